"""s41 (helper sweep41): classes of misses found on the s41 recall sweep (development data
``bench/detect_labels_sweep41.json``, labelled before the scan). Invented spellings of each class:
a Fuse (found, the rewrite run under the emulator against the original) and a Keep (no candidate,
a true reason) per class.

1. add + RMSNorm whose inline sum is written on the line after the norm call's parenthesis (a formatter's
   ``h = rms_norm(\\n    h + self.attn(h),\\n    variance_epsilon=eps,\\n)``) or whose first operand is a call
   (``rms_norm(self.mlp(h) + h, eps)``): the textual gate of the inline-sum reader wanted the ``+`` on the call's
   own line before any parenthesis, so the block was not read at all.
2. eager attention whose intermediates (a length, the probabilities) are read after the softmax only inside
   ``if self.<flag>:`` arms (ToonCrafter's relative-position terms ``if self.relative_position: len_q = ...`` before
   and ``if self.relative_position: out += einsum(sim, v2(len_q, ...))`` after): only the probabilities were read
   that way, a length read after gave "intermediate `len_q` is used after the attention". Now the fused call runs
   where the flag is off, the original where it is on."""

from __future__ import annotations

import pytest

from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.add_rms_norm import _S31_POST_NORM_HELPER, AddRmsNorm
from npufuse.patterns.attention import AttentionPattern


def _close(facts: dict) -> None:
    assert facts["n_out"][0] == facts["n_out"][1]
    assert all(c > 0.99999 for c in facts["cos_out"]), facts["cos_out"]
    assert all(c > 0.99999 for c in facts["cos_grad"]), facts["cos_grad"]


# -- 1. the inline sum of a norm call split over lines ------------------------------------------------------------

# s31's post-norm block (HRM) with its forward's two norm lines replaced by the spelling under test
_S31_BODY = (
    "        hidden_states = rms_norm(hidden_states + self.self_attn(hidden_states), variance_epsilon=self.norm_eps)\n"
    "        hidden_states = rms_norm(self.mlp(hidden_states) + hidden_states, variance_epsilon=self.norm_eps)\n"
)
assert _S31_BODY in _S31_POST_NORM_HELPER
_POST_NORM = _S31_POST_NORM_HELPER.replace(_S31_BODY, "{body}\n")

_SPLIT_SUMS = {
    # the sum alone on the line after the parenthesis, eps as a keyword on the next
    "sum_on_the_next_line": ("        hidden_states = rms_norm(\n            hidden_states + self.self_attn(hidden_states),\n"
                             "            variance_epsilon=self.norm_eps,\n        )", 25),
    # the operator opening the following line, after a call
    "plus_opening_the_next_line": ("        hidden_states = rms_norm(\n            self.mlp(hidden_states)\n            + hidden_states,\n"
                                   "            self.norm_eps,\n        )", 26),
    # one line, the sublayer's call before the ``+`` (the gate stopped at the first parenthesis)
    "call_before_the_plus": ("        hidden_states = rms_norm(self.mlp(self.self_attn(hidden_states).relu()) + hidden_states, self.norm_eps)", 22),
}

_RUN = '''
blk = Block(16)
x = torch.randn(2, 3, 16, requires_grad=True)
out = blk(x)
leaves = [x, blk.self_attn.weight, blk.mlp.weight]
'''


@pytest.mark.parametrize("name", list(_SPLIT_SUMS), ids=list(_SPLIT_SUMS))
def test_inline_sum_split_over_lines_is_found_and_runs(name: str) -> None:
    body, end = _SPLIT_SUMS[name]
    code = _POST_NORM.format(body=body)
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [(f.qualname, f.line, f.end_line) for f in findings] == [("Block.forward", 22, end)], misses
    facts = check_rewrite_runs(AddRmsNorm(), code, _RUN, findings)
    assert facts["all_calls"].get("npu_rms_norm"), facts["all_calls"]
    _close(facts)


def test_inline_sum_split_over_lines_into_a_mean_subtracting_helper_is_a_near_miss() -> None:
    # near miss: the helper subtracts the mean (a LayerNorm under another name): no candidate, the reason says so
    code = _POST_NORM.format(body=_SPLIT_SUMS["sum_on_the_next_line"][0]).replace(
        "    variance = hidden_states.square()",
        "    hidden_states = hidden_states - hidden_states.mean(-1, keepdim=True)\n    variance = hidden_states.square()")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert not findings
    assert any("is not RMSNorm" in m.reason for m in misses if m.qualname == "Block.forward"), [m.reason for m in misses]


def test_a_call_split_over_lines_without_a_sum_is_no_add_site() -> None:
    # near miss: a product, not a residual sum, split the same way: nothing for add_rms_norm
    code = _POST_NORM.format(body=_SPLIT_SUMS["sum_on_the_next_line"][0].replace("hidden_states + self.self_attn(", "hidden_states * self.self_attn("))
    findings, _ = detect_all(AddRmsNorm(), code)
    assert not findings


# -- 2. intermediates read after the attention only under the flag that also adds a term before it ----------------

_REL_POS = '''
import torch
from torch import nn


class RelativePosition(nn.Module):
    def __init__(self, units, max_rel):
        super().__init__()
        self.max_rel = max_rel
        self.table = nn.Parameter(torch.randn(2 * max_rel + 1, units) * 0.1)

    def forward(self, len_q, len_k):
        d = torch.arange(len_k)[None, :] - torch.arange(len_q)[:, None]
        return self.table[(d.clamp(-self.max_rel, self.max_rel) + self.max_rel).long()]


class TemporalAttention(nn.Module):
    def __init__(self, dim, heads=2, dim_head=8, relative_position=False, max_rel=4):
        super().__init__()
        inner = heads * dim_head
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.Linear(inner, dim)
        self.relative_position = relative_position
        if relative_position:
            self.rel_k = RelativePosition(dim_head, max_rel)
            self.rel_v = RelativePosition(dim_head, max_rel)

    def forward(self, x):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = (t.reshape(b, n, h, -1).transpose(1, 2).reshape(b * h, n, -1) for t in (self.to_q(x), self.to_k(x), self.to_v(x)))
        sim = torch.einsum("b i d, b j d -> b i j", q, k) * self.scale
        if self.relative_position:
            len_q, len_k = q.shape[1], k.shape[1]
            sim = sim + torch.einsum("b t d, t s d -> b t s", q, self.rel_k(len_q, len_k)) * self.scale
        sim = sim.softmax(dim=-1)
        out = torch.einsum("b i j, b j d -> b i d", sim, v)
        if self.relative_position:
            out = out + torch.einsum("b t s, t s d -> b t d", sim, self.rel_v(len_q, len_k))
        out = out.reshape(b, h, n, -1).transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)
'''

_REL_RUN = '''
plain, rel = TemporalAttention(16), TemporalAttention(16, relative_position=True)
x = torch.randn(2, 6, 16, requires_grad=True)
out = (plain(x), rel(x))
leaves = [x, plain.to_q.weight, rel.to_q.weight, rel.rel_v.table]
'''


def test_intermediates_read_after_the_attention_under_its_flag_fuse_where_the_flag_is_off() -> None:
    findings, misses = detect_all(AttentionPattern(), _REL_POS)
    assert [f.qualname for f in findings] == ["TemporalAttention.forward"], [m.reason for m in misses]
    assert findings[0].fused.startswith("if (not self.relative_position) and"), findings[0].fused
    facts = check_rewrite_runs(AttentionPattern(), _REL_POS, _REL_RUN, findings)
    assert facts["all_calls"].get("npu_fusion_attention") == 1, facts["all_calls"]  # the plain module only
    _close(facts)


def test_probabilities_read_after_the_attention_outside_the_flag_stay_a_near_miss() -> None:
    # near miss: besides the flag's arm, the probabilities are kept on the module unconditionally: the fused call
    # does not produce them, whatever the flag
    code = _REL_POS.replace("        return self.to_out(out)", "        self.attn_map = sim.detach()\n        return self.to_out(out)")
    findings, misses = detect_all(AttentionPattern(), code)
    assert not findings
    assert any("sim" in m.reason and "after the attention" in m.reason for m in misses), [m.reason for m in misses]


def test_an_intermediate_read_under_a_flag_the_function_sets_stays_a_near_miss() -> None:
    # near miss: the flag is a local the function computes (not an attribute or an untouched parameter): its value
    # at the later read is not known before the site
    code = _REL_POS.replace("    def forward(self, x):\n", "    def forward(self, x):\n        use_rel = self.relative_position and x.shape[1] > 1\n")
    code = code.replace("if self.relative_position:", "if use_rel:")
    findings, misses = detect_all(AttentionPattern(), code)
    assert not findings, findings[0].fused
    assert any("is used after the attention" in m.reason or "used after the attention" in m.reason for m in misses), [m.reason for m in misses]
