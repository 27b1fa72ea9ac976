"""s49 mask49: a float mask binarised for npu_fusion_attention must leave every query row a key.

An additive float mask whose values npufuse cannot prove (a tensor handed in: HF / BERT masks, a bias) is converted
with ``mask < 0`` (True = masked) after the run-time value check "every entry is 0 or <= -1000": an entry <= -1000
has a softmax weight of 0 in fp32 *beside a kept (0) entry of the same row*. A row with no 0 entry is different:

* every entry finite and <= -1000 (a per-head bias of -2000, a query row padded with -10000 or finfo.min): eager
  softmax is shift-invariant, so the row is the softmax of the scores plus what is left of the bias (uniform over
  the keys for a row-constant bias) -- a real attention row;
* every entry -inf: eager softmax gives NaN (SDPA gives 0 for such a row in recent torch);

while the boolean ``atten_mask`` marks the whole row masked, where npu_fusion_attention's value is not pinned down
(spec 5.1 / 14: zeros or a uniform average; the emulator zeroes the row). The value check therefore also requires a
0 in every row (``(m == 0).any(-1).all()``, in the same host sync: one more reduction on the mask, none on the
scores). Where the original zeroes NaN rows after the softmax (``P.masked_fill(P.isnan(), 0)``), a row of -inf only
is kept (the rewrite zeroes the rows its mask masks entirely); where it zeroes the mask's masked positions
(``P.masked_fill(M, 0)`` with M the mask), fully masked rows are zeroed on both sides and no row condition is added.

A 0 / 1 multiplicative mask applied with a finite offset (``s * m - C * (1 - m)``) is the same question: a row with
no 1 is a uniform row in the original, so its run-time 0 / 1 check also requires a 1 in every row.
"""

from __future__ import annotations

from typing import Any, Optional

FLOOR = -1000.0

KEY = "key"  # every row keeps a 0 entry
NAN = "nan"  # every row keeps a 0 entry or is -inf throughout (the original zeroes its NaN rows)


def _atom(text: str) -> str:
    from npufuse.patterns.attention import atom

    return atom(text)


def additive_exact(text: str, rows: Optional[str] = KEY) -> str:
    """One host sync: the values of the additive mask ``text`` are 0 or <= -1000 and (``rows``) every row keeps a key."""
    a = _atom(text)
    values = f"(({a} == 0) | ({a} <= {FLOOR})).all()"
    if rows == KEY:
        return f"bool({values} & ({a} == 0).any(-1).all())"
    if rows == NAN:
        return f"bool({values} & (({a} == 0).any(-1) | ({a} == float('-inf')).all(-1)).all())"
    return f"bool({values})"


def zero_one_exact(text: str, rows: Optional[str] = KEY) -> str:
    """One host sync: the multiplicative mask ``text`` holds only 0 and 1 and (``rows``) every row keeps a 1."""
    a = _atom(text)
    values = f"(({a} == 0) | ({a} == 1)).all()"
    if rows is None:
        return f"bool({values})"
    return f"bool({values} & ({a} == 1).any(-1).all())"


def term_rows(chain: Any) -> Optional[str]:
    """The row condition each term's value check carries: :func:`row_rule`, except where several terms make the mask
    (a handed-in padding bias beside a causal triangle: each keeps a key in every row, their union may not -- left
    padding masks the only key the triangle leaves the first query): there the rows of the combined mask are checked
    once it is built (:func:`combined_rows_lines`) and the terms' own checks are of values only."""
    rule = row_rule(chain)
    if combined_rows(chain):
        return None
    return rule


def combined_rows(chain: Any) -> bool:
    """The rows are checked on the combined boolean mask, in the [B, N, Sq, Skv] order the op gets, rather than on
    each term: several terms, or scores written in another axis order (s43 / s44 einsum layouts: a term's key axis
    is then not its last). Also where the original zeroes NaN rows: a row the union masks may hold finite entries (a
    -10000 padding key beside -inf causal ones), no NaN in the original, while the rewrite would zero it; the boolean
    mask cannot tell the two apart, so every fully masked row runs the original there."""
    from npufuse.patterns import _attention_s43mla

    if row_rule(chain) not in (KEY, NAN):
        return False  # the original zeroes the mask's masked positions: fully masked rows are 0 on both sides
    return len(chain.masks) > 1 or chain.s43_score_axes is not None or _attention_s43mla.key_axis(chain) != 3


def combined_rows_check(maybe_none: bool) -> str:
    """Every query row of the combined boolean mask (True = masked) keeps a key."""
    check = "not bool(_npufuse_mask.all(-1).any())"
    return f"(_npufuse_mask is None or {check})" if maybe_none else check


COMBINED_ROWS_RISK = ("the mask's rows are checked on the boolean mask the op gets, once it is built (several terms combined, "
                      "one of them handed in with its values checked at run time -- left padding beside a causal triangle masks "
                      "the first query's only key -- or scores written in another axis order): where a query row keeps no key, "
                      "eager softmax averages what is left of that row and the op's value there is not pinned down (spec 5.1 / "
                      "14), so the original code runs; a second reduction and host sync per call, on the boolean mask")


def row_rule(chain: Any) -> Optional[str]:
    """What the rows of a binarised term must hold for the chain ``chain``: KEY, NAN (the original zeroes NaN rows)
    or None (the original zeroes the masked positions: fully masked rows are 0 on both sides)."""
    from npufuse.patterns import _attention_s33

    zeroed = getattr(chain, "zero_masked", None)
    if zeroed is None:
        return KEY
    if zeroed is _attention_s33.NAN_ROWS:
        return NAN
    return None


def mark_rows_checked(term: Any, rows: Optional[str]) -> None:
    """The term's value check (KEY rows) already requires a key in every row: _mask_rows' own row check of the same
    term would be a second reduction and host sync for nothing."""
    try:
        if rows in (KEY, NAN):
            term.s50_value_rows = True  # s50: the value check carries the row condition (gaps50's unread_terms skips it)
        if rows == KEY:
            term.s49_rows_checked = True
    except AttributeError:
        pass


def rows_checked(term: Any) -> bool:
    return bool(getattr(term, "s49_rows_checked", False))


VALUE_CHECK_RISK = ("the float mask's values are not known statically: the fused branch checks that every entry is 0 or "
                    f"<= {FLOOR:g} and that every query row keeps a 0 (a 0/-inf mask; a graded bias such as ALiBi, a 0/1 float "
                    "mask, or a row masked throughout -- a constant per-head bias, a padded query row, where eager softmax "
                    "still averages the keys -- runs the original code instead), two reductions and a host sync per call "
                    "(a graph break under torch.compile)")
