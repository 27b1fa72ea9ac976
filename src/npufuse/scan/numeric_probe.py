"""Numeric probe: prove what a function computes by interpreting its AST on sampled inputs.

Every syntactic matcher recognises spellings; a function written another way is missed. This
module takes a different route: it *evaluates* one function (a module-level function, or a
method such as ``forward`` with ``self`` built by interpreting the class's ``__init__``) on
random inputs with a small interpreter of its own, then compares the result with a pattern's
reference implementation (:func:`prove_rms_norm`).

Safety: repository code is never imported, ``exec``'d or ``eval``'d. The interpreter walks AST
nodes itself and calls only an allowlist of pure torch functions, tensor methods,
``torch.nn.functional`` ops, a few ``torch.nn`` modules (torch's own code) and a few builtins.
Anything else -- an unknown call, I/O, an import, a write to a global or to ``self`` outside
``__init__``, a loop over an unknown or large range, recursion past a depth budget, a step budget,
a tensor over ``MAX_NUMEL`` elements -- stops the evaluation with :class:`Unknown` and its reason.

torch is imported only when a probe actually runs (the scan otherwise never pays for it), and
:func:`static_gate` turns most functions away from their AST alone, before that import.
"""

from __future__ import annotations

import ast
import re
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

# s46: fast_walk / child_nodes for ast.walk / ast.iter_child_nodes (the same nodes, in the same order)
from npufuse.scan.dataflow import ModuleInfo, _is_word, child_nodes, fast_walk

MAX_NUMEL = 100_000  # elements of any tensor the probe creates
MAX_STEPS = 20_000  # AST nodes evaluated per run
MAX_DEPTH = 6  # nested helper calls
MAX_LOOP = 64  # iterations of one for loop
DIM = 16  # what a dimension-like constructor argument is set to


class Unknown(Exception):
    """The evaluation cannot go on; ``reason`` says why (counted in reports)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Opaque:
    """A value the probe could not build (an unknown construction); any use of it is Unknown."""

    what: str


@dataclass
class Obj:
    """``self``: attributes built by interpreting ``__init__``, methods from the class AST."""

    cls: ast.ClassDef
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ConfigStub:
    """A constructor argument the class reads only through its attributes (``config.n_embd``,
    ``getattr(cfg, "bias", True)``: the nanoGPT / lit-gpt style). Each attribute holds a value chosen
    from how the class uses it (:func:`config_values`); reading any other attribute is Unknown."""

    name: str
    values: dict[str, Any]


@dataclass
class Func:
    """A function of the probed module (a helper or a method), interpreted when called."""

    node: ast.FunctionDef
    bound: Obj | None = None
    module: Any = None  # the ModuleInfo of another file of the repo that defines it (None: this one)


@dataclass
class Dotted:
    """A torch/math name not yet resolved to an allowlisted object (``torch.nn.functional``)."""

    name: str


@dataclass
class Decision:
    """One ``if``/``IfExp``/``and``/``or`` test taken during a run, with the value it had."""

    test: ast.expr
    value: bool
    foreign: bool = False  # taken inside a helper of another file: its names are not this scope's


_torch: Any = None


def torch_module() -> Any:
    """torch, imported on first use (the scan itself never imports it)."""
    global _torch
    if _torch is None:
        import torch

        _torch = torch
    return _torch


# --- allowlists ----------------------------------------------------------------------------

# torch.<name> functions (pure, deterministic; creation functions are capped by MAX_NUMEL)
_TORCH_FUNCS = frozenset("""
rsqrt sqrt pow square mean sum add mul multiply div divide sub subtract neg abs exp log log1p
clamp clamp_min clamp_max clip maximum minimum max min amax amin where cat concat stack norm var
std var_mean std_mean reciprocal tanh sigmoid matmul einsum ones ones_like zeros zeros_like full
full_like arange finfo promote_types is_tensor is_floating_point softmax erf cumsum prod
unsqueeze squeeze reshape transpose permute flatten chunk split unbind rms_norm layer_norm empty
mm bmm argmax argmin tensor linspace square_ float_power Size roll flip narrow negative movedim swapaxes
""".split())
_INIT_FILLS = frozenset(("ones_", "zeros_", "normal_", "uniform_", "constant_", "trunc_normal_", "xavier_uniform_"))
_TORCH_CONSTANT_FALSE = frozenset(("torch.is_autocast_enabled", "torch.jit.is_scripting", "torch.jit.is_tracing",
                                   "torch.compiler.is_compiling", "torch._dynamo.is_compiling",
                                   "torch.is_grad_enabled"))
_LINALG_FUNCS = frozenset(("vector_norm", "norm"))
_F_FUNCS = frozenset("""
silu gelu relu sigmoid tanh softmax linear normalize layer_norm rms_norm dropout leaky_relu
""".split())
_NN_MODULES = frozenset(("Linear", "Identity", "Dropout"))
_DTYPES = frozenset("""
float32 float float16 half bfloat16 float64 double int32 int64 long int bool
""".split())
_TENSOR_METHODS = frozenset("""
float half bfloat16 double to type type_as pow square mean sum rsqrt sqrt mul mul_ add add_ sub
sub_ div div_ neg abs clamp clamp_ clamp_min clamp_max reshape view view_as flatten unsqueeze
squeeze transpose permute contiguous size dim numel norm var std chunk split unbind expand
expand_as exp log sigmoid tanh max min amax amin reciprocal detach clone new_ones new_zeros
softmax matmul t is_floating_point square_ pow_ rsqrt_ sqrt_ masked_fill eq ne gt lt ge le
bool long int repeat repeat_interleave argmax argmin mm bmm float_power new_full new_empty
roll flip narrow unflatten movedim swapaxes negative
""".split())
_TENSOR_ATTRS = frozenset(("shape", "dtype", "ndim", "device", "T", "is_cuda", "requires_grad"))
_BUILTINS = frozenset(("len", "int", "float", "min", "max", "tuple", "list", "isinstance", "range",
                       "abs", "bool", "super", "getattr", "hasattr", "pow", "round", "sum",
                       "enumerate", "zip", "reversed"))
_CONTEXTS = frozenset(("torch.autocast", "torch.no_grad", "torch.amp.autocast", "torch.cuda.amp.autocast",
                       "torch.cpu.amp.autocast", "contextlib.nullcontext", "torch.inference_mode",
                       "torch.enable_grad"))


# --- static gate ---------------------------------------------------------------------------


def _canon(module: ModuleInfo, node: ast.AST) -> str | None:
    name = module.canonical(node)
    if name is None:
        return None
    return name.replace("torch.nn.functional.", "F.").replace("torch.functional.", "torch.")


def _allowed_dotted(name: str) -> bool:
    if name in _TORCH_CONSTANT_FALSE or name in _CONTEXTS:
        return True
    if name.startswith("F."):
        return name[2:] in _F_FUNCS
    if name.startswith("torch.linalg."):
        return name[13:] in _LINALG_FUNCS
    if name.startswith("torch.nn.init."):
        return name[14:] in _INIT_FILLS
    if name.startswith("torch.nn.") and name.count(".") == 2:
        return name[9:] in _NN_MODULES or name[9:] in ("Parameter", "Buffer")
    if name.startswith("torch.") and name.count(".") == 1:
        return name[6:] in _TORCH_FUNCS or name[6:] in _DTYPES
    if name.startswith("math."):
        return name[5:] in ("sqrt", "pi", "e", "log", "exp", "prod", "inf", "floor", "ceil", "log2")
    return False


def static_gate(module: ModuleInfo, fn: ast.FunctionDef, cls: ast.ClassDef | None) -> str | None:
    """Why the probe surely cannot evaluate ``fn`` (a call outside the allowlist, a loop it does
    not run, ...), from the AST alone -- or None. Run before torch is imported."""
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)} if cls is not None else set()
    for node in _code_nodes(fn):
        if isinstance(node, (ast.While, ast.Try, ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal,
                             ast.Yield, ast.YieldFrom, ast.Await, ast.Lambda, ast.SetComp)):
            return f"{type(node).__name__.lower()} in the function"
        if isinstance(node, ast.Raise) and node is not None:
            continue  # only an error path: a run that reaches it is Unknown
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name):
            if f.id in _BUILTINS or f.id in module.functions:
                continue
            target = _canon(module, f)
            if target and _allowed_dotted(target):
                continue
            if _repo_function(module, f.id) is not None:
                continue  # a function of another file of the repo: gated when it is resolved
            return f"call of `{f.id}`"
        if isinstance(f, ast.Attribute):
            base = f.value
            if isinstance(base, ast.Name) and base.id == "self":
                continue  # a method (interpreted) or a submodule (must be an allowlisted nn module)
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            target = _canon(module, f)
            root = target.split(".")[0] if target else ""
            if target and root in ("torch", "F", "math", "contextlib", "nn"):
                if _allowed_dotted(target):
                    continue
                return f"call of `{target}`"
            if target and root in module.aliases and root not in ("torch", "F", "math", "contextlib", "nn"):
                return f"call of `{target}`"  # an imported module's function (os.system, np.*)
            if f.attr in _TENSOR_METHODS:
                continue
            return f"call of method `.{f.attr}`"
        else:
            continue  # a call of a call's result etc.: decided at run time
    return None


# --- the interpreter -----------------------------------------------------------------------


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a ** b, ast.MatMult: lambda a, b: a @ b,
}
_CMPOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
    ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}


class _Return(Exception):
    def __init__(self, value: Any) -> None:
        self.value = value


class Interpreter:
    """Evaluates functions of one module. One instance per run (it counts steps)."""

    def __init__(self, module: ModuleInfo, in_init: bool = False) -> None:
        self.module = module
        self.torch = torch_module()
        self.steps = 0
        self.depth = 0
        self.in_init = in_init
        self.decisions: list[Decision] = []
        self.entered: list[ast.FunctionDef] = []  # helpers followed (their findings cover callers)
        self.stack: list[ast.FunctionDef] = []  # functions running (super() starts after the owner's class)
        self.scalar_reads: dict[str, Any] = {}  # self.<attr> -> int/float value read by the run

    # -- values ----------------------------------------------------------------------------
    def _check(self, v: Any) -> Any:
        t = self.torch
        if isinstance(v, t.Tensor) and v.numel() > MAX_NUMEL:
            raise Unknown(f"creates a tensor of {v.numel()} elements (cap {MAX_NUMEL})")
        if isinstance(v, Opaque):
            raise Unknown(f"uses {v.what}")
        return v

    def _plain(self, v: Any) -> Any:
        """A value used in arithmetic or a call: never opaque."""
        if isinstance(v, Opaque):
            raise Unknown(f"uses {v.what}")
        if isinstance(v, (Dotted, Func, Obj)):
            raise Unknown("uses a function or object as a value")
        return v

    # -- functions -------------------------------------------------------------------------
    def call_function(self, fn: ast.FunctionDef, args: list[Any], kwargs: dict[str, Any], bound: Obj | None) -> Any:
        if self.depth >= MAX_DEPTH:
            raise Unknown("helper calls nested too deeply (recursion?)")
        if self.depth > 0 and fn.decorator_list and not all(isinstance(d, ast.Name) and d.id in ("staticmethod",) for d in fn.decorator_list):
            raise Unknown("calls a decorated helper")
        env = self._bind(fn, ([bound] if bound is not None and not _is_static(fn) else []) + list(args), kwargs)
        self.depth += 1
        self.stack.append(fn)
        try:
            self._block(fn.body, env)
        except _Return as r:
            return r.value
        finally:
            self.depth -= 1
            self.stack.pop()
        return None

    def _bind(self, fn: ast.FunctionDef, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        a = fn.args
        if a.vararg is not None or a.kwarg is not None:
            if len(args) > len(a.posonlyargs) + len(a.args) or set(kwargs) - {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}:
                raise Unknown("*args/**kwargs receive arguments")
        params = [*a.posonlyargs, *a.args]
        env: dict[str, Any] = {}
        if a.vararg is not None:
            env[a.vararg.arg] = ()
        if a.kwarg is not None:
            env[a.kwarg.arg] = {}
        if len(args) > len(params):
            raise Unknown("too many positional arguments")
        for p, v in zip(params, args):
            env[p.arg] = v
        defaults = dict(zip([p.arg for p in params][len(params) - len(a.defaults):], a.defaults))
        for p, d in zip(a.kwonlyargs, a.kw_defaults):
            if d is not None:
                defaults[p.arg] = d
        for k, v in kwargs.items():
            if k in env:
                raise Unknown(f"argument `{k}` given twice")
            env[k] = v
        for p in (*params, *a.kwonlyargs):
            if p.arg not in env:
                if p.arg not in defaults:
                    raise Unknown(f"argument `{p.arg}` has no value")
                env[p.arg] = self.expr(defaults[p.arg], {})
        return env

    # -- statements ------------------------------------------------------------------------
    def _block(self, body: list[ast.stmt], env: dict[str, Any]) -> None:
        for st in body:
            self._stmt(st, env)

    def _step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise Unknown("step budget exhausted")

    def _stmt(self, st: ast.stmt, env: dict[str, Any]) -> None:
        self._step()
        if isinstance(st, ast.Expr):
            if isinstance(st.value, ast.Constant):
                return  # docstring
            self.expr(st.value, env)
        elif isinstance(st, ast.Assign):
            v = self.expr(st.value, env)
            for t in st.targets:
                self._assign(t, v, env)
        elif isinstance(st, ast.AnnAssign):
            if st.value is not None:
                self._assign(st.target, self.expr(st.value, env), env)
        elif isinstance(st, ast.AugAssign):
            op = _BINOPS.get(type(st.op))
            if op is None:
                raise Unknown(f"operator {type(st.op).__name__}")
            cur = self.expr(_as_load(st.target), env)
            self._assign(st.target, self._check(op(self._plain(cur), self._plain(self.expr(st.value, env)))), env)
        elif isinstance(st, ast.Return):
            raise _Return(self.expr(st.value, env) if st.value is not None else None)
        elif isinstance(st, ast.If):
            self._block(st.body if self._test(st.test, env) else st.orelse, env)
        elif isinstance(st, ast.With):
            for item in st.items:
                ctx = item.context_expr
                target = _canon(self.module, ctx.func if isinstance(ctx, ast.Call) else ctx)
                if target not in _CONTEXTS:
                    raise Unknown(f"with `{ast.unparse(ctx)[:40]}`")
                if item.optional_vars is not None:
                    raise Unknown("with ... as")
            self._block(st.body, env)
        elif isinstance(st, ast.Assert) or isinstance(st, ast.Pass):
            return
        elif isinstance(st, ast.For):
            it = self.expr(st.iter, env)
            if isinstance(it, range) or isinstance(it, (tuple, list)):
                items = list(it)
            else:
                raise Unknown("a for loop over an unknown iterable")
            if len(items) > MAX_LOOP or st.orelse:
                raise Unknown("a long for loop")
            for v in items:
                self._assign(st.target, v, env)
                self._block(st.body, env)
        elif isinstance(st, ast.Raise):
            raise Unknown("reaches a raise")
        else:
            raise Unknown(f"statement {type(st).__name__}")

    def _assign(self, t: ast.expr, v: Any, env: dict[str, Any]) -> None:
        if isinstance(t, ast.Name):
            env[t.id] = v
        elif isinstance(t, (ast.Tuple, ast.List)):
            vals = list(self._plain(v)) if not isinstance(v, self.torch.Tensor) else list(v.unbind(0))
            stars = [i for i, e in enumerate(t.elts) if isinstance(e, ast.Starred)]
            if len(stars) == 1 and len(vals) >= len(t.elts) - 1:
                # ``*shape, d, r = x.shape`` (k-diffusion): the starred name takes what the others leave, as a list
                i, after = stars[0], len(t.elts) - stars[0] - 1
                rest = vals[i : len(vals) - after]
                vals = vals[:i] + [rest] + vals[len(vals) - after :]
                t_elts = [e.value if isinstance(e, ast.Starred) else e for e in t.elts]
            elif len(vals) != len(t.elts) or stars:
                raise Unknown("unpacking mismatch")
            else:
                t_elts = list(t.elts)
            for e, x in zip(t_elts, vals):
                self._assign(e, x, env)
        elif isinstance(t, ast.Attribute):
            obj = self.expr(t.value, env)
            if not (self.in_init and isinstance(obj, Obj)):
                raise Unknown("writes an attribute")
            obj.attrs[t.attr] = v
        elif isinstance(t, ast.Subscript):
            obj = self._plain(self.expr(t.value, env))
            if not isinstance(obj, self.torch.Tensor):
                raise Unknown("item assignment into a non-tensor")
            obj[self._index(t.slice, env)] = self._plain(v)
        else:
            raise Unknown(f"assignment to {type(t).__name__}")

    def _test(self, test: ast.expr, env: dict[str, Any]) -> bool:
        v = self.expr(test, env)
        if isinstance(v, Opaque):
            # an unknown flag or construction: the value decides nothing we can prove here
            raise Unknown(f"a branch on {v.what}")
        if isinstance(v, self.torch.Tensor):
            if v.numel() != 1:
                raise Unknown("a branch on a tensor")
            raise Unknown("a branch on tensor values")
        b = bool(v)
        self.decisions.append(Decision(test, b))
        return b

    # -- expressions -----------------------------------------------------------------------
    def expr(self, node: ast.expr, env: dict[str, Any]) -> Any:
        self._step()
        t = self.torch
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return self._name(node.id, env)
        if isinstance(node, ast.Attribute):
            return self._attribute(node, env)
        if isinstance(node, ast.BinOp):
            op = _BINOPS.get(type(node.op))
            if op is None:
                raise Unknown(f"operator {type(node.op).__name__}")
            a, b = self._plain(self.expr(node.left, env)), self._plain(self.expr(node.right, env))
            try:
                return self._check(op(a, b))
            except Unknown:
                raise
            except Exception as e:  # a shape or type error of the sampled run
                raise Unknown(f"arithmetic fails on the sample ({type(e).__name__})") from None
        if isinstance(node, ast.UnaryOp):
            v = self._plain(self.expr(node.operand, env))
            if isinstance(node.op, ast.USub):
                return -v
            if isinstance(node.op, ast.UAdd):
                return +v
            if isinstance(node.op, ast.Not):
                if isinstance(v, t.Tensor):
                    raise Unknown("`not` of a tensor")
                self.decisions.append(Decision(node.operand, bool(v)))
                return not v
            raise Unknown("operator ~")
        if isinstance(node, ast.BoolOp):
            last: Any = None
            for i, v_node in enumerate(node.values):
                last = self.expr(v_node, env)
                if isinstance(last, (Opaque, t.Tensor)):
                    raise Unknown("and/or on an unknown value or a tensor")
                if i < len(node.values) - 1:
                    self.decisions.append(Decision(v_node, bool(last)))
                    if isinstance(node.op, ast.And) and not last:
                        return last
                    if isinstance(node.op, ast.Or) and last:
                        return last
            return last
        if isinstance(node, ast.Compare):
            left = self._plain(self.expr(node.left, env))
            for op, rnode in zip(node.ops, node.comparators):
                right = self._plain(self.expr(rnode, env))
                if isinstance(left, t.Tensor) or isinstance(right, t.Tensor):
                    if isinstance(op, (ast.Is, ast.IsNot)):
                        r = _CMPOPS[type(op)](left, right)
                    else:
                        raise Unknown("a comparison of tensors")
                else:
                    try:
                        r = _CMPOPS[type(op)](left, right)
                    except Exception:
                        raise Unknown("a comparison fails on the sample") from None
                if not r:
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return self.expr(node.body if self._test(node.test, env) else node.orelse, env)
        if isinstance(node, (ast.Tuple, ast.List)):
            vals = [self.expr(e, env) for e in node.elts if not isinstance(e, ast.Starred)]
            if any(isinstance(e, ast.Starred) for e in node.elts):
                raise Unknown("a starred element")
            return tuple(vals) if isinstance(node, ast.Tuple) else vals
        if isinstance(node, ast.Subscript):
            base = self._plain(self.expr(node.value, env))
            idx = self._index(node.slice, env)
            try:
                return self._check(base[idx])
            except Unknown:
                raise
            except Exception as e:
                raise Unknown(f"indexing fails on the sample ({type(e).__name__})") from None
        if isinstance(node, ast.Call):
            return self._call(node, env)
        if isinstance(node, ast.JoinedStr):
            return ""
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.DictComp)):
            return _comprehension(self, node, env)
        raise Unknown(f"expression {type(node).__name__}")

    def _index(self, node: ast.expr, env: dict[str, Any]) -> Any:
        if isinstance(node, ast.Slice):
            parts = [self._plain(self.expr(p, env)) if p is not None else None for p in (node.lower, node.upper, node.step)]
            return slice(*parts)
        if isinstance(node, ast.Tuple):
            return tuple(self._index(e, env) for e in node.elts)
        v = self._plain(self.expr(node, env))
        if v is Ellipsis or v is None or isinstance(v, (int, self.torch.Tensor)):
            return v
        raise Unknown("an index of an unknown kind")

    def _name(self, name: str, env: dict[str, Any]) -> Any:
        if name in env:
            return env[name]
        m = self.module
        if name in m.functions:
            return Func(m.functions[name])  # type: ignore[arg-type]
        other = _repo_function(m, name)
        if other is not None:
            return Func(other[1], None, other[0])
        if name in m.aliases:
            return Dotted(m.aliases[name].replace("torch.nn.functional", "F"))
        if name in ("True", "False", "None"):
            return {"True": True, "False": False, "None": None}[name]
        if name in _BUILTINS:
            return Dotted("builtins." + name)
        const = _module_constant(m, name)
        if const is not _MISSING:
            return self.expr(const, {}) if isinstance(const, ast.expr) else const
        if name in m.classes:
            return Opaque(f"class `{name}`")
        raise Unknown(f"name `{name}` is not known")

    def _attribute(self, node: ast.Attribute, env: dict[str, Any]) -> Any:
        t = self.torch
        base = self.expr(node.value, env)
        if isinstance(base, Dotted):
            full = f"{base.name}.{node.attr}"
            if full.startswith("torch.") and node.attr in _DTYPES and full.count(".") == 1:
                return getattr(t, node.attr)
            if full in ("math.pi", "math.e", "math.inf"):
                return getattr(math, node.attr)
            return Dotted(full)
        if isinstance(base, Obj):
            if node.attr in base.attrs:
                v = base.attrs[node.attr]
                if isinstance(v, (int, float)) and not isinstance(v, bool) and not self.in_init:
                    self.scalar_reads[node.attr] = v
                return v
            for fn in _methods(self.module, base.cls):
                if fn.name == node.attr:
                    if any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list):
                        return self.call_function(_undecorated(fn), [], {}, base)
                    return Func(fn, base)
            if node.attr in ("register_buffer", "register_parameter") and self.in_init:
                return ("register", base, node.attr)
            if node.attr == "training":
                return False  # the probe runs the module in eval mode; tests on it become guards
            raise Unknown(f"attribute `self.{node.attr}` is not set by __init__")
        if isinstance(base, ConfigStub):
            if node.attr in base.values:
                return base.values[node.attr]
            raise Unknown(f"`{base.name}.{node.attr}` is not read where the probe can choose its value")
        if isinstance(base, Opaque):
            raise Unknown(f"uses {base.what}")
        if isinstance(base, t.Tensor):
            if node.attr in _TENSOR_ATTRS:
                return getattr(base, node.attr)
            if node.attr in _TENSOR_METHODS:
                return ("method", base, node.attr)
            raise Unknown(f"tensor attribute `.{node.attr}`")
        if isinstance(base, t.nn.Module) and node.attr in ("weight", "bias", "in_features", "out_features"):
            return getattr(base, node.attr)
        if isinstance(base, t.dtype) and node.attr in ("is_floating_point", "itemsize"):
            return getattr(base, node.attr)
        if isinstance(base, type(t.finfo(t.float32))) and node.attr in ("eps", "tiny", "max", "min"):
            return getattr(base, node.attr)
        if isinstance(base, t.Size) and node.attr == "numel":
            return ("method", base, "numel")
        raise Unknown(f"attribute `.{node.attr}` of a {type(base).__name__}")

    def _call(self, node: ast.Call, env: dict[str, Any]) -> Any:
        t = self.torch
        # super().__init__(...) / super().method(...)
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name) \
                and f.value.func.id == "super":
            return self._super_call(f.attr, node, env)
        fv = self.expr(f, env)
        args: list[Any] = []
        for a in node.args:
            if isinstance(a, ast.Starred):
                # s31: ``x.reshape(*x.shape[:-1], -1, 2)``: a tuple / list / torch.Size of plain values spread
                spread = self.expr(a.value, env)
                if not isinstance(spread, (tuple, list, self.torch.Size)) or len(spread) > 16 \
                        or any(isinstance(v, (Opaque, Func, Obj)) for v in spread):
                    raise Unknown("a *args call")
                args.extend(spread)
                continue
            args.append(self.expr(a, env))
        kwargs: dict[str, Any] = {}
        for k in node.keywords:
            if k.arg is None:
                raise Unknown("a **kwargs call")
            kwargs[k.arg] = self.expr(k.value, env)
        if isinstance(fv, Func):
            if any(isinstance(a, Opaque) for a in (*args, *kwargs.values())):
                raise Unknown("passes an unknown value to a helper")
            self.entered.append(fv.node)
            if fv.module is not None:
                return _call_foreign(self, fv, args, kwargs)
            return self.call_function(fv.node, args, kwargs, fv.bound)
        if isinstance(fv, tuple) and len(fv) == 3 and fv[0] == "register":
            if len(args) < 2 or not isinstance(args[0], str):
                raise Unknown(f"{fv[2]} with unknown arguments")
            value = args[1]
            if isinstance(value, t.Tensor) and fv[2] == "register_parameter":
                value = value.detach().clone()
            fv[1].attrs[args[0]] = value
            return None
        if isinstance(fv, tuple) and len(fv) == 3 and fv[0] == "method":
            _, base, name = fv
            args = [self._plain(a) for a in args]
            kwargs = {k: self._plain(v) for k, v in kwargs.items()}
            if name in ("to", "type") and any(isinstance(a, (str, t.device)) for a in args):
                args = [a for a in args if not isinstance(a, (str, t.device))]
                if not args and not kwargs:
                    return base
            kwargs.pop("device", None)
            kwargs.pop("non_blocking", None)
            try:
                return self._check(getattr(base, name)(*args, **kwargs))
            except Unknown:
                raise
            except Exception as e:
                raise Unknown(f"`.{name}` fails on the sample ({type(e).__name__})") from None
        if isinstance(fv, Dotted):
            return self._dotted_call(fv.name, args, kwargs)
        if isinstance(fv, t.nn.Module):
            try:
                return self._check(fv(*[self._plain(a) for a in args]))
            except Unknown:
                raise
            except Exception as e:
                raise Unknown(f"a submodule call fails on the sample ({type(e).__name__})") from None
        if isinstance(fv, Opaque):
            raise Unknown(f"calls {fv.what}")
        raise Unknown(f"calls a {type(fv).__name__}")

    def _super_call(self, name: str, node: ast.Call, env: dict[str, Any]) -> Any:
        obj = env.get("self")
        if not isinstance(obj, Obj):
            raise Unknown("super() outside a method")
        args = [self.expr(a, env) for a in node.args]
        kwargs = {k.arg: self.expr(k.value, env) for k in node.keywords if k.arg is not None}
        chain = _bases(self.module, obj.cls)
        owner = next((i for i, c in enumerate(chain) if self.stack and self.stack[-1] in c.body), 0)
        for base in chain[owner + 1:]:
            for fn in base.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == name:
                    return self.call_function(fn, args, kwargs, obj)
        if name == "__init__" and _plain_module_base(self.module, obj.cls):
            return None
        raise Unknown(f"super().{name} of a class outside this file")

    def _dotted_call(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        t = self.torch
        if name in _TORCH_CONSTANT_FALSE:
            return False
        if name in _CONTEXTS:
            return None
        if name.startswith("builtins."):
            return self._builtin(name[9:], args, kwargs)
        if not _allowed_dotted(name):
            raise Unknown(f"call of `{name}`")
        args = [self._plain(a) for a in args]
        kwargs = {k: self._plain(v) for k, v in kwargs.items()}
        kwargs.pop("device", None)
        if name.startswith("math."):
            return getattr(math, name[5:])(*args, **kwargs)
        if name in ("torch.nn.Parameter", "torch.nn.Buffer"):
            v = args[0] if args else kwargs.get("data")
            if not isinstance(v, t.Tensor):
                raise Unknown("a Parameter of a non-tensor")
            return v.detach().clone()
        if name.startswith("torch.nn.init."):
            return args[0]  # a fill: every float tensor is randomized before a run anyway
        if name.startswith("torch.nn."):
            try:
                mod = getattr(t.nn, name[9:])(*args, **kwargs)
            except Exception as e:
                raise Unknown(f"`{name}` fails on the sample ({type(e).__name__})") from None
            if isinstance(mod, t.nn.Dropout):
                mod.eval()
            return mod
        if name == "F.dropout":
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            if p != 0 and training is not False:
                raise Unknown("dropout with p > 0 in training mode")
            return args[0]
        if name.startswith("F."):
            fn = getattr(t.nn.functional, name[2:])
        elif name.startswith("torch.linalg."):
            fn = getattr(t.linalg, name[13:])
        else:
            fn = getattr(t, name[6:])
        if name == "torch.empty":
            fn = t.zeros  # uninitialised memory: zeros (randomized before a run anyway)
        if name in ("torch.ones", "torch.zeros", "torch.full", "torch.arange", "torch.empty"):
            n = 1
            for s in args[:1] if name in ("torch.full",) else args:
                for d in (s if isinstance(s, (tuple, list)) else (s,)):
                    if not isinstance(d, int):
                        break
                    n *= max(d, 1)
            if n > MAX_NUMEL:
                raise Unknown(f"creates a tensor of {n} elements (cap {MAX_NUMEL})")
        try:
            return self._check(fn(*args, **kwargs))
        except Unknown:
            raise
        except Exception as e:
            raise Unknown(f"`{name}` fails on the sample ({type(e).__name__})") from None

    def _builtin(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        t = self.torch
        if name == "isinstance":
            v, types = args
            types = types if isinstance(types, tuple) else (types,)
            real = []
            for ty in types:
                if isinstance(ty, Dotted):
                    if ty.name == "torch.Tensor" or ty.name == "torch.nn.Parameter":
                        real.append(t.Tensor)
                    elif ty.name.startswith("builtins.") and ty.name[9:] in ("int", "float", "tuple", "list", "bool"):
                        real.append(__builtins__[ty.name[9:]] if isinstance(__builtins__, dict) else getattr(__builtins__, ty.name[9:]))
                    else:
                        raise Unknown(f"isinstance of `{ty.name}`")
                else:
                    raise Unknown("isinstance of an unknown type")
            if isinstance(v, Opaque):
                raise Unknown(f"isinstance of {v.what}")
            return isinstance(v, tuple(real))
        if name in ("hasattr", "getattr"):
            obj = args[0]
            if not isinstance(obj, (Obj, ConfigStub)) or not isinstance(args[1], str):
                raise Unknown(f"{name} on something other than self or a configuration object")
            attrs = obj.attrs if isinstance(obj, Obj) else obj.values
            if name == "hasattr":
                return args[1] in attrs
            if args[1] in attrs:
                return attrs[args[1]]
            if len(args) > 2:
                return args[2]
            raise Unknown("getattr of an unset attribute")
        if name == "super":
            raise Unknown("super() used as a value")
        args = [self._plain(a) for a in args]
        if name == "range":
            r = range(*args)
            if len(r) > MAX_LOOP:
                raise Unknown("a long range")
            return r
        if name in ("float", "int", "bool") and args and isinstance(args[0], t.Tensor):
            raise Unknown(f"{name}() of a tensor")
        if name in ("enumerate", "zip", "reversed"):
            return _finite_iter(name, args, kwargs)
        fn = {"len": len, "int": int, "float": float, "min": min, "max": max, "tuple": tuple, "list": list,
              "abs": abs, "bool": bool, "pow": pow, "round": round, "sum": sum}[name]
        try:
            return self._check(fn(*args, **kwargs))
        except Unknown:
            raise
        except Exception as e:
            raise Unknown(f"{name}() fails on the sample ({type(e).__name__})") from None


_MISSING = object()


def _module_constant(module: ModuleInfo, name: str) -> Any:
    """A module-level ``NAME = <literal>`` bound exactly once (else _MISSING)."""
    found: list[ast.expr] = []
    for st in module.tree.body:
        if isinstance(st, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in st.targets):
            found.append(st.value)
        elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id == name and st.value is not None:
            found.append(st.value)
    if len(found) != 1:
        return _MISSING
    try:
        return ast.literal_eval(found[0])
    except Exception:
        return _MISSING


def _as_load(node: ast.expr) -> ast.expr:
    return ast.parse(ast.unparse(node), mode="eval").body


def _is_static(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def _undecorated(fn: ast.FunctionDef) -> ast.FunctionDef:
    copy = ast.FunctionDef(name=fn.name, args=fn.args, body=fn.body, decorator_list=[], returns=None, type_comment=None)
    return ast.copy_location(copy, fn)  # type: ignore[return-value]


def _bases(module: ModuleInfo, cls: ast.ClassDef) -> list[ast.ClassDef]:
    """The class and its bases defined in the same file, method-resolution order (single chain)."""
    out = [cls]
    cur = cls
    while len(out) < 8:
        nxt = None
        for b in cur.bases:
            if isinstance(b, ast.Name) and b.id in module.classes and module.classes[b.id] is not cur:
                nxt = module.classes[b.id]
                break
        if nxt is None or nxt in out:
            break
        out.append(nxt)
        cur = nxt
    return out


def _plain_module_base(module: ModuleInfo, cls: ast.ClassDef) -> bool:
    """The chain ends in ``nn.Module`` (torch's: its __init__ sets nothing the probe reads)."""
    last = _bases(module, cls)[-1]
    return any(module.canonical(b) in ("torch.nn.Module", "torch.nn.modules.module.Module") for b in last.bases)


def _methods(module: ModuleInfo, cls: ast.ClassDef) -> Iterable[ast.FunctionDef]:
    for c in _bases(module, cls):
        for n in c.body:
            if isinstance(n, ast.FunctionDef):
                yield n


# --- building self -------------------------------------------------------------------------


def build_self(module: ModuleInfo, cls: ast.ClassDef, overrides: dict[str, Any] | None = None) -> Obj:
    """``self`` after the class's ``__init__`` (or its same-file base's) ran with dimension-like
    arguments (no default) set to ``DIM`` and the others to their defaults. Raises Unknown."""
    if not _plain_module_base(module, cls):
        raise Unknown("the class does not derive from nn.Module in this file")
    obj = Obj(cls)
    init = next((fn for fn in _methods(module, cls) if fn.name == "__init__"), None)
    if init is None:
        return obj
    it = Interpreter(module, in_init=True)
    a = init.args
    params = [*a.posonlyargs, *a.args][1:]
    n_def = len(a.defaults)
    overrides = {k: (DIM // 2 if v is HALF_DIM else v) for k, v in (overrides or {}).items()}
    config_over = {k[len(CONFIG_KEY):]: overrides.pop(k) for k in list(overrides) if k.startswith(CONFIG_KEY)}
    args: list[Any] = []
    for i, p in enumerate(params):
        if i >= len(params) - n_def:
            break
        # an overridden required argument is passed by position too (positional-only ones must be)
        if p.arg in overrides:
            args.append(overrides.pop(p.arg))
            continue
        values = config_values(module, cls, init, p.arg)
        if values is not None:
            values.update({k: v for k, v in config_over.items() if k in values})
        args.append(ConfigStub(p.arg, values) if values is not None else _dim_argument(p))
    kwargs = {p.arg: _dim_argument(p) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None}
    kwargs.update(overrides)
    it.call_function(init, args, kwargs, obj)
    return obj


def config_values(module: ModuleInfo, cls: ast.ClassDef, init: ast.FunctionDef, arg: str) -> dict[str, Any] | None:
    """The attribute values of a constructor argument used as a configuration object (``config.n_embd``
    in ``__init__``, or ``self.config = config`` and ``self.config.x`` in any method), or None when
    ``__init__`` uses the argument any other way (arithmetic, indexing, a call: then it is a dimension).

    A value is chosen from the attribute's uses, so that the configuration the probe builds is the
    plain one: compared with None -> None (the "not configured" branch); tested for truth (``if``,
    ``and``/``or``, ``not``, a conditional expression) -> False (the exploration of boolean flags does
    not reach these: their tests become run-time guards like any other); an epsilon (the attribute name
    says so) -> 1e-5, so that the probe's eps estimate is well conditioned; otherwise a dimension (DIM).
    What the probe then proves still rests on the numbers, not on these choices."""
    held: set[str] = set()  # self attributes holding the argument
    direct = 0
    for node in fast_walk(init):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id == arg:
            for tg in node.targets:
                if isinstance(tg, ast.Attribute) and isinstance(tg.value, ast.Name) and tg.value.id == "self":
                    held.add(tg.attr)
    parents: dict[ast.AST, ast.AST] = {}
    reads: list[ast.expr] = []  # `arg.attr` / `self.held.attr` nodes, or getattr(arg, "attr", ...) calls
    fns = [init] + ([fn for fn in _methods(module, cls) if fn is not init] if held else [])
    for fn in fns:
        for node in fast_walk(fn):
            for child in child_nodes(node):
                parents[child] = node
    for fn in fns:
        for node in fast_walk(fn):
            if not (isinstance(node, ast.Name) and node.id == arg and isinstance(node.ctx, ast.Load)) or fn is not init:
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                        and isinstance(node.value.value, ast.Name) and node.value.value.id == "self" \
                        and node.value.attr in held and isinstance(node.ctx, ast.Load):
                    reads.append(node)
                continue
            direct += 1
            up = parents.get(node)
            if isinstance(up, ast.Attribute) and up.value is node:
                reads.append(up)
            elif isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id in ("getattr", "hasattr") \
                    and up.args and up.args[0] is node and len(up.args) >= 2 and isinstance(up.args[1], ast.Constant) \
                    and isinstance(up.args[1].value, str):
                reads.append(up)
            elif isinstance(up, ast.Assign) and up.value is node:
                continue  # `self.config = config`
            else:
                return None
    if not reads or (direct == 0 and not held):
        return None
    values: dict[str, Any] = {}
    rank = {"dim": 0, "false": 1, "none": 2, "eps": 3}  # an epsilon is a number even where checked for None
    kinds: dict[str, str] = {}
    for r in reads:
        name = r.args[1].value if isinstance(r, ast.Call) else r.attr  # type: ignore[union-attr]
        up = parents.get(r)
        if re.search(r"(^|_)(eps|epsilon)($|_)|eps$", name.lower()):
            kind = "eps"
        elif isinstance(up, ast.Compare) and any(isinstance(c, ast.Constant) and c.value is None for c in [up.left, *up.comparators]):
            kind = "none"
        elif (isinstance(up, (ast.If, ast.IfExp, ast.While, ast.Assert)) and up.test is r) or isinstance(up, ast.BoolOp) \
                or (isinstance(up, ast.UnaryOp) and isinstance(up.op, ast.Not)):
            kind = "false"
        else:
            kind = "dim"
        if rank[kind] > rank[kinds.get(name, "dim")] or name not in kinds:
            kinds[name] = kind
    for name, kind in kinds.items():
        values[name] = {"none": None, "false": False, "eps": 1e-5, "dim": DIM}[kind]
    return values


#: the prefix of an override key that sets one configuration attribute (``CONFIG_KEY + "bias"``)
CONFIG_KEY = "\0config."


def config_flips(module: ModuleInfo, cls: ast.ClassDef | None) -> list[tuple[str, str, Any]]:
    """The configuration attributes :func:`config_values` set to None or False, each with the value
    of its other case (a size for None, True for False): ``(argument, attribute, value)``. The
    configuration object is the user's, not a default the class declares, so a proof must hold in
    both cases (or the difference must be checked at run time)."""
    if cls is None:
        return []
    init = next((fn for fn in _methods(module, cls) if fn.name == "__init__"), None)
    if init is None:
        return []
    out = []
    for p in required_init_args(init):
        for attr, v in (config_values(module, cls, init, p.arg) or {}).items():
            if v is None:
                out.append((p.arg, attr, HALF_DIM))
            elif v is False:
                out.append((p.arg, attr, True))
    return out


#: an override value: half the probe's dimension (a second dimension-like argument set apart from DIM)
HALF_DIM = object()


def other_dim_arguments(cls: ast.ClassDef | None, module: ModuleInfo) -> list[str]:
    """Required int (or unannotated) constructor arguments after the first: the probe gives them
    DIM like the first, which proves only the configuration where they equal the dimension (a
    grouped norm with ``group_size == d`` is a whole RMSNorm)."""
    if cls is None:
        return []
    init = next((fn for fn in _methods(module, cls) if fn.name == "__init__"), None)
    if init is None:
        return []
    dims = [p.arg for p in required_init_args(init) if _annotation(p) in ("", *_DIM_ANNOTATIONS)]
    return dims[1:]


def required_init_args(init: ast.FunctionDef) -> list[ast.arg]:
    """``__init__``'s arguments without a default, ``self`` left out (positional, then keyword-only)."""
    a = init.args
    params = [*a.posonlyargs, *a.args][1:]
    return params[: len(params) - len(a.defaults)] + [p for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]


#: annotations of a constructor argument the probe fills with a dimension (besides none at all)
_DIM_ANNOTATIONS = ("int", "Optional[int]", "int | None")


def _annotation(p: ast.arg) -> str:
    return ast.unparse(p.annotation) if p.annotation is not None else ""


def _dim_argument(p: ast.arg) -> int:
    """A constructor argument without default: a dimension (int, or not annotated) gets DIM."""
    ann = _annotation(p)
    if ann == "bool":
        return False  # a flag without default: False first, flipped by the exploration
    if ann and ann not in _DIM_ANNOTATIONS:
        raise Unknown(f"constructor argument `{p.arg}: {ann}` has no default")
    return DIM


def bool_arguments(module: ModuleInfo, cls: ast.ClassDef) -> dict[str, bool]:
    """Constructor arguments whose default is True/False (flags the probe may flip)."""
    init = next((fn for fn in _methods(module, cls) if fn.name == "__init__"), None)
    if init is None:
        return {}
    a = init.args
    params = [*a.posonlyargs, *a.args]
    pairs = list(zip(params[len(params) - len(a.defaults):], a.defaults)) + [(p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
    flags = {p.arg: d.value for p, d in pairs if isinstance(d, ast.Constant) and isinstance(d.value, bool)}
    n_req = len(params) - len(a.defaults)
    for p in [*params[1:n_req], *(p for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None)]:
        if p.annotation is not None and ast.unparse(p.annotation) == "bool":
            flags[p.arg] = False
    return flags


def randomize(obj: Obj, gen: Any, dtype: Any = None) -> Obj:
    """A copy of ``obj`` whose float tensors (parameters, buffers) hold random values in
    [0.5, 1.5] (ones and zeros would hide which one is the weight), optionally cast to ``dtype``."""
    t = torch_module()
    out = Obj(obj.cls, {})
    for k, v in obj.attrs.items():
        if isinstance(v, t.Tensor) and v.is_floating_point():
            r = t.rand(v.shape, generator=gen, dtype=t.float64) + 0.5
            v = r.to(dtype or v.dtype)
        elif isinstance(v, t.nn.Module):
            import copy

            v = copy.deepcopy(v)
            if dtype is not None:
                v = v.to(dtype)
        out.attrs[k] = v
    return out


# --- rms_norm: the reference check -----------------------------------------------------------


@dataclass
class RmsProof:
    """What :func:`prove_rms_norm` found. ``kind``: "proved" (the other fields say how to call
    npu_rms_norm), "mismatch" (it ran and computes a normalisation that is not RMSNorm;
    ``reason`` says how it differs), "other" (it ran and is not a normalisation at all),
    "conditional" (proved only for one value of a configuration object's attribute; ``reason``),
    "unknown" (the probe could not evaluate it; ``reason`` says why) or "deferred" (a pool
    worker left it to the parent process: engine.defer_import)."""

    kind: str
    reason: str = ""
    x: str = ""
    weight: str | None = None  # expression of the scope, None: no weight
    weight_offset: int = 0  # 1: the code multiplies by (1 + weight)
    eps: str = ""  # expression of the scope (or a literal)
    eps_value: float = 0.0
    dtype_rule: str = ""  # "input" | "promote" | "weight" | "float32"
    guards: list[str] = field(default_factory=list)  # run-time tests the proof assumed
    sampled: list[str] = field(default_factory=list)  # input-dependent branches only sampled
    entered: list[ast.FunctionDef] = field(default_factory=list)
    scalar_reads: dict[str, Any] = field(default_factory=dict)  # self.<attr> -> value the function read
    # s36: where the original puts eps. "inside" (under the root, as npu_rms_norm); "outside"
    # (x / (rms + c)) or "clamp" (x / max(rms, c), an L2 norm clamped at c * sqrt(d) alike): then
    # ``eps`` is the eps' passed to the op (both limits agree), ``eps_base`` the scope's c,
    # ``eps_floor`` c in rms units and ``eps_bound`` the relative difference on rows of rms 1
    max_rank: int = 8  # s36: 3 where a 4-D sample raised or disagreed (proved on ranks 2 and 3 only)
    eps_form: str = "inside"
    eps_base: str = ""
    eps_floor: float = 0.0
    eps_bound: float = 0.0
    # s42: what a "clamp" form floors: "norm" (max(rms, c), eps' = c ** 2) or "mean square" (max(mean(x^2), E):
    # the rms floored at sqrt(E), eps' = E itself)
    eps_clamps: str = "norm"


# s36: the largest relative difference an eps placement may make on ordinary rows (rms 1): a tenth
# of the op check's tolerance for the dtype (fp32 1e-5; fp16 2^-10, bf16 2^-7: 1e-4 for both), so
# rows of rms 0.1 stay within it. Between the two the fused branch runs for half inputs only.
_EPS_FORM_BOUND = 1e-6
_EPS_FORM_BOUND_HALF = 1e-4


def eps_prime_limit(outside: bool, half_only: bool) -> float:
    """The largest eps' (the op's eps, in mean-square units: c ** 2 with c the original's eps in rms units) whose
    placement difference on rows of rms 1 stays within the bound the fused branch was accepted under (fp32's, or
    fp16 / bf16's where ``half_only``). s46 review: the probe measures eps at the class's default; an instance built
    with a larger eps (``RMSNorm(d, eps=0.5)``) differs by more, so the fused branch tests the instance's eps' against
    this at run time. The bound grows with c: bisection."""
    limit = _EPS_FORM_BOUND_HALF if half_only else _EPS_FORM_BOUND

    def bound(c: float) -> float:
        return (1 + c) / math.sqrt(1 + c * c) - 1 if outside else 1 - 1 / math.sqrt(1 + c * c)

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if bound(mid) <= limit else (lo, mid)
    v = lo * lo
    exp = math.floor(math.log10(v))
    return float(f"{math.floor(v / 10 ** exp * 100) / 100}e{exp}")  # three digits, rounded down: never above the bound


@dataclass
class _Run:
    x: Any
    out: Any
    scalars: dict[str, Any]  # expression -> value (self attrs, params)
    tensors: dict[str, Any]  # expression -> 1-D float tensor
    decisions: list[Decision]
    entered: list[ast.FunctionDef]
    scalar_reads: dict[str, Any] = field(default_factory=dict)


_SCALES = (1.0, 10.0, 1e-3, 1e-6, 1e-13)


def _free_names(node: ast.AST) -> set[str]:
    return {n.id for n in fast_walk(node) if isinstance(n, ast.Name)}


def _assigned_names(fn: ast.FunctionDef) -> set[str]:
    out: set[str] = set()
    for n in fast_walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
    return out


def prove_rms_norm(module: ModuleInfo, fn: ast.FunctionDef, cls: ast.ClassDef | None) -> RmsProof:
    """Evaluate ``fn`` on sampled inputs and decide whether it returns
    ``x * rsqrt(mean(x**2, -1) + eps) * w`` (w: a 1-D weight of the scope, ``1 + w``, or none)."""
    reason = static_gate(module, fn, cls)
    if reason is None and cls is not None:
        # self is built by interpreting __init__ (and same-file bases'): the same allowlist holds there
        for c in _bases(module, cls):
            init = next((n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            if init is not None:
                reason = static_gate(module, init, c)
                if reason is not None:
                    reason = f"__init__: {reason}"
                    break
    if reason is None:
        reason = structural_gate(module, fn, cls)
    if reason is not None:
        return RmsProof("unknown", reason)
    if _deferred(module):
        return RmsProof("deferred", "left to the parent process, which imports torch once for the scan")
    try:
        # the repository's code runs on sampled tensors here: torch's deprecation warnings about
        # it (`x.T` on 3-D tensors...) are the repository's business, not lines in the scan's output
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _explore(module, fn, cls)
    except Unknown as e:
        return RmsProof("unknown", e.reason)
    except RecursionError:
        return RmsProof("unknown", "recursion")
    except Exception as e:  # torch raising on a sampled value the interpreter did not anticipate
        return RmsProof("unknown", f"evaluation raised {type(e).__name__}")


def _explore(module: ModuleInfo, fn: ast.FunctionDef, cls: ast.ClassDef | None) -> RmsProof:
    """:func:`_explore_configs`, and a proof must hold with the constructor's other dimension-like
    arguments set apart from the dimension too (the probe gives them all DIM)."""
    result = _explore_configs(module, fn, cls)
    if result.kind == "proved":
        for arg, attr, value in config_flips(module, cls)[:4]:
            try:
                alt = _proved_on_two_dims(module, fn, cls, {CONFIG_KEY + attr: value})
            except Unknown as e:
                alt = RmsProof("unknown", e.reason)
            same = alt.kind == "proved" and (alt.weight, alt.weight_offset, alt.eps, alt.dtype_rule) == \
                (result.weight, result.weight_offset, result.eps, result.dtype_rule)
            if not same:
                was, other = ("None", "set to a size") if value is HALF_DIM else ("false", "true")
                then = (f"the probe cannot evaluate it ({alt.reason})" if alt.kind == "unknown"
                        else "the probe does not find that RMSNorm" if alt.kind in ("mismatch", "other")
                        else "it is an RMSNorm with another weight, eps or dtype rule")
                return RmsProof("conditional", f"proved only where `{arg}.{attr}` is {was}, a configuration value the "
                                               f"scan cannot see (with it {other}, {then})")
        for name in other_dim_arguments(cls, module)[:3]:
            try:
                alt = _proved_on_two_dims(module, fn, cls, {name: HALF_DIM})
            except Unknown as e:
                alt = RmsProof("unknown", e.reason)
            if alt.kind != "proved":
                return RmsProof("unknown", f"proved only where constructor argument `{name}` equals the normalised dimension "
                                           f"(with it set to half the dimension: {alt.reason or alt.kind})")
    return result


def _explore_configs(module: ModuleInfo, fn: ast.FunctionDef, cls: ast.ClassDef | None) -> RmsProof:
    """The constructor's defaults first, then each boolean flag flipped (up to 4): the first
    configuration proved wins (the forward's tests on those flags become run-time guards);
    otherwise the defaults' outcome is reported."""
    configs: list[dict[str, Any]] = [{}]
    if cls is not None:
        flags = bool_arguments(module, cls)
        configs += [{k: not v} for k, v in list(flags.items())[:4]]
    first: RmsProof | None = None
    weightless: RmsProof | None = None
    for overrides in configs:
        try:
            proof = _proved_on_two_dims(module, fn, cls, overrides)
        except Unknown as e:
            proof = RmsProof("unknown", e.reason)
        if proof.kind == "proved":
            if proof.weight is not None:
                return proof
            if not overrides:
                # weightless by default: kept unless a configuration with a weight is proved.
                # (A flipped flag that removes the weight proves a path that rarely runs: not used.)
                weightless = weightless or proof
        first = first or proof
        if first.kind != "mismatch":
            break  # flags are flipped only for a normalisation that differs (a bias, an optional weight): cost
    assert first is not None
    return weightless or first


#: the two feature widths a class-based proof runs with (a scalar read that follows them is that width)
_PROOF_DIMS = (16, 24)


def _proved_on_two_dims(module: ModuleInfo, fn: ast.FunctionDef, cls: ast.ClassDef | None, overrides: dict[str, Any]) -> RmsProof:
    """Proved with dimension arguments 16 and 24 alike (a scalar derived from the dimension is
    then covered); scalar attributes of self read by the function with the same value in both
    (a constructor default such as ``scale=1.0``) become run-time guards, eps excepted."""
    global DIM
    proofs: list[RmsProof] = []
    for d in _PROOF_DIMS:
        DIM = d
        try:
            proofs.append(_prove_rms_norm(module, fn, cls, overrides))
        finally:
            DIM = 16
        if proofs[-1].kind != "proved":
            return proofs[-1]
    a, b = proofs
    if (a.weight, a.weight_offset, a.eps, a.dtype_rule) != (b.weight, b.weight_offset, b.eps, b.dtype_rule):
        return RmsProof("unknown", "the proof depends on the dimension")
    a.max_rank = min(a.max_rank, b.max_rank)
    guards = a.guards + [g for g in b.guards if g not in a.guards]
    for attr, v in sorted(a.scalar_reads.items()):
        if b.scalar_reads.get(attr) == v and f"self.{attr}" not in (a.eps, a.eps_base) and math.isfinite(v):
            guards.append(f"self.{attr} == {v!r}")
        elif (v, b.scalar_reads.get(attr)) == _PROOF_DIMS and f"self.{attr}" not in (a.eps, a.eps_base):
            # audit40b: a width the constructor was given, set to the feature size by the proof (QuaRot's
            # ``x.pow(2).sum(-1) / self.mean_dim``): the fused call equals it only where it is x's last dim
            guards.append(f"self.{attr} == {a.x}.shape[-1]")
    a.guards = guards
    return a


def _prove_rms_norm(module: ModuleInfo, fn: ast.FunctionDef, cls: ast.ClassDef | None, overrides: dict[str, Any] | None = None) -> RmsProof:
    t = torch_module()
    a = fn.args
    params = [p.arg for p in (*a.posonlyargs, *a.args)]
    is_method = cls is not None and not _is_static(fn)
    if is_method:
        if not params or params[0] != "self":
            raise Unknown("a method without self")
        params = params[1:]
    if not params:
        raise Unknown("no input argument")
    x_name = params[0]
    n_required = len(params) - len(a.defaults)
    extra = params[1:n_required]  # arguments without default besides x
    if is_method and extra:
        raise Unknown(f"argument `{extra[0]}` has no default")
    if any(d is None for d in a.kw_defaults):
        raise Unknown("a keyword-only argument has no default")
    base = build_self(module, cls, overrides) if is_method else None
    if cls is not None and not is_method:
        raise Unknown("a static method")
    assigned = _assigned_names(fn)

    def run(xv: Any, wdtype: Any, seed: int) -> _Run:
        gen = t.Generator().manual_seed(1234 + seed)
        obj = randomize(base, gen, wdtype) if base is not None else None
        # s42 (nano-vllm's ``x = x.float(); x.mul_(torch.rsqrt(var + self.eps))``): the function gets a copy, so an
        # in-place op on its input (``.float()`` of a float32 tensor is that tensor) leaves the sample the reference reads
        args: list[Any] = [xv.clone()]
        tensors: dict[str, Any] = {}
        for name in extra:  # a module-level function's weight-like tensor arguments
            w = (t.rand(DIM, generator=gen, dtype=t.float64) + 0.5).to(wdtype or t.float32)
            args.append(w)
            if name not in assigned:
                tensors[name] = w
        it = Interpreter(module)
        out = it.call_function(fn, args, {}, obj)
        scalars: dict[str, Any] = {}
        if obj is not None:
            for k, v in obj.attrs.items():
                if isinstance(v, t.Tensor) and v.dim() == 1 and v.is_floating_point() and v.numel() == DIM:
                    tensors[f"self.{k}"] = v
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    scalars[f"self.{k}"] = v
                elif isinstance(v, ConfigStub):  # ``self.config.norm_eps``: an eps the forward reads there
                    scalars.update({f"self.{k}.{a}": c for a, c in v.values.items()
                                    if isinstance(c, (int, float)) and not isinstance(c, bool)})
        return _Run(xv, out, scalars, tensors, it.decisions, it.entered, it.scalar_reads)

    gen0 = t.Generator().manual_seed(0)
    base3 = t.randn(2, 3, DIM, generator=gen0, dtype=t.float64)
    base2 = t.randn(5, DIM, generator=gen0, dtype=t.float64)
    fp32_runs = [run((base3 * s).float(), None, 0) for s in _SCALES]
    fp32_runs.append(run(base2.float(), None, 1))
    first = fp32_runs[0]
    if not isinstance(first.out, t.Tensor) or first.out.shape != first.x.shape or not first.out.is_floating_point():
        return RmsProof("other", "the output is not a float tensor shaped like the input")
    for r in fp32_runs:
        if not isinstance(r.out, t.Tensor) or r.out.shape != r.x.shape:
            return RmsProof("other", "the output is not shaped like the input on every sample")
    o1, o10 = first.out.double(), fp32_runs[1].out.double()
    normalizes = bool(((o1 - o10).abs() <= 1e-3 * o1.abs().amax() + 1e-3 * o1.abs()).all())
    # weight: the candidate g for which out / (x * g) is one number per row
    cands: list[tuple[str | None, int]] = [(None, 0)]
    for k in first.tensors:
        cands += [(k, 0), (k, 1)]

    def gain(r: _Run, k: str | None, off: int) -> Any:
        if k is None:
            return t.ones(DIM, dtype=t.float64)
        return r.tensors[k].double() + off

    chosen = None
    for k, off in cands:
        ratio = first.out.double() / (first.x.double() * gain(first, k, off))
        spread = (ratio.amax(-1) - ratio.amin(-1)) / ratio.abs().amax(-1)
        if bool((spread < 1e-4).all()):
            chosen = (k, off)
            break
    if chosen is None:
        if not normalizes:
            return RmsProof("other", "not a normalisation (the output is not scale-invariant)")
        return RmsProof("mismatch", _why_not_rms(first, cands, gain))
    k, off = chosen
    # eps from the smallest sample, where eps dominates mean(x^2)
    tiny = fp32_runs[len(_SCALES) - 1]
    xt = tiny.x.double()
    r = (tiny.out.double() / (xt * gain(tiny, k, off))).mean(-1)
    ms = xt.pow(2).mean(-1)
    eps_rows = 1.0 / r.pow(2) - ms
    eps_hat = float(eps_rows.median())
    eps_expr, eps_value = _match_eps(module, fn, first, eps_hat, params, assigned, a)
    form = _EpsForm()
    if eps_expr is None or any(_rel_err(rr, k, off, gain, eps_value) > 1e-4 for rr in fp32_runs):
        # s36: eps outside the root or a clamp on the norm: a candidate with eps' chosen so that
        # both limits agree, where the difference on ordinary rows stays below the tolerance. Read
        # before the scale-invariance verdict: a large eps outside the root (1e-2) breaks that
        # invariance at scale 1 too, and is an RMS norm with a measurable difference, not "no norm"
        form = _eps_form(module, fn, fp32_runs, k, off, gain, params, assigned, a, x_name)
        if not normalizes and form.kind not in ("outside", "clamp") and not form.reason:
            return RmsProof("other", "not a normalisation")  # no eps form fits either
        if form.kind == "mismatch":
            return RmsProof("mismatch", form.reason or _why_eps(fp32_runs, k, off, gain, eps_hat))
        eps_expr, eps_value = form.expr, form.floor ** 2
        if any(_rel_err(rr, k, off, gain, eps_value, form) > 1e-4 for rr in fp32_runs):
            return RmsProof("mismatch", _why_eps(fp32_runs, k, off, gain, eps_hat))
    # dtype rule and half-precision agreement
    pairs = [(t.bfloat16, t.float32), (t.bfloat16, t.bfloat16), (t.float32, t.bfloat16), (t.float16, t.float32),
             (t.float16, t.float16)]
    observed: list[tuple[Any, Any, Any]] = []
    half_runs: list[_Run] = []
    for xd, wd in pairs:
        hr = run(base3.to(xd), wd, 0)
        if not isinstance(hr.out, t.Tensor) or hr.out.shape != hr.x.shape:
            raise Unknown("the output is not shaped like the input in half precision")
        err = _rel_err(hr, k, off, gain, eps_value, form)
        if err > 3e-2:
            return RmsProof("mismatch", f"agrees with RMSNorm in float32 but not with {xd} input and {wd} weights "
                            f"(relative error {err:.2g})")
        observed.append((xd, wd, hr.out.dtype))
        half_runs.append(hr)
    # s27: at scale 1 eps is invisible (mean(x^2) ~ 1), so an eps that depends on the input's dtype
    # (``finfo(x.dtype).eps``, a larger eps for half inputs) would pass the runs above: one bf16 run
    # where mean(x^2) ~ eps (bf16 keeps fp32's exponent range; fp16 would underflow there)
    if eps_value > 0:
        hr = run((base3 * math.sqrt(eps_value)).to(t.bfloat16), t.float32, 0)
        if not isinstance(hr.out, t.Tensor) or hr.out.shape != hr.x.shape:
            raise Unknown("the output is not shaped like the input in half precision")
        err = _rel_err(hr, k, off, gain, eps_value, form)
        if err > 3e-2:
            return RmsProof("mismatch", f"agrees with RMSNorm (eps {eps_value:.3g}) in float32 but not with small bfloat16 inputs "
                            f"(relative error {err:.2g}): eps or the computation depends on the input's dtype")
        half_runs.append(hr)
    # s36: the samples are 2-D and 3-D while the fused branch would take ranks up to 8: a 4-D sample
    # (a function moving axes, ``movedim(1, -1)``, normalises another dim there) either agrees or
    # caps the guard at rank 3
    max_rank = 8
    try:
        r4 = run(t.randn(2, 3, 2, DIM, generator=t.Generator().manual_seed(4), dtype=t.float64).float(), None, 0)
        if not isinstance(r4.out, t.Tensor) or r4.out.shape != r4.x.shape or _rel_err(r4, k, off, gain, eps_value, form) > 1e-4:
            max_rank = 3
    except Exception:  # Unknown, or torch raising on the rank (``B, L, D = x.shape``)
        max_rank = 3
    rule = _dtype_rule(observed, weighted=k is not None)
    if rule is None:
        raise Unknown("no simple output-dtype rule fits "
                      + ", ".join(f"{_dn(x)}x{_dn(w)}->{_dn(o)}" for x, w, o in observed))
    # run-time guards: tests on self/module names/unassigned non-input arguments
    guards: list[str] = []
    sampled: list[str] = []
    guardable = {"self"} | {p for p in params[1:] if p not in assigned}
    for rr in [*fp32_runs, *half_runs]:
        for d in rr.decisions:
            names = _free_names(d.test)
            src = ast.unparse(d.test)
            text = f"({src})" if d.value else f"not ({src})"
            if not d.foreign and names and names <= guardable | (set(module.aliases) | set(module.functions)) - assigned - {x_name} \
                    and _only_self_reads(d.test):
                if text not in guards:
                    if (f"not ({src})" if d.value else f"({src})") in guards:
                        raise Unknown(f"the test `{src}` went both ways on the samples")
                    guards.append(text)
            elif src not in sampled:
                sampled.append(src)
    entered = list({id(f): f for rr in fp32_runs for f in rr.entered}.values())
    reads: dict[str, Any] = {}
    for rr in [*fp32_runs, *half_runs]:
        reads.update(rr.scalar_reads)
    return RmsProof("proved", "", x_name, k, off, eps_expr, eps_value, rule, guards, sampled, entered, reads, max_rank,
                    form.kind if form.kind != "none" else "inside", form.base, form.floor, form.bound, eps_clamps=form.clamps)


@dataclass
class _EpsForm:
    kind: str = "none"  # "none" (eps inside the root) | "outside" | "clamp" | "mismatch"
    expr: str = ""  # eps' for npu_rms_norm, an expression of the scope
    base: str = ""  # the scope's eps as written
    floor: float = 0.0  # the original's eps in rms units: 1 / s as rms -> 0
    bound: float = 0.0  # relative difference of the fused op on rows of rms 1
    reason: str = ""
    clamps: str = "norm"  # s42: a "clamp" kind's floor is on the norm, or on the mean square


def _eps_form(module: ModuleInfo, fn: ast.FunctionDef, runs: list[_Run], k: str | None, off: int, gain: Callable[..., Any],
              params: list[str], assigned: set[str], a: ast.arguments, x_name: str) -> _EpsForm:
    """The per-row scale s = out / (x * w) of every sample against the two other eps placements
    (the decision is the values', not the spelling's): 1 / s = rms + c (eps added outside the root)
    or 1 / s = max(rms, c) (the norm clamped from below; an L2 norm clamped at e with a sqrt(d)
    gain is the rms clamped at e / sqrt(d)). npu_rms_norm's 1 / s is sqrt(rms^2 + eps'); eps' = c^2
    makes the two agree as rms -> 0 (both x / c) and as rms >> c. c is then matched to a value of
    the scope, directly (eps' = E ** 2) or as E / sqrt(d) (eps' = E ** 2 / d)."""
    t = torch_module()
    inv, rms = [], []
    for r in runs:
        x = r.x.double()
        s = (r.out.double() / (x * gain(r, k, off))).mean(-1)
        inv.append((1.0 / s).flatten())
        rms.append(x.pow(2).mean(-1).sqrt().flatten())
    iv, rm = t.cat(inv), t.cat(rms)
    if not bool(t.isfinite(iv).all()):
        return _EpsForm("mismatch")
    slack = 2e-5 * rm + 1e-300
    c_out = iv - rm
    kind, floor = "mismatch", 0.0
    # c from the smallest rows, where it dominates (elsewhere fp32 rounding of the output does)
    small = rm <= rm.min() * 100
    c0 = float(c_out[small].median())
    if c0 > 0 and bool(((c_out - c0).abs() <= 1e-3 * c0 + slack).all()):
        kind, floor = "outside", c0
    else:
        clamped = iv > rm * (1 + 1e-3)
        if bool(clamped.any()):
            c1 = float(iv[clamped].median())
            if c1 > 0 and bool(((iv - t.clamp(rm, min=c1)).abs() <= 1e-3 * c1 + slack).all()):
                kind, floor = "clamp", c1
    if kind == "mismatch":
        return _EpsForm("mismatch")
    d = runs[0].x.shape[-1]
    expr, _ = _match_eps(module, fn, runs[0], floor, params, assigned, a)
    eps_prime = f"({expr}) ** 2" if expr is not None else None
    if expr is None:
        expr, _ = _match_eps(module, fn, runs[0], floor * math.sqrt(d), params, assigned, a)
        eps_prime = f"({expr}) ** 2 / {x_name}.shape[-1]" if expr is not None else None
    clamps = "norm"
    if expr is None and kind == "clamp":
        # s42: the mean square clamped from below (``x * rsqrt(ms.clamp(min=eps))``, ``x / sqrt(clamp(ms, min=eps))``):
        # the rms floored at sqrt(eps), so eps' = eps itself makes both limits agree
        expr, _ = _match_eps(module, fn, runs[0], floor * floor, params, assigned, a)
        eps_prime, clamps = expr, "mean square"
    if expr is None or eps_prime is None:
        return _EpsForm("mismatch")
    if kind == "outside":
        bound = (1 + floor) / math.sqrt(1 + floor * floor) - 1
        where = f"eps ({floor:.3g}) is added outside the square root (x / (rms + eps))"
    elif clamps == "mean square":
        bound = 1 - 1 / math.sqrt(1 + floor * floor) if floor < 1 else 1.0
        where = f"the mean square is clamped from below at {floor * floor:.3g} (x * rsqrt(max(mean(x^2), eps)))"
    else:
        bound = 1 - 1 / math.sqrt(1 + floor * floor) if floor < 1 else 1.0
        where = f"the norm is clamped from below at rms {floor:.3g} (x / max(rms, eps), F.normalize-like)"
    if bound > _EPS_FORM_BOUND_HALF:
        return _EpsForm("mismatch", reason=f"{where}: npu_rms_norm with eps' = {eps_prime} would differ by {bound:.2g} "
                                           f"(relative) on rows of rms 1, above the tolerance of every dtype (a tenth of "
                                           f"the op check's: fp32 {_EPS_FORM_BOUND:g}, fp16/bf16 {_EPS_FORM_BOUND_HALF:g}): kept")
    return _EpsForm(kind, eps_prime, expr, floor, bound, clamps=clamps)


def _only_self_reads(test: ast.expr) -> bool:
    """The test reads attributes of self and names only (no call of a helper that may look at
    state the guard cannot see, no subscript of a tensor)."""
    for n in fast_walk(test):
        if isinstance(n, ast.Call):
            return False
    return True


def _dn(d: Any) -> str:
    return str(d).replace("torch.", "")


def _dtype_rule(observed: list[tuple[Any, Any, Any]], weighted: bool) -> str | None:
    t = torch_module()
    rules: dict[str, Callable[[Any, Any], Any]] = {
        "input": lambda x, w: x,
        "promote": lambda x, w: t.promote_types(x, w),
        "weight": lambda x, w: w,
        "float32": lambda x, w: t.float32,
    }
    for name, f in rules.items():
        if not weighted and name in ("promote", "weight"):
            continue
        if all(f(x, w) == o for x, w, o in observed):
            return name
    return None


def _rel_err(r: _Run, k: str | None, off: int, gain: Callable[..., Any], eps: float, form: Any = None) -> float:
    """Relative error of the run's output against x * rsqrt(mean(x^2) + eps) * w, or against the
    original's own eps placement (``form``: an :class:`_EpsForm` of kind outside / clamp)."""
    t = torch_module()
    x = r.x.double()
    ms = x.pow(2).mean(-1, keepdim=True)
    kind = getattr(form, "kind", "none")
    if kind == "outside":
        ref = x / (ms.sqrt() + form.floor) * gain(r, k, off)
    elif kind == "clamp":
        ref = x / t.clamp(ms.sqrt(), min=form.floor) * gain(r, k, off)
    else:
        ref = x * t.rsqrt(ms + eps) * gain(r, k, off)
    d = (r.out.double() - ref).abs()
    scale = ref.abs().amax(-1, keepdim=True)
    return float((d / (scale + 1e-300)).max())


def _match_eps(module: ModuleInfo, fn: ast.FunctionDef, run: _Run, eps_hat: float, params: list[str],
               assigned: set[str], a: ast.arguments) -> tuple[str | None, float]:
    """The expression of the scope whose value is the solved eps: an attribute of self, an
    argument's default, a module constant, a literal in the function."""
    cands: list[tuple[str, float]] = list(run.scalars.items())
    defaults = dict(zip(params[len(params) - len(a.defaults):], a.defaults))
    for p, d in defaults.items():
        if p not in assigned and isinstance(d, ast.Constant) and isinstance(d.value, (int, float)) and not isinstance(d.value, bool):
            cands.append((p, float(d.value)))
    seen_fns = [fn, *run.entered]
    for f in seen_fns:
        for n in fast_walk(f):
            if isinstance(n, ast.Constant) and isinstance(n.value, float):
                cands.append((repr(n.value), n.value))
    for st in module.tree.body:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            v = _module_constant(module, st.targets[0].id)
            if isinstance(v, float):
                cands.append((st.targets[0].id, v))
    if abs(eps_hat) < 1e-30:
        for expr, v in cands:
            if v == 0:
                return expr, 0.0
        return "0.0", 0.0
    for expr, v in cands:
        if v > 0 and abs(v - eps_hat) <= 2e-3 * v:
            return expr, float(v)
    return None, eps_hat


def _why_eps(runs: list[_Run], k: str | None, off: int, gain: Callable[..., Any], eps_hat: float) -> str:
    """The output is x scaled per row, but not by rsqrt(mean(x^2) + eps) for one eps: say how."""
    t = torch_module()
    outside: list[float] = []
    slack: list[float] = []  # float32 rounding of 1/s - rms, relative to rms
    clamp_ok = True
    for r in runs:
        x = r.x.double()
        s = (r.out.double() / (x * gain(r, k, off))).mean(-1)
        rms = x.pow(2).mean(-1).sqrt()
        outside.extend((1.0 / s - rms).flatten().tolist())
        slack.extend((1e-5 * rms).flatten().tolist())
        norm = x.pow(2).sum(-1).sqrt()
        big = norm > 1e-6
        if bool(big.any()):
            c = (s * norm)[big]
            clamp_ok = clamp_ok and bool(((c - c.mean()).abs() <= 1e-4 * c.abs().mean()).all())
    o = t.tensor(outside, dtype=t.float64)
    sl = t.tensor(slack, dtype=t.float64)
    if o.numel() and float(o.abs().max()) > 0 and bool(((o - o.median()).abs() <= 1e-3 * o.median().abs() + sl).all()) \
            and float(o.median()) > 0:
        return f"eps ({float(o.median()):.3g}) is added outside the square root (x / (sqrt(mean(x^2)) + eps)); npu_rms_norm adds it inside"
    if clamp_ok:
        return "the norm is clamped from below (x / max(||x||, eps) times a constant, F.normalize-like) instead of eps added inside the root"
    return (f"x is scaled per row, but not by rsqrt(mean(x^2, -1) + eps) for one eps (solved from the smallest inputs: "
            f"{eps_hat:.3g}; it does not fit the other scales or no value of the scope equals it: e.g. a sum instead of a mean, "
            "an L2 normalisation, an extra constant factor)")


def _why_not_rms(r: _Run, cands: list[tuple[str | None, int]], gain: Callable[..., Any]) -> str:
    """A normalisation that is not x scaled per row: say which kind (checked numerically)."""
    x = r.x.double()
    out = r.out.double()
    for k, off in cands:
        g = gain(r, k, off)
        centred = x - x.mean(-1, keepdim=True)
        ratio = out / (centred * g)
        spread = (ratio.amax(-1) - ratio.amin(-1)) / ratio.abs().amax(-1)
        if bool((spread < 1e-3).all()):
            return "subtracts the mean before normalising (LayerNorm), not RMSNorm"
        if k is not None:
            for b in r.tensors:
                if b == k:
                    continue
                ratio = (out - r.tensors[b].double()) / (x * g)
                spread = (ratio.amax(-1) - ratio.amin(-1)) / ratio.abs().amax(-1)
                if bool((spread < 1e-4).all()):
                    return f"adds `{b}` after the weight (a bias): npu_rms_norm has no bias"
        if x.dim() == 3:
            ratio = out / (x * g)
            spread = (ratio.amax(1) - ratio.amin(1)) / ratio.abs().amax(1)
            if bool((spread < 1e-4).all()):
                return "normalises over another dim than the last (the statistic is not per row of the last dim)"
    return "normalises, but the output is not x * rsqrt(mean(x^2, -1) + eps) * w for any 1-D weight of the scope"


# --- s27 probe: scope gate, structural preconditions, deferral to the parent ------------------
#
# A probe that runs costs a torch import (2-3 s of CPU per process) before anything is known, so
# everything that can turn a scope away is decided from its text and AST first, cheapest first:
# (1) the scope words (the Pattern.SCOPE_WORDS mechanism, engine.scope_holds_words: aliases and
# text outside ASCII as for every pattern), (2) a statistic and a root as code, not in a comment,
# (3) static_gate (calls outside the allowlist), (4) structural_gate (arguments without a value,
# a class the probe cannot build); then, in a pool worker, the file is left to the parent
# (engine.defer_import) which imports torch once for the whole scan.

#: one of these words and one of ROOT_WORDS must be in the scope's text
STAT_WORDS = ("mean", "sum", "norm", "var")
ROOT_WORDS = ("sqrt", "norm", "pow", "**")
_STAT_NAMES = frozenset(("mean", "sum", "norm", "vector_norm", "var", "var_mean", "normalize"))
_ROOT_NAMES = frozenset(("rsqrt", "sqrt", "norm", "vector_norm", "pow", "normalize"))


def _fn_nodes(scope: Any, fn: ast.FunctionDef) -> dict[type, list[ast.AST]]:
    """The nodes of ``ast.walk(fn)`` grouped by type: the scope's shared index where ``fn`` is
    the scope's node (the detectors build it anyway), else one fast walk."""
    if getattr(scope, "node", None) is fn and hasattr(scope, "nodes"):
        return scope.nodes()
    groups: dict[type, list[ast.AST]] = {}
    for n in fast_walk(fn):
        groups.setdefault(type(n), []).append(n)
    return groups


def _called_names(module: ModuleInfo, fn: ast.FunctionDef, scope: Any = None) -> set[str]:
    """Last segments of what ``fn`` names as code (attributes, names resolved through the
    module's import aliases); ``self.norm`` is a submodule, not the statistic."""
    out: set[str] = set()
    groups = _fn_nodes(scope, fn)
    for n in groups.get(ast.Attribute, ()):
        if not (n.attr == "norm" and isinstance(n.value, ast.Name) and n.value.id == "self"):  # type: ignore[attr-defined]
            out.add(n.attr)  # type: ignore[attr-defined]
    for n in groups.get(ast.Name, ()):
        target = module.aliases.get(n.id)  # type: ignore[attr-defined]
        out.add(target.rsplit(".", 1)[-1] if target else n.id)  # type: ignore[attr-defined]
    if any(isinstance(n.op, ast.Pow) for t in (ast.BinOp, ast.AugAssign) for n in groups.get(t, ())):  # type: ignore[attr-defined]
        out.add("**")
    return out


#: ``self.norm`` is a submodule, not the statistic (as in :func:`_called_names`); ``myself.norm`` and
#: ``x.self.norm`` are not that (the by-hand test also sees ``x. self.norm``, beyond a fixed-width lookbehind)
_STAT_OR_ROOT_TOKEN = re.compile(r"(?<![\w])(?:%s|(?<!(?<![\w.])self\.)norm)(?![\w])|\*\*" % "|".join(sorted((_STAT_NAMES | _ROOT_NAMES) - {"norm"})))


_TOKEN_NAMES = tuple(sorted(_STAT_NAMES | _ROOT_NAMES))


def _holds_stat_or_root_token(text: str) -> bool:
    """``_STAT_OR_ROOT_TOKEN.search(text) is not None`` for an ASCII ``text``, checked by hand at each
    occurrence of a name (``str.find``): a regex led by a lookbehind has no literal prefix to search for,
    so ``re`` tried every position of the scope's text. A name counts where the text's maximal run of
    word characters around it is the name itself (what the regex's lookarounds ask), "norm" also
    not right after ``self.``."""
    if "**" in text:
        return True
    find, n = text.find, len(text)
    for name in _TOKEN_NAMES:
        i = find(name)
        while i >= 0:
            end = i + len(name)
            if not (i and _is_word(text[i - 1])) and not (end < n and _is_word(text[end])) \
                    and not (name == "norm" and _self_attribute(text, i)):
                return True
            i = find(name, i + 1)
    return False


def _may_name_stat_or_root(module: ModuleInfo, scope: Any) -> bool:
    """A necessary condition of both ways :func:`probe_worthy` accepts (each needs a name of
    _STAT_NAMES or _ROOT_NAMES, or a ``**``, among :func:`_called_names`), read from the text
    instead of the AST: one of those names as a whole identifier, a ``**``, or an import alias
    whose target ends in one. The word gates let every scope that says ``layernorm`` or
    ``self.norm`` through ("norm" is a statistic word and a root word); this turns most of them
    away before the scope's node index is built. Text outside ASCII is left to the AST test (an
    identifier there may be a decomposed spelling of a name)."""
    from npufuse.scan import engine

    if not engine.SCOPE_GATES:
        return True
    text = engine.gate_text(module, scope)
    if not text.isascii() or _holds_stat_or_root_token(text):
        return True
    wanted = _STAT_NAMES | _ROOT_NAMES
    return any(target.rsplit(".", 1)[-1] in wanted and re.search(rf"(?<![\w]){re.escape(local)}(?![\w])", text)
               for local, target in module.aliases.items())


def probe_worthy(module: ModuleInfo, scope: Any, fn: ast.FunctionDef) -> bool:
    """Gates (1) and (2): the scope's text holds a statistic word and a root word, and its code
    names a statistic (mean, sum, var, a norm) and a root (sqrt, rsqrt, pow, ``**``, a norm)."""
    from npufuse.scan import engine

    if not (engine.scope_holds_words(module, scope, STAT_WORDS) and engine.scope_holds_words(module, scope, ROOT_WORDS)):
        return False
    if not _may_name_stat_or_root(module, scope):
        return False
    names = _called_names(module, fn, scope)
    if names & _STAT_NAMES and names & (_ROOT_NAMES | {"**"}):
        return True
    # the statistic or the root may be computed by a helper of this file or one imported from
    # another file of the repo (the run follows both); the scope's words still name them
    helpers = {n.func.id for n in _fn_nodes(scope, fn).get(ast.Call, ()) if isinstance(n.func, ast.Name)}  # type: ignore[attr-defined]
    return bool(helpers & (set(module.functions) | _relative_imports(module))) and bool(names & (_STAT_NAMES | _ROOT_NAMES | {"**"}))


def _self_attribute(text: str, i: int) -> bool:
    """Is the name at ``text[i]`` written ``self.<name>``, ``self`` a name of its own (not
    ``myself.norm``, ``x.self.norm``, ``x. self.norm``)?"""
    if not text.endswith("self.", 0, i):
        return False
    j = i - 6  # the character before "self."
    if j >= 0 and (text[j].isalnum() or text[j] == "_"):
        return False  # myself.norm
    while j >= 0 and text[j] in " \t\n\r\f\\":
        j -= 1
    return not (j >= 0 and text[j] == ".")  # x.self.norm, x. self.norm


def structural_gate(module: ModuleInfo, fn: ast.FunctionDef, cls: ast.ClassDef | None) -> str | None:
    """Why a run would stop before computing anything, from the AST alone (the checks
    :func:`_prove_rms_norm` and :func:`build_self` make once torch is imported), or None."""
    a = fn.args
    params = [p.arg for p in (*a.posonlyargs, *a.args)]
    is_method = cls is not None and not _is_static(fn)
    if cls is not None and not is_method:
        return "a static method"
    if is_method:
        if not params or params[0] != "self":
            return "a method without self"
        params = params[1:]
    if not params:
        return "no input argument"
    n_required = len(params) - len(a.defaults)
    if is_method and params[1:n_required]:
        return f"argument `{params[1]}` has no default"
    if any(d is None for d in a.kw_defaults):
        return "a keyword-only argument has no default"
    if is_method and cls is not None:
        if not _plain_module_base(module, cls):
            return "the class does not derive from nn.Module in this file"
        init = next((f for f in _methods(module, cls) if f.name == "__init__"), None)
        if init is not None:
            for p in required_init_args(init):
                ann = _annotation(p)
                if ann and ann not in (*_DIM_ANNOTATIONS, "bool"):
                    return f"constructor argument `{p.arg}: {ann}` has no default"
    return None


def _deferred(module: ModuleInfo) -> bool:
    """In a pool worker without torch: leave this file to the parent (engine.defer_import)."""
    from npufuse.scan import engine

    return engine.defer_import(module, "torch")


# --- s27 probe: reach (bail classes of the census) --------------------------------------------


def _code_nodes(fn: ast.FunctionDef) -> Iterable[ast.AST]:
    """The nodes a run of ``fn`` can evaluate: not its decorators (the rewrite goes inside the
    body, whatever wraps the function), not annotations, not what an error path (``raise``)
    builds -- a run that reaches a raise stops with Unknown anyway."""
    stack: list[ast.AST] = [*fn.body, *fn.args.defaults, *(d for d in fn.args.kw_defaults if d is not None)]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.Raise):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stack.extend(node.body)  # a nested def: refused when it runs (statement FunctionDef)
            continue
        for child in child_nodes(node):
            if isinstance(child, ast.arg) or (isinstance(node, ast.AnnAssign) and child is node.annotation):
                continue
            stack.append(child)


def _finite_iter(name: str, args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
    """enumerate / zip / reversed over sequences the probe already holds, as a list (capped)."""
    t = torch_module()
    if kwargs and set(kwargs) - {"start", "strict"}:
        raise Unknown(f"{name}() with keyword arguments")
    for a in args:
        if not isinstance(a, (list, tuple, range, str)) and not isinstance(a, t.Tensor):
            raise Unknown(f"{name}() of a {type(a).__name__}")
        if len(a) > MAX_LOOP:
            raise Unknown(f"{name}() of a long sequence")
    seqs = [list(a.unbind(0)) if isinstance(a, t.Tensor) else list(a) for a in args]
    if name == "enumerate":
        if len(seqs) != 1:
            raise Unknown("enumerate() of an unknown form")
        start = kwargs.get("start", 0)
        return list(enumerate(seqs[0], start))
    if name == "zip":
        return list(zip(*seqs))
    if len(seqs) != 1:
        raise Unknown("reversed() of an unknown form")
    return list(reversed(seqs[0]))


def _comprehension(it: Interpreter, node: ast.ListComp | ast.GeneratorExp | ast.DictComp, env: dict[str, Any]) -> Any:
    """A list/dict comprehension or generator expression, evaluated at once in its own scope
    (the code is pure: evaluating a generator eagerly changes nothing); at most MAX_LOOP items."""
    inner = dict(env)
    out: list[Any] = []
    count = [0]

    def gen(k: int) -> None:
        if k == len(node.generators):
            count[0] += 1
            if count[0] > MAX_LOOP:
                raise Unknown("a long comprehension")
            if isinstance(node, ast.DictComp):
                out.append((it.expr(node.key, inner), it.expr(node.value, inner)))
            else:
                out.append(it.expr(node.elt, inner))
            return
        g = node.generators[k]
        if g.is_async:
            raise Unknown("an async comprehension")
        seq = it.expr(g.iter, inner)
        t = it.torch
        if isinstance(seq, t.Tensor):
            if seq.dim() == 0 or seq.shape[0] > MAX_LOOP:
                raise Unknown("a comprehension over a tensor")
            items = list(seq.unbind(0))
        elif isinstance(seq, (range, tuple, list, dict)):
            items = list(seq)
        else:
            raise Unknown("a comprehension over an unknown iterable")
        if len(items) > MAX_LOOP:
            raise Unknown("a long comprehension")
        for v in items:
            it._assign(g.target, v, inner)
            if all(it._test(c, inner) for c in g.ifs):
                gen(k + 1)

    gen(0)
    if isinstance(node, ast.DictComp):
        return dict(out)
    return out


# A helper imported from another file of the repository (``from .ops import rms_norm``) is
# followed like a same-file one: found through repo_facts.definition (which marks the outcome as
# depending on other files, so the per-file cache does not keep it), statically gated in its own
# file, interpreted with that file's names. Its branches never become guards of this scope
# (their names are the helper's); they are reported as sampled.
_EXTERNAL_ROOTS = frozenset(("torch", "math", "numpy", "einops", "triton", "functools", "typing", "os", "sys",
                             "transformers", "apex", "flash_attn", "xformers", "deepspeed", "megatron", "vllm"))
_FOREIGN_DEPTH = [0]


def _repo_function(module: ModuleInfo, name: str) -> tuple[ModuleInfo, ast.FunctionDef] | None:
    """(its file's ModuleInfo, its def) for a name this file imports from another file of the
    repo that defines a plain function there whose code passes the static gate; else None."""
    if name in module.functions or name in _BUILTINS or name in module.classes:
        return None
    target = module.aliases.get(name)
    if target is not None and target.split(".")[0] in _EXTERNAL_ROOTS:
        return None
    if target is None and name not in _relative_imports(module):
        return None  # not imported at all (a builtin, a local): asking other files would only cost
    cache = module.__dict__.setdefault("_npufuse_probe_foreign", {})
    if name in cache:
        return cache[name]
    cache[name] = None
    if _FOREIGN_DEPTH[0] >= 2:
        return None
    from npufuse.scan import repo_facts

    root = repo_facts.repo_root(module)
    if root is None:
        return None
    if target is not None:
        # an absolute import: only a package of this repository (asking about timm/numpy would mark
        # the file as depending on other files and keep it out of the cache for nothing)
        head = target.split(".")[0]
        try:
            if not ((root / head).is_dir() or (root / f"{head}.py").is_file()):
                return None
        except OSError:
            return None
    d = repo_facts.definition(module, name)
    if d is None or not isinstance(d.node, ast.FunctionDef) or d.rel == module.path or d.node.decorator_list:
        return None
    other = repo_facts.definition_module(root, d)
    if other is None:
        return None
    _FOREIGN_DEPTH[0] += 1
    try:
        if static_gate(other, d.node, None) is not None:
            return None
    finally:
        _FOREIGN_DEPTH[0] -= 1
    cache[name] = (other, d.node)
    return cache[name]


def _call_foreign(it: Interpreter, fv: Func, args: list[Any], kwargs: dict[str, Any]) -> Any:
    saved, first = it.module, len(it.decisions)
    it.module = fv.module
    try:
        out = it.call_function(fv.node, args, kwargs, fv.bound)
    finally:
        it.module = saved
        for d in it.decisions[first:]:
            d.foreign = True
    # a branch on a global of that file (a flag another module may set) is an assumption no
    # guard of this scope can check: refused; branches on the helper's arguments are sampled
    a = fv.node.args
    own = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)} | {n.id for n in fast_walk(fv.node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for d in it.decisions[first:]:
        for name in _free_names(d.test) - own - _BUILTINS:
            target = fv.module.aliases.get(name)
            if target is None or target.split(".")[0] not in _EXTERNAL_ROOTS:
                raise Unknown(f"a helper of another file branches on its global `{name}`")
    return out


def _relative_imports(module: ModuleInfo) -> set[str]:
    """Names bound by ``from .x import name`` statements of the file (ModuleInfo.aliases holds
    only absolute imports): gathered by the module's index in its walk of the statements."""
    return module.relative_imports


# --- s31: rotation helpers proved by evaluation ------------------------------------------------


@dataclass
class RotationProof:
    """What a one-tensor helper computes: ``half`` (``cat(-x2, x1)``), ``interleave``
    (``stack(-x_odd, x_even).flatten``), ``other`` (it ran and computes something else), ``unknown``
    (it could not be evaluated: ``reason`` says why) or ``deferred`` (left to the parent process)."""

    kind: str
    reason: str = ""


def prove_rotation(module: ModuleInfo, fn: ast.FunctionDef, cls: ast.ClassDef | None) -> RotationProof:
    """Evaluate ``fn(x)`` on sampled 4-D inputs of two widths and compare it with the two rotations
    npu_rotary_mul knows. Every spelling of rotate_half (halves by chunk/split/slices/unbind of a view,
    einops, filled buffers) reads the same here; a result of another dtype than the input's, or one that
    matches on one width only, is ``other``."""
    reason = static_gate(module, fn, cls)
    if reason is None:
        reason = structural_gate(module, fn, cls)
    if reason is not None:
        return RotationProof("unknown", reason)
    a = fn.args
    params = [p.arg for p in (*a.posonlyargs, *a.args)]
    is_method = cls is not None and not _is_static(fn)
    if is_method:
        params = params[1:]
    if len(params) - len(a.defaults) != 1 or any(d is None for d in a.kw_defaults):
        return RotationProof("unknown", "the helper takes other arguments without defaults than the tensor")
    if _deferred(module):
        return RotationProof("deferred", "left to the parent process, which imports torch once for the scan")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _prove_rotation(module, fn, cls if is_method else None)
    except Unknown as e:
        return RotationProof("unknown", e.reason)
    except RecursionError:
        return RotationProof("unknown", "recursion")
    except Exception as e:  # torch raising on a sampled value the interpreter did not anticipate
        return RotationProof("unknown", f"evaluation raised {type(e).__name__}")


def _prove_rotation(module: ModuleInfo, fn: ast.FunctionDef, cls: ast.ClassDef | None) -> RotationProof:
    t = torch_module()
    kinds = set()
    for seed, (width, dtype) in enumerate(((8, t.float64), (12, t.float64), (8, t.float32))):
        gen = t.Generator().manual_seed(4321 + seed)
        x = t.randn(2, 3, 5, width, generator=gen, dtype=dtype)
        obj = Obj(cls) if cls is not None else None  # a helper reading state of self is Unknown (no attrs)
        out = Interpreter(module).call_function(fn, [x], {}, obj)
        if not isinstance(out, t.Tensor) or out.shape != x.shape:
            return RotationProof("other", "the result is not a tensor of the input's shape")
        if out.dtype != x.dtype:
            return RotationProof("other", f"the result is {out.dtype} for a {x.dtype} input")
        x1, x2 = x[..., : width // 2], x[..., width // 2 :]
        half = t.cat((-x2, x1), dim=-1)
        inter = t.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        tol = dict(rtol=0, atol=0) if dtype == t.float64 else dict(rtol=1e-6, atol=1e-6)
        found = {k for k, ref in (("half", half), ("interleave", inter)) if t.allclose(out, ref, **tol)}
        if len(found) != 1:
            return RotationProof("other", "it computes neither cat(-x2, x1) nor stack(-x_odd, x_even) on sampled inputs")
        kinds |= found
    if len(kinds) != 1:
        return RotationProof("other", "it computes different rotations on different widths")
    return RotationProof(kinds.pop())
