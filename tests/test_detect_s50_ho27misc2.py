"""s50 (ho27misc2): the two judged HO27 classes ho27misc left, as invented spellings (no repository code).

1. add_rms_norm: an own RMS norm class whose forward has several exiting arms (F.rms_norm under a test with pure
   calls, an opt-in external kernel behind a keyword the call passes, the norm by hand): read as one RMS norm; the
   keyword's arm is excluded by a run-time test of the caller's value; an arm with another eps, or one the reader
   cannot exclude, keeps a true reason. Where the hand-written arm promotes with a float32 weight and F.rms_norm does
   not, the fused code runs only where both give one dtype.
2. swiglu: a learned bias added to the gate half before the activation (``silu(gate + b) * up``, b read with
   ``int(step)``): ``npu_swiglu(cat([gate + b, up]))`` under a shape test, with the cat copy's cost in the value.
"""

from __future__ import annotations

from typing import Any

import torch
from pattern_harness import _exec, detect_all, fused_and_runs

from npufuse import emulate
from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.swiglu import Swiglu, gated_value
from npufuse.rewrite.codegen import splice


# -- 1. add_rms_norm: an N-arm norm forward -----------------------------------------------------------------------------

_ARMS = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class ScaleOnlyNorm(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.gain = nn.Parameter(torch.ones(width))

    def _unit(self, t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, t, external: bool = False):
        if not external and hasattr(F, "rms_norm") and not torch.jit.is_scripting():
            return F.rms_norm(t, self.gain.shape, self.gain, eps=self.eps)
        if external:
            from vendor_kernels import rms_forward
            return rms_forward(t, self.gain, self.eps)
        y = self._unit(t.float()).type_as(t)
        return y * self.gain


class Stage(nn.Module):
    def __init__(self, dim, external=False):
        super().__init__()
        self.mixer = nn.Linear(dim, dim)
        self.ff = nn.Linear(dim, dim)
        self.pre = ScaleOnlyNorm(dim)
        self.post = ScaleOnlyNorm(dim)
        self.external = external

    def forward(self, x):
        ext = self.external
        h = x + self.mixer(self.pre(x, external=ext))
        return h + self.ff(self.post(h, external=ext))
'''

# training (npu_rms_norm), inference (npu_add_rms_norm), bf16 throughout, and a bf16 input to fp32 weights (the
# F.rms_norm arm returns bf16 there while the hand-written arm would promote: the fused code keeps the original)
_ARMS_RUN = '''
torch.manual_seed(0)
m = Stage(16)
with torch.no_grad():
    m.post.gain.mul_(torch.rand(16) + 0.5)
x = torch.randn(2, 5, 16, requires_grad=True)
mb = Stage(16)
mb.load_state_dict(m.state_dict())
mb = mb.to(torch.bfloat16)
with torch.no_grad():
    infer = m(x.detach() * 2)
    infer_b = mb(x.detach().to(torch.bfloat16))
mm = Stage(16)
mm.load_state_dict(m.state_dict())
mm.mixer.to(torch.bfloat16)
mm.ff.to(torch.bfloat16)
out = [m(x), infer, infer_b, mm(x.detach().to(torch.bfloat16))]
leaves = [x, m.post.gain]
'''


def _max_rel(code: str, run: str, findings: list) -> tuple[list[float], dict[str, int], list[tuple]]:
    """Largest relative difference per output between the original and the rewrite under the emulator, the fused calls,
    and the (original, rewritten) dtypes."""
    rewritten = splice(code, findings)
    ns = _exec(code, "original")
    exec(compile(run, "<run>", "exec"), ns)
    with emulate.install() as emu:
        fns = _exec(rewritten, "rewritten")
        exec(compile(run, "<run>", "exec"), fns)
    rel = [((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-12)).item() for a, b in zip(ns["out"], fns["out"])]
    return rel, dict(emu.calls), [(a.dtype, b.dtype) for a, b in zip(ns["out"], fns["out"])]


def test_n_arm_norm_with_keyword_arm_fuses_under_the_callers_flag() -> None:
    facts = fused_and_runs(AddRmsNorm(), _ARMS, _ARMS_RUN, "Stage.forward")
    assert facts["all_calls"].get("npu_rms_norm", 0) >= 1 and facts["all_calls"].get("npu_add_rms_norm", 0) >= 1, facts["all_calls"]
    findings, _ = detect_all(AddRmsNorm(), _ARMS)
    text = findings[0].fused
    assert "if not (ext):" in text, text  # the external kernel's arm is excluded by the caller's value
    # the dtype agreement term, in both paths
    assert "torch.promote_types(h.dtype, self.post.gain.dtype) == h.dtype" in text, text
    assert "torch.promote_types(_npu_x1.dtype, self.post.gain.dtype) != _npu_x1.dtype" in text, text
    rel, calls, dtypes = _max_rel(_ARMS, _ARMS_RUN, findings)
    assert all(a == b for a, b in dtypes), dtypes
    assert rel[0] < 1e-6 and rel[1] < 1e-6, rel  # fp32 training and inference
    assert rel[2] < 1e-2, rel  # bf16: one rounding apart at most
    assert rel[3] == 0.0, rel  # bf16 input, fp32 weights: the original runs


def test_n_arm_norm_called_without_the_keyword_needs_no_guard() -> None:
    code = _ARMS.replace("self.pre(x, external=ext)", "self.pre(x)").replace("self.post(h, external=ext)", "self.post(h)")
    assert code != _ARMS
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [f.qualname for f in findings] == ["Stage.forward"], [m.reason for m in misses]
    assert "if not (" not in findings[0].fused  # the default is False: the arm never runs
    fused_and_runs(AddRmsNorm(), code, _ARMS_RUN, "Stage.forward")


def test_n_arm_norm_arm_with_another_eps_keeps_a_reason() -> None:
    code = _ARMS.replace("self.gain, eps=self.eps)\n", "self.gain, eps=1e-5)\n")
    assert code != _ARMS
    findings, misses = detect_all(AddRmsNorm(), code)
    assert not findings
    assert any("not read as using the same weight and eps" in m.reason for m in misses), [m.reason for m in misses]


def test_n_arm_norm_arm_it_cannot_exclude_keeps_a_reason() -> None:
    # the keyword's value is a call (the guard would call it again); an arm under a test of the input's rank
    for change in [("self.post(h, external=ext)", "self.post(h, external=self.pick())"),
                   ("        if external:\n", "        if t.dim() == 2:\n")]:
        code = _ARMS.replace(*change)
        assert code != _ARMS
        findings, misses = detect_all(AddRmsNorm(), code)
        assert "Stage.forward" not in [f.qualname for f in findings], change
        assert any("an arm npufuse does not read as the same RMS norm" in m.reason for m in misses), (change, [m.reason for m in misses])


# -- 2. swiglu: a learned bias on the gate half -------------------------------------------------------------------------

_GATE_BIAS = '''\
import torch
from torch import nn
from torch.nn import functional as F


class RoundFFN(nn.Module):
    def __init__(self, dim, hidden, rounds):
        super().__init__()
        self.w_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.round_shift = nn.Embedding(rounds, hidden)
        self.w_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, r):
        a, b = self.w_in(x).chunk(2, dim=-1)
        shift = self.round_shift.weight[int(r)][None, None, :]
        y = F.silu(a + shift) * b
        return self.w_out(y)
'''

_GATE_BIAS_RUN = '''
torch.manual_seed(0)
m = RoundFFN(8, 12, 3)
x = torch.randn(2, 5, 8, requires_grad=True)
mb = RoundFFN(8, 12, 3).to(torch.bfloat16)
out = [m(x, 1), m(x, torch.tensor(2)), mb(x.detach().to(torch.bfloat16), 0).float()]
leaves = [x, m.w_in.weight, m.round_shift.weight]
'''


def test_gate_bias_before_activation_fuses_with_its_cat_cost_said() -> None:
    facts = fused_and_runs(Swiglu(), _GATE_BIAS, _GATE_BIAS_RUN, "RoundFFN.forward")
    assert facts["all_calls"].get("npu_swiglu", 0) >= 1, facts
    findings, _ = detect_all(Swiglu(), _GATE_BIAS)
    f = findings[0]
    # the halves' statement runs as written; the projection is not computed again inside the fused code
    assert "a, b = self.w_in(x).chunk(2, dim=-1)" not in f.fused.split("else")[0], f.fused
    assert f.fused.count("self.w_in(x)") == 0, f.fused
    assert "torch.cat([a + shift, b], dim=-1)" in f.fused, f.fused
    assert f.params.get("operands") == "transformed chunk parts", f.params
    rel, calls, dtypes = _max_rel(_GATE_BIAS, _GATE_BIAS_RUN, findings)
    assert rel[0] < 1e-6 and rel[1] < 1e-6 and rel[2] < 1e-2, rel


def test_gate_bias_value_says_the_cat_copy() -> None:
    findings, _ = detect_all(Swiglu(), _GATE_BIAS)
    value: dict[str, Any] = gated_value(findings[0], {"intermediate_size": 1024, "hidden_size": 256}, 1)
    assert "torch.cat of the transformed chunk parts" in value["estimate"], value
    assert value["speedup_bound"] < 1.0 and "slower as written" in value["verdict"], value


def test_gate_bias_read_from_the_gate_or_through_a_call_keeps_a_reason() -> None:
    for change in [("shift = self.round_shift.weight[int(r)][None, None, :]", "shift = a.mean(-1, keepdim=True)"),
                   ("shift = self.round_shift.weight[int(r)][None, None, :]", "shift = self.round_shift.weight[self.pick(r)][None, None, :]")]:
        code = _GATE_BIAS.replace(*change)
        assert code != _GATE_BIAS
        findings, misses = detect_all(Swiglu(), code)
        assert not findings, change
        assert any("transformed after its projection" in m.reason for m in misses), (change, [m.reason for m in misses])
