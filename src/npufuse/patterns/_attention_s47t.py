"""s47 (ho24attn): attention classes behind the HO24a / HO24b misses and untrue near-miss reasons.

1. A softmax helper of the repository with an option parameter whose default makes a branch dead
   (``def softmax(x, dim=-1, temperature=1.0): if temperature != 1: x = x / temperature; ...``, anenbergb's CS336
   code): at a call that leaves the option at a constant, the helper's ``if`` tests over such parameters are
   evaluated and the body read without the dead arm (:func:`specialised_softmax_body`). Where a test reads a
   parameter the call passes as a non-constant, the near miss names that branch (:func:`unevaluated_branch`).
"""

from __future__ import annotations

import ast
import copy
import operator
from typing import Any, Optional

from npufuse.scan import canonical
from npufuse.scan.dataflow import const_value

_UNKNOWN = object()
_CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
        ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not}


def _constant_params(fn: ast.FunctionDef, bound: dict[str, Any]) -> dict[str, object]:
    """{parameter: value} for the parameters ``bound`` (call argument or default) gives a literal number / bool /
    None, and that nothing in the body rebinds."""
    stored = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}
    out: dict[str, object] = {}
    for p, node in bound.items():
        if p in stored or not isinstance(node, (ast.Constant, ast.UnaryOp)):
            continue
        v = const_value(node)
        if v is None or isinstance(v, (bool, int, float)):
            out[p] = v
    return out


def _test_value(test: ast.expr, consts: dict[str, object]) -> object:
    """The value of an ``if`` test made of the constant parameters, literals, comparisons, ``not`` / ``and`` / ``or``;
    ``_UNKNOWN`` otherwise."""
    if isinstance(test, ast.Name):
        return consts.get(test.id, _UNKNOWN)
    if isinstance(test, (ast.Constant, ast.UnaryOp)) and not (isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)):
        v = const_value(test)
        return v if v is None or isinstance(v, (bool, int, float)) else _UNKNOWN
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        v = _test_value(test.operand, consts)
        return _UNKNOWN if v is _UNKNOWN else (not v)
    if isinstance(test, ast.BoolOp):
        vals = [_test_value(v, consts) for v in test.values]
        if any(v is _UNKNOWN for v in vals):
            return _UNKNOWN
        return all(vals) if isinstance(test.op, ast.And) else any(vals)
    if isinstance(test, ast.Compare):
        left = _test_value(test.left, consts)
        if left is _UNKNOWN:
            return _UNKNOWN
        for op, right_node in zip(test.ops, test.comparators):
            right = _test_value(right_node, consts)
            fn = _CMP.get(type(op))
            if right is _UNKNOWN or fn is None:
                return _UNKNOWN
            if not fn(left, right):
                return False
            left = right
        return True
    return _UNKNOWN


def _fold(body: list[ast.stmt], consts: dict[str, object], folded: list[int], forced: Optional[tuple[ast.If, bool]] = None) -> list[ast.stmt]:
    """``body`` with every ``if`` whose test is a constant (or the ``forced`` one, to the value given) replaced by the
    arm that runs (nested ones too); ``folded`` counts the folds."""
    out: list[ast.stmt] = []
    for st in body:
        if isinstance(st, ast.If):
            v = forced[1] if forced is not None and st is forced[0] else _test_value(st.test, consts)
            if v is not _UNKNOWN:
                folded.append(st.lineno)
                out.extend(_fold(st.body if v else st.orelse, consts, folded, forced))
                continue
            st = copy.copy(st)
            st.body, st.orelse = _fold(st.body, consts, folded, forced), _fold(st.orelse, consts, folded, forced)
        out.append(st)
    return out


def specialised_softmax_body(fn: Any, tree: ast.Module, bound: Optional[dict[str, Any]], cache_owner: Any) -> Any:
    """:func:`canonical.softmax_body` of ``fn`` read with its ``if`` tests over parameters that this call leaves at
    a literal (``bound``: parameter -> the call's argument or the default) evaluated; None where no test folds or the
    folded body is still no softmax. Memoised on ``cache_owner`` (the module) per (function, constant values)."""
    if bound is None or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    consts = _constant_params(fn, bound)
    if not consts:
        return None
    cache = cache_owner.__dict__.setdefault("_npufuse_s47t_softmax", {})
    key = (id(fn), tuple(sorted((k, repr(v)) for k, v in consts.items())))
    hit = cache.get(key)
    if hit is not None and hit[0] is fn:
        return hit[1]
    folded: list[int] = []
    body = _fold(list(fn.body), consts, folded)
    result = None
    if folded and body:
        spec = copy.copy(fn)
        spec.body = body
        result = canonical.softmax_body(spec, tree)
    cache[key] = (fn, result)
    return result


def unevaluated_branch(fn: Any, tree: ast.Module, bound: Optional[dict[str, Any]]) -> Optional[str]:
    """For the near miss: the first ``if`` of ``fn``'s body whose test reads a parameter the call passes as something
    other than a literal (``if temperature != 1:`` with ``temperature=self.t``) and with one value of which the body is
    a softmax over one axis (so the branch is what stops the reading), as "`<test>` (line N) ... "; None when there is
    none (the body is no softmax either way: the caller keeps its general reason)."""
    if bound is None or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    consts = _constant_params(fn, bound)
    for st in ast.walk(fn):
        if not isinstance(st, ast.If) or _test_value(st.test, consts) is not _UNKNOWN:
            continue
        param = next((n.id for n in ast.walk(st.test) if isinstance(n, ast.Name) and n.id in bound and n.id not in consts), None)
        if param is None:
            continue
        arms = []
        for value in (True, False):
            spec = copy.copy(fn)
            spec.body = _fold(list(fn.body), consts, [], (st, value))
            if spec.body and canonical.softmax_body(spec, tree) is not None:
                arms.append(value)
        if len(arms) != 1:
            continue  # a softmax either way (the test is not the obstacle) or neither way
        from npufuse.patterns.attention import _plain

        try:
            arg = ast.unparse(_plain(bound[param]))
        except Exception:
            arg = "<expression>"
        return (f"`{ast.unparse(st.test)[:50]}` (line {st.lineno}): it is a softmax over one axis only where that test is "
                f"{'true' if arms[0] else 'false'}, and this call passes `{param}` as `{arg[:40]}`, whose value npufuse does not know here")
    return None


# -- 2. the score arithmetic written as tensor methods / torch functions ----------------------------------------------

_METHOD_OPS = {"mul": ast.Mult, "div": ast.Div, "add": ast.Add, "multiply": ast.Mult, "divide": ast.Div, "true_divide": ast.Div}


def method_arith(matcher: Any, node: Any) -> Optional[ast.BinOp]:
    """``s.mul(f)`` / ``s.div(f)`` / ``s.add(t)`` (and ``torch.mul(s, f)`` / ``torch.div(s, f)`` / ``torch.add(s, t)``)
    with one argument each and no keyword (``rounding_mode`` / ``alpha`` change the value), as the operator form
    ``s * f`` / ``s / f`` / ``s + t`` that the score chain reads; None for anything else. (vit-attentive-bench DAT:
    ``attn = torch.einsum(..).mul(self.scale)`` then a learned additive bias.)"""
    if not isinstance(node, ast.Call) or node.keywords:
        return None
    fn = matcher._fn(node)
    for name, op in _METHOD_OPS.items():
        if fn == f"torch.{name}" and len(node.args) == 2 and not any(isinstance(a, ast.Starred) for a in node.args):
            return ast.BinOp(left=node.args[0], op=op(), right=node.args[1])
        if fn != f"torch.{name}" and matcher.method(node, name) and len(node.args) == 1 and not isinstance(node.args[0], ast.Starred):
            return ast.BinOp(left=node.func.value, op=op(), right=node.args[0])
    return None


def conjunction_of_flags(scope: Any, flag: ast.expr) -> bool:
    """``a and b [and ..]`` where each operand (possibly under ``not``) is ``self.<attr>`` or a parameter the function
    never reassigns: a test the fused branch can read before the site as well as one flag (DAT's
    ``if self.use_pe and self.dwc_pe: out = out + residual_lepe``, the value computed under the same flags inside the
    attention's lines)."""
    if not (isinstance(flag, ast.BoolOp) and isinstance(flag.op, ast.And)):
        return False
    for v in flag.values:
        v = v.operand if isinstance(v, ast.UnaryOp) and isinstance(v.op, ast.Not) else v
        own = isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "self"
        param = isinstance(v, ast.Name) and v.id in scope.args and not scope.assignments.get(v.id)
        if not (own or param):
            return False
    return True


# -- 3. q / k written as calls of a pure method of the class (``einsum(.., self.ema(q), self.ema(k))``) -----------------

# torch functions with no state, no randomness and no in-place effect: a method calling only these (and views, shape
# reads) on its arguments and the module's tensors returns the same value when called again
_PURE_TORCH = frozenset({"einsum", "matmul", "bmm", "mm", "cat", "stack", "exp", "sigmoid", "tanh", "softmax", "tril", "triu",
                         "flip", "roll", "sum", "mean", "sqrt", "rsqrt", "cumsum", "where", "zeros_like", "ones_like"})


def pure_torch_function(func: ast.expr) -> bool:
    """``torch.<fn>`` for a stateless, deterministic ``fn`` (AlgoRepo's ``ema``: ``torch.einsum('bnhad,ga->bnhgd', src,
    self.ema_matrix[:n, :n])``, a registered buffer read)."""
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch" and func.attr in _PURE_TORCH


def operands_are_calls(*texts: str) -> bool:
    """Some operand text is a call (``self.ema(q)``), not a name / attribute / subscript: evaluating it in a run-time
    test before it is bound once would evaluate it again."""
    for t in texts:
        try:
            node = ast.parse(t, mode="eval").body
        except SyntaxError:
            return True
        if any(isinstance(n, ast.Call) for n in ast.walk(node)):
            return True
    return False


# -- 4. a registered ``triu(ones(L, L), diagonal=1)`` buffer as the masked positions (a causal mask) --------------------


def _buffer_values(cls: ast.ClassDef, attr: str) -> list[ast.expr]:
    """Every value the class stores as ``self.<attr>`` (``register_buffer("<attr>", v)`` or ``self.<attr> = v``), a
    local name followed to its single assignment in the same method."""
    from npufuse.scan.dataflow import dotted

    out: list[ast.expr] = []
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            value = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register_buffer" \
                    and len(node.args) >= 2 and const_value(node.args[0]) == attr:
                value = node.args[1]
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and any(
                    dotted(t) == f"self.{attr}" for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
                value = node.value if not isinstance(node, ast.AugAssign) else ast.Constant(None)
            if value is None:
                continue
            if isinstance(value, ast.Name):
                stores = [a.value for a in ast.walk(fn) if isinstance(a, ast.Assign)
                          and any(isinstance(t, ast.Name) and t.id == value.id for t in a.targets)]
                value = stores[0] if len(stores) == 1 else ast.Constant(None)
            out.append(value)
    return out


def triu_buffer_causal(matcher: Any, c: Any) -> Optional[str]:
    """``self.<m>[:n, :n].bool()`` / ``self.<m>.bool()[:n, :n]`` where every value the class stores as ``self.<m>`` is
    ``torch.triu(torch.ones(L, L), diagonal=1)`` (casts allowed): the positions above the diagonal, masked -- the causal
    triangle (the from-scratch GPT buffer; qwen3-from-scratch's 5-D GQA). The slicing kind as
    ``_Matcher._slice_kind`` gives it ("top_left" for ``[:n, :n]``), else None."""
    from npufuse.patterns.attention import Ref, deref

    node, sliced = deref(c), None
    for _ in range(8):
        if matcher.method(node, "bool", "to", "float", "byte", "view", "unsqueeze") and not node.keywords \
                and (not matcher.method(node, "view", "unsqueeze", "to") or matcher.method(node, "to") and len(node.args) == 1):
            node = deref(node.func.value)
        elif isinstance(node, ast.Subscript) and sliced is None:
            sliced, node = node, deref(node.value)
        else:
            break
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, Ref) and node.value.name == "self" and node.value.idx == -1):
        return None
    cls = matcher.module.classes.get(matcher.scope.class_name or "")
    if cls is None or sliced is None:
        return None
    cache = matcher.module.__dict__.setdefault("_npufuse_s47t_triu_buffers", {})
    key = (id(cls), node.attr)
    if key not in cache or cache[key][0] is not cls:
        values = _buffer_values(cls, node.attr)
        cache[key] = (cls, bool(values) and all(matcher._is_local_tri(v, "triu", 1) for v in values))
    if not cache[key][1]:
        return None
    return matcher._slice_kind(sliced)


# -- 5. the pse refusal names its condition ------------------------------------------------------------------------------


def pse_layout_reason(chain: Any, scores_shape: Any) -> str:
    """The near miss where a float bias has no pse npufuse builds: which of the conditions holds (before s47 the reason
    said "not in this layout" also of one-head [B, Sq, Skv] scores made from transposed [B, D, S] q / k, vit-bench's DAT
    form, whose scores are plain: the operands are not)."""
    why = []
    if chain.heads_in_batch:
        why.append("the scores hold the heads folded into the batch ([B*N, Sq, Skv])")
    transposed = [t for t, flag in (("q", chain.q_transposed), ("k", chain.k_transposed), ("v", chain.v_transposed)) if flag]
    if transposed:
        why.append(f"{' / '.join(transposed)} enter{'s' if len(transposed) == 1 else ''} the products transposed ([.., D, S]), "
                   "a form whose bias npufuse does not pass")
    if scores_shape is None and not why:
        why.append("npufuse could not state the scores' shape for the bias")
    return ("a float bias is added to the scores: npufuse passes it as npu_fusion_attention's `pse` only for [B, N, Sq, Skv] "
            "scores of BNSD/BSND q/k or one-head [B, Sq, Skv] scores of [B, S, D] q/k; here " + "; ".join(why or ["another layout"]))
