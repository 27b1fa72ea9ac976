"""`verify op` fails loudly when the fused branch goes through an op without a derivative.

On NPU such an op (torch_npu's VariableFallbackKernel) only warns and leaves the inputs'
``.grad`` None: a training rewrite through it ships silently missing gradients. The forward
here is exact (gemma's ``1 + gamma`` with ``gamma = weight - 1``), so only the backward can
catch it.
"""

from __future__ import annotations

from pathlib import Path

import test_verify_helpers as h
from npufuse.verify.candidate import load_candidate
from npufuse.verify.opcheck import OpOptions, verify_op

FUSED_GEMMA = (
    "return torch_npu.npu_gemma_rms_norm(hidden_states, (self.weight.float() - 1).to(hidden_states.dtype), "
    "epsilon=self.variance_epsilon)[0]"
)


def test_gradients_dropped_by_an_op_without_derivative_fail(tmp_path: Path) -> None:
    sd = h.rms_repo(tmp_path, FUSED_GEMMA, config={"torch_dtype": "float32"})
    report = verify_op(load_candidate(1, sd), OpOptions())
    assert not report.passed
    reasons = " ".join(report.reasons)
    assert "drops gradients the original produces" in reasons and "npu_gemma_rms_norm" in reasons
    assert "grad hidden_states: no gradient reaches it" in reasons
    assert "grad param:weight: no gradient reaches it" in reasons
    out = next(c for c in report.checks if c.name == "out")
    assert not out.problem  # the forward alone would have passed


def test_same_forward_with_a_derivative_passes(tmp_path: Path) -> None:
    # control: the identical site through npu_rms_norm (which has a backward) passes
    sd = h.rms_repo(tmp_path, config={"torch_dtype": "float32"})
    assert verify_op(load_candidate(1, sd), OpOptions()).passed
