"""s46 (ho23fix46): a complex rope's pair view whose shape is built in a separate value.

HO23b tktts: ``complex_shape = x.shape[:-1] + (-1, 2)`` then ``x.float().reshape(complex_shape)`` before
``view_as_complex``. The view is ``x.reshape(*x.shape[:-1], -1, 2)`` spelled with one shape argument, so the
complex-rope reading reported "pairs are not formed by reshape(..., -1, 2)", which is untrue. Here such a call is
given back with its shape written out as separate arguments (the tuple / list displays and concatenations of them
flattened, anything else starred), which the existing pair-view test reads.
"""

from __future__ import annotations

import ast
from typing import Optional

from npufuse.patterns import _rope_s48r
from npufuse.scan.dataflow import Scope

_VIEWS = ("reshape", "view")


def _shape_parts(scope: Scope, node: ast.expr, line: int, depth: int = 0) -> Optional[list[ast.expr]]:
    """The sizes a shape value lists, in order (a starred entry for a sub-shape kept whole), or None when the value
    is not a display, a ``+`` of displays / shapes, or a name bound once before ``line`` to one of those."""
    if depth > 4:
        return None
    if isinstance(node, (ast.Tuple, ast.List)):
        return list(node.elts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _shape_parts(scope, node.left, line, depth + 1)
        right = _shape_parts(scope, node.right, line, depth + 1)
        if left is None and right is None:
            return None  # a sum of two opaque values: maybe numbers, not shapes
        return (left if left is not None else [ast.Starred(value=node.left, ctx=ast.Load())]) \
            + (right if right is not None else [ast.Starred(value=node.right, ctx=ast.Load())])
    if isinstance(node, ast.Name):
        defs = scope.assignments.get(node.id, [])
        if len(defs) != 1 or defs[0][0].lineno >= line or node.id in scope.args or not _rope_s48r.stored_once(scope, node.id):
            return None  # bound once, before the view (no other path can give it another value; s48: for / with too)
        return _shape_parts(scope, defs[0][1], defs[0][0].lineno, depth + 1)
    return None


def shape_spelled_out(scope: Scope, node: ast.expr, line: int) -> Optional[ast.Call]:
    """``t.reshape(s)`` / ``t.view(s)`` with ``s`` a shape built as a display or a concatenation (inline or in a name
    bound once before ``line``), rewritten as ``t.reshape(*parts)``; None for any other expression."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _VIEWS
            and len(node.args) == 1 and not node.keywords and not isinstance(node.args[0], ast.Starred)):
        return None
    parts = _shape_parts(scope, node.args[0], line)
    if not parts:
        return None
    return ast.copy_location(ast.Call(func=node.func, args=parts, keywords=[]), node)
