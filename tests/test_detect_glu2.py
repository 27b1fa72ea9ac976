"""canonical.if_else_binding / canonical.filled_halves (rope helper spellings) and the benchmark's
matching of a candidate that dispatches to two patterns."""
from __future__ import annotations

import ast

from npufuse.scan import canonical


def _fn(src: str) -> ast.FunctionDef:
    fn = ast.parse(src).body[0]
    assert isinstance(fn, ast.FunctionDef)
    return fn


def test_filled_halves_is_the_cat_of_the_two_slices() -> None:
    fn = _fn("def r(x):\n    out = torch.empty_like(x)\n    out[..., :h] = -b\n    out[..., h:] = a\n    return out\n")
    got = canonical.filled_halves(fn, fn.body[-1])  # type: ignore[arg-type]
    assert got is not None and ast.unparse(got) == "torch.cat((-b, a), dim=-1)"


def test_filled_lanes_is_the_stack_flattened() -> None:
    fn = _fn("def r(x):\n    out = th.zeros_like(x)\n    out[..., ::2] = -o\n    out[..., 1::2] = e\n    return out\n")
    got = canonical.filled_halves(fn, fn.body[-1])  # type: ignore[arg-type]
    assert got is not None and ast.unparse(got) == "th.stack((-o, e), dim=-1).flatten(-2)"


def test_filled_halves_refuses_other_fills() -> None:
    for body in ("    out[..., :h] = -b\n    out[..., h + 1:] = a\n",  # slices not a partition
                 "    out[..., :h] = -b\n    out[..., h:] = out[..., :h]\n",  # reads out
                 "    out[..., 1::2] = -b\n    out[..., 0::2] = a\n",  # odd lanes first
                 "    out[:h] = -b\n    out[h:] = a\n"):  # not the last dim
        fn = _fn("def r(x):\n    out = torch.empty_like(x)\n" + body + "    return out\n")
        assert canonical.filled_halves(fn, fn.body[-1]) is None, body  # type: ignore[arg-type]


def test_if_else_binding() -> None:
    fn = _fn("def f(c):\n    if c:\n        g = a\n    else:\n        g = b\n    y = g(x)\n")
    got = canonical.if_else_binding(fn.body, "g", 6)
    assert got is not None and ast.unparse(got) == "a if c else b"
    fn2 = _fn("def f(c):\n    if c:\n        g = a\n    else:\n        g = b\n    g = d\n    y = g(x)\n")
    assert canonical.if_else_binding(fn2.body, "g", 7) is None
