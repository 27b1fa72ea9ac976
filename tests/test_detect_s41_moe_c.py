"""s41 moe41c: HF-integration-style eager experts (argsort-sorted (token, slot) pairs, histc counts iterated as a
tensor with `end = start + int(n)`, contiguous slices through raw stacked weights), Fuse and Keep examples (`s41c_*`)."""

from __future__ import annotations

import pytest

from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, detect_all, example_cases

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s41c_", kind="fuse"))
def test_s41c_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s41c_", kind="keep"))
def test_s41c_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


def test_s41c_counts_are_computed_again_on_the_device_as_int64():
    ex = next(e for e in PATTERN.FUSE if e.name == "s41c_eager_sorted_slices_of_histc_counts")
    findings, _ = detect_all(PATTERN, ex.code)
    assert len(findings) == 1
    fused = findings[0].fused
    assert "torch.histc(expert_ids.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)).to(torch.int64)" in fused
    assert "inv_perm" not in fused  # the un-sort and the sum over k after the loop stay as written
