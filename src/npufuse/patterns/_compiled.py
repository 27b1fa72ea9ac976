"""Code TorchScript compiles: no rewrite goes there (issue 14, class 7).

``@torch.jit.script`` compiles a function's body when the module is imported, and everything it
calls in the same module with it. The fused branch npufuse writes (the ``_npufuse_on_npu`` guard,
the optional ``torch_npu`` module, ``torch_npu.npu_*`` calls) does not compile: measured with
torch 2.13, the rewritten module fails at import with ``RuntimeError: undefined value
torch_npu``. So a finding inside compiled code becomes a near miss saying so, for every pattern
(:class:`npufuse.patterns.base.Pattern` applies :func:`compiled_reason` to whatever a detector
yields).

Compiled here means: a function decorated ``@torch.jit.script`` / ``@torch.jit.script_method``
(any alias of ``torch.jit``), one passed to ``torch.jit.script(f)`` in the module, the methods
of a class instantiated inside ``torch.jit.script(Cls(...))``, and the module's functions those
call (followed a few levels). ``@torch.jit.ignore`` / ``@torch.jit.unused`` functions stay Python.
"""

from __future__ import annotations

import ast
import re
from typing import TYPE_CHECKING

from npufuse.scan.dataflow import fast_walk

if TYPE_CHECKING:
    from npufuse.scan.dataflow import ModuleInfo, Scope

_SCRIPT = ("torch.jit.script", "torch.jit.script_method")
_PYTHON = ("torch.jit.ignore", "torch.jit.unused")
# Every way of naming torch.jit.script / script_method spells the word `script` (an attribute,
# the imported name or the import of an alias): without it in the text nothing is compiled.
# Identifiers are NFKC-normalised, so a file with non-ASCII text is searched (for the bare
# substring) in its NFKC form.
_SCRIPT_WORD = re.compile(r"\bscript(?:_method)?\b")


def may_compile(source: str) -> bool:
    """False when no code of ``source`` can be TorchScript-compiled (see ``_SCRIPT_WORD``)."""
    if "jit" not in source:
        return False
    if source.isascii():
        return _SCRIPT_WORD.search(source) is not None
    import unicodedata

    return "script" in unicodedata.normalize("NFKC", source)


def _decorator_names(module: "ModuleInfo", fn: ast.AST) -> list[str]:
    out = []
    for d in getattr(fn, "decorator_list", []):
        target = d.func if isinstance(d, ast.Call) else d
        name = module.canonical(target)
        if name:
            out.append(name)
    return out


def _compiled(module: "ModuleInfo") -> tuple[set[str], set[str]]:
    """(qualnames of compiled functions/methods, classes whose methods are all compiled), cached."""
    cached = module.__dict__.get("_npufuse_compiled")
    if cached is not None:
        return cached
    functions: set[str] = set()
    classes: set[str] = set()
    if may_compile(module.source):
        nodes = {s.qualname: s.node for s in module.scopes if s.qualname != "<module>"}
        for qual, fn in nodes.items():
            names = _decorator_names(module, fn)
            if any(n in _SCRIPT for n in names):
                functions.add(qual)
        for node in fast_walk(module.tree):  # ast.walk's nodes, cheaper
            if isinstance(node, ast.Call) and module.canonical(node.func) == "torch.jit.script" and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Name) and arg.id in module.functions:
                    functions.add(arg.id)
                elif isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name) and arg.func.id in module.classes:
                    classes.add(arg.func.id)
        # what compiled code calls in this module is compiled with it (a few levels)
        todo = list(functions)
        for _ in range(4):
            nxt = []
            for qual in todo:
                fn = nodes.get(qual)
                if fn is None:
                    continue
                for n in fast_walk(fn):
                    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in module.functions and n.func.id not in functions:
                        functions.add(n.func.id)
                        nxt.append(n.func.id)
            todo = nxt
        for qual, fn in nodes.items():
            if any(n in _PYTHON for n in _decorator_names(module, fn)):
                functions.discard(qual)
    cached = module.__dict__["_npufuse_compiled"] = (functions, classes)
    return cached


def compiled_reason(module: "ModuleInfo", scope: "Scope") -> str | None:
    """Why a rewrite in ``scope`` would not compile, or None (plain Python code)."""
    if scope.qualname == "<module>":
        return None
    functions, classes = _compiled(module)
    parts = scope.qualname.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in functions:
            where = ".".join(parts[:i])
            break
    else:
        if scope.class_name in classes and not any(n in _PYTHON for n in _decorator_names(module, scope.node)):
            where = f"{scope.class_name} (passed to torch.jit.script)"
        else:
            return None
    return (f"TorchScript compiles `{where}` at import: the fused branch (its _npufuse_on_npu guard and the optional "
            "torch_npu module) does not compile there, and the rewritten module would fail to import "
            "(undefined value torch_npu); rewrite by hand outside the scripted code")
