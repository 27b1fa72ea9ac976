"""s43 (helper ho20fix43): rope forms the s43 blind judge found missed, read by class.

1. A rotation helper defined inside a method (``def spin(v, c, s)`` in ``Attention.forward``, filling
   ``out[..., 0::2]`` / ``out[..., 1::2]`` of an ``empty_like`` buffer): the scan's per-module hints (names of
   helpers that could rotate) listed only module-level functions and class methods, so the nested helper's own
   scope, whose text holds no other hint, was never read.
2. The rotated lanes computed by named statements right before the buffer (``new_ev = ev * c - od * s``;
   ``new_od = ..``; ``res = torch.empty_like(v)``; ``res[..., 0::2] = new_ev``; ..): the fused call replaces
   them with the fills, as it already did for the tuple-fill spelling (the eager products no longer run on the
   fused path, where they were computed and thrown away).
"""

from __future__ import annotations

import ast
from typing import Any, Callable

from npufuse.scan.dataflow import ModuleInfo


def nested_rotation_helpers(module: ModuleInfo, known: set[str], could_rotate: Callable[[ast.AST], bool]) -> set[str]:
    """Names of functions nested in another function that could rotate (``could_rotate``: their text concatenates,
    stacks or fills a new tensor) and are not among ``known`` (module-level functions and methods)."""
    out: set[str] = set()
    for scope in module.scopes:
        node = scope.node
        # a nested function's qualname runs through its enclosing function: ``Cls.forward.spin``, ``f.g``
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in known \
                and scope.qualname.count(".") >= 1 and scope.qualname not in module.functions and could_rotate(node):
            out.add(node.name)
    return out


def parts_before(runs: list[Any], block: list[ast.stmt], i: int, parts: list[ast.stmt]) -> list[tuple[int, ast.stmt, list[Any]]]:
    """Run items for the statements ``parts`` (a match's absorbed rotated parts) where they are exactly the
    statements right before ``block[i]`` (the buffer's allocation), an earlier run of ``runs`` that reached into
    them cut back; [] otherwise (the parts stay where they are: the fused call does not read them)."""
    ids = {id(a) for a in parts}
    if not ids or i < len(ids) or {id(b) for b in block[i - len(ids) : i]} != ids:
        return []
    start = i - len(ids)
    if runs and runs[-1][0] is block and runs[-1][1][-1][0] >= start:
        runs[-1][1][:] = [it for it in runs[-1][1] if it[0] < start]
        if not runs[-1][1]:
            runs.pop()
    return [(j, block[j], []) for j in range(start, i)]
