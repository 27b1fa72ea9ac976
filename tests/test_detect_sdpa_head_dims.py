"""npu_fusion_attention takes a value head no wider than the key's (Dk >= Dv; SDPA takes any Dv):
the sdpa replacement checks it at run time and runs the original call otherwise."""

from __future__ import annotations

import pytest

from npufuse.patterns.sdpa import SdpaPattern
from pattern_harness import check_rewrite_runs, detect_all

SDPA = SdpaPattern()

_CODE = '''\
import torch
import torch.nn.functional as F


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
'''


def _findings():
    findings, misses = detect_all(SDPA, _CODE)
    assert len(findings) == 1, misses
    return findings


@pytest.mark.parametrize("dv,fused", [(16, 1), (8, 1), (32, 0)])
def test_value_head_wider_than_the_key_runs_the_original(dv: int, fused: int) -> None:
    run = f"""
q = torch.randn(1, 2, 8, 16); k = torch.randn(1, 2, 8, 16); v = torch.randn(1, 2, 8, {dv})
out = attend(q, k, v)
"""
    facts = check_rewrite_runs(SDPA, _CODE, run, _findings())
    # the emulator raises for Dv > Dk as the op does: without the check this case fails, not falls back
    assert facts["calls"] == fused and min(facts["cos_out"]) > 0.9999


def test_the_check_is_in_the_fused_code() -> None:
    fused = _findings()[0].fused
    # s38: q's rank is not stated here (parameters), so the op's 4-D layout is checked with the head dims
    # s51b: on the 4-D views (3-D operands as [1, X, S, D]) bound first
    assert fused.splitlines()[0].startswith("_npufuse_lift = int(q.dim() == k.dim() == v.dim() == 3 and q.shape[0] == k.shape[0] == v.shape[0])")
    assert fused.splitlines()[2] == ("if _npufuse_q4.dim() == _npufuse_k4.dim() == _npufuse_v4.dim() == 4 and "
                                     "_npufuse_v4.shape[-1] <= _npufuse_k4.shape[-1] <= 768:")  # s45: every operand of unstated rank
    assert "F.scaled_dot_product_attention(q, k, v, is_causal=True)" in fused.split("else:")[-1]
