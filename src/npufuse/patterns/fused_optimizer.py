"""``fused_optimizer``: ``torch.optim.AdamW/Adam/SGD(...)`` → ``torch_npu.optim.NpuFused*``.

The torch optimizers update every parameter tensor with its own handful of small kernels (the
single-tensor path launches ~10 per tensor per step); torch_npu's fused optimizers copy params,
grads and states into one flat buffer per dtype at the first step and update each buffer with a
few kernels. The replacement is the same construction with the class swapped (same arguments,
same defaults: AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2; SGD's lr
default 1e-3 is passed explicitly because NpuFusedSGD has none).

Only where the documented constraints hold (spec §10): params fp32/fp16 (no bf16), grads never
re-allocated (no ``zero_grad(set_to_none=True)``, no ``model.zero_grad()`` on torch ≥ 2.0,
no ``p.grad = ...``, no accelerate-prepared optimizer that gets ``zero_grad()``: accelerate's
wrapper passes ``set_to_none=True``), params never re-allocated (no FSDP / DeepSpeed / ZeRO
flattening), and no ``foreach/fused/capturable/maximize/differentiable`` arguments. Anything else
is a near miss. These facts are read from the code that may run with the optimizer: the whole file
less other tests' code (:class:`_Units`), nearest first. A peft model over a bf16 base is not
blocked by the bf16 cast (only its fp32 adapters get grads); its guard checks the trainable
dtypes at run time instead.

The guard tensor: ``model.parameters()`` is a generator, so the guard never peeks into the
user's own iterator. When the params argument is (or is built from) ``M.parameters()`` /
``M.named_parameters()``, the guard makes a fresh one: ``next(M.parameters(), None)``. When it
is an opaque name (``def build(params): return AdamW(params)``), the guard materialises it once
with a walrus, ``next(iter((params := list(params))), None)``, so both branches get the same
list (torch.optim does ``list(params)`` itself) and nothing is consumed twice; param-group dicts
passed that way have no tensor first, so the guard stays false and the original runs.
"""

from __future__ import annotations

import ast
import re
from typing import Any, ClassVar, Iterable, Optional, Union

from npufuse.patterns import _fused_optimizer_s50m, _fused_optimizer_s51a, _fused_optimizer_s51b
from npufuse.patterns import _fused_optimizer_s46a, _optim_s45, _optim_s46
from npufuse.patterns import _fused_optimizer_s47sweep
from npufuse.patterns import _optim_s46h
from npufuse.patterns.base import Finding, Fuse, Keep, NearMiss, Pattern, Result, Risk
from npufuse.scan.dataflow import ModuleInfo, Scope, const_value, dotted, fast_walk, keyword, names_bound_from, segment
from npufuse.scan.value import estimate, symbolic

_ID = "fused_optimizer"

# torch class -> (fused class, accepted argument names in positional order after params)
_OPTIMIZERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "AdamW": ("NpuFusedAdamW", ("lr", "betas", "eps", "weight_decay", "amsgrad")),
    "Adam": ("NpuFusedAdam", ("lr", "betas", "eps", "weight_decay", "amsgrad")),
    "SGD": ("NpuFusedSGD", ("lr", "momentum", "dampening", "weight_decay", "nesterov")),
    # same constructor and defaults as torch.optim's (spec §10); torch's extra keywords
    # (foreach, capturable, maximize, differentiable) are near misses like everywhere else
    "Adadelta": ("NpuFusedAdadelta", ("lr", "rho", "eps", "weight_decay")),
    "RMSprop": ("NpuFusedRMSprop", ("lr", "alpha", "eps", "weight_decay", "momentum", "centered")),
}
# torch.optim classes torch_npu.optim has no fused class for (its fused classes: spec §10; LAMB,
# AdamP, BertAdam and RMSpropTF there follow other libraries' math, not a torch.optim class)
_NO_FUSED = ("Adagrad", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "LBFGS", "SparseAdam")
_CANONICAL = {
    **{f"torch.optim.{k}": k for k in _OPTIMIZERS},
    "torch.optim.adamw.AdamW": "AdamW",
    "torch.optim.adam.Adam": "Adam",
    "torch.optim.sgd.SGD": "SGD",
    "torch.optim.adadelta.Adadelta": "Adadelta",
    "torch.optim.rmsprop.RMSprop": "RMSprop",
}
_NO_FUSED_NAMES = {f"torch.optim.{k}": k for k in _NO_FUSED} | {f"torch.optim.{k.lower()}.{k}": k for k in _NO_FUSED}
# Keywords that choose how torch.optim runs (not what it computes): dropped from the fused call.
# ``foreach``/``fused`` at any value pick torch.optim's implementation (single-tensor, foreach or its
# own fused kernel: the same update); ``capturable`` keeps ``step`` a device tensor for CUDA-graph
# capture (the same update; it matters only where a graph is captured: see _GRAPH_CAPTURE);
# ``maximize``/``differentiable`` change the math or its autograd, so only their default goes.
_ANY_VALUE = ("foreach", "fused", "capturable")
_DROPPABLE: dict[str, tuple[object, ...]] = {
    "maximize": (False,),
    "differentiable": (False,),
}
# Calls that capture a graph of device work: an optimizer step captured there must keep its step
# count on the device (capturable=True); the fused class keeps a Python int.
_GRAPH_CAPTURE = ("CUDAGraph", "NPUGraph", "make_graphed_callables", "graph_pool_handle")
_UNSUPPORTED_KW = ("foreach", "fused", "capturable", "maximize", "differentiable", "decoupled_weight_decay")
# Names that mean parameters get flattened, sharded or re-allocated behind the optimizer's back.
_SHARDING = ("FullyShardedDataParallel", "FSDP", "fully_shard", "deepspeed", "ZeroRedundancyOptimizer",
             "zero_optimization", "DeepSpeedEngine", "FlatParameter")
# Bytes per parameter element and kernels per parameter tensor of one step (fp32 state).
_STEP_COST = {  # fused bytes, single-tensor bytes, single-tensor kernels per tensor
    "AdamW": (28, 80, 10),
    "Adam": (28, 80, 10),
    "SGD": (20, 40, 4),
    "Adadelta": (28, 80, 10),  # two state tensors, like Adam
    "RMSprop": (20, 48, 6),  # one state tensor (square average), more with momentum/centered
}


class FusedOptimizer(Pattern):
    id = _ID
    api = "torch_npu.optim.NpuFusedAdamW"
    title = "torch.optim AdamW/Adam/SGD → torch_npu.optim.NpuFused* (flat-buffer fused update)"
    training_ok = True
    bound = "launch"
    #: ``npufuse scan --optimizer-zero-grad-in-place`` (ScanOptions.optimizer_zero_grad_in_place):
    #: an explicit ``zero_grad(set_to_none=True)`` on the optimizer, its model or a wrapper holding it
    #: is rebound to zero in place instead of refusing (see :class:`_ZeroGradFix`)
    zero_grad_in_place: bool = False
    #: examples of that option (found and run only with it on; near misses by default: see KEEP)
    FUSE_ZERO_IN_PLACE: ClassVar[list[Fuse]] = []
    KEEP_ZERO_IN_PLACE: ClassVar[list[Keep]] = []

    def with_scan_options(self, options: Any) -> "FusedOptimizer":
        wanted = bool(getattr(options, "optimizer_zero_grad_in_place", False))
        if wanted == self.zero_grad_in_place:
            return self
        copy = type(self)()
        copy.zero_grad_in_place = wanted  # an instance attribute: cache.fingerprint keys it
        return copy

    def detect(self, module: ModuleInfo, scope: Scope) -> Iterable[Result]:
        if not _relevant(module):
            return  # no optimizer class named in this file
        for _block, _i, stmt in scope.statements():
            if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Expr, ast.Return)):
                continue
            calls = _optimizer_calls(module, stmt)
            rebound = _optim_s46h.rebound_before_read(module, _block, _i) if calls else None
            if rebound is not None:
                # s46h: `opt = AdamW(..)` then `opt = AdamW(..)` again before any use: this one never steps
                yield NearMiss(_ID, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno,
                               f"the optimizer is never used: `{ast.unparse(stmt.targets[0])}` is rebound at line "  # type: ignore[union-attr]
                               f"{rebound} before anything reads it (the construction there is the site)")
                continue
            for call in calls:
                yield _site(module, scope, stmt, call, _units(module).tiers(scope.qualname), in_place=self.zero_grad_in_place)
            for call in _unfusable_calls(module, stmt):
                kind = _NO_FUSED_NAMES[module.canonical(call.func) or ""]
                yield NearMiss(_ID, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno,
                               f"torch_npu.optim has no fused counterpart of torch.optim.{kind} (its fused classes: "
                               f"{', '.join(v[0] for v in _OPTIMIZERS.values())}, and LAMB/AdamP/BertAdam/RMSpropTF "
                               "with other libraries' math); switching algorithms changes training")
            for _call, reason in _third_party_calls(module, stmt):
                yield NearMiss(_ID, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, reason)
            if not calls:
                through_partial = _s40_partial_construction(module, scope, stmt)
                if through_partial is not None:
                    yield _s40_partial_site(module, scope, stmt, *through_partial, in_place=self.zero_grad_in_place)
                    continue
                table_called = _s39_table_called(module, scope, stmt)
                if table_called is not None:
                    yield _s32_looked_up_site(module, scope, stmt, *table_called, in_place=self.zero_grad_in_place)
                    continue
                built = _chosen_construction(module, scope, stmt)
                if built is None:
                    built = _s28_injected_class(module, scope, stmt)
                looked_up = (_s32_class_lookup(module, stmt) or _s34_bound_lookup(module, scope, stmt)) if built is None else None
                if built is None and looked_up is None:
                    loaded = _s39_loaded_class(module, scope, stmt)  # s39: a class loaded from a dotted path
                    built, looked_up = (loaded, None) if isinstance(loaded, NearMiss) else (None, loaded)
                if isinstance(built, NearMiss):
                    yield built
                elif built is not None:
                    call, kind, test = built
                    yield _site(module, scope, stmt, call, _units(module).tiers(scope.qualname), in_place=self.zero_grad_in_place,
                                chosen_class=(kind, test))
                elif looked_up is not None:
                    yield _s32_looked_up_site(module, scope, stmt, *looked_up, in_place=self.zero_grad_in_place)
                else:
                    chosen = (_class_chosen_at_run_time(module, scope, stmt) or _class_as_value(module, scope, stmt)
                              or _looked_up_by_name(module, scope, stmt)
                              or _fused_optimizer_s51b.table_lookup_refusal(module, scope, stmt))
                    if chosen is not None:
                        yield chosen

    def assess(self, finding: Finding, config: dict[str, Any]) -> dict[str, Any]:
        return _assess(finding, config)

    @staticmethod
    def reference(params: Any, kind: str = "AdamW", **kwargs: Any) -> Any:
        """The eager optimizer the fused class must match step for step (``torch.optim.<kind>``)."""
        import torch

        return getattr(torch.optim, kind)(params, **kwargs)


def _relevant(module: ModuleInfo) -> bool:
    # cached on the module (detect runs for every scope of it); a global cache holding the
    # last module would keep its whole tree alive past the file, for the garbage collector to walk
    cached = module.__dict__.get("_npufuse_optim_relevant")
    if cached is None:
        src = module.source
        # "optim" first: one search instead of fourteen in the files that never say it (most)
        cached = module.__dict__["_npufuse_optim_relevant"] = (("optim" in src) and any(k in src for k in (*_OPTIMIZERS, *_NO_FUSED))) \
            or any(k in src for k in _THIRD_PARTY_CLASSES) or _BY_NAME_WORD in src or (_CALLED_LOOKUP_WORD in src and "optim" in src) \
            or ("optim" in src and any(w in src for w in _S39_LOADER_WORDS)) \
            or bool(_fused_optimizer_s51b.registry_words(module, tuple(_OPTIMIZERS)))  # s51b: a table of another file
        if cached and "*" in src:
            # s51b: `from config import *` binding torch.optim classes (config: `from torch.optim import Adam`)
            module.aliases.update(_fused_optimizer_s51b.star_optim_aliases(module))
    return bool(cached)


# Third-party optimizers torch_npu.optim has a fused class for (spec §10), by (top package, class):
# the reason they stay near misses. LAMB: NpuFusedLamb is the cybertronai/pytorch-lamb form (no
# bias correction, trust ratio clamp(||p||, 0, 10)/||step||); apex's FusedLAMB and timm's Lamb
# bias-correct the moments (bias_correction=True) and clip grads by their global norm
# (max_grad_norm=1.0) by default: another update. The others are documented as the same math,
# but npufuse's emulator (npufuse.emulate) has no reference for them, so no swap could be verified.
_SAME_MATH = ("torch_npu.optim.{fused} documents the same math ({origin}), but npufuse's emulator has no reference "
              "implementation of it, so `npufuse verify` could not check a swap; replace it by hand (same constructor "
              "arguments) once the fused constraints hold (fp32/fp16 params, grads never set to None, no FSDP/DeepSpeed)")
_LAMB_DIFFERS = ("torch_npu.optim.NpuFusedLamb is LAMB in the cybertronai/pytorch-lamb form (no bias correction, trust "
                 "ratio clamp(||p||, 0, 10)/||step||); {name} bias-corrects the Adam moments and clips grads by their global "
                 "norm (max_grad_norm=1.0) by default: swapping changes the update")
_THIRD_PARTY: dict[tuple[str, str], str] = {
    ("apex", "FusedLAMB"): _LAMB_DIFFERS.format(name="apex.optimizers.FusedLAMB"),
    ("timm", "Lamb"): _LAMB_DIFFERS.format(name="timm.optim.Lamb"),
    ("pytorch_lamb", "Lamb"): _SAME_MATH.format(fused="NpuFusedLamb", origin="cybertronai/pytorch-lamb"),
    ("timm", "AdamP"): _SAME_MATH.format(fused="NpuFusedAdamP", origin="clovaai AdamP, which timm's copies"),
    ("adamp", "AdamP"): _SAME_MATH.format(fused="NpuFusedAdamP", origin="clovaai AdamP"),
    ("timm", "RMSpropTF"): _SAME_MATH.format(fused="NpuFusedRMSpropTF", origin="timm RMSpropTF"),
    ("pytorch_pretrained_bert", "BertAdam"): _SAME_MATH.format(fused="NpuFusedBertAdam", origin="pytorch-pretrained-bert BertAdam"),
}
_THIRD_PARTY_CLASSES = tuple({k[1] for k in _THIRD_PARTY})
# Pattern.SCOPE_WORDS: every result of detect hangs on a name or attribute whose canonical name
# (module.canonical: the head import alias resolved) is one of these classes: its last dotted
# part is the class name as written in the scope, or the whole name is an import alias of it
# (the scan adds those aliases to the words); run-time choices are the scope's own assignments.
FusedOptimizer.SCOPE_WORDS = (*_OPTIMIZERS, *_NO_FUSED, *sorted(_THIRD_PARTY_CLASSES))


def _third_party_calls(module: ModuleInfo, stmt: ast.stmt) -> list[tuple[ast.Call, str]]:
    out = []
    for n in fast_walk(stmt):
        if isinstance(n, ast.Call):
            name = module.canonical(n.func) or ""
            parts = name.split(".")
            reason = _THIRD_PARTY.get((parts[0], parts[-1])) if len(parts) > 1 else None
            if reason is not None:
                out.append((n, reason))
    return out


def _unfusable_calls(module: ModuleInfo, stmt: ast.stmt) -> list[ast.Call]:
    return [n for n in fast_walk(stmt) if isinstance(n, ast.Call) and module.canonical(n.func) in _NO_FUSED_NAMES]


def _optimizer_calls(module: ModuleInfo, stmt: ast.stmt) -> list[ast.Call]:
    out = []
    for node in fast_walk(stmt):
        if isinstance(node, ast.Call) and module.canonical(node.func) in _CANONICAL:
            out.append(node)
    return out


class _FileFacts:
    """Facts of the code that may run with an optimizer (see :class:`_Units`) that decide
    whether the fused optimizer's constraints can hold. Built per unit from its ``roots`` and
    merged per site (:meth:`merged`), the site's own function first, so a reason cites the
    nearest occurrence."""

    def __init__(self, module: ModuleInfo, roots: Iterable[ast.AST] = ()) -> None:
        self.sharding: Optional[tuple[int, str]] = None
        self.sharding_nodes: list[ast.AST] = []  # every node naming sharding (the first few)
        self.set_to_none: list[tuple[int, str]] = []  # (line, receiver) of zero_grad(set_to_none=True)
        self.module_zero_grad: list[tuple[int, str]] = []  # receiver.zero_grad() that is not an optimizer's
        # s42: receiver -> "Class.zero_grad (file)" when it is an instance of a plain project class with its own zero_grad
        self.own_zero_grad: dict[str, str] = {}
        self.grad_assign: Optional[int] = None
        self.grad_assigns: list[tuple[int, str]] = []  # (line, receiver) of every `X.grad = ...`
        # (line, call text) of a backward that builds a graph of the grads (`loss.backward(create_graph=True)`)
        self.create_graph: list[tuple[int, str]] = []
        # (line, flag source) of embeddings with sparse grads (`nn.EmbeddingBag(..., sparse=True)`)
        self.sparse: list[tuple[int, str]] = []
        self.flags: dict[int, ast.expr] = {}  # line -> the non-constant set_to_none of a zero_grad there
        self.data_assign: Optional[int] = None
        self.bf16: list[tuple[int, str]] = []  # (line, receiver or "") of bf16 casts / loads
        # accelerate: (line, receiver, dotted args) of `<accelerator>.prepare(...)` / `.prepare_optimizer(...)`
        self.prepared: list[tuple[int, str, list[str]]] = []
        self.zero_grad_calls: list[tuple[int, str]] = []  # an optimizer's `.zero_grad(...)` not given set_to_none=False
        self.returned: set[str] = set()  # dotted names a `return` hands out (`return model, optimizer`)
        self.dtype_casts: list[tuple[int, str, str]] = []  # (line, receiver, name) of `.to(<a dtype held in a name>)`
        # (line, function) of a `.data =` / `.grad =` re-allocation left out of data_assign/grad_assign
        # because it sits in a module-level function nothing in the file calls (:meth:`_Units.tiers`)
        self.uncalled_reallocation: Optional[tuple[int, str]] = None
        # s40: lines of `X.grad is None` / `X.grad is not None` tests (see npufuse.scan.grad_none), and of
        # `zero_grad(set_to_none=False)` calls (grads kept allocated under torch.optim too)
        self.grad_tests: list[int] = []
        self.kept_grads: list[int] = []
        self.data_assigns: list[tuple[int, ast.Attribute]] = []  # every `X.data = ...` (line, target)
        self._bf16_calls: list[ast.Call] = []  # the method casts behind `bf16` entries (s40: tensor temporaries dropped)
        for root in roots:
            for node in fast_walk(root):
                self._visit(module, node)
            if self._bf16_calls:
                temporaries = {id(c) for c in self._bf16_calls if _s40_tensor_temporary(root, c)}
                if temporaries:
                    lines = {c.lineno for c in self._bf16_calls if id(c) in temporaries} - {
                        c.lineno for c in self._bf16_calls if id(c) not in temporaries}
                    self.bf16 = [(ln, r) for ln, r in self.bf16 if ln not in lines]
                self._bf16_calls = []
            if isinstance(root, (ast.FunctionDef, ast.AsyncFunctionDef)):
                # s31: a function that returns its result cast to bf16 hands out a bf16 model under its own name
                # (a pytest fixture ``def model(): m = Net(); return m.to(torch.bfloat16)`` is the test's ``model``):
                # the cast concerns that name, whatever the local was called
                for node in fast_walk(root):
                    if isinstance(node, ast.Return) and _bf16_cast(node.value):
                        self.bf16.append((node.lineno, root.name))

    @classmethod
    def merged(cls, module: ModuleInfo, parts: Iterable["_FileFacts"]) -> "_FileFacts":
        """The facts of ``parts`` together, in their order (the first sharding/assignment wins)."""
        out = cls(module)
        for f in parts:
            out.sharding = out.sharding or f.sharding
            out.sharding_nodes.extend(f.sharding_nodes)
            out.grad_assign = out.grad_assign if out.grad_assign is not None else f.grad_assign
            out.data_assign = out.data_assign if out.data_assign is not None else f.data_assign
            for name in ("set_to_none", "module_zero_grad", "bf16", "prepared", "zero_grad_calls", "dtype_casts", "grad_assigns", "sparse",
                         "create_graph", "grad_tests", "kept_grads", "data_assigns"):
                getattr(out, name).extend(getattr(f, name))
            out.returned |= f.returned
            for recv, own in f.own_zero_grad.items():
                out.own_zero_grad.setdefault(recv, own)
            out.flags.update(f.flags)
        return out

    def _visit(self, module: ModuleInfo, node: ast.AST) -> None:
        if len(self.sharding_nodes) < 16:
            ident = _sharding_identifier(module, node)
            if ident is not None and not _optim_s45.refused_sharding_flag(module, node):  # s45: `if use_fsdp: assert False`
                self.sharding = self.sharding or (getattr(node, "lineno", 0), ident)
                self.sharding_nodes.append(node)
        if isinstance(node, ast.Return) and node.value is not None:
            for n in (node.value.elts if isinstance(node.value, (ast.Tuple, ast.List)) else [node.value]):
                name = dotted(n)
                if name:
                    self.returned.add(name)
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "grad":
            self.grad_tests.append(node.lineno)
        if isinstance(node, ast.Assign) or isinstance(node, ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                # `p.grad /= n` divides in place (the same tensor is set back): only `p.grad = <new>` re-allocates
                # `p._grad = g` is the same re-assignment (hogwild A3C); `self._grad` is an object's own field
                if isinstance(t, ast.Attribute) and isinstance(node, ast.Assign) and (t.attr == "grad" or (
                        t.attr == "_grad" and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")))):
                    if self.grad_assign is None:
                        self.grad_assign = node.lineno
                    self.grad_assigns.append((node.lineno, dotted(t.value) or ""))
                # `self.data = ...` is an object's attribute (a Dataset's tensor), not a parameter's storage
                if (isinstance(t, ast.Attribute) and t.attr == "data" and isinstance(node, ast.Assign)
                        and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))
                        and not _s42_non_tensor_value(module, node.value)):
                    self.data_assigns.append((node.lineno, t))
                    if self.data_assign is None:
                        self.data_assign = node.lineno
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            if isinstance(node, ast.Call):
                self._bf16_kw(node)
            return
        # the receiver as written, not ast.unparse: unparse recurses once per link of a call chain
        # (`x.pow(2).pow(2)...`), so a long chain raised RecursionError, and whether and where it
        # hit the limit depended on the caller's stack depth (a pool worker vs in-process)
        attr, recv = node.func.attr, dotted(node.func.value) or segment(module, node.func.value)
        if attr == "zero_grad":
            flag = keyword(node, "set_to_none", 0)
            explicit_false = isinstance(flag, ast.Constant) and flag.value is False
            optimizer_like = _looks_like_optimizer(recv, module)
            if not explicit_false and optimizer_like:
                self.zero_grad_calls.append((node.lineno, recv))
            elif explicit_false:
                self.kept_grads.append(node.lineno)
            if isinstance(flag, ast.Constant) and flag.value is True:
                self.set_to_none.append((node.lineno, recv))
            elif flag is None and not optimizer_like:
                self.module_zero_grad.append((node.lineno, recv))
                own = _s42_own_zero_grad(module, recv)
                if own:
                    self.own_zero_grad[recv] = own
            elif flag is not None and not explicit_false and not isinstance(flag, ast.Constant):
                self.set_to_none.append((node.lineno, recv))
                self.flags[node.lineno] = flag
        elif attr == "backward" and _builds_grad_graph(module, node, recv):
            self.create_graph.append((node.lineno, f"{recv}.backward"))
        elif attr in ("prepare", "prepare_optimizer") and "accelerator" in recv.split(".")[-1].lower():
            args = [dotted(a.value if isinstance(a, ast.Starred) else a) or "" for a in node.args]
            self.prepared.append((node.lineno, recv, args))
        elif attr == "bfloat16" and not node.args:
            self.bf16.append((node.lineno, recv))
            self._bf16_calls.append(node)
        elif attr == "to" and any(_is_bf16(a) for a in [*node.args, *(k.value for k in node.keywords if k.arg == "dtype")]):
            self.bf16.append((node.lineno, recv))
            self._bf16_calls.append(node)
        elif attr == "to":
            for a in [*node.args[:1], *(k.value for k in node.keywords if k.arg == "dtype")]:
                if isinstance(a, ast.Name):
                    self.dtype_casts.append((node.lineno, recv, a.id))
        self._bf16_kw(node)

    def _bf16_kw(self, node: ast.Call) -> None:
        name = (dotted(node.func) or "").split(".")[-1]
        if name in _SPARSE_GRAD_CALLS:
            flag = keyword(node, "sparse", _SPARSE_GRAD_CALLS[name])
            if flag is not None and not (isinstance(flag, ast.Constant) and not flag.value):
                self.sparse.append((node.lineno, "" if isinstance(flag, ast.Constant) else " ".join(ast.unparse(flag).split())[:60]))
        for k in node.keywords:
            # Lightning's true-half precision keeps the parameters themselves in bf16 ("bf16-mixed"
            # keeps fp32 master weights)
            if k.arg == "precision" and isinstance(k.value, ast.Constant) and k.value.value == "bf16-true":
                self.bf16.append((node.lineno, ""))
        if name in ("from_pretrained", "from_config", "set_default_dtype") or name.endswith("from_pretrained"):
            for k in node.keywords:
                if k.arg in ("torch_dtype", "dtype") and _is_bf16(k.value):
                    self.bf16.append((node.lineno, ""))
            if name == "set_default_dtype" and node.args and _is_bf16(node.args[0]):
                self.bf16.append((node.lineno, ""))


# s40 (HO16a blueberry-llm): `X = G.bfloat16()` inside Muon's Newton-Schulz helper casts a gradient-derived tensor
# (a new tensor; the parameters keep their dtype), not the model. nn.Module has none of these tensor attributes.
# Attributes read as values, and methods called: a model may hold a submodule or a width under other such names
# (`self.norm`, `self.dim`), so those count only as calls of the names nn.Module has no method of.
_TENSOR_ONLY_ATTRS = frozenset(("ndim", "mT", "T", "shape", "grad_fn"))
_TENSOR_ONLY_METHODS = frozenset(("size", "dim", "numel", "view", "reshape"))


def _s40_tensor_temporary(root: ast.AST, cast: ast.Call) -> bool:
    """Is ``cast`` (``R.bfloat16()`` / ``R.to(torch.bfloat16)``) a cast of a tensor into a new tensor, by evidence in
    the innermost function of ``root`` holding it: ``R`` is ``<x>.grad``, or a name that function annotates as a
    Tensor, binds from an expression reading ``.grad``, or reads a tensor-only attribute / method of (``G.ndim``,
    ``G.size(-2)``, ``X.mT``)? Not when the result is stored into ``.data`` (a parameter re-cast in place of its storage)."""
    recv = cast.func.value  # type: ignore[attr-defined]
    if isinstance(recv, ast.Attribute) and recv.attr == "grad":
        return True
    if not isinstance(recv, ast.Name):
        return False
    fns = [n for n in fast_walk(root) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
           and n.lineno <= cast.lineno <= (n.end_lineno or n.lineno)]
    if not fns:
        return False
    fn = max(fns, key=lambda n: n.lineno)
    name = recv.id
    for n in fast_walk(fn):
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "data" for t in n.targets) \
                and any(x is cast for x in fast_walk(n.value)):
            return False
    a = fn.args
    for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
        if arg.arg == name and arg.annotation is not None and (dotted(arg.annotation) or "").split(".")[-1] == "Tensor":
            return True
    for n in fast_walk(fn):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name and n.attr in _TENSOR_ONLY_ATTRS:
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
                and n.func.value.id == name and n.func.attr in _TENSOR_ONLY_METHODS:
            return True
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets) and any(
                isinstance(x, ast.Attribute) and x.attr == "grad" for x in fast_walk(n.value)):
            return True
    return False


def _builds_grad_graph(module: ModuleInfo, node: ast.Call, recv: str) -> bool:
    """Is ``node`` a backward asked to build a graph of the grads: ``t.backward(create_graph=True)``
    (third positional of Tensor.backward), ``torch.autograd.backward(ts, create_graph=True)`` (fourth),
    the flag a literal true or a name every binding in the file gives a literal true? Then autograd
    runs in grad mode and accumulates each grad out of place (AccumulateGrad: ``grad = grad + new``),
    so ``p.grad`` is a new tensor every step. ``torch.autograd.grad(create_graph=True)`` (gradient
    penalties) returns the grads and never touches ``.grad``: not this. A flag handed in
    (``create_graph=is_second_order``, timm's loss scaler) is not judged."""
    flag = keyword(node, "create_graph", 3 if module.canonical(node.func) == "torch.autograd.backward" or recv.endswith("autograd") else 2)
    if isinstance(flag, ast.Constant):
        return bool(flag.value)
    if isinstance(flag, ast.Name):
        values = [v for sc in module.scopes for _st, v in sc.assignments.get(flag.id, [])]
        return bool(values) and all(isinstance(v, ast.Constant) and v.value is True for v in values)
    return False


# calls that give sparse grads with `sparse=<true>` -> the position of that argument
_SPARSE_GRAD_CALLS = {"Embedding": 6, "EmbeddingBag": 6, "embedding": 6, "embedding_bag": 7}


def _is_bf16(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value in ("bfloat16", "bf16"):
        return True
    return (dotted(node) or "").split(".")[-1] in ("bfloat16", "bf16") and not isinstance(node, ast.Constant)


def _bf16_cast(value: Optional[ast.expr]) -> bool:
    """``x.bfloat16()`` / ``x.to(torch.bfloat16)`` / ``x.to(dtype=torch.bfloat16)``."""
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)):
        return False
    if value.func.attr == "bfloat16":
        return not value.args
    return value.func.attr == "to" and any(_is_bf16(a) for a in [*value.args, *(k.value for k in value.keywords if k.arg == "dtype")])


# s42 (sweep42b, MDT / guided-diffusion's ``self.mp_trainer.zero_grad()``): the receiver is built from a plain class
# of the project (``self.mp_trainer = MixedPrecisionTrainer(...)``, no base class) that defines its own zero_grad:
# that is the project's grad handling, not nn.Module.zero_grad, so "sets grads to None on torch >= 2.0" would be
# false. Which class, and where: the near miss names it (what it does to the grads is not read).
def _s42_own_zero_grad(module: ModuleInfo, recv: str) -> Optional[str]:
    cache = module.__dict__.setdefault("_npufuse_s42_own_zero_grad", {})
    if recv not in cache:
        cache[recv] = _s42_own_zero_grad_uncached(module, recv)
    return cache[recv]


def _s42_own_zero_grad_uncached(module: ModuleInfo, recv: str) -> Optional[str]:
    built = {dotted(n.value.func) for n in fast_walk(module.tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
             and any(dotted(t) == recv for t in n.targets)}
    if len(built) != 1 or None in built:
        return None
    name = built.pop() or ""
    cls: Optional[ast.AST] = module.classes.get(name)
    where = module.path
    if cls is None:
        from npufuse.scan import repo_facts

        found = repo_facts.definition(module, name)
        cls, where = (found.node, found.rel) if found is not None else (None, "")
    if not isinstance(cls, ast.ClassDef) or any(not (isinstance(b, ast.Name) and b.id == "object") for b in cls.bases):
        return None
    if not any(isinstance(item, ast.FunctionDef) and item.name == "zero_grad" for item in cls.body):
        return None
    return f"`{cls.name}.zero_grad` ({where})"


def _looks_like_optimizer(recv: str, module: Optional[ModuleInfo] = None) -> bool:
    last = recv.split(".")[-1].lower()
    return "opt" in last or last in ("o", "solver") or (module is not None and recv in _step_receivers(module))


def _step_receivers(module: ModuleInfo) -> frozenset[str]:
    """Receivers of ``X.step()`` / ``X.step(closure)`` in the file. An object with both
    ``zero_grad`` and ``step`` is an optimizer or holds one (``nn.Module`` has no ``step``;
    a scheduler or an environment has no ``zero_grad``), whatever its name: a wrapper's
    ``for op in self.optimizers: op.zero_grad()`` zeroes through the optimizer's own
    zero_grad, whose default on torch_npu's fused classes is set_to_none=False."""
    cached = module.__dict__.get("_npufuse_step_receivers")
    if cached is None:
        found: set[str] = set()
        if ".step(" in module.source:
            for n in fast_walk(module.tree):
                if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "step"
                        and len(n.args) <= 1 and not n.keywords):
                    name = dotted(n.func.value)
                    if name:
                        found.add(name)
        cached = module.__dict__["_npufuse_step_receivers"] = frozenset(found)
    return cached


# Parts of identifiers that name parameter sharding/flattening (`FSDP`, `fully_shard`,
# `DeepSpeedPlugin`, `get_active_deepspeed_plugin`, `DistributedConfig(fsdp_size=...)`), and
# torchrec's model-parallel path: `DistributedModelParallel` shards tables into ShardedTensors,
# `apply_optimizer_in_backward` runs an optimizer per parameter inside backward, and
# `KeyedOptimizerWrapper(params, optim_factory)` builds the optimizer from a factory over a dict of
# sharded/filtered params: none of them steps a flat-buffer fused optimizer over the original tensors.
_TORCHREC_PARTS = ("distributedmodelparallel", "optimizer_in_backward", "keyedoptimizer", "shardedtensor")
_SHARDING_PARTS = ("fsdp", "deepspeed", "fullyshard", "fully_shard", "zero_optimization", "zeroredundancy", "flatparameter",
                   *_TORCHREC_PARTS)


# s37 (fix37): DDP's `gradient_as_bucket_view=True` makes every p.grad a view into DDP's flat
# all-reduce bucket (the reducer assigns `p.grad = bucket_view` at the first backward, and again
# whenever the grad is not that alias). The fused base sizes each grad by its storage (the whole
# bucket) when it combines them and re-points that shared storage, so its combined grad buffer is
# not the params' grads: like FSDP/DeepSpeed, the grads are re-allocated behind the optimizer. The
# order of the wrap and the construction does not matter (both precede the first step). Kept: the
# keyword provably false (False/None/0), plain DDP (its grads are the params' own tensors).
_BUCKET_VIEW = "gradient_as_bucket_view"


def _s37_bucket_view(node: ast.AST) -> Optional[str]:
    """``gradient_as_bucket_view`` when ``node`` sets it to a value that is not provably false: a
    keyword argument (``DDP(m, gradient_as_bucket_view=True)``, ``DistributedDataParallelKwargs(...)``,
    ``DDPStrategy(...)``, ``dict(...)``) or a dict literal's key (``{"gradient_as_bucket_view": flag}``)."""
    values: list[ast.AST] = []
    if isinstance(node, ast.keyword) and node.arg == _BUCKET_VIEW:
        values = [node.value]
    elif isinstance(node, ast.Dict):
        values = [v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant) and k.value == _BUCKET_VIEW]
    for v in values:
        if not (isinstance(v, ast.Constant) and not v.value):
            return _BUCKET_VIEW
    return None


def _sharding_description(ident: str) -> str:
    """How the construct named ``ident`` (a :func:`_sharding_identifier`) takes the grads or params away."""
    if ident == _BUCKET_VIEW:
        return ("DistributedDataParallel with gradient_as_bucket_view set makes every grad a view into its flat "
                "all-reduce bucket and re-assigns it there")
    return "FSDP/DeepSpeed/ZeRO flatten or re-allocate the parameters"


def _sharding_identifier(module: ModuleInfo, node: ast.AST) -> Optional[str]:
    """The identifier if ``node`` names FSDP/DeepSpeed/ZeRO: a name, attribute or keyword
    argument, or a name imported from such a module (``from x.fsdp import Wrapper as W``; the
    import alone does not count: only code using it)."""
    if isinstance(node, ast.Name):
        ident = node.id
    elif isinstance(node, ast.Attribute):
        ident = node.attr
    elif isinstance(node, ast.keyword) and node.arg:
        ident = node.arg
    elif isinstance(node, ast.Dict):
        ident = _BUCKET_VIEW
    else:
        return None
    if ident.startswith("is_") and ident.endswith("_available"):
        return None  # `is_deepspeed_available()` probes an install; it shards nothing
    if ident == _BUCKET_VIEW:
        return _s37_bucket_view(node)
    if isinstance(node, ast.Name) and any(s in module.aliases.get(ident, "").lower() for s in _SHARDING_PARTS):
        return ident
    return ident if ident in _SHARDING or any(s in ident.lower() for s in _SHARDING_PARTS) else None


class _Unit:
    """One outermost function or method (nested definitions included), or module-level code."""

    __slots__ = ("name", "roots", "cls", "test", "args")

    def __init__(self, name: str, roots: list[ast.AST], cls: Optional[str], test: bool, args: list[str]) -> None:
        self.name, self.roots, self.cls, self.test, self.args = name, roots, cls, test, args


_MODULE = "<module>"
# a test class: `TestFoo`, `FooTest`, `ModelTesterMixin`, `AccelerateTestCase`, `test_case` (not `Latest`)
_TEST_CLASS = re.compile(r"Test|(?:^|_)test")


class _Units:
    """Which code of a file may run with an optimizer built in a given function.

    The constraints (no FSDP/DeepSpeed, no bf16, grads never freed or re-assigned...) are about
    everything that touches the optimizer's parameters, which may live in other functions of the
    file: a helper builds the optimizer, ``train()`` calls ``model.zero_grad()``. So the facts
    are file-wide, with one exception: code owned by *other tests*. A test file's test functions
    (``test*``, methods of a class named ``*Test*``, pytest fixtures) are separate programs; an
    FSDP test or a bf16 test next to this one says nothing about this one's optimizer. A site's
    region is therefore the whole file less the test-owned units that neither lead to the site
    (callers) nor follow from its callers (callees, the fixtures a test asks for by name), and
    less the helpers only those other tests reach. :meth:`tiers` orders it nearest first.
    Calls are followed by name: module-level functions and classes (a class: all its methods),
    ``self.``/``cls.`` methods of the same class and its bases in the file, ``Class.method``, and
    plain references (``partial(train, ...)``)."""

    def __init__(self, module: ModuleInfo) -> None:
        self.module = module
        self.units: dict[str, _Unit] = {}
        module_roots: list[ast.AST] = []
        self.classes: dict[str, list[str]] = {}  # class name -> its method units
        self.bases: dict[str, list[str]] = {}
        self._split(module.tree.body, "", None, False, module_roots)
        self.units[_MODULE] = _Unit(_MODULE, module_roots, None, False, [])
        self.functions = {u.name: u.name for u in self.units.values() if u.cls is None and u.name != _MODULE}
        self.edges: dict[str, set[str]] = {name: self._calls(u) for name, u in self.units.items()}
        self.callers: dict[str, set[str]] = {name: set() for name in self.units}
        for name, targets in self.edges.items():
            for t in targets:
                self.callers[t].add(name)
        self._facts: dict[str, _FileFacts] = {}
        self._regions: dict[str, tuple[_FileFacts, _FileFacts, _FileFacts]] = {}
        self.near: dict[str, set[str]] = {}  # unit -> its callers and callees (the second tier's units)

    def _split(self, body: list[ast.stmt], prefix: str, cls: Optional[str], in_test: bool, module_roots: list[ast.AST]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, [])
                self.bases.setdefault(node.name, []).extend(b.id for b in node.bases if isinstance(b, ast.Name))
                self._split(node.body, f"{prefix}{node.name}.", node.name, in_test or bool(_TEST_CLASS.search(node.name)), module_roots)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{node.name}"
                fixture = any("fixture" in (dotted(d.func if isinstance(d, ast.Call) else d) or "") for d in node.decorator_list)
                a = node.args
                args = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                self.units[name] = _Unit(name, [node], cls, in_test or node.name.startswith("test") or fixture, args)
                if cls is not None:
                    self.classes[cls].append(name)
            elif any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in fast_walk(node)):
                # a block holding definitions (`if __name__ == "__main__":`, `if is_available(): class ...`):
                # its definitions are units, its other statements belong where the block is (an `if`'s
                # condition is a check, not code acting on parameters)
                for field in ("iter", "items", "subject"):
                    head = getattr(node, field, None)
                    if head is not None and cls is None:
                        module_roots.extend(head if isinstance(head, list) else [head])
                blocks = [getattr(node, f, None) or [] for f in ("body", "orelse", "finalbody")]
                blocks += [h.body for h in getattr(node, "handlers", None) or []]
                blocks += [c.body for c in getattr(node, "cases", None) or []]
                for block in blocks:
                    self._split(block, prefix, cls, in_test, module_roots)
            elif cls is None:
                module_roots.append(node)

    def _methods(self, cls: str, attr: str, seen: Optional[set[str]] = None) -> list[str]:
        """``cls.attr`` as units: the class's own method, else its bases' (in this file)."""
        own = [m for m in self.classes.get(cls, []) if m.rsplit(".", 1)[-1] == attr]
        if own:
            return own
        seen = seen or set()
        out: list[str] = []
        for base in self.bases.get(cls, []):
            if base not in seen:
                seen.add(base)
                out += self._methods(base, attr, seen)
        return out

    def _calls(self, unit: _Unit) -> set[str]:
        out: set[str] = set()
        for root in unit.roots:
            for node in fast_walk(root):
                if isinstance(node, ast.Name):
                    if node.id in self.functions:
                        out.add(self.functions[node.id])
                    elif node.id in self.classes:
                        out.update(self.classes[node.id])
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    owner = node.value.id
                    if owner in ("self", "cls") and unit.cls is not None:
                        out.update(self._methods(unit.cls, node.attr))
                    elif owner in self.classes:
                        out.update(self._methods(owner, node.attr))
        if unit.test:  # fixtures a test asks for by parameter name
            for arg in unit.args:
                if arg in self.functions:
                    out.add(self.functions[arg])
                if unit.cls is not None:
                    out.update(self._methods(unit.cls, arg))
        out.discard(unit.name)
        return out

    def unit_of(self, qualname: str) -> str:
        """The unit holding a scope (``outer.inner`` -> ``outer``)."""
        name = qualname
        while name not in self.units and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in self.units else _MODULE

    def tiers(self, qualname: str) -> tuple[_FileFacts, _FileFacts, _FileFacts]:
        """A site's facts in three tiers, nearest first: its own unit; its callers and callees
        (the code that surely runs with it); the rest of the file that is not another test's."""
        own = self.unit_of(qualname)
        cached = self._regions.get(own)
        if cached is not None:
            return cached
        roots, todo = {own}, [own]
        while todo:
            for c in self.callers[todo.pop()]:
                if c not in roots:
                    roots.add(c)
                    todo.append(c)
        u = self.units[own]
        if u.cls is not None and not u.test:  # a model/trainer class: its methods work together
            roots.update(self.classes.get(u.cls, []))
        mine, todo = set(roots), list(roots)
        while todo:
            for c in self.edges[todo.pop()]:
                if c not in mine:
                    mine.add(c)
                    todo.append(c)
        self.near[own] = mine - {own}
        # helpers only other tests reach (a `_deepspeed_zero3()` context of the ZeRO tests) are theirs
        others = [n for n, x in self.units.items() if x.test and n not in mine]
        theirs = self._closure(others)
        entries = [n for n, x in self.units.items() if not x.test and n not in mine and not self.callers[n]]
        shared = self._closure(entries)
        rest = sorted(n for n, x in self.units.items() if n not in mine and not x.test and (n not in theirs or n in shared))
        third = _FileFacts.merged(self.module, (self._unit_facts(n) for n in rest))
        # the optimizer belongs to this file's own program (built at module level or in a function
        # the module-level code reaches, `if __name__ == "__main__": main()`): a module-level function
        # that nothing in the file calls or names (Chinese-CLIP's unused `convert_models_to_fp32(model)`:
        # `p.data = p.data.float()`) cannot touch its parameters; that re-allocation is a risk (other
        # files may call the helper on their own models), not a refusal. An optimizer built in a
        # library function (`def build(model)`, called from elsewhere) may meet any of them.
        script = own == _MODULE or own in self._closure([_MODULE])
        uncalled = {n for n in rest if self.units[n].cls is None and n != _MODULE and not self.callers[n]} if script else set()
        if uncalled and (third.data_assign is not None or third.grad_assign is not None):
            kept = _FileFacts.merged(self.module, (self._unit_facts(n) for n in rest if n not in uncalled))
            lines = [(ln, n) for n in sorted(uncalled) for ln in (self._unit_facts(n).data_assign, self._unit_facts(n).grad_assign) if ln is not None]
            third.data_assign, third.grad_assign = kept.data_assign, kept.grad_assign
            third.uncalled_reallocation = min(lines) if lines else None
        out = (self._unit_facts(own),
               _FileFacts.merged(self.module, (self._unit_facts(n) for n in sorted(mine - {own}))),
               third)
        self._regions[own] = out
        return out

    def _closure(self, start: Iterable[str]) -> set[str]:
        seen, todo = set(start), list(start)
        while todo:
            for c in self.edges[todo.pop()]:
                if c not in seen:
                    seen.add(c)
                    todo.append(c)
        return seen

    def facts(self, qualname: str) -> _FileFacts:
        """All of a site's facts merged, nearest first."""
        return _FileFacts.merged(self.module, self.tiers(qualname))

    def _unit_facts(self, name: str) -> _FileFacts:
        f = self._facts.get(name)
        if f is None:
            f = self._facts[name] = _FileFacts(self.module, self.units[name].roots)
        return f


def _units(module: ModuleInfo) -> _Units:
    # cached on the module like _relevant: detect runs once per scope of the file
    cached = module.__dict__.get("_npufuse_optim_units")
    if cached is None:
        cached = module.__dict__["_npufuse_optim_units"] = _Units(module)
    return cached


def _model_of(module: ModuleInfo, scope: Scope, node: ast.AST, line: int, depth: int = 0) -> Optional[str]:
    """``M`` of the first ``M.parameters()`` / ``M.named_parameters()`` the params argument is built from."""
    if depth > 6:
        return None
    for n in fast_walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("parameters", "named_parameters"):
            base = dotted(n.func.value)
            if base is not None:
                return base
    for n in fast_walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            value = scope.definition(n.id, line)
            if value is not None:
                found = _model_of(module, scope, value, getattr(value, "lineno", line), depth + 1)
                if found is not None:
                    return found
    return None


# A tensor dtype the fused classes take (bf16 raises TypeError at the first step); str(dtype): the
# file need not import torch itself (`from torch.optim import AdamW`). ``{t}``: the tensor.
# ... and a plain tensor or nn.Parameter: FSDP2's DTensor params (fully_shard), FSDP1's FlatParameter and other
# tensor subclasses have storage the fused class cannot combine and re-point (spec 10 / 13.11; audit34: blt's
# optimizer is built after fully_shard, with fp32 sharded params the dtype test let through)
_FUSABLE_DTYPE = "str({t}.dtype) in ('torch.float32', 'torch.float16') and type({t}).__name__ in ('Tensor', 'Parameter')"

# The guard of a params list (or tuple) that may hold param-group dicts, applied to that list: its
# first tensor, or None (the original optimizer runs) when a tensor that can get a grad is not
# fp32/fp16 (s33: the dtype is a run-time fact). A group whose params are not a list/tuple (a
# generator) is never read: reading it would consume it.
_GROUP_TENSORS = ("((g,) if not isinstance(g, dict) else g['params'] if isinstance(g.get('params'), (list, tuple)) "
                  "else ())")
_GROUPS_GUARD = (f"(lambda gs: next((t for g in gs for t in {_GROUP_TENSORS}), None) if all("
                 f"{_FUSABLE_DTYPE.format(t='t')} for g in gs for t in {_GROUP_TENSORS} "
                 "if getattr(t, 'requires_grad', False)) and len({t.device for g in gs for t in "
                 f"{_GROUP_TENSORS} if getattr(t, 'requires_grad', False)}}) <= 1 else None)")

# The fused classes combine each dtype's params into ONE flat buffer (spec 10: npu_combine_tensors), which
# lives on one device: a model split over devices in one process (naive pipeline / device_map="auto":
# minimal-llama's finetune_pp, moeopt36) cannot be combined; the original optimizer runs there.
# ``{ts}``: an iterable expression of the tensors that can get a grad (read again: a list or a fresh generator).
_ONE_DEVICE = "len({{_t.device for _t in {ts}}}) <= 1"


def _guard(module: ModuleInfo, scope: Scope, call: ast.Call, stmt: ast.stmt) -> tuple[Optional[str], str]:
    params = keyword(call, "params", 0)
    if params is None:
        return None, "the optimizer gets no params argument npufuse can read"
    model = _model_of(module, scope, params, stmt.lineno) or _model_via_helper(module, scope, params)
    if model is not None:
        # a fresh generator: the user's own iterator is never touched
        return f"next({model}.parameters(), None)", ""
    if isinstance(params, ast.Name):
        # materialise the opaque iterable once: both branches then get the same list (torch.optim
        # lists it too). It may hold param-group dicts: their first listed tensor is the guard; a
        # group's generator is never touched (no tensor: the original runs)
        n = params.id
        # (a lambda: an assignment expression may not be a comprehension's iterable)
        return f"{_GROUPS_GUARD}({n} := list({n}))", ""
    first = _first_group_params(params)
    if first is not None:
        # ``[{"params": decay, ...}, ...]`` of opaque names: the first group's list is materialised
        # once (torch.optim lists each group's params too) and its first tensor is the guard. s43
        # (audit43b, quip-sharp's ``[{"params": susv_params, ..}, {"params": params, ..}]``): when every
        # group's params is a plain name, every group is materialised and dtype / device checked (a bf16
        # tensor of the second group made the fused class raise); otherwise the first group, as before
        names = _all_group_param_names(params) or [first]
        listed = f"{first} := list({first})" if len(names) == 1 else \
            "[" + ", ".join(f"*({n} := list({n}))" for n in names) + "]"
        return (f"(lambda ts: next(iter(ts), None) if all({_FUSABLE_DTYPE.format(t='t')} for t in ts "
                f"if getattr(t, 'requires_grad', False)) and {_ONE_DEVICE.format(ts='(t for t in ts if getattr(t, ' + repr('requires_grad') + ', False))')} "
                f"else None)({listed})"), ""
    if (_side_effect_free(params) or _pure_listing_call(module, params)) and _list_valued(module, scope, params, stmt.lineno):
        # a list (or tuple) is read, not consumed: the guard iterates it afresh, and the
        # optimizer still gets every element. Its first element may be a param-group dict.
        e = segment(module, params)
        return f"{_GROUPS_GUARD}({e})", ""
    handed = _module_handed_to_helper(module, scope, params)
    if handed is None:
        # ``[{"params": helper(M, ...)}, {"params": helper(M, ...)}]``: the groups' helpers may be
        # generators (lightweight-pose's get_parameters_conv yields from M.modules()); the guard reads
        # the module handed to the first group's helper, never the helpers' results
        group = _first_group_value(params)
        if group is not None:
            handed = _module_handed_to_helper(module, scope, group, local_ok=True)
    if handed is not None:
        # `get_parameters(model)` of another file: its result is never read by the guard (it may be a
        # generator); the guard reads a fresh generator of the module handed to it, checked to be an
        # nn.Module at run time, and the helper runs once, in the branch taken
        return f"next({handed}.parameters(), None) if isinstance({handed}, torch.nn.Module) else None", ""
    listed_by = _fused_optimizer_s51b.list_method_receiver(module, params)
    if listed_by is not None:
        # s51b: `model.grouped_parameters(lr=lr)`, a method of the repository returning a list comprehension: the
        # guard reads the receiver's fresh parameters() generator, the method runs once, in the branch taken
        return f"next({listed_by}.parameters(), None) if {_fused_optimizer_s51b.module_test(listed_by)} else None", ""
    return None, (f"the params come from `{segment(module, params)[:50]}`, which may be a one-shot iterator (a generator): "
                  "reading a tensor from it for the guard would consume it")


def _first_group_value(params: ast.expr) -> Optional[ast.expr]:
    """The first group's ``"params"`` value of an inline ``[{"params": ..., ...}, ...]``."""
    if not (isinstance(params, (ast.List, ast.Tuple)) and params.elts and isinstance(params.elts[0], ast.Dict)):
        return None
    return next((v for k, v in zip(params.elts[0].keys, params.elts[0].values)
                 if isinstance(k, ast.Constant) and k.value == "params"), None)


def _module_handed_to_helper(module: ModuleInfo, scope: Scope, params: ast.expr, local_ok: bool = False) -> Optional[str]:
    """``M`` of ``helper(M, ...)`` where ``helper`` is not a function of this file (imported: its
    code is elsewhere; with ``local_ok`` any helper, for param groups whose helpers the guard never
    reads) and ``M`` a plain name or attribute path, in a file where ``torch`` names the
    torch module (the guard's run-time check ``isinstance(M, torch.nn.Module)`` needs it)."""
    if not (isinstance(params, ast.Call) and params.args and not isinstance(params.args[0], ast.Starred)):
        return None
    name = dotted(params.func) or ""
    if not name or (not local_ok and _local_function(module, scope, name) is not None) or name in _LIST_BUILDERS or module.aliases.get("torch") != "torch":
        return None
    if name.split(".")[0] in ("self", "cls") or (module.canonical(params.func) or "").startswith(("torch.", "itertools.", "builtins.")):
        return None  # a method of this object (its code is this file's) or a library call of known meaning
    return dotted(params.args[0])


_LIST_BUILDERS = ("list", "sorted", "tuple")


def _list_valued(module: ModuleInfo, scope: Scope, node: ast.AST, line: int, depth: int = 0) -> bool:
    """Is ``node`` provably a list or tuple (re-iterable, never consumed by reading it) by
    dataflow: a list/tuple literal or comprehension, ``list(...)``/``sorted(...)``/``tuple(...)``,
    an element of a literal tuple/list of lists (``g = [], [], []`` then ``g[2]``), a name last
    bound to one of those, or a call of a function of this file every ``return`` of which
    returns one. Names and attribute names are not evidence."""
    if depth > 4:
        return False
    if isinstance(node, (ast.List, ast.Tuple, ast.ListComp)):
        return True
    if isinstance(node, ast.BinOp):
        # `[latent] + noises`: list.__add__/tuple.__add__ take only their own type (a generator on
        # the right raises TypeError), so a list/tuple on the left makes a list/tuple or nothing;
        # `[p] * n` repeats one. An unknown left operand may define its own `+`: not evidence
        if isinstance(node.op, ast.Add):
            return _list_valued(module, scope, node.left, line, depth + 1)
        if isinstance(node.op, ast.Mult):
            return any(_list_valued(module, scope, side, line, depth + 1) for side in (node.left, node.right))
        return False
    if isinstance(node, ast.Call):
        name = dotted(node.func) or ""
        if name in _LIST_BUILDERS and name not in module.aliases and name not in module.functions:
            return True
        fn = _local_function(module, scope, name)
        if fn is None:
            return _pure_listing_call(module, node)
        rets = [n for n in fast_walk(fn) if isinstance(n, ast.Return)]
        fscope = next((s for s in module.scopes if s.node is fn), None)
        return bool(rets) and fscope is not None and all(
            r.value is not None and _list_valued(module, fscope, r.value, r.lineno, depth + 1) for r in rets)
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int):
        base = scope.definition(node.value.id, line) if isinstance(node.value, ast.Name) else None
        if isinstance(base, (ast.Tuple, ast.List)) and -len(base.elts) <= node.slice.value < len(base.elts):
            return _list_valued(module, scope, base.elts[node.slice.value], line, depth + 1)
        if isinstance(base, ast.ListComp):  # [[] for _ in range(3)]
            return _list_valued(module, scope, base.elt, line, depth + 1)
        return False
    if isinstance(node, ast.Name):
        value = scope.definition(node.id, line)
        return value is not None and _list_valued(module, scope, value, getattr(value, "lineno", line), depth + 1)
    if isinstance(node, ast.Attribute):
        return _self_attribute_list(module, scope, node, depth)
    return False


def _pure_listing_call(module: ModuleInfo, node: ast.AST) -> bool:
    """``M.method()`` (no arguments, ``M`` a name or attribute path) where every definition of ``method`` in
    the repository only builds fresh lists from its object's parameters and returns one
    (:func:`npufuse.scan.repo_facts.pure_list_method`; ReChorus' ``model.customize_parameters()``): a list,
    and calling it again for the guard gives the same tensors with no other effect."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args and not node.keywords
            and _side_effect_free(node.func.value) and dotted(node.func.value)):
        return False
    from npufuse.scan import repo_facts

    return repo_facts.pure_list_method(module, node.func.attr)


def _local_function(module: ModuleInfo, scope: Scope, name: str) -> Optional[ast.AST]:
    """The def of ``f`` (a module-level function) or ``self.f`` (a method of the site's class)."""
    if name in module.functions:
        return module.functions[name]
    if name.startswith("self.") and name.count(".") == 1 and "." in scope.qualname:
        cls = module.classes.get(scope.qualname.split(".")[0])
        for st in cls.body if cls is not None else ():
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)) and st.name == name[5:]:
                return st
    return None


def _model_via_helper(module: ModuleInfo, scope: Scope, params: ast.expr) -> Optional[str]:
    """``M`` of ``helper(M, ...)`` where ``helper`` (a function or method of this file) builds the
    params from ``<its parameter>.parameters()`` / ``.named_parameters()`` / ``.modules()``:
    the guard then reads a fresh ``M.parameters()`` and the helper still runs once, in the
    branch taken (its result is never read twice, list or generator)."""
    if not isinstance(params, ast.Call):
        return None
    fn = _local_function(module, scope, dotted(params.func) or "")
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    own_method = bool(names) and names[0] == "self" and isinstance(params.func, ast.Attribute) and dotted(params.func.value) == "self"
    if names and names[0] in ("self", "cls") and isinstance(params.func, ast.Attribute):
        names = names[1:]
    bound = {n: dotted(a) for n, a in zip(names, params.args)} | {k.arg: dotted(k.value) for k in params.keywords if k.arg}
    if own_method:
        # `self.param_groups(wd)`: a method of the site's own class builds them from its own
        # modules (`self.named_parameters()`, `self.model.parameters()`): the same object here
        bound["self"] = "self"
    for n in fast_walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("parameters", "named_parameters", "modules", "named_modules") \
                and isinstance(n.func.value, ast.Name) and bound.get(n.func.value.id):
            return bound[n.func.value.id]
    return None


def _parents(module: ModuleInfo) -> dict[int, ast.AST]:
    """id(child) -> parent for the whole file (built once per module, only where sharding is named)."""
    cached = module.__dict__.get("_npufuse_optim_parents")
    if cached is None:
        cached = {}
        for parent in fast_walk(module.tree):
            for child in ast.iter_child_nodes(parent):
                cached[id(child)] = parent
        module.__dict__["_npufuse_optim_parents"] = cached
    return cached


def _consequence_of_sharding(module: ModuleInfo, parents: dict[int, ast.AST], node: ast.AST) -> bool:
    """Is ``node`` a check for sharding or code run only when it is on, not a cause of it:
    inside ``isinstance(...)``, or in the body of an ``if`` whose test is such a check
    (``if isinstance(fabric.strategy, DeepSpeedStrategy): <consolidate the checkpoint>``)?"""
    child, parent = node, parents.get(id(node))
    while parent is not None:
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "isinstance":
            return True
        if isinstance(parent, ast.If) and any(child is b for b in parent.body) and any(
                isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "isinstance"
                and any(_sharding_identifier(module, a) is not None for a in n.args[1:]) for n in fast_walk(parent.test)):
            return True
        child, parent = parent, parents.get(id(parent))
    return False


def _sharding_condition(module: ModuleInfo, scope: Scope, stmt: ast.stmt, nodes: list[ast.AST]) -> Optional[tuple[str, bool, str]]:
    """(test source, sharding in its true arm?, where) when every node naming FSDP/DeepSpeed/ZeRO
    sits in one arm of the same ``if`` / conditional expression (``strategy = DeepSpeedStrategy(...)
    if devices > 1 else "auto"``) and that test can be evaluated again at the optimizer's line
    with the same value: side-effect free, and every name in it a parameter of the site's function
    or a module-level name, never re-assigned in that function."""
    if not nodes:
        return None
    parents = _parents(module)
    arms: set[tuple[int, bool]] = set()
    tests: dict[int, ast.expr] = {}
    for node in nodes:
        if _consequence_of_sharding(module, parents, node) or _fused_optimizer_s51a.option_read(node, parents):
            continue  # s51: the option read in a test / turned off by a keyword is no cause of sharding
        child, parent = node, parents.get(id(node))
        while parent is not None and not (isinstance(parent, (ast.If, ast.IfExp)) and child is not parent.test):
            child, parent = parent, parents.get(id(parent))
        if parent is None:
            return None
        in_body = child is parent.body if isinstance(parent, ast.IfExp) else any(child is b for b in parent.body)
        arms.add((id(parent), in_body))
        tests[id(parent)] = parent.test  # type: ignore[attr-defined]
    if len(arms) != 1:
        return None
    ((key, in_body),) = arms
    test = tests[key]
    if not _side_effect_free(test):
        return None
    fn = scope.node
    params_ = set()
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = fn.args
        params_ = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    module_scope = next((s for s in module.scopes if s.qualname == "<module>"), None)
    if _fused_optimizer_s51a.self_test_holds(module, scope, stmt, test):  # s51: `self.cfg.use_fsdp` in __init__
        return " ".join(segment(module, test).split()), in_body, f"line {test.lineno}"
    # s51: a parameter of the site's function is the test's value only where the test is in that function
    own = fn is not None and fn.lineno <= test.lineno <= (getattr(fn, "end_lineno", None) or fn.lineno)
    for n in fast_walk(test):
        if not isinstance(n, ast.Name):
            continue
        if scope.qualname != "<module>" and n.id in scope.assignments:
            return None  # re-bound in the function: the value at the site may differ
        if n.id in params_ and own:
            continue
        if module_scope is None or n.id not in module_scope.assignments:
            return None
    text = " ".join(segment(module, test).split())
    return text, in_body, f"line {test.lineno}"


def _first_group_params(params: ast.expr) -> Optional[str]:
    """``a`` of an inline ``[{"params": a, ...}, ...]`` (the first group's params, a plain name)."""
    if not (isinstance(params, (ast.List, ast.Tuple)) and params.elts and isinstance(params.elts[0], ast.Dict)):
        return None
    for k, v in zip(params.elts[0].keys, params.elts[0].values):
        if isinstance(k, ast.Constant) and k.value == "params" and isinstance(v, ast.Name):
            return v.id
    return None


def _all_group_param_names(params: ast.expr) -> list[str]:
    """The distinct plain names every group of an inline ``[{"params": a, ..}, {"params": b, ..}]`` takes its
    params from, in order; empty when some group is not a dict or its params is not a plain name."""
    names: list[str] = []
    for group in params.elts if isinstance(params, (ast.List, ast.Tuple)) else ():
        if not isinstance(group, ast.Dict):
            return []
        value = next((v for k, v in zip(group.keys, group.values) if isinstance(k, ast.Constant) and k.value == "params"), None)
        if not isinstance(value, ast.Name):
            return []
        if value.id not in names:
            names.append(value.id)
    return names


def _target_names(stmt: ast.stmt) -> set[str]:
    """Dotted names the statement binds (``opt``, ``self.optimizer``, each of ``a, b = ...``)."""
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
    out: set[str] = set()
    for t in targets:
        for n in ([*t.elts] if isinstance(t, (ast.Tuple, ast.List)) else [t]):
            name = dotted(n)
            if name:
                out.add(name)
    return out


def _accelerate_prepared(stmt: ast.stmt, own: _FileFacts, near: _FileFacts) -> Optional[tuple[int, str]]:
    """(line, receiver) of an accelerate ``prepare`` that takes this optimizer: in the site's own
    function, by the name the statement binds; in its callers/callees (``near``), by that name
    only when the function returns it (callers unpack a helper's result under the same name, as
    accelerate's tests do), or, for ``return AdamW(...)``, any optimizer-looking name."""
    names = _target_names(stmt)
    for ln, recv, args in own.prepared:
        if names & set(args):
            return ln, recv
    handed = names & own.returned if names else set()
    for ln, recv, args in near.prepared:
        if (handed & set(args)) or (isinstance(stmt, ast.Return) and any(_looks_like_optimizer(a) for a in args if a)):
            return ln, recv
    return None


# --- an optimizer class chosen at run time and built in the same function (issue 14 class 5) -------
# diffusers' `optimizer_cls = bnb.optim.AdamW8bit` / `else: optimizer_cls = torch.optim.AdamW` then
# `optimizer_cls(unet.parameters(), ...)`; dlrm's `opts = {"sgd": torch.optim.SGD, ...}` then
# `opts[args.optimizer](parameters, lr=...)`; `cls = DummyOptim if ds else AdamW`. The construction
# is the site: its fused branch runs only when the class chosen at run time IS the one torch.optim
# class among the choices (the guard tests identity), so every other choice keeps its own class.

def _chosen_construction(module: ModuleInfo, scope: Scope, stmt: ast.stmt
                         ) -> Optional[Union[NearMiss, tuple[ast.Call, str, str]]]:
    """(call, torch.optim class, run-time test) of a construction through a name or a dict entry
    bound in this scope, before the call, only to class expressions (``if``/``else`` arms, a
    conditional expression, a dict literal never mutated) among which exactly one fusable
    torch.optim class is; a NearMiss when torch.optim classes are among the choices but that test
    cannot be written; None when no torch.optim class is chosen here."""
    for call in fast_walk(stmt):
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        key: Optional[ast.expr] = None
        if isinstance(func, ast.Subscript) and isinstance(func.value, ast.Name):
            name, key = func.value.id, func.slice
        elif isinstance(func, ast.Name):
            name = func.id
        else:
            continue
        bound = [v for st, v in scope.assignments.get(name, []) if st.lineno < stmt.lineno]
        if not bound:
            continue
        choices: list[ast.expr] = []
        todo = list(bound)
        while todo:
            v = todo.pop()
            if isinstance(v, ast.IfExp):
                todo += [v.body, v.orelse]
            elif isinstance(v, ast.BoolOp):
                todo += v.values
            elif isinstance(v, ast.Dict) and key is not None:
                choices += [x for x in v.values if x is not None]
                if any(k is None for k in v.keys):
                    choices.append(v)  # `{**other}`: entries npufuse does not see
            else:
                choices.append(v)
        kinds = {_CANONICAL.get(module.canonical(c) or "") for c in choices if isinstance(c, (ast.Name, ast.Attribute))} - {None}
        if not kinds:
            continue
        line, end = stmt.lineno, stmt.end_lineno or stmt.lineno
        where = f"`{segment(module, func)}` (bound at line {min(getattr(b, 'lineno', line) for b in bound)})"

        def refuse(why: str) -> NearMiss:
            return NearMiss(_ID, scope.qualname, line, end,
                            f"the optimizer class is chosen at run time through {where} and {why}: torch_npu.optim."
                            f"{_OPTIMIZERS[sorted(kinds)[0]][0]} could take the place of torch.optim.{sorted(kinds)[0]} by hand "
                            "once the constraints hold (no FSDP/DeepSpeed-sharded or DTensor params, no set_to_none, fp32/fp16)")
        if key is not None and not _side_effect_free(key):
            return refuse("the dict key calls code (the guard would evaluate it a second time)")
        if len(kinds) > 1:
            return refuse(f"several torch.optim classes are among the choices ({', '.join(sorted(kinds))}), each with its "
                          "own arguments")
        (kind,) = kinds
        pick = next(c for c in choices if isinstance(c, (ast.Name, ast.Attribute)) and _CANONICAL.get(module.canonical(c) or "") == kind)
        text = dotted(pick) or ""
        root = text.split(".")[0]
        if not text or root not in module.aliases or root in scope.assignments or root in scope.args:
            return refuse(f"`{segment(module, pick)}` is not a module-level name the guard could test the choice against")
        if name in scope.args or any(isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.value, ast.Name) and n.value.id == name
                                     and (isinstance(n.ctx, ast.Store) or (isinstance(n, ast.Attribute) and n.attr in
                                          ("update", "setdefault", "__setitem__", "pop", "clear")))
                                     for n in fast_walk(scope.node)):
            return refuse("its value may change outside these bindings")
        if key is not None and not _side_effect_free(key):
            return refuse("the dict key calls code (the guard would evaluate it a second time)")
        return call, kind, f"{segment(module, func)} is {text}"
    return None


def _class_chosen_at_run_time(module: ModuleInfo, scope: Scope, stmt: ast.stmt) -> Optional[NearMiss]:
    """``cls = AdamW if cond else DummyOptim; opt = cls(...)``: a torch optimizer built through a
    class picked at run time. Named as a near miss, not swapped: the choice is elsewhere."""
    for node in fast_walk(stmt):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        value = scope.definition(node.func.id, stmt.lineno)
        if not isinstance(value, (ast.IfExp, ast.BoolOp)):
            continue
        named = [module.canonical(n) for n in fast_walk(value) if isinstance(n, (ast.Name, ast.Attribute))]
        hits = [_CANONICAL[k] for k in named if k in _CANONICAL]
        if not hits:
            continue
        facts = _units(module).facts(scope.qualname)
        also = (f"; the code also uses {'DDP bucket-view grads' if facts.sharding[1] == _BUCKET_VIEW else 'FSDP/DeepSpeed/ZeRO'} "
                f"(`{facts.sharding[1]}` at line {facts.sharding[0]})"
                if facts.sharding is not None else "")
        choice = " ".join(segment(module, value).split())
        return NearMiss(_ID, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno,
                        f"the optimizer class is chosen at run time (`{node.func.id} = {choice[:80]}`): npufuse swaps a "
                        f"torch.optim class named at the call only; torch.optim.{hits[0]} there would become "
                        f"torch_npu.optim.{_OPTIMIZERS[hits[0]][0]} by hand{also}")
    return None


def _class_as_value(module: ModuleInfo, scope: Scope, stmt: ast.stmt) -> Optional[NearMiss]:
    """``{"Adam": torch.optim.Adam, ...}`` / ``factories = [torch.optim.AdamW]`` / ``cls = torch.optim.SGD``:
    a torch.optim class handed around as a value (a registry or factory); the construction is
    elsewhere, with arguments npufuse does not see at this line."""
    value = getattr(stmt, "value", None)
    if value is None:
        return None
    targets = getattr(stmt, "targets", None)
    if isinstance(scope.node, ast.Module) and targets and isinstance(targets[0], ast.Name) and targets[0].id in module.assigned_aliases:
        # s42 review: a module-level alias (``Optim = torch.optim.AdamW``, bound nowhere else in the file) is the class
        # itself wherever it is called (ModuleInfo.canonical): each construction reports itself, candidate or near miss
        return None
    items: list[ast.AST] = [value]
    if isinstance(value, ast.Dict):
        items = list(value.values)
    elif isinstance(value, (ast.List, ast.Tuple, ast.Set)):
        items = list(value.elts)
    for item in items:
        kind = _CANONICAL.get(module.canonical(item) or "") if isinstance(item, (ast.Name, ast.Attribute)) else None
        built = _called_later(scope, stmt) if kind is not None else None
        if built is not None and isinstance(scope.node, ast.Module) and _fused_optimizer_s51b.module_class_kinds(module, built[0], _OPTIMIZERS):
            return None  # s51b: each construction through the module-level name reports itself (_s34_bound_lookup)
        if built is not None and _built_statement(module, scope, built[1]) is not None:
            return None  # the construction reports itself (_chosen_construction): candidate or near miss
        if built is not None:
            # diffusers' `optimizer_cls = torch.optim.AdamW` (else bnb's AdamW8bit), dlrm's
            # `opts = {"sgd": torch.optim.SGD, ...}; opts[args.optimizer](...)`: built right here
            name, at = built
            return NearMiss(_ID, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno,
                            f"torch.optim.{kind} is bound to `{name}` (line {stmt.lineno}) and the optimizer is built "
                            f"through `{name}` at line {at}, the class chosen at run time: npufuse swaps a torch.optim "
                            f"class named at the construction only; torch_npu.optim.{_OPTIMIZERS[kind][0]} could take its "
                            "place by hand once the constraints hold (no FSDP/DeepSpeed-sharded or DTensor params, no "
                            "set_to_none, fp32/fp16)")
        if kind is not None and _s34_read_by_later_lookup(module, scope, stmt):
            return None  # `cls = table[name]` then `cls(...)` later in this scope: that construction reports itself
        if kind is not None:
            return NearMiss(_ID, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno,
                            f"torch.optim.{kind} is handed around as a value (a registry or factory) and the optimizer is "
                            "built elsewhere with arguments npufuse does not see here: npufuse swaps a class named at the "
                            f"construction only; torch_npu.optim.{_OPTIMIZERS[kind][0]} could take its place by hand once the "
                            "constraints hold (no FSDP/DeepSpeed-sharded or DTensor params, no set_to_none, fp32/fp16)")
    return None


def _reallocated_before(module: ModuleInfo, scope: Scope, stmt: ast.stmt, tiers: tuple[_FileFacts, _FileFacts, _FileFacts]
                        ) -> Optional[tuple[tuple[_FileFacts, _FileFacts, _FileFacts], list[tuple[str, int, int]]]]:
    """Chinese-CLIP's ``main()`` calls ``convert_models_to_fp32(model)`` (``p.data = p.data.float()``)
    before it builds the optimizer: harmless, the fused class reads the parameters at construction
    and at its first step. The second tier without such helpers: module-level functions whose only
    calls are in the site's own function, each before the construction and in no loop that also
    holds it, called by no other code of the file. (tiers, [(helper, re-allocation line, call line)])
    or None when nothing changes."""
    if tiers[1].data_assign is None and tiers[1].grad_assign is None:
        return None
    units = _units(module)
    own = units.unit_of(scope.qualname)
    if own != scope.qualname or own not in units.near:
        return None
    fn_node = units.units[own].roots[0] if units.units[own].roots else None
    if not isinstance(fn_node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    loops = [n for n in fast_walk(fn_node) if isinstance(n, (ast.For, ast.AsyncFor, ast.While))
             and n.lineno <= stmt.lineno <= (n.end_lineno or n.lineno)]
    harmless: list[tuple[str, int, int]] = []
    for name in sorted(units.near[own]):
        u = units.units[name]
        facts = units._unit_facts(name)
        line = facts.data_assign if facts.data_assign is not None else facts.grad_assign
        if line is None or u.cls is not None or units.callers[name] != {own}:
            continue
        refs = [n for n in fast_walk(fn_node) if isinstance(n, ast.Name) and n.id == name]
        calls = [n for n in fast_walk(fn_node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]
        if not calls or len(refs) != len(calls):
            continue  # handed on by name (partial, a callback): when it runs is unknown
        if any(c.lineno >= stmt.lineno or any(lp.lineno <= c.lineno <= (lp.end_lineno or lp.lineno) for lp in loops) for c in calls):
            continue
        harmless.append((name, line, max(c.lineno for c in calls)))
    if not harmless:
        return None
    skip = {h[0] for h in harmless}
    second = _FileFacts.merged(module, (units._unit_facts(n) for n in sorted(units.near[own] - skip)))
    if second.data_assign == tiers[1].data_assign and second.grad_assign == tiers[1].grad_assign:
        return None
    # only the re-allocation facts change: the other facts of the skipped helpers still count
    kept = _FileFacts.merged(module, [tiers[1]])
    kept.data_assign, kept.grad_assign = second.data_assign, second.grad_assign
    return (tiers[0], kept, tiers[2]), harmless


def _built_statement(module: ModuleInfo, scope: Scope, line: int) -> Optional[ast.stmt]:
    """The statement of ``scope`` at ``line`` that detect judges as a construction through a class
    chosen at run time (an assignment, expression or return holding such a call)."""
    for _b, _i, st in scope.statements():
        if st.lineno <= line <= (st.end_lineno or st.lineno) and isinstance(st, (ast.Assign, ast.AnnAssign, ast.Expr, ast.Return)):
            return st if _chosen_construction(module, scope, st) is not None else None
    return None


def _called_later(scope: Scope, stmt: ast.stmt) -> Optional[tuple[str, int]]:
    """(name, line) where the one name ``stmt`` binds is called later in ``scope``, directly
    (``name(...)``) or through a subscript (``name[key](...)``)."""
    targets = getattr(stmt, "targets", None) or ([stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
    if len(targets) != 1 or not isinstance(targets[0], ast.Name):
        return None
    name = targets[0].id
    for _b, _i, st in scope.statements():
        if st.lineno <= (stmt.end_lineno or stmt.lineno):
            continue
        for n in fast_walk(st):
            if isinstance(n, ast.Call):
                f = n.func.value if isinstance(n.func, ast.Subscript) else n.func
                if isinstance(f, ast.Name) and f.id == name:
                    return name, n.lineno
    return None


def _run_time_dtype_casts(module: ModuleInfo, tiers: tuple[_FileFacts, ...], model: str) -> list[tuple[int, str, str]]:
    """``M.to(d)`` casts of the model where the name ``d`` is bound somewhere in the file to an
    expression naming bfloat16 (``dtype = torch.bfloat16 if cuda_bf16 else torch.float32``)."""
    out = []
    for t in tiers:
        for ln, recv, name in t.dtype_casts:
            if not _concerns(recv, model):
                continue
            values = [v for sc in module.scopes for _st, v in sc.assignments.get(name, [])]
            if any(_is_bf16(n) for v in values for n in fast_walk(v)):
                out.append((ln, recv, name))
    return out


def _bf16_only_conditional_before(scope: Scope, stmt: ast.stmt, hits: list[tuple[int, str]]) -> bool:
    """Are all ``hits`` (bf16 casts/loads of the model) statements of ``scope`` itself, before
    ``stmt``, each in the body of an ``if <flag>:`` of that scope whose flag is a parameter of the
    function defaulting to False/None/0 (`def train(..., main_module_bf16: bool = False)`)? The runs
    that cast keep torch.optim through the guard; a flag that is on by default (or read from a
    config npufuse does not evaluate) would leave the fused branch dead in the default run."""
    fn = scope.node
    if not hits or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = {x.arg: d for x, d in zip(positional[len(positional) - len(a.defaults):], a.defaults)}
    defaults |= {x.arg: d for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None}
    off = {n for n, d in defaults.items() if isinstance(d, ast.Constant) and not d.value}
    ifs = [n for n in fast_walk(fn) if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id in off
           and not any(isinstance(t, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
               isinstance(x, ast.Name) and x.id == n.test.id for x in fast_walk(t)) and t.lineno < n.lineno
               for t in fast_walk(fn) if isinstance(t, ast.stmt) and not isinstance(t, (ast.FunctionDef, ast.AsyncFunctionDef)))]
    return all(ln < stmt.lineno and _in_scope(scope, ln) and any(
        i.body[0].lineno <= ln <= (i.body[-1].end_lineno or i.body[-1].lineno) for i in ifs) for ln, _r in hits)


def _concerns(recv: str, model: str) -> bool:
    """May a cast of ``recv`` ("" : of whatever is loaded) concern ``model``'s parameters?"""
    return not recv or not model or recv == model or recv.split(".")[0] in (model, model.split(".")[0]) or "model" in recv.lower()


def _bf16_hits(facts: _FileFacts, model: str) -> list[tuple[int, str]]:
    """The bf16 casts/loads of ``facts`` that may concern ``model``'s parameters."""
    return [(ln, r) for ln, r in facts.bf16 if _concerns(r, model)]


def _peft_wrapped(module: ModuleInfo, scope: Scope, model: str, line: int) -> bool:
    """Is ``model`` (a local name) a peft model here: last bound from ``get_peft_model(...)`` or a
    ``Peft*.from_pretrained(...)`` (possibly with ``.to(device)`` after)? peft freezes the base
    model and, by default (autocast_adapter_dtype=True), upcasts bf16/fp16 adapters to fp32, so a
    bf16 base says nothing about the dtype of the parameters that get grads."""
    if not model or "." in model:
        return False
    value = scope.definition(model, line)
    for n in fast_walk(value) if value is not None else ():
        if isinstance(n, ast.Call):
            name = module.canonical(n.func) or ""
            last = name.split(".")[-1]
            if last == "get_peft_model" or (last == "from_pretrained" and "Peft" in name):
                return not any(k.arg == "autocast_adapter_dtype" and not (isinstance(k.value, ast.Constant) and k.value.value is True)
                               for k in n.keywords)
    return False


def _blocker(facts: _FileFacts, model: str, prepared: Optional[tuple[int, str]], near: bool,
             bf16_checked: bool = False, fix: Optional["_ZeroGradFix"] = None, sharding_guarded: bool = False) -> Optional[str]:
    """Why the fused class cannot take over, from one tier of facts (None: nothing here).
    ``prepared``: the accelerate ``prepare`` this optimizer goes through; its zero_grad only
    counts in the ``near`` tiers (code that surely runs with this optimizer). ``bf16_checked``:
    bf16 casts do not block, the guard checks the trainable parameters' dtypes at run time."""
    if facts.sharding is not None and not sharding_guarded:
        if any(s in facts.sharding[1].lower() for s in _TORCHREC_PARTS):
            return (f"parameters sharded or stepped inside backward by torchrec's model-parallel path (`{facts.sharding[1]}` "
                    f"at line {facts.sharding[0]}): the optimizer is built from a factory over sharded/filtered "
                    "params, and a flat-buffer fused optimizer's combined buffers would not be those tensors")
        if facts.sharding[1] == _BUCKET_VIEW:
            return (f"`{_BUCKET_VIEW}` is set (line {facts.sharding[0]}): {_sharding_description(_BUCKET_VIEW)}; the fused "
                    "optimizer sizes each grad by its storage (the whole bucket) when it combines them and re-points that "
                    "shared storage, so its combined grad buffer is not the parameters' grads (torch.optim takes view grads)")
        return (f"parameters flattened/re-allocated by FSDP/DeepSpeed/ZeRO (`{facts.sharding[1]}` at line "
                f"{facts.sharding[0]}): the fused optimizer's combined buffers would go stale")
    if prepared is not None and near and facts.zero_grad_calls and not (fix is not None and fix.accelerate):
        (pl, precv), (zl, zrecv) = prepared, facts.zero_grad_calls[0]
        return (f"the optimizer goes through `{precv}.prepare` (line {pl}) and `{zrecv}.zero_grad()` is called "
                f"(line {zl}): accelerate's AcceleratedOptimizer.zero_grad() passes set_to_none=True to an optimizer "
                "whose zero_grad takes it, and torch_npu fused optimizers raise ValueError on that; call "
                "zero_grad(set_to_none=False)")
    bf16 = [] if bf16_checked else _bf16_hits(facts, model)
    if bf16:
        return (f"bf16 parameters unsupported: the file casts or loads the model in bfloat16 (line {bf16[0][0]}); "
                "torch_npu fused optimizers take fp32/fp16 params only (keep fp32 master weights)")
    free = [(ln, r) for ln, r in facts.set_to_none if fix is None or not fix.handles(ln, r)]
    if free:
        ln, recv = free[0]
        opt_in = ZERO_IN_PLACE_OPT_IN if fix is not None and fix.opts_in(ln, recv) else ""
        if not _looks_like_optimizer(recv) and not (fix is not None and recv == fix.target):
            # a module's zero_grad does not raise: it frees silently
            return (f"`{recv}.zero_grad(set_to_none=...)` (line {ln}) may set the parameters' grads to None: the next "
                    "backward allocates new ones outside the fused optimizer's flat buffer and its update silently uses "
                    "stale grads (torch_npu fused optimizers read grads only from that buffer and raise ValueError on "
                    "zero_grad(set_to_none=True)); pass set_to_none=False there" + opt_in)
        flag = facts.flags.get(ln)
        if flag is not None:
            text = " ".join(ast.unparse(flag).split())[:60]
            return (f"`{recv}.zero_grad(set_to_none={text})` (line {ln}) frees the grads whenever `{text}` is true (a "
                    "run-time or configuration value npufuse cannot test where the optimizer is built): torch_npu fused "
                    "optimizers raise ValueError on zero_grad(set_to_none=True) (grads must stay allocated in their flat "
                    "buffer); use set_to_none=False" + opt_in)
        return (f"`{recv}.zero_grad(set_to_none=True)` (line {ln}) frees the grads: torch_npu fused optimizers raise "
                "ValueError on zero_grad(set_to_none=True) (grads must stay allocated in their flat buffer); use "
                "zero_grad() / set_to_none=False" + opt_in)
    left = [(ln, r) for ln, r in facts.module_zero_grad if fix is None or not fix.handles(ln, r)]
    if left:
        ln, recv = left[0]
        if recv in facts.own_zero_grad:
            return (f"`{recv}.zero_grad()` (line {ln}) runs {facts.own_zero_grad[recv]}, the project's own handling of "
                    "the grads, not nn.Module.zero_grad: npufuse does not check what it does to the grads of the "
                    "parameters this optimizer steps (re-allocated or freed grads leave the fused optimizer's flat "
                    "grad buffer stale)")
        # s40 (ports 11 PoolNet, a once-per-epoch call): says what the call does and what to write, nothing about how often
        return (f"`{recv}.zero_grad()` (line {ln}) sets grads to None on torch >= 2.0 (nn.Module.zero_grad defaults to "
                "set_to_none=True): the next backward allocates new grads outside the fused optimizer's combined grad "
                f"buffer, which its updates keep reading; write `{recv}.zero_grad(set_to_none=False)` there")
    if facts.sparse:
        ln, flag = facts.sparse[0]
        return (f"sparse gradients: an embedding built with sparse={flag or 'True'} (line {ln}) gets sparse grad tensors"
                + (f" whenever `{flag}` is true (a run-time or configuration value)" if flag else "")
                + "; torch_npu fused optimizers take dense grads only (every grad is copied into one dense flat buffer)")
    if facts.create_graph:
        ln, call = facts.create_graph[0]
        return (f"`{call}(create_graph=True)` (line {ln}) runs the backward in grad mode, where autograd accumulates each "
                "grad out of place (`p.grad = p.grad + g`: a new grad tensor every step after the first), so the fused "
                "optimizer keeps updating from its combined grad buffer, which no longer receives the grads")
    if facts.grad_assign is not None:
        return (f"grads are re-allocated (`.grad = ...` at line {facts.grad_assign}): the fused optimizer keeps "
                "updating from its combined grad buffer")
    if facts.data_assign is not None:
        return (f"parameters are re-allocated (`.data = ...` at line {facts.data_assign}): the fused optimizer's "
                "combined buffers would go stale")
    return None


# The fused branch's replacement of an optimizer's zero_grad where the code frees grads
# (``zero_grad(set_to_none=True)``, directly or through accelerate): torch_npu's fused class raises
# ValueError on set_to_none=True, and its own zero_grad(set_to_none=False) zeroes the flat buffer in
# place. Also used by npufuse.scan.repo_facts when the call is in another file.
ZERO_IN_PLACE_COMMENT = ("# torch_npu fused optimizers keep grads in a flat buffer and raise on set_to_none=True: "
                         "zero them in place")


# What a near miss adds where ``npufuse scan --optimizer-zero-grad-in-place`` would make the site a
# candidate (also used by npufuse.scan.repo_facts): the code's own choice to free grads is kept by
# default (issue 14 class 5: set_to_none=True is a reason to keep the torch optimizer).
ZERO_IN_PLACE_OPT_IN = (
    "; `npufuse scan --optimizer-zero-grad-in-place` makes this a candidate whose fused branch rebinds that "
    "zero_grad to zero the grads in place (risk: a parameter that gets no grad in some step is then updated with "
    "a zero grad, so weight decay and momentum still apply where torch.optim would skip it, and grad memory is "
    "not released between steps)")


# accelerate's launcher (`accelerate launch --config_file x.yaml`) tells the Accelerator to wrap the
# model and the optimizer in DeepSpeed, FSDP or Megatron-LM through these environment variables; the
# code itself only calls `accelerator.prepare(model, optimizer)`. Those engines flatten the parameters
# or re-assign `.grad` every step behind the optimizer (ZeRO hands the wrapped optimizer fp32
# partitions), so the flat-buffer fused class would update stale buffers: such runs keep torch.optim.
# accelerate reads them with str_to_bool (y/yes/t/true/on/1); a plugin passed in code
# (`Accelerator(deepspeed_plugin=...)`) is sharding the detector sees in the file.
ACCELERATE_SHARDING_ENV = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_MEGATRON_LM")
_ACCELERATE_SHARDED_LAUNCH = ("any(_npufuse_os.environ.get(_k, '').strip().lower() in ('1', 'true', 'yes', 'y', 'on', 't') "
                              f"for _k in {ACCELERATE_SHARDING_ENV!r})")
ACCELERATE_LAUNCH_NOTE = ("the optimizer goes through accelerate's prepare: the guard keeps torch.optim for runs that "
                          "`accelerate launch` configures for DeepSpeed, FSDP or Megatron-LM (" + ", ".join(ACCELERATE_SHARDING_ENV)
                          + " set), which flatten or re-assign the parameters and grads behind the optimizer")


def accelerate_launch_guard(guard: str) -> str:
    """``guard`` made None for runs that accelerate's launcher configures for DeepSpeed/FSDP/Megatron
    (read from the environment when the optimizer is built; ``_npufuse_os`` is the rewrite's prelude's
    ``os``). Also used by npufuse.scan.repo_facts when the ``prepare`` is in another file."""
    return f"({guard}) if not {_ACCELERATE_SHARDED_LAUNCH} else None"


def guard_model(guard: str) -> Optional[str]:
    """The model whose fresh ``parameters()`` generator a guard reads (``next(M.parameters(), None)``,
    possibly wrapped in run-time conditions: ``(next(M.parameters(), None)) if ... else None``)."""
    m = re.match(r"\(*next\(([A-Za-z_][\w.]*)\.parameters\(\), None\)", guard)
    return m.group(1) if m else None


def zero_in_place(target: str) -> str:
    """The expression bound to ``<target>.zero_grad`` in the fused branch (``target``: the optimizer
    or a module; its zero_grad is called with set_to_none=False whatever the caller asks)."""
    return f"(lambda zero_grad: lambda set_to_none=None: zero_grad(set_to_none=False))({target}.zero_grad)"


class _ZeroGradFix:
    """The zero_grad calls that would free the fused optimizer's grads, and the statements the
    fused branch adds after the construction so they no longer do (the fused class reads every
    grad from one flat buffer made at its first step; a grad set to None and re-allocated by the
    next backward is no longer in it, and the update silently uses the stale buffer):

    * ``M.zero_grad()`` on the model whose parameters the optimizer takes (torch >= 2.0 default
      set_to_none=True): ``M.zero_grad`` is bound to ``partial(M.zero_grad, set_to_none=False)``
      (zeroed in place, as the fused class's own zero_grad does). Other receivers must provably not
      hold these parameters: the else branch of the same test as the optimizer's construction
      (``if args.use_optimizer: opt = ...`` / ``else: model.zero_grad()``), or a different object
      built in the same scope from a different class.
    * an accelerate-prepared optimizer whose ``zero_grad()`` is called: AcceleratedOptimizer passes
      set_to_none=True to a wrapped zero_grad that has that parameter (the fused class raises
      ValueError on it); the fused optimizer's zero_grad is replaced by one without the parameter
      that zeroes in place.

    With ``in_place`` (``npufuse scan --optimizer-zero-grad-in-place``) also, and only then:

    * ``zero_grad(set_to_none=True)`` (or a flag) on the optimizer, on its model, or on a wrapper
      provably holding its parameters (``raw = model.module``): bound to a zero_grad that zeroes in
      place whatever set_to_none asks. Without it those calls are the code's stated choice to free
      grads: they stay blockers, whose reason names the option (:meth:`opts_in`). (``zero_grad()``
      on such a wrapper frees by default, like ``M.zero_grad()``: zeroed in place in both modes.)

    Only for a statement that binds the optimizer to one name (nothing can follow a ``return``)."""

    def __init__(self, module: ModuleInfo, scope: Scope, stmt: ast.stmt, model: str,
                 prepared: Optional[tuple[int, str]], tiers: tuple[_FileFacts, _FileFacts, _FileFacts],
                 in_place: bool = False) -> None:
        names = _target_names(stmt)
        self.target = next(iter(names)) if len(names) == 1 and not isinstance(stmt, ast.Return) else ""
        self.model = model if self.target else ""
        self.accelerate = bool(self.target) and prepared is not None and any(t.zero_grad_calls for t in tiers[:2])
        self._handled: set[tuple[int, str]] = set()
        # calls the option would handle (left as blockers without it)
        self._opt_in: set[tuple[int, str]] = set()
        self.patch_model: list[int] = []  # lines of M.zero_grad() calls the patch covers
        # zero_grad(set_to_none=True) (or a flag) on the optimizer this statement binds / on the model
        # whose parameters it takes: the fused branch makes those calls zero in place
        self.free_optimizer: list[int] = []
        self.free_model: list[int] = []
        site_tests = _enclosing_tests(module.tree, stmt.lineno)
        # other receivers that provably hold the model (`model.zero_grad()` where the optimizer takes
        # `raw_model.lm_head.parameters()` and `raw_model = model.module`): their zero_grad is bound too
        self.holders: dict[str, list[int]] = {}
        for t in tiers:
            for ln, recv in t.set_to_none:
                if _excluded_branch(site_tests, _enclosing_tests(module.tree, ln)):
                    self._handled.add((ln, recv))
                elif not in_place:
                    if ((self.target and recv == self.target)
                            or (self.model and recv == self.model and not _other_optimizer_over(module, scope, self.model, stmt))
                            or (self.model and _holds(module, scope, recv, self.model, ln, stmt.lineno))):
                        self._opt_in.add((ln, recv))
                elif self.target and recv == self.target:
                    self._handled.add((ln, recv))
                    self.free_optimizer.append(ln)
                elif self.model and recv == self.model and not _other_optimizer_over(module, scope, self.model, stmt):
                    self._handled.add((ln, recv))
                    self.free_model.append(ln)
                elif self.model and _holds(module, scope, recv, self.model, ln, stmt.lineno):
                    self._handled.add((ln, recv))
                    self.holders.setdefault(recv, []).append(ln)
        for t in tiers:
            for ln, recv in t.module_zero_grad:
                if _excluded_branch(site_tests, _enclosing_tests(module.tree, ln)):
                    self._handled.add((ln, recv))
                elif self.model and recv == self.model and not _other_optimizer_over(module, scope, self.model, stmt):
                    self._handled.add((ln, recv))
                    self.patch_model.append(ln)
                elif self.model and _holds(module, scope, recv, self.model, ln, stmt.lineno):
                    # frees by default (torch >= 2.0), like M.zero_grad() above: zeroed in place in both modes
                    self._handled.add((ln, recv))
                    self.holders.setdefault(recv, []).append(ln)
                elif self.model and _other_object(module, scope, recv, self.model, ln, stmt.lineno):
                    self._handled.add((ln, recv))

    def handles(self, line: int, recv: str) -> bool:
        return (line, recv) in self._handled

    def opts_in(self, line: int, recv: str) -> bool:
        """Would ``--optimizer-zero-grad-in-place`` make this freeing call zero in place?"""
        return (line, recv) in self._opt_in

    def statements(self) -> str:
        out = ""
        if self.free_model:
            m = self.model
            out += ("# the fused optimizer reads grads from its flat buffer: zero them in place, never free them "
                    "(whatever set_to_none asks)\n"
                    f"{m}.zero_grad = (lambda zero_grad: lambda set_to_none=None: zero_grad(set_to_none=False))({m}.zero_grad)\n")
        elif self.patch_model:
            m = self.model
            out += ("# the fused optimizer reads grads from its flat buffer: zero them in place, never free them\n"
                    "import functools as _npufuse_functools\n"
                    f"{m}.zero_grad = _npufuse_functools.partial({m}.zero_grad, set_to_none=False)\n")
        for h in sorted(self.holders):
            out += (f"# `{h}` holds the parameters the fused optimizer takes: its zero_grad zeroes in place\n"
                    f"{h}.zero_grad = {zero_in_place(h)}\n")
        if self.free_optimizer:
            # (accelerate's wrapper passes set_to_none=True to it too: also zeroed in place)
            o = self.target
            out += (f"{ZERO_IN_PLACE_COMMENT}\n"
                    f"{o}.zero_grad = {zero_in_place(o)}\n")
        elif self.accelerate:
            o = self.target
            # it takes set_to_none and ignores it: accelerate >= 0.2x passes True by default, older
            # versions False, and a caller's own `zero_grad(set_to_none=False)` through the wrapper
            # would raise ValueError in accelerate if the rebound zero_grad had no such parameter
            out += ("# accelerate passes set_to_none=True to a zero_grad that takes it (the fused class raises): "
                    "zero in place\n"
                    f"{o}.zero_grad = {zero_in_place(o)}\n")
        return out

    def risks(self) -> list[Risk]:
        lines = sorted(set(self.free_optimizer + self.free_model + [ln for lns in self.holders.values() for ln in lns]))
        if not lines:
            return []
        return [Risk("other", f"the code frees grads with zero_grad(set_to_none=...) (line {', '.join(map(str, lines))}); "
                     "torch_npu's fused optimizers raise ValueError on set_to_none=True and read grads from their flat "
                     "buffer, so the fused branch zeroes them in place instead: a parameter that gets no grad in some step "
                     "is then updated with a zero grad (weight decay and momentum still apply) where torch.optim would skip "
                     "it, and grad memory is not released between steps"
                     + (f"; every parameter under {', '.join(f'`{h}`' for h in sorted(self.holders))} is zeroed in place, "
                        "including those another optimizer updates" if self.holders else ""))]

    def notes(self) -> list[str]:
        out = []
        if self.free_model:
            out.append(f"`{self.model}.zero_grad(set_to_none=...)` (line {', '.join(map(str, sorted(set(self.free_model))))}): "
                       f"the fused branch binds `{self.model}.zero_grad` to one that zeroes in place")
        if self.free_optimizer:
            out.append(f"`{self.target}.zero_grad(set_to_none=...)` (line {', '.join(map(str, sorted(set(self.free_optimizer))))}): "
                       f"the fused branch gives `{self.target}` a zero_grad that accepts set_to_none and zeroes in place")
        if self.patch_model and not self.free_model:
            lines = ", ".join(str(x) for x in sorted(set(self.patch_model)))
            out.append(f"`{self.model}.zero_grad()` (line {lines}) would set grads to None (torch >= 2.0) and the next "
                       "backward would allocate new ones outside the fused optimizer's flat buffer (its update would "
                       f"silently use stale grads): the fused branch binds `{self.model}.zero_grad` to "
                       "set_to_none=False, so grads are zeroed in place")
        if self.accelerate:
            out.append(f"the optimizer goes through accelerate's prepare, whose zero_grad() passes set_to_none=True to "
                       f"a wrapped zero_grad that takes it (torch_npu fused optimizers raise ValueError): the fused branch "
                       f"gives `{self.target}` a zero_grad without that parameter, zeroing in place")
        return out


def _holds(module: ModuleInfo, scope: Scope, recv: str, model: str, line: int, site_line: int) -> bool:
    """Does ``recv`` (whose zero_grad is called at ``line``) hold ``model``'s parameters, by dataflow
    in the site's scope: ``model`` is an attribute path under it (``recv.lm_head``), or ``model``'s
    root name is last bound, before the site, to an attribute path under it (``raw_model =
    model.module``); and ``recv`` names the same object at the call as at the site (a plain name of
    the site's scope, not re-bound between them)."""
    if "." in recv or not recv.isidentifier() or not (_in_scope(scope, line) or _reads_global(module, scope, recv, line)):
        return False
    bindings = scope.assignments.get(recv, [])
    if not bindings or any(st.lineno >= site_line for st, _ in bindings):
        return False  # unknown, or re-bound after the optimizer is built (the call may see another object)
    if model.startswith(recv + "."):
        return True
    root = model.split(".")[0]
    value = scope.definition(root, site_line)
    name = dotted(value) if isinstance(value, ast.Attribute) else None
    return bool(name) and name.startswith(recv + ".")


# torch.optim modules whose classes take an optimizer, not parameters (schedulers, SWA's LR)
_NOT_OPTIMIZERS = ("torch.optim.lr_scheduler.", "torch.optim.swa_utils.")


def _other_optimizer_over(module: ModuleInfo, scope: Scope, model: str, stmt: ast.stmt) -> bool:
    """Does another statement of the file build an optimizer (a name that looks like one) from
    ``model``'s parameters? Binding ``model.zero_grad`` to set_to_none=False would change what that
    one sees for parameters without a grad in a step (zeros instead of None). An object built on this
    statement's optimizer (``StepLR(optimizer, ...)``, a warm-up or Lookahead wrapper) or a torch.optim
    LR scheduler is no other optimizer: it reaches the parameters only through this one (s34)."""
    own = _target_names(stmt)
    for n in fast_walk(module.tree):
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.Return)) and n is not stmt and n.value is not None:
            if _s35_exclusive_arms(module.tree, stmt.lineno, n.lineno):
                continue  # s35: built only on a run where the site's optimizer is not (`if opt == 'sgd': ... elif ...`)
            if isinstance(n.value, ast.Call) and (
                    (module.canonical(n.value.func) or "").startswith(_NOT_OPTIMIZERS)
                    or any(isinstance(a, ast.Name) and a.id in own for a in [*n.value.args, *(k.value for k in n.value.keywords)])):
                continue
            if isinstance(n, ast.Return):
                # `return Muon(model.parameters())`: a class constructed and handed out
                head = (dotted(n.value.func) or "").rsplit(".", 1)[-1] if isinstance(n.value, ast.Call) else ""
                targets = {"optimizer"} if head[:1].isupper() else set()
            else:
                targets = _target_names(n)
            # s31: by what it is (a torch.optim class built, an object stepped in the file), not only by its name
            # (``o2 = torch.optim.SGD(model.parameters())`` was missed: names are no evidence)
            built = isinstance(n.value, ast.Call) and (module.canonical(n.value.func) or "").startswith("torch.optim.")
            if not built and not any(_looks_like_optimizer(t, module) for t in targets):
                continue
            # names resolved through the site's scope (in another scope that may over-match: then no rewrite)
            if _model_of(module, scope, n.value, n.lineno) == model:
                return True
    return False


def _s35_exclusive_arms(tree: ast.Module, a: int, b: int) -> bool:
    """Do the statements at lines ``a`` and ``b`` sit in different arms of one ``if`` statement
    (body / else, an ``elif`` being an ``if`` in the else arm) that no loop of their function
    repeats? Then one run of that function executes at most one of them, whatever the test reads
    (transformer-xl's `if args.optim.lower() == 'sgd': ... elif ... == 'adam': ...`)."""
    body: list[ast.stmt] = tree.body
    looped = False
    while True:
        st = next((s for s in body if s.lineno <= min(a, b) and max(a, b) <= (s.end_lineno or s.lineno)), None)
        if st is None or st.lineno in (a, b):
            return False
        if isinstance(st, ast.If):
            arms = [st.body, st.orelse]
            ia = next((i for i, arm in enumerate(arms) if arm and arm[0].lineno <= a <= (arm[-1].end_lineno or 0)), None)
            ib = next((i for i, arm in enumerate(arms) if arm and arm[0].lineno <= b <= (arm[-1].end_lineno or 0)), None)
            if ia is None or ib is None:
                return False
            if ia != ib:
                return not looped
            body = arms[ia]
            continue
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            looped = False
        elif isinstance(st, (ast.For, ast.AsyncFor, ast.While)):
            looped = True
        elif isinstance(st, ast.ClassDef):
            pass
        blocks = [getattr(st, f, None) or [] for f in ("body", "orelse", "finalbody")]
        blocks += [h.body for h in getattr(st, "handlers", None) or []]
        blocks += [c.body for c in getattr(st, "cases", None) or []]
        nxt = [blk for blk in blocks if blk and blk[0].lineno <= min(a, b) and max(a, b) <= (blk[-1].end_lineno or 0)]
        if not nxt:
            return False
        body = nxt[0]


def _enclosing_tests(tree: ast.Module, line: int) -> list[tuple[str, bool]]:
    """(dump of the test, in its body?) of each ``if`` enclosing the statement at ``line``,
    outermost first; only tests that call nothing (a flag, a comparison of names)."""
    out: list[tuple[str, bool]] = []
    body: list[ast.stmt] = tree.body
    while True:
        for st in body:
            if st.lineno <= line <= (st.end_lineno or st.lineno):
                break
        else:
            return out
        if st.lineno == line and not isinstance(st, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
            return out
        if isinstance(st, ast.If):
            in_body = bool(st.body) and st.body[0].lineno <= line <= (st.body[-1].end_lineno or 0)
            if _side_effect_free(st.test):
                out.append((ast.dump(st.test), in_body))
            body = st.body if in_body else st.orelse
        else:
            blocks = [getattr(st, f, None) or [] for f in ("body", "orelse", "finalbody")]
            blocks += [h.body for h in getattr(st, "handlers", None) or []]
            nxt = [b for b in blocks if b and b[0].lineno <= line <= (b[-1].end_lineno or 0)]
            if not nxt:
                return out
            body = nxt[0]


def _excluded_branch(site: list[tuple[str, bool]], other: list[tuple[str, bool]]) -> bool:
    """Does ``other`` sit in the opposite branch of a test the site also sits under (the same
    flag read twice: ``if args.use_optimizer: opt = ...`` and later ``if args.use_optimizer: ...
    else: model.zero_grad()``)?"""
    where = dict(site)
    return any(test in where and where[test] != branch for test, branch in other)


def _other_object(module: ModuleInfo, scope: Scope, recv: str, model: str, line: int, site_line: int) -> bool:
    """Is ``recv`` (whose zero_grad is called at ``line``) provably not ``model``: both plain names
    of the site's own scope, the call in that scope too, each last bound from a constructor call
    of a different class (``netD = Discriminator(...).to(device)``, ``netG = Generator(...)``),
    neither built from the other?"""
    if "." in recv or "." in model or not (_in_scope(scope, line) or _reads_global(module, scope, recv, line)):
        return False
    a, b = scope.definition(recv, line + 1), scope.definition(model, site_line)
    ca, cb = _constructor(module, a), _constructor(module, b)
    if ca is None or cb is None or ca == cb:
        return False
    return not any(isinstance(n, ast.Name) and n.id == model for n in fast_walk(a)) and \
        not any(isinstance(n, ast.Name) and n.id == recv for n in fast_walk(b))


def _reads_global(module: ModuleInfo, scope: Scope, name: str, line: int) -> bool:
    """Does the function holding ``line`` read ``name`` as the module-level name the site (a
    module-level statement) binds: no parameter, assignment or ``for`` target of it there?"""
    if scope.qualname != "<module>":
        return False
    holders = [s for s in module.scopes if s.qualname != "<module>"
               and s.node.lineno <= line <= (getattr(s.node, "end_lineno", None) or s.node.lineno)]
    if not holders:
        return False
    fn = holders[-1].node
    args = fn.args  # type: ignore[attr-defined]
    if name in {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}:
        return False
    return not any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in fast_walk(fn))


def _in_scope(scope: Scope, line: int) -> bool:
    """Is the statement at ``line`` directly in ``scope`` (not in a nested function or class)?"""
    return any(st.lineno == line or (st.lineno <= line <= (st.end_lineno or st.lineno)
               and not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
               for _b, _i, st in scope.statements())


def _constructor(module: ModuleInfo, value: Optional[ast.expr]) -> Optional[str]:
    """``Cls`` of ``Cls(...)`` / ``Cls(...).to(device)`` / ``.cuda()`` / ``.float()``: a class of
    this module (a name bound to a call of something else says nothing about identity)."""
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in ("to", "cuda", "float", "half", "train", "npu"):
        value = value.func.value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in module.classes:
        return value.func.id
    return None


# --- wrapper classes of other optimizers (issue 14 class 5) --------------------------------------
# OpenNMT's `MultipleOptimizer.zero_grad(self, set_to_none=True): for op in self.optimizers:
# op.zero_grad(set_to_none)` frees the grads of the optimizers it was built with, and only those:
# an optimizer of the same file that is never handed to `MultipleOptimizer(...)` keeps its grads.

def _foreign_wrapper_lines(module: ModuleInfo, scope: Scope, stmt: ast.stmt, call: ast.Call) -> set[int]:
    """Lines of grad-freeing code (``zero_grad(set_to_none=...)``, ``X.grad = ...``) in methods of a
    class of this file, on objects the instance holds (``self.x``, or a name iterating / built from
    ``self``), where that class is not the site's own class or one of its bases/subclasses, its
    constructions in this file are all seen, and none is handed this optimizer (by the call itself,
    the name the statement binds, a call of the site's function, or anything npufuse cannot tell
    apart from them)."""
    units = _units(module)
    if not units.classes:
        return set()
    site_cls = units.units[units.unit_of(scope.qualname)].cls
    related = _class_family(units, site_cls) if site_cls else set()
    out: set[int] = set()
    for cls_name, methods in units.classes.items():
        if cls_name in related:
            continue
        lines = []
        for m in methods:
            u = units.units[m]
            fn = u.roots[0] if u.roots else None
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            facts = units._unit_facts(m)
            lines += [ln for ln, recv in (*facts.set_to_none, *facts.grad_assigns) if held_by_instance(fn, recv)]
        if lines and not _handed_to_class(module, scope, cls_name, stmt, call):
            out.update(lines)
    return out


def _testable_flags(module: ModuleInfo, scope: Scope, stmt: ast.stmt, own: _FileFacts) -> list[tuple[int, str]]:
    """(line, test source) of each ``zero_grad(set_to_none=<flag>)`` directly in the site's scope
    whose flag reads the same value where the optimizer is built: side-effect free, every name in
    it a parameter of the site's function or a module-level name, never re-bound in the function.
    Only when every non-constant flag of the site's own function is such (else nothing)."""
    flagged = [(ln, r) for ln, r in own.set_to_none if ln in own.flags]
    if not flagged:
        return []
    fn = scope.node
    params_ = set(scope.args)
    module_scope = next((s for s in module.scopes if s.qualname == _MODULE), None)
    out = []
    for ln, _recv in flagged:
        flag = own.flags[ln]
        if not _in_scope(scope, ln) or not _side_effect_free(flag):
            return []
        for n in fast_walk(flag):
            if isinstance(n, ast.Name):
                rebound = scope.qualname != _MODULE and n.id in scope.assignments
                known = n.id in params_ or (module_scope is not None and n.id in module_scope.assignments) or n.id in module.aliases
                if rebound or not known or (scope.qualname == _MODULE and n.id in scope.assignments
                                            and any(st.lineno > stmt.lineno for st, _v in scope.assignments[n.id])):
                    return []
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            return []
        out.append((ln, " ".join(segment(module, flag).split())))
    return out


def _class_family(units: "_Units", cls: str) -> set[str]:
    """``cls``, its bases and its subclasses among the classes of the file (transitively)."""
    family, todo = {cls}, [cls]
    while todo:
        c = todo.pop()
        near = set(units.bases.get(c, [])) | {k for k, bs in units.bases.items() if c in bs}
        for n in near - family:
            family.add(n)
            todo.append(n)
    return family


def held_by_instance(fn: ast.AST, recv: str) -> bool:
    """Is ``recv`` (in method ``fn``) an object the instance holds: ``self.x``, or a name bound by a
    ``for`` over / an assignment from an expression reading ``self`` or such a name (to a fixed
    point: ``for group in self.param_groups: for p in group["params"]``)?"""
    root = recv.split(".")[0]
    if not root:
        return False
    return root in names_bound_from(fn, {"self", "cls"}, 4)


def _handed_to_class(module: ModuleInfo, scope: Scope, cls: str, stmt: ast.stmt, call: ast.Call) -> bool:
    """May this optimizer reach an instance of ``cls``? True unless every ``cls(...)`` of the file
    (there must be one) takes only constants and constructions of other objects."""
    ctors = [n for n in fast_walk(module.tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == cls]
    if not ctors:
        return True  # built elsewhere, with whatever optimizer
    builder = scope.qualname.rsplit(".", 1)[-1] if scope.qualname != _MODULE else ""
    todo: list[ast.AST] = [a for c in ctors for a in (*c.args, *(k.value for k in c.keywords))]
    while todo:
        a = todo.pop()
        if any(n is call for n in fast_walk(a)):
            return True
        if isinstance(a, (ast.List, ast.Tuple, ast.Set)):
            todo += a.elts
        elif isinstance(a, ast.Starred):
            todo.append(a.value)
        elif isinstance(a, ast.Constant):
            continue
        elif isinstance(a, ast.Call):
            name = module.canonical(a.func) or ""
            head = dotted(a.func) or ""
            other_ctor = name.startswith("torch.optim.") or head in module.classes
            if not other_ctor or (builder and head.rsplit(".", 1)[-1] == builder):
                return True  # a function's result: it may be this optimizer
        else:
            return True  # a name or attribute: it may hold this optimizer
    return False


def _without_lines(module: ModuleInfo, facts: _FileFacts, lines: set[int]) -> _FileFacts:
    """``facts`` less the grad-freeing facts at ``lines``."""
    if not any(ln in lines for ln, _r in (*facts.set_to_none, *facts.grad_assigns)):
        return facts
    out = _FileFacts.merged(module, [facts])
    out.uncalled_reallocation = facts.uncalled_reallocation
    out.set_to_none = [(ln, r) for ln, r in facts.set_to_none if ln not in lines]
    out.grad_assigns = [(ln, r) for ln, r in facts.grad_assigns if ln not in lines]
    if facts.grad_assign in lines:
        out.grad_assign = out.grad_assigns[0][0] if out.grad_assigns else None
    return out


def _lambda_parameters_read(stmt: ast.stmt, call: ast.Call) -> set[str]:
    """The parameters of a lambda in ``stmt`` around ``call`` that the call's arguments read
    (`lambda params: torch.optim.SGD(params, lr=lr)`): names the statement-level guard never sees."""
    if not any(isinstance(n, ast.Lambda) for n in fast_walk(stmt)):
        return set()
    read = {n.id for a in (*call.args, *(k.value for k in call.keywords)) for n in fast_walk(a) if isinstance(n, ast.Name)}
    found: set[str] = set()
    for lam in (n for n in fast_walk(stmt) if isinstance(n, ast.Lambda)):
        if any(n is call for n in fast_walk(lam.body)):
            a = lam.args
            names = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, *(v for v in (a.vararg, a.kwarg) if v))}
            found |= names & read
    return found


def _comprehension_targets_read(stmt: ast.stmt, call: ast.Call) -> set[str]:
    """The loop variables of a comprehension in ``stmt`` around ``call`` that the call's arguments read
    (`{name: Adam(params) for name, params in groups.items()}`): bound only inside the comprehension,
    so a guard before the statement that reads them raises NameError."""
    comps = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    if not any(isinstance(n, comps) for n in fast_walk(stmt)):
        return set()
    read = {n.id for a in (*call.args, *(k.value for k in call.keywords)) for n in fast_walk(a) if isinstance(n, ast.Name)}
    found: set[str] = set()
    for comp in (n for n in fast_walk(stmt) if isinstance(n, comps)):
        if any(n is call for n in fast_walk(comp)):
            for gen in comp.generators:
                found |= {n.id for n in fast_walk(gen.target) if isinstance(n, ast.Name)} & read
    return found


def _site(module: ModuleInfo, scope: Scope, stmt: ast.stmt, call: ast.Call,
          tiers: tuple[_FileFacts, _FileFacts, _FileFacts], in_place: bool = False,
          chosen_class: Optional[tuple[str, str]] = None) -> Result:
    """``chosen_class``: (torch.optim class, test) when the class is chosen at run time
    (:func:`_chosen_construction`): the guard runs the fused class only when the test holds."""
    kind = chosen_class[0] if chosen_class is not None else _CANONICAL[module.canonical(call.func) or ""]
    fused_cls, accepted = _OPTIMIZERS[kind]
    line, end = stmt.lineno, stmt.end_lineno or stmt.lineno

    def miss(reason: str) -> NearMiss:
        return NearMiss(_ID, scope.qualname, line, end, reason)

    dead = _optim_s46.overwritten_before_use(scope.node, stmt)  # s46: replaced before any use
    if dead is None:
        dead = _fused_optimizer_s47sweep.only_groups_read(scope, stmt)  # s47: only its param_groups are read
    if dead is not None:
        return miss(dead)
    # grads freed by a wrapper class's own objects (`for op in self.optimizers: op.zero_grad(True)`)
    # concern only the optimizers handed to that class: not this one when it never is
    foreign = _foreign_wrapper_lines(module, scope, stmt, call) | _fused_optimizer_s51b.foreign_grad_write_lines(module, scope, call)
    if foreign:
        tiers = (_without_lines(module, tiers[0], foreign), _without_lines(module, tiers[1], foreign),
                 _without_lines(module, tiers[2], foreign))
    # `zero_grad(set_to_none=<flag>)` in the site's own scope, with a flag the guard can read where
    # the optimizer is built: the fused branch only for runs where the flag is false
    flag_tests = [] if in_place else _testable_flags(module, scope, stmt, tiers[0])
    if flag_tests:
        lines = {ln for ln, _t in flag_tests}
        tiers = (_without_lines(module, tiers[0], lines), tiers[1], tiers[2])
    # -- arguments ---------------------------------------------------------------------------
    plan = _KeywordPlan(module, scope, call, line, accepted, fused_cls)
    if plan.reason is not None:
        return miss(plan.reason)
    bound = _lambda_parameters_read(stmt, call)
    if bound:
        return miss(f"the optimizer is built inside a lambda from its own parameter(s) ({', '.join(sorted(bound))}): "
                    "an optimizer factory whose caller supplies the params; the guard that checks them is a statement "
                    "around the construction and cannot read a lambda's parameters (a def factory can be rewritten)")
    looped = _comprehension_targets_read(stmt, call)
    if looped:
        return miss(f"the optimizer is built inside a comprehension from its loop variable(s) ({', '.join(sorted(looped))}): "
                    "one optimizer per parameter group; the guard that checks the params is a statement around the "
                    "construction and cannot read names bound only inside the comprehension")
    star_test = _s34_starred_test(module, call, accepted if chosen_class is None else _FEWEST_POSITIONAL)
    if any(isinstance(a, ast.Starred) for a in call.args) and star_test is None:
        return miss("positional arguments passed through `*args`: cannot check them against the fused class")
    if len(call.args) > 1 + len(accepted):
        return miss("more positional arguments than the fused class takes")
    # -- constraints of the code that may run with it (_Units: the file, less other tests) -------
    # checked before the guard (a blocker in the code is the reason, not npufuse's rewrite limits),
    # nearest tier first, so the reason cites the occurrence closest to the site
    guard, why = _guard(module, scope, call, stmt)
    model = guard[len("next("):].split(".parameters()")[0] if guard and ".parameters()" in guard else ""
    prepared = _accelerate_prepared(stmt, tiers[0], tiers[1])
    moved: Optional[str] = None  # s50: the guard whose device test is the accelerator's
    peft = _peft_wrapped(module, scope, model, stmt.lineno)
    fix = _ZeroGradFix(module, scope, stmt, model, prepared, tiers, in_place)
    before = _reallocated_before(module, scope, stmt, tiers)
    if before is not None:
        tiers, ran_before = before
    else:
        ran_before = []
    tiers = _s40_on_the_sites_path(module, stmt, model, tiers)
    sharded_when = (_sharding_condition(module, scope, stmt, [n for t in tiers for n in t.sharding_nodes])
                    if guard and all(len(t.sharding_nodes) < 16 for t in tiers) else None)
    # `if use_bf16: model = model.to(torch.bfloat16)` before the construction, in its own scope, under a
    # parameter that is off by default: whether a run casts is a run-time fact the guard reads (every
    # trainable parameter fp32/fp16); a cast after it, elsewhere, unconditional or on by default refuses
    bf16_when = bool(model) and _bf16_only_conditional_before(scope, stmt, [h for t in tiers for h in _bf16_hits(t, model)])
    for n, facts in enumerate(tiers):
        reason = _blocker(facts, model, prepared, near=n < 2, bf16_checked=peft or bf16_when, fix=fix,
                          sharding_guarded=sharded_when is not None)
        if reason is not None:
            return miss(reason)
    reason = _s25_blocker(module, scope, stmt, call, model)
    if reason is not None:
        return miss(reason)
    # one tensor: correct but of little value; said in the notes, not refused (the report ranks it)
    single = _s27_single_tensor(module, scope, stmt, call)
    if guard is None:
        return miss(why)
    skip_names: Optional[list[str]] = None
    reason = _s37_random_skip(module, scope, guard, call)
    if reason is not None and model:
        # s51: skipping classes of a model npufuse does not tell apart: the guard tests the model's modules for them
        reason, skip_names = _fused_optimizer_s51a.random_skip_verdict(
            module, scope, guard, segment(module, keyword(call, "params", 0)) if keyword(call, "params", 0) is not None else "")
        reason = None if skip_names else reason
    reason = reason or _s40_grad_none_read(module, tiers)
    if reason is not None:
        return miss(reason)
    if plan.runtime is not None:
        mapping, taken, filtered = plan.runtime
        guard = f"({guard}) if set({mapping}).issubset({tuple(sorted(taken + filtered))!r}) else None"
    for _ln, test in flag_tests:
        guard = f"({guard}) if not ({test}) else None"
    if star_test is not None:
        # s34: the `*args` tuple must fit the positional slots the fused class has after those written
        guard = f"({guard}) if {star_test} else None"
    if chosen_class is not None:
        # the class is chosen at run time: the fused class only where torch.optim's was chosen
        guard = f"({guard}) if {chosen_class[1]} else None"
    if sharded_when is not None:
        # the sharded runs keep torch.optim: the fused branch only where the test says no sharding
        test, in_body, where = sharded_when
        guard = f"({guard}) if {'not ' if in_body else ''}({test}) else None"
    if skip_names:
        guard = f"({guard}) if {_fused_optimizer_s51a.no_skip_test(model, skip_names)} else None"
    if prepared is not None:
        # s32: accelerate's launcher picks DeepSpeed/FSDP/Megatron from a config file the code never names
        guard = accelerate_launch_guard(guard)
        # s50: built before the prepare that moves the model: the device tested is the accelerator's
        moved = _fused_optimizer_s50m.accelerator_device_guard(module, scope, stmt, guard, prepared,
                                                                any((ln, recv) == prepared and model in a for ln, recv, a in tiers[0].prepared))
        guard = moved or guard
    lightning_self = _s32_lightning_self(module, scope)
    if lightning_self is not None:
        # s32: a LightningModule's optimizer runs under the Trainer's strategy, often a run-time value
        guard = lightning_strategy_guard(guard, lightning_self)
    dtype_checked = (peft and any(_bf16_hits(t, model) for t in tiers)) or bf16_when
    chosen = _run_time_dtype_casts(module, tiers, model)
    if chosen:
        ln, recv, name = chosen[0]
        if not model or any(c[0] >= stmt.lineno or not _in_scope(scope, c[0]) for c in chosen):
            return miss(f"`{recv}.to({name})` (line {ln}) may cast the parameters to bfloat16 (`{name}` can be bfloat16 by its "
                        "definition) after, or away from, the optimizer's construction; torch_npu fused optimizers take "
                        "fp32/fp16 params only (TypeError at the first step)")
        dtype_checked = True  # cast before the construction, in its scope: checked at run time below
    if model:
        # s33: the parameters' dtype is a run-time fact wherever the model comes from a caller, a
        # config or a checkpoint (a bf16 model handed to `train(model)`, `Net(cfg)` built with
        # cfg["dtype"] = torch.bfloat16): fuse only if every parameter that can get a grad is
        # fp32/fp16, else the original optimizer runs (the fused class raises TypeError on bf16 at
        # its first step). Also a bf16 base under peft (modules_to_save copies stay bf16). str(dtype):
        # the file need not import torch itself (`from torch.optim import AdamW`). The guard is
        # parenthesised: it may already be a conditional expression (run-time launch/strategy tests).
        test = (f"all({_FUSABLE_DTYPE.format(t='p')} for p in {model}.parameters() if p.requires_grad) and "
                f"{_ONE_DEVICE.format(ts=f'(p for p in {model}.parameters() if p.requires_grad)')}")
        module_checked = f"isinstance({model}, torch.nn.Module)"
        if module_checked in guard:
            # a module handed to another file's helper: only an nn.Module has parameters() to read
            test = f"{module_checked} and {test}"
        guard = f"({guard}) if {test} else None"
    # -- the statement must own its lines (the span is whole lines) ------------------------------
    text = _statement_text(module, stmt)
    if text is None:
        return miss("the optimizer statement shares its line with other code")
    fused = _fused_text(module, stmt, call, fused_cls, kind, plan.drop)
    # NpuFusedSGD has no lr default: torch.optim.SGD's is passed. Beside a ``**mapping`` it goes INTO the
    # mapping, under the mapping's own keys (a keyword after it raised "got multiple values for keyword
    # argument 'lr'" wherever the mapping holds lr: timm's opt_args always does; audit33)
    splats = [k for k in call.keywords if k.arg is None]
    lr_in_splat = kind == "SGD" and keyword(call, "lr", 1) is None and bool(splats)
    if lr_in_splat and len(splats) > 1:
        return miss("torch.optim.SGD's lr default would have to be merged into one of several `**` mappings")
    if plan.runtime is not None:
        mapping, _taken, filtered = plan.runtime
        star = re.compile(r"\*\*\s*" + re.escape(mapping) + r"(?![\w.])")
        if len(star.findall(fused)) != 1:
            return miss(f"`**{mapping}` is written more than once in the statement")
        lr_first = "'lr': 1e-3, " if lr_in_splat else ""
        fused = star.sub(lambda _m: f"**{{{lr_first}**{{_k: _v for _k, _v in {mapping}.items() if _k not in {filtered!r}}}}}"
                         if lr_first else f"**{{_k: _v for _k, _v in {mapping}.items() if _k not in {filtered!r}}}", fused)
    elif lr_in_splat:
        written = segment(module, splats[0].value)
        star = re.compile(r"\*\*\s*" + re.escape(written) + r"(?![\w.])")
        if len(star.findall(fused)) != 1:
            return miss(f"`**{written}` is written more than once in the statement")
        fused = star.sub(lambda _m: f"**{{'lr': 1e-3, **{written}}}", fused)
    fused += fix.statements()
    lr_given = keyword(call, "lr", 1) is not None
    params = {
        "optimizer": f"torch.optim.{kind}",
        "fused_class": f"torch_npu.optim.{fused_cls}",
        "args": {k.arg: segment(module, k.value) for k in call.keywords if k.arg and k.arg != "params" and k not in plan.drop}
        | {accepted[i - 1]: segment(module, a) for i, a in enumerate(call.args) if i > 0 and not isinstance(a, ast.Starred)},
        "params": segment(module, keyword(call, "params", 0)),  # type: ignore[arg-type]
        "param_groups": _is_groups(module, scope, keyword(call, "params", 0), stmt.lineno),  # type: ignore[arg-type]
        "guard": (("fresh_generator_trainable_dtypes_checked" if dtype_checked else "fresh_generator") if model else "materialised_list")
        + ("_kwargs_checked" if plan.runtime is not None else ""),
        "lr_default_added": kind == "SGD" and not lr_given,
    }
    risks = [
        Risk("other", "about 70% more device memory for the optimizer (msFmkTransplt's advice table): params, grads "
             "and states are copied into combined flat buffers at the first step"),
        Risk("other", "params without a grad at the first step are excluded from the combined buffers for good "
             "(never updated: layers unfrozen later, and parameters a step may leave unused: a submodule or stage drawn at "
             "random per step, layer drop, MoE experts no token reached in the first batch); params/grads must never be re-allocated afterwards "
             "(.cpu()/.to(), new Parameter, p.grad = ..., load_state_dict into new tensors)"),
        Risk("dtype", "params must be float32 or float16 (bf16 raises TypeError at the first step); mixed fp32/fp16 params "
             "get one buffer each" + (": the guard checks the dtype of the trainable parameters it can read without consuming "
                                      "an iterator when the optimizer "
                                      "is built (else the original optimizer runs); a cast after that is not seen"
                                      if "requires_grad" in guard else "")),
    ]
    risks += fix.risks()
    if tiers[2].uncalled_reallocation is not None:
        ln, fn = tiers[2].uncalled_reallocation
        risks.append(Risk("other", f"`{fn}` re-allocates parameters or grads (`.data =` / `.grad =` at line {ln}); nothing in this "
                          "file calls it, but if other code runs it on these parameters after the optimizer's first step, the "
                          "fused optimizer's combined buffers go stale"))
    if sharded_when is not None:
        test, in_body, where = sharded_when
        risks.append(Risk("other", f"FSDP/DeepSpeed/ZeRO (or DDP's {_BUCKET_VIEW}) is chosen at run time ({where}, when `{test}` is "
                          f"{'true' if in_body else 'false'}): it flattens the parameters or re-assigns the grads behind the optimizer, so the guard "
                          "runs the fused optimizer only when that test says no sharding; sharded runs keep torch.optim"))
        params["guard"] += "_unsharded_runs_only"
    if skip_names:
        params["skip_classes_checked"] = skip_names
        params["guard"] += "_skipping_classes_checked"
        notes.append(_fused_optimizer_s51a.skip_note(model, skip_names))
    if prepared is not None:
        risks.append(Risk("other", f"the optimizer goes through `{prepared[1]}.prepare` (line {prepared[0]}): accelerate's "
                          "AcceleratedOptimizer.zero_grad() passes set_to_none=True, which the fused class rejects "
                          "(ValueError); any zero_grad() on it must pass set_to_none=False"))
    notes = [
        "alternative (field lesson 9): torch.optim." + kind + "(..., fused=True) where the installed torch_npu registers "
        "the fused kernel for NPU; it keeps torch.optim semantics (zero_grad(set_to_none=True) allowed, bf16 params)",
        "zero_grad(): the fused class's default is set_to_none=False (grads are zeroed in place and stay allocated), "
        "unlike torch.optim >= 2.0 whose default frees them",
        "optimizer state: 'step' is a Python int in the fused class (a tensor in torch.optim); check checkpoint save/load",
        "the guard "
        + ("makes a fresh `" + model + ".parameters()` generator, so the user's iterator is never consumed" if model
           else "reads the params as a list (an opaque iterable is materialised once into a list with a walrus, so both "
           "branches see the same parameters); a param group whose params are not a list or tuple is not read by it"),
    ]
    if lightning_self is not None:
        params["guard"] += "_lightning_strategy_checked"
        notes.append("built in a LightningModule: the guard keeps torch.optim when the attached Trainer's strategy "
                     f"shards ({', '.join(_LIGHTNING_SHARDED_WORDS)} in its class name: FSDP/DeepSpeed/model-parallel "
                     "strategies flatten or re-assign the parameters and grads behind the optimizer)")
    if prepared is not None:
        params["guard"] += "_accelerate_launch_checked"
        if moved is not None:
            params["device_tested"] = f"{prepared[1]}.device"
            notes.append(f"built before `{prepared[1]}.prepare` (line {prepared[0]}) moves the model: the guard tests "
                         f"`{prepared[1]}.device` (where the model will train; the fused class builds its buffers at the first "
                         "step), not the parameters' device at the construction")
        params["accelerate_prepare"] = f"line {prepared[0]}"
        notes.append(ACCELERATE_LAUNCH_NOTE)
    if chosen:
        notes.append(f"`{chosen[0][1]}.to({chosen[0][2]})` (line {chosen[0][0]}) casts the model to a dtype chosen at run time "
                     "(bfloat16 in some runs): the guard checks that every trainable parameter is fp32/fp16, else the "
                     "original optimizer runs")
    elif dtype_checked and not peft:
        notes.append("the model is cast to bfloat16 under a condition before the optimizer is built (in some runs): the "
                     "guard checks that every trainable parameter is fp32/fp16, else the original optimizer runs")
    elif dtype_checked:
        notes.append(f"`{model}` is a peft model over a bf16 base: the frozen base never gets grads (the fused class "
                     "only takes params with grads), peft upcasts adapters to fp32; the guard also checks at run time "
                     "that every trainable parameter is fp32/fp16 (modules_to_save copies stay bf16: then the original runs)")
    dropped = [f"{k.arg}={segment(module, k.value)}" if k.arg else f"**{segment(module, k.value)}" for k in plan.drop]
    if dropped:
        params["dropped"] = dropped
        notes.append(f"dropped from the fused call: {', '.join(dropped)} (it picks torch.optim's implementation or "
                     "states a default; the fused class computes the same update without it)")
    notes += plan.notes + fix.notes()
    if single is not None:
        notes.append("low value: " + single)
        params["single_tensor"] = True
    for fn, ln, call_line in ran_before:
        notes.append(f"`{fn}` re-allocates parameters or grads (line {ln}) but runs only at line {call_line}, before the "
                     "optimizer is built (the fused class reads its parameters at construction and its first step)")
    if any(k.arg == "fused" or k.arg is None for k in plan.drop):
        notes.append("the call may ask for torch.optim's own fused kernel (fused=True); torch_npu 2.14 registers "
                     "_fused_adam_/_fused_adamw_/_fused_sgd_ for NPU, so that path is fused already there: measure "
                     "both with `npufuse verify e2e` before keeping the flat-buffer class")
    if any(k.arg == "capturable" for k in plan.drop):
        notes.append("capturable= only keeps torch.optim's step count on the device for graph capture (no graph is "
                     "captured in this file); the fused class keeps a Python int")
    if flag_tests:
        params["guard"] += "_set_to_none_flag_checked"
        notes.append("zero_grad(set_to_none=...) with a run-time flag (" + ", ".join(f"`{t}` at line {ln}" for ln, t in flag_tests)
                     + "): the guard runs the fused class only when the flag is false where the optimizer is built (the "
                     "fused class raises ValueError on set_to_none=True); runs that free grads keep torch.optim")
        risks.append(Risk("other", "the set_to_none flag is read once where the optimizer is built: if the code changes it "
                          "later in the run, the fused optimizer would get set_to_none=True (ValueError)"))
    if chosen_class is not None:
        params["class_chosen_at_run_time"] = chosen_class[1]
        params["guard"] += "_class_checked"
        notes.append(f"the optimizer class is chosen at run time: the guard runs torch_npu.optim.{fused_cls} only when "
                     f"`{chosen_class[1]}`; any other choice keeps its own class")
    if params["lr_default_added"]:
        notes.append("NpuFusedSGD has no lr default: torch.optim.SGD's lr=1e-3 is passed explicitly")
    if star_test is not None:
        params["starred_args"] = star_test
        params["guard"] += "_starred_length_checked"
        notes.append(f"positional arguments through `*` fill the same slots in torch.optim's and the fused class's "
                     f"constructors (same positional order, spec §10); the guard checks `{star_test}` (a list or tuple "
                     "that fits the fused class's positional parameters), else the original call runs")
    return Finding(
        pattern=_ID,
        qualname=scope.qualname,
        line=line,
        end_line=end,
        params=params,
        fused=fused,
        guard_tensor=guard,
        confidence="high" if model else "medium",
        variant=f"{kind.lower()}_{'groups' if params['param_groups'] else 'params'}",
        risks=risks,
        notes=notes,
        training_ok=True,
    )


def _is_groups(module: ModuleInfo, scope: Scope, node: Optional[ast.expr], line: int) -> bool:
    """Is the params argument a list of param-group dicts?"""
    if node is None:
        return False
    value = scope.resolve(node, line) if isinstance(node, ast.Name) else node
    if isinstance(value, (ast.List, ast.Tuple)):
        return any(isinstance(e, ast.Dict) for e in value.elts)
    if isinstance(value, ast.ListComp):
        return isinstance(value.elt, ast.Dict)
    return False


def _statement_text(module: ModuleInfo, stmt: ast.stmt) -> Optional[str]:
    """The statement's whole lines, if it is the only code on them."""
    lines = module.lines  # numbered as ast numbers them
    first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
    head = lines[first - 1]
    indent = len(head) - len(head.lstrip())
    if len(head[:indent].encode()) != stmt.col_offset:
        return None  # something precedes the statement on its first line (`if x: opt = ...`, `a = 1; opt = ...`)
    tail = lines[last - 1].encode()
    rest = tail[stmt.end_col_offset or 0 :].decode(errors="replace").strip()
    if rest and not rest.startswith("#"):
        return None
    return "".join(lines[first - 1 : last])


def _side_effect_free(node: ast.AST) -> bool:
    """An expression whose evaluation calls nothing (names, attributes, constants, operators):
    dropping it from the fused call drops no work."""
    return not any(isinstance(n, (ast.Call, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom, ast.Lambda))
                   for n in fast_walk(node))


def _droppable(name: Optional[str], value: ast.AST, graph_line: Optional[int]) -> bool:
    """Is ``name=value`` a keyword the fused class computes the same update without?"""
    # s46: a value asking the runtime a question (``fused=flag and torch.cuda.is_available()``) is dropped too
    if name in _ANY_VALUE and (_side_effect_free(value) or _fused_optimizer_s46a.runtime_query(value)):
        if name == "capturable" and graph_line is not None:
            v = const_value(value)
            return v is False or v is None  # captured graphs need it; its default still goes
        return True
    v = const_value(value)
    return name in _DROPPABLE and type(v) in (bool, type(None)) and v in _DROPPABLE[name]


def _graph_capture_line(module: ModuleInfo) -> Optional[int]:
    """Line of the first graph capture in the file (``torch.cuda.graph(...)``, ``CUDAGraph()``,
    ``make_graphed_callables``...), cached on the module."""
    cached = module.__dict__.get("_npufuse_optim_graph")
    if cached is None:
        cached = 0
        src = module.source
        if "graph" in src.lower():
            for n in fast_walk(module.tree):
                if isinstance(n, ast.Call):
                    name = module.canonical(n.func) or ""
                    last = name.rsplit(".", 1)[-1]
                    if last in _GRAPH_CAPTURE or name in ("torch.cuda.graph", "torch.npu.graph", "torch_npu.npu.graph"):
                        cached = n.lineno
                        break
        module.__dict__["_npufuse_optim_graph"] = cached
    return cached or None


class _KeywordPlan:
    """What becomes of each keyword argument of the optimizer call in the fused call: ``drop``
    (implementation choices, cut from the text), ``notes``, or ``reason`` why the call cannot be
    swapped. A ``**extra`` mapping is followed to its definitions in the same function: its keys
    must all be droppable (then ``**extra`` is dropped) or all be arguments the fused class takes."""

    def __init__(self, module: ModuleInfo, scope: Scope, call: ast.Call, line: int,
                 accepted: tuple[str, ...], fused_cls: str) -> None:
        self.drop: list[ast.keyword] = []
        self.notes: list[str] = []
        self.reason: Optional[str] = None
        # `**mapping` whose keys only the run time knows: (its source, the keys the fused branch may
        # pass on, the keys it filters out). The guard checks the keys; the fused call filters them.
        self.runtime: Optional[tuple[str, tuple[str, ...], tuple[str, ...]]] = None
        graph = _graph_capture_line(module)
        for k in call.keywords:
            if k.arg is None:
                self._star(module, scope, k, line, accepted, fused_cls, graph)
            elif _droppable(k.arg, k.value, graph):
                self.drop.append(k)
            elif k.arg == "capturable" and graph is not None:
                self.reason = (f"`capturable={segment(module, k.value)}` with a graph captured in this file (line {graph}): "
                               f"a captured optimizer step needs its step count on the device; torch_npu.optim.{fused_cls} "
                               "keeps a Python int")
            elif k.arg in _UNSUPPORTED_KW:
                self.reason = (f"`{k.arg}={segment(module, k.value)[:40]}` changes what torch.optim computes "
                               f"(maximize: ascent; differentiable: autograd through the step; decoupled_weight_decay: "
                               f"AdamW's decay) and torch_npu.optim.{fused_cls} has no such argument")
            elif k.arg not in accepted and k.arg != "params":
                self.reason = f"`{k.arg}=` has no counterpart in torch_npu.optim.{fused_cls}"
            if self.reason is not None:
                return

    def _star(self, module: ModuleInfo, scope: Scope, k: ast.keyword, line: int, accepted: tuple[str, ...],
              fused_cls: str, graph: Optional[int]) -> None:
        name = k.value.id if isinstance(k.value, ast.Name) else None
        text = segment(module, k.value)
        keys = _mapping_keys(scope, name, line) if name else None
        if keys is None and self.runtime is None and _side_effect_free(k.value) and (dotted(k.value) or _constant_subscript(k.value)):
            # an opaque mapping (a parameter, a config's dict, one updated in place): checked at run
            # time. Implementation choices are filtered out of the fused call (the same update);
            # any other key the fused class does not take keeps torch.optim
            filtered = ("foreach", "fused") + (("capturable",) if graph is None else ())
            self.runtime = (text, tuple(a for a in accepted if a != "params"), filtered)
            self.notes.append(f"`**{text}`: its keys are known only at run time; the guard runs the fused class only "
                              f"when they are among {', '.join(self.runtime[1])} (taken) and {', '.join(filtered)} "
                              "(implementation choices, filtered out of the fused call); otherwise torch.optim runs")
            return
        if keys is None:
            self.reason = (f"keyword arguments passed through `**{text}` (not a dict built in this function from "
                           "literal keys): they may carry maximize=/differentiable=, which change the update, and "
                           "npufuse cannot check them against the fused class")
            return
        if all(_droppable(key, value, graph) for key, value in keys):
            self.drop.append(k)
            self.notes.append(f"`**{text}` only ever holds {', '.join(sorted({key for key, _ in keys})) or 'nothing'} "
                              "(its definitions in this function): implementation choices, dropped with it")
        elif all(key in accepted for key, _ in keys):
            self.notes.append(f"`**{text}` only ever holds {', '.join(sorted({key for key, _ in keys}))}: "
                              f"arguments torch_npu.optim.{fused_cls} takes, passed on")
        else:
            bad = sorted({key for key, value in keys if not _droppable(key, value, graph) and key not in accepted})
            self.reason = (f"`**{text}` may carry {', '.join(f'{b}=' for b in bad) or 'keys'} (its definitions in this "
                           f"function), which torch_npu.optim.{fused_cls} does not take or which change the update"
                           if bad else f"`**{text}` mixes implementation choices and arguments of the update")


def _mapping_keys(scope: Scope, name: str, line: int) -> Optional[list[tuple[str, ast.expr]]]:
    """(key, value) of every entry ``name`` can hold at ``line``: each of its assignments in the
    scope is ``dict(k=v, ...)``, a ``{"k": v}`` literal or a conditional of those, and nothing
    mutates it (``name[...] = ``, ``name.update(...)``); None when that is not so."""
    found = [v for st, v in scope.assignments.get(name, []) if st.lineno < line]
    if not found:
        return None  # a parameter, a global, or built elsewhere
    for n in fast_walk(scope.node):
        if isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.value, ast.Name) and n.value.id == name:
            if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store):
                return None
            if isinstance(n, ast.Attribute) and n.attr in ("update", "setdefault", "__setitem__", "pop", "popitem", "clear", "__ior__"):
                return None
        if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name) and n.target.id == name:
            return None
    out: list[tuple[str, ast.expr]] = []
    todo: list[ast.expr] = list(found)
    while todo:
        v = todo.pop()
        if isinstance(v, ast.IfExp):
            todo += [v.body, v.orelse]
        elif isinstance(v, ast.Dict):
            for key, val in zip(v.keys, v.values):
                if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                    return None
                out.append((key.value, val))
        elif isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "dict" and not v.args:
            for kw in v.keywords:
                if kw.arg is None:
                    return None
                out.append((kw.arg, kw.value))
        else:
            return None
    return out


def _cut_keyword(text: bytes, k0: int, k1: int) -> bytes:
    """``text`` without the keyword argument at [k0, k1) and one comma next to it; a keyword alone
    on its line takes its line with it."""
    after = text[k1:]
    gap = len(after) - len(after.lstrip(b" \t"))
    if after[gap:gap + 1] == b",":
        end = k1 + gap + 1
        line_start = text.rfind(b"\n", 0, k0) + 1
        rest = text[end:]
        if not text[line_start:k0].strip() and rest.lstrip(b" \t")[:1] in (b"\n", b"\r"):
            nl = text.find(b"\n", end)
            return text[:line_start] + text[nl + 1:]  # the whole line
        return text[:k0] + rest.lstrip(b" \t")
    before = text[:k0].rstrip(b" \t\r\n")
    if before.endswith(b","):
        before = before[:-1]
    return before + text[k1:]


def _fused_text(module: ModuleInfo, stmt: ast.stmt, call: ast.Call, fused_cls: str, kind: str, drop: list[ast.keyword]) -> str:
    """The statement with the optimizer class swapped (byte offsets: ast columns are UTF-8)."""
    lines = module.lines  # numbered as ast numbers them
    first = stmt.lineno
    raw = [ln.encode() for ln in lines[first - 1 : (stmt.end_lineno or first)]]

    def offset(lineno: int, col: int) -> int:
        return sum(len(r) for r in raw[: lineno - first]) + col

    blob = b"".join(raw)
    f0 = offset(call.func.lineno, call.func.col_offset)
    f1 = offset(call.func.end_lineno or call.func.lineno, call.func.end_col_offset or 0)
    c1 = offset(call.end_lineno or call.lineno, call.end_col_offset or 0) - 1  # the closing parenthesis
    tail_add = b""
    if kind == "SGD" and keyword(call, "lr", 1) is None and not any(k.arg is None for k in call.keywords):  # (else: in the mapping)
        inside = blob[:c1].rstrip()
        tail_add = b" lr=1e-3" if inside.endswith(b",") or inside.endswith(b"(") else b", lr=1e-3"
    new = blob[:f0] + f"torch_npu.optim.{fused_cls}".encode() + blob[f1:c1] + tail_add + blob[c1:]
    # keywords the fused class does not take but that change nothing (foreach=False, ...): cut
    # out with the comma after them (or before them, for the last argument)
    shift = len(f"torch_npu.optim.{fused_cls}".encode()) - (f1 - f0)
    for k in sorted(drop, key=lambda k: (k.lineno, k.col_offset), reverse=True):
        k0 = offset(k.lineno, k.col_offset) + shift
        k1 = offset(k.end_lineno or k.lineno, k.end_col_offset or 0) + shift
        new = _cut_keyword(new, k0, k1)
    out = new.decode()
    head = out.splitlines(keepends=True)
    indent = head[0][: len(head[0]) - len(head[0].lstrip())]
    body = "".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in head)
    return body


def _assess(finding: Finding, config: dict[str, Any]) -> dict[str, Any]:
    kind = finding.params.get("optimizer", "torch.optim.AdamW").rsplit(".", 1)[-1]
    fused_b, loop_b, per_tensor = _STEP_COST.get(kind, _STEP_COST["AdamW"])
    h, layers = config.get("hidden_size"), config.get("num_hidden_layers")
    if not (h and layers):
        return symbolic(
            "launch",
            f"launch-bound: torch.optim.{kind}'s single-tensor path launches ~{per_tensor} small kernels per parameter "
            "tensor per step; the fused class a few per dtype over flat buffers. The gain grows with the number of "
            "parameter tensors (hundreds in a transformer) and shrinks if torch already runs its foreach path",
        )
    inter = config.get("intermediate_size") or 4 * h
    vocab = config.get("vocab_size") or 32000
    kv_ratio = (config.get("num_key_value_heads") or config.get("num_attention_heads") or 1) / (config.get("num_attention_heads") or 1)
    experts = config.get("num_experts") or 1
    moe_inter = config.get("moe_intermediate_size") or inter
    # a decoder layer: q, k, v, o, gate, up, down and two norms (per expert for the MLP in MoE models)
    tensors = layers * (4 + 2 + 3 * experts) + 3
    mlp = 3 * h * (moe_inter * experts if experts > 1 else inter)
    elements = layers * (2 * h * h + 2 * h * h * kv_ratio + mlp + 2 * h) + 2 * vocab * h + h
    out = estimate(
        bytes_before=elements * loop_b,
        bytes_after=elements * fused_b,
        kernels_before=tensors * per_tensor,
        kernels_after=12,
        shapes=f"~{tensors} parameter tensors, ~{elements / 1e9:.2f}B fp32 elements (decoder-layer layout assumed "
        f"from hidden={h}, layers={layers}, intermediate={inter}, vocab={vocab}); single-tensor path as the baseline",
    )
    out["estimate"] += ("; if torch.optim already runs its foreach path on this stack the launch saving is smaller, "
                        "and the memory traffic saving is the main gain")
    return out


# ---------------------------------------------------------------------------------------------
# Examples (they are the tests)
# ---------------------------------------------------------------------------------------------

_NET = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.ln(self.fc1(x))))
'''

_TRAIN_RUN = '''\
model = Net()
opt = build(model)
x, y = torch.randn(6, 8), torch.randn(6, 4)
for _ in range(3):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
out = tuple(p.detach().clone() for p in model.parameters())
'''

_HF_NO_TRAINER = _NET + '''

def build(model, weight_decay=0.01, learning_rate=5e-3):
    # Optimizer: split weights in two groups, one with weight decay and the other not.
    no_decay = ["bias", "ln.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=learning_rate)
    return optimizer
'''

_SGD_CIFAR = _NET.replace("import torch\n", "import torch\nimport torch.optim as optim\n", 1) + '''

def build(net):
    optimizer = optim.SGD(net.parameters(), lr=0.1,
                          momentum=0.9, weight_decay=5e-4, nesterov=True)
    return optimizer
'''

_LIGHTNING = _NET + '''

class LitModel(Net):
    def __init__(self, lr=1e-3):
        super().__init__()
        self.lr = lr

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr, betas=(0.9, 0.98), eps=1e-9)


def build(model):
    model.lr = 2e-3
    return LitModel.configure_optimizers(model)
'''

_FILTER_ALIAS = _NET + '''
from torch.optim import AdamW


def build(model, lr=3e-3):
    opt = AdamW(filter(lambda p: p.requires_grad, model.parameters()), lr, (0.9, 0.95), 1e-8, 0.1)
    return opt
'''

_NANOGPT = _NET + '''

class GPTLike(Net):
    def configure_optimizers(self, weight_decay, learning_rate, betas):
        # start with all of the candidate parameters
        param_dict = {pn: p for pn, p in self.named_parameters()}
        # filter out those that do not require grad
        param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
        # any parameters that is 2D will be weight decayed, otherwise no.
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {'params': decay_params, 'weight_decay': weight_decay},
            {'params': nodecay_params, 'weight_decay': 0.0}
        ]
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)
        return optimizer


def build(model):
    return GPTLike.configure_optimizers(model, 0.1, 6e-3, (0.9, 0.95))
'''

_OPAQUE = _NET + '''

def build_optimizer(params, lr=1e-2):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.05, amsgrad=True)


def build(model):
    return build_optimizer(p for p in model.parameters() if p.requires_grad)
'''

_SGD_NO_LR = _NET + '''
optimizer = None


def build(model):
    global optimizer
    optimizer = torch.optim.SGD(model.parameters(), momentum=0.9)
    return optimizer
'''

# timm's create_optimizer: the keyword arguments gathered in a dict that always holds lr (setdefault), no lr
# keyword in the call: SGD's lr default must not be passed beside the mapping (TypeError: multiple values)
_SGD_LR_IN_MAPPING = _NET + '''

def build(model, lr=0.05, weight_decay=0.0, **kwargs):
    opt_args = dict(weight_decay=weight_decay, **kwargs)
    if lr is not None:
        opt_args.setdefault('lr', lr)
    optimizer = torch.optim.SGD(model.parameters(), momentum=0.9, nesterov=True, **opt_args)
    return optimizer
'''

_KEEP_NANOGPT_TRAIN = _NET + '''
model = Net()
optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
for it in range(10):
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    # flush the gradients as soon as we can, no need for this memory anymore
    optimizer.zero_grad(set_to_none=True)
'''

# a `return` hands the optimizer out: nothing can follow it to make set_to_none=True zero in place
_KEEP_OPTIMIZER_RETURNED_SET_TO_NONE = _NET + '''

def build(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model, steps=3):
    opt = build(model)
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
'''

_EXTRA_ARGS = _NET + '''
import inspect


def configure_optimizers(model, weight_decay, learning_rate, betas, device_type):
    optim_groups = [{'params': list(model.parameters()), 'weight_decay': weight_decay}]
    fused_available = 'fused' in inspect.signature(torch.optim.AdamW).parameters
    use_fused = fused_available and device_type == 'cuda'
    extra_args = dict(fused=True) if use_fused else dict()
    optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)
    return optimizer
'''

_KEEP_FSDP = _NET + '''
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def setup(model, lr):
    model = FSDP(model, use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, optimizer
'''

_KEEP_BF16 = '''\
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-0.5B", torch_dtype=torch.bfloat16)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.0)
'''

_CAPTURABLE = _NET + '''

def build(model, graphs=False):
    # capturable keeps the step as a device tensor for CUDA-graph capture (none here): the same update
    return torch.optim.Adam(model.parameters(), lr=1e-3, capturable=graphs)
'''

_KEEP_GRAD_ASSIGN = _NET + '''

def train_step(model, optimizer, batches):
    grads = None
    for x in batches:
        model(x).sum().backward()
    for p in model.parameters():
        p.grad = p.grad / len(batches)
    optimizer.step()


def build(model):
    return torch.optim.SGD(model.parameters(), lr=0.01)
'''

# A wrapper holding several optimizers, zeroed through each one's own zero_grad (BertSum/OpenNMT
# style `for op in self.optimizers: op.zero_grad()`): the loop variable's name says nothing, its
# `.step()` says it is an optimizer, and a fused optimizer's zero_grad() keeps its grads allocated.
_OPTIMIZER_LIST_WRAPPER = _NET + '''

class MultipleOptimizer:
    def __init__(self, op):
        self.optimizers = op

    def zero_grad(self):
        for op in self.optimizers:
            op.zero_grad()

    def step(self):
        for op in self.optimizers:
            op.step()


def build(model):
    return MultipleOptimizer([torch.optim.Adam(model.parameters(), lr=1e-3)])
'''

# The near miss: the same wrapper zeroing a *module* (no `.step()` on it anywhere): torch >= 2
# frees the grads there, and the fused optimizer would keep reading its stale flat buffer.
_KEEP_WRAPPER_ZEROES_A_MODULE = _NET + '''

class Trainer:
    def __init__(self, net):
        self.net = net
        self.optim = torch.optim.Adam(net.parameters(), lr=1e-3)

    def train_step(self, x):
        loss = self.net(x).mean()
        loss.backward()
        self.optim.step()
        self.net.zero_grad()
'''


# Param groups built by generator helpers over the model's modules (lightweight-pose style): the
# guard reads the module handed to the first group's helper; each helper runs once, in the branch taken.
_GROUPS_FROM_GENERATOR_HELPERS = _NET + '''

def params_of(model, kind):
    for m in model.modules():
        if isinstance(m, nn.Linear):
            yield getattr(m, kind)


def build(model):
    return torch.optim.Adam([
        {'params': params_of(model, 'weight')},
        {'params': params_of(model, 'bias'), 'lr': 2e-3, 'weight_decay': 0},
    ], lr=1e-3, weight_decay=5e-4)
'''


_MODEL_ZERO_GRAD = _NET + '''

def train(model, loader, epochs=1):
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    for _ in range(epochs):
        for x in loader:
            loss = model(x).mean()
            loss.backward()
            optimizer.step()
            model.zero_grad()
'''


# Examples from the optimizer-corpus audit (bench/audit/fused_optimizer.yaml).

# A test file: another test's FSDP wrap and bf16 model say nothing about `build`'s optimizer
# (peft's test_custom_models imports FSDP for one test class; the bf16 casts are other tests'),
# while a test that calls `build` is code that runs with it.
_OTHER_TESTS = _NET + '''
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def build(model):
    return torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)


class TestTraining:
    def test_fsdp_wrapped(self):
        model = FSDP(Net())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def test_bf16_model(self):
        model = Net().to(torch.bfloat16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer.zero_grad(set_to_none=True)

    def test_train(self):
        model = Net()
        optimizer = build(model)
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
'''

# Lightning's BoringModel file: `self.data = torch.randn(...)` is a Dataset attribute, not a
# parameter's storage being replaced.
_DATASET_ATTR = _NET + '''

class RandomDataset(torch.utils.data.Dataset):
    def __init__(self, size, length):
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return self.len


def build(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
'''

# accelerate: AcceleratedOptimizer.zero_grad() passes set_to_none=True to a wrapped optimizer
# whose zero_grad has that parameter, and NpuFusedOptimizerBase.zero_grad raises ValueError on it.
_KEEP_ACCELERATE = _NET + '''
from accelerate import Accelerator


def train(loader, epochs=1):
    accelerator = Accelerator()
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(epochs):
        for x, y in loader:
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
'''

# The same through a helper (accelerate's tests/test_accelerator.py create_components): the
# caller prepares the returned optimizer and zeroes the prepared one.
_KEEP_ACCELERATE_HELPER = _NET + '''
from accelerate import Accelerator


def create_components():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer


def test_prepared_training():
    accelerator = Accelerator()
    model, optimizer = create_components()
    model, prepared_optimizer = accelerator.prepare(model, optimizer)
    for _ in range(2):
        accelerator.backward(model(torch.randn(4, 8)).sum())
        prepared_optimizer.step()
        prepared_optimizer.zero_grad()
'''

# timm's test_lookahead_load_base_state_dict: what blocks is the grad assigned before each step,
# not the list literal (which has its tensor to guard on).
_KEEP_LIST_GRAD_ASSIGNED = '''\
import torch
from torch.nn import Parameter


def test_steps():
    param = Parameter(torch.ones(4))
    opt = torch.optim.AdamW([param], lr=1e-2)
    for _ in range(2):
        param.grad = torch.ones(4)
        opt.step()
'''

# accelerate's external_deps scripts: `optimizer_cls = AdamW if ... else DummyOptim`.
_KEEP_CLASS_CHOSEN = _NET + '''
from torch.optim import AdamW


class DummyOptim:
    def __init__(self, params, lr=1e-3):
        self.params, self.lr = list(params), lr


def build(model, engine_has_optimizer=False):
    optimizer_cls = DummyOptim if engine_has_optimizer else AdamW
    return optimizer_cls(model.parameters(), lr=1e-3)
'''

# A pytest fixture a test asks for by name is code that runs with the test's optimizer.
_KEEP_FIXTURE_BF16 = _NET + '''
import pytest


class TestTraining:
    @pytest.fixture
    def model(self):
        model = Net()
        return model.to(torch.bfloat16)

    def test_step(self, model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
        optimizer.step()
'''


# peft's test_decoder_models / test_gpu_examples: LoRA / prefix tuning over a bf16 base. Only the
# adapters (fp32) get grads; the guard checks that at run time. `LoraWrapped` stands in for peft.
_PEFT_BF16_BASE = _NET + '''

class LoraWrapped(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora = nn.Linear(8, 4)

    def forward(self, x):
        return self.base(x.to(torch.bfloat16)).float() + self.lora(x)


def get_peft_model(model, config=None):
    return LoraWrapped(model)


def build(base_model):
    base_model = base_model.to(torch.bfloat16)
    model = get_peft_model(base_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer
'''

_PEFT_RUN = '''\
model, opt = build(Net())
x, y = torch.randn(6, 8), torch.randn(6, 4)
for _ in range(3):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
out = tuple(p.detach().clone() for p in model.lora.parameters())
'''


FusedOptimizer.FUSE = [
    Fuse(_HF_NO_TRAINER, name="hf_no_trainer_param_groups", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.AdamW", "fused_class": "torch_npu.optim.NpuFusedAdamW", "param_groups": True,
        "guard": "fresh_generator", "args": {"lr": "learning_rate"}, "variant": "adamw_groups"}),
    Fuse(_SGD_CIFAR, name="cifar_sgd_nesterov_module_alias", run=_TRAIN_RUN.replace("build(model)", "build(model)"), expect={
        "optimizer": "torch.optim.SGD", "fused_class": "torch_npu.optim.NpuFusedSGD",
        "args": {"lr": "0.1", "momentum": "0.9", "weight_decay": "5e-4", "nesterov": "True"}, "lr_default_added": False}),
    Fuse(_LIGHTNING, name="lightning_configure_optimizers_return", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.Adam", "params": "self.parameters()", "guard": "fresh_generator",
        "args": {"lr": "self.lr", "betas": "(0.9, 0.98)", "eps": "1e-9"}, "qualname": "LitModel.configure_optimizers"}),
    Fuse(_FILTER_ALIAS, name="from_import_filter_positional_args", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.AdamW", "guard": "fresh_generator",
        "args": {"lr": "lr", "betas": "(0.9, 0.95)", "eps": "1e-8", "weight_decay": "0.1"}}),
    Fuse(_NANOGPT, name="nanogpt_optim_groups_named_parameters", run=_TRAIN_RUN, expect={
        "param_groups": True, "guard": "fresh_generator", "args": {"lr": "learning_rate", "betas": "betas"}}),
    Fuse(_OPAQUE, name="opaque_params_generator_materialised", run=_TRAIN_RUN, expect={
        "guard": "materialised_list", "params": "params", "args": {"lr": "lr", "weight_decay": "0.05", "amsgrad": "True"},
        "confidence": "medium"}),
    Fuse(_SGD_NO_LR, name="sgd_default_lr_made_explicit", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.SGD", "lr_default_added": True, "args": {"momentum": "0.9"}}),
    Fuse(_SGD_LR_IN_MAPPING, name="sgd_default_lr_merged_into_the_kwargs_mapping", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.SGD", "lr_default_added": True, "args": {"momentum": "0.9", "nesterov": "True"}}),
    Fuse(_OTHER_TESTS, name="other_tests_fsdp_and_bf16_do_not_count", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.AdamW", "qualname": "build", "args": {"lr": "2e-3", "weight_decay": "0.0"}}),
    Fuse(_DATASET_ATTR, name="dataset_self_data_is_not_a_parameter", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.SGD", "args": {"lr": "0.05", "momentum": "0.9"}}),
    Fuse(_PEFT_BF16_BASE, name="peft_adapters_over_bf16_base_dtype_checked", run=_PEFT_RUN, expect={
        "optimizer": "torch.optim.AdamW", "guard": "fresh_generator_trainable_dtypes_checked"}),
]

FusedOptimizer.KEEP = [
    Keep(_KEEP_OPTIMIZER_RETURNED_SET_TO_NONE, reason="set_to_none=True", name="returned_optimizer_zero_grad_set_to_none"),
    Keep(_KEEP_FSDP, reason="FSDP", name="fsdp_wrapped_model"),
    Keep(_KEEP_BF16, reason="bf16 parameters unsupported", name="hf_model_loaded_in_bf16"),
    Keep(_KEEP_GRAD_ASSIGN, reason="re-allocated", name="manual_grad_averaging"),
    Keep(_KEEP_LIST_GRAD_ASSIGNED, reason="grads are re-allocated", name="list_params_grad_assigned_each_step"),

    Keep(_KEEP_FIXTURE_BF16, reason="bf16 parameters unsupported", name="pytest_fixture_bf16_model"),
]


# -- issue 14, class 5: every torch.optim class torch_npu.optim has; param groups as arguments ----

_ADADELTA = _NET + '''

def build(model):
    return torch.optim.Adadelta(model.parameters(), lr=1.0, rho=0.95, weight_decay=1e-4)
'''

_RMSPROP_ALIAS = _NET + '''
import torch.optim as optim


def build(model):
    opt = optim.RMSprop(model.parameters(), lr=1e-2, alpha=0.9, momentum=0.5, centered=True)
    return opt
'''

_GROUPS_ARGUMENT = _NET + '''

def make_optimizer(groups, lr):
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def build(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return make_optimizer([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], 3e-3)
'''

_GROUPS_LITERAL_OF_ARGUMENTS = _NET + '''

def make_optimizer(decay, no_decay, lr=3e-3):
    return torch.optim.Adam([{"params": decay, "weight_decay": 0.01}, {"params": no_decay}], lr=lr)


def build(model):
    ps = list(model.parameters())
    return make_optimizer((p for p in ps if p.dim() >= 2), (p for p in ps if p.dim() < 2))
'''

FusedOptimizer.FUSE += [
    Fuse(_ADADELTA, name="adadelta", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.Adadelta", "fused_class": "torch_npu.optim.NpuFusedAdadelta",
        "args": {"lr": "1.0", "rho": "0.95", "weight_decay": "1e-4"}, "guard": "fresh_generator"}),
    Fuse(_RMSPROP_ALIAS, name="rmsprop_module_alias_centered", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.RMSprop", "fused_class": "torch_npu.optim.NpuFusedRMSprop",
        "args": {"lr": "1e-2", "alpha": "0.9", "momentum": "0.5", "centered": "True"}}),
    Fuse(_GROUPS_ARGUMENT, name="param_groups_passed_as_an_argument", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.AdamW", "params": "groups", "guard": "materialised_list", "qualname": "make_optimizer"}),
    Fuse(_GROUPS_LITERAL_OF_ARGUMENTS, name="param_group_literal_of_generator_arguments", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.Adam", "param_groups": True, "guard": "materialised_list"}),
]

FusedOptimizer.KEEP += [
    Keep(_NET + '''

def build(model):
    return torch.optim.Adagrad(model.parameters(), lr=1e-2)
''', reason="no fused counterpart of torch.optim.Adagrad", name="adagrad_has_no_fused_class"),
    Keep(_NET + '''

def build(model):
    return torch.optim.RMSprop(model.parameters(), lr=1e-2, differentiable=True)
''', reason="`differentiable=True` changes what torch.optim computes", name="rmsprop_differentiable"),
]

_FOREACH_OFF = _NET + '''

def build(model, learning_rate=6e-4, weight_decay=1e-1, beta1=0.9, beta2=0.95):
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=learning_rate,
        weight_decay=weight_decay,
        betas=(beta1, beta2),
        foreach=False,
    )
    return optimizer
'''

FusedOptimizer.FUSE += [
    Fuse(_FOREACH_OFF, name="foreach_false_dropped", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.AdamW", "dropped": ["foreach=False"],
        "args": {"lr": "learning_rate", "weight_decay": "weight_decay", "betas": "(beta1, beta2)"}}),
    Fuse(_NET + '''

def build(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, foreach=None, maximize=False, momentum=0.9)
''', name="default_valued_keywords_dropped_inline", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.SGD", "dropped": ["foreach=None", "maximize=False"], "args": {"lr": "0.1", "momentum": "0.9"}}),
]

FusedOptimizer.KEEP += [
    Keep(_NET + '''

def build(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, maximize=True)
''', reason="`maximize=True` changes what torch.optim computes", name="maximize_true_changes_the_math"),
]


# -- issue 14, class 5: implementation keywords, `**extra` mappings, zero_grad calls the fused
# branch makes safe ----------------------------------------------------------------------------

# nanoGPT's configure_optimizers: `**extra_args` only ever holds fused=True (or nothing)
_EXTRA_ARGS_RUN = _TRAIN_RUN.replace("opt = build(model)", "opt = configure_optimizers(model, 0.1, 6e-3, (0.9, 0.95), 'cpu')")

_FUSED_FLAG = _NET + '''

class OptimArgs:
    lr = 3e-3
    beta1, beta2 = 0.9, 0.95
    torch_adam_is_fused = True


def build(model, args=OptimArgs()):
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        fused=args.torch_adam_is_fused,  # torch's own fused kernel on CUDA
    )
    return optimizer
'''

# dcgan: two models, two optimizers, `netD.zero_grad()` / `netG.zero_grad()` in the loop
_TWO_MODELS = _NET + '''

class Other(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        return self.fc(x)


torch.manual_seed(0)
netD = Net()
netG = Other()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))


def run_steps(steps=3):
    torch.manual_seed(0)
    for _ in range(steps):
        x = torch.randn(5, 8)
        netD.zero_grad()
        netD(x).square().mean().backward()
        optimizerD.step()
        netG.zero_grad()
        netD(netG(torch.randn(5, 4))).mean().backward()
        optimizerG.step()
    return tuple(p.detach().clone() for p in (*netD.parameters(), *netG.parameters()))
'''

# word_language_model: the optimizer under a flag, `model.zero_grad()` only in the flag's else branch
_FLAG_BRANCHES = _NET + '''

class Args:
    use_optimizer = True
    lr = 5e-3


args = Args()
torch.manual_seed(0)
model = Net()
if args.use_optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)


def train(steps=3):
    for _ in range(steps):
        if args.use_optimizer:
            optimizer.zero_grad()
        else:
            model.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        if args.use_optimizer:
            optimizer.step()
        else:
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-args.lr)
    return tuple(p.detach().clone() for p in model.parameters())
'''

# accelerate's prepare + optimizer.zero_grad(); `Accelerator` here mirrors accelerate's
# AcceleratedOptimizer.zero_grad: set_to_none=True goes to a wrapped zero_grad that takes it
_ACCELERATE_LIKE = _NET + '''
import inspect


class _Wrapped:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        self.optimizer.step()

    def zero_grad(self, set_to_none=None):
        if "set_to_none" in inspect.signature(self.optimizer.zero_grad).parameters:
            # (a mapping: in a real program this code lives in accelerate, not in the scanned file)
            self.optimizer.zero_grad(**{"set_to_none": True if set_to_none is None else set_to_none})
        else:
            if set_to_none is not None:
                raise ValueError("set_to_none is not supported by this optimizer")
            self.optimizer.zero_grad()


class Accelerator:
    def prepare(self, model, optimizer):
        return model, _Wrapped(optimizer)


class Trainer:
    def __init__(self, model, lr=1e-3):
        self.accelerator = Accelerator()
        self.model = model
        self.opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.99))
        self.model, self.opt = self.accelerator.prepare(self.model, self.opt)

    def train(self, steps=3):
        for _ in range(steps):
            self.model(torch.randn(4, 8)).square().mean().backward()
            self.opt.step()
            self.opt.zero_grad()
        return tuple(p.detach().clone() for p in self.model.parameters())
'''

FusedOptimizer.FUSE += [
    Fuse(_EXTRA_ARGS, name="extra_args_mapping_of_fused_flag_dropped", run=_EXTRA_ARGS_RUN, expect={
        "optimizer": "torch.optim.AdamW", "dropped": ["**extra_args"], "param_groups": True,
        "args": {"lr": "learning_rate", "betas": "betas"}}),
    Fuse(_FUSED_FLAG, name="fused_config_flag_dropped", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.AdamW", "dropped": ["fused=args.torch_adam_is_fused"],
        "args": {"lr": "args.lr", "betas": "(args.beta1, args.beta2)"}}),
    Fuse(_CAPTURABLE, name="capturable_without_graph_capture_dropped", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.Adam", "dropped": ["capturable=graphs"]}),
    Fuse(_GROUPS_FROM_GENERATOR_HELPERS, name="param_groups_from_generator_helpers_guarded_on_the_model", run=_TRAIN_RUN,
         expect={"optimizer": "torch.optim.Adam"}),
    Fuse(_OPTIMIZER_LIST_WRAPPER, name="wrapper_zeroes_each_optimizer_by_its_own_zero_grad", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.Adam"}),
    Fuse(_MODEL_ZERO_GRAD, name="module_zero_grad_bound_to_set_to_none_false",
         run="out = tuple(p.detach().clone() for p in (train(Net(), [torch.randn(4, 8) for _ in range(3)]) or ()))\n"
             "model = Net()\ntrain(model, [torch.randn(4, 8) for _ in range(3)])\n"
             "out = tuple(p.detach().clone() for p in model.parameters())\n",
         expect={"optimizer": "torch.optim.AdamW", "args": {"lr": "5e-5"}}),
    Fuse(_TWO_MODELS, name="dcgan_two_models_each_zero_grad_patched", run="out = run_steps()\n", expect={
        "optimizer": "torch.optim.Adam", "params": "netD.parameters()", "args": {"lr": "2e-3", "betas": "(0.5, 0.999)"}}),
    Fuse(_FLAG_BRANCHES, name="module_zero_grad_only_when_the_optimizer_is_off", run="out = train()\n", expect={
        "optimizer": "torch.optim.AdamW", "args": {"lr": "args.lr"}}),
    Fuse(_ACCELERATE_LIKE, name="accelerate_prepared_zero_grad_without_set_to_none",
         run="out = Trainer(Net()).train()\n", expect={"optimizer": "torch.optim.Adam", "qualname": "Trainer.__init__"}),
]

FusedOptimizer.KEEP += [
    Keep(_EXTRA_ARGS.replace("dict(fused=True)", "dict(maximize=True)"), reason="`**extra_args` may carry maximize=",
         name="extra_args_mapping_that_changes_the_update"),
    Keep(_NET + '''

def build(model, extra):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, **extra.kwargs())
''', reason="not a dict built in this function", name="extra_mapping_from_a_call"),
    Keep(_CAPTURABLE + '''

def capture(model, opt, x):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        model(x).sum().backward()
        opt.step()
    return g
''', reason="with a graph captured in this file", name="capturable_with_graph_capture"),
    # a receiver that may hold the same parameters (an alias of the model): no proof, no rewrite
    Keep(_NET + '''

def train(model, loader):
    net = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    for x in loader:
        net(x).mean().backward()
        optimizer.step()
        net.zero_grad()
''', reason="`net.zero_grad()`", name="module_zero_grad_on_an_alias"),
]

FusedOptimizer.KEEP += [
    Keep(_NET + '''

def resolve_optimizer_factory(name):
    factories = {
        "Adam": torch.optim.Adam,
        "AdamW": torch.optim.AdamW,
    }
    return factories[name]
''', reason="handed around as a value", name="optimizer_class_in_a_registry"),
    # another optimizer takes the same model's parameters: binding model.zero_grad would change what it sees
    Keep(_NET + '''

def train(model, loader):
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(matrices, lr=5e-5)
    other_opt = torch.optim.SGD(vectors, lr=0.1)
    for x in loader:
        model(x).mean().backward()
        optimizer.step()
        other_opt.step()
        model.zero_grad()
''', reason="`model.zero_grad()`", name="module_zero_grad_with_a_second_optimizer_over_the_model"),
    # (`model.zero_grad(set_to_none=True)` on the optimizer's own model: a Fuse example now,
    # model_zero_grad_set_to_none_zeroed_in_place)
]


# -- issue 14, class 5: params that are lists by dataflow (re-iterable: the guard reads them) ----

_YOLO_GROUPS = _NET + '''

def smart_optimizer(model, name="Adam", lr=1e-3, momentum=0.9, decay=1e-5):
    g = [], [], []  # optimizer parameter groups
    bn = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)
    for v in model.modules():
        for p_name, p in v.named_parameters(recurse=False):
            if p_name == "bias":
                g[2].append(p)
            elif isinstance(v, bn):
                g[1].append(p)
            else:
                g[0].append(p)
    if name == "Adam":
        optimizer = torch.optim.Adam(g[2], lr=lr, betas=(momentum, 0.999))
    else:
        optimizer = torch.optim.SGD(g[2], lr=lr, momentum=momentum, nesterov=True)
    optimizer.add_param_group({"params": g[0], "weight_decay": decay})
    optimizer.add_param_group({"params": g[1], "weight_decay": 0.0})
    return optimizer


def build(model):
    return smart_optimizer(model)
'''

_LIST_RETURNING_HELPER = _NET + '''

def get_parameters(model):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


def build(model):
    return torch.optim.AdamW(get_parameters(model), lr=2e-3)
'''

FusedOptimizer.FUSE += [
    Fuse(_YOLO_GROUPS, name="yolo_tuple_of_lists_element_params", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.Adam", "params": "g[2]", "guard": "materialised_list", "args": {"lr": "lr", "betas": "(momentum, 0.999)"}}),
    Fuse(_LIST_RETURNING_HELPER, name="helper_returning_param_group_list", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.AdamW", "params": "get_parameters(model)", "guard": "fresh_generator"}),
]

FusedOptimizer.KEEP += [
    # a generator function's result is consumed by reading it: no tensor to guard on
    Keep(_NET + '''

def get_parameters(model):
    for p in model.parameters():
        if p.requires_grad:
            yield p


def build(model, params=None):
    return torch.optim.AdamW(get_parameters(model) if params is None else params, lr=2e-3)
''', reason="may be a one-shot iterator", name="generator_function_params"),
]


# -- issue 14, class 5: sharding chosen at run time; Lightning true-bf16 precision --------------

_CONDITIONAL_DEEPSPEED = _NET + '''
devices = 1
ds_config = {"zero_optimization": {"stage": 2}}


def DeepSpeedStrategy(config):
    return ("deepspeed", config)


def build(model, learning_rate=3e-3):
    strategy = DeepSpeedStrategy(config=ds_config) if devices > 1 else "auto"
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    return optimizer
'''

FusedOptimizer.FUSE += [
    Fuse(_CONDITIONAL_DEEPSPEED, name="deepspeed_only_when_multi_device_guarded_off", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.AdamW", "guard": "fresh_generator_unsharded_runs_only"}),
]

FusedOptimizer.KEEP += [
    # the test's name is re-bound in the function: its value at the optimizer may differ
    Keep(_CONDITIONAL_DEEPSPEED.replace("    strategy = DeepSpeedStrategy", "    devices = torch.cuda.device_count()\n    strategy = DeepSpeedStrategy"),
         reason="parameters flattened/re-allocated by FSDP/DeepSpeed/ZeRO (`DeepSpeedStrategy`", name="deepspeed_condition_rebound_in_function"),
    # sharding in both arms (or unconditional): always sharded
    Keep(_CONDITIONAL_DEEPSPEED.replace('else "auto"', 'else DeepSpeedStrategy(config={})'),
         reason="FSDP/DeepSpeed/ZeRO", name="deepspeed_in_both_arms"),
    # Lightning "bf16-true" keeps the parameters in bf16 (the fused class raises TypeError on them)
    Keep(_NET + '''

def main(fabric_cls, devices=1):
    fabric = fabric_cls(accelerator="cuda", devices=devices, precision="bf16-true")
    with fabric.init_module():
        model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return fabric.setup(model, optimizer)
''', reason="bf16 parameters unsupported", name="lightning_bf16_true_precision"),
]


# -- issue 14, class 5: third-party optimizers of torch_npu.optim's other fused classes ----------

FusedOptimizer.KEEP += [
    Keep(_NET + '''
from apex.optimizers import FusedLAMB


def build(model):
    return FusedLAMB(model.parameters(), lr=1e-3, weight_decay=0.01)
''', reason="bias-corrects the Adam moments", name="apex_fused_lamb_other_math"),
    Keep(_NET + '''
import timm.optim


def build(model):
    return timm.optim.Lamb(model.parameters(), lr=1e-3)
''', reason="timm.optim.Lamb bias-corrects", name="timm_lamb_other_math"),
    Keep(_NET + '''
from timm.optim.rmsprop_tf import RMSpropTF


def build(model):
    return RMSpropTF(model.parameters(), lr=1e-2, alpha=0.9, eps=1e-3, momentum=0.9)
''', reason="NpuFusedRMSpropTF documents the same math", name="timm_rmsproptf_no_emulator_reference"),
    Keep(_NET + '''
from pytorch_pretrained_bert.optimization import BertAdam


def build(model, t_total=1000):
    return BertAdam(model.parameters(), lr=5e-5, warmup=0.1, t_total=t_total)
''', reason="NpuFusedBertAdam documents the same math", name="bert_adam_no_emulator_reference"),
]

# a later `if isinstance(strategy, DeepSpeedStrategy):` checks for sharding; it shards nothing
_CONDITIONAL_DEEPSPEED_CHECKED = _NET + '''
devices = 1


class DeepSpeedStrategy:
    def __init__(self, config):
        self.config = config


def save(strategy, model):
    if isinstance(strategy, DeepSpeedStrategy):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        return get_fp32_state_dict_from_zero_checkpoint(".")
    return model.state_dict()


def build(model, learning_rate=3e-3):
    strategy = DeepSpeedStrategy(config={}) if devices > 1 else "auto"
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    return optimizer
'''

FusedOptimizer.FUSE += [
    Fuse(_CONDITIONAL_DEEPSPEED_CHECKED, name="deepspeed_conditional_with_isinstance_check_elsewhere", run=_TRAIN_RUN, expect={
        "guard": "fresh_generator_unsharded_runs_only"}),
]

# --- set_to_none: kept by default, zeroed in place on request (issue 14 class 5) -----------------
# An explicit zero_grad(set_to_none=True) is the code's choice (memory); torch_npu's fused class
# raises ValueError on it. By default the site is a near miss naming the option; with
# `npufuse scan --optimizer-zero-grad-in-place` (FusedOptimizer.FUSE_ZERO_IN_PLACE, run by
# tests/test_detect_optimizer_zero_grad.py with the option on) the fused branch binds zero_grad to zero
# in place. The emulator's fused zero_grad raises on set_to_none=True too, so each run there fails
# if that binding is missing.

# nanoGPT's loop: the optimizer frees the grads every step
_NANOGPT_TRAIN_SET_TO_NONE = _NET + '''

def main(steps=3):
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    for it in range(steps):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        # flush the gradients as soon as we can, no need for this memory anymore
        optimizer.zero_grad(set_to_none=True)
    return tuple(p.detach().clone() for p in model.parameters())
'''

# the model frees them (minGPT's trainer), after an in-place grad division (`p.grad /= n`)
_MODEL_SET_TO_NONE = _NET + '''

def train(steps=3, accumulation=2):
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        for _ in range(accumulation):
            model(torch.randn(4, 8)).square().mean().backward()
        for p in model.parameters():
            p.grad /= accumulation
        opt.step()
        model.zero_grad(set_to_none=True)
    return tuple(p.detach().clone() for p in model.parameters())
'''


# a wrapper (DDP-like) frees the grads of the whole model; the optimizer takes one part of the raw
# model (`raw = model.module`): the wrapper's zero_grad is bound
_HOLDER_SET_TO_NONE = _NET + '''


class Wrapped(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def train(steps=3):
    model = Wrapped(Net())
    raw = model.module
    head = torch.optim.AdamW(raw.fc2.parameters(), lr=1e-2, weight_decay=0.0)
    rest = torch.optim.SGD(raw.fc1.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        head.step()
        rest.step()
        model.zero_grad(set_to_none=True)
    return tuple(p.detach().clone() for p in model.parameters())
'''

# the reason states the fact and names the option (with its risk)
_OPT_IN_SAYS = "makes this a candidate whose fused branch rebinds that zero_grad to zero the grads in place (risk:"

FusedOptimizer.KEEP += [
    Keep(_NANOGPT_TRAIN_SET_TO_NONE, name="optimizer_zero_grad_set_to_none_kept_by_default",
         reason="raise ValueError on zero_grad(set_to_none=True) (grads must stay allocated in their flat buffer); use "
                "zero_grad() / set_to_none=False; `npufuse scan --optimizer-zero-grad-in-place` " + _OPT_IN_SAYS),
    Keep(_MODEL_SET_TO_NONE, name="model_zero_grad_set_to_none_kept_by_default",
         reason="raise ValueError on zero_grad(set_to_none=True)); pass set_to_none=False there; "
                "`npufuse scan --optimizer-zero-grad-in-place` " + _OPT_IN_SAYS),
    Keep(_HOLDER_SET_TO_NONE, name="wrapper_holding_the_params_set_to_none_kept_by_default",
         reason="`model.zero_grad(set_to_none=...)` (line 36) may set the parameters' grads to None: the next backward "
                "allocates new ones outside the fused optimizer's flat buffer and its update silently uses stale grads "
                "(torch_npu fused optimizers read grads only from that buffer and raise ValueError on "
                "zero_grad(set_to_none=True)); pass set_to_none=False there; `npufuse scan --optimizer-zero-grad-in-place` "
                + _OPT_IN_SAYS),
]

FusedOptimizer.FUSE_ZERO_IN_PLACE = [
    Fuse(_NANOGPT_TRAIN_SET_TO_NONE, name="optimizer_zero_grad_set_to_none_zeroed_in_place",
         run="out = main()\n",
         expect={"optimizer": "torch.optim.AdamW", "args": {"lr": "6e-4", "betas": "(0.9, 0.95)", "weight_decay": "0.1"}}),
    Fuse(_MODEL_SET_TO_NONE, name="model_zero_grad_set_to_none_zeroed_in_place", run="out = train()\n",
         expect={"optimizer": "torch.optim.Adam", "qualname": "train"}),
    Fuse(_HOLDER_SET_TO_NONE, name="wrapper_holding_the_params_zeroed_in_place", run="out = train()\n",
         expect={"optimizer": "torch.optim.AdamW", "params": "raw.fc2.parameters()"}),
    Fuse(_HOLDER_SET_TO_NONE.replace("model.zero_grad(set_to_none=True)", "model.zero_grad()"),
         name="wrapper_holding_the_params_zero_grad_zeroed_in_place", run="out = train()\n",
         expect={"optimizer": "torch.optim.AdamW", "params": "raw.fc2.parameters()"}),
]
# a wrapper's zero_grad() frees by default (torch >= 2.0), like model.zero_grad(): zeroed in place in both modes
FusedOptimizer.FUSE.append(FusedOptimizer.FUSE_ZERO_IN_PLACE.pop())

# near misses in both modes (FusedOptimizer.KEEP_ZERO_IN_PLACE: the option's test runs them too)
FusedOptimizer.KEEP_ZERO_IN_PLACE = [
    # the wrapper is re-bound after the optimizer is built: binding its zero_grad at the optimizer's
    # line would patch another object
    Keep(_HOLDER_SET_TO_NONE.replace("    for _ in range(steps):\n", "    model = Wrapped(raw)\n    for _ in range(steps):\n", 1),
         reason="may set the parameters' grads to None", name="wrapper_rebound_after_the_optimizer"),
    # set_to_none on an object that is neither the optimizer nor provably holds its parameters
    Keep(_NET + '''

def train(model, other, steps=3):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        other.zero_grad(set_to_none=True)
''', reason="may set the parameters' grads to None", name="unrelated_receiver_set_to_none"),
]
FusedOptimizer.KEEP += FusedOptimizer.KEEP_ZERO_IN_PLACE

# --- `**mapping` of keys known at run time (issue 14 class 5) -----------------------------------
# open_clip's `opt_kwargs.update(args.opt_kwargs or {})`, InternEvo's `extra["fused"] = True`: the
# guard checks the keys when the optimizer is built; implementation choices are filtered out

_RUNTIME_KWARGS = _NET + '''

def build(model, extra):
    extra = dict(extra)
    extra.update({"betas": (0.9, 0.95)})
    return torch.optim.AdamW([{"params": [model.fc1.weight, model.fc2.weight], "weight_decay": 0.1},
                              {"params": [model.fc1.bias, model.fc2.bias, *model.ln.parameters()], "weight_decay": 0.0}],
                             lr=1e-2, **extra)
'''

FusedOptimizer.FUSE += [
    Fuse(_RUNTIME_KWARGS, name="runtime_kwargs_checked_and_filtered",
         run=_TRAIN_RUN.replace("opt = build(model)", "opt = build(model, {'eps': 1e-7, 'fused': False})"),
         expect={"optimizer": "torch.optim.AdamW", "guard": "fresh_generator_kwargs_checked"}),
    Fuse(_NET + '''

def build(model, extra=None):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, **extra)
''', name="caller_mapping_checked_at_run_time", run=_TRAIN_RUN.replace("opt = build(model)", "opt = build(model, {'foreach': False})"),
         expect={"guard": "fresh_generator_kwargs_checked"}),
]

# --- params from a helper of another file (issue 14 class 5) ------------------------------------
# ShuffleNet's `SGD(get_parameters(model), ...)` with `from utils import get_parameters`: the
# helper's result may be a generator; the guard reads a fresh `model.parameters()` instead
_IMPORTED_HELPER = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def build(model):
    return torch.optim.SGD(get_param_groups(model), lr=1e-2, momentum=0.9, weight_decay=1e-4)
'''
# the run defines the helper as another module would: a generator of param groups
_IMPORTED_HELPER_RUN = '''\
def get_param_groups(m):
    yield {"params": [p for n, p in m.named_parameters() if n.endswith("weight")]}
    yield {"params": [p for n, p in m.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}


''' + _TRAIN_RUN

FusedOptimizer.FUSE += [
    Fuse(_IMPORTED_HELPER, name="params_from_a_helper_of_another_file", run=_IMPORTED_HELPER_RUN,
         expect={"optimizer": "torch.optim.SGD", "params": "get_param_groups(model)", "guard": "fresh_generator"}),
]

FusedOptimizer.KEEP += [
    # without `import torch` the guard cannot check that the argument is an nn.Module
    Keep('''\
import torch.optim as optim


def build(model):
    return optim.SGD(get_param_groups(model), lr=1e-2)
''', reason="may be a one-shot iterator", name="params_from_a_helper_without_torch_bound"),
]

# --- a dtype chosen at run time (issue 14 class 5) ------------------------------------------------
# picotron: `dtype = torch.bfloat16 if <cuda has bf16> else torch.float32; model.to(dtype)` before
# the optimizer: the guard checks the trainable parameters' dtypes when the optimizer is built
_RUN_TIME_DTYPE = _NET + '''
use_bf16 = False


def build(model):
    dtype = torch.bfloat16 if use_bf16 else torch.float32
    model.to(dtype)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)
'''

FusedOptimizer.FUSE += [
    Fuse(_RUN_TIME_DTYPE, name="dtype_chosen_at_run_time_checked_by_the_guard", run=_TRAIN_RUN,
         expect={"optimizer": "torch.optim.AdamW", "guard": "fresh_generator_trainable_dtypes_checked"}),
]

FusedOptimizer.KEEP += [
    # the cast comes after the construction: a check at construction would see fp32 and pass
    Keep(_RUN_TIME_DTYPE.replace("    model.to(dtype)\n    return torch.optim.AdamW(model.parameters(), lr=1e-3)\n",
                                 "    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)\n    model.to(dtype)\n    return opt\n"),
         reason="may cast the parameters to bfloat16", name="dtype_chosen_at_run_time_cast_after_the_optimizer"),
]

# --- a re-allocation in a helper nothing in the file calls (issue 14 class 5) ---------------------
# Chinese-CLIP's training main.py defines `convert_models_to_fp32(model)` (`p.data = p.data.float()`)
# and never calls it (other files import it for evaluation): it cannot touch the optimizer main()
# builds. A stated risk, not a refusal; called after the construction it still refuses.
_UNCALLED_REALLOCATION = _NET + '''


def convert_models_to_fp32(model):
    for p in model.parameters():
        p.data = p.data.float()


def main(steps=3):
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return tuple(p.detach().clone() for p in model.parameters())


if __name__ == "__main__":
    main()
'''

FusedOptimizer.FUSE += [
    Fuse(_UNCALLED_REALLOCATION, name="reallocation_in_a_helper_the_file_never_calls", run="out = main()\n",
         expect={"optimizer": "torch.optim.AdamW", "qualname": "main"}),
]

FusedOptimizer.KEEP += [
    Keep(_UNCALLED_REALLOCATION.replace("        optimizer.step()\n", "        optimizer.step()\n        convert_models_to_fp32(model)\n"),
         reason="parameters are re-allocated (`.data = ...` at line 20)", name="reallocation_in_a_helper_called_in_the_loop"),
    # the optimizer is built in a library function other files call: they may call the helper too
    Keep(_UNCALLED_REALLOCATION.replace('if __name__ == "__main__":\n    main()\n', ""),
         reason="parameters are re-allocated (`.data = ...` at line 20)", name="reallocation_in_a_helper_beside_a_library_builder"),
]

# --- an optimizer class bound to a name and called in the same function (issue 14 class 5) --------
# the construction is the site; its guard tests which class was chosen (_chosen_construction)
_CHOSEN_BY_IF = _NET + """

def build(model, use_8bit=False):
    if use_8bit:
        import bitsandbytes as bnb
        optimizer_cls = bnb.optim.AdamW8bit
    else:
        optimizer_cls = torch.optim.AdamW
    optimizer = optimizer_cls(model.parameters(), lr=1e-2, weight_decay=1e-2)
    return optimizer
"""
_CHOSEN_FROM_DICT = _NET + """

class RowWise(torch.optim.SGD):  # the repo's own variant (not a torch.optim class)
    pass


def run(model, name="sgd"):
    opts = {"sgd": torch.optim.SGD, "rowwise": RowWise, "adagrad": torch.optim.Adagrad}
    return opts[name](model.parameters(), lr=0.1)
"""
_TRAIN_STEPS = ("for _ in range(3):\n    model(torch.randn(4, 8)).square().mean().backward()\n    opt.step()\n    opt.zero_grad()\n"
                "out = tuple(p.detach().clone() for p in model.parameters())\n")
FusedOptimizer.FUSE += [
    Fuse(_CHOSEN_BY_IF, name="optimizer_class_chosen_by_if_and_built_here", run="model = Net()\nopt = build(model)\n" + _TRAIN_STEPS,
         expect={"optimizer": "torch.optim.AdamW", "class_chosen_at_run_time": "optimizer_cls is torch.optim.AdamW"}),
    Fuse(_CHOSEN_FROM_DICT, name="optimizer_class_from_a_dict_built_here", run="model = Net()\nopt = run(model)\n" + _TRAIN_STEPS,
         expect={"optimizer": "torch.optim.SGD", "class_chosen_at_run_time": "opts[name] is torch.optim.SGD"}),
]
FusedOptimizer.KEEP += [
    # (s39: two torch.optim classes among a dict's entries called at once take s32's class guard:
    # `s39_optimizer_class_from_a_dict_of_two_fusable`)
    # the dict gains entries at run time: what `opts[name]` is cannot be read from its literal
    Keep(_CHOSEN_FROM_DICT.replace("    return opts[name]", "    opts.update(EXTRA)\n    return opts[name]"),
         reason="its value may change outside these bindings", name="optimizer_class_dict_updated"),
    # the key calls code: testing the choice would run it twice
    Keep(_CHOSEN_FROM_DICT.replace("opts[name](", "opts[name.lower()]("),
         reason="the dict key calls code", name="optimizer_class_dict_key_calls_code"),
]

# --- a re-allocation that runs before the optimizer is built (issue 14 class 5) -------------------
# Chinese-CLIP's main(): `convert_models_to_fp32(model)` (`p.data = p.data.float()`) at line 103,
# the optimizer at line 158; the fused class reads the parameters at construction and first step.
FusedOptimizer.FUSE += [
    Fuse(_UNCALLED_REALLOCATION.replace("    model = Net()\n", "    model = Net()\n    convert_models_to_fp32(model)\n"),
         name="reallocation_in_a_helper_called_before_the_optimizer", run="out = main()\n",
         expect={"optimizer": "torch.optim.AdamW", "qualname": "main"}),
]

FusedOptimizer.KEEP += [
    # called before AND after the construction (a second call later): still refused
    Keep(_UNCALLED_REALLOCATION.replace("    model = Net()\n", "    model = Net()\n    convert_models_to_fp32(model)\n").replace(
        "    return tuple(", "    convert_models_to_fp32(model)\n    optimizer.step()\n    return tuple("),
         reason="parameters are re-allocated (`.data = ...` at line 20)", name="reallocation_in_a_helper_called_before_and_after"),
]

# --- wrapper classes that free the grads of the optimizers they hold (issue 14 class 5) ---------
# OpenNMT-style: a class of the file frees the grads of the optimizers it is built with
# (`for op in self.optimizers: op.zero_grad(set_to_none)`, `for p in self.params: p.grad = None`);
# an optimizer of the same file never handed to it is not concerned (dataflow, not names).

_WRAPPER_CLASS = _NET + '''

class ManyOptimizers:
    def __init__(self, optimizers):
        self.optimizers = optimizers

    def zero_grad(self, set_to_none=True):
        for op in self.optimizers:
            op.zero_grad(set_to_none)

    def step(self):
        for op in self.optimizers:
            op.step()


def build(model, kind="sgd", lr=1e-2):
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        optimizer = torch.optim.SGD(params, lr=lr)
    elif kind == "adadelta":
        optimizer = torch.optim.Adadelta(params, lr=lr)
    else:
        optimizer = ManyOptimizers([torch.optim.Adam(params, lr=lr), torch.optim.Adagrad(params, lr=lr)])
    return optimizer
'''

# the instance's own parameters freed by a loop over what it holds, in a class built only from
# other objects' constructions
_WRAPPER_GRAD_NONE = _NET + '''

class Holder:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def zero_grad(self):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None


def build(model, lr=1e-2):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    spare = Holder(torch.optim.SGD(model.fc1.parameters(), lr=lr))
    return opt, spare
'''

FusedOptimizer.FUSE += [
    Fuse(_WRAPPER_CLASS, name="optimizer_never_handed_to_a_freeing_wrapper_class",
         run="model = Net()\nopt = build(model)\nfor _ in range(3):\n    model(torch.randn(4, 8)).square().mean().backward()\n"
             "    opt.step()\n    opt.zero_grad()\nout = tuple(p.detach().clone() for p in model.parameters())\n",
         expect={"optimizer": "torch.optim.SGD", "qualname": "build"}),
    Fuse(_WRAPPER_GRAD_NONE, name="optimizer_never_handed_to_a_class_setting_grads_to_none",
         run="model = Net()\nopt, _spare = build(model)\nfor _ in range(3):\n    model(torch.randn(4, 8)).square().mean().backward()\n"
             "    opt.step()\n    opt.zero_grad()\nout = tuple(p.detach().clone() for p in model.parameters())\n",
         expect={"optimizer": "torch.optim.AdamW", "qualname": "build"}),
]
FusedOptimizer.KEEP += [
    # the same class given this optimizer (inline, or by the name it is bound to): its grads are freed
    Keep(_WRAPPER_CLASS.replace('''    if kind == "sgd":
        optimizer = torch.optim.SGD(params, lr=lr)
    elif kind == "adadelta":
        optimizer = torch.optim.Adadelta(params, lr=lr)
    else:
''', '''    if kind == "sgd":
        optimizer = ManyOptimizers([torch.optim.SGD(params, lr=lr)])
    else:
'''), name="optimizer_handed_inline_to_a_freeing_wrapper_class",
         reason="`op.zero_grad(set_to_none=...)` (line 23) may set the parameters' grads to None"),
    Keep(_WRAPPER_GRAD_NONE.replace("    spare = Holder(torch.optim.SGD(model.fc1.parameters(), lr=lr))\n",
                                    "    spare = Holder(opt)\n"),
         name="optimizer_handed_by_name_to_a_class_setting_grads_to_none",
         reason="grads are re-allocated (`.grad = ...` at line 24)"),
    # a wrapper built from something npufuse cannot tell apart from this optimizer (a parameter)
    Keep(_WRAPPER_GRAD_NONE.replace("    spare = Holder(torch.optim.SGD(model.fc1.parameters(), lr=lr))\n",
                                    "    spare = Holder(model.extra_optimizer)\n"),
         name="wrapper_built_from_an_opaque_object",
         reason="grads are re-allocated (`.grad = ...` at line 24)"),
]

# accelerate-style `optimizer_cls = DummyOptim if engine_has_optimizer else AdamW`: the fused class
# only where AdamW is chosen
FusedOptimizer.FUSE.append(
    Fuse(_KEEP_CLASS_CHOSEN, name="optimizer_class_chosen_at_run_time",
         run="model = Net()\nopt = build(model)\n" + _TRAIN_STEPS,
         expect={"optimizer": "torch.optim.AdamW", "class_chosen_at_run_time": "optimizer_cls is AdamW"}))

# --- sparse embedding grads (issue 14 class 5) --------------------------------------------------
# dlrm's `nn.EmbeddingBag(n, m, mode="sum", sparse=True)`: sparse grads cannot go into the fused
# class's dense flat buffer (spec 10); a flag says it depends on the run
_SPARSE_EMBEDDING = """\
import torch
import torch.nn as nn


class Ranker(nn.Module):
    def __init__(self, rows, dim, sparse=True):
        super().__init__()
        self.emb = nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse)
        self.top = nn.Linear(dim, 1)

    def forward(self, idx, offsets):
        return self.top(self.emb(idx, offsets))


def build(model, lr=0.1):
    return torch.optim.SGD(model.parameters(), lr=lr)
"""
FusedOptimizer.KEEP += [
    Keep(_SPARSE_EMBEDDING, name="sparse_embedding_grads_by_flag",
         reason="an embedding built with sparse=sparse (line 8) gets sparse grad tensors whenever `sparse` is true"),
    # positional: EmbeddingBag(num, dim, max_norm, norm_type, scale_grad_by_freq, mode, sparse)
    Keep(_SPARSE_EMBEDDING.replace('mode="sum", sparse=sparse)', 'None, 2.0, False, "sum", True)'), name="sparse_embedding_grads_positional",
         reason="sparse gradients: an embedding built with sparse=True (line 8)"),
    Keep(_SPARSE_EMBEDDING.replace("sparse=sparse)", "sparse=True)"), name="sparse_embedding_grads",
         reason="sparse gradients: an embedding built with sparse=True (line 8) gets sparse grad tensors; torch_npu fused "
                "optimizers take dense grads only"),
]
FusedOptimizer.FUSE.append(
    Fuse(_SPARSE_EMBEDDING.replace("sparse=sparse)", "sparse=False)"), name="dense_embedding_grads",
         run="model = Ranker(10, 4)\nopt = build(model)\nfor _ in range(2):\n"
             "    model(torch.tensor([1, 2, 4, 5]), torch.tensor([0, 2])).square().mean().backward()\n    opt.step()\n"
             "    opt.zero_grad()\nout = tuple(p.detach().clone() for p in model.parameters())\n",
         expect={"optimizer": "torch.optim.SGD"}))

# --- zero_grad(set_to_none=<a flag>) (issue 14 class 5) -------------------------------------------
# the flag is a run-time or configuration value: read where the optimizer is built (a parameter of
# the same function, never re-bound), the guard keeps torch.optim for runs that free grads;
# elsewhere (another method's `self.zero_out_grads`) the near miss says it depends on the run
_FLAG_SET_TO_NONE = _NET + '''

class Config:
    def __init__(self, free_grads=False, lr=1e-2):
        self.free_grads, self.lr = free_grads, lr


def train(model, cfg, steps=3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=cfg.free_grads)
    return tuple(p.detach().clone() for p in model.parameters())
'''

_FLAG_IN_ANOTHER_METHOD = _NET + '''

class Trainer:
    def __init__(self, model, zero_out_grads=True):
        self.model = model
        self.zero_out_grads = zero_out_grads
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(self):
        self.model(torch.randn(4, 8)).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.zero_out_grads)
'''

FusedOptimizer.FUSE.append(
    Fuse(_FLAG_SET_TO_NONE, name="set_to_none_flag_read_where_the_optimizer_is_built",
         run="out = train(Net(), Config())\n", expect={"optimizer": "torch.optim.AdamW", "qualname": "train"}))
FusedOptimizer.KEEP += [
    Keep(_FLAG_IN_ANOTHER_METHOD, name="set_to_none_flag_of_another_method",
         reason="`self.optimizer.zero_grad(set_to_none=self.zero_out_grads)` (line 26) frees the grads whenever "
                "`self.zero_out_grads` is true (a run-time or configuration value"),
    # the flag is re-bound in the function: its value where the optimizer is built says nothing
    Keep(_FLAG_SET_TO_NONE.replace("    for _ in range(steps):\n", "    free = cfg.free_grads\n    for _ in range(steps):\n        free = not free\n", 1)
         .replace("set_to_none=cfg.free_grads", "set_to_none=free"),
         name="set_to_none_flag_rebound_in_the_loop", reason="frees the grads whenever `free` is true"),
]

# --- param groups built by a method of the site's own class (issue 14 class 5) -------------------
# Lightning-style `configure_optimizers(self): return AdamW(self.param_groups(wd), ...)` where the
# method builds decay / no-decay groups from `self.named_parameters()`: the guard reads a fresh
# `self.parameters()`, the method still runs once, in the branch taken
_GROUPS_FROM_OWN_METHOD = _NET + '''

class WithGroups(Net):
    def param_groups(self, wd):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.param_groups(0.1), lr=1e-2)
'''
FusedOptimizer.FUSE.append(
    Fuse(_GROUPS_FROM_OWN_METHOD, name="param_groups_from_a_method_of_the_own_class",
         run="model = WithGroups()\nopt = model.configure_optimizers()\n" + _TRAIN_STEPS,
         expect={"optimizer": "torch.optim.AdamW", "guard": "fresh_generator", "param_groups": False}))
FusedOptimizer.KEEP.append(
    # a method of another object (its class is not this one): what it returns, and whether reading a
    # tensor from it consumes it, npufuse cannot tell here
    Keep(_GROUPS_FROM_OWN_METHOD.replace("return torch.optim.AdamW(self.param_groups(0.1), lr=1e-2)",
                                         "return torch.optim.AdamW(self.helper.param_groups(0.1), lr=1e-2)"),
         reason="the params come from `self.helper.param_groups(0.1)`, which may be a one-shot iterator",
         name="param_groups_from_a_method_of_another_object"))

FusedOptimizer.KEEP += [
    Keep(_KEEP_WRAPPER_ZEROES_A_MODULE, reason="`self.net.zero_grad()`", name="wrapper_zeroes_a_module_not_an_optimizer"),
]


# --- s25 precision: what the fused classes break, read from the code around the site (issue 14) -------------
# Found by harvesting optimizer constructions from RL, speech, diffusion, Lightning and LLM-trainer repos:
# constructions taken as candidates although torch_npu's fused classes (spec §10, npu_fused_optim_base.py)
# cannot run them as the code uses them. Every test reads values, calls and imports, never names:
# * `p._grad = ...` re-assigns a grad like `p.grad = ...` (the hogwild A3C idiom);
# * `M.share_memory()` (nn.Module's, Tensor has only share_memory_()): hogwild processes share parameter
#   storage that the fused class re-points into its own flat buffer at the first step;
# * float64 / complex parameters: `.double()`, `.to(torch.float64)`, `dtype=torch.float64`, a tensor made
#   from a numpy scalar (`torch.tensor(np.log(a))`: numpy computes in float64): the fused class raises
#   TypeError (float32/float16 only);
# * the optimizer handed to transformers'/trl's Trainer (`optimizers=(opt, sched)`): Trainer calls
#   `model.zero_grad()` (set_to_none=True on torch >= 2.0) and goes through accelerate;
# * a Lightning/Fabric strategy named by a string (`strategy="deepspeed_stage_2"`, `"fsdp"`): sharding;
# * `opt.add_param_group(...)` after the first step (in a loop, or in another function): the fused
#   class builds its per-group combined buffers once, so the new group's index is past them (IndexError).

# numpy calls whose result need not be float64: narrower dtype constructors, and array builders whose
# dtype follows their data (`np.array([1, 2])` is int64)
_NUMPY_FLOAT_CTORS = ("float32", "float16", "half", "single", "int8", "int16", "int32", "int64", "uint8", "bool_",
                      "array", "asarray", "arange", "frombuffer", "fromfile", "load")
_WIDE_DTYPES = ("float64", "double", "complex64", "complex128", "cfloat", "cdouble", "complex32", "chalf")


def _is_wide_dtype(node: ast.AST) -> bool:
    """``torch.float64`` / ``torch.double`` / a complex dtype / the string ``"float64"``."""
    if isinstance(node, ast.Constant):
        return node.value in _WIDE_DTYPES
    name = dotted(node) or ""
    return name.split(".")[-1] in _WIDE_DTYPES and name.split(".")[0] in ("torch", "th")


def _region_roots(module: ModuleInfo, qualname: str) -> list[ast.AST]:
    """The code that may run with a site's optimizer: the file less other tests' units (as :class:`_Units`)."""
    units = _units(module)
    own = units.unit_of(qualname)
    units.tiers(qualname)  # fills units.near[own]
    near = units.near.get(own, set())
    # nearest first, so a reason cites the occurrence closest to the site
    order = [own, *sorted(near), *sorted(n for n, u in units.units.items() if n != own and n not in near and not u.test)]
    return [r for n in order for r in units.units[n].roots]


def _local_definition(module: ModuleInfo, name: str, line: int) -> Optional[ast.expr]:
    """The value last assigned to local ``name`` before ``line`` in the innermost function holding that line."""
    best: Optional[Scope] = None
    for sc in module.scopes:
        node = sc.node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno >= best.node.lineno:
                best = sc
    return best.definition(name, line) if best is not None else None


def _wide_tensor_value(module: ModuleInfo, value: Optional[ast.AST]) -> Optional[str]:
    """Why ``value`` (an expression a params list holds) is a float64/complex tensor, else None."""
    if not isinstance(value, ast.Call):
        return None
    if isinstance(value.func, ast.Attribute) and value.func.attr == "double" and not value.args:
        return f"`{segment(module, value)[:60]}` is float64"
    name = module.canonical(value.func) or ""
    if not name.startswith("torch."):
        return None
    dtype = next((k.value for k in value.keywords if k.arg == "dtype"), None)
    if dtype is not None:
        return f"`{segment(module, value)[:60]}` is {segment(module, dtype)}" if _is_wide_dtype(dtype) else None
    data = value.args[0] if value.args else None
    if isinstance(data, ast.Name):
        # s31: the number named first (``a = np.log(x); torch.tensor(a)``): read where it was assigned
        data = _local_definition(module, data.id, value.lineno)
    if name in ("torch.tensor", "torch.as_tensor") and isinstance(data, ast.Call):
        inner = module.canonical(data.func) or ""
        if inner.startswith("numpy.") and inner.split(".")[-1] not in _NUMPY_FLOAT_CTORS:
            return (f"`{segment(module, value)[:60]}` is float64 (numpy computes `{segment(module, data)[:40]}` "
                    "in float64 and torch.tensor keeps that dtype)")
    return None


def _element_value(module: ModuleInfo, scope: Scope, node: ast.AST, line: int) -> Optional[ast.AST]:
    """The value a params-list element was last bound to: a local name, or ``self.x`` assigned in a method of the site's class."""
    if isinstance(node, ast.Name):
        return scope.definition(node.id, line)
    name = dotted(node) or ""
    if name.startswith("self.") and name.count(".") == 1 and "." in scope.qualname:
        cls = module.classes.get(scope.qualname.split(".")[0])
        found = None
        for n in fast_walk(cls) if cls is not None else ():
            if isinstance(n, ast.Assign) and any(dotted(t) == name for t in n.targets):
                found = n.value
        return found
    return node


def _wide_params(module: ModuleInfo, scope: Scope, stmt: ast.stmt, call: ast.Call, model: str,
                 roots: list[ast.AST]) -> Optional[str]:
    params = keyword(call, "params", 0)
    elements = params.elts if isinstance(params, (ast.List, ast.Tuple)) else []
    for e in elements:
        why = _wide_tensor_value(module, _element_value(module, scope, e, stmt.lineno))
        if why is not None:
            return why
    for root in roots:
        for n in fast_walk(root):
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
                if isinstance(n, ast.Call) and (module.canonical(n.func) or "") == "torch.set_default_dtype" \
                        and n.args and _is_wide_dtype(n.args[0]):
                    return f"`torch.set_default_dtype({segment(module, n.args[0])})` (line {n.lineno}) makes new parameters float64"
                continue
            recv = dotted(n.func.value) or ""
            # the model itself, a module holding it or one of its submodules (`.double()` is common on data
            # tensors, so the looser name test of the bf16 casts would refuse too much)
            if not _is_model_receiver(n.func.value, model):
                continue
            if n.func.attr == "double" and not n.args:
                return f"`{recv}.double()` (line {n.lineno}) makes the parameters float64"
            if n.func.attr in ("to", "type") and any(_is_wide_dtype(a) for a in [*n.args, *(k.value for k in n.keywords if k.arg == "dtype")]):
                return f"`{segment(module, n)[:60]}` (line {n.lineno}) makes the parameters float64/complex"
    return None


def _optimizer_names(stmt: ast.stmt) -> set[str]:
    return _target_names(stmt) | ({"<returned>"} if isinstance(stmt, ast.Return) else set())


def _is_model_receiver(value: ast.expr, model: str) -> bool:
    """``value`` is the model the parameters come from, a module holding it or one of its submodules
    (a data tensor's ``share_memory()`` shares no parameter)."""
    recv = dotted(value) or ""
    return bool(recv and model) and (recv == model or model.startswith(recv + ".") or recv.startswith(model + "."))


def _handed_to_the_site(roots: list[ast.AST], value: ast.expr, scope: Scope, model: str) -> bool:
    """``value`` (a name, in some function of the region) is passed to the site's function as the parameter the
    model comes from: ``site(v)``, ``Process(target=site, args=(v,))``, ``mp.spawn(site, args=(v,))`` (spawn
    passes the rank first), ``Thread(target=site, kwargs={"model": v})``. s31: a hogwild ``net.share_memory()``
    in ``main`` whose ``net`` reaches ``train(model)`` was missed because the two names differ."""
    fn = scope.node
    recv = dotted(value)
    if not recv or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    if params[:1] in (["self"], ["cls"]):
        params = params[1:]
    name = fn.name

    def names_site(e: Optional[ast.expr]) -> bool:
        d = dotted(e) if e is not None else None
        return bool(d) and d.split(".")[-1] == name

    def param_for(args: list[ast.expr], kwargs: list[tuple[Optional[str], ast.expr]], offset: int = 0) -> Optional[str]:
        for i, a in enumerate(args):
            if dotted(a) == recv and 0 <= i + offset < len(params):
                return params[i + offset]
        return next((k for k, v in kwargs if k in params and dotted(v) == recv), None)

    for root in roots:
        for c in fast_walk(root):
            if not isinstance(c, ast.Call):
                continue
            got: Optional[str] = None
            if names_site(c.func):
                got = param_for(list(c.args), [(k.arg, k.value) for k in c.keywords])
            else:
                target = keyword(c, "target")
                spawned = (dotted(c.func) or "").split(".")[-1] == "spawn" and c.args and names_site(c.args[0])
                if names_site(target) or spawned:
                    packed = keyword(c, "args")
                    args = list(packed.elts) if isinstance(packed, (ast.Tuple, ast.List)) else []
                    kw = keyword(c, "kwargs")
                    kwargs = [(k.value if isinstance(k, ast.Constant) else None, v) for k, v in zip(kw.keys, kw.values)] \
                        if isinstance(kw, ast.Dict) else []
                    got = param_for(args, kwargs, 1 if spawned else 0)
            if got is not None and _is_model_receiver(ast.Name(got, ast.Load()), model):
                return True
    return False


def _s25_blocker(module: ModuleInfo, scope: Scope, stmt: ast.stmt, call: ast.Call, model: str) -> Optional[str]:
    """Why the fused class cannot take this construction over (the classes above), else None."""
    src = module.source
    roots = _region_roots(module, scope.qualname)
    wide = _wide_params(module, scope, stmt, call, model, roots)
    if wide is not None:
        return (f"float64/complex parameters: {wide}; torch_npu fused optimizers take float32/float16 params only "
                "(TypeError at the first step)")
    names = _target_names(stmt)
    site_tests: Optional[list[tuple[str, bool]]] = None
    for root in roots:
        for n in fast_walk(root):
            if not isinstance(n, ast.Call):
                continue
            attr = n.func.attr if isinstance(n.func, ast.Attribute) else ""
            if attr in ("share_memory", "add_param_group", "initialize") or any(k.arg in ("optimizers", "strategy", "precision")
                                                                              for k in n.keywords):
                # the other arm of an `if` the site sits in too (OpenNMT's `elif opt.optim == "fusedadam":
                # ... apex.amp.initialize(...)` next to `if opt.optim == "sgd": optim.SGD(...)`) never runs with it
                site_tests = _enclosing_tests(module.tree, stmt.lineno) if site_tests is None else site_tests
                if _excluded_branch(site_tests, _enclosing_tests(module.tree, n.lineno)):
                    continue
            if attr == "share_memory" and not n.args and "share_memory" in src and (
                    _is_model_receiver(n.func.value, model) or _handed_to_the_site(roots, n.func.value, scope, model)):
                return (f"`{segment(module, n.func.value)[:40]}.share_memory()` (line {n.lineno}): hogwild processes share "
                        "the parameters' storage, and the fused optimizer re-points every parameter into its own flat "
                        "buffer at the first step, so the processes would stop sharing them")
            for k in n.keywords if "optimizers" in src or "strategy" in src or "precision" in src else ():
                if k.arg == "precision" and isinstance(k.value, ast.Constant) and k.value.value in (64, "64", "64-true") \
                        and (module.canonical(n.func) or "").split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric"):
                    return (f"float64 parameters: `precision={k.value.value!r}` (line {n.lineno}) makes Lightning cast the "
                            "model to float64; torch_npu fused optimizers take float32/float16 params only (TypeError at "
                            "the first step)")
                if k.arg == "optimizers" and (module.canonical(n.func) or "").split(".")[0] in ("transformers", "trl") \
                        and (not names or any(dotted(e) in names for e in fast_walk(k.value))):
                    return (f"handed to `{segment(module, n.func)}` (optimizers=, line {n.lineno}): the Hugging Face "
                            "Trainer calls model.zero_grad() (set_to_none=True on torch >= 2.0) and accelerate's "
                            "AcceleratedOptimizer.zero_grad() passes set_to_none=True: the grads are freed and "
                            "re-allocated outside the fused optimizer's flat buffer (or ValueError)")
                if k.arg == "optimizers" and names and any(dotted(e) in names for e in fast_walk(k.value)):
                    # s32: another framework's trainer (mosaicml composer's `Trainer(optimizers=...)`, a trainer
                    # built by `hydra.utils.instantiate(cfg.trainer, optimizers=...)`) drives it
                    driver = _s32_external_driver(module, n)
                    if driver is not None:
                        return (f"handed to `{driver}` (optimizers=, line {n.lineno}), a trainer from outside the "
                                "repository: it clears the grads (composer and the Hugging Face Trainer free them: "
                                "set_to_none=True), chooses the precision and may shard the parameters (FSDP from its "
                                "config) behind the optimizer; npufuse cannot check that code, and the flat-buffer fused "
                                "class breaks under any of those")
                if k.arg == "strategy" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str) \
                        and any(s in k.value.value.lower() for s in ("deepspeed", "fsdp")):
                    return (f"parameters flattened/re-allocated by FSDP/DeepSpeed/ZeRO (`strategy={k.value.value!r}` at "
                            f"line {n.lineno}): the fused optimizer's combined buffers would go stale")
            if "amp" in src and (module.canonical(n.func) or "") == "apex.amp.initialize" \
                    and (not names or any(dotted(a) in names for a in fast_walk(n) if isinstance(a, (ast.Name, ast.Attribute)))):
                return (f"handed to `{segment(module, n.func)}` (line {n.lineno}): apex amp sets every parameter's grad "
                        "to None before each backward (its grad copy elision) and, with master weights, steps fp32 "
                        "copies; the fused optimizer's flat grad buffer would go stale")
            if attr == "add_param_group" and names and dotted(n.func.value) in names and n.lineno > (stmt.end_lineno or stmt.lineno):
                # a loop that also steps this optimizer (`for g in groups[1:]: opt.add_param_group(g)` before
                # training is harmless); in another function, only an attribute of the same object (`self.opt`)
                loops = [lp for lp in fast_walk(scope.node) if isinstance(lp, (ast.For, ast.AsyncFor, ast.While))
                         and lp.lineno <= n.lineno <= (lp.end_lineno or lp.lineno)
                         and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "step"
                                 and dotted(c.func.value) in names for c in fast_walk(lp))]
                elsewhere = not _in_scope(scope, n.lineno) and (dotted(n.func.value) or "").startswith("self.")
                if loops or elsewhere:
                    return (f"`{segment(module, n.func)}(...)` (line {n.lineno}) may add a param group after the first "
                            "step (in a loop or another function): torch_npu fused optimizers build their per-group "
                            "combined buffers once, at the first step, so a later group is outside them (IndexError at "
                            "the next step)")
    return None


_S25_HOGWILD_GRAD = _NET + '''

def train(global_model, local_model, steps=3):
    opt = torch.optim.Adam(global_model.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        local_model(torch.randn(2, 8)).sum().backward()
        for gp, lp in zip(global_model.parameters(), local_model.parameters()):
            gp._grad = lp.grad
        opt.step()
'''

_S25_SHARED_MODEL = _NET + '''

def worker(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(2, 8)).sum().backward()
        opt.step()


def main(workers=2):
    model = Net()
    model.share_memory()
    return [torch.multiprocessing.Process(target=worker, args=(model,)) for _ in range(workers)]
'''

_S25_NUMPY_SCALAR = _NET.replace("import torch\n", "import numpy as np\nimport torch\n", 1) + '''

class Policy(nn.Module):
    def __init__(self, init_alpha=0.01):
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.log_alpha = torch.tensor(np.log(init_alpha))
        self.log_alpha.requires_grad = True
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=3e-4)
'''

_S25_DOUBLE_MODEL = _NET + '''

def fit(model):
    model = model.double()
    return torch.optim.SGD(model.parameters(), lr=0.1)
'''

_S25_COMPLEX_PARAM = '''\
import torch


def build(n=16):
    phases = torch.zeros(n, dtype=torch.complex64, requires_grad=True)
    return torch.optim.Adam([phases], lr=1e-2)
'''

_S25_HF_TRAINER = _NET + '''
from transformers import Trainer


def main(args, dataset):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, optimizers=(opt, None))
    trainer.train()
'''

_S25_STRING_STRATEGY = _NET + '''
import lightning as L


class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Net()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def main():
    L.Trainer(strategy="fsdp", precision="16-mixed").fit(Lit())
'''

_S25_GROUP_ADDED_LATER = _NET + '''

def train(model, head, loader, epochs=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(epochs):
        if epoch == 1:
            opt.add_param_group({"params": head.parameters()})
        for x in loader:
            opt.zero_grad()
            head(model(x)).sum().backward()
            opt.step()
'''

# the look-alikes that stay candidates: a data tensor cast to float64, a shared metrics tensor
# (Tensor.share_memory_), a group added right after the construction, a plain DDP strategy string
_S25_LOOK_ALIKES = _NET + '''

def launch(strategy="ddp"):
    return strategy


def build(model):
    stats = torch.zeros(4)
    stats.share_memory_()
    opt = torch.optim.SGD(model.fc1.parameters(), lr=1e-2, momentum=0.9)
    opt.add_param_group({"params": list(model.ln.parameters()) + list(model.fc2.parameters())})
    reference = torch.randn(3).double()
    launch(strategy="ddp")
    return opt
'''

FusedOptimizer.KEEP += [
    Keep(_S25_HOGWILD_GRAD, reason="grads are re-allocated", name="s25_hogwild_underscore_grad_assigned"),
    Keep(_S25_SHARED_MODEL, reason="`model.share_memory()` (line", name="s25_hogwild_module_share_memory"),
    Keep(_S25_NUMPY_SCALAR, reason="is float64 (numpy computes `np.log(init_alpha)`", name="s25_param_from_numpy_scalar_is_float64"),
    Keep(_S25_DOUBLE_MODEL, reason="`model.double()` (line", name="s25_model_cast_to_double"),
    Keep(_S25_COMPLEX_PARAM, reason="is torch.complex64", name="s25_complex_param"),
    Keep(_S25_HF_TRAINER, reason="handed to `Trainer` (optimizers=", name="s25_handed_to_hf_trainer"),
    Keep(_S25_STRING_STRATEGY, reason="`strategy='fsdp'`", name="s25_lightning_string_strategy_fsdp"),
    Keep(_S25_GROUP_ADDED_LATER, reason="may add a param group after the first step", name="s25_param_group_added_in_the_loop"),
]
FusedOptimizer.FUSE += [
    Fuse(_S25_LOOK_ALIKES, name="s25_float64_data_shared_tensor_early_group_ddp_string", run=_TRAIN_RUN, expect={
        "optimizer": "torch.optim.SGD", "fused_class": "torch_npu.optim.NpuFusedSGD", "guard": "fresh_generator"}),
]


# --- s25 recall: config-held keyword mappings and list attributes of the object building the optimizer ---
# wenet's `optim.Adam(model.parameters(), **configs['optim_conf'])`, `**cfg["optimizer"]["kwargs"]`: a dict read
# from a config by constant keys is as opaque (and as side-effect free to read twice) as `**self.config.kwargs`,
# so its keys are checked at run time like the latter's (_KeywordPlan._star). OpenNMT-style wrappers
# (`self.params = []`, `self.params.append(p)`, then `optim.Adam(self.params, ...)`): an attribute of the
# site's own object that every assignment in its class makes a list is re-iterable, so the guard reads its
# first tensor without consuming anything.

def _constant_subscript(node: ast.AST) -> bool:
    """``a.b["k"]`` / ``cfg["optimizer"]["kwargs"]``: subscripts by constant keys of a dotted name."""
    while isinstance(node, ast.Subscript):
        if not (isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, (str, int))):
            return False
        node = node.value
    return dotted(node) is not None


def _self_attribute_list(module: ModuleInfo, scope: Scope, node: ast.Attribute, depth: int) -> bool:
    """Is ``self.x`` a list or tuple wherever it is set: every assignment to it in the site's class (its
    methods; nested functions included) is list-valued and nothing else binds it (no augmented or
    tuple-unpacking assignment)."""
    name = dotted(node) or ""
    if not (name.startswith("self.") and name.count(".") == 1 and "." in scope.qualname):
        return False
    cls = module.classes.get(scope.qualname.split(".")[0])
    if cls is None:
        return False
    values = []
    for n in fast_walk(cls):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if dotted(t) == name:
                    values.append(n.value)
                elif isinstance(t, (ast.Tuple, ast.List)) and any(dotted(e) == name for e in t.elts):
                    return False
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)) and dotted(n.target) == name:
            if isinstance(n, ast.AugAssign):
                # `self.params += list(mixer.parameters())` on a list extends it in place (a tuple
                # target takes only a tuple, else TypeError): still a list/tuple; other operators are not
                if not isinstance(n.op, (ast.Add, ast.Mult)):
                    return False
                continue
            if n.value is None:
                return False
            values.append(n.value)

    def listy(v: ast.AST) -> bool:
        if isinstance(v, ast.BinOp) and isinstance(v.op, ast.Add):
            return listy(v.left)  # list.__add__ takes only a list: a list or TypeError
        return isinstance(v, (ast.List, ast.Tuple, ast.ListComp)) or (
            isinstance(v, ast.Call) and dotted(v.func) in _LIST_BUILDERS and dotted(v.func) not in module.functions)

    return bool(values) and all(listy(v) for v in values)


_S25_WRAPPER_LIST_ATTRIBUTE = _NET + '''

class OptimWrapper:
    def __init__(self, lr=1e-2):
        self.lr = lr
        self.params = []

    def set_parameters(self, named):
        self.params = []
        for _name, p in named:
            if p.requires_grad:
                self.params.append(p)
        self.optimizer = torch.optim.Adam(self.params, lr=self.lr, eps=1e-9)
'''

_S25_CONFIG_KWARGS = _NET + '''

def build(model, configs={"optim_conf": {"lr": 5e-3, "weight_decay": 1e-4}}):
    return torch.optim.Adam(model.parameters(), **configs["optim_conf"])
'''

FusedOptimizer.FUSE += [
    Fuse(_S25_WRAPPER_LIST_ATTRIBUTE, name="s25_params_list_attribute_of_the_wrapper",
         run="model = Net()\nw = OptimWrapper()\nw.set_parameters(model.named_parameters())\nopt = w.optimizer\n" + _TRAIN_STEPS,
         expect={"optimizer": "torch.optim.Adam", "params": "self.params", "guard": "materialised_list"}),
    Fuse(_S25_CONFIG_KWARGS, name="s25_kwargs_from_a_config_by_constant_keys", run=_TRAIN_RUN,
         expect={"optimizer": "torch.optim.Adam", "guard": "fresh_generator_kwargs_checked"}),
]
FusedOptimizer.KEEP += [
    # the attribute is a generator in one of its assignments: reading a tensor from it would consume it
    Keep(_S25_WRAPPER_LIST_ATTRIBUTE.replace("        self.params = []\n\n    def set", "        self.params = iter(())\n\n    def set"),
         reason="the params come from `self.params`, which may be a one-shot iterator", name="s25_params_attribute_sometimes_a_generator"),
    # a key computed at run time: which mapping is read depends on code npufuse does not evaluate twice
    Keep(_S25_CONFIG_KWARGS.replace('**configs["optim_conf"]', "**configs[key()]").replace("def build(model,", "def build(model, key,"),
         reason="keyword arguments passed through `**configs[key()]`", name="s25_kwargs_from_a_config_by_a_computed_key"),
]


# --- s25: a torch.optim class looked up by name at run time -------------------------------------------------
# `getattr(torch.optim, cfg.name)(params, **cfg.kwargs)` (litgpt, many research trainers): which class runs is
# known only at run time, so npufuse cannot pick the fused class or check the arguments against it; named as a
# near miss (before: no word of the pattern in the scope, so not even that).
_BY_NAME_WORD = "optim,"
FusedOptimizer.SCOPE_WORDS = (*FusedOptimizer.SCOPE_WORDS, _BY_NAME_WORD)


def _looked_up_by_name(module: ModuleInfo, scope: Scope, stmt: ast.stmt) -> Optional[NearMiss]:
    """``getattr(torch.optim, <name>)(...)`` called in this statement, or bound to a name this scope calls later."""
    if _BY_NAME_WORD not in segment(module, stmt):
        return None
    for n in fast_walk(stmt):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr" and len(n.args) >= 2
                and module.canonical(n.args[0]) == "torch.optim" and "getattr" not in module.aliases):
            continue
        if isinstance(n.args[1], ast.Constant):
            return None  # `getattr(torch.optim, "AdamW")`: one class, spelt as a string; rare, left alone
        built = any(isinstance(c, ast.Call) and c.func is n for c in fast_walk(stmt)) or _called_later(scope, stmt) is not None
        if not built or _s34_read_by_later_lookup(module, scope, stmt):
            return None  # not built, or built later through the bound name: that construction reports itself
        fused = ", ".join(f"{k} -> {v[0]}" for k, v in _OPTIMIZERS.items())
        return NearMiss(_ID, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno,
                        f"the optimizer class is looked up by name at run time (`{segment(module, n)[:60]}`): npufuse "
                        "swaps a torch.optim class named at the construction only; torch_npu.optim has fused classes "
                        f"for {fused} (same constructor arguments), to be chosen by hand once the constraints hold "
                        "(fp32/fp16 params, grads never set to None, no FSDP/DeepSpeed)")
    return None


_S25_BY_NAME = _NET + '''

def build(model, name="AdamW", lr=1e-3):
    return getattr(torch.optim, name)(model.parameters(), lr=lr)
'''

FusedOptimizer.KEEP += [
    # (s32: `getattr(torch.optim, name)(...)` called at once is a guarded candidate: see the s32 examples;
    # s34: so is the lookup bound to a name and called later, `s34_getattr_lookup_bound_then_called`)
    Keep(_NET + '''
import lightning as L


class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Net()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def main():
    L.Trainer(precision="64-true").fit(Lit())
''', reason="`precision='64-true'`", name="s25_lightning_precision_64"),
]

FusedOptimizer.KEEP.append(Keep(_NET + '''
from apex import amp


def setup(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    return model, optimizer
''', reason="handed to `amp.initialize` (line", name="s25_apex_amp_initialize"))

FusedOptimizer.FUSE.append(Fuse(_NET + '''

def build(model, method="sgd", opt_level=None):
    params = [p for p in model.parameters() if p.requires_grad]
    if method == "sgd":
        optimizer = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    elif method == "fusedadam":
        from apex import amp
        from apex.optimizers import FusedAdam
        optimizer = FusedAdam(params, lr=1e-3)
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level)
    return optimizer
''', name="s25_apex_amp_only_in_another_branch", run=_TRAIN_RUN, expect={"optimizer": "torch.optim.SGD"}))

FusedOptimizer.FUSE.append(Fuse(_NET + '''

def build(model):
    groups = [{"params": list(model.fc1.parameters())}, {"params": list(model.ln.parameters())},
              {"params": list(model.fc2.parameters()), "weight_decay": 0.0}]
    opt = torch.optim.SGD(groups[0]["params"], lr=1e-2, momentum=0.9, weight_decay=1e-4)
    for g in groups[1:]:
        opt.add_param_group(g)
    return opt
''', name="s25_groups_added_in_a_loop_before_training", run=_TRAIN_RUN, expect={"optimizer": "torch.optim.SGD"}))


# --- s27: one parameter tensor (issue 14, class 5 precision) ---------------------------------------
# torch_npu's fused classes gain by combining many parameter tensors into one flat buffer per dtype
# and running the update once over it (npu_fused_adamw.py `_group_step`: the same element-wise
# steps torch.optim runs per tensor, applied per combined buffer). An optimizer over ONE tensor
# (SAC's `[log_alpha]`, a texture or latent optimised in place) makes one buffer holding that
# tensor: the step launches as many kernels as torch.optim's, plus a copy of the parameter and its
# states at the first step. A params list literal holds tensors or param-group dicts (the
# torch.optim contract), so the element must be proven a tensor by its value, never by its name.
_TENSOR_MAKERS = ("torch.nn.Parameter", "torch.nn.parameter.Parameter", "torch.zeros", "torch.ones", "torch.full",
                  "torch.tensor", "torch.as_tensor", "torch.randn", "torch.rand", "torch.empty", "torch.zeros_like",
                  "torch.ones_like", "torch.full_like", "torch.randn_like", "torch.rand_like", "torch.empty_like",
                  "torch.arange", "torch.linspace")
_TENSOR_METHODS = ("requires_grad_", "detach", "clone", "cuda", "npu", "float", "half", "contiguous")


def _one_tensor(module: ModuleInfo, value: Optional[ast.AST], depth: int = 0) -> bool:
    """``value`` is a single tensor by how it is made (a torch constructor, nn.Parameter, or a
    tensor method over one: ``x.detach().requires_grad_()``)."""
    if not isinstance(value, ast.Call) or depth > 4:
        return False
    if (module.canonical(value.func) or "") in _TENSOR_MAKERS:
        return True
    if isinstance(value.func, ast.Attribute) and value.func.attr in _TENSOR_METHODS:
        # a method a Module has too (`.cuda()`, `.float()`) only counts over a proven tensor
        return value.func.attr in ("requires_grad_", "detach") or _one_tensor(module, value.func.value, depth + 1)
    return False


def _s27_single_tensor(module: ModuleInfo, scope: Scope, stmt: ast.stmt, call: ast.Call) -> Optional[str]:
    """Why fusing gains nothing: the params are one tensor, proven by its value; else None."""
    params = keyword(call, "params", 0)
    if isinstance(params, ast.Name):
        params = scope.definition(params.id, stmt.lineno)
    if not (isinstance(params, (ast.List, ast.Tuple)) and len(params.elts) == 1):
        return None
    element = params.elts[0]
    if isinstance(element, (ast.Starred, ast.Dict)):
        return None
    value = _element_value(module, scope, element, stmt.lineno)
    if not _one_tensor(module, value):
        return None
    return (f"the optimizer updates one tensor (`{segment(module, element)[:40]}`): torch_npu fused optimizers gain by "
            "combining many parameter tensors into one buffer per dtype, and over a single tensor they run the same "
            "element-wise steps as torch.optim (plus a copy of the tensor and its states at the first step); "
            "the swap is exact but saves next to nothing")

_S27_SAC_TEMPERATURE = _NET + '''

class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.actor = Net()
        self.log_alpha = nn.Parameter(torch.zeros(1))
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=3e-4)


def temperature_step(agent, log_prob):
    loss = -(agent.log_alpha * (log_prob + 1.0).detach()).mean()
    agent.alpha_optimizer.zero_grad()
    loss.backward()
    agent.alpha_optimizer.step()
'''

_S27_LATENT = _NET + '''

def optimise_latent(model, target, steps=10):
    latent = torch.zeros(1, 8).requires_grad_(True)
    opt = torch.optim.SGD([latent], lr=0.1)
    for _ in range(steps):
        loss = F.mse_loss(model(latent), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return latent
'''

_S27_TWO_TENSORS = _NET + '''

def build(model):
    return torch.optim.SGD([model.fc1.weight, model.fc2.weight], lr=1e-2, momentum=0.9)
'''

# one tensor: exact, so a candidate (a labeller's `fuse`), with the low value said in its notes
FusedOptimizer.FUSE += [
    Fuse(_S27_SAC_TEMPERATURE, expect={"optimizer": "torch.optim.Adam", "single_tensor": True}, name="s27_single_parameter_attribute"),
    Fuse(_S27_LATENT, expect={"optimizer": "torch.optim.SGD", "single_tensor": True}, name="s27_single_latent_tensor"),
]
FusedOptimizer.FUSE += [
    Fuse(_S27_TWO_TENSORS, name="s27_two_tensors_listed", run=_TRAIN_RUN, expect={"optimizer": "torch.optim.SGD"}),
    # a one-element list holding a param-group dict is not one tensor: the group's params are combined
    Fuse(_NET + '''

def build(model):
    group = {"params": list(model.parameters()), "weight_decay": 0.0}
    return torch.optim.SGD([group], lr=1e-2, momentum=0.9)
''', name="s27_one_group_dict_listed", run=_TRAIN_RUN, expect={"optimizer": "torch.optim.SGD"}),
]


# --- s28 injected optimizer classes (issue 14 class 5 recall) -----------------------------------
# stable-baselines3 builds `self.optimizer = self.optimizer_class(self.parameters(), lr=..., **self.optimizer_kwargs)`
# where a base class's __init__ stores `self.optimizer_class = optimizer_class` from a parameter
# defaulting to `th.optim.Adam` (A2C passes RMSprop); other code writes `def build(model,
# optimizer_cls=torch.optim.AdamW): return optimizer_cls(...)` or a class attribute
# `optimizer_class = torch.optim.Adam` that subclasses override. The class is known at run time
# only, so the construction is a candidate whose guard tests it (`self.optimizer_class is
# th.optim.Adam`): the fused class runs only where torch.optim's default was chosen; any other
# class keeps the original call. Evidence that it is an optimizer class is its value (a default or
# a binding to a torch.optim class, followed through the class's bases in other files), never its name.

_S28_BASE_DEPTH = 4


def _s28_import_aliases(tree: ast.Module) -> dict[str, str]:
    """local name -> dotted import target, for a file other than the scanned one."""
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    out[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _s28_kind(expr: Optional[ast.AST], aliases: dict[str, str]) -> Optional[str]:
    """The torch.optim class ``expr`` names (with that file's imports), "" for another class-like
    name, None for anything else (a call, a constant)."""
    name = dotted(expr) if isinstance(expr, (ast.Name, ast.Attribute)) else None
    if not name:
        return None
    head, _, rest = name.partition(".")
    full = (f"{aliases[head]}.{rest}" if rest else aliases[head]) if head in aliases else name
    kind = _CANONICAL.get(full)
    if kind is not None:
        return kind
    return "" if full.startswith("torch.optim.") or full[:1].isupper() or "." in full else None


def _s28_default(fn: ast.AST, param: str) -> Optional[ast.expr]:
    """The default value of parameter ``param`` of function ``fn`` (None: no default, or no such parameter)."""
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    for arg, default in zip(positional[len(positional) - len(a.defaults):], a.defaults):
        if arg.arg == param:
            return default
    for arg, kw_default in zip(a.kwonlyargs, a.kw_defaults):
        if arg.arg == param:
            return kw_default
    return None


def _s28_class_values(module: ModuleInfo, cls: ast.ClassDef, attr: str) -> tuple[list[str], bool]:
    """(the torch.optim kinds ``self.<attr>`` can hold by the bindings of ``cls`` and its bases,
    whether some binding is something else or unknown). A binding ``self.attr = p`` from a method
    parameter counts that parameter's default, and the defaults of the parameters that subclasses
    in the chain hand to ``super().__init__(attr=q)`` / positionally to that parameter."""
    from npufuse.scan import repo_facts

    kinds: list[str] = []
    other = False
    chain: list[tuple[ast.ClassDef, dict[str, str], Optional[ast.Module], str]] = [(cls, dict(module.aliases), module.tree, module.path)]
    seen: set[int] = set()
    handed: list[tuple[ast.expr, dict[str, str]]] = []  # defaults handed down to a base's __init__ parameter
    i = 0
    while i < len(chain) and i < _S28_BASE_DEPTH:
        node, aliases, tree, rel = chain[i]
        i += 1
        if id(node) in seen:
            continue
        seen.add(id(node))
        for st in node.body:
            if isinstance(st, (ast.Assign, ast.AnnAssign)) and st.value is not None:
                targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                    k = _s28_kind(st.value, aliases)
                    kinds.append(k) if k else None
                    other = other or not k
        for st, n, attrs in _s28_self_bindings(node):
            if isinstance(n, ast.Assign):
                if attr not in attrs:
                    continue
                value = n.value
                if isinstance(value, ast.Name) and value.id in [x.arg for x in (*st.args.posonlyargs, *st.args.args, *st.args.kwonlyargs)]:
                    d = _s28_default(st, value.id)
                    values = [(d, aliases)] if d is not None else []
                    values += [h for h in handed]  # what subclasses pass for it
                    if not values:
                        other = True
                    for v, al in values:
                        k = _s28_kind(v, al)
                        kinds.append(k) if k else None
                        other = other or not k
                else:
                    k = _s28_kind(value, aliases)
                    kinds.append(k) if k else None
                    other = other or not k
                continue
            # `super().__init__(..., attr=p)` with p a parameter of this method: its default goes down
            for k in n.keywords:
                if k.arg == attr and isinstance(k.value, ast.Name):
                    d = _s28_default(st, k.value.id)
                    if d is not None:
                        handed.append((d, aliases))
        for base in node.bases:
            name = dotted(base)
            if not name or tree is None:
                continue
            local = next((b for b in tree.body if isinstance(b, ast.ClassDef) and b.name == name), None)
            if local is not None:
                chain.append((local, aliases, tree, rel))
                continue
            found = repo_facts.definition(module, name) if rel == module.path else None
            if found is not None and isinstance(found.node, ast.ClassDef):
                chain.append((found.node, _s28_import_aliases(found.tree), found.tree, found.rel))
    return kinds, other


# one walk per class body, shared by every attribute asked about (a scope calls _s28_class_values for
# each `self.<attr>(...)` it holds: walking the class again per call made the detector quadratic in the
# class size -- 2/3 of a scan's time on a repository of long trainer classes). Kept on the node itself,
# so it lives exactly as long as the tree.
def _s28_self_bindings(cls: ast.ClassDef) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, ast.AST, frozenset[str]]]:
    """In the walk order of each method of ``cls``: (method, ``self.<a> = ...`` assignment, the
    attributes it binds) and (method, ``super().__init__(...)`` call, empty set)."""
    hit = cls.__dict__.get("_npufuse_s28_bindings")
    if hit is not None:
        return hit
    out: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, ast.AST, frozenset[str]]] = []
    for st in cls.body:
        if not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in fast_walk(st):
            if isinstance(n, ast.Assign):
                attrs = frozenset(t.attr for t in n.targets
                                  if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self")
                if attrs:
                    out.append((st, n, attrs))
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "__init__"
                    and isinstance(n.func.value, ast.Call) and isinstance(n.func.value.func, ast.Name)
                    and n.func.value.func.id == "super"):
                out.append((st, n, frozenset()))
    cls.__dict__["_npufuse_s28_bindings"] = out
    return out


def _s28_torch_test(module: ModuleInfo, kind: str) -> Optional[str]:
    """An expression naming torch.optim.<kind> with this file's own imports (None: none reaches it)."""
    for local, full in sorted(module.aliases.items()):
        if full == "torch":
            return f"{local}.optim.{kind}"
    for local, full in sorted(module.aliases.items()):
        if full == "torch.optim":
            return f"{local}.{kind}"
        if _CANONICAL.get(full) == kind:
            return local
    return None


def _s28_injected_class(module: ModuleInfo, scope: Scope, stmt: ast.stmt
                        ) -> Optional[Union[NearMiss, tuple[ast.Call, str, str]]]:
    """(call, torch.optim class, run-time test) of a construction through ``self.<attr>(...)`` or a
    parameter of the function, whose value by its bindings/defaults is one fusable torch.optim class
    (the test picks the fused class only for it); a NearMiss when it can be several; None otherwise."""
    for call in fast_walk(stmt):
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        kinds: list[str] = []
        other = False
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self" and scope.class_name:
            cls = module.classes.get(scope.class_name) or next(
                (c for c in module.tree.body if isinstance(c, ast.ClassDef) and c.name == scope.class_name), None)
            if cls is None:
                continue
            kinds, other = _s28_class_values(module, cls, func.attr)
        elif isinstance(func, ast.Name) and func.id in scope.args and not scope.assignments.get(func.id):
            d = _s28_default(scope.node, func.id)
            k = _s28_kind(d, module.aliases)
            if k:
                kinds = [k]
        if not kinds:
            continue
        line, end = stmt.lineno, stmt.end_lineno or stmt.lineno
        text = segment(module, func)
        fusable = sorted(set(kinds))
        if len(fusable) > 1:
            return NearMiss(_ID, scope.qualname, line, end,
                            f"the optimizer class `{text}` is injected (its bindings/defaults name several torch.optim classes: "
                            f"{', '.join(fusable)}), each with its own arguments: torch_npu.optim's counterpart could take "
                            "the place of the one that runs by hand once the constraints hold")
        kind = fusable[0]
        test = _s28_torch_test(module, kind)
        if test is None:
            return NearMiss(_ID, scope.qualname, line, end,
                            f"the optimizer class `{text}` is injected (torch.optim.{kind} by default) and this file imports "
                            "no name the guard could test it against (`import torch`)")
        return call, kind, f"{text} is {test}"
    return None


# The scope of an injected construction holds no torch.optim class name (`self.optimizer_class(...)`
# in `_build`): the gate also opens on "optim", which such attributes and parameters are spelled
# with in the code we measured (optimizer_class, optimizer_cls, optim_cls). A class injected under
# a name without it (`self.opt_cls`) is not found: a known gap, said in bench/DETECTION.md.
_S28_INJECTED_WORD = "optim"
FusedOptimizer.SCOPE_WORDS = (*FusedOptimizer.SCOPE_WORDS, _S28_INJECTED_WORD)

# s28 examples: an injected class, found by its value (bindings and defaults), guarded at run time
_S28_INJECTED_BASE = '''\
import torch as th
import torch.nn as nn
import torch.nn.functional as F


class BaseModel(nn.Module):
    def __init__(self, optimizer_class=th.optim.Adam, optimizer_kwargs=None):
        super().__init__()
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = optimizer_kwargs if optimizer_kwargs is not None else {}


class Policy(BaseModel):
    def __init__(self, optimizer_class=th.optim.Adam, optimizer_kwargs=None):
        super().__init__(optimizer_class=optimizer_class, optimizer_kwargs=optimizer_kwargs)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self._build(3e-3)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))

    def _build(self, lr):
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr, **self.optimizer_kwargs)
'''

_S28_POLICY_RUN = '''\
model = Policy({args})
x, y = th.randn(6, 8), th.randn(6, 4)
for _ in range(3):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    model.optimizer.step()
    model.optimizer.zero_grad()
out = tuple(p.detach().clone() for p in model.parameters())
'''

_S28_PARAM_DEFAULT = _NET + '''

def build(model, optimizer_cls=torch.optim.AdamW, lr=1e-2):
    return optimizer_cls(model.parameters(), lr=lr, weight_decay=0.1)
'''

_S28_CLASS_ATTRIBUTE = _NET + '''

class Trainer:
    optim_class = torch.optim.SGD

    def __init__(self, model):
        self.model = model

    def make(self):
        return self.optim_class(self.model.parameters(), lr=1e-2, momentum=0.9)


def build(model):
    return Trainer(model).make()
'''

FusedOptimizer.FUSE += [
    # the default (Adam) runs the fused class; `self.optimizer_class is th.optim.Adam` is the test
    Fuse(_S28_INJECTED_BASE, name="s28_injected_class_default_through_base", run=_S28_POLICY_RUN.format(args=""),
         expect={"optimizer": "torch.optim.Adam", "class_chosen_at_run_time": "self.optimizer_class is th.optim.Adam",
                 "guard": "fresh_generator_kwargs_checked_class_checked"}),
    Fuse(_S28_PARAM_DEFAULT, name="s28_parameter_default_class", run=_TRAIN_RUN,
         expect={"optimizer": "torch.optim.AdamW", "class_chosen_at_run_time": "optimizer_cls is torch.optim.AdamW"}),
    Fuse(_S28_CLASS_ATTRIBUTE, name="s28_class_attribute_class", run=_TRAIN_RUN,
         expect={"optimizer": "torch.optim.SGD", "class_chosen_at_run_time": "self.optim_class is torch.optim.SGD"}),
]

FusedOptimizer.KEEP += [
    # the bindings name two torch.optim classes: each has its own arguments, no single fused class
    Keep(_S28_CLASS_ATTRIBUTE.replace("    def make(self):", "    def use_adam(self):\n        self.optim_class = torch.optim.Adam\n\n"
                                      "    def make(self):"),
         reason="its bindings/defaults name several torch.optim classes", name="s28_injected_two_classes"),
    # a default that is not a torch.optim class (a repo's own optimizer): nothing to swap, no near miss
    Keep(_S28_PARAM_DEFAULT.replace("optimizer_cls=torch.optim.AdamW", "optimizer_cls=None"), name="s28_parameter_default_none"),
    # a parameter re-bound in the function is not the injected default any more
    Keep(_S28_PARAM_DEFAULT.replace("    return optimizer_cls(", "    optimizer_cls = make_optimizer_class()\n    return optimizer_cls("),
         name="s28_parameter_rebound"),
    # an injected construction goes through the same argument rules as a named one
    Keep(_S28_PARAM_DEFAULT.replace("weight_decay=0.1)", "weight_decay=0.1, maximize=True)"),
         reason="changes what torch.optim computes", name="s28_parameter_default_unsupported_keyword"),
]


# s31 (found by bench/detect_spellings.py, local names renamed): the shared model reaches the optimizer's
# function under another name, through the process's args / spawn / a direct call; a model shared but never
# handed to the site's function does not block it
_S31_SHARED_UNDER_ANOTHER_NAME = _S25_SHARED_MODEL.replace('''    model = Net()
    model.share_memory()
    return [torch.multiprocessing.Process(target=worker, args=(model,)) for _ in range(workers)]''', '''    net = Net()
    net.share_memory()
    return [torch.multiprocessing.Process(target=worker, args=(net,)) for _ in range(workers)]''')

FusedOptimizer.KEEP += [
    Keep(_S31_SHARED_UNDER_ANOTHER_NAME, reason="`net.share_memory()` (line", name="s31_hogwild_model_shared_under_another_name"),
    Keep(_S25_SHARED_MODEL.replace('''def worker(model, steps=3):''', '''def worker(rank, model, steps=3):''').replace('''    model = Net()
    model.share_memory()
    return [torch.multiprocessing.Process(target=worker, args=(model,)) for _ in range(workers)]''', '''    shared = Net()
    shared.share_memory()
    torch.multiprocessing.spawn(worker, args=(shared,), nprocs=workers)'''),
         reason="`shared.share_memory()` (line", name="s31_hogwild_model_shared_through_spawn"),
]

FusedOptimizer.FUSE += [
    Fuse(_S25_SHARED_MODEL.replace('''    model = Net()
    model.share_memory()
    return [torch.multiprocessing.Process(target=worker, args=(model,)) for _ in range(workers)]''', '''    model, teacher = Net(), Net()
    teacher.share_memory()
    return [torch.multiprocessing.Process(target=worker, args=(model,)) for _ in range(workers)]'''),
         name="s31_another_model_shared_not_handed_to_the_site"),
]


# s31 (found by bench/detect_spellings.py, local names renamed): the second optimizer over the model is named
# like anything (``o2``), it is still an optimizer: ``model.zero_grad()`` cannot be bound for the fused one
FusedOptimizer.KEEP += [
    Keep(next(k.code for k in FusedOptimizer.KEEP if k.name == "module_zero_grad_with_a_second_optimizer_over_the_model")
         .replace("other_opt", "o2"), reason="`model.zero_grad()`", name="s31_second_optimizer_over_the_model_named_like_anything"),
]

FusedOptimizer.KEEP += [
    Keep(_KEEP_FIXTURE_BF16.replace("        model = Net()\n        return model.to(torch.bfloat16)", "        net = Net()\n        return net.to(torch.bfloat16)"),
         reason="bf16 parameters unsupported", name="s31_pytest_fixture_returns_its_local_cast_to_bf16"),
]

FusedOptimizer.KEEP += [
    Keep(_S25_NUMPY_SCALAR.replace("self.log_alpha = torch.tensor(np.log(init_alpha))", "log_init = np.log(init_alpha)\n        self.log_alpha = torch.tensor(log_init)"),
         reason="is float64 (numpy computes `np.log(init_alpha)`", name="s31_numpy_number_named_before_the_tensor"),
]

# -- s31: torchrec's model-parallel path (DistributedModelParallel, in-backward optimizers) ----------
# torchrec shards embedding tables into ShardedTensors, steps them with optimizers applied inside
# backward (`apply_optimizer_in_backward`), and builds the dense optimizer from a factory over a dict of
# the remaining params (`KeyedOptimizerWrapper(params, optim_factory)`): the factory's torch.optim class
# never sees the module's own parameter tensors as a list it owns, so a flat-buffer fused class is wrong.

_S31_TORCHREC_FACTORY = _NET + '''
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import KeyedOptimizerWrapper


def dense_factory(lr):
    def make(params):
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    return make


def shard(model, device, lr):
    model = DistributedModelParallel(module=model, device=device)
    return model, KeyedOptimizerWrapper(dict(model.named_parameters()), dense_factory(lr))
'''

_S31_IN_BACKWARD = _NET + '''
from torch.distributed.optim import _apply_optimizer_in_backward


def build(model, lr=1e-2):
    _apply_optimizer_in_backward(torch.optim.SGD, model.embedding.parameters(), {"lr": lr})
    return torch.optim.Adam(model.parameters(), lr=lr)
'''

# near miss: the same factory shape on a model nothing shards (DataParallel replicates, the
# parameters stay the module's own tensors)
_S31_PLAIN_FACTORY = _NET + '''

def dense_factory(lr):
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)


def build(model, lr=1e-2):
    wrapped = torch.nn.DataParallel(model)
    return dense_factory(lr)(wrapped.parameters())
'''

# a factory written as a def is rewritten (the guard is a statement inside it, where `params` is bound)
_S31_DEF_FACTORY = _S31_PLAIN_FACTORY.replace("    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)",
                                              "    def make(params):\n        return torch.optim.SGD(params, lr=lr, momentum=0.9)\n\n    return make")

FusedOptimizer.FUSE += [
    Fuse(_S31_DEF_FACTORY, name="s31_def_factory_on_unsharded_model", run=_TRAIN_RUN,
         expect={"optimizer": "torch.optim.SGD"}),
]

FusedOptimizer.KEEP += [
    Keep(_S31_TORCHREC_FACTORY, reason="torchrec's model-parallel path", name="s31_torchrec_keyed_optimizer_factory"),
    Keep(_S31_IN_BACKWARD, reason="torchrec's model-parallel path", name="s31_optimizer_applied_in_backward"),
    # the lambda's parameter is the params: a guard hoisted out of the lambda would read an unbound name
    Keep(_S31_PLAIN_FACTORY, reason="built inside a lambda from its own parameter", name="s31_factory_lambda_params"),
]


# -- s31: list-ness of params built with `+` ------------------------------------------------------------
# `[latent] + noises` and `self.params = list(a.parameters()); self.params += list(b.parameters())`:
# list.__add__ takes only a list (a generator raises TypeError) and `+=` extends a list in place, so the
# value is a list the guard can read without consuming it. An unknown left operand may define its own `+`.

_S31_CONCATENATED = _NET + '''

def build(model, lr=1e-2):
    rest = list(model.fc1.parameters()) + list(model.ln.parameters())
    return torch.optim.Adam([model.fc2.weight] + rest + [model.fc2.bias], lr=lr)
'''

_S31_EXTENDED_ATTRIBUTE = _NET + '''

class Learner:
    def __init__(self, agent, mixer=None, lr=1e-2):
        self.params = list(agent.parameters())
        if mixer is not None:
            self.params += list(mixer.parameters())
        self.optimiser = torch.optim.RMSprop(params=self.params, lr=lr, alpha=0.99, eps=1e-5)
'''

FusedOptimizer.FUSE += [
    Fuse(_S31_CONCATENATED, name="s31_params_list_concatenated", run="model = Net()\nopt = build(model)\n" + _TRAIN_STEPS,
         expect={"optimizer": "torch.optim.Adam"}),
    Fuse(_S31_EXTENDED_ATTRIBUTE, name="s31_params_attribute_extended_in_place",
         run="model = Net()\nopt = Learner(model).optimiser\n" + _TRAIN_STEPS,
         expect={"optimizer": "torch.optim.RMSprop", "params": "self.params"}),
]

FusedOptimizer.KEEP += [
    # the left operand is a helper's result (a generator's `+` would raise, but a helper may return
    # any type with its own `+`): no evidence that the sum is re-iterable
    Keep(_NET + "\n\ndef build(head, tail, lr=1e-2):\n    return torch.optim.Adam(head + [p for p in tail], lr=lr)\n",
         reason="which may be a one-shot iterator", name="s31_params_sum_with_unknown_left_operand"),
    # `self.params |= ...` is no list operation: the attribute's type is unknown
    Keep(_S31_EXTENDED_ATTRIBUTE.replace("self.params += list(", "self.params |= set("),
         reason="the params come from `self.params`, which may be a one-shot iterator", name="s31_params_attribute_other_operator"),
]


# -- s31: a bf16 cast under a condition before the construction: a run-time dtype guard --------------------
# `if main_module_bf16: model = model.to(torch.bfloat16)` (a parameter defaulting to False) then the
# optimizer: the runs that cast keep
# torch.optim (the guard reads every trainable parameter's dtype), the fp32 runs get the fused class.

_S31_CONDITIONAL_BF16 = _NET + '''

def build(model, use_bf16=False, lr=1e-2):
    if use_bf16:
        model = model.to(torch.bfloat16)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
'''

FusedOptimizer.FUSE += [
    Fuse(_S31_CONDITIONAL_BF16, name="s31_bf16_cast_under_a_condition_before", run=_TRAIN_RUN,
         expect={"optimizer": "torch.optim.AdamW", "guard": "fresh_generator_trainable_dtypes_checked"}),
]

FusedOptimizer.KEEP += [
    # cast after the construction: the guard ran before it, the fused class would meet bf16 params
    Keep(_S31_CONDITIONAL_BF16.replace("    if use_bf16:\n        model = model.to(torch.bfloat16)\n    return torch.optim.AdamW(",
                                       "    opt = torch.optim.AdamW(").replace("weight_decay=0.1)\n",
                                                                        "weight_decay=0.1)\n    if use_bf16:\n        model.to(torch.bfloat16)\n    return opt\n"),
         reason="bf16 parameters unsupported", name="s31_bf16_cast_under_a_condition_after"),
    # the flag is on by default: the default run casts, the fused branch would be dead there
    Keep(_S31_CONDITIONAL_BF16.replace("use_bf16=False", "use_bf16=True"),
         reason="bf16 parameters unsupported", name="s31_bf16_cast_under_a_flag_on_by_default"),
    # unconditional cast before it: every run has bf16 params, nothing for a guard to choose
    Keep(_S31_CONDITIONAL_BF16.replace("    if use_bf16:\n        model = model.to(torch.bfloat16)\n",
                                       "    model = model.to(torch.bfloat16)\n"),
         reason="bf16 parameters unsupported", name="s31_bf16_cast_unconditional_before"),
]


# -- s32: accelerate's launcher chooses DeepSpeed/FSDP/Megatron outside the code ---------------------
# `accelerate launch --config_file cfg.yaml train.py` with `distributed_type: DEEPSPEED` (MC-SMoE's
# scripts) wraps the prepared optimizer in ZeRO, which hands it fp32 partitions and re-assigns their
# grads every step; nothing in train.py says so. The candidate's guard reads the launcher's
# environment (ACCELERATE_USE_DEEPSPEED / _FSDP / _MEGATRON_LM) where the optimizer is built: those runs
# keep torch.optim. (A repository whose every accelerate config shards is a near miss: repo_facts,
# tests/test_detect_s32_optim_accelerate.py.) Here `Accelerator` stands in for accelerate's, with
# `prepare_optimizer` alone and accumulation, a spelling the labelled sets do not have.

_S32_PREPARE_OPTIMIZER = _NET + '''
from torch import optim


class _AcceleratedOptimizer:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        self.optimizer.step()

    def zero_grad(self, set_to_none=None):
        self.optimizer.zero_grad(**({} if set_to_none is None else {"set_to_none": set_to_none}))


class Accelerator:
    def __init__(self, gradient_accumulation_steps=1):
        self.gradient_accumulation_steps = gradient_accumulation_steps

    def prepare_optimizer(self, optimizer):
        return _AcceleratedOptimizer(optimizer)


def fit(net, batches, lr=0.05):
    accelerator = Accelerator(gradient_accumulation_steps=2)
    sgd = optim.SGD(net.parameters(), lr=lr, momentum=0.9, nesterov=True)
    sgd = accelerator.prepare_optimizer(sgd)
    for i, (x, y) in enumerate(batches):
        F.mse_loss(net(x), y).backward()
        if (i + 1) % accelerator.gradient_accumulation_steps == 0:
            sgd.step()
            sgd.zero_grad()
    return tuple(p.detach().clone() for p in net.parameters())
'''

_S32_FIT_RUN = "out = fit(Net(), [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(4)])\n"

FusedOptimizer.FUSE += [
    Fuse(_S32_PREPARE_OPTIMIZER, name="s32_accelerate_prepare_optimizer_launch_guarded", run=_S32_FIT_RUN,
         expect={"optimizer": "torch.optim.SGD", "guard": "fresh_generator_accelerate_launch_checked",
                 "accelerate_prepare": "line 41", "qualname": "fit"}),
]

FusedOptimizer.KEEP += [
    # the sharding engine chosen in code, as a plugin of the Accelerator: refused outright
    Keep(_S32_PREPARE_OPTIMIZER.replace("    def __init__(self, gradient_accumulation_steps=1):\n",
                                        "    def __init__(self, gradient_accumulation_steps=1, fsdp_plugin=None):\n")
         .replace("Accelerator(gradient_accumulation_steps=2)",
                  "Accelerator(gradient_accumulation_steps=2, fsdp_plugin=dict(sharding_strategy=1))"),
         reason="parameters flattened/re-allocated by FSDP/DeepSpeed/ZeRO", name="s32_accelerate_fsdp_plugin_in_code"),
]


# -- s32: a torch.optim class looked up at run time, then called ------------------------------------------
# `getattr(torch.optim, name)(params, lr=lr)` (FuxiCTR's get_optimizer), `resolve_optimizer(name)(params,
# lr=lr)` where resolve_optimizer (any file of the repo) only returns entries of a dict literal of torch.optim
# classes (rsl_rl's PPO / Distillation). Every fusable class has a fused counterpart with the same
# constructor (spec §10), so the class need not be known here: the guard evaluates the lookup (a getattr on
# torch.optim, or a function proved to be a pure lookup) and runs the fused branch only when it yields one of
# the torch.optim classes whose fused counterpart takes every argument written; the fused call is that
# counterpart, `torch_npu.optim.NpuFused<Name>`. Any other class (Adagrad, a third-party one, a name that
# raises) runs the original statement, which also raises where it did.

# the scope's text gate: the construction calls a call's result (`resolve(name)(params, ...)`)
_CALLED_LOOKUP_WORD = ")("
FusedOptimizer.SCOPE_WORDS = (*FusedOptimizer.SCOPE_WORDS, _CALLED_LOOKUP_WORD)
_LOOKUP_STATEMENTS = (ast.Expr, ast.Assign, ast.AnnAssign, ast.If, ast.Return, ast.Raise, ast.Pass)


def _s32_class_lookup(module: ModuleInfo, stmt: ast.stmt) -> Optional[tuple[ast.Call, str, tuple[str, ...]]]:
    """(construction call, lookup expression's text, torch.optim classes it may yield) where the statement
    calls the result of a run-time class lookup: ``getattr(torch.optim, <non-constant>)(...)`` or
    ``F(...)(...)`` with ``F`` a function of this file or the repo that :func:`_s32_pure_lookup` proves."""
    if _CALLED_LOOKUP_WORD not in segment(module, stmt) and _BY_NAME_WORD not in segment(module, stmt):
        return None
    for call in fast_walk(stmt):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Call)):
            continue
        inner = call.func
        if (isinstance(inner.func, ast.Name) and inner.func.id == "getattr" and len(inner.args) == 2 and not inner.keywords
                and "getattr" not in module.aliases and module.canonical(inner.args[0]) == "torch.optim"
                and not isinstance(inner.args[1], ast.Constant) and _side_effect_free(inner.args[1])):
            return call, segment(module, inner), tuple(_OPTIMIZERS)
        named = _s33_evaluated_optim_name(module, inner)
        if named is not None:
            # s33: `eval("torch.optim." + name)(...)` (ReChorus' BaseRunner): for a plain name it is
            # `getattr(torch.optim, name)`; the guard reads it that way and without raising (a name that
            # is not a torch.optim attribute gives None: the original statement runs, and raises where it did)
            return call, f"getattr(torch.optim, str({segment(module, named)}), None)", tuple(_OPTIMIZERS)
        if isinstance(inner.func, ast.Name) and all(_side_effect_free(a) for a in [*inner.args, *(k.value for k in inner.keywords)]):
            kinds = _s32_lookup_function(module, inner.func.id)
            if kinds:
                return call, segment(module, inner), kinds
    return None


def _s33_evaluated_optim_name(module: ModuleInfo, lookup: ast.Call) -> Optional[ast.expr]:
    """``X`` of ``eval("torch.optim." + X)``, ``eval("torch.optim.{}".format(X))`` or
    ``eval(f"torch.optim.{X}")`` (``X`` side-effect free, ``eval`` the builtin, ``torch`` the module); None
    for any other call."""
    if not (isinstance(lookup.func, ast.Name) and lookup.func.id == "eval" and "eval" not in module.aliases
            and len(lookup.args) == 1 and not lookup.keywords and module.aliases.get("torch") == "torch"):
        return None
    text, prefix = lookup.args[0], "torch.optim."
    name: Optional[ast.expr] = None
    if isinstance(text, ast.BinOp) and isinstance(text.op, ast.Add) and isinstance(text.left, ast.Constant) \
            and text.left.value == prefix:
        name = text.right
    elif (isinstance(text, ast.Call) and isinstance(text.func, ast.Attribute) and text.func.attr == "format"
          and isinstance(text.func.value, ast.Constant) and text.func.value.value == prefix + "{}"
          and len(text.args) == 1 and not text.keywords):
        name = text.args[0]
    elif (isinstance(text, ast.JoinedStr) and len(text.values) == 2 and isinstance(text.values[0], ast.Constant)
          and text.values[0].value == prefix and isinstance(text.values[1], ast.FormattedValue)
          and text.values[1].conversion == -1 and text.values[1].format_spec is None):
        name = text.values[1].value
    return name if name is not None and _side_effect_free(name) else None


def _s32_lookup_function(module: ModuleInfo, name: str) -> tuple[str, ...]:
    """The torch.optim classes a function named ``name`` (defined in this file, or imported from a file of
    the repo) may return, when its body is a pure lookup (:func:`_s32_pure_lookup`); () otherwise."""
    fn = next((n for n in module.tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name), None)
    if fn is None:
        from npufuse.scan import repo_facts

        found = repo_facts.definition(module, name)
        fn = found.node if found is not None and isinstance(found.node, ast.FunctionDef) else None
    return _s32_pure_lookup(fn) if isinstance(fn, ast.FunctionDef) else ()


def _s32_optim_class(node: ast.AST) -> Optional[str]:
    """``torch.optim.Adam`` / ``optim.Adam`` / ``torch.optim.adam.Adam``: the class name."""
    text = dotted(node) or ""
    parts = text.split(".")
    if len(parts) >= 2 and (parts[:2] == ["torch", "optim"] or parts[0] == "optim") and parts[-1] in (*_OPTIMIZERS, *_NO_FUSED):
        return parts[-1]
    return None


def _s32_pure_lookup(fn: ast.FunctionDef) -> tuple[str, ...]:
    """The fusable torch.optim classes ``fn`` may return when it does nothing but look a class up: its
    statements are a docstring, names bound to dict literals of torch.optim classes or to string methods
    of names (``name = name.lower()``), ``if`` tests, ``raise``, and returns of a torch.optim class or of a
    subscript / ``.get`` of such a dict. Anything else (a call with effects, a loop, another return) -> ()."""
    dicts: dict[str, list[str]] = {}
    returned: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
            return ()
        if isinstance(node, ast.stmt) and node is not fn and not isinstance(node, _LOOKUP_STATEMENTS):
            return ()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            v = node.value
            if isinstance(v, ast.Dict) and v.values and all(k is not None for k in v.keys):
                kinds = [_s32_optim_class(x) for x in v.values]
                if not all(kinds):
                    return ()
                dicts[node.targets[0].id] = kinds  # type: ignore[assignment]
            elif not (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and isinstance(v.func.value, ast.Name)
                      and v.func.attr in ("lower", "upper", "strip", "casefold") and not v.args):
                return ()
        elif isinstance(node, ast.AnnAssign):
            return ()
        elif isinstance(node, ast.Expr) and not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return ()
    for node in ast.walk(fn):
        if not isinstance(node, ast.Return):
            continue
        v = node.value
        kind = _s32_optim_class(v) if v is not None else None
        if kind is not None:
            returned.add(kind)
        elif isinstance(v, ast.Subscript) and isinstance(v.value, ast.Name) and v.value.id in dicts:
            returned |= set(dicts[v.value.id])
        elif (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "get"
              and isinstance(v.func.value, ast.Name) and v.func.value.id in dicts and len(v.args) == 1):
            returned |= set(dicts[v.func.value.id])
        else:
            return ()
    # calls other than the string methods above (the `if` tests may hold `x in d`, `isinstance`...): none
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Attribute) and node.func.attr in ("lower", "upper", "strip", "casefold", "get", "keys")) \
                and not (isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "list", "ValueError", "KeyError", "NotImplementedError", "TypeError")):
            return ()
    return tuple(k for k in _OPTIMIZERS if k in returned)


def _s32_looked_up_site(module: ModuleInfo, scope: Scope, stmt: ast.stmt, call: ast.Call, lookup: str, kinds: tuple[str, ...],
                        in_place: bool = False) -> Result:
    """The construction through a run-time class lookup (:func:`_s32_class_lookup`) as a candidate whose guard
    checks which torch.optim class the lookup yields, or a near miss."""
    line, end = stmt.lineno, stmt.end_lineno or stmt.lineno
    # the classes whose fused counterpart takes every argument as written (NpuFusedSGD has no lr default)
    usable = tuple(k for k in kinds
                   if _KeywordPlan(module, scope, call, line, _OPTIMIZERS[k][1], _OPTIMIZERS[k][0]).reason is None
                   and len(call.args) <= 1 + len(_OPTIMIZERS[k][1]) and not (k == "SGD" and keyword(call, "lr", 1) is None))
    if not usable:
        return NearMiss(_ID, scope.qualname, line, end,
                        f"the optimizer class is looked up at run time (`{lookup[:60]}`) and no fused counterpart of the "
                        "torch.optim classes it may yield takes the arguments written")
    names = ", ".join(repr(k) for k in usable)
    test = (f"(lambda _cls: getattr(_cls, '__module__', '').startswith('torch.optim') "
            f"and getattr(_cls, '__name__', '') in ({names},))({lookup})")
    result = _site(module, scope, stmt, call, _units(module).tiers(scope.qualname), in_place=in_place,
                   chosen_class=(usable[0], test))
    if not isinstance(result, Finding):
        return result
    written = f"torch_npu.optim.{_OPTIMIZERS[usable[0]][0]}"
    if result.fused.count(written) != 1:
        return NearMiss(_ID, scope.qualname, line, end, f"`{written}` is already written in the statement")
    result.fused = result.fused.replace(written, f"getattr(torch_npu.optim, 'NpuFused' + {lookup}.__name__)")
    result.params["optimizer"] = "torch.optim." + "|".join(usable)
    result.params["fused_class"] = "torch_npu.optim." + "|".join(_OPTIMIZERS[k][0] for k in usable)
    result.params["class_looked_up"] = lookup
    result.params.pop("class_chosen_at_run_time", None)
    result.notes = [n for n in result.notes if not n.startswith("the optimizer class is chosen at run time")]
    if lookup.startswith("getattr(torch.optim, str("):
        result.notes.append("`eval(\"torch.optim.\" + <name>)` is read as `getattr(torch.optim, <name>)` (the same class for a "
                            "plain name; any other string gives None in the guard, and the original statement runs)")
    result.notes.append(f"the class is looked up at run time (`{lookup[:60]}`): the guard runs the fused counterpart "
                        f"(torch_npu.optim.NpuFused<Name>) only when it yields torch.optim.{'/'.join(usable)}; any other "
                        "class keeps the original call")
    return result


_S32_LOOKUP_RESOLVER = _NET + '''
from itertools import chain


def resolve_optimizer(name: str):
    """The torch.optim class for a config name."""
    table = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "rmsprop": torch.optim.RMSprop}
    name = name.lower()
    if name in table:
        return table[name]
    raise ValueError(f"unknown optimizer {name!r}: choose from {list(table.keys())}")


class ActorCritic:
    def __init__(self, actor, critic, optimizer="adam", lr=1e-2):
        self.actor, self.critic = actor, critic
        self.optimizer = resolve_optimizer(optimizer)(chain(self.actor.parameters(), self.critic.parameters()), lr=lr)

    def update(self, x, y):
        loss = F.mse_loss(self.actor(x) + self.critic(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
'''

_S32_LOOKUP_RUN = '''\
agent = ActorCritic(Net(), Net(), optimizer="RMSprop")
x, y = torch.randn(6, 8), torch.randn(6, 4)
for _ in range(3):
    agent.update(x, y)
out = tuple(p.detach().clone() for p in [*agent.actor.parameters(), *agent.critic.parameters()])
'''

_S32_BY_NAME_TRY = _NET + '''

def get_optimizer(optimizer, params, lr):
    if isinstance(optimizer, str) and optimizer.lower() == "adam":
        optimizer = "Adam"
    try:
        optimizer = getattr(torch.optim, optimizer)(params, lr=lr)
    except AttributeError:
        raise NotImplementedError(f"optimizer={optimizer} is not supported")
    return optimizer


def build(model, lr=1e-3):
    return get_optimizer("adam", model.parameters(), lr)
'''

FusedOptimizer.FUSE += [
    Fuse(_S25_BY_NAME, name="s32_class_looked_up_by_name_called_at_once", run=_TRAIN_RUN,
         expect={"optimizer": "torch.optim.AdamW|Adam|SGD|Adadelta|RMSprop", "class_looked_up": "getattr(torch.optim, name)",
                 "qualname": "build"}),
    Fuse(_S32_BY_NAME_TRY, name="s32_class_looked_up_by_name_inside_try", run=_TRAIN_RUN,
         expect={"optimizer": "torch.optim.AdamW|Adam|SGD|Adadelta|RMSprop", "qualname": "get_optimizer",
                 "guard": "materialised_list_class_checked"}),
    Fuse(_S32_LOOKUP_RESOLVER, name="s32_class_from_a_pure_lookup_function", run=_S32_LOOKUP_RUN,
         expect={"optimizer": "torch.optim.AdamW|Adam|SGD|RMSprop", "class_looked_up": "resolve_optimizer(optimizer)",
                 "qualname": "ActorCritic.__init__"}),
]

FusedOptimizer.KEEP += [
    # an argument no fused counterpart takes: the lookup cannot matter
    Keep(_S25_BY_NAME.replace("(model.parameters(), lr=lr)", "(model.parameters(), lr=lr, maximize=True)"),
         reason="no fused counterpart of the torch.optim classes it may yield takes the arguments written",
         name="s32_class_looked_up_with_an_argument_no_fused_class_takes"),
    # the lookup table holds a class that is not torch.optim's: not a pure torch.optim lookup, nothing claimed
    Keep(_S32_LOOKUP_RESOLVER.replace('"rmsprop": torch.optim.RMSprop}', '"rmsprop": torch.optim.RMSprop, "lion": Lion}')
         .replace("from itertools import chain\n", "from itertools import chain\nfrom lion_pytorch import Lion\n"),
         name="s32_lookup_table_with_a_third_party_class"),
    # the resolver logs (a call with effects): not proved a pure lookup, so it is not evaluated twice
    Keep(_S32_LOOKUP_RESOLVER.replace("    name = name.lower()\n", "    name = name.lower()\n    print(f'optimizer: {name}')\n"),
         name="s32_lookup_function_with_a_side_effect"),
]


# -- s32: an optimizer handed to another framework's trainer (`optimizers=`) --------------------------------

def _s32_external_driver(module: ModuleInfo, call: ast.Call) -> Optional[str]:
    """The dotted name of ``call``'s callee when it comes from a package outside the repository (not torch,
    not a class or function of the repo): a framework whose training loop npufuse does not read."""
    name = module.canonical(call.func) or ""
    if not name or name.split(".")[0] in ("torch", "torch_npu") or "." not in name:
        return None
    from npufuse.scan import repo_facts

    if repo_facts.repo_root(module) is None:
        return name  # one file scanned alone: what it imports is outside it
    return repo_facts.external_origin(module, name)


_S32_COMPOSER = _NET + '''
from composer import Trainer


def train(model, loader, max_duration="1ep"):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    trainer = Trainer(model=model, train_dataloader=loader, optimizers=optimizer, max_duration=max_duration)
    return trainer.fit()
'''

FusedOptimizer.KEEP += [
    Keep(_S32_COMPOSER, reason="handed to `composer.Trainer` (optimizers=, line 21), a trainer from outside the repository",
         name="s32_handed_to_an_outside_trainer"),
    Keep(_S32_COMPOSER.replace("from composer import Trainer\n", "import hydra\n").replace(
        "    trainer = Trainer(model=model, train_dataloader=loader, optimizers=optimizer, max_duration=max_duration)\n",
        "    trainer = hydra.utils.instantiate(cfg.trainer, model=model, train_dataloader=loader, optimizers=optimizer)\n"),
         reason="handed to `hydra.utils.instantiate` (optimizers=", name="s32_handed_to_a_trainer_built_from_config"),
]


# -- s32: a LightningModule's optimizer under a strategy chosen at run time ----------------------------------
# `Trainer(strategy=args.strategy)` (WhisperSpeech's `--strategy`, default "ddp"), strategies from hydra
# configs: FSDPStrategy / DeepSpeedStrategy wrap the module before `configure_optimizers` is called and then
# flatten or re-assign its parameters and grads behind the optimizer. A strategy written as a literal is a
# near miss already; any other is read where the optimizer is built: Lightning attaches the Trainer before it
# calls configure_optimizers (`self._trainer`; `self.trainer` in Lightning 1.0, `training_type_plugin` before
# `strategy`). Called by hand (no Trainer), the fused class runs.
_LIGHTNING_SHARDED_WORDS = ("DeepSpeed", "FSDP", "Shard", "ModelParallel")


def lightning_strategy_guard(guard: str, me: str) -> str:
    """``guard`` made None when the Trainer attached to LightningModule ``me`` has a sharding strategy."""
    return (f"({guard}) if (lambda _t: not any(_w in type(getattr(_t, 'strategy', None) or getattr(_t, 'training_type_plugin', None)).__name__ "
            f"for _w in {_LIGHTNING_SHARDED_WORDS!r}))(getattr({me}, '_trainer', None) or vars({me}).get('trainer')) else None")


def _s32_lightning_self(module: ModuleInfo, scope: Scope) -> Optional[str]:
    """The name of the method's first parameter when the scope is a method of a LightningModule subclass
    (its bases followed through the classes of this file); None otherwise."""
    fn = scope.node
    if not scope.class_name or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args \
            or any(isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod") for d in fn.decorator_list):
        return None
    name: Optional[str] = scope.class_name
    seen: set[str] = set()
    while name and name not in seen:
        seen.add(name)
        cls = next((c for c in module.tree.body if isinstance(c, ast.ClassDef) and c.name == name), None)
        if cls is None:
            return None
        name = None
        for base in cls.bases:
            canon = module.canonical(base) or dotted(base) or ""
            if canon.split(".")[-1] == "LightningModule" and canon.split(".")[0] in ("lightning", "pytorch_lightning"):
                return fn.args.args[0].arg
            if isinstance(base, ast.Name) and name is None:
                name = base.id
    return None


_S32_LIGHTNING_RUNTIME_STRATEGY = _NET + '''
import argparse

import pytorch_lightning as pl


class Base(pl.LightningModule):
    def __init__(self, lr=1e-3):
        super().__init__()
        self.net = Net()
        self.lr = lr


class Task(Base):
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.net.parameters(), lr=self.lr, betas=(0.9, 0.95))
        return [opt], []


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()
    pl.Trainer(strategy=args.strategy, precision="16-mixed").fit(Task())
'''

FusedOptimizer.FUSE += [
    Fuse(_S32_LIGHTNING_RUNTIME_STRATEGY, name="s32_lightning_strategy_chosen_at_run_time",
         expect={"optimizer": "torch.optim.AdamW", "guard": "fresh_generator_lightning_strategy_checked",
                 "qualname": "Task.configure_optimizers"}),
]

FusedOptimizer.KEEP += [
    # a strategy object written in the code: sharding seen statically
    Keep(_S32_LIGHTNING_RUNTIME_STRATEGY.replace("pl.Trainer(strategy=args.strategy,",
                                                 "pl.Trainer(strategy=pl.strategies.FSDPStrategy(),"),
         reason="parameters flattened/re-allocated by FSDP/DeepSpeed/ZeRO", name="s32_lightning_fsdp_strategy_object"),
]


# -- s33 (helper optim33): the parameters' dtype is a run-time fact; backward(create_graph=True) -------

# The model comes from the caller (reasoning-from-scratch's `train_rlvr_grpo(model, ...)` over a Qwen3Model
# whose layers take cfg["dtype"] = torch.bfloat16; nanoGRPO's trainer handed a model cast to bf16 in
# another file): nothing here says its dtype, so the guard checks every trainable parameter when the
# optimizer is built. The run trains an fp32 model (the fused class runs) and a bf16 one (the original
# runs; without the check the fused class raises TypeError at its first step).
_S33_MODEL_FROM_CALLER = _NET + '''

def train(model, steps=3, lr=1e-2):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    x = torch.randn(6, 8, dtype=next(model.parameters()).dtype)
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).float().pow(2).mean().backward()
        optimizer.step()
    return model
'''

_S33_FP32_AND_BF16_RUN = '''\
fp32 = train(Net())
bf16 = train(Net().to(torch.bfloat16))
out = tuple(p.detach().float().clone() for m in (fp32, bf16) for p in m.parameters())
'''

# the params themselves from the caller (an opaque iterable: the guard materialises it once and checks
# every tensor that can get a grad, param-group dicts' lists included)
_S33_PARAMS_FROM_CALLER = _NET + '''

def fit(params, loss_fn, steps=3, lr=1e-2):
    optimizer = torch.optim.Adam(params, lr=lr, weight_decay=1e-4)
    for _ in range(steps):
        optimizer.zero_grad()
        loss_fn().backward()
        optimizer.step()
'''

_S33_PARAMS_RUN = '''\
x = torch.randn(6, 8)
fp32, bf16 = Net(), Net().to(torch.bfloat16)
fit(fp32.parameters(), lambda: fp32(x).pow(2).mean())
fit([{"params": list(bf16.parameters())}], lambda: bf16(x.to(torch.bfloat16)).float().pow(2).mean())
out = tuple(p.detach().float().clone() for m in (fp32, bf16) for p in m.parameters())
'''

# AdaHessian's shared CIFAR loop: loss.backward(create_graph=True) for every optimizer it compares. In
# grad mode AccumulateGrad adds out of place (`grad = grad + new`): every step after the first gives
# each parameter a new grad tensor, which the fused class's combined grad buffer never sees.
_S33_CREATE_GRAPH = _NET + '''
import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--optimizer", default="sgd")
args = parser.parse_args([])
model = Net()
if args.optimizer == "sgd":
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
else:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(3):
    loss = model(torch.randn(6, 8)).pow(2).mean()
    loss.backward(create_graph=True)
    optimizer.step()
    optimizer.zero_grad()
'''

# a gradient penalty (WGAN-GP, R1): torch.autograd.grad(create_graph=True) returns the grads and
# never touches `.grad`; the plain backward that follows accumulates in place
_S33_GRADIENT_PENALTY = _NET + '''

def build(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.5, 0.9))


def train(model, steps=3):
    optimizer = build(model)
    for _ in range(steps):
        x = torch.randn(6, 8, requires_grad=True)
        out = model(x)
        g, = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = out.pow(2).mean() + 10 * (g.norm(2, dim=1) - 1).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
'''

FusedOptimizer.FUSE += [
    Fuse(_S33_MODEL_FROM_CALLER, name="s33_model_from_caller_dtype_checked_at_run_time", run=_S33_FP32_AND_BF16_RUN,
         expect={"optimizer": "torch.optim.AdamW", "qualname": "train"}),
    Fuse(_S33_PARAMS_FROM_CALLER, name="s33_params_from_caller_dtype_checked_at_run_time", run=_S33_PARAMS_RUN,
         expect={"optimizer": "torch.optim.Adam", "guard": "materialised_list", "qualname": "fit"}),
    Fuse(_S33_GRADIENT_PENALTY, name="s33_autograd_grad_create_graph_does_not_touch_grads", run=_TRAIN_RUN,
         expect={"optimizer": "torch.optim.Adam", "qualname": "build"}),
]

FusedOptimizer.KEEP += [
    Keep(_S33_CREATE_GRAPH, reason="backward(create_graph=True)", name="s33_backward_create_graph_shared_loop"),
    # the functional spelling, the flag bound to a name first
    Keep(_S33_CREATE_GRAPH.replace("    loss.backward(create_graph=True)\n",
                                   "    second_order = True\n    torch.autograd.backward(loss, create_graph=second_order)\n"),
         reason="create_graph=True", name="s33_autograd_backward_create_graph_flag"),
]


# ReChorus' BaseRunner: `eval('torch.optim.{}'.format(self.optimizer_name))(model.customize_parameters(), ...)`
# (the name from argparse, Adam by default). For a plain name eval gives getattr(torch.optim, name): a run-time
# lookup like the s32 ones; the guard reads it without raising.
_S33_EVAL_LOOKUP = _NET + '''

class Runner:
    def __init__(self, optimizer_name="Adam", lr=1e-2, l2=1e-4):
        self.optimizer_name, self.learning_rate, self.l2 = optimizer_name, lr, l2

    def build(self, model):
        optimizer = eval('torch.optim.{}'.format(self.optimizer_name))(
            model.parameters(), lr=self.learning_rate, weight_decay=self.l2)
        return optimizer
'''

_S33_EVAL_RUN = '''\
model = Net()
opt = Runner("RMSprop").build(model)
x, y = torch.randn(6, 8), torch.randn(6, 4)
for _ in range(3):
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
out = tuple(p.detach().clone() for p in model.parameters())
'''

FusedOptimizer.FUSE += [
    Fuse(_S33_EVAL_LOOKUP, name="s33_eval_torch_optim_name_format", run=_S33_EVAL_RUN,
         expect={"class_looked_up": "getattr(torch.optim, str(self.optimizer_name), None)", "qualname": "Runner.build"}),
    Fuse(_S33_EVAL_LOOKUP.replace("eval('torch.optim.{}'.format(self.optimizer_name))", "eval('torch.optim.' + self.optimizer_name)"),
         name="s33_eval_torch_optim_name_concatenated", run=_S33_EVAL_RUN,
         expect={"class_looked_up": "getattr(torch.optim, str(self.optimizer_name), None)"}),
]

FusedOptimizer.KEEP += [
    # the params from a method of the model that nothing here (no repository) shows to be a pure list builder
    Keep(_S33_EVAL_LOOKUP.replace("model.parameters(), lr=", "model.customize_parameters(), lr="),
         reason="may be a one-shot iterator", name="s33_eval_lookup_params_from_unknown_method"),
]


# -- s34: a run-time class lookup bound to a name, called later ------------------------------------------
# The s32 lookups called at once, bound to a name first: `optimizer_fn = getattr(torch.optim, optimizer_type)`
# then `optimizer_fn(parameters, **config)` (stable-audio-tools), `optimizer = getattr(optim, optimizer)`
# rebinding the config's string (equiformer_v2), `opt_func = optimizer_dict[optimizer_name]` over a dict of
# torch.optim and third-party classes (Sophia), `Optimizer = {...}[name]` (a dict literal read at once). The
# construction calls the bound name, so the guard tests that name's value (read once, no lookup evaluated
# again): the fused counterpart `torch_npu.optim.NpuFused<Name>` runs only when the value is one of the
# torch.optim classes whose fused counterpart takes the arguments written; any other class (a third-party
# entry, a partial, a subclass of the repository) runs the original call.

def _s34_table_kinds(module: ModuleInfo, table: ast.AST) -> tuple[str, ...]:
    """The fusable torch.optim classes among the values of a dict literal (``{...}`` or ``dict(k=...)``)."""
    if isinstance(table, ast.Dict):
        values: list[ast.expr] = [v for v in table.values if v is not None]
    elif isinstance(table, (ast.Tuple, ast.List)):
        values = list(table.elts)  # s51b: `OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam)` indexed by a number
    elif isinstance(table, ast.Call) and isinstance(table.func, ast.Name) and table.func.id == "dict" and not table.args \
            and "dict" not in module.aliases:
        values = [k.value for k in table.keywords]
    else:
        return ()
    found = {_CANONICAL.get(module.canonical(v) or "") for v in values if isinstance(v, (ast.Name, ast.Attribute))}
    return tuple(k for k in _OPTIMIZERS if k in found)


def _s34_module_binding(module: ModuleInfo, name: str) -> Optional[ast.expr]:
    """The value of a module-level ``name = <value>`` (the last one), or None."""
    value = None
    for node in module.tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            value = node.value
    return value


def _s34_lookup_kinds(module: ModuleInfo, scope: Scope, value: ast.expr, line: int) -> tuple[tuple[str, ...], Optional[str]]:
    """(fusable torch.optim classes the run-time lookup ``value`` may yield, the name of the table it reads or
    None): ``getattr(torch.optim, <name>)``, ``eval("torch.optim." + <name>)``, a call of a pure lookup function
    (:func:`_s32_pure_lookup`), a subscript or ``.get`` of a dict literal, or of a name bound to one in this
    scope or at module level. ((), None) for anything else."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
        if (value.func.id == "getattr" and "getattr" not in module.aliases and len(value.args) in (2, 3) and not value.keywords
                and module.canonical(value.args[0]) == "torch.optim" and not isinstance(value.args[1], ast.Constant)):
            return tuple(_OPTIMIZERS), None
        if _s33_evaluated_optim_name(module, value) is not None:
            return tuple(_OPTIMIZERS), None
        if value.func.id not in ("getattr", "eval") and all(_side_effect_free(a) for a in [*value.args, *(k.value for k in value.keywords)]):
            return _s32_lookup_function(module, value.func.id), None
        return (), None
    table: Optional[ast.AST] = None
    if isinstance(value, ast.Subscript):
        table = value.value
    elif isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "get" and value.args:
        table = value.func.value
    table_name = table.id if isinstance(table, ast.Name) else None
    if table_name is not None:
        table = scope.definition(table_name, line) if table_name in scope.assignments else _s34_module_binding(module, table_name)
        if table is None and table_name not in scope.args:
            # s51b: a table imported from another module of the repository (`from optimizers import OPTIMIZERS`)
            imported = _fused_optimizer_s51b.imported_table(module, table_name)
            return (tuple(k for k in _OPTIMIZERS if f"torch.optim.{k}" in (imported or ())), table_name)
    handed = _fused_optimizer_s51b.handed_table(scope, value, tuple(_OPTIMIZERS))
    if handed is not None:
        return handed
    return (_s34_table_kinds(module, table), table_name) if table is not None else ((), None)


def _s34_bound_lookup(module: ModuleInfo, scope: Scope, stmt: ast.stmt) -> Optional[tuple[ast.Call, str, tuple[str, ...]]]:
    """(construction call, the name it calls, torch.optim classes that name may hold) where the statement calls
    a local name last bound, before it, to a run-time class lookup (:func:`_s34_lookup_kinds`)."""
    for call in fast_walk(stmt):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            found = _s40_attribute_lookup(module, scope, stmt, call)
            if found is not None:
                return found
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
            continue
        name = call.func.id
        if name in scope.args or name in module.aliases:
            continue  # a parameter (an injected class: _s28_injected_class) or an import
        value = scope.definition(name, stmt.lineno)
        if value is None:
            if not isinstance(scope.node, ast.Module) and name not in scope.assignments:
                # s51b: a module-level name bound to torch.optim classes in an if/else chain, called in a function
                kinds = _fused_optimizer_s51b.module_class_kinds(module, name, _OPTIMIZERS)
                if kinds:
                    return call, name, kinds
            continue
        kinds, _table = _s34_lookup_kinds(module, scope, value, stmt.lineno)
        if kinds:
            return call, name, kinds
    return None


def _s40_attribute_lookup(module: ModuleInfo, scope: Scope, stmt: ast.stmt, call: ast.Call) -> Optional[tuple[ast.Call, str, tuple[str, ...]]]:
    """s40 (reflow's Trainer): ``self.optimizer = getattr(optim, cfg.get("optimizer", "Adam"))`` then, later in the same
    method, ``self.optimizer = self.optimizer(params, lr=...)``: the attribute holds the looked-up class when the
    construction reads it (``bound_callee.attribute_value_before``), so the guard tests that value as for a local."""
    f = call.func
    if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self"):
        return None
    from npufuse.scan import bound_callee

    if not _s39_parameters_like(keyword(call, "params", 0)):
        return None  # the cheap test first: most calls of an attribute are no construction
    value = bound_callee.attribute_value_before(scope, f.attr, stmt.lineno)
    if value is None:
        return None
    kinds, _table = _s34_lookup_kinds(module, scope, value, stmt.lineno)
    return (call, f"self.{f.attr}", kinds) if kinds else None


def _s34_read_by_later_lookup(module: ModuleInfo, scope: Scope, stmt: ast.stmt) -> bool:
    """Whether the lookup this statement binds (``cls = getattr(torch.optim, n)``, or a dict ``table = {...}``)
    is what a later construction of this scope calls (:func:`_s34_bound_lookup`): that construction reports
    itself, so this binding is no near miss of its own."""
    targets = getattr(stmt, "targets", None) or ([stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
    if len(targets) != 1 or not isinstance(targets[0], ast.Name):
        return False
    bound = targets[0].id
    for _b, _i, st in scope.statements():
        if st.lineno <= (stmt.end_lineno or stmt.lineno) or not isinstance(st, (ast.Assign, ast.AnnAssign, ast.Expr, ast.Return)):
            continue
        found = _s34_bound_lookup(module, scope, st)
        if found is None:
            continue
        value = scope.definition(found[1], st.lineno)
        if found[1] == bound or (value is not None and _s34_lookup_kinds(module, scope, value, st.lineno)[1] == bound):
            return True
    return False


# the fewest positional parameters after params among the fused classes (NpuFusedAdadelta's four): the room a
# `*args` tuple has where the class is only known at run time
_FEWEST_POSITIONAL = min((v[1] for v in _OPTIMIZERS.values()), key=len)


def _s34_starred_test(module: ModuleInfo, call: ast.Call, accepted: tuple[str, ...]) -> Optional[str]:
    """The run-time test for one ``*name`` after the params and lr written positionally (``Cls(groups, lr,
    *momentum, weight_decay=wd)``): the torch.optim classes and their fused counterparts take the same
    positional parameters in the same order (spec §10; torch.optim's extra ones are keyword-only, or come after
    them), so a list or tuple that fits the fused class's slots means the same in both. None when there is no
    such single trailing ``*name`` (no test can be written)."""
    starred = [i for i, a in enumerate(call.args) if isinstance(a, ast.Starred)]
    if len(starred) != 1 or starred[0] != len(call.args) - 1 or starred[0] < 2:
        return None
    value = call.args[-1].value  # type: ignore[attr-defined]
    if not isinstance(value, (ast.Name, ast.Attribute)) or not _side_effect_free(value):
        return None
    room = 1 + len(accepted) - starred[0]
    text = segment(module, value)
    return f"isinstance({text}, (tuple, list)) and len({text}) <= {room}"


_S34_CONFIG_LOOKUP = _NET + '''

def create_optimizer_from_config(optimizer_config, parameters):
    """stable-audio-tools' spelling: the class named by the config, then called with the config's kwargs."""
    optimizer_type = optimizer_config["type"]
    optimizer_fn = getattr(torch.optim, optimizer_type)
    optimizer = optimizer_fn(parameters, **optimizer_config["config"])
    return optimizer


def build(model):
    return create_optimizer_from_config({"type": "AdamW", "config": {"lr": 1e-3, "weight_decay": 0.01}}, model.parameters())
'''

_S34_REBOUND_NAME = _NET + '''
from torch import optim


class Trainer:
    """equiformer_v2's spelling: the config's string rebound to the class it names."""

    def __init__(self, model, config):
        self.model, self.config = model, config

    def load_optimizer(self):
        optimizer = self.config["optim"].get("optimizer", "AdamW")
        optimizer = getattr(optim, optimizer)
        decay = [p for n, p in self.model.named_parameters() if p.ndim > 1]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim <= 1]
        parameters = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = optimizer(parameters, lr=self.config["optim"]["lr_initial"])


def build(model):
    trainer = Trainer(model, {"optim": {"optimizer": "SGD", "lr_initial": 0.05}})
    trainer.load_optimizer()
    return trainer.optimizer
'''

_S34_TABLE_WITH_OTHERS = _NET + '''


class SignSGD(torch.optim.Optimizer):
    """The repository's own optimizer, listed beside torch.optim's."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99)):
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


optimizer_dict = {"adamw": torch.optim.AdamW, "signsgd": SignSGD}


def configure_optimizers(model, optimizer_name, learning_rate, betas):
    """Sophia's spelling: a module-level table of torch.optim and repository classes."""
    optim_groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                    {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt_func = optimizer_dict[optimizer_name]
    optimizer = opt_func(optim_groups, lr=learning_rate, betas=betas)
    return optimizer


def build(model, name="adamw"):
    return configure_optimizers(model, name, 1e-3, (0.9, 0.95))
'''

_S34_STARRED = _NET + '''

def make_optimizer(name, groups, lr, weight_decay):
    """A class from a dict literal read at once; SGD's momentum passed positionally through `*`."""
    cls = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[name]
    extra = (0.9,) if cls is torch.optim.SGD else ()
    return cls(groups, lr, *extra, weight_decay=weight_decay)


def build(model, name="sgd"):
    return make_optimizer(name, model.parameters(), 0.05, 1e-4)
'''

FusedOptimizer.FUSE += [
    Fuse(_S25_BY_NAME.replace("    return getattr(torch.optim, name)(model.parameters(), lr=lr)",
                              "    cls = getattr(torch.optim, name)\n    return cls(model.parameters(), lr=lr)"),
         name="s34_getattr_lookup_bound_then_called", run=_TRAIN_RUN,
         expect={"class_looked_up": "cls", "optimizer": "torch.optim.AdamW|Adam|SGD|Adadelta|RMSprop", "qualname": "build"}),
    Fuse(_S34_CONFIG_LOOKUP, name="s34_config_lookup_bound_then_called_with_config_kwargs", run=_TRAIN_RUN,
         expect={"class_looked_up": "optimizer_fn", "qualname": "create_optimizer_from_config"}),
    Fuse(_S34_REBOUND_NAME, name="s34_config_string_rebound_to_its_class", run=_TRAIN_RUN,
         expect={"class_looked_up": "optimizer", "qualname": "Trainer.load_optimizer"}),
    Fuse(_S34_TABLE_WITH_OTHERS, name="s34_module_table_with_a_repository_class", run=_TRAIN_RUN,
         expect={"class_looked_up": "opt_func", "optimizer": "torch.optim.AdamW", "qualname": "configure_optimizers"}),
    Fuse(_S34_TABLE_WITH_OTHERS.replace('def build(model, name="adamw")', 'def build(model, name="signsgd")'),
         name="s34_table_entry_not_torch_is_guarded", expect={"class_looked_up": "opt_func"}),
    Fuse(_S34_STARRED, name="s34_dict_literal_lookup_with_starred_positional", run=_TRAIN_RUN,
         expect={"class_looked_up": "cls", "optimizer": "torch.optim.Adam|SGD",
                 "starred_args": "isinstance(extra, (tuple, list)) and len(extra) <= 3"}),
]

FusedOptimizer.KEEP += [
    # a table of the repository's classes only: no torch.optim class can be called through it
    Keep(_S34_TABLE_WITH_OTHERS.replace('"adamw": torch.optim.AdamW, ', ""), name="s34_table_without_torch_optim_classes"),
    # the `*` tuple fills the lr slot: NpuFusedSGD has no lr default, the slots cannot be checked as written
    Keep(_S34_STARRED.replace("return cls(groups, lr, *extra, weight_decay=weight_decay)",
                              "return cls(groups, *((lr,) + extra), weight_decay=weight_decay)"),
         reason="positional arguments passed through `*args`", name="s34_starred_holding_lr"),
    # an argument no fused counterpart takes: the bound lookup cannot matter
    Keep(_S34_CONFIG_LOOKUP.replace('optimizer_fn(parameters, **optimizer_config["config"])',
                                    'optimizer_fn(parameters, maximize=True, **optimizer_config["config"])'),
         reason="no fused counterpart", name="s34_bound_lookup_with_an_argument_no_fused_class_takes"),
]


# -- s34: an LR scheduler on the optimizer is no second optimizer over the model --------------------------
# transformer-xl's train.py (and its copies in fastmoe and Adan): `optimizer = optim.SGD(model.parameters(), ...)`,
# `scheduler = optim.lr_scheduler.CosineAnnealingLR(optimizer, ...)`, `model.zero_grad()` in the loop; ConSinGAN's
# `torch.optim.lr_scheduler.MultiStepLR(optimizer=optimizerD, milestones=...)`. The scheduler was read as another
# optimizer over the model's parameters (built from `optimizer`, which takes them), so `model.zero_grad` was not
# bound to zero in place and the site was refused.

_S34_SCHEDULED = _NET + '''
from torch import optim


def build(model, lr=0.05, max_step=100):
    optimizer = optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = optim.lr_scheduler.CosineAnnealingLR(optimizer, max_step, eta_min=0.0)
    return optimizer, scheduler


def train(model, steps=3):
    optimizer, scheduler = build(model)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    for _ in range(steps):
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        scheduler.step()
'''

_S34_SCHEDULED_RUN = '''\
model = Net()
train(model)
out = tuple(p.detach().clone() for p in model.parameters())
'''

FusedOptimizer.FUSE += [
    Fuse(_S34_SCHEDULED, name="s34_lr_scheduler_on_the_optimizer_is_no_other_optimizer", run=_S34_SCHEDULED_RUN,
         expect={"optimizer": "torch.optim.SGD", "qualname": "build"}),
    Fuse(_S34_SCHEDULED.replace("    scheduler = optim.lr_scheduler.CosineAnnealingLR(optimizer, max_step, eta_min=0.0)\n",
                                "    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer=optimizer, milestones=[50], gamma=0.1)\n"),
         name="s34_lr_scheduler_by_keyword_is_no_other_optimizer", run=_S34_SCHEDULED_RUN,
         expect={"optimizer": "torch.optim.SGD"}),
]

FusedOptimizer.KEEP += [
    # a second torch.optim optimizer over the same model's parameters beside the scheduler: binding the model's
    # zero_grad would change what that one sees, so the default free stays a blocker
    Keep(_S34_SCHEDULED.replace("    return optimizer, scheduler\n",
                                "    finetune = optim.Adam(model.parameters(), lr=lr)\n    return optimizer, scheduler, finetune\n")
         .replace("    optimizer, scheduler = build(model)\n", "    optimizer, scheduler, _finetune = build(model)\n"),
         reason="sets grads to None", name="s34_scheduler_beside_a_second_optimizer_over_the_model"),
]


# --- s35 (optim35): optimizers built in exclusive arms of one `if` are not "another optimizer" -------------
# transformer-xl's train.py (and its copies in fastmoe and Adan) builds `optim.SGD(model.parameters())`,
# `optim.Adam(model.parameters())` or `optim.Adagrad(...)` in `if args.optim.lower() == 'sgd': ... elif ...`
# arms and frees grads with `model.zero_grad()`: one run builds one of them, so binding the model's
# zero_grad to zero in place changes what no other optimizer sees. `_enclosing_tests` only pairs tests that
# call nothing and are read twice; arms of the same `if` statement exclude each other whatever the test
# calls, unless a loop of the function repeats that statement.
_S35_ARM_BUILDER = '''\
def build(model, name="sgd", lr=0.05):
    if name.lower() == "sgd":
        optimizer = optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    elif name.lower().startswith("adam"):
        optimizer = optim.Adam(model.parameters(), lr=lr * 0.1)
    else:
        raise ValueError(name)
    return optimizer
'''

_S35_CHOSEN_ARM = _NET + '''
from torch import optim


''' + _S35_ARM_BUILDER + '''


def train(model, name, steps=3):
    optimizer = build(model, name)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    for _ in range(steps):
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
'''

_S35_CHOSEN_ARM_RUN = '''\
outs = []
for name in ("sgd", "adamw"):
    model = Net()
    train(model, name)
    outs.extend(p.detach().clone() for p in model.parameters())
out = tuple(outs)
'''

# the choice spelled as a conditional statement over a config object, the other class in the else arm
_S35_CHOSEN_ELSE = _NET + '''
import torch.optim


class Config:
    def __init__(self, opt="rms", lr=1e-2):
        self.opt, self.lr = opt, lr


def make(net, cfg=Config()):
    if cfg.opt not in {"rms", "rmsprop"}:
        opt = torch.optim.SGD(params=net.parameters(), lr=cfg.lr, nesterov=True, momentum=0.5)
    else:
        opt = torch.optim.RMSprop(net.parameters(), lr=cfg.lr, alpha=0.9)
    return opt


def train(net, steps=3):
    opt = make(net)
    x = torch.randn(5, 8)
    for _ in range(steps):
        net.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()
'''

FusedOptimizer.FUSE += [
    Fuse(_S35_CHOSEN_ARM, name="s35_optimizers_in_exclusive_elif_arms_bind_the_models_zero_grad", run=_S35_CHOSEN_ARM_RUN,
         expect={"optimizer": "torch.optim.SGD", "qualname": "build"}),
    Fuse(_S35_CHOSEN_ELSE, name="s35_optimizers_in_if_else_arms_over_a_config_bind_the_models_zero_grad",
         run=_S34_SCHEDULED_RUN, expect={"optimizer": "torch.optim.SGD", "qualname": "make"}),
]

FusedOptimizer.KEEP += [
    # the same arms under a loop of the function: both optimizers exist in one run, over the same model
    Keep(_S35_CHOSEN_ARM.replace(_S35_ARM_BUILDER, '''def build(model, names=("sgd", "adam"), lr=0.05):
    made = []
    for name in names:
        if name.lower() == "sgd":
            optimizer = optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        else:
            optimizer = optim.Adam(model.parameters(), lr=lr * 0.1)
        made.append(optimizer)
    return made[0]
'''), reason="sets grads to None", name="s35_arms_repeated_by_a_loop_build_both_optimizers"),
]


# -- s37 audit fixes (fix37) ----------------------------------------------------------------------
# F1: a model whose forward skips a trainable submodule (or discards its output) on steps drawn at
# random (npufuse.scan.random_skip): its params have no grad on such steps, and the fused class
# excludes for good a param without a grad at the first step and steps the others with zero grads.
# This file's classes (and, with the scan root, the classes they are built from); the scan's repo
# pass (random_skip.apply) follows the trainer's imports and configs.


def _s37_random_skip(module: ModuleInfo, scope: Scope, guard: str, call: ast.Call) -> Optional[str]:
    from npufuse.scan import random_skip
    from npufuse.scan.repo_facts import repo_root

    params = keyword(call, "params", 0)
    text = module.source
    if "def forward" not in text and "import" not in text:
        return None
    try:
        return random_skip.in_file(module.path, text, module.tree, repo_root(module), scope.qualname, guard,
                                   segment(module, params) if params is not None else "")
    except (Exception, RecursionError):  # an analysis aid: never lose the site over it
        return None


def _s40_on_the_sites_path(module: ModuleInfo, stmt: ast.stmt, model: str, tiers: tuple[_FileFacts, _FileFacts, _FileFacts]
                           ) -> tuple[_FileFacts, _FileFacts, _FileFacts]:
    """s40 (audit39): the tiers less the sharding and re-allocation facts that cannot concern this optimizer: FSDP /
    DeepSpeed / ZeRO named only in the other arm of an ``if`` the construction sits in (InternImage's
    ``if use_zero: ZeroRedundancyOptimizer(...) else: optim.SGD(...)``), or in a test the path to the construction
    has already refused by raising (OmniGen's LoRA arm: ``if distributed_type == FSDP: raise ...``, and later
    checks of that same test); ``.data =`` assignments to the parameters of a deep copy (an EMA model), when the
    optimizer does not take that copy (:func:`_s40_copy_reallocation`)."""
    if not any(t.sharding_nodes or t.data_assign is not None for t in tiers):
        return tiers
    refused = _s40_refused_tests(module, stmt) if any(t.sharding_nodes for t in tiers) else set()
    out = []
    for t in tiers:
        drop = [n for n in t.sharding_nodes if _s35_exclusive_arms(module.tree, stmt.lineno, getattr(n, "lineno", stmt.lineno))
                or (refused and _s40_under_refused_test(module, n, refused))]
        copies = [ln for ln, target in t.data_assigns if t.data_assign is not None and _s40_copy_reallocation(module, ln, target, model)]
        if not drop and t.data_assign not in copies:
            out.append(t)
            continue
        kept = _FileFacts.merged(module, [t])
        kept.uncalled_reallocation = t.uncalled_reallocation
        kept.sharding_nodes = [n for n in t.sharding_nodes if not any(n is d for d in drop)]
        first = kept.sharding_nodes[0] if kept.sharding_nodes else None
        kept.sharding = (getattr(first, "lineno", 0), _sharding_identifier(module, first) or "") if first is not None else None
        if t.data_assign in copies:
            skip = {t.uncalled_reallocation[0]} if t.uncalled_reallocation else set()
            kept.data_assign = next((ln for ln, _t in t.data_assigns if ln not in copies and ln not in skip), None)
        out.append(kept)
    return out[0], out[1], out[2]


def _s40_refused_tests(module: ModuleInfo, stmt: ast.stmt) -> set[str]:
    """Dumps of the tests of ``if T: ... raise ...`` statements (the body ending in a raise, no else) that precede
    ``stmt`` in a block on its path: past them, T is false."""
    out: set[str] = set()
    body: list[ast.stmt] = module.tree.body
    while True:
        holder = None
        for st in body:
            if st.lineno <= stmt.lineno <= (st.end_lineno or st.lineno):
                holder = st
                break
            if isinstance(st, ast.If) and not st.orelse and st.body and isinstance(st.body[-1], ast.Raise) and _side_effect_free(st.test):
                out.add(ast.dump(st.test))
        if holder is None or holder is stmt:
            return out
        blocks = [getattr(holder, f, None) or [] for f in ("body", "orelse", "finalbody")]
        blocks += [h.body for h in getattr(holder, "handlers", None) or []]
        nxt = [b for b in blocks if b and b[0].lineno <= stmt.lineno <= (b[-1].end_lineno or b[-1].lineno)]
        if not nxt:
            return out
        body = nxt[0]


def _s40_under_refused_test(module: ModuleInfo, node: ast.AST, refused: set[str]) -> bool:
    """Does ``node`` sit in the test, or the body, of an ``if`` whose test is one of ``refused`` (false on the path)?"""
    parents = _parents(module)
    child, parent = node, parents.get(id(node))
    while parent is not None:
        if isinstance(parent, ast.If) and (child is parent.test or any(child is b for b in parent.body)) and ast.dump(parent.test) in refused:
            return True
        child, parent = parent, parents.get(id(parent))
    return False


_S42_LITERALS = (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)


def _s42_non_tensor_value(module: ModuleInfo, value: ast.expr) -> bool:
    """s42 (ports 12, cornac's VAECF ``u_batch.data = np.ones(len(u_batch.data))`` on a scipy sparse batch): is the
    value assigned to some ``X.data`` a numpy array or a Python literal? ``Tensor.data`` takes only a Tensor (torch
    raises TypeError for anything else), so such an ``X`` is no parameter and nothing is re-allocated."""
    if isinstance(value, _S42_LITERALS):
        return True
    if isinstance(value, ast.Call):
        return (module.canonical(value.func) or "").startswith("numpy.")
    return False


def _s40_copy_reallocation(module: ModuleInfo, line: int, target: ast.Attribute, model: str) -> bool:
    """Is ``target`` (``R.data`` assigned at ``line``) a parameter of a deep copy: ``R`` runs over
    ``M.parameters()`` (alone or in a ``zip``) where ``M`` is a parameter of the function, and every call of that
    function in the file passes there an expression every binding of which in the file is ``deepcopy(...)``
    (diffuser's ``EMA.update_model_average(self.ema_model, self.model)``, ``self.ema_model = copy.deepcopy(self.model)``),
    which is not the optimizer's model?"""
    root = target.value
    while isinstance(root, ast.Attribute):
        root = root.value
    if not isinstance(root, ast.Name):
        return False
    fn = next((sc.node for sc in reversed(module.scopes) if isinstance(sc.node, (ast.FunctionDef, ast.AsyncFunctionDef))
               and sc.node.lineno <= line <= (sc.node.end_lineno or sc.node.lineno)), None)
    if fn is None:
        return False
    owner = _s40_parameters_owner(fn, root.id)
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    if owner is None or owner not in names:
        return False
    method = bool(names) and names[0] in ("self", "cls")
    index = names.index(owner) - (1 if method else 0)
    passed: list[ast.expr] = []
    for n in fast_walk(module.tree):
        if isinstance(n, ast.Call) and (dotted(n.func) or "").split(".")[-1] == fn.name:
            arg = n.args[index] if 0 <= index < len(n.args) else next((k.value for k in n.keywords if k.arg == owner), None)
            if arg is None:
                return False
            passed.append(arg)
    return bool(passed) and all(_s40_deep_copy(module, a) and dotted(a) != model for a in passed)


def _s40_parameters_owner(fn: ast.AST, name: str) -> Optional[str]:
    """``M`` when ``name`` is bound by a ``for`` over ``M.parameters()`` (or that call's place in a ``zip``)."""
    for n in fast_walk(fn):
        if not isinstance(n, (ast.For, ast.AsyncFor)):
            continue
        it, tgt = n.iter, n.target
        pairs: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "zip" and isinstance(tgt, ast.Tuple):
            pairs = list(zip(tgt.elts, it.args))
        else:
            pairs = [(tgt, it)]
        for t, src in pairs:
            if isinstance(t, ast.Name) and t.id == name and isinstance(src, ast.Call) and isinstance(src.func, ast.Attribute) \
                    and src.func.attr == "parameters" and isinstance(src.func.value, ast.Name):
                return src.func.value.id
    return None


def _s40_deep_copy(module: ModuleInfo, value: ast.expr) -> bool:
    """Is every binding in the file of ``value`` (a name or ``self.x``) a ``deepcopy(...)`` call?"""
    name = dotted(value)
    if not name:
        return False
    attr = name[5:] if name.startswith("self.") and name.count(".") == 1 else None
    values: list[ast.expr] = []
    for n in fast_walk(module.tree):
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                if (attr is not None and isinstance(t, ast.Attribute) and t.attr == attr and dotted(t.value) == "self") or \
                        (attr is None and dotted(t) == name):
                    values.append(n.value)
    def copied(v: ast.expr) -> bool:
        while isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr in ("to", "cuda", "eval", "requires_grad_"):
            v = v.func.value
        return isinstance(v, ast.Call) and (dotted(v.func) or "").split(".")[-1] == "deepcopy"
    return bool(values) and all(copied(v) for v in values)


def _s40_grad_none_read(module: ModuleInfo, tiers: tuple[_FileFacts, ...]) -> Optional[str]:
    """s40: code of the site's region that tests a module parameter's grad for None where a zero grad changes the
    outcome (npufuse.scan.grad_none): the fused class keeps grads allocated. Not where the code keeps grads itself
    (every zero_grad of the region passes set_to_none=False: then torch.optim leaves no grad None after its first
    backward either)."""
    lines = {ln for t in tiers for ln in t.grad_tests}
    if not lines:
        return None
    if any(t.kept_grads for t in tiers) and not any(t.zero_grad_calls or t.module_zero_grad for t in tiers):
        return None
    from npufuse.scan import grad_none

    found = module.__dict__.get("_npufuse_grad_none_reads")
    if found is None:
        found = module.__dict__["_npufuse_grad_none_reads"] = grad_none.reads(module.source, module.tree)
    hit = next(((ln, test) for ln, test in found if ln in lines), None)
    return grad_none.reason(f"line {hit[0]}", hit[1], "the code that runs with this optimizer") if hit is not None else None


# F2: DistributedDataParallel(..., gradient_as_bucket_view=True): every p.grad a view into DDP's
# bucket (see _BUCKET_VIEW). The wrap precedes the construction in a trainer method (openvla's
# DDPStrategy.run_setup), or comes through a kwargs dict; plain DDP and the keyword False are fused.

_S37_DDP_BUCKET_VIEW = _NET + '''
from torch.nn.parallel import DistributedDataParallel as DDP


class Strategy:
    def __init__(self, model, device_id=0, lr=1e-3):
        self.model, self.device_id, self.lr = model, device_id, lr

    def setup(self):
        self.model = DDP(self.model, device_ids=[self.device_id], gradient_as_bucket_view=True)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=self.lr, weight_decay=0.0)
'''

_S37_DDP_BUCKET_VIEW_KWARGS = _NET + '''
import torch.nn.parallel as tnp


def wrap_and_build(net, rank, share_buckets=True, lr=1e-2):
    wrap_opts = {"device_ids": [rank], "gradient_as_bucket_view": share_buckets}
    wrapped = tnp.DistributedDataParallel(net, **wrap_opts)
    opt = torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=0.9)
    return wrapped, opt
'''

_S37_DDP_PLAIN = _NET + '''
from torch.nn.parallel import DistributedDataParallel as DDP


def wrap(model, rank):
    return DDP(model, device_ids=[rank], gradient_as_bucket_view=False)


def build(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)
'''

FusedOptimizer.FUSE += [
    Fuse(_S37_DDP_PLAIN, name="s37_ddp_without_bucket_view_grads", run=_TRAIN_RUN,
         expect={"optimizer": "torch.optim.AdamW", "qualname": "build"}),
]

FusedOptimizer.KEEP += [
    Keep(_S37_DDP_BUCKET_VIEW, reason="gradient_as_bucket_view", name="s37_ddp_bucket_view_grads_before_the_optimizer"),
    Keep(_S37_DDP_BUCKET_VIEW_KWARGS, reason="view into its flat all-reduce bucket",
         name="s37_ddp_bucket_view_through_a_kwargs_dict"),
]

# F1 examples: condition dropout that zeroes a submodule's output, layer drop that skips the call,
# an unconditional forward chosen by the trainer's draw; kept: a flag fixed per run, dropout, a
# drop-path mask multiplied in, a random flip of the input.
_S37_STYLE_DROP = '''\
import torch
import torch.nn as nn


class Styler(nn.Module):
    def __init__(self, dim=8, p_uncond=0.1):
        super().__init__()
        self.p_uncond = p_uncond
        self.style_proj = nn.Linear(dim, dim)
        self.body = nn.Linear(dim, dim)

    def forward(self, x, style):
        null_style = False
        if self.training and torch.rand(1) < self.p_uncond:
            null_style = True
        s = self.style_proj(style)
        s = torch.zeros_like(s) if null_style else s
        return self.body(x + s)


def build(dim=8):
    model = Styler(dim)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
'''

_S37_LAYER_SKIP = '''\
import random
import torch
import torch.nn as nn


class Stack(nn.Module):
    def __init__(self, dim=8, depth=4, skip_rate=0.2):
        super().__init__()
        self.skip_rate = skip_rate
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x):
        for i, blk in enumerate(self.blocks):
            if self.training and random.random() < self.skip_rate:
                continue
            x = x + blk(x)
        return x


class Trainer:
    def __init__(self, lr=1e-3):
        self.net = Stack()
        self.opt = torch.optim.SGD(self.net.parameters(), lr=lr, momentum=0.9)
'''

_S37_CALLER_DRAWN = '''\
import numpy as np
import torch
import torch.nn as nn


class TwoTower(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.ref_encoder = nn.Linear(dim, dim)
        self.denoiser = nn.Linear(dim, dim)

    def forward(self, x, ref, plain_pass=False):
        if not plain_pass:
            x = x + self.ref_encoder(ref)
        return self.denoiser(x)


def main(steps=3, drop_ratio=0.1):
    tower = TwoTower()
    optimizer = torch.optim.AdamW(tower.parameters(), lr=1e-4)
    for _ in range(steps):
        x, ref = torch.randn(4, 8), torch.randn(4, 8)
        plain = np.random.rand() < drop_ratio
        tower(x, ref, plain).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
'''

FusedOptimizer.KEEP += [
    Keep(_S37_STYLE_DROP, reason="replaces by a constant the output of `self.style_proj` on steps drawn at random",
         name="s37_condition_dropout_zeroes_a_submodule_output"),
    Keep(_S37_LAYER_SKIP, reason="skips the call of `self.blocks` on steps drawn at random", name="s37_layer_drop_skips_the_call"),
    Keep(_S37_CALLER_DRAWN, reason="when its `plain_pass` argument is drawn at random by the caller",
         name="s37_unconditional_forward_drawn_by_the_trainer"),
]

FusedOptimizer.FUSE += [
    # a flag fixed per run: the skipped params never get a grad, both optimizers leave them alone
    Fuse(_S37_STYLE_DROP.replace("        if self.training and torch.rand(1) < self.p_uncond:\n",
                                 "        if self.training and self.p_uncond >= 1.0:\n"),
         name="s37_condition_dropped_by_a_fixed_flag", expect={"qualname": "build"}),
    # drop-path multiplied in: the branch runs and its grads exist (zero where dropped)
    Fuse(_S37_LAYER_SKIP.replace("""            if self.training and random.random() < self.skip_rate:
                continue
            x = x + blk(x)""", """            keep = float(not self.training or random.random() >= self.skip_rate)
            x = x + keep * blk(x)"""), name="s37_drop_path_multiplied_keeps_the_grads", expect={"qualname": "Trainer.__init__"}),
    # a random flip of the input: every submodule is called on every step
    Fuse(_S37_CALLER_DRAWN.replace("        if not plain_pass:\n            x = x + self.ref_encoder(ref)\n",
                                   "        if plain_pass:\n            ref = ref.flip(-1)\n        x = x + self.ref_encoder(ref)\n"),
         name="s37_random_input_flip_calls_every_submodule", expect={"qualname": "main"}),
]

# a random data augmentation module in the trainer's file is no model part: a class kept to build
# transforms from (`self._resize = Resize`) and a torchvision transform have no parameters to skip
_S37_AUGMENTATION = '''\
import torch
import torch.nn as nn
import torchvision.transforms as T


class Resize(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.size = size

    def forward(self, x):
        return nn.functional.interpolate(x, size=self.size)


class RandomScale(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.p = p
        self._resize = Resize
        self.jitter = T.ColorJitter(0.2, 0.2)

    def forward(self, x):
        if torch.rand(1) < self.p:
            x = self._resize((x.shape[-2] * 2, x.shape[-1] * 2))(x)
        if torch.rand(1) < self.p:
            x = self.jitter(x)
        return x


def main(make_model):
    model = make_model()
    return torch.optim.AdamW(model.parameters(), lr=1e-3)
'''

FusedOptimizer.FUSE += [
    Fuse(_S37_AUGMENTATION, name="s37_random_augmentation_modules_are_not_model_parts", expect={"qualname": "main"}),
]


# -- s39 (opt39): an optimizer class loaded from a dotted path string -------------------------------------------------
# LLaMA-pretrain's `opt_class = load_class(opt_conf.name)` with `load_class` splitting "torch.optim.AdamW" and running
# `getattr(importlib.import_module(module), name)`: a run-time lookup like s32's `getattr(torch.optim, name)`. The
# classes it may yield are the dotted optimizer paths the repository spells (this file's strings, its configuration
# files): when every one is a torch.optim class torch_npu has a fused counterpart of, the construction is a candidate
# whose guard checks the loaded class (s32's machinery; any other class runs the original call); a path naming another
# class (bitsandbytes' AdamW8bit, torch.optim.Adagrad), or none spelt anywhere, is a near miss naming what is unknown.

# the scope's text gate: a loader call's usual spellings (`load_class(`, `get_class(`, `import_module(`)
_S39_LOADER_WORDS = ("_class(", "import_module")
FusedOptimizer.SCOPE_WORDS = (*FusedOptimizer.SCOPE_WORDS, *_S39_LOADER_WORDS)
_S39_LOADER_CALLS = frozenset(("rsplit", "split", "rpartition", "import_module", "getattr", "locate", "str"))
# a dotted path to a class in an optimizer module (`torch.optim.AdamW`, `bitsandbytes.optim.AdamW8bit`,
# `apex.optimizers.FusedAdam`); learning-rate schedulers are not optimizers
_S39_DOTTED_CLASS = re.compile(r"(?<![\w.])([A-Za-z_][\w.]*)\.([A-Z]\w*)(?![\w.])")


def _s39_path_loader(fn: ast.AST) -> bool:
    """Does ``fn`` only load a class from a dotted path: statements that split the path, import the module
    (``importlib.import_module``, ``pydoc.locate``) and return ``getattr(<module>, <name>)`` or the located object?"""
    if not isinstance(fn, ast.FunctionDef):
        return False
    imports = False
    for node in ast.walk(fn):
        if isinstance(node, (ast.Lambda, ast.AsyncFunctionDef, ast.ClassDef)) or (isinstance(node, ast.FunctionDef) and node is not fn):
            return False
        if isinstance(node, ast.stmt) and node is not fn and not isinstance(node, (ast.Assign, ast.Return, ast.Import, ast.ImportFrom, ast.Expr)):
            return False
        if isinstance(node, ast.Expr) and not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return False
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id if isinstance(node.func, ast.Name) else ""
            if name not in _S39_LOADER_CALLS:
                return False
            imports = imports or name in ("import_module", "locate")
    returns = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return)]
    return imports and bool(returns) and all(isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in ("getattr", "locate")
                                             for v in returns)


def _s39_loader(module: ModuleInfo, name: str) -> bool:
    fn = next((n for n in module.tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if fn is None and name not in module.aliases:
        return False
    if fn is None:
        from npufuse.scan import repo_facts

        found = repo_facts.definition(module, name)
        fn = found.node if found is not None else None
    return fn is not None and _s39_path_loader(fn)


def _s39_spelt_paths(module: ModuleInfo) -> list[str]:
    """The dotted optimizer-class paths the file's strings and the repository's configuration files spell."""
    cached = module.__dict__.get("_npufuse_s39_paths")
    if cached is not None:
        return cached
    texts = [n.value for n in fast_walk(module.tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and "optim" in n.value]
    from npufuse.scan.random_skip import RepoIndex
    from npufuse.scan.repo_facts import repo_root

    root = repo_root(module)
    if root is not None:
        texts += [t for _suffix, t in RepoIndex(root, [], 1 << 20).config_files() if "optim" in t]
    found = [f"{m.group(1)}.{m.group(2)}" for t in texts for m in _S39_DOTTED_CLASS.finditer(t)
             if "optim" in m.group(1) and "lr_scheduler" not in m.group(1)]
    cached = module.__dict__["_npufuse_s39_paths"] = list(dict.fromkeys(found))
    return cached


def _s39_parameters_like(node: Optional[ast.expr]) -> bool:
    """Is the first argument what an optimizer takes: ``m.parameters()`` / ``named_parameters()``, a list or
    comprehension, or a name / attribute that says params or groups (never an optimizer: a scheduler's first
    argument)?"""
    if node is None:
        return False
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("parameters", "named_parameters"):
        return True
    if isinstance(node, (ast.List, ast.ListComp, ast.GeneratorExp, ast.Tuple)):
        return True
    text = (dotted(node) or "").lower()
    return "optim" not in text and ("param" in text or "group" in text)


def _s39_loaded_class(module: ModuleInfo, scope: Scope, stmt: ast.stmt) -> Optional[Union[NearMiss, tuple[ast.Call, str, tuple[str, ...]]]]:
    """(construction call, lookup text, fusable classes) of an optimizer built through a class a path loader
    (:func:`_s39_path_loader`) returns, called at once (``load_class(path)(params, ...)``) or bound to a name of this
    scope first; a NearMiss when a spelt path names another class, or none is spelt; None when no loader is involved."""
    for call in fast_walk(stmt):
        if not isinstance(call, ast.Call):
            continue
        lookup: Optional[ast.Call] = None
        text = ""
        if isinstance(call.func, ast.Call):
            lookup, text = call.func, segment(module, call.func)
        elif isinstance(call.func, ast.Name) and call.func.id not in scope.args and call.func.id not in module.aliases:
            value = scope.definition(call.func.id, stmt.lineno)
            lookup, text = (value, call.func.id) if isinstance(value, ast.Call) else (None, "")
        if lookup is None or not isinstance(lookup.func, ast.Name) or not all(
                _side_effect_free(a) for a in [*lookup.args, *(k.value for k in lookup.keywords)]):
            continue
        if not _s39_parameters_like(keyword(call, "params", 0)) or not _s39_loader(module, lookup.func.id):
            continue  # a loaded scheduler (`sched_cls(self.optimizer, ...)`), loss or model is no optimizer
        paths = _s39_spelt_paths(module)
        kinds = tuple(k for k in _OPTIMIZERS if f"torch.optim.{k}" in paths)
        unknown = [p for p in paths if not (p.startswith("torch.optim.") and p.split(".")[-1] in _OPTIMIZERS)]
        where = f"`{segment(module, lookup)[:60]}`"
        line, end = stmt.lineno, stmt.end_lineno or stmt.lineno
        if unknown:
            return NearMiss(_ID, scope.qualname, line, end,
                            f"the optimizer class is loaded from a dotted path at run time ({where}) and the repository also "
                            f"names {', '.join(f'`{p}`' for p in unknown[:3])}, which torch_npu.optim has no fused counterpart of "
                            "(its fused classes: " + ", ".join(f"torch.optim.{k}" for k in _OPTIMIZERS) + ")")
        if not kinds:
            return NearMiss(_ID, scope.qualname, line, end,
                            f"the optimizer class is loaded from a dotted path at run time ({where}) and no file or "
                            "configuration of the repository spells the path: which class it is cannot be told")
        return call, text, kinds
    return None


# s39: `OPTIMIZERS[cfg.optim](params, lr=...)` / `table.get(name)(params, ...)` called at once over a dict literal
# holding several torch.optim classes (this scope's or the module's): the class is the dict's entry at run time, so
# s32's guard (the looked-up class is a torch.optim class with a fused counterpart taking the arguments written)
# decides; s35's `_chosen_construction` refused these ("several classes, each with its own arguments"), yet the
# constructor arguments are the call's own, the same for every entry. An entry of another library's class (Lion)
# fails the guard and runs the original call.

def table_lookup(lookup: ast.expr) -> Optional[tuple[ast.expr, ast.expr]]:
    """(table, key) of a callee spelled ``T[key]`` or ``T.get(key)``; None for any other callee. One reading for every
    reader of optimizer classes looked up in a table (s39 here, s51b's refusal and handed-in tables)."""
    if isinstance(lookup, ast.Subscript):
        return lookup.value, lookup.slice
    if isinstance(lookup, ast.Call) and isinstance(lookup.func, ast.Attribute) and lookup.func.attr == "get" and lookup.args:
        return lookup.func.value, lookup.args[0]
    return None


def _s39_table_called(module: ModuleInfo, scope: Scope, stmt: ast.stmt) -> Optional[tuple[ast.Call, str, tuple[str, ...]]]:
    """(construction call, lookup text, fusable classes) of a dict-literal lookup called at once whose table holds
    two or more fusable torch.optim classes; None otherwise (one class: :func:`_chosen_construction` guards it)."""
    for call in fast_walk(stmt):
        if not isinstance(call, ast.Call):
            continue
        lookup = call.func
        if table_lookup(lookup) is None:
            continue
        if not _s39_parameters_like(keyword(call, "params", 0)) or not _side_effect_free(lookup):
            continue
        kinds, table = _s34_lookup_kinds(module, scope, lookup, stmt.lineno)
        # s51b: one fusable class is enough where the table is module-level or imported (_chosen_construction reads
        # only a table this scope binds)
        if len(kinds) >= 2 or (kinds and table is not None and table not in scope.assignments):
            return call, segment(module, lookup), kinds
    return None


FusedOptimizer.FUSE += [
    Fuse(_CHOSEN_FROM_DICT.replace('"rowwise": RowWise', '"adam": torch.optim.Adam'), name="s39_optimizer_class_from_a_dict_of_two_fusable",
         run="model = Net()\nopt = run(model, 'adam')\n" + _TRAIN_STEPS,
         expect={"optimizer": "torch.optim.Adam|SGD", "class_looked_up": "opts[name]", "qualname": "run"}),
]

FusedOptimizer.KEEP += [
    # the key calls code: the guard would run it a second time
    Keep(_CHOSEN_FROM_DICT.replace('"rowwise": RowWise', '"adam": torch.optim.Adam').replace("opts[name](", "opts[name.lower()]("),
         reason="the dict key calls code", name="s39_dict_of_two_fusable_key_calls_code"),
]


# -- s40: an optimizer built through ``functools.partial(<torch.optim class>, ...)`` -----------------------------------
# ``opt_fn = partial(torch.optim.Adam, betas=(0.9, 0.99))`` then ``opt = opt_fn(model.parameters(), lr=lr)`` (fastai-style
# factories): ``bound_callee.choices`` reads the one partial the callee holds. The construction is the class's with the
# partial's keywords merged (checked against the fused class like written ones); the fused call is
# ``type(opt_fn)(torch_npu.optim.NpuFused<Name>, **opt_fn.keywords)(...)`` -- the same partial over the fused class --
# under a run-time test that the callee still is that partial (its class, no bound positionals, the same keyword names).
# Only keywords the fused class takes are carried (one it drops would be cut from text the statement does not hold).


def _s40_partial_attribute_words(module: ModuleInfo) -> tuple[str, ...]:
    """``self.<attr>`` for every attribute the module sets to a ``functools.partial(..)`` (review40): the method
    calling ``self.opt_fn(params, lr=..)`` names no optimizer class, so ``SCOPE_WORDS`` alone skipped the
    partial-built construction :func:`_s40_partial_construction` reads through a ``self.`` attribute (engine.gate_words
    adds these words; cached per module)."""
    cached = module.__dict__.get("_npufuse_s40_opt_partial_words")
    if cached is None:
        found: list[str] = []
        if "partial" in module.source or any(t == "functools.partial" for t in module.aliases.values()):
            # the text, not a walk of the tree (most files naming ``partial`` hold no such attribute)
            names = "|".join(re.escape(a) for a, t in module.aliases.items() if t == "functools.partial" and a.isascii())
            # (s50: ``self`` and its left boundary after it, as _compiled._SCRIPT_WORD: the same matches, found by the literal)
            rx = re.compile(r"self(?<!\wself)\s*\.\s*([A-Za-z_]\w*)\s*=\s*(?:[\w.]*\bpartial" + (f"|{names}" if names else "") + r")\s*\(")
            found = [f"self.{m.group(1)}" for m in rx.finditer(module.source) if m.group(1).isascii()]
        cached = module.__dict__["_npufuse_s40_opt_partial_words"] = tuple(dict.fromkeys(found))
    return cached


def _held_call_words(module: ModuleInfo) -> tuple[str, ...]:
    """The s40 partial attributes and (s51b) the names of tables of torch.optim classes the module looks a class
    up in (``OPTIMIZERS[name](..)`` in a function naming no class)."""
    return _s40_partial_attribute_words(module) + _fused_optimizer_s51b.registry_words(module, tuple(_OPTIMIZERS))


FusedOptimizer.held_call_words = staticmethod(_held_call_words)  # type: ignore[attr-defined]


def _s40_partial_construction(module: ModuleInfo, scope: Scope, stmt: ast.stmt) -> Optional[tuple[ast.Call, str, str, list[str]]]:
    """(the construction with the partial's keywords merged in, the torch.optim class, the callee's text, the names
    of the keywords the partial binds) where the
    statement calls a local or attribute holding exactly one ``functools.partial`` of a fusable torch.optim class."""
    from npufuse.scan import bound_callee

    for call in fast_walk(stmt):
        if not (isinstance(call, ast.Call) and isinstance(call.func, (ast.Name, ast.Attribute))):
            continue
        f = call.func
        if isinstance(f, ast.Name) and (f.id not in scope.assignments or f.id in scope.args):
            continue
        if isinstance(f, ast.Attribute) and not (isinstance(f.value, ast.Name) and f.value.id == "self"):
            continue
        if not _s39_parameters_like(keyword(call, "params", 0)) or "partial" not in module.source:
            continue
        choice = bound_callee.choices(module, scope, f)
        if choice is None or not choice.complete or len(choice.members) != 1 or choice.members[0].partial is None:
            continue
        part = choice.members[0].partial
        kind = _CANONICAL.get(choice.members[0].name)
        if kind is None or len(part.args) != 1 or any(k.arg is None or k.arg not in _OPTIMIZERS[kind][1] for k in part.keywords):
            continue
        if {k.arg for k in part.keywords} & {k.arg for k in call.keywords}:
            continue  # the call overrides a bound keyword: read as written, not merged
        synth = ast.Call(func=f, args=list(call.args), keywords=[*call.keywords, *part.keywords])
        ast.copy_location(synth, call)
        synth.end_lineno, synth.end_col_offset = call.end_lineno, call.end_col_offset
        return synth, kind, segment(module, f), sorted(str(k.arg) for k in part.keywords)
    return None


def _s40_partial_site(module: ModuleInfo, scope: Scope, stmt: ast.stmt, call: ast.Call, kind: str, held: str, names: list[str],
                      in_place: bool = False) -> Result:
    """The construction through a partial (:func:`_s40_partial_construction`) as a candidate checked at run time."""
    test = (f'(type({held}).__name__ == "partial" and getattr({held}, "func", None) is torch.optim.{kind} '
            f"and not {held}.args and sorted({held}.keywords) == {names!r})")
    result = _site(module, scope, stmt, call, _units(module).tiers(scope.qualname), in_place=in_place, chosen_class=(kind, test))
    if not isinstance(result, Finding):
        return result
    written = f"torch_npu.optim.{_OPTIMIZERS[kind][0]}"
    if result.fused.count(written) != 1:
        return NearMiss(_ID, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, f"`{written}` is already written in the statement")
    result.fused = result.fused.replace(written, f"type({held})({written}, **{held}.keywords)")
    result.params["partial_of"] = f"torch.optim.{kind}"
    result.notes.append(f"`{held}` is a functools.partial of torch.optim.{kind}: the fused class is wrapped in the same partial "
                        "(its keywords, checked against the fused class), where the callee still is that partial at run time")
    return result


# -- s40 (opt40): grad None-ness read by the training code; facts that concern other arms, models or tensors ----------
# (1) HO16b anmoa/PILF: code that tests `p.grad is None` on the model's parameters tells a grad torch.optim's
# zero_grad freed (or a parameter the step left without one) from a kept one; the fused class keeps grads allocated
# and zeroes them in place, so the test answers otherwise (npufuse.scan.grad_none: this file here, the files the
# trainer's imports reach in the repo pass). A test whose outcome a zero grad does not change (a norm added to a sum,
# an in-place scale, a finiteness check) or an optimizer's own loop over its param_groups is no such reader.

_S40_GRAD_NONE = _NET + '''

def pick_experts(model, k=1):
    ranked = []
    for name, p in model.named_parameters():
        if p.grad is None:
            ranked.append((float("inf"), name))
        else:
            ranked.append((p.grad.norm().item(), name))
    return sorted(ranked)[:k]


def train(model, steps=3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        pick_experts(model)
        optimizer.step()
        optimizer.zero_grad()
'''

_S40_GRAD_NORM_LOG = _NET + '''

def grad_norm(model):
    total = 0.0
    for p in model.parameters():
        if p.grad is not None:
            param_norm = p.grad.data.norm(2)
            total += param_norm.item() ** 2
    return total ** 0.5


def build(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)
'''

# (2) HO16a blueberry-llm: Muon's Newton-Schulz helper casts a gradient-derived tensor (`X = G.bfloat16()`); the
# model keeps its dtype, and the AdamW beside the custom optimizer is fused
_S40_HELPER_CAST = _NET + '''

def orthogonalize(G, steps: int = 5):
    assert G.ndim >= 2
    X = G.bfloat16()
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        X = 1.5 * X - 0.5 * X @ X.mT @ X
    return X


def build(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
'''

# (3) audit39 InternImage: ZeRO in the other arm of the `if` the construction sits in; (4) diffuser: `.data =` on an
# EMA's deep copy, not on the optimizer's model
_S40_ZERO_OTHER_ARM = _NET + '''
from torch.distributed.optim import ZeroRedundancyOptimizer


def build(model, use_zero=False, lr=1e-3):
    optimizer = None
    if use_zero:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return optimizer
'''

_S40_EMA_COPY = _NET + '''
import copy


class EMA:
    def __init__(self, beta=0.99):
        self.beta = beta

    def update(self, ma_model, current_model):
        for current, averaged in zip(current_model.parameters(), ma_model.parameters()):
            averaged.data = averaged.data * self.beta + (1 - self.beta) * current.data


class Trainer:
    def __init__(self, model, lr=1e-3):
        self.model = model
        self.ema = EMA()
        self.ema_model = copy.deepcopy(self.model)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def step_ema(self):
        self.ema.update(self.ema_model, self.model)
'''

FusedOptimizer.KEEP += [
    Keep(_S40_GRAD_NONE, reason="tests whether a parameter's grad is None (`p.grad is None` at line",
         name="s40_training_code_tests_grad_none"),
    # the same reader wrapped in a helper whose grads are appended: a zero grad changes the list
    Keep(_S40_GRAD_NORM_LOG.replace("            param_norm = p.grad.data.norm(2)\n            total += param_norm.item() ** 2\n",
                                    "            grads.append(p.grad)\n").replace("    total = 0.0\n", "    total, grads = 0.0, []\n"),
         reason="tests whether a parameter's grad is None", name="s40_grads_collected_when_not_none"),
    # the EMA update applied to the trained model itself
    Keep(_S40_EMA_COPY.replace("self.ema.update(self.ema_model, self.model)", "self.ema.update(self.model, self.ema_model)"),
         reason="parameters are re-allocated (`.data = ...`", name="s40_data_assigned_to_the_trained_model"),
    # the cast on the model itself (a module: cast in place)
    Keep(_S40_HELPER_CAST.replace("    return torch.optim.AdamW(", "    model.bfloat16()\n    return torch.optim.AdamW("),
         reason="bf16 parameters unsupported", name="s40_model_cast_beside_a_tensor_cast"),
    # FSDP wraps the model in the construction's own arm
    Keep(_S40_ZERO_OTHER_ARM.replace(
        "        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)\n    else:\n",
        "        model = torch.distributed.fsdp.FullyShardedDataParallel(model)\n").replace(
        "        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)\n",
        "        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)\n    else:\n        optimizer = None\n").replace(
        "    if use_zero:\n", "    if torch.distributed.is_initialized():\n"),
         reason="FSDP/DeepSpeed/ZeRO", name="s40_fsdp_in_the_constructions_own_arm"),
]

FusedOptimizer.FUSE += [
    Fuse(_S40_GRAD_NORM_LOG, name="s40_grad_norm_log_reads_grad_none_harmlessly", run="model = Net()\nopt = build(model)\n" + _TRAIN_STEPS,
         expect={"qualname": "build"}),
    Fuse(_S40_HELPER_CAST, name="s40_bf16_cast_of_a_gradient_temporary", run="model = Net()\nopt = build(model)\n" + _TRAIN_STEPS,
         expect={"qualname": "build"}),
    Fuse(_S40_ZERO_OTHER_ARM, name="s40_zero_in_the_other_arm", run="model = Net()\nopt = build(model)\n" + _TRAIN_STEPS,
         expect={"qualname": "build"}),
    Fuse(_S40_EMA_COPY, name="s40_data_assigned_to_an_ema_copy", run="model = Net()\nopt = Trainer(model).optimizer\n" + _TRAIN_STEPS,
         expect={"qualname": "Trainer.__init__"}),
]
