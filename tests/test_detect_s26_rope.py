"""Rope forms normalised by mechanism (issue 14, session 26): a lane indexed out of a two-axis view, the
complex operand proven by dataflow (a rebinding product, a helper parameter filled by its callers), a
rotation named before use, a helper cutting its halves at ``self.<attr> // 2``. The end-to-end checks
(detection, rewrite, emulator) are the pattern's own Fuse/Keep examples; these pin the pieces."""

from __future__ import annotations

import ast

import pytest

from npufuse.patterns import rope as R
from npufuse.scan import canonical
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import detect_all


def _fn_scope(code: str):
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "f")
    return module, scope


def _subscript(scope, text: str) -> ast.Subscript:
    return next(n for n in ast.walk(scope.node) if isinstance(n, ast.Subscript) and ast.unparse(n) == text)


@pytest.mark.parametrize("view", [
    "x.reshape(*x.shape[:-1], -1, 2)",
    "x.view(*x.shape[:-1], -1, 2)",
    "x.unflatten(-1, (-1, 2))",
    "x.float().reshape(*x.shape[:-1], -1, 2)",
])
@pytest.mark.parametrize("k", [0, 1])
def test_indexed_lane_of_a_pairs_view_is_that_lane(view, k):
    module, scope = _fn_scope(f"def f(x):\n    xs = {view}\n    return xs[..., {k}] * 2\n")
    lane = canonical.lane_of(module, scope, _subscript(scope, f"xs[..., {k}]"))
    assert lane is not None and lane.kind == "pairs" and lane.index == k
    assert ast.unparse(canonical.strip_casts(lane.source)[0]) == "x"


def test_indexed_lane_of_a_view_rebinding_the_name_reads_the_view_flattened_back():
    # at the use the name holds the [.., D/2, 2] view: the source must be written so it reads x there
    module, scope = _fn_scope("def f(x):\n    x = x.reshape(*x.shape[:-1], -1, 2)\n    return x[..., 1] * 2\n")
    lane = canonical.lane_of(module, scope, _subscript(scope, "x[..., 1]"))
    assert lane is not None and (lane.kind, lane.index) == ("pairs", 1)
    assert ast.unparse(lane.source) == "x.flatten(-2)"


@pytest.mark.parametrize("body", [
    # the halves view (2, D/2) indexed on the pair axis alone is not a lane of the last dim
    "    xs = x.reshape(*x.shape[:-1], 2, -1)\n    return xs[..., 0] * 2\n",
    # a lane index 2 of a pairs view does not exist
    "    xs = x.reshape(*x.shape[:-1], -1, 2)\n    return xs[..., 2] * 2\n",
    # x is rebound between the view and the read: the view's x is not the name's value there
    "    xs = x.reshape(*x.shape[:-1], -1, 2)\n    x = x * 2\n    return xs[..., 0] * 2\n",
    # not a view of the last dim in two
    "    xs = x.reshape(-1, 2)\n    return xs[..., 0] * 2\n",
])
def test_indexed_lane_refuses_what_is_not_a_lane(body):
    module, scope = _fn_scope("def f(x):\n" + body)
    sub = next(n for n in ast.walk(scope.node) if isinstance(n, ast.Subscript) and ast.unparse(n).startswith("xs[..., "))
    assert canonical.indexed_lane(module, scope, sub) is None


def test_indexed_halves_of_a_two_by_half_view():
    module, scope = _fn_scope("def f(x):\n    xs = x.unflatten(-1, (2, -1))\n    return xs[..., 1, :] * 2\n")
    lane = canonical.indexed_lane(module, scope, _subscript(scope, "xs[..., 1, :]"))
    assert lane is not None and (lane.kind, lane.index) == ("halves", 1)


_HELPER = '''
import torch


class Spin:
    def _turn(self, f, z):
        return torch.view_as_real(z * f).flatten(3)

    def forward(self, q, f, first: bool):
        z = q[..., :4]
        if first:
            z = torch.view_as_complex(z.reshape(*z.shape[:-1], -1, 2))
            z = self._turn(f, z)
        else:
            z = torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2))
            z = self._turn(f, z)
        return z
'''


def test_helper_parameter_is_complex_when_every_caller_passes_view_as_complex():
    # the binding reaching the else-branch call is the else-branch one, not the textually last
    # (the if-branch rebinding of z by the helper's own result)
    module = ModuleInfo.from_source("m.py", _HELPER)
    scope = next(s for s in module.scopes if s.qualname == "Spin._turn")
    assert R._passes_complex(module, scope, "z")
    assert not R._passes_complex(module, scope, "f")


def test_helper_parameter_with_one_real_caller_is_not_proven():
    code = _HELPER.replace("            z = torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2))\n", "")
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "Spin._turn")
    assert not R._passes_complex(module, scope, "z")


def test_other_class_method_of_the_same_name_is_not_a_caller():
    code = _HELPER + '''

class Other:
    def _turn(self, f, z):
        return z

    def forward(self, q, f):
        return self._turn(f, q)
'''
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "Spin._turn")
    assert R._passes_complex(module, scope, "z")


def test_attribute_split_helper_is_fused_only_under_the_run_time_split_check():
    code = next(e.code for e in R.RopePattern.FUSE if e.name == "named_rotation_of_attribute_split_helper")
    findings, _ = detect_all(R.RopePattern(), code)
    assert len(findings) == 1
    assert "xf.shape[-1] == 2 * (self.dim // 2)" in findings[0].fused.splitlines()[0]


def test_unmerged_stack_gives_the_pairs_layout_back():
    code = next(e.code for e in R.RopePattern.FUSE if e.name == "stacked_lane_pairs_left_unmerged")
    findings, _ = detect_all(R.RopePattern(), code)
    assert len(findings) == 1
    fused = findings[0].fused
    assert ".unflatten(-1, (-1, 2))" in fused and "x.flatten(-2)" in fused
    # the rank check is on the [.., D/2, 2] view the name holds: at most 5-D there is 4-D x
    assert "x.dim() <= 5" in fused
