"""s45 (helper sweep45): rms_norm forms the s45 recall sweep found missed, read by class.

1. The trailing dims counted up to zero: ``dims = tuple(range(-len(self.normalized_shape), 0))`` (a gated RMSNorm of
   a linear-attention zoo; the same spelling as ``range(-k, 0)`` in other generic norms). The mean is over the last
   ``len(shape)`` dims, as with InternEvo's ``range(-1, -len(shape) - 1, -1)``; the fused branch runs where that
   count is 1 (the run-time check ``-len(shape) == -1``), the original elsewhere. Near misses kept: a start that is
   not ``-len(..)`` (``range(-2, 0)`` is two dims, never one), a stop other than 0, a step.
"""

from __future__ import annotations

import ast

from npufuse.patterns import _site as S
from npufuse.patterns._norm_s44h import range_call
from npufuse.scan.dataflow import const_value


def trailing_dims_counted_to_zero(dim: ast.expr, ctx: S.Ctx, trace: S.Trace) -> tuple[ast.expr, S.Ctx] | None:
    """For a name holding ``tuple(range(-len(shape), 0))`` (or ``range(-n, 0)`` with ``n = len(shape)``, ``list(..)``,
    a generator over it): ``(-len(shape), ctx)`` for the run-time check ``-len(shape) == -1``; None otherwise."""
    if not isinstance(dim, ast.Name):
        return None
    value, vctx, stmt = S.follow(dim, ctx)
    if value is dim or stmt is None:
        return None
    rng = range_call(value)
    if rng is None or len(rng.args) not in (2, 3) or const_value(rng.args[1]) != 0 \
            or len(rng.args) == 3 and const_value(rng.args[2]) != 1:
        return None
    start = rng.args[0]
    if not (isinstance(start, ast.UnaryOp) and isinstance(start.op, ast.USub)):
        return None
    count = start.operand
    if isinstance(count, ast.Name):
        count = S.follow(count, vctx)[0]
    if not (isinstance(count, ast.Call) and isinstance(count.func, ast.Name) and count.func.id == "len" and len(count.args) == 1):
        return None
    S.follow(dim, ctx, trace)
    return start, vctx
