"""Eager attention whose 4-D scores put the heads after the query axis (helper mla43, s43).

DeepSeek-V3's inference MLA text, copied into many repositories, computes
``scores = einsum("bshd,bthd->bsht", q, k) * scale``, adds a mask broadcast over the heads
(``scores += mask.unsqueeze(1)``: a [S, T] mask read as [S, 1, T]), takes ``softmax(dim=-1)`` and multiplies with
``einsum("bsht,bthd->bshd", scores, v)``. The scores are [B, Sq, N, Skv]: the key axis is last (the softmax runs over
the keys) but the query axis is not next to it, so the BNSD / BSND readings and s28's ``[batch.., Sq, Skv]`` reading
refuse them. The computation is the same attention with every head's scores in another axis order: q / k / v are
read as BNSD through a permutation the equations name, the fused result is permuted to the P@V output's order (s28's
``out_perm``), and each mask term -- written against the [B, Sq, N, Skv] scores -- is broadcast to 4-D and permuted to
[B, N, Sq, Skv] before it becomes the op's mask (``_npufuse_bnsd``).

Read only where both einsums agree on the axis roles (the P@V einsum records the scores' order, the Q@Kᵀ einsum must
produce the same); otherwise the site stays a near miss. Left out (near misses with their reason): a mask term proven
causal (its triangle's axes are read for BNSD scores), a float bias taken as pse, a boolean-index write, probabilities
zeroed after the softmax (all read in the BNSD order), and repeated kv heads.
"""

from __future__ import annotations

from typing import Any

from npufuse.scan.canonical import Contraction

SCORE_AXES_REASON = "q/k/scores in layouts other than BNSD/BSND with [B, N, Sq, Skv] scores"


def _query_letter(scores: str, q_sub: str, k_sub: str) -> str | None:
    """The one axis of the scores that only the query carries (None where there is not exactly one)."""
    only_q = [x for x in scores if x in q_sub and x not in k_sub]
    return only_q[0] if len(only_q) == 1 else None


def canonical_axes(written: str, i: str, j: str | None = None) -> tuple[str, tuple[int, ...]]:
    """The [batch.., Sq, Skv] order of the 4-D scores ``written`` whose query letter is ``i`` and key letter ``j`` (the
    last by default), and for each of its axes the position of that axis in ``written``."""
    j = written[-1] if j is None else j
    batch = "".join(x for x in written if x not in (i, j))
    canon = batch + i + j
    return canon, tuple(written.index(x) for x in canon)


def key_axis(chain: Any) -> int:
    """The scores' key axis: the last, or (s44) the one a softmax over another axis of einsum scores was taken over."""
    axis = getattr(chain, "s44_key_axis", None)
    return 3 if axis is None else axis


def pv_scores_permuted(m: Any, c: Contraction | None, p_sub: str, v_sub: str, v_node: Any, chain: Any) -> bool:
    """P@V as a 4-D einsum over probabilities whose key axis is last and whose query axis is not next to it
    (``bsht,bthd->bshd``): v is read as BNSD through a permutation, the fused result permuted to the output's order,
    and the scores' axis order recorded for the Q@Kᵀ einsum and the mask terms. False (nothing recorded) where the
    query axis already sits before the key axis (the BNSD / BSND / s28 readings) or the form differs."""
    ka = key_axis(chain)
    if c is None or len(p_sub) != 4 or chain.p_transposed or len(c.summed) != 1 or p_sub[ka] != c.summed:
        return False
    j = c.summed
    d_letters = [x for x in v_sub if x not in p_sub]
    if len(d_letters) != 1 or len(v_sub) != 4 or len(c.out) != 4:
        return False
    d = d_letters[0]
    i = _query_letter(p_sub, c.out, v_sub)
    if i is None or (ka == 3 and p_sub.index(i) == 2):
        return False
    canon, axes = canonical_axes(p_sub, i, j)
    batch = canon[:2]
    if set(v_sub) != set(batch) | {j, d} or set(c.out) != set(batch) | {i, d}:
        return False
    from npufuse.patterns.attention import _s28_permuted_operand  # the s28 reading of a permuted operand
    chain.v = _s28_permuted_operand(m, v_node, "v", v_sub, batch + j + d, chain)
    out_canon = batch + i + d
    perm = tuple(out_canon.index(x) for x in c.out)
    chain.out_layout = "BNSD"
    chain.out_perm = perm if perm != tuple(range(4)) else None
    chain.s43_score_axes = axes
    chain.notes.append(f"einsum `{c.a},{c.b}->{c.out}`: the probabilities are [{', '.join(p_sub)}] with the query axis "
                       f"`{i}` at {p_sub.index(i)}: read as [{', '.join(canon)}] (v permuted to BNSD, the result permuted back)")
    return True


def query_key_sides(mm: Any, c: Contraction, ka: int = -1) -> tuple[Any, Any, str, str] | None:
    """(q node, k node, q's letters, k's letters) of a Q@Kᵀ einsum: the key is the operand carrying the scores'
    key axis ``ka`` (the last by default); None where neither does (the softmax would not run over keys)."""
    j = c.out[ka]
    if j in c.b_free:
        return mm.a, mm.b, c.a, c.b
    if j in c.a_free:
        return mm.b, mm.a, c.b, c.a
    return None


def qk_scores_permuted(m: Any, mm: Any, c: Contraction, chain: Any) -> bool:
    """Q@Kᵀ as a 4-D einsum producing the scores in the axis order the P@V einsum recorded (``bshd,bthd->bsht``):
    q and k read as BNSD through permutations. False where no such order was recorded or the equation does
    not produce it (the caller's own reading then decides)."""
    axes = getattr(chain, "s43_score_axes", None)
    if axes is None or len(c.out) != 4 or len(c.summed) != 1 or len(c.a) != 4 or len(c.b) != 4:
        return False
    ka = key_axis(chain)
    sides = query_key_sides(mm, c, ka)
    if sides is None:
        return False
    q_node, k_node, qs, ks = sides
    j = c.out[ka]
    i = _query_letter(c.out, qs, ks)
    if i is None:
        return False
    canon, own_axes = canonical_axes(c.out, i, j)
    d = c.summed
    if own_axes != axes or set(qs) != set(canon[:2]) | {i, d} or set(ks) != set(canon[:2]) | {j, d}:
        return False
    from npufuse.patterns.attention import _s28_permuted_operand
    chain.q = _s28_permuted_operand(m, q_node, "q", qs, canon[:2] + i + d, chain)
    chain.k = _s28_permuted_operand(m, k_node, "k", ks, canon[:2] + j + d, chain)
    chain.spelling.append("einsum")
    chain.s43_qk_read = True
    return True


def unread_scores_reason(chain: Any) -> str | None:
    """Why a chain whose probabilities are permuted scores is not fused (None: it is)."""
    if getattr(chain, "s43_score_axes", None) is None:
        return None
    if not getattr(chain, "s43_qk_read", False):
        return ("the probabilities' einsum has the query axis away from the key axis, but the scores' product does not "
                "produce that same axis order: npufuse reads such permuted scores only from a 4-D einsum Q@Kᵀ")
    for term in chain.masks:
        if term.causal:
            return ("a mask term proven causal on scores laid out with the heads after the query axis: npufuse reads the "
                    "triangle's axes for [B, N, Sq, Skv] scores only")
        if term.index_write:
            return "a boolean-index write on scores laid out with the heads after the query axis: npufuse checks its rank for BNSD scores only"
    if getattr(chain, "zero_masked", None) is not None:
        return "probabilities zeroed after the softmax on scores laid out with the heads after the query axis: npufuse reads that mask for BNSD scores only"
    return None


def to_bnsd_lambda(axes: tuple[int, ...]) -> str:
    """The helper each mask term goes through: broadcast to 4-D against the written scores, then permuted to
    [B, N, Sq, Skv]."""
    return (f"_npufuse_bnsd = lambda t: t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)).permute({', '.join(map(str, axes))})"
            "  # each mask term from the written score order to [B, N, Sq, Skv]")
