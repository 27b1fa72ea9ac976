"""s27 norms pass (issue 14): span plans keep metadata reads (``orig_dtype = x.dtype``) in place for
every pattern; a name reassigned under a branch is another value than the parameter it shadows; the
residual sum assigned in both branches of a flag; a cast between the sum and its norm."""

from __future__ import annotations

import ast

import pytest
import torch

from npufuse import emulate
from npufuse.patterns import _site as S
from npufuse.patterns import add_rms_norm as A
from npufuse.patterns import rms_norm as R
from npufuse.scan.dataflow import ModuleInfo
from npufuse.rewrite.codegen import splice
from pattern_harness import _exec, check_fuse_found, check_keep_refused, detect_all, example_cases


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


@pytest.mark.parametrize(("pattern", "example"), [
    case for case in example_cases(R.RmsNorm(), "s27_", kind="keep")
    # the probe's own Keeps are refused by the probe, which this test switches off
    if not case.values[1].name.startswith("s27_probe_")])
def test_decisive_reason_before_control_flow(pattern, example, static_only) -> None:
    # the syntactic matcher's own reason (the probe, switched off here, never overrides these either)
    check_keep_refused(pattern, example)


class _StandInLlamaRMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm forward, written out (transformers is not a dependency)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def test_inline_input_bound_in_place_runs_under_the_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    for name in ("transformers", "transformers.models", "transformers.models.llama"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    llama = types.ModuleType("transformers.models.llama.modeling_llama")
    llama.LlamaRMSNorm = _StandInLlamaRMSNorm  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, llama.__name__, llama)
    code = next(e.code for e in R.RmsNorm.FUSE if e.name == "s27_transformers_norm_of_an_inline_input_bound_in_place")
    findings, _ = detect_all(R.RmsNorm(), code)
    # the two norm calls of one statement: one finding each; apply the first (they share the lines)
    assert [(f.qualname, f.line) for f in findings] == [("Patchify.forward", 15), ("Patchify.forward", 15)]
    assert "(_npu_x := e.permute(0, 2, 3, 1))" in findings[0].fused
    for f in findings:
        text = splice(code, [f])
        x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)
        ref_mod = _exec(code, "orig")["Patchify"](16).to(torch.bfloat16)
        with torch.no_grad():
            ref_mod.norm.weight.normal_()
        ref = ref_mod(x)
        with emulate.install() as emu:
            mod = _exec(text, "new")["Patchify"](16).to(torch.bfloat16)
            mod.load_state_dict(ref_mod.state_dict())
            out = mod(x)
            assert emu.calls.get("npu_rms_norm") == 1
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert torch.nn.functional.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0) > 0.999


def test_gap_if_is_fused_only_where_its_test_is_false() -> None:
    code = next(e.code for e in A.AddRmsNorm.FUSE if e.name == "gap_if_between_sum_and_norm")
    findings, _ = detect_all(A.AddRmsNorm(), code)
    assert len(findings) == 1
    fused = findings[0].fused
    assert fused.startswith("if not (type(padding_mask) == torch.Tensor):")
    # the original statements, the if among them, on the other path
    assert "else:\n    u = self.mix(self.pre_norm(u)) + u\n    if type(padding_mask) == torch.Tensor:" in fused


@pytest.mark.parametrize("test", ["self.training and torch.rand(1) > 0.5", "padding_mask.any()"])
def test_gap_if_with_a_test_that_has_effects_or_calls_is_not_fused(test: str) -> None:
    code = next(e.code for e in A.AddRmsNorm.FUSE if e.name == "gap_if_between_sum_and_norm")
    findings, _ = detect_all(A.AddRmsNorm(), code.replace("type(padding_mask) == torch.Tensor", test))
    assert not findings


def test_cast_statement_between_sum_and_norm_checks_the_target_dtype() -> None:
    code = next(e.code for e in A.AddRmsNorm.FUSE if e.name == "cast_stmt_between_sum_and_norm")
    findings, _ = detect_all(A.AddRmsNorm(), code)
    assert len(findings) == 1
    first = findings[0].fused.splitlines()[0]
    # where the cast would change the sum, the add, the cast and the fused norm run as written
    assert first.endswith("or self.post_attention_layernorm.weight.dtype != residual.dtype:")


def test_gap_if_that_normalises_the_sum_itself_gives_one_site() -> None:
    # ``if self.attn is not None: x = x + self.attn(norm(x))`` is the site (fused where the test holds);
    # the norm after it must not make a second, overlapping candidate for the same add
    code = next(e.code for e in A.AddRmsNorm.FUSE if e.name == "gap_if_between_sum_and_norm")
    code = code.replace("        if type(padding_mask) == torch.Tensor:\n            u = u * padding_mask[..., None]\n",
                        "        if self.mix is not None:\n            u = u + self.mix(self.post_norm(u))\n")
    findings, _ = detect_all(A.AddRmsNorm(), code)
    assert len([f for f in findings if f.line == 28]) == 1
