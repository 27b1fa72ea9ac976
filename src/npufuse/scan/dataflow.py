"""The parsed view of one module that every detector shares.

A file is parsed once (``ast``); :class:`ModuleInfo` indexes it (imports and their aliases,
module-level helper functions, classes, ``ACT2FN``-style tables) and :class:`Scope` is one
function body (or the module body) with its local assignments, so a detector can follow a value
through ``x = ...`` chains and into small helpers defined in the same module (``rotate_half``,
``repeat_kv``). Detection is by what code computes, never by class or model names.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

from npufuse.scan import _classes_s48r

# Canonical names for the aliases real code uses.
_CANONICAL_MODULES = {
    "torch": "torch",
    "torch.nn": "torch.nn",
    "torch.nn.functional": "torch.nn.functional",
    "torch.optim": "torch.optim",
}

# Calls/methods that only change dtype (or nothing numerically): stripped by ``strip_casts``.
CAST_METHODS = {"to", "float", "half", "bfloat16", "double", "type", "type_as", "contiguous"}


def dotted(node: ast.AST | None) -> str | None:
    """``a.b.c`` for Name/Attribute chains, else None. ``self.weight`` -> "self.weight"."""
    if type(node) is ast.Name:  # most callees and bases are one name
        return node.id
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


# Module imports respelled in the tree the way detectors match them (issue 14: one canonical layer instead of
# each detector checking ``torch.`` / ``th.`` itself). ``F`` and ``nn`` are left as they are (every detector
# reads them); other aliases of those modules become the dotted path, which needs no binding but ``torch``.
_CANONICAL_SPELLING = {"torch": "torch", "torch.nn.functional": "torch.nn.functional", "torch.nn": "torch.nn"}
_USUAL_ALIAS = {"torch.nn.functional": "F", "torch.nn": "nn"}


def canonicalise_module_aliases(tree: ast.Module) -> dict[str, str]:
    """Respell, in ``tree``, the names a module-level ``import torch as th`` (``import torch.nn.functional as
    fn``, ``import torch.nn as tnn``) binds, as ``torch`` (``torch.nn.functional``, ``torch.nn``), so
    ``th.cat(..)`` reads as ``torch.cat(..)`` to every detector. Only read positions (``Load``) change, each
    node keeping its position, so the quoted source still says ``th`` (which the module binds) and code a
    detector prints from the tree says ``torch`` (which the rewrite's prelude imports where the module does
    not). Done only where it cannot change a meaning: the alias is bound by that import alone, and ``torch``
    by nothing but ``import torch``. Returns {alias: dotted name} of what it respelled; a tree already
    canonical is left alone."""
    wanted: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in _CANONICAL_SPELLING and a.asname and a.asname not in (a.name, _USUAL_ALIAS.get(a.name)):
                    wanted[a.asname] = a.name
    if not wanted:
        return {}
    bound: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.setdefault(node.id, []).append("store")
        elif isinstance(node, ast.arg):
            bound.setdefault(node.arg, []).append("arg")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.setdefault(node.name, []).append("def")
        elif isinstance(node, ast.Import):
            for a in node.names:
                bound.setdefault(a.asname or a.name.split(".")[0], []).append(f"import {a.name if a.asname else a.name.split('.')[0]}")
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                bound.setdefault(a.asname or a.name, []).append(f"from {node.module}")
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for n in node.names:
                bound.setdefault(n, []).append("global")
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.setdefault(node.name, []).append("except")
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound.setdefault(node.name, []).append("match")
    if any(b != "import torch" for b in bound.get("torch", [])):
        return {}  # ``torch`` means something else somewhere in this module
    mapping = {alias: module for alias, module in wanted.items() if bound.get(alias) == [f"import {module}"]}
    if not mapping:
        return {}

    class Respell(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            if not isinstance(node.ctx, ast.Load) or node.id not in mapping:
                return node
            parts = mapping[node.id].split(".")
            new: ast.expr = ast.Name(parts[0], ast.Load())
            for attr in parts[1:]:
                new = ast.Attribute(new, attr, ast.Load())
            for n in ast.walk(new):
                ast.copy_location(n, node)
            return new

    try:
        Respell().visit(tree)
    except RecursionError:
        pass  # code nested too deep to walk recursively: each respelling made so far is complete on its own
    return mapping


# ``torch.f(x, ...)`` that is exactly ``x.f(...)``: every such function requires a tensor first argument (a
# Python number there raises), so the method spelling computes the same. Not in the list: functions that take
# a number first (``pow``, ``add``, ``mul``, ``sub``, ``div``, ``where``), have no method (``cat``, ``stack``,
# ``einsum``), whose one-argument form means something else (``repeat_interleave(repeats)``), and those some
# detector matches and quotes in its function spelling (``split`` for MoE token groups; ``exp`` / ``sqrt`` /
# ``rsqrt`` in a quoted attention scale; ``sigmoid`` / ``bmm`` / ``baddbmm``, respelled the other way below).
_TENSOR_FIRST_FUNCTIONS = frozenset((
    "unsqueeze", "squeeze", "transpose", "reshape", "flatten", "unflatten", "chunk", "permute", "narrow", "roll", "neg",
    "negative", "unbind", "movedim", "swapaxes", "flip", "index_select", "gather", "masked_fill", "softmax", "log_softmax",
    "square", "cumsum", "tile", "triu", "tril", "clone", "detach", "argsort", "topk", "amax", "amin", "sum", "mean", "var",
))




def canonicalise_tensor_functions(tree: ast.Module, source: str | None = None) -> int:
    """Respell, in ``tree``, ``torch.unsqueeze(x, 1)`` as ``x.unsqueeze(1)`` and ``y.sigmoid()`` as
    ``torch.sigmoid(y)`` (the spellings detectors match). Each call node is changed in place (its func and
    arguments), so it keeps its position and the quoted source is unchanged; ``torch.matmul`` and ``@`` are
    both read by the detectors and left as written. Only calls of ``torch`` itself (after
    :func:`canonicalise_module_aliases`), with positional tensor first argument and no ``out=`` / ``input=`` /
    ``**``; only where ``torch`` is bound by nothing but ``import torch``. ``source``: the tree's text, a
    cheap gate (no such call in the text: nothing to walk; else only the statements on the lines of such
    text are walked). Returns how many calls it respelled."""
    global WALK_MEMO
    # s50: the walk below is of a tree this function then changes: no walk of it is kept (a detector respells a copy
    # of fused code mid-detection, _guard_arms_s46audit; from_source suspends the memo around all its respellings)
    memo, WALK_MEMO = WALK_MEMO, None
    try:
        return _respell_tensor_functions(tree, source)
    finally:
        WALK_MEMO = memo


def _respell_tensor_functions(tree: ast.Module, source: str | None) -> int:
    calls = None
    if source is not None:
        hits, binds = tensor_call_lines(source)
        if not hits:
            return 0
        # (line numbers are newline counts unless a lone carriage return ends a line)
        if not binds and ("\r" not in source or "\r" not in source.replace("\r\n", "")):
            calls = _tensor_calls_on_lines(tree, hits)
    if calls is None:
        calls = _tensor_calls_everywhere(tree)
        if calls is None:
            return 0
    count = 0
    for node in calls:  # each call changed in place: nested calls stay the same objects in their parents
        f = node.func
        if type(f) is not ast.Attribute:
            continue
        if type(f.value) is ast.Name and f.value.id == "torch":
            if not node.args or isinstance(node.args[0], (ast.Starred, ast.Constant, ast.List, ast.Tuple)) \
                    or f.attr not in _TENSOR_FIRST_FUNCTIONS or any(k.arg in (None, "out", "input") for k in node.keywords):
                continue
            method = ast.copy_location(ast.Attribute(node.args[0], f.attr, ast.Load()), node)
            node.func, node.args = method, node.args[1:]
            count += 1
            continue
        want = _TENSOR_METHODS_AS_FUNCTIONS.get(f.attr)
        if want is None or len(node.args) != want or node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            continue
        root = f.value
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        if isinstance(root, ast.Name) and (root.id in ("self", "cls", "torch", "F", "nn", "math", "np", "numpy") or root.id[:1].isupper()):
            continue  # a module's own method, or a library's function: not a tensor method
        fn = ast.copy_location(ast.Attribute(ast.copy_location(ast.Name("torch", ast.Load()), node), f.attr, ast.Load()), node)
        node.func, node.args = fn, [f.value, *node.args]
        count += 1
    return count


# ``Tensor.f(`` / ``Tensor . f (``: the text of an unbound tensor method called as a function
_UNBOUND_METHOD_CALL = re.compile(r"Tensor\s*\.\s*[A-Za-z]\w*\s*\(")


def canonicalise_unbound_tensor_methods(tree: ast.Module, source: str) -> int:
    """Respell, in ``tree``, ``Tensor.f(x, ...)`` (``from torch import Tensor``) and ``torch.Tensor.f(x, ...)``
    as ``x.f(...)``: an unbound method called on its receiver is that method call, and files that never
    ``import torch`` (``from torch import Tensor, nn``) write ``Tensor.rsqrt(v)`` where others write
    ``torch.rsqrt(v)``. Each call node changes in place (the quoted source is unchanged). Only where the module
    binds ``Tensor`` by ``from torch import Tensor`` (or ``torch`` by ``import torch``) at its top level, with a
    positional first argument and no ``**``; dunder methods are left alone. Text-gated: a file without
    ``Tensor.<name>(`` is not walked. Returns how many calls it respelled."""
    at = source.find("Tensor")
    offsets: list[int] = []
    while at >= 0:
        if _UNBOUND_METHOD_CALL.match(source, at) and not (at and _is_word(source[at - 1])):
            offsets.append(at)
        at = source.find("Tensor", at + 6)
    if not offsets:
        return 0
    names: set[str] = set()
    torch_bound = False
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0:
            names.update(a.asname or a.name for a in node.names if a.name == "Tensor")
        elif isinstance(node, ast.Import):
            torch_bound = torch_bound or any(a.name.split(".")[0] == "torch" and a.asname is None for a in node.names)
    if not names and not torch_bound:
        return 0
    count = 0
    for call in _tensor_calls_on_lines(tree, lines_of_offsets(source, offsets)):
        f = call.func
        if type(f) is not ast.Attribute or f.attr.startswith("__") or not call.args or type(call.args[0]) is ast.Starred \
                or any(k.arg is None for k in call.keywords):
            continue
        owner = f.value
        if not (type(owner) is ast.Name and owner.id in names
                or torch_bound and type(owner) is ast.Attribute and owner.attr == "Tensor"
                and type(owner.value) is ast.Name and owner.value.id == "torch"):
            continue
        call.func = ast.copy_location(ast.Attribute(call.args[0], f.attr, ast.Load()), f)
        call.args = call.args[1:]
        count += 1
    return count


# after a ``torch`` that is a name: ``torch`` where a statement could bind it (``torch = ..``, ``torch, x = ..``,
# ``def f(torch)``, ``lambda torch:``, ``for torch in``, ``def torch(``, ``del torch``): followed by ``=`` (not ``==``),
# ``:``, ``,``, a bracket, ``;``, ``in`` or the line's end. Prose in comments and docstrings mostly is not (``a torch
# tensor``, ``torch's``). An import line (a doctest's too) binds it as the module
_BINDS_TORCH_AFTER = re.compile(r"[ \t]*(?:(?!==)[=:,)\](;]|in\b|\\?\r?$)", re.MULTILINE)
_IMPORT_LINE = re.compile(r"[ \t]*(?:(?:>>>|\.\.\.)[ \t]*)?(?:import|from)[ \t]")
# after a ``torch`` that is a name: ``.f(`` of a function the respelling changes
_TENSOR_FUNCTION_AFTER = re.compile(r"\s*\.\s*(?:" + "|".join(sorted(_TENSOR_FIRST_FUNCTIONS)) + r")\s*\(")


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def tensor_call_lines(source: str) -> tuple[list[int], bool]:
    """The line numbers (ascending, each once) of the text of a call the respelling may change (``torch.f(`` of a
    function in ``_TENSOR_FIRST_FUNCTIONS``, ``.sigmoid(`` / ``.bmm(`` / ``.baddbmm(``; spaces and line breaks
    allowed around the dot and before the parenthesis), and whether the text may bind ``torch``
    other than by an import (``_BINDS_TORCH_AFTER``). Found with ``str.find``: a regex starting with ``\\b``
    or ``\\.`` tries every position of the file (both regexes cost a third of an ``ast.parse``)."""
    spots: list[int] = []
    binds = False
    find = source.find
    pos = find("torch")
    while pos >= 0:
        end = pos + 5
        if not (pos and _is_word(source[pos - 1])) and not (end < len(source) and _is_word(source[end])):
            if _TENSOR_FUNCTION_AFTER.match(source, end):
                spots.append(pos)
            elif not binds and _BINDS_TORCH_AFTER.match(source, end) \
                    and not _IMPORT_LINE.match(source, source.rfind("\n", 0, pos) + 1, pos):
                binds = True
        pos = find("torch", end)
    for word in ("sigmoid", "bmm"):
        pos = find(word)
        while pos >= 0:
            end = pos + len(word)
            start = pos - 4 if word == "bmm" and source.startswith("badd", pos - 4) else pos
            before = start - 1
            while before >= 0 and source[before] in " \t\r\n\\":
                before -= 1
            if before >= 0 and source[before] == "." and not (end < len(source) and _is_word(source[end])):
                after = end
                while after < len(source) and source[after] in " \t\r\n\\":
                    after += 1
                if after < len(source) and source[after] == "(":
                    spots.append(start)
            pos = find(word, end)
    spots.sort()
    return lines_of_offsets(source, spots), binds


def lines_of_offsets(source: str, offsets: list[int]) -> list[int]:
    """The line numbers (1-based, each once, ascending) of ascending character offsets of ``source``."""
    lines: list[int] = []
    line, at = 1, 0
    for p in offsets:
        line += source.count("\n", at, p)
        at = p
        if not lines or lines[-1] != line:
            lines.append(line)
    return lines


def _tensor_calls_everywhere(tree: ast.Module) -> list[ast.Call] | None:
    """Every call of ``tree`` (one whole-tree walk), or None where ``torch`` is bound by something
    other than an import (a name, an argument, a def): then no call of it is respelled."""
    calls: list[ast.Call] = []
    for node in fast_walk(tree):
        t = type(node)
        if t is ast.Call:
            calls.append(node)  # type: ignore[arg-type]
        elif t is ast.Name:
            if node.id == "torch" and type(node.ctx) is not ast.Load:  # type: ignore[attr-defined]
                return None
        elif t is ast.arg:
            if node.arg == "torch":  # type: ignore[attr-defined]
                return None
        elif t is ast.FunctionDef or t is ast.AsyncFunctionDef or t is ast.ClassDef:
            if node.name == "torch":  # type: ignore[attr-defined]
                return None
    return calls


def _tensor_calls_on_lines(tree: ast.Module, hits: list[int]) -> list[ast.Call]:
    """The calls of the statements spanning one of the lines ``hits`` (ascending), found by walking the
    statements and, of those, only the expressions of the ones spanning such a line: a whole-tree walk was
    a third of an ``ast.parse``, and most statements hold no call the respelling changes. The statements
    are ``_statements_bfs``'s, less those inside a statement spanning no such line (theirs lie within its
    lines: skipped, they were still visited one by one), in the same order."""
    calls: list[ast.Call] = []
    todo: list[ast.AST] = [tree]
    fields = _BLOCK_FIELDS
    for stmt in todo:  # a queue: the list grows while it is read
        t = type(stmt)
        lo = getattr(stmt, "lineno", None)
        if lo is not None:  # (a match case has no position: its pattern and guard are walked)
            k = bisect_left(hits, lo)
            if k == len(hits) or hits[k] > (getattr(stmt, "end_lineno", None) or lo):
                continue
        blocks = fields.get(t)
        if blocks is None:
            blocks = fields[t] = tuple(n for n in _BLOCK_NAMES if n in t._fields)
        for name in blocks:
            block = getattr(stmt, name, None)
            if type(block) is list:
                todo.extend(block)
        if t is ast.Module:
            continue
        names = _EXPRESSION_FIELDS.get(t)
        if names is None:
            names = _EXPRESSION_FIELDS[t] = tuple(f for f in child_fields(t) if f not in _BLOCK_NAMES)
        for name in names:
            v = getattr(stmt, name, None)
            for root in (v if type(v) is list else (v,)):
                if isinstance(root, ast.AST):
                    for n in fast_walk(root):
                        if type(n) is ast.Call:
                            calls.append(n)  # type: ignore[arg-type]
    return calls


# statement type -> its fields that hold expressions, not statement blocks
_EXPRESSION_FIELDS: dict[type, tuple[str, ...]] = {}

# tensor methods some detectors match only as ``torch.f(x, ..)`` (the gate's ``torch.sigmoid``, attention's
# ``torch.bmm``): method name -> its positional argument count; the receiver is the function's first argument
_TENSOR_METHODS_AS_FUNCTIONS = {"sigmoid": 0, "bmm": 1, "baddbmm": 2}


def source_of(module: "ModuleInfo", node: ast.AST) -> str:
    """The exact source text of ``node`` (what the report and templates quote)."""
    return ast.get_source_segment(module.source, node) or ast.unparse(node)


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


def _inner_bound_loads(nodes: dict[type, list[ast.AST]], own: ast.AST) -> set[int]:
    """ids of the ``Name`` reads that name a variable of an inner scope, not the scope's own: a
    comprehension's target (``[e(x) for e in experts]`` after ``for e in experts:`` reads no ``e`` of
    the loop: Python 3 comprehensions have their own scope), or a parameter of a nested lambda / def.
    A comprehension's first iterable and a function's defaults are evaluated outside: not shadowed."""
    out: set[int] = set()
    Load = ast.Load
    for kind in _COMPREHENSIONS:
        for comp in nodes.get(kind, ()):
            bound = {n.id for g in comp.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}  # type: ignore[attr-defined]
            if not bound:
                continue
            outside = {id(n) for n in ast.walk(comp.generators[0].iter)}  # type: ignore[attr-defined]
            for n in ast.walk(comp):
                if type(n) is ast.Name and type(n.ctx) is Load and n.id in bound and id(n) not in outside:
                    out.add(id(n))
    for kind in (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef):
        for fn in nodes.get(kind, ()):
            if fn is own:
                continue  # the scope's own parameters are its variables
            a = fn.args  # type: ignore[attr-defined]
            params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None}
            if not params:
                continue
            body = fn.body if isinstance(fn.body, list) else [fn.body]  # type: ignore[attr-defined]
            for stmt in body:
                for n in ast.walk(stmt):
                    if type(n) is ast.Name and type(n.ctx) is Load and n.id in params:
                        out.add(id(n))
    return out


@dataclass
class Scope:
    """One function body (or the module body) and its local assignments, in order."""

    qualname: str
    node: ast.AST  # FunctionDef / AsyncFunctionDef / Module
    class_name: str | None = None
    body: list[ast.stmt] = field(default_factory=list)

    @property
    def assignments(self) -> dict[str, list[tuple[ast.stmt, ast.expr]]]:
        """name -> [(statement, value)] in source order; tuple targets record the whole value
        with an index. Worked out on first use: most scopes of a file never get that far (every
        detector's text gate turns them away), and indexing all of them was most of the cost of
        :meth:`ModuleInfo.from_source`."""
        cached = self.__dict__.get("_assignments")
        if cached is None:
            cached = self.__dict__["_assignments"] = _assignments_of(self.listing()[0])
        return cached

    @assignments.setter
    def assignments(self, value: dict[str, list[tuple[ast.stmt, ast.expr]]]) -> None:
        self.__dict__["_assignments"] = value

    @property
    def args(self) -> list[str]:
        if isinstance(self.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = self.node.args
            return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
        return []

    def definition(self, name: str, before_line: int | None = None) -> ast.expr | None:
        """The value last assigned to ``name`` before ``before_line`` (None if a parameter/unknown)."""
        best = None
        for stmt, value in self.assignments.get(name, []):
            if before_line is None or stmt.lineno < before_line:
                best = value
        return best

    def resolve(self, node: ast.expr, before_line: int | None = None, depth: int = 8) -> ast.expr:
        """Follow a bare Name through single local assignments (``h = x.float()`` -> ``x.float()``)."""
        while depth and isinstance(node, ast.Name):
            value = self.definition(node.id, before_line if before_line is not None else getattr(node, "lineno", None))
            if value is None:
                break
            before_line = getattr(value, "lineno", before_line)
            node = value
            depth -= 1
        return node

    def uses_after(self, name: str, line: int) -> bool:
        """Is the value ``name`` holds at the end of ``line`` read later in this scope? (the live-out
        check of every near miss "... is used after ..."). A read on a later line counts unless a
        rebinding made after ``line`` always runs between (see :meth:`loads_after`)."""
        if self.last_loads().get(name, 0) <= line:
            return False  # the cheap gate: no read on a later line at all
        return bool(self.loads_after(name, line))

    def loads_after(self, name: str, line: int) -> list[ast.Name]:
        """The reads of ``name`` on lines after ``line`` that can see the value it holds there: by
        reaching definition, a read after a rebinding is not a use of the old value. A read is left
        out when an assignment to ``name`` that starts after ``line`` stands earlier in a block that
        holds the read (``x = ...`` then ``use(x)`` in the same body: every path from ``line`` into
        that block runs the assignment first; a later attention reusing the name ``attn_weights`` in
        an ``if`` arm). Reads inside a nested function or lambda always count (they run when called)."""
        loads = [n for n in self.name_loads().get(name, ()) if n.lineno > line]
        if not loads:
            return loads
        shadowed = self._shadowed_loads()
        if shadowed:
            loads = [n for n in loads if id(n) not in shadowed]  # a comprehension's / lambda's own variable
        kills = [k for k in self._rebinding_regions().get(name, ()) if k[0] > line]
        if not kills:
            return loads
        deferred = self._deferred_regions()
        out = []
        for n in loads:
            at = (n.lineno, n.col_offset)
            if any(lo <= at <= hi for _s, lo, hi in kills) and not any(lo <= at <= hi for lo, hi in deferred):
                continue
            out.append(n)
        return out

    def _rebinding_regions(self) -> dict[str, list[tuple[int, tuple[int, int], tuple[int, int]]]]:
        """name -> (line of the assignment, start, end of the statements after it in its block) for
        every plain assignment (``=``, annotated with a value) that binds ``name`` itself, a tuple /
        list / starred element included: whatever those statements read of ``name`` comes from that
        assignment or a later one. Not ``x += ...``: it reads the old value itself (no Load node says
        so) and, on a tensor, changes that very object in place. Computed once per scope."""
        cached = self.__dict__.get("_rebinding_regions_cache")
        if cached is not None:
            return cached
        cached = {}
        for block, i, stmt in self.listing()[0]:
            if isinstance(stmt, (ast.For, ast.AsyncFor)) and stmt.body:
                # a loop's target is bound before each run of its body: reads in the body see that binding
                loop_bound: set[str] = set()
                _plain_bound(stmt.target, loop_bound)
                first, last = stmt.body[0], stmt.body[-1]
                region = (stmt.lineno, (first.lineno, first.col_offset), (last.end_lineno or last.lineno, last.end_col_offset or 0))
                for name in loop_bound:
                    cached.setdefault(name, []).append(region)
                continue
            if i + 1 >= len(block) or not isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                continue
            if isinstance(stmt, ast.AnnAssign) and stmt.value is None:
                continue
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            bound: set[str] = set()
            for t in targets:
                _plain_bound(t, bound)
            if not bound:
                continue
            first, last = block[i + 1], block[-1]
            region = (stmt.lineno, (first.lineno, first.col_offset), (last.end_lineno or last.lineno, last.end_col_offset or 0))
            for name in bound:
                cached.setdefault(name, []).append(region)
        self.__dict__["_rebinding_regions_cache"] = cached
        return cached

    def _deferred_regions(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """The text spans of the nested functions and lambdas of the scope: code run when called."""
        cached = self.__dict__.get("_deferred_regions_cache")
        if cached is None:
            nodes = self.nodes()
            cached = [((n.lineno, n.col_offset), (n.end_lineno or n.lineno, n.end_col_offset or 0))  # type: ignore[attr-defined]
                      for kind in (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef) for n in nodes.get(kind, ()) if n is not self.node]
            self.__dict__["_deferred_regions_cache"] = cached
        return cached

    def nodes(self) -> dict[type, list[ast.AST]]:
        """Every node of ``ast.walk(self.node)`` (nested functions and the header included),
        grouped by exact type, each list in walk order: one walk per scope, shared by the
        questions asked about the whole scope (names read after a line, calls anywhere)."""
        cached = self.__dict__.get("_nodes")
        if cached is None:
            cached = {}
            for n in fast_walk(self.node):
                group = cached.get(type(n))
                if group is None:
                    cached[type(n)] = [n]
                else:
                    group.append(n)
            self.__dict__["_nodes"] = cached
        return cached

    def name_loads(self) -> dict[str, list[ast.Name]]:
        """name -> its reads (``Name`` nodes in Load context) anywhere in the scope, in walk order."""
        cached = self.__dict__.get("_name_loads")
        if cached is None:
            cached = {}
            Load = ast.Load
            for n in self.nodes().get(ast.Name, ()):
                if type(n.ctx) is Load:  # type: ignore[attr-defined]
                    cached.setdefault(n.id, []).append(n)  # type: ignore[attr-defined]
            self.__dict__["_name_loads"] = cached
        return cached

    def last_loads(self) -> dict[str, int]:
        """name -> the last line on which it is read (a ``Name`` in Load context) anywhere in
        ``ast.walk(self.node)``: for every "is it read after line N" question (``uses_after``,
        live-out sets)."""
        cached = self.__dict__.get("_last_loads")
        if cached is None:
            shadowed = self._shadowed_loads()
            cached = {}
            for name, loads in self.name_loads().items():
                lines = [n.lineno for n in loads if id(n) not in shadowed] if shadowed else [n.lineno for n in loads]
                if lines:
                    cached[name] = max(lines)
            self.__dict__["_last_loads"] = cached
        return cached

    def _shadowed_loads(self) -> set[int]:
        """:func:`_inner_bound_loads` of the scope, computed once."""
        cached = self.__dict__.get("_shadowed")
        if cached is None:
            cached = self.__dict__["_shadowed"] = _inner_bound_loads(self.nodes(), self.node)
        return cached

    def statements(self) -> Iterator[tuple[list[ast.stmt], int, ast.stmt]]:
        """Every statement with the block (list) holding it and its index — spans must stay in one block.
        Listed once per scope (every detector asks for them; the tree is never modified)."""
        return iter(self.listing()[0])

    # -- s40 (dataflow40): reaching definitions across if / else arms ----------------------------
    def reaching_definitions(self, name: str, stmt: ast.stmt) -> tuple[list[ast.stmt], bool]:
        """The statements of the scope whose binding of ``name`` may be the value ``stmt`` reads
        (read where ``stmt`` starts), and whether that list is complete: False where, on some path,
        the value comes from before the scope (a parameter, a global) or from a statement read
        conservatively. Structured: the statements before ``stmt`` in its block, backwards; an
        ``if`` contributes the definitions reaching the end of each arm (an arm ending in
        ``return`` / ``raise`` / ``continue`` / ``break`` contributes none) and stops the search
        only where every arm binds the name; a loop or ``try`` contributes every binding inside it
        and never stops it; then the blocks around ``stmt``. ``if use_kernel: y = kernel(x) else:
        y = norm(x)`` then ``return y + r``: both assignments reach the return."""
        where = self._positions().get(id(stmt))
        if where is None:
            return [], False
        block, i, owner = where
        defs, definite = _reach_before(block, i, name)
        while not definite and owner is not None:
            if not isinstance(owner, (ast.If, ast.With, ast.AsyncWith)):
                # a loop repeats its body (a later binding reaches an earlier read), a handler or
                # ``finally`` runs after any part of the ``try`` body
                defs += [s for s in _all_bindings(owner, name) if s not in defs]
            outer = self._positions().get(id(owner))
            if outer is None:
                break
            block, i, owner = outer
            more, definite = _reach_before(block, i, name)
            defs += [s for s in more if s not in defs]
        return defs, definite

    def arm_exits(self) -> list["ArmExit"]:
        """Every arm of an ``if`` (its body, its ``else``) whose last statement binds a name whose
        value at the arm's end is read after the ``if`` (by :meth:`reaching_definitions`): the end
        of the arm is a read of that value, where a detector can take a computation written in the
        arm (``if use_kernel: y = kernel(x) else: y = <hand-written norm>``, then ``return y + r``)
        and replace it inside the arm alone, the other arm untouched. Computed once per scope."""
        cached = self.__dict__.get("_arm_exits")
        if cached is not None:
            return cached
        cached = []
        listing = self.listing()[0]
        for _block, _i, stmt in listing:
            if type(stmt) is not ast.If or not stmt.orelse:
                continue  # without ``else`` the value after the ``if`` may be the one from before it
            end = stmt.end_lineno or stmt.lineno
            for arm in (stmt.body, stmt.orelse):
                if not arm or isinstance(arm[-1], _EXITS) or (arm is stmt.orelse and len(arm) == 1 and type(arm[0]) is ast.If):
                    continue  # an arm that leaves; an ``elif`` (its own arms are listed with it)
                last = arm[-1]
                for name in sorted(_bound_at_end(last)):
                    reader = self._first_reader_after(name, end, last)
                    if reader is None:
                        continue
                    defs, _complete = self.reaching_definitions(name, reader)
                    cached.append(ArmExit(stmt, arm, name, last, reader, [d for d in defs if not _inside(d, arm)]))
        self.__dict__["_arm_exits"] = cached
        return cached

    def _first_reader_after(self, name: str, line: int, last: ast.stmt) -> ast.stmt | None:
        """The first statement after ``line`` (in the scope's statement order) that reads ``name``
        in its own expressions (not those of statements nested in it) and that ``last``'s binding
        reaches; None where there is none."""
        if self.last_loads().get(name, 0) <= line:
            return None
        for _block, _i, s in self.listing()[0]:
            if s.lineno <= line or isinstance(s, _DEFS):
                continue
            if not any(type(n) is ast.Name and n.id == name and type(n.ctx) is ast.Load for n in _own_expressions(s)):
                continue
            defs, _complete = self.reaching_definitions(name, s)
            if any(d is last or _inside(d, [last]) for d in defs):
                return s
        return None

    def _positions(self) -> dict[int, tuple[list[ast.stmt], int, ast.stmt | None]]:
        """id(statement) -> (its block, its index there, the compound statement holding the block)."""
        cached = self.__dict__.get("_positions_cache")
        if cached is None:
            listing, owners = self.listing()
            cached = {id(s): (b, i, o) for (b, i, s), o in zip(listing, owners)}
            self.__dict__["_positions_cache"] = cached
        return cached

    def listing(self) -> tuple[list[tuple[list[ast.stmt], int, ast.stmt]], list[ast.stmt | None]]:
        """What :meth:`statements` yields, as a list, and each statement's enclosing compound
        statement (None at the top of the scope); computed once per scope."""
        cached = self.__dict__.get("_listing")
        if cached is None:
            cached = self.__dict__["_listing"] = _block_list(self.body)
        return cached


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)

# statements after which the rest of their block does not run
_EXITS = (ast.Return, ast.Raise, ast.Continue, ast.Break)


@dataclass
class ArmExit:
    """The end of one arm of an ``if``, read as a use of ``name`` (see :meth:`Scope.arm_exits`)."""

    if_stmt: ast.If
    arm: list[ast.stmt]  # the arm's block (``if_stmt.body`` or ``if_stmt.orelse``)
    name: str
    last: ast.stmt  # the arm's last statement, which binds ``name``
    reader: ast.stmt  # the first statement after the ``if`` that reads the value
    others: list[ast.stmt]  # the other bindings reaching ``reader`` (the other arm's, those before the ``if``)


def _binding_here(stmt: ast.stmt, name: str) -> bool:
    """Does the simple statement ``stmt`` bind ``name`` (as a whole name, tuple elements included)?"""
    if isinstance(stmt, ast.Assign):
        out: set[str] = set()
        for t in stmt.targets:
            _plain_bound(t, out)
        return name in out
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return isinstance(stmt.target, ast.Name) and stmt.target.id == name and (stmt.value is not None or isinstance(stmt, ast.AugAssign))
    if isinstance(stmt, _DEFS):
        return stmt.name == name
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) == name for a in stmt.names)
    return False


def _all_bindings(stmt: ast.stmt, name: str) -> list[ast.stmt]:
    """Every statement in ``stmt`` (itself included, nested definitions not entered) that binds
    ``name``, a loop binding it as its target and a walrus counted as binding where they stand."""
    out: list[ast.stmt] = []
    for _b, _i, s in _block_list([stmt])[0]:
        if _binding_here(s, name) or name in _header_bound(s):
            out.append(s)
    return out


def _header_bound(stmt: ast.stmt) -> set[str]:
    """Names a statement binds other than by an assignment: a loop's target, ``with ... as``,
    an ``except ... as`` handler (read on the statement), a walrus in its own expressions."""
    out: set[str] = set()
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        _plain_bound(stmt.target, out)
    elif isinstance(stmt, (ast.With, ast.AsyncWith)):
        for item in stmt.items:
            if item.optional_vars is not None:
                _plain_bound(item.optional_vars, out)
    elif isinstance(stmt, ast.Try):
        out.update(h.name for h in stmt.handlers if h.name)
    for n in _own_expressions(stmt):
        if type(n) is ast.NamedExpr and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    return out


def _own_expressions(stmt: ast.stmt) -> Iterator[ast.AST]:
    """The expression nodes of ``stmt`` itself (a compound statement's header), not those of the
    statements nested in it nor of nested lambdas' bodies kept apart (a lambda's nodes are included:
    a read there is a read)."""
    if isinstance(stmt, _DEFS):
        return
    for f in child_fields(type(stmt)):
        if f in _BLOCK_NAMES:
            continue
        v = getattr(stmt, f, None)
        for root in (v if type(v) is list else (v,)):
            if isinstance(root, ast.AST) and not isinstance(root, ast.stmt):
                yield from fast_walk(root)


def _reach_before(block: list[ast.stmt], i: int, name: str) -> tuple[list[ast.stmt], bool]:
    """The bindings of ``name`` reaching the start of ``block[i]`` from the statements before it in
    ``block``, and whether one of them always runs last (the search need not go further out)."""
    defs: list[ast.stmt] = []
    for s in reversed(block[:i]):
        got, definite = _reach_through(s, name)
        defs += [d for d in got if d not in defs]
        if definite:
            return defs, True
    return defs, False


def _reach_end(block: list[ast.stmt], name: str) -> tuple[list[ast.stmt], bool]:
    """:func:`_reach_before` at the end of ``block``; a block that always leaves (its last statement
    a ``return`` / ``raise`` / ``continue`` / ``break``) passes nothing on, definitely."""
    if block and isinstance(block[-1], _EXITS):
        return [], True
    return _reach_before(block, len(block), name)


def _reach_through(s: ast.stmt, name: str) -> tuple[list[ast.stmt], bool]:
    """The bindings of ``name`` in ``s`` that may still hold after it, and whether ``s`` always binds it."""
    if _binding_here(s, name):
        return [s], True
    if isinstance(s, ast.If):
        body, b_def = _reach_end(s.body, name)
        other, o_def = _reach_end(s.orelse, name) if s.orelse else ([], False)
        return body + [d for d in other if d not in body], b_def and o_def
    if isinstance(s, (ast.With, ast.AsyncWith)):
        if name in _header_bound(s):
            inner, definite = _reach_end(s.body, name)
            return (inner or [s]), True
        return _reach_end(s.body, name)
    if isinstance(s, ast.stmt) and not isinstance(s, _DEFS):
        bound = _all_bindings(s, name)
        if bound:
            return bound, False  # a loop, ``try`` or ``match``: may or may not run them, maybe again
        if name in _header_bound(s):
            return [s], False
    return [], False


def _bound_at_end(stmt: ast.stmt) -> set[str]:
    """Names ``stmt`` may bind where it ends: a simple assignment's names, or those bound inside
    a compound statement (``if self.weight is not None: y = y * self.weight``)."""
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        out: set[str] = set()
        for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]):
            _plain_bound(t, out)
        return out
    if isinstance(stmt, (ast.If, ast.With, ast.AsyncWith)):
        out = set()
        for _b, _i, s in _block_list([stmt])[0][1:]:
            if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (s.targets if isinstance(s, ast.Assign) else [s.target]):
                    _plain_bound(t, out)
        return out
    return set()


def _inside(stmt: ast.stmt, block: list[ast.stmt]) -> bool:
    """Is ``stmt`` one of ``block``'s statements or nested in one?"""
    lo, hi = block[0].lineno, block[-1].end_lineno or block[-1].lineno
    return lo <= stmt.lineno <= hi


def _plain_bound(target: ast.AST, out: set[str]) -> None:
    """The names an assignment target binds as a whole (``x``, ``a, (b, *c)``), not through an
    attribute or a subscript (``x[i] = ...`` changes ``x``'s value without rebinding it)."""
    if isinstance(target, ast.Name):
        out.add(target.id)
    elif isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            _plain_bound(elt, out)
    elif isinstance(target, ast.Starred):
        _plain_bound(target.value, out)


# statement type -> which of body/orelse/finalbody/handlers/cases it has (empty: a simple statement)
_COMPOUND: dict[type, tuple[str, ...]] = {}


def _block_list(block: list[ast.stmt]) -> tuple[list[tuple[list[ast.stmt], int, ast.stmt]], list[ast.stmt | None]]:
    """(block, index, statement) for every statement of ``block`` and its nested blocks, in
    source order (a statement, then its body, orelse, finalbody, handlers, cases); nested
    definitions are listed but not entered — they are their own scopes. Also each statement's
    owner: the compound statement whose block holds it (None for ``block`` itself)."""
    out: list[tuple[list[ast.stmt], int, ast.stmt]] = []
    owners: list[ast.stmt | None] = []
    _list_blocks(block, None, out, owners)
    return out, owners


def _list_blocks(block: list[ast.stmt], owner: ast.stmt | None, out: list[tuple[list[ast.stmt], int, ast.stmt]], owners: list[ast.stmt | None]) -> None:
    # a module-level function, not a closure: a recursive closure is a reference cycle that
    # would keep the listing (and so the whole tree) alive until the garbage collector runs
    compound, defs, stmt_type = _COMPOUND, _DEFS, ast.stmt
    for i, stmt in enumerate(block):
        out.append((block, i, stmt))
        owners.append(owner)
        if isinstance(stmt, defs):
            continue  # nested definitions are their own scopes
        names = compound.get(type(stmt))
        if names is None:
            names = compound[type(stmt)] = tuple(n for n in ("body", "orelse", "finalbody", "handlers", "cases") if n in type(stmt)._fields)
        if not names:
            continue  # a simple statement
        for name in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, name, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], stmt_type):
                _list_blocks(inner, stmt, out, owners)
        for handler in getattr(stmt, "handlers", []) or []:
            _list_blocks(handler.body, stmt, out, owners)
        for case in getattr(stmt, "cases", []) or []:
            _list_blocks(case.body, stmt, out, owners)


def _names_bound_elsewhere(tree: ast.Module, names: set[str]) -> set[str]:
    """Those of ``names`` (each bound by one module-level ``name = ...``) that the file binds in any other way:
    another assignment target (a function's local, a loop or ``with`` variable, a comprehension's), a parameter,
    a def or class, an import, an ``except .. as`` or ``match`` capture, or a ``global`` / ``nonlocal``
    declaration."""
    stores: dict[str, int] = {}
    other: set[str] = set()
    for n in fast_walk(tree):
        t = type(n)
        if t is ast.Name:
            if n.id in names and type(n.ctx) is not ast.Load:  # type: ignore[attr-defined]
                stores[n.id] = stores.get(n.id, 0) + 1  # type: ignore[attr-defined]
        elif t is ast.arg:
            other.add(n.arg)  # type: ignore[attr-defined]
        elif t in (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef):
            other.add(n.name)  # type: ignore[attr-defined]
        elif t is ast.alias:
            other.add(n.asname or n.name.split(".")[0])  # type: ignore[attr-defined]
        elif t in (ast.Global, ast.Nonlocal):
            other.update(n.names)  # type: ignore[attr-defined]
        elif t is ast.ExceptHandler and n.name:  # type: ignore[attr-defined]
            other.add(n.name)  # type: ignore[attr-defined]
        elif t in (ast.MatchAs, ast.MatchStar) and n.name:  # type: ignore[attr-defined]
            other.add(n.name)  # type: ignore[attr-defined]
        elif t is ast.MatchMapping and n.rest:  # type: ignore[attr-defined]
            other.add(n.rest)  # type: ignore[attr-defined]
    return {name for name in names if stores.get(name, 0) != 1 or name in other}


# s50 (perf50): the walks of one file's analysis, kept while ``engine._analyze_file`` runs its detectors
# (None elsewhere: no memo). id(root) -> (root, every node of its walk in order). Two in five nodes the
# detectors walked were a root walked before in the same file (a class walked again by each attribute
# question, a statement by each reader), and the queue a finished walk leaves behind is that walk's
# whole answer: the next walk of the root reads the list. The root is held with its list, so its id
# cannot be reused by another node while the entry lives. Exact as long as no tree walked during the
# detection changes: the only rewrites of a parsed tree (the respellings in ``ModuleInfo.from_source``)
# run with the memo suspended; detectors change only fresh trees and copies they make before walking them.
WALK_MEMO: dict[int, tuple[ast.AST, list[ast.AST]]] | None = None


def fast_walk(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk(node)``: the same nodes in the same (breadth-first) order, at a fraction of
    its cost (no deque, no ``iter_fields``/``iter_child_nodes`` generators). Like ``ast.walk``
    it reads a node's children when it reaches the node; the tree must not change meanwhile.
    Within a file's detection (``WALK_MEMO``) a root walked to its end before is not walked again."""
    memo = WALK_MEMO
    if memo is not None:
        hit = memo.get(id(node))
        if hit is not None:
            return iter(hit[1])
        return _walk(node, memo)
    return _walk(node, None)


def _walk(node: ast.AST, memo: dict[int, tuple[ast.AST, list[ast.AST]]] | None) -> Iterator[ast.AST]:
    todo = [node]
    AST = ast.AST
    append = todo.append
    fields = _CHILD_FIELDS
    for n in todo:  # a queue: the list grows while it is read
        names = fields.get(type(n))
        if names is None:
            names = child_fields(type(n))
        for name in names:
            v = getattr(n, name, None)
            if type(v) is list:
                # appended one by one: most lists hold one to three nodes, and a comprehension
                # per list (a call, a new list) cost a fifth of the walk
                for x in v:
                    if isinstance(x, AST):
                        append(x)
            elif isinstance(v, AST):
                append(v)
        yield n
    if memo is not None:  # walked to the end: the queue holds the walk
        memo[id(node)] = (node, todo)


def child_fields(node_type: type) -> tuple[str, ...]:
    """The fields of a node type that can hold child nodes (``_fields`` less the scalar ones)."""
    names = _CHILD_FIELDS.get(node_type)
    if names is None:
        names = _CHILD_FIELDS[node_type] = tuple(f for f in getattr(node_type, "_fields", ()) if f not in _SCALAR_FIELDS)
    return names


def child_nodes(node: ast.AST) -> list[ast.AST]:
    """``list(ast.iter_child_nodes(node))``, faster."""
    names = _CHILD_FIELDS.get(type(node))
    if names is None:
        names = child_fields(type(node))
    out: list[ast.AST] = []
    AST = ast.AST
    for name in names:
        v = getattr(node, name, None)
        if type(v) is list:
            for x in v:  # (as in fast_walk: no comprehension per list)
                if isinstance(x, AST):
                    out.append(x)
        elif isinstance(v, AST):
            out.append(v)
    return out


# Fields that hold a name, number or flag in every node type that has them (never a node):
# skipping them changes nothing but the cost.
_SCALAR_FIELDS = frozenset({"id", "attr", "arg", "module", "asname", "level", "is_async", "simple", "conversion", "type_comment", "kind"})
_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}


@dataclass
class ModuleInfo:
    """One parsed file: source, tree, import aliases, helper functions, classes."""

    path: str  # relative to the scanned root, '/'-separated
    source: str
    tree: ast.Module
    aliases: dict[str, str] = field(default_factory=dict)  # local name -> canonical dotted name
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)  # module-level defs
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    scopes: list[Scope] = field(default_factory=list)
    # names bound by ``from .x import name`` anywhere in the file (``aliases`` holds absolute imports only)
    relative_imports: set[str] = field(default_factory=set)
    # every class definition, nested ones included, in ``ast.walk`` order (each definition of a name)
    all_classes: list[ast.ClassDef] = field(default_factory=list)
    # module-level names bound once to a torch API (``LayerNormImpl = nn.RMSNorm``): local name ->
    # canonical dotted name. Kept apart from ``aliases`` (imports), which callers also iterate.
    assigned_aliases: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_source(cls, path: str, source: str, tree: ast.Module | None = None) -> "ModuleInfo":
        global WALK_MEMO
        tree = tree if tree is not None else ast.parse(source)
        # the respellings below change the tree they walk: no walk of it may be kept from before them
        # (another file of the repo is indexed here in the middle of a detector's work)
        memo, WALK_MEMO = WALK_MEMO, None
        try:
            aliased = canonicalise_module_aliases(tree)
            canonicalise_unbound_tensor_methods(tree, source)
            # the text gate reads ``torch.``: a module that spells it ``th.`` is walked without it
            canonicalise_tensor_functions(tree, None if aliased else source)
            info = cls(path=path, source=source, tree=tree)
            info._index()
        finally:
            WALK_MEMO = memo
        return info

    @property
    def lines(self) -> list[str]:
        """The source's lines with their ends, numbered as ``ast`` numbers them, split once per
        module and shared by every reader (detectors, risks, replacement): callers slice it and
        never modify it. ``str.splitlines`` (fast) where it gives those lines; a file with a form
        feed or another break that only splitlines counts is split by ``codegen.source_lines``
        (with splitlines, every line after a page break was read one line off: wrong code in the
        fused branch)."""
        cached = self.__dict__.get("_npufuse_lines")
        if cached is None:
            from npufuse.rewrite.codegen import has_other_breaks, source_lines

            src = self.source
            cached = self.__dict__["_npufuse_lines"] = source_lines(src) if has_other_breaks(src) else src.splitlines(keepends=True)
        return cached

    def canonical(self, node: ast.AST | None) -> str | None:
        """Dotted name with import aliases resolved: ``F.silu`` -> ``torch.nn.functional.silu``."""
        name = dotted(node)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        if head in self.aliases:
            full = self.aliases[head]
            return f"{full}.{rest}" if rest else full
        if self.assigned_aliases:  # (empty in most files: no lookup there)
            full = self.assigned_aliases.get(head)
            if full is not None:
                return f"{full}.{rest}" if rest else full
        return name

    def call_name(self, node: ast.AST) -> str | None:
        """Canonical name of the callee if ``node`` is a call of a plain/dotted name."""
        if isinstance(node, ast.Call):
            return self.canonical(node.func)
        return None

    def helper(self, name: str) -> ast.FunctionDef | None:
        """A small module-level function by name (followed by detectors: rotate_half, repeat_kv)."""
        return self.functions.get(name)

    # -- indexing -------------------------------------------------------------------------
    def _index(self) -> None:
        for node in _statements_bfs(self.tree):
            if type(node) is ast.ClassDef:
                self.all_classes.append(node)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        self.aliases.setdefault(a.name.split(".")[0], a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # gathered in this walk: the numeric probe's gate read every statement again for them
                    self.relative_imports.update(a.asname or a.name for a in node.names if a.name != "*")
                elif node.module:
                    for a in node.names:
                        self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        assigned: dict[str, str | None] = {}
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node  # type: ignore[assignment]
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
            elif type(node) is ast.Assign:
                self._note_api_alias(node, assigned)
        candidates = {k: v for k, v in assigned.items() if v is not None and k not in self.aliases}
        if candidates:  # (rare: one more walk of the tree only in files that have such a name)
            # s42 review: canonical() has no scope, so the name must mean the API everywhere in the file: a name
            # a function binds too (`act = self.act`, a parameter `act=F.gelu`, `global act`), a def, a loop
            # variable or a relative import of the same name is no alias
            rebound = _names_bound_elsewhere(self.tree, set(candidates))
            candidates = {k: v for k, v in candidates.items() if k not in rebound}
        self.assigned_aliases = candidates
        self.scopes = [_make_scope("<module>", self.tree, None, self.tree.body)]
        self._collect_scopes(self.tree.body, prefix="", class_name=None, top=True)
        if len(self.all_classes) > len(self.classes):  # s48: a class name defined twice means no one class
            _classes_s48r.drop_ambiguous(self)

    def _note_api_alias(self, node: ast.Assign, assigned: dict[str, str | None]) -> None:
        """``Name = torch.api`` at module level (``LayerNormImpl = nn.RMSNorm``): the name stands for
        the API wherever the file calls it. A name bound twice, or to anything else, is no alias
        (None marks it so a later binding cannot make it one)."""
        for t in node.targets:
            for leaf in ast.walk(t):
                if isinstance(leaf, ast.Name):
                    name = leaf.id
                    if name in assigned or len(node.targets) != 1 or t is not leaf:
                        assigned[name] = None
                        continue
                    full = self.canonical(node.value) if isinstance(node.value, (ast.Name, ast.Attribute)) else None
                    # only torch APIs: an alias of the file's own helper or of another package is left as written
                    assigned[name] = full if full is not None and full.startswith("torch.") and full != name else None

    def _collect_scopes(self, body: list[ast.stmt], prefix: str, class_name: str | None, top: bool = False) -> None:
        """Every function/method under ``body`` becomes a scope, also one defined inside an
        ``if``/``else``/``try``/``except``/``with``/``for``/``match`` block: a ``try: import x
        except ImportError: def rms_norm(...)`` fallback or an ``if is_available(): class ...``
        is as real as a top-level def. A block adds nothing to the qualname (``rms_norm``,
        ``Cls.forward``: the names ``apply``'s marked-site finder and Python's ``__qualname__``
        give, ``<locals>`` aside). ``top``: ``body`` is the module's (through such blocks), so
        its classes and functions are also indexed in ``classes``/``functions`` for the
        detectors' lookups (``self.config``, helpers) — a top-level definition of the same name
        keeps its place."""
        for node in body:
            if isinstance(node, ast.ClassDef):
                if top:
                    self.classes.setdefault(node.name, node)
                self._collect_scopes(node.body, f"{prefix}{node.name}.", node.name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if top:
                    self.functions.setdefault(node.name, node)  # type: ignore[arg-type]
                qual = f"{prefix}{node.name}"
                self.scopes.append(_make_scope(qual, node, class_name, node.body))
                self._collect_scopes(node.body, f"{qual}.", None)
            else:
                names = _BLOCK_FIELDS.get(type(node))
                if names is None:
                    names = _BLOCK_FIELDS[type(node)] = tuple(n for n in _BLOCK_NAMES if n in type(node)._fields)
                for name in names:
                    block = getattr(node, name, None) or []
                    if name == "handlers" or name == "cases":  # except handlers, match cases: each holds a block
                        for part in block:
                            self._collect_scopes(part.body, prefix, class_name, top)
                    else:
                        self._collect_scopes(block, prefix, class_name, top)


def _statements_bfs(tree: ast.Module) -> Iterator[ast.AST]:
    """The statements of ``ast.walk(tree)``, in the same order, without visiting expressions
    (imports are statements; expressions never hold statements). Several times faster."""
    todo: list[ast.AST] = [tree]
    fields = _BLOCK_FIELDS
    for node in todo:  # a queue: the list grows while it is read
        yield node
        names = fields.get(type(node))
        if names is None:
            names = fields[type(node)] = tuple(n for n in _BLOCK_NAMES if n in type(node)._fields)
        for name in names:
            block = getattr(node, name, None)
            if type(block) is list:
                todo.extend(block)


# the fields of a statement (or handler / match case) that hold statement blocks
_BLOCK_NAMES = ("body", "handlers", "orelse", "finalbody", "cases")
# node type -> its fields among body/handlers/orelse/finalbody/cases (most statements have none)
_BLOCK_FIELDS: dict[type, tuple[str, ...]] = {}


def _make_scope(qualname: str, node: ast.AST, class_name: str | None, body: list[ast.stmt]) -> Scope:
    return Scope(qualname=qualname, node=node, class_name=class_name, body=body)


def _assignments_of(listing: list[tuple[list[ast.stmt], int, ast.stmt]]) -> dict[str, list[tuple[ast.stmt, ast.expr]]]:
    """:attr:`Scope.assignments` from the scope's statement listing."""
    assignments: dict[str, list[tuple[ast.stmt, ast.expr]]] = {}
    for _block, _i, stmt in listing:
        targets: list[ast.expr] = []
        value = None
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
            if isinstance(stmt, ast.AugAssign):  # x *= y  ==  x = x * y
                value = ast.copy_location(ast.BinOp(left=ast.Name(dotted(stmt.target) or "_", ast.Load()), op=stmt.op, right=stmt.value), stmt)
        for target in targets:
            if isinstance(target, ast.Name):
                assignments.setdefault(target.id, []).append((stmt, value))
            elif isinstance(target, (ast.Tuple, ast.List)):
                _record_unpacked(stmt, target, value, assignments)  # type: ignore[arg-type]
    return assignments


def _record_unpacked(stmt: ast.stmt, target: ast.Tuple | ast.List, value: ast.expr,
                     assignments: dict[str, list[tuple[ast.stmt, ast.expr]]]) -> None:
    """Per-element definitions of a tuple / list target: element k of ``a, b = v`` is ``v[k]`` (an
    element after a starred one counts from the end: ``v[-1]`` for ``c`` in ``a, *b, c = v``; the
    starred one itself gets none); a nested target goes on inside (``(a, b), c = v``: ``a`` is
    ``v[0][0]``). s40 (dataflow40): where ``v`` is ``map(lambda t: f(t), (x, y))`` (or a list / tuple
    / generator comprehension ``[f(t) for t in (x, y)]``) over a literal tuple or list, element k is
    the lambda applied to that element, ``(lambda t: f(t))(x)`` (:func:`applied_lambda` reads it),
    so ``q, k = map(lambda t: rearrange(t, ...), (q, k))`` defines ``q`` as ``rearrange(q, ...)``."""
    elts = target.elts
    star = next((k for k, e in enumerate(elts) if isinstance(e, ast.Starred)), None)
    mapped = _mapped_elements(value, len(elts)) if star is None else None
    for k, elt in enumerate(elts):
        if isinstance(elt, ast.Starred):
            continue
        index = k if star is None or k < star else k - len(elts)
        if mapped is not None:
            element = mapped[k]
        else:
            element = ast.copy_location(ast.Subscript(value=value, slice=ast.Constant(index), ctx=ast.Load()), value)
        if isinstance(elt, ast.Name):
            assignments.setdefault(elt.id, []).append((stmt, element))
        elif isinstance(elt, (ast.Tuple, ast.List)):
            _record_unpacked(stmt, elt, element, assignments)


def _mapped_elements(value: ast.expr, n: int) -> list[ast.expr] | None:
    """The n elements of ``map(lambda t: body, <literal of n>)`` / ``[body for t in <literal of n>]``
    (also ``(...)`` generators and ``tuple(...)`` / ``list(...)`` of one) as lambda applications,
    or None. Only a one-parameter lambda without defaults, one ``for`` over a plain name target,
    no ``if``, a literal tuple / list of exactly n elements, none starred."""
    lam: ast.Lambda | None = None
    items: ast.expr | None = None
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("tuple", "list") \
            and len(value.args) == 1 and not value.keywords:
        value = value.args[0]
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "map" \
            and len(value.args) == 2 and not value.keywords and isinstance(value.args[0], ast.Lambda):
        lam, items = value.args[0], value.args[1]
    elif isinstance(value, (ast.ListComp, ast.GeneratorExp)) and len(value.generators) == 1:
        gen = value.generators[0]
        if isinstance(gen.target, ast.Name) and not gen.ifs and not gen.is_async:
            params = ast.arguments(posonlyargs=[], args=[ast.arg(gen.target.id)], kwonlyargs=[], kw_defaults=[], defaults=[])
            lam = ast.copy_location(ast.Lambda(args=params, body=value.elt), value.elt)
            items = gen.iter
    if lam is None or not isinstance(items, (ast.Tuple, ast.List)) or len(items.elts) != n \
            or any(isinstance(e, ast.Starred) for e in items.elts):
        return None
    a = lam.args
    if a.posonlyargs or len(a.args) != 1 or a.vararg or a.kwonlyargs or a.kwarg or a.defaults:
        return None
    return [ast.copy_location(ast.Call(func=lam, args=[e], keywords=[]), e) for e in items.elts]


def applied_lambda(node: ast.AST | None) -> tuple[str, ast.expr, ast.expr] | None:
    """``(lambda t: body)(arg)`` (as :func:`_record_unpacked` records a mapped element, or written so):
    (the parameter's name, the body, the argument), or None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Lambda) and len(node.args) == 1 and not node.keywords):
        return None
    a = node.func.args
    if a.posonlyargs or len(a.args) != 1 or a.vararg or a.kwonlyargs or a.kwarg or a.defaults or isinstance(node.args[0], ast.Starred):
        return None
    return a.args[0].arg, node.func.body, node.args[0]


def strip_casts(node: ast.expr) -> tuple[ast.expr, list[str]]:
    """Remove dtype-only wrappers (``x.to(torch.float32)``, ``.float()``, ``.type_as(y)``).

    Returns the inner expression and the casts removed (outermost first, as source-ish text),
    so detectors can record where the fp32 upcast happens and which dtype comes out.
    """
    casts: list[str] = []
    while (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in CAST_METHODS
    ):
        casts.append(ast.unparse(node)[len(ast.unparse(node.func.value)) :])
        node = node.func.value
    return node, casts


def literal_eval_node(node: ast.AST) -> object:
    """``ast.literal_eval(node)`` for a node (not a string): the same value, or the same
    exception type where it raises (ValueError for what is no literal; TypeError for an
    unhashable set member or key). Its steps, as module-level functions: every call of
    ``ast.literal_eval`` defines four nested functions that refer to one another, a reference
    cycle (with their cells and the node given) that only the cyclic garbage collector frees,
    and ``engine.analyze_file`` keeps the collector off while a file is analysed. The scan
    evaluates ~10 literals per scope; collecting those cycles, with the tree pieces they kept
    alive, cost about a tenth of a plain ``ast.parse`` of the corpus. Tests compare it with
    the running Python's ``ast.literal_eval`` on every literal form."""
    if isinstance(node, ast.Expression):
        node = node.body
    return _literal_convert(node)


def _literal_malformed(node: object) -> ValueError:
    msg = "malformed node or string"
    lno = getattr(node, "lineno", None)
    if lno:
        msg += f" on line {lno}"
    return ValueError(msg + f": {node!r}")


def _literal_num(node: object) -> object:
    if not isinstance(node, ast.Constant) or type(node.value) not in (int, float, complex):
        raise _literal_malformed(node)
    return node.value


def _literal_signed_num(node: object) -> object:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        operand = _literal_num(node.operand)
        return +operand if isinstance(node.op, ast.UAdd) else -operand  # type: ignore[operator]
    return _literal_num(node)


def _literal_convert(node: object) -> object:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple):
        return tuple(map(_literal_convert, node.elts))
    if isinstance(node, ast.List):
        return list(map(_literal_convert, node.elts))
    if isinstance(node, ast.Set):
        return set(map(_literal_convert, node.elts))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "set" and node.args == node.keywords == []:
        return set()
    if isinstance(node, ast.Dict):
        if len(node.keys) != len(node.values):
            raise _literal_malformed(node)
        return dict(zip(map(_literal_convert, node.keys), map(_literal_convert, node.values)))  # type: ignore[arg-type]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        left = _literal_signed_num(node.left)
        right = _literal_num(node.right)
        if isinstance(left, (int, float)) and isinstance(right, complex):
            return left + right if isinstance(node.op, ast.Add) else left - right
    return _literal_signed_num(node)


def const_value(node: ast.AST | None) -> object:
    """Python value of a literal (incl. negative numbers), else a sentinel ``...``."""
    # (a constant is its value; a bare or dotted name is no literal)
    t = type(node)
    if t is ast.Constant:
        return node.value  # type: ignore[union-attr]
    if t is ast.Name or t is ast.Attribute or node is None:
        return ...
    try:
        return literal_eval_node(node)  # type: ignore[arg-type]
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return ...


def literal_ellipsis(node: ast.AST | None) -> bool:
    """The literal ``...`` of an index (``const_value`` answers ``...`` for every non-literal too)."""
    return isinstance(node, ast.Constant) and node.value is Ellipsis


def keyword(call: ast.Call, name: str, position: int | None = None) -> ast.expr | None:
    """Argument ``name`` of a call, by keyword or by position."""
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    if position is not None and len(call.args) > position and not any(isinstance(a, ast.Starred) for a in call.args[: position + 1]):
        return call.args[position]
    return None


def same_expr(a: ast.AST | None, b: ast.AST | None) -> bool:
    return a is not None and b is not None and ast.dump(a) == ast.dump(b)


def replace_segments(module: "ModuleInfo", stmt: ast.stmt, replacements: list[tuple[ast.AST, str]]) -> str:
    """Source of ``stmt`` with the source of each given sub-node replaced by a text.

    Used to write a fused statement that keeps everything around the matched expression
    (``q_embed = torch.cat([<rope>, q_pass], -1)``, ``x = <attention>.transpose(1, 2)``) byte for
    byte. The result is dedented by the statement's own indentation (continuation lines keep
    their relative indentation). Sub-nodes must lie inside ``stmt`` and not overlap.
    """
    lines = module.lines
    first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
    # ast offsets are UTF-8 byte columns: work on bytes so non-ASCII source stays aligned
    chunk = [ln.encode("utf-8") for ln in lines[first - 1 : last]]
    starts = [0]
    for ln in chunk:
        starts.append(starts[-1] + len(ln))
    text = b"".join(chunk)

    def offset(line: int, col: int) -> int:
        return starts[line - first] + col

    begin = offset(first, stmt.col_offset)
    end = offset(last, stmt.end_col_offset or 0)
    spans = sorted(
        ((offset(n.lineno, n.col_offset), offset(n.end_lineno or n.lineno, n.end_col_offset or 0), new) for n, new in replacements),
        key=lambda t: t[0],
    )
    indent = " " * stmt.col_offset

    def dedent(piece: str) -> str:
        # only the original source's continuation lines carry the statement's indentation
        lines_ = piece.split("\n")
        return "\n".join([lines_[0]] + [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines_[1:]])

    out, pos = [], begin
    for a, b, new in spans:
        if a < pos or b > end:
            raise ValueError("replace_segments: overlapping or out-of-statement node")
        out.append(dedent(text[pos:a].decode("utf-8")))
        out.append(new)
        pos = b
    out.append(dedent(text[pos:end].decode("utf-8")))
    return "".join(out)


def lf_line_ends(text: str) -> str:
    """``text`` with "\n" for every "\r\n" or lone "\r" line end (as ``ast`` reads them): code and
    words a detector cut from a file with Windows (or old Mac) line ends, made the same as from
    its "\n" twin. apply (libcst) writes fused code with the file's own line end."""
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def names_bound_from(fn: ast.AST, names: Iterable[str], rounds: int) -> set[str]:
    """``names`` and the names bound in ``fn`` from an expression reading one of them: a ``for`` /
    comprehension target over it or an assignment target of it (``for p in model.parameters()``,
    ``params = list(model.parameters())``), repeated to a fixed point or ``rounds`` passes."""
    out = set(names)
    for _ in range(rounds):
        before = len(out)
        for n in fast_walk(fn):
            src: Optional[ast.AST] = None
            tgt: list[ast.AST] = []
            if isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
                src, tgt = n.iter, [n.target]
            elif isinstance(n, ast.Assign):
                src, tgt = n.value, list(n.targets)
            if src is not None and any(isinstance(x, ast.Name) and x.id in out for x in fast_walk(src)):
                out |= {x.id for t in tgt for x in fast_walk(t) if isinstance(x, ast.Name)}
        if len(out) == before:
            break
    return out


def segment(module: "ModuleInfo", node: ast.AST) -> str:
    """``source_of`` with the file's lines split once per module (``ast.get_source_segment``
    re-splits the whole source on every call, which dominates detection on large files)."""
    cache = module.__dict__.get("_segment_lines")
    if cache is None:
        # ast columns count UTF-8 bytes; on an ASCII line they count characters, so only the
        # other lines are kept as bytes (most lines of most files are ASCII: no encode, no decode)
        # (s50: an ASCII file's lines are all kept as they are: the module's own list, read only here, not copied)
        ascii_file = module.source.isascii()
        cache = module.__dict__["_segment_lines"] = module.lines if ascii_file else \
            [ln if ln.isascii() else ln.encode("utf-8") for ln in module.lines]
        # whether every line is str (an ASCII file: most): then a span needs no per-line check
        module.__dict__["_segment_all_str"] = ascii_file or all(type(ln) is str for ln in cache)
    lineno, end = getattr(node, "lineno", None), getattr(node, "end_lineno", None)
    col, end_col = getattr(node, "col_offset", None), getattr(node, "end_col_offset", None)
    if None in (lineno, end, col, end_col) or end > len(cache):
        return ast.unparse(node)
    if lineno == end:
        ln = cache[lineno - 1]
        return ln[col:end_col] if type(ln) is str else ln[col:end_col].decode("utf-8")
    parts = [cache[lineno - 1][col:]] + cache[lineno : end - 1] + [cache[end - 1][:end_col]]
    if module.__dict__["_segment_all_str"] or all(type(p) is str for p in parts):
        return "".join(parts)
    return b"".join([p.encode("utf-8") if type(p) is str else p for p in parts]).decode("utf-8")


# character outside ASCII -> does its NFKD form hold an ASCII character (``…`` -> "...", ``é`` -> "e"
# and a combining accent, a fullwidth letter -> the letter)? Most do not (CJK, dashes, quotes, arrows)
_FOLDS_TO_ASCII: dict[str, bool] = {}
_ASCII_BYTES = bytes(range(128))


def folds_to_ascii(module: ModuleInfo) -> bool:
    """Whether some character of the file outside ASCII has an NFKD form holding an ASCII
    character. Where none has, decomposing adds no ASCII character to any text of the file: the
    ASCII runs of the decomposed text are those of the text as written (a character outside
    ASCII decomposes to characters outside ASCII, never to nothing, so runs stay apart), and an
    ASCII word is in the one exactly where it is in the other (``engine.gate_folded``). The same
    holds for the names Python reads (NFKC: composing only takes ASCII letters away), so
    ``lines_with`` and the config-switch lines need not list the lines outside ASCII either.
    1,422 of the 1,461 files of the transformers corpus with text outside ASCII (docstrings in
    other scripts, dashes, arrows) are such files. Computed once per file, from the set of its
    characters outside ASCII."""
    cached = module.__dict__.get("_npufuse_folds_to_ascii")
    if cached is None:
        src = module.source
        cached = False
        if not src.isascii():
            # the characters outside ASCII, without a Python loop over the text: the UTF-8 bytes
            # less the ASCII ones decode to them ("surrogatepass": a lone surrogate stays one)
            others = set(src.encode("utf-8", "surrogatepass").translate(None, _ASCII_BYTES).decode("utf-8", "surrogatepass"))
            table = _FOLDS_TO_ASCII
            for c in others:
                folds = table.get(c)
                if folds is None:
                    folds = table[c] = any(ord(d) < 128 for d in unicodedata.normalize("NFKD", c))
                if folds:
                    cached = True
                    break
        module.__dict__["_npufuse_folds_to_ascii"] = cached
    return cached


_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def lines_with(module: "ModuleInfo", words: tuple[str, ...]) -> list[int] | None:
    """Sorted line numbers (as ast counts them) of the lines holding one of ``words`` or a
    character outside ASCII; None where "\r" ends lines (ast counts it too; "\n" is then not
    enough to number them). An identifier is written on one line, and where its spelling
    differs from its name (identifiers are NFKC-normalised: a ligature "\ufb02" reads as "fl")
    it holds a character outside ASCII: a node named by one of ``words`` lies on a listed
    line. Those lines are left out where no character of the file decomposes to ASCII and the
    words are ASCII (``folds_to_ascii``: no name differs from its spelling in ASCII letters).
    Cached per module and words."""
    cache = module.__dict__.setdefault("_npufuse_lines_with", {})
    if words in cache:
        return cache[words]
    src = module.source
    out: list[int] | None = None
    if "\r" not in src:
        starts: list[int] = []
        for w in words:
            i = src.find(w)
            while i >= 0:
                starts.append(i)
                i = src.find(w, i + 1)
        if not src.isascii() and (folds_to_ascii(module) or not all(w.isascii() for w in words)):
            starts += [m.start() for m in _NON_ASCII.finditer(src)]
        starts.sort()
        out = lines_of_offsets(src, starts)
    cache[words] = out
    return out


def spans_a_line(stmt: ast.stmt, lines: list[int]) -> bool:
    """Whether the statement (its decorators included) spans one of the sorted ``lines``."""
    start = stmt.lineno
    for d in getattr(stmt, "decorator_list", ()):
        start = min(start, d.lineno)
    k = bisect_left(lines, start)
    return k < len(lines) and lines[k] <= (stmt.end_lineno or stmt.lineno)


def calls_on_lines(root: ast.AST, lines: list[int]) -> list[ast.Call]:
    """The ``ast.Call`` nodes of ``fast_walk(root)``, in its order, that lie in statements
    spanning one of ``lines`` (nested statements spanning none are not entered: the walk is the
    same breadth-first walk with whole subtrees left out, so the order of what is left holds)."""
    out: list[ast.Call] = []
    todo = [root]
    append, stmt_type, call_type = todo.append, ast.stmt, ast.Call
    for n in todo:  # a queue: the list grows while it is read
        if type(n) is call_type:
            out.append(n)  # type: ignore[arg-type]
        for c in child_nodes(n):
            if isinstance(c, stmt_type) and not spans_a_line(c, lines):
                continue
            append(c)
    return out


def scope_text(module: "ModuleInfo", scope: "Scope") -> str:
    """Source text of a scope (the whole file for ``<module>``): for cheap substring prefilters
    that let a detector skip scopes that cannot hold its pattern."""
    if isinstance(scope.node, ast.Module):
        return module.source
    cached = scope.__dict__.get("_segment_text")
    if cached is None:  # asked by several detectors per scope: cut once
        cached = scope.__dict__["_segment_text"] = segment(module, scope.node)
    return cached


# --- s28: the names a statement binds (shared by the detectors' "rebound between" checks) -------------------

def stored_name(node: ast.AST) -> str | None:
    """The name ``node`` binds or deletes: a ``Name`` in Store/Del context (an assignment, augmented or
    annotated target, a ``for`` / ``with`` / comprehension target, a walrus, ``del``); else None."""
    if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
        return node.id
    return None


def bound_names(stmt: ast.stmt) -> set[str]:
    """Every name ``stmt`` binds or deletes in the scope it runs in: Store/Del names anywhere in it (nested
    blocks, walrus, loop/with targets), a def's or class's own name (not the names bound in its body: its own
    scope), import aliases and ``except ... as`` names."""
    out: set[str] = set()
    _collect_bound(stmt, out)
    return out


def _collect_bound(node: ast.AST, out: set[str]) -> None:
    # module level, not a closure: a recursive closure is a reference cycle per call
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        out.add(node.name)
        return
    if isinstance(node, ast.Lambda):
        return  # its parameters bind in the lambda's own scope
    name = stored_name(node)
    if name is not None:
        out.add(name)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        out.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
    elif isinstance(node, ast.ExceptHandler) and node.name:
        out.add(node.name)
    for child in child_nodes(node):
        _collect_bound(child, out)


# --- s37 speed: text questions answered once per module, without a regex tried at every position ---


def _word_char(ch: str) -> bool:
    """``re``'s ``\\w`` on one character of a str."""
    return ch.isalnum() or ch == "_"


def called_outside_def(module: "ModuleInfo", name: str, method: bool) -> bool:
    """Whether ``module``'s text spells a call of ``name`` anywhere but its ``def``: a match of
    ``\\bself\\s*\\.\\s*NAME\\s*\\(`` (``method``) or ``(?<![\\w.])NAME\\s*\\(`` whose text is not
    preceded (8 characters back, spaces stripped) by ``def``. Each occurrence of ``name`` is
    checked by hand around it: those regexes start with an assertion, so ``re`` tried every
    position of the file (a search per question about a parameter; attention asked it ~1.3 times
    a file). Matches of either regex never overlap one another, so testing every occurrence is
    ``finditer``'s answer. Cached per module."""
    cache = module.__dict__.setdefault("_npufuse_called_outside_def", {})
    key = (name, method)
    got = cache.get(key)
    if got is None:
        got = cache[key] = _called_outside_def(module.source, name, method)
    return got


def _called_outside_def(src: str, name: str, method: bool) -> bool:
    n = len(src)
    p = src.find(name) if name else -1
    while p >= 0:
        after = p + len(name)
        while after < n and src[after].isspace():
            after += 1
        if after < n and src[after] == "(":
            start = -1
            if method:
                j = p - 1
                while j >= 0 and src[j].isspace():
                    j -= 1
                if j >= 0 and src[j] == ".":
                    j -= 1
                    while j >= 0 and src[j].isspace():
                        j -= 1
                    if j >= 3 and src[j - 3 : j + 1] == "self" and (j == 3 or not _word_char(src[j - 4])):
                        start = j - 3
            elif p == 0 or not (_word_char(src[p - 1]) or src[p - 1] == "."):
                start = p
            if start >= 0 and not src[max(0, start - 8) : start].rstrip().endswith("def"):
                return True
        p = src.find(name, p + 1)
    return False


def text_holds_any(module: "ModuleInfo", words: tuple[str, ...]) -> bool:
    """``any(w in module.source for w in words)``, computed once per module and ``words``: a
    detector asking it for every scope searched the whole file each time (moe_experts' gather
    words: most are absent, so each question read the file six times)."""
    cache = module.__dict__.setdefault("_npufuse_text_holds_any", {})
    got = cache.get(words)
    if got is None:
        src = module.source
        got = cache[words] = any(w in src for w in words)
    return got


def may_name(module: "ModuleInfo", text: str, name: str) -> bool:
    """False only where no identifier in ``text`` (a part of ``module``'s source) can be ``name``:
    the text does not hold it, and it is ASCII or no character of the file outside ASCII
    decomposes to an ASCII one (an identifier is read as its NFKC form: ``folds_to_ascii``).
    A test before walking the nodes of that text for a ``Name`` of ``name``."""
    return name in text or not (text.isascii() or not folds_to_ascii(module))


# --- s40: can a star be an operator? (the gates' product and power tests) ------------------------


def may_raise_to_power(text: str) -> bool:
    """Can ``text`` hold the power operator (``a ** b``, ``a **= b``)? Each ``**`` is one unless
    :func:`_unpacks` says it cannot be. A ``**`` in a string or comment may answer True: never
    False for a power."""
    i = text.find("**")
    while i >= 0:
        if not _unpacks(text, i):
            return True
        i = text.find("**", i + 2)
    return False


def may_multiply(text: str) -> bool:
    """Can ``text`` hold a product or power operator (``a * b``, ``a *= b``, ``a ** b``)? Every
    run of ``*`` is one unless :func:`_unpacks` says it cannot be (``*args``, ``**kwargs``, the
    keyword-only ``*``, ``[*a]``, ``f(**kw)``): the stars of most ``forward(self, x, **kwargs)``.
    Never False where the code multiplies."""
    i = text.find("*")
    while i >= 0:
        if not _unpacks(text, i):
            return True
        i = text.find("*", i + 2 if text.startswith("*", i + 1) else i + 1)
    return False


def _unpacks(text: str, i: int) -> bool:
    """Is the run of stars at ``text[i]`` certainly no binary operator? True only where the
    character before it (spaces, line ends and backslash continuations skipped) is ``(``, ``,``,
    ``[``, ``{`` or the keyword ``lambda``: no operand ends there. A line end crossed onto a line holding ``#`` answers
    False (that character may be a comment's: ``(a  # note,`` / ``* b)``)."""
    j = i - 1
    crossed = False
    while j >= 0 and text[j] in " \t\n\r\f\\":
        crossed = crossed or text[j] in "\n\r"
        j -= 1
    if j < 0:
        return False
    if text[j] not in "(,[{" and not (text.endswith("lambda", 0, j + 1) and (j < 6 or text[j - 6] in _NOT_NAME)):
        return False
    if crossed:
        start = max(text.rfind("\n", 0, j), text.rfind("\r", 0, j)) + 1
        if "#" in text[start:j]:
            return False
    return True


# ASCII characters no identifier holds (before ``lambda``, the keyword; any other character:
# maybe a longer name ending in "lambda", an operand)
_NOT_NAME = frozenset(" \t\n\r\f\v()[]{}:;,.=+-*/%@&|^~<>!'\"#\\")
