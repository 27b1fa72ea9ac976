"""s27 norms pass (issue 14): span plans keep metadata reads (``orig_dtype = x.dtype``) in place for
every pattern; a name reassigned under a branch is another value than the parameter it shadows; the
residual sum assigned in both branches of a flag; a cast between the sum and its norm."""

from __future__ import annotations

import ast

import pytest

from npufuse.patterns import _site as S
from npufuse.patterns import add_rms_norm as A
from npufuse.patterns import rms_norm as R
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import check_fuse_found, check_keep_refused, detect_all, example_cases


@pytest.fixture
def static_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The syntactic matcher alone (the numeric probe would prove some refusals by value)."""
    monkeypatch.setattr(R, "_PROBE", False)


def _scope(module: ModuleInfo, qualname: str):
    return next(s for s in module.scopes if s.qualname == qualname)


_PLAN = '''
def f(x, r):
    dt = x.dtype
    y = x.float()
    if r is not None:
        r = r.to(dt)
    z = y * 2
    return z
'''


def test_plan_span_keeps_a_metadata_read_a_kept_statement_needs() -> None:
    # a pattern-neutral plan: the trace covers the dtype read and y; the kept ``if`` reads ``dt``
    module = ModuleInfo.from_source("m.py", _PLAN)
    scope = _scope(module, "f")
    body = scope.node.body
    trace = S.Trace()
    for stmt in (body[0], body[1], body[3]):
        trace.add(stmt)
    plan = S.plan_span(scope, body[4], trace)
    assert isinstance(plan, S.SpanPlan), plan
    assert [s.lineno for s in plan.kept] == [3, 5]  # ``dt = x.dtype`` stays where it stands
    assert [s.lineno for s in plan.dropped] == [4, 7]


def test_plan_span_still_refuses_a_kept_reader_of_a_computed_intermediate() -> None:
    # ``y`` is computed (a kernel), not a metadata read: a kept statement reading it is refused
    module = ModuleInfo.from_source("m.py", _PLAN.replace("r = r.to(dt)", "r = r + y"))
    scope = _scope(module, "f")
    body = scope.node.body
    trace = S.Trace()
    for stmt in (body[0], body[1], body[3]):
        trace.add(stmt)
    plan = S.plan_span(scope, body[4], trace)
    assert plan == "intermediate `y` is used by another statement inside the fused region"


def test_plan_span_refuses_a_metadata_read_of_a_dropped_value() -> None:
    # ``dt = y.dtype`` reads ``y``, which a dropped statement computes before it: it cannot run verbatim
    src = _PLAN.replace("    dt = x.dtype\n    y = x.float()\n", "    y = x.float()\n    dt = y.dtype\n")
    module = ModuleInfo.from_source("m.py", src)
    scope = _scope(module, "f")
    body = scope.node.body
    trace = S.Trace()
    for stmt in (body[0], body[1], body[3]):
        trace.add(stmt)
    plan = S.plan_span(scope, body[4], trace)
    assert plan == "intermediate `y` is used by another statement inside the fused region"


def test_key_tells_a_parameter_from_its_conditional_reassignment() -> None:
    src = "def f(x, r):\n    a = x\n    if r is not None:\n        x = x + r\n    b = x\n"
    module = ModuleInfo.from_source("m.py", src)
    scope = _scope(module, "f")
    before = S.key(ast.Name("x", ast.Load()), S.Ctx(scope, 2))
    after = S.key(ast.Name("x", ast.Load()), S.Ctx(scope, 5))
    assert before != after
    # the same version read twice is one value
    assert after == S.key(ast.Name("x", ast.Load()), S.Ctx(scope, 5))


@pytest.mark.parametrize(("pattern", "example"), example_cases(R.RmsNorm(), "dtype_read_kept"))
def test_dtype_read_kept_is_a_static_finding(pattern, example, static_only) -> None:
    check_fuse_found(R.RmsNorm(), example)
    findings, _ = detect_all(R.RmsNorm(), example.code)
    fused = findings[0].fused
    # the read stays verbatim and the output is cast to it, not to the reassigned ``x``'s dtype
    name = "orig_dtype" if "orig_dtype" in example.code else "og_dtype"
    assert fused.splitlines()[0] == f"{name} = x.dtype"
    assert f"promote_types(self.weight.dtype, {name})" in fused


def test_dtype_of_a_reassigned_input_is_not_the_input_dtype(static_only) -> None:
    # before s27 ``x.to(orig_dtype)`` (``orig_dtype`` read before ``x`` became fp32 plus a residual)
    # looked like a cast to the input's own dtype: a wrong fp32 output
    code = next(e.code for e in R.RmsNorm.FUSE if e.name == "dtype_read_kept_for_a_residual_branch")
    findings, _ = detect_all(R.RmsNorm(), code)
    assert findings[0].params["output_dtype"] == "promote(orig_dtype, weight)"
    assert "promote_types(self.weight.dtype, x.dtype)" not in findings[0].fused


@pytest.mark.parametrize(("pattern", "example"), example_cases(A.AddRmsNorm(), "branch_sum"))
def test_branch_sum_found(pattern, example) -> None:
    check_fuse_found(A.AddRmsNorm(), example)
    findings, _ = detect_all(A.AddRmsNorm(), example.code)
    # the operands are bound by the original if, the add made once
    assert findings[0].fused.startswith("if self.use_mup:\n    _npu_x1, _npu_x2 = r, y * self.scale\n")
    assert "torch_npu.npu_add_rms_norm(_npu_x1, _npu_x2," in findings[0].fused


@pytest.mark.parametrize(("pattern", "example"), example_cases(A.AddRmsNorm(), ("branch_sum", "cast_between"), kind="keep"))
def test_branch_sum_and_cast_keeps(pattern, example) -> None:
    check_keep_refused(A.AddRmsNorm(), example)


def test_branch_sum_with_a_scaled_add_in_one_branch_is_not_fused() -> None:
    code = next(e.code for e in A.AddRmsNorm.FUSE if e.name == "branch_sum_flag_fp32")
    code = code.replace("h = r + y * self.scale", "h = torch.add(r, y, alpha=self.scale)")
    findings, _ = detect_all(A.AddRmsNorm(), code)
    assert not findings


def test_branch_sum_of_two_names_is_not_fused() -> None:
    # each branch assigns another name: the norm reads only one of them
    code = next(e.code for e in A.AddRmsNorm.FUSE if e.name == "branch_sum_flag_fp32")
    code = code.replace("        else:\n            h = r + y\n", "        else:\n            g = r + y\n")
    findings, _ = detect_all(A.AddRmsNorm(), code)
    assert not findings


@pytest.mark.parametrize(("pattern", "example"), example_cases(R.RmsNorm(), "s27_", kind="keep"))
def test_decisive_reason_before_control_flow(pattern, example, static_only) -> None:
    # the syntactic matcher's own reason (the probe, switched off here, never overrides these either)
    check_keep_refused(pattern, example)
