"""s47 (ho24attn): moe_experts near-miss reason for a routing weight assembled slot by slot.

keeratpreetsingh's ``simplified moe(faster).py`` (HO24a): the expert loop picks its rows with
``(indices == e).any(-1)`` and builds each row's weight in a fresh buffer, one write per top-k slot
(``w = torch.zeros(mask.sum()); pos0 = indices[mask, 0] == e; w[pos0] = weights[mask, 0][pos0]; ...``). The old
reason, "rows are written through `w[pos0]`, not selected by an expert-index comparison", was false: the rows are
selected by one, the writes only choose which slot's weight applies. :func:`slot_weight_write` names what the loop
does instead.
"""

from __future__ import annotations

import ast
from typing import Any, Optional

from npufuse.patterns import _moe_s48f
from npufuse.scan.dataflow import dotted, fast_walk

_FRESH = ("zeros", "empty", "zeros_like", "empty_like", "full", "new_zeros", "new_empty", "new_full")


def _bound_in(loop: ast.For, name: str) -> list[ast.expr]:
    return [n.value for n in fast_walk(loop) if isinstance(n, ast.Assign) and len(n.targets) == 1
            and isinstance(n.targets[0], ast.Name) and n.targets[0].id == name]


def slot_weight_write(loop: ast.For, eidx: set[str], stmt: ast.Assign) -> Optional[str]:
    """The near miss for ``buf[pos] = <value>`` in the expert loop where ``buf`` is bound in the loop only to a fresh
    buffer (``torch.zeros(..)`` and the like) and ``pos`` is (bound in the loop to) a comparison reading the expert
    index; None for any other write."""
    tgt = stmt.targets[0] if len(stmt.targets) == 1 else None
    if not (isinstance(tgt, ast.Subscript) and isinstance(tgt.value, ast.Name)):
        return None
    values = _bound_in(loop, tgt.value.id)
    if not values or not all(isinstance(v, ast.Call) and (dotted(v.func) or "").rpartition(".")[2] in _FRESH for v in values):
        return None
    idx = tgt.slice
    tests = _bound_in(loop, idx.id) if isinstance(idx, ast.Name) else [idx]
    if not tests or not all(isinstance(t, ast.Compare) and any(isinstance(n, ast.Name) and n.id in eidx for n in fast_walk(t))
                            for t in tests):
        return None
    return (f"each selected row's routing weight is written slot by slot into the fresh buffer `{tgt.value.id}` "
            f"(`{ast.unparse(stmt)[:70]}`, at the rows whose top-k slot holds this expert): npufuse reads a routing weight "
            "taken from the weights by the expert-index comparison itself (`w[mask, k]`, `(w * (idx == e)).sum(-1)`), "
            + _moe_s48f.SLOT_WRITES_READ)  # s48: per-slot writes of every slot are read (fix48)
