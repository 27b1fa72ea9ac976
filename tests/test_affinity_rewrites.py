"""The affinity rewrites (plain-torch replacements) executed: original vs rewritten module.

``test_patterns.py`` proves a fused branch ran by counting torch_npu calls; these two patterns'
fused code calls only torch (``masked_fill_``, ``torch.where``, ``torch.lerp``), so here the proof
is a line trace: every ``# npufuse:`` branch of the rewritten module must execute. Outputs must be
equal (these rewrites are exact for the inputs used), dtypes identical, gradients equal; without
the emulator the rewritten module imports and runs its original branch.
"""

from __future__ import annotations

import ast
import sys
import types
from typing import Any

import pytest
import torch

from npufuse import emulate
from npufuse.patterns import affinity_index_put, affinity_where
from npufuse.patterns.registry import get_pattern
from npufuse.rewrite.codegen import splice
from pattern_harness import detect_all

MODULES = {"affinity_index_put": affinity_index_put, "affinity_where": affinity_where}
FILENAME = "<rewritten-affinity>"


def _cases():
    for pid, mod in MODULES.items():
        pattern = get_pattern(pid)
        for ex in pattern.FUSE:
            if ex.name in mod.CHECKS:
                yield pytest.param(pattern, ex, mod.CHECKS[ex.name], id=f"{pid}-{ex.name}")


def _fused_branches(source: str) -> list[tuple[int, int]]:
    """Line ranges of the bodies of every npufuse-guarded ``if``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and "_npufuse_on_npu(" in ast.unparse(node.test):
            out.append((node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno))
    return out


def _run(code: str, check: str, filename: str) -> tuple[dict[str, Any], set[int]]:
    """Exec ``code`` as a module, run ``check`` in it (seeded), trace executed lines of the module."""
    mod = types.ModuleType("affinity_example")
    mod.__file__ = filename
    executed: set[int] = set()

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != filename:
            return None

        def local(frame, event, arg):
            if event == "line":
                executed.add(frame.f_lineno)
            return local

        return local

    exec(compile(code, filename, "exec"), mod.__dict__)
    torch.manual_seed(0)
    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        exec(compile(check, "<check>", "exec"), mod.__dict__)
    finally:
        sys.settrace(old)
    ns = mod.__dict__
    leaves = ns.get("leaves") or []
    if leaves:
        outs = [o for o in _flat(ns["out"]) if o.requires_grad]
        sum(o.float().sum() for o in outs).backward()
        ns["grads"] = [leaf.grad for leaf in leaves]
    return ns, executed


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype, f"dtype changed: {a.dtype} -> {b.dtype}"
    assert a.shape == b.shape
    torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("pattern,example,check", list(_cases()))
def test_rewrite_runs_fused_branch_and_matches(pattern, example, check):
    findings, _ = detect_all(pattern, example.code)
    assert findings
    rewritten = splice(example.code, findings)
    branches = _fused_branches(rewritten)
    assert len(branches) == len(findings)

    ref, _ = _run(example.code, check, "<original-affinity>")
    with emulate.install():
        got, executed = _run(rewritten, check, FILENAME)
    for first, last in branches:
        assert executed & set(range(first, last + 1)), f"fused branch at lines {first}-{last} did not run"
    ref_out, got_out = _flat(ref["out"]), _flat(got["out"])
    assert len(ref_out) == len(got_out)
    for a, b in zip(ref_out, got_out):
        _same(a, b)
    for a, b in zip(ref.get("grads", []), got.get("grads", [])):
        assert (a is None) == (b is None)
        if a is not None:
            _same(a, b)


@pytest.mark.parametrize("pattern,example,check", list(_cases()))
def test_rewritten_module_without_torch_npu_runs_original(pattern, example, check):
    findings, _ = detect_all(pattern, example.code)
    rewritten = splice(example.code, findings)
    assert "import npufuse" not in rewritten and "from npufuse" not in rewritten
    ref, _ = _run(example.code, check, "<original-affinity>")
    got, executed = _run(rewritten, check, FILENAME)
    for first, last in _fused_branches(rewritten):
        assert not executed & set(range(first, last + 1)), "fused branch ran without an NPU"
    for a, b in zip(_flat(ref["out"]), _flat(got["out"])):
        _same(a, b)


def test_every_fuse_example_has_a_check():
    for pid, mod in MODULES.items():
        names = {ex.name for ex in get_pattern(pid).FUSE}
        assert names == set(mod.CHECKS), f"{pid}: every Fuse example needs exactly one CHECKS entry"


def test_multiply_form_is_why_masked_fill_is_used():
    # the Ascend guide's `x *= ~mask` is wrong for non-finite x; the emitted masked_fill_ is not
    x = torch.tensor([1.0, float("inf"), float("nan"), -2.0])
    mask = torch.isfinite(x).logical_not()
    expected = x.clone()
    expected[mask] = 0.0
    assert torch.isnan(x * ~mask).any()
    torch.testing.assert_close(x.clone().masked_fill_(mask, 0.0), expected, rtol=0, atol=0)
