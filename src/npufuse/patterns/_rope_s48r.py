"""s48 review48: rope's halves cut at a split point read from x's own shape.

The halves reader (``_Halves._part``) accepts ``x[..., :h]`` / ``x[..., h:]`` at a split point h it cannot prove to
be half of x's last dim, under the run-time check ``x.shape[-1] == 2 * (h)`` (the original code runs where the check
is false). Where h is read from x's OWN shape, the check decides nothing at run time: either h is the half of x's
last dim (``s, _, dim = x.shape[1:]`` then ``dim // 2``: true wherever the width is even) or it is another fraction
of it (``x.shape[-1] // 3``: never true, a dead fused branch) or another dim of x (``b, s, n, d = x.shape`` then
``s // 2``: a cut along the sequence length, true only where two unrelated sizes meet).

:func:`dead_own_split` tells them apart: it evaluates h as a function of x's last dim L (x's shape read through
``x.shape[i]`` / ``x.size(i)``, names bound once, tuple unpacking of ``x.shape`` / ``x.size()`` / an open-ended slice
of either, ``+ - * // >> %``, ``int(a / b)``) and accepts exactly the split points equal to ``L // 2`` for every even
L. A read of another dim of x (an index below -1, an unpacked element other than the last, a slice with an end), or a
term it cannot evaluate beside a read of x's shape, refuses. A positive index ``x.shape[k]`` is read as the last dim
(it is, for x of rank k + 1; the run-time check stays and the original raises for a smaller rank). A split point
that reads no shape of x (a head size, another tensor's width) is left to the run-time check as before.
"""

from __future__ import annotations

import ast
from typing import Any, Callable

from npufuse.scan.dataflow import Scope, const_value

_WIDTHS = range(2, 258, 2)  # even last dims: h must be their half, each one


class _No(Exception):
    pass


class _Reader:
    def __init__(self, scope: Scope, is_x: Callable[[ast.expr], bool]) -> None:
        self.scope = scope
        self.is_x = is_x
        self.own = False  # some read of x's shape was seen

    def _size_of_x(self, node: ast.expr) -> Any:
        """``x.shape`` / ``x.size()`` (a name bound once to one too): the whole shape of x, else None."""
        node = self._bound(node, None)[0]
        if isinstance(node, ast.Attribute) and node.attr == "shape" and self.is_x(node.value):
            return node
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size" \
                and not node.args and not node.keywords and self.is_x(node.func.value):
            return node
        return None

    def _bound(self, node: ast.expr, stmt: ast.stmt | None) -> tuple[ast.expr, ast.stmt | None]:
        for _ in range(8):
            if not isinstance(node, ast.Name):
                break
            binds = self.scope.assignments.get(node.id, [])
            if len(binds) != 1:
                break
            stmt, node = binds[0]
        return node, stmt

    def _dim(self, seq: ast.expr, index: Any, stmt: ast.stmt | None) -> bool | None:
        """Element ``index`` of ``seq``: True where it is x's last dim, False where it is another dim of x, None
        where seq is no shape of x."""
        if type(index) is not int:
            if self._size_of_x(seq) is not None or self._slice_of_shape(seq) is not None:
                self.own = True
                raise _No
            return None
        unpacked = self._unpacked_length(stmt)
        if self._size_of_x(seq) is not None:
            self.own = True
            if index == -1:
                return True
            if index < -1:
                return False
            return index == unpacked - 1 if unpacked is not None else True  # x.shape[k]: last for rank k + 1
        sl = self._slice_of_shape(seq)
        if sl is not None:
            self.own = True
            if sl.upper is not None or sl.step is not None:
                raise _No  # a slice with an end: its elements are not known to reach the last dim
            if index == -1:
                return True
            if index < -1 or unpacked is None:
                return False  # another dim, or an element of the slice not known to be its last
            return index == unpacked - 1
        return None

    def _slice_of_shape(self, node: ast.expr) -> ast.Slice | None:
        node = self._bound(node, None)[0]
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice) and self._size_of_x(node.value) is not None:
            return node.slice
        return None

    @staticmethod
    def _unpacked_length(stmt: ast.stmt | None) -> int | None:
        """n for ``a, b, .., z = value`` (one flat tuple / list target, no starred element), else None."""
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], (ast.Tuple, ast.List)):
            elts = stmt.targets[0].elts
            if all(isinstance(e, ast.Name) for e in elts):
                return len(elts)
        return None

    def value(self, node: ast.expr, width: int, stmt: ast.stmt | None = None, depth: int = 0) -> int:
        """h's value where x's last dim is ``width`` (raises _No where it cannot be read so); ``stmt`` is the
        statement binding ``node`` where node is a name's bound value itself (an unpacked element's target length)."""
        if depth > 24:
            raise _No
        if isinstance(node, ast.Constant):
            if type(node.value) in (int, float):
                return node.value
            raise _No
        if isinstance(node, ast.Name):
            binds = self.scope.assignments.get(node.id, [])
            if len(binds) != 1:
                raise _No  # a parameter or a name bound more than once: not read here
            bstmt, bound = binds[0]
            return self.value(bound, width, bstmt, depth + 1)
        if isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Tuple, ast.List)):
            index = const_value(node.slice)  # ``a, b = x.shape[-1] // 2, c``: a's element of the literal
            if type(index) is not int or not -len(node.value.elts) <= index < len(node.value.elts):
                raise _No
            return self.value(node.value.elts[index], width, None, depth + 1)
        if isinstance(node, ast.Subscript):
            last = self._dim(node.value, const_value(node.slice), stmt)
            if last is None:
                raise _No
            if not last:
                raise _No  # another dim of x
            return width
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size":
            if not self.is_x(node.func.value) or node.keywords or len(node.args) != 1:
                raise _No
            self.own = True
            index = const_value(node.args[0])
            if type(index) is not int or index < -1:
                raise _No
            return width
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "int" \
                and len(node.args) == 1 and not node.keywords:
            return int(self.value(node.args[0], width, None, depth + 1))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self.value(node.operand, width, None, depth + 1)
        if isinstance(node, ast.BinOp):
            a = self.value(node.left, width, None, depth + 1)
            b = self.value(node.right, width, None, depth + 1)
            try:
                if isinstance(node.op, ast.Add):
                    return a + b
                if isinstance(node.op, ast.Sub):
                    return a - b
                if isinstance(node.op, ast.Mult):
                    return a * b
                if isinstance(node.op, ast.FloorDiv):
                    return a // b
                if isinstance(node.op, ast.Div):
                    return a / b
                if isinstance(node.op, ast.Mod):
                    return a % b
                if isinstance(node.op, ast.RShift) and type(a) is int and type(b) is int:
                    return a >> b
            except (ZeroDivisionError, ValueError, TypeError, OverflowError):
                raise _No from None
        raise _No


def reads_own_shape(scope: Scope, is_x: Callable[[ast.expr], bool], h: ast.expr) -> bool:
    """Does the split point h read x's shape (through names bound in the scope, up to 8 deep)?"""
    seen: set[int] = set()
    todo = [(h, 0)]
    while todo:
        node, depth = todo.pop()
        if id(node) in seen or depth > 8:
            continue
        seen.add(id(node))
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and n.attr == "shape" and is_x(n.value):
                return True
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "size" and is_x(n.func.value):
                return True
            if isinstance(n, ast.Name):
                todo.extend((v, depth + 1) for _st, v in scope.assignments.get(n.id, []))
    return False


def dead_own_split(scope: Scope, is_x: Callable[[ast.expr], bool], h: ast.expr) -> bool:
    """True where the split point h is read from x's own shape and is not exactly half of x's last dim (for every
    even width): the run-time check ``x.shape[-1] == 2 * (h)`` would be dead or a coincidence of two dims."""
    if not reads_own_shape(scope, is_x, h):
        return False  # a split point from elsewhere: the run-time check decides
    reader = _Reader(scope, is_x)
    try:
        for width in _WIDTHS:
            if 2 * reader.value(h, width) != width:
                return True
    except _No:
        return True
    return False


# -- item 2: float64 reaching npu_rotary_mul through the forms that compute the eager dtype themselves ----------------

_FUSED_DTYPES = "(torch.float16, torch.bfloat16, torch.float32)"


def matrix_dtype_check(x: ast.expr, pairs_dtype: str | None, prepared: str | None, matrix: str,
                       cast_dtype: Callable[[ast.Call], str | None]) -> str | None:
    """The run-time test that the per-pair matrix product (flux's ``F[..., 0] * xp[..., 0] + F[..., 1] * xp[..., 1]``,
    lingua's ``(xp * F).sum(-1)``) is made in a dtype npu_rotary_mul takes: the product promotes the pairs' dtype
    with the matrix's, and a float64 matrix (flux builds its rope in float64) or float64 pairs make a float64 product,
    which the op does not take (spec 4.1: fp16 / bf16 / fp32): the original code runs there. The pairs' dtype is read
    before the branch without making the pairs: the cast written after the view (``pairs_dtype``), else the cast on
    x (``q.float()``), else x's own (a name), else the prepared ``prepared`` (x made before the branch). None where
    it is not known from the text (a cast like ``type_as(y)``): the caller refuses."""
    if pairs_dtype is not None:
        side = pairs_dtype
    elif isinstance(x, ast.Call) and isinstance(x.func, ast.Attribute) and prepared is None:
        side = cast_dtype(x)  # type: ignore[assignment]
        if side is None:
            return None
    elif isinstance(x, ast.Name):
        side = f"{x.id}.dtype"
    elif prepared is not None:
        side = f"{prepared}.dtype"
    else:
        return None
    return f"torch.promote_types({side}, {matrix}.dtype) in {_FUSED_DTYPES}"


def eager_dtype_check(dtype_var: str) -> str:
    """The run-time test that the eager dtype computed before the branch (``dtype_var``) is one npu_rotary_mul takes
    (the lane-pair forms: a float64 (cos, sin) cache promotes the product to float64; the original code runs)."""
    return f"{dtype_var} in {_FUSED_DTYPES}"


# -- item 3c: "bound once" counts every binding of the name, not only assignments ---------------------------------------

def stored_once(scope: Scope, name: str) -> bool:
    """``name`` is stored exactly once in the scope by any form (``scope.assignments`` holds ``=`` / annotated /
    augmented assignments only: a ``for`` / ``with`` target, a walrus or a ``del`` between also bind it; a nested
    function's own local of that name counts too, which only refuses more)."""
    n = 0
    for node in scope.nodes().get(ast.Name, ()):
        if node.id == name and type(node.ctx) is not ast.Load:  # type: ignore[attr-defined]
            n += 1
            if n > 1:
                return False
    return n == 1
