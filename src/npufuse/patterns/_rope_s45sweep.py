"""s45 (helper sweep45): rope forms the s45 recall sweep found missed, read by class.

1. Interleaved pairs cut with x's dims spelled one by one from an unpacking of its shape
   (``b, s, h, d = q.shape``; ``q_pairs = q.reshape(b, s, h, d // 2, 2)``), the rotated pairs written into
   ``torch.zeros_like(q_pairs)`` (a Chinese Qwen3 inference engine): the buffer is x's ``(.., D/2, 2)`` pair view as
   surely as with ``*q.shape[:-1]``. Accepted: every leading argument is x's own dim at that position (a name
   unpacked from ``x.shape`` or ``x.shape[i]`` / ``x.size(i)``), the pair-count argument is x's last dim ``// 2``
   (or ``-1``), the last argument 2. Near miss kept: any other leading size (the pairs of another tensor's shape).
"""

from __future__ import annotations

import ast
from typing import Callable, Optional

from npufuse.scan.dataflow import Scope, const_value, same_expr


def _dim_index(node: ast.expr, x: ast.expr) -> Optional[int]:
    """i where ``node`` is ``x.shape[i]`` / ``x.size(i)`` (i a literal int); None otherwise."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape" \
            and same_expr(node.value.value, x):
        i = const_value(node.slice)
        return i if isinstance(i, int) and not isinstance(i, bool) else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size" \
            and same_expr(node.func.value, x) and len(node.args) == 1 and not node.keywords:
        i = const_value(node.args[0])
        return i if isinstance(i, int) and not isinstance(i, bool) else None
    return None


def _unpacked_dim_index(scope: Scope, node: ast.expr, x: ast.expr, resolve: Callable[[Scope, ast.expr], ast.expr]) -> Optional[int]:
    """i where ``node`` (through local names) is x's dim i: ``b, s, h, d = x.shape`` makes ``s`` dim 1."""
    return _dim_index(resolve(scope, node), x)


def spelled_pair_view_of(scope: Scope, view: ast.AST, x: ast.expr, resolve: Callable[[Scope, ast.expr], ast.expr]) -> bool:
    """Is ``view`` ``x.view(d0, .., d_{n-2}, d_last // 2, 2)`` / ``.reshape(..)`` with every leading argument x's own
    dim at its position, the pair count x's last dim halved (or -1) and the last argument 2?"""
    if not (isinstance(view, ast.Call) and isinstance(view.func, ast.Attribute) and view.func.attr in ("view", "reshape")
            and same_expr(view.func.value, x) and not view.keywords and len(view.args) >= 3):
        return False
    args = view.args
    if any(isinstance(a, ast.Starred) for a in args) or const_value(args[-1]) != 2:
        return False
    ndim = len(args) - 1  # x's rank: the pair axis splits x's last dim in two
    for i, a in enumerate(args[:-2]):
        j = _unpacked_dim_index(scope, a, x, resolve)
        if j is None or j not in (i, i - ndim):
            return False
    count = args[-2]
    if const_value(count) == -1:
        return True
    if not (isinstance(count, ast.BinOp) and isinstance(count.op, ast.FloorDiv) and const_value(count.right) == 2):
        return False
    j = _unpacked_dim_index(scope, count.left, x, resolve)
    return j is not None and j in (ndim - 1, -1)
