"""Which class or function a name refers to, across the files of the scanned repository (issue 14).

Detectors see one file; the code a name stands for is often in another: ``from .norms import
RMSNorm``, ``import model.layers as L`` then ``L.SwiGLU``, a package ``__init__.py`` that
re-exports (``from .attention import *``), ``Norm = LlamaRMSNorm`` aliases. :class:`RepoSymbols`
answers, for a file of the repo and a (possibly dotted) name used in it, where the name is
defined and what its parsed definition is::

    from npufuse.scan import repo_symbols

    symbols = repo_symbols.shared(root, files, max_bytes)   # one index per scan (see below)
    sym = symbols.resolve("pkg/model.py", "RMSNorm")         # or "L.SwiGLU", "Block.forward"
    if sym.found:                  # kind "class" | "function" | "module" | "value"
        sym.file, sym.qualname     # "pkg/norms.py", "RMSNorm"
        sym.node                   # the ast.ClassDef / FunctionDef / value expression / ast.Module
        sym.conditional            # bound under if/try or more than once: a run-time choice
    elif sym.kind == "external":
        sym.target                 # "torch.nn.RMSNorm": defined outside the repository
    else:                          # "unresolved"
        sym.reason                 # why, in words (not found, does not parse, too large, ...)
    symbols.resolve_node("pkg/model.py", call.func)          # an ast.Name / ast.Attribute chain
    symbols.tree("pkg/norms.py")   # (ast.Module or None, reason): the cached parse of any file

Cost: constructing the index reads nothing. The module table (module names -> files; strings
only) is built on the first question; a file is read and parsed only when a question reaches it,
at most once per index, and at most ``max_parses`` files in all. Files that no detector asks
about cost nothing.

Which index: the scan's per-file analysis is cached per file (its digest), so facts from other
files must be applied after the analysis, in the parent, as :mod:`npufuse.scan.repo_facts` does.
Such a pass gets the one index of the scan with :func:`shared` (same root and file list: same
object; :func:`forget` drops it when the scan ends, so a later scan re-reads changed files).

Module names: the repository root, the importing file's own folder when it is not a package (a
script's ``sys.path[0]``) and any folder holding a top-level package (a ``src/`` layout) are import
roots; among several files that could be ``import a.b``, a module or regular package beats a
namespace folder, then the one sharing the longest folder prefix with the importing file wins. Relative imports follow the importing file's package. A name bound more than once in a module
resolves to its last binding in the repository (``try: from apex import X / except ImportError:
from .x import X`` gives ``.x``'s X, flagged ``conditional``).

Hostile repositories: a file whose real path leaves the root (a symlinked folder) is never read;
files over ``max_bytes`` are not parsed; a parse failure, a cycle of re-exports or a chain deeper
than ``MAX_HOPS`` is an "unresolved" answer with its reason. Never raises for anything a repository
holds.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

MAX_HOPS = 24  # imports/aliases followed for one question
DEFAULT_MAX_PARSES = 256  # files parsed per index
DEFAULT_MAX_BYTES = 4 << 20


@dataclass(frozen=True)
class Symbol:
    """The answer to one question. ``found``: kind is class, function, module or value."""

    kind: str  # class | function | module | value | external | unresolved
    file: str = ""  # repository-relative file of the definition (a package folder ends in "/")
    qualname: str = ""  # the name in that file ("RMSNorm", "Block.forward"); "" for a module
    node: Optional[ast.AST] = None  # ClassDef / FunctionDef / the assigned expression / ast.Module
    target: str = ""  # external: the dotted name outside the repository ("torch.nn.RMSNorm")
    reason: str = ""  # unresolved: why
    conditional: bool = False  # some hop was bound under if/try, or more than once
    via: tuple[str, ...] = ()  # the hops followed, "file:line"

    @property
    def found(self) -> bool:
        return self.kind in ("class", "function", "module", "value")


@dataclass(frozen=True)
class _Binding:
    kind: str  # def | value | module | from | star
    line: int
    node: Optional[ast.AST] = None  # def: the ClassDef/FunctionDef; value: the expression
    module: str = ""  # module / from / star: the dotted module ("" for ``from . import x``)
    level: int = 0  # relative import level
    name: str = ""  # from: the imported name; module: the bound prefix ("a" for ``import a.b``)
    nested: bool = False  # under an if / try / with at module level


class _Module:
    """One parsed file's module-level bindings (names -> bindings in source order)."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.bindings: dict[str, list[_Binding]] = {}
        self.stars: list[_Binding] = []
        self.all: Optional[set[str]] = None
        self._collect(tree.body, nested=False)

    def _add(self, name: str, b: _Binding) -> None:
        self.bindings.setdefault(name, []).append(b)

    def _collect(self, body: Sequence[ast.stmt], nested: bool) -> None:
        for st in body:
            if isinstance(st, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                self._add(st.name, _Binding("def", st.lineno, st, nested=nested))
            elif isinstance(st, ast.Import):
                for a in st.names:
                    if a.asname:
                        self._add(a.asname, _Binding("module", st.lineno, module=a.name, name=a.name, nested=nested))
                    else:
                        top = a.name.split(".")[0]
                        self._add(top, _Binding("module", st.lineno, module=a.name, name=top, nested=nested))
            elif isinstance(st, ast.ImportFrom):
                for a in st.names:
                    if a.name == "*":
                        self.stars.append(_Binding("star", st.lineno, module=st.module or "", level=st.level or 0, nested=nested))
                    else:
                        self._add(a.asname or a.name, _Binding("from", st.lineno, module=st.module or "", level=st.level or 0,
                                                              name=a.name, nested=nested))
            elif isinstance(st, (ast.Assign, ast.AnnAssign)) and st.value is not None:
                targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        if t.id == "__all__" and isinstance(st.value, (ast.List, ast.Tuple)):
                            self.all = {e.value for e in st.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                        self._add(t.id, _Binding("value", st.lineno, st.value, nested=nested))
            elif isinstance(st, ast.If):
                self._collect(st.body, True)
                self._collect(st.orelse, True)
            elif isinstance(st, ast.Try) or type(st).__name__ == "TryStar":
                self._collect(st.body, True)  # type: ignore[attr-defined]
                for h in st.handlers:  # type: ignore[attr-defined]
                    self._collect(h.body, True)
                self._collect(st.orelse, True)  # type: ignore[attr-defined]
                self._collect(st.finalbody, True)  # type: ignore[attr-defined]
            elif isinstance(st, (ast.With, ast.AsyncWith)):
                self._collect(st.body, True)


_Answer = Union[Symbol, "_ModuleRef"]


@dataclass(frozen=True)
class _ModuleRef:
    """A module of the repository: a file, or a package folder without ``__init__.py`` ("x/")."""

    key: str
    conditional: bool
    via: tuple[str, ...]
    dotted: str = ""  # the absolute module name it was imported as ("" for a relative import)


class RepoSymbols:
    """The repository's symbol index: lazy, cached, bounded (see the module docstring)."""

    def __init__(self, root: Union[str, os.PathLike[str]], files: Iterable[str], max_bytes: int = DEFAULT_MAX_BYTES,
                 max_parses: int = DEFAULT_MAX_PARSES) -> None:
        self.root = Path(root)
        self.files = [f for f in files if isinstance(f, str) and f.endswith(".py")]
        self.max_bytes = max_bytes
        self.max_parses = max_parses
        self.parsed = 0  # files read and parsed so far (a figure for benchmarks and tests)
        self._real_root: Optional[str] = None
        self._modules: dict[str, tuple[Optional[_Module], str]] = {}
        self._table: Optional[dict[str, list[str]]] = None
        self._fileset: Optional[set[str]] = None
        self._packages: Optional[set[str]] = None  # folders holding an __init__.py
        self._dirs: set[str] = set()  # every folder holding a scanned file

    # --- files -------------------------------------------------------------------------------

    def tree(self, rel: str) -> tuple[Optional[ast.Module], str]:
        """The parsed file (cached) or None and the reason it is not available."""
        mod, why = self._module(rel)
        return (mod.tree if mod is not None else None), why

    def _module(self, rel: str) -> tuple[Optional[_Module], str]:
        if rel in self._modules:
            return self._modules[rel]
        self._modules[rel] = out = self._load(rel)
        return out

    def _load(self, rel: str) -> tuple[Optional[_Module], str]:
        if rel not in self._files():
            return None, f"{rel} is not one of the scanned files"
        if self.parsed >= self.max_parses:
            return None, f"{rel} not read: {self.max_parses} files parsed for cross-file names already (the limit)"
        try:
            if self._real_root is None:
                self._real_root = os.path.realpath(self.root)
            real = os.path.realpath(self.root / rel)
            if os.path.commonpath([self._real_root, real]) != self._real_root:
                return None, f"{rel} leads outside the repository (a symlink): not read"
            with open(real, "rb") as fh:
                data = fh.read(self.max_bytes + 1)
        except (OSError, ValueError) as exc:
            return None, f"{rel} cannot be read ({getattr(exc, 'strerror', None) or exc})"
        if len(data) > self.max_bytes:
            return None, f"{rel} is larger than {self.max_bytes} bytes: not parsed"
        self.parsed += 1
        try:
            return _Module(ast.parse(data, filename=rel)), ""
        except SyntaxError as exc:
            return None, f"{rel} does not parse (line {exc.lineno}: {exc.msg})"
        except (ValueError, RecursionError, MemoryError) as exc:
            return None, f"{rel} does not parse ({type(exc).__name__})"

    def _files(self) -> set[str]:
        if self._fileset is None:
            self._fileset = set(self.files)
        return self._fileset

    # --- modules -----------------------------------------------------------------------------

    def _module_table(self) -> dict[str, list[str]]:
        """Every dotted suffix of every file's and folder's module name -> keys (file, or "dir/")."""
        if self._table is None:
            table: dict[str, list[str]] = {}
            dirs: set[str] = set()
            self._packages = set()
            for rel in sorted(self.files):
                parts = rel[:-3].split("/")
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                    self._packages.add("/".join(parts))
                for i in range(len(parts)):
                    table.setdefault(".".join(parts[i:]), []).append(rel)
                folders = rel.split("/")[:-1]
                for j in range(1, len(folders) + 1):
                    dirs.add("/".join(folders[:j]))
            self._dirs = dirs
            for d in sorted(dirs - self._packages):  # namespace packages
                parts = d.split("/")
                for i in range(len(parts)):
                    table.setdefault(".".join(parts[i:]), []).append(d + "/")
            self._table = table
        return self._table

    def _root_ok(self, key: str, dotted_name: str, importer: str) -> bool:
        """Is the folder above ``key``'s match of ``dotted_name`` an import root for ``importer``?"""
        path = key[:-1] if key.endswith("/") else key[:-3]
        if path.endswith("/__init__"):
            path = path[: -len("/__init__")]
        depth = dotted_name.count(".") + 1
        parts = path.split("/")
        base = "/".join(parts[: len(parts) - depth])
        assert self._packages is not None
        if base == "":
            return True  # the repository root
        if base == importer.rpartition("/")[0] and base not in self._packages:
            return True  # a script's own folder (sys.path[0]); a package's modules import absolutely
        # a source root (src/ layout): the top of the match is a package and its folder is not one
        top = "/".join(parts[: len(parts) - depth + 1])
        return top in self._packages and base not in self._packages

    def module_key(self, dotted_name: str, importer: str = "", level: int = 0) -> Optional[str]:
        """The repository file (or "pkg/" folder) of module ``dotted_name`` imported from
        ``importer`` (``level``: the dots of a relative import); None: not in the repository."""
        table = self._module_table()
        if level:
            base = importer.split("/")[:-1]
            if level - 1 > len(base):
                return None
            base = base[: len(base) - (level - 1)]
            path = "/".join(base + (dotted_name.split(".") if dotted_name else []))
            for key in (_join(path, "__init__.py"),) if not dotted_name else (path + ".py", path + "/__init__.py"):
                if key in self._files():
                    return key
            return path + "/" if path == "" or path in self._dirs else None
        keys = [k for k in table.get(dotted_name, []) if self._root_ok(k, dotted_name, importer)]
        if not keys:
            return None
        here = importer.split("/")[:-1]

        def shared_prefix(k: str) -> int:
            n = 0
            for a, b in zip(k.split("/"), here):
                if a != b:
                    break
                n += 1
            return n

        # a module or regular package on any import root beats a namespace package (Python's rule)
        return sorted(keys, key=lambda k: (k.endswith("/"), -shared_prefix(k), k.count("/"), k))[0]

    def holds_module_named(self, dotted_name: str) -> bool:
        """Does some file or folder of the repository end in module path ``dotted_name`` (on any root)?"""
        return bool(self._module_table().get(dotted_name))

    # --- names -------------------------------------------------------------------------------

    def resolve(self, from_file: str, name: str, scope: Optional[ast.AST] = None) -> Symbol:
        """What ``name`` (``X``, ``mod.X``, ``Cls.method``) means in ``from_file``. ``scope``: a
        function whose own imports come first (``def f(): from .x import X``)."""
        try:
            parts = [p for p in name.split(".")]
            if not parts or not all(p.isidentifier() for p in parts):
                return Symbol("unresolved", reason=f"{name!r} is not a dotted name")
            ans = self._name_in_file(from_file, parts[0], (), set(), False, scope)
            for i, part in enumerate(parts[1:], 1):
                if isinstance(ans, Symbol) and not ans.found:
                    if ans.kind == "external":
                        return Symbol("external", target=ans.target + "." + ".".join(parts[i:]), conditional=ans.conditional, via=ans.via)
                    return ans
                ans = self._attribute(ans, part, set())
            return self._finish(ans)
        except RecursionError:
            return Symbol("unresolved", reason=f"{name}: the chain of imports is too deep")

    def resolve_node(self, from_file: str, node: ast.AST, scope: Optional[ast.AST] = None) -> Symbol:
        """:meth:`resolve` for an ``ast.Name`` or a chain of ``ast.Attribute`` on one."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return Symbol("unresolved", reason="not a name or a dotted name")
        parts.append(node.id)
        return self.resolve(from_file, ".".join(reversed(parts)), scope)

    def _finish(self, ans: _Answer) -> Symbol:
        if isinstance(ans, Symbol):
            return ans
        mod = self._module(ans.key)[0] if not ans.key.endswith("/") else None
        return Symbol("module", file=ans.key, node=mod.tree if mod is not None else None, conditional=ans.conditional, via=ans.via)

    def _name_in_file(self, rel: str, name: str, via: tuple[str, ...], seen: set[tuple[str, str]], cond: bool,
                      scope: Optional[ast.AST] = None) -> _Answer:
        if len(via) > MAX_HOPS:
            return Symbol("unresolved", reason=f"{name}: more than {MAX_HOPS} imports followed", via=via)
        if (rel, name) in seen:
            return Symbol("unresolved", reason=f"{name}: the imports form a cycle ({rel})", via=via)
        seen = seen | {(rel, name)}
        bindings: list[_Binding] = []
        if scope is not None:
            local = _Module(ast.Module(body=[s for s in getattr(scope, "body", []) if isinstance(s, (ast.Import, ast.ImportFrom))],
                                       type_ignores=[]))
            bindings = local.bindings.get(name, [])
        mod = None
        if not bindings:
            mod, why = self._module(rel)
            if mod is None:
                return Symbol("unresolved", reason=why, via=via)
            bindings = mod.bindings.get(name, [])
        cond = cond or len(bindings) > 1 or any(b.nested for b in bindings)
        last: Optional[_Answer] = None
        for b in reversed(bindings):  # the last binding in the repository wins
            ans = self._binding(rel, name, b, via + (f"{rel}:{b.line}",), seen, cond)
            if isinstance(ans, _ModuleRef) or ans.kind in ("class", "function", "module", "value"):
                return ans
            last = last or ans
        if last is not None:
            return last
        if mod is not None:
            for st in mod.stars:
                key = self._import_key(rel, st.module, st.level)
                if key is None or key.endswith("/"):
                    continue
                inner = self._module(key)[0]
                if inner is not None and inner.all is not None and name not in inner.all:
                    continue
                ans = self._name_in_file(key, name, via + (f"{rel}:{st.line}",), seen, cond or st.nested)
                if isinstance(ans, _ModuleRef) or ans.found:
                    return ans
            if rel.endswith("__init__.py"):  # a submodule of this package
                key = self.module_key(name, rel, level=1)
                if key is not None:
                    return _ModuleRef(key, cond, via)
        return Symbol("unresolved", reason=f"`{name}` is not defined or imported at module level in {rel}", via=via)

    def _import_key(self, rel: str, module: str, level: int) -> Optional[str]:
        return self.module_key(module, rel, level) if level else self.module_key(module, rel)

    def _binding(self, rel: str, name: str, b: _Binding, via: tuple[str, ...], seen: set[tuple[str, str]], cond: bool) -> _Answer:
        if b.kind == "def":
            node = b.node
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            return Symbol(kind, file=rel, qualname=name, node=node, conditional=cond, via=via)
        if b.kind == "value":
            value = b.node
            if isinstance(value, (ast.Name, ast.Attribute)):  # an alias: Norm = LlamaRMSNorm
                parts: list[str] = []
                v: ast.AST = value
                while isinstance(v, ast.Attribute):
                    parts.append(v.attr)
                    v = v.value
                if isinstance(v, ast.Name) and v.id != name:
                    ans = self._name_in_file(rel, v.id, via, seen, cond)
                    for part in reversed(parts):
                        if isinstance(ans, Symbol) and not ans.found:
                            if ans.kind == "external":
                                return Symbol("external", target=ans.target + "." + part, conditional=cond, via=via)
                            return ans
                        ans = self._attribute(ans, part, seen)
                    return ans
            return Symbol("value", file=rel, qualname=name, node=value, conditional=cond, via=via)
        if b.kind == "module":
            bound = b.module if b.name == b.module else b.name  # `import a.b as c` binds a.b; `import a.b` binds a
            key = self._import_key(rel, bound, 0)
            if key is None:
                return Symbol("external", target=bound, conditional=cond, via=via)
            return _ModuleRef(key, cond, via, bound)
        # from M import X
        key = self._import_key(rel, b.module, b.level)
        if key is None:
            if b.level:
                return Symbol("unresolved", reason=f"{rel}:{b.line}: the relative module {'.' * b.level}{b.module} is not in the repository",
                              via=via)
            return Symbol("external", target=f"{b.module}.{b.name}", conditional=cond, via=via)
        return self._attribute(_ModuleRef(key, cond, via, "" if b.level else b.module), b.name, seen)

    def _attribute(self, ans: _Answer, attr: str, seen: set[tuple[str, str]]) -> _Answer:
        """``attr`` of a module (its binding, else its submodule) or of a class (a def in its body)."""
        if isinstance(ans, _ModuleRef):
            if not ans.key.endswith("/"):
                got = self._name_in_file(ans.key, attr, ans.via, seen, ans.conditional)
                if isinstance(got, _ModuleRef) or got.found or got.kind == "external":
                    return got
                if not ans.key.endswith("__init__.py"):
                    return got
            folder = ans.key[:-1] if ans.key.endswith("/") else ans.key.rpartition("/")[0]
            sub = _join(folder, attr)
            dotted_sub = f"{ans.dotted}.{attr}" if ans.dotted else ""
            for key in (sub + ".py", sub + "/__init__.py"):
                if key in self._files():
                    return _ModuleRef(key, ans.conditional, ans.via, dotted_sub)
            self._module_table()
            if sub in self._dirs:
                return _ModuleRef(sub + "/", ans.conditional, ans.via, dotted_sub)
            if ans.key.endswith("/") and ans.dotted:
                # a folder without __init__.py is a namespace package only where no installed package
                # of that name exists (any regular package wins): `from transformers import AutoModel`
                # beside a repo folder transformers/ is the installed library's
                return Symbol("external", target=f"{ans.dotted}.{attr}", conditional=ans.conditional, via=ans.via)
            return Symbol("unresolved", reason=f"`{attr}` is not defined in {ans.key}", via=ans.via)
        if ans.kind == "class" and isinstance(ans.node, ast.ClassDef):
            for st in reversed(ans.node.body):
                if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and st.name == attr:
                    kind = "class" if isinstance(st, ast.ClassDef) else "function"
                    return Symbol(kind, file=ans.file, qualname=f"{ans.qualname}.{attr}", node=st, conditional=ans.conditional, via=ans.via)
                if isinstance(st, (ast.Assign, ast.AnnAssign)) and st.value is not None:
                    targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                    if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                        return Symbol("value", file=ans.file, qualname=f"{ans.qualname}.{attr}", node=st.value,
                                      conditional=ans.conditional, via=ans.via)
            return Symbol("unresolved", reason=f"`{attr}` is not defined in the body of class {ans.qualname} ({ans.file}); "
                                               "an inherited or instance attribute is not followed", via=ans.via)
        if ans.kind == "external":
            return Symbol("external", target=f"{ans.target}.{attr}", conditional=ans.conditional, via=ans.via)
        return Symbol("unresolved", reason=f"`{attr}` of a {ans.kind} is not followed", via=ans.via)


def _join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


# --- the one index of a scan -----------------------------------------------------------------

_SHARED: Optional[tuple[tuple[str, tuple[str, ...], int], RepoSymbols]] = None


def shared(root: Union[str, os.PathLike[str]], files: Iterable[str], max_bytes: int = DEFAULT_MAX_BYTES) -> RepoSymbols:
    """The scan's index: the same object for the same root, file list and size limit, until
    :func:`forget` (the engine calls it when a scan ends)."""
    global _SHARED
    files = tuple(files)
    key = (os.fspath(root), files, max_bytes)
    if _SHARED is None or _SHARED[0] != key:
        _SHARED = (key, RepoSymbols(root, files, max_bytes))
    return _SHARED[1]


def forget() -> None:
    """Drop the shared index (its parsed files): the next scan reads the repository afresh."""
    global _SHARED
    _SHARED = None
