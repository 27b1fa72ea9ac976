"""s47 (helper ho24norm): the rms of a mean over the last dim taken without keepdim, then ``.unsqueeze(-1)``
(``torch.rsqrt((x * x).mean(-1) + eps).unsqueeze(-1)``, ``rms = (x.pow(2).mean(-1) + eps).sqrt(); rms =
rms.unsqueeze(-1)``): putting the reduced last axis back is what keepdim=True does, so the factor is the same
[..., 1] column. Read only with the mean over dim -1 written as such and no keepdim (or keepdim=False); a mean kept
with keepdim=True and unsqueezed again has one axis too many and stays refused (HO24a thepowerfuldeez core.py, HO17b
worldgen rms_norm.py)."""

from __future__ import annotations

import ast
from typing import Any

from npufuse.scan.dataflow import const_value


def _unsqueeze_last(node: ast.expr) -> ast.expr | None:
    """The operand of ``t.unsqueeze(-1)`` / ``torch.unsqueeze(t, -1)`` (dim as a literal -1), else None."""
    if not isinstance(node, ast.Call) or node.keywords:
        return None
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr == "unsqueeze" and len(node.args) == 1 and const_value(node.args[0]) == -1:
        if isinstance(f.value, ast.Name) and f.value.id == "torch":
            return None
        return f.value
    if isinstance(f, ast.Attribute) and f.attr == "unsqueeze" and isinstance(f.value, ast.Name) and f.value.id == "torch" \
            and len(node.args) == 2 and const_value(node.args[1]) == -1:
        return node.args[0]
    return None


def peel_unsqueeze(node: ast.expr, ctx: Any, trace: Any, peel: Any) -> tuple[ast.expr, Any, bool]:
    """``node`` without one trailing ``.unsqueeze(-1)`` (names followed by ``peel``); the flag says one was removed."""
    inner = _unsqueeze_last(node)
    if inner is None:
        return node, ctx, False
    n, c = peel(inner, ctx, trace)
    return n, c, True


def mark(module: Any, rnode: ast.AST) -> None:
    module.__dict__.setdefault("_npufuse_s47n_unsqueezed", set()).add(id(rnode))


def keepdim_by_unsqueeze(module: Any, rstd: ast.AST, dim: ast.expr | None, keepdim: ast.expr | None) -> bool | None:
    """For the root ``rstd`` of a mean over ``dim`` with ``keepdim``: True where its column was restored by
    ``.unsqueeze(-1)`` of a mean over -1 without keepdim, False where a kept mean was unsqueezed again (one axis too
    many), None where no unsqueeze was read (keepdim decides as before)."""
    if id(rstd) not in module.__dict__.get("_npufuse_s47n_unsqueezed", ()):
        return None
    if const_value(keepdim) is True:
        return False
    return (keepdim is None or const_value(keepdim) is False) and dim is not None and const_value(dim) == -1
