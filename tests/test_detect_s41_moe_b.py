"""s41 moe41b: the s41 judge's blind moe_experts recall classes, each with Fuse and Keep examples (`s41b_*`).

1. empty-expert skips whose weighted rows are added back one (token, slot) pair at a time (`for j in range(len(tok))`,
   `for i, t in enumerate(tok.tolist())`) or as `out[rows] = out[rows] + w * y`;
2. a dropout around the expert output (module or functional), over [T, B, K] indices picked by two coordinates;
3. a two-input expert given its selected rows twice;
5. per-expert load counted into a module buffer (`self.expert_load[e] += idx.numel()`);
8. the routing weight gathered at the argmax slot of the expert.
"""

from __future__ import annotations

import pytest

from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, example_cases, only_finding

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s41b_", kind="fuse"))
def test_s41b_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s41b_", kind="keep"))
def test_s41b_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


def _finding(name: str):
    return only_finding(PATTERN, name)


def test_s41b_dropout_is_replayed_and_names_its_training_risk():
    f = _finding("s41b_dropout_around_expert_rows_of_tbk_indices")
    assert "self.dropout(_npufuse_h)" in f.fused
    assert any("equal in distribution" in r.detail for r in f.risks)


def test_s41b_two_input_expert_is_called_with_its_rows_twice():
    f = _finding("s41b_two_input_expert_given_rows_twice")
    assert "_npufuse_expert(_npufuse_rows_e, _npufuse_rows_e)" in f.fused
    assert "npu_grouped_matmul(" not in f.fused  # modules as they are: no grouped matmul without a backward


def test_s41b_load_buffer_is_written_once_for_all_experts():
    f = _finding("s41b_expert_load_buffer_counted_by_numel")
    assert "self.expert_load[:self.n] += _npufuse_cnt" in f.fused
