"""s41 moe41: the s40 judge's HO17a/b blind moe_experts misses as classes, each with Fuse and Keep examples.

1. empty experts skipped on `w > 0` / `w != 0` of each token's summed slot weight (StoryMixtral): the routed tokens
   (`> 0` only for weights shown non-negative by dataflow);
2. the routing weight gathered with the expert mask, from a router module of the file (llama4-tiny-vlm), or the masked
   product bound to a name and summed in a second statement (epilabram);
3. slot-outer loops over [B, T, K] index columns `idx[:, :, k] == e`, the slot weight expanded to the tokens
   (mini-MoE-CoT); `for k in range(self.k)` is a slot loop (the attribute `k` is not the loop variable).
"""

from __future__ import annotations

import pytest

from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, detect_all, example_cases

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s41_", kind="fuse"))
def test_s41_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s41_", kind="keep"))
def test_s41_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


def test_s41_positive_select_names_its_zero_weight_risk():
    ex = next(e for e in PATTERN.FUSE if e.name == "s41_skip_empty_on_positive_summed_weight")
    findings, _ = detect_all(PATTERN, ex.code)
    assert any("`w > 0`" in r.detail and "inf / NaN" in r.detail for r in findings[0].risks)


def test_s41_slot_columns_claim_no_distinct_indices():
    """Slot columns visit every (token, slot) pair once, duplicates included: no 'distinct indices' risk."""
    ex = next(e for e in PATTERN.FUSE if e.name == "s41_slot_outer_loop_over_3d_index_columns")
    findings, _ = detect_all(PATTERN, ex.code)
    assert not any("distinct" in r.detail for r in findings[0].risks)
