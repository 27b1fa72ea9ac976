"""s51 late51attn2: an SDPA mask that is None on the configured path, whose other arm builds a mask the row analysis
rejects (HO28b VggAE: ``attn_mask = None; if self.causal and L > 1: attn_mask = torch.triu(ones, diagonal=1)`` -- a
bool keep-mask that keeps no key for the last query row).

Before, the whole site was refused for that arm. The fused call is exact where the mask is None, so it now runs under
the run-time requirement ``<mask> is None``; where the arm built a mask, the original SDPA call runs as written (it keeps
whatever that mask does, fully masked rows included)."""

from __future__ import annotations

import ast
from typing import Any, Optional

from npufuse.patterns.base import Risk


def _bound_to_none(scope_node: Any, name: str) -> bool:
    """The function binds ``name`` to a literal None (``attn_mask = None``) or takes it with a None default: the None
    path is one the code spells (a mask that is merely not proven a tensor, a helper's result, is not enough: the
    guard would never hold there and the site would be reported fused for nothing)."""
    for n in ast.walk(scope_node):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and n.value.value is None \
                and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            return True
    args = getattr(scope_node, "args", None)
    if args is not None:
        pos = [*args.posonlyargs, *args.args]
        for a, d in zip(pos[len(pos) - len(args.defaults):], args.defaults):
            if a.arg == name and isinstance(d, ast.Constant) and d.value is None:
                return True
        for a, d in zip(args.kwonlyargs, args.kw_defaults):
            if a.arg == name and isinstance(d, ast.Constant) and d.value is None:
                return True
    return False


def none_only_guard(m_src: str, maybe_none: bool, simple: bool, scope_node: Any) -> Optional[str]:
    """The run-time requirement under which the fused call takes no mask, or None where the mask is never None /
    not a plain name (its expression would be evaluated twice) / never spelled None in the function."""
    if not (maybe_none and simple and m_src.isidentifier() and _bound_to_none(scope_node, m_src)):
        return None
    return f"{m_src} is None"


def none_only_risk(m_src: str, why: str) -> Any:
    return Risk("other", f"the fused call runs only where `{m_src}` is None; where it is a mask ({why}) the original SDPA call runs")
