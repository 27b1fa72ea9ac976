"""s50 (helper gaps50): soundness gaps the s49 sessions left as notes, each closed and run under the emulator.

1. attention: a handed-in boolean padding mask gets no row check; a sequence that is all padding makes eager's row a
   uniform average (a finite fill) while the op's fully masked row is not pinned down (cos 0.77 at the start). One
   replacing fill term: unmasked with q zeroed there (no host sync); other forms: the op mask's rows checked.
2. moe_experts: an indexed ``out[tok] += y`` with ids not shown distinct per row: a run-time distinct-rows guard.
3. moe_experts: a token-wise expert's scalar known only by its numeric default: refused where a caller passes a tensor.
4. moe_experts: idle experts (a zero grad for a None): the risk line is the answer; shown numerically.
"""

from __future__ import annotations

import pytest
import torch
import test_detect_s49_moe49 as moe49
import test_detect_s49_review49 as review49
from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.moe_experts import MoeExperts

ATTN, MOE = AttentionPattern(), MoeExperts()

# -- 1. attention: fully masked rows of handed-in masks ---------------------------------------------------------------------

_HEAD = '''
import torch
from torch import nn


class PadAttention(nn.Module):
    def __init__(self, d=32, n_head=4):
        super().__init__()
        self.n_head, self.head_dim = n_head, d // n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("tril", torch.tril(torch.ones(16, 16)))

    def forward(self, x, keep):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        att = q @ k.transpose(-2, -1) * self.head_dim ** -0.5
'''
_TAIL = '''        y = att.softmax(dim=-1) @ v
        return y.transpose(1, 2).reshape(b, s, -1)
'''

_FORMS = {
    # one replacing fill: q zeroed on the empty rows, no host sync
    "fill_finfo_min": "        att = att.masked_fill(~keep[:, None, None, :], torch.finfo(att.dtype).min)\n",
    "fill_keep_eq_0_minus_1e9": "        att = att.masked_fill(keep[:, None, None, :] == 0, -1e9)\n",
    # an additive bias built from the boolean: the row check (host sync), the original on an empty row
    "bias_finfo_min": ("        bias = torch.zeros(b, 1, 1, s, dtype=x.dtype).masked_fill(~keep[:, None, None, :], "
                       "torch.finfo(x.dtype).min)\n        att = att + bias\n"),
    # a causal triangle beside finfo.min padding: left padding leaves query 0 only a padded key (eager: all its weight)
    "causal_and_padding": ("        att = att.masked_fill(self.tril[:s, :s] == 0, float('-inf'))\n"
                           "        att = att.masked_fill(~keep[:, None, None, :], torch.finfo(att.dtype).min)\n"),
}

_ALL_PADDING = "torch.tensor([[True] * 6, [False] * 6])"
_RIGHT_PADDING = "torch.tensor([[True] * 6, [True] * 4 + [False] * 2])"
_LEFT_PADDING = "torch.tensor([[True] * 6, [False] * 2 + [True] * 4])"


def _attn_run(keep: str, dtype: str, backward: bool = True) -> str:
    return (f"torch.manual_seed(0)\nm = PadAttention().to(torch.{dtype})\n"
            f"x = torch.randn(2, 6, 32, dtype=torch.{dtype}, requires_grad=True)\n"
            f"out = m(x, {keep})\nleaves = {'[x, *m.parameters()]' if backward else '[]'}\n")


def _attn_facts(form: str, keep: str, dtype: str) -> dict:
    code = _HEAD + _FORMS[form] + _TAIL
    findings, misses = detect_all(ATTN, code)
    assert [f.qualname for f in findings] == ["PadAttention.forward"], [m.reason for m in misses]
    facts = check_rewrite_runs(ATTN, code, _attn_run(keep, dtype), findings)
    facts["finding"] = findings[0]
    return facts


def _same(facts: dict, dtype: str) -> None:
    tol = 0.9999 if dtype == "float32" else 0.999
    assert min(facts["cos_out"]) > tol and min(facts["cos_grad"], default=1.0) > tol, facts
    assert all(a == b for a, b in facts["dtypes"]) and all(a == b for a, b in facts["shapes"]), facts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", ["fill_finfo_min", "fill_keep_eq_0_minus_1e9"])
def test_one_fill_term_all_padding_sequence_runs_fused_and_equal(form: str, dtype: str) -> None:
    facts = _attn_facts(form, _ALL_PADDING, dtype)
    assert facts["all_calls"].get("npu_fusion_attention", 0) == 1, facts["all_calls"]  # no fallback: device-side repair
    assert "masked_fill(_npufuse_empty, 0)" in facts["rewritten"]
    assert ".item()" not in facts["finding"].fused and "bool(" not in facts["finding"].fused  # no host sync added
    _same(facts, dtype)


@pytest.mark.parametrize("form", ["fill_finfo_min", "fill_keep_eq_0_minus_1e9"])
def test_one_fill_term_right_padding_unchanged(form: str) -> None:
    facts = _attn_facts(form, _RIGHT_PADDING, "float32")
    assert facts["all_calls"].get("npu_fusion_attention", 0) == 1
    _same(facts, "float32")
    assert any("zeroes q there" in r.detail for r in facts["finding"].risks)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_additive_bias_from_a_boolean_checks_rows(dtype: str) -> None:
    facts = _attn_facts("bias_finfo_min", _ALL_PADDING, dtype)
    assert facts["calls"] == 0, facts["all_calls"]  # the all-padding sequence: the original code
    _same(facts, dtype)
    facts = _attn_facts("bias_finfo_min", _RIGHT_PADDING, dtype)
    assert facts["all_calls"].get("npu_fusion_attention", 0) == 1, facts["all_calls"]
    _same(facts, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_causal_beside_left_padding_checks_the_union(dtype: str) -> None:
    facts = _attn_facts("causal_and_padding", _LEFT_PADDING, dtype)
    assert facts["calls"] == 0, facts["all_calls"]  # query 0 keeps only a padded key: the original code
    _same(facts, dtype)
    facts = _attn_facts("causal_and_padding", _RIGHT_PADDING, dtype)
    assert facts["all_calls"].get("npu_fusion_attention", 0) == 1, facts["all_calls"]
    _same(facts, dtype)


def test_minus_inf_fill_is_left_as_it_was() -> None:
    # -inf throughout is NaN in eager: no row check, no q repair (keep twin: passes on the start code too)
    code = _HEAD + "        att = att.masked_fill(~keep[:, None, None, :], float('-inf'))\n" + _TAIL
    findings, _ = detect_all(ATTN, code)
    assert findings and "_npufuse_empty" not in findings[0].fused and ".all(-1).any()" not in findings[0].fused
    facts = check_rewrite_runs(ATTN, code, _attn_run(_RIGHT_PADDING, "float32"), findings)
    _same(facts, "float32")


def test_helper_built_padding_bias_says_rows_are_unchecked() -> None:
    # a method builds the bias from the handed-in boolean: a fallback would call it again (s41), so the candidate
    # stays and says so
    code = _HEAD.replace("    def forward(self, x, keep):", "    def _bias(self, keep):\n        return torch.zeros(keep.shape, "
                         "device=keep.device).masked_fill(~keep, torch.finfo(torch.float32).min)[:, None, None, :]\n\n"
                         "    def forward(self, x, keep):") + "        att = att + self._bias(keep)\n" + _TAIL
    findings, misses = detect_all(ATTN, code)
    assert findings, [m.reason for m in misses]
    assert any("NOT checked at run time" in r.detail for r in findings[0].risks), [r.detail for r in findings[0].risks]


# -- 2. moe_experts: an indexed `+=` with ids handed in ---------------------------------------------------------------------

_SAMPLED_IDS = '''
import torch
from torch import nn
import torch.nn.functional as F


class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)))


class HandedIdsMoE(nn.Module):
    def __init__(self, d=16, h=32, n_experts=4):
        super().__init__()
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList([Expert(d, h) for _ in range(n_experts)])

    def forward(self, x, ids):
        w = self.gate(x).softmax(-1).gather(-1, ids)
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            tok, slot = torch.where(ids == e)
            out[tok] += self.experts[e](x[tok]) * w[tok, slot].unsqueeze(-1)
        return out
'''

_REPEATING = "torch.multinomial(torch.ones(10, 4), 2, replacement=True, generator=torch.Generator().manual_seed(3))"
_DISTINCT = "torch.randn(10, 4, generator=torch.Generator().manual_seed(1)).topk(2, -1).indices"


def _moe_run(ids: str) -> str:
    return f"torch.manual_seed(0)\nm = HandedIdsMoE()\nx = torch.randn(10, 16, requires_grad=True)\nout = m(x, {ids})\nleaves = [x, *m.parameters()]\n"


def test_repeating_ids_run_the_original_loop() -> None:
    findings, misses = detect_all(MOE, _SAMPLED_IDS)
    assert findings, [m.reason for m in misses]
    assert "torch.diff(torch.sort(ids, dim=-1).values, dim=-1) != 0" in findings[0].guard_tensor
    facts = check_rewrite_runs(MOE, _SAMPLED_IDS, _moe_run(_REPEATING), findings)
    assert facts["calls"] == 0, facts["all_calls"]  # a token holds one expert twice: the loop runs
    assert min(facts["cos_out"]) > 0.99999 and min(facts["cos_grad"]) > 0.99999, facts


def test_distinct_handed_in_ids_run_fused() -> None:
    findings, _ = detect_all(MOE, _SAMPLED_IDS)
    facts = check_rewrite_runs(MOE, _SAMPLED_IDS, _moe_run(_DISTINCT), findings)
    assert facts["all_calls"].get("npu_grouped_matmul", 0) >= 1, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999, facts
    assert any("every row of it is distinct" in r.detail for r in findings[0].risks)


def test_index_add_combine_needs_no_distinct_check() -> None:
    # index_add_ adds every copy, as the fused layer does (twin: no guard, fused on repeating ids, equal)
    code = _SAMPLED_IDS.replace("out[tok] += self.experts[e](x[tok]) * w[tok, slot].unsqueeze(-1)",
                                "out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot].unsqueeze(-1))")
    findings, misses = detect_all(MOE, code)
    assert findings, [m.reason for m in misses]
    assert "torch.diff" not in (findings[0].guard_tensor or "")
    facts = check_rewrite_runs(MOE, code, _moe_run(_REPEATING), findings)
    assert facts["all_calls"].get("npu_grouped_matmul", 0) >= 1
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999, facts


def test_topk_ids_get_no_check() -> None:
    code = _SAMPLED_IDS.replace("    def forward(self, x, ids):\n", "    def forward(self, x):\n        ids = self.gate(x).topk(2, dim=-1).indices\n")
    findings, misses = detect_all(MOE, code)
    assert findings, [m.reason for m in misses]
    assert "torch.diff" not in (findings[0].guard_tensor or "")


# -- 3. moe_experts: a scalar known by its numeric default, filled with a tensor by a caller --------------------------------

def test_numeric_default_filled_with_a_tensor_is_not_tokenwise() -> None:
    review49._near_miss(MOE, review49._scaled("pos_scale=1.0", "torch.linspace(0.5, 1.5, 5)[:, None]"), "compute each token on its own")


def test_numeric_default_filled_with_a_number_stays_fused() -> None:
    review49._fused_and_runs(MOE, review49._scaled("pos_scale=1.0", "0.5"), moe49._WHERE_PAIRS_RUN, "SequenceRoutedMoE.forward")


def _two_files(tmp_path, other: str) -> tuple[list, list]:
    from npufuse.scan import repo_facts
    from npufuse.scan.dataflow import ModuleInfo

    code = review49._scaled("pos_scale=1.0", "0.5")
    (tmp_path / "moe.py").write_text(code)
    (tmp_path / "other.py").write_text(other)
    module = ModuleInfo.from_source("moe.py", code)
    repo_facts.attach_root(module, tmp_path)
    found, misses = [], []
    for scope in module.scopes:
        for r in MOE.detect(module, scope):
            (misses if hasattr(r, "reason") else found).append(r)
    return found, misses


def test_a_tensor_passed_by_another_file_is_seen(tmp_path) -> None:
    other = ("import torch\nfrom moe import FeedForwardExpert\n\n\ndef build():\n    scale = torch.ones(5, 1)\n"
             "    return FeedForwardExpert(16, 24, 0.0, pos_scale=scale)\n")
    found, misses = _two_files(tmp_path, other)
    assert not found and any("compute each token on its own" in m.reason for m in misses), [m.reason for m in misses]


def test_a_number_passed_by_another_file_stays_fused(tmp_path) -> None:
    other = "from moe import FeedForwardExpert\n\n\ndef build(cfg):\n    return FeedForwardExpert(16, 24, 0.0, cfg.scale * 2)\n"
    found, misses = _two_files(tmp_path, other)
    assert [f.qualname for f in found] == ["SequenceRoutedMoE.forward"], [m.reason for m in misses]


# -- 4. moe_experts: idle experts get a zero grad through the stacked weights (the risk line is the answer) ------------------

def test_idle_expert_zero_grad_is_said_and_measured() -> None:
    code = _SAMPLED_IDS.replace("            tok, slot = torch.where(ids == e)\n",
                                "            tok, slot = torch.where(ids == e)\n            if tok.numel() == 0:\n                continue\n")
    findings, _ = detect_all(MOE, code)
    risk = " ".join(r.detail for r in findings[0].risks)
    assert "ZERO gradient" in risk and "a host sync per layer and step" in risk
    # every token to experts 0 and 1: experts 2 and 3 idle. The loop leaves their grads None; the rewrite gives zeros,
    # and one AdamW step (weight decay 0.1) then moves them: that is what the risk line says
    run = (_moe_run("torch.tensor([[0, 1]] * 10)") +
           "out.float().sum().backward()\nopt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1)\n"
           "before = m.experts[3].w1.weight.detach().clone()\nopt.step()\n"
           "out = (m.experts[3].w1.weight.detach() - before).abs().sum().reshape(1)\nleaves = []\n")
    facts = check_rewrite_runs(MOE, code, run, findings)
    assert facts["all_calls"].get("npu_grouped_matmul", 0) >= 1
    ns: dict = {}
    exec(compile(code, "<o>", "exec"), ns)
    exec(compile(run, "<r>", "exec"), ns)
    assert float(ns["out"]) == 0.0  # the loop: a None grad, AdamW skips the expert
    assert facts["cos_out"] == [0.0]  # the rewrite: the idle expert moved (a zero vector vs a nonzero one)


def test_einops_reshaped_handed_in_mask_gets_the_row_check() -> None:
    # folded heads, the boolean key mask repeated per head with einops (pure: evaluating it again in the fallback is
    # harmless): the rows are repaired (q zeroed or the op mask's rows checked), not left unchecked (FourierFlow's
    # CrossAttention form)
    code = '''
import torch
from torch import nn
from einops import rearrange, repeat


class FoldedCross(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads, self.scale = heads, (d // heads) ** -0.5
        self.to_q, self.to_kv = nn.Linear(d, d, bias=False), nn.Linear(d, 2 * d, bias=False)

    def forward(self, x, context, mask):
        h = self.heads
        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        q, k, v = map(lambda t: rearrange(t, "b n (h d) -> (b h) n d", h=h), (q, k, v))
        sim = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        mask = repeat(mask, "b j -> (b h) () j", h=h)
        sim.masked_fill_(~mask, -torch.finfo(sim.dtype).max)
        out = torch.matmul(sim.softmax(dim=-1), v)
        return rearrange(out, "(b h) n d -> b n (h d)", h=h)
'''
    findings, misses = detect_all(ATTN, code)
    assert findings, [m.reason for m in misses]
    fused = findings[0].fused
    assert "not bool(_npufuse_mask.all(-1).any())" in fused or "masked_fill(_npufuse_empty, 0)" in fused  # repaired
    assert not any("NOT checked at run time" in r.detail for r in findings[0].risks)
