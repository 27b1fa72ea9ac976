"""s47 (fix47h): skips of empty experts are never the reason a MoE loop is refused.

A loop that skips experts without rows (``if cnt == 0: continue``) computes what the loop without the skip
computes: an expert called on no rows adds nothing. Two classes, from HO23a moe-routers (``cnt =
int(counts[e].item()); if cnt == 0: continue`` in an ``enumerate(self.experts)`` loop over sorted routes):

1. **a count bound to a name in the loop**: ``cnt = int(counts[e].item())`` (``counts[e].item()``, ``int(counts[e])``)
   then ``if cnt == 0`` / ``cnt <= 0`` / ``cnt < 1`` / ``not cnt``: the same test as ``if counts[e] == 0`` (which the
   analyser reads with ``counts = bincount(...)``), so it is read the same way.
2. **an emptiness test npufuse cannot read** (``v == 0``, ``v <= 0``, ``v < 1``, ``not v`` of a value not traced to this
   expert's rows): it no longer stops the analysis at the ``if``. The loop is read on; a later
   blocker is the reason reported (true of the loop whatever the skip does), and where nothing else blocks, the
   unread skip is the reason (as before): no candidate is ever made past a skip that is not proven to skip only
   empty experts. A test of another shape (a threshold ``n < 4``, a flag) is the blocker itself, reported at once.
"""

from __future__ import annotations

import ast
from typing import Optional

from npufuse.scan.dataflow import const_value, dotted


def _zero_test(test: ast.expr) -> Optional[ast.expr]:
    """The operand of ``v == 0`` / ``v <= 0`` / ``v < 1`` / ``0 == v`` / ``not v``; None for any other test."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return test.operand
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, op, right = test.left, test.ops[0], test.comparators[0]
        for v, c, flipped in ((left, right, False), (right, left, True)):
            k = const_value(c)
            if not isinstance(k, int) or isinstance(k, bool):
                continue
            if isinstance(op, ast.Eq) and k == 0:
                return v
            if not flipped and ((isinstance(op, ast.LtE) and k == 0) or (isinstance(op, ast.Lt) and k == 1)):
                return v
            if flipped and ((isinstance(op, ast.GtE) and k == 0) or (isinstance(op, ast.Gt) and k == 1)):
                return v
    return None


def emptiness_shaped(test: ast.expr) -> bool:
    """``test`` has the shape of an emptiness test (``v == 0``, ``v <= 0``, ``v < 1``, ``not v``), whatever ``v`` is."""
    return _zero_test(test) is not None


def _host_number(node: ast.expr) -> ast.expr:
    """``counts[e]`` of ``int(counts[e].item())`` / ``counts[e].item()`` / ``int(counts[e])``."""
    for _ in range(3):
        if isinstance(node, ast.Call) and dotted(node.func) == "int" and len(node.args) == 1 and not node.keywords:
            node = node.args[0]
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "item" \
                and not node.args and not node.keywords:
            node = node.func.value
            continue
        break
    return node


def counted_read(loop: ast.For, test: ast.expr, line: int) -> Optional[ast.Subscript]:
    """``counts[e]`` where ``test`` (at ``line``, a statement of the loop's body) tests for zero a name bound once in the
    loop's body, before ``line`` and at its top level, to ``int(counts[e].item())`` (or a spelling above); None
    otherwise."""
    v = _zero_test(test)
    if not isinstance(v, ast.Name):
        return None
    binds = []
    for st in ast.walk(loop):
        if isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.With, ast.NamedExpr)) and st is not loop:
            targets = st.targets if isinstance(st, ast.Assign) else [getattr(st, "target", None)] if not isinstance(st, ast.With) \
                else [it.optional_vars for it in st.items]
            for t in targets:
                if t is not None and any(isinstance(n, ast.Name) and n.id == v.id for n in ast.walk(t)):
                    binds.append(st)
    if len(binds) != 1 or not isinstance(binds[0], ast.Assign) or len(binds[0].targets) != 1 \
            or not isinstance(binds[0].targets[0], ast.Name) or binds[0].lineno >= line \
            or not any(st is binds[0] for st in loop.body):
        return None
    value = _host_number(binds[0].value)
    return value if isinstance(value, ast.Subscript) else None
