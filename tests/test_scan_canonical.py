"""The canonical layer: equivalent spellings give one answer (issue 14)."""

from __future__ import annotations

import ast

import pytest

from npufuse.scan import canonical
from npufuse.scan.dataflow import ModuleInfo

HEADER = "import torch as th\nimport torch.nn.functional as F\nfrom torch import nn\nfrom torch.nn import functional as G\n"


def _module(body: str) -> ModuleInfo:
    return ModuleInfo.from_source("m.py", HEADER + body)


def _expr(module: ModuleInfo, line: int = -1) -> ast.expr:
    stmt = module.tree.body[line]
    return stmt.value  # type: ignore[attr-defined]


@pytest.mark.parametrize("text", ["x * x", "x ** 2", "x**2.0", "x.pow(2)", "th.pow(x, 2)", "x.square()", "th.square(x)"])
def test_square_spellings_give_the_operand(text):
    m = _module(f"y = {text}\n")
    got = canonical.square_operand(m, _expr(m))
    assert isinstance(got, ast.Name) and got.id == "x"


@pytest.mark.parametrize("text", ["x * y", "x ** 3", "x.pow(0.5)", "th.pow(x, 3)", "x.abs()", "x * x.T"])
def test_non_squares_are_not_squares(text):
    m = _module(f"y = {text}\n")
    assert canonical.square_operand(m, _expr(m)) is None


@pytest.mark.parametrize("text,want", [
    ("th.rms_norm", "torch.nn.functional.rms_norm"),
    ("F.rms_norm", "torch.nn.functional.rms_norm"),
    ("G.rms_norm", "torch.nn.functional.rms_norm"),
    ("nn.functional.rms_norm", "torch.nn.functional.rms_norm"),
    ("nn.RMSNorm", "torch.nn.RMSNorm"),
    ("th.nn.modules.normalization.RMSNorm", "torch.nn.RMSNorm"),
    ("th.concat", "torch.cat"),
])
def test_aliases_and_synonyms_resolve(text, want):
    m = _module(f"y = {text}\n")
    assert canonical.api(m, _expr(m)) == want


@pytest.mark.parametrize("binding,first,second,spelling", [
    ("x1, x2 = x.chunk(2, dim=-1)", "x1", "x2", "chunk"),
    ("x1, x2 = th.chunk(x, 2, -1)", "x1", "x2", "chunk"),
    ("a, b = x.split(x.shape[-1] // 2, dim=-1)", "a", "b", "split"),
    ("a, b = x.unbind(-1)", "a", "b", "unbind"),
    ("a = x[..., : x.shape[-1] // 2]\n    b = x[..., x.shape[-1] // 2 :]", "a", "b", "slice"),
    ("a, b = x[..., :d], x[..., d:]", "a", "b", "slice"),
])
def test_halves_spellings(binding, first, second, spelling):
    m = _module(f"def f(x):\n    {binding}\n    return a_use\n")
    scope = next(s for s in m.scopes if s.qualname == "f")
    line = scope.node.body[-1].lineno
    for name, index in ((first, 0), (second, 1)):
        h = canonical.half_of(m, scope, ast.Name(name, ast.Load()), before_line=line)
        assert h is not None and h.index == index and h.spelling == spelling and ast.unparse(h.source) == "x"


@pytest.mark.parametrize("binding", ["a, b = x.chunk(2, dim=1)", "a, b = x.chunk(3, -1)", "a, b, c = x.chunk(3, -1)", "a = x[..., ::2]\n    b = x[..., 1::2]", "a = x[..., 1:5:2]"])
def test_not_halves(binding):
    # (s34: ``x[..., h:u]`` is the second half of the prefix ``x[..., :u]`` to this pre-classifier; the rope
    # detector proves u == 2 * h at run time, see test_detect_s34_rope.py)
    m = _module(f"def f(x):\n    {binding}\n    return a\n")
    scope = next(s for s in m.scopes if s.qualname == "f")
    line = scope.node.body[-1].lineno
    assert canonical.half_of(m, scope, ast.Name("a", ast.Load()), before_line=line) is None
