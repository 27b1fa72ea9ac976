"""affinity_where reasons corrected by the s46 precision audit (helper audit46).

* Theseus / torchlie's small-angle code divides by names the code itself made nonzero: ``theta_nz =
  torch.where(small_theta, non_zero, theta)``, then ``torch.where(small_theta, -theta / 2 + theta3 / 24, (cosine - 1) /
  theta_nz)``. The reason said the division "can be inf/NaN where it is not selected"; with the usual positive
  threshold it cannot. What holds is narrower: npufuse does not show the test covers every zero of the replaced value
  (the threshold is a run-time value), so the lerp form is not shown inf-safe. The decision is unchanged; the reason
  now names the sanitised divisor and what is not shown.
"""

from __future__ import annotations

import ast
from typing import Optional

from npufuse.scan.dataflow import ModuleInfo, Scope, fast_walk, segment


_FILLS = frozenset(("ones", "ones_like", "full", "full_like", "tensor"))


def _fill(module: ModuleInfo, scope: Scope, node: ast.expr, line: int) -> bool:
    """A stand-in value: a literal, a constant attribute (``constants._NON_ZERO``), ``torch.ones_like(x)`` /
    ``torch.full(...)``, or a name bound from one of those (``non_zero = torch.ones(1, ...)``)."""
    if isinstance(node, ast.Name):
        node = scope.definition(node.id, line)  # type: ignore[assignment]
    if isinstance(node, (ast.Constant, ast.Attribute)):
        return True
    return isinstance(node, ast.Call) and (module.canonical(node.func) or "").rsplit(".", 1)[-1] in _FILLS \
        and (module.canonical(node.func) or "").startswith("torch.")


def _where_replacement(module: ModuleInfo, scope: Scope, name: str, line: int) -> Optional[tuple[str, str, str]]:
    """(where call, kept value, test) texts where ``name`` is bound, as it reaches ``line``, from ``torch.where(test,
    a, b)`` with one branch a stand-in (:func:`_fill`) for the other."""
    value = scope.definition(name, line)
    if not (isinstance(value, ast.Call) and (module.canonical(value.func) or "") == "torch.where" and len(value.args) == 3):
        return None
    test, a, b = value.args
    fa, fb = _fill(module, scope, a, line), _fill(module, scope, b, line)
    if fa == fb:
        return None  # both stand-ins, or neither: no sanitised value
    kept = b if fa else a
    return segment(module, value), segment(module, kept), segment(module, test)


def sanitised_divisor_reason(module: ModuleInfo, scope: Scope, branch: str, op: str, line: int) -> Optional[str]:
    """The reason for a division whose divisor is a product / power of names each bound from such a torch.where (and
    literals), None for any other unsafe op."""
    try:
        node = ast.parse(op, mode="eval").body
    except SyntaxError:
        return None
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
        return None
    names: list[str] = []
    stack: list[ast.expr] = [node.right]
    while stack:
        n = stack.pop()
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mult, ast.Pow)):
            stack += [n.left] if isinstance(n.op, ast.Pow) else [n.left, n.right]
        elif isinstance(n, ast.Name):
            names.append(n.id)
        elif not isinstance(n, ast.Constant):
            return None
    found = [(n, _where_replacement(module, scope, n, line)) for n in dict.fromkeys(names)]
    if not found or any(w is None for _n, w in found):
        return None
    name, (where, kept, test) = found[0]  # type: ignore[misc]
    return (f"branch `{branch}` divides by `{name}` (`{' '.join(where.split())[:90]}`): npufuse does not show that the "
            f"test `{test}` replaces every zero of `{kept}` (it reads a run-time value), so where the branch is not "
            "selected the division is not shown finite, and lerp would turn an inf there into NaN: the lerp form is not "
            "shown inf-safe")
