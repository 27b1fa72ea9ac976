"""s51 moe51: the any-mask loop's gate scattered into a fresh per-token buffer (moe51 toqeer-ahmed MoE Segformer).

Inside the any-mask loop that s50h reads (``m = (ids == e).any(-1)``, rows ``x[m]``, ``out[m] += y * g``), the gate of
expert e is spelled as a scatter of its (token, slot) pairs' weights into a [T] zeros buffer, read back at the mask::

    r, c = torch.where(ids == e)          # the (token, slot) pairs of e
    g = torch.zeros(x.size(0), device=x.device)
    g[r] = w[r, c]                        # each token's weight of e; 0 for tokens without e
    out[m] += y * g[m].unsqueeze(-1)

Where each row of ``ids`` holds distinct experts (a last-dim topk's indices, a router's included: s49h's proof; else
a run-time check of the rows, s50g's), every token has at most one slot of e, so ``g`` is exactly the slot sum
``((ids == e) * w).sum(-1)`` that s50h reads as the pair's weight -- the buffer is bound to that value and s50h's
reader and the where-loop analysis decide as before. Where a row repeats e, ``g[r] = ...`` keeps one slot's weight
(an index_put writes one of them) while the sum adds both: hence the distinct-rows condition.

``torch.zeros`` without a dtype makes ``g`` the default dtype, so the loop multiplies the expert rows by the weights
in that dtype; the reading holds the weights' own dtype, so it runs where ``w.dtype == torch.get_default_dtype()``
(``dtype=w.dtype`` needs no guard; any other dtype: not read). Not read: a buffer of another rank or shape argument
(a tuple), any other use of ``r`` / ``c``, the scatter of another weight tensor's columns (``w[r, 0]``), an
accumulating scatter (``index_put_``, ``+=``: a different statement, left to the old reasons).
"""

from __future__ import annotations

import ast
import copy
from typing import Any, Callable, Optional

from npufuse.scan.dataflow import dotted


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _slot_sum(ids: str, e: str, w: str) -> ast.expr:
    """``((ids == e) * w).sum(dim=-1)``: the per-token weight of e (one slot per token)."""
    prod = ast.BinOp(ast.Compare(ast.Name(ids, ast.Load()), [ast.Eq()], [ast.Name(e, ast.Load())]), ast.Mult(),
                     ast.Name(w, ast.Load()))
    return ast.Call(ast.Attribute(prod, "sum", ast.Load()), [], [ast.keyword("dim", ast.UnaryOp(ast.USub(), ast.Constant(1)))])


def scatter_gate(m: Any, scope: Any, loop: ast.For, body: list, k: int, e: str, inline: Callable[[ast.expr], ast.expr],
                 eq_ids: Callable[[ast.expr, str], Optional[str]], bound: set[str]) -> Optional[tuple[int, str, ast.expr, list[str]]]:
    """``(next statement, buffer name, its value, run-time guards)`` where ``body[k:k + 3]`` is the scatter of e's
    pair weights into a fresh [T] zeros buffer (module doc); None otherwise (the caller's reading refuses as before)."""
    if k + 3 > len(body):
        return None
    s0, s1, s2 = body[k:k + 3]
    if not (isinstance(s0, ast.Assign) and len(s0.targets) == 1 and isinstance(s0.targets[0], ast.Tuple)
            and len(s0.targets[0].elts) == 2 and all(isinstance(t, ast.Name) for t in s0.targets[0].elts)
            and isinstance(s0.value, ast.Call) and dotted(s0.value.func) == "torch.where"
            and len(s0.value.args) == 1 and not s0.value.keywords):
        return None
    r, c = (t.id for t in s0.targets[0].elts)  # type: ignore[attr-defined]
    ids = eq_ids(inline(copy.deepcopy(s0.value.args[0])), e)
    if ids is None or r == c or {r, c} & (bound | {e}):
        return None
    # g = torch.zeros(n[, device=..][, dtype=w.dtype]): one size argument (a 1-D buffer)
    if not (isinstance(s1, ast.Assign) and len(s1.targets) == 1 and isinstance(s1.targets[0], ast.Name)
            and isinstance(s1.value, ast.Call) and dotted(s1.value.func) == "torch.zeros" and len(s1.value.args) == 1
            and not isinstance(s1.value.args[0], (ast.Tuple, ast.List, ast.Starred))
            and all(kw.arg in ("device", "dtype") for kw in s1.value.keywords)):
        return None
    g = s1.targets[0].id
    if g in bound | {e, r, c, ids}:
        return None
    # g[r] = w[r, c]
    t2 = s2.targets[0] if isinstance(s2, ast.Assign) and len(s2.targets) == 1 else None
    if not (isinstance(t2, ast.Subscript) and isinstance(t2.value, ast.Name) and t2.value.id == g
            and isinstance(t2.slice, ast.Name) and t2.slice.id == r):
        return None
    v = s2.value  # type: ignore[union-attr]
    if not (isinstance(v, ast.Subscript) and isinstance(v.value, ast.Name) and isinstance(v.slice, ast.Tuple)
            and len(v.slice.elts) == 2 and isinstance(v.slice.elts[0], ast.Name) and v.slice.elts[0].id == r
            and isinstance(v.slice.elts[1], ast.Name) and v.slice.elts[1].id == c):
        return None
    w = v.value.id
    if w in bound | {e, r, c, g, ids}:
        return None
    # r / c read nowhere else in the loop (r: s0's target, g[r], w[r, ..]; c: s0's target, w[.., c])
    seen = [n.id for n in ast.walk(loop) if isinstance(n, ast.Name) and n.id in (r, c)]
    if seen.count(r) != 3 or seen.count(c) != 2:
        return None
    # g only read (never written again) after the scatter
    for st in body[k + 3:]:
        for n in ast.walk(st):
            if isinstance(n, ast.Name) and n.id == g and not isinstance(n.ctx, ast.Load):
                return None
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == g \
                    and not isinstance(n.ctx, ast.Load):
                return None
    # w[r, c] is the pair's weight where w has the ids' [T, K] shape (a dense [T, E] score read at slot c is not): a
    # run-time check where the reader cannot show it statically (a router of another file)
    guards: list[str] = [shape_guard(w, ids)]
    dtype = [kw.value for kw in s1.value.keywords if kw.arg == "dtype"]
    if not dtype:
        guards.append(f"({w}.dtype == torch.get_default_dtype())")  # the loop weights in the buffer's dtype
    elif not (isinstance(dtype[0], ast.Attribute) and dtype[0].attr == "dtype" and isinstance(dtype[0].value, ast.Name)
              and dtype[0].value.id == w):
        return None
    from npufuse.patterns import _moe_s49h, _moe_s50g
    from npufuse.patterns import moe_experts as me  # the analyser (imports the s50h reader that calls this)

    if _moe_s49h.topk_or_router_topk(me._s40_topk_indices, me._s41_call_output)(m, scope, ids, loop.lineno) is None:
        guards.append(f"({_moe_s50g.distinct_rows_check(ids)})")  # g[r] = .. keeps one slot of a repeated e
    bound.update((r, c))
    return k + 3, g, _slot_sum(ids, e, w), guards


def shape_guard(w: str, ids: str) -> str:
    return f"({w}.shape == {ids}.shape)"
