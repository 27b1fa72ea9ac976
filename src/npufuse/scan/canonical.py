"""One spelling per meaning: the canonical layer detectors match on.

Real code spells the same computation many ways; a detector that matches one spelling misses the
others (issue 14: recall 0.32 on real NPU ports, decided by spelling, not semantics). This module
maps the equivalent forms to one answer, so one fix here serves every detector that calls it:

* :func:`api` — the canonical dotted name of a callee or class, import aliases resolved
  (``import torch as th``, ``from torch.nn import functional as F``, ``from torch import nn``)
  and synonyms folded (``torch.rms_norm`` is ``torch.nn.functional.rms_norm``,
  ``torch.nn.modules.normalization.RMSNorm`` is ``torch.nn.RMSNorm``);
* :func:`square_operand` — ``x`` of ``x*x``, ``x**2``, ``x.pow(2)``, ``torch.pow(x, 2)``,
  ``x.square()``, ``torch.square(x)``;
* :func:`half_of` — which half of which tensor a name holds, for ``x1, x2 = x.chunk(2, -1)``,
  ``torch.chunk``, ``x.split(d // 2, dim=-1)``, ``x.unbind(-1)`` of a 2-wide last dim, and the
  slice pair ``x[..., : d // 2]`` / ``x[..., d // 2 :]``;
* :func:`same` — structural equality of two expressions (``ctx`` and positions ignored).

Everything here is a pure function of the ``ast`` nodes and the module's import table: no
per-node work happens unless a detector asks, so the scan's cost is unchanged for files that
never reach these questions.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from npufuse.scan.dataflow import ModuleInfo, Scope, const_value

# Different names of one API (after alias resolution): the key is read as the value.
SYNONYMS: dict[str, str] = {
    "torch.rms_norm": "torch.nn.functional.rms_norm",
    "torch.nn.modules.normalization.RMSNorm": "torch.nn.RMSNorm",
    "torch.nn.modules.RMSNorm": "torch.nn.RMSNorm",
    "torch.nn.modules.linear.Linear": "torch.nn.Linear",
    "torch.nn.modules.Linear": "torch.nn.Linear",
    "torch.functional.F": "torch.nn.functional",
    "torch.nn.functional.normalize": "torch.nn.functional.normalize",
    "torch.Tensor.pow": "torch.pow",
    "torch.concat": "torch.cat",
    "torch.concatenate": "torch.cat",
}


def api(module: ModuleInfo, node: ast.AST | None) -> str | None:
    """Canonical dotted name of ``node`` (a Name/Attribute chain, or a Call's callee)."""
    if isinstance(node, ast.Call):
        node = node.func
    name = module.canonical(node)
    if name is None:
        return None
    return SYNONYMS.get(name, name)


def is_api(module: ModuleInfo, node: ast.AST | None, *names: str) -> bool:
    """Is ``node`` (or the callee of the call ``node``) one of the canonical ``names``?"""
    return api(module, node) in names


def same(a: ast.AST | None, b: ast.AST | None) -> bool:
    """The two expressions are written the same way (positions and load/store context ignored)."""
    if a is None or b is None:
        return a is b
    return ast.dump(a, annotate_fields=False) == ast.dump(b, annotate_fields=False)


def _is_two(node: ast.AST | None) -> bool:
    v = const_value(node)
    return type(v) in (int, float) and v == 2


def square_operand(module: ModuleInfo, node: ast.AST) -> ast.expr | None:
    """``x`` when ``node`` squares it: ``x*x``, ``x**2``, ``x.pow(2)``, ``torch.pow(x, 2)``,
    ``x.square()``, ``torch.square(x)`` (``2.0`` counts as 2); else None."""
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Mult) and same(node.left, node.right):
            return node.left
        if isinstance(node.op, ast.Pow) and _is_two(node.right):
            return node.left
        return None
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    if isinstance(f, ast.Attribute):
        name = api(module, f)
        if name in ("torch.pow", "torch.square"):
            x = node.args[0] if node.args else _kw(node, "input")
            if name == "torch.square":
                return x
            e = node.args[1] if len(node.args) > 1 else _kw(node, "exponent")
            return x if _is_two(e) else None
        # a method of the tensor itself: x.pow(2) / x.square()
        if f.attr == "square" and not node.args and not node.keywords:
            return f.value
        if f.attr == "pow" and len(node.args) == 1 and not node.keywords and _is_two(node.args[0]):
            return f.value
    return None


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def is_last_dim(node: ast.AST | None) -> bool:
    """``-1`` (the last dimension, the only one the halves below are read on)."""
    return const_value(node) == -1


@dataclass(frozen=True)
class Half:
    """``name`` holds half ``index`` (0 first, 1 second) of ``source`` along the last dim."""

    source: ast.expr
    index: int
    spelling: str  # chunk | split | unbind | slice


def _split_call(module: ModuleInfo, call: ast.expr) -> tuple[ast.expr, str] | None:
    """(tensor, spelling) when ``call`` cuts a tensor into two halves along the last dim."""
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
        return None
    name = api(module, call.func)
    method = call.func.attr
    if name in ("torch.chunk", "torch.split", "torch.unbind"):
        if not call.args:
            return None
        x, rest, spelling = call.args[0], call.args[1:], name.rsplit(".", 1)[1]
    elif method in ("chunk", "split", "unbind", "tensor_split"):
        x, rest, spelling = call.func.value, list(call.args), method
    else:
        return None
    dim = _kw(call, "dim")
    if spelling == "unbind":
        dim = rest[0] if rest else dim
        # unbind yields every slice: two names are two halves only of a 2-wide last dim, which
        # the caller knows from the unpacking target (exactly two names)
        return (x, "unbind") if is_last_dim(dim) else None
    if len(rest) >= 2:
        dim = rest[1]
    if not is_last_dim(dim):
        return None
    if spelling in ("chunk", "tensor_split"):
        n = rest[0] if rest else _kw(call, "chunks") or _kw(call, "sections")
        return (x, spelling) if _is_two(n) else None
    # split(size): two pieces only when size is half the last dim; the unpacking into exactly two
    # names (checked by the caller) makes a wrong size raise in the original code itself
    return (x, "split") if rest or _kw(call, "split_size_or_sections") is not None or _kw(call, "split_size") is not None else None


def _slice_half(node: ast.expr) -> tuple[ast.expr, int] | None:
    """``x[..., :h]`` -> (x, 0), ``x[..., h:]`` -> (x, 1), also without the ellipsis on 1-D."""
    if not isinstance(node, ast.Subscript):
        return None
    sl = node.slice
    if isinstance(sl, ast.Tuple):
        if len(sl.elts) != 2 or not (isinstance(sl.elts[0], ast.Constant) and sl.elts[0].value is Ellipsis):
            return None
        sl = sl.elts[1]
    if not isinstance(sl, ast.Slice) or sl.step is not None:
        return None
    if sl.lower is None and sl.upper is not None:
        return node.value, 0
    if sl.upper is None and sl.lower is not None:
        return node.value, 1
    return None


def half_of(module: ModuleInfo, scope: Scope, node: ast.expr, before_line: int | None = None) -> Half | None:
    """Which half of which tensor ``node`` holds (a name bound by a two-way unpacking of a
    chunk/split/unbind along the last dim, or a last-dim slice written inline or bound to a name)."""
    s = _slice_half(node)
    if s is not None:
        return Half(s[0], s[1], "slice")
    if not isinstance(node, ast.Name):
        return None
    line = before_line if before_line is not None else getattr(node, "lineno", None)
    best: Half | None = None
    for stmt, value in scope.assignments.get(node.id, []):
        if line is not None and stmt.lineno >= line:
            break
        best = None
        if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant) and type(value.slice.value) is int:
            # ``x1, x2 = x.chunk(2, -1)`` is recorded as the whole value indexed by position;
            # ``x1, x2 = x[..., :d], x[..., d:]`` as the tuple indexed by position
            if isinstance(value.value, (ast.Tuple, ast.List)) and value.slice.value < len(value.value.elts):
                sl = _slice_half(value.value.elts[value.slice.value])
                if sl is not None:
                    best = Half(sl[0], sl[1], "slice")
                continue
            inner = _split_call(module, value.value)
            if inner is not None and value.slice.value in (0, 1) and _unpacks_two(stmt):
                best = Half(inner[0], value.slice.value, inner[1])
            continue
        s = _slice_half(value)
        if s is not None:
            best = Half(s[0], s[1], "slice")
            continue
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple):
            inner = _split_call(module, value)
            elts = stmt.targets[0].elts
            if inner is not None and len(elts) == 2:
                idx = next((i for i, e in enumerate(elts) if isinstance(e, ast.Name) and e.id == node.id), None)
                if idx is not None:
                    best = Half(inner[0], idx, inner[1])
    return best


def _unpacks_two(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple) and len(stmt.targets[0].elts) == 2


# --- moe expert masks ---


@dataclass(frozen=True)
class ExpertMask:
    """A tensor of per-expert routing masks indexed by the expert first: ``mask[e]`` is where
    ``indices == e``, ``[T, K]`` (orientation ``tk``) or ``[K, T]`` (``kt``)."""

    indices: str  # the name of the [T, K] expert-index tensor
    num_classes: ast.expr  # E (the number of masks)
    orientation: str  # tk | kt | tke (not permuted: ``mask[..., e]`` is expert e's [T, K] mask)
    spelling: str  # one_hot | arange_eq


def _arange_from_zero(module: ModuleInfo, node: ast.AST) -> ast.expr | None:
    """``E`` of ``torch.arange(E)`` / ``torch.arange(0, E)`` (keywords such as device= allowed, no step)."""
    if not isinstance(node, ast.Call) or api(module, node) != "torch.arange":
        return None
    if _kw(node, "step") is not None or _kw(node, "start") is not None:
        return None
    if len(node.args) == 1:
        return node.args[0]
    if len(node.args) == 2 and const_value(node.args[0]) == 0 and type(const_value(node.args[0])) is int:
        return node.args[1]
    end = _kw(node, "end")
    return end if not node.args and end is not None else None


def _trailing_new_axis(module: ModuleInfo, node: ast.AST) -> ast.expr | None:
    """``idx`` of ``idx.unsqueeze(-1)`` / ``idx[..., None]`` / ``idx[:, :, None]`` (a new last axis of a 2-D ``idx``)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "unsqueeze" \
            and len(node.args) == 1 and not node.keywords and const_value(node.args[0]) in (-1, 2):
        return node.func.value
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple):
        elts = node.slice.elts
        if len(elts) >= 2 and isinstance(elts[-1], ast.Constant) and elts[-1].value is None:
            head = elts[:-1]
            if len(head) == 1 and isinstance(head[0], ast.Constant) and head[0].value is Ellipsis:
                return node.value
            if len(head) == 2 and all(isinstance(e, ast.Slice) and e.lower is None and e.upper is None and e.step is None for e in head):
                return node.value
    return None


def _one_hot_source(module: ModuleInfo, node: ast.AST) -> tuple[ast.expr, ast.expr, str] | None:
    """(indices, E, spelling) when ``node`` is a ``[T, K, E]`` one-hot of 2-D expert indices."""
    if isinstance(node, ast.Call) and api(module, node) == "torch.nn.functional.one_hot":
        idx = node.args[0] if node.args else _kw(node, "input")
        n = node.args[1] if len(node.args) > 1 else _kw(node, "num_classes")
        if idx is not None and n is not None:
            return idx, n, "one_hot"
        return None
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
        for a, b in ((node.left, node.comparators[0]), (node.comparators[0], node.left)):
            n = _arange_from_zero(module, b)
            idx = _trailing_new_axis(module, a)
            if n is not None and idx is not None:
                return idx, n, "arange_eq"
    return None


def _permute_dims(node: ast.Call) -> list | None:
    args = node.args
    if len(args) == 1 and isinstance(args[0], (ast.Tuple, ast.List)):
        args = args[0].elts
    dims = [const_value(a) for a in args]
    return dims if all(type(d) is int for d in dims) else None


def expert_mask(module: ModuleInfo, scope: Scope, name: str, before_line: int) -> ExpertMask | None:
    """What ``name`` holds when it is the per-expert routing masks of 2-D expert indices:
    ``F.one_hot(idx, E).permute(2, 1, 0)`` (HF Mixtral: ``mask[e]`` is ``[K, T]``),
    ``.permute(2, 0, 1)`` (``[T, K]``), and the same with the one-hot spelled as a comparison
    ``idx.unsqueeze(-1) == torch.arange(E)`` / ``idx[..., None] == torch.arange(E)`` (litgpt,
    mistral's reference); the permute may be a separate statement. Without a permute the masks are
    ``[T, K, E]`` (orientation ``tke``: expert e's mask is ``mask[..., e]``). Anything else: None."""
    node: ast.expr | None = scope.definition(name, before_line)
    line = before_line
    orient = ""
    for _ in range(8):
        if node is None:
            return None
        if isinstance(node, ast.Name):
            line = getattr(node, "lineno", line)
            node = scope.definition(node.id, line)
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("long", "int", "bool", "contiguous") \
                and not node.args:
            node = node.func.value  # a cast or a copy of the masks: same values per expert
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "permute" and not orient:
            dims = _permute_dims(node)
            if dims == [2, 1, 0]:
                orient = "kt"
            elif dims == [2, 0, 1]:
                orient = "tk"
            else:
                return None
            line = getattr(node, "lineno", line)
            node = node.func.value
            continue
        src = _one_hot_source(module, node)
        if src is None or not isinstance(src[0], ast.Name):
            return None
        return ExpertMask(src[0].id, src[1], orient or "tke", src[2])
    return None


# --- MoE: routing weights shaped like the expert indices ---


_SHAPE_KEEPING_CASTS = ("to", "float", "half", "bfloat16", "type_as", "contiguous", "detach", "clone")


def _keepdim_or_scalar(operand: ast.expr, name: str) -> bool:
    """True when ``operand`` broadcasts against ``name`` without widening it: constants, and
    reductions of ``name`` itself that keep their dims (``name.sum(dim=-1, keepdim=True) + 1e-20``)."""
    for n in ast.walk(operand):
        if isinstance(n, ast.Name) and n.id != name:
            return False
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("sum", "mean", "amax", "max", "norm"):
            keep = _kw(n, "keepdim")
            if keep is None or const_value(keep) is not True:
                return False
    return True


def shaped_like_indices(module: ModuleInfo, scope: Scope, weights: str, indices: str, before_line: int) -> bool:
    """Whether ``weights`` provably has the shape of the expert indices ``indices`` (element [t, k]
    is the weight of slot k of token t): the two outputs of one ``topk`` call, ``x.gather(-1,
    indices)``, and either of them through shape-keeping steps of its own (casts, ``softmax(w,
    dim=-1)``, ``w / (w.sum(-1, keepdim=True) + eps)``). Only then does ``weights[indices == e]``
    list, in row-major order, one weight per token routed to e (with distinct top-k indices)."""
    idx_def = scope.definition(indices, before_line)
    line = before_line
    node: ast.expr | None = scope.definition(weights, line)
    for _ in range(8):
        if node is None:
            return False
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call) and const_value(node.slice) == 0 \
                and isinstance(idx_def, ast.Subscript) and idx_def.value is node.value and const_value(idx_def.slice) == 1:
            f = node.value.func
            return (isinstance(f, ast.Attribute) and f.attr == "topk") or api(module, f) == "torch.topk"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "gather":
            first = 1 if api(module, node.func) == "torch.gather" else 0
            dim, index = (node.args[first] if len(node.args) > first else _kw(node, "dim")), \
                (node.args[first + 1] if len(node.args) > first + 1 else _kw(node, "index"))
            return dim is not None and const_value(dim) == -1 and isinstance(index, ast.Name) and index.id == indices
        step: ast.expr | None = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SHAPE_KEEPING_CASTS:
            step = node.func.value
        elif isinstance(node, ast.Call) and api(module, node.func) in ("torch.softmax", "torch.nn.functional.softmax") and node.args:
            dim = node.args[1] if len(node.args) > 1 else _kw(node, "dim")
            step = node.args[0] if dim is not None and const_value(dim) == -1 else None
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div, ast.Add, ast.Sub)):
            for own, other in ((node.left, node.right), (node.right, node.left)):
                if isinstance(own, ast.Name) and _keepdim_or_scalar(other, own.id) \
                        or not isinstance(own, ast.Name) and isinstance(const_value(other), (int, float)):
                    step = own
                    break
        if step is None:
            return False
        if isinstance(step, ast.Name):
            if step.id != weights:
                weights = step.id
            line = getattr(node, "lineno", line)
            node = scope.definition(weights, line)
        else:
            node = step
    return False
