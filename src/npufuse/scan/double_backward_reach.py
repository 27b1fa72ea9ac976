"""Which files a double-backward call can reach (s44, helper ho21fix44).

:mod:`npufuse.scan.forward_ad` turns every site of a repository into a near miss when some file calls
``torch.autograd.functional.hvp`` / ``vhp`` / ``jvp`` / ``hessian`` (no run-time test tells when the
backward is differentiated again). That is right when the call can differentiate the model; it is wrong
for a tutorial script of the same repository that differentiates a toy function of its own (``def g(x):
return (x ** 3).sum()`` then ``hessian(g, x)`` at the top level of ``autograd/05_hessian.py``): that code
can only reach what its own file defines or imports.

The rule, per use in file U (a site in file S is reached when any answer below says so):

* S is U, or S is in U's static import closure through repository modules (followed transitively, a
  bounded number of files): the function differentiated there can call code of those files only.
* Every other file is reached as before (repository-wide) when the use sits inside a function of a file
  that other code can import (the caller may hand it any model), or when U or a file of its closure loads
  code by name at run time (``importlib``, ``__import__``, ``exec``, ``sys.path`` edits, a pickled model
  through ``torch.load`` / ``pickle.load``, a config ``instantiate``), or when an import of U names a
  module the resolver cannot place but the repository holds a file of that name, or when the closure is
  larger than the bound. Only a use at module level, or in a file no import statement can name (``05_x.py``),
  in a file whose imports are all resolved, is narrowed.

Read lazily: nothing runs unless the scan found a double-backward use. Never raises.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Callable, Iterable, Optional

from npufuse.scan import repo_symbols

MAX_CLOSURE = 96  # repository files followed from one using file; beyond it the use reaches everything
# names whose call loads code chosen at run time: the closure cannot tell what the use reaches
_DYNAMIC_NAMES = frozenset(("__import__", "exec", "eval", "import_module", "instantiate"))
_DYNAMIC_METHODS = frozenset(("import_module", "instantiate", "run_path", "run_module", "spec_from_file_location"))
# ``X.load(...)`` of these unpickles objects whose classes are imported then (a whole saved model)
_UNPICKLERS = frozenset(("torch", "pickle", "dill", "joblib", "cloudpickle", "hub"))
_DYNAMIC_MODULES = ("importlib", "runpy", "pickle", "dill", "hydra", "torch.hub")


class Reach:
    """For each using file: the set of repository files its use can reach, or None (every file)."""

    def __init__(self, root: Optional[Path], files: Iterable[str]) -> None:
        self.root = root
        self.files = [f for f in files if isinstance(f, str)]
        self._symbols: Optional[repo_symbols.RepoSymbols] = None
        self._on_disk: Optional[repo_symbols.RepoSymbols] = None
        self._memo: dict[tuple[str, int], Optional[frozenset[str]]] = {}

    def reaches(self, use_file: str, use_line: int, site_file: str) -> bool:
        """Can the double-backward call at ``use_file:use_line`` differentiate code of ``site_file``?"""
        if use_file == site_file:
            return True
        key = (use_file, use_line)
        if key not in self._memo:
            try:
                self._memo[key] = self._closure(use_file, use_line)
            except (Exception, RecursionError):  # an analysis aid: unsure means every file, as before
                self._memo[key] = None
        files = self._memo[key]
        return files is None or site_file in files

    # -- the closure ----------------------------------------------------------------------------------

    def _index(self) -> repo_symbols.RepoSymbols:
        if self._symbols is None:
            self._symbols = repo_symbols.RepoSymbols(self.root or Path("."), self.files)
        return self._symbols

    def _held_on_disk(self, dotted_name: str) -> bool:
        """Does the repository hold module ``dotted_name`` among all its files, also those the scan skips (tests,
        examples, gitignored files): such a module runs when imported although the scan did not list it."""
        if self._on_disk is None:
            from npufuse.scan import repo_facts

            self._on_disk = repo_symbols.RepoSymbols(self.root or Path("."), repo_facts._repo_py_files(self.root)
                                                     if self.root is not None else [])
        return self._on_disk.holds_module_named(dotted_name)

    def _closure(self, use_file: str, use_line: int) -> Optional[frozenset[str]]:
        if self.root is None:
            return None
        symbols = self._index()
        tree, _ = symbols.tree(use_file)
        if tree is None:
            return None
        if _inside_function(tree, use_line) and _importable(use_file):
            return None  # a caller elsewhere may hand the function any model
        seen: set[str] = {use_file}
        todo = [use_file]
        while todo:
            rel = todo.pop()
            t = tree if rel == use_file else symbols.tree(rel)[0]
            if t is None:
                # (s45 review) not read: over the size or parse limit, unreadable, or syntax newer than this Python;
                # it still runs when imported, and what it imports is unknown
                return None
            if _loads_by_name(t):
                return None
            for target in _imported_files(symbols, rel, t, self._held_on_disk):
                if target is None:
                    return None
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
                    if len(seen) > MAX_CLOSURE:
                        return None
        return frozenset(seen)


def _importable(rel: str) -> bool:
    """Can an import statement name the module of ``rel`` (``05_hessian.py`` cannot)?"""
    stem = os.path.basename(rel)[:-3] if rel.endswith(".py") else os.path.basename(rel)
    return stem.isidentifier()


def _inside_function(tree: ast.Module, line: int) -> bool:
    """Does line ``line`` sit inside a def (or a class body) rather than the module's own statements?"""
    for st in tree.body:
        end = getattr(st, "end_lineno", st.lineno) or st.lineno
        if st.lineno <= line <= end:
            return isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    return False


def _import_origins(tree: ast.Module) -> dict[str, str]:
    """``{local name: dotted origin}`` of the file's ``import a.b as c`` / ``from a import b as c`` statements."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _loads_by_name(tree: ast.Module) -> bool:
    """Does the file load code chosen at run time (or edit sys.path so imports resolve elsewhere)? Names are read
    through the file's import aliases (s45 review: ``import torch as th; th.load(..)`` and ``from torch import
    load`` unpickle a model as ``torch.load`` does)."""
    origins = _import_origins(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):
                origin = origins.get(f.id, f.id).split(".")
                if origin[-1] in _DYNAMIC_NAMES or (len(origin) > 1 and origin[-1] in ("load", "loads")
                                                    and origin[-2] in _UNPICKLERS):
                    return True
            if isinstance(f, ast.Attribute):
                if f.attr in _DYNAMIC_METHODS:
                    return True
                recv = f.value.attr if isinstance(f.value, ast.Attribute) else \
                    origins.get(f.value.id, f.value.id).rsplit(".", 1)[-1] if isinstance(f.value, ast.Name) else ""
                if f.attr in ("load", "loads") and recv in _UNPICKLERS:
                    return True
        elif isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
                and node.value.id == "sys":
            return True
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n == m or n.startswith(m + ".") for n in names for m in _DYNAMIC_MODULES):
                return True
    return False


def _imported_files(symbols: repo_symbols.RepoSymbols, rel: str, tree: ast.Module,
                    held_on_disk: Callable[[str], bool]) -> list[Optional[str]]:
    """The repository files ``rel``'s import statements (anywhere in the file) name; None for a name the
    resolver cannot place although the repository holds a module of that name (unsure)."""
    out: list[Optional[str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out += _module_files(symbols, a.name, rel, 0, held_on_disk)
        elif isinstance(node, ast.ImportFrom):
            mod, level = node.module or "", node.level or 0
            out += _module_files(symbols, mod, rel, level, held_on_disk)
            for a in node.names:  # ``from pkg import sub``: a submodule named like a symbol
                if a.name != "*":
                    sub = f"{mod}.{a.name}" if mod else a.name
                    key = symbols.module_key(sub, rel, level)
                    if key is not None and not key.endswith("/"):
                        out.append(key)
    return out


def _module_files(symbols: repo_symbols.RepoSymbols, dotted: str, rel: str, level: int,
                  held_on_disk: Callable[[str], bool]) -> list[Optional[str]]:
    """Files of module ``dotted`` and of the packages above it (their ``__init__`` runs on import)."""
    parts = dotted.split(".") if dotted else []
    out: list[Optional[str]] = []
    for i in range(1 if level == 0 else 0, len(parts) + 1):
        name = ".".join(parts[:i])
        key = symbols.module_key(name, rel, level)
        if key is None:
            if level > 0 and i == len(parts):
                out.append(None)  # (s45 review) a relative import of a file the scan did not list: unsure
            elif level == 0 and i == len(parts) and (symbols.holds_module_named(name) or held_on_disk(name)):
                out.append(None)  # the repository has such a module on a root the resolver did not take
            continue
        if not key.endswith("/"):
            out.append(key)
        else:
            init = key + "__init__.py"
            if init in symbols.files:
                out.append(init)
    return out
