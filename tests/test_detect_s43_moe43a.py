"""s43 moe43a: moe_experts recall classes of the real HO19a misses (`s43a_*` examples in patterns/_moe_s43a.py):
rows added through a `.view(-1, D)` of the output, top-k slot loops around experts not named `.experts`, dispatch
chained over loops joined by lists made between them; with near misses whose reasons are true."""

from __future__ import annotations

import pytest

from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, detect_all, example_cases

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s43a_", kind="fuse"))
def test_s43a_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s43a_", kind="keep"))
def test_s43a_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


def test_s43a_row_view_result_takes_the_output_shape_and_top1_weights_are_checked():
    codes = {e.name: e.code for e in PATTERN.FUSE}
    (view,), _ = detect_all(PATTERN, codes["s43a_add_through_row_view_of_zero_output"])
    assert ".reshape(out.shape)" in view.fused
    (top1,), _ = detect_all(PATTERN, codes["s43a_top1_flat_indices_weighted_in_the_loop"])
    assert "probs=gate.reshape(-1, 1)" in top1.fused
    assert "(gate.shape == idx.shape)" in top1.guard_tensor
