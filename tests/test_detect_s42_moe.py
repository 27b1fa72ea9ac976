"""s42 moe42: moe_experts recall classes of the development sets (HO18a / HO18b), each with Fuse and Keep examples
(`s42_*` in patterns/moe_experts.py):

1. `(idx == e).any(dim=1)` and masked slot-weight sums over dim 1 (the last dim of 2-D indices: a run-time rank
   check), the dispatch under `if mask.any():` with the full gates' column as weight; the forward's dense path
   rebinds the loop names in a loop of its own (a for target is a fresh binding);
2. experts of other ranks held as None and skipped: fused under an all-present run-time check;
3. top-k slot loops gathering stacked weights at one column of the indices (`self.w1[idx[:, k]]` + bmm / einsum);
7. sorted per-expert counts: the fused text runs only where they add up to the sorted rows.
"""

from __future__ import annotations


import pytest
import torch

from npufuse.patterns.moe_experts import MoeExperts
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import check_fuse_found, check_keep_refused, check_rewrite_runs, \
    detect_all, example_cases

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s42_", kind="fuse"))
def test_s42_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s42_", kind="keep"))
def test_s42_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


def _example(name: str):
    return next(e for e in PATTERN.FUSE if e.name == name)


def _finding(name: str):
    findings, _ = detect_all(PATTERN, _example(name).code)
    assert len(findings) == 1
    return findings[0]


def test_s42_dim1_reads_carry_a_rank_check():
    assert "(top_i.dim() == 2)" in _finding("s42_any_dim1_dispatch_under_if_mask_any_full_gates").guard_tensor
    assert "(idx.dim() == 2)" in _finding("s42_masked_weight_sum_over_dim1_named_slot_mask").guard_tensor


def test_s42_absent_experts_guard_runs_the_loop_on_a_shard():
    f = _finding("s42_absent_experts_skipped_when_none")
    assert "all(_npufuse_m is not None for _npufuse_m in list(self.experts))" in f.guard_tensor
    ex = _example("s42_absent_experts_skipped_when_none")
    shard = ex.run.replace("ShardedMoE(16, 12, 6, 2)", "ShardedMoE(16, 12, 6, 2, rank=1, world=2)")
    torch.manual_seed(0)
    facts = check_rewrite_runs(PATTERN, ex.code, shard, [f])
    assert facts["calls"] == 0  # rank 1 holds experts 3..5 only: the loop as written
    assert min(facts["cos_out"]) >= 0.9999


def test_s42_slot_gather_reads_the_column_in_its_checks():
    f = _finding("s42_slot_loop_gathers_stacked_weights_at_a_column")
    assert "idx[:, k].dim() == 1" in f.fused
    assert "_npufuse_slot_mm(x, self.w1, idx[:, k], True" in f.fused


def test_s42_sorted_counts_run_only_where_they_cover_the_rows():
    ex = next(e for e in PATTERN.FUSE if e.name == "deepseek_v3_moe_infer_sorted_counts")
    findings, _ = detect_all(PATTERN, ex.code)
    guard = findings[0].guard_tensor
    assert "(int(tokens_per_expert.sum()) == sorted_tokens.shape[0])" in guard
    rows = torch.zeros(5, 3)
    assert eval(guard, {"tokens_per_expert": torch.tensor([2, 3]), "sorted_tokens": rows}) is rows
    assert eval(guard, {"tokens_per_expert": torch.tensor([2, 2]), "sorted_tokens": rows}) is None


def test_s42_for_target_is_a_fresh_binding_for_its_body():
    code = (
        "def f(xs, ys):\n"
        "    for e in xs:\n"
        "        a = e\n"
        "    for e in ys:\n"
        "        b = e\n"
        "    return e\n"
    )
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "f")
    reads = scope.loads_after("e", 3)
    assert [n.lineno for n in reads] == [6]  # the second loop's body reads its own binding; `return e` may not


def test_s42_index_select_along_dim_1_is_not_the_rows():
    # a one-input expert on feature columns picked by index_select(1, tok): fused as token rows before s42
    code = _example("s42_weight_index_selected_then_gathered_at_the_where_slot").code.replace(
        "y = expert(inputs.index_select(0, batch_idx), inputs.index_select(0, batch_idx))",
        "y = expert.wide(inputs.index_select(1, batch_idx))")
    findings, misses = detect_all(PATTERN, code)
    assert not findings
    assert misses
