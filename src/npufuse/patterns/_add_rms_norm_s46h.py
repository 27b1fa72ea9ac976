"""s46 (ho23fix46): a residual add and its RMS norm separated by an ``if`` testing only the sum's dtype.

HO23a LexiMind (a T5-style encoder layer)::

    x = x + self.dropout1(attn_out)
    if x.dtype == torch.float16 or x.dtype == torch.bfloat16:   # clamp half-precision overflow
        clamp_value = torch.finfo(x.dtype).max - 1000
        x = torch.clamp(x, min=-clamp_value, max=clamp_value)
    x_norm = self.norm2(x)

The ``if`` changes the sum where it runs, so the fused add + norm is exact only where it does not. Its test reads the
sum, but only its dtype, which the operands fix before the add: ``torch.result_type(x1, x2)`` is the dtype of
``x1 + x2``. The fused code evaluates the operands once (as it does anyway), tests that dtype, and where the test holds
runs the original statements on those operands (the add, the ``if``, the norm as written); elsewhere the fused add +
norm. The test must be pure (no calls but ``type`` / ``isinstance`` / ``len``) and read nothing else the add, its
aliases or the ``if`` assign.
"""

from __future__ import annotations

import ast
import copy
from typing import Callable, Iterator, Optional


def reads_only_sum_dtype(test: ast.expr, s_name: str, written: set[str]) -> bool:
    """The test reads ``s_name`` only as ``s_name.dtype``, at least once, and no other name in ``written``."""
    dtype_reads = {id(n.value) for n in ast.walk(test) if isinstance(n, ast.Attribute) and n.attr == "dtype"
                   and isinstance(n.value, ast.Name) and n.value.id == s_name}
    names = [n for n in ast.walk(test) if isinstance(n, ast.Name)]
    if not dtype_reads:
        return False
    for n in names:
        if n.id == s_name and id(n) not in dtype_reads:
            return False  # the sum's values or shape: not known before the add
        if n.id != s_name and n.id in written:
            return False
    return True


class _SumDtype(ast.NodeTransformer):
    def __init__(self, s_name: str, dtype_src: ast.expr) -> None:
        self.s_name, self.dtype_src = s_name, dtype_src

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        if node.attr == "dtype" and isinstance(node.value, ast.Name) and node.value.id == self.s_name:
            return copy.deepcopy(self.dtype_src)
        return self.generic_visit(node)


def test_on_operands(test: ast.expr, s_name: str, x1: str, x2: str, torch_name: str = "torch") -> Optional[str]:
    """The test's source with ``s_name.dtype`` read as ``torch.result_type(x1, x2)`` (the dtype ``x1 + x2`` has);
    None when the operand texts do not parse as expressions."""
    try:
        dtype_src = ast.parse(f"{torch_name}.result_type({x1}, {x2})", mode="eval").body
    except SyntaxError:
        return None
    return ast.unparse(_SumDtype(s_name, dtype_src).visit(copy.deepcopy(test)))


def dtype_arm(pre: list[str], fused: list[str], test: str, s_name: str, x1: str, x2: str, between: str) -> list[str]:
    """The fused body with the dtype arm first: where the test holds, the add on the operands evaluated once, then the
    statements after it up to the norm as written (``between``); the fused add + norm otherwise."""
    arm = f"{s_name} = {x1} + {x2}\n{between}"
    return [*pre, f"if {test}:", "    # the branch between the add and the norm runs for this dtype: the original statements",
            *("    " + ln if ln else ln for ln in arm.splitlines()), "else:",
            *("    " + ln if ln else ln for ln in "\n".join(fused).splitlines())]


# -- the add ending one ``with`` block, the norm starting the next (HO23b supervoice-vall-e-2) -------------------------
#
#     with record_function("attention:post"):
#         ...
#         y = residual + y
#         residual = y
#     with record_function("attention:post-post"):
#         y = self.mlp_ln(y)
#
# The fused add + norm replaces one span of statements of one block; here the two statements sit in two blocks, so no
# rewrite is made. Reported as a near miss with that reason (there was none: the site was silently skipped).

def _is_sum_alias(stmt: ast.stmt, name: str) -> bool:
    return isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
        and isinstance(stmt.value, ast.Name) and stmt.value.id == name


def add_and_norm_in_two_with_blocks(stmts: list[ast.stmt], block_of: Callable[[ast.stmt], tuple[list[ast.stmt], int]],
                                    is_sum: Callable[[ast.expr], bool],
                                    is_rms_norm_of: Callable[[ast.Call, str], bool]) -> Iterator[tuple[ast.stmt, str]]:
    """(norm statement, reason) for each ``with`` block ending with a residual sum (then only aliases of it) right
    before a ``with`` block whose first statement calls an RMS norm on the sum's name."""
    for w1 in stmts:
        if not (isinstance(w1, (ast.With, ast.AsyncWith)) and w1.body):
            continue
        body = w1.body
        k = len(body) - 1
        while k > 0 and _is_sum_alias(body[k], _target(body[k - 1]) or ""):
            k -= 1
        add = body[k]
        name = _target(add)
        if name is None or not is_sum(add.value) or not all(_is_sum_alias(a, name) for a in body[k + 1:]):  # type: ignore[attr-defined]
            continue
        block, i = block_of(w1)
        w2 = block[i + 1] if i + 1 < len(block) else None
        if not (isinstance(w2, (ast.With, ast.AsyncWith)) and w2.body and isinstance(w2.body[0], ast.Assign)):
            continue
        first = w2.body[0]
        if any(isinstance(c, ast.Call) and is_rms_norm_of(c, name) for c in ast.walk(first.value)):  # type: ignore[attr-defined]
            yield first, (f"the residual add (line {add.lineno}) ends one `with` block and the RMS norm of its sum (line "
                          f"{first.lineno}) starts the next (`{ast.unparse(w2.items[0].context_expr)[:50]}`): npufuse "
                          "rewrites one span of one block, and a fused add + norm would move the add into the next block")


def _target(stmt: ast.stmt) -> Optional[str]:
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id
    return None
