"""s26 glu (issue 14): the shared example selector, and the value facts the swiglu/geglu
mechanisms rest on (which tensors are fresh temporaries; which products are rewritten with a
run-time shape check). The s26_* examples themselves run in tests/test_patterns.py."""

from __future__ import annotations

import ast

import pytest

from npufuse.patterns import swiglu as W
from npufuse.patterns.geglu import Geglu
from npufuse.patterns.swiglu import Swiglu
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import check_rewrite_runs, detect_all, example_cases

_PATTERNS = (Swiglu(), Geglu())


def test_example_cases_selects_by_prefix_and_kind() -> None:
    fuse = example_cases(_PATTERNS, "s26_", "fuse")
    run = example_cases(_PATTERNS, "s26_", "run")
    keep = example_cases(_PATTERNS, "s26_", "keep")
    assert fuse and keep and run
    assert all(c.values[1].name.startswith("s26_") for c in fuse + keep)
    assert {c.values[1].name for c in run} <= {c.values[1].name for c in fuse}
    assert all(c.values[1].run for c in run)
    every = example_cases(_PATTERNS, kind="fuse")
    assert len(every) == sum(len(p.FUSE) for p in _PATTERNS) > len(fuse)
    with pytest.raises(ValueError):
        example_cases(_PATTERNS, "s26_", "fused")


@pytest.mark.parametrize("src,fresh", [
    ("self.w1(x)", True),
    ("F.silu(self.w1(x), inplace=True)", True),
    ("F.silu(h, inplace=True)", False),  # returns h itself
    ("h.view(2, -1)", False),
    ("self.w1(x).view(2, -1)", True),
    ("torch.relu_(h)", False),
    ("h", False),
    ("self.h", False),
    ("a * b", True),
])
def test_fresh_tensor(src: str, fresh: bool) -> None:
    module = ModuleInfo.from_source("m.py", "import torch\nimport torch.nn.functional as F\n")
    assert W._fresh_tensor(module, ast.parse(src, mode="eval").body) is fresh


def test_inplace_silu_on_a_named_tensor_read_later_was_a_wrong_rewrite() -> None:
    """The refused case is a real difference: rewriting it (as the scan did before) changes the
    value the later read sees."""
    ex = next(e for e in Swiglu.KEEP if e.name == "s26_inplace_silu_on_a_tensor_read_later")
    findings, misses = detect_all(Swiglu(), ex.code)
    assert not findings and any("in-place activation on `g`" in m.reason for m in misses)


def test_conditional_gate_is_shape_checked_after_the_kept_statements() -> None:
    ex = next(e for e in Swiglu.FUSE if e.name == "s26_glu_ffn_with_optional_sparsity_and_dropout")
    findings, _ = detect_all(Swiglu(), ex.code)
    fused = findings[0].fused.splitlines()
    assert fused[0] == "seqs = self.inner_proj(seqs)"
    assert fused[1] == "if gate.shape == seqs.shape:"
    assert sum("self.inner_proj(" in ln for ln in fused) == 1  # the up projection runs once on every path
    facts = check_rewrite_runs(Swiglu(), ex.code, ex.run, findings)
    assert facts["all_calls"].get("npu_swiglu", 0) >= 2 and facts["all_calls"].get("npu_geglu", 0) >= 1
    assert min(facts["cos_out"]) >= 0.9999


def test_sigmoid_default_is_a_near_miss_not_a_candidate() -> None:
    ex = next(e for e in Swiglu.KEEP if e.name == "s26_caller_activation_or_sigmoid_default_in_branches")
    findings, misses = detect_all(Swiglu(), ex.code)
    assert not findings
    assert any("defaults to sigmoid" in m.reason for m in misses)
    # the same layer with a SiLU default is a candidate whose default decides the pattern
    ok = next(e for e in Swiglu.FUSE if e.name == "s26_caller_activation_or_silu_default_in_branches")
    assert detect_all(Swiglu(), ok.code)[0][0].params["default_activation"] == "silu"
