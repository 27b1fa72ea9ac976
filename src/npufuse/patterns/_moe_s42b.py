"""moe_experts constructs of the s42 pass b (helper moe42b): recall classes of the s42 blind judge and the moesweep42
development sweep, read by small hooks in :mod:`npufuse.patterns.moe_experts`.

* A top-k slot loop nested INSIDE the expert loop (``for e in range(E): for k in range(K): m = idx[:, k] == e``):
  the outer loop is the expert loop when its variable picks the expert module (``self.experts[e]``), not the
  slot-outer form ``for k: for e: ...`` (:func:`outer_variable_picks_experts`).
* Flat (token, slot) rows accumulated into zeros (``y[flat == e] += v`` / ``y[m] = y[m] + v``, DeepSeek's
  ``y[flat == e] = v`` written as a sum): each flat row belongs to one expert, so adding into zeros is the
  assignment (:func:`made_as_zeros`, :func:`spelled_out_sum`); into an ``empty`` buffer it is not read.
"""

from __future__ import annotations

import ast
from typing import Any

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


_ZEROS_MAKERS = ("torch.zeros", "torch.zeros_like")


def made_as_zeros(module: Any, scope: Any, name: str, before_line: int) -> bool:
    """``name`` is bound (last, before ``before_line``) to zeros: ``torch.zeros(...)`` / ``torch.zeros_like(x)`` /
    ``x.new_zeros(...)``, optionally moved by ``.to(...)`` / ``.float()`` (still zeros). Empty allocations are not."""
    node = scope.definition(name, before_line)
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("to", "float", "half", "bfloat16"):
        node = node.func.value
    if not isinstance(node, ast.Call):
        return False
    return (module.canonical(node.func) or "") in _ZEROS_MAKERS or (
        isinstance(node.func, ast.Attribute) and node.func.attr == "new_zeros")


def spelled_out_sum(target: ast.Subscript, value: ast.expr) -> ast.expr | None:
    """``v`` of ``out[rows] = out[rows] + v`` (or ``v + out[rows]``): the spelled-out ``out[rows] += v``; else None."""
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add)):
        return None
    read = ast.dump(ast.Subscript(value=target.value, slice=target.slice, ctx=ast.Load()))
    if ast.dump(value.left) == read:
        return value.right
    if ast.dump(value.right) == read:
        return value.left
    return None


def _made_as_empty_dict(scope: Any, name: str, line: int) -> bool:
    node = scope.definition(name, line)
    return isinstance(node, ast.Dict) and not node.keys or (
        isinstance(node, ast.Call) and dotted(node.func) in ("dict", "collections.defaultdict", "defaultdict") and not node.keywords)


def _dict_reads(node: ast.AST, name: str) -> tuple[int, int]:
    """(reads of ``name`` as a dict -- ``name[k]``, ``name.items()`` / ``keys()`` / ``values()`` / ``get``, iterated by a
    ``for`` -- , other reads) inside ``node``."""
    plain, other = 0, 0
    parents: dict[int, ast.AST] = {}
    for n in fast_walk(node):
        for c in ast.iter_child_nodes(n):
            parents[id(c)] = n
    for n in fast_walk(node):
        if not (isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)):
            continue
        up = parents.get(id(n))
        if isinstance(up, ast.Subscript) and up.value is n or isinstance(up, ast.Attribute) and up.attr in (
                "items", "keys", "values", "get") or isinstance(up, ast.For) and up.iter is n:
            plain += 1
        else:
            other += 1
    return plain, other


def local_dict_combined_later(scope: Any, name: str, loop: ast.For) -> int | None:
    """The line of a later ``for`` loop of the same function that reads ``name`` as a dict, when ``name`` is a local
    dict (``{}`` / ``dict()`` before ``loop``) read nowhere else after ``loop`` (not returned, stored or passed on):
    per-expert values kept for a second, combining loop -- an intermediate, not an output. Else None."""
    if not _made_as_empty_dict(scope, name, loop.lineno):
        return None
    end = loop.end_lineno or loop.lineno
    later = [s for s in scope.node.body if s.lineno > end] if hasattr(scope.node, "body") else []
    combine = next((s for s in later if isinstance(s, ast.For) and _dict_reads(s, name)[0]), None)
    if combine is None or any(_dict_reads(s, name)[1] for s in later):
        return None
    if any(_dict_reads(s, name) != (0, 0) for s in later if s is not combine):
        return None
    return combine.lineno


def dict_filled_by_earlier_loop(scope: Any, name: str, loop: ast.For) -> int | None:
    """The line of an earlier ``for`` loop of the same function that stores ``name[...] = ...`` into a local dict; else
    None (the values read here as ``name[e]`` were made there, per expert)."""
    body = getattr(scope.node, "body", [])
    for s in body:
        if not isinstance(s, ast.For) or s.lineno >= loop.lineno:
            continue
        if _made_as_empty_dict(scope, name, s.lineno) and any(
                isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                and n.value.id == name for n in fast_walk(s)):
            return s.lineno
    return None
