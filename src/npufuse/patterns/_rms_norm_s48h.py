"""s48 ho25fix: an RMS norm whose compute dtype is chosen by a conditional on the input's dtype.

``compute_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype; x = x.to(compute_dtype)``
(HO25a jeongsu-moon mini-deepseek-v4 model.py:29). npu_rms_norm computes in float32 for fp16 / bf16 / fp32 inputs
(spec 2.1), so a cast whose dtype evaluates to float32 for each of those three input dtypes is the op's own
upcast. The conditional is evaluated here for each of them (a small evaluator over dtype constants, ``<x>.dtype``
of the cast's own operand, ==, !=, in, not in, is, and / or / not, nested if-else); other input dtypes (float64)
keep the original: the fused branch runs only under ``<x>.dtype in (float16, bfloat16, float32)``.
"""

from __future__ import annotations

import ast
from typing import Any

from npufuse.patterns import _site as S

_OPS = ("torch.float16", "torch.bfloat16", "torch.float32")
_UNKNOWN = object()


def _once(node: ast.Name, ctx: S.Ctx, stmt: ast.stmt | None) -> bool:
    """s48 precision48: a name read through its local definition must be stored exactly once in its scope (S.follow
    sees assignments only: a ``for`` / ``with`` / walrus / tuple store after the if-else would be ignored)."""
    from npufuse.patterns._rope_s48r import stored_once

    return stmt is None or stored_once(ctx.scope, node.id)


def _final(node: ast.expr, ctx: S.Ctx) -> tuple[ast.expr, S.Ctx]:
    """Through plain names only (no casts, no helper bindings)."""
    for _ in range(16):
        if not isinstance(node, ast.Name):
            break
        value, vctx, _stmt = S.follow(node, ctx)
        if value is node or not _once(node, ctx, _stmt):
            break
        node, ctx = value, vctx
    return node, ctx


def _same_value(a: ast.expr, actx: S.Ctx, b: ast.expr, bctx: S.Ctx) -> bool:
    """``a`` and ``b`` are one tensor with one dtype (S.key drops casts, so a cast on either side refuses)."""
    fa, _ = _final(a, actx)
    fb, _ = _final(b, bctx)
    if fa is fb:
        return True
    return not S.is_cast(fa) and not S.is_cast(fb) and S.key(a, actx) == S.key(b, bctx)


class _Eval:
    def __init__(self, module: Any, operand: ast.expr, octx: S.Ctx) -> None:
        self.module, self.operand, self.octx = module, operand, octx

    def value(self, node: ast.expr, ctx: S.Ctx, x_dtype: str, depth: int = 0) -> Any:
        if depth > 12:
            return _UNKNOWN
        canon = self.module.canonical(node)
        if canon in S._FLOAT_DTYPES:
            return S._FLOAT_DTYPES[canon]
        if isinstance(node, ast.Attribute) and node.attr == "dtype":
            return x_dtype if _same_value(node.value, ctx, self.operand, self.octx) else _UNKNOWN
        if isinstance(node, ast.Name):
            value, vctx, _stmt = S.follow(node, ctx)
            if value is node or not _once(node, ctx, _stmt):
                return _UNKNOWN
            return self.value(value, vctx, x_dtype, depth + 1)
        if isinstance(node, ast.IfExp):
            t = self.value(node.test, ctx, x_dtype, depth + 1)
            if t is _UNKNOWN or not isinstance(t, bool):
                return _UNKNOWN
            return self.value(node.body if t else node.orelse, ctx, x_dtype, depth + 1)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            vals = [self.value(e, ctx, x_dtype, depth + 1) for e in node.elts]
            if any(v is _UNKNOWN or not isinstance(v, str) for v in vals):
                return _UNKNOWN
            return frozenset(vals)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            v = self.value(node.operand, ctx, x_dtype, depth + 1)
            return (not v) if isinstance(v, bool) else _UNKNOWN
        if isinstance(node, ast.BoolOp):
            vals = [self.value(v, ctx, x_dtype, depth + 1) for v in node.values]
            if any(not isinstance(v, bool) for v in vals):
                return _UNKNOWN
            return all(vals) if isinstance(node.op, ast.And) else any(vals)
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left = self.value(node.left, ctx, x_dtype, depth + 1)
            right = self.value(node.comparators[0], ctx, x_dtype, depth + 1)
            op = node.ops[0]
            if not isinstance(left, str):
                return _UNKNOWN
            if isinstance(op, (ast.Eq, ast.Is)) and isinstance(right, str):
                return left == right
            if isinstance(op, (ast.NotEq, ast.IsNot)) and isinstance(right, str):
                return left != right
            if isinstance(op, ast.In) and isinstance(right, frozenset):
                return left in right
            if isinstance(op, ast.NotIn) and isinstance(right, frozenset):
                return left not in right
        return _UNKNOWN


def conditional_upcast(module: Any, cast: ast.Call, ctx: S.Ctx) -> str | None:
    """For ``<x>.to(<dtype>)`` / ``.type(<dtype>)`` whose dtype is an if-else reading ``<x>.dtype``: "f32" where it
    is float32 for each of fp16 / bf16 / fp32 inputs; a near-miss reason where it is readable but not; None where it
    is not such a cast (the caller's own reading stands)."""
    if not (isinstance(cast.func, ast.Attribute) and cast.func.attr in ("to", "type")):
        return None
    target = S.arg(cast, "dtype", 0)
    if target is None or len(cast.args) > 1:
        return None
    node, nctx = _final(target, ctx)
    if not isinstance(node, ast.IfExp):
        return None
    ev = _Eval(module, cast.func.value, ctx)
    got = {d: ev.value(node, nctx, d) for d in _OPS}
    if any(v is _UNKNOWN or not isinstance(v, str) for v in got.values()):
        return None
    if all(v == "torch.float32" for v in got.values()):
        return "f32"
    bad = ", ".join(f"{d.split('.')[-1]} -> {v.split('.')[-1]}" for d, v in got.items() if v != "torch.float32")
    return (f"the norm computes in the dtype `{ast.unparse(target)}` chooses, which is not float32 for every input "
            f"npu_rms_norm takes ({bad}), where npu_rms_norm computes in float32")


def dtype_check(x_src: str, T: str) -> str:
    return f"{x_src}.dtype in ({T}.float16, {T}.bfloat16, {T}.float32)"


def peel_hook(module: Any, cast: ast.Call, ctx: S.Ctx, dtype_checks: list | None, seen: bool) -> tuple:
    """_peel_x's reading of a cast S.cast_dtype cannot read: a conditional upcast (float32), else NoMatch / Miss."""
    from npufuse.patterns.rms_norm import Miss, NoMatch

    got = None if seen or dtype_checks is None else conditional_upcast(module, cast, ctx)
    if got is None:
        raise NoMatch
    if got != "f32":
        raise Miss(got)
    return ("torch.float32", None, ctx)


def on_first_operand(p: Any, s_name: str, x1: ast.expr, simple: bool, T: str) -> Any:
    """add_rms_norm's module-norm path tests its conditions before the add: a conditional upcast's dtype test,
    rendered on the sum's name, is read on the first operand instead (the residual stream, whose dtype the sum has
    unless the other addend is float64); a reason where the first operand is no name it can read twice."""
    text = dtype_check(s_name, T)
    if p.condition is None or text not in p.condition:
        return p
    if not simple:
        return ("its compute dtype is chosen by a conditional on the input's dtype, tested before the add on the "
                "first operand, which is no plain name npufuse can read twice")
    import dataclasses

    new = dtype_check(ast.unparse(x1), T)
    params = dict(p.params)
    if "dim_check" in params:
        params["dim_check"] = params["dim_check"].replace(text, new)
    return dataclasses.replace(p, condition=p.condition.replace(text, new), params=params)
