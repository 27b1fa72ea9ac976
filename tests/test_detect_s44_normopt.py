"""s44 (helper normopt44): recall classes read from real development misses of add_rms_norm, rms_norm and
fused_optimizer, each with a near miss (Keep) that is truly not the same computation.

1. add_rms_norm: a norm class whose forward returns apex's ``fused_rms_norm_affine`` of its input (verl's Megatron
   ``ParallelLlamaRMSNorm``), imported in the forward or by the file: the residual add feeding it is fused.
   Keep: apex's ``fused_layer_norm_affine`` (mean-subtracted LayerNorm kernel) in the same place.
2. swiglu / geglu: ``act(T[0]) * T[1]`` where one projection stacks gate and up on a leading dim (tapnet's TAPNext
   ``MLPBlock``: ``out = self.ffw_up(x)`` [2, ..., D], ``gelu(out[0]) * out[1]``): the halves of ``T[:2]`` on dim 0,
   fused without a concatenation. Keeps: rows of two different tensors, rows 0 and 2, a Python tuple of two
   values indexed so (its items need not share a shape), rows of the input or of a reshaped output (batch rows).
"""

from __future__ import annotations

import pytest
import torch

from pattern_harness import check_rewrite_runs, detect_all, install_stand_in_modules
from test_detect_s43_sweep import _BLOCK_RUN

from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.geglu import Geglu
from npufuse.patterns.swiglu import Swiglu


def _apex_rms(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):  # noqa: A002 (apex's names)
    """apex's fused_rms_norm_affine as its CUDA kernel computes it: float32 statistics, the input's dtype out."""
    dims = tuple(range(-len(normalized_shape), 0))
    x = input.float()
    return (x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps) * weight.float()).to(input.dtype)


def _apex_ln(input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False):  # noqa: A002
    return torch.nn.functional.layer_norm(input, normalized_shape, weight, bias, eps)


@pytest.fixture
def apex(monkeypatch: pytest.MonkeyPatch) -> None:
    install_stand_in_modules(monkeypatch, {"apex.normalization.fused_layer_norm": {
        "fused_rms_norm_affine": _apex_rms, "fused_layer_norm_affine": _apex_ln,
        "FusedRMSNormAffineFunction": type("FusedRMSNormAffineFunction", (), {"apply": staticmethod(_apex_rms)})}})


_APEX_NORM_LOCAL = '''
import torch
from torch import nn


class ParallelRMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.normalized_shape = torch.Size((hidden,))
        self.weight = nn.Parameter(torch.ones(self.normalized_shape))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        from apex.normalization.fused_layer_norm import fused_rms_norm_affine

        return fused_rms_norm_affine(
            input=hidden_states,
            weight=self.weight,
            normalized_shape=self.normalized_shape,
            eps=self.variance_epsilon,
            memory_efficient=True,
        )
'''

_APEX_NORM_FILE = '''
import torch
from torch import nn
from apex.normalization.fused_layer_norm import fused_rms_norm_affine as rms_kernel


class ParallelRMSNorm(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.shape = (hidden,)
        self.gain = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return rms_kernel(x, self.gain, self.shape, 1e-6)
'''

_APEX_LAYER_NORM = '''
import torch
from torch import nn


class ParallelRMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-5):
        super().__init__()
        self.normalized_shape = (hidden,)
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.eps = eps

    def forward(self, hidden_states):
        from apex.normalization.fused_layer_norm import fused_layer_norm_affine

        return fused_layer_norm_affine(hidden_states, self.weight, self.bias, self.normalized_shape, self.eps)
'''

_DECODER = '''

class DecoderLayer(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.self_attn = nn.Linear(hidden, hidden)
        self.mlp = nn.Linear(hidden, hidden)
        self.post_attention_layernorm = ParallelRMSNorm(hidden)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.self_attn(hidden_states)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states
'''

# the s43 sweep's run: inference under no_grad (npu_add_rms_norm), then a training call (add + npu_rms_norm)
_DECODER_RUN = _BLOCK_RUN.replace("Block(16)", "DecoderLayer(16)")


_APEX_NORM_APPLY = _APEX_NORM_FILE.replace("import fused_rms_norm_affine as rms_kernel", "import FusedRMSNormAffineFunction").replace(
    "rms_kernel(x, self.gain, self.shape, 1e-6)", "FusedRMSNormAffineFunction.apply(x, self.gain, self.shape, 1e-6)")


@pytest.mark.parametrize("norm", [_APEX_NORM_LOCAL, _APEX_NORM_FILE, _APEX_NORM_APPLY],
                         ids=["imported_in_forward", "imported_by_file", "autograd_function_apply"])
def test_residual_add_feeding_an_apex_rms_kernel_norm_is_fused(apex: None, norm: str) -> None:
    code = norm + _DECODER
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [f.qualname for f in findings] == ["DecoderLayer.forward"], misses
    facts = check_rewrite_runs(AddRmsNorm(), code, _DECODER_RUN, findings)
    assert facts["all_calls"].get("npu_add_rms_norm"), facts["all_calls"]
    assert all(c > 0.99999 for c in facts["cos_out"]), facts["cos_out"]
    assert all(c > 0.99999 for c in facts["cos_grad"]), facts["cos_grad"]


def test_residual_add_feeding_an_apex_layer_norm_kernel_is_not_fused(apex: None) -> None:
    findings, misses = detect_all(AddRmsNorm(), _APEX_LAYER_NORM + _DECODER)
    assert not findings, misses


def test_apex_rms_kernel_of_a_scaled_input_is_not_read_as_the_norm_of_the_sum(apex: None) -> None:
    # the kernel normalises ``hidden_states * self.pre``, not the module's input: the sum is not what is normalised
    norm = _APEX_NORM_LOCAL.replace("input=hidden_states,", "input=hidden_states * self.pre,").replace(
        "self.variance_epsilon = eps", "self.variance_epsilon = eps\n        self.pre = nn.Parameter(torch.ones(hidden))")
    findings, misses = detect_all(AddRmsNorm(), norm + _DECODER)
    assert not findings, misses


# -- 2. gate and up as the two leading rows of one tensor --------------------------------------------------------------

_STACKED = '''
import torch
from torch import nn
import torch.nn.functional as F


def gelu(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh")


class StackedUp(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, d, h) * 0.1)
        self.b = nn.Parameter(torch.zeros(2, 1, 1, h))

    def forward(self, x):
        return torch.einsum("...td,cdD->c...tD", x, self.w) + self.b


class MLPBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ffw_up = StackedUp(d, h)
        self.ffw_down = nn.Linear(h, d)

    def forward(self, x):
        out = self.ffw_up(x)
        gate_value = {act}(out[{g}])
        activations = gate_value * out[{u}]
        return self.ffw_down(activations)
'''

_STACKED_RUN = '''
m = MLPBlock(8, 16)
x = torch.randn(3, 5, 8, requires_grad=True)
out = m(x)
leaves = [x]
'''


@pytest.mark.parametrize(("pattern", "act", "g", "u", "op"), [
    (Geglu(), "gelu", 0, 1, "npu_geglu"),
    (Geglu(), "F.gelu", 1, 0, "npu_geglu"),
    (Swiglu(), "F.silu", 0, 1, "npu_swiglu"),
    (Swiglu(), "F.silu", 1, 0, "npu_swiglu"),
], ids=["geglu_tanh_helper", "geglu_gate_second", "swiglu", "swiglu_gate_second"])
def test_act_of_one_leading_row_times_the_other_is_fused_on_dim_0(pattern, act: str, g: int, u: int, op: str) -> None:
    code = _STACKED.format(act=act, g=g, u=u)
    findings, misses = detect_all(pattern, code)
    assert [f.qualname for f in findings] == ["MLPBlock.forward"], misses
    facts = check_rewrite_runs(pattern, code, _STACKED_RUN, findings)
    assert facts["all_calls"].get(op), facts["all_calls"]
    assert "[:2]" in facts["rewritten"] and "torch.cat([" not in facts["rewritten"]
    assert facts["shapes"][0][0] == facts["shapes"][0][1]
    assert all(c > 0.99999 for c in facts["cos_out"]), facts["cos_out"]
    assert all(c > 0.99999 for c in facts["cos_grad"]), facts["cos_grad"]


@pytest.mark.parametrize("product", [
    "gate_value = F.silu(out[0])\n        activations = gate_value * self.ffw_up(x * 2)[1]",
    "gate_value = F.silu(out[0])\n        activations = gate_value * out[2]",
    "out = (self.ffw_up(x)[0], self.ffw_down.weight.sum() + x)\n        activations = F.silu(out[0]) * out[1]",
    "activations = F.silu(x[0]) * x[1]",
    "out = self.ffw_up(x).flatten(0, 1)\n        activations = F.silu(out[0]) * out[1]",
], ids=["rows_of_two_tensors", "rows_0_and_2", "python_tuple_of_two_values", "rows_of_the_input", "rows_of_a_reshaped_output"])
def test_rows_not_of_one_leading_pair_are_not_fused(product: str) -> None:
    code = _STACKED.format(act="F.silu", g=0, u=1).replace(
        "gate_value = F.silu(out[0])\n        activations = gate_value * out[1]", product)
    assert product in code
    findings, _misses = detect_all(Swiglu(), code)
    assert not findings
