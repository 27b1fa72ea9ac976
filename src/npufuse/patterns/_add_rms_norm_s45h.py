"""s45 (helper ho22fix45): add_rms_norm forms the HO22 blind judge found missed, read by class.

1. A norm class whose forward first adapts an input of another width (``if x.size(-1) != self.dim: x = F.pad(x, ..)``
   or ``x = x[..., :self.dim]``, Differential-Transformer's RMSNorm) and then normalises the input. At a call whose
   input already has the norm's width the branch does not run: the norm of the input itself. The fused call runs
   under the run-time test that the branch's test is false (``x1.shape[-1] == norm.dim``: the sum's last dim is x1's
   wherever the eager add does not raise, or x1's is 1 and the test sends it to the original); any other width runs
   the original. Only a branch whose every statement rebinds local names (no return, no raise, no write to state)
   and a test comparing the input's last size with one attribute of the module are read.
"""

from __future__ import annotations

import ast

from npufuse.scan.dataflow import dotted

INPUT_TOKEN = "_npu_norm_input"  # the norm's input in a condition; :func:`on_operand` renders it as the sum's operand


def _last_size(node: ast.expr, x: str) -> bool:
    """``x.size(-1)`` / ``x.shape[-1]``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size" \
            and isinstance(node.func.value, ast.Name) and node.func.value.id == x and len(node.args) == 1 and not node.keywords:
        arg = node.args[0]
    elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape" \
            and isinstance(node.value.value, ast.Name) and node.value.value.id == x:
        arg = node.slice
    else:
        return False
    return isinstance(arg, ast.UnaryOp) and isinstance(arg.op, ast.USub) and isinstance(arg.operand, ast.Constant) \
        and arg.operand.value == 1


def _rebinds_locals_only(stmts: list[ast.stmt]) -> bool:
    """Every statement (nested ``if`` arms included) assigns plain local names."""
    for st in stmts:
        if isinstance(st, ast.If):
            if not _rebinds_locals_only(st.body) or not _rebinds_locals_only(st.orelse):
                return False
        elif isinstance(st, ast.Assign):
            if not all(isinstance(t, ast.Name) for t in st.targets):
                return False
        elif not isinstance(st, ast.Pass):
            return False
    return True


def width_adapter(fwd: ast.FunctionDef, me: str, x: str, mod: str) -> tuple[ast.If, str] | None:
    """(the branch, the run-time condition that it does not run, written on ``mod`` and :data:`INPUT_TOKEN`) for a
    forward whose first statement is ``if <x's last size> != <me>.<attr>: <local rebindings>`` (either order) and
    which stores ``x`` nowhere else; None for any other forward."""
    body = [st for st in fwd.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    if not body or not isinstance(body[0], ast.If) or "\n" in mod:
        return None
    head = body[0]
    test = head.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.NotEq)):
        return None
    left, right = test.left, test.comparators[0]
    size, attr = (left, right) if _last_size(left, x) else (right, left)
    chain = dotted(attr)
    if not _last_size(size, x) or chain is None or not chain.startswith(me + ".") or chain.count(".") != 1:
        return None
    if not _rebinds_locals_only(head.body) or not _rebinds_locals_only(head.orelse) or head.orelse:
        return None
    inside = {id(n) for st in head.body for n in ast.walk(st)}
    for n in ast.walk(fwd):
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr, ast.For, ast.With)) and id(n) not in inside:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if hasattr(n, "target") else \
                [i.optional_vars for i in n.items if i.optional_vars is not None] if isinstance(n, ast.With) else []
            if any(isinstance(t, ast.Name) and t.id == x for tt in targets for t in ast.walk(tt)):
                return None
    return head, f"{INPUT_TOKEN}.shape[-1] == {mod}{chain[len(me):]}"


def on_operand(conditions: list[str], plain_operands: list[str]) -> list[str] | None:
    """The conditions with the norm's input written as a plain operand of the sum (a name or attribute chain, read a
    second time without effect; its last dim is the sum's wherever the eager add does not raise, unless it is 1: then
    the test fails and the original runs), width tests last (after the norm's class test that makes ``.dim`` safe to
    read); None where a width test has no plain operand to read."""
    tested = [c for c in conditions if INPUT_TOKEN in c]
    if not tested:
        return conditions
    if not plain_operands:
        return None
    return [c for c in conditions if INPUT_TOKEN not in c] + [c.replace(INPUT_TOKEN, plain_operands[0]) for c in tested]
