"""s48 moe48: MoE expert-loop readings found by the sweep48moe development labels (bench/detect_labels_sweep48moe).

One-line hooks in moe_experts.py call these helpers; each widens one reader by a class of code the labels showed
and the tests in tests/test_detect_s48_moe48.py pin (every Fuse runs rewritten under the emulator).
"""
from __future__ import annotations

import ast
from typing import Any, Optional


def counts_copy_source(scope: Any, node: ast.expr, line: int) -> Optional[tuple[str, int]]:
    """``counts = expert_counts.tolist()`` where ``expert_counts = torch.bincount(...)`` is bound once before: the
    host copy of counts held under another name. Returns (that name, the line to look its definition up before) so
    the bincount reader reads the counts themselves; None where ``node`` is not such a name (bound more than once,
    a parameter, an augmented / subscript store of it in the scope)."""
    if not isinstance(node, ast.Name):
        return None
    stores = scope.assignments.get(node.id, [])
    if len(stores) != 1 or stores[0][0].lineno >= line:
        return None
    for n in ast.walk(scope.node):
        # an in-place change of the counts (`expert_counts[0] += 1`, `expert_counts.add_(1)`) before the copy
        if isinstance(n, ast.AugAssign) and isinstance(n.target, (ast.Name, ast.Subscript)) \
                and _root(n.target) == node.id:
            return None
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Subscript) and _root(t) == node.id for t in targets):
                return None
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr.endswith("_") \
                and not n.func.attr.startswith("_") and _root(n.func.value) == node.id:
            return None
    return node.id, stores[0][0].lineno + 1


def _root(node: ast.expr) -> Optional[str]:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None
