"""s49 ho26misc: an nn.RMSNorm built through a parameter whose default is the class.

``def __init__(self, dim, ..., norm_layer: nn.Module = nn.RMSNorm): ... self.q_norm = norm_layer(self.head_dim)``
(HO26b SpeedrunDiT's QK norms; timm-style blocks), also ``norm_layer=partial(nn.RMSNorm, eps=1e-6)`` and a default
None with one ``norm_layer = norm_layer or nn.RMSNorm`` rebinding. The construction is swapped as a written-out
``nn.RMSNorm(...)`` is (:func:`_library_norm.construction_sites`): the swapped forward runs npu_rms_norm only where
``type(self).forward is nn.RMSNorm.forward``, so a caller passing another class (``norm_layer=nn.LayerNorm``) keeps
its own forward, and the weight / eps / normalized_shape are read from the instance (keyword arguments at the call,
``norm_layer(d, eps=1e-5)``, or bound by the partial, included).
"""

from __future__ import annotations

import ast
from typing import Callable

from npufuse.patterns import _site as S
from npufuse.scan.dataflow import ModuleInfo, Scope, dotted

_PARTIAL = ("functools.partial",)


def _default_ctor(module: ModuleInfo, value: ast.expr | None, ctor_call: Callable) -> str | None:
    """The RMSNorm class a parameter default constructs when called: ``nn.RMSNorm`` (or a forward-less subclass),
    or ``partial(<that>, **keywords)`` (keywords only: a bound positional would shift the caller's arguments)."""
    if value is None:
        return None
    if isinstance(value, ast.Call):
        if module.canonical(value.func) not in _PARTIAL and dotted(value.func) not in ("partial", "functools.partial"):
            return None
        if len(value.args) != 1 or any(k.arg is None for k in value.keywords):
            return None
        inner = _default_ctor(module, value.args[0], ctor_call)
        return f"partial({inner}, ...)" if inner else None
    if not isinstance(value, (ast.Name, ast.Attribute)):
        return None
    # the class called with no arguments: _ctor_call reads the callee only
    return ctor_call(module, ast.Call(func=value, args=[], keywords=[]))


def param_defaults(module: ModuleInfo, scope: Scope, ctor_call: Callable) -> dict[str, str]:
    """Parameters of the scope's function whose default constructs an nn.RMSNorm (name -> what it builds), the
    parameter not rebound in the body except by one ``p = p or <class>`` over a default None."""
    fn = scope.node
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {}
    cached = scope.__dict__.get("_npufuse_s49_rms_params")
    if cached is not None:
        return cached
    a = fn.args
    pos = [*a.posonlyargs, *a.args]
    pairs = list(zip(pos, [None] * (len(pos) - len(a.defaults)) + list(a.defaults))) + list(zip(a.kwonlyargs, a.kw_defaults))
    out: dict[str, str] = {}
    text = S.scope_text(module, scope)
    # a class default, or a default None with a ``p = p or <class>`` rebinding (the text names it)
    pairs = [(p, d) for p, d in pairs if d is not None and (_default_ctor(module, d, ctor_call) or
                                                           isinstance(d, ast.Constant) and d.value is None and f"{p.arg} or " in text)]
    if not pairs:
        scope.__dict__["_npufuse_s49_rms_params"] = out
        return out
    writes: dict[str, list[ast.stmt]] = {}
    for st in S._stmts_in(fn.body):
        for name in S.names_written(st):
            writes.setdefault(name, []).append(st)
    for p, default in pairs:
        rebinds = writes.get(p.arg, [])
        if rebinds:
            st = rebinds[0]
            if not (len(rebinds) == 1 and isinstance(st, ast.Assign) and len(st.targets) == 1
                    and isinstance(st.targets[0], ast.Name) and isinstance(st.value, ast.BoolOp)
                    and isinstance(st.value.op, ast.Or) and len(st.value.values) == 2
                    and isinstance(st.value.values[0], ast.Name) and st.value.values[0].id == p.arg
                    and (default is None or (isinstance(default, ast.Constant) and default.value is None))
                    and any(st is b for b in fn.body)):
                continue
            default = st.value.values[1]
        what = _default_ctor(module, default, ctor_call)
        if what:
            out[p.arg] = f"{what} (default of `{p.arg}`)"
    scope.__dict__["_npufuse_s49_rms_params"] = out
    return out


def param_ctor(call: ast.Call, params: dict[str, str], stmt: ast.stmt | None = None) -> str | None:
    """``norm_layer(dim, ...)`` with ``norm_layer`` one of :func:`param_defaults`; None inside a comprehension's iterable
    of ``stmt`` (the guarded swap binds a name with ``:=``, which Python refuses there)."""
    f = call.func
    what = params.get(f.id) if isinstance(f, ast.Name) else None
    if what is None or stmt is None:
        return what
    for c in ast.walk(stmt):
        if isinstance(c, ast.comprehension) and any(n is call for n in ast.walk(c.iter)):
            return None
    return what


def wrapped(call: ast.Call, params: dict[str, str], swap: str, T: str, src: str) -> str | None:
    """The swapped construction for a parameter's call: the caller may pass any class (one whose forward takes more
    than the input among them), so only an instance of nn.RMSNorm gets the swapped forward."""
    if param_ctor(call, params) is None:
        return None
    return f"({swap}(_npufuse_norm) if isinstance(_npufuse_norm := {src}, {T}.nn.RMSNorm) else _npufuse_norm)"
