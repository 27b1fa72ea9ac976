"""s34 rope pass: the einops form the examples in patterns/rope.py cannot run (einops is not a dependency), and the
pieces of the new readings (a pair axis moved to the front and unpacked, a list joined by einops, prefix halves)."""

from __future__ import annotations

import ast
import sys
import types

import torch

from npufuse.patterns.rope import RopePattern, _einops_list_merge
from npufuse.scan import canonical
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import check_rewrite_runs, detect_all

PATTERN = RopePattern()


def _fake_einops() -> types.ModuleType:
    """A stand-in for the four einops patterns the s34 example uses."""
    mod = types.ModuleType("einops")

    def rearrange(t, pattern: str, **sizes: int) -> torch.Tensor:
        compact = pattern.replace(" ", "")
        if compact == "...(dtwo)->two...d":
            return t.unflatten(-1, (-1, 2)).movedim(-1, 0)
        if compact == "...(twod)->two...d":
            return t.unflatten(-1, (2, -1)).movedim(-2, 0)
        if compact == "two...d->...(dtwo)":
            return torch.stack(list(t), dim=-1).flatten(-2)
        if compact == "two...d->...(twod)":
            return torch.cat(list(t), dim=-1)
        raise NotImplementedError(pattern)

    mod.rearrange = rearrange  # type: ignore[attr-defined]
    return mod


def test_einops_front_axis_rotations_rewrite_to_the_same_numbers(monkeypatch):
    monkeypatch.setitem(sys.modules, "einops", _fake_einops())
    example = next(e for e in PATTERN.FUSE if e.name == "s34_einops_pair_axis_unpacked_and_list_joined")
    findings, _ = detect_all(PATTERN, example.code)
    assert sorted(f.params["mode"] for f in findings) == ["half", "interleave"]
    run = '''
x = torch.randn(2, 3, 5, 16, requires_grad=True)
ang = torch.randn(5, 8).repeat(1, 2)
out = (LaneRotary(16)(x), rotate(x, ang.cos(), ang.sin()), LaneRotary(16)(x.to(torch.bfloat16)))
leaves = [x]
'''
    facts = check_rewrite_runs(PATTERN, example.code, run, findings)
    assert facts["calls"] >= 3, facts["all_calls"]
    assert all(a == b for a, b in facts["dtypes"]) and all(a == b for a, b in facts["shapes"])
    assert min(facts["cos_out"]) >= 0.999 and min(facts["cos_grad"]) >= 0.999


def _merge(text: str):
    got = _einops_list_merge(ast.parse(text, mode="eval").body)
    return None if got is None else (got[0], ast.unparse(got[1]), ast.unparse(got[2]))


def test_einops_list_merge_reads_only_a_front_axis_moved_into_the_last_dim():
    assert _merge('rearrange([-b, a], "r ... d -> ... (d r)", r=2)') == ("stack", "-b", "a")
    assert _merge('rearrange((-b, a), "two b h s d -> b h s (two d)", two=2)') == ("cat", "-b", "a")
    assert _merge('rearrange([-b, a], "r ... d -> ... (d r)", r=3)') is None  # not the 2-sized list axis
    assert _merge('rearrange([-b, a], "r ... d -> ... d r", r=2)') is None  # the pair axis kept apart
    assert _merge('rearrange([-b, a], "r b d -> d (b r)", r=2)') is None  # other axes moved
    assert _merge('rearrange(x, "r ... d -> ... (d r)", r=2)') is None  # a tensor, not a list of two


def _lane(code: str, name: str):
    mod = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in mod.scopes if s.qualname == "f")
    node = ast.Name(id=name, ctx=ast.Load(), lineno=99, col_offset=0)
    return canonical.lane_of(mod, scope, node, 99)


def test_front_pair_axis_unpacked_gives_lanes_or_halves():
    lanes = "from einops import rearrange\n\ndef f(x):\n    a, b = rearrange(x, '... (d r) -> r ... d', r=2)\n"
    halves = "from einops import rearrange\n\ndef f(x):\n    a, b = rearrange(x, '... (r d) -> r ... d', r=2)\n"
    got = _lane(lanes, "b")
    assert got is not None and (got.kind, got.index, ast.unparse(got.source)) == ("pairs", 1, "x")
    got = _lane(halves, "a")
    assert got is not None and (got.kind, got.index) == ("halves", 0)
    # three pieces unpacked, or the 2 not on the moved axis: not the two lanes
    assert _lane(lanes.replace("a, b =", "a, b, c =").replace("r=2", "r=3"), "b") is None
    assert _lane(lanes.replace("-> r ... d", "-> d ... r"), "b") is None


def test_prefix_halves_check_both_split_points_and_the_width_at_run_time():
    code = '''
import torch


def f(x, cos, sin, u: int, h: int):
    x1 = x[..., :h]
    x2 = x[..., h:u]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
'''
    findings, _ = detect_all(PATTERN, code)
    assert len(findings) == 1
    fused = findings[0].fused
    assert "(u) == 2 * (h)" in fused and "x.shape[-1] >= (u)" in fused and "x[..., :u]" in fused
