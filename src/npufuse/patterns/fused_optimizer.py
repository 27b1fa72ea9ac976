"""``fused_optimizer``: ``torch.optim.AdamW/Adam/SGD(...)`` → ``torch_npu.optim.NpuFused*``.

The torch optimizers update every parameter tensor with its own handful of small kernels (the
single-tensor path launches ~10 per tensor per step); torch_npu's fused optimizers copy params,
grads and states into one flat buffer per dtype at the first step and update each buffer with a
few kernels. The replacement is the same construction with the class swapped (same arguments,
same defaults: AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2; SGD's lr
default 1e-3 is passed explicitly because NpuFusedSGD has none).

Only where the documented constraints hold (spec §10): params fp32/fp16 (no bf16), grads never
re-allocated (no ``zero_grad(set_to_none=True)``, no ``model.zero_grad()`` on torch ≥ 2.0,
no ``p.grad = ...``), params never re-allocated (no FSDP / DeepSpeed / ZeRO flattening), and no
``foreach/fused/capturable/maximize/differentiable`` arguments. Anything else is a near miss.

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
from typing import Any, Iterable, Optional

from npufuse.patterns.base import Finding, Fuse, Keep, NearMiss, Pattern, Result, Risk
from npufuse.scan.dataflow import ModuleInfo, Scope, dotted, fast_walk, keyword, segment
from npufuse.scan.value import estimate, symbolic

_ID = "fused_optimizer"

# torch class -> (fused class, accepted argument names in positional order after params)
_OPTIMIZERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "AdamW": ("NpuFusedAdamW", ("lr", "betas", "eps", "weight_decay", "amsgrad")),
    "Adam": ("NpuFusedAdam", ("lr", "betas", "eps", "weight_decay", "amsgrad")),
    "SGD": ("NpuFusedSGD", ("lr", "momentum", "dampening", "weight_decay", "nesterov")),
}
_CANONICAL = {
    **{f"torch.optim.{k}": k for k in _OPTIMIZERS},
    "torch.optim.adamw.AdamW": "AdamW",
    "torch.optim.adam.Adam": "Adam",
    "torch.optim.sgd.SGD": "SGD",
}
_UNSUPPORTED_KW = ("foreach", "fused", "capturable", "maximize", "differentiable", "decoupled_weight_decay")
# Names that mean parameters get flattened, sharded or re-allocated behind the optimizer's back.
_SHARDING = ("FullyShardedDataParallel", "FSDP", "fully_shard", "deepspeed", "ZeroRedundancyOptimizer",
             "zero_optimization", "DeepSpeedEngine", "FlatParameter")
# Bytes per parameter element and kernels per parameter tensor of one step (fp32 state).
_STEP_COST = {  # fused bytes, single-tensor bytes, single-tensor kernels per tensor
    "AdamW": (28, 80, 10),
    "Adam": (28, 80, 10),
    "SGD": (20, 40, 4),
}


class FusedOptimizer(Pattern):
    id = _ID
    api = "torch_npu.optim.NpuFusedAdamW"
    title = "torch.optim AdamW/Adam/SGD → torch_npu.optim.NpuFused* (flat-buffer fused update)"
    training_ok = True
    bound = "launch"

    def detect(self, module: ModuleInfo, scope: Scope) -> Iterable[Result]:
        if not _relevant(module):
            return  # no optimizer class named in this file
        facts: Optional[_FileFacts] = None
        for _block, _i, stmt in scope.statements():
            if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Expr, ast.Return)):
                continue
            for call in _optimizer_calls(module, stmt):
                if facts is None:
                    facts = _FileFacts(module)
                yield _site(module, scope, stmt, call, facts)

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
        cached = module.__dict__["_npufuse_optim_relevant"] = any(k in src for k in _OPTIMIZERS) and ("optim" in src)
    return bool(cached)


def _optimizer_calls(module: ModuleInfo, stmt: ast.stmt) -> list[ast.Call]:
    out = []
    for node in fast_walk(stmt):
        if isinstance(node, ast.Call) and module.canonical(node.func) in _CANONICAL:
            out.append(node)
    return out


class _FileFacts:
    """File-wide facts that decide whether the fused optimizer's constraints can hold."""

    def __init__(self, module: ModuleInfo) -> None:
        self.sharding: Optional[tuple[int, str]] = None
        self.set_to_none: list[tuple[int, str]] = []  # (line, receiver) of zero_grad(set_to_none=True)
        self.module_zero_grad: list[tuple[int, str]] = []  # receiver.zero_grad() that is not an optimizer's
        self.grad_assign: Optional[int] = None
        self.data_assign: Optional[int] = None
        self.bf16: list[tuple[int, str]] = []  # (line, receiver or "") of bf16 casts / loads
        for name in module.aliases.values():
            if any(s.lower() in name.lower() for s in ("deepspeed", "fsdp", "fully_sharded")):
                self.sharding = (1, name)
        for node in fast_walk(module.tree):
            if isinstance(node, (ast.Name, ast.Attribute)) and self.sharding is None:
                ident = node.id if isinstance(node, ast.Name) else node.attr
                if ident in _SHARDING:
                    self.sharding = (node.lineno, ident)
            if isinstance(node, ast.Assign) or isinstance(node, ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr == "grad" and self.grad_assign is None:
                        self.grad_assign = node.lineno
                    if isinstance(t, ast.Attribute) and t.attr == "data" and isinstance(node, ast.Assign) and self.data_assign is None:
                        self.data_assign = node.lineno
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                if isinstance(node, ast.Call):
                    self._bf16_kw(node)
                continue
            attr, recv = node.func.attr, dotted(node.func.value) or ast.unparse(node.func.value)
            if attr == "zero_grad":
                flag = keyword(node, "set_to_none", 0)
                explicit_false = isinstance(flag, ast.Constant) and flag.value is False
                if isinstance(flag, ast.Constant) and flag.value is True:
                    self.set_to_none.append((node.lineno, recv))
                elif flag is None and not _looks_like_optimizer(recv):
                    self.module_zero_grad.append((node.lineno, recv))
                elif flag is not None and not explicit_false and not isinstance(flag, ast.Constant):
                    self.set_to_none.append((node.lineno, recv))
            elif attr == "bfloat16" and not node.args:
                self.bf16.append((node.lineno, recv))
            elif attr == "to" and any(_is_bf16(a) for a in [*node.args, *(k.value for k in node.keywords if k.arg == "dtype")]):
                self.bf16.append((node.lineno, recv))
            self._bf16_kw(node)

    def _bf16_kw(self, node: ast.Call) -> None:
        name = (dotted(node.func) or "").split(".")[-1]
        if name in ("from_pretrained", "from_config", "set_default_dtype") or name.endswith("from_pretrained"):
            for k in node.keywords:
                if k.arg in ("torch_dtype", "dtype") and _is_bf16(k.value):
                    self.bf16.append((node.lineno, ""))
            if name == "set_default_dtype" and node.args and _is_bf16(node.args[0]):
                self.bf16.append((node.lineno, ""))


def _is_bf16(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value in ("bfloat16", "bf16"):
        return True
    return (dotted(node) or "").split(".")[-1] in ("bfloat16", "bf16") and not isinstance(node, ast.Constant)


def _looks_like_optimizer(recv: str) -> bool:
    last = recv.split(".")[-1].lower()
    return "opt" in last or last in ("o", "solver")


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


def _guard(module: ModuleInfo, scope: Scope, call: ast.Call, stmt: ast.stmt) -> tuple[Optional[str], str]:
    params = keyword(call, "params", 0)
    if params is None:
        return None, "the optimizer gets no params argument npufuse can read"
    model = _model_of(module, scope, params, stmt.lineno)
    if model is not None:
        # a fresh generator: the user's own iterator is never touched
        return f"next({model}.parameters(), None)", ""
    if isinstance(params, ast.Name):
        # materialise the opaque iterable once: both branches then get the same list
        return f"next(iter(({params.id} := list({params.id}))), None)", ""
    return None, f"the params come from `{segment(module, params)[:50]}`: no parameter tensor to guard on without consuming it"


def _site(module: ModuleInfo, scope: Scope, stmt: ast.stmt, call: ast.Call, facts: _FileFacts) -> Result:
    kind = _CANONICAL[module.canonical(call.func) or ""]
    fused_cls, accepted = _OPTIMIZERS[kind]
    line, end = stmt.lineno, stmt.end_lineno or stmt.lineno

    def miss(reason: str) -> NearMiss:
        return NearMiss(_ID, scope.qualname, line, end, reason)

    # -- arguments ---------------------------------------------------------------------------
    for k in call.keywords:
        if k.arg is None:
            return miss(f"keyword arguments passed through `**{segment(module, k.value)}` may carry "
                        "fused=/foreach=/capturable=, which torch_npu.optim fused optimizers do not take")
        if k.arg in _UNSUPPORTED_KW:
            return miss(f"`{k.arg}=` is not supported by torch_npu.optim.{fused_cls} (no foreach/fused/capturable/"
                        "maximize/differentiable arguments)")
        if k.arg not in accepted and k.arg != "params":
            return miss(f"`{k.arg}=` has no counterpart in torch_npu.optim.{fused_cls}")
    if any(isinstance(a, ast.Starred) for a in call.args):
        return miss("positional arguments passed through `*args`: cannot check them against the fused class")
    if len(call.args) > 1 + len(accepted):
        return miss("more positional arguments than the fused class takes")
    # -- file-wide constraints -------------------------------------------------------------------
    if facts.sharding is not None:
        return miss(f"parameters flattened/re-allocated by FSDP/DeepSpeed/ZeRO (`{facts.sharding[1]}` at line "
                    f"{facts.sharding[0]}): the fused optimizer's combined buffers would go stale")
    guard, why = _guard(module, scope, call, stmt)
    if guard is None:
        return miss(why)
    model = guard[len("next("):].split(".parameters()")[0] if ".parameters()" in guard else ""
    bf16 = [(ln, r) for ln, r in facts.bf16 if not r or not model or r == model or r.split(".")[0] in (model, model.split(".")[0]) or "model" in r.lower()]
    if bf16:
        return miss(f"bf16 parameters unsupported: the file casts or loads the model in bfloat16 (line {bf16[0][0]}); "
                    "torch_npu fused optimizers take fp32/fp16 params only (keep fp32 master weights)")
    if facts.set_to_none:
        ln, recv = facts.set_to_none[0]
        return miss(f"`{recv}.zero_grad(set_to_none=True)` (line {ln}) frees the grads: the fused optimizer raises "
                    "on it (grads must stay allocated); use zero_grad() / set_to_none=False")
    if facts.module_zero_grad:
        ln, recv = facts.module_zero_grad[0]
        return miss(f"`{recv}.zero_grad()` (line {ln}) sets grads to None on torch >= 2.0, so they are re-allocated "
                    "every step and the fused optimizer's combined grad buffer goes stale; pass set_to_none=False")
    if facts.grad_assign is not None:
        return miss(f"grads are re-allocated (`.grad = ...` at line {facts.grad_assign}): the fused optimizer keeps "
                    "updating from its combined grad buffer")
    if facts.data_assign is not None:
        return miss(f"parameters are re-allocated (`.data = ...` at line {facts.data_assign}): the fused optimizer's "
                    "combined buffers would go stale")
    # -- the statement must own its lines (the span is whole lines) ------------------------------
    text = _statement_text(module, stmt)
    if text is None:
        return miss("the optimizer statement shares its line with other code")
    fused = _fused_text(module, stmt, call, fused_cls, kind, text)
    lr_given = keyword(call, "lr", 1) is not None
    params = {
        "optimizer": f"torch.optim.{kind}",
        "fused_class": f"torch_npu.optim.{fused_cls}",
        "args": {k.arg: segment(module, k.value) for k in call.keywords if k.arg and k.arg != "params"}
        | {accepted[i - 1]: segment(module, a) for i, a in enumerate(call.args) if i > 0},
        "params": segment(module, keyword(call, "params", 0)),  # type: ignore[arg-type]
        "param_groups": _is_groups(module, scope, keyword(call, "params", 0), stmt.lineno),  # type: ignore[arg-type]
        "guard": "fresh_generator" if model else "materialised_list",
        "lr_default_added": kind == "SGD" and not lr_given,
    }
    risks = [
        Risk("other", "about 70% more device memory for the optimizer (msFmkTransplt's advice table): params, grads "
             "and states are copied into combined flat buffers at the first step"),
        Risk("other", "params without a grad at the first step are excluded from the combined buffers for good "
             "(layers unfrozen later are never updated); params/grads must never be re-allocated afterwards "
             "(.cpu()/.to(), new Parameter, p.grad = ..., load_state_dict into new tensors)"),
        Risk("dtype", "params must be float32 or float16 (bf16 raises TypeError); mixed fp32/fp16 params get one buffer each"),
    ]
    notes = [
        "alternative (field lesson 9): torch.optim." + kind + "(..., fused=True) where the installed torch_npu registers "
        "the fused kernel for NPU; it keeps torch.optim semantics (zero_grad(set_to_none=True) allowed, bf16 params)",
        "zero_grad(): the fused class's default is set_to_none=False (grads are zeroed in place and stay allocated), "
        "unlike torch.optim >= 2.0 whose default frees them",
        "optimizer state: 'step' is a Python int in the fused class (a tensor in torch.optim); check checkpoint save/load",
        "the guard "
        + ("makes a fresh `" + model + ".parameters()` generator, so the user's iterator is never consumed" if model
           else "materialises the params iterable once into a list (walrus) so both branches see the same parameters; "
           "param-group dicts passed this way keep the original optimizer"),
    ]
    if params["lr_default_added"]:
        notes.append("NpuFusedSGD has no lr default: torch.optim.SGD's lr=1e-3 is passed explicitly")
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
    lines = module.source.splitlines(keepends=True)
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


def _fused_text(module: ModuleInfo, stmt: ast.stmt, call: ast.Call, fused_cls: str, kind: str, text: str) -> str:
    """The statement with the optimizer class swapped (byte offsets: ast columns are UTF-8)."""
    lines = module.source.splitlines(keepends=True)
    first = stmt.lineno
    raw = [ln.encode() for ln in lines[first - 1 : (stmt.end_lineno or first)]]

    def offset(lineno: int, col: int) -> int:
        return sum(len(r) for r in raw[: lineno - first]) + col

    blob = b"".join(raw)
    f0 = offset(call.func.lineno, call.func.col_offset)
    f1 = offset(call.func.end_lineno or call.func.lineno, call.func.end_col_offset or 0)
    c1 = offset(call.end_lineno or call.lineno, call.end_col_offset or 0) - 1  # the closing parenthesis
    tail_add = b""
    if kind == "SGD" and keyword(call, "lr", 1) is None:
        inside = blob[:c1].rstrip()
        tail_add = b" lr=1e-3" if inside.endswith(b",") or inside.endswith(b"(") else b", lr=1e-3"
    new = blob[:f0] + f"torch_npu.optim.{fused_cls}".encode() + blob[f1:c1] + tail_add + blob[c1:]
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

_KEEP_EXTRA_ARGS = _NET + '''
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

_KEEP_FOREACH = _NET + '''

def build(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
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

_KEEP_MODEL_ZERO_GRAD = _NET + '''

def train(model, loader, epochs=1):
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    for _ in range(epochs):
        for x in loader:
            loss = model(x).mean()
            loss.backward()
            optimizer.step()
            model.zero_grad()
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
]

FusedOptimizer.KEEP = [
    Keep(_KEEP_NANOGPT_TRAIN, reason="set_to_none=True", name="nanogpt_train_zero_grad_set_to_none"),
    Keep(_KEEP_EXTRA_ARGS, reason="**extra_args", name="nanogpt_fused_extra_args"),
    Keep(_KEEP_FSDP, reason="FSDP", name="fsdp_wrapped_model"),
    Keep(_KEEP_BF16, reason="bf16 parameters unsupported", name="hf_model_loaded_in_bf16"),
    Keep(_KEEP_FOREACH, reason="foreach", name="foreach_kwarg"),
    Keep(_KEEP_GRAD_ASSIGN, reason="re-allocated", name="manual_grad_averaging"),
    Keep(_KEEP_MODEL_ZERO_GRAD, reason="model.zero_grad()", name="module_zero_grad_default"),
]
