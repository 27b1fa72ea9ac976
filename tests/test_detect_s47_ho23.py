"""s47 (fix47h): classes behind the remaining HO23a / HO23b misses (development data since s47), with invented
reproducers (several spellings each, and near misses).

1. attention: a softmax helper decorated with AMP's ``custom_fwd`` (no ``cast_inputs``, or ``cast_inputs=float32``)
   computes the softmax it spells (in float32 under autocast, as the fused op does): read as that softmax, where
   every decorator used to drop the whole site without a near miss.
2. rope: a per-pair 2x2 rotation matrix applied by ``einsum`` (einops' or torch's) over the lane pairs
   (``"... k j, ... k i j -> ... k i"``), the matrix traced to ``[[cos, -sin], [sin, cos]]`` built in ``__init__``
   (einops ``rearrange([cos, -sin, sin, cos], "(a b) i k -> i k a b")`` or ``stack(..).view(.., 2, 2)``): the
   interleaved rope (flux's matrix reading); the transposed contraction or an untraced matrix are near misses.
3. moe_experts: a skip of empty experts is never the reason a loop is refused: ``cnt = int(counts[e].item()); if cnt
   == 0: continue`` is read as ``counts[e] == 0``; a skip test npufuse does not read is reported only where nothing
   else in the loop blocks (another blocker is the reason; no candidate past an unread skip).
4. moe_experts: a token's weight summed over its top-k slots by an inner loop into ``zeros(n)`` (``for k in
   range(K): km = idx[mask, k] == e; tw[km] += w[mask, k][km]``): the dense-gates weight ``(w * (idx == e)).sum(-1)
   [mask]`` under the run-time guard ``K == idx.shape[-1]``.
5. attention: an einsum P@V whose equation has ``...`` (npufuse reads it as two axes) was refused as "einsum over 5-D
   probabilities", untrue of 3-D tensors: the reason now says the rank is not known.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.moe_experts import MoeExperts
from npufuse.patterns.rope import RopePattern


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


# -- 1. attention: a softmax helper under AMP's custom_fwd --------------------------------------------------------------

_AMP_SOFTMAX = '''\
import math
import torch


@torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
def softmax(x, dim):
    max_x = x.amax(dim=dim, keepdim=True)
    e = (x - max_x).exp()
    return e / e.sum(dim=dim, keepdim=True)


def attend(q, k, v, causal: bool = False):
    s = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        m = torch.triu(torch.ones((s, s), device=q.device), diagonal=1).bool()
        scores = scores.masked_fill(m, float("-inf"))
    p = softmax(scores, -1)
    return torch.matmul(p, v)
'''

_AMP_SOFTMAX_RUN = """
q = torch.randn(2, 4, 16, 8, requires_grad=True)
k = torch.randn(2, 4, 16, 8, requires_grad=True)
v = torch.randn(2, 4, 16, 8, requires_grad=True)
out = attend(q, k, v, True) + attend(q, k, v)
leaves = [q, k, v]
"""


@pytest.mark.parametrize("change", [
    ("", ""),
    ('@torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)', '@torch.amp.custom_fwd(device_type="cuda")'),
    ('@torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)', "@custom_fwd(cast_inputs=torch.float)"),
    ('@torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)', "@custom_fwd"),
])
def test_softmax_helper_under_amp_custom_fwd_fuses(change: tuple[str, str]) -> None:
    code = _AMP_SOFTMAX.replace(*change) if change[0] else _AMP_SOFTMAX
    if "@custom_fwd" in code:
        code = code.replace("import torch\n", "import torch\nfrom torch.cuda.amp import custom_fwd\n", 1)
    _fused_and_runs(AttentionPattern(), code, _AMP_SOFTMAX_RUN, "attend")


@pytest.mark.parametrize("decorator", [
    '@torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float16)',  # a half-precision softmax
    "@functools.lru_cache",  # not AMP's
    "@my_wrapper",
])
def test_softmax_helper_under_other_decorators_is_not_read(decorator: str) -> None:
    code = _AMP_SOFTMAX.replace('@torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)', decorator)
    code = code.replace("import torch\n", "import functools\nimport torch\n\n\ndef my_wrapper(f):\n    return lambda x, d: f(x * 2, d)\n", 1)
    findings, _ = detect_all(AttentionPattern(), code)
    assert not findings


_AMP_SOFTMAX_SINKS = _AMP_SOFTMAX.replace('''    p = softmax(scores, -1)
    return torch.matmul(p, v)''', '''    bh = scores.shape[0]
    sinks = sinks.reshape(-1, 1, 1).repeat(bh // sinks.shape[0], s, 1)
    scores = torch.cat([scores, sinks], dim=-1)
    p = softmax(scores, -1)
    p = p[..., :-1]
    return torch.matmul(p, v)''').replace("def attend(q, k, v, causal: bool = False):", "def attend(q, k, v, sinks, causal: bool = False):")


def test_sinks_on_merged_heads_through_amp_softmax_is_a_near_miss() -> None:
    # HO23a JorgeVanco: 3-D [(b h), S, D] scores with a per-head sink column and the decorated softmax: was silent
    _near_miss(AttentionPattern(), _AMP_SOFTMAX_SINKS, "attention sinks")


# -- 2. rope: a per-pair rotation matrix applied by einsum ---------------------------------------------------------------

def _rearrange(t, pattern: str, **axes: int) -> torch.Tensor:
    """The einops patterns of the examples (einops is not installed in the test environment)."""
    if pattern == "(d1 d2) i k -> i k d1 d2":
        return torch.stack(list(t)).unflatten(0, (2, 2)).permute(2, 3, 0, 1)
    if pattern == "... seq (k d1) -> ... seq k d1":
        return t.unflatten(-1, (-1, axes["d1"]))
    if pattern == "... seq k d2 -> ... seq (k d2)":
        return t.flatten(-2)
    raise NotImplementedError(pattern)


def _einsum(a: torch.Tensor, b: torch.Tensor, pattern: str) -> torch.Tensor:
    if pattern == "... seq k d1, ... seq k d2 d1 -> ... seq k d2":
        return torch.einsum("...skj,...skij->...ski", a, b)
    raise NotImplementedError(pattern)


@pytest.fixture()
def fake_einops(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("einops")
    module.rearrange = _rearrange  # type: ignore[attr-defined]
    module.einsum = _einsum  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "einops", module)


_MATRIX_ROPE = '''\
import torch
import torch.nn as nn
from einops import rearrange, einsum


class RotaryPositionalEmbedding(nn.Module):
    def __init__(self, theta, d_k, max_seq_len, device=None):
        super().__init__()
        i = torch.arange(max_seq_len, device=device).view(-1, 1)
        k = torch.arange(1, d_k // 2 + 1, device=device)
        theta_i_k = i / theta ** (2 * (k - 1) / d_k)
        sin = theta_i_k.sin()
        cos = theta_i_k.cos()
        R = [cos, -sin, sin, cos]
        R = rearrange(R, "(d1 d2) i k -> i k d1 d2", d1=2, d2=2)
        self.register_buffer("R", R, persistent=False)

    def forward(self, x, token_positions):
        position_matrices = self.R[token_positions]
        x = rearrange(x, "... seq (k d1) -> ... seq k d1", d1=2)
        applied_rotary = einsum(x, position_matrices, "... seq k d1, ... seq k d2 d1 -> ... seq k d2")
        return rearrange(applied_rotary, "... seq k d2 -> ... seq (k d2)")
'''

_MATRIX_ROPE_RUN = """
rope = RotaryPositionalEmbedding(10000.0, 16, 32)
pos = torch.arange(6)
q3 = torch.randn(8, 6, 16, requires_grad=True)  # [(b h), S, D]
q4 = torch.randn(2, 4, 6, 16, requires_grad=True)  # [B, H, S, D]
q64 = torch.randn(2, 4, 6, 16, dtype=torch.float64, requires_grad=True)  # einsum does not promote: fp64 tables too
rope64 = RotaryPositionalEmbedding(10000.0, 16, 32).double()
out = [rope(q3, pos), rope(q4, pos), rope64(q64, pos), rope(q3, pos + 3)]
leaves = [q3, q4, q64]
"""

_MATRIX_ROPE_TORCH = '''\
import torch
import torch.nn as nn


class Rope(nn.Module):
    def __init__(self, theta, d_k, max_seq_len):
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, d_k, 2).float() / d_k)
        ang = torch.outer(torch.arange(max_seq_len).float(), inv)
        rot = torch.stack((torch.cos(ang), -torch.sin(ang), torch.sin(ang), torch.cos(ang)), dim=-1).view(max_seq_len, d_k // 2, 2, 2)
        self.register_buffer("rot", rot)

    def forward(self, x, pos):
        m = self.rot[pos]
        pairs = x.unflatten(-1, (-1, 2))
        y = torch.einsum("...skj,...skij->...ski", pairs, m)
        return y.flatten(-2)
'''

_MATRIX_ROPE_TORCH_RUN = """
rope = Rope(10000.0, 16, 32)
pos = torch.arange(6)
q4 = torch.randn(2, 4, 6, 16, requires_grad=True)
q3 = torch.randn(8, 6, 16, requires_grad=True)
out = [rope(q4, pos), rope(q3, pos)]
leaves = [q4, q3]
"""


def test_rotation_matrix_rope_by_einops_einsum_fuses(fake_einops: None) -> None:
    findings = _fused_and_runs(RopePattern(), _MATRIX_ROPE, _MATRIX_ROPE_RUN, "RotaryPositionalEmbedding.forward")
    assert findings[0].params["mode"] == "interleave"


@pytest.mark.parametrize("change", [
    ("", ""),
    ("pairs = x.unflatten(-1, (-1, 2))", "pairs = x.reshape(*x.shape[:-1], -1, 2)"),
    ('y = torch.einsum("...skj,...skij->...ski", pairs, m)', 'y = torch.einsum("...skij,...skj->...ski", m, pairs)'),
])
def test_rotation_matrix_rope_by_torch_einsum_fuses(change: tuple[str, str]) -> None:
    code = _MATRIX_ROPE_TORCH.replace(*change) if change[0] else _MATRIX_ROPE_TORCH
    _fused_and_runs(RopePattern(), code, _MATRIX_ROPE_TORCH_RUN, "Rope.forward")


@pytest.mark.parametrize("change", [
    # the transposed contraction: the inverse rotation
    ('"...skj,...skij->...ski"', '"...skj,...skji->...ski"'),
    # [[cos, sin], [-sin, cos]]: not the rotation read (its transpose)
    ("(torch.cos(ang), -torch.sin(ang), torch.sin(ang), torch.cos(ang))", "(torch.cos(ang), torch.sin(ang), -torch.sin(ang), torch.cos(ang))"),
    # cos and sin of different angles
    ("-torch.sin(ang), torch.sin(ang)", "-torch.sin(2 * ang), torch.sin(2 * ang)"),
    # the pairs axis is not the last one cut in two
    ("pairs = x.unflatten(-1, (-1, 2))", "pairs = x.unflatten(-1, (2, -1))"),
])
def test_rotation_matrix_rope_by_einsum_other_forms_are_not_fused(change: tuple[str, str]) -> None:
    findings, _ = detect_all(RopePattern(), _MATRIX_ROPE_TORCH.replace(*change))
    assert not findings


def test_rotation_matrix_by_einsum_not_traced_is_a_near_miss() -> None:
    code = _MATRIX_ROPE_TORCH.replace("m = self.rot[pos]", "m = self.make(pos)")
    _near_miss(RopePattern(), code, "not traced to rotations")


def test_rotation_matrix_rope_by_einsum_keeps_the_autocast_dtype(fake_einops: None) -> None:
    # under autocast einsum's product runs in autocast's dtype (bf16 here) whatever the tables' dtype: the fused call too
    run = """
rope = RotaryPositionalEmbedding(10000.0, 16, 32)
q = torch.randn(2, 4, 6, 16, requires_grad=True)
with torch.autocast("cpu", dtype=torch.bfloat16):
    y = rope(q, torch.arange(6))
out = [y]
leaves = [q]
"""
    findings, _ = detect_all(RopePattern(), _MATRIX_ROPE)
    facts = check_rewrite_runs(RopePattern(), _MATRIX_ROPE, run, findings)
    assert facts["calls"] >= 1 and facts["dtypes"] == [(torch.bfloat16, torch.bfloat16)], facts["dtypes"]
    assert min(facts["cos_out"]) > 0.999 and min(facts["cos_grad"]) > 0.999


# -- 3. moe_experts: skips of empty experts --------------------------------------------------------------------------

_COUNT_SKIP = '''\
import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.w2 = nn.Linear(h, d)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class MoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.n, self.k = n, k
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([Expert(d, h) for _ in range(n)])

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, indices = torch.topk(self.gate(x).softmax(dim=-1), self.k, dim=-1)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.n)
        for e in range(self.n):
            cnt = int(counts[e].item())
            if cnt == 0:
                continue
            idx, top = torch.where(indices == e)
            y[idx] += self.experts[e](x[idx]) * weights[idx, top, None]
        return y.view(shape)
'''

_COUNT_SKIP_RUN = '''
moe = MoE(16, 24, 8, 2)
x = torch.randn(2, 9, 16, requires_grad=True)
out = moe(x)
leaves = [x, moe.gate.weight, moe.experts[3].w1.weight]
'''


@pytest.mark.parametrize("change", [
    ("", ""),
    ("cnt = int(counts[e].item())", "cnt = counts[e].item()"),
    ("if cnt == 0:", "if not cnt:"),
    ("if cnt == 0:", "if cnt < 1:"),
    ("counts = torch.bincount(indices.flatten(), minlength=self.n)", "counts = torch.bincount(indices.view(-1), minlength=self.n).tolist()"),
])
def test_count_bound_to_a_name_then_skipped_fuses(change: tuple[str, str]) -> None:
    code = _COUNT_SKIP.replace(*change) if change[0] else _COUNT_SKIP
    if "tolist" in code:
        code = code.replace("cnt = int(counts[e].item())", "cnt = counts[e]")
    _fused_and_runs(MoeExperts(), code, _COUNT_SKIP_RUN, "MoE.forward")


def test_count_name_skip_with_another_blocker_names_that_blocker() -> None:
    # the skip is fine; the blocker is the expert input (rows of another tensor): that is the reason, not the skip
    code = _COUNT_SKIP.replace("self.experts[e](x[idx])", "self.experts[e](x.flip(0)[idx])").replace(
        "cnt = int(counts[e].item())", "cnt = int(self.load[e])")
    findings, misses = detect_all(MoeExperts(), code)
    assert not findings and misses
    assert not any("skips experts" in m.reason for m in misses), [m.reason for m in misses]


@pytest.mark.parametrize("change", [
    # a count of something else than the routed tokens: may skip experts with rows
    ("cnt = int(counts[e].item())", "cnt = int(self.load[e])"),
    # a threshold, not emptiness
    ("if cnt == 0:", "if cnt < 4:"),
    # weighted counts
    ("minlength=self.n)", "minlength=self.n, weights=weights.flatten())"),
])
def test_count_name_skip_not_proven_empty_is_the_reason(change: tuple[str, str]) -> None:
    _near_miss(MoeExperts(), _COUNT_SKIP.replace(*change), "skips experts")


# -- 4. moe_experts: the weight summed over the top-k slots by an inner loop -------------------------------------------

_SLOT_SUM = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class FFN(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class SlotSumMoE(nn.Module):
    def __init__(self, d, h, n, top_k):
        super().__init__()
        self.n, self.top_k = n, top_k
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([FFN(d, h) for _ in range(n)])
        self.load = torch.zeros(n)

    def forward(self, x):
        b, t, d = x.shape
        xf = x.view(-1, d)
        probs = F.softmax(self.router(xf), dim=-1)
        if self.top_k == 1:
            w, idx = torch.max(probs, dim=-1)
            w, idx = w.unsqueeze(-1), idx.unsqueeze(-1)
        else:
            w, idx = torch.topk(probs, self.top_k, dim=-1)
            w = w / w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(xf)
        for e in range(self.n):
            sel = (idx == e).any(dim=-1)
            if sel.any():
                y = self.experts[e](xf[sel])
                tw = torch.zeros(sel.sum(), device=x.device)
                for k in range(self.top_k):
                    hit = idx[sel, k] == e
                    tw[hit] += w[sel, k][hit]
                out[sel] += y * tw.unsqueeze(-1)
                if not self.training:
                    self.load[e] += sel.sum().item()
        return out.view(b, t, d)
'''

_SLOT_SUM_RUN = '''
torch.manual_seed(0)
m2 = SlotSumMoE(16, 24, 6, 2)
m1 = SlotSumMoE(16, 24, 6, 1)
x = torch.randn(2, 9, 16, requires_grad=True)
xb = torch.randn(2, 9, 16, requires_grad=True)
m2b = SlotSumMoE(16, 24, 6, 2).to(torch.bfloat16)
out = [m2(x), m1(x), m2b(xb.to(torch.bfloat16)).float()]
m2.eval()
out.append(m2(x))
leaves = [x, xb, m2.router.weight, m2.experts[2].up.weight]
'''


@pytest.mark.parametrize("change", [
    ("", ""),
    # the slot mask written inline, the weight assigned (top-k ids are distinct: one slot per token)
    ("                    hit = idx[sel, k] == e\n                    tw[hit] += w[sel, k][hit]",
     "                    tw[idx[sel, k] == e] = w[sel, k][idx[sel, k] == e]"),
    ("tw = torch.zeros(sel.sum(), device=x.device)", "tw = torch.zeros(sel.sum(), device=x.device, dtype=torch.float32)"),
])
def test_weight_summed_over_slots_by_an_inner_loop_fuses(change: tuple[str, str]) -> None:
    code = _SLOT_SUM.replace(*change) if change[0] else _SLOT_SUM
    findings, misses = detect_all(MoeExperts(), code)
    assert [f.qualname for f in findings] == ["SlotSumMoE.forward"], [m.reason for m in misses]
    run = _SLOT_SUM_RUN
    if "tw[idx[sel, k] == e] = " in code:  # an index put of bf16 weights into the fp32 zeros raises: fp32 only
        run = run.replace("m2b(xb.to(torch.bfloat16)).float()", "m2(xb)")
    facts = check_rewrite_runs(MoeExperts(), code, run, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.999 and min(facts["cos_grad"]) > 0.999, facts
    assert facts["dtypes"] == [(torch.float32, torch.float32)] * 4
    assert "(self.top_k) == idx.shape[-1]" in facts["rewritten"]  # the slots the loop reads are all of them


@pytest.mark.parametrize("change", [
    # the weight of slot 0 for every slot
    ("tw[hit] += w[sel, k][hit]", "tw[hit] += w[sel, 0][hit]"),
    # another expert's slots
    ("hit = idx[sel, k] == e", "hit = idx[sel, k] == 0"),
    # a bf16 accumulator rounds fp32 weights
    ("tw = torch.zeros(sel.sum(), device=x.device)", "tw = torch.zeros(sel.sum(), device=x.device, dtype=torch.bfloat16)"),
    # twice the weight
    ("tw[hit] += w[sel, k][hit]", "tw[hit] += 2 * w[sel, k][hit]"),
])
def test_weight_summed_over_slots_other_forms_are_not_fused(change: tuple[str, str]) -> None:
    findings, misses = detect_all(MoeExperts(), _SLOT_SUM.replace(*change))
    assert not findings and misses


# -- 5. attention: the reason for an einsum with `...` --------------------------------------------------------------

_ELLIPSIS_PV = '''\
import math
import torch
from einops import einsum


def attend(q, k, v):
    s = einsum(q, k, "batch ... q d, batch ... k d -> batch ... q k") / math.sqrt(q.shape[-1])
    p = torch.softmax(s, dim=-1)
    return einsum(p, v, "batch ... q k, batch ... k d -> batch ... q d")
'''


def test_einsum_with_an_ellipsis_gives_no_false_rank() -> None:
    findings, misses = detect_all(AttentionPattern(), _ELLIPSIS_PV)
    assert not findings
    assert misses and all("5-D" not in m.reason for m in misses), [m.reason for m in misses]
    assert any("`...` stands for any number of axes" in m.reason for m in misses), [m.reason for m in misses]


def test_rotation_matrix_rope_by_einsum_passes_the_scan_gate(tmp_path) -> None:
    # the scan hands a scope to the rope detector only if it holds one of SCOPE_WORDS: this forward has no `*`
    from npufuse.patterns.registry import all_patterns
    from npufuse.scan import engine

    (tmp_path / "site.py").write_text(_MATRIX_ROPE_TORCH, encoding="utf-8")
    out = engine.analyze_file(tmp_path, "site.py", all_patterns(), engine.ScanOptions())
    assert [h.finding.qualname for h in out.hits if h.finding.pattern == "rope"] == ["Rope.forward"]
