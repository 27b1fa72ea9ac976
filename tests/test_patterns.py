"""Every pattern's FUSE/KEEP examples, parametrized over the registry (Fixit style): each Fuse example is found, each
Keep example refused with its reason; tests/test_apply_patterns.py runs each runnable Fuse example rewritten."""

from __future__ import annotations

import pytest

from npufuse.patterns.registry import all_patterns
from pattern_harness import check_fuse_found, check_keep_refused, example_cases

PATTERNS = all_patterns()


@pytest.mark.parametrize("pattern", PATTERNS, ids=[p.id for p in PATTERNS])
def test_pattern_has_enough_examples(pattern):
    assert len(pattern.FUSE) >= 5, f"{pattern.id}: needs >= 5 Fuse examples"
    assert len(pattern.KEEP) >= 3, f"{pattern.id}: needs >= 3 Keep examples"
    assert pattern.api.startswith("torch_npu.") or pattern.api.startswith("torch.")


@pytest.mark.parametrize("pattern,example", example_cases(PATTERNS, kind="fuse"))
def test_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERNS, kind="keep"))
def test_keep_example_is_not_fused(pattern, example):
    check_keep_refused(pattern, example)


# Every runnable Fuse example's rewrite is run under the emulator against the original (fused branch called,
# outputs / dtypes / shapes / gradients alike) by tests/test_apply_patterns.py, through the real scan and
# `npufuse apply`: the same assertions as pattern_harness.check_replacement_matches, which this file ran a second
# time on every example until s48 (127 of the suite's ~1,900 worker-seconds).
