"""s43 (helper mla43): eager attention whose 4-D scores put the heads after the query axis -- DeepSeek-V3's inference
MLA text (``einsum("bshd,bthd->bsht", q, k)``, ``scores += mask.unsqueeze(1)``, ``softmax(-1)``,
``einsum("bsht,bthd->bshd", scores, v)``), copied into many repositories. Fuse examples run rewritten under the
emulator against the original (outputs and gradients); each near miss states a true reason."""

from __future__ import annotations

import pytest
from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.attention import AttentionPattern

# DeepSeek-V3 ``MLA.forward``'s naive branch: q/k/v [B, S, H, D] written into a KV cache, Dv < Dq
_CACHED = '''
import torch
from torch import nn


class MLA(nn.Module):
    def __init__(self, dim=32, n_heads=4, qk_dim=12, v_dim=8, max_seq=16, max_batch=2):
        super().__init__()
        self.n_heads, self.qk_dim, self.v_dim = n_heads, qk_dim, v_dim
        self.wq = nn.Linear(dim, n_heads * qk_dim)
        self.wk = nn.Linear(dim, n_heads * qk_dim)
        self.wv = nn.Linear(dim, n_heads * v_dim)
        self.wo = nn.Linear(n_heads * v_dim, dim)
        self.softmax_scale = qk_dim ** -0.5
        self.register_buffer("k_cache", torch.zeros(max_batch, max_seq, n_heads, qk_dim), persistent=False)
        self.register_buffer("v_cache", torch.zeros(max_batch, max_seq, n_heads, v_dim), persistent=False)

    def forward(self, x, start_pos, mask=None):
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.qk_dim)
        k = self.wk(x).view(bsz, seqlen, self.n_heads, self.qk_dim)
        v = self.wv(x).view(bsz, seqlen, self.n_heads, self.v_dim)
        self.k_cache[:bsz, start_pos:end_pos] = k
        self.v_cache[:bsz, start_pos:end_pos] = v
        scores = torch.einsum("bshd,bthd->bsht", q, self.k_cache[:bsz, :end_pos]) * self.softmax_scale
        if mask is not None:
            scores += mask.unsqueeze(1)
        scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        x = torch.einsum("bsht,bthd->bshd", scores, self.v_cache[:bsz, :end_pos])
        return self.wo(x.flatten(2))
'''

_RUN_CACHED = '''
m = MLA()
x = torch.randn(2, 6, 32, requires_grad=True)
mask = torch.full((6, 6), float("-inf")).triu_(1)
out = m(x, 0, mask)
leaves = [x]
'''

# the same layout in a training block: letters of another choice, a [B, T] keep mask broadcast over query and heads
_PADDED = '''
import math
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, dim * 3)

    def forward(self, x, keep):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.hd).unbind(2)
        att = torch.einsum("bqhd,bkhd->bqhk", q, k) / math.sqrt(self.hd)
        att = att.masked_fill(~keep[:, None, None, :], float("-inf"))
        att = torch.softmax(att, dim=-1)
        out = torch.einsum("bqhk,bkhd->bqhd", att, v)
        return out.reshape(b, n, -1)
'''

_RUN_PADDED = '''
m = Block()
x = torch.randn(2, 6, 32, requires_grad=True)
keep = torch.ones(2, 6, dtype=torch.bool)
keep[1, 4:] = False
out = m(x, keep)
leaves = [x]
'''


def _emulated(code: str, run: str) -> dict:
    (f,), misses = detect_all(AttentionPattern(), code)
    facts = check_rewrite_runs(AttentionPattern(), code, run, [f])
    assert facts["calls"] >= 1, facts["all_calls"]
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999, facts
    return {"finding": f, **facts}


def _near_miss(code: str) -> str:
    findings, misses = detect_all(AttentionPattern(), code)
    assert not findings
    assert misses
    return " | ".join(m.reason for m in misses)


def test_deepseek_cached_scores_bsht_fuse_with_the_mask_permuted_to_bnsd() -> None:
    facts = _emulated(_CACHED, _RUN_CACHED)
    fused = facts["finding"].fused
    assert "_npufuse_bnsd(mask.unsqueeze(1) < 0)" in fused and ".permute(0, 2, 1, 3)" in fused


def test_deepseek_cached_scores_without_a_mask_fuse() -> None:
    _emulated(_CACHED, _RUN_CACHED.replace("out = m(x, 0, mask)", "out = m(x, 0)"))


def test_a_padding_keep_mask_on_bqhk_scores_fuses() -> None:
    facts = _emulated(_PADDED, _RUN_PADDED)
    assert "_npufuse_bnsd(" in facts["finding"].fused


def test_a_per_query_keep_mask_on_bsht_scores_fuses() -> None:
    # DeepSeek-V3.2's sparse prefill adds a [B, S, T] mask as ``index_mask.unsqueeze(2)``: read as [B, 1, S, T]
    code = _PADDED.replace("~keep[:, None, None, :]", "~keep.unsqueeze(2)")
    run = _RUN_PADDED.replace("keep = torch.ones(2, 6, dtype=torch.bool)\nkeep[1, 4:] = False",
                              "keep = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 6, 6).clone()\nkeep[1, :, 5] = False\nkeep[1, 5, 0] = False")
    _emulated(code, run)


def test_scores_in_another_order_than_the_probabilities_product_reads_stay_a_near_miss() -> None:
    # [B, H, S, T] scores multiplied as if [B, S, H, T]: the einsums mix the head and query axes (no attention)
    code = _CACHED.replace('torch.einsum("bshd,bthd->bsht"', 'torch.einsum("bshd,bthd->bhst"')
    assert "does not produce that same axis order" in _near_miss(code)


def test_a_learned_bias_on_bsht_scores_stays_a_near_miss() -> None:
    code = _PADDED.replace("self.qkv = nn.Linear(dim, dim * 3)",
                           "self.qkv = nn.Linear(dim, dim * 3)\n        self.rel = nn.Parameter(torch.randn(heads, 6))")
    code = code.replace("att = att.masked_fill(", "att = att + self.rel\n        att = att.masked_fill(")
    assert "not proven a 0 / -inf mask" in _near_miss(code)


_CAUSAL_BUILT = _PADDED.replace("att = att.masked_fill(~keep[:, None, None, :], float(\"-inf\"))", "CAUSAL")


@pytest.mark.parametrize("build", [
    "causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)\n        att = att.masked_fill(causal[:, None, :], float(\"-inf\"))",
    "causal = torch.full((n, n), float(\"-inf\"), device=x.device).triu(1)\n        att = att + causal.unsqueeze(1)",
])
def test_a_causal_triangle_read_over_the_heads_fuses(build: str) -> None:
    _emulated(_CAUSAL_BUILT.replace("CAUSAL", build), _RUN_PADDED)


def test_a_causal_triangle_on_the_head_and_key_axes_stays_a_near_miss() -> None:
    # a [S, T] triangle added to [B, S, H, T] scores lands on the head and key axes (it runs only where H == T)
    build = "causal = torch.full((n, n), float(\"-inf\"), device=x.device).triu(1)\n        att = att + causal"
    assert "proven causal" in _near_miss(_CAUSAL_BUILT.replace("CAUSAL", build))
