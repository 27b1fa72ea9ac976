"""Issue 14 class 5: an explicit ``zero_grad(set_to_none=True)`` (on the optimizer, its model or a
wrapper holding its parameters) keeps torch.optim by default: a near miss whose reason states the
line, that torch_npu's fused optimizers raise ValueError on it, and names
``npufuse scan --optimizer-zero-grad-in-place``. With that option the fused branch rebinds the
zero_grad to zero in place; these are ``FusedOptimizer.FUSE_ZERO_IN_PLACE``, detected, rewritten
and run under the emulator (whose fused zero_grad raises on set_to_none=True like torch_npu's) here,
and through ``npufuse scan --optimizer-zero-grad-in-place`` + ``npufuse apply``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apply_support import npufuse, state_of
from npufuse import emulate
from npufuse.patterns.fused_optimizer import FusedOptimizer
from npufuse.scan.engine import ScanOptions
from pattern_harness import _exec, _run, check_rewrite_runs, cosine, detect_all

IN_PLACE = FusedOptimizer().with_scan_options(ScanOptions(optimizer_zero_grad_in_place=True))
DEFAULT = FusedOptimizer()
OPT_IN = "`npufuse scan --optimizer-zero-grad-in-place` makes this a candidate"
FUSE = [pytest.param(ex, id=ex.name) for ex in FusedOptimizer.FUSE_ZERO_IN_PLACE]


def test_the_option_gives_a_configured_copy_and_leaves_the_registry_alone() -> None:
    from npufuse.patterns.registry import get_pattern

    shared = get_pattern("fused_optimizer")
    assert IN_PLACE.zero_grad_in_place and not shared.zero_grad_in_place and IN_PLACE is not shared
    assert shared.with_scan_options(ScanOptions()) is shared
    assert IN_PLACE.with_scan_options(ScanOptions()).zero_grad_in_place is False


@pytest.mark.parametrize("example", FUSE)
def test_default_is_a_near_miss_naming_the_line_the_fact_and_the_option(example) -> None:
    findings, misses = detect_all(DEFAULT, example.code)
    assert findings == []
    assert misses and all(OPT_IN in m.reason and "weight decay and momentum still apply" in m.reason for m in misses), [m.reason for m in misses]
    # the line cited is the freeing call's
    lines = [i + 1 for i, text in enumerate(example.code.splitlines()) if ".zero_grad(" in text]
    assert all(any(f"(line {ln})" in m.reason for ln in lines) for m in misses)
    assert all("ValueError on zero_grad(set_to_none=True)" in m.reason for m in misses)


@pytest.mark.parametrize("example", FUSE)
def test_with_the_option_found_and_rewritten_run_matches(example) -> None:
    findings, _ = detect_all(IN_PLACE, example.code)
    assert findings, "not found with the option"
    f = findings[0]
    for key, want in example.expect.items():
        got = getattr(f, key) if key in ("variant", "qualname") else f.params.get(key)
        assert got == want, (key, got, want)
    assert all(".zero_grad = (lambda zero_grad:" in x.fused or "partial(" in x.fused for x in findings)
    assert all(any("zeroes them in place" in r.detail or "zeroed in place" in r.detail for r in x.risks) for x in findings)
    facts = check_rewrite_runs(IN_PLACE, example.code, example.run, findings)
    assert facts["calls"] >= 1, facts["all_calls"]
    assert min(facts["cos_out"], default=1.0) >= 0.9999, facts["cos_out"]


@pytest.mark.parametrize("example", [pytest.param(ex, id=ex.name) for ex in FusedOptimizer.KEEP_ZERO_IN_PLACE])
def test_near_misses_in_both_modes_without_naming_the_option(example) -> None:
    for pattern in (DEFAULT, IN_PLACE):
        findings, misses = detect_all(pattern, example.code)
        assert findings == [] and any(example.reason.lower() in m.reason.lower() for m in misses)
        assert not any(OPT_IN in m.reason for m in misses)  # the option would not help here


def test_cli_flag_scans_applies_and_runs_under_the_emulator(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.chdir(tmp_path)
    ex = next(e for e in FusedOptimizer.FUSE_ZERO_IN_PLACE if e.name == "optimizer_zero_grad_set_to_none_zeroed_in_place")
    root = tmp_path / "repo"
    root.mkdir()
    (root / "train.py").write_text(ex.code, encoding="utf-8")
    state = tmp_path / ".npufuse"
    # default: a near miss, nothing to apply
    assert npufuse("scan", str(root), "--only", "fused_optimizer", "--state-dir", str(state), "--no-progress") == 0
    scan = json.loads((state / "scan.json").read_text(encoding="utf-8"))
    assert scan["candidates"] == [] and OPT_IN in scan["near_misses"][0]["reason"]
    assert "optimizer_zero_grad_in_place" not in scan["assumptions"]
    # with the option: a candidate, applied, and the rewritten loop runs the fused class
    assert npufuse("scan", str(root), "--only", "fused_optimizer", "--state-dir", str(state), "--no-progress",
                   "--optimizer-zero-grad-in-place") == 0
    scan = json.loads((state / "scan.json").read_text(encoding="utf-8"))
    assert [c["line"] for c in scan["candidates"]] == [19] and scan["assumptions"]["optimizer_zero_grad_in_place"] is True
    assert npufuse("apply", "--accept", "all", "--state-dir", str(state)) == 0
    assert state_of(state)["candidates"][0]["applied"]
    rewritten = (root / "train.py").read_text(encoding="utf-8")
    assert "optimizer.zero_grad = (lambda zero_grad: lambda set_to_none=None: zero_grad(set_to_none=False))" in rewritten
    ref, _ = _run(_exec(ex.code, "original"), ex.run)
    with emulate.install() as emu:
        outs, _ = _run(_exec(rewritten, "rewritten"), ex.run)
    assert sum(emu.calls.values()) >= 1
    assert all(cosine(a, b) >= 0.9999 for a, b in zip(ref, outs))


def test_an_uncalled_helper_reallocating_parameters_is_a_stated_risk() -> None:
    ex = next(e for e in FusedOptimizer.FUSE if e.name == "reallocation_in_a_helper_the_file_never_calls")
    findings, _ = detect_all(DEFAULT, ex.code)
    assert len(findings) == 1
    risk = [r.detail for r in findings[0].risks if "convert_models_to_fp32" in r.detail]
    assert risk and "line 20" in risk[0] and "nothing in this file calls it" in risk[0]


def test_a_reallocation_that_runs_before_the_construction_is_a_note() -> None:
    ex = next(e for e in FusedOptimizer.FUSE if e.name == "reallocation_in_a_helper_called_before_the_optimizer")
    findings, _ = detect_all(DEFAULT, ex.code)
    assert len(findings) == 1
    assert any("`convert_models_to_fp32` re-allocates parameters or grads (line 20) but runs only at line 25, before the optimizer" in n
               for n in findings[0].notes), findings[0].notes
