"""Library RMSNorms: ``nn.RMSNorm`` modules and ``F.rms_norm`` / ``torch.rms_norm`` calls.

The most common replacement Ascend engineers make when porting (issue 14, class 1): the model
already calls PyTorch's RMSNorm, which on NPU runs as several kernels, and the port calls
``torch_npu.npu_rms_norm`` instead. The hand-written-norm matcher of :mod:`rms_norm` looks for
``rsqrt(mean(x**2) + eps)`` arithmetic and never sees these; this module finds

* calls ``F.rms_norm(x, normalized_shape, weight=None, eps=None)`` (any alias of
  ``torch.nn.functional``, ``torch.rms_norm``), and
* calls ``self.<attr>(x)`` in a method of a class whose ``__init__`` assigns
  ``self.<attr> = nn.RMSNorm(normalized_shape, eps=None, elementwise_affine=True, ...)``
  (the call site is rewritten, not the constructor: the module's weight and eps are read from
  the instance, so loading a checkpoint is unchanged),

and ``F.normalize(x, dim=-1) * scale * g`` (the "l2norm times sqrt(d)" RMSNorm of lucidrains-style
code), which is reported as a near miss with the difference stated: ``F.normalize`` clamps the
norm from below (``x / max(||x||, eps)``) where ``npu_rms_norm`` adds eps inside the root.

Facts the replacement relies on (checked against torch 2.13 on CPU):

* ``npu_rms_norm`` returns ``(y, rstd)``: the output is ``[0]``;
* ``eps=None`` (the default of both ``nn.RMSNorm`` and ``F.rms_norm``): PyTorch's documentation
  says ``torch.finfo(x.dtype).eps``, but the kernel takes the epsilon of its *compute* type, which
  is float32 for float16/bfloat16/float32 inputs (bf16 input with ``finfo(bf16).eps = 0.0078``
  would change the output visibly; measured: it does not). The replacement passes
  ``torch.finfo(torch.float32).eps`` and the finding says so;
* ``elementwise_affine=False`` / ``weight=None``: ``npu_rms_norm`` needs a gamma, so ones of the
  normalized shape are passed (same result, one small allocation per call).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

from npufuse.patterns import _norm_s44h, _rms_norm_s49m
from npufuse.patterns import _site as S
from npufuse.patterns.base import Finding, NearMiss, Result, Risk
from npufuse.scan import canonical
from npufuse.scan.dataflow import ModuleInfo, Scope, const_value, dotted, fast_walk, keyword

RMS_NORM_FN = "torch.nn.functional.rms_norm"
RMS_NORM_CLASS = "torch.nn.RMSNorm"
NORMALIZE_FN = "torch.nn.functional.normalize"

# The default epsilon of PyTorch's rms_norm for fp16/bf16/fp32 inputs (see the module docstring).
DEFAULT_EPS_NOTE = ("eps is None here: PyTorch's rms_norm then uses the epsilon of its compute type, float32 for "
                    "fp16/bf16/fp32 inputs (its docs say torch.finfo(x.dtype).eps; the kernel uses the float32 one), "
                    "so the replacement passes torch.finfo(torch.float32).eps")

_RISKS = [
    Risk("dtype", "npu_rms_norm: fp16/bf16/fp32; gamma in the input's dtype, or fp32 with fp16/bf16 input (A2/A3 only; 310P/910 need the same dtype)"),
    Risk("other", "npu_rms_norm needs a 2-8-D input (1-D vectors fall back to an error on NPU)"),
]


def relevant(module: ModuleInfo) -> bool:
    """Cheap per-file gate: the file names one of the APIs at all."""
    cached = module.__dict__.get("_npufuse_library_norm_text")
    if cached is None:
        src = module.source
        cached = module.__dict__["_npufuse_library_norm_text"] = "rms_norm" in src or "RMSNorm" in src or "RmsNorm" in src or _l2_text(src) \
            or ("norm(" in src and "keepdim" in src)  # x / (||x|| * s + eps): see eps_added_norm_sites
    return cached


def detect(module: ModuleInfo, scope: Scope) -> Iterator[Result]:
    """Findings and near misses for library norms in one scope."""
    if not relevant(module):
        return
    text = S.scope_text(module, scope)
    out: list[Result] = []
    if any(w in text for w in _ctor_words(module)) or (scope.qualname.endswith(".__init__") and rms_subclass(module, scope.class_name)):
        # nn.RMSNorm modules: swapped where they are constructed (see construction_sites)
        ctor_idx = S.stmt_index(scope)
        out.extend(construction_sites(module, scope, ctor_idx))
        out.extend(hf_construction_sites(module, scope, ctor_idx))
        out.extend(library_construction_sites(module, scope, ctor_idx))  # apex / xformers modules
    if "RmsNorm" in text:  # library families found by package and class name (timm)
        out.extend(family_construction_sites(module, scope, S.stmt_index(scope)))
    if scope.qualname == "<module>":
        out.sort(key=lambda r: r.line)
        yield from out
        return
    hf = _hf_norm_attributes(module, scope.class_name) if _imports_hf_norm(module) else None
    if hf and any(f"self.{a}(" in text for a in hf):
        out.extend(hf_norm_calls(module, scope, S.stmt_index(scope), hf))
    l2 = _l2_text(text) or any(f"{h}(" in text for h in _l2_helpers(module))
    if not (l2 or _may_call_rms_norm(module, text) or ("norm(" in text and "+" in text)):
        yield from out
        return
    idx = S.stmt_index(scope)
    calls = scope.nodes().get(ast.Call, [])
    sites: dict[int, list[_Site]] = {}
    missed: set[int] = set()
    for call in calls:
        if canonical.api(module, call.func) != RMS_NORM_FN:
            continue
        for r in _functional(module, scope, idx, call):
            if isinstance(r, _Site):
                sites.setdefault(id(r.stmt), []).append(r)
            else:
                out.append(r)
                missed.add(r.line)
    claimed = _claimed_by_add_rms_norm(module, scope) if sites else set()
    for key in list(sites):
        sites[key] = [x for x in sites[key] if id(x.call) not in claimed]
        if not sites[key]:
            del sites[key]
    for group in sites.values():
        if group[0].stmt.lineno in missed:
            continue  # another call in the statement cannot be replaced: the statement stays as it is
        group.sort(key=lambda x: (x.call.lineno, x.call.col_offset))
        out.append(_finding(module, scope, group))
    if l2:
        out.extend(l2_norm_sites(module, scope, idx))
    if "norm(" in text and "+" in text:
        out.extend(eps_added_norm_sites(module, scope, idx))
    out.sort(key=lambda r: r.line)
    yield from out


# (s50: the left boundary after the word, as _compiled._SCRIPT_WORD: the same matches, searched by the literal)
_RMS_NORM_WORD = re.compile(r"rms_norm(?<!\wrms_norm)(?!\w)")


def _may_call_rms_norm(module: ModuleInfo, text: str) -> bool:
    """Can a call in ``text`` resolve to ``F.rms_norm``? Its callee's last name is ``rms_norm``
    as a whole word (``F.rms_norm``, ``torch.rms_norm``) or an import alias of the function
    (``from torch.nn.functional import rms_norm as rn``); ``rms_norm_eps`` (in most Hugging Face
    files) is neither, and a scope holding only that word used to be walked node by node.
    Text outside ASCII keeps the plain substring test (an identifier is read in NFKC form).
    Narrows the test this replaces (``"rms_norm" in text``), never widens it."""
    if "rms_norm" not in text:
        return False
    if not text.isascii():
        return True
    return _RMS_NORM_WORD.search(text) is not None or any(a in text for a in _rms_norm_aliases(module))


def _rms_norm_aliases(module: ModuleInfo) -> tuple[str, ...]:
    """Local names the module imports ``rms_norm`` itself under, when not ``rms_norm`` (cached)."""
    cached = module.__dict__.get("_npufuse_rms_norm_aliases")
    if cached is None:
        cached = module.__dict__["_npufuse_rms_norm_aliases"] = tuple(
            local for local, target in module.aliases.items() if local != "rms_norm" and canonical.SYNONYMS.get(target, target) == RMS_NORM_FN)
    return cached


def _imports_hf_norm(module: ModuleInfo) -> bool:
    """Does the module import one of ``_HF_LLAMA_NORMS`` from transformers? Without one,
    ``_hf_norm_attributes`` finds nothing in any class (cached per module)."""
    cached = module.__dict__.get("_npufuse_imports_hf_norm")
    if cached is None:
        cached = module.__dict__["_npufuse_imports_hf_norm"] = any(
            full.startswith("transformers.") and full.rsplit(".", 1)[-1] in _HF_LLAMA_NORMS for full in module.aliases.values())
    return cached


def _claimed_by_add_rms_norm(module: ModuleInfo, scope: Scope) -> set[int]:
    """Library norm calls on a residual sum that add_rms_norm replaces (``x = x + a; y = F.rms_norm(x, ...)``):
    reported once, there (its training path runs the add then npu_rms_norm, so nothing is lost)."""
    from npufuse.patterns import add_rms_norm as A

    if not scope.class_name or "+" not in S.scope_text(module, scope):
        return set()
    out: set[int] = set()
    for _stmt, site in A._sites(module, scope):
        if isinstance(site, A._Site) and site.nc.kind in ("library", "external") and isinstance(A._build(module, scope, site), Finding):
            out.add(id(site.nc.call))
    return out


def _next_reader(idx: S.StmtIndex, stmt: ast.Assign) -> tuple[ast.stmt | None, ast.Name | None]:
    """The statement right after ``stmt`` (``n = ...`` binding one name) in its block, and its
    first read of that name (None when there is no next simple statement or it does not read it)."""
    loc = idx.block.get(id(stmt))
    nxt = loc[0][loc[1] + 1] if loc is not None and loc[1] + 1 < len(loc[0]) else None
    use = next((n for n in S.iter_exprs_topdown(nxt) if isinstance(n, ast.Name) and n.id == stmt.targets[0].id), None) \
        if nxt is not None and S.simple_stmt(nxt) else None
    return nxt, use


def _stmt_of(idx: S.StmtIndex, scope: Scope, call: ast.Call) -> ast.stmt | None:
    """The simple statement holding ``call`` directly in this scope (not in a nested def/lambda)."""
    best = None
    for stmt in idx.stmts:
        if stmt.lineno <= call.lineno <= (stmt.end_lineno or stmt.lineno) and S.simple_stmt(stmt):
            if any(n is call for n in S.iter_exprs_topdown(stmt)):
                best = stmt
    return best


def _atom(node: ast.AST | None) -> bool:
    """A name or ``self.a.b``: reading it twice reads the same value, at no cost."""
    return dotted(node) is not None


def _miss(scope: Scope, stmt: ast.stmt, reason: str) -> NearMiss:
    return NearMiss("rms_norm", scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, reason)


def float32_eps(T: str) -> str:
    """PyTorch's rms_norm epsilon when none is given, as its kernel uses it (the float32 one)."""
    return f"{T}.finfo({T}.float32).eps"


def eps_or_default(src: str, T: str) -> str:
    """``src`` read at run time, where None means :func:`float32_eps` (PyTorch's rule)."""
    return f"({src} if {src} is not None else {float32_eps(T)})"


def _eps_code(eps: ast.expr | None, module: ModuleInfo, T: str, notes: list[str]) -> tuple[str, object] | None:
    """(source of the epsilon argument, its value for params); None when it cannot be written once."""
    value = const_value(eps) if eps is not None else None
    if eps is None or value is None:
        notes.append(DEFAULT_EPS_NOTE)
        return float32_eps(T), "finfo(float32).eps"
    if type(value) in (int, float):
        return S.source_of(module, eps), float(value)  # type: ignore[arg-type]
    if _atom(eps):
        # may be None at run time (a parameter defaulting to None): same rule as PyTorch's
        src = S.source_of(module, eps)
        notes.append("eps is read at run time; None means torch.finfo(torch.float32).eps, as in PyTorch's kernel")
        return eps_or_default(src, T), src
    return None


@dataclass
class _Site:
    """One library norm call and its replacement (a statement may hold several: q and k norms)."""

    stmt: ast.stmt
    call: ast.Call
    expr: str
    guard: str
    params: dict
    variant: str
    notes: list[str]
    conditions: list[str] = field(default_factory=list)


def _finding(module: ModuleInfo, scope: Scope, sites: list[_Site]) -> Finding:
    """One finding per statement: every library norm call in it replaced."""
    stmt = sites[0].stmt
    fused = S.splice(module, stmt, [(x.call, x.expr) for x in sites])
    conditions = list(dict.fromkeys(c for x in sites for c in x.conditions))
    if conditions:
        fused = f"if {' and '.join(conditions)}:\n{S.indent(fused)}\nelse:\n{S.indent(S.stmt_source(module, stmt))}"
    notes = list(dict.fromkeys(n for x in sites for n in x.notes))
    params = dict(sites[0].params)
    if len(sites) > 1:
        params["calls"] = len(sites)
        params["inputs"] = [x.params.get("x") for x in sites]
    return Finding(
        pattern="rms_norm", qualname=scope.qualname, line=stmt.lineno, end_line=stmt.end_lineno or stmt.lineno,
        params=params, fused=fused, guard_tensor=sites[0].guard, confidence="high", variant=sites[0].variant,
        risks=list(_RISKS), notes=["unfused: PyTorch's rms_norm (several kernels on NPU); fused: 1", *notes], training_ok=True,
    )


def _functional(module: ModuleInfo, scope: Scope, idx: S.StmtIndex, call: ast.Call) -> Iterator["Result | _Site"]:
    stmt = _stmt_of(idx, scope, call)
    if stmt is None:
        return
    done = S.already_fused(module, scope, stmt)
    if done:
        yield _miss(scope, stmt, done)
        return
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        yield _miss(scope, stmt, "rms_norm called with *args/**kwargs: its input, weight and eps cannot be read")
        return
    T = S.torch_name(module) or "torch"
    x = keyword(call, "input", 0)
    shape = keyword(call, "normalized_shape", 1)
    weight = keyword(call, "weight", 2)
    eps = keyword(call, "eps", 3)
    if x is None or shape is None:
        return
    notes: list[str] = []
    e = _eps_code(eps, module, T, notes)
    if e is None:
        yield _miss(scope, stmt, "eps is an expression that would be evaluated twice; bind it to a name first")
        return
    x_src = S.source_of(module, x)
    if weight is None or const_value(weight) is None:
        if not _atom(x):
            yield _miss(scope, stmt, "rms_norm without a weight on an inline expression: the replacement needs the input "
                                     "twice (for the ones gamma); bind the input to a name first")
            return
        gamma = f"{T}.ones({S.source_of(module, shape)}, dtype={x_src}.dtype, device={x_src}.device)"
        variant = "f_rms_norm_no_weight"
    else:
        gamma = S.source_of(module, weight)
        variant = "f_rms_norm"
    guard = x_src if _atom(x) else (gamma if weight is not None and _atom(weight) else None)
    if guard is None:
        yield _miss(scope, stmt, "neither the input nor the weight of rms_norm is a name: no tensor to check the device of before the call")
        return
    expr = f"torch_npu.npu_rms_norm({x_src}, {gamma}, epsilon={e[0]})[0]"
    params = {"eps": e[1], "weight": S.source_of(module, weight) if weight is not None else None, "source": "library", "x": x_src}
    yield _Site(stmt, call, expr, guard, params, variant, notes)


def rms_subclass(module: ModuleInfo, name: str | None) -> bool:
    """A class of this module deriving from ``nn.RMSNorm`` without its own ``forward``
    (torchtitan's configurable ``class RMSNorm(nn.RMSNorm, Module)``): it computes nn.RMSNorm."""
    cls = module.classes.get(name or "")
    if cls is None or S.method(module, cls.name, "forward") is not None:
        return False
    return any(canonical.api(module, b) == RMS_NORM_CLASS for b in cls.bases)


# --- nn.RMSNorm modules: swapped where they are constructed --------------------------------
#
# A port replaces the module, not each call: the finding is the statement constructing it
# (``self.norm = nn.RMSNorm(dim, eps=eps)``; where humans point), and the fused branch constructs
# the same module and gives that instance a forward that runs ``npu_rms_norm`` on NPU input and
# nn.RMSNorm's own forward otherwise. The instance stays an nn.RMSNorm: its ``weight`` parameter,
# ``eps``, ``normalized_shape`` and state_dict keys are unchanged (checkpoints load as before),
# every call site is covered (``self.norm(x.permute(...))``, calls from other classes), and the
# weightless and ``eps=None`` cases are read from the instance at run time. The switch is read
# at construction; the device is checked on every call. A subclass of nn.RMSNorm without its own
# forward (torchtitan) is swapped in its own ``__init__``, right after ``super().__init__(...)``.

_SWAP = "_npufuse_rms_norm_swap"

_SWAP_RISKS = [
    Risk("other", "the module's forward is replaced on the instance by a function defined where it is constructed: "
                  "pickling the whole module (torch.save(model), not its state_dict) and torch.jit.script of it "
                  "fail; deepcopy, state_dict and torch.compile work"),
]


def _swap_helper(T: str) -> str:
    """The statements defining the swap: a local function, so the file needs nothing new imported."""
    return "\n".join([
        f"def {_SWAP}(norm):",
        "    # nn.RMSNorm's forward through torch_npu.npu_rms_norm for NPU input; weight, eps and the",
        "    # state_dict keys stay those of the nn.RMSNorm instance",
        "    def forward(self, x):",
        f"        if _npufuse_on_npu(x) and type(self).forward is {T}.nn.RMSNorm.forward and 2 <= x.dim() <= 8:",
        f"            gamma = self.weight if self.weight is not None else {T}.ones(self.normalized_shape, dtype=x.dtype, device=x.device)",
        f"            eps = self.eps if self.eps is not None else {float32_eps(T)}",
        f"            if x.dtype == {T}.float32 and gamma.dtype != x.dtype:",
        "                gamma = gamma.float()  # a half weight with fp32 input: torch computes in fp32 (exact upcast)",
        "            # npu_rms_norm takes gamma in the input's dtype, or float32 with an fp16/bf16 input",
        f"            if gamma.dtype in (x.dtype, {T}.float32):",
        "                return torch_npu.npu_rms_norm(x, gamma, epsilon=eps)[0]",
        "        return type(self).forward(self, x)",
        "",
        "    norm.forward = forward.__get__(norm)",
        "    return norm",
        "",
    ])


def _ctor_call(module: ModuleInfo, call: ast.Call) -> str | None:
    """The class a call constructs when it is PyTorch's RMSNorm (or a subclass of this module
    without forward nor __init__ of its own: one with an ``__init__`` is swapped there)."""
    if isinstance(call.func, ast.Call):
        return None  # ``nn.RMSNorm(d)(x)`` calls the module the inner call builds: that one is the construction
    if canonical.api(module, call.func) == RMS_NORM_CLASS:
        return "nn.RMSNorm"
    name = dotted(call.func)
    if rms_subclass(module, name) and S.method(module, name, "__init__") is None:
        return name
    return None


def _ctor_words(module: ModuleInfo) -> tuple[str, ...]:
    """Words a statement constructing an RMSNorm module holds: ``RMSNorm``, the names of this
    module's nn.RMSNorm subclasses and the local names of library RMSNorm classes imported under
    another name (``from diffusers... import RMSNorm as DNorm``) (cached per module)."""
    cached = module.__dict__.get("_npufuse_rms_ctor_words")
    if cached is None:
        cached = module.__dict__["_npufuse_rms_ctor_words"] = (
            "RMSNorm", *(c for c in module.classes if rms_subclass(module, c)),
            *(local for local, full in module.aliases.items() if full in LIBRARY_RMS_CLASSES and "RMSNorm" not in local),
            # a module-level alias of the class (``LayerNormImpl = nn.RMSNorm``) constructs it by that name
            *(local for local, full in module.assigned_aliases.items() if full == RMS_NORM_CLASS and "RMSNorm" not in local))
    return cached


def _super_init(stmt: ast.stmt) -> bool:
    """``super().__init__(...)`` as a statement."""
    if not isinstance(stmt, ast.Expr) or not isinstance(stmt.value, ast.Call):
        return False
    f = stmt.value.func
    return isinstance(f, ast.Attribute) and f.attr == "__init__" and isinstance(f.value, ast.Call) \
        and isinstance(f.value.func, ast.Name) and f.value.func.id == "super"


def _in_fused_branch(idx: S.StmtIndex, stmt: ast.stmt) -> bool:
    """Inside the fused branch npufuse wrote (``if _npufuse_on_npu(...) ...:``): the swap's own code."""
    child = stmt
    for anc in S.ancestors(idx, stmt):
        if isinstance(anc, ast.If) and "_npufuse_" in ast.unparse(anc.test) and any(s is child for s in anc.body):
            return True
        child = anc
    return False


def construction_sites(module: ModuleInfo, scope: Scope, idx: S.StmtIndex) -> Iterator[Result]:
    """One finding per statement constructing nn.RMSNorm modules (each construction wrapped in the
    swap), and the ``super().__init__`` of an nn.RMSNorm subclass without its own forward."""
    T = S.torch_name(module) or "torch"
    cls_name = scope.class_name
    subclass_init = scope.qualname.endswith(".__init__") and rms_subclass(module, cls_name)
    words = _ctor_words(module)
    pdefs = _rms_norm_s49m.param_defaults(module, scope, _ctor_call)  # s49: `norm_layer=nn.RMSNorm` parameter defaults
    words = (*words, *pdefs) if pdefs else words
    lines = S.module_lines(module)
    for stmt in idx.stmts:
        if not S.simple_stmt(stmt):
            continue
        # text first: a construction names its class (RMSNorm, or a subclass's name); the
        # subclass's own super().__init__ is looked at only in that class's __init__
        text = "".join(lines[stmt.lineno - 1 : stmt.end_lineno or stmt.lineno])
        if not (subclass_init and "__init__" in text) and not any(w in text for w in words):
            continue
        if _in_fused_branch(idx, stmt):
            continue
        if subclass_init and _super_init(stmt) and idx.parent.get(id(stmt)) is None:
            ctors: list[ast.Call] = []
            classes = [cls_name or ""]
        else:
            ctors = [n for n in S.iter_exprs_topdown(stmt) if isinstance(n, ast.Call) and (_ctor_call(module, n) or _rms_norm_s49m.param_ctor(n, pdefs, stmt)) is not None]
            if not ctors:
                continue
            classes = [_ctor_call(module, c) or _rms_norm_s49m.param_ctor(c, pdefs) or "" for c in ctors]
        done = S.already_fused(module, scope, stmt)
        if done:
            yield _miss(scope, stmt, done)
            continue
        if ctors:
            body = S.splice(module, stmt, [(c, _rms_norm_s49m.wrapped(c, pdefs, _SWAP, T, S.source_of(module, c))  # s49
                                            or f"{_SWAP}({S.source_of(module, c)})") for c in ctors])
        else:
            body = S.stmt_source(module, stmt) + f"\n{_SWAP}(self)"
        params: dict = {"source": "library", "module": ", ".join(dict.fromkeys(classes)), "constructions": max(len(ctors), 1),
                        "eps": "the module's eps (None: torch.finfo(torch.float32).eps)", "weight": "the module's weight",
                        # PyTorch's composite rms_norm where no fused kernel serves the device (the value estimate)
                        "unfused_ops": ["cast", "pow", "mean", "add", "rsqrt", "mul", "cast", "mul"], "upcast": "float32"}
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
        if target is not None and dotted(target):
            params["target"] = dotted(target)
        yield Finding(
            pattern="rms_norm", qualname=scope.qualname, line=stmt.lineno, end_line=stmt.end_lineno or stmt.lineno,
            params=params, fused=_swap_helper(T) + body,
            # nothing is a tensor yet where a module is built: the guard asks only whether
            # torch_npu is loaded (it gives torch.Tensor its is_npu property); the swapped forward
            # checks the device of each input
            guard_tensor=f"{T}.Tensor", confidence="high", variant="nn_rmsnorm",
            risks=[*_RISKS, *_SWAP_RISKS],
            notes=["unfused: PyTorch's RMSNorm (several kernels on NPU); fused: 1",
                   "the module is swapped where it is built: every call of it runs npu_rms_norm on NPU input "
                   "(weight and eps read from the instance; eps=None means torch.finfo(torch.float32).eps, as in "
                   "PyTorch's kernel; no weight: ones of normalized_shape)"],
            training_ok=True,
        )


# --- L2-normalisation RMSNorms: ``F.normalize(x, dim=-1) * sqrt(d) * g`` and
# ``x / (torch.norm(x, dim=-1, keepdim=True) * d ** -0.5).clamp(min=eps) * g`` ------------------
#
# ||x|| = sqrt(d) * rms(x), so with the sqrt(d) the two are x / rms(x) * g: npu_rms_norm with
# gamma = P / (S * sqrt(d)) (P: the factors multiplying the normalised x, S: those scaling the norm
# before the clamp). Where eps goes differs: the original clamps the (scaled) norm from below,
# ``max(||x|| * S, eps)``; npu_rms_norm adds eps' inside the root. eps' = (eps / (S * sqrt(d)))**2
# puts the floor at the same rms, so the two agree except on rows whose norm is near eps (near-zero
# rows), and the finding says so. Without a sqrt(d) factor the code is an L2 normalisation with a
# gain (ScaleNorm): a near miss.

_CLAMP_RISK = Risk("numerics", "eps is a clamp on the norm in the original (x / max(||x|| * s, eps)); the fused op adds "
                               "eps' = (eps / (s * sqrt(d)))**2 inside the root instead: the same floor, identical results "
                               "except on rows whose norm is near eps (near-zero rows), where the two differ slightly")


def _l2_helpers(module: ModuleInfo) -> tuple[str, ...]:
    """Module-level one-line ``F.normalize(t, dim=-1)`` helpers (lucidrains' ``l2norm``), cached:
    a scope calling one is read for the L2 spelling of an RMSNorm."""
    cached = module.__dict__.get("_npufuse_l2_helpers")
    if cached is None:
        names = []
        if "normalize(" in module.source:
            for fn in module.tree.body:
                if isinstance(fn, ast.FunctionDef) and len(fn.body) <= 2 and isinstance(fn.body[-1], ast.Return):
                    probe = ast.Call(ast.Name(fn.name, ast.Load()), [ast.Name("x", ast.Load())], [])
                    if canonical.l2_normalize_of(module, probe) is not None:
                        names.append(fn.name)
        cached = module.__dict__["_npufuse_l2_helpers"] = tuple(names)
    return cached


def _l2_text(text: str) -> bool:
    return "normalize(" in text or ("norm(" in text and "clamp" in text)


def _mul_chain(stmt: ast.stmt, leaf: ast.AST) -> tuple[ast.expr, list[tuple[ast.expr, bool]]] | None:
    """The outermost ``*``/``/`` chain of ``stmt`` holding ``leaf`` as a factor: (chain, factors as
    (node, in the denominator))."""
    for n in S.iter_exprs_topdown(stmt):
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mult, ast.Div)):
            factors: list[tuple[ast.expr, bool]] = []
            _flatten(n, False, factors)
            if any(f is leaf for f, _ in factors):
                return n, factors
    return None


def _flatten(node: ast.expr, inverse: bool, out: list[tuple[ast.expr, bool]]) -> None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        _flatten(node.left, inverse, out)
        _flatten(node.right, inverse, out)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        _flatten(node.left, inverse, out)
        _flatten(node.right, not inverse, out)
    else:
        out.append((node, inverse))


def _pure(module: ModuleInfo, node: ast.AST) -> bool:
    """Evaluating ``node`` twice is harmless and cheap: names, attributes, numbers, arithmetic,
    ``math.sqrt`` and argument-less dtype casts (``self.g.float()``)."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            if canonical.api(module, n.func) in ("math.sqrt", "numpy.sqrt"):
                continue
            if isinstance(n.func, ast.Attribute) and n.func.attr in ("float", "half", "bfloat16") and not n.args and not n.keywords:
                continue
            return False
        if not isinstance(n, (ast.Name, ast.Attribute, ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop,
                              ast.expr_context, ast.Subscript, ast.Slice, ast.Tuple)):
            return False
    return True


def _local_value(scope: Scope, stmt: ast.stmt, node: ast.expr) -> tuple[ast.expr, ast.stmt | None]:
    """A name's value when the statement just before ``stmt`` in its block assigns it (and only
    there in the scope), with that statement; else (node, None)."""
    if not isinstance(node, ast.Name) or len(scope.assignments.get(node.id, [])) != 1:
        return node, None
    d, value = scope.assignments[node.id][0]
    idx = S.stmt_index(scope)
    loc, here = idx.block.get(id(d)), idx.block.get(id(stmt))
    if loc is None or here is None or loc[0] is not here[0] or loc[1] != here[1] - 1 or not isinstance(d, ast.Assign) or len(d.targets) != 1:
        return node, None
    return value, d


def l2_norm_sites(module: ModuleInfo, scope: Scope, idx: S.StmtIndex) -> Iterator[Result]:
    """Findings/near misses for the two L2-normalisation spellings of an RMSNorm in one scope."""
    T = S.torch_name(module) or "torch"
    for call in scope.nodes().get(ast.Call, []):
        S_factors: list[ast.expr] = []
        prev: ast.stmt | None = None
        l2n = canonical.l2_normalize_of(module, call)
        dim_check = None
        if l2n is None:
            l2n, dim_check = _l2_normalize_chosen_dim(module, call)
        if l2n is not None:
            x, eps = l2n.x, l2n.eps
            eps_src = S.source_of(module, eps) if eps is not None else "1e-12"
            stmt = _stmt_of(idx, scope, call)  # type: ignore[arg-type]
            unit: ast.expr = call  # type: ignore[assignment]
            spelling = "F.normalize(x, dim=-1)" if l2n.via_helper is None else f"{l2n.via_helper}(x) (F.normalize(x, dim=-1))"
            if stmt is not None and isinstance(stmt, ast.Assign) and stmt.value is call and len(stmt.targets) == 1 \
                    and isinstance(stmt.targets[0], ast.Name):
                # ``normed = F.normalize(x, dim=-1)`` then ``normed * scale * gamma`` on the next line
                nxt, use = _next_reader(idx, stmt)
                if use is None:
                    continue
                prev, stmt, unit = stmt, nxt, use
        else:
            clamp = canonical.clamp_min_of(module, call)  # type: ignore[arg-type]
            if clamp is None:
                continue
            stmt = _stmt_of(idx, scope, call)  # type: ignore[arg-type]
            if stmt is None:
                continue
            inner, eps_node = clamp
            unit = call  # type: ignore[assignment]
            if isinstance(stmt, ast.Assign) and stmt.value is call and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                # ``n = torch.norm(x, ...).clamp(min=eps)`` then ``x / n * g`` on the next line
                nxt, use = _next_reader(idx, stmt)
                if use is None:
                    continue
                prev, stmt, unit = stmt, nxt, use
                value = inner
            else:
                value, prev = _local_value(scope, stmt, inner)
            nfactors: list[tuple[ast.expr, bool]] = []
            _flatten(value, False, nfactors)
            l2 = [(f, canonical.l2_norm_operand(module, f)) for f, inv in nfactors if not inv]
            l2 = [(f, v) for f, v in l2 if v is not None]
            if len(l2) != 1 or any(inv for _, inv in nfactors):
                continue
            x = l2[0][1]
            S_factors = [f for f, _ in nfactors if f is not l2[0][0]]
            eps_src = S.source_of(module, eps_node)
            spelling = "x / norm(x).clamp(min=eps)"
        if stmt is None or x is None:
            continue
        chain = _mul_chain(stmt, unit)
        if chain is None:
            continue
        node, factors = chain
        if spelling.startswith("x /"):
            # the clamp divides; x itself must be a numerator factor
            if not any(f is unit and inv for f, inv in factors):
                continue
            xs = [f for f, inv in factors if not inv and canonical.same(f, x)]
            if not xs:
                continue
            rest = [(f, inv) for f, inv in factors if f is not unit and f is not xs[0]]
        else:
            if any(f is unit and inv for f, inv in factors):
                continue
            rest = [(f, inv) for f, inv in factors if f is not unit]
        if not rest:
            continue  # a bare unit vector: not a norm with a gain
        init = S.init_assignments(module, scope.class_name)
        powers = [canonical.root_power(module, f, init.get) for f, _ in rest] + [canonical.root_power(module, f, init.get) for f in S_factors]
        signed = [pw if not inv else -pw for (f, inv), pw in zip(rest, powers) if pw is not None] + \
                 [-pw for f, pw in zip(S_factors, powers[len(rest):]) if pw is not None]
        if 0.5 not in signed and not any(_norm_s44h.gain_initialised_to_root(module, f, init.get) for f, inv in rest if not inv):
            yield _miss(scope, stmt, f"{spelling} times a gain without a sqrt(d) factor: an L2 normalisation (ScaleNorm), "
                                     "not an RMSNorm (npu_rms_norm divides by the root of the mean, ||x|| / sqrt(d))")
            continue
        cast_base = _cast_of_name(x) if dotted(x) is None else None  # ``F.normalize(x.float(), dim=-1)``
        if dotted(x) is None and cast_base is None:
            yield _miss(scope, stmt, f"{spelling}: the normalised input is an expression; bind it to a name first")
            continue
        if not all(_pure(module, f) for f, _ in rest) or not all(_pure(module, f) for f in S_factors):
            yield _miss(scope, stmt, f"{spelling}: a factor besides the norm is computed by a call (the replacement "
                                     "evaluates the factors again on its fallback path: it would run twice)")
            continue
        done = S.already_fused(module, scope, stmt)
        if done:
            yield _miss(scope, stmt, done)
            continue
        xs_ = S.source_of(module, x)
        x_param, guard_x = xs_, xs_
        if cast_base is not None:  # the cast is evaluated once, into _npu_x, inside the fused branch
            xs_, guard_x = "_npu_x", S.source_of(module, cast_base)
        num = " * ".join(f"({S.source_of(module, f)})" for f, inv in rest if not inv) or "1.0"
        den = [f"({S.source_of(module, f)})" for f, inv in rest if inv]
        P = num if not den else f"{num} / ({' * '.join(den)})"
        scale = " * ".join([f"({S.source_of(module, f)})" for f in S_factors] + [f"{xs_}.shape[-1] ** 0.5"])
        fused_expr = (f"torch_npu.npu_rms_norm({xs_}, _npu_g.to({xs_}.dtype), epsilon=float(({eps_src}) / ({scale})) ** 2)[0]"
                      f".to({T}.result_type({xs_}, _npu_p))")
        new_stmt = S.splice(module, stmt, [(node, fused_expr)])
        after_expr = (f"(torch_npu.npu_rms_norm({xs_}, {xs_}.new_ones({xs_}.shape[-1]), epsilon=float(({eps_src}) / ({scale})) ** 2)[0]"
                      f" * _npu_g).to({T}.result_type({xs_}, _npu_p))")
        first = prev if prev is not None and not scope.uses_after(prev.targets[0].id, stmt.end_lineno or stmt.lineno) else None  # type: ignore[attr-defined]
        fused = "\n".join([
            *([f"_npu_x = {x_param}"] if cast_base is not None else []),
            f"_npu_p = {P}",
            "# gamma = P / (s * sqrt(d)): the gain over the rms (||x|| = sqrt(d) * rms(x))",
            f"_npu_g = {xs_}.new_ones({xs_}.shape[-1], dtype={T}.float32) * _npu_p / ({scale})",
            "if _npu_g.dim() == 1:",
            S.indent(new_stmt),
            "else:  # a gain that is not one value per feature (per head, per sample): multiplied after the norm",
            S.indent(S.splice(module, stmt, [(node, after_expr)])),
        ])
        start = first if first is not None else stmt
        params = {"eps": eps_src, "eps_rule": "clamp on the norm", "weight": P, "norm_scale": scale, "x": x_param, "source": "l2_normalize"}
        if dim_check is not None:
            # the dim is chosen at run time (``dim = 1 if self.channel_first else -1``): the fused code where
            # the choice is the last dim, the statements as written otherwise
            original = S.block_source(module, [first, stmt] if first is not None else [stmt])
            fused = "\n".join([f"if {dim_check}:", S.indent(fused), "else:", S.indent(original)])
            params["condition"] = dim_check
        yield Finding(
            pattern="rms_norm", qualname=scope.qualname, line=start.lineno, end_line=stmt.end_lineno or stmt.lineno,
            params=params,
            fused=fused, guard_tensor=guard_x, confidence="medium", variant="l2_normalize" if l2n is not None else "l2_norm_clamp",
            risks=[*_RISKS, _CLAMP_RISK],
            notes=[f"{spelling} with a sqrt(d) factor is x / rms(x): replaced by npu_rms_norm with the gain folded into gamma",
                   "eps: a clamp on the norm in the original, inside the root in the fused op (see the risk)"],
            training_ok=True,
        )


def _l2_normalize_chosen_dim(module: ModuleInfo, call: ast.AST) -> tuple["canonical.L2Normalize | None", str | None]:
    """``F.normalize(x, dim=(1 if self.channel_first else -1))`` (magvit2's RMSNorm, s39): read as the
    last-dim normalisation under the run-time check that selects ``-1``; (None, None) where the dim is
    not such a choice or its test is not a plain read (a call would run twice)."""
    if not isinstance(call, ast.Call) or not any(k.arg == "dim" and isinstance(k.value, ast.IfExp) for k in call.keywords) \
            and not (len(call.args) > 2 and isinstance(call.args[2], ast.IfExp)):
        return None, None
    choice = next((k.value for k in call.keywords if k.arg == "dim"), None) or call.args[2]
    assert isinstance(choice, ast.IfExp)
    if not _pure(module, choice.test) or canonical.is_last_dim(choice.body) == canonical.is_last_dim(choice.orelse):
        return None, None
    last = choice.body if canonical.is_last_dim(choice.body) else choice.orelse
    probe = ast.Call(call.func, [last if a is choice else a for a in call.args],
                     [ast.keyword(k.arg, last) if k.value is choice else k for k in call.keywords])
    l2n = canonical.l2_normalize_of(module, probe)
    if l2n is None:
        return None, None
    test = S.source_of(module, choice.test)
    return l2n, (f"({test})" if last is choice.body else f"not ({test})")


# --- Hugging Face RMSNorm classes imported into a model (issue 14) --------------------------------
#
# ``from transformers.models.llama.modeling_llama import LlamaRMSNorm as RMSNorm`` then
# ``self.norm = RMSNorm(c, eps)`` and ``x = self.norm(x.permute(0, 2, 3, 1))`` (Janus). The class's
# code is not in the repository: its forward is transformers' (fp32 statistics, ``weight *
# x.to(input_dtype)``, eps in ``variance_epsilon``), the same in every release these classes exist
# in. The call is rewritten where it is made, under a run-time check that the attribute holds
# exactly that class (anything else, a subclass included, runs the original call).

_HF_LLAMA_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm",
                   # s40: the Qwen VL families' text norms, LlamaRMSNorm's code under another name (transformers 5.25)
                   "Qwen2VLRMSNorm", "Qwen2_5_VLRMSNorm", "Qwen3VLTextRMSNorm", "Qwen3VLMoeTextRMSNorm"}


def _hf_norm_attributes(module: ModuleInfo, class_name: str | None) -> dict[str, str]:
    """``attr -> local class name`` for ``self.<attr> = <HF Llama-style RMSNorm>(...)`` assigned once,
    unconditionally, at the top of ``__init__`` (a norm chosen by a flag is another module at times)."""
    init = S.method(module, class_name, "__init__")
    if init is None:
        return {}
    cache = module.__dict__.setdefault("_npufuse_hf_norms", {})
    if class_name in cache:
        return cache[class_name]
    counts: dict[str, int] = {}
    found: dict[str, str] = {}
    for st in S._stmts_in(init.body):
        targets = st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(st, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            d = dotted(t)
            if d and d.startswith("self.") and d.count(".") == 1:
                counts[d[5:]] = counts.get(d[5:], 0) + 1
    for st in init.body:  # top level only: not under if/for/try
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Name):
            d = dotted(st.targets[0])
            full = module.aliases.get(st.value.func.id, "")
            if d and d.startswith("self.") and d.count(".") == 1 and full.startswith("transformers.") \
                    and full.rsplit(".", 1)[-1] in _HF_LLAMA_NORMS:
                found[d[5:]] = st.value.func.id
    out = {a: c for a, c in found.items() if counts.get(a) == 1}
    cache[class_name] = out
    return out


def hf_norm_calls(module: ModuleInfo, scope: Scope, idx: S.StmtIndex, attrs: dict[str, str]) -> Iterator[Result]:
    """Findings for ``self.<attr>(x)`` calls of an imported HF Llama-style RMSNorm."""
    T = S.torch_name(module) or "torch"
    claimed = _claimed_by_add_rms_norm(module, scope)
    for call in scope.nodes().get(ast.Call, []):
        f = call.func
        if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" and f.attr in attrs):
            continue
        if id(call) in claimed:
            continue
        stmt = _stmt_of(idx, scope, call)
        if stmt is None:
            continue
        mod, cls = f"self.{f.attr}", attrs[f.attr]
        done = S.already_fused(module, scope, stmt)
        if done:
            yield _miss(scope, stmt, done)
            continue
        if len(call.args) != 1 or call.keywords or isinstance(call.args[0], ast.Starred):
            yield _miss(scope, stmt, f"{mod} ({cls}) is called with other than one input")
            continue
        x = call.args[0]
        whole = getattr(stmt, "value", None) is call
        if not _atom(x) and not whole:
            # binding the input first would move its evaluation before the rest of the statement:
            # it is bound where it stands instead (``(_npu_x := <input>)``, the call's first argument)
            inline = _inline_bound_norm(module, stmt, call, mod, T)
            if inline is None:
                yield _miss(scope, stmt, f"{mod} ({cls}) of an inline expression inside a larger statement: bind the input to a name first")
                continue
            guard = next((n.id for n in ast.walk(x) if isinstance(n, ast.Name) and n.id not in ("self", T)), None)
            if guard is not None:
                yield _hf_inline_finding(module, scope, stmt, call, mod, cls, inline, guard)
                continue
        guard = next((n.id for n in ast.walk(x) if isinstance(n, ast.Name) and n.id not in ("self", T)), None)
        if guard is None:
            yield _miss(scope, stmt, f"{mod} ({cls}): no tensor named in its input to check the device of before the call")
            continue
        pre = [] if _atom(x) else [f"_npu_x = {S.source_of(module, x)}"]
        xs = S.source_of(module, x) if _atom(x) else "_npu_x"
        w = f"{mod}.weight"
        expr = (f"torch_npu.npu_rms_norm({xs}, _npu_gamma, epsilon={mod}.variance_epsilon)[0]"
                f".to({T}.promote_types({xs}.dtype, {w}.dtype))")
        body = "\n".join([
            *pre,
            "# npu_rms_norm takes gamma in the input's dtype, or float32 with an fp16/bf16 input",
            f"_npu_gamma = {w} if {w}.dtype in ({xs}.dtype, {T}.float32) else {w}.to({xs}.dtype)",
            S.splice(module, stmt, [(call, expr)]),
        ])
        fused = f"if type({mod}) is {cls}:\n{S.indent(body)}\nelse:\n{S.indent(S.stmt_source(module, stmt))}"
        yield Finding(
            pattern="rms_norm", qualname=scope.qualname, line=stmt.lineno, end_line=stmt.end_lineno or stmt.lineno,
            params={"eps": f"{mod}.variance_epsilon", "weight": w, "source": "transformers", "module": mod, "norm_class": cls,
                    "x": S.source_of(module, x), "output_dtype": "promote(input, weight)"},
            fused=fused, guard_tensor=guard, confidence="medium", variant="hf_norm_module",
            risks=[*_RISKS,
                   Risk("numerics", f"{cls} is transformers' code, not this repository's: its forward is read as transformers' "
                                    "(x.float() * rsqrt(mean(x^2) + variance_epsilon), then weight * x.to(input_dtype)); "
                                    "npu_rms_norm applies the weight in fp32 and rounds once (≤1-ulp differences)")],
            notes=["unfused: transformers' RMSNorm (about 8 kernels); fused: 1",
                   f"fused only while {mod} is exactly {cls} (checked at run time)"],
            training_ok=True,
        )


# --- transformers' Llama-style RMSNorm modules built in this repo, called by code outside it -------
#
# ``class MoEDecoderLayer(LlamaDecoderLayer)`` whose ``__init__`` builds ``self.input_layernorm =
# LlamaRMSNorm(...)``: the calls are in transformers' inherited forward, not in the repository, so
# :func:`hf_norm_calls` has no call to rewrite. The module is swapped where it is built instead (as
# nn.RMSNorm modules are): the instance keeps its class, ``weight`` and ``variance_epsilon`` (state
# dict unchanged) and gets a forward running npu_rms_norm on NPU input while its type is exactly the
# imported class. Which classes are Llama-style is a fact about transformers (``_HF_LLAMA_NORMS``:
# fp32 statistics, ``weight * x.to(input_dtype)``), as for the call sites. Where the class itself
# calls the attribute, the call site is the finding (:func:`hf_norm_calls`) and nothing is added here.

_HF_SWAP = "_npufuse_hf_rms_norm_swap"


def _hf_swap_helper(T: str) -> str:
    """The local function swapping a transformers Llama-style RMSNorm's forward on one instance."""
    return "\n".join([
        f"def {_HF_SWAP}(norm):",
        "    # transformers' Llama-style RMSNorm through torch_npu.npu_rms_norm for NPU input; weight,",
        "    # variance_epsilon and the state_dict keys stay those of the instance",
        "    cls = type(norm)",
        "    def forward(self, hidden_states):",
        "        if _npufuse_on_npu(hidden_states) and type(self) is cls and 2 <= hidden_states.dim() <= 8:",
        "            w = self.weight",
        "            # npu_rms_norm takes gamma in the input's dtype, or float32 with an fp16/bf16 input",
        f"            gamma = w if w.dtype in (hidden_states.dtype, {T}.float32) else w.to(hidden_states.dtype)",
        "            out = torch_npu.npu_rms_norm(hidden_states, gamma, epsilon=self.variance_epsilon)[0]",
        f"            return out.to({T}.promote_types(hidden_states.dtype, w.dtype))",
        "        return cls.forward(self, hidden_states)",
        "",
        "    norm.forward = forward.__get__(norm)",
        "    return norm",
        "",
    ])


def _hf_norm_class(module: ModuleInfo, call: ast.Call) -> str | None:
    """The local name of the class ``call`` constructs when it is a transformers Llama-style RMSNorm."""
    if not isinstance(call.func, ast.Name):
        return None
    full = module.aliases.get(call.func.id, "")
    if full.startswith("transformers.") and full.rsplit(".", 1)[-1] in _HF_LLAMA_NORMS:
        return call.func.id
    return None


def _class_calls_attr(module: ModuleInfo, class_name: str | None, attr: str) -> bool:
    """Some method of the class (as written in this file) calls ``self.<attr>(...)``."""
    if module.classes.get(class_name or "") is None:
        return True  # unknown class: leave it to the call-site finding
    return f"self.{attr}(" in _class_text(module, class_name)


def _class_text(module: ModuleInfo, class_name: str | None) -> str:
    node = module.classes.get(class_name or "")
    if node is None:
        return ""
    return "".join(S.module_lines(module)[node.lineno - 1 : node.end_lineno or node.lineno])


def _own_forward_line(module: ModuleInfo, class_name: str | None) -> int | None:
    """The line of a ``def forward`` written in the class body that does not hand over to the inherited
    forward (``super().forward(...)``); None where forward is inherited or aliased (``forward =
    Qwen2DecoderLayer.forward``: installed code calls the module)."""
    node = module.classes.get(class_name or "")
    if node is None:
        return None
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "forward":
            text = "".join(S.module_lines(module)[item.lineno - 1 : item.end_lineno or item.lineno])
            return None if ".forward(" in text else item.lineno
    return None


def hf_construction_sites(module: ModuleInfo, scope: Scope, idx: S.StmtIndex) -> Iterator[Result]:
    """One finding per statement building a transformers Llama-style RMSNorm into ``self.<attr>``
    that this class never calls itself (the inherited, installed code does)."""
    if not scope.class_name or "RMSNorm" not in S.scope_text(module, scope):
        return
    T = S.torch_name(module) or "torch"
    lines = S.module_lines(module)
    for stmt in idx.stmts:
        if not S.simple_stmt(stmt) or not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            continue
        if "RMSNorm" not in "".join(lines[stmt.lineno - 1 : stmt.end_lineno or stmt.lineno]):
            continue
        if not isinstance(stmt.value, ast.Call) or _in_fused_branch(idx, stmt):
            continue
        cls = _hf_norm_class(module, stmt.value)
        target = dotted(stmt.targets[0])
        if cls is None or not target or not target.startswith("self.") or target.count(".") != 1:
            continue
        if _class_calls_attr(module, scope.class_name, target[5:]):
            continue
        own_forward = _own_forward_line(module, scope.class_name)
        if own_forward is not None:
            # ``class CoatLlamaDecoderLayer(nn.Module)`` with its own forward that hands only
            # ``self.input_layernorm.weight`` to an FP8 kernel: no inherited forward calls the module,
            # so a swapped forward would never run
            yield _miss(scope, stmt, f"{target} is never called: {scope.class_name} defines its own forward (line "
                                     f"{own_forward}), which does not call it or the inherited forward"
                                     + (f" (it reads only {target}.weight)" if f"{target}.weight" in _class_text(module, scope.class_name) else ""))
            continue
        done = S.already_fused(module, scope, stmt)
        if done:
            yield _miss(scope, stmt, done)
            continue
        body = S.splice(module, stmt, [(stmt.value, f"{_HF_SWAP}({S.source_of(module, stmt.value)})")])
        yield Finding(
            pattern="rms_norm", qualname=scope.qualname, line=stmt.lineno, end_line=stmt.end_lineno or stmt.lineno,
            params={"source": "transformers", "module": cls, "norm_class": cls, "target": target, "constructions": 1,
                    "eps": f"{target}.variance_epsilon", "weight": f"{target}.weight", "output_dtype": "promote(input, weight)",
                    "unfused_ops": ["cast", "pow", "mean", "add", "rsqrt", "mul", "cast", "mul"], "upcast": "float32"},
            fused=_hf_swap_helper(T) + body,
            # nothing is a tensor yet where a module is built (see construction_sites)
            guard_tensor=f"{T}.Tensor", confidence="medium", variant="hf_norm_construction",
            risks=[*_RISKS, *_SWAP_RISKS,
                   Risk("numerics", f"{cls} is transformers' code, not this repository's: its forward is read as transformers' "
                                    "(x.float() * rsqrt(mean(x^2) + variance_epsilon), then weight * x.to(input_dtype)); "
                                    "npu_rms_norm applies the weight in fp32 and rounds once (≤1-ulp differences)")],
            notes=["unfused: transformers' RMSNorm (about 8 kernels); fused: 1",
                   f"{target} is called by inherited code outside this repository: the module is swapped where it is "
                   f"built, and its forward runs npu_rms_norm while its type is exactly {cls} (checked at run time)"],
            training_ok=True,
        )


# --- eps added to the scaled 2-norm: ``x / (x.norm(2, dim=-1, keepdim=True) * d ** -0.5 + eps) * g`` --
#
# stripedhyena's RMSNorm: the rms is ||x|| * s (s = d ** -0.5) and eps is added to it, not under the
# root. As for the clamp spelling above, ||x|| * s = s * sqrt(D) * rms(x), so the replacement is
# npu_rms_norm with gamma = P / (s * sqrt(D)) (D read from x at run time) and eps' = (eps / (s *
# sqrt(D)))**2, which gives the same value where the norm is zero. Elsewhere the two differ by the
# factor (r + e) / sqrt(r**2 + e**2) (r the scaled norm, e = eps): about 1 + eps / r on rows whose
# norm is far above eps, up to sqrt(2) where the norm is near eps: a stated numerics risk.

_EPS_ADDED_RISK = Risk("numerics", "eps is added to the (scaled) norm in the original (x / (||x|| * s + eps)); the fused op adds "
                                   "eps' = (eps / (s * sqrt(d)))**2 inside the root: equal on zero rows, relative difference about "
                                   "eps / (||x|| * s) on rows whose norm is far above eps (negligible for eps ~1e-6 and unit-scale "
                                   "activations), up to 1.41x on rows whose scaled norm is close to eps")


def _number(node: ast.AST | None) -> float | None:
    """The value of a constant arithmetic expression (``-1.0 / 2``), else None."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _number(node.operand)
        return None if v is None else (-v if isinstance(node.op, ast.USub) else v)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _number(node.left), _number(node.right)
        if a is None or b is None or (isinstance(node.op, ast.Div) and b == 0):
            return None
        return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}.get(type(node.op), a / b if b else 0.0)
    return None


def _root_power_any(module: ModuleInfo, node: ast.expr, init: dict) -> float | None:
    """root_power, also with the exponent spelled as arithmetic (``d ** (-1.0 / 2)``)."""
    p = canonical.root_power(module, node, init.get)
    if p is None and isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and _number(node.right) in (0.5, -0.5):
        p = _number(node.right)
    return p


def _eps_added_norm(module: ModuleInfo, den: ast.expr) -> tuple[ast.expr, list[tuple[ast.expr, bool]], ast.expr] | None:
    """(x, scale factors s as (factor, divided), eps) of ``||x|| * s + eps`` (either order of the sum)
    with eps a number or a plain attribute/name, and the norm a factor of the product (not divided)."""
    if not (isinstance(den, ast.BinOp) and isinstance(den.op, ast.Add)):
        return None
    for prod, eps in ((den.left, den.right), (den.right, den.left)):
        if not (_number(eps) is not None or dotted(eps) is not None):
            continue
        factors: list[tuple[ast.expr, bool]] = []
        _flatten(prod, False, factors)
        norms = [(f, canonical.l2_norm_operand(module, f)) for f, inv in factors if not inv]
        norms = [(f, v) for f, v in norms if v is not None]
        if len(norms) != 1:
            continue
        return norms[0][1], [(f, inv) for f, inv in factors if f is not norms[0][0]], eps
    return None


def eps_added_norm_sites(module: ModuleInfo, scope: Scope, idx: S.StmtIndex) -> Iterator[Result]:
    """Findings/near misses for ``x / (||x|| * s + eps)`` times a gain (the gain on the same statement
    or on the next one reading the quotient)."""
    T = S.torch_name(module) or "torch"
    init = S.init_assignments(module, scope.class_name)
    for div in scope.nodes().get(ast.BinOp, []):
        if not isinstance(div.op, ast.Div):
            continue
        found = _eps_added_norm(module, div.right)
        lead: ast.stmt | None = None
        if found is None:
            found, lead = _s28_eps_added_named_norm(module, scope, div)
        if found is None:
            continue
        x, s_factors, eps = found
        if dotted(x) is None:
            continue
        stmt = _stmt_of(idx, scope, div)  # type: ignore[arg-type]
        if stmt is None:
            continue
        prev: ast.stmt | None = None
        unit: ast.expr = div
        if not canonical.same(div.left, x):
            # ``g * x / (...)``: the denominator is a divided factor of the chain, x a multiplied one
            chain = _mul_chain(stmt, div.right)
            if chain is None or not any(f is div.right and inv for f, inv in chain[1]):
                continue
            xs = [f for f, inv in chain[1] if not inv and canonical.same(f, x)]
            if len(xs) != 1:
                continue
            rest = [(f, inv) for f, inv in chain[1] if f is not div.right and f is not xs[0]]
            yield from _eps_added_finding(module, scope, T, init, stmt, None, chain[0], rest, x, s_factors, eps)
            continue
        if isinstance(stmt, ast.Assign) and stmt.value is div and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            # ``y = x / (...)`` then ``g * y`` on the next statement
            nxt, use = _next_reader(idx, stmt)
            if use is None or (s_factors and _mul_chain(nxt, use) is None):  # type: ignore[arg-type]
                if s_factors and use is not None:
                    # weightless ``y = x / (||x|| * s + eps)`` (s28): the quotient itself is the norm
                    yield from _eps_added_finding(module, scope, T, init, stmt, None, div, [], x, s_factors, eps,
                                                  lead=_s28_lead(idx, scope, lead, stmt, stmt, div))
                continue
            prev, stmt, unit = stmt, nxt, use
        chain = _mul_chain(stmt, unit)
        if chain is None:
            continue
        node, factors = chain
        if any(f is unit and inv for f, inv in factors):
            continue
        rest = [(f, inv) for f, inv in factors if f is not unit]
        yield from _eps_added_finding(module, scope, T, init, stmt, prev, node, rest, x, s_factors, eps,
                                      lead=_s28_lead(idx, scope, lead, prev or stmt, stmt, node))


def _eps_added_finding(module: ModuleInfo, scope: Scope, T: str, init: dict, stmt: ast.stmt, prev: ast.stmt | None, node: ast.expr,
                       rest: list[tuple[ast.expr, bool]], x: ast.expr, s_factors: list[tuple[ast.expr, bool]], eps: ast.expr,
                       lead: ast.stmt | None = None) -> Iterator[Result]:
    """The finding (or near miss) for ``node``, the product ``x / (||x|| * s + eps)`` times the ``rest`` factors
    (none: a weightless norm, when ``s`` scales the norm to the rms); ``lead`` is a statement binding the norm
    that the span takes in (s28)."""
    for _once in (0,):
        if not rest and not s_factors:
            continue  # a bare unit vector: no gain
        spelling = "x / (norm(x) * s + eps)"
        powers = [(_s28_root_power(module, f, init), inv) for f, inv in rest] + [(_s28_root_power(module, f, init), not inv) for f, inv in s_factors]
        if 0.5 not in [(-p if inv else p) for p, inv in powers if p is not None]:
            yield _miss(scope, stmt, f"{spelling} times a gain without a sqrt(d) factor: an L2 normalisation (ScaleNorm), "
                                     "not an RMSNorm (npu_rms_norm divides by the root of the mean, ||x|| / sqrt(d))")
            continue
        if not all(_pure(module, f) for f, _ in rest) or not all(_pure(module, f) for f, _ in s_factors):
            yield _miss(scope, stmt, f"{spelling}: a factor besides the norm is computed by a call (the replacement "
                                     "evaluates the factors again on its fallback path: it would run twice)")
            continue
        done = S.already_fused(module, scope, stmt)
        if done:
            yield _miss(scope, stmt, done)
            continue
        xs_ = S.source_of(module, x)
        eps_src = S.source_of(module, eps)
        num = " * ".join(f"({S.source_of(module, f)})" for f, inv in rest if not inv) or "1.0"
        den = [f"({S.source_of(module, f)})" for f, inv in rest if inv]
        P = num if not den else f"{num} / ({' * '.join(den)})"
        scale = " * ".join([f"({S.source_of(module, f)})" if not inv else f"(1.0 / ({S.source_of(module, f)}))" for f, inv in s_factors]
                           + [f"{xs_}.shape[-1] ** 0.5"])
        eps_arg = f"float(({eps_src}) / ({scale})) ** 2"
        fused_expr = f"torch_npu.npu_rms_norm({xs_}, _npu_g.to({xs_}.dtype), epsilon={eps_arg})[0].to({T}.result_type({xs_}, _npu_p))"
        after_expr = (f"(torch_npu.npu_rms_norm({xs_}, {xs_}.new_ones({xs_}.shape[-1]), epsilon={eps_arg})[0]"
                      f" * _npu_g).to({T}.result_type({xs_}, _npu_p))")
        first = prev if prev is not None and not scope.uses_after(prev.targets[0].id, stmt.end_lineno or stmt.lineno) else None  # type: ignore[attr-defined]
        if lead is not None and (first is not None or prev is None):
            first = lead  # the statement binding the norm, read only here (s28)
        fused = "\n".join([
            f"_npu_p = {P}",
            "# gamma = P / (s * sqrt(d)): the gain over the rms (||x|| = sqrt(d) * rms(x))",
            f"_npu_g = {xs_}.new_ones({xs_}.shape[-1], dtype={T}.float32) * _npu_p / ({scale})",
            "if _npu_g.dim() == 1:",
            S.indent(S.splice(module, stmt, [(node, fused_expr)])),
            "else:  # a gain that is not one value per feature (per head, per sample): multiplied after the norm",
            S.indent(S.splice(module, stmt, [(node, after_expr)])),
        ])
        start = first if first is not None else stmt
        yield Finding(
            pattern="rms_norm", qualname=scope.qualname, line=start.lineno, end_line=stmt.end_lineno or stmt.lineno,
            params={"eps": eps_src, "eps_rule": "added to the scaled norm", "weight": P, "norm_scale": scale, "x": xs_, "source": "l2_norm"},
            fused=fused, guard_tensor=xs_, confidence="medium", variant="l2_norm_eps_added",
            risks=[*_RISKS, _EPS_ADDED_RISK],
            notes=[f"{spelling} with s = 1/sqrt(d) is x / (rms(x) + eps): replaced by npu_rms_norm with the gain folded into gamma",
                   "eps: added to the rms in the original, inside the root in the fused op (see the risk)"],
            training_ok=True,
        )


# --- norms (s25): RMSNorm modules of other libraries, swapped where they are built --------------
#
# ``from apex.normalization import MixedFusedRMSNorm as RMSNorm`` (Megatron forks, Lumina),
# ``from xformers.ops import RMSNorm`` (BitNet), directly or through a package of the repository
# that re-exports them (:func:`repo_facts.external_origin`). Their forward is nn.RMSNorm's math
# (mean of squares over the trailing ``normalized_shape`` dims, eps inside the root, weight or none),
# but on an NPU tensor apex runs its unfused Python reference (its fused path needs ``is_cuda``)
# and xformers' triton kernel does not run at all. As for nn.RMSNorm, the instance is swapped where
# it is built (weight, eps and state_dict keys stay the library's) and its forward runs npu_rms_norm
# on NPU input. The swap also checks at run time that the instance's class comes from that library
# (a ``try: from apex ... except ImportError: RMSNorm = MyRMSNorm`` fallback keeps its own forward).
# TransformerEngine's RMSNorm is not swapped: a near miss says why.

LIBRARY_RMS_CLASSES = {
    "apex.normalization.FusedRMSNorm": "apex",
    "apex.normalization.MixedFusedRMSNorm": "apex",
    "apex.normalization.fused_layer_norm.FusedRMSNorm": "apex",
    "apex.normalization.fused_layer_norm.MixedFusedRMSNorm": "apex",
    "xformers.ops.RMSNorm": "xformers",
    "xformers.ops.rmsnorm.RMSNorm": "xformers",
    # s37: diffusers' RMSNorm (re-exported by its attention modules); before diffusers 0.33 it has no NPU
    # path: x * rsqrt(fp32 mean(x^2) + eps), then cast to a half weight's dtype and times the weight
    # (float32 out with a float32 weight; the input's dtype without a weight); a bias (0.30+, optional)
    # or a multi-dim ``dim`` keeps its forward. From 0.33 its own NPU branch calls npu_rms_norm.
    "diffusers.models.normalization.RMSNorm": "diffusers",
    "diffusers.models.attention_processor.RMSNorm": "diffusers",
    "diffusers.models.attention.RMSNorm": "diffusers",
}
TE_RMS_CLASSES = ("transformer_engine.pytorch.RMSNorm", "transformer_engine.pytorch.module.rmsnorm.RMSNorm",
                  "transformer_engine.pytorch.module.RMSNorm")
_TE_REASON = ("TransformerEngine's RMSNorm (a CUDA library module; with zero_centered_gamma=True it scales by 1 + weight): "
              "not swapped: TransformerEngine runs on Ascend only as Ascend's own TransformerEngineNPU port; build nn.RMSNorm "
              "here (weight + 1 for zero_centered_gamma) to get npu_rms_norm")

_LIB_SWAP = "_npufuse_library_rms_norm_swap"
_LIB_WHY = {"apex": "apex runs its Python reference, about 8 kernels, on non-CUDA input",
            "xformers": "xformers' triton kernel runs on CUDA only",
            "diffusers": "diffusers' RMSNorm before 0.33 runs about 8 unfused kernels (0.33 and later call npu_rms_norm "
                         "themselves on NPU: the swap then changes nothing)"}

_LIB_RISKS = [
    Risk("numerics", "the library's forward is replaced by npu_rms_norm with statistics in fp32. The output dtype is "
                     "that of what runs on NPU without the swap: apex's Python reference (manual_rms_norm) returns "
                     "float32 for fp16/bf16 input unless the weight is fp16/bf16 (then the weight's dtype), so the fused "
                     "call runs on the float32 input there; xformers returns the input's dtype. On CUDA apex's "
                     "Mixed* classes return the weight's dtype and FusedRMSNorm the input's (A2/A3). diffusers returns "
                     "the weight's dtype (the input's without a weight); where a half weight meets a float32 input "
                     "diffusers rounds the normalised value to the weight's dtype before the multiply, the fused call "
                     "multiplies in float32 and rounds once"),
]


def _lib_swap_helper(T: str) -> str:
    """The local function swapping one library RMSNorm instance's forward (``origin``: the library's
    top-level package, checked against the instance's class at run time)."""
    return "\n".join([
        f"def {_LIB_SWAP}(norm, origin):",
        "    # the library RMSNorm's forward through torch_npu.npu_rms_norm for NPU input; weight, eps and",
        "    # the state_dict keys stay those of the instance",
        "    cls = type(norm)",
        "    if cls.__module__.split('.')[0] != origin:",
        "        return norm  # another class bound to the name (an import fallback): left as it is",
        "    half = ({T}.float16, {T}.bfloat16)".format(T=T),
        "    def forward(self, x):",
        f"        if _npufuse_on_npu(x) and type(self) is cls and 2 <= x.dim() <= 8 and x.dtype in (*half, {T}.float32):",
        "            w = getattr(self, 'weight', None)",
        "            out_dtype = x.dtype",
        "            if origin == 'apex':",
        "                # apex off CUDA runs manual_rms_norm: x * rsqrt(fp32 variance) is float32 for half x, cast",
        "                # to the weight's dtype only when that is half; so float32 out unless the weight is half",
        f"                out_dtype = w.dtype if w is not None and w.dtype in half else {T}.float32",
        "            if origin == 'diffusers':",
        "                # diffusers: a bias, or a weight over several trailing dims (its mean is over the last one",
        "                # only): its own forward; otherwise the weight's dtype out (the input's without a weight)",
        "                if getattr(self, 'bias', None) is not None or len(getattr(self, 'dim', x.shape[-1:])) != 1:",
        "                    return cls.forward(self, x)",
        "                out_dtype = w.dtype if w is not None else x.dtype",
        f"            gamma = w if w is not None else {T}.ones(getattr(self, 'normalized_shape', x.shape[-1:]), dtype=x.dtype, device=x.device)",
        "            # npu_rms_norm takes gamma in the input's dtype, or float32 with an fp16/bf16 input",
        f"            if gamma.dtype not in (x.dtype, {T}.float32):",
        "                gamma = gamma.to(x.dtype)",
        f"            xin = x.float() if out_dtype == {T}.float32 and x.dtype in half else x",
        "            if xin.dtype != x.dtype and gamma.dtype != xin.dtype:",
        "                gamma = gamma.float()",
        "            return torch_npu.npu_rms_norm(xin, gamma, epsilon=self.eps)[0].to(out_dtype)",
        "        return cls.forward(self, x)",
        "",
        "    norm.forward = forward.__get__(norm)",
        "    return norm",
        "",
    ])


def library_class(module: ModuleInfo, func: ast.expr) -> str | None:
    """The canonical name of the library RMSNorm class (or TransformerEngine's) a constructor
    call's callee stands for, in this file or through a re-export of the repository."""
    name = canonical.api(module, func)
    if not name or "." not in name:
        return None
    if name in LIBRARY_RMS_CLASSES or name in TE_RMS_CLASSES:
        return name
    if not name.rsplit(".", 1)[-1].lower().endswith("norm") or name.startswith("torch."):
        return None  # only norm-named classes are followed into other files
    from npufuse.scan import repo_facts

    origin = repo_facts.external_origin(module, name)
    if origin in LIBRARY_RMS_CLASSES or origin in TE_RMS_CLASSES:
        return origin
    return None


def library_construction_sites(module: ModuleInfo, scope: Scope, idx: S.StmtIndex) -> Iterator[Result]:
    """One finding per statement constructing apex / xformers RMSNorm modules (each wrapped in the
    swap); a near miss for TransformerEngine's."""
    yield from swap_construction_sites(_LIBRARY_SWAP, module, scope, idx)
    yield from swap_construction_sites(_IMPORT_TIME_SWAP, module, scope, idx)
    yield from third_party_construction_sites(module, scope, idx)  # torchtune's; near misses for unread libraries


@dataclass(frozen=True)
class SwapKind:
    """How one kind of library RMSNorm construction is found and swapped: the callee text test
    (cheap, before any resolution), the resolver to a class name, a refusal for classes that must
    not be swapped, the swap call around a construction, the swap helper's source, and what the
    finding says (unfused kernels, upcast, risks, notes)."""

    callee_may_be: Callable[[str], bool]
    resolve: Callable[[ModuleInfo, ast.expr], "str | None"]
    refusal: Callable[[list[str]], "str | None"]
    wrap: Callable[[str, str], str]  # (construction source, class) -> swapped construction
    helper: Callable[[str], str]  # torch's local name -> the swap function's source
    unfused_ops: tuple[str, ...]
    upcast: str
    risks: tuple[Risk, ...]
    why: Callable[[list[str]], str]  # classes -> what runs unfused today


def swap_construction_sites(kind: SwapKind, module: ModuleInfo, scope: Scope, idx: S.StmtIndex) -> Iterator[Result]:
    """One finding per statement constructing library RMSNorm modules of ``kind`` (each construction
    wrapped in the swap, as for nn.RMSNorm: checkpoints, eps and every call site are unchanged), or a
    near miss where ``kind`` refuses the class or the statement already has a torch_npu path."""
    T = S.torch_name(module) or "torch"
    lines = S.module_lines(module)
    for stmt in idx.stmts:
        if not S.simple_stmt(stmt):
            continue
        text = "".join(lines[stmt.lineno - 1 : stmt.end_lineno or stmt.lineno])
        if "Norm" not in text or _in_fused_branch(idx, stmt):
            continue
        ctors = [(n, c) for n in S.iter_exprs_topdown(stmt) if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))
                 and kind.callee_may_be(ast.unparse(n.func)) for c in [kind.resolve(module, n.func)] if c is not None]
        if not ctors:
            continue
        refused = kind.refusal([c for _, c in ctors])
        if refused is not None:
            yield _miss(scope, stmt, refused)
            continue
        done = S.already_fused(module, scope, stmt)
        if done:
            yield _miss(scope, stmt, done)
            continue
        body = S.splice(module, stmt, [(n, kind.wrap(S.source_of(module, n), c)) for n, c in ctors])
        classes = list(dict.fromkeys(c for _, c in ctors))
        params: dict = {"source": "library", "module": ", ".join(classes), "constructions": len(ctors),
                        "eps": "the module's eps", "weight": "the module's weight (None: ones of normalized_shape)",
                        "unfused_ops": list(kind.unfused_ops), "upcast": kind.upcast}
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
        if target is not None and dotted(target):
            params["target"] = dotted(target)
        yield Finding(
            pattern="rms_norm", qualname=scope.qualname, line=stmt.lineno, end_line=stmt.end_lineno or stmt.lineno,
            params=params, fused=kind.helper(T) + body,
            # nothing is a tensor yet where a module is built (see construction_sites)
            guard_tensor=f"{T}.Tensor", confidence="medium", variant="library_rmsnorm",
            risks=[*_RISKS, *_SWAP_RISKS, *kind.risks],
            notes=[f"unfused: {', '.join(classes)} ({kind.why(classes)}); fused: 1",
                   "the module is swapped where it is built: every call of it runs npu_rms_norm on NPU input "
                   "(weight and eps read from the instance; no weight: ones of normalized_shape)"],
            training_ok=True,
        )


_LIBRARY_SWAP = SwapKind(
    callee_may_be=lambda callee: "norm" in callee.lower(),
    resolve=library_class,
    refusal=lambda classes: _TE_REASON if any(c in TE_RMS_CLASSES for c in classes) else None,
    wrap=lambda src, cls: f"{_LIB_SWAP}({src}, {LIBRARY_RMS_CLASSES[cls]!r})",
    helper=_lib_swap_helper,
    unfused_ops=("cast", "pow", "mean", "add", "rsqrt", "mul", "cast", "mul"),
    upcast="float32",
    risks=tuple(_LIB_RISKS),
    why=lambda classes: "; ".join(dict.fromkeys(_LIB_WHY[LIBRARY_RMS_CLASSES[c]] for c in classes)),
)


# --- s38: a norm class a repository module chooses at import time among library RMSNorms -------------
#
# Lumina-Video's ``models/components.py``: ``try: from apex.normalization import FusedRMSNorm as RMSNorm
# except ImportError: from torch.nn import RMSNorm``, then ``from .components import RMSNorm`` and
# ``RMSNorm(dim, eps=norm_eps)`` in the model. Which class the name holds is decided when that module
# is imported (apex on a CUDA machine, torch's on an NPU one), so ``external_origin`` gives no single
# class. Where every binding is a library RMSNorm or nn.RMSNorm the construction is wrapped in each
# arm's swap: each checks the instance's class at run time and leaves any other class as it is. A class
# of the repository as one arm (switti's fallback) is what runs where apex does not import: its own
# forward is the site, and the construction is left alone.

def import_time_library_classes(module: ModuleInfo, func: ast.expr) -> str | None:
    """``"a.B|torch.nn.RMSNorm"`` when a constructor's callee is a name a repository module binds at
    import time to one of several classes, every outside one a library RMSNorm (``LIBRARY_RMS_CLASSES``)
    or nn.RMSNorm; None otherwise (a name bound once is ``library_class``'s)."""
    name = canonical.api(module, func)
    if not name or name.startswith("torch.") or name in LIBRARY_RMS_CLASSES or name in TE_RMS_CLASSES \
            or not name.rsplit(".", 1)[-1].lower().endswith("norm"):
        return None
    from npufuse.scan import repo_facts

    origins = repo_facts.import_time_origins(module, name)
    # a class of the repository among the arms is what runs where the libraries do not import (apex is
    # CUDA-only): its own forward is the site, read where it is defined; the construction is left alone
    if not origins or any(o is None or (o not in LIBRARY_RMS_CLASSES and o != RMS_NORM_CLASS) for o in origins):
        return None
    return "|".join(dict.fromkeys(o for o in origins if o is not None))


def _wrap_each_arm(src: str, classes: str) -> str:
    """The construction wrapped in the swap of every class it may build (nn.RMSNorm's innermost)."""
    arms = classes.split("|")
    out = f"{_SWAP}({src})" if RMS_NORM_CLASS in arms else src
    for cls in arms:
        if cls != RMS_NORM_CLASS:
            out = f"{_LIB_SWAP}({out}, {LIBRARY_RMS_CLASSES[cls]!r})"
    return out


def _arms_why(classes: list[str]) -> str:
    arms = [a for c in classes for a in c.split("|")]
    return "; ".join(dict.fromkeys(_LIB_WHY[LIBRARY_RMS_CLASSES[a]] if a != RMS_NORM_CLASS else "nn.RMSNorm runs several kernels on NPU"
                                   for a in arms)) + "; the class is chosen when the re-exporting module is imported"


_IMPORT_TIME_SWAP = SwapKind(
    callee_may_be=lambda callee: "norm" in callee.lower(),
    resolve=import_time_library_classes,
    refusal=lambda classes: None,
    wrap=_wrap_each_arm,
    helper=lambda T: _swap_helper(T) + _lib_swap_helper(T),
    unfused_ops=("cast", "pow", "mean", "add", "rsqrt", "mul", "cast", "mul"),
    upcast="float32",
    risks=tuple(_LIB_RISKS),
    why=_arms_why,
)


# --- s26 norms: library RMSNorm families found by package and class name ---------------------
#
# Libraries re-export their norm classes from many modules (timm's ``RmsNorm`` is importable from
# ``timm.layers``, ``timm.layers.norm``, ``timm.models.layers`` and every model module that imports
# it, e.g. ``timm.models.vision_transformer``): a table of full dotted names misses most of them.
# A family is (top-level package, class names whose semantics were read from the library's source);
# a constructor whose canonical name (after the repository's own re-exports) starts with the package
# and ends with one of the class names is that class. The swap checks the same two facts at run
# time (the instance's class comes from that package and has that name), so a repo that binds the
# name to its own class (an import fallback) keeps its own forward.
#
# timm (timm/layers/norm.py, fast_norm.py; read at timm main 2025):
# * ``RmsNorm(channels, eps=1e-6, affine=True)``: ``normalized_shape`` (channels,), ``weight`` or None;
#   forward (``_fast_norm`` False, the default) is ``x * rsqrt(mean(x**2, last dims) + eps) * weight``
#   in x's dtype (no upcast), so the output dtype is promote(x, weight). With ``set_fast_norm()``
#   it casts to the autocast dtype first: the swap leaves that mode to timm's forward. timm <= 1.0.12
#   has no ``_fast_norm`` attribute and its forward always took the fast path, which without apex is
#   ``x * rsqrt(var(x) + eps) * w`` (mean-centred, unbiased: timm issue #2380, fixed in 1.0.13 with the
#   attribute): a missing attribute on RmsNorm therefore keeps timm's forward too (s35 blind-extras
#   review). RmsNormFp32 never had the attribute nor a fast path: it is swapped as before.
# * ``RmsNormFp32``: the same on ``x.float()`` and ``weight.float()``, cast back to x's dtype.
# * ``RmsNorm2d`` / ``RmsNorm2dFp32`` normalise dim 1 of NCHW (not the trailing dims npu_rms_norm
#   normalises) and ``SimpleNorm*`` subtract nothing but use ``var`` (mean-centred): not in the family.

LIBRARY_RMS_FAMILIES: dict[str, tuple[str, ...]] = {
    "timm": ("RmsNorm", "RmsNormFp32"),
}

_TIMM_SWAP = "_npufuse_timm_rms_norm_swap"

_TIMM_RISKS = [
    Risk("numerics", "timm's RmsNorm computes in the input's dtype (no fp32 upcast); npu_rms_norm keeps its statistics in "
                     "fp32, so bf16/fp16 outputs differ in the last bits (more accurate). The output dtype is timm's: "
                     "promote(input, weight) for RmsNorm, the input's for RmsNormFp32"),
]


def library_family_class(module: ModuleInfo, func: ast.expr) -> str | None:
    """``package.ClassName`` when a constructor's callee is a class of ``LIBRARY_RMS_FAMILIES``
    (through the repository's re-exports); None for anything else, including a class of that
    name the repository defines itself (timm's own source)."""
    name = canonical.api(module, func)
    if not name or "." not in name:
        return None
    pkg, cls = name.split(".", 1)[0], name.rsplit(".", 1)[-1]
    if cls not in LIBRARY_RMS_FAMILIES.get(pkg, ()):
        # a repository module re-exporting the class (``from .layers import RmsNorm``)
        if not cls.lower().endswith("norm") or name.startswith("torch."):
            return None
    from npufuse.scan import repo_facts

    origin = repo_facts.external_origin(module, name) if repo_facts.repo_root(module) is not None else name
    if origin is None:
        return None  # defined in the repository: its own class, read by the hand-written matcher
    pkg, cls = origin.split(".", 1)[0], origin.rsplit(".", 1)[-1]
    return f"{pkg}.{cls}" if cls in LIBRARY_RMS_FAMILIES.get(pkg, ()) else None


def library_origin(module: ModuleInfo, func: ast.expr, package: str) -> str | None:
    """``package.ClassName`` when a constructor's callee is a class that ``package`` defines (through
    the library's and the repository's re-exports), whatever its name; None otherwise (a class the
    repository defines itself, another package)."""
    name = canonical.api(module, func)
    if not name or "." not in name:
        return None
    from npufuse.scan import repo_facts

    origin = repo_facts.external_origin(module, name) if repo_facts.repo_root(module) is not None else name
    if origin is None or origin.split(".", 1)[0] != package:
        return None
    return f"{package}.{origin.rsplit('.', 1)[-1]}"


def _timm_swap_helper(T: str) -> str:
    """The local function swapping a timm RmsNorm / RmsNormFp32 instance's forward."""
    return "\n".join([
        f"def {_TIMM_SWAP}(norm):",
        "    # timm's RmsNorm forward through torch_npu.npu_rms_norm for NPU input; weight, eps and the",
        "    # state_dict keys stay those of the instance",
        "    cls = type(norm)",
        "    if cls.__module__.split('.')[0] != 'timm' or cls.__name__ not in ('RmsNorm', 'RmsNormFp32'):",
        "        return norm  # another class bound to the name (an import fallback): left as it is",
        f"    half = ({T}.float16, {T}.bfloat16)",
        "    fp32 = cls.__name__ == 'RmsNormFp32'",
        "    def forward(self, x):",
        f"        if _npufuse_on_npu(x) and type(self) is cls and not getattr(self, '_fast_norm', not fp32) and 2 <= x.dim() <= 8 and x.dtype in (*half, {T}.float32):",
        "            w = self.weight",
        "            if fp32:",
        "                # statistics and weight in fp32, output in x's dtype (fp32 gamma with half x: A2/A3)",
        f"                gamma = w.float() if w is not None else {T}.ones(self.normalized_shape, dtype={T}.float32, device=x.device)",
        "                return torch_npu.npu_rms_norm(x, gamma, epsilon=self.eps)[0]",
        "            # timm computes in x's dtype and multiplies by the weight: the output is promote(x, weight)",
        f"            out = {T}.promote_types(x.dtype, w.dtype) if w is not None else x.dtype",
        "            xin = x.to(out)",
        f"            gamma = w.to(out) if w is not None else {T}.ones(self.normalized_shape, dtype=out, device=x.device)",
        "            return torch_npu.npu_rms_norm(xin, gamma, epsilon=self.eps)[0]",
        "        return cls.forward(self, x)",
        "",
        "    norm.forward = forward.__get__(norm)",
        "    return norm",
        "",
    ])


def family_construction_sites(module: ModuleInfo, scope: Scope, idx: S.StmtIndex) -> Iterator[Result]:
    """One finding per statement constructing a library-family RMSNorm (timm's), each construction
    wrapped in the swap (as for nn.RMSNorm: checkpoints, eps and every call site are unchanged)."""
    return swap_construction_sites(_FAMILY_SWAP, module, scope, idx)


_FAMILY_WORDS = tuple(c for classes in LIBRARY_RMS_FAMILIES.values() for c in classes)
_FAMILY_SWAP = SwapKind(
    callee_may_be=lambda callee: any(w in callee for w in _FAMILY_WORDS) or callee.lower().endswith("norm"),
    resolve=library_family_class,
    refusal=lambda classes: None,
    wrap=lambda src, cls: f"{_TIMM_SWAP}({src})",
    helper=_timm_swap_helper,
    unfused_ops=("pow", "mean", "add", "rsqrt", "mul", "mul"),
    upcast="none",
    risks=tuple(_TIMM_RISKS),
    why=lambda classes: "timm's pure-PyTorch RMSNorm: pow, mean, add, rsqrt, mul, mul kernels on NPU",
)


# --- s26 norms: the normalised input as a cast of a name -----------------------------------


def _cast_of_name(node: ast.expr) -> ast.expr | None:
    """The name (or ``self.a``) under a dtype cast (``x.float()``, ``x.half()``, ``x.bfloat16()``,
    ``x.to(torch.float32)`` / ``x.to(y.dtype)``): a value the replacement can compute once into a
    local, the device and shape of which are those of the name. None for anything else."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) or node.keywords:
        return None
    base = node.func.value
    if dotted(base) is None:
        return None
    if node.func.attr in ("float", "half", "bfloat16") and not node.args:
        return base
    if node.func.attr == "to" and len(node.args) == 1 and isinstance(node.args[0], ast.Attribute) \
            and (node.args[0].attr == "dtype" or node.args[0].attr in ("float32", "float16", "bfloat16")) and dotted(node.args[0]) is not None:
        return base
    return None


# --- s27 norms: a norm module of an inline expression, its input bound where it stands ---


def _inline_bound_norm(module: ModuleInfo, stmt: ast.stmt, call: ast.Call, mod: str, T: str) -> str | None:
    """``npu_rms_norm((_npu_x := <input>), <gamma of _npu_x's dtype>, ...)`` for ``self.<norm>(<input>)``
    inside a larger statement (``self.q_norm(self.q_proj(h).view(shape)).transpose(1, 2)``): the input
    is evaluated exactly where the original evaluates it, once, and the arguments after it (left to
    right) read its dtype. None where an assignment expression cannot stand: inside a lambda or a
    comprehension of the statement."""
    for n in fast_walk(stmt):
        if isinstance(n, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)) \
                and any(c is call for c in fast_walk(n)):
            return None
    w = f"{mod}.weight"
    xs = S.source_of(module, call.args[0])
    if "\n" in xs:
        xs = f"({xs})"
    gamma = f"({w} if {w}.dtype in (_npu_x.dtype, {T}.float32) else {w}.to(_npu_x.dtype))"
    return (f"torch_npu.npu_rms_norm((_npu_x := {xs}), {gamma}, epsilon={mod}.variance_epsilon)[0]"
            f".to({T}.promote_types(_npu_x.dtype, {w}.dtype))")


def _hf_inline_finding(module: ModuleInfo, scope: Scope, stmt: ast.stmt, call: ast.Call, mod: str, cls: str, expr: str,
                       guard: str) -> Finding:
    """The hf_norm_module finding of :func:`hf_norm_calls` with the input bound inline."""
    body = S.splice(module, stmt, [(call, expr)])
    fused = f"if type({mod}) is {cls}:\n{S.indent(body)}\nelse:\n{S.indent(S.stmt_source(module, stmt))}"
    return Finding(
        pattern="rms_norm", qualname=scope.qualname, line=stmt.lineno, end_line=stmt.end_lineno or stmt.lineno,
        params={"eps": f"{mod}.variance_epsilon", "weight": f"{mod}.weight", "source": "transformers", "module": mod,
                "norm_class": cls, "x": S.source_of(module, call.args[0]), "output_dtype": "promote(input, weight)"},
        fused=fused, guard_tensor=guard, confidence="medium", variant="hf_norm_module",
        risks=[*_RISKS,
               Risk("numerics", f"{cls} is transformers' code, not this repository's: its forward is read as transformers' "
                                "(x.float() * rsqrt(mean(x^2) + variance_epsilon), then weight * x.to(input_dtype)); "
                                "npu_rms_norm applies the weight in fp32 and rounds once (≤1-ulp differences)")],
        notes=["unfused: transformers' RMSNorm (about 8 kernels); fused: 1",
               f"fused only while {mod} is exactly {cls} (checked at run time)",
               "the input is bound where it stands (`_npu_x := ...`): evaluated once, in the original order"],
        training_ok=True,
    )


# --- s28 norms: x / (n * s + eps) with the norm bound to a name first, and weightless (issue 14) ---
#
# ``norm_x = x.norm(2, dim=-1, keepdim=True); y = x / (norm_x * self.dd + 1e-12); return self.weight * y``
# (RWKV-v1; ``self.dd = d ** (-1. / 2)``) and the same without the weight: the norm is read through a
# name bound to it, as the rsqrt forms are read through theirs. ``s = d ** -0.5`` makes ``norm * s``
# the rms, so the quotient is an RMS norm with eps added outside the root: npu_rms_norm with
# eps' = (eps / (s * sqrt(d)))**2 inside it (``_EPS_ADDED_RISK`` states the difference: none on zero
# rows, relative ~eps / rms elsewhere, at most 1.41x on rows whose rms is close to eps). A weightless
# quotient is fused with a ones gamma. A bare unit vector ``x / (||x|| + eps)`` (no d-power: an L2
# normalisation, not a norm layer) stays silent as before.

def _s28_eps_added_named_norm(module: ModuleInfo, scope: Scope, div: ast.BinOp) -> tuple[
        tuple[ast.expr, list[tuple[ast.expr, bool]], ast.expr] | None, ast.stmt | None]:
    """``_eps_added_norm`` of ``div``'s denominator where the norm factor is a local name bound
    (unconditionally, before ``div``) to the 2-norm of the last dim: ((x, s factors, eps), the binding
    statement), or (None, None)."""
    den = div.right
    if not (isinstance(den, ast.BinOp) and isinstance(den.op, ast.Add)):
        return None, None
    for prod, eps in ((den.left, den.right), (den.right, den.left)):
        if not (_number(eps) is not None or dotted(eps) is not None):
            continue
        factors: list[tuple[ast.expr, bool]] = []
        _flatten(prod, False, factors)
        named: list[tuple[ast.expr, ast.expr, ast.stmt]] = []
        for f, inv in factors:
            if inv or not isinstance(f, ast.Name):
                continue
            value, _vctx, bound = S.follow(f, S.Ctx(scope, div.lineno))
            x = canonical.l2_norm_operand(module, value) if bound is not None else None
            if x is not None:
                named.append((f, x, bound))
        if len(named) != 1 or any(canonical.l2_norm_operand(module, f) is not None for f, _ in factors):
            continue
        f0, x, bound = named[0]
        # the operand must still hold the normed value where the quotient reads it
        if isinstance(x, ast.Name) and any(x.id in S.names_written(st) for st in S.stmt_index(scope).stmts
                                           if bound.lineno < st.lineno < div.lineno):
            continue
        return (x, [(f, inv) for f, inv in factors if f is not f0], eps), bound
    return None, None


def _s28_lead(idx: S.StmtIndex, scope: Scope, lead: ast.stmt | None, head: ast.stmt, last: ast.stmt,
              replaced: ast.expr) -> ast.stmt | None:
    """``lead`` (the statement binding the norm) when it comes right before ``head`` in the same block
    and its name is read nowhere after ``last`` nor in ``last`` outside the ``replaced`` expression: the
    span takes it in; else None (it stays, run before the span on both paths)."""
    if lead is None or not (isinstance(lead, ast.Assign) and len(lead.targets) == 1 and isinstance(lead.targets[0], ast.Name)):
        return None
    loc = idx.block.get(id(lead))
    if loc is None or loc[1] + 1 >= len(loc[0]) or loc[0][loc[1] + 1] is not head:
        return None
    name = lead.targets[0].id
    if scope.uses_after(name, last.end_lineno or last.lineno):
        return None
    inside = {id(n) for n in ast.walk(replaced)}
    if any(isinstance(n, ast.Name) and n.id == name and id(n) not in inside for n in S.iter_exprs_topdown(last)):
        return None
    return lead


def _s28_root_power(module: ModuleInfo, node: ast.expr, init: dict) -> float | None:
    """``_root_power_any``, also through ``self.a`` whose ``__init__`` value is ``d ** (-1. / 2)``
    (an exponent written as arithmetic)."""
    p = _root_power_any(module, node, init)
    if p is None and isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        value = init.get(node.attr)
        if isinstance(value, ast.expr):
            p = _root_power_any(module, value, init)
    return p


# --- s39: third-party model libraries' RMSNorm classes, read from their source ------------------------
#
# A model built from a model library's modules (``from torchtune.modules import RMSNorm``; HO15a's
# mini-llm-brawl) holds no norm arithmetic of its own: the construction is the site, as for apex. Each
# class below was read in the library's history; the swap runs npu_rms_norm only where, at run time, the
# instance's class is exactly that class (module and name) and its forward's code names (``co_names`` of
# ``forward``, then of ``_norm`` where the class has one) are one of the spellings read: a release that
# rewrites the forward, a subclass or another class bound to the name keeps the library's own forward.
# A library RMSNorm-named class missing from the table is a near miss that names it.


@dataclass(frozen=True)
class ThirdPartyNorm:
    """One verified third-party RMSNorm class: where it lives at run time, the attributes the fused
    call reads, and its forward's spellings (code names -> output dtype rule)."""

    runtime_module: str  # type(norm).__module__
    name: str  # type(norm).__name__
    weight: str  # the gain's attribute
    eps: str  # the epsilon's attribute
    offset: float  # gamma = offset + weight (Gemma: 1 + w)
    # forward's code names -> "promote" (x normalised in fp32, rounded to x's dtype, times the weight:
    # promote(x, weight) out) or "input" (weight applied in fp32, x's dtype out)
    forms: tuple[tuple[tuple[str, ...], str], ...]
    semantics: str  # what the forms compute and the releases each holds for


THIRD_PARTY_RMS_NORMS: dict[str, ThirdPartyNorm] = {
    # torchtune/modules/rms_norm.py (read at v0.1.0 .. v0.6.1 and main 2025): ``scale`` (ones), ``eps``
    # (1e-6); 0.1.0-0.4.0 and main after c5c160b: (x.float() * rsqrt(mean(x^2) + eps)).type_as(x) * scale;
    # 0.5.0-0.6.1: F.rms_norm(x.float(), (dim,), scale, eps).to(x.dtype)
    "torchtune.RMSNorm": ThirdPartyNorm(
        "torchtune.modules.rms_norm", "RMSNorm", "scale", "eps", 0.0,
        ((("float", "torch", "rsqrt", "pow", "mean", "eps", "type_as", "scale"), "promote"),
         (("F", "rms_norm", "float", "normalized_shape", "scale", "eps", "to", "dtype"), "input")),
        "fp32 statistics, eps inside the root, times scale; torchtune 0.1-0.4 and main: normalised value rounded "
        "to x's dtype, then times scale (promote(x, scale) out); 0.5-0.6.1: scale applied in fp32, x's dtype out"),
    # torchtune/models/gemma/rms_norm.py (the same code v0.1.0 .. main): ``scale`` (zeros), ``eps``;
    # x.float() * rsqrt(mean(x^2) + eps) * (1 + scale.float()), then type_as(x)
    "torchtune.GemmaRMSNorm": ThirdPartyNorm(
        "torchtune.models.gemma.rms_norm", "GemmaRMSNorm", "scale", "eps", 1.0,
        ((("_norm", "float", "scale", "type_as", "|", "torch", "rsqrt", "pow", "mean", "eps"), "input"),),
        "fp32 statistics, eps inside the root, times (1 + scale) in fp32, x's dtype out (torchtune 0.1 .. main)"),
}
_THIRD_PARTY_PACKAGES = {key.split(".", 1)[0] for key in THIRD_PARTY_RMS_NORMS}


def third_party_norm_class(module: ModuleInfo, func: ast.expr) -> str | None:
    """The ``THIRD_PARTY_RMS_NORMS`` key of the class a constructor's callee stands for (through the
    library's own re-exports and the repository's); None for anything else."""
    return library_table_key(module, func, THIRD_PARTY_RMS_NORMS, _THIRD_PARTY_PACKAGES,
                             lambda cls: _RMS_CLASS_NAME.search(cls) is not None)


def library_table_key(module: ModuleInfo, func: ast.expr, table: dict, packages: set[str] | frozenset[str],
                      named: Callable[[str], bool] | None = None) -> str | None:
    """The ``package.ClassName`` key of ``table`` (a table of library classes whose code npufuse read: the
    norm and rope tables) that a constructor's callee stands for: spelled through the library's own
    re-exports, or through the repository's re-exports of a class outside it. Another class of a table
    package, or (with ``named``) a class whose name fails the test, is None without following re-exports."""
    name = canonical.api(module, func)
    if not name or "." not in name:
        return None
    key = f"{name.split('.', 1)[0]}.{name.rsplit('.', 1)[-1]}"
    if key in table:
        return key
    if name.split(".", 1)[0] in packages or (named is not None and not named(name.rsplit(".", 1)[-1])):
        return None  # another class of a table library, or not the kind of class by name
    origin = _outside_origin(module, name)
    if origin is None:
        return None
    key = f"{origin.split('.', 1)[0]}.{origin.rsplit('.', 1)[-1]}"
    return key if key in table else None


_RMS_CLASS_NAME = re.compile(r"rms_?norm", re.IGNORECASE)


def _outside_origin(module: ModuleInfo, name: str) -> str | None:
    """``name`` followed through the repository's re-exports to a class outside it (None when the
    repository defines it, or outside a repository)."""
    if name.startswith("torch."):
        return None
    from npufuse.scan import repo_facts

    return repo_facts.external_origin(module, name) if repo_facts.repo_root(module) is not None else None


_TP_SWAP = "_npufuse_third_party_rms_norm_swap"


def _tp_swap_helper(T: str) -> str:
    """The local function swapping one verified third-party RMSNorm instance's forward: the table's
    facts (class, attributes, offset, spellings) are arguments written at the construction."""
    return "\n".join([
        f"def {_TP_SWAP}(norm, module, name, weight, eps, offset, forms):",
        "    # a third-party RMSNorm's forward through torch_npu.npu_rms_norm for NPU input, where the instance's",
        "    # class is exactly the one read and its forward one of the spellings read (else left as it is)",
        "    cls = type(norm)",
        "    if cls.__module__ != module or cls.__name__ != name:",
        "        return norm",
        "    code = lambda f: getattr(cls.__dict__.get(f), '__code__', None)",
        "    names = tuple(code('forward').co_names) if code('forward') is not None else ()",
        "    if code('_norm') is not None:",
        "        names += ('|', *code('_norm').co_names)",
        "    rule = dict(forms).get(names)",
        "    if rule is None:",
        "        return norm  # a release whose forward was not read: its own forward",
        f"    half = ({T}.float16, {T}.bfloat16)",
        "    def forward(self, x):",
        f"        if _npufuse_on_npu(x) and type(self) is cls and 2 <= x.dim() <= 8 and x.dtype in (*half, {T}.float32):",
        "            w = getattr(self, weight)",
        "            gamma = w.float() + offset if offset else w",
        f"            out = {T}.promote_types(x.dtype, w.dtype) if rule == 'promote' else x.dtype",
        "            xin = x.to(out)",
        "            # npu_rms_norm takes gamma in the input's dtype, or float32 with an fp16/bf16 input",
        f"            if gamma.dtype not in (xin.dtype, {T}.float32):",
        "                gamma = gamma.to(xin.dtype)",
        "            return torch_npu.npu_rms_norm(xin, gamma, epsilon=getattr(self, eps))[0]",
        "        return cls.forward(self, x)",
        "",
        "    norm.forward = forward.__get__(norm)",
        "    return norm",
        "",
    ])


def _tp_wrap(src: str, key: str) -> str:
    spec = THIRD_PARTY_RMS_NORMS[key]
    return (f"{_TP_SWAP}({src}, {spec.runtime_module!r}, {spec.name!r}, {spec.weight!r}, {spec.eps!r}, {spec.offset!r}, "
            f"{tuple(spec.forms)!r})")


_TP_RISKS = (
    Risk("numerics", "the library class's forward is replaced by npu_rms_norm (statistics in fp32, the weight applied in "
                     "fp32, one rounding); where the library rounds the normalised value to the input's dtype before the "
                     "weight (torchtune's RMSNorm outside 0.5-0.6.1) bf16/fp16 outputs differ in the last bit"),
)

_THIRD_PARTY_SWAP = SwapKind(
    callee_may_be=lambda callee: "norm" in callee.lower(),
    resolve=third_party_norm_class,
    refusal=lambda classes: None,
    wrap=_tp_wrap,
    helper=_tp_swap_helper,
    unfused_ops=("cast", "pow", "mean", "add", "rsqrt", "mul", "cast", "mul"),
    upcast="float32",
    risks=_TP_RISKS,
    why=lambda classes: "; ".join(f"{c}: {THIRD_PARTY_RMS_NORMS[c].semantics}" for c in classes),
)


def unknown_library_norm_class(module: ModuleInfo, func: ast.expr) -> str | None:
    """The outside name of an RMSNorm-named class from a library npufuse has no verified model of (not
    nn.RMSNorm, the apex / xformers / diffusers / TransformerEngine / timm / torchtune tables, nor
    transformers' Llama-style norms, which other readings handle); None for anything else."""
    name = canonical.api(module, func)
    if not name or "." not in name or not _RMS_CLASS_NAME.search(name.rsplit(".", 1)[-1]):
        return None
    origin = _outside_origin(module, name)
    if origin is None or origin.startswith("torch.") or origin in LIBRARY_RMS_CLASSES or origin in TE_RMS_CLASSES:
        return None
    pkg, cls = origin.split(".", 1)[0], origin.rsplit(".", 1)[-1]
    if pkg in _THIRD_PARTY_PACKAGES or cls in LIBRARY_RMS_FAMILIES.get(pkg, ()) or (pkg == "transformers" and cls in _HF_LLAMA_NORMS):
        return None
    return origin


def _unknown_refusal(classes: list[str]) -> str:
    known = "apex, xformers, diffusers, timm, torchtune; TransformerEngine refused"
    return (f"{', '.join(dict.fromkeys(classes))}: an RMSNorm class of a third-party library whose forward npufuse has "
            f"not read (its table of library norms read from their source: {known}): eps placement, weight offset "
            "and upcast are unknown, so the construction is left as it is")


_UNKNOWN_LIBRARY = SwapKind(
    callee_may_be=lambda callee: bool(_RMS_CLASS_NAME.search(callee)),
    resolve=unknown_library_norm_class,
    refusal=_unknown_refusal,
    wrap=lambda src, cls: src,
    helper=lambda T: "",
    unfused_ops=(),
    upcast="",
    risks=(),
    why=lambda classes: "",
)


def third_party_construction_sites(module: ModuleInfo, scope: Scope, idx: S.StmtIndex) -> Iterator[Result]:
    """Constructions of the table's third-party RMSNorms (swapped), and near misses naming the
    RMSNorm classes of libraries the table does not hold."""
    yield from swap_construction_sites(_THIRD_PARTY_SWAP, module, scope, idx)
    yield from swap_construction_sites(_UNKNOWN_LIBRARY, module, scope, idx)
