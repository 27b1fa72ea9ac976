"""add_rms_norm: a residual add directly followed by an RMSNorm of the sum -> ``npu_add_rms_norm``.

The HF decoder layer spelling::

    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)

is found when the norm module's class is one the rms_norm detector recognises in this module
(its ``forward`` is parsed with ``self`` bound to ``self.post_attention_layernorm``, so eps, the
weight, the ``1 +`` offset and the output dtype come from the norm's own code); a class defined
elsewhere whose name says RMSNorm is taken with medium confidence and HF semantics assumed.

Training: ``npu_add_rms_norm`` has no backward (spec §2.2, §12). The fused branch therefore uses
it only when autograd is off (``torch.is_grad_enabled()`` false: inference, ``no_grad``,
``inference_mode``) and ``x1``/``x2`` share a dtype (the op's constraint); otherwise it runs
``x1 + x2`` then ``npu_rms_norm`` (which has a backward), so training still works and still gets
the fused norm.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from npufuse.patterns import _add_rms_norm_s44, _add_rms_norm_s44h, _add_rms_norm_s45h, _add_rms_norm_s45sweep, _add_rms_norm_s46a, _norm_s43
from npufuse.patterns import _add_rms_norm_s46h, _add_rms_norm_s47n, _add_rms_norm_s47sweep
from npufuse.patterns import _add_rms_norm_s48h, _add_rms_norm_s49l, _add_rms_norm_s49m, _add_rms_norm_s50m, _add_rms_norm_s50n, _rms_norm_s48f, _rms_norm_s48h
from npufuse.patterns import _add_rms_norm_s51m
from npufuse.patterns import _site as S
from npufuse.patterns import rms_norm as R
from npufuse.patterns._library_norm import eps_or_default, float32_eps
from npufuse.patterns.base import Finding, Fuse, Keep, NearMiss, Pattern, Result, Risk
from npufuse.scan.dataflow import ModuleInfo, Scope, dotted, fast_walk
from npufuse.scan.value import estimate, symbolic

if TYPE_CHECKING:  # torch is imported only to run a reference, never to scan
    import torch

_LAYER_NORMS = {"torch.nn.LayerNorm", "torch.nn.GroupNorm", "torch.nn.BatchNorm1d", "torch.nn.InstanceNorm1d"}
_RMS_NAME = re.compile(r"rms_?norm", re.IGNORECASE)
_OFFSET_NAME = re.compile(r"gemma|qwen3_?5|qwen3_?next", re.IGNORECASE)


@dataclass
class NormCall:
    call: ast.Call  # self.<attr>(x)
    attr: str
    kind: str  # "rms" | "library" | "l2" | "external" | "not_rms"
    match: R.Match | None = None
    reason: str = ""
    cls: str = ""
    gamma: str = ""  # library kind: the weight and eps expressions
    eps: str = ""
    ones: bool = False  # no weight (``F.rms_norm(x, (d,))``): npu_add_rms_norm gets ones of x1's last dim
    conditions: list[str] = field(default_factory=list)  # run-time checks for the fused code (else the original)
    # s31: the file view the norm was read in when its class is in another file of the repository
    # (this file with that class added): the replacement is planned in it
    home: ModuleInfo | None = None
    # s32: the norm module's expression when it is not ``self.<attr>`` (``layer.post_attention_layernorm``)
    mod: str = ""
    # s39: the ``_library_norm.THIRD_PARTY_RMS_NORMS`` key of a verified library class (external kind)
    third_party: str = ""
    # s40: ``timm.RmsNorm`` / ``timm.RmsNormFp32`` (external kind), read from timm's source
    timm: str = ""
    # s41: probed kind (a forward the numeric probe proves): its output dtype rule and the highest input rank proved
    probe: tuple[str, int] = ("", 0)
    # s42: probed kind whose forward places eps otherwise (outside the root, a clamp): the rule, the original's eps
    # and the probe's relative difference on rows of rms 1 (the eps above is the probe's mapped eps')
    s42_eps_form: tuple[str, str, float] | None = None
    # s43: probed kind: the run-time guards the probe assumed (``self.d_model == x.shape[-1]`` for a mean spelled
    # ``(1 / self.d_model) * x.pow(2).sum(-1)``), read on the instance; the input is written ``_npu_norm_input``
    # and renamed to the sum's first operand where the replacement is built
    probe_guards: list[str] = field(default_factory=list)
    # s50: forward parameters read only by arm tests the fused code's conditions settle (_add_rms_norm_s50n), and the
    # caller's names those conditions read (tested before the site's first statement)
    test_only: frozenset[str] = frozenset()
    guard_names: frozenset[str] = frozenset()
    # s50: the forward's F.rms_norm arm returns the input's dtype; the torch path read may promote with the weight
    # (``type_as(x) * self.weight``): the fused code runs only where the two agree (see _add_rms_norm_s50n.same_dtype)
    library_arm: bool = False


def _library_gamma_eps(module: ModuleInfo, mod: str, ctor: ast.Call) -> tuple[str, str] | None:
    """(gamma, eps) of ``self.<attr> = nn.RMSNorm(shape, eps=None, elementwise_affine=True)``;
    None when it has no weight (npu_add_rms_norm needs gamma)."""
    from npufuse.scan.dataflow import const_value, keyword

    affine = keyword(ctor, "elementwise_affine", 2)
    if affine is not None and const_value(affine) is not True:
        return None
    T = S.torch_name(module) or "torch"
    eps = keyword(ctor, "eps", 1)
    v = const_value(eps) if eps is not None else None
    if eps is None or v is None:
        return f"{mod}.weight", float32_eps(T)
    if type(v) in (int, float):
        return f"{mod}.weight", S.source_of(module, eps)
    return f"{mod}.weight", eps_or_default(f"{mod}.eps", T)


def _library_forward(module: ModuleInfo, fwd: ast.FunctionDef, mod: str, foreign: bool = False) -> tuple[str, str] | None:
    """(gamma, eps) when a norm class's forward is ``return F.rms_norm(x, shape, self.w, self.eps)``
    (DeepSeek-V3's RMSNorm), with ``self`` read as ``mod``; None otherwise."""
    from npufuse.scan import canonical
    from npufuse.scan.dataflow import const_value, keyword

    ret = S.helper_return(fwd)
    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    if ret is None or len(params) < 2 or not isinstance(ret.value, ast.Call):
        return None
    call = ret.value
    if canonical.api(module, call.func) != "torch.nn.functional.rms_norm":
        return None
    x, w, eps = keyword(call, "input", 0), keyword(call, "weight", 2), keyword(call, "eps", 3)
    if not (isinstance(x, ast.Name) and x.id == params[1]) or w is None:
        return None
    if _add_rms_norm_s44h.input_changed_before(fwd, ret, params[1]):
        return None  # (s45 review) ``x = x + self.bias`` first: the fused call would normalise the caller's tensor

    def as_mod(node: ast.expr) -> str | None:
        d = dotted(node)
        if d is not None and d.startswith(params[0] + "."):
            return mod + d[len(params[0]):]
        return None

    gamma = as_mod(w)
    if gamma is None:
        return None
    T = S.torch_name(module) or "torch"
    if eps is None or const_value(eps) is None:
        return gamma, float32_eps(T)
    if isinstance(const_value(eps), (int, float)):
        # ``foreign``: the forward is another file's code, whose text is not this module's
        return gamma, ast.unparse(eps) if foreign else S.source_of(module, eps)
    e = as_mod(eps)
    if e is None:
        return None
    return gamma, eps_or_default(e, T)


# Triton RMSNorm kernels of flash-attn (and mamba_ssm's copy): ``rms_norm_fn(x, weight, bias, residual=None,
# ..., eps=1e-6, dropout_p=0.0, rowscale=None, prenorm=False, ...)``. With no bias, residual, second input,
# dropout, row scale, prenorm or zero-centred weight it is ``x * rsqrt(mean(x^2) + eps) * weight`` computed
# in float32 and returned in x's dtype: an RMSNorm. Norm modules keep the function as an attribute
# (``self.rms_norm_fn = rms_norm_fn``: ProGen3, llm-foundry, OLMo-core) or call it by name.
_TRITON_RMS_NORM_FNS = ("flash_attn.ops.triton.layer_norm.rms_norm_fn", "mamba_ssm.ops.triton.layer_norm.rms_norm_fn")
# keywords that must be absent or hold these values for the call to be a plain RMSNorm
_TRITON_PLAIN_KEYWORDS = {"bias": None, "residual": None, "x1": None, "weight1": None, "bias1": None, "dropout_p": 0,
                          "rowscale": None, "prenorm": False, "zero_centered_weight": False, "out_dtype": None,
                          "out": None, "residual_out": None}


def _triton_rms_forward(module: ModuleInfo, fwd: ast.FunctionDef, cls: str, mod: str, foreign: bool) -> tuple[str, str] | None:
    """(gamma, eps) when a norm class's forward returns flash-attn's Triton ``rms_norm_fn(x, self.w, None,
    eps=...)`` as a plain RMSNorm of its input (optionally cast back to the input's dtype, read before
    the call as ``name = x.dtype``), the function called by its imported name or through an attribute
    ``__init__`` binds to it once; ``self`` read as ``mod``. None otherwise."""
    from npufuse.scan import canonical
    from npufuse.scan.dataflow import const_value

    body = [st for st in fwd.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    if not body or len(params) < 2 or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    self_name, x_name = params[0], params[1]
    dtype_names: set[str] = set()
    for st in body[:-1]:  # only ``input_dtype = x.dtype`` reads may come first: x is normalised as given
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                and dotted(st.value) == f"{x_name}.dtype"):
            return None
        dtype_names.add(st.targets[0].id)
    value = body[-1].value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in ("to", "type_as") \
            and len(value.args) == 1 and not value.keywords:
        back = value.args[0]
        # a cast back to the input's dtype changes nothing: the kernel returns x's dtype
        if not (isinstance(back, ast.Name) and (back.id in dtype_names or back.id == x_name and value.func.attr == "type_as")
                or dotted(back) == f"{x_name}.dtype"):
            return None
        value = value.func.value
    if not isinstance(value, ast.Call) or any(isinstance(a, ast.Starred) for a in value.args) or len(value.args) > 3 \
            or any(k.arg is None for k in value.keywords):
        return None
    func = value.func
    name = canonical.api(module, func)
    d = dotted(func)
    if d is not None and d.startswith(self_name + ".") and d.count(".") == 1:
        attr = d.split(".", 1)[1]
        init = S.method(module, cls, "__init__")
        bound = [st.value for st in (S._stmts_in(init.body) if init is not None else [])
                 if isinstance(st, ast.Assign) and any(dotted(t) == f"self.{attr}" for t in st.targets)]
        name = canonical.api(module, bound[0]) if len(bound) == 1 and isinstance(bound[0], ast.Name) else None
    if name not in _TRITON_RMS_NORM_FNS:
        return None
    given = {k.arg: k.value for k in value.keywords}
    for i, a in enumerate(value.args):
        given[("x", "weight", "bias")[i]] = a
    x, w, eps = given.pop("x", None), given.pop("weight", None), given.pop("eps", None)
    if not (isinstance(x, ast.Name) and x.id == x_name) or w is None:
        return None
    for k, v in given.items():
        if k == "residual_in_fp32":
            continue  # no residual: nothing to keep in fp32
        if k not in _TRITON_PLAIN_KEYWORDS or const_value(v) != _TRITON_PLAIN_KEYWORDS[k] \
                or _TRITON_PLAIN_KEYWORDS[k] is None and not (isinstance(v, ast.Constant) and v.value is None):
            return None
    wd = dotted(w)
    if wd is None or not wd.startswith(self_name + "."):
        return None
    gamma = mod + wd[len(self_name):]
    if eps is None:
        return gamma, "1e-6"  # rms_norm_fn's default
    if isinstance(const_value(eps), (int, float)) and not isinstance(const_value(eps), bool):
        return gamma, ast.unparse(eps) if foreign else S.source_of(module, eps)
    ed = dotted(eps)
    if ed is None or not ed.startswith(self_name + "."):
        return None
    return gamma, mod + ed[len(self_name):]


# -- s35: norm helpers that return a library RMSNorm kernel of their input ---------------------------
# ShadowKV's ``def layer_norm(h, eps, w): return rmsnorm(h.view(-1, h.size(-1)), w, eps).view_as(h)``
# (flashinfer), xtuner's ``def rms_norm(x, weight, epsilon): return rms_norm_fn(x, weight, bias=None,
# eps=epsilon)`` (flash-attn's Triton kernel), a ``F.rms_norm(x, (x.size(-1),), w, eps)`` helper: each is
# x * rsqrt(mean(x^2) + eps) * w over the last dim, computed in fp32 and returned in x's dtype. The
# helper's weight and eps are parameters; the call site's arguments for them name the norm's gamma and
# eps, so the helper's own code is never rendered (its file may import the kernel; this one need not).

# kernel: (its parameters in order, eps when not given; None: float32's, as PyTorch's rms_norm)
_RMS_KERNELS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "flashinfer.norm.rmsnorm": (("input", "weight", "eps", "out", "enable_pdl"), "1e-6"),
    "flashinfer.rmsnorm": (("input", "weight", "eps", "out", "enable_pdl"), "1e-6"),
    **{k: (("x", "weight", "bias"), "1e-6") for k in _TRITON_RMS_NORM_FNS},
    "torch.nn.functional.rms_norm": (("input", "normalized_shape", "weight", "eps"), None),
}
# flashinfer's Gemma form, x * rsqrt(mean(x^2) + eps) * (1 + weight) in float32: the same kernel arguments
_GEMMA_RMS_KERNELS = {"flashinfer.gemma_rmsnorm": "flashinfer.rmsnorm", "flashinfer.norm.gemma_rmsnorm": "flashinfer.norm.rmsnorm"}
# the kernel's arguments that may be given with these values only (flashinfer's ``out`` writes into a
# caller's buffer; ``enable_pdl`` only overlaps kernel launches): the rest as for the Triton module form
_RMS_KERNEL_PLAIN = {**_TRITON_PLAIN_KEYWORDS, "enable_pdl": ..., "residual_in_fp32": ...}


def _rows_of(node: ast.expr, x: str, dims: tuple[str, ...] = ()) -> bool:
    """``node`` is ``x`` or ``x`` with its leading dims flattened (``x.view(-1, x.size(-1))``,
    ``x.reshape(-1, x.shape[-1])``, ``x.flatten(0, -2)``; with ``dims`` the names ``b, s, h = x.shape``
    unpacked: ``x.reshape(b * s, h)``): the same rows of the last dim."""
    if isinstance(node, ast.Name):
        return node.id == x
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == x and not node.keywords):
        return False
    m, args = node.func.attr, [ast.unparse(a).replace(" ", "") for a in node.args]
    if m in ("view", "reshape"):
        rows = ["-1", "*".join(dims[:-1])] if len(dims) >= 2 else []
        return args in (["-1", f"{x}.size(-1)"], ["-1", f"{x}.shape[-1]"]) or (len(args) == 2 and args[0] in rows and args[1] == dims[-1])
    return m == "flatten" and args == ["0", "-2"]


def _restored(node: ast.expr, x: str, dims: tuple[str, ...] = ()) -> ast.expr | None:
    """The inner value of ``v.view_as(x)`` / ``v.reshape_as(x)`` / ``v.view(x.shape)`` /
    ``v.reshape(*x.shape)`` (x's shape given back; with ``dims`` unpacked from ``x.shape``, also
    ``v.reshape(b, s, h)``), or ``node`` itself."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and len(node.args) == 1 and not node.keywords:
        a = node.args[0]
        a = a.value if isinstance(a, ast.Starred) else a
        m, text = node.func.attr, ast.unparse(a).replace(" ", "")
        if (m in ("view_as", "reshape_as") and text == x) or (m in ("view", "reshape") and text in (f"{x}.shape", f"{x}.size()")):
            return node.func.value
    if dims and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("view", "reshape") \
            and not node.keywords and [ast.unparse(a) for a in node.args] == list(dims):
        return node.func.value
    return node


def _straight_helper_value(fn: ast.FunctionDef, x: str) -> tuple[ast.expr, tuple[str, ...]] | None:
    """The value a straight-line helper returns as one expression of its parameters, and the names of
    ``x``'s dims when its first statement unpacks them (``b, s, h = x.shape``). UMbreLLa's
    ``layer_norm(h, eps, w)``: ``b, s, h = x.shape; x = x.reshape(b * s, h); x = kernel(x, w, eps);
    x = x.reshape(b, s, h); return x``. Only rebindings of ``x`` itself are folded in (each reads the
    one before); anything else in the body: None."""
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    dims: tuple[str, ...] = ()
    first = body[0]
    if len(body) > 1 and isinstance(first, ast.Assign) and len(first.targets) == 1 and isinstance(first.targets[0], ast.Tuple) \
            and all(isinstance(e, ast.Name) for e in first.targets[0].elts) \
            and ast.unparse(first.value).replace(" ", "") in (f"{x}.shape", f"{x}.size()"):
        dims = tuple(e.id for e in first.targets[0].elts)  # type: ignore[attr-defined]
        if x in dims or len(set(dims)) != len(dims):
            return None
        body = body[1:]
    current: ast.expr = ast.Name(x, ast.Load())

    class Fold(ast.NodeTransformer):
        def visit_Name(self, n: ast.Name) -> ast.AST:
            return current if n.id == x else n

    for st in body[:-1]:
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) and st.targets[0].id == x):
            return None
        current = Fold().visit(ast.parse(ast.unparse(st.value), mode="eval").body)
    value = Fold().visit(ast.parse(ast.unparse(body[-1].value), mode="eval").body)
    return value, dims


def _kernel_helper_norm(module: ModuleInfo, call: ast.Call, home: ModuleInfo, fn: ast.FunctionDef, where: str) -> NormCall | None:
    """The helper ``fn`` (of ``home``) called as ``call`` when its one statement returns a library
    RMSNorm kernel (``_RMS_KERNELS``) of its first parameter, the kernel's weight and eps each a
    parameter of the helper (read as this call's argument: a name or an attribute) or a constant;
    None otherwise."""
    from npufuse.scan import canonical
    from npufuse.scan.dataflow import const_value

    a = fn.args
    params = [p.arg for p in (*a.posonlyargs, *a.args)]
    if not params or a.vararg or a.kwarg:
        return None
    inlined = _straight_helper_value(fn, params[0])
    if inlined is None:
        return None
    returned, dims = inlined
    value = _restored(returned, params[0], dims)
    if not isinstance(value, ast.Call) or any(isinstance(v, ast.Starred) for v in value.args) or any(k.arg is None for k in value.keywords):
        return None
    kernel = canonical.api(home, value.func)
    offset = kernel in _GEMMA_RMS_KERNELS
    if offset:
        kernel = _GEMMA_RMS_KERNELS[kernel]
    if kernel not in _RMS_KERNELS:
        return None
    names, eps_default = _RMS_KERNELS[kernel]
    if len(value.args) > len(names):
        return None
    given: dict[str, ast.expr] = dict(zip(names, value.args))
    given.update({k.arg: k.value for k in value.keywords if k.arg is not None})
    x, w, eps = given.pop(names[0], None), given.pop("weight", None), given.pop("eps", None)
    shape = given.pop("normalized_shape", None)
    if x is None or not _rows_of(x, params[0], dims):
        return None
    conditions: list[str] = []
    by_weight = isinstance(shape, ast.Attribute) and shape.attr == "shape" and isinstance(w, ast.Name) \
        and isinstance(shape.value, ast.Name) and shape.value.id == w.id
    if shape is not None and not by_weight \
            and not (_last_dim_shape(shape) and params[0] in {n.id for n in ast.walk(shape) if isinstance(n, ast.Name)}):
        return None  # F.rms_norm over ``(x.size(-1),)`` or ``weight.shape`` only (another shape may name more dims)
    for k, v in given.items():
        plain = _RMS_KERNEL_PLAIN.get(k, ...)
        if k not in _RMS_KERNEL_PLAIN or (plain is not ... and (const_value(v) != plain or plain is None
                                                                  and not (isinstance(v, ast.Constant) and v.value is None))):
            return None
    # this call's argument for each helper parameter (the helper's constant defaults included)
    bound: dict[str, ast.expr] = dict(zip(params, call.args))
    for k in call.keywords:
        if k.arg is None or k.arg not in params or k.arg in bound:
            return None
        bound[k.arg] = k.value
    defaults = dict(zip(params[len(params) - len(a.defaults):], a.defaults)) if a.defaults else {}

    def text(node: ast.expr | None) -> str | None:
        """The code of a kernel argument at the call site: a parameter's argument (a name or an
        attribute: the fused code reads it twice), or a number."""
        if node is None:
            return None
        if isinstance(node, ast.Name) and node.id in params:
            arg = bound.get(node.id)
            if arg is None:
                d = defaults.get(node.id)
                return ast.unparse(d) if d is not None and type(const_value(d)) in (int, float) else None
            return S.source_of(module, arg) if dotted(arg) is not None or type(const_value(arg)) in (int, float) else None
        if params[0] in {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}:
            return None
        return ast.unparse(node) if type(const_value(node)) in (int, float) else None

    if isinstance(w, ast.Name) and w.id in params and w.id not in bound and isinstance(defaults.get(w.id), ast.Constant):
        w = defaults[w.id]  # ``weight=None`` left out: no weight
    ones = w is None or (isinstance(w, ast.Constant) and w.value is None)
    if ones and (by_weight or shape is None or home is module):
        return None  # the norm's shape is the weight's (or the kernel needs one); this file's weightless
        # F.rms_norm helpers are read by _function_norm itself
    gamma = "" if ones else text(w)
    if gamma and shape is not None:
        # F.rms_norm's weight may be None at run time (``self.weight`` of a weightless norm); over
        # ``weight.shape`` it names the last dim only when 1-D
        conditions.append(f"{gamma} is not None" + (f" and {gamma}.dim() == 1" if by_weight else ""))
    if isinstance(eps, ast.Name) and eps.id in params and eps.id not in bound and isinstance(defaults.get(eps.id), ast.Constant):
        eps = defaults[eps.id]  # the helper's default (``eps=None``: the kernel's own)
    if eps is None or (isinstance(eps, ast.Constant) and eps.value is None):
        T = S.torch_name(module) or "torch"
        e = eps_default if eps_default is not None else float32_eps(T)
    else:
        e = text(eps)
        if e is not None and eps_default is None and type(const_value(ast.parse(e, mode="eval").body)) not in (int, float):
            e = eps_or_default(e, S.torch_name(module) or "torch")  # F.rms_norm's eps=None: float32's
    if gamma is None or e is None or len(call.args) + len(call.keywords) > len(params) or (offset and ones):
        return None
    if offset:
        # flashinfer's gemma_rmsnorm scales by (1 + weight), computed in float32 like the kernel does
        gamma = f"(1 + {gamma}.float())"
    label = call.func.id if isinstance(call.func, ast.Name) else ast.unparse(call.func)
    name = kernel.rsplit('.', 1)[-1] if not offset else "gemma_rmsnorm"
    return NormCall(call, label, "library", cls=f"{label}{where} ({name} kernel)", gamma=gamma, eps=e,
                    ones=ones, conditions=conditions)


def _eps_text(module: ModuleInfo, eps: ast.expr | None) -> str | None:
    """The epsilon argument for a library rms_norm's ``eps`` (None/absent: float32's, as PyTorch's kernel)."""
    from npufuse.scan.dataflow import const_value

    T = S.torch_name(module) or "torch"
    if eps is None or (isinstance(eps, ast.Constant) and eps.value is None):
        return float32_eps(T)
    if type(const_value(eps)) in (int, float):
        return S.source_of(module, eps)
    if dotted(eps) is not None:  # a name or attribute: None at run time means PyTorch's default
        e = S.source_of(module, eps)
        return eps_or_default(e, T)
    return None


def _last_dim_shape(shape: ast.expr | None) -> bool:
    """A ``normalized_shape`` naming one (the last) dim: ``(d,)``, ``[d]``, ``d``."""
    if isinstance(shape, (ast.Tuple, ast.List)):
        return len(shape.elts) == 1 and not isinstance(shape.elts[0], ast.Starred)
    return isinstance(shape, (ast.Name, ast.Attribute, ast.Constant)) or (
        isinstance(shape, ast.Call) and isinstance(shape.func, ast.Attribute) and shape.func.attr == "size" and len(shape.args) == 1)


def _functional_norm(module: ModuleInfo, call: ast.Call, label: str) -> NormCall | None:
    """``F.rms_norm(x, shape, weight=None, eps=None)`` / ``torch.rms_norm`` on the sum."""
    from npufuse.scan.dataflow import keyword

    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None
    shape, w, eps = keyword(call, "normalized_shape", 1), keyword(call, "weight", 2), keyword(call, "eps", 3)
    e = _eps_text(module, eps)
    if e is None:
        return None
    if w is None or (isinstance(w, ast.Constant) and w.value is None):
        if not _last_dim_shape(shape):
            return None
        return NormCall(call, label, "library", cls=label, gamma="", eps=e, ones=True)
    if dotted(w) is None:
        return None  # an expression would be evaluated before the add, and twice
    return NormCall(call, label, "library", cls=label, gamma=S.source_of(module, w), eps=e)


def _function_norm(module: ModuleInfo, call: ast.Call, ctx: S.Ctx) -> NormCall | None:
    """``norm(x)``: a module-level function of this file that is an RMSNorm of its argument
    (nanochat's ``def norm(x): return F.rms_norm(x, (x.size(-1),))``, a hand-written one)."""
    from npufuse.scan import canonical

    f = call.func
    assert isinstance(f, ast.Name)
    if (call.args and isinstance(call.args[0], ast.Starred)) or S.definition(ctx, f.id) is not None:
        return None
    # the input: the first positional argument, or the keyword naming the helper's first parameter; for a helper
    # of this file normalizing a later parameter (CS336's ``rmsnorm(d_model, eps, weights, in_features)``) that one
    in_arg = _helper_input_arg(module, call) if "norm" in f.id.lower() else None
    in_param = _helper_input_param(module, module.helper(f.id)) if in_arg is not None else None  # type: ignore[arg-type]
    arg = in_arg if in_arg is not None else call.args[0] if call.args else _helper_keyword_input(module, call)
    if arg is None:
        return None
    fn = module.helper(f.id)
    home, where = module, ""  # the file defining the helper
    if fn is None:
        found = _repo_norm_helper(module, f.id)
        if found is not None:
            home, fn = found
            where = f" (from {home.path})"
        else:
            # a helper returning a library kernel is not rendered: the names its file reads may differ
            other = _foreign_definition(module, f.id)
            if other is not None and isinstance(other[1], ast.FunctionDef):
                return _kernel_helper_norm(module, call, other[0], other[1], f" (from {other[0].path})")
    if not isinstance(fn, ast.FunctionDef):
        return None
    kernel = _kernel_helper_norm(module, call, home, fn, where)
    if kernel is not None:
        return kernel
    ret = R._helper_return(fn)
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    nscope = S.scope_of(home, fn)
    if ret is None or ret.value is None or nscope is None or not params:
        return None
    defaults = dict(zip(params[len(params) - len(fn.args.defaults):], fn.args.defaults))
    value = ret.value
    if isinstance(value, ast.Call) and canonical.api(module, value.func) == "torch.nn.functional.rms_norm":
        if home is not module:
            return None  # its weight and eps would be read as text of the other file
        if len(call.args) != 1 or call.keywords or any(p not in defaults for p in params[1:]):
            return None
        from npufuse.scan.dataflow import keyword

        x = keyword(value, "input", 0)
        if not (isinstance(x, ast.Name) and x.id == params[0]) or len(fn.body) != 1 + (isinstance(fn.body[0], ast.Expr)):
            return None
        # only the input may be a parameter: the weight and eps are read at the call site
        used = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)} & set(params[1:])
        if used:
            return None
        nc = _functional_norm(module, value, f.id)
        if nc is None or not nc.ones:
            return None  # a weight written in the helper cannot be named at the call site
        nc.call = call
        return nc
    # the helper's parameters bound to this call's arguments (``rms_norm(h, self.w, self.eps)``)
    hctx = S.bind_call(home, call, fn, ctx, False)
    if hctx is None:
        return None
    # an inline sum (``rms_norm(h + attn(h), eps)``) is read as the name the fused code binds it to:
    # the helper's reads of its input (``input_dtype = x.dtype``) must not evaluate the sum again
    hctx.bind[in_param or params[0]] = (_norm_input(arg), ctx)
    try:
        m = R.parse_norm(module, value, hctx.at(ret.lineno))
    except R.NoMatch:
        return None
    except R.Miss as e:
        kind = "is not RMSNorm" if "mean subtracted" in e.reason else "cannot be fused"
        return NormCall(call, f.id, "not_rms", reason=f"norm {f.id}{where} {kind}: {e.reason}", cls=f.id)
    return NormCall(call, f.id, "rms", match=m, cls=f.id + where)


# -- s31: a norm helper imported from another file of the repository ------------------------------
# HRM's ``from models.layers import rms_norm`` then ``rms_norm(h + self.attn(h), variance_epsilon=eps)``:
# the helper is read in its own file with its parameters bound to this call's arguments. The matcher
# resolves the helper's names through this file's imports and the replacement spells them here
# (a helper's code is rendered as text, its parameters as this call's arguments), so every name the
# helper reads without binding it must mean the same in both files: a builtin, or an import both
# files spell alike (``torch``); a helper reading another name of its file (a constant, another
# helper) is not followed.

_BUILTIN_NAMES = frozenset(dir(__import__("builtins")))


def _foreign_definition(module: ModuleInfo, name: str) -> tuple[ModuleInfo, ast.AST] | None:
    """(its file, its definition) for a top-level def or class ``name`` that this file imports from
    another file of the repository; None otherwise (cached per file)."""
    cache = module.__dict__.setdefault("_npufuse_norm_foreign", {})
    if name in cache:
        return cache[name]
    cache[name] = found = _find_foreign_definition(module, name)
    return found


def _find_foreign_definition(module: ModuleInfo, name: str) -> tuple[ModuleInfo, ast.AST] | None:
    """:func:`_foreign_definition` uncached: every answer, None included, is kept per file and name (the
    detector asks again for every norm call of the file, and the import test read every top-level
    statement each time)."""
    from npufuse.scan import repo_facts

    if name in module.classes or name in module.functions:
        return None
    # s33: ``layers.UIOLayerNorm`` with ``from uio2 import layers`` (a class of a submodule the file imports)
    head, dot, attr = name.partition(".")
    if dot and ("." in attr or head in module.classes or head in module.functions):
        return None
    target = module.aliases.get(head)
    if target is not None and dot:
        target = f"{target}.{attr}"
    # s41: an import inside a function or an ``if`` arm (``if cfg.rms: from .layers import RMSNorm`` in ``__init__``)
    # counts like a top-level one (``relative_imports`` holds the whole file's), where every import of the name in
    # the file names the same thing (the definition is looked up per file and name, not per scope)
    relative = head in module.relative_imports
    if target is None and not relative:
        return None  # not imported: asking other files would only cost
    if not _imports_agree(module, head):
        return None
    root = repo_facts.repo_root(module)
    if root is None:
        return None
    if target is not None:
        # an absolute import: only a package of this repository (asking about a library would mark
        # the file as depending on other files for nothing)
        # (at the root or in a folder above the importing file, as repo_facts.definition looks)
        head = target.split(".")[0]
        packages = module.__dict__.setdefault("_npufuse_norm_repo_packages", {})  # head -> a package of the repo?
        if head not in packages:  # most names share a head (``torch``): the folders are asked once per file
            try:
                folders = [root, *(root / p for p in PurePosixPath(module.path).parents if str(p) != ".")]
                packages[head] = any((d / head).is_dir() or (d / f"{head}.py").is_file() for d in folders)
            except OSError:
                packages[head] = False
        if not packages[head]:
            return None
    d = repo_facts.definition(module, name)
    if d is None or d.rel == module.path or not isinstance(d.node, (ast.FunctionDef, ast.ClassDef)) or d.node.decorator_list:
        return None
    text = repo_facts._repo_text(root, d.rel)
    if text is None:
        return None
    try:
        other = ModuleInfo.from_source(d.rel, text, d.tree)
    except (Exception, RecursionError):
        return None
    repo_facts.attach_root(other, root)
    return other, d.node


def _imports_agree(module: ModuleInfo, name: str) -> bool:
    """Every import binding ``name`` in the file names the same thing, or all of them are top-level ones (whose first
    one the lookup reads, as before s41); False where an import inside a function or block names something else."""
    table = module.__dict__.get("_npufuse_norm_imports")
    if table is None:
        from npufuse.scan.dataflow import _statements_bfs

        table = module.__dict__["_npufuse_norm_imports"] = {}
        top = {id(n) for n in module.tree.body}
        for n in _statements_bfs(module.tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                for a in n.names:
                    key = (getattr(n, "level", 0), getattr(n, "module", None), a.name)
                    table.setdefault(a.asname or a.name.split(".")[0], []).append((key, id(n) in top))
    found = table.get(name, [])
    return all(t for _k, t in found) or len({k for k, _t in found}) <= 1


def _free_names(module: ModuleInfo, other: ModuleInfo, node: ast.AST, also: frozenset[str] = frozenset()) -> dict[str, str] | None:
    """The import aliases ``node`` (code of ``other``) reads that this file does not bind (to be
    borrowed while reading it), or None when a name it reads means something else here or is
    another definition of its file (a constant, a helper: not followed). ``also``: classes of
    ``other`` added to the view with it (s35: a norm wrapper and the norm classes it builds)."""
    bound = {n.arg for n in ast.walk(node) if isinstance(n, ast.arg)} | set(also)
    bound |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    bound |= {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    top_here = {t.id for st in module.tree.body if isinstance(st, (ast.Assign, ast.AnnAssign))
                for t in (st.targets if isinstance(st, ast.Assign) else [st.target]) if isinstance(t, ast.Name)}
    borrowed: dict[str, str] = {}
    for n in ast.walk(node):
        if not (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)) or n.id in bound:
            continue
        if n.id in other.functions or n.id in other.classes:
            return None
        there = other.aliases.get(n.id)
        if there is None:
            if n.id not in _BUILTIN_NAMES or any(n.id in names for names in (module.aliases, module.functions, module.classes, top_here)):
                return None
            continue
        if n.id in module.aliases:
            if module.aliases[n.id] != there:
                return None
        elif n.id in module.functions or n.id in module.classes or n.id in top_here:
            return None
        else:
            borrowed[n.id] = there
    return borrowed


def _repo_norm_helper(module: ModuleInfo, name: str) -> tuple[ModuleInfo, ast.FunctionDef] | None:
    """(its file, its def) for a plain function ``name`` this file imports from another file of the
    repository, every name it reads meaning the same here; None otherwise."""
    found = _foreign_definition(module, name)
    if found is None or not isinstance(found[1], ast.FunctionDef):
        return None
    other, fn = found
    if _free_names(module, other, fn) != {}:
        return None  # the rendered helper code would name something this file lacks or means otherwise
    return other, fn


def _repo_norm_class(module: ModuleInfo, func: ast.expr) -> tuple[ModuleInfo, str, str] | None:
    """A norm class built as ``Cls(...)`` that this file imports from another file of the repository:
    (this file with the class added, the class's name, its file). The class's code reads its imports
    (``torch``, ``nn``) as its file does; names this file does not bind are borrowed for the reading
    (the replacement is checked not to name them), any other difference refuses."""
    name = dotted(func) if isinstance(func, (ast.Name, ast.Attribute)) else None
    if name is None:
        return None
    found = _foreign_definition(module, name)
    if found is None or not isinstance(found[1], ast.ClassDef):
        return None
    other, cls = found
    if cls.name in module.classes or any(not _plain_module_base(other, b) for b in cls.bases) or cls.keywords:
        return None  # inherited methods would be read from this file, or not at all
    home = _home_with(module, other, cls)
    return (home, cls.name, other.path) if home is not None else None


def _home_with(module: ModuleInfo, other: ModuleInfo, cls: ast.ClassDef, extra: tuple[ast.ClassDef, ...] = ()) -> ModuleInfo | None:
    """This file with ``cls`` (a class of ``other``) added, to read the class as if it were here;
    ``extra``: more classes of ``other`` added with it (which ``cls`` may name)."""
    classes = (cls, *extra)
    if any(c.name in module.classes or any(not _plain_module_base(other, b) for b in c.bases) or c.keywords for c in classes):
        return None  # inherited methods would be read from this file, or not at all
    names = frozenset(c.name for c in classes)
    borrowed: dict[str, str] = {}
    for c in classes:
        free = _free_names(module, other, c, names)
        if free is None:
            return None
        borrowed.update(free)
    cache = module.__dict__.setdefault("_npufuse_norm_homes", {})
    key = tuple(id(c) for c in classes) if extra else id(cls)
    if key not in cache:
        from dataclasses import replace

        from npufuse.scan import repo_facts

        own = {id(n) for c in classes for n in ast.walk(c)}
        scopes = [sc for sc in other.scopes if id(sc.node) in own]
        for sc in scopes:
            # the text a scope's readers cache on it is read now, from its own file (the view's
            # source is this file's)
            S.scope_text(other, sc)
            R._root_lines(other, sc)
            if getattr(sc.node, "name", "") == "forward":
                R.scope_results(other, sc)  # the rms_norm verdict on the forward, in its own file
        home = replace(module, aliases={**borrowed, **module.aliases}, classes={**module.classes, **{c.name: c for c in classes}},
                       scopes=[*module.scopes, *scopes])
        home.__dict__["_npufuse_borrowed"] = frozenset(borrowed)
        root = repo_facts.repo_root(module)
        if root is not None:
            repo_facts.attach_root(home, root)
        cache[key] = home
    return cache[key]


def _factory_norm(module: ModuleInfo, call: ast.Call, ctx: S.Ctx, value: ast.Call) -> NormCall | None:
    """``self.norm = create_norm(cfg.norm_type, dim, eps=eps)`` (torchtitan and its copies): a
    function of this file or of another file of the repository whose returns construct norm modules
    chosen by its arguments. When exactly one class of the factory's file it constructs reads as an
    RMSNorm (in that file), the fused code runs where the attribute's run-time type is that class,
    and the original statements otherwise (a LayerNorm, a kernel-backed RMSNorm, anything else)."""
    f = call.func
    func = value.func
    if not (isinstance(f, ast.Attribute) and isinstance(func, ast.Name)):
        return None
    if func.id in module.functions:
        other, fn, modname, where = module, module.functions[func.id], "", ""
    else:
        found = _foreign_definition(module, func.id)
        target = module.aliases.get(func.id)
        if found is None or not isinstance(found[1], ast.FunctionDef) or target is None:
            return None  # (a relative import: the class's module name is not known here)
        other, fn = found
        modname, where = target.rsplit(".", 1)[0], f" (from {other.path})"
    returns = [n.value for n in _own_nodes(fn) if isinstance(n, ast.Return)]
    # the classes of the factory's file it constructs; whatever else it returns (a library module, a
    # kernel wrapper) fails the run-time type check and runs the original call
    built = sorted({v.func.id for v in returns if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in other.classes})
    read: list[tuple[str, ModuleInfo, NormCall, str | None]] = []
    for cname in built[:4]:
        home = module if other is module else _home_with(module, other, other.classes[cname])
        nc = _class_norm_call(home, call, ctx, cname, where) if home is not None else None
        if nc is not None and nc.kind != "not_rms" and home is not None:
            read.append((cname, home, nc, None))
    if not built:
        read = _s40_registry_built(module, call, ctx, other, fn, returns, where)
    if len(read) != 1:
        return None  # none read as an RMSNorm, or several (each would need its own fused code)
    cname, home, nc, class_module = read[0]
    mod = f"self.{f.attr}"
    if class_module is not None:
        modname = class_module  # s40: a class the factory's file imports from a third file
    guard = (f"type({mod}) is {cname}" if other is module and class_module is None
             else f'type({mod}).__qualname__ == "{cname}" and type({mod}).__module__ == "{modname}"')
    nc.conditions = [*nc.conditions, guard]
    nc.home = home if home is not module else None
    nc.cls = f"{cname} (returned by {func.id}(...){where})"
    return nc


def _s40_registry_built(module: ModuleInfo, call: ast.Call, ctx: S.Ctx, other: ModuleInfo, fn: ast.FunctionDef,
                        returns: list[ast.expr], where: str) -> list[tuple[str, ModuleInfo, NormCall, str | None]]:
    """s40 (mosaic-gpt's ``build_norm(cfg.norm.type, d)`` returning ``NORM_REGISTRY[norm_type](d, eps=eps)``): the
    classes a factory builds through a registry keyed by a configuration string (``bound_callee.choices`` on each
    returned construction's callee), each a class the factory's file imports absolutely from a file of the
    repository; those read as an RMSNorm there, with the module the guard tests (the import's), else []."""
    from npufuse.scan import bound_callee

    fscope = next((sc for sc in other.scopes if sc.node is fn), None)
    if fscope is None:
        return []
    read: list[tuple[str, ModuleInfo, NormCall, str | None]] = []
    seen: set[str] = set()
    for v in returns:
        if not (isinstance(v, ast.Call) and isinstance(v.func, ast.Subscript)):
            continue
        choice = bound_callee.choices(other, fscope, v.func)
        for m in choice.members if choice is not None else ():
            if m.home is not other or not isinstance(m.node, ast.Name) or m.instance or m.partial is not None \
                    or m.name in seen or "." not in m.name or len(seen) >= 4:
                continue
            seen.add(m.name)
            found = _foreign_definition(other, m.node.id)
            if found is None or not isinstance(found[1], ast.ClassDef):
                continue
            cls_file, cls = found
            home = _home_with(module, cls_file, cls)
            nc = _class_norm_call(home, call, ctx, cls.name, where) if home is not None else None
            if nc is not None and nc.kind != "not_rms" and home is not None:
                read.append((cls.name, home, nc, m.name.rsplit(".", 1)[0]))
    return read


def _factory_class_norm(module: ModuleInfo, scope: Scope, call: ast.Call, value: ast.Call) -> NormCall | None:
    """``NORM = get_norm_class(); self.norm = NORM(d, eps)`` or ``get_norm_class()(d, eps)`` (Smol-LM, s39):
    a function of this or another file of the repository whose every return is a class name -- a class of
    its file, or one it imports in its body (``try: from flash_attn... import RMSNorm as A; return A``
    ``except ImportError: from torch.nn import RMSNorm as B; return B``). Where nn.RMSNorm is among them
    the fused code runs where the module's forward is nn.RMSNorm's (checked at run time: what runs on an
    NPU, where CUDA-only kernels fail to import), and the original call for any other class."""
    f, func = call.func, value.func
    if not isinstance(f, ast.Attribute) or scope.class_name is None:
        return None
    if isinstance(func, ast.Name) and func.id not in module.classes:
        init = S.method(module, scope.class_name, "__init__")
        binds = [n for n in ast.walk(init) if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == func.id for t in n.targets)] \
            if init is not None else []
        if len(binds) != 1 or len(binds[0].targets) != 1:
            return None
        func = binds[0].value
    if not (isinstance(func, ast.Call) and isinstance(func.func, ast.Name) and not func.args and not func.keywords):
        return None
    name = func.func.id
    if name in module.functions:
        other, fn = module, module.functions[name]
    else:
        found = _foreign_definition(module, name)
        if found is None or not isinstance(found[1], ast.FunctionDef):
            return None
        other, fn = found
    returns = [n.value for n in _own_nodes(fn) if isinstance(n, ast.Return)]
    if not returns or not all(isinstance(v, ast.Name) for v in returns):
        return None  # a factory returning instances or expressions: _factory_norm's
    imported = {a.asname or a.name: f"{n.module}.{a.name}" for n in _own_nodes(fn) if isinstance(n, ast.ImportFrom) and n.module and not n.level
                for a in n.names}
    arms = [imported.get(v.id) or other.aliases.get(v.id) or (v.id if v.id in other.classes else None) for v in returns]  # type: ignore[attr-defined]
    if any(a is None for a in arms):
        return None  # a name the factory rebinds otherwise: its class is not known here
    from npufuse.scan import canonical

    if not any(canonical.SYNONYMS.get(a, a) in ("torch.nn.RMSNorm", "torch.nn.modules.normalization.RMSNorm") for a in arms):
        return None
    mod = f"self.{f.attr}"
    T = S.torch_name(module) or "torch"
    return NormCall(call, f.attr, "library", cls=f"nn.RMSNorm (one of {', '.join(dict.fromkeys(arms))} returned by {name}())",
                    gamma=f"{mod}.weight", eps=eps_or_default(f"{mod}.eps", T),
                    conditions=[f"type({mod}).forward is {T}.nn.RMSNorm.forward", f"{mod}.weight is not None"])


def _mean_subtracted(module: ModuleInfo, cls: str) -> str | None:
    """The rms_norm detector's reason when the forward of ``cls`` subtracts the mean (a LayerNorm),
    as found in the class's own file (:func:`_repo_norm_class` reads it there first)."""
    fwd = S.method(module, cls, "forward")
    sc = S.scope_of(module, fwd) if fwd is not None else None
    results = sc.__dict__.get("_npufuse_rms") if sc is not None else None
    for r in results or []:
        if r.miss is not None and "mean subtracted" in r.miss.reason:
            return r.miss.reason
    return None


def _default_class(module: ModuleInfo, class_name: str | None, name: str) -> ast.expr | None:
    """The class a constructor parameter ``name`` of ``__init__`` holds unless the caller passes
    another: its default (``norm_layer=RMSNorm``), or the fallback of its one rebinding
    ``norm_layer = norm_layer or RMSNorm`` (default None); None when it is rebound otherwise."""
    init = S.method(module, class_name, "__init__")
    params = S.init_params(module, class_name)
    if init is None or name not in params:
        return None
    value = params[name]
    rebinds = [st for st in S._stmts_in(init.body) if name in S.names_written(st)]
    if rebinds:
        st = rebinds[0]
        if not (len(rebinds) == 1 and isinstance(st, ast.Assign) and isinstance(st.value, ast.BoolOp)
                and isinstance(st.value.op, ast.Or) and len(st.value.values) == 2
                and isinstance(st.value.values[0], ast.Name) and st.value.values[0].id == name
                and (value is None or (isinstance(value, ast.Constant) and value.value is None))):
            return None
        value = st.value.values[1]
    return value if isinstance(value, (ast.Name, ast.Attribute)) and dotted(value) else None


def _default_class_norm(module: ModuleInfo, scope: Scope, call: ast.Call, ctx: S.Ctx, value: ast.Call) -> NormCall | None:
    """``self.norm = norm_layer(dim)`` with ``norm_layer`` a constructor parameter defaulting to a
    class (timm / lucidrains blocks, ``norm_klass=RMSNorm``): the caller may pass another class, so
    the fused code runs where the attribute's run-time type is the default one, read as such; a
    LayerNorm default is a near miss."""
    f = call.func
    if not (isinstance(f, ast.Attribute) and isinstance(value.func, ast.Name)):
        return None
    default = _default_class(module, scope.class_name, value.func.id)
    if default is None:
        return _passed_class_norm(module, scope, call, ctx, value)
    mod = f"self.{f.attr}"
    T = S.torch_name(module) or "torch"
    canon = module.canonical(default) or ""
    name = dotted(default) or ""
    if canon in _LAYER_NORMS:
        # s50: an RMS norm class the repository passes for the parameter, under a run-time type check
        passed = _add_rms_norm_s50m.passed_rms_norm(module, call, ctx, scope.class_name or "", value.func.id, f.attr, mod, T, _class_norm_call,
                                                    _home_with, NormCall, eps_or_default)
        if passed is not None:
            return passed
        return NormCall(call, f.attr, "not_rms", reason=f"norm is not RMSNorm by default ({name}: mean subtracted; "
                                                        f"`{value.func.id}` is a constructor parameter)")
    if canon in ("torch.nn.RMSNorm", "torch.nn.modules.normalization.RMSNorm"):
        return NormCall(call, f.attr, "library", cls=name, gamma=f"{mod}.weight", eps=eps_or_default(f"{mod}.eps", T),
                        conditions=[f"type({mod}) is {name}", f"{mod}.weight is not None"])
    if name in module.classes:
        nc = _class_norm_call(module, call, ctx, name)
    elif isinstance(default, ast.Name) and (foreign := _repo_norm_class(module, default)) is not None:
        home, real, rel = foreign
        nc = _class_norm_call(home, call, ctx, real, f" (from {rel})")
        if nc is not None and nc.kind != "not_rms":
            nc.home = home
    else:
        return None
    if nc is None or nc.kind == "not_rms":
        return None  # another class may be passed: a refusal of the default says little
    nc.conditions = [*nc.conditions, f"type({mod}) is {name}"]
    nc.cls = f"{nc.cls} (default of `{value.func.id}`)"
    return nc


# -- s35: a norm class the caller passes (``Block(d, norm_class)``, no default) ---------------------------
# ai-algorithms' dynamic_tanh ``Block(n_embd, n_head, norm_class)`` built with RMSNorm, LayerNorm or DyT;
# gpt-neox's ``Norm(norm_class, hidden_size, eps)``, fairseq's / unilm's kmeans ``PreNorm(norm_class, dim,
# fn)``, VAR / HART / 1d-tokenizer blocks taking ``norm_layer``: which class runs is a run-time fact. The
# file's own RMSNorm class (or the one it imports from another file of the repository), when exactly one
# reads as such, is fused where the attribute's run-time type is exactly it; any other class passed runs
# the original statements.

_NORM_CLASS_TEXT = re.compile(r"rsqrt|rms_norm|\bsqrt\b|normalize|\.norm\(")


def _passed_class_norm(module: ModuleInfo, scope: Scope, call: ast.Call, ctx: S.Ctx, value: ast.Call) -> NormCall | None:
    """``self.norm = norm_cls(d)`` with ``norm_cls`` a constructor parameter without a default that
    ``__init__`` never rebinds: the one class of this file (or imported into it from the repository)
    that reads as an RMSNorm, under a run-time type check; None when there is none or several."""
    f = call.func
    assert isinstance(f, ast.Attribute) and isinstance(value.func, ast.Name)
    name = value.func.id
    init = S.method(module, scope.class_name, "__init__")
    params = S.init_params(module, scope.class_name)
    if init is None or name not in params or params[name] is not None \
            or any(name in S.names_written(st) for st in S._stmts_in(init.body)):
        return None
    found: list[tuple[str, NormCall]] = []
    lines = S.module_lines(module)
    for cname, cdef in module.classes.items():
        if cname == scope.class_name or S.method(module, cname, "forward") is None:
            continue
        if not _NORM_CLASS_TEXT.search("".join(lines[cdef.lineno - 1 : cdef.end_lineno or cdef.lineno])):
            continue  # the cheap test first: a norm's forward takes a root or a norm
        nc = _class_norm_call(module, call, ctx, cname)
        if nc is not None and nc.kind != "not_rms":
            found.append((cname, nc))
    for local, full in module.aliases.items():
        if len(found) > 1:
            break
        if local in module.classes or not _RMS_NAME.search(local) or "." not in full:
            continue  # another file's class is read only when it is imported here under an RMSNorm name
        foreign = _repo_norm_class(module, ast.Name(local, ast.Load()))
        if foreign is None:
            continue
        home, real, rel = foreign
        nc = _class_norm_call(home, call, ctx, real, f" (from {rel})")
        if nc is not None and nc.kind != "not_rms":
            nc.home = home
            found.append((local, nc))
    if len(found) != 1:
        return None
    cname, nc = found[0]
    nc.conditions = [*nc.conditions, f"type(self.{f.attr}) is {cname}"]
    nc.cls = f"{nc.cls} (passed as `{name}`)"
    return nc


# -- s37: a norm attribute that a base class of another module builds ----------------------------------
# VisionLLaMA's ``class RBlockRMSNorm(Block)`` (timm's Block): ``__init__(..., norm_layer=RMSNorm)`` hands
# the class to ``super().__init__``, whose ``self.norm2 = norm_layer(dim)`` npufuse cannot read; subclasses
# of Hugging Face decoder layers, of repository blocks of another file alike. What the attribute holds is
# a run-time fact: the classes the subclass chain hands to its base's ``__init__`` (an argument, or the
# default of a parameter handed on) are the candidates, and the one that reads as an RMSNorm is fused
# where the attribute's run-time type is exactly it; any other module there runs the original statements.

_NORM_ATTR = re.compile(r"norm|(^|_)ln(_|\d|$)", re.I)


def _base_built_chain(module: ModuleInfo, class_name: str | None, attr: str) -> list[str] | None:
    """The classes of this file from ``class_name`` up its single-base chain, when none of their
    ``__init__`` assigns ``self.<attr>`` and the chain ends in a base of another module (not
    ``nn.Module``): that base builds it. None otherwise."""
    chain: list[str] = []
    c = class_name
    while c is not None and c in module.classes and c not in chain and len(chain) < 8:
        if attr in S.init_assignments(module, c):
            return None
        chain.append(c)
        bases = module.classes[c].bases
        if len(bases) != 1:
            return None  # several bases: which one builds the attribute is not read
        base = bases[0]
        if isinstance(base, ast.Name) and base.id in module.classes:
            c = base.id
            continue
        if _plain_module_base(module, base) or not dotted(base):
            return None  # nn.Module sets no norm: the attribute is assigned elsewhere or never
        return chain
    return None


def _handed_to_base(module: ModuleInfo, class_name: str) -> list[ast.expr]:
    """What ``__init__`` of ``class_name`` hands to its base's ``__init__`` (``super().__init__(...)``,
    ``super(C, self).__init__(...)``, ``Base.__init__(self, ...)``): each argument, and for an argument
    that is a parameter of ``__init__``, its default class (:func:`_default_class`)."""
    init = S.method(module, class_name, "__init__")
    if init is None:
        return []
    out: list[ast.expr] = []
    for n in _own_nodes(init):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "__init__"):
            continue
        recv = n.func.value
        if not ((isinstance(recv, ast.Call) and isinstance(recv.func, ast.Name) and recv.func.id == "super")
                or isinstance(recv, (ast.Name, ast.Attribute))):
            continue
        for a in (*n.args, *(k.value for k in n.keywords)):
            a = a.value if isinstance(a, ast.Starred) else a
            if isinstance(a, ast.Name) and a.id in S.init_params(module, class_name):
                default = _default_class(module, class_name, a.id)
                if default is not None:
                    out.append(default)
            elif isinstance(a, (ast.Name, ast.Attribute)) and dotted(a):
                out.append(a)
    return out


def _base_built_norm(module: ModuleInfo, scope: Scope, call: ast.Call, ctx: S.Ctx, attr: str) -> NormCall | None:
    """``self.<attr>(s)`` where a base class of another module builds the attribute (see above): the one
    RMSNorm class the subclass chain names, fused under a check of the attribute's run-time type."""
    # the base builds many attributes and which one it builds from the handed class is in code npufuse
    # does not read: attributes named as norms are tried (their run-time type decides), not dropouts
    chain = _base_built_chain(module, scope.class_name, attr) if _NORM_ATTR.search(attr) else None
    if chain is None:
        return None
    mod = f"self.{attr}"
    T = S.torch_name(module)
    found: dict[str, NormCall] = {}
    layer_norms: list[str] = []
    seen: set[str] = set()
    for c in chain:
        for node in _handed_to_base(module, c):
            name = dotted(node) or ""
            if name in seen or name == "self" or name.startswith("self."):
                continue
            seen.add(name)
            canon = module.canonical(node) or ""
            if canon in _LAYER_NORMS:
                layer_norms.append(name)
                continue
            if canon in ("torch.nn.RMSNorm", "torch.nn.modules.normalization.RMSNorm") and T is not None:
                found[canon] = NormCall(call, attr, "library", cls=name, gamma=f"{mod}.weight", eps=eps_or_default(f"{mod}.eps", T),
                                        conditions=[f"type({mod}) is {name}", f"{mod}.weight is not None"])
                continue
            if not isinstance(node, ast.Name) or _class_named(module, node.id) is None:
                continue
            nc = _member_ctor_norm(module, call, ctx, module, ast.Call(node, [], []), mod, "")
            if nc is not None and nc.kind != "not_rms":
                found[name] = nc
    base = dotted(module.classes[chain[-1]].bases[0])
    if not found and layer_norms:
        return NormCall(call, attr, "not_rms", cls=layer_norms[0],
                        reason=f"norm handed to the base is not RMSNorm ({layer_norms[0]}: mean subtracted; handed by {chain[0]}.__init__ to the "
                               f"base class `{base}`, whose code builds `{mod}`)")
    if not found and _HF_LLAMA_FAMILY.match(module.canonical(module.classes[chain[-1]].bases[0]) or ""):
        # a Hugging Face layer builds it (``class MoEDecoderLayer(LlamaDecoderLayer)``): its own norm class
        return _hf_runtime_norm(module, call, mod, attr, f"built by the transformers base class `{base}`")
    if len(found) != 1:
        return None
    nc = next(iter(found.values()))
    nc.cls = f"{nc.cls} (handed to the base class `{base}`, which builds `{mod}`)"
    return nc


# -- s37: Hugging Face norms reached where no class of the file says what they are ---------------------
# MoE-LLaVA's ``def MoELlamaDecoderLayer_forward(self): def forward(hidden_states, ...): ... return forward``
# installed as ``m.forward = MoELlamaDecoderLayer_forward(m)`` on transformers' decoder layers; MindSpeed-MM's
# ``Qwen3MoeDecoderLayer.forward = internvl_moe_decoder_layer_forward``, msmodeling's ``MethodType(fn, layer)``;
# subclasses of transformers' decoder layers that keep the base's norms (LLaMA-MoE, VeOmni). The module
# ``self.<norm>`` holds is transformers' own class, known only at run time: fused where its type is one of
# transformers' Llama-style RMSNorm classes (one forward: fp32 statistics, ``weight * x.to(input_dtype)``,
# eps in ``variance_epsilon``), the original call for anything else.

# what a file imports from the transformers families whose norm is the Llama-style class: the model
# package or modeling module, or one of its classes (not a logger or a helper borrowed from it)
# s40: the Qwen vision-language families (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe: robot-policy and VLM
# repositories subclass their decoder layers, lerobot's wall_x) build their decoder norms from classes whose
# ``__init__`` and ``forward`` are LlamaRMSNorm's, token for token (transformers 5.25, compared as ASTs; 4.x
# built them from Qwen2RMSNorm)
_HF_LLAMA_FAMILY = re.compile(r"transformers\.(?:models\.(?:llama|mistral|mixtral|qwen2|qwen2_moe|qwen3|qwen3_moe|qwen2_vl|qwen2_5_vl|qwen3_vl|qwen3_vl_moe)"
                              r"(?:\.modeling_\w+)?(?:\.(?:Llama|Mistral|Mixtral|Qwen2|Qwen3)\w*)?|(?:Llama|Mistral|Mixtral|Qwen2|Qwen3)\w*)$")


def _hf_runtime_norm(module: ModuleInfo, call: ast.Call, mod: str, attr: str, origin: str) -> NormCall | None:
    """The external-norm reading of ``mod`` under a run-time check that it is exactly one of transformers'
    Llama-style RMSNorm classes."""
    from npufuse.patterns._library_norm import _HF_LLAMA_NORMS

    if S.torch_name(module) is None:
        return None
    names = ", ".join(f'"{n}"' for n in sorted(_HF_LLAMA_NORMS))
    check = f'type({mod}).__name__ in ({names}) and type({mod}).__module__.startswith("transformers.")'
    return NormCall(call, attr, "external", cls=f"a transformers Llama-style RMSNorm at run time ({origin})",
                    conditions=[check], mod=mod if mod != f"self.{attr}" else "")


def _installed_forward(module: ModuleInfo, scope: Scope, family: re.Pattern | None = None) -> bool:
    """A function of no class whose ``self`` is its first parameter or the first parameter of the
    module-level function whose own nested def it is, never rebound, in a file importing a transformers
    model family whose norm is the Llama-style class."""
    fn = scope.node
    if scope.class_name or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) \
            or not any((family or _HF_LLAMA_FAMILY).match(v) for v in module.aliases.values()):
        return False
    own = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    if own[:1] != ["self"]:
        outer = module.functions.get(scope.qualname.split(".")[0])
        if "self" in own or outer is None or outer is fn or [a.arg for a in (*outer.args.posonlyargs, *outer.args.args)][:1] != ["self"]:
            return False
        if fn not in outer.body:
            return False  # the closure must be the outer function's own def (not deeper)
    return "self" not in scope.assignments  # rebound: not the module the forward is installed on


def _installed_forward_norm(module: ModuleInfo, scope: Scope, call: ast.Call, attr: str) -> NormCall | None:
    """``self.<norm>(s)`` in a function of no class of this file whose ``self`` is a parameter of it or
    of the module-level function enclosing it (a forward installed on another module's layer), in a
    file that imports transformers: the run-time check of :func:`_hf_runtime_norm`."""
    if not _NORM_ATTR.search(attr):
        return None
    if not _installed_forward(module, scope):
        return _add_rms_norm_s48h.gemma_installed_norm(module, scope, call, attr, _installed_forward, NormCall)  # s48
    return _hf_runtime_norm(module, call, f"self.{attr}", attr, f"`self` of `{scope.qualname}`, a forward installed on another module")


# -- s37: a norm module called with more than its input (Amphion's ``LlamaAdaptiveRMSNorm(h, cond_embedding=c)``,
# lucidrains' / stable-audio's ``AdaptiveRMSNorm(x, cond=c)``): its class's forward is read with each extra
# argument bound to the call's expression, for a near miss that says what the call does (it was silent): a gain
# computed from them (an adaptive norm), or arguments whose other uses the reading does not prove harmless.

def _conditioned_norm(module: ModuleInfo, scope: Scope, call: ast.Call, ctx: S.Ctx) -> NormCall | None:
    """``self.<attr>(s, *more, **kw)`` with ``__init__`` building the attribute as a class of this file
    whose forward names every keyword and takes as many positionals: read by :func:`_class_norm_call`
    with them bound; a near miss (never a candidate) when it reads as an RMSNorm."""
    f = call.func
    assert isinstance(f, ast.Attribute)
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None
    value = S.init_assignments(module, scope.class_name).get(f.attr)
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in module.classes):
        return None
    fwd = S.method(module, value.func.id, "forward")
    if fwd is None or fwd.args.vararg or fwd.args.kwarg:
        return None
    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    if len(call.args) > len(params) - 1 or any(k.arg not in params[2:] for k in call.keywords):
        return None
    extra = {params[i + 1]: a for i, a in enumerate(call.args) if i > 0}
    extra.update({k.arg: k.value for k in call.keywords if k.arg is not None})
    nc = _class_norm_call(module, call, ctx, value.func.id, extra=extra)
    if nc is None or nc.kind == "not_rms" or (nc.test_only and set(extra) <= nc.test_only):
        return nc  # s50: arguments only the forward's arm tests read, settled by the fused code's conditions
    gain = ""
    if nc.kind == "rms" and nc.match is not None and nc.match.weights:
        try:
            gain = R.render_factor(module, R.analyse_weight(module, nc.match.weights[0]), None)
        except (R.Miss, R.NoMatch):
            gain = "?"
    used = [k for k, v in extra.items() if gain == "?" or S.source_of(module, v) in gain]
    if used:
        # an adaptive norm: its gain is computed from the call's other arguments (one per sample), which
        # npu_add_rms_norm's gamma (one value per feature) is not
        return NormCall(call, f.attr, "not_rms", cls=value.func.id,
                        reason=f"norm {value.func.id} scales by a gain computed from the call's `{'`, `'.join(used)}` (an adaptive "
                               "norm: a gain per call, not npu_add_rms_norm's per-feature gamma; npufuse does not apply it "
                               "after the fused op)")
    # the reading does not prove the other arguments unused elsewhere in the forward (a mask applied to the
    # input before the statistic, under a test or not, was read past): no candidate, a near miss saying why
    names = "`, `".join(extra)
    return NormCall(call, f.attr, "not_rms", cls=value.func.id,
                    reason=f"norm {value.func.id} is called with more than its input (`{names}`): npufuse does not follow what "
                           "its forward does with them (a mask or a scale of the input would change the statistic)")


def _own_nodes(fn: ast.FunctionDef) -> Iterator[ast.AST]:
    """The nodes of ``fn``'s body outside nested functions, classes and lambdas."""
    todo: list[ast.AST] = list(fn.body)
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(n))


def _plain_module_base(module: ModuleInfo, base: ast.expr) -> bool:
    return (module.canonical(base) or "") in ("torch.nn.Module", "torch.nn.modules.module.Module")


def _norm_call(module: ModuleInfo, scope: Scope, call: ast.Call, ctx: S.Ctx) -> NormCall | None:
    """What the norm call ``self.<attr>(x)`` / ``norm(x)`` / ``F.rms_norm(x, ...)`` on the sum is,
    judged from ``__init__``, the class's or the function's own code; for ``self.<attr>`` whose class builds
    it as one of several modules, every one of them (:func:`_s40_config_chosen_norm`)."""
    nc = _s40_config_chosen_norm(module, scope, call, ctx, _norm_call_read(module, scope, call, ctx))
    optional = module.__dict__.get("_s43_helper_tests", {}).get(id(call))
    if optional is not None and nc is not None and nc.kind != "not_rms":
        # s43: ``self._norm(self.ln2, x)`` returns x where the module is None: the fused code runs where it is not
        nc.conditions = [optional, *nc.conditions]
    return nc


def _norm_call_read(module: ModuleInfo, scope: Scope, call: ast.Call, ctx: S.Ctx) -> NormCall | None:
    """:func:`_norm_call` as read from one construction of the module (the last in ``__init__``)."""
    from npufuse.scan import canonical

    f = call.func
    if canonical.api(module, f) == "torch.nn.functional.rms_norm":
        return _functional_norm(module, call, "F.rms_norm")
    if isinstance(f, ast.Name):
        # lucidrains: ``for attn_norm, attn, ff_norm, ff in self.layers:``: the construction at the
        # name's position of every element, read in ``__init__`` (s32)
        found = _unpacked_ctor(module, scope, f.id) if len(call.args) == 1 and not call.keywords else None
        if found is not None:
            file, ctor, lst, handed = found
            where = f" (from {file.path})" if file is not module else ""
            nc = _norm_of_ctor(module, call, ctx, file, ctor, f.id, where, f"unpacked from `{lst}`", on_instance=handed)
            if nc is not None:
                return nc
            if "norm" in f.id.lower():
                text = ast.unparse(ctor)
                return NormCall(call, f.id, "not_rms", cls=f.id,
                                reason=f"`{f.id}` is unpacked from `{lst}` in a loop, built as `{text[:80]}`{where}: npufuse does not "
                                       "read that construction as a norm module whose forward it can follow")
        unpacked = _loop_unpacked(scope, f.id)
        if unpacked is not None:
            if "norm" in f.id.lower():
                # a near miss saying so (the name only picks what to report; which module it is stays unknown)
                return NormCall(call, f.id, "not_rms", cls=f.id,
                                reason=f"`{f.id}` is unpacked from `{unpacked}` in a loop: npufuse could not read which "
                                       "module that position of the list holds (each element a list of the same constructions in `__init__`)")
        passed = _s42_parameter_norm(module, scope, call, ctx)
        if passed is not None:
            return passed
        found = _function_norm(module, call, ctx)
        if found is None and isinstance(module.helper(f.id), ast.FunctionDef) and S.definition(ctx, f.id) is None:
            # s47: ``norm(x, use_rms=flag)``, a helper choosing F.rms_norm or another norm by that flag
            found = _add_rms_norm_s47sweep.flagged_function_norm(module, scope, call, module.helper(f.id), _functional_norm,
                                                                 S.source_of, canonical.api,
                                                                 lambda why: NormCall(call, f.id, "not_rms", reason=why, cls=f.id))
        return found
    if isinstance(f, ast.Attribute) and not (isinstance(f.value, ast.Name) and f.value.id == "self"):
        return _member_norm(module, scope, call, ctx)
    if isinstance(f, ast.Subscript):
        return _indexed_norm(module, scope, call, ctx)
    if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self"):
        return None
    if not call.args or isinstance(call.args[0], ast.Starred):
        return None
    wrapper = _dispatch_norm(module, scope, call, ctx)
    if wrapper is None and (len(call.args) != 1 or call.keywords):
        return _conditioned_norm(module, scope, call, ctx)
    if wrapper is not None or len(call.args) != 1 or call.keywords:
        return wrapper
    chosen_norm = _flag_chosen_local_norm(module, scope, call, ctx, f.attr)
    if chosen_norm is not None:
        return chosen_norm
    value = S.init_assignments(module, scope.class_name).get(f.attr)
    if isinstance(value, ast.Constant) and value.value is None:
        value = _s43_built_beside_none(module, scope.class_name, f.attr)  # s43: ``else: self.norm2 = None``
    if value is None and scope.class_name is None:
        return _installed_forward_norm(module, scope, call, f.attr)
    if value is None:
        return _base_built_norm(module, scope, call, ctx, f.attr)
    if isinstance(value, ast.IfExp):
        # ``RMSNorm(d) if config.use_norm else None`` (Gemma2): calling None fails in the original
        # too, so where the module is called it is the norm
        sides = [v for v in (value.body, value.orelse) if not (isinstance(v, ast.Constant) and v.value is None)]
        lib = [v for v in sides if isinstance(v, ast.Call) and (module.canonical(v.func) == "torch.nn.RMSNorm" or _is_rms_subclass(module, v))]
        if len(sides) == 2 and lib:
            # ``nn.RMSNorm(d) if cfg.rms else nn.LayerNorm(d)``: fused when nn.RMSNorm's forward is what runs
            mod = f"self.{f.attr}"
            T = S.torch_name(module) or "torch"
            return NormCall(call, f.attr, "library", cls="nn.RMSNorm", gamma=f"{mod}.weight",
                            eps=eps_or_default(f"{mod}.eps", T),
                            conditions=[f"type({mod}).forward is {T}.nn.RMSNorm.forward", f"{mod}.weight is not None"])
        if len(sides) == 2 and not lib:
            # ``RMSNorm(d) if cfg.rms else nn.LayerNorm(d)`` with RMSNorm a class of this or another file
            # of the repository: each side read, the fused code guarded on the run-time type of the one read
            return _norm_of_ctor(module, call, ctx, module, value, f"self.{f.attr}", "", f"built in {scope.class_name}.__init__")
        value = sides[0] if len(sides) == 1 else None
    if not isinstance(value, ast.Call):
        return None
    canon = module.canonical(value.func) or ""
    if canon in _LAYER_NORMS:
        short = canon.replace("torch.nn.", "nn.")
        hint = "; npu_add_layer_norm fuses add + LayerNorm (not an npufuse pattern yet)" if short == "nn.LayerNorm" else ""
        return NormCall(call, f.attr, "not_rms", reason=f"norm is not RMSNorm ({short}: mean subtracted){hint}")
    if canon in ("torch.nn.RMSNorm", "torch.nn.modules.normalization.RMSNorm"):
        lib = _library_gamma_eps(module, f"self.{f.attr}", value)
        if lib is None:
            return _s42_weightless_library_norm(module, call, f.attr, f"self.{f.attr}", value)
        return NormCall(call, f.attr, "library", cls="nn.RMSNorm", gamma=lib[0], eps=lib[1])
    cls = dotted(value.func) or ""
    from npufuse.patterns._library_norm import rms_subclass

    if rms_subclass(module, cls):
        # a subclass of nn.RMSNorm without its own forward: the instance's weight and eps
        mod = f"self.{f.attr}"
        T = S.torch_name(module) or "torch"
        return NormCall(call, f.attr, "library", cls=cls, gamma=f"{mod}.weight",
                        eps=eps_or_default(f"{mod}.eps", T),
                        conditions=[f"{mod}.weight is not None"])
    if cls in module.classes:
        return _s40_own_class_norm(module, call, ctx, cls, f.attr) or _s42_unread_kernel_norm(module, call, cls, f.attr)
    foreign = _repo_norm_class(module, value.func)
    if foreign is not None:
        # a class of another file of the repository, read there (s31): its verdict replaces the
        # assumption a name would give
        home, real, rel = foreign
        nc = _class_norm_call(home, call, ctx, real, f" (from {rel})")
        if nc is not None:
            nc.home = home if nc.kind != "not_rms" else None
            if nc.kind != "not_rms":
                # ``__init__`` may build the attribute otherwise on another path (LightningDiT: a
                # LayerNorm unless a flag is set; the last assignment is the one read): the fused
                # code runs where the attribute is an instance of exactly this class
                nc.conditions = [*nc.conditions, f"type(self.{f.attr}) is {S.source_of(module, value.func)}"]
            return nc
        layer_norm = _mean_subtracted(home, real)
        if layer_norm is not None:
            # read in its file, the forward subtracts the mean: no name makes it an RMSNorm
            return NormCall(call, f.attr, "not_rms", reason=f"norm is not RMSNorm ({real} (from {rel}): {layer_norm})", cls=real)
        # s43: the repository defines the class and its forward was read there without being proved an
        # RMSNorm (a zero-centred norm: (1 + weight) and the output's mean subtracted after the scaling):
        # its name is no evidence, so the HF semantics a name would let the fused code assume are not taken
        return NormCall(call, f.attr, "not_rms", cls=real,
                        reason=f"norm is not read as an RMSNorm ({real} (from {rel}): its forward, read in its own file, is not "
                               "x * rsqrt(mean(x^2) + eps) * weight as npu_rms_norm computes it; the class name is not evidence)")
    factory = _factory_norm(module, call, ctx, value)
    if factory is not None:
        return factory
    # s44: ``Factory.create("norm", cfg)``, the class picked from a string-keyed registry filled by decorators
    registered = _add_rms_norm_s44h.registry_created_norm(module, call, ctx, value, _home_with, _class_norm_call)
    if registered is not None:
        return registered
    returned = _factory_class_norm(module, scope, call, value)
    if returned is not None:
        return returned
    by_default = _default_class_norm(module, scope, call, ctx, value)
    if by_default is not None:
        return by_default
    from npufuse.patterns._library_norm import third_party_norm_class

    third_party = third_party_norm_class(module, value.func)
    if third_party is not None:
        # a model library's RMSNorm read from its source (torchtune's): its attributes, offset and
        # output dtype, under a run-time check of the class and its forward's spelling
        return NormCall(call, f.attr, "external", cls=third_party, third_party=third_party)
    aliased = _add_rms_norm_s47n.alias_norm_call(module, call, f.attr, value.func, NormCall)  # s47: ``LigerRMSNorm as LayerNorm``
    if aliased is not None:
        return aliased
    if _RMS_NAME.search(cls.split(".")[-1]):
        return _timm_norm(module, call, f.attr, value.func) or _s41_eps_outside(module, call, f.attr, [cls]) \
            or NormCall(call, f.attr, "external", cls=cls)
    chosen = _chosen_classes(module, scope.class_name, value.func)
    if chosen and all(_RMS_NAME.search(c.split(".")[-1]) and c not in module.classes for c in chosen):
        # nanotron: ``norm_class = TritonRMSNorm if config.fused else RMSNorm`` in __init__, both
        # defined elsewhere: the same assumptions as one external class (checked at run time)
        return _s41_eps_outside(module, call, f.attr, chosen) or NormCall(call, f.attr, "external", cls=" or ".join(chosen))
    return None


def _s41_eps_outside(module: ModuleInfo, call: ast.Call, attr: str, names: list[str]) -> NormCall | None:
    """s41 (fwdad41): a class of another file of the repository taken by its RMSNorm name (its code could not be
    read into this file: it reads a constant or a helper of its own file), whose forward adds eps to the rms outside
    the root or clamps the norm (rms_norm's reading, :func:`rms_norm.class_eps_outside_root`): the HF reading would
    hand its eps to npu_add_rms_norm inside the root, another function. Refused, as for a class read here."""
    for name in names:
        found = _foreign_definition(module, name)
        if found is None or not isinstance(found[1], ast.ClassDef):
            continue
        other, cdef = found
        why = R.class_eps_outside_root(other, cdef.name)
        if why is not None:
            return NormCall(call, attr, "not_rms", reason=f"norm {name} (from {other.path}:{cdef.lineno}) cannot be fused: {why}", cls=name)
    return None


def _s40_own_class_norm(module: ModuleInfo, call: ast.Call, ctx: S.Ctx, cls: str, attr: str) -> NormCall | None:
    """``self.<attr> = Cls(...)`` with ``class Cls`` in this file, read through its forward. s40 (InternViT, audit39's
    dubious): where the module also rebinds the name (``try: from apex.normalization import FusedRMSNorm;
    InternRMSNorm = FusedRMSNorm``), the instance may be of that other class, whose attributes differ (no
    ``variance_epsilon``): the fused code runs where the instance's class is exactly the one this file's ``class``
    statement makes (its qualname and module), the original call otherwise."""
    from npufuse.scan import bound_callee

    nc = _class_norm_call(module, call, ctx, cls)
    rebound = bound_callee.rebound_class(module, cls) if nc is not None and nc.kind != "not_rms" else None
    if rebound is not None and nc is not None:
        nc.conditions = [*nc.conditions, bound_callee.own_class_test(f"self.{attr}", cls)]
        nc.cls = f"{nc.cls} (the file also binds {rebound}: checked at run time)"
    return nc


# -- s40: timm's RMSNorm classes. The generic reading of an outside RMSNorm-named class (HF semantics under a
# run-time check of attribute names) passed on every timm class, whose forwards are not all that: RmsNorm up to
# timm 1.0.12 divides by the root of the unbiased variance (mean subtracted: timm issue #2380; 1.0.13 added
# ``_fast_norm`` with the mean-of-squares fix), RmsNorm2d / RmsNorm2dFp32 normalise dim 1 of NCHW input, and
# ``_fast_norm`` True takes apex or an autocast-dtype path. Read from timm/layers/norm.py and fast_norm.py at
# v1.0.12, v1.0.13 and main (2025): RmsNorm computes ``x * rsqrt(mean(x^2) + eps) * weight`` in x's dtype (the
# output promote(x, weight)); RmsNormFp32 (added after 1.0.16, never var-based) the same on x.float() and
# weight.float(), cast back to x's dtype.

_TIMM_OUT = {"timm.RmsNorm": "promote", "timm.RmsNormFp32": "input"}


def _timm_norm(module: ModuleInfo, call: ast.Call, attr: str, func: ast.expr) -> NormCall | None:
    """What ``self.<attr>`` built by ``func(...)`` is when ``func`` is a timm class: timm's RmsNorm /
    RmsNormFp32 (external kind, fused under a run-time check of the class and version read), a near
    miss for its other RMSNorm-named classes; None for a class timm does not define."""
    from npufuse.patterns._library_norm import library_origin

    origin = library_origin(module, func, "timm")
    if origin is None:
        return None
    if origin in _TIMM_OUT:
        return NormCall(call, attr, "external", cls=origin, timm=origin)
    what = ("normalises dim 1 (the channels of NCHW input), not the last dim that npu_add_rms_norm normalises"
            if "2d" in origin.lower() else "is not timm's RmsNorm or RmsNormFp32, the timm RMSNorm classes whose forward npufuse read")
    return NormCall(call, attr, "not_rms", cls=origin, reason=f"norm {origin} {what}")


def _timm_reading(m: NormCall, s_name: str, T: str) -> tuple[str, str, str, str, dict, Risk, str]:
    """gamma, eps, output dtype, run-time check, params, risk and note for timm's RmsNorm / RmsNormFp32."""
    mod = m.mod or f"self.{m.attr}"
    name = m.timm.split(".", 1)[1]
    promote = _TIMM_OUT[m.timm] == "promote"
    out_code = f"{T}.promote_types({s_name}.dtype, {mod}.weight.dtype)" if promote else f"{s_name}.dtype"
    # exactly timm's class; RmsNorm only from the version with ``_fast_norm`` (mean of squares) and with it
    # off; a weight (affine) over one trailing dim
    check = (f'type({mod}).__module__.split(".")[0] == "timm" and type({mod}).__name__ == "{name}"'
             + (f' and not getattr({mod}, "_fast_norm", True)' if name == "RmsNorm" else "")
             + f" and {mod}.weight is not None and len({mod}.normalized_shape) == 1")
    params = {"eps": f"{mod}.eps", "weight": f"{mod}.weight", "weight_offset": 0, "upcast": "none" if promote else "float32",
              "output_dtype": "promote(input, weight)" if promote else "input", "library_class": m.timm}
    semantics = ("x * rsqrt(mean(x^2) + eps) * weight in x's dtype (no upcast)" if promote
                 else "x.float() * rsqrt(mean(x^2) + eps) * weight.float(), cast back to x's dtype")
    risk = Risk("numerics", f"{m.timm} (library code, read from timm's source): {semantics}; npu_add_rms_norm keeps its "
                            "statistics in fp32 and applies the weight cast to the input's dtype (last-bit differences in "
                            "bf16/fp16). timm <= 1.0.12 (mean-centred variance) and timm's fast-norm mode keep timm's forward")
    note = (f"norm class {m.timm}: training keeps the module call; inference is fused where the module is exactly timm's "
            "class, in a version whose forward was read (checked at run time)")
    return f"{mod}.weight", f"{mod}.eps", out_code, check, params, risk, note


def _third_party_reading(m: NormCall, s_name: str, T: str) -> tuple[str, str, str, str, dict, Risk, str]:
    """gamma, eps, output dtype, run-time check, params, risk and note for a verified third-party
    RMSNorm (``_library_norm.THIRD_PARTY_RMS_NORMS``): the fused code runs where the module's class is
    exactly the one read and its forward one of the spellings read; each spelling gives its dtype."""
    from npufuse.patterns._library_norm import THIRD_PARTY_RMS_NORMS

    spec = THIRD_PARTY_RMS_NORMS[m.third_party]
    mod = m.mod or f"self.{m.attr}"
    w = f"{mod}.{spec.weight}"
    gamma = f"(1.0 + {w}.float())" if spec.offset else w
    # the forward's code names (then ``_norm``'s, after "|", where the class defines one), as the
    # construction swap computes them; a method without code (wrapped) gives () and no spelling matches
    code = lambda f: f'tuple(getattr(getattr(type({mod}).__dict__.get("{f}"), "__code__", None), "co_names", ()))'
    names = (f'({code("forward")} + ((("|",) + {code("_norm")}) if "_norm" in type({mod}).__dict__ else ()))'
             if any("|" in n for n, _ in spec.forms) else code("forward"))
    by_rule = {rule: tuple(n for n, r in spec.forms if r == rule) for _, rule in spec.forms}
    promote = f"{T}.promote_types({s_name}.dtype, {w}.dtype)"
    if set(by_rule) == {"input"}:
        out_code = f"{s_name}.dtype"
    elif set(by_rule) == {"promote"}:
        out_code = promote
    else:
        out_code = f"({promote} if {names} in {by_rule['promote']!r} else {s_name}.dtype)"
    forms = tuple(n for n, _ in spec.forms)
    check = (f"type({mod}).__module__ == {spec.runtime_module!r} and type({mod}).__name__ == {spec.name!r} "
             f"and {names} in {forms!r}")
    params = {"eps": f"{mod}.{spec.eps}", "weight": w, "weight_offset": spec.offset, "upcast": "float32",
              "output_dtype": "/".join(dict.fromkeys("promote(input, weight)" if r == "promote" else "input" for _, r in spec.forms)),
              "library_class": m.third_party}
    risk = Risk("numerics", f"{m.third_party} (library code, read from its source): {spec.semantics}; the fused op applies "
                            "the weight in fp32 and rounds once (last-bit differences in bf16/fp16)")
    note = (f"norm class {m.third_party} (a model library's): training keeps the module call; inference is fused where the "
            "module's class and its forward's spelling are the ones read (checked at run time)")
    return gamma, f"{mod}.{spec.eps}", out_code, check, params, risk, note


# -- s32: the norm of another layer object (a decoder loop unrolling its layers) ----------------------
# ``for layer in self.model.layers: ... h = residual + h; residual = h; h = layer.post_attention_layernorm(h)``
# (fiddler's and ktransformers' Ascend decoder loops, TriForce's ``self.layers[i]``): the add is in the
# runner's method, the norm a module of a layer object. The object's class is followed through
# ``__init__`` constructions (``self.model = Model(cfg)``, ``self.layers = nn.ModuleList([Layer(...) for
# ...])``), in this file or, for a class imported from another file of the repository, in that file;
# the layer class's ``__init__`` says what the norm attribute is. The fused code runs where the norm's
# run-time type is the class read (lists can change after ``__init__``; a flag may build another class).

_Owner = tuple[ModuleInfo, str]  # a class (its name) and the file defining it


def _class_named(file: ModuleInfo, name: str) -> _Owner | None:
    """The class ``name`` means in ``file``: one of its own, or one it imports from another file of the
    repository (read there)."""
    if name in file.classes:
        return file, name
    found = _foreign_definition(file, name)
    if found is not None and isinstance(found[1], ast.ClassDef):
        return found[0], found[1].name
    return None


def _attr_class(owner: _Owner, attr: str) -> _Owner | None:
    """The class of ``self.<attr>`` of ``owner``: its ``__init__`` builds it as ``Cls(...)``."""
    file, cls = owner
    value = S.init_assignments(file, cls).get(attr)
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
        return _class_named(file, value.func.id)
    return None


def _list_elements(owner: _Owner, attr: str) -> list[ast.expr] | None:
    """The element constructions of ``self.<attr>`` of ``owner`` when its ``__init__`` builds it as
    ``nn.ModuleList([X for ...])`` / ``nn.ModuleList(X for ...)`` / ``nn.ModuleList([X, Y])`` (``nn.Sequential(*...)``
    alike) or fills an empty list by ``append(X)``; None when it is built otherwise or changed by other means."""
    file, class_name = owner
    value = S.init_assignments(file, class_name).get(attr)
    if isinstance(value, ast.Call) and file.canonical(value.func) == "torch.nn.ModuleDict":  # s51: values of a ModuleDict
        return _add_rms_norm_s51m.dict_values(file, S.method(file, class_name, "__init__"), attr, value)
    if not (isinstance(value, ast.Call) and file.canonical(value.func) in ("torch.nn.ModuleList", "torch.nn.Sequential")
            and len(value.args) <= 1 and not value.keywords):
        return None
    elts: list[ast.expr] = []
    if value.args:
        arg = value.args[0]
        if isinstance(arg, ast.Starred):
            arg = arg.value
        if isinstance(arg, (ast.ListComp, ast.GeneratorExp)):
            elts = [arg.elt]
        elif isinstance(arg, (ast.List, ast.Tuple)):
            elts = list(arg.elts)  # ``nn.ModuleList([])``: filled below
        else:
            return None
    # ``self.layers = nn.ModuleList()`` then ``self.layers.append(X)`` in a loop of ``__init__``
    init = S.method(file, class_name, "__init__")
    for n in fast_walk(init) if init is not None else ():
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and dotted(n.func.value) == f"self.{attr}":
            if n.func.attr != "append" or len(n.args) != 1:
                return None  # extend / insert: not read
            elts.append(n.args[0])
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and dotted(n.value) == f"self.{attr}":
            return None
    return elts or None


def _list_element_class(owner: _Owner, attr: str) -> _Owner | None:
    """The class of every element of the layer list ``self.<attr>`` of ``owner`` (:func:`_list_elements`),
    when they are all constructions of one class."""
    elts = _list_elements(owner, attr)
    names = {e.func.id if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) else None for e in elts or ()}
    if len(names) != 1 or None in names:
        return None
    return _class_named(owner[0], names.pop())  # type: ignore[arg-type]


def _unpacked_ctor(module: ModuleInfo, scope: Scope, name: str) -> tuple[ModuleInfo, ast.expr, str, bool] | None:
    """lucidrains' layers: ``for attn_norm, attn, ff_norm, ff in self.layers:`` over a list whose every
    element is ``nn.ModuleList([RMSNorm(dim), Attention(...), RMSNorm(dim), FeedForward(...)])``: (the
    file, the construction at ``name``'s position, the list's expression) when every element builds the
    same thing there and ``name`` is bound nowhere else in the scope; last, whether the list's object has the class
    this file's callers hand a parameter (its norms' numbers then read on the instance)."""
    loops = [lp for lp in scope.nodes().get(ast.For, []) if name in {n.id for n in ast.walk(lp.target) if isinstance(n, ast.Name)}]  # type: ignore[attr-defined]
    if len(loops) != 1 or any(st is not loops[0] for st, _v in scope.assignments.get(name, [])):
        return None
    it, target = loops[0].iter, loops[0].target  # type: ignore[attr-defined]
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" and len(it.args) == 1 \
            and isinstance(target, ast.Tuple) and len(target.elts) == 2:
        it, target = it.args[0], target.elts[1]
    if not (isinstance(target, ast.Tuple) and isinstance(it, ast.Attribute)):
        return None
    pos = [k for k, e in enumerate(target.elts) if isinstance(e, ast.Name) and e.id == name]
    via: list[str] = []
    owner = _object_class(module, scope, it.value, via=via)
    elts = _list_elements(owner, it.attr) if owner is not None and len(pos) == 1 else None
    if not elts:
        return None
    built: set[str] = set()
    ctor: ast.expr | None = None
    for e in elts:
        if not (isinstance(e, ast.Call) and owner[0].canonical(e.func) in ("torch.nn.ModuleList", "torch.nn.Sequential")  # type: ignore[index]
                and len(e.args) == 1 and isinstance(e.args[0], (ast.List, ast.Tuple))
                and len(e.args[0].elts) == len(target.elts) and not any(isinstance(x, ast.Starred) for x in e.args[0].elts)):
            return None
        ctor = e.args[0].elts[pos[0]]
        built.add(ast.dump(ctor))
    if len(built) != 1 or ctor is None:
        return None
    return owner[0], ctor, ast.unparse(it), bool(via)  # type: ignore[index]


def _object_class(module: ModuleInfo, scope: Scope, node: ast.expr, depth: int = 0, via: list[str] | None = None) -> _Owner | None:
    """The class the object ``node`` is an instance of, followed from ``self`` through attributes built
    in ``__init__`` and elements of layer lists: ``self.model.layers[i]``, the name a ``for`` over such a
    list (``enumerate`` included) binds, ``layer = self.layers[i]``; a name must be bound once in the scope.
    ``via`` (s43 review) collects the parameters whose class was taken from this file's callers on the way."""
    if depth > 6:
        return None
    if isinstance(node, ast.Name) and node.id == "self":
        return (module, scope.class_name) if scope.class_name in module.classes else None
    if isinstance(node, ast.Attribute):
        owner = _object_class(module, scope, node.value, depth + 1, via)
        return _attr_class(owner, node.attr) if owner is not None else None
    if isinstance(node, ast.Subscript):
        idx = node.slice
        if not (isinstance(node.value, ast.Attribute) and _s42_plain_index(idx)):
            return None
        owner = _object_class(module, scope, node.value.value, depth + 1, via)
        return _list_element_class(owner, node.value.attr) if owner is not None else None
    if not isinstance(node, ast.Name):
        return None
    bound = scope.assignments.get(node.id, [])
    loops = [lp for lp in scope.nodes().get(ast.For, []) if node.id in {n.id for n in ast.walk(lp.target) if isinstance(n, ast.Name)}]  # type: ignore[attr-defined]
    args = scope.node.args if isinstance(scope.node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    params = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)} if args is not None else set()
    if node.id in params and not bound and not loops:
        handed = _s43_parameter_class(module, scope, node.id, depth)  # s43: the one class its callers hand it
        if handed is not None and via is not None:
            via.append(node.id)
        return handed
    if not loops and bound:
        built = _s43_built_class(module, scope, node.id, [v for _st, v in bound])
        if built is not None:
            return built  # s43: ``model = DeepSeek(cfg)`` (``model = torch.compile(model)`` keeps it)
    if len(bound) + len(loops) != 1 or node.id in params:
        return None
    if bound:
        value = bound[0][1]
        return _object_class(module, scope, value, depth + 1, via) if isinstance(value, (ast.Subscript, ast.Attribute)) else None
    loop = loops[0]
    it, target = loop.iter, loop.target  # type: ignore[attr-defined]
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" and len(it.args) == 1 and not it.keywords:
        if not (isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(target.elts[1], ast.Name)
                and target.elts[1].id == node.id):
            return None
        it = it.args[0]
    elif not (isinstance(target, ast.Name) and target.id == node.id):
        return None
    if isinstance(it, ast.Attribute):
        owner = _object_class(module, scope, it.value, depth + 1, via)
        return _list_element_class(owner, it.attr) if owner is not None else None
    return None


def _type_guard(module: ModuleInfo, mod: str, ctor: ast.expr, file: ModuleInfo) -> str:
    """The run-time check that ``mod`` is an instance of exactly the class ``ctor`` names in ``file``:
    ``type(m) is Cls`` where this file can name it, else its name and the file its forward comes from."""
    if file is module:
        return f"type({mod}) is {S.source_of(module, ctor)}"
    name = dotted(ctor) or ""
    return (f'type({mod}).__qualname__ == "{name}" and getattr(getattr(type({mod}).forward, "__code__", None), '
            f'"co_filename", "").replace("\\\\", "/").endswith("/{file.path}")')


def _own_method(module: ModuleInfo, scope: Scope, f: ast.Attribute) -> bool:
    """``cls.<name>`` / ``self.<name>`` where the enclosing class defines ``<name>`` as a method (a staticmethod or
    classmethod called on the class): a function, not a module held by the object."""
    if not (isinstance(f.value, ast.Name) and f.value.id in ("cls", "self") and scope.class_name):
        return False
    node = module.classes.get(scope.class_name)
    return node is not None and any(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) and b.name == f.attr for b in node.body)


def _member_norm(module: ModuleInfo, scope: Scope, call: ast.Call, ctx: S.Ctx) -> NormCall | None:
    """``<layer>.<attr>(s)``: a norm module of another object (see above)."""
    f = call.func
    assert isinstance(f, ast.Attribute)
    if len(call.args) != 1 or call.keywords or isinstance(call.args[0], ast.Starred):
        return None
    # s42: GPT-2's ``block.ln_2(x)`` names no "norm" anywhere in the scope: the attribute's own name counts too
    if "norm" not in S.scope_text(module, scope).lower() and not _NORM_ATTR.search(f.attr):
        return None
    root: ast.expr = f
    while isinstance(root, (ast.Attribute, ast.Subscript)):
        root = root.value
    if not isinstance(root, ast.Name) or root.id in module.aliases or root.id in module.classes or root.id in module.functions:
        return None  # a library function (``torch.linalg.norm``, ``np.linalg.norm``), not a module of an object
    via: list[str] = []
    owner = _object_class(module, scope, f.value, via=via)
    recv = S.source_of(module, f.value)
    if owner is None:
        if _own_method(module, scope, f):
            return None  # s43 (audit43, TorchRL's ``cls.angle_normalize(th + dth * dt)``): a function of the class
        hf = _add_rms_norm_s49l.hf_layer_norm(module, scope, call, _HF_LLAMA_FAMILY, _hf_runtime_norm, S.source_of)  # s49
        if hf is not None:
            return hf
        if "norm" in f.attr.lower():
            return NormCall(call, f.attr, "not_rms", cls=f.attr,
                            reason=f"`{recv}.{f.attr}` is a module of `{recv}`, whose class npufuse does not resolve (from "
                                   "`self` through `__init__` constructions and layer lists built from one class): what the "
                                   "norm is stays unknown")
        return None
    file, owner_cls = owner
    value = S.init_assignments(file, owner_cls).get(f.attr)
    where = f" (from {file.path})" if file is not module else ""
    return _norm_of_ctor(module, call, ctx, file, value, S.source_of(module, f), where, f"built in {owner_cls}.__init__",
                         on_instance=bool(via)) if value is not None else None


def _norm_of_ctor(module: ModuleInfo, call: ast.Call, ctx: S.Ctx, file: ModuleInfo, value: ast.expr, mod: str, where: str,
                  origin: str, on_instance: bool = False) -> NormCall | None:
    """What the module ``mod`` (called by ``call``) is, ``value`` (code of ``file``) building it; ``origin``
    says where, for reasons. ``on_instance``: ``value`` is only the construction this file's callers show (a
    caller elsewhere may hand a module of the same class built otherwise): its numbers are read on the instance."""
    # ``RMSNorm(d) if cfg.rms else nn.LayerNorm(d)``: each side read; the guard picks the one read
    # s42: an ``nn.Identity()`` side (``RMSNorm(d) if cfg.final_norm else nn.Identity()``) is no norm: the run-time
    # class test every reading below adds sends it to the original statements
    ctors = [v for v in ((value.body, value.orelse) if isinstance(value, ast.IfExp) else (value,))
             if not (isinstance(v, ast.Constant) and v.value is None) and not _s42_identity(file, v)]
    if not ctors or not all(isinstance(v, ast.Call) and dotted(v.func) for v in ctors):
        return None
    f = call.func
    attr = _callee_name(f)
    found: list[NormCall] = []
    for ctor in ctors:
        nc = _member_ctor_norm(module, call, ctx, file, ctor, mod, where, on_instance)  # type: ignore[arg-type]
        if nc is None:
            return None  # a side npufuse cannot read: which one runs decides nothing then
        found.append(nc)
    rms = [nc for nc in found if nc.kind != "not_rms"]
    if len(rms) > 1:
        return None
    if not rms:
        # s47: "is not RMSNorm" only where every side is one that is not (a side read as an RMSNorm it cannot fuse is one)
        head = "no module this choice builds can be fused" if any("cannot be fused" in nc.reason for nc in found) else "norm is not RMSNorm"
        return NormCall(call, attr, "not_rms", reason=f"{head} ({'; '.join(nc.reason for nc in found)}; `{mod}`, {origin}{where})")
    return rms[0]


def _member_ctor_norm(module: ModuleInfo, call: ast.Call, ctx: S.Ctx, file: ModuleInfo, ctor: ast.Call, mod: str,
                      where: str, on_instance: bool = False) -> NormCall | None:
    """What the norm module ``mod`` built by ``ctor`` (code of ``file``) is, its fused code guarded on its
    run-time type; a ``not_rms`` NormCall for a LayerNorm; None when npufuse cannot read it. ``on_instance``: see
    :func:`_norm_of_ctor`."""
    f = call.func
    attr = _callee_name(f)
    canon = file.canonical(ctor.func) or ""
    if canon in _LAYER_NORMS:
        return NormCall(call, attr, "not_rms", reason=f"{canon.replace('torch.nn.', 'nn.')}: mean subtracted")
    T = S.torch_name(module)
    if canon in ("torch.nn.RMSNorm", "torch.nn.modules.normalization.RMSNorm"):
        if T is None:
            return None  # the guard names torch.nn.RMSNorm
        # s43 review: the construction's own eps (``nn.RMSNorm(d, eps=1e-5)``) is the instance's only where that
        # construction built it; a module of a class taken from callers is known by its class test: eps read on it
        lib = _library_gamma_eps(file, mod, ctor) if file is module and not on_instance else None
        if lib is None:
            weightless = _s42_weightless_library_norm(module, call, attr, mod, ctor) if file is module else None
            if weightless is not None:
                weightless.conditions = [f"type({mod}) is {T}.nn.RMSNorm", f"{mod}.weight is None"]
                weightless.mod = mod
                if on_instance:
                    weightless.eps = eps_or_default(f"{mod}.eps", T)
            if file is module and (weightless is not None or not on_instance):
                return weightless
            # built in another file: its weight and eps are the instance's
            lib = (f"{mod}.weight", eps_or_default(f"{mod}.eps", T))
        return NormCall(call, attr, "library", cls="nn.RMSNorm", gamma=lib[0], eps=lib[1], mod=mod,
                        conditions=[f"type({mod}) is {T}.nn.RMSNorm", f"{mod}.weight is not None"])
    cls = dotted(ctor.func) or ""
    # a class of ``file``, or one ``file`` imports from another file of the repository (s33: AMPLIFY's
    # ``RMSNorm(d, eps) if config.rms_norm else nn.LayerNorm(d, eps)``, RMSNorm from ``.rmsnorm``)
    owner = _class_named(file, cls) if cls else None
    if owner is None:
        return None
    cfile, cls = owner
    if cfile is not file:
        where = f" (from {cfile.path})"
    home = module if cfile is module else _home_with(module, cfile, cfile.classes[cls])
    if home is None:
        return None
    nc = _class_norm_call(home, call, ctx, cls, where)
    if nc is not None and nc.kind != "not_rms":
        # this file names the class where it builds it; another file's class is told by its forward's file
        # (s41: a class imported inside a method, ``if cfg.rms: from .layers import RMSNorm``, is not a name the
        # forward can read: told by its forward's file too)
        from npufuse.scan import bound_callee

        head = (dotted(ctor.func) or "").split(".")[0]
        named = file is module and (cfile is module or bool(bound_callee.module_bindings(module, head)))
        nc.conditions = [*nc.conditions, _type_guard(module, mod, ctor.func, module if named else cfile)]
        nc.mod = mod
        nc.home = home if home is not module else None
    return nc


def _callee_name(f: ast.expr) -> str:
    """The name a norm call's callee goes by in reasons: ``self.norm`` -> ``norm``, ``ff_norm``,
    ``self.norms[i]`` -> ``norms``."""
    while isinstance(f, ast.Subscript):
        f = f.value
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ast.unparse(f)


def _indexed_norm(module: ModuleInfo, scope: Scope, call: ast.Call, ctx: S.Ctx) -> NormCall | None:
    """``self.norms[i](h)`` (VITS' ``self.norm_layers_1[i](x + y)``, XLM's ``self.layer_norm2[i]``): a list of
    norms of ``__init__``, every element the same construction, read like a member norm (s32)."""
    f = call.func
    assert isinstance(f, ast.Subscript)
    lst, idx = f.value, f.slice
    if not (isinstance(lst, ast.Attribute) and _s42_plain_index(idx)
            and len(call.args) == 1 and not call.keywords and not isinstance(call.args[0], ast.Starred)):
        return None
    via: list[str] = []
    owner = _object_class(module, scope, lst.value, via=via)
    elts = _list_elements(owner, lst.attr) if owner is not None else None
    if not elts or len({ast.dump(e) for e in elts}) != 1:
        return None
    file = owner[0]  # type: ignore[index]
    where = f" (from {file.path})" if file is not module else ""
    return _norm_of_ctor(module, call, ctx, file, elts[0], S.source_of(module, f), where, f"an element of `{ast.unparse(lst)}`",
                         on_instance=bool(via))


def _class_norm_call(module: ModuleInfo, call: ast.Call, ctx: S.Ctx, cls: str, where: str = "",
                     inner: ast.expr | None = None, extra: dict[str, ast.expr] | None = None) -> NormCall | None:
    """``self.<attr>(x)`` where ``__init__`` builds the attribute as ``cls(...)``, a class of
    ``module``: read through its forward with ``self`` bound to ``self.<attr>`` and its input to the
    sum. ``where`` names the other file a repository class comes from (for reasons). ``inner``: the
    module expression read instead of the callee (a submodule the callee's forward calls; it has no
    place in the source and is rendered by ``ast.unparse``)."""
    f = call.func if inner is None else inner
    attr = _callee_name(call.func)  # s32: a Name (unpacked from a layer list) or a Subscript (``self.norms[i]``) too
    fwd = S.method(module, cls, "forward")
    mod = f"self.{attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" \
        else S.source_of(module, f) if inner is None else ast.unparse(f)
    written = _s43_state_write(fwd) if fwd is not None else None
    if written is not None:
        # s43 review: the fused code replaces the whole call, so a write the forward makes (a call counter, a cached
        # statistic, the input changed in place) would no longer happen
        return NormCall(call, attr, "not_rms", cls=cls + where,
                        reason=f"norm {cls}{where} cannot be fused: its forward writes `{written}`, which the fused call would not")
    # the library kernels a norm class's forward may return, tried in order: F.rms_norm, flash-attn's Triton kernel,
    # apex's kernel (s44), F.rms_norm cast back to the input's dtype (s44)
    readers: tuple[Callable[[ast.FunctionDef], tuple[str, str] | None], ...] = (
        lambda fn: _library_forward(module, fn, mod, foreign=bool(where)),
        lambda fn: _triton_rms_forward(module, fn, cls, mod, foreign=bool(where)),
        lambda fn: _add_rms_norm_s44.apex_rms_forward(module, fn, mod, foreign=bool(where)),
        lambda fn: _add_rms_norm_s44h.cast_back_library_forward(module, fn, mod, bool(where), _library_forward),
        # s46: F.rms_norm with the weight cast to the input's dtype (``self.weight.to(x.dtype)``)
        lambda fn: _add_rms_norm_s46a.cast_weight_library_forward(module, fn, mod, bool(where), _library_forward),
    )
    lib_fwd = next((got for got in (read(fwd) for read in readers) if got is not None), None) if fwd is not None else None
    if lib_fwd is not None:
        return NormCall(call, attr, "library", cls=cls + where, gamma=lib_fwd[0], eps=lib_fwd[1])
    if fwd is None:
        return None
    ret = S.helper_return(fwd) or _add_rms_norm_s47n.return_after_checks(module, cls, fwd, S.helper_return)  # s47
    ret = ret or (_rms_norm_s48f.return_past_scale(fwd, S._straight) if fwd is not None else None)  # s48
    nscope = S.scope_of(module, fwd)
    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    kernel_branch: tuple[ast.Return, list[str], str] | None = None
    arms = _add_rms_norm_s49m.library_arm(module, fwd, mod, bool(where), _library_forward) if ret is None and len(params) >= 2 else None
    if arms is None and ret is None and len(params) >= 2:  # s50: N exiting arms, each F.rms_norm or not run where fused
        narms = _add_rms_norm_s50n.read(module, fwd, mod, bool(where), extra or {}, _library_forward, _s42_dead_on_npu, cls + where,
                                        lambda e: S.source_of(module, e))
        if isinstance(narms, str):
            return NormCall(call, attr, "not_rms", cls=cls + where, reason=narms)
        arms = narms
    ret = arms.ret if arms is not None else ret  # s49: ``if flag: return F.rms_norm(..)`` then the same norm by hand
    if ret is None and len(params) >= 2:
        # s42: ``if HAS_TRITON and x.is_cuda: return kernel(x, ...)`` before the torch path: the torch path is read
        kernel_branch = _s42_kernel_branch(fwd, params[0], params[1], mod, bool(where))
        if kernel_branch is None:
            # s43: ``if self.gain is not None: return unit * self.gain`` then ``return unit``
            kernel_branch = _norm_s43.exiting_if_arm(fwd, params[0], mod, bool(where))
        ret = kernel_branch[0] if kernel_branch is not None else None
    weight_branch: tuple[ast.Return, list[str]] | None = None
    if ret is None and len(params) >= 2:
        # s43: ``if self.weight is not None: return <weighted> else: return <plain>``: one arm, under its test
        weight_branch = _s43_branch_return(fwd, params[0], mod)
        ret = weight_branch[0] if weight_branch is not None else None
    if ret is None and nscope is not None:
        unread = _add_rms_norm_s47n.unread_forward_reason(fwd, cls + where)  # s47: a true reason where one is evident
        if unread is not None:
            return NormCall(call, attr, "not_rms", cls=cls + where, reason=unread)
    if ret is None or nscope is None or len(params) < 2:
        return None
    defaults = dict(zip(params[len(params) - len(fwd.args.defaults) :], fwd.args.defaults))
    hctx = S.Ctx(nscope, ret.lineno, {}, ctx.depth + 1)
    bind: dict[str, tuple[ast.expr, S.Ctx]] = {params[0]: (f, ctx), params[1]: (_norm_input(call.args[0]), ctx)}
    for p in params[2:]:
        if extra and p in extra:
            bind[p] = (extra[p], ctx)  # s37: an argument the call passes (a conditioning input)
            continue
        if p not in defaults:
            return None
        bind[p] = (defaults[p], hctx)
    hctx.bind = bind
    try:
        m = R.parse_norm(module, ret.value, hctx)  # type: ignore[arg-type]
    except R.NoMatch:
        if weight_branch is not None:
            return None  # s43: the arm is no norm; the readings below take the whole forward, which has another arm
        return (_l2_class_norm(module, call, cls, fwd, where) or _clamp_class_norm(module, call, cls, fwd, where)
                or _probed_class_norm(module, call, cls, fwd, where, attr, mod))
    except R.Miss as e:
        if "LayerNorm" in e.reason or "mean subtracted" in e.reason:
            return NormCall(call, attr, "not_rms", reason=f"norm is not RMSNorm ({cls}{where}: {e.reason})", cls=cls + where)
        return NormCall(call, attr, "not_rms", reason=f"norm {cls}{where} cannot be fused: {e.reason}", cls=cls + where)
    # s37: the value normalised must be the module's input itself; a forward normalising ``y = x * self.pre``
    # (or a masked input) was fused as the norm of the sum, dropping the factor. A name rebound only by
    # function calls of the input keeps the earlier reading (see _computed_by_arithmetic)
    # s45: ``if x.size(-1) != self.dim: x = pad(x) / x[..., :dim]`` first: the input itself where the widths agree
    adapter = _add_rms_norm_s45h.width_adapter(fwd, params[0], params[1], mod) \
        if isinstance(m.core.x, ast.Name) and m.core.x.id == params[1] else None
    if adapter is None and m.core.x_key != S.key(bind[params[1]][0], ctx) \
            and not _rebound_by_casts_only(nscope, params[1], m.core.x_key) \
            and _computed_by_arithmetic(nscope, m.core.x, getattr(m.core.rstd, "lineno", 0)):
        return NormCall(call, attr, "not_rms", cls=cls + where,
                        reason=f"norm {cls}{where} normalises `{ast.unparse(m.core.x)}`, computed from its input, not the input itself")
    # (s46 review) the width test joins the arm's own tests: with ``if self.weight is not None: return .. else: ..``
    # after the width branch, the adapter alone dropped the arm's test and the fused call read a None weight
    width = [adapter[1]] if adapter is not None else []
    if arms is not None and (why := _add_rms_norm_s50n.differ(m, arms, cls + where)) is not None:  # s49, s50
        return NormCall(call, attr, "not_rms", cls=cls + where, reason=why)
    if kernel_branch is not None:
        return NormCall(call, attr, "rms", match=m, cls=f"{cls}{where} ({kernel_branch[2]})", conditions=kernel_branch[1] + width)
    if weight_branch is not None:
        return NormCall(call, attr, "rms", match=m, cls=cls + where, conditions=weight_branch[1] + width)
    if isinstance(arms, _add_rms_norm_s50n.NArms):
        return NormCall(call, attr, "rms", match=m, cls=f"{cls}{where} ({arms.note})", conditions=arms.conditions + width,
                        test_only=frozenset(arms.test_only), library_arm=bool(arms.library), guard_names=frozenset(arms.guard_names))
    return NormCall(call, attr, "rms", match=m, cls=cls + where + (f" ({arms.note})" if arms is not None else ""), conditions=width,
                    library_arm=arms is not None)


def _s43_state_write(fwd: ast.FunctionDef) -> str | None:
    """The first assignment target of ``fwd`` that writes state rather than a local name: an attribute or an
    element of a parameter (``self.calls = ..``, ``self.stats[k] = ..``, ``x[..., 0] = ..`` on the input); None
    where it assigns locals only (a local tensor's elements included)."""
    params = {a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args, *fwd.args.kwonlyargs)}
    for n in fast_walk(fwd):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for part in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                root = part
                while isinstance(root, (ast.Attribute, ast.Subscript, ast.Starred)):
                    root = root.value
                if part is not root and (isinstance(part, ast.Attribute) or isinstance(root, ast.Name) and root.id in params):
                    return ast.unparse(part)
    return None


def _probed_class_norm(module: ModuleInfo, call: ast.Call, cls: str, fwd: ast.FunctionDef, where: str, attr: str,
                       mod: str) -> NormCall | None:
    """s41: a norm class whose forward the syntactic matcher cannot read but the numeric probe proves an RMSNorm
    (rms_norm's own finding on the forward, memoised there: ``((x**2).sum(-1, keepdim=True) / x.size(-1) + eps) **
    0.5`` as the divisor). Taken only in the plain form: eps inside the root, a weight without offset that is an
    attribute of the module, eps a number or an attribute, no run-time guard the probe assumed; its weight and eps
    are read on the instance (``self`` becomes the module expression)."""
    if where or "_npufuse_borrowed" in module.__dict__:
        return None  # a class of another file, read in a view of this file: its probe would read the wrong text
    found = R.probed_forward(module, fwd)
    if found is None:
        return None
    p = found.params
    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    # s42: eps outside the root or a clamp (on the norm, on the mean square) is taken with the probe's mapped eps'
    if (p.get("eps_rule") and p.get("eps_rule") not in _S42_MAPPED_EPS_RULES) or p.get("weight_offset") \
            or not p.get("weight") or p.get("input") != params[1]:
        return None
    guards = _s43_instance_guards(p.get("guards") or [], params[0], params[1], mod)
    if guards is None:
        return None

    def on_instance(text: str) -> str | None:
        # only ``self.<attr>`` chains and numbers: anything else names a value of the class's file or scope
        try:
            node = ast.parse(text, mode="eval").body
        except SyntaxError:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return text
        chain = dotted(node)
        if chain is None or not chain.startswith(params[0] + ".") or "\n" in mod:
            return None
        return mod + chain[len(params[0]):]

    gamma, eps = on_instance(p["weight"]), on_instance(p["eps"])
    if eps is None and p.get("eps_rule") and "\n" not in mod:
        eps = _s42_eps_on_instance(p["eps"], params[0], mod)  # eps' = ``(self.eps) ** 2``: an expression of the module
    if gamma is None or eps is None:
        return None
    rule = p.get("output_dtype")
    if rule not in ("input", "promote", "weight", "float32"):
        return None
    nc = NormCall(call, attr, "probed", cls=cls + where, gamma=gamma, eps=eps, mod=mod,
                  probe=(rule, _probed_rank(found)), probe_guards=guards)
    if p.get("eps_rule"):
        nc.s42_eps_form = (p["eps_rule"], p.get("eps_original", ""), float(p.get("eps_bound", 1.0)))
    return nc


def _s43_instance_guards(guards: list[str], me: str, x: str, mod: str) -> list[str] | None:
    """The probe's run-time guards read on the norm instance: ``self`` becomes the module expression, the input
    ``_npu_norm_input`` (renamed to the sum's operand by _build). None where a guard reads any other name (a value
    of the class's scope) or the module expression spans lines: the norm is then not taken, as before s43."""
    if guards and "\n" in mod:
        return None
    out: list[str] = []
    for text in guards:
        try:
            node = ast.parse(text, mode="eval").body
        except SyntaxError:
            return None
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if not names <= {me, x} or any(isinstance(n, (ast.Call, ast.Lambda, ast.NamedExpr)) for n in ast.walk(node)):
            return None
        renamed = _renamed(_renamed(node, x, "_npu_norm_input"), me, "_npu_norm_module")
        out.append(ast.unparse(renamed).replace("_npu_norm_module", mod))
    return out


def _probed_rank(found: Finding) -> int:
    """The highest input rank the probe's finding admits (its first guard ``2 <= x.dim() <= R``; 3 if unreadable)."""
    m = re.search(r"2 <= \w+\.dim\(\) <= (\d+)", found.fused.split("\n", 1)[0])
    return int(m.group(1)) if m else 3


_CASTS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as", "contiguous"})


def _rebound_by_casts_only(scope: Scope, param: str, x_key: str) -> bool:
    """The normalised value is the forward's input name itself (``x_key`` names it in ``scope``: several
    definitions reach it) and every rebinding of it is a cast of it (``x = x.to(torch.float32)`` under a
    flag): the value is the input up to its dtype, which the matcher reads as a (conditional) cast."""
    if x_key != f"${param}@{scope.qualname}":
        return False
    for _st, value in scope.assignments.get(param, []):
        if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _CASTS
                and isinstance(value.func.value, ast.Name) and value.func.value.id == param):
            return False
    return True


def _computed_by_arithmetic(scope: Scope, leaf: ast.expr, before: int) -> bool:
    """The normalised name is (at some definition) arithmetic on tensors (``y = x * self.pre``, ``x = x * mask``),
    not a call of a function handed the input (``x = probe.log_stats(x, "resid")``, a logging hook returning it:
    still read as the input, as before s37; whether such a function returns its argument is not proved)."""
    if not isinstance(leaf, ast.Name):
        return True
    # definitions from the statistic's line on are the norm's own result (``xf = xf * rsqrt(...)``); a plain
    # alias of a name (``xf = x`` before ``if ...: xf = x.float()``, fms) is no arithmetic
    defs = [v for st, v in scope.assignments.get(leaf.id, []) if st.lineno < before]
    return any(not isinstance(v, (ast.Call, ast.Name)) for v in defs)


def _module_read_text(n: ast.expr, me: str, mod: str) -> str | None:
    """A gain factor of a norm class's forward with ``me`` (its ``self``) read as ``mod`` (the norm
    attribute at the call site); None for anything but module reads (``self.<attr>``) and numbers."""
    if isinstance(n, ast.Constant) and type(n.value) in (int, float):
        return repr(n.value)
    d = dotted(n)
    if d is not None and d.startswith(me + ".") and d.count(".") == 1:
        return mod + d[len(me):]
    return None


def _product_text(parts: list[tuple[str, bool]]) -> str:
    """``a * b / (c * d)`` from (text, in the denominator) factors."""
    num = " * ".join(f"({t})" for t, inv in parts if not inv) or "1.0"
    den = [f"({t})" for t, inv in parts if inv]
    return num if not den else f"{num} / ({' * '.join(den)})"


def _l2_class_norm(module: ModuleInfo, call: ast.Call, cls: str, fwd: ast.FunctionDef, where: str) -> NormCall | None:
    """A norm class whose forward is ``return F.normalize(x, dim=-1) * <gain>`` with a sqrt(d) factor
    in the gain (lucidrains: ``F.normalize(x, dim=-1) * self.scale * self.gamma``, ``self.scale =
    dim ** 0.5``): x / ||x|| * P = x / rms(x) * (P / sqrt(d)), an RMSNorm whose eps is a clamp on
    the norm. The gain's factors must be reads of the module (``self.<attr>``) or constants."""
    from npufuse.patterns._library_norm import _flatten as flatten_factors
    from npufuse.scan import canonical

    f = call.func
    attr = _callee_name(f)
    ret = S.helper_return(fwd)
    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    if ret is None or ret.value is None or len(params) != 2 or fwd.args.vararg or fwd.args.kwonlyargs or fwd.args.kwarg \
            or len(fwd.body) - isinstance(fwd.body[0], ast.Expr) != 1:
        return None  # only ``return <product>`` (a docstring allowed)
    me, x = params
    factors: list[tuple[ast.expr, bool]] = []
    flatten_factors(ret.value, False, factors)
    units = [(n, l2) for n, inv in factors for l2 in [canonical.l2_normalize_of(module, n)] if l2 is not None and not inv]
    if len(units) != 1 or not (isinstance(units[0][1].x, ast.Name) and units[0][1].x.id == x):
        return None
    unit, l2 = units[0]
    rest = [(n, inv) for n, inv in factors if n is not unit]
    mod = f"self.{attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" else S.source_of(module, f)

    texts = [_module_read_text(n, me, mod) for n, _ in rest]
    init = S.init_assignments(module, cls)
    powers = [canonical.root_power(module, n, init.get) for n, _ in rest]
    signed = [pw if not inv else -pw for (n, inv), pw in zip(rest, powers) if pw is not None]
    if not rest or None in texts or 0.5 not in signed:
        return None  # no sqrt(d) gain (an L2 normalisation) or a factor computed otherwise
    gain = _product_text([(t, inv) for t, (_, inv) in zip(texts, rest)])  # type: ignore[misc]
    eps = "1e-12"
    if l2.eps is not None:
        v = l2.eps.value if isinstance(l2.eps, ast.Constant) else None
        if type(v) not in (int, float):
            return None
        eps = repr(v)
    return NormCall(call, attr, "l2", cls=cls + where, gamma=gain, eps=eps)


def _clamp_class_norm(module: ModuleInfo, call: ast.Call, cls: str, fwd: ast.FunctionDef, where: str) -> NormCall | None:
    """A norm class whose forward is the two-statement clamp form (x-transformers' RMSNorm and its copies
    in latent-diffusion, TTS, MoDE): ``n = torch.norm(x, dim=-1, keepdim=True) * S`` then ``return x /
    n.clamp(min=eps) * P``. x / max(||x|| S, eps) * P = x / max(||x||, eps / S) * (P / S): the L2 form
    (``_l2_class_norm``) with gain P / S and clamp eps / S, an RMSNorm when S or P holds the 1 / sqrt(d).
    Every factor of S and P must be a read of the module (``self.<attr>``) or a number."""
    from npufuse.patterns._library_norm import _flatten as flatten_factors
    from npufuse.scan import canonical

    f = call.func
    attr = _callee_name(f)
    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    body = [st for st in fwd.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    if len(params) != 2 or fwd.args.vararg or fwd.args.kwonlyargs or fwd.args.kwarg or len(body) != 2:
        return None
    first, ret = body
    if not (isinstance(first, ast.Assign) and len(first.targets) == 1 and isinstance(first.targets[0], ast.Name)
            and isinstance(ret, ast.Return) and ret.value is not None):
        return None
    me, x = params
    n_name = first.targets[0].id
    scale: list[tuple[ast.expr, bool]] = []
    flatten_factors(first.value, False, scale)
    l2 = [n for n, inv in scale if not inv and isinstance(canonical.l2_norm_operand(module, n), ast.Name)
          and canonical.l2_norm_operand(module, n).id == x]  # type: ignore[union-attr]
    if len(l2) != 1 or any(inv for n, inv in scale if n is l2[0]):
        return None
    scale = [(n, inv) for n, inv in scale if n is not l2[0]]
    factors: list[tuple[ast.expr, bool]] = []
    flatten_factors(ret.value, False, factors)
    xs = [n for n, inv in factors if not inv and isinstance(n, ast.Name) and n.id == x]
    clamps = [(n, c) for n, inv in factors if inv for c in [canonical.clamp_min_of(module, n)]
              if c is not None and isinstance(c[0], ast.Name) and c[0].id == n_name]
    if len(xs) != 1 or len(clamps) != 1:
        return None
    rest = [(n, inv) for n, inv in factors if n is not xs[0] and n is not clamps[0][0]]
    if any(isinstance(n, ast.Name) and n.id in (x, n_name) for n, _ in rest):
        return None
    mod = f"self.{attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" else S.source_of(module, f)

    eps = _module_read_text(clamps[0][1][1], me, mod)
    texts = [_module_read_text(n, me, mod) for n, _ in rest]
    s_texts = [_module_read_text(n, me, mod) for n, _ in scale]
    if eps is None or None in texts or None in s_texts:
        return None
    init = S.init_assignments(module, cls)
    signed = [pw if not inv else -pw for n, inv in rest for pw in [canonical.root_power(module, n, init.get)] if pw is not None] + \
             [-pw if not inv else pw for n, inv in scale for pw in [canonical.root_power(module, n, init.get)] if pw is not None]
    if 0.5 not in signed:
        return None  # no 1 / sqrt(d): an L2 normalisation with a gain, not an RMSNorm
    S_text = _product_text([(t, inv) for t, (_, inv) in zip(s_texts, scale)])  # type: ignore[misc]
    P_text = _product_text([(t, inv) for t, (_, inv) in zip(texts, rest)])  # type: ignore[misc]
    return NormCall(call, attr, "l2", cls=cls + where, gamma=f"({P_text}) / ({S_text})", eps=f"({eps}) / ({S_text})")


def _loop_unpacked(scope: Scope, name: str) -> str | None:
    """The iterated attribute when ``name`` is one of the names a ``for a, b, ... in self.x:`` of this
    scope unpacks (and is bound nowhere else in it)."""
    if len(scope.assignments.get(name, [])) > 1:
        return None
    for loop in scope.nodes().get(ast.For, []):
        t = loop.target  # type: ignore[attr-defined]
        if isinstance(t, ast.Tuple) and any(isinstance(e, ast.Name) and e.id == name for e in t.elts):
            it = dotted(loop.iter)  # type: ignore[attr-defined]
            if it is not None and it.startswith("self."):
                return it
    return None


def _is_rms_subclass(module: ModuleInfo, ctor: ast.Call) -> bool:
    from npufuse.patterns._library_norm import rms_subclass

    return rms_subclass(module, dotted(ctor.func))


def _chosen_classes(module: ModuleInfo, class_name: str | None, func: ast.expr) -> list[str]:
    """``[A, B]`` when ``func`` is a local of ``__init__`` assigned once, ``A if test else B``."""
    init = S.method(module, class_name, "__init__")
    if init is None or not isinstance(func, ast.Name):
        return []
    values = [st.value for st in S._stmts_in(init.body) if isinstance(st, ast.Assign) and len(st.targets) == 1
              and isinstance(st.targets[0], ast.Name) and st.targets[0].id == func.id]
    if len(values) != 1 or not isinstance(values[0], ast.IfExp):
        return []
    names = [dotted(v) for v in (values[0].body, values[0].orelse)]
    return [n for n in names if n] if all(names) else []


def _operands(module: ModuleInfo, value: ast.expr) -> tuple[ast.expr, ast.expr] | str | None:
    """(x1, x2) of a residual add; a reason for ``torch.add(..., alpha=)``; None for no add.

    A scaled operand (Granite's ``residual + hidden_states * self.residual_multiplier``, a gated
    ``g1 * a + g2 * b``) is still x1 + x2 with x2 a tensor: npu_add_rms_norm takes it evaluated."""
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
        x1, x2 = value.left, value.right
    elif isinstance(value, ast.Call) and module.call_name(value) == "torch.add" and len(value.args) == 2:
        if value.keywords:
            return f"scaled add (`{ast.unparse(value)}`): npu_add_rms_norm adds x1 + x2 unscaled"
        x1, x2 = value.args
    else:
        return None
    for x in (x1, x2):
        if isinstance(x, ast.Constant):
            return None
    return x1, x2


@dataclass
class _Site:
    add: ast.stmt
    aliases: list[ast.stmt]
    norm_stmt: ast.stmt
    nc: NormCall
    x1: ast.expr
    x2: ast.expr
    sum_name: str | None  # None: the add is inline in the norm call
    # Gemma2: ``if self.pre_feedforward_layernorm is not None: h = self.pre_feedforward_layernorm(h)``:
    # the ``if`` holding the norm statement (the fused branch runs when its test holds)
    wrapper: ast.If | None = None
    # Lumina's sandwich block: ``if self.num_experts > 0: out = h + ff(norm(h) ...) else: out = h +
    # other_ff(norm(h) ...)``: the same norm of the sum in both branches (the if, and the else
    # branch's statement and norm call; ``norm_stmt`` / ``nc`` are the if branch's)
    fork: ast.If | None = None
    fork_else: tuple[ast.stmt, ast.Call] | None = None
    # s27: ``if use_mup: h = r + y * s else: h = r + y`` then the norm of ``h``: the ``if`` (``add``)
    # and each branch's operands; the fused code binds the taken branch's operands, then adds once
    branches: list[tuple[ast.expr, ast.expr]] | None = None
    # s27: ``u = attn(norm(u)) + u; if <pure test>: u = u * mask; u = mlp(norm2(u)) + u``: the ``if``
    # between the sum and its norm; the fused code runs where its test is false (else the original)
    gap: ast.If | None = None
    # s46h: the gap's test reads the sum only as ``sum.dtype``: tested on the operands' result type, the original
    # statements run where it holds (see patterns/_add_rms_norm_s46h.py)
    gap_dtype: bool = False
    # s27: ``h = r + y; residual = h; h = h.to(<dtype>)`` then the norm of ``h``: the cast statement and
    # its target dtype as code; npu_add_rms_norm runs only where the cast changes nothing
    cast: tuple[ast.stmt, str] | None = None
    # s31: ``if <test>: ...; h = h + ca(...)`` then the norm of ``h`` after the ``if`` (a block adding an
    # optional cross-attention): the ``if`` whose body ends with the add; the norm statement is taken
    # into both branches, fused where the body ran
    tail_if: ast.If | None = None
    # s33: ``h = h + a`` then ``if <pure test>: y = norm(h); <more>`` (else optional): the ``if`` whose
    # body the norm statement heads; the add moves into both branches, fused where the body runs
    head_if: ast.If | None = None
    # s45: the arm of ``head_if`` the norm heads: "body", or "orelse" (``if use_checkpoint: .. checkpoint(..)
    # else: y = norm(h) ..``, the norm where the switch is off)
    head_arm: str = "body"

    @property
    def last(self) -> ast.stmt:
        if self.head_if is not None:
            return self.head_if
        if self.fork is not None:
            return self.fork
        return self.wrapper if self.wrapper is not None else self.norm_stmt

    def splice_norm(self, module: ModuleInfo, rep) -> str:
        """The norm statement(s) with each norm call replaced by ``rep(call)`` (a list of
        (node, text) pairs): one statement, or the fork's if/else with both branches."""
        first = S.splice(module, self.norm_stmt, rep(self.nc.call))
        if self.fork is None or self.fork_else is None:
            return first
        st, call = self.fork_else
        # s45: a fork whose arms go on after the norm statement (``mlp_out = self.mlp(self.ln2(x)); aux = ..``)
        body_rest, else_rest = ([S.block_source(module, arm[1:])] if arm[1:] else [] for arm in (self.fork.body, self.fork.orelse))
        return "\n".join([f"if {S.source_of(module, self.fork.test)}:", S.indent("\n".join([first, *body_rest])), "else:",
                          S.indent("\n".join([S.splice(module, st, rep(call)), *else_rest]))])


def _sum_arg(call: ast.Call, name: str, module: ModuleInfo | None = None) -> bool:
    """The call's input (first positional argument, ``input=``, or for a norm helper of this or
    another file of the repository the keyword naming the helper's first parameter) is the name
    ``name``."""
    first = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "input"), None)
    if first is None and module is not None and isinstance(call.func, ast.Name):
        # TriForce: ``RMSNorm(hidden_states=hidden_states, layernorm_variance_epsilon=..., layernorm_weight=...)``
        # (a helper of another file called with keywords only): the keyword that binds its input
        first = _helper_keyword_input(module, call)
    if isinstance(first, ast.Name) and first.id == name:
        return True
    if module is not None and isinstance(call.func, ast.Name) and "norm" in call.func.id.lower():
        # s42, CS336: ``rmsnorm(d_model, eps=1e-5, weights=w, in_features=x)``: the helper normalizes a later parameter
        arg = _helper_input_arg(module, call)
        return isinstance(arg, ast.Name) and arg.id == name
    return False


def _helper_keyword_input(module: ModuleInfo, call: ast.Call) -> ast.expr | None:
    """The argument bound to the first parameter of the plain function ``call`` names (a def of
    this file, or one this file imports from another file of the repository), where the call passes
    it by keyword; None otherwise."""
    if call.args or not isinstance(call.func, ast.Name) or not any(isinstance(k.value, ast.Name) for k in call.keywords):
        return None  # the cheap test first: only a keyword holding a name can be the sum
    fn = module.helper(call.func.id)
    if fn is None:
        found = _foreign_definition(module, call.func.id)
        fn = found[1] if found is not None else None
    if not isinstance(fn, ast.FunctionDef):
        return None
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    if not params or fn.args.posonlyargs:
        return None
    return next((k.value for k in call.keywords if k.arg == params[0]), None)


def _calls_norm_helper(module: ModuleInfo, scope: Scope) -> bool:
    """The scope's text calls a module-level function of this file whose name says norm (``rmsnorm(``): the
    cheap gate before a module-level function is read for add + norm sites."""
    names = module.__dict__.get("_npufuse_norm_helper_calls")
    if names is None:
        names = module.__dict__["_npufuse_norm_helper_calls"] = tuple(f"{n}(" for n in module.functions if "norm" in n.lower())
    if not names:
        return False
    text = S.scope_text(module, scope)
    return any(n in text for n in names)


def _helper_input_param(module: ModuleInfo, fn: ast.FunctionDef) -> str | None:
    """The parameter a module-level norm helper of this file normalizes when it is not the first one (CS336's
    ``def rmsnorm(d_model, eps, weights, in_features)``): the RMSNorm its return computes, read with the
    parameters unbound, has that parameter as its operand. None for a first-parameter helper (the usual
    reading) or anything else (cached per helper)."""
    cache = module.__dict__.setdefault("_npufuse_norm_input_param", {})
    key = id(fn)
    if key in cache:
        return cache[key]
    found = None
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    ret = R._helper_return(fn)
    nscope = S.scope_of(module, fn)
    if len(params) > 1 and ret is not None and ret.value is not None and nscope is not None:
        try:
            m = R.parse_norm(module, ret.value, S.Ctx(nscope, ret.lineno))
        except (R.NoMatch, R.Miss):
            m = None
        x = m.core.x if m is not None else None
        if isinstance(x, ast.Name) and x.id in params[1:]:
            found = x.id
    cache[key] = found
    return found


def _helper_input_arg(module: ModuleInfo, call: ast.Call) -> ast.expr | None:
    """The argument ``call`` passes for the input parameter :func:`_helper_input_param` names (by position
    or keyword); None when the callee is no such helper of this file."""
    if not isinstance(call.func, ast.Name) or any(isinstance(a, ast.Starred) for a in call.args):
        return None
    fn = module.helper(call.func.id)
    if not isinstance(fn, ast.FunctionDef) or fn.args.posonlyargs:
        return None
    param = _helper_input_param(module, fn)
    if param is None:
        return None
    params = [a.arg for a in fn.args.args]
    i = params.index(param)
    if i < len(call.args):
        return call.args[i]
    return next((k.value for k in call.keywords if k.arg == param), None)


def _norm_stmt(stmt: ast.stmt) -> tuple[ast.stmt, ast.If | None]:
    """The statement holding the norm call: ``stmt``, or the only statement of an ``if`` without
    ``else`` whose test reads ``self`` attributes only (``if self.norm is not None:``)."""
    if isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1 and S.simple_stmt(stmt.body[0]) \
            and all(isinstance(n, (ast.Attribute, ast.Name, ast.Compare, ast.Constant, ast.BoolOp, ast.UnaryOp, ast.cmpop, ast.boolop,
                                   ast.unaryop, ast.Load))
                    and (not isinstance(n, ast.Name) or n.id == "self") for n in ast.walk(stmt.test)):
        return stmt.body[0], stmt
    return stmt, None


# ``norm(x + y)``, ``self.norms[i](x + y)``, ``norm(self.attn(x) + x)`` (calls nested up to three deep before the
# ``+``); the sum may start on the line after the call's parenthesis and its ``+`` may open a line (a formatter's
# ``norm(\n    x + f(x),\n    eps=...)``, ``norm(\n    f(x)\n    + x)``). A cheap gate: the AST decides.
_NESTED_PARENS = r"\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)"
# s51 (perf51): the ``(`` first and the character before it as a lookbehind: a pattern led by a class gives ``re`` no
# literal to look for, so it tried a match at every word character; searched only for whether it matches anywhere, the
# two forms agree on every text (a match of ``[\w\]]\(...`` at p is one of this at p + 1, and back)
_INLINE_SUM = re.compile(r"\((?<=[\w\]]\()\s*(?:[^()\n]|" + _NESTED_PARENS + r")*(?:\n\s*)?\+")


def _sites(module: ModuleInfo, scope: Scope) -> Iterable[tuple[ast.stmt, _Site | str]]:
    """Residual adds directly followed (through ``residual = sum`` aliases) by a norm-module call
    on the sum, and norm calls on an inline sum (``self.norm(x + y)``)."""
    idx = S.stmt_index(scope)
    lines = S.module_lines(module)
    for stmt in idx.stmts:
        if not (S.simple_stmt(stmt) or isinstance(stmt, ast.AugAssign)) or getattr(stmt, "value", None) is None:
            continue
        # a sum assigned to a name (or added in place to it), then the norm of it
        in_place = _in_place_sum(scope, idx, stmt)
        if in_place is not None or (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            ops = in_place if in_place is not None else _operands(module, stmt.value)  # type: ignore[attr-defined]
            if ops is not None:
                s_name = stmt.target.id if in_place is not None else stmt.targets[0].id  # type: ignore[attr-defined]
                block, i = idx.block[id(stmt)]
                j = i + 1
                aliases: list[ast.stmt] = []
                # s43: profiling markers (nvtx range_pop / range_push, logging) travel with the aliases, in order
                while j < len(block) and (_is_alias(block[j], s_name) or _s43_is_marker(module, scope, block[j])):
                    aliases.append(block[j])
                    j += 1
                if j + 1 < len(block) and not isinstance(ops, str):
                    yield from _s43_unmoved_marker(module, scope, block, j, s_name)
                nstmt, wrapper = _norm_stmt(block[j]) if j < len(block) else (None, None)
                fork = _fork(module, scope, block[j], s_name) if j < len(block) and wrapper is None else None
                if fork is not None:
                    fork_if, fork_stmt, fork_nc, fork_else = fork
                    if isinstance(ops, str):
                        yield fork_stmt, fork_nc.reason if fork_nc.kind == "not_rms" else ops
                    else:
                        yield fork_stmt, _Site(stmt, aliases, fork_stmt, fork_nc, ops[0], ops[1], s_name, None, fork_if, fork_else)
                if nstmt is not None and S.simple_stmt(nstmt) and getattr(nstmt, "value", None) is not None:
                    for node in S.iter_exprs_topdown(nstmt.value):  # type: ignore[attr-defined]
                        node = _s43_unwrap(module, scope, node)
                        if isinstance(node, ast.Call) and (_sum_arg(node, s_name, module)
                                                           or _add_rms_norm_s44h.norm_reads_alias(node, aliases)):  # s44: ``x = s; norm(x)``
                            nc = _norm_call(module, scope, node, S.Ctx(scope, nstmt.lineno))
                            if nc is None:
                                continue
                            if isinstance(ops, str):
                                # a norm that is not RMSNorm is the first reason (the add's form is moot then)
                                yield nstmt, nc.reason if nc.kind == "not_rms" else ops
                            else:
                                yield nstmt, _Site(stmt, aliases, nstmt, nc, ops[0], ops[1], s_name, wrapper)
                            break
        # the norm of an inline sum
        text = "".join(lines[stmt.lineno - 1 : stmt.end_lineno or stmt.lineno])
        if "+" in text and _INLINE_SUM.search(text):
            for node in S.iter_exprs_topdown(stmt.value):  # type: ignore[attr-defined]
                node = _s43_unwrap(module, scope, node)
                if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], (ast.BinOp, ast.Call))):
                    continue
                ops = _operands(module, node.args[0])
                if ops is None:
                    continue
                nc = _norm_call(module, scope, node, S.Ctx(scope, stmt.lineno))
                if nc is None:
                    continue
                if isinstance(ops, str):
                    yield stmt, ops
                else:
                    yield stmt, _Site(stmt, [], stmt, nc, ops[0], ops[1], None)


_PURE_TEST = (ast.Attribute, ast.Name, ast.Compare, ast.Constant, ast.BoolOp, ast.UnaryOp, ast.cmpop, ast.boolop, ast.unaryop, ast.Load)


def _fork(module: ModuleInfo, scope: Scope, stmt: ast.stmt, s_name: str,
          multi: bool = False) -> tuple[ast.If, ast.stmt, NormCall, tuple[ast.stmt, ast.Call]] | None:
    """``if <test without calls>: a = ...norm(s)... else: b = ...norm(s)...``: one simple statement per
    branch, each calling the same norm on the sum (the norm can then run before the test).

    s45 (``multi``): arms that go on after their first statement, and a test that may call ``isinstance`` /
    ``type`` / ``len`` (:func:`_pure_test`): ``if isinstance(self.mlp, MoE): out, aux = self.mlp(self.ln2(x))
    else: out = self.mlp(self.ln2(x)); aux = zero``."""
    if multi:
        if not (isinstance(stmt, ast.If) and stmt.body and stmt.orelse and _pure_test(stmt.test)):
            return None
    elif not (isinstance(stmt, ast.If) and len(stmt.body) == 1 and len(stmt.orelse) == 1
              and all(isinstance(n, _PURE_TEST) for n in ast.walk(stmt.test))):
        return None
    found: list[tuple[ast.stmt, ast.Call]] = []
    for st in (stmt.body[0], stmt.orelse[0]):
        if not (S.simple_stmt(st) and getattr(st, "value", None) is not None):
            return None
        calls = [n for n in S.iter_exprs_topdown(st.value) if isinstance(n, ast.Call) and _sum_arg(n, s_name, module)]  # type: ignore[attr-defined]
        if not calls:
            return None
        found.append((st, calls[0]))
    (a, ca), (b, cb) = found
    if ast.dump(ca) != ast.dump(cb):
        return None  # another norm (or other arguments) on the other path
    nc = _norm_call(module, scope, ca, S.Ctx(scope, a.lineno))
    if nc is None:
        return None
    return stmt, a, nc, (b, cb)


def _in_place_sum(scope: Scope, idx: S.StmtIndex, stmt: ast.stmt) -> tuple[ast.expr, ast.expr] | str | None:
    """(x1, x2) of ``h += r`` when rebinding ``h = h + r`` instead is invisible: ``h`` was assigned in
    this block by the statement just before (a fresh tensor from a call or an expression, not
    another name's tensor, not the caller's argument), so no other name holds the tensor the
    original adds into (MiniMind's ``hidden_states, kv = self.self_attn(...)`` then
    ``hidden_states += residual``). A reason when it may be aliased; None when not ``+=``."""
    if not (isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Add) and isinstance(stmt.target, ast.Name)):
        return None
    name = stmt.target.id
    block, i = idx.block[id(stmt)]
    prev = block[i - 1] if i > 0 else None
    fresh = False
    if isinstance(prev, ast.Assign) and len(prev.targets) == 1 and not isinstance(prev.value, (ast.Name, ast.Attribute, ast.Subscript)):
        t = prev.targets[0]
        names = [t] if isinstance(t, ast.Name) else list(t.elts) if isinstance(t, ast.Tuple) else []
        fresh = any(isinstance(n, ast.Name) and n.id == name for n in names)
    if not fresh:
        return (f"in-place residual add (`{name} += ...`): the tensor `{name}` holds may be shared with another name "
                "or the caller, which see the sum in the original; npufuse rewrites it only right after "
                f"`{name}` is assigned a new tensor")
    if isinstance(stmt.value, ast.Constant):
        return None
    return ast.copy_location(ast.Name(name, ast.Load()), stmt.target), stmt.value


def _is_alias(stmt: ast.stmt, name: str) -> bool:
    """``residual = <sum name>``."""
    return (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
        and stmt.targets[0].id != name
        and isinstance(stmt.value, ast.Name)
        and stmt.value.id == name
    )


def _simple(node: ast.expr) -> bool:
    return isinstance(node, (ast.Name, ast.Attribute)) and dotted(node) is not None


def _build(module: ModuleInfo, scope: Scope, site: _Site) -> Finding | str:
    T = S.torch_name(module) or "torch"
    done = S.already_fused(module, scope, site.norm_stmt)
    if done:
        return done
    if (site.add.end_lineno or 0) and site.add is not site.norm_stmt:
        block, i = S.stmt_index(scope).block[id(site.add)]
        if i > 0 and (block[i - 1].end_lineno or 0) >= site.add.lineno:
            return "statement shares a line with another"
    # an operand spread over lines is valid only inside brackets: it travels in its own parentheses
    # (cut out of them, torchchat's multi-line residual operand gave code that did not parse)
    x1, x2 = (f"({t})" if "\n" in t else t for t in (S.source_of(module, site.x1), S.source_of(module, site.x2)))
    pre: list[str] = []
    if site.branches is not None:
        pre.append(_branch_operands(module, site))
        x1, x2 = "_npu_x1", "_npu_x2"
    elif not (_simple(site.x1) and _simple(site.x2)):
        # evaluate the operands once, in the original order, for the dtype check and both paths
        pre.append(f"_npu_x1, _npu_x2 = {x1}, {x2}")
        x1, x2 = "_npu_x1", "_npu_x2"
    s_name = site.sum_name or "_npu_sum"
    risks = [
        Risk("inference_only", "npu_add_rms_norm has no backward: the fused branch uses it only when autograd is off; "
                               "with grad enabled it runs x1 + x2 then npu_rms_norm (the norm fused, the add not)"),
        Risk("dtype", "npu_add_rms_norm needs x1, x2 and gamma of one dtype (gamma is cast to x1's dtype; "
                      "mixed x1/x2 dtypes take the add + npu_rms_norm path)"),
    ]
    notes: list[str] = []
    conditions: list[str] = []
    confidence = "high"
    weight_base = ""  # the norm's weight parameter (rms kind only)
    folded_scale = None  # s48
    m = site.nc
    ones = f"{T}.ones({x1}.shape[-1], dtype={x1}.dtype, device={x1}.device)"
    if site.wrapper is not None:
        conditions.append(S.source_of(module, site.wrapper.test))
    if site.gap is not None and not site.gap_dtype:
        conditions.append(f"not ({S.source_of(module, site.gap.test)})")
    if (late := _add_rms_norm_s50n.bound_in_span(m, module, scope, site)) is not None:  # s50: a keyword's value tested first
        return late
    width = _add_rms_norm_s45h.on_operand(site.nc.conditions, [S.source_of(module, x) for x in (site.x1, site.x2) if _simple(x)])
    if width is None:  # s45: a width test of the norm's input needs an operand it can read twice
        return (f"norm {m.cls} adapts an input of another width first (`if x.size(-1) != dim`); npufuse tests the width "
                "on an operand of the sum, and neither operand is a plain name it can read a second time")
    conditions += width
    if m.kind == "rms":
        assert m.match is not None
        try:
            p = R.plan_norm(module, m.match, None, x_src=s_name)
        except R.Miss as e:
            return f"norm {m.cls} cannot be fused: {e.reason}"
        except R.NoMatch:
            return f"norm {m.cls} cannot be fused"
        folded_scale = p.params.get("weight_scale")  # s48: a number folded into a float32 gamma
        p = _rms_norm_s48h.on_first_operand(p, s_name, site.x1, _simple(site.x1), T)  # s48: a conditional upcast's dtype test
        if isinstance(p, str):
            return f"norm {m.cls} cannot be fused: {p}"
        if p.condition is not None:
            # a weight applied only when, or a mean dim read at run time: the fused code runs
            # when the condition holds, the original statements otherwise
            conditions.append(p.condition)
        if m.match.weights:
            try:
                w = R.analyse_weight(module, _rms_norm_s48f.main_weight(module, m.match.weights))  # s48: not a folded number
            except R.Miss as e:
                return f"norm {m.cls} cannot be fused: {e.reason}"
            except R.NoMatch:
                return f"norm {m.cls} cannot be fused"
            gamma = R.render_factor(module, w, None)
            weight_base = S.render(module, w.base, w.base_ctx, None)
            if folded_scale:
                gamma = _rms_norm_s48f.folded_gamma(gamma, folded_scale)
            if isinstance(w.node, ast.IfExp):
                gamma = "_npu_w"  # chosen by the plan's if/else (only one side evaluated)
                pre += p.pre[:4]  # the if/else binding _npu_w comes first in the plan's statements
        else:
            gamma = ones
            notes.append("no weight: npu_add_rms_norm gets ones of the last dim as gamma (one small allocation per call)")
        eps = p.params["eps"]
        train_norm = p.expr
        out_code = p.out_dtype
        params = {k: v for k, v in p.params.items() if k != "input"}
        norm_pre = p.pre[4:] if gamma == "_npu_w" else p.pre
        variant = "residual_then_norm" if site.sum_name else "inline_sum"
    elif m.kind == "library":
        # PyTorch's own rms_norm (nn.RMSNorm, or a class whose forward is F.rms_norm): its output
        # has the input's dtype, like npu_add_rms_norm's / npu_rms_norm's
        gamma, eps = m.gamma, m.eps
        out_code = f"{s_name}.dtype"
        if m.ones:
            gamma = ones
            notes.append("no weight: npu_add_rms_norm gets ones of the last dim as gamma (one small allocation per call)")
        train_gamma = f"{T}.ones({s_name}.shape[-1], dtype={s_name}.dtype, device={s_name}.device)" if m.ones else gamma
        train_norm = f"torch_npu.npu_rms_norm({s_name}, {train_gamma}, epsilon={eps})[0]"
        norm_pre = []
        params = {"eps": eps, "weight": None if m.ones else gamma, "weight_offset": 0, "upcast": "float32", "output_dtype": "input"}
        variant = "library_norm"
        weight_base = gamma
    elif m.kind == "l2":
        # x / ||x|| * P (lucidrains' RMSNorm): an RMSNorm with gamma P / sqrt(d) whose eps clamps the
        # norm; the gain may broadcast (per head): fused only where it is one value per feature
        from npufuse.patterns._library_norm import _CLAMP_RISK

        confidence = "medium"
        root = f"({x1}.shape[-1] ** 0.5)"
        gamma = f"{T}.ones({x1}.shape[-1], dtype={T}.float32, device={x1}.device) * ({m.gamma}) / {root}"
        eps = f"float(({m.eps}) / {root}) ** 2"
        out_code = f"{T}.result_type({s_name}, {m.gamma})"
        train_norm = ""  # the module itself in training
        norm_pre = []
        conditions.append(f"{T}.as_tensor({m.gamma}).dim() <= 1")
        params = {"eps": m.eps, "eps_rule": "clamp on the norm", "weight": m.gamma, "weight_offset": 0, "upcast": None,
                  "output_dtype": "result_type(input, gain)"}
        risks.append(_CLAMP_RISK)
        notes.append(f"{m.cls}: F.normalize(x, dim=-1) times a sqrt(d) gain is x / rms(x) * gain / sqrt(d); "
                     "training keeps the module call, only inference is fused")
        variant = "l2_normalize_norm"
    elif m.kind == "probed":
        # s41: a forward the numeric probe proves an RMSNorm on sampled inputs: inference only (training keeps
        # the module call); ranks, dtypes and the weight's shape the probe did not cover take the original path
        confidence = "medium"
        gamma, eps = m.gamma, m.eps
        rule, rank = m.probe
        out_code = {"input": f"{s_name}.dtype", "promote": f"{T}.promote_types({s_name}.dtype, {gamma}.dtype)",
                    "weight": f"{gamma}.dtype", "float32": f"{T}.float32"}[rule]
        train_norm = ""  # the module itself in training
        norm_pre = []
        conditions.append(f"isinstance({gamma}, {T}.Tensor) and {gamma}.dim() == 1")
        unproved = (f" or not 2 <= {x1}.dim() <= {rank} or {x1}.dtype not in ({T}.float16, {T}.bfloat16, {T}.float32)"
                    f" or {x1}.shape[-1] != {gamma}.shape[0]")
        # s43: what the probe assumed of the instance (x1 has the sum's shape: a shape mismatch is tested first)
        unproved += "".join(f" or not ({ast.unparse(_renamed(ast.parse(g, mode='eval').body, '_npu_norm_input', x1))})"
                            for g in m.probe_guards)
        params = {"eps": eps, "weight": gamma, "weight_offset": 0, "upcast": None, "output_dtype": rule, "found_by": "numeric_probe"}
        risks.append(Risk("numerics", f"{m.cls}'s forward is proved an RMSNorm by npufuse's numeric probe on sampled inputs "
                                      "(random x of ranks 2-3, fp32/bf16/fp16, random weights), not by a proof over all inputs"))
        if m.s42_eps_form is not None:
            unproved += _s42_eps_form_terms(m, x1, T, params, risks)
        notes.append(f"norm class {m.cls}: read by the numeric probe; training keeps the module call, only inference is fused")
        variant = "probed_norm"
    elif m.third_party or m.timm:
        confidence = "medium"
        reading = _timm_reading if m.timm else _third_party_reading
        gamma, eps, out_code, check, params, risk, note = reading(m, s_name, T)
        train_norm = ""  # the module itself in training
        norm_pre = []
        risks.append(risk)
        notes.append(note)
        variant = "external_norm"
        conditions.append(check)
    else:
        confidence = "medium"
        mod = m.mod or f"self.{m.attr}"
        offset = 1 if _OFFSET_NAME.search(m.cls) else 0
        gamma = f"(1.0 + {mod}.weight.float())" if offset else f"{mod}.weight"
        eps = f'({mod}.variance_epsilon if hasattr({mod}, "variance_epsilon") else {mod}.eps)'
        out_code = f"{s_name}.dtype" if offset else f"{T}.promote_types({s_name}.dtype, {mod}.weight.dtype)"
        train_norm = ""  # the module itself in training
        norm_pre = []
        params = {"eps": eps, "weight": f"{mod}.weight", "weight_offset": offset, "upcast": "float32",
                  "output_dtype": "input" if offset else "promote(input, weight)"}
        risks.append(Risk("numerics", f"{m.cls} is defined outside this module: assumed HF semantics "
                                      f"(x * rsqrt(mean(x^2) + eps) * {'(1 + weight)' if offset else 'weight'}, "
                                      "eps in .variance_epsilon or .eps); verify with `npufuse verify op` before accepting"))
        notes.append(f"norm class {m.cls} not in this module: training keeps the module call; only inference is fused")
        variant = "external_norm"
        # the assumed attributes are checked where the code runs: a module without them (another
        # norm's parameter names, a mean over another dim) takes the original statements; so does one
        # built without a weight (``weight`` None: the fused code would call ``.to`` on None) and one whose
        # ``offset`` attribute says another gain than the name's (liger's ``LigerRMSNorm(offset=1.0)``)
        conditions.append(f'getattr({mod}, "weight", None) is not None and (hasattr({mod}, "variance_epsilon") or hasattr({mod}, "eps")) '
                          f'and getattr({mod}, "dim", -1) == -1 and getattr({mod}, "offset", {offset}) == {offset}')
    gamma_npu = f"{gamma if _simple_text(gamma) else '(' + gamma + ')'}.to({x1}.dtype)"
    norm_node = m.call
    # -- training (or mixed dtypes): the add, the aliases, the norm as npu_rms_norm (or, for a
    # norm class defined elsewhere, the module itself)
    train: list[str] = [f"{s_name} = {x1} + {x2}"]
    train += [S.stmt_source(module, a) for a in site.aliases]
    if site.cast is not None:
        train.append(S.stmt_source(module, site.cast[0]))
    if train_norm:
        # s48 precision48: npu_rms_norm takes fp16 / bf16 / fp32 only; the sum of a float64 addend (a float64
        # positional table added to an fp32 stream) runs the norm as written (the sum's dtype, read after the add)
        fused_norm = "\n".join([*norm_pre, site.splice_norm(module, lambda call: [(call, train_norm)])])
        as_written = site.splice_norm(module, lambda call: [] if site.sum_name else [(call.args[0], s_name)])
        check = _rms_norm_s48h.dtype_check(s_name, T) + _add_rms_norm_s50n.same_dtype(m, out_code, s_name, s_name)  # s50
        train += [f"if {check}:", S.indent(fused_norm), "else:", S.indent(as_written)]
    else:
        train.append(site.splice_norm(module, lambda call: [] if site.sum_name else [(call.args[0], s_name)]))
    # -- inference: one npu_add_rms_norm (returns y, rstd, x1 + x2)
    y = "_npu_normed" if out_code == f"{s_name}.dtype" else f"_npu_normed.to({out_code})"
    infer: list[str] = []
    if out_code == "_npu_dtype":
        infer += [ln for ln in norm_pre if ln.startswith("_npu_dtype")]
    infer.append(f"_npu_normed, _npu_rstd, {s_name} = torch_npu.npu_add_rms_norm({x1}, {x2}, {gamma_npu}, epsilon={eps})")
    infer += [S.stmt_source(module, a) for a in site.aliases]
    infer.append(site.splice_norm(module, lambda call: [(call, y)]))
    body = list(pre)
    # audit40b: npu_add_rms_norm adds tensors of one shape (its outputs take x1's): an addend that broadcasts
    # (``h + temb_proj(t)[:, :, None, None]``) takes the add, then the fused norm
    mixed = f"{x1}.dtype != {x2}.dtype or {x1}.shape != {x2}.shape" + (unproved if m.kind == "probed" else "")
    if m.kind != "probed":  # s48 precision48: npu_add_rms_norm takes fp16 / bf16 / fp32 only (probed: tested above)
        mixed += f" or {x1}.dtype not in ({T}.float16, {T}.bfloat16, {T}.float32)"
    mixed += _add_rms_norm_s50n.same_dtype(m, out_code, s_name, x1, negate=True)  # s50: x1 has the sum's dtype there
    if folded_scale:
        # s48: npu_add_rms_norm takes gamma in x1's dtype; the float32 product of weight and scale is taken as is only
        # by a float32 x1 (a half x1 takes the add + npu_rms_norm path, whose gamma may be float32)
        mixed += f" or {x1}.dtype != {T}.float32"
    if site.cast is not None:
        mixed += f" or {site.cast[1]} != {x1}.dtype"  # the cast would change the sum: add, cast, then the norm
    if out_code == "_npu_dtype":
        # T5: a weight that is not half keeps the whole norm in fp32; npu_add_rms_norm (gamma cast to
        # x1's dtype) would compute it at x1's precision, so that case takes the npu_rms_norm path
        mixed += f" or {weight_base}.dtype != {x1}.dtype"
    body.append(f"if {T}.is_grad_enabled() or {mixed}:")
    body.append("    # npu_add_rms_norm has no backward and needs one dtype: add, then the fused norm")
    body.append(S.indent("\n".join(train)))
    body.append("else:")
    body.append(S.indent("\n".join(infer)))
    if site.gap is not None and site.gap_dtype:
        # s46h: the gap runs for some dtypes of the sum: tested on the operands, the original statements there
        test = _add_rms_norm_s46h.test_on_operands(site.gap.test, s_name, x1, x2, T)
        gblock, gi = S.stmt_index(scope).block[id(site.add)]
        gj = next((k for k in range(gi, len(gblock)) if gblock[k] is site.last), None)
        if test is None or gj is None:
            return "the statement between the add and the norm tests the sum's dtype in a form npufuse cannot move"
        body = _add_rms_norm_s46h.dtype_arm(pre, body[len(pre):], test, s_name, x1, x2,
                                            S.block_source(module, gblock[gi + 1 : gj + 1]))
    guard = _guard(site)
    if guard is None:
        return "no input tensor live before the site to guard the fused branch on"
    if conditions:
        block, i = S.stmt_index(scope).block[id(site.add)]
        j = next((k for k in range(i, len(block)) if block[k] is site.last), None)
        if site.tail_if is not None:
            # s42: aliases after the add (``residual = x``) are in the ``if`` body with it
            original = "\n".join([S.stmt_source(module, st) for st in (site.add, *site.aliases, site.norm_stmt)])
        elif site.head_if is not None:
            if site.fork is not None:
                return "a run-time condition on a norm inside a switch's fork: not rewritten"  # s45: keep the original whole
            original = "\n".join(S.stmt_source(module, st) for st in (site.add, *site.aliases, site.norm_stmt))
        elif j is None:
            return "the norm is not in the add's block"
        else:
            original = S.block_source(module, block[i : j + 1])
        body = [f"if {' and '.join(conditions)}:", S.indent("\n".join(body)), "else:", S.indent(original)]
        params["condition"] = " and ".join(conditions)
    first_line = site.add.lineno
    if site.tail_if is not None:
        # the statements before the add run as written, then the fused add + norm; where the body
        # does not run, the norm statement as written
        t = site.tail_if
        before = t.body[: t.body.index(site.add)]
        taken = ([S.block_source(module, before)] if before else []) + ["\n".join(body)]
        body = [f"if {S.source_of(module, t.test)}:", S.indent("\n".join(taken))]
        # an ``else``/``elif`` runs as written, then the norm statement
        other = ([_s42_else_source(module, t)] if t.orelse else []) + [S.stmt_source(module, site.norm_stmt)]
        body += ["else:", S.indent("\n".join(other))]
        first_line = t.lineno
    if site.head_if is not None and site.head_arm == "orelse":
        # s45: the norm heads the ``else``: there the fused add + norm, then the arm's other statements; where the
        # test holds the add (and its aliases) as written, then the body
        h = site.head_if
        taken = ["\n".join(body)] + ([S.block_source(module, h.orelse[1:])] if h.orelse[1:] else [])
        other = [S.stmt_source(module, st) for st in (site.add, *site.aliases)] + [S.block_source(module, h.body)]
        body = [f"if {S.source_of(module, h.test)}:", S.indent("\n".join(other)), "else:", S.indent("\n".join(taken))]
    elif site.head_if is not None:
        # where the body runs: the fused add + norm, then the body's other statements as written;
        # elsewhere the add (and its aliases) as written, then the ``else`` if any
        h = site.head_if
        # s46: the body may save the sum before the norm (``if flag: residual = x; x = norm(x)``): its statements
        # after the norm go on as written, and its aliases run only where the body does
        rest = h.body[h.body.index(site.norm_stmt) + 1:] if site.norm_stmt in h.body else h.body[1:]
        taken = ["\n".join(body)] + ([S.block_source(module, rest)] if rest else [])
        outer = [a for a in site.aliases if a not in h.body]
        other = [S.stmt_source(module, st) for st in (site.add, *outer)] + ([_s42_else_source(module, h)] if h.orelse else [])
        body = [f"if {S.source_of(module, h.test)}:", S.indent("\n".join(taken)), "else:", S.indent("\n".join(other))]
    borrowed = module.__dict__.get("_npufuse_borrowed")
    if borrowed:
        # the norm class's file imports names this file does not: the replacement may not use them
        named = {n.id for n in ast.walk(ast.parse("\n".join(body))) if isinstance(n, ast.Name)} & borrowed
        if module.aliases.get("torch") == "torch":
            # s43: ``torch`` itself is no borrowed name: the rewrite's prelude imports it in a file that does not
            # (``from torch import nn`` only: kimi-exp's layers/model.py)
            named.discard("torch")
        if named:
            return f"the replacement would name {', '.join(sorted(named))}, which only the norm class's file imports"
    params.update({"x1": S.source_of(module, site.x1), "x2": S.source_of(module, site.x2), "sum": site.sum_name,
                   "norm": S.source_of(module, m.call.func), "norm_class": m.cls,
                   "residual_aliases": [a.targets[0].id for a in site.aliases if isinstance(a, ast.Assign)]})
    return Finding(
        pattern="add_rms_norm",
        qualname=scope.qualname,
        line=first_line,
        end_line=site.last.end_lineno or site.last.lineno,
        params=params,
        fused="\n".join(body),
        guard_tensor=guard,
        confidence=confidence,
        variant=variant,
        risks=risks,
        notes=notes,
        training_ok=True,  # the emitted code trains (via npu_rms_norm); the API itself is inference-only
    )


def _simple_text(s: str) -> bool:
    return re.fullmatch(r"[\w.]+(\(\))?", s) is not None


def _guard(site: _Site) -> str | None:
    for x in (site.x1, site.x2):
        if isinstance(x, ast.Name):
            return x.id
    for x in (site.x1, site.x2):
        for n in fast_walk(x):
            if isinstance(n, ast.Name) and n.id not in ("self", "torch", "F", "nn"):
                return n.id
    return None


# -- the optional residual of inference engines (lmdeploy / vLLM ``RMSNorm.forward(x, residual=None)``)


@dataclass
class _OptionalResidual:
    test: ast.If  # ``if <r> is not None:``
    sum_name: str  # the name the sum is assigned to
    x1: str
    x2: str
    aliases: list[ast.stmt]  # ``residual = x`` after the sum, inside the ``if``
    names: set[str]  # names holding the sum after the ``if``
    after: list[ast.stmt] = field(default_factory=list)  # ``residual = x`` right after the ``if`` (TGI)
    in_place: bool = False  # ``x += r``: the original adds into the caller's tensor
    residual: str = ""  # s38: the optional residual of the if/else spelling (``if r is None: ... else: ...``)


def _optional_residual(stmt: ast.stmt) -> _OptionalResidual | None:
    """``if r is not None: s = a + b`` (``{a, b}`` names, one of them ``r``) then only aliases of
    ``s``, no ``else``: the residual add that runs when a residual is passed. Also its if/else
    spelling ``if r is None: s = a`` / ``else: s = a + r`` (ppl.pmx's SkipRMSNorm), which binds ``s``
    in both arms: the same values as ``s = a`` then the ``if r is not None`` add."""
    if isinstance(stmt, ast.If) and stmt.orelse:
        return _optional_residual_with_else(stmt)
    if not (isinstance(stmt, ast.If) and not stmt.orelse and stmt.body):
        return None
    t = stmt.test
    if not (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and len(t.ops) == 1 and isinstance(t.ops[0], ast.IsNot)
            and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value is None):
        return None
    r = t.left.id
    add = stmt.body[0]
    if isinstance(add, ast.AugAssign) and isinstance(add.op, ast.Add) and isinstance(add.target, ast.Name) and isinstance(add.value, ast.Name):
        # ``x += r`` adds into the caller's tensor (TGI): see _in_place_optional_residual
        return _in_place_optional_residual(stmt, r, add)
    if not (isinstance(add, ast.Assign) and len(add.targets) == 1 and isinstance(add.targets[0], ast.Name)
            and isinstance(add.value, ast.BinOp) and isinstance(add.value.op, ast.Add)
            and isinstance(add.value.left, ast.Name) and isinstance(add.value.right, ast.Name)):
        return None
    a, b = add.value.left.id, add.value.right.id
    s_name = add.targets[0].id
    if r not in (a, b) or a == b or s_name not in (a, b):
        return None
    aliases = stmt.body[1:]
    if not all(_is_alias(al, s_name) for al in aliases):
        return None
    names = {s_name} | {al.targets[0].id for al in aliases}  # type: ignore[attr-defined]
    return _OptionalResidual(stmt, s_name, a, b, list(aliases), names)


def _optional_residual_with_else(stmt: ast.If) -> _OptionalResidual | None:
    """``if r is None: s = a`` / ``else: s = a + r`` (either operand order), nothing else in the arms."""
    t = stmt.test
    if not (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Is)
            and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value is None
            and len(stmt.body) == 1 and len(stmt.orelse) == 1):
        return None
    r, bare, add = t.left.id, stmt.body[0], stmt.orelse[0]
    if not (isinstance(bare, ast.Assign) and len(bare.targets) == 1 and isinstance(bare.targets[0], ast.Name)
            and isinstance(bare.value, ast.Name) and isinstance(add, ast.Assign) and len(add.targets) == 1
            and isinstance(add.targets[0], ast.Name) and add.targets[0].id == bare.targets[0].id
            and isinstance(add.value, ast.BinOp) and isinstance(add.value.op, ast.Add)
            and isinstance(add.value.left, ast.Name) and isinstance(add.value.right, ast.Name)):
        return None
    a, b, s_name = add.value.left.id, add.value.right.id, bare.targets[0].id
    if {a, b} != {bare.value.id, r} or a == b or s_name in (a, b, r):
        return None
    return _OptionalResidual(stmt, s_name, a, b, [], {s_name}, residual=r)


def _optional_residual_results(module: ModuleInfo, scope: Scope) -> Iterable[Result]:
    idx = S.stmt_index(scope)
    ifs = [(s, o) for s in idx.stmts if isinstance(s, ast.If) for o in [_optional_residual(s)] if o is not None]
    if not ifs:
        return
    results = R.scope_results(module, scope)
    for stmt, o in ifs:
        block, i = idx.block[id(stmt)]
        nxt = _after_aliases(o, block, i)
        for sr in results:
            if sr.finding is None or sr.match is None or nxt is None or not _starts_at(sr, nxt, stmt):
                continue
            if not (isinstance(sr.match.core.x, ast.Name) and sr.match.core.x.id in o.names):
                continue
            r = _build_optional(module, scope, o, sr)
            if isinstance(r, str):
                yield NearMiss("add_rms_norm", scope.qualname, stmt.lineno, sr.finding.end_line, r)
            else:
                yield r
            break


def _build_optional(module: ModuleInfo, scope: Scope, o: _OptionalResidual, sr: R.SiteResult) -> Finding | str:
    """Inference with a residual of x's dtype and gamma of x's dtype: one npu_add_rms_norm (its
    third output is the sum the original keeps as the residual); every other case (training, no
    residual, mixed dtypes) the original add and the rms_norm candidate's own fused code."""
    T = S.torch_name(module) or "torch"
    m, f = sr.match, sr.finding
    assert m is not None and f is not None
    done = S.already_fused(module, scope, o.test)
    if done:
        return done
    before = _reads_before(scope, o, sr)
    if isinstance(before, str):
        return before
    plan = S.plan_span(scope, sr.stmt, _trace_after(m.trace, o.test))
    if isinstance(plan, str):
        return plan
    try:
        p = R.plan_norm(module, m, plan)
    except (R.Miss, R.NoMatch) as e:
        return f"the norm of the sum cannot be fused: {getattr(e, 'reason', '')}".rstrip(": ")
    if p.params.get("weight_scale"):  # s48: a folded scale is npu_rms_norm's only
        return (f"the norm of the sum multiplies its output by `{p.params['weight_scale']}`, a factor npufuse folds into "
                "npu_rms_norm's float32 gamma, not into npu_add_rms_norm's (taken in x1's dtype)")
    # the 1-D weight check and a check of the reduced dim (a dim handed in, ``axis in (-1, ...)``) are taken along
    taken = [c for c in (p.params.get("dim_check"), p.params.get("weight_check")) if c]
    extra = p.condition if p.condition is not None and p.condition != " and ".join(taken) else None
    if extra is not None or p.variant not in ("fp32_output", "weight_then_cast", "cast_then_weight", "no_upcast", "no_weight", "t5"):
        return (f"the norm of the sum is the `{p.variant}` form{' with a run-time condition' if extra else ''}: "
                "npufuse fuses the residual add only into a plain x * rstd * weight norm")
    x = o.sum_name
    has_residual = f"{o.residual} is not None" if o.residual else S.source_of(module, o.test.test)
    conditions = [has_residual, f"not {T}.is_grad_enabled()", f"{o.x1}.dtype == {o.x2}.dtype",
                  f"{o.x1}.dtype in ({T}.float16, {T}.bfloat16, {T}.float32)"]  # s48 precision48: the op's dtypes
    if p.condition is not None:
        cond = ast.parse(p.condition, mode="eval").body
        if any(isinstance(n, ast.Name) and n.id == x for n in ast.walk(cond)):
            # a dim check reading the sum (``axis in (-1, s.dim() - 1)``) is tested before the fused add
            # computes it: read on x1, whose shape the sum has where the two operands' shapes agree
            # (parenthesised: the unparsed text may be an ``or`` joined to the others by ``and``)
            conditions += [f"{o.x1}.shape == {o.x2}.shape", f"({ast.unparse(_renamed(cond, x, o.x1))})"]
        else:
            conditions.append(p.condition)
    if m.weights:
        w = R.analyse_weight(module, m.weights[0])  # a plain weight: the variants above exclude `1 + w` and chosen ones
        base = S.render(module, w.base, w.base_ctx, plan)
        # npu_add_rms_norm takes gamma in x1's dtype: a weight of another dtype would be rounded
        # first (the original multiplies by it in its own precision), so that case is not fused
        conditions.append(f"{base}.dtype == {o.x1}.dtype")
        gamma = f"{base}.reshape(-1)" if w.flatten else base
    else:
        gamma = f"{T}.ones({o.x1}.shape[-1], dtype={o.x1}.dtype, device={o.x1}.device)"
    eps = p.params["eps"]
    y = "_npu_normed"
    after: list[ast.stmt] = []
    end_line = f.end_line
    # t5 (``if w is half: x = x.to(w.dtype)``, then ``w * x``): with the weight in x1's dtype (a
    # condition above) the result has x1's dtype, fp32 and half alike
    if p.out_dtype != f"{p.x}.dtype" and p.variant != "t5":
        # npu_add_rms_norm returns x1's dtype: fused only where the result ends in that dtype, either
        # as the norm's own output or through the cast statement right after it
        # (lmdeploy: ``x = weight.float() * x`` then ``x = x.to(input_dtype)``)
        final = p.out_dtype
        if final == "_npu_dtype":  # the plan names the output dtype in a statement of its own
            final = next((ln.split(" = ", 1)[1] for ln in p.pre if ln.startswith("_npu_dtype = ")), final)
        cast = _cast_after(module, scope, sr.stmt, o.test.lineno)
        if cast is not None:
            after, final = [cast[0]], cast[1]
            end_line = cast[0].end_lineno or cast[0].lineno
        conditions.append(f"{final} == {o.x1}.dtype")
    infer = [f"_npu_normed, _npu_rstd, {x} = torch_npu.npu_add_rms_norm({o.x1}, {o.x2}, {gamma}, epsilon={eps})"]
    infer += [S.stmt_source(module, a) for a in o.aliases + o.after]
    infer += [S.stmt_source(module, k) for k in plan.kept]
    infer.append(S.splice(module, sr.stmt, [(m.node, y)]))
    if before:
        # the rms_norm candidate starts at a dtype read above the ``if`` (kept in place): its fused
        # code holds the ``if`` too; the read runs first here as well (the condition may use it)
        other = [f.fused] + [S.stmt_source(module, a) for a in after]
    else:
        other = [S.stmt_source(module, o.test), *(S.stmt_source(module, a) for a in o.after), f.fused] + [S.stmt_source(module, a) for a in after]
    body = [*(S.stmt_source(module, b) for b in before),
            f"if {' and '.join(conditions)}:", S.indent("\n".join(infer)), "else:",
            "    # training, no residual or mixed dtypes: the add as written, then the fused norm",
            S.indent("\n".join(other))]
    params = {k: v for k, v in p.params.items() if k != "input"}
    params.update({"x1": o.x1, "x2": o.x2, "sum": x, "norm": "inline", "norm_class": "",
                   "residual_aliases": [a.targets[0].id for a in o.aliases],  # type: ignore[attr-defined]
                   "condition": " and ".join(conditions)})
    return Finding(
        pattern="add_rms_norm",
        qualname=scope.qualname,
        line=before[0].lineno if before else o.test.lineno,
        end_line=end_line,
        params=params,
        fused="\n".join(body),
        # the if/else spelling binds the sum only in its arms: the device is read on x1
        guard_tensor=o.x1 if o.residual else f.guard_tensor,
        confidence="high",
        variant="optional_residual",
        risks=[Risk("inference_only", "npu_add_rms_norm has no backward: used only with autograd off; otherwise the add "
                                      "as written and npu_rms_norm"),
               Risk("numerics", "npu_add_rms_norm may normalize the fp32 sum where the original normalizes the sum "
                                "rounded to the input dtype (spec §2.2): <=1-ulp differences"),
               *_in_place_risks(o)],
        notes=["the residual is optional (`if ... is not None`): without one the rms_norm fused code runs"],
        training_ok=True,
    )


def _s42_else_source(module: ModuleInfo, stmt: ast.If) -> str:
    """The source of ``stmt``'s ``else`` block, to run as a block of its own: an ``elif`` chain's text begins with
    ``elif`` (Bagel's ``if mode == "und": .. elif mode == "gen": ..``), which there reads ``if``."""
    text = S.block_source(module, stmt.orelse)
    if len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If) and text.startswith("elif"):
        text = text[2:]
    return text


def _renamed(node: ast.expr, old: str, new: str) -> ast.expr:
    """``node`` with every read of the name ``old`` reading ``new``."""

    class Rename(ast.NodeTransformer):
        def visit_Name(self, n: ast.Name) -> ast.AST:
            return ast.Name(new, n.ctx) if n.id == old else n

    return Rename().visit(node)


def _cast_after(module: ModuleInfo, scope: Scope, stmt: ast.stmt, first_line: int) -> tuple[ast.stmt, str] | None:
    """``t = t.to(<dtype>)`` (or ``.float()``, ``.type_as(u)``) right after ``t = <norm>``: the
    statement and its dtype as source text."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    name = stmt.targets[0].id
    block, i = S.stmt_index(scope).block[id(stmt)]
    nxt = block[i + 1] if i + 1 < len(block) else None
    if not (isinstance(nxt, ast.Assign) and len(nxt.targets) == 1 and isinstance(nxt.targets[0], ast.Name)
            and nxt.targets[0].id == name and S.is_cast(nxt.value) and isinstance(nxt.value.func.value, ast.Name)  # type: ignore[union-attr]
            and nxt.value.func.value.id == name):  # type: ignore[union-attr]
        return None
    cast = nxt.value
    T = S.torch_name(module) or "torch"
    attr = cast.func.attr  # type: ignore[union-attr]
    fixed = {"float": "float32", "half": "float16", "bfloat16": "bfloat16", "double": "float64"}
    if attr in fixed and not cast.args and not cast.keywords:  # type: ignore[union-attr]
        text = f"{T}.{fixed[attr]}"
    elif attr in ("to", "type", "type_as") and len(cast.args) == 1 and not cast.keywords \
            and isinstance(cast.args[0], (ast.Name, ast.Attribute)) and dotted(cast.args[0]):  # type: ignore[union-attr]
        # the dtype as written (``input_dtype`` bound before the residual add, ``torch.bfloat16``):
        # evaluated at the fused statement, so it must not be rebound in between
        arg = cast.args[0]  # type: ignore[union-attr]
        root = dotted(arg).split(".")[0]  # type: ignore[union-attr]
        if root == name or any(root in S.names_written(s) for s in block[: i + 2]
                               if s.lineno >= first_line):
            return None
        if attr == "type_as":
            text = f"{dotted(arg)}.dtype"
        elif isinstance(arg, ast.Attribute) and arg.attr in ("float32", "float16", "bfloat16", "half", "float", "float64"):
            text = dotted(arg)  # type: ignore[assignment]
        elif attr == "to" and isinstance(arg, ast.Name):
            # a name holding a dtype (``input_dtype = x.dtype``); a tensor argument would move devices too
            value, _, _ = S.follow(arg, S.Ctx(scope, nxt.lineno))
            if not (isinstance(value, ast.Attribute) and value.attr == "dtype"):
                return None
            text = arg.id
        else:
            return None
    else:
        return None
    return nxt, text


class AddRmsNorm(Pattern):
    id = "add_rms_norm"
    api = "torch_npu.npu_add_rms_norm"
    title = "residual add + RMSNorm -> npu_add_rms_norm"
    training_ok = False  # the API has no backward; the generated branch trains via npu_rms_norm
    bound = "memory"
    # detect's first text test (a residual add), made once by the scan
    SCOPE_WORDS = ("+",)

    def detect(self, module: ModuleInfo, scope: Scope) -> Iterable[Result]:
        if isinstance(scope.node, ast.Module):
            return
        scope = _add_rms_norm_s47n.closure_as_method(module, scope)  # s47: a closure reading its method's ``self``
        # s46: an engine's add + norm method (``def add_rms_forward(self, x, residual)``), in place or not; its near
        # miss stands only where no other reading of the method gives a result
        engine = _add_rms_norm_s46a.engine_add_norm(module, scope, R._PROBE)
        if isinstance(engine, Finding):
            yield engine
            return
        others = list(self._forms(module, scope)) if engine is not None else None
        if others is None:
            yield from self._forms(module, scope)
            return
        yield from others or [engine]

    def _forms(self, module: ModuleInfo, scope: Scope) -> Iterable[Result]:
        """The results of every add + norm reading but the engine method's."""
        if "+" not in S.scope_text(module, scope):
            return
        # the inference-engine norm (``if residual is not None: x = x + residual; residual = x``
        # then the hand-written norm of ``x``): methods and plain functions alike
        if "is not None" in S.scope_text(module, scope) or ("is None" in S.scope_text(module, scope) and "else" in S.scope_text(module, scope)):
            yield from _optional_residual_results(module, scope)
        if not scope.class_name and not _installed_forward(module, scope) \
                and not _add_rms_norm_s48h.installed_on_gemma(module, scope, _installed_forward):  # s48
            # s42: a plain function adding then calling a norm it is handed (``def _block(x, norm, attn)``), a norm
            # function of the file or F.rms_norm (a functional forward / training step over parameter dicts)
            # s43: or a norm module of an object it is handed (``for layer in model.layers: ... layer.ffn_norm(x)``)
            member = _S43_MEMBER_NORM_TEXT.search(S.scope_text(module, scope)) is not None
            if _s42_norm_parameters(scope) or _s42_norm_call_text(S.scope_text(module, scope)):
                yield from self._s42_function_sites(module, scope, member)
            elif member:
                yield from self._s42_function_sites(module, scope, member)
            # s42: a module-level function of a functional model (CS336's ``transformer_block(.., weights, in_features)``)
            # adding a residual and calling this file's norm helper on the sum: the plain add + norm sites only
            elif _calls_norm_helper(module, scope) and module.helper(scope.qualname) is scope.node:
                for stmt, site in _sites(module, scope):
                    if isinstance(site, _Site) and site.nc.kind == "rms" and isinstance(site.nc.call.func, ast.Name):
                        r = _build(module, scope, site)
                        if not isinstance(r, str):
                            yield r
            return
        for stmt, site in [*_sites(module, scope), *_branch_sum_sites(module, scope), *_cast_sum_misses(module, scope),
                           *_gap_sites(module, scope), *_cast_stmt_sites(module, scope), *_tail_sites(module, scope),
                           *_head_sites(module, scope), *_s42_conditional_sum_sites(module, scope),
                           *_add_rms_norm_s45sweep.switch_arm_sites(module, scope),
                           *_add_rms_norm_s46a.head_sites_after_aliases(module, scope),
                           *_s46h_with_split_misses(module, scope)]:
            yield self._site_result(module, scope, stmt, site)

    def _site_result(self, module: ModuleInfo, scope: Scope, stmt: ast.stmt, site: _Site | str) -> Result:
        """The candidate of one site, or the near miss saying why not."""
        first = (site.tail_if or site.add) if isinstance(site, _Site) else stmt
        if isinstance(site, str):
            return NearMiss(self.id, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, site)
        if site.nc.kind == "not_rms":
            return NearMiss(self.id, scope.qualname, first.lineno, stmt.end_lineno or stmt.lineno, site.nc.reason)
        r = _build(site.nc.home or module, scope, site)
        if isinstance(r, str):
            return NearMiss(self.id, scope.qualname, first.lineno, stmt.end_lineno or stmt.lineno, r)
        return r

    def _s42_function_sites(self, module: ModuleInfo, scope: Scope, member: bool = False) -> Iterable[Result]:
        """The add + norm sites of a plain function (no class) whose norm is called by a plain name (one of its
        parameters, see _s42_parameter_norm, or a norm function of the file) or is F.rms_norm / torch.rms_norm:
        readings that need no ``self``. ``member`` (s43): also a norm module of an object the function is handed
        or builds (``layer.ffn_norm(x)``), read with its run-time class test."""
        for stmt, site in _sites(module, scope):
            if isinstance(site, _Site) and (isinstance(site.nc.call.func, ast.Name) or site.nc.cls == "F.rms_norm"
                                            or member and _s43_guarded_member_norm(site.nc)):
                yield self._site_result(module, scope, stmt, site)

    def assess(self, finding: Finding, config: dict[str, Any]) -> dict[str, Any]:
        hidden = config.get("hidden_size") or config.get("d_model") or config.get("dim")
        ops = ["add"] + list(finding.params.get("unfused_ops") or ["cast", "pow", "mean", "add", "rsqrt", "mul", "cast", "mul"])
        if not isinstance(hidden, int):
            return symbolic(
                "memory",
                f"memory-bound: add + {len(ops) - 1}-kernel norm chain over the T x H residual -> 1 kernel reading x1, x2 "
                "and writing y and the sum (inference); with grad enabled 2 kernels (add + npu_rms_norm); T, H unknown",
            )
        e = R.elem_bytes(config)
        t, tdesc = R.tokens_of(config)
        per, n = R.norm_traffic(ops[1:], e, finding.params.get("upcast") == "float32")
        elems = t * hidden
        return estimate(
            bytes_before=(3 * e + per) * elems,
            bytes_after=4 * e * elems + 4 * t,
            kernels_before=n + 1,
            kernels_after=1,
            flops=5 * elems,
            shapes=f"residual [{tdesc}, hidden {hidden}]; inference path (training: add + npu_rms_norm, 2 kernels)",
        )

    @staticmethod
    def reference(x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 golden: (rms_norm(x1 + x2) * (offset + weight), x1 + x2)."""
        import torch

        s = x1.float() + x2.float()
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + weight_offset), s

    FUSE: list = []
    KEEP: list = []


# --------------------------------------------------------------------------------------------
# examples

_NORM = '''
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

_HF_LAYER = '''
import torch
from torch import nn
''' + _NORM + '''

class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.self_attn = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 2 * hidden_size), nn.SiLU(), nn.Linear(2 * hidden_size, hidden_size))
        self.input_layernorm = LlamaRMSNorm(hidden_size, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden_size, eps=eps)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states)
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states
'''

_RUN_TRAIN = '''
layer = LlamaDecoderLayer(32, eps=1e-5){cast}
with torch.no_grad():
    layer.post_attention_layernorm.weight.normal_()
x = torch.randn(2, 5, 32{dtype}, requires_grad=True)
out = layer(x)
leaves = [x, layer.post_attention_layernorm.weight, layer.self_attn.weight]
'''

_RUN_INFER = '''
layer = LlamaDecoderLayer(32, eps=1e-5){cast}
with torch.no_grad():
    layer.post_attention_layernorm.weight.normal_()
    x = torch.randn(3, 4, 32{dtype})
    out = layer(x)
'''

_META_BLOCK = '''
import torch
import torch.nn.functional as F
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


class TransformerBlock(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.attention = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, 3 * dim, bias=False)
        self.w2 = nn.Linear(3 * dim, dim, bias=False)
        self.attention_norm = RMSNorm(dim, eps=eps)
        self.ffn_norm = RMSNorm(dim, eps=eps)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        out = h + self.w2(F.silu(self.w1(self.ffn_norm(h))))
        return out
'''

_GEMMA_SANDWICH = '''
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
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.self_attn = nn.Linear(d, d, bias=False)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps=eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps=eps)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.self_attn(hidden_states)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        return hidden_states, residual
'''

_EXTERNAL = '''
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm


class MyDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn = nn.Linear(config.hidden_size, config.hidden_size)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.attn(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return hidden_states, residual
'''

_T5_FF = '''
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
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ff = nn.Linear(d, d)
        self.dropout = nn.Dropout(0.0)
        self.final_layer_norm = T5LayerNorm(d)

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.dropout(self.ff(hidden_states))
        hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states
'''

_MINICPM_SCALED = '''
import math
import torch
from torch import nn


class MiniCPMRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
        return (self.weight * (hidden_states.float() * torch.rsqrt(variance + self.variance_epsilon))).to(hidden_states.dtype)


class MiniCPMDecoderLayer(nn.Module):
    def __init__(self, d, scale_depth, num_hidden_layers):
        super().__init__()
        self.self_attn = nn.Linear(d, d)
        self.post_attention_layernorm = MiniCPMRMSNorm(d)
        self.scale_depth = scale_depth
        self.num_hidden_layers = num_hidden_layers

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.self_attn(hidden_states)
        hidden_states = residual + hidden_states * (self.scale_depth / math.sqrt(self.num_hidden_layers))
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return hidden_states, residual
'''


_MULTILINE_OPERAND = '''
import torch
from torch import nn


class TransformerBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attention = nn.Linear(dim, dim)
        self.feed_forward = nn.Linear(dim, dim)
        self.ffn_norm = nn.RMSNorm(dim, 1e-5)
        self.attention_norm = nn.RMSNorm(dim, 1e-5)
        self.residual_multiplier = 0.5

    def forward(self, x):
        h = (
            x
            + self.attention(
                self.attention_norm(x),
            )
            * self.residual_multiplier
        )
        out = h + self.feed_forward(self.ffn_norm(h)) * self.residual_multiplier
        return out
'''

AddRmsNorm.FUSE = [
    # an operand spread over lines inside the parentheses it came from (torchchat's block): it is
    # bound as a whole expression, not cut out of its brackets (that did not parse)
    Fuse(_MULTILINE_OPERAND, expect={"x1": "x"}, name="multiline_parenthesised_operand",
         run="b = TransformerBlock(16)\nwith torch.no_grad():\n    out = b(torch.randn(2, 3, 16))\n"),
    Fuse(
        _HF_LAYER,
        expect={"x1": "residual", "x2": "hidden_states", "sum": "hidden_states", "norm": "self.post_attention_layernorm",
                "eps": "self.post_attention_layernorm.variance_epsilon", "weight": "self.post_attention_layernorm.weight",
                "weight_offset": 0, "residual_aliases": ["residual"], "qualname": "LlamaDecoderLayer.forward", "line": 31, "end_line": 35},
        run=_RUN_TRAIN.format(cast="", dtype=""),
        name="hf_llama_layer_training",
    ),
    Fuse(_HF_LAYER, expect={"variant": "residual_then_norm"}, run=_RUN_INFER.format(cast="", dtype=""), name="hf_llama_layer_inference_fp32"),
    Fuse(_HF_LAYER, expect={"output_dtype": "promote(input, weight)"}, run=_RUN_INFER.format(cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16"),
         name="hf_llama_layer_inference_bf16"),
    Fuse(_HF_LAYER, expect={"confidence": "high"}, run=_RUN_TRAIN.format(cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16"),
         name="hf_llama_layer_training_bf16"),
    Fuse(
        _META_BLOCK,
        expect={"x1": "x", "x2": "self.attention(self.attention_norm(x))", "sum": "h", "norm": "self.ffn_norm", "eps": "self.ffn_norm.eps",
                "residual_aliases": []},
        run="blk = TransformerBlock(16, 1e-5)\nx = torch.randn(2, 3, 16, requires_grad=True)\nout = blk(x)\nleaves = [x, blk.ffn_norm.weight]\n",
        name="meta_llama_block",
    ),
    Fuse(
        _GEMMA_SANDWICH,
        expect={"weight_offset": 1, "norm": "self.pre_feedforward_layernorm", "output_dtype": "input"},
        run="m = Gemma2DecoderLayer(16)\nwith torch.no_grad():\n    m.pre_feedforward_layernorm.weight.normal_()\n    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)\n    m = m.to(torch.bfloat16)\n    out = m(x)\n",
        name="gemma_sandwich_one_plus_weight_bf16",
    ),
    Fuse(
        _EXTERNAL,
        expect={"confidence": "medium", "variant": "external_norm", "norm_class": "LlamaRMSNorm"},
        name="norm_class_from_another_module",
    ),
    Fuse(
        _T5_FF,
        expect={"x1": "hidden_states", "x2": "self.dropout(self.ff(hidden_states))", "norm": "self.final_layer_norm"},
        run="m = Block(16)\nx = torch.randn(2, 5, 16, requires_grad=True)\nout = m(x)\nleaves = [x, m.final_layer_norm.weight]\n",
        name="t5_style_dropout_residual",
    ),
    Fuse(
        _T5_FF,
        expect={"norm_class": "T5LayerNorm"},
        # inference with bf16 activations and the norm's weight kept in fp32: the original returns an
        # fp32-precise result; out is the part of it bf16 cannot hold (all zero if the fused code ran
        # the norm at bf16 precision, as npu_add_rms_norm with gamma cast to x1's dtype would)
        run="m = Block(16)\nwith torch.no_grad():\n    m.final_layer_norm.weight.normal_()\n    m.ff.to(torch.bfloat16)\n"
            "    x = torch.randn(2, 5, 16).to(torch.bfloat16)\n    y = m(x)\n    out = (y - y.to(torch.bfloat16).float()) * 1000\n",
        name="t5_fp32_weight_bf16_inference_keeps_fp32",
    ),
    Fuse(
        _MINICPM_SCALED,
        # a scaled residual branch is still x1 + x2: x2 = hidden_states * scale, evaluated once
        expect={"x1": "residual", "x2": "hidden_states * (self.scale_depth / math.sqrt(self.num_hidden_layers))", "sum": "hidden_states"},
        run="layer = MiniCPMDecoderLayer(16, 1.4, 4)\nx = torch.randn(2, 3, 16, requires_grad=True)\nout = layer(x)\nleaves = [x, layer.post_attention_layernorm.weight]\n",
        name="minicpm_scaled_residual_training",
    ),
    Fuse(
        _MINICPM_SCALED,
        expect={"variant": "residual_then_norm"},
        run="layer = MiniCPMDecoderLayer(16, 1.4, 4).to(torch.bfloat16)\nwith torch.no_grad():\n    layer.post_attention_layernorm.weight.normal_()\n    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)\n    out = layer(x)\n",
        name="minicpm_scaled_residual_inference_bf16",
    ),
]

AddRmsNorm.KEEP = [
    Keep(
        '''
import torch
from torch import nn


class GPTNeoXLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attention = nn.Linear(d, d)
        self.post_attention_layernorm = nn.LayerNorm(d, eps=1e-5)
        self.mlp = nn.Linear(d, d)

    def forward(self, hidden_states):
        attn_output = self.attention(hidden_states)
        attn_output = attn_output + hidden_states
        mlp_output = self.mlp(self.post_attention_layernorm(attn_output))
        return mlp_output + attn_output
''',
        reason="not RMSNorm",
        name="gpt_neox_layernorm",
    ),
    Keep(
        '''
import torch
from torch import nn


class CohereLayerNorm(nn.Module):
    def __init__(self, hidden_size=None, eps=1e-5):
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


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mix = nn.Linear(d, d)
        self.norm = CohereLayerNorm(d)

    def forward(self, x):
        h = x + self.mix(x)
        return self.norm(h)
''',
        reason="not RMSNorm",
        name="hand_written_layernorm_class",
    ),
    Keep(
        '''
import torch
from torch import nn
''' + _NORM + '''

class PreNormLayer(nn.Module):
    """The norm reads the layer input, not a residual sum: nothing to fuse with an add."""

    def __init__(self, d):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(d)
        self.proj = nn.Linear(d, d)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        return residual + self.proj(hidden_states)
''',
        name="norm_of_layer_input",
    ),
    Keep(
        '''
import torch
from torch import nn
''' + _NORM + '''

class LayerWithWork(nn.Module):
    """Something else happens to the sum between the add and the norm."""

    def __init__(self, d):
        super().__init__()
        self.norm = LlamaRMSNorm(d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, y):
        h = x + y
        h = torch.clamp(h, -100, 100)
        return self.norm(h)
''',
        name="sum_modified_before_norm",
    ),
]


# -- issue 14, class 1: PyTorch's own RMSNorm after a residual add ------------------------------

_LIBRARY_BLOCK = '''
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor):
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.ffn = nn.Linear(dim, dim)
        self.attn_norm = RMSNorm(dim)
        self.ffn_norm = NORM

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        x = x + self.ffn(self.ffn_norm(x))
        return x
'''

_LIBRARY_RUN = '''
blk = Block(32){cast}
with torch.no_grad():
    blk.ffn_norm.weight.normal_()
x = torch.randn(2, 5, 32{dtype}, requires_grad=True)
{ctx}out = blk(x)
leaves = {leaves}
'''

AddRmsNorm.FUSE += [
    Fuse(_LIBRARY_BLOCK.replace("NORM", "RMSNorm(dim)"),
         expect={"variant": "library_norm", "weight": "self.ffn_norm.weight", "eps": "(self.ffn_norm.eps if self.ffn_norm.eps is not None else torch.finfo(torch.float32).eps)",
                 "norm_class": "RMSNorm", "line": 27, "end_line": 28},
         run=_LIBRARY_RUN.format(cast="", dtype="", ctx="", leaves="[x, blk.ffn_norm.weight]"),
         name="deepseek_v3_f_rms_norm_class_training"),
    Fuse(_LIBRARY_BLOCK.replace("NORM", "nn.RMSNorm(dim, eps=1e-5)"),
         expect={"variant": "library_norm", "eps": "1e-5", "norm_class": "nn.RMSNorm"},
         run=_LIBRARY_RUN.format(cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16", ctx="torch.set_grad_enabled(False)\n", leaves="[]")
         + "torch.set_grad_enabled(True)\n",
         name="nn_rmsnorm_inference_bf16"),
    Fuse(_LIBRARY_BLOCK.replace("NORM", "nn.RMSNorm(dim, elementwise_affine=False)"),
         expect={"variant": "library_norm", "weight": None, "norm_class": "nn.RMSNorm (elementwise_affine=False)"},
         run=_LIBRARY_RUN.replace("    blk.ffn_norm.weight.normal_()\n", "    pass\n").format(cast="", dtype="", ctx="", leaves="[x]"),
         name="s42_nn_rmsnorm_without_weight"),
]

AddRmsNorm.KEEP += [
    # s42: a weightless nn.RMSNorm is fused with ones as gamma (see _s42_weightless_library_norm); a weight flag
    # npufuse cannot read keeps it (whether there is a weight is not known)
    Keep(_LIBRARY_BLOCK.replace("NORM", "nn.RMSNorm(dim, elementwise_affine=dim > 8)"), name="nn_rmsnorm_weight_unknown"),
]


# -- issue 14, class 1: norms spelled as bare function calls, weightless, conditional -----------

_BARE_FUNCTION_NORM = '''
import torch
import torch.nn.functional as F
from torch import nn


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class Block(nn.Module):
    """nanochat: a parameter-free norm function on the residual stream."""

    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d, bias=False)
        self.mlp = nn.Linear(d, d, bias=False)

    def forward(self, x):
        x = x + self.attn(norm(x))
        x = x + self.mlp(norm(x))
        return x
'''

_INLINE_LIBRARY_NORM = '''
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """modded-nanogpt: F.rms_norm written inline, no weight."""

    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d, bias=False)
        self.mlp = nn.Linear(d, d, bias=False)

    def forward(self, x):
        x = x + self.attn(F.rms_norm(x, (x.size(-1),)))
        x = x + self.mlp(F.rms_norm(x, (x.size(-1),), eps=1e-5))
        return x
'''

_DIM_NORM_BLOCK = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
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
    """lit-llama: the norm's mean dim is an attribute (-1 unless a caller passes another)."""

    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d, bias=False)
        self.mlp = nn.Linear(d, d, bias=False)
        self.rms_1 = RMSNorm(d)
        self.rms_2 = RMSNorm(d)

    def forward(self, x):
        h = self.attn(self.rms_1(x))
        x = x + h
        x = x + self.mlp(self.rms_2(x))
        return x
'''

_OPTIONAL_GEMMA_NORM = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
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


class Layer(nn.Module):
    """gemma_pytorch Gemma2: an optional pre-feedforward norm, called under ``is not None``."""

    def __init__(self, d, use_pre_ffw_norm=True):
        super().__init__()
        self.self_attn = nn.Linear(d, d, bias=False)
        self.mlp = nn.Linear(d, d, bias=False)
        self.pre_feedforward_layernorm = RMSNorm(d) if use_pre_ffw_norm else None

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.self_attn(hidden_states)
        hidden_states = residual + hidden_states

        residual = hidden_states
        if self.pre_feedforward_layernorm is not None:
            hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states
'''

_NESTED_HELPER_BLOCK = '''
import torch
from torch import nn


def rmsnorm(x, eps):
    def _norm(y):
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)

    return _norm(x.float()).type_as(x)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rmsnorm(x, self.eps) * self.weight


class TransformerBlock(nn.Module):
    """llama4: the norm module wraps a helper that defines a nested ``_norm``."""

    def __init__(self, d):
        super().__init__()
        self.attention = nn.Linear(d, d, bias=False)
        self.feed_forward = nn.Linear(d, d, bias=False)
        self.attention_norm = RMSNorm(d, eps=1e-5)
        self.ffn_norm = RMSNorm(d, eps=1e-5)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        out = h + self.feed_forward(self.ffn_norm(h))
        return out
'''

_RUN_BLOCK = '''
blk = {ctor}{cast}
x = torch.randn(2, 5, 32{dtype}, requires_grad={grad})
{pre}out = blk(x)
leaves = {leaves}
'''


def _run_block(ctor: str, *, bf16: bool = False, train: bool = True, leaves: str = "[x]", extra: str = "") -> str:
    pre = "" if train else "torch.set_grad_enabled(False)\n"
    code = _RUN_BLOCK.format(ctor=ctor, cast=".to(torch.bfloat16)" if bf16 else "", dtype=", dtype=torch.bfloat16" if bf16 else "",
                             grad=train, pre=extra + pre, leaves=leaves if train else "[]")
    return code + ("" if train else "torch.set_grad_enabled(True)\n")


AddRmsNorm.FUSE += [
    Fuse(_BARE_FUNCTION_NORM, expect={"variant": "library_norm", "norm": "norm", "weight": None, "x1": "x", "sum": "x", "line": 20, "end_line": 21},
         run=_run_block("Block(32)"), name="bare_function_weightless_norm_training"),
    Fuse(_BARE_FUNCTION_NORM, expect={"norm_class": "norm"}, run=_run_block("Block(32)", bf16=True, train=False),
         name="bare_function_weightless_norm_inference_bf16"),
    Fuse(_INLINE_LIBRARY_NORM, expect={"variant": "library_norm", "norm": "F.rms_norm", "eps": "1e-5", "weight": None},
         run=_run_block("Block(32)", bf16=True, train=False), name="inline_f_rms_norm_inference_bf16"),
    Fuse(_DIM_NORM_BLOCK, expect={"condition": "self.rms_2.dim == -1", "norm": "self.rms_2", "weight": "self.rms_2.scale"},
         run=_run_block("Block(32)", leaves="[x, blk.rms_2.scale]",
                        extra="with torch.no_grad():\n    blk.rms_2.scale.normal_()\n"),
         name="dim_attribute_norm_training"),
    Fuse(_DIM_NORM_BLOCK, expect={"dim_check": "self.rms_2.dim == -1"},
         run=_run_block("Block(32)", bf16=True, train=False), name="dim_attribute_norm_inference_bf16"),
    Fuse(_OPTIONAL_GEMMA_NORM, expect={"condition": "self.pre_feedforward_layernorm is not None", "variant": "residual_then_norm",
                                       "weight": "1 + self.pre_feedforward_layernorm.weight.float() if self.pre_feedforward_layernorm.add_unit_offset else self.pre_feedforward_layernorm.weight.float()"},
         run=_run_block("Layer(32)", bf16=True, train=False,
                        extra="with torch.no_grad():\n    blk.pre_feedforward_layernorm.weight.normal_()\n")
         + "out = (out, Layer(32, use_pre_ffw_norm=False).to(torch.bfloat16)(x))\n",
         name="optional_norm_under_is_not_none"),
    Fuse(_OPTIONAL_GEMMA_NORM, expect={"norm": "self.pre_feedforward_layernorm"},
         run=_run_block("Layer(32)", leaves="[x, blk.pre_feedforward_layernorm.weight]"),
         name="optional_norm_under_is_not_none_training"),
    Fuse(_NESTED_HELPER_BLOCK, expect={"norm": "self.ffn_norm", "eps": "self.ffn_norm.eps", "sum": "h"},
         run=_run_block("TransformerBlock(32)", leaves="[x, blk.ffn_norm.weight]"), name="nested_helper_norm_training"),
    Fuse(_NESTED_HELPER_BLOCK, expect={"weight": "self.ffn_norm.weight"},
         run=_run_block("TransformerBlock(32)", bf16=True, train=False), name="nested_helper_norm_inference_bf16"),
]

AddRmsNorm.KEEP += [
    Keep(
        _BARE_FUNCTION_NORM.replace("return F.rms_norm(x, (x.size(-1),))",
                                    "return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)"),
        reason="is not RMSNorm",
        name="bare_function_layernorm",
    ),
    Keep(
        # over the last two dims: ones of the last dim would be the wrong gamma
        _INLINE_LIBRARY_NORM.replace("(x.size(-1),)", "x.shape[-2:]"),
        name="inline_f_rms_norm_over_two_dims",
    ),
]

# s36: a mean dim a constructor may pass is read at run time (the last dim as -1 or rank - 1):
# the block built with dim 1 runs the original, the one built with -1 the fused op
AddRmsNorm.FUSE += [
    Fuse(
        _DIM_NORM_BLOCK.replace("def __init__(self, d):\n        super().__init__()\n        self.attn",
                                "def __init__(self, d, over=-1):\n        super().__init__()\n        self.attn")
        .replace("self.rms_2 = RMSNorm(d)", "self.rms_2 = RMSNorm(d, over)"),
        expect={"dim_check": "self.rms_2.dim in (-1, (-1,), x.dim() - 1)", "norm": "self.rms_2"},
        run=_run_block("Block(32)", bf16=True, train=False) + "out = (out, Block(32, 1).to(torch.bfloat16)(x))\n",
        name="s36_dim_attribute_passed_by_a_constructor_guarded",
    ),
]

_INLINE_SUM_LIBRARY = '''
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.RMSNorm):
    """A configurable nn.RMSNorm (no forward of its own)."""

    def __init__(self, dim):
        super().__init__(dim, eps=1e-5)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mix = nn.Linear(d, d, bias=False)
        self.w = nn.Parameter(torch.ones(d))
        self.norm = RMSNorm(d)

    def forward(self, x):
        h = self.mix(x)
        y = F.rms_norm(x + h, (x.size(-1),), self.w, 1e-6)
        z = x + y
        return y, self.norm(z)
'''

AddRmsNorm.FUSE += [
    Fuse(_INLINE_SUM_LIBRARY, expect={"variant": "library_norm", "weight": "self.w", "eps": "1e-6", "sum": None, "x2": "h"},
         run=_run_block("Block(32)", bf16=True, train=False, extra="with torch.no_grad():\n    blk.w.normal_()\n    blk.norm.weight.normal_()\n"),
         name="inline_sum_in_f_rms_norm_and_nn_rmsnorm_subclass"),
    Fuse(_INLINE_SUM_LIBRARY, expect={"norm": "F.rms_norm"},
         run=_run_block("Block(32)", leaves="[x, blk.w, blk.norm.weight]"),
         name="inline_sum_in_f_rms_norm_training"),
]

_FUNCTION_WITH_WEIGHT = '''
import torch
from torch import nn


def rms_norm(x, weight, eps: float = 1e-6):
    x_fp32 = x.float()
    normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


class Block(nn.Module):
    """A functional norm helper taking its weight and eps as arguments."""

    def __init__(self, d, rms=True):
        super().__init__()
        self.mix = nn.Linear(d, d, bias=False)
        self.w = nn.Parameter(torch.ones(d))
        self.norm = nn.RMSNorm(d, eps=1e-5) if rms else nn.LayerNorm(d)

    def forward(self, x):
        h = x + self.mix(x)
        y = rms_norm(h, self.w, eps=1e-5)
        z = y + x
        return self.norm(z)
'''

AddRmsNorm.FUSE += [
    Fuse(_FUNCTION_WITH_WEIGHT, expect={"norm": "rms_norm", "weight": "self.w", "eps": "1e-05", "sum": "h", "line": 22, "end_line": 23},
         run=_run_block("Block(32)", leaves="[x, blk.w]", extra="with torch.no_grad():\n    blk.w.normal_()\n"),
         name="function_norm_with_weight_and_eps_arguments"),
    Fuse(_FUNCTION_WITH_WEIGHT, expect={"norm": "rms_norm"},
         run=_run_block("Block(32)", bf16=True, train=False, extra="with torch.no_grad():\n    blk.w.normal_()\n")
         + "out = (out, Block(32, rms=False).to(torch.bfloat16)(x))\n",
         name="function_norm_and_rmsnorm_or_layernorm_inference_bf16"),
]


# -- an in-place residual add (`h += residual`) right after h gets a new tensor (issue 14) --------------

_IN_PLACE_ADD = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return (self.weight * self.norm(x.float())).type_as(x)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.mlp = nn.Linear(dim, dim)
        self.input_layernorm = RMSNorm(dim)
        self.post_attention_layernorm = RMSNorm(dim)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.attn(self.input_layernorm(hidden_states))
        hidden_states += residual
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states
'''

AddRmsNorm.FUSE += [
    Fuse(_IN_PLACE_ADD, expect={"sum": "hidden_states", "x1": "hidden_states", "x2": "residual", "line": 30, "end_line": 31},
         run=_run_block("Block(32)"), name="in_place_residual_add_training"),
    Fuse(_IN_PLACE_ADD, expect={"sum": "hidden_states"}, run=_run_block("Block(32)", bf16=True, train=False),
         name="in_place_residual_add_inference_bf16"),
]

AddRmsNorm.KEEP += [
    Keep(
        # the tensor added into is also held by `kept`, which sees the sum in the original: rebinding
        # the name to a new tensor would change what `kept` holds
        _IN_PLACE_ADD.replace("        hidden_states += residual\n", "        kept = hidden_states\n        hidden_states += residual\n")
                     .replace("        return hidden_states\n", "        return hidden_states, kept\n"),
        reason="in-place residual add",
        name="in_place_add_into_an_aliased_tensor",
    ),
]


# -- a norm with an optional bias after it, and an optional upcast (issue 14) ----------------------

_OPTIONAL_SHIFT = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, emb_dim, eps=1e-6, bias=False, qwen3_compatible=True):
        super().__init__()
        self.eps = eps
        self.qwen3_compatible = qwen3_compatible
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim)) if bias else None

    def forward(self, x):
        input_dtype = x.dtype

        if self.qwen3_compatible:
            x = x.to(torch.float32)

        variance = x.pow(2).mean(dim=-1, keepdim=True)
        norm_x = x * torch.rsqrt(variance + self.eps)
        norm_x = norm_x * self.scale

        if self.shift is not None:
            norm_x = norm_x + self.shift

        return norm_x.to(input_dtype)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.att = nn.Linear(d, d)
        self.ff = nn.Linear(d, d)
        self.norm1 = RMSNorm(d, eps=1e-6)
        self.norm2 = RMSNorm(d, eps=1e-6)

    def forward(self, x):
        shortcut = x
        x = self.norm1(x)
        x = self.att(x)
        x = x + shortcut

        shortcut = x
        x = self.norm2(x)
        x = self.ff(x)
        x = x + shortcut
        return x
'''

AddRmsNorm.FUSE += [
    Fuse(_OPTIONAL_SHIFT, expect={"sum": "x", "residual_aliases": ["shortcut"], "condition": "not (self.norm2.shift is not None)",
                                  "line": 42, "end_line": 45},
         run=_run_block("Block(32)", bf16=True), name="norm_with_optional_shift_training_bf16"),
    Fuse(_OPTIONAL_SHIFT, expect={"sum": "x"},
         run=_run_block("Block(32)", train=False) + "out = (out, RMSNorm(32, bias=True)(x))\n",
         name="norm_with_optional_shift_inference"),
]

AddRmsNorm.KEEP += [
    Keep(
        # lucidrains: the norms are unpacked from a ModuleList in the loop; where the list comes from a
        # function (not read), which module sits at each position is unknown: a near miss saying so (not a
        # silent skip). Built in ``__init__`` it is read (s32, ``s32_unpacked_*``)
        '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.g


def make_layers(dim, depth):
    return nn.ModuleList([nn.ModuleList([RMSNorm(dim), nn.Linear(dim, dim), RMSNorm(dim), nn.Linear(dim, dim)]) for _ in range(depth)])


class Transformer(nn.Module):
    def __init__(self, dim, depth):
        super().__init__()
        self.layers = make_layers(dim, depth)

    def forward(self, x):
        for attn_norm, attn, ff_norm, ff in self.layers:
            x = attn(attn_norm(x)) + x
            x = ff(ff_norm(x)) + x
        return x
''',
        reason="unpacked from `self.layers` in a loop",
        name="norm_unpacked_from_a_module_list_in_a_loop",
    ),
]


# -- issue 14, class 1: the optional residual of inference engines ------------------------------
# ``forward(x, weight, residual=None)``: the add runs only when a residual is passed, the norm is
# written out in the same function, and (normed, residual) is returned.

_OPTIONAL_RESIDUAL = '''
import torch


class NormImpl:
    def __init__(self, eps: float = 1e-6):
        self.eps = eps

    def forward(self, x, weight, residual=None):
        input_dtype = x.dtype
        if residual is not None:
            x = x + residual
            residual = x
        x = x.to(torch.float32)
        variance = x.square().mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        x = weight.to(torch.float32) * x
        x = x.to(input_dtype)
        if residual is None:
            return x
        return x, residual
'''

_OPTIONAL_RESIDUAL_FUNCTION = '''
import torch


def fused_add_norm(hidden, weight, residual=None, eps: float = 1e-5):
    """The sum kept in ``residual``, then aliased back to the name the norm reads."""
    if residual is not None:
        residual = residual + hidden
        hidden = residual
    var = torch.mean(hidden.float() ** 2, dim=-1, keepdim=True)
    out = hidden * torch.rsqrt(var + eps)
    return out * weight, residual
'''

_RUN_OPTIONAL = '''
w = torch.randn(32, dtype=torch.bfloat16, requires_grad=True)
x = torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)
r = torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)
n = NormImpl(1e-5)
with torch.no_grad():
    infer = n.forward(x, w, r)
    alone = n.forward(x, w)
out = (infer, alone, n.forward(x, w, r))
leaves = [x, w, r]
'''

_RUN_OPTIONAL_FUNCTION = '''
w = torch.randn(32, requires_grad=True)
x = torch.randn(2, 5, 32, requires_grad=True)
r = torch.randn(2, 5, 32, requires_grad=True)
with torch.no_grad():
    infer = fused_add_norm(x, w, r)
out = (infer, fused_add_norm(x, w, r)[0], fused_add_norm(x, w)[0])
leaves = [x, w, r]
'''

AddRmsNorm.FUSE += [
    Fuse(
        _OPTIONAL_RESIDUAL,
        expect={"variant": "optional_residual", "x1": "x", "x2": "residual", "sum": "x", "residual_aliases": ["residual"],
                "weight": "weight", "qualname": "NormImpl.forward",
                "condition": "residual is not None and not torch.is_grad_enabled() and x.dtype == residual.dtype "
                             "and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and (weight is None or weight.dim() == 1) and weight.dtype == x.dtype and input_dtype == x.dtype"},
        run=_RUN_OPTIONAL,
        name="optional_residual_inference_engine_method",
    ),
    Fuse(
        _OPTIONAL_RESIDUAL_FUNCTION,
        expect={"variant": "optional_residual", "x1": "residual", "x2": "hidden", "sum": "residual", "residual_aliases": ["hidden"],
                "qualname": "fused_add_norm"},
        run=_RUN_OPTIONAL_FUNCTION,
        name="optional_residual_plain_function_sum_in_residual",
    ),
]

AddRmsNorm.KEEP += [
    Keep(
        # the norm of the sum is modulated by a per-sample factor: the add is left to the original
        _OPTIONAL_RESIDUAL_FUNCTION.replace("def fused_add_norm(hidden, weight,", "def fused_add_norm(hidden, scale,")
        .replace("return out * weight, residual", "return out * (1 + scale[:, None]), residual"),
        reason="fuses the residual add only into a plain x * rstd * weight norm",
        name="optional_residual_modulated_norm",
    ),
]


# -- issue 14, class 1: the norm of the sum in both branches of a configuration ``if`` -----------
# (sandwich / MoE-or-dense blocks): the norm runs once before the test on the fused path.

_FORKED_BLOCK = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class SandwichBlock(nn.Module):
    def __init__(self, dim, use_moe=False):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.attn_out_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)
        self.dense = nn.Linear(dim, dim)
        self.experts = nn.Linear(dim, dim)
        self.use_moe = use_moe

    def forward(self, x, gate):
        h = x + gate.tanh() * self.attn_out_norm(self.attn(x))
        if self.use_moe:
            out = h + self.experts(self.ffn_norm(h))
        else:
            out = h + self.dense(self.ffn_norm(h))
        return out
'''

AddRmsNorm.FUSE += [
    Fuse(
        _FORKED_BLOCK,
        expect={"variant": "residual_then_norm", "sum": "h", "norm": "self.ffn_norm", "qualname": "SandwichBlock.forward"},
        run=("b = SandwichBlock(16)\nb2 = SandwichBlock(16, use_moe=True)\nwith torch.no_grad():\n    b.ffn_norm.weight.normal_()\n"
             "    x = torch.randn(2, 3, 16)\n    g = torch.randn(2, 1, 16)\n    infer = (b(x, g), b2(x, g))\n"
             "xt = torch.randn(2, 3, 16, requires_grad=True)\nout = (infer, b(xt, g), b2(xt, g))\nleaves = [xt, b.ffn_norm.weight]\n"),
        name="norm_of_the_sum_in_both_branches",
    ),
]

AddRmsNorm.KEEP += [
    Keep(
        # a LayerNorm of the sum in both branches: not an RMSNorm
        _FORKED_BLOCK.replace("self.ffn_norm = RMSNorm(dim)", "self.ffn_norm = nn.LayerNorm(dim)"),
        reason="LayerNorm",
        name="layer_norm_of_the_sum_in_both_branches",
    ),
]




# --- a norm attribute built by one of several branches of ``__init__`` (issue 14, held-out 4) -------
#
# HunyuanImage-3: ``if config.norm_type in ('hf_rms', 'rms'): self.post_attention_layernorm =
# HunyuanRMSNorm(...) elif ...: self.post_attention_layernorm = nn.LayerNorm(...)``. Which module
# the attribute holds is a configuration fact; the last assignment (nn.LayerNorm) is not "the" norm.
# Where exactly one of the branches builds a class of this module whose forward parses as an
# RMSNorm, the site is fused under a run-time check that the attribute holds exactly that class
# (the original code runs for the other branches' modules).


def _flag_chosen_local_norm(module: ModuleInfo, scope: Scope, call: ast.Call, ctx: S.Ctx, attr: str) -> NormCall | None:
    init = S.method(module, scope.class_name, "__init__")
    if init is None:
        return None
    target = f"self.{attr}"
    values = [st.value for st in S._stmts_in(init.body) if isinstance(st, ast.Assign) and len(st.targets) == 1
              and dotted(st.targets[0]) == target]
    if len(values) < 2 or not all(isinstance(v, ast.Call) for v in values):
        return None
    local = {dotted(v.func) for v in values if dotted(v.func) in module.classes}  # type: ignore[union-attr]
    if len(local) != 1:
        return None
    cls = next(iter(local))
    if not all(dotted(v.func) == cls or (module.canonical(v.func) or "") in _LAYER_NORMS for v in values):  # type: ignore[union-attr]
        return None  # another kind of module (a library RMSNorm, an unknown class): left to the plain reading
    nc = _local_class_norm(module, call, ctx, cls)
    if nc is None or nc.kind != "rms":
        return None
    nc.conditions = [*nc.conditions, f"type({target}) is {cls}"]
    return nc


def _local_class_norm(module: ModuleInfo, call: ast.Call, ctx: S.Ctx, cls: str) -> NormCall | None:
    """The NormCall for ``self.<attr>(x)`` read through the forward of the module class ``cls`` (as
    :func:`_norm_call` reads a class built unconditionally); None unless it reads as hand-written RMS."""
    if not isinstance(call.func, ast.Attribute) or len(call.args) != 1:
        return None
    nc = _class_norm_call(module, call, ctx, cls)
    return nc if nc is not None and nc.kind == "rms" else None


# --- a norm attribute built by one of several branches of __init__ (held-out 4) ---------------------

_NORM_CHOSEN_BY_BRANCH = '''
import torch
from torch import nn


class HyRMSNorm(nn.Module):
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


class DecoderLayer(nn.Module):
    def __init__(self, hidden_size, norm_type="rms", eps=1e-6):
        super().__init__()
        self.attn = nn.Linear(hidden_size, hidden_size)
        self.mlp = nn.Linear(hidden_size, hidden_size)
        if norm_type == "hf_rms" or norm_type == "rms":
            self.input_layernorm = HyRMSNorm(hidden_size, eps=eps)
            self.post_attention_layernorm = HyRMSNorm(hidden_size, eps=eps)
        elif norm_type == "torch_nn":
            self.input_layernorm = nn.LayerNorm(hidden_size, eps=eps)
            self.post_attention_layernorm = nn.LayerNorm(hidden_size, eps=eps)
        else:
            assert False, "other norm_type are not supported"

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.attn(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states
'''

AddRmsNorm.FUSE += [
    Fuse(
        _NORM_CHOSEN_BY_BRANCH,
        expect={"qualname": "DecoderLayer.forward", "line": 38},
        run=(
            "with torch.no_grad():\n"
            "    layer = DecoderLayer(16).eval()\n"
            "    layer.post_attention_layernorm.weight.normal_()\n"
            "    other = DecoderLayer(16, norm_type='torch_nn').eval()\n"
            "    x = torch.randn(2, 5, 16)\n"
            "    out = (layer(x), other(x))\n"
        ),
        name="norm_class_chosen_by_init_branches",
    ),
]

AddRmsNorm.KEEP += [
    Keep(
        # every branch builds a LayerNorm: not an RMSNorm whichever is taken
        _NORM_CHOSEN_BY_BRANCH.replace("self.post_attention_layernorm = HyRMSNorm(hidden_size, eps=eps)",
                                       "self.post_attention_layernorm = nn.LayerNorm(hidden_size, eps=eps)"),
        reason="norm is not RMSNorm (nn.LayerNorm",
        name="norm_chosen_by_init_branches_all_layernorm",
    ),
]


# --- norms (s25): the sum passed inline to a norm class of this file --------------------------
# Yuan's ``lf_output = self.output_layernorm(output2 + residual)``: the norm's forward is read with
# its input bound to the sum. An expression there made the norm matcher refuse ("computed inline");
# the fused code names the sum itself (``_npu_sum``, :func:`_build`), so the forward is read with the
# input bound to that name.

def _norm_input(arg: ast.expr) -> ast.expr:
    """What the norm's forward is read with as its input: the argument, or for an inline sum the
    name the fused code binds it to."""
    if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Add):
        return ast.copy_location(ast.Name(id="_npu_sum", ctx=ast.Load()), arg)
    return arg


_INLINE_SUM_LOCAL = '''
import torch
from torch import nn
''' + _NORM + '''

class LocalizedFiltering(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.conv = nn.Linear(hidden_size, hidden_size)
        self.output_layernorm = LlamaRMSNorm(hidden_size, eps=eps)

    def forward(self, inputs):
        residual = inputs
        output2 = self.conv(inputs)
        lf_output = self.output_layernorm(output2 + residual)
        return lf_output
'''

_RUN_INLINE_SUM_LOCAL = '''
blk = LocalizedFiltering(32, eps=1e-5){cast}
with torch.no_grad():
    blk.output_layernorm.weight.normal_()
{ctx}x = torch.randn(2, 5, 32{dtype}, requires_grad={grad})
out = blk(x)
leaves = {leaves}
torch.set_grad_enabled(True)
'''

AddRmsNorm.FUSE += [
    Fuse(_INLINE_SUM_LOCAL, expect={"variant": "inline_sum", "line": 28, "end_line": 28, "norm_class": "LlamaRMSNorm"},
         run=_RUN_INLINE_SUM_LOCAL.format(cast="", dtype="", ctx="", grad=True, leaves="[x, blk.output_layernorm.weight]"),
         name="inline_sum_into_a_norm_class_of_this_file_training"),
    Fuse(_INLINE_SUM_LOCAL, expect={"variant": "inline_sum"},
         run=_RUN_INLINE_SUM_LOCAL.format(cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16", ctx="torch.set_grad_enabled(False)\n",
                                          grad=False, leaves="[]"),
         name="inline_sum_into_a_norm_class_of_this_file_inference_bf16"),
]

AddRmsNorm.KEEP += [
    Keep(
        # the operand is a product, not a residual sum: no add to fuse, and the norm stays the rms_norm pattern's
        _INLINE_SUM_LOCAL.replace("self.output_layernorm(output2 + residual)", "self.output_layernorm(output2 * residual)"),
        name="inline_product_into_a_norm_class_of_this_file",
    ),
]


# --- norms (s25): TGI's in-place optional residual -------------------------------------------
# ``if residual is not None: hidden_states += residual`` then ``residual = hidden_states`` after the
# ``if`` and the norm of ``hidden_states``, returning ``(normed, residual)`` (TGI / lorax FastRMSNorm,
# their LlamaRMSNorm). The fused branch binds the sum npu_add_rms_norm returns to the same local name
# (the caller gets it back as the returned residual); the caller's own tensor then no longer holds
# the sum: a stated risk.


def _in_place_optional_residual(stmt: ast.If, r: str, add: ast.AugAssign) -> _OptionalResidual | None:
    """``if r is not None: x += r`` (then only aliases of x inside the ``if``)."""
    x = add.target.id  # type: ignore[union-attr]
    if add.value.id != r or x == r:  # type: ignore[union-attr]
        return None
    aliases = stmt.body[1:]
    if not all(_is_alias(al, x) for al in aliases):
        return None
    names = {x} | {al.targets[0].id for al in aliases}  # type: ignore[attr-defined]
    return _OptionalResidual(stmt, x, x, r, list(aliases), names, in_place=True)


def _after_aliases(o: _OptionalResidual, block: list[ast.stmt], i: int) -> ast.stmt | None:
    """The statement after the ``if`` and the aliases of the sum right after it (recorded in ``o.after``)."""
    j = i + 1
    o.after = []
    while j < len(block) and any(_is_alias(block[j], n) for n in o.names):
        o.after.append(block[j])
        o.names |= {block[j].targets[0].id}  # type: ignore[attr-defined]
        j += 1
    return block[j] if j < len(block) else None


def _in_place_risks(o: _OptionalResidual) -> list[Risk]:
    if not o.in_place:
        return []
    return [Risk("other", f"the original adds the residual into the caller's tensor in place (`{o.x1} += {o.x2}`); the fused "
                          f"branch binds the sum npu_add_rms_norm returns to `{o.x1}` instead (returned to the caller as the "
                          "residual): a caller reading its own input tensor after the call would see it without the residual")]


_TGI_NORM = '''
import torch
from torch import nn


class FastRMSNorm(nn.Module):
    def __init__(self, weight, eps):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.variance_epsilon = eps

    def forward(self, hidden_states, residual=None):
        if residual is not None:
            hidden_states += residual
        residual = hidden_states

        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)

        # convert into half-precision if necessary
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)

        return self.weight * hidden_states, residual
'''

_RUN_TGI = '''
norm = FastRMSNorm(torch.randn(32{dtype}), 1e-5)
{ctx}x = torch.randn(2, 5, 32{dtype})
r = torch.randn(2, 5, 32{dtype})
out = norm(x, r)
torch.set_grad_enabled(True)
'''

AddRmsNorm.FUSE += [
    Fuse(_TGI_NORM, expect={"variant": "optional_residual", "x1": "hidden_states", "x2": "residual", "line": 13, "end_line": 25},
         run=_RUN_TGI.format(dtype=", dtype=torch.bfloat16", ctx="torch.set_grad_enabled(False)\n"),
         name="tgi_in_place_optional_residual_inference_bf16"),
    Fuse(_TGI_NORM, expect={"variant": "optional_residual"},
         run=_RUN_TGI.format(dtype="", ctx=""), name="tgi_in_place_optional_residual_fp32_with_grad"),
]

AddRmsNorm.KEEP += [
    Keep(
        # Gemma's (1 + w) after the in-place add: only the plain x * rstd * weight norm takes the add
        _TGI_NORM.replace("return self.weight * hidden_states, residual", "return (1 + self.weight) * hidden_states, residual"),
        reason="npufuse fuses the residual add only into a plain x * rstd * weight norm",
        name="tgi_in_place_optional_residual_into_a_one_plus_weight_norm",
    ),
]

AddRmsNorm.FUSE += [
    Fuse(
        # was a Keep (``x += residual`` writes into the caller's tensor): since s25 the in-place form is a
        # candidate whose risk states that difference (TGI/lorax; see _in_place_optional_residual)
        _OPTIONAL_RESIDUAL.replace("            x = x + residual\n", "            x += residual\n"),
        expect={"variant": "optional_residual", "x1": "x", "x2": "residual", "residual_aliases": ["residual"]},
        name="optional_residual_added_in_place",
    ),
]


# --- s27 norms: a residual sum assigned in both branches of an if ---


def _branch_sum(module: ModuleInfo, stmt: ast.stmt) -> tuple[str, list[tuple[ast.expr, ast.expr]]] | str | None:
    """``if <test>: s = a1 + b1 else: s = a2 + b2`` (one statement per branch, the same name, each a
    residual add; ``elif`` chains too): (the name, each branch's operands); a reason when a branch's
    add is one npu_add_rms_norm cannot take; None for any other statement.

    Whichever branch runs, the norm reads ``x1 + x2`` of that branch: the fused code runs the same
    ``if`` binding only the operands (evaluated in the original order), then adds once."""
    if not isinstance(stmt, ast.If):
        return None
    ops: list[tuple[ast.expr, ast.expr]] = []
    name: str | None = None
    cur: ast.If = stmt
    while True:
        for body in ([cur.body] if cur.orelse and len(cur.orelse) == 1 and isinstance(cur.orelse[0], ast.If) else [cur.body, cur.orelse]):
            if len(body) != 1 or not isinstance(body[0], ast.Assign) or len(body[0].targets) != 1 \
                    or not isinstance(body[0].targets[0], ast.Name):
                return None
            if name is not None and body[0].targets[0].id != name:
                return None
            name = body[0].targets[0].id
            o = _operands(module, body[0].value)
            if o is None:
                return None
            if isinstance(o, str):
                return o
            ops.append(o)
        if cur.orelse and len(cur.orelse) == 1 and isinstance(cur.orelse[0], ast.If):
            cur = cur.orelse[0]
            continue
        break
    if name is None or len(ops) < 2:
        return None
    # an operand reading the sum's own name reads its value from before the if: fine in both codes
    return name, ops


def _branch_sum_sites(module: ModuleInfo, scope: Scope) -> Iterable[tuple[ast.stmt, _Site | str]]:
    """Norm calls on a sum each branch of an ``if`` assigns (see :func:`_branch_sum`)."""
    if "else" not in S.scope_text(module, scope):
        return
    idx = S.stmt_index(scope)
    for stmt in idx.stmts:
        found = _branch_sum(module, stmt)
        if found is None:
            continue
        if isinstance(found, str):
            continue  # a scaled torch.add in a branch: no single x1 + x2 there
        s_name = found[0]
        block, i = idx.block[id(stmt)]
        j = i + 1
        aliases: list[ast.stmt] = []
        while j < len(block) and _is_alias(block[j], s_name):
            aliases.append(block[j])
            j += 1
        if j >= len(block):
            continue
        nstmt, wrapper = _norm_stmt(block[j])
        if not (S.simple_stmt(nstmt) and getattr(nstmt, "value", None) is not None):
            continue
        for node in S.iter_exprs_topdown(nstmt.value):  # type: ignore[attr-defined]
            if isinstance(node, ast.Call) and _sum_arg(node, s_name, module):
                nc = _norm_call(module, scope, node, S.Ctx(scope, nstmt.lineno))
                if nc is None:
                    continue
                ops = found[1]  # type: ignore[index]
                yield nstmt, _Site(stmt, aliases, nstmt, nc, ops[0][0], ops[0][1], s_name, wrapper, branches=ops)
                break


def _branch_operands(module: ModuleInfo, site: _Site) -> str:
    """The site's ``if`` with each branch binding its operands to ``_npu_x1, _npu_x2`` (the
    tests and operands verbatim, evaluated in the original order)."""
    assert site.branches is not None and isinstance(site.add, ast.If)

    def operands(x1: ast.expr, x2: ast.expr) -> str:
        a, b = (f"({t})" if "\n" in t else t for t in (S.source_of(module, x1), S.source_of(module, x2)))
        return f"_npu_x1, _npu_x2 = {a}, {b}"

    out: list[str] = []
    cur: ast.If = site.add
    head = "if"
    for k, (x1, x2) in enumerate(site.branches):
        if k == len(site.branches) - 1:
            out.append("else:")
        else:
            out.append(f"{head} {S.source_of(module, cur.test)}:")
        out.append(S.indent(operands(x1, x2)))
        if _chain_continues(cur):
            cur, head = cur.orelse[0], "elif"  # type: ignore[assignment]
    return "\n".join(out)


def _chain_continues(cur: ast.If) -> bool:
    """Is ``cur``'s else an ``elif`` (one ``if`` alone in the else block, as :func:`_branch_sum` reads it)?"""
    return bool(cur.orelse) and len(cur.orelse) == 1 and isinstance(cur.orelse[0], ast.If)


def _cast_sum_misses(module: ModuleInfo, scope: Scope) -> Iterable[tuple[ast.stmt, str]]:
    """``h = r + y`` then ``self.norm(h.float())``: a residual sum cast before its RMS norm. A near
    miss with its reason (it was silent): npu_add_rms_norm normalizes the sum in x1's dtype and
    returns that dtype, where the original normalizes the cast sum and returns the cast dtype
    (an fp32 output would come back rounded to bf16/fp16)."""
    text = S.scope_text(module, scope)
    if not any(w in text for w in (".float(", ".to(", ".half(", ".bfloat16(", ".type(", ".double(", ".type_as(")):
        return  # no cast anywhere in the scope: nothing to look at
    idx = S.stmt_index(scope)
    for stmt in idx.stmts:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            continue
        ops = _operands(module, stmt.value)
        if ops is None or isinstance(ops, str):
            continue
        s_name = stmt.targets[0].id
        block, i = idx.block[id(stmt)]
        j = i + 1
        while j < len(block) and _is_alias(block[j], s_name):
            j += 1
        if j >= len(block):
            continue
        nstmt, _ = _norm_stmt(block[j])
        if not (S.simple_stmt(nstmt) and getattr(nstmt, "value", None) is not None):
            continue
        for node in S.iter_exprs_topdown(nstmt.value):  # type: ignore[attr-defined]
            if not (isinstance(node, ast.Call) and len(node.args) == 1 and S.is_cast(node.args[0])):
                continue
            cast = node.args[0]
            if not (isinstance(cast.func.value, ast.Name) and cast.func.value.id == s_name):  # type: ignore[attr-defined]
                continue
            target = S.cast_dtype(module, cast, S.Ctx(scope, nstmt.lineno))  # type: ignore[arg-type]
            if target is None or target[0] == "same":
                continue  # ``.to(device)`` / ``.contiguous()``: no dtype change
            # the same call on the sum itself: is it an RMS norm?
            plain = ast.copy_location(ast.Call(node.func, [ast.copy_location(ast.Name(s_name, ast.Load()), cast)], []), node)
            nc = _norm_call(module, scope, plain, S.Ctx(scope, nstmt.lineno))
            if nc is None or nc.kind == "not_rms":
                continue
            yield nstmt, (f"the residual sum is cast (`{S.source_of(module, cast)}`) before the norm: npu_add_rms_norm "
                          "normalizes the sum in x1's dtype and returns that dtype, the original normalizes the cast sum "
                          "(npufuse fuses the norm alone where its code is found)")
            break


_BRANCH_SUM = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


class Block(nn.Module):
    def __init__(self, dim, use_mup=False, scale=1.0):
        super().__init__()
        self.use_mup = use_mup
        self.scale = scale
        self.attn = nn.Linear(dim, dim)
        self.norm = RMSNorm(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, r):
        y = self.attn(r)
        if self.use_mup:
            h = r + y * self.scale
        else:
            h = r + y
        out = self.mlp(self.norm(h))
        return h + out
'''

_BRANCH_SUM_RUN = ("blocks = [Block(16, use_mup=True, scale=0.5){cast}, Block(16){cast}]\n"
                   "with torch.no_grad():\n    x = torch.randn(2, 3, 16{dtype})\n    out = tuple(b(x) for b in blocks)\n")

AddRmsNorm.FUSE += [
    # s27: the residual sum assigned in both branches of a flag (muP scaling): the fused code runs
    # the same if binding only the taken branch's operands, then one npu_add_rms_norm
    Fuse(_BRANCH_SUM, expect={"variant": "residual_then_norm", "sum": "h", "x1": "r", "x2": "y * self.scale", "line": 30, "end_line": 34},
         run=_BRANCH_SUM_RUN.format(cast="", dtype=""), name="branch_sum_flag_fp32"),
    Fuse(_BRANCH_SUM, expect={"norm": "self.norm"}, run=_BRANCH_SUM_RUN.format(cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16"),
         name="branch_sum_flag_bf16"),
    Fuse(_BRANCH_SUM.replace("        else:\n            h = r + y\n",
                             "        elif self.scale > 1:\n            h = y + r\n        else:\n            h = r + y\n"),
         expect={"sum": "h", "line": 30, "end_line": 36},
         run="blocks = [Block(16, use_mup=True), Block(16, scale=2.0), Block(16)]\nwith torch.no_grad():\n"
             "    x = torch.randn(2, 3, 16)\n    out = tuple(b(x) for b in blocks)\n",
         name="branch_sum_elif_chain"),
]

AddRmsNorm.KEEP += [
    # no else: on the flag's false path ``h`` is whatever it was before (not a sum the norm reads)
    Keep(_BRANCH_SUM.replace("        else:\n            h = r + y\n", ""), name="branch_sum_without_else"),
    # a cast between the add and the norm: npu_add_rms_norm would normalize (and return) the sum's dtype
    Keep(_BRANCH_SUM.replace("        if self.use_mup:\n            h = r + y * self.scale\n        else:\n            h = r + y\n",
                             "        h = r + y\n").replace("self.norm(h)", "self.norm(h.float())"),
         reason="the residual sum is cast (`h.float()`) before the norm", name="cast_between_sum_and_norm"),
]


# --- s27 norms: an optional residual below a kept dtype read ---


def _starts_at(sr: R.SiteResult, nxt: ast.stmt, test: ast.If) -> bool:
    """Does the rms_norm candidate start right after the optional-residual ``if`` (its aliases), or
    at a dtype read above the ``if`` that its span keeps in place (vLLM/lmdeploy's ``input_dtype =
    x.dtype`` first)?"""
    assert sr.finding is not None
    if sr.finding.line == nxt.lineno:
        return True
    return sr.finding.line < test.lineno and sr.stmt.lineno >= nxt.lineno


def _reads_before(scope: Scope, o: _OptionalResidual, sr: R.SiteResult) -> list[ast.stmt] | str:
    """The statements of the candidate's span above the ``if``: only dtype/shape reads, which run
    verbatim before the fused code (re-running one is exact: it reads a value nothing changed)."""
    assert sr.finding is not None
    if sr.finding.line >= o.test.lineno:
        return []
    block, i = S.stmt_index(scope).block[id(o.test)]
    out = [s for s in block[:i] if s.lineno >= sr.finding.line]
    if not all(S._is_metadata_read(s) for s in out):
        return "the norm's span starts above the residual `if` with a computation npufuse would run twice"
    return out


def _trace_after(trace: S.Trace, test: ast.If) -> S.Trace:
    """``trace`` without the statements above the residual ``if`` (they run before the fused code)."""
    out = trace.copy()
    out.stmts = {k: s for k, s in out.stmts.items() if s.lineno > (test.end_lineno or test.lineno)}
    return out


# --- s27 norms: a conditional statement between the sum and its norm ---

_PURE_CALLS = ("type", "isinstance", "len")


def _pure_test(test: ast.expr) -> bool:
    """A test without effects that may run earlier than written: names, attributes, comparisons,
    constants and ``type()`` / ``isinstance()`` / ``len()``."""
    for n in ast.walk(test):
        if isinstance(n, ast.Call):
            if not (isinstance(n.func, ast.Name) and n.func.id in _PURE_CALLS and not n.keywords):
                return False
        elif not isinstance(n, (*_PURE_TEST, ast.Call, ast.Tuple, ast.expr_context)):
            return False
    return True


def _s46h_with_split_misses(module: ModuleInfo, scope: Scope) -> Iterable[tuple[ast.stmt, str]]:
    """s46h: a residual add ending one ``with`` block and the RMS norm of the sum starting the next: a near miss."""
    if "with " not in S.scope_text(module, scope):
        return
    idx = S.stmt_index(scope)

    def is_sum(value: ast.expr) -> bool:
        ops = _operands(module, value)
        return ops is not None and not isinstance(ops, str)

    def is_rms_norm_of(call: ast.Call, name: str) -> bool:
        if not _sum_arg(call, name, module):
            return False
        nc = _norm_call(module, scope, call, S.Ctx(scope, call.lineno))
        return nc is not None and nc.kind in ("rms", "library", "l2", "external")

    yield from _add_rms_norm_s46h.add_and_norm_in_two_with_blocks(idx.stmts, lambda st: idx.block[id(st)], is_sum,
                                                                  is_rms_norm_of)


def _gap_sites(module: ModuleInfo, scope: Scope) -> Iterable[tuple[ast.stmt, _Site | str]]:
    """A residual sum, an ``if <pure test>:`` without ``else`` (its body may change the sum, e.g. a
    padding mask), then the norm of the sum: fused where the test is false, where the ``if`` does
    nothing; the original statements run otherwise. The test runs before the add in the fused code,
    so it must not read the sum, its aliases or anything the add or the ``if`` assigns."""
    if "if " not in S.scope_text(module, scope):
        return
    for stmt, ops, s_name, aliases, gap, after in _sums_then_statement(module, scope):
        if not (isinstance(gap, ast.If) and not gap.orelse and _pure_test(gap.test)):
            continue
        written = {s_name} | {a.targets[0].id for a in aliases} | S.names_written(gap)  # type: ignore[attr-defined]
        dtype_gap = _add_rms_norm_s46h.reads_only_sum_dtype(gap.test, s_name, written)  # s46h: `if x.dtype == fp16:`
        if S.names_read(gap.test) & written and not dtype_gap:
            continue
        # the if's body normalises the sum itself (that is the site: a wrapper, one per add), or hands it to a call and
        # rebinds it (an optional adapter ending in an add: the tail-site reading). s43: a body that only reads the sum
        # (a debug NaN check, ``if debug: if torch.isnan(x).any(): print(...); return``) runs as written where its
        # test holds, so it does not stop the site
        rebinds = s_name in S.names_written(gap)
        if any(isinstance(n, ast.Call) and _sum_arg(n, s_name, module)
               and (rebinds and not dtype_gap or _norm_call(module, scope, n, S.Ctx(scope, n.lineno)) is not None)
               for n in fast_walk(gap)):
            continue
        yield from _norm_of_sum(module, scope, after, s_name,
                                lambda nstmt, nc: _Site(stmt, aliases, nstmt, nc, ops[0], ops[1], s_name, gap=gap,
                                                        gap_dtype=dtype_gap))


def _tail_sites(module: ModuleInfo, scope: Scope) -> Iterable[tuple[ast.stmt, _Site | str]]:
    """``if <test>: ... h = <residual sum>`` then, right after the ``if``, the norm of ``h`` (an
    optional cross-attention or adapter adding into the stream before the next norm). The norm
    statement moves into both branches: after the add (fused) where the body runs, as written
    after the ``else`` (or nothing) otherwise; the test is evaluated once, where it was."""
    if "if " not in S.scope_text(module, scope):
        return
    idx = S.stmt_index(scope)
    for t in idx.stmts:
        if not (isinstance(t, ast.If) and t.body):
            continue
        # s42: the body may end with aliases of the sum after the add (``x = x + h; residual = x``)
        k = len(t.body) - 1
        while k > 0 and isinstance(t.body[k], ast.Assign) and isinstance(t.body[k - 1], ast.Assign) \
                and len(t.body[k - 1].targets) == 1 and isinstance(t.body[k - 1].targets[0], ast.Name) \
                and _is_alias(t.body[k], t.body[k - 1].targets[0].id):
            k -= 1
        add = t.body[k]
        aliases = t.body[k + 1:]
        if not (isinstance(add, ast.Assign) and len(add.targets) == 1 and isinstance(add.targets[0], ast.Name)):
            continue
        if any(_is_alias(a, add.targets[0].id) is False for a in aliases):
            continue
        ops = _operands(module, add.value)
        if ops is None or isinstance(ops, str):
            continue
        block, i = idx.block[id(t)]
        s_name = add.targets[0].id
        if i + 1 >= len(block) or s_name not in S.names_read(add.value):
            continue  # the stream must flow on through the branch (``h = h + a``), as it does around it
        yield from _norm_of_sum(module, scope, block[i + 1], s_name,
                                lambda nstmt, nc, t=t, add=add, ops=ops, s_name=s_name, aliases=aliases:
                                _Site(add, list(aliases), nstmt, nc, ops[0], ops[1], s_name, tail_if=t))


def _head_sites(module: ModuleInfo, scope: Scope) -> Iterable[tuple[ast.stmt, _Site | str]]:
    """``h = <residual sum>`` (and its aliases), then ``if <pure test>:`` whose body begins with the norm
    of ``h`` and goes on (Unified-IO 2's decoder layer: ``x = x + inputs; if self.enable_xattention: y =
    self.pre_cross_attention_norm(x); y = self.cross_attention(y, ...); ...``), with or without ``else``.
    The add moves into both branches: fused with the norm where the body runs, as written (then the
    ``else``) otherwise. The test then runs before the add, so it must not read what the add binds.
    A one-statement body without ``else`` is the wrapper form and an if/else normalising in both
    branches the fork form (:func:`_sites`)."""
    if "if " not in S.scope_text(module, scope):
        return
    for stmt, ops, s_name, aliases, following in _sums_and_following(module, scope):
        t = following[0] if following else None
        if not (isinstance(t, ast.If) and t.body and _pure_test(t.test)) or _norm_stmt(t)[1] is not None \
                or _fork(module, scope, t, s_name) is not None:
            continue
        written = {s_name} | {a.targets[0].id for a in aliases}  # type: ignore[attr-defined]
        if S.names_read(t.test) & written:
            continue
        yield from _norm_of_sum(module, scope, t.body[0], s_name,
                                lambda nstmt, nc, stmt=stmt, ops=ops, s_name=s_name, aliases=aliases, t=t:
                                _Site(stmt, aliases, nstmt, nc, ops[0], ops[1], s_name, head_if=t))


def _sums_and_following(module: ModuleInfo, scope: Scope) -> Iterator[tuple[ast.Assign, tuple, str, list[ast.stmt], list[ast.stmt]]]:
    """Each ``<name> = <residual sum>`` of ``scope`` with its operands, its aliases and the statements of
    its block after them: ``(sum, operands, name, aliases, following)``."""
    idx = S.stmt_index(scope)
    for stmt in idx.stmts:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            continue
        ops = _operands(module, stmt.value)
        if ops is None or isinstance(ops, str):
            continue
        s_name = stmt.targets[0].id
        block, i = idx.block[id(stmt)]
        j = i + 1
        aliases: list[ast.stmt] = []
        while j < len(block) and _is_alias(block[j], s_name):
            aliases.append(block[j])
            j += 1
        yield stmt, ops, s_name, aliases, block[j:]


def _sums_then_statement(module: ModuleInfo, scope: Scope) -> Iterator[tuple[ast.Assign, tuple, str, list[ast.stmt], ast.stmt, ast.stmt]]:
    """Each ``<name> = <residual sum>`` of ``scope`` with its aliases, the statement after them and the
    one after that (where the norm must be): ``(sum, operands, name, aliases, next, after)``."""
    for stmt, ops, s_name, aliases, following in _sums_and_following(module, scope):
        if len(following) > 1:
            yield stmt, ops, s_name, aliases, following[0], following[1]


def _norm_of_sum(module: ModuleInfo, scope: Scope, after: ast.stmt, s_name: str,
                 make: Callable[[ast.stmt, Any], "_Site"]) -> Iterator[tuple[ast.stmt, "_Site | str"]]:
    """The site (``make(norm statement, norm call)``) or the near-miss reason where ``after`` is a simple
    statement normalising the sum ``s_name`` (the first call of it, outermost first)."""
    nstmt, wrapper = _norm_stmt(after)
    if wrapper is not None or not (S.simple_stmt(nstmt) and getattr(nstmt, "value", None) is not None):
        return
    for node in S.iter_exprs_topdown(nstmt.value):  # type: ignore[attr-defined]
        node = _s43_unwrap(module, scope, node)
        if isinstance(node, ast.Call) and _sum_arg(node, s_name, module):
            nc = _norm_call(module, scope, node, S.Ctx(scope, nstmt.lineno))
            if nc is None:
                continue
            yield (nstmt, nc.reason) if nc.kind == "not_rms" else (nstmt, make(nstmt, nc))
            return


_GAP_IF = '''
import torch
from torch import nn


class PlainNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.pre_norm = PlainNorm(d)
        self.post_norm = PlainNorm(d)
        self.mix = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)

    def forward(self, u, padding_mask=None):
        u = self.mix(self.pre_norm(u)) + u
        if type(padding_mask) == torch.Tensor:
            u = u * padding_mask[..., None]
        u = self.mlp(self.post_norm(u)) + u
        return u
'''

AddRmsNorm.FUSE += [
    # s27: an if between the sum and its norm (a padding mask): fused where its test is false
    Fuse(_GAP_IF, expect={"condition": "not (type(padding_mask) == torch.Tensor)", "sum": "u", "norm": "self.post_norm",
                          "line": 28, "end_line": 31},
         run=("b = Block(16)\nwith torch.no_grad():\n    x = torch.randn(2, 3, 16)\n"
              "    out = (b(x), b(x, (torch.rand(2, 3) > 0.5).float()))\n"),
         name="gap_if_between_sum_and_norm"),
]

AddRmsNorm.KEEP += [
    # the test reads the sum's shape: it cannot run before the add (s46h: a test of the sum's dtype only is read on
    # the operands' result type, see patterns/_add_rms_norm_s46h.py)
    Keep(_GAP_IF.replace("if type(padding_mask) == torch.Tensor:", "if u.shape[-1] == 16:"), name="gap_if_reading_the_sum"),
]


# --- s27 norms: a cast statement between the sum and its norm ---

_CAST_METHOD_TARGET = {"float": "float32", "half": "float16", "bfloat16": "bfloat16", "double": "float64"}


def _cast_target_code(module: ModuleInfo, value: ast.expr, name: str) -> str | None:
    """The dtype ``<name>.float()`` / ``.to(<dotted dtype>)`` / ``.type_as(<dotted>)`` casts to, as code
    that reads no intermediate (a torch dtype or a dotted ``self.`` attribute's dtype); None otherwise."""
    T = S.torch_name(module) or "torch"
    if not (S.is_cast(value) and isinstance(value.func.value, ast.Name) and value.func.value.id == name):  # type: ignore[attr-defined]
        return None
    attr, args = value.func.attr, value.args  # type: ignore[attr-defined]
    if value.keywords:  # type: ignore[attr-defined]
        return None
    if attr in _CAST_METHOD_TARGET and not args:
        return f"{T}.{_CAST_METHOD_TARGET[attr]}"
    if len(args) != 1:
        return None
    d = dotted(args[0])
    if d is None or not (d.startswith("self.") or d.startswith(f"{T}.")):
        return None
    if attr == "to":
        return d if d.startswith(f"{T}.") or d.endswith(".dtype") else None
    if attr == "type_as":
        return f"{d}.dtype" if d.startswith("self.") else None
    return None


def _cast_stmt_sites(module: ModuleInfo, scope: Scope) -> Iterable[tuple[ast.stmt, _Site | str]]:
    """A residual sum, its aliases, ``<sum> = <sum>.to(<dtype>)``, then the norm of the sum (lerobot's
    ``hidden_states.to(self.post_attention_layernorm.weight.dtype)``): fused where x1, x2 and the target
    share one dtype (the cast is then the identity); add, cast and the fused norm otherwise."""
    text = S.scope_text(module, scope)
    if not any(w in text for w in (".float()", ".to(", ".half()", ".bfloat16()", ".type_as(", ".double()")):
        return
    for stmt, ops, s_name, aliases, cast, after in _sums_then_statement(module, scope):
        if not (isinstance(cast, ast.Assign) and len(cast.targets) == 1 and isinstance(cast.targets[0], ast.Name)
                and cast.targets[0].id == s_name):
            continue
        target = _cast_target_code(module, cast.value, s_name)
        if target is None:
            continue
        yield from _norm_of_sum(module, scope, after, s_name,
                                lambda nstmt, nc: _Site(stmt, aliases, nstmt, nc, ops[0], ops[1], s_name, cast=(cast, target)))


# the norm class is the LlamaRMSNorm text of ``_NORM_CHOSEN_BY_BRANCH`` (one source), renamed
_CAST_STMT = _NORM_CHOSEN_BY_BRANCH.split("class DecoderLayer")[0].replace("HyRMSNorm", "PlainNorm").replace("hidden_size", "d") + '''class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.post_attention_layernorm = PlainNorm(d)
        self.mlp = nn.Linear(d, d)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.attn(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = hidden_states.to(self.post_attention_layernorm.weight.dtype)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states.to(self.mlp.weight.dtype))
        return residual + hidden_states
'''

AddRmsNorm.FUSE += [
    # s27: a cast statement between the sum and its norm: npu_add_rms_norm where the cast is the identity
    Fuse(_CAST_STMT, expect={"sum": "hidden_states", "x1": "residual", "residual_aliases": ["residual"], "line": 30, "end_line": 33},
         run=("a = Layer(16)\nb = Layer(16).to(torch.bfloat16)\nc = Layer(16)\nc.attn.to(torch.bfloat16)\n"
              "with torch.no_grad():\n    x = torch.randn(2, 3, 16)\n"
              "    out = (a(x), b(x.to(torch.bfloat16)), c(x.to(torch.bfloat16)))\n"),
         name="cast_stmt_between_sum_and_norm"),
]

AddRmsNorm.KEEP += [
    # the target dtype is read from a local tensor, not a fixed dtype or a parameter: not fused
    Keep(_CAST_STMT.replace("hidden_states.to(self.post_attention_layernorm.weight.dtype)\n        hidden_states = self.post",
                            "hidden_states.to(residual.dtype)\n        hidden_states = self.post"),
         name="cast_stmt_to_a_local_dtype"),
]


# -- s31: a post-norm block whose norm helper takes the inline sum and eps as a keyword ------------
# (HRM: ``h = rms_norm(h + self.attn(h), variance_epsilon=self.norm_eps)``). The helper's reads of
# its input (``input_dtype = x.dtype``) are read as the sum's name, so the sum is evaluated once.

_S31_POST_NORM_HELPER = '''
import torch
from torch import nn


def rms_norm(hidden_states: torch.Tensor, variance_epsilon: float) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.square().mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + variance_epsilon)
    return hidden_states.to(input_dtype)


class Block(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.self_attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.norm_eps = eps

    def forward(self, hidden_states):
        hidden_states = rms_norm(hidden_states + self.self_attn(hidden_states), variance_epsilon=self.norm_eps)
        hidden_states = rms_norm(self.mlp(hidden_states) + hidden_states, variance_epsilon=self.norm_eps)
        return hidden_states
'''

AddRmsNorm.FUSE += [
    Fuse(_S31_POST_NORM_HELPER, expect={"variant": "inline_sum", "norm": "rms_norm", "eps": "self.norm_eps", "weight": None,
                                        "sum": None, "line": 22, "end_line": 22},
         run=_run_block("Block(32)", bf16=True, train=False), name="s31_post_norm_helper_eps_keyword_inference_bf16"),
    Fuse(_S31_POST_NORM_HELPER, expect={"norm": "rms_norm"}, run=_run_block("Block(32)"),
         name="s31_post_norm_helper_eps_keyword_training"),
]

AddRmsNorm.KEEP += [
    # the helper subtracts the mean: a LayerNorm, whatever its name
    Keep(_S31_POST_NORM_HELPER.replace("    variance = hidden_states.square().mean(-1, keepdim=True)\n",
                                       "    hidden_states = hidden_states - hidden_states.mean(-1, keepdim=True)\n"
                                       "    variance = hidden_states.square().mean(-1, keepdim=True)\n"),
         reason="is not RMSNorm", name="s31_post_norm_helper_subtracting_the_mean"),
    # eps added outside the root (x / (rms + eps)): not the op's formula
    Keep(_S31_POST_NORM_HELPER.replace("torch.rsqrt(variance + variance_epsilon)", "(1.0 / (variance.sqrt() + variance_epsilon))"),
         name="s31_post_norm_helper_eps_outside_the_root"),
]


# -- s31: a norm factory (torchtitan's ``create_norm``: the class chosen by a string at run time), a
# method held through ``torch.compile``, and an add ending an optional branch before the norm ------

_S31_FACTORY = '''
import torch
import torch.nn as nn


def build_norm(kind, dim, eps=1e-6):
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    return ScaledRMS(dim, eps=eps)


class ScaledRMS(nn.Module):
    def __init__(self, dim, eps=1e-6, compiled=False):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))
        self.fn = torch.compile(self.compute) if compiled else self.compute

    def compute(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.scale

    def forward(self, x):
        return self.fn(x)


class Block(nn.Module):
    def __init__(self, d, kind="rms", adapter=True):
        super().__init__()
        self.mix = nn.Linear(d, d)
        self.adapter = nn.Linear(d, d) if adapter else None
        self.mlp = nn.Linear(d, d)
        self.norm = build_norm(kind, d, eps=1e-5)

    def forward(self, x):
        h = x + self.mix(x)
        if self.adapter is not None:
            a = self.adapter(h)
            h = h + a
        return h + self.mlp(self.norm(h))
'''

_S31_FACTORY_RUN = '''
outs = []
for kw in ({{}}, {{"adapter": False}}, {{"kind": "layernorm"}}):
    blk = Block(32, **kw){cast}
    x = torch.randn(2, 5, 32{dtype})
    with torch.no_grad():
        outs.append(blk(x))
    outs.append(blk(x))
out = tuple(outs)
'''

AddRmsNorm.FUSE += [
    Fuse(_S31_FACTORY, expect={"line": 36, "end_line": 39, "sum": "h", "x1": "h", "x2": "a", "norm": "self.norm",
                               "condition": "type(self.norm) is ScaledRMS", "norm_class": "ScaledRMS (returned by build_norm(...))"},
         run=_S31_FACTORY_RUN.format(cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16"),
         name="s31_factory_norm_after_optional_branch_bf16"),
    Fuse(_S31_FACTORY, expect={"norm": "self.norm"}, run=_S31_FACTORY_RUN.format(cast="", dtype=""),
         name="s31_factory_norm_after_optional_branch_fp32"),
]

AddRmsNorm.KEEP += [
    # the factory may return two RMS classes read here: each would need its own fused code (not built)
    Keep(_S31_FACTORY.replace('        return nn.LayerNorm(dim, eps=eps)', '        return OtherRMS(dim)')
         + ("\n\nclass OtherRMS(nn.Module):\n    def __init__(self, dim):\n        super().__init__()\n"
            "        self.w = nn.Parameter(torch.ones(dim))\n\n    def forward(self, x):\n"
            "        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w\n"),
         name="s31_factory_of_two_rms_classes"),
    # the compiled attribute is rebound after construction: the method it holds is not known
    Keep(_S31_FACTORY.replace("    def forward(self, x):\n        return self.fn(x)",
                              "    def forward(self, x):\n        return self.fn(x)\n\n    def use(self, f):\n        self.fn = f"),
         name="s31_held_method_rebound"),
    # the branch ends with another statement after the add: the norm does not directly follow it
    Keep(_S31_FACTORY.replace("            h = h + a\n", "            h = h + a\n            a = None\n"),
         name="s31_optional_branch_not_ending_in_the_add"),
    # a factory returning a LayerNorm-only set: the norm is never RMS
    Keep(_S31_FACTORY.replace("    return ScaledRMS(dim, eps=eps)", "    return nn.LayerNorm(dim)"), name="s31_factory_of_layernorms"),
]


# -- s31: the norm class a constructor parameter holds (``norm_layer=RMSNorm``, ``norm_klass``) ------

_S31_NORM_LAYER = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.g


class Block(nn.Module):
    def __init__(self, d, norm_layer=RMSNorm):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.norm1 = norm_layer(d)
        self.norm2 = norm_layer(d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return x
'''

_S31_NORM_LAYER_RUN = '''
outs = []
for blk in (Block(32){cast}, Block(32, norm_layer=nn.LayerNorm){cast}):
    x = torch.randn(2, 5, 32{dtype})
    with torch.no_grad():
        outs.append(blk(x))
out = tuple(outs)
'''

AddRmsNorm.FUSE += [
    Fuse(_S31_NORM_LAYER, expect={"condition": "type(self.norm2) is RMSNorm", "weight": "self.norm2.g", "line": 25, "end_line": 26},
         run=_S31_NORM_LAYER_RUN.format(cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16"),
         name="s31_norm_layer_parameter_default_bf16"),
    Fuse(_S31_NORM_LAYER.replace("def __init__(self, d, norm_layer=RMSNorm):\n        super().__init__()\n",
                                 "def __init__(self, d, norm_layer=None):\n        super().__init__()\n        norm_layer = norm_layer or RMSNorm\n"),
         expect={"condition": "type(self.norm2) is RMSNorm"}, run=_S31_NORM_LAYER_RUN.format(cast="", dtype=""),
         name="s31_norm_layer_parameter_or_default_fp32"),
    Fuse(_S31_NORM_LAYER.replace("norm_layer=RMSNorm", "norm_layer=nn.RMSNorm"),
         expect={"variant": "library_norm", "condition": "type(self.norm2) is nn.RMSNorm and self.norm2.weight is not None"},
         run=_S31_NORM_LAYER_RUN.format(cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16"),
         name="s31_norm_layer_parameter_library_default"),
]

AddRmsNorm.FUSE += [
    # a subclass without its own forward (or any module the factory gets elsewhere) fails the exact
    # type check: the class read is the one fused
    Fuse(_S31_FACTORY.replace('        return nn.LayerNorm(dim, eps=eps)', '        return OtherRMS(dim)')
         + "\n\nclass OtherRMS(ScaledRMS):\n    pass\n",
         expect={"condition": "type(self.norm) is ScaledRMS"}, run=_S31_FACTORY_RUN.format(cast="", dtype=""),
         name="s31_factory_with_a_subclass"),
]

AddRmsNorm.KEEP += [
    Keep(_S31_NORM_LAYER.replace("norm_layer=RMSNorm", "norm_layer=nn.LayerNorm"), reason="not RMSNorm by default",
         name="s31_norm_layer_parameter_layernorm_default"),
    # rebound by a choice the detector does not read: which class is built is not known
    Keep(_S31_NORM_LAYER.replace("        super().__init__()\n        self.attn",
                                 "        super().__init__()\n        if d > 64:\n            norm_layer = nn.LayerNorm\n        self.attn"),
         name="s31_norm_layer_parameter_rebound"),
]


# -- s31: lucidrains' RMSNorm, ``F.normalize(x, dim=-1) * self.scale * self.gamma`` (scale = sqrt(d)) --

_S31_L2_NORM = '''
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.gamma


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.ff = nn.Linear(dim, dim)
        self.ff_norm = RMSNorm(dim)

    def forward(self, x):
        x = self.attn(x) + x
        return self.ff(self.ff_norm(x)) + x
'''

_S31_L2_RUN = '''
blk = Block(32){cast}
with torch.no_grad():
    blk.ff_norm.gamma.add_(0.1 * torch.randn(32{dtype}))
    x = torch.randn(2, 5, 32{dtype})
    out = blk(x)
'''

AddRmsNorm.FUSE += [
    Fuse(_S31_L2_NORM, expect={"variant": "l2_normalize_norm", "weight": "(self.ff_norm.scale) * (self.ff_norm.gamma)", "eps": "1e-12",
                               "confidence": "medium", "line": 25, "end_line": 26},
         run=_S31_L2_RUN.format(cast="", dtype=""), name="s31_l2_normalize_norm_class_fp32"),
    Fuse(_S31_L2_NORM, expect={"condition": "torch.as_tensor((self.ff_norm.scale) * (self.ff_norm.gamma)).dim() <= 1"},
         run=_S31_L2_RUN.format(cast=".to(torch.bfloat16)", dtype=", dtype=torch.bfloat16"), name="s31_l2_normalize_norm_class_bf16"),
    Fuse(_S31_L2_NORM.replace("F.normalize(x, dim=-1) * self.scale * self.gamma", "self.gamma * F.normalize(x, dim=-1, eps=1e-6) / self.inv")
         .replace("self.scale = dim ** 0.5", "self.inv = dim ** -0.5"),
         expect={"weight": "(self.ff_norm.gamma) / ((self.ff_norm.inv))", "eps": "1e-06"},
         run=_S31_L2_RUN.format(cast="", dtype=""), name="s31_l2_normalize_norm_class_divided_gain"),
]

AddRmsNorm.KEEP += [
    # no sqrt(d) in the gain: an L2 normalisation (ScaleNorm-like), not an RMSNorm
    Keep(_S31_L2_NORM.replace("self.scale = dim ** 0.5", "self.scale = 10.0"), name="s31_l2_normalize_without_sqrt_d"),
    # a gain computed from the input: not a module read
    Keep(_S31_L2_NORM.replace("* self.scale * self.gamma", "* self.scale * x.sigmoid()"), name="s31_l2_normalize_input_gain"),
]


# -- s32: a functional norm called with keywords only, its weight read through the layer list ------
# (TriForce's decoder methods: ``hidden_states = RMSNorm(hidden_states=hidden_states,
# layernorm_variance_epsilon=self.layers[i].eps, layernorm_weight=self.layers[i].weight)``): the sum is
# the argument bound to the helper's first parameter, whatever the call names it; a weight read as an
# attribute through indexed containers is one tensor, read twice alike.

_S32_KEYWORD_HELPER = '''
import torch
from torch import nn


def RMSNorm(hidden_states, layernorm_variance_epsilon, layernorm_weight):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + layernorm_variance_epsilon)
    hidden_states = layernorm_weight * hidden_states.to(input_dtype)
    return hidden_states


class LayerWeights(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.wo = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.post_attention_layernorm_weight = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.post_attention_layernorm_variance_epsilon = 1e-6


class Decoder(nn.Module):
    def __init__(self, d, n=2):
        super().__init__()
        self.layers = nn.ModuleList([LayerWeights(d) for _ in range(n)])

    def layer_compute(self, layer_idx, hidden_states):
        residual = hidden_states
        hidden_states = self.layers[layer_idx].wo(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = RMSNorm(
            hidden_states=hidden_states,
            layernorm_variance_epsilon=self.layers[layer_idx].post_attention_layernorm_variance_epsilon,
            layernorm_weight=self.layers[layer_idx].post_attention_layernorm_weight,
        )
        hidden_states = self.layers[layer_idx].mlp(hidden_states)
        return residual + hidden_states

    def forward(self, x):
        for i in range(len(self.layers)):
            x = self.layer_compute(i, x)
        return x
'''

AddRmsNorm.FUSE += [
    Fuse(_S32_KEYWORD_HELPER, expect={"variant": "residual_then_norm", "norm": "RMSNorm", "sum": "hidden_states",
                                      "residual_aliases": ["residual"], "line": 32, "end_line": 38,
                                      "eps": "self.layers[layer_idx].post_attention_layernorm_variance_epsilon"},
         run=_run_block("Decoder(32)", bf16=True, train=False), name="s32_keyword_only_norm_helper_inference_bf16"),
    Fuse(_S32_KEYWORD_HELPER, expect={"norm_class": "RMSNorm"},
         run=_run_block("Decoder(32)", leaves="[x, blk.layers[0].post_attention_layernorm_weight]"),
         name="s32_keyword_only_norm_helper_training"),
    # keywords in another order, the weight read through a constant index
    Fuse(_S32_KEYWORD_HELPER.replace(
        "            hidden_states=hidden_states,\n            layernorm_variance_epsilon=self.layers[layer_idx].post_attention_layernorm_variance_epsilon,\n"
        "            layernorm_weight=self.layers[layer_idx].post_attention_layernorm_weight,\n",
        "            layernorm_weight=self.layers[0].post_attention_layernorm_weight,\n            hidden_states=hidden_states,\n"
        "            layernorm_variance_epsilon=1e-6,\n"),
        expect={"eps": "1e-06"}, run=_run_block("Decoder(32)", bf16=True, train=False),
        name="s32_keyword_only_norm_helper_reordered_constant_index"),
]

AddRmsNorm.KEEP += [
    # the sum is passed as the weight, another tensor is the input: not the norm of the sum
    Keep(_S32_KEYWORD_HELPER.replace("            hidden_states=hidden_states,\n", "            hidden_states=self.layers[layer_idx].wo.weight,\n")
         .replace("layernorm_weight=self.layers[layer_idx].post_attention_layernorm_weight,", "layernorm_weight=hidden_states,"),
         name="s32_keyword_helper_sum_as_the_weight"),
    # the helper subtracts the mean: a LayerNorm whatever its name
    Keep(_S32_KEYWORD_HELPER.replace("    variance = hidden_states.pow(2).mean(-1, keepdim=True)\n",
                                     "    hidden_states = hidden_states - hidden_states.mean(-1, keepdim=True)\n"
                                     "    variance = hidden_states.pow(2).mean(-1, keepdim=True)\n"),
         reason="is not RMSNorm", name="s32_keyword_helper_subtracting_the_mean"),
    # the weight is a row of a tensor (``scale[layer_idx]``, a per-call modulation table): not one read gamma
    Keep(_S32_KEYWORD_HELPER.replace("layernorm_weight=self.layers[layer_idx].post_attention_layernorm_weight,",
                                     "layernorm_weight=self.scales[layer_idx],")
         .replace("        self.layers = nn.ModuleList([LayerWeights(d) for _ in range(n)])\n",
                  "        self.layers = nn.ModuleList([LayerWeights(d) for _ in range(n)])\n        self.scales = nn.Parameter(torch.ones(n, d))\n"),
         reason="is not a parameter", name="s32_keyword_helper_weight_row_of_a_table"),
]


# -- s32: the norm of another layer object, in a decoder loop that unrolls the layers -----------------

_S32_DECODER_LOOP = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).type_as(x) * self.weight


class DecoderLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.input_layernorm = RMSNorm(d)
        self.self_attn = nn.Linear(d, d)
        self.post_attention_layernorm = RMSNorm(d)
        self.mlp = nn.Linear(d, d)


class Model(nn.Module):
    def __init__(self, d, n=2):
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(d) for _ in range(n)])

    def forward(self, hidden_states):
        for i, layer in enumerate(self.layers):
            residual = hidden_states
            hidden_states = layer.input_layernorm(hidden_states)
            hidden_states = layer.self_attn(hidden_states)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = layer.post_attention_layernorm(hidden_states)
            hidden_states = layer.mlp(hidden_states)
            hidden_states = residual + hidden_states
        return hidden_states
'''

AddRmsNorm.FUSE += [
    Fuse(_S32_DECODER_LOOP, expect={"variant": "residual_then_norm", "norm": "layer.post_attention_layernorm", "eps": "layer.post_attention_layernorm.eps",
                                    "condition": "type(layer.post_attention_layernorm) is RMSNorm", "line": 36, "end_line": 38},
         run=_run_block("Model(32)", bf16=True, train=False), name="s32_decoder_loop_member_norm_inference_bf16"),
    Fuse(_S32_DECODER_LOOP, expect={"norm_class": "RMSNorm"},
         run=_run_block("Model(32)", leaves="[x, blk.layers[1].post_attention_layernorm.weight]"),
         name="s32_decoder_loop_member_norm_training"),
    # the layer indexed from the list, PyTorch's nn.RMSNorm
    Fuse(_S32_DECODER_LOOP.replace("for i, layer in enumerate(self.layers):", "for i in range(len(self.layers)):")
         .replace("layer.", "self.layers[i].")
         .replace("self.post_attention_layernorm = RMSNorm(d)", "self.post_attention_layernorm = nn.RMSNorm(d, eps=1e-5)"),
         expect={"variant": "library_norm", "weight": "self.layers[i].post_attention_layernorm.weight", "eps": "1e-5",
                 "condition": "type(self.layers[i].post_attention_layernorm) is torch.nn.RMSNorm and self.layers[i].post_attention_layernorm.weight is not None"},
         run=_run_block("Model(32)", bf16=True, train=False), name="s32_indexed_layer_library_norm_inference_bf16"),
    # the layer bound from the list by index, a generator ModuleList
    Fuse(_S32_DECODER_LOOP.replace("for i, layer in enumerate(self.layers):", "for i in range(len(self.layers)):\n            layer = self.layers[i]")
         .replace("nn.ModuleList([DecoderLayer(d) for _ in range(n)])", "nn.ModuleList(DecoderLayer(d) for _ in range(n))"),
         expect={"norm": "layer.post_attention_layernorm"}, run=_run_block("Model(32)"), name="s32_layer_bound_by_index_training"),
]

AddRmsNorm.KEEP += [
    # the layer's norm is a LayerNorm
    Keep(_S32_DECODER_LOOP.replace("self.post_attention_layernorm = RMSNorm(d)", "self.post_attention_layernorm = nn.LayerNorm(d)"),
         reason="is not RMSNorm", name="s32_decoder_loop_member_layernorm"),
    # layers of two classes: which one a position holds is not read
    Keep(_S32_DECODER_LOOP.replace("nn.ModuleList([DecoderLayer(d) for _ in range(n)])", "nn.ModuleList([DecoderLayer(d), OtherLayer(d)])")
         + "\n\nclass OtherLayer(nn.Module):\n    def __init__(self, d):\n        super().__init__()\n"
           "        self.input_layernorm = nn.LayerNorm(d)\n        self.self_attn = nn.Linear(d, d)\n"
           "        self.post_attention_layernorm = nn.LayerNorm(d)\n        self.mlp = nn.Linear(d, d)\n",
         name="s32_decoder_loop_layers_of_two_classes"),
    # the loop name is rebound inside the loop: not the list's element
    Keep(_S32_DECODER_LOOP.replace("            residual = hidden_states\n            hidden_states = layer.post_attention_layernorm",
                                   "            residual = hidden_states\n            layer = self.other\n            hidden_states = layer.post_attention_layernorm")
         .replace("        self.layers = nn.ModuleList([DecoderLayer(d) for _ in range(n)])\n",
                  "        self.layers = nn.ModuleList([DecoderLayer(d) for _ in range(n)])\n        self.other = DecoderLayer(d)\n"),
         name="s32_decoder_loop_name_rebound"),
]

AddRmsNorm.KEEP += [
    # the layers come from elsewhere (a model passed in): what the norm is stays unknown, said as such
    Keep(_S32_DECODER_LOOP.replace("    def forward(self, hidden_states):\n        for i, layer in enumerate(self.layers):",
                                   "    def forward(self, hidden_states, model):\n        for i, layer in enumerate(model.layers):"),
         reason="whose class npufuse does not resolve", name="s32_decoder_loop_layers_of_another_model"),
    # a library norm of the sum (an L2 norm, not a module of an object): nothing to say
    Keep(_S32_DECODER_LOOP.replace("hidden_states = layer.post_attention_layernorm(hidden_states)",
                                   "hidden_states = hidden_states / torch.linalg.norm(hidden_states)"),
         name="s32_decoder_loop_library_function_of_the_sum"),
]

AddRmsNorm.FUSE += [
    # the list filled by ``append`` in ``__init__``'s loop
    Fuse(_S32_DECODER_LOOP.replace("        self.layers = nn.ModuleList([DecoderLayer(d) for _ in range(n)])\n",
                                   "        self.layers = nn.ModuleList()\n        for _ in range(n):\n            self.layers.append(DecoderLayer(d))\n"),
         expect={"condition": "type(layer.post_attention_layernorm) is RMSNorm"}, run=_run_block("Model(32)", bf16=True, train=False),
         name="s32_decoder_loop_list_filled_by_append"),
]

AddRmsNorm.KEEP += [
    # one appended layer of another class (a LayerNorm inside): the element class is not one
    Keep(_S32_DECODER_LOOP.replace("        self.layers = nn.ModuleList([DecoderLayer(d) for _ in range(n)])\n",
                                   "        self.layers = nn.ModuleList()\n        for _ in range(n):\n            self.layers.append(DecoderLayer(d))\n"
                                   "        self.layers.append(nn.TransformerEncoderLayer(d, 1))\n"),
         reason="whose class npufuse does not resolve", name="s32_decoder_loop_list_appended_two_classes"),
]


# -- s32: lucidrains' layer lists, the norm unpacked by position (``for attn_norm, attn, ff_norm, ff in self.layers``)

_S32_UNPACKED = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.g


class Transformer(nn.Module):
    def __init__(self, dim, depth=2):
        super().__init__()
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                RMSNorm(dim),
                nn.Linear(dim, dim),
                RMSNorm(dim),
                nn.Linear(dim, dim),
            ]))

    def forward(self, x):
        for attn_norm, attn, ff_norm, ff in self.layers:
            x = attn(attn_norm(x)) + x
            x = ff(ff_norm(x)) + x
        return x
'''

AddRmsNorm.FUSE += [
    Fuse(_S32_UNPACKED, expect={"norm": "ff_norm", "weight": "ff_norm.g", "eps": "ff_norm.eps", "x1": "attn(attn_norm(x))", "x2": "x",
                                "condition": "type(ff_norm) is RMSNorm", "line": 30, "end_line": 31},
         run=_run_block("Transformer(32)", bf16=True, train=False), name="s32_unpacked_layer_norm_inference_bf16"),
    Fuse(_S32_UNPACKED, expect={"norm_class": "RMSNorm"}, run=_run_block("Transformer(32)", leaves="[x, blk.layers[0][2].g]"),
         name="s32_unpacked_layer_norm_training"),
    # a list comprehension of lists, enumerate, nn.RMSNorm
    Fuse(_S32_UNPACKED.replace("        self.layers = nn.ModuleList([])\n        for _ in range(depth):\n            self.layers.append(nn.ModuleList([\n",
                               "        self.layers = nn.ModuleList([nn.ModuleList([\n")
         .replace("                nn.Linear(dim, dim),\n            ]))\n", "                nn.Linear(dim, dim),\n            ]) for _ in range(depth)])\n")
         .replace("                RMSNorm(dim),\n                nn.Linear(dim, dim),\n            ])", "                nn.RMSNorm(dim),\n                nn.Linear(dim, dim),\n            ])")
         .replace("for attn_norm, attn, ff_norm, ff in self.layers:", "for i, (attn_norm, attn, ff_norm, ff) in enumerate(self.layers):"),
         expect={"variant": "library_norm", "weight": "ff_norm.weight", "condition": "type(ff_norm) is torch.nn.RMSNorm and ff_norm.weight is not None"},
         run=_run_block("Transformer(32)", bf16=True, train=False), name="s32_unpacked_library_norm_comprehension_enumerate"),
]

AddRmsNorm.KEEP += [
    # a LayerNorm at that position
    Keep(_S32_UNPACKED.replace("                RMSNorm(dim),\n                nn.Linear(dim, dim),\n            ]))",
                               "                nn.LayerNorm(dim),\n                nn.Linear(dim, dim),\n            ]))"),
         reason="is not RMSNorm", name="s32_unpacked_layer_norm_is_a_layernorm"),
    # the elements differ at that position: which one a layer holds is not one construction
    Keep(_S32_UNPACKED.replace("        for _ in range(depth):\n", "        for k in range(depth):\n")
         .replace("                RMSNorm(dim),\n                nn.Linear(dim, dim),\n            ]))",
                  "                RMSNorm(dim),\n                nn.Linear(dim, dim),\n            ]))\n"
                  "        self.layers.append(nn.ModuleList([RMSNorm(dim), nn.Linear(dim, dim), nn.LayerNorm(dim), nn.Linear(dim, dim)]))"),
         reason="could not read which module that position", name="s32_unpacked_positions_differ"),
]


# -- s32: a list of norms indexed in the loop (VITS' post-norm ``x = self.norm_layers_1[i](x + y)``) ---

_S32_INDEXED_NORMS = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Encoder(nn.Module):
    def __init__(self, dim, n_layers=2):
        super().__init__()
        self.n_layers = n_layers
        self.attn_layers = nn.ModuleList()
        self.norm_layers_1 = nn.ModuleList()
        for _ in range(n_layers):
            self.attn_layers.append(nn.Linear(dim, dim))
            self.norm_layers_1.append(RMSNorm(dim))

    def forward(self, x):
        for i in range(self.n_layers):
            y = self.attn_layers[i](x)
            x = self.norm_layers_1[i](x + y)
        return x
'''

AddRmsNorm.FUSE += [
    Fuse(_S32_INDEXED_NORMS, expect={"variant": "inline_sum", "norm": "self.norm_layers_1[i]", "weight": "self.norm_layers_1[i].weight",
                                     "condition": "type(self.norm_layers_1[i]) is RMSNorm", "line": 29, "end_line": 29},
         run=_run_block("Encoder(32)", bf16=True, train=False), name="s32_indexed_norm_list_inline_sum_inference_bf16"),
    Fuse(_S32_INDEXED_NORMS, expect={"norm_class": "RMSNorm"}, run=_run_block("Encoder(32)", leaves="[x, blk.norm_layers_1[1].weight]"),
         name="s32_indexed_norm_list_inline_sum_training"),
]

AddRmsNorm.KEEP += [
    # VITS' norms are LayerNorms
    Keep(_S32_INDEXED_NORMS.replace("self.norm_layers_1.append(RMSNorm(dim))", "self.norm_layers_1.append(nn.LayerNorm(dim))"),
         reason="is not RMSNorm", name="s32_indexed_norm_list_of_layernorms"),
    # the list holds two constructions: which one an index reaches is not read
    Keep(_S32_INDEXED_NORMS.replace("            self.norm_layers_1.append(RMSNorm(dim))\n",
                                    "            self.norm_layers_1.append(RMSNorm(dim))\n        self.norm_layers_1.append(nn.LayerNorm(dim))\n"),
         name="s32_indexed_norm_list_of_two_constructions"),
]


# --- s33: a flag choosing between a class RMSNorm and nn.LayerNorm; the norm heading an if's body ---

_S33_FLAG_AND_HEAD_IF = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


class EncoderBlock(nn.Module):
    def __init__(self, dim, rms_norm=True, cross=True):
        super().__init__()
        self.cross = cross
        self.attn = nn.Linear(dim, dim)
        self.ffn_norm = RMSNorm(dim, 1e-5) if rms_norm else nn.LayerNorm(dim, 1e-5)
        self.ffn = nn.Linear(dim, dim)
        self.cross_norm = RMSNorm(dim)
        self.cross_attn = nn.Linear(dim, dim)

    def forward(self, x):
        x = x + self.attn(x)
        x = x + self.ffn(self.ffn_norm(x))
        x = self.ffn(x) + x
        if self.cross:
            y = self.cross_norm(x)
            y = self.cross_attn(y)
            x = y + x
        return x
'''

_RUN_S33_FLAG_AND_HEAD_IF = '''
x = torch.randn(2, 5, 32, requires_grad={grad})
blocks = [EncoderBlock(32), EncoderBlock(32, rms_norm=False, cross=False)]
{pre}out = tuple(b(x) for b in blocks)
leaves = {leaves}
'''

AddRmsNorm.FUSE += [
    # AMPLIFY: ``RMSNorm(d, eps) if config.rms_norm else nn.LayerNorm(d, eps)``: fused where the attribute is the RMSNorm
    Fuse(_S33_FLAG_AND_HEAD_IF, expect={"norm": "self.ffn_norm", "condition": "type(self.ffn_norm) is RMSNorm", "line": 30, "end_line": 31},
         run=_RUN_S33_FLAG_AND_HEAD_IF.format(grad=False, pre="torch.set_grad_enabled(False)\n", leaves="[]") + "torch.set_grad_enabled(True)\n",
         name="s33_flag_chosen_class_or_layer_norm_inference"),
    # Unified-IO 2: the norm heads the body of an ``if`` right after the add: the add moves into both branches
    Fuse(_S33_FLAG_AND_HEAD_IF.replace("RMSNorm(dim, 1e-5) if rms_norm", "nn.LayerNorm(dim) if rms_norm"),
         expect={"norm": "self.cross_norm", "sum": "x", "line": 32, "end_line": 36},
         run=_RUN_S33_FLAG_AND_HEAD_IF.format(grad=True, pre="", leaves="[x, blocks[0].cross_norm.weight]"),
         name="s33_norm_heading_an_if_body_training"),
]

AddRmsNorm.KEEP += [
    # the test reads the sum: it cannot run before the add
    Keep(_S33_FLAG_AND_HEAD_IF.replace("        x = x + self.ffn(self.ffn_norm(x))\n", "")
         .replace("if self.cross:", "if x.dtype == torch.float32:"), name="s33_if_test_reading_the_sum"),
    # a flag choosing between two norms that subtract the mean
    Keep(_S33_FLAG_AND_HEAD_IF.replace("        x = self.ffn(x) + x\n        if self.cross:\n", "        if self.cross:\n")
         .replace("if self.cross:", "if x.dtype == torch.float32:")
         .replace("RMSNorm(dim, 1e-5) if rms_norm", "nn.LayerNorm(dim) if rms_norm"),
         reason="is not RMSNorm", name="s33_flag_chosen_between_mean_subtracting_norms"),
]

AddRmsNorm.FUSE += [
    # recurrentgemma: the norm's weight broadcast by a [1, ..., 1, -1] view (its shape reads the norm's own input)
    Fuse(R._S33_BROADCAST_VIEW_WEIGHT + '''

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mix = nn.Linear(d, d)
        self.channel_pre_norm = RMSNorm(d)
        self.mlp = nn.Linear(d, d)

    def forward(self, x):
        raw_x = x
        x = self.mix(x)
        residual = x + raw_x
        x = self.channel_pre_norm(residual)
        return self.mlp(x) + residual
''', expect={"norm": "self.channel_pre_norm", "weight": "self.channel_pre_norm.scale", "weight_offset": 1},
         run=_run_block("Block(32)", bf16=True, train=False), name="s33_norm_weight_broadcast_by_a_view_inference_bf16"),
]

# -- s34: norm modules whose forward is flash-attn's Triton ``rms_norm_fn`` (ProGen3, llm-foundry, OLMo-core,
# mamba_ssm's copy): with no bias, residual, dropout or prenorm it is an RMSNorm of the input computed in fp32
# and returned in the input's dtype; the add before it and that norm become npu_add_rms_norm (flash-attn does
# not run on Ascend).

_S34_TRITON_NORM = '''
import torch
from torch import nn
from flash_attn.ops.triton.layer_norm import rms_norm_fn


class TritonRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.rms_norm_fn = rms_norm_fn

    def forward(self, x):
        # Flash Attention expects a flat tensor
        return self.rms_norm_fn(
            x,
            self.weight,
            None,  # no bias
            residual=None,
            eps=self.eps,
            dropout_p=0.0,
            prenorm=False,
            residual_in_fp32=False,
        )


class FusedRMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        return rms_norm_fn(hidden_states, self.weight, bias=None, eps=1e-6).to(input_dtype)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.norm_2 = TritonRMSNorm(d)
        self.ffn = nn.Linear(d, d)

    def forward(self, x, a):
        x = x + self.attn(a)
        m = self.norm_2(x)
        return x + self.ffn(m)


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.post_attention_layernorm = FusedRMSNorm(d)
        self.mlp = nn.Linear(d, d)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = residual + self.attn(hidden_states)
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)
'''

AddRmsNorm.FUSE += [
    Fuse(_S34_TRITON_NORM, expect={"norm": "self.norm_2", "weight": "self.norm_2.weight", "eps": "self.norm_2.eps"},
         name="s34_triton_rms_norm_fn_through_an_attribute"),
    Fuse(_S34_TRITON_NORM.replace("        x = x + self.attn(a)\n        m = self.norm_2(x)\n", "        m = self.norm_2(x)\n"),
         expect={"norm": "self.post_attention_layernorm", "eps": "1e-6"},
         name="s34_triton_rms_norm_fn_by_name_cast_back"),
]

AddRmsNorm.KEEP += [
    # prenorm=True returns (y, residual) and a residual argument adds inside the kernel: not a plain norm
    Keep(_S34_TRITON_NORM.split("class Layer")[0].replace("prenorm=False", "prenorm=True"), name="s34_triton_prenorm"),
    Keep(_S34_TRITON_NORM.split("class Layer")[0].replace("residual=None", "residual=x"), name="s34_triton_residual_in_kernel"),
    # dropout inside the kernel, and a norm whose input is cast first (the kernel sees another tensor)
    Keep(_S34_TRITON_NORM.replace("dropout_p=0.0", "dropout_p=0.1")
         .replace("        input_dtype = hidden_states.dtype\n", "        input_dtype = hidden_states.dtype\n        hidden_states = hidden_states.float()\n"),
         name="s34_triton_dropout_and_cast_input"),
]

# -- s34: the two-statement clamp RMSNorm (x-transformers' ``norm = torch.norm(x, dim=-1, keepdim=True) *
# self.scale; return x / norm.clamp(min=self.eps) * self.g``, copied into latent-diffusion, stable-diffusion,
# DynamiCrafter, coqui TTS, MoDE; RETRO's ``x.norm(keepdim=True, dim=-1)`` with the gain outside brackets)
# read as a norm class after a residual add: gain P / S, clamp eps / S.

_S34_CLAMP_NORM = R._L2_NORM_CLAMP + '''

class RetroNorm(nn.Module):
    def __init__(self, dim, *, eps = 1e-8):
        super().__init__()
        self.eps = eps
        self.scale = dim ** -0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        norm = x.norm(keepdim = True, dim = -1) * self.scale
        return (x / norm.clamp(min = self.eps)) * self.gamma


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.norm2 = RMSNorm(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(self.norm2(x))


class PostNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fn = nn.Linear(dim, dim)
        self.norm = RetroNorm(dim)

    def forward(self, x):
        out = self.fn(x) + x
        return self.norm(out)
'''

AddRmsNorm.FUSE += [
    Fuse(_S34_CLAMP_NORM, expect={"norm": "self.norm2", "sum": "x"},
         # (with grad enabled the l2 forms run the add and the module itself: npu_add_rms_norm has no backward)
         run=_run_block("Block(32)", train=False, extra="with torch.no_grad():\n    blk.norm2.g.normal_()\n"),
         name="s34_clamp_norm_class_inference"),
    Fuse(_S34_CLAMP_NORM.replace("        x = x + self.attn(x)\n        return x + self.mlp(self.norm2(x))\n",
                                 "        return self.mlp(self.norm2(x))\n"),
         expect={"norm": "self.norm", "sum": "out"},
         run=_run_block("PostNorm(32)", bf16=True, train=False), name="s34_clamp_norm_class_post_norm_inference_bf16"),
]

AddRmsNorm.KEEP += [
    # no 1 / sqrt(d) in the scale: an L2 normalisation with a gain (ScaleNorm), and a norm over dim 1
    Keep(_S34_CLAMP_NORM.replace("self.scale = dim ** -0.5\n        self.eps = eps", "self.scale = 2.0\n        self.eps = eps")
         .replace("x.norm(keepdim = True, dim = -1)", "x.norm(keepdim = True, dim = 1)"), name="s34_clamp_norm_without_sqrt_d_or_other_dim"),
    # the clamp floors another tensor than the scaled norm
    Keep(_S34_CLAMP_NORM.replace("return x / norm.clamp(min=self.eps) * self.g", "return x / x.clamp(min=self.eps) * self.g")
         .replace("return (x / norm.clamp(min = self.eps)) * self.gamma", "return (x / norm.clamp(min = self.eps)) * x"),
         name="s34_clamp_of_another_tensor"),
]

# -- s35: norm helpers returning a library RMSNorm kernel of their input (ShadowKV's flashinfer
# ``layer_norm(h, eps, w)``, xtuner's ``rms_norm_fn`` wrapper, a ``F.rms_norm`` helper taking the weight):
# the call site's arguments name gamma and eps; the helper's own code is not rendered.

_S35_KERNEL_HELPERS = '''
import torch
import torch.nn.functional as F
from torch import nn
import flashinfer
from flash_attn.ops.triton.layer_norm import rms_norm_fn


def rms(t, w, eps=1e-5):
    return flashinfer.norm.rmsnorm(t.reshape(-1, t.shape[-1]), w, eps).reshape(*t.shape)


def triton_norm(hidden, weight, epsilon):
    """flash-attn's Triton RMSNorm, no bias, no residual."""
    return rms_norm_fn(hidden, weight, bias=None, eps=epsilon, prenorm=False)


def scaled(x, gain, eps=None):
    return F.rms_norm(x, (x.size(-1),), gain, eps)


def by_weight_shape(inp, w, epsilon: float = 1e-5):
    return F.rms_norm(inp, w.shape, w, epsilon)


class Decoder(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.w_post = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x, attn):
        h = self.proj(attn) + x
        return self.mlp(rms(h, self.w_post, self.eps)) + h


class Stage(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mix = nn.Linear(d, d)
        self.norm_weight = nn.Parameter(torch.ones(d))
        self.norm_eps = 1e-5

    def forward(self, stream):
        mixed = self.mix(stream)
        stream = stream + mixed
        skip = stream
        stream = triton_norm(stream, self.norm_weight, self.norm_eps)
        return stream + skip


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ff = nn.Linear(d, d)
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.ff(scaled(x + self.ff(x), self.g))


class Mixer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ff = nn.Linear(d, d)
        self.post = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        skip = x
        x = self.ff(x)
        x += skip
        return self.post(by_weight_shape(x, self.scale))
'''

_S35_HELPERS_ONLY = _S35_KERNEL_HELPERS.split("class Decoder")[0]


def _s35_with(cls: str) -> str:
    """The helpers and one of the example's classes (the F.rms_norm one without the CUDA-only imports,
    so that it runs)."""
    helpers = _S35_HELPERS_ONLY
    if cls in ("Block", "Mixer"):
        helpers = "\nimport torch\nimport torch.nn.functional as F\nfrom torch import nn\n\n\n" + "def scaled" + helpers.split("def scaled")[1]
    return helpers + "class " + cls + _S35_KERNEL_HELPERS.split("class " + cls)[1].split("\n\nclass ")[0] + "\n"


AddRmsNorm.FUSE += [
    Fuse(_s35_with("Decoder"), expect={"norm": "rms", "variant": "library_norm", "weight": "self.w_post", "eps": "self.eps"},
         name="s35_flashinfer_helper_reshaping_its_rows"),
    Fuse(_s35_with("Stage"), expect={"norm": "triton_norm", "weight": "self.norm_weight", "eps": "self.norm_eps",
                                     "residual_aliases": ["skip"]},
         name="s35_triton_kernel_helper_with_keywords"),
    Fuse(_s35_with("Block"), expect={"norm": "scaled", "weight": "self.g", "sum": None},
         run=_run_block("Block(32)", bf16=True, train=False), name="s35_f_rms_norm_helper_on_an_inline_sum_inference_bf16"),
    Fuse(_s35_with("Block"), expect={"norm": "scaled"}, run=_run_block("Block(32)", leaves="[x, blk.g]"),
         name="s35_f_rms_norm_helper_on_an_inline_sum_training"),
    # xtuner's ``F.rms_norm(x, weight.shape, weight, epsilon)``: the last dim where the weight is 1-D (checked)
    Fuse(_s35_with("Mixer"), expect={"norm": "by_weight_shape", "weight": "self.scale", "eps": "1e-05",
                                     "condition": "self.scale is not None and self.scale.dim() == 1"},
         run=_run_block("Mixer(32)", bf16=True, train=False), name="s35_f_rms_norm_helper_over_the_weight_shape_inference_bf16"),
]

AddRmsNorm.KEEP += [
    # the kernel adds a residual itself, or normalises the last two dims, or another tensor's rows
    Keep(_S35_KERNEL_HELPERS.replace("bias=None, eps=epsilon", "bias=None, residual=hidden, eps=epsilon")
         .replace("(x.size(-1),)", "(x.size(-2), x.size(-1))")
         .replace("t.reshape(-1, t.shape[-1])", "t.transpose(0, 1).reshape(-1, t.shape[-1])")
         .replace("F.rms_norm(inp, w.shape, w, epsilon)", "F.rms_norm(inp, inp.shape[1:], w, epsilon)"),
         name="s35_kernel_helpers_that_are_not_a_plain_rms_norm_of_the_input"),
    # the weight is a helper argument computed at the call (it would run before the add, and twice)
    Keep(_s35_with("Block").replace("scaled(x + self.ff(x), self.g)", "scaled(x + self.ff(x), self.g * 2)"),
         name="s35_kernel_helper_weight_computed_at_the_call"),
]

# -- s35: a norm wrapper whose forward, under a test, returns a submodule norm of its input ---------------
# tinyworlds' ``AdaptiveNormalizer.forward(x, conditioning=None)``: ``if self.to_gamma_beta is None or
# conditioning is None: return self.rms(x) if self.rms is not None else self.ln(x)``, then a FiLM
# LayerNorm; gpt-neox's ``TERMSNorm.forward(x): return self.norm(x)``. The branch that returns the inner
# RMSNorm is fused where its tests hold at run time (``self`` read as the wrapper module, the forward's
# other parameters as this call's arguments) and the inner module's type is the class read; elsewhere the
# original call runs.

_PURE_NODES = (ast.Attribute, ast.Name, ast.Compare, ast.Constant, ast.BoolOp, ast.UnaryOp, ast.cmpop, ast.boolop,
               ast.unaryop, ast.Load)


def _dispatch_norm(module: ModuleInfo, scope: Scope, call: ast.Call, ctx: S.Ctx) -> NormCall | None:
    """``self.<attr>(x, *rest)`` whose class's forward starts with ``if <test>: return self.<inner>(x)``
    (or ``v = ...; return v``; the value may choose between two submodules by a conditional expression),
    ``<inner>`` built in the wrapper's ``__init__`` as an RMSNorm class of its file: that norm, its fused
    code guarded by the tests and by the inner module's run-time type. None otherwise."""
    f = call.func
    assert isinstance(f, ast.Attribute)
    value = S.init_assignments(module, scope.class_name).get(f.attr)
    if not isinstance(value, ast.Call) or not dotted(value.func):
        return None
    cls = dotted(value.func) or ""
    home, where, file = module, "", module  # ``file``: the one defining the wrapper class
    if cls not in module.classes:
        defined = _foreign_definition(module, cls)
        if defined is None or not isinstance(defined[1], ast.ClassDef):
            return None
        file, wdef = defined
        # the wrapper read here with the classes of its file its ``__init__`` builds (every branch's)
        built = {dotted(v.func) for vs in _init_constructions(file, wdef.name).values() for v in vs}
        extra = tuple(file.classes[c] for c in sorted(c for c in built if c in file.classes and c != wdef.name))
        found_home = _home_with(module, file, wdef, extra)
        if found_home is None:
            return None
        home, cls, where = found_home, wdef.name, f" (from {file.path})"
    fwd = S.method(home, cls, "forward")
    if fwd is None or fwd.args.vararg or fwd.args.kwarg or fwd.args.kwonlyargs:
        return None
    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    if len(params) < 2 or len(call.args) > len(params) - 1:
        return None
    body = [st for st in fwd.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    first = body[0] if body else None
    if isinstance(first, ast.If) and first.body:
        inner, test = first.body, first.test
    elif len(body) in (1, 2) and isinstance(body[-1], ast.Return):
        inner, test = body, None  # gpt-neox's ``TERMSNorm.forward(x): return self.norm(x)``: no test
    else:
        return None
    if len(inner) == 2 and isinstance(inner[0], ast.Assign) and len(inner[0].targets) == 1 and isinstance(inner[0].targets[0], ast.Name) \
            and isinstance(inner[1], ast.Return) and isinstance(inner[1].value, ast.Name) and inner[1].value.id == inner[0].targets[0].id:
        ret = inner[0].value
    elif len(inner) == 1 and isinstance(inner[0], ast.Return) and inner[0].value is not None:
        ret = inner[0].value
    else:
        return None
    # the forward's parameters as this call's arguments (texts), its defaults where not given
    args: dict[str, str] = {params[0]: S.source_of(module, f)}
    defaults = dict(zip(params[len(params) - len(fwd.args.defaults):], fwd.args.defaults))
    for p, a in zip(params[2:], call.args[1:]):
        if isinstance(a, ast.Starred) or dotted(a) is None and not isinstance(a, ast.Constant):
            return None
        args[p] = S.source_of(module, a)
    for k in call.keywords:
        if k.arg is None or k.arg not in params[2:] or k.arg in args or (dotted(k.value) is None and not isinstance(k.value, ast.Constant)):
            return None
        args[k.arg] = S.source_of(module, k.value)
    for p in params[2:]:
        if p not in args:
            d = defaults.get(p)
            if not isinstance(d, ast.Constant):
                return None
            args[p] = ast.unparse(d)

    def as_here(test: ast.expr) -> str | None:
        """The forward's test as code at the call site (pure: attributes, names, comparisons)."""
        if not all(isinstance(n, _PURE_NODES) for n in ast.walk(test)):
            return None
        names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
        if not names <= set(args):
            return None  # the input (or a global) is read: not decided before the call

        class Sub(ast.NodeTransformer):
            def visit_Name(self, n: ast.Name) -> ast.AST:
                return ast.parse(args[n.id], mode="eval").body

        return f"({ast.unparse(Sub().visit(ast.parse(ast.unparse(test), mode='eval')).body)})"

    conditions = [as_here(test) if test is not None else ""]
    sides: list[tuple[ast.expr, str | None]] = [(ret, None)]
    if isinstance(ret, ast.IfExp):
        t = as_here(ret.test)
        sides = [(ret.body, t), (ret.orelse, f"not {t}" if t is not None else None)]
    found: list[NormCall] = []
    for side, side_test in sides:
        if not (isinstance(side, ast.Call) and len(side.args) == 1 and not side.keywords and isinstance(side.args[0], ast.Name)
                and side.args[0].id == params[1] and isinstance(side.func, ast.Attribute)
                and isinstance(side.func.value, ast.Name) and side.func.value.id == params[0]):
            continue
        if ret is not side and side_test is None:
            continue
        # s38: the inner attribute may be built by several branches of ``__init__`` (amago's
        # ``Normalization``: LayerNorm, a lambda, its _RMSNorm... by a method string); the one class that
        # reads as an RMSNorm is fused under its run-time type check, any other built there runs the original
        read: dict[str, tuple[NormCall, ast.Call, ModuleInfo, ModuleInfo, str]] = {}
        for ctor in _init_constructions(home, cls).get(side.func.attr, []):
            owner = _class_named(file, dotted(ctor.func) or "")  # the inner class, read in the wrapper's file
            if owner is None or owner[1] in read:
                continue
            cfile, inner_cls = owner
            inner_home = home if inner_cls in home.classes else _home_with(home, cfile, cfile.classes[inner_cls])
            if inner_home is None:
                continue
            node = ast.Attribute(value=f, attr=side.func.attr, ctx=ast.Load())
            nc = _class_norm_call(inner_home, call, ctx, inner_cls, where, inner=node)
            if nc is not None and nc.kind in ("rms", "library"):
                read[inner_cls] = (nc, ctor, cfile, inner_home, inner_cls)
        if len(read) != 1:
            continue  # none, or two RMSNorm classes (their eps / weight names may differ)
        nc, ctor, cfile, inner_home, inner_cls = next(iter(read.values()))
        mod = f"{S.source_of(module, f)}.{side.func.attr}"
        # both run-time types checked: exactly the wrapper class read, holding exactly the norm class read
        nc.conditions = [*[c for c in (*conditions, side_test) if c], *nc.conditions,
                         _type_guard(module, S.source_of(module, f), value.func, module),
                         _type_guard(module, mod, ctor.func if cfile is module else ast.Name(inner_cls, ast.Load()), cfile)]
        nc.home = inner_home if inner_home is not module else None
        nc.cls = f"{inner_cls} in {cls}{where}"
        found.append(nc)
    if len(found) != 1 or conditions[0] is None:
        return None
    return found[0]


def _init_constructions(module: ModuleInfo, class_name: str) -> dict[str, list[ast.Call]]:
    """``attr -> [Cls(...), ...]``: every constructor call ``__init__`` assigns to ``self.<attr>``, in
    every branch (``init_assignments`` keeps the last one only)."""
    init = S.method(module, class_name, "__init__")
    out: dict[str, list[ast.Call]] = {}
    for st in S._stmts_in(init.body) if init is not None else []:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.value, ast.Call) and dotted(st.value.func):
            d = dotted(st.targets[0])
            if d and d.startswith("self.") and d.count(".") == 1:
                out.setdefault(d[5:], []).append(st.value)
    return out


# -- s35: a norm class the caller passes to the block (no default): the file's one RMSNorm class,
# fused where the attribute's run-time type is exactly it; another class passed runs the original.

_S35_PASSED_NORM = '''
import torch
from torch import nn


class Normalizer(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, t):
        rms = torch.rsqrt(t.float().square().mean(dim=-1, keepdim=True) + self.eps)
        return (t.float() * rms).to(t.dtype) * self.gain


class Layer(nn.Module):
    def __init__(self, width, make_norm, hidden=64):
        super().__init__()
        self.mix = nn.Linear(width, width)
        self.pre = make_norm(width)
        self.out = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, stream):
        upd = self.mix(stream)
        stream = upd + stream
        return stream + self.out(self.pre(stream))
'''

AddRmsNorm.FUSE += [
    Fuse(_S35_PASSED_NORM, expect={"norm": "self.pre", "weight": "self.pre.gain", "sum": "stream",
                                   "condition": "type(self.pre) is Normalizer"},
         run=_run_block("Layer(32, Normalizer)", bf16=True, train=False), name="s35_norm_class_passed_by_the_caller_inference_bf16"),
    Fuse(_S35_PASSED_NORM, expect={"norm": "self.pre"}, run=_run_block("Layer(32, Normalizer)", leaves="[x, blk.pre.gain]"),
         name="s35_norm_class_passed_by_the_caller_training"),
]

AddRmsNorm.KEEP += [
    # the file's one norm class subtracts the mean, or two classes read as RMSNorm (which one is passed?)
    Keep(_S35_PASSED_NORM.replace("rms = torch.rsqrt(t.float().square()", "t = t - t.mean(-1, keepdim=True)\n        rms = torch.rsqrt(t.float().square()"),
         name="s35_passed_norm_class_subtracts_the_mean"),
    Keep(_S35_PASSED_NORM.replace("class Layer(", _S35_PASSED_NORM.split("class Normalizer")[1].split("class Layer")[0]
                                  .join(["class OtherNormalizer", "class Layer("])),
         name="s35_two_rms_classes_for_a_passed_norm"),
]

# -- s35: norm wrappers whose forward returns an inner RMSNorm submodule of the input, under a test of
# ``self`` attributes and the other arguments (tinyworlds' AdaptiveNormalizer: RMSNorm unconditioned, a FiLM
# LayerNorm with conditioning; gpt-neox's TERMSNorm without a test): fused where the test holds and both
# run-time types are the classes read; elsewhere the original call.

_S35_DISPATCH = '''
import torch
from torch import nn


class RMS(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + self.eps) * self.weight


class Centred(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        m = x.mean(dim=-1, keepdim=True)
        v = x.var(dim=-1, unbiased=False, keepdim=True)
        return (x - m) * torch.rsqrt(v + self.eps)


class Switch(nn.Module):
    def __init__(self, d, cond_dim=None):
        super().__init__()
        self.rms = None
        self.ln = None
        self.film = None
        if cond_dim is None:
            self.rms = RMS(d)
        else:
            self.ln = Centred(d)
            self.film = nn.Linear(cond_dim, 2 * d)

    def forward(self, x, cond=None):
        if self.film is None or cond is None:
            normed = self.rms(x) if self.rms is not None else self.ln(x)
            return normed
        g, b = self.film(cond).chunk(2, dim=-1)
        return self.ln(x) * (1 + g) + b


class Layer(nn.Module):
    def __init__(self, d, cond_dim=None):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.norm = Switch(d, cond_dim)

    def forward(self, x, cond=None):
        out = self.proj(x)
        return self.norm(x + out, cond)


class Wrapped(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.impl = RMS(width, eps=1e-6)

    def forward(self, h):
        return self.impl(h)


class Stack(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.f = nn.Linear(d, d)
        self.w = nn.Linear(d, d)
        self.post = Wrapped(d)

    def forward(self, x):
        y = self.f(x)
        x = x + y
        return self.w(self.post(x)) + x
'''

AddRmsNorm.FUSE += [
    Fuse(_S35_DISPATCH.split("class Wrapped")[0], expect={"norm": "self.norm", "weight": "self.norm.rms.weight", "sum": None,
                                                         "condition": "(self.norm.film is None or cond is None) and (self.norm.rms is not None) "
                                                                      "and type(self.norm) is Switch and type(self.norm.rms) is RMS"},
         run=_run_block("Layer(32)", bf16=True, train=False), name="s35_norm_wrapper_choosing_rms_by_a_test_inference_bf16"),
    Fuse(_S35_DISPATCH.split("class Wrapped")[0], expect={"norm": "self.norm"}, run=_run_block("Layer(32)", leaves="[x, blk.norm.rms.weight]"),
         name="s35_norm_wrapper_choosing_rms_by_a_test_training"),
    Fuse(_S35_DISPATCH.split("class Switch")[0] + "class Wrapped" + _S35_DISPATCH.split("class Wrapped")[1],
         expect={"norm": "self.post", "sum": "x", "eps": "self.post.impl.eps",
                 "condition": "type(self.post) is Wrapped and type(self.post.impl) is RMS"},
         run=_run_block("Stack(32)", bf16=True, train=False), name="s35_norm_wrapper_without_a_test_inference_bf16"),
]

AddRmsNorm.KEEP += [
    # the test reads the input (decided by the tensor, not before the call); the inner norm gets another tensor
    Keep(_S35_DISPATCH.replace("if self.film is None or cond is None:", "if self.film is None or x.dtype == torch.float32:")
         .replace("return self.impl(h)", "return self.impl(h.transpose(0, 1))"),
         name="s35_norm_wrapper_test_reads_the_input_or_inner_gets_another_tensor"),
    # the branch returning early is the LayerNorm one
    Keep(_S35_DISPATCH.split("class Wrapped")[0].replace("self.rms(x) if self.rms is not None else self.ln(x)", "self.ln(x)"),
         name="s35_norm_wrapper_early_branch_is_not_rms"),
]

# -- s37: a norm attribute that a base class npufuse cannot read builds from a class the subclass hands it
# (VisionLLaMA ``class RBlockRMSNorm(timm Block)`` with ``norm_layer=RMSNorm`` passed to ``super().__init__``).
# Invented spellings: a base made by a class factory of the file, handed the class through ``Base.__init__``
# as a keyword, a parameter rebound ``norm_cls = norm_cls or Scale``; the sum inside a stochastic-depth call.

_S37_BASE_BUILT = '''
import torch
from torch import nn


class Scale(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.ones(width))

    def forward(self, v):
        inv = torch.rsqrt(v.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (v.float() * inv).type_as(v) * self.g


def residual_base(mixer):
    class _Base(nn.Module):
        def __init__(self, width, norm_cls=nn.LayerNorm):
            super().__init__()
            self.pre_norm = norm_cls(width)
            self.post_norm = norm_cls(width)
            self.mix = mixer(width, width)
            self.ffn = nn.Sequential(nn.Linear(width, 2 * width), nn.SiLU(), nn.Linear(2 * width, width))
            self.skip = nn.Identity()

    return _Base


LinearBase = residual_base(nn.Linear)


class Block(LinearBase):
    def __init__(self, width, norm_cls=None):
        norm_cls = norm_cls or Scale
        LinearBase.__init__(self, width, norm_cls=norm_cls)

    def forward(self, u):
        u = self.skip(self.mix(self.pre_norm(u))) + u
        return u + self.skip(self.ffn(self.post_norm(u)))
'''

AddRmsNorm.FUSE += [
    Fuse(_S37_BASE_BUILT, expect={"norm": "self.post_norm", "weight": "self.post_norm.g", "sum": "u",
                                  "condition": "type(self.post_norm) is Scale"},
         run=_run_block("Block(32)", bf16=True, train=False), name="s37_norm_built_by_an_unread_base_inference_bf16"),
    Fuse(_S37_BASE_BUILT, expect={"norm": "self.post_norm"}, run=_run_block("Block(32)", leaves="[x, blk.post_norm.g]"),
         name="s37_norm_built_by_an_unread_base_training"),
    # the same block handing the class positionally through a chain of two subclasses and ``super()``
    Fuse(_S37_BASE_BUILT.replace('''class Block(LinearBase):
    def __init__(self, width, norm_cls=None):
        norm_cls = norm_cls or Scale
        LinearBase.__init__(self, width, norm_cls=norm_cls)
''', '''class Middle(LinearBase):
    def __init__(self, width, norm=Scale):
        super(Middle, self).__init__(width, norm)


class Block(Middle):
    def __init__(self, width):
        super().__init__(width)
'''), expect={"norm": "self.post_norm", "condition": "type(self.post_norm) is Scale"},
         run=_run_block("Block(32)", bf16=True, train=False), name="s37_norm_class_default_of_a_middle_class"),
]

AddRmsNorm.KEEP += [
    # the class handed to the base is a LayerNorm: a near miss saying so
    Keep(_S37_BASE_BUILT.replace("norm_cls = norm_cls or Scale", "norm_cls = norm_cls or nn.LayerNorm"),
         reason="norm handed to the base is not RMSNorm (nn.LayerNorm", name="s37_layer_norm_handed_to_an_unread_base"),
    # the handed class subtracts the mean: no candidate
    Keep(_S37_BASE_BUILT.replace("inv = torch.rsqrt(v.float().pow(2)", "v = v - v.mean(-1, keepdim=True)\n        inv = torch.rsqrt(v.float().pow(2)"),
         name="s37_mean_subtracting_class_handed_to_an_unread_base"),
]

# -- s37: forwards installed on transformers' layers, subclasses keeping transformers' norms: the norm is
# transformers' own class, fused where its run-time type is one of the Llama-style RMSNorm classes.
# Invented spellings: a module-level ``def layer_forward(self, h, mask=None)`` assigned to a class; a
# closure factory whose inner forward reads ``self`` of the factory; a subclass of a transformers layer.

_S37_INSTALLED = '''
import types

import torch
from transformers.models.qwen2 import modeling_qwen2


def patched_layer_forward(self, h, mask=None):
    skip = h
    h = self.self_attn(self.input_layernorm(h), mask)[0]
    h = skip + h
    skip = h
    h = self.post_attention_layernorm(h)
    return skip + self.mlp(h)


def make_forward(self):
    def forward(tokens, mask=None):
        kept = tokens
        out = self.self_attn(self.input_layernorm(tokens), mask)[0]
        tokens = kept + out
        return tokens + self.mlp(self.post_attention_layernorm(tokens))

    return forward


def install(model):
    modeling_qwen2.Qwen2DecoderLayer.forward = patched_layer_forward
    for layer in model.layers:
        layer.forward = make_forward(layer)
'''

_S37_HF_SUBCLASS = '''
import torch
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer


class RoutedLayer(MistralDecoderLayer):
    def __init__(self, config, layer_idx, n_routes=4):
        super().__init__(config, layer_idx)
        self.route = torch.nn.Linear(config.hidden_size, n_routes)

    def forward(self, hidden, **kw):
        res = hidden
        hidden, _ = self.self_attn(self.input_layernorm(hidden), **kw)
        hidden = res + hidden
        res = hidden
        hidden = self.mlp(self.post_attention_layernorm(hidden)) * self.route(hidden).softmax(-1).max(-1, keepdim=True)[0]
        return res + hidden
'''

AddRmsNorm.FUSE += [
    Fuse(_S37_INSTALLED, expect={"qualname": "patched_layer_forward", "norm": "self.post_attention_layernorm", "sum": "h",
                                 "weight": "self.post_attention_layernorm.weight"},
         name="s37_module_level_forward_installed_on_a_transformers_layer"),
    Fuse(_S37_INSTALLED.split("def patched_layer_forward")[0] + "def make_forward" + _S37_INSTALLED.split("def make_forward")[1],
         expect={"qualname": "make_forward.forward", "norm": "self.post_attention_layernorm", "sum": "tokens"},
         name="s37_closure_forward_installed_on_a_transformers_layer"),
    Fuse(_S37_HF_SUBCLASS, expect={"qualname": "RoutedLayer.forward", "norm": "self.post_attention_layernorm", "sum": "hidden"},
         name="s37_subclass_keeping_the_transformers_norms"),
]

AddRmsNorm.KEEP += [
    # no transformers import: what the installed forward's ``self`` holds says nothing of a known class
    Keep(_S37_INSTALLED.replace("from transformers.models.qwen2 import modeling_qwen2", "import mylib as modeling_qwen2"),
         name="s37_installed_forward_without_transformers"),
    # ``self`` rebound in the function: not the module the forward is installed on
    Keep(_S37_INSTALLED.replace("    skip = h\n    h = self.self_attn", "    self = self.inner\n    skip = h\n    h = self.self_attn")
         .split("def make_forward")[0], name="s37_installed_forward_rebinding_self"),
]

# -- s37: a norm module called with more than its input: the extra arguments are bound into its forward.
# A conditioning gain (Amphion's ``LlamaAdaptiveRMSNorm(h, cond_embedding=c)``: ``to_weight(c) * normed``) is
# a near miss saying so; any other extra argument is a near miss too (the reading does not prove its uses harmless).

_S37_CONDITIONED = '''
import torch
from torch import nn


class ScaledEpsNorm(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, h, eps_scale=1.0):
        stat = h.float().pow(2).mean(-1, keepdim=True)
        return (h.float() * torch.rsqrt(stat + self.eps * eps_scale)).type_as(h) * self.gain


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ff = nn.Linear(width, width)
        self.post = ScaledEpsNorm(width)
        self.out = nn.Linear(width, width)

    def forward(self, h):
        h = self.ff(h) + h
        return self.out(self.post(h, eps_scale=4.0)) + h
'''

# the same block whose norm's gain is a Linear of a condition the block passes
_S37_ADAPTIVE = _S37_CONDITIONED.split("class ScaledEpsNorm")[0] + '''class CondRMS(nn.Module):
    def __init__(self, width, cond_width=8, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.to_gain = nn.Linear(cond_width, width)

    def forward(self, h, cond):
        stat = h.float().pow(2).mean(-1, keepdim=True)
        return (self.to_gain(cond) * (h.float() * torch.rsqrt(stat + self.eps))).to(h.dtype)


class Block''' + _S37_CONDITIONED.split("class Block")[1].replace("ScaledEpsNorm(width)", "CondRMS(width)") \
    .replace("def forward(self, h):", "def forward(self, h, c):").replace("self.post(h, eps_scale=4.0)", "self.post(h, c)")

AddRmsNorm.KEEP += [
    Keep(_S37_CONDITIONED, reason="is called with more than its input (`eps_scale`)", name="s37_norm_called_with_an_eps_argument"),
    # the extra argument masks the input before the statistic: the reading would drop it (it did, before the refusal)
    Keep(_S37_CONDITIONED.replace("def forward(self, h, eps_scale=1.0):", "def forward(self, h, eps_scale=None):\n        if eps_scale is not None:\n            h = h * eps_scale")
         .replace("self.eps * eps_scale", "self.eps"), reason="normalises `h`, computed from its input", name="s37_norm_masking_its_input_by_an_argument"),
    # a single-input norm normalising a scaled copy of its input (``y = x * self.pre``): the factor was dropped
    Keep(_S37_CONDITIONED.replace("def forward(self, h, eps_scale=1.0):", "def forward(self, h):\n        h2 = h * self.gain")
         .replace("stat = h.float()", "stat = h2.float()").replace("(h.float() * torch.rsqrt(stat + self.eps * eps_scale))", "(h2.float() * torch.rsqrt(stat + self.eps))")
         .replace("self.post(h, eps_scale=4.0)", "self.post(h)"),
         reason="normalises `h2`, computed from its input, not the input itself", name="s37_norm_of_a_scaled_copy_of_its_input"),
    Keep(_S37_ADAPTIVE, reason="scales by a gain computed from the call's `cond`", name="s37_adaptive_norm_gain_from_the_condition"),
]


# -- s38: a norm wrapper whose inner norm ``__init__`` builds in one of several branches (amago's
# ``Normalization(method, d_model)``: LayerNorm, a lambda, an identity or its own RMSNorm by a string):
# the one class that reads as an RMSNorm is fused under both run-time type checks; another branch's
# module runs the original call. Two branches building two RMSNorm classes: nothing (which is built?).

_S38_SWITCHED = '''
import torch
from torch import nn


class PlainRMS(nn.Module):
    def __init__(self, width, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, t):
        return self.gain * (t * torch.rsqrt(torch.mean(t * t, dim=-1, keepdim=True) + self.eps))


class NormChoice(nn.Module):
    def __init__(self, kind, width):
        super().__init__()
        if kind == "layer":
            self.inner = nn.LayerNorm(width)
        elif kind == "rms":
            self.inner = PlainRMS(width)
        elif kind == "unit":
            self.inner = lambda t: t / t.norm(dim=-1, keepdim=True)
        else:
            self.inner = nn.Identity()

    def forward(self, t):
        return self.inner(t)


class Layer(nn.Module):
    def __init__(self, width, kind="rms"):
        super().__init__()
        self.mix = nn.Linear(width, width)
        self.pre_ff = NormChoice(kind, width)
        self.ff = nn.Linear(width, width)

    def forward(self, seq):
        upd = self.mix(seq)
        seq = seq + upd
        return seq + self.ff(self.pre_ff(seq))
'''

AddRmsNorm.FUSE += [
    Fuse(_S38_SWITCHED, expect={"norm": "self.pre_ff", "weight": "self.pre_ff.inner.gain", "sum": "seq",
                                "condition": "type(self.pre_ff) is NormChoice and type(self.pre_ff.inner) is PlainRMS"},
         run=_run_block("Layer(32)", bf16=True, train=False) + "out = (out, Layer(32, 'layer').to(torch.bfloat16)(x))\n",
         name="s38_wrapper_building_its_norm_in_one_of_several_branches_inference_bf16"),
    Fuse(_S38_SWITCHED, expect={"norm": "self.pre_ff"}, run=_run_block("Layer(32)", leaves="[x, blk.pre_ff.inner.gain]"),
         name="s38_wrapper_building_its_norm_in_one_of_several_branches_training"),
]

AddRmsNorm.KEEP += [
    # a second RMSNorm class in another branch (its eps under another name): which one is built is a run-time string
    Keep(_S38_SWITCHED.replace("class NormChoice", _S38_SWITCHED.split("class PlainRMS")[1].split("class NormChoice")[0]
                               .replace("self.eps = eps", "self.epsilon = eps").replace("+ self.eps)", "+ self.epsilon)")
                               .join(["class OtherRMS", "class NormChoice"]))
         .replace('self.inner = nn.Identity()', 'self.inner = OtherRMS(width)'),
         name="s38_wrapper_building_one_of_two_rms_classes"),
]


# -- s38: straight-line kernel helpers (UMbreLLa's ``layer_norm`` / ``layer_norm_gemma``): the input's dims
# unpacked, its rows flattened for the kernel and the shape given back, each statement rebinding the input;
# flashinfer's ``gemma_rmsnorm`` is the same kernel scaled by (1 + weight).

_S38_STRAIGHT_HELPERS = '''
import torch
import torch.nn.functional as F
from torch import nn


def rows_norm(t, eps, w):
    b, s, d = t.shape
    t = t.reshape(b * s, d)
    t = F.rms_norm(t, (t.size(-1),), w, eps)
    t = t.reshape(b, s, d)
    return t


class Decoder(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.w_post = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x, attn=None):
        attn = x if attn is None else attn
        h = self.proj(attn)
        h = x + h
        x = h
        h = rows_norm(h, self.eps, self.w_post)
        return self.mlp(h) + x
'''

_S38_GEMMA_HELPER = _S38_STRAIGHT_HELPERS.replace("import torch\\n", "import torch\\nimport flashinfer\\n", 1) \
    .replace("t = F.rms_norm(t, (t.size(-1),), w, eps)", "t = flashinfer.gemma_rmsnorm(t, w, eps)")

AddRmsNorm.FUSE += [
    Fuse(_S38_STRAIGHT_HELPERS, expect={"norm": "rows_norm", "weight": "self.w_post", "sum": "h",
                                        "eps": "(self.eps if self.eps is not None else torch.finfo(torch.float32).eps)"},
         run=_run_block("Decoder(32)", bf16=True, train=False), name="s38_straight_line_helper_flattening_rows_inference_bf16"),
    Fuse(_S38_STRAIGHT_HELPERS, expect={"norm": "rows_norm"}, run=_run_block("Decoder(32)", leaves="[x, blk.w_post]"),
         name="s38_straight_line_helper_flattening_rows_training"),
    Fuse(_S38_GEMMA_HELPER, expect={"norm": "rows_norm", "weight": "(1 + self.w_post.float())", "eps": "self.eps"},
         name="s38_straight_line_helper_of_flashinfer_gemma_rmsnorm"),
]

AddRmsNorm.KEEP += [
    # the shape given back is not the input's (two dims swapped), or the input is scaled before the kernel
    Keep(_S38_STRAIGHT_HELPERS.replace("t = t.reshape(b, s, d)", "t = t.reshape(s, b, d)"), name="s38_helper_restoring_another_shape"),
    Keep(_S38_STRAIGHT_HELPERS.replace("t = t.reshape(b * s, d)", "t = (2 * t).reshape(b * s, d)"), name="s38_helper_scaling_its_input"),
    # a statement that is not a rebinding of the input (a second name) is not folded
    Keep(_S38_STRAIGHT_HELPERS.replace("t = t.reshape(b * s, d)\n", "u = t.reshape(b * s, d)\n    t = u\n"),
         name="s38_helper_through_a_second_name"),
]


# -- s38: the optional residual spelled with an ``else`` (ppl.pmx's SkipRMSNorm reference op): ``if skip is
# None: s = x`` / ``else: s = x + skip`` binds the sum in both arms, then the norm of ``s`` over an axis handed
# in (checked at run time on x1, whose shape the sum has where the operands' shapes agree).

_S38_SKIP_NORM = '''
import torch


def skip_norm(x, weight, skip=None, axis: int = -1, eps: float = 1e-5):
    if skip is None:
        out = x
    else:
        out = x + skip
    t = out.float()
    ms = t.pow(2).mean(axis, keepdim=True)
    y = t * torch.rsqrt(ms + eps)
    y = y.type_as(x) * weight
    return y, out
'''

_S38_RUN_SKIP = '''
w = torch.randn(32, dtype=torch.bfloat16, requires_grad=True)
x = torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)
r = torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)
with torch.no_grad():
    infer = skip_norm(x, w, r)
    alone = skip_norm(x, w)
    other_axis = skip_norm(x.transpose(1, 2).contiguous(), w[:5].contiguous(), r.transpose(1, 2).contiguous(), axis=1)
out = (infer, alone, other_axis, skip_norm(x, w, r))
leaves = [x, w, r]
'''

AddRmsNorm.FUSE += [
    # (the condition's parts: tests/test_detect_s38_norm.py; the order of promote_types' operands varies by run)
    Fuse(_S38_SKIP_NORM, expect={"variant": "optional_residual", "x1": "x", "x2": "skip", "sum": "out", "qualname": "skip_norm"},
         run=_S38_RUN_SKIP, name="s38_optional_residual_bound_in_both_arms_axis_handed_in"),
]

AddRmsNorm.KEEP += [
    # the no-residual arm is not the other operand (``out = skip``... with skip None), or the arm adds something else
    Keep(_S38_SKIP_NORM.replace("        out = x\n", "        out = 2 * x\n"), name="s38_optional_residual_else_arm_not_an_alias"),
    Keep(_S38_SKIP_NORM.replace("out = x + skip", "out = x + weight"), name="s38_optional_residual_else_arm_adds_another_tensor"),
]


# -- s40 (reasons40): a norm module chosen by configuration among several classes ------------------------------------
#
# ``if cfg.use_rms: self.norm = nn.RMSNorm(d) else: self.norm = nn.LayerNorm(d)``, ``norm_cls = RMSNorm if
# cfg.rms else nn.LayerNorm; self.norm = norm_cls(d)``, ``self.norm = build_norm(cfg, d)`` / ``self._make_norm(cfg)``
# (a factory whose returns choose): the plain reading took the last construction in ``__init__`` (a near miss that
# described only the LayerNorm branch, false for runs with the RMSNorm; and with the arms in the other order an
# unguarded fusion of nn.RMSNorm that ran npu_rms_norm on the LayerNorm instance) or nothing at all for a factory.
# Every construction ``bound_callee.choices`` reads is judged like one built unconditionally; exactly one RMSNorm
# among them is fused under an exact run-time class test (the other classes run the original code); otherwise
# the near miss names every class the attribute may hold.


def _s40_built_by_choice(module: ModuleInfo, value: ast.expr) -> bool:
    """One construction of the attribute that may build one of several classes: a call of a local alias, a
    function or method of the file, or of a conditional expression (``(A if c else B)(d)``)."""
    if not isinstance(value, ast.Call):
        return False
    f = value.func
    if isinstance(f, ast.IfExp):
        return True
    if isinstance(f, ast.Attribute):
        return isinstance(f.value, ast.Name) and f.value.id == "self"
    return isinstance(f, ast.Name) and f.id not in module.classes and f.id not in module.aliases


def _s40_guarded(nc: NormCall, mod: str) -> bool:
    return any(c.startswith((f"type({mod})", f"isinstance({mod}")) for c in nc.conditions)


def _s41_unresolved_stores(module: ModuleInfo, nc: NormCall | None, stores: list[ast.expr], choice: Any, mod: str,
                           cls: str | None) -> NormCall | None:
    """s41 (HO17a vjsingh1984 mamba.py: ``if config.use_rmsnorm: from .transformer import RMSNorm; self.norm =
    RMSNorm(d)`` else ``nn.LayerNorm(d)``): where the attribute is built more than once and some construction names a
    class npufuse does not resolve (imported inside the method), the reason read from the one it resolves (a
    LayerNorm) is no answer for the other path: the near miss names the unresolved construction too."""
    if nc is None or nc.kind != "not_rms" or len(stores) < 2:
        return nc
    read = {m.name.split(".")[-1] for m in choice.members} if choice is not None else set()
    from npufuse.scan import bound_callee

    unread = [v for v in stores if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id not in read
              and not bound_callee.module_bindings(module, v.func.id)]
    if not unread or (choice is not None and choice.complete):
        return nc
    built = ", ".join(f"`{' '.join(ast.unparse(v).split())[:60]}`" for v in unread)
    names = ", ".join(dict.fromkeys(f"`{v.func.id}`" for v in unread))  # type: ignore[attr-defined]
    return NormCall(nc.call, nc.attr, "not_rms", cls=nc.cls,
                    reason=f"{nc.reason}; `{mod}` is also built as {built} in {cls}, whose class npufuse does not resolve "
                           f"({names} not bound at module level): on that path the norm may be another module, an RMSNorm, "
                           "and nothing is fused")


def _s40_config_chosen_norm(module: ModuleInfo, scope: Scope, call: ast.Call, ctx: S.Ctx, nc: NormCall | None) -> NormCall | None:
    f = call.func
    if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" and scope.class_name
            and len(call.args) == 1 and not call.keywords and not isinstance(call.args[0], ast.Starred)):
        return nc
    mod = f"self.{f.attr}"
    if nc is not None and nc.kind != "not_rms" and _s40_guarded(nc, mod):
        return nc  # fused under a test of the instance's class already
    from npufuse.scan import bound_callee

    stores = bound_callee.attribute_values(module, scope.class_name, f.attr)
    if not (len(stores) > 1 or (len(stores) == 1 and _s40_built_by_choice(module, stores[0]))):
        return nc
    choice = bound_callee.choices(module, scope, f)
    # (a constant store, ``self.norm2 = None`` in the other arm, is no module the call could run: the original raises)
    modules = [v for v in stores if not (isinstance(v, ast.Constant) and v.value is not Ellipsis)]
    if nc is not None and nc.kind != "not_rms" and len(modules) > 1 and (choice is None or not choice.complete) \
            and not _s40_guarded(nc, mod):
        # (s45 review) another store of the attribute npufuse does not resolve (``self.norm = getattr(nn, name)(d)``,
        # ``self.kind, self.norm = make_norm(d)`` in another method): the fused code, with no class test, would run
        # the RMSNorm reading on whatever module that store puts there
        built = ", ".join(f"`{' '.join(ast.unparse(v).split())[:50]}`" for v in stores[:4])
        return NormCall(nc.call, nc.attr, "not_rms", cls=nc.cls,
                        reason=f"norm `{mod}` is stored more than once in {scope.class_name} ({built}) and npufuse does not "
                               "resolve every store: the fused code would have no class test to tell the RMSNorm path "
                               "from another module's")
    if choice is None or len(choice.names()) < 2:
        return _s41_unresolved_stores(module, nc, stores, choice, mod, scope.class_name)
    readings: list[tuple[bound_callee.Member, NormCall | None]] = []
    for m in choice.members:
        r = None
        if m.instance and m.built_by is not None and dotted(m.node):
            ctor = ast.copy_location(ast.Call(func=m.node, args=m.built_by.args, keywords=m.built_by.keywords), m.built_by)
            where = f" (from {m.home.path})" if m.home is not module else ""
            r = _member_ctor_norm(module, call, ctx, m.home, ctor, mod, where)
            if r is not None and r.kind != "not_rms" and (not _s40_guarded(r, mod) or bound_callee.rebound_class(m.home, dotted(m.node) or "")):
                r = None  # no exact class test (or the file rebinds the class name): not fused
        readings.append((m, r))
    rms = [r for _m, r in readings if r is not None and r.kind != "not_rms"]
    if len(rms) == 1:
        return rms[0]
    if not any(r is not None or _RMS_NAME.search(m.name.split(".")[-1]) for m, r in readings):
        return nc  # no choice is read as a norm nor named an RMSNorm (an MLP, a projection): no norm site to explain
    if nc is not None and nc.kind != "not_rms" and not any(r is not None and r.kind == "not_rms" for _m, r in readings):
        return nc  # the plain reading's (nanotron's two outside RMSNorm classes): no construction is read as another norm
    parts = []
    for m, r in readings:
        name = m.name.replace("torch.nn.", "nn.")
        when = f" (under {m.condition})" if m.condition else ""
        what = ("an RMSNorm" if r is not None and r.kind != "not_rms" else
                r.reason.replace("norm is not RMSNorm (", "").rstrip(")").removeprefix(f"{name}: ") if r is not None
                else "a construction npufuse does not fuse")
        parts.append(f"`{name}`{when}: {what}")
    built = "" if len(stores) > 1 else f" (`{ast.unparse(stores[0])[:60]}`)"
    why = ("more than one of them is an RMSNorm (one fused branch per class is not built)" if len(rms) > 1
           else "none is an RMSNorm npufuse can fuse")
    return NormCall(call, f.attr, "not_rms", cls=" or ".join(p.split("`")[1] for p in parts),
                    reason=f"norm `{mod}` is one of several modules built in {scope.class_name}{built}: {'; '.join(parts)}; {why}")


# -- s42 (addnorm42): a norm handed to a function as an argument --------------------------------------------------
# ``def _block(x, norm, attn, mlp): x = x + attn(x); h = norm(x)`` (a helper the model's forward calls with
# ``self.ln_2`` / ``block.ln_2`` / ``self.layers[i].post_norm``), and a method ``def _ffn(self, x, norm)`` alike: the
# norm is a parameter, whose module only the callers in this file say. Every call of the function in the file must
# hand that parameter a module npufuse reads as one construction of one class (followed from ``self`` through
# ``__init__`` and layer lists, as a member norm); the fused code runs where the parameter's run-time type is that
# class (another caller, in another file, may hand something else), the original statements otherwise.

_S42_NORM_PARAM = re.compile(r"norm|(^|_)ln(_|\d|$)", re.I)
# a plain function's text calling a norm function by name (``rms_norm(h, w)``, ``norm(x)``, ``F.rms_norm``)
_S42_NORM_CALL_TEXT = re.compile(r"rms|\bnorm\w*\(", re.I)
# s51 (perf51): the same test on an ASCII text, lowered (re.I on ASCII text is ASCII case folding; ``re`` finds no literal
# in a case-insensitive pattern and tried a match at every position): ``rms`` by ``in``, ``\bnorm`` as the literal
# ``norm`` with the left boundary after it
_S42_NORM_CALL_LOWER = re.compile(r"norm(?<!\wnorm)\w*\(")


def _s42_norm_call_text(text: str) -> bool:
    """``_S42_NORM_CALL_TEXT.search(text)`` found something."""
    if text.isascii():
        low = text.lower()
        return "rms" in low or _S42_NORM_CALL_LOWER.search(low) is not None
    return _S42_NORM_CALL_TEXT.search(text) is not None


def _s42_norm_parameters(scope: Scope) -> set[str]:
    """The parameters of the function ``scope`` whose name says norm (``norm``, ``ln_2``, ``post_norm``) and
    that the function never rebinds: the cheap test before any caller is looked at."""
    if not isinstance(scope.node, (ast.FunctionDef, ast.AsyncFunctionDef)) or scope.node.name == "__init__":
        return set()  # ``__init__``'s ``norm`` parameter is a class it builds modules with (``norm(ch)``), not a module
    return {p for p in scope.args if _S42_NORM_PARAM.search(p) and p != "self" and not scope.assignments.get(p)}


def _s42_enclosing_scope(module: ModuleInfo, node: ast.AST) -> Scope | None:
    """The innermost function scope of ``module`` holding ``node`` (by lines)."""
    best: Scope | None = None
    for sc in module.scopes:
        fn = sc.node
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.lineno <= node.lineno <= (fn.end_lineno or fn.lineno):
            if best is None or fn.lineno >= best.node.lineno:  # type: ignore[attr-defined]
                best = sc
    return best


def _s42_passed_modules(module: ModuleInfo, scope: Scope, param: str) -> list[tuple[ast.expr, Scope]] | str:
    """The expressions every call of the function ``scope`` in this file hands ``param`` (each with the caller's
    scope); a reason when a call hands it otherwise (``*args``, ``**kw``, left to a default) or none is found."""
    fn = scope.node
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
    positional = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    method = scope.class_name is not None
    if method:
        positional = positional[1:]  # ``self.<name>(...)`` binds self itself
    pos = positional.index(param) if param in positional else None
    found: list[tuple[ast.expr, Scope]] = []
    for c in R._calls_naming(module, fn.name):
        f = c.func
        if method:
            if not (isinstance(f, ast.Attribute) and f.attr == fn.name and isinstance(f.value, ast.Name) and f.value.id == "self"):
                continue
        elif not (isinstance(f, ast.Name) and f.id == fn.name):
            continue
        if any(isinstance(a, ast.Starred) for a in c.args) or any(k.arg is None for k in c.keywords):
            return f"a call of `{fn.name}` (line {c.lineno}) hands its arguments unpacked"
        arg = c.args[pos] if pos is not None and pos < len(c.args) else next((k.value for k in c.keywords if k.arg == param), None)
        caller = _s42_enclosing_scope(module, c)
        if arg is None or caller is None:
            return f"a call of `{fn.name}` (line {c.lineno}) does not hand `{param}` a module"
        found.append((arg, caller))
    return found or f"no call of `{fn.name}` in this file says which module `{param}` is"


def _s42_passed_ctor(module: ModuleInfo, arg: ast.expr, caller: Scope) -> tuple[ModuleInfo, ast.expr] | None:
    """The construction of the module a caller hands over: ``self.ln_2`` / ``block.ln_2`` / ``self.layers[i].norm``
    (an attribute built in its object's ``__init__``), or ``self.norms[i]`` (an element of a list of one construction)."""
    if isinstance(arg, ast.Attribute):
        owner = _object_class(module, caller, arg.value)
        if owner is None:
            return None
        value = S.init_assignments(owner[0], owner[1]).get(arg.attr)
        return (owner[0], value) if value is not None else None
    if isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Attribute):
        idx = arg.slice
        if not _s42_plain_index(idx):
            return None
        owner = _object_class(module, caller, arg.value.value)
        elts = _list_elements(owner, arg.value.attr) if owner is not None else None
        if not elts or len({ast.dump(e) for e in elts}) != 1:
            return None
        return owner[0], elts[0]  # type: ignore[index]
    return None


def _s42_parameter_norm(module: ModuleInfo, scope: Scope, call: ast.Call, ctx: S.Ctx) -> NormCall | None:
    """``norm(s)`` with ``norm`` a parameter of the function: read as the one construction its callers hand it."""
    f = call.func
    if not (isinstance(f, ast.Name) and f.id in _s42_norm_parameters(scope)) or len(call.args) != 1 or call.keywords:
        return None
    passed = _s42_passed_modules(module, scope, f.id)
    if isinstance(passed, str) and passed.startswith("no call of"):
        # s46: no caller in the file: PyTorch's nn.RMSNorm where the run-time type says so, the original elsewhere
        return _add_rms_norm_s46a.unbound_parameter_library_norm(module, call, f.id)
    if isinstance(passed, str):
        return NormCall(call, f.id, "not_rms", cls=f.id, reason=f"`{f.id}` is a parameter of `{scope.qualname}`: {passed}; "
                                                                   "what the norm is stays unknown")
    ctors: dict[str, tuple[ModuleInfo, ast.expr]] = {}
    for arg, caller in passed:
        built = _s42_passed_ctor(module, arg, caller)
        if built is None:
            return NormCall(call, f.id, "not_rms", cls=f.id,
                            reason=f"`{f.id}` is a parameter of `{scope.qualname}`; the module a caller hands it "
                                   f"(`{ast.unparse(arg)}`, line {arg.lineno}) is not one npufuse resolves to a construction")
        ctors.setdefault(f"{built[0].path}:{ast.dump(built[1])}", built)
    if len(ctors) != 1:
        return NormCall(call, f.id, "not_rms", cls=f.id,
                        reason=f"`{f.id}` is a parameter of `{scope.qualname}` whose callers hand it modules built differently "
                               f"({len(ctors)} constructions): one fused branch per construction is not built")
    file, value = next(iter(ctors.values()))
    where = f" (from {file.path})" if file is not module else ""
    nc = _norm_of_ctor(module, call, ctx, file, value, f.id, where, f"handed to `{scope.qualname}` by its callers", on_instance=True)
    if nc is not None and nc.kind != "not_rms" and not any(c.startswith(("type(", f"type({f.id})")) for c in nc.conditions):
        return None  # no run-time class test came with the reading: another caller's module would take the fused code
    return nc


# -- s42 (addnorm42): an optional or weightless norm after the add ------------------------------------------------
# ``self.norm = nn.RMSNorm(d, elementwise_affine=False)`` (no weight: npu_add_rms_norm gets ones of the last dim, as
# for ``F.rms_norm(x, (d,))``), and ``RMSNorm(d) if cfg.final_norm else nn.Identity()`` (the Identity side is no norm).


def _s42_identity(file: ModuleInfo, node: ast.expr) -> bool:
    """``nn.Identity()`` (any arguments: Identity ignores them)."""
    return isinstance(node, ast.Call) and file.canonical(node.func) in ("torch.nn.Identity", "torch.nn.modules.linear.Identity")


def _s42_weightless_library_norm(module: ModuleInfo, call: ast.Call, attr: str, mod: str, ctor: ast.Call) -> NormCall | None:
    """``nn.RMSNorm(d, eps, elementwise_affine=False)`` over the last dim alone: npu_add_rms_norm with ones as
    gamma and the module's eps (None: PyTorch's default). None for any other construction (a flag for the weight
    npufuse cannot read, a normalized_shape over several dims: ones of the last dim would be the wrong gamma)."""
    from npufuse.scan.dataflow import const_value, keyword

    affine = keyword(ctor, "elementwise_affine", 2)
    if affine is None or const_value(affine) is not False or any(k.arg is None for k in ctor.keywords):
        return None
    if not _last_dim_shape(keyword(ctor, "normalized_shape", 0)):
        return None
    T = S.torch_name(module) or "torch"
    eps = keyword(ctor, "eps", 1)
    v = const_value(eps) if eps is not None else None
    if eps is None or (isinstance(eps, ast.Constant) and eps.value is None):
        e = float32_eps(T)
    elif type(v) in (int, float):
        e = S.source_of(module, eps)
    else:
        e = eps_or_default(f"{mod}.eps", T)
    return NormCall(call, attr, "library", cls="nn.RMSNorm (elementwise_affine=False)", gamma="", eps=e, ones=True)


# -- s42 (addnorm42): an add + norm whose norm clamps the rms or the mean square from below ----------------------
# rms_norm's numeric probe maps the original's eps to the eps' npu_rms_norm adds inside the root (c ** 2 for a floor
# c on the rms, E itself for a floor E on the mean square) and states the difference;
# the add + norm on such a norm makes the same decision with the same eps' (never the original's eps), the same
# stated risk, and the same dtype rule: where the difference at rms 1 exceeds fp32's tolerance, the fused branch runs
# for fp16 / bf16 sums only.

# s45 (HO22b GeoAlign ``x / (||x|| * d ** -0.5 + eps) * g``): eps added outside the root is mapped too, as rms_norm
# maps it alone (eps' = eps ** 2, the probe's bound: every dtype up to 1e-6, fp16 / bf16 only up to 1e-4, refused above)
_S42_MAPPED_EPS_RULES = ("clamp on the norm", "clamp on the mean square", "added outside the root")


def _s42_eps_on_instance(text: str, me: str, mod: str) -> str | None:
    """The probe's eps' (an expression of the class's forward: ``(self.eps) ** 2``) with ``self`` read as the
    module expression ``mod``; None where it reads anything but module attributes and numbers (the input's
    shape, a name of the class's file)."""
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id != me:
            return None
        if isinstance(n, ast.Call) or isinstance(n, ast.Subscript):
            return None
    return re.sub(rf"\b{re.escape(me)}\.", mod + ".", text)


def _s42_eps_form_terms(m: NormCall, x1: str, T: str, params: dict[str, Any], risks: list[Risk]) -> str:
    """The stated risk and params of a probed norm with a mapped eps; the extra test sending fp32 sums to the
    original statements where the difference exceeds fp32's tolerance (as rms_norm's own finding does)."""
    from npufuse.scan import numeric_probe

    assert m.s42_eps_form is not None
    rule, original, bound = m.s42_eps_form
    params.update({"eps_rule": rule, "eps_original": original, "eps_bound": bound})
    half_only = bound > numeric_probe._EPS_FORM_BOUND
    risks.append(Risk("numerics", f"{m.cls}'s forward puts eps otherwise than npu_add_rms_norm ({rule}, `{original}`); the fused "
                                  f"op adds eps' = {m.eps} inside the root, mapped so that both agree on zero rows and far above "
                                  f"the floor: a relative difference of {bound:.2g} on rows of rms 1 (the probe's measurement), "
                                  "larger on rows whose rms is near the floor"
                                  + ("; above fp32's tolerance, so the fused branch runs for fp16 / bf16 sums only" if half_only else "")))
    # (s46 review) the probe measured the class's default eps: an instance built with a larger one runs the original
    within = f" or not ({m.eps} <= {numeric_probe.eps_prime_limit(rule == 'added outside the root', half_only)!r})"
    return (f" or {x1}.dtype == {T}.float32" if half_only else "") + within


# -- s42 (addnorm42): a norm class whose forward calls a custom kernel before its torch path ----------------------
# ``if HAS_TRITON and x.is_cuda: return rms_norm_triton(x, self.weight, self.eps)`` then the torch code (or the
# other way round, in an ``else``). The kernel's maths is not read (its contract may say RMSNorm, its code is
# another language); the torch path is, and it is what runs where the test is false. A test on the input's
# device (``x.is_cuda``, ``x.device.type == "cuda"``, in a conjunction too) is false for every tensor the fused
# branch takes (``_npufuse_on_npu``: an NPU tensor is no CUDA tensor); a test of flags (module names, ``self``
# attributes) is checked at run time, the fused code running where it is false. Anything else in the test
# (a call, another read of the input): not read, nothing fused.

_S42_CUDA_TYPES = _add_rms_norm_s47n.NOT_NPU_DEVICE_TYPES  # s47: was ("cuda",)


def _s42_device_test(test: ast.expr, x: str) -> bool:
    """``x.is_cuda`` / ``x.device.type == "cuda"`` (``"cuda" == ...`` too): false on an NPU tensor."""
    if isinstance(test, ast.Attribute) and test.attr == "is_cuda" and isinstance(test.value, ast.Name) and test.value.id == x:
        return True
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        sides = [test.left, test.comparators[0]]
        dev = [n for n in sides if dotted(n) == f"{x}.device.type"]
        lit = [n for n in sides if isinstance(n, ast.Constant) and n.value in _S42_CUDA_TYPES]
        return len(dev) == 1 and len(lit) == 1
    return False


def _s42_dead_on_npu(test: ast.expr, x: str) -> bool:
    """The test is false for every NPU input: a device test of the input, or a conjunction holding one."""
    if _s42_device_test(test, x):
        return True
    return isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and any(_s42_device_test(v, x) for v in test.values)


def _s42_true_on_npu(test: ast.expr, x: str) -> bool:
    """The test holds for every NPU input: the negation of one false there (``not x.is_cuda``, ``x.device.type !=
    "cuda"``), or a disjunction holding one."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _s42_dead_on_npu(test.operand, x)
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.NotEq):
        return _s42_device_test(ast.Compare(test.left, [ast.Eq()], test.comparators), x)
    return isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or) and any(_s42_true_on_npu(v, x) for v in test.values)


def _s42_flag_test(test: ast.expr, me: str, x: str) -> bool:
    """A test of flags only: names that are not the input, ``self`` attributes, constants, comparisons and
    boolean operators (no call, no subscript: nothing whose value the run-time check could not reread)."""
    for n in ast.walk(test):
        if isinstance(n, (ast.Call, ast.Subscript, ast.Lambda, ast.NamedExpr)):
            return False
        if isinstance(n, ast.Name) and n.id == x:
            return False
    return True


def _s42_kernel_branch(fwd: ast.FunctionDef, me: str, x: str, mod: str, foreign: bool) -> tuple[ast.Return, list[str], str] | None:
    """(the torch path's return, the run-time conditions, a note) for a forward that is ``if <test>: ...; return
    <kernel>`` then straight-line torch code ending in a return (or ``else:`` holding it); None otherwise."""
    body = [st for st in fwd.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    if not body or not isinstance(body[0], ast.If):
        return None
    head = body[0]
    rest = head.orelse if head.orelse else body[1:]
    if (head.orelse and body[1:]) or not head.body or not _add_rms_norm_s47n.ends_in_return(head.body) or not rest:
        return None
    test = head.test
    kernel = head.body
    if _s42_true_on_npu(test, x):
        # ``if not x.is_cuda: <torch path>`` then the kernel: the ``if`` body is what runs on an NPU tensor
        kernel, rest = rest, head.body
    if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)) for st in kernel for n in ast.walk(st)):
        return None
    if len(rest) > 8 or not isinstance(rest[-1], ast.Return) or rest[-1].value is None or not all(S._straight(st) for st in rest[:-1]):
        return None
    if kernel is not head.body:
        return rest[-1], [], f"its torch path runs under `{ast.unparse(test)}`, true for an NPU tensor: the torch path is read"
    if _s42_dead_on_npu(test, x):
        note = f"its kernel branch runs under `{ast.unparse(test)}`, false for an NPU tensor: the torch path is read"
        return rest[-1], [], note
    if foreign or "\n" in mod or not _s42_flag_test(test, me, x):
        return None
    cond = re.sub(rf"\b{re.escape(me)}\.", mod + ".", ast.unparse(test))
    note = f"its kernel branch runs under `{ast.unparse(test)}`, checked false at run time: the torch path is read"
    return rest[-1], [f"not ({cond})"], note


def _s42_unread_kernel_norm(module: ModuleInfo, call: ast.Call, cls: str, attr: str) -> NormCall | None:
    """A near miss for an RMSNorm-named class of this file whose forward npufuse did not read as a norm because it
    hands the input to a kernel: with no torch path (``return fused_rms_norm(x, self.weight, self.eps)``), or under a
    test it cannot prove false where the fused code runs. None for any other class (nothing is said there)."""
    fwd = S.method(module, cls, "forward")
    if fwd is None or not _RMS_NAME.search(cls):
        return None
    params = [a.arg for a in (*fwd.args.posonlyargs, *fwd.args.args)]
    if len(params) < 2:
        return None
    body = [st for st in fwd.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    if body and isinstance(body[0], ast.If) and isinstance(body[0].body[-1], ast.Return):
        return NormCall(call, attr, "not_rms", cls=cls,
                        reason=f"norm {cls}'s forward takes another path under `{ast.unparse(body[0].test)[:80]}`, a test npufuse "
                               "cannot prove false where the fused code runs (only a CUDA test of the input or flags are read): "
                               "which computation runs is not known")
    ret = S.helper_return(fwd)
    value = ret.value if ret is not None else None
    if not (isinstance(value, ast.Call) and isinstance(value.func, (ast.Name, ast.Attribute))):
        return None
    name = dotted(value.func) or ""
    canon = module.canonical(value.func) or name
    head = name.split(".")[0]
    if head not in module.aliases or head in module.classes or head in module.functions:
        return None  # only an imported function is a kernel npufuse does not read (``RMSNorm._norm`` is this file's code)
    if canon.startswith("torch.") or name.startswith(f"{params[0]}.") or not any(
            isinstance(a, ast.Name) and a.id == params[1] for a in value.args):
        return None
    return NormCall(call, attr, "not_rms", cls=cls,
                    reason=f"norm {cls}'s forward hands its input to `{name}`, a kernel npufuse does not read, with no torch "
                           "path: that it computes an RMSNorm (its name, a weight and an eps say so) is not proved")


# -- s42 (addnorm42): layer lists indexed by arithmetic ---------------------------------------------------------------
# an unrolled or strided layer loop reads ``self.norms[2 * i + 1]`` / ``self.layers[i + 1].ln_2``: where every element
# is one construction the index only picks which instance; arithmetic on names and numbers reads the same element
# each time it is evaluated (no call, no subscript that could change between two reads).

_S42_INDEX_NODES = (ast.Name, ast.Constant, ast.BinOp, ast.UnaryOp, ast.Attribute, ast.operator, ast.unaryop, ast.Load)


def _s42_plain_index(idx: ast.expr) -> bool:
    """A list index that is a name, an int, or arithmetic on names, attributes and ints (``2 * i + 1``)."""
    if isinstance(idx, ast.Constant):
        return type(idx.value) is int
    return all(isinstance(n, _S42_INDEX_NODES) and (not isinstance(n, ast.Constant) or type(n.value) is int) for n in ast.walk(idx))


# -- s42 (addnorm42): a residual add chosen by a conditional expression -------------------------------------------
# ``x = x + h if self.use_residual else h`` then ``x = self.norm(x)``: where the test holds (a test of flags, no
# call: it reads the same both times it is evaluated) the statement is the add and the pair is fused; elsewhere
# the statements run as written.


def _s42_conditional_sum_sites(module: ModuleInfo, scope: Scope) -> Iterable[tuple[ast.stmt, _Site | str]]:
    if " if " not in S.scope_text(module, scope) or " else " not in S.scope_text(module, scope):
        return
    import dataclasses

    idx = S.stmt_index(scope)
    for stmt in idx.stmts:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and isinstance(stmt.value, ast.IfExp) and all(isinstance(n, _PURE_TEST) for n in fast_walk(stmt.value.test))):
            continue
        arms = [(stmt.value.body, f"({S.source_of(module, stmt.value.test)})"),
                (stmt.value.orelse, f"not ({S.source_of(module, stmt.value.test)})")]
        added = [(ops, cond) for arm, cond in arms for ops in [_operands(module, arm)] if isinstance(ops, tuple)]
        if len(added) != 1:
            continue  # no add, or an add in both arms (the branch-sum reading's form)
        (x1, x2), cond = added[0]
        s_name = stmt.targets[0].id
        if s_name in {n.id for n in ast.walk(stmt.value.test) if isinstance(n, ast.Name)}:
            continue
        block, i = idx.block[id(stmt)]
        if i + 1 >= len(block):
            continue
        yield from _norm_of_sum(module, scope, block[i + 1], s_name,
                                lambda nstmt, nc, stmt=stmt, x1=x1, x2=x2, s_name=s_name, cond=cond:
                                _Site(stmt, [], nstmt, dataclasses.replace(nc, conditions=[cond, *nc.conditions]), x1, x2, s_name))


# -- s43 (addnorm43): profiling markers between the add and the norm ------------------------------------------------
# llm-infer-engine's block: ``torch.cuda.nvtx.range_push("Attn"); x = x + self.attention(...); range_pop();
# range_push("FFN"); x = x + self.feed_forward(self.ffn_norm(x)); range_pop()``. The pop / push between the add and
# the norm only mark time ranges: they read no tensor the add or the norm makes and change none. They travel with
# the sum's aliases (in their order, every marker re-emitted once on each path, so the nvtx stack stays balanced);
# on the npu_add_rms_norm path the norm's kernel then runs before the markers instead of after (it is attributed to
# the range before). Logging calls (``logging.info`` / a module-level ``logging.getLogger`` logger) count alike.
# Not markers: arguments that call anything but ``str`` / ``"...".format`` (the call may have effects), any other
# statement (``torch.cuda.synchronize()``, a cache update, a rebinding of the sum).

_S43_MARKERS = frozenset({
    "torch.cuda.nvtx.range_push", "torch.cuda.nvtx.range_pop", "torch.cuda.nvtx.mark", "torch.cuda.nvtx.range_start",
    "torch.cuda.nvtx.range_end", "nvtx.push_range", "nvtx.pop_range", "nvtx.mark", "nvtx.start_range", "nvtx.end_range",
})
_S43_LOG_LEVELS = frozenset({"debug", "info", "warning", "warn", "error", "critical", "log"})


def _s43_module_loggers(module: ModuleInfo) -> frozenset[str]:
    """Names bound at module level to ``logging.getLogger(...)`` (memoised per file)."""
    cached = module.__dict__.get("_s43_loggers")
    if cached is None:
        cached = frozenset(t.id for st in module.tree.body if isinstance(st, ast.Assign) and isinstance(st.value, ast.Call)
                           and module.canonical(st.value.func) == "logging.getLogger"
                           for t in st.targets if isinstance(t, ast.Name))
        module.__dict__["_s43_loggers"] = cached
    return cached


def _s43_marker_call(module: ModuleInfo, scope: Scope, stmt: ast.stmt) -> ast.Call | None:
    """The call of an expression statement that names a profiling marker or a logging call (its arguments unread);
    None where the callee's root name is a local or a parameter of ``scope`` (a ``logger`` handed in may be any
    object: it is not the module-level logging logger its name says)."""
    from npufuse.patterns._attention_s33 import is_parameter

    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return None
    root = stmt.value.func
    while isinstance(root, ast.Attribute):
        root = root.value
    if isinstance(root, ast.Name) and (scope.assignments.get(root.id) or is_parameter(scope, root.id)):
        return None
    name = module.canonical(stmt.value.func) or ""
    if name in _S43_MARKERS:
        return stmt.value
    head, _, level = name.rpartition(".")
    if level in _S43_LOG_LEVELS and (head == "logging" or head in _s43_module_loggers(module)):
        return stmt.value
    return None


def _s43_marker_reason(module: ModuleInfo, call: ast.Call) -> str | None:
    """Why the marker ``call`` cannot be moved past the norm's kernel: an argument calls something (other than
    ``str()`` / ``"...".format()``: formatting a message); None when it can."""
    for arg in (*call.args, *(k.value for k in call.keywords)):
        for n in fast_walk(arg):
            if not isinstance(n, ast.Call):
                continue
            if (isinstance(n.func, ast.Name) and n.func.id == "str") or \
                    (isinstance(n.func, ast.Attribute) and n.func.attr == "format" and isinstance(n.func.value, ast.Constant)):
                continue
            return (f"`{ast.unparse(call.func)}(...)` between the add and the norm calls `{ast.unparse(n.func)}` in its "
                    "arguments: a call npufuse does not read may have effects, so the marker is not moved past the fused norm")
    return None


def _s43_is_marker(module: ModuleInfo, scope: Scope, stmt: ast.stmt) -> bool:
    """A profiling marker / logging statement that may sit between the add and the norm (see above)."""
    call = _s43_marker_call(module, scope, stmt)
    return call is not None and _s43_marker_reason(module, call) is None


def _s43_unmoved_marker(module: ModuleInfo, scope: Scope, block: list[ast.stmt], j: int, s_name: str) -> Iterator[tuple[ast.stmt, str]]:
    """The near miss of a marker at ``block[j]`` that may not move (its reason), where the norm of the sum follows it
    (through further aliases and markers)."""
    call = _s43_marker_call(module, scope, block[j])
    reason = _s43_marker_reason(module, call) if call is not None else None
    if reason is None:
        return
    k = j + 1
    while k < len(block) and (_is_alias(block[k], s_name) or _s43_marker_call(module, scope, block[k]) is not None):
        k += 1
    if k < len(block):
        for nstmt, _site in _norm_of_sum(module, scope, block[k], s_name, lambda nstmt, nc: None):  # type: ignore[arg-type,return-value]
            yield nstmt, reason


# -- s43 (addnorm43): a norm forward returning from an if/else on a module attribute -----------------------------------
# video-diffusion-speedrun's RMSNorm: ``x = x.float(); norm = rsqrt(...); if self.weight is not None: return (x * norm
# * self.weight).to(dtype) else: return (x * norm).to(dtype)`` (the weight is built only when trainable). One arm is
# read (the one reading more of the module's attributes: the weighted one) and the fused code runs where the test
# selects it, checked at run time on the module (``self`` read as the call's module); the other arm takes the
# original call. The test may read only the module's attributes and constants: it means the same at the call site.

def _s43_attribute_test(test: ast.expr, me: str) -> bool:
    """A test of ``me.<attr>`` chains, constants, comparisons and boolean operators only."""
    for n in ast.walk(test):
        if isinstance(n, ast.Name) and n.id != me:
            return False
        if not isinstance(n, (ast.Name, ast.Attribute, ast.Constant, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.cmpop,
                              ast.boolop, ast.unaryop, ast.expr_context)):
            return False
    return any(isinstance(n, ast.Attribute) for n in ast.walk(test))


def _s43_branch_return(fwd: ast.FunctionDef, me: str, mod: str) -> tuple[ast.Return, list[str]] | None:
    """(the arm's return, its run-time condition) for a forward of straight-line statements ending in ``if <test of
    the module's attributes>: return A`` and ``else: return B`` (or ``return B`` after the ``if``); None otherwise."""
    body = [st for st in fwd.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    if len(body) >= 2 and isinstance(body[-2], ast.If) and not body[-2].orelse and isinstance(body[-1], ast.Return):
        head, other, prelude = body[-2], [body[-1]], body[:-2]
    elif body and isinstance(body[-1], ast.If) and body[-1].orelse:
        head, other, prelude = body[-1], body[-1].orelse, body[:-1]
    else:
        return None
    arms = [head.body, other]
    if "\n" in mod or len(prelude) > 8 or not all(S._straight(st) for st in prelude) or not _s43_attribute_test(head.test, me) \
            or not all(len(a) == 1 and isinstance(a[0], ast.Return) and a[0].value is not None for a in arms):
        return None

    def module_reads(ret: ast.stmt) -> int:
        return sum(1 for n in ast.walk(ret) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == me)

    # the module read as the call's module by name, not by text (a string constant saying ``self.`` stays as written)
    fresh = ast.parse(ast.unparse(head.test), mode="eval").body
    test = ast.unparse(_renamed(fresh, me, "_npu_norm_module")).replace("_npu_norm_module", mod)
    if module_reads(arms[1][0]) > module_reads(arms[0][0]):
        return arms[1][0], [f"not ({test})"]  # type: ignore[list-item]
    return arms[0][0], [f"({test})"]  # type: ignore[list-item]


def _s43_built_beside_none(module: ModuleInfo, class_name: str | None, attr: str) -> ast.Call | None:
    """The one construction ``__init__`` assigns ``self.<attr>`` where its other assignments are ``None``
    (``if cross_attn: self.norm2 = RMSNorm(d) else: self.norm2 = None``): calling None fails in the original, so
    where the module is called it is that construction."""
    init = S.method(module, class_name, "__init__") if class_name else None
    if init is None:
        return None
    built: dict[str, ast.Call] = {}
    for st in S._stmts_in(init.body):
        if isinstance(st, ast.Assign) and any(dotted(t) == f"self.{attr}" for t in st.targets):
            if isinstance(st.value, ast.Constant) and st.value.value is None:
                continue
            if not isinstance(st.value, ast.Call) or len(st.targets) != 1:
                return None
            built.setdefault(ast.dump(st.value), st.value)
    return next(iter(built.values())) if len(built) == 1 else None


# -- s43 (addnorm43): a layer object handed to a plain function ------------------------------------------------------
# DeepSeek-V3 shakespeare's training script: ``def update_load_balancing(model, x): for layer in model.layers: x = x +
# layer.attention(layer.attention_norm(x)); x_norm = layer.ffn_norm(x)``, called as ``update_load_balancing(model, x)``
# where ``train()`` binds ``model = DeepSeek(config)`` (then maybe ``model = torch.compile(model)``, which hands
# attribute reads to the model). The parameter's class is the one class every call in the file hands it; the norm
# reading then adds its run-time class test as for any other layer object (another caller's object takes the
# original call).

# methods that return the module itself (``torch.compile`` returns a wrapper whose attributes are the module's)
_S43_SAME_MODULE_METHODS = frozenset({"to", "cuda", "cpu", "float", "half", "bfloat16", "train", "eval", "requires_grad_"})


def _s43_hands_on(module: ModuleInfo, v: ast.expr, name: str) -> bool:
    """``v`` is the module ``name`` holds, handed on: ``name``, ``torch.compile(name)``, ``name.to(device)``, or a
    conditional expression of those (``torch.compile(model) if cfg.compile else model``)."""
    if isinstance(v, ast.Name):
        return v.id == name
    if isinstance(v, ast.IfExp):
        return _s43_hands_on(module, v.body, name) and _s43_hands_on(module, v.orelse, name)
    if not isinstance(v, ast.Call):
        return False
    f = v.func
    passed = v.args[0] if module.canonical(f) == "torch.compile" and v.args else \
        f.value if isinstance(f, ast.Attribute) and f.attr in _S43_SAME_MODULE_METHODS else None
    return isinstance(passed, ast.Name) and passed.id == name


def _s43_built_class(module: ModuleInfo, scope: Scope, name: str, values: list[ast.expr]) -> _Owner | None:
    """The class of the local ``name`` when every assignment of it builds one class of the repository (``Cls(...)``)
    or hands the same module on (:func:`_s43_hands_on`), at least one building it."""
    from npufuse.patterns._attention_s33 import is_parameter

    owner: _Owner | None = None
    for v in values:
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name):
            # a class's name (capitalised): a cheap gate before another file of the repository is looked up; a
            # parameter or local of that name (``def train(Model=..)``) may be any class (s43 review)
            shadowed = bool(scope.assignments.get(v.func.id)) or is_parameter(scope, v.func.id)
            got = _class_named(module, v.func.id) if v.func.id[:1].isupper() and not shadowed else None
            if got is None or (owner is not None and (got[0].path, got[1]) != (owner[0].path, owner[1])):
                return None
            owner = got
        elif not _s43_hands_on(module, v, name):
            return None
    return owner


def _s43_parameter_class(module: ModuleInfo, scope: Scope, param: str, depth: int) -> _Owner | None:
    """The class of the parameter ``param`` of ``scope``: the one class every call of the function in this file
    hands it (a name the caller builds, or an object followed from the caller's ``self``); None otherwise."""
    fn = scope.node
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name == "__init__" or param == "self" or depth > 3:
        return None
    memo = module.__dict__.setdefault("_s43_param_class", {})
    key = (id(fn), param)
    if key in memo:
        return memo[key]
    memo[key] = None  # a call cycle reads as unresolved
    passed = _s42_passed_modules(module, scope, param)
    owners: dict[tuple[str, str] | None, _Owner | None] = {}
    for arg, caller in passed if not isinstance(passed, str) else ():
        got = _object_class(module, caller, arg, depth + 1) if caller is not scope else None
        owners[(got[0].path, got[1]) if got is not None else None] = got
    owner = next(iter(owners.values())) if len(owners) == 1 and not isinstance(passed, str) else None
    memo[key] = owner
    return owner


# a plain function's text calling a norm module of an object: ``layer.ffn_norm(``, ``block.ln_2(``
# s51 (perf51): led by the ``.`` (an uncased literal ``re`` searches for, case-insensitive or not) with the word character
# before it as a lookbehind: only searched for whether it matches, which the two forms agree on
_S43_MEMBER_NORM_TEXT = re.compile(r"\.(?<=\w\.)\w*(?:norm|ln_?\d)\w*\(", re.I)


def _s43_guarded_member_norm(nc: NormCall) -> bool:
    """``<object>.<attr>(s)`` (not ``self``'s) whose reading checks the module's run-time class."""
    f = nc.call.func
    if not isinstance(f, ast.Attribute) or (isinstance(f.value, ast.Name) and f.value.id == "self"):
        return False
    if nc.kind == "not_rms":
        return "does not resolve" not in nc.reason  # an object of no known class: silent, as before s43
    return any(c.startswith("type(") for c in nc.conditions)


# -- s43 (addnorm43): a norm applied through a None-guarding helper method ----------------------------------------------
# CS336's ``def _norm(self, norm, x): return norm(x) if norm is not None else x`` called as ``x = x + self.ffn(
# self._norm(self.ln2, x))`` / ``x = self._norm(self.ln1, x + self.attn(x))``, ``self.ln2 = RMSNorm(d) if cfg.rms
# else None``. The call is read as ``self.ln2(x)`` (a call node standing at the helper call's place, so the rewrite
# replaces the whole helper call), fused where ``self.ln2 is not None`` (elsewhere the helper returns x: the original).


def _s43_guarding_helper(fn: ast.FunctionDef) -> bool:
    """``def h(self, norm, x): return norm(x) if norm is not None else x`` (or ``x if norm is None else norm(x)``, or
    ``if norm is None: return x`` then ``return norm(x)``)."""
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    if len(params) != 3 or fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or fn.decorator_list:
        return False
    _me, norm, x = params
    applied = f"{norm}({x})"
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    if len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.IfExp):
        v = body[0].value
        text = (ast.unparse(v.test), ast.unparse(v.body), ast.unparse(v.orelse))
        return text in ((f"{norm} is not None", applied, x), (f"{norm} is None", x, applied))
    if len(body) == 2 and isinstance(body[0], ast.If) and not body[0].orelse and isinstance(body[1], ast.Return):
        first = body[0]
        return (ast.unparse(first.test) == f"{norm} is None" and len(first.body) == 1 and isinstance(first.body[0], ast.Return)
                and ast.unparse(first.body[0]) == f"return {x}" and ast.unparse(body[1]) == f"return {applied}")
    return False


def _s43_unwrap(module: ModuleInfo, scope: Scope, node: ast.expr) -> ast.expr:
    """``self.<helper>(<module>, <x>)`` of a None-guarding helper method of the class: a call ``<module>(<x>)`` at its
    place (one per call, kept per file with the test it needs); any other node as it is."""
    if not (isinstance(node, ast.Call) and len(node.args) == 2 and not node.keywords and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self" and scope.class_name
            and isinstance(node.args[0], (ast.Attribute, ast.Name)) and not isinstance(node.args[1], ast.Starred)):
        return node
    made = module.__dict__.setdefault("_s43_unwrapped", {})
    if id(node) in made:
        return made[id(node)]
    fn = S.method(module, scope.class_name, node.func.attr)
    out: ast.expr = node
    if isinstance(fn, ast.FunctionDef) and _s43_guarding_helper(fn):
        out = ast.copy_location(ast.Call(func=node.args[0], args=[node.args[1]], keywords=[]), node)
        out.end_lineno, out.end_col_offset = node.end_lineno, node.end_col_offset  # type: ignore[attr-defined]
        module.__dict__.setdefault("_s43_helper_tests", {})[id(out)] = f"{S.source_of(module, node.args[0])} is not None"
    made[id(node)] = out
    return out
