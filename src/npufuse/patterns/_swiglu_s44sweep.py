"""s44 (helper sweep44): swiglu readings the s44 sweep found missed, read by class.

1. The sizes of a split into 3+ parts held by a local name (``split_sizes = [d_mlp, d_mlp, d_inner, ...]``;
   ``z0, x0, z, xBC, dt = torch.split(zxbcdt, split_sizes, dim=-1)``, a Mamba-2 block's parallel MLP branch
   ``silu(z0) * x0``): the list written inline was read as sized parts, the same list through a name was
   counted by its unpacking ("split into 5 parts, not two halves"). The name is followed to its one list /
   tuple literal, which the scope never changes in place.
2. Two slices of one tensor along its last axis with provably equal widths, one cut at both ends
   (``z0 = t[:, :, :d]``; ``x0 = t[:, :, d:2 * d]``): the GLU pair of an in_proj that also carries other
   parts. Only ``[..., :w]``, ``[..., w:2 * w]`` and ``[..., l:l + w]`` are read (widths w, w, w); the
   operands are then taken concatenated, as for the sized parts of a split (exact for any positions).
"""

from __future__ import annotations

import ast
from typing import Optional

from npufuse.patterns import _site as S
from npufuse.scan.dataflow import const_value

# methods that change a list in place: a sizes list the scope mutates is not its literal any more
_MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "reverse", "sort", "__setitem__"})


def _mutated(scope_node: ast.AST, name: str) -> bool:
    """Does the scope change the list ``name`` in place (``name.append(..)``, ``name[i] = ..``, ``name += ..``)?"""
    for n in ast.walk(scope_node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _MUTATORS \
                and isinstance(n.func.value, ast.Name) and n.func.value.id == name:
            return True
        if isinstance(n, (ast.Assign, ast.AugAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == name:
                    return True
                if isinstance(n, ast.AugAssign) and isinstance(t, ast.Name) and t.id == name:
                    return True
    return False


def sizes_literal(size: Optional[ast.expr], ctx: S.Ctx) -> tuple[Optional[ast.expr], S.Ctx]:
    """The list / tuple literal a split's sizes name holds (followed through the scope's one definition before the
    split), with the context its elements are read in; ``(size, ctx)`` unchanged for anything else."""
    if not isinstance(size, ast.Name):
        return size, ctx
    value, vctx, stmt = S.follow(size, ctx)
    if stmt is None or not isinstance(value, (ast.List, ast.Tuple)) or any(isinstance(e, ast.Starred) for e in value.elts):
        return size, ctx
    if _mutated(ctx.scope.node, size.id):
        return size, ctx
    return value, vctx


def _last_axis_slice(node: ast.expr) -> Optional[ast.Slice]:
    """The slice of ``t[..., s]`` / ``t[:, :, s]`` (every other index a full ``:``), unit step; None otherwise."""
    if not isinstance(node, ast.Subscript):
        return None
    elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    if len(elts) < 2:
        return None  # ``t[:w]`` cuts the first axis: not the features
    *lead, last = elts
    if not isinstance(last, ast.Slice) or last.step is not None:
        return None
    for e in lead:
        full = isinstance(e, ast.Slice) and e.lower is None and e.upper is None and e.step is None
        if not (full or (isinstance(e, ast.Constant) and e.value is Ellipsis)):
            return None
    return last


def _width(sl: ast.Slice, ctx: S.Ctx) -> Optional[str]:
    """Key of the width of ``[:w]`` (w), ``[w:2 * w]`` / ``[w:w * 2]`` (w), ``[l:l + w]`` (w); None otherwise."""
    lower = None if sl.lower is not None and const_value(sl.lower) == 0 else sl.lower
    if lower is None:
        return S.key(sl.upper, ctx) if sl.upper is not None else None
    up = sl.upper
    if not (isinstance(up, ast.BinOp) and isinstance(up.op, (ast.Mult, ast.Add))):
        return None
    lk = S.key(lower, ctx)
    if isinstance(up.op, ast.Mult):
        for two, w in ((up.left, up.right), (up.right, up.left)):
            if const_value(two) == 2 and S.key(w, ctx) == lk:
                return lk
        return None
    for base, w in ((up.left, up.right), (up.right, up.left)):
        if S.key(base, ctx) == lk:
            return S.key(w, ctx)
    return None


def equal_width_slices(a: ast.expr, actx: S.Ctx, b: ast.expr, bctx: S.Ctx) -> Optional[str]:
    """Key of the tensor when the GLU operands ``a`` and ``b`` are two slices of it along its last axis with equal
    proven widths and one of them cut at both ends (the other cases are read as halves elsewhere); None otherwise."""
    na, ca = S.peel(a, actx)
    nb, cb = S.peel(b, bctx)
    sa, sb = _last_axis_slice(na), _last_axis_slice(nb)
    if sa is None or sb is None or len(na.slice.elts) != len(nb.slice.elts):  # type: ignore[union-attr]
        return None
    bounded = [s for s in (sa, sb) if s.upper is not None and s.lower is not None and const_value(s.lower) != 0]
    if not bounded:
        return None
    tk = S.key(na.value, ca)  # type: ignore[union-attr]
    if tk != S.key(nb.value, cb):  # type: ignore[union-attr]
        return None
    wa, wb = _width(sa, ca), _width(sb, cb)
    if wa is None or wa != wb:
        return None
    if ast.dump(sa) == ast.dump(sb) and ca.line == cb.line:
        return None  # one slice twice: silu(p) * p is no GLU pair
    return tk
