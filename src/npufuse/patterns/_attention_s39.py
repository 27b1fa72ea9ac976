"""Attention constructs of the s39 pass (HO15 development data).

* Scores masked by a write through a boolean index (``scores[mask] = float('-inf')``, ``attn[~keep] =
  torch.finfo(dtype).min``: Quest's evaluation attention, many research repositories). For a bool index of the
  tensor's rank, ``x[m] = v`` is ``x = x.masked_fill(m, v)`` (the write touches exactly the True positions; a bool
  index of the same rank but another shape raises ``IndexError`` in the original), so the mask goes to the fused op
  with masked_fill's polarity (True = masked out, atten_mask's own). Whether the index is a bool tensor of the
  scores' rank is checked at run time (:func:`index_mask_checks`); the original code runs otherwise (an integer
  index tensor selects rows, a lower-rank bool index whole rows). An index that is visibly not a mask (a slice, an
  integer, a tuple of indices) is described in the near miss (:func:`index_write_parts`).
* A mask computed from a matrix product that is not the scores' own (Quest selects pages by an upper-bound estimate
  ``(q * sign) @ chunk_max_keyᵀ``, then masks the scores with it) is still refused, but the reason says so instead of
  "computed from the attention scores themselves" (:func:`heavy_input_reason`).
"""

from __future__ import annotations

import ast
from typing import Any, Union

# index expressions whose value may be a bool tensor (checked at run time): a name, ``~m``, ``m == 0``, ``m & n``,
# ``m.logical_not()``, ``m.bool()``, an attribute
_MASK_LIKE = (ast.Name, ast.Attribute, ast.UnaryOp, ast.Compare, ast.BinOp, ast.Call)


def index_write_parts(stmt: ast.stmt, target: ast.Subscript) -> Union[tuple[ast.expr, ast.expr], str, None]:
    """(index, value) of ``name[index] = value`` where the index may be a bool mask (a name, ``~m``, a comparison,
    a call); a description of the index where it cannot be one (``"a slice"``, ``"an integer"``, ``"a tuple of
    indices"``); None for any other write (an augmented assignment, several targets, a nested subscript)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and stmt.targets[0] is target
            and isinstance(target.value, ast.Name)):
        return None
    index = target.slice
    if isinstance(index, ast.Slice):
        return "a slice"
    if isinstance(index, ast.Tuple):
        return "a tuple of indices"
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub) and isinstance(index.operand, ast.Constant):
        index = index.operand  # ``x[-1] = ...``
    if isinstance(index, ast.Constant):
        return "an integer" if type(index.value) is int else "a constant"
    if isinstance(index, (ast.List, ast.ListComp)):
        return "a list of indices"
    if isinstance(index, _MASK_LIKE):
        return index, stmt.value
    return None


def index_mask_checks(r: Any, masks: list, rank: int) -> list[str]:
    """Run-time conditions under which each boolean-index write of the scores equals its masked_fill: the index is a
    bool tensor of the scores' rank. Read on the tensor under a ``~`` (its dtype and rank are the index's)."""
    from npufuse.patterns.attention import atom, deref

    checks: list[str] = []
    for m in masks:
        if not getattr(m, "index_write", False):
            continue
        node = deref(m.node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
            node = node.operand
        t = atom(r.text(node))
        check = f"{t}.dtype == torch.bool and {t}.dim() == {rank}"
        if m.cond is not None:
            c = r.text(m.cond)
            check = f"{atom(c)} or ({check})" if m.negate_cond else f"not {atom(c)} or ({check})"
        checks.append(check)
    return checks


INDEX_WRITE_RISK = ("the scores are masked by a write through an index (`s[m] = v`): read as `s.masked_fill(m, v)`, which it is "
                    "where m is a bool tensor of the scores' rank (checked at run time; an integer or lower-rank index runs the "
                    "original code)")


def heavy_input_reason(value: Any, allowed: set[int], qk: Any, text: str) -> str:
    """Why an input of the fused call computed from a matrix product is refused, stated truly: from the scores where
    one of its products is the scores' own (``qk``) or computed from it (a top-k of the scores), or where the scores'
    product is not known; from another product otherwise (Quest's page selection ``(q * sign) @ chunk_max_keyᵀ``)."""
    from npufuse.patterns.attention import _s32_products, walk_values

    products = [p for p in _s32_products(value) if id(p) not in allowed]
    if qk is None or any(p is qk or any(n is qk for n in walk_values(p)) for p in products):
        return f"an input of the fused call (mask / scale) is computed from the attention scores themselves (`{text}`)"
    return (f"an input of the fused call (mask / scale) is computed from a matrix product other than the scores (`{text}`): "
            "npufuse does not compute such an input on the fused branch")
