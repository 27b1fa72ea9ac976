"""s43 (helper ho20fix43): swiglu readings the s43 blind judge found missed, read by class.

1. Two projections built by identical constructor calls (``to_gate = nn.Linear(w, h, bias=False)``;
   ``to_value = nn.Linear(w, h, bias=False)``, a script's or a function's local modules): the value key resolves
   names to their definitions, so ``to_gate(t)`` and ``to_value(t)`` had one key and ``silu(gate) * up`` was
   refused as "gate and up are one value". Two construction statements make two objects: the values differ.
2. An activation object bound to a local name of the function (or of a script's ``if __name__ == "__main__":``
   block) and called there: ``nonlin = nn.SiLU()`` (or chosen by ``if act_name == "silu": nonlin = nn.SiLU() else: raise``),
   then ``nonlin(g) * u``. Only a name the scope binds once, in straight code or in ``if`` arms whose other arm
   always leaves (raise / return): every path reaching the call took that binding.
3. The module's own statements (a script, an ``if __name__ == "__main__":`` demo) are read like a function's. A
   name such a span binds is a global: a function of the file may read it later, which the scope's own reads do
   not show; a span binding a name any function or class body of the file reads is a near miss saying so.
"""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from typing import Any

from npufuse.patterns import _site as S
from npufuse.patterns.base import NearMiss
from npufuse.scan.dataflow import ModuleInfo, Scope, dotted, fast_walk


def _constructs(value: ast.expr) -> bool:
    """``nn.Linear(...)`` / ``Linear(...)`` / ``MyMLP(...)``: a call of a class (by the naming convention: its last
    name starts with a capital letter), which makes a new object each time it runs."""
    if not isinstance(value, ast.Call):
        return False
    name = dotted(value.func) or ""
    last = name.rpartition(".")[2]
    return bool(last) and last[0].isupper()


def _constructions(node: ast.expr, ctx: S.Ctx, seen: set[int], out: set[int], depth: int = 0) -> None:
    """ids of the statements constructing an object (``_constructs``) that ``node``'s value reads, through names."""
    if depth > 12:
        return
    for n in fast_walk(node):
        if not isinstance(n, ast.Name) or id(n) in seen:
            continue
        seen.add(id(n))
        value, vctx, stmt = S.follow(n, ctx)
        if stmt is None or value is n:
            continue
        if _constructs(value):
            out.add(id(stmt))
        _constructions(value, vctx, seen, out, depth + 1)


def distinct_objects(a: ast.expr, actx: S.Ctx, b: ast.expr, bctx: S.Ctx) -> bool:
    """Do ``a`` and ``b``, of one value key, read objects made by different construction statements (two
    ``nn.Linear`` built alike)? Then they are two values, not one."""
    left: set[int] = set()
    right: set[int] = set()
    _constructions(a, actx, set(), left)
    _constructions(b, bctx, set(), right)
    return left != right


def _exits(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Raise, ast.Return))


def sole_local_value(ctx: S.Ctx, name: str) -> ast.expr | None:
    """The value of ``name`` where ``ctx`` reads it, when the scope binds the name once (``name = value``) and
    every path reaching the read ran that binding (see 2. above); None otherwise."""
    binds = ctx.scope.assignments.get(name, [])
    if len(binds) != 1 or name in ctx.bind:
        return None
    stmt, value = binds[0]
    if value is None or stmt.lineno >= ctx.line or not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                                                        and isinstance(stmt.targets[0], ast.Name)):
        return None
    idx = S.stmt_index(ctx.scope)
    use = idx.by_line.get(ctx.line)
    use_anc = {id(a) for a in S.ancestors(idx, use)} if use is not None else set()
    child: ast.stmt = stmt
    for anc in S.ancestors(idx, stmt):
        if id(anc) in use_anc:
            break  # the read sits in this block too: the binding ran before it on its path
        if not isinstance(anc, ast.If):
            return None  # a loop, a with / try block: not read here
        other = anc.orelse if any(s is child for s in anc.body) else anc.body
        if not _exits(other):
            return None  # the other arm falls through to the read without the binding
        child = anc
    return value


def module_statements_multiply(module: ModuleInfo, scope: Scope, words: tuple[str, ...]) -> bool:
    """Does a statement of the module's own (not a def, class or import) hold one of the product spellings ``words``
    on its lines? The cheap gate before the module scope is read for a gated product."""
    lines = S.module_lines(module)
    return any(w in ln for st in S.stmt_index(scope).stmts
               if not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom, ast.If, ast.With,
                                      ast.For, ast.While, ast.Try))
               for ln in lines[st.lineno - 1 : st.end_lineno or st.lineno] for w in words)


def _names_read_in_bodies(module: ModuleInfo) -> set[str]:
    """Names loaded anywhere inside the file's function and class bodies (memoised per file)."""
    cached = module.__dict__.get("_npufuse_s43_body_reads")
    if cached is None:
        cached = {n.id for st in module.tree.body if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  for n in fast_walk(st) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        module.__dict__["_npufuse_s43_body_reads"] = cached
    return cached


def _bound_on_the_fused_path(fused: str) -> set[str]:
    """Names the fused branch (the first arm of the replacement's ``if``) binds; none where it does not parse (the span is then refused: conservative)."""
    try:
        tree = ast.parse(textwrap.dedent(fused))
    except SyntaxError:
        return set()
    head = tree.body[0] if tree.body else None
    body = head.body if isinstance(head, ast.If) else tree.body
    return {n.id for st in body for n in fast_walk(st) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def module_level_result(module: ModuleInfo, scope: Scope, result: Any) -> Any:
    """``result`` (a GateResult of the module's own statements), or a near miss in its place where the finding's
    span binds a global that a function or class body of the file reads (see 3. above)."""
    f = result.finding
    if f is None:
        return result
    written = {n.id for st in S.stmt_index(scope).stmts if f.line <= st.lineno <= f.end_line
               for n in fast_walk(st) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    shared = written & _names_read_in_bodies(module)
    if shared:
        shared -= _bound_on_the_fused_path(f.fused)
    if not shared:
        return result
    reason = (f"module-level statements: `{sorted(shared)[0]}`, an intermediate the fused code no longer binds, is a global "
              "that a function or class of this file reads")
    return dataclasses.replace(result, finding=None, miss=NearMiss(f.pattern, f.qualname, f.line, f.end_line, reason))
