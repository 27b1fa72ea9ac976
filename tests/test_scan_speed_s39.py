"""s39 cold-scan cuts (helper speed39): each cut gives the same answers and skips work on the common path."""

from __future__ import annotations

import pytest

from npufuse.patterns import _guard_arms, base
from npufuse.patterns._guard_arms import contradicted_guard
from npufuse.patterns.base import Finding
from npufuse.scan.dataflow import ModuleInfo

_PLAIN = '''
def f(x, fast):
    y = x * 2
    return y
'''

_ARM = '''
def f(x, fast):
    if fast:
        y = x * 2
    else:
        y = x * 3
    return y
'''


def _scope(code: str) -> object:
    module = ModuleInfo.from_source("example.py", code)
    return next(s for s in module.scopes if s.qualname == "f")


def _finding(fused: str, line: int) -> Finding:
    return Finding("rms_norm", "f", line, line, {}, fused, "x")


def test_contradicted_guard_parses_no_fused_text_for_a_span_in_no_if_arm(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[str] = []
    real = _guard_arms.ast.parse

    def counted(code: str, *a: object, **k: object) -> object:
        parsed.append(code)
        return real(code, *a, **k)

    scope, finding = _scope(_PLAIN), _finding("if not fast:\n    y = x\nelse:\n    y = x * 2", 3)
    base._PARSED_CODE.pop(finding.fused, None)
    with monkeypatch.context() as m:
        m.setattr(_guard_arms.ast, "parse", counted)
        answer = contradicted_guard(scope, finding)
    assert answer is None and parsed == []


def test_contradicted_guard_still_reads_the_arm() -> None:
    scope = _scope(_ARM)
    assert "false in the taken arm" in contradicted_guard(scope, _finding("if not fast:\n    y = x\nelse:\n    y = x * 2", 4))
    assert "false in the `else` arm" in contradicted_guard(scope, _finding("if fast:\n    y = x\nelse:\n    y = x * 3", 6))
    assert contradicted_guard(scope, _finding("if not fast:\n    y = x\nelse:\n    y = fused(x)", 4)) is None
    assert contradicted_guard(scope, _finding("if not fast:\n    y = (", 4)) is None  # fused text that does not parse


def _sample_texts() -> list[str]:
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "src" / "npufuse" / "patterns").glob("*.py"))[:6] + sorted((root / "examples").rglob("*.py"))[:20]
    return [p.read_text(encoding="utf-8") for p in files]


_IMPORTS = '''
from . import a, b as bee
from .x import *
from ..y.z import (c, d as dee)
from os import path
import torch.nn as nn

class Top:
    class Inner:
        pass

def f():
    from .lazy import late
    class Local:
        pass

try:
    from .fast import kernel
except ImportError:
    class Top:
        pass
'''


def test_index_gathers_relative_imports_and_every_class_in_walk_order() -> None:
    import ast

    from npufuse.scan.dataflow import _statements_bfs

    for text in [_IMPORTS, *_sample_texts()]:
        module = ModuleInfo.from_source("m.py", text)
        walked = list(_statements_bfs(module.tree))
        # what the numeric probe's gate and rope's class lookup each walked the statements for
        assert module.relative_imports == {a.asname or a.name for n in walked if isinstance(n, ast.ImportFrom) and n.level
                                           for a in n.names if a.name != "*"}
        assert module.all_classes == [n for n in walked if type(n) is ast.ClassDef]
    module = ModuleInfo.from_source("m.py", _IMPORTS)
    assert module.relative_imports == {"a", "bee", "c", "dee", "late", "kernel"}
    assert [c.name for c in module.all_classes] == ["Top", "Inner", "Local", "Top"]
    assert module.aliases["path"] == "os.path" and module.aliases["nn"] == "torch.nn"


_NESTED_IMPORTS = '''
import os
try:
    from .fast import kernel as K
except ImportError:
    from .slow import kernel as K
def f():
    from pkg import layers
    match x:
        case 1:
            import a.b as ab
if True:
    from ..up import kernel
'''


def test_imported_reads_statements_only_and_finds_the_same_import(monkeypatch: pytest.MonkeyPatch) -> None:
    import ast

    from npufuse.scan import repo_facts
    from npufuse.scan.dataflow import _statements_bfs

    for text in [_NESTED_IMPORTS, *_sample_texts()]:
        tree = ast.parse(text)
        imports = (ast.Import, ast.ImportFrom)
        assert [n for n in ast.walk(tree) if isinstance(n, imports)] == [n for n in _statements_bfs(tree) if isinstance(n, imports)]
    tree = ast.parse(_NESTED_IMPORTS)

    def refuse(node: object) -> None:
        raise AssertionError("a whole-tree walk for an import")

    with monkeypatch.context() as m:
        m.setattr(repo_facts.ast, "walk", refuse)
        found = [repo_facts._imported(tree, "p/q/m.py", n) for n in ("K", "kernel", "layers.Dense", "ab.C", "missing")]
    assert found == [("p.q.fast", "kernel"), ("p.up", "kernel"), ("pkg.layers", "Dense"), ("a.b", "C"), None]


def test_rope_pair_of_unparses_only_calls_that_can_name_cat_or_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    import ast

    from npufuse.patterns import rope

    def call(text: str) -> ast.Call:
        node = ast.parse(text, mode="eval").body
        assert isinstance(node, ast.Call)
        return node

    kept = {"torch.cat((-x2, x1), dim=-1)": rope._CAT, "torch.stack([a, b], -1)": rope._STACK, "torch.concat((a, b), -1)": rope._CAT}
    for text, names in kept.items():
        assert rope._pair_of(call(text), names) is not None
    assert rope._pair_of(call("torch.cat((a, b), dim=0)"), rope._CAT) is None

    def refuse(node: object) -> None:
        raise AssertionError("unparsed a callee that names neither cat nor stack")

    with monkeypatch.context() as m:
        m.setattr(rope.ast, "unparse", refuse)
        for text in ("x.view(2, 3)", "self.proj(x)", "f(x)((a, b), -1)", "fns[0]((a, b), -1)", "(lambda: torch.cat)()((a, b), -1)"):
            for names in (rope._CAT, rope._STACK):
                assert rope._pair_of(call(text), names) is None


def test_add_rms_norm_foreign_definition_asks_once_per_file_and_name(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    from npufuse.patterns import add_rms_norm
    from npufuse.scan import repo_facts

    root = Path(str(tmp_path))
    (root / "pkg").mkdir()
    (root / "pkg" / "layers.py").write_text("class Norm:\n    def forward(self, x):\n        return x\n")
    text = "import torch\nfrom pkg.layers import Norm\nfrom torch.nn import LayerNorm\n"
    (root / "m.py").write_text(text)
    module = ModuleInfo.from_source("m.py", text)
    repo_facts.attach_root(module, root)
    asked: list[str] = []
    real = add_rms_norm._find_foreign_definition

    def counted(m: ModuleInfo, name: str) -> object:
        asked.append(name)
        return real(m, name)

    monkeypatch.setattr(add_rms_norm, "_find_foreign_definition", counted)
    for _ in range(3):
        found = add_rms_norm._foreign_definition(module, "Norm")
        assert found is not None and getattr(found[1], "name", None) == "Norm"
        assert add_rms_norm._foreign_definition(module, "LayerNorm") is None  # torch: no package of the repo
        assert add_rms_norm._foreign_definition(module, "Missing") is None  # not imported
    assert asked == ["Norm", "LayerNorm", "Missing"]


_RESPELLED = '''
import torch


class Block:
    def forward(self, x):
        y = x + 1
        return torch.sigmoid(y)

    def other(self, x):
        for i in range(3):
            x = x * 2
        return x


def f(a, b):
    if a is not None:
        with ctx():
            return torch.unsqueeze(a, 1) + b.sigmoid()
    return b
'''


def test_tensor_calls_on_lines_skips_statements_inside_a_statement_off_the_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    import ast

    from npufuse.scan import dataflow

    def expected(tree: ast.Module, hits: list[int]) -> list[ast.Call]:
        # what the walk of every statement gave: the calls of the statements spanning a line, in that order
        out = []
        for stmt in dataflow._statements_bfs(tree):
            lo = getattr(stmt, "lineno", None)
            if type(stmt) is ast.Module or (lo is not None and not any(lo <= h <= (stmt.end_lineno or lo) for h in hits)):
                continue
            for name in (f for f in dataflow.child_fields(type(stmt)) if f not in dataflow._BLOCK_NAMES):
                v = getattr(stmt, name, None)
                for root in (v if type(v) is list else (v,)):
                    if isinstance(root, ast.AST):
                        out += [n for n in dataflow.fast_walk(root) if type(n) is ast.Call]
        return out

    for text in [_RESPELLED, *_sample_texts()]:
        tree = ast.parse(text)
        hits = dataflow.tensor_call_lines(text)[0]
        assert dataflow._tensor_calls_on_lines(tree, hits) == expected(tree, hits)

    def refuse(tree: object) -> None:
        raise AssertionError("every statement of the tree visited")

    tree = ast.parse(_RESPELLED)
    with monkeypatch.context() as m:
        m.setattr(dataflow, "_statements_bfs", refuse)
        found = dataflow._tensor_calls_on_lines(tree, dataflow.tensor_call_lines(_RESPELLED)[0])
    assert [ast.unparse(c.func) for c in found] == ["torch.sigmoid", "ctx", "torch.unsqueeze", "b.sigmoid"]


_TOKEN_TEXTS = ["x.mean(-1)", "self.norm(x)", "h = self.input_layernorm(h)", "a, b = torch.var_mean(x)", "torch.linalg.vector_norm(x)",
                "y = x ** 2", "f(**kwargs)", "summary = 1", "_sum(x)", "sum_(x)", "norm(x)", "self.normalize(x)", "myself.norm(x)",
                "self. norm(x)", "xnorm + norm_x", "rsqrt", "pow", "return x", "", "self.norm", "cfg.norm_eps", "x.sqrt()"]


def test_stat_or_root_token_by_hand_equals_the_regex() -> None:
    from npufuse.scan import numeric_probe

    texts = _TOKEN_TEXTS + [t for t in _sample_texts() if t.isascii()]
    texts += [line for t in texts for line in t.splitlines()]
    for text in texts:
        assert numeric_probe._holds_stat_or_root_token(text) == (numeric_probe._STAT_OR_ROOT_TOKEN.search(text) is not None), text
