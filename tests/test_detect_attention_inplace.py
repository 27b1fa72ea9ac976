"""Issue 14 class 3 for attention: an in-place add on a trailing slice of the scores (minimind's causal triangle over
the newest keys) read through the canonical layer, and what a statement between the steps does to the scores."""

from __future__ import annotations

import ast

import pytest

from npufuse.patterns.attention import AttentionPattern
from npufuse.scan.canonical import slice_add_as_padded
from pattern_harness import check_rewrite_runs, detect_all

PATTERN = AttentionPattern()


def _example(name: str):
    return next(ex for ex in PATTERN.FUSE + PATTERN.KEEP if ex.name == name)


def _aug(src: str) -> ast.AugAssign:
    node = ast.parse(src).body[0]
    assert isinstance(node, ast.AugAssign)
    return node


def test_slice_add_is_a_padded_add() -> None:
    st = _aug("s[:, :, :, -n:] += torch.full((n, n), float('-inf')).triu(1)")
    out = slice_add_as_padded(st.target, st.value)
    assert out is not None
    assert ast.unparse(out) == "torch.nn.functional.pad(torch.full((n, n), float('-inf')).triu(1), (s.size(-1) - n, 0))"


@pytest.mark.parametrize("src", [
    "s[:, :, -n:, :] += torch.full((n, n), 1.0)",  # not the last axis
    "s[:, :, :, -n:] += torch.full((n, m), 1.0)",  # the term's last dim is not the slice's width
    "s[:, :, :, -n:] += t",  # the term's shape is not stated
    "s[:, :, :, :n] += torch.zeros(n, n)",  # the first columns, not the newest
])
def test_other_slice_adds_are_not_read(src: str) -> None:
    st = _aug(src)
    assert slice_add_as_padded(st.target, st.value) is None


def test_in_place_causal_over_newest_keys_matches_under_emulator() -> None:
    ex = _example("causal_added_in_place_on_newest_keys")
    findings, misses = detect_all(PATTERN, ex.code)
    assert findings, [m.reason for m in misses]
    assert "torch.nn.functional.pad(" in findings[0].fused
    facts = check_rewrite_runs(PATTERN, ex.code, ex.run, findings)
    assert facts["calls"] == 3 and min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


@pytest.mark.parametrize("name,reason", [
    ("in_place_add_on_middle_slice", "line 7 modifies `scores` in place (`scores[:, :, -n:, :] +="),
    ("scores_stored_between_steps", "(`self.last_scores = scores`): the fused op does not produce it"),
])
def test_statement_between_steps_says_what_it_does(name: str, reason: str) -> None:
    findings, misses = detect_all(PATTERN, _example(name).code)
    assert not findings
    assert any(reason in m.reason for m in misses), [m.reason for m in misses]


def test_mask_changed_in_place_is_never_read_as_its_first_value() -> None:
    findings, misses = detect_all(PATTERN, _example("window_mask_changed_in_place").code)
    assert not findings
    assert any("modifies `window_mask` in place" in m.reason for m in misses), [m.reason for m in misses]


def test_key_transposed_upstream_matches_under_emulator() -> None:
    ex = _example("key_transposed_upstream")
    findings, misses = detect_all(PATTERN, ex.code)
    assert findings, [m.reason for m in misses]
    # the causal mask is built on the query's device/dtype (the scores are never computed on the fused branch)
    assert "q.new_ones(" in findings[0].fused and "attn_weight" not in findings[0].fused.split("else:")[0].replace("attn_weight = None", "")
    facts = check_rewrite_runs(PATTERN, ex.code, ex.run, findings)
    assert facts["calls"] == 2 and min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_key_operand_that_is_an_expression_stays_a_near_miss() -> None:
    findings, misses = detect_all(PATTERN, _example("key_operand_scaled_product").code)
    assert not findings
    assert any("`k.transpose(-2, -1) + w` is not a transpose of K" in m.reason for m in misses)
