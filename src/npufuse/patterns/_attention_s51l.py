"""s51 late51attn: a scores-masking helper method called with keywords only, or declared ``@staticmethod``.

``logits = self.padding_masking(attention_logits=logits, attention_mask=m)`` where ``padding_masking`` is a
``@staticmethod`` of the class doing ``masked_fill(~m, -inf)`` (HO28c genji970's class). s41's
``_score_method.inline_masking_method`` reads such a body as inline code, but ``_attention_s33.own_method`` takes
only plain methods called with positional arguments: this module finds the same method when the call passes
keywords only or the method is a staticmethod (no ``self`` to bind), and binds the arguments accordingly. The
override guard ``type(self).<m> is <Owner>.<m>`` stays valid: a staticmethod read from a class is its function.
"""

from __future__ import annotations

import ast
from typing import Any, Optional

from npufuse.patterns import _attention_s33
from npufuse.scan import canonical


def _static(fn: ast.FunctionDef) -> Optional[bool]:
    """True for ``@staticmethod``, False for no decorator, None for any other decorator (its effect is not read)."""
    if not fn.decorator_list:
        return False
    if len(fn.decorator_list) == 1 and isinstance(fn.decorator_list[0], ast.Name) and fn.decorator_list[0].id == "staticmethod":
        return True
    return None


def keyword_or_static_method(matcher: Any, node: Any) -> Optional[tuple[str, ast.FunctionDef, dict[str, Any]]]:
    """(owner class, method, parameters bound to the call's arguments) for ``self.<m>(..)`` where ``<m>`` is a method
    of the scope's module-level class (or its one base of this file) that ``own_method`` does not take: called with
    keywords only, or a ``@staticmethod``; None otherwise."""
    from npufuse.patterns.attention import Ref

    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, Ref)
            and node.func.value.name == "self" and node.func.value.idx == -1
            and not any(isinstance(a, ast.Starred) for a in node.args)
            and not any(k.arg is None for k in node.keywords)):
        return None
    cls_name = matcher.scope.class_name
    cls = matcher.module.classes.get(cls_name or "")
    if cls is None or "." in (cls_name or "") or not any(st is cls for st in matcher.module.tree.body):
        return None
    owner, fn = cls.name, _attention_s33._method_of(cls, node.func.attr)
    if fn is None and len(cls.bases) == 1 and isinstance(cls.bases[0], ast.Name):
        base = _attention_s33.repo_definition(matcher, cls.bases[0].id)
        if base is not None and isinstance(base.node, ast.ClassDef):
            owner, fn = cls.bases[0].id, _attention_s33._method_of(base.node, node.func.attr)
    if not isinstance(fn, ast.FunctionDef):
        return None
    static = _static(fn)
    if static is None:
        return None
    if static:
        bound = canonical._bind_call(fn, node)  # no ``self`` parameter: the call's arguments bind as written
    else:
        if not fn.args.args or fn.args.posonlyargs:
            return None
        bound = canonical._bind_call(fn, ast.Call(func=node.func, args=[node.func.value, *node.args], keywords=node.keywords))
    if bound is None:
        return None
    return owner, fn, bound


def raising_check(st: ast.stmt) -> bool:
    """``if <test>: raise <Error>(..)`` with no else (an argument check in a masking helper), the test free of calls
    other than reads, so evaluating it again in the fused guard has no side effect."""
    if not (isinstance(st, ast.If) and not st.orelse and len(st.body) == 1 and isinstance(st.body[0], ast.Raise)):
        return False
    return not any(isinstance(n, (ast.Call, ast.NamedExpr, ast.Lambda, ast.Await)) for n in ast.walk(st.test))
