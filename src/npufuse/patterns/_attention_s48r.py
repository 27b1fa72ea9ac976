"""s48 review48: the stores of ``self.<attr>`` in a class, as :func:`_attention_s46._layer_keeps_rank` reads them.

s46 read ``self.<attr> = v`` / annotated / augmented stores only: a tuple target (``self.to_qkv, self.gate = proj,
flag``) or ``setattr(self, "to_qkv", proj)`` in another method was not seen, so a layer swapped in that way still had
its constructor's rank "stated" (a 5-D fold chosen, or the near miss "q/k/v are 5-D with ..." said, of operands the
swapped layer may give another rank). Here every store form gives its value where it is known (a tuple target beside
a tuple value of the same length, ``setattr`` with a literal name) and ``None`` where it is not (a tuple target of
another value, a ``for`` / ``with`` target, ``setattr`` with a computed name: that one refuses every attribute), so
the rank reader only states a rank where every store is a rank-keeping layer."""

from __future__ import annotations

import ast
from typing import Any, Optional

from npufuse.scan.dataflow import const_value, dotted, fast_walk

ANY = "*"  # the key under which a store to a computed attribute name is kept (it may be any attribute)


def _self_attr(t: ast.AST) -> Optional[str]:
    name = dotted(t) if isinstance(t, ast.Attribute) else None
    return name[5:] if name and name.startswith("self.") and name.count(".") == 1 else None


def _targets(t: ast.AST, value: Optional[ast.expr], found: dict[str, list[Any]]) -> None:
    if isinstance(t, (ast.Tuple, ast.List)):
        vals = value.elts if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(t.elts) \
            and not any(isinstance(e, ast.Starred) for e in (*t.elts, *value.elts)) else None
        for k, e in enumerate(t.elts):
            _targets(e.value if isinstance(e, ast.Starred) else e, vals[k] if vals is not None else None, found)
        return
    attr = _self_attr(t)
    if attr is not None:
        found.setdefault(attr, []).append(value)


def layer_stores(cls: ast.ClassDef) -> dict[str, list[Any]]:
    """attr -> the values stored to ``self.<attr>`` anywhere in the class (None for a value not known here)."""
    found: dict[str, list[Any]] = {}
    for node in fast_walk(cls):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                _targets(t, node.value, found)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            attr = _self_attr(node.target)
            if attr is not None:
                found.setdefault(attr, []).append(node.value)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            _targets(node.target, None, found)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    _targets(item.optional_vars, None, found)
        elif isinstance(node, ast.NamedExpr):
            continue  # (a walrus target is a plain name)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) == 3 and isinstance(node.args[0], ast.Name) and node.args[0].id == "self":
            name = const_value(node.args[1])
            found.setdefault(name if isinstance(name, str) else ANY, []).append(node.args[2])
    return found
