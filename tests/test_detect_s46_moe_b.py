"""s46 moe46b: moe_experts classes of patterns/_moe_s46b.py (`s46b_*` examples).

* an expert called through a named method of its own (`expert.forward_export(rows)`): the fused layer calls the same
  method (the MLP is not read off `forward`); nn.Module's own methods are not expert calls;
* `if not hasattr(expert, "m"): raise` in the loop, where the loop then calls `expert.m(rows)` on experts that have
  rows: it fires where the call would raise; a guard of another method, or before a skip of empty experts, is kept;
* residual experts (`expert(xb) - xb`, `xb + expert(xb)`) and accumulators started as `x.clone()` (HO22a FlashMoE's
  export path, less its co-filter on the weights). Every Fuse example runs under the emulator with gradients.
"""

from __future__ import annotations

import pytest

from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, detect_all, example_cases

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s46b_", kind="fuse"))
def test_s46b_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s46b_", kind="keep"))
def test_s46b_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


def test_named_method_is_called_in_the_fused_text_and_the_mlp_is_not_read():
    from npufuse.patterns._moe_s46b import METHOD_ONLY

    (finding,), _ = detect_all(PATTERN, METHOD_ONLY)
    assert "_npufuse_expert.forward_export(_npufuse_rows_e)" in finding.fused
    assert finding.params["activation"] == "as the expert modules compute it"


def test_residual_expert_and_clone_start_are_written_out():
    from npufuse.patterns._moe_s46b import FLASH_EXPORT

    (finding,), _ = detect_all(PATTERN, FLASH_EXPORT)
    assert "(_npufuse_expert.forward_export(_npufuse_rows_e) - _npufuse_rows_e)" in finding.fused
    assert "y = x.clone()" in finding.fused and "y.add_(" in finding.fused
