"""s27 glu census classes: behaviour the pattern examples do not pin down by themselves (spans,
guards, reasons). The examples in swiglu.py run end to end under the emulator; these check the
shape of what is emitted."""

from __future__ import annotations

from npufuse.patterns.geglu import Geglu
from npufuse.patterns.swiglu import _S27_OFFSET_UP, Swiglu
from tests.pattern_harness import detect_all

_FOREIGN = '''
import torch


def mlp_forward(layers, hidden_states, layer_id):
    x = hidden_states
    origin = layers[layer_id]
    x1 = origin.dense_h_to_4h(x)
    x2 = origin.gate_proj(x)
    hidden = origin.activation_func(x2) * x1
    return origin.dense_4h_to_h(hidden)
'''


def test_dropped_weak_factor_does_not_pull_its_statement_into_the_span() -> None:
    # `origin.dense_h_to_4h(x)` looks like a weak activation object too; only the chosen
    # activation's statements may join the replaced span, so `x1 = ...` stays as written before it
    findings, _ = detect_all(Swiglu(), _FOREIGN)
    assert len(findings) == 1
    f = findings[0]
    assert f.line == f.end_line == 10
    assert "dense_h_to_4h" not in f.fused


def test_inline_operand_guard_reads_names_and_values_only() -> None:
    findings, _ = detect_all(Swiglu(), _S27_OFFSET_UP)
    assert len(findings) == 1
    first = findings[0].fused.splitlines()[0]
    assert first.startswith("if x_glu.shape == torch.broadcast_shapes(x_linear.shape,")
    assert "self.fc1" not in first and "activation_func(" not in first


def test_inline_operand_computing_a_projection_is_a_near_miss() -> None:
    code = _S27_OFFSET_UP.replace("(x_linear + self.config.linear_offset)", "(self.fc1(x_linear) * 2.0)")
    findings, misses = detect_all(Swiglu(), code)
    assert not findings
    assert all("not" in m.reason or "computed" in m.reason for m in misses)


def test_lambda_gelu_object_is_read_statically() -> None:
    code = '''
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.activation = lambda x: F.gelu(x, approximate="tanh")

    def forward(self, x):
        gate = self.gate_proj(x)
        up = self.up_proj(x)
        return self.activation(gate) * up
'''
    findings, _ = detect_all(Geglu(), code)
    assert len(findings) == 1 and findings[0].params["approximate"] == 1 and findings[0].params["activation"] == "gelu_tanh"
    # a lambda that reads its parameter twice is no activation object: nothing is claimed
    twice = code.replace('lambda x: F.gelu(x, approximate="tanh")', 'lambda x: F.gelu(x, approximate="tanh") + x')
    assert detect_all(Geglu(), twice)[0] == [] and detect_all(Swiglu(), twice)[0] == []
