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
