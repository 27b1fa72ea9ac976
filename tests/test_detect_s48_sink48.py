"""s48 (helper sink48): gpt-oss attention sinks in the spellings the s44 reading missed.

HO25a jeongsu-moon/mini-deepseek-v4 ``_CompressedAttentionBase.forward``: the per-head sink logits cast to float32
between the re-view and the expand (``self.sinks.view(1, h, 1, 1).float().expand(B, h, S, 1)``), the probabilities
cast back after the softmax and the sink column dropped from the cast (``combined.softmax(dim=-1).to(q.dtype)`` then
``probs[..., :-1]``). Spec 5.1: npu_fusion_attention's ``sink`` is float32 [head_num], one unscaled logit per head,
``m = max(max_j S, sink_h)``, ``P = exp(S - m) / (sum_j exp(S - m) + exp(sink_h - m))`` -- exactly the concatenated
column dropped after the softmax. A cast of the sink to float32 is the value the op reads; a cast to another dtype
rounds it and is not read. Every Fuse form runs rewritten under the emulator against the original (outputs and
gradients, the sink parameter's included), fp32 and bf16; each look-alike keeps a true near-miss reason.
"""

from __future__ import annotations

import pytest
import torch
from pattern_harness import check_rewrite_runs, detect_all

from npufuse.emulate.attention import npu_fusion_attention as fa
from npufuse.patterns.attention import AttentionPattern

# jeongsu-moon style: MQA with K == V (one KV head), an additive 0 / -inf mask, fp32 scores, the sink cast between view
# and expand, the row max (amax) subtracted, the probabilities cast back, the column dropped from the cast
_COMPRESSED = '''
import torch
from torch import nn


class CompressedAttention(nn.Module):
    def __init__(self, d=32, n_head=4, head_dim=8):
        super().__init__()
        self.n_head, self.head_dim = n_head, head_dim
        self.scaling = head_dim ** -0.5
        self.q_proj = nn.Linear(d, n_head * head_dim, bias=False)
        self.kv_proj = nn.Linear(d, head_dim, bias=False)
        self.proj = nn.Linear(n_head * head_dim, d, bias=False)
        self.sinks = nn.Parameter(torch.zeros(n_head))

    def forward(self, x, mask):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_head, self.head_dim).transpose(1, 2)
        full_kv = self.kv_proj(x).view(B, S, 1, self.head_dim).transpose(1, 2)
        logits = torch.matmul(q, full_kv.transpose(-1, -2)) * self.scaling
        logits = logits.float() + mask
        sink = self.sinks.view(1, self.n_head, 1, 1).float().expand(B, self.n_head, S, 1)
        combined = torch.cat([logits, sink], dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = combined.softmax(dim=-1).to(q.dtype)
        attn = torch.matmul(probs[..., :-1], full_kv)
        attn = attn.transpose(1, 2).reshape(B, S, self.n_head * self.head_dim)
        return self.proj(attn)
'''

# gpt-oss reference spelling: reshape(1, -1, 1, 1).expand(b, -1, sq, 1) cast after the expand, torch.cat, F.softmax
# then .type_as(v), a four-index slice, dropout off in eval
_GPT_OSS = '''
import torch
from torch import nn
import torch.nn.functional as F


class SinkAttention(nn.Module):
    def __init__(self, heads=4, p=0.1):
        super().__init__()
        self.sinks = nn.Parameter(torch.zeros(heads))
        self.drop = nn.Dropout(p)

    def forward(self, q, k, v, mask=None):
        b, h, sq, d = q.shape
        s = q @ k.transpose(-1, -2) * d ** -0.5
        if mask is not None:
            s = s + mask
        sink = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, sq, 1).float()
        p = torch.cat([s, sink], dim=-1)
        p = p - p.max(-1, keepdim=True).values
        p = F.softmax(p, -1).type_as(v)
        p = p[:, :, :, :-1]
        return self.drop(p) @ v
'''


def _run_compressed(dtype: torch.dtype) -> str:
    return f'''
torch.manual_seed(0)
m = CompressedAttention().to({dtype})
with torch.no_grad():
    m.sinks.copy_(torch.randn(4))
x = torch.randn(2, 6, 32, dtype={dtype}, requires_grad=True)
causal = torch.zeros(6, 6).masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf"))[None, None].expand(2, 1, 6, 6)
out = (m(x, causal), m(x, torch.zeros(2, 1, 6, 6)))
leaves = [x, m.sinks, m.q_proj.weight, m.kv_proj.weight]
'''


def _run_gpt_oss(dtype: torch.dtype) -> str:
    return f'''
torch.manual_seed(0)
m = SinkAttention().to({dtype}).eval()
with torch.no_grad():
    m.sinks.copy_(torch.randn(4))
q, k, v = (torch.randn(2, 4, 5, 8, dtype={dtype}, requires_grad=True) for _ in range(3))
causal = torch.full((5, 5), float("-inf")).triu(1).to({dtype})
out = (m(q, k, v), m(q, k, v, causal))
leaves = [q, k, v, m.sinks]
'''


_COS = {torch.float32: 0.9999, torch.bfloat16: 0.999}


def _emulated(code: str, run: str, dtype: torch.dtype):
    (f,), _misses = detect_all(AttentionPattern(), code)
    facts = check_rewrite_runs(AttentionPattern(), code, run, [f])
    assert facts["calls"] >= 1, facts["all_calls"]
    assert all(a == b for a, b in facts["dtypes"]) and all(a == b for a, b in facts["shapes"]), facts
    assert min(facts["cos_out"]) >= _COS[dtype] and min(facts["cos_grad"]) >= _COS[dtype], facts
    return f


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sink_cast_between_view_and_expand_and_probabilities_cast_back_fuse(dtype: torch.dtype) -> None:
    f = _emulated(_COMPRESSED, _run_compressed(dtype), dtype)
    assert "sink=self.sinks.reshape(-1).float()" in f.fused
    assert any("aclnnFlashAttentionScoreV3" in r.detail for r in f.risks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sink_cast_after_the_expand_and_a_type_as_after_the_softmax_fuse(dtype: torch.dtype) -> None:
    f = _emulated(_GPT_OSS, _run_gpt_oss(dtype), dtype)
    assert "sink=self.sinks.reshape(-1).float()" in f.fused
    assert any("aclnnFlashAttentionScoreV3" in r.detail for r in f.risks)


def _near_miss(code: str) -> str:
    findings, misses = detect_all(AttentionPattern(), code)
    assert not findings, findings[0].fused
    assert misses
    return " | ".join(m.reason for m in misses)


@pytest.mark.parametrize(("old", "new", "reason"), [
    # the sink rounded to half precision before the concatenation: the op's float32 sink would not round it
    (".view(1, self.n_head, 1, 1).float().expand", ".view(1, self.n_head, 1, 1).half().expand", "attention sinks"),
    # a [H, Sq] sink (one logit per head and query row): `sink` takes [head_num]
    ("self.sinks = nn.Parameter(torch.zeros(n_head))", "self.sinks = nn.Parameter(torch.zeros(n_head, 6))", None),
    # the wrong column dropped: the first key's probability dropped, the sink's kept
    ("probs[..., :-1]", "probs[..., 1:]", "attention sinks"),
    # the sink column kept, given a value row: a probability npu_fusion_attention has no value for
    ("torch.matmul(probs[..., :-1], full_kv)", "torch.matmul(probs, torch.cat([full_kv, full_kv[:, :, :1]], dim=2))", None),
])
def test_compressed_look_alikes_stay_near_misses(old: str, new: str, reason: str | None) -> None:
    code = _COMPRESSED.replace(old, new)
    if "zeros(n_head, 6)" in new:
        code = code.replace("self.sinks.view(1, self.n_head, 1, 1)", "self.sinks.view(1, self.n_head, S, 1)")
        code = code.replace("expand(B, self.n_head, S, 1)", "expand(B, self.n_head, -1, 1)")
        reason = "attention sinks"
    assert code != _COMPRESSED
    got = _near_miss(code)
    assert reason is None or reason in got, got


def test_a_sink_scaled_with_the_scores_stays_a_near_miss() -> None:
    # the scale after the concatenation multiplies the sink too: npu_fusion_attention's sink is not scaled (spec 5.1)
    code = _GPT_OSS.replace("s = q @ k.transpose(-1, -2) * d ** -0.5", "s = q @ k.transpose(-1, -2)").replace(
        "p = torch.cat([s, sink], dim=-1)", "p = torch.cat([s, sink], dim=-1) * d ** -0.5")
    assert code != _GPT_OSS
    got = _near_miss(code)
    assert "attention sinks scaled with the scores" in got, got


def test_a_sink_added_to_the_scores_is_no_sink_column() -> None:
    # a per-head logit ADDED to every score (a bias, the probabilities sum to 1): no `sink`; whatever npufuse does with
    # it, it does not pass the logit as the op's sink
    code = _GPT_OSS.replace("p = torch.cat([s, sink], dim=-1)", "p = s + sink").replace("        p = p[:, :, :, :-1]\n", "")
    assert code != _GPT_OSS
    findings, misses = detect_all(AttentionPattern(), code)
    assert not any("sink=" in f.fused for f in findings)


# -- the emulator's sink (spec 5.1) against the plain-PyTorch concatenated column, forward and backward ---------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulated_sink_matches_the_concatenated_column(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    b, n, sq, skv, d = 2, 4, 5, 7, 8
    q, k, v = (torch.randn(b, n, s, d, dtype=dtype) for s in (sq, skv, skv))
    sink = torch.randn(n) * 2
    keep = torch.ones(sq, skv).tril(skv - sq).bool()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out = fa(*leaves[:3], n, "BNSD", scale=0.3, sink=leaves[3], atten_mask=~keep, sparse_mode=0)[0]
    grad = torch.randn_like(out)
    out.backward(grad)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    s = (ref[0] @ ref[1].transpose(-1, -2) * 0.3).masked_fill(~keep, float("-inf"))
    p = torch.cat([s, ref[3].reshape(1, -1, 1, 1).expand(b, -1, sq, 1)], dim=-1).softmax(-1)[..., :-1]
    want = p @ ref[2]
    want.backward(grad.double())
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want.detach(), atol=tol, rtol=tol)
    for got, r in zip(leaves, ref):
        torch.testing.assert_close(got.grad.double(), r.grad, atol=tol * 5, rtol=tol * 5)
