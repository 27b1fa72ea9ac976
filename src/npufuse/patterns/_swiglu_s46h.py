"""s46 (ho23fix46): a GLU operand bound in both arms of one ``if`` / ``else`` to a projection of one input.

A functional expert kernel serving two weight layouts projects in each arm (HO23a build-your-own-moe-router):

    if batched:
        hidden = _batched_linear(x, w1, b1)
    else:
        hidden = F.linear(x, w1, b1)

Whichever arm runs, ``hidden`` is a projection of ``x``. The swiglu detector follows a name to its one reaching
definition only, so such an operand had no projection input and the product was reported as "not projections of one
input", which is untrue. Here the operand's input is the one input every arm projects; the fused op takes the names'
values at the product (concatenated), so which arm ran does not matter.
"""

from __future__ import annotations

import ast
from typing import Callable, Optional

from npufuse.patterns import _site as S
from npufuse.scan.dataflow import ModuleInfo

#: ``_projection_input(node, ctx, module) -> key | None`` of swiglu.py, passed in (no import cycle)
ProjectionInput = Callable[[ast.expr, S.Ctx, Optional[ModuleInfo]], Optional[str]]


def _arm_definition(arm: list[ast.stmt], name: str) -> Optional[ast.Assign]:
    """The arm's last top-level statement binding ``name`` when it is a plain ``name = value`` and nothing else in
    the arm (nested blocks included) binds ``name`` after it; None otherwise."""
    last: Optional[ast.Assign] = None
    for st in arm:
        binds = any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in ast.walk(st))
        if not binds:
            continue
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            last = st
        else:
            return None  # bound by a loop, a tuple, a nested block: not one plain value
    return last


def branch_projection_input(module: ModuleInfo, node: ast.expr, ctx: S.Ctx, projection_input: ProjectionInput) -> Optional[str]:
    """The input key when ``node`` is a name whose reaching definition is the pair of assignments ending both arms of
    one ``if`` / ``else`` before the use, each a projection of the same input; None otherwise."""
    if not isinstance(node, ast.Name) or ctx.depth:
        return None
    cands = [st for st, _ in ctx.scope.assignments.get(node.id, []) if st.lineno < ctx.line]
    if not cands:
        return None
    latest = max(cands, key=lambda st: st.lineno)
    idx = S.stmt_index(ctx.scope)
    use = idx.by_line.get(ctx.line)
    if use is None:
        return None
    use_anc = {id(a) for a in S.ancestors(idx, use)}
    branch = next((a for a in S.ancestors(idx, latest) if isinstance(a, S._CONDITIONAL) and id(a) not in use_anc), None)
    if not isinstance(branch, ast.If) or not branch.orelse or idx.parent.get(id(latest)) is not branch:
        return None  # the value must come from the arms of one if / else directly holding the assignments
    arms = [_arm_definition(branch.body, node.id), _arm_definition(branch.orelse, node.id)]
    if any(a is None for a in arms) or not any(a is latest for a in arms):
        return None
    end = branch.end_lineno or branch.lineno
    if any(end < st.lineno < ctx.line for st in cands):
        return None  # rebound after the branch, before the product
    keys = {projection_input(a.value, ctx.at(a.lineno), module) for a in arms if a is not None}
    if len(keys) != 1 or None in keys:
        return None
    return keys.pop()
