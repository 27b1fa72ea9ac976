"""s40 attention / sdpa / rope: ranks read through helper calls by dataflow (a helper's return rank given its
arguments' ranks), ..."""

from __future__ import annotations

import pytest
from pattern_harness import detect_all

from npufuse.patterns.attention import AttentionPattern


def _example(name: str) -> str:
    return next(e.code for e in AttentionPattern.FUSE + AttentionPattern.KEEP if e.name == name)


def test_three_d_heads_through_a_helper_method_checks_every_rank() -> None:
    (f,), misses = detect_all(AttentionPattern(), _example("s40_three_d_heads_through_a_helper_method"))
    assert f.fused.startswith("if (q.dim() == 3 and k.dim() == 3 and (v.dim() == 3)):"), f.fused
    assert not misses


@pytest.mark.parametrize("name, reason", [
    ("s40_helper_returns_a_four_d_key", "not the last two of the 4-D key"),
    ("s40_helper_returns_ranks_that_differ", "the code does not show the key's rank"),
])
def test_helper_return_rank_near_misses(name: str, reason: str) -> None:
    found, misses = detect_all(AttentionPattern(), _example(name))
    assert not found
    assert any(reason in m.reason for m in misses), [m.reason for m in misses]
