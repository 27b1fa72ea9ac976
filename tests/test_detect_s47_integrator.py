"""s47 integrator: a rope whose halves are cut at a point read from x's own shape other than its half.

The named-halves reader accepted ``h = x.shape[-1] // 3; x[..., :h], x[..., h:]`` under the run-time check
``x.shape[-1] == 2 * (h)``: never true for such an h, so the fused branch could never run (a dead candidate; found
by sweep47a, contrived, no real instance seen). The halves reader now refuses a split point read from x's own
shape at the source, as the inline reader already did; a split point from elsewhere (a head size) keeps its
run-time check, and x's own half fuses without one."""

from __future__ import annotations

import pytest

from npufuse.patterns.registry import all_patterns
from pattern_harness import detect_all

ROPE = next(p for p in all_patterns() if p.id == "rope")

_BODY = '''import torch


def apply_rope(x, cos, sin{extra}):
    h = {split}
    x1 = x[..., :h]
    x2 = x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
'''


def test_halves_cut_at_another_fraction_of_xs_own_width_are_no_candidate():
    findings, _ = detect_all(ROPE, _BODY.format(extra="", split="x.shape[-1] // 3"))
    assert not findings, [f.fused for f in findings]


@pytest.mark.parametrize("extra, split, checked", [
    ("", "x.shape[-1] // 2", False),  # x's own half: no run-time check needed
    (", head_dim", "head_dim // 2", True),  # a split point from elsewhere: checked at run time
])
def test_halves_at_xs_half_or_a_foreign_split_point_still_fuse(extra, split, checked):
    findings, _ = detect_all(ROPE, _BODY.format(extra=extra, split=split))
    assert len(findings) == 1
    assert ("x.shape[-1] == 2 * (h)" in findings[0].fused) is checked
