"""s43 (helper ho20fix43): classes of the s43 blind sets' real misses and false reasons (every spelling here is
invented; each class has a Fuse run under the emulator against the original and a Keep with a true reason).

1. rms_norm / add_rms_norm: a norm whose optional weight is returned under an exiting ``if`` and whose weightless
   value is returned after it (``if self.weight is not None: return y * self.weight`` / ``return y``); the residual
   add before such a norm class (``x = x + ffn(self.norm2(x))``).
"""

from __future__ import annotations

from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.rms_norm import RmsNorm


def _close(facts: dict, tol: float = 0.99999) -> None:
    assert facts["n_out"][0] == facts["n_out"][1]
    assert facts["dtypes"] and all(a == b for a, b in facts["dtypes"]), facts["dtypes"]
    assert all(c > tol for c in facts["cos_out"]), facts["cos_out"]
    assert all(c > tol for c in facts["cos_grad"]), facts["cos_grad"]


# -- 1. the optional weight returned under an exiting ``if`` --------------------------------------------------------

_OPTIONAL_WEIGHT = '''
import torch
import torch.nn as nn


class ScaleFreeRMSNorm(nn.Module):
    def __init__(self, shape, eps=1e-6, learnable=True):
        super().__init__()
        self.eps = eps
        if learnable:
            self.gain = nn.Parameter(torch.ones(shape))
        else:
            self.register_parameter("gain", None)

    def forward(self, h):
        denom = torch.sqrt(h.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        unit = h / denom
        if {test}:
            return {weighted}
        return unit


class EncoderLayer(nn.Module):
    def __init__(self, d, learnable=True):
        super().__init__()
        self.mix = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.pre_mix = ScaleFreeRMSNorm(d, learnable=learnable)
        self.pre_mlp = ScaleFreeRMSNorm(d, learnable=learnable)

    def forward(self, tokens):
        mixed = self.mix(self.pre_mix(tokens))
        tokens = tokens + mixed
        tokens = tokens + self.mlp(self.pre_mlp(tokens))
        return tokens
'''

_PLAIN = {"test": "self.gain is not None", "weighted": "unit * self.gain"}

_RUN_NORM = '''
a = ScaleFreeRMSNorm(16)
b = ScaleFreeRMSNorm(16, learnable=False)
with torch.no_grad():
    a.gain.normal_()
x = torch.randn(2, 3, 16, requires_grad=True)
out = (a(x), b(x), a(x.to(torch.bfloat16)))
leaves = [x, a.gain]
'''

_RUN_LAYER = '''
layers = [EncoderLayer(16), EncoderLayer(16, learnable=False)]
with torch.no_grad():
    for m in layers:
        for p in m.parameters():
            p.normal_()
    infer = [m(torch.randn(2, 5, 16)) for m in layers]
x = torch.randn(2, 5, 16, requires_grad=True)
out = (infer, [m(x) for m in layers])
leaves = [x]
'''


def test_weight_returned_under_an_exiting_if_is_fused_on_that_path() -> None:
    code = _OPTIONAL_WEIGHT.format(**_PLAIN)
    findings, misses = detect_all(RmsNorm(), code)
    norm = [f for f in findings if f.qualname == "ScaleFreeRMSNorm.forward"]
    assert [(f.line, f.end_line) for f in norm] == [(16, 20)], [m.reason for m in misses]
    assert "if (self.gain is not None):" in norm[0].fused and norm[0].params["weight"] == "self.gain"
    facts = check_rewrite_runs(RmsNorm(), code, _RUN_NORM, norm)
    assert facts["all_calls"].get("npu_rms_norm"), facts["all_calls"]
    _close(facts)


def test_exiting_if_whose_test_reads_the_normalised_value_is_a_near_miss() -> None:
    # the test needs the computation's own value: it cannot run before the fused region
    code = _OPTIONAL_WEIGHT.format(test="unit.dtype == torch.float32", weighted="unit * self.gain")
    findings, misses = detect_all(RmsNorm(), code)
    assert not [f for f in findings if f.qualname == "ScaleFreeRMSNorm.forward"]
    assert [m.reason for m in misses if m.qualname == "ScaleFreeRMSNorm.forward"] == [
        "part of the computation is in another block (control flow)"]


def test_residual_add_before_an_optional_weight_norm_class_is_fused() -> None:
    code = _OPTIONAL_WEIGHT.format(**_PLAIN)
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [(f.qualname, f.line) for f in findings] == [("EncoderLayer.forward", 33)], [m.reason for m in misses]
    assert findings[0].params["condition"] == "(self.pre_mlp.gain is not None)", findings[0].params
    facts = check_rewrite_runs(AddRmsNorm(), code, _RUN_LAYER, findings)
    assert facts["all_calls"].get("npu_add_rms_norm") and facts["all_calls"].get("npu_rms_norm"), facts["all_calls"]
    _close(facts)


def test_residual_add_before_a_norm_whose_arms_both_compute_is_fused_only_on_the_weighted_arm() -> None:
    # neither arm returns the bare normalised value, so this is not ho20fix43's optional-weight class; addnorm43's
    # if / else reading (s43, merged beside it) fuses the weighted arm under its own test, checked where the code runs:
    # the `unit * 2.0` arm always takes the original statements
    code = _OPTIONAL_WEIGHT.format(test="self.gain is not None", weighted="unit * self.gain").replace(
        "        return unit\n", "        return unit * 2.0\n")
    findings, _ = detect_all(AddRmsNorm(), code)
    assert findings and all(f.params.get("condition") == "(self.pre_mlp.gain is not None)" for f in findings)
    assert all(f.fused.startswith("if (self.pre_mlp.gain is not None):") for f in findings)


# -- 2. rope: an interleaved rotation helper nested in forward, its lanes named then filled into empty_like ----------

_NESTED_LANES = '''
import torch
import torch.nn as nn


class Attention(nn.Module):
    def __init__(self, heads=2, dim=8, seq=16):
        super().__init__()
        self.heads, self.dim = heads, dim
        theta = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        ang = torch.arange(seq).float()[:, None] * theta[None, :]
        self.register_buffer("cos_t", ang.cos())
        self.register_buffer("sin_t", ang.sin())

    def forward(self, q, k, offset: int = 0):
        n = q.shape[2]
        cos = self.cos_t[offset:offset + n].to(q.dtype)[None, None]
        sin = self.sin_t[offset:offset + n].to(q.dtype)[None, None]

        def spin(v, c, s):
            ev = v[..., 0::2]
            od = v[..., 1::2]
            new_ev = ev * c - od * s
            new_od = ev * s + od * c
            res = {alloc}
            res[..., 0::2] = new_ev
            res[..., 1::2] = new_od
            return res

        return spin(q, cos, sin), spin(k, cos, sin)
'''

_RUN_NESTED = '''
m = Attention()
q = torch.randn(2, 2, 5, 8, requires_grad=True)
k = torch.randn(2, 2, 5, 8, requires_grad=True)
out = (m(q, k), m(q, k, offset=3))
leaves = [q, k]
'''


def test_nested_lane_fill_helper_is_fused_with_its_named_lanes() -> None:
    from npufuse.patterns.rope import RopePattern

    code = _NESTED_LANES.format(alloc="torch.empty_like(v)")
    findings, misses = detect_all(RopePattern(), code)
    # the span starts at the named rotated lanes: the fused path no longer computes them
    assert [(f.qualname, f.line, f.end_line) for f in findings] == [("Attention.forward.spin", 23, 27)], [m.reason for m in misses]
    assert 'rotary_mode="interleave"' in findings[0].fused
    facts = check_rewrite_runs(RopePattern(), code, _RUN_NESTED, findings)
    assert facts["all_calls"].get("npu_rotary_mul"), facts["all_calls"]
    _close(facts)


def test_nested_lane_fill_into_a_buffer_shaped_like_the_table_is_a_near_miss() -> None:
    from npufuse.patterns.rope import RopePattern

    code = _NESTED_LANES.format(alloc="torch.empty_like(c)")
    findings, misses = detect_all(RopePattern(), code)
    assert not findings
    assert [m.reason for m in misses] == ["the rotated halves are written into `torch.empty_like(c)`, a new tensor shaped like "
                                          "another tensor than the rotated `v`: not verified"]


# -- 3. sdpa: the mask is an entry of a cache a builder method fills with a comparison of positions ------------------

_CACHED_MASK = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class CachedAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self._masks = {}

    def _mask_for(self, t, s, start, device):
        key = (t, s, start, str(device))
        if key not in self._masks:
            rows = torch.arange(t, device=device)[:, None]
            cols = torch.arange(s, device=device)[None, :]
            self._masks[key] = {entry}
        return self._masks[key]

    def forward(self, x, start=0):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if start:
            k = torch.cat([k[:, :, :1].expand(-1, -1, start, -1), k], dim=2)
            v = torch.cat([v[:, :, :1].expand(-1, -1, start, -1), v], dim=2)
        mask = self._mask_for(t, start + t, start, x.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, t, d)
'''

_RUN_CACHED = '''
m = CachedAttention()
x = torch.randn(2, 5, 16, requires_grad=True)
out = (m(x), m(x, start=3), m(x))
leaves = [x]
'''


def test_sdpa_mask_from_a_cache_of_position_comparisons_is_fused_as_a_bool_mask() -> None:
    from npufuse.patterns.sdpa import SdpaPattern

    code = _CACHED_MASK.replace("{entry}", "cols <= start + rows")
    findings, misses = detect_all(SdpaPattern(), code)
    assert [f.qualname for f in findings] == ["CachedAttention.forward"], [m.reason for m in misses]
    facts = check_rewrite_runs(SdpaPattern(), code, _RUN_CACHED, findings)
    assert facts["all_calls"].get("npu_fusion_attention"), facts["all_calls"]
    _close(facts, tol=0.9999)


def test_sdpa_mask_from_a_cache_of_distance_biases_is_a_true_float_bias_near_miss() -> None:
    from npufuse.patterns.sdpa import SdpaPattern

    # an ALiBi-like distance bias: graded float values, not a mask
    code = _CACHED_MASK.replace("{entry}", "(cols - rows - start).float() * 0.5")
    findings, misses = detect_all(SdpaPattern(), code)
    assert not findings
    assert any(m.reason.startswith("attn_mask: a float bias is added to the scores") for m in misses), [m.reason for m in misses]


def test_sdpa_mask_cache_another_method_also_fills_is_not_read_as_bool() -> None:
    from npufuse.patterns.sdpa import SdpaPattern

    code = _CACHED_MASK.replace("{entry}", "cols <= start + rows").replace(
        "    def forward(self, x, start=0):",
        "    def prime(self, t):\n        self._masks[(t, t, 0, 'cpu')] = torch.arange(t)[None, :] * 0.1\n\n    def forward(self, x, start=0):")
    findings, misses = detect_all(SdpaPattern(), code)
    assert not findings
    assert any("float bias" in m.reason for m in misses), [m.reason for m in misses]


# -- 4. swiglu: local projections built alike, a local activation object, the module's own statements ---------------

_SCRIPT_GLU = '''
import torch
import torch.nn as nn

torch.manual_seed(0)
width, hidden, act_name = 16, 32, "silu"
to_gate = nn.Linear(width, hidden, bias=False)
to_value = nn.Linear(width, hidden, bias=False)
{choice}
tokens = torch.randn(3, width)
g = to_gate(tokens)
u = to_value(tokens)
gated = nonlin(g)
mixed = gated * u
demo_out = mixed.sum(-1)
'''

_CHOSEN = '''if act_name == "silu":
    nonlin = nn.SiLU()
else:
    raise ValueError(act_name)'''


def _glu_in_function(script: str) -> str:
    head, body = script.split("torch.manual_seed(0)\n")
    return head + "\ndef run_glu():\n    torch.manual_seed(0)\n" + "".join(
        "    " + ln + "\n" if ln else "\n" for ln in body.splitlines()) + "    return demo_out\n"


def test_script_glu_with_alike_projections_and_a_chosen_activation_object_is_fused() -> None:
    from npufuse.patterns.swiglu import Swiglu

    code = _SCRIPT_GLU.format(choice=_CHOSEN)
    findings, misses = detect_all(Swiglu(), code)
    assert [(f.qualname, f.line, f.end_line) for f in findings] == [("<module>", 16, 17)], [m.reason for m in misses]
    facts = check_rewrite_runs(Swiglu(), code, "out = demo_out\n", findings)
    assert facts["all_calls"].get("npu_swiglu"), facts["all_calls"]
    _close(facts)
    in_function = _glu_in_function(code)
    findings, misses = detect_all(Swiglu(), in_function)
    assert [f.qualname for f in findings] == ["run_glu"], [m.reason for m in misses]
    facts = check_rewrite_runs(Swiglu(), in_function, "out = run_glu()\n", findings)
    assert facts["all_calls"].get("npu_swiglu"), facts["all_calls"]
    _close(facts)


def test_one_projection_object_applied_twice_is_still_one_value() -> None:
    from npufuse.patterns.swiglu import Swiglu

    code = _SCRIPT_GLU.format(choice="nonlin = nn.SiLU()").replace("u = to_value(tokens)", "u = to_gate(tokens)")
    findings, misses = detect_all(Swiglu(), code)
    assert not findings
    assert any(m.reason.startswith("gate and up are one value") for m in misses), [m.reason for m in misses]


def test_activation_object_rebound_on_a_fall_through_path_is_not_read() -> None:
    from npufuse.patterns.swiglu import Swiglu

    # GELU stays bound where the test fails: which activation runs is not known here
    code = _SCRIPT_GLU.format(choice='nonlin = nn.GELU()\nif act_name == "silu":\n    nonlin = nn.SiLU()')
    findings, _ = detect_all(Swiglu(), code)
    assert not findings


def test_script_intermediate_read_by_a_function_of_the_file_is_a_near_miss() -> None:
    from npufuse.patterns.swiglu import Swiglu

    code = _SCRIPT_GLU.format(choice="nonlin = nn.SiLU()").replace(
        "torch.manual_seed(0)\n", "\ndef gate_stats():\n    return gated.mean()\n\n\ntorch.manual_seed(0)\n")
    findings, misses = detect_all(Swiglu(), code)
    assert not findings
    assert [m.reason for m in misses] == ["module-level statements: `gated`, an intermediate the fused code no longer binds, is a "
                                          "global that a function or class of this file reads"]


def test_exiting_if_with_another_return_before_the_weighted_one_is_not_lifted() -> None:
    # the bias return would be skipped on the fused path: the syntactic lift refuses (the numeric probe, which runs
    # the forward, proves it with the bias test as a run-time guard)
    code = _OPTIONAL_WEIGHT.format(test="self.gain is not None", weighted="unit * self.gain").replace(
        "            return unit * self.gain\n",
        "            if getattr(self, 'shift', None) is not None:\n                return unit * self.gain + self.shift\n"
        "            return unit * self.gain\n")
    findings, _ = detect_all(RmsNorm(), code)
    norm = [f for f in findings if f.qualname == "ScaleFreeRMSNorm.forward"]
    assert all(f.params.get("found_by") == "numeric_probe" for f in norm), [f.fused for f in norm]
