"""s47 (ho24attn): attention / moe_experts classes behind the HO24a / HO24b misses and untrue near-miss reasons, with
invented reproducers in other spellings (the real sites are not copied), near misses, and the rewrites run under the
emulator against the original.

1. A repository softmax helper whose option parameter defaults to a value that makes a branch dead
   (``temperature=1.0`` / ``if temperature != 1``, ``tau=None`` / ``if tau is not None``): read at a call that
   leaves the option at a literal; where the call passes a non-literal the near miss names the branch.
2. Score arithmetic written as tensor methods / torch functions (``s.mul(scale)``, ``torch.div(s, c)``,
   ``s.add(bias)``), read as the operators; a value computed inside the attention's lines and read after it only
   under ``if self.a and self.b`` (a conjunction of flags) keeps the fused call to where the conjunction is false.
3. moe_experts: a routing weight assembled slot by slot into a fresh buffer: the near miss says so (the old reason
   claimed the rows were not selected by an expert-index comparison).
"""

from __future__ import annotations

import pytest
from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.moe_experts import MoeExperts


def _fused_and_runs(pattern: object, code: str, run: str, qualname: str) -> dict:
    findings, misses = detect_all(pattern, code)  # type: ignore[arg-type]
    assert [f.qualname for f in findings] == [qualname], [m.reason for m in misses]
    facts = check_rewrite_runs(pattern, code, run, findings)  # type: ignore[arg-type]
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.999 and min(facts["cos_grad"] or [1.0]) > 0.999, facts
    return facts


def _near_miss(pattern: object, code: str, phrase: str) -> str:
    findings, misses = detect_all(pattern, code)  # type: ignore[arg-type]
    assert not findings, [f.qualname for f in findings]
    hit = [m.reason for m in misses if phrase in m.reason]
    assert hit, [m.reason for m in misses]
    return hit[0]


# -- 1. softmax helper with a dead option branch -----------------------------------------------------------------------

_TEMP_HELPER = '''
import math
import torch


def softmax(x, dim=-1, temperature=1.0):
    assert temperature > 0
    if temperature != 1:
        x = x / temperature
    m = torch.max(x, dim=dim, keepdim=True).values
    e = torch.exp(x - m)
    return e / torch.sum(e, dim=dim, keepdim=True)


def attend(Q, K, V, mask=None):
    d_k = K.shape[-1]
    scores = Q @ K.transpose(-2, -1) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    w = softmax(scores, dim=-1)
    return w @ V
'''

# a second spelling: a class-free helper with ``tau=None`` and the axis by position, the module's forward calling it
_TAU_HELPER = '''
import torch
import torch.nn as nn


def stable_softmax(logits, axis, tau=None, use_fp32=False):
    if tau is not None:
        logits = logits * (1.0 / tau)
    if use_fp32:
        return torch.softmax(logits.float(), dim=axis).type_as(logits)
    return torch.softmax(logits, dim=axis)


class SelfAttn(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        att = torch.matmul(q, k.transpose(-1, -2)) * (d // self.h) ** -0.5
        att = stable_softmax(att, -1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, n, d)
        return self.out(y)
'''

_RUN_ATTEND = '''
q = torch.randn(2, 4, 16, 32, requires_grad=True); k = torch.randn(2, 4, 16, 32, requires_grad=True)
v = torch.randn(2, 4, 16, 32, requires_grad=True)
mask = torch.tril(torch.ones(16, 16, dtype=torch.bool))
out = [attend(q, k, v, mask), attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask).float()]
leaves = [q, k, v]
'''

_RUN_SELF = '''
m = SelfAttn(64, 4)
x = torch.randn(2, 10, 64, requires_grad=True)
out = m(x)
leaves = [x, m.qkv.weight]
'''


@pytest.mark.parametrize("code,run,qualname", [(_TEMP_HELPER, _RUN_ATTEND, "attend"), (_TAU_HELPER, _RUN_SELF, "SelfAttn.forward")])
def test_softmax_helper_with_a_dead_option_branch_fuses(code: str, run: str, qualname: str) -> None:
    _fused_and_runs(AttentionPattern(), code, run, qualname)


def test_softmax_helper_option_passed_at_run_time_names_the_branch() -> None:
    code = _TEMP_HELPER.replace("softmax(scores, dim=-1)", "softmax(scores, dim=-1, temperature=t)").replace("mask=None)", "mask=None, t=1.0)")
    reason = _near_miss(AttentionPattern(), code, "whose body branches on `temperature != 1` (line 8): it is a softmax over one axis only where that test is false")
    assert "this call passes `temperature` as `t`" in reason
    # a literal that takes the branch: the body at this call divides first, not read as a softmax of the scores
    _near_miss(AttentionPattern(), _TEMP_HELPER.replace("softmax(scores, dim=-1)", "softmax(scores, dim=-1, temperature=2.0)"),
               "whose body is not read as a softmax")


# -- 2. method-form score arithmetic; a side value read after under a conjunction of flags -----------------------------

_DEFORM = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class SampledAttention(nn.Module):
    def __init__(self, dim, heads, n_sample, use_pe=True, dwc_pe=False):
        super().__init__()
        self.heads, self.hc = heads, dim // heads
        self.scale = self.hc ** -0.5
        self.n_sample = n_sample
        self.use_pe, self.dwc_pe = use_pe, dwc_pe
        self.proj_q = nn.Conv1d(dim, dim, 1)
        self.proj_k = nn.Conv1d(dim, dim, 1)
        self.proj_v = nn.Conv1d(dim, dim, 1)
        self.pool = nn.AdaptiveAvgPool1d(n_sample)
        self.lepe = nn.Conv1d(dim, dim, 3, padding=1, groups=dim)
        self.attn_drop = nn.Dropout(0.0)

    def forward(self, x):
        B, C, L = x.shape
        q = self.proj_q(x)
        kv = self.pool(x)
        q = q.reshape(B * self.heads, self.hc, L)
        k = self.proj_k(kv).reshape(B * self.heads, self.hc, self.n_sample)
        v = self.proj_v(kv).reshape(B * self.heads, self.hc, self.n_sample)
        attn = torch.einsum('b c m, b c n -> b m n', q, k)
        attn = attn.mul(self.scale)
        if self.use_pe:
            if self.dwc_pe:
                lepe = self.lepe(q.reshape(B, C, L)).reshape(B * self.heads, self.hc, L)
            else:
                attn = torch.tanh(attn / 30.0) * 30.0
        attn = F.softmax(attn, dim=2)
        attn = self.attn_drop(attn)
        out = torch.einsum('b m n, b c n -> b c m', attn, v)
        if self.use_pe and self.dwc_pe:
            out = out + lepe
        return out.reshape(B, C, L)
'''

_RUN_DEFORM = '''
m = SampledAttention(32, 4, 6, use_pe=False)
x = torch.randn(2, 32, 20, requires_grad=True)
out = m(x)
leaves = [x, m.proj_q.weight, m.proj_k.weight]
'''

# a second spelling: function forms (``torch.div``) and a method-form bias (``.add``), 4-D heads
_FUNC_FORMS = '''
import math
import torch


def attend(q, k, v, bias):
    s = torch.matmul(q, k.transpose(-2, -1))
    s = torch.div(s, math.sqrt(q.size(-1))).add(bias)
    return torch.matmul(s.softmax(dim=-1), v)
'''

_RUN_FUNC = '''
q = torch.randn(2, 4, 12, 16, requires_grad=True); k = torch.randn(2, 4, 12, 16, requires_grad=True)
v = torch.randn(2, 4, 12, 16, requires_grad=True)
bias = torch.zeros(1, 1, 12, 12).masked_fill(torch.ones(12, 12).triu(1).bool(), float("-inf"))
out = attend(q, k, v, bias)
leaves = [q, k, v]
'''


def test_method_form_scale_and_flag_conjunction_fuse() -> None:
    facts = _fused_and_runs(AttentionPattern(), _DEFORM, _RUN_DEFORM, "SampledAttention.forward")
    assert "not (self.use_pe and self.dwc_pe)" in facts["rewritten"]


def test_function_form_scale_and_bias_fuse() -> None:
    _fused_and_runs(AttentionPattern(), _FUNC_FORMS, _RUN_FUNC, "attend")


def test_method_forms_near_misses() -> None:
    # ``alpha=`` changes the value: not read as ``s + t``
    _near_miss(AttentionPattern(), _FUNC_FORMS.replace(".add(bias)", ".add(bias, alpha=0.5)"), "unsupported operation on the attention scores")
    # the side value read after under ``or``: the fused call could not skip every read
    reason = _near_miss(AttentionPattern(), _DEFORM.replace("if self.use_pe and self.dwc_pe:", "if self.use_pe or self.dwc_pe:"),
                        "is used after the attention")
    assert "`lepe`" in reason


# -- 3. moe_experts: routing weight assembled slot by slot -------------------------------------------------------------

_SLOT_WRITES = '''
import torch
import torch.nn as nn


class Top2(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.n = n
        self.router = nn.Linear(d, n)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs, idx = self.router(flat).topk(2, dim=-1)
        probs = probs.softmax(-1)
        y = torch.zeros_like(flat)
        for e in range(self.n):
            sel = (idx == e).any(dim=-1)
            if not sel.any():
                continue
            h = self.experts[e](flat[sel])
            wt = torch.zeros(int(sel.sum()), device=x.device, dtype=x.dtype)
            first = idx[sel, 0] == e
            second = idx[sel, 1] == e
            wt[first] = probs[sel, 0][first]
            wt[second] = probs[sel, 1][second]
            y[sel] += h * wt[:, None]
        return y.view_as(x)
'''


def test_slot_written_weight_reason_is_true() -> None:
    reason = _near_miss(MoeExperts(), _SLOT_WRITES, "written slot by slot into the fresh buffer `wt`")
    assert "not selected by an expert-index" not in reason
    # a write into a buffer made before the loop keeps the old reason (not a per-expert weight buffer)
    moved = _SLOT_WRITES.replace("        for e in range(self.n):\n", "        wt = torch.zeros(flat.shape[0])\n        for e in range(self.n):\n") \
        .replace("            wt = torch.zeros(int(sel.sum()), device=x.device, dtype=x.dtype)\n", "")
    _near_miss(MoeExperts(), moved, "rows are written through `wt[first]`")


# -- 4. q / k written as calls of a pure method of the class ----------------------------------------------------------

_SMOOTHED = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Smoothed(nn.Module):
    def __init__(self, d, heads, n):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.drop = nn.Dropout(0.0)
        self.register_buffer("mix", torch.tril(torch.rand(n, n)))

    def smooth(self, x):
        return torch.matmul(self.mix[:x.shape[-2], :x.shape[-2]], x)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        s = torch.matmul(self.smooth(q), self.smooth(k).transpose(-2, -1)) * (d // self.heads) ** -0.5
        p = self.drop(F.softmax(s, dim=-1))
        o = torch.matmul(p, v)
        return o.transpose(1, 2).reshape(b, n, d)
'''

_RUN_SMOOTHED = '''
m = Smoothed(64, 4, 16)
x = torch.randn(2, 12, 64, requires_grad=True)
out = [m(x), m.bfloat16()(x.bfloat16()).float()]
leaves = [x]
'''

# a second spelling: 5-D [B, vars, H, S, D] operands (folded), an einsum EMA over the token axis, the scale a division
_EMA_5D = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class TokenEMAAttention(nn.Module):
    def __init__(self, hidden, heads, n_tokens, alpha=0.3):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_dropout = nn.Dropout(0.0)
        m = torch.zeros(n_tokens, n_tokens)
        for i in range(n_tokens):
            for j in range(i + 1):
                m[i, j] = alpha * (1 - alpha) ** (i - j)
        self.register_buffer("ema_matrix", m)

    def ema(self, src):
        return torch.einsum('bnhad,ga->bnhgd', src, self.ema_matrix[:src.shape[-2], :src.shape[-2]])

    def forward(self, src):
        B, nvars, T, C = src.shape
        q, k, v = self.qkv(src).reshape(B, nvars, T, 3, self.heads, C // self.heads).permute(3, 0, 1, 4, 2, 5)
        score = torch.einsum('bnhed,bnhfd->bnhef', self.ema(q), self.ema(k)) / self.head_dim ** -0.5
        attn = self.attn_dropout(F.softmax(score, dim=-1))
        out = torch.einsum('bnhef,bnhfd->bnhed', attn, v)
        return out.permute(0, 1, 3, 2, 4).reshape(B, nvars, T, C)
'''

_RUN_EMA = '''
m = TokenEMAAttention(32, 4, 16)
x = (torch.randn(2, 3, 10, 32) * 0.1).requires_grad_()
out = m(x)
leaves = [x, m.qkv.weight]
'''


@pytest.mark.parametrize("code,run,qualname", [(_SMOOTHED, _RUN_SMOOTHED, "Smoothed.forward"),
                                               (_EMA_5D, _RUN_EMA, "TokenEMAAttention.forward")])
def test_pure_method_operands_bound_once_fuse(code: str, run: str, qualname: str) -> None:
    facts = _fused_and_runs(AttentionPattern(), code, run, qualname)
    fused = facts["rewritten"].split("npufuse: attention")[1].split("else:")[0]
    # each operand call made once before the call (and the fold test, if any, reads the bound names)
    assert fused.count("self.smooth(") + fused.count("self.ema(") == 2, fused


def test_impure_method_operands_stay_a_near_miss() -> None:
    # a method drawing random numbers: a second call gives another value
    noisy = _SMOOTHED.replace("return torch.matmul(self.mix[:x.shape[-2], :x.shape[-2]], x)",
                              "return torch.matmul(self.mix[:x.shape[-2], :x.shape[-2]], x + 0.01 * torch.randn_like(x))")
    _near_miss(AttentionPattern(), noisy, "more often than the original code does")


# -- 5. a registered triu(ones, 1) buffer as the masked positions: causal (5-D grouped-query attention folds) -----------

_GQA_5D = '''
import torch
import torch.nn as nn


class GroupedAttention(nn.Module):
    def __init__(self, d, heads, kv_heads, ctx):
        super().__init__()
        self.h, self.kvh, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(ctx, ctx), diagonal=1))

    def forward(self, x):
        B, T, _ = x.shape
        g = self.h // self.kvh
        q = self.q(x).view(B, T, self.kvh, g, self.hd).permute(0, 2, 3, 1, 4)
        k = self.k(x).view(B, T, self.kvh, 1, self.hd).permute(0, 2, 3, 4, 1)
        v = self.v(x).view(B, T, self.kvh, 1, self.hd).permute(0, 2, 3, 1, 4)
        scores = q @ k
        causal = self.mask[:T, :T].bool()
        scores = scores.masked_fill(causal, -float("inf"))
        w = torch.softmax(scores / self.hd ** 0.5, dim=-1)
        out = w @ v
        return out.reshape(B, self.h, T, self.hd).transpose(1, 2).reshape(B, T, -1)
'''

_RUN_GQA = '''
m = GroupedAttention(64, 8, 2, 32)
x = torch.randn(2, 12, 64, requires_grad=True)
out = [m(x), m.bfloat16()(x.bfloat16()).float()]
leaves = [x]
'''

# a second spelling: 4-D heads, the buffer cast before slicing and applied in place (the from-scratch GPT book form)
_CAUSAL_BUFFER_4D = '''
import torch
import torch.nn as nn


class CausalMHA(nn.Module):
    def __init__(self, d, heads, ctx, dropout=0.0):
        super().__init__()
        self.h, self.hd = heads, d // heads
        self.W_query = nn.Linear(d, d)
        self.W_key = nn.Linear(d, d)
        self.W_value = nn.Linear(d, d)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(ctx, ctx), diagonal=1))

    def forward(self, x):
        b, n, d = x.shape
        q = self.W_query(x).view(b, n, self.h, self.hd).transpose(1, 2)
        k = self.W_key(x).view(b, n, self.h, self.hd).transpose(1, 2)
        v = self.W_value(x).view(b, n, self.h, self.hd).transpose(1, 2)
        attn_scores = q @ k.transpose(2, 3)
        mask_bool = self.mask.bool()[:n, :n]
        attn_scores = attn_scores.masked_fill(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / k.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return (attn_weights @ v).transpose(1, 2).reshape(b, n, d)
'''

_RUN_CAUSAL_4D = '''
m = CausalMHA(64, 4, 32)
x = torch.randn(2, 10, 64, requires_grad=True)
out = [m(x), m.bfloat16()(x.bfloat16()).float()]
leaves = [x]
'''


@pytest.mark.parametrize("code,run,qualname", [(_GQA_5D, _RUN_GQA, "GroupedAttention.forward"),
                                               (_CAUSAL_BUFFER_4D, _RUN_CAUSAL_4D, "CausalMHA.forward")])
def test_triu_buffer_is_causal(code: str, run: str, qualname: str) -> None:
    facts = _fused_and_runs(AttentionPattern(), code, run, qualname)
    assert "sparse_mode=" in facts["rewritten"]


def test_triu_buffer_near_misses() -> None:
    # diagonal 0 masks the diagonal too (every key of row 0): not the causal triangle, a mask beside 5-D operands
    _near_miss(AttentionPattern(), _GQA_5D.replace("diagonal=1", "diagonal=0"), "could not fold the other leading dims")
    # the buffer is overwritten elsewhere with something else: not read as causal
    other = _GQA_5D.replace("    def forward(self, x):", "    def widen(self, m):\n        self.mask = m\n\n    def forward(self, x):")
    _near_miss(AttentionPattern(), other, "could not fold the other leading dims")


def test_pse_refusal_names_the_transposed_operands() -> None:
    # one-head [B, Sq, Skv] scores of channel-first [B, D, S] q / k with a learned bias: the old reason said the scores'
    # shape was not plain (it is); the operands' transposition is what npufuse does not pass a bias for
    biased = _DEFORM.replace("                attn = torch.tanh(attn / 30.0) * 30.0\n",
                             "                attn = attn + self.table[None].expand(B, -1, -1, -1).reshape(B * self.heads, L, self.n_sample)\n") \
        .replace("        self.attn_drop = nn.Dropout(0.0)\n", "        self.attn_drop = nn.Dropout(0.0)\n        self.table = nn.Parameter(torch.zeros(heads, 20, n_sample))\n")
    reason = _near_miss(AttentionPattern(), biased, "a float bias is added to the scores")
    assert "enter the products transposed" in reason and "not in this layout" not in reason
