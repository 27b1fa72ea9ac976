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
