"""rms_norm: ``x * rsqrt(mean(x**2, -1, keepdim=True) + eps) * w`` -> ``torch_npu.npu_rms_norm``.

Found by what the code computes: a product in which one factor is ``rsqrt(mean(y**2) + eps)``
(or a division by ``sqrt(...)``) and another is ``x`` with ``y`` and ``x`` the same value up to
dtype, followed outwards through casts, the weight multiply and local names, and into small
helpers of the same module (Meta's ``self._norm(x.float())``). The parse records what the
replacement must reproduce: the eps expression, the weight expression and its ``1 +`` offset,
where the fp32 upcast happens and the dtype that comes out (HF Llama returns
``promote(weight.dtype, input_dtype)``; Gemma casts back after the weight; T5 casts to the weight's
dtype only when it is half).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from npufuse.patterns import _library_norm, _norm_s43, _norm_s44h, _rms_norm_s45sweep, _rms_norm_s46b, _rms_norm_s47n
from npufuse.patterns import _rms_norm_s48f, _rms_norm_s48h, _rms_norm_s51b
from npufuse.patterns import _rms_norm_s51m
from npufuse.patterns import _site as S
from npufuse.patterns.base import Finding, Fuse, Keep, NearMiss, Pattern, Result, Risk
from npufuse.scan.dataflow import ModuleInfo, Scope, calls_on_lines, child_nodes, const_value, dotted, fast_walk, lines_with, may_raise_to_power, text_holds_any
from npufuse.scan.value import estimate, symbolic

if TYPE_CHECKING:  # torch is imported only to run a reference, never to scan
    import torch

# --------------------------------------------------------------------------------------------
# parse results


class NoMatch(Exception):
    """Not an RMSNorm (silently: plainly other code)."""


class Miss(Exception):
    """Looks like an RMSNorm but must not be replaced as is."""

    def __init__(self, reason: str, rstd: ast.AST | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.rstd = rstd


@dataclass
class Core:
    x: ast.expr  # the normalized operand (a name or attribute), evaluated in ``xctx``
    xctx: S.Ctx
    x_key: str
    eps: ast.expr
    eps_ctx: S.Ctx
    upcast: bool  # the statistics (and the normalized value) are computed in fp32
    rstd: ast.AST  # the rsqrt/sqrt node (identity of the site for near-miss bookkeeping)
    rstd_ops: list[str] = field(default_factory=list)  # unfused kernels of the core, for assess
    # dims of the mean read at run time (``self.dim``, -1 by the class's own default): the fused
    # branch runs only when each is -1 at run time, else the original code
    dim_checks: list[tuple[ast.expr, S.Ctx]] = field(default_factory=list)


@dataclass
class Op:
    kind: str  # "cast" | "condcast" | "mul"
    node: ast.expr  # the cast call, or the weight factor
    ctx: S.Ctx
    dtype: tuple | None = None  # cast target (see _cast_target)
    test: ast.expr | None = None  # condcast: the if-test
    test_ctx: S.Ctx | None = None


@dataclass
class Match:
    core: Core
    ops: list[Op]  # innermost first
    node: ast.expr  # the matched expression (the norm's output)
    ctx: S.Ctx
    trace: S.Trace
    helpers: set[int]

    @property
    def weights(self) -> list[Op]:
        return [o for o in self.ops if o.kind in ("mul", "condmul")]

    @property
    def condition(self) -> Op | None:
        return next((o for o in self.ops if o.kind == "condmul"), None)


# dtype symbols: ("in",) the input's dtype, ("f32",), ("fixed", "torch.bfloat16"), ("like", src),
# ("promote", a, b), ("cond", test_src, then, else)
D_IN = ("in",)
D_F32 = ("f32",)


def _promote(a: tuple, b: tuple) -> tuple:
    if a == b:
        return a
    if a[0] == "cond":  # promote(t ? p : q, b) = t ? promote(p, b) : promote(q, b)
        return _simplify_cond(("cond", a[1], _promote(a[2], b), _promote(a[3], b)))
    if b[0] == "cond":
        return _promote(b, a)
    for d in (a, b):
        if d == ("fixed", "torch.float64"):
            return d
    if D_F32 in (a, b):
        return D_F32  # float32 with fp16/bf16/fp32 (fp64 weights are not a thing in these models)
    return ("promote",) + tuple(sorted((a, b), key=_dtype_sort_key))


def _dtype_sort_key(d: object) -> str:
    """A dtype symbol's text without memory addresses: ("like", <ast node>, ...) holds AST nodes, whose
    repr names their address, so sorting by repr ordered a promote's operands by where the nodes happen
    to live (the rendered ``promote_types(a, b)`` changed between runs)."""
    if isinstance(d, ast.AST):
        return ast.dump(d)
    if isinstance(d, tuple):
        return "(" + ", ".join(_dtype_sort_key(e) for e in d) + ")"
    return repr(d)


def _simplify_cond(d: tuple) -> tuple:
    return d[2] if d[2] == d[3] else d


# --------------------------------------------------------------------------------------------
# the parse


@dataclass
class _Factor:
    node: ast.expr
    ctx: S.Ctx
    inverse: bool


def _is_muldiv(n: ast.AST) -> bool:
    return isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mult, ast.Div))


def _flatten(node: ast.expr, ctx: S.Ctx, trace: S.Trace, inverse: bool, out: list[_Factor]) -> None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        _flatten(node.left, ctx, trace, inverse, out)
        _flatten(node.right, ctx, trace, inverse, out)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        _flatten(node.left, ctx, trace, inverse, out)
        _flatten(node.right, ctx, trace, not inverse, out)
    elif isinstance(node, ast.Name):
        value, vctx, stmt = S.follow(node, ctx)
        if value is not node and _is_muldiv(value):
            S.follow(node, ctx, trace)
            _flatten(value, vctx, trace, inverse, out)
        else:
            out.append(_Factor(node, ctx, inverse))
    else:
        out.append(_Factor(node, ctx, inverse))


def _peel_any(node: ast.expr, ctx: S.Ctx, trace: S.Trace) -> tuple[ast.expr, S.Ctx]:
    """Through names (recorded) and helper-parameter bindings."""
    return S.peel(node, ctx, trace)


def _strip_casts(module: ModuleInfo, node: ast.expr, ctx: S.Ctx, trace: S.Trace) -> tuple[ast.expr, S.Ctx, bool]:
    """Through names and dtype casts; returns (inner, ctx, saw an fp32 upcast)."""
    up = False
    for _ in range(32):
        node, ctx = _peel_any(node, ctx, trace)
        if S.is_cast(node):
            t = S.cast_dtype(module, node, ctx)
            if t is not None and t[0] == "torch.float32":
                up = True
            node = node.func.value  # type: ignore[union-attr]
            continue
        break
    return node, ctx, up



def _reads_a_mean(module: ModuleInfo, node: ast.expr, ctx: Any) -> bool:
    """The expression under a root computes a mean or a variance (``x.pow(2).mean(-1)``, ``torch.mean(x * x)``,
    ``x.var(-1)``), through local names: a norm's statistic, not a count or a constant."""
    peeled, _ = S.peel(node, ctx)
    for n in ast.walk(peeled):
        if isinstance(n, ast.Call):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id if isinstance(n.func, ast.Name) else ""
            if name in ("mean", "var", "norm", "square", "sum", "vector_norm"):
                return True
    return False

def _call_of(module: ModuleInfo, node: ast.AST, torch_fn: str, method: str) -> tuple[ast.expr, ast.Call, int] | None:
    """``torch.fn(t, ...)`` or ``t.method(...)``: (operand, call, index of the first non-operand arg)."""
    if not isinstance(node, ast.Call):
        return None
    if module.call_name(node) == torch_fn and node.args:
        return node.args[0], node, 1
    if isinstance(node.func, ast.Attribute) and node.func.attr == method and module.canonical(node.func) != torch_fn:
        return node.func.value, node, 0
    return None


def _square_operand(module: ModuleInfo, node: ast.expr, ctx: S.Ctx) -> ast.expr | None:
    """y for ``y**2``, ``y.pow(2)``, ``torch.pow(y, 2)``, ``torch.square(y)``, ``y*y``."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and const_value(node.right) in (2, 2.0):
        return node.left
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and S.key(node.left, ctx) == S.key(node.right, ctx):
        return node.left
    c = _call_of(module, node, "torch.pow", "pow")
    if c is not None:
        operand, call, k = c
        if len(call.args) > k and const_value(call.args[k]) in (2, 2.0):
            return operand
    c = _call_of(module, node, "torch.square", "square")
    if c is not None:
        return c[0]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        from npufuse.scan import canonical  # builtin pow(y, 2), torch's pow/square imported by name

        return canonical.name_square_operand(module, node)
    return None


def _is_mean_of(module: ModuleInfo, node: ast.expr, ctx: S.Ctx, of_key: str) -> bool:
    node, ctx, _ = _strip_casts(module, node, ctx, S.Trace())
    c = _call_of(module, node, "torch.mean", "mean")
    return c is not None and S.key(c[0], ctx) == of_key


def _mean_of_square(module: ModuleInfo, node: ast.expr, ctx: S.Ctx, trace: S.Trace, rstd: ast.AST,
                    dim_checks: list[tuple[ast.expr, S.Ctx]] | None = None) -> tuple[ast.expr, S.Ctx, bool]:
    """(y, ctx, upcast) for ``mean(y**2, dim=-1, keepdim=True)``; Miss for LayerNorm/dim/keepdim.

    A dim read from an attribute that the class's ``__init__`` sets to -1 by default (lit-llama's
    ``self.dim = dim`` with ``dim: int = -1``) is appended to ``dim_checks``: the fused branch
    tests it at run time."""
    v, vctx, up = _strip_casts(module, node, ctx, trace)
    var = _call_of(module, v, "torch.var", "var")
    if var is not None:
        raise Miss("mean subtracted (LayerNorm): variance about the mean", rstd)
    c = _call_of(module, v, "torch.mean", "mean")
    if c is None:
        raise NoMatch
    operand, call, k = c
    sq, sqctx, up2 = _strip_casts(module, operand, vctx, trace)
    y = _square_operand(module, sq, sqctx)
    if y is None:
        raise NoMatch
    y_inner, yctx, up3 = _strip_casts(module, y, sqctx, S.Trace())
    if isinstance(y_inner, ast.BinOp) and isinstance(y_inner.op, ast.Sub):
        # (x - mean(x)) ** 2: a LayerNorm (or its variance)
        if _is_mean_of(module, y_inner.right, yctx, S.key(y_inner.left, yctx)):
            raise Miss("mean subtracted (LayerNorm)", rstd)
    dim = S.arg(call, "dim", k)
    if dim is None:
        dim = S.arg(call, "axis", k)
    keepdim = S.arg(call, "keepdim", k + 1)
    if keepdim is None:
        # ``mean(-1, keepdims=True)``: torch's argument parser takes numpy's spelling as keepdim
        keepdim = S.arg(call, "keepdims", None)
    if dim is None:
        raise Miss("mean over all elements, not over the last dim", rstd)
    if not S.is_last_dim_expr(dim):
        if isinstance(const_value(dim), int) and not _asserted_last_dim(ctx, y_inner, const_value(dim)):
            raise Miss(f"mean over dim {ast.unparse(dim)}, not the last dim", rstd)
        if isinstance(const_value(dim), int):
            if const_value(keepdim) is not True:
                raise Miss("mean without keepdim=True", rstd)
            return y, sqctx, up or up2 or up3
        trailing = _trailing_dims_of(module, dim, vctx, trace)
        if trailing is None:  # s44: ``range(x.ndim - k, x.ndim)``, the rank read from the squared tensor
            trailing = _norm_s44h.trailing_dims_from_rank(module, dim, vctx, trace, S.key(y, sqctx))
        if trailing is None:  # s45: ``tuple(range(-len(shape), 0))``
            trailing = _rms_norm_s45sweep.trailing_dims_counted_to_zero(dim, vctx, trace)
        if trailing is not None and dim_checks is not None:
            # ``dims = tuple(range(-1, -len(shape) - 1, -1))``: the last len(shape) dims; the fused
            # branch runs when that is the last dim alone (len(shape) == 1), the original otherwise
            dim_checks.append(trailing)
            if const_value(keepdim) is not True:
                raise Miss("mean without keepdim=True", rstd)
            return y, sqctx, up or up2 or up3
        why = _default_last_dim(module, dim, vctx)
        if why is not None and dim_checks is not None and _value_from_outside(dim, vctx):
            # s36: a dim the caller or the object hands in (an ``axis`` parameter, ``self.axis``):
            # the fused branch runs where it names the last dim at run time, the original elsewhere
            dim_checks.append((dim, vctx, "rank"))  # type: ignore[arg-type]
            why = None
        elif why is not None or dim_checks is None:
            read = _rms_norm_s51m.dims_reason(dim, vctx, S.key(y, sqctx))  # s51: the dims read from the expression
            if read is not None:
                raise Miss(read, rstd)
            raise Miss(f"mean over dim `{ast.unparse(dim)}`, {why or 'a run-time value'}: npufuse cannot prove it to be "
                       "the last dim (npu_rms_norm normalises the last dims only)", rstd)
        else:
            dim_checks.append((dim, vctx))
    restored = _rms_norm_s47n.keepdim_by_unsqueeze(module, rstd, dim, keepdim)  # s47: mean(-1) then .unsqueeze(-1)
    if restored is False:
        raise Miss("mean with keepdim=True, then unsqueeze(-1): one axis more than the input has", rstd)
    if const_value(keepdim) is not True and not restored:
        raise Miss("mean without keepdim=True", rstd)
    return y, sqctx, up or up2 or up3


_RUNTIME_DIM = "a run-time value"


def _value_from_outside(dim: ast.expr, ctx: S.Ctx) -> bool:
    """``dim`` is a parameter of the function holding it that the function never rebinds, or an
    attribute chain of one (``self.axis``, ``cfg.norm.dim``): a value handed in from outside, the
    same at the top of the fused span as where the mean reads it (a name the function computes,
    such as a tuple of dims, is not: its reason stands)."""
    base = dim
    while isinstance(base, ast.Attribute):
        base = base.value
    fn = ctx.scope.node
    if not (isinstance(base, ast.Name) and isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))):
        return False
    params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    if base.id not in params:
        return False
    return not any(isinstance(n, ast.Name) and n.id == base.id and isinstance(n.ctx, (ast.Store, ast.Del))
                   for n in ast.walk(fn))


def _trailing_dims_of(module: ModuleInfo, dim: ast.expr, ctx: S.Ctx, trace: S.Trace) -> tuple[ast.expr, S.Ctx] | None:
    """For a name holding ``tuple(range(-1, -len(shape) - 1, -1))`` (also as ``tuple(i for i in
    range(...))`` or a list comprehension): ``(-len(shape), ctx)``, so that the run-time dim check
    ``-len(shape) == -1`` holds exactly when the dims are the last one alone (InternEvo's
    ``manual_rms_norm``)."""
    if not isinstance(dim, ast.Name):
        return None
    value, vctx, stmt = S.follow(dim, ctx)
    if value is dim or stmt is None:
        return None
    rng = value
    if isinstance(rng, ast.Call) and isinstance(rng.func, ast.Name) and rng.func.id in ("tuple", "list") and len(rng.args) == 1 and not rng.keywords:
        rng = rng.args[0]
    if isinstance(rng, (ast.GeneratorExp, ast.ListComp)) and len(rng.generators) == 1:
        gen = rng.generators[0]
        if gen.ifs or gen.is_async or not (isinstance(gen.target, ast.Name) and isinstance(rng.elt, ast.Name) and rng.elt.id == gen.target.id):
            return None
        rng = gen.iter
    if not (isinstance(rng, ast.Call) and isinstance(rng.func, ast.Name) and rng.func.id == "range" and len(rng.args) == 3 and not rng.keywords):
        return None
    start, stop, step = rng.args
    if const_value(start) != -1 or const_value(step) != -1:
        return None
    # stop: -len(shape) - 1, or -n - 1 with n a name bound once to len(shape) (timm's
    # ``norm_ndim = len(normalized_shape)``): the check reads the name where the norm is
    if not (isinstance(stop, ast.BinOp) and isinstance(stop.op, ast.Sub) and const_value(stop.right) == 1
            and isinstance(stop.left, ast.UnaryOp) and isinstance(stop.left.op, ast.USub)):
        return None
    count = stop.left.operand
    if isinstance(count, ast.Name):
        count = S.follow(count, vctx)[0]
    if not (isinstance(count, ast.Call) and isinstance(count.func, ast.Name) and count.func.id == "len" and len(count.args) == 1):
        return None
    S.follow(dim, ctx, trace)
    return stop.left, vctx


def _default_last_dim(module: ModuleInfo, dim: ast.expr, ctx: S.Ctx) -> str | None:
    """None when ``dim`` is ``self.<attr>`` that ``__init__`` sets to -1, or to a parameter whose
    default is -1 and that no constructor call of the class in this module passes; else what
    stands in the way (for the near-miss reason)."""
    fn = ctx.scope.node
    cls = ctx.scope.class_name
    if not (isinstance(dim, ast.Attribute) and isinstance(dim.value, ast.Name) and cls
            and isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))):
        return _RUNTIME_DIM
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    if not params or dim.value.id != params[0]:
        return _RUNTIME_DIM
    value = S.init_assignments(module, cls).get(dim.attr)
    if value is None:
        return f"{_RUNTIME_DIM} not set in {cls}.__init__"
    if S.const_dim(value) == -1:
        return None
    if not isinstance(value, ast.Name):
        return f"{_RUNTIME_DIM} (`{ast.unparse(value)}` in {cls}.__init__)"
    init = S.init_params(module, cls)
    if value.id not in init or S.const_dim(init[value.id]) != -1:
        return f"{_RUNTIME_DIM} (the {cls}.__init__ parameter `{value.id}` has no default -1)"
    line = _constructor_passing(module, cls, value.id)
    if line is not None:
        return f"{_RUNTIME_DIM} (the {cls}(...) call at line {line} may pass `{value.id}`)"
    return None


def _constructor_passing(module: ModuleInfo, cls: str, param: str) -> int | None:
    """Line of a call ``cls(...)`` in this module that passes ``param`` (other than -1) or may
    (``*args``/``**kwargs``); None when every call leaves it at its default."""
    init = S.method(module, cls, "__init__")
    if init is None:
        return None
    pos = [a.arg for a in (*init.args.posonlyargs, *init.args.args)][1:]
    i = pos.index(param) if param in pos else None
    cache = module.__dict__.setdefault("_npufuse_rms_ctor_calls", {})
    calls = cache.get(cls)
    if calls is None:
        calls = cache[cls] = [n for n in ast.walk(module.tree) if isinstance(n, ast.Call)
                              and (getattr(n.func, "id", None) == cls or getattr(n.func, "attr", None) == cls)]
    for c in calls:
        if any(isinstance(a, ast.Starred) for a in c.args) or any(k.arg is None for k in c.keywords):
            return c.lineno
        passed = next((k.value for k in c.keywords if k.arg == param), None)
        if passed is None and i is not None and len(c.args) > i:
            passed = c.args[i]
        if passed is not None and S.const_dim(passed) != -1:
            return c.lineno
    return None


def _pow_operand(module: ModuleInfo, node: ast.expr, exponent: float) -> ast.expr | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and const_value(node.right) == exponent:
        return node.left
    c = _call_of(module, node, "torch.pow", "pow")
    if c is not None:
        operand, call, k = c
        if len(call.args) > k and const_value(call.args[k]) == exponent:
            return operand
    return None


def _rstd(module: ModuleInfo, f: _Factor, trace: S.Trace) -> tuple[ast.expr, S.Ctx, ast.expr, S.Ctx, ast.AST, list[str]] | None:
    """For a factor ``rsqrt(V + eps)`` (or an inverse factor ``sqrt(V + eps)``): (V, eps, node)."""
    node, ctx = _peel_any(f.node, f.ctx, trace)
    node, ctx, _ = _strip_casts(module, node, ctx, trace)
    node, ctx, unsqueezed = _rms_norm_s47n.peel_unsqueeze(node, ctx, trace, _peel_any)  # s47: ``rms.unsqueeze(-1)``
    if unsqueezed:
        node, ctx, _ = _strip_casts(module, node, ctx, trace)
    for _ in range(2):
        # the rstd returned by a helper of this module (``def _rstd(x, eps): return rsqrt(...)``):
        # read in the helper's body with its parameters bound to the call's arguments
        if not isinstance(node, ast.Call) or S.is_cast(node) or not _root_helper_call(module, node, ctx):
            break
        callee = S.resolve_callee(module, node, ctx)
        assert callee is not None
        fn, is_method = callee
        ret = _helper_return(fn)
        hctx = S.bind_call(module, node, fn, ctx, is_method) if ret is not None else None
        if ret is None or hctx is None:
            return None
        node, ctx = _peel_any(ret.value, hctx.at(ret.lineno), trace)  # type: ignore[arg-type]
        node, ctx, _ = _strip_casts(module, node, ctx, trace)
    inner: ast.expr | None = None
    ops: list[str] = []
    if not f.inverse:
        c = _call_of(module, node, "torch.rsqrt", "rsqrt")
        if c is not None:
            inner, ops = c[0], ["rsqrt"]
        else:
            inner = _pow_operand(module, node, -0.5)
            ops = ["pow"]
    else:
        c = _call_of(module, node, "torch.sqrt", "sqrt")
        if c is not None:
            inner, ops = c[0], ["sqrt", "div"]
        else:
            inner = _pow_operand(module, node, 0.5)
            ops = ["pow", "div"]
            if inner is None and isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
                # x / (sqrt(mean(x**2)) + eps): eps added after the root
                for side in (node.left, node.right):
                    s_node, s_ctx = S.peel(side, ctx)
                    c_root = _call_of(module, s_node, "torch.sqrt", "sqrt")
                    root = c_root[0] if c_root is not None else _pow_operand(module, s_node, 0.5)
                    # s40 (audit40): only a root of a mean (of squares) is a norm; FasterViT's step size
                    # ``w / (n ** 0.5 + 1)`` divides by the root of a count
                    if root is not None and _reads_a_mean(module, root, s_ctx):
                        other = node.right if side is node.left else node.left
                        r_node, r_ctx, _ = _strip_casts(module, *_peel_any(root, s_ctx, S.Trace()), S.Trace())
                        if _rms_norm_s46b.tiny_literal_eps(module, other, ctx.scope) is not None \
                                and _call_of(module, r_node, "torch.mean", "mean") is not None:
                            # s46b: a tiny literal eps outside the root is read as eps**2 inside it (s36's probe form)
                            inner, ops = _rms_norm_s46b.root_plus_eps(root, other), ["sqrt", "div", _rms_norm_s46b.EPS_OUTSIDE]
                            break
                        raise Miss("eps outside the sqrt: x / (sqrt(mean(x^2)) + eps) is not npu_rms_norm's x * rsqrt(mean(x^2) + eps)", node)
    if inner is None:
        return None
    rnode = node
    if unsqueezed:
        _rms_norm_s47n.mark(module, rnode)
    e, ectx = _peel_any(inner, ctx, trace)
    e, ectx, _ = _strip_casts(module, e, ectx, trace)
    pair: tuple[ast.expr, ast.expr] | None = None
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add):
        pair = (e.left, e.right)
    else:
        c = _call_of(module, e, "torch.add", "add") or _inplace_add_on_temporary(e)
        if c is not None and len(c[1].args) > c[2]:
            pair = (c[0], c[1].args[c[2]])
    if pair is None:
        return None
    for v, eps in (pair, pair[::-1]):
        vv, vctx, _ = _strip_casts(module, v, ectx, S.Trace())
        if _call_of(module, vv, "torch.mean", "mean") is not None or _call_of(module, vv, "torch.var", "var") is not None:
            return v, ectx, eps, ectx, rnode, ["mean", "add"] + ops
    return None


def _root_helper_call(module: ModuleInfo, call: ast.Call, ctx: S.Ctx) -> bool:
    """A call of a helper of this module whose single return is an inverse square root."""
    callee = S.resolve_callee(module, call, ctx)
    if callee is None:
        return False
    ret = _helper_return(callee[0])
    return ret is not None and ret.value is not None and _calls_sqrt_helper(module, callee[0]) \
        and bool(_TORCH_ROOT.search(ast.unparse(ret.value)) or isinstance(ret.value, ast.Name))


def _peel_x(module: ModuleInfo, node: ast.expr, ctx: S.Ctx, trace: S.Trace, dtype_checks: list | None = None) -> tuple[ast.expr, S.Ctx, bool, int]:
    """The normalized operand: through names defined as casts (and helper bindings), stripping
    casts; stops at a name whose value is computed otherwise. Returns (leaf, ctx, upcast, casts)."""
    up = False
    n_casts = 0
    cond_cast = False  # s48: a conditional upcast seen (see _rms_norm_s48h); no cast may follow it
    for _ in range(32):
        if isinstance(node, ast.Name):
            value, vctx, stmt = S.follow(node, ctx)
            if value is node:
                break
            if stmt is None or S.is_cast(value) or isinstance(value, ast.Name):
                S.follow(node, ctx, trace)
                node, ctx = value, vctx
                continue
            break
        if S.is_cast(node):
            t = S.cast_dtype(module, node, ctx)
            if t is None:
                t = _rms_norm_s48h.peel_hook(module, node, ctx, dtype_checks, cond_cast)  # s48: conditional upcast
                cond_cast = True
            elif cond_cast and t[0] != "same":
                raise NoMatch
            if t[0] == "torch.float32":
                up = True
            if t[0] != "same":
                n_casts += 1
            node = node.func.value  # type: ignore[union-attr]
            continue
        break
    if cond_cast and dtype_checks is not None:
        dtype_checks.append((node, ctx, "dtype"))
    return node, ctx, up, n_casts


def _factor_cast(module: ModuleInfo, f: _Factor, x_key: str) -> tuple | None:
    """The dtype the rstd factor is cast to last before the product (``D_IN`` for ``.to(x.dtype)`` /
    ``.type_as(x)`` of the normalized input), or None when its outermost step is no cast."""
    node, ctx = f.node, f.ctx
    for _ in range(32):
        node, ctx = _peel_any(node, ctx, S.Trace())
        if not S.is_cast(node):
            return None
        t = _cast_target(module, node, ctx, x_key)
        if t != ("same",):
            return t
        node = node.func.value  # type: ignore[union-attr]
    return None


def _find_core(module: ModuleInfo, factors: list[_Factor], trace: S.Trace) -> tuple[Core, list[_Factor]] | None:
    for i, f in enumerate(factors):
        t = trace.copy()
        r = _rstd(module, f, t)
        if r is None:
            continue
        v, vctx, eps, ectx, rnode, rops = r
        checks: list[tuple[ast.expr, S.Ctx]] = []
        y, yctx, up_y = _mean_of_square(module, v, vctx, t, rnode, checks)
        y_key = S.key(y, yctx)
        for j, g in enumerate(factors):
            if j == i or g.inverse:
                continue
            t2 = t.copy()
            dchecks: list = []
            leaf, lctx, up_x, n_casts = _peel_x(module, g.node, g.ctx, t2, dchecks)
            if S.key(leaf, lctx) != y_key:
                continue
            checks.extend(dchecks)  # s48: the input dtypes a conditional upcast is float32 for
            if not (isinstance(leaf, (ast.Name, ast.Attribute)) and dotted(leaf)):
                raise Miss("the normalized input is computed inline; assign it to a name first", rnode)
            if y_key in S.key(eps, ectx):
                raise NoMatch
            trace.stmts.update(t2.stmts)
            rest = [h for k, h in enumerate(factors) if k not in (i, j) and const_value(h.node) not in (1, 1.0)]
            ops = (["cast"] * n_casts if up_x else []) + ["pow"] + rops + ["mul"]
            upcast = up_x or up_y
            if up_y and not up_x and _factor_cast(module, f, y_key) == D_IN:
                # s43: ``x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)``: the statistics
                # are fp32 but the factor is cast back before the product, so the normalized value is in the
                # input's dtype (read as fp32 it gave an fp32 result where the original returns bf16)
                upcast = False
            return Core(leaf, lctx, y_key, eps, ectx, upcast, rnode, ops, checks), rest
    return None


def _cast_target(module: ModuleInfo, cast: ast.Call, ctx: S.Ctx, x_key: str | None, trace: S.Trace | None = None) -> tuple | None:
    t = S.cast_dtype(module, cast, ctx, trace)
    if t is None:
        return None
    kind, expr, ectx = t
    if kind == "same":
        return ("same",)
    if kind == "like":
        assert expr is not None
        if x_key is not None and S.key(expr, ectx) == x_key:
            return D_IN
        return ("like", expr, ectx)
    if kind == "expr":
        return ("expr", expr, ectx)
    if kind == "torch.float32":
        return D_F32
    return ("fixed", kind)


def _conditional_if(ctx: S.Ctx, stmt: ast.stmt) -> ast.stmt | None:
    idx = S.stmt_index(ctx.scope)
    use = idx.by_line.get(ctx.line)
    use_anc = {id(a) for a in S.ancestors(idx, use)} if use is not None else set()
    for anc in S.ancestors(idx, stmt):
        if isinstance(anc, S._CONDITIONAL) and id(anc) not in use_anc:
            return anc
    return None


def _chain(module: ModuleInfo, node: ast.expr, ctx: S.Ctx, trace: S.Trace, helpers: set[int], depth: int = 0) -> tuple[Core, list[Op]]:
    """Parse outwards-in from the norm's output; returns the core and the ops, outermost first."""
    ops: list[Op] = []
    for _ in range(64):
        if isinstance(node, ast.Name):
            value, vctx, stmt = S.follow(node, ctx, None, allow_conditional=True)
            if value is node:
                raise NoMatch
            for st, f in reversed(_rms_norm_s48f.inplace_scale(ctx, node)):  # s48: ``out.mul_(s)`` before the use
                if ctx.depth == 0:
                    trace.add(st)
                _rms_norm_s48f.mark_inplace(module, f)
                ops.append(Op("mul", f, ctx.at(st.lineno)))
            cond = _conditional_if(ctx, stmt) if stmt is not None else None
            if cond is not None:
                simple = isinstance(cond, ast.If) and not cond.orelse and all(isinstance(s, ast.Assign) for s in cond.body)
                # T5: ``if self.weight.dtype in [fp16, bf16]: h = h.to(self.weight.dtype)`` -- a cast
                # that may not happen
                if simple and S.is_cast(value) and _is_name(value.func.value, node.id):  # type: ignore[union-attr]
                    S.follow(node, ctx, trace, allow_conditional=True)
                    ops.append(Op("condcast", value, vctx, None, cond.test, ctx.at(cond.lineno)))  # type: ignore[attr-defined]
                    node, ctx = value.func.value, vctx  # type: ignore[union-attr]
                    continue
                # Gemma3n: ``if self.with_scale: h = h * self.weight.float()`` -- an optional weight
                other = _other_factor(value, node.id)
                if simple and other is not None:
                    S.follow(node, ctx, trace, allow_conditional=True)
                    ops.append(Op("condmul", other, vctx, None, cond.test, ctx.at(cond.lineno)))  # type: ignore[attr-defined]
                    node, ctx = ast.copy_location(ast.Name(node.id, ast.Load()), value), vctx
                    continue
                # an optional bias after the norm (``if self.shift is not None: y = y + self.shift``):
                # the fused code runs on the path without it (the test false), the original on the other
                if simple and _added_term(value, node.id) is not None:
                    S.follow(node, ctx, trace, allow_conditional=True)
                    ops.append(Op("skip", value, vctx, None, cond.test, ctx.at(cond.lineno)))  # type: ignore[attr-defined]
                    node, ctx = ast.copy_location(ast.Name(node.id, ast.Load()), value), vctx
                    continue
                # Gemma: ``if self.add_unit_offset: h = h * (1 + w) else: h = h * w`` -- one weight
                # factor chosen by the test, read as ``h * ((1 + w) if test else w)``
                sel = _selected_factor(cond, node.id)
                if sel is not None:
                    S.follow(node, ctx, trace, allow_conditional=True)
                    ops.append(Op("mul", sel, ctx.at(cond.lineno)))
                    node, ctx = ast.copy_location(ast.Name(node.id, ast.Load()), value), ctx.at(cond.lineno)
                    continue
                raise _through_control_flow(module, value, vctx, node, cond, ctx)
            S.follow(node, ctx, trace)
            node, ctx = value, vctx
            continue
        if S.is_cast(node):
            if S.cast_dtype(module, node, ctx) is None:
                raise NoMatch  # .to(device) and friends
            ops.append(Op("cast", node, ctx))
            node = node.func.value  # type: ignore[union-attr]
            continue
        if isinstance(node, ast.IfExp):
            for branch in (node.body, node.orelse):
                found = _probe(module, branch, ctx)
                if found is not None:
                    raise Miss("control flow (a conditional expression) between the norm and its result", found)
            raise NoMatch
        if isinstance(node, ast.Call):
            callee = S.resolve_callee(module, node, ctx) or _nested_callee(node, ctx)
            if callee is None:
                if isinstance(node.func, ast.Attribute) and depth == 0:
                    found = _probe(module, node.func.value, ctx)
                    if found is not None:
                        raise Miss(f"`.{node.func.attr}()` between the norm and its weight (grouped or reshaped norm: npu_rms_norm normalizes over gamma's trailing dims)", found)
                raise NoMatch
            fn, is_method = callee
            ret = _helper_return(fn)
            if ret is None or not _calls_sqrt_helper(module, fn):
                raise NoMatch
            hctx = S.bind_call(module, node, fn, ctx, is_method)
            if hctx is None:
                raise NoMatch
            if _is_nested(fn, ctx):
                # a closure (llama4's ``rmsnorm`` defines ``_norm(y)`` reading its ``eps``): the
                # enclosing function's bound parameters stay bound inside
                for k, v in ctx.bind.items():
                    hctx.bind.setdefault(k, v)
            helpers.add(id(fn))
            node, ctx = ret.value, hctx.at(ret.lineno)  # type: ignore[assignment]
            continue
        if _is_muldiv(node):
            factors: list[_Factor] = []
            t = trace.copy()
            _flatten(node, ctx, t, False, factors)
            found = _find_core(module, factors, t)
            if found is not None:
                core, rest = found
                trace.stmts.update(t.stmts)
                for f in rest:
                    if f.inverse:
                        raise Miss(f"divides by `{ast.unparse(f.node)}` besides the rms", core.rstd)
                    ops.append(Op("mul", f.node, f.ctx))
                return core, ops
            for i, f in enumerate(factors):
                if f.inverse:
                    continue
                sub = t.copy()
                try:
                    core, sub_ops = _chain(module, f.node, f.ctx, sub, helpers, depth + 1)
                except NoMatch:
                    continue
                for k, g in enumerate(factors):
                    if k == i:
                        continue
                    if g.inverse:
                        raise Miss(f"divides by `{ast.unparse(g.node)}` besides the rms", core.rstd)
                    if core.x_key in S.key(g.node, g.ctx):
                        raise NoMatch
                    ops.append(Op("mul", g.node, g.ctx))
                trace.stmts.update(sub.stmts)
                trace.conditional.extend(sub.conditional)
                return core, ops + sub_ops
            cast_core = _cast_weight_factor(module, factors, t)
            if cast_core is not None:
                trace.stmts.update(t.stmts)
                return cast_core[0], ops + cast_core[1]
            raise NoMatch
        raise NoMatch
    raise NoMatch


def _cast_weight_factor(module: ModuleInfo, factors: list[_Factor], trace: S.Trace) -> tuple[Core, list[Op]] | None:
    """``x * s.to(x.dtype)`` with ``s = w.to(dt) * rsqrt(mean(x^2) + eps)`` (stable-audio style):
    the weight and the rstd multiplied first, the product cast, then x. Read as
    ``(x * rstd * w).to(...)``: the same value up to where it is rounded (npu_rms_norm rounds once).
    Only the two-factor form ``x * cast(product)``: a further outer factor would be applied after
    the cast in the original."""
    if len(factors) != 2:
        return None
    for i, f in enumerate(factors):
        other = factors[1 - i]
        if f.inverse or other.inverse or not S.is_cast(f.node):
            continue
        t = trace.copy()
        inner, ictx = _peel_any(f.node.func.value, f.ctx, t)  # type: ignore[union-attr]
        if not _is_muldiv(inner):
            continue
        sub: list[_Factor] = []
        _flatten(inner, ictx, t, False, sub)
        if any(g.inverse for g in sub):
            continue
        found = _find_core(module, [other] + sub, t)
        if found is None:
            continue
        core, rest = found
        if any(r is other for r in rest):
            continue  # x was inside the cast: the ordinary chain's business
        trace.stmts.update(t.stmts)
        return core, [Op("cast", f.node, f.ctx)] + [Op("mul", r.node, r.ctx) for r in rest]
    return None


def _nested_callee(call: ast.Call, ctx: S.Ctx) -> tuple[ast.FunctionDef, bool] | None:
    """``f(...)`` calling a function defined by a ``def f`` directly in the current function's body."""
    fn = ctx.scope.node
    if not (isinstance(call.func, ast.Name) and isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))):
        return None
    if call.func.id in ctx.scope.assignments:
        return None
    found = None
    for st in fn.body:
        if isinstance(st, ast.FunctionDef) and st.name == call.func.id and st.lineno < ctx.line:
            found = st
    return (found, False) if found is not None else None


def _is_nested(fn: ast.FunctionDef, ctx: S.Ctx) -> bool:
    scope_fn = ctx.scope.node
    return isinstance(scope_fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(st is fn for st in scope_fn.body)


def _helper_return(fn: ast.FunctionDef) -> ast.Return | None:
    """:func:`S.helper_return`, also for a helper that first defines a nested function."""
    ret = S.helper_return(fn)
    if ret is not None or not any(isinstance(st, ast.FunctionDef) for st in fn.body):
        return ret
    body = [st for st in fn.body if not isinstance(st, ast.FunctionDef) and not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    if not body or len(body) > 8 or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    if not all(isinstance(st, (ast.Assign, ast.AnnAssign)) for st in body[:-1]):
        return None
    return body[-1]


def _probe(module: ModuleInfo, node: ast.expr, ctx: S.Ctx) -> ast.AST | None:
    """The rsqrt node of an RMS core reachable from ``node``, if any (for near-miss reasons)."""
    try:
        core, _ = _chain(module, node, ctx, S.Trace(), set(), 1)
    except NoMatch:
        return None
    except Miss as e:
        return e.rstd or node
    return core.rstd


def _selected_factor(cond: ast.stmt, name: str) -> ast.IfExp | None:
    """``w1 if test else w2`` for ``if test: name = name * w1 else: name = name * w2``."""
    if not (isinstance(cond, ast.If) and len(cond.body) == 1 and len(cond.orelse) == 1):
        return None
    sides = []
    for st in (cond.body[0], cond.orelse[0]):
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and _is_name(st.targets[0], name)):
            return None
        w = _other_factor(st.value, name)
        if w is None:
            return None
        sides.append(w)
    return ast.IfExp(test=cond.test, body=sides[0], orelse=sides[1])


def _added_term(value: ast.expr, name: str) -> ast.expr | None:
    """``b`` for ``name + b`` / ``b + name`` (b not reading ``name``)."""
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
        for mine, other in ((value.left, value.right), (value.right, value.left)):
            if _is_name(mine, name) and not any(_is_name(n, name) for n in ast.walk(other)):
                return other
    return None


def _skip_conditions(module: ModuleInfo, m: "Match", plan: S.SpanPlan | None) -> list[str]:
    """``not (test)`` for each optional step the fused code leaves out (an optional bias)."""
    out = []
    for op in m.ops:
        if op.kind == "skip":
            try:
                out.append(f"not ({S.render(module, op.test, op.test_ctx, plan)})")  # type: ignore[arg-type]
            except S.RenderError as e:
                raise Miss(f"cannot express the replacement at the site: {e}", m.core.rstd)
    return out


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _other_factor(value: ast.expr, name: str) -> ast.expr | None:
    """``w`` for ``name * w`` / ``w * name``."""
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult):
        if _is_name(value.left, name) and not _is_name(value.right, name):
            return value.right
        if _is_name(value.right, name) and not _is_name(value.left, name):
            return value.left
    return None


def _through_control_flow(module: ModuleInfo, value: ast.expr, vctx: S.Ctx, node: ast.Name, cond: ast.stmt, ctx: S.Ctx) -> Exception:
    """A name assigned under control flow: a near miss if either path leads to an RMSNorm."""
    paths = [(value, vctx)]
    before = S.definition(ctx.at(cond.lineno), node.id)
    if before is not None:
        paths.append((before[1], ctx.at(before[0].lineno)))
    for v, c in paths:
        try:
            core, _ = _chain(module, v, c, S.Trace(), set(), 1)
        except NoMatch:
            continue
        except Miss as e:
            if e.reason.startswith("mean subtracted"):
                return e  # a LayerNorm on that path (an optional affine after it): that is the reason
            return _control_flow_miss(module, ctx, cond, c, e)
        return _control_flow_miss(module, ctx, cond, c, Miss("", core.rstd))
    return NoMatch()


# a torch inverse square root: rsqrt, .sqrt()/torch.sqrt (not math/np), ** -0.5, pow(.., -0.5)
_TORCH_ROOT = re.compile(r"rsqrt|(?<!math\.)(?<!np\.)(?<!numpy\.)\bsqrt\(|\*\*\s*\(?\s*-?\s*0?\.5\b|pow\([^()]*-\s*0?\.5\s*\)")


# Where a _TORCH_ROOT match can start (one string per alternative): S.anchored_search tries the
# regex only there, which is exact for this regex (checked here, so an edited regex falls back).
_ROOT_ANCHORS = ("rsqrt", "sqrt(", "**", "pow(")
_ROOT_FAST = _TORCH_ROOT.pattern == r"rsqrt|(?<!math\.)(?<!np\.)(?<!numpy\.)\bsqrt\(|\*\*\s*\(?\s*-?\s*0?\.5\b|pow\([^()]*-\s*0?\.5\s*\)"


def _root_text(text: str) -> bool:
    if not ("sqrt" in text or "0.5" in text or ".5" in text):
        return False
    if _ROOT_FAST:
        return S.anchored_search(_TORCH_ROOT, text, _ROOT_ANCHORS)
    return bool(_TORCH_ROOT.search(text))


def _norm_text(text: str) -> bool:
    """Text that can hold an RMS statistic: a mean and a (torch) inverse square root."""
    return "mean" in text and _root_text(text)


def _calls_sqrt_helper(module: ModuleInfo, fn: ast.AST) -> bool:
    """Is ``fn`` (or a helper of this module it calls) where an RMS statistic can be computed?"""
    return getattr(fn, "name", None) in S.functions_matching(module, "rms_norm", _norm_text)


def parse_norm(module: ModuleInfo, node: ast.expr, ctx: S.Ctx, *, eps_outside: bool = False) -> Match:
    """Parse ``node`` (in ``ctx``) as an RMSNorm output. Raises NoMatch / Miss. ``eps_outside``: a tiny eps added
    outside the root is read as eps**2 inside it (s46b, this detector only; npu_add_rms_norm readers keep the
    near miss, as the add + norm labels of such norms are keeps)."""
    trace = S.Trace()
    helpers: set[int] = set()
    core, ops_outer = _chain(module, node, ctx, trace, helpers)
    if not eps_outside and _rms_norm_s46b.EPS_OUTSIDE in core.rstd_ops:
        raise Miss("eps outside the sqrt: x / (sqrt(mean(x^2)) + eps) is not npu_rms_norm's x * rsqrt(mean(x^2) + eps)", core.rstd)
    ops = list(reversed(ops_outer))
    for op in ops:
        if op.kind in ("cast", "condcast"):
            op.dtype = _cast_target(module, op.node, op.ctx, core.x_key, trace)  # type: ignore[arg-type]
            if op.dtype is None:
                raise NoMatch
    return Match(core, ops, node, ctx, trace, helpers)


# --------------------------------------------------------------------------------------------
# from a match to the replacement


@dataclass
class Weight:
    node: ast.expr  # the whole factor, as written: self.weight, (1 + self.weight), self.weight.float()
    ctx: S.Ctx
    base: ast.expr  # self.weight
    base_ctx: S.Ctx
    offset: int
    dtype: tuple
    conditional: bool = False  # ``a if test else b``: the weight (or its ``1 +`` offset) chosen at run time
    # s33: the weight viewed as ``[1, ..., 1, -1]`` to broadcast over the last dim (recurrentgemma's
    # ``torch.reshape(self.scale, [1 for _ in range(x.ndim - 1)] + [-1])``): gamma is the factor flattened
    flatten: bool = False
    casts: bool = False  # a cast was peeled off the factor


def render_factor(module: ModuleInfo, w: Weight, plan: S.SpanPlan | None) -> str:
    """The weight factor as source at the site, as npu_rms_norm's gamma. A factor broadcast by a
    ``[1, ..., 1, -1]`` view is given flat: built from the parameter itself (the view's shape may read
    names of the norm's own code) unless casts sit between them, then the factor as written, flattened."""
    if not w.flatten:
        return S.render(module, w.node, w.ctx, plan)
    if w.casts:
        return f"({S.render(module, w.node, w.ctx, plan)}).reshape(-1)"
    flat = f"{S.render(module, w.base, w.base_ctx, plan)}.reshape(-1)"
    return f"({flat} + 1)" if w.offset else flat


def _ones_then_minus_one(shape: list[ast.expr]) -> bool:
    """A shape of 1s ending in -1: ``[1, 1, -1]``, ``[1 for _ in range(n)] + [-1]``, ``[1] * n + [-1]``,
    ``(1,) * n + (-1,)`` (the leading 1s may be any number: the view only broadcasts over the last dim)."""
    if len(shape) == 1 and isinstance(shape[0], (ast.List, ast.Tuple)):
        shape = list(shape[0].elts)
    elif len(shape) == 1 and isinstance(shape[0], ast.BinOp) and isinstance(shape[0].op, ast.Add):
        head, tail = shape[0].left, shape[0].right
        if not (isinstance(tail, (ast.List, ast.Tuple)) and len(tail.elts) == 1 and const_value(tail.elts[0]) == -1):
            return False
        if isinstance(head, ast.ListComp):
            return const_value(head.elt) == 1 and len(head.generators) == 1 and not head.generators[0].ifs
        if isinstance(head, ast.BinOp) and isinstance(head.op, ast.Mult):
            seq = head.left if isinstance(head.left, (ast.List, ast.Tuple)) else head.right
            return isinstance(seq, (ast.List, ast.Tuple)) and len(seq.elts) == 1 and const_value(seq.elts[0]) == 1
        return isinstance(head, (ast.List, ast.Tuple)) and all(const_value(e) == 1 for e in head.elts)
    return bool(shape) and const_value(shape[-1]) == -1 and all(const_value(e) == 1 for e in shape[:-1]) \
        and not any(isinstance(e, ast.Starred) for e in shape)


def _broadcast_view_of(module: ModuleInfo, node: ast.expr) -> ast.expr | None:
    """The tensor of ``torch.reshape(t, [1, ..., 1, -1])`` / ``t.reshape(...)`` / ``t.view(...)`` with such a
    shape, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("view", "reshape")
            and not node.keywords):
        return None
    if module.canonical(node.func) == "torch.reshape":
        return node.args[0] if len(node.args) == 2 and _ones_then_minus_one(node.args[1:]) else None
    return node.func.value if node.args and _ones_then_minus_one(list(node.args)) else None


def analyse_weight(module: ModuleInfo, op: Op) -> Weight:
    node, ctx = op.node, op.ctx
    inner, ictx = S.peel(node, ctx)
    dt: tuple | None = None
    casts = False

    def peel_casts() -> None:
        # the first cast met decides the factor's dtype
        nonlocal casts, dt, inner, ictx
        casts = casts or S.is_cast(inner)
        while S.is_cast(inner):
            t = _cast_target(module, inner, ictx, None)  # type: ignore[arg-type]
            if t is None:
                raise NoMatch
            if dt is None and t != ("same",):
                dt = t
            inner, ictx = S.peel(inner.func.value, ictx)  # type: ignore[union-attr]

    peel_casts()  # outer casts
    offset = 0
    if isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Add):
        for c, other in ((inner.left, inner.right), (inner.right, inner.left)):
            if const_value(c) in (1, 1.0):
                offset = 1
                inner, ictx = S.peel(other, ictx)
                break
        else:
            raise Miss("weight factor is a sum that is not 1 + weight")
    peel_casts()  # casts under the 1 + w
    flatten = False
    viewed = _broadcast_view_of(module, inner)
    if viewed is not None:
        flatten = True
        inner, ictx = S.peel(viewed, ictx)
        peel_casts()  # (casts under the view too: ``w.float().view(1, 1, -1)``)
    if isinstance(inner, ast.IfExp) and not offset and not flatten:
        # ``(1 + w) if add_unit_offset else w`` (litgpt, Gemma's branch): each side must be a weight
        parts = [analyse_weight(module, Op("mul", side, ictx)) for side in (inner.body, inner.orelse)]
        if dt is None:
            same = all(p.dtype == D_F32 for p in parts)
            dt = D_F32 if same else ("like", inner, ictx)
        return Weight(node, ctx, inner, ictx, 0, dt, conditional=True)
    if not ((isinstance(inner, (ast.Name, ast.Attribute)) and (dotted(inner) or _indexed_attribute(inner))) or _named_entry(inner)):
        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.func.attr in ("view", "reshape"):
            # FalconH1/Mamba2 gated norms: x viewed as (groups, group_size), the weight viewed to match
            raise Miss(f"grouped norm: the weight is reshaped (`{ast.unparse(op.node)}`) to normalize per group; "
                       "npu_rms_norm normalizes over gamma's trailing dims as stored")
        raise Miss(f"weight `{ast.unparse(op.node)}` is not a parameter")
    if dt is None:
        dt = ("like", inner, ictx)
    return Weight(node, ctx, inner, ictx, offset, dt, flatten=flatten, casts=casts)


def _named_entry(node: ast.expr) -> bool:
    """A weight read from a mapping by a string key, ``weights["ln2.weight"]`` (CS336's functional model passes a
    state dict): a tensor cannot be indexed by a string, so this is one stored tensor, read the same each time."""
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and type(node.slice.value) is str \
        and dotted(node.value) is not None


def _indexed_attribute(node: ast.expr) -> bool:
    """An attribute read through indexed containers, ``self.layers[layer_idx].post_attention_layernorm_weight``
    (TriForce passes each layer's weight to a functional norm this way): names, attributes and
    subscripts by a name or an integer, ending in an attribute. Reading it twice reads the same
    tensor; a subscript at the end (``scale[0]``, a row of a modulation) is not taken."""
    if not isinstance(node, ast.Attribute):
        return False
    cur: ast.expr = node.value
    indexed = False
    while True:
        if isinstance(cur, ast.Attribute):
            cur = cur.value
        elif isinstance(cur, ast.Subscript):
            idx = cur.slice
            if not (isinstance(idx, ast.Name) or (isinstance(idx, ast.Constant) and type(idx.value) is int)):
                return False
            indexed = True
            cur = cur.value
        else:
            return indexed and isinstance(cur, ast.Name)


@dataclass
class Plan:
    """Everything the fused expression needs, rendered for one site."""

    x: str
    pre: list[str]  # statements before the fused root statement
    expr: str  # the fused expression replacing the norm's output
    params: dict[str, Any]
    variant: str
    ops: list[str]  # unfused kernels, for the value estimate
    out_dtype: str
    condition: str | None = None  # the weight is applied only when this holds (Gemma3n with_scale)


class _DtypeRender:
    def __init__(self, module: ModuleInfo, plan: S.SpanPlan | None, x_src: str, T: str, weight_src: str | None) -> None:
        self.module, self.plan, self.x, self.T, self.w = module, plan, x_src, T, weight_src

    def code(self, d: tuple) -> str:
        k = d[0]
        if k == "in":
            return f"{self.x}.dtype"
        if k == "f32":
            return f"{self.T}.float32"
        if k == "fixed":
            return d[1].replace("torch.", f"{self.T}.", 1)
        if k == "like":
            kept = _kept_metadata_name(self.plan, d[1], d[2])
            if kept is not None:
                return kept
            try:
                text = S.render(self.module, d[1], d[2], self.plan)
            except S.RenderError as e:
                raise Miss(f"cannot express the output dtype at the site: {e}") from None
            # ``.dtype`` binds tighter than an operator: the dtype of ``x.float() * rsqrt(..)`` needs the
            # brackets (SkyReels' fast_rms_norm rendered ``a * b.dtype``, a TypeError: audit41)
            return f"{text}.dtype" if _is_atom(ast.parse(text, mode="eval").body) else f"({text}).dtype"
        if k == "expr":
            return S.render(self.module, d[1], d[2], self.plan)
        if k == "promote":
            return f"{self.T}.promote_types({self.code(d[1])}, {self.code(d[2])})"
        if k == "cond":
            return f"({self.code(d[2])} if {d[1]} else {self.code(d[3])})"
        raise ValueError(d)

    def rule(self, d: tuple) -> str:
        k = d[0]
        if k == "in":
            return "input"
        if k == "f32":
            return "float32"
        if k == "fixed":
            return d[1].replace("torch.", "")
        if k == "like":
            kept = _kept_metadata_name(self.plan, d[1], d[2])
            if kept is not None:
                return kept
            try:
                src = S.render(self.module, d[1], d[2], self.plan)
            except S.RenderError as e:
                raise Miss(f"cannot express the output dtype at the site: {e}") from None
            return "weight" if src == self.w else f"dtype of {src}"
        if k == "expr":
            return S.render(self.module, d[1], d[2], self.plan)
        if k == "promote":
            return f"promote({', '.join(sorted((self.rule(d[1]), self.rule(d[2]))))})"
        if k == "cond":
            return f"{self.rule(d[2])} if {d[1]} else {self.rule(d[3])}"
        raise ValueError(d)


def plan_norm(module: ModuleInfo, m: Match, plan: S.SpanPlan | None, *, x_src: str | None = None) -> Plan:
    """Render the fused npu_rms_norm expression for a match (``x_src`` overrides the input text).

    Raises Miss when the match cannot be replaced (no weight, several weights, unrenderable).
    """
    core = m.core
    weights = m.weights
    checks = _dim_conditions(module, core, plan, x_src)
    scalars: list[Op] = []
    if len(weights) > 1:
        split = _rms_norm_s48f.split_scalars(module, weights)  # s48: factors proven one number fold into gamma
        if split is not None:
            weights, scalars = split
    inplace = _rms_norm_s48f.inplace_reason(module, weights)
    if inplace is not None:
        raise Miss(inplace, core.rstd)
    if not weights and not scalars:
        return _plan_weightless(module, m, plan, x_src, checks)
    if not weights:
        raise Miss("the norm's output is scaled by one number (`" + "`, `".join(ast.unparse(s.node) for s in scalars)
                   + "`) but has no weight: npufuse folds such a factor into a weight's gamma only", core.rstd)
    if len(weights) > 1:
        if not any(_is_parameter_like(module, o) for o in weights):
            return _plan_modulated(module, m, plan, x_src, checks)
        raise Miss("more than one factor besides the rms: " + ", ".join(f"`{ast.unparse(w.node)}`" for w in weights), core.rstd)
    try:
        w = analyse_weight(module, weights[0])
    except Miss as e:
        if not e.reason.endswith("is not a parameter"):
            raise
        return _plan_modulated(module, m, plan, x_src, checks)
    T = S.torch_name(module) or "torch"
    try:
        x = x_src or S.render(module, core.x, core.xctx, plan)
        eps = _rms_norm_s46b.fused_eps(S.render(module, core.eps, core.eps_ctx, plan), core.rstd_ops)
        g = render_factor(module, w, plan)
        w_base = S.render(module, w.base, w.base_ctx, plan)
        chosen: list[str] = []
        if isinstance(w.node, ast.IfExp):
            # an if/else picking the weight: kept as statements, so only one side is evaluated
            chosen = [f"if {S.render(module, w.node.test, w.ctx, plan)}:",
                      f"    _npu_w = {S.render(module, w.node.body, w.ctx, plan)}",
                      "else:",
                      f"    _npu_w = {S.render(module, w.node.orelse, w.ctx, plan)}"]
            g = "_npu_w"
        tests = {id(op): S.render(module, op.test, op.test_ctx, plan) for op in m.ops if op.kind == "condcast"}  # type: ignore[arg-type]
    except S.RenderError as e:
        raise Miss(f"cannot express the replacement at the site: {e}", core.rstd)
    R = _DtypeRender(module, plan, x, T, w_base)
    likes: dict[str, tuple] = {}

    def canon(d: tuple | None) -> tuple | None:
        # ("like", expr, ctx) compare by value identity, not by AST node
        if d is not None and d[0] == "like" and len(d) == 3:
            k = S.key(d[1], d[2])
            likes.setdefault(k, d)
            return likes[k]
        return d

    for op in m.ops:
        op.dtype = canon(op.dtype)
    w.dtype = canon(w.dtype)  # type: ignore[assignment]

    # dtype of the value as it flows outwards (inner -> outer), as the original computes it
    d: tuple = D_F32 if core.upcast else D_IN
    rounds_to_input = False
    order: list[str] = []
    unfused = [o for o in core.rstd_ops if o != _rms_norm_s46b.EPS_OUTSIDE]
    for op in m.ops:
        if op.kind == "cast":
            assert op.dtype is not None
            if op.dtype != ("same",):
                if op.dtype == D_IN:
                    rounds_to_input = True
                if op.dtype != d:
                    unfused.append("cast")
                d = op.dtype
                order.append("cast")
        elif op.kind == "skip":
            continue  # not on the fused path (see _skip_conditions)
        elif op.kind == "condcast":
            assert op.dtype is not None
            d = ("cond", tests[id(op)], op.dtype, d)
            unfused.append("cast (conditional)")
            order.append("condcast")
        elif any(op is sc for sc in scalars):
            # s48: one number never promotes a tensor; folded into a float32 gamma only where multiplied in float32
            if d != D_F32:
                raise Miss(f"the norm's output is scaled by `{ast.unparse(op.node)}` where it is not proven float32 (it may "
                           "be in the input's dtype): folded into gamma the product would be rounded differently", core.rstd)
            unfused.append("mul")
            order.append("scale")
        else:  # mul / condmul (the weight)
            d = _promote(d, w.dtype)
            unfused.append("mul")
            if w.offset:
                unfused.append("add (1 + weight)")
            order.append("mul")
    out = d

    pre: list[str] = list(chosen)
    # the op's input: where the original rounds to the input dtype (or never upcasts), the input
    # itself (npu_rms_norm computes in fp32 internally and rounds once); otherwise keep the
    # original's fp32 precision by upcasting
    if rounds_to_input or not core.upcast or out == D_IN:
        xin, xdt = x, D_IN
    elif out == D_F32:
        xin, xdt = f"{x}.float()", D_F32
    else:
        pre.append(f"_npu_dtype = {R.code(out)}")
        pre.append(f"_npu_x = {x}.to({T}.promote_types({x}.dtype, _npu_dtype))")
        xin, xdt = "_npu_x", ("x",)
        out = ("expr_name", "_npu_dtype")

    # gamma: npu_rms_norm takes it in the input's dtype, or float32 with an fp16/bf16 input
    gp = g if _is_atom(w.node) else f"({g})"
    if scalars:
        # s48: the factors that are one number fold into a float32 gamma (the original multiplies in float32)
        try:
            stext = " * ".join(S.render(module, sc.node, sc.ctx, plan) for sc in scalars)
        except S.RenderError as e:
            raise Miss(f"cannot express the replacement at the site: {e}", core.rstd)
        # s48 precision48: ``.float()`` on the product: a factor that is a float64 tensor at run time (a subclass
        # storing one under the factor's name) would make gamma float64, which npu_rms_norm does not take
        gamma = f"({gp if w.dtype == D_F32 else gp + '.float()'} * {stext}).float()"
    elif xdt == D_F32:
        gamma = g if w.dtype == D_F32 else f"{gp}.float()"
    elif w.dtype == D_F32:
        gamma = g
    else:
        gname = "_npu_gamma"
        # (s50) bound once unless a plain name or attribute chain: a call (`self.w.to(x.dtype)`) is an atom for
        # precedence, but the dtype fix below reads gamma up to three times
        from npufuse.patterns.attention import is_simple

        if not _is_atom(w.node) or not is_simple(g):
            pre.append(f"{gname} = {g}")
            gp = gname
        pre.append("# npu_rms_norm takes gamma in the input's dtype, or float32 with an fp16/bf16 input")
        pre.append(f"{gname} = {gp} if {gp}.dtype in ({xin}.dtype, {T}.float32) else {gp}.to({xin}.dtype)")
        gamma = gname
    expr = f"torch_npu.npu_rms_norm({xin}, {gamma}, epsilon={eps})[0]"
    if out[0] == "expr_name":
        expr += f".to({out[1]})"
        out_code = out[1]
    elif out != xdt and not (xdt == D_IN and out == D_IN):
        out_code = R.code(out)
        expr += f".to({out_code})"
    else:
        out_code = R.code(out) if out[0] != "expr_name" else out[1]

    if w.offset:
        variant = "one_plus_weight"
    elif any(o.kind == "condcast" for o in m.ops):
        variant = "t5"
    elif not core.upcast:
        variant = "no_upcast"
    elif order and order[0] == "cast" and "mul" in order:
        variant = "cast_then_weight"
    elif "cast" in order or "condcast" in order:
        variant = "weight_then_cast"
    else:
        variant = "fp32_output"
    params: dict[str, Any] = {
        "eps": eps,
        "weight": w_base,
        "weight_offset": w.offset,
        "upcast": "float32" if core.upcast else None,
        "output_dtype": R.rule(d),
        "input": x,
        "unfused_ops": unfused,
    }
    if scalars:
        params["weight_scale"] = stext  # s48
    cond = m.condition
    condition = None
    if cond is not None:
        try:
            condition = S.render(module, cond.test, cond.test_ctx, plan)  # type: ignore[arg-type]
        except S.RenderError as e:
            raise Miss(f"cannot express the replacement at the site: {e}", core.rstd)
        params["weight_condition"] = condition
    if w.conditional:
        variant = "conditional_weight"
    if checks:
        params["dim_check"] = " and ".join(checks)
        condition = " and ".join(([condition] if condition else []) + checks)
    if isinstance(w.base, ast.Name):
        # a weight handed in (a function's argument, a local): npu_rms_norm normalizes over gamma's
        # trailing dims, so a per-sample [B, 1, D] scale passed as the "weight" (adaLN through a
        # shared helper) would change what is normalized; fused only for a 1-D weight
        # (None passes: an optional weight's own ``is None`` path runs inside the fused branch as written)
        params["weight_check"] = f"({w_base} is None or {w_base}.dim() == 1)"
    condition = _with_skips(module, m, plan, params, condition)
    if "weight_check" in params:
        # last: after the optional weight's ``is not None`` test
        condition = " and ".join(([condition] if condition else []) + [params["weight_check"]])
    return Plan(x, pre, expr, params, variant, unfused, out_code, condition)


def _with_skips(module: ModuleInfo, m: "Match", plan: S.SpanPlan | None, params: dict[str, Any], condition: str | None) -> str | None:
    """The fused path's condition with the optional steps it leaves out absent (``optional_absent``)."""
    skips = _skip_conditions(module, m, plan)
    if not skips:
        return condition
    params["optional_absent"] = " and ".join(skips)
    return " and ".join(([condition] if condition else []) + skips)


def _dim_conditions(module: ModuleInfo, core: Core, plan: S.SpanPlan | None, x_src: str | None = None) -> list[str]:
    """``<dim> == -1`` for each mean dim read at run time (see :func:`_default_last_dim`)."""
    out = []
    for entry in core.dim_checks:
        node, ctx = entry[0], entry[1]
        try:
            if len(entry) > 2 and entry[2] == "dtype":  # s48: a conditional upcast (_rms_norm_s48h)
                out.append(_rms_norm_s48h.dtype_check(x_src or S.render(module, node, ctx, plan), S.torch_name(module) or "torch"))
                continue
            if len(entry) > 2:  # a dim handed in from outside: the last dim as -1 or as rank - 1
                x = S.render(module, core.x, core.xctx, plan)
                out.append(f"{S.render(module, node, ctx, plan)} in (-1, (-1,), {x}.dim() - 1)")
                continue
            out.append(f"{S.render(module, node, ctx, plan)} == -1")
        except S.RenderError as e:
            raise Miss(f"cannot express the replacement at the site: {e}", core.rstd)
    return out


def _plan_weightless(module: ModuleInfo, m: Match, plan: S.SpanPlan | None, x_src: str | None, checks: list[str]) -> Plan:
    """An RMSNorm without a weight (llama4's QK ``rmsnorm``, ``nn.RMSNorm(elementwise_affine=False)``
    written by hand): npu_rms_norm needs a gamma, so ones of the last dim are passed, in the
    input's dtype (the op's rule). One small allocation per call; the same result."""
    core = m.core
    T = S.torch_name(module) or "torch"
    try:
        x = x_src or S.render(module, core.x, core.xctx, plan)
        eps = _rms_norm_s46b.fused_eps(S.render(module, core.eps, core.eps_ctx, plan), core.rstd_ops)
    except S.RenderError as e:
        raise Miss(f"cannot express the replacement at the site: {e}", core.rstd)
    d: tuple = D_F32 if core.upcast else D_IN
    unfused = [o for o in core.rstd_ops if o != _rms_norm_s46b.EPS_OUTSIDE]
    for op in m.ops:
        if op.kind == "skip":
            continue
        if op.kind != "cast":
            raise Miss("no weight and a conditional step after the norm: not replaced", core.rstd)
        assert op.dtype is not None
        if op.dtype != ("same",):
            if op.dtype != d:
                unfused.append("cast")
            d = op.dtype
    R = _DtypeRender(module, plan, x, T, None)
    pre: list[str] = []
    if not core.upcast or d == D_IN:
        # npu_rms_norm computes in fp32 and rounds once to the input's dtype
        xin, out = x, D_IN
    else:
        xin, out = f"{x}.float()", D_F32
    if not re.fullmatch(r"[A-Za-z_][\w.]*", xin):
        pre.append(f"_npu_x = {xin}")
        xin = "_npu_x"
    gamma = f"{T}.ones({xin}.shape[-1], dtype={xin}.dtype, device={xin}.device)"
    expr = f"torch_npu.npu_rms_norm({xin}, {gamma}, epsilon={eps})[0]"
    out_code = R.code(d)
    if d != out:
        expr += f".to({out_code})"
    params: dict[str, Any] = {
        "eps": eps,
        "weight": None,
        "weight_offset": 0,
        "upcast": "float32" if core.upcast else None,
        "output_dtype": R.rule(d),
        "input": x,
        "unfused_ops": unfused,
    }
    condition = None
    if checks:
        params["dim_check"] = condition = " and ".join(checks)
    condition = _with_skips(module, m, plan, params, condition)
    return Plan(x, pre, expr, params, "no_weight", unfused, out_code, condition)


def _is_parameter_like(module: ModuleInfo, op: Op) -> bool:
    """Whether a factor reads as a gamma (``self.weight``, ``(1 + w).float()``...), not a run-time
    modulation (``1 + scale[:, None]``, ``tanh(gate)``)."""
    try:
        analyse_weight(module, op)
    except Miss:
        return False
    except NoMatch:
        return True  # unknown: treated as a gamma, so the caller keeps its own refusal
    return True


def _plan_modulated(module: ModuleInfo, m: Match, plan: S.SpanPlan | None, x_src: str | None, checks: list[str]) -> Plan:
    """A norm whose factors are values computed at run time (adaLN / modulated norms:
    ``x * rstd * (1 + scale[:, None])``, ``x_res * rstd * tanh(gate)``): npu_rms_norm cannot take
    them as gamma (gamma's shape must equal the input's trailing dims, and a per-sample scale
    has a batch dim), so the op normalizes with a gamma of ones (exact: multiplying by 1) and
    the factors and casts are applied afterwards, in the original order and dtypes."""
    core = m.core
    T = S.torch_name(module) or "torch"
    try:
        x = x_src or S.render(module, core.x, core.xctx, plan)
        eps = _rms_norm_s46b.fused_eps(S.render(module, core.eps, core.eps_ctx, plan), core.rstd_ops)
        steps: list[tuple[str, Any]] = []
        for op in m.ops:
            if op.kind == "skip":
                continue
            if op.kind == "mul":
                if core.x_key in S.key(op.node, op.ctx):
                    raise Miss(f"factor `{ast.unparse(op.node)}` reads the normalized input again", core.rstd)
                steps.append(("mul", S.render(module, op.node, op.ctx, plan)))
            elif op.kind == "cast":
                steps.append(("cast", op.dtype))
            else:
                raise Miss("run-time factor and a conditional step after the norm: not replaced", core.rstd)
    except S.RenderError as e:
        raise Miss(f"cannot express the replacement at the site: {e}", core.rstd)
    pre: list[str] = []
    xin = f"{x}.float()" if core.upcast else x
    if not re.fullmatch(r"[A-Za-z_][\w.]*", xin):
        pre.append(f"_npu_x = {xin}")
        xin = "_npu_x"
    gamma = f"{T}.ones({xin}.shape[-1], dtype={xin}.dtype, device={xin}.device)"
    expr = f"torch_npu.npu_rms_norm({xin}, {gamma}, epsilon={eps})[0]"
    R = _DtypeRender(module, plan, x, T, None)
    d: tuple = D_F32 if core.upcast else D_IN
    unfused = [o for o in core.rstd_ops if o != _rms_norm_s46b.EPS_OUTSIDE]
    factors: list[str] = []
    for kind, val in steps:
        if kind == "mul":
            expr = f"{expr} * ({val})"
            factors.append(val)
            unfused.append("mul")
        elif val != ("same",):
            if val != d:
                unfused.append("cast")
            d = val
            expr = f"({expr}).to({R.code(val)})"
    params: dict[str, Any] = {
        "eps": eps,
        "weight": None,
        "weight_offset": 0,
        "modulation": factors,
        "upcast": "float32" if core.upcast else None,
        "output_dtype": R.rule(d),
        "input": x,
        "unfused_ops": unfused,
    }
    condition = None
    if checks:
        params["dim_check"] = condition = " and ".join(checks)
    condition = _with_skips(module, m, plan, params, condition)
    return Plan(x, pre, expr, params, "modulated", unfused, R.code(d), condition)


def _is_atom(node: ast.expr) -> bool:
    return isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))


# --------------------------------------------------------------------------------------------
# scanning one scope


@dataclass
class SiteResult:
    stmt: ast.stmt
    match: Match | None
    finding: Finding | None
    miss: NearMiss | None
    rstd: ast.AST | None


def _roots(stmt: ast.stmt) -> Iterable[ast.expr]:
    """Candidate outputs of a norm in a statement, outermost first: products/divisions, calls
    (casts, helpers) and the statement's whole value when it is a bare name."""
    value = getattr(stmt, "value", None)
    if value is None or not S.simple_stmt(stmt):
        return
    if isinstance(value, ast.Name):
        yield value
        return
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and isinstance(value.func.value, ast.Name) \
            and _layout_receiver(value.func.value, value):
        yield value.func.value  # s36: ``y = y.transpose(1, 2)``: the norm is read at the name
        return
    for n in S.iter_exprs_topdown(value):
        if isinstance(n, ast.Call) or _is_muldiv(n):
            yield n


def _root_lines(module: ModuleInfo, scope: Scope) -> list[int]:
    """Lines of the scope holding a torch inverse square root (text scan, cached)."""
    cached = scope.__dict__.get("_npufuse_root_lines")
    if cached is not None:
        return cached
    lines = S.module_lines(module)
    if isinstance(scope.node, ast.Module) and _MODULE_ROOT_LINES:
        out = _module_root_lines(module, scope, lines)
    else:
        lo = 1 if isinstance(scope.node, ast.Module) else scope.node.lineno  # type: ignore[attr-defined]
        hi = len(lines) if isinstance(scope.node, ast.Module) else (scope.node.end_lineno or lo)  # type: ignore[attr-defined]
        out = [i for i in range(lo, hi + 1) if ("sqrt" in lines[i - 1] or "0.5" in lines[i - 1]) and _root_text(lines[i - 1])]
    scope.__dict__["_npufuse_root_lines"] = out
    return out


_MODULE_ROOT_LINES = True  # tests switch it off to compare


def _module_root_lines(module: ModuleInfo, scope: Scope, lines: list[str]) -> list[int]:
    """The module scope's root lines as its two readers see them, without testing every line of
    the file: scope_results reads only the smallest (the file's first root line), and
    _rstd_sites only whether one lies within a statement of the scope that is not a definition.
    So: that first line, plus the root lines inside those statements' spans."""
    first = _first_root_line(lines)
    if first is None:
        return []
    out = [first]
    spans: set[int] = set()
    for stmt in S.stmt_index(scope).stmts:
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            spans.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    spans.discard(first)
    out += [i for i in sorted(spans) if i <= len(lines) and _is_root_line(lines[i - 1])]
    out.sort()
    return out


def _is_root_line(ln: str) -> bool:
    return ("sqrt" in ln or "0.5" in ln) and _root_text(ln)


def _first_root_line(lines: list[str]) -> int | None:
    for i, ln in enumerate(lines, 1):
        if _is_root_line(ln):
            return i
    return None


def _rstd_sites(module: ModuleInfo, scope: Scope) -> list[tuple[ast.stmt, ast.AST]]:
    marks = set(_root_lines(module, scope))
    out = []
    if not marks:
        return out
    for stmt in S.stmt_index(scope).stmts:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if not any(stmt.lineno <= ln <= (stmt.end_lineno or stmt.lineno) for ln in marks):
            continue
        for n in _own_nodes(stmt):
            if isinstance(n, ast.Call):
                name = module.call_name(n)
                if name in ("torch.rsqrt", "torch.sqrt") or (isinstance(n.func, ast.Attribute) and n.func.attr in ("rsqrt", "sqrt") and name not in ("math.sqrt", "np.sqrt", "numpy.sqrt")):
                    out.append((stmt, n))
                elif _pow_operand(module, n, -0.5) is not None:
                    out.append((stmt, n))
            elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow) and const_value(n.right) in (-0.5, 0.5):
                out.append((stmt, n))
    return out


def _own_nodes(stmt: ast.stmt) -> Iterable[ast.AST]:
    """Nodes of a statement, not descending into nested statements (they are visited themselves)."""
    stack: list[ast.AST] = [stmt]
    while stack:
        n = stack.pop()
        yield n
        for c in child_nodes(n):
            if isinstance(c, ast.stmt):
                continue
            stack.append(c)


def scope_results(module: ModuleInfo, scope: Scope) -> list[SiteResult]:
    """All rms_norm findings and near misses of one scope (cached on the scope)."""
    cached = scope.__dict__.get("_npufuse_rms")
    if cached is not None:
        return cached
    results: list[SiteResult] = []
    scope.__dict__["_npufuse_rms"] = results
    if not _relevant(module, scope):
        return results
    idx = S.stmt_index(scope)
    consumed: set[int] = set()
    marks = _root_lines(module, scope)
    # the norm's output comes at or after its statistic; a scope that only calls a norm helper
    # (Meta's forward -> self._norm) is scanned whole
    first = min(marks) if marks else 0
    lines = S.module_lines(module)
    helpers = [h + "(" for h in S.functions_matching(module, "rms_norm", _norm_text)]
    for stmt in reversed(idx.stmts):
        if id(stmt) in consumed or not S.simple_stmt(stmt):
            continue
        if any(a <= stmt.lineno <= b for a, b in scope.__dict__.get("_npufuse_rms_lifted", ())):
            continue  # another return of ifs already taken whole by a finding (its other paths run the original)
        if (stmt.end_lineno or stmt.lineno) < first:
            break
        # text prefilter: a norm's output is a product/division, a cast, a helper call or a name
        t = "".join(lines[stmt.lineno - 1 : stmt.end_lineno or stmt.lineno])
        if not ("*" in t or "/" in t or ".to(" in t or "float()" in t or "type_as" in t or "half()" in t
                or "bfloat16()" in t or "type(" in t or isinstance(getattr(stmt, "value", None), ast.Name)
                or any(h in t for h in helpers) or _moves_axes_of_a_name(stmt)):
            continue
        top = getattr(stmt, "value", None)
        inside: list[ast.AST] = []
        for node in _roots(stmt):
            if any(_within(node, m) for m in inside):
                continue
            is_name = isinstance(node, ast.Name)
            if is_name and node is not top and not _layout_receiver(node, top):
                continue
            if not (is_name or _is_muldiv(node) or isinstance(node, ast.Call)):
                continue
            if isinstance(node, ast.Call) and not (S.is_cast(node) or S.resolve_callee(module, node, S.Ctx(scope, stmt.lineno)) is not None):
                continue
            ctx = S.Ctx(scope, stmt.lineno)
            try:
                m = parse_norm(module, node, ctx, eps_outside=True)
            except NoMatch:
                continue
            except Miss as e:
                results.append(SiteResult(stmt, None, None, NearMiss("rms_norm", scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, e.reason), e.rstd))
                inside.append(node)
                continue
            if is_name and m.condition is None:
                continue  # the statement that computes it is matched on its own (smaller span)
            inside.append(node)
            res = _finalize(module, scope, stmt, m)
            results.append(res)
            if res.finding is not None:
                consumed.update(m.trace.stmts.keys())
    _arm_exit_results(module, scope, results, consumed)
    _attribute_misses(module, scope, results)
    _already_fused_statistics(module, scope, results)
    return results


_OTHER_BLOCK = "part of the computation is in another block (control flow)"


def _arm_exit_results(module: ModuleInfo, scope: Scope, results: list[SiteResult], consumed: set[int]) -> None:
    """s40 (dataflow40): a norm written in one arm of an ``if`` / ``else`` whose output name the
    other arm also binds (``if APEX: y = fused_rms_norm_affine(..) else: y = self._norm(x.float())
    ...``) and which is read only after the ``if``: the read sees two definitions, so no root after
    the ``if`` parses. The end of the arm is read as a root (``Scope.arm_exits``,
    ``S.arm_exit_root``): the fused code replaces the arm's statements alone and ends with
    ``y = <fused>``; what the ``if`` does after that is unchanged. A near miss or nothing where the
    arm's computation fails its checks (an intermediate read after the ``if`` is "reused after the
    fused region": the read sees this arm's value). Where the arm gives a result, a near miss of a
    root after the ``if`` that the arm's value reaches is dropped (it read the name through control
    flow; the arm's own result says more)."""
    if not any(type(s) is ast.If and s.orelse for s in S.stmt_index(scope).stmts):
        return  # (most scopes: no ``if`` with an ``else``, no arm exit to work out)
    # the text prefilter of scope_results' roots: a product / quotient, a cast, a norm helper's call
    helpers = [h + "(" for h in S.functions_matching(module, "rms_norm", _norm_text)]
    words = ("*", "/", ".to(", "float()", "type_as", "half()", "bfloat16()", "type(", *helpers)
    exits = [e for e in scope.arm_exits() if any(w in S.source_of(module, e.last) for w in words)]
    for e in exits:
        if any(id(s) in consumed for s in e.arm):
            continue
        root, line = S.arm_exit_root(scope, e)
        ctx = S.Ctx(scope, line)  # type: ignore[arg-type]
        try:
            m = parse_norm(module, root.value, ctx, eps_outside=True)
        except NoMatch:
            continue
        except Miss:
            continue  # the arm's own reasons are those of its statements, tried as roots above
        # the other arm already runs torch_npu's kernel (or the ``if`` is an NPU test): the arm is its fallback
        done = S.already_fused(module, scope, root) or _npu_call_in_sibling_branch(module, S.stmt_index(scope), e.last)
        if done:
            lo = min(s.lineno for s in e.arm if id(s) in {id(t) for t in m.trace.stmts.values()} or s is e.last)
            res = SiteResult(root, m, None, NearMiss("rms_norm", scope.qualname, lo, e.last.end_lineno or e.last.lineno, done), m.core.rstd)
        else:
            res = _finalize(module, scope, root, m)
        if res.finding is None and (res.miss is None or not done):
            continue  # the arm's own refusal says less than the one of the read after the ``if`` (or of its statements)
        results[:] = [r for r in results if not (r.finding is None and r.miss is not None and r.stmt is e.reader)]
        results.insert(0, res)
        if res.finding is not None:
            consumed.update(m.trace.stmts.keys())
            consumed.update(id(s) for s in e.arm)


def _lift_to_branches(module: ModuleInfo, scope: Scope, stmt: ast.Return, trace: S.Trace) -> tuple[S.SpanPlan, str] | None:
    """A ``return`` of the norm inside ``if``/``else`` branches that follow the computation: the span
    grows to the outermost of those ``if`` statements in the computation's block, and the fused
    code runs only on this return's path (the conjunction of the tests, negated for ``else``)."""
    idx = S.stmt_index(scope)
    child: ast.stmt = stmt
    conds: list[str] = []
    for anc in S.ancestors(idx, stmt)[:3]:
        if not isinstance(anc, ast.If):
            return None
        test = S.source_of(module, anc.test)
        if "\n" in test:
            return None
        if any(x is child for x in anc.body):
            conds.insert(0, f"({test})")
        elif any(x is child for x in anc.orelse):
            conds.insert(0, f"not ({test})")
        else:
            return None
        plan = S.plan_span(scope, anc, trace)
        if isinstance(plan, S.SpanPlan):
            return plan, " and ".join(conds)
        if plan != _OTHER_BLOCK:
            # s43: ``if self.gain is not None: return unit * self.gain`` then ``return unit``: the statements
            # after an exiting ``if`` are its else
            grown = _norm_s43.lift_over_exiting_if(scope, anc, trace) if child is stmt else None
            return (grown, " and ".join(conds)) if grown is not None else None
        child = anc
    return None


# s36 (N4): the axis moves that bring a channel-first tensor back after a norm over its channels
_LAYOUT_METHODS = frozenset({"transpose", "permute", "movedim", "swapaxes", "swapdims", "contiguous"})


def _moves_axes_of_a_name(stmt: ast.stmt) -> bool:
    value = getattr(stmt, "value", None)
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and isinstance(value.func.value, ast.Name) \
        and _layout_receiver(value.func.value, value)


def _layout_receiver(node: ast.Name, top: ast.AST | None) -> bool:
    """``top`` is ``node.transpose(...)`` (``permute`` / ``movedim`` / ``swapaxes`` / ``contiguous``):
    the statement moves the axes of a name that may hold a norm's output (ConvRMSNorm's ``output =
    output.transpose(1, 2)`` after the channels-last norm). The norm is read at the name, as a
    statement returning it would be, and the fused value takes its place in the axis move."""
    return (isinstance(top, ast.Call) and isinstance(top.func, ast.Attribute) and top.func.value is node
            and top.func.attr in _LAYOUT_METHODS)


def _within(node: ast.AST, outer: ast.AST) -> bool:
    return node is not outer and any(n is node for n in fast_walk(outer))


def _finalize(module: ModuleInfo, scope: Scope, stmt: ast.stmt, m: Match) -> SiteResult:
    def miss(reason: str) -> SiteResult:
        return SiteResult(stmt, m, None, NearMiss("rms_norm", scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, reason), m.core.rstd)

    done = S.already_fused(module, scope, stmt)
    if done:
        return miss(done)
    # a module-level helper that is itself a whole norm covers its callers
    if isinstance(m.node, ast.Call) and _is_full_norm_helper(module, scope, m.node):
        return SiteResult(stmt, m, None, None, m.core.rstd)
    if _cast_of_full_norm_helper(module, scope, m.node, m.ctx):
        return SiteResult(stmt, m, None, None, m.core.rstd)
    if not m.weights:
        later = _multiplied_later(scope, stmt)
        if later is not None:
            return miss(f"no weight in the matched norm, but its result is multiplied later (`{later}`) in a way "
                        "npufuse does not follow into the norm (control flow or a reshaped factor)")
    plan = S.plan_span(scope, stmt, m.trace)
    path_cond: str | None = None
    if plan == _OTHER_BLOCK and isinstance(stmt, ast.Return):
        lifted = _lift_to_branches(module, scope, stmt, m.trace)
        if lifted is not None:
            plan, path_cond = lifted
    early: ast.If | None = None
    in_place: list[ast.stmt] = []
    if isinstance(plan, str) and plan.endswith("is used by another statement inside the fused region"):
        found = _early_exit(scope, stmt, m.trace)
        if found is not None:
            early, plan, in_place = found
    if isinstance(plan, str):
        return miss(plan)
    dropped = set().union(*(S.names_written(s) for s in plan.dropped)) if plan.dropped else set()
    outside = _names_read_outside(stmt, m.node) & dropped
    chosen = _s40_chosen_arm(module, stmt, m.node, plan, dropped) if outside else None
    if isinstance(chosen, str):
        return miss(chosen)
    if chosen is not None:
        # s40: ``return out * self.weight if self.affine else out``: the other read of the intermediate is the
        # alternative arm; the fused code runs where the test picks the norm's arm, the original elsewhere
        outside = _names_read_outside(stmt, chosen[0]) & dropped
    if outside:
        return miss(f"intermediate `{sorted(outside)[0]}` reused after the fused region")
    try:
        p = plan_norm(module, m, plan)
    except Miss as e:
        return miss(e.reason)
    except NoMatch:
        return SiteResult(stmt, m, None, None, m.core.rstd)
    if m.core.x is not None and isinstance(m.core.x, ast.Name):
        # a kept statement (run before the fused code) may write the input only before every
        # dropped statement reading it: they read that new value in the original too
        name = m.core.x.id
        readers = [d.lineno for d in plan.dropped if d not in in_place and name in S.names_read(d)]
        if any(name in S.names_written(s) and (not readers or s.lineno > min(readers)) for s in plan.kept):
            return miss(f"input `{name}` is reassigned inside the region")
    body = [S.stmt_source(module, s) for s in sorted([*plan.kept, *in_place], key=lambda s: s.lineno)]
    if early is not None:
        # gpt-neox: ``if self.bias: return self.scale * x_normed + self.offset`` reads the norm's
        # intermediate and leaves: that path runs the original computation, the other the fused op
        before = [S.stmt_source(module, d) for d in plan.dropped if d.lineno < early.lineno and d is not early and d not in in_place]
        exit_body = [S.stmt_source(module, b) for b in early.body]
        body.append(f"if {S.source_of(module, early.test)}:\n" + S.indent("\n".join(before + exit_body)))
    body += p.pre
    body.append(S.splice(module, stmt, [(m.node if chosen is None else chosen[0], p.expr)]))
    if p.condition is not None:
        # the weight is optional: fused with it, the original code without it (npu_rms_norm needs gamma)
        body = [f"if {p.condition}:", S.indent("\n".join(body)), "else:", S.indent(S.block_source(module, plan.stmts))]
    if chosen is not None:
        path_cond = chosen[1] if path_cond is None else f"{path_cond} and {chosen[1]}"
    if path_cond is not None:
        # the norm is returned in one branch of ifs after it (OLMo: ``if self.weight is not None: ...
        # return self.weight * x``): that path fused, every other path the original statements
        body = [f"if {path_cond}:", S.indent("\n".join(body)), "else:", S.indent(S.block_source(module, plan.stmts))]
        scope.__dict__.setdefault("_npufuse_rms_lifted", []).append((plan.line, plan.end_line))
    risks = [
        Risk("dtype", "npu_rms_norm: fp16/bf16/fp32; gamma in the input's dtype, or fp32 with fp16/bf16 input (A2/A3 only; 310P/910 need the same dtype)"),
        Risk("numerics", "npu_rms_norm applies gamma in fp32 and rounds once; the original rounds before the weight: ≤1-ulp differences"),
        Risk("other", "npu_rms_norm needs a 2-8-D input (1-D vectors fall back to an error on NPU)"),
    ]
    if _rms_norm_s46b.EPS_OUTSIDE in m.core.rstd_ops:
        risks.append(Risk("numerics", _rms_norm_s46b.EPS_OUTSIDE_RISK))
    notes = [f"unfused: {len(p.ops)} kernels ({', '.join(p.ops)}); fused: 1"]
    if m.helpers:
        notes.append("follows a helper of this module into the norm")
    if p.variant == "no_weight":
        notes.append("no weight: npu_rms_norm needs a gamma, so ones of the last dim are passed (allocated per call, "
                     "one small fill kernel; the same result)")
    if "dim_check" in p.params:
        notes.append(f"the mean's dim is read at run time (-1 by the class's default): fused only when {p.params['dim_check']}")
    f = Finding(
        pattern="rms_norm",
        qualname=scope.qualname,
        line=plan.line,
        end_line=plan.end_line,
        params=p.params,
        fused="\n".join(body),
        guard_tensor=p.x,
        confidence="high",
        variant=p.variant,
        risks=risks,
        notes=notes,
        training_ok=True,
    )
    return SiteResult(stmt, m, f, None, m.core.rstd)


# s40 (reasons40): a norm whose forward returns a conditional expression, the norm times its weight in one arm and
# the weightless value in the other (``return out * self.weight if self.affine else out``). The intermediate is read
# again only by the other arm: not a reuse after the fused region. The test is moved before the fused region (it
# reads nothing the region computes or stores, and calls nothing), so the fused code runs where it picks the
# norm's arm and the original statements run on the other path; attributes the arm reads (a weight that exists
# only when affine) are read only after the test.
_PLAIN_TEST = (ast.Name, ast.Attribute, ast.Constant, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.Load,
               ast.cmpop, ast.boolop, ast.unaryop)


def _s40_chosen_arm(module: ModuleInfo, stmt: ast.stmt, node: ast.AST, plan: S.SpanPlan,
                    dropped: set[str]) -> tuple[ast.IfExp, str] | str | None:
    """For a matched norm ``node`` that is one whole arm of a conditional expression in ``stmt``: (that
    expression, the test under which the arm is taken); a reason (str) where the test cannot be moved before
    the fused region; None where ``node`` is no arm of one."""
    ifexp = next((n for n in fast_walk(stmt) if isinstance(n, ast.IfExp) and (n.body is node or n.orelse is node)), None)
    if ifexp is None:
        return None
    test = ifexp.test
    text = S.source_of(module, test)
    if "\n" in text or not all(isinstance(n, _PLAIN_TEST) for n in fast_walk(test)):
        return (f"the norm is one arm of a conditional expression whose test `{text[:60]}` is not a plain flag or "
                "comparison: npufuse does not move it before the fused region")
    read = {n.id for n in fast_walk(test) if isinstance(n, ast.Name)}
    if read & dropped:
        return (f"the conditional expression's test `{text[:60]}` reads `{sorted(read & dropped)[0]}`, computed by the norm's "
                "statements: it cannot be tested before the fused region")
    paths = {dotted(n) for n in fast_walk(test) if isinstance(n, (ast.Name, ast.Attribute))} - {None}
    for st in plan.stmts:
        for n in fast_walk(st):
            if isinstance(n, (ast.Name, ast.Attribute)) and isinstance(n.ctx, ast.Store) and dotted(n) in paths:
                return (f"the conditional expression's test `{text[:60]}` reads `{dotted(n)}`, assigned inside the fused "
                        "region: it cannot be tested before it")
    return ifexp, f"({text})" if ifexp.body is node else f"not ({text})"


def _early_exit(scope: Scope, root: ast.stmt, trace: S.Trace) -> tuple[ast.If, S.SpanPlan, list[ast.stmt]] | None:
    """The span when the one statement of it that reads the norm's intermediates is an early exit
    -- ``if <test>: ... return/raise`` without ``else``, its test reading none of them, after every
    other kept statement -- so the fused code can run the original computation on that path only."""
    idx = S.stmt_index(scope)
    loc = idx.block.get(id(root))
    if loc is None:
        return None
    block, end = loc
    members: set[int] = {id(root)}
    for st in trace.stmts.values():
        cur: ast.stmt | None = st
        while cur is not None and idx.block.get(id(cur), (None, 0))[0] is not block:
            cur = idx.parent.get(id(cur))
        if cur is None:
            return None
        members.add(id(cur))
    start = min(idx.block[i][1] for i in (id(s) for s in block if id(s) in members))
    span = block[start : end + 1]
    exits = [s for s in span if id(s) not in members and isinstance(s, ast.If) and not s.orelse and s.body
             and isinstance(s.body[-1], (ast.Return, ast.Raise))]
    if len(exits) != 1:
        return None
    k = exits[0]
    dropped_before = [s for s in span if id(s) in members and s is not root and s.lineno < k.lineno]
    written = set().union(*(S.names_written(d) for d in dropped_before)) if dropped_before else set()
    kept = [s for s in span if id(s) not in members and s is not k]
    if S.names_read(k.test) & written or any(s.lineno > k.lineno for s in kept):
        return None
    # the fused code runs the kept statements first: a dropped one that originally ran before a
    # kept one and reads what that kept one writes runs in its place too, if cheap (``dtype = x.dtype``)
    also: list[ast.stmt] = []
    for d in dropped_before:
        if any(S.names_read(d) & S.names_written(s) for s in kept if s.lineno > d.lineno):
            if not S._is_cheap(d):
                return None
            also.append(d)
    t2 = trace.copy()
    t2.add(k)
    plan = S.plan_span(scope, root, t2)
    return (k, plan, also) if not isinstance(plan, str) else None


def _names_read_outside(stmt: ast.stmt, node: ast.AST) -> set[str]:
    inner = {id(n) for n in fast_walk(node)}
    return {n.id for n in fast_walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and id(n) not in inner}


def _is_full_norm_helper(module: ModuleInfo, scope: Scope, call: ast.Call) -> bool:
    callee = S.resolve_callee(module, call, S.Ctx(scope, call.lineno))
    if callee is None:
        return False
    hscope = S.scope_of(module, callee[0])
    return hscope is not None and hscope is not scope and any(r.finding is not None for r in scope_results(module, hscope))


def _attribute_misses(module: ModuleInfo, scope: Scope, results: list[SiteResult]) -> None:
    """One outcome per rsqrt site: a finding wins; else the outermost near miss; a no-weight
    helper used by a finding elsewhere in the module is not a near miss."""
    found = {id(r.rstd) for r in results if r.finding is not None}
    seen: set[int] = set()
    sites = _rstd_sites(module, scope)
    for r in list(results):
        if r.miss is None:
            continue
        rid = id(r.rstd) if r.rstd is not None else _nearest_site(sites, r.stmt)
        if rid in found or rid in seen:
            results.remove(r)
            continue
        seen.add(rid)
        if _helper_used_by_finding(module, scope) or (r.rstd is not None and _claimed_by_caller(module, scope, r.rstd)):
            results.remove(r)
    # sites never reached by a parse but shaped like an RMS statistic: report them
    for stmt, node in sites:
        if id(node) in found or id(node) in seen or any(id(node) in {id(n) for n in fast_walk(r.stmt)} for r in results):
            continue
        reason = _stat_reason(module, scope, stmt, node)
        if reason:
            results.append(SiteResult(stmt, None, None, NearMiss("rms_norm", scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, reason), node))


def _nearest_site(sites: list[tuple[ast.stmt, ast.AST]], stmt: ast.stmt) -> int:
    best = None
    for s, n in sites:
        if s.lineno <= (stmt.end_lineno or stmt.lineno):
            best = n
    return id(best) if best is not None else id(stmt)


def _stat_reason(module: ModuleInfo, scope: Scope, stmt: ast.stmt, node: ast.AST) -> str | None:
    """A bare ``rsqrt(mean(x**2) + eps)`` whose result is not multiplied back onto x."""
    f = _Factor(node, S.Ctx(scope, stmt.lineno), False)  # type: ignore[arg-type]
    try:
        r = _rstd(module, f, S.Trace())
        if r is None:
            f.inverse = True
            r = _rstd(module, f, S.Trace())
        if r is None:
            return None
        # s44: dims a replacement would check at run time are no reason here (the statistic alone is not applied)
        _mean_of_square(module, r[0], r[1], S.Trace(), r[4], [])
    except Miss as e:
        return e.reason
    except NoMatch:
        return None
    return "rsqrt(mean(x^2) + eps) is computed but not applied as x * rstd * weight in one place"


def _claimed_by_caller(module: ModuleInfo, scope: Scope, rstd: ast.AST) -> bool:
    """A helper's near miss is reported once, at the caller that inlines it (same rsqrt node)."""
    if not isinstance(scope.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    name = scope.node.name
    for other in module.scopes:
        if other is scope or not isinstance(other.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if name not in S.scope_text(module, other):
            continue
        for r in scope_results(module, other):
            if r.rstd is rstd and r.stmt is not None and other is not scope:
                return True
    return False


def _multiplied_later(scope: Scope, stmt: ast.stmt) -> str | None:
    """A product after ``stmt`` with a name ``stmt`` assigns as an operand (a weight applied
    later: diffusers' ``if self.weight is not None: h = h * self.weight``), as text."""
    names = S.names_written(stmt)
    if not names:
        return None
    end = stmt.end_lineno or stmt.lineno
    # up to the next assignment of the name (a product after it multiplies another value)
    # (a cast of itself, ``h = h.to(self.weight.dtype)``, keeps the value: the window goes on)
    def _recast(value: ast.expr, name: str) -> bool:
        return S.is_cast(value) and _is_name(value.func.value, name)  # type: ignore[attr-defined]

    nxt = {name: min((s.lineno for s, v in scope.assignments.get(name, []) if s.lineno > end and not _recast(v, name)), default=1 << 30)
           for name in names}
    # names holding the result reshaped or cast (Mamba2's gated norm: ``h = h_group.view(...)``)
    for st in sorted(S.stmt_index(scope).stmts, key=lambda x: x.lineno):
        if st.lineno <= end or not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)):
            continue
        base = _through_views(st.value)
        if base is not None and base.id in names and st.lineno <= nxt[base.id] and st.targets[0].id not in names:
            names = names | {st.targets[0].id}
            nxt[st.targets[0].id] = min((s.lineno for s, v in scope.assignments.get(st.targets[0].id, []) if s.lineno > st.lineno
                                         and not _recast(v, st.targets[0].id)), default=1 << 30)
    for n in scope.nodes().get(ast.BinOp, []):
        if isinstance(n.op, ast.Mult) and n.lineno > end:  # type: ignore[attr-defined]
            for side in (n.left, n.right):  # type: ignore[attr-defined]
                base = _through_views(side)
                if base is not None and base.id in names and n.lineno <= nxt[base.id]:  # type: ignore[attr-defined]
                    return ast.unparse(n)
    return None


_VIEWS = frozenset(("view", "reshape", "flatten", "contiguous", "to", "float", "half", "bfloat16", "type_as", "type"))


def _through_views(node: ast.expr) -> ast.Name | None:
    """The name under reshapes and casts (``h.view(b, t, d).to(dt)`` -> ``h``)."""
    for _ in range(8):
        if isinstance(node, ast.Name):
            return node
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _VIEWS:
            node = node.func.value
            continue
        return None
    return None


def _weightless_helper_covered(module: ModuleInfo, scope: Scope) -> bool:
    """A weightless norm helper whose every call in this module lies inside a finding that
    inlines it (Meta's ``forward -> self._norm(x.float()) ... * self.weight``): the caller's
    replacement covers it, and a second, weightless one in the helper would be noise. A helper
    also called elsewhere on its own (llama4's ``rmsnorm`` for the QK norm) is a site itself."""
    fn = scope.node
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    spans: list[tuple[int, int]] = []
    for other in module.scopes:
        if other is scope or isinstance(other.node, ast.Module) or fn.name not in S.scope_text(module, other):
            continue
        for r in scope_results(module, other):
            if r.finding is not None and r.match is not None and id(fn) in r.match.helpers:
                spans.append((r.finding.line, r.finding.end_line))
            elif r.miss is not None and r.rstd is not None and fn.lineno <= getattr(r.rstd, "lineno", 0) <= (fn.end_lineno or 0):
                # the caller reached this helper's norm and reported why it cannot be replaced:
                # its calls there are that near miss's business
                spans.append((other.node.lineno, other.node.end_lineno or other.node.lineno))  # type: ignore[attr-defined]
    if not spans:
        return False
    own = (fn.lineno, fn.end_lineno or fn.lineno)
    # a method is called as ``self.name(...)`` in its own class (another class may have a method
    # of the same name: Llama4's weightless and weighted norms both define ``_norm``); a function
    # as ``name(...)``
    cls = module.classes.get(scope.class_name or "") if scope.class_name else None
    for call in _calls_naming(module, fn.name):  # every call of the file that can be one of fn
        f = call.func  # type: ignore[attr-defined]
        line = call.lineno  # type: ignore[attr-defined]
        if cls is not None:
            if getattr(f, "attr", None) != fn.name or not (cls.lineno <= line <= (cls.end_lineno or cls.lineno)):
                continue
        elif getattr(f, "id", None) != fn.name:
            continue
        if not (own[0] <= line <= own[1]) and not any(lo <= line <= hi for lo, hi in spans):
            return False
    return True


def _calls_naming(module: ModuleInfo, name: str) -> list[ast.Call]:
    """The file's calls, or those of its statements whose lines hold ``name`` (a call of it
    does): the whole file is walked node by node only where another question already did."""
    top = module.scopes[0]
    lines = None if "_nodes" in top.__dict__ else lines_with(module, (name,))
    if lines is None:
        return top.nodes().get(ast.Call, [])
    return calls_on_lines(module.tree, lines)


def _helper_used_by_finding(module: ModuleInfo, scope: Scope) -> bool:
    fn = scope.node
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    for other in module.scopes:
        if other is scope:
            continue
        for r in scope_results(module, other):
            if r.finding is not None and r.match is not None and id(fn) in r.match.helpers:
                return True
    return False


def _relevant(module: ModuleInfo, scope: Scope) -> bool:
    """Cheap text prefilter: the scope (or a helper of this module it calls) has a mean and a
    torch inverse square root. Attention's ``math.sqrt(head_dim)`` does not count."""
    cache = module.__dict__.setdefault("_npufuse_rms_relevant", {})
    if "module" not in cache:
        cache["module"] = "mean" in module.source and _root_text(module.source)
    if not cache["module"]:
        return False
    if isinstance(scope.node, ast.Module):
        return True  # _norm_text of the module's text: cache["module"], just computed
    return _calls_sqrt_helper(module, scope.node) and (not _SCOPE_GATE or _reaches_root(module, scope))


# _reaches_root may skip a scope (tests switch it off to compare).
_SCOPE_GATE = True
_ROOT_APIS = ("torch.rsqrt", "torch.sqrt", "torch.pow")


def _reaches_root(module: ModuleInfo, scope: Scope) -> bool:
    """Can :func:`scope_results` find anything in this function? ``_calls_sqrt_helper`` goes by
    name only (every ``forward`` counts once one ``forward`` of the file looks like a norm);
    this asks the scope itself. Every finding and near miss hangs on an inverse-square-root node
    -- a call ``torch.rsqrt/sqrt/pow`` or ``.rsqrt/.sqrt/.pow(...)``, or a ``**`` -- that the
    parse reaches from the scope's statements: in the scope's own code (its names' definitions
    are its own statements) or in a helper it enters through a call ``self.NAME(...)`` /
    ``NAME(...)``, and the parse enters only helpers whose NAME passes ``_calls_sqrt_helper``;
    ``_attribute_misses`` looks at the scope's own root lines only. So a function whose text
    holds none of "sqrt", "pow", a local name bound to one of those torch functions or such a
    helper's NAME (besides its own ``def`` line), and no ``**`` operator, gives nothing."""
    text = S.scope_text(module, scope)
    if "pow" in text:
        return True
    if "sqrt" in text and not _rms_norm_s51b.sqrt_only_of_math(module, text):
        return True  # s51 perf51b: a bare ``math.sqrt`` (attention's scale) is no root the parse can read
    aliases = module.__dict__.get("_npufuse_rms_root_aliases")
    if aliases is None:
        aliases = module.__dict__["_npufuse_rms_root_aliases"] = tuple(sorted(k for k, v in module.aliases.items() if v in _ROOT_APIS))
    if any(a in text for a in aliases):
        return True
    own = getattr(scope.node, "name", None)
    for name in S.functions_matching(module, "rms_norm", _norm_text):
        # the text starts at the scope's own ``def NAME``: one more occurrence is needed for a call
        # s51 perf51b: NAME as a whole identifier (a call of it is one), not inside ``eager_attention_forward``
        if _rms_norm_s51b.name_occurrences(text, name) > (1 if name == own else 0):
            return True
    return _power_operator(text)


def _power_operator(text: str) -> bool:
    """Can a ``**`` in ``text`` be the power operator (or ``**=``)? ``dataflow.may_raise_to_power``,
    the test the scan's per-scope summary makes (most ``**`` unpack ``**kwargs``)."""
    return may_raise_to_power(text)


# --------------------------------------------------------------------------------------------
# the pattern


_TOKENS_DEFAULT = 4096


def elem_bytes(config: dict[str, Any]) -> int:
    dt = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return 4 if "32" in dt else 2


def tokens_of(config: dict[str, Any]) -> tuple[int, str]:
    for k in ("tokens", "num_tokens"):
        if isinstance(config.get(k), int):
            return config[k], f"{config[k]} tokens"
    b, s = config.get("batch_size"), config.get("seq_length") or config.get("seq_len")
    if isinstance(b, int) and isinstance(s, int):
        return b * s, f"B*S = {b}*{s} tokens"
    return _TOKENS_DEFAULT, f"tokens B*S = {_TOKENS_DEFAULT} assumed (not in config)"


def norm_traffic(ops: list[str], e: int, upcast: bool) -> tuple[float, int]:
    """Bytes per normalized element moved by the unfused ops, and their kernel count."""
    s = 4 if upcast else e
    per = {"cast": e + 4, "pow": 2 * s, "mean": s, "add": 0, "rsqrt": 0, "sqrt": 0, "div": 2 * s, "mul": 2 * s + 0.0,
           "cast (conditional)": 4 + e, "add (1 + weight)": 0}
    total = 0.0
    n = 0
    for op in ops:
        total += per.get(op, 2 * s)
        n += 1
    return total, n


class RmsNorm(Pattern):
    id = "rms_norm"
    api = "torch_npu.npu_rms_norm"
    title = "RMSNorm -> npu_rms_norm"
    training_ok = True
    bound = "memory"

    def detect(self, module: ModuleInfo, scope: Scope) -> Iterable[Result]:
        yield from detected(module, scope)

    def assess(self, finding: Finding, config: dict[str, Any]) -> dict[str, Any]:
        ops = list(finding.params.get("unfused_ops") or [])
        upcast = finding.params.get("upcast") == "float32"
        hidden = config.get("hidden_size") or config.get("d_model") or config.get("dim")
        if not isinstance(hidden, int):
            return symbolic(
                "memory",
                f"memory-bound elementwise chain: {len(ops)} kernels ({', '.join(ops)}) each reading/writing the "
                "T x H activation (fp32 copies when upcast) -> 1 kernel reading x and writing y once; "
                "gain ~ traffic ratio (typically 5-9x on this site); T tokens, H hidden size unknown",
            )
        e = elem_bytes(config)
        t, tdesc = tokens_of(config)
        per, n = norm_traffic(ops, e, upcast)
        elems = t * hidden
        return estimate(
            bytes_before=per * elems,
            bytes_after=2 * e * elems + 4 * t,
            kernels_before=n,
            kernels_after=1,
            flops=4 * elems,
            shapes=f"x [{tdesc}, hidden {hidden}], {'fp32' if e == 4 else 'bf16/fp16'} activations; norm dim assumed = hidden_size",
        )

    @staticmethod
    def reference(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: int = 0) -> torch.Tensor:
        """fp32 golden: x * rsqrt(mean(x^2, -1) + eps) * (weight_offset + weight)."""
        import torch

        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + weight_offset)

    FUSE = []  # filled below
    KEEP = []



def detected(module: ModuleInfo, scope: Scope) -> list[Result]:
    """The rms_norm pattern's results in ``scope``, memoised on it: s41, add_rms_norm reads a norm class's forward
    through them (a forward only the numeric probe proves), so the probe runs once per forward."""
    cached = scope.__dict__.get("_npufuse_rms_detected")
    if cached is None:
        cached = scope.__dict__["_npufuse_rms_detected"] = list(_detect(module, scope))
    return cached


def probed_forward(module: ModuleInfo, fn: ast.FunctionDef) -> Finding | None:
    """The numeric probe's rms_norm finding for the whole function ``fn`` (a norm class's forward that the syntactic
    matcher cannot read: ``sum(x ** 2, -1) / x.size(-1)``), None where there is none."""
    scope = S.scope_of(module, fn)
    if scope is None:
        return None
    return next((r for r in detected(module, scope) if isinstance(r, Finding) and r.params.get("found_by") == "numeric_probe"), None)


def _detect(module: ModuleInfo, scope: Scope) -> Iterable[Result]:
    out: list[Result] = []
    for r in scope_results(module, scope):
        if r.finding is not None:
            if (r.finding.variant == "no_weight" or _import_fallback_def(module, scope)) and _weightless_helper_covered(module, scope):
                out.append(None)  # type: ignore[arg-type]  # covered: no probe either
                continue  # Meta's ``_norm``: its callers apply the weight and are replaced whole
            out.append(r.finding)
        elif r.miss is not None:
            out.append(r.miss)
        elif r.match is not None:
            out.append(None)  # type: ignore[arg-type]  # a norm covered elsewhere: no probe
    # PyTorch's own RMSNorm (nn.RMSNorm modules, F.rms_norm calls): issue 14, class 1
    library = list(_library_norm.detect(module, scope))
    # numeric probe fallback (end of module): only where nothing was found
    probed = probe_results(module, scope, out) if not library else []
    yield from (_s28_unless_reference(module, scope, r) for r in (probed or out) if r is not None)
    yield from library

# --------------------------------------------------------------------------------------------
# examples (they are the tests)

_HF_LLAMA = '''
import torch
from torch import nn


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)
'''

_RUN_NORM_FP32 = '''
norm = {cls}(64, eps=1e-5)
with torch.no_grad():
    norm.weight.normal_()
x = torch.randn(2, 7, 64, requires_grad=True)
out = norm(x)
leaves = [x, norm.weight]
'''

_RUN_NORM_BF16 = '''
norm = {cls}(64, eps=1e-6).to(torch.bfloat16)
with torch.no_grad():
    norm.weight.normal_()
x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
out = norm(x)
leaves = [x, norm.weight]
'''

_RUN_MIXED = '''
norm = {cls}(64, eps=1e-6)
x = torch.randn(4, 64, dtype=torch.bfloat16)
out = norm(x)
'''

_META = '''
import torch
from torch import nn


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight
'''

_GEMMA = '''
import torch
from torch import nn


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        # Llama does x.to(float16) * w whilst Gemma is (x * w).to(float16)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)
'''

_T5 = '''
import torch
from torch import nn


class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)

        # convert into half-precision if necessary
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)

        return self.weight * hidden_states
'''

_USER_NORM2 = '''
import torch
import torch.nn as nn


class Norm2(nn.Module):
    """A user's own norm: no model names, inverse sqrt spelled as a division."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        ms = torch.mean(x * x, dim=-1, keepdim=True)
        return x / torch.sqrt(ms + self.eps) * self.g
'''

_QWEN35_ONE_PLUS = '''
import torch
from torch import nn


class Qwen3_5RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = torch.square(hidden_states).mean(dim=-1, keepdim=True)
        hidden_states = hidden_states * variance.add(self.eps).rsqrt()
        hidden_states = hidden_states * (1 + self.weight.float())
        return hidden_states.to(input_dtype)
'''

_INLINE_BLOCK = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """nanoGPT-style block with the norm written inline (no upcast) before the MLP."""

    def __init__(self, n_embd, eps=1e-5):
        super().__init__()
        self.ln_w = nn.Parameter(torch.ones(n_embd))
        self.eps = eps
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        h = x * (1.0 / torch.sqrt((x ** 2).mean(-1, keepdim=True) + self.eps)) * self.ln_w
        h = self.proj(F.gelu(self.fc(h)))
        return x + h
'''

_FUNCTIONAL = '''
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x_fp32 = x.float()
    normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)
'''

_FLUX_QK = '''
import torch
from torch import Tensor, nn


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor):
        x_dtype = x.dtype
        x = x.float()
        rrms = torch.rsqrt(torch.mean(x**2, dim=-1, keepdim=True) + 1e-6)
        return (x * rrms).to(dtype=x_dtype) * self.scale
'''

_GATED = '''
import torch
from torch import nn
import torch.nn.functional as F


class RMSNormGated(nn.Module):
    """Qwen3.5 / OLMo-hybrid style: a Llama norm, then a separate gate multiply (kept)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, gate):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        # Norm before gate
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = self.weight * hidden_states.to(input_dtype)
        hidden_states = hidden_states * F.silu(gate.to(torch.float32))

        return hidden_states.to(input_dtype)
'''

_IMPORT_FALLBACK = '''
import torch

try:
    from fused_norm_kernels import rms_norm  # an optional kernel package
except ImportError:

    def rms_norm(x, weight, eps=1e-6):
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(dim=-1, keepdim=True) + eps)
        return (normed * weight.float()).to(x.dtype)
'''

RmsNorm.FUSE = [
    Fuse(
        _HF_LLAMA,
        expect={"eps": "self.variance_epsilon", "weight": "self.weight", "weight_offset": 0, "upcast": "float32",
                "output_dtype": "promote(input, weight)", "input": "hidden_states", "variant": "cast_then_weight",
                "qualname": "LlamaRMSNorm.forward", "line": 13, "end_line": 17},
        run=_RUN_NORM_FP32.format(cls="LlamaRMSNorm"),
        name="hf_llama_fp32",
    ),
    Fuse(_HF_LLAMA, expect={"eps": "self.variance_epsilon"}, run=_RUN_NORM_BF16.format(cls="LlamaRMSNorm"), name="hf_llama_bf16"),
    Fuse(_HF_LLAMA, expect={"output_dtype": "promote(input, weight)"}, run=_RUN_MIXED.format(cls="LlamaRMSNorm"), name="hf_llama_fp32_weight_bf16_input"),
    Fuse(
        _META,
        expect={"eps": "self.eps", "weight": "self.weight", "upcast": "float32", "input": "x", "output_dtype": "promote(input, weight)",
                "qualname": "RMSNorm.forward"},
        run=_RUN_NORM_BF16.format(cls="RMSNorm"),
        name="meta_llama_helper",
    ),
    Fuse(
        _GEMMA,
        expect={"weight_offset": 1, "weight": "self.weight", "output_dtype": "input", "variant": "one_plus_weight"},
        run=_RUN_NORM_BF16.format(cls="GemmaRMSNorm"),
        name="gemma_one_plus_weight",
    ),
    Fuse(
        _QWEN35_ONE_PLUS,
        expect={"weight_offset": 1, "eps": "self.eps", "output_dtype": "input"},
        run=_RUN_NORM_FP32.format(cls="Qwen3_5RMSNorm"),
        name="qwen35_square_add_rsqrt",
    ),
    Fuse(
        _T5,
        expect={"variant": "t5", "eps": "self.variance_epsilon", "upcast": "float32",
                "output_dtype": "weight if self.weight.dtype in [torch.float16, torch.bfloat16] else float32"},
        run=_RUN_NORM_BF16.format(cls="T5LayerNorm"),
        name="t5_bf16",
    ),
    Fuse(_T5, expect={"variant": "t5"}, run=_RUN_MIXED.format(cls="T5LayerNorm"), name="t5_fp32_weight"),
    Fuse(
        _USER_NORM2,
        expect={"eps": "self.eps", "weight": "self.g", "upcast": None, "variant": "no_upcast", "qualname": "Norm2.forward"},
        run=_RUN_NORM_FP32.format(cls="Norm2").replace("norm.weight", "norm.g"),
        name="user_norm_div_sqrt",
    ),
    Fuse(
        _INLINE_BLOCK,
        expect={"eps": "self.eps", "weight": "self.ln_w", "input": "x", "line": 18, "end_line": 18},
        run="blk = Block(32)\nx = torch.randn(2, 3, 32, requires_grad=True)\nout = blk(x)\nleaves = [x, blk.ln_w, blk.fc.weight]\n",
        name="inline_one_over_sqrt",
    ),
    Fuse(
        _FUNCTIONAL,
        expect={"eps": "eps", "weight": "weight", "input": "x", "output_dtype": "input", "qualname": "rms_norm"},
        run="w = torch.randn(48, requires_grad=True)\nx = torch.randn(6, 48, dtype=torch.float16)\nout = rms_norm(x, w, 1e-5)\nleaves = [w]\n",
        name="functional_fp16_fp32_weight",
    ),
    Fuse(
        _FLUX_QK,
        expect={"eps": "1e-6", "weight": "self.scale", "output_dtype": "promote(input, weight)"},
        run="n = RMSNorm(16)\nx = torch.randn(2, 4, 9, 16, requires_grad=True)\nout = n(x)\nleaves = [x, n.scale]\n",
        name="flux_qk_norm_literal_eps",
    ),
    Fuse(
        # the kept `input_dtype = ...` reads `hidden_states` before the dropped upcast rebinds it
        _GATED,
        expect={"eps": "self.variance_epsilon", "weight": "self.weight", "input": "hidden_states",
                "output_dtype": "promote(input, weight)", "qualname": "RMSNormGated.forward", "line": 16, "end_line": 21},
        run=("norm = RMSNormGated(64).to(torch.bfloat16)\nwith torch.no_grad():\n    norm.weight.normal_()\n"
             "x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)\n"
             "g = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)\n"
             "out = norm(x, g)\nleaves = [x, g, norm.weight]\n"),
        name="gated_norm_then_separate_gate",
    ),
    Fuse(
        # a def under a module-level try/except is a scope like any other (its qualname has no block in it)
        _IMPORT_FALLBACK,
        expect={"eps": "eps", "weight": "weight", "input": "x", "qualname": "rms_norm", "line": 9, "end_line": 11},
        run="w = torch.randn(48, requires_grad=True)\nx = torch.randn(6, 48, dtype=torch.bfloat16, requires_grad=True)\nout = rms_norm(x, w, 1e-5)\nleaves = [x, w]\n",
        name="import_fallback_under_try_except",
    ),
]

RmsNorm.KEEP = [
    Keep(
        '''
import torch
from torch import nn

try:
    import torch_npu
except ImportError:
    torch_npu = None


class Qwen2RMSNorm(nn.Module):
    """A repo that already switches to the fused op on NPU."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        if torch_npu is not None and hidden_states.is_npu:
            return torch_npu.npu_rms_norm(hidden_states, self.weight, epsilon=self.variance_epsilon)[0]
        else:
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)
''',
        reason="already has a torch_npu branch",
        name="existing_npu_branch",
    ),
    Keep(
        '''
import torch
from torch import nn


class LayerNorm(nn.Module):
    """ConvNeXt-style hand-written LayerNorm: the mean is subtracted."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight * x + self.bias
''',
        reason="mean subtracted (LayerNorm)",
        name="layernorm_mean_subtracted",
    ),
    Keep(
        '''
import torch
from torch import nn


class CohereLayerNorm(nn.Module):
    def __init__(self, hidden_size=None, eps=1e-5, bias=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = self.weight.to(torch.float32) * hidden_states
        return hidden_states.to(input_dtype)
''',
        reason="mean subtracted (LayerNorm)",
        name="cohere_layernorm",
    ),
    Keep(
        '''
import torch
from torch import nn


class ChannelRMSNorm(nn.Module):
    """Normalizes over the channel dim of NCHW maps: not the last dim."""

    def __init__(self, channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels, 1, 1))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))
''',
        reason="not the last dim",
        name="mean_over_channel_dim",
    ),
    Keep(
        # s36: with eps 1e-8 this is a candidate (eps' = eps ** 2, risk stated: s36_matcher_eps_outside_sqrt);
        # at 1e-2 the difference on ordinary rows is 1e-2: refused
        '''
import torch
from torch import nn


class RMSNormEpsOutside(nn.Module):
    def __init__(self, d, eps=1e-2):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True))
        return self.scale * x / (rms + self.eps)
''',
        reason="eps outside the sqrt",
        name="eps_outside_sqrt",
    ),
    Keep(
        '''
import torch
from torch import nn


class NormWithStats(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        x = x.float()
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        y = x * rstd * self.weight
        return y, rstd
''',
        reason="reused after the fused region",
        name="rstd_reused",
    ),
    Keep(
        '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    """diffusers-style: the weight is optional and applied under control flow."""

    def __init__(self, dim, eps, elementwise_affine=True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        if self.weight is not None:
            if self.weight.dtype in [torch.float16, torch.bfloat16]:
                hidden_states = hidden_states.to(self.weight.dtype)
            hidden_states = hidden_states * self.weight
        else:
            hidden_states = hidden_states.to(input_dtype)
        return hidden_states
''',
        reason="control flow",
        name="diffusers_optional_weight",
    ),
    Keep(
        '''
import math
import torch


def scaled_dot(q, k):
    # a plain 1/sqrt(d) scale, not a norm
    return q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
''',
        name="attention_scale_unrelated",
    ),
    Keep(
        '''
import torch
from torch import nn


class FlowLayerNorm(nn.Module):
    def __init__(self, d, eps=1e-6, elementwise_affine=True):
        super().__init__()
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, hidden_states):
        mean = hidden_states.mean(-1, keepdim=True)
        variance = hidden_states.var(-1, unbiased=False, keepdim=True)
        hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.eps)
        if self.elementwise_affine:
            hidden_states = hidden_states * self.weight + self.bias
        return hidden_states
''',
        reason="mean subtracted",  # a LayerNorm with an optional affine: not 'control flow'
        name="layernorm_with_optional_affine",
    ),
    Keep(
        '''
import torch
from torch import nn


class GroupedRMSNorm(nn.Module):
    def __init__(self, d, n_groups, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.n_groups = n_groups
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        batch_size, seq_len, dim = hidden_states.shape
        hidden_states = hidden_states.to(torch.float32)
        hidden_states = hidden_states.view(batch_size, seq_len, self.n_groups, dim // self.n_groups)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = self.weight.view(self.n_groups, dim // self.n_groups) * hidden_states
        return hidden_states.view(batch_size, seq_len, dim)
''',
        reason="grouped norm",
        name="grouped_norm_weight_viewed",
    ),
]


# -- library norms (issue 14, class 1): PyTorch's own RMSNorm, module and functional ------------

_NN_RMSNORM_BLOCK = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-6)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        h = x + self.proj(self.attention_norm(x))
        return h + self.proj(self.ffn_norm(h))
'''

_NN_RMSNORM_DEFAULT_EPS = '''
import torch as th
import torch.nn as nn


class Layer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.RMSNorm([dim])

    def forward(self, x):
        y = self.norm(x)
        return y * 2
'''

_F_RMS_NORM = '''
import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)
'''

_TORCH_RMS_NORM_NO_WEIGHT = '''
import torch


def qk_norm(q, k):
    q = torch.rms_norm(q, (q.shape[-1],))
    k = torch.rms_norm(k, (k.shape[-1],), eps=1e-6)
    return q, k
'''

_NN_RMSNORM_CONDITIONAL = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim, use_rms=True):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-6) if use_rms else nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(x)
'''

_RUN_BLOCK_BF16 = (
    "blk = Block(32).to(torch.bfloat16)\nwith torch.no_grad():\n    blk.attention_norm.weight.normal_()\n    blk.ffn_norm.weight.normal_()\n"
    "x = torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)\nout = blk(x)\n"
    "leaves = [x, blk.attention_norm.weight, blk.ffn_norm.weight]\n"
)

RmsNorm.FUSE += [
    Fuse(
        _NN_RMSNORM_BLOCK,
        expect={"variant": "nn_rmsnorm", "module": "nn.RMSNorm", "target": "self.attention_norm",
                "qualname": "Block.__init__", "line": 9, "end_line": 9},
        run=_RUN_BLOCK_BF16,
        name="nn_rmsnorm_modules",
    ),
    Fuse(
        # eps omitted: PyTorch takes float32's epsilon for bf16 input (not bf16's; see _library_norm)
        _NN_RMSNORM_DEFAULT_EPS,
        expect={"variant": "nn_rmsnorm", "target": "self.norm", "qualname": "Layer.__init__"},
        run=("m = Layer(16).to(th.bfloat16)\nx = (th.randn(3, 4, 16) * 1e-3).to(th.bfloat16).requires_grad_()\n"
             "out = m(x)\nleaves = [x, m.norm.weight]\n"),
        name="nn_rmsnorm_default_eps_tiny_input",
    ),
    Fuse(
        _F_RMS_NORM,
        expect={"variant": "f_rms_norm", "eps": "self.eps", "weight": "self.weight", "x": "x", "qualname": "RMSNorm.forward"},
        run="n = RMSNorm(24)\nx = torch.randn(2, 3, 24, requires_grad=True)\nout = n(x)\nleaves = [x, n.weight]\n",
        name="f_rms_norm_in_a_module",
    ),
    Fuse(
        _TORCH_RMS_NORM_NO_WEIGHT,
        expect={"variant": "f_rms_norm_no_weight", "eps": "finfo(float32).eps", "weight": None, "x": "q"},
        run=("q = torch.randn(2, 4, 6, 8, dtype=torch.float16, requires_grad=True)\nk = torch.randn(2, 4, 6, 8, dtype=torch.float16)\n"
             "out = qk_norm(q, k)\nleaves = [q]\n"),
        name="torch_rms_norm_without_weight",
    ),
    Fuse(
        _NN_RMSNORM_CONDITIONAL,
        expect={"variant": "nn_rmsnorm", "target": "self.norm", "module": "nn.RMSNorm"},
        run=("m = Block(16)\nwith torch.no_grad():\n    m.norm.weight.normal_()\nx = torch.randn(4, 16, requires_grad=True)\n"
             "out = (m(x), Block(16, use_rms=False)(x))\nleaves = [x]\n"),
        name="nn_rmsnorm_or_layernorm_by_flag",
    ),
]

RmsNorm.KEEP += [
    Keep(
        '''
import torch
import torch.nn.functional as F


def norm_all(x, w, eps):
    return F.rms_norm(x.flatten(1), x.shape[1:], w.flatten(), eps)
''',
        reason="neither the input nor the weight",
        name="f_rms_norm_of_inline_expressions",
    ),
]

_NN_RMSNORM_MANY = '''
import torch
from torch import nn


class Head(nn.Module):
    def __init__(self, dim, depth=2):
        super().__init__()
        self.norm = nn.RMSNorm(dim, elementwise_affine=False)
        self.norms = nn.ModuleList([nn.RMSNorm(dim, eps=1e-6) for _ in range(depth)])
        self.grid_norm = nn.RMSNorm([4, dim])
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.out(self.norm(self.out(x)))
        for n in self.norms:
            h = n(h.permute(0, 2, 1, 3))
        return self.grid_norm(h)


def make_norm(dim):
    return nn.RMSNorm(dim, eps=None)
'''

RmsNorm.FUSE += [
    Fuse(
        # no weight (ones gamma), one statement building several modules, a multi-dim normalized_shape
        # (npu_rms_norm normalises gamma's trailing dims), a permuted input at the call
        _NN_RMSNORM_MANY,
        expect={"variant": "nn_rmsnorm", "target": "self.norm", "qualname": "Head.__init__", "line": 9},
        run=("m = Head(8)\nwith torch.no_grad():\n    m.grid_norm.weight.normal_()\n    m.norms[1].weight.normal_()\n"
             "x = torch.randn(2, 4, 4, 8, requires_grad=True)\nf = make_norm(8)\nout = (m(x), f(x))\n"
             "leaves = [x, m.grid_norm.weight, m.norms[1].weight]\n"),
        name="nn_rmsnorm_no_weight_list_multidim_factory",
    ),
]

RmsNorm.KEEP += [
    Keep(
        # issue 14, class 7: TorchScript compiles the body at import; the fused branch would not compile
        '''
import torch


@torch.jit.script
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x_fp32 = x.float()
    normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


@torch.jit.script
def block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x + rms_norm(x, weight, 1e-6)  # scripted code calls it: it stays compiled, not rewritten
''',
        reason="TorchScript compiles `rms_norm` at import",
        name="inside_torch_jit_script",
    ),
    Keep(
        '''
import torch
from torch import jit


def _norm(x, eps: float):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def scaled(x, w, eps: float):
    return w * _norm(x, eps)


scaled_scripted = jit.script(scaled)
''',
        reason="TorchScript compiles `scaled` at import",
        name="called_from_torch_jit_script_call",
    ),
]

RmsNorm.FUSE += [
    Fuse(
        # modded-nanogpt's QK norm: two weightless library norms in one statement -> one finding, both replaced
        '''
import torch
import torch.nn.functional as F


def qk_norm(q, k):
    q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
    return q, k
''',
        expect={"variant": "f_rms_norm_no_weight", "calls": 2, "inputs": ["q", "k"], "line": 7, "end_line": 7},
        run=("q = torch.randn(2, 5, 4, 8, requires_grad=True)\nk = torch.randn(2, 5, 4, 8, requires_grad=True)\n"
             "out = qk_norm(q, k)\nleaves = [q, k]\n"),
        name="two_library_norms_one_statement",
    ),
]


# -- issue 14, class 1: dim attributes, conditional weights, weightless norms ---------------------

_NO_AFFINE = '''
import torch
from torch import nn


class RMSNormNoAffine(nn.Module):
    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.eps)
        return hidden_states.to(dtype)
'''

_DIM_ATTRIBUTE = '''
import torch
from torch import nn


class ScaleNormish(nn.Module):
    """lit-llama's RMSNorm: the mean's dim is an attribute, -1 by default; no call here passes it."""

    def __init__(self, size: int, dim: int = -1, eps: float = 1e-5) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.dim = dim

    def forward(self, x):
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        return self.scale * x_normed


class Block(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.norm = ScaleNormish(n)

    def forward(self, x):
        return self.norm(x)
'''

_UNIT_OFFSET_IFEXP = '''
import torch


class Norm(torch.nn.Module):
    """litgpt's RMSNorm: dim attribute and a ``(1 + w) if flag else w`` weight."""

    def __init__(self, size: int, dim: int = -1, eps: float = 1e-6, add_unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps
        self.dim = dim
        self.add_unit_offset = add_unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        weight = (1 + self.weight) if self.add_unit_offset else self.weight
        return (x_normed * weight.float()).to(dtype=dtype)
'''

_UNIT_OFFSET_BRANCH = '''
import torch
from torch import nn


class Norm(nn.Module):
    """gemma_pytorch: the weight (or 1 + weight) applied in an if/else."""

    def __init__(self, dim: int, eps: float = 1e-6, add_unit_offset: bool = True):
        super().__init__()
        self.eps = eps
        self.add_unit_offset = add_unit_offset
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        if self.add_unit_offset:
            output = output * (1 + self.weight.float())
        else:
            output = output * self.weight.float()
        return output.type_as(x)
'''

_NESTED_HELPER = '''
import torch
from torch import nn


def qk_rms(x, eps):
    def _norm(y):
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)

    return _norm(x.float()).type_as(x)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return qk_rms(x, self.eps) * self.weight


class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.eps = 1e-5
        self.wq = nn.Linear(d, d, bias=False)

    def forward(self, x):
        q = self.wq(x)
        q = qk_rms(q, self.eps)
        return q
'''

_RUN_UNIT = '''
m = Norm(16{args}){cast}
with torch.no_grad():
    m.weight.normal_()
x = torch.randn(3, 5, 16{dtype}, requires_grad=True)
out = m(x)
leaves = [x, m.weight]
'''

RmsNorm.FUSE += [
    Fuse(
        # weightless: npu_rms_norm needs a gamma, ones of the last dim are passed (same result)
        _NO_AFFINE,
        expect={"variant": "no_weight", "weight": None, "eps": "self.eps", "output_dtype": "input"},
        run="m = RMSNormNoAffine()\nx = torch.randn(2, 3, 32, dtype=torch.bfloat16, requires_grad=True)\nout = m(x)\nleaves = [x]\n",
        name="weightless_hand_written",
    ),
    Fuse(
        _DIM_ATTRIBUTE,
        expect={"dim_check": "self.dim == -1", "weight": "self.scale", "upcast": None, "qualname": "ScaleNormish.forward"},
        run=("m = Block(24)\nwith torch.no_grad():\n    m.norm.scale.normal_()\nx = torch.randn(2, 5, 24, requires_grad=True)\n"
             "out = (m(x), ScaleNormish(5, dim=1)(x.transpose(1, 2).contiguous()))\nleaves = [x, m.norm.scale]\n"),
        name="dim_attribute_default_last",
    ),
    Fuse(
        _UNIT_OFFSET_IFEXP,
        expect={"variant": "conditional_weight", "dim_check": "self.dim == -1", "upcast": "float32"},
        run=_RUN_UNIT.format(args=", add_unit_offset=True", cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16")
        + "out = (out, Norm(16)(x))\n",
        name="litgpt_unit_offset_if_expression",
    ),
    Fuse(
        _UNIT_OFFSET_BRANCH,
        expect={"variant": "conditional_weight", "weight": "1 + self.weight.float() if self.add_unit_offset else self.weight.float()"},
        run=_RUN_UNIT.format(args="", cast="", dtype="") + "m2 = Norm(16, add_unit_offset=False)\nwith torch.no_grad():\n"
        "    m2.weight.normal_()\nout = (out, m2(x))\nleaves = [x, m.weight, m2.weight]\n",
        name="gemma_unit_offset_if_else",
    ),
    Fuse(
        # llama4: a module-level helper defining a nested ``_norm``: the helper is a weightless site
        # (the QK norm calls it on its own), the module applying the weight is another
        _NESTED_HELPER,
        expect={"variant": "no_weight", "qualname": "qk_rms", "eps": "eps", "input": "x"},
        run=("m = Attn(16).to(torch.bfloat16)\nx = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)\nn = Norm(16)\n"
             "with torch.no_grad():\n    n.weight.normal_()\nout = (m(x), n(x))\nleaves = [x, n.weight]\n"),
        name="nested_helper_weightless_and_weighted",
    ),
]

RmsNorm.KEEP += [
    Keep(
        # the weight chosen by the branch is not a parameter on one side: not a norm's weight
        _UNIT_OFFSET_BRANCH.replace("output = output * self.weight.float()", "output = output * self.weight.float().view(-1, 1)"),
        reason="the weight is reshaped",
        name="branch_weight_not_a_parameter",
    ),
]


# -- issue 14, class 1: L2-normalisation spellings (eps as a clamp on the norm: a stated risk) -----

_L2_NORMALIZE = '''
import math
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = math.sqrt(dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.gamma
'''

_L2_NORM_CLAMP = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    """PaLM-lite: the norm scaled by d ** -0.5 (so: the rms), clamped from below."""

    def __init__(self, dim, eps=1e-8):
        super().__init__()
        self.scale = dim ** -0.5
        self.eps = eps
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        norm = torch.norm(x, dim=-1, keepdim=True) * self.scale
        return x / norm.clamp(min=self.eps) * self.g
'''

_L2_RUN = '''
m = RMSNorm(32){cast}
with torch.no_grad():
    getattr(m, "{w}").normal_()
x = torch.randn(3, 5, 32{dtype}, requires_grad=True)
out = m(x)
leaves = [x, getattr(m, "{w}")]
'''

RmsNorm.FUSE += [
    Fuse(_L2_NORMALIZE, expect={"variant": "l2_normalize", "eps": "1e-12", "eps_rule": "clamp on the norm", "x": "x",
                                "norm_scale": "x.shape[-1] ** 0.5", "confidence": "medium"},
         run=_L2_RUN.format(cast="", dtype="", w="gamma"), name="f_normalize_times_sqrt_d"),
    Fuse(_L2_NORMALIZE.replace("F.normalize(x, dim=-1) * self.scale * self.gamma", "self.gamma * (F.normalize(x, p=2, dim=-1, eps=1e-6) * self.scale)"),
         expect={"variant": "l2_normalize", "eps": "1e-6"},
         run=_L2_RUN.format(cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16", w="gamma"), name="f_normalize_bf16_gain_first"),
    Fuse(_L2_NORM_CLAMP, expect={"variant": "l2_norm_clamp", "eps": "self.eps", "norm_scale": "(self.scale) * x.shape[-1] ** 0.5",
                                 "line": 16, "end_line": 17},
         run=_L2_RUN.format(cast="", dtype="", w="g"), name="norm_times_inverse_sqrt_d_clamped"),
]

RmsNorm.KEEP += [
    Keep(
        '''
import torch


class ScaleNorm(torch.nn.Module):
    """An L2 normalisation with a scalar gain: no sqrt(d), not an RMSNorm."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.g = torch.nn.Parameter(torch.ones(1))
        self.eps = eps

    def forward(self, x):
        n = torch.norm(x, dim=-1, keepdim=True).clamp(min=self.eps)
        return x / n * self.g
''',
        reason="without a sqrt(d) factor",
        name="scalenorm_l2_with_scalar_gain",
    ),
    Keep(
        # normalises the channel dim of NCHW maps: npu_rms_norm normalises trailing dims only
        _L2_NORMALIZE.replace("F.normalize(x, dim=-1)", "F.normalize(x, dim=1)"),
        name="f_normalize_over_channels",
    ),
    Keep(
        # a factor computed by a module call would run twice in the replacement
        _L2_NORMALIZE.replace("* self.scale * self.gamma", "* self.scale * self.gate(x)").replace(
            "self.gamma = nn.Parameter(torch.ones(dim))", "self.gate = nn.Linear(dim, dim)"),
        reason="computed by a call",
        name="f_normalize_times_a_module_output",
    ),
]


# -- issue 14, class 1: an intermediate reused on an early-exit path (gpt-neox) -----------------

_EARLY_EXIT_BIAS = '''
import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, p=-1.0, eps=1e-8, bias=False):
        super().__init__()
        self.eps = eps
        self.d = dim
        self.p = p
        self.bias = bias
        self.scale = torch.nn.Parameter(torch.ones(dim))
        if self.bias:
            self.offset = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        dtype = x.dtype
        if self.p >= 0.0 and self.p <= 1.0:
            partial_size = int(self.d * self.p)
            x, _ = torch.split(x, [partial_size, self.d - partial_size], dim=-1)

        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x_normed = x * torch.rsqrt(variance + self.eps)

        if self.bias:
            return self.scale * x_normed + self.offset

        return (self.scale * x_normed).to(dtype)
'''

RmsNorm.FUSE += [
    Fuse(
        # the normalized value also feeds ``if self.bias: return ...``: that path keeps the original
        # computation, the other runs the fused op
        _EARLY_EXIT_BIAS,
        expect={"variant": "weight_then_cast", "weight": "self.scale", "eps": "self.eps", "line": 17, "end_line": 29},
        run=("m = RMSNorm(32).to(torch.bfloat16)\nmb = RMSNorm(32, bias=True)\nwith torch.no_grad():\n    m.scale.normal_()\n"
             "x = torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)\nout = (m(x), mb(x.float()))\nleaves = [x, m.scale, mb.scale]\n"),
        name="intermediate_reused_on_an_early_exit",
    ),
]

RmsNorm.KEEP += [
    Keep(
        # the early exit's test reads the intermediate itself: it must be computed before the test
        _EARLY_EXIT_BIAS.replace("if self.bias:\n            return", "if x_normed.isnan().any():\n            return"),
        reason="is used by another statement inside the fused region",
        name="early_exit_test_reads_the_intermediate",
    ),
]

_RMSNORM_SUBCLASS = '''
import torch
from torch import nn


class RMSNorm(nn.RMSNorm):
    """torchtitan: a configurable nn.RMSNorm -- its forward is nn.RMSNorm's."""

    def __init__(self, dim, eps=1e-5):
        super().__init__(dim, eps=eps)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(self.norm(x))
'''

RmsNorm.FUSE += [
    Fuse(_RMSNORM_SUBCLASS, expect={"variant": "nn_rmsnorm", "module": "RMSNorm", "qualname": "RMSNorm.__init__", "line": 10},
         run=("m = Block(16).to(torch.bfloat16)\nwith torch.no_grad():\n    m.norm.weight.normal_()\n"
              "x = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)\nout = m(x)\nleaves = [x, m.norm.weight]\n"),
         name="nn_rmsnorm_subclass_without_forward"),
]

RmsNorm.KEEP += [
    Keep(
        # a subclass with its own forward computes something else: not read as nn.RMSNorm
        _RMSNORM_SUBCLASS.replace("super().__init__(dim, eps=eps)\n",
                                  "super().__init__(dim, eps=eps)\n\n    def forward(self, x):\n        return super().forward(x) * 2\n"),
        name="nn_rmsnorm_subclass_with_own_forward",
    ),
]

RmsNorm.FUSE += [
    Fuse(_L2_NORMALIZE.replace("F.normalize(x, dim=-1) * self.scale * self.gamma", "F.normalize(x, dim=-1) * x.shape[-1] ** 0.5 * self.gamma"),
         expect={"variant": "l2_normalize", "weight": "(x.shape[-1] ** 0.5) * (self.gamma)"},
         run=_L2_RUN.format(cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16", w="gamma"), name="f_normalize_times_inline_sqrt_d"),
]


# -- norms with an optional weight applied in a branch, the result returned by name (issue 14) ------

_OPTIONAL_WEIGHT_BY_NAME = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, elementwise_affine=True, eps=1e-6):
        super().__init__()
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        if hasattr(self, "weight"):
            output = output * self.weight
        return output
'''

RmsNorm.FUSE += [
    Fuse(
        # the weight exists only with elementwise_affine: fused with it, the original code without it
        _OPTIONAL_WEIGHT_BY_NAME,
        expect={"weight": "self.weight", "weight_condition": 'hasattr(self, "weight")', "qualname": "RMSNorm.forward",
                "line": 17, "end_line": 20},
        run=("m = RMSNorm(16).to(torch.bfloat16)\nwith torch.no_grad():\n    m.weight.normal_()\n"
             "x = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)\n"
             "out = (m(x), RMSNorm(16, elementwise_affine=False)(x))\nleaves = [x, m.weight]\n"),
        name="optional_weight_in_a_branch_returned_by_name",
    ),
    Fuse(
        _OPTIONAL_WEIGHT_BY_NAME.replace("if elementwise_affine:\n            self.weight = nn.Parameter(torch.ones(dim))",
                                         "self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None")
                                .replace('if hasattr(self, "weight"):', "if self.weight is not None:"),
        expect={"weight": "self.weight", "weight_condition": "self.weight is not None"},
        run=("m = RMSNorm(16)\nwith torch.no_grad():\n    m.weight.normal_()\nx = torch.randn(2, 3, 16, requires_grad=True)\n"
             "out = (m(x), RMSNorm(16, elementwise_affine=False)(x))\nleaves = [x, m.weight]\n"),
        name="weight_is_not_none_branch_returned_by_name",
    ),
]


# -- L2 spellings through a one-line helper, a named intermediate, a per-head gain (issue 14, class 1) --

_L2_HELPER_AND_HEADS = '''
import torch
from torch import nn
import torch.nn.functional as F


def l2norm(t):
    return F.normalize(t, dim = -1)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return l2norm(x) * self.scale * self.gamma


class HeadNorm(nn.Module):
    def __init__(self, heads, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(heads, 1, dim))

    def forward(self, x):
        normed = F.normalize(x, dim = -1)
        return normed * self.scale * self.gamma
'''

_L2_HELPER_RUN = ("m = RMSNorm(16)\nh = HeadNorm(4, 16)\nwith torch.no_grad():\n    m.gamma.normal_()\n    h.gamma.normal_()\n"
                  "x = torch.randn(2, 4, 5, 16, dtype=torch.bfloat16, requires_grad=True)\nout = (m(x), h(x))\nleaves = [x, m.gamma, h.gamma]\n")

RmsNorm.FUSE += [
    Fuse(
        # ``l2norm(x)`` is F.normalize(x, dim=-1) through a helper; HeadNorm's gain is [heads, 1, d]: not a
        # gamma of the last dim, so it multiplies the fused norm's output (a run-time branch on its shape)
        _L2_HELPER_AND_HEADS,
        expect={"variant": "l2_normalize", "eps_rule": "clamp on the norm", "qualname": "RMSNorm.forward", "line": 18},
        run=_L2_HELPER_RUN,
        name="l2norm_helper_and_per_head_gain",
    ),
]

RmsNorm.KEEP += [
    Keep(
        # a helper that normalises over dim 1 (channels of NCHW) is not a last-dim norm; with no
        # sqrt(d) factor the direct spelling is an L2 normalisation: said so
        _L2_HELPER_AND_HEADS.replace("return F.normalize(t, dim = -1)", "return F.normalize(t, dim = 1)")
                            .replace("self.scale = dim ** 0.5", "self.scale = 2.0"),
        reason="without a sqrt(d) factor",
        name="l2norm_helper_other_dim_and_no_sqrt_d",
    ),
]


# -- an L2 helper with defaulted parameters (s34): ``def l2norm(t, dim = -1, eps = 1e-12): return
# F.normalize(t, dim = dim, eps = eps)`` (denoising-diffusion's karras_unet, pi-zero), ``def l2norm(t,
# dim = -1): return F.normalize(t, dim = dim, p = 2)`` (vit-pytorch, x-transformers): the call is read
# with its own arguments and the helper's defaults in place of the parameters, so ``l2norm(x)`` is a
# last-dim normalisation with the default eps and ``l2norm(x, dim = 1)`` is not one.

_L2_HELPER_DEFAULTS = '''
import torch
from torch import nn
import torch.nn.functional as F


def l2norm(t, dim = -1, eps = 1e-6):
    return F.normalize(t, dim = dim, eps = eps)


def unit_norm(t, dim = -1):
    """unit vectors along dim"""
    return F.normalize(t, p = 2, dim = dim)


class RMSNorm(nn.Module):
    def __init__(self, dim, affine = True):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim)) if affine else 1.0

    def forward(self, x):
        return l2norm(x) * self.gamma * self.scale


class ChanRMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return unit_norm(x, dim = -1) * self.g * (x.shape[-1] ** 0.5)
'''

RmsNorm.FUSE += [
    Fuse(
        # eps comes from the helper's default (1e-6), dim from its default (-1); gamma may be a float
        _L2_HELPER_DEFAULTS,
        expect={"variant": "l2_normalize", "eps": "1e-6", "qualname": "RMSNorm.forward"},
        run=("m = RMSNorm(16)\nplain = RMSNorm(16, affine = False)\nwith torch.no_grad():\n    m.gamma.normal_()\n"
             "x = torch.randn(2, 5, 16, requires_grad=True)\nout = (m(x), plain(x))\nleaves = [x, m.gamma]\n"),
        name="l2norm_helper_with_defaulted_dim_and_eps",
    ),
    Fuse(
        # the dim passed by keyword at the call; the helper's own p = 2 (RMSNorm here normalises dim 1)
        _L2_HELPER_DEFAULTS.replace("return l2norm(x) * self.gamma * self.scale", "return l2norm(x, 1) * self.gamma * self.scale"),
        expect={"variant": "l2_normalize", "eps": "1e-12", "qualname": "ChanRMSNorm.forward"},
        name="l2_helper_dim_passed_at_the_call",
    ),
]

RmsNorm.KEEP += [
    Keep(
        # the same helpers asked for dim 1 (channels of NCHW) at the call: not a last-dim norm
        _L2_HELPER_DEFAULTS.replace("return l2norm(x) * self.gamma * self.scale", "return l2norm(x, 1) * self.gamma * self.scale")
                           .replace("return unit_norm(x, dim = -1)", "return unit_norm(x, dim = 1)"),
        name="l2_helpers_called_on_another_dim",
    ),
    Keep(
        # a default of p = 1 in the helper: an L1 normalisation
        _L2_HELPER_DEFAULTS.replace("def unit_norm(t, dim = -1):", "def unit_norm(t, dim = -1, p = 1):")
                           .replace("return F.normalize(t, p = 2, dim = dim)", "return F.normalize(t, p = p, dim = dim)")
                           .replace("return l2norm(x) * self.gamma * self.scale", "return l2norm(x, 1) * self.gamma * self.scale"),
        name="l2_helper_with_a_p1_default",
    ),
]


# -- the norm returned in one branch of ifs after the computation (OLMo; issue 14) ---------------

_RETURN_IN_BRANCHES = '''
import torch
from torch import nn


class RMSLayerNorm(nn.Module):
    def __init__(self, size, eps=1e-5, affine=True, bias=False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if affine else None
        self.bias = nn.Parameter(torch.zeros(size)) if affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(enabled=False, device_type=x.device.type):
            og_dtype = x.dtype
            x = x.to(torch.float32)
            variance = x.pow(2).mean(-1, keepdim=True)
            x = x * torch.rsqrt(variance + self.eps)
            x = x.to(og_dtype)

        if self.weight is not None:
            if self.bias is not None:
                return self.weight * x + self.bias
            else:
                return self.weight * x
        else:
            return x
'''

RmsNorm.FUSE += [
    Fuse(
        # the path returning ``self.weight * x`` is fused; the bias and weightless paths run the original
        _RETURN_IN_BRANCHES,
        expect={"weight": "self.weight", "qualname": "RMSLayerNorm.forward", "line": 14, "end_line": 27},
        run=("a = RMSLayerNorm(16)\nb = RMSLayerNorm(16, bias=True)\nc = RMSLayerNorm(16, affine=False)\nwith torch.no_grad():\n"
             "    a.weight.normal_()\nx = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)\n"
             "out = (a(x), b(x), c(x))\nleaves = [x, a.weight]\n"),
        name="norm_returned_in_one_branch_of_ifs",
    ),
]

RmsNorm.KEEP += [
    Keep(
        # a loop between the computation and the return is not an if: still refused, with the reason
        _RETURN_IN_BRANCHES.replace("        if self.weight is not None:\n", "        for _ in range(1):\n"),
        reason="another block",
        name="norm_returned_inside_a_loop",
    ),
]


# -- Hugging Face Llama-style RMSNorm classes imported into a model (issue 14) --------------------

_HF_NORM_IMPORTED = '''
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm as RMSNorm


class Patchify(nn.Module):
    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 2, stride=2)
        self.norm = RMSNorm(c, eps)

    def forward(self, x):
        e = self.conv(x)
        e = self.norm(e.permute(0, 2, 3, 1))
        return e.permute(0, 3, 1, 2)


class Down(nn.Module):
    def __init__(self, c, norm_type="rms_norm"):
        super().__init__()
        if norm_type == "rms_norm":
            self.norm = RMSNorm(c, 1e-6)
        else:
            self.norm = nn.LayerNorm(c)

    def forward(self, x):
        return self.norm(x)
'''

RmsNorm.FUSE += [
    # run end to end in tests/test_detect_norms.py (transformers is not a dependency: a stand-in module
    # with transformers' LlamaRMSNorm forward is installed there)
    Fuse(_HF_NORM_IMPORTED, expect={"variant": "hf_norm_module", "module": "self.norm", "norm_class": "RMSNorm",
                                    "qualname": "Patchify.forward", "line": 15, "end_line": 15},
         name="transformers_llama_rmsnorm_on_a_permuted_input"),
]

RmsNorm.KEEP += [
    Keep(
        # the norm of an inline input inside a larger statement: binding the input first would reorder
        # evaluation, and inside a comprehension it cannot be bound where it stands (s27: elsewhere it is)
        _HF_NORM_IMPORTED.split("class Down")[0].replace("class Patchify", "class Unused").replace(
            "        e = self.norm(e.permute(0, 2, 3, 1))\n", "        e = [self.norm(t.permute(0, 2, 3, 1)) for t in e.chunk(2)]\n"),
        reason="inline expression inside a larger statement",
        name="transformers_norm_of_an_inline_input_inside_a_sum",
    ),
]


# -- a mean over the trailing len(normalized_shape) dims (InternEvo's manual_rms_norm; issue 14) ------

_TRAILING_DIMS = '''
import torch


def manual_rms_norm(my_input, normalized_shape, weight, eps):
    # layer norm should always be calculated in float32
    dims = tuple(i for i in range(-1, -len(normalized_shape) - 1, -1))
    variance = my_input.to(torch.float32).pow(2).mean(dims, keepdim=True)
    my_input = my_input * torch.rsqrt(variance + eps)

    if weight is None:
        return my_input

    # convert into half-precision if necessary
    if weight.dtype in [torch.float16, torch.bfloat16]:
        my_input = my_input.to(weight.dtype)

    return weight * my_input
'''

RmsNorm.FUSE += [
    Fuse(
        # dims = the last len(normalized_shape) dims: fused when that is the last dim alone, the original
        # otherwise (and on the weightless early return)
        _TRAILING_DIMS,
        expect={"dim_check": "-len(normalized_shape) == -1", "weight": "weight", "qualname": "manual_rms_norm", "line": 7, "end_line": 18},
        run=("x = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)\nw = torch.randn(16, dtype=torch.bfloat16, requires_grad=True)\n"
             "w2 = torch.randn(3, 16, requires_grad=True)\nout = (manual_rms_norm(x, (16,), w, 1e-5), manual_rms_norm(x, (16,), None, 1e-5),\n"
             "       manual_rms_norm(x, (3, 16), w2, 1e-5), manual_rms_norm(x.float(), [16], w.float(), 1e-5))\nleaves = [x, w, w2]\n"),
        name="mean_over_trailing_dims_of_normalized_shape",
    ),
]

RmsNorm.FUSE += [
    Fuse(
        # the count of trailing dims through a name bound to len(normalized_shape)
        _TRAILING_DIMS.replace("    dims = tuple(i for i in range(-1, -len(normalized_shape) - 1, -1))",
                               "    norm_ndim = len(normalized_shape)\n    dims = tuple(range(-1, -norm_ndim - 1, -1))"),
        expect={"dim_check": "-norm_ndim == -1", "weight": "weight", "qualname": "manual_rms_norm"},
        run=("x = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)\nw = torch.randn(16, dtype=torch.bfloat16, requires_grad=True)\n"
             "w2 = torch.randn(3, 16, requires_grad=True)\nout = (manual_rms_norm(x, (16,), w, 1e-5), manual_rms_norm(x, (3, 16), w2, 1e-5))\n"
             "leaves = [x, w, w2]\n"),
        name="mean_over_trailing_dims_counted_by_a_name",
    ),
]

RmsNorm.KEEP += [
    Keep(
        # the count is a name bound to something else than len(shape) (a shape entry): refused
        _TRAILING_DIMS.replace("    dims = tuple(i for i in range(-1, -len(normalized_shape) - 1, -1))",
                               "    norm_ndim = normalized_shape[0]\n    dims = tuple(range(-1, -norm_ndim - 1, -1))"),
        reason="a run-time value",
        name="mean_over_trailing_dims_counted_by_a_shape_entry",
    ),
    Keep(
        # the leading dims instead (range(0, len(shape))): not the trailing ones, refused with the reason
        _TRAILING_DIMS.replace("range(-1, -len(normalized_shape) - 1, -1)", "range(0, len(normalized_shape))"),
        reason="a run-time value",
        name="mean_over_leading_dims_from_a_shape",
    ),
]

RmsNorm.FUSE += [
    Fuse(
        # a subclass of nn.RMSNorm with neither forward nor __init__: swapped where it is built
        '''
import torch
from torch import nn


class Norm(nn.RMSNorm):
    pass


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.n = Norm(d)

    def forward(self, x):
        return self.n(x)
''',
        expect={"variant": "nn_rmsnorm", "module": "Norm", "target": "self.n", "qualname": "Block.__init__", "line": 13},
        run="b = Block(8)\nx = torch.randn(2, 8, requires_grad=True)\nout = b(x)\nleaves = [x]\n",
        name="nn_rmsnorm_bare_subclass_built_in_another_class",
    ),
]


# -- issue 14, class 1: modulated / conditioned norms (adaLN, gated residual norms) -------------
# The factor after the norm is computed at run time (a per-sample scale with a batch dim): not a
# gamma npu_rms_norm takes, so the op normalizes with ones and the factor is applied after it.

_MODULATED_FN = '''
import torch


def modulated_rms(x, scale, eps=1e-6):
    dtype = x.dtype
    x = x.float()
    ms = x.pow(2).mean(-1, keepdim=True)
    inv = torch.rsqrt(ms + eps)
    x_normed = x * inv
    return (x_normed * (1 + scale.unsqueeze(1).float())).to(dtype)
'''

_MODULATED_MODULE = '''
import torch
from torch import nn


class AdaNorm(nn.Module):
    """adaLN: shift and scale from a conditioning vector, applied to a weightless norm."""

    def __init__(self, d, c, eps=1e-6):
        super().__init__()
        self.proj = nn.Linear(c, 2 * d)
        self.eps = eps

    def forward(self, x, cond):
        shift, scale = self.proj(cond).chunk(2, dim=-1)
        h = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + self.eps)
        return h * (1 + scale[:, None, :]) + shift[:, None, :]
'''

_GATED_RESIDUAL = '''
import torch


def gated_residual_rms(x, x_res, gate, eps=1e-6):
    x_res = x_res.float()
    rstd = torch.rsqrt(torch.mean(x_res * x_res, dim=-1, keepdim=True) + eps)
    g = torch.tanh(gate).unsqueeze(1)
    return x + (x_res * rstd * g).type_as(x)
'''

RmsNorm.FUSE += [
    Fuse(
        _MODULATED_FN,
        expect={"variant": "modulated", "weight": None, "modulation": ["1 + scale.unsqueeze(1).float()"],
                "upcast": "float32", "output_dtype": "input"},
        run=("x = torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True)\ns = torch.randn(2, 16, requires_grad=True)\n"
             "out = modulated_rms(x, s)\nleaves = [x, s]\n"),
        name="modulated_function_per_sample_scale",
    ),
    Fuse(
        _MODULATED_MODULE,
        expect={"variant": "modulated", "modulation": ["1 + scale[:, None, :]"], "upcast": None, "qualname": "AdaNorm.forward"},
        run=("m = AdaNorm(16, 8)\nx = torch.randn(3, 4, 16, requires_grad=True)\nc = torch.randn(3, 8)\n"
             "out = m(x, c)\nleaves = [x, m.proj.weight]\n"),
        name="modulated_module_adaln_shift_scale",
    ),
    Fuse(
        _GATED_RESIDUAL,
        expect={"variant": "modulated", "modulation": ["g"], "input": "x_res", "output_dtype": "dtype of x"},
        run=("x = torch.randn(2, 3, 16, dtype=torch.bfloat16)\nr = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)\n"
             "g = torch.randn(2, 16, requires_grad=True)\nout = gated_residual_rms(x, r, g)\nleaves = [r, g]\n"),
        name="modulated_tanh_gated_residual",
    ),
]

RmsNorm.KEEP += [
    Keep(
        # the factor reads the normalized input again (a gated activation of x): not a modulation
        _GATED_RESIDUAL.replace("g = torch.tanh(gate).unsqueeze(1)", "g = torch.sigmoid(x_res)").replace("    x_res = x_res.float()\n", ""),
        reason="reads the normalized input again",
        name="modulated_factor_reads_the_input",
    ),
]


# -- issue 14, class 1: the rstd built in one statement and applied in another -------------------
# The weight times the rstd first, that product cast, then x (``x * s.to(x.dtype)``); the rstd
# returned by a helper. A weight handed in as an argument is fused only where it is 1-D: a shared
# helper also called with a per-sample scale ([B, 1, D]) would otherwise change what is normalized.

_WEIGHT_TIMES_RSTD = '''
from functools import reduce

import torch


def rms_norm(x, scale, eps):
    dtype = reduce(torch.promote_types, (x.dtype, scale.dtype, torch.float32))
    mean_sq = torch.mean(x.to(dtype) ** 2, dim=-1, keepdim=True)
    scale = scale.to(dtype) * torch.rsqrt(mean_sq + eps)
    return x * scale.to(x.dtype)


class AdaNorm(torch.nn.Module):
    def __init__(self, d, c):
        super().__init__()
        self.lin = torch.nn.Linear(c, d)

    def forward(self, x, cond):
        return rms_norm(x, self.lin(cond)[:, None, :] + 1, 1e-6)
'''

_RSTD_HELPER = '''
import torch


def _inv_rms(t, eps):
    return torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + eps)


class Norm(torch.nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return (x.float() * _inv_rms(x, self.eps)).type_as(x) * self.weight
'''

RmsNorm.FUSE += [
    Fuse(
        _WEIGHT_TIMES_RSTD,
        expect={"qualname": "rms_norm", "weight": "scale", "weight_check": "(scale is None or scale.dim() == 1)", "output_dtype": "input"},
        run=("x = torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True)\ng = torch.randn(16, requires_grad=True)\n"
             "m = AdaNorm(16, 8)\nout = (rms_norm(x, g, 1e-6), m(x.float(), torch.randn(2, 8)))\nleaves = [x, g]\n"),
        name="weight_times_rstd_cast_then_x",
    ),
    Fuse(
        _RSTD_HELPER,
        expect={"qualname": "Norm.forward", "weight": "self.weight", "upcast": "float32"},
        run=("m = Norm(16)\nwith torch.no_grad():\n    m.weight.normal_()\nx = torch.randn(2, 3, 16, dtype=torch.bfloat16, requires_grad=True)\n"
             "out = m(x)\nleaves = [x, m.weight]\n"),
        name="rstd_returned_by_a_helper",
    ),
]

RmsNorm.KEEP += [
    Keep(
        # the rstd of x applied to another tensor (x reversed along its last dim): not a norm of anything
        _WEIGHT_TIMES_RSTD.replace("return x * scale.to(x.dtype)", "return x.flip(-1) * scale.to(x.dtype)"),
        reason="computed but not applied as x * rstd * weight in one place",
        name="weight_times_rstd_with_a_factor_after_the_cast",
    ),
]



# -- transformers' Llama-style RMSNorm built in this repo and called by inherited code (issue 14) ----

_HF_NORM_BUILT_FOR_INHERITED = '''
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel, LlamaRMSNorm


class SparseLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )


class Backbone(LlamaModel):
    def __init__(self, config):
        super().__init__(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
'''

RmsNorm.FUSE += [
    # run end to end in tests/test_detect_ho4_norm_rope_attn.py (a stand-in transformers module there)
    Fuse(_HF_NORM_BUILT_FOR_INHERITED, expect={"variant": "hf_norm_construction", "target": "self.input_layernorm",
                                               "norm_class": "LlamaRMSNorm", "qualname": "SparseLayer.__init__", "line": 10},
         name="transformers_rmsnorm_built_for_an_inherited_forward"),
]

RmsNorm.KEEP += [
    Keep(
        # a norm class transformers writes differently (Gemma: x * (1 + weight)) is not assumed Llama-style
        _HF_NORM_BUILT_FOR_INHERITED.replace("LlamaRMSNorm", "GemmaRMSNorm").replace("modeling_llama import", "modeling_gemma import"),
        reason="",
        name="transformers_gemma_rmsnorm_built_is_not_llama_style",
    ),
]


# -- eps added to the scaled 2-norm (stripedhyena-style; issue 14, held-out 4) ---------------------

_EPS_ADDED_TO_NORM = '''
import math
import torch
from torch import nn


class ScaledNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps, self.d = eps, d
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        y = x / (x.norm(2, dim=-1, keepdim=True) * self.d ** (-1.0 / 2) + self.eps)
        return self.scale * y


class InlineNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps, self.d = eps, d
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.g * x / (torch.linalg.vector_norm(x, dim=-1, keepdim=True) / math.sqrt(self.d) + self.eps)
'''

_EPS_ADDED_RUN = '''
m = {cls}(32){cast}
with torch.no_grad():
    getattr(m, "{w}").normal_()
x = torch.randn(3, 5, 32{dtype}, requires_grad=True)
out = m(x)
leaves = [x, getattr(m, "{w}")]
'''

RmsNorm.FUSE += [
    Fuse(_EPS_ADDED_TO_NORM, expect={"variant": "l2_norm_eps_added", "qualname": "ScaledNorm.forward", "eps": "self.eps",
                                     "eps_rule": "added to the scaled norm", "x": "x"},
         run=_EPS_ADDED_RUN.format(cls="ScaledNorm", cast="", dtype="", w="scale"), name="eps_added_to_scaled_norm_next_statement_gain"),
    Fuse(_EPS_ADDED_TO_NORM.split("class ScaledNorm")[0] + "class ScaledNorm" + _EPS_ADDED_TO_NORM.split("class InlineNorm")[1].replace("(nn.Module)", "(nn.Module)", 1),
         expect={"variant": "l2_norm_eps_added", "qualname": "ScaledNorm.forward"},
         run=_EPS_ADDED_RUN.format(cls="ScaledNorm", cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16", w="g"),
         name="eps_added_to_norm_over_sqrt_d_inline_gain_bf16"),
]

RmsNorm.KEEP += [
    Keep(
        # no 1/sqrt(d) on the norm: x / (||x|| + eps) * g is an L2 normalisation with a gain (ScaleNorm)
        _EPS_ADDED_TO_NORM.split("class InlineNorm")[0].replace(" * self.d ** (-1.0 / 2) + self.eps)", " + self.eps)"),
        reason="without a sqrt(d) factor",
        name="eps_added_to_unscaled_norm_is_scalenorm",
    ),
]



# --- a non-negative mean dim that is the last one by an asserted rank (moshi; issue 14, held-out 4) ---
#
# ``assert x.dim() == 3`` then ``torch.mean(x**2, dim=2, keepdim=True)``: dim 2 of a 3-D tensor is its
# last dim. The rank is taken from an ``assert`` at the top level of the same function on the same
# name, where every assignment to that name in the function is a cast of itself (a cast keeps the
# rank); anything else (a reshape, a value from elsewhere) leaves the dim unproven.

_RANK_KEEPING = ("to", "float", "half", "bfloat16", "double", "type", "type_as", "contiguous")


def _asserted_rank(stmt: ast.stmt, name: str) -> int | None:
    """N of ``assert <name>.dim() == N`` / ``<name>.ndim == N`` / ``len(<name>.shape) == N`` (also inside ``and``)."""
    if not isinstance(stmt, ast.Assert):
        return None
    tests = stmt.test.values if isinstance(stmt.test, ast.BoolOp) and isinstance(stmt.test.op, ast.And) else [stmt.test]
    for t in tests:
        if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)):
            continue
        for a, b in ((t.left, t.comparators[0]), (t.comparators[0], t.left)):
            n = const_value(b)
            if not isinstance(n, int) or isinstance(n, bool):
                continue
            if isinstance(a, ast.Call) and isinstance(a.func, ast.Attribute) and a.func.attr in ("dim", "ndimension") and not a.args \
                    and isinstance(a.func.value, ast.Name) and a.func.value.id == name:
                return n
            if isinstance(a, ast.Attribute) and a.attr == "ndim" and isinstance(a.value, ast.Name) and a.value.id == name:
                return n
            if isinstance(a, ast.Call) and isinstance(a.func, ast.Name) and a.func.id == "len" and len(a.args) == 1 \
                    and isinstance(a.args[0], ast.Attribute) and a.args[0].attr == "shape" \
                    and isinstance(a.args[0].value, ast.Name) and a.args[0].value.id == name:
                return n
    return None


def _casts_itself(value: ast.AST | None, name: str) -> bool:
    """``name.to(...)`` / ``name.float()`` ...: a value of the same rank as ``name``."""
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _RANK_KEEPING \
        and isinstance(value.func.value, ast.Name) and value.func.value.id == name


def _asserted_last_dim(ctx: "S.Ctx", y: ast.expr, dim: int) -> bool:
    """``dim`` (>= 0) is the last dim of ``y`` by a rank asserted in the enclosing function."""
    fn = ctx.scope.node
    if dim < 0 or not isinstance(y, ast.Name) or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    ranks = {r for st in fn.body if (r := _asserted_rank(st, y.id)) is not None}
    if ranks != {dim + 1}:
        return False
    for node in ast.walk(fn):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == y.id for t in targets) and not _casts_itself(node.value, y.id):
                return False
        elif isinstance(node, (ast.For, ast.With, ast.NamedExpr)) and any(
                isinstance(t, ast.Name) and t.id == y.id for t in ast.walk(getattr(node, "target", node))
                if isinstance(node, (ast.For, ast.NamedExpr))):
            return False
    return True

_ASSERTED_RANK_NORM = '''
import torch
from torch import nn


class Norm3d(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        assert x.dim() == 3, "expects [B, T, C]"
        x = x.float()
        var = torch.mean(x ** 2, dim=2, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))
'''

RmsNorm.FUSE += [
    Fuse(_ASSERTED_RANK_NORM, expect={"qualname": "Norm3d.forward"},
         run=("m = Norm3d(16)\nwith torch.no_grad():\n    m.weight.normal_()\n"
              "x = torch.randn(2, 5, 16, requires_grad=True)\nout = m(x)\nleaves = [x, m.weight]\n"),
         name="mean_over_dim_2_of_an_asserted_3d_input"),
]

RmsNorm.KEEP += [
    Keep(_ASSERTED_RANK_NORM.replace("x.dim() == 3", "x.dim() == 4"), reason="mean over dim 2, not the last dim",
         name="mean_over_dim_2_of_an_asserted_4d_input"),
    Keep(_ASSERTED_RANK_NORM.replace("x = x.float()", "x = x.transpose(1, 2)"), reason="mean over dim 2, not the last dim",
         name="mean_over_dim_2_after_a_rank_assert_and_a_transpose"),
]


# -- a TorchScript RMSNorm rebinding its input inside the fused statements (ModelCenter-style) -------

_SCRIPTED_RMS_REBINDS_INPUT = '''
import torch


@torch.jit.script
def rms_layernorm(hidden: torch.Tensor, weight: torch.Tensor, eps: float):
    old_dtype = hidden.dtype
    variance = hidden.to(torch.float32).pow(2).mean(dim=-1, keepdim=True)
    hidden = (hidden * torch.rsqrt(variance + eps)).to(old_dtype)
    return hidden * weight
'''

RmsNorm.FUSE += [
    Fuse(
        # the input is rebound by the statements the fused code replaces: the wrapper's entry check reads
        # the value the site reads
        _SCRIPTED_RMS_REBINDS_INPUT,
        expect={"qualname": "<module>", "lifted_from": "rms_layernorm"},
        run=("x = torch.randn(3, 5, 16).to(torch.bfloat16).requires_grad_()\nw = torch.randn(16, dtype=torch.bfloat16, requires_grad=True)\n"
             "out = rms_layernorm(x, w, 1e-5)\nleaves = [x, w]\n"),
        name="torchscript_rmsnorm_rebinding_its_input_in_the_site",
    ),
]

RmsNorm.KEEP += [
    Keep(
        # rebound before the site: the tensor the wrapper would test is not the one normalised
        _SCRIPTED_RMS_REBINDS_INPUT.replace("    old_dtype = hidden.dtype\n", "    hidden = hidden.flip(-1)\n    old_dtype = hidden.dtype\n"),
        reason="is not a parameter left unchanged",
        name="torchscript_rmsnorm_rebinding_its_input_before_the_site",
    ),
]


# --- norms (s25): the hand-written norm in one branch of a backend switch ----------------------
# TGI / lorax / DeepSpeed style: ``if <backend a>: kernel(x) elif <cond>: <hand-written norm of x>
# else: other_kernel(x)``. The other branches read x too, but never after the norm's branch ran.

_BACKEND_BRANCHES = '''
import torch
from torch import nn

USE_KERNEL = False


def kernel_norm(x, w, eps):
    return x


class FastRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, hidden_states, residual=None):
        if USE_KERNEL:
            return kernel_norm(hidden_states, self.weight, self.variance_epsilon), residual
        elif hidden_states.shape[-1] >= 8:
            if residual is not None:
                hidden_states = hidden_states + residual
            residual = hidden_states
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            if self.weight.dtype in [torch.float16, torch.bfloat16]:
                hidden_states = hidden_states.to(self.weight.dtype)
            return self.weight * hidden_states, residual
        else:
            out = kernel_norm(hidden_states, self.weight, self.variance_epsilon)
            return out * 2, hidden_states
'''

RmsNorm.FUSE += [
    Fuse(
        _BACKEND_BRANCHES,
        expect={"qualname": "FastRMSNorm.forward", "eps": "self.variance_epsilon"},
        run=("norm = FastRMSNorm(32).to(torch.bfloat16)\nwith torch.no_grad():\n    norm.weight.normal_()\n"
             "x = torch.randn(3, 32, dtype=torch.bfloat16, requires_grad=True)\nout = norm(x)[0]\nleaves = [x]\n"),
        name="norm_in_one_branch_of_a_backend_switch",
    ),
]

RmsNorm.KEEP += [
    Keep(
        # in a loop the next iteration's other branch does read the value the norm's branch left
        '''
import torch
from torch import nn


def kernel_norm(x):
    return x


class LoopNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, h, steps):
        for step in range(steps):
            if step % 2 == 0:
                h = h.to(torch.float32)
                variance = h.pow(2).mean(-1, keepdim=True)
                normed = h * torch.rsqrt(variance + self.eps)
                h = normed * self.weight
            else:
                h = kernel_norm(h) + normed  # the previous step's intermediate
        return h
''',
        reason="reused after the fused region",
        name="norm_in_one_branch_of_an_if_inside_a_loop",
    ),
]


# --- norms (s25): other libraries' RMSNorm modules (see _library_norm.library_construction_sites;
# the emulated rewrite is checked with stand-ins of apex/xformers in tests/test_detect_norm_libraries.py)

RmsNorm.FUSE += [
    Fuse(
        '''
from torch import nn
from xformers.ops import RMSNorm


class Block(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.ffn_norm = RMSNorm(dim, eps=eps)
''',
        expect={"variant": "library_rmsnorm", "module": "xformers.ops.RMSNorm", "target": "self.ffn_norm"},
        name="xformers_rmsnorm_construction",
    ),
    Fuse(
        '''
from torch import nn
from apex.normalization import MixedFusedRMSNorm as RMSNorm


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = RMSNorm(dim, eps=1e-6)
''',
        expect={"variant": "library_rmsnorm", "module": "apex.normalization.MixedFusedRMSNorm"},
        name="apex_mixed_fused_rmsnorm_construction",
    ),
]

# s37: diffusers' RMSNorm (no NPU path before diffusers 0.33), built by a norm-layer factory's nested def
# (SeedVR's ``get_norm_layer(norm_type)._norm_layer``) or imported through diffusers' attention module
RmsNorm.FUSE += [
    Fuse(
        '''
from torch import nn
from diffusers.models.normalization import RMSNorm


def norm_factory(kind):
    def _make(width, eps, affine):
        if kind is None:
            return nn.Identity()
        if kind == "rms":
            return RMSNorm(dim=width, eps=eps, elementwise_affine=affine)
        return nn.LayerNorm(width, eps=eps, elementwise_affine=affine)

    return _make
''',
        expect={"variant": "library_rmsnorm", "module": "diffusers.models.normalization.RMSNorm", "qualname": "norm_factory._make"},
        name="s37_diffusers_rmsnorm_built_by_a_norm_factory",
    ),
    Fuse(
        '''
import torch
from diffusers.models.attention_processor import RMSNorm as DNorm


class QKNorm(torch.nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        self.q, self.k = DNorm(head_dim, eps=1e-6), DNorm(head_dim, eps=1e-6)
''',
        expect={"variant": "library_rmsnorm", "module": "diffusers.models.attention_processor.RMSNorm", "constructions": 2},
        name="s37_diffusers_rmsnorm_through_the_attention_module",
    ),
]

RmsNorm.KEEP += [
    # diffusers' LayerNorm / AdaLayerNorm are mean-centred: no library RMSNorm
    Keep(
        '''
from torch import nn
from diffusers.models.normalization import AdaLayerNorm, LayerNorm


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = LayerNorm(dim, eps=1e-6)
        self.ada = AdaLayerNorm(dim, 10)
''',
        name="s37_diffusers_layer_norms_are_not_swapped",
    ),
]

RmsNorm.KEEP += [
    Keep(
        '''
from torch import nn
import transformer_engine.pytorch as te


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = te.RMSNorm(dim, eps=1e-5, zero_centered_gamma=True)
''',
        reason="TransformerEngine's RMSNorm",
        name="transformer_engine_rmsnorm_construction",
    ),
]



# --- norms (s25): a statistic in the fallback of an existing NPU branch, never matched whole --------
# diffusers' RMSNorm: ``if is_torch_npu_available(): ... npu_rms_norm ... else: <hand-written norm
# whose weight multiply sits in a nested if>``. The matcher never completes there, so the site said
# nothing at all; it is already fused on NPU, and the near miss says so.

def _already_fused_statistics(module: ModuleInfo, scope: Scope, results: list[SiteResult]) -> None:
    """A near miss for each rsqrt statistic no result covers that sits in an NPU branch's fallback."""
    covered = [(r.stmt.lineno, r.stmt.end_lineno or r.stmt.lineno) for r in results]
    covered += [(x.line, x.end_line) for r in results for x in (r.finding, r.miss) if x is not None]
    seen: set[int] = set()
    for stmt, node in _rstd_sites(module, scope):
        if id(stmt) in seen or any(a <= stmt.lineno <= b for a, b in covered):
            continue
        seen.add(id(stmt))
        done = S.already_fused(module, scope, stmt)
        if done:
            results.append(SiteResult(stmt, None, None, NearMiss("rms_norm", scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno,
                                                                 f"{done} (this statistic is in its fallback)"), node))


_NPU_BRANCH_NESTED_WEIGHT = '''
import torch
from torch import nn


def is_torch_npu_available():
    return False


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, elementwise_affine=True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, hidden_states):
        if is_torch_npu_available():
            import torch_npu

            hidden_states = torch_npu.npu_rms_norm(hidden_states, self.weight, epsilon=self.eps)[0]
        else:
            input_dtype = hidden_states.dtype
            variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
            if self.weight is not None:
                if self.weight.dtype in [torch.float16, torch.bfloat16]:
                    hidden_states = hidden_states.to(self.weight.dtype)
                hidden_states = hidden_states * self.weight
            else:
                hidden_states = hidden_states.to(input_dtype)
        return hidden_states
'''

RmsNorm.KEEP += [
    Keep(_NPU_BRANCH_NESTED_WEIGHT, reason="already has a torch_npu branch (this statistic is in its fallback)",
         name="statistic_in_the_fallback_of_an_npu_branch"),
    Keep(
        '''
import torch
from torch import nn

HAS_NPU = False


class Norm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if not HAS_NPU:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        return torch_npu.npu_rms_norm(x, self.weight, epsilon=1e-6)[0]
''',
        reason="already has a torch_npu branch",
        name="norm_in_the_body_of_a_negated_npu_test",
    ),
]


# --- s26 norms: in-place eps add on a temporary ---------------------------------------------


def _inplace_add_on_temporary(node: ast.AST) -> tuple[ast.expr, ast.Call, int] | None:
    """``mean(...).add_(eps)``: an in-place add on the fresh tensor a call just returned (the
    mean of squares) is ``mean(...) + eps`` and changes nothing anyone else can read. On a name
    (``var.add_(eps)``) the add would also change ``var`` for later readers: not accepted."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_" \
            and isinstance(node.func.value, ast.Call) and len(node.args) == 1 and not node.keywords:
        return node.func.value, node, 0
    return None


# --- s26 norms: pure-torch fallbacks of an optional kernel import ----------------------------


def _import_fallback_def(module: ModuleInfo, scope: Scope) -> bool:
    """A module-level ``def`` in the ``except ImportError`` handler of a ``try`` that imports the
    same name (``try: from flash_attn.ops.rms_norm import rms_norm as impl / except ImportError:
    def impl(x, w, eps): ...``). It is what runs on NPU where the kernel package is absent; when
    every call of it lies in a caller's finding that reads through it, the callers are the sites
    (where the kernel or its fallback is used), and the def needs no replacement of its own."""
    fn = scope.node
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or "ImportError" not in module.source:
        return False
    for node in module.tree.body:
        if not isinstance(node, ast.Try):
            continue
        imported = {a.asname or a.name.split(".")[0] for s in node.body if isinstance(s, (ast.Import, ast.ImportFrom)) for a in s.names}
        if fn.name not in imported:
            continue
        for h in node.handlers:
            names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
            if any(isinstance(t, ast.Name) and t.id in ("ImportError", "ModuleNotFoundError") for t in names) \
                    and any(s is fn for s in h.body):
                return True
    return False


# --- s26 norms: examples (timm's RmsNorm family; the emulated swap is checked with a timm
# stand-in in tests/test_detect_s26_norms.py) and optional-kernel fallbacks --------------------

RmsNorm.FUSE += [
    Fuse(
        '''
from torch import nn
from timm.models.vision_transformer import RmsNorm


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm1 = RmsNorm(dim, eps=1e-6)
''',
        expect={"variant": "library_rmsnorm", "module": "timm.RmsNorm", "target": "self.norm1"},
        name="timm_rmsnorm_reexported_by_a_model_module",
    ),
    Fuse(
        '''
import torch
from torch import nn

try:
    from fused_kernels.rms import rms_norm as rms_norm_impl
except ImportError:
    def rms_norm_impl(x, weight, epsilon):
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(epsilon))) * weight


class FastRMSNorm(nn.Module):
    def __init__(self, C, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(C))

    def forward(self, x):
        src_type = x.dtype
        return rms_norm_impl(x.float(), self.weight, epsilon=self.eps).to(src_type)
''',
        expect={"qualname": "FastRMSNorm.forward", "line": 19},
        run="m = FastRMSNorm(32)\nwith torch.no_grad():\n    m.weight.normal_()\nx = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)\nout = m(x)\nleaves = [x, m.weight]\n",
        name="kernel_import_fallback_called_by_a_module_inplace_eps_add",
    ),
]

RmsNorm.KEEP += [
    Keep(
        '''
from torch import nn
from timm.layers import RmsNorm2d


class Stem(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = RmsNorm2d(dim)  # normalises dim 1 of NCHW, not the trailing dims
''',
        name="timm_rmsnorm2d_is_channel_first",
    ),
    Keep(
        '''
import torch


def norm(x, w, eps):
    var = x.pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(var.add_(eps)) * w  # changes var in place: later readers see var + eps
    return y, var
''',
        name="inplace_eps_add_on_a_named_variance",
    ),
]

# s26 norms: F.normalize of a cast of the input (the cast is computed once in the fused branch)
RmsNorm.FUSE += [
    Fuse(
        '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class MultiHeadRMSNorm(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(heads, dim))

    def forward(self, x):
        return (F.normalize(x.float(), dim=-1) * self.gamma * self.scale).to(x.dtype)
''',
        expect={"variant": "l2_normalize", "x": "x.float()", "qualname": "MultiHeadRMSNorm.forward"},
        run="m = MultiHeadRMSNorm(32, 4)\nwith torch.no_grad():\n    m.gamma.normal_()\n"
            "x = torch.randn(2, 5, 4, 32, dtype=torch.bfloat16, requires_grad=True)\nout = m(x)\nleaves = [x, m.gamma]\n",
        name="l2_normalize_of_a_cast_per_head_gamma",
    ),
]

RmsNorm.KEEP += [
    Keep(
        '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Norm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(self.proj(x), dim=-1) * self.g * x.shape[-1] ** 0.5
''',
        reason="the normalised input is an expression",
        name="l2_normalize_of_a_call_result",
    ),
]


# --------------------------------------------------------------------------------------------
# s41 (fwdad41): where a repository norm class puts its eps, read the way this detector reads it.
# add_rms_norm takes a class it cannot read into its own file (the class reads a constant or a
# helper of its file) by its RMSNorm name, with HF semantics assumed: the class's eps handed to
# npu_add_rms_norm inside the root. A class that adds eps to the rms outside the root
# (``x / (sqrt(mean(x^2)) + eps)``, ``x / (rms + eps)``) computes another function (0.06% at rms
# 0.03, up to 1.41x near rms 1e-3); this detector maps such an eps to eps' = eps ** 2 (numeric
# probe, with its stated difference); add_rms_norm refuses it, as it does for a class it reads
# (parse_norm's "eps outside the sqrt"). One reader for both: this function.

_EPS_WORD = re.compile(r"eps|epsilon", re.IGNORECASE)
_CLAMPS = frozenset(("clamp", "clamp_min", "clip", "max", "maximum"))


def _reads_eps(node: ast.expr, me: str) -> bool:
    """``self.<..eps..>``, a parameter or name spelled like an eps, or a small literal (``1e-6``)."""
    d = dotted(node)
    if d is not None:
        last = d.rsplit(".", 1)[-1]
        return (d.startswith(me + ".") or "." not in d) and _EPS_WORD.search(last) is not None
    v = const_value(node)
    return type(v) is float and 0 < v < 1e-2


def class_eps_outside_root(module: ModuleInfo, cls_name: str) -> str | None:
    """Why the ``forward`` of class ``cls_name`` (a class of ``module``, read in its own file) does
    not put eps inside the root as ``npu_rms_norm`` does; None where nothing says so. Two readings:
    this detector's own verdict on the forward (its matcher's "eps outside the sqrt" refusal), and a
    division by a sum holding an eps (``x / (rms + eps)``) or by a norm clamped at one
    (``x / rms.clamp(min=eps)``), wherever the rms comes from (a helper of the file, a constant)."""
    fwd = S.method(module, cls_name, "forward")
    scope = S.scope_of(module, fwd) if fwd is not None else None
    if fwd is None or scope is None:
        return None
    for r in scope_results(module, scope):
        if r.miss is not None and r.miss.reason.startswith("eps outside the sqrt"):
            return r.miss.reason
    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    me = params[0] if params else "self"
    for node in fast_walk(fwd):
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
            continue
        den, _ctx = S.peel(node.right, S.Ctx(scope, node.lineno))
        if isinstance(den, ast.BinOp) and isinstance(den.op, ast.Add) and any(_reads_eps(s, me) for s in (den.left, den.right)):
            return (f"eps outside the sqrt: `{ast.unparse(node)}` divides by the rms plus eps, not npu_rms_norm's "
                    "x * rsqrt(mean(x^2) + eps)")
        if isinstance(den, ast.Call):
            name = dotted(den.func) or ""
            operands = [*den.args, *(k.value for k in den.keywords)]
            last = den.func.attr if isinstance(den.func, ast.Attribute) else name.rsplit(".", 1)[-1]
            if last in _CLAMPS and any(_reads_eps(a, me) for a in operands):
                return (f"eps clamps the norm from below: `{ast.unparse(node)}` divides by max(rms, eps), not "
                        "npu_rms_norm's x * rsqrt(mean(x^2) + eps)")
    return None


# --------------------------------------------------------------------------------------------
# numeric probe fallback (issue 14): a function the syntactic matcher found nothing in, whose
# text names a statistic and a root/norm, is EVALUATED on sampled inputs by
# npufuse.scan.numeric_probe and compared with RMSNorm's reference; proven ones become findings.

_PROBE = True  # tests switch the fallback off to compare


def _probe_target(module: ModuleInfo, scope: Scope) -> tuple[ast.FunctionDef, ast.ClassDef | None] | None:
    """The function of ``scope`` the probe may evaluate: a module-level function or a method of a
    module-level class (not a nested def: its closure is unknown), whose text passes the gates."""
    fn = scope.node
    if not isinstance(fn, ast.FunctionDef) or fn.name == "__init__":
        return None
    cls = None
    if scope.class_name is not None:
        cls = module.classes.get(scope.class_name)
        if cls is None or fn not in cls.body:
            return None
    elif module.functions.get(fn.name) is not fn:
        return None
    from npufuse.scan import numeric_probe  # no torch: its gates read text and AST only

    if not numeric_probe.probe_worthy(module, scope, fn):
        return None
    return fn, cls


# A matcher near miss is a question the spelling could not settle; the probe settles it by
# value (a proof replaces the whole function, so span questions vanish too). Only the refusals
# that no value can overturn stand: an existing torch_npu branch.
_PROBE_NEVER_OVERRIDES = ("torch_npu", "already")


def _probe_may_override(reason: str) -> bool:
    return not any(w in reason for w in _PROBE_NEVER_OVERRIDES)


def probe_results(module: ModuleInfo, scope: Scope, matched: list[Result | None]) -> list[Result]:
    """Findings/near misses the numeric probe proves in a scope where the matcher found no norm
    (``matched``: its results there; near misses saying only that the matcher could not follow
    the code -- control flow, a reassigned input -- do not stop the probe, which then replaces
    them; any finding, covered norm or factual refusal does)."""
    if not _PROBE or any(r is None or isinstance(r, Finding) or not _probe_may_override(r.reason) for r in matched):
        return []
    target = _probe_target(module, scope)
    if target is None:
        return []
    fn, cls = target
    from npufuse.scan import numeric_probe  # imports torch only when a probe runs

    proof = numeric_probe.prove_rms_norm(module, fn, cls)
    stats = module.__dict__.setdefault("_npufuse_probe_stats", [])
    stats.append((scope.qualname, proof.kind, proof.reason))
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str))]
    if not body:
        return []
    line, end = body[0].lineno, body[-1].end_lineno or body[-1].lineno
    if proof.kind in ("mismatch", "conditional") and not matched:  # the matcher's own reasons stand where it gave some
        return [NearMiss("rms_norm", scope.qualname, line, end, f"numeric probe on sampled inputs: {proof.reason}")]
    if proof.kind != "proved":
        return []
    # a helper the function runs that is itself a finding covers it (one replacement per norm)
    for helper in proof.entered:
        for sc in module.scopes:
            if sc.node is helper and any(r.finding is not None for r in scope_results(module, sc)):
                return []
    if body[0].lineno == fn.lineno:
        return []  # ``def f(x): return ...`` on one line: no block to put the guard in
    T = S.torch_name(module)
    if T is None:
        return []
    return [_probe_finding(module, scope, proof, body, T)]


def _probe_finding(module: ModuleInfo, scope: Scope, proof: Any, body: list[ast.stmt], T: str) -> Finding:
    x, W = proof.x, proof.weight
    from npufuse.scan import numeric_probe

    form = getattr(proof, "eps_form", "inside")
    half_only = form != "inside" and proof.eps_bound > numeric_probe._EPS_FORM_BOUND
    dtypes = f"({T}.float16, {T}.bfloat16)" if half_only else f"({T}.float16, {T}.bfloat16, {T}.float32)"
    guards = [f"2 <= {x}.dim() <= {getattr(proof, 'max_rank', 8)}", f"{x}.dtype in {dtypes}"]
    pre: list[str] = []
    if W is None:
        gamma = f"{x}.new_ones({x}.shape[-1])"
    else:
        guards += [f"isinstance({W}, {T}.Tensor)", f"{W}.dim() == 1", f"{x}.shape[-1] == {W}.shape[0]"]
        g = f"(1 + {W})" if proof.weight_offset else W
        if proof.weight_offset:
            pre.append(f"_npu_gamma = 1 + {W}")
            g = "_npu_gamma"
        pre.append("# npu_rms_norm takes gamma in the input's dtype, or float32 with an fp16/bf16 input")
        pre.append(f"_npu_gamma = {g} if {g}.dtype in ({x}.dtype, {T}.float32) else {g}.to({x}.dtype)")
        gamma = "_npu_gamma"
    cast = {"input": "", "float32": f".to({T}.float32)", "weight": f".to({W}.dtype)",
            "promote": f".to({T}.promote_types({x}.dtype, {W}.dtype))"}[proof.dtype_rule]
    guards += list(proof.guards)
    if form != "inside":  # (s46 review) the probe measured the default eps: a larger instance eps runs the original
        guards.append(f"{proof.eps} <= {numeric_probe.eps_prime_limit(form == 'outside', half_only)!r}")
    call = f"return torch_npu.npu_rms_norm({x}, {gamma}, epsilon={proof.eps})[0]{cast}"
    fused = "\n".join([f"if {' and '.join(guards)}:", S.indent("\n".join([*pre, call])), S.block_source(module, body)])
    risks = [
        Risk("numerics", "proved by numeric probe on sampled inputs (random x of shapes [2,3,D] and [5,D], fp32/bf16/fp16, "
             "weights random): the function equals x * rsqrt(mean(x^2, -1) + eps) * w on those samples, not by a proof over all inputs"),
        Risk("numerics", "npu_rms_norm computes in fp32 and rounds once; the original may round in between: ≤1-ulp differences"),
        Risk("dtype", "npu_rms_norm: fp16/bf16/fp32; gamma in the input's dtype, or fp32 with fp16/bf16 input (A2/A3 only; 310P/910 need the same dtype)"),
    ]
    if form != "inside":
        risks.append(_eps_form_risk(proof, x, half_only))
    if proof.sampled:
        risks.append(Risk("other", "branches on the input were sampled (fp32/bf16/fp16, 2-D and 3-D), not proven for every input: "
                          + "; ".join(f"`{s}`" for s in proof.sampled[:4])))
    in_place = _s42_in_place_statement(body)
    if in_place is not None:
        risks.append(Risk("other", f"the original changes a tensor in place (`{in_place}`): where that tensor is the caller's "
                                   f"input ({x}.float() of a float32 {x} is {x} itself) the caller sees it normalised; the "
                                   "fused branch leaves the input as it was"))
    notes = ["proved by numeric probe on sampled inputs (the syntactic matcher found nothing here)",
             f"output dtype rule observed: {proof.dtype_rule}; eps solved numerically = {proof.eps_value:.3g}, matched to `{proof.eps}`"]
    if proof.guards:
        notes.append("run-time guards for what the probe assumed: " + ", ".join(proof.guards))
    params_extra: dict[str, Any] = {}
    if form != "inside":
        clamps = getattr(proof, "eps_clamps", "norm")
        rule = "added outside the root" if form == "outside" else f"clamp on the {clamps}"
        params_extra = {"eps_rule": rule, "eps_original": proof.eps_base, "eps_bound": float(f"{proof.eps_bound:.2g}")}
        notes.append(f"eps: {rule} in the original (`{proof.eps_base}`), passed as eps' = {proof.eps} inside the root "
                     "(same value where the rms is far above it and where it goes to zero; see the risk)")
    return Finding(
        pattern="rms_norm",
        qualname=scope.qualname,
        line=body[0].lineno,
        end_line=body[-1].end_lineno or body[-1].lineno,
        params={"eps": proof.eps, "weight": W, "weight_offset": proof.weight_offset, "output_dtype": proof.dtype_rule,
                "input": x, "found_by": "numeric_probe", "guards": list(proof.guards), **params_extra},
        fused=fused,
        guard_tensor=x,
        confidence="medium",
        variant="numeric_probe",
        risks=risks,
        notes=notes,
        training_ok=True,
    )


def _s42_in_place_statement(body: list[ast.stmt]) -> str | None:
    """The source of the first top-level ``t.mul_(..)``-style statement (an in-place tensor method whose result is
    dropped) of a probed function's body, else None."""
    for st in body:
        v = st.value if isinstance(st, ast.Expr) else None
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr.endswith("_") \
                and not v.func.attr.startswith("_") and isinstance(v.func.value, ast.Name):
            return ast.unparse(v)
    return None


def _eps_form_risk(proof: Any, x: str, half_only: bool) -> Risk:
    """s36: what differs where the original puts eps outside the root or clamps the norm (the
    probe measured which, and the floor c in rms units; eps' = c ** 2 makes both limits agree)."""
    c = proof.eps_floor
    if proof.eps_form == "outside":
        text = (f"eps is added to the rms outside the square root in the original (x / (rms + eps), `{proof.eps_base}`, "
                f"c = {c:.3g} in rms units); the fused op adds eps' = {proof.eps} inside: the factor (rms + c) / "
                f"sqrt(rms^2 + c^2) separates them, 1 on zero rows and as rms >> c, about 1 + c / rms on ordinary rows "
                f"(measured {proof.eps_bound:.2g} at rms 1), up to 1.41x on rows whose rms is near c")
    elif getattr(proof, "eps_clamps", "norm") == "mean square":
        # s42: max(mean(x^2), eps) under the root: the same eps, clamped instead of added
        text = (f"the original clamps the mean square from below (x * rsqrt(max(mean(x^2), eps)), `{proof.eps_base}`) "
                f"where the fused op adds eps = {proof.eps} to it: equal on zero rows, a relative difference of about "
                f"eps / (2 mean(x^2)) on ordinary rows (measured {proof.eps_bound:.2g} at rms 1), up to 0.71x on rows whose "
                "mean square is near eps")
    else:
        text = (f"the original clamps the norm from below (x / max(norm, eps), `{proof.eps_base}`: a floor at rms "
                f"{c:.3g}); the fused op adds eps' = {proof.eps} inside the root: equal on zero rows, a relative "
                f"difference of about c^2 / (2 rms^2) above the floor (measured {proof.eps_bound:.2g} at rms 1), up to "
                f"0.71x on rows whose rms is near the floor")
    if half_only:
        text += f"; above fp32's tolerance on ordinary rows, so the fused branch runs for fp16/bf16 {x} only"
    return Risk("numerics", text)


# examples of the numeric probe fallback (each written so that the syntactic matcher misses it)
_PROBE_OLMO_FLAGS = '''
import torch
from torch import nn


class FlagRMSNorm(nn.Module):
    def __init__(self, size, eps=1e-5, bias=False, full_precision=True):
        super().__init__()
        self.eps = eps
        self.full_precision = full_precision
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None

    def forward(self, x):
        with torch.autocast(enabled=False, device_type=x.device.type):
            og_dtype = x.dtype
            if self.full_precision:
                x = x.float()
            variance = x.pow(2).mean(-1, keepdim=True)
            x = x * torch.rsqrt(variance + self.eps)
            x = x.to(og_dtype)
        if self.weight is not None:
            if self.bias is not None:
                return self.weight * x + self.bias
            return self.weight * x
        return x
'''
_PROBE_VECTOR_NORM = '''
import torch
from torch import nn


class ScaledNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        n = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
        y = xf * self.dim ** 0.5 / torch.sqrt(n * n + self.dim * self.eps)
        return y.type_as(x) * self.gain
'''
_PROBE_NORM_METHOD = '''
import torch
from torch import nn


class OffsetNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        ms = x.norm(2, dim=-1, keepdim=True) ** 2 / x.shape[-1]
        return x / torch.sqrt(ms + self.eps) * (1 + self.scale)
'''
_PROBE_VAR = '''
import torch
from torch import nn


class VarNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        sq = torch.square(x.float())
        rstd = (sq.sum(dim=-1, keepdim=True) / x.shape[-1] + self.eps) ** -0.5
        return (x.float() * rstd).to(x.dtype) * self.weight
'''
_PROBE_K_NORM_EPS_OUT = '''
import torch
from torch import nn


class NormPlusEps(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.scale = dim ** -0.5
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        rms = x.norm(2, dim=-1, keepdim=True) * self.scale
        return x / (rms + self.eps) * self.g
'''
_PROBE_K_DIM1 = '''
import torch
from torch import nn


class ChannelNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        ms = torch.linalg.vector_norm(x, dim=1, keepdim=True) ** 2 / x.shape[1]
        return x * torch.rsqrt(ms + self.eps) * self.g
'''
_PROBE_K_BIAS = '''
import torch
from torch import nn


class BiasedNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.ones(dim))
        self.b = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        ms = torch.linalg.vector_norm(x, dim=-1, keepdim=True) ** 2 / x.shape[-1]
        return x * torch.rsqrt(ms + self.eps) * self.g + self.b
'''

RmsNorm.FUSE += [
    Fuse(_PROBE_OLMO_FLAGS, expect={"found_by": "numeric_probe", "eps": "self.eps", "weight": "self.weight", "output_dtype": "promote",
                                    "guards": ["(self.full_precision)", "(self.weight is not None)", "not (self.bias is not None)"]},
         run="m = FlagRMSNorm(16)\nx = torch.randn(2, 5, 16)\nout = (m(x), m(x.to(torch.bfloat16)), m(x.to(torch.float16)))", name="probe_flags_under_autocast"),
    Fuse(_PROBE_VECTOR_NORM, expect={"found_by": "numeric_probe", "eps": "self.eps", "weight": "self.gain", "weight_offset": 0},
         run="m = ScaledNorm(16)\nx = torch.randn(2, 5, 16)\nout = (m(x), m(x.to(torch.bfloat16)), m(x.to(torch.float16)))", name="probe_vector_norm_times_sqrt_d"),
    Fuse(_PROBE_NORM_METHOD, expect={"found_by": "numeric_probe", "eps": "self.eps", "weight": "self.scale", "weight_offset": 1},
         run="m = OffsetNorm(16)\nx = torch.randn(2, 5, 16)\nout = (m(x), m(x.to(torch.bfloat16)), m(x.to(torch.float16)))", name="probe_norm_method_one_plus_weight"),
    Fuse(_PROBE_VAR, expect={"found_by": "numeric_probe", "eps": "self.eps", "weight": "self.weight"},
         run="m = VarNorm(16)\nx = torch.randn(2, 5, 16)\nout = (m(x), m(x.to(torch.bfloat16)), m(x.to(torch.float16)))", name="probe_sum_of_squares_power"),
]
RmsNorm.KEEP += [
    # s36: eps outside the root is a candidate where the difference stays below the tolerance on
    # ordinary rows (below); at 1e-3 it is 1e-3 at rms 1, above every dtype's: refused, bound said
    Keep(_PROBE_K_NORM_EPS_OUT.replace("eps=1e-5", "eps=1e-3"),
         reason="numeric probe on sampled inputs: eps (0.001) is added outside the square root (x / (rms + eps)): npu_rms_norm "
                "with eps' = (self.eps) ** 2 would differ by 0.001",
         name="probe_eps_outside_the_root"),
    Keep(_PROBE_K_DIM1, reason="normalises over another dim than the last", name="probe_statistic_over_dim_1"),
    Keep(_PROBE_K_BIAS, reason="adds `self.b` after the weight (a bias): npu_rms_norm has no bias", name="probe_bias_after_weight"),
]

# The matcher refuses a mean over ``self.dim`` when a constructor call may pass another dim (it
# cannot know the value statically); the probe proves the default and guards ``self.dim == -1``
# at run time, so the former Keep ``dim_attribute_passed_by_a_constructor`` is this Fuse: the
# instance built with dim=1 runs the original.
RmsNorm.FUSE += [
    Fuse(
        _DIM_ATTRIBUTE.replace("self.norm = ScaleNormish(n)", "self.norm = ScaleNormish(n, 1)"),
        # s36: the matcher now guards a dim handed in from outside itself (the probe is not reached)
        expect={"weight": "self.scale", "dim_check": "self.dim in (-1, (-1,), x.dim() - 1)"},
        run=("m = ScaleNormish(16)\nother = ScaleNormish(16, 1)\nx = torch.randn(2, 3, 16)\n"
             "out = (m(x), m(x.to(torch.bfloat16)), other(x))\n"),
        name="probe_dim_attribute_guarded_at_run_time",
    ),
]


# --- s27 norms: a dtype read kept in place ---


def _kept_metadata_name(plan: S.SpanPlan | None, node: ast.expr, ctx: S.Ctx) -> str | None:
    """The name an ``orig_dtype = x.dtype`` statement binds, when ``node`` (a ``like`` dtype's tensor)
    is that statement's ``x`` read where it stands and the statement still runs before the fused code
    (kept in the span, or before it) with the name unchanged up to the root: the fused code reads
    ``orig_dtype``, which holds the dtype of ``x`` from before the statements that reassigned ``x``
    (vLLM's forward_native casts to fp32 and adds the residual in between)."""
    if plan is None or not isinstance(node, ast.Name) or ctx.depth != 0:
        return None
    s = S.stmt_index(ctx.scope).by_line.get(ctx.line)
    if s is None or plan.is_dropped(s) or not (S._is_metadata_read(s) and isinstance(s, ast.Assign)):
        return None
    value = s.value
    if not (isinstance(value, ast.Attribute) and value.attr == "dtype" and isinstance(value.value, ast.Name)
            and value.value.id == node.id):
        return None
    target = s.targets[0].id  # type: ignore[attr-defined]
    if S._reassigned_before_root(ctx.at(s.lineno), target, plan):
        return None
    return target


# the dtype read kept in place (s27): a kept statement (a residual branch) reads ``orig_dtype``
_DTYPE_READ_KEPT = '''
import torch
from torch import nn


class ResidualRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward_native(self, x, residual=None):
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        if residual is not None:
            x = x + residual.to(torch.float32)
            residual = x.to(orig_dtype)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        x = x.to(orig_dtype) * self.weight
        if residual is None:
            return x
        return x, residual
'''

RmsNorm.FUSE += [
    Fuse(
        _DTYPE_READ_KEPT,
        expect={"variant": "no_upcast", "weight": "self.weight", "eps": "self.variance_epsilon",
                "output_dtype": "promote(orig_dtype, weight)", "line": 13, "end_line": 20},
        run=("m = ResidualRMSNorm(32).to(torch.bfloat16)\nwith torch.no_grad():\n    m.weight.normal_()\n"
             "x = torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)\n"
             "r = torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)\n"
             "out = (*m.forward_native(x, r), m.forward_native(x))\nleaves = [x, r, m.weight]\n"),
        name="dtype_read_kept_for_a_residual_branch",
    ),
]


# --- s27 norms: the decisive reason before "control flow" ---

_DIM_REASON = re.compile(r"^mean over dim ")


def _control_flow_miss(module: ModuleInfo, ctx: S.Ctx, cond: ast.stmt, path_ctx: S.Ctx, found: Miss) -> Miss:
    """The near miss of a norm whose result a branch assigns. Reasons that no rewrite of the control
    flow would overturn come first (census s27: diffusers' and MindSpeed's norms sit in the fallback
    of a torch_npu branch; DC-AE's and TurboVAED's normalise over dim 1): an existing torch_npu branch
    around the path's statement or beside it in the same ``if``, then a mean over another dim."""
    idx = S.stmt_index(ctx.scope)
    where = idx.by_line.get(path_ctx.line) or cond
    done = S.already_fused(module, ctx.scope, where) or _npu_call_in_sibling_branch(module, idx, where)
    if done:
        return Miss(done, found.rstd)
    if _DIM_REASON.match(found.reason):
        return found
    return Miss("control flow between the norm and its result (a branch assigns it)", found.rstd)


def _npu_call_in_sibling_branch(module: ModuleInfo, idx: S.StmtIndex, stmt: ast.stmt) -> str | None:
    """``if <flag>: x = torch_npu.npu_rms_norm(...) else: <the hand-written norm>``: the other branch
    of an ``if`` holding ``stmt`` already calls torch_npu (a flag test without "npu" in it)."""
    child: ast.stmt = stmt
    for anc in S.ancestors(idx, stmt):
        if isinstance(anc, ast.If):
            other = anc.body if S._contains(anc.orelse, child) or any(x is child for x in anc.orelse) else anc.orelse
            for n in (n for b in other for n in fast_walk(b)):
                if isinstance(n, ast.Call) and (module.call_name(n) or "").startswith("torch_npu."):
                    return "already has a torch_npu branch"
        child = anc
    return None


# s27: the decisive reason comes before "control flow" (own reproducers of the census classes)
_FLAG_NPU_BRANCH = '''
import torch
import torch_npu
from torch import nn


class FlagNorm(nn.Module):
    def __init__(self, dim, fused=True, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = fused

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        if self.fused:
            x = torch_npu.npu_rms_norm(x, self.weight.float(), epsilon=self.eps)[0]
        else:
            var = x.pow(2).mean(-1, keepdim=True)
            x = x * torch.rsqrt(var + self.eps)
            x = self.weight * x.to(dt)
        return x.to(dt)
'''

_CHANNEL_OPTIONAL_WEIGHT = '''
import torch
from torch import nn


class ChannelNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, affine=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        var = x.float().pow(2).mean(1, keepdim=True)
        x = x * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            x = x.to(self.weight.dtype) * self.weight
        else:
            x = x.to(dt)
        return x
'''

RmsNorm.KEEP += [
    # the other branch of a flag (no "npu" in its test) already calls torch_npu: not "control flow"
    Keep(_FLAG_NPU_BRANCH, reason="already has a torch_npu branch", name="s27_flag_chosen_npu_branch_beside_the_norm"),
    # an optional weight assigned in branches of a channel-first norm: the dim is the reason
    Keep(_CHANNEL_OPTIONAL_WEIGHT, reason="mean over dim 1, not the last dim", name="s27_channel_first_norm_with_optional_weight"),
]


# s27 (task B): OLMo-style dtype read before a conditional upcast; the read stays in place and the
# output cast reads it (``x`` is another tensor by then)
_DTYPE_READ_CONDITIONAL_CAST = '''
import torch
from torch import nn


class PlainNorm(nn.Module):
    def __init__(self, size, eps=1e-5, full_precision=True):
        super().__init__()
        self.eps = eps
        self.full_precision = full_precision
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        og_dtype = x.dtype
        if self.full_precision:
            x = x.float()
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        x = x.to(og_dtype)
        return x * self.weight
'''

RmsNorm.FUSE += [
    Fuse(
        _DTYPE_READ_CONDITIONAL_CAST,
        expect={"weight": "self.weight", "eps": "self.eps", "output_dtype": "promote(og_dtype, weight)", "line": 14, "end_line": 20},
        run=("a = PlainNorm(32).to(torch.bfloat16)\nb = PlainNorm(32, full_precision=False)\nwith torch.no_grad():\n"
             "    a.weight.normal_()\n    b.weight.normal_()\n"
             "x = torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)\n"
             "out = (a(x), b(x.float()), b(x))\nleaves = [x, a.weight, b.weight]\n"),
        name="dtype_read_kept_before_a_conditional_upcast",
    ),
]


# s27: a transformers norm of an inline input inside a larger statement, bound where it stands
# (run end to end in tests/test_detect_s27_norms.py with the transformers stand-in)
RmsNorm.FUSE += [
    Fuse(_HF_NORM_IMPORTED.split("class Down")[0].replace(
        "        e = self.norm(e.permute(0, 2, 3, 1))\n", "        e = self.norm(e.permute(0, 2, 3, 1)) + self.norm(e.permute(0, 2, 3, 1) * 2)\n"),
        expect={"variant": "hf_norm_module", "module": "self.norm", "qualname": "Patchify.forward", "line": 15},
        name="s27_transformers_norm_of_an_inline_input_bound_in_place"),
]



# --- s27 probe reach: a decorated forward (the decorator is not code the run evaluates), a
# comprehension / generator expression and enumerate in the body, a raise on an error path (tests/test_detect_s27_probe.py counts the census before/after)
_PROBE_S27_DECORATED_GENERATOR = '''
import torch
from torch import nn


def kernel_hook(name, fallback=False):  # a registry decorator (a hub kernel, a compile hint): not evaluated
    def wrap(fn):
        fn.kernel_name = name
        return fn
    return wrap


class ColumnNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        if dim <= 0:
            raise ValueError(f"bad dim {dim}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    @kernel_hook("rms", fallback=True)
    def forward(self, x):
        cols = [x[..., i] for i in range(x.shape[-1])]
        total = sum(c * c for c in cols)
        for k, c in enumerate(cols):
            if k == 0:
                total = total + 0.0 * c
        return x * torch.rsqrt(total.unsqueeze(-1) / len(cols) + self.eps) * self.weight
'''
_PROBE_S27_K_COMPREHENSION_SUM = '''
import torch
from torch import nn


class ColumnSumNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        cols = [x[..., i] for i in range(x.shape[-1])]
        total = sum(c * c for c in cols)  # a sum of squares, not their mean: an L2 normalisation
        return x * torch.rsqrt(total.unsqueeze(-1) + self.eps) * self.weight
'''
RmsNorm.FUSE += [
    Fuse(_PROBE_S27_DECORATED_GENERATOR, expect={"found_by": "numeric_probe", "eps": "self.eps", "weight": "self.weight"},
         run="m = ColumnNorm(16)\nx = torch.randn(2, 5, 16)\nout = (m(x), m(x.to(torch.bfloat16)), m(x.to(torch.float16)))",
         name="s27_probe_decorated_forward_with_comprehensions"),
]
RmsNorm.KEEP += [
    Keep(_PROBE_S27_K_COMPREHENSION_SUM, reason="numeric probe on sampled inputs: x is scaled per row, but not by rsqrt(mean(x^2, -1) + eps)",
         name="s27_probe_comprehension_sum_of_squares"),
]


# --- s28 norms: a cast of a call of a norm helper that is a candidate itself (issue 14, held-out 5) ---
#
# ``y = self.gemma_norm(x.float(), w).to(torch.bfloat16)`` or ``ref = rms_ref(x, w, eps).to(dtype)``:
# the helper's own body is a finding (weight and all), so the call site only adds casts around it.
# Reporting the call as a second, inlined site rewrote the same norm twice (one candidate bypassing
# the other) and counted one norm as two. ``_is_full_norm_helper`` already covers the bare call;
# this looks through the casts wrapped around it (and nothing else: a factor outside the helper is
# a modulation the helper's finding does not cover).

def _cast_of_full_norm_helper(module: ModuleInfo, scope: Scope, node: ast.expr, ctx: S.Ctx) -> bool:
    """``node`` is, through casts and local names bound to casts (``h = helper(..).to(dt)`` ...
    ``h.float()``), a call to a helper of this module whose body has an rms_norm finding of its own."""
    cast = False
    for _ in range(8):
        while S.is_cast(node):
            node, cast = node.func.value, True  # type: ignore[attr-defined]
        if not isinstance(node, ast.Name):
            break
        value, vctx, stmt = S.follow(node, ctx)
        if stmt is None or value is node:
            return False
        node, ctx, cast = value, vctx, True
    if not (cast and isinstance(node, ast.Call)):
        return False
    callee = S.resolve_callee(module, node, S.Ctx(ctx.scope, node.lineno))
    hscope = S.scope_of(module, callee[0]) if callee is not None else None
    if hscope is None or hscope is scope or _import_fallback_def(module, hscope):
        return False  # an import fallback's callers are its sites (see _import_fallback_def)
    # a weightless helper (Meta's ``_norm``) is covered by its callers' findings instead
    return any(r.finding is not None and r.finding.variant != "no_weight" for r in scope_results(module, hscope))


_S28_CAST_OF_HELPER = '''
import torch
from torch import nn


class Projector(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm_w = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)

    def offset_norm(self, t, weight, eps: float = 1e-6):
        def _norm(v):
            return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)

        out = _norm(t.float())
        out = out * (1.0 + weight.float())
        return out.type_as(t)

    def forward(self, x):
        h = self.offset_norm(x.float(), self.norm_w).to(torch.bfloat16)
        return self.proj(h.float())
'''

RmsNorm.FUSE += [
    # one candidate, in the helper (the call site only casts its result): see tests/test_detect_s28_norms.py
    Fuse(_S28_CAST_OF_HELPER, expect={"qualname": "Projector.offset_norm"},
         run="m = Projector(16)\nwith torch.no_grad():\n    m.norm_w.normal_()\nx = torch.randn(2, 3, 16, requires_grad=True)\n"
             "out = m(x)\nleaves = [x, m.norm_w]\n",
         name="s28_cast_of_a_helper_call_is_the_helpers_site"),
]


# --- s28 norms: x / (n * s + eps) with the norm bound to a name first, and weightless (see
# _library_norm._s28_eps_added_named_norm; held-out 5 RWKV-v1 RMSNorm/FixedNorm shapes, own code) ---

_S28_NAMED_NORM = '''
import torch
from torch import nn


class ScaledRootNorm(nn.Module):
    def __init__(self, width, eps=1e-8):
        super().__init__()
        self.inv_root = width ** (-1 / 2)
        self.eps = eps
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, h):
        n = torch.linalg.vector_norm(h, dim=-1, keepdim=True)
        unit = h / (n * self.inv_root + self.eps)
        return unit * self.gain


class PlainRootNorm(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inv_root = width ** (-1 / 2)

    def forward(self, h):
        n = h.norm(p=2, dim=-1, keepdim=True)
        out = h / (self.inv_root * n + 1e-10)
        return out
'''

_S28_NAMED_RUN = '''
m = {cls}(24){cast}
{init}x = torch.randn(2, 7, 24{dtype}, requires_grad=True)
out = m(x)
leaves = [x{leaves}]
'''

RmsNorm.FUSE += [
    Fuse(_S28_NAMED_NORM, expect={"variant": "l2_norm_eps_added", "qualname": "ScaledRootNorm.forward", "eps": "self.eps",
                                  "x": "h", "weight": "(self.gain)", "line": 14, "end_line": 16},
         run=_S28_NAMED_RUN.format(cls="ScaledRootNorm", cast="", dtype="", leaves=", m.gain",
                                   init="with torch.no_grad():\n    m.gain.normal_()\n"),
         name="s28_eps_added_to_a_named_norm_with_gain"),
    Fuse(_S28_NAMED_NORM.split("class ScaledRootNorm")[0] + "class PlainRootNorm" + _S28_NAMED_NORM.split("class PlainRootNorm")[1],
         expect={"variant": "l2_norm_eps_added", "qualname": "PlainRootNorm.forward", "eps": "1e-10", "weight": "1.0",
                 "line": 12, "end_line": 13},
         run=_S28_NAMED_RUN.format(cls="PlainRootNorm", cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16", leaves="", init=""),
         name="s28_eps_added_weightless_bf16"),
]

RmsNorm.KEEP += [
    Keep(
        # no d-power on the named norm: h / (||h|| + eps) * g is an L2 normalisation with a gain
        _S28_NAMED_NORM.split("class PlainRootNorm")[0].replace("n * self.inv_root + self.eps", "n + self.eps"),
        reason="without a sqrt(d) factor",
        name="s28_named_norm_without_d_power_is_scalenorm",
    ),
    Keep(
        # the weightless form without the d-power is a bare unit vector (cosine features): no site at all
        "import torch\n\n\ndef unit(h):\n    n = h.norm(p=2, dim=-1, keepdim=True)\n    out = h / (n + 1e-10)\n    return out\n",
        name="s28_named_norm_bare_unit_vector",
    ),
    Keep(
        # the operand changes between the norm and the quotient: the norm is not of the divided value
        _S28_NAMED_NORM.split("class PlainRootNorm")[0].replace(
            "        unit = h / (n * self.inv_root + self.eps)", "        h = h * 2\n        unit = h / (n * self.inv_root + self.eps)"),
        name="s28_named_norm_of_an_older_operand",
    ),
]


# --- s28 norms: a torch reference that only checks a kernel (issue 14, held-out 5 extras) ---------
#
# Kernel files keep a plain-torch RMSNorm beside their Triton/CUDA kernel to test it
# (``def torch_rms_norm(x, w, eps)`` ... ``y_ref = torch_rms_norm(...)``; ``assert torch.allclose(y_tri,
# y_ref)``). Replacing the reference by the fused op would make the check compare the kernel with
# another kernel, not with the math it is meant to match. Decided by dataflow, not by names: every
# call of the function in its file lies in a function that passes the result of one of these calls
# (directly or through the name it is bound to) to a closeness check; other calls there (a timing
# loop that discards the result) do not change that. A function also called by model code is a site.

_CLOSENESS_CHECKS = ("allclose", "assert_close", "assert_allclose", "isclose")


def _s28_reference_check(module: ModuleInfo, scope: Scope) -> str | None:
    """The near-miss reason when the function of ``scope`` is only a reference for closeness checks."""
    fn = scope.node
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    if not text_holds_any(module, _CLOSENESS_CHECKS):
        return None  # cheap gate: no closeness check anywhere in the file
    cached = scope.__dict__.get("_npufuse_rms_reference")
    if cached is not None:
        return cached or None
    callers: dict[int, ast.AST] = {}
    for call in _calls_naming(module, fn.name):
        f = call.func
        if not ((isinstance(f, ast.Name) and f.id == fn.name) or (isinstance(f, ast.Attribute) and f.attr == fn.name)):
            continue
        line = call.lineno
        if fn.lineno <= line <= (fn.end_lineno or fn.lineno):
            continue
        encl = [s.node for s in module.scopes if isinstance(s.node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and s.node.lineno <= line <= (s.node.end_lineno or s.node.lineno)]
        if not encl:
            scope.__dict__["_npufuse_rms_reference"] = ""
            return None  # called at module level: model code or a script, not a check
        callers.setdefault(id(encl[-1]), encl[-1])
    checked = [c for c in callers.values() if _compares_a_call_of(c, fn.name)]
    reason = ""
    if callers and len(checked) == len(callers):
        names = ", ".join(sorted(c.name for c in checked))  # type: ignore[attr-defined]
        reason = (f"reference implementation: every call of `{fn.name}` in this file feeds a closeness check "
                  f"(in {names}); replacing it would compare the kernel under test with the fused op instead of the math")
    scope.__dict__["_npufuse_rms_reference"] = reason
    return reason or None


def _compares_a_call_of(fn: ast.AST, name: str) -> bool:
    """``fn`` passes a call of ``name`` (or a name bound to one, casts allowed) to a closeness check."""
    def calls_it(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Call) and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)
                   for n in ast.walk(node))
    bound = {t.id for st in ast.walk(fn) if isinstance(st, ast.Assign) and calls_it(st.value)
             for t in st.targets if isinstance(t, ast.Name)}
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and (getattr(n.func, "attr", None) in _CLOSENESS_CHECKS or getattr(n.func, "id", None) in _CLOSENESS_CHECKS):
            args = [*n.args, *(k.value for k in n.keywords)]
            if any(calls_it(a) or any(isinstance(m, ast.Name) and m.id in bound for m in ast.walk(a)) for a in args):
                return True
    return False


_S28_REFERENCE = '''
import torch


def fused_rmsnorm(x, w, eps):
    return x  # stands in for a compiled kernel


def reference_rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def check(n, eps=1e-5):
    x = torch.randn(4, n)
    w = torch.rand(n)
    got = fused_rmsnorm(x, w, eps)
    want = reference_rmsnorm(x.float(), w.float(), eps).to(x.dtype)
    assert torch.allclose(got, want, atol=1e-2)
'''

RmsNorm.KEEP += [
    Keep(_S28_REFERENCE, reason="reference implementation: every call of `reference_rmsnorm`", name="s28_kernel_test_reference"),
]
RmsNorm.FUSE += [
    # the same function also called by model code: a site (the reference rule needs every call to be checked)
    Fuse(_S28_REFERENCE + "\n\nclass Block(torch.nn.Module):\n    def __init__(self, n):\n        super().__init__()\n"
         "        self.w = torch.nn.Parameter(torch.ones(n))\n\n    def forward(self, x):\n        return reference_rmsnorm(x, self.w, 1e-6)\n",
         expect={"qualname": "reference_rmsnorm"},
         run="m = Block(16)\nwith torch.no_grad():\n    m.w.normal_()\nx = torch.randn(2, 16, requires_grad=True)\nout = m(x)\nleaves = [x, m.w]\n",
         name="s28_reference_also_called_by_a_module_is_a_site"),
]


def _s28_unless_reference(module: ModuleInfo, scope: Scope, r: Result) -> Result:
    """``r``, or a near miss in its place when it is a finding in a kernel's test reference (or, s38, one whose
    epsilon is a learned parameter)."""
    if not isinstance(r, Finding):
        return r
    reason = _s28_reference_check(module, scope) or _s38_learned_epsilon(module, scope, r)
    return r if reason is None else NearMiss("rms_norm", scope.qualname, r.line, r.end_line, reason)


_PARAMETER_CTORS = ("torch.nn.Parameter", "torch.nn.parameter.Parameter")


def _s38_learned_epsilon(module: ModuleInfo, scope: Scope, finding: Finding) -> str | None:
    """Why the finding's epsilon cannot go to npu_rms_norm: it reads ``self.<attr>`` (directly or through local
    names) that the class's ``__init__`` makes an ``nn.Parameter`` (icefall / VoiceCraft ``BasicNorm``: ``self.eps =
    nn.Parameter(torch.tensor(eps).log())`` with ``learn_eps`` on by default, used as ``eps.exp()``). The op's
    ``epsilon`` is a Python float: a tensor that requires grad is refused there, and the eps would get no gradient
    (the original trains it). None otherwise (a buffer, a float attribute, a constant)."""
    eps = finding.params.get("eps")
    cls = module.classes.get(scope.class_name or "") if scope.class_name else None
    if not isinstance(eps, str) or cls is None:
        return None
    try:
        tree = ast.parse(eps, mode="eval")
    except SyntaxError:
        return None
    attrs: set[str] = set()
    seen: set[str] = set()
    todo: list[ast.AST] = [tree]
    while todo and len(seen) < 16:
        for n in fast_walk(todo.pop()):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                attrs.add(n.attr)
            elif isinstance(n, ast.Name) and n.id not in seen:
                seen.add(n.id)
                todo += [value for _stmt, value in scope.assignments.get(n.id, ()) if value is not None]
    if not attrs:
        return None
    for n in fast_walk(cls):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and (module.canonical(n.value.func) or "") in _PARAMETER_CTORS:
            for t in n.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" and t.attr in attrs:
                    return (f"eps `{eps}` reads `self.{t.attr}`, an nn.Parameter (line {n.lineno}): a learned epsilon; npu_rms_norm "
                            "takes a float epsilon (a tensor that requires grad is refused, and the eps would not be trained)")
    return None


# --- s28 norms: F.normalize times d ** -0.5 stays a near miss (held-out 5 zeta SimpleRMSNorm) ---
# Mathematically rms_norm(x) / d, but d ** -0.5 is also the usual attention temperature: the same
# text is cosine-similarity attention on q, which the labels (and npufuse) treat as an L2
# normalisation. Only a sqrt(d) gain shows a norm layer (see the l2_normalize Fuse examples).
RmsNorm.KEEP += [
    Keep(
        "import torch\nimport torch.nn.functional as F\nfrom torch import nn\n\n\nclass CosineQuery(nn.Module):\n"
        "    def __init__(self, dim_head):\n        super().__init__()\n        self.scale = dim_head ** -0.5\n\n"
        "    def forward(self, q):\n        return F.normalize(q, dim=-1) * self.scale\n",
        reason="without a sqrt(d) factor",
        name="s28_f_normalize_times_inverse_sqrt_d_is_cosine_scaling",
    ),
]


# --- s32: a module built and called in one expression (pytorch/executorch's reference ops) -------
# ``nn.RMSNorm(shape, eps=eps)(x)``: the inner call is the construction (swapped); the outer call
# only calls it. Both were once read as constructions and spliced on top of each other, which
# produced code that does not parse (a render error instead of a candidate).
_S32_BUILT_AND_CALLED = '''\
import torch
from torch import nn


def rms_norm(X: torch.Tensor, normalized_shape: tuple, W: torch.Tensor, eps: float) -> torch.Tensor:
    return W * nn.RMSNorm(list(normalized_shape), eps=eps, dtype=X.dtype)(X)
'''

RmsNorm.FUSE += [
    Fuse(_S32_BUILT_AND_CALLED, expect={"variant": "nn_rmsnorm", "constructions": 1},
         run="x = torch.randn(3, 16, requires_grad=True)\nw = torch.randn(16, requires_grad=True)\n"
             "out = rms_norm(x, (16,), w, 1e-6)\nleaves = [x, w]\n",
         name="s32_module_built_and_called_in_one_expression"),
]

RmsNorm.KEEP += [
    # near miss: a LayerNorm built and called the same way is no RMSNorm
    Keep(_S32_BUILT_AND_CALLED.replace("nn.RMSNorm(", "nn.LayerNorm("), reason="",
         name="s32_layer_norm_built_and_called_in_one_expression"),
]


# the s33 examples' run: an RMSNorm(16) over a [2, 3, 16] input, gradients to the input and ``weight``
_S33_RUN_NORM = "m = RMSNorm(16)\nx = torch.randn(2, 3, 16, requires_grad=True)\nout = m(x)\nleaves = [x, m.{weight}]\n"


# --- s33: attributes bound by one tuple assignment in ``__init__`` (MoDE's ``self.scale, self.eps = dim**-0.5, eps``) ---
# x / clamp(||x|| * d ** -0.5, eps) * g: the norm times d ** -0.5 is the root mean square, read once
# ``self.scale`` is paired with its own value of the tuple.
_S33_TUPLE_BOUND_SCALE = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-8) -> None:
        super().__init__()
        self.scale, self.eps = dim**-0.5, eps
        self.g = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = torch.norm(x, dim=-1, keepdim=True) * self.scale
        return x / norm.clamp(min=self.eps) * self.g
'''

RmsNorm.FUSE += [
    Fuse(_S33_TUPLE_BOUND_SCALE, expect={"source": "l2_normalize", "eps": "self.eps", "eps_rule": "clamp on the norm"},
         run=_S33_RUN_NORM.format(weight="g"),
         name="s33_scale_bound_by_a_tuple_assignment"),
]

RmsNorm.KEEP += [
    # the tuple comes from a call: which value ``self.scale`` holds is not read, so no sqrt(d) factor is shown
    Keep(_S33_TUPLE_BOUND_SCALE.replace("self.scale, self.eps = dim**-0.5, eps", "self.scale, self.eps = divmod(dim, eps)"),
         name="s33_scale_unpacked_from_a_call"),
]


# --- s33: numpy's keyword spelling ``mean(-1, keepdims=True)`` (torch's argument parser takes ``keepdims``
# and ``axis`` for ``keepdim`` and ``dim``) ---
_S33_NUMPY_KEEPDIMS = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, embed_dim, eps=1e-6):
        super(RMSNorm, self).__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(embed_dim))
        self.eps = eps

    def forward(self, x):
        input_dtype = x.dtype
        x = x.to(torch.float32)
        var = x.pow(2).mean(axis=-1, keepdims=True)
        x = x * torch.rsqrt(var + self.eps)
        return self.weight * x.to(input_dtype)
'''

RmsNorm.FUSE += [
    Fuse(_S33_NUMPY_KEEPDIMS, expect={"eps": "self.eps", "weight": "self.weight"},
         run=_S33_RUN_NORM.format(weight="weight"),
         name="s33_mean_with_numpy_keepdims"),
]

RmsNorm.KEEP += [
    Keep(_S33_NUMPY_KEEPDIMS.replace("keepdims=True", "keepdims=False"), reason="without keepdim=True",
         name="s33_mean_with_numpy_keepdims_false"),
]


# --- s33: the weight viewed as [1, ..., 1, -1] to broadcast over the last dim (recurrentgemma) ---
# A view that only adds leading 1s multiplies by the same per-feature values: gamma is the weight
# itself (flattened); any other reshape still reads as a grouped norm.
_S33_BROADCAST_VIEW_WEIGHT = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.width = width
        self.eps = eps
        self.scale = nn.Parameter(0.1 * torch.randn([self.width]))

    def forward(self, x):
        var = torch.mean(torch.square(x), axis=-1, keepdims=True)
        normed_x = x * torch.rsqrt(var + self.eps)
        scale = torch.reshape(self.scale, [1 for _ in range(x.ndim - 1)] + [-1])
        return normed_x * (scale + 1)
'''

RmsNorm.FUSE += [
    Fuse(_S33_BROADCAST_VIEW_WEIGHT, expect={"weight": "self.scale", "weight_offset": 1},
         run=_S33_RUN_NORM.format(weight="scale"),
         name="s33_weight_broadcast_by_a_leading_ones_view"),
    Fuse(_S33_BROADCAST_VIEW_WEIGHT.replace("torch.reshape(self.scale, [1 for _ in range(x.ndim - 1)] + [-1])", "self.scale.view(1, 1, -1)"),
         expect={"weight": "self.scale", "weight_offset": 1},
         run=_S33_RUN_NORM.format(weight="scale"),
         name="s33_weight_viewed_as_1_1_minus_1"),
]

RmsNorm.KEEP += [
    # near miss: a view that moves the features off the last dim is a grouped norm's
    Keep(_S33_BROADCAST_VIEW_WEIGHT.replace("[1 for _ in range(x.ndim - 1)] + [-1]", "[1, -1, 1]"), reason="the weight is reshaped",
         name="s33_weight_viewed_off_the_last_dim"),
]


# --- s35: norms whose constructor takes a configuration object (issue 14, held-out 11) ---
#
# nanoGPT-lineage code builds every module from one ``config`` (``RMSNorm(config)``, ``ndim =
# config.n_embd``, ``getattr(config, "bias", False)``). The probe used to give such an argument a
# dimension, so ``config.n_embd`` stopped the evaluation and the norm was missed with no reason. It
# now passes a stand-in whose attributes get values from how the class uses them (a size, None where
# compared with None, False where tested, a small eps), and because the configuration is the user's,
# not a default of the class, a proof must also hold with each None / False attribute set the other
# way: a norm whose scale comes from ``config.radius`` when it is set is proved for one case only and
# refused with that reason.
_PROBE_S35_CONFIG_NORM = '''
import math
import torch
from torch import nn


class ScaleNorm(nn.Module):
    def __init__(self, config):
        super().__init__()
        width = config.n_embd
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x):
        rms = x.norm(2, dim=-1, keepdim=True) / math.sqrt(x.size(-1))
        return x / rms * self.gain
'''
_PROBE_S35_HELD_CONFIG_NORM = '''
import torch
from torch import nn


class UnitRmsNorm(nn.Module):
    def __init__(self, hp):
        super().__init__()
        self.hp = hp
        self.scale = nn.Parameter(torch.zeros(hp.d_model)) if getattr(hp, "zero_centered", False) else None
        self.g = nn.Parameter(torch.ones(hp.d_model))

    def forward(self, h):
        if self.hp.layer_norm_epsilon is None:
            raise ValueError("epsilon missing")
        mean_sq = torch.linalg.vector_norm(h, ord=2, dim=-1, keepdim=True).square() / h.shape[-1]
        out = h / torch.sqrt(mean_sq + self.hp.layer_norm_epsilon)
        return out * self.g
'''
_PROBE_S35_K_CONFIG_RADIUS = '''
import math
import torch
from torch import nn


class SphereProjection(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.sphere_radius is not None:
            self.r = config.sphere_radius
        else:
            self.r = math.sqrt(config.n_embd)

    def forward(self, x):
        length = x.norm(2, dim=-1, keepdim=True)
        return x / length * self.r
'''
RmsNorm.FUSE += [
    Fuse(_PROBE_S35_CONFIG_NORM, expect={"found_by": "numeric_probe", "eps": "0.0", "weight": "self.gain"},
         run="import types\nm = ScaleNorm(types.SimpleNamespace(n_embd=16))\nx = torch.randn(2, 5, 16)\nout = m(x)",
         name="s35_probe_config_object_constructor"),
    Fuse(_PROBE_S35_HELD_CONFIG_NORM, expect={"found_by": "numeric_probe", "eps": "self.hp.layer_norm_epsilon", "weight": "self.g"},
         run="import types\nm = UnitRmsNorm(types.SimpleNamespace(d_model=16, layer_norm_epsilon=1e-6))\n"
             "x = torch.randn(2, 5, 16)\nout = m(x)",
         name="s35_probe_config_object_held_on_self"),
]
RmsNorm.KEEP += [
    Keep(_PROBE_S35_K_CONFIG_RADIUS, reason="proved only where `config.sphere_radius` is None",
         name="s35_probe_config_value_decides_the_scale"),
]


# --- s36 (N2): a mean dim handed in from outside, guarded at run time ------------------------------
#
# ``mean(axis, keepdim=True)`` with ``axis`` a parameter of the function or an attribute the object
# was built with (ppl.pmx's OPMX reference ops, stylegan2 / Latte ``normalize_2nd_moment(x, dim=1)``,
# uni2ts ``self.mean_dim``, lmdeploy ``rms_scale(.., dim)``): the value is unknown statically but
# readable at the top of the span, so the fused branch runs where it names the last dim (-1, (-1,)
# or rank - 1) and the original everywhere else, instead of the former near miss.

_S36_AXIS_FUNCTION = '''
import torch


def scale_rows(t, g, reduce_axis=-1, tiny=1e-6):
    t32 = t.float()
    ms = t32.pow(2).mean(reduce_axis, keepdim=True)
    return (t32 * torch.rsqrt(ms + tiny)).to(t.dtype) * g
'''

_S36_AXIS_ATTRIBUTE = '''
import torch
from torch import nn


class ChannelScale(nn.Module):
    def __init__(self, width, over, eps=1e-5):
        super().__init__()
        self.over = over
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, h):
        var = torch.mean(h * h, dim=self.over, keepdim=True)
        return self.weight * (h * torch.rsqrt(var + self.eps))
'''

RmsNorm.FUSE += [
    Fuse(_S36_AXIS_FUNCTION, expect={"dim_check": "reduce_axis in (-1, (-1,), t.dim() - 1)", "qualname": "scale_rows"},
         run=("x = torch.randn(2, 5, 16, requires_grad=True)\ng = torch.randn(16, requires_grad=True)\n"
              "g5 = torch.randn(5, 1, requires_grad=True)\n"
              "out = (scale_rows(x, g), scale_rows(x, g, 2), scale_rows(x, g, (-1,)), scale_rows(x, g5, 1),\n"
              "       scale_rows(x.to(torch.bfloat16), g.to(torch.bfloat16), -1))\nleaves = [x, g, g5]\n"),
         name="s36_mean_axis_parameter_guarded_at_run_time"),
    Fuse(_S36_AXIS_ATTRIBUTE, expect={"dim_check": "self.over in (-1, (-1,), h.dim() - 1)", "weight": "self.weight"},
         run=("m = ChannelScale(16, -1)\nk = ChannelScale(16, 2)\nc = ChannelScale(5, 1)\n"
              "x = torch.randn(2, 5, 16, requires_grad=True)\nxc = torch.randn(2, 5, 1, requires_grad=True)\n"
              "out = (m(x), k(x), c(xc))\nleaves = [x, xc, m.weight]\n"),
         name="s36_mean_dim_attribute_without_default_guarded_at_run_time"),
]

RmsNorm.KEEP += [
    Keep(
        # the function recomputes its axis before the mean: not the value handed in, the reason stands
        _S36_AXIS_FUNCTION.replace("    t32 = t.float()\n", "    t32 = t.float()\n    reduce_axis = reduce_axis - 1\n"),
        reason="a run-time value",
        name="s36_mean_axis_parameter_rebound_in_the_function",
    ),
]


# --- s36 (N1): eps outside the root, or a clamp on the norm, read by value ------------------------
#
# The probe measures the per-row scale s = out / (x * w) on every sample: 1 / s = rms + c is eps
# added outside the root (bzhangGo's RMSNorm copies: ml-simplefold, stripedhyena, the PaLM-lite
# ``x / (norm * d ** -0.5 + eps)``), 1 / s = max(rms, c) a clamp (torchmultimodal SimpleRMSNorm
# ``x / ||x||.clamp_min(eps) * sqrt(d)``, x-transformers / RETRO / MoDE ``norm.clamp(min=eps)``,
# lucidrains' ``F.normalize(x, dim=-1) * scale * g``). eps' = c ** 2 (c ** 2 / d for a clamp on the
# L2 norm) makes both limits agree; the risk states the difference and where it matters; a
# difference above fp32's tolerance on rows of rms 1 keeps fp32 inputs on the original (half
# only), one above the half tolerance is refused with the measured bound.

_S36_EPS_AFTER_ROOT = '''
import torch
from torch import nn


class UnitScale(nn.Module):
    def __init__(self, n, tiny=1e-8):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n))
        self.tiny = tiny

    def forward(self, h):
        r = torch.sqrt(torch.mean(h ** 2, dim=-1, keepdim=True))
        return self.gain * h / (r + self.tiny)
'''

_S36_RMS_FLOOR = '''
import torch
from torch import nn


class FlooredRms(nn.Module):
    def __init__(self, width, floor=1e-6):
        super().__init__()
        self.floor = floor
        self.g = nn.Parameter(torch.ones(width))

    def forward(self, v):
        mag = (v.square().sum(-1, keepdim=True) / v.shape[-1]).sqrt().clamp(min=self.floor)
        return v / mag * self.g
'''

_S36_L2_FLOOR_FUNCTION = '''
import math

import torch


def unit_rows(z, gamma, lo=1e-10):
    n = torch.norm(z, p=2, dim=-1, keepdim=True)
    return z * (math.sqrt(z.shape[-1]) / torch.clamp(n, min=lo)) * gamma
'''

_S36_EPS_RUN = ("m = {ctor}\nwith torch.no_grad():\n    m.{w}.normal_()\nx = torch.randn(2, 5, 16, requires_grad=True)\n"
                "z = torch.zeros(1, 16)\nout = (m(x), m(x.to(torch.bfloat16)), m(x.to(torch.float16)), m(z))\n"
                "leaves = [x, m.{w}]\n")

RmsNorm.FUSE += [
    Fuse(_S36_EPS_AFTER_ROOT, expect={"found_by": "numeric_probe", "eps": "(self.tiny) ** 2", "eps_rule": "added outside the root",
                                      "eps_original": "self.tiny", "weight": "self.gain"},
         run=_S36_EPS_RUN.format(ctor="UnitScale(16)", w="gain"), name="s36_probe_eps_added_after_the_root"),
    Fuse(_S36_RMS_FLOOR, expect={"found_by": "numeric_probe", "eps": "(self.floor) ** 2", "eps_rule": "clamp on the norm"},
         run=_S36_EPS_RUN.format(ctor="FlooredRms(16)", w="g"), name="s36_probe_rms_clamped_from_below"),
    Fuse(_S36_L2_FLOOR_FUNCTION, expect={"eps_rule": "clamp on the norm"},
         run=("x = torch.randn(2, 5, 16, requires_grad=True)\ng = torch.randn(16, requires_grad=True)\n"
              "out = (unit_rows(x, g), unit_rows(x.to(torch.bfloat16), g.to(torch.bfloat16)), unit_rows(torch.zeros(3, 16), g))\n"
              "leaves = [x, g]\n"), name="s36_probe_l2_norm_clamped_in_a_function"),
    # eps 1e-5 outside the root: 1e-5 at rms 1, above fp32's tolerance, within fp16/bf16's: half inputs only
    Fuse(_PROBE_K_NORM_EPS_OUT, expect={"found_by": "numeric_probe", "eps": "(self.eps) ** 2", "eps_rule": "added outside the root"},
         run=("m = NormPlusEps(16)\nx = torch.randn(2, 5, 16)\nout = (m(x), m(x.to(torch.bfloat16)), m(x.to(torch.float16)))\n"),
         name="s36_probe_eps_outside_half_inputs_only"),
]

_S36_L2_FLOOR_CLASS = '''
import torch
from torch import nn


class RowUnit(nn.Module):
    def __init__(self, size, eps=1e-12):
        super().__init__()
        self.mult = size ** 0.5
        self.eps = eps

    def forward(self, t):
        den = t.norm(p=2, dim=-1, keepdim=True).clamp_min(self.eps)
        return t.div(den.expand_as(t)).mul(self.mult)
'''

RmsNorm.FUSE += [
    # no weight, the L2 norm clamped at eps and a sqrt(d) gain: the rms floored at eps / sqrt(d)
    Fuse(_S36_L2_FLOOR_CLASS, expect={"found_by": "numeric_probe", "eps": "(self.eps) ** 2 / t.shape[-1]", "weight": None,
                                      "eps_rule": "clamp on the norm"},
         run=("m = RowUnit(16)\nx = torch.randn(2, 5, 16, requires_grad=True)\n"
              "out = (m(x), m(x.to(torch.bfloat16)), m(torch.zeros(2, 16)))\nleaves = [x]\n"),
         name="s36_probe_l2_norm_clamped_times_sqrt_d_no_weight"),
]

RmsNorm.KEEP += [
    # the same clamp without the sqrt(d) gain: an L2 normalisation (ScaleNorm-like), not an rms
    Keep(_S36_L2_FLOOR_FUNCTION.replace("math.sqrt(z.shape[-1])", "1.0"), name="s36_probe_l2_clamp_without_sqrt_d"),
    # a floor at rms 0.01: 5e-5 apart at rms 1 in the op's form, near misses above 1e-4
    Keep(_S36_RMS_FLOOR.replace("floor=1e-6", "floor=0.1"), reason="clamped from below", name="s36_probe_rms_floor_too_high"),
]

RmsNorm.FUSE += [
    Fuse(RmsNorm.KEEP[[k.name for k in RmsNorm.KEEP].index("eps_outside_sqrt")].code.replace("eps=1e-2", "eps=1e-8"),
         expect={"found_by": "numeric_probe", "eps": "(self.eps) ** 2", "eps_rule": "added outside the root"},
         run=_S36_EPS_RUN.format(ctor="RMSNormEpsOutside(16)", w="scale"), name="s36_matcher_eps_outside_sqrt"),
]


# --- s36 (N4): channel-first norms: move the channels last, norm, move them back --------------
#
# ``x = x.transpose(1, 2)`` / ``permute`` / ``movedim`` puts the channels of [B, C, T] last, the norm
# runs over them, and ``y = y.transpose(1, 2)`` moves them back (VibeVoice ConvRMSNorm, the
# ConvLayerNorm / ChannelNorm family of audio and diffusion codecs). npu_rms_norm on the moved view
# (the op takes non-contiguous input, spec 2.1) is the same norm; where the weight is applied under
# a test (``if self.weight is not None``) the norm is read at the axis move back, whose statement
# takes the fused value in place of the name. A base class's ``_norm`` helper is found through
# same-file inheritance (``_site.inherited_method``).

_S36_CONV_RMS_SUBCLASS = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5, elementwise_affine=True):
        super().__init__()
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_parameter("weight", None)

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class ChannelsFirstRMSNorm(RMSNorm):
    def forward(self, x):
        x = x.transpose(1, 2)
        output = self._norm(x.float()).type_as(x)
        if self.weight is not None:
            output = output * self.weight
        output = output.transpose(1, 2)
        return output
'''

_S36_MOVEDIM_FUNCTION = '''
import torch


def channel_rms(t, w=None, eps=1e-6):
    t = t.movedim(1, -1)
    out = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        out = out * w
    out = out.movedim(-1, 1)
    return out
'''

RmsNorm.FUSE += [
    Fuse(_S36_CONV_RMS_SUBCLASS, expect={"qualname": "ChannelsFirstRMSNorm.forward", "weight": "self.weight"},
         run=("m = ChannelsFirstRMSNorm(16)\nwith torch.no_grad():\n    m.weight.normal_()\n"
              "x = torch.randn(2, 16, 7, requires_grad=True)\nbare = ChannelsFirstRMSNorm(16, elementwise_affine=False)\n"
              "out = (m(x), m(x.to(torch.bfloat16)), bare(x))\nleaves = [x, m.weight]\n"),
         name="s36_channels_first_subclass_of_a_norm_with_base_helper"),
    Fuse(_S36_MOVEDIM_FUNCTION, expect={"qualname": "channel_rms", "weight": "w"},
         run=("x = torch.randn(2, 16, 4, 5, requires_grad=True)\nw = torch.randn(16, requires_grad=True)\n"
              "out = (channel_rms(x, w), channel_rms(x), channel_rms(x.to(torch.bfloat16), w.to(torch.bfloat16)))\n"
              "leaves = [x, w]\n"), name="s36_channels_moved_last_by_movedim_conditional_weight"),
]

RmsNorm.KEEP += [
    # the statistic is taken over dim 1 of the moved tensor (not the channels moved last): refused
    # the statistic over dim 1 of the moved tensor: the last dim of a 3-D input (the probe proves it
    # there), another dim of a 4-D one: the fused branch is capped at rank 3 (4-D runs the original)
]
RmsNorm.FUSE += [
    Fuse(_S36_MOVEDIM_FUNCTION.replace("mean(-1, keepdim=True)", "mean(1, keepdim=True)"),
         expect={"found_by": "numeric_probe"},
         run=("x = torch.randn(2, 5, 16, requires_grad=True)\nx4 = torch.randn(2, 3, 4, 16, requires_grad=True)\n"
              "out = (channel_rms(x), channel_rms(x4))\nleaves = [x, x4]\n"),
         name="s36_probe_rank_dependent_norm_capped_at_rank_3"),
]


# s40 (dataflow40): the norm in one arm of an if / else whose other arm calls a kernel, its output read
# after the ``if`` (two reaching definitions): the fused code replaces the hand-written arm alone
_S40_ARM_OF_IF_ELSE = '''
import torch
from torch import nn

try:
    from fast_norms import fused_rms_norm as _kernel_rms
    HAVE_KERNEL = True
except ImportError:
    HAVE_KERNEL = False


class SwitchableNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps
        self.use_kernel = HAVE_KERNEL

    def forward(self, x, r):
        if self.use_kernel:
            y = _kernel_rms(x, self.weight, self.eps)
        else:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            y = self.weight * h.to(x.dtype)
        return y + r
'''

# the hand-written arm first, channels moved last before the ``if`` and back after it, an optional weight
_S40_ARM_FIRST_CHANNELS = '''
import torch
from torch import nn

KERNEL = None


class ChannelNorm(nn.Module):
    def __init__(self, d, eps=1e-5, affine=True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d)) if affine else None

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        x = x.transpose(1, 2)
        if KERNEL is None or self.weight is None:
            out = self._norm(x.float()).type_as(x)
            if self.weight is not None:
                out = out * self.weight
        else:
            out = KERNEL(x, self.weight, self.eps)
        out = out.transpose(1, 2)
        return out
'''

RmsNorm.FUSE += [
    Fuse(_S40_ARM_OF_IF_ELSE, expect={"qualname": "SwitchableNorm.forward", "weight": "self.weight"},
         run=("m = SwitchableNorm(16)\nwith torch.no_grad():\n    m.weight.normal_()\n"
              "x = torch.randn(2, 5, 16, requires_grad=True)\nr = torch.randn(2, 5, 16)\n"
              "out = (m(x, r), m(x.to(torch.bfloat16), r))\nleaves = [x, m.weight]\n"),
         name="s40_norm_in_the_else_arm_of_a_kernel_switch_read_after_the_if"),
    Fuse(_S40_ARM_FIRST_CHANNELS, expect={"qualname": "ChannelNorm.forward", "weight": "self.weight"},
         run=("m = ChannelNorm(16)\nwith torch.no_grad():\n    m.weight.normal_()\n"
              "x = torch.randn(2, 16, 7, requires_grad=True)\nbare = ChannelNorm(16, affine=False)\n"
              "out = (m(x), bare(x))\nleaves = [x, m.weight]\n"),
         name="s40_norm_in_the_first_arm_channels_moved_around_the_if"),
]

RmsNorm.KEEP += [
    # the other arm also binds the statistic, read after the ``if``: the hand-written arm's ``rstd``
    # reaches that read, and the fused code would not compute it
    Keep(_S40_ARM_OF_IF_ELSE.replace("y = _kernel_rms(x, self.weight, self.eps)", "y, rstd = _kernel_rms(x, self.weight, self.eps)")
         .replace("h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)",
                  "rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)\n            h = h * rstd")
         .replace("return y + r", "return y + r, rstd"),
         reason="intermediate `rstd` reused after the fused region", name="s40_arm_statistic_read_after_the_if"),
    # the other arm is torch_npu's own kernel: the hand-written arm is its fallback
    Keep(_S40_ARM_OF_IF_ELSE.replace("y = _kernel_rms(x, self.weight, self.eps)",
                                     "import torch_npu\n            y = torch_npu.npu_rms_norm(x, self.weight, self.eps)[0]")
         .replace("if self.use_kernel:", "if torch.npu.is_available():"),
         reason="already has a torch_npu branch", name="s40_arm_beside_a_torch_npu_arm"),
]
