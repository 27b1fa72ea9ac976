"""Issue 14, class 1 (norms): the spellings the rms_norm / add_rms_norm detectors now read, checked
beyond the patterns' own examples -- the shared canonical pieces, run-time checks that must take
the original code, helper bookkeeping, and a norm class imported from another module."""

from __future__ import annotations

import ast
import sys
import types

import pytest
import torch

from npufuse import emulate
from npufuse.patterns import add_rms_norm as A
from npufuse.patterns import rms_norm as R
from npufuse.rewrite.codegen import splice
from npufuse.scan import canonical
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import _exec, _run, check_rewrite_runs, detect_all

HEADER = "import math\nimport torch as th\nimport torch.nn.functional as F\n"


def _value(body: str) -> tuple[ModuleInfo, ast.expr]:
    m = ModuleInfo.from_source("m.py", HEADER + body)
    return m, m.tree.body[-1].value  # type: ignore[attr-defined]


# -- canonical: the pieces of an L2-normalisation RMSNorm ------------------------------------------

@pytest.mark.parametrize("text", [
    "th.norm(x, dim=-1, keepdim=True)", "x.norm(2, -1, True)", "x.norm(p=2, dim=-1, keepdim=True)",
    "th.linalg.vector_norm(x, dim=-1, keepdim=True)", "th.linalg.norm(x, ord=2, dim=(-1,), keepdim=True)",
    "x.norm(dim=-1, keepdim=True)",
])
def test_l2_norm_spellings_give_the_operand(text):
    m, v = _value(f"n = {text}\n")
    got = canonical.l2_norm_operand(m, v)
    assert isinstance(got, ast.Name) and got.id == "x"


@pytest.mark.parametrize("text", [
    "th.norm(x, dim=1, keepdim=True)",  # another dim
    "th.norm(x, dim=-1)",  # not kept: does not broadcast back
    "x.norm(1, -1, True)",  # the 1-norm
    "self.norm(x)",  # a module called norm
    "th.norm(*xs)",
])
def test_other_norms_are_not_l2_over_the_last_dim(text):
    m, v = _value(f"n = {text}\n")
    assert canonical.l2_norm_operand(m, v) is None


@pytest.mark.parametrize("text", ["n.clamp(min=eps)", "n.clamp(eps)", "n.clamp_min(eps)", "th.clamp(n, min=eps)",
                                  "th.clamp_min(n, eps)", "n.clip(min=eps)"])
def test_clamp_from_below_spellings(text):
    m, v = _value(f"y = {text}\n")
    got = canonical.clamp_min_of(m, v)
    assert got is not None and ast.unparse(got[0]) == "n" and ast.unparse(got[1]) == "eps"


@pytest.mark.parametrize("text", ["n.clamp(min=eps, max=1.0)", "n.clamp(0, 1)", "th.clamp(n, max=eps)", "n.abs()"])
def test_other_clamps_are_not_a_floor(text):
    m, v = _value(f"y = {text}\n")
    assert canonical.clamp_min_of(m, v) is None


@pytest.mark.parametrize("text,want", [
    ("d ** 0.5", 0.5), ("math.sqrt(d)", 0.5), ("d ** -0.5", -0.5), ("1 / math.sqrt(d)", -0.5), ("1.0 / d ** 0.5", -0.5),
    ("d ** 2", None), ("th.sqrt(t)", None), ("self.scale", 0.5), ("self.other", None),
])
def test_root_power_reads_init_attributes(text, want):
    m, v = _value(f"y = {text}\n")
    init = {"scale": ast.parse("dim ** 0.5", mode="eval").body}
    assert canonical.root_power(m, v, init.get) == want


# -- rms_norm: weightless helpers, dims, nested helpers ----------------------------------------------

def test_meta_norm_helper_is_not_a_second_site():
    # Meta's _norm is weightless, but forward applies the weight and is replaced whole
    findings, _ = detect_all(R.RmsNorm(), R._META)
    assert [(f.qualname, f.variant) for f in findings] == [("RMSNorm.forward", "cast_then_weight")]


def test_weightless_helper_called_on_its_own_is_a_site_and_its_weighted_caller_too():
    findings, _ = detect_all(R.RmsNorm(), R._NESTED_HELPER)
    assert sorted((f.qualname, f.variant) for f in findings) == [("Norm.forward", "cast_then_weight"), ("qk_rms", "no_weight")]
    # the closure's eps is the caller's: inside Norm.forward it reads self.eps
    fwd = next(f for f in findings if f.qualname == "Norm.forward")
    assert fwd.params["eps"] == "self.eps"


def test_weight_applied_in_a_branch_then_returned_by_name_is_fused_under_that_branch():
    code = '''
import torch


def norm(x, w, flag: bool):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    if flag:
        x = x * w
    return x
'''
    findings, misses = detect_all(R.RmsNorm(), code)
    # the weight is applied only when flag holds: fused with it then, the original code otherwise
    assert len(findings) == 1 and findings[0].params["weight_condition"] == "flag"
    run = "x = torch.randn(2, 3, 8)\nw = torch.randn(8)\nout = (norm(x, w, True), norm(x, w, False))\n"
    facts = check_rewrite_runs(R.RmsNorm(), code, run, findings)
    assert facts["calls"] == 1 and min(facts["cos_out"]) > 0.99999


def test_dim_attribute_set_to_another_dim_at_run_time_takes_the_original_code():
    code = R._DIM_ATTRIBUTE
    findings, _ = detect_all(R.RmsNorm(), code)
    assert findings and findings[0].params["dim_check"] == "self.dim == -1"
    run = ("m = ScaleNormish(5, dim=1)\nwith torch.no_grad():\n    m.scale.normal_()\n"
           "x = torch.randn(2, 7, 5, requires_grad=True)\nout = m(x)\nleaves = [x, m.scale]\n")
    facts = check_rewrite_runs(R.RmsNorm(), code, run, findings)
    assert facts["calls"] == 0  # dim 1 of a 3-D input: the fused op would normalise the wrong dim
    assert min(facts["cos_out"]) > 0.999999 and min(facts["cos_grad"]) > 0.999999


def test_dim_attribute_without_a_default_is_guarded_at_run_time():
    # s36: a dim the object is built with is read at run time (the last dim as -1 or rank - 1)
    code = R._DIM_ATTRIBUTE.replace("dim: int = -1", "dim: int")
    findings, _ = detect_all(R.RmsNorm(), code)
    assert findings and findings[0].params["dim_check"] == "self.dim in (-1, (-1,), x.dim() - 1)"


# -- L2-normalisation forms: the eps difference is stated, and zero rows stay finite ---------------

def test_l2_normalize_states_the_clamp_risk_and_handles_zero_rows():
    findings, _ = detect_all(R.RmsNorm(), R._L2_NORMALIZE)
    (f,) = findings
    assert any("clamp on the norm" in r.detail and "near-zero rows" in r.detail for r in f.risks)
    rewritten = splice(R._L2_NORMALIZE, findings)
    run = "m = RMSNorm(16)\nx = torch.randn(3, 16)\nx[1] = 0.0\nx[2] *= 1e-3\nout = m(x)\n"
    ref, _ = _run(_exec(R._L2_NORMALIZE, "original"), run)
    with emulate.install() as emu:
        got, _ = _run(_exec(rewritten, "rewritten"), run)
    assert sum(emu.calls.values()) == 1
    assert torch.isfinite(got[0]).all() and torch.equal(got[0][1], ref[0][1])  # a zero row stays zero
    assert torch.allclose(got[0], ref[0], rtol=1e-4, atol=1e-5)


def test_l2_gain_that_is_not_per_feature_multiplies_the_fused_output():
    # a [1, d] gain is not a gamma of the last dim: the fused op runs with ones and the gain after it
    code = R._L2_NORMALIZE.replace("torch.ones(dim)", "torch.ones(1, dim)")
    findings, _ = detect_all(R.RmsNorm(), code)
    facts = check_rewrite_runs(R.RmsNorm(), code, "m = RMSNorm(8)\nx = torch.randn(2, 3, 8)\nout = m(x)\n", findings)
    assert facts["calls"] == 1 and facts["shapes"][0][0] == facts["shapes"][0][1] and min(facts["cos_out"]) > 0.99999


# -- add_rms_norm: a norm class from another module --------------------------------------------------

_EXTERNAL_LAYER = '''
import torch
from torch import nn
from my_norms import FancyRMSNorm, OtherRMSNorm


class Layer(nn.Module):
    def __init__(self, d, fused=False):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)
        norm_class = OtherRMSNorm if fused else FancyRMSNorm
        self.norm = norm_class(d)

    def forward(self, x):
        h = x + self.proj(x)
        h = self.norm(h)
        return h
'''


class _HFNorm(torch.nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d))
        self.variance_epsilon = eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


class _ScaleNamed(torch.nn.Module):
    """Another library's norm: its gain is called ``scale`` -- not what the external path assumes."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(d))
        self.eps = eps

    def forward(self, x):
        return self.scale * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


@pytest.fixture
def my_norms(monkeypatch):
    mod = types.ModuleType("my_norms")
    mod.FancyRMSNorm, mod.OtherRMSNorm = _HFNorm, _ScaleNamed  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "my_norms", mod)
    return mod


def test_norm_class_chosen_by_a_flag_from_another_module(my_norms):
    findings, _ = detect_all(A.AddRmsNorm(), _EXTERNAL_LAYER)
    (f,) = findings
    assert f.variant == "external_norm" and f.params["norm_class"] == "OtherRMSNorm or FancyRMSNorm"
    assert 'getattr(self.norm, "weight", None) is not None' in f.params["condition"]  # s40 sweep40: a None weight is no weight
    infer = "torch.set_grad_enabled(False)\nm = Layer(16)\nx = torch.randn(2, 3, 16)\nout = m(x)\ntorch.set_grad_enabled(True)\n"
    facts = check_rewrite_runs(A.AddRmsNorm(), _EXTERNAL_LAYER, infer, findings)
    assert facts["all_calls"].get("npu_add_rms_norm") == 1 and min(facts["cos_out"]) >= 0.9999
    # the other class has no .weight: the run-time check takes the original statements
    other = infer.replace("Layer(16)", "Layer(16, fused=True)")
    facts = check_rewrite_runs(A.AddRmsNorm(), _EXTERNAL_LAYER, other, findings)
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.999999


def test_optional_norm_absent_takes_the_original_statements():
    findings, _ = detect_all(A.AddRmsNorm(), A._OPTIONAL_GEMMA_NORM)
    run = "torch.set_grad_enabled(False)\nm = Layer(8, use_pre_ffw_norm=False)\nx = torch.randn(2, 3, 8)\nout = m(x)\ntorch.set_grad_enabled(True)\n"
    facts = check_rewrite_runs(A.AddRmsNorm(), A._OPTIONAL_GEMMA_NORM, run, findings)
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.999999


def test_library_norm_of_a_residual_sum_is_reported_once_as_add_rms_norm():
    code = A._INLINE_LIBRARY_NORM
    rms, _ = detect_all(R.RmsNorm(), code)
    add, _ = detect_all(A.AddRmsNorm(), code)
    # the first norm reads the block's input (an rms_norm site), the second the residual sum
    assert [f.line for f in rms] == [16] and [(f.line, f.end_line) for f in add] == [(16, 17)]


def test_a_product_of_the_name_after_it_is_reassigned_is_not_a_later_weight():
    code = '''
import torch


def qk(q, k):
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
    s = q @ k.transpose(-2, -1)
    q = s.softmax(-1)
    return q * 2.0
'''
    findings, _ = detect_all(R.RmsNorm(), code)
    assert [(f.line, f.variant) for f in findings] == [(6, "no_weight")]
    assert any("ones of the last dim" in n for n in findings[0].notes)


def test_same_named_helpers_of_two_classes_are_told_apart():
    # transformers' Llama4: a weightless and a weighted norm class, both with a ``_norm`` method
    code = '''
import torch
from torch import nn


class Weightless(nn.Module):
    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x)


class Weighted(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight
'''
    findings, _ = detect_all(R.RmsNorm(), code)
    assert sorted((f.qualname, f.variant) for f in findings) == [("Weighted.forward", "cast_then_weight"), ("Weightless.forward", "no_weight")]


def test_grouped_gated_norm_is_not_cut_into_a_weightless_site():
    # Mamba2-style: the group statistic is normalised, viewed back, then weighted -- not a whole norm
    code = '''
import torch
from torch import nn


class GatedNorm(nn.Module):
    def __init__(self, d, group_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps
        self.group_size = group_size

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        *prefix, last = hidden_states.shape
        group = hidden_states.view(*prefix, last // self.group_size, self.group_size)
        variance = group.pow(2).mean(-1, keepdim=True)
        group = group * torch.rsqrt(variance + self.eps)
        hidden_states = group.view(*prefix, last)
        return self.weight * hidden_states.to(input_dtype)
'''
    findings, misses = detect_all(R.RmsNorm(), code)
    assert not findings
    assert any("grouped or reshaped norm" in m.reason or "multiplied later" in m.reason for m in misses)


def test_scan_of_a_repo_with_the_norm_class_in_another_file(tmp_path):
    from npufuse.scan.engine import scan_repo

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "norms.py").write_text(R._DIM_ATTRIBUTE.split("class Block")[0])
    (tmp_path / "pkg" / "model.py").write_text('''
import torch
from torch import nn
from .norms import ScaleNormish as RMSNorm


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mlp = nn.Linear(d, d)
        self.rms_2 = RMSNorm(d)

    def forward(self, x, h):
        x = x + h
        x = x + self.mlp(self.rms_2(x))
        return x
''')
    result = scan_repo(tmp_path, only=["rms_norm", "add_rms_norm"], jobs=1)
    got = sorted((c["pattern"], c["file"], c["line"]) for c in result.candidates)
    assert got == [("add_rms_norm", "pkg/model.py", 14), ("rms_norm", "pkg/norms.py", 16)]
    add = next(c for c in result.candidates if c["pattern"] == "add_rms_norm")
    # defined in another file of the repository: read there (s31), its gain `.scale` and its dim
    # attribute checked where it runs, instead of HF semantics assumed
    assert add["confidence"] == "high" and add["params"]["weight"] == "self.rms_2.scale", add["params"]
    assert "self.rms_2.dim == -1" in add["params"]["condition"]
