"""s43 moe43a: moe_experts recall classes of the real HO19a misses (`s43a_*` examples in patterns/_moe_s43a.py):
rows added through a `.view(-1, D)` of the output, top-k slot loops around experts not named `.experts`, dispatch
chained over loops joined by lists made between them; with near misses whose reasons are true."""

from __future__ import annotations

import pytest

from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, check_replacement_matches, detect_all, example_cases

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s43a_", kind="fuse"))
def test_s43a_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s43a_", kind="keep"))
def test_s43a_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s43a_", kind="run"))
def test_s43a_replacement_matches_under_the_emulator(pattern, example):
    check_replacement_matches(pattern, example)


def _finding(name: str):
    ex = next(e for e in PATTERN.FUSE if e.name == name)
    findings, _ = detect_all(PATTERN, ex.code)
    assert len(findings) == 1
    return findings[0]


def test_s43a_row_view_result_takes_the_output_shape():
    assert ".reshape(out.shape)" in _finding("s43a_add_through_row_view_of_zero_output").fused
