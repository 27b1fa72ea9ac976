"""s49 mask49: an attention helper method whose every call takes the branch the fused call excludes (a dead candidate).

The attention reading records steps it cannot fuse under a flag as ``Chain.excluded`` (``if self.variant == "x":
w = softmax1(s) else: w = F.softmax(s)``): the fused call runs where that branch is not taken, the original code where
it is. Where the site's function is a method whose class calls it only under that same test, in the branch that takes
the excluded step (``if self.variant == "x": out = self._manual_attention(q, k, v) else: out = F.sdpa(...)``), the
fused branch never runs on any call the code makes: a candidate that only adds a guard. It is a near miss naming the
callers and the step.

Proven, not guessed: every mention of the method's name in the file is its definition or such a call through
``self`` inside the class (:func:`_attention_s32.code_mentions`, no prose), and no other file of the repository can
read the member (:func:`_attention_s32.member_may_be_read`). The caller's test must be the callee's test as written
(``ast.dump`` equal: ``self.`` attributes and constants only), so both read the same value on one call.
"""

from __future__ import annotations

import ast
from types import SimpleNamespace
from typing import Any, Optional


def _flag_test(node: ast.AST) -> bool:
    """A test reading only ``self.<attr>`` chains, constants, comparisons and boolean operators."""
    for n in ast.walk(node):
        if isinstance(n, (ast.Compare, ast.BoolOp, ast.UnaryOp, ast.Constant, ast.Load, ast.Eq, ast.NotEq, ast.Is,
                          ast.IsNot, ast.In, ast.NotIn, ast.Not, ast.And, ast.Or, ast.Tuple, ast.List)):
            continue
        if isinstance(n, ast.Attribute):
            continue
        if isinstance(n, ast.Name) and n.id == "self":
            continue
        return False
    return True


def _calls_under(cls: ast.ClassDef, word: str) -> Optional[list[tuple[ast.Call, list[tuple[str, bool]]]]]:
    """Every ``self.<word>(...)`` call in the methods of ``cls``, each with the ``if`` tests above it in its method
    (``(ast.dump(test), in_body)``); None where ``self.<word>`` is read other than as such a call."""
    out: list[tuple[ast.Call, list[tuple[str, bool]]]] = []

    def visit(node: ast.AST, tests: list[tuple[str, bool]]) -> bool:
        if isinstance(node, ast.If):
            if not visit(node.test, tests):
                return False
            key = ast.dump(node.test)
            return all(visit(c, tests + [(key, True)]) for c in node.body) and \
                all(visit(c, tests + [(key, False)]) for c in node.orelse)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == word \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
            out.append((node, tests))
            return all(visit(c, tests) for c in ast.iter_child_nodes(node) if c is not node.func)
        if isinstance(node, ast.Attribute) and node.attr == word:
            return False  # ``self.word`` passed on, stored, or read another way
        return all(visit(c, tests) for c in ast.iter_child_nodes(node))

    for item in cls.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not visit(item, []):
            return None
    return out


def _base_names(cls: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases if isinstance(b, (ast.Name, ast.Attribute))}


def _own_namesakes(module: Any, cls: ast.ClassDef, word: str) -> int:
    """The mentions of ``word`` inside the file's other classes that define their own method ``word`` and are neither
    a base nor a subclass of ``cls`` by name (math-llm's ``TransformerBlock._manual_attention`` beside
    ``FeedbackTransformerBlock._manual_attention``): their ``self.word`` is their own method. Counted as
    :func:`_attention_s32.code_mentions` counts, over each class."""
    from npufuse.patterns import _attention_s32

    total = 0
    for other in ast.walk(module.tree):
        if not isinstance(other, ast.ClassDef) or other is cls:
            continue
        if not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == word for n in other.body):
            continue
        if cls.name in _base_names(other) or other.name in _base_names(cls):
            continue  # related by inheritance: its mentions are not set aside
        total += _attention_s32.code_mentions(SimpleNamespace(tree=other), word)
    return total


def dead_under_callers(module: Any, scope: Any, excluded: list[tuple[Any, bool, str]], text: Any) -> Optional[str]:
    """The near-miss reason where every call of the site's method takes an excluded branch; None otherwise.
    ``text``: the renderer's source of a node (the test as the reason names it)."""
    from npufuse.patterns import _attention_s32

    fn, cls_name = scope.node, scope.class_name
    if cls_name is None or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.decorator_list \
            or fn.name in ("forward", "__call__") or fn.name.startswith("__"):
        return None
    flags: dict[tuple[str, bool], tuple[Any, str]] = {}
    for t, neg, step in excluded:
        try:
            parsed = ast.parse(text(t), mode="eval").body  # the test as written (the reading holds ``self`` as a Ref)
        except Exception:  # noqa: BLE001 - a test npufuse cannot render is no flag
            continue
        if _flag_test(parsed):
            flags.setdefault((ast.dump(parsed), not neg), (t, step))
    if not flags:
        return None
    cls = next((n for n in ast.walk(module.tree) if isinstance(n, ast.ClassDef) and n.name == cls_name
                and fn in n.body), None)
    if cls is None:
        return None
    calls = _calls_under(cls, fn.name)
    if not calls:
        return None
    taken: Optional[tuple[Any, str]] = None
    for _call, tests in calls:
        hit = next((flags[t] for t in tests if t in flags), None)
        if hit is None:
            return None  # a call the excluded test does not route to the excluded branch
        taken = taken or hit
    if _attention_s32.code_mentions(module, fn.name) != 1 + len(calls) + _own_namesakes(module, cls, fn.name):
        return None  # the name is used another way (another class, a string, an export)
    if _attention_s32.member_may_be_read(module, cls_name, fn.name, this_file=False) is not None:
        return None  # another file may call it
    assert taken is not None
    lines = ", ".join(str(c.lineno) for c, _ in calls)
    test, step = taken
    return (f"every call of `{fn.name}` (line{'s' if len(calls) > 1 else ''} {lines}) is made where `{text(test)}` "
            f"selects {step if step.startswith('`') else f'`{step}`'}, which npu_fusion_attention does not compute: "
            "the fused call, guarded by the other branch, would never run")
