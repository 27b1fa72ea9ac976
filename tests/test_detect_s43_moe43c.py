"""s43 moe43c: moe_experts routing-weight reads of the s43 blind sets' missed sites (`s43c_*` examples,
patterns/_moe_s43c.py): w[mask, k] in a slot loop, w[pairs] of a nonzero / where tuple, the slot of e in each selected
row from (idx[rows] == e).nonzero()[:, 1], and the expert output scaled in place (y *= w / y.mul_(w))."""

from __future__ import annotations

import ast

import pytest

from npufuse.patterns import _moe_s43c as s43c
from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, example_cases

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s43c_", kind="fuse"))
def test_s43c_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s43c_", kind="keep"))
def test_s43c_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


def _loop(code: str) -> ast.For:
    return next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.For))


def test_s43c_read_since_bound_sees_a_read_between_binding_and_scaling():
    loop = _loop("for e in r:\n    y = f(x)\n    z = y\n    y *= w\n")
    assert s43c.read_since_bound(loop, "y", loop.body[2])
    loop = _loop("for e in r:\n    y = f(y)\n    y *= w\n")
    assert not s43c.read_since_bound(loop, "y", loop.body[1])
    loop = _loop("for e in r:\n    y *= w\n")  # never bound in the loop: another handle may exist
    assert s43c.read_since_bound(loop, "y", loop.body[0])


@pytest.mark.parametrize("index,second", [("[:, 1]", True), ("[:, -1]", True), ("[:, 0]", False), ("[0, 1]", False),
                                          ("[1:, 1]", False), ("[:, True]", False)])
def test_s43c_second_column(index, second):
    sl = ast.parse(f"a{index}", mode="eval").body.slice
    assert s43c.is_second_column(sl) is second
