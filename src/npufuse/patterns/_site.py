"""Value tracking, spans and text splicing shared by the norm and gated-activation patterns.

Private to ``npufuse.patterns`` (the registry skips ``_``-prefixed modules). A detector walks a
value backwards from the statement that produces it: :class:`Ctx` says where an expression is
evaluated (which scope, at which statement, and — inside an inlined helper — what its
parameters are bound to); :func:`follow` steps through a local name to its definition and records
the statement in a :class:`Trace`; :func:`plan_span` turns the traced statements into a
whole-statement span in one block (or the reason it cannot); :func:`render` writes an expression
seen anywhere in the trace as source text valid at the fused statement; :func:`splice` replaces
sub-expressions of a statement by text, preserving everything else byte for byte.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass, field
from typing import Iterator

from npufuse.patterns import _site_s47review
from npufuse.scan import bound_callee
from npufuse.scan.dataflow import CAST_METHODS, ArmExit, ModuleInfo, Scope, applied_lambda, child_nodes, const_value, dotted, fast_walk, lf_line_ends

# Statements whose body may not run (or runs repeatedly): a value defined inside is conditional.
_CONDITIONAL = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Match) if hasattr(ast, "Match") else (ast.If, ast.For, ast.AsyncFor, ast.While)

_FLOAT_DTYPES = {
    "torch.float32": "torch.float32",
    "torch.float": "torch.float32",
    "torch.float16": "torch.float16",
    "torch.half": "torch.float16",
    "torch.bfloat16": "torch.bfloat16",
    "torch.float64": "torch.float64",
    "torch.double": "torch.float64",
}
_CAST_METHOD_DTYPE = {"float": "torch.float32", "half": "torch.float16", "bfloat16": "torch.bfloat16", "double": "torch.float64"}


# --------------------------------------------------------------------------------------------
# per-scope statement index (cached on the Scope object: scopes live as long as their module)


@dataclass
class StmtIndex:
    parent: dict[int, ast.stmt | None]  # id(stmt) -> enclosing compound statement (None: top of scope)
    block: dict[int, tuple[list[ast.stmt], int]]  # id(stmt) -> (block holding it, index)
    by_line: dict[int, ast.stmt]  # first statement starting on a line
    stmts: list[ast.stmt]


def stmt_index(scope: Scope) -> StmtIndex:
    cached = scope.__dict__.get("_npufuse_stmt_index")
    if cached is not None:
        return cached
    parent: dict[int, ast.stmt | None] = {}
    block: dict[int, tuple[list[ast.stmt], int]] = {}
    by_line: dict[int, ast.stmt] = {}
    stmts: list[ast.stmt] = []
    # the scope's statement listing (Scope.statements: the same order and blocks, walked once)
    listing, owners = scope.listing()
    for (body, i, stmt), owner in zip(listing, owners):
        key = id(stmt)
        parent[key] = owner
        block[key] = (body, i)
        by_line.setdefault(stmt.lineno, stmt)
        stmts.append(stmt)
    idx = StmtIndex(parent, block, by_line, stmts)
    scope.__dict__["_npufuse_stmt_index"] = idx
    return idx


def arm_exit_root(scope: Scope, exit: ArmExit) -> tuple[ast.Assign, float]:
    """A root statement standing for the end of an ``if`` arm whose value is read after the ``if``
    (:meth:`Scope.arm_exits`): ``name = name`` placed in the arm after its last statement (in the
    statement index only; the tree is not changed), so a detector parsing backwards from it sees the
    arm's own definitions, builds its span in the arm and writes ``name = <fused>`` there, the other
    arm untouched. Returns the statement and the line to evaluate it at (just after the arm's last
    line: the arm's bindings come before it, nothing of the other arm reaches it). Made once per exit."""
    cache = scope.__dict__.setdefault("_npufuse_arm_roots", {})
    got = cache.get((id(exit.last), exit.name))
    if got is not None:
        return got
    idx = stmt_index(scope)
    end = exit.last.end_lineno or exit.last.lineno
    where = {"lineno": end, "col_offset": exit.last.col_offset, "end_lineno": end, "end_col_offset": exit.last.col_offset}
    value = ast.Name(exit.name, ast.Load(), **where)
    root = ast.Assign(targets=[ast.Name(exit.name, ast.Store(), **where)], value=value, **where)
    root._npufuse_arm_exit = exit.name  # type: ignore[attr-defined]
    line = end + 0.5  # between the arm's last line and whatever follows: no real statement starts there
    idx.parent[id(root)] = exit.if_stmt
    idx.block[id(root)] = (exit.arm, len(exit.arm) - 1)
    idx.by_line[line] = root  # type: ignore[index]
    got = cache[(id(exit.last), exit.name)] = (root, line)
    return got


def is_arm_exit_root(stmt: ast.stmt) -> bool:
    return getattr(stmt, "_npufuse_arm_exit", None) is not None


def ancestors(idx: StmtIndex, stmt: ast.stmt) -> list[ast.stmt]:
    out: list[ast.stmt] = []
    cur = idx.parent.get(id(stmt))
    while cur is not None:
        out.append(cur)
        cur = idx.parent.get(id(cur))
    return out


def scope_of(module: ModuleInfo, fn: ast.AST) -> Scope | None:
    table = module.__dict__.get("_npufuse_scope_of")
    if table is None:
        table = {id(s.node): s for s in module.scopes}
        module.__dict__["_npufuse_scope_of"] = table
    return table.get(id(fn))


def functions_matching(module: ModuleInfo, tag: str, pred) -> set[str]:
    """Names of functions/methods whose own text satisfies ``pred(text)``, closed over calls by
    name (a helper calling such a helper counts). Text-only, so it costs no AST walk; cached per
    module under ``tag``."""
    cache = module.__dict__.setdefault("_npufuse_mentions", {})
    if tag in cache:
        return cache[tag]
    texts: dict[str, list[str]] = {}
    found: set[str] = set()
    for s in module.scopes:
        fn = s.node
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        text = scope_text(module, s)  # the function's lines, joined once and shared with the detectors
        if pred(text):
            found.add(fn.name)
        else:
            texts.setdefault(fn.name, []).append(text)
    new = set(found)
    while new and texts:
        called = re.compile(r"\b(?:" + "|".join(re.escape(n) for n in sorted(new)) + r")\s*\(")
        names = tuple(sorted(new))  # every match starts with one of the names
        new = {name for name, ts in texts.items() if name not in found and any(anchored_search(called, t, names) for t in ts)}
        found |= new
        for name in new:
            texts.pop(name, None)
    cache[tag] = found
    return found


def anchored_search(rx: re.Pattern[str], text: str, anchors: tuple[str, ...]) -> bool:
    """``rx.search(text) is not None``, trying ``rx.match`` only where one of ``anchors`` occurs.

    Exact when every match of ``rx`` starts with one of the anchor strings (each alternative of
    the regex begins, after zero-width assertions, with one of them): ``match`` at a position
    still sees the text before it (lookbehinds, ``\\b``). A regex that opens with a lookbehind or
    ``\\b`` cannot use the regex engine's literal scan and tries every position of the text
    otherwise — on whole files that costs as much as a tenth of parsing them."""
    match = rx.match
    for anchor in anchors:
        i = text.find(anchor)
        while i >= 0:
            if match(text, i):
                return True
            i = text.find(anchor, i + 1)
    return False


def module_lines(module: ModuleInfo) -> list[str]:
    return module.lines  # split once per module, shared (never modified)


def source_of(module: ModuleInfo, node: ast.AST) -> str:
    """Exact source of a node (``ast.get_source_segment`` re-splits the whole file per call)."""
    lines = module_lines(module)
    l0, l1 = node.lineno - 1, (node.end_lineno or node.lineno) - 1  # type: ignore[attr-defined]
    c0, c1 = node.col_offset, node.end_col_offset  # type: ignore[attr-defined]
    # columns are UTF-8 byte offsets: on an ASCII line (most) they are character offsets
    if l0 == l1:
        line = lines[l0]
        return line[c0:c1] if line.isascii() else line.encode("utf-8")[c0:c1].decode("utf-8")
    first, last = lines[l0], lines[l1]
    parts = [first[c0:] if first.isascii() else first.encode("utf-8")[c0:].decode("utf-8")]
    parts += lines[l0 + 1 : l1]
    parts.append(last[:c1] if last.isascii() else last.encode("utf-8")[:c1].decode("utf-8"))
    return "".join(parts)


def scope_text(module: ModuleInfo, scope: Scope) -> str:
    """Source of a scope (cheap prefilter for detectors: skip scopes without the right words)."""
    if isinstance(scope.node, ast.Module):
        return module.source
    cached = scope.__dict__.get("_npufuse_text")
    if cached is None:
        lines = module_lines(module)
        cached = "".join(lines[scope.node.lineno - 1 : (scope.node.end_lineno or scope.node.lineno)])
        scope.__dict__["_npufuse_text"] = cached
    return cached


# --------------------------------------------------------------------------------------------
# evaluation context and tracing


@dataclass
class Ctx:
    """Where an expression is evaluated: scope, the statement line, helper parameter bindings."""

    scope: Scope
    line: int
    bind: dict[str, tuple[ast.expr, "Ctx"]] = field(default_factory=dict)
    depth: int = 0  # 0 = the scope being scanned; >0 = inside an inlined helper

    def at(self, line: int) -> "Ctx":
        return Ctx(self.scope, line, self.bind, self.depth)


@dataclass
class Trace:
    """Statements of the scanned scope a match reads through (the span is built from them)."""

    stmts: dict[int, ast.stmt] = field(default_factory=dict)
    # conditional definitions met while following names: (def stmt, enclosing compound stmt)
    conditional: list[tuple[ast.stmt, ast.stmt]] = field(default_factory=list)

    def add(self, stmt: ast.stmt) -> None:
        self.stmts[id(stmt)] = stmt

    def copy(self) -> "Trace":
        return Trace(dict(self.stmts), list(self.conditional))


def definition(ctx: Ctx, name: str) -> tuple[ast.stmt, ast.expr] | None:
    """The statement and value last assigning ``name`` before ``ctx.line`` in ``ctx.scope``.

    Unlike a purely textual lookup, a definition in the other branch of an ``if`` that also holds
    the use (``if a: x = f() else: use(x)``) does not reach the use and is skipped.
    """
    cands = [(stmt, value) for stmt, value in ctx.scope.assignments.get(name, []) if stmt.lineno < ctx.line]
    if not cands:
        return None
    idx = stmt_index(ctx.scope)
    use = idx.by_line.get(ctx.line)
    for stmt, value in reversed(cands):
        if use is None or not _exclusive(idx, stmt, use):
            return stmt, value
    return None


def _exclusive(idx: StmtIndex, a: ast.stmt, b: ast.stmt) -> bool:
    """Are ``a`` and ``b`` in different branches of one ``if`` (never both executed)?"""
    chain_a = [a] + ancestors(idx, a)
    chain_b = {id(x) for x in [b] + ancestors(idx, b)}
    prev = a
    for anc in chain_a[1:]:
        if id(anc) in chain_b:
            if isinstance(anc, ast.If):
                in_body_a = any(s is prev for s in anc.body)
                prev_b = b
                for x in [b] + ancestors(idx, b):
                    if idx.parent.get(id(x)) is anc:
                        prev_b = x
                        break
                # (by the index: an arm_exit_root stands in the arm without being in its list)
                in_body_b = any(s is prev_b for s in anc.body) or idx.block.get(id(prev_b), (None,))[0] is anc.body
                return in_body_a != in_body_b
            return False
        prev = anc
    return False


def follow(node: ast.expr, ctx: Ctx, trace: Trace | None = None, *, allow_conditional: bool = False) -> tuple[ast.expr, Ctx, ast.stmt | None]:
    """One step through a Name: its bound helper argument or its local definition.

    Returns ``(value, ctx_of_value, defining_stmt)``; a Name that is a parameter (or global, or
    only conditionally defined when ``allow_conditional`` is false) comes back unchanged with
    ``defining_stmt`` None.
    """
    if not isinstance(node, ast.Name):
        return node, ctx, None
    d = definition(ctx, node.id)
    if d is None:
        if node.id in ctx.bind:  # a helper parameter not reassigned before this line
            value, vctx = ctx.bind[node.id]
            return value, vctx, None
        return node, ctx, None
    stmt, value = d
    idx = stmt_index(ctx.scope)
    use = idx.by_line.get(ctx.line)
    use_anc = {id(a) for a in ancestors(idx, use)} if use is not None else set()
    for anc in ancestors(idx, stmt):
        if isinstance(anc, _CONDITIONAL) and id(anc) not in use_anc:
            if not allow_conditional:
                return node, ctx, None
            if trace is not None and ctx.depth == 0:
                trace.conditional.append((stmt, anc))
            break
    if trace is not None and ctx.depth == 0:
        trace.add(stmt)
    # ``a, b = x, y``: the scope records ``(x, y)[0]`` for ``a``; take the element itself
    if (
        isinstance(value, ast.Subscript)
        and isinstance(value.value, (ast.Tuple, ast.List))
        and isinstance(value.slice, ast.Constant)
        and isinstance(value.slice.value, int)
        and 0 <= value.slice.value < len(value.value.elts)
        and not any(isinstance(e, ast.Starred) for e in value.value.elts)
    ):
        value = value.value.elts[value.slice.value]
    # s40 (dataflow40): ``q, k = map(lambda t: f(t), (q, k))`` records ``q`` as ``(lambda t: f(t))(q)``:
    # the body, read with ``t`` bound to the element where the statement stands (the lambda runs
    # there). Only where ``t`` names nothing else the scope binds (else the scope's ``t`` would win)
    applied = applied_lambda(value)
    if applied is not None:
        param, body, arg = applied
        if param not in ctx.scope.assignments and param not in ctx.scope.args and param not in ctx.bind:
            at = ctx.at(stmt.lineno)
            return body, Ctx(ctx.scope, stmt.lineno, {**ctx.bind, param: (arg, at)}, ctx.depth), stmt
    return value, ctx.at(stmt.lineno), stmt


def peel(node: ast.expr, ctx: Ctx, trace: Trace | None = None, *, through=None, allow_conditional: bool = False) -> tuple[ast.expr, Ctx]:
    """Follow names while their definition satisfies ``through(value)`` (all names when None)."""
    for _ in range(32):
        if not isinstance(node, ast.Name):
            return node, ctx
        value, vctx, stmt = follow(node, ctx, None, allow_conditional=allow_conditional)
        if value is node:
            return node, ctx
        if through is not None and not through(value):
            return node, ctx
        if trace is not None:
            follow(node, ctx, trace, allow_conditional=allow_conditional)
        node, ctx = value, vctx
    return node, ctx


def is_cast(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CAST_METHODS


def key(node: ast.expr, ctx: Ctx, depth: int = 0) -> str:
    """A dtype-insensitive identity of a value: names resolved to their definitions, casts dropped.

    Two expressions with the same key compute the same tensor (up to dtype), e.g. the squared
    operand of the variance and the normalized operand of an RMSNorm.
    """
    if depth > 40:
        return "<deep>"
    while is_cast(node):
        node = node.func.value  # type: ignore[union-attr]
    if isinstance(node, ast.Name):
        value, vctx, stmt = follow(node, ctx)
        if value is node:
            return f"${node.id}@{ctx.scope.qualname}" + _version_suffix(node.id, ctx)
        return key(value, vctx, depth + 1)
    if isinstance(node, ast.AST):
        parts = [type(node).__name__]
        for fname, val in ast.iter_fields(node):
            if fname in ("ctx", "type_comment", "kind"):
                continue
            if isinstance(val, ast.expr):
                parts.append(key(val, ctx, depth + 1))
            elif isinstance(val, list):
                parts.append("[" + ",".join(key(v, ctx, depth + 1) if isinstance(v, ast.expr) else (ast.dump(v) if isinstance(v, ast.AST) else repr(v)) for v in val) + "]")
            elif isinstance(val, ast.AST):
                parts.append(ast.dump(val))
            else:
                parts.append(repr(val))
        return "(" + " ".join(parts) + ")"
    return repr(node)


# --------------------------------------------------------------------------------------------
# small AST predicates


def arg(call: ast.Call, name: str, position: int | None) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    if position is not None and len(call.args) > position and not any(isinstance(a, ast.Starred) for a in call.args[: position + 1]):
        return call.args[position]
    return None


def const_dim(node: ast.expr | None) -> object:
    """A literal dim (``-1``, ``(-1,)``, ``[-1]`` -> -1), else ``...``."""
    v = const_value(node)
    if isinstance(v, (tuple, list)) and len(v) == 1:
        v = v[0]
    return v


def is_last_dim_expr(node: ast.expr | None) -> bool:
    """``-1`` or ``x.dim() - 1`` / ``x.ndim - 1`` / ``len(x.shape) - 1``."""
    if node is None:
        return False
    if const_dim(node) == -1:
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and const_value(node.right) == 1:
        left = node.left
        if isinstance(left, ast.Attribute) and left.attr == "ndim":
            return True
        if isinstance(left, ast.Call) and isinstance(left.func, ast.Attribute) and left.func.attr in ("dim", "ndimension"):
            return True
        if isinstance(left, ast.Call) and isinstance(left.func, ast.Name) and left.func.id == "len":
            return True
    return False


def torch_name(module: ModuleInfo) -> str | None:
    """The name this module binds to the ``torch`` package (``torch`` almost always). Memoised
    per module (s42: asked ~15 times per file, each a scan of every import alias: a file that
    imports hundreds of names paid ~27 us a call); ``aliases`` is complete once indexed."""
    cached = module.__dict__.get("_npufuse_torch_name", _UNSET)
    if cached is _UNSET:
        cached = module.__dict__["_npufuse_torch_name"] = next((local for local, full in module.aliases.items() if full == "torch"), None)
    return cached  # type: ignore[return-value]


_UNSET = object()


def cast_dtype(module: ModuleInfo, cast: ast.Call, ctx: Ctx, trace: Trace | None = None) -> tuple[str, ast.expr | None, Ctx] | None:
    """What dtype a cast produces: ``("torch.float32", None, ctx)`` for fixed dtypes, ``("like",
    t, tctx)`` for ``.to(t.dtype)`` / ``.type_as(t)`` (``t`` evaluated in ``tctx``), ``("same", ...)``
    for ``.contiguous()``, ``("expr", e, ectx)`` for a dtype-valued parameter; None if it is not a
    plain dtype cast (``.to(device)``). Names holding the dtype are followed (and traced)."""
    attr = cast.func.attr  # type: ignore[union-attr]
    if attr == "contiguous":
        return ("same", None, ctx)
    if attr in _CAST_METHOD_DTYPE and not cast.args:
        return (_CAST_METHOD_DTYPE[attr], None, ctx)
    if attr == "type_as" and len(cast.args) == 1:
        return ("like", cast.args[0], ctx)
    if attr in ("to", "type"):
        target = arg(cast, "dtype", 0)
        if target is None or len(cast.args) > 1:
            return None
        return dtype_of_expr(module, target, ctx, trace)
    return None


def dtype_of_expr(module: ModuleInfo, node: ast.expr, ctx: Ctx, trace: Trace | None = None, depth: int = 0) -> tuple[str, ast.expr | None, Ctx] | None:
    """A dtype-valued expression: ``torch.bfloat16`` or ``t.dtype`` (followed through names)."""
    if depth > 8:
        return None
    canon = module.canonical(node)
    if canon in _FLOAT_DTYPES:
        return (_FLOAT_DTYPES[canon], None, ctx)
    if isinstance(node, ast.Attribute) and node.attr == "dtype":
        return ("like", node.value, ctx)
    if isinstance(node, ast.Name):
        value, vctx, stmt = follow(node, ctx)
        if value is not node:
            found = dtype_of_expr(module, value, vctx, trace, depth + 1)
            if found is not None and trace is not None:
                follow(node, ctx, trace)
            if found is None and _is_promotion(module, value):
                # ``dtype = torch.promote_types(x.dtype, w.dtype)`` / ``reduce(torch.promote_types, ...)``:
                # a computed dtype, read through its name as is
                return ("expr", node, ctx)
            return found
        return ("expr", node, ctx)  # a parameter holding a dtype: used as is
    return None


def _is_promotion(module: ModuleInfo, value: ast.expr) -> bool:
    if not isinstance(value, ast.Call):
        return False
    name = module.call_name(value)
    if name == "torch.promote_types":
        return True
    return name in ("functools.reduce", "reduce") and bool(value.args) and module.canonical(value.args[0]) == "torch.promote_types"


# --------------------------------------------------------------------------------------------
# rendering expressions as source valid at the fused statement


class RenderError(Exception):
    pass


@dataclass
class SpanPlan:
    block: list[ast.stmt]
    start: int  # index in block
    end: int  # index in block (the root statement)
    dropped: list[ast.stmt]  # traced statements the fused code replaces
    kept: list[ast.stmt]  # statements inside the span emitted verbatim, in order
    line: int
    end_line: int

    dropped_ids: set[int] = field(default_factory=set)  # dropped statements and everything nested in them

    @property
    def stmts(self) -> list[ast.stmt]:
        return self.block[self.start : self.end + 1]

    def is_dropped(self, stmt: ast.stmt) -> bool:
        return id(stmt) in self.dropped_ids

    def kept_writes_after(self, name: str, line: int) -> bool:
        """Does a kept statement assign ``name`` after ``line`` (so the name changed meaning)?"""
        return any(s.lineno > line and name in names_written(s) for s in self.kept)


def render(module: ModuleInfo, node: ast.expr, ctx: Ctx, plan: SpanPlan | None) -> str:
    """``node`` (evaluated in ``ctx``) as source text valid where the fused root statement runs.

    Helper parameters become the caller's arguments; names defined by statements the fused code
    drops are replaced by their (rendered) definitions; other names are kept. Raises
    :class:`RenderError` when a name cannot be expressed there.
    """
    changed = [False]

    def sub(n: ast.expr, c: Ctx, depth: int) -> ast.expr:
        if depth > 24:
            raise RenderError("expression too deep")
        if isinstance(n, ast.Name):
            d = definition(c, n.id)
            if d is None and n.id in c.bind:
                value, vctx = c.bind[n.id]
                changed[0] = True
                return sub(value, vctx, depth + 1)
            if d is None:
                if plan is not None and c.depth == 0 and _reassigned_before_root(c, n.id, plan):
                    # a parameter read where ``c`` stands but reassigned by a statement that still
                    # runs before the fused one: there the name holds another value
                    raise RenderError(f"`{n.id}` is reassigned inside the span")
                return n
            stmt, value = d
            if c.depth > 0:  # a helper's local: inline its definition
                changed[0] = True
                return sub(value, c.at(stmt.lineno), depth + 1)
            if plan is not None and plan.is_dropped(stmt):
                changed[0] = True
                return sub(value, c.at(stmt.lineno), depth + 1)
            # (a kept ``if`` assigning the name inside counts as kept: gpt-neox's partial-norm split)
            if plan is not None and stmt.lineno >= plan.line and not any(s is a for s in plan.kept for a in [stmt, *ancestors(stmt_index(c.scope), stmt)]):
                raise RenderError(f"`{n.id}` is assigned inside the span")
            if plan is not None and plan.kept_writes_after(n.id, stmt.lineno):
                raise RenderError(f"`{n.id}` is reassigned inside the span")
            return n
        new = _copy_shallow(n)
        for fname, val in ast.iter_fields(n):
            if isinstance(val, ast.expr):
                setattr(new, fname, sub(val, c, depth + 1))
            elif isinstance(val, list):
                setattr(new, fname, [sub(v, c, depth + 1) if isinstance(v, ast.expr) else _sub_kw(v, c, depth) for v in val])
            elif isinstance(val, ast.AST):
                setattr(new, fname, _sub_kw(val, c, depth))
        return new

    def _sub_kw(v: object, c: Ctx, depth: int) -> object:
        if isinstance(v, ast.keyword):
            k = ast.keyword(arg=v.arg, value=sub(v.value, c, depth + 1))
            return k
        if isinstance(v, ast.comprehension):
            raise RenderError("comprehension")
        return v

    try:
        out = sub(node, ctx, 0)
    finally:
        # sub and _sub_kw refer to each other through closure cells: a reference cycle that
        # would keep ``plan`` (and through its block the whole tree) alive until the garbage
        # collector runs. Emptying the cells breaks it.
        sub = _sub_kw = None  # type: ignore[assignment]
    if not changed[0] and ctx.depth == 0 and getattr(node, "lineno", None) is not None and getattr(node, "end_col_offset", None) is not None:
        return source_of(module, node)
    return ast.unparse(out)


def _copy_shallow(n: ast.AST) -> ast.AST:
    new = type(n)()
    for fname, val in ast.iter_fields(n):
        setattr(new, fname, val)
    for attr in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
        if hasattr(n, attr):
            setattr(new, attr, getattr(n, attr))
    return new


# --------------------------------------------------------------------------------------------
# spans


def names_read(node: ast.AST) -> set[str]:
    return {n.id for n in fast_walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def names_written(stmt: ast.stmt) -> set[str]:
    out: set[str] = set()
    targets: list[ast.expr] = []
    if isinstance(stmt, ast.Assign):
        targets = list(stmt.targets)
    elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Attribute) \
            and stmt.value.func.attr in ("mul_", "multiply_") and isinstance(stmt.value.func.value, ast.Name):
        return {stmt.value.func.value.id}  # `t.mul_(b)` changes t's value (swiglu rewrites it as `t = ...`)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        targets = [stmt.target]
    elif isinstance(stmt, (ast.If, ast.With, ast.For, ast.While, ast.Try)):
        for n in fast_walk(stmt):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, ast.Expr):
                out |= names_written(n)
        return out
    for t in targets:
        for n in fast_walk(t):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
    return out


def _is_cheap(stmt: ast.stmt) -> bool:
    """Metadata and view statements (``dt = x.dtype``, ``a, b = t.chunk(2, -1)``): re-running them
    costs no kernel, so they may stay verbatim in the fused code when their names are used later."""
    if not isinstance(stmt, ast.Assign):
        return False
    v = stmt.value
    if isinstance(v, ast.Attribute) and v.attr in ("dtype", "shape", "device", "ndim"):
        return True
    if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr in ("size", "dim", "chunk", "split", "view", "unbind"):
        return True
    return False


OTHER_BLOCK = "part of the computation is in another block (control flow)"


def plan_span(scope: Scope, root: ast.stmt, trace: Trace, reads: set[str] | None = None) -> SpanPlan | str:
    """Whole statements in ``root``'s block covering every traced statement, or why not.

    Traced statements in nested blocks count as their ancestor in the root's block (a T5-style
    ``if weight is half: cast`` is one statement of the span). Statements between the traced
    ones are kept verbatim if they do not read a dropped intermediate. A dropped intermediate
    read after the span is a near miss (``intermediate ... reused after the fused region``),
    unless its statement is cheap (dtype/shape/view), which is then kept verbatim.
    """
    idx = stmt_index(scope)
    loc = idx.block.get(id(root))
    if loc is None:
        return "statement not found"
    block, end = loc
    start = end
    members: dict[int, ast.stmt] = {id(root): root}
    for stmt in trace.stmts.values():
        cur: ast.stmt | None = stmt
        while cur is not None and idx.block.get(id(cur), (None, 0))[0] is not block:
            cur = idx.parent.get(id(cur))
        if cur is None:
            return OTHER_BLOCK
        i = idx.block[id(cur)][1]
        if i > end:
            return "part of the computation comes after its result"
        start = min(start, i)
        members[id(cur)] = cur
    span = block[start : end + 1]
    line = span[0].lineno
    end_line = root.end_lineno or root.lineno
    # whole lines only: nothing else may share the span's first or last line
    if start > 0 and (block[start - 1].end_lineno or 0) >= line:
        return "statement shares a line with another"
    if end + 1 < len(block) and block[end + 1].lineno <= end_line:
        return "statement shares a line with another"
    dropped = [s for s in span if id(s) in members and s is not root]
    kept = [s for s in span if id(s) not in members]
    live_after = _names_used_after(scope, end_line)
    root_writes = names_written(root)
    for s in list(dropped):
        for name in names_written(s):
            if name in root_writes:
                continue
            if name in live_after and _read_later(scope, idx, root, end_line, name):
                if _is_cheap(s):
                    dropped.remove(s)
                    kept.append(s)
                    break
                return f"intermediate `{name}` reused after the fused region"
    kept.sort(key=lambda s: s.lineno)
    # A kept statement runs verbatim before the fused code, so it only sees an intermediate a
    # dropped statement wrote before it; a name a dropped statement writes later still holds
    # its earlier value there, as in the original (``input_dtype = hidden_states.dtype`` above
    # ``hidden_states = hidden_states.to(torch.float32)`` in a gated RMSNorm). In a loop body the
    # next iteration's kept statement would see that later write too (never made by the fused
    # branch) unless the root statement, which the fused branch does run, writes the name.
    in_loop = any(isinstance(a, (ast.For, ast.AsyncFor, ast.While)) for a in ancestors(idx, root))
    _keep_metadata_reads_in_place(dropped, kept)
    for s in kept:
        seen: set[str] = set()
        for d in dropped:
            if d.lineno < s.lineno:
                seen |= names_written(d)
            elif in_loop:
                seen |= names_written(d) - root_writes
        clash = names_read(s) & seen
        if clash:
            return f"intermediate `{sorted(clash)[0]}` is used by another statement inside the fused region"
    dropped_ids = {id(n) for s in dropped for n in fast_walk(s) if isinstance(n, ast.stmt)}
    return SpanPlan(block, start, end, dropped, kept, line, end_line, dropped_ids)


_HEADERS = {ast.If: ("test",), ast.While: ("test",), ast.For: ("target", "iter"), ast.AsyncFor: ("target", "iter"),
            ast.With: ("items",), ast.AsyncWith: ("items",), ast.Try: ()}


def _read_later(scope: Scope, idx: StmtIndex, root: ast.stmt, end_line: int, name: str) -> bool:
    """Is ``name`` read after ``end_line`` where the value ``root``'s span leaves can reach it?

    A read in the other branch of an ``if`` holding ``root`` (eole's ``if gated: ... gate * up
    else: gate = linear(x); act(gate)``) is not, when that branch assigns the name first in the
    read's own block: also in a loop, the read then sees that assignment, never the span's value.
    Anything else read later counts (headers of compound statements included), except a read that
    a rebinding after the span always precedes (:meth:`Scope.loads_after`: reaching definition)."""
    live = {id(n) for n in scope.loads_after(name, end_line)}
    if not live:
        return False
    for s in idx.stmts:
        header = _HEADERS.get(type(s))
        if header is not None:
            nodes = [n for f in header for v in ([getattr(s, f)] if not isinstance(getattr(s, f), list) else getattr(s, f)) for n in fast_walk(v)]
        elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            nodes = list(fast_walk(s))
        else:
            nodes = list(fast_walk(s))
        if not any(id(n) in live for n in nodes):
            continue
        if _exclusive_outside_loops(idx, s, root):
            continue  # another branch of an if that no loop repeats: it never runs after the span
        if header is None and _exclusive(idx, s, root):
            d = definition(Ctx(scope, s.lineno), name)
            if d is not None and d[0] is not s and idx.block.get(id(d[0]), (None,))[0] is idx.block.get(id(s), (0,))[0] \
                    and _exclusive(idx, d[0], root):
                continue
        return True
    return False


def _names_used_after(scope: Scope, line: int) -> set[str]:
    """Names read anywhere in the scope (``ast.walk`` of its node) on a line after ``line``."""
    return {name for name, last in scope.last_loads().items() if last > line}


# --------------------------------------------------------------------------------------------
# text


def splice(module: ModuleInfo, stmt: ast.stmt, replacements: list[tuple[ast.AST, str]]) -> str:
    """The statement's source lines (dedented) with each node's text replaced; byte-exact elsewhere."""
    name = getattr(stmt, "_npufuse_arm_exit", None)
    if name is not None:  # the end of an ``if`` arm (arm_exit_root): no text of its own
        value = getattr(stmt, "value", None)
        texts = [text for node, text in replacements if node is value]
        return f"{name} = {texts[0] if texts else name}"
    lines = module_lines(module)
    first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
    raw = [ln.encode("utf-8") for ln in lines[first - 1 : last]]
    # replace right-to-left so earlier offsets stay valid
    for node, text in sorted(replacements, key=lambda r: (r[0].lineno, r[0].col_offset), reverse=True):
        l0, c0 = node.lineno - first, node.col_offset
        l1, c1 = (node.end_lineno or node.lineno) - first, node.end_col_offset or 0
        head = raw[l0][:c0]
        tail = raw[l1][c1:]
        raw[l0 : l1 + 1] = [head + text.encode("utf-8") + tail]
    text = lf_line_ends(b"".join(raw).decode("utf-8"))
    # the first line starts at the statement's column: drop that indentation from every line
    return textwrap.dedent(text).rstrip("\n")


def stmt_source(module: ModuleInfo, stmt: ast.stmt) -> str:
    return splice(module, stmt, [])


def block_source(module: ModuleInfo, stmts: list[ast.stmt]) -> str:
    """Verbatim source of consecutive statements, dedented (comments between them kept)."""
    lines = module_lines(module)
    text = lf_line_ends("".join(lines[stmts[0].lineno - 1 : (stmts[-1].end_lineno or stmts[-1].lineno)]))
    return _dedent_lines(text).rstrip("\n")


def _dedent_lines(text: str) -> str:
    """``textwrap.dedent`` that also treats a blank line holding a form feed (a page break between
    statements) as blank: textwrap counts "\x0c" as text, finds no common margin and dedents nothing,
    and ``str.splitlines`` would later split that line in two. Blank lines come out empty, as
    textwrap makes whitespace-only lines."""
    lines = text.split("\n")
    margins = [ln[: len(ln) - len(ln.lstrip(" \t"))] for ln in lines if ln.strip()]
    if not margins:
        return textwrap.dedent(text)
    common = margins[0]
    for m in margins[1:]:
        while not m.startswith(common):
            common = common[:-1]
    return "\n".join(ln[len(common):] if ln.strip() else "" for ln in lines)


_ATOMS = (ast.Name, ast.Attribute, ast.Subscript, ast.Call, ast.Constant, ast.List, ast.Dict, ast.Set,
          ast.ListComp, ast.SetComp, ast.DictComp, ast.JoinedStr)


def atom(text: str) -> str:
    """Rendered expression text made safe to paste beside an operator or before ``.attr`` in a
    template (``({e}) == "tanh"``, ``({t}).shape``): parenthesised unless it parses as an atom
    (a name, attribute, subscript, call or literal). A rendered name can stand for its definition
    (``"tanh" if flag else "none"``, ``a + b``): pasted bare, the template parses otherwise or,
    worse, means something else (``a + b.shape``)."""
    try:
        e = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return f"({text})"
    if isinstance(e, _ATOMS) and not (isinstance(e, ast.Constant) and isinstance(e.value, (int, float, complex)) and not isinstance(e.value, bool)):
        return text.strip()
    return f"({text.strip()})"


def indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + ln if ln.strip() else ln for ln in text.splitlines())


_NPU_WORD = re.compile(r"(?<![a-z0-9])npu(?![a-z0-9])")


def already_fused(module: ModuleInfo, scope: Scope, stmt: ast.stmt) -> str | None:
    """Why a site needs no rewrite: it sits in the fallback of an existing torch_npu/npufuse branch."""
    idx = stmt_index(scope)
    child: ast.stmt = stmt
    for anc in ancestors(idx, stmt):
        if isinstance(anc, ast.If):
            test = ast.unparse(anc.test).lower()
            in_else = any(s is child for s in anc.orelse) or idx.block.get(id(child), (None,))[0] is anc.orelse \
                or _contains(anc.orelse, stmt)
            # "npu" as a word of the test (torch_npu, is_npu_available, device.type == "npu"), not
            # as letters inside another word: `if adaln_input is not None:` is no NPU branch
            if (in_else or (_negated_npu_test(anc, child) and "torch_npu" in module.source)) and _NPU_WORD.search(test):
                if "_npufuse_" in test:
                    return "already rewritten by npufuse"
                return "already has a torch_npu branch"
        child = anc
    return None


def _contains(block: list[ast.stmt], stmt: ast.stmt) -> bool:
    for s in block:
        for n in fast_walk(s):
            if n is stmt:
                return True
    return False


def iter_exprs_topdown(node: ast.AST) -> Iterator[ast.expr]:
    """Expression nodes of a statement in preorder (a node before anything inside it), not into
    nested function bodies or lambdas."""
    stack: list[ast.AST] = [node]
    pop, extend = stack.pop, stack.extend
    skip, expr = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda), ast.expr
    while stack:
        n = pop()
        if n is not node and isinstance(n, skip):
            continue
        if isinstance(n, expr):
            yield n
        children = child_nodes(n)
        children.reverse()
        extend(children)


def simple_stmt(stmt: ast.stmt) -> bool:
    return isinstance(stmt, (ast.Return, ast.Assign, ast.AnnAssign, ast.Expr))


def init_assignments(module: ModuleInfo, class_name: str | None) -> dict[str, ast.expr]:
    """``self.<attr> = <value>`` in the class's ``__init__`` (last one wins), for module lookups."""
    if not class_name or class_name not in module.classes:
        return {}
    cached = module.__dict__.setdefault("_npufuse_init", {})
    if class_name in cached:
        return cached[class_name]
    out: dict[str, ast.expr] = {}
    cls = module.classes[class_name]
    for item in cls.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            for n in _stmts_in(item.body):
                if isinstance(n, ast.Assign):
                    for t in n.targets:
                        for t_el, v_el in _paired_targets(t, n.value):
                            d = dotted(t_el)
                            if d and d.startswith("self.") and d.count(".") == 1:
                                out[d[5:]] = v_el
                elif isinstance(n, ast.AnnAssign) and n.value is not None:
                    d = dotted(n.target)
                    if d and d.startswith("self.") and d.count(".") == 1:
                        out[d[5:]] = n.value
    cached[class_name] = out
    return out


def _paired_targets(target: ast.expr, value: ast.expr) -> list[tuple[ast.expr, ast.expr]]:
    """(target, value) pairs of one assignment: ``self.a, self.b = X(), Y()`` (a tuple of targets
    given a tuple of as many values, no starred element) pairs each target with its own value;
    any other tuple target binds values npufuse does not read (an unpacked call result)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        if not (isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts)
                and not any(isinstance(e, ast.Starred) for e in (*target.elts, *value.elts))):
            return []
        return [p for t, v in zip(target.elts, value.elts) for p in _paired_targets(t, v)]
    return [(target, value)]


def _stmts_in(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements of a body and its nested blocks (not nested functions/classes)."""
    for _block, _i, stmt in _walk_stmts(body):
        yield stmt


def _walk_stmts(body: list[ast.stmt]) -> Iterator[tuple[list[ast.stmt], int, ast.stmt]]:
    for i, stmt in enumerate(body):
        yield body, i, stmt
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for name in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, name, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                yield from _walk_stmts(inner)
        for handler in getattr(stmt, "handlers", []) or []:
            yield from _walk_stmts(handler.body)


def init_params(module: ModuleInfo, class_name: str | None) -> dict[str, ast.expr | None]:
    """Parameters of the class's ``__init__`` with their defaults."""
    if not class_name or class_name not in module.classes:
        return {}
    for item in module.classes[class_name].body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            a = item.args
            pos = [*a.posonlyargs, *a.args]
            defaults: list[ast.expr | None] = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
            out = {p.arg: d for p, d in zip(pos, defaults)}
            for p, d in zip(a.kwonlyargs, a.kw_defaults):
                out[p.arg] = d
            return out
    return {}


def method(module: ModuleInfo, class_name: str | None, name: str) -> ast.FunctionDef | None:
    if not class_name or class_name not in module.classes:
        return None
    for item in module.classes[class_name].body:
        if isinstance(item, ast.FunctionDef) and item.name == name:
            return item
    return None


def bind_call(module: ModuleInfo, call: ast.Call, fn: ast.FunctionDef, ctx: Ctx, is_method: bool) -> Ctx | None:
    """The context of ``fn``'s body with its parameters bound to ``call``'s arguments."""
    scope = scope_of(module, fn)
    if scope is None or ctx.depth >= 3:
        return None
    a = fn.args
    params = [p.arg for p in (*a.posonlyargs, *a.args)]
    bind: dict[str, tuple[ast.expr, Ctx]] = {}
    args = list(call.args)
    if any(isinstance(x, ast.Starred) for x in args) or any(k.arg is None for k in call.keywords):
        return None
    if is_method:
        if not params:
            return None
        recv = call.func.value  # type: ignore[union-attr]
        bind[params[0]] = (recv, ctx)
        params = params[1:]
    if len(args) > len(params):
        return None
    for p, v in zip(params, args):
        bind[p] = (v, ctx)
    kwonly = [p.arg for p in a.kwonlyargs]
    for k in call.keywords:
        if k.arg not in params and k.arg not in kwonly:
            return None
        bind[k.arg] = (k.value, ctx)  # type: ignore[index]
    defaults = dict(zip(params[len(params) - len(a.defaults) :] if a.defaults else [], a.defaults))
    for p, d in zip(kwonly, a.kw_defaults):
        if d is not None:
            defaults[p] = d
    line = fn.body[0].lineno if fn.body else fn.lineno
    hctx = Ctx(scope, line, {}, ctx.depth + 1)
    for p in params + kwonly:
        if p not in bind:
            if p in defaults:
                bind[p] = (defaults[p], hctx)
            else:
                return None
    hctx.bind = bind
    return hctx


def helper_return(fn: ast.FunctionDef) -> ast.Return | None:
    """The single ``return <expr>`` ending a small helper (straight-line body), else None."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not body or len(body) > 8:
        return None
    if not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    for s in body[:-1]:
        if not _straight(s):
            return None
    return body[-1]


def _straight(s: ast.stmt) -> bool:
    """An assignment, or an ``if`` holding only assignments (T5's "cast if the weight is half")."""
    if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        return True
    if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant):
        return True
    if isinstance(s, ast.If):
        return all(_straight(x) for x in s.body) and all(_straight(x) for x in s.orelse)
    return False


def resolve_callee(module: ModuleInfo, call: ast.Call, ctx: Ctx) -> tuple[ast.FunctionDef, bool] | None:
    """A helper defined in this module that ``call`` invokes: ``self.m(...)`` in the same class,
    or a module-level ``f(...)``."""
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" and ctx.scope.class_name:
        # s47 review: one reader (``_site_s47review.lookup``): the last ``def`` of the name, refused where a method
        # stores ``self.<m>`` (an instance attribute shadows it) or a decorator may change what the call computes
        own = _site_s47review.lookup(module, ctx.scope.class_name, f.attr, inherit=False)
        if own is not None:
            return (own[1], True) if _site_s47review.decorators(module, own[1]) == "plain" else None
        held = _method_held(module, ctx.scope.class_name, f.attr)
        if held is not None:
            return held
        m = inherited_method(module, ctx.scope.class_name, f.attr)
        return (m, True) if m is not None and _site_s47review.decorators(module, m) == "plain" else None
    if isinstance(f, ast.Name) and f.id not in ctx.bind and definition(ctx, f.id) is None:
        fn = module.helper(f.id)
        if isinstance(fn, ast.FunctionDef):
            return fn, False
    return None


def inherited_method(module: ModuleInfo, class_name: str, name: str) -> ast.FunctionDef | None:
    """s36: ``name`` as Python's attribute lookup finds it on an instance of ``class_name`` through
    base classes defined in this module (depth first along the bases, as the MRO of single
    inheritance does; the class itself first). VibeVoice's ``ConvRMSNorm(RMSNorm)`` calls the base's
    ``self._norm``. A base of another module, or a base assigning ``self.<name>`` in its
    ``__init__`` (an attribute shadowing the method), stops the lookup."""
    # s47 review: ``_site_s47review.lookup`` (the last ``def``; a store of ``self.<name>`` in any method of the
    # chain refuses it, not only one in ``__init__`` of a class below the definition; the first base only)
    found = _site_s47review.lookup(module, class_name, name)
    return found[1] if found is not None else None


def _method_held(module: ModuleInfo, class_name: str, attr: str) -> tuple[ast.FunctionDef, bool] | None:
    """The method an attribute holds: ``__init__`` sets ``self.<attr>`` once to ``self.m``, to
    ``torch.compile(self.m, ...)`` (the same function, compiled) or to a conditional choosing
    between those for one ``m`` (cosmos / torchtitan ``RMSNorm``: ``self.rmsnorm_fn =
    torch.compile(self.compute_rmsnorm, fullgraph=True) if compile else self.compute_rmsnorm``), and
    no other method of the class assigns it. A staticmethod is called without ``self``."""
    value = init_assignments(module, class_name).get(attr)
    if value is None:
        return None

    def held(v: ast.expr) -> str | None:
        if isinstance(v, ast.Call) and module.canonical(v.func) == "torch.compile" and v.args \
                and not isinstance(v.args[0], ast.Starred):
            v = v.args[0]
        d = dotted(v)
        return d[5:] if d is not None and d.startswith("self.") and d.count(".") == 1 else None

    names = {held(v) for v in ((value.body, value.orelse) if isinstance(value, ast.IfExp) else (value,))}
    if len(names) != 1 or None in names:
        return None
    name = names.pop()
    if name == attr:  # ``self._norm = torch.compile(self._norm)``: the class's own def, wrapped (the store is this one)
        last = _site_s47review._last_binding(module.classes[class_name], name)
        fn = last if isinstance(last, ast.FunctionDef) else None
    else:
        own = _site_s47review.lookup(module, class_name, name, inherit=False)  # type: ignore[arg-type]
        fn = own[1] if own is not None else None
    if fn is None:
        return None
    if attr in bound_callee.changed_outside_init(module, class_name):
        return None  # rebound after construction (s46: bound_callee's one reader)
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if fn.decorator_list and not static:
        return None
    return fn, not static


# --- norms (s25): a read in another branch of a non-repeated if never sees the span's value -----
#
# TGI / lorax ``FastRMSNorm.forward``: ``if SYSTEM == "xpu": ... elif x.shape[-1] > 8192: <the norm>
# elif SYSTEM == "cuda": kernel(x, ...)``. The cuda branch reads ``x``, but only on a call where the
# norm's branch did not run: the value the span leaves can reach it only through a loop around the
# if (the next iteration), so without an enclosing loop such a read is not a reuse.

def _exclusive_outside_loops(idx: StmtIndex, s: ast.stmt, root: ast.stmt) -> bool:
    """``s`` and ``root`` sit in different branches of one ``if`` and no loop of the scope holds ``root``."""
    if any(isinstance(a, (ast.For, ast.AsyncFor, ast.While)) for a in ancestors(idx, root)):
        return False
    return _exclusive(idx, s, root)



def _negated_npu_test(anc: ast.If, child: ast.stmt) -> bool:
    """``if not is_torch_npu_available(): <site>`` (the site in the body of a negated NPU test: the
    same fallback as an ``else``; the caller checks that the test names NPU and that the file calls
    torch_npu). ``not (flag and on_npu)`` is no such test: the site also runs on NPU when the flag
    is false, so only a negated test without ``and``/``or`` counts."""
    return (isinstance(anc.test, ast.UnaryOp) and isinstance(anc.test.op, ast.Not)
            and not isinstance(anc.test.operand, ast.BoolOp) and any(s is child for s in anc.body))


# --- s27 norms: metadata reads stay in place ---


def _is_metadata_read(stmt: ast.stmt) -> bool:
    """``dt = x.dtype`` (also ``.device``/``.shape``/``.ndim``) into one plain name: reading it runs no
    kernel and has no effect, so running it verbatim where it stands is exactly the original."""
    return isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
        and isinstance(stmt.value, ast.Attribute) and stmt.value.attr in ("dtype", "device", "shape", "ndim") \
        and isinstance(stmt.value.value, ast.Name)


def _keep_metadata_reads_in_place(dropped: list[ast.stmt], kept: list[ast.stmt]) -> None:
    """Move dropped metadata reads (``orig_dtype = x.dtype``) that a kept statement reads into ``kept``.

    vLLM's ``forward_native`` / OLMo's norms read the input dtype, then a kept statement (a residual
    branch, a conditional cast) reads that name: the fused code would otherwise lack it. The moved
    statement is itself checked by the caller like every kept one (it must not read a value a
    dropped statement wrote before it), so this is exact or refused, never wrong. Kept sorted."""
    changed = True
    while changed:
        changed = False
        wanted: set[str] = set().union(*(names_read(s) for s in kept)) if kept else set()
        for d in list(dropped):
            if not _is_metadata_read(d):
                continue
            # also when a kept statement reassigns the tensor read after the read: the fused code
            # then needs the name (the tensor's name holds another value where it runs)
            src = d.value.value.id  # type: ignore[attr-defined]
            if names_written(d) & wanted or any(s.lineno > d.lineno and src in names_written(s) for s in kept):
                dropped.remove(d)
                kept.append(d)
                changed = True
    kept.sort(key=lambda s: s.lineno)


def _version_suffix(name: str, ctx: Ctx) -> str:
    """Which assignment of an unfollowed name reaches ``ctx``: none (a parameter or global) or the
    line of a conditional one. ``orig_dtype = x.dtype`` read above ``if residual is not None:
    x = x + residual`` (vLLM's forward_native) names another tensor than ``x`` below that ``if``;
    without this both were ``$x`` and a cast back to ``orig_dtype`` looked like a no-op."""
    if ctx.depth > 0 and name in ctx.bind:
        return ""
    d = definition(ctx, name)
    return "" if d is None else f"#{d[0].lineno}"


def _reassigned_before_root(ctx: Ctx, name: str, plan: SpanPlan) -> bool:
    """Is ``name`` (unassigned where ``ctx`` stands) assigned by a statement between ``ctx.line`` and
    the span's root statement that the fused code does not drop (a kept one, or one before the span)?"""
    root = plan.block[plan.end]
    return any(ctx.line < stmt.lineno < root.lineno and not plan.is_dropped(stmt)
               for stmt, _ in ctx.scope.assignments.get(name, []))
