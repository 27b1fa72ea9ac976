"""s26 attention: values folded from their spelling (canonical.folded_number), and the mask fill judged by value."""

from __future__ import annotations

import ast

import pytest

from npufuse.scan.canonical import folded_number
from npufuse.scan.dataflow import ModuleInfo

_MODULE = ModuleInfo.from_source("m.py", "import math\nimport numpy as np\nimport torch as th\n")


@pytest.mark.parametrize("text, value", [
    ('float("-1e20")', -1e20),
    ("float('-inf')", float("-inf")),
    ("-1e9", -1e9),
    ("-10 ** 9", -(10 ** 9)),
    ("-1 * float('inf')", float("-inf")),
    ("-math.inf", float("-inf")),
    ("-np.inf", float("-inf")),
    ("-th.inf", float("-inf")),
    ("float(-65504)", -65504.0),
    ("int(-1e4)", -10000),
    ("2 ** -0.5", 2 ** -0.5),
])
def test_folded_number_reads_the_value_not_the_spelling(text: str, value: float) -> None:
    assert folded_number(_MODULE, ast.parse(text, mode="eval").body) == value


@pytest.mark.parametrize("text", ["x", "float(x)", "torch.finfo(t.dtype).min", "float('abc')", "10 ** 10 ** 10", "1 / 0", "-mask"])
def test_folded_number_refuses_what_is_not_a_literal_value(text: str) -> None:
    assert folded_number(_MODULE, ast.parse(text, mode="eval").body) is None


def test_module_call_counts_keep_first_seen_order_across_branches() -> None:
    # the near-miss text names the first call counted; a set union ordered these by the hash seed, so the
    # reported call changed between runs (transformers' luke). First-seen order is the same in every run.
    from npufuse.patterns.base import _module_calls

    calls = [f"self.m{i}(x)" for i in range(8)]
    body = "\n".join(f"    y = {c}" for c in calls[:4])
    orelse = "\n".join(f"    y = {c}" for c in calls[4:])
    stmts = ast.parse(f"if flag:\n{body}\nelse:\n{orelse}\n").body
    assert list(_module_calls(stmts)) == calls


def test_fill_below_fp16_range_is_fused_with_a_true_note() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from pattern_harness import detect_all

    from npufuse.patterns.attention import _FOLDED_FILL, AttentionPattern

    findings, _ = detect_all(AttentionPattern(), _FOLDED_FILL)
    assert findings, "float('-1e20') is a large negative fill"
    notes = " ".join(findings[0].notes)
    assert "below fp16's range" in notes and "not pinned down" in notes
    # a fill inside fp16's range gets no overflow note
    findings, _ = detect_all(AttentionPattern(), _FOLDED_FILL.replace('float("-1e20")', "-1e4"))
    assert findings and "below fp16's range" not in " ".join(findings[0].notes)


def test_module_constant_is_the_single_top_level_binding_only() -> None:
    from npufuse.scan.canonical import module_constant

    m = ModuleInfo.from_source("c.py", "A = -1e9\nB = 1\nB = 2\nif x:\n    C = 3\nD: float = -5.0\n\ndef f():\n    global E\n    E = 1\nE = -1\n")
    assert folded_number(m, module_constant(m, "A")) == -1e9
    assert module_constant(m, "B") is None  # bound twice
    assert module_constant(m, "C") is None  # bound under an if
    assert folded_number(m, module_constant(m, "D")) == -5.0
    assert module_constant(m, "E") is None  # rebound through `global`
    assert module_constant(m, "f") is None


def test_split_pipeline_near_miss_needs_a_qk_shaped_product_in_the_caller() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from pattern_harness import detect_all

    from npufuse.patterns.attention import _SPLIT_PIPELINE, AttentionPattern

    _, misses = detect_all(AttentionPattern(), _SPLIT_PIPELINE)
    assert any("reach this softmax and P@V as parameter `logits`" in m.reason for m in misses)
    # a categorical mean over bins: the caller's product projects onto a weight, it is no Q@Kᵀ
    code = '''
import torch


def categorical_mean(logits, centers):
    return logits.softmax(-1) @ centers


def head(x, w, centers):
    logits = torch.einsum("...c,...cb->...b", x, w)
    return categorical_mean(logits, centers)
'''
    _, misses = detect_all(AttentionPattern(), code)
    assert not any("reach this softmax" in m.reason for m in misses)
