"""s41 (helper sweep41): classes of misses found on the s41 recall sweep (development data
``bench/detect_labels_sweep41.json``, labelled before the scan). Invented spellings of each class:
a Fuse (found, the rewrite run under the emulator against the original) and a Keep (no candidate,
a true reason) per class.

1. add + RMSNorm whose inline sum is written on the line after the norm call's parenthesis (a formatter's
   ``h = rms_norm(\\n    h + self.attn(h),\\n    variance_epsilon=eps,\\n)``) or whose first operand is a call
   (``rms_norm(self.mlp(h) + h, eps)``): the textual gate of the inline-sum reader wanted the ``+`` on the call's
   own line before any parenthesis, so the block was not read at all."""

from __future__ import annotations

import pytest

from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.add_rms_norm import AddRmsNorm


def _close(facts: dict) -> None:
    assert facts["n_out"][0] == facts["n_out"][1]
    assert all(c > 0.99999 for c in facts["cos_out"]), facts["cos_out"]
    assert all(c > 0.99999 for c in facts["cos_grad"]), facts["cos_grad"]


# -- 1. the inline sum of a norm call split over lines ------------------------------------------------------------

_POST_NORM = '''
import torch
from torch import nn


def rms_norm(hidden_states, variance_epsilon):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.square().mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + variance_epsilon)
    return hidden_states.to(input_dtype)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.norm_eps = 1e-5

    def forward(self, h):
{body}
        return h
'''

_SPLIT_SUMS = {
    # the sum alone on the line after the parenthesis, eps as a keyword on the next
    "sum_on_the_next_line": ("        h = rms_norm(\n            h + self.attn(h),\n            variance_epsilon=self.norm_eps,\n        )", 25),
    # the operator opening the following line, after a call
    "plus_opening_the_next_line": ("        h = rms_norm(\n            self.mlp(h)\n            + h,\n            self.norm_eps,\n        )", 26),
    # one line, the sublayer's call before the ``+`` (the gate stopped at the first parenthesis)
    "call_before_the_plus": ("        h = rms_norm(self.mlp(self.attn(h).relu()) + h, self.norm_eps)", 22),
}

_RUN = '''
blk = Block(16)
x = torch.randn(2, 3, 16, requires_grad=True)
out = blk(x)
leaves = [x, blk.attn.weight, blk.mlp.weight]
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
    code = _POST_NORM.format(body=_SPLIT_SUMS["sum_on_the_next_line"][0].replace("h + self.attn(h)", "h * self.attn(h)"))
    findings, _ = detect_all(AddRmsNorm(), code)
    assert not findings
