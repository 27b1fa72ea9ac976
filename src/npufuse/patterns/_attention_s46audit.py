"""Attention fixes of the s46 precision audit (helper audit46).

* A fused branch that can never run (the s45 judge's harmless extra on F5-like TTS ``models/dit.py``): the eager
  attention sits inside ``if return_attn_weights:``, the arm that returns the probabilities, and the fused call
  needs ``not return_attn_weights`` (``Chain.excluded``). Every run reaching the site takes the original code, so
  the report promised a speed-up that never comes: a near miss naming the enclosing test instead.
"""

from __future__ import annotations

import ast
from typing import Any

from npufuse.scan.dataflow import Scope, fast_walk



def _stored_names(stmts: list[ast.stmt]) -> set[str]:
    """Names (and ``self.<attr>`` texts) stored anywhere in ``stmts``."""
    out: set[str] = set()
    for st in stmts:
        for n in fast_walk(st):
            if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
                out.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name):
                out.add(f"{n.value.id}.{n.attr}")
    return out


def _read_names(test: ast.expr) -> set[str]:
    out: set[str] = set()
    for n in fast_walk(test):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            out.add(f"{n.value.id}.{n.attr}")
    return out


def excluded_test_encloses_site(scope: Scope, stmt: ast.stmt, excluded: list[tuple[Any, bool, str]],
                                parents: dict[int, ast.AST]) -> tuple[ast.expr, str] | None:
    """(the enclosing ``if`` test, the excluded step) where ``stmt`` sits in the arm of an ``if`` that is taken exactly
    where an excluded branch is (``Chain.excluded``: the fused call runs only where ``not test``, or ``test`` when
    negated), and nothing in that arm stores a name the test reads: the fused branch is dead. None otherwise."""
    wanted = {(ast.dump(t), neg): step for t, neg, step in excluded}
    up, child = parents.get(id(stmt)), stmt
    while up is not None and up is not scope.node:
        if isinstance(up, ast.If) and child is not up.test:
            in_body = any(child is b for b in up.body)
            test, negated = up.test, False
            if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
                test, negated = test.operand, True
            # the arm is taken where `test` is true when in the body of `if test:` (or the else of `if not test:`)
            taken_true = in_body != negated
            # excluded (t, False): the fused call needs `not t`, dead where t is true; (t, True): dead where t is false
            step = wanted.get((ast.dump(test), not taken_true))
            arm = up.body if in_body else up.orelse
            if step is not None and not (_read_names(test) & _stored_names(arm)):
                return up.test, step
        up, child = parents.get(id(up)), up
    return None
