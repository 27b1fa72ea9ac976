"""s41 sweep c (MoE-heavy development set `bench/detect_labels_sweep41c.json`): the shapes whose first label the
scan corrected, and the MoE near misses the set pins down.

No detector changed in this pass; these tests keep the behaviour the labels were reviewed against:

* an interleaved ``rotate_half`` (``stack(-x[..., 1::2], x[..., ::2])``) fed tiled ``.repeat(1, 1, 1, 2)`` tables is
  still rewritten in 'interleave' mode with the tables as given (npu_rotary_mul's math is elementwise over full-D
  tables, so the mismatched pairing is reproduced as written);
* attention that returns its probabilities only under a flag runs fused under ``not flag``, eager otherwise;
* Mixtral loops whose experts carry their own LayerNorm stay candidates;
* capacity-limited dispatch (tokens over an expert's capacity dropped), dense softmax-gated mixtures (every expert
  on every token) and Soft MoE (softmax over the tokens into slots) get no moe_experts candidate: the dropless
  permute / grouped-matmul path computes something else, or there is no routing to replace.
"""

from __future__ import annotations

from pattern_harness import detect_all

from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.moe_experts import MoeExperts
from npufuse.patterns.rope import RopePattern

INTERLEAVED_ROTATION_TILED_TABLES = '''
import torch


def rotate_pairs(x):
    odd_negated = -x[..., 1::2]
    even = x[..., 0::2]
    return torch.stack((odd_negated, even), dim=-1).reshape(x.shape)


def rotate(x, cos, sin):
    return (x * cos) + (rotate_pairs(x) * sin)


class Attn(torch.nn.Module):
    def __init__(self, head_dim, max_len=64):
        super().__init__()
        self.head_dim = head_dim
        freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        ang = torch.outer(torch.arange(max_len).float(), freqs)
        self.register_buffer("cos_t", ang.cos()[None, None, :, :])
        self.register_buffer("sin_t", ang.sin()[None, None, :, :])

    def forward(self, q, start):
        s = q.shape[2]
        cos = self.cos_t[:, :, start:start + s, :self.head_dim // 2].repeat(1, 1, 1, 2)
        sin = self.sin_t[:, :, start:start + s, :self.head_dim // 2].repeat(1, 1, 1, 2)
        return rotate(q, cos, sin)
'''

PROBABILITIES_RETURNED_UNDER_A_FLAG = '''
import torch


class RelBiasAttention(torch.nn.Module):
    def __init__(self, dim, heads, buckets=32):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.rel = torch.nn.Embedding(buckets, heads)

    def forward(self, x, bucket_ids, want_probs=False):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / (self.head_dim ** 0.5)
        bias = self.rel(bucket_ids).permute(2, 0, 1)
        scores = scores + bias.unsqueeze(0)
        probs = torch.softmax(scores, dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, n, c)
        if want_probs:
            return out, probs
        return out
'''

MIXTRAL_LOOP_EXPERTS_WITH_OWN_NORM = '''
import torch
from torch import nn


class NormedExpert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Routed(nn.Module):
    def __init__(self, d, h, n, k=2):
        super().__init__()
        self.k = k
        self.d = d
        self.experts = nn.ModuleList([NormedExpert(d, h) for _ in range(n)])
        self.router = nn.Linear(d, n, bias=False)

    def forward(self, x):
        flat = x.view(-1, self.d)
        probs = torch.softmax(self.router(flat), dim=-1)
        top_w, top_i = torch.topk(probs, self.k, dim=-1)
        top_w = torch.softmax(top_w, dim=1, dtype=x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(top_i == e)
            out[rows] += top_w[rows, slot, None] * expert(flat[rows])
        return out.view_as(x)
'''

CAPACITY_LIMITED_LOOP = '''
import math
import torch
from torch import nn


class CappedMoE(nn.Module):
    def __init__(self, d, n, k=2, capacity_factor=1.25):
        super().__init__()
        self.k = k
        self.n = n
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([nn.Linear(d, d, bias=False) for _ in range(n)])

    def forward(self, x):
        tokens = x.shape[0]
        probs = torch.softmax(self.router(x).float(), dim=-1)
        top_p, top_i = torch.topk(probs, self.k, dim=-1)
        top_w = (top_p / top_p.sum(dim=-1, keepdim=True)).to(x.dtype)
        capacity = max(1, int(math.ceil(self.capacity_factor * tokens * self.k / self.n)))
        flat_ids = top_i.reshape(-1)
        flat_w = top_w.reshape(-1)
        flat_tok = torch.arange(tokens, device=x.device).repeat_interleave(self.k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            pos = torch.nonzero(flat_ids == e, as_tuple=False).flatten()
            if pos.numel() == 0:
                continue
            order = torch.argsort(flat_w[pos].float(), descending=True)
            kept = pos[order[:capacity]]
            rows = flat_tok[kept]
            y = expert(x.index_select(0, rows)) * flat_w[kept].unsqueeze(-1)
            out.index_add_(0, rows, y)
        return out
'''

DENSE_SOFTMAX_GATED_MIXTURE = '''
import torch
from torch import nn


class DenseMixture(nn.Module):
    def __init__(self, d_in, d_out, n):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(d_in, d_out) for _ in range(n)])
        self.w_gate = nn.Parameter(torch.zeros(d_in, n))

    def forward(self, x):
        gates = torch.softmax(x @ self.w_gate, dim=-1)
        outs = torch.stack([e(x) for e in self.experts], dim=-2)
        return (gates.unsqueeze(-1) * outs).sum(dim=-2)
'''

SOFT_MOE_SLOTS = '''
import torch
from torch import nn


class SlotMoE(nn.Module):
    def __init__(self, d, n, slots):
        super().__init__()
        self.n = n
        self.phi = nn.Parameter(torch.randn(d, n, slots) * 0.02)
        self.w = nn.Parameter(torch.randn(n, d, d) * 0.02)

    def forward(self, x):
        logits = torch.einsum("bmd,dnp->bmnp", x, self.phi)
        dispatch = logits.softmax(dim=1)
        combine = logits.flatten(start_dim=2).softmax(dim=-1).view_as(logits)
        xs = torch.einsum("bmd,bmnp->bnpd", x, dispatch)
        ys = torch.einsum("bnpd,nde->bnpe", xs, self.w)
        return torch.einsum("bnpd,bmnp->bmd", ys, combine)
'''


def test_interleaved_rotation_with_tiled_tables_is_rewritten_as_written() -> None:
    found, _ = detect_all(RopePattern(), INTERLEAVED_ROTATION_TILED_TABLES)
    (f,) = [x for x in found if x.qualname == "rotate"]
    assert f.params["mode"] == "interleave", f.params
    # the tables go in as the caller built them: no repeat_interleave / cat rebuild of cos, sin
    assert "repeat_interleave" not in f.fused and "npu_rotary_mul(" in f.fused, f.fused


def test_probabilities_returned_under_a_flag_run_fused_only_without_the_flag() -> None:
    found, _ = detect_all(AttentionPattern(), PROBABILITIES_RETURNED_UNDER_A_FLAG)
    (f,) = found
    assert "not want_probs" in f.fused, f.fused
    assert "pse=" in f.fused and "npu_fusion_attention(" in f.fused, f.fused


def test_mixtral_loop_whose_experts_carry_their_own_norm_is_a_candidate() -> None:
    (f,), _ = detect_all(MoeExperts(), MIXTRAL_LOOP_EXPERTS_WITH_OWN_NORM)
    assert f.qualname == "Routed.forward"
    # the expert's own LayerNorm rules out a grouped matmul over its weights: the modules run on permuted slices
    assert "npu_moe_token_permute(flat, top_i)" in f.fused and "_npufuse_expert(_npufuse_rows_e)" in f.fused, f.fused
    assert "npu_grouped_matmul" not in f.fused, f.fused


def test_capacity_dropping_loop_is_no_candidate() -> None:
    found, misses = detect_all(MoeExperts(), CAPACITY_LIMITED_LOOP)
    assert not found, [(f.qualname, f.variant) for f in found]
    assert any("token dropping" in m.reason for m in misses), [m.reason for m in misses]


def test_dense_softmax_gated_mixture_is_no_candidate() -> None:
    found, _ = detect_all(MoeExperts(), DENSE_SOFTMAX_GATED_MIXTURE)
    assert not found, [(f.qualname, f.variant) for f in found]


def test_soft_moe_slots_are_no_candidate() -> None:
    found, _ = detect_all(MoeExperts(), SOFT_MOE_SLOTS)
    assert not found, [(f.qualname, f.variant) for f in found]
