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
from dataclasses import dataclass, field
from typing import Iterator

from npufuse.patterns import _site as S
from npufuse.patterns.base import Finding, NearMiss, Result, Risk
from npufuse.scan import canonical
from npufuse.scan.dataflow import ModuleInfo, Scope, const_value, dotted, keyword

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
        cached = module.__dict__["_npufuse_library_norm_text"] = "rms_norm" in src or "RMSNorm" in src or "normalize(" in src
    return cached


def detect(module: ModuleInfo, scope: Scope) -> Iterator[Result]:
    """Findings and near misses for library norms in one scope."""
    if scope.qualname == "<module>" or not relevant(module):
        return
    norm_attrs = _norm_attributes(module, scope.class_name)
    text = S.scope_text(module, scope)
    if not ("rms_norm" in text or "normalize(" in text or any(f"self.{a}(" in text for a in norm_attrs)):
        return
    calls = scope.nodes().get(ast.Call, [])
    idx = S.stmt_index(scope)
    sites: dict[int, list[_Site]] = {}
    missed: set[int] = set()
    out: list[Result] = []
    for call in calls:
        name = canonical.api(module, call.func)
        if name == RMS_NORM_FN:
            found = list(_functional(module, scope, idx, call))
        elif norm_attrs and isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) \
                and call.func.value.id == "self" and call.func.attr in norm_attrs:
            found = list(_module_call(module, scope, idx, call, norm_attrs[call.func.attr]))
        elif name == NORMALIZE_FN:
            found = list(_normalize(module, scope, idx, call))
        else:
            continue
        for r in found:
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
    out.sort(key=lambda r: r.line)
    yield from out


def _claimed_by_add_rms_norm(module: ModuleInfo, scope: Scope) -> set[int]:
    """Library norm calls on a residual sum that add_rms_norm replaces (``x = x + a; y = F.rms_norm(x, ...)``):
    reported once, there (its training path runs the add then npu_rms_norm, so nothing is lost)."""
    from npufuse.patterns import add_rms_norm as A

    if not scope.class_name or "+" not in S.scope_text(module, scope):
        return set()
    out: set[int] = set()
    for _stmt, site in A._sites(module, scope):
        if isinstance(site, A._Site) and site.nc.kind == "library" and isinstance(A._build(module, scope, site), Finding):
            out.add(id(site.nc.call))
    return out


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


def _eps_code(eps: ast.expr | None, module: ModuleInfo, T: str, notes: list[str]) -> tuple[str, object] | None:
    """(source of the epsilon argument, its value for params); None when it cannot be written once."""
    value = const_value(eps) if eps is not None else None
    if eps is None or value is None:
        notes.append(DEFAULT_EPS_NOTE)
        return f"{T}.finfo({T}.float32).eps", "finfo(float32).eps"
    if type(value) in (int, float):
        return S.source_of(module, eps), float(value)  # type: ignore[arg-type]
    if _atom(eps):
        # may be None at run time (a parameter defaulting to None): same rule as PyTorch's
        src = S.source_of(module, eps)
        notes.append("eps is read at run time; None means torch.finfo(torch.float32).eps, as in PyTorch's kernel")
        return f"({src} if {src} is not None else {T}.finfo({T}.float32).eps)", src
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


def _norm_attributes(module: ModuleInfo, class_name: str | None) -> dict[str, list[ast.expr]]:
    """``attr -> [values assigned to self.attr in __init__]`` for the attributes of which at least
    one assignment constructs ``nn.RMSNorm`` (cached per class)."""
    if not class_name or class_name not in module.classes:
        return {}
    cache = module.__dict__.setdefault("_npufuse_library_norms", {})
    if class_name in cache:
        return cache[class_name]
    found: dict[str, list[ast.expr]] = {}
    for item in module.classes[class_name].body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            for n in S._stmts_in(item.body):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) and n.value is not None else []
                for t in targets:
                    d = dotted(t)
                    if d and d.startswith("self.") and d.count(".") == 1:
                        found.setdefault(d[5:], []).append(n.value)  # type: ignore[union-attr]
    out = {a: vs for a, vs in found.items() if any(_rms_ctor(module, v) is not None for v in vs)}
    cache[class_name] = out
    return out


def _rms_ctor(module: ModuleInfo, value: ast.expr) -> ast.Call | None:
    """The ``nn.RMSNorm(...)`` call of an assigned value (also one branch of ``a if c else b``)."""
    if isinstance(value, ast.Call) and canonical.api(module, value.func) == RMS_NORM_CLASS:
        return value
    if isinstance(value, ast.IfExp):
        return _rms_ctor(module, value.body) or _rms_ctor(module, value.orelse)
    return None


def _module_call(module: ModuleInfo, scope: Scope, idx: S.StmtIndex, call: ast.Call, values: list[ast.expr]) -> Iterator["Result | _Site"]:
    stmt = _stmt_of(idx, scope, call)
    if stmt is None:
        return
    attr = f"self.{call.func.attr}"  # type: ignore[union-attr]
    done = S.already_fused(module, scope, stmt)
    if done:
        yield _miss(scope, stmt, done)
        return
    if len(call.args) != 1 or call.keywords or isinstance(call.args[0], ast.Starred):
        yield _miss(scope, stmt, f"{attr} is an nn.RMSNorm called with other than one input")
        return
    T = S.torch_name(module) or "torch"
    ctors = [_rms_ctor(module, v) for v in values]
    only_rms = len(values) == 1 and isinstance(values[0], ast.Call) and ctors[0] is not None
    ctor = ctors[0] if only_rms else None
    notes: list[str] = []
    conditions: list[str] = []
    if not only_rms:
        # another module may sit in the attribute (``RMSNorm(d) if cfg.rms else LayerNorm(d)``):
        # the fused branch runs only when it really is PyTorch's RMSNorm
        conditions.append(f"type({attr}) is {T}.nn.RMSNorm")
        notes.append(f"{attr} is not always an nn.RMSNorm (assigned conditionally or more than once): the fused branch checks its type")
    x = call.args[0]
    x_src = S.source_of(module, x)
    affine = keyword(ctor, "elementwise_affine", 2) if ctor is not None else None
    affine_value = const_value(affine) if affine is not None else True
    if ctor is not None and affine_value is False:
        if not _atom(x):
            yield _miss(scope, stmt, f"{attr} has no weight (elementwise_affine=False) and its input is an inline expression: "
                                     "the replacement needs the input twice; bind it to a name first")
            return
        gamma = f"{T}.ones({attr}.normalized_shape, dtype={x_src}.dtype, device={x_src}.device)"
        guard = x_src
    else:
        gamma = f"{attr}.weight"
        # the guard runs before the fused branch's own checks: the input when it is a name (a
        # tensor whatever sits in the attribute), the weight only when the attribute surely
        # holds an nn.RMSNorm with one
        guard = x_src if _atom(x) else gamma if only_rms and affine_value is True else None
        if guard is None:
            yield _miss(scope, stmt, f"{attr} may hold another module and its input is an inline expression: no tensor "
                                     "to check the device of before the call; bind the input to a name first")
            return
        if ctor is None or affine_value is not True:
            conditions.append(f"{attr}.weight is not None")
    eps_node = keyword(ctor, "eps", 1) if ctor is not None else None
    if ctor is not None and (eps_node is None or type(const_value(eps_node)) in (int, float) or const_value(eps_node) is None):
        e = _eps_code(eps_node, module, T, notes)
    else:
        # eps from the config, a parameter, or another constructor: the instance knows it
        e = (f"({attr}.eps if {attr}.eps is not None else {T}.finfo({T}.float32).eps)", f"{attr}.eps")
        notes.append(f"eps read from {attr}.eps at run time; None means torch.finfo(torch.float32).eps, as in PyTorch's kernel")
    assert e is not None
    expr = f"torch_npu.npu_rms_norm({x_src}, {gamma}, epsilon={e[0]})[0]"
    params = {"eps": e[1], "weight": None if gamma.startswith(f"{T}.ones") else gamma, "source": "library", "module": attr, "x": x_src}
    yield _Site(stmt, call, expr, guard, params, "nn_rmsnorm", notes, conditions)


def _normalize(module: ModuleInfo, scope: Scope, idx: S.StmtIndex, call: ast.Call) -> Iterator[Result]:
    """``F.normalize(x, dim=-1) * scale [* g]``: an RMSNorm up to where eps goes: a near miss."""
    dim = keyword(call, "dim", 2)
    p = keyword(call, "p", 1)
    if const_value(dim) != -1 or (p is not None and const_value(p) not in (2, 2.0)):
        return
    stmt = _stmt_of(idx, scope, call)
    if stmt is None or not _scaled(stmt, call):
        return
    yield _miss(scope, stmt, "F.normalize(x, dim=-1) times a scale is an RMSNorm only up to eps: F.normalize divides by "
                             "max(||x||, eps) (eps as a clamp on the norm), npu_rms_norm by sqrt(mean(x^2) + eps) (eps inside "
                             "the root), and the scale must equal sqrt(d) for the two to agree; rewrite by hand if that "
                             "difference is acceptable")


def _scaled(stmt: ast.stmt, call: ast.Call) -> bool:
    """``call`` is an operand of a multiplication in ``stmt`` (``normalize(x) * self.scale * g``)."""
    for n in S.iter_exprs_topdown(stmt):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult) and (n.left is call or n.right is call):
            return True
    return False
