"""s47 review (helper review47) of two s45 moe readers review46 left open.

* ``_moe_s45h.one_d`` read ``y[c]`` with ``y`` 1-D and ``c`` ANY comparison as 1-D (a boolean mask keeps the rank).
  That holds for a mask tensor of rank >= 1 only: a comparison of Python numbers (``y[k > 0]``, ``k`` an int) is a
  Python bool and a comparison of 0-d tensors (``y[w.sum() > 0]``) a 0-d bool, and indexing with either ADDS an axis
  (``[1, n]`` or ``[0, n]``), as ``None`` does. :func:`mask_of` requires one side of the comparison to be shown 1-D
  (then the mask is 1-D, or the original raises on a mask of another shape).
* ``_moe_s45a.flattens`` read ``E.view(<any BinOp>)`` as a reshape to one dim. A BinOp of tuples is a shape of several
  dims: ``E.view(E.shape[:-1] + (-1,))`` (the common "keep the leading dims" idiom), ``E.reshape((n,) + rest)``.
  :func:`size_expr` accepts arithmetic whose leaves are numbers: int constants, names / attributes (read as numbers,
  as before), ``t.size(i)`` / ``t.shape[i]`` / ``t.numel()`` / ``len(..)`` / ``int(..)``; a tuple, a list, a slice of
  a shape, a whole ``.shape`` / ``.size()`` refuse.
"""

from __future__ import annotations

import ast
from typing import Any, Callable


def mask_of(module: Any, scope: Any, node: ast.expr, line: int, depth: int,
            one_d: Callable[..., bool]) -> bool:
    """``node`` is a boolean mask of rank 1 (a comparison one side of which is shown 1-D, through a name)."""
    if isinstance(node, ast.Name):
        value = scope.definition(node.id, line)
        return value is not None and depth > 0 and mask_of(module, scope, value, getattr(value, "lineno", line), depth - 1, one_d)
    return isinstance(node, ast.Compare) and len(node.ops) == 1 \
        and isinstance(node.ops[0], (ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq)) \
        and any(one_d(module, scope, s, line, depth - 1) for s in (node.left, node.comparators[0]))


_ARITH = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)


def size_expr(node: ast.expr) -> bool:
    """``node`` is integer arithmetic (see the module docstring): a size, not a shape of several dims."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int) and not isinstance(node.value, bool)
    if isinstance(node, (ast.Name, ast.Attribute)):
        return not (isinstance(node, ast.Attribute) and node.attr == "shape")
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, _ARITH) and size_expr(node.left) and size_expr(node.right)
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.USub) and size_expr(node.operand)
    if isinstance(node, ast.Subscript):  # ``t.shape[0]``: one dim's size (a slice is a shape)
        return not isinstance(node.slice, (ast.Slice, ast.Tuple))
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "size":
            return len(node.args) == 1 and not node.keywords
        if isinstance(f, ast.Attribute) and f.attr in ("numel", "nelement"):
            return not node.args
        return isinstance(f, ast.Name) and f.id in ("len", "int")
    return False
