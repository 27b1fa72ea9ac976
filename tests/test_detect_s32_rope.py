"""s32 rope pass: the forms the examples in patterns/rope.py cannot run (einops is not a dependency),
and the pieces of the new mechanisms (rank-free pair merges, helper locals in split checks)."""

from __future__ import annotations

import ast
import sys
import types

import torch

from npufuse.patterns.rope import RopePattern, _einops_pairs_source, _helper_locals_inlined
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import check_rewrite_runs, detect_all

PATTERN = RopePattern()


def _fake_einops() -> types.ModuleType:
    """A stand-in for the two einops patterns the s32 example uses."""
    mod = types.ModuleType("einops")

    def rearrange(t: torch.Tensor, pattern: str, **sizes: int) -> torch.Tensor:
        compact = pattern.replace(" ", "")
        if compact == "...(dtwo)->...dtwo":
            return t.unflatten(-1, (-1, sizes["two"]))
        if compact == "...dtwo->...(dtwo)":
            return t.flatten(-2)
        raise NotImplementedError(pattern)

    mod.rearrange = rearrange  # type: ignore[attr-defined]
    return mod


def test_einops_complex_pairs_rewrite_to_the_same_numbers(monkeypatch):
    monkeypatch.setitem(sys.modules, "einops", _fake_einops())
    example = next(e for e in PATTERN.FUSE if e.name == "einops_pairs_complex_merged_later")
    findings, _ = detect_all(PATTERN, example.code)
    assert findings
    run = '''
x = torch.randn(2, 6, 3, 8, requires_grad=True)
out = rope(x, precompute(6, 8))
leaves = [x]
'''
    facts = check_rewrite_runs(PATTERN, example.code, run, findings)
    assert facts["calls"] >= 1, facts["all_calls"]
    assert all(a == b for a, b in facts["dtypes"]) and all(a == b for a, b in facts["shapes"])
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_einops_pairs_source_reads_only_the_lane_pairing():
    def src(pattern: str, kw: str = ", two=2") -> str | None:
        node = ast.parse(f'rearrange(x, "{pattern}"{kw})', mode="eval").body
        got = _einops_pairs_source(node)
        return ast.unparse(got) if got is not None else None

    assert src("... (d two) -> ... d two") == "x"
    assert src("b s h (d r) -> b s h d r", ", r=2") == "x"
    assert src("... (d 2) -> ... d 2", "") == "x"
    assert src("... (two d) -> ... d two") is None  # the halves' lanes, not consecutive pairs
    assert src("... (d two) -> ... d two", ", two=3") is None
    assert src("b (d two) -> d b two") is None  # the leading axes moved


def test_helper_local_split_point_is_inlined_only_when_bound_once():
    mod = ModuleInfo.from_source("m.py", '''
class R:
    def a(self, x):
        h = self.d // 2
        return x[..., h:]

    def b(self, x):
        h = self.d // 2
        h += 1
        return x[..., h:]
''')
    scopes = {s.qualname: s for s in mod.scopes}
    tree = ast.parse("2 * (h)", mode="eval").body
    assert ast.unparse(_helper_locals_inlined(scopes["R.a"], tree, "x")) == "2 * (self.d // 2)"
    assert ast.unparse(_helper_locals_inlined(scopes["R.b"], tree, "x")) == "2 * h"


def test_flatten_of_rank_free_pairs_checks_the_rank_at_run_time():
    example = next(e for e in PATTERN.FUSE if e.name == "mistral_complex_tokens_flatten_positive_axis")
    findings, _ = detect_all(PATTERN, example.code)
    assert findings and all(".dim() > 2" in f.fused for f in findings)
    # 3-D tokens and batched 4-D input both reach the fused call (the Fuse examples run them); the check
    # keeps a lower rank, where flatten(2) would merge fewer axes than the fused result's, on the original code
