"""s47 review (helper review47): the GLU reason "gate and up are not projections of one input (a gated output, not a
GLU MLP)" (s46 ``_reasons_s46.gate_inputs_unproven``'s fallback) was said wherever an operand was not READ as a
projection, also where both operands are matrix products npufuse has no reading for: a stacked weight
(``gu = torch.einsum('bd,kdh->kbh', x, w); silu(gu[0]) * gu[1]``), ``torch.addmm(b, x, w)``, ``torch.baddbmm``,
``torch.tensordot``. Those are projections of one input; the reason asserted the opposite. Where neither operand was
read as a projection of some input and both hold such a product (through local names), the reason now says what
npufuse established: it does not read them as projections, so it cannot show the GLU form. Operands read as
projections of two different inputs keep the old reason (true there).
"""

from __future__ import annotations

import ast
from typing import Any, Optional

_PRODUCTS = frozenset({"matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "einsum", "linear", "tensordot", "addmv", "mv"})


def _holds_product(node: ast.expr, ctx: Any, peel: Any, depth: int = 0) -> bool:
    """``node`` computes a matrix product of its own or reads a local name that does (three names deep)."""
    for n in ast.walk(node):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult):
            return True
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in _PRODUCTS:
                return True
        if isinstance(n, ast.Name) and depth < 3:
            value, vctx = peel(n, ctx)
            if value is not n and _holds_product(value, vctx, peel, depth + 1):
                return True
    return False


def unread_products(a: ast.expr, actx: Any, b: ast.expr, bctx: Any, ia: Optional[str], ib: Optional[str], peel: Any) -> Optional[str]:
    """The reason where neither operand was read as a projection (``ia`` / ``ib``: the input keys found, None where
    none) and both hold matrix products; None otherwise (the caller's reason stands)."""
    if ia is not None or ib is not None:
        return None
    if not (_holds_product(a, actx, peel) and _holds_product(b, bctx, peel)):
        return None
    return (f"`{' '.join(ast.unparse(a).split())[:40]}` and `{' '.join(ast.unparse(b).split())[:40]}` are matrix products "
            "that npufuse does not read as projections of one input (a stacked or biased product of a form it has no "
            "reading for), so it cannot show the GLU MLP's form")


_BIAS_FIRST = frozenset({"addmm", "baddbmm", "addbmm", "addmv"})


def bias_first_input(n: ast.expr) -> Optional[ast.expr]:
    """The input of ``torch.addmm(bias, x, w)`` (``baddbmm`` / ``addbmm`` / ``addmv``): the second argument. The
    projection reader took every call's first argument as its input, so two biased projections of one ``x`` with
    their own biases were read as projections of two inputs (the bias) and given the false "not projections of one
    input". The method form ``bias.addmm(x, w)`` has the input first already."""
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _BIAS_FIRST \
            and isinstance(n.func.value, ast.Name) and n.func.value.id in ("torch", "th") and len(n.args) >= 3 \
            and not any(isinstance(a, ast.Starred) for a in n.args[:3]):
        return n.args[1]
    return None
