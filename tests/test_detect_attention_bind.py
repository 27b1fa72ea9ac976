"""Issue 14 classes 3 and 7 for attention: statements bound once on the fused branch instead of being
inlined into the call's inputs (a module call feeding k and v; k/v read after the site)."""

from __future__ import annotations

import ast

import pytest

from npufuse.patterns.attention import AttentionPattern
from pattern_harness import check_rewrite_runs, detect_all

PATTERN = AttentionPattern()
NEW = {"module_call_bound_once", "keys_kept_for_a_memory", "keys_kept_for_a_memory_value_checked", "scaled_key_returned"}


def _example(name: str):
    return next(ex for ex in PATTERN.FUSE + PATTERN.KEEP if ex.name == name)


@pytest.mark.parametrize("name", sorted(NEW))
def test_bound_statement_runs_once_and_matches(name: str) -> None:
    ex = _example(name)
    findings, misses = detect_all(PATTERN, ex.code)
    assert findings, [m.reason for m in misses]
    fused = findings[0].fused
    # every module call of the fused branch appears once, and the k/v statement is kept as written
    calls = [ast.unparse(n.func) for n in ast.walk(ast.parse(fused)) if isinstance(n, ast.Call) and ast.unparse(n.func).startswith("self.")]
    assert len(calls) == len(set(calls)), calls
    facts = check_rewrite_runs(PATTERN, ex.code, ex.run, findings)
    assert facts["calls"] >= 1
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"], default=1.0) >= 0.9999


def test_value_checked_fallback_does_not_repeat_bound_statement() -> None:
    findings, _ = detect_all(PATTERN, _example("keys_kept_for_a_memory_value_checked").code)
    fused = findings[0].fused
    # the memory is concatenated before the check, and the original code in the else branch does not do it again
    assert fused.count("torch.cat((k_mem, k)") == 1
    head, _, orig = fused.partition("\nelse:\n")
    assert "torch.cat((k_mem, k)" in head and "torch.cat" not in orig


def test_scaled_key_runs_after_the_fused_call() -> None:
    findings, _ = detect_all(PATTERN, _example("scaled_key_returned").code)
    fused = findings[0].fused
    # the call reads the pre-scale k; the scaled k the function returns is computed after it
    assert fused.index("npu_fusion_attention") < fused.index("k = k * 0.125")


def test_scores_returned_stays_a_near_miss() -> None:
    findings, misses = detect_all(PATTERN, _example("scores_returned").code)
    assert not findings
    assert any("intermediate `sim` is used after the attention" in m.reason for m in misses)
