"""Held-out 4 spellings of swiglu/geglu/moe_experts (issue 14): accumulators moved after zeros."""

from __future__ import annotations

import ast

import pytest

from npufuse.patterns import moe_experts as moe
from npufuse.scan.dataflow import ModuleInfo


def _module(expr: str) -> ModuleInfo:
    text = f"import torch\nacc = {expr}\n"
    return ModuleInfo("m.py", text, ast.parse(text))


@pytest.mark.parametrize("src,inner,dtype", [
    ("torch.zeros_like(x).to(x.dtype)", "torch.zeros_like(x)", "x.dtype"),
    ("torch.zeros(n, d).to(x.device)", "torch.zeros(n, d)", None),
    ("x.new_zeros(x.shape).float()", "x.new_zeros(x.shape)", "torch.float32"),
    ("torch.zeros_like(x).to(device='cuda', dtype=torch.bfloat16)", "torch.zeros_like(x)", "torch.bfloat16"),
    ("torch.zeros_like(x).cuda().half()", "torch.zeros_like(x)", "torch.float16"),
])
def test_zeros_moved_by_a_cast_or_a_device_move_are_still_zeros(src, inner, dtype):
    module = _module(src)
    got = moe._zeros_moved_dtype(module, module.tree.body[-1].value)
    assert got is not None
    assert ast.unparse(got[0]) == inner
    assert got[1] == dtype


@pytest.mark.parametrize("src", ["torch.zeros_like(x).to(y)", "torch.zeros_like(x)", "torch.zeros_like(x).to(x.dtype, 3)"])
def test_unknown_moves_and_plain_makers_are_not_taken_as_moved(src):
    module = _module(src)
    assert moe._zeros_moved_dtype(module, module.tree.body[-1].value) is None


def test_an_activation_assigned_in_init_branches_is_dispatched_at_run_time_not_taken_from_the_last_branch():
    from pattern_harness import detect_all

    from npufuse.patterns.registry import get_pattern as get
    from npufuse.patterns.swiglu import _BRANCH_ACT

    code = _BRANCH_ACT.replace("self.act = nn.ReLU()", "self.act = make_act()").replace(
        "import torch\n", "import torch\nfrom acts import make_act\n", 1)
    findings, _ = detect_all(get("swiglu"), code)
    assert len(findings) == 1
    params = findings[0].params
    # the last branch assigns F.silu, but which branch runs is decided when the object is built
    assert params["conditional"] is True and params["activation"] == "config"
    assert "branches of __init__" in params["activation_source"]
    assert params["dispatches_to"] == ["swiglu", "geglu"]


def test_a_glu_kernel_taking_its_activation_as_a_parameter_is_fused_only_behind_run_time_checks():
    # s28: a function whose whole body is `act(a) * b` of its parameters is the GLU itself (library
    # kernels such as a bivariate-GLU helper); its callers are out of sight, so both the activation
    # and the shapes are checked where it runs, and the original body is the fallback
    from pattern_harness import detect_all

    from npufuse.patterns.registry import get_pattern as get

    code = "import torch\n\ndef f(act, x, y):\n    return act(x) * y\n"
    findings, misses = detect_all(get("swiglu"), code)
    assert misses == [] and len(findings) == 1
    params = findings[0].params
    assert params["glu_kernel"] is True and params["runtime_check"] == "activation type"
    assert params["activation_source"] == "act (a parameter of the function)"
    fused = findings[0].fused
    assert fused.startswith("if x.shape == y.shape:") and "return act(x) * y" in fused


def test_gate_and_up_indexed_out_of_one_pair_are_found_in_both_layouts_and_written_as_mul_calls():
    from pattern_harness import detect_all

    from npufuse.patterns.registry import get_pattern
    from npufuse.patterns.swiglu import _PAIR_INDEXED

    findings, misses = detect_all(get_pattern("swiglu"), _PAIR_INDEXED)
    assert sorted(f.qualname for f in findings) == ["PairFirstDim.forward", "PairProjection.forward"]
    assert misses == []
    same = _PAIR_INDEXED.replace("up = fused[..., 1, :]", "up = fused[..., 0, :]")
    findings, misses = detect_all(get_pattern("swiglu"), same)
    assert [f.qualname for f in findings] == ["PairFirstDim.forward"]
    assert [m.qualname for m in misses] == ["PairProjection.forward"]
    assert "not two parts" in misses[0].reason


def test_projections_through_a_one_argument_helper_keep_the_rebinding_statement_as_written():
    from pattern_harness import detect_all

    from npufuse.patterns.registry import get_pattern
    from npufuse.patterns.swiglu import _UNARY_HELPER

    findings, misses = detect_all(get_pattern("swiglu"), _UNARY_HELPER)
    assert len(findings) == 1 and misses == []
    f = findings[0]
    # only the product's line is rewritten: `z1, z2 = first_if_tuple(z1), first_if_tuple(z2)` stays,
    # so the helper runs once per operand (never rendered as `(..., ...)[0]`, evaluating both twice)
    assert (f.line, f.end_line) == (29, 29)
    assert "first_if_tuple" not in str(f.fused)
    assert f.params["conditional"] is True
