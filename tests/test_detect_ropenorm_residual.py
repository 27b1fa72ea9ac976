"""Issue 14 class 1, the inference engines' optional residual (``forward(x, weight, residual=None)``:
``if residual is not None: x = x + residual; residual = x`` then the norm written out): one
npu_add_rms_norm where autograd is off, the residual passed and the dtypes agree; otherwise the add
as written and the rms_norm candidate's fused code."""

from __future__ import annotations

import torch

from npufuse.patterns.add_rms_norm import _OPTIONAL_RESIDUAL, AddRmsNorm
from tests.pattern_harness import check_rewrite_runs, detect_all


def test_mixed_dtypes_take_the_add_then_the_fused_norm():
    findings, _ = detect_all(AddRmsNorm(), _OPTIONAL_RESIDUAL)
    run = ("w = torch.randn(32, dtype=torch.bfloat16)\nx = torch.randn(2, 5, 32, dtype=torch.bfloat16)\n"
           "r = torch.randn(2, 5, 32)\nwith torch.no_grad():\n    out = NormImpl(1e-5).forward(x, w, r)\n")
    facts = check_rewrite_runs(AddRmsNorm(), _OPTIONAL_RESIDUAL, run, findings)
    assert "npu_add_rms_norm" not in facts["all_calls"] and facts["all_calls"].get("npu_rms_norm") == 1
    assert all(a == b for a, b in facts["dtypes"]) and min(facts["cos_out"]) >= 0.9999


def test_a_float32_weight_with_bf16_activations_is_not_rounded_into_gamma():
    findings, _ = detect_all(AddRmsNorm(), _OPTIONAL_RESIDUAL)
    assert "weight.dtype == x.dtype" in findings[0].params["condition"]
    run = ("w = torch.randn(32)\nx = torch.randn(2, 5, 32, dtype=torch.bfloat16)\nr = torch.randn(2, 5, 32, dtype=torch.bfloat16)\n"
           "with torch.no_grad():\n    out = NormImpl(1e-5).forward(x, w, r)\n")
    facts = check_rewrite_runs(AddRmsNorm(), _OPTIONAL_RESIDUAL, run, findings)
    assert "npu_add_rms_norm" not in facts["all_calls"]


def test_the_residual_returned_is_the_sum_of_the_fused_op():
    findings, _ = detect_all(AddRmsNorm(), _OPTIONAL_RESIDUAL)
    fused = findings[0].fused
    assert "_npu_normed, _npu_rstd, x = torch_npu.npu_add_rms_norm(x, residual, weight, epsilon=self.eps)" in fused
    assert fused.index("residual = x") > fused.index("npu_add_rms_norm")
    # the cast to the input dtype right after the norm is part of the span (the fused output is in x's
    # dtype), and so is the `input_dtype = x.dtype` read before the add: the plan keeps it in place (s27)
    assert (findings[0].line, findings[0].end_line) == (10, 18)
    assert fused.startswith("input_dtype = x.dtype\n") and "input_dtype == x.dtype" in fused


def test_an_add_without_alias_and_without_cast_is_still_one_site():
    code = '''
import torch


def norm(x, weight, residual=None, eps=1e-6):
    if residual is not None:
        x = residual + x
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
'''
    findings, _ = detect_all(AddRmsNorm(), code)
    assert [(f.variant, f.params["x1"], f.params["x2"]) for f in findings] == [("optional_residual", "residual", "x")]
    run = ("w = torch.randn(16)\nx = torch.randn(3, 16)\nr = torch.randn(3, 16)\nwith torch.no_grad():\n"
           "    out = (norm(x, w, r), norm(x, w))\n")
    facts = check_rewrite_runs(AddRmsNorm(), code, run, findings)
    assert facts["all_calls"].get("npu_add_rms_norm") == 1 and min(facts["cos_out"]) >= 0.9999


def test_a_residual_added_when_it_is_none_or_under_an_else_is_not_this_form():
    for change in (("if residual is not None:", "if residual is None:"),
                   ("            residual = x\n", "            residual = x\n        else:\n            residual = x\n")):
        code = _OPTIONAL_RESIDUAL.replace(*change)
        findings, _ = detect_all(AddRmsNorm(), code)
        assert not findings, change


def test_a_unit_offset_weight_is_a_stated_near_miss():
    code = _OPTIONAL_RESIDUAL.replace("x = weight.to(torch.float32) * x", "x = (1 + weight.to(torch.float32)) * x")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert not findings
    assert any("`one_plus_weight` form" in m.reason and "plain x * rstd * weight norm" in m.reason for m in misses)


def test_the_forked_block_uses_the_fused_add_once_for_either_branch():
    from npufuse.patterns.add_rms_norm import _FORKED_BLOCK

    findings, _ = detect_all(AddRmsNorm(), _FORKED_BLOCK)
    assert len(findings) == 1
    run = ("b = SandwichBlock(16)\nb2 = SandwichBlock(16, use_moe=True)\nwith torch.no_grad():\n"
           "    x = torch.randn(2, 3, 16)\n    g = torch.randn(2, 1, 16)\n    out = (b(x, g), b2(x, g))\n")
    facts = check_rewrite_runs(AddRmsNorm(), _FORKED_BLOCK, run, findings)
    assert facts["all_calls"].get("npu_add_rms_norm") == 2 and min(facts["cos_out"]) >= 0.9999
    infer = findings[0].fused.split("else:\n", 1)[1]
    assert infer.count("npu_add_rms_norm") == 1 and infer.count("_npu_normed") == 3  # bound once, read in each branch


def test_different_norms_or_a_call_in_the_test_are_not_a_fork():
    from npufuse.patterns.add_rms_norm import _FORKED_BLOCK

    other_norm = _FORKED_BLOCK.replace("out = h + self.dense(self.ffn_norm(h))", "out = h + self.dense(self.attn_out_norm(h))")
    calling_test = _FORKED_BLOCK.replace("if self.use_moe:", "if self.route(h):")
    base, _ = detect_all(AddRmsNorm(), _FORKED_BLOCK)
    add_line = base[0].line  # the residual add of the forked site
    findings, _ = detect_all(AddRmsNorm(), calling_test)  # the test reads the sum: the add cannot move below it
    assert [f.qualname for f in findings if f.line == add_line] == []
    # different norms: not a fork; since s33 the add moves into both branches and is fused in the one whose
    # first statement is the norm (the other branch adds as written)
    findings, _ = detect_all(AddRmsNorm(), other_norm)
    site = [f for f in findings if f.line == add_line]
    assert len(site) == 1 and site[0].fused.count("torch_npu.npu_add_rms_norm(") == 1 and "self.attn_out_norm(h)" in site[0].fused
    run = ("b = SandwichBlock(16)\nb2 = SandwichBlock(16, use_moe=True)\nwith torch.no_grad():\n"
           "    b.ffn_norm.weight.normal_(); b2.ffn_norm.weight.normal_(); b.attn_out_norm.weight.normal_()\n"
           "    x = torch.randn(2, 3, 16)\n    g = torch.randn(2, 1, 16)\n    out = (b(x, g), b2(x, g))\n")
    facts = check_rewrite_runs(AddRmsNorm(), other_norm, run, site)
    assert facts["all_calls"].get("npu_add_rms_norm") == 1 and min(facts["cos_out"]) >= 0.9999
