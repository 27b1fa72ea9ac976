"""s51 (late51misc, HO28b ``RMSNormND``): the reason for an RMS over every non-batch dim.

``dim = tuple(range(1, x.ndim)); x / sqrt(x.pow(2).mean(dim, keepdim=True) + eps) * w.view(1, -1, 1, ..)`` (an N-D
RMSNorm over channels and space) was refused as "mean over dim `dim`, a run-time value": the value is no run-time
mystery, it is read from the expression (dims 1 .. rank-1 of the squared tensor), and a literal ``(1, 2, 3)`` was
called "a run-time value" too. npu_rms_norm normalises over the trailing ``gamma.dim()`` dims of x (spec), so this
norm is the op only with the per-channel weight expanded to ``x.shape[1:]`` as gamma; npufuse's rewrite takes gamma
of the last dim's size, so the site is refused, now with what the code computes.
"""

from __future__ import annotations

import ast

from npufuse.patterns import _site as S
from npufuse.patterns._norm_s44h import _rank_of, range_call
from npufuse.scan.dataflow import const_value

_WHY = ("npu_rms_norm normalises the trailing gamma.dim() dims, so it matches only with the weight expanded to the "
        "normalised dims' full shape as gamma, a form npufuse does not build (its gamma is one row of the last dim)")


def _literal_dims(value: ast.expr) -> list[int] | None:
    if isinstance(value, (ast.Tuple, ast.List)) and value.elts:
        dims = [const_value(e) for e in value.elts]
        if all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            return dims  # type: ignore[return-value]
    return None


def dims_reason(dim: ast.expr, ctx: S.Ctx, squared_key: str) -> str | None:
    """The reason for a mean over ``dim`` where it is read: every dim from 1 to the squared tensor's rank
    (``tuple(range(1, x.ndim))``, ``list(range(1, x.dim()))``, through one local name) or a literal tuple / list of ints
    (``(1, 2, 3)``). None where ``dim`` is neither (the caller's reason stands)."""
    value, vctx = dim, ctx
    if isinstance(dim, ast.Name):
        value, vctx, stmt = S.follow(dim, ctx)
        if value is dim or stmt is None:
            return None
    literal = _literal_dims(value)
    if literal is not None:
        if len(literal) > 1 and 0 not in literal:
            return f"mean over dims {tuple(literal)} (several dims, not the last one alone); {_WHY}"
        return None  # one dim (the last one for some rank) or dim 0: the caller's reason stands
    rng = range_call(value)
    if rng is None or len(rng.args) != 2 or const_value(rng.args[0]) != 1:
        return None
    t = _rank_of(rng.args[1])
    if t is None or S.key(t, vctx) != squared_key:
        return None
    return (f"mean over `{ast.unparse(value)}`: every non-batch dim of `{ast.unparse(t)}` (dims 1 .. rank-1, the "
            f"last dim alone only for a 2-D input); {_WHY}")
