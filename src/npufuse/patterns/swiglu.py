"""swiglu: ``silu(a) * b`` with a, b from two projections or one split -> ``torch_npu.npu_swiglu``.

Also the shared machinery of gated activations (``geglu`` imports it): a product of two factors
where one is an activation of ``a`` and the other is ``b``; the activation is recognised by what
it is (``F.silu``, ``nn.SiLU()`` assigned in ``__init__``, ``torch.sigmoid(a) * a``, a helper of
this module, ``ACT2FN["silu"]``), or recorded as chosen by config (``ACT2FN[config.hidden_act]``)
with a runtime check in the fused branch. ``a`` and ``b`` are the two halves of one tensor
(``chunk``/``split``/slicing: the fused op takes that tensor directly; the order decides which
half is activated) or two projections of one input (the fused op takes ``torch.cat([a, b])``:
exact, but it adds a copy — merging the projections' weights into one is what makes it pay).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from npufuse.patterns import _site as S
from npufuse.patterns import _swiglu_s43, _swiglu_s44, _swiglu_s44sweep, _swiglu_s46h
from npufuse.patterns import _reasons_s46, _swiglu_s47review, _swiglu_s50b
from npufuse.patterns import _swiglu_s51m
from npufuse.patterns.base import Finding, Fuse, Keep, NearMiss, Pattern, Result, Risk
from npufuse.scan import bound_callee
from npufuse.scan.dataflow import ModuleInfo, Scope, const_value, dotted, fast_walk
from npufuse.scan.value import estimate, symbolic

if TYPE_CHECKING:  # torch is imported only to run a reference, never to scan
    import torch

# --------------------------------------------------------------------------------------------
# activations

SILU = "silu"
GELU = "gelu"  # erf
GELU_TANH = "gelu_tanh"
GELU_DYN = "gelu_dyn"  # F.gelu(x, approximate=<expression>)
QUICK_GELU = "quick_gelu"
SIGMOID = "sigmoid"
CONFIG = "config"


def _model_method_of_child(module: "ModuleInfo", f: ast.Attribute) -> bool:
    """``self.transformer.guided_flow(...)`` (FastVideo's MMAudio Euler step, audit40b): a child that
    ``__init__`` builds from a class or receives, called by a method name that says nothing of an
    activation, is a model's method, not a callable a configuration holds (``self.config.activation_func``)."""
    holder = f.value.attr if isinstance(f.value, ast.Attribute) else ""
    if any(w in holder.lower() for w in ("config", "cfg", "args", "opt", "param", "setting")):
        return False
    return not any(w in f.attr.lower() for w in ("act", "gelu", "silu", "swish", "glu", "nonlin", "fn", "func"))
#: a config's mapping reads (``self.config.get("rope_scaling", {})``, S-LoRA's RoPE set-up, audit40b): a value
#: looked up, not a callable the config holds
_MAPPING_READS = frozenset({"get", "pop", "setdefault", "items", "keys", "values", "copy", "to_dict"})
# s39: a local activation class whose forward is a formula of its input npufuse cannot name
_OWN_FORMULA = "own formula"
_REASSIGNED = "stored again after __init__"

# ACT2FN keys (transformers) by what they compute
ACT_NAMES = {
    "silu": SILU,
    "swish": SILU,
    "gelu": GELU,
    "gelu_python": GELU,
    "gelu_new": GELU_TANH,
    "gelu_pytorch_tanh": GELU_TANH,
    "gelu_fast": GELU_TANH,
    "gelu_accurate": GELU_TANH,
    "gelu_python_tanh": GELU_TANH,
    "quick_gelu": QUICK_GELU,
    "relu": "relu",
    "relu2": "relu2",
    "relu6": "relu6",
    "leaky_relu": "leaky_relu",
    "sigmoid": SIGMOID,
    "tanh": "tanh",
    "mish": "mish",
    "gelu_10": "gelu_10 (clipped)",
    "linear": "linear",
    "elu": "elu",
    "selu": "selu",
    "softplus": "softplus",
    "hardswish": "hardswish",
}
ACT_CONFIG_SILU = ("silu", "swish")
ACT_CONFIG_GELU = ("gelu", "gelu_python")
ACT_CONFIG_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate", "gelu_python_tanh")

_FUNCS = {
    "torch.nn.functional.silu": SILU,
    "torch.silu": SILU,
    "torch.nn.functional.gelu": GELU,
    "torch.nn.functional.relu": "relu",
    "torch.relu": "relu",
    "torch.nn.functional.relu6": "relu6",
    "torch.nn.functional.leaky_relu": "leaky_relu",
    "torch.nn.functional.mish": "mish",
    "torch.nn.functional.elu": "elu",
    "torch.nn.functional.selu": "selu",
    "torch.nn.functional.softplus": "softplus",
    "torch.nn.functional.hardswish": "hardswish",
    "torch.tanh": "tanh",
    "torch.sigmoid": SIGMOID,
    "torch.nn.functional.sigmoid": SIGMOID,
}
_MODULES = {
    "torch.nn.SiLU": SILU,
    "torch.nn.GELU": GELU,
    "torch.nn.ReLU": "relu",
    "torch.nn.ReLU6": "relu6",
    "torch.nn.LeakyReLU": "leaky_relu",
    "torch.nn.Mish": "mish",
    "torch.nn.Tanh": "tanh",
    "torch.nn.Sigmoid": SIGMOID,
    "torch.nn.ELU": "elu",
    "torch.nn.Hardswish": "hardswish",
}
_ACT_TABLES = {"ACT2FN", "ACT2CLS", "ACTIVATIONS", "ACT_FNS"}
_GETTERS = {"get_activation", "get_act_fn", "get_act_layer", "create_act_layer", "get_activation_fn"}


@dataclass
class Act:
    kind: str
    gate: ast.expr | None  # the activated operand (None for a sigmoid-form silu until paired)
    ctx: S.Ctx
    describe: str
    obj: ast.expr | None = None  # the activation object (self.act_fn) for runtime checks
    config_key: ast.expr | None = None  # runtime string naming the activation (self.config.hidden_act)
    approx: ast.expr | None = None  # gelu_dyn: the approximate expression
    sigmoid_arg: ast.expr | None = None  # sigmoid form: the sigmoid's argument (key compared with a factor)
    gelu_hint: bool = False  # config-chosen, but the code names it gelu (T5 "hidden_gelu")
    default: str | None = None  # config-chosen with a known default (an __init__ default class)
    kernels: int = 1  # eager kernels the activation launches (a hand-written formula: several)
    moved: bool = False  # the activation's result is moved with .to(device=...) before the product
    weak: bool = False  # only an imported builder's object: an activation only if the product's structure says so
    # s36: a swish ``z * sigmoid(beta * z)`` whose beta defaults to 1 (a parameter): silu only where
    # beta == 1 at run time (the fused branch tests it; the original code otherwise)
    beta: ast.expr | None = None


def _module_act(module: ModuleInfo, value: ast.expr) -> tuple[str, ast.expr | None] | None:
    """Kind of an activation *object* expression: ``nn.SiLU()``, ``F.silu``, ``ACT2FN["gelu"]``."""
    if isinstance(value, ast.Call):
        name = module.canonical(value.func)
        if name in _MODULES:
            kind = _MODULES[name]
            if kind == GELU:
                approx = S.arg(value, "approximate", 0)
                if approx is not None:
                    v = const_value(approx)
                    if v == "tanh":
                        return GELU_TANH, None
                    if v == "none":
                        return GELU, None
                    return GELU_DYN, approx
            return kind, None
        short = (dotted(value.func) or "").split(".")[-1]
        if short in _GETTERS and _config_object_arg(value):
            # `get_activation(global_config, act_default=...)`: the getter reads the name from a config
            # object, which is no name itself: the fused branch dispatches on the object it returns (audit42)
            return CONFIG, None
        named = _getter_name_arg(value) if short in _GETTERS else None
        if named is not None:
            v = const_value(named)
            if isinstance(v, str):
                return ACT_NAMES.get(v.lower(), v), None
            return CONFIG, named
    if isinstance(value, ast.Subscript):
        table = (dotted(value.value) or "").split(".")[-1]
        if table in _ACT_TABLES:
            v = const_value(value.slice)
            if isinstance(v, str):
                return ACT_NAMES.get(v, v), None
            return CONFIG, value.slice
        own = _own_act_table(module, value.value)
        if own is not None:
            # the module's own table ({"relu": F.relu, "silu": F.silu, "gated-gelu": F.gelu}): its
            # keys are its own, so a run-time key is not compared with transformers' names; the
            # fused branch dispatches on the object the lookup returned
            v = const_value(value.slice)
            if isinstance(v, str) and v in own:
                return own[v]
            kinds = set(own.values())
            return kinds.pop() if len(kinds) == 1 else (CONFIG, None)
    name = module.canonical(value)
    if name in _FUNCS:
        return _FUNCS[name], None
    if isinstance(value, ast.Lambda):
        return _lambda_act(module, value)
    return None


def _own_act_table(module: ModuleInfo, table: ast.expr) -> dict[str, tuple[str, ast.expr | None]] | None:
    """A module-level dict literal of activations (every value an activation object npufuse
    knows; the keys any hashable: ``{Act.silu: F.silu}``): key text -> kind; else None. A
    string key is its value, any other key its source text (only a string literal is looked up)."""
    if not isinstance(table, ast.Name):
        return None
    d = _module_value(module, table.id)
    if not isinstance(d, ast.Dict) or not d.values or len(d.values) > 64:
        return None
    out: dict[str, tuple[str, ast.expr | None]] = {}
    for k, v in zip(d.keys, d.values):
        if k is None:
            return None  # `**other`: values unknown
        key = const_value(k)
        kind = _module_act(module, v) if not isinstance(v, ast.Subscript) else None
        if kind is None or kind[0] == CONFIG:
            return None
        out[key if isinstance(key, str) else "<" + ast.unparse(k) + ">"] = kind
    return out


def _helper_act(module: ModuleInfo, fn: ast.FunctionDef, depth: int = 0) -> str | None:
    """What a one-tensor helper computes: an activation call on its parameter, or a known formula."""
    if depth > 2:
        return None
    params = [a.arg for a in fn.args.args if a.arg != "self"]
    if len(params) != 1:
        return None
    p = params[0]
    returns = [n for n in fast_walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    if not returns:
        return None
    kinds = set()
    for r in returns:
        v = _s41_straight_value(module, fn, r.value) if len(returns) == 1 else r.value
        while S.is_cast(v):
            v = v.func.value  # type: ignore[union-attr]
        k = None
        if isinstance(v, ast.Call):
            name = module.canonical(v.func)
            if name in _FUNCS and v.args and _mentions(v.args[0], p):
                k = _FUNCS[name]
                if k == GELU:
                    approx = const_value(S.arg(v, "approximate", 1))
                    k = GELU_TANH if approx == "tanh" else GELU if approx in (..., "none") else GELU_DYN
        if k is None:
            text = ast.unparse(v)
            if "tanh" in text and "0.044715" in text:
                k = GELU_TANH
            elif "erf" in text:
                k = GELU
            elif "sigmoid" in text and "1.702" in text:
                k = QUICK_GELU
            elif _s39_silu_formula(module, v, p):
                # the whole return is x * sigmoid(x), sigmoid spelled as a call or as 1 / (1 + exp(-x)) (s33: a
                # search also took ``x * torch.sigmoid(x) * beta``, a scaled Swish)
                k = SILU
        if k is None:
            return None
        kinds.add(k)
    return kinds.pop() if len(kinds) == 1 else None


def _s41_straight_value(module: ModuleInfo, fn: ast.FunctionDef, value: ast.expr | None) -> ast.expr | None:
    """s41 (StoryMixtral's ``Swish``): the value a straight-line one-return body returns, its locals substituted
    (``swish = x * self.sig(x); return swish`` is ``x * self.sig(x)``) and a call of a ``self.<attr>`` that the
    class builds once as ``nn.Sigmoid()`` read as ``p.sigmoid()``. Only where the body is assignments to plain names
    (each stored once) and the return, so nothing else changes a value in between; ``value`` unchanged otherwise
    (a copy is returned where something was substituted)."""
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    if value is None or not body or not isinstance(body[-1], ast.Return) or body[-1].value is not value:
        return value
    local: dict[str, ast.expr] = {}
    for st in body[:-1]:
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)) \
                or st.targets[0].id in local or st.targets[0].id in {a.arg for a in fn.args.args}:
            return value
        local[st.targets[0].id] = st.value
    cls = next((c for c in module.classes.values() if fn in c.body), None)
    sigmoids: set[str] = set()
    if cls is not None:
        for attr, v in S.init_assignments(module, cls.name).items():
            if isinstance(v, ast.Call) and module.canonical(v.func) == "torch.nn.Sigmoid" and not v.args and not v.keywords \
                    and len(bound_callee.attribute_values(module, cls.name, attr)) == 1:
                sigmoids.add(attr)
    if not local and not sigmoids:
        return value

    class _Substitute(ast.NodeTransformer):
        def __init__(self) -> None:
            self.depth = 0

        def visit_Name(self, node: ast.Name) -> ast.expr:
            if node.id in local and self.depth < 4:
                self.depth += 1
                out = self.visit(copy.deepcopy(local[node.id]))
                self.depth -= 1
                return out
            return node

        def visit_Call(self, node: ast.Call) -> ast.expr:
            self.generic_visit(node)
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" and f.attr in sigmoids \
                    and len(node.args) == 1 and not node.keywords:
                return ast.copy_location(ast.Call(func=ast.Attribute(value=node.args[0], attr="sigmoid", ctx=ast.Load()), args=[], keywords=[]), node)
            return node

    return _Substitute().visit(copy.deepcopy(value))


def _s39_is_param(node: ast.expr, p: str) -> bool:
    while S.is_cast(node):
        node = node.func.value  # type: ignore[union-attr]
    return isinstance(node, ast.Name) and node.id == p


def _s39_one(node: ast.expr) -> bool:
    v = const_value(node)
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v == 1


def _s39_one_plus_exp_neg(module: ModuleInfo, node: ast.expr, p: str) -> bool:
    """``1 + exp(-p)`` (either order; torch.exp / math-free ``p.neg().exp()`` / ``(-p).exp()``)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)):
        return False
    for one, e in ((node.left, node.right), (node.right, node.left)):
        if not _s39_one(one) or not isinstance(e, ast.Call):
            continue
        if module.canonical(e.func) == "torch.exp" and len(e.args) == 1 and not e.keywords:
            arg = e.args[0]
        elif isinstance(e.func, ast.Attribute) and e.func.attr == "exp" and not e.args and not e.keywords:
            arg = e.func.value
        else:
            continue
        if isinstance(arg, ast.UnaryOp) and isinstance(arg.op, ast.USub) and _s39_is_param(arg.operand, p):
            return True
        if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr == "neg" and not arg.args \
                and _s39_is_param(arg.func.value, p):
            return True
    return False


def _s39_sigmoid_of(module: ModuleInfo, node: ast.expr, p: str) -> bool:
    """``sigmoid(p)`` spelled as a call (torch / F / method) or as ``1 / (1 + exp(-p))``."""
    if isinstance(node, ast.Call):
        name = module.canonical(node.func)
        if name in ("torch.sigmoid", "torch.nn.functional.sigmoid", "torch.special.expit") and len(node.args) == 1:
            return _s39_is_param(node.args[0], p)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "sigmoid" and not node.args:
            return _s39_is_param(node.func.value, p)
        if name == "torch.reciprocal" and len(node.args) == 1:
            return _s39_one_plus_exp_neg(module, node.args[0], p)
        return False
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _s39_one(node.left) \
        and _s39_one_plus_exp_neg(module, node.right, p)


def _s39_silu_formula(module: ModuleInfo, node: ast.expr, p: str) -> bool:
    """Is ``node`` exactly ``p * sigmoid(p)``? ``p * sigmoid(p)`` / ``sigmoid(p) * p`` with any spelling of
    the sigmoid (:func:`_s39_sigmoid_of`), ``p / (1 + exp(-p))`` and ``p * 1 / (1 + exp(-p))`` (which
    parses as ``(p * 1) / (...)``). A scale anywhere (``p * sigmoid(p) * beta``) is not SiLU."""
    if not isinstance(node, ast.BinOp):
        return False
    if isinstance(node.op, ast.Mult):
        return (_s39_is_param(node.left, p) and _s39_sigmoid_of(module, node.right, p)) \
            or (_s39_is_param(node.right, p) and _s39_sigmoid_of(module, node.left, p))
    if isinstance(node.op, ast.Div) and _s39_one_plus_exp_neg(module, node.right, p):
        num = node.left
        if isinstance(num, ast.BinOp) and isinstance(num.op, ast.Mult):
            num = num.left if _s39_one(num.right) else num.right if _s39_one(num.left) else num
        return _s39_is_param(num, p)
    return False


def _s39_pointwise_formula(module: ModuleInfo, fn: ast.FunctionDef) -> str | None:
    """The text a one-parameter ``forward`` returns when it is a formula of that parameter alone
    (arithmetic, constants and ``torch`` / ``math`` functions; one return): the local activation
    class npufuse cannot name, said in the near miss. None for anything else (a module that is no
    activation: a projection, a norm, several statements of state)."""
    params = [a.arg for a in fn.args.args if a.arg != "self"]
    returns = [n for n in fast_walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    if len(params) != 1 or len(returns) != 1 or fn.args.vararg or fn.args.kwarg:
        return None
    value = _s41_straight_value(module, fn, returns[0].value)
    if value is None:
        return None
    if not any(isinstance(n, ast.Name) and n.id == params[0] for n in fast_walk(value)):
        return None
    nonlinear = ("exp", "sigmoid", "tanh", "erf", "relu", "softplus", "log1p", "pow", "sqrt")
    if not any(isinstance(n, ast.Call) and ((module.canonical(n.func) or "").startswith(("torch.", "math."))
                                             or isinstance(n.func, ast.Attribute) and n.func.attr in nonlinear)
               for n in fast_walk(value)):
        return None  # `return x` / `x * 2` / `x.float()`: an identity, a scale or a cast (a hook module), no activation
    for n in fast_walk(value):
        if isinstance(n, ast.Call):
            name = module.canonical(n.func) or ""
            method = isinstance(n.func, ast.Attribute) and not (dotted(n.func) or "").startswith(("torch.", "math.", "F."))
            if not (name.startswith(("torch.", "math.")) or method):
                return None
        elif isinstance(n, ast.Name) and n.id not in (params[0], "torch", "math", "F"):
            if module.canonical(n) is None or not (module.canonical(n) or "").startswith(("torch", "math")):
                return None
        elif isinstance(n, (ast.Lambda, ast.NamedExpr, ast.Subscript, ast.IfExp, ast.Compare)):
            return None
    return ast.unparse(value)


def _formula_kernels(module: ModuleInfo, fn: ast.FunctionDef) -> int:
    """Eager kernels of a helper's formula: its tensor ops (those touching the parameter)."""
    params = [a.arg for a in fn.args.args if a.arg != "self"]
    rets = [n for n in fast_walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    if len(params) != 1 or not rets:
        return 1
    v = _s41_straight_value(module, fn, rets[-1].value) if len(rets) == 1 else rets[-1].value
    while S.is_cast(v):
        v = v.func.value  # type: ignore[union-attr]
    if isinstance(v, ast.Call) and module.canonical(v.func) in _FUNCS:
        return 1
    n = sum(1 for x in fast_walk(v) if isinstance(x, (ast.BinOp, ast.Call, ast.UnaryOp)) and _mentions(x, params[0]))
    return max(n, 1)


def _mentions(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in fast_walk(node))


def _class_act(module: ModuleInfo, cls_name: str) -> str | None:
    cls = module.classes.get(cls_name)
    if cls is None:
        return None
    for item in cls.body:
        if isinstance(item, ast.FunctionDef) and item.name == "forward":
            return _helper_act(module, item)
    return None


def classify_call(module: ModuleInfo, call: ast.Call, ctx: S.Ctx) -> Act | None:
    """The activation a call applies to its first argument, if it is one."""
    return _swiglu_s51m.sigmoid_object_as_form(_classify_call(module, call, ctx))  # s51: `self.sigmoid(x)`


def _classify_call(module: ModuleInfo, call: ast.Call, ctx: S.Ctx) -> Act | None:
    if not call.args or isinstance(call.args[0], ast.Starred):
        return None
    gate = call.args[0]
    name = module.canonical(call.func)
    if name in _FUNCS:
        kind = _FUNCS[name]
        approx = None
        if kind == GELU:
            a = S.arg(call, "approximate", 1)
            if a is not None:
                v = const_value(a)
                kind, approx = (GELU_TANH, None) if v == "tanh" else (GELU, None) if v == "none" else (GELU_DYN, a)
        if kind == SIGMOID:
            return Act(SIGMOID, None, ctx, ast.unparse(call.func), sigmoid_arg=gate)
        return Act(kind, gate, ctx, ast.unparse(call.func), approx=approx)
    f = call.func
    # x.sigmoid()
    if isinstance(f, ast.Attribute) and f.attr == "sigmoid" and not call.args:
        return Act(SIGMOID, None, ctx, "sigmoid", sigmoid_arg=f.value)
    # ACT2FN["silu"](x) inline
    if isinstance(f, (ast.Subscript, ast.Call)):
        k = _module_act(module, f)
        if k is not None:
            return Act(k[0], gate, ctx, ast.unparse(f), obj=f, config_key=k[1] if k[0] == CONFIG else None, approx=k[1] if k[0] == GELU_DYN else None)
    # ``SiLU()(x)`` (s33): a class of this module built and called in one expression, its forward an
    # activation of its one input (a new object per call: nothing set after ``__init__`` can change it)
    if isinstance(f, ast.Call) and not f.args and not f.keywords and isinstance(f.func, ast.Name) and f.func.id in module.classes \
            and S.method(module, f.func.id, "__init__") is None:
        ck = _class_act(module, f.func.id)
        fwd = S.method(module, f.func.id, "forward")
        if ck is not None and fwd is not None:
            return Act(ck, gate, ctx, ast.unparse(f), kernels=_formula_kernels(module, fwd))
    if isinstance(f, ast.Attribute) and f.attr not in _TENSOR_METHODS and isinstance(f.value, ast.Name) and _foreign_receiver(module, f.value.id, ctx):
        # `layer.act(layer.gate(x)) * layer.up(x)` with `layer` a local or a parameter of a plain
        # function (not a method's own receiver, whose __init__ would say what it is): a callable
        # another object holds; an activation only if the product is a GLU's (weak), dispatched
        # on the object at run time
        return Act(CONFIG, gate, ctx, ast.unparse(f), obj=f, gelu_hint=_gelu_hint(f.attr, None), weak=True)
    # self.act_fn(x): what __init__ assigned (this class's, or an in-module base class's)
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
        cls_name = _assigning_class(module, ctx.scope.class_name, f.attr) or ctx.scope.class_name
        init = S.init_assignments(module, cls_name)
        value = init.get(f.attr)
        if value is not None:
            desc = f"self.{f.attr} = {ast.unparse(value)}"
            elsewhere = _stored_outside_init(module, {cls_name, ctx.scope.class_name}, f.attr)
            if elsewhere is not None:
                # s45: another method stores the attribute again (`self.act = nn.GELU()` in a `set_act` method): the
                # callable at this call need not be the one __init__ chose, so the kind read there proves nothing
                return Act(_REASSIGNED, gate, ctx, f"`self.{f.attr}` is {elsewhere}", obj=f)
            branched = _branch_assigned_act(module, cls_name, f, gate, ctx) or _getattr_act(module, value, f, gate, ctx, desc)
            if branched is not None:
                return branched
            if isinstance(value, ast.IfExp):
                return _chosen_act(module, value, f, gate, ctx, desc) or _config_arm_act(module, value, f, gate, ctx, desc) \
                    or _param_or_default_act(module, value, f, gate, ctx, desc, cls_name)
            k = _module_act(module, value)
            if k is not None:
                kind, extra = k
                if kind == CONFIG:
                    return Act(CONFIG, gate, ctx, desc, obj=f, config_key=_config_key(module, ctx, extra, cls_name), gelu_hint=_gelu_hint(f.attr, extra),
                               default=_param_default_kind(module, ctx, extra, name_only=True, cls_name=cls_name))
                return Act(kind, gate, ctx, desc, obj=f, approx=extra if kind == GELU_DYN else None)
            seq = _sequential_act(module, value, f, gate, ctx, desc)
            if seq is not None:
                return seq
            fallback = _getattr_default_kind(module, value)
            if fallback is not None:
                # `self.act = getattr(expert, "activation", F.gelu)`: another object's callable,
                # an activation when it has none: chosen at run time, dispatched on the object
                return Act(CONFIG, gate, ctx, desc, obj=f, default=fallback, gelu_hint=fallback in GELU_KINDS)
            if isinstance(value, ast.Call):
                cname = dotted(value.func)
                if cname and cname in module.classes:
                    ck = _class_act(module, cname)
                    fwd = S.method(module, cname, "forward")
                    if ck is not None:
                        return Act(ck, gate, ctx, desc, obj=f, kernels=_formula_kernels(module, fwd) if fwd else 1)
                    swish = _s40_swish_act(module, fwd, cname, value, f, gate, ctx, desc) if isinstance(fwd, ast.FunctionDef) else None
                    if swish is not None:
                        return swish
                    formula = _s39_pointwise_formula(module, fwd) if isinstance(fwd, ast.FunctionDef) else None
                    if formula is not None:
                        # s39: the module's own activation class computes something npufuse cannot name: a near
                        # miss that says what its forward returns (no candidate: no fused op is known to match)
                        return Act(_OWN_FORMULA, gate, ctx, f"{desc}, whose forward returns `{formula[:60]}`", obj=f)
                # act_layer() with act_layer an __init__ parameter (timm): chosen by the caller
                params = S.init_params(module, cls_name)
                if isinstance(value.func, ast.Name) and value.func.id in params:
                    default = params[value.func.id]
                    dk = _module_act(module, ast.Call(func=default, args=[], keywords=[])) if default is not None else None
                    return Act(CONFIG, gate, ctx, desc, obj=f, default=dk[0] if dk else None, gelu_hint=_gelu_hint(f.attr, default))
            if isinstance(value, ast.Name) and value.id in S.init_params(module, cls_name):
                return Act(CONFIG, gate, ctx, desc, obj=f, gelu_hint=_gelu_hint(f.attr, value),
                           default=_param_default_kind(module, ctx, value, name_only=False, cls_name=cls_name))
            chooser = bound_callee.function_of_call(module, cls_name, value, foreign=False) if isinstance(value, ast.Call) else None
            if chooser is not None:
                # a function of this file, or (s40, tiny-qwen's ``self._get_activation_fn(cfg.hidden_act)``) a method of
                # the class, returning an activation chosen by its argument: a known kind on every return is that
                # kind, else the fused branch dispatches on the object (``self.act_fn is F.silu``)
                return _helper_chosen(module, chooser[1], None, gate, ctx, desc, f)
            if isinstance(value, ast.Call) and dotted(value.func) is not None and not (module.canonical(value.func) or "").startswith("torch.") \
                    and (dotted(value.func) or "").split(".")[0] in module.aliases:
                # `self.act = build_activation_layer(...)`: an object an imported builder makes from
                # configuration; only run-time dispatch on the object can tell what it is
                return Act(CONFIG, gate, ctx, desc, obj=f, gelu_hint=_gelu_hint(f.attr, None),
                           default=_call_literal_kind(module, value), weak=True)
            if isinstance(value, ast.Attribute) and dotted(value) is not None and not (module.canonical(value) or "").startswith("torch."):
                # `self.act = config.activation_func`: a callable handed in by configuration
                return Act(CONFIG, gate, ctx, desc, obj=f, gelu_hint=_gelu_hint(f.attr, value))
            return _opaque_object_act(module, value, f, gate, ctx, desc)
        elt = _init_tuple_element(module, ctx.scope.class_name, f.attr)
        if elt is not None:  # `self.act, self.is_gated = get_activation(args)`
            call, index = elt
            desc = f"{ast.unparse(call)}[{index}] (tuple assignment in __init__)"
            fn = module.functions.get(call.func.id) if isinstance(call.func, ast.Name) else None
            if fn is not None:
                return _helper_chosen(module, fn, index, gate, ctx, desc, f)
            return Act(CONFIG, gate, ctx, desc, obj=f, gelu_hint=_gelu_hint(f.attr, call))
        m = S.method(module, ctx.scope.class_name, f.attr)
        if m is not None:
            k2 = _helper_act(module, m)
            if k2 is not None:
                return Act(k2, gate, ctx, f"self.{f.attr}()", kernels=_formula_kernels(module, m))
            swish = _s40_swish_act(module, m, ctx.scope.class_name, None, ast.Name("self", ast.Load(), lineno=f.lineno, col_offset=f.col_offset),
                                   gate, ctx, f"self.{f.attr}()")
            if swish is not None:
                return swish
        return _inherited_act(module, f, gate, ctx)
    if isinstance(f, ast.Attribute) and (dotted(f) or "").startswith("self.") and (dotted(f) or "").count(".") == 2 \
            and f.attr != "forward" and f.attr not in _MAPPING_READS \
            and not _model_method_of_child(module, f):  # s28: `self.up_proj.forward(x)` is the module's own call
        # `self.config.activation_func(h[0]) * h[1]` (Megatron): a callable the config holds
        return Act(CONFIG, gate, ctx, ast.unparse(f), obj=f, gelu_hint=_gelu_hint(f.attr, None))
    if isinstance(f, ast.Name):
        local = S.definition(ctx, f.id)
        if local is not None and isinstance(local[1], ast.IfExp):
            # `act = F.silu if activation == "silu" else F.gelu` in this function
            return _chosen_act(module, local[1], f, gate, ctx, f"{f.id} = {ast.unparse(local[1])}")
        fn = module.helper(f.id)
        if isinstance(fn, ast.FunctionDef) and S.definition(ctx, f.id) is None:
            k3 = _helper_act(module, fn)
            if k3 is not None:
                return Act(k3, gate, ctx, f"{f.id}()", kernels=_formula_kernels(module, fn))
        passed = _parameter_act(module, f, gate, ctx)
        if passed is not None:
            return passed
        # s43: ``nonlin = nn.SiLU()`` bound once in this scope (or in an if arm whose other arm raises)
        built = _swiglu_s43.sole_local_value(ctx, f.id)
        kb = _module_act(module, built) if built is not None else None
        if kb is not None and kb[0] != CONFIG:
            return Act(kb[0], gate, ctx, f"{f.id} = {ast.unparse(built)}", obj=f, approx=kb[1] if kb[0] == GELU_DYN else None)  # type: ignore[arg-type]
        return _local_callable_act(module, f, gate, ctx)
    return None


# torch.Tensor methods taking one tensor: `h.matmul(self.w1(x))` is arithmetic, never an activation object
_TENSOR_METHODS = frozenset(("matmul", "mm", "bmm", "mul", "add", "sub", "div", "view", "view_as", "reshape", "reshape_as",
                             "expand", "expand_as", "to", "type_as", "masked_fill", "clamp", "repeat", "permute", "transpose",
                             "index_select", "gather", "scatter", "where", "pow", "softmax", "log_softmax", "sum", "mean",
                             "max", "min", "flatten", "unflatten", "narrow", "split", "chunk", "copy_", "mul_", "add_", "dot",
                             "outer", "lerp", "maximum", "minimum", "masked_select", "index_add", "roll", "unsqueeze", "squeeze"))


def _foreign_receiver(module: ModuleInfo, name: str, ctx: S.Ctx) -> bool:
    """``name`` holds some other object: a local of the function, or a parameter of a plain
    (module-level or nested) function; never a method's own receiver, a module, a class or a
    function of this module."""
    if ctx.depth or name in module.aliases or name in module.classes or name in module.functions:
        return False
    scope = ctx.scope
    cls = scope.class_name
    is_method = cls is not None and cls in module.classes and any(x is scope.node for x in module.classes[cls].body)
    if is_method and scope.args and name == scope.args[0]:
        return S.definition(ctx, name) is not None  # the receiver rebound (`self = self.layers[i].mlp`)
    return name in scope.args or S.definition(ctx, name) is not None


def _getattr_default_kind(module: ModuleInfo, value: ast.expr) -> str | None:
    """``getattr(obj, "name", <activation>)``: the activation kind of the fallback, else None."""
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "getattr"
            and module.canonical(value.func) in (None, "getattr") and len(value.args) == 3 and not value.keywords):
        return None
    return _default_object_kind(module, value.args[2])


def _chosen_act(module: ModuleInfo, value: ast.IfExp, f: ast.expr, gate: ast.expr, ctx: S.Ctx, desc: str) -> Act | None:
    """An activation object chosen by a condition (``nn.GELU() if use_gelu else nn.SiLU()``): both
    choices must be activations npufuse knows. The same kind: that kind; different kinds: chosen
    at run time like a configured activation, by testing the object itself (``isinstance(self.act,
    nn.SiLU)``), so whichever the condition picked is fused correctly."""
    kinds = []
    for branch in (value.body, value.orelse):
        k = _module_act(module, branch)
        if k is None or k[0] in (CONFIG, GELU_DYN):
            return None
        kinds.append(k[0])
    if kinds[0] == kinds[1]:
        return Act(kinds[0], gate, ctx, desc, obj=f)
    if not any(k in (SILU, GELU, GELU_TANH) for k in kinds):
        if any("gelu" in k for k in kinds):
            return None  # (a gelu variant: the geglu pattern's own wording does not fit a choice)
        return Act(f"{kinds[0]} or {kinds[1]}", gate, ctx, desc, obj=f)  # a near miss: neither choice is fused
    # a choice the fused ops do not compute (relu) runs the original code: the run-time test says so
    return Act(CONFIG, gate, ctx, desc, obj=f, gelu_hint=SILU not in kinds)


def _sequential_act(module: ModuleInfo, value: ast.expr, f: ast.expr, gate: ast.expr, ctx: S.Ctx, desc: str) -> Act | None:
    """``self.gate = nn.Sequential(nn.Linear(d, h), GELU())`` then ``self.gate(x)`` (Wan/T5
    gated-gelu): the activation is the Sequential's last layer, applied to the earlier layers'
    output, which is the gate operand (``self.gate[0](x)``, or ``self.gate[:-1](x)``: the same
    module objects, so the same weights)."""
    if not (isinstance(value, ast.Call) and module.canonical(value.func) == "torch.nn.Sequential" and len(value.args) >= 2
            and not value.keywords and not any(isinstance(a, ast.Starred) for a in value.args)):
        return None
    last = value.args[-1]
    k = _module_act(module, last)
    kind = k[0] if k is not None and k[0] not in (CONFIG, GELU_DYN) else None
    kernels = 1
    if kind is None and isinstance(last, ast.Call) and not last.args and not last.keywords and (dotted(last.func) or "") in module.classes:
        kind = _class_act(module, dotted(last.func) or "")
        fwd = S.method(module, dotted(last.func), "forward")
        kernels = _formula_kernels(module, fwd) if fwd else 1
    if kind is None:
        return None
    head: ast.expr = ast.Constant(0) if len(value.args) == 2 else ast.Slice(upper=ast.UnaryOp(op=ast.USub(), operand=ast.Constant(1)))
    earlier = ast.Call(func=ast.Subscript(value=f, slice=head, ctx=ast.Load()), args=[gate], keywords=[])
    return Act(kind, earlier, ctx, desc, kernels=kernels)


def _param_default_kind(module: ModuleInfo, ctx: S.Ctx, node: ast.expr | None, name_only: bool, cls_name: str | None = None) -> str | None:
    """The activation an ``__init__`` parameter's default names: ``activation=nn.GELU(...)`` /
    ``F.silu`` (an object), or ``hidden_act="gelu"`` (a key of an activation table: ``name_only``).
    Only which pattern reports the site follows from it; the fused code still dispatches at run
    time (a caller may pass another)."""
    if not isinstance(node, ast.Name):
        return None
    params = S.init_params(module, cls_name or ctx.scope.class_name)
    default = params.get(node.id)
    if default is None:
        if node.id in params and not name_only:
            return _caller_default_kind(module, cls_name or ctx.scope.class_name, node.id)
        return None
    if name_only:
        v = const_value(default)
        return ACT_NAMES.get(v.lower()) if isinstance(v, str) else None
    return _default_object_kind(module, default)


def _caller_default_kind(module: ModuleInfo, cls_name: str | None, param: str, depth: int = 0) -> str | None:
    """The activation a required ``__init__`` parameter gets from the module's own constructions of
    the class (``GLU(..., activation_fn=activation_fn)`` inside ``DroplessMLP.__init__``, whose
    parameter in turn comes from ``dMoE.__init__``'s default): one kind on every construction."""
    if not cls_name or depth > 3:
        return None
    init = S.method(module, cls_name, "__init__")
    if init is None:
        return None
    pos = [a.arg for a in (*init.args.posonlyargs, *init.args.args)][1:]
    owners: list[tuple[ast.FunctionDef, str | None]] = [(f, None) for f in module.functions.values()]
    owners += [(m, c) for c, cls in module.classes.items() for m in cls.body if isinstance(m, ast.FunctionDef)]
    kinds: set[str | None] = set()
    for fn, owner_cls in owners:
        for call in (n for n in fast_walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == cls_name):
            arg = next((k.value for k in call.keywords if k.arg == param), None)
            if arg is None and param in pos and pos.index(param) < len(call.args):
                arg = call.args[pos.index(param)]
            if arg is None or isinstance(arg, ast.Starred):
                kinds.add(None)
                continue
            fparams = {a.arg: d for a, d in zip(fn.args.args[::-1], [*fn.args.defaults[::-1], *[None] * len(fn.args.args)])}
            fparams.update({a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults)})
            if isinstance(arg, ast.Name) and arg.id in fparams:
                d = fparams[arg.id]
                if d is not None:
                    kinds.add(_default_object_kind(module, d))
                elif owner_cls is not None and fn.name == "__init__":
                    kinds.add(_caller_default_kind(module, owner_cls, arg.id, depth + 1))
                else:
                    kinds.add(None)
            else:
                kinds.add(_default_object_kind(module, arg))
    return kinds.pop() if len(kinds) == 1 else None


def _module_value(module: ModuleInfo, name: str) -> ast.expr | None:
    """The value of a module-level name assigned exactly once at the top level (a constant default)."""
    found = [n.value for n in module.tree.body if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]
    found += [n.value for n in module.tree.body if isinstance(n, ast.AnnAssign) and n.value is not None and isinstance(n.target, ast.Name) and n.target.id == name]
    return found[0] if len(found) == 1 else None


def _default_object_kind(module: ModuleInfo, node: ast.expr, depth: int = 0) -> str | None:
    """The activation a default *object* is: ``nn.GELU(...)``/``F.silu``, a module-level constant
    holding one (``DEFAULT_ACT = partial(F.gelu, approximate="tanh")``), a ``functools.partial`` of
    an activation function, or a module-level resolver called with a literal naming one activation
    (``resolve_act_fn({"name": "gelu", "approximate": "none"})``). It only picks which pattern
    reports the site: the fused code dispatches on the object at run time."""
    if depth > 3:
        return None
    if isinstance(node, ast.Name) and module.canonical(node) not in _FUNCS:
        v = _module_value(module, node.id)
        return _default_object_kind(module, v, depth + 1) if v is not None else None
    k = _module_act(module, node)
    if k is not None:
        return k[0] if k[0] not in (CONFIG, GELU_DYN) else None
    if isinstance(node, ast.Call) and module.canonical(node.func) in ("functools.partial", "partial") and node.args:
        fk = _FUNCS.get(module.canonical(node.args[0]) or "")
        if fk == GELU:
            v = const_value(S.arg(node, "approximate", 10**6))
            return GELU_TANH if v == "tanh" else GELU if v in (..., "none") else None
        return fk
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in module.functions:
        return _call_literal_kind(module, node)
    return None


def _call_literal_kind(module: ModuleInfo, call: ast.Call) -> str | None:
    """The one activation a builder call's literal arguments name (a string, or a dict literal's
    values, module-level constants followed): ``build_act("gelu")``, ``resolve({"name": "gelu"})``."""
    strings: list[str] = []
    for a in [*call.args, *(k.value for k in call.keywords)]:
        if isinstance(a, ast.Name):
            a = _module_value(module, a.id) or a
        vals = a.values if isinstance(a, ast.Dict) else [a]
        strings += [v for v in (const_value(x) for x in vals) if isinstance(v, str)]
    kinds = {ACT_NAMES[v.lower()] for v in strings if v.lower() in ACT_NAMES}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind == GELU and "tanh" in strings:
        kind = GELU_TANH
    return kind


def _stored_outside_init(module: ModuleInfo, class_names: set[str | None], attr: str) -> str | None:
    """Where and how code outside ``__init__`` (of these classes of this file) first changes ``self.<attr>``, as
    words (``stored again in `MLP.set_act```); None where nothing does (s46: bound_callee's one reader: stores, dels,
    ``setattr`` and hooks nested in ``__init__`` count)."""
    for cls_name in sorted(c for c in class_names if c):
        change = bound_callee.changed_outside_init(module, cls_name).get(attr)
        if change is not None:
            if change.how == "stored":
                return f"stored again in `{change.method}`"
            # (a store on another object may be this module: ``mod.act = ..`` in a hook taking the module)
            return f"{'possibly ' if change.how.startswith('stored on') else ''}changed in `{change.method}` ({change.how})"
    return None


def _assigning_class(module: ModuleInfo, class_name: str | None, attr: str, depth: int = 0) -> str | None:
    """The class whose ``__init__`` assigns ``self.<attr>``: this one, else a base class defined in
    the same module (``class MPTGLU(MPTMLP)`` inherits ``self.act`` from ``MPTMLP.__init__``)."""
    if not class_name or class_name not in module.classes or depth > 3:
        return None
    if attr in S.init_assignments(module, class_name):
        return class_name
    if S.method(module, class_name, "__init__") is not None and _init_tuple_element(module, class_name, attr) is not None:
        return None
    for b in module.classes[class_name].bases:
        if isinstance(b, ast.Name) and b.id in module.classes and b.id != class_name:
            found = _assigning_class(module, b.id, attr, depth + 1)
            if found is not None:
                return found
    return None


def _init_tuple_element(module: ModuleInfo, class_name: str | None, attr: str) -> tuple[ast.Call, int] | None:
    """(call, index) of ``self.a, self.b = call(...)`` in the class's ``__init__`` for ``attr``."""
    fn = S.method(module, class_name, "__init__")
    if fn is None:
        return None
    found = None
    for n in fast_walk(fn):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
            for t in n.targets:
                if isinstance(t, (ast.Tuple, ast.List)):
                    for i, e in enumerate(t.elts):
                        if dotted(e) == f"self.{attr}":
                            found = (n.value, i)
    return found


def _helper_chosen(module: ModuleInfo, fn: ast.FunctionDef, index: int | None, gate: ast.expr, ctx: S.Ctx, desc: str,
                   obj: ast.expr) -> Act | None:
    """The activation a module-level helper returns (element ``index`` of a returned tuple):
    one known kind on every ``return`` (a dict literal looked up: every value) is that kind;
    several known kinds none of which a fused op computes (``nn.ReLU()``, ``nn.Tanh()``) are none;
    anything else is chosen at run time (the fused branch dispatches on the object)."""
    kinds: set[str | None] = set()
    for r in (n for n in fast_walk(fn) if isinstance(n, ast.Return)):
        v = r.value
        if index is not None:
            v = v.elts[index] if isinstance(v, (ast.Tuple, ast.List)) and index < len(v.elts) else None
        values = list(v.value.values) if isinstance(v, ast.Subscript) and isinstance(v.value, ast.Dict) else [v]
        for x in values:
            k = _module_act(module, x) if x is not None else None
            kinds.add(k[0] if k is not None and k[0] not in (CONFIG, GELU_DYN) else None)
    if len(kinds) == 1 and None not in kinds:
        kind = kinds.pop()
        assert kind is not None
        return Act(kind, gate, ctx, desc, obj=obj)
    if None not in kinds and not kinds & {SILU, GELU, GELU_TANH, GELU_DYN}:
        return None  # several known activations, none of which a fused op computes (ReLU family, Tanh)
    hint = any(k is not None and "gelu" in k for k in kinds) and SILU not in kinds
    return Act(CONFIG, gate, ctx, desc, obj=obj, gelu_hint=hint)


def _gelu_hint(attr: str, key: ast.AST | None) -> bool:
    text = attr + " " + (ast.unparse(key) if key is not None else "")
    return "gelu" in text.lower()


def _config_key(module: ModuleInfo, ctx: S.Ctx, key: ast.expr | None, cls_name: str | None = None) -> ast.expr | None:
    """``ACT2FN[config.hidden_act]`` in __init__ -> ``self.config.hidden_act`` when __init__ keeps
    the config (``self.config = config``) or the key itself (``self.hidden_act = config.hidden_act``)."""
    if key is None:
        return None
    init = S.init_assignments(module, cls_name or ctx.scope.class_name)
    kd = dotted(key)
    if kd is None:
        return None
    head, _, rest = kd.partition(".")
    for attr, value in init.items():
        vd = dotted(value)
        if vd == kd:
            return _synthetic(f"self.{attr}")
    if rest:
        for attr, value in init.items():
            if dotted(value) == head:
                return _synthetic(f"self.{attr}.{rest}")
    return None


def _synthetic(src: str) -> ast.expr:
    """An expression written by npufuse (no source position: rendered with ast.unparse)."""
    node = ast.parse(src, mode="eval").body
    for n in fast_walk(node):
        for attr in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
            if hasattr(n, attr):
                delattr(n, attr)
    return node


# --------------------------------------------------------------------------------------------
# gated products


class GateMiss(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Operand:
    node: ast.expr
    ctx: S.Ctx


@dataclass
class Halves:
    tensor: ast.expr  # the split tensor
    ctx: S.Ctx
    dim: ast.expr
    dim_ctx: S.Ctx
    gate_index: int  # 0: activation on the first half
    how: str  # chunk | split | slice
    equal: bool  # sizes provably equal (chunk(2) / split([n, n]))


@dataclass
class Gate:
    act: Act
    a: Operand  # activated
    b: Operand  # the other factor
    node: ast.expr  # the product node replaced
    halves: Halves | None
    trace: S.Trace
    input_key: str | None  # the projections' common input
    parts: str | None = None  # two parts of one chunk/split taken as operands: how ("chunk", "split")
    # gate and up are parameters of the enclosing helper; the lines of the calls (in this module)
    # that pass it projections (or halves) of one input
    caller_lines: list[int] | None = None
    # an operand whose value the code may change under a condition before the product (a gate
    # sparsified when a flag is set): its shape is not proven equal to the other's, so the fused
    # branch checks it at run time (host-side shapes, no sync)
    shape_checked: bool = False
    elementwise: bool = False  # operands transformed elementwise after their projection (s27)
    # s27: operands written as expressions (`x_linear + offset`): per operand, the name it starts from
    # and the scales/bounds applied inline; the shape check reads those instead of the operand
    inline_guard: list[tuple[ast.Name, S.Ctx, list[tuple[ast.expr, S.Ctx]]]] | None = None


def _flatten_mul(node: ast.expr, out: list[ast.expr]) -> None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        _flatten_mul(node.left, out)
        _flatten_mul(node.right, out)
    else:
        out.append(node)


def _act_of(module: ModuleInfo, node: ast.expr, ctx: S.Ctx, trace: S.Trace) -> Act | None:
    """The activation a factor is (through names assigned from it)."""
    t = S.Trace()
    n, c = node, ctx
    for _ in range(8):
        if isinstance(n, ast.Name):
            value, vctx, stmt = S.follow(n, c)
            if value is n:
                return None
            if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult):
                # ``glu = gate * torch.sigmoid(alpha * gate)`` assigned to a name, then ``up * glu``
                act = _sigmoid_form(module, value, vctx)
                if act is not None:
                    S.follow(n, c, trace)
                return act
            if not isinstance(value, (ast.Call, ast.Name)):
                return None
            S.follow(n, c, t)
            n, c = value, vctx
            continue
        break
    moved = _device_move(n)
    if moved:
        n = n.func.value  # type: ignore[union-attr]
    if S.is_cast(n) and n.func.value is not None:  # type: ignore[union-attr]
        act = _cast_back_act(module, n, c)  # `act(g.float()).type_as(g)`: else no activation
    elif not isinstance(n, ast.Call):
        return None
    else:
        act = classify_call(module, n, c)
    if act is not None:
        act.moved = moved
        trace.stmts.update(t.stmts)
        # config-chosen, but the code calls its result gelu (T5: ``hidden_gelu = self.act(...)``)
        if act.kind == CONFIG and isinstance(node, ast.Name) and "gelu" in node.id.lower():
            act.gelu_hint = True
    return act


def _device_move(n: ast.expr) -> bool:
    """``t.to(device=d)`` / ``t.to(y.device)``: a device move only (no dtype): the values are
    unchanged, so the activation under it is still the gate (llm-foundry's MPTGLU)."""
    if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "to"):
        return False
    kws = {k.arg for k in n.keywords}
    if None in kws or not kws <= {"device", "non_blocking"}:
        return False
    if n.args:
        return len(n.args) == 1 and not kws & {"device"} and isinstance(n.args[0], ast.Attribute) and n.args[0].attr == "device"
    return "device" in kws


def _sigmoid_form(module: ModuleInfo, value: ast.BinOp, ctx: S.Ctx) -> Act | None:
    """``z * sigmoid(k * z)``: silu for k = 1, quick_gelu for 1.702, a scaled swish otherwise."""
    fs: list[ast.expr] = []
    _flatten_mul(value, fs)
    if len(fs) != 2:
        return None
    for i in (0, 1):
        sig, z = fs[i], fs[1 - i]
        if not isinstance(sig, ast.Call):
            continue
        a = classify_call(module, sig, ctx)
        if a is None or a.kind != SIGMOID or a.sigmoid_arg is None:
            continue
        arg = a.sigmoid_arg
        zk = S.key(z, ctx)
        if S.key(arg, ctx) == zk:
            return Act(SILU, z, ctx, "z * torch.sigmoid(z)", kernels=2)
        if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Mult):
            for k, other in ((arg.left, arg.right), (arg.right, arg.left)):
                if S.key(other, ctx) == zk:
                    if const_value(k) == 1.702:
                        return Act(QUICK_GELU, z, ctx, "z * torch.sigmoid(1.702 * z)", kernels=3)
                    unit = _s36_unit_beta(module, k, ctx)
                    if unit is not None:
                        return unit(z, "z * torch.sigmoid(beta * z)")
                    what = _s40_beta_attribute(module, k, ctx)
                    return Act(f"swish with beta `{ast.unparse(k)}`{what} (z * sigmoid(beta * z))", z, ctx, "", kernels=3)
    return None


def _split_of(module: ModuleInfo, node: ast.expr, ctx: S.Ctx, trace: S.Trace) -> tuple[str, ast.expr, S.Ctx, ast.expr | None, object, str, bool] | None:
    """``T.chunk(2, d)[i]`` / ``torch.chunk(T, 2, d)[i]`` / ``T.split(n, d)[i]`` / ``T[..., :n]``:
    (key of T, T, ctx, dim, index or slice-kind, how, equal)."""
    t = S.Trace()
    n, c = S.peel(node, ctx, t)
    if isinstance(n, ast.Subscript):
        tb = S.Trace()  # names followed to the chunk/split call: traced only if it is one
        base, bctx = S.peel(n.value, c, tb)
        idx = const_value(n.slice)
        call = base if isinstance(base, ast.Call) else None
        if call is not None and isinstance(idx, int):
            fname = module.call_name(call)
            recv: ast.expr | None = None
            rest: list[ast.expr] = []
            meth = call.func.attr if isinstance(call.func, ast.Attribute) else None
            if meth in ("chunk", "split", "tensor_split") and fname not in ("torch.chunk", "torch.split", "torch.tensor_split"):
                recv, rest = call.func.value, list(call.args)  # type: ignore[union-attr]
            elif fname in ("torch.chunk", "torch.split", "torch.tensor_split") and call.args:
                recv, rest = call.args[0], list(call.args[1:])
                meth = fname.split(".")[-1]
            if recv is not None:
                size = rest[0] if rest else S.arg(call, "chunks" if meth == "chunk" else "split_size_or_sections", None)
                dim = rest[1] if len(rest) > 1 else S.arg(call, "dim", None)
                if dim is None:
                    dim = ast.Constant(0)
                k = const_value(size)
                if meth == "chunk" and isinstance(k, int) and not isinstance(k, bool) and k > 2 and -k <= idx < k:
                    # one of k parts (gpt-neox/Megatron fused qkv-style projections): two of them
                    # can be the gate pair, taken as two operands (the parts stay as written).
                    # chunk makes every part ceil(n/k) long except the last, which may be shorter.
                    return (S.key(recv, bctx), recv, bctx, dim, idx % k, "part", idx % k < k - 1)
                if meth == "tensor_split" and _s28_one_index(size) and -2 <= idx < 2:
                    equal = False  # split at one index: two parts, halves when the index is half the dim (checked at run time)
                elif meth in ("chunk", "tensor_split"):
                    if const_value(size) != 2:
                        raise GateMiss(f"split into {ast.unparse(size) if size is not None else '?'} parts, not two halves")
                    equal = meth == "chunk"
                else:
                    sv = const_value(size)
                    size, sctx = _swiglu_s44sweep.sizes_literal(size, bctx)  # s44: the sizes list through a local name
                    if isinstance(size, (ast.List, ast.Tuple)) and len(size.elts) > 2 and not any(isinstance(e, ast.Starred) for e in size.elts) \
                            and -len(size.elts) <= idx < len(size.elts):
                        # one of 3+ sized parts (mamba2's in_proj split into z0, x0, z, xBC, dt): two parts
                        # of one size can be the gate pair, taken as two operands concatenated; the
                        # part's size (its key) is what the pairing compares
                        # (the operands stay as written, so the split's statement need not join the
                        # rewritten span: it may sit in an enclosing block, as in ``if d_mlp > 0:``)
                        part = idx % len(size.elts)
                        return (S.key(recv, bctx), recv, bctx, dim, part, "sized", (S.key(size.elts[part], sctx), ast.unparse(size.elts[part])))
                    if isinstance(size, (ast.List, ast.Tuple)):
                        if len(size.elts) != 2:
                            raise GateMiss("split into more than two parts")
                        equal = S.key(size.elts[0], sctx) == S.key(size.elts[1], sctx)
                        if not equal:
                            raise GateMiss(f"gate and up have different sizes ({ast.unparse(size)})")
                    else:
                        equal = False  # split(n): two parts only if the size is 2n (assumed, see risks)
                        for st in [*t.stmts.values(), *tb.stmts.values()]:
                            # `a, b, c = T.split(n, d)`: the unpacking says how many parts there are
                            if isinstance(st, ast.Assign) and st.value is call and isinstance(st.targets[0], (ast.Tuple, ast.List)) \
                                    and len(st.targets[0].elts) != 2:
                                raise GateMiss(f"split into {len(st.targets[0].elts)} parts (unpacked into {ast.unparse(st.targets[0])}), "
                                               "not two halves")
                    _ = sv
                trace.stmts.update(t.stmts)
                trace.stmts.update(tb.stmts)
                return (S.key(recv, bctx), recv, bctx, dim, idx, meth or "split", equal)
        # slicing: T[..., :n] / T[..., n:] / T[..., ::2]
        sl = n.slice
        elts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
        # the last dim viewed as two halves: T.view(*lead, 2, -1)[..., i, :] (Moshi's gating MLP)
        # is half i of T.view(*lead, -1), the tensor the fused op splits
        if (
            len(elts) == 3
            and isinstance(elts[0], ast.Constant) and elts[0].value is Ellipsis
            and const_value(elts[1]) in (0, 1)
            and isinstance(elts[2], ast.Slice) and elts[2].lower is None and elts[2].upper is None and elts[2].step is None
            and isinstance(base, ast.Call) and isinstance(base.func, ast.Attribute) and base.func.attr in ("view", "reshape")
            and len(base.args) >= 3 and not base.keywords and not any(isinstance(a, ast.Starred) for a in base.args)
            and const_value(base.args[-2]) == 2 and const_value(base.args[-1]) == -1
        ):
            # a new node with a start but no end: rendered from the AST, never as base's source text
            merged = ast.Call(func=ast.Attribute(value=base.func.value, attr=base.func.attr, ctx=ast.Load()), args=list(base.args[:-2]) + [ast.Constant(-1)], keywords=[],
                              lineno=base.lineno, col_offset=base.col_offset)
            trace.stmts.update(t.stmts)
            trace.stmts.update(tb.stmts)
            return (S.key(base, bctx), merged, bctx, ast.Constant(-1), int(const_value(elts[1])), "view", True)  # type: ignore[call-overload]
        pair = _indexed_pair_part(n, c)
        if pair is not None:
            trace.stmts.update(t.stmts)
            return pair
        if elts and isinstance(elts[-1], ast.Slice) and all(isinstance(e, ast.Slice) and e.lower is None and e.upper is None and e.step is None or (isinstance(e, ast.Constant) and e.value is Ellipsis) for e in elts[:-1]):
            s = elts[-1]
            if s.step is not None:
                return _interleaved_part(n, c, s, elts, trace, t)
            has_ellipsis = any(isinstance(e, ast.Constant) and e.value is Ellipsis for e in elts[:-1])
            dim: ast.expr = ast.Constant(-1) if has_ellipsis or len(elts) == 1 and False else ast.Constant(len(elts) - 1)
            if not has_ellipsis and len(elts) == 1:
                dim = ast.Constant(0)
            kind = "first" if s.lower is None and s.upper is not None else "second" if s.upper is None and s.lower is not None else None
            if kind is None:
                return None
            bound = s.upper if kind == "first" else s.lower
            trace.stmts.update(t.stmts)
            return (S.key(n.value, c), n.value, c, dim, (kind, S.key(bound, c)), "slice", False)
    return None


def _checkpointed(module: ModuleInfo | None, call: ast.Call, ctx: S.Ctx) -> bool:
    """``checkpoint(fn, x, ...)`` (torch.utils.checkpoint), or a ``self.<attr>`` that ``__init__``
    sets to it or to a plain call-through (``checkpoint if ckpt else lambda f, x: f(x)``): the
    value is ``fn(x, ...)``."""
    if module is None or len(call.args) < 2 or any(isinstance(a, ast.Starred) for a in call.args[:2]):
        return False

    def is_ckpt(v: ast.expr) -> bool:
        if module.canonical(v) == "torch.utils.checkpoint.checkpoint":
            return True
        if isinstance(v, ast.Lambda) and len(v.args.args) >= 2 and isinstance(v.body, ast.Call) and isinstance(v.body.func, ast.Name):
            names = [a.arg for a in v.args.args]
            return v.body.func.id == names[0] and [dotted(a) for a in v.body.args] == names[1:] and not v.body.keywords
        return False

    f = call.func
    if is_ckpt(f):
        return True
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" and ctx.scope.class_name:
        v = S.init_assignments(module, ctx.scope.class_name).get(f.attr)
        if v is not None:
            return all(is_ckpt(b) for b in ((v.body, v.orelse) if isinstance(v, ast.IfExp) else (v,)))
    return False


def _projection_input(node: ast.expr, ctx: S.Ctx, module: ModuleInfo | None = None) -> str | None:
    """Key of the input of a projection-like value: ``self.w(x)``, ``F.linear(x, w)``, ``x @ w``."""
    n, c = _through_unary_helper(*S.peel(node, ctx))
    n, c = _through_identity_module(module, n, c)
    n = _biased_projection(n, c)
    while S.is_cast(n):
        n = n.func.value  # type: ignore[union-attr]
    if isinstance(n, ast.Call) and _checkpointed(module, n, c):
        return S.key(n.args[1], c)  # checkpoint(self.w1, x): a projection of x, recomputed in backward
    if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Call) and const_value(n.slice) == 0:
        n = n.value  # vLLM-style ``self.wi_0(x)[0]`` (output, bias)
    if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute)):
        name = n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id
        args = [a for a in n.args if not isinstance(a, ast.Starred)]
        if name in ("cat", "concat", "concatenate") and args:
            # tensor-parallel slices: ``cat([F.linear(x, w_i) for ...], dim=-1)`` is a projection of x
            # (the slices' outputs side by side along the output features)
            return _sliced_projection_input(n, args[0], c)
        if name == "einsum" and len(args) == 3 and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
            # ``einsum("ti,taoi->tao", x, w)``: the same equation (spaces aside) on the same input
            return f"einsum[{args[0].value.replace(' ', '')}]{S.key(args[1], c)}"
        if not n.args and n.keywords and n.keywords[0].arg is not None:
            return S.key(n.keywords[0].value, c)  # ``grouped_mm(A=x, B_t=w, offs=...)``
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("matmul", "mm") and len(n.args) == 1 \
            and not n.keywords and not (isinstance(n.func.value, ast.Name) and n.func.value.id in ("torch", "th")):
        return S.key(n.func.value, c)  # ``x.matmul(w.t())``: the method's receiver is the input (``x @ w``)
    biased = _swiglu_s47review.bias_first_input(n)  # s47 review: ``torch.addmm(b, x, w)``: x is the input
    if biased is not None:
        return S.key(biased, c)
    if isinstance(n, ast.Call) and n.args and not isinstance(n.args[0], ast.Starred):
        return S.key(n.args[0], c)
    if isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult):
        return S.key(n.left, c)
    return None


def _summed_projection_input(node: ast.expr, ctx: S.Ctx, module: ModuleInfo | None) -> str | None:
    """The input key of a sum of projections of one input (a LoRA-adapted projection: ``self.w1(x) +
    self.lora_b(self.lora_a(x))``, optionally ``* scaling``): linear in the input like one projection,
    so the product is still a GLU of two projections; None for anything else."""
    n, c = S.peel(node, ctx)
    if not (isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub))):
        return None
    terms: list[ast.expr] = []
    stack: list[ast.expr] = [n]
    while stack:
        t = stack.pop()
        if isinstance(t, ast.BinOp) and isinstance(t.op, (ast.Add, ast.Sub)):
            stack += [t.left, t.right]
            continue
        # a scaled term (`lora(x) * self.scaling`, `/ r`): a constant or attribute factor, no tensor of its own
        if isinstance(t, ast.BinOp) and isinstance(t.op, (ast.Mult, ast.Div)) and isinstance(t.right, (ast.Constant, ast.Attribute, ast.Name)) \
                and not (isinstance(t.right, ast.Name) and S.definition(c, t.right.id) is not None):
            t = t.left
        terms.append(t)
    keys = set()
    for t in terms:
        # a chain of projections (`lora_b(lora_a(drop(x)))`): the innermost call's input
        for _ in range(4):
            inner = t.args[0] if isinstance(t, ast.Call) and t.args else None
            if not isinstance(inner, ast.Call) or (isinstance(inner.func, ast.Attribute) and inner.func.attr in _VIEWS) or S.is_cast(inner):
                break
            t = inner
        if not isinstance(t, ast.Call) and not (isinstance(t, ast.BinOp) and isinstance(t.op, ast.MatMult)):
            return None
        keys.add(_projection_input(t, c, module))
    if len(keys) != 1 or None in keys:
        return None
    return keys.pop()


def _sliced_projection_input(call: ast.Call, parts: ast.expr, ctx: S.Ctx) -> str | None:
    """The input key of a concatenation of projections of one input along the last dim, else None."""
    dim = S.arg(call, "dim", 1)
    if dim is None or const_value(dim) != -1:
        return None
    if isinstance(parts, (ast.ListComp, ast.GeneratorExp)) and len(parts.generators) == 1:
        elts = [parts.elt]
    elif isinstance(parts, (ast.List, ast.Tuple)) and len(parts.elts) > 1:
        elts = list(parts.elts)
    else:
        return None
    keys = set()
    for e in elts:
        if not (isinstance(e, ast.Call) or (isinstance(e, ast.BinOp) and isinstance(e.op, ast.MatMult))):
            return None
        keys.add(_projection_input(e, ctx))
    if len(keys) != 1 or None in keys:
        return None
    (key,) = keys
    return key


def _transformed(module: ModuleInfo, node: ast.expr, ctx: S.Ctx, other_input: str | None = None) -> str | None:
    """Why an operand is not a plain projection: scaled, clamped or assigned under control flow.

    Control flow is the reason only when one of the name's assignments projects the other
    operand's input (Gemma3n's ``gate_proj = self.gate_proj(x); if ...: gate_proj = topk(gate_proj)``);
    Mamba's ``out * silu(z)`` has a branch-assigned ``out`` too, but is no GLU at all."""
    n, c = S.peel(node, ctx)
    if isinstance(n, ast.Name):
        d = S.definition(c, n.id)
        if d is not None and other_input is not None:
            for stmt, value in c.scope.assignments.get(n.id, []):
                if stmt.lineno < c.line and value is not None and _projection_input(value, c.at(stmt.lineno)) == other_input:
                    return f"`{n.id}` is assigned under control flow before the gate"
        return None
    text = ast.unparse(n)
    inner: list[tuple[ast.expr, S.Ctx]] = []
    if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mult, ast.Div, ast.Add, ast.Sub)):
        inner = [(n.left, c), (n.right, c)]
    elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and not n.args and n.keywords:
        inner = [(n.func.value, c)]  # x.clamp(max=...)
    for e, ec in inner:
        if _projection_input(e, ec) is not None:
            scales: list[tuple[ast.expr, S.Ctx]] = []
            if _elementwise_operand(n, c, set(), scales) is not None \
                    and not any(S.names_read(x) & S.names_read(e) for x, _ in scales):
                # s38: a scale like `self.umup_mult * x` is such a transform; what fails is the value under it
                return (f"gate or up is an elementwise transform (`{text}`) of a value npufuse does not trace, with the "
                        "other operand, to projections of one input: not shown to be a gated product of two projections")
            return (f"gate or up is transformed after its projection (`{text}`) by something other than an elementwise "
                    "clamp, cast or scale independent of the operands: not a gated product of two projections")
    return None


def _biased_halves(module: ModuleInfo, a: ast.expr, actx: S.Ctx, b: ast.expr, ctx: S.Ctx) -> str | None:
    """gpt-neox's ``x, gate = t.chunk(2, -1)`` then ``if bias is not None: b1, b2 = bias.chunk(2, -1);
    x = x + b1; gate = gate + b2``: the two names are the halves of ``t`` (plus the matching halves
    of one bias, added in the same ``if``), whichever way the branch goes. The key of ``t``, or
    None."""
    if not (isinstance(a, ast.Name) and isinstance(b, ast.Name)) or a.id == b.id:
        return None
    scope = ctx.scope
    plans = []
    for name, c in ((a, actx), (b, ctx)):
        defs = [(st, v) for st, v in scope.assignments.get(name.id, []) if st.lineno < c.line]
        if not defs or len(defs) > 2:
            return None
        st0, v0 = defs[0]
        base = _split_of(module, v0, c.at(st0.lineno), S.Trace())
        if base is None or base[5] not in ("chunk", "split") or not base[6]:
            return None
        add = None
        if len(defs) == 2:
            st1, v1 = defs[1]
            if not (isinstance(v1, ast.BinOp) and isinstance(v1.op, ast.Add)):
                return None
            other = v1.right if isinstance(v1.left, ast.Name) and v1.left.id == name.id else \
                v1.left if isinstance(v1.right, ast.Name) and v1.right.id == name.id else None
            if other is None:
                return None
            add = (st1, _split_of(module, other, c.at(st1.lineno), S.Trace()))
            if add[1] is None or add[1][5] not in ("chunk", "split") or not add[1][6] or add[1][4] != base[4]:
                return None
        plans.append((base, add))
    (ba, aa), (bb, ab) = plans
    if ba[0] != bb[0] or {ba[4], bb[4]} != {0, 1} or S.key(ba[3], ba[2]) != S.key(bb[3], bb[2]):
        return None
    if (aa is None) != (ab is None):
        return None
    if aa is not None and ab is not None:
        if aa[1][0] != ab[1][0] or S.key(aa[1][3], aa[1][2]) != S.key(ab[1][3], ab[1][2]):
            return None
        # both bias adds directly in the body of one `if`
        holders = [n for n in fast_walk(scope.node) if isinstance(n, ast.If) and any(x is aa[0] for x in n.body)]
        if not holders or not any(x is ab[0] for x in holders[0].body):
            return None
    return ba[0]


def find_gate(module: ModuleInfo, node: ast.expr, ctx: S.Ctx) -> Gate | None:
    """A gated product ``act(a) * b`` at ``node`` (a Mult BinOp), or None; GateMiss for
    look-alikes whose structure the fused op cannot take."""
    weak: list[Act] = []
    try:
        g = _find_gate(module, node, ctx, weak)
    except GateMiss:
        if weak and weak[0].weak:
            return None  # an imported builder's object in a product that is no GLU: not even a look-alike
        raise
    return g


def _find_gate(module: ModuleInfo, node: ast.expr, ctx: S.Ctx, chosen: list[Act]) -> Gate | None:
    factors: list[ast.expr] = []
    _flatten_mul(node, factors)
    if len(factors) == 3:
        factors = _grouped_up(module, node, ctx) or factors
    if len(factors) not in (2, 3):
        return None
    trace = S.Trace()
    # one trace per factor: only the chosen activation's statements join the fused region (a
    # factor read as a weak activation object and then dropped, e.g. `up = self.up(x)` with an
    # imported `Linear`, must not pull its assignment into the span)
    factor_traces = [S.Trace() for _ in factors]
    acts = [(i, _act_of(module, f, ctx, factor_traces[i])) for i, f in enumerate(factors)]
    found = [(i, a) for i, a in acts if a is not None]
    if len(factors) == 2 and len(found) == 2 and all(a.weak for _, a in found):
        # two callables other objects hold (`layer.act(layer.gate(x)) * layer.up(x)`): the
        # activation is the one applied to a projection of the input the other factor projects
        def glu_like(i: int, a: Act) -> bool:
            ia = _projection_input(a.gate, a.ctx, module) if a.gate is not None else None
            ib_ = _projection_input(factors[1 - i], ctx, module)
            return (ia is not None and ia == ib_) or _conditionally_projected(module, a.gate, a.ctx, ib_)
        found = [(i, a) for i, a in found if glu_like(i, a)]
    if len(found) > 1 and any(a.weak for _, a in found):
        # an imported builder's object (`self.up = build_fc(...)`) is no activation beside a known one
        found = [(i, a) for i, a in found if not a.weak]
    if len(found) > 1 and all(a.kind == CONFIG for _, a in found):
        # two callables handed to __init__ (torchtune: self.w3 = up_proj, self.activation =
        # activation): the one whose default is an activation is the activation
        known = [(i, a) for i, a in found if a.default is not None]
        if len(known) == 1:
            found = known
    act: Act | None = None
    used: set[int] = set()
    if len(factors) == 2 and len(found) == 1 and found[0][1].kind != SIGMOID:
        i, act = found[0]
        used = {i}
    elif len(factors) == 3:
        sig = [(i, a) for i, a in found if a.kind == SIGMOID]
        if len(sig) == 1 and len(found) == 1:
            i, s = sig[0]
            inner, ictx = S.peel(s.sigmoid_arg, s.ctx)  # type: ignore[arg-type]
            skey = S.key(inner, ictx)
            quick = None
            scaled: tuple[str, Any] | None = None  # s36: `g * x * sigmoid(beta * x)`, beta defaulting to 1
            if isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Mult):
                for c0, other in ((inner.left, inner.right), (inner.right, inner.left)):
                    if const_value(c0) == 1.702:
                        quick = S.key(other, ictx)
                    elif scaled is None:
                        unit = _s36_unit_beta(module, c0, ictx)
                        if unit is not None:
                            scaled = (S.key(other, ictx), unit)
            for j, f in enumerate(factors):
                if j == i:
                    continue
                k = S.key(f, ctx)
                if k == skey:
                    act = Act(SILU, f, ctx, "torch.sigmoid(a) * a", kernels=2)
                elif quick is not None and k == quick:
                    act = Act(QUICK_GELU, f, ctx, "a * torch.sigmoid(1.702 * a)", kernels=3)
                elif scaled is not None and k == scaled[0]:
                    act = scaled[1](f, "a * torch.sigmoid(beta * a)")
                if act is not None:
                    used = {i, j}
                    break
    if act is None or act.gate is None:
        return None
    for i in used:
        trace.stmts.update(factor_traces[i].stmts)
        trace.conditional += factor_traces[i].conditional
    chosen.append(act)
    rest = [k for k in range(len(factors)) if k not in used]
    if len(rest) != 1:
        return None
    b = factors[rest[0]]
    a = act.gate
    actx = act.ctx
    # halves of one tensor?
    sa = _split_of(module, a, actx, trace)
    sb = _split_of(module, b, ctx, trace)
    halves = None
    if sa is not None and sb is not None and ("part" in (sa[5], sb[5]) or "interleaved" in (sa[5], sb[5])):
        if sa[5] != sb[5] or sa[0] != sb[0] or S.key(sa[3], sa[2]) != S.key(sb[3], sb[2]) or sa[4] == sb[4]:
            raise GateMiss("gate and up are not two parts of one chunk along one dim")
        if not (sa[6] and sb[6]):
            raise GateMiss("gate or up is the last part of a chunk, which is shorter than the others when the size does "
                           "not divide evenly (the product then broadcasts; the fused op would split wrongly)")
        # two equal parts of one tensor: the fused op takes them concatenated (exact for any dim)
        return Gate(act, Operand(a, actx), Operand(b, ctx), node, None, trace, sa[0], parts="chunk" if sa[5] == "part" else "interleaved")
    if sa is not None and sb is not None and "sized" in (sa[5], sb[5]):
        if sa[5] != sb[5] or sa[0] != sb[0] or S.key(sa[3], sa[2]) != S.key(sb[3], sb[2]) or sa[4] == sb[4]:
            raise GateMiss("gate and up are not two parts of one split along one dim")
        (ka, ta), (kb, tb_) = sa[6], sb[6]  # type: ignore[misc]
        if ka != kb:
            raise GateMiss(f"gate and up are split parts of sizes {ta} and {tb_}, not provably equal: the fused op "
                           "halves its input, so act(a) * b must have two equal-width operands")
        # two parts of one size: the fused op takes them concatenated (exact for any positions)
        return Gate(act, Operand(a, actx), Operand(b, ctx), node, None, trace, sa[0], parts="split")
    if sa is None or sb is None:
        # s44: two equal-width slices of one tensor's last axis, one cut at both ends (``t[..., w:2 * w]``)
        sliced = _swiglu_s44sweep.equal_width_slices(a, actx, b, ctx)
        if sliced is not None:
            return Gate(act, Operand(a, actx), Operand(b, ctx), node, None, trace, sliced, parts="split")
    if sa is not None and sb is not None and sa[0] == sb[0]:
        if sa[5] == "slice":
            (ka, ba), (kb, bb) = sa[4], sb[4]  # type: ignore[misc]
            if ba != bb or {ka, kb} != {"first", "second"}:
                raise GateMiss("gate and up slices do not split one tensor in two")
            gi = 0 if ka == "first" else 1
        else:
            if S.key(sa[3], sa[2]) != S.key(sb[3], sb[2]):
                raise GateMiss("gate and up split along different dims")
            if {sa[4], sb[4]} != {0, 1}:
                raise GateMiss("gate and up are not the two halves of one split")
            gi = int(sa[4])  # type: ignore[arg-type]
        halves = Halves(sa[1], sa[2], sa[3], sa[2], gi, sa[5], bool(sa[6]))
        return Gate(act, Operand(a, actx), Operand(b, ctx), node, halves, trace, None)
    if sa is not None and sb is not None:
        raise GateMiss("gate and up are halves of different tensors")
    if sa is None and sb is None:
        # s44: ``act(T[0]) * T[1]``: the two leading rows of one tensor, halves of ``T[:2]`` along dim 0
        lead = _swiglu_s44.leading_pair(a, actx, b, ctx)
        if lead is not None:
            halves = Halves(lead.tensor, lead.ctx, ast.Constant(0), lead.ctx, lead.gate_index, _swiglu_s44.LEADING_PAIR, True)
            return Gate(act, Operand(a, actx), Operand(b, ctx), node, halves, trace, None)
    ia = _projection_input(a, actx, module)
    ib = _projection_input(b, ctx, module)
    if ia is None or ib is None:  # s46h: a name bound in both arms of an if / else to projections of one input
        ia = ia if ia is not None else _swiglu_s46h.branch_projection_input(module, a, actx, _projection_input)
        ib = ib if ib is not None else _swiglu_s46h.branch_projection_input(module, b, ctx, _projection_input)
    if ia is None or ib is None or ia != ib:
        ia, ib = _summed_projection_input(a, actx, module) or ia, _summed_projection_input(b, ctx, module) or ib
    if ia is None or ib is None or ia != ib:
        ia, ib = _s28_weight_held_input(a, actx, b, ctx) or _s28_same_shard_input(module, a, actx, b, ctx) or (ia, ib)
    if (ia is None or ib is None or ia != ib) and act.kind in (SILU, CONFIG) + GELU_KINDS:
        biased = _biased_halves(module, a, actx, b, ctx)
        if biased is not None:
            # the current values of the two names: the fused op takes them concatenated (exact)
            return Gate(act, Operand(a, actx), Operand(b, ctx), node, None, trace, biased)
    if ia is None or ib is None or ia != ib:
        if act.kind in (SILU, CONFIG) + GELU_KINDS:
            conditional = _conditionally_transformed_gate(module, act, a, actx, b, ctx, node, trace, ia, ib) \
                or _elementwise_transformed_gate(module, act, a, actx, b, ctx, node, trace)
            if conditional is not None:
                return conditional
            kernel = _s37_transformed_kernel(module, a, actx, b, ctx, node)
            if kernel is not None:
                g = Gate(act, Operand(a, actx), Operand(b, ctx), node, None, trace, None, caller_lines=[], shape_checked=True,
                         elementwise=True)
                g.s28_kernel = kernel  # type: ignore[attr-defined]
                return g
            through = _s38_params_through_transforms(module, act, a, actx, b, ctx, node, trace)
            if through is not None:
                return through
            whys = [w for w in (_transformed(module, op, octx, other) for op, octx, other in ((a, actx, ib), (b, ctx, ia))) if w]
            if whys:
                # s38: an operand transformed by more than an independent elementwise step is the reason, before
                # the other operand's plain scale (a biased projection beside a residual sum)
                raise GateMiss(next((w for w in whys if "something other than" in w), whys[0]))
            callers = _caller_operands(module, a, actx, b, ctx)
            if isinstance(callers, list):
                return Gate(act, Operand(a, actx), Operand(b, ctx), node, None, trace, None, caller_lines=callers)
            if isinstance(callers, str) and ("unknown" in callers or _s28_passthrough_callers(module, a, actx, b, ctx)) \
                    and _s28_glu_kernel(ctx.scope, node):
                g = Gate(act, Operand(a, actx), Operand(b, ctx), node, None, trace, None, caller_lines=[])
                g.s28_kernel = callers  # type: ignore[attr-defined]
                return g
            scale = _s42_scale_factor(module, b, ctx) or _s42_scale_factor(module, a, actx)
            if not callers and scale:
                raise GateMiss(scale)
            unpacked = None if callers else _s43_unpacked_from_one_call(a, actx, b, ctx, node.lineno)
            raise GateMiss(callers or unpacked or _swiglu_s47review.unread_products(a, actx, b, ctx, ia, ib, S.peel)
                           or _reasons_s46.gate_inputs_unproven((a, S.peel(a, actx)[0]), (b, S.peel(b, ctx)[0]), ctx.scope.node))
        if act.kind.startswith("swish with beta"):  # GPT-OSS's clamped z * sigmoid(alpha * z) GLU: a look-alike
            raise GateMiss(f"activation is a {act.kind}{'' if _S40_UNSHOWN in act.kind else ', not silu'}: npu_swiglu computes silu(gate) * up only "
                           "(GPT-OSS's clamped form is npu_clipped_swiglu, not an npufuse pattern)")
        return None
    _one_value_check(a, actx, b, ctx)
    if isinstance(b, ast.Name):
        # CpmAnt's ``x = self.w_1(x)`` before ``gate * x``: the statement rebinding the
        # projections' input joins the fused region; kept verbatim it would clobber x for the gate
        d = S.definition(ctx, b.id)
        if d is not None and d[1] is not None and b.id in S.names_read(d[1]) and not _binds_gate_too(d[0], a):
            S.peel(b, ctx, trace)
    return Gate(act, Operand(a, actx), Operand(b, ctx), node, None, trace, ia)


def _s38_param_origin(module: ModuleInfo, node: ast.expr, ctx: S.Ctx, avoid: set[str]) -> tuple[str, int] | None:
    """The parameter an operand starts from, and how many steps lead there: elementwise transforms
    (``self.umup_mult * x``, see :func:`_transform_origin`) and rebindings of the parameter by a call
    of itself in the function's own body (``x = scale_bwd(x, s)``: whatever the call computes, the
    product multiplies its result, which the fused op takes as it is). None when the operand starts
    anywhere else, or a rebinding reads the other operand or sits under control flow."""
    fn = ctx.scope.node
    if ctx.depth or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    n, c, steps = _transform_origin(module, node, ctx, avoid)
    for _ in range(8):
        if not isinstance(n, ast.Name) or n.id not in ctx.scope.args:
            return None
        d = S.definition(c, n.id)
        if d is None:
            return n.id, steps
        st, value = d
        if value is None or not any(st is top for top in fn.body) or not isinstance(value, ast.Call) \
                or sum(isinstance(x, ast.Name) and x.id == n.id for x in value.args) != 1 \
                or (S.names_read(value) & avoid) - {n.id}:
            return None
        n, c, steps = ast.Name(id=n.id, ctx=ast.Load()), c.at(st.lineno), steps + 1
        n, c, more = _transform_origin(module, n, c, avoid)
        steps += more
    return None


def _s38_params_through_transforms(module: ModuleInfo, act: Act, a: ast.expr, actx: S.Ctx, b: ast.expr, ctx: S.Ctx,
                                   node: ast.expr, trace: S.Trace) -> Gate | None:
    """Gate and up are two parameters of the function holding the product, each first passed through
    calls of itself or scaled (Aleph-Alpha scaling's u-muP SwiGLU: ``x = scale_bwd(x, s); gate =
    scale_bwd(gate, s)``, then ``silu(x) * gate`` or ``silu(self.umup_mult * x) * gate / self.umup_mult``).
    ``act(a) * b`` is ``npu_swiglu(cat([a, b], -1))`` on the values at the product whenever they have one
    shape, so the fused branch checks the shapes and the statements before stay as written. A GLU
    when every call of the function in this module passes projections (or halves) of one input; else
    the reason says what the callers pass. None when the operands are not such parameters."""
    avoid = {n.id for n in (a, b) if isinstance(n, ast.Name)}
    oa, ob = _s38_param_origin(module, a, actx, avoid), _s38_param_origin(module, b, ctx, avoid)
    if oa is None or ob is None or oa[0] == ob[0] or oa[1] + ob[1] == 0:
        return None
    callers = _callers_pass_projections(module, oa[0], ob[0], ctx)
    if callers is None:
        return None
    if isinstance(callers, str):
        raise GateMiss(callers.replace("gate and up are parameters of", f"gate and up are the parameters `{oa[0]}` and `{ob[0]}` "
                                       "(transformed before the product) of", 1))
    return Gate(act, Operand(a, actx), Operand(b, ctx), node, None, trace, None, caller_lines=callers)


def _param_operand(node: ast.expr, ctx: S.Ctx) -> str | None:
    """The parameter name an operand is, when it is a parameter of the scanned function not
    reassigned before the product (``x1`` in ``def _gating(self, x1, x3): return F.silu(x1) * x3``)."""
    if ctx.depth or not isinstance(node, ast.Name) or node.id not in ctx.scope.args:
        return None
    return node.id if S.definition(ctx, node.id) is None else None


def _call_sites(module: ModuleInfo, fn: ast.AST, is_method: bool, class_name: str | None) -> tuple[list[tuple[ast.Call, Scope]], int | None]:
    """Direct calls of ``fn`` in this module (a method: ``<receiver>.<name>(...)`` from the same
    class's methods, the receiver being their first parameter; a module-level function: ``name(...)``),
    and the line of a reference that is not a direct call (the function passed on or stored:
    its callers are then unknown), else None."""
    name = getattr(fn, "name", "")
    calls: list[tuple[ast.Call, Scope]] = []
    other: int | None = None
    for sc in module.scopes:
        if sc.node is fn or isinstance(sc.node, ast.Module) and is_method:
            continue
        if is_method and sc.class_name != class_name:
            continue
        recv = sc.args[0] if is_method and sc.args else None
        if is_method and recv is None:
            continue
        text = S.scope_text(module, sc) if not isinstance(sc.node, ast.Module) else module.source
        if name not in text:
            continue
        funcs: set[int] = set()
        nodes = [n for n in fast_walk(sc.node) if n is not sc.node] if not isinstance(sc.node, ast.Module) else \
            [n for st in sc.body if not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in fast_walk(st)]
        for n in nodes:
            if isinstance(n, ast.Call):
                f = n.func
                if (is_method and isinstance(f, ast.Attribute) and f.attr == name and isinstance(f.value, ast.Name) and f.value.id == recv) \
                        or (not is_method and isinstance(f, ast.Name) and f.id == name and f.id not in sc.args and not sc.assignments.get(name)):
                    calls.append((n, sc))
                    funcs.add(id(f))
        for n in nodes:
            if id(n) in funcs:
                continue
            if (is_method and isinstance(n, ast.Attribute) and n.attr == name and isinstance(n.value, ast.Name) and n.value.id == recv) \
                    or (not is_method and isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)):
                other = other or n.lineno
    return calls, other


def _caller_operands(module: ModuleInfo, a: ast.expr, actx: S.Ctx, b: ast.expr, ctx: S.Ctx) -> list[int] | str | None:
    """Gate and up are both parameters of the function holding the product (a gating helper,
    ``self._gating(self.w1(x), self.w3(x))``): what the module's own calls pass them decides
    whether it is a GLU MLP. The lines of those calls when every one passes two projections of
    one input (or the two halves of one tensor); else the true reason it is not (a string), or
    None when the operands are not two parameters."""
    pa, pb = _param_operand(a, actx), _param_operand(b, ctx)
    if pa is None or pb is None or pa == pb:
        return None
    return _callers_pass_projections(module, pa, pb, ctx)


def _callers_pass_projections(module: ModuleInfo, pa: str, pb: str, ctx: S.Ctx) -> list[int] | str | None:
    """What the module's calls of the function holding the product pass its parameters ``pa`` and
    ``pb`` (see :func:`_caller_operands`): the calls' lines when every one passes projections (or the
    two halves) of one input, else the true reason (a string), None when its callers are not looked for."""
    fn = ctx.scope.node
    cls = ctx.scope.class_name
    is_method = cls is not None and cls in module.classes and any(x is fn for x in module.classes[cls].body)
    if is_method and any(module.canonical(d) in ("staticmethod", "classmethod") for d in getattr(fn, "decorator_list", [])):
        return None
    if not is_method and module.functions.get(getattr(fn, "name", "")) is not fn:
        return None  # a nested function: its calls are not looked for
    where = f"`{getattr(fn, 'name', '?')}`"
    calls, other = _call_sites(module, fn, is_method, cls)
    if other is not None:
        return (f"gate and up are parameters of {where}, which is also referenced without a direct call (line {other}): "
                "what its callers pass is unknown, so it may be a gated output, not a GLU MLP")
    if not calls:
        return (f"gate and up are parameters of {where} and no call in this module passes them: whether its callers pass "
                "projections of one input is unknown (a gated output, not a GLU MLP, otherwise)")
    lines = []
    for call, sc in calls:
        cctx = S.Ctx(sc, call.lineno)
        hctx = S.bind_call(module, call, fn, cctx, is_method)
        if hctx is None or pa not in hctx.bind or pb not in hctx.bind:
            return f"gate and up are parameters of {where}; the call on line {call.lineno} passes them in a form npufuse cannot bind (*args/**kwargs)"
        (ga, gctx), (ub, uctx) = hctx.bind[pa], hctx.bind[pb]
        ia, ib = _projection_input(ga, gctx, module), _projection_input(ub, uctx, module)
        if ia is not None and ia == ib:
            lines.append(call.lineno)
            continue
        try:
            sa, sb = _split_of(module, ga, gctx, S.Trace()), _split_of(module, ub, uctx, S.Trace())
        except GateMiss:
            sa = sb = None
        if sa is not None and sb is not None and sa[0] == sb[0] and sa[5] in ("chunk", "split") and sa[5] == sb[5] \
                and {sa[4], sb[4]} == {0, 1} and S.key(sa[3], sa[2]) == S.key(sb[3], sb[2]):
            lines.append(call.lineno)
            continue
        return (f"gate and up are parameters of {where}; the call on line {call.lineno} passes `{ast.unparse(ga)}` and "
                f"`{ast.unparse(ub)}`, not projections of one input (a gated output, not a GLU MLP)")
    return lines


# --------------------------------------------------------------------------------------------
# fused code


def _runtime_tests(module: ModuleInfo, act: Act, plan: S.SpanPlan | None) -> dict[str, str]:
    """Python conditions (no host sync) telling at run time which activation a config-chosen
    ``act`` is. Prefers the config string when the module keeps it; else the object's type
    (``ACT2FN["silu"]`` has been ``nn.SiLU``, ``SiLUActivation`` and a bare function across
    transformers releases, so all three are accepted)."""
    T = S.torch_name(module) or "torch"
    if act.config_key is not None:
        k = S.atom(S.render(module, act.config_key, act.ctx, plan))
        return {
            SILU: f"{k} in {ACT_CONFIG_SILU!r}",
            GELU: f"{k} in {ACT_CONFIG_GELU!r}",
            GELU_TANH: f"{k} in {ACT_CONFIG_GELU_TANH!r}",
        }
    assert act.obj is not None
    o = S.atom(S.render(module, act.obj, act.ctx, plan))

    # functools.partial(F.gelu, approximate="tanh") (megablocks/llm-foundry defaults): its func and
    # keywords say what it computes; no positional arguments bound
    def partial_of(fn: str, keywords: str) -> str:
        return (f'(type({o}).__name__ == "partial" and getattr({o}, "func", None) is {T}.nn.functional.{fn} '
                f'and not {o}.args and {o}.keywords in {keywords})')
    p_silu = partial_of("silu", '({}, {"inplace": False})')
    p_gelu = partial_of("gelu", '({}, {"approximate": "none"})')
    p_tanh = partial_of("gelu", '({"approximate": "tanh"},)')
    return {
        SILU: f'isinstance({o}, {T}.nn.SiLU) or type({o}).__name__ == "SiLUActivation" or {o} is {T}.nn.functional.silu or {p_silu}',
        GELU: f'(isinstance({o}, {T}.nn.GELU) and {o}.approximate == "none") or type({o}).__name__ == "GELUActivation" or {o} is {T}.nn.functional.gelu'
              f' or {p_gelu}',
        GELU_TANH: f'(isinstance({o}, {T}.nn.GELU) and {o}.approximate == "tanh") or type({o}).__name__ in ("NewGELUActivation", "PytorchGELUTanh", "GELUTanh", "FastGELUActivation", "AccurateGELUActivation")'
                   f' or {p_tanh}',
    }


def fused_expr(module: ModuleInfo, g: Gate, kind: str, plan: S.SpanPlan, approx_code: str | None = None) -> str:
    """The fused expression replacing ``act(a) * b`` for activation ``kind`` (silu or a gelu)."""
    T = S.torch_name(module) or "torch"
    if g.halves is not None and g.halves.how == _swiglu_s44.LEADING_PAIR:
        h = g.halves
        original = S.render(module, g.node, g.b.ctx, plan)  # the product as written, its names as the plan has them
        if kind == SILU:
            call = ("torch_npu.npu_swiglu({t}.contiguous(), dim=0)" if h.gate_index == 0
                    else f"torch_npu.npu_swiglu({T}.cat({{t}}.chunk(2, dim=0)[::-1], dim=0), dim=0)")
        else:
            call = f"torch_npu.npu_geglu({{t}}, dim=0, approximate={approx_code}, activate_left={h.gate_index == 0})[0]"
        return _swiglu_s44.fused_rows(S.render(module, h.tensor, h.ctx, plan), call, original, T)
    if g.halves is not None:
        h = g.halves
        t = S.render(module, h.tensor, h.ctx, plan)
        d = S.render(module, h.dim, h.dim_ctx, plan)
        tp = S.atom(t)  # decided on the rendered text: a name may render as its definition (`a + b`)
        if kind == SILU:
            if h.gate_index == 0:
                return f"torch_npu.npu_swiglu({tp}.contiguous(), dim={d})"
            # silu on the second half: swap the halves of the tensor, computed once (rendering the
            # two halves separately would evaluate `self.proj(x)` twice)
            return f"torch_npu.npu_swiglu({T}.cat({tp}.chunk(2, dim={d})[::-1], dim={d}), dim={d})"
        left = "True" if h.gate_index == 0 else "False"
        return f"torch_npu.npu_geglu({tp}, dim={d}, approximate={approx_code}, activate_left={left})[0]"
    a = S.render(module, g.a.node, g.a.ctx, plan)
    b = S.render(module, g.b.node, g.b.ctx, plan)
    if kind == SILU:
        return f"torch_npu.npu_swiglu({T}.cat([{a}, {b}], dim=-1), dim=-1)"
    return f"torch_npu.npu_geglu({T}.cat([{a}, {b}], dim=-1), dim=-1, approximate={approx_code}, activate_left=True)[0]"


def approx_code_of(module: ModuleInfo, act: Act, kind: str, plan: S.SpanPlan) -> str:
    if kind == GELU:
        return "0"
    if kind == GELU_TANH:
        return "1"
    assert act.approx is not None
    e = S.atom(S.render(module, act.approx, act.ctx, plan))  # `"tanh" if flag else "none"` pasted bare does not parse
    return f'(1 if {e} == "tanh" else 0)'


# --------------------------------------------------------------------------------------------
# scanning one scope (shared by swiglu and geglu)

GELU_KINDS = (GELU, GELU_TANH, GELU_DYN)


def owner(act: Act) -> str | None:
    """Which pattern reports a gated product with this activation."""
    if act.kind == SILU:
        return "swiglu"
    if act.kind in GELU_KINDS or "gelu" in act.kind:
        return "geglu"
    if act.kind == CONFIG:
        if act.default == SILU:
            return "swiglu"
        if act.default in GELU_KINDS or act.gelu_hint:
            return "geglu"
        return "swiglu"
    return "swiglu"  # other activations: swiglu reports "activation is not silu"


@dataclass
class GateResult:
    stmt: ast.stmt
    pattern: str
    finding: Finding | None = None
    miss: NearMiss | None = None


_ACT_WORDS = ("silu", "swish", "gelu", "sigmoid", "act", "glu", "relu", "tanh", "mish", "elu", "softplus")
# The same test with fewer searches: a text holding a word that contains another word of the
# list holds that one too ("gelu" and "relu" hold "elu"), and the most frequent word ("act")
# goes first, so a hit usually ends the search at once.
_ACT_SEARCH = tuple(sorted((w for w in _ACT_WORDS if not any(o != w and o in w for o in _ACT_WORDS)), key=lambda w: (w != "act", w)))


def _has_sequential_attr(module: ModuleInfo, class_name: str | None) -> bool:
    """The class keeps an ``nn.Sequential`` (whose last layer may be the activation: the forward
    then names no activation at all, as in ``self.fc1(x) * self.gate(x)``)."""
    return any(isinstance(v, ast.Call) and (dotted(v.func) or "").endswith("Sequential")
               for v in S.init_assignments(module, class_name).values())


def _has_built_activation_attr(module: ModuleInfo, scope: Scope, text: str) -> bool:
    """The forward calls ``self.<attr>(...)`` where ``__init__`` set ``attr`` from a call of a
    module-level builder whose body names an activation (``self.gating = _build_gate(kind)``
    returning ``nn.SiLU()`` / ``nn.GELU()`` / ``nn.Sigmoid()`` by a string): the forward's text then
    names no activation at all. classify_call reads the builder (one kind, or run-time dispatch)."""
    if scope.class_name is None or "self." not in text:
        return False
    params = S.init_params(module, scope.class_name)
    for attr, value in S.init_assignments(module, scope.class_name).items():
        if f"self.{attr}(" not in text:
            continue
        if isinstance(value, ast.Name) and value.id in params:
            # s36: ``self.a = activation_fn`` (an injected activation; FMS's GatedLinearUnit calls
            # ``self.a(wg)``): the parameter's name or its default names an activation
            default = params[value.id]
            said = value.id.lower() + (" " + S.source_of(module, default).lower() if default is not None else "")
            if any(w in said for w in _ACT_SEARCH):
                return True
            continue
        if isinstance(value, ast.Call) and any(w in (dotted(value.func) or "").lower() for w in _ACT_SEARCH):
            # s38: an activation module built in place under a name that says nothing (OFormer's GeGELU:
            # `self.fn = nn.GELU()`, forward `self.fn(x[..., :c // 2]) * x[..., c // 2:]`): the constructor
            # names it; classify_call reads what it computes
            return True
        if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Name):
            continue
        fn = module.functions.get(value.func.id)
        if fn is not None and any(w in S.source_of(module, fn).lower() for w in _ACT_SEARCH):
            return True
    return False


# how a product is spelled: `a * b`, `a.mul(b)`, `torch.mul(a, b)`, `t.mul_(b)`, `multiply`
_PRODUCT_WORDS = ("*", ".mul(", ".mul_(", "multiply")


def gate_results(module: ModuleInfo, scope: Scope) -> list[GateResult]:
    """Gated-activation findings and near misses of one scope, for both patterns (cached)."""
    cached = scope.__dict__.get("_npufuse_gates")
    if cached is not None:
        return cached
    results: list[GateResult] = []
    scope.__dict__["_npufuse_gates"] = results
    # (s43: the module's own statements too: a script's or an ``if __name__ == "__main__":`` block's gated product;
    # function and class bodies are their own scopes)
    if not any(w in S.scope_text(module, scope) for w in _PRODUCT_WORDS):
        return results
    if isinstance(scope.node, ast.Module) and not _swiglu_s43.module_statements_multiply(module, scope, _PRODUCT_WORDS):
        return results  # (most files: products only inside functions, read in their own scopes)
    text = S.scope_text(module, scope).lower()
    if not any(w in text for w in _ACT_SEARCH) and not _has_sequential_attr(module, scope.class_name) \
            and not _has_built_activation_attr(module, scope, S.scope_text(module, scope)):
        return results
    lines = S.module_lines(module)
    for stmt in S.stmt_index(scope).stmts:
        aug = _augassign_product(stmt, module, scope)
        if not (S.simple_stmt(stmt) or aug is not None) or getattr(stmt, "value", None) is None:
            continue
        if not any(w in ln for ln in lines[stmt.lineno - 1 : stmt.end_lineno or stmt.lineno] for w in _PRODUCT_WORDS):
            continue
        branched = _s28_branch_act_results(module, scope, stmt)
        if branched is not None:
            results.extend(branched)
            continue
        gates: list[Gate] = []
        misses: list[tuple[str, str]] = []
        inside: list[ast.AST] = []
        aliased = _aliased_in_place(scope, stmt)
        if aliased is not None:
            # `saved = t; t *= act(g)` / `t.mul_(...)`: the original multiplies the tensor `saved` also
            # holds; the rewrite `t = <fused>` rebinds `t` only, so `saved` would keep the old value
            defined = aliased[2]
            stmt_text = "".join(lines[stmt.lineno - 1 : stmt.end_lineno or stmt.lineno]).lower() + \
                "".join(lines[defined.lineno - 1 : defined.end_lineno or defined.lineno]).lower()
            if any(w in stmt_text for w in _ACT_SEARCH):
                results.append(GateResult(stmt, "geglu" if "gelu" in stmt_text else "swiglu", miss=NearMiss(
                    "geglu" if "gelu" in stmt_text else "swiglu", scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno,
                    f"in-place product on `{aliased[0]}`, which another statement reads before it (line {aliased[1]}): "
                    f"the rewrite `{aliased[0]} = <fused>` rebinds the name, so that other reference would not see the product")))
            continue
        for node in [*([aug] if aug is not None else []), *S.iter_exprs_topdown(stmt.value)]:  # type: ignore[attr-defined]
            if isinstance(node, ast.Call):
                node = _call_product(module, stmt, node)  # type: ignore[assignment]
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
                continue
            if any(any(n is node for n in fast_walk(m)) for m in inside):
                continue
            ctx = S.Ctx(scope, stmt.lineno)
            try:
                g = find_gate(module, node, ctx)
            except GateMiss as e:
                # only a look-alike if an activation is involved at all
                fs: list[ast.expr] = []
                _flatten_mul(node, fs)
                acts = [a for a in (_act_of(module, f, ctx, S.Trace()) for f in fs) if a is not None]
                if acts:
                    misses.append((owner(acts[0]) or "swiglu", e.reason))
                    inside.append(node)
                continue
            if g is None:
                continue
            saved = _saved_activation_reason(module, scope, g) or _inplace_alias_reason(module, scope, g) \
                or _unfusable_default_reason(module, scope, g.act) or _non_torch_reason(module) or getattr(node, "_npufuse_out_reason", None)
            if saved is not None:
                misses.append((owner(g.act) or "swiglu", saved))
                inside.append(node)
                continue
            inside.append(node)
            gates.append(g)
        for pat, reason in misses:
            results.append(GateResult(stmt, pat, miss=NearMiss(pat, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, reason)))
        if gates:
            results.extend(_site_results(module, scope, stmt, gates))
    if isinstance(scope.node, ast.Module):
        results[:] = [_swiglu_s43.module_level_result(module, scope, r) for r in results]
    return results


def _call_product(module: ModuleInfo, stmt: ast.stmt, call: ast.Call) -> ast.BinOp | None:
    """``a.mul(b)`` / ``torch.mul(a, b)`` as the product ``a * b`` (a node at the call's place, so
    the call's text is what the fused expression replaces); ``t.mul_(b)`` as a statement of its
    own as ``t = t * b`` (see :func:`_inplace_target`)."""
    if _out_product(module, call) is not None:
        return _out_product(module, call)
    if call.keywords or any(isinstance(a, ast.Starred) for a in call.args):
        return None
    f = call.func
    pair: tuple[ast.expr, ast.expr] | None = None
    if module.canonical(f) in ("torch.mul", "torch.multiply") and len(call.args) == 2:
        pair = (call.args[0], call.args[1])
    elif isinstance(f, ast.Attribute) and len(call.args) == 1 and not (isinstance(f.value, ast.Name) and f.value.id in module.aliases):
        if f.attr in ("mul", "multiply"):
            pair = (f.value, call.args[0])
        elif f.attr in ("mul_", "multiply_") and _inplace_target(stmt) is not None and isinstance(stmt, ast.Expr) and stmt.value is call:
            pair = (f.value, call.args[0])
        elif not (isinstance(stmt, ast.Expr) and stmt.value is call):
            pair = _fresh_inplace_product(module, call)  # `F.silu(self.w1(x), inplace=True).mul_(self.w3(x))` as a value
    if pair is None:
        return None
    return ast.BinOp(left=pair[0], op=ast.Mult(), right=pair[1], lineno=call.lineno, col_offset=call.col_offset,
                     end_lineno=call.end_lineno, end_col_offset=call.end_col_offset)


def _inplace_target(stmt: ast.stmt) -> str | None:
    """``t.mul_(b)`` as a whole statement: the name it updates in place. Rewritten as ``t = <fused>``:
    the same value under the same name; the tensor object differs, which only shows through another
    reference to it, and the product's operand ``t`` is the activation's fresh result (its one
    name, or the span that drops its statement is refused)."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Attribute) \
            and stmt.value.func.attr in ("mul_", "multiply_") and isinstance(stmt.value.func.value, ast.Name):
        return stmt.value.func.value.id
    if isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Mult) and isinstance(stmt.target, ast.Name):
        return stmt.target.id  # `t *= a` (see _augassign_product)
    return None


def _splice_product(module: ModuleInfo, stmt: ast.stmt, reps: list[tuple[ast.AST, str]]) -> str:
    """The statement with its gated products replaced; an in-place ``t.mul_(b)`` becomes ``t = ...``."""
    text = S.splice(module, stmt, reps)
    target = _inplace_target(stmt)
    return f"{target} = {text}" if target is not None else text


def _optional_gate(scope: Scope, stmt: ast.stmt, g: Gate) -> str | None:
    """``h = act(gate(x))`` for every path, then ``if <test>: h = h * up(x)`` (torchtune's
    FeedForward / LoRA experts with an optional up projection): the true reason it is not
    rewritten, or None when the product is not such an optional gate."""
    names = [n for n in (g.node.left, g.node.right) if isinstance(n, ast.Name)] if isinstance(g.node, ast.BinOp) else []
    # the name the activation was assigned to (its definition holds the activated operand): the
    # other factor's name (`up` of `gate, up = h.split(...)`, `gelu(gate) * up`) is no activation
    defs = [S.definition(S.Ctx(scope, stmt.lineno), n.id) for n in names]
    d = next((x for x in defs if x is not None and x[1] is not None and any(n is g.a.node for n in fast_walk(x[1]))), None)
    if d is None:
        return None
    parent = next((n for n in fast_walk(scope.node) if isinstance(n, ast.If) and any(x is stmt for x in n.body)), None)
    if parent is None or any(x is d[0] for x in parent.body):
        return None
    return (f"optional gate: the activation (line {d[0].lineno}) runs on every path and the product only under "
            f"`if {ast.unparse(parent.test)}:`; a correct rewrite must restructure both into if/else (fused op "
            "under the if, the activation alone otherwise; fusing the product alone would compute the gate "
            "projection twice), and npufuse cannot here")


@dataclass
class _OptionalBranch:
    """``h = act(gate(x))`` then ``if <test>: ...; h = h * up(x); ...`` rewritten as one if/else:
    the fused product (with the body's other statements, verbatim) under the test, the
    activation statements (verbatim) otherwise."""

    node: ast.If
    product: ast.stmt
    activation: list[ast.stmt]  # the statements computing the activation on every path, in order
    kept: list[ast.stmt]  # statements of the span's block emitted verbatim before the if/else

    def around(self, module: ModuleInfo, fused_product: str) -> str:
        body = [fused_product if s is self.product else S.stmt_source(module, s) for s in self.node.body]
        # s36: the if's own else branch (labml's `else: x = g`) runs after the activation, as it did
        orelse = S.block_source(module, self.activation) + ("\n" + S.block_source(module, self.node.orelse) if self.node.orelse else "")
        return "\n".join([f"if {S.source_of(module, self.node.test)}:", S.indent("\n".join(body)),
                          "else:", S.indent(orelse)])


def _s36_read_only_in(scope: Scope, names: set[str], where: list[ast.stmt]) -> bool:
    """Every read of ``names`` in the scope is inside ``where`` (labml's ``g = act(l1(x))`` read by
    the gated product and by the ``else: x = g`` branch only: the fused branch need not compute it)."""
    inside = {id(n) for st in where for n in fast_walk(st)}
    return not any(isinstance(n, ast.Name) and n.id in names and isinstance(n.ctx, ast.Load) and id(n) not in inside
                   for n in fast_walk(scope.node))


# what an optional gate's `if` may test: it is evaluated once, before the gate projection
_PURE_TEST = (ast.Name, ast.Attribute, ast.Constant, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.Load,
              ast.Is, ast.IsNot, ast.Not, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
              ast.In, ast.NotIn, ast.Tuple)


def _optional_plan(module: ModuleInfo, scope: Scope, stmt: ast.stmt, g: Gate, trace: S.Trace) -> tuple[S.SpanPlan, _OptionalBranch] | str:
    """The span and if/else of an optional gate (see :func:`_optional_gate`), or why it cannot be
    restructured."""
    idx = S.stmt_index(scope)
    parent = idx.parent.get(id(stmt))
    if not isinstance(parent, ast.If) or not any(x is stmt for x in parent.body):
        return "the product is not directly in the body of the `if`"
    if parent.orelse and not isinstance(parent.orelse[0], ast.stmt):
        return "the `if` has an else branch"
    if not all(isinstance(n, _PURE_TEST) for n in fast_walk(parent.test)):
        return "the `if` test is not a plain comparison of names and attributes"
    plan = S.plan_span(scope, parent, trace)
    if isinstance(plan, str):
        return plan
    written = set().union(*(S.names_written(s) for s in plan.dropped)) if plan.dropped else set()
    for s in parent.body:
        if s is stmt:
            continue
        if S.names_read(s) & written or S.names_written(s) & written:
            return f"another statement of the `if` body (line {s.lineno}) uses the activation's names"
    if not written <= S.names_written(stmt) and not _s36_read_only_in(scope, written - S.names_written(stmt), [stmt, *plan.dropped, *parent.orelse]):
        return "the activation's names are not all overwritten by the product"
    if S.names_read(parent.test) & written:
        return "the `if` test reads the activation's result"
    # kept statements now run before the activation statements (moved into the else branch)
    read_by_activation = set().union(*(S.names_read(s) for s in plan.dropped)) if plan.dropped else set()
    for s in plan.kept:
        if S.names_written(s) & read_by_activation:
            return f"line {s.lineno} changes what the activation reads"
    # the body's other statements run before the fused product, inside the `if`: names they
    # assign may appear in it (a render plan that counts them as kept); emitted by `around`
    others = [x for x in parent.body if x is not stmt]
    render_plan = dataclasses.replace(plan, kept=sorted([*plan.kept, *others], key=lambda x: x.lineno))
    return render_plan, _OptionalBranch(parent, stmt, list(plan.dropped), list(plan.kept))


def _outer_split(scope: Scope, stmt: ast.stmt, g: Gate, trace: S.Trace) -> S.Trace | None:
    """``gate, up = h.split(...)`` in an enclosing block, the product in a nested branch
    (``if act == GELU: out = gelu(gate) * up else: out = silu(gate) * up``): the trace without
    that split, which stays where it is written (a view, no kernel; its names keep their values).
    The fused op reads the split tensor itself, so its name must hold at the product the value
    the split read (no assignment in between), and every statement left out must be such a
    split of an enclosing block. None when the trace has anything else outside the product's block."""
    if g.halves is None or not isinstance(g.halves.tensor, ast.Name):
        return None
    idx = S.stmt_index(scope)
    enclosing = {id(idx.block[id(a)][0]) for a in [stmt, *S.ancestors(idx, stmt)] if id(a) in idx.block}
    own = idx.block.get(id(stmt), (None, 0))[0]
    inner = S.Trace(conditional=list(trace.conditional))
    left_out = 0
    for key, t in trace.stmts.items():
        loc = idx.block.get(id(t))
        if loc is None:
            return None
        if loc[0] is own or any(a is stmt for a in S.ancestors(idx, t)):
            inner.stmts[key] = t
            continue
        if id(loc[0]) not in enclosing or not S._is_cheap(t) or not isinstance(t, ast.Assign):
            return None
        name = g.halves.tensor.id
        if name not in S.names_read(t.value) or name in S.names_written(t):
            return None
        at_split, at_product = S.definition(S.Ctx(scope, t.lineno), name), S.definition(S.Ctx(scope, stmt.lineno), name)
        if at_split is None or at_product is None or at_split[0] is not at_product[0]:
            return None
        left_out += 1
    return inner if left_out else None


def _site_results(module: ModuleInfo, scope: Scope, stmt: ast.stmt, gates: list[Gate]) -> list[GateResult]:
    pat = owner(gates[0].act) or "swiglu"

    def miss(reason: str) -> list[GateResult]:
        return [GateResult(stmt, pat, miss=NearMiss(pat, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, reason))]

    g0 = gates[0]
    kind = g0.act.kind
    if kind not in (SILU, CONFIG) + GELU_KINDS:
        if kind == QUICK_GELU:
            return miss("quick_gelu (x * sigmoid(1.702 x)) is not gelu: npu_geglu has erf/tanh gelu only (npu_fast_gelu covers the activation alone)")
        if "gelu" in kind:
            return miss(f"gelu variant `{kind}` cannot be mapped: npu_geglu computes approximate=0 (erf) or 1 (tanh) only")
        if kind.startswith("swish with beta") and _S40_UNSHOWN in kind:
            # s40: beta may be 1 at run time, but nothing read shows it: not "not silu"
            return miss(f"activation is a {kind}: npu_swiglu computes silu(gate) * up (beta 1) only")
        if kind == _REASSIGNED:
            return miss(f"{g0.act.describe}, outside __init__: the activation called here may not be the one __init__ "
                        "assigned, so no fused gated op is known to compute it")
        if kind == _OWN_FORMULA:
            return miss(f"the activation is the module's own class ({g0.act.describe}), a formula npufuse does not read as "
                        "silu or as gelu (erf / tanh): no fused gated op is known to compute it")
        return miss(f"activation is not silu ({kind}{': ' + g0.act.describe if g0.act.describe else ''}) and not gelu: no fused gated op")
    if any(g.act.kind != kind for g in gates):
        return miss("several gated products with different activations in one statement")
    done = S.already_fused(module, scope, stmt)
    if done:
        return miss(done)
    trace = S.Trace()
    for g in gates:
        trace.stmts.update(g.trace.stmts)
    plan = S.plan_span(scope, stmt, trace)
    if plan == S.OTHER_BLOCK:
        outer = _outer_split(scope, stmt, g0, trace)
        if outer is not None:
            plan = S.plan_span(scope, stmt, outer)
    branch: _OptionalBranch | None = None
    if isinstance(plan, str):
        optional = _optional_gate(scope, stmt, g0)
        if optional is None:
            return miss(plan)
        opt = _optional_plan(module, scope, stmt, g0, trace)
        if isinstance(opt, str):
            return miss(f"{optional} ({opt})")
        plan, branch = opt
    dropped = set().union(*(S.names_written(s) for s in plan.dropped)) if plan.dropped else set()
    inner = {id(n) for g in gates for n in fast_walk(g.node)}
    outside = {n.id for n in fast_walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and id(n) not in inner} & dropped
    if outside:
        return miss(f"intermediate `{sorted(outside)[0]}` is also read elsewhere in the statement, outside the gated product the fused op replaces")
    guard = _guard(module, g0, plan)
    if guard is None:
        return miss("no input tensor live before the site to guard the fused branch on")
    guard = _s28_element_guard(g0, guard, plan)
    half_check: str | None = None
    kept = [S.stmt_source(module, s) for s in (branch.kept if branch else plan.kept)]
    kept_first, kept = (kept, []) if g0.shape_checked and branch is None else ([], kept)  # before the shape check
    try:
        if kind == CONFIG:
            tests = _runtime_tests(module, g0.act, plan)
            branches = []
            order = [SILU, GELU, GELU_TANH] if pat == "swiglu" else [GELU, GELU_TANH, SILU]
            for k in order:
                root = _splice_product(module, stmt, [(g.node, fused_expr(module, g, k, plan, approx_code_of(module, g.act, k, plan) if k != SILU else None)) for g in gates])
                branches.append((tests[k], root))
            body = []
            for i, (test, root) in enumerate(branches):
                body.append(f"{'if' if i == 0 else 'elif'} {test}:")
                body.append(S.indent("\n".join(kept + [branch.around(module, root) if branch else root])))
            body.append("else:  # an activation the fused ops do not compute: the original code")
            body.append(S.indent(_replaced_source(module, plan) if kept_first else S.block_source(module, plan.stmts)))
            fused = "\n".join(body)
        else:
            ak = approx_code_of(module, g0.act, kind, plan) if kind in GELU_KINDS else None
            root = _splice_product(module, stmt, [(g.node, fused_expr(module, g, SILU if kind == SILU else kind, plan, ak)) for g in gates])
            fused = "\n".join(kept + [branch.around(module, root) if branch else root])
        if g0.shape_checked:
            fused = _shape_checked_fused(module, g0, plan, fused, kept_first)
        if g0.caller_lines or getattr(g0, "s28_kernel", None):
            # operands handed in by callers: a caller elsewhere may pass a broadcasting pair, which
            # torch.cat rejects; equal shapes (a host-side check, no sync) take the fused op
            ga, gb = (S.atom(S.render(module, op.node, op.ctx, plan)) for op in (g0.a, g0.b))
            fused = "\n".join([f"if {ga}.shape == {gb}.shape:", S.indent(fused),
                               "else:  # operands that broadcast: the original code",
                               S.indent(S.block_source(module, plan.stmts))])
        half_check = _s28_half_size_check(module, g0, plan) if not g0.shape_checked and g0.caller_lines is None else None
        if half_check is not None:
            fused = "\n".join([f"if {half_check}:", S.indent(fused),
                               "else:  # the split size is not half the dim: the original code",
                               S.indent(S.block_source(module, plan.stmts))])
        beta_check = _s36_beta_check(module, g0, plan)
        if beta_check is not None:
            fused = "\n".join([f"if {beta_check}:", S.indent(fused),
                               "else:  # a swish with another beta (or a tensor beta): the original code",
                               S.indent(S.block_source(module, plan.stmts))])
    except S.RenderError as e:
        return miss(f"cannot express the replacement at the site: {e}")
    params = _params(module, g0, plan, pat)
    risks, notes = _risks(g0, pat)
    if half_check is not None:
        _s28_note_half_check(params, risks, notes, half_check)
    if beta_check is not None:
        params["beta_check"] = beta_check
        notes.append(f"the activation is a swish z * sigmoid(beta * z) whose beta defaults to 1: the fused op (silu) runs "
                     f"where `{beta_check}` holds, the original code otherwise")
    if g0.shape_checked:
        notes.append(_ELEMENTWISE_NOTE if g0.elementwise else
                     _CONDITIONAL_NOTE.format(name=ast.unparse(g0.a.node) if isinstance(g0.a.node, ast.Name) else ast.unparse(g0.b.node)))
    if getattr(g0, "s28_kernel", None):
        _s28_note_kernel(params, risks, notes, scope, g0)
    if g0.caller_lines:
        params["operands_from_callers"] = list(g0.caller_lines)
        notes.append(f"gate and up are parameters of `{scope.qualname}`: every call of it in this module (line(s) "
                     f"{', '.join(map(str, g0.caller_lines))}) passes projections (or halves) of one input; the fused op "
                     "runs when both have one shape, the original code otherwise")
        if any(module.canonical(d.func if isinstance(d, ast.Call) else d) == "torch.compile" for d in getattr(scope.node, "decorator_list", [])):
            risks.append(Risk("other", "the helper is compiled with @torch.compile: the fused branch (its is_npu / environment "
                                       "switch tests and the torch_npu call) is traced by dynamo; torch_npu's ops are "
                                       "registered torch ops, but check the compiled graph on the device"))
    if branch is not None:
        params["optional_gate"] = ast.unparse(branch.node.test)
        notes.append(f"optional up projection: fused under `if {params['optional_gate']}:`, the activation alone otherwise "
                     f"(lines {plan.line}-{plan.end_line} restructured into if/else; the gate projection runs once on either path)")
    variant = ("halves_" + ("gate_first" if g0.halves.gate_index == 0 else "gate_second")) if g0.halves else "two_projections"
    f = Finding(
        pattern=pat,
        qualname=scope.qualname,
        line=plan.line,
        end_line=plan.end_line,
        params=params,
        fused=fused,
        guard_tensor=guard,
        confidence="high" if kind != CONFIG else "medium",
        variant=variant,
        risks=risks,
        notes=notes,
        training_ok=True,
    )
    return [GateResult(stmt, pat, finding=f)]


def _guard(module: ModuleInfo, g: Gate, plan: S.SpanPlan) -> str | None:
    """A tensor name live at the span start: the split tensor or the projections' input."""
    exprs: list[tuple[ast.expr, S.Ctx]] = []
    if g.halves is not None:
        root = g.halves.tensor
        while isinstance(root, ast.Call) and isinstance(root.func, ast.Attribute):
            root = root.func.value  # x.view(b, s, -1): the tensor x, not the size b
        exprs += [(root, g.halves.ctx), (g.halves.tensor, g.halves.ctx)]
    exprs += [(g.a.node, g.a.ctx), (g.b.node, g.b.ctx)]
    skip = set(module.aliases) | set(module.functions) | set(module.classes) | {"self", "cls"}
    seen: set[int] = set()
    stack = list(exprs)
    while stack:
        node, ctx = stack.pop(0)
        if id(node) in seen:
            continue
        seen.add(id(node))
        for n in fast_walk(node):
            if not isinstance(n, ast.Name) or n.id in skip or not isinstance(n.ctx, ast.Load):
                continue
            d = S.definition(ctx, n.id)
            if d is None and n.id in ctx.bind:
                stack.append(ctx.bind[n.id])
                continue
            if d is not None and plan.is_dropped(d[0]):
                stack.append((d[1], ctx.at(d[0].lineno)))
                continue
            if (d is None and n.id in ctx.scope.args) or (d is not None and d[0].lineno < plan.line):
                if not plan.kept_writes_after(n.id, 0):
                    return n.id
    return None


def _params(module: ModuleInfo, g: Gate, plan: S.SpanPlan, pat: str) -> dict[str, Any]:
    act = g.act
    p: dict[str, Any] = {
        "activation": act.kind if act.kind != CONFIG else "config",
        "activation_source": act.describe,
        "activation_kernels": act.kernels,
        "conditional": act.kind == CONFIG,
        "gate": _as_written(module, g.a, plan),
        "up": _as_written(module, g.b, plan),
    }
    if act.kind == CONFIG:
        p["runtime_check"] = "config string" if act.config_key is not None else "activation type"
        if act.config_key is not None:
            p["config_key"] = S.render(module, act.config_key, act.ctx, plan)
        if act.default is not None:
            # what the code picks when nobody passes another: decides the pattern id; the code still dispatches
            p["default_activation"] = act.default
        # the run-time dispatch runs npu_swiglu for a SiLU and npu_geglu for a GELU: the site is
        # either pattern, whichever id it is filed under (the object decides, not the scan)
        p["dispatches_to"] = ["swiglu", "geglu"]
    if g.halves is not None:
        h = g.halves
        p["source"] = "split"
        p["split"] = h.how
        p["split_tensor"] = S.render(module, h.tensor, h.ctx, plan)
        p["split_dim"] = const_value(h.dim) if const_value(h.dim) is not ... else S.render(module, h.dim, h.dim_ctx, plan)
        p["order"] = "gate_first" if h.gate_index == 0 else "up_first"
    else:
        p["source"] = "two_projections"
        p["split_dim"] = -1
        p["order"] = "gate_first"  # torch.cat([gate, up]) puts the activated half first
        if g.parts is not None and g.elementwise:
            p["operands"] = f"transformed {g.parts} parts"  # s50: the cost model's cat form, said as what it copies
    if pat == "geglu":
        if act.kind == GELU:
            p["approximate"] = 0
        elif act.kind == GELU_TANH:
            p["approximate"] = 1
        elif act.kind == GELU_DYN:
            p["approximate"] = "runtime"
        else:
            p["approximate"] = "config"
            if act.default in (GELU, GELU_TANH):
                p["default_approximate"] = 0 if act.default == GELU else 1
        p["activate_left"] = (g.halves is None) or g.halves.gate_index == 0
    return p


def _as_written(module: ModuleInfo, op: Operand, plan: S.SpanPlan) -> str:
    """The operand as the user wrote it (for the report), rendered only if it is not in this scope."""
    if op.ctx.depth == 0 and getattr(op.node, "end_col_offset", None) is not None:
        return S.source_of(module, op.node)
    return S.render(module, op.node, op.ctx, plan)


def _risks(g: Gate, pat: str) -> tuple[list[Risk], list[str]]:
    risks: list[Risk] = [Risk("dtype", f"npu_{pat}: fp16/bf16/fp32 only (bf16 needs A2+)")]
    notes: list[str] = []
    if g.halves is None and g.parts == "interleaved":
        risks.append(Risk("other", "the even and odd columns of one projection taken as operands: the fused op needs [gate, up] "
                                   "in one tensor, so this adds a torch.cat copy of both (2 x T x I elements written and read "
                                   "again) and keeps it for backward; de-interleaving the projection's weight rows once "
                                   "([gate; up] order) lets the op take the projection itself"))
    elif g.halves is None and g.parts is not None:
        risks.append(Risk("other", f"two parts of one {g.parts} taken as operands: the fused op needs [gate, up] in one "
                                   "tensor, so this adds a torch.cat copy of both parts (2 x T x I elements written and read "
                                   "again) and keeps it for backward; npufuse does not slice the adjacent pair out of the "
                                   "split tensor instead"))
    elif g.halves is None:
        risks.append(Risk("other", "two projections: the fused op needs [gate, up] in one tensor, so this adds a torch.cat "
                                   "copy of both projection outputs (2 x T x I elements written and read again) and keeps it "
                                   "for backward; merge the two projection weights into one gate_up projection (once, at load) "
                                   "for the fused op to pay off"))
    else:
        if g.halves.gate_index == 1 and pat == "swiglu":
            risks.append(Risk("other", "silu is on the second half: npu_swiglu activates the first, so the halves are swapped "
                                       "with a torch.cat copy; reorder the fused projection's weight rows (up first -> gate "
                                       "first) to drop it"))
        if not g.halves.equal:
            risks.append(Risk("layout", f"{g.halves.how} with a symbolic size: the fused op needs two equal halves "
                                        "(the split size must be half of the dim)"))
        if pat == "swiglu" and g.halves.gate_index == 0:
            # fused_expr passes `t.contiguous()`: npu_swiglu is not contiguous-tolerant (spec 3.1)
            risks.append(Risk("non_contiguous", "the split tensor is passed whole through .contiguous() (npu_swiglu is not "
                                                "contiguous-tolerant): no copy when it is already contiguous (a projection "
                                                "output is), a copy of the whole tensor when it is a strided view"))
        elif pat != "swiglu":
            risks.append(Risk("non_contiguous", "the split tensor is passed whole as it is (no .contiguous()): a strided "
                                                "view reaches npu_geglu strided"))
    if g.act.moved:
        risks.append(Risk("other", "the activation's result is moved with .to(device=...) before the product; the fused op "
                                   "concatenates gate and up, so both must already be on one device (torch.cat raises "
                                   "otherwise: an error, never wrong values)"))
    if g.act.kind == CONFIG:
        notes.append(f"activation chosen by config ({g.act.describe}): the fused branch checks at run time which one it is "
                     "(silu -> npu_swiglu, gelu/gelu_new -> npu_geglu) and keeps the original code otherwise")
    notes.append("npu_gelu_mul is forward-only; not used" if pat == "geglu" else "npu_swiglu has a backward: training-safe")
    return risks, notes


# --------------------------------------------------------------------------------------------
# value


def gated_value(finding: Finding, config: dict[str, Any], act_kernels: int) -> dict[str, Any]:
    inter = config.get("intermediate_size") or config.get("d_ff") or config.get("ffn_dim") or config.get("moe_intermediate_size")
    two = finding.params.get("source") == "two_projections"
    swap = finding.params.get("order") == "up_first" and finding.pattern == "swiglu"
    k_before = act_kernels + 1  # activation kernel(s) + the product
    # per T*I element, in units of the element size: act reads a, writes s (x act_kernels);
    # mul reads s and b, writes out
    units_before = 2 * act_kernels + 3
    units_after = 3 + (4 if (two or swap) else 0)  # read a, b; write out (+ cat: read 2, write 2)
    k_after = 1 + (1 if (two or swap) else 0)
    merged = merged_form(finding) if two else None
    if not isinstance(inter, int):
        extra = (f" plus a torch.cat copy (two projections): ~{units_after}·T·I moved against ~{units_before}·T·I before, "
                 "slower as written unless the projections are merged") if two else ""  # fmt: skip
        extra = _swiglu_s50b.cat_text(finding.params, units_after, units_before) or extra
        out = symbolic(
            "memory",
            f"memory-bound: {k_before} elementwise kernels moving ~{units_before}·T·I elements -> {k_after} kernel(s) "
            f"moving ~{units_after}·T·I{extra}; T tokens, I intermediate size unknown",
        )
        if merged:
            out["estimate"] += "; merged-weight form: 1 kernel moving ~3·T·I (offered below)"
            out["merged_form"] = merged
        return out
    from npufuse.patterns.rms_norm import elem_bytes, tokens_of

    e = elem_bytes(config)
    t, tdesc = tokens_of(config)
    elems = t * inter
    out = estimate(
        bytes_before=units_before * e * elems,
        bytes_after=units_after * e * elems,
        kernels_before=k_before,
        kernels_after=k_after,
        flops=6 * elems,
        shapes=f"gate/up [{tdesc}, intermediate {inter}]"
        + ((" (+ torch.cat of the " + finding.params["operands"] + ")") if finding.params.get("operands") else " (+ torch.cat of two projections)" if two else ""),
    )
    if merged:
        alt = estimate(bytes_before=units_before * e * elems, bytes_after=3 * e * elems, kernels_before=k_before, kernels_after=1, flops=6 * elems)
        out["estimate"] += f"; merged-weight form (offered below): speed-up bound {alt['speedup_bound']:.2f}x"
        out["merged_form"] = merged
        out["merged_speedup_bound"] = alt["speedup_bound"]
    return out


_OWN_PROJ = re.compile(r"self\.([A-Za-z_]\w*)\(\s*([A-Za-z_]\w*)\s*\)")


def merged_form(finding: Finding) -> str | None:
    """The merged-weight form human ports use (one Linear with the gate rows stacked over the up
    rows, so npu_swiglu gets [gate, up] without a torch.cat), offered when both projections are
    the module's own ``self.<proj>(x)`` of one input; None otherwise (the weights live elsewhere)."""
    g = _OWN_PROJ.fullmatch(str(finding.params.get("gate") or "").strip())
    u = _OWN_PROJ.fullmatch(str(finding.params.get("up") or "").strip())
    if not g or not u or g.group(2) != u.group(2) or g.group(1) == u.group(1):
        return None
    gate, up, x = g.group(1), u.group(1), g.group(2)
    merged = f"{gate}_{up}"
    return ("# __init__: one projection, gate rows first then up rows (bias: the same concatenation)\n"
            f"self.{merged} = nn.Linear(self.{gate}.in_features, 2 * self.{gate}.out_features, bias=self.{gate}.bias is not None)\n"
            f"# loading a checkpoint: {merged}.weight = torch.cat([{gate}.weight, {up}.weight], dim=0)\n"
            "# forward (the activation line):\n"
            f"torch_npu.npu_swiglu(self.{merged}({x}), dim=-1)")


# --------------------------------------------------------------------------------------------
# the pattern


class Swiglu(Pattern):
    id = "swiglu"
    api = "torch_npu.npu_swiglu"
    title = "SwiGLU (silu(gate) * up) -> npu_swiglu"
    SHARES_SITES_WITH = ("geglu",)  # one gate reader (gate_results) decides which of the two reports a product
    training_ok = True
    bound = "memory"
    # gate_results' first text test (a gated activation multiplies), made once by the scan
    SCOPE_WORDS = ("*", ".mul(", ".mul_(", "multiply")

    def detect(self, module: ModuleInfo, scope: Scope) -> Iterable[Result]:
        for r in gate_results(module, scope):
            if r.pattern != self.id:
                continue
            if r.finding is not None:
                yield r.finding
            elif r.miss is not None:
                yield r.miss

    def assess(self, finding: Finding, config: dict[str, Any]) -> dict[str, Any]:
        return gated_value(finding, config, int(finding.params.get("activation_kernels") or 1))

    @staticmethod
    def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """fp32 golden: silu(gate) * up."""
        import torch.nn.functional as F

        return F.silu(gate.float()) * up.float()

    FUSE: list = []
    KEEP: list = []


# --------------------------------------------------------------------------------------------
# examples

_LLAMA_MLP = '''
import torch
from torch import nn

ACT2FN = {"silu": nn.SiLU(), "gelu": nn.GELU(), "relu": nn.ReLU()}


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj
'''

_RUN_LLAMA = '''
class Cfg:
    hidden_size = 32
    intermediate_size = 48
    hidden_act = "{act}"
mlp = LlamaMLP(Cfg()){cast}
x = torch.randn(2, 5, 32{dtype}, requires_grad=True)
out = mlp(x)
leaves = [x, mlp.gate_proj.weight, mlp.up_proj.weight]
'''

_META_FFN = '''
import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
'''

_PHI3 = '''
import torch
from torch import nn


class Phi3MLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.activation_fn = nn.SiLU()

    def forward(self, hidden_states):
        up_states = self.gate_up_proj(hidden_states)
        gate, up_states = up_states.chunk(2, dim=-1)
        up_states = up_states * self.activation_fn(gate)
        return self.down_proj(up_states)
'''

_SIGMOID_FORM = '''
import torch
from torch import nn


class SwiGLUFFN(nn.Module):
    """A user's own FFN: silu spelled as x * sigmoid(x), projections as matmuls."""

    def __init__(self, d, h):
        super().__init__()
        self.w_gate = nn.Parameter(torch.randn(d, h) * 0.02)
        self.w_up = nn.Parameter(torch.randn(d, h) * 0.02)
        self.w_down = nn.Parameter(torch.randn(h, d) * 0.02)

    def forward(self, x):
        g = x @ self.w_gate
        u = x @ self.w_up
        h = torch.sigmoid(g) * g * u
        return h @ self.w_down
'''

_UP_FIRST = '''
import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    """Fused projection stored up-first: silu applies to the second half."""

    def __init__(self, d, h):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        y = self.fc1(x)
        y, gate = y.chunk(2, dim=-1)
        y = y * F.silu(gate)
        return self.fc2(y)
'''

_MOE_V5 = '''
import torch
from torch import nn
import torch.nn.functional as F


class Experts(nn.Module):
    """transformers v5-style stacked experts: one gate_up weight per expert, F.linear + chunk."""

    def __init__(self, num_experts, hidden, inter):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * inter, hidden) * 0.05)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, inter) * 0.05)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, expert_idx):
        gate, up = F.linear(hidden_states, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        return F.linear(current_hidden_states, self.down_proj[expert_idx])
'''

_FLUX_ACT = '''
import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SiLUGate(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return F.silu(x1) * x2
'''

_QWEN2_CONFIG_NO_SELF_CONFIG = '''
import torch
from torch import nn

ACT2FN = {"silu": nn.SiLU(), "gelu": nn.GELU(), "relu": nn.ReLU()}


class Qwen2MoeMLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        gate = self.gate_proj(x)
        act = self.act_fn(gate)
        up = self.up_proj(x)
        return self.down_proj(act * up)
'''

_DEEPSEEK_SPLIT = '''
import torch
import torch.nn.functional as F
from torch import nn


class FusedMLP(nn.Module):
    """One projection split with torch.split into [gate, up] of intermediate_size each."""

    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        gate, up = torch.split(gate_up, self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
'''

_SLICED = '''
import torch
import torch.nn.functional as F
from torch import nn


class SlicedGLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.w_in = nn.Linear(d, 2 * h)

    def forward(self, x):
        z = self.w_in(x)
        return F.silu(z[..., : self.h]) * z[..., self.h :]
'''

Swiglu.FUSE = [
    Fuse(
        _LLAMA_MLP,
        expect={"activation": "config", "conditional": True, "config_key": "self.config.hidden_act", "source": "two_projections",
                "order": "gate_first", "split_dim": -1, "qualname": "LlamaMLP.forward"},
        run=_RUN_LLAMA.format(act="silu", cast="", dtype=""),
        name="hf_llama_act2fn_fp32",
    ),
    Fuse(_LLAMA_MLP, expect={"conditional": True}, run=_RUN_LLAMA.format(act="silu", cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16"),
         name="hf_llama_act2fn_bf16"),
    Fuse(_LLAMA_MLP, expect={"conditional": True}, run=_RUN_LLAMA.format(act="gelu", cast="", dtype=""), name="hf_llama_config_gelu_dispatch"),
    Fuse(
        _META_FFN,
        expect={"activation": "silu", "conditional": False, "gate": "self.w1(x)", "up": "self.w3(x)", "source": "two_projections"},
        run="ff = FeedForward(16, 40)\nx = torch.randn(3, 16, requires_grad=True)\nout = ff(x)\nleaves = [x, ff.w1.weight, ff.w3.weight]\n",
        name="meta_llama_f_silu",
    ),
    Fuse(
        _PHI3,
        expect={"source": "split", "split": "chunk", "order": "gate_first", "split_dim": -1, "split_tensor": "up_states",
                "activation": "silu", "line": 15, "end_line": 16},
        run="m = Phi3MLP(16, 24).to(torch.float16)\nx = torch.randn(2, 3, 16, dtype=torch.float16, requires_grad=True)\nout = m(x)\nleaves = [x, m.gate_up_proj.weight]\n",
        name="phi3_fused_gate_up_fp16",
    ),
    Fuse(
        _SIGMOID_FORM,
        expect={"activation": "silu", "gate": "g", "up": "u", "source": "two_projections"},
        run="m = SwiGLUFFN(8, 12)\nx = torch.randn(5, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.w_gate, m.w_up]\n",
        name="sigmoid_times_x_matmul",
    ),
    Fuse(
        _UP_FIRST,
        expect={"order": "up_first", "split_dim": -1, "source": "split", "gate": "gate", "up": "y"},
        run="m = GatedMLP(8, 10)\nx = torch.randn(4, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.fc1.weight]\n",
        name="silu_on_second_half_swapped",
    ),
    Fuse(
        _MOE_V5,
        expect={"source": "split", "order": "gate_first", "split_tensor": "F.linear(hidden_states, self.gate_up_proj[expert_idx])"},
        run="m = Experts(3, 8, 6).to(torch.bfloat16)\nx = torch.randn(7, 8, dtype=torch.bfloat16, requires_grad=True)\nout = m(x, 1)\nleaves = [x]\n",
        name="moe_v5_stacked_linear_chunk_bf16",
    ),
    Fuse(
        _FLUX_ACT,
        expect={"source": "split", "split_tensor": "x", "order": "gate_first", "line": 9, "end_line": 10},
        run="m = SiLUGate()\nx = torch.randn(2, 6, 20, requires_grad=True)\nout = m(x)\nleaves = [x]\n",
        name="flux_chunk_gate",
    ),
    Fuse(
        _QWEN2_CONFIG_NO_SELF_CONFIG,
        expect={"conditional": True, "runtime_check": "activation type", "gate": "gate", "up": "up"},
        run="class C:\n    hidden_size = 16\n    hidden_act = 'silu'\nm = Qwen2MoeMLP(C(), 24)\nx = torch.randn(3, 16, requires_grad=True)\nout = m(x)\nleaves = [x, m.gate_proj.weight]\n",
        name="qwen2_moe_act_statement",
    ),
]

Swiglu.FUSE += [
    Fuse(
        _DEEPSEEK_SPLIT,
        expect={"source": "split", "split": "split", "order": "gate_first", "split_tensor": "gate_up", "split_dim": -1},
        run="m = FusedMLP(8, 12)\nx = torch.randn(2, 3, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.gate_up_proj.weight]\n",
        name="torch_split_symbolic_size",
    ),
    Fuse(
        _SLICED,
        expect={"source": "split", "split": "slice", "order": "gate_first", "split_tensor": "z", "split_dim": -1},
        run="m = SlicedGLU(8, 5)\nx = torch.randn(4, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.w_in.weight]\n",
        name="slicing_halves",
    ),
    Fuse(
        '''
import torch
from torch import nn


class GatingMLP(nn.Module):
    """Moshi: one projection, its last dim viewed as (2, -1), halves picked by index."""

    def __init__(self, d, h):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * h, bias=False)
        self.fc2 = nn.Linear(h, d, bias=False)
        self.activation_fn = nn.SiLU()

    def forward(self, hidden_states):
        hidden_states = self.fc1(hidden_states)
        batch_size, sequence_length, _ = hidden_states.shape
        hidden_states = hidden_states.view(batch_size, sequence_length, 2, -1)
        hidden_states = self.activation_fn(hidden_states[..., 0, :]) * hidden_states[..., 1, :]
        return self.fc2(hidden_states)
''',
        expect={"source": "split", "split": "view", "order": "gate_first", "split_tensor": "hidden_states.view(batch_size, sequence_length, -1)", "split_dim": -1},
        run="m = GatingMLP(8, 5)\nx = torch.randn(2, 3, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.fc1.weight]\n",
        name="moshi_view_halves",
    ),
]

Swiglu.KEEP = [
    Keep(
        '''
import torch
import torch.nn.functional as F
from torch import nn


class ReluGLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.wi_0 = nn.Linear(d, h, bias=False)
        self.wi_1 = nn.Linear(d, h, bias=False)

    def forward(self, x):
        return F.relu(self.wi_0(x)) * self.wi_1(x)
''',
        reason="activation is not silu",
        name="relu_glu",
    ),
    Keep(
        '''
import torch
import torch.nn.functional as F
from torch import nn


class MambaMixerOut(nn.Module):
    """Mamba-style output gating: y * silu(z) with y from the scan, not a projection."""

    def __init__(self, d):
        super().__init__()
        self.in_proj = nn.Linear(d, 2 * d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x, scan):
        xz = self.in_proj(x)
        x_in, z = xz.chunk(2, dim=-1)
        y = scan(x_in)
        return self.out_proj(y * F.silu(z))
''',
        reason="not projections of one input",
        name="mamba_output_gate",
    ),
    Keep(
        '''
import torch
from torch import nn


class GptOssExperts(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate_up = nn.Linear(d, 2 * h)
        self.alpha = 1.702

    def forward(self, x):
        gate_up = self.gate_up(x)
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu
''',
        reason="swish with beta",
        name="gpt_oss_interleaved_alpha",
    ),
    Keep(
        '''
import torch
import torch.nn.functional as F
from torch import nn


class SwiGLUWithStats(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.w3 = nn.Linear(d, h)

    def forward(self, x):
        act = F.silu(self.w1(x))
        out = act * self.w3(x)
        return out, act.abs().mean()
''',
        reason="reused after the fused region",
        name="activation_reused",
    ),
    # (a 3-way chunk whose first two parts are the gate pair is a candidate now: issue 14 class 6)
    Keep(
        '''
import torch
import torch.nn.functional as F


def selective_state_update(state, x, C, D=None, z=None):
    """Mamba's decode step: the branch-assigned ``out`` is gated by an argument, no GLU."""
    out = torch.matmul(state, C.unsqueeze(-1)).squeeze(-1)
    if D is not None:
        out = out + x * D
    if z is not None:
        out = out * F.silu(z)
    return out
''',
        reason="not projections of one input",
        name="mamba_branch_assigned_output",
    ),
    Keep(
        '''
import torch
from torch import nn


class ClampedSwishExperts(nn.Module):
    """GPT-OSS as shipped: the halves are clamped before the alpha-swish, so no split is seen."""

    def __init__(self, alpha=1.702, limit=7.0):
        super().__init__()
        self.alpha = alpha
        self.limit = limit

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu
''',
        reason="swish with beta",
        name="gpt_oss_clamped_alpha_swish",
    ),
]


# issue 14, class 7: the projection computed inline and silu on its second half (CLVP-style): the
# replacement swaps the halves of one evaluation of `self.proj(x)` (a replacement calling it twice
# would be a near miss, patterns/base.py)
Swiglu.FUSE += [
    Fuse(
        '''
import torch
import torch.nn.functional as F
from torch import nn


class GatedFFN(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.proj = nn.Linear(d, 2 * h)

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.silu(gate)
''',
        run="m = GatedFFN(8, 12)\nx = torch.randn(3, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.proj.weight]\n",
        name="inline_projection_silu_on_second_half_bound_once",
    ),
]


# issue 14, class 6: gate and up from stacked expert weights: einsum over gathered weights
# (gpt-fast mixtral), bmm over [E, D, H] weights (llama4 batched experts), a grouped matmul taking
# keyword arguments only (torchtitan GroupedExperts); a near miss when the einsums' inputs differ
_STACKED = '''
import torch
import torch.nn.functional as F
from torch import nn


def grouped_mm(A, B_t, offs=None):
    return A @ B_t


class Experts(nn.Module):
    def __init__(self, e=4, d=8, h=12):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(e, h, d) * 0.3)
        self.w3 = nn.Parameter(torch.randn(e, h, d) * 0.3)
        self.w2 = nn.Parameter(torch.randn(e, d, h) * 0.3)

    def forward(self, x, idx):
{body}
'''

_STACKED_RUN = ("m = Experts()\nx = torch.randn(5, 8, requires_grad=True)\nidx = torch.randint(0, 4, (5, 2))\n"
                "out = m(x, idx)\nleaves = [x, m.w1, m.w3]\n")

Swiglu.FUSE += [
    Fuse(_STACKED.format(body='''        w1, w3, w2 = self.w1[idx], self.w3[idx], self.w2[idx]
        x1 = F.silu(torch.einsum("ti,taoi -> tao", x, w1))
        x3 = torch.einsum("ti, taoi -> tao", x, w3)
        return torch.einsum("tao, taio -> tai", x1 * x3, w2)'''), run=_STACKED_RUN,
         expect={"source": "two_projections", "order": "gate_first"}, name="einsum_over_gathered_expert_weights"),
    Fuse(_STACKED.format(body='''        xs = x.unsqueeze(0).expand(self.w1.shape[0], -1, -1)
        h = F.silu(torch.bmm(xs, self.w1.transpose(1, 2))) * torch.bmm(xs, self.w3.transpose(1, 2))
        return torch.bmm(h, self.w2.transpose(1, 2)).sum(0)'''), run=_STACKED_RUN,
         expect={"source": "two_projections"}, name="bmm_over_stacked_expert_weights"),
    Fuse(_STACKED.format(body='''        h = F.silu(grouped_mm(A=x, B_t=self.w1[0].transpose(-2, -1)))
        h = h * grouped_mm(A=x, B_t=self.w3[0].transpose(-2, -1))
        return grouped_mm(A=h, B_t=self.w2[0].transpose(-2, -1))'''), run=_STACKED_RUN,
         expect={"source": "two_projections"}, name="keyword_only_grouped_matmul"),
]

Swiglu.KEEP += [
    Keep(_STACKED.format(body='''        w1, w3 = self.w1[idx], self.w3[idx]
        y = torch.tanh(x)
        return F.silu(torch.einsum("ti,taoi->tao", x, w1)) * torch.einsum("ti,taoi->tao", y, w3)'''),
         reason="not projections of one input", name="einsums_of_different_inputs"),
    Keep(_STACKED.format(body='''        w1, w3 = self.w1[idx], self.w3[idx]
        return F.silu(torch.einsum("ti,taoi->tao", x, w1)) * torch.einsum("ti,taoi->tai", x, w3)'''),
         reason="not projections of one input", name="einsums_with_different_equations"),
]


# -- issue 14, class 6: activations chosen by configuration, resolved by dataflow ---------------

_GET_ACTIVATION = '''
import torch
import torch.nn.functional as F
from torch import nn


def get_activation(name):
    if name == "swiglu":
        return F.silu, True
    if name == "geglu":
        return F.gelu, True
    return F.relu, False


class GatedMLP(nn.Module):
    def __init__(self, args, d, h):
        super().__init__()
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.act, self.is_gated = get_activation(args.activation)

    def forward(self, x):
        return self.act(self.gate(x)) * self.up(x)
'''

_RUN_GET_ACTIVATION = '''
class Args:
    activation = "{act}"
mlp = GatedMLP(Args(), 16, 24)
x = torch.randn(2, 3, 16, requires_grad=True)
out = mlp(x)
leaves = [x, mlp.gate.weight, mlp.up.weight]
'''

_CONFIG_CALLABLE = '''
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, config, d, h):
        super().__init__()
        self.config = config
        self.fc1 = nn.Linear(d, 2 * h, bias=False)

    def forward(self, x):
        h = torch.chunk(self.fc1(x), 2, dim=-1)
        return self.config.activation_func(h[0]) * h[1]
'''

_RUN_CONFIG_CALLABLE = '''
class Config:
    activation_func = staticmethod({act})
mlp = MLP(Config(), 16, 24)
x = torch.randn(2, 3, 16, requires_grad=True)
out = mlp(x)
leaves = [x, mlp.fc1.weight]
'''

_ACT_TABLE_HELPER = '''
import torch
from torch import nn


def get_act(name):
    return {"gelu": nn.GELU(approximate="tanh"), "silu": nn.SiLU()}[name]


class FFN(nn.Module):
    def __init__(self, d, h, act="gelu"):
        super().__init__()
        self.gate = nn.Linear(d, h)
        self.up = nn.Linear(d, h)
        self.act = get_act(act)

    def forward(self, x):
        return self.act(self.gate(x)) * self.up(x)
'''

_RUN_ACT_TABLE = '''
mlp = FFN(16, 24, act="{act}")
x = torch.randn(2, 3, 16, requires_grad=True)
out = mlp(x)
leaves = [x, mlp.gate.weight, mlp.up.weight]
'''

Swiglu.FUSE += [
    Fuse(_GET_ACTIVATION, expect={"conditional": True}, run=_RUN_GET_ACTIVATION.format(act="swiglu"), name="tuple_from_get_activation_silu"),
    Fuse(_GET_ACTIVATION, expect={"conditional": True}, run=_RUN_GET_ACTIVATION.format(act="geglu"), name="tuple_from_get_activation_gelu"),
    Fuse(_CONFIG_CALLABLE, expect={"conditional": True}, run=_RUN_CONFIG_CALLABLE.format(act="F.silu"), name="config_activation_func_halves_silu"),
    Fuse(_CONFIG_CALLABLE, expect={"conditional": True}, run=_RUN_CONFIG_CALLABLE.format(act="F.gelu"), name="config_activation_func_halves_gelu"),
    Fuse(_ACT_TABLE_HELPER, expect={"conditional": True}, run=_RUN_ACT_TABLE.format(act="gelu"), name="helper_act_table_gelu_tanh"),
    Fuse(_ACT_TABLE_HELPER, expect={"conditional": True}, run=_RUN_ACT_TABLE.format(act="silu"), name="helper_act_table_silu"),
]

Swiglu.KEEP += [
    # the helper returns relu on every path: resolved, and not a gated op torch_npu has
    Keep(_GET_ACTIVATION.replace("F.silu, True", "F.relu, True").replace("F.gelu, True", "F.relu, True"),
         reason="activation is not silu", name="tuple_from_helper_always_relu"),
]


# -- issue 14, class 6: gate pair from a 3-way chunk; gpt-neox gated activation with a bias -----

_THREE_WAY = '''
import torch
import torch.nn.functional as F
from torch import nn


class GatedResidual(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w = nn.Linear(d, 3 * h)

    def forward(self, x):
        a, b, c = self.w(x).chunk(3, dim=-1)
        return F.silu(a) * b + c
'''

_RUN_THREE_WAY = '''
m = GatedResidual(16, 24)
x = torch.randn(2, 3, 16, requires_grad=True)
out = m(x)
leaves = [x, m.w.weight]
'''

_NEOX_GATED = '''
import torch
import torch.nn.functional as F


class Gated_Activation(torch.nn.Module):
    def __init__(self, activation_func, use_swiglu=False):
        super().__init__()
        self.activation_func = activation_func
        self.use_swiglu = use_swiglu

    def forward(self, x, bias=None):
        x, gate = x.chunk(2, dim=-1)
        if bias is not None:
            bias_1, bias_2 = bias.chunk(2, dim=-1)
            x = x + bias_1
            gate = gate + bias_2
        intermediate_parallel = self.activation_func(gate)
        return intermediate_parallel * x
'''

_RUN_NEOX_GATED = '''
act = Gated_Activation({act})
h = torch.randn(2, 3, 32, requires_grad=True)
bias = torch.randn(32, requires_grad=True)
out = act(h, {bias})
leaves = [h, bias]
'''

Swiglu.FUSE += [
    Fuse(_THREE_WAY, run=_RUN_THREE_WAY, name="gate_pair_from_three_way_chunk"),
    Fuse(_NEOX_GATED, expect={"conditional": True}, run=_RUN_NEOX_GATED.format(act="F.silu", bias="bias"), name="neox_gated_activation_with_bias_silu"),
    Fuse(_NEOX_GATED, expect={"conditional": True}, run=_RUN_NEOX_GATED.format(act="F.silu", bias="None"), name="neox_gated_activation_without_bias_silu"),
    Fuse(_NEOX_GATED, expect={"conditional": True}, run=_RUN_NEOX_GATED.format(act="F.gelu", bias="bias"), name="neox_gated_activation_with_bias_gelu"),
]

Swiglu.KEEP += [
    # the last of three chunks is shorter when the size does not divide by 3: the product broadcasts
    Keep(_THREE_WAY.replace("F.silu(a) * b + c", "F.silu(a) * c + b"), reason="last part of a chunk",
         name="gate_pair_with_the_last_chunk"),
]


# -- issue 14, class 6: gate pair from a split into 3+ sized parts (mamba2-style in_proj) ------

_SIZED_SPLIT = '''
import torch
import torch.nn.functional as F
from torch import nn


class SplitMixer(nn.Module):
    def __init__(self, d, d_mlp, d_ssm, nheads):
        super().__init__()
        self.d_mlp, self.d_ssm, self.nheads = d_mlp, d_ssm, nheads
        self.in_proj = nn.Linear(d, 2 * d_mlp + 2 * d_ssm + nheads)

    def forward(self, u):
        zxbcdt = self.in_proj(u)
        d_mlp = self.d_mlp
        z0, x0, z, xbc, dt = torch.split(zxbcdt, [d_mlp, d_mlp, self.d_ssm, self.d_ssm, self.nheads], dim=-1)
        y = xbc * torch.sigmoid(dt.mean(-1, keepdim=True)) + z
        if d_mlp > 0:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return y
'''

_RUN_SIZED_SPLIT = '''
m = SplitMixer(16, {d_mlp}, 8, 4)
u = torch.randn(2, 3, 16, requires_grad=True)
out = m(u)
leaves = [u, m.in_proj.weight]
'''

Swiglu.FUSE += [
    # the gate pair is two parts of one size of a 5-way sized split; the product sits under an if
    # (the split in the enclosing block stays as written: the operands are the parts themselves)
    Fuse(_SIZED_SPLIT, run=_RUN_SIZED_SPLIT.format(d_mlp=12), name="gate_pair_from_sized_split_under_if"),
]

Swiglu.KEEP += [
    # z (d_ssm wide) times x0 (d_mlp wide): two parts whose sizes are not provably equal
    Keep(_SIZED_SPLIT.replace("F.silu(z0) * x0", "F.silu(z) * x0"), reason="not provably equal",
         name="sized_split_parts_of_different_sizes"),
    # y * silu(z): z is a split part but y is computed from others (an output gate, not a GLU)
    Keep(_SIZED_SPLIT.replace("torch.cat([F.silu(z0) * x0, y], dim=-1)", "y * F.silu(z)"),
         reason="not projections of one input", name="sized_split_part_gating_another_output"),
]


# -- issue 14, class 6: an activation object made by an imported builder ---------------------

# corenet-style: self.act = <imported builder>(...) (here copy.deepcopy of the module handed in);
# nothing in the file says what it is, so the fused branch dispatches on the object at run time
_BUILT_ACT = '''
import copy

import torch
from torch import nn


class FeedForwardNetwork(nn.Module):
    def __init__(self, d, h, act):
        super().__init__()
        self.proj_1 = nn.Linear(d, 2 * h, bias=False)
        self.proj_2 = nn.Linear(h, d, bias=False)
        self.act = copy.deepcopy(act)

    def forward(self, x):
        y_12 = self.proj_1(x)
        y_1, y_2 = y_12.chunk(2, dim=-1)
        y = self.act(y_1) * y_2
        return self.proj_2(y)
'''

_RUN_BUILT_ACT = '''
m = FeedForwardNetwork(8, 12, {act})
x = torch.randn(2, 3, 8, requires_grad=True)
out = m(x)
leaves = [x, m.proj_1.weight]
'''

Swiglu.FUSE += [
    Fuse(_BUILT_ACT, expect={"conditional": True}, run=_RUN_BUILT_ACT.format(act="nn.SiLU()"), name="imported_builder_activation_silu"),
    Fuse(_BUILT_ACT, expect={"conditional": True}, run=_RUN_BUILT_ACT.format(act="nn.GELU()"), name="imported_builder_activation_gelu"),
]

Swiglu.KEEP += [
    # an imported builder's object beside a known activation is a projection, not the activation
    # (llm-foundry: self.up_proj = build_fc(...)); here the two factors share no input: nothing at all
    Keep(_BUILT_ACT.replace("y = self.act(y_1) * y_2", "y = self.act(y_1) * self.proj_2(y_12)"), reason="",
         name="imported_builder_object_in_a_product_that_is_no_glu"),
]


# -- issue 14, class 6: projections and activation all handed to __init__ (torchtune) ----------

_INJECTED = '''
import torch
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, *, gate_proj, down_proj, up_proj=None, activation=nn.SiLU()):
        super().__init__()
        self.w1 = gate_proj
        self.w2 = down_proj
        self.w3 = up_proj
        self.activation = activation

    def forward(self, x):
        return self.w2(self.activation(self.w1(x)) * self.w3(x))
'''

_RUN_INJECTED = '''
m = FeedForward(gate_proj=nn.Linear(8, 12), down_proj=nn.Linear(12, 8), up_proj=nn.Linear(8, 12){arg})
x = torch.randn(2, 3, 8, requires_grad=True)
out = m(x)
leaves = [x, m.w1.weight, m.w3.weight]
'''

Swiglu.FUSE += [
    # self.w3 = up_proj and self.activation = activation are both callables from __init__: the one
    # whose default is an activation (nn.SiLU()) is the activation
    Fuse(_INJECTED, expect={"conditional": True}, run=_RUN_INJECTED.format(arg=""), name="injected_projections_default_silu"),
    Fuse(_INJECTED, expect={"conditional": True}, run=_RUN_INJECTED.format(arg=", activation=nn.GELU(approximate='tanh')"),
         name="injected_projections_caller_passes_tanh_gelu"),
]

_OPTIONAL_UP = _INJECTED.replace(
    "        return self.w2(self.activation(self.w1(x)) * self.w3(x))",
    "        h = self.activation(self.w1(x))\n        if self.w3 is not None:\n            h = h * self.w3(x)\n        return self.w2(h)")

Swiglu.FUSE += [
    # the up projection is optional: activation on every path, the product only under the if ->
    # one if/else: the fused op under the test, the activation alone otherwise (gate projected once)
    Fuse(_OPTIONAL_UP, expect={"optional_gate": "self.w3 is not None", "line": 15, "end_line": 17},
         run=_RUN_INJECTED.format(arg="") + '''
m0 = FeedForward(gate_proj=nn.Linear(8, 12), down_proj=nn.Linear(12, 8))
out = (out, m0(x))
leaves = leaves + [m0.w1.weight]
''', name="optional_up_projection_under_if"),
]

Swiglu.KEEP += [
    # (s36: the Keep `optional_up_projection_with_else` is now the Fuse example of that name: the
    # else branch runs after the activation statements in the restructured else, as it did)
    # the test reads the activation's result: it cannot be evaluated before the gate projection
    Keep(_OPTIONAL_UP.replace("if self.w3 is not None:", "if h.requires_grad:"),
         reason="the `if` test reads the activation's result", name="optional_up_projection_test_reads_activation"),
]


# --- ropeglu: projections computed in tensor-parallel slices (issue 14, class 6) ---------------

_SLICED = '''
import torch
import torch.nn.functional as F
from torch import nn


class SlicedMLP(nn.Module):
    def __init__(self, d, h, parts):
        super().__init__()
        self.parts = parts
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        n = self.gate.weight.shape[0] // self.parts
        gw = self.gate.weight.split(n, dim=0)
        uw = self.up.weight.split(n, dim=0)
        g = torch.cat([F.linear(x, gw[i]) for i in range(self.parts)], dim=-1)
        u = torch.cat([F.linear(x, uw[i]) for i in range(self.parts)], dim=-1)
        return self.down(F.silu(g) * u)
'''

Swiglu.FUSE += [
    # gate and up each a concatenation of per-slice projections of x along the output features
    Fuse(_SLICED, expect={"gate": "g", "up": "u"}, name="tensor_parallel_slices_concatenated",
         run='''
m = SlicedMLP(8, 12, 3)
x = torch.randn(2, 5, 8, requires_grad=True)
out = m(x)
leaves = [x, m.gate.weight, m.up.weight]
'''),
]

Swiglu.KEEP += [
    # slices joined along the token dim: not the output features of one projection
    Keep(_SLICED.replace("for i in range(self.parts)], dim=-1)\n        u", "for i in range(self.parts)], dim=0)\n        u"),
         reason="not projections of one input", name="slices_concatenated_along_tokens"),
    # the up slices project another input
    Keep(_SLICED.replace("u = torch.cat([F.linear(x, uw[i])", "u = torch.cat([F.linear(x.flip(-1), uw[i])"),
         reason="not projections of one input", name="slices_of_another_input"),
]


# --- ropeglu: an activation chosen by a condition (issue 14, class 6) ---------------------------

_CHOSEN_ACT = '''
import torch
import torch.nn.functional as F
from torch import nn


class PackedGLU(nn.Module):
    def __init__(self, d, h, use_gelu=False):
        super().__init__()
        self.w12 = nn.Linear(d, 2 * h)
        self.w3 = nn.Linear(h, d)
        self.act = nn.GELU(approximate="tanh") if use_gelu else nn.SiLU()

    def forward(self, x):
        x1, x2 = self.w12(x).chunk(2, dim=-1)
        return self.w3(self.act(x1) * x2)
'''

_CHOSEN_LOCAL_ACT = '''
import torch
import torch.nn.functional as F


def glu_weights(x, w1, w2, w3, activation: str = "silu"):
    act = F.silu if activation == "silu" else F.gelu
    return (act(x @ w1) * (x @ w3)) @ w2
'''

Swiglu.FUSE += [
    # the activation object picked by a constructor flag: tested at run time (isinstance), each choice fused
    # with its op; the packed projection self.w12(x) computed once on every branch
    Fuse(_CHOSEN_ACT, expect={"activation": "config", "runtime_check": "activation type"}, name="activation_chosen_by_a_flag",
         run='''
x = torch.randn(2, 3, 8, requires_grad=True)
m1, m2 = PackedGLU(8, 12), PackedGLU(8, 12, use_gelu=True)
out = (m1(x), m2(x))
leaves = [x, m1.w12.weight, m2.w12.weight]
'''),
    # a local `act = F.silu if ... else F.gelu` in a function taking the weights
    Fuse(_CHOSEN_LOCAL_ACT, expect={"activation": "config", "gate": "x @ w1"}, name="local_activation_chosen_by_an_argument",
         run='''
x = torch.randn(5, 8, requires_grad=True)
w1, w3, w2 = torch.randn(8, 12), torch.randn(8, 12), torch.randn(12, 8)
out = (glu_weights(x, w1, w2, w3), glu_weights(x, w1, w2, w3, "gelu"))
leaves = [x]
'''),
]

Swiglu.KEEP += [
    # neither choice is an activation a fused gated op computes
    Keep(_CHOSEN_ACT.replace('nn.GELU(approximate="tanh") if use_gelu else nn.SiLU()', "nn.ReLU() if use_gelu else nn.Tanh()"),
         reason="activation is not silu (relu or tanh: self.act = nn.ReLU() if use_gelu else nn.Tanh())", name="activation_chosen_between_unfusable_ones"),
    # a callable picked between non-activations (a module chosen by the flag) is no activation at all
    Keep(_CHOSEN_ACT.replace('nn.GELU(approximate="tanh") if use_gelu else nn.SiLU()', "nn.Identity() if use_gelu else nn.Linear(12, 12)"),
         reason="", name="callable_chosen_between_non_activations"),
]

Swiglu.KEEP += [
    # the optional product written as a conditional expression: its else arm reads the activation itself
    Keep(_OPTIONAL_UP.replace("        if self.w3 is not None:\n            h = h * self.w3(x)\n",
                              "        h = h * self.w3(x) if self.w3 is not None else h\n"),
         reason="is also read elsewhere in the statement", name="optional_up_projection_in_a_conditional_expression"),
]


# --- activation handed in as a function parameter (held-out 4) ---


def _parameter_act(module: ModuleInfo, f: ast.Name, gate: ast.expr, ctx: S.Ctx) -> Act | None:
    """``activation(x[..., 0, :]) * x[..., 1, :]`` with ``activation`` a parameter of this function
    (never rebound in it): a callable the caller chooses, so only a run-time test of the object
    tells SiLU from GELU (the fused branch runs npu_swiglu / npu_geglu for those and the original
    code for anything else). Weak: an activation only when the product is a GLU's structure
    (halves of one tensor, projections of one input), never a reason to refuse another product."""
    if f.id not in ctx.scope.args or S.definition(ctx, f.id) is not None:
        return None
    cls = module.classes.get(ctx.scope.class_name or "")
    if cls is not None and any((module.canonical(b) or dotted(b) or "").endswith("autograd.Function") for b in cls.bases):
        # forward of a hand-written autograd.Function: its backward recomputes the activation from the
        # saved inputs with the same callable, so the pair is the Function's own business
        return None
    fn = ctx.scope.node if isinstance(getattr(ctx.scope, "node", None), (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    default: str | None = None
    if fn is not None:
        args = fn.args.posonlyargs + fn.args.args
        defaults = dict(zip([a.arg for a in args][len(args) - len(fn.args.defaults):], fn.args.defaults))
        defaults.update({a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None})
        dv = defaults.get(f.id)
        if dv is not None:
            k = _module_act(module, ast.Call(func=dv, args=[], keywords=[])) or _module_act(module, dv)
            default = k[0] if k is not None and k[0] != CONFIG else None
    return Act(CONFIG, gate, ctx, f"{f.id} (a parameter of the function)", obj=f, default=default,
               gelu_hint=_gelu_hint(f.id, None), weak=True)


_PARAM_ACT = '''
import torch
from torch import nn
import torch.nn.functional as F


def gated_ffn(w_in, w_out, activation, x):
    h = F.linear(x, w_in)
    a, b = h.chunk(2, dim=-1)
    return F.linear(activation(a) * b, w_out)


def gated_ffn_view(linear_in, linear_out, act_fn, x):
    x = linear_in(x)
    n, t, _ = x.shape
    x = x.view(n, t, 2, -1)
    x = act_fn(x[..., 0, :]) * x[..., 1, :]
    return linear_out(x)
'''

_RUN_PARAM_ACT = '''
w_in = torch.randn(24, 8, requires_grad=True)
w_out = torch.randn(8, 12)
lin_in, lin_out = nn.Linear(8, 24, bias=False), nn.Linear(12, 8, bias=False)
x = torch.randn(2, 3, 8, requires_grad=True)
out = gated_ffn(w_in, w_out, {act}, x) + gated_ffn_view(lin_in, lin_out, {act}, x)
leaves = [x, w_in, lin_in.weight]
'''

Swiglu.FUSE += [
    Fuse(_PARAM_ACT, expect={"conditional": True}, run=_RUN_PARAM_ACT.format(act="F.silu"), name="activation_function_parameter_silu"),
    Fuse(_PARAM_ACT, expect={"conditional": True}, run=_RUN_PARAM_ACT.format(act="nn.GELU()"), name="activation_function_parameter_gelu"),
]

Swiglu.KEEP += [
    # the parameter is a callable beside a product that is no GLU (a scale times a different tensor):
    # weak, so not even a near miss
    Keep(_PARAM_ACT.replace("activation(a) * b", "activation(a) * x.sum()").replace(
        "act_fn(x[..., 0, :]) * x[..., 1, :]", "act_fn(x[..., 0, :]) * n"), reason="", name="activation_parameter_not_a_glu"),
]


# --- activation assigned in several branches of __init__ (held-out 4) ---


def _init_values(module: ModuleInfo, class_name: str | None, attr: str) -> list[ast.expr]:
    """Every value ``self.<attr>`` is assigned in the class's ``__init__``, in source order."""
    if not class_name or class_name not in module.classes:
        return []
    out: list[ast.expr] = []
    for item in module.classes[class_name].body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            for n in S._stmts_in(item.body):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) and n.value is not None else []
                if any(dotted(t) == f"self.{attr}" for t in targets):
                    out.append(n.value)  # type: ignore[union-attr]
    return out


def _branch_assigned_act(module: ModuleInfo, cls_name: str | None, f: ast.Attribute, gate: ast.expr, ctx: S.Ctx) -> Act | None:
    """``if act == "relu": self.act = nn.ReLU() elif ...: self.act = F.silu``: which assignment runs
    is decided when the object is built, so the last one in the source is not the activation (taking
    it made an unconditional npu_swiglu where the default was GELU). Every value known: one kind is
    that kind; several kinds: chosen at run time, tested on the object in the fused branch. None when
    the attribute is assigned once (the existing lookup decides) or a value is not an activation
    npufuse knows (then nothing tells what runs)."""
    values = _init_values(module, cls_name, f.attr)
    if len(values) < 2:
        return None
    kinds: list[str] = []
    for v in values:
        k = _module_act(module, v)
        if k is None and isinstance(v, ast.Name):
            fn = module.helper(v.id)
            k3 = _helper_act(module, fn) if isinstance(fn, ast.FunctionDef) else None
            k = (k3, None) if k3 is not None else None
        kinds.append(k[0] if k is not None and k[0] not in (CONFIG, GELU_DYN) else CONFIG)
    if CONFIG in kinds:
        # a branch npufuse cannot resolve: only testing the object at run time tells what runs
        return Act(CONFIG, gate, ctx, f"self.{f.attr} assigned in {len(values)} branches of __init__, one not resolved",
                   obj=f, gelu_hint=_gelu_hint(f.attr, None), weak=True, default=_fallback_kind(module, cls_name, values, kinds))
    desc = f"self.{f.attr} assigned in {len(values)} branches of __init__ ({', '.join(sorted(set(kinds)))})"
    if len(set(kinds)) == 1:
        return Act(kinds[0], gate, ctx, desc, obj=f)
    if not {SILU, GELU, GELU_TANH} & set(kinds):
        return None
    return Act(CONFIG, gate, ctx, desc, obj=f, gelu_hint=_gelu_hint(f.attr, None))


_BRANCH_ACT = '''
import torch
from torch import nn
import torch.nn.functional as F


class GatedFF(nn.Module):
    def __init__(self, d, h, activate_fn="gelu"):
        super().__init__()
        self.w_0 = nn.Linear(d, h, bias=False)
        self.w_1 = nn.Linear(d, h, bias=False)
        if activate_fn == "relu":
            self.act = nn.ReLU()
        elif activate_fn == "gelu":
            self.act = nn.GELU()
        elif activate_fn == "silu":
            self.act = F.silu
        else:
            raise ValueError(activate_fn)

    def forward(self, x):
        gate_score = self.act(self.w_0(x))
        x = self.w_1(x)
        x = gate_score * x
        return x
'''

_RUN_BRANCH_ACT = '''
m = GatedFF(8, 12, activate_fn="{act}")
x = torch.randn(2, 3, 8, requires_grad=True)
out = m(x)
leaves = [x, m.w_0.weight, m.w_1.weight]
'''

Swiglu.FUSE += [
    Fuse(_BRANCH_ACT, expect={"conditional": True, "dispatches_to": ["swiglu", "geglu"]}, run=_RUN_BRANCH_ACT.format(act="silu"),
         name="activation_assigned_in_init_branches_silu"),
    Fuse(_BRANCH_ACT, expect={"conditional": True}, run=_RUN_BRANCH_ACT.format(act="gelu"), name="activation_assigned_in_init_branches_gelu"),
]

Swiglu.KEEP += [
    # every branch assigns an activation torch_npu has no gated op for: resolved, nothing to fuse
    Keep(_BRANCH_ACT.replace("self.act = nn.GELU()", "self.act = nn.Tanh()").replace("self.act = F.silu", "self.act = nn.ReLU6()"),
         reason="", name="activation_init_branches_none_fusable"),
]


# --- activation looked up by name in torch's namespaces (held-out 4) ---

_ACT_NAMESPACES = {"torch.nn.functional": False, "torch": False, "torch.nn": True}  # True: a class, instantiated


def _getattr_act(module: ModuleInfo, value: ast.expr, f: ast.expr, gate: ast.expr, ctx: S.Ctx, desc: str) -> Act | None:
    """``self.act = getattr(F, config.act)`` / ``getattr(nn, name)()``: an activation of torch looked
    up by a name known only at run time. A literal name resolves (``getattr(F, "silu")`` is F.silu);
    otherwise only testing the object in the fused branch tells SiLU from GELU (anything else runs
    the original code)."""
    call = value
    instantiated = False
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Call) and not call.args and not call.keywords:
        call, instantiated = call.func, True  # getattr(nn, name)()
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "getattr"
            and len(call.args) == 2 and not call.keywords):
        return None
    space = module.canonical(call.args[0])
    if space not in _ACT_NAMESPACES or _ACT_NAMESPACES[space] != instantiated:
        return None
    name = const_value(call.args[1])
    if isinstance(name, str):
        target = f"{space}.{name}" if not instantiated else None
        kind = _FUNCS.get(target) if target else None
        if kind is None and instantiated:
            k = _module_act(module, ast.parse(f"torch.nn.{name}()", mode="eval").body)
            kind = k[0] if k is not None and k[0] != CONFIG else None
        return Act(kind, gate, ctx, desc, obj=f) if kind in (SILU, GELU) else None
    return Act(CONFIG, gate, ctx, desc, obj=f, gelu_hint=_gelu_hint(getattr(f, "attr", ""), None))


_GETATTR_ACT = '''
import torch
from torch import nn
import torch.nn.functional as F


class GLUFFN(nn.Module):
    def __init__(self, d, h, act_name):
        super().__init__()
        self.proj = nn.Linear(d, 2 * h, bias=False)
        self.out = nn.Linear(h, d)
        self.act = getattr(F, act_name)

    def forward(self, x):
        g, u = self.proj(x).chunk(2, dim=-1)
        return self.out(self.act(g) * u)


class GLUFFNModule(nn.Module):
    def __init__(self, d, h, act_cls):
        super().__init__()
        self.w_gate = nn.Linear(d, h, bias=False)
        self.w_up = nn.Linear(d, h, bias=False)
        self.act = getattr(nn, act_cls)()

    def forward(self, x):
        return self.act(self.w_gate(x)) * self.w_up(x)
'''

_RUN_GETATTR_ACT = '''
m1, m2 = GLUFFN(8, 6, "{fn}"), GLUFFNModule(8, 6, "{cls}")
x = torch.randn(2, 3, 8, requires_grad=True)
out = m1(x).sum() + m2(x).sum()
leaves = [x, m1.proj.weight, m2.w_gate.weight]
'''

Swiglu.FUSE += [
    Fuse(_GETATTR_ACT, expect={"conditional": True}, run=_RUN_GETATTR_ACT.format(fn="silu", cls="SiLU"), name="activation_getattr_by_name_silu"),
    Fuse(_GETATTR_ACT, expect={"conditional": True}, run=_RUN_GETATTR_ACT.format(fn="gelu", cls="GELU"), name="activation_getattr_by_name_gelu"),
]

Swiglu.KEEP += [
    # a literal name resolves: getattr(F, "relu") is relu, which no gated torch_npu op computes
    Keep(_GETATTR_ACT.replace("getattr(F, act_name)", 'getattr(F, "relu")').replace("getattr(nn, act_cls)()", 'getattr(nn, "ReLU")()'),
         reason="", name="activation_getattr_literal_relu"),
    # getattr on a user's object: not torch's namespace, nothing says it is an activation
    Keep(_GETATTR_ACT.replace("getattr(F, act_name)", "getattr(self, act_name)").replace("getattr(nn, act_cls)()", "getattr(self, act_cls)()"),
         reason="", name="activation_getattr_on_own_object"),
]


# --- a conditional activation whose arm is configuration's (held-out 4) ---


def _config_arm_act(module: ModuleInfo, value: ast.IfExp, f: ast.expr, gate: ast.expr, ctx: S.Ctx, desc: str) -> Act | None:
    """``ACT2FN[cfg.act] if isinstance(cfg.act, str) else cfg.act``: each arm is an activation chosen
    by configuration (a table lookup by a run-time name, or a callable the config holds) or a known
    one, so only testing the object in the fused branch tells what runs. An arm that is neither
    (a call of something unknown, a constant) leaves it unresolved (None)."""
    has_config = False
    for arm in (value.body, value.orelse):
        k = _module_act(module, arm)
        if k is not None:
            has_config = has_config or k[0] == CONFIG
            continue
        text = dotted(arm) or ""
        if isinstance(arm, ast.Attribute) and text and not (module.canonical(arm) or "").startswith("torch.") \
                and not text.startswith("self."):
            has_config = True  # `config.act_fn`: a callable handed in by configuration
            continue
        return None
    if not has_config:
        return None
    return Act(CONFIG, gate, ctx, desc, obj=f, gelu_hint=_gelu_hint(getattr(f, "attr", ""), None))


_CONFIG_ARM_ACT = '''
import torch
from torch import nn

ACT2FN = {"silu": nn.SiLU(), "gelu": nn.GELU(), "relu": nn.ReLU()}


class FusedGateUp(nn.Module):
    def __init__(self, cfg, d, h):
        super().__init__()
        self.gate_up = nn.Linear(d, 2 * h, bias=False)
        self.act_fn = ACT2FN[cfg.act] if isinstance(cfg.act, str) else cfg.act

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return up * self.act_fn(gate)
'''

_RUN_CONFIG_ARM_ACT = '''
class Cfg:
    act = {act}
m = FusedGateUp(Cfg(), 8, 6)
x = torch.randn(2, 3, 8, requires_grad=True)
out = m(x)
leaves = [x, m.gate_up.weight]
'''

Swiglu.FUSE += [
    Fuse(_CONFIG_ARM_ACT, expect={"conditional": True}, run=_RUN_CONFIG_ARM_ACT.format(act="torch.nn.SiLU()"), name="activation_config_table_or_callable_silu"),
    Fuse(_CONFIG_ARM_ACT, expect={"conditional": True}, run=_RUN_CONFIG_ARM_ACT.format(act="torch.nn.GELU()"), name="activation_config_table_or_callable_gelu"),
    Fuse(_CONFIG_ARM_ACT, expect={"conditional": True}, run=_RUN_CONFIG_ARM_ACT.format(act='"silu"'), name="activation_config_table_or_callable_name_silu"),
]

Swiglu.KEEP += [
    # one arm is a call of something npufuse cannot see into: nothing says what the object is
    Keep(_CONFIG_ARM_ACT.replace("else cfg.act", "else cfg.build()"), reason="", name="activation_config_arm_unknown_call"),
]


# --- gate and up indexed out of one tensor along a non-last dim (held-out 4) ---


def _indexed_pair_part(n: ast.Subscript, ctx: S.Ctx) -> tuple[str, ast.expr, S.Ctx, ast.expr, object, str, bool] | None:
    """``T[..., 0, :]`` / ``T[..., 1, :]`` (one projection producing ``[..., 2, I]``; gate and up
    indexed out of it): one part of a pair along one dim, every other dim taken whole. Both parts
    then have T's shape less that dim, so they are equal-width operands and the fused op takes them
    concatenated along the last dim: exact whatever T's size along the indexed dim (no shape is
    assumed). Only indices 0 and 1 (the two members of a pair); a plain ``T[0]`` is a row, not a
    part of a pair, and stays out."""
    sl = n.slice
    elts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
    elts = _rank_padded_index(n.value, ctx, list(elts))
    if len(elts) < 2:
        return None
    ints = [i for i, e in enumerate(elts) if isinstance(e, ast.Constant) and type(e.value) is int]
    whole = [i for i, e in enumerate(elts) if isinstance(e, ast.Slice) and e.lower is None and e.upper is None and e.step is None
             or isinstance(e, ast.Constant) and e.value is Ellipsis]
    if len(ints) != 1 or len(ints) + len(whole) != len(elts) or elts[ints[0]].value not in (0, 1):  # type: ignore[attr-defined]
        return None
    if not isinstance(elts[-1], ast.Slice):
        return None  # the last dim indexed: a scalar column per row, not a feature vector
    pos = ints[0]
    ellipsis = [i for i in whole if isinstance(elts[i], ast.Constant)]
    if len(ellipsis) > 1:
        return None
    if ellipsis and ellipsis[0] < pos:
        dim: ast.expr = ast.Constant(pos - len(elts))  # counted from the end: [..., 0, :] is dim -2
    elif ellipsis:
        return None  # [0, ..., :]: the dim is counted from the start, the ellipsis after it
    else:
        dim = ast.Constant(pos)
    idx = elts[pos].value  # type: ignore[attr-defined]
    return (S.key(n.value, ctx), n.value, ctx, dim, idx, "part", True)


# --- torch.mul(a, b) / a.mul(b): the product written as a call (held-out 4) ---


_PAIR_INDEXED = '''
import torch
from torch import nn
import torch.nn.functional as F


class PairProjection(nn.Module):
    """One projection whose output is [..., 2, I]: gate and up indexed out of it."""

    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.wi = nn.Linear(d, 2 * h, bias=False)
        self.wo = nn.Linear(h, d, bias=False)

    def forward(self, x):
        fused = self.wi(x).unflatten(-1, (2, self.h))
        gate = fused[..., 0, :]
        up = fused[..., 1, :]
        hidden = torch.mul(F.silu(gate), up).to(x.dtype)
        return self.wo(hidden)


class PairFirstDim(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.wi = nn.Linear(d, 2 * h, bias=False)

    def forward(self, x):
        t = self.wi(x).view(x.shape[0], 2, -1)
        return t[:, 1, :].mul(F.silu(t[:, 0, :]))
'''

_RUN_PAIR_INDEXED = '''
m1, m2 = PairProjection(8, 6), PairFirstDim(8, 5)
x = torch.randn(2, 3, 8, requires_grad=True)
x2 = torch.randn(4, 8, requires_grad=True)
out = m1(x).sum() + m2(x2).sum()
leaves = [x, x2, m1.wi.weight, m2.wi.weight]
'''

Swiglu.FUSE += [
    Fuse(_PAIR_INDEXED, run=_RUN_PAIR_INDEXED, name="gate_up_indexed_pair_and_mul_calls"),
]

Swiglu.KEEP += [
    # the same member of the pair twice: silu(g) * g is no gate/up pair
    Keep(_PAIR_INDEXED.replace("up = fused[..., 1, :]", "up = fused[..., 0, :]").replace(
        "t[:, 1, :].mul(F.silu(t[:, 0, :]))", "t[:, 0, :].mul(F.silu(t[:, 0, :]))"),
         reason="", name="indexed_pair_same_member_twice"),
    # rows 0 and 1 of a batch (no other dim taken whole): not the two members of a pair
    Keep(_PAIR_INDEXED.replace("gate = fused[..., 0, :]", "gate = fused[0]").replace("up = fused[..., 1, :]", "up = fused[1]").replace(
        "t[:, 1, :].mul(F.silu(t[:, 0, :]))", "t[1].mul(F.silu(t[0]))"),
         reason="", name="rows_of_a_batch_not_a_pair"),
]


# --- a projection passed through a one-argument helper (held-out 4) ---


def _through_unary_helper(n: ast.expr, ctx: S.Ctx) -> tuple[ast.expr, S.Ctx]:
    """``grab_first_if_tuple(self.l1(z))`` (a plain function of one argument, applied to a
    projection's output: unwrap a (output, bias) tuple, a tensor-parallel gather): the projection it
    wraps, for the question "are gate and up projections of one input". The operands are still
    rendered as written in the fused text, so the helper runs exactly as before; this only lets the
    structure check see through it. Only a plain name's call (not a method, not a module of this
    object) whose argument is itself a method/attribute call (``self.l1(z)``), one level."""
    if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and len(n.args) == 1 and not n.keywords
            and not isinstance(n.args[0], ast.Starred)):
        return n, ctx
    if S.definition(ctx, n.func.id) is not None or n.func.id in ctx.scope.args:
        return n, ctx  # a local callable (a module object passed in or built here): it may be the projection
    inner, ictx = S.peel(n.args[0], ctx)
    if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and isinstance(inner.func.value, ast.Name) \
            and inner.func.value.id == "self" and inner.args:
        return inner, ictx
    return n, ctx



def _binds_gate_too(stmt: ast.AST, a: ast.expr) -> bool:
    """``z1, z2 = f(z1), f(z2)``: the statement rebinding up's name binds the gate's name too, so
    the gate reads the new value as well and the statement can stay as written before the fused
    text (joining it to the region would render each of its values twice, as a tuple indexed)."""
    if not (isinstance(a, ast.Name) and isinstance(stmt, ast.Assign)):
        return False
    return any(isinstance(n, ast.Name) and n.id == a.id and isinstance(n.ctx, ast.Store) for t in stmt.targets for n in ast.walk(t))


_UNARY_HELPER = '''
import torch
from torch import nn
import torch.nn.functional as F


def first_if_tuple(x):
    if isinstance(x, tuple):
        return x[0]
    return x


class GatedMLP2(nn.Module):
    def __init__(self, d, h, act="silu"):
        super().__init__()
        if act == "gelu":
            self.act = F.gelu
        elif act == "silu":
            self.act = F.silu
        else:
            raise NotImplementedError(act)
        self.l1 = nn.Linear(d, h, bias=False)
        self.l2 = nn.Linear(d, h, bias=False)
        self.l3 = nn.Linear(h, d, bias=False)

    def forward(self, z):
        z1, z2 = self.l1(z), self.l2(z)
        z1, z2 = first_if_tuple(z1), first_if_tuple(z2)
        y = self.l3(self.act(z1) * z2)
        return first_if_tuple(y)
'''

_RUN_UNARY_HELPER = '''
m = GatedMLP2(8, 6, act="{act}")
x = torch.randn(2, 3, 8, requires_grad=True)
out = m(x)
leaves = [x, m.l1.weight, m.l2.weight]
'''

Swiglu.FUSE += [
    Fuse(_UNARY_HELPER, expect={"conditional": True}, run=_RUN_UNARY_HELPER.format(act="silu"), name="projections_through_unary_helper_silu"),
    Fuse(_UNARY_HELPER, expect={"conditional": True}, run=_RUN_UNARY_HELPER.format(act="gelu"), name="projections_through_unary_helper_gelu"),
]

Swiglu.KEEP += [
    # the helper wraps projections of two different inputs: a gated output, not a GLU MLP
    Keep(_UNARY_HELPER.replace("def forward(self, z):", "def forward(self, z, w):").replace(
        "self.l2(z)", "self.l2(w)").replace("first_if_tuple(y)", "first_if_tuple(y)"),
         reason="not projections of one input", name="unary_helper_over_projections_of_two_inputs"),
]


_PARAM_ACT_AUTOGRAD = '''
import torch
import torch.nn.functional as F


class GatedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w3, activation_fn):
        a = x @ w1.t()
        b = x @ w3.t()
        ctx.save_for_backward(x, w1, w3)
        ctx.activation_fn = activation_fn
        return activation_fn(a) * b

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError
'''

Swiglu.KEEP += [
    # a hand-written autograd.Function handed the activation: its backward owns the recomputation
    Keep(_PARAM_ACT_AUTOGRAD, reason="", name="activation_parameter_in_autograd_function"),
]



# --- glu: gating in a helper whose operands the callers project (issue 14, class 6) ----------

_GATING_HELPER = '''
import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)
        self.w3 = nn.Linear(d, h, bias=False)

    def _gating(self, x1, x3):
        return F.silu(x1) * x3

    def forward(self, x):
        return self.w2(self._gating(self.w1(x), self.w3(x)))
'''

_RUN_GATING = '''
m = FeedForward(8, 12)
x = torch.randn(2, 3, 8, requires_grad=True)
out = m(x)
leaves = [x, m.w1.weight, m.w3.weight]
'''

# a module-level helper, its callers' projections held in names and passed by keyword
_GATING_FUNCTION = '''
import torch
import torch.nn.functional as F
from torch import nn


def gated_silu(gate, up):
    return up * F.silu(gate)


class MLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate_proj = nn.Linear(d, h)
        self.up_proj = nn.Linear(d, h)
        self.down_proj = nn.Linear(h, d)

    def forward(self, x):
        g = self.gate_proj(x)
        u = self.up_proj(x)
        return self.down_proj(gated_silu(up=u, gate=g))


def mlp_weights(x, w1, w3, w2):
    return gated_silu(x @ w1, x @ w3) @ w2
'''

_RUN_GATING_FUNCTION = '''
m = MLP(8, 12)
x = torch.randn(2, 3, 8, requires_grad=True)
w1, w3, w2 = torch.randn(8, 12), torch.randn(8, 12), torch.randn(12, 8)
out = (m(x), mlp_weights(x, w1, w3, w2))
leaves = [x, m.gate_proj.weight, m.up_proj.weight]
'''

# the caller splits one packed projection and hands the two halves over
_GATING_HALVES = '''
import torch
import torch.nn.functional as F
from torch import nn


class PackedFFN(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w13 = nn.Linear(d, 2 * h)
        self.w2 = nn.Linear(h, d)
        self.act = nn.SiLU()

    def gate(self, a, b):
        return self.act(a) * b

    def forward(self, x):
        a, b = self.w13(x).chunk(2, dim=-1)
        return self.w2(self.gate(a, b))
'''

Swiglu.FUSE += [
    Fuse(_GATING_HELPER, expect={"gate": "x1", "up": "x3", "operands_from_callers": [18], "line": 15}, run=_RUN_GATING,
         name="gating_helper_projections_from_the_caller"),
    Fuse(_GATING_HELPER.replace("    def _gating", "    @torch.compile\n    def _gating"), expect={"operands_from_callers": [19]},
         name="gating_helper_compiled_with_torch_compile"),
    Fuse(_GATING_FUNCTION, expect={"gate": "gate", "up": "up", "operands_from_callers": [21, 25]}, run=_RUN_GATING_FUNCTION,
         name="gating_function_called_by_keyword_and_with_matmuls"),
    Fuse(_GATING_HALVES, expect={"operands_from_callers": [19]}, name="gating_helper_given_the_halves_of_one_projection",
         run='''
m = PackedFFN(8, 12)
x = torch.randn(4, 8, requires_grad=True)
out = m(x)
leaves = [x, m.w13.weight]
'''),
]

Swiglu.KEEP += [
    # a second caller gates an SSM output with a projection: a gated output, not a GLU MLP
    Keep(_GATING_HELPER.replace("        return self.w2(self._gating(self.w1(x), self.w3(x)))",
                                "        y = self.w2(self._gating(self.w1(x), self.w3(x)))\n"
                                "        return self._gating(self.w1(y), x.cumsum(1))"),
         reason="the call on line 19 passes `self.w1(y)` and `x.cumsum(1)`, not projections of one input",
         name="gating_helper_one_caller_passes_other_tensors"),
    # projections of two different inputs (cross-attention-like gating)
    Keep(_GATING_HELPER.replace("def forward(self, x):", "def forward(self, x, ctx):").replace("self.w3(x)))", "self.w3(ctx)))"),
         reason="not projections of one input", name="gating_helper_projections_of_two_inputs"),
    # no call in the module: the operands come from elsewhere (an operator library's forward); the helper
    # does more than the product (s28: one that only returns it is the GLU kernel itself, fused, see below)
    Keep(_GATING_HELPER.replace("self._gating(self.w1(x), self.w3(x))", "self.w1(x)").replace(
        "        return F.silu(x1) * x3", "        self.last = x3\n        return F.silu(x1) * x3"),
         reason="no call in this module passes them", name="gating_helper_without_callers"),
    # the helper handed on as a callable: its callers are unknown
    Keep(_GATING_HELPER.replace("return self.w2(self._gating(self.w1(x), self.w3(x)))",
                                "fn = self._gating\n        return self.w2(fn(self.w1(x), self.w3(x)))").replace(
        "        return F.silu(x1) * x3", "        self.last = x3\n        return F.silu(x1) * x3"),
         reason="also referenced without a direct call (line 19)", name="gating_helper_passed_as_a_callable"),
]

Swiglu.FUSE += [
    # s28: the same helpers reduced to `return act(x1) * x3` are GLU kernels: fused under a shape check
    Fuse(_GATING_HELPER.replace("self._gating(self.w1(x), self.w3(x))", "self.w1(x)"),
         expect={"glu_kernel": True}, name="s28_gating_kernel_without_callers"),
    Fuse(_GATING_HELPER.replace("return self.w2(self._gating(self.w1(x), self.w3(x)))",
                                "fn = self._gating\n        return self.w2(fn(self.w1(x), self.w3(x)))"),
         expect={"glu_kernel": True}, run=_RUN_GATING, name="s28_gating_kernel_passed_as_a_callable"),
]


# --- glu: activations another object holds (issue 14, class 6) ---------------------------------

# a plain function reading the layers from an object it is handed (SwissArmyTransformer-style hooks)
_FOREIGN_LAYER = '''
import torch
import torch.nn.functional as F
from torch import nn


class Layer(nn.Module):
    def __init__(self, d, h, act):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.gate = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.activation_func = act


def mlp_forward(model, hidden_states, layer_id):
    layer = model[layer_id]
    inter = layer.up(hidden_states)
    gated = layer.gate(hidden_states)
    inter = layer.activation_func(gated) * inter
    return layer.down(inter)
'''

_RUN_FOREIGN = '''
model = [Layer(8, 12, F.silu), Layer(8, 12, nn.GELU()), Layer(8, 12, torch.tanh)]
x = torch.randn(2, 3, 8, requires_grad=True)
out = (mlp_forward(model, x, 0), mlp_forward(model, x, 1), mlp_forward(model, x, 2))
leaves = [x, model[0].gate.weight, model[1].up.weight]
'''

# an expert's activation read with getattr and a gelu fallback; one packed projection split in two
_GETATTR_ACT = '''
import torch
import torch.nn.functional as F
from torch import nn


class GroupedExperts(nn.Module):
    def __init__(self, experts, ffn):
        super().__init__()
        self.ffn = ffn
        self.w_gate_up = nn.ParameterList([nn.Parameter(torch.cat([e[0].weight, e[1].weight], 0)) for e in experts])
        self.w_down = nn.ParameterList([nn.Parameter(e[2].weight) for e in experts])
        self.activation = getattr(experts[0], "activation", F.gelu)

    def forward_tokens(self, x, ids):
        y = torch.zeros_like(x)
        for e in range(len(self.w_down)):
            pos = ids == e
            gate_up = F.linear(x[pos], self.w_gate_up[e])
            gate, up = gate_up.split(self.ffn, dim=1)
            gate = self.activation(gate)
            hidden = gate * up
            y[pos] = F.linear(hidden, self.w_down[e])
        return y
'''

_RUN_GETATTR = '''
experts = [nn.ModuleList([nn.Linear(8, 12), nn.Linear(8, 12), nn.Linear(12, 8)]) for _ in range(3)]
m = GroupedExperts(experts, 12)
x = torch.randn(10, 8, requires_grad=True)
out = m.forward_tokens(x, torch.arange(10) % 3)
leaves = [x, m.w_gate_up[0]]
'''

Swiglu.FUSE += [
    Fuse(_FOREIGN_LAYER, expect={"activation": "config", "runtime_check": "activation type", "gate": "gated", "up": "inter"},
         run=_RUN_FOREIGN, name="activation_held_by_a_layer_object_of_a_plain_function"),
]
Swiglu.KEEP += [
    # the other object's callable applied to the input itself: no projection pair, so no activation either
    Keep(_FOREIGN_LAYER.replace("layer.activation_func(gated) * inter", "layer.activation_func(hidden_states) * inter"),
         reason="", name="foreign_callable_on_the_input_is_no_glu"),
    # projections of two different inputs
    Keep(_FOREIGN_LAYER.replace("gated = layer.gate(hidden_states)", "gated = layer.gate(hidden_states.flip(1))"),
         reason="", name="foreign_callable_projections_of_two_inputs"),
]


# --- glu: a module's own activation table, projections through a checkpoint wrapper (class 6) --

_OWN_TABLE_CKPT = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "gated-gelu": F.gelu}


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, activation_fn="silu", use_ckpting=()):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.w_3 = nn.Linear(d_model, d_ff)
        self.activation = ACTIVATIONS[activation_fn]
        self.maybe_ckpt = (lambda f, x: checkpoint(f, x, use_reentrant=False)) if "ffn" in use_ckpting else lambda f, x: f(x)

    def forward(self, x):
        inter = self.activation(self.maybe_ckpt(self.w_1, x))
        inter = inter * self.maybe_ckpt(self.w_3, x)
        return self.w_2(inter) + x
'''

_RUN_OWN_TABLE = '''
x = torch.randn(2, 3, 8, requires_grad=True)
ms = [PositionwiseFeedForward(8, 12, a) for a in ("silu", "gated-gelu", "relu")]
out = tuple(m(x) for m in ms)
leaves = [x] + [m.w_1.weight for m in ms]
'''

Swiglu.FUSE += [
    # the table's keys are the module's own ("gated-gelu"): dispatch on the object the lookup returned
    Fuse(_OWN_TABLE_CKPT.replace("(lambda f, x: checkpoint(f, x, use_reentrant=False)) if", "checkpoint if"),
         expect={"activation": "config", "runtime_check": "activation type", "up": "self.maybe_ckpt(self.w_3, x)"},
         run=_RUN_OWN_TABLE, name="activation_from_own_table_projections_through_call_through_wrapper"),
    Fuse(_OWN_TABLE_CKPT.replace("self.maybe_ckpt(self.w_1, x)", "checkpoint(self.w_1, x, use_reentrant=False)")
         .replace("self.maybe_ckpt(self.w_3, x)", "checkpoint(self.w_3, x, use_reentrant=False)"),
         expect={"activation": "config"}, run=_RUN_OWN_TABLE, name="activation_from_own_table_projections_checkpointed"),
]
Swiglu.KEEP += [
    # a wrapper that is neither checkpoint nor a call-through: the "projections" are unknown
    Keep(_OWN_TABLE_CKPT.replace("(lambda f, x: checkpoint(f, x, use_reentrant=False)) if \"ffn\" in use_ckpting else lambda f, x: f(x)",
                                 "lambda f, x: f(x.flip(-1))"),
         reason="not projections of one input", name="activation_from_own_table_projections_through_unknown_wrapper"),
    # the checkpointed projections read two different inputs
    Keep(_OWN_TABLE_CKPT.replace("self.maybe_ckpt(self.w_3, x)", "self.maybe_ckpt(self.w_3, x.flip(-1))"),
         reason="not projections of one input", name="activation_from_own_table_projections_of_two_inputs"),
]


# --- glu: the product as a method call, in place, under an optional up projection (class 6) ----

_INPLACE_OPTIONAL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "gated-gelu": F.gelu}


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, activation_fn="relu"):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.activation = ACTIVATIONS[activation_fn]
        if activation_fn in ("silu", "gated-gelu"):
            self.w_3 = nn.Linear(d_model, d_ff)
        else:
            self.w_3 = None
        self.maybe_ckpt = lambda f, x: f(x)

    def forward(self, x):
        norm_x = x * 0.5
        inter = self.maybe_ckpt(self.w_1, norm_x)
        inter = self.activation(inter)
        if self.w_3 is not None:
            inter.mul_(self.maybe_ckpt(self.w_3, norm_x))
        return self.w_2(inter) + x
'''

_RUN_INPLACE = '''
x = torch.randn(2, 3, 8, requires_grad=True)
ms = [PositionwiseFeedForward(8, 12, a) for a in ("silu", "gated-gelu", "relu")]
out = tuple(m(x) for m in ms)
leaves = [x] + [m.w_1.weight for m in ms]
'''

_METHOD_PRODUCT = '''
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(d, h)
        self.proj = nn.Linear(h, d)

    def forward(self, x):
        return self.proj(F.silu(self.fc1(x)).mul(self.fc2(x)))
'''

_RUN_METHOD = '''
m = MLP(8, 12)
x = torch.randn(2, 3, 8, requires_grad=True)
out = m(x)
leaves = [x, m.fc1.weight, m.fc2.weight]
'''

Swiglu.FUSE += [
    # `inter.mul_(up)` as `inter = inter * up`, restructured with the optional up projection; the
    # activation from the module's own table, the projections through a call-through wrapper
    Fuse(_INPLACE_OPTIONAL, expect={"activation": "config", "optional_gate": "self.w_3 is not None", "line": 24, "end_line": 26},
         run=_RUN_INPLACE, name="product_in_place_under_an_optional_up_projection"),
    # the table keyed by class constants (`Names.silu`), not string literals
    Fuse(_INPLACE_OPTIONAL.replace('ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "gated-gelu": F.gelu}',
                                   'class Names:\n    relu = "relu"\n    silu = "silu"\n    gated_gelu = "gated-gelu"\n\n\n'
                                   'ACTIVATIONS = {Names.relu: F.relu, Names.silu: F.silu, Names.gated_gelu: F.gelu}'),
         expect={"activation": "config", "optional_gate": "self.w_3 is not None"}, run=_RUN_INPLACE,
         name="product_in_place_activation_table_keyed_by_class_constants"),
    Fuse(_METHOD_PRODUCT, expect={"activation": "silu", "gate": "self.fc1(x)", "up": "self.fc2(x)"}, run=_RUN_METHOD,
         name="product_as_a_mul_method"),
    Fuse(_METHOD_PRODUCT.replace("F.silu(self.fc1(x)).mul(self.fc2(x))", "torch.mul(self.fc2(x), F.silu(self.fc1(x)))"),
         expect={"activation": "silu", "gate": "self.fc1(x)"}, run=_RUN_METHOD, name="product_as_torch_mul"),
]
Swiglu.KEEP += [
    # another name holds the activation's tensor before the in-place product: it sees the product
    Keep(_INPLACE_OPTIONAL.replace("        if self.w_3 is not None:\n            inter.mul_",
                                   "        self.last = inter\n        if self.w_3 is not None:\n            inter.mul_"),
         reason="in-place product on `inter`, which another statement reads before it", name="product_in_place_seen_through_another_reference"),
    # in place inside a larger expression statement: not the whole statement, so no rebinding
    Keep(_METHOD_PRODUCT.replace("return self.proj(F.silu(self.fc1(x)).mul(self.fc2(x)))",
                                 "h = F.silu(self.fc1(x))\n        self.proj(h.mul_(self.fc2(x)))\n        return self.proj(h)"),
         reason="", name="product_in_place_inside_an_expression"),
]


# --- glu harvest (s25): casts around the activation, identity wrappers, callables chosen
# elsewhere, the product as `t *= a` (issue 14, classes 6 and 7) ------------------------------

_UPCASTS = ("float",)


def _upcast_of(module: ModuleInfo, node: ast.expr) -> ast.expr | None:
    """``g.float()`` / ``g.to(torch.float32)`` / ``g.to(dtype=torch.float32)``: ``g``; else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if node.func.attr in _UPCASTS and not node.args and not node.keywords:
        return node.func.value
    if node.func.attr == "to" and len(node.args) + len(node.keywords) == 1:
        target = node.args[0] if node.args else (node.keywords[0].value if node.keywords[0].arg == "dtype" else None)
        if target is not None and module.canonical(target) in ("torch.float32", "torch.float"):
            return node.func.value
    return None


def _cast_back_target(node: ast.Call) -> ast.expr | None:
    """The tensor whose dtype ``x.type_as(t)`` / ``x.to(t.dtype)`` / ``x.to(dtype=t.dtype)`` casts to."""
    f = node.func
    if not isinstance(f, ast.Attribute):
        return None
    if f.attr == "type_as" and len(node.args) == 1 and not node.keywords:
        return node.args[0]
    if f.attr == "to" and len(node.args) + len(node.keywords) == 1:
        t = node.args[0] if node.args else (node.keywords[0].value if node.keywords[0].arg == "dtype" else None)
        if isinstance(t, ast.Attribute) and t.attr == "dtype":
            return t.value
    return None


def _cast_back_act(module: ModuleInfo, cast: ast.Call, ctx: S.Ctx) -> Act | None:
    """``act(g.float()).type_as(g)`` (torchscale's GLU; also ``.to(g.dtype)``, and without the
    up-cast): the activation computed in fp32 and rounded back to the gate's own dtype. That is
    exactly how npu_swiglu / npu_geglu compute a half-precision gate (the activation in fp32, its
    result rounded to the input dtype before the product), so the activation of ``g`` itself,
    with ``g`` (not its fp32 copy) as the fused op's operand. A cast to any other tensor's dtype
    (the block input's, under autocast another dtype than the projection's) is not this and stays
    unrecognised."""
    target = _cast_back_target(cast)
    inner = cast.func.value  # type: ignore[attr-defined]
    if target is None or not isinstance(inner, ast.Call) or not inner.args or isinstance(inner.args[0], ast.Starred):
        return None
    act = classify_call(module, inner, ctx)
    if act is None or act.gate is None or act.kind == SIGMOID:
        return None
    g = _upcast_of(module, act.gate) or act.gate
    tkey, gkey = S.key(target, ctx), S.key(g, act.ctx)
    if S.is_cast(g) or tkey != gkey:
        return None
    act.gate = g
    return act


def _through_identity_module(module: ModuleInfo | None, n: ast.expr, ctx: S.Ctx) -> tuple[ast.expr, S.Ctx]:
    """``self.hook_pre(F.linear(x, W))`` with ``self.hook_pre = HookPoint()`` (TransformerLens), or
    ``nn.Identity()`` / ``nn.Dropout()``: a module built with no argument at all holds no weight
    sized for the features, so it is no projection; the projection is its argument. Only for the
    question "are gate and up projections of one input": the operands are still rendered as
    written, so the wrapper (and any hook on it) runs exactly as before."""
    if module is None or not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                              and n.func.value.id == "self" and len(n.args) == 1 and not n.keywords
                              and not isinstance(n.args[0], ast.Starred)) or ctx.depth:
        return n, ctx
    cls = _assigning_class(module, ctx.scope.class_name, n.func.attr)
    value = S.init_assignments(module, cls).get(n.func.attr) if cls else None
    if not (isinstance(value, ast.Call) and not value.args and not value.keywords and isinstance(value.func, (ast.Name, ast.Attribute))):
        return n, ctx
    if _module_act(module, value) is not None:
        return n, ctx  # an activation module is not an identity
    inner, ictx = S.peel(n.args[0], ctx)
    if isinstance(inner, (ast.Call, ast.BinOp)):
        return inner, ictx
    return n, ctx


def _self_stores(module: ModuleInfo, class_name: str, attr: str, depth: int = 0) -> bool:
    """Some method of the class (or of an in-module base) assigns ``self.<attr>``, or defines it
    (cached per module: every unknown ``self.<attr>(...)`` factor of the class asks)."""
    cache = module.__dict__.setdefault("_npufuse_glu_self_stores", {})
    k = (class_name, attr, depth)
    if k not in cache:
        cache[k] = _self_stores_uncached(module, class_name, attr, depth)
    return cache[k]


def _self_stores_uncached(module: ModuleInfo, class_name: str, attr: str, depth: int) -> bool:
    cls = module.classes.get(class_name)
    if cls is None or depth > 3:
        return False
    for item in cls.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if item.name == attr:
                return True
            for n in fast_walk(item):
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and n.attr == attr and isinstance(n.value, ast.Name) \
                        and n.value.id == "self":
                    return True
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                return True
    return any(isinstance(b, ast.Name) and b.id in module.classes and b.id != class_name and _self_stores(module, b.id, attr, depth + 1)
               for b in cls.bases)


def _imported_base(module: ModuleInfo, class_name: str, depth: int = 0) -> bool:
    """The class (or an in-module base of it) derives from a class defined in another file of the
    repository or a package, other than torch's own modules (whose attributes npufuse knows)."""
    cls = module.classes.get(class_name)
    if cls is None or depth > 3:
        return False
    for b in cls.bases:
        if isinstance(b, ast.Name) and b.id in module.classes and b.id != class_name:
            if _imported_base(module, b.id, depth + 1):
                return True
            continue
        name = module.canonical(b) or dotted(b) or ""
        if name and not name.startswith("torch.") and name not in ("object", "Generic", "ABC", "abc.ABC"):
            return True
    return False


# s42 (sweep42b; the audit41/42 near-miss wording notes on HorNet's `gamma1 * self.gnconv(...)`, seamless'
# `char_embeds *= self.scale`, vocos / FocalNet layer scales): a factor that is a learned per-channel scale (an
# `nn.Parameter` attribute, maybe viewed to broadcast) or a number is a layer scale or a constant scale, not a gate.
# The near miss then says so instead of calling the product "a gated output".
_S42_BROADCAST_VIEWS = frozenset(("view", "reshape", "unsqueeze", "expand", "expand_as", "to", "type_as", "float", "half",
                                  "squeeze"))


def _s42_number_expr(node: ast.expr) -> bool:
    """Arithmetic on numbers, names and attributes only (``dim ** -0.5``, ``math.sqrt(self.model_dim)``): no tensor op."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            if (dotted(n.func) or "") not in ("math.sqrt", "math.log", "float", "int", "np.sqrt", "numpy.sqrt"):
                return False
        elif isinstance(n, ast.Constant) and not isinstance(n.value, (int, float)):
            return False
        elif not isinstance(n, (ast.Call, ast.Constant, ast.BinOp, ast.UnaryOp, ast.Name, ast.Attribute, ast.Load,
                                ast.operator, ast.unaryop)):
            return False
    return True


def _s42_scale_kind(module: ModuleInfo, value: ast.expr, cls: str | None, scope: Scope | None, depth: int,
                    init: bool = False) -> str | None:
    """"learned" (an ``nn.Parameter``), "constant" (a number) or None, for what ``value`` holds. Arithmetic on names
    counts as a number only in ``__init__`` (``init``: ``self.scale = dim ** -0.5``, its names the constructor's
    numbers); in ``forward`` a name may be a tensor."""
    while depth < 4:
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _S42_BROADCAST_VIEWS:
            value = value.func.value
        elif isinstance(value, ast.Subscript):
            value = value.value
        else:
            break
        depth += 1
    if isinstance(value, ast.Constant) and isinstance(value.value, bool):
        return None
    if isinstance(value, ast.Constant) and isinstance(value.value, (int, float)):
        return "constant"
    if init and not isinstance(value, (ast.Name, ast.Attribute)) and _s42_number_expr(value):
        return "constant"
    if isinstance(value, ast.Call) and (dotted(value.func) or "").split(".")[-1] == "Parameter":
        return "learned"
    if depth >= 4:
        return None
    if isinstance(value, ast.IfExp):  # `nn.Parameter(...) if init > 0 else None`: None is no factor at all
        return _s42_either(_s42_scale_kind(module, v, cls, scope, depth + 1, init) for v in (value.body, value.orelse)
                           if not (isinstance(v, ast.Constant) and v.value is None))
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "self" and cls:
        held = S.init_assignments(module, cls).get(value.attr)
        return None if held is None else _s42_scale_kind(module, held, cls, None, depth + 1, init=True)
    if isinstance(value, ast.Name) and scope is not None:
        # `gamma1 = self.gamma1.view(C, 1, 1)` on one branch, `gamma1 = 1` on the other
        return _s42_either(_s42_scale_kind(module, v, cls, None, depth + 1) for _, v in scope.assignments.get(value.id) or [])
    return None


def _s42_either(kinds: Iterable[str | None]) -> str | None:
    """One kind for values that are each a scale: "learned" if any is, None if any is not a scale (or none given)."""
    seen = set(kinds)
    if not seen or None in seen:
        return None
    return "learned" if "learned" in seen else "constant"


def _s43_unpacked_from_one_call(a: ast.expr, actx: S.Ctx, b: ast.expr, ctx: S.Ctx, line: int) -> str | None:
    """s43 (audit43b, quip-sharp's ``up, gate = self.upgate_proj(x)``): both operands unpacked from one call's result.
    "Not projections of one input" was not a fact there (one fused gate-up layer); what holds is that npufuse does
    not read what the call returns. None unless both are names bound by the same tuple assignment of a call."""
    if actx.depth or ctx.depth or actx.scope is not ctx.scope or not (isinstance(a, ast.Name) and isinstance(b, ast.Name)):
        return None
    found = []
    for name in (a.id, b.id):
        stmts = [stmt for stmt, _ in ctx.scope.assignments.get(name, []) if stmt.lineno < line]
        found.append(stmts[-1] if stmts else None)
    stmt = found[0]
    if stmt is None or stmt is not found[1] or a.id == b.id or not isinstance(stmt, ast.Assign) \
            or not isinstance(stmt.targets[0], ast.Tuple) or not isinstance(stmt.value, ast.Call):
        return None
    text = " ".join(ast.unparse(stmt).split())[:70]
    return (f"gate and up are unpacked from one call's result (`{text}`): npufuse does not read what "
            f"`{ast.unparse(stmt.value.func)[:40]}` returns, so it cannot show the two are projections it may concatenate")


def _s42_scale_factor(module: ModuleInfo, factor: ast.expr, ctx: S.Ctx) -> str | None:
    """The near-miss reason when ``factor`` is a layer scale or a constant scale, else None."""
    if ctx.depth:
        return None
    kind = _s42_scale_kind(module, factor, ctx.scope.class_name, ctx.scope, 0)
    text = " ".join(ast.unparse(factor).split())[:60]
    if kind == "learned":
        return (f"`{text}` is a learned scale (an nn.Parameter, a layer scale) multiplying a branch, not a gate: "
                "no two projections of one input to fuse")
    if kind == "constant":
        return f"`{text}` is a constant scale multiplying a tensor, not a gate: no two projections of one input to fuse"
    return None


# s42 (sweep42b, DiG's adaLN block `x + gate_msa * self.attn(modulate(norm1(x), ...))`, `self.attn` set by a GLA
# base class in another file): an inherited attribute whose name says it is a layer (an attention, an MLP, a conv, a
# norm, a projection) is that layer, not an activation the config picks; its output times an adaLN gate is no GLU.
_LAYER_NAME_PARTS = frozenset(("attn", "attention", "mlp", "ffn", "ff", "feedforward", "conv", "norm", "proj", "linear",
                               "block", "blocks", "layer", "layers", "embed", "embedding", "encoder", "decoder", "mixer",
                               "head", "fc", "dense", "lstm", "gru", "rnn", "transformer"))


def _names_a_layer(attr: str) -> bool:
    """``attn`` / ``self_attn`` / ``mlp`` / ``dw_conv`` / ``out_proj``: a name made of a layer kind (split on ``_``
    and trailing digits), never an activation's (``act``, ``act_fn``, ``activation``, ``gate_fn``)."""
    parts = [part.rstrip("0123456789") for part in attr.lower().split("_")]
    if any(part in ("act", "activation", "acti", "nonlinearity", "silu", "gelu", "swish") for part in parts):
        return False  # `act_layer`, `activation_fn`: an activation whatever else the name says
    return any(part in _LAYER_NAME_PARTS for part in parts)


def _inherited_act(module: ModuleInfo, f: ast.Attribute, gate: ast.expr, ctx: S.Ctx) -> Act | None:
    """``self.act(self.gate_proj(x)) * self.up_proj(x)`` where nothing in this file assigns
    ``self.act``: a base class from another file does (megablocks' SharedGLU, TransformerLens'
    GatedMLP picking ``act_fn`` from the config). A callable chosen elsewhere: weak (an activation
    only when the product is a GLU's structure), dispatched on the object at run time."""
    cls = ctx.scope.class_name
    if ctx.depth or not cls or cls not in module.classes or f.attr in _TENSOR_METHODS:
        return None
    if _names_a_layer(f.attr):
        return None
    if _self_stores(module, cls, f.attr) or not _imported_base(module, cls):
        return None
    return Act(CONFIG, gate, ctx, f"self.{f.attr} (set by a base class in another file)", obj=f,
               gelu_hint=_gelu_hint(f.attr, None), weak=True)


def _local_callable_act(module: ModuleInfo, f: ast.Name, gate: ast.expr, ctx: S.Ctx) -> Act | None:
    """``act_fn = resolve_activation_fn(self.config)`` (a module function: what its returns are)
    or ``act_fn = self._resolve_activation_fn()`` (anything else: weak, dispatched on the object
    at run time), then ``act_fn(gate) * up``."""
    local = S.definition(ctx, f.id)
    if local is None or not isinstance(local[1], ast.Call):
        return None
    value = local[1]
    desc = f"{f.id} = {ast.unparse(value)}"
    if _module_act(module, value) is not None:
        return None  # an activation object built here: classify_call's own business
    if isinstance(value.func, ast.Name) and value.func.id in module.functions and S.definition(ctx, value.func.id) is None:
        act = _helper_chosen(module, module.functions[value.func.id], None, gate, ctx, desc, f)
        if act is None or act.kind != CONFIG:
            return act
        return dataclasses.replace(act, weak=True)
    if (isinstance(value.func, ast.Name) and value.func.id in module.classes) or (module.canonical(value.func) or "").startswith("torch."):
        return None  # a class of this file instantiated here, or a torch object (an activation would be known)
    return Act(CONFIG, gate, ctx, desc, obj=f, gelu_hint=_gelu_hint(f.id, None), weak=True)


_VIEWS = frozenset(("view", "view_as", "reshape", "transpose", "permute", "expand", "expand_as", "narrow", "unsqueeze", "squeeze",
                    "flatten", "unflatten", "chunk", "split", "unbind", "select", "t", "T", "detach", "as_strided", "movedim"))


def _augassign_product(stmt: ast.stmt, module: ModuleInfo | None = None, scope: Scope | None = None) -> ast.BinOp | None:
    """``t *= a`` as the product ``t * a`` spanning the whole statement (rewritten ``t = <fused>``
    like ``t.mul_(a)``, see :func:`_inplace_target`). Only where ``t`` is a fresh tensor of this
    function (a local assigned from a call that is not a view): the original multiplies that
    tensor in place, and the rewrite rebinds the name instead, which differs only for another
    reference to the same storage (a parameter, a view, a slice)."""
    if not (isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Mult) and isinstance(stmt.target, ast.Name)):
        return None
    if scope is not None:
        d = S.definition(S.Ctx(scope, stmt.lineno), stmt.target.id)
        v = d[1] if d is not None else None
        if not (isinstance(v, ast.Call) and not (isinstance(v.func, ast.Attribute) and v.func.attr in _VIEWS)):
            return None
    target = ast.Name(id=stmt.target.id, ctx=ast.Load(), lineno=stmt.target.lineno, col_offset=stmt.target.col_offset,
                      end_lineno=stmt.target.end_lineno, end_col_offset=stmt.target.end_col_offset)
    return ast.BinOp(left=target, op=ast.Mult(), right=stmt.value, lineno=stmt.lineno, col_offset=stmt.col_offset,
                     end_lineno=stmt.end_lineno, end_col_offset=stmt.end_col_offset)


def _aliased_in_place(scope: Scope, stmt: ast.stmt) -> tuple[str, int, ast.stmt] | None:
    """For an in-place product statement (``t *= a``, ``t.mul_(a)``): ``(t, line)`` when ``t`` is
    read after its definition and before the product (``saved = t``, ``cache.append(t)``): that
    other reference sees the in-place multiply, which a rewrite rebinding ``t`` does not give it."""
    name = _inplace_target(stmt)
    if name is None:
        return None
    d = S.definition(S.Ctx(scope, stmt.lineno), name)
    if d is None:
        return None
    first, last = d[0].end_lineno or d[0].lineno, stmt.lineno
    for n in fast_walk(scope.node):
        if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) and first < n.lineno < last:
            return name, n.lineno, d[0]
    return None


_CONFIG_OBJECT_SUFFIXES = ("config", "cfg", "conf", "args", "opt", "opts", "hparams")


def _config_object_arg(call: ast.Call) -> bool:
    """An activation getter's first argument is a config object (``global_config``, ``self.cfg``,
    ``neox_args``), not the activation's name: compared with names it never equals one."""
    if not call.args or not isinstance(call.args[0], (ast.Name, ast.Attribute)):
        return False
    last = (dotted(call.args[0]) or "").split(".")[-1].lower()
    return last.endswith(_CONFIG_OBJECT_SUFFIXES)


def _getter_name_arg(call: ast.Call) -> ast.expr | None:
    """The activation's name an activation getter is given: its first argument, or its only
    keyword (torchscale's ``get_activation_fn(activation=str(name))``)."""
    if call.args:
        return None if isinstance(call.args[0], ast.Starred) else call.args[0]
    if len(call.keywords) == 1 and call.keywords[0].arg is not None:
        return call.keywords[0].value
    return None


def _biased_projection(n: ast.expr, ctx: S.Ctx) -> ast.expr:
    """``x @ w1.transpose(-2, -1) + b1`` / ``F.linear(x, w) + b`` (xformers' decomposed SwiGLU):
    an affine projection written as a matmul plus a bias, which is a parameter of the function or
    an attribute (``self.b1``), never the projection's own input (a residual ``x @ w + x``): the
    matmul part, for the question "are gate and up projections of one input"."""
    if not (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add)):
        return n
    for proj, bias in ((n.left, n.right), (n.right, n.left)):
        is_proj = (isinstance(proj, ast.BinOp) and isinstance(proj.op, ast.MatMult)) or (
            isinstance(proj, ast.Call) and (dotted(proj.func) or "").split(".")[-1] in ("linear", "matmul", "mm") and len(proj.args) >= 2)
        is_bias = (isinstance(bias, ast.Name) and bias.id in ctx.scope.args and S.definition(ctx, bias.id) is None) or (
            isinstance(bias, ast.Attribute) and (dotted(bias) or "").startswith("self."))
        if is_proj and is_bias:
            x = proj.left if isinstance(proj, ast.BinOp) else proj.args[0]
            if S.key(x, ctx) != S.key(bias, ctx):
                return proj
    return n


def _saved_activation_reason(module: ModuleInfo, scope: Scope, g: Gate) -> str | None:
    """The forward of a hand-written ``torch.autograd.Function`` that saves the activation's result
    for its own backward (``x3 = F.silu(x1); x4 = x3 * x2; ctx.save_for_backward(..., x3, ...)``):
    the activation must still be computed, so the fused op would replace the multiplication alone
    (and add a concatenation): why it is not a candidate, else None."""
    cls = module.classes.get(scope.class_name or "")
    if cls is None or not any((module.canonical(b) or dotted(b) or "").endswith("autograd.Function") for b in cls.bases):
        return None
    factors: list[ast.expr] = []
    _flatten_mul(g.node, factors)
    held = {f.id for f in factors if isinstance(f, ast.Name)}
    for n in fast_walk(scope.node):
        saved: list[ast.expr] = []
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("save_for_backward", "mark_non_differentiable"):
            saved = list(n.args)
        elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Attribute) for t in n.targets):
            saved = [n.value]
        for e in saved:
            for name in fast_walk(e):
                if isinstance(name, ast.Name) and name.id in held and _act_of(module, name, S.Ctx(scope, g.node.lineno), S.Trace()) is not None:
                    return (f"inside the hand-written autograd.Function `{cls.name}`: the activation's result `{name.id}` is saved "
                            "for its backward, so the activation runs anyway and the fused op would replace only the "
                            "multiplication (adding a concatenation)")
    return None


# --- glu harvest (s25): examples (run by name in tests/test_detect_glu_harvest.py) ---------------

# torchscale's GLU: the activation in fp32 and rounded back to the gate's dtype, chosen by a
# getter imported from elsewhere and given its name by keyword
_HARVEST_CAST = '''
import torch
import torch.nn.functional as F
from torch import nn


def get_activation_fn(activation):
    if activation == "relu":
        return F.relu
    elif activation == "gelu":
        return F.gelu
    elif activation == "swish":
        return F.silu
    raise NotImplementedError


class GLU(nn.Module):
    def __init__(self, d, h, activation_fn):
        super().__init__()
        self.activation_fn = get_activation_fn(activation=str(activation_fn))
        self.fc1 = nn.Linear(d, h, bias=False)
        self.fc2 = nn.Linear(h, d, bias=False)
        self.gate = nn.Linear(d, h, bias=False)

    def forward(self, x):
        g = self.gate(x)
        x = self.fc1(x)
        x = self.activation_fn(x.float()).type_as(x) * g
        return self.fc2(x)
'''

_RUN_HARVEST_CAST = '''
x = torch.randn(2, 3, 8, requires_grad=True)
ms = [GLU(8, 12, a) for a in ("swish", "gelu", "relu")]
half = GLU(8, 12, "swish").to(torch.bfloat16)
out = tuple(m(x) for m in ms) + (half(x.detach().to(torch.bfloat16)),)
leaves = [x] + [m.fc1.weight for m in ms]
'''

# the cast spelled `.to(g.dtype)` / `.to(dtype=g.dtype)`, the up-cast `.to(torch.float32)`
_HARVEST_CAST_TO = '''
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.w3 = nn.Linear(d, h)

    def forward(self, x):
        g = self.w1(x)
        return F.silu(g.float()).to(g.dtype) * self.w3(x)
'''

_RUN_HARVEST_CAST_TO = '''
m = MLP(8, 12)
x = torch.randn(4, 8, requires_grad=True)
out = (m(x), m.to(torch.bfloat16)(x.detach().to(torch.bfloat16)))
leaves = [x]
'''

# TransformerLens: every projection passes through a HookPoint (an identity module users hook)
_HARVEST_HOOKS = '''
import torch
import torch.nn.functional as F
from torch import nn


class HookPoint(nn.Module):
    def forward(self, x):
        return x


class GatedMLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.W_in = nn.Parameter(torch.randn(d, h) / d ** 0.5)
        self.W_gate = nn.Parameter(torch.randn(d, h) / d ** 0.5)
        self.W_out = nn.Parameter(torch.randn(h, d) / h ** 0.5)
        self.b_in = nn.Parameter(torch.zeros(h))
        self.hook_pre = HookPoint()
        self.hook_pre_linear = HookPoint()
        self.hook_post = HookPoint()
        self.act_fn = F.silu

    def forward(self, x):
        pre_act = self.hook_pre(F.linear(x, self.W_gate.T.contiguous()))
        pre_linear = self.hook_pre_linear(F.linear(x, self.W_in.T.contiguous()))
        post_act = self.hook_post((self.act_fn(pre_act) * pre_linear) + self.b_in)
        return F.linear(post_act, self.W_out.T.contiguous())
'''

_RUN_HARVEST_HOOKS = '''
m = GatedMLP(8, 12)
x = torch.randn(2, 3, 8, requires_grad=True)
out = m(x)
leaves = [x, m.W_gate, m.W_in]
'''

# megablocks' SharedGLU / TransformerLens' GatedMLP: `self.act` set by a base class from another file
_HARVEST_INHERITED = '''
import torch
import torch.nn.functional as F
from torch import nn

from mlp_base import SharedMLP


class SharedGLU(SharedMLP):
    def __init__(self, d, h, act):
        super().__init__(d, h, act)
        self.gate_proj = nn.Linear(d, h)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
'''

# the same with the base class made where it runs (the example executes standalone)
_HARVEST_INHERITED_RUNNABLE = _HARVEST_INHERITED.replace("from mlp_base import SharedMLP\n", '''
def _base():
    class SharedMLP(nn.Module):
        def __init__(self, d, h, act):
            super().__init__()
            self.up_proj = nn.Linear(d, h)
            self.down_proj = nn.Linear(h, d)
            self.act = act
    return SharedMLP


SharedMLP = _base()
''')

_RUN_HARVEST_INHERITED = '''
x = torch.randn(2, 3, 8, requires_grad=True)
ms = [SharedGLU(8, 12, a) for a in (F.silu, nn.GELU(), torch.relu)]
out = tuple(m(x) for m in ms)
leaves = [x] + [m.gate_proj.weight for m in ms]
'''

# a local callable: a module function's choice, or what a method returns
_HARVEST_LOCAL = '''
import torch
import torch.nn.functional as F
from torch import nn


def resolve_activation_fn(config):
    name = getattr(config, "hidden_act", None)
    if name is None or name in ("silu", "swish"):
        return F.silu
    if name == "gelu":
        return F.gelu
    return F.relu


class Bridge(nn.Module):
    def __init__(self, d, h, config):
        super().__init__()
        self.config = config
        self.W_gate = nn.Parameter(torch.randn(h, d) / d ** 0.5)
        self.W_in = nn.Parameter(torch.randn(h, d) / d ** 0.5)

    def _resolve(self):
        return resolve_activation_fn(self.config)

    def forward(self, hidden_states):
        gate_output = F.linear(hidden_states, self.W_gate)
        linear_output = F.linear(hidden_states, self.W_in)
        act_fn = resolve_activation_fn(self.config)
        activated = act_fn(gate_output)
        return activated * linear_output

    def forward_method(self, hidden_states):
        act_fn = self._resolve()
        return act_fn(F.linear(hidden_states, self.W_gate)) * F.linear(hidden_states, self.W_in)
'''

_RUN_HARVEST_LOCAL = '''
class Cfg:
    def __init__(self, a):
        self.hidden_act = a
x = torch.randn(2, 3, 8, requires_grad=True)
ms = [Bridge(8, 12, Cfg(a)) for a in ("silu", "gelu", "relu")]
out = tuple(m(x) for m in ms) + tuple(m.forward_method(x) for m in ms)
leaves = [x] + [m.W_gate for m in ms]
'''

# Protenix's inference loop: the activation in place, then `b *= a`
_HARVEST_AUGASSIGN = '''
import torch
import torch.nn.functional as F
from torch import nn


class Transition(nn.Module):
    def __init__(self, c, n):
        super().__init__()
        self.lin_a = nn.Linear(c, n * c, bias=False)
        self.lin_b = nn.Linear(c, n * c, bias=False)
        self.out = nn.Linear(n * c, c, bias=False)

    def forward(self, x):
        outputs = []
        for chunk in torch.chunk(x, 2, dim=0):
            a = self.lin_a(chunk)
            a = F.silu(a, True)
            b = self.lin_b(chunk)
            b *= a
            del a
            outputs.append(self.out(b))
        return torch.cat(outputs)

    def forward_up_first(self, x):
        h = self.lin_b(x)
        h *= F.silu(self.lin_a(x))
        return self.out(h)
'''

_RUN_HARVEST_AUGASSIGN = '''
m = Transition(8, 2)
x = torch.randn(6, 8)
out = (m(x), m.forward_up_first(x))
'''

# xformers' decomposed SwiGLU: `x @ w.transpose(-2, -1) + b` projections as plain function arguments
_HARVEST_BIASED = '''
import torch
import torch.nn.functional as F


def swiglu_reference(x, w1, b1, w2, b2, w3, b3):
    x1 = x @ w1.transpose(-2, -1) + b1
    x2 = x @ w2.transpose(-2, -1) + b2
    hidden = F.silu(x1) * x2
    return hidden @ w3.transpose(-2, -1) + b3
'''

_RUN_HARVEST_BIASED = '''
x = torch.randn(5, 8, requires_grad=True)
w1, w2, w3 = torch.randn(12, 8), torch.randn(12, 8), torch.randn(8, 12)
b1, b2, b3 = torch.randn(12), torch.randn(12), torch.randn(8)
out = swiglu_reference(x, w1, b1, w2, b2, w3, b3)
leaves = [x]
'''

# the same inside a hand-written autograd.Function that saves the activation for its backward
_HARVEST_SAVED = '''
import torch
import torch.nn.functional as F


class DecomposedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        x1 = x @ w1.transpose(-2, -1) + b1
        x2 = x @ w2.transpose(-2, -1) + b2
        x3 = F.silu(x1)
        x4 = x3 * x2
        ctx.save_for_backward(x, w1, w2, x1, x2, x3)
        return x4
'''

# bigscience's GLU modules: the activation handed up to a base whose forward TorchScript compiles
_HARVEST_SCRIPTED_BASE = '''
import torch
from torch import nn
from torch.nn import functional as F


class _GLUBaseModule(nn.Module):
    def __init__(self, activation_fn):
        super().__init__()
        self.activation_fn = activation_fn

    def forward(self, x):
        x1, x2 = x.chunk(2, dim=(x.ndim - 1))
        return x1 * self.activation_fn(x2)


class SwiGLU(_GLUBaseModule):
    def __init__(self):
        super().__init__(F.silu)


swiglu = torch.jit.script(SwiGLU())
'''

Swiglu.FUSE += [
    Fuse(_HARVEST_CAST, expect={"activation": "config", "gate": "x", "up": "g", "dispatches_to": ["swiglu", "geglu"]},
         run=_RUN_HARVEST_CAST, name="harvest_activation_in_fp32_cast_back_to_the_gate_dtype"),
    Fuse(_HARVEST_CAST_TO, expect={"activation": "silu", "gate": "g"}, run=_RUN_HARVEST_CAST_TO,
         name="harvest_activation_cast_back_with_to_dtype"),
    Fuse(_HARVEST_CAST_TO.replace("F.silu(g.float()).to(g.dtype)", "F.silu(g.to(torch.float32)).to(dtype=g.dtype)"),
         expect={"activation": "silu", "gate": "g"}, run=_RUN_HARVEST_CAST_TO, name="harvest_activation_upcast_with_to_float32"),
    Fuse(_HARVEST_HOOKS, expect={"activation": "silu", "gate": "pre_act", "up": "pre_linear"}, run=_RUN_HARVEST_HOOKS,
         name="harvest_projections_through_identity_hook_modules"),
    Fuse(_HARVEST_HOOKS.replace("self.hook_pre_linear = HookPoint()", "self.hook_pre_linear = nn.Dropout()"),
         expect={"activation": "silu", "up": "pre_linear"}, run=_RUN_HARVEST_HOOKS, name="harvest_projection_through_a_dropout"),
    Fuse(_HARVEST_INHERITED, expect={"activation": "config", "gate": "self.gate_proj(x)", "up": "self.up_proj(x)"},
         name="harvest_activation_set_by_an_imported_base_class"),
    Fuse(_HARVEST_INHERITED_RUNNABLE, expect={"activation": "config", "dispatches_to": ["swiglu", "geglu"]}, run=_RUN_HARVEST_INHERITED,
         name="harvest_activation_set_by_a_base_class_made_elsewhere"),
    Fuse(_HARVEST_LOCAL, expect={"activation": "config", "gate": "gate_output", "up": "linear_output"}, run=_RUN_HARVEST_LOCAL,
         name="harvest_local_callable_from_a_module_function_or_a_method"),
    Fuse(_HARVEST_AUGASSIGN, expect={"activation": "silu", "up": "b", "line": 18, "end_line": 20}, run=_RUN_HARVEST_AUGASSIGN,
         name="harvest_product_as_augmented_assignment_after_an_in_place_activation"),
    Fuse(_HARVEST_BIASED, expect={"activation": "silu", "gate": "x1", "up": "x2"}, run=_RUN_HARVEST_BIASED,
         name="harvest_projections_as_matmul_plus_bias"),
]

Swiglu.KEEP += [
    # the activation's result rounded to the block input's dtype, not the gate's: under autocast
    # that is another dtype than the projection's, so it is not how the fused op rounds
    Keep(_HARVEST_CAST_TO.replace("F.silu(g.float()).to(g.dtype)", "F.silu(g.float()).to(x.dtype)"), reason="",
         name="harvest_activation_cast_to_another_tensors_dtype"),
    # a module built with arguments is no identity: the up operand is a normalised projection
    Keep(_HARVEST_HOOKS.replace("self.hook_pre_linear = HookPoint()", "self.hook_pre_linear = nn.LayerNorm(h)"),
         reason="not projections of one input", name="harvest_projection_through_a_module_with_weights"),
    # the inherited callable times a mask: no GLU structure, so not even a look-alike
    Keep(_HARVEST_INHERITED.replace("self.act(self.gate_proj(x)) * self.up_proj(x)", "self.act(self.gate_proj(x)) * x.ne(0)"),
         reason="", name="harvest_inherited_callable_times_a_mask"),
    # the class assigns the attribute itself (a projection), so it is not a callable chosen elsewhere
    Keep(_HARVEST_INHERITED.replace("self.gate_proj = nn.Linear(d, h)", "self.gate_proj = nn.Linear(d, h)\n        self.act = nn.Linear(h, h)"),
         reason="", name="harvest_attribute_assigned_by_the_class_itself"),
    # `up *= silu(g)` on a parameter: the caller's tensor is multiplied in place; a rebinding would not
    Keep('''
import torch
import torch.nn.functional as F


def gate_in_place(g, up):
    up *= F.silu(g)
    return up
''', reason="", name="harvest_augmented_product_on_a_parameter"),
    Keep('''
import torch
import torch.nn.functional as F
from torch import nn


class Up(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.lin_a = nn.Linear(c, 2 * c)
        self.lin_b = nn.Linear(c, 2 * c)

    def forward(self, x):
        h = self.lin_b(x).view(-1, 16)
        h *= F.silu(self.lin_a(x)).view(-1, 16)
        return h
''', reason="", name="harvest_augmented_product_on_a_view"),
    Keep(_HARVEST_SAVED, reason="the activation's result `x3` is saved for its backward",
         name="harvest_autograd_function_saving_the_activation"),
    # the bias is the projection's own input: a residual, not an affine projection
    Keep(_HARVEST_BIASED.replace("x2 = x @ w2.transpose(-2, -1) + b2", "x2 = x @ w2.transpose(-2, -1) + x"),
         reason="transformed after its projection", name="harvest_matmul_plus_its_own_input"),
    Keep(_HARVEST_SCRIPTED_BASE, reason="TorchScript compiles `_GLUBaseModule (passed to torch.jit.script)`",
         name="harvest_forward_inherited_by_a_scripted_class"),
]


def _interleaved_part(n: ast.Subscript, ctx: S.Ctx, s: ast.Slice, elts: list[ast.expr], trace: S.Trace, t: S.Trace) -> tuple:
    """``T[..., ::2]`` / ``T[..., 0::2]`` and ``T[..., 1::2]``: the even and odd columns of one
    fused gate/up projection (gpt-oss' interleaved layout). Two parts of one tensor, taken as two
    operands: the fused op gets them concatenated (``torch.cat([T[..., ::2], T[..., 1::2]], -1)``:
    exact; the copy is the cost, as for two projections; de-interleaving the weight's rows once
    makes the op take ``T`` itself). Any other strided slice is refused (GateMiss)."""
    lower, step, upper = const_value(s.lower) if s.lower is not None else 0, const_value(s.step), s.upper
    if step != 2 or upper is not None or lower not in (0, 1) or not elts[:-1] or not all(
            isinstance(e, ast.Constant) and e.value is Ellipsis for e in elts[:-1]):
        raise GateMiss("gate and up interleaved (x[..., ::2] / x[..., 1::2]): the fused op splits contiguous halves")
    trace.stmts.update(t.stmts)
    return (S.key(n.value, ctx), n.value, ctx, ast.Constant(-1), lower, "interleaved", True)


_HARVEST_INTERLEAVED = '''
import torch
import torch.nn.functional as F
from torch import nn


class InterleavedSwiGLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w = nn.Linear(d, 2 * h)

    def forward(self, x):
        h = self.w(x)
        return F.silu(h[..., ::2]) * h[..., 1::2]

    def forward_named(self, x):
        gate_up = self.w(x)
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
        return up * F.silu(gate)
'''

Swiglu.FUSE += [
    Fuse(_HARVEST_INTERLEAVED, expect={"activation": "silu", "gate": "h[..., ::2]", "up": "h[..., 1::2]"},
         run="m = InterleavedSwiGLU(8, 6)\nx = torch.randn(3, 8, requires_grad=True)\nout = (m(x), m.forward_named(x))\nleaves = [x, m.w.weight]\n",
         name="harvest_interleaved_gate_up_columns"),
]
Swiglu.KEEP += [
    # odd columns activated against a stride-3 slice: not the two halves of one interleaving
    Keep(_HARVEST_INTERLEAVED.replace("1::2]", "1::3]"), reason="interleaved",
         name="harvest_interleaved_other_stride"),
]


# --------------------------------------------------------------------------------------------
# s26 (issue 14): opaque activation objects, in-place spellings, non-GLU defaults
#
# Three mechanisms, each for a family rather than a spelling:
# - an activation attribute whose value npufuse cannot resolve statically (`self.act =
#   activation.build()`, `registry[name]()`, `cfg.make_act()`) is a weak config-chosen activation:
#   reported only where the product has a GLU's structure, and the fused branch tests the object at
#   run time (silu -> npu_swiglu, gelu -> npu_geglu, anything else the original code);
# - `act(a, inplace=True)` writes its operand: fused only when that operand is a value no other
#   code reads (a fresh projection output), and `fresh.mul_(b)` inside an expression is the product;
# - a config-chosen activation whose known default is no activation the fused ops compute (a
#   Dauphin GLU's Sigmoid) is a near miss, not a candidate that never runs.

# tensor methods that return (a view of) their receiver, not a new tensor: their result aliases it
_ALIASING_METHODS = frozenset(("view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "contiguous", "to",
                               "type_as", "type", "float", "half", "bfloat16", "double", "squeeze", "unsqueeze", "expand",
                               "expand_as", "narrow", "select", "flatten", "unflatten", "detach", "as_strided", "movedim",
                               "swapaxes", "swapdims", "chunk", "split", "unbind", "tensor_split", "real", "imag", "data"))


def _inplace_call(call: ast.Call) -> bool:
    """``F.silu(t, inplace=True)`` / ``t.silu_()`` style: the call writes its operand and returns it."""
    kw = next((k for k in call.keywords if k.arg == "inplace"), None)
    if kw is not None:
        return const_value(kw.value) is not False
    name = call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id if isinstance(call.func, ast.Name) else ""
    return name.endswith("_") and not name.endswith("__")


def _fresh_tensor(module: ModuleInfo, node: ast.expr) -> bool:
    """``node`` evaluates to a tensor no name or attribute holds: an arithmetic result, or a call
    (a projection, an activation) that returns a new tensor; an in-place call's result is its
    operand, so it is fresh only when that operand is. Names, attributes, subscripts and views are not."""
    for _ in range(8):
        if isinstance(node, ast.BinOp):
            return True
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        if isinstance(f, ast.Attribute) and (f.attr in _ALIASING_METHODS or f.attr.endswith("_")) and not f.attr.endswith("__") \
                and not (isinstance(f.value, ast.Name) and f.value.id in module.aliases):
            node = f.value  # `t.view(...)` / `t.mul_(...)`: the receiver's storage
            continue
        if _inplace_call(node):
            if not node.args or isinstance(node.args[0], ast.Starred):
                return False
            node = node.args[0]
            continue
        return True
    return False


def _fresh_inplace_product(module: ModuleInfo, call: ast.Call) -> tuple[ast.expr, ast.expr] | None:
    """``fresh.mul_(b)`` used as a value (``F.silu(self.w1(x), inplace=True).mul_(self.w3(x))``): the
    product ``fresh * b``; the tensor it writes is a temporary nothing else reads, so the fused
    op's new tensor is the same value. None for any receiver a name or attribute may hold."""
    f = call.func
    if not (isinstance(f, ast.Attribute) and f.attr in ("mul_", "multiply_") and len(call.args) == 1 and not call.keywords
            and not isinstance(call.args[0], ast.Starred)):
        return None
    if not _fresh_tensor(module, f.value):
        return None
    return f.value, call.args[0]


def _act_call_of(scope: Scope, act: Act) -> ast.Call | None:
    """The call that applies ``act`` (its first argument is the activation's operand)."""
    if act.gate is None:
        return None
    for n in fast_walk(scope.node):
        if isinstance(n, ast.Call) and n.args and n.args[0] is act.gate:
            return n
    return None


def _inplace_alias_reason(module: ModuleInfo, scope: Scope, g: Gate) -> str | None:
    """An in-place activation (``F.silu(h, inplace=True)``, ``self.act = nn.SiLU(inplace=True)``)
    on a tensor other code reads: the original leaves act(h) in ``h`` for those reads, the fused op
    would leave ``h`` as it was. The reason, or None when the operand is fresh or read nowhere else."""
    call = _act_call_of(scope, g.act)
    if call is None:
        return None
    inplace = _inplace_call(call)
    if not inplace and isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) and call.func.value.id == "self":
        value = S.init_assignments(module, scope.class_name).get(call.func.attr)
        inplace = isinstance(value, ast.Call) and any(k.arg == "inplace" and const_value(k.value) is not False for k in value.keywords)
    if not inplace:
        return None
    operand = call.args[0]
    if _fresh_tensor(module, operand):
        return None
    if isinstance(operand, ast.Name):
        inside = {id(n) for n in fast_walk(call)}
        reads = [n for n in fast_walk(scope.node) if isinstance(n, ast.Name) and n.id == operand.id
                 and isinstance(n.ctx, ast.Load) and id(n) not in inside]
        if not reads:
            return None
        return (f"in-place activation on `{operand.id}`, which line {reads[0].lineno} also reads: the original leaves "
                f"the activation's result in `{operand.id}`, the fused op would leave it unchanged")
    return (f"in-place activation on `{ast.unparse(operand)}`, which other code may hold: the original leaves the "
            "activation's result there, the fused op would leave it unchanged")


_NOT_ACTIVATIONS = frozenset(("torch.nn.Linear", "torch.nn.Dropout", "torch.nn.LayerNorm", "torch.nn.Identity", "torch.nn.Embedding",
                              "torch.nn.Conv1d", "torch.nn.Conv2d", "torch.nn.Sequential", "torch.nn.ModuleList"))


def _opaque_object_act(module: ModuleInfo, value: ast.expr, f: ast.Attribute, gate: ast.expr, ctx: S.Ctx, desc: str) -> Act | None:
    """``self.act = activation.build()`` / ``self.act = registry[name]()`` / ``self.act = cfg.act``:
    an object whose identity configuration decides elsewhere, so no static reading says what it is.
    Weak (a candidate only where the product is a GLU's: an activation of one projection times
    another projection of the same input) and dispatched on the object at run time. Never a torch
    name (those are known: a torch callable that is no activation stays none) or a class of this module
    (its forward says what it computes)."""
    call = value.func if isinstance(value, ast.Call) else value
    if isinstance(call, ast.Subscript):
        call = call.value
    name = module.canonical(call) or ""
    if name.startswith("torch.") or name in _NOT_ACTIVATIONS:
        return None
    root = call
    while isinstance(root, (ast.Attribute, ast.Call, ast.Subscript)):
        root = root.value if not isinstance(root, ast.Call) else root.func
    if not isinstance(root, ast.Name) or root.id in module.classes or (isinstance(call, ast.Name) and call.id in module.classes):
        return None
    if root.id in _BUILTIN_NAMES or root.id in ("self", "cls"):
        # `getattr(F, "relu")` / `getattr(self, name)` are read by _getattr_act (a resolved relu is
        # no activation to dispatch on); the object's own methods by the lookups above
        return None
    return Act(CONFIG, gate, ctx, desc, obj=f, gelu_hint=_gelu_hint(f.attr, None), weak=True)


_BUILTIN_NAMES = frozenset(dir(__import__("builtins")))


def _visible_choices(module: ModuleInfo, scope: Scope, act: Act) -> set[str]:
    """Activation kinds the code itself offers for ``self.<attr>``: every value __init__ assigns it,
    the arms of a conditional, the entries of a table it is looked up in (a transformers-style name
    table offers silu and gelu)."""
    if not (isinstance(act.obj, ast.Attribute) and isinstance(act.obj.value, ast.Name) and act.obj.value.id == "self"):
        return set()
    cls_name = _assigning_class(module, scope.class_name, act.obj.attr) or scope.class_name
    out: set[str] = set()
    values = list(_init_values(module, cls_name, act.obj.attr))
    while values:
        v = values.pop()
        if isinstance(v, ast.IfExp):
            values += [v.body, v.orelse]
            continue
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Subscript):
            v = v.func
        if isinstance(v, ast.Subscript):
            if (dotted(v.value) or "").split(".")[-1] in _ACT_TABLES:
                out |= {SILU, GELU}
            own = _own_act_table(module, v.value)
            out |= {k for k, _ in own.values()} if own else set()
            continue
        k = _module_act(module, v)
        if k is not None and k[0] != CONFIG:
            out.add(k[0])
    return out | _compared_choices(module, cls_name, act.obj.attr) | _constructor_choices(module, cls_name)


def _compared_choices(module: ModuleInfo, cls_name: str | None, attr: str) -> set[str]:
    """Activations the class tests ``self.<attr>`` against (``self.activation == F.silu``,
    ``self.act is F.gelu``, ``isinstance(self.act, nn.SiLU)``): the code itself expects them."""
    cls = module.classes.get(cls_name or "")
    if cls is None:
        return set()
    target = f"self.{attr}"
    out: set[str] = set()
    for n in fast_walk(cls):
        others: list[ast.expr] = []
        if isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], (ast.Eq, ast.Is)):
            left, right = n.left, n.comparators[0]
            others = [right] if dotted(left) == target else [left] if dotted(right) == target else []
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "isinstance" and len(n.args) == 2 \
                and dotted(n.args[0]) == target:
            cls_arg = n.args[1]
            others = [ast.Call(func=e, args=[], keywords=[]) for e in (cls_arg.elts if isinstance(cls_arg, ast.Tuple) else [cls_arg])]
        for o in others:
            k = _module_act(module, o)
            if k is not None and k[0] != CONFIG:
                out.add(k[0])
    return out


def _unfusable_default_reason(module: ModuleInfo, scope: Scope, act: Act) -> str | None:
    """A config-chosen activation whose default is known and is no activation the fused ops compute,
    with no fusable choice anywhere in the code (a Dauphin GLU's ``act or nn.Sigmoid()``): only a
    caller elsewhere could make it a SwiGLU, so it is a near miss. Where the code itself offers silu
    or gelu (a name table, branches), the site stays a run-time dispatched candidate."""
    if act.kind != CONFIG or act.default is None or act.default in (SILU,) + GELU_KINDS:
        return None
    if _visible_choices(module, scope, act) & {SILU, GELU, GELU_TANH}:
        return None
    if _default_branched_away(module, scope, act):
        return None
    built = _s36_repo_choices(module, scope, act)
    if built is not None and built[0] & {SILU, GELU, GELU_TANH, CONFIG}:
        return None  # s36: some construction passes silu/gelu or an object npufuse cannot read: dispatched at run time
    where = ""
    if built is not None:
        where = (f"; every construction of the class in the repository ({built[1]}) passes "
                 + (" or ".join(sorted(built[0])) if built[0] else "nothing for it") if built[1] else
                 "; no construction of the class in the repository passes another")
    return (f"activation chosen by configuration ({act.describe}) defaults to {act.default}, which no fused gated op "
            f"computes (npu_swiglu: silu, npu_geglu: gelu){where}; a sigmoid or relu GLU is not a SwiGLU")


def _fallback_kind(module: ModuleInfo, cls_name: str | None, values: list[ast.expr], kinds: list[str]) -> str | None:
    """``self.act = act if act is not None else nn.SiLU()`` as branches: the unresolved values are
    __init__ parameters handed in by the caller, the known ones one kind: that kind is the default."""
    params = S.init_params(module, cls_name)
    unknown = [v for v, k in zip(values, kinds) if k == CONFIG]
    known = {k for k in kinds if k != CONFIG}
    if len(known) == 1 and unknown and all(isinstance(v, ast.Name) and v.id in params for v in unknown):
        return known.pop()
    return None


def _param_or_default_act(module: ModuleInfo, value: ast.IfExp, f: ast.Attribute, gate: ast.expr, ctx: S.Ctx, desc: str,
                          cls_name: str | None) -> Act | None:
    """``self.act = act if act is not None else nn.SiLU()``: the caller's object (an __init__
    parameter) or a known activation when none is passed. Config-chosen with that default: weak
    (reported only on a GLU's structure), dispatched on the object at run time; a default the
    fused ops do not compute (a Sigmoid GLU) makes it a near miss (see _unfusable_default_reason)."""
    params = S.init_params(module, cls_name)
    arms = (value.body, value.orelse)
    passed = [a for a in arms if _caller_supplied(a, params)]
    others = [a for a in arms if not _caller_supplied(a, params)]
    if len(passed) != 1 or len(others) != 1:
        return None
    k = _module_act(module, others[0])
    if k is None or k[0] in (CONFIG, GELU_DYN):
        return None
    return Act(CONFIG, gate, ctx, desc, obj=f, gelu_hint=k[0] in GELU_KINDS, default=k[0], weak=True)


def _one_value_check(a: ast.expr, actx: S.Ctx, b: ast.expr, ctx: S.Ctx) -> None:
    """``act(h) * h``: gate and up are one value. That is an activation of one tensor (x * silu(x)),
    not a gated linear unit's two projections; the fused op would take the value twice (a copy of
    both in torch.cat) for no fusion gain, so it is no candidate."""
    if S.key(a, actx) == S.key(b, ctx) and not _swiglu_s43.distinct_objects(a, actx, b, ctx):
        raise GateMiss("gate and up are one value (act(h) * h): an activation of a single tensor, not a gated linear "
                       "unit with two projections")


# --- s26 examples: opaque activation objects (issue 14, class 6) ---

_S26_OPAQUE = '''
import enum
import functools

import torch
import torch.nn.functional as F
from torch import nn


class Activation(str, enum.Enum):
    silu = "silu"
    gelu_tanh = "gelu_tanh"
    relu = "relu"

    def build(self):
        if self is Activation.silu:
            return F.silu
        if self is Activation.gelu_tanh:
            return functools.partial(F.gelu, approximate="tanh")
        return F.relu


class GatedFeedForward(nn.Module):
    def __init__(self, d, h, activation=Activation.silu):
        super().__init__()
        self.act_fn = activation.build()
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(self.act_fn(self.gate(x)) * self.up(x))
'''

_RUN_S26_OPAQUE = '''
x = torch.randn(2, 3, 8, requires_grad=True)
ms = [GatedFeedForward(8, 12, a) for a in (Activation.silu, Activation.gelu_tanh, Activation.relu)]
out = tuple(m(x) for m in ms)
leaves = [x] + [m.gate.weight for m in ms]
'''

_S26_REGISTRY = '''
import torch
from torch import nn

ACTIVATIONS = {}


def register(name, cls):
    ACTIVATIONS[name] = cls


register("swish", nn.SiLU)
register("gelu", nn.GELU)
register("relu", nn.ReLU)


class Config:
    def __init__(self, act="swish"):
        self.act = act

    def make_activation(self):
        return ACTIVATIONS[self.act]()


class RegistryGLU(nn.Module):
    def __init__(self, d, h, act="swish"):
        super().__init__()
        self.act = ACTIVATIONS[act]()
        self.w_in = nn.Linear(d, 2 * h)
        self.w_out = nn.Linear(h, d)

    def forward(self, x):
        a, b = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(self.act(a) * b)


class ConfigMethodGLU(nn.Module):
    def __init__(self, cfg, d, h):
        super().__init__()
        self.activation = cfg.make_activation()
        self.w1 = nn.Linear(d, h)
        self.w3 = nn.Linear(d, h)

    def forward(self, x):
        h = self.activation(self.w1(x))
        return h * self.w3(x)
'''

_RUN_S26_REGISTRY = '''
x = torch.randn(2, 3, 8, requires_grad=True)
ms = [RegistryGLU(8, 6, a) for a in ("swish", "gelu", "relu")] + [ConfigMethodGLU(Config(a), 8, 6) for a in ("swish", "gelu")]
out = tuple(m(x) for m in ms)
leaves = [x]
'''

Swiglu.FUSE += [
    # `activation.build()` on an enum the caller passes: only the object says what runs; the
    # functools.partial gelu(tanh) the enum builds takes npu_geglu, relu the original code
    Fuse(_S26_OPAQUE, expect={"activation": "config", "runtime_check": "activation type", "dispatches_to": ["swiglu", "geglu"],
                              "gate": "self.gate(x)", "up": "self.up(x)"},
         run=_RUN_S26_OPAQUE, name="s26_opaque_activation_built_from_an_enum"),
    # a registry filled by calls (no literal table to read), halves of one projection
    Fuse(_S26_REGISTRY, expect={"activation": "config", "source": "split", "order": "gate_first"},
         run=_RUN_S26_REGISTRY, name="s26_opaque_activation_from_a_registry_lookup"),
    # a method of a configuration object builds it; the activation assigned to a name first
    Fuse(_S26_REGISTRY.split("class RegistryGLU")[0] + "class ConfigMethodGLU" + _S26_REGISTRY.split("class ConfigMethodGLU")[1],
         expect={"activation": "config", "gate": "self.w1(x)", "up": "self.w3(x)"},
         run="x = torch.randn(2, 8, requires_grad=True)\nout = tuple(ConfigMethodGLU(Config(a), 8, 6)(x) for a in ('swish', 'gelu', 'relu'))\nleaves = [x]\n",
         name="s26_opaque_activation_from_a_config_method"),
]

Swiglu.KEEP += [
    # the opaque object applied to the projection the other factor also is: x * act(x) of one
    # tensor, not a GLU; opaque objects report nothing outside a GLU's structure
    Keep(_S26_OPAQUE.replace("* self.up(x)", "* self.gate(x)"), reason="", name="s26_opaque_activation_times_the_same_projection"),
    # ... nor beside a tensor that is no projection of the input (a residual gate)
    Keep(_S26_OPAQUE.replace("self.down(self.act_fn(self.gate(x)) * self.up(x))", "self.down(self.act_fn(self.gate(x)) * x)"),
         reason="", name="s26_opaque_activation_times_the_residual"),
    # a known activation on one value twice: silu(h) * h, an activation of one tensor
    Keep(_S26_OPAQUE.replace("self.act_fn(self.gate(x)) * self.up(x)", "F.silu(self.gate(x)) * self.gate(x)"),
         reason="gate and up are one value", name="s26_silu_of_a_projection_times_itself"),
]


# --- s26 examples: in-place activations and products (issue 14) ---

_S26_INPLACE = '''
import torch
import torch.nn.functional as F
from torch import nn


class InplaceGLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fcg = nn.Linear(d, h, bias=False)
        self.fc1 = nn.Linear(d, h, bias=False)
        self.fc2 = nn.Linear(h, d, bias=False)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x):
        return self.fc2(F.silu(self.fcg(x), inplace=True).mul_(self.fc1(x)))

    def forward_module(self, x):
        return self.fc2(self.act(self.fcg(x)) * self.fc1(x))
'''

_RUN_S26_INPLACE = '''
m = InplaceGLU(8, 12)
x = torch.randn(2, 3, 8, requires_grad=True)
out = (m(x), m.forward_module(x))
leaves = [x, m.fcg.weight, m.fc1.weight]
'''

_S26_INPLACE_NAMED = '''
import torch
import torch.nn.functional as F
from torch import nn


class GLUWithStats(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fcg = nn.Linear(d, h, bias=False)
        self.fc1 = nn.Linear(d, h, bias=False)

    def forward(self, x):
        g = self.fcg(x)
        y = F.silu(g, inplace=True) * self.fc1(x)
        return y, g.mean()
'''

Swiglu.FUSE += [
    # in-place silu on a fresh projection output, then `.mul_` on that temporary: the product as a value
    Fuse(_S26_INPLACE, expect={"activation": "silu", "gate": "self.fcg(x)", "up": "self.fc1(x)"},
         run=_RUN_S26_INPLACE, name="s26_inplace_silu_then_mul_on_a_temporary"),
    # an `inplace=True` activation module on a fresh projection output
    Fuse(_S26_INPLACE.replace("return self.fc2(F.silu(self.fcg(x), inplace=True).mul_(self.fc1(x)))",
                              "return self.fc2(self.act(self.fcg(x)) * self.fc1(x))"),
         expect={"activation": "silu"}, run=_RUN_S26_INPLACE, name="s26_inplace_activation_module_on_a_projection"),
]

Swiglu.KEEP += [
    # the in-place silu writes `g`, which the return statement reads: the rewrite would change it
    Keep(_S26_INPLACE_NAMED, reason="in-place activation on `g`", name="s26_inplace_silu_on_a_tensor_read_later"),
    # the same through an inplace=True module held by the layer
    Keep(_S26_INPLACE_NAMED.replace("self.fc1 = nn.Linear(d, h, bias=False)", "self.fc1 = nn.Linear(d, h, bias=False)\n        self.act = nn.SiLU(inplace=True)")
         .replace("F.silu(g, inplace=True)", "self.act(g)"),
         reason="in-place activation on `g`", name="s26_inplace_activation_module_on_a_tensor_read_later"),
]


# --- s26 examples: caller-chosen activation with a known default (issue 14) ---

_S26_DEFAULT = '''
import torch
from torch import nn


class GLUFFN(nn.Module):
    def __init__(self, d, h, gate_activation=None):
        super().__init__()
        self.gate_proj = nn.Linear(d, h)
        self.inner_proj = nn.Linear(d, h)
        self.output_proj = nn.Linear(h, d)
        self.gate_activation = gate_activation if gate_activation is not None else nn.SiLU()

    def forward(self, x):
        return self.output_proj(self.gate_activation(self.gate_proj(x)) * self.inner_proj(x))
'''

_RUN_S26_DEFAULT = '''
x = torch.randn(2, 3, 8, requires_grad=True)
ms = [GLUFFN(8, 6), GLUFFN(8, 6, nn.GELU()), GLUFFN(8, 6, nn.Sigmoid())]
out = tuple(m(x) for m in ms)
leaves = [x] + [m.gate_proj.weight for m in ms]
'''

_S26_DEFAULT_BRANCHES = '''
import torch
from torch import nn


class DauphinFFN(nn.Module):
    def __init__(self, d, h, inner_activation=None):
        super().__init__()
        self.inner_proj = nn.Linear(d, 2 * h)
        if inner_activation is not None:
            self.inner_activation = inner_activation
        else:
            self.inner_activation = nn.Sigmoid()
        self.output_proj = nn.Linear(h, d)

    def forward(self, x):
        a, b = self.inner_proj(x).chunk(2, dim=-1)
        return self.output_proj(self.inner_activation(a) * b)
'''

_S26_DEFAULT_FACTORY = '''
import torch
from torch import nn


class GluMlp(nn.Module):
    def __init__(self, d, h, act_layer=nn.Sigmoid):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * h)
        self.act = act_layer()
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        x = self.fc1(x)
        x1, x2 = x.chunk(2, dim=-1)
        return self.fc2(self.act(x1) * x2)
'''

Swiglu.FUSE += [
    # the caller's object or nn.SiLU(): config-chosen with a silu default, dispatched on the object
    Fuse(_S26_DEFAULT, expect={"activation": "config", "default_activation": "silu", "dispatches_to": ["swiglu", "geglu"]},
         run=_RUN_S26_DEFAULT, name="s26_caller_activation_or_silu_default"),
    # the same as if/else statements in __init__ (a Dauphin-style layer whose default is SiLU)
    Fuse(_S26_DEFAULT_BRANCHES.replace("nn.Sigmoid()", "nn.SiLU()"), expect={"activation": "config", "default_activation": "silu"},
         run="x = torch.randn(2, 8, requires_grad=True)\nout = (DauphinFFN(8, 6)(x), DauphinFFN(8, 6, nn.GELU())(x))\nleaves = [x]\n",
         name="s26_caller_activation_or_silu_default_in_branches"),
]

Swiglu.KEEP += [
    # a sigmoid GLU by default; only some caller elsewhere could pass a SiLU: not a SwiGLU site
    Keep(_S26_DEFAULT.replace("nn.SiLU()", "nn.Sigmoid()"), reason="defaults to sigmoid", name="s26_caller_activation_or_sigmoid_default"),
    Keep(_S26_DEFAULT_BRANCHES, reason="defaults to sigmoid", name="s26_caller_activation_or_sigmoid_default_in_branches"),
    # timm-style act_layer class with a Sigmoid default (GluMlp)
    Keep(_S26_DEFAULT_FACTORY, reason="defaults to sigmoid", name="s26_act_layer_factory_with_sigmoid_default"),
]


def _default_branched_away(module: ModuleInfo, scope: Scope, act: Act) -> bool:
    """The product sits where the default never runs: the else of ``if self.act == <default>:``
    (flash-attn's GatedMlp sends its F.sigmoid default to F.glu and multiplies only otherwise), or
    the body of ``if self.act != <default>:``."""
    if act.gate is None or not isinstance(act.obj, ast.Attribute):
        return False
    target, line = dotted(act.obj), act.gate.lineno
    for n in fast_walk(scope.node):
        if not (isinstance(n, ast.If) and isinstance(n.test, ast.Compare) and len(n.test.ops) == 1):
            continue
        left, right = n.test.left, n.test.comparators[0]
        other = right if dotted(left) == target else left if dotted(right) == target else None
        k = _module_act(module, other) if other is not None else None
        if k is None or k[0] != act.default:
            continue
        away = n.orelse if isinstance(n.test.ops[0], (ast.Eq, ast.Is)) else n.body if isinstance(n.test.ops[0], (ast.NotEq, ast.IsNot)) else []
        if away and away[0].lineno <= line <= (away[-1].end_lineno or away[-1].lineno):
            return True
    return False

_S26_DEFAULT_SPECIAL_CASED = '''
import torch
import torch.nn.functional as F
from torch import nn


class GatedMlp(nn.Module):
    def __init__(self, d, h, activation=F.sigmoid):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * h)
        self.activation = activation
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        y = self.fc1(x)
        if self.activation == F.sigmoid:
            y = F.glu(y, dim=-1)
        else:
            y, gate = y.chunk(2, dim=-1)
            y = y * self.activation(gate)
        return self.fc2(y)
'''

Swiglu.FUSE += [
    # the sigmoid default goes to F.glu; the product runs only for another activation: a candidate
    # dispatched on the object (silu on the second half: the halves swapped)
    Fuse(_S26_DEFAULT_SPECIAL_CASED, expect={"activation": "config", "order": "up_first"},
         run="x = torch.randn(2, 8, requires_grad=True)\nout = tuple(GatedMlp(8, 6, a)(x) for a in (F.sigmoid, F.silu, F.gelu, F.relu))\nleaves = [x]\n",
         name="s26_sigmoid_default_special_cased_away_from_the_product"),
]
Swiglu.KEEP += [
    # the same product reached by the default itself (the special case tests another activation)
    Keep(_S26_DEFAULT_SPECIAL_CASED.replace("if self.activation == F.sigmoid:", "if self.activation == F.relu:"),
         reason="defaults to sigmoid", name="s26_sigmoid_default_reaching_the_product"),
]


# --- s26: an operand transformed under a condition before the product (fairseq2/Gemma3n sparsity) ---

_CONDITIONAL_NOTE = ("`{name}` may be transformed under a condition before the product (e.g. a sparsified gate): the fused op "
                     "takes its value as it is at the activation, so the transform stays outside and runs as before; the "
                     "fused branch also checks that gate and up have one shape")


def _conditionally_transformed_gate(module: ModuleInfo, act: Act, a: ast.expr, actx: S.Ctx, b: ast.expr, ctx: S.Ctx,
                                    node: ast.expr, trace: S.Trace, ia: str | None, ib: str | None) -> Gate | None:
    """``gate = self.gate_proj(x); if flag: gate = sparsify(gate); gate = act(gate); up = self.up(x);
    up * gate``: the activated name's first assignment projects the other operand's input, and every
    later one before the activation transforms the name itself (so each path starts from that
    projection). The fused op takes the name's value at the activation (whatever the branch did), so
    the conditional statements stay outside the replaced span; shapes are checked at run time. Only
    the activated operand is taken this way; an up operand changed under a condition stays a near miss."""
    if ia == ib or not _conditionally_projected(module, a, actx, ib):
        return None
    # the up operand is left as written (a name stays a name): the fused branch compares the two
    # operands' shapes, so both must be values it can read without computing them again. Its own
    # statement (`seqs = self.inner_proj(seqs)`) stays verbatim, even where reading the factors
    # followed it (an imported Linear looks like an activation object to _act_of)
    if isinstance(b, ast.Name):
        d = S.definition(ctx, b.id)
        if d is not None and id(d[0]) in trace.stmts and S.names_written(d[0]) == {b.id}:
            others = set().union(*(S.names_written(st) for k, st in trace.stmts.items() if k != id(d[0])))
            if not (S.names_read(d[0]) & others):
                del trace.stmts[id(d[0])]
    return Gate(act, Operand(a, actx), Operand(b, ctx), node, None, trace, ib, shape_checked=True)


def _shape_checked_fused(module: ModuleInfo, g: Gate, plan: S.SpanPlan, fused: str, kept_first: list[str]) -> str:
    """The kept statements, then ``if a.shape == b.shape: <fused root> else: <the replaced
    statements as written>``: the shapes are read after everything the operands need has run.
    Raises RenderError when an operand is no plain name (checking it would compute it twice) or an
    optional branch restructured the span."""
    if len(kept_first) != len(plan.kept):
        raise S.RenderError("an optional branch and a run-time shape check in one span")
    if g.inline_guard is not None:
        test = _inline_shape_test(module, g, plan)
        return "\n".join(kept_first + [f"if {test}:", S.indent(fused),
                                        "else:  # operands of different shapes (broadcasting): the original code",
                                        S.indent(_replaced_source(module, plan))])
    ga, gb = (S.render(module, op.node, op.ctx, plan) for op in (g.a, g.b))
    if not (ga.isidentifier() and gb.isidentifier()):
        raise S.RenderError("the operands' shapes must be checked at run time, and an operand is computed in the product itself")
    return "\n".join(kept_first + [f"if {ga}.shape == {gb}.shape:", S.indent(fused),
                                    "else:  # operands of different shapes (broadcasting): the original code",
                                    S.indent(_replaced_source(module, plan))])


def _replaced_source(module: ModuleInfo, plan: S.SpanPlan) -> str:
    """The span's statements the fused code replaces (the kept ones already ran before), as written."""
    return "\n".join(S.stmt_source(module, st) for st in plan.stmts if not any(st is k for k in plan.kept))


_S26_SPARSE_GATE = '''
import torch
from torch import nn


class SparseGateMLP(nn.Module):
    """Gemma3n: the gate projection is sparsified under a condition before the activation."""

    def __init__(self, d, h, sparsity):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.act_fn = nn.SiLU()
        self.sparsity = sparsity

    def forward(self, x):
        gate_proj = self.gate_proj(x)
        if self.sparsity > 0.0:
            gate_proj = torch.relu(gate_proj - 1.0)
        activations = self.act_fn(gate_proj)
        up_proj = self.up_proj(x)
        return self.down_proj(activations * up_proj)
'''

_S26_GLU_FFN_CONDITIONAL = '''
import torch
import torch.nn.functional as F
from torch import nn


class GLUFeedForward(nn.Module):
    def __init__(self, d, h, gate_activation=None, sparsity=0.0, dropout_p=0.0):
        super().__init__()
        self.gate_proj = nn.Linear(d, h)
        self.gate_activation = gate_activation if gate_activation is not None else nn.SiLU()
        self.inner_proj = nn.Linear(d, h)
        self.inner_dropout = nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.output_proj = nn.Linear(h, d)
        self.sparsity = sparsity

    def _sparsify(self, t):
        cutoff = t.mean(dim=-1, keepdim=True) + t.std(dim=-1, keepdim=True) * self.sparsity
        return F.relu(t - cutoff)

    def forward(self, seqs):
        gate = self.gate_proj(seqs)
        if self.sparsity > 0.0:
            gate = self._sparsify(gate)
        gate = self.gate_activation(gate)
        seqs = self.inner_proj(seqs)
        seqs = seqs * gate
        del gate
        if self.inner_dropout is not None:
            seqs = self.inner_dropout(seqs)
        return self.output_proj(seqs)


class TanhGLU(nn.Module):
    def __init__(self, d, h, sparsity=0.0):
        super().__init__()
        self.gate_proj = nn.Linear(d, h)
        self.inner_proj = nn.Linear(d, h)
        self.output_proj = nn.Linear(h, d)
        self.sparsity = sparsity

    def forward(self, seqs):
        gate = self.gate_proj(seqs)
        if self.sparsity > 0.0:
            gate = F.relu(gate - gate.mean(dim=-1, keepdim=True))
        gate = F.gelu(gate, approximate="tanh")
        seqs = self.inner_proj(seqs)
        seqs = seqs * gate
        return self.output_proj(seqs)
'''

_RUN_S26_GLU_FFN_CONDITIONAL = '''
x = torch.randn(2, 3, 8, requires_grad=True)
ms = [GLUFeedForward(8, 6), GLUFeedForward(8, 6, sparsity=0.5), GLUFeedForward(8, 6, nn.GELU()), GLUFeedForward(8, 6, nn.ReLU())]
out = tuple(m(x) for m in ms)
leaves = [x] + [m.gate_proj.weight for m in ms]
'''

Swiglu.FUSE += [
    # the gate sparsified under a flag before the activation: the fused op takes the gate's value
    # at the activation, the condition stays outside; shapes checked at run time
    Fuse(_S26_SPARSE_GATE, expect={"activation": "silu", "gate": "gate_proj", "up": "up_proj"},
         run="x = torch.randn(2, 3, 8, requires_grad=True)\nout = (SparseGateMLP(8, 6, 0.0)(x), SparseGateMLP(8, 6, 0.5)(x))\nleaves = [x]\n",
         name="s26_gate_sparsified_under_condition"),
    # fairseq2-style GLU FFN: caller's gate activation (SiLU default), optional sparsity before and
    # optional dropout after the product, the input rebound by the up projection
    Fuse(_S26_GLU_FFN_CONDITIONAL, expect={"activation": "config", "default_activation": "silu", "gate": "gate", "up": "seqs"},
         run=_RUN_S26_GLU_FFN_CONDITIONAL, name="s26_glu_ffn_with_optional_sparsity_and_dropout"),
]

Swiglu.KEEP += [
    # the pre-activation name is read after the product: the fused path would leave it un-activated
    Keep(_S26_SPARSE_GATE.replace("return self.down_proj(activations * up_proj)", "return self.down_proj(activations * up_proj), activations.mean()"),
         reason="", name="s26_gate_sparsified_activation_read_later"),
    # the up operand is computed inside the product: its shape cannot be read before it is computed once
    Keep(_S26_SPARSE_GATE.replace("up_proj = self.up_proj(x)\n        return self.down_proj(activations * up_proj)",
                                  "return self.down_proj(activations * self.up_proj(x))"),
         reason="shapes must be checked at run time", name="s26_gate_sparsified_up_computed_in_the_product"),
    # the up operand changed under a condition by something that is no elementwise clamp/cast/scale
    # (s27: a scale is, see s27_up_scaled_under_condition): not proved a projection on every path
    Keep(_S26_SPARSE_GATE.replace("        if self.sparsity > 0.0:\n            gate_proj = torch.relu(gate_proj - 1.0)\n", "")
         .replace("up_proj = self.up_proj(x)\n", "up_proj = self.up_proj(x)\n        if self.sparsity > 0.0:\n            up_proj = torch.relu(up_proj)\n"),
         reason="", name="s26_up_transformed_under_condition"),
]


def _conditionally_projected(module: ModuleInfo, a: ast.expr | None, actx: S.Ctx, ib: str | None) -> bool:
    """``a`` is a name first assigned a projection of input ``ib``, then (under a condition) only
    transformed from itself (``gate = topk(gate)``) before ``actx``'s line."""
    if not isinstance(a, ast.Name) or ib is None:
        return False
    assigns = sorted(((st, v) for st, v in actx.scope.assignments.get(a.id, []) if st.lineno < actx.line), key=lambda t: t[0].lineno)
    if len(assigns) < 2:
        return False
    first_stmt, first = assigns[0]
    if first is None or _projection_input(first, actx.at(first_stmt.lineno), module) != ib:
        return False
    if any(v is None or a.id not in S.names_read(v) for _, v in assigns[1:]):
        return False
    idx = S.stmt_index(actx.scope)
    # unconditional transforms: the "transformed after its projection" reading applies instead
    return any(isinstance(anc, (ast.If, ast.For, ast.While, ast.Try, ast.With)) for st, _ in assigns[1:] for anc in S.ancestors(idx, st))


def _constructor_choices(module: ModuleInfo, cls_name: str | None) -> set[str]:
    """Activations this module passes when it builds the class (``GluMlp(..., act_layer=nn.SiLU)``,
    ``partial(GluMlp, act_layer=nn.SiLU)``, timm's SwiGLUPacked): keyword values that are activation
    objects or activation classes."""
    if not cls_name:
        return set()
    out: set[str] = set()
    for n in fast_walk(module.tree):
        if not isinstance(n, ast.Call):
            continue
        builds = dotted(n.func) == cls_name or (
            (dotted(n.func) or "").split(".")[-1] == "partial" and n.args and dotted(n.args[0]) == cls_name)
        if not builds:
            continue
        for kw in n.keywords:
            for v in (kw.value, ast.Call(func=kw.value, args=[], keywords=[])):
                k = _module_act(module, v)
                if k is not None and k[0] != CONFIG:
                    out.add(k[0])
    return out

Swiglu.FUSE += [
    # the Sigmoid default, but the module itself builds the layer with SiLU (timm's SwiGLUPacked):
    # a candidate dispatched on the object (the plain GLU runs the original code)
    Fuse("import functools\n" + _S26_DEFAULT_FACTORY + "\n\nSwiGLUPacked = functools.partial(GluMlp, act_layer=nn.SiLU)\n",
         expect={"activation": "config", "default_activation": "sigmoid"},
         run="x = torch.randn(2, 8, requires_grad=True)\nout = (SwiGLUPacked(8, 6)(x), GluMlp(8, 6)(x))\nleaves = [x]\n",
         name="s26_sigmoid_default_but_built_with_silu_in_the_module"),
]


# --- s27 glu: census classes (issue 14; helper session glu, branch s27-glu) ---


def _rank_padded_index(tensor: ast.expr, ctx: S.Ctx, elts: list[ast.expr]) -> list[ast.expr]:
    """``t[:, 0]`` where ``t = x.view(-1, 2, I)``: an index shorter than the tensor's rank leaves
    the trailing dims whole, so ``t[:, 0]`` is ``t[:, 0, :]`` (TGI/lorax ``gate_up_states``). The rank
    is proved by the defining ``view``/``reshape`` (one size argument per dim, no starred sizes); an
    index with an ellipsis or an unknown rank is returned as written."""
    if len(elts) < 2 or any(isinstance(e, ast.Constant) and e.value is Ellipsis for e in elts) or not isinstance(tensor, ast.Name):
        return elts  # a single index `t[0]` is a row of a batch, never a pair member
    value, _, stmt = S.follow(tensor, ctx)
    if stmt is None or not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                            and value.func.attr in ("view", "reshape") and not value.keywords):
        return elts
    sizes = value.args
    if len(sizes) == 1 and isinstance(sizes[0], (ast.Tuple, ast.List)):
        sizes = sizes[0].elts
    if not sizes or any(isinstance(a, ast.Starred) for a in sizes) or len(sizes) <= len(elts):
        return elts
    if len(sizes) == 1 and not isinstance(sizes[0], ast.Constant):
        return elts  # `t.view(shape)`: one argument that may be a whole shape
    return elts + [ast.Slice(lower=None, upper=None, step=None) for _ in range(len(sizes) - len(elts))]


def _lambda_act(module: ModuleInfo, value: ast.Lambda) -> tuple[str, ast.expr | None] | None:
    """``lambda x: F.gelu(x, approximate="tanh")`` (TGI's ``ACT2FN[act] if "gelu" not in act else
    lambda x: ...``): a one-parameter lambda whose body applies a known activation to that parameter
    and reads it nowhere else is that activation. Anything else in the body (a scale, a second use of
    the parameter) is no activation object."""
    a = value.args
    if len(a.args) != 1 or a.vararg or a.kwarg or a.kwonlyargs or a.defaults or a.posonlyargs:
        return None
    param = a.args[0].arg
    body = value.body
    if not (isinstance(body, ast.Call) and body.args and isinstance(body.args[0], ast.Name) and body.args[0].id == param):
        return None
    if sum(1 for n in ast.walk(body) if isinstance(n, ast.Name) and n.id == param) != 1:
        return None
    name = module.canonical(body.func)
    if name not in _FUNCS or _FUNCS[name] == SIGMOID:
        return None
    kind = _FUNCS[name]
    if kind == GELU:
        approx = S.arg(body, "approximate", 1)
        if approx is not None:
            v = const_value(approx)
            return (GELU_TANH, None) if v == "tanh" else (GELU, None) if v == "none" else (GELU_DYN, approx)
    return kind, None


_S27_PACKED_PAIR = '''
import torch
import torch.nn.functional as F
from torch import nn

ACT2FN = {"silu": nn.SiLU(), "relu": nn.ReLU(), "gelu": nn.GELU()}


class Cfg:
    def __init__(self, act):
        self.hidden_act = act


class PackedPairMLP(nn.Module):
    """A server-style MLP: one projection viewed as [N, 2, I]; a lambda for the gelu family."""

    def __init__(self, cfg, d, h):
        super().__init__()
        act = cfg.hidden_act
        self.act = (
            ACT2FN[act]
            if "gelu" not in act
            else lambda x: F.gelu(x, approximate="tanh" if act in ["gelu_fast", "gelu_pytorch_tanh"] else "none")
        )
        self.gate_up = nn.Linear(d, 2 * h, bias=False)
        self.down = nn.Linear(h, d, bias=False)
        self.inner = h

    def forward(self, x):
        gate_up = self.gate_up(x)
        gate_up = gate_up.view(-1, 2, self.inner)
        return self.down(self.act(gate_up[:, 0]) * gate_up[:, 1])
'''

_RUN_S27_PACKED_PAIR = '''
x = torch.randn(5, 8, requires_grad=True)
ms = [PackedPairMLP(Cfg(a), 8, 6) for a in ("silu", "relu", "gelu_pytorch_tanh")]
out = tuple(m(x) for m in ms)
leaves = [x] + [m.gate_up.weight for m in ms]
'''

_S27_LAMBDA_GATED = '''
import torch
import torch.nn.functional as F
from torch import nn

ACT2FN = {"silu": nn.SiLU(), "relu": nn.ReLU()}


class DenseGatedActDense(nn.Module):
    def __init__(self, act_name, d, h):
        super().__init__()
        self.wi_0 = nn.Linear(d, h, bias=False)
        self.wi_1 = nn.Linear(d, h, bias=False)
        self.wo = nn.Linear(h, d, bias=False)
        self.act = ACT2FN[act_name] if "gelu" not in act_name else lambda x: F.gelu(x, approximate="tanh")

    def forward(self, hidden_states):
        activated = self.act(self.wi_0(hidden_states))
        hidden_linear = self.wi_1(hidden_states)
        hidden_states = activated * hidden_linear
        return self.wo(hidden_states)
'''

_RUN_S27_LAMBDA_GATED = '''
x = torch.randn(2, 3, 8, requires_grad=True)
ms = [DenseGatedActDense(a, 8, 6) for a in ("silu", "gelu_new", "relu")]
out = tuple(m(x) for m in ms)
leaves = [x] + [m.wi_0.weight for m in ms]
'''

Swiglu.FUSE += [
    # `t = proj(x).view(-1, 2, I)`; `act(t[:, 0]) * t[:, 1]`: the view proves t is 3-D, so `t[:, 0]` is the
    # pair's first member (trailing dim whole); the config arm dispatches on the object at run time
    Fuse(_S27_PACKED_PAIR, expect={"activation": "config", "gate": "gate_up[:, 0]", "up": "gate_up[:, 1]"},
         run=_RUN_S27_PACKED_PAIR, name="s27_pair_indexed_by_a_short_index_on_a_viewed_tensor"),
    # `ACT2FN[name] if ... else lambda x: F.gelu(x, approximate="tanh")`: the lambda arm is a gelu object
    Fuse(_S27_LAMBDA_GATED, expect={"activation": "config", "gate": "self.wi_0(hidden_states)", "up": "hidden_linear"},
         run=_RUN_S27_LAMBDA_GATED, name="s27_config_or_lambda_activation"),
]

Swiglu.KEEP += [
    # no view proves the rank: `t[:, 0]` of a 2-D projection is a column (one number per row), not a
    # pair member; nothing is claimed about it
    Keep(_S27_PACKED_PAIR.replace("        gate_up = gate_up.view(-1, 2, self.inner)\n", ""),
         reason="gate and up are not", name="s27_short_index_without_a_proved_rank"),
    # a lambda that does more than apply an activation to its parameter is no activation object
    Keep(_S27_LAMBDA_GATED.replace('lambda x: F.gelu(x, approximate="tanh")', 'lambda x: F.gelu(x, approximate="tanh") * x'),
         reason="", name="s27_lambda_that_is_no_plain_activation"),
]


# --- s27: operands transformed elementwise after their projection (clamped / scaled GLUs) ---

_ELEMENTWISE_METHODS = frozenset(("clamp", "clamp_min", "clamp_max", "clip", "float", "half", "bfloat16", "to", "type_as", "contiguous",
                                  # s39: `up = up.mul(mask)` (a scale spelled as a method)
                                  "mul", "div"))
# torch functions taking the tensor first and only bounds after it (`torch.clamp(t, min=None, max=None)`)
_TORCH_CLAMPS = frozenset(("clamp", "clamp_min", "clamp_max", "clip"))
_SHAPE_READS = frozenset(("dtype", "device", "shape"))


def _independent(e: ast.expr, ctx: S.Ctx, avoid: set[str], depth: int = 0) -> bool:
    """``e`` (a clamp bound, a scale) reads none of ``avoid`` (the operands' names and the
    projections' input) and calls nothing but casts and indexing: a value chosen apart from the
    product's operands (``self.limit``, ``self.gate_scale * (self.dim ** 0.5)``). ``x.dtype`` /
    ``x.shape`` reads of any tensor are allowed (metadata, not values)."""
    if depth > 3:
        return False
    for n in fast_walk(e):
        if isinstance(n, ast.Call) and not (isinstance(n.func, ast.Attribute) and n.func.attr in ("to", "float", "half", "bfloat16", "type_as")) \
                and not _own_value_call(n) and not _swiglu_s50b.conversion(n):  # s50: ``int(step)``
            return False
        if isinstance(n, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
            return False
    meta = {id(n.value) for n in fast_walk(e) if isinstance(n, ast.Attribute) and n.attr in _SHAPE_READS}
    for n in fast_walk(e):
        if not isinstance(n, ast.Name) or id(n) in meta:
            continue
        if n.id in avoid:
            return False
        d = S.definition(ctx, n.id)
        if d is not None and (d[1] is None or not _independent(d[1], ctx.at(d[0].lineno), avoid, depth + 1)):
            return False
    return True


def _own_value_call(call: ast.Call) -> bool:
    """``self.gate_scale()``: a call without arguments of a module attribute (nGPT's ``Scale``
    submodule returning its parameter times a constant). It can read none of the product's
    operands (it is passed nothing), and it stays where it is written (the transforms are outside
    the replaced span), so it runs exactly as often as before."""
    return not call.args and not call.keywords and isinstance(call.func, ast.Attribute) \
        and (dotted(call.func) or "").startswith("self.")


def _elementwise_operand(value: ast.expr, ctx: S.Ctx, avoid: set[str], scales: list[tuple[ast.expr, S.Ctx]] | None = None) -> ast.expr | None:
    """The tensor a shape-preserving elementwise transform applies to: ``t.clamp(max=L)``,
    ``torch.clamp(t, -L, L)``, ``t.float()``, ``t * s`` / ``s * t`` / ``t / s`` / ``t + b`` with ``s``
    independent of the operands (see :func:`_independent`); None for anything else. (A scale may
    broadcast to a larger shape in principle: the fused branch checks the operands' shapes.)"""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _ELEMENTWISE_METHODS:
        if value.func.attr == "contiguous" and (value.args or value.keywords):
            return None
        tensor, bounds = value.func.value, [*value.args, *(k.value for k in value.keywords if k.arg is not None)]
        if value.func.attr in _TORCH_CLAMPS and dotted(value.func.value) == "torch":
            # s37: the function spelling `torch.clamp(t, -L, L)` (llm-torch's optional limits): the tensor is the
            # first argument, the bounds the others
            if not value.args or isinstance(value.args[0], ast.Starred):
                return None
            tensor, bounds = value.args[0], bounds[1:]
        if all(_independent(x, ctx, avoid) for x in bounds) and all(k.arg is not None for k in value.keywords):
            if scales is not None:
                scales.extend((x, ctx) for x in bounds)
            return tensor
        return None
    if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div, ast.Add, ast.Sub)):
        sides = [(value.left, value.right)] + ([(value.right, value.left)] if isinstance(value.op, (ast.Mult, ast.Add)) else [])
        for t, sc in sides:
            if _independent(sc, ctx, avoid) and not _independent(t, ctx, avoid):
                if scales is not None:
                    scales.append((sc, ctx))
                return t
    return None


def _transform_origin(module: ModuleInfo, node: ast.expr, ctx: S.Ctx, avoid: set[str],
                      scales: list[tuple[ast.expr, S.Ctx]] | None = None) -> tuple[ast.expr, S.Ctx, int]:
    """Peel elementwise transforms off an operand, through the names they are assigned to
    (``up = up.clamp(-L, L)`` after ``gate, up = t.chunk(2, -1)``): the value they start from, its
    context, and how many transforms were peeled."""
    n, c, count = node, ctx, 0
    for _ in range(8):
        if isinstance(n, ast.Name):
            d = S.definition(c, n.id)
            if d is None or d[1] is None:
                return n, c, count
            inner = _elementwise_operand(d[1], c.at(d[0].lineno), avoid, scales)
            if inner is None:
                return n, c, count
            n, c, count = inner, c.at(d[0].lineno), count + 1
            continue
        inner = _elementwise_operand(n, c, avoid, scales)
        if inner is None:
            return n, c, count
        n, count = inner, count + 1
    return n, c, count


def _elementwise_transformed_gate(module: ModuleInfo, act: Act, a: ast.expr, actx: S.Ctx, b: ast.expr, ctx: S.Ctx,
                                  node: ast.expr, trace: S.Trace) -> Gate | None:
    """``gate = proj_g(x).clamp(max=L); up = proj_u(x).clamp(-L, L); act(gate) * up`` (DeepSeek-V4,
    Megatron's clamped_swiglu), ``gate = gate * self.gate_scale`` (nGPT-style scaled GLUs): operands
    that are elementwise transforms of two projections of one input, or of the two halves of one
    chunk. ``act(a) * b`` is then ``npu_swiglu(cat([a, b], -1))`` on the transformed values exactly,
    whenever a and b have one shape, so the transforms stay as written (outside the replaced span)
    and the fused branch checks the shapes at run time (a scale could broadcast). Both operands must
    be names (the check reads them without computing them again)."""
    names = isinstance(a, ast.Name) and isinstance(b, ast.Name)
    if names and a.id == b.id:  # type: ignore[union-attr]
        return None
    avoid = {n.id for n in (a, b) if isinstance(n, ast.Name)}
    scales: list[tuple[ast.expr, S.Ctx]] = []
    oa, ca, na = _transform_origin(module, a, actx, avoid, scales)
    ob, cb, nb = _transform_origin(module, b, ctx, avoid, scales)
    if na + nb == 0:
        return None
    sa = _split_of(module, oa, ca, S.Trace())
    sb = _split_of(module, ob, cb, S.Trace())
    if sa is not None and sb is not None:
        if sa[0] != sb[0] or S.key(sa[3], sa[2]) != S.key(sb[3], sb[2]) or sa[4] == sb[4] or sa[5] != sb[5]:
            return None
        if sa[5] == "slice" or (sa[5] != "sized" and {sa[4], sb[4]} != {0, 1}) or not (sa[6] and sb[6]):
            return None
        key = sa[0]
    else:
        ia = _projection_input(oa, ca, module)
        ib = _projection_input(ob, cb, module)
        if ia is None or ia != ib:
            return None
        key = ia
    # a scale or bound that reads the projections' input (`silu(w1(x) * x)`) gates by the input itself
    base = _key_name(key)
    if base is not None and any(base in S.names_read(e) for e, _ in scales):
        return None
    if not names:
        inline = _inline_guard(module, a, actx, b, ctx, avoid)
        if inline is not None and sa is not None and sb is not None \
                and not _swiglu_s50b.keep_halves_outside(trace, [n for n, _, _ in inline if isinstance(n, ast.Name)], ctx):
            inline = None  # s50: the halves' statement must run as written (the shape test reads the names)
        if inline is not None:
            return Gate(act, Operand(a, actx), Operand(b, ctx), node, None, trace, key, shape_checked=True, elementwise=True,
                        inline_guard=inline, parts=_swiglu_s50b.parts_of(sa, sb))
        raise GateMiss("gate and up are elementwise transforms (clamp, cast, scale) of projections of one input, and one "
                       "is an expression computed inside the activation or product, not a name: a scale could broadcast, so "
                       "the fused branch must compare their shapes at run time, which it cannot do without computing them "
                       "twice (assign them to names first)")
    return Gate(act, Operand(a, actx), Operand(b, ctx), node, None, trace, key, shape_checked=True, elementwise=True)


_ELEMENTWISE_NOTE = ("gate and up are transformed elementwise after their projections (clamped, scaled or cast): the fused "
                     "op takes the transformed values, so the transforms stay as written; the fused branch checks that "
                     "gate and up have one shape (a scale could broadcast), the original code runs otherwise")

_S27_CLAMPED = '''
import torch
import torch.nn.functional as F
from torch import nn


class ClampedGLU(nn.Module):
    """Gate and up clamped after their projections, then silu(gate) * up."""

    def __init__(self, d, h, limit=0.5):
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)

    def forward(self, x):
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


def clamped_halves(y, clamp_value):
    y_1, y_2 = torch.chunk(y.float(), 2, -1)
    y_1 = y_1.clamp(min=None, max=clamp_value)
    y_2 = y_2.clamp(min=-clamp_value, max=clamp_value)
    return F.silu(y_1) * y_2


class ScaledGLU(nn.Module):
    """Each projection times a learned per-channel scale (normalized-transformer style)."""

    def __init__(self, d, h):
        super().__init__()
        self.dim = d
        self.to_hidden = nn.Linear(d, h, bias=False)
        self.to_gate = nn.Linear(d, h, bias=False)
        self.hidden_scale = nn.Parameter(torch.rand(h) + 0.5)
        self.gate_scale = nn.Parameter(torch.rand(h) + 0.5)

    def forward(self, x):
        hidden, gate = self.to_hidden(x), self.to_gate(x)
        hidden = hidden * self.hidden_scale
        gate = gate * self.gate_scale * (self.dim ** 0.5)
        return F.gelu(gate) * hidden
'''

_RUN_S27_CLAMPED = '''
m, s = ClampedGLU(8, 6), ScaledGLU(8, 6)
x = torch.randn(2, 3, 8, requires_grad=True)
y = torch.randn(4, 12, requires_grad=True)
out = (m(x), clamped_halves(y, 0.7), s(x))
leaves = [x, y, m.gate_proj.weight, s.gate_scale]
'''

Swiglu.FUSE += [
    # clamped projections (DeepSeek-V4 style), clamped halves (Megatron clamped_swiglu style): the fused
    # op takes the clamped values; shapes checked at run time
    Fuse(_S27_CLAMPED, expect={"activation": "silu", "gate": "gate", "up": "up", "qualname": "ClampedGLU.forward"},
         run=_RUN_S27_CLAMPED, name="s27_clamped_projections_and_halves"),
]

Swiglu.KEEP += [
    # a "scale" that reads the other operand: silu(gate * up) * up is no GLU of two transformed projections
    Keep(_S27_CLAMPED.replace("gate = self.gate_proj(x).clamp(max=self.limit)", "gate = self.gate_proj(x) * self.up_proj(x)")
         .replace("y_1 = y_1.clamp(min=None, max=clamp_value)", "y_1 = y_1 * y_2").replace("F.gelu(gate) * hidden", "F.gelu(gate) * x"),
         reason="not a gated product of two projections", name="s27_transform_reading_the_other_operand"),
    # a scaled projection written inside the product: its shape cannot be checked without computing it twice
    Keep(_S27_CLAMPED.split("class ClampedGLU")[0] + "class ScaledGLU" + _S27_CLAMPED.split("class ScaledGLU")[1].replace(
        "        hidden, gate = self.to_hidden(x), self.to_gate(x)\n        hidden = hidden * self.hidden_scale\n"
        "        gate = gate * self.gate_scale * (self.dim ** 0.5)\n        return F.gelu(gate) * hidden",
        "        return F.silu(self.to_gate(x) * self.gate_scale) * self.to_hidden(x)"),
         reason="computed inside the activation or product", name="s27_scaled_projection_inside_the_product"),
    # both scaled projections written inline, the up one parenthesised (`act(s1 * w1(x)) * (s3 * w3(x))`):
    # read as two operands, not three factors, and refused for the same reason
    Keep(_S27_CLAMPED.split("class ClampedGLU")[0] + "class ScaledGLU" + _S27_CLAMPED.split("class ScaledGLU")[1].replace(
        "        hidden, gate = self.to_hidden(x), self.to_gate(x)\n        hidden = hidden * self.hidden_scale\n"
        "        gate = gate * self.gate_scale * (self.dim ** 0.5)\n        return F.gelu(gate) * hidden",
        "        return F.silu(self.gate_scale * self.to_gate(x)) * (self.hidden_scale * self.to_hidden(x))"),
         reason="computed inside the activation or product", name="s27_scaled_projections_grouped_in_the_product"),
]


_S30_SCALE_CALL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Scale(nn.Module):
    """A learned per-channel scale, read by calling the module with no input."""

    def __init__(self, h, init=1.0, scale=1.0):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(h) + 0.5)
        self.forward_scale = init / scale

    def forward(self):
        return self.scale * self.forward_scale


class ScaleCallGLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.dim = d
        self.to_hidden = nn.Linear(d, h, bias=False)
        self.to_gate = nn.Linear(d, h, bias=False)
        self.hidden_scale = Scale(h)
        self.gate_scale = Scale(h)

    def forward(self, x):
        hidden, gate = self.to_hidden(x), self.to_gate(x)
        hidden = hidden * self.hidden_scale()
        gate = gate * self.gate_scale() * (self.dim ** 0.5)
        hidden = F.silu(gate) * hidden
        return hidden
'''

_RUN_S30_SCALE_CALL = '''
m = ScaleCallGLU(8, 6)
x = torch.randn(2, 3, 8, requires_grad=True)
out = m(x)
leaves = [x, m.to_gate.weight, m.gate_scale.scale]
'''

Swiglu.FUSE += [
    # a scale read by calling a submodule with no arguments (`self.gate_scale()`, nGPT's Scale): it is
    # passed nothing, so it reads none of the operands; it stays as written (outside the fused span)
    Fuse(_S30_SCALE_CALL, expect={"activation": "silu", "gate": "gate", "up": "hidden", "qualname": "ScaleCallGLU.forward"},
         run=_RUN_S30_SCALE_CALL, name="s30_scale_from_a_module_call_without_arguments"),
]

Swiglu.KEEP += [
    # the "scale" call is passed the projection itself: it may compute anything from it
    Keep(_S30_SCALE_CALL.replace("def forward(self):\n        return self.scale", "def forward(self, t):\n        return t * self.scale")
         .replace("hidden * self.hidden_scale()", "self.hidden_scale(hidden)"),
         reason="not projections of one input", name="s30_scale_call_passed_the_projection"),
]

# the halves split once in the loop body, the product in a nested branch on an option
# (`if activation == GELU: gelu(gate) * up else: silu(gate) * up`): the split stays where it is
_S30_OUTER_SPLIT = '''
import torch
import torch.nn.functional as F


def experts_forward(x, w1, w2, activation, gated):
    out = []
    for e in range(w1.shape[0]):
        h = x @ w1[e].t()
        if gated:
            gate, up = h.split([w1.shape[1] // 2, w1.shape[1] // 2], dim=-1)
            if activation == "gelu":
                act_out = F.gelu(gate) * up
            else:
                act_out = F.silu(gate) * up
        else:
            act_out = F.silu(h)
        out.append(act_out @ w2[e].t())
    return torch.stack(out)
'''

_RUN_S30_OUTER_SPLIT = '''
x = torch.randn(5, 8, requires_grad=True)
w1 = torch.randn(3, 12, 8, requires_grad=True)
w2 = torch.randn(3, 8, 6, requires_grad=True)
out = (experts_forward(x, w1, w2, "gelu", True), experts_forward(x, w1, w2, "silu", True))
leaves = [x, w1, w2]
'''

Swiglu.FUSE += [
    Fuse(_S30_OUTER_SPLIT, expect={"activation": "silu", "gate": "gate", "up": "up", "qualname": "experts_forward"},
         run=_RUN_S30_OUTER_SPLIT, name="s30_split_in_an_enclosing_block"),
]

Swiglu.KEEP += [
    # the split tensor changes between the split and the product: the fused op would read the new value
    Keep(_S30_OUTER_SPLIT.replace("            if activation == \"gelu\":", "            h = h * 2\n            if activation == \"gelu\":"),
         reason="in another block", name="s30_split_tensor_reassigned_before_the_nested_product"),
    # the enclosing statement is no split (a kernel): it cannot stay behind while the product is fused
    Keep(_S30_OUTER_SPLIT.replace("gate, up = h.split([w1.shape[1] // 2, w1.shape[1] // 2], dim=-1)",
                                  "gate, up = torch.tanh(h).split([w1.shape[1] // 2, w1.shape[1] // 2], dim=-1)"),
         name="s30_outer_split_of_an_expression"),
]

def _non_torch_reason(module: ModuleInfo) -> str | None:
    """A file that imports nothing from torch (JAX, TensorFlow, MLX ports of the same model sit
    beside the torch files in many repositories): its tensors are not torch tensors, so a torch_npu
    call has nothing to run on there, whatever the product looks like."""
    if any(full == "torch" or full.startswith("torch.") for full in module.aliases.values()):
        return None
    return ("the file imports nothing from torch (a JAX / TensorFlow / MLX implementation): its arrays are not torch "
            "tensors, so no torch_npu op applies")


_S27_NOT_TORCH = '''
import mlx.core as mx
import mlx.nn as nn


class FeedForward(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.proj_1 = nn.Linear(d, 2 * h)
        self.proj_2 = nn.Linear(h, d)
        self.act = nn.SiLU()

    def __call__(self, x):
        y_12 = self.proj_1(x)
        y_1, y_2 = mx.split(y_12, 2, axis=-1)
        return self.proj_2(self.act(y_1) * y_2)
'''

Swiglu.KEEP += [
    Keep(_S27_NOT_TORCH, reason="imports nothing from torch", name="s27_glu_in_a_file_without_torch"),
]


def _key_name(key: str) -> str | None:
    """The local name a value key starts from (``$x@Scope.forward`` -> ``x``), if it is one."""
    m = re.match(r"\$([A-Za-z_]\w*)@", key)
    return m.group(1) if m else None


def _grouped_up(module: ModuleInfo, node: ast.expr, ctx: S.Ctx) -> list[ast.expr] | None:
    """``act(a) * (s * u)`` (OLMo-core's NormalizedFeedForward: ``silu(sw1 * w1(x)) * (sw3 * w3(x))``):
    the parenthesised product is the up operand as written, not two more factors. Only where one
    side is the activation call and the other a product with no activation in it (a sigmoid form
    ``sigmoid(a) * a * b`` keeps its three factors)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return None
    for act_side, other in ((node.left, node.right), (node.right, node.left)):
        if not (isinstance(act_side, ast.Call) and isinstance(other, ast.BinOp) and isinstance(other.op, ast.Mult)):
            continue
        a = _act_of(module, act_side, ctx, S.Trace())
        if a is None or a.kind == SIGMOID:
            continue
        inner: list[ast.expr] = []
        _flatten_mul(other, inner)
        if any(_act_of(module, f, ctx, S.Trace()) is not None for f in inner):
            continue
        return [node.left, node.right]
    return None


Swiglu.FUSE += [
    # s27: the up operand scaled under a condition (formerly a Keep): on either path it is an elementwise
    # transform of the projection, so the fused op takes its value at the product, behind a shape check
    Fuse(_S26_SPARSE_GATE.replace("        if self.sparsity > 0.0:\n            gate_proj = torch.relu(gate_proj - 1.0)\n", "")
         .replace("up_proj = self.up_proj(x)\n", "up_proj = self.up_proj(x)\n        if self.sparsity > 0.0:\n            up_proj = up_proj * 0.5\n"),
         expect={"activation": "silu", "gate": "gate_proj", "up": "up_proj"},
         run="x = torch.randn(2, 3, 8, requires_grad=True)\nout = (SparseGateMLP(8, 6, 0.0)(x), SparseGateMLP(8, 6, 0.5)(x))\nleaves = [x]\n",
         name="s27_up_scaled_under_condition"),
]


def _out_product(module: ModuleInfo, call: ast.Call) -> ast.BinOp | None:
    """``torch.mul(act(g), u, out=buf)``: the gated product written into a preallocated tensor. Read as
    the product so a GLU there is reported, but as a near miss: the fused ops return a new tensor, and
    a rewrite that rebinds the expression would leave ``buf`` unfilled for code that reads it."""
    if module.canonical(call.func) not in ("torch.mul", "torch.multiply") or len(call.args) != 2 \
            or any(isinstance(a, ast.Starred) for a in call.args) or [k.arg for k in call.keywords] != ["out"]:
        return None
    node = ast.BinOp(left=call.args[0], op=ast.Mult(), right=call.args[1], lineno=call.lineno, col_offset=call.col_offset,
                     end_lineno=call.end_lineno, end_col_offset=call.end_col_offset)
    node._npufuse_out_reason = (  # type: ignore[attr-defined]
        f"the product is written into `out={ast.unparse(call.keywords[0].value)}`: the fused op returns a new tensor, "
        "so a rewrite would leave that buffer unfilled for the code that reads it")
    return node


_S27_MUL_OUT = '''
import torch
import torch.nn.functional as F
from torch import nn


class BufferedGLU(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = nn.Linear(d, h, bias=False)
        self.w3 = nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)

    def forward(self, x, buf):
        torch.mul(F.silu(self.w1(x)), self.w3(x), out=buf)
        return self.w2(buf)
'''

Swiglu.KEEP += [
    Keep(_S27_MUL_OUT, reason="written into `out=buf`", name="s27_mul_into_an_out_buffer"),
]


def _plain_value(e: ast.expr) -> bool:
    """A name, an attribute chain or a constant: reading it twice computes nothing."""
    return all(isinstance(n, (ast.Name, ast.Attribute, ast.Constant, ast.Load, ast.UnaryOp, ast.USub, ast.UAdd)) for n in fast_walk(e))


def _s39_linear_call(module: ModuleInfo, node: ast.expr, ctx: S.Ctx) -> bool:
    """``self.<attr>(v)`` with ``self.<attr> = nn.Linear(...)`` in the class's ``__init__`` and ``v`` a plain
    value: its result's shape is ``(*v.shape[:-1], self.<attr>.out_features)`` while the attribute still
    holds an nn.Linear (the fused branch tests that too: a pruned or wrapped layer is checked at run time)."""
    if not (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords and _plain_value(node.args[0])):
        return False
    f = node.func
    if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self"):
        return False
    value = S.init_assignments(module, ctx.scope.class_name).get(f.attr)
    return isinstance(value, ast.Call) and module.canonical(value.func) == "torch.nn.Linear"


def _inline_guard(module: ModuleInfo, a: ast.expr, actx: S.Ctx, b: ast.expr, ctx: S.Ctx,
                  avoid: set[str]) -> list[tuple[ast.Name, S.Ctx, list[tuple[ast.expr, S.Ctx]]]] | None:
    """Megatron's ``act(x_glu) * (x_linear + self.config.glu_linear_offset)``: an operand written as an
    elementwise transform of a name, by plain values (names, attributes, constants). Its shape is the
    broadcast of the name's shape with the values' shapes, which the fused branch can read without
    computing the operand: per operand, the name and the inline values; None when an operand is
    anything else (a projection call computed in the product, a value that is itself computed)."""
    out: list[tuple[ast.expr, S.Ctx, list[tuple[ast.expr, S.Ctx]]]] = []
    for op, octx in ((a, actx), (b, ctx)):
        scales: list[tuple[ast.expr, S.Ctx]] = []
        n = op
        if _s39_linear_call(module, n, octx):
            # s39: `act(self.gate_proj(x)) * up` with up scaled (LLM-Shearing's optional mask): the projection's
            # shape is read from the nn.Linear and its input, so it is not computed twice
            out.append((n, octx, []))
            continue
        for _ in range(8):
            if isinstance(n, ast.Name):
                break
            inner = _elementwise_operand(n, octx, avoid, scales)
            if inner is None:
                return None
            n = inner
        if not isinstance(n, ast.Name) or not all(_plain_value(e) for e, _ in scales):
            return None
        out.append((n, octx, [(e, c) for e, c in scales if not (isinstance(e, ast.Constant) and e.value is None)]))
    return out


def _inline_shape_test(module: ModuleInfo, g: Gate, plan: S.SpanPlan) -> str:
    """``a.shape == b.shape`` for operands written as ``name <op> value``: each operand's shape is
    ``broadcast_shapes(name.shape, value.shape...)`` (a number has shape ``()``), read from the names
    and values only (nothing is computed twice)."""
    T = S.torch_name(module) or "torch"
    shapes, linear = [], []
    for name, nctx, scales in g.inline_guard or []:
        if isinstance(name, ast.Call):  # an nn.Linear projection of a plain value (_s39_linear_call)
            proj, inp = S.render(module, name.func, nctx, plan), S.render(module, name.args[0], nctx, plan)
            linear.append(f"isinstance({proj}, {T}.nn.Linear)")
            shapes.append(f"(*{S.atom(inp)}.shape[:-1], {proj}.out_features)")
            continue
        base = S.render(module, name, nctx, plan)
        if not base.isidentifier():
            raise S.RenderError("the operands' shapes must be checked at run time, and an operand is computed in the product itself")
        if not scales:
            shapes.append(f"{base}.shape")
            continue
        parts = ", ".join(f'getattr({S.render(module, e, c, plan)}, "shape", ())' for e, c in scales)
        shapes.append(f"{T}.broadcast_shapes({base}.shape, {parts})")
    return " and ".join(linear + [f"{shapes[0]} == {shapes[1]}"])


_S27_OFFSET_UP = '''
import torch
import torch.nn.functional as F
from torch import nn


class Cfg:
    def __init__(self, clamp=None, offset=0.0):
        self.activation_func = F.silu
        self.clamp_value = clamp
        self.linear_offset = offset


class OffsetGLU(nn.Module):
    """Megatron-style: halves of one projection, optionally clamped, the up half offset inline."""

    def __init__(self, cfg, d, h):
        super().__init__()
        self.config = cfg
        self.fc1 = nn.Linear(d, 2 * h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        y = self.fc1(x)

        def glu(t):
            x_glu, x_linear = torch.chunk(t, 2, dim=-1)
            if (val := self.config.clamp_value) is not None:
                x_glu = x_glu.clamp(min=None, max=val)
                x_linear = x_linear.clamp(min=-val, max=val)
            return self.config.activation_func(x_glu) * (x_linear + self.config.linear_offset)

        return self.fc2(glu(y))
'''

_RUN_S27_OFFSET_UP = '''
x = torch.randn(2, 3, 8, requires_grad=True)
ms = [OffsetGLU(Cfg(), 8, 6), OffsetGLU(Cfg(0.3, 1.0), 8, 6), OffsetGLU(Cfg(None, torch.ones(2, 3, 1)), 8, 6), OffsetGLU(Cfg(None, torch.ones(4, 2, 3, 1)), 8, 6)]
out = tuple(m(x) for m in ms)
leaves = [x] + [m.fc1.weight for m in ms]
'''

Swiglu.FUSE += [
    # the up half offset inline by a config value: the shape check broadcasts the half's shape with the
    # offset's (a tensor offset that grows the shape runs the original code)
    Fuse(_S27_OFFSET_UP, expect={"activation": "config", "gate": "x_glu", "up": "x_linear + self.config.linear_offset"},
         run=_RUN_S27_OFFSET_UP, name="s27_up_offset_inline_by_a_config_value"),
]


def _caller_supplied(arm: ast.expr, params: dict) -> bool:
    """An __init__ parameter (``act``) or an instance the class builds from one (``act_layer()``, timm's
    ``act_layer() if act_layer is not None else nn.GELU(approximate='tanh')``): the caller's choice."""
    if isinstance(arm, ast.Call) and not arm.args and not arm.keywords:
        arm = arm.func
    return isinstance(arm, ast.Name) and arm.id in params


_S27_ACT_LAYER_OR_DEFAULT = '''
import torch
from torch import nn


class GatedMlp(nn.Module):
    def __init__(self, d, h, act_layer=None):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.act = act_layer() if act_layer is not None else nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
'''

_RUN_S27_ACT_LAYER_OR_DEFAULT = '''
x = torch.randn(2, 3, 8, requires_grad=True)
ms = [GatedMlp(8, 6), GatedMlp(8, 6, nn.GELU), GatedMlp(8, 6, nn.ReLU)]
out = tuple(m(x) for m in ms)
leaves = [x] + [m.gate_proj.weight for m in ms]
'''

Swiglu.FUSE += [
    # `act_layer() if act_layer is not None else nn.GELU(approximate="tanh")`: an instance of the caller's
    # class, or gelu(tanh) by default; dispatched on the object at run time
    Fuse(_S27_ACT_LAYER_OR_DEFAULT.replace('nn.GELU(approximate="tanh")', "nn.SiLU()"),
         expect={"activation": "config", "default_activation": "silu"},
         run=_RUN_S27_ACT_LAYER_OR_DEFAULT, name="s27_caller_class_instance_or_default"),
]

Swiglu.KEEP += [
    # the default is a sigmoid (a Dauphin GLU) and nothing offers silu/gelu: a near miss, as for `act or nn.Sigmoid()`
    Keep(_S27_ACT_LAYER_OR_DEFAULT.replace('nn.GELU(approximate="tanh")', "nn.Sigmoid()"), reason="defaults to sigmoid",
         name="s27_caller_class_instance_or_sigmoid_default"),
]


# --- s28 glu: a projection's input found by dataflow, not by which side of the matmul it is on ---


def _s28_matmul_sides(node: ast.expr, ctx: S.Ctx) -> tuple[ast.expr, ast.expr, S.Ctx] | None:
    """(the matrix on the left, the one on the right, ctx) of ``L.mm(R)`` / ``L.matmul(R)`` (a
    method of one argument, not ``torch.mm``) or ``L @ R``, after following names and casts."""
    n, c = S.peel(node, ctx)
    while S.is_cast(n):
        n = n.func.value  # type: ignore[union-attr]
        n, c = S.peel(n, c)
    if isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult):
        return n.left, n.right, c
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("mm", "matmul") \
            and len(n.args) == 1 and not isinstance(n.args[0], ast.Starred) and not n.keywords \
            and not (isinstance(n.func.value, ast.Name) and n.func.value.id in ("torch", "th")):
        return n.func.value, n.args[0], c
    return None


def _s28_held_state(node: ast.expr) -> bool:
    """An attribute chain (``self.w1``, ``layer_weight.gate_proj``): state an object holds, as weights
    are; never a value the function computes (a call, an arithmetic result, a plain local)."""
    if not isinstance(node, ast.Attribute):
        return False
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _s28_weight_held_input(a: ast.expr, actx: S.Ctx, b: ast.expr, ctx: S.Ctx) -> tuple[str, str] | None:
    """Gate and up as ``W1.mm(x)`` and ``W3.mm(x)`` (lightllm's weight objects, ``self.w1 @ x``): the
    projections' input is the operand the two matmuls share, whichever side it is written on; the
    other operands are two different attributes an object holds (weights). ``_projection_input``
    reads the receiver of ``.mm`` as the input (``x.mm(w)``), which makes these look like products of
    two inputs. (key, key) of the shared right operand, or None. The shapes of the two products are
    equal whenever the two weights have one shape; the fused op is exact for any two equal-shape
    operands (it concatenates them and splits them back along one dim)."""
    sa, sb = _s28_matmul_sides(a, actx), _s28_matmul_sides(b, ctx)
    if sa is None or sb is None:
        return None
    (la, ra, ca), (lb, rb, cb) = sa, sb
    if not (_s28_held_state(la) and _s28_held_state(lb)) or ast.dump(la) == ast.dump(lb):
        return None
    if _s28_held_state(ra) or _s28_held_state(rb):
        return None  # state on both sides: nothing says which one is the input
    ka, kb = S.key(ra, ca), S.key(rb, cb)
    return (ka, kb) if ka == kb else None


# --- s28 glu: a split by a symbolic size, its halves checked at run time ---


def _s28_one_index(size: ast.expr | None) -> bool:
    """``(n,)`` / ``[n]``: one split index, so ``tensor_split`` makes exactly two parts."""
    return isinstance(size, (ast.Tuple, ast.List)) and len(size.elts) == 1 and not isinstance(size.elts[0], ast.Starred)


def _s28_split_size(module: ModuleInfo, g: Gate) -> tuple[ast.expr, S.Ctx, int] | None:
    """The size of the first part of the halves' split when it is symbolic: ``n`` of ``T.split(n, d)``,
    of ``torch.tensor_split(T, (n,), d)`` or of ``T[..., :n]`` / ``T[..., n:]``, and the line of the split."""
    h = g.halves
    if h is None or h.equal:
        return None
    n, c = S.peel(g.a.node, g.a.ctx)
    if not isinstance(n, ast.Subscript):
        return None
    if h.how == "slice":
        sl = n.slice.elts[-1] if isinstance(n.slice, ast.Tuple) else n.slice
        if not isinstance(sl, ast.Slice) or sl.step is not None:
            return None
        bound = sl.upper if sl.lower is None else sl.lower if sl.upper is None else None
        return (bound, c, n.lineno) if bound is not None and const_value(bound) is ... else None
    base, bctx = S.peel(n.value, c)
    if not isinstance(base, ast.Call):
        return None
    fname = module.call_name(base)
    meth = base.func.attr if isinstance(base.func, ast.Attribute) else None
    if fname in ("torch.split", "torch.tensor_split"):
        rest, meth = list(base.args[1:]), fname.split(".")[-1]
    elif meth in ("split", "tensor_split"):
        rest = list(base.args)
    else:
        return None
    size = rest[0] if rest else S.arg(base, "split_size_or_sections" if meth == "split" else "indices_or_sections", None)
    if meth == "tensor_split" and _s28_one_index(size):
        size = size.elts[0]  # type: ignore[union-attr]
    elif meth != "split" or size is None or isinstance(size, (ast.Tuple, ast.List)):
        return None
    return (size, bctx, base.lineno) if size is not None and const_value(size) is ... else None


def _s28_half_size_check(module: ModuleInfo, g: Gate, plan: S.SpanPlan) -> str | None:
    """``T.shape[d] == 2 * (n)`` for halves split by a symbolic size (``split(self.up_proj_dim, -1)``,
    ``tensor_split(T, (n,), -1)``, ``T[..., :n]``): the fused op halves T, so it is exact only when n
    is half of T's dim; the scan cannot know n, the run can (a host-side shape, no sync). None when
    the sizes are provably equal, or when T or n is not a value readable before the span (then the
    finding keeps its stated layout risk)."""
    found = _s28_split_size(module, g)
    h = g.halves
    if found is None or h is None:
        return None
    size, sctx, at = found
    # the check runs before the span: a name the span rebinds before the split holds another value there
    written = set().union(*(S.names_written(st) for st in plan.stmts if st.lineno < at))
    for e in (h.tensor, size):
        if any(isinstance(x, ast.Name) and x.id in written for x in fast_walk(e)):
            return None  # rebound inside the span: its value at the span's start is another one
        if any(isinstance(x, ast.Call) for x in fast_walk(e)):
            return None  # checking it would compute it a second time
    try:
        t = S.render(module, h.tensor, h.ctx, plan)
        n = S.render(module, size, sctx, plan)
        d = S.render(module, h.dim, h.dim_ctx, plan)
    except S.RenderError:
        return None
    if not all(p.isidentifier() for p in t.split(".")):
        return None
    return f"{S.atom(t)}.shape[{d}] == 2 * ({n})"


def _s28_note_half_check(params: dict[str, Any], risks: list[Risk], notes: list[str], check: str) -> None:
    params["halves_checked"] = check
    risks[:] = [r for r in risks if not (r.kind == "layout" and "symbolic size" in r.detail)]
    notes.append(f"split by a symbolic size: the fused op runs when `{check}` (two equal halves), the original code otherwise")


# weight objects with a ``.mm`` method and a split at a symbolic index: examples (s28)
_S28_WEIGHT_MM = '''
import torch
import torch.nn.functional as F


class Weight:
    """A loaded weight with its own matmul (inference engines keep these outside nn.Module)."""

    def __init__(self, d, h):
        self.weight = torch.randn(d, h, requires_grad=True)

    def mm(self, x):
        return x @ self.weight


class LayerWeight:
    def __init__(self, d, h):
        self.gate_proj, self.up_proj, self.down_proj = Weight(d, h), Weight(d, h), Weight(h, d)


class LayerInfer:
    def __init__(self, d):
        self.embed_dim = d

    def ffn(self, hidden, layer_weight):
        hidden = hidden.view(-1, self.embed_dim)
        gate = layer_weight.gate_proj.mm(hidden.view(-1, self.embed_dim))
        up = layer_weight.up_proj.mm(hidden.view(-1, self.embed_dim))
        out = F.silu(gate) * up
        return layer_weight.down_proj.mm(out)
'''

_RUN_S28_WEIGHT_MM = '''
w = LayerWeight(8, 6)
x = torch.randn(2, 3, 8, requires_grad=True)
out = LayerInfer(8).ffn(x, w)
leaves = [x, w.gate_proj.weight, w.up_proj.weight]
'''

_S28_SPLIT_AT = '''
import torch
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, d, h, extra=0):
        super().__init__()
        self.up_proj_dim = h
        self.proj_up_gate_z = nn.Linear(d, 2 * h + extra)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        x = self.proj_up_gate_z(x)
        gate, z = torch.tensor_split(x, (self.up_proj_dim,), dim=-1)
        x = self.act_fn(gate) * z
        return x
'''

# the second module splits 1 + 5 features at index 1: not halves (silu(gate) broadcasts over z), so
# the run-time check takes the original code there
_RUN_S28_SPLIT_AT = '''
x = torch.randn(2, 3, 8, requires_grad=True)
ms = [FeedForward(8, 6), FeedForward(8, 1, extra=4)]
out = tuple(m(x) for m in ms)
leaves = [x] + [m.proj_up_gate_z.weight for m in ms]
'''

Swiglu.FUSE += [
    # `W.mm(x)` on weight objects: the input is the operand both matmuls share, whichever side it is on
    Fuse(_S28_WEIGHT_MM, expect={"activation": "silu", "gate": "gate", "up": "up", "source": "two_projections"},
         run=_RUN_S28_WEIGHT_MM, name="s28_weight_objects_mm_of_one_input"),
    # tensor_split at a symbolic index: halves only when the index is half the dim, checked at run time
    Fuse(_S28_SPLIT_AT, expect={"split": "tensor_split", "halves_checked": "x.shape[-1] == 2 * (self.up_proj_dim)"},
         run=_RUN_S28_SPLIT_AT, name="s28_tensor_split_at_a_symbolic_index"),
]

Swiglu.KEEP += [
    # the two weight objects multiply two different inputs: a gated output, not a GLU MLP
    Keep(_S28_WEIGHT_MM.replace("up = layer_weight.up_proj.mm(hidden.view(-1, self.embed_dim))",
                                "up = layer_weight.up_proj.mm(hidden.view(-1, self.embed_dim).cumsum(0))"),
         reason="not projections of one input", name="s28_weight_objects_mm_of_two_inputs"),
    # one weight, two inputs (`a.mm(w)`-style with the weight on the right of both): no shared input
    Keep(_S28_WEIGHT_MM.replace("gate = layer_weight.gate_proj.mm(hidden.view(-1, self.embed_dim))",
                                "gate = hidden.cumsum(0).mm(layer_weight.up_proj.weight)").replace(
                                "up = layer_weight.up_proj.mm(hidden.view(-1, self.embed_dim))",
                                "up = hidden.mm(layer_weight.up_proj.weight)"),
         reason="not projections of one input", name="s28_one_weight_two_inputs"),
    # two split indices: three parts, not two halves
    Keep(_S28_SPLIT_AT.replace("gate, z = torch.tensor_split(x, (self.up_proj_dim,), dim=-1)",
                               "gate, z, _ = torch.tensor_split(x, (self.up_proj_dim, 2 * self.up_proj_dim), dim=-1)"),
         reason="not two halves", name="s28_tensor_split_at_two_indices"),
]


# --- s28 glu: the activation chosen by an if/elif chain of assignments, the product after it ---


@dataclass
class _S28Arm:
    test: ast.expr | None  # None: the else arm
    body: list[ast.stmt]
    act: Act | None  # the arm's `y = act(g)` when it is one
    gate: Gate | None  # the product the arm's activation makes, when it is a GLU


def _s28_chain_arms(node: ast.If) -> list[tuple[ast.expr | None, list[ast.stmt]]]:
    arms: list[tuple[ast.expr | None, list[ast.stmt]]] = []
    cur = node
    while True:
        arms.append((cur.test, cur.body))
        if len(cur.orelse) == 1 and isinstance(cur.orelse[0], ast.If):
            cur = cur.orelse[0]
            continue
        if cur.orelse:
            arms.append((None, cur.orelse))
        return arms


def _s28_product_of(stmt: ast.stmt) -> list[tuple[ast.Name, ast.expr, ast.expr]]:
    """(the activated name, the other factor, the product node) readings of ``y *= b`` / ``t = y * b`` /
    ``t = b * y`` (the whole value): each Name factor may be the one the chain assigned."""
    if isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Mult) and isinstance(stmt.target, ast.Name):
        prod = _augassign_product(stmt)
        assert prod is not None
        return [(prod.left, stmt.value, prod)]  # type: ignore[list-item]
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.value, ast.BinOp) and isinstance(stmt.value.op, ast.Mult):
        v = stmt.value
        return [(y, b, v) for y, b in ((v.left, v.right), (v.right, v.left)) if isinstance(y, ast.Name)]
    return []


def _s28_branch_act_results(module: ModuleInfo, scope: Scope, stmt: ast.stmt) -> list[GateResult] | None:
    """exllamav2 / DeepSpeed: ``if cfg == "silu": y = F.silu(g) elif cfg == "gelu": y = F.gelu(g, ...)``,
    (other statements), then ``y *= up``. Each arm is a gated product of its own activation; the
    rewrite keeps the chain and puts each arm's fused product in it (silu -> npu_swiglu, gelu ->
    npu_geglu; any other arm, and the no-arm path, runs the original statements), so every test is
    evaluated where it was and the statements between run once on every path, in their order. None
    when the statement is no such product (the ordinary scan then reads it)."""
    idx = S.stmt_index(scope)
    body, i = idx.block.get(id(stmt), (None, -1))
    if body is None:
        return None
    chain_at = None
    for y, b, node in _s28_product_of(stmt):
        for j in range(i - 1, max(i - 9, -1), -1):  # the chain a few statements back at most: bounded work per product
            if isinstance(body[j], ast.If) and y.id in set().union(*(S.names_written(st) for _, arm in _s28_chain_arms(body[j]) for st in arm)):
                chain_at = j
                break
            if y.id in S.names_written(body[j]) or any(isinstance(n, ast.Name) and n.id == y.id for n in fast_walk(body[j])):
                break  # y written or read between: not the chain's value alone
        if chain_at is not None:
            break
    if chain_at is None:
        return None
    chain = body[chain_at]
    between = body[chain_at + 1 : i]
    assert isinstance(chain, ast.If)
    arms: list[_S28Arm] = []
    gate_key: str | None = None
    for test, arm in _s28_chain_arms(chain):
        st0 = arm[0]
        if len(arm) == 1 and isinstance(st0, ast.Raise):
            arms.append(_S28Arm(test, arm, None, None))
            continue
        if not (len(arm) == 1 and isinstance(st0, ast.Assign) and len(st0.targets) == 1 and isinstance(st0.targets[0], ast.Name)
                and st0.targets[0].id == y.id and isinstance(st0.value, ast.Call)):
            return None  # an arm doing anything else: not an activation chosen by the chain
        act = classify_call(module, st0.value, S.Ctx(scope, st0.lineno))
        if act is None or act.gate is None:
            return None
        k = S.key(act.gate, S.Ctx(scope, st0.lineno))
        if gate_key is not None and k != gate_key:
            return None  # arms activating different tensors
        gate_key = k
        arms.append(_S28Arm(test, arm, act, None))
    acts = [a for a in arms if a.act is not None]
    if len(acts) < 2 and not (len(acts) == 1 and len(arms) == 1):
        return None
    # the activated tensor and the other factor's names must hold, at the product, what they held in the arms
    moved_reads = {n.id for a in acts for n in fast_walk(a.act.gate) if isinstance(n, ast.Name)}  # type: ignore[union-attr]
    written_between = set().union(*(S.names_written(st) for st in between)) if between else set()
    if moved_reads & written_between or any(isinstance(n, (ast.Yield, ast.Await, ast.NamedExpr)) for st in between for n in fast_walk(st)):
        return None
    ctx = S.Ctx(scope, stmt.lineno)
    pat_kinds = (SILU,) + GELU_KINDS
    for a in arms:
        if a.act is None or a.act.kind not in pat_kinds:
            continue
        synth = ast.BinOp(left=a.body[0].value, op=ast.Mult(), right=b, lineno=stmt.lineno, col_offset=0,  # type: ignore[attr-defined]
                          end_lineno=stmt.end_lineno, end_col_offset=0)
        try:
            g = find_gate(module, synth, ctx)
        except GateMiss as e:
            pat = owner(a.act) or "swiglu"
            return [GateResult(stmt, pat, miss=NearMiss(pat, scope.qualname, chain.lineno, stmt.end_lineno or stmt.lineno,
                                                        f"activation chosen by an if/elif chain, then `{ast.unparse(node)}`: {e.reason}"))]
        if g is None or g.act.kind != a.act.kind or g.shape_checked or g.caller_lines is not None or g.inline_guard is not None:
            return None
        a.gate = g
    fusable = [a for a in arms if a.gate is not None]
    if not fusable:
        return None
    halves_t = fusable[0].gate.halves  # type: ignore[union-attr]
    if halves_t is not None:
        # the fused op reads the split tensor at the product: it must still hold the split's value there
        tn = {n.id for n in fast_walk(halves_t.tensor) if isinstance(n, ast.Name)}
        if tn & (written_between | {y.id}):
            return None
    done = S.already_fused(module, scope, stmt)
    pat = "swiglu" if any(a.act.kind == SILU for a in fusable) else "geglu"  # type: ignore[union-attr]
    if done:
        return [GateResult(stmt, pat, miss=NearMiss(pat, scope.qualname, chain.lineno, stmt.end_lineno or stmt.lineno, done))]
    try:
        text = _s28_branch_act_fused(module, chain, arms, between, stmt, node)
    except S.RenderError as e:
        return [GateResult(stmt, pat, miss=NearMiss(pat, scope.qualname, chain.lineno, stmt.end_lineno or stmt.lineno,
                                                    f"cannot express the replacement at the site: {e}"))]
    g0 = fusable[0].gate
    assert g0 is not None
    guard = g0.halves.tensor if g0.halves is not None else g0.a.node
    if not isinstance(guard, ast.Name):
        guard = g0.a.node
    # a tensor live at the chain: a name or a subscript of names (`gate[idx]`), nothing computed
    if any(isinstance(n, ast.Call) or isinstance(n, ast.Name) and n.id in written_between for n in fast_walk(guard)):
        return None
    kinds = sorted({a.act.kind for a in fusable})  # type: ignore[union-attr]
    params: dict[str, Any] = {
        "activation": "branch",
        "activation_source": "; ".join(f"{ast.unparse(a.test) if a.test is not None else 'else'}: {ast.unparse(a.body[0].value)}"  # type: ignore[attr-defined]
                                       for a in arms if a.act is not None),
        "activation_kernels": 1,
        "conditional": True,
        "branch_kinds": kinds,
        "gate": ast.unparse(g0.a.node),
        "up": ast.unparse(g0.b.node),
        "source": "split" if g0.halves is not None else "two_projections",
        "dispatches_to": sorted({"swiglu" if k == SILU else "geglu" for k in kinds}),
    }
    risks, notes = _risks(g0, pat)
    notes.append("activation chosen by an if/elif chain of assignments before the product: each arm computing silu or gelu "
                 "runs its fused op in place of the activation and the product; other arms and the no-arm path run the "
                 f"original statements (lines {chain.lineno}-{stmt.end_lineno or stmt.lineno} restructured: the statements "
                 "between the chain and the product are repeated in each arm, run once on every path)")
    f = Finding(pattern=pat, qualname=scope.qualname, line=chain.lineno, end_line=stmt.end_lineno or stmt.lineno, params=params,
                fused=text, guard_tensor=ast.unparse(guard), confidence="medium", variant="branch_chosen_activation", risks=risks,
                notes=notes, training_ok=True)
    return [GateResult(stmt, pat, finding=f)]


def _s28_branch_act_fused(module: ModuleInfo, chain: ast.If, arms: list[_S28Arm], between: list[ast.stmt],
                          stmt: ast.stmt, node: ast.expr) -> str:
    src = module.source
    between_src = [S.block_source(module, between)] if between else []
    out: list[str] = []
    for k, a in enumerate(arms):
        if a.test is None:
            out.append("else:")
        else:
            seg = ast.get_source_segment(src, a.test)
            if seg is None or "\n" in seg:
                seg = ast.unparse(a.test)
            out.append(f"{'if' if k == 0 else 'elif'} {seg}:")
        if a.gate is not None:
            kind = a.act.kind  # type: ignore[union-attr]
            ak = approx_code_of(module, a.gate.act, kind, None) if kind in GELU_KINDS else None  # type: ignore[arg-type]
            fused = fused_expr(module, a.gate, SILU if kind == SILU else kind, None, ak)  # type: ignore[arg-type]
            root = _s28_splice_root(module, stmt, node, fused)
            out.append(S.indent("\n".join(between_src + [root])))
        elif isinstance(a.body[0], ast.Raise):
            out.append(S.indent(S.block_source(module, a.body)))
        else:
            out.append(S.indent("\n".join([S.block_source(module, a.body)] + between_src + [S.stmt_source(module, stmt)])))
    if arms[-1].test is not None:
        out.append("else:  # no arm taken: the original statements")
        out.append(S.indent("\n".join(between_src + [S.stmt_source(module, stmt)])))
    return "\n".join(out)


def _s28_splice_root(module: ModuleInfo, stmt: ast.stmt, node: ast.expr, fused: str) -> str:
    if isinstance(stmt, ast.AugAssign):
        return f"{ast.unparse(stmt.target)} = {fused}"
    return S.splice(module, stmt, [(node, fused)])


_S28_BRANCH_ACT = '''
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """exllamav2-style: the activation picked by an if/elif chain, up projected after it, in-place product."""

    def __init__(self, d, h, act="silu"):
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)

    def forward(self, x):
        gate = self.gate_proj.forward(x)
        if self.act == "silu":
            y = F.silu(gate)
        elif self.act == "gelu":
            y = F.gelu(gate, approximate="tanh")
        elif self.act == "leaky":
            y = F.leaky_relu(gate)
        up = self.up_proj.forward(x)
        y *= up
        y.clamp_(min=-65504.0, max=65504.0)
        return self.down_proj(y)


def mlp_fallback(x, w, kind):
    """DeepSpeed-style: halves of one projection, an enum-like switch, a raising else."""
    tmp = torch.matmul(x, w)
    up, gate = tmp.chunk(2, dim=-1)
    if kind == 1:
        inter = F.gelu(gate)
    elif kind == 2:
        inter = F.silu(gate)
    else:
        raise ValueError(f"activation {kind} not implemented")
    inter = up * inter
    return inter
'''

_RUN_S28_BRANCH_ACT = '''
x = torch.randn(2, 3, 8, requires_grad=True)
w = torch.randn(8, 12, requires_grad=True)
ms = [MLP(8, 6, "silu"), MLP(8, 6, "gelu"), MLP(8, 6, "leaky")]
out = tuple(m(x) for m in ms) + (mlp_fallback(x, w, 1), mlp_fallback(x, w, 2))
leaves = [x, w] + [m.gate_proj.weight for m in ms]
'''

Swiglu.FUSE += [
    # each silu/gelu arm of the chain runs its fused op; the leaky_relu arm and the no-arm path the original code
    Fuse(_S28_BRANCH_ACT, expect={"qualname": "MLP.forward", "activation": "branch", "branch_kinds": ["gelu_tanh", "silu"],
                                  "dispatches_to": ["geglu", "swiglu"]},
         run=_RUN_S28_BRANCH_ACT, name="s28_activation_chosen_by_an_if_elif_chain"),
]

Swiglu.KEEP += [
    # the arms activate different tensors: no one gate
    Keep(_S28_BRANCH_ACT.split("def mlp_fallback")[0].replace('y = F.gelu(gate, approximate="tanh")', 'y = F.gelu(x, approximate="tanh")'),
         reason="", name="s28_chain_arms_activating_different_tensors"),
    # the gate and the other factor are projections of two inputs: a gated output
    Keep(_S28_BRANCH_ACT.split("def mlp_fallback")[0].replace("up = self.up_proj.forward(x)", "up = self.up_proj.forward(x.flip(1))"),
         reason="activation chosen by an if/elif chain", name="s28_chain_then_product_of_two_inputs"),
    # the activated name is read between the chain and the product (a saved activation): the product alone stays
    Keep(_S28_BRANCH_ACT.split("def mlp_fallback")[0].replace("        up = self.up_proj.forward(x)\n",
                                                             "        up = self.up_proj.forward(x)\n        self.saved = y\n"),
         reason="", name="s28_chain_value_read_before_the_product"),
]


def _s28_same_shard_input(module: ModuleInfo, a: ast.expr, actx: S.Ctx, b: ast.expr, ctx: S.Ctx) -> tuple[str, str] | None:
    """``gate[idx]`` and ``up[idx]`` with ``gate``/``up`` two projections of one input returning one output
    per device (exllamav2's ``forward_tp(x, output_split=True)``): element ``idx`` of each is that shard's
    projection of the input, so the pair is a GLU's gate and up. Only a variable index (a loop's shard),
    the same on both; a constant index is read elsewhere (``self.w(x)[0]``: (output, bias) tuples)."""
    na, ca = S.peel(a, actx)
    nb, cb = S.peel(b, ctx)
    if not (isinstance(na, ast.Subscript) and isinstance(nb, ast.Subscript)):
        return None
    if not (isinstance(na.slice, ast.Name) and isinstance(nb.slice, ast.Name)) or S.key(na.slice, ca) != S.key(nb.slice, cb):
        return None
    if S.key(na.value, ca) == S.key(nb.value, cb):
        return None  # one list indexed twice at one index: one value, not a pair
    va, vca = S.peel(na.value, ca)
    vb, vcb = S.peel(nb.value, cb)
    if not (isinstance(va, ast.Call) and isinstance(vb, ast.Call)):
        return None
    ka, kb = _projection_input(va, vca, module), _projection_input(vb, vcb, module)
    return (ka, kb) if ka is not None and ka == kb else None


_S28_SHARDS = '''
import torch
import torch.nn.functional as F
from torch import nn


class ShardedLinear(nn.Module):
    """One weight shard per device; forward_tp returns one output per shard."""

    def __init__(self, d, h, shards=2):
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(torch.randn(d, h // shards)) for _ in range(shards)])

    def forward_tp(self, x, output_split=True):
        return [x[i] @ w for i, w in enumerate(self.w)]


class MLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.gate_proj = ShardedLinear(d, h)
        self.up_proj = ShardedLinear(d, h)

    def forward_tp(self, post_norm):
        gate = self.gate_proj.forward_tp(post_norm, output_split=True)
        up = self.up_proj.forward_tp(post_norm, output_split=True)
        outputs = []
        for idx in range(len(post_norm)):
            outputs.append(F.silu(gate[idx]) * up[idx])
        return outputs
'''

_RUN_S28_SHARDS = '''
m = MLP(8, 12)
x = [torch.randn(3, 8, requires_grad=True) for _ in range(2)]
out = tuple(m.forward_tp(x))
leaves = x + [m.gate_proj.w[0], m.up_proj.w[1]]
'''

Swiglu.FUSE += [
    # element idx of two per-shard projection lists of one input: that shard's gate and up
    Fuse(_S28_SHARDS, expect={"gate": "gate[idx]", "up": "up[idx]", "source": "two_projections"}, run=_RUN_S28_SHARDS,
         name="s28_same_shard_of_two_split_projections"),
]

Swiglu.KEEP += [
    # two different shards: not one shard's pair
    Keep(_S28_SHARDS.replace("for idx in range(len(post_norm)):", "for idx, jdx in ((0, 1), (1, 0)):").replace(
        "* up[idx]", "* up[jdx]"), reason="not projections of one input", name="s28_different_shards_of_two_projections"),
]


def _s28_element_guard(g: Gate, guard: str, plan: S.SpanPlan) -> str:
    """``gate[idx]`` rather than ``gate`` when the guard name is a per-shard list the operand indexes: the
    switch tests a tensor's device, and a list has none (the fused branch would never run)."""
    n = g.a.node
    if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == guard and isinstance(n.slice, ast.Name) \
            and not plan.kept_writes_after(n.slice.id, 0) and not any(n.slice.id in S.names_written(st) for st in plan.stmts):
        return f"{guard}[{n.slice.id}]"
    return guard


# --- s28 glu: a GLU kernel written as a plain function of (gate, up), its callers out of sight ---


def _s28_glu_kernel(scope: Scope, node: ast.expr) -> bool:
    """The function holding the product does nothing else: its body (docstring and asserts aside) is
    ``return <the product>`` (Cerebras' ``glu_bivariate_base_fn``, litgpt's ``swiglu(e, g)``, a
    ``SwiGLUActivation.forward(x1, x2)``). Such a function IS the gated activation, whoever calls it:
    the fused op is exact for any two operands of one shape (checked at run time, original code
    otherwise), so what its callers pass decides only whether it pays (a torch.cat copy), not
    whether it is right."""
    fn = scope.node
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant) and isinstance(st.value.value, str))
            and not isinstance(st, ast.Assert)]
    return len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is node


def _s37_transformed_kernel(module: ModuleInfo, a: ast.expr, actx: S.Ctx, b: ast.expr, ctx: S.Ctx, node: ast.expr) -> str | None:
    """A GLU kernel (see :func:`_s28_glu_kernel`) whose body, before ``return <the product>``, only transforms its
    two parameters elementwise in place, optionally under an ``if`` (mojo_opset's SwiGLU op: ``if self.swiglu_limit
    > 0: up = torch.clamp(up, ...); gate = torch.clamp(gate, max=...)``): still the gated activation of whatever the
    callers pass, on the transformed values, which the fused op takes as they are. The text for the kernel's
    risk, or None."""
    fn = ctx.scope.node
    if not (isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and isinstance(a, ast.Name) and isinstance(b, ast.Name)) \
            or a.id == b.id:
        return None
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant) and isinstance(st.value.value, str))
            and not isinstance(st, ast.Assert)]
    if len(body) < 2 or not (isinstance(body[-1], ast.Return) and body[-1].value is node):
        return None
    params = {x.arg for x in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    if not {a.id, b.id} <= params:
        return None
    avoid = {a.id, b.id}

    def transforms(stmts: list[ast.stmt]) -> bool:
        for st in stmts:
            if isinstance(st, ast.If) and not st.orelse and transforms(st.body):
                continue
            if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                    and st.targets[0].id in avoid):
                return False
            inner = _elementwise_operand(st.value, ctx.at(st.lineno), avoid)
            if not (isinstance(inner, ast.Name) and inner.id == st.targets[0].id):
                return False  # a transform of the name itself, never of the other operand
        return True

    if not transforms(body[:-1]):
        return None
    return (f"unknown: `{fn.name}` only transforms its parameters `{a.id}` and `{b.id}` elementwise before returning the "
            "gated product")


def _s28_note_kernel(params: dict[str, Any], risks: list[Risk], notes: list[str], scope: Scope, g: Gate) -> None:
    params["glu_kernel"] = True
    risks.append(Risk("other", f"`{scope.qualname}` is a GLU kernel whose callers npufuse cannot see "
                               f"({g.s28_kernel.split(':')[0]}): if a caller passes two values that are not "  # type: ignore[attr-defined]
                               "projections of one input (a gated output), the fused op is still exact but adds a "
                               "torch.cat copy for little gain"))
    notes.append(f"`{scope.qualname}` only returns the gated product of its two parameters: the fused op replaces its body "
                 "when both have one shape, the original code otherwise")


def _s28_passthrough_callers(module: ModuleInfo, a: ast.expr, actx: S.Ctx, b: ast.expr, ctx: S.Ctx) -> bool:
    """Every call of the kernel passes gate and up straight through from its own caller's parameters,
    in a wrapper that returns that call (Cerebras' ``def swiglu(x1, x2): return
    glu_bivariate_base_fn(x1, x2, F.silu)``): the values come from the wrappers' callers, which this
    check does not follow, so they are as unknown as when nothing calls the kernel here."""
    pa, pb = _param_operand(a, actx), _param_operand(b, ctx)
    fn = ctx.scope.node
    if pa is None or pb is None or module.functions.get(getattr(fn, "name", "")) is not fn:
        return False
    calls, other = _call_sites(module, fn, False, None)
    if other is not None or not calls:
        return False
    for call, sc in calls:
        hctx = S.bind_call(module, call, fn, S.Ctx(sc, call.lineno), False)
        if hctx is None or pa not in hctx.bind or pb not in hctx.bind:
            return False
        (ga, _), (ub, _) = hctx.bind[pa], hctx.bind[pb]
        if not (isinstance(ga, ast.Name) and isinstance(ub, ast.Name) and ga.id in sc.args and ub.id in sc.args and ga.id != ub.id):
            return False
        w = sc.node
        body = getattr(w, "body", [])
        if not (body and isinstance(body[-1], ast.Return) and body[-1].value is call):
            return False  # the wrapper returns the kernel's result as it is (Cerebras' liglu binds a lambda first)
        if S.definition(S.Ctx(sc, call.lineno), ga.id) is not None or S.definition(S.Ctx(sc, call.lineno), ub.id) is not None:
            return False
    return True


_S28_GLU_KERNEL = '''
import torch
from torch import nn


def glu_base(x1, x2, activation_fn):
    assert x1.shape == x2.shape, "GLU inputs must have one shape"
    return x1 * activation_fn(x2)


def geglu(x1, x2):
    return glu_base(x1, x2, nn.functional.gelu)


def swiglu(x1, x2):
    return glu_base(x1, x2, nn.functional.silu)


def reglu(x1, x2):
    return glu_base(x1, x2, nn.functional.relu)


class SwiGLUActivation(nn.Module):
    def forward(self, x1, x2):
        return x1 * nn.functional.silu(x2)


ACTIVATIONS = {"geglu": geglu, "swiglu": swiglu, "reglu": reglu}
'''

_RUN_S28_GLU_KERNEL = '''
a = torch.randn(2, 3, 6, requires_grad=True)
b = torch.randn(2, 3, 6, requires_grad=True)
c = torch.randn(2, 3, 1, requires_grad=True)
out = tuple(ACTIVATIONS[k](a, b) for k in ("geglu", "swiglu", "reglu")) + (SwiGLUActivation()(a, b), SwiGLUActivation()(a, c))
leaves = [a, b, c]
'''

Swiglu.FUSE += [
    # a function that only returns act(x2) * x1 of its parameters is the GLU itself, whoever calls it: fused
    # under a shape check (the last call broadcasts a [.., 1] operand and runs the original code)
    Fuse(_S28_GLU_KERNEL, expect={"qualname": "glu_base", "glu_kernel": True, "dispatches_to": ["swiglu", "geglu"]},
         run=_RUN_S28_GLU_KERNEL, name="s28_glu_kernel_function_with_callers_out_of_sight"),
    Fuse(_S28_GLU_KERNEL.split("def glu_base")[0] + "class SwiGLUActivation" + _S28_GLU_KERNEL.split("class SwiGLUActivation")[1],
         expect={"qualname": "SwiGLUActivation.forward", "glu_kernel": True, "activation": "silu"},
         name="s28_glu_kernel_module_forward"),
]

Swiglu.KEEP += [
    # more than the product in the function: no kernel by itself, so the callers' values decide, and they are unknown
    Keep((_S28_GLU_KERNEL.split("def glu_base")[0] + "class SwiGLUActivation" + _S28_GLU_KERNEL.split("class SwiGLUActivation")[1]).replace(
        "        return x1 * nn.functional.silu(x2)",
                                 "        print(x1.norm())\n        return x1 * nn.functional.silu(x2)"),
         reason="unknown", name="s28_more_than_the_product_with_unknown_callers"),
]


# --- s33: modules bound by one tuple assignment in ``__init__`` (MoDE's SwishGLU) ---
# ``self.act, self.project = nn.SiLU(), nn.Linear(d, 2 * h)``: each attribute paired with its own
# construction; silu on the second half of the split (the halves swapped for npu_swiglu).
_S33_TUPLE_BOUND_MODULES = '''
import torch
from torch import nn


class SwishGLU(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.act, self.project = nn.SiLU(), nn.Linear(in_dim, 2 * out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected, gate = self.project(x).tensor_split(2, dim=-1)
        return projected * self.act(gate)
'''

Swiglu.FUSE += [
    Fuse(_S33_TUPLE_BOUND_MODULES, expect={"activation": "silu", "gate": "gate", "up": "projected", "order": "up_first"},
         run="m = SwishGLU(8, 6)\nx = torch.randn(2, 3, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.project.weight]\n",
         name="s33_act_and_projection_bound_by_a_tuple_assignment"),
]

Swiglu.KEEP += [
    # near miss: the tuple pairs ``self.act`` with a ReLU (a ReGLU, not npu_swiglu)
    Keep(_S33_TUPLE_BOUND_MODULES.replace("self.act, self.project = nn.SiLU(), nn.Linear(in_dim, 2 * out_dim)",
                                          "self.act, self.project = nn.ReLU(), nn.Linear(in_dim, 2 * out_dim)"),
         name="s33_relu_bound_by_a_tuple_assignment"),
]


# --- s33: an activation class of the module built and called in one expression (``SiLU()(self.w1(X))``) ---
_S33_INLINE_ACTIVATION_CLASS = '''
import torch
from torch import nn


class SiLU(nn.Module):
    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return X * torch.sigmoid(X)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)
        self.w3 = nn.Linear(d_model, d_ff)

    def forward(self, X: torch.Tensor, if_gated=True) -> torch.Tensor:
        if if_gated:
            return self.w2(SiLU()(self.w1(X)) * self.w3(X))
        else:
            return self.w2(SiLU()(self.w1(X)))
'''

Swiglu.FUSE += [
    Fuse(_S33_INLINE_ACTIVATION_CLASS, expect={"activation": "silu", "activation_source": "SiLU()", "gate": "self.w1(X)", "up": "self.w3(X)",
                                               "line": 20, "end_line": 20},
         run="m = SwiGLU(8, 6)\nx = torch.randn(2, 3, 8, requires_grad=True)\nout = (m(x), m(x, False))\nleaves = [x, m.w1.weight]\n",
         name="s33_activation_class_built_and_called_inline"),
]

Swiglu.KEEP += [
    # near miss: the class is QuickGELU (x * sigmoid(1.702 x)), not SiLU
    Keep(_S33_INLINE_ACTIVATION_CLASS.replace("return X * torch.sigmoid(X)", "return X * torch.sigmoid(1.702 * X)"),
         name="s33_quick_gelu_class_built_and_called_inline"),
    # near miss: a scaled SiLU (x * sigmoid(x) * c) is no npu_swiglu activation by itself
    Keep(_S33_INLINE_ACTIVATION_CLASS.replace("return X * torch.sigmoid(X)", "return X * torch.sigmoid(X) * 1.6791767923989418"),
         name="s33_scaled_silu_class_built_and_called_inline"),
]


# --- s35: an activation module a module-level builder makes from a string (issue 14 class 6, held-out 11) ---
#
# ``self.gating = _build_gating_activation(kind)`` returning ``nn.SiLU()`` / ``nn.GELU()`` / ``nn.Sigmoid()`` by a
# string: the forward ``self.gating(self.gate_proj(x)) * self.value_proj(x)`` names no activation, so the text
# gate turned the scope away before classify_call (which already dispatches on such objects at run time) could
# read the builder. The gate now also passes a forward calling an attribute that ``__init__`` set from a
# builder whose body names an activation.
_S35_BUILT_GATE = '''
import torch
from torch import nn


def make_nonlinearity(name):
    if name == "silu":
        return nn.SiLU()
    if name == "gelu":
        return nn.GELU()
    if name == "sigmoid":
        return nn.Sigmoid()
    raise ValueError(name)


class GatedBlock(nn.Module):
    def __init__(self, width, hidden, kind="silu"):
        super().__init__()
        self.to_gate = nn.Linear(width, hidden, bias=False)
        self.to_value = nn.Linear(width, hidden, bias=False)
        self.squash = make_nonlinearity(kind)
        self.back = nn.Linear(hidden, width, bias=False)

    def forward(self, h):
        return self.back(self.to_value(h) * self.squash(self.to_gate(h)))
'''
Swiglu.FUSE += [
    Fuse(_S35_BUILT_GATE, expect={"activation": "config", "runtime_check": "activation type", "gate": "self.to_gate(h)",
                                  "up": "self.to_value(h)"},
         run="x = torch.randn(2, 3, 8, requires_grad=True)\nms = [GatedBlock(8, 6, k) for k in ('silu', 'gelu', 'sigmoid')]\n"
             "out = tuple(m(x) for m in ms)\nleaves = [x] + [m.to_gate.weight for m in ms]\n",
         name="s35_activation_built_by_a_module_function"),
]
Swiglu.KEEP += [
    # near miss: the builder only makes ReLU-family activations, which neither fused op computes
    Keep(_S35_BUILT_GATE.replace("nn.SiLU()", "nn.ReLU()").replace("nn.GELU()", "nn.ReLU6()").replace("nn.Sigmoid()", "nn.LeakyReLU()"),
         name="s35_builder_of_relu_family_activations"),
]


# --- s35: LoRA-adapted projections (held-out 11: LLaMA-Adapter's FeedForward) ---
#
# ``silu(self.w1(x) + self.lora_b(self.lora_a(x))) * (self.w3(x) + ...)``: each operand is a sum of projections
# of the same input (a low-rank adapter beside the frozen weight, optionally scaled), linear in x like one
# projection, so the product is a GLU of two projections and npu_swiglu takes the two sums concatenated. A sum
# with a projection of another input stays a near miss.
_S35_LORA_GLU = '''
import torch
import torch.nn.functional as F
from torch import nn


class AdaptedMLP(nn.Module):
    def __init__(self, dim, hidden, rank=4, alpha=8.0):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.gate_a = nn.Linear(dim, rank, bias=False)
        self.gate_b = nn.Linear(rank, hidden, bias=False)
        self.up_a = nn.Linear(dim, rank, bias=False)
        self.up_b = nn.Linear(rank, hidden, bias=False)
        self.drop = nn.Dropout(0.0)
        self.scaling = alpha / rank

    def forward(self, tokens):
        g = self.gate(tokens) + self.gate_b(self.gate_a(self.drop(tokens))) * self.scaling
        u = self.up(tokens) + self.up_b(self.up_a(self.drop(tokens))) * self.scaling
        return self.down(F.silu(g) * u)
'''
_S35_LORA_FUNCTIONAL = '''
import torch
import torch.nn.functional as F


def adapted_glu(x, w_gate, w_up, a_gate, b_gate, w_down):
    gate = F.linear(x, w_gate) + F.linear(F.linear(x, a_gate), b_gate)
    return F.linear(F.silu(gate) * F.linear(x, w_up), w_down)
'''
Swiglu.FUSE += [
    Fuse(_S35_LORA_GLU, expect={"activation": "silu", "gate": "g", "up": "u"},
         run="m = AdaptedMLP(8, 12)\nx = torch.randn(2, 3, 8, requires_grad=True)\nout = m(x)\nleaves = [x, m.gate.weight, m.gate_b.weight]\n",
         name="s35_lora_adapted_projections"),
    Fuse(_S35_LORA_FUNCTIONAL, expect={"activation": "silu", "up": "F.linear(x, w_up)"},
         run="x = torch.randn(2, 3, 8, requires_grad=True)\nw = [torch.randn(12, 8), torch.randn(12, 8), torch.randn(4, 8), torch.randn(12, 4), torch.randn(8, 12)]\n"
             "out = adapted_glu(x, *w)\nleaves = [x]\n",
         name="s35_lora_adapted_functional_projection"),
]
Swiglu.KEEP += [
    # near miss: the adapter reads another input than the up projection (a cross-input sum, not a GLU of one input)
    Keep(_S35_LORA_FUNCTIONAL.replace("def adapted_glu(x, ", "def adapted_glu(x, y, ").replace("F.linear(F.linear(x, a_gate), b_gate)", "F.linear(F.linear(y, a_gate), b_gate)"),
         name="s35_adapter_on_another_input"),
]


# --- s36 glu36: an injected activation's values read from every construction in the repository ---
#
# ``self.a = activation_fn`` (default ``nn.ReLU()``) in a GLU whose file offers no silu/gelu: the
# class is built elsewhere (FMS: ``GatedLinearUnit(..., activation_fn=str_to_activation(cfg.x))`` in
# every model file; labml: ``FeedForward(d, d_ff, p, nn.SiLU(), True, ...)`` in the experiments). The
# default alone decided "near miss" before. Now every construction of the class in the repository
# (``Cls(...)``, ``partial(Cls, ...)``, a subclass's ``super().__init__(...)``; names resolved through
# imports, a same-named class of another file is another class) is read for that parameter: a value
# that is silu/gelu, or that npufuse cannot read (a config lookup, a factory call, ``**kwargs``), makes
# the site a candidate dispatched on the object at run time (the original code for anything else);
# only when every construction passes known activations neither fused op computes (or none builds
# the class) is it a near miss.

_S36_MAX_FILES = 400  # repository files whose text is searched for the class's name


def _s36_act_params(module: ModuleInfo, cls_name: str, attr: str) -> list[str]:
    """The ``__init__`` parameters whose value ``self.<attr>`` takes (``self.a = activation_fn``,
    ``self.act = act if act is not None else nn.SiLU()``)."""
    params = S.init_params(module, cls_name)
    out: list[str] = []
    for v in _init_values(module, cls_name, attr):
        for n in fast_walk(v):
            if isinstance(n, ast.Name) and n.id in params and n.id not in out:
                out.append(n.id)
    return out


def _s36_value_kind(mod: ModuleInfo, value: ast.expr, attr: str) -> str | None:
    """The activation kind an argument value is; CONFIG when npufuse cannot tell; None for the
    object of another instance of the class handed on (``activation_fn=self.a``: no new value)."""
    if isinstance(value, ast.Attribute) and value.attr == attr:
        return None
    if isinstance(value, ast.Constant) and value.value is None:
        return None  # "not passed": the class's own default (counted apart)
    for v in (value, ast.Call(func=value, args=[], keywords=[])):
        k = _module_act(mod, v)
        if k is not None:
            return k[0] if k[0] not in (GELU_DYN,) else GELU
    # any other torch module or function (nn.Softplus(), torch.tanh, nn.Identity()): a known
    # computation that is neither silu nor gelu (those two are read above)
    name = mod.canonical(value.func if isinstance(value, ast.Call) else value) or ""
    if name.startswith("torch.") and not any(w in name.lower() for w in ("silu", "gelu", "swish")):
        return name.split(".")[-1].lower()
    return CONFIG


def _s36_arg(call: ast.Call, pos: list[str], param: str, skip: int) -> ast.expr | None | bool:
    """The argument ``call`` passes for ``param`` (``pos``: __init__'s positional parameters after
    self; ``skip``: leading arguments that are not __init__'s, e.g. ``self`` of ``Cls.__init__(self,...)``);
    None when it passes none; True when a ``*args`` / ``**kwargs`` may carry it."""
    for k in call.keywords:
        if k.arg == param:
            return k.value
    args = call.args[skip:]
    if param in pos:
        i = pos.index(param)
        for j, a in enumerate(args):
            if isinstance(a, ast.Starred):
                return True
            if j == i:
                return a
    if any(k.arg is None for k in call.keywords):
        return True
    return None


def _s36_symbols(root: Any) -> Any:
    from npufuse.scan import repo_facts, repo_symbols

    cache = _s36_symbols.__dict__.setdefault("cache", {})
    key = str(root)
    if key not in cache:
        if len(cache) > 4:
            cache.clear()
        cache[key] = repo_symbols.RepoSymbols(root, repo_facts._repo_py_files(root))
    return cache[key]


def _s36_constructions(module: ModuleInfo, cls_name: str, param: str, attr: str, depth: int = 0,
                       flag: tuple[str, ast.expr | None] | None = None) -> tuple[set[str], int]:
    """(the activation kinds every construction of ``cls_name`` (defined in ``module``) passes for
    ``param``, how many constructions were read). A construction whose argument is a parameter of a
    subclass's ``__init__`` counts that subclass's own constructions (and its default)."""
    from npufuse.scan import repo_facts

    init = S.method(module, cls_name, "__init__")
    if init is None:
        return set(), 0
    pos = [a.arg for a in (*init.args.posonlyargs, *init.args.args)][1:]
    root = repo_facts.repo_root(module)
    others: list[tuple[str, str]] = []
    if root is not None:
        repo_facts._depends(root, module.path)  # the answer reads the other files of the repository
        word = re.compile(r"\b" + re.escape(cls_name) + r"\b")
        for rel in repo_facts._repo_py_files(root)[:_S36_MAX_FILES * 10]:
            if rel == module.path:
                continue
            text = repo_facts._repo_text(root, rel)
            if text is not None and cls_name in text and word.search(text):
                others.append((rel, text))
            if len(others) >= _S36_MAX_FILES:
                break
    kinds: set[str] = set()
    count = 0
    files: list[tuple[ModuleInfo, bool]] = [(module, True)]
    for rel, text in others:
        try:
            other = ModuleInfo.from_source(rel, text)
        except (SyntaxError, ValueError, RecursionError):
            continue
        repo_facts.attach_root(other, root)  # a subclass there is followed to its own constructions
        files.append((other, False))
    for mod, own in files:
        # names that may mean the class here: its own name, and imports of it under another name
        local = {cls_name} | {a.asname for n in fast_walk(mod.tree) if isinstance(n, ast.ImportFrom)
                              for a in n.names if a.name == cls_name and a.asname}
        resolved: dict[str, bool] = {}

        def is_cls(node: ast.expr) -> bool:
            if own:
                return isinstance(node, ast.Name) and node.id == cls_name
            name = dotted(node) or ""
            if name.split(".")[-1] not in local or root is None:
                return False
            if name not in resolved:
                sym = _s36_symbols(root).resolve_node(mod.path, node)
                resolved[name] = sym.kind == "class" and sym.file == module.path and sym.qualname == cls_name
            return resolved[name]

        subclasses = {c for c, cd in mod.classes.items() if not (own and c == cls_name) and any(is_cls(b) for b in cd.bases)}
        for n in fast_walk(mod.tree):
            if not isinstance(n, ast.Call):
                continue
            f, skip = n.func, 0
            if (dotted(f) or "").split(".")[-1] == "partial" and n.args and is_cls(n.args[0]):
                skip = 1
            elif isinstance(f, ast.Attribute) and f.attr == "__init__" and is_cls(f.value):
                skip = 1  # Cls.__init__(self, ...)
            elif isinstance(f, ast.Attribute) and f.attr == "__init__" and isinstance(f.value, ast.Call) \
                    and dotted(f.value.func) == "super":
                holder = _s36_enclosing_class(mod, n)
                if holder not in subclasses:
                    continue
            elif not is_cls(f):
                continue
            arg = _s36_arg(n, pos, param, skip)
            count += 1
            if flag is not None and _s36_flag_off(n, pos, skip, flag):
                # built with the product's `if self.<flag>:` off: that construction never multiplies
                kinds.add(f"{flag[0]}=False (the product never runs)")
                continue
            if arg is True:
                kinds.add(CONFIG)
                continue
            if arg is None:
                continue  # the class's default (the caller of this function weighs it)
            holder = _s36_enclosing_class(mod, n)
            fn = _s36_enclosing_init(mod, n)
            if isinstance(arg, ast.Name) and fn is not None and arg.id in [a.arg for a in (*fn.args.args, *fn.args.kwonlyargs)]:
                # a subclass / wrapper handing its own parameter on: its default and its constructions
                sub = S.init_params(mod, holder).get(arg.id) if holder else None
                if sub is not None:
                    k = _s36_value_kind(mod, sub, attr)
                    if k is not None:
                        kinds.add(k)
                if holder is None or depth >= 2:
                    kinds.add(CONFIG)
                else:
                    more, n_more = _s36_constructions(mod, holder, arg.id, attr, depth + 1)
                    kinds |= more
                    count += n_more
                continue
            k = _s36_value_kind(mod, arg, attr)
            if k is not None:
                kinds.add(k)
    return kinds, count


def _s36_flag_off(call: ast.Call, pos: list[str], skip: int, flag: tuple[str, ast.expr | None]) -> bool:
    """The construction passes the gating flag as a false constant (or leaves its false default)."""
    arg = _s36_arg(call, pos, flag[0], skip)
    if arg is True:
        return False
    v = const_value(flag[1] if arg is None else arg) if (flag[1] if arg is None else arg) is not None else ...
    return v is not ... and v in (False, None, 0) and not isinstance(v, float)


def _s36_product_flag(module: ModuleInfo, scope: Scope, act: Act, cls_name: str) -> tuple[str, ast.expr | None] | None:
    """The ``__init__`` parameter (name, default) of the flag the product sits under: ``if
    self.<f>:`` in the forward, after the activation, holding a product, ``self.<f>`` stored from a
    parameter once (labml / cosmos ``FeedForward``'s ``is_gated``)."""
    line = act.gate.lineno if act.gate is not None else 0
    params = S.init_params(module, cls_name)
    for n in fast_walk(scope.node):
        if not (isinstance(n, ast.If) and n.lineno >= line and isinstance(n.test, ast.Attribute)
                and isinstance(n.test.value, ast.Name) and n.test.value.id == "self"):
            continue
        if not any(isinstance(x, ast.BinOp) and isinstance(x.op, ast.Mult) for st in n.body for x in fast_walk(st)):
            continue
        values = _init_values(module, cls_name, n.test.attr)
        if len(values) == 1 and isinstance(values[0], ast.Name) and values[0].id in params:
            return values[0].id, params[values[0].id]
    return None


def _s36_enclosing_class(mod: ModuleInfo, node: ast.AST) -> str | None:
    for c, cd in mod.classes.items():
        if cd.lineno <= node.lineno <= (cd.end_lineno or cd.lineno) and any(n is node for n in fast_walk(cd)):
            return c
    return None


def _s36_enclosing_init(mod: ModuleInfo, node: ast.AST) -> ast.FunctionDef | None:
    """The ``__init__`` (of any class) holding ``node``; None elsewhere."""
    for cd in mod.classes.values():
        for item in cd.body:
            if isinstance(item, ast.FunctionDef) and item.lineno <= node.lineno <= (item.end_lineno or item.lineno) \
                    and any(n is node for n in fast_walk(item)):
                return item if item.name == "__init__" else None
    return None


def _s36_repo_choices(module: ModuleInfo, scope: Scope, act: Act) -> tuple[set[str], int] | None:
    """The kinds the repository's constructions pass for the injected activation ``act`` (an
    ``__init__`` parameter stored on ``self``); None when it is no such parameter."""
    if not (isinstance(act.obj, ast.Attribute) and isinstance(act.obj.value, ast.Name) and act.obj.value.id == "self"):
        return None
    cls_name = _assigning_class(module, scope.class_name, act.obj.attr) or scope.class_name
    if not cls_name:
        return None
    params = _s36_act_params(module, cls_name, act.obj.attr)
    if not params:
        return None
    flag = _s36_product_flag(module, scope, act, cls_name)
    kinds: set[str] = set()
    count = 0
    from npufuse.scan import repo_facts

    root = repo_facts.repo_root(module)
    # one answer per class and parameter for one listing of the repository (repo_facts.reset, at
    # the start of each scan, makes a new listing: answers of an earlier scan are not reused)
    listing = repo_facts._repo_py_files(root) if root is not None else None
    cache = _s36_repo_choices.__dict__.setdefault("cache", {})
    for p in params:
        key = (id(listing), str(root), module.path, cls_name, p, act.obj.attr, flag[0] if flag else None)
        hit = cache.get(key) if listing is not None else None
        if hit is None or hit[0] is not listing:
            if len(cache) > 512:
                cache.clear()
            hit = (listing, _s36_constructions(module, cls_name, p, act.obj.attr, flag=flag))
            if listing is not None:
                cache[key] = hit
        elif root is not None:
            repo_facts._depends(root, module.path)
        kinds |= hit[1][0]
        count += hit[1][1]
    return kinds, count


# an injected activation (default ReLU, nothing in the class offers silu/gelu); a function of the
# file builds the class with a SiLU handed by keyword (FMS's GatedLinearUnit shape, renamed)
_S36_INJECTED_BUILT_WITH_SILU = '''
import torch
from torch import nn


class GatedFFN(nn.Module):
    def __init__(self, d, h, nonlin=nn.ReLU(), packed=True):
        super().__init__()
        self.h = h
        self.packed = packed
        self.fc_in = nn.Linear(d, 2 * h)
        self.fc_a = nn.Linear(d, h)
        self.fc_b = nn.Linear(d, h)
        self.fc_out = nn.Linear(h, d)
        self.nl = nonlin

    def forward(self, x):
        if self.packed:
            a, b = torch.split(self.fc_in(x), [self.h, self.h], dim=-1)
            y = self.nl(a) * b
        else:
            y = self.nl(self.fc_a(x)) * self.fc_b(x)
        return self.fc_out(y)


def build_block(d):
    return GatedFFN(d, 2 * d, nonlin=nn.SiLU(), packed=False)
'''

_RUN_S36_INJECTED = '''
x = torch.randn(2, 3, 8, requires_grad=True)
ms = [GatedFFN(8, 6, nn.SiLU()), GatedFFN(8, 6, nn.GELU(), packed=False), GatedFFN(8, 6), build_block(8)]
out = tuple(m(x) for m in ms)
leaves = [x] + [m.fc_in.weight for m in ms]
'''

# invented: built positionally through functools.partial with a GELU, the activation applied to
# the second projection's output written first (`up * act(gate)`)
_S36_INJECTED_PARTIAL_GELU = '''
import functools

import torch
from torch import nn


class TwoBranch(nn.Module):
    def __init__(self, width, hidden, squash=nn.Sigmoid()):
        super().__init__()
        self.lin_val = nn.Linear(width, hidden, bias=False)
        self.lin_gate = nn.Linear(width, hidden, bias=False)
        self.proj = nn.Linear(hidden, width, bias=False)
        self.squash = squash

    def forward(self, t):
        return self.proj(self.lin_val(t) * self.squash(self.lin_gate(t)))


GeluBranch = functools.partial(TwoBranch, 16, 32, nn.GELU())
'''

# invented: built with an object looked up by a run-time key (nothing tells which): a candidate
_S36_INJECTED_LOOKUP = '''
import torch
from torch import nn

NONLINEARITIES = {}


class GLUBlock(nn.Module):
    def __init__(self, d, h, activation_fn=nn.ReLU()):
        super().__init__()
        self.w_in = nn.Linear(d, 2 * h)
        self.activation = activation_fn

    def forward(self, x):
        gate, up = self.w_in(x).chunk(2, dim=-1)
        return self.activation(gate) * up


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.block = GLUBlock(cfg.d, cfg.h, activation_fn=NONLINEARITIES[cfg.act])
'''

Swiglu.FUSE += [
    Fuse(_S36_INJECTED_BUILT_WITH_SILU, expect={"activation": "config", "default_activation": "relu", "source": "split"},
         run=_RUN_S36_INJECTED, name="s36_injected_activation_built_with_silu_by_the_file"),
    Fuse(_S36_INJECTED_PARTIAL_GELU, expect={"activation": "config", "default_activation": "sigmoid", "source": "two_projections"},
         run="x = torch.randn(3, 16, requires_grad=True)\nout = (GeluBranch()(x), TwoBranch(16, 32, nn.SiLU())(x), TwoBranch(16, 32)(x))\nleaves = [x]\n",
         name="s36_injected_activation_built_by_a_partial_with_gelu"),
    Fuse(_S36_INJECTED_LOOKUP, expect={"activation": "config", "default_activation": "relu"},
         run="x = torch.randn(2, 8, requires_grad=True)\nout = tuple(GLUBlock(8, 6, a)(x) for a in (nn.SiLU(), nn.GELU(approximate='tanh'), nn.ReLU()))\nleaves = [x]\n",
         name="s36_injected_activation_built_from_a_run_time_lookup"),
]

Swiglu.KEEP += [
    # every construction in the repository passes activations no fused op computes
    Keep(_S36_INJECTED_BUILT_WITH_SILU.replace("nonlin=nn.SiLU()", "nonlin=nn.Tanh()"),
         reason="every construction of the class in the repository", name="s36_injected_activation_built_only_with_tanh"),
    Keep(_S36_INJECTED_PARTIAL_GELU.replace("nn.GELU()", "nn.Softplus(beta=2.0)"),
         reason="every construction of the class in the repository", name="s36_injected_activation_partial_with_softplus"),
    # nobody builds it: the default decides (ReLU)
    Keep(_S36_INJECTED_LOOKUP.split("class Model")[0], reason="defaults to relu", name="s36_injected_activation_never_built"),
]


# labml's gated FeedForward, renamed: the activation on every path, the product under `if` and an
# `else` that uses the activation alone; built with a SiLU positionally by a function of the file
_S36_OPTIONAL_GATE_WITH_ELSE = '''
import torch
from torch import nn


class FFN(nn.Module):
    def __init__(self, d, d_ff, act=nn.ReLU(), gated=False):
        super().__init__()
        self.first = nn.Linear(d, d_ff)
        self.second = nn.Linear(d_ff, d)
        self.act = act
        self.gated = gated
        if gated:
            self.value = nn.Linear(d, d_ff)

    def forward(self, inp):
        a = self.act(self.first(inp))
        if self.gated:
            out = a * self.value(inp)
        else:
            out = a
        return self.second(out)


def swiglu_ffn(d):
    return FFN(d, 4 * d, nn.SiLU(), True)
'''

Swiglu.FUSE += [
    Fuse(_S36_OPTIONAL_GATE_WITH_ELSE, expect={"activation": "config", "source": "two_projections", "gate": "self.first(inp)"},
         run="x = torch.randn(2, 8, requires_grad=True)\nout = (swiglu_ffn(8)(x), FFN(8, 16, nn.GELU(), True)(x), FFN(8, 16, nn.SiLU())(x), FFN(8, 16)(x))\nleaves = [x]\n",
         name="s36_optional_gate_with_an_else_branch"),
]

Swiglu.KEEP += [
    # the activation's result is read after the if: the fused branch would leave `a` unset
    Keep(_S36_OPTIONAL_GATE_WITH_ELSE.replace("return self.second(out)", "return self.second(out) + a.sum()"),
         reason="reused after the fused region", name="s36_optional_gate_activation_read_after_the_if"),
]


# --- s36 glu36: a swish whose beta defaults to 1 (ppl.pmx's SwiGLU op, gpt-neox's swish, speechbrain) ---
#
# ``g * x * sigmoid(beta * x)`` with ``beta`` a parameter defaulting to 1.0 (or ``self.beta`` set from
# such a parameter): silu(x) * g exactly where beta == 1, which is a run-time fact. The fused branch
# tests ``isinstance(beta, (int, float)) and beta == 1`` (a Python number: no device sync; a tensor
# beta, a learnable one, fails the test) and runs the original code otherwise. A beta that is a
# constant other than 1 (GPT-OSS's 1.702 alpha) or that defaults to another value stays the
# "swish with beta" near miss.


def _s36_unit_default(default: ast.expr | None) -> bool:
    v = const_value(default) if default is not None else ...
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v == 1


def _s36_unit_beta(module: ModuleInfo, k: ast.expr, ctx: S.Ctx) -> Any:
    """A maker of the silu Act for a beta that defaults to 1 (``k``: the beta factor), or None."""
    if ctx.depth:
        return None  # inside an inlined helper: the caller's argument decides; not followed
    v = const_value(k)
    if not isinstance(v, bool) and isinstance(v, (int, float)) and v == 1:
        return lambda z, desc: Act(SILU, z, ctx, desc.replace("beta", "1"), kernels=3)
    if isinstance(k, ast.Name) and k.id in ctx.scope.args and S.definition(ctx, k.id) is None:
        fn = ctx.scope.node
        a = fn.args  # type: ignore[attr-defined]
        pos = [*a.posonlyargs, *a.args]
        defaults = dict(zip([p.arg for p in pos][len(pos) - len(a.defaults):], a.defaults))
        defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults)})
        if not _s36_unit_default(defaults.get(k.id)):
            return None
    elif isinstance(k, ast.Attribute) and isinstance(k.value, ast.Name) and k.value.id == "self" and ctx.scope.class_name:
        if _s40_unit_attribute(module, ctx.scope.class_name, k.attr, None) is not True:
            return None
        if any(isinstance(n, (ast.Assign, ast.AugAssign)) and any(dotted(t) == f"self.{k.attr}" for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
               for n in fast_walk(ctx.scope.node)):
            return None
    else:
        return None
    return lambda z, desc: Act(SILU, z, ctx, desc, kernels=3, beta=k)


# s40 (reasons40): a swish whose beta is an attribute set to the number 1 (``self.beta = 1.0`` in ``__init__``, no
# other store in the class) is silu: the s36 reading took only a constructor argument defaulting to 1 and called the
# constant "a swish with beta, not silu". The same for a Swish module class of the file (``self.act = Swish()``,
# its forward ``x * torch.sigmoid(self.beta * x)``) and a method of the class, which were not read at all. The fused
# branch still tests the attribute at run time (``self.act.beta == 1``: something outside the class may set it); a
# beta that is an nn.Parameter, another number or not shown stays "a swish with beta", now saying which.

_S40_UNSHOWN = ", not shown to be 1"


def _s40_unit_attribute(module: ModuleInfo, cls_name: str, attr: str, ctor: ast.Call | None) -> bool | tuple[str, bool]:
    """Whether ``self.<attr>`` of class ``cls_name`` is the number 1 where ``ctor`` (None: any construction)
    builds it: True; else (what it is, for the reason; whether that is known not to be 1)."""
    stores = bound_callee.attribute_values(module, cls_name, attr)
    values = _init_values(module, cls_name, attr)
    if not values:
        return "not assigned in __init__", False
    if len(stores) != 1 or len(values) != 1:
        return "assigned more than once in the class", False
    v = values[0]
    if _s36_unit_default(v):
        return True
    if isinstance(v, ast.Name):
        params = S.init_params(module, cls_name)
        if v.id not in params or not _s36_unit_default(params[v.id]):
            return f"set from `{v.id}`, which does not default to 1", False
        if ctor is None:
            return True  # the s36 reading: a constructor argument defaulting to 1, tested at run time
        init = S.method(module, cls_name, "__init__")
        names = [a.arg for a in init.args.args[1:]] if init is not None else []
        passed = next((kw.value for kw in ctor.keywords if kw.arg == v.id), None)
        if passed is None and v.id in names and names.index(v.id) < len(ctor.args):
            passed = ctor.args[names.index(v.id)]
        if passed is None and (None in {kw.arg for kw in ctor.keywords} or any(isinstance(a, ast.Starred) for a in ctor.args)):
            return f"set from the constructor argument `{v.id}`, which `{ast.unparse(ctor)[:40]}` may pass", False
        if passed is None or _s36_unit_default(passed):
            return True
        c = const_value(passed)
        known = isinstance(c, (int, float)) and not isinstance(c, bool)
        return f"set from the constructor argument `{v.id}`, which `{ast.unparse(ctor)[:40]}` passes", known
    c = const_value(v)
    if isinstance(c, (int, float)) and not isinstance(c, bool):
        return f"set to {c!r}", True
    if isinstance(v, ast.Call) and (module.canonical(v.func) or "").endswith("Parameter"):
        return "a learnable nn.Parameter", True
    return f"set to `{ast.unparse(v)[:40]}`", False


def _s40_beta_attribute(module: ModuleInfo, k: ast.expr, ctx: S.Ctx) -> str:
    """For a beta ``self.<attr>`` of the scope's class not shown to be 1: what it is (", set to 2.0", ", a learnable
    nn.Parameter", ", assigned more than once in the class, not shown to be 1"); "" for any other beta."""
    if ctx.depth or not (isinstance(k, ast.Attribute) and isinstance(k.value, ast.Name) and k.value.id == "self" and ctx.scope.class_name):
        return ""
    what = _s40_unit_attribute(module, ctx.scope.class_name, k.attr, None)
    return "" if what is True else f", {what[0]}{'' if what[1] else _S40_UNSHOWN}"


def _s40_sigmoid_arg(module: ModuleInfo, node: ast.expr) -> ast.expr | None:
    """The argument of ``torch.sigmoid(a)`` / ``F.sigmoid(a)`` / ``a.sigmoid()`` / ``torch.special.expit(a)``."""
    if not isinstance(node, ast.Call) or node.keywords:
        return None
    if module.canonical(node.func) in ("torch.sigmoid", "torch.nn.functional.sigmoid", "torch.special.expit") and len(node.args) == 1:
        return node.args[0]
    if isinstance(node.func, ast.Attribute) and node.func.attr == "sigmoid" and not node.args:
        return node.func.value
    return None


def _s40_swish_act(module: ModuleInfo, fn: ast.FunctionDef, cls_name: str | None, ctor: ast.Call | None, holder: ast.expr,
                   gate: ast.expr, ctx: S.Ctx, desc: str) -> Act | None:
    """The activation of a one-input ``forward`` / method ``fn`` of class ``cls_name`` whose one return is
    ``p * sigmoid(self.<beta> * p)`` (either order, casts of the result peeled): silu where ``self.<beta>`` is
    the number 1 (tested at run time on ``holder.<beta>``), a "swish with beta" saying what beta is otherwise;
    None for any other body."""
    params = [a.arg for a in fn.args.args[1:]]
    returns = [n for n in fast_walk(fn) if isinstance(n, ast.Return)]
    if cls_name is None or len(params) != 1 or len(returns) != 1 or returns[0].value is None or fn.args.vararg or fn.args.kwarg:
        return None
    p = params[0]
    v = _s41_straight_value(module, fn, returns[0].value)
    while S.is_cast(v):
        v = v.func.value  # type: ignore[union-attr]
    if not (isinstance(v, ast.BinOp) and isinstance(v.op, ast.Mult)):
        return None
    for z, sig in ((v.left, v.right), (v.right, v.left)):
        arg = _s40_sigmoid_arg(module, sig) if _s39_is_param(z, p) else None
        if not (isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Mult)):
            continue
        for k, other in ((arg.left, arg.right), (arg.right, arg.left)):
            if not _s39_is_param(other, p):
                continue
            if not (isinstance(k, ast.Attribute) and isinstance(k.value, ast.Name) and k.value.id == "self"):
                return None  # a literal beta is read by the formula readers; another factor is not a beta
            what = _s40_unit_attribute(module, cls_name, k.attr, ctor)
            formula = " ".join(ast.unparse(_s41_straight_value(module, fn, returns[0].value)).split())[:60]  # type: ignore[arg-type]
            if what is True:
                # (no end position: rendered from the tree, not as the source text under ``holder``)
                beta = ast.Attribute(value=holder, attr=k.attr, ctx=ast.Load(), lineno=holder.lineno, col_offset=holder.col_offset)
                return Act(SILU, gate, ctx, f"{desc}, whose forward returns `{formula}`", obj=holder if ctor is not None else None,
                           kernels=3, beta=beta)
            text, other = what
            return Act(f"swish with beta `self.{k.attr}` of {cls_name}, {text}{'' if other else _S40_UNSHOWN} (z * sigmoid(beta * z))",
                       gate, ctx, "", kernels=3)
    return None


def _s36_beta_check(module: ModuleInfo, g: Gate, plan: S.SpanPlan) -> str | None:
    """The run-time test that the swish's beta is the number 1 (None: no beta to test)."""
    if g.act.beta is None:
        return None
    b = S.atom(S.render(module, g.act.beta, g.act.ctx, plan))
    return f"isinstance({b}, (int, float)) and {b} == 1"


_S36_BETA_OP = '''
import torch


class SwiGLUOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X: torch.Tensor, beta: float = 1.0):
        x, g = torch.split(X, [X.shape[-1] // 2, X.shape[-1] // 2], -1)
        Y = g * x * torch.nn.functional.sigmoid(beta * x)
        return Y
'''

# invented: a module keeping beta from its constructor, the swish grouped and written second
_S36_BETA_ATTR = '''
import torch
from torch import nn


class ScaledSwishGLU(nn.Module):
    def __init__(self, d, h, beta=1):
        super().__init__()
        self.inp = nn.Linear(d, 2 * h)
        self.beta = beta

    def forward(self, t):
        u, v = self.inp(t).chunk(2, dim=-1)
        return v * (u * torch.sigmoid(self.beta * u))
'''

# invented: a helper naming the swish first, beta on the right of the product inside the sigmoid
_S36_BETA_NAMED = '''
import torch


def gated_swish(h, up, beta: float = 1.0):
    a = h * torch.sigmoid(h * beta)
    return a * up


def mlp(x, w_gate, w_up):
    return gated_swish(x @ w_gate, x @ w_up)
'''

Swiglu.FUSE += [
    Fuse(_S36_BETA_OP, expect={"activation": "silu", "source": "split", "beta_check": "isinstance(beta, (int, float)) and beta == 1"},
         run="x = torch.randn(3, 8, requires_grad=True)\nout = (SwiGLUOp.forward(None, x), SwiGLUOp.forward(None, x, 1.702))\nleaves = [x]\n",
         name="s36_swish_beta_defaulting_to_one_in_an_autograd_op"),
    Fuse(_S36_BETA_ATTR, expect={"activation": "silu", "beta_check": "isinstance(self.beta, (int, float)) and self.beta == 1"},
         run="x = torch.randn(2, 5, 8, requires_grad=True)\nout = (ScaledSwishGLU(8, 6)(x), ScaledSwishGLU(8, 6, beta=0.5)(x))\nleaves = [x]\n",
         name="s36_swish_beta_from_the_constructor"),
    Fuse(_S36_BETA_NAMED, expect={"activation": "silu", "qualname": "gated_swish"},
         run="x = torch.randn(4, 8, requires_grad=True)\nwg, wu = torch.randn(8, 6), torch.randn(8, 6)\n"
             "out = (mlp(x, wg, wu), gated_swish(x @ wg, x @ wu, 2.0))\nleaves = [x]\n",
         name="s36_swish_beta_in_a_named_swish"),
]

Swiglu.KEEP += [
    # beta defaults to GPT-OSS's 1.702: not silu
    Keep(_S36_BETA_NAMED.replace("beta: float = 1.0", "beta: float = 1.702"), reason="swish with beta",
         name="s36_swish_beta_defaulting_to_another_value"),
    # a learnable beta (a tensor): not a number that can be 1
    Keep(_S36_BETA_ATTR.replace("self.beta = beta", "self.beta = nn.Parameter(torch.ones(1) * beta)"), reason="",
         name="s36_swish_learnable_beta"),
]


Swiglu.FUSE += [
    # an else branch computing something else from the activation (was a Keep: "the `if` has an else
    # branch"): the restructured else runs the activation statements, then the else's own
    Fuse(_OPTIONAL_UP.replace("            h = h * self.w3(x)\n", "            h = h * self.w3(x)\n        else:\n            h = h * 2\n"),
         expect={"optional_gate": "self.w3 is not None"},
         run=_RUN_INJECTED.format(arg="") + '''
m0 = FeedForward(gate_proj=nn.Linear(8, 12), down_proj=nn.Linear(12, 8))
out = (out, m0(x))
leaves = leaves + [m0.w1.weight]
''', name="optional_up_projection_with_else"),
]

Swiglu.KEEP += [
    # every construction passing a fusable activation leaves the product's flag off (cosmos' FeedForward:
    # only GPT2FeedForward builds it, with nn.GELU() and is_gated=False): no GLU is ever computed
    Keep(_S36_OPTIONAL_GATE_WITH_ELSE.replace("    return FFN(d, 4 * d, nn.SiLU(), True)", "    return FFN(d, 4 * d, nn.SiLU(), gated=False)"),
         reason="gated=False (the product never runs)", name="s36_injected_activation_built_only_with_the_gate_off"),
]


# --- s37: `torch.clamp(t, lo, hi)` spelled as a function, optionally, on both operands (llm-torch SwiGLUBlock) ---
# `_elementwise_operand` read clamps only as methods (`t.clamp(...)`); the function spelling bound its tensor as a
# "bound" that reads an operand, so llm-torch's `if self.limit is not None: x1 = torch.clamp(x1, -L, L); x2 = ...`
# was "not projections of one input". The transforms stay outside the replaced span, as for the method spelling.
_S37_CLAMPED_GLU = '''
import torch
import torch.nn.functional as F
from torch import nn


class LimitedGLU(nn.Module):
    def __init__(self, d, h, limit=None):
        super().__init__()
        self.proj_a = nn.Linear(d, h, bias=False)
        self.proj_b = nn.Linear(d, h, bias=False)
        self.out = nn.Linear(h, d, bias=False)
        self.act = nn.SiLU()
        self.limit = limit

    def forward(self, x):
        a = self.proj_a(x)
        b = self.proj_b(x)
        if self.limit is not None:
            a = torch.clamp(a, -self.limit, self.limit)
            b = torch.clamp(b, -self.limit, self.limit)
        return self.out(self.act(a) * b)
'''

_S37_CAPPED_FUNCTION = '''
import torch
import torch.nn.functional as F


def capped_swiglu(x, w_gate, w_up, cap: float = 7.0):
    g = F.linear(x, w_gate)
    u = F.linear(x, w_up)
    g = torch.clip(g, max=cap)
    u = torch.clamp_min(u, -cap)
    return u * F.silu(g)
'''

Swiglu.FUSE += [
    Fuse(_S37_CLAMPED_GLU, expect={"activation": "silu"},
         run="x = torch.randn(2, 3, 8, requires_grad=True)\nout = (LimitedGLU(8, 6)(x), LimitedGLU(8, 6, 0.1)(x))\nleaves = [x]\n",
         name="s37_both_projections_clamped_by_torch_clamp_under_an_option"),
    Fuse(_S37_CAPPED_FUNCTION, expect={"activation": "silu"},
         run="x = torch.randn(4, 8, requires_grad=True)\nwg = torch.randn(6, 8, requires_grad=True)\n"
             "wu = torch.randn(6, 8, requires_grad=True)\nout = capped_swiglu(x, wg, wu, 0.5)\nleaves = [x, wg, wu]\n",
         name="s37_torch_clip_and_clamp_min_functions_on_linear_projections_operands_swapped"),
]

Swiglu.KEEP += [
    # the clamp applies to the activation's output, not to an operand: silu clipped at the limit is no silu
    Keep(_S37_CLAMPED_GLU.replace("            a = torch.clamp(a, -self.limit, self.limit)\n            b = torch.clamp(b, -self.limit, self.limit)\n"
                                  "        return self.out(self.act(a) * b)",
                                  "            return self.out(torch.clamp(self.act(a), max=self.limit) * b)\n        return self.out(b)"),
         reason="", name="s37_clamp_of_the_activation_output"),
    # the clamp's bound is the other operand: the gate depends on the up projection (no longer a transform of its own)
    Keep(_S37_CAPPED_FUNCTION.replace("g = torch.clip(g, max=cap)", "g = torch.clip(g, max=u)"), reason="",
         name="s37_clip_bounded_by_the_other_operand"),
]


# --- s37: a GLU kernel that clamps its own two parameters before returning the product (mojo_opset's SwiGLU op) ---
_S37_LIMITED_KERNEL = '''
import torch
import torch.nn.functional as F


class LimitedSwiGLU(torch.nn.Module):
    def __init__(self, limit: float = 0.0):
        super().__init__()
        self.limit = limit

    def forward(self, g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """silu(g) * v, both clamped first when a limit is set."""
        if self.limit > 0:
            v = torch.clamp(v, min=-self.limit, max=self.limit)
            g = g.clamp(max=self.limit)
        return F.silu(g) * v


def capped_glu(h1, h2, cap=3.0):
    h1 = torch.clip(h1, -cap, cap)
    return h2 * F.silu(h1)
'''

Swiglu.FUSE += [
    Fuse(_S37_LIMITED_KERNEL, expect={"activation": "silu"},
         run="g = torch.randn(2, 3, 6, requires_grad=True)\nv = torch.randn(2, 3, 6, requires_grad=True)\n"
             "out = (LimitedSwiGLU()(g, v), LimitedSwiGLU(0.3)(g, v), capped_glu(g, v, 0.5))\nleaves = [g, v]\n",
         name="s37_glu_kernel_clamping_its_parameters_first"),
]

Swiglu.KEEP += [
    # the kernel bounds the gate by the other parameter: a transform that reads the other operand
    Keep(_S37_LIMITED_KERNEL.split("\n\ndef capped_glu")[0].replace("g = g.clamp(max=self.limit)", "g = g.clamp(max=v)"),
         reason="", name="s37_glu_kernel_gate_clamped_by_the_other_parameter"),
]


# --- s38 glumoe38: an activation module built in place under a name that says nothing -------------
# (`self.f = torch.nn.SiLU()`: the forward's text names no activation; the constructor in __init__ does)
_S38_BUILT_IN_PLACE = '''
import torch
from torch import nn


class PackedGate(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.wi = nn.Linear(d, 2 * h, bias=False)
        self.f = torch.nn.SiLU()

    def forward(self, x):
        a, b = self.wi(x).chunk(2, dim=-1)
        return self.f(a) * b
'''

Swiglu.FUSE += [
    Fuse(_S38_BUILT_IN_PLACE, expect={"activation": "silu"},
         run="x = torch.randn(2, 3, 8, requires_grad=True)\nm = PackedGate(8, 6)\nout = m(x)\nleaves = [x, m.wi.weight]\n",
         name="s38_activation_module_under_a_plain_attribute_name"),
]

Swiglu.KEEP += [
    # the module built in place is a ReLU: no fused gated op computes it
    Keep(_S38_BUILT_IN_PLACE.replace("torch.nn.SiLU()", "torch.nn.ReLU()"),
         reason="activation is not silu", name="s38_plain_attribute_activation_is_relu"),
]


# --- s38 glumoe38: a gating method whose two parameters pass through calls of themselves first ------
# (HO13a Aleph-Alpha scaling's u-muP SwiGLU: `x = scale_bwd(x, s); gate = scale_bwd(gate, s)`, then
# `silu(x) * gate` or `silu(m * x) * gate / m`; its only caller passes two projections of one input).
# Was "gate and up are not projections of one input", not a fact: the operands were not followed back to
# the parameters. Invented spellings: a gradient-scaling autograd Function of this module, a scaled gate
# under an option, the post-division left outside the replaced product.
_S38_PARAMS_THROUGH_CALLS = '''
import torch
import torch.nn.functional as F
from torch import nn


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, s):
        ctx.s = s
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


def grad_scale(t, s):
    return _GradScale.apply(t, s)


class ScaledGLU(nn.Module):
    def __init__(self, d, h, mult=1.0):
        super().__init__()
        self.w1 = nn.Linear(d, h, bias=False)
        self.w3 = nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)
        self.mult = mult
        self.s = 0.5

    def _gated(self, u, v):
        u = grad_scale(u, self.s)
        v = grad_scale(v, self.s)
        if self.mult == 1.0:
            y = F.silu(u) * v
        else:
            y = F.silu(self.mult * u) * v / self.mult
        return y

    def forward(self, x):
        return self.w2(self._gated(self.w1(x), self.w3(x)))
'''

Swiglu.FUSE += [
    Fuse(_S38_PARAMS_THROUGH_CALLS, expect={"activation": "silu", "operands_from_callers": [41]},
         run="x = torch.randn(2, 3, 8, requires_grad=True)\nm1, m2 = ScaledGLU(8, 6), ScaledGLU(8, 6, mult=2.0)\n"
             "out = (m1(x), m2(x))\nleaves = [x, m1.w1.weight, m2.w3.weight]\n",
         name="s38_gating_parameters_through_calls_of_themselves"),
]

Swiglu.KEEP += [
    # the caller projects two different inputs: now said of the call, not of the operands
    Keep(_S38_PARAMS_THROUGH_CALLS.replace("self._gated(self.w1(x), self.w3(x))", "self._gated(self.w1(x), self.w3(x.flip(1)))"),
         reason="gate and up are the parameters `u` and `v` (transformed before the product) of `_gated`; the call on line 41 "
                "passes `self.w1(x)` and `self.w3(x.flip(1))`, not projections of one input", name="s38_gating_parameters_through_calls_projections_of_two_inputs"),
    # a rebinding that reads the other operand: not a transform of the parameter alone
    Keep(_S38_PARAMS_THROUGH_CALLS.replace("u = grad_scale(u, self.s)", "u = grad_scale(u, v)"),
         reason="", name="s38_gating_parameter_rebound_from_the_other_operand"),
]


# --- s39 glumoe39: the module's own activation class, its sigmoid written out ----------------------
# (HO15a LLM-quest: `self.silu_activ = SiLU()` with `class SiLU(nn.Module)` returning
# `x * 1 / (1 + torch.exp(-x))`: the forward is read structurally, so the spelling of the sigmoid
# (a call, `1 / (1 + exp(-x))`, a reciprocal) does not matter; a formula that is not exactly SiLU is
# a near miss that says what it returns.) Invented spellings below.
_S39_OWN_ACT_CLASS = '''
import torch
from torch import nn


class Swish(nn.Module):
    def forward(self, t):
        return t / (1 + torch.exp(-t))


class GatedFF(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.a = nn.Linear(d, h, bias=False)
        self.b = nn.Linear(d, h, bias=False)
        self.o = nn.Linear(h, d, bias=False)
        self.nl = Swish()

    def forward(self, x):
        g = self.nl(self.a(x))
        return self.o(g * self.b(x))
'''

Swiglu.FUSE += [
    Fuse(_S39_OWN_ACT_CLASS, expect={"activation": "silu"},
         run="x = torch.randn(2, 3, 8, requires_grad=True)\nm = GatedFF(8, 6)\nout = m(x)\nleaves = [x, m.a.weight, m.b.weight]\n",
         name="s39_own_activation_class_sigmoid_written_out"),
    Fuse(_S39_OWN_ACT_CLASS.replace("return t / (1 + torch.exp(-t))", "return t * 1 / (torch.exp(-t) + 1)"),
         expect={"activation": "silu"},
         run="x = torch.randn(2, 3, 8, requires_grad=True)\nm = GatedFF(8, 6)\nout = m(x)\nleaves = [x, m.a.weight]\n",
         name="s39_own_activation_class_times_one_over_one_plus_exp"),
]

Swiglu.KEEP += [
    # a Swish with beta 2 written out: not SiLU; the near miss says what the class computes
    Keep(_S39_OWN_ACT_CLASS.replace("return t / (1 + torch.exp(-t))", "return t / (1 + torch.exp(-2.0 * t))"),
         reason="the activation is the module's own class (self.nl = Swish(), whose forward returns "
                "`t / (1 + torch.exp(-2.0 * t))`), a formula npufuse does not read as silu",
         name="s39_own_activation_class_swish_beta_two"),
    # a plain `x * sigmoid(x) * beta`-free but offset formula: not SiLU either
    Keep(_S39_OWN_ACT_CLASS.replace("return t / (1 + torch.exp(-t))", "return t / (1 + torch.exp(-t)) + 0.1 * t"),
         reason="a formula npufuse does not read as silu", name="s39_own_activation_class_offset_swish"),
]


# --- s39 glumoe39: the up branch scaled by an optional mask before the product ----------------------
# (HO15a LLM-Shearing: `gate = F.silu(self.gate_proj(x)); up_v = self.up_proj(x); if z is not None:
# up_v *= z; self.down_proj(gate * up_v)`.) A scale of the up half stays as written (npu_swiglu takes
# the scaled half: silu(g) * (u * m) exactly); what the fused branch must check is that gate and up have
# one shape (a mask could broadcast up to a larger shape). The gate projection is computed inside the
# activation, so its shape is read from the nn.Linear and its input instead of computing it twice; the
# method spelling `up.mul(mask)` is a scale like `up * mask`. Invented spellings below.
_S39_UP_MASKED = '''
import torch
import torch.nn.functional as F
from torch import nn


class PrunableMLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w_gate = nn.Linear(d, h, bias=False)
        self.w_up = nn.Linear(d, h, bias=False)
        self.w_down = nn.Linear(h, d, bias=False)

    def forward(self, x, keep=None):
        act = F.silu(self.w_gate(x))
        val = self.w_up(x)
        if keep is not None:
            val *= keep
        return self.w_down(act * val)


class MethodMasked(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.g = nn.Linear(d, h, bias=False)
        self.u = nn.Linear(d, h, bias=False)

    def forward(self, x, keep=None):
        a, b = self.g(x), self.u(x)
        if keep is not None:
            b = b.mul(keep)
        return F.silu(a) * b
'''

_S39_UP_MASKED_RUN = '''\
x = torch.randn(2, 3, 8, requires_grad=True)
keep = (torch.rand(6) > 0.3).float()
m1, m2 = PrunableMLP(8, 6), MethodMasked(8, 6)
out = (m1(x), m1(x, keep), m2(x), m2(x, keep), m2(x, torch.ones(4, 1, 1, 6)))
leaves = [x, m1.w_gate.weight, m1.w_up.weight, m2.u.weight]
'''

Swiglu.FUSE += [
    Fuse(_S39_UP_MASKED, expect={"activation": "silu", "qualname": "PrunableMLP.forward"}, run=_S39_UP_MASKED_RUN,
         name="s39_up_half_scaled_by_an_optional_mask"),
]

Swiglu.KEEP += [
    # the gate projection is a module npufuse cannot read the shape of (a local class): its shape cannot be
    # checked without computing it twice
    Keep(_S39_UP_MASKED.replace("class PrunableMLP", "class Proj(nn.Linear):\n    pass\n\n\nclass PrunableMLP")
         .replace("self.w_gate = nn.Linear(d, h, bias=False)", "self.w_gate = Proj(d, h, bias=False)")
         .split("class MethodMasked")[0],
         reason="computed inside the activation or product", name="s39_up_masked_gate_projection_not_an_nn_linear"),
    # the "mask" is the projections' input: silu(g) * (u * x) gates by the input itself
    Keep(_S39_UP_MASKED.replace("b = b.mul(keep)", "b = b.mul(x)").split("class PrunableMLP")[0]
         + "class MethodMasked" + _S39_UP_MASKED.replace("b = b.mul(keep)", "b = b.mul(x)").split("class MethodMasked")[1],
         reason="", name="s39_up_scaled_by_the_projections_input"),
]
