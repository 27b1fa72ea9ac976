"""s44 (helper normopt44): gate and up as the two leading rows of one tensor (swiglu / geglu).

A projection whose output stacks gate and up on a leading dim of size 2 (tapnet's TAPNext ``MLPBlock``:
``out = self.ffw_up(x)``, an einsum ``...td,cdD->c...tD`` with c = 2, then ``gelu(out[0]) * out[1]``). ``out[0]`` and
``out[1]`` are the two halves of ``out[:2]`` along dim 0, so::

    act(T[0]) * T[1]  ==  npu_geglu(T[:2], dim=0, activate_left=True)[0].squeeze(0)     (npu_swiglu alike)

exactly, whatever T's size along dim 0 (``T[:2]`` is a view: no copy, contiguous when T is), with nothing
concatenated. ``T[1]`` activated and ``T[0]`` the other factor is the same pair with the gate second. The operands
must index one tensor by the integers 0 and 1 on its first dim only (``T[0]``, ``T[1]``), T the output of one of the
module's submodules (``self.ffw_up(x)``): rows of a reshaped input (``x.view(b, 2, -1)``) or of a parameter are batch
rows, not a stacked pair (swiglu's Keep ``rows_of_a_batch_not_a_pair``). A submodule returning a list or tuple
indexed so is no tensor, so the fused expression runs only where ``isinstance(T, torch.Tensor)`` holds at run time
(the original product otherwise), and T must be a plain name live at the product (checking it never computes it
twice).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from npufuse.patterns import _site as S
from npufuse.scan.dataflow import const_value

LEADING_PAIR = "leading_pair"  # Halves.how of this reading


@dataclass
class LeadingPair:
    tensor: ast.expr  # T as written at the operand (a name)
    ctx: S.Ctx
    gate_index: int  # 0: the activation is on T[0]


def _row(node: ast.expr, ctx: S.Ctx) -> tuple[ast.expr, S.Ctx, int] | None:
    """(T, its ctx, i) where ``node`` is, through names, ``T[i]`` with i the integer 0 or 1 and T a name."""
    n, c = S.peel(node, ctx)
    if not isinstance(n, ast.Subscript) or not isinstance(n.value, ast.Name):
        return None
    i = const_value(n.slice)
    if type(i) is not int or i not in (0, 1):
        return None
    return n.value, c, i


# calls returning a tuple of tensors (their parts are read by the split readings, not as rows)
_SEQUENCE_CALLS = frozenset(("chunk", "split", "tensor_split", "unbind", "hsplit", "vsplit", "dsplit"))


def _sequence_call(node: ast.expr) -> bool:
    f = node.func if isinstance(node, ast.Call) else None
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name in _SEQUENCE_CALLS


def _module_output(node: ast.expr) -> bool:
    """``self.<attr>(...)`` / ``self.<attr>[i](...)``: the output of one of the module's own submodules (the projection
    that stacks gate and up), not a tensor method's result nor an input."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    while isinstance(f, (ast.Attribute, ast.Subscript)):
        f = f.value
    return isinstance(f, ast.Name) and f.id == "self" and not isinstance(node.func, ast.Name)


def leading_pair(a: ast.expr, actx: S.Ctx, b: ast.expr, bctx: S.Ctx) -> LeadingPair | None:
    """The pair when the activated operand ``a`` and the other factor ``b`` are ``T[0]`` and ``T[1]`` (either way
    round) of one tensor name T; None otherwise."""
    ra, rb = _row(a, actx), _row(b, bctx)
    if ra is None or rb is None or ra[2] == rb[2]:
        return None
    if S.key(ra[0], ra[1]) != S.key(rb[0], rb[1]):
        return None
    built, _ = S.peel(ra[0], ra[1])
    if not _module_output(built) or _sequence_call(built):
        # a parameter, a view (``x.view(b, 2, -1)[0]`` is a batch row), a Python sequence: no stacked projection
        return None
    return LeadingPair(ra[0], ra[1], ra[2])


def fused_rows(tensor: str, op_call: str, original: str, T: str) -> str:
    """The fused expression over ``tensor[:2]`` on dim 0 (``op_call`` holds ``{t}`` for it), squeezed back to one row,
    taken only where ``tensor`` is a tensor; ``original`` (the product as written) otherwise."""
    if not tensor.isidentifier():
        raise S.RenderError(f"the rows' tensor `{tensor}` is no plain name: testing it would compute it twice")
    fused = op_call.format(t=f"{tensor}[:2]") + ".squeeze(0)"
    return f"({fused} if isinstance({tensor}, {T}.Tensor) else {original})"
