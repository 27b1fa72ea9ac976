"""s46 non-LLM recall sweep (helper sweep46b): the classes behind the misses on bench/detect_labels_sweep46b.json,
eight repositories labelled before npufuse was run on them (development data).

A attention: the NaN rows of the probabilities zeroed AFTER their dropout, ``torch.nan_to_num(self.dropout(
   softmax(scale * scores)))`` (Spacetimeformer / Informer-family FullAttention), on BSND einsum scores and on BNSD
   matmul scores. Dropout keeps a NaN row NaN and adds none, so the fully masked rows are zeroed in the fused output
   as for ``nan_to_num(softmax(...))``; on BSND the rows are swapped to the [B, S, N, D] output.
   Near misses: ``nan_to_num(..., nan=1.0)`` (rows set to ones, not zeros), and a scale between the dropout and the
   nan_to_num (``nan_to_num(drop(p) * w)``).
"""

from __future__ import annotations

from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.rms_norm import RmsNorm
from pattern_harness import check_rewrite_runs, detect_all, found_and_faithful

# -- A: nan_to_num after the dropout of the probabilities

_FULL_ATTENTION = '''
import numpy as np
import torch
from math import sqrt
from torch import nn


class FullAttention(nn.Module):
    def __init__(self, scale=None, attention_dropout=0.1):
        super().__init__()
        self.scale = scale
        self.dropout = nn.Dropout(attention_dropout)

    def forward(self, queries, keys, values, attn_mask):
        B, L, H, E = queries.shape
        scale = self.scale or 1.0 / sqrt(E)
        scores = torch.einsum("blhe,bshe->bhls", queries, keys)
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(1)
            scores.masked_fill_(attn_mask, -np.inf)
        A = torch.nan_to_num(self.dropout(torch.softmax(scale * scores, dim=-1)))
        V = torch.einsum("bhls,bshd->blhd", A, values)
        return V.contiguous()
'''

_PADDED_RUN = '''
attn = FullAttention().eval()
q = torch.randn(2, 5, 3, 8, requires_grad=True)
k = torch.randn(2, 7, 3, 8, requires_grad=True)
v = torch.randn(2, 7, 3, 8, requires_grad=True)
m = torch.zeros(2, 5, 7, dtype=torch.bool)
m[0, :, 4:] = True
out = attn(q, k, v, m)
leaves = [q, k, v]
'''

# a fully masked query row: NaN in the softmax, zeroed by nan_to_num (no gradient: the original's is NaN there)
_EMPTY_ROW_RUN = '''
attn = FullAttention().eval()
q = torch.randn(2, 5, 3, 8)
k = torch.randn(2, 7, 3, 8)
v = torch.randn(2, 7, 3, 8)
m = torch.zeros(2, 5, 7, dtype=torch.bool)
m[0, :, 4:] = True
m[1, 2, :] = True
out = attn(q, k, v, m)
leaves = []
'''

_BNSD = '''
import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim, heads, p=0.1):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.drop = nn.Dropout(p)

    def forward(self, x, key_padding):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        s = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        s = s.masked_fill(key_padding[:, None, None, :], float("-inf"))
        p = torch.nan_to_num(self.drop(s.softmax(dim=-1)), nan=0.0)
        return (p @ v).transpose(1, 2).reshape(b, n, c)
'''

_BNSD_RUN = '''
attn = Attention(32, 4).eval()
x = torch.randn(2, 6, 32, requires_grad=True)
pad = torch.zeros(2, 6, dtype=torch.bool)
pad[1, 4:] = True
out = attn(x, pad)
leaves = [x]
'''


def test_a_nan_to_num_after_dropout_on_bsnd_einsum_scores_is_found_and_runs() -> None:
    findings = found_and_faithful(AttentionPattern(), _FULL_ATTENTION, _PADDED_RUN)
    assert [f.qualname for f in findings] == ["FullAttention.forward"]
    assert "masked_fill(_npufuse_rows, 0)" in findings[0].fused


def test_a_fully_masked_row_is_zeroed_in_the_bsnd_fused_output() -> None:
    findings, _ = detect_all(AttentionPattern(), _FULL_ATTENTION)
    facts = check_rewrite_runs(AttentionPattern(), _FULL_ATTENTION, _EMPTY_ROW_RUN, findings)
    assert facts["calls"] >= 1
    assert all(a == b for a, b in facts["shapes"])
    assert min(facts["cos_out"]) > 0.9999


def test_a_nan_to_num_after_dropout_on_bnsd_matmul_scores_is_found_and_runs() -> None:
    findings = found_and_faithful(AttentionPattern(), _BNSD, _BNSD_RUN)
    assert [f.qualname for f in findings] == ["Attention.forward"]


def test_a_nan_set_to_one_stays_a_near_miss() -> None:
    code = _FULL_ATTENTION.replace("A = torch.nan_to_num(self.dropout(torch.softmax(scale * scores, dim=-1)))",
                                   "A = torch.nan_to_num(self.dropout(torch.softmax(scale * scores, dim=-1)), nan=1.0)")
    findings, misses = detect_all(AttentionPattern(), code)
    assert findings == []
    assert any("modified after softmax" in m.reason for m in misses)


def test_a_scale_between_dropout_and_nan_to_num_stays_a_near_miss() -> None:
    code = _BNSD.replace("p = torch.nan_to_num(self.drop(s.softmax(dim=-1)), nan=0.0)", "p = torch.nan_to_num(self.drop(s.softmax(dim=-1)) * 2.0, nan=0.0)")
    findings, misses = detect_all(AttentionPattern(), code)
    assert findings == []
    assert misses


def test_a_nan_to_num_without_dropout_on_bsnd_scores_zeroes_the_right_rows() -> None:
    # the BSND output [B, S, N, D] takes the mask's fully masked rows swapped to [B, Sq, N | 1, 1] (s33 broadcast
    # [B, 1, Sq, 1] against it, which fails or zeroes the wrong entries)
    code = _FULL_ATTENTION.replace("torch.nan_to_num(self.dropout(torch.softmax(scale * scores, dim=-1)))",
                                   "torch.nan_to_num(torch.softmax(scale * scores, dim=-1))")
    findings, _ = detect_all(AttentionPattern(), code)
    assert [f.qualname for f in findings] == ["FullAttention.forward"]
    facts = check_rewrite_runs(AttentionPattern(), code, _EMPTY_ROW_RUN, findings)
    assert facts["calls"] >= 1
    assert min(facts["cos_out"]) > 0.9999


# -- B: Shaw relative scores, each product scaled by the same factor before the sum

_SHAW = '''
import torch
from torch import nn, einsum


class Attention(nn.Module):
    def __init__(self, dim, heads=4, dim_head=8, max_pos_emb=16):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim)
        self.max_pos_emb = max_pos_emb
        self.rel_pos_emb = nn.Embedding(2 * max_pos_emb + 1, dim_head)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        h = self.heads
        q = self.to_q(x)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = (t.reshape(b, n, h, -1).transpose(1, 2) for t in (q, k, v))
        dots = einsum('b h i d, b h j d -> b h i j', q, k) * self.scale
        seq = torch.arange(n, device=x.device)
        dist = (seq[:, None] - seq[None, :]).clamp(-self.max_pos_emb, self.max_pos_emb) + self.max_pos_emb
        rel_pos_emb = self.rel_pos_emb(dist).to(q)
        pos_attn = einsum('b h n d, n r d -> b h n r', q, rel_pos_emb) * self.scale
        dots = dots + pos_attn
        if mask is not None:
            dots.masked_fill_(~mask[:, None, None, :], -torch.finfo(dots.dtype).max)
        attn = dots.softmax(dim=-1)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))
'''

_SHAW_RUN = '''
attn = Attention(32)
x = torch.randn(2, 6, 32, requires_grad=True)
mask = torch.ones(2, 6, dtype=torch.bool)
mask[1, 4:] = False
out = attn(x, mask=mask)
leaves = [x]
'''


def test_b_shaw_relative_scores_scaled_on_each_side_are_found_and_run() -> None:
    findings = found_and_faithful(AttentionPattern(), _SHAW, _SHAW_RUN)
    assert [f.qualname for f in findings] == ["Attention.forward"]
    assert "pse=" in findings[0].fused


def test_b_both_sides_divided_by_the_same_root_are_found_and_run() -> None:
    code = _SHAW.replace("q, k) * self.scale", "q, k) / self.root").replace("rel_pos_emb) * self.scale", "rel_pos_emb) / self.root") \
        .replace("self.scale = dim_head ** -0.5", "self.root = dim_head ** 0.5")
    findings = found_and_faithful(AttentionPattern(), code, _SHAW_RUN)
    assert [f.qualname for f in findings] == ["Attention.forward"]


def test_b_different_factors_on_the_two_sides_stay_a_near_miss() -> None:
    code = _SHAW.replace("rel_pos_emb) * self.scale", "rel_pos_emb) * 0.5")
    findings, misses = detect_all(AttentionPattern(), code)
    assert findings == []
    assert any("scores added to scores" in m.reason for m in misses)


# -- C: rms_norm, a tiny literal eps added outside the root in a forward the numeric probe cannot run

_ADA_RMS = '''
import torch
import torch.nn.functional as F
from torch import nn


class AdaRMSNorm(nn.Module):
    def __init__(self, feature_dim, cond_dim):
        super().__init__()
        self.epsilon = 1e-8
        self.cond_proj = nn.Linear(cond_dim, feature_dim, bias=False)

    def forward(self, input, condition):
        rms = input.pow(2).mean(dim=-1, keepdim=True).sqrt()
        norm_input = input / (rms + self.epsilon)
        condition = F.silu(condition)
        cond_scale = self.cond_proj(condition).unsqueeze(1)
        scaled_input = norm_input * (1.0 + cond_scale)
        return scaled_input
'''

_ADA_RMS_RUN = '''
m = AdaRMSNorm(16, 8)
x = torch.randn(2, 5, 16, requires_grad=True)
c = torch.randn(2, 8)
out = m(x, c)
leaves = [x]
'''


def test_c_tiny_eps_outside_the_root_in_an_ada_rms_norm_is_found_and_runs() -> None:
    findings = found_and_faithful(RmsNorm(), _ADA_RMS, _ADA_RMS_RUN)
    assert [f.qualname for f in findings] == ["AdaRMSNorm.forward"]
    assert "epsilon=(self.epsilon) ** 2" in findings[0].fused
    assert any("outside the square root" in r.detail for r in findings[0].risks)


def test_c_literal_tiny_eps_outside_the_root_is_found() -> None:
    code = _ADA_RMS.replace("input / (rms + self.epsilon)", "input / (torch.sqrt(input.pow(2).mean(-1, keepdim=True)) + 1e-8)")
    findings = found_and_faithful(RmsNorm(), code, _ADA_RMS_RUN)
    assert "epsilon=(1e-08) ** 2" in findings[0].fused or "epsilon=(1e-8) ** 2" in findings[0].fused


def test_c_a_larger_eps_outside_the_root_stays_a_near_miss() -> None:
    code = _ADA_RMS.replace("self.epsilon = 1e-8", "self.epsilon = 1e-5")
    findings, misses = detect_all(RmsNorm(), code)
    assert findings == []
    assert any("eps outside the sqrt" in m.reason for m in misses)


def test_c_an_eps_handed_in_stays_a_near_miss() -> None:
    code = _ADA_RMS.replace("def __init__(self, feature_dim, cond_dim):", "def __init__(self, feature_dim, cond_dim, eps=1e-8):") \
        .replace("self.epsilon = 1e-8", "self.epsilon = eps")
    findings, misses = detect_all(RmsNorm(), code)
    assert findings == []
    assert any("eps outside the sqrt" in m.reason for m in misses)


_ADD_THEN_EPS_OUTSIDE_NORM = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.epsilon = 1e-8

    def forward(self, input):
        rms = input.pow(2).mean(dim=-1, keepdim=True).sqrt()
        norm_input = input / (rms + self.epsilon)
        return norm_input * self.scale


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attention = nn.Linear(d, d)
        self.att_norm = RMSNorm(d)
        self.ff_norm = RMSNorm(d)
        self.feed_forward = nn.Linear(d, d)

    def forward(self, x):
        h = x + self.attention(self.att_norm(x))
        return h + self.feed_forward(self.ff_norm(h))
'''


def test_c_an_add_into_an_eps_outside_norm_stays_unfused_for_add_rms_norm() -> None:
    # npu_add_rms_norm readers keep the s36 refusal (the development labels of such add + norm pairs are keeps);
    # the norm itself is an rms_norm candidate
    findings, _ = detect_all(AddRmsNorm(), _ADD_THEN_EPS_OUTSIDE_NORM)
    assert findings == []
    norms, _ = detect_all(RmsNorm(), _ADD_THEN_EPS_OUTSIDE_NORM)
    assert [f.qualname for f in norms] == ["RMSNorm.forward"]
