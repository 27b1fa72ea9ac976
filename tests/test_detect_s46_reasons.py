"""s46 reasons46: near-miss reasons on development misses that asserted a fact npufuse had not established.

1. moe_experts: ``if len(expert_indices) > 0:`` around the dispatch, with ``expert_indices`` from a dense dispatch
   mask handed in (HO22a sparse-moe-pytorch): reported "conditional code inside the expert loop", yet an emptiness
   guard changes nothing when the rows are the expert's own; the blocker is that npufuse does not read those rows.
   The reason now names the unread rows. Twin: a threshold (``> 1``) keeps the old, true reason (as do the pattern's
   Keeps on a weight sum ``if topk_weight.sum():`` and on another expert's count).
2. attention: a 3-D einsum outside [B, S, D] (unbatched [N, H, D] heads, HO22b graph-transformers) was "not attention";
   the reason now says which 3-D layout npufuse maps.
3. swiglu: ``gate * silu(X)`` with both operands parameters (HO12a ppl.pmx autograd Function) was "not projections of
   one input"; now "parameters ... whose callers npufuse did not read". Twin: a computed operand keeps the old text.
4. attention: 5-D q/k/v (sweep42 minAlphaFold2) "the eager matmuls broadcast over other leading dims" -> "npufuse
   could not fold the other leading dims into the batch here".
5. attention: a scale ``w if w is not None else 1.0`` is a tensor on one arm only (moesweep42 UltraThinking).
"""

from __future__ import annotations

from pattern_harness import detect_all
from npufuse.patterns.moe_experts import MoeExperts


def _near_miss(pattern, code: str) -> str:
    findings, misses = detect_all(pattern, code)
    assert not findings, findings[0].fused
    assert misses
    return " | ".join(m.reason for m in misses)


DENSE_DISPATCH = '''
import torch
from torch import nn


class Dispatcher(nn.Module):
    def forward(self, x, dispatch_mask, combine_weights, experts):
        _, num_experts = dispatch_mask.shape
        output = torch.zeros_like(x)
        for i in range(num_experts):
            expert_indices = dispatch_mask[:, i].nonzero(as_tuple=True)[0]
            if len(expert_indices) > 0:
                expert_inputs = x[expert_indices]
                expert_outputs = experts[i](expert_inputs)
                expert_weights = combine_weights[expert_indices, i].unsqueeze(1)
                output[expert_indices] += expert_outputs * expert_weights
        return output
'''


def test_unread_rows_under_an_emptiness_guard_name_the_rows() -> None:
    for guard in ("len(expert_indices) > 0", "expert_indices.numel() > 0", "expert_indices.shape[0] != 0"):
        reason = _near_miss(MoeExperts(), DENSE_DISPATCH.replace("len(expert_indices) > 0", guard))
        assert "conditional code" not in reason, reason
        assert "npufuse does not read `expert_indices`" in reason, reason
        assert "dispatch_mask[:, i].nonzero" in reason, reason


def test_threshold_guard_keeps_conditional_code() -> None:
    # skips experts with one token too: a real change of result, not an emptiness test
    reason = _near_miss(MoeExperts(), DENSE_DISPATCH.replace("len(expert_indices) > 0", "len(expert_indices) > 1"))
    assert "conditional code inside the expert loop: `if len(expert_indices) > 1`" in reason, reason


UNBATCHED_HEADS = '''
import torch
from torch import nn


class GraphAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, adj):
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, self.h, self.d).unbind(1)
        scores = torch.einsum("nhd,mhd->nhm", q, k) / self.d ** 0.5
        scores = scores.masked_fill(~adj.unsqueeze(1), float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        return torch.einsum("nhm,mhd->nhd", attn, v).reshape(N, -1)
'''


def test_unbatched_multi_head_einsum_is_not_called_not_attention() -> None:
    # [S, H, D] operands with no batch axis: attention all the same; npufuse does not map the layout
    from npufuse.patterns.attention import AttentionPattern
    reason = _near_miss(AttentionPattern(), UNBATCHED_HEADS)
    assert "not [B, S, D] attention" not in reason, reason
    # attn46 (merged beside this) names the unbatched multi-head form itself; the generic text covers the rest
    assert ("npufuse maps a 3-D product only with [B, S, D] operands" in reason
            or "attention over 3-D operands whose shared axis" in reason), reason


GATE_FUNCTION = '''
import torch


class SiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, gate=None):
        Y = torch.nn.functional.silu(X)
        if gate is not None:
            return gate * Y
        return Y


def silu(X, gate=None):
    return SiLU.apply(X, gate)
'''


def test_gate_handed_in_is_not_called_another_input() -> None:
    # X and gate are handed in (callers elsewhere pass two projections of one input): npufuse cannot tell
    from npufuse.patterns.swiglu import Swiglu
    reason = _near_miss(Swiglu(), GATE_FUNCTION)
    assert "not projections of one input" not in reason, reason
    assert "`X` and `gate` are parameters of the function whose callers npufuse did not read" in reason, reason


def test_gate_computed_from_another_value_keeps_the_fact() -> None:
    # the gated value is a computed output (an SSM-like cumulative sum), not a parameter: the old reason is the fact
    from npufuse.patterns.swiglu import Swiglu
    code = GATE_FUNCTION.replace("        Y = torch.nn.functional.silu(X)\n",
                                 "        Y = torch.nn.functional.silu(X)\n        gate = X.cumsum(1)\n")
    reason = _near_miss(Swiglu(), code)
    assert "not projections of one input" in reason, reason


# the projections every attention snippet below starts from
QKV_INIT = '''
    def __init__(self, dim, heads):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, heads)
'''

FIVE_D_WITH_BIAS = '''
import torch
from torch import nn


class RowAttentionWithPairBias(nn.Module):''' + QKV_INIT + '''

    def forward(self, m, z, keep):
        B, S, R, _ = m.shape
        q = self.q(m).view(B, S, R, self.h, self.d).permute(0, 1, 3, 2, 4)
        k = self.k(m).view(B, S, R, self.h, self.d).permute(0, 1, 3, 2, 4)
        v = self.v(m).view(B, S, R, self.h, self.d).permute(0, 1, 3, 2, 4)
        bias = self.b(z).permute(0, 3, 1, 2).unsqueeze(1)
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.d ** 0.5 + bias
        scores = scores.masked_fill(~keep[:, :, None, None, :], -1e9)
        attn = torch.softmax(scores, dim=-1)
        return torch.matmul(attn, v)
'''


def test_five_d_operands_do_not_claim_a_broadcast() -> None:
    # q / k / v share their leading dims (nothing broadcasts); the bool mask beside them is what npufuse does not fold
    from npufuse.patterns.attention import AttentionPattern
    reason = _near_miss(AttentionPattern(), FIVE_D_WITH_BIAS)
    assert "is 5-D" in reason and "broadcast over other leading dims" not in reason, reason
    assert "npufuse could not fold the other leading dims into the batch here" in reason, reason


CONDITIONAL_SCALE = '''
import math
import torch
import torch.nn.functional as F
from torch import nn


class CrossAttention(nn.Module):''' + QKV_INIT + '''
    def forward(self, x, weights=None):
        B = x.shape[0]
        q = self.q(x).view(B, -1, self.h, self.d).transpose(1, 2)
        k = self.k(x).view(B, -1, self.h, self.d).transpose(1, 2)
        v = self.v(x).view(B, -1, self.h, self.d).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d)
        if weights is not None:
            weights_expanded = weights.unsqueeze(1).expand_as(scores)
            scores = scores * weights_expanded
        attn = F.softmax(scores, dim=-1)
        return torch.matmul(attn, v)
'''


def test_conditional_tensor_scale_says_one_arm() -> None:
    # the scale is a tensor only when weights are given; without them it is 1.0
    from npufuse.patterns.attention import AttentionPattern
    reason = _near_miss(AttentionPattern(), CONDITIONAL_SCALE)
    assert "is a tensor on one arm of the condition" in reason, reason
