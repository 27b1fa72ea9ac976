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
import textwrap
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
# s50: the word first and its left boundary after it (``(?<!\wscript)``: the character before is no word
# character, what a leading ``\b`` asks before a word character): a pattern that starts with a literal is searched
# for that literal; a leading ``\b`` made ``re`` try the whole matcher at every position of the file
_SCRIPT_WORD = re.compile(r"script(?<!\wscript)(?:_method)?\b")


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
        classes |= _scripted_bases(module, classes)
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


# --- lifting a site out of a @torch.jit.script function (issue 14, class 7) -------------------
#
# A scripted function is compiled when its module is imported, so a fused branch inside it can
# never compile, and could never run either (the function always runs compiled). What does
# compile: the module-level definition rewritten as
#
#     if torch_npu is not None:  # npufuse: <pattern>
#         @torch.jit.script                       # the original, verbatim, under another name
#         def _npufuse_scripted_f(q, k, ...):
#             <original body>
#
#         def f(q, k, ...):                       # plain Python: the name callers import
#             if not (<the site's guard>):
#                 return _npufuse_scripted_f(q, k, ...)
#             <original body with the site replaced by the fused statements>
#     else:
#         <the original decorated definition, verbatim>
#
# Without torch_npu nothing changes; with it, the scripted copy still compiles (the same code)
# and the Python wrapper dispatches to it off the NPU or with the switch off. The site's guard
# (device test, per-candidate and pattern switch) is only known when the site is rendered, so
# the fused text carries LIFTED_GUARD where it goes; the rewriter substitutes it and writes
# LIFTED_TEST as the module-level test (npufuse.rewrite.transform).

LIFTED_GUARD = "_npufuse_lifted_guard_"
LIFTED_TEST = "torch_npu is not None"
_SCRIPTED_PREFIX = "_npufuse_scripted_"


def _script_decorated(module: "ModuleInfo", fn: ast.AST) -> bool:
    return any(n in _SCRIPT for n in _decorator_names(module, fn))


def lift_refusal(module: "ModuleInfo", qualname: str) -> str | None:
    """Why the scripted function ``qualname`` cannot be rewritten as a module-level wrapper
    (see above), or None when it can. Cached per module."""
    cache = module.__dict__.setdefault("_npufuse_lift_refusal", {})
    if qualname in cache:
        return cache[qualname]
    cache[qualname] = why = _lift_refusal(module, qualname)
    return why


def _lift_refusal(module: "ModuleInfo", qualname: str) -> str | None:
    fn = next((n for n in module.tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == qualname), None)
    if fn is None or not isinstance(fn, ast.FunctionDef):
        return "it is not a function defined at the top of its module"
    if len(fn.decorator_list) != 1 or not _script_decorated(module, fn):
        return "it is not a function whose only decorator is @torch.jit.script"
    if fn.args.vararg is not None or fn.args.kwarg is not None:
        return "it takes *args/**kwargs"
    functions, classes = _compiled(module)
    # scripted code that calls it would compile the Python wrapper in its place
    for node in module.tree.body:
        if node is fn:
            continue
        for n in fast_walk(node):
            if isinstance(n, ast.Name) and n.id == qualname:
                owner = _owner_compiled(module, node, n, functions, classes)
                if owner is not None:
                    return f"compiled code (`{owner}`) calls it: that code would compile the Python wrapper"
    # it is bound once: a second definition or assignment of the name would be overwritten
    if sum(1 for n in module.tree.body if getattr(n, "name", None) == qualname) != 1:
        return "the module defines the name twice"
    return None


def _owner_compiled(module: "ModuleInfo", top: ast.AST, ref: ast.AST, functions: set[str], classes: set[str]) -> str | None:
    """The compiled definition (function, or class passed to torch.jit.script) holding ``ref``, if any."""
    if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return top.name if top.name in functions else None
    if isinstance(top, ast.ClassDef):
        if top.name in classes:
            return top.name
        for item in top.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and f"{top.name}.{item.name}" in functions:
                if any(n is ref for n in fast_walk(item)):
                    return f"{top.name}.{item.name}"
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _script_decorated(module, item):
                if any(n is ref for n in fast_walk(item)):
                    return f"{top.name}.{item.name}"
    return None


def _indent_of(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def lifted_text(module: "ModuleInfo", qualname: str, sites: list[tuple[int, int, str]], guard_tensor: str) -> str | None:
    """The fused branch of the module-level rewrite of scripted ``qualname`` (see above), with
    each ``(line, end_line, fused)`` of ``sites`` in place of its statements; None where it
    cannot be written (the guard tensor is not a parameter that reaches the sites unchanged,
    or fused code holds a string over several lines, which re-indenting would change)."""
    fn = module.functions.get(qualname)
    if not isinstance(fn, ast.FunctionDef) or not fn.body:
        return None
    a = fn.args
    params = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    try:
        guard_names = {n.id for n in fast_walk(ast.parse(guard_tensor, mode="eval"))if isinstance(n, ast.Name)}
    except SyntaxError:
        return None
    if not guard_names or not guard_names <= set(params):
        return None
    # the wrapper checks the guard tensor once, at entry: it must be the value the first site reads, so
    # no statement before that site may rebind it (rebinding inside or after the sites is theirs to do)
    first_site = min((line for line, _e, _f in sites), default=0)
    stored = {t.id for n in fast_walk(fn) for t in ([n] if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) else [])
              if t.lineno < first_site}
    if guard_names & stored:
        return None
    if any('"""' in f or "'''" in f for _a, _b, f in sites):
        return None
    lines = module.lines
    dec_start = min(d.lineno for d in fn.decorator_list)
    body0 = fn.body[0]
    # the header (signature, and the docstring if any) ends before the first other statement
    first_code = 1 if (isinstance(body0, ast.Expr) and isinstance(body0.value, ast.Constant) and isinstance(body0.value.value, str) and len(fn.body) > 1) else 0
    header_end = fn.body[first_code].lineno - 1  # last header line (1-based)
    def_line = lines[fn.lineno - 1]
    renamed = def_line.replace(f"def {qualname}", f"def {_SCRIPTED_PREFIX}{qualname}", 1)
    if renamed == def_line:
        return None
    scripted = "".join(lines[dec_start - 1 : fn.lineno - 1]) + renamed + "".join(lines[fn.lineno : fn.end_lineno])
    body_indent = _indent_of(lines[fn.body[first_code].lineno - 1])
    forward = ", ".join([*(x.arg for x in (*a.posonlyargs, *a.args)), *(f"{x.arg}={x.arg}" for x in a.kwonlyargs)])
    wrapper = "".join(lines[fn.lineno - 1 : header_end])
    wrapper += f"{body_indent}if not ({LIFTED_GUARD}):  # off the NPU or switched off: the scripted original\n"
    wrapper += f"{body_indent}    return {_SCRIPTED_PREFIX}{qualname}({forward})\n"
    at = header_end + 1
    for line, end_line, fused in sorted(sites):
        if line < at or end_line > (fn.end_lineno or 0):
            return None
        wrapper += "".join(lines[at - 1 : line - 1])
        indent = _indent_of(lines[line - 1])
        wrapper += "".join(indent + row if row.strip() else row for row in textwrap.dedent(fused).strip("\n").splitlines(keepends=True)) + "\n"
        at = end_line + 1
    wrapper += "".join(lines[at - 1 : fn.end_lineno])
    text = scripted.rstrip("\n") + "\n\n\n" + wrapper
    try:
        ast.parse(text)
    except SyntaxError:
        return None
    return text


# --- glu harvest (s25): methods a scripted class inherits ------------------------------------


def _scripted_bases(module: "ModuleInfo", classes: set[str]) -> set[str]:
    """The in-module base classes of classes passed to ``torch.jit.script(Cls())``: TorchScript
    compiles the methods the instance has, inherited ones included (bigscience's ``GEGLU(
    _GLUBaseModule)`` whose ``forward`` is the base's), so a rewrite in the base's method breaks
    the import just the same."""
    out: set[str] = set()
    todo = list(classes)
    for _ in range(8):
        nxt = []
        for name in todo:
            cls = module.classes.get(name)
            for b in cls.bases if cls is not None else ():
                if isinstance(b, ast.Name) and b.id in module.classes and b.id not in classes and b.id not in out:
                    out.add(b.id)
                    nxt.append(b.id)
        todo = nxt
    return out
