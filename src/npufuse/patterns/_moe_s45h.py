"""s45 (helper ho22fix45): moe_experts forms the HO22 blind judge found missed, read by class.

1. A per-expert loop in a helper method (``self._compute_expert_outputs(x, routing_weights, selected_experts)``,
   DriveDiT) whose routing weights and top-k indices are the method's parameters: that they have one shape (what
   reads ``(w * (idx == e)).sum(1)`` as the weight of expert e) is shown at the method's callers. Every call of the
   method in the file (``self.<method>(...)`` inside its own class, the only way the file reaches it) must bind the
   two parameters to names the caller shows shaped alike (a router's top-k values and indices); a reference to the
   method other than such a call, or none, shows nothing.
"""

from __future__ import annotations

import ast
from typing import Callable, Optional

from npufuse.scan.dataflow import ModuleInfo, Scope, fast_walk


def _own_calls(scope: Scope, method: str) -> list[ast.Call]:
    out: list[ast.Call] = []
    stack = list(ast.iter_child_nodes(scope.node))
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue  # a nested function is a scope of its own
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == method \
                and isinstance(n.func.value, ast.Name) and n.func.value.id == "self":
            out.append(n)
        stack.extend(ast.iter_child_nodes(n))
    return out


def _argument(fn: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call, name: str) -> Optional[ast.expr]:
    """The caller's expression bound to the parameter ``name`` of the method ``fn`` (``self`` skipped)."""
    params = [p.arg for p in (*fn.args.posonlyargs, *fn.args.args)][1:]
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None
    for k in call.keywords:
        if k.arg == name:
            return k.value
    if name in params and params.index(name) < len(call.args):
        return call.args[params.index(name)]
    return None


def shaped_alike_at_callers(module: ModuleInfo, scope: Scope, weights: str, indices: str, line: int,
                            shaped_alike: Callable[[ModuleInfo, Scope, str, str, int], bool]) -> bool:
    """Whether ``weights`` and ``indices``, parameters of the method ``scope`` (not rebound before ``line``), are bound
    at every call of the method to names ``shaped_alike`` holds for in the caller."""
    fn = scope.node
    if scope.class_name is None or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) \
            or weights not in scope.args or indices not in scope.args \
            or scope.definition(weights, line) is not None or scope.definition(indices, line) is not None:
        return False
    if fn.decorator_list:
        return False  # a static / class method, a property: not the plain ``self.<method>(...)`` read here
    if sum(1 for n in fast_walk(module.tree) if isinstance(n, ast.Attribute) and n.attr == fn.name) \
            != sum(len(_own_calls(s, fn.name)) for s in module.scopes if s.class_name == scope.class_name):
        return False  # the method is reached otherwise too (another object's, a stored bound method)
    if id(scope) in _IN_PROGRESS:
        return False  # methods binding each other's parameters: nothing shown
    _IN_PROGRESS.add(id(scope))
    try:
        return _every_call_binds(module, scope, fn, weights, indices, shaped_alike)
    finally:
        _IN_PROGRESS.discard(id(scope))


_IN_PROGRESS: set[int] = set()


def _every_call_binds(module: ModuleInfo, scope: Scope, fn: ast.FunctionDef | ast.AsyncFunctionDef, weights: str,
                      indices: str, shaped_alike: Callable[[ModuleInfo, Scope, str, str, int], bool]) -> bool:
    found = False
    for caller in (s for s in module.scopes if s.class_name == scope.class_name and s is not scope):
        for call in _own_calls(caller, fn.name):
            w, i = _argument(fn, call, weights), _argument(fn, call, indices)
            if not (isinstance(w, ast.Name) and isinstance(i, ast.Name)) or not shaped_alike(module, caller, w.id, i.id, call.lineno):
                return False
            found = True
    return found
