"""Fixes from the s36 precision audit (a helper judged 151 candidates on 27 new repositories against
the spec: 147 correct, 2 wrong, 2 dubious). Each test fails without its fix."""

from __future__ import annotations

import pytest

from npufuse.patterns import rope
from pattern_harness import check_rewrite_runs, detect_all

# Meta-style complex rope with a batch-free table ([S, D/2] viewed as [1, S, 1, D/2]): nothing in the
# table bounds the batch, and npu_rotary_mul's interleave mode takes B*N < 1000 (spec 4.1)
_COMPLEX_BATCH_FREE = '''
import torch


def broadcastable(table, xc):
    nd = xc.ndim
    assert table.shape == (xc.shape[1], xc.shape[-1])
    shape = [n if i == 1 or i == nd - 1 else 1 for i, n in enumerate(xc.shape)]
    return table.view(*shape)


def rotate(q, k, table):
    qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    kc = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
    table = broadcastable(table, qc)
    q_out = torch.view_as_real(qc * table).flatten(3)
    k_out = torch.view_as_real(kc * table).flatten(3)
    return q_out.type_as(q), k_out.type_as(k)
'''

_RUN = '''
b, s, h, d = {b}, 3, {h}, 8
angles = torch.outer(torch.arange(s).float(), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
table = torch.polar(torch.ones_like(angles), angles)
q = torch.randn(b, s, h, d, requires_grad=True)
k = torch.randn(b, s, h, d, requires_grad=True)
out = rotate(q, k, table)
leaves = [q, k]
'''


@pytest.mark.parametrize("b,h,fused", [(2, 4, True), (32, 32, False), (1000, 1, False)])
def test_complex_rope_with_a_batch_free_table_checks_the_interleave_row_limit(b: int, h: int, fused: bool) -> None:
    pattern = rope.RopePattern()
    findings, _ = detect_all(pattern, _COMPLEX_BATCH_FREE)
    assert findings and findings[0].params["mode"] == "complex" and findings[0].variant == "complex_freqs_cis"
    facts = check_rewrite_runs(pattern, _COMPLEX_BATCH_FREE, _RUN.format(b=b, h=h), findings)
    assert "< 1000 *" in facts["rewritten"]
    assert (facts["calls"] > 0) is fused  # B*N >= 1000: the original code runs, not a call the op rejects
    assert all(c > 0.9999 for c in facts["cos_out"] + facts["cos_grad"])


# VQGAN-style single-head channel attention: the head dim the op sees is the channel count, which no
# literal bounds; npu_fusion_attention takes D <= 768 (spec 5.1): above it the original code must run
_CHANNEL_ATTENTION = '''
import torch
import torch.nn.functional as F


def mix(q, k, v):
    b, c, h, w = q.shape
    q = q.reshape(b, c, h * w)
    k = k.reshape(b, c, h * w)
    w_ = torch.bmm(q.permute(0, 2, 1), k)
    w_ = w_ * (int(c) ** (-0.5))
    w_ = F.softmax(w_, dim=2)
    v = v.reshape(b, c, h * w)
    out = torch.bmm(v, w_.permute(0, 2, 1))
    return out.reshape(b, c, h, w)
'''

_RUN_CHANNELS = '''
q, k, v = (torch.randn(2, {c}, 3, 4, requires_grad=True) for _ in range(3))
out = mix(q, k, v)
leaves = [q, k, v]
'''


@pytest.mark.parametrize("channels,fused", [(64, True), (1024, False)])
def test_channel_attention_runs_the_op_only_within_its_head_dim_limit(channels: int, fused: bool) -> None:
    from npufuse.patterns.attention import AttentionPattern

    pattern = AttentionPattern()
    findings, misses = detect_all(pattern, _CHANNEL_ATTENTION)
    assert findings, [m.reason for m in misses]
    facts = check_rewrite_runs(pattern, _CHANNEL_ATTENTION, _RUN_CHANNELS.format(c=channels), findings)
    assert "<= 768" in facts["rewritten"]
    assert (facts["calls"] > 0) is fused
    assert all(c > 0.9999 for c in facts["cos_out"] + facts["cos_grad"])


# Whisper-style decoder attention: the causal mask is sliced to the query length, [n_ctx, n_ctx]; one new
# token against a longer KV cache slices it to [1, 1], which the eager sum broadcasts over the keys and
# npu_fusion_attention does not take (it wants [Sq, Skv] or a 4-D mask)
_SLICED_MASK = '''
import torch
import torch.nn.functional as F


def qkv_attention(q, k, v, mask, n_head=2):
    n_batch, n_ctx, n_state = q.shape
    scale = (n_state // n_head) ** -0.25
    q = q.view(*q.shape[:2], n_head, -1).permute(0, 2, 1, 3) * scale
    k = k.view(*k.shape[:2], n_head, -1).permute(0, 2, 3, 1) * scale
    v = v.view(*v.shape[:2], n_head, -1).permute(0, 2, 1, 3)
    qk = q @ k
    if mask is not None:
        qk = qk + mask[:n_ctx, :n_ctx]
    w = F.softmax(qk.float(), dim=-1).to(q.dtype)
    return (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2)
'''

_RUN_SLICED = '''
mask = torch.empty(8, 8).fill_(-float("inf")).triu_(1)
q = torch.randn(2, {sq}, 16, requires_grad=True)
k = torch.randn(2, {skv}, 16, requires_grad=True)
v = torch.randn(2, {skv}, 16, requires_grad=True)
out = qkv_attention(q, k, v, mask)
leaves = [q, k, v]
'''


@pytest.mark.parametrize("sq,skv", [(1, 6), (6, 6)])
def test_a_sliced_2d_mask_is_broadcast_over_a_longer_kv_cache(sq: int, skv: int) -> None:
    from npufuse.patterns.attention import AttentionPattern

    pattern = AttentionPattern()
    findings, misses = detect_all(pattern, _SLICED_MASK)
    assert findings, [m.reason for m in misses]
    facts = check_rewrite_runs(pattern, _SLICED_MASK, _RUN_SLICED.format(sq=sq, skv=skv), findings)
    assert facts["calls"] > 0
    assert all(c > 0.9999 for c in facts["cos_out"] + facts["cos_grad"])


# moeopt36 (HO12a minimal-llama's pipeline fine-tuning, a keep label): the fused optimizers combine each
# dtype's params into one flat buffer (spec 10), which lives on one device; a model split over devices in
# one process must keep the original optimizer. The guard reads the devices of every trainable tensor.
def _split_model():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].to("meta")  # a second device this machine has: the guard only reads .device
    return model


@pytest.mark.parametrize("split", [False, True])
def test_the_optimizer_guard_keeps_the_original_for_params_on_several_devices(split: bool) -> None:
    import torch

    from npufuse.patterns import fused_optimizer

    model = _split_model() if split else torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    params = list(model.parameters())
    by_list = eval(f"{fused_optimizer._GROUPS_GUARD}(params)", {"params": params})
    by_groups = eval(f"{fused_optimizer._GROUPS_GUARD}(groups)", {"groups": [{"params": params[:2]}, {"params": params[2:]}]})
    one_device = eval(fused_optimizer._ONE_DEVICE.format(ts="(p for p in model.parameters() if p.requires_grad)"), {"model": model})
    assert (by_list is None) is split and (by_groups is None) is split and one_device is not split
    # a frozen part elsewhere does not count: only tensors that can get a grad are combined
    if split:
        model[1].requires_grad_(False)
        assert eval(f"{fused_optimizer._GROUPS_GUARD}(params)", {"params": params}) is params[0]
