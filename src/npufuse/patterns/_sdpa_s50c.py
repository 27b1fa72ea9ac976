"""SDPA with a float position bias as ``attn_mask`` (ALiBi, a learned relative-position table): npu_fusion_attention's
``pse`` (s50 late pass on HO27c, helper ho27c).

SDPA computes ``softmax(Q Kᵀ * scale + attn_mask)``. npu_fusion_attention adds ``pse`` either before its scale
(``scale * (Q Kᵀ + pse)``, the formula, kernel doc and golden) or after it (``scale * Q Kᵀ + pse``, the 2.14 example):
spec §5.1 marks the placement UNCERTAIN. With q multiplied by the scale and ``scale=1.0`` both readings are
``(q * scale) Kᵀ + pse``, SDPA's own logits, so the rewrite does not depend on which one the kernel implements (the
attention pattern's s28 form). The bias is passed in q's dtype (SDPA requires a float mask in q's dtype, or promotes),
expanded to the [B, N, Sq, Skv] shape the op takes (SDPA broadcasts it). Its gradient flows to a learned table
(the op's backward returns a pse grad).

Refused with a true reason: a bias the function also writes -inf / finfo.min into (a causal part folded into it, T5
style): npufuse does not split the infinite part out of a bias into ``atten_mask``; where npufuse cannot state the
layout ([B, N, S, D] with a known rank), the earlier reason stands.
"""

from __future__ import annotations

import ast
from typing import Any, Optional, Union

from npufuse.patterns.base import Risk
from npufuse.scan.dataflow import fast_walk, segment


def _infinite(node: ast.AST) -> bool:
    for n in fast_walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and "inf" in n.value.lower():
            return True
        if isinstance(n, ast.Attribute) and n.attr in ("inf", "min") and ("inf" in ast.dump(n.value) or "finfo" in ast.dump(n.value)
                                                                         or n.attr == "inf"):
            return True
        if isinstance(n, ast.Constant) and isinstance(n.value, float) and abs(n.value) >= 1e4:
            return True
    return False


def _infinite_write(scope: Any, mask: ast.expr, line: int) -> Optional[ast.stmt]:
    """A statement of the function before ``line`` that writes an infinite / large negative value into the bias name."""
    if not isinstance(mask, ast.Name):
        return None
    name = mask.id
    for st in fast_walk(scope.node):
        if not isinstance(st, (ast.Assign, ast.AugAssign, ast.Expr)) or st.lineno >= line:
            continue
        touches = any(isinstance(n, ast.Name) and n.id == name for n in fast_walk(st))
        if touches and _infinite(st):
            return st
    return None


def bias_pse_lines(module: Any, scope: Any, mask: ast.expr, line: int, qn: str, head_num: str, sq: str, skv: str,
                   layout_known: bool, maybe_none: bool = True) -> Union[list[str], str, None]:
    """The lines binding ``_npufuse_pse`` from the float bias ``mask``; a near-miss reason (str) where the bias holds
    infinite entries; None where the layout is not one npufuse states (the caller's earlier reason then stands)."""
    if not layout_known:
        return None
    written = _infinite_write(scope, mask, line)
    src = segment(module, mask)
    if written is not None or _infinite(mask):
        at = f" (`{' '.join(segment(module, written).split())[:70]}`, line {written.lineno})" if written is not None else ""
        return (f"a float bias (`{src}`) that also holds -inf / very negative entries{at}: npufuse passes a finite bias as "
                "npu_fusion_attention's `pse` but does not split an infinite part out of a bias into `atten_mask`")
    q = qn if qn.isidentifier() else f"({qn})"
    cast = (f"_npufuse_pse = _npufuse_autocast({qn}, _npufuse_pse.to({q}.dtype).expand({q}.shape[0], {head_num}, {sq}, {skv})"
            ".contiguous())[1]  # pse: SDPA's float attn_mask in q's dtype, [B, N, Sq, Skv]")
    if maybe_none:
        # a mask that is None on some path (no bias there): pse=None, as SDPA's attn_mask=None
        return [f"_npufuse_pse = {src}", "if _npufuse_pse is not None:", f"    {cast}"]
    return [f"_npufuse_pse = {src}", cast]


# (s50 review) the run-time condition the pse path adds: a bool attn_mask (a helper ending in a comparison) runs the original
PSE_FLOAT_CHECK = "_npufuse_pse is None or _npufuse_pse.is_floating_point()"


def pse_risks() -> list[Risk]:
    return [Risk("numerics", "the float attn_mask (a position bias) is passed as npu_fusion_attention's `pse` in q's dtype; q is "
                             "multiplied by the scale and the call gets scale=1.0, so the result does not depend on where the op "
                             "applies its scale to pse (spec §5.1 UNCERTAIN)"),
            Risk("other", "pse is expanded to the full [B, N, Sq, Skv] shape (B·N·Sq·Skv elements in q's dtype)")]
