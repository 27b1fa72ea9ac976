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


def _where_replacement(module: ModuleInfo, scope: Scope, name: str, line: int) -> Optional[tuple[str, str, str]]:
    """(test, replacement, replaced) texts where ``name`` is bound, as it reaches ``line``, from ``torch.where(test,
    replacement, replaced)`` with a literal, a constant attribute or a plain name as the replacement."""
    value = scope.definition(name, line)
    if not (isinstance(value, ast.Call) and (module.canonical(value.func) or "") == "torch.where" and len(value.args) == 3):
        return None
    test, fill, replaced = value.args
    if not isinstance(fill, (ast.Constant, ast.Attribute, ast.Name)):
        return None
    return segment(module, test), segment(module, fill), segment(module, replaced)


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
    name, (test, fill, replaced) = found[0]  # type: ignore[misc]
    return (f"branch `{branch}` divides by `{name}` (`torch.where({test}, {fill}, {replaced})`): npufuse does not show "
            f"that `{test}` holds at every zero of `{replaced}` (the test reads a run-time value), so where the branch is "
            "not selected the division is not shown finite, and lerp would turn an inf there into NaN: the lerp form is "
            "not shown inf-safe")
