"""s40 shared dataflow (helper ``dataflow40``): values with two reaching definitions from the arms of an
``if`` / ``else`` read after it, and tuple / ``map(lambda ...)`` unpacking.

1. ``Scope.reaching_definitions`` / ``Scope.arm_exits``: ``if use_kernel: y = kernel(x) else: y = <norm>``
   then ``return y + r`` -- both assignments reach the return, so no root after the ``if`` parses; the
   end of the hand-written arm is read as a root (``_site.arm_exit_root``) and the fused code replaces
   that arm alone (VibeVoice ConvRMSNorm; MindSpeed-MM Qwen3_5MoeRMSNorm, whose other arm is
   torch_npu's own kernel: its near miss now stands in the arm it is about).
2. ``_assignments_of`` records per-element definitions of nested tuple targets, starred targets and
   ``map(lambda t: f(t), (a, b))`` / ``[f(t) for t in (a, b)]`` unpacking (HO16b reflow's rope inputs).
"""

from __future__ import annotations

import ast

from npufuse.scan.dataflow import ModuleInfo, Scope, applied_lambda


def _scope(code: str, qualname: str) -> tuple[ModuleInfo, Scope]:
    module = ModuleInfo.from_source("m.py", code)
    return module, next(s for s in module.scopes if s.qualname == qualname)


_ARMS = '''
def f(x, r, use_kernel, w):
    x = x.transpose(1, 2)
    if use_kernel:
        y = kernel(x)
    else:
        y = x * 2
        if w is not None:
            y = y * w
    y = y.transpose(1, 2)
    return y + r
'''


def test_reaching_definitions_see_both_arms_and_stop_at_a_definite_binding() -> None:
    _m, scope = _scope(_ARMS, "f")
    after_if = scope.node.body[2]  # y = y.transpose(1, 2)
    defs, complete = scope.reaching_definitions("y", after_if)
    assert sorted(d.lineno for d in defs) == [5, 7, 9] and complete
    defs, complete = scope.reaching_definitions("y", scope.node.body[-1])
    assert [d.lineno for d in defs] == [10] and complete
    defs, complete = scope.reaching_definitions("x", scope.node.body[0])
    assert defs == [] and not complete  # a parameter: the value comes from before the scope


def test_an_arm_that_returns_passes_nothing_on_and_a_loop_never_stops_the_search() -> None:
    code = '''
def g(x, flag):
    y = x
    if flag:
        y = x + 1
        return y
    else:
        y = x * 2
    for i in range(3):
        y = y + i
    return y
'''
    _m, scope = _scope(code, "g")
    defs, complete = scope.reaching_definitions("y", scope.node.body[-1])
    assert sorted(d.lineno for d in defs) == [8, 10] and complete


def test_arm_exits_name_the_arm_its_reader_and_the_other_definitions() -> None:
    _m, scope = _scope(_ARMS, "f")
    exits = {(e.name, e.last.lineno): e for e in scope.arm_exits()}
    assert set(exits) == {("y", 5), ("y", 8)}  # the nested ``if`` without ``else`` is no arm exit
    kernel_arm, native_arm = exits[("y", 5)], exits[("y", 8)]
    assert kernel_arm.reader.lineno == native_arm.reader.lineno == 10
    assert [d.lineno for d in native_arm.others] == [5]
    assert sorted(d.lineno for d in kernel_arm.others) == [7, 9]


def test_a_name_not_read_after_the_if_has_no_arm_exit() -> None:
    _m, scope = _scope(_ARMS.replace("    y = y.transpose(1, 2)\n    return y + r\n", "    return r\n"), "f")
    assert scope.arm_exits() == []


def test_norm_in_an_arm_beside_a_kernel_arm_is_fused_in_the_arm_alone() -> None:
    from pattern_harness import detect_all

    from npufuse.patterns.rms_norm import _S40_ARM_FIRST_CHANNELS, _S40_ARM_OF_IF_ELSE, RmsNorm

    findings, _ = detect_all(RmsNorm(), _S40_ARM_OF_IF_ELSE)
    assert [(f.line, f.end_line) for f in findings] == [(23, 25)], findings  # the else arm's three statements
    assert findings[0].fused.splitlines()[-1].startswith("y = ")
    assert "_kernel_rms" not in findings[0].fused  # the kernel arm is untouched
    findings, _ = detect_all(RmsNorm(), _S40_ARM_FIRST_CHANNELS)
    assert [(f.line, f.end_line) for f in findings] == [(20, 22)], findings
    assert findings[0].fused.startswith("if self.weight is not None:")


def test_norm_arm_beside_torch_npu_is_its_fallback_and_the_near_miss_stands_in_the_arm() -> None:
    from pattern_harness import detect_all

    from npufuse.patterns.rms_norm import _S40_ARM_OF_IF_ELSE, RmsNorm

    code = _S40_ARM_OF_IF_ELSE.replace(
        "y = _kernel_rms(x, self.weight, self.eps)",
        "import torch_npu\n            y = torch_npu.npu_rms_norm(x, self.weight, self.eps)[0]").replace(
        "if self.use_kernel:", "if torch.npu.is_available():")
    findings, misses = detect_all(RmsNorm(), code)
    assert findings == []
    # the arm's lines (it was the ``return`` after the ``if``, outside the arm the reason is about)
    assert [(m.line, m.end_line, m.reason) for m in misses] == [(24, 26, "already has a torch_npu branch")], misses


def test_norm_arm_whose_statistic_is_read_after_the_if_is_refused() -> None:
    from pattern_harness import detect_all

    from npufuse.patterns.rms_norm import RmsNorm

    code = '''
import torch


def norm(x, w, eps, kernel=None):
    if kernel is not None:
        y, rstd = kernel(x, w, eps)
    else:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        y = w * (x.float() * rstd).to(x.dtype)
    return y, rstd
'''
    findings, misses = detect_all(RmsNorm(), code)
    assert findings == []
    assert any("`rstd` reused after the fused region" in m.reason for m in misses), misses


def test_nested_and_starred_tuple_targets_get_one_definition_per_element() -> None:
    code = '''
def f(q, k, v):
    (m, n), o = (q, k), v
    a, *b, c = v
'''
    _m, scope = _scope(code, "f")
    seen = {name: ast.unparse(defs[-1][1]) for name, defs in scope.assignments.items()}
    assert seen["m"] == "((q, k), v)[0][0]" and seen["n"] == "((q, k), v)[0][1]" and seen["o"] == "((q, k), v)[1]"
    assert seen["a"] == "v[0]" and seen["c"] == "v[-1]"  # c was ``v[2]`` (after the starred target: from the end)
    assert "b" not in seen


def test_map_of_a_lambda_over_a_tuple_defines_each_element_as_the_lambda_applied() -> None:
    code = '''
def rope(q, k):
    (q_r, q_i), (k_r, k_i) = map(lambda t: rearrange(t, 'b n h (d s) -> s b h n d', s=2), (q, k))
    x, y = [t.float() for t in (q, k)]
    u, w = map(fn, (q, k))
'''
    _m, scope = _scope(code, "rope")
    q_r = scope.assignments["q_r"][-1][1]
    assert isinstance(q_r, ast.Subscript) and q_r.slice.value == 0  # type: ignore[attr-defined]
    param, body, arg = applied_lambda(q_r.value)  # type: ignore[misc]
    assert param == "t" and ast.unparse(body).startswith("rearrange(t,") and ast.unparse(arg) == "q"
    assert ast.unparse(applied_lambda(scope.assignments["k_i"][-1][1].value)[2]) == "k"  # type: ignore[index,attr-defined]
    assert [ast.unparse(p) for p in applied_lambda(scope.assignments["y"][-1][1])[1:]] == ["t.float()", "k"]  # type: ignore[index]
    assert ast.unparse(scope.assignments["u"][-1][1]) == "map(fn, (q, k))[0]"  # no lambda to read: as before


def test_site_follow_reads_the_applied_lambda_with_its_parameter_bound() -> None:
    from npufuse.patterns import _site as S

    code = '''
def g(a, b):
    x, y = map(lambda t: t.float() * 2, (a, b))
    return x
'''
    _m, scope = _scope(code, "g")
    value, ctx, stmt = S.follow(ast.Name("x", ast.Load()), S.Ctx(scope, 4))
    assert ast.unparse(value) == "t.float() * 2" and stmt is not None and stmt.lineno == 3
    assert ast.unparse(ctx.bind["t"][0]) == "a"
    # a lambda parameter the scope also binds is not read through (the scope's ``t`` would win)
    _m, scope = _scope(code.replace("    return x\n", "    t = a\n    return x\n"), "g")
    value, _ctx, _stmt = S.follow(ast.Name("x", ast.Load()), S.Ctx(scope, 5))
    assert applied_lambda(value) is not None
