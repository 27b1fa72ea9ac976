"""s48 review48: a def replaced later in the same body (a stale first def) is no site of its own.

Python binds the LAST ``def`` of a name in a class (or module) body: where a class keeps an older ``forward`` /
``_norm`` above the live one, the first is never what ``self.forward(..)`` runs (review47 made the method readers
take the last def; the first def was still scanned as a scope of its own, so a candidate in it was a fused branch
that never runs). :func:`replaced_later` names the later def of such a function; a def whose name the body reads
between the two (``forward_v1 = forward``, ``@value.setter`` on the second def: a property's getter) is alive and not
named. Only defs directly in a module or class body; computed once per file, only where a site was found."""

from __future__ import annotations

import ast
from typing import Any, Optional

from npufuse.scan.dataflow import fast_walk

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _reads(nodes: list[ast.AST], name: str) -> bool:
    for root in nodes:
        for n in fast_walk(root):
            if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load):
                return True
    return False


def _stale_in(body: list[ast.stmt], out: dict[int, int]) -> None:
    for i, st in enumerate(body):
        if not isinstance(st, _DEFS):
            continue
        for j in range(i + 1, len(body)):
            later = body[j]
            if isinstance(later, _DEFS) and later.name == st.name:
                # the name read between the two (or by the later def's decorators / defaults): the first is in use
                if not _reads(list(body[i + 1 : j]) + list(later.decorator_list) + list(later.args.defaults)
                              + [d for d in later.args.kw_defaults if d is not None], st.name):
                    out[id(st)] = later.lineno
                break
            if _binds(later, st.name):
                break  # rebound otherwise first (an assignment, a class): not read here


def _binds(st: ast.stmt, name: str) -> bool:
    if isinstance(st, (ast.ClassDef, *_DEFS)):
        return st.name == name
    if isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = st.targets if isinstance(st, ast.Assign) else [st.target]
        return any(isinstance(n, ast.Name) and n.id == name for t in targets for n in fast_walk(t))
    return False


def replaced_later(module: Any, scope: Any) -> Optional[int]:
    """The line of the later def of the scope's function in the same module / class body, or None where it is live.
    Only a qualname two scopes share can be such a def: the tree is walked only then (once per file)."""
    node = scope.node
    if not isinstance(node, _DEFS):
        return None
    table = module.__dict__.get("_npufuse_s48_stale")
    if table is None:
        seen: set[str] = set()
        twice = False
        for s in module.scopes:
            if s.qualname in seen:
                twice = True
                break
            seen.add(s.qualname)
        table = {}
        if twice:
            tree = module.tree
            _stale_in(tree.body, table)
            for n in fast_walk(tree):
                if isinstance(n, ast.ClassDef):
                    _stale_in(n.body, table)
        module.__dict__["_npufuse_s48_stale"] = table
    return table.get(id(node))


def reason(qualname: str, line: int) -> str:
    return (f"`{qualname}` is defined again later in the same body (line {line}), which replaces this definition: "
            "it never runs, so a rewrite of it would never run")
