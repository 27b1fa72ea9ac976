"""s50 perf50 (issue 14 item 3): exact cuts of the analysis' CPU.

* ``dataflow.WALK_MEMO``: within one file's detection a root walked to its end is read from its walk's queue the
  next time. The same nodes in the same order as ``ast.walk``, the memo dropped after the file and never kept
  across the respellings ``ModuleInfo.from_source`` makes to a tree it indexes (another file, mid-detection).
* regexes searched by a literal instead of a leading ``\\b`` / lookbehind (``re`` has no literal to look for
  there and ran its whole matcher at every position of the file): the same matches as the start code's.
* attention's softmax word test lowers the text only where the word is not there as written.

The reference of every rewritten regex is the start code's pattern, written out here.
"""

from __future__ import annotations

import ast
import re
from re import _compiler, _parser  # (the compiler the re module uses; sre_compile is its deprecated alias)
from pathlib import Path

import pytest

from npufuse.patterns import _compiled, _library_norm
from npufuse.scan import dataflow, engine, repo_facts, repo_search
from npufuse.scan.dataflow import ModuleInfo, fast_walk

from test_scan_prefilter import _texts

# (the start code's pattern, the module's compiled pattern now)
_REWRITTEN = [
    (r"\bscript(?:_method)?\b", _compiled._SCRIPT_WORD),
    (r"\b(?:autocast|GradScaler)\s*\(", repo_search._AMP_CALL),
    (r"\bself\s*\.\s*config(?![\w])", repo_search._READS_SELF_CONFIG),
    (r"(?<!\w)rms_norm(?!\w)", _library_norm._RMS_NORM_WORD),
    (r"(?<![\w.])(?:self|cls)\s*\.\s*register_buffer", repo_facts._SELF_REGISTER_BUFFER),
]

# the edges of each boundary: a word character, a dot, a line start, non-ASCII word characters, `self`/`cls` inside
# longer names, several matches on a line
_EDGES = """script x.script _script script_method scriptx jit.script(f) @torch.jit.script_method
éscript ΣGradScaler( autocast( autocast (x) torch.autocast(  my_autocast( GradScaler  ( xGradScaler(
self.config self .config myself.config self.configure x.self.config ſelf.config (self).config
rms_norm F.rms_norm(x) my_rms_norm rms_norm2 .rms_norm rms_normé ærms_norm
self.register_buffer cls . register_buffer x.self.register_buffer myself.register_buffer
    self.register_buffer("a", a); cls.register_buffer("b", b)
"""


def _corpus() -> list[str]:
    texts = [_EDGES, _EDGES.replace("\n", "\r\n")]
    texts += _texts()
    data = Path(__file__).resolve().parents[1] / "bench" / ".data" / "transformers"
    if data.is_dir():  # the speed corpus where present (gitignored): 40 of its files
        texts += [p.read_text(encoding="utf-8") for p in sorted(data.rglob("modeling_*.py"))[::14]]
    return texts


@pytest.mark.parametrize("old, new", _REWRITTEN, ids=[r[0][:24] for r in _REWRITTEN])
def test_rewritten_regexes_match_what_the_start_code_matched(old: str, new: re.Pattern[str]) -> None:
    ref = re.compile(old)
    for text in _corpus():
        assert [(m.span(), m.groups()) for m in new.finditer(text)] == [(m.span(), m.groups()) for m in ref.finditer(text)]


def _literal_led(rx: re.Pattern[str]) -> bool:
    """Does ``re`` search this pattern by a literal prefix or a set of first characters (not the whole matcher at
    every position)? Its compiled info block says so."""
    parsed = _parser.parse(rx.pattern, rx.flags)  # type: ignore[attr-defined]
    prefix, _skip, _all = _compiler._get_literal_prefix(parsed, rx.flags)  # type: ignore[attr-defined]
    return bool(prefix) or _compiler._get_charset_prefix(parsed, rx.flags) is not None  # type: ignore[attr-defined]


@pytest.mark.parametrize("new", [r[1] for r in _REWRITTEN], ids=[r[0][:24] for r in _REWRITTEN])
def test_rewritten_regexes_are_searched_by_their_first_characters(new: re.Pattern[str]) -> None:
    # (fails on the start code: a leading \b or lookbehind gives re nothing to search for)
    assert _literal_led(new)


def test_partial_attribute_regex_matches_what_the_start_code_matched() -> None:
    """fused_optimizer's ``self.<a> = partial(..)`` reader builds its regex per module (the alias names)."""
    for names in ("", "P|fp"):
        tail = (f"|{names}" if names else "") + r")\s*\("
        ref = re.compile(r"\bself\s*\.\s*([A-Za-z_]\w*)\s*=\s*(?:[\w.]*\bpartial" + tail)
        new = re.compile(r"self(?<!\wself)\s*\.\s*([A-Za-z_]\w*)\s*=\s*(?:[\w.]*\bpartial" + tail)
        for text in _corpus() + ["self.f = partial(g)\nmyself.f = partial(g)\nx.self.opt = functools.partial(A)\nself . o = P(x)"]:
            assert [(m.span(), m.groups()) for m in new.finditer(text)] == [(m.span(), m.groups()) for m in ref.finditer(text)]
    from npufuse.patterns import fused_optimizer

    module = ModuleInfo.from_source("m.py", "from functools import partial as P\nclass A:\n    def __init__(self):\n"
                                    "        self.opt_fn = P(torch.optim.AdamW, lr=1)\n        myself.x = partial(f)\n")
    assert fused_optimizer._s40_partial_attribute_words(module) == ("self.opt_fn",)


def test_lone_backslash_search_needs_a_backslash_before_a_line_end() -> None:
    for text in _corpus() + ["x = 1\n\\\ny = 2\n", "x = 1\r\n  \\\r\ny = 2\r\n", "s = '\\\\n'\n"]:
        if engine._LONE_BACKSLASH.search(text) is not None:
            assert "\\\n" in text or "\\\r" in text
    assert engine._apply_refuses("x = 1\n\\\ny = 2\n") != ""
    assert engine._apply_refuses("s = 'a\\\\nb'\nx = 1\n") == ""


def test_walk_memo_gives_ast_walks_order_and_is_dropped_after_the_file(tmp_path: Path) -> None:
    text = "import torch\nclass A:\n    def f(self, x):\n        y = x * 2\n        return [z + 1 for z in y]\n"
    tree = ast.parse(text)
    assert dataflow.WALK_MEMO is None
    dataflow.WALK_MEMO = {}
    try:
        first = list(fast_walk(tree))
        assert id(tree) in dataflow.WALK_MEMO  # walked to its end: kept
        again = list(fast_walk(tree))
        fn = tree.body[1].body[0]
        part = next(iter(fast_walk(fn)))  # a walk stopped early is not kept
        assert part is fn and id(fn) not in dataflow.WALK_MEMO
        assert list(fast_walk(fn)) == list(ast.walk(fn))
    finally:
        dataflow.WALK_MEMO = None
    assert first == again == list(ast.walk(tree))
    (tmp_path / "m.py").write_text(text)
    engine.analyze_file(tmp_path, "m.py", engine.registry_patterns(), engine.ScanOptions())
    assert dataflow.WALK_MEMO is None  # (fails on the start code: no memo at all)


def test_indexing_another_file_mid_detection_keeps_no_walk_of_a_tree_it_respells() -> None:
    """``canonicalise_unbound_tensor_methods`` replaces call nodes' children: a walk of the tree from before it would
    list the old children. ``from_source`` suspends the memo while it respells and indexes."""
    text = "import torch\n\ndef f(x):\n    return torch.Tensor.softmax(x, -1)\n"
    outer = {}
    dataflow.WALK_MEMO = outer
    try:
        module = ModuleInfo.from_source("m.py", text)
        assert dataflow.WALK_MEMO is outer and not outer  # back as it was, nothing kept from the indexing
        walked = list(fast_walk(module.tree))
    finally:
        dataflow.WALK_MEMO = None
    assert walked == list(ast.walk(module.tree))
    assert any(isinstance(n, ast.Attribute) and n.attr == "softmax" and isinstance(n.value, ast.Name) and n.value.id == "x"
               for n in walked)  # the respelled call x.softmax(-1)


def test_the_analysis_is_the_same_with_and_without_the_walk_memo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    patterns = engine.registry_patterns()
    files = []
    for i, text in enumerate(_texts()[:120]):
        (tmp_path / f"f{i}.py").write_text(text, encoding="utf-8")
        files.append(f"f{i}.py")

    def outcome(rel: str) -> tuple:
        o = engine.analyze_file(tmp_path, rel, patterns, engine.ScanOptions())
        hits = [(h.finding.pattern, h.finding.line, h.finding.end_line, repr(h.finding.params), h.finding.fused, repr(h.body)) for h in o.hits]
        return hits, [(m["pattern"], m["line"], m["reason"]) for m in o.near_misses], [(f.kind, f.error) for f in o.failures]

    with_memo = [outcome(rel) for rel in files]
    # every walk made afresh, as the start code did: the walker never hands its queue to the memo
    walk = dataflow._walk
    monkeypatch.setattr(dataflow, "_walk", lambda node, memo: walk(node, None))
    without = [outcome(rel) for rel in files]
    assert with_memo == without


def test_softmax_word_test_answers_as_the_lowered_text() -> None:
    for text in _corpus() + ["SoftMax", "x.softmax(", "ſoftmax", "İsoftmax", "torch.Softmax(dim=-1)"]:
        assert ("softmax" in text or "softmax" in text.lower()) == ("softmax" in text.lower())


def test_respelling_a_copy_mid_detection_keeps_no_walk_of_it() -> None:
    """_guard_arms_s46audit respells a copy of fused code while a file's detectors run: the walk that finds its calls
    is of a tree the respelling then changes, so it is not kept."""
    tree = ast.parse("import torch\ny = torch.softmax(x, dim=-1)\n")
    outer: dict = {}
    dataflow.WALK_MEMO = outer
    try:
        assert dataflow.canonicalise_tensor_functions(tree) == 1
        assert dataflow.WALK_MEMO is outer and id(tree) not in outer
        walked = list(fast_walk(tree))
    finally:
        dataflow.WALK_MEMO = None
    assert walked == list(ast.walk(tree))
    assert ast.unparse(tree).endswith("y = x.softmax(dim=-1)")
