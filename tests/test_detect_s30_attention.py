"""s30 attention pass: scales computed from a Python number in a 0-d tensor, branches keeping the scores."""

from __future__ import annotations

import torch

from npufuse.patterns.attention import AttentionPattern, _S30_SQRT_OF_A_HOST_TENSOR
from pattern_harness import detect_all


def test_host_tensor_scale_keeps_the_low_precision_rounding() -> None:
    # bf16 rounds sqrt(12) to 3.46875: the fused call's scale must be that value, not 1/math.sqrt(12)
    findings, _ = detect_all(AttentionPattern(), _S30_SQRT_OF_A_HOST_TENSOR)
    scale = findings[0].params["scale"]

    class Self:
        head_dim = 12

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        Q = torch.zeros(1, dtype=dtype)
        got = eval(scale, {"torch": torch, "self": Self(), "Q": Q})
        eager = (torch.ones((), dtype=dtype) / torch.sqrt(torch.tensor(12, dtype=dtype))).item()
        assert isinstance(got, float)
        assert torch.tensor(got, dtype=dtype).item() == eager
    assert abs(eval(scale, {"torch": torch, "self": Self(), "Q": torch.zeros(1, dtype=torch.bfloat16)}) - 12 ** -0.5) > 1e-4


def test_fp32_softmax_cast_to_half_under_a_flag_is_guarded_on_the_dtype() -> None:
    from npufuse.patterns.attention import _S30_MEGATRON_FP32_SOFTMAX_FLAG

    findings, _ = detect_all(AttentionPattern(), _S30_MEGATRON_FP32_SOFTMAX_FLAG)
    guard = findings[0].fused.splitlines()[0]
    # the flag off, or the scores (q) already half: the fused op's fp32 softmax then returns what `.half()` gives
    assert "not self.attention_softmax_in_fp32 or query_layer.transpose(0, 1).dtype == torch.float16" in guard
    assert any("float16" in r.detail for r in findings[0].risks)


def test_probabilities_returned_under_a_flag_run_the_original_where_it_is_on() -> None:
    from npufuse.patterns.attention import _S30_PROBS_RETURNED_UNDER_A_FLAG

    findings, _ = detect_all(AttentionPattern(), _S30_PROBS_RETURNED_UNDER_A_FLAG)
    fused = findings[0].fused
    assert fused.splitlines()[0].startswith("if (not self.output_attention)")
    assert "A = None" in fused
