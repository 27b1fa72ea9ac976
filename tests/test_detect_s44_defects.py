"""s44 defects44: three pre-existing defects review44 found with the emulator, each pinned here (fails on d2b2e7c),
then fixed by its class; every Fuse form runs rewritten under the emulator against the original (outputs, grads).

1. moe_experts mask routing whose ids can reach E (top-k over a gate wider than the loop, `range(len(self.experts))`
   over fewer experts than the gate's width): the loop skips those tokens, the fused unpermute combined them.
2. moe_experts flat routing with -1 ids (dropped tokens): npu_moe_token_permute takes ids in [0, 16777215) only
   (spec 8.6) and raised where the loop skips them.
   Both: ids proven in [0, E) from the gate's width / a one-hot mask of E classes keep the fused text as it was; others
   are masked at run time (`_npufuse_named`, elementwise, no host sync).
3. attention / sdpa: a mask broadcast over the keys ([B, 1, Sq, 1], a query-padding `keep[:, None, :, None]`) reached
   npu_fusion_attention unexpanded (shape not supported); now expanded to [.., Sq, Skv].
"""

from __future__ import annotations

import pytest

from pattern_harness import check_rewrite_runs, detect_all
from npufuse.patterns import _attention_audit40
from npufuse.patterns._moe_s42b import _HEAD, _moe, _run
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.moe_experts import MoeExperts
from npufuse.patterns.sdpa import SdpaPattern


def _close(facts: dict, tol: float = 0.9999) -> None:
    assert facts["calls"] >= 1, facts["all_calls"]
    assert all(a == b for a, b in facts["shapes"]), facts["shapes"]
    assert all(c > tol for c in facts["cos_out"]), facts["cos_out"]
    assert all(c > tol for c in facts["cos_grad"]), facts["cos_grad"]


def _fused(pattern, code: str) -> list:
    findings, misses = detect_all(pattern, code)
    assert findings, [m.reason for m in misses]
    return findings


def _moe_matches(code: str, ids_masked: bool, run: str = _run("9, 16")) -> None:
    """Fused (with or without the run-time id mask) and, rewritten, the same as the original under the emulator."""
    findings = _fused(MoeExperts(), code)
    assert ("_npufuse_named" in findings[0].fused) == ids_masked
    _close(check_rewrite_runs(MoeExperts(), code, run, findings))


# -- 1. mask routing whose ids can name no expert of the loop -----------------------------------------------------------

_WHERE = _moe('''\
        w, sel = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.n):
            tok, slot = torch.where(sel == e)
            out[tok] += w[tok, slot, None] * self.experts[e](x[tok])
        return out
''')
_WIDER_GATE = _WHERE.replace("nn.Linear(d, n, bias=False)", "nn.Linear(d, n + 1, bias=False)")
_FEWER_EXPERTS = _WHERE.replace("for _ in range(n)])", "for _ in range(n - 1)])").replace(
    "for e in range(self.n):", "for e in range(len(self.experts)):")
_ONE_HOT = _moe('''\
        w, sel = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        mask = F.one_hot(sel, num_classes=self.n).permute(2, 1, 0)
        for e in range(self.n):
            idx, top_x = torch.where(mask[e])
            out[top_x] += w[top_x, idx, None] * self.experts[e](x[top_x])
        return out
''')
# the one-hot spelled as a comparison: ids outside arange(E) match no expert (skipped), where F.one_hot raises
_ARANGE_EQ = _ONE_HOT.replace("F.one_hot(sel, num_classes=self.n)", "(sel.unsqueeze(-1) == torch.arange(self.n))")
# the ids read through a copy of the top-k's
_COPY = ("w, sel = torch.topk", "w, top = torch.topk", "        out = torch.zeros_like(x)\n",
         "        out = torch.zeros_like(x)\n        sel = top.clone()\n")


# experts npufuse calls as they are (a LayerNorm inside: no grouped matmul form): the local path, ids sorted last
_OPAQUE_EXPERT = '''

class NormFF(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x))))
'''


def _opaque(code: str) -> str:
    return code.replace("self.experts = nn.ModuleList([FF(d, h)", "self.experts = nn.ModuleList([NormFF(d, h)").replace(
        "\n\nclass MoE(", _OPAQUE_EXPERT + "\n\nclass MoE(", 1)


# ids handed in by a router elsewhere, tokens it drops marked -1 (no width to read): masked at run time
_HANDED_IN = _HEAD + '''

class MoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.n, self.k = n, k
        self.experts = nn.ModuleList([FF(d, h) for _ in range(n)])

    def forward(self, x, w, sel):
        out = torch.zeros_like(x)
        for e in range(self.n):
            tok, slot = torch.where(sel == e)
            out[tok] += w[tok, slot, None] * self.experts[e](x[tok])
        return out
'''
_HANDED_RUN = ("m = MoE(16, 24, 5, 2)\nx = torch.randn(9, 16, requires_grad=True)\nw = torch.rand(9, 2, requires_grad=True)\n"
               "sel = torch.randint(0, 5, (9, 2))\nsel[::3, 1] = -1\nout = m(x, w, sel)\nleaves = [x, w, m.experts[1].w1.weight]\n")


@pytest.mark.parametrize("code", [_WIDER_GATE, _FEWER_EXPERTS, _opaque(_WIDER_GATE), _opaque(_FEWER_EXPERTS),
                                  _ARANGE_EQ.replace("nn.Linear(d, n, bias=False)", "nn.Linear(d, n + 1, bias=False)")],
                         ids=["topk_over_a_wider_gate", "loop_over_fewer_experts", "opaque_wider_gate", "opaque_fewer_experts",
                              "arange_eq_masks_of_a_wider_gate"])
def test_mask_routing_ids_at_or_past_the_loops_experts_are_skipped(code: str) -> None:
    # the loop never runs ids >= its E; the fused unpermute combined them (emulator cos 0.89)
    _moe_matches(code, ids_masked=True)


def test_mask_routing_ids_handed_in_with_minus_one_drops() -> None:
    _moe_matches(_HANDED_IN, True, _HANDED_RUN)


@pytest.mark.parametrize("code", [_WHERE, _ONE_HOT, _opaque(_WHERE), _WHERE.replace(*_COPY[:2]).replace(*_COPY[2:])],
                         ids=["gate_as_wide_as_the_loop", "one_hot_of_E_classes", "opaque_gate_as_wide", "ids_cloned"])
def test_ids_proven_to_name_an_expert_keep_the_fused_text(code: str) -> None:
    # top-k over nn.Linear(d, n) with the loop over range(self.n) (self.n = n): every id is in [0, n); a one-hot of
    # n classes raises on any other id. No mask is added (the fused text is the one before s44)
    _moe_matches(code, ids_masked=False)


@pytest.mark.parametrize("changes", [
    # near misses of the proof: the ids are changed in place / rebound after the top-k, the gate is wider than the loop
    _COPY + ("        sel = top.clone()\n", "        sel = top.clone()\n        sel[w < 0.1] = -1\n"),
    _COPY + ("        sel = top.clone()\n", "        sel = top.clone()\n        sel.masked_fill_(w < 0.1, -1)\n"),
    ("        out = torch.zeros_like(x)\n", "        out = torch.zeros_like(x)\n        sel = torch.where(w < 0.1, -1, sel)\n"),
    ("nn.Linear(d, n, bias=False)", "nn.Linear(d, self.n + 1, bias=False)"),
    ("self.n, self.k = n, k", "self.n, self.k = n - 1, k"),
], ids=["index_write", "masked_fill_", "rebound_by_where", "gate_self_n_plus_one", "loop_bound_set_to_fewer"])
def test_ids_not_proven_are_masked_at_run_time(changes: tuple[str, ...]) -> None:
    code = _WHERE
    for old, new in zip(changes[::2], changes[1::2]):
        assert old in code
        code = code.replace(old, new)
    _moe_matches(code, ids_masked=True)


# -- 2. flat routing with -1 ids ------------------------------------------------------------------------------------

_FLAT_DROPS = _moe('''\
        w, idx = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        flat = idx.view(-1)
        flat = torch.where(w.view(-1) > 0.25, flat, -1)
        xr = x.repeat_interleave(self.k, dim=0)
        y = torch.zeros_like(xr)
        for i, expert in enumerate(self.experts):
            y[flat == i] = expert(xr[flat == i])
        return (y.view(*w.shape, -1) * w.unsqueeze(-1)).sum(dim=1)
''')
_FLAT_PLAIN = _FLAT_DROPS.replace("        flat = torch.where(w.view(-1) > 0.25, flat, -1)\n", "")


@pytest.mark.parametrize("code", [_FLAT_DROPS, _opaque(_FLAT_DROPS)], ids=["grouped_matmul", "experts_as_they_are"])
def test_flat_routing_minus_one_ids_are_skipped_not_permuted(code: str) -> None:
    # npu_moe_token_permute raised on the -1 ids (values in [0, 16777215)); the loop leaves those rows zero
    _moe_matches(code, ids_masked=True)


def test_flat_routing_of_plain_top_k_ids_keeps_the_fused_text() -> None:
    _moe_matches(_FLAT_PLAIN, ids_masked=False)


# -- 3. masks broadcast over the keys -------------------------------------------------------------------------------

_ATTN = '''
import math
import torch
import torch.nn.functional as F
from torch import nn


class Attn(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.n, self.hd = n, d // n
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)

    def forward(self, x, keep):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n, self.hd).permute(2, 0, 3, 1, 4)
{body}
        return self.o(out.transpose(1, 2).reshape(b, s, -1))
'''
_EAGER = '''\
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.hd)
        scores = scores.masked_fill(~keep[{index}], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v)'''
_SDPA = "        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[{index}])"
# every query row keeps its keys here (a padded query row masked whole is NaN in the original and not compared)
_ATTN_RUN = ("m = Attn(32, 4)\nx = torch.randn(2, 6, 32, requires_grad=True)\nkeep = torch.ones(2, 6, dtype=torch.bool)\n"
             "keep[1, 4:] = {value}\nout = m(x, keep)\nleaves = [x, m.qkv.weight]\n")


@pytest.mark.parametrize("pattern,body", [(AttentionPattern(), _EAGER), (SdpaPattern(), _SDPA)], ids=["attention", "sdpa"])
@pytest.mark.parametrize("index,value", [(":, None, :, None", "True"), (":, None, None, :", "False")],
                         ids=["query_rows_over_the_keys", "key_padding_over_the_rows"])
def test_mask_broadcast_over_the_keys_is_expanded(pattern, body: str, index: str, value: str) -> None:
    # [B, 1, Sq, 1] reached npu_fusion_attention as it was: "atten_mask shape [2, 1, 6, 1] not supported"; the
    # [B, 1, 1, Skv] key padding (expanded over the rows before s44 already) is the twin
    code = _ATTN.format(body=body.format(index=index))
    findings = _fused(pattern, code)
    _close(check_rewrite_runs(pattern, code, _ATTN_RUN.format(value=value), findings))


def test_folded_heads_mask_is_expanded_over_the_keys_too() -> None:
    # heads in the batch, several terms: the combined [B*N | 1, 1, Sq, 1 | Skv] mask to the full [.., Sq, Skv]
    lines = _attention_audit40.rows_lines(False, "q.shape[1]", "k.shape[1]")
    assert "_npufuse_mask.shape[3] != k.shape[1]" in lines[0]
    assert lines[1].strip() == "_npufuse_mask = _npufuse_mask.expand(-1, -1, q.shape[1], k.shape[1]).contiguous()"
