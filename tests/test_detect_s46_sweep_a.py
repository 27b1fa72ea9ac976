"""s46 recall sweep (helper sweep46a): the classes behind the misses on bench/detect_labels_sweep46a.json, eight LLM
repositories labelled before npufuse was run on them (development data).

A add_rms_norm: the residual sum, then ``if <flag>:`` whose body saves the sum (``residual = x``) before normalising
   it (a hybrid Mamba / xLSTM block with an optional MLP). Near miss: a test that reads the sum.
B add_rms_norm: a norm class whose forward is ``F.rms_norm(x, shape, self.weight.to(x.dtype), self.eps)`` (a
   block-diffusion LM), in this file or another of the repository. Near miss: the weight cast to another tensor's
   dtype.
C fused_optimizer: ``fused=fused and torch.cuda.is_available()`` (an implementation choice asking the runtime a
   question). Near miss: ``fused=`` computed by an arbitrary call.
"""

from __future__ import annotations

from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.fused_optimizer import FusedOptimizer
from pattern_harness import check_rewrite_runs, detect_all, found_and_faithful


# -- A: the body of a flag saves the sum before its norm

_FLAG_BODY_ALIAS = '''
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        rms = torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + self.eps)
        x_norm = x / rms
        return self.weight * x_norm


class HybridBlock(nn.Module):
    def __init__(self, dim, norm_type="rms", use_mlp=True):
        super().__init__()
        self.use_mlp = use_mlp
        if norm_type.lower() == "rms":
            self.norm1 = RMSNorm(dim)
        else:
            self.norm1 = nn.LayerNorm(dim)
        self.mixer = nn.Linear(dim, dim)
        if use_mlp:
            if norm_type.lower() == "rms":
                self.norm2 = RMSNorm(dim)
            else:
                self.norm2 = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        else:
            self.norm2 = None
            self.mlp = None

    def forward(self, x):
        residual = x
        x = self.norm1(x)
        x = self.mixer(x)
        x = residual + x
        if self.use_mlp:
            residual = x
            x = self.norm2(x)
            x = self.mlp(x)
            x = residual + x
        return x
'''

_FLAG_BODY_ALIAS_RUN = '''
torch.manual_seed(0)
block = HybridBlock(16)
with torch.no_grad():
    block.norm2.weight.uniform_(0.5, 1.5)
x = torch.randn(2, 5, 16, requires_grad=True)
out = block(x)
leaves = [x]
'''


def test_a_sum_saved_inside_a_flag_body_then_normalised_is_found_and_runs() -> None:
    findings = found_and_faithful(AddRmsNorm(), _FLAG_BODY_ALIAS, _FLAG_BODY_ALIAS_RUN)
    assert [(f.qualname, f.line) for f in findings] == [("HybridBlock.forward", 41)]


def test_a_rewrite_keeps_the_aliases_inside_the_body_and_fuses_inference() -> None:
    findings, _ = detect_all(AddRmsNorm(), _FLAG_BODY_ALIAS)
    fused = findings[0].fused
    # the body's alias runs only where the body does: the other branch is the add alone
    assert fused.rstrip().endswith("else:\n    x = residual + x")
    run = _FLAG_BODY_ALIAS_RUN.replace("out = block(x)", "with torch.no_grad():\n    out = block(x)").replace("leaves = [x]", "leaves = []")
    facts = check_rewrite_runs(AddRmsNorm(), _FLAG_BODY_ALIAS, run, findings)
    assert facts["all_calls"].get("npu_add_rms_norm", 0) >= 1 and min(facts["cos_out"]) > 0.9999


def test_a_flag_reading_the_sum_stays_unfused() -> None:
    code = _FLAG_BODY_ALIAS.replace("        if self.use_mlp:\n            residual = x",
                                    "        if x.abs().max() < 1e4:\n            residual = x")
    findings, _ = detect_all(AddRmsNorm(), code)
    assert [f.line for f in findings if f.line == 41] == []


# -- B: F.rms_norm with the weight cast to the input's dtype

_CAST_WEIGHT = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), weight=self.weight.to(dtype=x.dtype), eps=self.eps)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.rms1 = RMSNorm(dim)
        self.rms2 = RMSNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, xt, gate):
        attn_out = self.attn(self.rms1(xt))
        xt = xt + gate * attn_out
        h2 = self.rms2(xt)
        return xt + self.mlp(h2)
'''

_CAST_WEIGHT_RUN = '''
torch.manual_seed(0)
block = Block(16)
with torch.no_grad():
    block.rms2.weight.uniform_(0.5, 1.5)
xt = torch.randn(2, 5, 16, requires_grad=True)
gate = torch.rand(2, 1, 16)
out = block(xt, gate)
leaves = [xt]
'''


def test_b_library_norm_with_the_weight_cast_to_the_input_is_found_and_runs() -> None:
    findings = found_and_faithful(AddRmsNorm(), _CAST_WEIGHT, _CAST_WEIGHT_RUN)
    assert [(f.qualname, f.line, f.variant) for f in findings] == [("Block.forward", 27, "library_norm")]


def test_b_type_as_spelling_is_found() -> None:
    code = _CAST_WEIGHT.replace("weight=self.weight.to(dtype=x.dtype)", "weight=self.weight.type_as(x)")
    findings, _ = detect_all(AddRmsNorm(), code)
    assert [f.line for f in findings] == [27]


def test_b_weight_cast_to_another_tensors_dtype_stays_unfused() -> None:
    code = _CAST_WEIGHT.replace("weight=self.weight.to(dtype=x.dtype)", "weight=self.weight.to(dtype=self.weight.dtype)")
    findings, _ = detect_all(AddRmsNorm(), code)
    assert findings == []


# -- C: fused= asking the runtime whether CUDA is there

_QUERY_FUSED = '''
import torch
from torch.optim import AdamW


def configure_optimizer(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = AdamW(
        params,
        lr=lr,
        betas=betas,
        eps=eps,
        fused=fused and torch.cuda.is_available(),
    )
    return optimizer


def train(model, data):
    opt = configure_optimizer(model)
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
'''


def test_c_fused_flag_asking_the_runtime_is_dropped_and_the_call_fused() -> None:
    findings, _ = detect_all(FusedOptimizer(), _QUERY_FUSED)
    assert [(f.qualname, f.line) for f in findings] == [("configure_optimizer", 8)]
    assert "fused=" not in findings[0].fused and "NpuFusedAdamW" in findings[0].fused


def test_c_fused_flag_from_an_arbitrary_call_stays_a_near_miss() -> None:
    code = _QUERY_FUSED.replace("fused=fused and torch.cuda.is_available()", "fused=pick_fused(model)")
    findings, misses = detect_all(FusedOptimizer(), code)
    assert findings == [] and any("pick_fused" in m.reason for m in misses)


# -- D: an engine's add + norm method, written in place

_ENGINE_ADD_NORM = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def add_rms_forward(self, x, residual):
        orig_dtype = x.dtype
        x = x.float().add_(residual.float())
        residual = x.to(orig_dtype)
        var = x.pow(2).mean(dim=-1, keepdim=True)
        x.mul_(torch.rsqrt(var + self.eps))
        x = x.to(orig_dtype).mul_(self.weight)
        return x, residual
'''

_ENGINE_ADD_NORM_RUN = '''
torch.manual_seed(0)
norm = RMSNorm(16)
with torch.no_grad():
    norm.weight.uniform_(0.5, 1.5)
    norm.weight.data = norm.weight.data.bfloat16()
    x = torch.randn(3, 16).bfloat16()
    r = torch.randn(3, 16).bfloat16()
    out = norm.add_rms_forward(x, r)
leaves = []
'''


def test_d_engine_add_norm_method_in_place_is_found_and_runs_the_fused_op() -> None:
    findings, _ = detect_all(AddRmsNorm(), _ENGINE_ADD_NORM)
    assert [(f.qualname, f.line, f.variant) for f in findings] == [("RMSNorm.add_rms_forward", 13, "engine_add_norm")]
    facts = check_rewrite_runs(AddRmsNorm(), _ENGINE_ADD_NORM, _ENGINE_ADD_NORM_RUN, findings)
    assert facts["all_calls"].get("npu_add_rms_norm", 0) == 1 and facts["n_out"] == (2, 2)
    assert min(facts["cos_out"]) > 0.9999 and facts["dtypes"] == [(a, a) for a, _ in facts["dtypes"]]


def test_d_functional_spelling_is_found_too() -> None:
    code = _ENGINE_ADD_NORM.replace("x = x.float().add_(residual.float())", "x = x.float() + residual.float()")
    findings, _ = detect_all(AddRmsNorm(), code)
    assert [f.variant for f in findings] == ["engine_add_norm"]


def test_d_plain_alias_of_an_in_place_normalised_sum_stays_a_near_miss() -> None:
    code = _ENGINE_ADD_NORM.replace("x = x.float().add_(residual.float())", "x = x + residual").replace(
        "residual = x.to(orig_dtype)", "residual = x")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert findings == [] and any("shares storage" in m.reason for m in misses)


def test_d_float32_input_keeps_the_original_in_place_aliasing() -> None:
    # a float32 x: x.float() is x and .to(float32) no copy, so the original returns the normalised tensor twice; the
    # fused branch runs for half inputs only
    findings, _ = detect_all(AddRmsNorm(), _ENGINE_ADD_NORM)
    assert "x.dtype in (torch.float16, torch.bfloat16)" in findings[0].fused
    run = _ENGINE_ADD_NORM_RUN.replace(".bfloat16()", "")
    facts = check_rewrite_runs(AddRmsNorm(), _ENGINE_ADD_NORM, run, findings)
    assert facts["all_calls"].get("npu_add_rms_norm", 0) == 0 and min(facts["cos_out"]) > 0.9999


def test_d_float32_residual_handed_on_stays_a_near_miss() -> None:
    code = _ENGINE_ADD_NORM.replace("residual = x.to(orig_dtype)", "residual = x")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert findings == [] and any("in float32" in m.reason for m in misses)


def test_d_norm_reading_the_residual_again_stays_a_near_miss() -> None:
    code = _ENGINE_ADD_NORM.replace("var = x.pow(2).mean(dim=-1, keepdim=True)", "var = (x * residual).mean(dim=-1, keepdim=True)")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert findings == [] and any("read the residual again" in m.reason for m in misses)


def test_d_a_module_norm_in_the_engine_shape_is_left_to_the_other_readings() -> None:
    # the probe cannot read a norm module's call as a function of the sum: the engine reading gives way to the
    # existing add + norm reading of the same method (no early near miss hides it)
    code = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Layer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = RMSNorm(dim)

    def add_norm(self, x, residual):
        orig = x.dtype
        x = x + residual
        residual = x
        x = self.norm(x)  # x * rsqrt(mean(x^2) + eps) * w
        return x, residual
'''
    findings, _ = detect_all(AddRmsNorm(), code)
    assert [(f.qualname, f.variant != "engine_add_norm") for f in findings] == [("Layer.add_norm", True)]


# -- E: a norm handed to an exported helper that no call in the file binds

_UNBOUND_NORM = '''
from typing import Tuple
import torch
import torch.nn as nn


def fused_add_norm(x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fused residual addition and normalization."""
    residual = residual + x
    normalized = norm(residual)
    return normalized, residual
'''

_UNBOUND_NORM_RUN = '''
torch.manual_seed(0)
norm = nn.RMSNorm(16, eps=1e-6)
with torch.no_grad():
    norm.weight.uniform_(0.5, 1.5)
x = torch.randn(2, 5, 16, requires_grad=True)
r = torch.randn(2, 5, 16, requires_grad=True)
out = fused_add_norm(x, r, norm)
leaves = [x, r]
'''


def test_e_unbound_norm_parameter_is_fused_where_it_is_torchs_rmsnorm() -> None:
    findings = found_and_faithful(AddRmsNorm(), _UNBOUND_NORM, _UNBOUND_NORM_RUN)
    assert [(f.qualname, f.line) for f in findings] == [("fused_add_norm", 9)]
    assert findings[0].fused.startswith("if isinstance(norm, torch.nn.RMSNorm) and type(norm).forward is torch.nn.RMSNorm.forward")


def test_e_a_layernorm_handed_over_runs_the_original() -> None:
    findings, _ = detect_all(AddRmsNorm(), _UNBOUND_NORM)
    run = _UNBOUND_NORM_RUN.replace("nn.RMSNorm(16, eps=1e-6)", "nn.LayerNorm(16)")
    facts = check_rewrite_runs(AddRmsNorm(), _UNBOUND_NORM, run, findings)
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.9999


def test_e_a_caller_handing_an_unresolved_module_keeps_the_s42_near_miss() -> None:
    code = _UNBOUND_NORM + '''

def block(x, residual, layers):
    return fused_add_norm(x, residual, layers.pick())
'''
    findings, misses = detect_all(AddRmsNorm(), code)
    assert findings == [] and any("is a parameter of `fused_add_norm`" in m.reason for m in misses)


def test_e_a_plain_function_handed_over_runs_the_original() -> None:
    findings, _ = detect_all(AddRmsNorm(), _UNBOUND_NORM)
    run = _UNBOUND_NORM_RUN.replace("out = fused_add_norm(x, r, norm)", "out = fused_add_norm(x, r, torch.tanh)")
    facts = check_rewrite_runs(AddRmsNorm(), _UNBOUND_NORM, run, findings)
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.9999
