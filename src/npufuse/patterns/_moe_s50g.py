"""s50 gaps50: expert ids that may repeat in a row, combined with an indexed ``out[tok] += y``.

``tok, slot = torch.where(ids == e)`` lists a token once per slot holding e. Where a token holds e in two slots,
``out[tok] += y`` is ``index_put`` without accumulate: the token's two rows are both computed from the same ``out[tok]``
and one of them is written (the other is lost), while npu_moe_token_permute / unpermute add both copies (review49:
cos 0.96 with ``multinomial(..., replacement=True)`` ids). Distinct ids -- a last-dim topk's indices, which npufuse
reads -- make the two equal. Elsewhere (ids handed in as an argument, sampled, hashed) s49 only said so in a risk
line; now the fused text runs under a run-time check that every row of the ids is distinct (one sort of the [T, K]
ids and a host sync), and the original loop runs where one is not. ``index_add_`` / ``index_put_(accumulate=True)``
combines add every copy, as the fused layer does: no check there.
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Optional


def distinct_rows_check(ids: str) -> str:
    """True where every row (last dim) of ``ids`` holds distinct values (a [T, 1] row is distinct: an empty diff)."""
    return f"bool((torch.diff(torch.sort({ids}, dim=-1).values, dim=-1) != 0).all())"


def guard(module: Any, scope: Any, ev: Any, site: Any, topk: Callable[..., Any], miss: Callable[[str], Exception]) -> Optional[str]:
    """The run-time check the site needs, or None (ids read as a topk's, or an accumulating combine). Raises
    ``miss`` where the ids are bound inside the fused span (the check before the span cannot read them)."""
    put = getattr(ev, "s49r_put", "")
    indexed = bool(put) and site.token_dims <= 1 and not site.flat_rows or site.token_dims > 1 and site.out_name
    if not indexed or not site.indices or not site.indices.isidentifier():
        return None
    if topk(module, scope, site.indices, site.first_line) is not None:
        return None  # a last-dim topk's indices (a router's included): distinct per row
    for stmt, _ in scope.assignments.get(site.indices, []):
        if site.first_line <= stmt.lineno <= site.last_line:
            raise miss(f"the loop adds rows back with an indexed `+=` (index_put: a token listing one expert in two slots "
                       f"of `{site.indices}` is written once) and `{site.indices}` is not read as a last-dim topk's "
                       f"indices; it is bound inside the loop's span (line {stmt.lineno}), so no check before the fused "
                       "text can show its rows distinct")
    site.s50_distinct = True
    return f"({distinct_rows_check(site.indices)})"


def risk(site: Any) -> str:
    return (f"the loop adds an expert's rows back with an indexed `+=` (index_put, not index_add): a token listing the "
            f"same expert in two slots of `{site.indices}` is written once there and added twice by the fused layer, "
            f"and `{site.indices}` is not read as a last-dim topk's indices (sampled or hashed routing can repeat an "
            "expert): the fused text runs where every row of it is distinct (checked at run time: one sort and a "
            "host sync per call), the original loop otherwise")
