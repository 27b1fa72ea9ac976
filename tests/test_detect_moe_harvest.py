"""Session 25's moe_experts classes from the harvest (bench/detect_harvest_moe.json): each half of a
token dispatcher fused alone, grouped-matmul loops that leave rows outside every group, DeepSeekMoE
moe_infer with ids that skip experts, and the asserted-2-D grouped_mm refusal."""

from __future__ import annotations

import torch

from npufuse.patterns import moe_experts as moe
from npufuse.patterns.base import Finding
from pattern_harness import check_rewrite_runs, detect_all

PATTERN = moe.MoeExperts()


def _close(facts: dict) -> bool:
    return all(c > 0.9999 for c in facts["cos_out"]) and all(c > 0.999 for c in facts["cos_grad"]) \
        and facts["shapes"] and all(a == b for a, b in facts["shapes"]) and all(a == b for a, b in facts["dtypes"])


def test_dispatcher_halves_each_fused_alone_match_the_original():
    findings, _ = detect_all(PATTERN, moe._DISPATCHER)
    by_variant = {f.variant: f for f in findings}
    assert set(by_variant) == {"dispatcher_permute", "dispatcher_unpermute"}
    for variant, op in (("dispatcher_permute", "npu_moe_token_permute"), ("dispatcher_unpermute", "npu_moe_token_unpermute")):
        facts = check_rewrite_runs(PATTERN, moe._DISPATCHER, moe._DISPATCHER_RUN, [by_variant[variant]])
        assert facts["all_calls"].get(op), (variant, facts["all_calls"])
        assert _close(facts), (variant, facts)


def test_dispatcher_permute_keeps_the_stable_argsort_the_code_stores():
    # the kept order is what the original stored (dst -> src), not the op's inverse
    code = moe._DISPATCHER
    run = '''\
d = Dispatcher(2)
x = torch.randn(5, 4)
ids = torch.tensor([[1, 0], [1, 2], [0, 1], [2, 2], [1, 0]])
d.permute(x, ids)
out = d.saved_order.float()
'''
    findings, _ = detect_all(PATTERN, code)
    facts = check_rewrite_runs(PATTERN, code, run, [f for f in findings if f.variant == "dispatcher_permute"])
    assert facts["all_calls"].get("npu_moe_token_permute")
    assert facts["cos_out"] == [1.0] or facts["cos_out"][0] > 0.999999


def test_grouped_loop_leaves_rows_past_the_last_group_as_the_buffer_held():
    run = '''\
w = torch.randn(3, 24, 16) * 0.25
x = torch.randn(10, 16)
out = reference_grouped_gemm(x, w, torch.tensor([2, 0, 5]))
'''
    findings, _ = detect_all(PATTERN, moe._GROUP_LOOP_OFFSETS)
    assert [f.variant for f in findings] == ["grouped_loop"]
    facts = check_rewrite_runs(PATTERN, moe._GROUP_LOOP_OFFSETS, run, findings)
    assert facts["all_calls"].get("npu_grouped_matmul")
    assert _close(facts), facts


def test_grouped_loop_weight_list_keeps_the_loop():
    # a Python list of per-group weights has no .dim(): the guard sends it to the loop as written
    run = '''\
w = [torch.randn(8, 16) * 0.25 for _ in range(3)]
x = torch.randn(9, 16)
out = per_group_linear(x, w, torch.tensor([4, 5, 0]))
'''
    code = moe._GROUP_LOOP_APPEND.replace("range(stacked.shape[0])", "range(len(stacked))")
    findings, _ = detect_all(PATTERN, code)
    assert [f.variant for f in findings] == ["grouped_loop"]
    facts = check_rewrite_runs(PATTERN, code, run, findings)
    assert not facts["all_calls"].get("npu_grouped_matmul")
    assert _close(facts), facts


def test_cumulative_runs_with_unused_and_trailing_experts():
    # ids never reach experts 1 and 4: bincount() without minlength stops at 3, the fused sizes run to 5
    run = '''\
block = SparseBlock(16, 24, 5, 2)
x = torch.randn(6, 16)
ids = torch.tensor([[0, 3], [3, 2], [0, 2], [2, 0], [3, 0], [0, 2]])
w = torch.rand(6, 2)
out = block.infer(x, ids.view(-1), w.view(-1, 1))
'''
    findings, _ = detect_all(PATTERN, moe._CUM_RUNS)
    assert [f.variant for f in findings] == ["sorted_cumulative_ends_expert_modules"]
    facts = check_rewrite_runs(PATTERN, moe._CUM_RUNS, run, findings)
    assert facts["all_calls"].get("npu_moe_token_permute") and facts["all_calls"].get("npu_moe_token_unpermute")
    assert _close(facts), facts


def test_grouped_mm_asserted_2d_weight_is_refused_with_a_true_reason():
    code = moe._GROUPED_MM_DIRECT.replace("    offsets = torch.cumsum(", "    assert w1.ndim == 2\n    offsets = torch.cumsum(")
    findings, misses = detect_all(PATTERN, code)
    assert not [f for f in findings if isinstance(f, Finding)]
    assert any("asserted 2-D" in m.reason for m in misses)
