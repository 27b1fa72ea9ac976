"""The scan's fast paths give exactly what the code they replaced gave.

``analyze_file`` and the detectors share helpers that were made faster without changing any
result: ``dataflow.fast_walk``/``child_nodes`` (``ast.walk``/``ast.iter_child_nodes``), the
per-scope statement listing, node index and last reads, the text prefilters that try a regex
only where a match can start (``_site.anchored_search``, ``repo_search._mentions_npu``), the
tokenizer-free line classifier of the replacement fast path, ``const_value`` without
``ast.literal_eval`` for plain names and constants, and file_facts' walk restricted to the node
types it reads. Each is checked against its reference here, piece by piece, and then as a whole:
every registry example (FUSE and KEEP) and a sample of real files is analysed with the fast
paths on and with every one of them swapped back for its reference, and the outcomes must be
identical (findings, replacements, near misses, risks, repo facts, problems).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import io
import random
import re
import sys
import tokenize
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npufuse.patterns._site as S
from npufuse.patterns import rms_norm
from npufuse.patterns.registry import all_patterns
from npufuse.scan import dataflow, engine, replacement, repo_search
from npufuse.scan.dataflow import ModuleInfo

ROOT = Path(__file__).resolve().parents[1]
_BIG_CORPORA = [ROOT / "bench" / ".data" / "transformers", ROOT / ".venv" / "transformers-site" / "transformers" / "models"]


def _example_codes() -> list[str]:
    codes = []
    for p in all_patterns():
        for ex in [*p.FUSE, *p.KEEP]:
            codes.append(ex.code)
    return codes


def _sample_files(n_big: int = 12) -> list[Path]:
    """The bundled repos' files, plus (where this machine has one) a fixed sample of a
    transformers corpus (never committed: bench/scan.py --fetch-transformers unpacks it)."""
    files = sorted((ROOT / "examples").rglob("*.py")) + sorted((ROOT / "tests" / "fixtures" / "scan_repo").rglob("*.py"))
    for corpus in _BIG_CORPORA:
        if corpus.is_dir():
            big = sorted(p for p in corpus.rglob("modeling_*.py"))
            files += random.Random(7).sample(big, min(n_big, len(big)))
            break
    return files


def _texts() -> list[str]:
    out = _example_codes()
    for p in _sample_files(6):
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return [t for t in out if _parses(t)]


def _parses(text: str) -> bool:
    try:
        ast.parse(text)
        return True
    except (SyntaxError, ValueError):
        return False


TEXTS = _texts()


# -- reference implementations (the code the fast paths replaced) -------------------------------


def ref_walk_blocks(block: list[ast.stmt]) -> Iterator[tuple[list[ast.stmt], int, ast.stmt]]:
    for i, stmt in enumerate(block):
        yield block, i, stmt
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for name in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, name, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                yield from ref_walk_blocks(inner)
        for handler in getattr(stmt, "handlers", []) or []:
            yield from ref_walk_blocks(handler.body)
        for case in getattr(stmt, "cases", []) or []:
            yield from ref_walk_blocks(case.body)


def ref_parents(body: list[ast.stmt]) -> dict[int, ast.stmt | None]:
    parent: dict[int, ast.stmt | None] = {}

    def walk(block: list[ast.stmt], owner: ast.stmt | None) -> None:
        for stmt in block:
            parent[id(stmt)] = owner
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for name in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, name, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    walk(inner, stmt)
            for handler in getattr(stmt, "handlers", []) or []:
                walk(handler.body, stmt)
            for case in getattr(stmt, "cases", []) or []:
                walk(case.body, stmt)

    walk(body, None)
    return parent


def ref_statements_bfs(tree: ast.Module) -> Iterator[ast.AST]:
    from collections import deque

    todo: deque[ast.AST] = deque([tree])
    while todo:
        node = todo.popleft()
        yield node
        for name in ("body", "handlers", "orelse", "finalbody", "cases"):
            block = getattr(node, name, None)
            if type(block) is list:
                todo.extend(block)


def ref_const_value(node: ast.AST | None) -> object:
    try:
        return ast.literal_eval(node) if node is not None else ...
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return ...


def ref_iter_exprs_topdown(node: ast.AST) -> Iterator[ast.expr]:
    stack: list[ast.AST] = [node]
    while stack:
        n = stack.pop()
        if n is not node and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(n, ast.expr):
            yield n
        children = list(ast.iter_child_nodes(n))
        children.reverse()
        stack.extend(children)


def ref_root_text(text: str) -> bool:
    return ("sqrt" in text or "0.5" in text or ".5" in text) and bool(rms_norm._TORCH_ROOT.search(text))


# -- the pieces -------------------------------------------------------------------------------------


def _trees() -> list[ast.Module]:
    return [ast.parse(t) for t in TEXTS]


def test_fast_walk_and_child_nodes_are_ast_walk_and_iter_child_nodes() -> None:
    odd = [ast.Name(), ast.Subscript(value=ast.Name("x", ast.Load())), ast.keyword(arg="a"), ast.Constant(value=ast.Name("n"))]
    for tree in [*_trees(), *odd]:
        want = list(ast.walk(tree))
        got = list(dataflow.fast_walk(tree))
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want))
        for n in want:
            kids = list(ast.iter_child_nodes(n))
            mine = dataflow.child_nodes(n)
            assert len(kids) == len(mine) and all(a is b for a, b in zip(kids, mine))
        assert [id(n) for n in S.iter_exprs_topdown(tree)] == [id(n) for n in ref_iter_exprs_topdown(tree)]


def test_scalar_fields_never_hold_nodes() -> None:
    """fast_walk skips fields named in _SCALAR_FIELDS: in no node class do they hold a node."""
    for cls in [c for c in vars(ast).values() if isinstance(c, type) and issubclass(c, ast.AST)]:
        for f in getattr(cls, "_fields", ()):
            if f in dataflow._SCALAR_FIELDS:
                for tree in _trees():
                    for n in ast.walk(tree):
                        if type(n) is cls:
                            assert not isinstance(getattr(n, f, None), (ast.AST, list)), (cls.__name__, f)


def test_scope_listing_index_and_reads_match_the_references() -> None:
    for text in TEXTS:
        module = ModuleInfo.from_source("m.py", text, ast.parse(text))
        assert [id(n) for n in dataflow._statements_bfs(module.tree)] == [id(n) for n in ref_statements_bfs(module.tree)]
        for scope in module.scopes:
            want = list(ref_walk_blocks(scope.body))
            got = list(scope.statements())
            assert [(id(b), i, id(s)) for b, i, s in got] == [(id(b), i, id(s)) for b, i, s in want]
            parents = ref_parents(scope.body)
            listing, owners = scope.listing()
            assert [id(o) if o is not None else None for o in owners] == [id(parents[id(s)]) if parents[id(s)] is not None else None for _b, _i, s in listing]
            idx = S.stmt_index(scope)
            assert [id(s) for s in idx.stmts] == [id(s) for _b, _i, s in want]
            loads: dict[str, list[int]] = {}
            for n in ast.walk(scope.node):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                    loads.setdefault(n.id, []).append(n.lineno)
            assert scope.last_loads() == {k: max(v) for k, v in loads.items()}
            assert {k: [n.lineno for n in v] for k, v in scope.name_loads().items()} == loads
            calls = [n for n in ast.walk(scope.node) if isinstance(n, ast.Call)]
            assert [id(n) for n in scope.nodes().get(ast.Call, [])] == [id(n) for n in calls]
            for name in list(loads)[:5]:
                for line in (0, scope.node.lineno if hasattr(scope.node, "lineno") else 1, 10**6):
                    want_used = any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) and n.lineno > line for n in ast.walk(scope.node))
                    assert scope.uses_after(name, line) == want_used
                    assert (name in S._names_used_after(scope, line)) == want_used


def test_const_value_is_literal_eval() -> None:
    for tree in _trees():
        for n in ast.walk(tree):
            if isinstance(n, ast.expr):
                a, b = dataflow.const_value(n), ref_const_value(n)
                assert a == b or (a is ... and b is ...) or (a != a and b != b), ast.dump(n)
    assert dataflow.const_value(None) is ...


# -- text prefilters ---------------------------------------------------------------------------------

_ROOT_BITS = ["rsqrt", "sqrt(", "math.sqrt(", "np.sqrt(", "numpy.sqrt(", "x.sqrt()", "** -0.5", "**(-0.5)", "** 0.5", "**.5", "**-.5x",
              "pow(x, -0.5)", "pow(a(b), -0.5)", "pow(x, - .5 )", "0.5", ".5", " ", "\n", "_", "a", "(", ")", "*", "-", "\\b"]


@settings(max_examples=600, deadline=None)
@given(st.lists(st.sampled_from(_ROOT_BITS), max_size=12))
def test_root_text_is_the_regex(bits: list[str]) -> None:
    text = "".join(bits)
    assert rms_norm._root_text(text) == ref_root_text(text)


def test_root_text_fast_path_is_on_and_exact_on_real_text() -> None:
    # an edited _TORCH_ROOT switches the fast path off (the anchors are derived from this regex)
    assert rms_norm._ROOT_FAST
    for text in TEXTS:
        for piece in [text, *text.splitlines()]:
            assert rms_norm._root_text(piece) == ref_root_text(piece)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="npuNPUiat_ 1.\n(", max_size=40))
def test_mentions_npu_is_the_regex(text: str) -> None:
    assert repo_search._mentions_npu(text) == (repo_search._NPU_TEXT.search(text) is not None)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["foo", "bar", "f", " ", "(", "\n", "xfoo", "foo_", "#", "foo (", "bar\n("]), max_size=10))
def test_anchored_search_is_search(bits: list[str]) -> None:
    text = "".join(bits)
    rx = re.compile(r"\b(?:bar|foo)\s*\(")
    assert S.anchored_search(rx, text, ("bar", "foo")) == (rx.search(text) is not None)


def test_file_facts_reads_the_same_with_the_restricted_walk(monkeypatch) -> None:
    for text in TEXTS + ["import torch_npu\nimport os\nif os.environ.get('USE_NPU_FUSION'):\n    x = torch_npu.npu_rms_norm(a, b)\n"]:
        module = ModuleInfo.from_source("m.py", text, ast.parse(text))
        fast = repo_search.file_facts(module)
        monkeypatch.setattr(repo_search, "_FACT_TYPES", None)
        module = ModuleInfo.from_source("m.py", text, ast.parse(text))
        slow = repo_search.file_facts(module)
        monkeypatch.undo()
        assert dataclasses.asdict(fast) == dataclasses.asdict(slow)


# -- the replacement's line classifier ----------------------------------------------------------------

_ODD_SPANS = [
    "x = f(a,\n      b)\n", "x = '(' + \"[\"\n", "y = 1  # (\n", "    # c\n    x = 1\n", "x = (\n\n    1)\n", "a = 's\n", "x = )\n",
    "x = (1,\n", "if a:\n        b = 1\n    c = 2\n", 's = """a\nb"""\n', "x = 1\n\n", "  \n", "#only\n", "a = {'k': [1,\n 2]}\n",
    "f(x)[0]\n", "x = 'a' 'b' \"#\"\n", "x = \\\n 1\n", "x = 'é'\n", "x = 1\r\n", "\tx = 1\n", "x = 1\x0c\n",
]


def _spans(text: str, rng: random.Random, n: int) -> Iterator[str]:
    lines = text.splitlines(keepends=True)
    for _ in range(n if lines else 0):
        a = rng.randrange(len(lines))
        yield "".join(lines[a : a + rng.choice([1, 2, 3, 5, 9])])


def test_plain_classifier_agrees_with_the_tokenizer() -> None:
    rng = random.Random(3)
    cases = list(_ODD_SPANS)
    for text in TEXTS:
        cases += list(_spans(text, rng, 40))
    covered = 0
    for case in cases:
        fast = replacement._classify_plain(case)
        if fast is replacement._UNCOVERED:
            continue
        covered += 1
        assert fast == replacement._classify_tokens(case), repr(case)
    assert covered > len(cases) // 2  # the fast path is the common one


# -- all of it, on and off -------------------------------------------------------------------------------


def _reference_paths(monkeypatch) -> None:
    """Swap every fast path back for the code it replaced (module attributes looked up at call time)."""
    walkers = {"fast_walk": ast.walk, "child_nodes": lambda n: list(ast.iter_child_nodes(n)), "const_value": ref_const_value}
    fast = {attr: getattr(dataflow, attr) for attr in walkers}
    for name, mod in list(sys.modules.items()):
        if name.startswith("npufuse.") and mod is not None:
            for attr, ref in walkers.items():
                if getattr(mod, attr, None) is fast[attr]:
                    monkeypatch.setattr(mod, attr, ref)
    monkeypatch.setattr(dataflow, "_block_list", lambda body: (list(ref_walk_blocks(body)), [ref_parents(body)[id(s)] for _b, _i, s in ref_walk_blocks(body)]))
    monkeypatch.setattr(dataflow, "_statements_bfs", ref_statements_bfs)
    monkeypatch.setattr(S, "iter_exprs_topdown", ref_iter_exprs_topdown)
    monkeypatch.setattr(S, "anchored_search", lambda rx, text, anchors: rx.search(text) is not None)
    monkeypatch.setattr(rms_norm, "_ROOT_FAST", False)
    monkeypatch.setattr(repo_search, "_mentions_npu", lambda src: repo_search._NPU_TEXT.search(src) is not None)
    monkeypatch.setattr(repo_search, "_FACT_TYPES", None)
    monkeypatch.setattr(replacement, "_classify_plain", lambda text: replacement._UNCOVERED)
    import npufuse.patterns.attention as attention

    monkeypatch.setattr(attention, "_shallow_copy", copy.copy)


def _outcome(o: engine.FileOutcome) -> dict[str, Any]:
    return {
        "parsed": o.parsed, "lines": o.lines, "failures": [f.to_json() for f in o.failures], "near": o.near_misses,
        "hits": [(h.finding.to_json(), h.context, h.local_risks, h.code, h.body) for h in o.hits],
        "facts": dataclasses.asdict(o.facts) if o.facts is not None else None, "source": o.source is not None,
    }


def _analyze_all(paths: list[tuple[Path, str]]) -> list[dict[str, Any]]:
    patterns = all_patterns()
    return [_outcome(engine.analyze_file(root, rel, patterns, engine.ScanOptions())) for root, rel in paths]


def test_every_example_and_sample_file_analyses_the_same_with_the_fast_paths_off(tmp_path, monkeypatch) -> None:
    paths: list[tuple[Path, str]] = []
    for k, code in enumerate(_example_codes()):
        (tmp_path / f"ex{k}.py").write_text(code, encoding="utf-8")
        paths.append((tmp_path, f"ex{k}.py"))
    for p in _sample_files():
        paths.append((p.parent, p.name))
    fast = _analyze_all(paths)
    assert sum(len(o["hits"]) for o in fast) > 10  # the sample does exercise the detectors
    _reference_paths(monkeypatch)
    slow = _analyze_all(paths)
    for (root, rel), a, b in zip(paths, fast, slow):
        assert a == b, f"{root / rel}: the fast paths change the outcome"


def test_reference_switch_reaches_the_detectors(monkeypatch) -> None:
    """The on/off comparison above is only worth something if the swap reaches the modules
    that call the helpers: every npufuse module binding fast_walk gets the reference."""
    import npufuse.patterns.attention as attention
    import npufuse.patterns.swiglu as swiglu

    _reference_paths(monkeypatch)
    assert attention.fast_walk is ast.walk and swiglu.fast_walk is ast.walk and S.fast_walk is ast.walk
    assert replacement._classify("x = 1\n") == ["logical"]  # through the tokenizer now


def test_tokenizer_classify_reference_is_unchanged() -> None:
    # _classify_tokens is the original _classify: spot-check it against tokenize directly
    kinds = replacement._classify_tokens("x = (\n    1)\n\n# c\ny = 2\n")
    assert kinds == ["logical", "cont", "blank", "comment", "logical"]
    assert list(tokenize.generate_tokens(io.StringIO("x = 1\n").readline))


def test_lone_backslash_files_are_near_misses_not_candidates(tmp_path) -> None:
    body = "import torch\n\n\ndef f(self, x):\n    variance = x.pow(2).mean(-1, keepdim=True)\n    x = x * torch.rsqrt(variance + self.eps)\n    return self.weight * x\n"
    (tmp_path / "ok.py").write_text(body)
    (tmp_path / "bad.py").write_text(body.replace("import torch\n", "import torch\n\\\nimport os\n", 1))
    (tmp_path / "str.py").write_text(body + "s = 'a\\\\'\n")  # a backslash in a string: nothing to refuse
    # a lone backslash before a blank line: libcst reproduces that file, so apply rewrites it
    (tmp_path / "blank.py").write_text(body.replace("import torch\n", "import torch\n\\\n", 1))
    patterns = all_patterns()
    out = {name: engine.analyze_file(tmp_path, f"{name}.py", patterns, engine.ScanOptions()) for name in ("ok", "bad", "str", "blank")}
    for name in ("ok", "str", "blank"):
        assert [h.finding.pattern for h in out[name].hits] == ["rms_norm"], name
    assert not out["bad"].hits
    assert [(m["pattern"], m["line"]) for m in out["bad"].near_misses] == [("rms_norm", 7)]
    assert "line 2 holds only a backslash continuation" in out["bad"].near_misses[0]["reason"]


@pytest.mark.parametrize("text", ["x = 1\n", "s = '\\\\'\n", "x = (1 +\n     2)\n"])
def test_apply_refuses_only_files_libcst_cannot_reproduce(text: str) -> None:
    assert engine._apply_refuses(text) == ""
    assert engine._apply_refuses("\\\n" + text).startswith("apply cannot rewrite this file")
