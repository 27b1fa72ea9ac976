"""s49 ho26misc: a norm class whose forward has two arms that are both RMS norms of the input.

``if self._use_native: return F.rms_norm(x, self.weight.shape, self.weight, self.eps)`` then a hand-written float32
RMS norm with the same weight and eps (HO26b sdx's RMSNorm, imported into the file that calls it). The rms_norm
detector reads each arm as an RMSNorm; the add_rms_norm reader took the ``if`` arm for a kernel branch and, the class
being another file's, refused the whole forward with "is not x * rsqrt(mean(x^2) + eps) * weight" (false). Both arms
compute x * rsqrt(mean(x^2) + eps) * weight in float32 and return the input's dtype, so which one runs does not
matter: the torch path is read, and the library arm is checked to use the same weight and eps (else a near miss says
the arms are not read as one). The test must be free of calls (nothing the fused code would skip could have an effect).
"""

from __future__ import annotations

import ast
from typing import Callable

from npufuse.patterns import _site as S
from npufuse.scan.dataflow import ModuleInfo, const_value, dotted, keyword


class Arms:
    def __init__(self, ret: ast.Return, test: ast.expr, weight: ast.expr, eps: ast.expr | None) -> None:
        self.ret, self.test, self.weight, self.eps = ret, test, weight, eps

    @property
    def note(self) -> str:
        return f"its forward's arm under `{ast.unparse(self.test)[:60]}` is F.rms_norm with the same weight and eps: the torch path is read"


def library_arm(module: ModuleInfo, fwd: ast.FunctionDef, mod: str, foreign: bool,
                library_forward: Callable[..., tuple[str, str] | None]) -> Arms | None:
    """The torch path of ``if <test>: return F.rms_norm(x, ..)`` followed (or ``else:``) by straight-line code ending in
    a return; None for any other forward."""
    body = [st for st in fwd.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    if not body or not isinstance(body[0], ast.If):
        return None
    head = body[0]
    rest = head.orelse if head.orelse else body[1:]
    if (head.orelse and body[1:]) or len(head.body) != 1 or not isinstance(head.body[0], ast.Return) or not rest:
        return None
    if any(isinstance(n, (ast.Call, ast.NamedExpr, ast.Lambda, ast.Await)) for n in ast.walk(head.test)):
        return None
    if len(rest) > 8 or not isinstance(rest[-1], ast.Return) or rest[-1].value is None or not all(S._straight(st) for st in rest[:-1]):
        return None
    arm = ast.FunctionDef(name=fwd.name, args=fwd.args, body=head.body, decorator_list=[], returns=None, type_comment=None,
                          lineno=fwd.lineno, col_offset=fwd.col_offset, end_lineno=head.end_lineno, end_col_offset=0)
    if library_forward(module, arm, mod, foreign) is None:
        return None
    call = head.body[0].value
    assert isinstance(call, ast.Call)
    weight = keyword(call, "weight", 2)
    if weight is None:
        return None
    return Arms(rest[-1], head.test, weight, keyword(call, "eps", 3))


def _same(a: ast.expr | None, b: ast.expr | None) -> bool:
    if a is None or b is None:
        return False
    ca, cb = const_value(a), const_value(b)
    if isinstance(ca, (int, float)) and isinstance(cb, (int, float)):
        return float(ca) == float(cb)
    return dotted(a) is not None and dotted(a) == dotted(b)


def differ(match: object, arms: Arms, cls: str) -> str | None:
    """None where the torch path's reading (one weight factor, its eps) uses the library arm's weight and eps; else
    the reason the two arms are not one computation."""
    weights = [o for o in getattr(match, "ops", []) if o.kind in ("mul", "condmul")]
    core = getattr(match, "core", None)
    if len(weights) == 1 and core is not None and _same(weights[0].node, arms.weight) and _same(core.eps, arms.eps):
        return None
    return (f"norm {cls}'s forward has two arms under `{ast.unparse(arms.test)[:60]}` (F.rms_norm, and a hand-written "
            "norm) that are not read as using the same weight and eps: the fused call would compute one of them, and "
            "which one runs is not known")
