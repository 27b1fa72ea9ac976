"""moe_experts reason fix of the s45 precision audit (helper audit45), read on code npufuse had never seen.

R1 (Hetu-Galvatron's Megatron-style ``SequentialMLP.forward``): ``output, output_bias = expert(tokens)``, then
``output_local_list.append(output)`` and, under ``if self.add_bias:``, ``output_bias_list.append(...)``. The reason
said "the expert returns several values and the loop keeps only one", but the loop keeps both (the second under a
condition the collector does not follow). Where another unpacked element is read in the loop or after it, the
reason now names it; "keeps only one" stays where that is the fact.
"""

from __future__ import annotations

import ast
from typing import Any

from npufuse.scan.dataflow import fast_walk


def _reads(node: ast.AST, names: set[str]) -> set[str]:
    return {n.id for n in fast_walk(node) if isinstance(n, ast.Name) and n.id in names and isinstance(n.ctx, ast.Load)}


def other_parts_read(ev: Any, part: int, loop: ast.stmt) -> list[str]:
    """The names of the expert call's other unpacked elements (``ev.tuple_call``: ``a, b = expert(x)``; ``part``
    the kept one's position) that the loop keeps: appended / extended to a list or stored into a subscript (directly
    or through names assigned from them in the loop), or read after the loop; [] when none is. A value only
    recomputed and dropped (``b = b.expand_as(a)`` and nothing else) is not kept."""
    if ev.tuple_call is None or not isinstance(part, int):
        return []
    names = ev.tuple_call[1]
    if not 0 <= part < len(names):
        return []
    others = {n for n in names if n != names[part] and n != "_"}
    if not others:
        return []
    # names computed from the other elements inside the loop (``b2 = b.expand_as(a)``): what they hold is kept too
    derived = {n: {n} for n in others}
    assigns = [st for st in fast_walk(loop) if isinstance(st, ast.Assign) and len(st.targets) == 1
               and isinstance(st.targets[0], ast.Name)]
    for _ in range(3):
        for st in assigns:
            for root, group in derived.items():
                if _reads(st.value, group):
                    group.add(st.targets[0].id)  # type: ignore[attr-defined]
    kept: set[str] = set()
    for n in fast_walk(loop):
        held = None
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("append", "extend"):
            held = n  # ``lst.append(b)``
        elif isinstance(n, (ast.Assign, ast.AugAssign)) and any(
                isinstance(t, ast.Subscript) for t in (n.targets if isinstance(n, ast.Assign) else [n.target])):
            held = n.value  # ``out[rows] = b``
        if held is None:
            continue
        for root, group in derived.items():
            if _reads(held, group):
                kept.add(root)
    end = loop.end_lineno or loop.lineno
    kept |= {root for root, group in derived.items() if any(ev.scope.uses_after(n, end) for n in group)}
    return sorted(kept)
