"""s51 late51attn2: rows of the attention probabilities zeroed after the softmax, in more spellings.

HO28c scCAFM (and s50 twothsnd / EmberNet): ``all_masked = mask.all(dim=-1, keepdim=True)`` then
``weights = weights.masked_fill(all_masked, 0.0)`` after the softmax, or ``p = p * valid`` with ``valid`` a row
predicate. s44 reads ``p.masked_fill(rows, 0)`` with a row mask of size 1 on the key axis as the same masked_fill of the
fused OUTPUT (row i of P @ V is sum_j P[i, j] v[j], so zeroing row i of P zeroes row i of the product); s50c read the
``torch.where`` spelling. Here the row predicate is read however it is computed (a keepdim reduction over the last
axis, compared or negated, cast to a number), and a product ``p * rows`` (or ``rows * p``) with a size-1 last axis is
the same product of the output: (P * r) @ V = r * (P @ V) for any per-row factor r, so it is rendered as a product
(not a masked_fill) and stays exact for non-0/1 factors. The fused output's row is then what the original gives
whatever the kernel computes on a fully masked row, except where the original multiplies a NaN row (softmax of an
all -inf row) by 0: that NaN is the original's, the fused row is the kernel's row times 0.
"""

from __future__ import annotations

import ast
from typing import Any, Optional

from npufuse.scan.dataflow import const_value

_CASTS = frozenset({"float", "half", "bfloat16", "bool", "int", "long", "to", "type_as", "type", "logical_not", "detach"})


def _keepdim_reduction(matcher: Any, node: Any) -> bool:
    """``X.any(-1, keepdim=True)`` / ``.all`` / ``.sum`` / ``.amax`` / ``.amin`` / ``torch.<that>(X, -1, keepdim=True)``:
    size 1 on the last axis by construction."""
    if not isinstance(node, ast.Call):
        return False
    kw = {k.arg: k.value for k in node.keywords}
    names = ("any", "all", "sum", "amax", "amin")
    if matcher._fn(node) in tuple(f"torch.{n}" for n in names):  # before the method test: ``torch.all`` is an attribute too
        if not node.args:
            return False
        dim = node.args[1] if len(node.args) > 1 else kw.get("dim")
        keep = node.args[2] if len(node.args) > 2 else kw.get("keepdim")
    elif matcher.method(node, *names):
        dim = node.args[0] if node.args else kw.get("dim")
        keep = node.args[1] if len(node.args) > 1 else kw.get("keepdim")
    else:
        return False
    return dim is not None and const_value(dim) == -1 and keep is not None and const_value(keep) is True


def row_predicate(matcher: Any, node: Any, depth: int = 0) -> bool:
    """``node`` has size 1 on its last axis by construction: a keepdim reduction over the last axis, through negation,
    a comparison with a scalar, casts, and the s44 forms (``.unsqueeze(-1)``, ``X[..., None]``)."""
    from npufuse.patterns import _attention_s44
    from npufuse.patterns.attention import deref

    if depth > 6:
        return False
    node = deref(node)
    if _attention_s44._key_axis_one(matcher, node) or _keepdim_reduction(matcher, node):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Invert, ast.Not)):
        return row_predicate(matcher, node.operand, depth + 1)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and len(node.comparators) == 1:
        # ``valid.sum(-1, keepdim=True) == 0`` / ``> 0``: a scalar on the other side keeps the shape
        left, right = node.left, node.comparators[0]
        if isinstance(const_value(deref(right)), (int, float)):
            return row_predicate(matcher, left, depth + 1)
        if isinstance(const_value(deref(left)), (int, float)):
            return row_predicate(matcher, right, depth + 1)
        return False
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _CASTS:
        if node.func.attr in ("to", "type_as", "type") and not node.args:
            return False
        return row_predicate(matcher, node.func.value, depth + 1)
    return False


def scaled_rows(matcher: Any, node: Any, chain: Any) -> Optional[Any]:
    """The probabilities P of ``torch.masked_fill(P, r, 0)``, ``P * r`` / ``r * P`` with r a row predicate (size 1 on the key axis), recorded on the
    chain as a per-row factor of the fused output; None for anything else."""
    from npufuse.patterns import _attention_s44, _attention_s50c
    from npufuse.patterns.attention import deref

    node = deref(node)
    if isinstance(node, ast.Call) and matcher._fn(node) == "torch.masked_fill" and len(node.args) == 3 and not node.keywords:
        # the function spelling of s44's ``P.masked_fill(rows, 0)``
        p, rows, fill = node.args
        value = const_value(deref(fill))
        if value in (0, 0.0) and not isinstance(value, bool) and row_predicate(matcher, rows) and matcher._qk_softmax(p):
            _attention_s50c.mark_row_statements(rows, chain)
            chain.s44_zeroed_rows.append(_attention_s44.ZeroedRows(rows))
            return p
        return None
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return None
    for p, r in ((node.left, node.right), (node.right, node.left)):
        if row_predicate(matcher, r) and matcher._qk_softmax(p):
            _attention_s50c.mark_row_statements(r, chain)
            chain.s44_zeroed_rows.append(_attention_s44.ZeroedRows(r, times=True))
            return p
    return None


def mark_rows(rows: Any, chain: Any) -> None:
    """The statements computing a row predicate read by :func:`row_predicate` (not the s44 forms, rendered as written
    before) are steps of the site: the fused branch renders the predicate from them."""
    from npufuse.patterns import _attention_s50c
    from npufuse.patterns.attention import deref

    if isinstance(deref(rows), ast.Name) or rows is not deref(rows):
        _attention_s50c.mark_row_statements(rows, chain)
