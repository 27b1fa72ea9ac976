"""s49 ho26misc: an interleaved rope written as strided slice assignments into a clone of the input, the fills not
right after the clone.

``out = x.clone()`` then ``out[..., 0::2] = x1 * cos - x2 * sin; out[..., 1::2] = x1 * sin + x2 * cos`` with the halves
named in between (``x1, x2 = x[..., 0::2], x[..., 1::2]``), or the two fills written twice in the arms of an ``if``
whose arms are the same code (HO26a cr21's ``if is_4d: <fills> else: <same fills>``). The fills cover every lane of the
last dim, so nothing of the copy survives: the buffer is read as ``torch.empty_like(x)`` (_rope._s42_clone_as_empty_like)
and the fills as one ``out = stack((a, b), -1).flatten(-2)`` (canonical.filled_output), as the adjacent spelling is.
The clone stays as written (the fused call rebinds ``out`` where the fills were); statements between the clone and the
fills must not name ``out`` nor rebind the cloned tensor (the buffer has the clone's dtype and shape, the fused result
is cast to x's dtype). An ``if`` is read only when its test holds no call and both arms are the same statements.
"""

from __future__ import annotations

import ast
from typing import Any

from npufuse.patterns import _site as S


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _fill(st: ast.stmt, out: str) -> bool:
    return isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Subscript) \
        and isinstance(st.targets[0].value, ast.Name) and st.targets[0].value.id == out


def clone_fills(block: list[ast.stmt], i: int, stmt: ast.stmt, filled_output: Any, pair_axis_output: Any,
                clone_as_empty_like: Any) -> tuple[int, ast.Assign, list[ast.stmt]] | None:
    """(index of the fills' first statement in ``block``, one statement ``out = <value>`` spanning the fills, the fill
    statements) for the allocation ``out = x.clone()`` at ``block[i]``; None for any other statement or shape (the
    fills right after the clone are :func:`rope._filled_site`'s)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == "clone"
            and isinstance(stmt.value.func.value, ast.Name)):
        return None
    out, src = stmt.targets[0].id, stmt.value.func.value.id
    alloc = clone_as_empty_like(stmt)
    if alloc is None:
        return None
    j = i + 1
    while j < len(block) and out not in _names(block[j]):
        if src in S.names_written(block[j]) or isinstance(block[j], (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return None  # the cloned tensor rebound (its dtype / shape may change): not the buffer the fills write
        j += 1
    if j >= len(block):
        return None
    head = block[j]
    if isinstance(head, ast.If):
        arms = head.body, head.orelse
        if len(arms[0]) != 2 or [ast.dump(s) for s in arms[0]] != [ast.dump(s) for s in arms[1]] \
                or any(isinstance(n, (ast.Call, ast.NamedExpr, ast.Await)) for n in ast.walk(head.test)):
            return None
        fills, span = list(arms[0]), head
    elif j == i + 1 or j + 1 >= len(block):
        return None  # adjacent: the canonical spelling (rope._filled_site)
    else:
        fills, span = [block[j], block[j + 1]], block[j + 1]
    if not all(_fill(f, out) for f in fills):
        return None
    value = ast.copy_location(ast.Call(func=alloc.value.func, args=alloc.value.args, keywords=[]), head)
    moved = ast.copy_location(ast.Assign(targets=alloc.targets, value=value), head)
    found = filled_output([moved, *fills]) or pair_axis_output(moved, fills)
    if found is None:
        return None
    # the value the reading builds spans (the allocation's place ..) the second fill: here the fills' whole span (the
    # ``if`` with both arms), which the fused call replaces
    last = fills[1]
    for n in ast.walk(found[1]):
        if getattr(n, "lineno", None) == head.lineno and getattr(n, "col_offset", None) == head.col_offset \
                and getattr(n, "end_lineno", None) == last.end_lineno and getattr(n, "end_col_offset", None) == last.end_col_offset:
            n.end_lineno, n.end_col_offset = span.end_lineno, span.end_col_offset  # type: ignore[attr-defined]
    target = ast.copy_location(ast.Name(id=out, ctx=ast.Store()), head)
    site = ast.copy_location(ast.Assign(targets=[target], value=found[1]), head)
    site.end_lineno, site.end_col_offset = span.end_lineno, span.end_col_offset
    site.npufuse_alloc = alloc.value  # type: ignore[attr-defined]
    return j, site, fills
