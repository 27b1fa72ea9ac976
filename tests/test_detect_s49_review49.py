"""s49 review49: correctness review of the s49 detection classes (moe49, mask49, ho26moe, ho26misc).

a. Per-expert nn.Linear experts stacked for the grouped matmul, in a loop that skips experts without tokens: the
   stack gives an untouched expert a ZERO gradient where the loop left its .grad None (optimizers then apply weight
   decay / momentum to it): a risk line says so.
b. The token-wise proof of per-sample routed / masked dense experts (called as they are on [m, H] token rows where the
   loop gave [n, T, H] samples): ``nn.LayerNorm(shape)`` with ``shape`` a name (``[T, H]`` normalises over the tokens)
   and ``h * self.scale`` with ``self.scale`` a plain ``__init__`` argument (a [T, 1] tensor scales per position) were
   read as token-wise; the fused layer then crashed (or, where the sizes line up, computes something else). Now the
   LayerNorm size must be shown an int (a constant, a size nn.Linear is given, an int __init__ argument) and a scalar
   attribute a number (a constant, or an __init__ argument annotated int / float or with a numeric default).
c. ``out[tok] += y`` over ``tok, slot = torch.where(ids == e)`` pairs (also s49d's sorted dispatch, read as that loop)
   is index_put without accumulate: a token listing expert e in two slots is written once where the fused permute
   adds both (sampled routing: cos 0.96). Where ``ids`` is not read as a last-dim topk's indices a risk line says so.
"""

from __future__ import annotations

import test_detect_s49_moe49 as moe49
from pattern_harness import check_rewrite_runs, detect_all, fused_and_runs as _fused_and_runs, near_miss_says as _near_miss

from npufuse.patterns.moe_experts import MoeExperts

# -- a. zero gradient of an expert without tokens -----------------------------------------------------------------------

_SKIP_EMPTY = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = nn.Linear(d, h, bias=False)
        self.w3 = nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Moe(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.k = k
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([Expert(d, h) for _ in range(n)])

    def forward(self, x):
        w, idx = torch.topk(self.gate(x).softmax(-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            out[tok] += self.experts[e](x[tok]) * w[tok, slot, None]
        return out
'''

_SKIP_EMPTY_RUN = '''
torch.manual_seed(0)
m = Moe(8, 16, 6, 1)
with torch.no_grad():
    m.gate.weight.zero_()
    m.gate.weight[0] += 1.0
x = torch.randn(5, 8, requires_grad=True)
out = m(x)
leaves = [x, m.experts[0].w1.weight, m.experts[5].w1.weight]
'''


def test_unhit_expert_zero_gradient_is_a_risk() -> None:
    findings, _ = detect_all(MoeExperts(), _SKIP_EMPTY)
    assert len(findings) == 1
    facts = check_rewrite_runs(MoeExperts(), _SKIP_EMPTY, _SKIP_EMPTY_RUN, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"][:2]) > 0.9999
    # the fact the risk states: the loop leaves the unhit expert's grad None, the fused layer gives zeros
    assert facts["cos_grad"][2] == 0.0
    assert any("ZERO gradient" in r.detail and "None" in r.detail for r in findings[0].risks)


# -- b. the token-wise proof of experts called as they are --------------------------------------------------------------

_BASE = moe49._WHERE_PAIRS


def _ln(size_arg: str, call_arg: str) -> str:
    return (_BASE.replace("def __init__(self, dim, hidden, p=0.0):", "def __init__(self, dim, hidden, p=0.0, norm_shape=None):")
            .replace("self.drop = nn.Dropout(p)", f"self.drop = nn.Dropout(p)\n        self.norm = nn.LayerNorm({size_arg})")
            .replace("return self.fc_out(self.drop(F.gelu(self.fc_in(h))))",
                     "return self.fc_out(self.drop(F.gelu(self.fc_in(self.norm(h)))))")
            .replace("FeedForwardExpert(dim, hidden) for", f"FeedForwardExpert(dim, hidden, 0.0, {call_arg}) for"))


def _scaled(param: str, call_arg: str) -> str:
    return (_BASE.replace("def __init__(self, dim, hidden, p=0.0):", f"def __init__(self, dim, hidden, p, {param}):")
            .replace("self.drop = nn.Dropout(p)", "self.drop = nn.Dropout(p)\n        self.pos_scale = pos_scale")
            .replace("return self.fc_out(self.drop(F.gelu(self.fc_in(h))))",
                     "return self.fc_out(self.drop(F.gelu(self.fc_in(h * self.pos_scale))))")
            .replace("FeedForwardExpert(dim, hidden) for", f"FeedForwardExpert(dim, hidden, 0.0, {call_arg}) for"))


def test_layernorm_over_a_named_shape_is_not_tokenwise() -> None:
    # [5, dim]: the norm over the sample's 5 tokens; the rewrite gave it [25, 16] rows and raised
    _near_miss(MoeExperts(), _ln("norm_shape", "[5, dim]"), "`self.norm`, which is not an nn.Linear")


def test_tensor_attribute_scale_is_not_tokenwise() -> None:
    # a [T, 1] per-position scale handed to __init__: [n, T, H] * [T, 1] in the loop, [m, H] * [T, 1] in the rewrite
    _near_miss(MoeExperts(), _scaled("pos_scale", "torch.linspace(0.5, 1.5, 5)[:, None]"), "compute each token on its own")


def test_tokenwise_twins_still_fused() -> None:
    # LayerNorm over a size nn.Linear is given, and a scale annotated float: token-wise, fused and equal
    _fused_and_runs(MoeExperts(), _ln("dim", "None"), moe49._WHERE_PAIRS_RUN, "SequenceRoutedMoE.forward")
    _fused_and_runs(MoeExperts(), _scaled("pos_scale: float", "0.5"), moe49._WHERE_PAIRS_RUN, "SequenceRoutedMoE.forward")


# -- c. indexed `+=` with ids not shown distinct per row --------------------------------------------------------------------

_SAMPLED = moe49._SORTED_OFFSETS.replace(
    "gate_w, expert_ids = probs.topk(self.top_k, dim=-1)",
    "expert_ids = torch.multinomial(probs, self.top_k, replacement=True)\n        gate_w = probs.gather(-1, expert_ids)")


def test_indexed_put_with_sampled_ids_has_a_risk() -> None:
    findings, _ = detect_all(MoeExperts(), _SAMPLED)
    assert len(findings) == 1
    facts = check_rewrite_runs(MoeExperts(), _SAMPLED, moe49._SORTED_OFFSETS_RUN, findings)
    # s50 gaps50: the ids' rows are checked distinct at run time; a token listed twice runs the original loop
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.99999, facts
    assert any("index_put" in r.detail and "expert_ids" in r.detail for r in findings[0].risks)


def test_indexed_put_with_topk_ids_has_no_such_risk() -> None:
    findings, _ = detect_all(MoeExperts(), moe49._SORTED_OFFSETS)
    assert len(findings) == 1 and not any("index_put" in r.detail for r in findings[0].risks)
