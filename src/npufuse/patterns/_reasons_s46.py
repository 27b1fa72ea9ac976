"""s46 (helper reasons46): near-miss reasons that state only what npufuse established.

Development misses carried reasons that asserted a fact about the user's code where npufuse had only failed to
prove one: an expert loop's ``if len(rows) > 0:`` was reported as "conditional code" (an emptiness guard changes
nothing when ``rows`` are the expert's routed tokens; what npufuse could not show is that they are). The helpers
here read syntax only and return the text of a truer reason, or None where the old reason stays.
"""

from __future__ import annotations

import ast
from typing import Callable, Optional

from npufuse.patterns import _moe_s44a as s44a

# sizes whose zero-ness says "this tensor has no rows / no element": len(x), x.numel(), x.nelement(), x.shape[0],
# x.size(0). Not x.any() / x.sum(): over weights those test values (`if topk_weight.sum():`), not emptiness
_ROW_COUNT_METHODS = ("numel", "nelement")


def _counted_name(count: ast.expr) -> Optional[str]:
    """``x`` when ``count`` is a size or element count of the plain name ``x``, else None."""
    if isinstance(count, ast.Call) and isinstance(count.func, ast.Name) and count.func.id == "len" \
            and len(count.args) == 1 and not count.keywords and isinstance(count.args[0], ast.Name):
        return count.args[0].id
    if isinstance(count, ast.Call) and isinstance(count.func, ast.Attribute) and not count.keywords \
            and isinstance(count.func.value, ast.Name):
        if count.func.attr in _ROW_COUNT_METHODS and not count.args:
            return count.func.value.id
        if count.func.attr == "size" and len(count.args) == 1 and isinstance(count.args[0], ast.Constant) \
                and count.args[0].value == 0:
            return count.func.value.id
    if isinstance(count, ast.Subscript) and isinstance(count.slice, ast.Constant) and count.slice.value == 0 \
            and isinstance(count.value, ast.Attribute) and count.value.attr == "shape" \
            and isinstance(count.value.value, ast.Name):
        return count.value.value.id
    return None


def unread_emptiness_guard(test: ast.expr, strip: Callable[[ast.expr], ast.expr],
                           bound: dict[str, ast.expr]) -> Optional[str]:
    """The reason for an expert loop's ``if`` whose test says only "``x`` is (not) empty" over a plain name ``x``
    the loop analysis did not read as this expert's rows (it accepts the guard when it does): the guard is not the
    blocker, the unread ``x`` is. ``bound`` maps names to the value last stored in the loop (quoted when known).
    None for any other test (a threshold, a flag, a count of something else): "conditional code" stays."""
    norm = s44a.emptiness(test, strip)
    if norm is None:
        return None
    name = _counted_name(strip(norm[1]))
    if name is None:
        return None
    value = bound.get(name)
    source = f" (`{name} = {ast.unparse(value)[:60]}`)" if value is not None else ""
    return (f"the loop skips an expert when `{name}` is empty (`if {ast.unparse(test)[:50]}`), but npufuse does not "
            f"read `{name}`{source} as the tokens routed to this expert, so it cannot show which rows the expert takes")


def unmapped_3d_einsum(equation: str) -> str:
    """The reason for a 3-D einsum product (scores or P@V) outside the one 3-D layout attention maps. It used to say
    "not [B, S, D] attention", which is false for unbatched multi-head attention over [S, H, D] operands (HO22b
    graph-transformers ``nhd,mhd->nmh``): the code is attention, npufuse does not map that layout."""
    return (f"einsum `{equation}`: npufuse maps a 3-D product only with [B, S, D] operands whose batch letter comes "
            "first, and these operands are not laid out so")


def _handed_in(node: ast.expr, function: ast.AST) -> bool:
    """``node`` (already followed through local names) is a parameter of ``function``: a value its callers pass."""
    if not isinstance(node, ast.Name) or not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    a = function.args
    return node.id in {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}


def gate_inputs_unproven(gate: tuple[ast.expr, ast.expr], up: tuple[ast.expr, ast.expr], function: ast.AST) -> str:
    """The reason for act(gate) * up whose operands npufuse did not show to be projections of one input. ``gate`` /
    ``up``: (the operand as written, the operand followed through local names). Where both operands are parameters of
    the function (an autograd Function's ``forward(X, gate)``, a helper's argument) and its callers were not read,
    "not projections of one input" was a guess (HO12a ppl.pmx ``gate * silu(X)``, whose callers pass ``w1 x`` and
    ``w3 x``): the reason says what npufuse could not trace. Where an operand is computed in the function (Mamba's SSM
    output, a cumsum) the old reason stays: that value is no projection."""
    if not (_handed_in(gate[1], function) and _handed_in(up[1], function)):
        return "gate and up are not projections of one input (a gated output, not a GLU MLP)"
    return (f"`{ast.unparse(gate[0])[:40]}` and `{ast.unparse(up[0])[:40]}` are parameters of the function whose callers "
            "npufuse did not read, so it cannot show that gate and up are projections of one input (a GLU MLP's form)")
