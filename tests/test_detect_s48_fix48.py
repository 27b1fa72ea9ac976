"""s48 (fix48): classes behind the remaining HO24a / HO24b misses (development data since s47) and sweep47a, with
invented reproducers (a second spelling each, and near-miss twins).

1. moe_experts: a routing weight written slot by slot into a fresh buffer with the slots written out
   (``tw = zeros(n); pos0 = idx[sel, 0] == e; tw[pos0] = w[sel, 0][pos0]; ...``): fix47h's slot loop unrolled, read
   as the dense-gates weight ``(w * (idx == e)).sum(-1)[sel]`` under the guard ``K == idx.shape[-1]``.
"""

from __future__ import annotations

import pytest
import torch
from pattern_harness import check_rewrite_runs, detect_all
from pattern_harness import fused_and_runs as _fused_and_runs, near_miss_says as _near_miss

from npufuse.patterns.moe_experts import MoeExperts


# -- 1. moe_experts: the slot writes written out ---------------------------------------------------------------------

_UNROLLED = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.a = nn.Linear(d, h)
        self.b = nn.Linear(h, d)

    def forward(self, x):
        return self.b(F.silu(self.a(x)))


class TwoSlotMoE(nn.Module):
    def __init__(self, d, h, n):
        super().__init__()
        self.n = n
        self.gate = nn.Linear(d, n)
        self.experts = nn.ModuleList([Expert(d, h) for _ in range(n)])

    def forward(self, x):
        b, s, d = x.shape
        flat = x.view(-1, d)
        w, idx = self.gate(flat).topk(k=2, dim=-1)
        w = F.softmax(w, dim=-1)
        out = torch.zeros_like(flat)
        for e in range(self.n):
            sel = (idx == e).any(dim=-1)
            if sel.any():
                y = self.experts[e](flat[sel])
                tw = torch.zeros(sel.sum(), device=x.device)
                pos0 = idx[sel, 0] == e
                pos1 = idx[sel, 1] == e
                tw[pos0] = w[sel, 0][pos0]
                tw[pos1] = w[sel, 1][pos1]
                out[sel] += y * tw.unsqueeze(-1)
        return out.view(b, s, d)
'''

_UNROLLED_RUN = '''
torch.manual_seed(0)
m = TwoSlotMoE(16, 24, 5)
x = torch.randn(2, 7, 16, requires_grad=True)
out = [m(x)]
leaves = [x, m.gate.weight, m.experts[1].a.weight]
'''

# the second spelling: three slots, masks inline with the expert id on the left, `+=` writes in another order, a
# buffer in the weights' dtype, the weighted rows added back by index_add_ over token ids
_UNROLLED3 = '''\
import torch
from torch import nn


class Mlp(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class ThreeSlotMoE(nn.Module):
    def __init__(self, d, h, n_exp):
        super().__init__()
        self.n_exp = n_exp
        self.router = nn.Linear(d, n_exp, bias=False)
        self.experts = nn.ModuleList(Mlp(d, h) for _ in range(n_exp))

    def forward(self, tokens):
        probs = self.router(tokens).softmax(-1)
        top_p, top_i = torch.topk(probs, 3, dim=-1)
        result = torch.zeros_like(tokens)
        for ex in range(self.n_exp):
            rows = (top_i == ex).any(-1)
            if not rows.any():
                continue
            gate = torch.zeros(int(rows.sum()), dtype=top_p.dtype, device=tokens.device)
            gate[ex == top_i[rows, 2]] += top_p[rows, 2][ex == top_i[rows, 2]]
            gate[ex == top_i[rows, 0]] += top_p[rows, 0][ex == top_i[rows, 0]]
            gate[ex == top_i[rows, 1]] += top_p[rows, 1][ex == top_i[rows, 1]]
            result[rows] += gate[:, None] * self.experts[ex](tokens[rows])
        return result
'''

_UNROLLED3_RUN = '''
torch.manual_seed(1)
m = ThreeSlotMoE(12, 20, 6)
x = torch.randn(15, 12, requires_grad=True)
mb = ThreeSlotMoE(12, 20, 6).to(torch.bfloat16)
xb = torch.randn(15, 12, requires_grad=True)
out = [m(x), mb(xb.to(torch.bfloat16)).float()]
leaves = [x, xb, m.router.weight, m.experts[3].up.weight]
'''


def test_slot_writes_written_out_fuse() -> None:
    facts = _fused_and_runs(MoeExperts(), _UNROLLED, _UNROLLED_RUN, "TwoSlotMoE.forward")
    assert "2 == idx.shape[-1]" in facts["rewritten"]  # the slots written are all of them


def test_slot_writes_written_out_second_spelling_fuses() -> None:
    facts = _fused_and_runs(MoeExperts(), _UNROLLED3, _UNROLLED3_RUN, "ThreeSlotMoE.forward", tol=0.999)
    assert "3 == top_i.shape[-1]" in facts["rewritten"]


def test_slot_writes_guard_falls_back_for_more_slots() -> None:
    """Two slots written of a top-3 routing: the guard keeps the original (the third slot's weight would be lost)."""
    code = _UNROLLED.replace("topk(k=2, dim=-1)", "topk(k=3, dim=-1)")
    findings, _ = detect_all(MoeExperts(), code)
    facts = check_rewrite_runs(MoeExperts(), code, _UNROLLED_RUN, findings)
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.999999


@pytest.mark.parametrize("change", [
    # a slot's weight taken from the other slot
    ("tw[pos1] = w[sel, 1][pos1]", "tw[pos1] = w[sel, 0][pos1]"),
    # the same slot twice (slot 1 never written)
    ("pos1 = idx[sel, 1] == e", "pos1 = idx[sel, 0] == e"),
    # another expert's slot
    ("pos1 = idx[sel, 1] == e", "pos1 = idx[sel, 1] == 0"),
    # a scaled weight
    ("tw[pos0] = w[sel, 0][pos0]", "tw[pos0] = 0.5 * w[sel, 0][pos0]"),
    # a bf16 buffer rounds fp32 weights
    ("tw = torch.zeros(sel.sum(), device=x.device)", "tw = torch.zeros(sel.sum(), device=x.device, dtype=torch.bfloat16)"),
    # a slot mask read again after the writes
    ("out[sel] += y * tw.unsqueeze(-1)", "out[sel] += y * tw.unsqueeze(-1) * pos0.unsqueeze(-1)"),
])
def test_slot_writes_written_out_other_forms_are_near_misses(change: tuple[str, str]) -> None:
    code = _UNROLLED.replace(*change)
    assert code != _UNROLLED
    _near_miss(MoeExperts(), code, "written slot by slot into the fresh buffer `tw`")


# -- 2. rms_norm / add_rms_norm: a factor proven one number folded into gamma ------------------------------------------

from npufuse.patterns.add_rms_norm import AddRmsNorm  # noqa: E402
from npufuse.patterns.rms_norm import RmsNorm  # noqa: E402

_SCALED = '''\
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, d_model, eps=1e-5, position=None, dtype=None):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d_model, dtype=dtype))
        self.eps = eps
        if position is None:
            scale = torch.tensor(1.0, dtype=torch.float32)
        else:
            scale = torch.rsqrt(torch.tensor(float(position), dtype=torch.float32))
        self.register_buffer("position_scale", scale, persistent=False)

    def forward(self, x):
        in_dtype = x.dtype
        x = x.to(torch.float32)
        with torch.autocast("cuda", enabled=False):
            reverse_rms = torch.rsqrt((x * x).mean(-1) + self.eps).unsqueeze(-1)
            out = x * reverse_rms * self.gain
        out.mul_(self.position_scale)
        return out.to(in_dtype)


class Block(nn.Module):
    def __init__(self, d_model, position=None):
        super().__init__()
        self.ln1 = RMSNorm(d_model, position=position)
        self.attn = nn.Linear(d_model, d_model)
        self.ln2 = RMSNorm(d_model, position=position)
        self.ffn = nn.Linear(d_model, d_model)

    def forward(self, x):
        attn_out = self.attn(self.ln1(x))
        y = x + attn_out
        return y + self.ffn(self.ln2(y))
'''

_SCALED_RUN = '''
torch.manual_seed(0)
m = RMSNorm(16, position=3)
with torch.no_grad():
    m.gain.mul_(torch.linspace(0.5, 1.5, 16))
x = torch.randn(2, 5, 16, requires_grad=True)
xb = torch.randn(2, 5, 16, requires_grad=True)
out = [m(x), m(xb.to(torch.bfloat16)).float()]
leaves = [x, xb, m.gain]
'''

_BLOCK_RUN = '''
torch.manual_seed(0)
m = Block(16, position=4)
x = torch.randn(2, 5, 16, requires_grad=True)
out = [m(x)]
mb = Block(16, position=4).to(torch.bfloat16)
with torch.no_grad():
    out.append(m(x))
    out.append(mb(x.to(torch.bfloat16).detach()).float())
leaves = [x, m.ln2.gain, m.attn.weight]
'''

# the second spelling: a learnable 0-dim scale (nn.Parameter of torch.tensor), a Python-number constant, the norm
# upcast with .float() and cast back with type_as, the factors written inline in one product
_SCALED2 = '''\
import math
import torch
from torch import nn


class ScaledRMSNorm(nn.Module):
    def __init__(self, dim, n_layers, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.residual_scale = nn.Parameter(torch.tensor(0.5))
        self.depth_scale = 1.0 / math.sqrt(2 * n_layers)

    def forward(self, hidden):
        h = hidden.float()
        normed = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        normed = normed * self.weight.float() * self.residual_scale
        normed *= self.depth_scale
        return normed.type_as(hidden)
'''

_SCALED2_RUN = '''
torch.manual_seed(0)
m = ScaledRMSNorm(12, 6)
x = torch.randn(3, 4, 12, requires_grad=True)
xb = torch.randn(3, 4, 12, requires_grad=True)
out = [m(x), m(xb.to(torch.bfloat16)).float()]
leaves = [x, xb, m.weight, m.residual_scale]
'''


@pytest.mark.parametrize("scale", ["out.mul_(self.position_scale)", "out = out * self.position_scale",
                                   "out *= self.position_scale"])
def test_scaled_norm_folds_the_number_into_gamma(scale: str) -> None:
    code = _SCALED.replace("out.mul_(self.position_scale)", scale)
    facts = _fused_and_runs(RmsNorm(), code, _SCALED_RUN, "RMSNorm.forward", tol=0.999)
    assert "self.gain.float() * self.position_scale" in facts["rewritten"]


def test_scaled_norm_second_spelling_folds() -> None:
    facts = _fused_and_runs(RmsNorm(), _SCALED2, _SCALED2_RUN, "ScaledRMSNorm.forward", tol=0.999)
    assert "(self.weight.float() * self.depth_scale * self.residual_scale)" in facts["rewritten"]


@pytest.mark.parametrize("scale", ["out.mul_(self.position_scale)", "out = out * self.position_scale"])
def test_add_then_scaled_norm_fuses(scale: str) -> None:
    code = _SCALED.replace("out.mul_(self.position_scale)", scale)
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [f.qualname for f in findings] == ["Block.forward"], [m.reason for m in misses]
    facts = check_rewrite_runs(AddRmsNorm(), code, _BLOCK_RUN, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.999 and min(facts["cos_grad"]) > 0.999, facts
    assert all(a == b for a, b in facts["dtypes"]), facts
    # the float32 product is handed to npu_add_rms_norm only for a float32 x1
    assert "x.dtype != torch.float32" in facts["rewritten"]
    assert "self.ln2.gain.float() * self.ln2.position_scale" in facts["rewritten"]


@pytest.mark.parametrize("change,phrase", [
    # a per-channel second factor: not one number
    (("self.register_buffer(\"position_scale\", scale, persistent=False)",
      "self.register_buffer(\"position_scale\", torch.ones(d_model) * scale, persistent=False)"),
     "multiplied in place by `self.position_scale`"),
    # changed after construction
    (("    def forward(self, x):", "    def set_position(self, p):\n        self.position_scale = torch.full((4,), p)\n\n"
      "    def forward(self, x):"), "multiplied in place by `self.position_scale`"),
    # the weight itself multiplied in place
    (("out = x * reverse_rms * self.gain", "out = x * reverse_rms"), "multiplied in place by `self.position_scale`"),
])
def test_scaled_norm_near_misses(change: tuple[str, str], phrase: str) -> None:
    code = _SCALED.replace(*change)
    assert code != _SCALED
    _near_miss(RmsNorm(), code, phrase)


def test_scale_on_a_half_value_is_a_near_miss() -> None:
    """No upcast: the original multiplies by the number in the input's dtype (rounded there)."""
    code = _SCALED2.replace("h = hidden.float()", "h = hidden").replace("self.weight.float()", "self.weight")
    _near_miss(RmsNorm(), code, "not proven float32")


def test_per_channel_factor_keeps_the_old_reason() -> None:
    code = _SCALED2.replace("nn.Parameter(torch.tensor(0.5))", "nn.Parameter(torch.ones(dim))")
    _near_miss(RmsNorm(), code, "more than one factor besides the rms")
