"""Every pattern's FUSE/KEEP examples, parametrized over the registry (Fixit style)."""

from __future__ import annotations

import pytest

from npufuse.patterns.registry import all_patterns
from pattern_harness import check_rewrite_runs, detect_all

PATTERNS = all_patterns()


def _fuse_cases():
    for p in PATTERNS:
        for i, ex in enumerate(p.FUSE):
            yield pytest.param(p, ex, id=f"{p.id}-fuse-{ex.name or i}")


def _keep_cases():
    for p in PATTERNS:
        for i, ex in enumerate(p.KEEP):
            yield pytest.param(p, ex, id=f"{p.id}-keep-{ex.name or i}")


def _run_cases():
    for p in PATTERNS:
        for i, ex in enumerate(p.FUSE):
            if ex.run:
                yield pytest.param(p, ex, id=f"{p.id}-run-{ex.name or i}")


@pytest.mark.parametrize("pattern", PATTERNS, ids=[p.id for p in PATTERNS])
def test_pattern_has_enough_examples(pattern):
    assert len(pattern.FUSE) >= 5, f"{pattern.id}: needs >= 5 Fuse examples"
    assert len(pattern.KEEP) >= 3, f"{pattern.id}: needs >= 3 Keep examples"
    assert pattern.api.startswith("torch_npu.") or pattern.api.startswith("torch.")


@pytest.mark.parametrize("pattern,example", list(_fuse_cases()))
def test_fuse_example_is_found(pattern, example):
    findings, _ = detect_all(pattern, example.code)
    assert findings, f"{pattern.id}: example not found"
    f = findings[0]
    for key, want in example.expect.items():
        got = getattr(f, key) if key in ("variant", "qualname", "confidence", "line", "end_line") else f.params.get(key)
        assert got == want, f"{pattern.id}: {key} = {got!r}, expected {want!r}"
    for f in findings:
        assert f.pattern == pattern.id and f.fused.strip() and f.guard_tensor
        assert 1 <= f.line <= f.end_line


@pytest.mark.parametrize("pattern,example", list(_keep_cases()))
def test_keep_example_is_not_fused(pattern, example):
    findings, misses = detect_all(pattern, example.code)
    assert not findings, f"{pattern.id}: near miss was reported as a candidate: {findings[0].params}"
    if example.reason:
        reasons = " | ".join(m.reason for m in misses)
        assert any(example.reason.lower() in m.reason.lower() for m in misses), (
            f"{pattern.id}: expected a near miss saying {example.reason!r}, got: {reasons or 'none'}"
        )


@pytest.mark.parametrize("pattern,example", list(_run_cases()))
def test_replacement_matches_original_under_emulator(pattern, example):
    findings, _ = detect_all(pattern, example.code)
    facts = check_rewrite_runs(pattern, example.code, example.run, findings)
    assert facts["calls"] >= 1, f"fused branch did not run; calls: {facts['all_calls']}"
    assert facts["n_out"][0] == facts["n_out"][1]
    for a, b in facts["dtypes"]:
        assert a == b, f"dtype changed: {a} -> {b}"
    for a, b in facts["shapes"]:
        assert a == b
    assert min(facts["cos_out"], default=1.0) >= 0.9999, facts["cos_out"]
    assert min(facts["cos_grad"], default=1.0) >= 0.9999, facts["cos_grad"]
