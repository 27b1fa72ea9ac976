"""What a callee chosen by configuration or by a condition may be bound to (issue 14: one shared layer).

Real code rarely calls the fused pattern's function by its name. It calls an attribute or a local that holds one of
several callables, chosen when the module is imported or built:

* a module-level name rebound under ``try: from flash_attn import f as attn except ImportError: from
  torch.nn.functional import scaled_dot_product_attention as attn``, or under ``if flag:`` (``InternRMSNorm =
  FusedRMSNorm`` when apex imports), or ``X = a if cond else b``;
* a registry keyed by a configuration string (``NORMS[cfg.norm]``, ``{"rmsnorm": RMSNorm, ...}[name]``);
* a function or method that returns one of several callables by a string (``_get_activation_fn(name)``:
  ``if name == "silu": return F.silu``), or builds an instance of one (``build_norm(type, d)`` returning
  ``NORM_REGISTRY[type](d)``);
* ``functools.partial(cls, ...)``; ``getattr(module, name)`` (an open set: the module's attributes);
* ``self.<attr>`` assigned in ``__init__`` from any of these.

:func:`choices` returns the finite set of :class:`Member` such a callee may hold, each with the condition under
which the code binds it, and whether every binding was read (``complete``). A detector fuses a member only under an
exact run-time test that the callee holds that member (:func:`identity_test`: ``self.act is F.silu``,
``type(self.norm) is RMSNorm``); every other member runs the original code, and a member the detector cannot fuse
is named in its near miss. Everything is read from the tree, memoised per file; nothing runs unless a detector asks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace
from typing import Optional

from npufuse.scan.dataflow import ModuleInfo, Scope, const_value, dotted, fast_walk

# how deep a chain of names / returns / registries is followed (each step is one binding)
_DEPTH = 6


@dataclass(frozen=True)
class Member:
    """One thing a callee may be bound to."""

    name: str  # canonical dotted name (``torch.nn.functional.silu``) or the file's own def / class (``RMSNorm``)
    node: ast.expr  # the expression that names it, in ``home``'s code
    home: ModuleInfo  # the file whose names ``node`` is read in
    instance: bool = False  # the callee holds an instance built by calling ``name`` (a class), not ``name`` itself
    condition: str = ""  # when the code binds it ("" unconditionally), for reasons
    partial: Optional[ast.Call] = None  # ``functools.partial(name, ...)``: the partial call
    built_by: Optional[ast.Call] = None  # ``instance``: the call that builds it (its arguments: ``eps=...``), in ``home``


@dataclass(frozen=True)
class Choice:
    """The members a callee may hold; ``complete`` when every binding of it was read."""

    members: tuple[Member, ...]
    complete: bool

    def names(self) -> list[str]:
        return list(dict.fromkeys(m.name for m in self.members))


def _cache(module: ModuleInfo, key: str) -> dict:
    return module.__dict__.setdefault(key, {})


# -- module-level bindings ----------------------------------------------------------------------------------------

def module_bindings(module: ModuleInfo, name: str) -> list[tuple[ast.AST, ast.expr | None, str]]:
    """Every module-level binding of ``name`` (through ``if`` / ``try`` / ``with`` blocks, not into defs), in source
    order: (the binding statement, the value expression or None for an import / def / class, its condition text)."""
    table = _cache(module, "_npufuse_bc_module")
    if not table:
        table["\0built"] = True
        _collect_module(module.tree.body, "", table)
    return table.get(name, [])


def _collect_module(body: list[ast.stmt], cond: str, out: dict) -> None:
    for st in body:
        if isinstance(st, (ast.Import, ast.ImportFrom)):
            for a in st.names:
                if a.name != "*":
                    out.setdefault(a.asname or a.name.split(".")[0], []).append((st, None, cond))
        elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.setdefault(st.name, []).append((st, None, cond))
        elif isinstance(st, (ast.Assign, ast.AnnAssign)) and st.value is not None:
            for t in (st.targets if isinstance(st, ast.Assign) else [st.target]):
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, []).append((st, st.value, cond))
        elif isinstance(st, ast.If):
            test = " ".join(ast.unparse(st.test).split())[:60]
            _collect_module(st.body, f"`if {test}:`", out)
            _collect_module(st.orelse, f"the `else` of `if {test}:`", out)
        elif isinstance(st, ast.Try):
            _collect_module(st.body, "the `try` block succeeding", out)
            for h in st.handlers:
                caught = ast.unparse(h.type) if h.type is not None else "any exception"
                _collect_module(h.body, f"`except {caught}`", out)
            _collect_module(st.orelse, "the `try` block succeeding", out)
            _collect_module(st.finalbody, cond, out)
        elif isinstance(st, (ast.With, ast.For, ast.While)):
            _collect_module(st.body, cond, out)


# -- function-local bindings (issue 14, s41): ``if cfg.rms: from .layers import RMSNorm`` inside ``__init__``, ``try:
# from flash_attn import f as attn`` inside ``forward``. A name a function binds anywhere is local to the whole
# function (Python's rule): its uses read only the function's own bindings; a name it does not bind reads the
# nearest enclosing function's, and only then the module's.

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _function_table(module: ModuleInfo, fn: ast.AST) -> tuple[dict, frozenset[str]]:
    """(``module_bindings``' table for ``fn``'s own body, every other name ``fn`` binds: parameters, loop / with /
    except targets, tuple targets, augmented assignments), memoised per function."""
    memo = _cache(module, "_npufuse_bc_functions")
    found = memo.get(id(fn))
    if found is None:
        table: dict = {}
        _collect_module(fn.body, "", table)  # type: ignore[attr-defined]
        other: set[str] = set()
        stores: dict[str, int] = {}
        args = fn.args  # type: ignore[attr-defined]
        other.update(a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg) if a is not None)
        todo: list[ast.AST] = list(fn.body)  # type: ignore[attr-defined]
        while todo:
            n = todo.pop()
            if isinstance(n, (*_FUNCTIONS, ast.ClassDef)):
                other.add(n.name)
                continue  # (a nested def's body is its own scope)
            if isinstance(n, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                continue
            if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
                stores[n.id] = stores.get(n.id, 0) + 1
            elif isinstance(n, ast.ExceptHandler) and n.name:
                other.add(n.name)
            elif isinstance(n, ast.Global):
                other.add("\0global")  # (rare: such a function is not read)
            todo.extend(ast.iter_child_nodes(n))
        # a name stored more often than the table's plain assignments of it is bound otherwise too (a loop target)
        other.update(k for k, c in stores.items() if c > sum(1 for _st, v, _c in table.get(k, ()) if v is not None))
        found = memo[id(fn)] = (table, frozenset(other))
    return found


def _enclosing_function(module: ModuleInfo, fn: ast.AST) -> Optional[ast.AST]:
    """The function whose body (through classes and blocks) defines ``fn``; None at module level (memoised)."""
    parents = _cache(module, "_npufuse_bc_parents")
    if not parents:
        parents["\0built"] = True
        todo: list[tuple[ast.AST, Optional[ast.AST]]] = [(module.tree, None)]
        while todo:
            node, owner = todo.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, _FUNCTIONS):
                    parents[id(child)] = owner
                    todo.append((child, child))
                elif isinstance(child, (ast.stmt, ast.ExceptHandler, ast.match_case)):
                    todo.append((child, owner))
    return parents.get(id(fn))


def name_bindings(module: ModuleInfo, fn: Optional[ast.AST], name: str) -> Optional[list[tuple[ast.AST, ast.expr | None, str]]]:
    """The bindings of ``name`` a read of it inside function ``fn`` sees, as :func:`module_bindings` gives them: the
    function's own where it binds the name (an import in an ``if`` arm or under ``try`` included), else the nearest
    enclosing function's, else the module's; None where the function that binds it binds it in a way not read here
    (a parameter, a loop target, a ``global`` statement)."""
    while isinstance(fn, _FUNCTIONS):
        table, other = _function_table(module, fn)
        if "\0global" in other:
            return None
        if name in table or name in other:
            return None if name in other else table[name]
        fn = _enclosing_function(module, fn)
    return module_bindings(module, name)


def import_aliases(module: ModuleInfo, targets: frozenset[str] | set[str] | tuple[str, ...]) -> list[str]:
    """The names any ``from m import x as name`` of the file (in a function or block too) binds to a dotted name of
    ``targets``."""
    from npufuse.scan.dataflow import _statements_bfs

    return list(dict.fromkeys(a.asname or a.name for n in _statements_bfs(module.tree)
                              if isinstance(n, ast.ImportFrom) and n.module and not n.level
                              for a in n.names if f"{n.module}.{a.name}" in targets))


def _import_member(node: ast.Name, st: ast.Import | ast.ImportFrom, module: ModuleInfo, instance: bool, cond: str) -> Member:
    """The member an import statement binds ``node``'s name to: its dotted name (the name itself for a relative
    import, read through the repository by the detectors)."""
    a = next(a for a in st.names if (a.asname or a.name.split(".")[0]) == node.id)
    full = (f"{st.module}.{a.name}" if isinstance(st, ast.ImportFrom) and st.module and not st.level
            else a.name if isinstance(st, ast.Import) else node.id)
    return Member(full, node, module, instance, cond)


def rebound_class(module: ModuleInfo, name: str) -> Optional[str]:
    """For a class ``name`` defined in this file: a description of another module-level binding of the same name
    (InternViT's ``try: from apex.normalization import FusedRMSNorm; InternRMSNorm = FusedRMSNorm``), else None.
    Where one exists, ``name`` at run time may be that other class: a test ``type(m) is name`` proves nothing."""
    found = module_bindings(module, name)
    if len(found) < 2:
        return None
    for st, value, cond in found:
        if isinstance(st, ast.ClassDef):
            continue
        what = ast.unparse(value)[:60] if value is not None else " ".join(ast.unparse(st).split())[:60]
        return f"`{name} = {what}` under {cond}" if value is not None and cond else \
            f"`{what}`" + (f" under {cond}" if cond else "")
    return None


def own_class_test(held: str, class_name: str) -> str:
    """A run-time test that ``held`` is an instance of exactly the class this file's ``class ClassName`` statement
    makes, also where the name is rebound to another class at module level (its qualname and module differ)."""
    return f'type({held}).__qualname__ == "{class_name}" and type({held}).__module__ == __name__'


# -- attributes ---------------------------------------------------------------------------------------------------

def attribute_values(module: ModuleInfo, class_name: Optional[str], attr: str) -> list[ast.expr]:
    """The values of every ``self.<attr> = value`` in the class's methods (each arm of an if / elif registry in
    ``__init__`` included), in source order; [] where the class is not this file's."""
    return [v for v, _scope in _attribute_stores(module, class_name, attr)]


@dataclass(frozen=True)
class Change:
    """Where code of a class outside ``__init__`` changes an attribute first, and how."""

    method: str  # ``Class.method`` (``Class.__init__.<hook>`` for a function nested in ``__init__``: it runs later)
    how: str  # "stored", "deleted", "stored on `<receiver>`", "item stored", "item deleted", "pop()", "setattr", ...
    line: int


_SHRINKING = ("pop", "remove", "clear")


def changed_outside_init(module: ModuleInfo, class_name: Optional[str]) -> dict[str, Change]:
    """Per attribute, the first code of the class outside ``__init__``'s own statements that changes it (s46: one
    reader for every "is ``self.<attr>``'s ``__init__`` value still the one a call sees" question): a store, ``del``,
    augmented / loop / ``with`` target (any receiver: ``other.act = ..`` in a method may be this module), an item
    stored or deleted (``self.experts[-1] = ..``), ``self.<attr>.pop()`` / ``remove`` / ``clear``, ``setattr`` /
    ``delattr(self, "<attr>", ..)``. Methods in source order; a function or lambda nested in ``__init__`` counts (a
    hook it registers runs after construction). Memoised per class."""
    cls = module.classes.get(class_name) if class_name else None
    if cls is None:
        return {}
    table = _cache(module, "_npufuse_bc_changed")
    found = table.get(class_name)
    if found is None:
        found = table[class_name] = {}
        for item in cls.body:
            if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if item.name != "__init__":
                roots: list[tuple[str, ast.AST]] = [(f"{class_name}.{item.name}", item)]
            else:  # only what __init__ defines to run later
                roots = [(f"{class_name}.__init__.{getattr(n, 'name', '<lambda>')}", n) for n in fast_walk(item)
                         if n is not item and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
            for where, root in roots:
                for attr, how, line in sorted(_changes_in(root), key=lambda c: c[2]):
                    found.setdefault(attr, Change(where, how, line))
    return found


def _changes_in(root: ast.AST, how: bool = True) -> list[tuple[str, str, int]]:
    """(attribute, how, line) of every change :func:`changed_outside_init` counts under ``root``. ``how`` False: the
    same attributes and lines with an empty ``how`` (s47: one walk instead of two and no unparsing, for callers that
    need the names only)."""
    out: list[tuple[str, str, int]] = []
    augmented = {id(n.target) for n in fast_walk(root) if isinstance(n, ast.AugAssign)} if how else set()
    for n in fast_walk(root):
        line = getattr(n, "lineno", 0)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)):
            if not how:
                out.append((n.attr, "", line))
                continue
            on_self = isinstance(n.value, ast.Name) and n.value.id == "self"
            text = ("deleted" if isinstance(n.ctx, ast.Del) else "augmented" if id(n) in augmented else "stored") if on_self \
                else f"stored on `{' '.join(ast.unparse(n.value).split())[:40]}`"
            out.append((n.attr, text, line))
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, (ast.Store, ast.Del)):
            base = n.value
            while isinstance(base, ast.Subscript):
                base = base.value
            if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id == "self":
                out.append((base.attr, "item deleted" if isinstance(n.ctx, ast.Del) else "item stored", line))
        elif isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr in _SHRINKING and isinstance(f.value, ast.Attribute) \
                    and isinstance(f.value.value, ast.Name) and f.value.value.id == "self":
                out.append((f.value.attr, f"{f.attr}()", line))
            elif isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and len(n.args) >= 2 \
                    and isinstance(n.args[0], ast.Name) and n.args[0].id == "self" and isinstance(n.args[1], ast.Constant) \
                    and isinstance(n.args[1].value, str):
                out.append((n.args[1].value, f.id, line))
    return out


def _attribute_stores(module: ModuleInfo, class_name: Optional[str], attr: str) -> list[tuple[ast.expr, Optional[Scope]]]:
    """(value, the method's scope) of every ``self.<attr> = value`` of the class (memoised per class)."""
    cls = module.classes.get(class_name) if class_name else None
    if cls is None:
        return []
    table = _cache(module, "_npufuse_bc_attrs")
    stores = table.get(class_name)
    if stores is None:
        stores = table[class_name] = {}
        scopes = {id(s.node): s for s in module.scopes}
        for item in cls.body:
            if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for n in fast_walk(item):
                for t, value in self_attribute_stores(n):
                    stores.setdefault(t.attr, []).append((value, scopes.get(id(item))))
    return stores.get(attr, [])


def self_attribute_stores(node: ast.AST) -> list[tuple[ast.Attribute, ast.expr]]:
    """(``self.<attr>`` target, its value) of one assignment node: ``self.a = v``, ``self.a: T = v``, ``self.a =
    self.b = v`` and each element of ``self.a, self.b = v, w`` (paired by position, nested tuples too). An element
    whose own value is not written out (``self.a, self.b = pair()``, a starred side) gets the literal ``...``: a store
    that happened with a value nothing reads as known (s45 review: tuple stores were skipped, so an attribute stored
    a second time that way looked assigned once)."""
    if isinstance(node, ast.Assign):
        pairs: list[tuple[ast.expr, ast.expr]] = [(t, node.value) for t in node.targets]
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        pairs = [(node.target, node.value)]
    else:
        return []
    out: list[tuple[ast.Attribute, ast.expr]] = []
    while pairs:
        target, value = pairs.pop(0)
        if isinstance(target, (ast.Tuple, ast.List)):
            elts = target.elts
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(elts) \
                    and not any(isinstance(e, ast.Starred) for e in (*elts, *value.elts)):
                pairs += list(zip(elts, value.elts))
            else:
                unknown = ast.copy_location(ast.Constant(value=...), value)
                pairs += [(e.value if isinstance(e, ast.Starred) else e, unknown) for e in elts]
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            out.append((target, value))
    return out


def attribute_value_before(scope: Scope, attr: str, line: int) -> Optional[ast.expr]:
    """The value of the last ``self.<attr> = value`` of this scope's own straight-line body before ``line`` (Trainer
    ``__init__``'s ``self.optimizer = getattr(optim, name)`` then ``self.optimizer = self.optimizer(params)``); None
    where an assignment in a nested block (an ``if`` arm) or none stands before it."""
    found: Optional[ast.expr] = None
    for st in scope.body:
        if st.lineno >= line:
            break
        if isinstance(st, ast.Assign) and len(st.targets) == 1:
            t = st.targets[0]
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" and t.attr == attr:
                found = st.value
                continue
        if isinstance(st, (ast.Expr, ast.Return)):
            continue  # (an expression stores no attribute)
        # the targets of an assignment, or the whole of a compound statement (an ``if`` arm may bind it)
        parts = st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(st, (ast.AnnAssign, ast.AugAssign)) else [st]
        if any(isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.ctx, ast.Store) for p in parts for n in fast_walk(p)):
            return None  # bound otherwise (a tuple target, an augmented assignment, a nested block): not read here
    return found


# -- functions returning callables --------------------------------------------------------------------------------

def function_of_call(module: ModuleInfo, class_name: Optional[str], call: ast.Call,
                     foreign: bool = True) -> Optional[tuple[ModuleInfo, ast.FunctionDef]]:
    """The function a call runs: ``f(...)`` of this file or (``foreign``) imported from another file of the
    repository, or ``self.m(...)`` / ``Cls.m(...)`` a method of this file's class; None otherwise."""
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        owner = class_name if f.value.id == "self" else f.value.id if f.value.id in module.classes else None
        cls = module.classes.get(owner) if owner else None
        fn = next((it for it in cls.body if isinstance(it, ast.FunctionDef) and it.name == f.attr), None) if cls else None
        return (module, fn) if fn is not None else None
    if not isinstance(f, ast.Name):
        return None
    fn = module.functions.get(f.id)
    if isinstance(fn, ast.FunctionDef):
        return module, fn
    if not foreign or (f.id not in module.aliases and f.id not in module.relative_imports):
        return None
    from npufuse.patterns.add_rms_norm import _foreign_definition

    found = _foreign_definition(module, f.id)
    if found is None or not isinstance(found[1], ast.FunctionDef):
        return None
    return found[0], found[1]  # type: ignore[return-value]


def returned_values(fn: ast.FunctionDef) -> list[ast.expr]:
    """The values of ``fn``'s own returns (not of functions nested in it); [] where one returns nothing."""
    out: list[ast.expr] = []
    todo: list[ast.AST] = list(fn.body)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(n, ast.Return):
            if n.value is None:
                return []
            out.append(n.value)
        todo.extend(ast.iter_child_nodes(n))
    out.sort(key=lambda v: (v.lineno, v.col_offset))
    return out


# -- the resolver -------------------------------------------------------------------------------------------------

def choices(module: ModuleInfo, scope: Scope, node: ast.expr) -> Optional[Choice]:
    """The members the callee expression ``node`` (``self.act``, ``attn``, ``NORMS[cfg.norm]``,
    ``self._get_activation_fn(name)``, ``partial(optim.Adam, lr=1)``) may hold where ``scope`` reads it; None
    where it is not one of these forms (a parameter, another object's attribute)."""
    members: list[Member] = []
    complete = _expand(module, scope.class_name, node, "", members, _DEPTH, local=scope)
    if not members:
        return None
    unique: dict[tuple[str, bool, int], Member] = {}
    for m in members:
        unique.setdefault((m.name, m.instance, id(m.partial)), m)
    return Choice(tuple(unique.values()), complete)


def _expand(module: ModuleInfo, class_name: Optional[str], node: ast.expr, cond: str, out: list[Member], depth: int,
            local: Optional[Scope] = None, instance: bool = False) -> bool:
    """Add the members ``node`` may evaluate to (``instance``: the value is made by calling them); returns whether
    every one was read."""
    if depth <= 0:
        return False
    if isinstance(node, ast.IfExp):
        test = " ".join(ast.unparse(node.test).split())[:60]
        a = _expand(module, class_name, node.body, f"`{test}` holding", out, depth - 1, local, instance)
        b = _expand(module, class_name, node.orelse, f"`{test}` failing", out, depth - 1, local, instance)
        return a and b
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        stores = _attribute_stores(module, class_name, node.attr)
        cls = module.classes.get(class_name) if class_name else None
        if not stores and cls is not None and any(isinstance(it, (ast.FunctionDef, ast.AsyncFunctionDef)) and it.name == node.attr
                                                  for it in cls.body):
            out.append(Member(f"{class_name}.{node.attr}", node, module, instance, cond))  # a method of the class
            return True
        if not stores:
            return False
        ok = True
        for v, where in stores:
            ok = _expand(module, class_name, v, cond, out, depth - 1, where, instance) and ok
        return ok
    if isinstance(node, ast.Name) and local is not None and isinstance(local.node, _FUNCTIONS) and \
            _locally_bound(module, local.node, node.id):
        return _expand_local_name(module, class_name, node, cond, out, depth, local, instance)
    if isinstance(node, ast.Name) and local is not None and node.id in local.assignments:
        ok = True
        for _st, v in local.assignments[node.id]:
            ok = _expand(module, class_name, v, cond, out, depth - 1, local, instance) and ok
        return ok and node.id not in local.args
    if isinstance(node, ast.Name) and local is not None and node.id in local.args:
        return False  # a parameter: chosen by the caller
    if isinstance(node, ast.Name):
        return _expand_module_name(module, class_name, node, cond, out, depth, instance)
    if isinstance(node, ast.Attribute) and dotted(node) is not None:
        out.append(Member(module.canonical(node) or dotted(node) or "", node, module, instance, cond))
        return True
    if isinstance(node, ast.Subscript):
        return _expand_registry(module, class_name, node.value, node.slice, cond, out, depth, local, instance)
    if isinstance(node, ast.Call):
        return _expand_call(module, class_name, node, cond, out, depth, local, instance)
    return False


def _locally_bound(module: ModuleInfo, fn: ast.AST, name: str) -> bool:
    """Does ``fn`` or a function enclosing it bind ``name`` by an import (the reads :func:`_expand_local_name` adds)?"""
    while isinstance(fn, _FUNCTIONS):
        table, other = _function_table(module, fn)
        if name in table or name in other:
            return any(isinstance(st, (ast.Import, ast.ImportFrom)) for st, _v, _c in table.get(name, ()))
        fn = _enclosing_function(module, fn)
    return False


def _expand_local_name(module: ModuleInfo, class_name: Optional[str], node: ast.Name, cond: str, out: list[Member],
                       depth: int, local: Scope, instance: bool) -> bool:
    """A name imported inside the reading function or one enclosing it: each import's member (under its ``if`` arm /
    ``try`` condition), and the values of that function's assignments of the name."""
    fn: Optional[ast.AST] = local.node
    while isinstance(fn, _FUNCTIONS):
        table, other = _function_table(module, fn)
        if node.id in table or node.id in other:
            break
        fn = _enclosing_function(module, fn)
    owner = local if fn is local.node else next((s for s in module.scopes if s.node is fn), None)
    bindings = name_bindings(module, fn, node.id) or []
    ok = owner is not None and not any(isinstance(st, (*_FUNCTIONS, ast.ClassDef)) for st, _v, _c in bindings)
    for st, _value, where in bindings:
        if isinstance(st, (ast.Import, ast.ImportFrom)):
            out.append(_import_member(node, st, module, instance, where or cond))
    if owner is not None:
        for _st, v in owner.assignments.get(node.id, ()):
            ok = _expand(module, class_name, v, cond, out, depth - 1, owner, instance) and ok
    _table, other = _function_table(module, fn) if fn is not None else ({}, frozenset())
    return ok and node.id not in other


def _expand_module_name(module: ModuleInfo, class_name: Optional[str], node: ast.Name, cond: str, out: list[Member],
                        depth: int, instance: bool) -> bool:
    found = module_bindings(module, node.id)
    if not found:
        return node.id in ("True", "False", "None")  # a builtin or undefined name: not read
    ok = True
    for st, value, where in found:
        c = where or cond
        if value is not None:
            ok = _expand(module, class_name, value, c, out, depth - 1, None, instance) and ok
        elif isinstance(st, (ast.Import, ast.ImportFrom)):
            out.append(_import_member(node, st, module, instance, c))
        else:
            out.append(Member(node.id, node, module, instance, c))  # the file's own def / class
    return ok


def _expand_registry(module: ModuleInfo, class_name: Optional[str], table: ast.expr, key: ast.expr, cond: str,
                     out: list[Member], depth: int, local: Optional[Scope], instance: bool) -> bool:
    """``TABLE[key]`` with TABLE a dict literal (this scope's, the module's or the class's ``self.<attr>``): the
    entry of a constant key, or every entry."""
    d: Optional[ast.expr] = None
    if isinstance(table, ast.Dict):
        d = table
    elif isinstance(table, ast.Name):
        if local is not None and table.id in local.assignments:
            vals = [v for _s, v in local.assignments[table.id]]
        else:
            vals = [v for _st, v, _c in module_bindings(module, table.id) if v is not None]
        d = vals[0] if len(vals) == 1 else None
    elif isinstance(table, ast.Attribute) and isinstance(table.value, ast.Name) and table.value.id == "self":
        vals = attribute_values(module, class_name, table.attr)
        d = vals[0] if len(vals) == 1 else None
    if not isinstance(d, ast.Dict) or not d.values or any(k is None for k in d.keys):
        return False
    wanted = const_value(key)
    pairs = [(const_value(k), v) for k, v in zip(d.keys, d.values)]
    if isinstance(wanted, str):
        pairs = [(k, v) for k, v in pairs if k == wanted]
        if not pairs:
            return False
    ok = True
    for k, v in pairs:
        ok = _expand(module, class_name, v, f"key {k!r}" if isinstance(k, str) else cond, out, depth - 1, local, instance) and ok
    return ok


def _expand_call(module: ModuleInfo, class_name: Optional[str], node: ast.Call, cond: str, out: list[Member],
                 depth: int, local: Optional[Scope], instance: bool) -> bool:
    name = module.canonical(node.func) or ""
    if name in ("functools.partial", "partial") and node.args and not instance:
        inner: list[Member] = []
        ok = _expand(module, class_name, node.args[0], cond, inner, depth - 1, local)
        out.extend(Member(m.name, m.node, m.home, m.instance, m.condition, node) for m in inner)
        return ok
    if name == "getattr" and len(node.args) >= 2 and "getattr" not in module.aliases and not instance:
        owner = module.canonical(node.args[0])
        key = const_value(node.args[1])
        if owner is None:
            return False
        if isinstance(key, str):
            out.append(Member(f"{owner}.{key}", node, module, instance, cond))
            return True
        out.append(Member(f"{owner}.*", node, module, instance, cond))  # any attribute: an open set
        return False
    if instance:
        return False  # a call's result called again to build the instance: not read
    found = function_of_call(module, class_name, node)
    if found is not None:
        home, fn = found
        returns = returned_values(fn)
        if not returns:
            return False
        fscope = next((s for s in home.scopes if s.node is fn), None)
        owner = class_name if home is module and isinstance(node.func, ast.Attribute) else None
        ok = True
        for r in returns:
            ok = _expand(home, owner, r, cond, out, depth - 1, fscope) and ok
        return ok
    # ``Cls(...)``: an instance of what the callee names, built by this call (the nearest one where a local
    # alias is called: ``norm_cls = A if c else B; self.norm = norm_cls(d)``)
    start = len(out)
    ok = _expand(module, class_name, node.func, cond, out, depth - 1, local, instance=True)
    out[start:] = [m if m.built_by is not None else replace(m, built_by=node) for m in out[start:]]
    return ok


def identity_test(held: str, member: Member, spelled: str) -> str:
    """The run-time test that ``held`` holds ``member``, given how this file spells it (``spelled``): ``held is F``
    for a callable, ``type(held) is Cls`` for an instance."""
    return f"type({held}) is {spelled}" if member.instance else f"{held} is {spelled}"
