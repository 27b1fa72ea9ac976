"""The shortcuts the per-detector wrapper (patterns/base.py) takes give what the plain code gave.

* ``_compiled.may_compile``: a module whose text cannot name ``torch.jit.script`` is not walked
  for TorchScript-compiled functions; on every example, sample file and crafted alias the
  compiled set is the one the ungated walk finds.
* ``base._called_more_often``: the original span is parsed first and only calls on a ``self``
  chain both spans make are unparsed; the answer is the plain implementation's (kept here as
  the reference) on crafted spans and on every finding the registry's detectors yield.
"""

from __future__ import annotations

import ast
import textwrap

import pytest

from npufuse.patterns import _compiled, base
from npufuse.patterns.base import Finding
from npufuse.patterns.registry import all_patterns
from npufuse.scan.dataflow import ModuleInfo

from test_scan_prefilter import _sample_files, _texts


def _module(code: str) -> ModuleInfo:
    return ModuleInfo.from_source("m.py", code, ast.parse(code))


def _compiled_ungated(module: ModuleInfo, monkeypatch: pytest.MonkeyPatch) -> tuple[set[str], set[str]]:
    with monkeypatch.context() as m:
        m.setattr(_compiled, "may_compile", lambda source: "jit" in source)
        module.__dict__.pop("_npufuse_compiled", None)
        out = _compiled._compiled(module)
        module.__dict__.pop("_npufuse_compiled", None)
    return out


ALIASES = [
    "import torch\n\n@torch.jit.script\ndef f(x):\n    return g(x)\n\ndef g(x):\n    return x\n",
    "from torch.jit import script as s\nimport torch\n\n@s\ndef f(x):\n    return x\n",
    "from torch import jit as J\n\n@J.script\ndef f(x):\n    return x\n",
    "import torch.jit as tj\n\ndef f(x):\n    return x\n\nk = tj.script(f)\n",
    "import torch\n\nclass M(torch.nn.Module):\n    def forward(self, x):\n        return x\n\nm = torch.jit.script(M())\n",
    "import torch\n\nclass M(torch.nn.Module):\n    @torch.jit.script_method\n    def forward(self, x):\n        return x\n",
    # an identifier spelled with a fullwidth letter: NFKC makes it `script`
    "import torch\n\n@torch.jit.\uff53cript\ndef f(x):\n    return x\n",
    # `jit` and `script` only inside other words: nothing compiled
    "import torch\n# transcript of a jit-free run\ndef f(x):\n    return torch.jit.is_tracing()\n",
]


@pytest.mark.parametrize("code", ALIASES)
def test_may_compile_keeps_every_compiled_function(code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _module(code)
    expected = _compiled_ungated(module, monkeypatch)
    assert _compiled._compiled(module) == expected
    if expected != (set(), set()):
        assert _compiled.may_compile(code)


def test_may_compile_gate_on_aliases() -> None:
    assert _compiled.may_compile(ALIASES[1]) and _compiled.may_compile(ALIASES[6])
    assert not _compiled.may_compile(ALIASES[7])  # the walk is skipped: no `script` word
    assert not _compiled.may_compile("def f(x):\n    return x\n")


def test_may_compile_same_sets_on_examples_and_files(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = _texts() + ALIASES
    assert len(texts) > 20
    for code in texts:
        module = _module(code)
        assert _compiled._compiled(module) == _compiled_ungated(module, monkeypatch)


# -- _called_more_often --------------------------------------------------------------------------


def _module_calls_ref(stmts: list[ast.stmt]) -> dict[str, int]:
    total: dict[str, int] = {}

    def add(counts: dict[str, int]) -> None:
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v

    for st in stmts:
        if isinstance(st, ast.If):
            add(_module_calls_in_ref(st.test))
            a, b = _module_calls_ref(st.body), _module_calls_ref(st.orelse)
            add({k: max(a.get(k, 0), b.get(k, 0)) for k in a.keys() | b.keys()})
        else:
            add(_module_calls_in_ref(st))
    return total


def _self_call_key(n: ast.AST) -> str | None:
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
        b = n.func.value
        while isinstance(b, ast.Attribute):
            b = b.value
        if isinstance(b, ast.Name) and b.id == "self":
            return ast.unparse(n)
    return None


def _module_calls_in_ref(node: ast.AST) -> dict[str, int]:
    """Calls on the costliest path: a conditional expression runs its test and its busier arm (s40), by recursion;
    the keys in ast.walk's order of first occurrence (the first call found is reported)."""

    def count(n: ast.AST) -> dict[str, int]:
        if isinstance(n, ast.IfExp):
            out = count(n.test)
            a, b = count(n.body), count(n.orelse)
            for k in a.keys() | b.keys():
                out[k] = out.get(k, 0) + max(a.get(k, 0), b.get(k, 0))
            return out
        out = {}
        key = _self_call_key(n)
        if key is not None:
            out[key] = 1
        for child in ast.iter_child_nodes(n):
            for k, v in count(child).items():
                out[k] = out.get(k, 0) + v
        return out

    counts = count(node)
    order = [k for k in (_self_call_key(n) for n in ast.walk(node)) if k is not None]
    return {k: counts[k] for k in dict.fromkeys(order) if counts.get(k, 0) > 0}


def _called_more_often_ref(module: ModuleInfo, f: Finding) -> str | None:
    """base._called_more_often before its shortcuts (the reference)."""
    if "self." not in f.fused:
        return None
    try:
        fused = ast.parse(f.fused).body
        original = ast.parse(textwrap.dedent("".join(module.lines[f.line - 1 : f.end_line]))).body
    except (SyntaxError, ValueError):
        return None
    # a view-only method of the class (base._pure_methods, s34) gives the same value when called again: not counted
    pure = base._pure_methods(module, f.qualname)
    before = _module_calls_ref(original)
    for call, n in _module_calls_ref(fused).items():
        if n > before.get(call, 0) and before.get(call, 0) > 0 and not any(call.startswith(p + "(") for p in pure):
            return call
    return None


SPANS = [
    # (original statements, fused code)
    ("h = self.w1(x) * self.w3(x)\n", "h = torch_npu.npu_swiglu(torch.cat([self.w1(x), self.w3(x)], -1))\nh = h + self.w1(x)\n"),
    ("h = self.w12(x)\n", "a = self.w12(x)\nb = self.w12(x)\n"),
    ("h = self .w12(x)\n", "a = self.w12(x)\nb = self.w12(x)\n"),  # `self .w12`: no "self." in the text
    ("h = (self\n     .w12(x))\n", "a = self.w12(x)\nb = self.w12(x)\n"),
    ("if c:\n    h = self.a(x)\nelse:\n    h = self.a(x) + self.a(y)\n", "h = self.a(x) + self.a(y) + self.a(z)\n"),
    ("h = self.a.b(x)\n", "h = self.a.b(x) + self.a.b(x)\n"),
    ("h = self.a.b(x)\n", "h = self.a.c(x) + self.a.c(x)\n"),  # a call the original never makes
    ("h = self.layers[0](x)\n", "h = self.layers[0](x) + self.layers[0](x)\n"),  # not a plain chain
    ("h = f(x)\n", "h = self.g(x) + self.g(x)\n"),
    ("h = self.a(x)\n", "h = self.a(x) +\n"),  # fused code that does not parse
    # s40: one arm of a conditional expression runs (nested too); its test always runs
    ("h = self.a(x)\n", "h = (self.a(x) if c else self.a(x) + 1) if y else self.a(x)\n"),
    ("h = self.a(x)\n", "h = self.a(x) if self.a(x) is not None else None\n"),
    ("h = self.a(x)\n", "h = self.a(x) + (self.a(x) if c else 0)\n"),
]


@pytest.mark.parametrize("original,fused", SPANS)
def test_called_more_often_matches_reference(original: str, fused: str) -> None:
    code = "class M:\n    def forward(self, x, y, z, c):\n" + textwrap.indent(original, " " * 8) + "        return h\n"
    module = _module(code)
    n = original.count("\n")
    f = Finding("swiglu", "M.forward", 3, 2 + n, {}, fused, "x")
    assert base._called_more_often(module, f) == _called_more_often_ref(module, f)


def test_called_more_often_flags_a_doubled_call() -> None:
    code = "class M:\n    def forward(self, x):\n        h = self.w12(x)\n        return h\n"
    f = Finding("swiglu", "M.forward", 3, 3, {}, "a = self.w12(x)\nh = a + self.w12(x)\n", "x")
    assert base._called_more_often(_module(code), f) == "self.w12(x)"


def test_called_more_often_matches_reference_on_every_detector_finding() -> None:
    """Every finding the registry's detectors yield (before the wrapper judges it) on the
    examples and sample files: the shortcut version answers as the reference does."""
    seen = 0
    for code in _texts():
        module = _module(code)
        for pattern in all_patterns():
            raw = pattern.detect.__wrapped__  # the detector itself, without base's wrapper
            for scope in module.scopes:
                try:
                    results = list(raw(pattern, module, scope))
                except Exception:
                    continue
                for r in results:
                    if isinstance(r, Finding) and isinstance(r.fused, str):
                        seen += 1
                        assert base._called_more_often(module, r) == _called_more_often_ref(module, r), (pattern.id, r.line)
    assert seen > 50


# -- Pattern.SCOPE_WORDS -------------------------------------------------------------------------


class _Needle(base.Pattern):
    """A toy pattern: a near miss on every scope it is handed, and a record of them."""

    id = "needle_probe"
    api = "torch_npu.npu_needle"
    title = "probe"
    SCOPE_WORDS = ("needle",)

    def __init__(self) -> None:
        self.seen: list[str] = []

    def detect(self, module, scope):
        self.seen.append(scope.qualname)
        yield base.NearMiss(self.id, scope.qualname, getattr(scope.node, "lineno", 1), getattr(scope.node, "lineno", 1), "probe")


_NEEDLE_CODE = '''import torch


def has(x):
    return x.needle()


def hasnt(x):
    return x + 1


class C:
    def m(self, x):
        return torch.needle_sum(x)
'''


def test_scan_hands_a_pattern_only_scopes_with_its_words(tmp_path) -> None:
    from npufuse.scan import engine

    (tmp_path / "a.py").write_text(_NEEDLE_CODE)
    probe = _Needle()
    out = engine.analyze_file(tmp_path, "a.py", [probe], engine.ScanOptions())
    assert probe.seen == ["<module>", "has", "C.m"]  # `hasnt` holds no `needle`
    assert sorted(m["qualname"] for m in out.near_misses) == ["<module>", "C.m", "has"]


def test_scan_gates_text_outside_ascii_by_its_nfkd_form(tmp_path) -> None:
    """A file with text outside ASCII is gated scope by scope: a scope naming the word in
    fullwidth letters (Python reads ``ｎｅｅｄｌｅ`` as ``needle``) is still handed over, one
    without the word in any spelling is not (before, no scope of such a file was gated)."""
    from npufuse.scan import engine

    extra = ("\n\ndef caf\u00e9(x):\n    return x\n"
             "\n\ndef wide(x):\n    return x.\uff4e\uff45\uff45\uff44\uff4c\uff45()\n"
             "\n\ndef acc\u0065\u0301nt(x):  # combining accent\n    return x.needle()\n")
    (tmp_path / "a.py").write_text(_NEEDLE_CODE + extra, encoding="utf-8")
    probe = _Needle()
    engine.analyze_file(tmp_path, "a.py", [probe], engine.ScanOptions())
    assert probe.seen == ["<module>", "has", "C.m", "wide", "acc\u00e9nt"]  # not `hasnt`, not `caf\u00e9`


def test_text_outside_ascii_that_folds_to_no_ascii_is_gated_as_written(tmp_path) -> None:
    """Text outside ASCII whose NFKD form holds no ASCII character (CJK, dashes, arrows: most
    such files) cannot spell a word by decomposing: a scope lacking the word as written is skipped,
    ``<module>`` included (a file with any text outside ASCII kept it before); scopes holding the
    word are still handed over. A file with a character that does decompose to ASCII (``\u2026``
    is "...", ``\u00e9`` is "e" and an accent) keeps ``<module>`` as before."""
    from npufuse.scan import engine

    cjk = '"""\u6a21\u578b \u2014 \u6ce8\u610f\u529b \u2192 \u8f93\u51fa"""\nimport torch\n\n\ndef f(x):\n    """\u4e2d\u6587"""\n    return x + 1\n'
    assert not engine.folds_to_ascii(_module(cjk))
    for odd in ("\u2026", "\u00e9", "\uff4e", "\u00b2"):
        assert engine.folds_to_ascii(_module(cjk + f"# {odd}\n")), odd
    assert not engine.folds_to_ascii(_module("import torch\n"))
    # no scope holds the word: none handed over (before: <module>)
    (tmp_path / "a.py").write_text(cjk, encoding="utf-8")
    probe = _Needle()
    engine.analyze_file(tmp_path, "a.py", [probe], engine.ScanOptions())
    assert probe.seen == []
    # the same file with a scope naming the word: that scope (and <module>, whose text holds it)
    (tmp_path / "a.py").write_text(cjk + "\n\ndef has(x):\n    \"\"\"\u4e2d\"\"\"\n    return x.needle()\n", encoding="utf-8")
    probe = _Needle()
    out = engine.analyze_file(tmp_path, "a.py", [probe], engine.ScanOptions())
    assert probe.seen == ["<module>", "has"]
    assert sorted(m["qualname"] for m in out.near_misses) == ["<module>", "has"]
    # a character decomposing to ASCII: <module> is handed over as before, `f` still skipped
    (tmp_path / "a.py").write_text(cjk + "# \u2026\n", encoding="utf-8")
    probe = _Needle()
    engine.analyze_file(tmp_path, "a.py", [probe], engine.ScanOptions())
    assert probe.seen == ["<module>"]


def test_a_site_in_a_file_with_cjk_text_is_still_found(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real detectors on a file whose text outside ASCII folds to no ASCII: the eager
    attention and the rotate_half rope are found, gates on and off alike."""
    code = ('"""\u6ce8\u610f\u529b \u2014 \u65cb\u8f6c"""\nimport torch\n\n\n'
            'def attend(q, k, v):\n    """\u6ce8\u610f"""\n    s = torch.matmul(q, k.transpose(-2, -1)) / 8.0\n'
            '    p = torch.softmax(s, dim=-1)\n    return torch.matmul(p, v)\n\n\n'
            'def rotate_half(x):\n    x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n'
            '    return torch.cat((-x2, x1), dim=-1)\n\n\n'
            'def apply_rope(q, cos, sin):\n    """\u65cb\u8f6c"""\n    return (q * cos) + (rotate_half(q) * sin)\n')
    from npufuse.scan import engine

    assert not engine.folds_to_ascii(_module(code))
    on, off = _scan_both_ways(tmp_path, code, list(all_patterns()), monkeypatch)
    assert on == off
    assert {h[0] for h in on[0]} >= {"attention", "rope"}, on[0]


def test_an_import_alias_of_a_word_opens_the_gate(tmp_path) -> None:
    """``from m import needle as nd``: a scope calling ``nd(...)`` is handed over (detectors
    resolve calls through the module's aliases), one naming neither is not."""
    from npufuse.scan import engine

    code = "from m import needle as nd\n\n\ndef a(x):\n    return nd(x)\n\n\ndef b(x):\n    return x\n"
    (tmp_path / "a.py").write_text(code)
    probe = _Needle()
    engine.analyze_file(tmp_path, "a.py", [probe], engine.ScanOptions())
    assert probe.seen == ["<module>", "a"]


def _gated_out(module, scope, pattern: base.Pattern) -> bool:
    """Would the scan skip ``scope`` for ``pattern`` (engine.gate_words / gate_text)?"""
    from npufuse.scan import engine

    return engine.gated_out(module, scope, engine.gate_words(module, pattern))


def _declaration_violations(pattern: base.Pattern, texts: list[str]) -> list[tuple[str, str]]:
    """(qualname, first line of the code) of each scope the scan's gate skips for the pattern
    where its detector (unwrapped and ungated) still yields something."""
    words = pattern.SCOPE_WORDS
    assert words is not None
    detect = getattr(type(pattern).detect, "__wrapped__", type(pattern).detect)
    bad = []
    for code in texts:
        module = _module(code)
        for scope in module.scopes:
            if not _gated_out(module, scope, pattern):
                continue
            try:
                results = list(detect(pattern, module, scope))
            except Exception:
                continue  # the scan reports a detector error; not a question of the gate
            if results:
                bad.append((scope.qualname, code.splitlines()[0] if code else ""))
    return bad


def test_every_scope_words_declaration_holds_on_examples_and_files() -> None:
    """Per declared pattern, on every example of ANY pattern (a look-alike of another pattern is a near miss
    of this one) and the sample files: no scope the gate skips yields anything for the pattern. (Until s48 a
    second test ran the same check on the examples alone, a subset of these texts.)"""
    texts = _texts()
    assert set(_example_codes_all()) <= set(texts)  # every example parses: each one is among the texts
    declared = [p for p in all_patterns() if p.SCOPE_WORDS is not None]
    for p in declared:
        assert _declaration_violations(p, texts) == [], p.id


def test_a_false_scope_words_declaration_is_caught() -> None:
    class Liar(_Needle):
        id = "liar_probe"
        SCOPE_WORDS = ("needle",)

    assert _declaration_violations(Liar(), [_NEEDLE_CODE]) == [("hasnt", "import torch")]


def test_parsed_code_is_ast_parse_cached() -> None:
    code = "a = self.w1(x)\nb = a * 2\n"
    body = base.parsed_code(code)
    assert body is not None and ast.dump(ast.Module(body, [])) == ast.dump(ast.parse(code))
    assert base.parsed_code(code) is body  # the same statements: parsed once
    assert base.parsed_code("a = (\n") is None and base.parsed_code("a = 1\x00") is None


# -- every example, gates on and off ---------------------------------------------------------------


def _outcome_summary(out) -> tuple:
    """What a file contributes to scan.json, in comparable form: findings (span, params, fused
    code, guard, variant), near misses with their reasons, and failures."""
    hits = sorted((h.finding.pattern, h.finding.qualname, h.finding.line, h.finding.end_line, repr(h.finding.params),
                   h.finding.fused, h.finding.guard_tensor, h.finding.variant, h.finding.confidence, repr(h.body))
                  for h in out.hits)
    near = sorted((m["pattern"], m["qualname"], m["line"], m["end_line"], m["reason"]) for m in out.near_misses)
    return hits, near, sorted((f.kind, f.error) for f in out.failures)


def _scan_both_ways(tmp_path, code: str, patterns, monkeypatch: pytest.MonkeyPatch) -> tuple[tuple, tuple]:
    from npufuse.scan import engine

    (tmp_path / "example.py").write_text(code, encoding="utf-8")
    on = _outcome_summary(engine.analyze_file(tmp_path, "example.py", patterns, engine.ScanOptions()))
    with monkeypatch.context() as m:
        m.setattr(engine, "SCOPE_GATES", False)
        off = _outcome_summary(engine.analyze_file(tmp_path, "example.py", patterns, engine.ScanOptions()))
    return on, off


@pytest.mark.parametrize("pid", sorted(p.id for p in all_patterns()))
def test_every_example_scans_the_same_with_gates_on_and_off(pid: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each FUSE and KEEP example of the pattern, scanned by the engine with every detector: the
    same findings (params, fused code, replacement text) and the same near-miss reasons whether
    or not ``SCOPE_WORDS`` gates skip scopes. An example merged later that a word list does not
    cover fails here (and in the declaration check below)."""
    patterns = list(all_patterns())
    pattern = next(p for p in patterns if p.id == pid)
    examples = [*pattern.FUSE, *pattern.KEEP]
    for i, ex in enumerate(examples):
        on, off = _scan_both_ways(tmp_path, ex.code, patterns, monkeypatch)
        assert on == off, (pid, i, getattr(ex, "name", ""))


def _example_codes_all() -> list[str]:
    return [ex.code for p in all_patterns() for ex in [*p.FUSE, *p.KEEP]]


def test_gates_skip_detector_calls_on_the_examples() -> None:
    """The gates are not vacuous: on the examples some scopes are skipped for most declared
    patterns (a declaration that never skips anything would be dead weight)."""
    codes = _example_codes_all()
    declared = [p for p in all_patterns() if p.SCOPE_WORDS is not None]
    skipped = {p.id: 0 for p in declared}
    for code in codes:
        module = _module(code)
        for scope in module.scopes:
            for p in declared:
                skipped[p.id] += _gated_out(module, scope, p)
    assert sum(1 for n in skipped.values() if n > 0) >= len(declared) // 2, skipped


def test_gates_on_and_off_give_the_same_scan_of_sample_files(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    patterns = list(all_patterns())
    for path in _sample_files(6):
        try:
            code = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        on, off = _scan_both_ways(tmp_path, code, patterns, monkeypatch)
        assert on == off, str(path)


_ODD_TEXTS = [
    # text outside ASCII in docstrings, comments and identifiers; a fullwidth word; a \r\n file
    'import torch\n"""Modèle — ∑ notes"""\n\n\ndef f(x):\n    """é"""\n    return x * 2\n\n\ndef g(x):\n    return x.\uff57here(1)\n\n\ndef h(x):\n    return x\n',
    "import torch\r\n\r\n\r\ndef f(x):\r\n    # caf\u00e9\r\n    return x + 1\r\n\r\n\r\ndef g(x):\r\n    return x\r\n",
    "import torch\n\nclass A:\n    def f(self, x):\n        return torch.\uff53caled_dot_product_attention(x, x, x)\n\n    def g(self, x):\n        return x  # \u00e9\n",
    "from torch.optim import AdamW as W\n\n\ndef build(p):\n    return W(p)\n\n\ndef other(p):\n    return p\n",
    "x = 1\n\x0cdef f(a):\n    return a @ a\n",  # a form feed: lines cut differently by source_lines
]


def test_gates_on_and_off_give_the_same_scan_of_odd_texts(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Text outside ASCII (decomposed words, accents in docstrings), "\\r\\n" line ends, a form
    feed, an import alias of a word: the same scan with gates on and off, and some scope skipped."""
    from npufuse.scan import engine

    patterns = list(all_patterns())
    skipped = 0
    for code in _ODD_TEXTS:
        on, off = _scan_both_ways(tmp_path, code, patterns, monkeypatch)
        assert on == off, code[:40]
        module = _module(code)
        skipped += sum(engine.gated_out(module, s, engine.gate_words(module, p)) for s in module.scopes for p in patterns)
    assert skipped > 10


def test_lines_with_leaves_out_lines_outside_ascii_that_fold_to_no_ascii() -> None:
    """``dataflow.lines_with`` lists the lines outside ASCII only where a name could differ from
    its spelling (a character decomposing to ASCII, or a word outside ASCII); the call named by
    the word is still on a listed line and found by ``calls_on_lines``. The config-switch lines
    of repo_search follow the same rule."""
    from npufuse.scan import dataflow, repo_search

    code = '"""\u6ce8\u610f"""\nimport torch\n\n\ndef f(x):\n    """\u4e2d\u6587 \u2014 \u2192"""\n    return g(x)\n'
    module = _module(code)
    lines = dataflow.lines_with(module, ("g",))
    assert lines == [7]
    assert [c.func.id for c in dataflow.calls_on_lines(module.tree, lines)] == ["g"]
    assert dataflow.lines_with(_module(code + "# \u2026\n"), ("g",)) == [1, 6, 7, 8]  # "..." folds: kept as before
    assert dataflow.lines_with(_module(code), ("\u6ce8\u610f",)) == [1, 6]  # a word outside ASCII: kept
    cfg = code + "\n\ndef h(config):\n    # \u4e2d\n    return config.use_fused_op\n"
    assert repo_search._switch_word_lines(cfg, False) == [12]
    assert repo_search._switch_word_lines(cfg, True) == [1, 6, 11, 12]
    facts = repo_search.file_facts(_module(cfg))
    assert [s["name"] for s in facts.switches] == ["use_fused_op"]


def test_module_calls_keep_the_branches_order() -> None:
    """``base._module_calls`` lists the calls of an ``if``/``else`` in the branches' order (a set
    union of the keys made the call a near miss names depend on the string hash seed)."""
    stmts = ast.parse("if c:\n    self.a(x)\n    self.c(x)\nelse:\n    self.b(x)\n    self.a(x)\n    self.d(x)\n").body
    assert list(base._module_calls(stmts)) == ["self.a(x)", "self.c(x)", "self.b(x)", "self.d(x)"]


@pytest.mark.parametrize("src", ["f", "x.f = 1", "\u00e9f x", "_f", "ff = f", "f (", "af f", "\u4e2df", "1f", "(f)", "g = f\n", "self.f", "f(f)", "f\n(", "#f\nf(", ""])
def test_written_uncalled_function_is_the_lookbehind_regex(src: str) -> None:
    """attention._written_uncalled for a function: the lookbehind ``(?<![\\w.])`` checked by hand
    gives the regex's answer (name after a letter, digit, ``_`` or ``.``; at the start; outside ASCII)."""
    import re

    from npufuse.patterns import attention

    module = ModuleInfo("m.py", src, ast.Module(body=[], type_ignores=[]))
    assert attention._written_uncalled(module, "f", False) == (re.search(r"(?<![\w.])f\b(?!\s*\()", src) is not None)
