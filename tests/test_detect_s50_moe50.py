"""s50 (moe50): the canonical per-(token, slot) loop reader (``_moe_s50c``): loops over the token dims of the
routing ids (and the top-k slot) that call ``experts[ids[pair]]`` on one token's row and add the weighted result
into that token's row are read as the where loop they equal, so the where-loop analysis fuses them. Invented
reproducers of the HO26a / sweep50moe classes (nested B, S, K loops with ``.item()`` ids and unsqueezed rows; a
per-token top-1 ``out[i] = experts[c](x[i])`` loop; a [T, K] nest with an unsqueezed row), their guards, and twins.
"""

from __future__ import annotations

import torch
from pattern_harness import check_rewrite_runs, detect_all, fused_and_runs, near_miss_says

from npufuse.patterns.moe_experts import MoeExperts

_HEAD = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F
'''

# -- nested token loops, slot loop, `.item()` ids, per-pair names, unsqueezed row, squeezed result --------------------

_NESTED = _HEAD + '''

class PairLoopMoe(nn.Module):
    def __init__(self, d, n, k):
        super().__init__()
        self.k = k
        self.scorer = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(n)])

    def forward(self, h):
        top_v, top_i = torch.topk(self.scorer(h), self.k, dim=-1)
        gates = F.softmax(top_v, dim=-1)
        mixed = torch.zeros_like(h)
        nb, nt, _ = h.shape
        for bi in range(nb):
            for ti in range(nt):
                for slot in range(self.k):
                    which = top_i[bi, ti, slot].item()
                    g = gates[bi, ti, slot]
                    one = h[bi, ti].unsqueeze(0)
                    res = self.experts[which](one)
                    mixed[bi, ti] += g * res.squeeze(0)
        return h + mixed
'''

_NESTED_RUN = '''
torch.manual_seed(0)
m = PairLoopMoe(12, 5, 2)
h = torch.randn(2, 6, 12, requires_grad=True)
out = m(h)
leaves = [h, m.scorer.weight, m.experts[0][0].weight, m.experts[4][2].bias]
'''


def test_nested_token_slot_loops_with_item_ids_fused_and_exact() -> None:
    facts = fused_and_runs(MoeExperts(), _NESTED, _NESTED_RUN, "PairLoopMoe.forward")
    assert facts["all_calls"].get("npu_moe_token_permute") == 1
    assert facts["all_calls"].get("npu_moe_token_unpermute") == 1


def test_nested_token_slot_loops_bf16() -> None:
    run = _NESTED_RUN.replace("m = PairLoopMoe(12, 5, 2)", "m = PairLoopMoe(12, 5, 2).to(torch.bfloat16)") \
        .replace("requires_grad=True", "dtype=torch.bfloat16, requires_grad=True")
    findings, _ = detect_all(MoeExperts(), _NESTED)
    facts = check_rewrite_runs(MoeExperts(), _NESTED, run, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.999 and min(facts["cos_grad"]) > 0.99, facts


def test_nested_loops_guard_shapes() -> None:
    findings, _ = detect_all(MoeExperts(), _NESTED)
    facts = check_rewrite_runs(MoeExperts(), _NESTED, _NESTED_RUN, findings)
    assert "tuple(top_i.shape) == (nb, nt, self.k,)" in facts["rewritten"]
    assert "h.dim() == 3 and tuple(h.shape[:2]) == (nb, nt,)" in facts["rewritten"]


# -- per-token top-1 loop: `out[i] = experts[c](x[i])` with argmax ids ------------------------------------------------

_TOP1 = _HEAD + '''

class TokenwiseSwitch(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.gate = nn.Linear(d, n)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, 3 * d), nn.ReLU(), nn.Linear(3 * d, d)) for _ in range(n)])

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        pick = probs.argmax(dim=-1)
        y = torch.zeros_like(x)
        for r in range(x.shape[0]):
            c = int(pick[r])
            y[r] = self.experts[c](x[r])
        return y
'''

_TOP1_RUN = '''
torch.manual_seed(1)
m = TokenwiseSwitch(10, 4)
x = torch.randn(17, 10, requires_grad=True)
out = m(x)
leaves = [x, m.experts[0][0].weight, m.experts[3][2].bias]
'''


def test_per_token_top1_assignment_fused_and_exact() -> None:
    facts = fused_and_runs(MoeExperts(), _TOP1, _TOP1_RUN, "TokenwiseSwitch.forward")
    assert facts["all_calls"].get("npu_moe_token_unpermute") == 1


def test_per_token_top1_per_sample_ids_run_as_written() -> None:
    # [B] ids over [B, T, H] tokens: each "token" row is a whole sample; the guard sends it to the original
    code = _TOP1.replace("F.softmax(self.gate(x), dim=-1)", "F.softmax(self.gate(x.mean(dim=1)), dim=-1)")
    run = _TOP1_RUN.replace("torch.randn(17, 10", "torch.randn(3, 5, 10")
    findings, _ = detect_all(MoeExperts(), code)
    facts = check_rewrite_runs(MoeExperts(), code, run, findings)
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.9999999, facts


# -- [T, K] nest whose row is unsqueezed (the direct token-slot form refuses it), ids read as ids[t][k] ----------------

_TK = _HEAD + '''

class FlatPairs(nn.Module):
    def __init__(self, d, n, k):
        super().__init__()
        self.k = k
        self.route = nn.Linear(d, n)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])

    def forward(self, x):
        b, s, d = x.shape
        flat = x.view(b * s, d)
        w, ids = self.route(flat).topk(self.k, dim=-1)
        w = w.softmax(dim=-1)
        acc = torch.zeros_like(flat)
        for t in range(flat.size(0)):
            for j in range(self.k):
                acc[t] += self.experts[ids[t][j]](flat[t].unsqueeze(0)).squeeze(0) * w[t, j]
        return acc.view(b, s, d)
'''

_TK_RUN = '''
torch.manual_seed(2)
m = FlatPairs(8, 6, 3)
x = torch.randn(2, 5, 8, requires_grad=True)
out = m(x)
leaves = [x, m.route.weight, m.experts[1].weight]
'''


def test_token_slot_nest_with_unsqueezed_row_fused_and_exact() -> None:
    facts = fused_and_runs(MoeExperts(), _TK, _TK_RUN, "FlatPairs.forward")
    assert facts["all_calls"].get("npu_moe_token_permute") == 1


def test_partial_token_range_runs_as_written() -> None:
    # the loop covers only the first half of the tokens: the guard on the ids' shape fails, the original runs
    code = _TK.replace("for t in range(flat.size(0)):", "for t in range(flat.size(0) // 2):")
    findings, _ = detect_all(MoeExperts(), code)
    assert findings, "the form is read; its guard decides"
    facts = check_rewrite_runs(MoeExperts(), code, _TK_RUN, findings)
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.9999999, facts


# -- twins ---------------------------------------------------------------------------------------------------------------


def test_extra_per_pair_statement_not_read() -> None:
    # a per-pair count beside the combine: something else happens per pair, the reader does not take it
    code = _NESTED.replace("        mixed = torch.zeros_like(h)\n",
                           "        mixed = torch.zeros_like(h)\n        hits = [0] * len(self.experts)\n") \
        .replace("                    mixed[bi, ti] += g * res.squeeze(0)\n",
                 "                    hits[which] += 1\n                    mixed[bi, ti] += g * res.squeeze(0)\n") \
        .replace("        return h + mixed", "        return h + mixed, hits")
    findings, _ = detect_all(MoeExperts(), code)
    assert not findings


def test_host_weight_not_read() -> None:
    # `.item()` on the weight: a host float (no gradient to the router); not the routed weighting
    code = _NESTED.replace("g = gates[bi, ti, slot]", "g = gates[bi, ti, slot].item()")
    findings, _ = detect_all(MoeExperts(), code)
    assert not findings


def test_weighted_assignment_per_token_is_not_read_as_a_sum() -> None:
    # `=` with a slot loop keeps only the last slot's value: not the routed sum
    code = _TK.replace("acc[t] += self.experts", "acc[t] = self.experts")
    findings, _ = detect_all(MoeExperts(), code)
    assert not findings


def test_expert_on_other_token_is_a_near_miss_or_nothing() -> None:
    # the expert reads the NEXT token's row: not this token's expert output
    code = _TK.replace("(flat[t].unsqueeze(0))", "(flat[(t + 1) % flat.size(0)].unsqueeze(0))")
    findings, _ = detect_all(MoeExperts(), code)
    assert not findings


def test_row_mixing_expert_called_per_token_is_a_near_miss() -> None:
    # an expert mixing its rows (a mean over dim 0): on one [H] row the loop's call means over features, the fused
    # call on [n, H] over tokens; the reader needs the token-wise proof and says so
    code = _TOP1.replace(
        "self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, 3 * d), nn.ReLU(), nn.Linear(3 * d, d)) for _ in range(n)])",
        "self.experts = nn.ModuleList([Mixer(d) for _ in range(n)])").replace(
        "class TokenwiseSwitch", '''class Mixer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, v):
        return self.lin(v) - self.lin(v).mean(0)


class TokenwiseSwitch''')
    near_miss_says(MoeExperts(), code, "calls each expert on one token's row at a time")
