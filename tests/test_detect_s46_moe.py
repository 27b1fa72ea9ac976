"""s46 moe46: moe_experts classes of patterns/_moe_s46.py (`s46_*` examples).

* precision: on the sorted paths the original weights the expert rows out of place (`h * gate[:, None]`), which
  promotes bf16 rows with fp32 routing weights to fp32, and the output the code allocates from the weighted rows (and
  index_add, which takes only a source of the output's dtype) is fp32; the rewrite weighted in the rows' dtype and
  returned bf16. An in-place `h.mul_(w)` keeps bf16: moe45a's meta-read cast made that output fp32. Both Fuse examples
  run in bf16 under the emulator (dtype, outputs, gradients);
* dense gates written by an index put over their rows (`g[torch.arange(T)[:, None], idx] = w`), with near misses;
* HO22a FlashMoE's classes: flat-route positions as `nonzero(m).reshape(-1)` / `torch.where(m)[0]`, token-of-route
  maps read at them, route arrays sorted by one order (mixed sorted / unsorted reads refused), `torch.unique` of the
  sorted ids as the experts iterated.
"""

from __future__ import annotations

import pytest

from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, detect_all, example_cases, splice

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s46_", kind="fuse"))
def test_s46_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s46_", kind="keep"))
def test_s46_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


def test_index_put_gates_carry_the_row_guard():
    from npufuse.patterns._moe_s46 import PUT_ROWS

    findings, _ = detect_all(PATTERN, PUT_ROWS)
    assert "gates.dim() == 2 and indices.dim() == 2 and gates.shape[0] == indices.shape[0]" in splice(PUT_ROWS, findings)


def test_in_place_weighting_gets_no_promoting_cast():
    from npufuse.patterns._moe_s46 import SORTED_PAIRS_IN_PLACE, SORTED_PAIRS_PROMOTED

    (inplace,), _ = detect_all(PATTERN, SORTED_PAIRS_IN_PLACE)
    (promoted,), _ = detect_all(PATTERN, SORTED_PAIRS_PROMOTED)
    assert "promote_types" not in inplace.fused
    assert "promote_types(y_sorted.dtype, top_w.dtype)" in promoted.fused


def test_sorted_routes_check_the_weights_shape():
    from npufuse.patterns._moe_s46 import FLAT_SORTED

    findings, _ = detect_all(PATTERN, FLAT_SORTED)
    assert "topk_weights.shape == topk_idx.shape" in splice(FLAT_SORTED, findings)


def test_positions_of_a_mask_bound_after_them_are_not_read():
    from npufuse.patterns._moe_s46 import FLAT_NONZERO

    # the positions taken from the previous iteration's mask (bound after them): not this expert's routes
    code = FLAT_NONZERO.replace("            matches = exp_idx == e\n            pos = torch.nonzero(matches, as_tuple=False).reshape(-1)\n",
                                "            pos = torch.nonzero(matches, as_tuple=False).reshape(-1)\n            matches = exp_idx == e\n").replace(
        "        for e in range(len(self.experts)):\n", "        matches = exp_idx == 0\n        for e in range(len(self.experts)):\n")
    assert code.count("matches = exp_idx") == 2
    findings, _ = detect_all(PATTERN, code)
    assert not findings
