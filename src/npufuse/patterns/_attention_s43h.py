"""s43 (helper ho20fix43; named _attention_s43h at merge: attnrope43 had taken _attention_s43): attention / sdpa mask readings the s43 blind judge found false, read by class.

1. A mask-builder method that caches what it builds (``key = (t, s, start, str(device))``; ``if key not in
   self._masks: self._masks[key] = cols <= start + rows``; ``return self._masks[key]``):
   its result is an entry of the cache, so it is bool when every value stored into the cache is. The cache must
   hold nothing else: the class binds the attribute only to an empty dict and stores into it in this method alone.
   Without this, the positions it compares (``arange``) were read as graded values and the mask as a float bias.
"""

from __future__ import annotations

import ast
from typing import Any

from npufuse.scan.dataflow import ModuleInfo, fast_walk


def _self_attr(node: ast.AST) -> str | None:
    """``self.<attr>`` as ``"self.<attr>"``, None for anything else."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return f"self.{node.attr}"
    return None


def _empty_dict(node: ast.expr) -> bool:
    return (isinstance(node, ast.Dict) and not node.keys) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args and not node.keywords)


def cache_entries(module: ModuleInfo, fn: Any) -> dict[str, list[ast.expr]] | None:
    """``"self.<attr>"`` -> the values the method ``fn`` stores into ``self.<attr>[...]``, for each attribute whose
    entries ``fn`` returns (``return self._cache[key]``) and that its class binds only to an empty dict (``{}`` /
    ``dict()``) and stores into nowhere else; None where ``fn`` returns no such entry (most functions: the cheap
    test of its returns comes first)."""
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    returned = {a for r in fast_walk(fn) if isinstance(r, ast.Return) and isinstance(r.value, ast.Subscript)
                for a in [_self_attr(r.value.value)] if a is not None}
    if not returned:
        return None
    cls = next((c for c in module.classes.values() if any(m is fn for m in c.body)), None)
    if cls is None:
        return None
    stored: dict[str, list[ast.expr]] = {a: [] for a in returned}
    in_fn = {id(n) for n in fast_walk(fn)}
    for n in fast_walk(cls):
        if not isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        targets = n.targets if isinstance(n, ast.Assign) else [n.target]
        for t in targets:
            name = _self_attr(t)
            if name in stored and not (isinstance(n, ast.Assign) and _empty_dict(n.value)):
                return None  # bound to something else than an empty dict
            name = _self_attr(t.value) if isinstance(t, ast.Subscript) else None
            if name in stored:
                if not isinstance(n, ast.Assign) or id(n) not in in_fn:
                    return None  # an entry stored by another method (or updated in place): not read here
                stored[name].append(n.value)
    # method calls that could fill the cache otherwise (``self._cache.update(..)`` / ``setdefault``) are not read
    for n in fast_walk(cls):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and _self_attr(n.func.value) in stored:
            return None
    return {a: v for a, v in stored.items() if v} or None
