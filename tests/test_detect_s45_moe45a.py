"""s45 moe45a: recall classes of real HO21b misses (`s45a_*` examples, patterns/_moe_s45a.py), each Fuse example
run rewritten under the emulator (outputs and gradients), each Keep a near miss with its reason."""

from __future__ import annotations

import pytest

from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, example_cases

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s45a_", kind="fuse"))
def test_s45a_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s45a_", kind="keep"))
def test_s45a_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


