"""s46 sweep (helper sweep46c): a bias added to the attention scores inside a helper function.

SAM / ViTDet / GOT-OCR / Vary image encoders write ``attn = add_decomposed_rel_pos(attn, q, rel_pos_h, rel_pos_w,
(H, W), (H, W))``: a module-level function that builds two query-dependent relative-position tables from its other
parameters and returns ``(attn.view(B, qh, qw, kh, kw) + rel_h[..., None] + rel_w[..., None, :]).view(B, qh*qw,
kh*kw)``. The scores enter the helper exactly once, as the base of a sum whose other terms never read them, under
views only: the helper is ``s + h(0)``, so the term it adds is ``h(zeros_like(s), ...)``, a float bias for the fused
call's ``pse`` (the scale handling is the s28 bias path's). Anything else the helper does to its first parameter
(a product, a mask, a second use, a loop or a branch) leaves the call unread.
"""

from __future__ import annotations

import ast
from typing import Any, Optional

# s50: fast_walk for ast.walk (the same nodes in the same order; a root walked before in the file is not walked again)
from npufuse.scan.dataflow import fast_walk

_VIEWS = frozenset({"view", "reshape"})


def term_added_by_helper(m: Any, node: Any, chain: Any, stop: Any) -> Optional[tuple[Any, ast.expr]]:
    """(the scores passed in, the term the helper adds) where ``node`` is ``f(s, *args)`` of a module-level
    function that returns its first parameter plus terms of its other parameters only (views allowed around the
    sum); ``s`` must be a named step of the scores and no other argument may reach the scores. None otherwise."""
    from npufuse.patterns.attention import Ref

    if not isinstance(node, ast.Call) or not node.args or any(isinstance(a, ast.Starred) for a in node.args):
        return None
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.name if isinstance(func, Ref) and func.idx == -1 else None
    if name is None or m.scope.assignments.get(name):
        return None  # a local callable is not the module-level function
    base = node.args[0]
    if not isinstance(base, Ref) or not m._reaches(base, stop):
        return None
    if any(m._reaches(a, stop) for a in node.args[1:]) or any(m._reaches(k.value, stop) for k in node.keywords):
        return None
    from npufuse.scan import repo_facts

    found = repo_facts.definition(m.module, name)
    if found is None or not isinstance(found.node, ast.FunctionDef) or not _adds_to_first_parameter(found.node):
        return None
    zeros = ast.Call(func=ast.Attribute(value=ast.Name("torch", ast.Load()), attr="zeros_like", ctx=ast.Load()),
                     args=[base], keywords=[])
    term = ast.Call(func=func, args=[zeros, *node.args[1:]], keywords=list(node.keywords))
    chain.spelling.append("term_added_by_a_helper")
    chain.notes.append(f"`{m.src(node)[:80]}` returns the scores plus terms of its other arguments: the term is the "
                       f"helper run on zeros of the scores' shape (pse)")
    return base, term


def _adds_to_first_parameter(fn: ast.FunctionDef) -> bool:
    """The function's body is straight-line (assignments, a docstring, asserts) ending in one ``return``, its first
    positional parameter is read exactly once (besides a final ``return <it>`` after one rebinding), and that read is
    the base of the returned value's sum (through single assignments of local names and view / reshape calls)."""
    a = fn.args
    if fn.decorator_list or a.vararg or a.kwarg or a.posonlyargs or not a.args:
        return False
    first = a.args[0].arg
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return False
    if not all(isinstance(s, (ast.Assign, ast.Assert)) for s in body[:-1]):
        return False  # loops, branches, in-place statements: the helper is not read
    returned = body[-1].value
    loads = [n for n in fast_walk(fn) if isinstance(n, ast.Name) and n.id == first and isinstance(n.ctx, ast.Load)
             and n is not returned]
    if len(loads) != 1:
        return False
    assigned: dict[str, list[ast.expr]] = {}
    for s in body[:-1]:
        if isinstance(s, ast.Assign):
            for t in s.targets:
                for n in fast_walk(t):
                    if isinstance(n, ast.Name):
                        # a name unpacked from a tuple holds a part of the value: never additive, still what it reads
                        assigned.setdefault(n.id, []).append(s.value if isinstance(t, ast.Name) else ast.Tuple(elts=[s.value], ctx=ast.Load()))
    rebound = assigned.get(first, [])
    if returned is not loads[0] and isinstance(returned, ast.Name) and returned.id == first:
        # ``first = (first.view(..) + t).view(..); return first``: one rebinding that holds the one read
        if len(rebound) != 1 or loads[0] not in set(fast_walk(rebound[0])):
            return False
        returned = rebound[0]
    elif rebound:
        return False
    return _additive(returned, first, assigned, 0)


def _additive(e: ast.expr, first: str, assigned: dict[str, list[ast.expr]], depth: int) -> bool:
    """``e`` is ``first`` (the parameter) plus terms that never read it (view / reshape calls allowed around)."""
    if depth > 12:
        return False
    if isinstance(e, ast.Name):
        if e.id == first:
            return True
        values = assigned.get(e.id, [])
        return len(values) == 1 and not isinstance(values[0], ast.Tuple) and _additive(values[0], first, assigned, depth + 1)
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add):
        left, right = _reads_resolved(e.left, first, assigned), _reads_resolved(e.right, first, assigned)
        if left == right:
            return False
        return _additive(e.left if left else e.right, first, assigned, depth + 1)
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in _VIEWS and not e.keywords:
        if any(_reads_resolved(x, first, assigned) for x in e.args):
            return False
        return _additive(e.func.value, first, assigned, depth + 1)
    return False


def _reads_resolved(e: ast.AST, first: str, assigned: dict[str, list[ast.expr]], depth: int = 0) -> bool:
    """``e`` reads ``first`` directly or through a local name assigned from it."""
    if depth > 12:
        return True
    for n in fast_walk(e):
        if isinstance(n, ast.Name):
            if n.id == first:
                return True
            if n.id in assigned and any(_reads_resolved(v, first, assigned, depth + 1) for v in assigned[n.id]):
                return True
    return False
