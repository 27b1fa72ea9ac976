"""s51 (optim51b): torch.optim classes reached through another file of the repository, and facts scoped to their objects.

1. A registry table of torch.optim classes imported from a repository module (``from optimizers import
   OPTIMIZERS`` where ``optimizers/__init__.py`` holds ``OPTIMIZERS = {"sgd": SGD, "adam": Adam}``), or a
   module-level table of this file, read by a function whose text names no optimizer class
   (``OPTIMIZERS[cfg.optimizer_name](params, lr=..)``): :func:`imported_table` tells the fusable classes of such a table
   (the construction then becomes s32's looked-up site: its guard checks the class the lookup yields at run time,
   so the table's other classes -- and any entry added at run time -- keep running unchanged), and
   :func:`registry_words` opens the scope gate for the table's name.
2. ``from config import *`` where ``config.py`` does ``from torch.optim import Adam, SGD``: :func:`star_optim_aliases`
   resolves the star import through the repository's modules (a chain of star imports too) and names each
   torch.optim class bound that way, so ``Adam(model.parameters(), ..)`` is the torch.optim construction it is.
3. A module-level if/else chain of torch.optim classes (:func:`module_class_kinds`) and a table handed in through an
   attribute or parameter (:func:`handed_table`): looked-up sites under the same run-time class test; a lookup whose
   guard cannot be written is a near miss saying why (:func:`table_lookup_refusal`).
4. ``.grad`` writes in another class's methods on objects that class holds (an A3C worker's global network) do not
   concern an optimizer over a module the site's class keeps to itself (:func:`foreign_grad_write_lines`).
5. Params from a repository method that returns a list comprehension (:func:`list_method_receiver`): the guard reads the
   receiver's parameters, never the method's result.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path, PurePosixPath
from typing import Any, Optional

# module-level names whose binding the scan looks for in another file: a literal table of classes
_TABLES = (ast.Dict, ast.Tuple, ast.List)
_STAR_DEPTH = 3


def _locate(root: Path, from_rel: str, mod: str) -> Optional[tuple[str, ast.Module]]:
    """(repo-relative path, tree) of the repository module ``mod`` as imported from ``from_rel`` (the same search as
    ``repo_facts._find``: the repository root, then each folder above the importing file), or None."""
    from npufuse.scan import repo_facts

    if not mod or any(p in ("", "..") for p in mod.split(".")):
        return None
    parts = mod.split(".")
    for base in dict.fromkeys([PurePosixPath("."), *PurePosixPath(from_rel).parents]):
        for cand in (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py")):
            tree = repo_facts._parse_repo_file(root, str(cand))
            if tree is not None:
                return str(cand), tree
    return None


def _from_module(node: ast.ImportFrom, rel: str) -> str:
    """The dotted module a ``from .. import`` names, relative levels resolved against ``rel``."""
    if node.level == 0:
        return node.module or ""
    base = PurePosixPath(rel).parent
    for _ in range(node.level - 1):
        base = base.parent
    parts = [p for p in base.parts if p not in ("", ".")] + ((node.module or "").split(".") if node.module else [])
    return ".".join(parts)


def _torch_optim_name(tree: ast.Module, rel: str, node: ast.AST) -> Optional[str]:
    """``torch.optim.<X>`` for a name / attribute of ``tree``'s module that a top-level import binds to a torch.optim
    member (``from torch.optim import SGD``, ``import torch.optim as optim`` + ``optim.SGD``, ``import torch`` +
    ``torch.optim.SGD``); None otherwise."""
    from npufuse.scan import repo_facts
    from npufuse.scan.dataflow import dotted

    text = dotted(node) or ""
    if not text:
        return None
    head = text.split(".")[0]
    if text.startswith("torch.optim.") and any(isinstance(n, ast.Import) and any(a.name.split(".")[0] == "torch" and a.asname is None
                                                                                 for a in n.names) for n in tree.body):
        return text
    found = repo_facts._imported(tree, rel, text if text.count(".") <= 1 else head)
    if found is None or text.count(".") > 1:
        return None
    full = f"{found[0]}.{found[1]}"
    return full if full.startswith("torch.optim.") else None


def _binding(tree: ast.Module, name: str) -> Optional[ast.expr]:
    """The value of the last top-level ``name = <value>`` of ``tree``, or None."""
    value = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            value = node.value
    return value


def _table_classes(tree: ast.Module, rel: str, table: ast.expr) -> list[str]:
    """The torch.optim classes (``torch.optim.X``) among a literal table's entries."""
    values = [v for v in table.values if v is not None] if isinstance(table, ast.Dict) else list(getattr(table, "elts", []))
    return [c for c in (_torch_optim_name(tree, rel, v) for v in values if isinstance(v, (ast.Name, ast.Attribute))) if c]


def imported_table(module: Any, name: str) -> Optional[list[str]]:
    """The torch.optim classes of the literal table ``name`` that a top-level ``from <repo module> import name``
    of ``module`` binds (a re-export through a package ``__init__`` followed up to three files); None where the
    name is not imported from the repository or is not bound to a literal table there. Cached per module."""
    from npufuse.scan import repo_facts

    cache: dict[str, Optional[list[str]]] = module.__dict__.setdefault("_npufuse_s51b_tables", {})
    if name in cache:
        return cache[name]
    cache[name] = None
    root = repo_facts.repo_root(module)
    if root is None:
        return None
    repo_facts._depends(root, module.path)  # the answer depends on another file
    tree, rel, attr = module.tree, module.path, name
    for _ in range(_STAR_DEPTH + 1):
        target = repo_facts._imported(tree, rel, attr)
        if target is None:
            return None
        found = _locate(root, rel, target[0])
        if found is None:
            return None
        rel, tree = found
        attr = target[1]
        value = _binding(tree, attr)
        if value is not None:
            if isinstance(value, _TABLES):
                cache[name] = _table_classes(tree, rel, value)
            return cache[name]
    return None


# a name subscripted or read with `.get(` in the text: the uses of a table this module looks classes up in
_LOOKED_UP = re.compile(r"\b([A-Za-z_]\w*)\s*(?:\[|\.get\()")


def registry_words(module: Any, fusable: tuple[str, ...]) -> tuple[str, ...]:
    """Names of tables holding a fusable torch.optim class that ``module`` looks a class up in: imported from a
    repository module (:func:`imported_table`) or bound at this module's top level. The scope gate's extra words
    (a function calling ``OPTIMIZERS[name](..)`` names no class). Cached per module; empty in a file that never
    says "optim" in any case (the cheap test first)."""
    cached = module.__dict__.get("_npufuse_s51b_words")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    src: str = module.source
    words: list[str] = []
    says = "optim" in src or "OPTIM" in src or "Optim" in src
    if says and "[" in src:
        used = set(_LOOKED_UP.findall(src))
        imported = {a.asname or a.name for n in module.tree.body if isinstance(n, ast.ImportFrom)
                    and not (n.module or "").startswith(("torch", "typing")) for a in n.names if a.name != "*"}
        for name in sorted(used):
            if "optim" in name.lower() and f"self.{name}" in src and name.isascii():
                words.append(name)  # an attribute table handed in (:func:`handed_table`): the guard decides
                continue
            if name in imported:
                kinds = imported_table(module, name)
            else:
                value = _binding(module.tree, name)
                kinds = _table_classes(module.tree, module.path, value) if isinstance(value, _TABLES) else None
            if kinds and any(k.split(".")[-1] in fusable for k in kinds) and name.isascii():
                words.append(name)
    if says:
        # module-level names an if/else chain binds to torch.optim classes (:func:`module_class_kinds`)
        words += [name for name, bound in module.scopes[0].assignments.items() if len(bound) > 1 and name.isascii()
                  and module_class_kinds(module, name, dict.fromkeys(fusable))]
    cached = module.__dict__["_npufuse_s51b_words"] = tuple(words)
    return cached


def _exported(tree: ast.Module) -> Optional[set[str]]:
    """The names ``__all__`` lists (a literal list / tuple of strings), or None (every public name)."""
    value = _binding(tree, "__all__")
    if isinstance(value, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts):
        return {e.value for e in value.elts}  # type: ignore[attr-defined]
    return None


def _star_bindings(root: Path, rel: str, tree: ast.Module, depth: int) -> dict[str, Optional[str]]:
    """Public names ``from <tree's module> import *`` binds -> ``torch.optim.X`` where a top-level import of that
    module (or a star import it does in turn) binds the name to a torch.optim member, None for any other binding
    (a def, an assignment, another import): the last binding of a name wins, as at import time."""
    out: dict[str, Optional[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if any(a.name == "*" for a in node.names):
                mod = _from_module(node, rel)
                if mod == "torch" or mod.startswith("torch."):
                    continue
                found = _locate(root, rel, mod) if depth < _STAR_DEPTH else None
                if found is None:
                    out = {k: None for k in out}  # names npufuse does not see may rebind any of these
                    out["*"] = None
                    continue
                out.update(_star_bindings(root, found[0], found[1], depth + 1))
                continue
            mod = _from_module(node, rel)
            for a in node.names:
                full = f"{mod}.{a.name}"
                out[a.asname or a.name] = full if full.startswith("torch.optim.") and full.count(".") == 2 else None
        elif isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = None
        else:
            # any other statement: every name it may bind at module level (an import or def under an `if`, a
            # `global` rebinding inside a function) counts as a binding to something else (conservative: a function's
            # own locals are counted too)
            for n in ast.walk(node):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    out[n.name] = None
                elif isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
                    out[n.id] = None
                elif isinstance(n, ast.alias):
                    out[n.asname or n.name.split(".")[0]] = None
                elif isinstance(n, ast.Global):
                    out.update(dict.fromkeys(n.names))
    exported = _exported(tree)
    return {k: v for k, v in out.items() if (k in exported if exported is not None else not k.startswith("_"))}


def star_optim_aliases(module: Any) -> dict[str, str]:
    """Names a top-level ``from <repo module> import *`` of ``module`` binds to a torch.optim member (resolved through
    the repository's modules, star chains up to three deep) and that nothing else in the file binds: each is an
    alias of that member, like ``from torch.optim import X``. Added to ``module.aliases`` by the caller. Cached."""
    cached = module.__dict__.get("_npufuse_s51b_star")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    from npufuse.scan import repo_facts

    out: dict[str, str] = {}
    root = repo_facts.repo_root(module)
    stars = [n for n in module.tree.body if isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names)]
    if root is not None and stars:
        repo_facts._depends(root, module.path)
        seen: dict[str, Optional[str]] = {}
        for node in stars:  # in order: a later star import rebinds a name an earlier one bound
            mod = _from_module(node, module.path)
            if mod == "torch" or mod.startswith("torch."):
                continue  # torch's own modules bind no torch.optim class name under another meaning
            found = _locate(root, module.path, mod)
            if found is None:
                seen = {k: None for k in seen}  # a module outside the repository may rebind any name
                continue
            seen.update(_star_bindings(root, found[0], found[1], 1))
        # where the file binds the name no other way (a later `Adam = ..`, `def Adam` or import makes it another object)
        out = {k: v for k, v in sorted(seen.items()) if v is not None and k not in module.aliases and _only_star_bound(module.tree, k)}
    cached = module.__dict__["_npufuse_s51b_star"] = out
    return cached


def _only_star_bound(tree: ast.Module, name: str) -> bool:
    """No store, parameter, def, class, import alias or global of ``name`` anywhere in the file (the star import is
    its only binding: ``_names_bound_elsewhere`` counts one module-level assignment as expected, here there is none)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Load):
            return False
        if isinstance(n, ast.arg) and n.arg == name:
            return False
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name:
            return False
        if isinstance(n, ast.alias) and (n.asname or n.name.split(".")[0]) == name:
            return False
        if isinstance(n, (ast.Global, ast.Nonlocal)) and name in n.names:
            return False
    return True


def table_lookup_refusal(module: Any, scope: Any, stmt: ast.stmt) -> Optional[Any]:
    """A NearMiss for a construction through a lookup in a table of torch.optim classes (``OPTIMIZERS[key](..)`` /
    ``OPTIMIZERS.get(key)(..)``, the table this scope's, the module's or imported from the repository) that s39's
    looked-up site did not take: the key calls code (the guard would evaluate it again) or the parameters come
    through a ``**`` mapping only. None where no such lookup is called here."""
    from npufuse.patterns import fused_optimizer as fo
    from npufuse.patterns.base import NearMiss
    from npufuse.scan.dataflow import fast_walk, keyword, segment

    for call in fast_walk(stmt):
        if not isinstance(call, ast.Call):
            continue
        lookup = call.func
        parts = fo.table_lookup(lookup)
        if parts is None:
            continue
        key = parts[1]
        kinds, table = fo._s34_lookup_kinds(module, scope, lookup, stmt.lineno)
        if not kinds or table is None:
            continue
        where = f"`{segment(module, lookup)[:60]}` ({table} holds torch.optim.{', torch.optim.'.join(kinds)})"
        hand = ("; torch_npu.optim.NpuFused<Name> takes the same constructor arguments and could take the class's place by "
                "hand once the constraints hold (fp32/fp16 params, grads never set to None, no FSDP/DeepSpeed)")
        line, end = stmt.lineno, stmt.end_lineno or stmt.lineno
        if not fo._side_effect_free(key):
            return NearMiss(fo._ID, scope.qualname, line, end,
                            f"the optimizer class is looked up at run time in {where} by a key that calls code "
                            f"(`{segment(module, key)[:40]}`): a guard testing the class would evaluate it a second time{hand}")
        params = keyword(call, "params", 0)
        if params is None and any(k.arg is None for k in call.keywords):
            star = next(k for k in call.keywords if k.arg is None)
            return NearMiss(fo._ID, scope.qualname, line, end,
                            f"the optimizer class is looked up at run time in {where} and the parameters come only through "
                            f"`**{segment(module, star.value)[:40]}`, a mapping whose keys npufuse does not read: which "
                            f"arguments the fused class would get cannot be told{hand}")
    return None


def module_class_kinds(module: Any, name: str, fusable: dict[str, Any]) -> tuple[str, ...]:
    """The fusable torch.optim classes a module-level name may hold where every top-level binding of it (an ``if`` /
    ``else`` chain on a flag, a ``try``) is a class expression and one at least is a fusable torch.optim class
    (``if args.adam: OptimCls = torch.optim.Adam`` / ``else: OptimCls = torch.optim.SGD``); () otherwise (a name also
    imported, defined, bound once -- s42's alias -- or rebound by a function's ``global``: those stay near misses)."""
    if name in module.aliases or name in module.functions or name in module.classes:
        return ()
    top = module.scopes[0]
    bound = top.assignments.get(name, [])
    # two bindings at least (one is s42's module-level alias, or a name a function's `global` rebinds: a near miss)
    if len(bound) < 2 or not all(isinstance(v, (ast.Name, ast.Attribute)) for _st, v in bound):
        return ()
    if any(isinstance(n, ast.Global) and name in n.names for n in ast.walk(module.tree)):
        return ()
    found = {(module.canonical(v) or "").removeprefix("torch.optim.").split(".")[-1] for _st, v in bound
             if (module.canonical(v) or "").startswith("torch.optim.")}
    return tuple(k for k in fusable if k in found)


_LIST_METHODS: dict[tuple[str, str], bool] = {}


def _returns_lists(fn: ast.AST) -> bool:
    """Every ``return`` of ``fn`` (one at least; no ``yield``, no nested def) gives a list display or a list
    comprehension: each call makes a fresh list (never a one-shot generator)."""
    rets = []
    for n in ast.walk(fn):
        if isinstance(n, (ast.Yield, ast.YieldFrom, ast.Lambda)) or (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n is not fn):
            return False
        if isinstance(n, ast.Return):
            rets.append(n)
    return bool(rets) and all(isinstance(r.value, (ast.List, ast.ListComp)) for r in rets)


def list_returning_method(module: Any, name: str) -> bool:
    """Does every definition of a method ``name`` in the repository (one at least, each a method of a module-level
    class; no module-level function of that name; at most 24) return only list displays / comprehensions
    (:func:`_returns_lists`)? FOB's ``GroupedModel.grouped_parameters``: ``return [pg.to_optimizer_dict(..) for pg in
    self.parameter_groups()]`` -- a list, whatever else it calls."""
    from npufuse.scan import repo_facts

    root = repo_facts.repo_root(module)
    if root is None or not name.isidentifier():
        return False
    repo_facts._depends(root, module.path)
    key = (str(root), name)
    if key not in _LIST_METHODS:
        defs: Optional[list[ast.AST]] = []
        needle = f"def {name}("
        for rel in repo_facts._repo_py_files(root):
            text = repo_facts._repo_text(root, rel)
            if text is None or needle not in text:
                continue
            tree = repo_facts._parse_repo_file(root, rel)
            found = [m for c in (tree.body if tree is not None else []) if isinstance(c, ast.ClassDef) for m in c.body
                     if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name == name]
            if tree is None or not found or any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body) \
                    or len(defs) + len(found) > 24:  # type: ignore[arg-type]
                defs = None
                break
            defs.extend(found)  # type: ignore[union-attr]
        if len(_LIST_METHODS) > 256:
            _LIST_METHODS.clear()
        _LIST_METHODS[key] = bool(defs) and all(_returns_lists(fn) for fn in defs or ())
    return _LIST_METHODS[key]


def list_method_receiver(module: Any, params: ast.expr) -> Optional[str]:
    """``M`` of params written ``M.<method>(..)`` (``M`` a plain name or attribute path other than ``self`` / ``cls``,
    the method's name saying params or groups) where every repository definition of the method returns a list
    (:func:`list_returning_method`): the guard reads a fresh ``M.parameters()`` generator (checked to be an
    ``nn.Module`` at run time) and never calls the method, which runs once, in the branch taken."""
    from npufuse.scan.dataflow import dotted

    if not (isinstance(params, ast.Call) and isinstance(params.func, ast.Attribute)):
        return None
    recv = dotted(params.func.value) or ""
    low = params.func.attr.lower()
    if not recv or recv.split(".")[0] in ("self", "cls") or ("param" not in low and "group" not in low) \
            or (module.canonical(params.func.value) or "").startswith(("torch", "itertools", "builtins")):
        return None
    return recv if list_returning_method(module, params.func.attr) else None


def module_test(recv: str) -> str:
    """``recv`` is an ``nn.Module`` at run time, without the name ``torch`` (a file may not bind it): its class's MRO
    holds torch's ``Module``."""
    return (f"any(_c.__name__ == 'Module' and _c.__module__ == 'torch.nn.modules.module' for _c in type({recv}).__mro__)")


# methods of a module whose result is the module itself or nothing (read from `self.<m>` only as a statement or the
# store of `self.<m>`), or a copy (state_dict: detached tensors, no Parameter whose .grad could be set)
_IN_PLACE_METHODS = ("to", "cuda", "cpu", "train", "eval", "float", "half", "double", "share_memory", "requires_grad_")
_READ_METHODS = ("state_dict", "load_state_dict", "save", "load", "zero_grad", "forward")
_PARAM_METHODS = ("parameters", "named_parameters")


def _fresh_construction(value: ast.AST, method_args: set[str]) -> bool:
    """``Net(..)`` / ``Net(..).to(device)``: a call of a class or function (not of a method of a parameter or of
    ``self``), possibly followed by in-place module methods returning the module."""
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _IN_PLACE_METHODS:
        value = value.func.value
    if not isinstance(value, ast.Call):
        return False
    from npufuse.scan.dataflow import dotted

    head = (dotted(value.func) or "").split(".")[0]
    return bool(head) and head not in method_args and head != "self"


def private_model(module: Any, cls: ast.ClassDef, attr: str, site_params: ast.AST) -> bool:
    """Does the object a class keeps in ``self.<attr>`` stay inside its instances? Every store of ``self.<attr>`` in the
    class is a fresh construction (:func:`_fresh_construction`); every read is a call of it (``self.<attr>(x)``), an
    in-place method as a statement, a reading method (``state_dict``, ``save``), or ``parameters()`` handed to the
    site's optimizer or to a torch function; the class hands out no bare ``self`` and uses no reflection; and no code
    of the file reads ``.<attr>`` of another object. Then no other class of the file holds that module or its
    parameters (s51b: an A3C worker writing `.grad` of the global network it is handed)."""
    from npufuse.scan.dataflow import dotted, fast_walk

    parents: dict[int, ast.AST] = {}
    for parent in ast.walk(cls):
        for child in ast.iter_child_nodes(parent):
            parents[id(child)] = parent
    for n in ast.walk(cls):
        if isinstance(n, ast.Name) and n.id in ("getattr", "setattr", "vars") or isinstance(n, ast.Attribute) and n.attr == "__dict__":
            return False
    for n in fast_walk(module.tree):
        if isinstance(n, ast.Attribute) and n.attr == attr and not (isinstance(n.value, ast.Name) and n.value.id == "self"):
            return False  # `agent.network` read from outside: the module may be handed anywhere
    if _read_elsewhere(module, attr):
        return False  # another file of the repository may hand `agent.network` to the class that writes grads
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
        for n in ast.walk(fn):
            if isinstance(n, ast.Name) and n.id == "self" and isinstance(n.ctx, ast.Load):
                up = parents.get(id(n))
                if not isinstance(up, ast.Attribute):
                    return False  # `register(self)` / `return self`: the instance (and its attribute) handed out
            if not (isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name) and n.value.id == "self"):
                continue
            up = parents.get(id(n))
            if isinstance(n.ctx, ast.Store):
                if not (isinstance(up, ast.Assign) and len(up.targets) == 1 and _fresh_construction(up.value, args)):
                    return False
                continue
            if not isinstance(n.ctx, ast.Load):
                return False
            if isinstance(up, ast.Call) and up.func is n:
                continue  # self.net(x)
            call = parents.get(id(up))
            if not (isinstance(up, ast.Attribute) and isinstance(call, ast.Call) and call.func is up):
                return False  # `self.net.encoder`, `f(self.net)`, `x = self.net`
            outer = parents.get(id(call))
            if up.attr in _IN_PLACE_METHODS:
                if not isinstance(outer, ast.Expr) and not (isinstance(outer, ast.Assign) and len(outer.targets) == 1
                                                            and dotted(outer.targets[0]) == f"self.{attr}"):
                    return False  # `m = self.net.to(dev)`: the module itself under another name
            elif up.attr in _PARAM_METHODS:
                if call is site_params:
                    continue
                if not (isinstance(outer, ast.Call) and (module.canonical(outer.func) or "").startswith("torch.")
                        and not (module.canonical(outer.func) or "").startswith("torch.optim")):
                    return False  # the parameters handed to code npufuse does not follow
            elif up.attr not in _READ_METHODS:
                return False
    return True


def _read_elsewhere(module: Any, attr: str) -> bool:
    """Does another Python file of the repository read ``.<attr>`` of an object other than ``self`` (the text
    ``<x>.<attr>`` with ``<x>`` not ``self``, comments and strings included)? True where such a file cannot be read."""
    from npufuse.scan import repo_facts

    root = repo_facts.repo_root(module)
    if root is None:
        return False  # a single file scanned alone: the file is all there is
    repo_facts._depends(root, module.path)
    # `<chain>.<attr>` whose chain is not exactly `self` (`agent.net`, `self.agent.net`), or a call's / subscript's result
    # (a call of it -- `agent.net(x)`: its forward -- or a reading method hands nothing out)
    rx = re.compile(r"(?:(?<![\w.])([A-Za-z_][\w.]*)|[\])])\." + re.escape(attr)
                    + r"\b(?!\s*\(|\s*\.\s*(?:" + "|".join(_READ_METHODS) + r")\s*\()")
    for rel in repo_facts._repo_py_files(root):
        if rel == module.path:
            continue
        text = repo_facts._repo_text(root, rel)
        if text is None:
            return True
        if f".{attr}" in text and any(m.group(1) != "self" for m in rx.finditer(text)):
            return True
    return False


def foreign_grad_write_lines(module: Any, scope: Any, call: ast.Call) -> set[int]:
    """Lines of ``X.grad = ..`` / ``X._grad = ..`` in methods of another class of the file (not the site's class, a base
    or a subclass of it), on objects that class's instance holds, where the site's optimizer is built over
    ``self.<m>.parameters()`` of a module the site's class keeps to itself (:func:`private_model`): those writes
    concern other parameters (an A3C worker's global network), not this optimizer's. Empty otherwise."""
    from npufuse.patterns import fused_optimizer as fo
    from npufuse.scan.dataflow import dotted, keyword

    params = keyword(call, "params", 0)
    if not (isinstance(params, ast.Call) and isinstance(params.func, ast.Attribute) and params.func.attr in _PARAM_METHODS
            and not params.args and not params.keywords):
        return set()
    parts = (dotted(params.func.value) or "").split(".")
    if len(parts) != 2 or parts[0] != "self":
        return set()
    units = fo._units(module)
    site_cls = units.units[units.unit_of(scope.qualname)].cls
    cls_node = module.classes.get(site_cls) if site_cls else None
    if cls_node is None:
        return set()
    family = fo._class_family(units, site_cls)
    lines: set[int] = set()
    for cls_name, methods in units.classes.items():
        if cls_name in family:
            continue
        for m in methods:
            u = units.units[m]
            fn = u.roots[0] if u.roots else None
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines |= {ln for ln, recv in units._unit_facts(m).grad_assigns if fo.held_by_instance(fn, recv)}
    if lines and not private_model(module, cls_node, parts[1], params):
        return set()
    return lines


def handed_table(scope: Any, lookup: ast.expr, fusable: tuple[str, ...]) -> Optional[tuple[tuple[str, ...], str]]:
    """(every fusable class, the table's text) for a lookup in a table of optimizer classes handed in from elsewhere:
    ``self.<optim..>[key]`` / ``.get(key)`` (an attribute the instance was given) or ``<optim..>[key]`` of a parameter
    of the function, its name saying "optim" (core-ml's ``opt_class = self.optimizers_dict[opt_name]``). Which classes
    it holds is not read here; the construction's guard tests the class the lookup yields at run time (a torch.optim
    class with a fused counterpart taking the arguments written), so any other entry runs the original call. None for
    any other lookup."""
    from npufuse.patterns import fused_optimizer as fo
    from npufuse.scan.dataflow import dotted

    parts = fo.table_lookup(lookup)
    if parts is None:
        return None
    text = dotted(parts[0]) or ""
    parts = text.split(".")
    if "optim" not in parts[-1].lower():
        return None
    if (len(parts) == 2 and parts[0] == "self" and "self" in scope.args) or (len(parts) == 1 and parts[0] in scope.args):
        return fusable, text
    return None
