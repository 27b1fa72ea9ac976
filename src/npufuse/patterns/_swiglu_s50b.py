"""s50 ho27misc2: a learned bias added to the gate half before the activation (HO27b POEM's depth FFN).

``gate, up = self.proj(x).chunk(2, dim=-1); b = self.table.weight[int(step)][None, None, :]; y = F.silu(gate + b) *
up``. The elementwise-transform reading (s27) already takes ``act(gate + b) * up`` as
``npu_swiglu(cat([gate + b, up], -1))`` (exact whenever the two operands have one shape, tested at run time from the
names' shapes). Two things kept it from this spelling:
- the bias was read with ``int(step)`` in it, and a call made it "not independent of the operands"; ``int`` /
  ``float`` / ``bool`` of one value compute nothing from a tensor operand (the names they read are still checked);
- the halves' statement (``gate, up = ...chunk(2)``) joined the replaced span, so the fused code computed the
  projection twice inline and the shape test had no name to read. It now stays verbatim before the fused code, where
  it binds only the two halves and nothing else in the span writes what it reads.
The cost (a torch.cat copy of both halves, the bias add staying as written) is the model's two-operand cat form; the
finding's value says it (``source = "transformed_halves"``).
"""

from __future__ import annotations

import ast

from npufuse.patterns import _site as S

# builtins converting one value to a Python number: they read their argument only
PURE_CONVERSIONS = frozenset(("int", "float", "bool"))


def conversion(call: ast.Call) -> bool:
    """``int(step)``: one positional argument to a number conversion (its argument's names are checked by the caller)."""
    return isinstance(call.func, ast.Name) and call.func.id in PURE_CONVERSIONS and len(call.args) == 1 and not call.keywords \
        and not isinstance(call.args[0], ast.Starred)


def keep_halves_outside(trace: S.Trace, names: list[ast.Name], ctx: S.Ctx) -> bool:
    """Take the statement binding the two halves (``gate, up = t.chunk(2, -1)``) out of the replaced span: it then runs
    as written and the fused code reads the names. Only where it binds exactly those names and no other statement of the
    span writes a name it reads (it would run before them now). True where it was taken out, was not in the span, or
    the names are not bound by one statement; False where it is in the span and must stay there."""
    if len(names) != 2 or names[0].id == names[1].id:
        return True  # not two names of one statement: nothing to take out (the older reading stands)
    defs = [S.definition(ctx, n.id) for n in names]
    if any(d is None for d in defs) or defs[0][0] is not defs[1][0]:  # type: ignore[index]
        return True
    stmt = defs[0][0]  # type: ignore[index]
    if id(stmt) not in trace.stmts:
        return True
    if any(st.lineno <= stmt.lineno for k, st in trace.stmts.items() if k != id(stmt)):
        return False  # a statement of the span before it: the span would still hold it
    if S.names_written(stmt) != {n.id for n in names}:
        return False
    others = set().union(*(S.names_written(st) for k, st in trace.stmts.items() if k != id(stmt)))
    if S.names_read(stmt) & others:
        return False
    del trace.stmts[id(stmt)]
    return True


def parts_of(sa: tuple | None, sb: tuple | None) -> str | None:
    """How the two transformed operands come from one tensor (for the risk and the value's text), None for two
    projections."""
    if sa is None or sb is None:
        return None
    return {"part": "chunk", "sized": "split"}.get(sa[5], str(sa[5]))


def cat_text(params: dict, units_after: int, units_before: int) -> str:
    """The value's words for the cat form of transformed halves (the transforms stay as written and are not counted)."""
    what = params.get("operands")
    if not what:
        return ""
    return (f" plus a torch.cat copy of the {what} (gate and up are transformed after the projection, so the fused op "
            f"cannot take the projection itself): ~{units_after}·T·I moved against ~{units_before}·T·I before, slower as written")
