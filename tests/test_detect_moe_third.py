"""moe_experts, third pass (issue 14 class 4): forms of inference code outside Hugging Face spellings."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from pattern_harness import check_rewrite_runs, detect_all  # noqa: E402

from npufuse.patterns import moe_experts as M  # noqa: E402


def _rewrite(code: str, run: str) -> dict:
    findings, misses = detect_all(M.MoeExperts(), code)
    assert len(findings) == 1, [m.reason for m in misses]
    return check_rewrite_runs(M.MoeExperts(), code, run, findings)


def test_forward_spelled_opaque_experts_are_called_through_forward():
    run = "moe = BiasedMoE(16, 24, 5)\nx = torch.randn(11, 16)\nw, idx = torch.randn(11, 5).softmax(-1).topk(2, dim=-1)\nout = moe(x, w, idx)\n"
    res = _rewrite(M._FORWARD_SPELLED_OPAQUE, run)
    assert "_npufuse_expert.forward(" in res["rewritten"]
    assert res["all_calls"].get("npu_moe_token_permute") == 1
    assert min(res["cos_out"]) > 0.9999


def test_forward_hooks_are_skipped_as_in_the_original():
    # a hook that would change the output: .forward skips it in the original, so must the fused layer
    run = ("moe = BiasedMoE(16, 24, 5)\nfor e in moe.experts:\n    e.register_forward_hook(lambda m, i, o: o * 0)\n"
           "x = torch.randn(11, 16)\nw, idx = torch.randn(11, 5).softmax(-1).topk(2, dim=-1)\nout = moe(x, w, idx)\n")
    res = _rewrite(M._FORWARD_SPELLED_OPAQUE, run)
    assert min(res["cos_out"]) > 0.9999


def test_sorted_dispatch_spans_gather_to_weighted_sum_and_keeps_the_loop():
    code = M._SORTED_DISPATCH_OPAQUE
    findings, _ = detect_all(M.MoeExperts(), code)
    assert [f.variant for f in findings] == ["sorted_dispatch"]
    f = findings[0]
    lines = code.splitlines()
    assert lines[f.line - 1].strip().startswith("sorted_tokens = x[idxs //")
    assert lines[f.end_line - 1].strip() == ")"  # the weighted sum's closing parenthesis
    fused = f.fused
    assert "npu_moe_token_permute(x, topk_ids)" in fused and "npu_moe_token_unpermute(" in fused
    fused_branch = fused.split("else:")[0]
    assert "idxs" not in fused_branch.replace("if ", "")  # the fused branch never reads the code's own order
    assert "expert.forward(tokens_for_this_expert)" in fused_branch  # the loop runs as written


def test_sorted_dispatch_runs_the_original_where_the_permute_does_not_apply():
    # float64 tokens: npu_moe_token_permute takes fp16/bf16/fp32 only, so the guard runs the code as written
    run = M._DEEPSEEK_V3_RUN.replace("moe = DeepseekV3MoE(cfg)", "moe = DeepseekV3MoE(cfg).double()") \
        .replace("x = torch.randn(11, 16)", "x = torch.randn(11, 16, dtype=torch.float64)")
    res = _rewrite(M._SORTED_DISPATCH_OPAQUE, run)
    assert res["calls"] == 0
    assert min(res["cos_out"]) > 0.9999999


def test_token_slot_loops_become_one_call_per_chosen_expert():
    res = _rewrite(M._TOKEN_SLOT, M._TOKEN_SLOT_RUN)
    assert res["all_calls"] == {"npu_moe_token_permute": 1, "npu_moe_token_unpermute": 1}
    assert "self.experts[_npufuse_e].forward(_npufuse_rows)" in res["rewritten"]
    assert min(res["cos_out"]) > 0.9999


def test_token_slot_negative_indices_run_the_original():
    # -1 picks the last module in the original (Python indexing); bincount cannot take it: the guard keeps the loop
    run = M._TOKEN_SLOT_RUN.replace("out = moe(x, w, idx)", "idx[0, 0] = -1\nout = moe(x, w, idx)")
    res = _rewrite(M._TOKEN_SLOT, run)
    assert res["calls"] == 0
    assert min(res["cos_out"]) > 0.9999999


def test_token_slot_refusal_is_reported_once():
    code = M._TOKEN_SLOT.replace("outs = torch.zeros_like(x)", "outs = x.clone()")
    findings, misses = detect_all(M.MoeExperts(), code)
    assert not findings
    assert len(misses) == 1 and "fresh" in misses[0].reason
