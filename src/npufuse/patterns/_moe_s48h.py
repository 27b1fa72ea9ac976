"""s48 ho25fix: MoE routing weights the analyser did not read (HO25a / HO25b judged misses).

1. **The masked slot sum over the selected rows, the mask indexed after the comparison** (HO25a stonehuang
   mini-deepseek model.py:343): ``mask = idx == e; rows = mask.any(-1).nonzero(as_tuple=True)[0];
   w_e = (mask[rows].float() * w[rows]).sum(-1, keepdim=True)``. ``(idx == e)[rows]`` is ``idx[rows] == e`` (the form
   s41 reads, ``rowslots``): the same [n, K] slots of e in each selected row; with ``w`` shaped like ``idx`` (a
   last-dim top-k's values and indices: distinct per token) the masked sum over the slots is that row's one weight
   for e. Both operands must be indexed by the same rows (one text), the mask must be ``idx == e`` of the indices the
   rows were picked from (the analyser's ``tok_indices``). The weights and indices may each be reshaped by one
   ``view`` / ``reshape`` text from a pair shaped alike (``w.view(-1, K)``, ``idx.view(-1, K)``) under a run-time
   guard that the last dim (the slots) is kept.
"""

from __future__ import annotations

import ast
from typing import Any, Optional


def masked_rows(an: Any, sides: list[ast.expr], V: Any, shaped_like: Any, miss: Any = None) -> Optional[Any]:
    """``V("masked_w_rows", (w, idx))`` for ``mask[rows] * w[rows]`` (either order; casts already stripped) with
    ``mask`` = ``idx == e`` and ``rows`` this expert's token rows of ``idx``; None otherwise."""
    if len(sides) != 2 or not all(isinstance(s, ast.Subscript) and isinstance(s.value, ast.Name) for s in sides):
        return None
    for m, w in (sides, sides[::-1]):
        if ast.dump(m.slice) != ast.dump(w.slice):  # type: ignore[attr-defined]
            continue
        mv = an.ev(m.value)  # type: ignore[attr-defined]
        if mv.kind != "flatmask" or not mv.args or not an.tok_indices or mv.args[0] != an.tok_indices:
            continue
        if an.ev(m.slice).kind not in ("tok", "tokmask"):  # type: ignore[attr-defined]
            continue
        wv = an.ev(w)
        if wv.kind != "x" or not wv.args:
            continue
        if shaped_like(an.m, an.scope, wv.args[0], mv.args[0], an.loop.lineno) \
                or _reshaped_alike(an, wv.args[0], mv.args[0], shaped_like):
            return V("masked_w_rows", (wv.args[0], mv.args[0]))
        if miss is not None:
            raise miss(f"the expert's weight is the masked sum over the slots `{ast.unparse(m)} * {ast.unparse(w)}`, "
                       f"its routing weight only where `{wv.args[0]}` has the shape of the expert indices "
                       f"`{mv.args[0]}` (element [t, k] the weight of slot k), which is not shown")
    return None


def _reshaped_alike(an: Any, weights: str, indices: str, shaped_like: Any) -> bool:
    """``w2 = w.view(*s)`` and ``i2 = i.view(*s)`` (or reshape; one text of arguments) of a weights / indices pair
    shaped alike: element [r, k] of both is still one (token, slot) pair. A row of ``i2`` holds distinct experts only
    where it is a row of ``i``: a run-time guard that the last dim is kept (``i2.shape[-1] == i.shape[-1]``), read
    where ``i`` is not rebound between the reshape and the loop."""
    scope, line = an.scope, an.loop.lineno
    wd, idd = scope.definition(weights, line), scope.definition(indices, line)
    pair = []
    for d in (wd, idd):
        if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr in ("view", "reshape")
                and isinstance(d.func.value, ast.Name) and d.args and not d.keywords):
            return False
        pair.append(d)
    if wd.func.attr != idd.func.attr or [ast.dump(a) for a in wd.args] != [ast.dump(a) for a in idd.args]:
        return False
    w0, i0 = wd.func.value.id, idd.func.value.id
    if w0 in (weights, indices) or i0 in (weights, indices) or w0 == i0:
        return False
    if scope.definition(i0, line) is not scope.definition(i0, idd.lineno):
        return False
    if not shaped_like(an.m, scope, w0, i0, min(wd.lineno, idd.lineno)):
        return False
    an._rank_guard(f"{indices}.shape[-1] == {i0}.shape[-1]")
    return True
