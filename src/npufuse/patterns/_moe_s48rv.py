"""s48 review48b: the slot-by-slot routing-weight buffers (fix47h's slot loop, fix48's unrolled slot writes) read
as the dense-gates statement ``tw = (w * (idx == e)).sum(-1)[sel]``.

With ``tw[m_k] += w[sel, k][m_k]`` every slot holding e adds its weight: the sum, for any indices. With a plain
store ``tw[m_k] = w[sel, k][m_k]`` a row listing e in two slots keeps only the LAST slot's weight, where the sum
(and the fused dispatch, which routes the token once per slot) adds both: the two agree only where a row's
indices are distinct. So a plain store is read only where ``idx`` holds a last-dim topk's indices (distinct per
row); indices drawn another way (``torch.multinomial(p, K, replacement=True)``, a hash, an argmax per slot) keep
the original, with a reason that says so (measured: a top-2 multinomial routing with ``=`` writes fused to cos
0.9487 against the original before this check).
"""

from __future__ import annotations

import ast
import re
from typing import Any, Optional

_GUARD_IDX = re.compile(r"== (\w+)\.shape\[-1\]$")


def plain_store(body: list[ast.stmt], first: int, last: int, tw: str) -> Optional[ast.stmt]:
    """The first ``tw[...] = v`` (a plain store, not ``+=``) among ``body[first..last]`` (nested statements included)."""
    for st in body[first:last + 1]:
        for n in ast.walk(st):
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
                                                 and t.value.id == tw for t in n.targets):
                return n
    return None


def refusal(an: Any, body: list[ast.stmt], j: int, summed: tuple, topk_indices: Any) -> Optional[str]:
    """A reason where the folded slot writes store with ``=`` and their indices are not shown distinct per row;
    None where the dense-gates reading is exact."""
    synth = summed[0]
    last = summed[2] if len(summed) > 2 else j + 1
    tw = synth.targets[0].id
    store = plain_store(body, j + 1, last, tw)
    if store is None:
        return None
    m = _GUARD_IDX.search(summed[1])
    if m is not None and topk_indices(an.m, an.scope, m.group(1), an.loop.lineno) is not None:
        return None
    idx = m.group(1) if m else "the indices"
    return (f"each selected row's routing weight is stored slot by slot into `{tw}` with `=` "
            f"(`{ast.unparse(store)[:70]}`): a row listing the expert in two slots keeps the last slot's weight, where "
            f"the fused dispatch adds both; exact only for distinct indices per row, and `{idx}` is not shown to be "
            "the indices of a topk over the last dim (`+=` writes would sum them)")
