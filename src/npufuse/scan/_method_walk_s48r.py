"""s48 review48: the names a method stores, read from its scope's node index.

``_site_s47review._instance_stores`` (``self.<m>(..)`` is the method only where no method of the class stores
``self.<m>``) walked every method of each class whose calls it resolves with ``bound_callee._changes_in(item,
how=False)``: s47's reader made the scan's per-file analysis +6.4% Python opcodes, that walk its largest part. Each
method is a scope, and ``Scope.nodes()`` (one walk per scope, grouped by node type, shared by the detectors' questions
about the whole scope) holds the same nodes: :func:`stored_names` reads the stores off its Attribute / Subscript /
Call groups, the very conditions of ``_changes_in``, so the set is the same. (Tried and dropped: one shared walk per
method for ``changed_outside_init`` / ``_attribute_stores`` too -- the classes whose calls are resolved are mostly
not the ones those readers ask about, and the wider walk cost more than it saved.)"""

from __future__ import annotations

import ast
from typing import Any

_SHRINKING = ("pop", "remove", "clear")  # (bound_callee._SHRINKING)


def stored_names(module: Any, item: ast.AST) -> frozenset[str]:
    """The attributes ``bound_callee._changes_in(item)`` names (store / del of an attribute on any receiver, an item
    stored / deleted under ``self.<a>``, ``self.<a>.pop / remove / clear()``, ``setattr / delattr(self, "<a>", ..)``),
    read from the method scope's node index; a function that is no scope of the file gets the walk of its own."""
    scopes = module.__dict__.get("_npufuse_s48_scope_of")
    if scopes is None:
        scopes = module.__dict__["_npufuse_s48_scope_of"] = {id(s.node): s for s in module.scopes}
    scope = scopes.get(id(item))
    if scope is None or scope.node is not item:
        from npufuse.scan.bound_callee import _changes_in  # (bound_callee is imported by the readers of this one)

        return frozenset(attr for attr, _how, _line in _changes_in(item, how=False))
    nodes = scope.nodes()  # (indexed here where no detector did yet: their later questions about the scope reuse it)
    names: set[str] = set()
    Store, Del, Attribute, Subscript = ast.Store, ast.Del, ast.Attribute, ast.Subscript
    for n in nodes.get(Attribute, ()):
        if isinstance(n.ctx, (Store, Del)):  # type: ignore[attr-defined]
            names.add(n.attr)  # type: ignore[attr-defined]
    for n in nodes.get(Subscript, ()):
        if isinstance(n.ctx, (Store, Del)):  # type: ignore[attr-defined]
            base = n.value  # type: ignore[attr-defined]
            while isinstance(base, Subscript):
                base = base.value
            if isinstance(base, Attribute) and isinstance(base.value, ast.Name) and base.value.id == "self":
                names.add(base.attr)
    for n in nodes.get(ast.Call, ()):
        f = n.func  # type: ignore[attr-defined]
        if isinstance(f, Attribute):
            if f.attr in _SHRINKING and isinstance(f.value, Attribute) and isinstance(f.value.value, ast.Name) \
                    and f.value.value.id == "self":
                names.add(f.value.attr)
        elif isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and len(n.args) >= 2 \
                and isinstance(n.args[0], ast.Name) and n.args[0].id == "self" and isinstance(n.args[1], ast.Constant) \
                and isinstance(n.args[1].value, str):  # type: ignore[attr-defined]
            names.add(n.args[1].value)  # type: ignore[attr-defined]
    return frozenset(names)
