"""Attention constructs of the s37 pass (HO13 development data).

* A term added to the scores through a reshape of them (Swin-style window attention, in many repositories:
  ``attn = attn.view(B_ // nW, nW, H, N, N) + mask.unsqueeze(1).unsqueeze(0)`` then ``attn = attn.view(-1, H, N, N)``):
  both views are views of the same [B, H, Sq, Skv] scores, so the sum is the scores plus the term broadcast in the
  viewed shape and brought back: ``(zeros_like(scores).view(A) + M).view_as(scores)``
  (:func:`view_around_add`). The term goes to pse (its values may be any float: Swin's -100 shift mask, a
  per-window bias), exact for every value; the fused branch computes it on a zero tensor of the scores' shape
  (which the pse is expanded to anyway) and never computes the scores.
"""

from __future__ import annotations

import ast
from typing import Any, Optional

_VIEWS = ("view", "reshape")


def _view_call(m: Any, node: Any) -> bool:
    """``x.view(...)`` / ``x.reshape(...)`` with positional shape arguments and no keywords."""
    return m.method(node, *_VIEWS) and bool(node.args) and not node.keywords


def view_around_add(m: Any, node: Any, chain: Any, stop: Any) -> Optional[tuple[Any, ast.expr]]:
    """(the scores before the round trip, the term in the scores' shape) where ``node`` is
    ``(s.view(A) + M).view(B)`` (either operand order, ``reshape`` too): ``s`` reaches the scores, ``M`` does not,
    and the view back ``B`` keeps the trailing query / key axes ``A`` ends with (textually the same two last
    arguments): a view that brings the round trip back to the scores' layout. ``s`` must be a named step of the
    scores (the term is built from its shape, never its values). None for anything else."""
    from npufuse.patterns.attention import Ref, deref

    if not _view_call(m, node) or len(node.args) < 2:
        return None
    summed = deref(node.func.value)
    if not (isinstance(summed, ast.BinOp) and isinstance(summed.op, ast.Add)):
        return None
    for inner, term, left in ((summed.left, summed.right, True), (summed.right, summed.left, False)):
        viewed = deref(inner)
        if not (_view_call(m, viewed) and len(viewed.args) > len(node.args)):
            continue
        base = viewed.func.value
        if not isinstance(base, Ref) or not m._reaches(base, stop) or m._reaches(term, stop):
            continue
        if [ast.dump(_plain(a)) for a in viewed.args[-2:]] != [ast.dump(_plain(a)) for a in node.args[-2:]]:
            return None  # the view back does not keep the query / key axes the round trip's view ends with
        deref(node.func.value, chain.seen)
        deref(inner, chain.seen)
        zeros = ast.Call(func=ast.Attribute(value=ast.Name("torch", ast.Load()), attr="zeros_like", ctx=ast.Load()),
                         args=[base], keywords=[])
        spread = ast.Call(func=ast.Attribute(value=zeros, attr=viewed.func.attr, ctx=ast.Load()), args=list(viewed.args),
                          keywords=[])
        total = ast.BinOp(left=spread, op=ast.Add(), right=term) if left else ast.BinOp(left=term, op=ast.Add(), right=spread)
        back = ast.Call(func=ast.Attribute(value=total, attr="view_as", ctx=ast.Load()), args=[base], keywords=[])
        chain.spelling.append("term_added_through_a_view")
        chain.notes.append(f"`{m.src(node)}`: the scores viewed as `{m.src(viewed)[:60]}` to add `{m.src(term)[:60]}`, then viewed "
                           "back: the term is broadcast in the viewed shape and passed in the scores' shape (pse)")
        return base, back
    return None


def _plain(node: Any) -> Any:
    """The node with Refs replaced by their names (for a textual comparison of view arguments)."""
    from npufuse.patterns.attention import _plain as plain

    return plain(node)
