"""s41 (issue 14 item 3): a pool worker leaves to the parent only the detector calls that need
torch (the numeric probe), not the whole file (``engine.finish_deferred``).

A worker is simulated in this process: ``engine._DEFERRING`` on and ``engine.defer_import``
answering as in a worker without torch (it raises ``LeftToParent``). The worker's outcome lists
the calls left (``pending``); the parent parses the file again and runs just those calls. The
finished outcome must equal a plain ``analyze_file`` of the file in every detail and order
(findings, replacement texts, near misses with reasons, risks, repo facts, problems), on every
rms_norm and rope example (the two detectors that call the probe) and on files holding several
probed functions between other findings; a deferral outside a detector call, a file changed
since, or a call that fails in the parent falls back to analysing the whole file; a finished
outcome is cached only where neither the worker nor the parent read other files of the repo.
Also: the repo-text regexes made cheaper (``repo_facts.may_register_on_another`` gated by the
call's word, ``attention._SELF_ATTR_CTOR`` possessive) answer as before.
"""

from __future__ import annotations

import random
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from npufuse.patterns import attention
from npufuse.patterns import rms_norm as R
from npufuse.patterns.registry import all_patterns
from npufuse.scan import engine, repo_facts

from test_scan_prefilter import _texts

PATTERNS = list(all_patterns())
OPTIONS = engine.ScanOptions()


def _summary(o: engine.FileOutcome) -> tuple[Any, ...]:
    hits = [(h.finding.pattern, h.finding.qualname, h.finding.line, h.finding.end_line, repr(h.finding.params), h.finding.fused,
             h.finding.guard_tensor, h.finding.variant, repr(h.body), h.code, repr(h.local_risks), repr(h.context)) for h in o.hits]
    near = [tuple(sorted(m.items())) for m in o.near_misses]
    return hits, near, [(f.kind, f.error) for f in o.failures], o.sha256, o.lines, o.source, repr(o.facts), o.deferred, o.pending


def _in_worker(monkeypatch: pytest.MonkeyPatch, root: Path, rel: str) -> engine.FileOutcome:
    def defer_import(module: Any, name: str) -> bool:  # a worker without torch
        module.__dict__["_npufuse_deferred"] = True
        raise engine.LeftToParent(name)

    with monkeypatch.context() as m:
        m.setattr(engine, "_DEFERRING", True)
        m.setattr(engine, "defer_import", defer_import)
        return engine.analyze_file(root, rel, PATTERNS, OPTIONS)


def test_the_parent_runs_only_the_calls_left_and_gets_the_plain_outcome(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    codes = [ex.code for p in PATTERNS if p.id in ("rms_norm", "rope") for ex in (*p.FUSE, *p.KEEP)]
    finished = 0
    for i, code in enumerate(codes):
        rel = f"ex{i}.py"
        (tmp_path / rel).write_text(textwrap.dedent(code))
        plain = engine.analyze_file(tmp_path, rel, PATTERNS, OPTIONS)
        worker = _in_worker(monkeypatch, tmp_path, rel)
        if not worker.deferred:
            assert _summary(worker) == _summary(plain), rel
            continue
        assert worker.pending, rel  # the probe runs inside a detector call: only that call is left
        whole = []
        monkeypatch.setattr(engine, "analyze_file", lambda *a, **k: whole.append(a) or engine._analyze_file(*a, **k))
        done = engine.finish_deferred(tmp_path, worker, PATTERNS, OPTIONS)
        monkeypatch.undo()
        assert not whole, rel  # no whole-file analysis in the parent
        assert _summary(done) == _summary(plain), rel
        finished += 1
    assert finished >= 10  # the probe examples do reach the probe


def test_several_calls_left_in_one_file_keep_their_places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # several probed functions and other detectors' findings in one file: each insertion shifts the later ones
    code = "\n\n".join(textwrap.dedent(c) for c in (R._PROBE_VECTOR_NORM, R._PROBE_VAR, R._PROBE_NORM_METHOD, R.RmsNorm.FUSE[0].code))
    (tmp_path / "m.py").write_text(code)
    plain = engine.analyze_file(tmp_path, "m.py", PATTERNS, OPTIONS)
    worker = _in_worker(monkeypatch, tmp_path, "m.py")
    assert len(worker.pending) >= 2
    assert _summary(engine.finish_deferred(tmp_path, worker, PATTERNS, OPTIONS)) == _summary(plain)


def test_a_file_changed_since_the_worker_read_it_is_analysed_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "m.py").write_text(textwrap.dedent(R._PROBE_VECTOR_NORM))
    worker = _in_worker(monkeypatch, tmp_path, "m.py")
    assert worker.deferred and worker.pending
    (tmp_path / "m.py").write_text(textwrap.dedent(R._PROBE_VAR))
    plain = engine.analyze_file(tmp_path, "m.py", PATTERNS, OPTIONS)
    assert _summary(engine.finish_deferred(tmp_path, worker, PATTERNS, OPTIONS)) == _summary(plain)


def test_a_deferral_outside_a_detector_call_leaves_the_whole_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "m.py").write_text(textwrap.dedent(R._PROBE_VECTOR_NORM))
    plain = engine.analyze_file(tmp_path, "m.py", PATTERNS, OPTIONS)

    def facts(module: Any) -> Any:
        raise engine.LeftToParent("torch")

    with monkeypatch.context() as m:
        m.setattr(engine, "_DEFERRING", True)
        m.setattr(engine.repo_search, "file_facts", facts)
        worker = engine.analyze_file(tmp_path, "m.py", PATTERNS, OPTIONS)
    assert worker.deferred and not worker.pending and not worker.hits
    assert _summary(engine.finish_deferred(tmp_path, worker, PATTERNS, OPTIONS)) == _summary(plain)


def test_a_call_that_fails_in_the_parent_falls_back_to_the_whole_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "m.py").write_text(textwrap.dedent(R._PROBE_VECTOR_NORM))
    worker = _in_worker(monkeypatch, tmp_path, "m.py")
    assert worker.pending
    calls = []
    real = engine._analyze_file

    def spy(*a: Any, **k: Any) -> engine.FileOutcome:
        calls.append(bool(a[4:] or k))
        out = real(*a, **k)
        if a[4:] or k:  # the parent's partial run: make it report a problem
            out.failures.append(engine.Failure("m.py", "detector_error", "boom"))
        return out

    monkeypatch.setattr(engine, "_analyze_file", spy)
    done = engine.finish_deferred(tmp_path, worker, PATTERNS, OPTIONS)
    monkeypatch.undo()
    assert calls == [True, False]  # the partial run, then the whole file
    assert _summary(done) == _summary(engine.analyze_file(tmp_path, "m.py", PATTERNS, OPTIONS))


# --- the repo-text regexes: the same answers, cheaper --------------------------------------------

_OLD_SELF_ATTR_CTOR = re.compile(r"self\.(\w+)\s*(?::[^=\n]*)?=\s*(\w+)\s*\(")
_TOKENS = ["self", ".", "x", "norm_1", " ", "  ", "\n", ":", "Dict[str, int]", "=", "==", "Foo", "Bar.Baz", "(", ")", "cls",
           "register_buffer", "setattr", ",", "myself", "é", "\t", "_", "'", '"', "alibi"]


def _soups(n: int) -> list[str]:
    rnd = random.Random(41)
    return ["".join(rnd.choice(_TOKENS) for _ in range(rnd.randint(1, 40))) for _ in range(n)]


def _register_on_another_ungated(text: str) -> bool:
    """may_register_on_another before s41: the two regexes on every text"""
    from types import SimpleNamespace

    from npufuse.scan.dataflow import folds_to_ascii

    if not (text.isascii() or not folds_to_ascii(SimpleNamespace(source=text))):  # type: ignore[arg-type]
        return True
    return text.count("register_buffer") > len(repo_facts._SELF_REGISTER_BUFFER.findall(text)) \
        or text.count("setattr") > len(repo_facts._SELF_SETATTR.findall(text))


def test_the_possessive_attribute_constructor_regex_finds_what_the_backtracking_one_found() -> None:
    crafted = ["self.a = Foo(", "self.a: Dict[str, int] = Foo (", "self.a(x)", "self.a.b = Foo(", "self.a = Foo.Bar(",
               "self.a =\n  Foo(", "self.a : int=Foo(", "self.ab = cd (e)\nself.f = g(", "self.a: x == Foo("]
    for text in [*crafted, *_soups(4000), *_texts()]:
        assert attention._SELF_ATTR_CTOR.findall(text) == _OLD_SELF_ATTR_CTOR.findall(text)


def test_may_register_on_another_answers_as_the_ungated_counts(tmp_path: Path) -> None:
    crafted = ["x = 1\n", "self.register_buffer('a', t)\n", "m.register_buffer('a', t)\n", "setattr(self, 'a', t)\n",
               "setattr(m, 'a', t)\n", "# setattr only in a comment\n", "myself.register_buffer('a', t)\n", "cls . register_buffer('a', t)\n"]
    texts = [*crafted, *_soups(2000), *_texts()[:40]]
    for i, text in enumerate(texts):
        rel = f"f{i}.py"
        (tmp_path / rel).write_text(text, encoding="utf-8")
        assert repo_facts.may_register_on_another(tmp_path, rel) == _register_on_another_ungated(
            (tmp_path / rel).read_text(encoding="utf-8", errors="replace")), text
    repo_facts.reset()


def test_a_text_without_the_calls_runs_no_regex(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []

    class Spy:
        def __init__(self, rx: re.Pattern[str]) -> None:
            self.rx = rx

        def findall(self, text: str) -> list[Any]:
            ran.append(self.rx.pattern)
            return self.rx.findall(text)

    monkeypatch.setattr(repo_facts, "_SELF_REGISTER_BUFFER", Spy(repo_facts._SELF_REGISTER_BUFFER))
    monkeypatch.setattr(repo_facts, "_SELF_SETATTR", Spy(repo_facts._SELF_SETATTR))
    (tmp_path / "a.py").write_text("def f(x):\n    return setattr(x, 'y', 1)\n")  # setattr only: no register_buffer regex
    assert repo_facts.may_register_on_another(tmp_path, "a.py") is True
    assert ran == [repo_facts._SELF_SETATTR.rx.pattern]
    repo_facts.reset()
    # and the attribute-constructor regex is possessive (no backtracking through a called name)
    assert "\\w++" in attention._SELF_ATTR_CTOR.pattern


@pytest.mark.parametrize("worker_read_others", [True, False])
def test_a_finished_outcome_is_cached_only_where_neither_process_read_other_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, worker_read_others: bool) -> None:
    (tmp_path / "m.py").write_text(textwrap.dedent(R._PROBE_VECTOR_NORM))
    put: list[engine.FileOutcome] = []
    cache = type("C", (), {"put": lambda self, o: put.append(o)})()

    def defer_import(module: Any, name: str) -> bool:
        module.__dict__["_npufuse_deferred"] = True
        raise engine.LeftToParent(name)

    with monkeypatch.context() as m:  # the worker: its process's record says whether it read other files
        m.setattr(engine, "_DEFERRING", True)
        m.setattr(engine, "defer_import", defer_import)
        m.setattr(engine.repo_facts, "reads_other_files", lambda root, rel: worker_read_others)
        worker = engine._analyze_and_store(tmp_path, "m.py", PATTERNS, OPTIONS, cache)
    assert worker.deferred and worker.pending and put == []
    monkeypatch.setattr(engine.repo_facts, "reads_other_files", lambda root, rel: False)  # the parent's record
    done = engine._analyze_and_store(tmp_path, "m.py", PATTERNS, OPTIONS, cache, worker)
    assert not done.deferred and done.hits
    assert put == ([] if worker_read_others else [done])
