"""s35 rope pass: rotated lane pairs filled into a new tensor by strided slice assignment (one tuple statement,
an allocation on x's own device, the lanes of a rotated prefix ``x[..., :u:2]``)."""

from __future__ import annotations

import torch

from npufuse.patterns.rope import RopePattern
from pattern_harness import check_rewrite_runs, detect_all

PATTERN = RopePattern()


def _example(name: str):
    return next(e for e in PATTERN.FUSE + PATTERN.KEEP if e.name == name)


def test_filled_prefix_lanes_rewrite_to_the_same_numbers():
    example = _example("s35_prefix_lanes_filled_into_a_new_tensor")
    findings, _ = detect_all(PATTERN, example.code)
    assert sorted(f.qualname for f in findings) == ["PrefixRotary.forward", "turn_inline", "turn_leading", "turn_leading_zero_tail", "turn_pairs"]
    facts = check_rewrite_runs(PATTERN, example.code, example.run, findings)
    # eight calls fused (both prefix widths of the module, both widths of the helper, fp32 and bf16 pairs, the zeros
    # left in a zeros_like tail, the inline stack of a prefix's lanes); the B*N = 1000 call runs the original code
    assert facts["calls"] == 8, facts["all_calls"]
    assert all(a == b for a, b in facts["dtypes"]) and all(a == b for a, b in facts["shapes"])
    assert min(facts["cos_out"]) >= 0.999 and min(facts["cos_grad"]) >= 0.999


def test_prefix_lane_run_time_checks_name_the_prefix():
    findings, _ = detect_all(PATTERN, _example("s35_prefix_lanes_filled_into_a_new_tensor").code)
    leading = next(f for f in findings if f.qualname == "turn_leading")
    assert "(width) % 2 == 0" in leading.fused and "t.shape[-1] >= (width)" in leading.fused
    assert "t[..., width:]" in leading.fused  # x's tail joined after the rotated prefix
    pairs = next(f for f in findings if f.qualname == "turn_pairs")
    assert pairs.params["rotary_dim"] == "full" and "% 2 == 0" not in pairs.fused
    zero_tail = next(f for f in findings if f.qualname == "turn_leading_zero_tail")
    assert "torch.zeros_like(t[..., width:])" in zero_tail.fused  # zeros_like leaves zeros past the prefix, not x's tail


def test_filled_lanes_keep_examples_stay_unfused():
    for name in ("s35_prefix_lanes_filled_swapped", "s35_prefix_lanes_filled_on_another_device", "s35_prefix_lanes_filled_at_another_width"):
        findings, _ = detect_all(PATTERN, _example(name).code)
        assert findings == [], name


def test_accumulated_halves_rewrite_to_the_same_numbers():
    example = _example("s35_half_rotation_accumulated_in_place")
    findings, _ = detect_all(PATTERN, example.code)
    assert sorted(f.qualname for f in findings) == ["HalfTurn.forward", "split_rotate", "turn_by_rows"]
    facts = check_rewrite_runs(PATTERN, example.code, example.run, findings)
    # all five calls fused (half mode takes the per-batch B1SD table too); the bf16 x upcast by the view stays fp32
    assert facts["calls"] == 5, facts["all_calls"]
    assert all(a == b for a, b in facts["dtypes"]) and all(a == b for a, b in facts["shapes"])
    assert min(facts["cos_out"]) >= 0.999 and min(facts["cos_grad"]) >= 0.999


def test_accumulated_halves_near_misses_say_what_is_written():
    _, near = detect_all(PATTERN, _example("s35_accumulated_halves_same_sign").code)
    assert any("same sign" in n.reason for n in near)
    _, near = detect_all(PATTERN, _example("s35_accumulated_halves_own_half").code)
    assert any("not the other half" in n.reason for n in near)
