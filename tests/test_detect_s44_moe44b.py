"""s44 moe44b: moe_experts recall classes read off real development misses (`s44b_*` examples in
patterns/_moe_s44b.py): stacked expert projections with stacked biases, row-wise activation modules of the file
between them, dense expert outputs combined by a one-hot of the top-k indices, and files using torch unimported."""

from __future__ import annotations

import pytest

from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, detect_all, example_cases, only_finding

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s44b_", kind="fuse"))
def test_s44b_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s44b_", kind="keep"))
def test_s44b_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


def test_s44b_biases_are_added_after_each_grouped_matmul():
    f = only_finding(PATTERN, "s44b_stacked_biases_clamped_glu_module")
    assert "self.gate_up_proj_bias[:_npufuse_counts.shape[0]]" in f.fused
    assert "self.down_proj_bias[:_npufuse_counts.shape[0]]" in f.fused
    assert "_npufuse_h = self.activation(_npufuse_h)" in f.fused  # the row-wise module, eager between the matmuls


def test_s44b_a_lazy_torch_import_is_an_import():
    # the unimported-torch near miss is for files that never import torch; one importing it inside a function does
    from npufuse.patterns import _moe_s44b
    code = _moe_s44b.UNIMPORTED.replace("    def forward(self, x):\n        b, t, d = x.shape\n",
                                        "    def forward(self, x):\n        import torch\n        b, t, d = x.shape\n")
    _, misses = detect_all(PATTERN, code)
    assert not any("without importing torch" in m.reason for m in misses)
