"""affinity_index_put fix of the s45 precision audit (helper audit45), read on code npufuse had never seen.

W1 (UniAnimate's DWpose ``__call__``): ``candidate, subset = self.pose_estimation(img)`` (an opaque call returning
numpy arrays), then ``body = candidate[:, :18].copy()`` and ``candidate[subset < 0.3] = -1``. Nothing in the
assignment's own data flow named numpy, so the target was taken for a tensor and rewritten to
``candidate.masked_fill_(...)``: an AttributeError on a numpy array. A torch tensor has no ``.copy()`` and no
``.astype()`` (numpy's methods; torch spells them ``clone`` / ``to``): a call of either on the target, or on a slice
of it, while the name holds the same value as at the site, shows the target is not a torch tensor.
"""

from __future__ import annotations

import ast

from npufuse.scan.dataflow import ModuleInfo, Scope, segment

# methods of numpy arrays (and of lists / dicts / DataFrames for ``copy``) that torch.Tensor does not have
_NOT_TENSOR_METHODS = frozenset({"copy", "astype"})


def _root_name(node: ast.expr) -> ast.Name | None:
    """``x``, ``x[...]``, ``x[...][...]``: the name a chain of subscripts reads (a slice of an array is an array)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node if isinstance(node, ast.Name) else None


def not_tensor_method_use(module: ModuleInfo, scope: Scope, target: ast.expr, line: int) -> str | None:
    """Why ``target`` (a name) is not a torch tensor at ``line``: a ``.copy()`` / ``.astype(...)`` call on it or on a
    subscript of it in this function, made while the name holds the value it holds at ``line`` (same reaching
    assignment); None when there is no such call."""
    if not isinstance(target, ast.Name):
        return None
    name = target.id
    if not any(n.lineno != line for n in scope.name_loads().get(name, ())):
        return None  # the cheap gate: the name is read nowhere else in the function
    held = scope.definition(name, line)
    for call in scope.nodes().get(ast.Call, ()):
        func = call.func  # type: ignore[attr-defined]
        if not isinstance(func, ast.Attribute) or func.attr not in _NOT_TENSOR_METHODS:
            continue
        root = _root_name(func.value)
        if root is None or root.id != name or call.lineno == line:
            continue
        if scope.definition(name, call.lineno) is not held:
            continue  # the name was rebound between the call and the site: another value
        return f"`{segment(module, call)[:50]}` at line {call.lineno} (torch tensors have no `.{func.attr}()`)"
    return None
