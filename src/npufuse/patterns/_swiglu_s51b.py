"""s51 (helper ``sweep51b``): SSM output gates ``y * silu(z)`` as ``npu_swiglu(torch.cat([z, y], -1))``.

Mamba-style blocks split an input projection into the scan's input and a gate ``z``, run the scan, and gate its output:
``y = y * F.silu(z)`` (``z * torch.sigmoid(z)`` written out alike). y and z are two separate tensors (y is no
projection), so no split of one projection feeds npu_swiglu; but ``npu_swiglu(cat([z, y], -1), dim=-1)`` splits its
input into halves A = z and B = y along the last axis and returns ``silu(A) * B`` (spec 3.1): the same product,
exactly, wherever z and y have one shape (at least one axis) and one floating dtype the op takes (fp32 / fp16 / bf16).
Those are tested at run time (metadata only, no sync) together with ``isinstance(y, torch.Tensor)``; the original code
runs otherwise. The cat copies both tensors, which the finding's value states ("slower as written" by the cost model,
as s50's gate-bias cat form).

What is read as such a gate (the older reasons stand elsewhere):
- the activation is silu proper (not a config-chosen one, not a sigmoid gate, not a swish with another beta);
- the gate is a name, or a basic-index view of one (``z[:, 0]``: constants and slices only), whose value comes from a
  part of a chunk / split (the input projection's), possibly rebound in place of itself first (``z = z.view(...)``,
  ``z = z * keep``); a per-step index (``z[:, t]`` in a Python scan loop) is not read;
- the other factor is a name that is no part of that same split (those are the older two-halves readers').
Near misses (true reasons): a gate given a new axis (``z[..., None]``, ``z.unsqueeze(-1)``: a broadcasting gate, equal
in shape to y only if y has that size-1 axis too); a factor bound to a number (``g = 0.5; g * silu(z)``). A product of
the gate's own tensor (``z * silu(z)``) and sigmoid gates keep the older readers' answers.
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Optional

from npufuse.patterns import _site as S

NOTE = ("SSM output gate: y (the scan's output) and z (a part of the input projection) are two tensors, so npu_swiglu "
        "takes them concatenated as [z, y] (silu on the first half): exact where both have one shape and one dtype the "
        "op takes (fp32 / fp16 / bf16), tested at run time; the original code runs otherwise")

RISK = ("torch.cat copies the gate and the SSM output (2 reads and 2 writes of the gated size) before npu_swiglu: the "
        "fused form moves more memory than silu + mul as written (see the value); a win needs the in_proj's gate part "
        "and the scan output written into one buffer upstream, which npufuse does not do")

OPERANDS = "SSM output and its gate (two separate tensors)"


def _basic_index(sl: ast.expr) -> bool:
    """Constants and slices of constants only (``[:, 0]``): a view whose value depends on nothing else."""
    parts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
    for p in parts:
        if isinstance(p, ast.Slice):
            if any(x is not None and not isinstance(x, ast.Constant) and not (isinstance(x, ast.UnaryOp) and isinstance(x.operand, ast.Constant))
                   for x in (p.lower, p.upper, p.step)):
                return False
        elif isinstance(p, ast.Constant) and (isinstance(p.value, int) and not isinstance(p.value, bool)):
            continue
        elif isinstance(p, ast.UnaryOp) and isinstance(p.operand, ast.Constant):
            continue
        elif isinstance(p, ast.Constant) and p.value is Ellipsis:
            continue
        else:
            return False
    return True


def _adds_axis(node: ast.expr) -> bool:
    """``z[..., None]`` / ``z.unsqueeze(d)``: a gate given a new axis (it broadcasts over the other factor)."""
    if isinstance(node, ast.Subscript):
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return any(isinstance(p, ast.Constant) and p.value is None for p in parts)
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "unsqueeze"


def _split_origin(module: Any, name: ast.Name, ctx: S.Ctx, split_of: Callable, avoid: frozenset = frozenset()) -> Optional[tuple]:
    """The split part ``name`` holds (through rebindings of the name by an expression of itself that reads none of
    ``avoid``: a gate rebound from the other factor, ``z = z * y``, is no gate of y), or None."""
    n, c = name, ctx
    for _ in range(6):
        part = split_of(module, n, c, S.Trace())
        if part is not None:
            return part
        d = S.definition(c, n.id)
        if d is None:
            return None
        stmt, value = d
        reads = {x.id for x in ast.walk(value) if isinstance(x, ast.Name)}
        if n.id not in reads or reads & avoid:
            return None
        n, c = ast.Name(n.id, ast.Load()), c.at(stmt.lineno)  # the earlier value of the same name
    return None


def output_gate(module: Any, act_kind: str, silu: str, a: ast.expr, actx: S.Ctx, b: ast.expr, ctx: S.Ctx,
                split_of: Callable) -> Optional[str]:
    """``y * silu(z)`` read as an SSM output gate: "gate" where it is one; None where it is not (the older reason
    stands); raises ValueError with a near-miss reason for a gate that provably cannot be one half of two."""
    if act_kind != silu or not isinstance(b, ast.Name):
        return None
    gate = a
    if _adds_axis(gate):
        base = gate.value if isinstance(gate, ast.Subscript) else gate.func.value  # type: ignore[union-attr]
        if isinstance(base, ast.Name) and _split_origin(module, base, actx, split_of) is not None:
            raise ValueError(f"the gate `{ast.unparse(gate)[:40]}` is given a new axis of size 1 (a broadcasting gate): its shape "
                             f"equals `{b.id}`'s only where that has a size-1 axis there too, which npufuse does not show; "
                             "npu_swiglu takes two equal halves of one tensor")
        return None
    if isinstance(gate, ast.Subscript) and isinstance(gate.value, ast.Name) and _basic_index(gate.slice):
        base = gate.value
    elif isinstance(gate, ast.Name):
        base = gate
    else:
        return None
    if base.id == b.id:
        return None  # x * silu(x): no pair (the older readers say so)
    part = _split_origin(module, base, actx, split_of, frozenset((b.id,)))
    if part is None:
        return None
    held, _c = S.peel(b, ctx)
    if isinstance(held, ast.Constant) or (isinstance(held, ast.UnaryOp) and isinstance(held.operand, ast.Constant)):
        raise ValueError(f"`{b.id}` holds a number (`{ast.unparse(held)[:20]}`), not a tensor: silu(z) scaled by a constant is "
                         "no pair of halves npu_swiglu takes")
    other = split_of(module, b, ctx, S.Trace())  # its value as it reaches the product (``a = ssm(a)`` is no split part)
    if other is not None and other[0] == part[0]:
        return None  # two parts of one split: the older readers'
    if isinstance(held, ast.Subscript):
        sliced, sctx = S.peel(held.value, _c)
        if S.key(sliced, sctx) == part[0]:
            return None  # another slice of the gate's own tensor (``p[..., d:3 * d]``): the older readers' (no proven pair)
    return "gate"


def untrace_splits(trace: S.Trace, read: Callable[[S.Trace], Any]) -> None:
    """Take the split statements the two-halves reading traced (``u, z = proj(x).chunk(2, -1)``) out of the span: the
    gate is read by name, so they run as written before the fused code (the scan's input is read elsewhere too)."""
    t = S.Trace()
    read(t)
    for k in t.stmts:
        trace.stmts.pop(k, None)


def run_test(gate: str, up: str, torch_name: str) -> str:
    """The fused branch's condition (metadata reads only): one shape of at least one axis, one dtype the op takes."""
    g, u = S.atom(gate), S.atom(up)
    return (f"isinstance({u}, {torch_name}.Tensor) and {u}.dim() >= 1 and {g}.shape == {u}.shape and {g}.dtype == {u}.dtype "
            f"and {u}.dtype in ({torch_name}.float32, {torch_name}.float16, {torch_name}.bfloat16)")


def cat_text(params: dict, units_after: int, units_before: int) -> str:
    """The value's words for the SSM gate's cat form."""
    if params.get("operands") != OPERANDS:
        return ""
    return (f" plus a torch.cat copy of the {OPERANDS} (the scan output is no projection, so no projection output can be "
            f"handed to the fused op whole): ~{units_after}·T·I moved against ~{units_before}·T·I before, slower as written")
