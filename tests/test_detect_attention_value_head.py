"""npu_fusion_attention takes a value head no wider than the key's (Dk >= Dv; the eager matmuls take
any Dv): the eager-attention replacement checks it at run time and runs the original statements
otherwise, as the sdpa replacement does (tests/test_detect_sdpa_head_dims.py)."""

from __future__ import annotations

import pytest
import torch

from npufuse.emulate.attention import npu_fusion_attention
from npufuse.emulate.checks import NpuOpError
from npufuse.patterns.attention import AttentionPattern
from pattern_harness import check_rewrite_runs, detect_all

PATTERN = AttentionPattern()

_PLAIN = '''\
import math
import torch


def attend(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(mask == 0, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.matmul(p, v)
'''

# k/v bound to temporaries before the call (``k.float()``) and a soft-capping branch whose check
# comes first: the head-dim check sits inside that check's fused branch
_CAPPED = '''\
import torch


def attend(q, k, v, cap=None):
    scores = torch.matmul(q, k.float().transpose(-2, -1)) * 0.25
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    p = torch.softmax(scores, dim=-1)
    return torch.matmul(p, v.float())
'''

# channel-first single-head attention: k and v are [B, C, T], their head dim is axis 1
_CHANNEL_FIRST = '''\
import torch


def attend(q, k, v):
    w = torch.einsum("bct,bcs->bts", q, k) * 0.25
    w = torch.softmax(w, dim=-1)
    return torch.einsum("bts,bcs->bct", w, v)
'''

# a statement of the span that is no attention step runs once, before the check, on either branch
_WITH_A_LOG = '''\
import torch


def attend(q, k, v, log):
    scores = q @ k.transpose(-2, -1) * 0.25
    log.append(q.shape[0])
    p = scores.softmax(-1)
    return p @ v
'''


def _finding(code: str):
    findings, misses = detect_all(PATTERN, code)
    assert len(findings) == 1, [m.reason for m in misses]
    return findings


@pytest.mark.parametrize("dv,fused", [(16, 1), (8, 1), (32, 0)])
def test_value_head_wider_than_the_key_runs_the_original(dv: int, fused: int) -> None:
    run = f"""
q = torch.randn(1, 2, 8, 16, requires_grad=True); k = torch.randn(1, 2, 8, 16); v = torch.randn(1, 2, 8, {dv})
mask = torch.ones(8, 8, dtype=torch.bool).tril()
out = attend(q, k, v, mask)
leaves = [q]
"""
    facts = check_rewrite_runs(PATTERN, _PLAIN, run, _finding(_PLAIN))
    assert facts["calls"] == fused
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999


def test_the_check_and_the_original_are_in_the_fused_code() -> None:
    fused = _finding(_PLAIN)[0].fused
    # the operands' rank is not stated in the function: audit41's rank check comes first (s51b: on the 4-D views, which
    # 3-D operands get as [1, X, S, D])
    assert fused.splitlines()[0].startswith("_npufuse_lift = int(q.dim() == k.dim() == v.dim() == 3 and q.shape[0] == k.shape[0] == v.shape[0])")
    assert fused.splitlines()[2] == ("if _npufuse_q4.dim() == 4 and _npufuse_k4.dim() == 4 and _npufuse_v4.dim() == 4 and "
                                     "_npufuse_v4.shape[-1] <= _npufuse_k4.shape[-1] <= 768:")
    assert fused.split("\nelse:\n")[1].splitlines() == [
        "    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))",
        '    scores = scores.masked_fill(mask == 0, float("-inf"))',
        "    p = torch.softmax(scores, dim=-1)",
        "    return torch.matmul(p, v)",
    ]


def test_without_the_check_the_op_raises_as_npu_fusion_attention_does() -> None:
    # the emulator rejects Dv > Dk as the op does: the check is what keeps such inputs working
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 32)
    with pytest.raises(NpuOpError, match="Dk >= Dv"):
        npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.25)
    unchecked = _finding(_PLAIN)
    unchecked[0].fused = unchecked[0].fused.replace("and _npufuse_v4.shape[-1] <= _npufuse_k4.shape[-1] <= 768:", "and True:", 1)
    run = """
q = torch.randn(1, 2, 8, 16); k = torch.randn(1, 2, 8, 16); v = torch.randn(1, 2, 8, 32)
out = attend(q, k, v, torch.ones(8, 8, dtype=torch.bool))
"""
    with pytest.raises(NpuOpError, match="Dk >= Dv"):
        check_rewrite_runs(PATTERN, _PLAIN, run, unchecked)


@pytest.mark.parametrize("dv,cap,fused", [(16, None, 1), (32, None, 0), (16, 30.0, 0), (32, 30.0, 0)])
def test_head_dim_check_nested_in_an_earlier_check(dv: int, cap: float | None, fused: int) -> None:
    findings = _finding(_CAPPED)
    text = findings[0].fused
    # the capping check comes first (it decides whether the fused call applies); the head-dim check reads
    # the bound k/v inside it
    assert text.startswith("if not (cap is not None):\n    _npufuse_k = k.float()\n    _npufuse_v = v.float()\n"
                           "    _npufuse_lift = int(q.dim() == _npufuse_k.dim() == _npufuse_v.dim() == 3 and q.shape[0] == _npufuse_k.shape[0] == _npufuse_v.shape[0])")
    assert ("\n    if _npufuse_q4.dim() == 4 and _npufuse_k4.dim() == 4 and _npufuse_v4.dim() == 4"
            " and _npufuse_v4.shape[-1] <= _npufuse_k4.shape[-1] <= 768:\n") in text
    run = f"""
q = torch.randn(1, 2, 8, 16); k = torch.randn(1, 2, 8, 16); v = torch.randn(1, 2, 8, {dv})
out = attend(q, k, v, {cap})
"""
    facts = check_rewrite_runs(PATTERN, _CAPPED, run, findings)
    assert facts["calls"] == fused and min(facts["cos_out"]) > 0.9999


@pytest.mark.parametrize("dv,fused", [(16, 1), (32, 0)])
def test_channel_first_head_dim_is_axis_one(dv: int, fused: int) -> None:
    findings = _finding(_CHANNEL_FIRST)
    assert findings[0].fused.splitlines()[0] == "if v.shape[1] <= k.shape[1] <= 768:"
    run = f"""
q = torch.randn(2, 16, 8); k = torch.randn(2, 16, 8); v = torch.randn(2, {dv}, 8)
out = attend(q, k, v)
"""
    facts = check_rewrite_runs(PATTERN, _CHANNEL_FIRST, run, findings)
    assert facts["calls"] == fused and min(facts["cos_out"]) > 0.9999


@pytest.mark.parametrize("dv,fused", [(16, 1), (32, 0)])
def test_statements_run_before_the_check_do_not_run_again(dv: int, fused: int) -> None:
    findings = _finding(_WITH_A_LOG)
    assert findings[0].fused.count("log.append(q.shape[0])") == 1
    run = f"""
q = torch.randn(1, 2, 8, 16); k = torch.randn(1, 2, 8, 16); v = torch.randn(1, 2, 8, {dv})
log = []
out = (attend(q, k, v, log), torch.tensor([float(len(log)), 1.0]))
"""
    facts = check_rewrite_runs(PATTERN, _WITH_A_LOG, run, findings)
    # the second output is [times the log ran, 1]: [2, 1] against [1, 1] has a cosine of 0.95
    assert facts["calls"] == fused and min(facts["cos_out"]) > 0.9999
