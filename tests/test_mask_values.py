"""A float tensor named ``mask`` may carry ALiBi or 0/1 values: the fused branch must never
binarise it with ``mask < 0`` unchecked (issue 14, class 3). The rewritten code runs the fused op
for a 0/-inf mask and the original code for a graded one, with the original's result either way."""

from __future__ import annotations

import math

import pytest
import torch

from npufuse import emulate
from npufuse.patterns.registry import get_pattern
from pattern_harness import _exec, detect_all
from npufuse.rewrite.codegen import splice

SDPA = '''
import torch
import torch.nn.functional as F


def attend(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
'''

EAGER = '''
import math
import torch


def attend(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v)
'''

EAGER_BUILT = '''
import torch


def attend(q, k, v, keep):
    mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.size(-1) ** -0.5
    scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v)
'''


def _alibi(n_heads: int, s: int) -> torch.Tensor:
    slopes = torch.tensor([2 ** (-8 * (h + 1) / n_heads) for h in range(n_heads)])
    dist = (torch.arange(s)[None, :] - torch.arange(s)[:, None]).clamp(max=0).float()
    return (slopes[:, None, None] * dist)[None]  # [1, N, S, S], graded negative values


def _padding(s: int) -> torch.Tensor:
    m = torch.zeros(2, 1, s, s)
    m[..., -2:] = torch.finfo(torch.float32).min
    return m


def _run(code: str, pattern: str, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    findings, _ = detect_all(get_pattern(pattern), code)
    assert findings, f"{pattern}: no finding"
    assert findings[0].params["mask_values_checked"] is True
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    ref = _exec(code, "original")["attend"](q, k, v, mask)
    with emulate.install() as emu:
        out = _exec(splice(code, findings), "rewritten")["attend"](q, k, v, mask)
    return ref, out, sum(emu.calls.values())


@pytest.mark.parametrize("code,pattern", [(SDPA, "sdpa"), (EAGER, "attention")], ids=["sdpa", "eager"])
def test_graded_float_mask_runs_the_original(code, pattern):
    ref, out, calls = _run(code, pattern, _alibi(4, 6))
    assert calls == 0  # the values are graded: `mask < 0` would have dropped the bias
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("code,pattern", [(SDPA, "sdpa"), (EAGER, "attention")], ids=["sdpa", "eager"])
def test_zero_one_float_mask_runs_the_original(code, pattern):
    keep = (torch.rand(2, 1, 6, 6) > 0.5).float()  # 0/1 values: `< 0` would mask nothing
    ref, out, calls = _run(code, pattern, keep)
    assert calls == 0
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("code,pattern", [(SDPA, "sdpa"), (EAGER, "attention")], ids=["sdpa", "eager"])
def test_zero_minus_inf_mask_is_fused(code, pattern):
    ref, out, calls = _run(code, pattern, _padding(6))
    assert calls >= 1
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_a_mask_built_in_view_from_finfo_min_needs_no_check():
    findings, _ = detect_all(get_pattern("attention"), EAGER_BUILT)
    assert findings and findings[0].params["mask_values_checked"] is False
    assert "<= -1000" not in findings[0].fused
    assert math.isfinite(torch.finfo(torch.float32).min)
