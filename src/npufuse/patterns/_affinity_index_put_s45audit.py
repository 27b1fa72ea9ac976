"""affinity_index_put fix of the s45 precision audit (helper audit45), read on code npufuse had never seen.

W1 (UniAnimate's DWpose ``__call__``): ``candidate, subset = self.pose_estimation(img)`` (an opaque call returning
numpy arrays), then ``body = candidate[:, :18].copy()`` and ``candidate[subset < 0.3] = -1``. Nothing in the
assignment's own data flow named numpy, so the target was taken for a tensor and rewritten to
``candidate.masked_fill_(...)``: an AttributeError on a numpy array. A torch tensor has no ``.copy()`` and no
``.astype()`` (numpy's methods; torch spells them ``clone`` / ``to``): a call of either on the target, or on a slice
of it, while the name holds the same value as at the site, shows the target is not a torch tensor; so does a
value assigned from such a call (W2, OpenSTL's MovingMNIST ``digit_image = self.mnist[ind].copy()`` then
``digit_image[digit_image > 1] = 255``).
"""

from __future__ import annotations

import ast

from npufuse.scan.dataflow import ModuleInfo, Scope, segment

# methods of numpy arrays (and of lists / dicts / DataFrames for ``copy``) that torch.Tensor does not have
_NOT_TENSOR_METHODS = frozenset({"copy", "astype"})


def _method_call(module: ModuleInfo, node: ast.AST | None) -> bool:
    """``<expr>.copy()`` / ``<expr>.astype(...)``, a method of the receiver: not ``copy.copy(t)`` (the stdlib
    function, which copies a tensor into a tensor)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    if node.func.attr not in _NOT_TENSOR_METHODS:
        return False
    return not (module.canonical(node.func) or "").startswith("copy.")


def _root_name(node: ast.expr) -> ast.Name | None:
    """``x``, ``x[...]``, ``x[...][...]``: the name a chain of subscripts reads (a slice of an array is an array)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node if isinstance(node, ast.Name) else None


def not_tensor_method_use(module: ModuleInfo, scope: Scope, target: ast.expr, line: int) -> str | None:
    """Why ``target`` (a name) is not a torch tensor at ``line``: its value there is the result of a ``.copy()`` /
    ``.astype(...)`` call, or such a call is made on it (or on a subscript of it) in this function while the name holds
    the value it holds at ``line`` (same reaching assignment); None when there is no such call."""
    if not isinstance(target, ast.Name):
        return None
    name = target.id
    held = scope.definition(name, line)
    # OpenSTL's MovingMNIST: ``digit_image = self.mnist[ind].copy()``: what a ``.copy()`` returns is the receiver's kind
    if _method_call(module, held):
        return f"it is assigned `{segment(module, held)[:50]}` (torch tensors have no `.{held.func.attr}()`)"
    if not any(n.lineno != line for n in scope.name_loads().get(name, ())):
        return None  # the cheap gate: the name is read nowhere else in the function
    for call in scope.nodes().get(ast.Call, ()):
        if not _method_call(module, call):
            continue
        func = call.func  # type: ignore[attr-defined]
        root = _root_name(func.value)
        if root is None or root.id != name or call.lineno == line:
            continue
        if scope.definition(name, call.lineno) is not held:
            continue  # the name was rebound between the call and the site: another value
        return f"`{segment(module, call)[:50]}` at line {call.lineno} (torch tensors have no `.{func.attr}()`)"
    return None
