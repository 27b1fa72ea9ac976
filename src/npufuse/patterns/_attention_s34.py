"""Helpers of the repository read through on the attention chain (s34, HO10 development data).

Uni-Mol's ``softmax_dropout(x, p, training, mask=mask, bias=bias)`` (``x += mask``, ``x += bias``, then
``F.dropout(F.softmax(x, -1), p, training)``), Graphormer's ``softmax_dropout(x, p, training)``, ReaLHF's
``masked_softmax(x, mask, mask_value)`` (``torch.where(mask, x, mask_value)`` then a softmax): a function of the
repository that wraps the softmax with the steps around it. :func:`inlined_helper_body` runs the helper's body
symbolically (the block interpreter the caller's own statements go through) and gives back what it returns as an
expression of the caller's values, so the chain reads the masks, the dropout and the softmax as if written inline.

Refused (None): a body with loops, ``with``, ``try``, nested definitions, a ``return`` anywhere but last, a read of
any name that is neither a parameter, a local, nor a torch import bound the same way in the caller's file (a module
constant, another helper: what it holds is not checked), a decorator that may change what a call does, a starred
or unknown argument. Value-preserving copies (``.contiguous()``, ``.clone()``) are read as their input, so an
``if not inplace: x = x.clone()`` changes nothing; tests the bound arguments decide (``mask is not None`` with the
default ``None``, ``not inplace`` with ``True``) are folded.
"""

from __future__ import annotations

import ast
from typing import Any, Optional

from npufuse.scan import canonical
from npufuse.scan.dataflow import fast_walk

# decorators under which a call runs the body as written (canonical's set, and torch.compile: same values)
_KEEPS_BODY = canonical._EAGER_IDENTITY_DECORATORS | {"torch.compile"}
_COPIES = {"contiguous", "clone"}
_RESULT = "_npufuse_helper_result"


def _decorators_keep_body(fn: ast.FunctionDef, aliases: dict[str, str]) -> bool:
    for dec in fn.decorator_list:
        written = canonical.dotted(dec.func if isinstance(dec, ast.Call) else dec) or ""
        head, _, rest = written.partition(".")
        if not written or head not in aliases or aliases[head] + ("." + rest if rest else "") not in _KEEPS_BODY:
            return False
    return True


def _plain_statements(stmts: list[ast.stmt], top: bool) -> bool:
    """Assignments to names, augmented assignments, ``if`` blocks of them, in-place method calls on a name; one
    ``return`` only as the last top-level statement."""
    for i, st in enumerate(stmts):
        if isinstance(st, ast.Return):
            if not (top and i == len(stmts) - 1 and st.value is not None):
                return False
        elif isinstance(st, ast.Assign):
            if not all(isinstance(t, ast.Name) for t in st.targets):
                return False
        elif isinstance(st, (ast.AugAssign, ast.AnnAssign)):
            if not isinstance(st.target, ast.Name) or isinstance(st, ast.AnnAssign) and st.value is None:
                return False
        elif isinstance(st, ast.If):
            if not _plain_statements(st.body, False) or not _plain_statements(st.orelse, False):
                return False
        elif isinstance(st, ast.Expr):
            v = st.value
            if isinstance(canonical.const_value(v), str):
                continue
            if not (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and isinstance(v.func.value, ast.Name)
                    and v.func.attr.endswith("_") and not v.func.attr.startswith("_")):
                return False
        elif not isinstance(st, ast.Pass):
            return False
        if any(isinstance(n, (ast.Lambda, ast.NamedExpr, ast.comprehension, ast.Yield, ast.YieldFrom, ast.Await, ast.Starred))
               for n in fast_walk(st)):
            return False
    return True


def _static_truth(node: Any) -> Optional[bool]:
    """The truth of a test the bound arguments decide (``None is not None``, ``not True``), else None."""
    if isinstance(node, ast.Constant):
        return bool(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = _static_truth(node.operand)
        return None if inner is None else not inner
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)) \
            and isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value is None:
        left = node.left
        if isinstance(left, ast.Constant):
            return (left.value is None) == isinstance(node.ops[0], ast.Is)
        return None
    if isinstance(node, ast.BoolOp):
        values = [_static_truth(v) for v in node.values]
        if isinstance(node.op, ast.And):
            return False if False in values else None if None in values else True
        return True if True in values else None if None in values else False
    return None


def inlined_helper_body(matcher: Any, node: Any) -> Optional[Any]:
    """What a call of a repository function returns, as an expression of the caller's symbolic values (see the
    module doc); None when ``node`` is not such a call, no argument holds the attention scores, or the body is not
    read."""
    from npufuse.patterns import _attention_s33
    from npufuse.patterns.attention import BlockInterp, Cond, Opaque, Ref, Undef, _heavy

    if not isinstance(node, ast.Call) or not any(_heavy(a, through_meta=False) for a in (*node.args, *(k.value for k in node.keywords))):
        return None
    d = _attention_s33._definition(matcher, node.func)
    fn = d.node if d is not None else None
    if not isinstance(fn, ast.FunctionDef) or fn.args.vararg or fn.args.kwarg:
        return None
    helper_aliases = canonical._file_aliases(d.tree)
    if not _decorators_keep_body(fn, helper_aliases) or not fn.body or not isinstance(fn.body[-1], ast.Return) \
            or not _plain_statements(fn.body, True):
        return None
    bound = _attention_s33._bind(fn, node, skip_self=False)
    params = [p.arg for p in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]
    if bound is None or any(p not in bound for p in params):
        return None
    for p in params:
        if not any(bound[p] is a for a in node.args) and not any(bound[p] is k.value for k in node.keywords) \
                and not isinstance(bound[p], ast.Constant) and not isinstance(canonical.const_value(bound[p]), (int, float)):
            return None  # a default that is an expression of the helper's file (s38: a signed number, ``axis: int = -1``, is a literal)
    body = [st for st in fn.body[:-1] if not (isinstance(st, ast.Expr) and isinstance(canonical.const_value(st.value), str))]
    body.append(ast.Assign(targets=[ast.Name(_RESULT, ast.Store())], value=fn.body[-1].value, lineno=fn.body[-1].lineno))  # type: ignore[attr-defined]
    try:
        interp = BlockInterp(body)
    except Exception:
        return None
    # s38: a local assigned in every arm of an ``if`` (GluonNLP's ``masked_softmax``: ``att_weights`` in both arms) is
    # listed as read before the block too; it is the helper's own, never the caller's (its unassigned reading fails below)
    helper_locals = {t.id for st in fn.body for t in fast_walk(st) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)} - set(bound)
    for name in interp.pre:
        if name in bound or name in helper_locals:
            continue
        # a free name: a torch import, bound the same way in the caller's file (``F``, ``torch``, ``nn``)
        full = helper_aliases.get(name)
        if full is None or matcher.module.aliases.get(name) != full or matcher.scope.assignments.get(name) \
                or _attention_s33.is_parameter(matcher.scope, name):
            return None
    result = interp.after.get(_RESULT)
    if result is None:
        return None
    caller_pre = matcher.interp.pre
    memo: dict[int, Any] = {}

    def caller_name(name: str) -> Any:
        ref = caller_pre.get(name)
        if ref is None:
            ref = caller_pre[name] = Ref(name, -1, None, ast.Name(name, ast.Load()))
        return ref

    def sub(n: Any, depth: int = 0) -> Any:
        if depth > 200:
            raise RecursionError
        if id(n) in memo:
            return memo[id(n)]
        if isinstance(n, Ref):
            if n.idx == -1 and n.value is None:
                if n.name in helper_locals:
                    raise LookupError(n.name)  # a helper local read where no assignment of the helper reaches
                out = bound[n.name] if n.name in bound else caller_name(n.name)
            elif isinstance(n.value, (Opaque, Undef)) or n.value is None:
                raise LookupError(n.name)
            else:
                out = sub(n.value, depth + 1)
        elif isinstance(n, Cond):
            test = sub(n.test, depth + 1)
            truth = _static_truth(test)
            if truth is not None:
                out = sub(n.body if truth else n.orelse, depth + 1)
            else:
                out = Cond()
                out.test, out.body, out.orelse = test, sub(n.body, depth + 1), sub(n.orelse, depth + 1)
        elif isinstance(n, (Opaque, Undef)) or type(n).__module__ != "ast" and not isinstance(n, ast.AST):
            raise LookupError("opaque")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _COPIES and not n.args and not n.keywords:
            out = sub(n.func.value, depth + 1)  # a copy holds the same values
        elif isinstance(n, ast.AST) and type(n).__module__ == "ast":
            out = type(n).__new__(type(n))
            out.__dict__.update(n.__dict__)
            for field, value in ast.iter_fields(n):
                if isinstance(value, list):
                    setattr(out, field, [sub(v, depth + 1) if isinstance(v, ast.AST) else v for v in value])
                elif isinstance(value, ast.AST):
                    setattr(out, field, sub(value, depth + 1))
            # the helper's line numbers mean nothing in the caller's file: the call's own
            for attr in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
                if hasattr(n, attr) and hasattr(node, attr):
                    setattr(out, attr, getattr(node, attr))
        else:
            raise LookupError(type(n).__name__)
        memo[id(n)] = out
        return out

    try:
        out = sub(result)
    except (LookupError, RecursionError):
        return None
    # a helper that wraps a softmax: one the chain reads is in what it returns (a hand-written exp / sum is left to
    # the softmax-body proof and its near miss)
    from npufuse.patterns.attention import walk_values

    if not any(isinstance(n, ast.Call) and matcher.softmax_of(n) is not None for n in walk_values(out)):
        return None
    return out


def proven_3d(matcher: Any, node: Any) -> bool:
    """``node`` is a 3-D tensor where the code says so: :func:`attention.static_rank` reads 3, or it is the result of
    ``self.<m>(x)``, a method of this class whose one ``return`` is a ``view`` / ``reshape`` with three sizes
    (rtdl's ``_reshape``: ``x.reshape(b, s, h, d).transpose(1, 2).reshape(b * h, s, d)``, heads folded into the batch)."""
    from npufuse.patterns.attention import Ref, deref, static_rank

    if static_rank(matcher.scope, node, matcher._line) == 3:
        return True
    from npufuse.patterns import _attention_s35

    if _attention_s35.rank_through_helpers(matcher, node) == 3:
        return True  # s35: DexVLA's ``apply_rotary_pos_emb_vision(q.unsqueeze(0), rope).squeeze(0)`` (ranks checked at run time)
    n = deref(node)
    from npufuse.patterns import _attention_s45

    if _attention_s45.head_indexed_3d(n, matcher.scope, matcher._line):
        return True  # s45: ``query_states[:, h, :, :]`` in a per-head loop (MiniMax-M2), ranks checked at run time
    for _ in range(4):
        # ``self.W_key(x)`` with ``self.W_key = nn.Linear(..)``: a linear layer keeps its input's rank
        if isinstance(n, ast.Call) and len(n.args) == 1 and not n.keywords and isinstance(n.func, ast.Attribute) \
                and isinstance(n.func.value, Ref) and n.func.value.name == "self" and n.func.value.idx == -1:
            ctor = matcher._module_attr_ctor(n.func)
            if ctor is None or matcher.module.canonical(ctor.func) != "torch.nn.Linear":
                break
            n = deref(n.args[0])
        else:
            break
    if isinstance(n, Ref) and n.idx == -1 and _unpacked_as_3d(matcher.scope.node, n.name):
        return True
    if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, Ref)
            and n.func.value.name == "self" and n.func.value.idx == -1):
        return False
    cls = matcher.module.classes.get(matcher.scope.class_name or "")
    fn = next((st for st in cls.body if isinstance(st, ast.FunctionDef) and st.name == n.func.attr), None) if cls is not None else None
    if fn is None or fn.decorator_list:
        return False
    returns = [st for st in fast_walk(fn) if isinstance(st, ast.Return)]
    if len(returns) != 1 or returns[0] is not fn.body[-1]:
        return False
    ret = returns[0].value
    if not (isinstance(ret, ast.Call) and isinstance(ret.func, ast.Attribute) and ret.func.attr in ("view", "reshape") and not ret.keywords):
        return False
    args = ret.args
    if len(args) == 1 and isinstance(args[0], (ast.Tuple, ast.List)):
        args = args[0].elts
    return len(args) == 3 and not any(isinstance(a, ast.Starred) for a in args) and not (len(ret.args) == 1 and not isinstance(ret.args[0], (ast.Tuple, ast.List)))


def _unpacked_as_3d(fn: Any, name: str) -> bool:
    """``b, t, d = name.shape`` (or ``name.size()``) in ``fn``, three plain targets: the unpacking raises unless
    ``name`` is 3-D (rasbt's ``b, num_tokens, d_in = x.shape`` before ``self.W_key(x)``); ``name`` a parameter
    never reassigned in ``fn``."""
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    found = False
    for st in fast_walk(fn):
        if isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = st.targets if isinstance(st, ast.Assign) else [st.target]
            if any(isinstance(t, ast.Name) and t.id == name for tt in targets for t in fast_walk(tt)):
                return False  # reassigned: the unpacked tensor may not be the one that reaches the product
            v = st.value
            shape_of = v.value if isinstance(v, ast.Attribute) and v.attr == "shape" else \
                v.func.value if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "size" and not v.args else None
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Tuple) \
                    and len(st.targets[0].elts) == 3 and all(isinstance(e, ast.Name) for e in st.targets[0].elts) \
                    and isinstance(shape_of, ast.Name) and shape_of.id == name:
                found = True
    return found
