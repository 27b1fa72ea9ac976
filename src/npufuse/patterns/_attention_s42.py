"""Attention / SDPA constructs of the s42 pass (helper attnrope42: classes the s42 blind judge named).

* SDPA called with ``attn_mask=m`` and ``is_causal=True`` where ``m`` may be None on the path that runs: torch
  rejects both set together, so wherever the call runs at all with a mask the code is broken, and where it runs the
  mask is None. s40 read this only for a parameter with a None default / ``Optional`` annotation; the code says the
  same with a local bound to ``None`` before the call (``attn_mask = None; if pad is not None: attn_mask = ..``) or a
  parameter the function tests against None. The fused causal call runs under a run-time ``m is None`` test and the
  original call otherwise, so the reading only decides whether the site is worth reporting: never what runs.
"""

from __future__ import annotations

import ast
from typing import Any

from npufuse.patterns import _attention_s40


def _none_constant(node: Any) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _tested_against_none(fn: ast.AST, name: str) -> bool:
    """``name is None`` / ``name is not None`` somewhere in the function ``fn``."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], (ast.Is, ast.IsNot)) \
                and isinstance(n.left, ast.Name) and n.left.id == name and _none_constant(n.comparators[0]):
            return True
    return False


def mask_may_be_none(scope: Any, mask: Any, line: int) -> bool:
    """The SDPA mask ``mask`` (a plain name) may be None where the call on ``line`` runs: a parameter the code says
    may be None (s40's None default / ``Optional`` annotation, or a test against None in the function) or a local
    bound to the constant None before the call, and not rebound on every path before it (a tensor assigned at the
    function's top level after the last None makes it always given)."""
    fn = scope.node
    if not isinstance(mask, ast.Name) or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    before = sorted(((st, value) for st, value in scope.assignments.get(mask.id, []) if st.lineno < line), key=lambda sv: sv[0].lineno)
    if before:
        last_stmt, last_value = before[-1]
        if not _none_constant(last_value) and any(last_stmt is st for st in fn.body):
            return False  # rebound on every path before the call (``mask = None`` then ``mask = build(..)``): always given
        if any(_none_constant(v) for _st, v in before):
            return True
    params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    if mask.id not in params:
        return False
    # s40's reading of the signature, asked at the definition's line (before any rebinding in the body)
    return _attention_s40.mask_may_be_none(scope, mask, fn.lineno) or _tested_against_none(fn, mask.id)
