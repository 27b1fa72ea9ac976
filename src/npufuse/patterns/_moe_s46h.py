"""s46 (ho23fix46): moe_experts classes behind HO23a misses.

Expert modules called with keyword arguments forwarded unchanged (HO23a tiny-moe:
``self.experts[e](hidden_flat[mask], **kwargs)`` with ``kwargs`` the forward's own ``**kwargs``). The permute /
unpermute layer calls each expert once on its rows; for one expert those rows are the same tokens in the same (token)
order as the loop's ``x[mask]``, so an expert given the same keyword values computes what the loop's call computes.
Sound only where the values are the same at the fused call as at every call of the loop: the function's ``**kwargs``
parameter, or a parameter, never rebound in the function, and constants. The experts then run as they are (their
forward may read the keywords), never as an MLP read off their class.
"""

from __future__ import annotations

import ast
from typing import Optional

from npufuse.scan.dataflow import Scope


def _unbound_parameter(scope: Scope, name: str) -> bool:
    """``name`` is a parameter of the function (``**kw`` included) that no statement of it rebinds."""
    fn = scope.node
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    a = fn.args
    params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)} | {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    if name not in params or name in scope.assignments:
        return False
    # in-place updates (`kwargs.pop(...)`, `kwargs["k"] = v`, `del kwargs[...]`) change what later calls receive
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
                and n.func.value.id == name and n.func.attr in ("pop", "update", "setdefault", "clear", "popitem"):
            return False
        if isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.ctx, (ast.Store, ast.Del)) \
                and isinstance(n.value, ast.Name) and n.value.id == name:
            return False
    return True


def forwarded_keywords(call: ast.Call, scope: Scope) -> Optional[str]:
    """``, k=v, **kw`` (as written) when every keyword of the expert call passes a constant or an unrebound
    parameter of the function (the same value at every expert and at the fused call); None when it has no
    keywords or one that may differ."""
    if not call.keywords:
        return None
    for k in call.keywords:
        v = k.value
        if isinstance(v, ast.Constant):
            continue
        if isinstance(v, ast.Name) and _unbound_parameter(scope, v.id):
            continue
        return None
    return "".join(f", {ast.unparse(k)}" for k in call.keywords)
