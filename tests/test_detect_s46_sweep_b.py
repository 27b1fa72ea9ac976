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

from npufuse.patterns.attention import AttentionPattern
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
