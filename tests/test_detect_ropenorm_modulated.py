"""Issue 14 class 1, modulated / conditioned RMSNorms: a factor computed at run time (adaLN's
``1 + scale[:, None]``, a tanh gate) after the norm. npu_rms_norm's gamma must have the input's
trailing shape, so the op normalizes with ones and the factor is applied after it; a factor that
is a parameter keeps the usual gamma path. The pattern's examples cover three spellings; these
tests cover others, the refusals, and the emulated rewrite of spellings not in the examples."""

from __future__ import annotations

import pytest
import torch

from npufuse.patterns.rms_norm import RmsNorm
from tests.pattern_harness import check_rewrite_runs, detect_all

_INLINE = '''
import torch


def ada(x, scale, shift, eps: float = 1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + scale[:, None]) + shift[:, None]
'''

_SIGMOID_GATE = '''
import torch
from torch import nn


class GatedNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.to_gate = nn.Linear(d, d)

    def forward(self, x, cond):
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + self.eps)
        h = h * self.to_gate(cond).sigmoid().unsqueeze(1).float()
        return h.to(dtype)
'''

_SCALE_ONLY = '''
import torch


def scaled(x, gamma, eps=1e-6):
    """A per-sample scale without the ``1 +``; the factor in fp32, x in bf16: the product promotes."""
    normed = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)
    return normed * gamma.unsqueeze(1)
'''


@pytest.mark.parametrize("code,fn,run", [
    (_INLINE, "ada", "x = torch.randn(2, 3, 16, requires_grad=True)\ns = torch.randn(2, 16, requires_grad=True)\n"
                     "out = ada(x, s, torch.randn(2, 16))\nleaves = [x, s]\n"),
    (_SIGMOID_GATE, "GatedNorm.forward", "m = GatedNorm(16).to(torch.bfloat16)\nx = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)\n"
                                         "c = torch.randn(2, 16, dtype=torch.bfloat16)\nout = m(x, c)\nleaves = [x]\n"),
    (_SCALE_ONLY, "scaled", "x = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)\ng = torch.randn(2, 16, requires_grad=True)\n"
                            "out = scaled(x, g)\nleaves = [x, g]\n"),
])
def test_other_modulated_spellings_are_fused_and_match_under_the_emulator(code, fn, run):
    findings, _ = detect_all(RmsNorm(), code)
    assert [f.qualname for f in findings] == [fn]
    assert findings[0].variant == "modulated"
    assert findings[0].params["weight"] is None and findings[0].params["modulation"]
    facts = check_rewrite_runs(RmsNorm(), code, run, findings)
    assert facts["all_calls"].get("npu_rms_norm") == 1
    assert all(a == b for a, b in facts["dtypes"]), facts["dtypes"]
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"], default=1.0) >= 0.9999


def test_the_ones_gamma_takes_the_inputs_dtype_and_the_factor_is_applied_after_the_op():
    findings, _ = detect_all(RmsNorm(), _SCALE_ONLY)
    fused = findings[0].fused
    assert "torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)" in fused
    assert "[0] * (gamma.unsqueeze(1))" in fused


def test_a_parameter_weight_beside_a_run_time_factor_keeps_the_refusal():
    code = _SCALE_ONLY.replace("def scaled(x, gamma, eps=1e-6):", "def scaled(x, gamma, eps=1e-6, w=None):") \
        .replace("return normed * gamma.unsqueeze(1)", "return normed * self_w * gamma.unsqueeze(1)") \
        .replace("import torch\n", "import torch\nself_w = torch.ones(16)\n", 1)
    findings, misses = detect_all(RmsNorm(), code)
    assert not findings
    assert any("more than one factor besides the rms" in m.reason for m in misses)


def test_a_reshaped_weight_is_still_a_grouped_norm_not_a_modulation():
    code = '''
import torch
from torch import nn


class GroupedNorm(nn.Module):
    def __init__(self, d, groups):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.groups = groups

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight.view(self.groups, -1)
'''
    findings, misses = detect_all(RmsNorm(), code)
    assert not findings
    assert any("grouped norm" in m.reason for m in misses)


def test_a_per_sample_scale_handed_to_a_shared_helper_runs_the_original():
    from npufuse.patterns.rms_norm import _WEIGHT_TIMES_RSTD

    findings, _ = detect_all(RmsNorm(), _WEIGHT_TIMES_RSTD)
    assert [f.params.get("weight_check") for f in findings] == ["(scale is None or scale.dim() == 1)"]
    run = "m = AdaNorm(16, 8)\nx = torch.randn(2, 5, 16, requires_grad=True)\nout = m(x, torch.randn(2, 8))\nleaves = [x]\n"
    facts = check_rewrite_runs(RmsNorm(), _WEIGHT_TIMES_RSTD, run, findings)
    assert "npu_rms_norm" not in facts["all_calls"]  # [B, 1, D] is not a gamma: the original code ran
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_the_rstd_from_a_method_helper_is_read_through_its_binding():
    code = '''
import torch
from torch import nn


class Norm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))
        self.eps = eps

    def _inv(self, t):
        return torch.rsqrt(t.pow(2).mean(dim=-1, keepdim=True) + self.eps)

    def forward(self, x):
        h = x.float()
        return (h * self._inv(h)).to(x.dtype) * self.g
'''
    findings, _ = detect_all(RmsNorm(), code)
    assert [(f.qualname, f.params["weight"], f.params["eps"]) for f in findings] == [("Norm.forward", "self.g", "self.eps")]
    run = ("m = Norm(16).to(torch.bfloat16)\nwith torch.no_grad():\n    m.g.normal_()\n"
           "x = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)\nout = m(x)\nleaves = [x, m.g]\n")
    facts = check_rewrite_runs(RmsNorm(), code, run, findings)
    assert facts["all_calls"].get("npu_rms_norm") == 1 and min(facts["cos_out"]) >= 0.9999
