"""Review mends of the s25 detection passes: each test is a case the review reproduced."""

from __future__ import annotations

import textwrap

from npufuse.patterns.fused_optimizer import FusedOptimizer
from npufuse.patterns.rms_norm import RmsNorm
from npufuse.patterns.swiglu import Swiglu
from pattern_harness import detect_all

_GLU = '''
import torch
import torch.nn.functional as F
from torch import nn


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate = nn.Linear(c, c, bias=False)
        self.up = nn.Linear(c, c, bias=False)
        self.cache = []

    def forward(self, x):
        b = self.up(x)
        {between}
        {product}
        return b
'''


def _glu(between: str, product: str) -> list:
    code = _GLU.replace("{between}", between).replace("{product}", product)
    return detect_all(Swiglu(), textwrap.dedent(code))[0]


def test_in_place_product_of_a_fresh_tensor_is_fused() -> None:
    assert len(_glu("pass", "b *= F.silu(self.gate(x))")) == 1
    assert len(_glu("pass", "b.mul_(F.silu(self.gate(x)))")) == 1


def test_in_place_product_of_a_tensor_another_name_holds_is_not_rewritten() -> None:
    # the original multiplies the tensor `saved` / the cache also hold; `b = <fused>` would not
    for between in ("saved = b", "self.cache.append(b)"):
        assert _glu(between, "b *= F.silu(self.gate(x))") == []
        assert _glu(between, "b.mul_(F.silu(self.gate(x)))") == []


_NORM = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, skip_on_npu=False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.skip_on_npu = skip_on_npu

    def forward(self, hidden_states):
        if not (self.skip_on_npu and hidden_states.device.type == "npu"):
            input_dtype = hidden_states.dtype
            variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
            hidden_states = self.weight * hidden_states.to(input_dtype)
        return hidden_states
'''


def test_a_negated_test_with_a_flag_is_no_npu_branch() -> None:
    findings, misses = detect_all(RmsNorm(), _NORM)
    assert not any("torch_npu branch" in m.reason for m in misses)
    assert [f.line for f in findings] == [15]


_HOGWILD = '''
import torch
import torch.multiprocessing as mp
from torch import nn


def main():
    model = nn.Linear(8, 8)
    table = torch.randn(100, 8)
    {shared}.share_memory()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(table[:4]).sum().backward()
        opt.step()
'''


def test_share_memory_blocks_the_fused_optimizer_only_on_the_model() -> None:
    findings, misses = detect_all(FusedOptimizer(), _HOGWILD.replace("{shared}", "model"))
    assert not findings and any("share_memory()" in m.reason for m in misses)
    findings, misses = detect_all(FusedOptimizer(), _HOGWILD.replace("{shared}", "table"))
    assert [f.line for f in findings] == [11]
    assert not any("share_memory()" in m.reason for m in misses)


def test_the_aliased_in_place_product_says_why() -> None:
    code = textwrap.dedent(_GLU.replace("{between}", "saved = b").replace("{product}", "b *= F.silu(self.gate(x))"))
    findings, misses = detect_all(Swiglu(), code)
    assert not findings
    assert any("in-place product on `b`, which another statement reads before it (line 16)" in m.reason for m in misses)


def test_block_source_dedents_across_a_page_break_line() -> None:
    # a blank line holding a form feed between statements (the paged twin of a file): the span is
    # dedented like its plain twin, and the page break does not become a second blank line
    from npufuse.patterns._site import _dedent_lines

    assert _dedent_lines("        a = 1\n\x0c\n        b = 2\n") == "a = 1\n\nb = 2\n"
    assert _dedent_lines("    if x:\n        y()\n") == "if x:\n    y()\n"
