"""A site in the ``else`` of an NPU branch is left alone ("already has a torch_npu branch"); a site
in the ``else`` of any other ``if`` is not: the test must name NPU as a word, not hold the letters
n-p-u inside another word (``adaln_input``, ``input_ids``), which refused real add+norm sites."""

from __future__ import annotations

import pytest

from npufuse.patterns.registry import get_pattern
from pattern_harness import detect_all

BLOCK = """
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)
        self.attention = nn.Linear(dim, dim)
        self.feed_forward = nn.Linear(dim, dim)

    def forward(self, x, {arg}):
        if {test}:
            out = x
        else:
            h = x + self.attention(self.attention_norm(x))
            out = h + self.feed_forward(self.ffn_norm(h))
        return out
"""


@pytest.mark.parametrize("arg,test", [("adaln_input", "adaln_input is not None"), ("input_ids", "input_ids is None")])
def test_letters_npu_inside_a_word_are_no_npu_branch(arg: str, test: str) -> None:
    found, near = detect_all(get_pattern("add_rms_norm"), BLOCK.format(arg=arg, test=test))
    assert found, [n.reason for n in near]
    assert not any("torch_npu branch" in n.reason for n in near)


@pytest.mark.parametrize("arg,test", [("on_npu", "on_npu"), ("device", 'device.type == "npu"'),
                                      ("flag", "torch_npu is not None and flag")])
def test_an_npu_branch_still_leaves_its_fallback_alone(arg: str, test: str) -> None:
    found, near = detect_all(get_pattern("add_rms_norm"), BLOCK.format(arg=arg, test=test))
    assert not found
    assert any("already has a torch_npu branch" in n.reason for n in near), [n.reason for n in near]
