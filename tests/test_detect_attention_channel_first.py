"""Issue 14 class 3 for attention: channel-first einsum attention with q, k and v all [B*H, C, T]."""

from __future__ import annotations

import pytest

from npufuse.patterns.attention import AttentionPattern
from pattern_harness import check_rewrite_runs, detect_all

PATTERN = AttentionPattern()


def _example(name: str):
    return next(ex for ex in PATTERN.FUSE + PATTERN.KEEP if ex.name == name)


@pytest.mark.parametrize("name", ["channel_first_einsum_qkv", "channel_first_einsum_viewed_operands"])
def test_channel_first_query_is_transposed_for_the_call(name: str) -> None:
    ex = _example(name)
    findings, misses = detect_all(PATTERN, ex.code)
    assert findings, [m.reason for m in misses]
    fused = findings[0].fused
    # the switch is guarded on the query tensor, never on an int read first by a breadth-first walk (`ch`)
    assert findings[0].guard_tensor == "q"
    # every operand reaches the call as [B, 1, T, C] and the result goes back to [B, C, T]
    assert fused.count(".transpose(1, 2).unsqueeze(1).contiguous()") == 3
    # (the fused branch: an else after it runs the original where v's head dim exceeds k's)
    assert fused.split("\nelse:")[0].rstrip().endswith(".squeeze(1).transpose(1, 2)")
    facts = check_rewrite_runs(PATTERN, ex.code, ex.run, findings)
    assert facts["calls"] >= 1
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_softmax_over_the_query_axis_is_a_near_miss() -> None:
    findings, misses = detect_all(PATTERN, _example("channel_first_softmax_over_queries").code)
    assert not findings
    assert any("softmax over dim 1" in m.reason for m in misses)


def test_channel_first_query_with_a_4d_mask_is_not_reported_with_a_wrong_shape() -> None:
    # a [B, T, S] bool mask beside channel-first q: the mask keeps the scores' layout, q's T is its axis 1
    code = '''
import torch


def attend(q, k, v, mask):
    w = torch.einsum("bct,bcs->bts", q, k) * 0.25
    w = w.masked_fill(mask, float("-inf"))
    w = torch.softmax(w, dim=-1)
    return torch.einsum("bts,bcs->bct", w, v)
'''
    run = '''
q = torch.randn(3, 8, 5, requires_grad=True)
k = torch.randn(3, 8, 7, requires_grad=True)
v = torch.randn(3, 8, 7, requires_grad=True)
mask = torch.zeros(3, 5, 7, dtype=torch.bool)
mask[:, :, 0] = True
out = attend(q, k, v, mask)
leaves = [q, k, v]
'''
    findings, misses = detect_all(PATTERN, code)
    assert findings, [m.reason for m in misses]
    facts = check_rewrite_runs(PATTERN, code, run, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999
