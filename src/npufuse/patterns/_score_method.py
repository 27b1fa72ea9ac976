"""Attention scores masked by a helper METHOD of the same class, or a function of the file (s41, classes41).

``scores = self._apply_causal(scores)`` / ``scores = self.mask_fn(scores, T)`` where the method's body is
straight-line code that builds a mask and returns ``scores.masked_fill(mask, -inf)`` (or ``torch.where``):
the method is read as if its body were written at the call, its parameters replaced by the call's
arguments, its locals by their values and its ``self`` by the caller's, so the attention matcher decides
the mask (causal triangle -> sparse_mode, any other boolean mask -> atten_mask) as it does for inline code.
A subclass may override the method, so the fused call runs only where ``type(self).<m>`` is still this
class's function. A method that does anything else to the scores (adds a bias, scales them, a soft
penalty) is a near miss that says what it does."""

from __future__ import annotations

import ast
import copy
from typing import Any, Optional

from npufuse.patterns import _attention_s33, _attention_s51l
from npufuse.scan import canonical

class NotMasking(Exception):
    """The method computes something on the scores other than a mask (its description in ``args[0]``)."""


def _straight_line(fn: ast.FunctionDef) -> Optional[tuple[list[ast.stmt], ast.expr]]:
    """(the statements before the return, the returned expression) where the body (docstring aside) is only
    single-name assignments and ``<param>.masked_fill_(..)`` statements ended by one ``return <expr>``."""
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(canonical.const_value(st.value), str))]
    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    for st in body[:-1]:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            continue
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Attribute) \
                and st.value.func.attr == "masked_fill_" and isinstance(st.value.func.value, ast.Name):
            continue
        if _attention_s51l.raising_check(st):
            continue  # s51: ``if mask.shape != (b, n): raise ValueError(..)``: becomes a run-time requirement
        return None
    if any(isinstance(n, (ast.Lambda, ast.NamedExpr, ast.comprehension, ast.Yield, ast.YieldFrom, ast.Await))
           for st in body for n in ast.walk(st)):
        return None
    return body[:-1], body[-1].value  # type: ignore[return-value]


def _bind(fn: ast.FunctionDef, call: ast.Call) -> Optional[dict[str, Any]]:
    """The method's parameters bound to the call's arguments (positional, keyword, defaults), ``self`` to the
    caller's ``self``."""
    if not fn.args.args or fn.args.posonlyargs:
        return None
    receiver = call.func.value  # type: ignore[attr-defined]
    return canonical._bind_call(fn, ast.Call(func=call.func, args=[receiver, *call.args], keywords=call.keywords))


def _masking(matcher: Any, expr: Any) -> bool:
    """``x.masked_fill(..)`` / ``x.masked_fill_(..)`` / ``torch.masked_fill(..)`` / ``torch.where(c, a, b)``."""
    if not isinstance(expr, ast.Call):
        return False
    return matcher.method(expr, "masked_fill", "masked_fill_") or matcher._fn(expr) in ("torch.masked_fill", "torch.where")


def _describe(matcher: Any, expr: Any) -> str:
    """What ``expr`` (the helper's result) does to the scores, in words."""
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        left = matcher._reaches(expr.left, None)
        term = matcher.src(expr.right if left else expr.left)
        if isinstance(expr.op, ast.Add):
            return f"adds `{term}` to the scores (a float bias, not a mask)"
        if isinstance(expr.op, ast.Sub):
            return f"subtracts `{term}` from the scores (a float bias, not a mask)" if left else f"returns `{matcher.src(expr)}`"
        return f"scales the scores by `{term}`"
    return f"returns `{matcher.src(expr)}`, not the scores masked by masked_fill / where"


def inline_masking_method(matcher: Any, node: Any, chain: Any, cond: Optional[tuple[Any, bool]] = None) -> Optional[Any]:
    """The returned expression of ``self.<m>(scores, ...)`` with the method's body inlined (see the module
    docstring), where ``<m>`` is a plain method of this module-level class (or of its one base named in this
    file, see ``_attention_s33.own_method``); a run-time requirement that ``type(self).<m>`` is that function is added to ``chain``. None where
    the call is not such a method or its body is not straight-line code; raises :class:`NotMasking` where
    it is, but returns something other than a masked_fill / where of the scores."""
    from npufuse.patterns.attention import Ref

    caller_locals = set(matcher.scope.assignments) | set(matcher.scope.args)
    found = _attention_s33.own_method(matcher, node)
    owner: Optional[str] = None
    keyed = _attention_s51l.keyword_or_static_method(matcher, node) if found is None else None
    if found is not None:
        owner, fn = found
        bound = _bind(fn, node)
    elif keyed is not None:
        owner, fn, bound = keyed  # s51: ``self.padding_masking(attention_logits=s, attention_mask=m)``, a staticmethod
    else:
        # ``scores = apply_causal_mask(scores)``: a plain function of this file (not decorated, the name not rebound
        # by the caller); a function of one ``return`` is read by ``_inlined_helper`` before this
        name = node.func.name if isinstance(node, ast.Call) and isinstance(node.func, Ref) and node.func.idx == -1 else None
        fn = matcher.module.functions.get(name) if name is not None and name not in caller_locals else None
        if not isinstance(fn, ast.FunctionDef) or fn.decorator_list or any(isinstance(a, ast.Starred) for a in node.args):
            return None
        bound = canonical._bind_call(fn, node)
    parts = _straight_line(fn)
    if parts is None or bound is None:
        return None
    stmts, returned = parts
    env: dict[str, Any] = dict(bound)
    shadowed: list[str] = []
    called = f"self.{fn.name}(..)" if owner is not None else f"{fn.name}(..)"

    class _Substitute(ast.NodeTransformer):
        def visit_Name(self, n: ast.Name) -> Any:
            if n.id in env:
                return env[n.id]
            if n.id in caller_locals:
                shadowed.append(n.id)  # a module-level name the caller rebinds: its text would mean another value there
            return Ref(n.id, -1, None, n)

    def substitute(expr: ast.expr) -> Any:
        return _Substitute().visit(copy.deepcopy(expr))

    for st in stmts:
        if isinstance(st, ast.Assign):
            env[st.targets[0].id] = substitute(st.value)  # type: ignore[union-attr]
        elif isinstance(st, ast.If):
            # the helper raises where its check fails: the fused call runs only where it passes, else the original (raises)
            # under a branch (``if mask is not None: s = self.pad(s, mask)``) the check is read only where that branch runs
            failed = substitute(st.test) if cond is None else ast.BoolOp(op=ast.And(), values=[
                cond[0] if not cond[1] else ast.UnaryOp(op=ast.Not(), operand=cond[0]), substitute(st.test)])
            chain.requires.append((ast.UnaryOp(op=ast.Not(), operand=failed),
                                   f"`{called}` raises where `{ast.unparse(st.test)}`: the fused call runs only where that check "
                                   "passes; the original code (which raises) runs otherwise"))
        else:  # ``p.masked_fill_(mask, v)``: p holds the filled tensor from here on
            call = st.value  # type: ignore[attr-defined]
            target = call.func.value.id
            filled = substitute(call)
            filled.func.attr = "masked_fill"
            env[target] = filled
    result = substitute(returned)
    if shadowed:
        return None
    if not _masking(matcher, result):
        raise NotMasking(f"`{called}` {_describe(matcher, result)}: npu_fusion_attention takes a boolean mask "
                         "(masked_fill / where with a large negative fill), not what this helper does to the scores")
    if owner is None:
        chain.spelling.append("masking_function_inlined")
        return result
    guard = ast.parse(f"type(self).{fn.name} is {owner}.{fn.name}", mode="eval").body
    chain.requires.append((guard, f"`self.{fn.name}(..)` masks the scores in `{owner}`; a subclass may override it: the fused call "
                                  f"runs only where `type(self).{fn.name}` is `{owner}`'s"))
    chain.spelling.append("masking_method_inlined")
    return result


def flag_tensor_factor(matcher: Any, branch: Any, base: Any) -> Optional[Any]:
    """The product node of ``branch`` (the scores after an ``if``) that multiplies or divides the scores ``base`` by a
    tensor attribute of the module (``attn * self.temperature`` with ``nn.Parameter(torch.ones(heads, 1, 1))``), or
    None. Under a flag such a factor is no Python-float scale for the fused call (``scale`` takes a float): the
    branch is excluded (the fused call runs where the flag is off) rather than read as ``flag ? factor : 1.0``."""
    from npufuse.patterns import _attention_s35

    for n in matcher._until(branch, base):
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mult, ast.Div)):
            left, right = matcher._reaches(n.left, base), matcher._reaches(n.right, base)
            if left != right and _attention_s35.module_tensor(matcher, n.right if left else n.left):
                return n
    return None


def flag_extra_columns(matcher: Any, branch: Any, base: Any) -> Optional[Any]:
    """The ``torch.cat([scores, extra], dim=-1)`` of ``branch`` (attention sinks: one more logit per row, dropped from
    the probabilities after the softmax), the scores ``base`` first and the cat along the last dim; else None. The
    fused op has no extra key column: under a flag the branch is excluded (fused where the flag is off)."""
    for n in matcher._until(branch, base):
        if isinstance(n, ast.Call) and matcher._fn(n) in ("torch.cat", "torch.concat", "torch.concatenate") and n.args \
                and isinstance(n.args[0], (ast.List, ast.Tuple)) and len(n.args[0].elts) == 2:
            dim = n.args[1] if len(n.args) > 1 else next((k.value for k in n.keywords if k.arg in ("dim", "axis")), None)
            first, extra = n.args[0].elts
            if canonical.const_value(dim) == -1 and matcher._reaches(first, base) and not matcher._reaches(extra, base):
                return n
    return None
