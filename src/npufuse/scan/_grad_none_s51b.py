"""s51 (optim51b): a list of PARAMETERS filtered by ``p.grad is not None`` whose every use only reduces the grads'
norms (nanoMolmo2's ``compute_gradient_norm``).

``params = [p for p in model.parameters() if p.grad is not None]`` then ``if len(params) == 0: return torch.tensor(0.0)``,
``device = params[0].grad.device``, ``max(p.grad.detach().abs().max() for p in params)`` or
``torch.norm(torch.stack([torch.norm(p.grad.detach(), t) for p in params]), t)``. Under a fused optimizer a parameter
that got no grad in a step holds a zero grad instead of None: it adds a 0 to the norms a p-norm (or a max of absolute
values) reduces, so the value is the same; ``len(..) == 0`` only changes which of two zeros is returned (the total of
no norms is 0 too), and the first grad's device is the device of the grads either way. s41's reader took lists of
GRADS (``[p.grad for p ..]``); this one takes the parameters themselves, read only through ``.grad`` so.
"""

from __future__ import annotations

import ast
from typing import Optional

_TOTAL = frozenset(("norm", "vector_norm"))
_THROUGH = ("detach", "float", "double", "abs")


def _called(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _grad_of(x: Optional[ast.AST], name: str) -> bool:
    """``name.grad`` (through ``.data`` / ``.detach()`` / ``.float()``)."""
    while isinstance(x, ast.Call) and isinstance(x.func, ast.Attribute) and x.func.attr in ("detach", "float", "double") and not x.args:
        x = x.func.value
    while isinstance(x, ast.Attribute) and x.attr == "data":
        x = x.value
    return isinstance(x, ast.Attribute) and x.attr == "grad" and isinstance(x.value, ast.Name) and x.value.id == name


def _norm_of_grad(expr: ast.AST, name: str) -> bool:
    """``torch.norm(p.grad.detach(), t)`` / ``p.grad.norm(t)`` / ``torch.linalg.vector_norm(p.grad, t)``."""
    if not (isinstance(expr, ast.Call) and _called(expr) in _TOTAL):
        return False
    f = expr.func
    library = isinstance(f, ast.Name) or (isinstance(f, ast.Attribute) and (
        (isinstance(f.value, ast.Name) and f.value.id == "torch") or (isinstance(f.value, ast.Attribute) and f.value.attr == "linalg")))
    x = (expr.args[0] if expr.args else None) if library else f.value if isinstance(f, ast.Attribute) else None
    return _grad_of(x, name)


def _max_abs_of_grad(expr: ast.AST, name: str) -> bool:
    """``p.grad.detach().abs().max()`` / ``p.grad.abs().max()``: the largest absolute value (>= 0, 0 for a zero grad)."""
    if not (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in ("max", "amax") and not expr.args):
        return False
    x = expr.func.value
    if not (isinstance(x, ast.Call) and isinstance(x.func, ast.Attribute) and x.func.attr == "abs" and not x.args):
        return False
    return _grad_of(x.func.value, name)


def _negative_order(order: Optional[ast.AST]) -> bool:
    return (isinstance(order, ast.UnaryOp) and isinstance(order.op, ast.USub)) or (
        isinstance(order, ast.Constant) and isinstance(order.value, (int, float)) and order.value < 0)


def _use_reads_norms_only(use: ast.Name, parents: dict[int, ast.AST]) -> bool:
    up = parents.get(id(use))
    # `len(params) == 0` / `len(params)`: how many got a grad -- only chooses between two zeros (see the module doc)
    if isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id == "len" and up.args == [use]:
        cmp = parents.get(id(up))
        return isinstance(cmp, ast.Compare) and len(cmp.ops) == 1 and isinstance(cmp.ops[0], (ast.Eq, ast.NotEq)) \
            and isinstance(cmp.comparators[0], ast.Constant) and cmp.comparators[0].value == 0
    # `params[0].grad.device`
    if isinstance(up, ast.Subscript) and up.value is use and isinstance(up.slice, ast.Constant) and up.slice.value == 0:
        grad = parents.get(id(up))
        dev = parents.get(id(grad))
        return isinstance(grad, ast.Attribute) and grad.attr == "grad" and isinstance(dev, ast.Attribute) and dev.attr == "device"
    # the iterable of a one-generator comprehension over the params
    if not (isinstance(up, ast.comprehension) and up.iter is use and not up.ifs and isinstance(up.target, ast.Name)):
        return False
    comp = parents.get(id(up))
    if not (isinstance(comp, (ast.ListComp, ast.GeneratorExp)) and len(comp.generators) == 1):
        return False
    target = up.target.id
    call = parents.get(id(comp))
    if isinstance(comp, ast.GeneratorExp) and _max_abs_of_grad(comp.elt, target):
        # `max(p.grad.abs().max() for p in params)`: a zero grad adds a 0 to a max of values >= 0
        return isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "max" and call.args == [comp] \
            and not call.keywords
    if not (isinstance(comp, ast.ListComp) and _norm_of_grad(comp.elt, target)):
        return False
    if not (isinstance(call, ast.Call) and _called(call) == "stack" and call.args and call.args[0] is comp):
        return False
    total = parents.get(id(call))
    if not (isinstance(total, ast.Call) and _called(total) in _TOTAL and total.args and total.args[0] is call):
        return False
    order = total.args[1] if len(total.args) > 1 else next((k.value for k in total.keywords if k.arg in ("p", "ord")), None)
    return not _negative_order(order)


def params_read_only_for_norms(comp: ast.AST, name: str, fn: ast.AST, bound: dict[str, ast.AST]) -> bool:
    """Is ``comp`` the list ``[name for name in <params> if name.grad is not None]`` bound to a name in ``fn`` whose
    every use is ``len(..) == 0``, ``X[0].grad.device``, ``max(<name>.grad.abs().max() for ..)`` or a total norm of
    the grads' norms (see the module doc)? A name rebound or read any other way: no."""
    if not (isinstance(comp, ast.ListComp) and isinstance(comp.elt, ast.Name) and comp.elt.id == name and len(comp.generators) == 1):
        return False
    held = next((k for k, v in bound.items() if v is comp), None)
    if held is None:
        return False
    parents: dict[int, ast.AST] = {}
    uses: list[ast.Name] = []
    for n in ast.walk(fn):
        for ch in ast.iter_child_nodes(n):
            parents[id(ch)] = n
        if isinstance(n, ast.Name) and n.id == held:
            if not isinstance(n.ctx, ast.Load) and not (isinstance(parents.get(id(n)), ast.Assign) and parents[id(n)].value is comp):  # type: ignore[attr-defined]
                return False  # rebound elsewhere in the function
            if isinstance(n.ctx, ast.Load):
                uses.append(n)
    return bool(uses) and all(_use_reads_norms_only(u, parents) for u in uses)
