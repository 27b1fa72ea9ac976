"""s46 (helper optim46, audit46's W1): an optimizer built by a method that a base class of another file calls.

NATSpeech's tasks build their optimizer in ``DiffSpeechTask.build_optimizer(self, model)``; the trainer never names
that method: it calls ``task.configure_optimizers()``, which ``BaseTask`` (utils/commons/base_task.py, an nn.Module)
defines as ``optm = self.build_optimizer(self.model); return [optm]``, and later ``task.zero_grad()`` after
validation. ``Module.zero_grad()`` frees every grad of the task (set_to_none=True by default on torch >= 2.0), so the
fused optimizer's flat grad buffer is stale from the first validation on. The cross-file pass
(:mod:`npufuse.scan.repo_facts`) follows a builder to the files that call it or a module-level forwarder of it; a
base class's method that calls ``self.<builder>(...)`` and returns what it builds is such a forwarder too, reached
through any object of the subclass. :func:`inherited_forwarders` lists them (the builder's class's bases resolved
through the repository's imports, a few levels up), so the driving file's facts about that object are read.

The fix the one-file case takes (rebinding the object's zero_grad to zero in place) is not taken across such a hop:
the driving file may call zero_grad on a wrapper of that object (NATSpeech's ``configure_ddp`` hands the trainer a
DDP around the task, whose own Module.zero_grad the rebinding does not reach), so the candidate becomes a near miss.
"""

from __future__ import annotations

import ast
from typing import Any, Optional

_MAX_LEVELS = 6  # base classes followed up from the builder's class
_MAX_FORWARDERS = 4


def _method_forwards(fn: ast.AST, function: str) -> bool:
    """Does the method call ``self.<function>(...)`` and return what it got (the call, a name bound from it, or a
    list / tuple holding that name: ``return [optm]``)?"""
    bound: set[str] = set()
    called = False
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == function \
                and isinstance(n.func.value, ast.Name) and n.func.value.id == "self":
            called = True
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Attribute) \
                and n.value.func.attr == function and isinstance(n.value.func.value, ast.Name) and n.value.func.value.id == "self":
            bound |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    if not called:
        return False
    for n in ast.walk(fn):
        if not isinstance(n, ast.Return) or n.value is None:
            continue
        v = n.value
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == function:
            return True
        items = v.elts if isinstance(v, (ast.List, ast.Tuple)) else [v]
        if any(isinstance(e, ast.Name) and e.id in bound for e in items):
            return True
    return False


def _class_def(tree: Optional[ast.Module], name: str) -> Optional[ast.ClassDef]:
    for n in tree.body if tree is not None else ():
        if isinstance(n, ast.ClassDef) and n.name == name:
            return n
    return None


def inherited_forwarders(symbols: Any, builder: Any) -> list[Any]:
    """Builders (``repo_facts._Builder``) for the methods of the builder's base classes, in any file of the repo, that
    call the builder method on ``self`` and return what it builds; each has ``via`` set to ``builder`` and
    ``inherited`` True (its driving files' zero_grad frees are near misses, never rebound). [] for a function builder
    or a class whose bases do not resolve into the repository."""
    from npufuse.scan.repo_facts import _Builder

    if symbols is None or not builder.cls or not builder.function:
        return []
    tree, _why = symbols.tree(builder.rel)
    cls = _class_def(tree, builder.cls)
    out: list[Any] = []
    seen: set[tuple[str, str]] = {(builder.rel, builder.cls)}
    todo: list[tuple[str, ast.ClassDef, int]] = [(builder.rel, cls, 0)] if cls is not None else []
    while todo and len(out) < _MAX_FORWARDERS:
        rel, node, level = todo.pop(0)
        if level >= _MAX_LEVELS:
            continue
        for base in node.bases:
            sym = symbols.resolve_node(rel, base)
            if sym.kind != "class" or not isinstance(sym.node, ast.ClassDef) or (sym.file, sym.qualname) in seen:
                continue  # torch.nn.Module and other outside classes end the walk
            seen.add((sym.file, sym.qualname))
            todo.append((sym.file, sym.node, level + 1))
            base_tree, _why = symbols.tree(sym.file)
            if base_tree is None or _class_def(base_tree, sym.node.name) is not sym.node:
                continue  # a nested class: not reachable by name from another file
            for fn in sym.node.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name != builder.function \
                        and _method_forwards(fn, builder.function):
                    fwd = _Builder(sym.file, f"{sym.node.name}.{fn.name}", base_tree)
                    if fwd.function:
                        fwd.via = builder
                        fwd.inherited = True
                        out.append(fwd)
    return out
