"""s47 (sweep47a): a norm helper function whose flag parameter picks ``F.rms_norm`` or another norm.

nanogpt-to-chat's ``def norm(x, use_rms=True): if use_rms: return F.rms_norm(x, (x.size(-1),)) else: return
F.layer_norm(x, (x.size(-1),))``, called on the residual sum as ``norm(x, use_rms=self.config.use_rmsnorm)``. The
add_rms_norm reader followed a module-level norm helper only when it has one return (nanochat's ``norm(x)``), so
the sum and the norm were left without a near miss. Here a helper whose body is one ``if <flag>:`` choosing between
two returns, one of them the weightless ``F.rms_norm`` of the helper's input, is read as that library norm where the
flag the call passes is true (the fused code runs under that test, the original code elsewhere). The flag must be a
constant, ``self.<attr>...`` or a parameter of the calling function that it never rebinds (the test is evaluated
again at the site); the helper's other parameters must not be read by the RMS branch.
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Optional

_RMS = "torch.nn.functional.rms_norm"


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]
    return body


def _oriented(test: ast.expr, on_true: ast.expr, on_false: ast.expr) -> Optional[tuple[str, ast.expr, ast.expr]]:
    """(flag name, value where the flag is true, value where it is false) for a test ``flag`` / ``not flag``."""
    negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
    if negated:
        test = test.operand  # type: ignore[attr-defined]
    if not isinstance(test, ast.Name):
        return None
    return (test.id, on_false, on_true) if negated else (test.id, on_true, on_false)


def _choice(fn: ast.FunctionDef) -> Optional[tuple[str, ast.expr, ast.expr]]:
    """(flag parameter, value returned where it is true, value returned where it is false) of a helper whose body is
    ``if flag: return a`` with ``else: return b`` or a following ``return b``, or ``return a if flag else b``
    (``not flag`` swaps them)."""
    body = _body(fn)
    if len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.IfExp):
        e = body[0].value  # ``return F.rms_norm(x, ...) if flag else F.layer_norm(x, ...)``
        return _oriented(e.test, e.body, e.orelse)
    if not body or not isinstance(body[0], ast.If):
        return None
    st = body[0]
    if not (len(st.body) == 1 and isinstance(st.body[0], ast.Return) and st.body[0].value is not None):
        return None
    rest = st.orelse if st.orelse else body[1:]
    if len(body) != (1 if st.orelse else 2) or not (len(rest) == 1 and isinstance(rest[0], ast.Return) and rest[0].value is not None):
        return None
    return _oriented(st.test, st.body[0].value, rest[0].value)


def _bound(call: ast.Call, params: list[str], defaults: dict[str, ast.expr], name: str) -> Optional[ast.expr]:
    """The call's argument for parameter ``name`` (its default where not passed); None where it cannot be told."""
    idx = params.index(name)
    if idx < len(call.args):
        return call.args[idx]
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return defaults.get(name)


def _stable(node: ast.expr, scope: Any) -> bool:
    """A flag the fused code may evaluate again at the site: a constant, ``self.a.b...``, or a parameter of the
    calling function that it never rebinds."""
    if isinstance(node, ast.Constant):
        return True
    base = node
    while isinstance(base, ast.Attribute):
        base = base.value
    if isinstance(base, ast.Name) and base.id == "self" and base is not node:
        return True
    return isinstance(node, ast.Name) and node.id in getattr(scope, "args", ()) and not scope.assignments.get(node.id)


def flagged_function_norm(module: Any, scope: Any, call: ast.Call, fn: ast.FunctionDef, functional_norm: Callable,
                          source_of: Callable[[Any, ast.expr], str], api: Callable[[Any, ast.expr], Optional[str]],
                          miss: Callable[[str], Any]) -> Any:
    """The NormCall of ``norm(x, flag)`` where the helper ``fn`` (this file's) returns the weightless
    ``F.rms_norm(x, ...)`` on the flag's RMS side: ``functional_norm``'s reading with the flag as a condition;
    ``miss(reason)`` where the call always takes the other norm or passes a flag that cannot be read again at the
    site; None for any other helper or call."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None
    if fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs:
        return None
    choice = _choice(fn)
    if choice is None:
        return None
    flag, on_true, on_false = choice
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    if len(params) < 2 or flag not in params[1:]:
        return None
    defaults = dict(zip(params[len(params) - len(fn.args.defaults):], fn.args.defaults))
    rms_side = [v for v in (on_true, on_false) if isinstance(v, ast.Call) and api(module, v.func) == _RMS]
    if len(rms_side) != 1:
        return None
    value = rms_side[0]
    from npufuse.scan.dataflow import keyword

    x = keyword(value, "input", 0)
    if not (isinstance(x, ast.Name) and x.id == params[0]):
        return None
    if {n.id for n in ast.walk(value) if isinstance(n, ast.Name)} & set(params[1:]):
        return None  # the RMS branch reads another parameter: not nameable at the call site
    # the call binds the input first and nothing but the flag besides (the other parameters keep their defaults)
    if not (call.args or any(k.arg == params[0] for k in call.keywords)):
        return None
    passed = {params[i] for i in range(min(len(call.args), len(params)))} | {k.arg for k in call.keywords}
    if len(call.args) > len(params) or not passed <= {params[0], flag} or any(p not in defaults for p in params[1:] if p not in passed):
        return None
    arg = _bound(call, params, defaults, flag)
    if arg is None:
        return None
    name = call.func.id  # type: ignore[attr-defined]
    if not _stable(arg, scope):
        return miss(f"`{name}` picks F.rms_norm or another norm by its parameter `{flag}`, passed here as "
                    f"`{source_of(module, arg)}`: npufuse reads that choice only from a constant, `self.<attr>` or an "
                    "unchanged parameter (the fused code tests it again at the site)")
    rms_when = value is on_true
    condition = ""
    if isinstance(arg, ast.Constant):
        if bool(arg.value) != rms_when:
            other = on_false if rms_when else on_true
            return miss(f"`{name}` is called with `{flag}={source_of(module, arg)}`: it returns "
                        f"`{source_of(module, other)[:80]}`, not its F.rms_norm branch")
    else:
        text = source_of(module, arg)
        condition = f"bool({text})" if rms_when else f"not ({text})"
    nc = functional_norm(module, value, call.func.id)  # type: ignore[attr-defined]
    if nc is None or not nc.ones:
        return None
    nc.call = call
    if condition:
        nc.conditions = [condition, *nc.conditions]
    return nc
