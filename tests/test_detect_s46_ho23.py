"""s46 (ho23fix46): classes behind the real misses and untrue near-miss reasons of the blind sets HO23a / HO23b,
with invented reproducers (several spellings each, and near misses).

1. moe_experts: a top-k slot loop around the expert loop whose rows are listed with ``torch.nonzero(mask)`` /
   ``mask.nonzero()`` then squeezed (``[n, 1]`` -> ``[n]``): those rows are the slot mask's rows, so the slot's
   weight column read by them (``w[:, k][rows]``) is the routing weight of the (token, slot) pairs.
2. swiglu: an operand bound in both arms of one ``if`` / ``else`` to projections of one input (a functional expert
   kernel serving stacked and single weights) is a projection of that input.
3. rope: a complex rope whose pair view takes its shape as one value built apart (``shape = x.shape[:-1] + (-1, 2)``;
   ``x.reshape(shape)``): the shape is read as its listed sizes.
4. moe_experts: expert modules called with keywords the loop passes unchanged to every expert (the forward's
   ``**kwargs``, an unrebound parameter, a constant): the fused layer calls each expert as it is on the same rows with
   the same keywords.
5. add_rms_norm: the add and the norm separated by an ``if`` testing only the sum's dtype (a half-precision clamp):
   the test is read on ``torch.result_type`` of the operands, the original statements run where it holds.
6. fused_optimizer: a construction whose name is rebound before anything reads it is never used: a near miss saying
   so (the later construction is the site).
7. attention: the scores' shape bound to names (``i, j = att.shape[-2], att.shape[-1]``) that an ``if`` run as written
   reads (a cached causal mask rebuilt when the sequence grows): the names are bound on the fused branch from q / k.
8. add_rms_norm: a residual add ending one ``with`` block (a profiler range) and the norm of the sum starting the next:
   not rewritten (one span of one block), now a near miss saying so instead of nothing.
"""

from __future__ import annotations

import pytest
from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.fused_optimizer import FusedOptimizer
from npufuse.patterns.moe_experts import MoeExperts
from npufuse.patterns.rope import RopePattern as Rope
from npufuse.patterns.swiglu import Swiglu

def _near_miss(pattern: object, code: str, *phrases: str) -> None:
    """No candidate, and a near miss whose reason holds one of ``phrases``."""
    findings, misses = detect_all(pattern, code)  # type: ignore[arg-type]
    assert not findings
    assert any(any(p in m.reason for p in phrases) for m in misses), [m.reason for m in misses]


def _fused_and_runs(pattern: object, code: str, run: str, qualname: str) -> list:
    """One candidate in ``qualname``, whose rewrite runs under the emulator with the original's values."""
    findings, misses = detect_all(pattern, code)  # type: ignore[arg-type]
    assert [f.qualname for f in findings] == [qualname], [m.reason for m in misses]
    facts = check_rewrite_runs(pattern, code, run, findings)  # type: ignore[arg-type]
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999, facts
    return findings


# -- 1. slot loop around the expert loop, rows from a squeezed nonzero ------------------------------------------------

_SLOT_NONZERO = '''\
import torch
from torch import nn
import torch.nn.functional as F


class SlotMoE(nn.Module):
    def __init__(self, d, n, k):
        super().__init__()
        self.gate = nn.Linear(d, n)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(n)])
        self.n = n
        self.k = k

    def forward(self, x):
        B, T, D = x.shape
        top = self.gate(x).topk(self.k, dim=-1)
        ids = top.indices
        w = F.softmax(top.values, dim=-1)
        flat_x = x.view(B * T, D)
        flat_ids = ids.view(B * T, self.k)
        flat_w = w.view(B * T, self.k)
        out = torch.zeros_like(flat_x)
        for slot in range(self.k):
            col = flat_ids[:, slot]
            gv = flat_w[:, slot]
            for e in range(self.n):
                hit = (col == e)
                if not hit.any():
                    continue
                rows = torch.nonzero(hit, as_tuple=False).squeeze(-1)
                y = self.experts[e](flat_x[rows])
                out[rows] += y * gv[rows].unsqueeze(-1)
        return out.view(B, T, D)
'''

_SLOT_NONZERO_RUN = '''\
m = SlotMoE(16, 4, 2)
x = torch.randn(2, 7, 16, requires_grad=True)
out = m(x)
leaves = [x, m.gate.weight, m.experts[1][0].weight]
'''


@pytest.mark.parametrize("spelling", [
    "rows = torch.nonzero(hit, as_tuple=False).squeeze(-1)",
    "rows = torch.nonzero(hit).squeeze(1)",
    "rows = hit.nonzero().squeeze(-1)",
    "rows = hit.nonzero().view(-1)",
])
def test_slot_loop_rows_from_squeezed_nonzero_fuse(spelling: str) -> None:
    code = _SLOT_NONZERO.replace("rows = torch.nonzero(hit, as_tuple=False).squeeze(-1)", spelling)
    findings = _fused_and_runs(MoeExperts(), code, _SLOT_NONZERO_RUN, "SlotMoE.forward")
    assert findings[0].params["probs"] == "flat_w" and findings[0].params["indices"] == "flat_ids"


@pytest.mark.parametrize("change", [
    # every slot weighted by slot 0's weight: not each pair's own routing weight
    ("gv = flat_w[:, slot]", "gv = flat_w[:, 0]"),
    # the rows of the whole column mask of another slot
    ("hit = (col == e)", "hit = (flat_ids[:, 0] == e)"),
])
def test_slot_loop_rows_from_squeezed_nonzero_near_misses(change: tuple[str, str]) -> None:
    findings, misses = detect_all(MoeExperts(), _SLOT_NONZERO.replace(*change))
    assert not findings and misses


# -- 2. swiglu: operands bound in both arms of an if / else to projections of one input -------------------------------

_ARMED_KERNEL = '''\
import torch
import torch.nn.functional as F
from torch import nn


def _stacked_linear(x, weight, bias):
    out = torch.matmul(x, weight.transpose(-1, -2))
    if bias is not None:
        out = out + bias.unsqueeze(1)
    return out


def expert_kernel(x, w_up, b_up, w_gate, b_gate, w_down):
    stacked = w_up.dim() == 3
    if stacked:
        up = _stacked_linear(x, w_up, b_up)
    else:
        up = F.linear(x, w_up, b_up)
    if stacked:
        gate = _stacked_linear(x, w_gate, b_gate)
    else:
        gate = F.linear(x, w_gate, b_gate)
    up = F.silu(gate) * up
    if stacked:
        return torch.matmul(up, w_down.transpose(-1, -2))
    return F.linear(up, w_down)
'''

_ARMED_KERNEL_RUN = '''\
x = torch.randn(3, 5, 8, requires_grad=True)
w_up = torch.randn(3, 12, 8, requires_grad=True)
w_gate = torch.randn(3, 12, 8, requires_grad=True)
w_down = torch.randn(3, 8, 12)
b = torch.randn(3, 12)
out = [expert_kernel(x, w_up, b, w_gate, b, w_down), expert_kernel(x[0], w_up[0], b[0], w_gate[0], None, w_down[0])]
leaves = [x, w_up, w_gate]
'''


@pytest.mark.parametrize("change", [
    ("", ""),
    # one if / else holding both projections, the product in a method of a module
    ("    if stacked:\n        gate = _stacked_linear(x, w_gate, b_gate)\n    else:\n        gate = F.linear(x, w_gate, b_gate)\n",
     ""),
    # the arms' first statements compute something else before the projection
    ("        up = F.linear(x, w_up, b_up)\n", "        tmp = w_up.shape\n        up = F.linear(x, w_up, b_up)\n"),
])
def test_glu_operands_projected_in_both_arms_fuse(change: tuple[str, str]) -> None:
    code = _ARMED_KERNEL
    if change[0]:
        code = code.replace(*change)
    if "gate = _stacked" not in code:
        code = code.replace("        up = _stacked_linear(x, w_up, b_up)\n",
                            "        up = _stacked_linear(x, w_up, b_up)\n        gate = _stacked_linear(x, w_gate, b_gate)\n") \
            .replace("        up = F.linear(x, w_up, b_up)\n", "        up = F.linear(x, w_up, b_up)\n        gate = F.linear(x, w_gate, b_gate)\n")
    _fused_and_runs(Swiglu(), code, _ARMED_KERNEL_RUN, "expert_kernel")


@pytest.mark.parametrize("change", [
    # one arm projects another input: not a GLU of one input in that arm
    ("        gate = F.linear(x, w_gate, b_gate)\n", "        gate = F.linear(x * 2, w_gate, b_gate)\n"),
    # no else: where the test is false the name holds whatever it held before (here a parameter)
    ("    if stacked:\n        gate = _stacked_linear(x, w_gate, b_gate)\n    else:\n        gate = F.linear(x, w_gate, b_gate)\n",
     "    if stacked:\n        w_gate = _stacked_linear(x, w_gate, b_gate)\n"),
])
def test_glu_operands_projected_in_arms_near_misses(change: tuple[str, str]) -> None:
    code = _ARMED_KERNEL.replace(*change).replace("F.silu(gate)", "F.silu(w_gate)" if "w_gate = _stacked" in change[1] else "F.silu(gate)")
    findings, misses = detect_all(Swiglu(), code)
    assert not findings
    assert any("not projections of one input" in m.reason or "assigned under control flow" in m.reason for m in misses), \
        [m.reason for m in misses]


# -- 3. rope: the complex pair view's shape built in a separate value -------------------------------------------------

_COMPLEX_SHAPE = '''\
import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x):
        t = torch.arange(x.size(2), device=x.device).float()
        freqs = torch.outer(t, self.inv_freq)
        cis = torch.polar(torch.ones_like(freqs), freqs)
        pair_shape = x.shape[:-1] + (-1, 2)
        pairs = x.float().reshape(pair_shape)
        z = torch.view_as_complex(pairs)
        cis = cis.view(1, 1, -1, cis.shape[-1])
        out = torch.view_as_real(z * cis)
        return out.flatten(-2).to(dtype=x.dtype)
'''

_COMPLEX_SHAPE_RUN = '''\
m = Rotary(8)
x = torch.randn(2, 3, 5, 8, requires_grad=True)
out = m(x)
leaves = [x]
'''


@pytest.mark.parametrize("change", [
    ("", ""),
    ("        pair_shape = x.shape[:-1] + (-1, 2)\n        pairs = x.float().reshape(pair_shape)\n",
     "        pairs = x.float().reshape(x.shape[:-1] + (-1, 2))\n"),
    ("pair_shape = x.shape[:-1] + (-1, 2)", "pair_shape = (*x.shape[:-1], -1, 2)"),
    ("pair_shape = x.shape[:-1] + (-1, 2)", "pair_shape = list(x.shape[:-1]) + [x.shape[-1] // 2, 2]"),
    ("x.float().reshape(pair_shape)", "x.float().view(pair_shape)"),
])
def test_complex_pairs_with_shape_built_apart_fuse(change: tuple[str, str]) -> None:
    code = _COMPLEX_SHAPE.replace(*change) if change[0] else _COMPLEX_SHAPE
    findings = _fused_and_runs(Rope(), code, _COMPLEX_SHAPE_RUN, "Rotary.forward")
    assert findings[0].params["mode"] == "complex"


@pytest.mark.parametrize("change", [
    # (2, -1): element i pairs with element i + D / 2 (two halves), not consecutive lanes
    ("pair_shape = x.shape[:-1] + (-1, 2)", "pair_shape = x.shape[:-1] + (2, -1)"),
    # the shape is bound on two paths: which one reaches the view is not known
    ("        pair_shape = x.shape[:-1] + (-1, 2)\n",
     "        pair_shape = x.shape[:-1] + (-1, 2)\n        if x.size(0) > 4:\n            pair_shape = x.shape[:-1] + (2, -1)\n"),
])
def test_complex_pairs_with_shape_built_apart_near_misses(change: tuple[str, str]) -> None:
    _near_miss(Rope(), _COMPLEX_SHAPE.replace(*change), "pairs are not formed by reshape(..., -1, 2)")


# -- 4. moe_experts: experts given the forward's keywords unchanged ----------------------------------------------------

_KW_EXPERTS = '''\
import torch
from torch import nn
import torch.nn.functional as F


class Scaled(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, h, scale=1.0, shift=None, **unused):
        y = torch.tanh(self.fc(h)) * scale
        return y if shift is None else y + shift


class Top1(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.n = n
        self.experts = nn.ModuleList([Scaled(d) for _ in range(n)])
        self.router = nn.Linear(d, n, bias=False)

    def forward(self, hidden, **kwargs):
        b, t, d = hidden.shape
        flat = hidden.view(-1, d)
        probs = F.softmax(self.router(flat), dim=-1)
        choice = torch.argmax(probs, dim=-1)
        weight = probs.gather(1, choice.unsqueeze(1)).squeeze(1)
        out = torch.zeros_like(flat)
        for i in range(self.n):
            sel = choice == i
            if sel.any():
                y = self.experts[i](flat[sel], **kwargs)
                out[sel] = y * weight[sel].unsqueeze(1)
        return out.view(b, t, d)
'''

_KW_EXPERTS_RUN = '''\
m = Top1(16, 4)
x = torch.randn(2, 9, 16, requires_grad=True)
out = [m(x, scale=0.5), m(x)]
leaves = [x, m.router.weight, m.experts[2].fc.weight]
'''


@pytest.mark.parametrize("change", [
    ("", ""),
    ("self.experts[i](flat[sel], **kwargs)", "self.experts[i](flat[sel], shift=None, **kwargs)"),
    ("def forward(self, hidden, **kwargs):", "def forward(self, hidden, scale=0.5, **kwargs):"),
])
def test_experts_given_unchanged_keywords_fuse(change: tuple[str, str]) -> None:
    code = _KW_EXPERTS.replace(*change) if change[0] else _KW_EXPERTS
    if "scale=0.5, **kwargs):" in code:
        code = code.replace("self.experts[i](flat[sel], **kwargs)", "self.experts[i](flat[sel], scale=scale)")
    run = _KW_EXPERTS_RUN if "scale=scale" not in code else _KW_EXPERTS_RUN.replace("m(x, scale=0.5)", "m(x, scale=0.25)")
    findings = _fused_and_runs(MoeExperts(), code, run, "Top1.forward")
    assert findings[0].params["activation"] == "as the expert modules compute it"


@pytest.mark.parametrize("change", [
    # a keyword that changes per expert: the fused layer would not pass it
    ("self.experts[i](flat[sel], **kwargs)", "self.experts[i](flat[sel], scale=i + 1.0)"),
    # the keywords are changed in place before the loop: kept as written only if rebuilt at the fused call
    ("        out = torch.zeros_like(flat)\n", "        out = torch.zeros_like(flat)\n        kwargs.pop('shift', None)\n"),
    # a keyword computed inside the function (per token rows of another tensor)
    ("self.experts[i](flat[sel], **kwargs)", "self.experts[i](flat[sel], shift=flat[sel])"),
])
def test_experts_given_keywords_near_misses(change: tuple[str, str]) -> None:
    _near_miss(MoeExperts(), _KW_EXPERTS.replace(*change), "takes arguments besides its rows")


# -- 5. add_rms_norm: an if between the add and the norm that tests the sum's dtype only -------------------------------

_DTYPE_CLAMP = '''\
import torch
import torch.nn as nn


class T5Norm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, h):
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1 = T5Norm(d)
        self.norm2 = T5Norm(d)
        self.attn = nn.Linear(d, d)
        self.ffn = nn.Linear(d, d)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        a = self.attn(self.norm1(x))
        x = x + self.drop(a)
        if x.dtype == torch.float16 or x.dtype == torch.bfloat16:
            limit = torch.finfo(x.dtype).max - 1000
            x = torch.clamp(x, min=-limit, max=limit)
        h = self.norm2(x)
        return x + self.ffn(h)
'''

_DTYPE_CLAMP_RUN = '''\
m = Layer(16)
x = torch.randn(2, 5, 16, requires_grad=True)
with torch.no_grad():
    inferred = m(x)
out = [m(x), inferred, m.to(torch.bfloat16)(x.detach().to(torch.bfloat16)).float()]
leaves = [x]
'''


@pytest.mark.parametrize("change", [
    ("", ""),
    ("if x.dtype == torch.float16 or x.dtype == torch.bfloat16:", "if x.dtype in (torch.float16, torch.bfloat16):"),
    ("if x.dtype == torch.float16 or x.dtype == torch.bfloat16:", "if x.dtype != torch.float32:"),
    # the sum is also aliased before the branch
    ("        x = x + self.drop(a)\n", "        x = x + self.drop(a)\n        res = x\n"),
])
def test_add_norm_across_a_dtype_only_branch_fuse(change: tuple[str, str]) -> None:
    code = _DTYPE_CLAMP.replace(*change) if change[0] else _DTYPE_CLAMP
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [f.qualname for f in findings] == ["Layer.forward"], [m.reason for m in misses]
    assert "torch.result_type(" in findings[0].fused, findings[0].fused
    facts = check_rewrite_runs(AddRmsNorm(), code, _DTYPE_CLAMP_RUN, findings)
    # fp32 (autograd on and off) runs fused; the bf16 call runs the original statements
    assert facts["all_calls"].get("npu_add_rms_norm") and facts["all_calls"].get("npu_rms_norm"), facts["all_calls"]
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999, facts


def test_add_norm_across_a_dtype_only_branch_takes_the_original_for_half() -> None:
    findings, _ = detect_all(AddRmsNorm(), _DTYPE_CLAMP)
    run = "m = Layer(16).to(torch.bfloat16)\nwith torch.no_grad():\n    out = m(torch.randn(2, 5, 16).to(torch.bfloat16) * 1e4)\n"
    facts = check_rewrite_runs(AddRmsNorm(), _DTYPE_CLAMP, run, findings)
    assert not facts["all_calls"].get("npu_add_rms_norm") and not facts["all_calls"].get("npu_rms_norm"), facts["all_calls"]
    assert min(facts["cos_out"]) > 0.9999, facts


@pytest.mark.parametrize("change", [
    # the test reads the sum's values: not known before the add
    ("if x.dtype == torch.float16 or x.dtype == torch.bfloat16:", "if x.dtype == torch.float16 or x.shape[-1] > 8:"),
    # the test reads a name the branch itself assigns (limit): its value before the branch is another one
    ("if x.dtype == torch.float16 or x.dtype == torch.bfloat16:", "if x.dtype == torch.float16 and limit > 0:"),
])
def test_add_norm_across_a_branch_reading_more_than_the_dtype_is_not_fused(change: tuple[str, str]) -> None:
    code = _DTYPE_CLAMP.replace(*change).replace("    def forward(self, x):\n", "    def forward(self, x, limit=1.0):\n")
    findings, _ = detect_all(AddRmsNorm(), code)
    assert not findings


# -- 6. fused_optimizer: a construction overwritten before use ----------------------------------------------------------

_OVERWRITTEN = '''\
import torch
import torch.nn as nn

model = nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
criterion = nn.MSELoss()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.05)

for step in range(3):
    loss = criterion(model(torch.randn(2, 4)), torch.zeros(2, 4))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''


@pytest.mark.parametrize("code", [
    _OVERWRITTEN,
    # in a function, the first one built from another class
    "def train(model, data):\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n    n = len(data)\n"
    "    opt = torch.optim.Adam(model.parameters(), lr=1e-3)\n    for x in data:\n        opt.zero_grad()\n"
    "        model(x).sum().backward()\n        opt.step()\n",
])
def test_optimizer_overwritten_before_use_is_a_near_miss(code: str) -> None:
    if not code.startswith("import"):
        code = "import torch\n\n\n" + code
    findings, misses = detect_all(FusedOptimizer(), code)
    assert len(findings) == 1, [m.reason for m in misses]
    dead = [m for m in misses if "the optimizer is never used" in m.reason]
    assert len(dead) == 1 and dead[0].line < findings[0].line, [m.reason for m in misses]


@pytest.mark.parametrize("between", [
    "sched = torch.optim.lr_scheduler.StepLR(optimizer, 1)",  # read: the first optimizer is used
    "configure()",  # a function of this module may read the global
    "if criterion is None:\n    pass",  # control flow between: not followed
])
def test_optimizer_read_before_rebinding_stays_a_candidate(between: str) -> None:
    code = _OVERWRITTEN.replace("criterion = nn.MSELoss()\n", f"criterion = nn.MSELoss()\n{between}\n") \
        + "\n\ndef configure():\n    print(optimizer)\n"
    findings, misses = detect_all(FusedOptimizer(), code)
    assert not any("the optimizer is never used" in m.reason for m in misses)
    assert len(findings) == 2, [m.reason for m in misses]


# -- 7. attention: the scores' shape read by a cache update run as written -----------------------------------------------

_CACHED_MASK = '''\
import torch
from torch import nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.register_buffer("mask", None, persistent=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        att = torch.einsum("bhid,bhjd->bhij", q, k) / (self.head_dim ** 0.5)
        i, j = att.shape[-2], att.shape[-1]
        if self.mask is None or self.mask.size(0) < i:
            mask = torch.tril(torch.ones((i, j), device=x.device)).unsqueeze(0).unsqueeze(0)
            self.mask = mask
        att = att.masked_fill(self.mask[:, :, :i, :j] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", att, v)
        return self.out(out.transpose(1, 2).reshape(B, T, D))
'''

_CACHED_MASK_RUN = '''\
m = CausalSelfAttention(32, 4)
x = torch.randn(2, 7, 32, requires_grad=True)
out = [m(x), m(x[:, :3])]
leaves = [x, m.qkv.weight]
'''


@pytest.mark.parametrize("change", [
    ("", ""),
    ("i, j = att.shape[-2], att.shape[-1]", "i, j = att.shape[-2:]"),
    ("i, j = att.shape[-2], att.shape[-1]", "i, j = att.size(-2), att.size(-1)"),
    ("att = torch.einsum(\"bhid,bhjd->bhij\", q, k) / (self.head_dim ** 0.5)",
     "att = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5"),
])
def test_scores_shape_read_by_a_cache_update_fuses(change: tuple[str, str]) -> None:
    code = _CACHED_MASK.replace(*change) if change[0] else _CACHED_MASK
    _fused_and_runs(AttentionPattern(), code, _CACHED_MASK_RUN, "CausalSelfAttention.forward")


@pytest.mark.parametrize("change", [
    # the if reads the scores' values, not only their shape
    ("if self.mask is None or self.mask.size(0) < i:", "if self.mask is None or bool(att.isnan().any()):"),
    # the name read is bound from the scores' values
    ("i, j = att.shape[-2], att.shape[-1]", "i, j = att.shape[-2], int(att.argmax()) + 1"),
])
def test_scores_values_read_by_a_cache_update_stay_a_near_miss(change: tuple[str, str]) -> None:
    _near_miss(AttentionPattern(), _CACHED_MASK.replace(*change), "between the attention steps uses intermediate",
               "computed from the attention scores themselves")


# -- 8. add_rms_norm: the add and the norm in two consecutive with blocks ------------------------------------------------

_WITH_SPLIT = _DTYPE_CLAMP.split("    def forward(self, x):\n")[0].replace(
    "import torch.nn as nn\n", "import torch.nn as nn\nfrom torch.profiler import record_function\n") + '''\
    def forward(self, x):
        with record_function("attn"):
            a = self.attn(self.norm1(x))
            x = x + self.drop(a)
            res = x
        with record_function("mlp"):
            h = self.norm2(x)
            x = res + self.ffn(h)
        return x
'''


def test_add_and_norm_in_two_with_blocks_is_a_near_miss() -> None:
    findings, misses = detect_all(AddRmsNorm(), _WITH_SPLIT)
    assert not findings
    assert [m.line for m in misses if "ends one `with` block" in m.reason] == [33], [(m.line, m.reason) for m in misses]


@pytest.mark.parametrize("change", [
    # the next block starts with something else: no add + norm pair
    ("            h = self.norm2(x)\n", "            h = self.ffn(x)\n"),
    # the norm of another tensor
    ("            h = self.norm2(x)\n", "            h = self.norm2(a)\n"),
])
def test_with_blocks_without_the_pair_give_no_such_near_miss(change: tuple[str, str]) -> None:
    _, misses = detect_all(AddRmsNorm(), _WITH_SPLIT.replace(*change))
    assert not any("ends one `with` block" in m.reason for m in misses)


def test_add_and_norm_in_one_with_block_still_fuse() -> None:
    code = _WITH_SPLIT.replace('''            res = x
        with record_function("mlp"):
''', "            res = x\n")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [f.qualname for f in findings] == ["Layer.forward"], [m.reason for m in misses]
