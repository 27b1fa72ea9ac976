"""s42 moe42b: moe_experts recall classes of the s42 blind judge and the moesweep42 dev sweep (`s42b_*` examples in
patterns/_moe_s42b.py): integer casts inside the one-hot, masks returned by a router module, `h.unsqueeze(0)[:, rows]`,
dense gates at nonzero rows into an output view, slot loops inside the expert loop, flat rows summed into zeros,
per-token conditioning rows, a shared expert in the write-back, stacked weights through lambdas; and true near-miss
reasons for router dispatch tensors and two loops over a local dict."""

from __future__ import annotations

import pytest

from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, example_cases, only_finding

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s42b_", kind="fuse"))
def test_s42b_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s42b_", kind="keep"))
def test_s42b_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


def _finding(name: str):
    return only_finding(PATTERN, name)


def test_s42b_shared_expert_is_computed_once_on_all_rows_times_top_k():
    f = _finding("s42b_shared_expert_added_in_write_back")
    assert "out.add_((topk_i.shape[-1] * self.shared_expert(x))" in f.fused
    code = [line for line in f.fused.splitlines() if not line.lstrip().startswith("#")]
    assert sum(line.count("self.shared_expert(") for line in code) == 1  # never per expert


def test_s42b_conditioning_rows_are_permuted_with_the_rows_under_a_shape_guard():
    f = _finding("s42b_conditioning_rows_picked_by_token_mask_3d")
    assert "_npufuse_cond = t_emb.reshape(" in f.fused
    assert "_npufuse_expert(_npufuse_rows_e, _npufuse_cond_e)" in f.fused
    assert "t_emb.shape[:x.dim() - 1] == x.shape[:-1]" in f.guard_tensor


def test_s42b_router_mask_classes_are_read_through_the_router_module():
    f = _finding("s42b_router_module_returns_one_hot_mask_unit_axis_gather")
    # s44 (defects44): the router's ids are not proven < E here (its mask's classes are the router's own): ids outside
    # [0, E) are masked, the weights with them
    assert "npu_moe_token_permute" in f.fused and "_npufuse_probs = w.masked_fill(~_npufuse_named, 0)" in f.fused


def test_s42b_any_over_dim_one_runs_only_on_two_dim_indices():
    f = _finding("s42b_token_mask_any_over_dim_one_dense_gates")
    assert "top_i.dim() == 2" in f.guard_tensor
