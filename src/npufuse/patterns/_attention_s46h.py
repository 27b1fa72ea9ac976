"""s46 (ho23fix46): the scores' shape bound to names that a statement run as written on the fused branch reads.

HO23a Moe-LLM- (a causal mask cached on the module and rebuilt when the sequence grows)::

    att = einsum("b h i d, b h j d -> b h i j", q, k) / sqrt(d)
    i, j = att.shape[-2], att.shape[-1]
    if self.mask is None or self.mask.size(0) < i:
        self.mask = torch.tril(torch.ones((i, j), device=x.device)).unsqueeze(0).unsqueeze(0)
    att = att.masked_fill(self.mask[:, :, :i, :j] == 0, float("-inf"))

``i, j`` are metadata of the scores, inlined into the mask step; the ``if`` updating the cache runs as written on the
fused branch and reads them, so the site was refused ("uses intermediate `i`"). Their values need only the scores'
shape, which the renderer writes in terms of q and k (``Renderer.scores_shape``): the binding is emitted on the fused
branch in that form, before the statement that reads it. Only plain assignments whose every read of an intermediate
is a metadata read (``.shape`` / ``.size()`` / ``.dtype``) are rebound this way.
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Optional


def rebound_metadata(block: list[ast.stmt], steps: set[int], start: int, before: int, names: set[str],
                     assigned: list[set[str]], meta_only: Callable[[ast.stmt, set[str]], bool],
                     internal_before: Callable[[int], set[str]], render: Callable[[int], Optional[str]]) -> Optional[list[str]]:
    """Statements binding ``names`` on the fused branch, rendered from the scores' shape: for each name, its last
    binding among the steps ``start .. before - 1`` must be a plain assignment reading intermediates only through
    metadata; None when one is not (the caller's reason stands)."""
    out: list[tuple[int, str]] = []
    for name in sorted(names):
        idx = next((k for k in range(before - 1, start - 1, -1) if name in assigned[k]), None)
        if idx is None or idx not in steps:
            return None
        stmt = block[idx]
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
            return None
        inner = {n.id for n in ast.walk(stmt.value) if isinstance(n, ast.Name)} & internal_before(idx)
        if inner and not meta_only(stmt, inner):
            return None
        text = render(idx)
        if text is None:
            return None
        if all(k != idx for k, _ in out):
            out.append((idx, text))
    return [t for _, t in sorted(out)]


def render_assignment(stmt: ast.stmt, text: Callable[[Any], str], sym: Any) -> Optional[str]:
    """``targets = <value rendered by the renderer>``; None where the renderer refuses it."""
    if not isinstance(stmt, ast.Assign):
        return None
    try:
        value = text(sym)
    except Exception:  # noqa: BLE001 -- the renderer signals "cannot write this" with its own Miss
        return None
    if "\n" in value:
        return None
    return f"{ast.unparse(stmt.targets[0])} = {value}"
