"""s51 (helper ``sweep51b``): 3-D q / k / v of no stated rank reach the fused call.

s41 checks operands whose rank nothing states (parameters of a helper) with ``q.dim() == 4 and k.dim() == 4 and
v.dim() == 4`` at run time. Graph and point-cloud code calls such helpers with 3-D tensors: heads first with no batch
axis (``[H, N, d]``, graphs concatenated), heads folded into the batch (``[B*H, N, d]``) or one head (``[B, N, d]``).
There the fused branch never ran (``verify op``: "fused branch never executed") while the scan counted a candidate.

The eager matmuls treat every leading index of a 3-D ``[X, S, D]`` operand as one independent attention over its
last two axes, which is exactly npu_fusion_attention's BNSD call on ``q[None]`` (``[1, X, S, D]``: X as heads, B = 1),
the output ``[0]``. So where all three are 3-D with one leading size (tested at run time, bound once; a size-1 operand
broadcast by the matmuls over the others' X is left to the original) the operands are viewed 4-D and the result
unviewed; a 4-D input runs the 4-D call as before, any other rank mix the original code.

Masks: the eager sum broadcasts a mask of rank <= 3 against the 3-D scores as the generic code already reshapes it
against the lifted ones (leading 1s); a 4-D mask would make the eager result 4-D (``[B', X, Sq, D]``), and a 3-D one
whose first size is neither 1 nor X would broadcast the scores up. Both run the original code (a run-time test after
the mask is built). Forms left on the 4-D-only test (no lift, the s41 behaviour): causal terms (sole ones go to
sparse_mode without their tensor, whose rank, and so the eager output's, is not read here), float biases passed as
``pse`` (expanded to the scores' written shape), per-row tensor scales, einsums, transposed outputs (``(p @ v)
.transpose(1, 2)`` swaps other axes of a 3-D result), and operands whose heads are added, repeated or shared.
"""

from __future__ import annotations

from typing import Any

LIFT = "_npufuse_lift"

LIFT_NOTE = ("q/k/v of no stated rank: where all three are 3-D [X, S, D] (heads first, heads folded into the batch, or "
             "one head), every leading index is one independent attention, so they are passed as [1, X, S, D] BNSD views "
             "(X as heads) and the result's leading 1 is dropped; 4-D ones go as they are; any other rank mix runs the "
             "original code")

LIFT_RISK = ("q/k/v are taken as 4-D, or as 3-D [X, S, D] viewed [1, X, S, D] (the eager matmuls accept any rank; other "
             "ranks, mixed ranks, or beside 3-D operands a mask the eager broadcast would make 4-D, run the original code)")


def eligible(chain: Any, unstated: list[tuple[str, int]], v_shared: bool, folded: bool, fold_on_bound: bool,
             bias_type: type) -> bool:
    """May the run-time rank test take 3-D operands too (see the module doc for what is left out and why)?"""
    if len(unstated) != 3 or any(want != 4 for _tag, want in unstated):
        return False
    ops = (chain.q, chain.k, chain.v)
    if any(op.layout != "BNSD" or op.heads_added or op.repeat is not None for op in ops):
        return False
    if v_shared or folded or fold_on_bound or chain.out_layout != "BNSD" or chain.out_transposed or chain.out_perm is not None:
        return False
    if chain.heads_in_batch or chain.s43_score_axes is not None or chain.s44_sink is not None or chain.tensor_scales:
        return False
    if "einsum" in chain.spelling or chain.q_transposed or chain.k_transposed or chain.v_transposed:
        return False
    return not any(m.causal or isinstance(m, bias_type) for m in chain.masks)


def lift_lines(q: str, k: str, v: str, atom: Any) -> tuple[list[str], tuple[str, str, str]]:
    """Statements binding the 4-D views the call reads (after q / k / v are bound once), and their names."""
    qa, ka, va = atom(q), atom(k), atom(v)
    names = ("_npufuse_q4", "_npufuse_k4", "_npufuse_v4")
    return [
        f"{LIFT} = int({qa}.dim() == {ka}.dim() == {va}.dim() == 3 and {qa}.shape[0] == {ka}.shape[0] == {va}.shape[0])"
        "  # 3-D [X, S, D]: X independent attentions",
        f"{', '.join(names)} = ({qa}[None], {ka}[None], {va}[None]) if {LIFT} else ({q}, {k}, {v})  # [1, X, S, D]: BNSD, X as heads",
    ], names


def mask_test(q4: str, maybe_none: bool) -> str:
    """Run-time condition, once ``_npufuse_mask`` is built and before it is reshaped: a lifted call's mask is one the eager
    broadcast against 3-D scores leaves 3-D (rank <= 3, first size 1 or X where 3-D)."""
    none = "_npufuse_mask is None or " if maybe_none else ""
    return (f"not {LIFT} or {none}_npufuse_mask.dim() < 3 or "
            f"(_npufuse_mask.dim() == 3 and _npufuse_mask.shape[0] in (1, {q4}.shape[1]))")


def unlift(call: str) -> str:
    """The output as the eager code's: ``[1, X, Sq, D]`` -> ``[X, Sq, D]`` where lifted (``flatten(0, 0)`` is a no-op)."""
    return f"{call}.flatten(0, {LIFT})"
