"""s47 (sweep47a): the halves of x upcast to fp32 before a written-out rotation.

nanogpt-to-chat's ``rope_apply``: ``x1 = x[..., :half]; x2 = x[..., half:]; x1 = x1.float(); x2 = x2.float()``,
then ``cat([x1*cos - x2*sin, x1*sin + x2*cos]).type_as(x)`` (also spelt ``x1 = x[..., :half].float()`` inline).
The halves reader (``rope._Halves.part``) took a half only as a slice / chunk / unbind of x, so a half that went
through ``.float()`` (bound to a name, or rebinding its own name) was no half and the rope was missed without a near
miss. Here such a value gives back the tensor under the cast: the half of x, read in fp32. The readers that accept
it widen the fused computation to fp32 (the eager products are fp32 whatever x's dtype), through the same
``upcast`` flag the canonical lane reader already sets for ``x.float().reshape(..., -1, 2).unbind(-1)``.
Only fp32 casts are seen through (a cast to bf16 / fp16 would round the halves before the rotation).
"""

from __future__ import annotations

import ast
from typing import Callable, Optional

from npufuse.scan.dataflow import Scope

_FP32 = {"torch.float32", "torch.float"}


def _is_fp32_cast(node: ast.AST) -> bool:
    """``t.float()`` / ``t.to(torch.float32)`` / ``t.to(dtype=torch.float32)`` / ``t.type(torch.float32)``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    attr = node.func.attr
    if attr == "float":
        return not node.args and not node.keywords
    if attr in ("to", "type"):
        args = list(node.args) + [k.value for k in node.keywords if k.arg == "dtype"]
        other = [k for k in node.keywords if k.arg not in ("dtype",)]
        return len(args) == 1 and not other and ast.unparse(args[0]) in _FP32
    return False


def fp32_inner(scope: Scope, node: ast.expr, resolve: Callable[[Scope, ast.expr], ast.expr]) -> Optional[ast.expr]:
    """The tensor ``t`` where ``node`` is (inline or through local names, ``resolve``) an fp32 cast of it; None
    otherwise. A name rebinding itself (``x1 = x1.float()``) gives the ``x1`` inside the cast, whose own line makes
    the readers resolve it to the binding before."""
    value = resolve(scope, node)
    if _is_fp32_cast(value):
        return value.func.value  # type: ignore[attr-defined]
    return None


_NARROW = {"torch.bfloat16", "torch.float16", "torch.half"}


def _narrowing_cast(node: ast.AST) -> Optional[str]:
    """The text of a cast to bf16 / fp16 (``.half()``, ``.bfloat16()``, ``.to(torch.bfloat16)``, ...), else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    attr = node.func.attr
    if attr in ("half", "bfloat16") and not node.args and not node.keywords:
        return f".{attr}()"
    if attr in ("to", "type"):
        args = list(node.args) + [k.value for k in node.keywords if k.arg == "dtype"]
        if len(args) == 1 and ast.unparse(args[0]) in _NARROW:
            return f".{attr}({ast.unparse(args[0])})"
    return None


def upcast_lane_source(module, scope: Scope, factors: list[ast.expr], line: int, kind: str,
                       resolve: Callable[[Scope, ast.expr], ast.expr], lane_of) -> tuple[Optional[ast.expr], str]:
    """(the tensor whose halves the product ``factors`` read through an fp32 cast, "") where a factor is such a half
    (``x1`` bound to ``x1.float()`` of ``x[..., :h]``); (None, reason) where a factor is a half cast to bf16 / fp16
    instead (the eager rotation rounds the halves first: a near miss); (None, "") otherwise."""
    for f in factors:
        value = resolve(scope, f)
        narrow = _narrowing_cast(value)
        inner = value.func.value if (narrow or _is_fp32_cast(value)) else None  # type: ignore[attr-defined]
        if inner is None:
            continue
        lane = lane_of(module, scope, inner, getattr(inner, "lineno", line))
        if lane is None or lane.kind != kind:
            continue
        if narrow:
            return None, (f"the halves of `{ast.unparse(lane.source)}` are cast with `{narrow}` before the rotation "
                          f"(`{ast.unparse(f)}`): they are rounded to that dtype first; only fp32 casts of the halves are "
                          "read as the rotation of x")
        return lane.source, ""
    return None, ""


def cast_halves_source(module, scope: Scope, node: ast.expr, line: int, resolve: Callable[[Scope, ast.expr], ast.expr],
                       lane_of) -> Optional[ast.expr]:
    """The tensor whose half ``node`` is read through an fp32 cast (``x[..., :h].float()`` inline, or a name bound to
    it, also by tuple unpacking); None otherwise."""
    inner = fp32_inner(scope, node, resolve)
    if inner is None:
        return None
    lane = lane_of(module, scope, inner, getattr(inner, "lineno", line))
    return lane.source if lane is not None and lane.kind == "halves" else None


def fp32_part(halves, node: ast.expr, resolve: Callable[[Scope, ast.expr], ast.expr]) -> Optional[str]:
    """``halves.part`` of the tensor under an fp32 cast of ``node`` (the half read in fp32), setting
    ``halves.upcast``; None where ``node`` is no such cast or the tensor under it is no half of x."""
    inner = fp32_inner(halves.scope, node, resolve)
    if inner is None:
        return None
    found = halves._part_read(inner)
    if found is not None:
        halves.upcast = True
    return found


def widen_match(m, halves, x_text: str, atom: Callable[[str], str]) -> None:
    """The fused dtype of a written-out rotation whose halves went through ``.float()``: every half read in fp32
    -> the rotation of ``x.float()`` (the eager products are fp32 with fp32 tables, whatever x's dtype: a float64
    x is narrowed by the cast); a half also read in x's own dtype -> x's dtype promoted with fp32 (what the eager
    mixed products give)."""
    if halves.plain_read:
        m.x_dtype, m.widen = None, "torch.float32"
    else:
        m.x_text, m.x_dtype = f"{atom(x_text)}.float()", "float32"
