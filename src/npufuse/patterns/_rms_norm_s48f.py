"""s48 (fix48): an RMS norm whose output is multiplied by a scalar factor besides its weight.

HO24a thepowerfuldeez core.py (a "LayerNorm scaling" per layer position)::

    self.gain = nn.Parameter(torch.ones(d))
    scale = torch.tensor(1.0) if position is None else torch.rsqrt(torch.tensor(float(position)))
    self.register_buffer("position_scale", scale, persistent=False)
    ...
    out = x * rsqrt((x * x).mean(-1) + eps).unsqueeze(-1) * self.gain    # x in float32
    out.mul_(self.position_scale)
    return out.to(in_dtype)

A factor that is one number (a 0-dim tensor, or a Python number) multiplies every element alike, so the output is
``x * rstd * (gain * s)``: npu_rms_norm with gamma ``gain.float() * s``. Read only where

* the factor is proven one number: a numeric literal, or ``self.<a>`` whose every store in the class is in ``__init__``
  (an assignment or ``register_buffer("<a>", v)``) of a value built as a 0-dim tensor (``torch.tensor(<number>)``,
  ``torch.ones(())``, an element-wise function of one, ``nn.Parameter`` of one) or a Python number expression, and
  nothing else in the class changes it (``bound_callee.changed_outside_init``);
* the original multiplies by it in float32 (the value's dtype there is float32: a 0-dim factor never promotes a
  tensor, so the output dtype is the norm's): gamma is then computed in float32 as well (``g.float() * s``), the
  same products up to the order of two float32 roundings; a factor applied to a value in the input's (half) dtype
  would be rounded there, and is refused.

The in-place spelling ``out.mul_(s)`` (a statement between the product and its use) is read as the factor of the
value it scales; an in-place product that is not such a factor keeps ``out``'s dtype where ``out * w`` would promote,
so it is refused (true reason) rather than read as a weight.
"""

from __future__ import annotations

import ast
from typing import Any, Optional

from npufuse.scan.dataflow import const_value, dotted, fast_walk

_UNARY = ("rsqrt", "sqrt", "exp", "log", "reciprocal", "abs", "neg", "sigmoid", "tanh", "log2", "exp2")


def _number_expr(node: ast.expr) -> bool:
    """A Python number: a numeric literal, ``float(..)`` / ``int(..)``, ``math.<f>(..)``, arithmetic of those."""
    v = const_value(node)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return True
    if isinstance(node, ast.Call) and dotted(node.func) in ("float", "int") and len(node.args) == 1 and not node.keywords:
        return True
    if isinstance(node, ast.Call) and (dotted(node.func) or "").startswith("math.") and not node.keywords and node.args:
        return True  # a math function returns a Python number (or raises)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)):
        return _number_expr(node.left) and _number_expr(node.right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _number_expr(node.operand)
    return False


def _init_values(init: ast.FunctionDef, name: str) -> list[ast.expr]:
    return [n.value for n in fast_walk(init) if isinstance(n, ast.Assign) and len(n.targets) == 1
            and isinstance(n.targets[0], ast.Name) and n.targets[0].id == name]


def _zero_dim(node: ast.expr, init: ast.FunctionDef, depth: int = 0) -> bool:
    """``node`` (in ``__init__``) is a 0-dim tensor (or a Python number, which acts as one)."""
    if depth > 6:
        return False
    if _number_expr(node):
        return True
    if isinstance(node, ast.Name):
        values = _init_values(init, node.id)
        params = {a.arg for a in (*init.args.posonlyargs, *init.args.args, *init.args.kwonlyargs)}
        return bool(values) and node.id not in params and all(_zero_dim(v, init, depth + 1) for v in values)
    if isinstance(node, ast.IfExp):
        return _zero_dim(node.body, init, depth + 1) and _zero_dim(node.orelse, init, depth + 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        return _zero_dim(node.left, init, depth + 1) and _zero_dim(node.right, init, depth + 1)
    if not isinstance(node, ast.Call):
        return False
    name = dotted(node.func) or ""
    last = name.rpartition(".")[2]
    kw_ok = all(k.arg in ("device", "dtype", "requires_grad") for k in node.keywords)
    if name in ("torch.tensor", "torch.as_tensor", "torch.scalar_tensor") and len(node.args) == 1 and kw_ok:
        return _number_expr(node.args[0])
    if name in ("torch.ones", "torch.zeros", "torch.empty") and len(node.args) == 1 and kw_ok \
            and isinstance(node.args[0], (ast.Tuple, ast.List)) and not node.args[0].elts:
        return True
    if last == "Parameter" and name in ("nn.Parameter", "torch.nn.Parameter", "Parameter") and len(node.args) == 1 \
            and all(k.arg == "requires_grad" for k in node.keywords):
        return _zero_dim(node.args[0], init, depth + 1)
    if name.startswith("torch.") and last in _UNARY and len(node.args) == 1 and not node.keywords:
        return _zero_dim(node.args[0], init, depth + 1)
    if isinstance(node.func, ast.Attribute) and not node.args and not node.keywords \
            and (node.func.attr in _UNARY or node.func.attr in ("float", "double", "clone", "detach")) \
            and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
        return _zero_dim(node.func.value, init, depth + 1)
    return False


def scalar_factor(module: Any, cls: Optional[str], node: ast.expr) -> bool:
    """``node`` (a factor of the norm's output, as written in a method of ``cls``) is proven one number."""
    if _number_expr(node):
        return True
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" and cls):
        return False
    from npufuse.patterns import _site as S
    from npufuse.scan.bound_callee import changed_outside_init

    init = S.method(module, cls, "__init__")
    klass = module.classes.get(cls)
    if init is None or klass is None or node.attr in changed_outside_init(module, cls):
        return False
    values: list[ast.expr] = []
    for n in fast_walk(klass):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("register_buffer", "register_parameter") \
                and n.args and const_value(n.args[0]) == node.attr:
            if not any(m is n for m in fast_walk(init)) or len(n.args) < 2:
                return False
            values.append(n.args[1])
        elif isinstance(n, ast.Call) and dotted(n.func) in ("setattr", "delattr") and len(n.args) >= 2 \
                and const_value(n.args[1]) in (node.attr, None):
            return False
    for n in fast_walk(init):
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                if any(isinstance(a, ast.Attribute) and a.attr == node.attr and isinstance(a.value, ast.Name)
                       and a.value.id == "self" and isinstance(a.ctx, ast.Store) for a in ast.walk(t)):
                    if not (isinstance(n, ast.Assign) and t is n.targets[0] and len(n.targets) == 1
                            and isinstance(t, ast.Attribute)) or n.value is None:
                        return False
                    values.append(n.value)
    return bool(values) and all(_zero_dim(v, init) for v in values)


# -- the in-place spelling: ``out.mul_(s)`` between the product and its use -------------------------------------------

def _inplace_muls(ctx: Any) -> dict[str, list[tuple[ast.stmt, ast.expr]]]:
    """Per name, the ``name.mul_(f)`` statements of the scope (memoised per scope)."""
    scope = ctx.scope
    got = scope.__dict__.get("_npufuse_s48f_muls")
    if got is None:
        from npufuse.patterns import _site as S

        got = {}
        for st in S.stmt_index(scope).by_line.values():
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Attribute) \
                    and st.value.func.attr == "mul_" and isinstance(st.value.func.value, ast.Name) \
                    and len(st.value.args) == 1 and not st.value.keywords:
                got.setdefault(st.value.func.value.id, []).append((st, st.value.args[0]))
        scope.__dict__["_npufuse_s48f_muls"] = got
    return got


def inplace_scale(ctx: Any, node: ast.Name) -> list[tuple[ast.stmt, ast.expr]]:
    """The ``node.mul_(f)`` statements between ``node``'s definition and its use at ``ctx.line`` that run whenever the
    use does (no ``if`` / loop around them that is not around the use too), innermost (latest) last."""
    muls = _inplace_muls(ctx).get(node.id)
    if not muls:
        return []
    from npufuse.patterns import _site as S

    d = S.definition(ctx, node.id)
    if d is None:
        return []
    idx = S.stmt_index(ctx.scope)
    use = idx.by_line.get(ctx.line)
    use_anc = {id(a) for a in S.ancestors(idx, use)} if use is not None else set()
    found = []
    for st, f in muls:
        if not (d[0].lineno < st.lineno < ctx.line):
            continue
        if any(isinstance(a, (ast.If, ast.For, ast.While, ast.Try, ast.AsyncFor)) and id(a) not in use_anc
               for a in S.ancestors(idx, st)):
            return []  # conditional: not read (the statement stays a reader of the value: the old refusal)
        if any(isinstance(n, ast.Name) and n.id == node.id for n in ast.walk(f)):
            return []
        found.append((st, f))
    return found


def mark_inplace(module: Any, factor: ast.expr) -> None:
    module.__dict__.setdefault("_npufuse_s48f_inplace", set()).add(id(factor))


def is_inplace(module: Any, factor: ast.expr) -> bool:
    return id(factor) in module.__dict__.get("_npufuse_s48f_inplace", ())


def split_scalars(module: Any, weights: list) -> Optional[tuple[list, list]]:
    """(weights, scalar factors) where every factor but at most one is proven one number; None otherwise."""
    scalars = [w for w in weights if w.kind == "mul" and scalar_factor(module, getattr(w.ctx.scope, "class_name", None), w.node)]
    rest = [w for w in weights if all(w is not s for s in scalars)]
    if not scalars or len(rest) > 1:
        return None
    return rest, scalars


def inplace_reason(module: Any, weights: list) -> Optional[str]:
    """The refusal of a weight factor applied in place (``out.mul_(w)``) that is not folded as one number."""
    for w in weights:
        if is_inplace(module, w.node):
            return (f"the norm's output is multiplied in place by `{ast.unparse(w.node)}` (`.mul_` keeps the output's "
                    "dtype, which an out-of-place weight product may not): npufuse reads an in-place product only as a "
                    "factor proven one number, folded into gamma")
    return None


def add_norm_reason(cls: str, params: dict) -> Optional[str]:
    """add_rms_norm: the near miss for a norm whose plan folds a number into gamma (npu_add_rms_norm takes gamma in
    x1's dtype, so the float32 product would be rounded first)."""
    scale = params.get("weight_scale")
    if not scale:
        return None
    return (f"norm {cls} cannot be fused: its forward multiplies its output by `{scale}` after the norm, a factor "
            "npufuse folds into npu_rms_norm's float32 gamma for the norm alone, not into npu_add_rms_norm's gamma "
            "(taken in x1's dtype: a half-precision x1 would round the product)")


def folded_gamma(gamma: str, scale: str) -> str:
    """The float32 gamma of a weight with a folded number (as :func:`rms_norm.plan_norm` renders it)."""
    g = gamma if gamma.replace(".", "").replace("_", "").isalnum() else f"({gamma})"
    return f"({g}.float() * {scale}).float()"  # s48 precision48: float32 even for a float64 tensor factor


_AUTOCAST_OFF = ("torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "autocast")


def _autocast_off(item: ast.withitem) -> bool:
    c = item.context_expr
    return item.optional_vars is None and isinstance(c, ast.Call) and (dotted(c.func) or "") in _AUTOCAST_OFF \
        and any(k.arg == "enabled" and const_value(k.value) is False for k in c.keywords)


def return_past_scale(fwd: ast.FunctionDef, straight: Any) -> Optional[ast.Return]:
    """The final ``return`` of a norm forward whose body is straight-line statements (``straight``: the site reader's
    test), ``with <autocast(.., enabled=False)>:`` blocks of such statements, and ``name.mul_(f)`` statements (read as
    a factor by the chain); None otherwise (and None where no ``mul_`` or ``with`` is there: the old reader's case)."""
    body = [s for s in fwd.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not body or len(body) > 10 or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    seen = False
    for st in body[:-1]:
        if isinstance(st, ast.With) and all(_autocast_off(i) for i in st.items) and all(straight(x) for x in st.body):
            seen = True
        elif isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Attribute) \
                and st.value.func.attr == "mul_" and isinstance(st.value.func.value, ast.Name):
            seen = True
        elif not straight(st):
            return None
    return body[-1] if seen else None


def main_weight(module: Any, weights: list) -> Any:
    """The weight factor that is not a number folded into gamma (``weights[0]`` where nothing is folded)."""
    if len(weights) > 1:
        split = split_scalars(module, weights)
        if split is not None and split[0]:
            return split[0][0]
    return weights[0]
