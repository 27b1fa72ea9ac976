"""s44 (helper moe44b): moe_experts recall classes read off real development misses that npufuse did not read.

1. Stacked expert projections with stacked biases: ``F.linear(x, W[e], B[e])``, ``F.linear(x, W[e]) + B[e]``,
   ``x @ W[e] + B[e]`` (gpt-oss style experts). The grouped matmul runs without its bias argument (the fused text's
   autograd.Function has no bias gradient); the bias is added after it as ``B`` repeated per group row
   (``repeat_interleave`` by the device counts, ``output_size`` given: no host sync), which autograd differentiates.
2. A row-wise activation module of this file between the two projections (``self.activation = SwiGLUFFN()`` whose
   forward is clamps, sigmoids, products and last-dim slices of its input): no fused op computes it, so it runs
   eagerly on all the permuted rows at once; it is proven row-wise from its forward's syntax (each output row is a
   function of the same input row only), which is what makes one call on all the rows equal the per-expert calls.
3. A file that uses ``torch.`` / ``nn.`` / ``F.`` names without importing torch (a notebook fragment): npufuse resolves
   torch names through the file's imports only, so its loops get a near miss that says so instead of silence.

The functions here read syntax only and return facts, texts or None; ``moe_experts`` calls them.
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Optional

from npufuse.patterns.base import Fuse, Keep
from npufuse.scan.dataflow import const_value, dotted, literal_ellipsis

# -- class 1: stacked biases ------------------------------------------------------------------------------------


def stacked_bias(node: Optional[ast.expr], is_eidx: Callable[[ast.expr], bool],
                 stacked_base: Callable[[ast.expr], bool]) -> Optional[str]:
    """``B[e]`` (``B`` a stacked tensor: ``self.b`` or a name bound outside the loop, indexed by the expert
    alone): ``B``'s text. None for anything else (a per-expert bias must be one row of one stacked tensor)."""
    if not (isinstance(node, ast.Subscript) and is_eidx(node.slice) and stacked_base(node.value)):
        return None
    return dotted(node.value)


def with_bias(proj_key: tuple, bias: str) -> Optional[tuple]:
    """The stacked projection key ``("stk", weight, orient)`` with its bias appended; None when the key is not
    a bias-free stacked projection (a second bias, or a per-expert module's projection)."""
    if len(proj_key) != 3 or proj_key[0] != "stk":
        return None
    return (*proj_key, bias)


def projection_biases(value: Any) -> tuple[dict[str, str], str]:
    """The biases of every stacked projection in a symbolic value tree (weight text -> bias text), and a reason
    when one weight is used both with and without a bias, or with two biases ("" when consistent)."""
    found: dict[str, set[str]] = {}

    def walk(v: Any) -> None:
        if isinstance(v, tuple):
            for a in v:
                walk(a)
            return
        kind, args = getattr(v, "kind", None), getattr(v, "args", None)
        if kind is None or args is None:
            return
        if kind == "proj" and args and isinstance(args[0], tuple) and args[0][:1] == ("stk",):
            found.setdefault(args[0][1], set()).add(args[0][3] if len(args[0]) > 3 else "")
        for a in args:
            walk(a)

    walk(value)
    for weight, biases in found.items():
        if len(biases) > 1:
            return {}, f"the stacked weight `{weight}` is used with different biases (or with and without one)"
    return {w: next(iter(b)) for w, b in found.items() if next(iter(b))}, ""


def first_layer_bias(biases: dict[str, str], gate_up: str, gate: str, up: str, fc1: str) -> tuple[str, str]:
    """The first grouped matmul's bias text (``[E, out]``, gate | up like its weight), and a reason it cannot be
    built ("" when fine). Separate gate and up projections need both biases or neither."""
    if gate_up or fc1:
        return biases.get(gate_up or fc1, ""), ""
    bg, bu = biases.get(gate, ""), biases.get(up, "")
    if bool(bg) != bool(bu):
        return "", "only one of the gate and up stacked projections has a bias"
    if not bg:
        return "", ""
    # the weights are concatenated gate first along their out dim: the biases the same way along their last dim
    return f"torch.cat(({bg}.reshape({bg}.shape[0], -1), {bu}.reshape({bu}.shape[0], -1)), dim=-1)", ""


def bias_lines(bias: str, h: str, counts: str) -> list[str]:
    """``h += bias`` of each row's expert: the groups are experts 0, 1, ... in order with ``counts`` rows each, so
    the per-expert bias repeated by the counts lines up with the grouped matmul's rows (``output_size`` spares the
    host sync; autograd carries the bias gradient). reshape(rows, -1): ``B[e]`` of shape [out], [1, out] or []."""
    if not bias:
        return []
    return [f"{h} = {h} + {bias}[:{counts}.shape[0]].to({h}.dtype).repeat_interleave({counts}, dim=0, "
            f"output_size={h}.shape[0]).reshape({h}.shape[0], -1)  # each row's expert bias"]


# -- class 2: a row-wise activation module of this file ----------------------------------------------------------

_ELEMENTWISE_FUNCS = frozenset((
    "torch.sigmoid", "torch.tanh", "torch.exp", "torch.clamp", "torch.clip", "torch.relu", "torch.erf", "torch.abs",
    "torch.minimum", "torch.maximum", "torch.nn.functional.silu", "torch.nn.functional.gelu",
    "torch.nn.functional.relu", "torch.nn.functional.sigmoid", "torch.nn.functional.tanh",
    "torch.nn.functional.softplus", "torch.nn.functional.leaky_relu", "torch.nn.functional.elu",
    "torch.nn.functional.mish", "torch.nn.functional.relu6",
))
_ELEMENTWISE_METHODS = frozenset(("clamp", "clip", "clamp_min", "clamp_max", "sigmoid", "tanh", "exp", "relu", "abs",
                                  "float", "half", "bfloat16", "type_as", "to", "neg"))


def rowwise_activation_template(cls: Optional[ast.ClassDef], init_assigns: dict[str, ast.expr], canon: Callable[[ast.expr], str],
                                 attr: str) -> Optional[str]:
    """``"{owner}.<attr>({x})"`` when ``self.<attr>`` is built as ``Cls()`` of a class ``cls`` of this file whose
    forward is row-wise (see :func:`_rowwise_forward`); None otherwise."""
    if cls is None:
        return None
    forward = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
    if forward is None or not _rowwise_forward(forward, init_assigns, canon):
        return None
    return f"{{owner}}.{attr}({{x}})"


def _rowwise_forward(fn: ast.FunctionDef, init_assigns: dict[str, ast.expr], canon: Callable[[ast.expr], str]) -> bool:
    """``forward(self, x)`` whose statements bind names to elementwise functions of ``x``, of last-dim slices
    (``x[..., a:b:c]``), of ``.chunk(n, dim=-1)`` parts and of scalar attributes (``self.alpha`` set to a constant or
    an ``__init__`` argument), and return one of them: every output row depends on the same input row only."""
    a = fn.args
    if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or len(a.args) != 2 or a.defaults:
        return False
    local = {a.args[1].arg}
    returned = False
    for i, st in enumerate(fn.body):
        if i == 0 and isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant) and isinstance(st.value.value, str):
            continue  # docstring
        if returned:
            return False
        if isinstance(st, ast.Assign) and len(st.targets) == 1:
            t = st.targets[0]
            if isinstance(t, ast.Name) and _rowwise_expr(st.value, local, init_assigns, canon):
                local.add(t.id)
                continue
            if isinstance(t, ast.Tuple) and all(isinstance(e, ast.Name) for e in t.elts) and _last_dim_chunk(st.value, local):
                local |= {e.id for e in t.elts}  # type: ignore[attr-defined]
                continue
            return False
        if isinstance(st, ast.Return) and st.value is not None and _rowwise_expr(st.value, local, init_assigns, canon):
            returned = True
            continue
        return False
    return returned


def _last_dim_chunk(node: ast.expr, local: set[str]) -> bool:
    """``v.chunk(n, dim=-1)`` / ``torch.chunk(v, n, dim=-1)`` of a local row-wise value."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "chunk"):
        return False
    dims = [k.value for k in node.keywords if k.arg == "dim"]
    if isinstance(node.func.value, ast.Name) and node.func.value.id in local and len(node.args) == 1:
        return len(dims) == 1 and const_value(dims[0]) == -1 and isinstance(const_value(node.args[0]), int)
    return False


def _scalar_attr(node: ast.expr, init_assigns: dict[str, ast.expr]) -> bool:
    """``self.alpha`` set in ``__init__`` to a number or to a plain ``__init__`` argument (a hyperparameter)."""
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
        return False
    value = init_assigns.get(node.attr)
    return isinstance(value, ast.Name) or isinstance(const_value(value), (int, float)) and not isinstance(const_value(value), bool) \
        if value is not None else False


def _number(node: ast.expr) -> bool:
    """A numeric constant, signs included (``-7``)."""
    v = const_value(node)
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _scalar(node: ast.expr, init_assigns: dict[str, ast.expr]) -> bool:
    """A number or a scalar attribute, signed (``-self.limit``)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    return _number(node) or _scalar_attr(node, init_assigns)


def _rowwise_expr(node: ast.expr, local: set[str], init_assigns: dict[str, ast.expr], canon: Callable[[ast.expr], str]) -> bool:
    def ok(n: Optional[ast.expr]) -> bool:
        return n is None or _rowwise_expr(n, local, init_assigns, canon)

    if isinstance(node, ast.Name):
        return node.id in local
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if _scalar_attr(node, init_assigns):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)):
        return ok(node.left) and ok(node.right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return ok(node.operand)
    if isinstance(node, ast.Subscript):
        # x[..., a:b:c]: a slice of the last dim with constant bounds
        sl = node.slice
        return isinstance(node.value, ast.Name) and node.value.id in local and isinstance(sl, ast.Tuple) \
            and len(sl.elts) == 2 and literal_ellipsis(sl.elts[0]) and isinstance(sl.elts[1], ast.Slice) \
            and all(p is None or isinstance(const_value(p), int) for p in (sl.elts[1].lower, sl.elts[1].upper, sl.elts[1].step))
    if isinstance(node, ast.Call):
        kw_ok = all(k.arg is not None and (_scalar(k.value, init_assigns) or k.arg == "dtype") for k in node.keywords)
        if not kw_ok:
            return False
        if isinstance(node.func, ast.Attribute) and node.func.attr in _ELEMENTWISE_METHODS \
                and not canon(node.func).startswith("torch."):
            return ok(node.func.value) and all(_scalar(x, init_assigns) or node.func.attr in ("to", "type_as") and ok(x) for x in node.args)
        if canon(node.func) in _ELEMENTWISE_FUNCS:
            return bool(node.args) and all(ok(x) for x in node.args)
    return False


# -- class 4: dense expert outputs combined by a one-hot of the top-k indices ----------------------------------------

_CASTS = frozenset(("to", "float", "half", "bfloat16", "type_as", "type"))


def one_hot_selection(node: ast.expr, canon: Callable[[ast.expr], str]) -> Optional[tuple[ast.expr, ast.expr, ast.expr]]:
    """(idx, num_classes, w) of ``F.one_hot(idx, num_classes=N)[.to(...)] * w.unsqueeze(-1)`` (either order; ``w[...,
    None]`` too): ``[..., K, E]``, weight ``w[.., k]`` at expert ``idx[.., k]`` of every slot, zero elsewhere."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return None
    for hot, weight in ((node.left, node.right), (node.right, node.left)):
        while isinstance(hot, ast.Call) and isinstance(hot.func, ast.Attribute) and hot.func.attr in _CASTS:
            hot = hot.func.value
        if not (isinstance(hot, ast.Call) and canon(hot.func) == "torch.nn.functional.one_hot" and hot.args):
            continue
        ncls = hot.args[1] if len(hot.args) > 1 else next((k.value for k in hot.keywords if k.arg == "num_classes"), None)
        w = _last_dim_column(weight)
        if ncls is not None and w is not None and len(hot.args) + len(hot.keywords) == 2:
            return hot.args[0], ncls, w
    return None


def _last_dim_column(node: ast.expr) -> Optional[ast.expr]:
    """w of ``w.unsqueeze(-1)`` / ``w[..., None]``: a trailing dim of 1 on the slot weights."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "unsqueeze" \
            and len(node.args) == 1 and not node.keywords and const_value(node.args[0]) == -1:
        return node.func.value
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 2 \
            and literal_ellipsis(node.slice.elts[0]) and isinstance(node.slice.elts[1], ast.Constant) \
            and node.slice.elts[1].value is None:
        return node.value
    return None


def einsum_operands(call: ast.Call, canon: Callable[[ast.expr], str]) -> Optional[tuple[list[str], str, list[ast.expr]]]:
    """(input axis lists, output axes, operands) of ``torch.einsum("ab,bc->ac", A, B)`` (one letter an axis) or
    einops' ``einsum(A, B, "x y, y z -> x z")`` (space-separated names); None for other calls or ``...``."""
    name = canon(call.func)
    if call.keywords:
        return None
    if name == "torch.einsum" and call.args and isinstance(const_value(call.args[0]), str):
        spec, operands = str(const_value(call.args[0])), list(call.args[1:])
        split: Callable[[str], list[str]] = lambda part: list(part.replace(" ", ""))
    elif name == "einops.einsum" and call.args and isinstance(const_value(call.args[-1]), str):
        spec, operands = str(const_value(call.args[-1])), list(call.args[:-1])
        split = lambda part: part.split()
    else:
        return None
    if "..." in spec or spec.count("->") != 1:
        return None
    ins, out = spec.split("->")
    return [split(p) for p in ins.split(",")], "".join(f"{a} " for a in split(out)), operands


def one_hot_einsum_sum(axes: list[list[str]], out: str, stack_dim: int) -> bool:
    """The einsum sums ``sel [*lead, k, e] x S`` over k and e, S holding the experts at ``stack_dim`` and the
    features last, the output ``[*lead, d]``: sum_k w[.., k] * S[idx[.., k], .., d]."""
    if len(axes) != 2:
        return False
    sel, sv = axes
    if len(sel) < 3 or len(sv) != len(sel) or len(set(sel)) != len(sel) or len(set(sv)) != len(sv):
        return False
    lead, k, e = sel[:-2], sel[-2], sel[-1]
    pos = stack_dim if stack_dim >= 0 else len(sv) + stack_dim
    if not 0 <= pos < len(sv) - 1 or sv[pos] != e:
        return False
    rest = sv[:pos] + sv[pos + 1:]
    d = rest[-1]
    return rest[:-1] == lead and k not in sv and d not in sel and out.split() == [*lead, d]


def guarded_routed_block(experts: str, guard: str, x: str, ids: str, probs: str, result_line: str, original: list[str],
                         p: str) -> list[str]:
    """``if guard:`` the routed form of a dense mixture (:func:`routed_expert_lines` over ``x``'s flattened rows), then
    ``result_line``; ``else:`` the ``original`` lines (indented already)."""
    ind = "    "
    return [
        f"{p}experts = list({experts})",
        f"if {guard}:",
        *routed_expert_lines(f"{x}.reshape(-1, {x}.shape[-1])", ids, probs, f"{p}experts", ind, p),
        f"{ind}{result_line}",
        "else:  # other shapes: as written",
        *original,
    ]


def routed_expert_lines(tokens: str, ids: str, probs: str, experts: str, ind: str, p: str) -> list[str]:
    """The fused body of a dense mixture (every expert ran on every token): ``tokens`` [T, H] permuted by ``ids``
    [T, K], every expert in ``experts`` once on its rows (an expert without rows on an empty slice: its weights get
    zero gradients, as the original's zero-weighted terms gave them), unpermuted with ``probs`` [T, K] into
    ``{p}mixed`` [T, D]."""
    return [
        f"{ind}{p}ids = {ids}.reshape(-1, {ids}.shape[-1])",
        f"{ind}{p}xs, {p}order = torch_npu.npu_moe_token_permute({tokens}, {p}ids)",
        f"{ind}# every expert runs once on its routed rows (one host sync for the group sizes)",
        f"{ind}{p}sizes = torch.bincount({p}ids.flatten(), minlength=len({experts})).tolist()",
        f"{ind}{p}h = torch.cat([{p}e({p}r) for {p}e, {p}r in zip({experts}, {p}xs.split({p}sizes))])",
        f"{ind}{p}p = {probs}",
        f"{ind}{p}h = {p}h.to(torch.promote_types({p}h.dtype, {p}p.dtype))  # the original multiplies with promotion",
        f"{ind}{p}mixed = torch_npu.npu_moe_token_unpermute({p}h, {p}order, probs={p}p.to({p}h.dtype))",
    ]


def token_expert_loop(loop: ast.For) -> Optional[tuple[ast.expr, str, str, str, tuple[str, str]]]:
    """(T, idx, out, t, (A, B)) of ``for t in range(T): for e in idx[t]: out[t] += A[t, e] * B[t, e]``: per token,
    per expert id of its top-k row, a product of two [T, E]-indexed tensors (the caller finds which is the
    stacked expert outputs and which the dense gate). None for anything else."""
    if not (isinstance(loop.target, ast.Name) and len(loop.body) == 1 and isinstance(loop.body[0], ast.For) and not loop.orelse):
        return None
    inner = loop.body[0]
    it = loop.iter
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range" and len(it.args) == 1
            and not it.keywords):
        return None
    t = loop.target.id
    if not (isinstance(inner.target, ast.Name) and not inner.orelse and len(inner.body) == 1
            and isinstance(inner.iter, ast.Subscript) and isinstance(inner.iter.value, ast.Name)
            and isinstance(inner.iter.slice, ast.Name) and inner.iter.slice.id == t):
        return None
    e, acc = inner.target.id, inner.body[0]
    if not (isinstance(acc, ast.AugAssign) and isinstance(acc.op, ast.Add) and isinstance(acc.target, ast.Subscript)
            and isinstance(acc.target.value, ast.Name) and isinstance(acc.target.slice, ast.Name)
            and acc.target.slice.id == t and isinstance(acc.value, ast.BinOp) and isinstance(acc.value.op, ast.Mult)):
        return None
    names = []
    for side in (acc.value.left, acc.value.right):
        sl = side.slice if isinstance(side, ast.Subscript) else None
        if not (isinstance(side, ast.Subscript) and isinstance(side.value, ast.Name) and isinstance(sl, ast.Tuple)
                and [getattr(x, "id", None) for x in sl.elts] == [t, e]):
            return None
        names.append(side.value.id)
    out, idx = acc.target.value.id, inner.iter.value.id
    if len({*names, out, idx, t, e}) != 6:
        return None
    return it.args[0], idx, out, t, (names[0], names[1])


def stacked_expert_calls(value: ast.expr, canon: Callable[[ast.expr], str]) -> Optional[tuple[str, ast.expr, int, bool]]:
    """(x, experts, stack dim, reshaped) of ``torch.stack([expert(x) for expert in C], dim=d)`` optionally followed
    by ``.reshape(-1, E, D)`` / ``.view(-1, E, D)`` (``[self.experts[i](x) for i in range(E)]`` too)."""
    reshaped = False
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in ("reshape", "view") \
            and len(value.args) == 3 and const_value(value.args[0]) == -1 and not value.keywords:
        value, reshaped = value.func.value, True
    if not (isinstance(value, ast.Call) and canon(value.func) == "torch.stack" and len(value.args) == 1
            and isinstance(value.args[0], ast.ListComp) and len(value.args[0].generators) == 1):
        return None
    dim_kw = [k.value for k in value.keywords if k.arg == "dim"]
    if len(value.keywords) != len(dim_kw) or len(dim_kw) > 1:
        return None
    dim = const_value(dim_kw[0]) if dim_kw else 0
    comp, gen = value.args[0], value.args[0].generators[0]
    call = comp.elt
    if not isinstance(dim, int) or isinstance(dim, bool) or gen.ifs or not isinstance(gen.target, ast.Name) \
            or not (isinstance(call, ast.Call) and len(call.args) == 1 and not call.keywords and isinstance(call.args[0], ast.Name)):
        return None
    if isinstance(call.func, ast.Name) and call.func.id == gen.target.id and dotted(gen.iter) is not None:
        container = gen.iter
    elif isinstance(call.func, ast.Subscript) and isinstance(call.func.slice, ast.Name) and call.func.slice.id == gen.target.id \
            and dotted(call.func.value) is not None and isinstance(gen.iter, ast.Call) and dotted(gen.iter.func) == "range":
        container = call.func.value
    else:
        return None
    if call.args[0].id == gen.target.id:
        return None
    return call.args[0].id, container, dim, reshaped


def enumerated_name(node: ast.expr) -> Optional[ast.Name]:
    """``rows`` of ``enumerate(rows)``: the loop walks a tensor of row indices one entry at a time."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "enumerate" \
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Name):
        return node.args[0]
    return None


# -- class 3: torch names without a torch import -----------------------------------------------------------------


def torch_without_import(source: str, imports_torch: bool) -> bool:
    """The file says ``torch.`` and ``nn.Module`` (or ``F.``) but imports no torch: a notebook fragment or code
    executed into another namespace. Cheap text gates only."""
    return not imports_torch and "torch." in source and ("nn.Module" in source or "F." in source) and "xpert" in source


UNIMPORTED_TORCH_REASON = (
    "the file uses torch names (`torch.`, `nn.`, `F.`) without importing torch (a notebook fragment, or code executed "
    "into another namespace): npufuse resolves torch names through the file's own imports, so it does not read this "
    "expert loop; add the imports to the file to have it analysed")


# -- examples (registered on MoeExperts by moe_experts.py) -------------------------------------------------------

_IMPORTS = '''\
import torch
import torch.nn.functional as F
from torch import nn
'''

# 1 + 2. gpt-oss style: stacked [E, 2I, H] / [E, H, I] weights with stacked biases, F.linear(x, W[e], B[e]), an
# interleaved clamped GLU module of this file between them, (token, slot) pairs from torch.where(idx == e)
BIASED_GPT_OSS = _IMPORTS + '''

class ClampedGlu(nn.Module):
    def __init__(self, limit=7.0):
        super().__init__()
        self.limit = limit

    def forward(self, x):
        x_gate = x[..., ::2]
        x_up = x[..., 1::2]
        x_gate = x_gate.clamp(max=self.limit)
        x_up = x_up.clamp(min=-self.limit, max=self.limit)
        return x_gate * torch.sigmoid(1.702 * x_gate) * (x_up + 1)


class BiasedStackedMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.n, self.k = n, k
        self.router = nn.Linear(d, n, bias=True)
        self.activation = ClampedGlu()
        self.gate_up_proj_weight = nn.Parameter(torch.randn(n, 2 * h, d) * 0.1)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(n, 2 * h) * 0.1)
        self.down_proj_weight = nn.Parameter(torch.randn(n, d, h) * 0.1)
        self.down_proj_bias = nn.Parameter(torch.randn(n, d) * 0.1)

    def forward(self, x):
        b, t, d = x.shape
        hidden = x.view(-1, d)
        weights, selected = torch.topk(self.router(hidden), self.k)
        weights = F.softmax(weights, dim=-1)
        output = torch.zeros_like(hidden)
        for expert_idx in range(self.n):
            token_idx, slot_idx = torch.where(selected == expert_idx)
            if token_idx.numel() == 0:
                continue
            tokens = hidden[token_idx]
            y = F.linear(tokens, self.gate_up_proj_weight[expert_idx], self.gate_up_proj_bias[expert_idx])
            y = self.activation(y)
            y = F.linear(y, self.down_proj_weight[expert_idx], self.down_proj_bias[expert_idx])
            output[token_idx] += y * weights[token_idx, slot_idx].unsqueeze(-1)
        return output.view(b, t, d)
'''
BIASED_RUN = ("m = BiasedStackedMoE(16, 12, 5, 2)\nx = torch.randn(2, 7, 16, requires_grad=True)\nout = m(x)\n"
              "leaves = [x, m.gate_up_proj_weight, m.gate_up_proj_bias, m.down_proj_weight, m.down_proj_bias]\n")

# 1. in x out stacked weights, the bias added after a matmul (`x @ W[e] + B[e]`) and passed by keyword, gelu
BIASED_MATMUL_ADD = _IMPORTS + '''

class AddedBiasMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.n, self.k = n, k
        self.gate = nn.Linear(d, n, bias=False)
        self.w1 = nn.Parameter(torch.randn(n, d, h) * 0.1)
        self.b1 = nn.Parameter(torch.randn(n, h) * 0.1)
        self.w2 = nn.Parameter(torch.randn(n, d, h) * 0.1)
        self.b2 = nn.Parameter(torch.randn(n, d) * 0.1)

    def forward(self, x):
        probs, idx = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.n):
            rows, slots = torch.where(idx == e)
            hid = F.gelu(x[rows] @ self.w1[e] + self.b1[e])
            y = F.linear(hid, self.w2[e], bias=self.b2[e])
            out.index_add_(0, rows, y * probs[rows, slots].unsqueeze(-1))
        return out
'''
BIASED_MATMUL_ADD_RUN = ("m = AddedBiasMoE(16, 12, 5, 2)\nx = torch.randn(11, 16, requires_grad=True)\nout = m(x)\n"
                         "leaves = [x, m.w1, m.b1, m.w2, m.b2]\n")

# 1. separate gate / up stacked projections, each with its bias (written bias first), silu-gated
BIASED_GATE_UP = BIASED_MATMUL_ADD.replace(
    "        self.w1 = nn.Parameter(torch.randn(n, d, h) * 0.1)\n        self.b1 = nn.Parameter(torch.randn(n, h) * 0.1)\n",
    "        self.w1 = nn.Parameter(torch.randn(n, d, h) * 0.1)\n        self.b1 = nn.Parameter(torch.randn(n, h) * 0.1)\n"
    "        self.w3 = nn.Parameter(torch.randn(n, d, h) * 0.1)\n        self.b3 = nn.Parameter(torch.randn(n, h) * 0.1)\n",
).replace("            hid = F.gelu(x[rows] @ self.w1[e] + self.b1[e])\n",
          "            tok = x[rows]\n            hid = F.silu(self.b1[e] + tok @ self.w1[e]) * (tok @ self.w3[e] + self.b3[e])\n")
BIASED_GATE_UP_RUN = BIASED_MATMUL_ADD_RUN.replace("m.b1, ", "m.b1, m.w3, m.b3, ")

# near misses
_BATCH_STAT_ACT = BIASED_GPT_OSS.replace("        return x_gate * torch.sigmoid(1.702 * x_gate) * (x_up + 1)\n",
                                         "        x_up = x_up - x_up.mean(dim=0)\n"
                                         "        return x_gate * torch.sigmoid(1.702 * x_gate) * (x_up + 1)\n")

# 4. dense experts (every expert on every token) stacked at dim 0, summed against one_hot(idx) * w by an einsum
_EXPERT = '''

class MlpExpert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))
'''
ONE_HOT_EINSUM = _IMPORTS + _EXPERT + '''

class DenseOneHotMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.n, self.k = n, k
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([MlpExpert(d, h) for _ in range(n)])

    def forward(self, hidden_states):
        w, idx = torch.topk(torch.sigmoid(self.gate(hidden_states)), self.k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        outs = torch.stack([expert(hidden_states) for expert in self.experts])
        selection = F.one_hot(idx, num_classes=self.n).to(hidden_states.dtype) * w.unsqueeze(-1)
        routed = torch.einsum("bske,ebsd->bsd", selection, outs)
        return routed + hidden_states
'''
ONE_HOT_EINSUM_RUN = ("m = DenseOneHotMoE(16, 12, 6, 2)\nx = torch.randn(2, 5, 16, requires_grad=True)\nout = m(x)\n"
                      "leaves = [x, m.gate.weight, m.experts[0].up.weight, m.experts[5].down.weight]\n")

# 4. 2-D tokens, experts stacked at dim -2, the one-hot on the right of the product, the einsum returned
ONE_HOT_EINSUM_2D = _IMPORTS + _EXPERT + '''

class FlatOneHotMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.n, self.k = n, k
        self.router = nn.Linear(d, n)
        self.experts = nn.ModuleList([MlpExpert(d, h) for _ in range(n)])

    def forward(self, x):
        probs, top = F.softmax(self.router(x), dim=-1).topk(self.k, dim=-1)
        every = torch.stack([self.experts[i](x) for i in range(self.n)], dim=-2)
        sel = probs[..., None] * F.one_hot(top, self.n).float()
        return torch.einsum("tke,ted->td", sel, every)
'''
ONE_HOT_EINSUM_2D_RUN = ("m = FlatOneHotMoE(16, 12, 5, 2)\nx = torch.randn(9, 16, requires_grad=True)\nout = m(x)\n"
                         "leaves = [x, m.router.weight, m.experts[1].up.weight]\n")

# 4. einops' einsum with named axes (the real site's spelling; einops is not needed to detect it)
ONE_HOT_EINOPS = ONE_HOT_EINSUM.replace("from torch import nn\n", "from torch import nn\nfrom einops import einsum\n").replace(
    'torch.einsum("bske,ebsd->bsd", selection, outs)',
    "einsum(selection, outs, 'batch seq k experts, experts batch seq hidden -> batch seq hidden')")

_CONV_EXPERT = ONE_HOT_EINSUM.replace("        self.up = nn.Linear(d, h)\n",
                                      "        self.up = nn.Linear(d, h)\n        self.mix = nn.Conv1d(d, d, 3, padding=1)\n")\
    .replace("        return self.down(F.gelu(self.up(x)))\n",
             "        x = self.mix(x.transpose(1, 2)).transpose(1, 2)\n        return self.down(F.gelu(self.up(x)))\n")

# 5. every expert on every token stacked [B, S, E, D] -> [T, E, D], a Python loop over tokens and their top-k ids
DENSE_TOKEN_LOOP = _IMPORTS + _EXPERT + '''

class TokenLoopMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.n, self.k, self.d = n, k, d
        self.gate = nn.Linear(d, n)
        self.experts = nn.ModuleList([MlpExpert(d, h) for _ in range(n)])

    def forward(self, x):
        weights = torch.softmax(self.gate(x), dim=-1).reshape(-1, self.n)
        top_w, top_i = torch.topk(weights, self.k, dim=-1)
        outs = torch.stack([expert(x) for expert in self.experts], dim=2).reshape(-1, self.n, self.d)
        b, s, _ = x.shape
        y = torch.zeros((b * s, self.d))
        for t in range(b * s):
            for e in top_i[t]:
                y[t] += outs[t, e] * weights[t, e]
        return y.reshape(b, s, -1)
'''
DENSE_TOKEN_LOOP_RUN = ("m = TokenLoopMoE(16, 12, 5, 2)\nx = torch.randn(2, 6, 16, requires_grad=True)\nout = m(x)\n"
                        "leaves = [x, m.gate.weight, m.experts[3].up.weight]\n")

# 5. 2-D tokens, experts indexed in the comprehension and stacked at dim 1, the gate factor first
DENSE_TOKEN_LOOP_2D = DENSE_TOKEN_LOOP.replace(
    "        outs = torch.stack([expert(x) for expert in self.experts], dim=2).reshape(-1, self.n, self.d)\n"
    "        b, s, _ = x.shape\n        y = torch.zeros((b * s, self.d))\n        for t in range(b * s):\n",
    "        outs = torch.stack([self.experts[i](x) for i in range(self.n)], dim=1)\n"
    "        y = x.new_zeros(x.shape[0], self.d)\n        for t in range(x.shape[0]):\n",
).replace("y[t] += outs[t, e] * weights[t, e]", "y[t] += weights[t, e] * outs[t, e]").replace(
    "        return y.reshape(b, s, -1)\n", "        return y\n")
DENSE_TOKEN_LOOP_2D_RUN = DENSE_TOKEN_LOOP_RUN.replace("torch.randn(2, 6, 16,", "torch.randn(11, 16,")

FUSE = [
    Fuse(DENSE_TOKEN_LOOP, name="s44b_dense_outputs_per_token_loop", run=DENSE_TOKEN_LOOP_RUN,
         expect={"variant": "dense_token_loop", "indices": "top_i", "output": "y"}),
    Fuse(DENSE_TOKEN_LOOP_2D, name="s44b_dense_outputs_per_token_loop_flat_tokens", run=DENSE_TOKEN_LOOP_2D_RUN,
         expect={"variant": "dense_token_loop", "tokens": "x"}),
    Fuse(ONE_HOT_EINSUM, name="s44b_dense_experts_one_hot_einsum", run=ONE_HOT_EINSUM_RUN,
         expect={"variant": "one_hot_combine", "indices": "idx", "probs": "w", "tokens": "hidden_states"}),
    Fuse(ONE_HOT_EINSUM_2D, name="s44b_dense_experts_one_hot_einsum_flat_tokens", run=ONE_HOT_EINSUM_2D_RUN,
         expect={"variant": "one_hot_combine", "indices": "top", "probs": "probs"}),
    Fuse(ONE_HOT_EINOPS, name="s44b_dense_experts_one_hot_einops", expect={"variant": "one_hot_combine"}),
    Fuse(BIASED_GPT_OSS, name="s44b_stacked_biases_clamped_glu_module", run=BIASED_RUN,
         expect={"layout": "stacked_out_in", "loop": "range"}),
    Fuse(BIASED_MATMUL_ADD, name="s44b_stacked_bias_added_after_matmul", run=BIASED_MATMUL_ADD_RUN,
         expect={"layout": "stacked_mixed"}),
    Fuse(BIASED_GATE_UP, name="s44b_stacked_gate_up_biases", run=BIASED_GATE_UP_RUN, expect={"layout": "stacked_mixed"}),
]

# 3. a notebook fragment: torch names used, torch never imported (the loop itself is a plain Mixtral dispatch)
UNIMPORTED = BIASED_GPT_OSS.replace(_IMPORTS, "")

KEEP = [
    # the expert's rows are added back one at a time in a loop over them (sample routing, HO20b DiaMoE-TTS)
    Keep(BIASED_GPT_OSS.replace("            output[token_idx] += y * weights[token_idx, slot_idx].unsqueeze(-1)\n",
                                "            for j, row in enumerate(token_idx):\n"
                                "                output[row] += weights[row, slot_idx[j]] * y[j]\n"),
         reason="one at a time in a Python loop over its selected rows", name="s44b_rows_added_back_one_at_a_time"),
    # every expert's output on every token is read again after the loop
    Keep(DENSE_TOKEN_LOOP.replace("        return y.reshape(b, s, -1)\n", "        return y.reshape(b, s, -1) + outs.mean()\n"),
         reason="is used after the mixture", name="s44b_dense_token_loop_outputs_read_after"),
    # experts stacked last ([B, S, D, E]) then viewed as [T, E, D]: row t, column e is not token t's expert e output
    Keep(DENSE_TOKEN_LOOP.replace("for expert in self.experts], dim=2)", "for expert in self.experts], dim=-1)"),
         name="s44b_dense_token_loop_experts_stacked_last"),
    # the einsum keeps the slot axis: per-slot outputs, not their sum
    Keep(ONE_HOT_EINSUM.replace('"bske,ebsd->bsd", selection, outs)\n        return routed + hidden_states',
                                '"bske,ebsd->bskd", selection, outs)\n        return routed.sum(-2) + hidden_states'),
         reason="does not read as the sum over the top-k slots", name="s44b_one_hot_einsum_keeps_the_slots"),
    # the experts convolve over the sequence: on the routed rows alone they would see other neighbours
    Keep(_CONV_EXPERT, reason="mix tokens", name="s44b_one_hot_einsum_experts_mix_tokens"),
    # every expert's output on every token is read after the mixture
    Keep(ONE_HOT_EINSUM.replace("        return routed + hidden_states\n", "        return routed + outs.mean(0)\n"),
         reason="is used after the mixture", name="s44b_one_hot_einsum_outputs_read_after"),
    Keep(UNIMPORTED, reason="without importing torch", name="s44b_torch_used_without_import"),
    # the activation module centres each column over the rows it is given: per-expert calls differ from one call
    Keep(_BATCH_STAT_ACT, reason="the expert activation `self.activation(y)` is not recognised",
         name="s44b_activation_module_with_a_statistic_over_rows"),
    # the bias row of expert 0 for every expert: not the expert's own bias
    Keep(BIASED_GPT_OSS.replace("self.gate_up_proj_bias[expert_idx])", "self.gate_up_proj_bias[0])"),
         reason="not one stacked tensor indexed by the expert", name="s44b_bias_of_one_fixed_expert"),
    # only the gate projection has a bias
    Keep(BIASED_GATE_UP.replace("(tok @ self.w3[e] + self.b3[e])", "(tok @ self.w3[e])"),
         reason="only one of the gate and up stacked projections has a bias", name="s44b_bias_on_the_gate_only"),
    # the routing weight scales the hidden rows before the biased down projection: the bias is not weighted
    Keep(BIASED_MATMUL_ADD.replace("            y = F.linear(hid, self.w2[e], bias=self.b2[e])\n"
                                   "            out.index_add_(0, rows, y * probs[rows, slots].unsqueeze(-1))\n",
                                   "            y = F.linear(hid * probs[rows, slots].unsqueeze(-1), self.w2[e], bias=self.b2[e])\n"
                                   "            out.index_add_(0, rows, y)\n"),
         reason="before a biased down projection", name="s44b_weights_before_a_biased_down_projection"),
]
