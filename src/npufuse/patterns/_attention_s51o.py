"""s51 late51attn2: a module-level attention function returning its probabilities, which a caller in the file picks
exactly when the attention map is asked for (HO28a myllm ``eager_attn``).

HF-style files keep ``eager`` / ``sdpa`` implementations interchangeable (``ATTENTION[...]``), so a fused eager function
returning None for the probabilities is fine where the callers discard them. Here a caller also selects the function
under a test on ``output_attentions`` (``if impl == 'sdpa' and output_attentions: attn_impl = eager_attn``): the function
is the path taken when the caller asks for the map, and the fused branch would hand it None exactly then. Nothing at
the site tells the two calls apart (the flag is the caller's), so the site is refused with that fact.
"""

from __future__ import annotations

import ast
from typing import Any, Optional


def _reads_output_attentions(test: Any) -> bool:
    for n in ast.walk(test):
        if isinstance(n, ast.Name) and "output_attentions" in n.id:
            return True
        if isinstance(n, ast.Attribute) and "output_attentions" in n.attr:
            return True
    return False


def _bound_under_flag(module: Any) -> dict[str, int]:
    """Per file (computed once): function names bound to a name (or returned) in the body of an ``if`` whose test
    reads ``output_attentions``, with the line; files without the word are not walked."""
    cached = getattr(module, "_s51o_bound", None)
    if cached is not None:
        return cached
    found: dict[str, int] = {}
    if "output_attentions" in module.source:
        for node in ast.walk(module.tree):
            if not (isinstance(node, ast.If) and _reads_output_attentions(node.test)):
                continue
            for st in node.body:
                for n in ast.walk(st):
                    if isinstance(n, (ast.Assign, ast.AnnAssign, ast.Return)) and isinstance(n.value, ast.Name):
                        found.setdefault(n.value.id, n.lineno)
    try:
        setattr(module, "_s51o_bound", found)
    except AttributeError:
        pass
    return found


def picked_when_asked(module: Any, scope: Any) -> Optional[int]:
    """The line where the file binds this module-level function to a name under ``if <test reading output_attentions>:``
    (the map-asking path); None otherwise."""
    fn = getattr(scope.node, "name", None)
    if fn is None or scope.class_name or module.functions.get(fn) is not scope.node:
        return None
    return _bound_under_flag(module).get(fn)


def refusal(module: Any, scope: Any, name: str) -> Optional[str]:
    line = picked_when_asked(module, scope)
    if line is None:
        return None
    return (f"the attention probabilities (`{name}`) are returned, and line {line} picks this function under a test on "
            "`output_attentions` (the path a caller takes to get the attention map): npu_fusion_attention does not produce "
            "the probabilities, and the flag is the caller's, not read at the site")
