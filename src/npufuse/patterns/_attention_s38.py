"""Attention constructs of the s38 pass (HO14 development data).

* Rank-aware reasons for a key transposed over positive dims (``k.transpose(1, 2)``): dims 1, 2 are the last two of a
  3-D key and not of a 4-D one, so whether "not the last two" is true depends on the key's rank. The rank is read
  where the code states it (:func:`attention.static_rank`); where it does not, the reason says the rank is not
  evident instead of asserting a 4-D layout (:func:`key_transpose_reason`).
* ``q @ k.transpose(1, 2)`` with q built 3-D by the code (a view / reshape with three sizes: UMbreLLa's static KV
  cache folds the query groups into ``[N_kv, G * Sq, D]`` and reads k / v as ``[N_kv, S, D]`` from a per-layer
  cache) while k / v come from places whose rank the code does not state: read as the 3-D bmm it is where the
  three ranks are checked at run time (:func:`three_d_retry_wanted`); other ranks run the original code.
"""

from __future__ import annotations

from typing import Any, Optional


def _rank_of(matcher: Any, node: Any) -> Optional[int]:
    from npufuse.patterns import _attention_s34
    from npufuse.patterns.attention import static_rank

    rank = static_rank(matcher.scope, node, matcher._line)
    if rank is None and _attention_s34.proven_3d(matcher, node):
        rank = 3
    return rank


def _last_two(dims: set, rank: int) -> bool:
    return {d % rank for d in dims if isinstance(d, int)} == {rank - 2, rank - 1} and len(dims) == 2


def key_transpose_reason(matcher: Any, key: Any, query: Any, dims: set, layout: str) -> str:
    """Why ``key.transpose(*dims)`` is refused as Kᵀ of a product read in ``layout``, stated for the key's rank
    where the code shows it: dims that are not the key's last two, or the last two of a key whose rank differs from
    the reading's, or (rank not evident) both possibilities."""
    shown = sorted(d for d in dims if isinstance(d, int))
    rank = _rank_of(matcher, key)
    if rank is not None and rank >= 2:
        if not _last_two(dims, rank):
            return f"key transposed over dims {shown}, not the last two of the {rank}-D key"
        q_rank = _rank_of(matcher, query)
        read = "3-D" if layout == "3D" else "4-D"
        q_text = f"q is {q_rank}-D" if q_rank is not None else "q's rank is not evident"
        return (f"key transposed over dims {shown}, the last two of the {rank}-D key, but the product is read {read} "
                f"({q_text}): the operands' ranks disagree")
    if shown == [1, 2]:
        q_rank = _rank_of(matcher, query)
        q_text = f"q is {q_rank}-D" if q_rank is not None else "q's rank is not evident either"
        return ("key transposed over dims [1, 2]: the last two only if the key is 3-D, and the code does not show the key's "
                f"rank ({q_text})")
    return f"key transposed over dims {shown}: not the last two of a 3-D or 4-D key (the key's rank is not evident)"


def three_d_retry_wanted(matcher: Any, key: Any, query: Any, dims: set, kind: str, layout: str) -> bool:
    """The 4-D reading of ``query @ key.transpose(1, 2)`` fails where the code builds q 3-D: worth reading the product
    as a bmm with every rank checked at run time (the key's rank is not shown, or shown 3-D)."""
    from npufuse.patterns import _attention_s34

    if kind not in ("matmul", "@") or layout == "3D" or dims != {1, 2}:
        return False
    k_rank = _rank_of(matcher, key)
    return k_rank in (None, 3) and _attention_s34.proven_3d(matcher, query)


def unchecked_operand(chain: Any) -> Optional[str]:
    """The role of an operand (q, k or v) whose rank the run-time check cannot read (it reaches the product as a call
    that may change the rank), else None: the 3-D reading of an unproven operand needs every rank checked."""
    from npufuse.patterns import _attention_s35

    for role, op in (("q", chain.q), ("k", chain.k), ("v", chain.v)):
        if op is None or _attention_s35.rank_base(op.leaf) is None:
            return role
    return None
