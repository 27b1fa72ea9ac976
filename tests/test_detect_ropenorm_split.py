"""Issue 14 class 2, rope halves cut at a split point the scan cannot prove to be the last dim // 2
(the tables' width, q's half point reused for k, per-axis chunks of an axial rope): fused under a
run-time ``x.shape[-1] == 2 * (h)`` check, the original code running elsewhere."""

from __future__ import annotations

import torch

from npufuse.patterns.rope import _AXIAL_CHUNKS, _SPLIT_OF_Q_FOR_K, RopePattern
from tests.pattern_harness import check_rewrite_runs, detect_all


def test_the_split_check_names_each_rotated_tensor():
    findings, _ = detect_all(RopePattern(), _SPLIT_OF_Q_FOR_K)
    assert len(findings) == 1
    fused = findings[0].fused
    # h is q's own half point (proven where it is read); k's is checked where the code runs
    assert "k.shape[-1] == 2 * (h)" in fused and "q.shape[-1] == 2 * (h)" not in fused
    assert findings[0].params["targets"] == ["q", "k"]


def test_a_split_point_rebound_in_the_scope_is_not_read_again():
    code = _SPLIT_OF_Q_FOR_K.replace("    h = q.shape[-1] // 2\n", "    h = q.shape[-1] // 2\n    h = h + 0\n")
    findings, _ = detect_all(RopePattern(), code)
    assert not findings


def test_a_literal_split_point_is_not_taken_as_half():
    code = _SPLIT_OF_Q_FOR_K.replace("    h = q.shape[-1] // 2\n", "").replace("[..., :h]", "[..., :8]").replace("[..., h:]", "[..., 8:]")
    findings, _ = detect_all(RopePattern(), code)
    assert not findings


def test_axial_rope_with_three_axes_matches_under_the_emulator():
    run = ("cs = torch.randn(5, 24)\nq = torch.randn(2, 5, 3, 24, dtype=torch.bfloat16, requires_grad=True)\n"
           "k = torch.randn(2, 5, 3, 24, dtype=torch.bfloat16, requires_grad=True)\nout = axial_rope(q, k, cs, ndim=3)\nleaves = [q, k]\n")
    findings, _ = detect_all(RopePattern(), _AXIAL_CHUNKS)
    facts = check_rewrite_runs(RopePattern(), _AXIAL_CHUNKS, run, findings)
    assert facts["all_calls"].get("npu_rotary_mul", 0) >= 3  # one call per axis chunk
    assert all(a == b for a, b in facts["dtypes"]) and min(facts["cos_out"]) >= 0.9999
    assert min(facts["cos_grad"]) >= 0.9999
