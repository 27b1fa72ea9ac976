"""s47 review (helper review47): one reader for "which function does ``self.<m>(..)`` call".

Before, two readers answered it differently and each missed part of Python's attribute lookup:

* ``_site.method`` / ``_site.inherited_method`` (helpers of the norms / rope / swiglu readings) took the FIRST ``def``
  of the name in a class body (Python binds the last one), and refused an instance attribute of that name only where
  the ``__init__`` of a class the method was NOT found in assigned it (``self._norm = ..`` in the class that defines
  ``_norm`` itself, or in any other method, was not seen);
* ``_attention_s46b.inlinable_methods`` (attention's inlined ``self.forward_attention``) never looked at instance
  attributes, also took the first ``def``, and inlined a decorated method's bare body (the decorator's change to the
  arguments or the result was lost).

:func:`lookup` is the one reader both use now. An instance attribute shadows every method of that name (an
``nn.Module`` keeps a plain callable -- a function, ``functools.partial``, a lambda -- in ``__dict__``), so a store of
``self.<m>`` (``=``, augmented, ``del``, a ``for`` / ``with`` target, ``setattr`` / ``delattr(self, "<m>")``) in any
method of any class of the chain refuses the name (precision first: a store of a submodule would not shadow, but what
a store holds is not read here). In a class body the last binding of the name is the one Python keeps: a ``def``
there is the method; anything else (an assignment, a nested class, an import) is not read.
"""

from __future__ import annotations

import ast
from typing import Any, Optional

from npufuse.scan import _method_walk_s48r, bound_callee
from npufuse.scan.dataflow import dotted

# decorators that call the function with the same arguments and return its result (compilation / scripting markers)
_VALUE_PRESERVING = frozenset({
    "torch.compile", "torch.jit.ignore", "torch.jit.unused", "torch.jit.export", "torch.compiler.disable",
    "torch._dynamo.disable", "torch.jit.script_method",
})


def _chain(module: Any, class_name: str) -> list[ast.ClassDef]:
    """The class and the base classes this file defines, in the order Python's method resolution reads them:
    the first base only, and only where it is a module-level class of this file; a class with several bases is
    followed into its first base only where no other base is a class of this file (a diamond over this file's
    classes reorders the lookup)."""
    out: list[ast.ClassDef] = []
    node = module.classes.get(class_name)
    top = {id(st) for st in module.tree.body}
    while node is not None and node not in out and len(out) < 8:
        out.append(node)
        bases = node.bases
        if not bases or not isinstance(bases[0], ast.Name):
            break
        if any(isinstance(b, ast.Name) and b.id in module.classes for b in bases[1:]):
            break
        nxt = module.classes.get(bases[0].id)
        if nxt is None or id(nxt) not in top:
            break  # a base of another module, or a nested class of that name
        node = nxt
    return out


def _instance_stores(module: Any, cls: ast.ClassDef) -> frozenset[str]:
    """Attribute names any method of ``cls`` (``__init__`` included, and what it nests) stores, deletes or sets
    (memoised per class node)."""
    table = module.__dict__.setdefault("_npufuse_s47r_stores", {})
    got = table.get(id(cls))
    if got is None:
        names: set[str] = set()
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.update(_method_walk_s48r.stored_names(module, item))  # s48: from the scope's shared node index
        got = table[id(cls)] = frozenset(names)
    return got


def _last_binding(cls: ast.ClassDef, name: str) -> Optional[ast.AST]:
    """The last statement of ``cls``'s body that binds ``name`` (None where none does)."""
    last: Optional[ast.AST] = None
    for st in cls.body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and st.name == name:
            last = st
        elif isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
                last = st
        elif isinstance(st, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in st.names):
                last = st
        elif isinstance(st, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name
                   or isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)
                   for n in ast.walk(st)):
                last = st  # bound under a condition / loop: not read
    return last


def lookup(module: Any, class_name: Optional[str], name: str, inherit: bool = True) -> Optional[tuple[str, ast.FunctionDef]]:
    """(the class that defines it, the function) that ``self.<name>`` finds on an instance of ``class_name``: the
    nearest class of :func:`_chain` (``inherit=False``: the class itself only) whose body binds ``name``, where that
    last binding is a plain ``def``; None where it is anything else, where no class of the chain binds it, or where
    any method of any class of the chain stores ``self.<name>`` (an instance attribute shadows the method). Memoised
    per (class, name, inherit)."""
    if not class_name or class_name not in module.classes:
        return None
    table = module.__dict__.setdefault("_npufuse_s47r_lookup", {})
    key = (class_name, name, inherit)
    if key in table:
        return table[key]
    chain = _chain(module, class_name)
    found: Optional[tuple[str, ast.FunctionDef]] = None
    if not any(name in _instance_stores(module, c) for c in chain):
        for c in chain if inherit else chain[:1]:
            b = _last_binding(c, name)
            if b is None:
                continue
            if isinstance(b, ast.FunctionDef):
                found = (c.name, b)
            break
    table[key] = found
    return found


def decorators(module: Any, fn: ast.FunctionDef) -> str:
    """"plain" (no decorator, or only compilation markers that call it with the same arguments), "static"
    (``@staticmethod`` alone: called without ``self``), or "other" (a decorator that may change the arguments, the
    result, gradients or the binding: ``@torch.no_grad()``, ``@custom_fwd(cast_inputs=..)``, a user wrapper)."""
    kinds = set()
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        name = module.canonical(target) if isinstance(target, (ast.Name, ast.Attribute)) else None
        if name is None:
            name = dotted(target)
        if isinstance(d, ast.Name) and d.id == "staticmethod":
            kinds.add("static")
        elif name in _VALUE_PRESERVING:
            continue
        else:
            kinds.add("other")
    if "other" in kinds or len(kinds) > 1:
        return "other"
    return "static" if kinds else "plain"


def refusal(module: Any, class_name: Optional[str], name: str) -> Optional[str]:
    """Why ``self.<name>`` is not read as a ``def`` of the chain that binds it (None where it is, or where no class of
    the chain has a ``def`` of that name): said to users, so each clause is what the code does."""
    if not class_name or class_name not in module.classes:
        return None
    chain = _chain(module, class_name)
    if not any(isinstance(st, ast.FunctionDef) and st.name == name for c in chain for st in c.body):
        return None
    for c in chain:
        if name in _instance_stores(module, c):
            for item in c.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    changes = sorted((line, how) for attr, how, line in bound_callee._changes_in(item) if attr == name)
                    if changes:
                        line, how = changes[0]
                        return (f"`{c.name}.{item.name}` changes `self.{name}` ({how}, line {line}): where that has run, "
                                f"`self.{name}(..)` calls the instance attribute, not the method")
    for c in chain:
        b = _last_binding(c, name)
        if b is None:
            continue
        if not isinstance(b, ast.FunctionDef):
            return (f"the last binding of `{name}` in class `{c.name}` (line {b.lineno}) is not a plain `def`: "
                    f"what `self.{name}(..)` calls is not read")
        if decorators(module, b) != "plain":
            deco = ", ".join("@" + " ".join(ast.unparse(d).split())[:40] for d in b.decorator_list)
            return (f"`{c.name}.{name}` is decorated ({deco}): the call runs what the decorator returns, "
                    "not the body as written")
        return None
    return None


def defined_methods(module: Any, cls: ast.ClassDef) -> set[str]:
    """Names of the ``def``\\ s of ``cls``'s chain (whether or not :func:`lookup` reads them)."""
    if cls.name not in module.classes or module.classes[cls.name] is not cls:
        return set()
    return {st.name for c in _chain(module, cls.name) for st in c.body if isinstance(st, ast.FunctionDef)}
