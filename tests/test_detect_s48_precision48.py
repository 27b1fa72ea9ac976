"""s48 precision48: three precision / crash gaps of the s48 review (review48b's "left" list).

1. add_rms_norm: the fused branch of an add + norm site could receive a float64 sum (``h = x + self.pe`` with a
   float64 buffer and an fp32 stream): the add + npu_rms_norm path raised where the original returns float64 (the
   plain rewrite had no dtype test on the sum; ho25fix's conditional-dtype path tested the first operand only), and
   float64 operands of one dtype and shape reached npu_add_rms_norm. The norm now runs as written where the sum's
   dtype (read after the add) is not fp16 / bf16 / fp32, and npu_add_rms_norm only for an x1 of those dtypes.
2. rms_norm: a number folded into gamma ``(w.float() * s)`` gave a float64 gamma where the factor is a float64 tensor
   at run time (a subclass storing one under the factor's name): ``.float()`` on the product.
3. ho25fix's conditional compute dtype: a later store to the dtype name (``for compute_dtype in (torch.float16,):
   pass``) was ignored; the names the reader follows must be stored exactly once in their scope.
"""

from __future__ import annotations

import pytest
from pattern_harness import check_rewrite_runs, detect_all

import test_detect_s48_fix48 as F48
import test_detect_s48_ho25fix as H
from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.rms_norm import RmsNorm

# -- 1. add + norm of a float64 sum ------------------------------------------------------------------------------------

_PLAIN_NORM = '''\
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.type_as(x)
'''

_POS = '''

class PosBlock(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.pos_norm = RMSNorm(d)
        self.register_buffer("pe", torch.randn(n, d, dtype=PE_DTYPE))
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        h = x + self.pe
        h = self.pos_norm(h)
        return h, x + self.proj(x)
'''

# training, no-grad (broadcast: the add + npu_rms_norm path), a float64 model with operands of one shape (the
# npu_add_rms_norm path)
_POS_RUN = '''
torch.manual_seed(0)
b = PosBlock(16, 5)
with torch.no_grad():
    b.pos_norm.weight.add_(torch.randn(16) * 0.1)
x = torch.randn(3, 5, 16, requires_grad=True)
out = [b(x)[0]]
with torch.no_grad():
    out.append(b(x.detach())[0])
    bd = PosBlock(16, 5).double()
    out.append(bd(torch.randn(5, 16, dtype=torch.float64))[0])
leaves = [x, b.pos_norm.weight]
'''


def _pos_code(norm: str, pe_dtype: str) -> str:
    base = _PLAIN_NORM if norm == "plain" else H._COND
    return base + _POS.replace("PE_DTYPE", pe_dtype)


@pytest.mark.parametrize("norm", ["plain", "conditional_dtype"])
def test_float64_addend_runs_the_norm_as_written(norm: str) -> None:
    """Fails on the start code: npu_rms_norm raises on the float64 sum."""
    code = _pos_code(norm, "torch.float64")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert "PosBlock.forward" in [f.qualname for f in findings], [m.reason for m in misses]
    findings = [f for f in findings if f.qualname == "PosBlock.forward"]
    facts = check_rewrite_runs(AddRmsNorm(), code, _POS_RUN, findings)
    assert all(a == b for a, b in facts["dtypes"]) and facts["dtypes"][0][0].is_floating_point, facts
    assert min(facts["cos_out"]) > 0.999999 and min(facts["cos_grad"]) > 0.999999, facts
    assert "h.dtype in (torch.float16, torch.bfloat16, torch.float32)" in facts["rewritten"]


@pytest.mark.parametrize("norm", ["plain", "conditional_dtype"])
def test_float32_addend_still_fuses(norm: str) -> None:
    """Twin: an fp32 table takes the fused norm, with the original's values."""
    code = _pos_code(norm, "torch.float32")
    findings, misses = detect_all(AddRmsNorm(), code)
    findings = [f for f in findings if f.qualname == "PosBlock.forward"]
    assert findings, [m.reason for m in misses]
    run = _POS_RUN.replace("out.append(bd(torch.randn(5, 16, dtype=torch.float64))[0])",
                           "out.append(b(torch.randn(5, 16))[0])")
    facts = check_rewrite_runs(AddRmsNorm(), code, run, findings)
    assert facts["calls"] >= 2 and facts["all_calls"].get("npu_add_rms_norm", 0) >= 1, facts
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999, facts
    assert all(a == b for a, b in facts["dtypes"]), facts


# -- 2. a folded factor that is a float64 tensor at run time -----------------------------------------------------------

_WIDE = '''

class WideRMSNorm(RMSNorm):
    """Stores a float64 per-channel tensor under the factor's name."""

    def __init__(self, d_model, eps=1e-5, position=None):
        super().__init__(d_model, eps=eps, position=position)
        self.register_buffer("position_scale", torch.linspace(0.5, 1.5, d_model, dtype=torch.float64), persistent=False)


class WideBlock(Block):
    def __init__(self, d_model, position=None):
        super().__init__(d_model, position=position)
        self.ln2 = WideRMSNorm(d_model, position=position)
'''

_WIDE_RUN = F48._SCALED_RUN.replace("m = RMSNorm(16, position=3)", "m = WideRMSNorm(16, position=3)")
_WIDE_BLOCK_RUN = F48._BLOCK_RUN.replace("Block(16, position=4)", "WideBlock(16, position=4)")


@pytest.mark.parametrize("scale", ["out.mul_(self.position_scale)", "out = out * self.position_scale"])
def test_float64_tensor_factor_gives_a_float32_gamma(scale: str) -> None:
    """Fails on the start code: the folded gamma is float64 and npu_rms_norm raises."""
    code = F48._SCALED.replace("out.mul_(self.position_scale)", scale) + _WIDE
    findings, misses = detect_all(RmsNorm(), code)
    assert [f.qualname for f in findings] == ["RMSNorm.forward"], [m.reason for m in misses]
    facts = check_rewrite_runs(RmsNorm(), code, _WIDE_RUN, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.999 and min(facts["cos_grad"]) > 0.999, facts
    assert all(a == b for a, b in facts["dtypes"]), facts
    assert "(self.gain.float() * self.position_scale).float()" in facts["rewritten"]


def test_float64_tensor_factor_in_add_then_norm() -> None:
    """Fails on the start code (the add + npu_rms_norm path's gamma is float64)."""
    code = F48._SCALED + _WIDE
    findings, misses = detect_all(AddRmsNorm(), code)
    assert "Block.forward" in [f.qualname for f in findings], [m.reason for m in misses]
    findings = [f for f in findings if f.qualname == "Block.forward"]
    facts = check_rewrite_runs(AddRmsNorm(), code, _WIDE_BLOCK_RUN, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.999 and min(facts["cos_grad"]) > 0.999, facts
    assert all(a == b for a, b in facts["dtypes"]), facts


def test_zero_dim_factor_still_fuses_exactly_as_before() -> None:
    """Twin: the 0-dim float32 factor (fix48's case); the added ``.float()`` is a no-op on a float32 product."""
    facts = F48._fused_and_runs(RmsNorm(), F48._SCALED, F48._SCALED_RUN, "RMSNorm.forward", tol=0.999)
    assert "(self.gain.float() * self.position_scale).float()" in facts["rewritten"]
    facts = F48._fused_and_runs(RmsNorm(), F48._SCALED2, F48._SCALED2_RUN, "ScaledRMSNorm.forward", tol=0.999)
    assert "(self.weight.float() * self.depth_scale * self.residual_scale).float()" in facts["rewritten"]


# -- 3. the conditional compute dtype's name stored again --------------------------------------------------------------

_IFELSE = "    compute_dtype = torch.float32 if in_dtype in (torch.float16, torch.bfloat16) else in_dtype\n"


@pytest.mark.parametrize("store", [
    "    for compute_dtype in (torch.float16,):\n        pass\n",
    "    with contextlib.nullcontext(torch.float16) as compute_dtype:\n        pass\n",
    "    if (compute_dtype := torch.float16) is None:\n        pass\n",
    "    for in_dtype in (torch.float16,):\n        pass\n",
], ids=["for", "with", "walrus", "for_on_input_dtype_name"])
def test_dtype_name_stored_again_is_not_fused(store: str) -> None:
    """Fails on the start code for `for` / `with` / walrus: the reader took the if-else and ignored the later store
    (the original computes in float16)."""
    code = "import contextlib\n" + H._COND.replace(_IFELSE, _IFELSE + store)
    assert code != "import contextlib\n" + H._COND
    findings, _ = detect_all(RmsNorm(), code)
    assert "rms_norm" not in [f.qualname for f in findings]


def test_another_name_stored_in_a_loop_still_fuses() -> None:
    """Twin: a loop storing another name after the if-else leaves the reading as it was."""
    code = H._COND.replace(_IFELSE, _IFELSE + "    for other in (torch.float16,):\n        pass\n")
    facts = H._fused_and_runs(RmsNorm(), code, H._COND_RUN, "rms_norm", tol=0.999)
    assert "x.dtype in (torch.float16, torch.bfloat16, torch.float32)" in facts["rewritten"]
