"""s45 (moe45a): expert ids outside [0, E) on the sorted-dispatch paths, read by small hooks in
:mod:`npufuse.patterns.moe_experts`.

defects44 proved / masked the ids of the mask- and flat-routing loops (:mod:`._defects_s44`). The sorted paths
differ in what such an id does in the original:

* sorted dispatch written by hand (sort_permute, sorted_pairs, sorted_dispatch): the code sorts the flat ids
  itself, so a -1 drop marker sorts FIRST and the experts between (kept as written) see it there; an id >= E sorts
  last and the code between leaves its rows as it leaves them. ``npu_moe_token_permute`` takes ids in
  [0, 16777215) only (spec 8.6) and raised on the -1. The permute is given the ids shifted by their minimum where
  that is negative: a monotone shift, so the sort order (and every row the experts see) is the original's, on the
  device, no host sync (:func:`permute_key`). Not needed where the ids are top-k / argmax indices (never negative)
  or where the original itself raises on a negative id before the experts run (a bincount / one-hot / scatter of
  those ids: :func:`negative_ids_raise`).
* runs of sorted ids (``for s, e in zip(starts, ends): self.experts[host[s]](...)``): Python indexing runs the
  LAST expert for a -1 (``experts[-1]``), so the fused permute takes ids wrapped the same way
  (:func:`wrapped_ids_line`); ids < -E and >= E raise IndexError in the original.
"""

from __future__ import annotations

import ast
from typing import Optional

from npufuse.patterns._defects_s44 import top_call_of
from npufuse.scan.dataflow import ModuleInfo, Scope, const_value, dotted, fast_walk, keyword

# calls after which a tensor still holds every value of the ids (layout, integer type)
_ALL_VALUES = {"view", "reshape", "flatten", "long", "int", "contiguous", "detach", "clone", "squeeze", "unsqueeze"}


def ids_nonnegative(module: ModuleInfo, scope: Scope, ids: str, line: int) -> bool:
    """``ids`` are the indices of a top-k / argmax (through value-keeping steps, never rebound or written in
    place): every value is >= 0."""
    return top_call_of(module, scope, ids, line) is not None


def _holds_the_ids(module: ModuleInfo, scope: Scope, node: ast.expr, ids: str, line: int) -> bool:
    """``node`` holds every value of ``ids``: the ids themselves, a view / flatten / integer cast of them, their
    sorted values (``v.sort()[0]``, ``torch.sort(v)[0]``, ``v[argsort(v)]``), through names bound once."""
    for _ in range(8):
        if isinstance(node, ast.Name):
            if node.id == ids:
                return True
            if len(scope.assignments.get(node.id, [])) != 1:
                return False
            value = scope.definition(node.id, line)
            if value is None:
                return False
            node = value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _ALL_VALUES:
            node = node.func.value
        elif isinstance(node, ast.Subscript) and const_value(node.slice) == 0 and _sorted_operand(module, node.value) is not None:
            node = _sorted_operand(module, node.value)  # type: ignore[assignment]
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name):
            from npufuse.patterns.moe_experts import _argsort_of  # (a permutation of all of them: `flat[order]`)

            if not isinstance(node.value, ast.Name) or _argsort_of(scope, node.slice.id, line) != node.value.id:
                return False
            node = node.value
        else:
            return False
    return False


def _sorted_operand(module: ModuleInfo, node: ast.expr) -> Optional[ast.expr]:
    """``v`` of ``v.sort(..)`` / ``torch.sort(v, ..)`` (its values half holds every value of v)."""
    if not isinstance(node, ast.Call):
        return None
    if (module.canonical(node.func) or "") == "torch.sort":
        return node.args[0] if node.args else None
    return node.func.value if isinstance(node.func, ast.Attribute) and node.func.attr == "sort" else None


def _raising_operand(module: ModuleInfo, call: ast.Call) -> Optional[ast.expr]:
    """The operand a call raises on when it holds a negative value: ``torch.bincount(v)`` / ``v.bincount()``,
    ``F.one_hot(v, ..)``, ``t.scatter_(d, v, ..)`` / ``scatter`` / ``scatter_add(_)`` (index out of range)."""
    canon = module.canonical(call.func) or ""
    f = call.func
    if canon in ("torch.bincount", "torch.nn.functional.one_hot") and call.args:
        return call.args[0]
    if isinstance(f, ast.Attribute) and not canon.startswith("torch."):
        if f.attr == "bincount" and not call.args:
            return f.value
        if f.attr in ("scatter", "scatter_", "scatter_add", "scatter_add_"):
            return keyword(call, "index", 1)
    return None


def negative_ids_raise(module: ModuleInfo, scope: Scope, ids: str, before: int) -> bool:
    """The function, on its straight-line path before line ``before`` (its body and ``with`` blocks, not inside an
    ``if`` / loop), counts, one-hots or scatters ``ids`` (or their sorted / flattened values) with an op that
    raises on a negative id: then the original never runs the experts on one."""
    body = list(getattr(scope.node, "body", []))
    first = min((st.lineno for st, _v in scope.assignments.get(ids, [])), default=0)
    while body:
        st = body.pop(0)
        if st.lineno >= before:
            return False
        if isinstance(st, (ast.With, ast.AsyncWith)):
            body[:0] = st.body
            continue
        if isinstance(st, (ast.If, ast.For, ast.While, ast.Try, ast.FunctionDef, ast.ClassDef, ast.Return)) \
                or st.lineno < first:
            continue
        for n in fast_walk(st):
            if isinstance(n, (ast.Lambda, ast.ListComp, ast.GeneratorExp, ast.DictComp, ast.SetComp, ast.IfExp)):
                break  # (parts that may not run)
            operand = _raising_operand(module, n) if isinstance(n, ast.Call) else None
            if operand is not None and _holds_the_ids(module, scope, operand, ids, st.lineno + 1):
                return True
    return False


def permute_key(module: ModuleInfo, scope: Scope, ids: str, line: int, prefix: str) -> tuple[str, list[str], str]:
    """(an extra run-time condition, lines, the ids to permute by) for a sorted dispatch that hands ``ids`` to
    ``npu_moe_token_permute`` in place of the code's own ascending sort of them. Ids that may be negative are
    shifted by their minimum where it is negative (the sort order is unchanged: every row lands where the code's
    own sort put it); the condition keeps an empty batch (no minimum) on the path as written."""
    if ids_nonnegative(module, scope, ids, line) or negative_ids_raise(module, scope, ids, line):
        return "", [], ids
    key = f"{prefix}key"
    return f" and {ids}.numel() > 0", [
        "# ids the code sorts itself: a negative one (a -1 drop marker) sorts first there; the permute takes ids",
        "# in [0, 16777215) only, so they are shifted by their minimum when it is negative (the same order)",
        f"{key} = {ids} - {ids}.min().clamp(max=0)",
    ], key


def wrapped_ids_line(ids: str, n: str) -> str:
    """Runs of sorted ids index the experts with Python's negative indexing (``experts[-1]`` is the last one)."""
    return f"{ids} = torch.where({ids} < 0, {ids} + {n}, {ids})  # experts[-1] is the last expert, as the loop indexes them"
