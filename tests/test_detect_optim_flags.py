"""Issue 14 class 5: ``zero_grad(set_to_none=<flag>)`` where the flag is a run-time or
configuration value. Read where the optimizer is built (a parameter of the same function, never
re-bound), the guard runs the fused class only for runs whose flag is false; a run that frees
grads keeps torch.optim (checked under the emulator, whose fused class raises ValueError on
set_to_none=True as torch_npu's does). With ``--optimizer-zero-grad-in-place`` the site is zeroed
in place instead (no flag test)."""

from __future__ import annotations

from pattern_harness import check_rewrite_runs, detect_all
from npufuse.patterns.fused_optimizer import _FLAG_SET_TO_NONE, FusedOptimizer


def test_flag_true_keeps_torch_optim_and_flag_false_fuses() -> None:
    findings, near = detect_all(FusedOptimizer(), _FLAG_SET_TO_NONE)
    assert len(findings) == 1 and near == []
    f = findings[0]
    assert "if not (cfg.free_grads) else None" in (f.guard_tensor or "")
    assert f.params["guard"].endswith("_set_to_none_flag_checked")
    assert any("read once where the optimizer is built" in r.detail for r in f.risks)
    facts = check_rewrite_runs(FusedOptimizer(), _FLAG_SET_TO_NONE, "out = train(Net(), Config(free_grads=True))\n", findings)
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.99999
    facts = check_rewrite_runs(FusedOptimizer(), _FLAG_SET_TO_NONE, "out = train(Net(), Config(free_grads=False))\n", findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.99999


def test_in_place_option_zeroes_instead_of_testing_the_flag() -> None:
    pattern = FusedOptimizer()
    pattern.zero_grad_in_place = True
    findings, _near = detect_all(pattern, _FLAG_SET_TO_NONE)
    assert len(findings) == 1 and "cfg.free_grads" not in (findings[0].guard_tensor or "")
    assert "zero_grad(set_to_none=False)" in (findings[0].fused or "")
