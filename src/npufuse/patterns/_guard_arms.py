"""A finding whose own guard can never hold where its span sits (s38, HO14b particleflow).

Many patterns write their replacement as ``if T1 and T2 ...: <fused> else: <original>``: the fused branch runs only
where every test holds. A span inside an ``if``/``else`` arm runs only where the arm's test has the arm's truth, so
when the arm fixes one of the guard's tests to false (jpata/particleflow: the eager attention inside
``if return_attn:``, whose guard asks ``not return_attn`` because the probabilities it returns have no fused
equivalent) the fused branch is dead code: the candidate replaces nothing that ever runs. :func:`contradicted_guard`
gives the reason; ``base._outside_compiled_code`` turns such findings into near misses for every pattern. Only a
guard proper is read: the fused ``if``'s ``else`` must be the span's statements as written.

Read as facts: the enclosing arms' tests (through ``and`` in a taken arm, ``or`` in an ``else`` arm, ``not``), each
only where nothing in the arm stores to a name or attribute the test reads (a store in the arm, before or after the
span in a loop, may change the test's value by the time the span runs). Tests are compared as written, up to
``not`` and the ``is None`` / ``is not None``, ``==`` / ``!=`` pairs.
"""

from __future__ import annotations

import ast
from typing import Any, Iterator, Optional

from npufuse.patterns._guard_arms_s46audit import same_statements

_NEGATED_OPS = {ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}


def _literal(test: ast.expr, truth: bool) -> tuple[str, bool]:
    """(the test's text without negations, its required truth): ``not x`` true is ``x`` false, ``a is not None``
    true is ``a is None`` false."""
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, truth = test.operand, not truth
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in (ast.IsNot, ast.NotEq):
        flipped = _NEGATED_OPS[type(test.ops[0])]()
        test, truth = ast.Compare(left=test.left, ops=[flipped], comparators=test.comparators), not truth
    return ast.dump(test), truth


def _facts(test: ast.expr, truth: bool) -> Iterator[tuple[ast.expr, bool]]:
    """The tests whose truth ``test`` having ``truth`` fixes: every operand of a true ``and`` / a false ``or``."""
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and isinstance(test.operand, ast.BoolOp):
        test, truth = test.operand, not truth
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And if truth else ast.Or):
        for value in test.values:
            yield from _facts(value, truth)
        return
    yield test, truth


def _conjuncts(test: ast.expr) -> Iterator[ast.expr]:
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        for value in test.values:
            yield from _conjuncts(value)
        return
    yield test


def _read_paths(test: ast.expr) -> Optional[set[str]]:
    """The names and attribute chains ``test`` reads (``self.flag``, ``x``); None where it calls anything or
    subscripts (its value may change without a store the arm shows)."""
    paths: set[str] = set()
    for node in ast.walk(test):
        if isinstance(node, (ast.Call, ast.Subscript, ast.Await, ast.NamedExpr, ast.Lambda)):
            return None
        if isinstance(node, ast.Name):
            paths.add(node.id)
        elif isinstance(node, ast.Attribute):
            try:
                paths.add(ast.unparse(node))
            except Exception:
                return None
    return paths


def _stored_paths(stmts: list[ast.stmt]) -> set[str]:
    """Names and attribute chains stored (assigned, deleted, augmented, bound by for / with / except / import /
    def) anywhere in ``stmts``, nested definitions included."""
    out: set[str] = set()
    for st in stmts:
        for node in ast.walk(st):
            if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del)):
                out.add(node.id if isinstance(node, ast.Name) else ast.unparse(node))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                out.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                out.add(node.name)
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                out.update(node.names)
    return out


def _changed(paths: set[str], stored: set[str]) -> bool:
    """A path the test reads, or an object on its chain (``self`` for ``self.flag``), is stored in the arm."""
    for p in paths:
        parts = p.split(".")
        if any(".".join(parts[: i + 1]) in stored for i in range(len(parts))):
            return True
    return False


def _falls_back_to_the_span(idx: Any, stmt: ast.stmt, finding: Any, guarded: ast.If) -> bool:
    """The fused ``if``'s ``else`` is the span's own statements as written (a guard: fused code or the original), so
    a false test means no fused code runs; a fork whose ``else`` holds fused code too (add_rms_norm's norm under an
    ``if`` / ``else`` of the original) is not such a guard."""
    held = idx.block.get(id(stmt))
    if held is None:
        return False
    block, i = held
    span = [st for st in block[i:] if (getattr(st, "end_lineno", None) or st.lineno) <= finding.end_line]
    # s46: the module's tree respells torch calls; the fallback parsed from the fused text does not
    return bool(span) and same_statements(span, guarded.orelse)


def contradicted_guard(scope: Any, finding: Any) -> Optional[str]:
    """Why ``finding``'s fused branch never runs where its span sits: a test of its guard (the ``if`` its fused
    text starts with) is false in the ``if``/``else`` arm holding the span; None otherwise."""
    from npufuse.patterns import _site as S
    from npufuse.patterns.base import parsed_code

    if not finding.fused.startswith("if "):
        return None
    idx = S.stmt_index(scope)
    stmt = idx.by_line.get(finding.line)
    if stmt is None:
        return None
    # the enclosing arms' facts first: most spans sit in no `if` arm, and without a fact nothing below can
    # answer; the fused text is parsed (once per text, shared with fast_body) and compared only where one is
    facts: list[tuple[tuple[str, bool], ast.If, bool]] = []
    child: ast.stmt = stmt
    for anc in S.ancestors(idx, stmt):
        if isinstance(anc, ast.If):
            held = idx.block.get(id(child))
            arm = anc.body if held is not None and held[0] is anc.body else anc.orelse if held is not None and held[0] is anc.orelse else None
            if arm is not None:
                taken = arm is anc.body
                stored = _stored_paths(arm)
                for test, truth in _facts(anc.test, taken):
                    paths = _read_paths(test)
                    if paths and not _changed(paths, stored):
                        facts.append((_literal(test, truth), anc, taken))
        if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            break
        child = anc
    if not facts:
        return None
    fused = parsed_code(finding.fused)
    if not fused or not isinstance(fused[0], ast.If) or not _falls_back_to_the_span(idx, stmt, finding, fused[0]):
        return None
    for conjunct in _conjuncts(fused[0].test):
        text, needed = _literal(conjunct, True)
        for (fact_text, fact_truth), anc, taken in facts:
            if fact_text == text and fact_truth != needed:
                arm = "taken" if taken else "`else`"
                return (f"the replacement's guard requires `{ast.unparse(conjunct)}`, which is false in the {arm} arm of "
                        f"`if {ast.unparse(anc.test)}:` (line {anc.lineno}) that holds this code: the fused branch could "
                        "never run there")
    return None


def unreachable_site(scope: Any, finding: Any) -> Optional[str]:
    """Why ``finding``'s span never runs: a ``raise`` / ``return`` / ``continue`` / ``break`` precedes its first
    statement in its block or an enclosing one (VILA's ``if tp > 1: raise ValueError(...)`` left above the old
    tensor-parallel code); None otherwise. Every pattern's rule, as the contradicted guard is."""
    from npufuse.patterns import _site as S
    from npufuse.patterns.sdpa import unconditional_exit_before

    stmt = S.stmt_index(scope).by_line.get(finding.line)
    if stmt is None:
        return None
    exit_stmt = unconditional_exit_before(scope, stmt)
    if exit_stmt is None:
        return None
    text = " ".join(ast.unparse(exit_stmt).split())
    return (f"unreachable: `{text[:60]}` (line {exit_stmt.lineno}) always leaves its block before this code, "
            "so the original never runs here and a rewrite changes nothing")
