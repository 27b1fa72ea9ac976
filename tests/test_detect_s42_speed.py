"""s42 (issue 14 item 3): cuts of the cold scan's CPU that must not change what it finds.

A forked pool worker keeps each analysed file's tree and caches alive instead of freeing them
(``engine._keep_alive``; it ends with ``os._exit``, which frees nothing), within a budget of
source bytes, and moves what it keeps out of the cyclic collector's reach (``gc.freeze``). The
outcome of a file must be the same kept or not; past the budget nothing more is kept; the
parent of a pooled scan keeps nothing, and a pooled scan finds what an in-process one does.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Iterator

import pytest

from npufuse.patterns.registry import all_patterns
from npufuse.scan import engine

from test_detect_s41_speed import _summary  # every detail of an outcome, in order
from test_scan_prefilter import _texts

PATTERNS = list(all_patterns())
OPTIONS = engine.ScanOptions()


@pytest.fixture
def keeping() -> Iterator[None]:
    """This process as a forked worker with a budget; afterwards it keeps nothing again."""
    saved = engine._KEEP_BUDGET[0]
    try:
        yield
    finally:
        engine._KEEP_BUDGET[0] = saved
        engine._KEPT.clear()
        gc.unfreeze()


def test_a_kept_analysis_finds_what_a_freed_one_does(tmp_path: Path, keeping: None) -> None:
    texts = _texts()[::7]
    assert len(texts) > 20
    for i, text in enumerate(texts):
        (tmp_path / f"f{i}.py").write_text(text, encoding="utf-8")
    freed = [_summary(engine.analyze_file(tmp_path, f"f{i}.py", PATTERNS, OPTIONS)) for i in range(len(texts))]
    assert engine._KEPT == []
    engine._KEEP_BUDGET[0] = 1 << 40
    frozen = gc.get_freeze_count()
    kept = [_summary(engine.analyze_file(tmp_path, f"f{i}.py", PATTERNS, OPTIONS)) for i in range(len(texts))]
    assert kept == freed
    # every file but an empty one (``_keep_alive`` never keeps 0 bytes: the stride may land on an empty __init__.py)
    assert [m.path for m in engine._KEPT] == [f"f{i}.py" for i, text in enumerate(texts) if text]
    assert gc.get_freeze_count() > frozen  # what is kept is out of the collector's reach


def test_nothing_is_kept_past_the_budget(tmp_path: Path, keeping: None) -> None:
    small, large = "x = 1\n", "def f(a):\n    return a * 2\n" * 20
    (tmp_path / "small.py").write_text(small, encoding="utf-8")
    (tmp_path / "large.py").write_text(large, encoding="utf-8")
    engine._KEEP_BUDGET[0] = len(small) + 3
    engine.analyze_file(tmp_path, "large.py", PATTERNS, OPTIONS)  # over the budget: freed as before
    assert engine._KEPT == []
    engine.analyze_file(tmp_path, "small.py", PATTERNS, OPTIONS)
    assert [m.path for m in engine._KEPT] == ["small.py"] and engine._KEEP_BUDGET[0] == 3
    engine.analyze_file(tmp_path, "small.py", PATTERNS, OPTIONS)  # the 3 bytes left hold no second file
    assert len(engine._KEPT) == 1
    (tmp_path / "empty.py").write_text("", encoding="utf-8")
    engine._KEEP_BUDGET[0] = 0
    frozen = gc.get_freeze_count()
    engine.analyze_file(tmp_path, "empty.py", PATTERNS, OPTIONS)  # no budget: not even an empty file, no freeze
    assert len(engine._KEPT) == 1 and gc.get_freeze_count() == frozen


def test_the_budget_is_shared_by_the_workers_and_bounded() -> None:
    one, four = engine._keep_budget(1), engine._keep_budget(4)
    assert 0 < four <= one // 4 + 1
    assert one * engine._KEPT_PER_SOURCE_BYTE <= engine._KEEP_TOTAL_BYTES


def test_a_pooled_scan_finds_what_an_in_process_one_does_and_its_parent_keeps_nothing(tmp_path: Path) -> None:
    texts = _texts()
    n = max(engine.PARALLEL_MIN_FILES, 60)
    for i in range(n):
        (tmp_path / f"m{i:03d}.py").write_text(texts[i % len(texts)], encoding="utf-8")
    files = [f"m{i:03d}.py" for i in range(n)]
    alone = engine._analyze_all(tmp_path, files, PATTERNS, OPTIONS, 1, None)
    pooled = engine._analyze_all(tmp_path, files, PATTERNS, OPTIONS, 2, None)
    strip = lambda o: _summary(o)[:-2]  # noqa: E731 (deferral bookkeeping differs by design)
    assert [strip(o) for o in pooled] == [strip(o) for o in alone]
    assert engine._KEPT == [] and engine._KEEP_BUDGET[0] == 0


# -- exact cuts of repeated work ------------------------------------------------------------------------

def _modules() -> list[Any]:
    from npufuse.scan.dataflow import ModuleInfo

    return [ModuleInfo.from_source(f"t{i}.py", text) for i, text in enumerate(_texts())]


def test_torch_name_is_memoised_and_answers_as_the_alias_scan() -> None:
    from npufuse.patterns import _site

    for module in _modules():
        want = next((local for local, full in module.aliases.items() if full == "torch"), None)
        assert _site.torch_name(module) == want
        assert module.__dict__["_npufuse_torch_name"] == want  # asked again: no second scan
        assert _site.torch_name(module) == want
    bare = _modules()[0]
    bare.aliases.clear()
    bare.__dict__.pop("_npufuse_torch_name", None)
    assert _site.torch_name(bare) is None and _site.torch_name(bare) is None  # None is remembered too


def _attribute_stores_by_ast_walk(module: Any, class_name: str) -> dict[str, list[tuple[int, int]]]:
    """Where each ``self.<attr> = value`` of the class's methods stores, in ``ast.walk`` order (what
    ``bound_callee._attribute_stores`` walked before s42)."""
    import ast

    methods = [it for it in module.classes[class_name].body if isinstance(it, (ast.FunctionDef, ast.AsyncFunctionDef))]
    out: dict[str, list[tuple[int, int]]] = {}
    for n in (n for m in methods for n in ast.walk(m)):
        pairs = [(t, n.value) for t in n.targets] if isinstance(n, ast.Assign) else \
            [(n.target, n.value)] if isinstance(n, ast.AnnAssign) and n.value is not None else []
        while pairs:
            t, v = pairs.pop(0)
            if isinstance(t, (ast.Tuple, ast.List)):
                # tuple stores (s45 review): elements paired by position with a written-out tuple of the same
                # length, else each element stands at the value's own place (its value is not known)
                if isinstance(v, (ast.Tuple, ast.List)) and len(v.elts) == len(t.elts) \
                        and not any(isinstance(e, ast.Starred) for e in (*t.elts, *v.elts)):
                    pairs += list(zip(t.elts, v.elts))
                else:
                    pairs += [(e.value if isinstance(e, ast.Starred) else e, v) for e in t.elts]
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.setdefault(t.attr, []).append((v.lineno, v.col_offset))
    return out


def test_class_attribute_stores_walk_fast_in_ast_walk_order(monkeypatch: pytest.MonkeyPatch) -> None:
    import ast

    from npufuse.scan import bound_callee

    modules = _modules()
    want = {(i, c): _attribute_stores_by_ast_walk(m, c) for i, m in enumerate(modules) for c in m.classes}
    assert sum(len(v) for v in want.values()) > 50

    def no_walk(node: Any) -> Any:
        raise AssertionError("ast.walk: three times fast_walk's cost on every class asked about")

    monkeypatch.setattr(ast, "walk", no_walk)
    for (i, c), stores in want.items():
        for attr, where in stores.items():
            got = bound_callee.attribute_values(modules[i], c, attr)
            assert [(v.lineno, v.col_offset) for v in got] == where
