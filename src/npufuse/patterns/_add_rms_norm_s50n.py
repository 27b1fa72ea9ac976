"""s50 ho27misc2: a norm class whose forward has several exiting arms before a hand-written RMS norm.

HO27a nano-llm's RMSNorm (and s49's sdx with two arms) chooses among F.rms_norm, an opt-in external kernel and the
norm by hand::

    def forward(self, x, use_kernel=False):
        if not use_kernel and hasattr(F, "rms_norm") and not torch.onnx.is_in_onnx_export():
            return F.rms_norm(x, self.weight.shape, self.weight, eps=self.eps)
        if use_kernel:
            from .kernels import kernel_rms
            return kernel_rms(x, self.weight, self.eps)
        return self._norm(x.float()).type_as(x) * self.weight

and is called ``self.norm(h, use_kernel=flag)``. The rms_norm detector reads each arm; the add_rms_norm reader took
one ``if`` arm only (s49m: a test free of calls, nothing after it but the tail), so the class was no norm at all and
the site had no near miss. Here the forward is read as N arms and a tail, and an arm is either
- excluded where the fused code runs: its test needs a truthy forward parameter that the call (or the default) binds
  to a constant false value (no guard) or to a plain name / attribute of the caller (guard ``not (<that expression>)``),
  or its test is a flag test of the instance (guard ``not (<test on the module>)``), or a CUDA test of the input
  (false on an NPU tensor); or
- F.rms_norm of the input, whose weight and eps must be the tail's (checked after the tail is read, :func:`differ`).
Every other arm is a true near miss: the fused call would replace it and npufuse cannot say it computes the same.
Tests may call only predicates without effects (``hasattr``, ``torch.onnx.is_in_onnx_export()`` ...): the fused code
skips them.
"""

from __future__ import annotations

import ast
import re
from typing import Callable

from npufuse.patterns import _add_rms_norm_s49m
from npufuse.patterns import _site as S
from npufuse.scan.dataflow import ModuleInfo, const_value, dotted, keyword

# calls a test may hold: predicates that read state and change none (the fused code does not evaluate the test)
_PURE_PREDICATES = frozenset(("hasattr", "isinstance", "callable", "torch.onnx.is_in_onnx_export", "torch.jit.is_scripting",
                              "torch.jit.is_tracing", "torch.compiler.is_compiling", "torch._dynamo.is_compiling",
                              "torch.is_autocast_enabled", "torch.is_grad_enabled"))

_SHAPE_READS = frozenset(("dim", "size", "numel", "is_floating_point", "is_contiguous"))


class NArms(_add_rms_norm_s49m.Arms):
    """The tail's return, the F.rms_norm arms (test, weight, eps), the run-time conditions under which the other arms
    do not run, and the forward parameters read only by arm tests (the call may pass them: they change no value)."""

    def __init__(self, ret: ast.Return, library: list[tuple[ast.expr, ast.expr, ast.expr | None]], conditions: list[str],
                 test_only: set[str], excluded: list[str]) -> None:
        first = library[0] if library else (ast.Constant(True), ast.Constant(None), None)
        super().__init__(ret, first[0], first[1], first[2])
        self.library, self.conditions, self.test_only, self.excluded = library, conditions, test_only, excluded

    @property
    def note(self) -> str:
        parts = []
        if self.library:
            parts.append(f"{len(self.library)} arm(s) F.rms_norm with the same weight and eps")
        if self.excluded:
            parts.append("not run where the fused code runs: " + "; ".join(self.excluded))
        return "its forward has several arms: " + ", ".join(parts) + "; the torch path is read"


def _pure_test(module: ModuleInfo, test: ast.expr) -> bool:
    for n in ast.walk(test):
        if isinstance(n, (ast.NamedExpr, ast.Lambda, ast.Await, ast.Yield, ast.YieldFrom)):
            return False
        if isinstance(n, ast.Call):
            if isinstance(n.func, ast.Attribute) and n.func.attr in _SHAPE_READS:
                continue  # ``t.dim() == 2``: metadata of a tensor
            name = module.canonical(n.func) or dotted(n.func) or ""
            if name not in _PURE_PREDICATES and (dotted(n.func) or "") not in _PURE_PREDICATES:
                return False
    return True


def _needs_truthy(test: ast.expr, p: str) -> bool:
    """The test is false wherever parameter ``p`` is falsy: ``p`` itself or a conjunction holding it."""
    if isinstance(test, ast.Name):
        return test.id == p
    return isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and any(isinstance(v, ast.Name) and v.id == p for v in test.values)


def _plain(node: ast.expr) -> bool:
    """A caller expression the guard may reread without effects: a name or an attribute chain (no call, no index)."""
    return dotted(node) is not None


def _flatten(body: list[ast.stmt]) -> tuple[list[ast.If], list[ast.stmt]] | None:
    """The exiting ``if`` arms (``if``/``elif`` whose body ends in a return) and the tail after them."""
    arms: list[ast.If] = []
    stmts = body
    while stmts and isinstance(stmts[0], ast.If) and stmts[0].body and isinstance(stmts[0].body[-1], ast.Return):
        head = stmts[0]
        arms.append(head)
        if head.orelse:
            if stmts[1:]:
                return None
            stmts = head.orelse
        else:
            stmts = stmts[1:]
    return (arms, stmts) if arms else None


def read(module: ModuleInfo, fwd: ast.FunctionDef, mod: str, foreign: bool, extra: dict[str, ast.expr],
         library_forward: Callable[..., tuple[str, str] | None], dead_on_npu: Callable[[ast.expr, str], bool],
         cls: str, source: Callable[[ast.expr], str]) -> NArms | str | None:
    """The forward as N arms and a tail (:class:`NArms`), a true reason where an arm is neither excluded nor the same
    F.rms_norm, or None where the forward is not of this form (or holds no arm this reader adds anything to: the
    older one-arm readers take it)."""
    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    if len(params) < 2 or fwd.args.vararg or fwd.args.kwarg:
        return None
    me, x = params[0], params[1]
    body = [st for st in fwd.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    got = _flatten(body)
    if got is None:
        return None
    arms, tail = got
    for arm in arms:
        before = arm.body[:-1]
        if not all(isinstance(st, (ast.Import, ast.ImportFrom, ast.Pass)) or (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))
                   for st in before):
            return None  # an arm that computes before returning: its names could read as the tail's definitions
        bound = {(a.asname or a.name).split(".")[0] for st in before if isinstance(st, (ast.Import, ast.ImportFrom)) for a in st.names}
        if bound & {n.id for st in tail for n in ast.walk(st) if isinstance(n, ast.Name)}:
            return None
    if not tail or len(tail) > 8 or not isinstance(tail[-1], ast.Return) or tail[-1].value is None \
            or not all(S._straight(st) for st in tail[:-1]):
        return None
    impure = next((a for a in arms if not _pure_test(module, a.test)), None)
    if impure is not None:
        if len(arms) < 2:
            return None  # one arm: the older readers (a kernel branch under a flag) take it
        return (f"norm {cls}'s forward chooses among {len(arms) + 1} paths, one under `{ast.unparse(impure.test)[:60]}`, a test "
                "that calls what npufuse does not read as free of effects: the fused call would skip it")
    defaults = dict(zip(params[len(params) - len(fwd.args.defaults):], fwd.args.defaults))
    kw_defaults = {a.arg: d for a, d in zip(fwd.args.kwonlyargs, fwd.args.kw_defaults) if d is not None}
    library: list[tuple[ast.expr, ast.expr, ast.expr | None]] = []
    conditions: list[str] = []
    excluded: list[str] = []
    test_only: set[str] = set()
    guard_names: set[str] = set()
    unread: ast.If | None = None
    claimed = False  # an arm only this reader reads (a keyword-excluded arm, a pure call in a test, two or more arms)
    for arm in arms:
        text = ast.unparse(arm.test)
        flag = next((p for p in (*params[2:], *(a.arg for a in fwd.args.kwonlyargs)) if _needs_truthy(arm.test, p)), None)
        if flag is not None:
            value = extra.get(flag, defaults.get(flag, kw_defaults.get(flag)))
            cv = const_value(value) if value is not None else ...
            if value is not None and cv is not ... and not cv:
                excluded.append(f"`{text[:50]}` (`{flag}` is {cv!r})")
                claimed = True
                continue
            if value is not None and flag in extra and _plain(value):
                conditions.append(f"not ({source(value)})")
                guard_names |= {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
                excluded.append(f"`{text[:50]}` (checked false: the call passes `{flag}={source(value)}`)")
                claimed = True
                continue
        if dead_on_npu(arm.test, x):
            excluded.append(f"`{text[:50]}` (false for an NPU tensor)")
            continue
        one = arm.body[0] if len(arm.body) == 1 else None
        if isinstance(one, ast.Return) and isinstance(one.value, ast.Call):
            probe = ast.FunctionDef(name=fwd.name, args=fwd.args, body=[one], decorator_list=[], returns=None, type_comment=None,
                                    lineno=fwd.lineno, col_offset=fwd.col_offset, end_lineno=arm.end_lineno, end_col_offset=0)
            w = keyword(one.value, "weight", 2)
            if w is not None and library_forward(module, probe, mod, foreign) is not None:
                library.append((arm.test, w, keyword(one.value, "eps", 3)))
                claimed = claimed or any(isinstance(n, ast.Call) for n in ast.walk(arm.test))
                continue
        if _instance_flags(arm.test, me) and not foreign and "\n" not in mod:
            conditions.append("not (" + re.sub(rf"\b{re.escape(me)}\.", mod + ".", text) + ")")
            excluded.append(f"`{text[:50]}` (checked false at run time)")
            continue
        unread = unread or arm
    claimed = claimed or len(arms) >= 2
    if not claimed:
        return None
    # a parameter the call passes may be read by the tests only: the tail (the norm the fused call computes) never sees it
    tail_names = {n.id for st in tail for n in ast.walk(st) if isinstance(n, ast.Name)}
    test_only = {p for p in params[2:] if p not in tail_names}
    if unread is not None:
        return (f"norm {cls}'s forward returns `{ast.unparse(unread.body[-1].value)[:60]}` under "  # type: ignore[union-attr]
                f"`{ast.unparse(unread.test)[:60]}`, an arm npufuse does not read as the same RMS norm and cannot show does not "
                "run where the fused code would (only F.rms_norm arms, flags the call passes false, flags of the module and "
                "CUDA tests of the input are read)")
    out = NArms(tail[-1], library, conditions, test_only, excluded)
    out.guard_names = guard_names
    return out


def _instance_flags(test: ast.expr, me: str) -> bool:
    """A test of the instance's attributes, constants, comparisons and boolean operators only (the run-time check rereads
    it on the module): every name is ``me`` under an attribute, no call or index."""
    for n in ast.walk(test):
        if isinstance(n, (ast.Call, ast.Subscript, ast.Lambda, ast.NamedExpr)):
            return False
        if isinstance(n, ast.Name) and n.id != me:
            return False
    return any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == me for n in ast.walk(test))


def differ(match: object, arms: _add_rms_norm_s49m.Arms, cls: str) -> str | None:
    """s49m's check for each F.rms_norm arm (one for a two-arm forward)."""
    if not isinstance(arms, NArms):
        return _add_rms_norm_s49m.differ(match, arms, cls)
    for test, weight, eps in arms.library:
        why = _add_rms_norm_s49m.differ(match, _add_rms_norm_s49m.Arms(arms.ret, test, weight, eps), cls)
        if why is not None:
            return why.replace("has two arms", "has an arm")
    return None


def same_dtype(nc: object, out_code: str, s_name: str, x: str, negate: bool = False) -> str:
    """The run-time term that keeps the fused code where the forward's F.rms_norm arm (output in the input's dtype) and
    the torch path read (``out_code``, written on ``s_name``) give one dtype: with a float32 weight and a half input,
    ``type_as(x) * self.weight`` is float32 while F.rms_norm is half (and rounds once more), so neither fused output
    is the original's there. ``x`` names the sum's dtype where the term is tested; empty where nothing differs."""
    if not getattr(nc, "library_arm", False) or out_code == f"{s_name}.dtype":
        return ""
    code = re.sub(rf"\b{re.escape(s_name)}\b", x, out_code) if x != s_name else out_code
    return f" or {code} != {x}.dtype" if negate else f" and {code} == {x}.dtype"


def bound_in_span(nc: object, module: ModuleInfo, scope: object, site: object) -> str | None:
    """A reason where a caller name the fused code's conditions read (a keyword's value) is assigned by a statement of
    the site (the add, an alias, anything up to the norm): the test runs before the site's first statement, where that
    name has its earlier value (or none). None where nothing is."""
    names = getattr(nc, "guard_names", frozenset())
    if not names:
        return None
    stmts: list[ast.stmt] = [site.add, *site.aliases, site.norm_stmt]  # type: ignore[attr-defined]
    where = S.stmt_index(scope).block.get(id(site.add))  # type: ignore[arg-type, attr-defined]
    if where is not None:
        block, i = where
        j = next((k for k in range(i, len(block)) if block[k] is site.last), None)  # type: ignore[attr-defined]
        if j is not None:
            stmts = list(block[i : j + 1])
    written = set().union(*(S.names_written(st) for st in stmts))
    late = sorted(names & written)
    if not late:
        return None
    return (f"norm {getattr(nc, 'cls', '')}: the fused code tests `{late[0]}` (the call's keyword value, which picks the "
            "forward's arm) before the site's first statement, and the site assigns it")
