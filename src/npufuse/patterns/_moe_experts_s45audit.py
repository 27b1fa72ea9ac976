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


def other_parts_read(ev: Any, part: int, loop: ast.stmt) -> list[str]:
    """The names of the expert call's other unpacked elements (``ev.tuple_call``: ``a, b = expert(x)``; ``part``
    the kept one's position) that the loop reads, or that are read after it; [] when none is."""
    if ev.tuple_call is None or not isinstance(part, int):
        return []
    names = ev.tuple_call[1]
    if not 0 <= part < len(names):
        return []
    others = {n for n in names if n != names[part] and n != "_"}
    if not others:
        return []
    read = {n.id for n in fast_walk(loop) if isinstance(n, ast.Name) and n.id in others and isinstance(n.ctx, ast.Load)}
    end = loop.end_lineno or loop.lineno
    read |= {n for n in others - read if ev.scope.uses_after(n, end)}
    return sorted(read)
