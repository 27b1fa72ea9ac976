"""Fixes from the s35 precision audit (a helper judged 60 candidates on 7 new repositories against
the spec: 58 correct, 1 wrong, 1 dubious). Each test fails without its fix."""

from __future__ import annotations

import pytest
import torch

from npufuse.patterns import rope


def _half_limits_hold(x_shape: tuple[int, ...], cos_shape: tuple[int, ...]) -> bool:
    test = rope._lifted_limits("x", "cos", "half")
    return bool(eval(test, {"x": torch.empty(x_shape, device="meta"), "cos": torch.empty(cos_shape, device="meta")}))


@pytest.mark.parametrize("x_shape,cos_shape,ok", [
    # VideoSys temporal RoPE: tokens [(b*h*w), heads, t, D], per-row positions -> cos [(b*h*w), 1, t, D];
    # half mode takes B < 1000 (spec 4.1): the original code must run (it counted the long B as the sequence)
    ((2048, 16, 17, 64), (2048, 1, 17, 64), False),
    # HF Llama prefill: cos [B, 1, S, D] with a long sequence: allowed (only B and N are limited)
    ((4, 32, 4096, 128), (4, 1, 4096, 128), True),
    ((4, 4096, 32, 128), (4, 4096, 1, 128), True),  # BSND with a BS1D table
    ((2, 8, 5000, 64), (1, 1, 5000, 64), True),  # shared table, long sequence
    ((1200, 8, 16, 64), (1, 1, 16, 64), False),  # a long batch under a shared table: broadcast dim counts twice
])
def test_half_mode_limits_with_a_per_batch_table(x_shape, cos_shape, ok) -> None:
    assert _half_limits_hold(x_shape, cos_shape) is ok
