"""s43 rope / attention / sdpa / fused_optimizer classes read from the real HO19a / HO19b missed sites (helper
attnrope43), each with Fuse and near-miss (Keep) examples; every Fuse example runs rewritten under the emulator
against the original (outputs and gradients)."""

from __future__ import annotations

import pytest
from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.rope import RopePattern


def _emulated(pattern, code: str, run: str) -> dict:
    findings, misses = detect_all(pattern, code)
    assert findings, misses
    facts = check_rewrite_runs(pattern, code, run, findings)
    assert facts["calls"] >= len(findings), facts["all_calls"]
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999, facts
    return {"findings": findings, "misses": misses, **facts}


# --- 1. rope: the half rotation inline, each element reading its own halves of the tables -------------------------
# (HO19a deepseek-v3-mlha-moe-shakespeare RoPE.forward: ``cat([x1*cos[:h] - x2*sin[h:], x1*sin[:h] + x2*cos[h:]])``.)
# npu_rotary_mul's half mode is [x1*C[:h] - x2*S[:h], x2*C[h:] + x1*S[h:]] (spec 4.1): the written code is that with
# C = cat(cA, cC), S = cat(sB, sD); a table read the other way round is passed with its halves exchanged, so the result
# is the written code whatever the halves hold (the runs use tables with unequal halves).
_INLINE = '''
import torch


def rope(x, cos, sin):
    B, H, T, D = x.shape
    x1 = x[..., : D // 2]
    x2 = x[..., D // 2 :]
    return torch.cat([
        FIRST,
        SECOND,
    ], dim=-1)
'''

_RUN_TABLES = '''
x = torch.randn(2, 3, 5, 8, requires_grad=True)
angles = torch.rand(1, 1, 5, 8) * 3.0  # unequal halves: no duplicated freqs
out = rope(x, angles.cos(), angles.sin())
leaves = [x]
'''


@pytest.mark.parametrize("first, second", [
    ("x1 * cos[..., : D // 2] - x2 * sin[..., D // 2 :]", "x1 * sin[..., : D // 2] + x2 * cos[..., D // 2 :]"),  # the site
    ("x1 * cos[..., : D // 2] - x2 * sin[..., : D // 2]", "x2 * cos[..., D // 2 :] + x1 * sin[..., D // 2 :]"),  # in order
    ("cos[..., D // 2 :] * x1 - sin[..., D // 2 :] * x2", "cos[..., : D // 2] * x2 + sin[..., : D // 2] * x1"),  # both exchanged
    ("x1 * cos[..., : D // 2] + x2 * sin[..., D // 2 :]", "x2 * cos[..., D // 2 :] - x1 * sin[..., : D // 2]"),  # by -angle
], ids=["sin_exchanged", "in_order", "both_exchanged_tables_first", "negative_angle"])
def test_inline_rotation_with_table_halves_fuses_in_half_mode(first: str, second: str) -> None:
    code = _INLINE.replace("FIRST", first).replace("SECOND", second)
    facts = _emulated(RopePattern(), code, _RUN_TABLES)
    (f,) = facts["findings"]
    assert "cos.shape[-1] == x.shape[-1] and sin.shape[-1] == x.shape[-1]" in f.fused, f.fused


@pytest.mark.parametrize("first, second", [
    # both elements read sin's FIRST half: S = cat(s1, s1) is no half of the sin table
    ("x1 * cos[..., : D // 2] - x2 * sin[..., : D // 2]", "x1 * sin[..., : D // 2] + x2 * cos[..., D // 2 :]"),
    # the second element's sign is not a rotation's
    ("x1 * cos[..., : D // 2] - x2 * sin[..., D // 2 :]", "x1 * sin[..., : D // 2] - x2 * cos[..., D // 2 :]"),
    # the cos halves come from two tables
    ("x1 * cos[..., : D // 2] - x2 * sin[..., D // 2 :]", "x1 * sin[..., : D // 2] + x2 * sin[..., D // 2 :]"),
], ids=["one_half_twice", "wrong_sign", "two_tables"])
def test_inline_rotation_whose_tables_are_not_one_tables_halves_is_not_fused(first: str, second: str) -> None:
    findings, _misses = detect_all(RopePattern(), _INLINE.replace("FIRST", first).replace("SECOND", second))
    assert not findings


_NAMED_SWAPPED = '''
import torch


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    cos2, cos1 = cos.chunk(2, dim=-1)
    sin2, sin1 = sin.chunk(2, dim=-1)
    y1 = x1 * cos1 - x2 * sin1
    y2 = x2 * cos2 + x1 * sin2
    return torch.cat((y1, y2), dim=-1)
'''


def test_split_tables_read_the_other_way_round_pass_exchanged_tables() -> None:
    # the s42 near miss "table halves swapped against x's": exact with both tables passed halves-exchanged
    facts = _emulated(RopePattern(), _NAMED_SWAPPED, _RUN_TABLES.replace("rope(x", "apply_rope(x"))
    (f,) = facts["findings"]
    assert "_cos_swapped = torch.cat((cos[..., cos.shape[-1] // 2 :], cos[..., : cos.shape[-1] // 2]), dim=-1)" in f.fused, f.fused
    assert "_sin_swapped" in f.fused


# --- 2. rope: interleaved lane pairs stacked and merged back by a reshape in the same statement ------------------
# (HO19a ModernBabyBERTa RotaryEmbedding.forward.apply_rot: ``stack([even_rot, odd_rot], -1).reshape_as(x1)``, a partial
# rotary prefix joined to the pass-through lanes, in a function nested in forward reading the enclosing tables.)
_STACK_MERGED = '''
import torch


def rope(q, seq_len, rot_dim):
    t = torch.arange(seq_len, dtype=q.dtype)
    freqs = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=q.dtype) / rot_dim))
    ang = torch.einsum("s,d->sd", t, freqs)
    cos = torch.cos(ang)[None, :, None, :]
    sin = torch.sin(ang)[None, :, None, :]

    def apply_rot(x):
        x1 = x[..., :rot_dim]
        even, odd = x1[..., ::2], x1[..., 1::2]
        rot_even = even * cos - odd * sin
        rot_odd = SECOND
        x1_rot = torch.stack([rot_even, rot_odd], dim=-1).MERGE
        return torch.cat([x1_rot, x[..., rot_dim:]], dim=-1)

    return apply_rot(q)
'''

_RUN_STACK = '''
q = torch.randn(2, 5, 3, 8, requires_grad=True)
out = rope(q, 5, ROT)
leaves = [q]
'''


@pytest.mark.parametrize("merge, rot", [
    ("reshape_as(x1)", 8), ("view_as(x1)", 8), ("reshape_as(x1)", 4), ("reshape(*x1.shape)", 8),
], ids=["reshape_as", "view_as", "partial_prefix", "reshape_shape"])
def test_stacked_pairs_merged_in_the_same_statement_fuse_in_interleave_mode(merge: str, rot: int) -> None:
    code = _STACK_MERGED.replace("SECOND", "odd * cos + even * sin").replace("MERGE", merge)
    facts = _emulated(RopePattern(), code, _RUN_STACK.replace("ROT", str(rot)))
    assert 'rotary_mode="interleave"' in facts["findings"][0].fused


@pytest.mark.parametrize("second", [
    "odd * cos - even * sin",  # the odd lanes' sign is not a rotation's
    "odd * sin + even * cos",  # cos and sin exchanged in the second part
])
def test_stacked_pairs_that_are_no_rotation_are_not_fused(second: str) -> None:
    code = _STACK_MERGED.replace("SECOND", second).replace("MERGE", "reshape_as(x1)")
    findings, _misses = detect_all(RopePattern(), code)
    assert not findings


# --- 3. rope: the pair axis of x's (D/2, 2) view filled into an empty buffer ---------------------------------------
# (HO19a transformer-llm AttentionLayer.apply_rotary: ``q_ = q.view(*q.shape[:-1], dim // 2, 2);
# q_rot = torch.empty_like(q_); q_rot[..., 0] = ..; q_rot[..., 1] = ..`` for q and k, the allocations first.)
_PAIR_FILLS = '''
import torch


def apply_rotary(q, k, cos, sin):
    dim = q.shape[-1]
    q_ = q.view(*q.shape[:-1], dim // 2, 2)
    k_ = k.view(*k.shape[:-1], dim // 2, 2)
    q_rot = torch.empty_like(QALLOC)
    k_rot = torch.KALLOC(k_)
    q_rot[..., 0] = q_[..., 0] * cos - q_[..., 1] * sin
    q_rot[..., 1] = QSECOND
    k_rot[..., 0] = k_[..., 0] * cos - k_[..., 1] * sin
    k_rot[..., 1] = k_[..., 0] * sin + k_[..., 1] * cos
    return q_rot.view_as(q), k_rot.view_as(k)
'''

_RUN_PAIRS = '''
q = torch.randn(2, 3, 5, 8, requires_grad=True)
k = torch.randn(2, 3, 5, 8, requires_grad=True)
ang = torch.rand(1, 1, 5, 4) * 3.0
out = torch.cat(apply_rotary(q, k, ang.cos(), ang.sin()), dim=-1)
leaves = [q, k]
'''


@pytest.mark.parametrize("k_alloc", ["empty_like", "zeros_like"])
def test_fills_of_the_pair_axis_fuse_in_interleave_mode(k_alloc: str) -> None:
    code = _PAIR_FILLS.replace("QALLOC", "q_").replace("QSECOND", "q_[..., 0] * sin + q_[..., 1] * cos").replace("KALLOC", k_alloc)
    facts = _emulated(RopePattern(), code, _RUN_PAIRS)
    assert len(facts["findings"]) == 2
    assert all('rotary_mode="interleave"' in f.fused for f in facts["findings"])


def test_fills_of_the_pair_axis_of_a_buffer_shaped_like_x_are_a_near_miss() -> None:
    # empty_like(q) is [.., D]: its [..., 0] / [..., 1] are two lanes of the head dim, not the pairs
    code = _PAIR_FILLS.replace("QALLOC", "q").replace("QSECOND", "q_[..., 0] * sin + q_[..., 1] * cos").replace("KALLOC", "empty_like")
    findings, misses = detect_all(RopePattern(), code)
    assert [f.line for f in findings] == [13]  # k's site only
    assert any("not shaped like the `(.., D/2, 2)` pairs of the rotated `q`" in m.reason for m in misses), misses


def test_fills_of_the_pair_axis_that_are_no_rotation_are_not_fused() -> None:
    code = _PAIR_FILLS.replace("QALLOC", "q_").replace("QSECOND", "q_[..., 0] * sin - q_[..., 1] * cos").replace("KALLOC", "empty_like")
    findings, _misses = detect_all(RopePattern(), code)
    assert [f.line for f in findings] == [13]


# --- 4. attention: ``where(c, zeros, -inf)`` added to the scores is a mask whatever method built c ---------------
# (HO19a deepseek-v3.2-from-scratch BlockSparseAttention.forward: c is ``self.get_block_mask(..)`` expanded to tokens;
# the branches are tensors ``torch.zeros(1, ..)`` / ``torch.full((1,), float('-inf'), ..)``.)
_BLOCK_MASK = '''
import math
import torch
import torch.nn as nn
import torch.nn.functional as F


class BlockSparse(nn.Module):
    def __init__(self, dim=32, heads=4, block=2):
        super().__init__()
        self.heads, self.hd, self.block = heads, dim // heads, block
        self.qkv = nn.Linear(dim, dim * 3)
        self.table = nn.Parameter(torch.randn(16, 16))
        self.scale = 1.0 / math.sqrt(self.hd)

    def get_block_mask(self, T, device):
        n = (T + self.block - 1) // self.block
        pos = torch.arange(n, device=device)
        return (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] <= 1)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        block_mask = self.get_block_mask(T, x.device)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        token_mask = block_mask.repeat_interleave(self.block, dim=0).repeat_interleave(self.block, dim=1)[:T, :T]
        attn_mask = torch.where(token_mask, ZERO, NEG)
        scores = scores + attn_mask
        out = torch.matmul(F.softmax(scores, dim=-1), v)
        return out.transpose(1, 2).reshape(B, T, C)
'''

_RUN_BLOCK = '''
m = BlockSparse()
x = torch.randn(2, 6, 32, requires_grad=True)
out = m(x)
leaves = [x]
'''


@pytest.mark.parametrize("zero, neg", [
    ("torch.zeros(1, device=x.device, dtype=scores.dtype)", "torch.full((1,), float('-inf'), device=x.device, dtype=scores.dtype)"),
    ("0.0", "float('-inf')"),
    ("0.0", "torch.finfo(scores.dtype).min"),
], ids=["tensor_branches", "scalar_branches", "finfo_min"])
def test_a_where_zero_minus_inf_of_a_method_built_condition_is_a_mask(zero: str, neg: str) -> None:
    from npufuse.patterns.attention import AttentionPattern
    code = _BLOCK_MASK.replace("ZERO", zero).replace("NEG", neg)
    facts = _emulated(AttentionPattern(), code, _RUN_BLOCK)
    fused = facts["findings"][0].fused
    assert "atten_mask=_npufuse_mask" in fused and "pse=" not in fused, fused


@pytest.mark.parametrize("zero, neg", [
    ("0.0", "self.table[:T, :T]"),  # a learned table on the masked-out entries: a bias, not 0 / -inf
    ("0.0", "-5.0"),  # a small negative value: a graded bias that softmax does not zero
], ids=["learned_branch", "small_negative"])
def test_a_where_with_another_branch_than_minus_inf_is_not_read_as_a_mask(zero: str, neg: str) -> None:
    from npufuse.patterns.attention import AttentionPattern
    code = _BLOCK_MASK.replace("ZERO", zero).replace("NEG", neg)
    findings, misses = detect_all(AttentionPattern(), code)
    for f in findings:  # never binarised without a run-time value check
        assert "< 0  # True = masked (additive 0/-inf mask)" not in f.fused or "<= -1000.0" in f.fused, f.fused
    assert findings or misses


# --- 5. sdpa: a bool keep mask a helper builds by rebinding a local from itself ---------------------------------------
# (HO19a Large-Language-Model-GPT-4 CausalSelfAttention._apply_hierarchical: ``causal = k_idx <= q_idx + ..;
# if self.local_window > 0: causal = causal & (k_idx >= lower)``; the scan called it a float bias from positions.)
_LOCAL_CAUSAL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4, window=2):
        super().__init__()
        self.heads, self.hd, self.local_window = heads, dim // heads, window
        self.qkv = nn.Linear(dim, dim * 3)

    def _local_causal_mask(self, seq_q, seq_k, device):
        q_idx = torch.arange(seq_q, device=device).unsqueeze(-1)
        k_idx = torch.arange(seq_k, device=device).unsqueeze(0)
        causal = k_idx <= q_idx + (seq_k - seq_q)
        if self.local_window > 0:
            lower = q_idx + (seq_k - seq_q) - self.local_window
            causal = causal & (k_idx >= lower)
        return causal

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        local_mask = self._local_causal_mask(N, N, x.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=local_mask)
        return out.transpose(1, 2).reshape(B, N, C)
'''

_RUN_LOCAL = '''
m = Attention()
x = torch.randn(2, 6, 32, requires_grad=True)
out = m(x)
leaves = [x]
'''


def test_a_keep_mask_rebound_from_itself_in_a_helper_fuses_inverted() -> None:
    from npufuse.patterns.sdpa import SdpaPattern
    facts = _emulated(SdpaPattern(), _LOCAL_CAUSAL, _RUN_LOCAL)
    assert "~local_mask if local_mask.dtype == torch.bool" in facts["findings"][0].fused


@pytest.mark.parametrize("body, is_bool", [
    ("m = k <= q\n    if w:\n        m = m & (k >= q - w)\n    return m", True),
    ("m = k <= q\n    m = m | (k == 0)\n    return ~m", True),
    # a parameter rebound from itself: its value on entry is the caller's (an int tensor gives an int result)
    ("p = p & (k <= q)\n    return p", False),
    # ALiBi-like: graded distances rebound from themselves stay a float bias, never a mask
    ("m = (k - q).float()\n    m = m * w\n    return m", False),
    ("m = k <= q\n    m = m * 2.0\n    return m", False),
], ids=["if_rebound", "or_then_invert", "parameter", "alibi_graded", "scaled_to_float"])
def test_returns_bool_reads_a_local_rebound_from_itself(body: str, is_bool: bool) -> None:
    import ast

    from npufuse.patterns import _attention_s35
    fn = ast.parse(f"def mask(p, k, q, w):\n    {body}\n").body[0]
    assert _attention_s35.returns_bool(fn) is is_bool


# --- 6. attention / sdpa: the reference a kernel test compares with is no site -------------------------------------
# (HO19a llm-infer-engine test_flash_attention: ``out_ref = F.scaled_dot_product_attention(..)``, then
# ``assert torch.allclose(out_flash, out_ref)``: replacing the reference compares the kernel with another kernel.)
_KERNEL_TEST = '''
import math
import torch
import torch.nn.functional as F


def my_attention(q, k, v):
    return v  # stands in for a Triton kernel


def REFNAME(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v


def test_attention():
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    out = my_attention(q, k, v)
    out_ref = F.scaled_dot_product_attention(q, k, v)
    eager = REFNAME(q, k, v)
    assert torch.allclose(out, out_ref, atol=1e-3) and CHECK
'''


def test_the_reference_of_a_closeness_check_is_a_near_miss() -> None:
    from npufuse.patterns.attention import AttentionPattern
    from npufuse.patterns.sdpa import SdpaPattern
    code = _KERNEL_TEST.replace("REFNAME", "ref_attention").replace("CHECK", "torch.allclose(out, eager)")
    for pattern in (SdpaPattern(), AttentionPattern()):
        findings, misses = detect_all(pattern, code)
        assert not findings, findings
        assert any(m.reason.startswith("reference implementation:") for m in misses), misses


def test_attention_whose_result_no_check_reads_stays_a_site() -> None:
    from npufuse.patterns.attention import AttentionPattern
    from npufuse.patterns.sdpa import SdpaPattern
    # out_ref is only printed and the eager function is also called by model code: both are sites
    code = _KERNEL_TEST.replace("REFNAME", "attend").replace("assert torch.allclose(out, out_ref, atol=1e-3) and CHECK",
                                                             "print(out_ref, eager)\n    assert torch.allclose(out, out)") \
        + "\n\nclass Block(torch.nn.Module):\n    def forward(self, q, k, v):\n        return attend(q, k, v)\n"
    for pattern in (SdpaPattern(), AttentionPattern()):
        findings, _misses = detect_all(pattern, code)
        assert findings


# --- 7. rope: interleave-mode tables bound per branch, one batch-free, one per batch -------------------------------
# (sweep42 CS336 RotaryEmbedding.forward: ``if positions.dim() == 1: cos = cos.view(1, 1, S, -1)`` / ``elif
# positions.dim() == 2: cos = cos[:, None, :, :]``.) Interleave mode takes only 11SD / 1S1D / S11D tables: the layout
# is checked at run time, the original code runs for per-batch positions; one per-batch binding alone stays refused.
_BRANCH_TABLES = '''
import torch
import torch.nn as nn


class Rope(nn.Module):
    def __init__(self, dim=8, max_len=16):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        f = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("cos_cached", f.cos(), persistent=False)
        self.register_buffer("sin_cached", f.sin(), persistent=False)

    def forward(self, x, positions=None):
        b, h, s, d = x.shape
        if positions is None:
            positions = torch.arange(s)
BRANCHES
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return out.flatten(-2)
'''

_TWO_BRANCHES = '''        if positions.dim() == 1:
            cos = self.cos_cached[positions].view(1, 1, s, -1)
            sin = self.sin_cached[positions].view(1, 1, s, -1)
        else:
            cos = self.cos_cached[positions][:, None, :, :]
            sin = self.sin_cached[positions][:, None, :, :]'''

_RUN_BRANCHES = '''
m = Rope()
x = torch.randn(2, 3, 5, 8, requires_grad=True)
out = torch.cat([m(x), m(x, torch.stack([torch.arange(5), torch.arange(5) + 3]))], dim=-1)  # 1-D, then per-batch
leaves = [x]
'''


def test_interleave_tables_bound_per_branch_fuse_under_a_run_time_layout_check() -> None:
    facts = _emulated(RopePattern(), _BRANCH_TABLES.replace("BRANCHES", _TWO_BRANCHES), _RUN_BRANCHES)
    fused = facts["findings"][0].fused
    assert "_cs_shape[0] == 1" in fused and 'rotary_mode="interleave"' in fused, fused


def test_interleave_tables_with_one_per_batch_binding_stay_refused() -> None:
    one = ("        cos = self.cos_cached[positions][:, None, :, :]\n        sin = self.sin_cached[positions][:, None, :, :]")
    findings, misses = detect_all(RopePattern(), _BRANCH_TABLES.replace("BRANCHES", one))
    assert not findings
    assert any("interleave mode with cos/sin that may depend on the batch" in m.reason for m in misses), misses
