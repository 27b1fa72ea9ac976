"""s43 (helper moe43c): moe_experts recall classes of the routing-weight reads the s43 blind sets missed.

Each class is a spelling of "the routing weight of the (token, slot) pairs this expert takes" that the loop
analysis did not read:

1. ``w[mask, k]`` with ``mask = idx[:, k] == e`` inside a slot loop ``for k in range(K)``: the slot-k weight of
   each selected token, ``[n]`` (s42b read only ``w[mask, k:k + 1]`` and ``w[:, k][mask]``);
2. ``w[pairs]`` with ``pairs = torch.nonzero(idx == e, as_tuple=True)`` (or ``torch.where(idx == e)``) used whole as
   the index: ``w[pairs[0], pairs[1]]``, the pairs' weights;
3. ``(idx[tok] == e).nonzero()[:, 1]`` with ``tok = (idx == e).any(-1)``: the slot of e in each selected row (one per
   row where the top-k ids of a row are distinct, in row order), so ``w[tok, col]`` is each selected token's weight;
4. ``y *= w`` on the expert output ``y`` (in place): the same value as ``y = y * w`` where nothing else holds ``y``
   (no alias read between its binding and the in-place product).

The functions here read syntax only and return facts (or None); ``moe_experts`` calls them from its loop analysis.
"""

from __future__ import annotations

import ast
from typing import Optional

from npufuse.patterns import _moe_s42c as s42c
from npufuse.patterns.base import Fuse, Keep
from npufuse.scan.dataflow import const_value


def is_slot_name(node: ast.expr, slot_var: str) -> bool:
    """``k``: the slot loop's variable itself (class 1: ``w[mask, k]``)."""
    return isinstance(node, ast.Name) and node.id == slot_var


def pair_tuple_parts(sl: ast.expr) -> Optional[list[ast.expr]]:
    """``[pairs[0], pairs[1]]`` for an index that is one bare name ``pairs`` (class 2): the caller checks it holds
    the (token, slot) pairs of 2-D indices; None for any other index."""
    if not isinstance(sl, ast.Name):
        return None
    return [ast.copy_location(ast.Subscript(ast.Name(sl.id, ast.Load()), ast.Constant(j), ast.Load()), sl) for j in (0, 1)]


def nonzero_receiver(node: ast.Call) -> Optional[ast.expr]:
    """X of ``X.nonzero()`` / ``torch.nonzero(X)`` without as_tuple (class 3)."""
    return s42c._nonzero_mask(node)


def is_second_column(sl: ast.expr) -> bool:
    """``[:, 1]`` / ``[:, -1]``: the column index of ``nonzero()``'s ``[m, 2]`` rows of a 2-D mask (class 3)."""
    if not (isinstance(sl, ast.Tuple) and len(sl.elts) == 2 and isinstance(sl.elts[0], ast.Slice)):
        return False
    whole = sl.elts[0]
    col = const_value(sl.elts[1])
    return whole.lower is None and whole.upper is None and whole.step is None and not isinstance(col, bool) and col in (1, -1)


def inplace_product(s: ast.stmt) -> Optional[tuple[str, ast.BinOp]]:
    """``y *= f`` / ``y.mul_(f)`` (class 4): (``y``, the product ``y * f`` it stands for); else None."""
    if isinstance(s, ast.AugAssign) and isinstance(s.op, ast.Mult) and isinstance(s.target, ast.Name):
        name, factor = s.target.id, s.value
    elif isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and isinstance(s.value.func, ast.Attribute) \
            and s.value.func.attr == "mul_" and isinstance(s.value.func.value, ast.Name) and len(s.value.args) == 1 \
            and not s.value.keywords:
        name, factor = s.value.func.value.id, s.value.args[0]
    else:
        return None
    product = ast.BinOp(ast.Name(name, ast.Load()), ast.Mult(), factor)
    return name, ast.copy_location(product, s)  # type: ignore[return-value]


def read_since_bound(loop: ast.AST, name: str, at: ast.stmt) -> bool:
    """Whether ``name`` is read in ``loop`` on a line after its last binding before ``at`` and before ``at`` (class 4),
    or is not bound there at all: such a read may have kept another handle on the tensor (``z = y``, ``y.view(...)``),
    which the in-place product changes too. (A read on a continuation line of the binding counts: a refusal.)"""
    names = [n for n in ast.walk(loop) if isinstance(n, ast.Name) and n.id == name and n.lineno < at.lineno]
    bound = [n.lineno for n in names if isinstance(n.ctx, ast.Store)]
    if not bound:
        return True
    return any(isinstance(n.ctx, ast.Load) and n.lineno > max(bound) for n in names)
