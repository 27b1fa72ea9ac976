"""moe_experts constructs of the s42 pass b (helper moe42b): recall classes of the s42 blind judge and the moesweep42
development sweep, read by small hooks in :mod:`npufuse.patterns.moe_experts`.

* A top-k slot loop nested INSIDE the expert loop (``for e in range(E): for k in range(K): m = idx[:, k] == e``):
  the outer loop is the expert loop when its variable picks the expert module (``self.experts[e]``), not the
  slot-outer form ``for k: for e: ...`` (:func:`outer_variable_picks_experts`).
"""

from __future__ import annotations

import ast

from npufuse.scan.dataflow import dotted, fast_walk


def _picks_experts(node: ast.Subscript, var: str) -> bool:
    """``<...>experts[var]``: the subscript indexes an experts container by ``var``."""
    base = dotted(node.value) or ""
    return base.split(".")[-1].lower().endswith("experts") and isinstance(node.slice, ast.Name) and node.slice.id == var


def outer_variable_picks_experts(outer: ast.For, inner: ast.For) -> bool:
    """Whether the outer loop's variable indexes an experts container inside ``inner`` while the inner loop's does
    not: then the outer loop is the expert loop and the inner one runs over top-k slots (not the slot-outer form)."""
    if not (isinstance(outer.target, ast.Name) and isinstance(inner.target, ast.Name)):
        return False
    subs = [n for n in fast_walk(inner) if isinstance(n, ast.Subscript)]
    return any(_picks_experts(n, outer.target.id) for n in subs) and not any(_picks_experts(n, inner.target.id) for n in subs)
