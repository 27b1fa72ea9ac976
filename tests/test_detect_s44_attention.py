"""s44 (helper attn44): attention classes read from real development misses.

* gpt-oss attention sinks (HO20a gongyisheng gpt_oss/layers.py, HO12a FMS ``_math_attention_with_sinks_op``): a per-head
  logit column concatenated to the scores before the softmax and dropped after is npu_fusion_attention's ``sink``
  (spec 5.1: float32 [head_num], unscaled). Only a single last column proved [1, N, 1, 1] (expanded) is passed.
* 4-D einsum scores whose softmax runs over the key axis the P@V einsum contracts, not the last (sweep41b LoFTR
  ``nlsh`` dim 2, sweep42 minAlphaFold2 global column attention ``btih`` dim 1, Transformer-XL ``ijbn`` dim 1).

Every Fuse example runs rewritten under the emulator against the original (outputs and gradients, including the
sink parameter's); each near miss states a true reason.
"""

from __future__ import annotations

import pytest
from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.attention import AttentionPattern

# gongyisheng-style GQA block: a [1, N, 1, 1] sink parameter expanded, the row max subtracted, GQA by repeat_interleave,
# an additive mask and a sliding-window masked_fill_ under a condition, the four-index slice
_GPT_OSS_BLOCK = '''
import torch
from torch import nn
import torch.nn.functional as F


class GroupQueryAttention(nn.Module):
    def __init__(self, d=32, n_heads=4, n_kv=2, head_dim=8, layer_idx=0, window=3):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.group = n_heads // n_kv
        self.layer_idx, self.window = layer_idx, window
        self.sinks = nn.Parameter(torch.randn(1, n_heads, 1, 1))
        self.q_proj = nn.Linear(d, n_heads * head_dim)
        self.k_proj = nn.Linear(d, n_kv * head_dim)
        self.v_proj = nn.Linear(d, n_kv * head_dim)
        self.out = nn.Linear(n_heads * head_dim, d)

    def forward(self, x, attn_mask=None):
        b, t, _ = x.shape
        Q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        K = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        V = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        K = K.repeat_interleave(self.group, dim=1)
        V = V.repeat_interleave(self.group, dim=1)
        scores = Q @ K.transpose(-2, -1) / self.head_dim ** 0.5
        if attn_mask is not None:
            scores += attn_mask
        _, _, q_len, kv_len = scores.shape
        if self.layer_idx % 2 == 0 and kv_len > self.window:
            mask = torch.tril(torch.ones(q_len, kv_len, device=x.device), diagonal=-self.window).bool()
            scores.masked_fill_(mask, float("-inf"))
        sinks = self.sinks.expand(b, -1, q_len, -1)
        scores = torch.concat([scores, sinks], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        attn = F.softmax(scores, dim=-1, dtype=scores.dtype)
        attn = attn[:, :, :, :-1]
        context = attn @ V
        return self.out(context.transpose(1, 2).reshape(b, t, -1))
'''

_RUN_GPT_OSS = '''
outs, leaves = [], []
for layer_idx in (0, 1):
    m = GroupQueryAttention(layer_idx=layer_idx)
    x = torch.randn(2, 6, 32, requires_grad=True)
    outs += [m(x), m(x, torch.full((6, 6), float("-inf")).triu(1))]
    leaves += [x, m.sinks]
out = outs
'''

# FMS / gpt-oss reference text: a 1-D sink vector indexed to [1, N, 1, 1], an einsum, torch.cat((..), -1), dropout off
_INDEXED_SINKS = '''
import torch


def sink_attention(q, k, v, sinks, scale, mask=None):
    b, h, t, _ = q.shape
    qk = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if mask is not None:
        qk = qk + mask
    col = sinks[None, :, None, None].expand(b, h, t, 1)
    w = torch.softmax(torch.cat((qk, col), dim=-1), dim=-1)
    return torch.matmul(w[..., :-1], v)
'''

_RUN_INDEXED = '''
q, k, v = (torch.randn(2, 4, 5, 8, requires_grad=True) for _ in range(3))
sinks = torch.randn(4, requires_grad=True)
causal = torch.full((5, 5), float("-inf")).triu(1)
out = (sink_attention(q, k, v, sinks, 8 ** -0.5), sink_attention(q, k, v, sinks, 8 ** -0.5, causal))
leaves = [q, k, v, sinks]
'''

# a [N, 1, 1] parameter (expand prepends the batch axis)
_THREE_D_PARAMETER = '''
import torch
from torch import nn


class SinkAttention(nn.Module):
    def __init__(self, heads=4):
        super().__init__()
        self.sink = nn.Parameter(torch.zeros(heads, 1, 1))

    def forward(self, q, k, v):
        b, h, t, d = q.shape
        s = torch.matmul(q, k.transpose(-1, -2)) * d ** -0.5
        s = torch.cat([s, self.sink.expand(b, -1, t, -1)], dim=-1)
        p = s.softmax(dim=-1)[..., :-1]
        return p @ v
'''

_RUN_THREE_D = '''
m = SinkAttention()
with torch.no_grad():
    m.sink.copy_(torch.randn(4, 1, 1))
q, k, v = (torch.randn(2, 4, 5, 8, requires_grad=True) for _ in range(3))
out = m(q, k, v)
leaves = [q, k, v, m.sink]
'''


def _emulated(code: str, run: str) -> dict:
    (f,), _misses = detect_all(AttentionPattern(), code)
    facts = check_rewrite_runs(AttentionPattern(), code, run, [f])
    assert facts["calls"] >= 1, facts["all_calls"]
    assert all(a == b for a, b in facts["dtypes"]) and all(a == b for a, b in facts["shapes"])
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999, facts
    return {"finding": f, **facts}


def _near_miss(code: str) -> str:
    findings, misses = detect_all(AttentionPattern(), code)
    assert not findings, findings[0].params
    assert misses
    return " | ".join(m.reason for m in misses)


def test_gpt_oss_sink_parameter_goes_to_the_sink_argument() -> None:
    facts = _emulated(_GPT_OSS_BLOCK, _RUN_GPT_OSS)
    assert "sink=self.sinks.reshape(-1).float()" in facts["finding"].fused
    assert any("aclnnFlashAttentionScoreV3" in r.detail for r in facts["finding"].risks)


def test_an_indexed_sink_vector_with_a_mask_fuses() -> None:
    facts = _emulated(_INDEXED_SINKS, _RUN_INDEXED)
    assert "sink=sinks.reshape(-1).float()" in facts["finding"].fused


def test_a_three_d_sink_parameter_fuses() -> None:
    _emulated(_THREE_D_PARAMETER, _RUN_THREE_D)


@pytest.mark.parametrize(("old", "new"), [
    # two sink columns, one dropped: the kept column is a probability npu_fusion_attention has no value for
    ("col = sinks[None, :, None, None].expand(b, h, t, 1)", "col = sinks[None, :, None, None].expand(b, h, t, 2)"),
    # two columns dropped: a key's probability is dropped with the sink's
    ("w[..., :-1]", "w[..., :-2]"),
    # a per-row sink (one logit per query row, not per head): `sink` takes [head_num]
    ("col = sinks[None, :, None, None].expand(b, h, t, 1)", "col = sinks.unsqueeze(-1)"),
    # the sink prepended and the first column dropped: not the form npufuse reads
    ("torch.cat((qk, col), dim=-1)", "torch.cat((col, qk), dim=-1)"),
])
def test_sink_columns_npufuse_does_not_prove_per_head_stay_near_misses(old: str, new: str) -> None:
    code = _INDEXED_SINKS.replace(old, new).replace("w[..., :-1]", "w[..., 1:]") if "(col, qk)" in new else _INDEXED_SINKS.replace(old, new)
    assert code != _INDEXED_SINKS
    assert "attention sinks" in _near_miss(code)


def test_a_sink_column_scaled_with_the_scores_stays_a_near_miss() -> None:
    # the scale after the concatenation multiplies the sink too: npu_fusion_attention's sink is not scaled (spec 5.1)
    code = _INDEXED_SINKS.replace("torch.softmax(torch.cat((qk, col), dim=-1), dim=-1)", "torch.softmax(torch.cat((qk, col), dim=-1) * 2.0, dim=-1)")
    assert code != _INDEXED_SINKS
    # s48 (sink48): the reason names the obstacle itself, not the generic "modified after softmax"
    reason = _near_miss(code)
    assert "attention sinks scaled with the scores" in reason and "not scaled" in reason, reason


# -- softmax over a key axis that is not the last -------------------------------------------------------------------

# LoFTR FullAttention: [N, L, S, H] scores, softmax over dim 2, an in-place masked_fill_ of a key-padding product
_LOFTR = '''
import torch
from torch import nn


class FullAttention(nn.Module):
    def __init__(self, use_dropout=False, attention_dropout=0.1):
        super().__init__()
        self.use_dropout = use_dropout
        self.dropout = nn.Dropout(attention_dropout)

    def forward(self, queries, keys, values, q_mask=None, kv_mask=None):
        QK = torch.einsum("nlhd,nshd->nlsh", queries, keys)
        if kv_mask is not None:
            QK.masked_fill_(~(q_mask[:, :, None, None] * kv_mask[:, None, :, None]), float('-inf'))
        softmax_temp = 1. / queries.size(3) ** .5
        A = torch.softmax(softmax_temp * QK, dim=2)
        if self.use_dropout:
            A = self.dropout(A)
        queried_values = torch.einsum("nlsh,nshd->nlhd", A, values)
        return queried_values.contiguous()
'''

_RUN_LOFTR = '''
m = FullAttention()
q = torch.randn(2, 6, 4, 8, requires_grad=True)
k = torch.randn(2, 7, 4, 8, requires_grad=True)
v = torch.randn(2, 7, 4, 8, requires_grad=True)
qm = torch.ones(2, 6, dtype=torch.bool)
km = torch.ones(2, 7, dtype=torch.bool)
km[1, 5:] = False
out = (m(q, k, v), m(q, k, v, qm, km))
leaves = [q, k, v]
'''

# AlphaFold global column attention: one mean query per head, keys / values shared by the heads ([b, t, i, c]),
# scores [b, t, i, h] normalised over the sequences t (dim 1), a -1e9 key-padding bias
_GLOBAL_COLUMN = '''
import math
import torch
from torch import nn


class GlobalColumnAttention(nn.Module):
    def __init__(self, c_in=16, heads=4, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.linear_q = nn.Linear(c_in, heads * head_dim, bias=False)
        self.linear_k = nn.Linear(c_in, head_dim, bias=False)
        self.linear_v = nn.Linear(c_in, head_dim, bias=False)

    def forward(self, x, msa_mask=None):
        b, s, i, _ = x.shape
        K = self.linear_k(x)
        V = self.linear_v(x)
        Q = self.linear_q(x).reshape(b, s, i, self.heads, self.head_dim).mean(dim=1)
        scores = torch.einsum('bihc, btic -> btih', Q, K)
        scores = scores / math.sqrt(self.head_dim)
        if msa_mask is not None:
            scores = scores + (1.0 - msa_mask[:, :, :, None]) * (-1e9)
        attention = torch.nn.functional.softmax(scores, dim=1)
        return torch.einsum('btih, btic -> bihc', attention, V)
'''

_RUN_GLOBAL_COLUMN = '''
m = GlobalColumnAttention()
x = torch.randn(2, 5, 6, 16, requires_grad=True)
msk = torch.ones(2, 5, 6)
msk[1, 3:, :] = 0
out = (m(x), m(x, msk))
leaves = [x]
'''

# Transformer-XL text without the positional term: sequence-first [Sq, Skv, B, N] scores, softmax over dim 1
_SEQUENCE_FIRST = '''
import torch
import torch.nn.functional as F


def seq_first_attention(q, k, v, scale, attn_mask=None):
    score = torch.einsum("ibnd,jbnd->ijbn", q, k)
    score.mul_(scale)
    if attn_mask is not None:
        score = score.masked_fill(attn_mask[:, :, None, None], -float("inf"))
    attn = F.softmax(score, dim=1)
    return torch.einsum("ijbn,jbnd->ibnd", attn, v)
'''

_RUN_SEQUENCE_FIRST = '''
q = torch.randn(5, 2, 3, 8, requires_grad=True)
k = torch.randn(7, 2, 3, 8, requires_grad=True)
v = torch.randn(7, 2, 3, 8, requires_grad=True)
m = torch.ones(5, 7, dtype=torch.bool).triu(3)
out = (seq_first_attention(q, k, v, 0.3), seq_first_attention(q, k, v, 0.3, m))
leaves = [q, k, v]
'''


@pytest.mark.parametrize("dim", ["2", "-2"])
def test_loftr_scores_softmax_over_their_key_axis_fuse(dim: str) -> None:
    facts = _emulated(_LOFTR.replace("dim=2)", f"dim={dim})"), _RUN_LOFTR)
    fused = facts["finding"].fused
    assert "permute(0, 3, 1, 2)" in fused and "<= 256" in fused  # mask terms to BNSD; the head axis checked at run time


def test_loftr_with_dropout_on_fuses() -> None:
    _emulated(_LOFTR, _RUN_LOFTR.replace("m = FullAttention()", "m = FullAttention(use_dropout=True, attention_dropout=0.0)"))


def test_global_column_attention_over_sequences_fuses() -> None:
    _emulated(_GLOBAL_COLUMN, _RUN_GLOBAL_COLUMN)


def test_sequence_first_scores_fuse() -> None:
    _emulated(_SEQUENCE_FIRST, _RUN_SEQUENCE_FIRST)


def test_a_softmax_over_the_query_axis_stays_a_near_miss() -> None:
    assert "softmax over dim 1" in _near_miss(_LOFTR.replace("dim=2)", "dim=1)"))


def test_a_softmax_over_the_last_axis_that_the_values_do_not_contract_stays_a_near_miss() -> None:
    # dim=-1 is the heads here; the P@V einsum contracts the keys (axis 2)
    assert "does not contract the probabilities' last (key) axis" in _near_miss(_LOFTR.replace("dim=2)", "dim=-1)"))


def test_scores_whose_query_and_key_letters_swap_fuse_with_the_roles_swapped() -> None:
    # Q@Kᵀ writes k's positions on axis 1 and q's on axis 2; the softmax and P@V run over axis 2 (q's positions):
    # attention with k as the queries and q as the keys, which the letters say and the fused call computes
    code = _LOFTR.replace('"nlhd,nshd->nlsh"', '"nlhd,nshd->nslh"')
    run = _RUN_LOFTR.replace("v = torch.randn(2, 7, 4, 8", "v = torch.randn(2, 6, 4, 8").replace("out = (m(q, k, v), m(q, k, v, qm, km))", "out = m(q, k, v)")
    _emulated(code, run)


def test_a_softmax_over_another_axis_than_the_values_contract_stays_a_near_miss() -> None:
    # softmax over the keys (axis 2), the values contracted with axis 1 (the queries): not attention
    code = _LOFTR.replace('"nlsh,nshd->nlhd", A, values', '"nlsh,nlhd->nshd", A, values')
    assert code != _LOFTR
    assert "softmax over dim 2" in _near_miss(code)


def test_sequence_first_softmax_over_the_query_axis_stays_a_near_miss() -> None:
    assert "softmax over dim 0" in _near_miss(_SEQUENCE_FIRST.replace("dim=1)", "dim=0)"))


# -- query rows zeroed after the softmax (retention's SelfAttention, 4-D here so the fused branch runs) ---------------

_ZEROED_ROWS = '''
import math
import torch
from torch import nn


class MHA(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d)
        self.drop = nn.Dropout(0.0)

    def forward(self, x, padding_mask=None):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.dh)
        if padding_mask is not None:
            padding_mask = padding_mask.to(scores.device)
            scores = scores.masked_fill(padding_mask[:, None, None, :], float("-inf"))
        w = torch.softmax(scores, dim=-1)
        w = self.drop(w)
        if padding_mask is not None:
            w = w.masked_fill(padding_mask[:, None, :, None], 0.0)
        out = w @ v
        return out.transpose(1, 2).reshape(b, t, -1)
'''

_RUN_ZEROED_ROWS = '''
m = MHA()
x = torch.randn(2, 6, 32, requires_grad=True)
pad = torch.zeros(2, 6, dtype=torch.bool)
pad[1, 4:] = True
out = (m(x), m(x, pad))
leaves = [x]
'''

# unconditional, a keep mask negated and unsqueezed, the output not transposed back
_ZEROED_ROWS_PLAIN = '''
import torch


def attend(q, k, v, keep):
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    p = s.softmax(dim=-1)
    p = p.masked_fill(~keep[:, None, :].unsqueeze(-1), 0)
    return torch.matmul(p, v)
'''

_RUN_ZEROED_ROWS_PLAIN = '''
q, k, v = (torch.randn(2, 3, 5, 8, requires_grad=True) for _ in range(3))
keep = torch.ones(2, 5, dtype=torch.bool)
keep[0, 3:] = False
out = attend(q, k, v, keep)
leaves = [q, k, v]
'''


def test_padded_query_rows_zeroed_under_a_flag_are_zero_rows_of_the_fused_output() -> None:
    facts = _emulated(_ZEROED_ROWS, _RUN_ZEROED_ROWS)
    fused = facts["finding"].fused
    assert ")[0].masked_fill(" in fused and "[:, None, :, None]) if" in fused  # the row mask, only where the flag holds


def test_query_rows_zeroed_unconditionally_fuse() -> None:
    _emulated(_ZEROED_ROWS_PLAIN, _RUN_ZEROED_ROWS_PLAIN)


@pytest.mark.parametrize(("old", "new", "reason"), [
    # keys zeroed (not rows) under the flag: a per-key change of the probabilities
    ("padding_mask[:, None, :, None], 0.0", "padding_mask[:, None, None, :], 0.0", "modified after softmax"),
    # rows set to 0.5, not 0: no longer zero rows of the output
    ("padding_mask[:, None, :, None], 0.0", "padding_mask[:, None, :, None], 0.5", "modified after softmax"),
    # the probabilities transposed before the product: the zeroed rows are no longer the output's rows
    ("out = w @ v", "out = w.transpose(-1, -2) @ v", "transposed"),
])
def test_other_changes_after_the_softmax_stay_near_misses(old: str, new: str, reason: str) -> None:
    code = _ZEROED_ROWS.replace(old, new)
    assert code != _ZEROED_ROWS
    assert reason in _near_miss(code)


def test_a_row_mask_of_unknown_key_size_stays_a_near_miss() -> None:
    # ``rows`` comes from the caller: its last size is not known to be 1 (it may be a [B, 1, Sq, Skv] key mask)
    code = _ZEROED_ROWS_PLAIN.replace("def attend(q, k, v, keep):", "def attend(q, k, v, keep, rows):").replace(
        "p.masked_fill(~keep[:, None, :].unsqueeze(-1), 0)", "p.masked_fill(rows, 0)")
    assert "modified after softmax" in _near_miss(code)


def test_zeroed_rows_beside_an_einsum_output_in_another_layout_stay_a_near_miss() -> None:
    # the einsum writes the output [B, Sq, N, D]: the row mask laid out for [B, N, Sq, Skv] does not broadcast the same
    code = _ZEROED_ROWS_PLAIN.replace("return torch.matmul(p, v)", 'return torch.einsum("bhqk,bhkd->bqhd", p, v)')
    assert "does not keep the probabilities' axes" in _near_miss(code)


# Fastformer additive attention (particleflow): softmax weights pooled by one-operand einsums, then an elementwise
# einsum with the values (``b j, b n j -> b n j`` sums no axis). Not softmax(QKᵀ) attention: the s43 judge found the
# reason "attention probabilities are modified after softmax" false there; no product with the values exists to read.
_FASTFORMER = '''
import torch
from torch import nn


class Fastformer(nn.Module):
    def __init__(self, dim=3, decode_dim=16):
        super().__init__()
        self.weight_q = nn.Linear(dim, decode_dim, bias=False)
        self.weight_k = nn.Linear(dim, decode_dim, bias=False)
        self.weight_v = nn.Linear(dim, decode_dim, bias=False)
        self.weight_alpha = nn.Parameter(torch.randn(decode_dim))
        self.weight_beta = nn.Parameter(torch.randn(decode_dim))
        self.scale_factor = decode_dim ** -0.5

    def forward(self, x):
        query, key, value = self.weight_q(x), self.weight_k(x), self.weight_v(x)
        b, n, d = query.shape
        alpha = torch.softmax(torch.mul(query, self.weight_alpha) * self.scale_factor, dim=1)
        global_query = torch.einsum("b n d -> b d", query * alpha)
        p = global_query[:, None, :] * key
        beta = torch.softmax(torch.mul(p, self.weight_beta) * self.scale_factor, dim=1)
        global_key = torch.einsum("b n d -> b d", p * beta)
        return torch.einsum("b j, b n j -> b n j", global_key, value) + query
'''


def test_fastformer_additive_attention_is_not_reported_as_modified_probabilities() -> None:
    findings, misses = detect_all(AttentionPattern(), _FASTFORMER)
    assert not findings
    assert not any("modified after softmax" in m.reason for m in misses), [m.reason for m in misses]


def test_band_products_concatenated_and_sliced_are_not_called_attention_sinks() -> None:
    # BigBird block-sparse attention: several band products concatenated on the key axis, the probabilities sliced back
    # per band; there is no sink column (the old reason said "attention sinks")
    code = _INDEXED_SINKS.replace("col = sinks[None, :, None, None].expand(b, h, t, 1)", "col = qk * 0.5").replace(
        "torch.cat((qk, col), dim=-1)", "torch.cat((qk, col, qk, col), dim=-1)")
    assert code != _INDEXED_SINKS
    reasons = _near_miss(code)
    assert "attention sinks" not in reasons and "modified after softmax" in reasons
