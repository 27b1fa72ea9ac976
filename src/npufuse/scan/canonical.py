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
import copy
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
    if isinstance(f, ast.Name):
        return name_square_operand(module, node)
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
    """``x[..., :h]`` -> (x, 0), ``x[..., h:]`` -> (x, 1), also without the ellipsis on 1-D; an explicit
    ``0`` start is no start (``x[..., 0:h]``), and ``x[..., h:u]`` is the second half of the prefix
    ``x[..., :u]`` (partial rotary written as two slices: mlx's RoPE, k-diffusion's). A pre-classifier:
    the caller proves where the split points are."""
    if not isinstance(node, ast.Subscript):
        return None
    sl = node.slice
    if isinstance(sl, ast.Tuple):
        if len(sl.elts) != 2 or not (isinstance(sl.elts[0], ast.Constant) and sl.elts[0].value is Ellipsis):
            return None
        sl = sl.elts[1]
    if not isinstance(sl, ast.Slice) or sl.step is not None:
        return None
    lower = None if sl.lower is not None and const_value(sl.lower) == 0 else sl.lower
    if lower is None and sl.upper is not None:
        return node.value, 0
    if lower is not None:
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
        indices = _integer_cast_operand(module, src[0]) if src is not None else None
        if src is None or not isinstance(indices, ast.Name):
            return None
        return ExpertMask(indices.id, src[1], orient or "tke", src[2])


_INTEGER_DTYPES = {"torch.long", "torch.int64", "torch.int", "torch.int32"}


def _integer_cast_operand(module: ModuleInfo, node: ast.expr) -> ast.expr:
    """``idx`` of an integer cast ``idx.long()`` / ``idx.int()`` / ``idx.to(torch.int64)`` / ``idx.type(torch.long)``
    (s42: ``one_hot(sel.long(), E)``: expert indices are integers already, the cast changes no index value); else
    ``node`` itself."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.keywords):
        return node
    if node.func.attr in ("long", "int") and not node.args:
        return node.func.value
    if node.func.attr in ("to", "type") and len(node.args) == 1 and api(module, node.args[0]) in _INTEGER_DTYPES:
        return node.func.value
    return node

# --- norms (issue 14, class 1) ---
# Spellings of the pieces an L2-normalisation RMSNorm is written with: the 2-norm over the last
# dim, a clamp from below, and sqrt(d) factors. Pure functions of the nodes and the import table.

L2_NORM_APIS = ("torch.norm", "torch.linalg.norm", "torch.linalg.vector_norm", "torch.functional.norm")


def _last_dim(node: ast.AST | None) -> bool:
    v = const_value(node)
    if isinstance(v, (tuple, list)) and len(v) == 1:
        v = v[0]
    return v == -1


def l2_norm_operand(module: ModuleInfo, node: ast.AST | None) -> ast.expr | None:
    """``x`` when ``node`` is the 2-norm of ``x`` over the last dim, kept: ``torch.norm(x, dim=-1,
    keepdim=True)``, ``x.norm(2, -1, True)``, ``torch.linalg.vector_norm(x, dim=-1, keepdim=True)``,
    ``torch.linalg.norm(x, ord=2, dim=-1, keepdim=True)``; else None (another order or dim, no keepdim,
    ``self.norm(x)`` -- a module, not a tensor method)."""
    if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        return None
    name = api(module, node.func)
    if name in L2_NORM_APIS:
        if not node.args:
            return None
        x, rest = node.args[0], node.args[1:]
        order_kw = "ord" if "linalg" in name else "p"
    elif isinstance(node.func, ast.Attribute) and node.func.attr == "norm" and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
        x, rest, order_kw = node.func.value, list(node.args), "p"
    else:
        return None
    p = rest[0] if rest else _kw(node, order_kw)
    dim = rest[1] if len(rest) > 1 else _kw(node, "dim")
    keep = rest[2] if len(rest) > 2 else _kw(node, "keepdim")
    if p is not None and const_value(p) not in (2, 2.0):
        return None
    if not _last_dim(dim) or const_value(keep) is not True:
        return None
    return x


def clamp_min_of(module: ModuleInfo, node: ast.AST | None) -> tuple[ast.expr, ast.expr] | None:
    """(value, floor) of a clamp from below only: ``v.clamp(min=e)``, ``v.clamp(e)``,
    ``v.clamp_min(e)``, ``v.clip(min=e)``, ``torch.clamp(v, min=e)``, ``torch.clamp_min(v, e)``."""
    if not isinstance(node, ast.Call):
        return None
    name = api(module, node.func)
    if name in ("torch.clamp", "torch.clamp_min", "torch.clip") and node.args:
        v, rest = node.args[0], node.args[1:]
    elif isinstance(node.func, ast.Attribute) and node.func.attr in ("clamp", "clamp_min", "clip"):
        v, rest = node.func.value, list(node.args)
    else:
        return None
    floor = rest[0] if rest else _kw(node, "min")
    if floor is None or len(rest) > 1 or _kw(node, "max") is not None:
        return None
    return v, floor


def root_power(module: ModuleInfo, node: ast.AST | None, attr_value=None, depth: int = 0) -> float | None:
    """0.5 for ``d ** 0.5`` / ``math.sqrt(d)``, -0.5 for ``d ** -0.5`` / ``1 / math.sqrt(d)``; else
    None. ``attr_value(name)`` (optional) gives the value ``__init__`` assigns to ``self.<name>``,
    so ``self.scale = dim ** 0.5`` counts where ``self.scale`` is read."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and const_value(node.right) in (0.5, -0.5):
        return float(const_value(node.right))  # type: ignore[arg-type]
    if isinstance(node, ast.Call) and api(module, node.func) in ("math.sqrt", "numpy.sqrt") and len(node.args) == 1:
        return 0.5
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and const_value(node.left) in (1, 1.0):
        inner = root_power(module, node.right, attr_value, depth + 1)
        return -inner if inner is not None else None
    if (attr_value is not None and depth < 2 and isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self"):
        value = attr_value(node.attr)
        return root_power(module, value, attr_value, depth + 1) if value is not None else None

# --- rope: halves and lane pairs through views, unbind and einops (issue 14, class 2) ---
from npufuse.scan.dataflow import strip_casts  # noqa: E402  (kept in this block: other helpers append here too)
# ``half_of`` above answers for chunk / split / slices; rotary code also cuts the last dim by viewing it
# as two axes and unbinding one (``x.unflatten(-1, (2, -1)).unbind(-2)``), with einops, or into
# interleaved lane pairs (``x[..., ::2]``, ``x.view(*x.shape[:-1], -1, 2).unbind(-1)``). One answer
# for all of them: which tensor, which piece, and whether the pieces are halves or lanes.


@dataclass(frozen=True)
class Lane:
    """``node`` holds piece ``index`` of ``source``'s last dim: ``kind`` "halves" (0 first half,
    1 second half) or "pairs" (0 even lanes x[..., 2i], 1 odd lanes x[..., 2i+1])."""

    source: ast.expr
    index: int
    kind: str  # halves | pairs
    spelling: str
    # where the name holding x is rebound to the view itself (``q = q.view(.., -1, 2)``), ``source`` is the view
    # flattened back (x's values where the lanes are read) and this is the name as it was before the view
    before_view: ast.expr | None = None


def _shape_lead(node: ast.AST, x: ast.expr) -> bool:
    """``*x.shape[:-1]`` (x's leading dims kept)."""
    if not isinstance(node, ast.Starred):
        return False
    sub = node.value
    return (isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "shape"
            and (same(sub.value.value, x) or same(sub.value.value, strip_casts(x)[0]))  # x.float().view(*x.shape[:-1], ..)
            and isinstance(sub.slice, ast.Slice) and sub.slice.lower is None
            and const_value(sub.slice.upper) == -1 and sub.slice.step is None)


def _shape_plus_two(view: ast.Call, x: ast.expr) -> list[ast.expr] | None:
    """The two trailing sizes of a one-argument view of x's leading dims: ``x.reshape(x.shape[:-1] + (a, b))``
    (llama2.c) or ``x.view((*x.shape[:-1], a, b))``."""
    if len(view.args) != 1 or view.keywords:
        return None
    arg = view.args[0]
    if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Add) and isinstance(arg.right, ast.Tuple) and len(arg.right.elts) == 2 \
            and _shape_lead(ast.Starred(value=arg.left, ctx=ast.Load()), x):
        return list(arg.right.elts)
    if isinstance(arg, ast.Tuple) and len(arg.elts) == 3 and _shape_lead(arg.elts[0], x):
        return list(arg.elts[1:])
    return None


def _two_axes(module: ModuleInfo, node: ast.expr, scope: Scope | None = None) -> tuple[ast.expr, str] | None:
    """(x, "outer2" | "inner2") when ``node`` views x's last dim D as two axes, the 2 outer
    (``(2, D/2)``: halves) or inner (``(D/2, 2)``: lane pairs)."""
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr == "unflatten" and len(node.args) == 2 and const_value(node.args[0]) == -1:
        sizes = node.args[1]
        if isinstance(sizes, (ast.Tuple, ast.List)) and len(sizes.elts) == 2:
            a, b = (const_value(e) for e in sizes.elts)
            if a == 2 and b == -1:
                return f.value, "outer2"
            if a == -1 and b == 2:
                return f.value, "inner2"
        return None
    sizes_two = _shape_plus_two(node, f.value) if isinstance(f, ast.Attribute) and f.attr in ("view", "reshape") else None
    if sizes_two is not None or (isinstance(f, ast.Attribute) and f.attr in ("view", "reshape") and len(node.args) == 3 and _shape_lead(node.args[0], f.value)):
        a, b = (const_value(e) for e in sizes_two) if sizes_two is not None else (const_value(node.args[1]), const_value(node.args[2]))
        if a == 2 and b == -1:
            return f.value, "outer2"
        if a == -1 and b == 2:
            return f.value, "inner2"
        # x's own leading dims and a size written out beside the 2 (CS336's ``x.reshape(*x.shape[:-1], d_k // 2, 2)``):
        # the element count forces that size to be D/2 (any other value fails the reshape), so the view is the same
        if b == 2 and a != 2:
            return f.value, "inner2"
        if a == 2 and b != 2:
            return f.value, "outer2"
        return None
    if isinstance(f, ast.Attribute) and f.attr in ("view", "reshape") and len(node.args) >= 3 and scope is not None:
        # OLMo: ``B, nh, T, hs = x.size(); x.view(B, nh, T, 2, hs // 2)``: x's own dims, the last one cut in two
        return _explicit_two_axes(scope, node, f.value, module)
    if api(module, node) in ("einops.rearrange",) or (isinstance(f, ast.Name) and f.id == "rearrange"):
        if len(node.args) != 2 or not isinstance(node.args[1], ast.Constant) or not isinstance(node.args[1].value, str):
            return None
        lhs, _, rhs = node.args[1].value.partition("->")
        lt = lhs.replace("(", " ( ").replace(")", " ) ").split()
        rt = rhs.split()
        # "... (j d) -> ... j d" (j=2): halves; "... (d j) -> ... d j" (j=2): lane pairs
        if len(lt) < 4 or lt[-4] != "(" or lt[-1] != ")" or len(rt) < 2 or lt[:-4] != rt[:-2] or rt[-2:] != lt[-3:-1]:
            return None
        two = [kw.arg for kw in node.keywords if const_value(kw.value) == 2]
        if lt[-3] in two and lt[-2] not in two:
            return node.args[0], "outer2"
        if lt[-2] in two and lt[-3] not in two:
            return node.args[0], "inner2"
    return None


def _explicit_two_axes(scope: Scope, view: ast.Call, x: ast.expr, module: ModuleInfo | None = None) -> tuple[ast.expr, str] | None:
    """``x.view(d0, .., dk-1, 2, dk // 2)`` (or ``dk // 2, 2``) with ``d0, .., dk = x.size()`` unpacked
    in this scope: (x, "outer2" | "inner2"). The sizes may also be those of the input of the ``nn.Linear``
    x comes from, with ``-1`` for the half (``B, T, C = h.shape; q = self.wq(h); q.view(B, T, -1, 2)``: a
    linear layer keeps every leading dim, not the last)."""
    *lead, a, b = view.args
    names = []
    unpack = None
    sizes_of = x
    if module is not None and lead and isinstance(lead[0], ast.Name):
        first = [v for st, v in scope.assignments.get(lead[0].id, []) if st.lineno < view.lineno]
        if first and isinstance(first[-1], ast.Subscript) and not _size_of(first[-1].value, x):
            sizes_of = _linear_input(module, scope, x, view.lineno) or x  # (only then is the class read)
    for i, arg in enumerate(lead):
        if not isinstance(arg, ast.Name):
            return None
        binds = [(st, v) for st, v in scope.assignments.get(arg.id, []) if st.lineno < view.lineno]
        if not binds:
            return None
        st, v = binds[-1]
        if not (isinstance(v, ast.Subscript) and const_value(v.slice) == i and _size_of(v.value, sizes_of)):
            return None
        if unpack is None:
            unpack = st
        elif st is not unpack:
            return None
        names.append(arg.id)
    if unpack is None or not (isinstance(unpack, ast.Assign) and isinstance(unpack.targets[0], ast.Tuple)):
        return None
    elts = unpack.targets[0].elts
    if len(elts) != len(lead) + 1 or not isinstance(elts[-1], ast.Name):
        return None
    last = elts[-1].id if sizes_of is x else None  # (the layer's output width is not its input's)

    def half_of_last(e: ast.expr) -> bool:
        return const_value(e) == -1 or (isinstance(e, ast.BinOp) and isinstance(e.op, ast.FloorDiv)
                                        and isinstance(e.left, ast.Name) and e.left.id == last and const_value(e.right) == 2)
    if const_value(a) == 2 and half_of_last(b):
        return x, "outer2"
    if const_value(b) == 2 and half_of_last(a):
        return x, "inner2"
    return None


def _linear_input(module: ModuleInfo, scope: Scope, x: ast.expr, line: int) -> ast.expr | None:
    """z where x is ``self.<attr>(z)`` (inline, or the name x bound to it last before ``line``) and every
    assignment of ``self.<attr>`` in the scope's class is an ``nn.Linear(..)``; else None."""
    call = x
    if isinstance(x, ast.Name):
        binds = [v for st, v in scope.assignments.get(x.id, []) if st.lineno < line]
        call = binds[-1] if binds else None
    if not (isinstance(call, ast.Call) and len(call.args) == 1 and not call.keywords and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "self" and not isinstance(call.args[0], ast.Starred)):
        return None
    cls = module.classes.get(scope.class_name or "")
    if cls is None:
        return None
    attr = call.func.attr
    made = [st.value for st in ast.walk(cls) if isinstance(st, ast.Assign) and any(
        isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name) and t.value.id == "self" for t in st.targets)]
    if not made or not all(isinstance(v, ast.Call) and api(module, v) == "torch.nn.Linear" for v in made):
        return None
    z = call.args[0]
    if isinstance(x, ast.Name) and isinstance(z, ast.Name) and z.id == x.id:
        return None  # ``x = self.wq(x)``: the name no longer holds the layer's input where the sizes were read
    return z


def _size_of(node: ast.expr, x: ast.expr) -> bool:
    """``x.size()`` / ``x.shape``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size" and not node.args:
        return same(node.func.value, x)
    return isinstance(node, ast.Attribute) and node.attr == "shape" and same(node.value, x)


def _unbound_lanes(module: ModuleInfo, scope: Scope, call: ast.expr) -> tuple[ast.expr, ...] | None:
    """(x, kind, spelling) for ``<two-axis view of x>.unbind(axis)`` unbinding the 2-sized axis (the
    view inline or bound to a name first, as rotary-embedding-torch's ``x = rearrange(...)`` does)."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "unbind"):
        return None
    dim = call.args[0] if call.args else _kw(call, "dim")
    receiver = held = call.func.value
    if isinstance(receiver, ast.Name):
        receiver = scope.resolve(receiver, getattr(call, "lineno", None), depth=1)
    view = _two_axes(module, receiver, scope)
    if view is None:
        return None
    x, how = view
    base = strip_casts(x)[0]
    if isinstance(held, ast.Name) and receiver is not held and isinstance(base, ast.Name) and base.id == held.id:
        # ``q = q.view(B, T, -1, 2); a, b = q.unbind(-1)``: where the lanes are read the name holds the view, and
        # x is its flatten back (x's values and shape), as ``indexed_lane`` gives it
        minus_two = ast.UnaryOp(op=ast.USub(), operand=ast.Constant(2))
        flat = ast.Call(func=ast.Attribute(value=ast.Name(id=held.id, ctx=ast.Load()), attr="flatten", ctx=ast.Load()), args=[minus_two], keywords=[])
        if how == "outer2" and const_value(dim) == -2:
            return flat, "halves", "unbind", x
        if how == "inner2" and const_value(dim) == -1:
            return flat, "pairs", "unbind", x
        return None
    if how == "outer2" and const_value(dim) == -2:
        return x, "halves", "unbind"
    if how == "inner2" and const_value(dim) == -1:
        return x, "pairs", "unbind"
    return None


def _einops_tokens(pattern: str) -> tuple[list[str], list[str]] | None:
    lhs, arrow, rhs = pattern.partition("->")
    if not arrow:
        return None
    return lhs.replace("(", " ( ").replace(")", " ) ").split(), rhs.replace("(", " ( ").replace(")", " ) ").split()


def _pair_axis_first(module: ModuleInfo, node: ast.expr) -> tuple[ast.expr, str] | None:
    """(x, "halves" | "pairs") for einops ``rearrange(x, "... (d r) -> r ... d", r=2)``: x's last dim cut in two
    with the 2-sized factor moved to the front, so that unpacking ``a, b = <it>`` (which iterates dim 0) gives the
    two pieces: the even/odd lanes when the 2 is the inner factor (uni2ts / toto's ``(dim r) -> r ... dim``,
    CS336's ``(half_d xy) -> xy ... half_d``), the halves when it is the outer one (``(r d) -> r ... d``)."""
    if not (isinstance(node, ast.Call) and (api(module, node) == "einops.rearrange" or (isinstance(node.func, ast.Name) and node.func.id == "rearrange"))):
        return None
    if len(node.args) != 2 or not isinstance(node.args[1], ast.Constant) or not isinstance(node.args[1].value, str):
        return None
    toks = _einops_tokens(node.args[1].value)
    if toks is None:
        return None
    lt, rt = toks
    if len(lt) < 4 or lt[-4] != "(" or lt[-1] != ")" or "(" in lt[:-4] or len(rt) != len(lt) - 2:
        return None
    outer, inner = lt[-3], lt[-2]
    two = {kw.arg for kw in node.keywords if const_value(kw.value) == 2}
    for first, rest, kind in ((inner, outer, "pairs"), (outer, inner, "halves")):
        if first in two and rest not in two and rt == [first] + lt[:-4] + [rest]:
            return node.args[0], kind
    return None


def lane_of(module: ModuleInfo, scope: Scope, node: ast.expr, before_line: int | None = None) -> Lane | None:
    """Which half or lane pair of which tensor ``node`` holds, for every spelling :func:`half_of`
    knows plus strided slices (``x[..., ::2]`` / ``x[..., 1::2]``) and two-axis views unbound
    (``unflatten`` / ``view(*x.shape[:-1], 2, -1)`` / einops ``rearrange``), inline or through a
    two-name unpacking or an index ``[0]`` / ``[1]``."""
    value: ast.expr | None = node
    stmt = None
    if isinstance(node, ast.Name):
        line = before_line if before_line is not None else getattr(node, "lineno", None)
        value = None
        for st, v in scope.assignments.get(node.id, []):
            if line is not None and st.lineno >= line:
                break
            stmt, value = st, v
        if value is None:
            return None
    if isinstance(value, ast.Subscript) and isinstance(value.value, (ast.Tuple, ast.List)) \
            and type(const_value(value.slice)) is int and 0 <= const_value(value.slice) < len(value.value.elts):
        # ``a, b = x[..., ::2], x[..., 1::2]`` is recorded as the tuple indexed by position: its element
        value = value.value.elts[const_value(value.slice)]
    # a strided slice: the even / odd lanes
    if isinstance(value, ast.Subscript):
        sl = value.slice
        if isinstance(sl, ast.Tuple) and len(sl.elts) == 2 and isinstance(sl.elts[0], ast.Constant) and sl.elts[0].value is Ellipsis:
            sl = sl.elts[1]
        if isinstance(sl, ast.Slice) and sl.upper is None and const_value(sl.step) == 2 and not isinstance(value.slice, ast.Slice):
            lo = 0 if sl.lower is None else const_value(sl.lower)
            if lo in (0, 1):
                return Lane(value.value, lo, "pairs", "slice")
        # ``<view>.unbind(..)[k]`` (also how ``a, b = <view>.unbind(..)`` is recorded)
        k = const_value(value.slice)
        if type(k) is int and k in (0, 1):
            held = value.value
            if isinstance(held, ast.Name):  # ``p = <view>.unbind(..); a = p[0]``
                held = scope.resolve(held, getattr(value, "lineno", None), depth=1)
            inner = _unbound_lanes(module, scope, held)
            if inner is None and _unpacks_two(stmt):  # ``a, b = rearrange(x, "... (d r) -> r ... d", r=2)``
                first = _pair_axis_first(module, held)
                inner = (first[0], first[1], "einops") if first is not None else None
            if inner is not None and (stmt is None or _unpacks_two(stmt) or not isinstance(stmt, ast.Assign)
                                      or not isinstance(stmt.targets[0], ast.Tuple)):
                return Lane(inner[0], k, inner[1], inner[2], *inner[3:])
    if stmt is not None and isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple):
        inner = _unbound_lanes(module, scope, value)
        elts = stmt.targets[0].elts
        if inner is not None and len(elts) == 2:
            idx = next((i for i, e in enumerate(elts) if isinstance(e, ast.Name) and e.id == node.id), None)  # type: ignore[attr-defined]
            if idx is not None:
                return Lane(inner[0], idx, inner[1], inner[2], *inner[3:])
    # chunk / split / slices (and unbind of a 2-wide last dim, whose halves are its two lanes) — after the
    # views above, which name the tensor before the view
    h = half_of(module, scope, node, before_line)
    if h is not None:
        return Lane(h.source, h.index, "halves", h.spelling)
    lane = indexed_lane(module, scope, node, before_line)
    if lane is None and stmt is not None and value is not node and isinstance(value, ast.Subscript):
        # ``x0, x1 = p[..., 0], p[..., 1]`` / ``x0 = p[..., 0]``: the lane indexed where the name is bound
        lane = indexed_lane(module, scope, value, stmt.lineno)
        use = before_line if before_line is not None else getattr(node, "lineno", None)
        base = strip_casts(lane.source)[0] if lane is not None else None
        while isinstance(base, (ast.Call, ast.Attribute)) and lane is not None and lane.spelling == "index":
            base = base.func.value if isinstance(base, ast.Call) else base.value  # ``x.flatten(-2)``: x
        if lane is not None and (not isinstance(base, ast.Name) or use is None
                                 or any(stmt.lineno < st.lineno < use for st, _v in scope.assignments.get(base.id, []))):
            return None  # the source's name is rebound between the lane's binding and its use: another tensor there
    return lane

# --- attention: products as matmuls with a layout ---
# ``a @ b``, ``torch.matmul``/``bmm`` (function or method), a two-operand ``torch.einsum`` and
# ``torch.baddbmm(x, a, b, beta=0, alpha=s)`` (Megatron's scores: x is ignored when beta is 0) are
# one thing to a detector: a batched product of a and b, with einsum's subscripts saying which axes
# are batch, which are contracted and in which order the result comes out, and baddbmm's alpha a
# scale on it. The callee's name is resolved by the caller (a detector reading symbolic values has
# its own resolver), so this stays a pure function of the nodes.

from typing import Callable  # noqa: E402  (this block's own import: appended blocks merge independently)

MATMUL_NAMES = ("torch.matmul", "torch.bmm")


def einsum_subscripts(node: ast.AST | None) -> tuple[str, str, str] | None:
    """(a, b, out) of a two-operand einsum equation written as a string literal (or an f-string
    without placeholders, lucidrains' ``f"b h i d, b h j d -> b h i j"``); spaces dropped, a
    leading ``...`` read as two batch axes (``"BH"``); None for anything else (implicit output,
    three operands, placeholders)."""
    if isinstance(node, ast.JoinedStr):
        if not all(isinstance(v, ast.Constant) and isinstance(v.value, str) for v in node.values):
            return None
        spec = "".join(v.value for v in node.values)  # type: ignore[union-attr]
    else:
        spec = const_value(node)  # type: ignore[assignment]
    if not isinstance(spec, str) or "->" not in spec:
        return None
    spec = spec.replace(" ", "")
    lhs, _, out = spec.partition("->")
    ops = lhs.split(",")
    if len(ops) != 2:
        return None
    subs = [s.replace("...", "BH") for s in (ops[0], ops[1], out)]
    if not all(s.isalpha() and s.isascii() and len(set(s)) == len(s) for s in subs):
        return None  # a repeated letter is a diagonal, not a product
    return subs[0], subs[1], subs[2]


@dataclass(frozen=True)
class Contraction:
    """A two-operand einsum read as a batched matmul. Each letter is one of: ``batch`` (in a, b and
    the output), ``a_free`` (a and the output), ``b_free`` (b and the output), ``summed`` (a and b,
    not the output). Strings keep the letters in a's / b's order."""

    a: str
    b: str
    out: str
    batch: str
    a_free: str
    b_free: str
    summed: str


def contraction(subs: tuple[str, str, str] | None) -> Contraction | None:
    """The roles of an einsum's letters; None when it is not a product of the two operands (a
    letter summed over one operand only, an output letter in neither)."""
    if subs is None:
        return None
    a, b, out = subs
    if set(out) - set(a) - set(b):
        return None
    if (set(a) ^ set(b)) - set(out):
        return None  # summed over one operand only: a reduction, not a matmul
    return Contraction(
        a, b, out,
        batch="".join(c for c in a if c in b and c in out),
        a_free="".join(c for c in a if c not in b and c in out),
        b_free="".join(c for c in b if c not in a and c in out),
        summed="".join(c for c in a if c in b and c not in out),
    )


@dataclass
class Product:
    """A batched product ``a · b`` as written. ``kind``: ``@`` | ``matmul`` | ``bmm`` | ``einsum`` |
    ``baddbmm``; ``subs``: the einsum's letters (None: matmul semantics, contracting a's last axis
    with b's second to last); ``alpha``: baddbmm's scale on the product (None: 1)."""

    a: ast.expr
    b: ast.expr
    kind: str
    subs: Contraction | None = None
    alpha: ast.expr | None = None
    spec: ast.expr | None = None  # the einsum equation node


def product(node: ast.AST, callee: Callable[[ast.Call], str | None]) -> Product | None:
    """``node`` as a :class:`Product`, or None. ``callee(call)`` gives a call's canonical dotted name
    (``torch.einsum`` for ``from torch import einsum``); an einsum whose equation does not parse is
    still a product (``subs`` None, ``spec`` set) so the detector can say why it stops there."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return Product(node.left, node.right, "@")
    if not isinstance(node, ast.Call):
        return None
    name = callee(node)
    if name in MATMUL_NAMES and len(node.args) == 2:
        return Product(node.args[0], node.args[1], "bmm" if name == "torch.bmm" else "matmul")
    if name == "torch.einsum" or name in EINSUM_EQUIVALENTS:  # s28: opt_einsum's contract is the same product
        if len(node.args) == 3:
            a, b = node.args[1], node.args[2]
        elif len(node.args) == 2 and isinstance(node.args[1], (ast.List, ast.Tuple)) and len(node.args[1].elts) == 2 \
                and not any(isinstance(e, ast.Starred) for e in node.args[1].elts):
            a, b = node.args[1].elts  # CvT: einsum(spec, [q, k])
        else:
            return None
        return Product(a, b, "einsum", contraction(einsum_subscripts(node.args[0])), spec=node.args[0])
    if name == "einops.einsum" and len(node.args) == 3 and not node.keywords:
        # einops puts the equation last and names axes by space-separated words (``"b h i d, b h j
        # d -> b h i j"``); read only one-letter axis names, where the text means what torch reads
        return Product(node.args[0], node.args[1], "einsum", contraction(einops_equation_subscripts(node.args[2])), spec=node.args[2])
    if name == "torch.baddbmm" and len(node.args) == 3 and const_value(_kw(node, "beta")) in (0, 0.0):
        return Product(node.args[1], node.args[2], "baddbmm", alpha=_kw(node, "alpha"))
    if isinstance(node.func, ast.Attribute) and name not in MATMUL_NAMES + ("torch.einsum", "torch.baddbmm", "einops.einsum"):
        attr = node.func.attr
        if attr in ("matmul", "bmm") and len(node.args) == 1 and not node.keywords:
            return Product(node.func.value, node.args[0], attr)
        if attr == "baddbmm" and len(node.args) == 2 and const_value(_kw(node, "beta")) in (0, 0.0):
            return Product(node.args[0], node.args[1], "baddbmm", alpha=_kw(node, "alpha"))
    return None


def einops_equation_subscripts(node: ast.AST | None) -> tuple[str, str, str] | None:
    """(a, b, out) of an einops ``einsum`` pattern, each axis name one letter (or ``...``): a longer name is
    one axis to einops (``"batch i d"``: three axes; torch would read seven letters) and is renamed to one
    letter (s33); None for anything :func:`einsum_subscripts` does not read."""
    text = const_value(node)
    if isinstance(node, ast.JoinedStr) and all(isinstance(v, ast.Constant) and isinstance(v.value, str) for v in node.values):
        text = "".join(v.value for v in node.values)  # type: ignore[union-attr]
    if not isinstance(text, str):
        return None
    words = text.replace(",", " ").replace("->", " ").split()
    if not all(len(w) == 1 or w == "..." for w in words):
        # s33: einops axis names are words (``"... queries d_k, ... keys d_k -> ... queries keys"``, CS336 code):
        # each distinct word is one axis, renamed to a letter the pattern does not use (never ``B``/``H``, which
        # stand for ``...``); a grouping ``(h d)``, a digit axis or a non-identifier is not read
        if text.count("->") != 1 or not all(w == "..." or w.isidentifier() and w.isascii() for w in words):
            return None
        free = [c for c in "abcdefghijklmnopqrstuvwxyzACDEFGIJKLMNOPQRSTUVWXYZ" if c not in words]
        letters: dict[str, str] = {}
        for w in words:
            if len(w) > 1 and w != "..." and w not in letters:
                if not free:
                    return None
                letters[w] = free.pop(0)
        sides = [[" ".join(letters.get(w, w) for w in op.split()) for op in side.split(",")] for side in text.split("->")]
        text = " -> ".join(", ".join(side) for side in sides)
    return einsum_subscripts(ast.Constant(text))


def einops_permutation(pattern: ast.AST | None) -> tuple[int, ...] | None:
    """The axis permutation an einops ``rearrange`` pattern performs when it only reorders axes
    (``"b i j -> b j i"`` -> ``(0, 2, 1)``: a transpose); None for groupings, new or dropped axes."""
    text = const_value(pattern)
    if not isinstance(text, str) or text.count("->") != 1 or any(ch in text for ch in "()...1"):
        return None
    lhs, rhs = (side.split() for side in text.split("->"))
    if len(set(lhs)) != len(lhs) or sorted(lhs) != sorted(rhs) or not all(x.isidentifier() for x in lhs):
        return None
    return tuple(lhs.index(x) for x in rhs)


def swaps_last_two(perm: tuple[int, ...] | None) -> bool:
    """The permutation exchanges the last two axes and keeps the others in place."""
    return perm is not None and len(perm) >= 2 and perm == tuple(range(len(perm) - 2)) + (len(perm) - 1, len(perm) - 2)

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
            # s40: dim 1 is the expert axis of 2-D [T, E] scores (`torch.gather(affinity, 1, topk_i)`); the output has
            # the index's shape whatever the dim, but a gather across the tokens (dim 0) is not read as a routing weight
            return dim is not None and const_value(dim) in (-1, 1) and isinstance(index, ast.Name) and index.id == indices
        step: ast.expr | None = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SHAPE_KEEPING_CASTS:
            step = node.func.value
        elif isinstance(node, ast.Call) and api(module, node.func) in ("torch.softmax", "torch.nn.functional.softmax") and node.args:
            # s42: a softmax over any one dim keeps the shape (element [t, k] stays slot k of token t; which values the
            # weights hold is the site's business, it reads them as they are)
            dim = node.args[1] if len(node.args) > 1 else _kw(node, "dim")
            step = node.args[0] if dim is not None and type(const_value(dim)) is int else None
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "softmax":
            # w.softmax(dim=-1) (s40: torch.softmax(w, dim=-1) reads back in this spelling)
            dim = node.args[0] if node.args else _kw(node, "dim")
            step = node.func.value if dim is not None and type(const_value(dim)) is int else None
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


# --- attention: einsum equations with a placeholder chosen by a condition ---
# lucidrains' ``kv_eq = 'b j d' if k.ndim == 3 else 'b h j d'`` then ``einsum(f"b h i d, {kv_eq} -> b h i j", q, k)``:
# the equation is one of two literals, decided at run time. Each variant is read as its own product;
# which one a detector may fuse (and under what run-time condition) is its decision.


@dataclass(frozen=True)
class EquationVariant:
    """One value of an einsum equation whose placeholder is a conditional of two string constants:
    the equation text, its contraction, and the condition under which it is the one used
    (``test`` true when ``when_true``, false otherwise)."""

    equation: str
    subs: Contraction
    test: ast.expr
    when_true: bool
    placeholder: str  # the placeholder's value in this variant (``"b h j d"``)


def equation_variants(spec: ast.AST | None, assigned: Callable[[ast.expr], ast.AST | None]) -> list[EquationVariant] | None:
    """Both variants of an f-string einsum equation whose placeholders all hold one value
    (``assigned(expr)``: the expression a placeholder stands for, or None when that is not known)
    of the form ``"A" if test else "B"`` with string constants; None unless both variants parse as
    two-operand products (an equation that only works for one value is not read)."""
    if not isinstance(spec, ast.JoinedStr):
        return None
    values = []
    for part in spec.values:
        if isinstance(part, ast.FormattedValue):
            if part.conversion != -1 or part.format_spec is not None:
                return None
            values.append(assigned(part.value))
        elif not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
            return None
    if not values or any(v is not values[0] for v in values):
        return None
    value = values[0]
    if not isinstance(value, ast.IfExp):
        return None
    texts = const_value(value.body), const_value(value.orelse)
    if not all(isinstance(t, str) for t in texts):
        return None
    out = []
    for text, when_true in zip(texts, (True, False)):
        eq = "".join(p.value if isinstance(p, ast.Constant) else text for p in spec.values)  # type: ignore[operator]
        subs = contraction(einsum_subscripts(ast.Constant(eq)))
        if subs is None:
            return None
        out.append(EquationVariant(eq, subs, value.test, when_true, text))  # type: ignore[arg-type]
    return out


# --- moe: flattened (1-D) expert indices ---


def flattened_to_1d(module: ModuleInfo, scope: Scope, name: str, before_line: int) -> bool:
    """Whether ``name`` provably holds a 1-D tensor when read before ``before_line``: its last
    assignment is ``x.view(-1)`` / ``x.reshape(-1)`` / ``x.flatten()`` / ``torch.flatten(x)``
    (optionally followed by casts). Only then is ``(name == e).nonzero()`` an ``[n, 1]`` column of
    row numbers (for ``[T, K]`` indices it is ``[n, 2]`` (row, slot) pairs, which pick no rows)."""
    node = scope.definition(name, before_line)
    for _ in range(4):
        if not isinstance(node, ast.Call):
            break
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("view", "reshape") and len(node.args) == 1 and not node.keywords:
            return const_value(node.args[0]) == -1
        if isinstance(f, ast.Attribute) and f.attr == "flatten" and not node.args and not node.keywords:
            return True
        if isinstance(f, ast.Attribute) and f.attr in _SHAPE_KEEPING_CASTS + ("long", "int", "cpu"):
            node = f.value
            continue
        if api(module, f) == "torch.flatten" and len(node.args) == 1 and not node.keywords:
            return True
        break
    if node is None:
        return False
    from npufuse.patterns import _moe_s45h  # s45: ravel, and selections from a flattened tensor (``flat[keep][order]``)

    return _moe_s45h.one_d(module, scope, ast.Name(id=name, ctx=ast.Load()), before_line)

# --- attention: an in-place add on a trailing slice as an add of a padded term ---
from npufuse.scan.dataflow import dotted  # noqa: E402  (this block's own import)
_SHAPED_CTORS = ("full", "zeros", "ones", "empty")
_SHAPE_KEEPING = ("triu", "tril", "to", "float", "half", "bfloat16", "type", "type_as", "contiguous")


def _last_dim_text(node: ast.AST) -> str | None:
    """The source of a tensor expression's last dim when its constructor states it (``torch.full((s, s), v)``,
    ``torch.zeros(a, b)``, through ``.triu(1)`` / ``.to(...)``), else None."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SHAPE_KEEPING:
        node = node.func.value
    if not (isinstance(node, ast.Call) and (dotted(node.func) or "").rpartition(".")[2] in _SHAPED_CTORS and node.args):
        return None
    shape = node.args[0]
    if isinstance(shape, (ast.Tuple, ast.List)):
        return ast.unparse(shape.elts[-1]) if shape.elts and not any(isinstance(e, ast.Starred) for e in shape.elts) else None
    if (dotted(node.func) or "").rpartition(".")[2] == "full":
        return None  # full(size, value): one positional shape only as a tuple
    dims = [a for a in node.args if not isinstance(a, ast.Starred)]
    return ast.unparse(dims[-1]) if len(dims) == len(node.args) else None


def slice_add_as_padded(target: ast.AST, value: ast.AST) -> ast.expr | None:
    """``x[:, :, :, -n:] += t`` (every axis but the last taken whole, the last from ``-n``; ``t``'s last dim
    stated as ``n`` by its constructor) as ``x = x + F.pad(t, (x.size(-1) - n, 0))``: the same sum, with the
    zeros of the untouched columns written out (minimind's causal triangle over the newest keys). None for
    any other target."""
    if not (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)):
        return None
    parts = target.slice.elts if isinstance(target.slice, ast.Tuple) else [target.slice]
    if not parts or not all(isinstance(p, ast.Slice) for p in parts):
        return None
    if any(p.lower is not None or p.upper is not None or p.step is not None for p in parts[:-1]):
        return None
    last = parts[-1]
    if not (last.upper is None and last.step is None and isinstance(last.lower, ast.UnaryOp) and isinstance(last.lower.op, ast.USub)):
        return None
    n = last.lower.operand
    if _last_dim_text(value) != ast.unparse(n):
        return None
    width = ast.BinOp(left=ast.Call(func=ast.Attribute(value=ast.Name(target.value.id, ast.Load()), attr="size", ctx=ast.Load()),
                                    args=[ast.Constant(-1)], keywords=[]), op=ast.Sub(), right=n)
    pad = ast.Attribute(value=ast.Attribute(value=ast.Attribute(value=ast.Name("torch", ast.Load()), attr="nn", ctx=ast.Load()),
                                            attr="functional", ctx=ast.Load()), attr="pad", ctx=ast.Load())
    return ast.Call(func=pad, args=[value, ast.Tuple(elts=[width, ast.Constant(0)], ctx=ast.Load())], keywords=[])


# --- attention: a sum of two Q@Kᵀ products as one product of concatenated features ---
def _last_two_swapped_base(node: ast.AST) -> ast.expr | None:
    """X of ``X.mT`` / ``X.transpose(-2, -1)`` / ``X.transpose(-1, -2)``, else None."""
    if isinstance(node, ast.Attribute) and node.attr == "mT":
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "transpose" and len(node.args) == 2 \
            and {const_value(a) for a in node.args} == {-2, -1}:
        return node.func.value
    return None


def _torch_call(attr: str, args: list[ast.expr], keywords: list[ast.keyword]) -> ast.Call:
    return ast.Call(func=ast.Attribute(value=ast.Name("torch", ast.Load()), attr=attr, ctx=ast.Load()), args=args, keywords=keywords)


def summed_product(p1: "Product | None", p2: "Product | None") -> "tuple[Product, ast.expr] | None":
    """``a1 @ b1ᵀ + a2 @ b2ᵀ`` (matmul / ``@``, each key a visible transpose of its last two axes) as one product
    ``cat([a1, a2], -1) @ cat([b1, b2], -1)ᵀ`` — equal where the parts agree in every axis but the last
    (``torch.cat`` does not broadcast) — and that condition as an expression; None for other sums."""
    if p1 is None or p2 is None or p1.kind not in ("@", "matmul") or p2.kind not in ("@", "matmul") or p1.alpha is not None or p2.alpha is not None:
        return None
    k1, k2 = _last_two_swapped_base(p1.b), _last_two_swapped_base(p2.b)
    ranks: list[ast.expr] = []
    if k1 is None or k2 is None:
        # s44: ``k.transpose(2, 3)``: the last two axes where k has 4 dims (checked at run time)
        from npufuse.patterns import _attention_s44h

        by_pos = [None if k is not None else _attention_s44h.positional_last_two_swap(p.b) for k, p in ((k1, p1), (k2, p2))]
        if (k1 is None and by_pos[0] is None) or (k2 is None and by_pos[1] is None):
            return None
        ranks = [_attention_s44h.rank_check(base, rank) for base, rank in (r for r in by_pos if r is not None)]
        k1 = k1 if k1 is not None else by_pos[0][0]  # type: ignore[index]
        k2 = k2 if k2 is not None else by_pos[1][0]  # type: ignore[index]
    dim = [ast.keyword(arg="dim", value=ast.Constant(-1))]
    q = _torch_call("cat", [ast.List(elts=[p1.a, p2.a], ctx=ast.Load())], dim)

    def lead(x: ast.expr) -> ast.expr:
        shape = ast.Attribute(value=x, attr="shape", ctx=ast.Load())
        return ast.Subscript(value=shape, slice=ast.Slice(upper=ast.Constant(-1)), ctx=ast.Load())

    q_same = ast.Compare(left=lead(p1.a), ops=[ast.Eq()], comparators=[lead(p2.a)])
    if _plain_name(k1) and _plain_name(k2):
        # s40 (HO16a nano-moe-mla): the decoupled rope key is one head shared by every head ([B, 1, S, dr] beside
        # [B, H, S, hd]): each product broadcasts its key's head axis, so the keys are expanded to their common
        # leading shape before the concatenation, where they differ in the head axis (-3) only and one of them has
        # one head there (names only: each is read several times)
        k_lead = _substituted("torch.broadcast_shapes(K1.shape[:-1], K2.shape[:-1])", k1, k2)
        expanded = [ast.Call(func=ast.Attribute(value=x, attr="expand", ctx=ast.Load()),
                             args=[ast.Starred(value=k_lead, ctx=ast.Load()), ast.Constant(-1)], keywords=[]) for x in (k1, k2)]
        k = _torch_call("cat", [ast.List(elts=expanded, ctx=ast.Load())], dim)
        k_ok = _substituted("K1.dim() == K2.dim() >= 3 and K1.shape[:-3] == K2.shape[:-3] and K1.shape[-2] == K2.shape[-2] "
                            "and (K1.shape[-3] == K2.shape[-3] or K1.shape[-3] == 1 or K2.shape[-3] == 1)", k1, k2)
        guard = ast.BoolOp(op=ast.And(), values=[*ranks, q_same, *k_ok.values])  # type: ignore[attr-defined]
    else:
        k = _torch_call("cat", [ast.List(elts=[k1, k2], ctx=ast.Load())], dim)
        guard = ast.BoolOp(op=ast.And(), values=[*ranks, q_same, ast.Compare(left=lead(k1), ops=[ast.Eq()], comparators=[lead(k2)])])
    return Product(q, ast.Attribute(value=k, attr="mT", ctx=ast.Load()), "matmul"), guard


def _plain_name(node: ast.expr) -> bool:
    """A bare name (an ``ast.Name``, or a detector's symbolic reference to one)."""
    return isinstance(node, ast.Name) or (type(node).__name__ == "Ref" and isinstance(getattr(node, "name", None), str))


def _substituted(template: str, k1: ast.expr, k2: ast.expr) -> ast.expr:
    """``template`` parsed, its names ``K1`` / ``K2`` replaced by the two nodes."""

    class Fill(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.expr:
            return {"K1": k1, "K2": k2}.get(node.id, node)

    tree = ast.parse(template, mode="eval").body
    for n in ast.walk(tree):  # no positions: a renderer reads a positioned node's text from the file
        for attr in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
            if hasattr(n, attr):
                delattr(n, attr)
    return Fill().visit(tree)

# --- norms: L2 normalisation of the last dim through a one-line helper ---
# lucidrains' ``def l2norm(t): return F.normalize(t, dim=-1)`` then ``l2norm(x) * self.scale * self.gamma``:
# the helper's call is the normalisation of its argument, with the helper's own p/eps.

NORMALIZE_FN = "torch.nn.functional.normalize"


@dataclass(frozen=True)
class L2Normalize:
    """``F.normalize(x, p=2, dim=-1, eps=eps)`` read at a call: the normalised operand (an expression
    at the call) and the eps source (None: F.normalize's default 1e-12)."""

    x: ast.expr
    eps: ast.expr | None
    via_helper: str | None  # the helper's name when the call goes through one


def _normalize_last_dim(module: ModuleInfo, call: ast.Call) -> tuple[ast.expr, ast.expr | None] | None:
    if api(module, call.func) != NORMALIZE_FN or any(isinstance(a, ast.Starred) for a in call.args) \
            or any(k.arg is None for k in call.keywords):
        return None
    x = call.args[0] if call.args else _kw(call, "input")
    p = call.args[1] if len(call.args) > 1 else _kw(call, "p")
    dim = call.args[2] if len(call.args) > 2 else _kw(call, "dim")
    eps = call.args[3] if len(call.args) > 3 else _kw(call, "eps")
    if x is None or not is_last_dim(dim) or (p is not None and const_value(p) not in (2, 2.0)):
        return None
    return x, eps


def _bind_call(fn: ast.FunctionDef, call: ast.Call) -> dict[str, ast.expr] | None:
    """Each parameter of ``fn`` bound to the call's argument node, or to its default where the call
    leaves it out; None for ``*``/``**`` anywhere, an unknown keyword or a parameter left unbound."""
    a = fn.args
    if a.vararg or a.kwarg or a.kwonlyargs or any(isinstance(x, ast.Starred) for x in call.args):
        return None
    params = [p.arg for p in (*a.posonlyargs, *a.args)]
    if len(call.args) > len(params):
        return None
    bound: dict[str, ast.expr] = dict(zip(params, call.args))
    for kw in call.keywords:
        if kw.arg is None or kw.arg not in params[len(a.posonlyargs):] or kw.arg in bound:
            return None
        bound[kw.arg] = kw.value
    defaults = dict(zip(params[len(params) - len(a.defaults):], a.defaults))
    for p in params:
        if p not in bound:
            if p not in defaults:
                return None
            bound[p] = defaults[p]
    return bound


def l2_normalize_of(module: ModuleInfo, call: ast.AST | None) -> L2Normalize | None:
    """The last-dim L2 normalisation a call computes: ``F.normalize(x, dim=-1)`` itself, or a call
    ``h(x, ...)`` of a module-level function whose body is only ``return F.normalize(<a parameter>,
    dim=..., p=..., eps=...)`` (docstring allowed), read with the call's arguments and the helper's
    defaults in place of its parameters: ``def l2norm(t, dim=-1, eps=1e-12): return F.normalize(t,
    dim=dim, eps=eps)`` called as ``l2norm(x)`` normalises x over the last dim; ``l2norm(x, dim=1)``
    does not."""
    if not isinstance(call, ast.Call):
        return None
    direct = _normalize_last_dim(module, call)
    if direct is not None:
        return L2Normalize(direct[0], direct[1], None)
    if not isinstance(call.func, ast.Name):
        return None
    fn = next((n for n in module.tree.body if isinstance(n, ast.FunctionDef) and n.name == call.func.id), None)
    if fn is None or fn.decorator_list:
        return None
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.Call):
        return None
    bound = _bind_call(fn, call)
    if bound is None:
        return None
    ret = body[0].value
    operand = ret.args[0] if ret.args else _kw(ret, "input")
    at_call = [*call.args, *(k.value for k in call.keywords)]
    if not (isinstance(operand, ast.Name) and any(bound.get(operand.id) is n for n in at_call)):
        return None  # the normalised tensor is one of the caller's arguments, never a default

    class _Substitute(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            return bound.get(node.id, node)

    inner = _normalize_last_dim(module, _Substitute().visit(copy.deepcopy(ret)))
    if inner is None:
        return None
    if inner[1] is not None and type(const_value(inner[1])) not in (int, float) and not any(inner[1] is n for n in at_call):
        return None  # an eps read from the helper's scope cannot be written at the call
    return L2Normalize(inner[0], inner[1], fn.name)

# --- attention: one-expression helpers inlined at their call ---
# timm's ``maybe_add_mask(scores, mask)`` is ``return scores if mask is None else scores + mask``: a
# detector reading the scores' dataflow sees through it when the helper's body is one ``return`` of an
# expression of its own parameters only (no globals, whose meaning at the caller could differ).


def inline_return_expression(fn: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call,
                             decorator_keeps_function: Callable[[ast.expr], bool]) -> ast.expr | None:
    """The helper's single returned expression with its parameters replaced by the call's arguments
    (positional, keyword, defaults); None when the body is more than a docstring and one ``return``, the
    signature has ``*args``/``**kwargs``/keyword-only parameters, an argument is starred or unknown, a
    decorator may change what a call does (``decorator_keeps_function(d)`` false), or the expression
    reads any name that is not a parameter."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(const_value(s.value), str))]
    a = fn.args
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None or a.vararg or a.kwarg \
            or a.kwonlyargs or a.posonlyargs or not all(decorator_keeps_function(d) for d in fn.decorator_list):
        return None
    bound = _bind_call(fn, call)  # type: ignore[arg-type]
    if bound is None:
        return None
    expr = body[0].value
    if any(isinstance(n, ast.Name) and n.id not in bound for n in ast.walk(expr)) \
            or any(isinstance(n, (ast.Lambda, ast.NamedExpr, ast.comprehension)) for n in ast.walk(expr)):
        return None

    class _Substitute(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            return bound[node.id]

    return _Substitute().visit(copy.deepcopy(expr))


def returns_its_argument(fn: ast.AST | None) -> bool:
    """A decorator defined as ``def d(f): ...; return f`` (a registry such as timm's
    ``register_notrace_function``): eager calls of what it decorates are the function itself."""
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(fn.args.args) != 1 or not fn.body:
        return False
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
    last = fn.body[-1]
    return isinstance(last, ast.Return) and isinstance(last.value, ast.Name) and last.value.id == fn.args.args[0].arg \
        and all(isinstance(r.value, ast.Name) and r.value.id == fn.args.args[0].arg for r in returns) \
        and not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) for n in ast.walk(fn) if n is not fn)


# --- rope / helper spellings (glu2) ---


def if_else_binding(body: list[ast.stmt], name: str, before_line: int) -> ast.IfExp | None:
    """``if c: f = a`` / ``else: f = b`` (each branch that one assignment, the statement before
    ``before_line`` in ``body``, the scope's top level) as the conditional expression
    ``a if c else b``; None where ``name`` is bound any other way before that line."""
    from npufuse.scan.dataflow import fast_walk  # (here: the top import line is shared by every block's edits)

    chosen: ast.IfExp | None = None
    for st in body:
        if st.lineno >= before_line:
            break
        if isinstance(st, ast.If) and len(st.body) == 1 and len(st.orelse) == 1:
            a, b = st.body[0], st.orelse[0]
            if all(isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
                   and s.targets[0].id == name for s in (a, b)):
                chosen = ast.copy_location(ast.IfExp(test=st.test, body=a.value, orelse=b.value), st)  # type: ignore[attr-defined]
                continue
        if any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in fast_walk(st)):  # ast.walk's nodes, cheaper
            return None  # bound (again) some other way
    return chosen


def filled_halves(fn: ast.FunctionDef, ret: ast.Return) -> ast.expr | None:
    """A helper body ``out = torch.empty_like(x); out[..., :h] = A; out[..., h:] = B; return out``
    as ``torch.cat((A, B), dim=-1)`` (the two slices partition the last dim whatever h is), and
    ``out[..., 0::2] = A; out[..., 1::2] = B`` as ``torch.stack((A, B), dim=-1).flatten(-2)`` (even
    lanes A, odd lanes B). Only where those are the three statements right before the return at the
    function's top level, and A and B do not read ``out``; None otherwise."""
    if not (isinstance(ret.value, ast.Name)) or ret not in fn.body:
        return None
    i = fn.body.index(ret)
    if i < 3:
        return None
    got = filled_output(fn.body[i - 3:i])
    if got is None or got[0] != ret.value.id:
        return None
    expr = got[1]
    # the helper's result stands at its return (A and B included, as before filled_output existed)
    for n in ast.walk(expr):
        ast.copy_location(n, ret)
        n.end_lineno, n.end_col_offset = ret.end_lineno, ret.end_col_offset  # type: ignore[attr-defined]
    return expr



# --- norms (s25): squares written with a bare name -----------------------------------------------
# pi-zero's ``pow(x_float, 2).mean(-1, keepdim=True)`` (Python's builtin pow calls Tensor.__pow__),
# ``from torch import pow, square`` then ``pow(x, 2)`` / ``square(x)``.

def name_square_operand(module: ModuleInfo, node: ast.Call) -> ast.expr | None:
    """``x`` for ``pow(x, 2)`` (builtin, or torch's imported by name) and ``square(x)`` (torch's
    imported by name); None for a ``pow`` the module defines itself or imports from elsewhere."""
    f = node.func
    if not isinstance(f, ast.Name) or node.keywords:
        return None
    name = api(module, f)
    builtin = name == "pow" and f.id == "pow" and not any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == "pow" for n in module.tree.body)
    if (builtin or name == "torch.pow") and len(node.args) == 2 and _is_two(node.args[1]):
        return node.args[0]
    if name == "torch.square" and len(node.args) == 1:
        return node.args[0]
    return None



# --- rope harvest (s25): merged pair axis, library rotation helpers ---


def _neg_int(node: ast.AST | None) -> int | None:
    """-k of a literal ``-k`` (an ``ast.UnaryOp``), else None."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and type(node.operand.value) is int:
        return -node.operand.value
    return None


def merges_last_two(node: ast.AST | None) -> ast.expr | None:
    """The tensor whose last two axes ``node`` merges into one, for the spellings authors use after
    ``stack([...], dim=-1)``: ``t.flatten(-2)``, ``t.flatten(-2, -1)``, ``t.flatten(start_dim=-2,
    end_dim=-1)``, ``torch.flatten(t, -2[, -1])``; None for anything else (a positive start dim
    depends on the rank, which only the caller may know)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) or node.func.attr != "flatten":
        return None
    args = list(node.args)
    is_fn = isinstance(node.func.value, ast.Name) and node.func.value.id in ("torch", "th")
    if is_fn:
        if not args:
            return None
        inner, args = args[0], args[1:]
    else:
        inner = node.func.value
    if len(args) > 2:
        return None
    start = args[0] if args else _kw(node, "start_dim")
    end = args[1] if len(args) > 1 else _kw(node, "end_dim")
    if _neg_int(start) != -2 or (end is not None and _neg_int(end) != -1):
        return None
    if any(k.arg not in ("start_dim", "end_dim") for k in node.keywords):
        return None
    return inner


# Rotation helpers of libraries, by their import path: what they compute is fixed by the library
# (the function is not in the scanned repository, so its body cannot be read). ``half``:
# ``cat((-x2, x1), -1)`` over the two halves of the last dim; ``interleave``: ``stack((-x[..., 1::2],
# x[..., ::2]), -1).flatten(-2)``. Hugging Face transformers has carried these bodies unchanged
# since the models were added; Cohere's ``rotate_half`` is the interleaved one despite its name.
LIBRARY_ROTATIONS: dict[str, str] = {
    **{f"transformers.models.{m}.modeling_{m}.rotate_half": "half" for m in (
        "llama", "gpt_neox", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
        "gemma3", "phi", "phi3", "falcon", "starcoder2", "stablelm", "olmo", "olmo2", "persimmon", "esm",
        "granite", "deepseek_v3", "idefics")},
    "transformers.models.cohere.modeling_cohere.rotate_half": "interleave",
    "transformers.models.gptj.modeling_gptj.rotate_every_two": "interleave",
    "transformers.models.codegen.modeling_codegen.rotate_every_two": "interleave",
    # lucidrains' rotary-embedding-torch: rearrange '... (d r) -> ... d r', stack((-x2, x1), -1), flatten back
    # (the same text in every release): adjacent pairs, the interleave rotation
    "rotary_embedding_torch.rotary_embedding_torch.rotate_half": "interleave",
}


def library_rotation(module: ModuleInfo, func: ast.AST | None) -> str | None:
    """``half`` / ``interleave`` for a call of a known library rotation helper (:data:`LIBRARY_ROTATIONS`)
    through this module's imports (``from transformers.models.llama.modeling_llama import rotate_half``,
    ``modeling_llama.rotate_half``), else None."""
    name = module.canonical(func) if func is not None else None
    return LIBRARY_ROTATIONS.get(name) if name else None


def filled_output(stmts: list[ast.stmt]) -> tuple[str, ast.expr] | None:
    """Three statements ``out = torch.empty_like(x); out[..., :h] = A; out[..., h:] = B`` (or the
    ``0::2`` / ``1::2`` lanes) as (``out``, the expression they leave in ``out``): ``torch.cat((A, B),
    dim=-1)`` or ``torch.stack((A, B), dim=-1).flatten(-2)``, the shapes of :func:`filled_halves`. The new
    wrapper nodes span the three statements (the allocation's value to the end of the second fill), so a
    caller may replace them with ``out = <new value>``; A and B are the original nodes, untouched (their
    positions stay theirs). A and B must not read ``out``. None otherwise."""
    if len(stmts) != 3:
        return None
    alloc, first, second = stmts
    if not (isinstance(alloc, ast.Assign) and len(alloc.targets) == 1 and isinstance(alloc.targets[0], ast.Name)
            and isinstance(alloc.value, ast.Call) and isinstance(alloc.value.func, ast.Attribute)
            and alloc.value.func.attr in ("empty_like", "zeros_like") and len(alloc.value.args) == 1 and not alloc.value.keywords):
        return None
    out = alloc.targets[0].id
    torch_mod = alloc.value.func.value
    parts: list[tuple[ast.Slice, ast.expr]] = []
    for st in (first, second):
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Subscript)):
            return None
        t = st.targets[0]
        if not (isinstance(t.value, ast.Name) and t.value.id == out and isinstance(t.slice, ast.Tuple) and len(t.slice.elts) == 2
                and isinstance(t.slice.elts[0], ast.Constant) and t.slice.elts[0].value is Ellipsis and isinstance(t.slice.elts[1], ast.Slice)):
            return None
        if any(isinstance(n, ast.Name) and n.id == out for n in ast.walk(st.value)):
            return None
        parts.append((t.slice.elts[1], st.value))
    (s1, a), (s2, b) = parts

    def const(n: ast.expr | None) -> object:
        return n.value if isinstance(n, ast.Constant) else (None if n is None else ...)

    def at(node: ast.AST) -> ast.AST:
        node.lineno, node.col_offset = alloc.value.lineno, alloc.value.col_offset  # type: ignore[attr-defined]
        node.end_lineno, node.end_col_offset = second.end_lineno, second.end_col_offset  # type: ignore[attr-defined]
        return node

    minus_one = ast.UnaryOp(op=ast.USub(), operand=ast.Constant(1))
    pair = at(ast.Tuple(elts=[a, b], ctx=ast.Load()))
    if s1.lower is None and s1.step is None and s1.upper is not None and s2.upper is None and s2.step is None \
            and s2.lower is not None and ast.dump(s1.upper) == ast.dump(s2.lower):
        expr = at(ast.Call(func=at(ast.Attribute(value=torch_mod, attr="cat", ctx=ast.Load())), args=[pair],
                           keywords=[ast.keyword(arg="dim", value=at(minus_one))]))
    elif const(s1.lower) in (None, 0) and const(s1.upper) is None and const(s1.step) == 2 \
            and const(s2.lower) == 1 and const(s2.upper) is None and const(s2.step) == 2:
        stacked = at(ast.Call(func=at(ast.Attribute(value=torch_mod, attr="stack", ctx=ast.Load())), args=[pair],
                              keywords=[ast.keyword(arg="dim", value=at(minus_one))]))
        expr = at(ast.Call(func=at(ast.Attribute(value=stacked, attr="flatten", ctx=ast.Load())),
                           args=[at(ast.UnaryOp(op=ast.USub(), operand=ast.Constant(2)))], keywords=[]))
    else:
        return None
    return out, expr  # type: ignore[return-value]


# --- moe (s26): per-group indexing with trailing full slices; host copies of a count tensor ---
_HOST_COPIES = ("cpu", "numpy", "tolist", "detach")


def leading_subscript(node: ast.AST | None) -> ast.AST | None:
    """``w[i, :, :]`` / ``x[a:b, :]`` / ``w[i, ...]`` read as ``w[i]`` / ``x[a:b]``: a subscript whose index is a
    tuple of one item followed only by full slices (``:``, no bounds or step) or one ``...`` selects the same
    elements as the first item alone (trailing dimensions are taken whole). Other nodes come back as they are.
    The new Subscript carries the original's position, so source segments of it stay the original text."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) >= 2):
        return node
    first, *rest = node.slice.elts
    if isinstance(first, ast.Starred) or isinstance(first, ast.Constant) and first.value is Ellipsis:
        return node
    ellipses = sum(1 for e in rest if isinstance(e, ast.Constant) and e.value is Ellipsis)
    if ellipses > 1 or not all(isinstance(e, ast.Slice) and e.lower is None and e.upper is None and e.step is None
                               or isinstance(e, ast.Constant) and e.value is Ellipsis for e in rest):
        return node
    return ast.copy_location(ast.Subscript(value=node.value, slice=first, ctx=node.ctx), node)


def host_copy_base(node: ast.AST | None) -> ast.AST | None:
    """``counts.cpu().numpy()`` / ``counts.tolist()`` / ``counts.detach().cpu()`` -> ``counts``: the tensor a
    chain of argument-free host copies starts from (the values are the same; only where they live differs).
    None when ``node`` is no such chain (at least one copy)."""
    hops = 0
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _HOST_COPIES \
            and not node.args and not node.keywords:
        node, hops = node.func.value, hops + 1
    return node if hops else None



# --- rope: a lane or half indexed out of a two-axis view (``xs[..., 0]`` of ``xs = x.reshape(.., -1, 2)``) ---
# The same lane as ``xs.unbind(-1)[0]``: authors index the pair axis directly (llama-style "manual complex"
# rotations, stacked q/k rotations). The view is often bound to the SAME name as the tensor it views
# (``qk = qk.reshape(*qk.shape[:-1], -1, 2)``): then the name no longer holds x where the lane is read,
# and the source is given as ``<view>.flatten(-2)`` (the inverse view: x's values, x's shape) so that a
# replacement reading the source at the use site reads x, not the pairs view.


def indexed_lane(module: ModuleInfo, scope: Scope, node: ast.expr, before_line: int | None = None) -> Lane | None:
    """Lane of ``<view>[..., k]`` (k in 0, 1) where ``<view>`` (inline or a name bound once before) views x's
    last dim as ``(D/2, 2)`` (the lane pairs, k = even/odd) or ``<view>[..., k, :]`` of a ``(2, D/2)`` view
    (the halves)."""
    if not isinstance(node, ast.Subscript) or not isinstance(node.slice, ast.Tuple):
        return None
    elts = node.slice.elts
    if not (elts and isinstance(elts[0], ast.Constant) and elts[0].value is Ellipsis):
        return None
    if len(elts) == 2:
        k, want = const_value(elts[1]), "inner2"
    elif len(elts) == 3 and isinstance(elts[2], ast.Slice) and elts[2].lower is None and elts[2].upper is None and elts[2].step is None:
        k, want = const_value(elts[1]), "outer2"
    else:
        return None
    if type(k) is not int or k not in (0, 1):
        return None
    held = node.value
    line = before_line if before_line is not None else getattr(node, "lineno", None)
    view_stmt = None
    if isinstance(held, ast.Name):
        # (a binding by the statement holding the lane itself, ``qk = stack([.. qk[..., 0] ..])``, comes after the read)
        binds = [(st, v) for st, v in scope.assignments.get(held.id, [])
                 if (line is None or st.lineno < line) and not st.lineno <= node.lineno <= (st.end_lineno or st.lineno)]
        if not binds:
            return None
        view_stmt, view = binds[-1]
    else:
        view = held
    got = _two_axes(module, view, scope)
    if got is None or got[1] != want:
        return None
    x = got[0]
    base, _casts = strip_casts(x)
    if isinstance(held, ast.Name) and view_stmt is not None and isinstance(base, ast.Name) and base.id == held.id:
        # ``qk = qk.reshape(.., -1, 2)``: at the use, the name holds the view; x is its flatten back
        if want == "outer2":
            return None  # (a (2, D/2) view flattened back is ``flatten(-2)`` too, but rare: not claimed)
        minus_two = ast.UnaryOp(op=ast.USub(), operand=ast.Constant(2))
        x = ast.Call(func=ast.Attribute(value=ast.Name(id=held.id, ctx=ast.Load()), attr="flatten", ctx=ast.Load()), args=[minus_two], keywords=[])
    elif isinstance(base, ast.Name) and view_stmt is not None and line is not None \
            and any(view_stmt.lineno <= st.lineno < line for st, _v in scope.assignments.get(base.id, [])):
        return None  # x's name is rebound between the view and the use: its text there is another tensor
    return Lane(x, k, "pairs" if want == "inner2" else "halves", "index")



# --- attention (s26): a numeric value folded from its spelling, whatever the spelling -------------
# A masking fill is a VALUE: ``-1e20``, ``float("-1e20")``, ``-1 * float("inf")``, ``-10 ** 9``,
# ``-math.inf``, ``th.finfo``-free constants all mean one number; a detector asks for the number
# and reasons about it (is it -inf? is it <= -1e4?) instead of matching the spelling.
from typing import Any  # noqa: E402  (this block's own import)
import re  # noqa: E402

_INF_NAMES = frozenset(("math.inf", "torch.inf", "numpy.inf", "numpy.Inf", "numpy.Infinity", "numpy.PINF"))
_NEG_INF_NAMES = frozenset(("numpy.NINF",))


def folded_number(module: ModuleInfo, node: ast.AST | None, unwrap: Callable[[Any], Any] | None = None,
                  depth: int = 0) -> float | int | None:
    """The number ``node`` evaluates to when it is built only from literals, ``float(<str or number>)``,
    ``int(<number>)``, the library infinities (``math.inf``, ``torch.inf``, ``np.inf`` through any import
    alias) and ``+ - * / // **`` on those; None for anything else (names, tensors, calls with effects).
    ``unwrap`` maps a detector's symbolic wrapper to the expression it stands for."""
    if depth > 12 or node is None:
        return None
    if unwrap is not None:
        node = unwrap(node)
    if isinstance(node, ast.Constant):
        v = node.value
        return v if type(v) in (int, float) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = folded_number(module, node.operand, unwrap, depth + 1)
        if v is None:
            return None
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, (ast.Name, ast.Attribute)):
        name = api(module, node) if isinstance(node, (ast.Name, ast.Attribute)) else None
        if name is None and isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            name = f"{node.value.id}.{node.attr}"
        if name in _INF_NAMES:
            return float("inf")
        if name in _NEG_INF_NAMES:
            return float("-inf")
        return None
    if isinstance(node, ast.Call) and len(node.args) <= 1 and not node.keywords:
        func = unwrap(node.func) if unwrap is not None else node.func
        fn = api(module, func) or (func.id if isinstance(func, ast.Name) else None)
        if fn not in ("float", "int"):
            return None
        if not node.args:
            return 0.0 if fn == "float" else 0
        arg = unwrap(node.args[0]) if unwrap is not None else node.args[0]
        if fn == "float" and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            try:
                return float(arg.value.strip())
            except ValueError:
                return None
        v = folded_number(module, arg, unwrap, depth + 1)
        if v is None:
            return None
        if fn == "int":
            return int(v) if v == v and abs(v) != float("inf") else None
        return float(v)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Pow)):
        a = folded_number(module, node.left, unwrap, depth + 1)
        b = folded_number(module, node.right, unwrap, depth + 1)
        if a is None or b is None:
            return None
        try:
            if isinstance(node.op, ast.Pow):
                if abs(b) > 400 or abs(a) > 1e6:
                    return None  # no huge integer powers: a fill is a magnitude, not a big-number workload
                return a ** b if not (isinstance(a, int) and isinstance(b, int) and b < 0) else float(a) ** b
            return {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b,
                    ast.Div: lambda: a / b, ast.FloorDiv: lambda: a // b}[type(node.op)]()
        except (ZeroDivisionError, OverflowError, ValueError, TypeError):
            return None
    return None


def module_constant(module: ModuleInfo, name: str) -> ast.expr | None:
    """The expression a module-level name is bound to when the module binds it exactly once, by a plain
    top-level assignment (``NEG_INF = -1e9``, ``INF = float("inf")``), and no function rebinds it through
    ``global``; else None. Folding it gives the value every function of the module reads."""
    table = module.__dict__.get("_npufuse_module_constants")
    if table is None:
        counts: dict[str, int] = {}
        values: dict[str, ast.expr] = {}
        for st in module.tree.body:
            targets: list[ast.expr] = []
            if isinstance(st, ast.Assign):
                targets = st.targets
            elif isinstance(st, (ast.AnnAssign, ast.AugAssign)):
                targets = [st.target]
            elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                counts[st.name] = counts.get(st.name, 0) + 1
                continue
            elif isinstance(st, (ast.Import, ast.ImportFrom)):
                for a in st.names:
                    n = (a.asname or a.name).split(".")[0]
                    counts[n] = counts.get(n, 0) + 1
                continue
            elif not isinstance(st, ast.Expr):
                # a name bound inside if/for/try/with at module level: not a single plain binding
                for n in ast.walk(st):
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                        counts[n.id] = counts.get(n.id, 0) + 2
                continue
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        counts[n.id] = counts.get(n.id, 0) + 1
                if isinstance(t, ast.Name) and isinstance(st, (ast.Assign, ast.AnnAssign)) and st.value is not None:
                    values[t.id] = st.value
        table = {k: v for k, v in values.items() if counts.get(k) == 1 and f"global {k}" not in module.source
                 and not re.search(r"\bglobal\b[^\n]*\b" + re.escape(k) + r"\b", module.source)}
        module.__dict__["_npufuse_module_constants"] = table
    return table.get(name)


# --- s28 attention ---
# Callables that compute exactly ``torch.einsum(equation, a, b)`` for torch tensors with an explicit
# output: opt_einsum's ``contract`` (its torch backend runs torch.einsum / tensordot on the same
# equation; protein-structure code imports it as ``einsum``). Read by :func:`product`.
EINSUM_EQUIVALENTS = frozenset({"opt_einsum.contract"})


# --- s33 attention: a softmax written as a function or module of the repository ---
# CS336-style code writes its own ``softmax(x, dim)`` (``e = exp(x - x.amax(dim, keepdim=True)); e / e.sum(dim,
# keepdim=True)``), fairseq-style code wraps torch's (``F.softmax(x, dim=dim, dtype=torch.float32)``, one branch
# per ``onnx_trace`` flag), OpenFold's ``softmax_no_cast`` runs it with autocast off. :func:`softmax_body` reads such
# a body as "softmax of parameter X over dim D" or says nothing.


@dataclass(frozen=True)
class SoftmaxBody:
    """A function body proven to return ``softmax(<input>, dim)``: ``input`` the parameter it normalises,
    ``dim`` where the axis comes from (``("param", name)``, ``("self", attr)`` or ``("const", value)``),
    ``float32`` when the result is float32 whatever the input dtype (``dtype=torch.float32``, ``x.float()``)."""

    input: str
    dim: tuple
    float32: bool


def _file_aliases(tree: ast.Module) -> dict[str, str]:
    """{local name: dotted torch name} for the module-level imports of ``tree`` that bind a torch module or function."""
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


# decorators under which an eager call runs the body as written
# s43: ``staticmethod`` too (a softmax written as a static method of a helper class, called ``Ops.softmax(x, dim)``)
_EAGER_IDENTITY_DECORATORS = {"torch.jit.ignore", "torch.jit.unused", "torch.jit.script", "torch.compiler.disable", "torch._dynamo.disable",
                              "staticmethod"}
_SB_F32 = {"torch.float32", "torch.float"}


def softmax_body(fn: ast.AST | None, tree: ast.Module) -> SoftmaxBody | None:
    """What ``fn`` (a function of ``tree``, or a module's ``forward(self, x)``) returns, when every path returns the
    softmax of one parameter over one axis (a parameter, ``self.<attr>`` or a constant), written as torch's softmax
    (``F.softmax`` / ``torch.softmax`` / ``x.softmax``) or as ``exp(x - max(x, d, keepdim=True)) / sum(.., d,
    keepdim=True)`` (``amax`` / ``max(..)[0]`` / ``.values``; ``exp_`` and ``/=`` in place on a fresh tensor) or
    ``exp(x - logsumexp(x, d, keepdim=True))``; casts to float32 and back to the input's dtype allowed, branches on
    anything but changes of the input, ``with ..autocast(..)`` blocks. None for anything else: the unstable
    ``exp(x) / exp(x).sum()`` (inf where torch's softmax is finite), a temperature, a mask, an in-place change
    of the input, a reduction without ``keepdim``."""
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    names = _file_aliases(tree)
    for dec in fn.decorator_list:
        # ``@torch.jit.ignore`` (OpenFold's softmax_no_cast) and the like leave the eager call as written
        written = dotted(dec.func if isinstance(dec, ast.Call) else dec) or ""
        head, _, rest = written.partition(".")
        if not written or names.get(head, head) + ("." + rest if rest else "") not in _EAGER_IDENTITY_DECORATORS:
            from npufuse.patterns import _attention_s47h  # s47: AMP's custom_fwd (no cast, or a float32 cast)

            if not _attention_s47h.keeps_softmax(dec, names):
                return None
    a = fn.args
    params = [p.arg for p in (*a.posonlyargs, *a.args)]
    method = bool(params) and params[0] == "self"
    data = params[1:] if method else params
    if not data or a.vararg or a.kwarg:
        return None
    x = data[0]
    IN = ("in",)

    def api_of(f: ast.AST) -> str | None:
        parts: list[str] = []
        while isinstance(f, ast.Attribute):
            parts.append(f.attr)
            f = f.value
        if not isinstance(f, ast.Name) or f.id not in names:
            return None
        return ".".join([names[f.id], *reversed(parts)]).replace("torch.nn.functional.functional", "torch.nn.functional")

    def dim_ref(node: ast.AST | None) -> tuple | None:
        if isinstance(node, ast.Name) and node.id in data[1:]:
            return ("param", node.id)
        if method and isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return ("self", node.attr)
        v = const_value(node) if node is not None else None
        return ("const", v) if isinstance(v, int) and not isinstance(v, bool) else None

    def kw(call: ast.Call, name: str, pos: int) -> ast.AST | None:
        for k in call.keywords:
            if k.arg == name:
                return k.value
        return call.args[pos] if len(call.args) > pos else None

    def keepdim(call: ast.Call, pos: int) -> bool:
        return const_value(kw(call, "keepdim", pos)) is True

    def is_f32(node: ast.AST | None) -> bool:
        return node is not None and api_of(node) in _SB_F32

    # a value: (term, float32, fresh): term a tuple, float32 its dtype is float32, fresh a tensor this body made
    env: dict[str, tuple] = {x: (IN, False, False)}

    def ev(node: ast.AST) -> tuple | None:
        if isinstance(node, ast.Name):
            return env.get(node.id)
        if isinstance(node, ast.Subscript):
            # ``x.max(d, keepdim=True)[0]``
            inner = ev(node.value) if isinstance(node.value, ast.Call) else None
            if inner is not None and inner[0][0] == "maxpair" and const_value(node.slice) == 0:
                return (("max",) + inner[0][1:], inner[1], True)
            return None
        if isinstance(node, ast.Attribute):
            inner = ev(node.value)
            if inner is not None and inner[0][0] == "maxpair" and node.attr == "values":
                return (("max",) + inner[0][1:], inner[1], True)
            return None
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Sub, ast.Div)):
            left, right = ev(node.left), ev(node.right)
            if left is None or right is None:
                return None
            return (("sub" if isinstance(node.op, ast.Sub) else "div", left[0], right[0]), left[1] or right[1], True)
        if not isinstance(node, ast.Call):
            return None
        f = node.func
        name = api_of(f)
        if name is not None:
            # torch.<fn>(t, ...)
            if not node.args:
                return None
            t = ev(node.args[0])
            op, call = name.rpartition(".")[2], ast.Call(func=f, args=node.args[1:], keywords=node.keywords)
        elif isinstance(f, ast.Attribute):
            t = ev(f.value)
            op, call = f.attr, node
        else:
            return None
        if t is None:
            return None
        term, f32, fresh = t
        if name is not None and name.rpartition(".")[0] not in ("torch", "torch.nn.functional", "torch.special"):
            return None
        if op in ("float",) and not call.args and not call.keywords:
            return (term, True, fresh)
        if op in ("to", "type") and len(call.args) + len(call.keywords) == 1:
            target = call.args[0] if call.args else call.keywords[0].value
            if call.keywords and call.keywords[0].arg != "dtype":
                return None
            if is_f32(target):
                return (term, True, fresh)
            back = ev(target.value) if isinstance(target, ast.Attribute) and target.attr == "dtype" else None
            if back is None and isinstance(target, ast.Name) and target.id in env and env[target.id][0] == ("dtype",):
                back = (IN, False, False)
            if back is not None and back[0] == IN and not back[1]:
                return (term, False, fresh)
            return None
        if op == "type_as" and len(call.args) == 1 and not call.keywords:
            other = ev(call.args[0])
            return (term, False, fresh) if other is not None and other[0] == IN and not other[1] else None
        if op in ("detach", "contiguous") and not call.args and not call.keywords:
            return t
        if op in ("amax", "max"):
            # keepdim=True is required: ``max`` is then the reduction (values, indices), never the elementwise max
            d = dim_ref(kw(call, "dim", 0))
            if d is None or not keepdim(call, 1):
                return None
            return (("max" if op == "amax" else "maxpair", term, d), f32, True)
        if op == "sum" or op == "logsumexp":
            d = dim_ref(kw(call, "dim", 0))
            if d is None or not keepdim(call, 1) or any(k.arg == "dtype" for k in call.keywords):
                return None
            return (("sum" if op == "sum" else "lse", term, d), f32, True)
        if op == "exp" and not call.args and not call.keywords:
            return (("exp", term), f32, True)
        if op == "softmax":
            d = dim_ref(kw(call, "dim", 0))
            dt = kw(call, "dtype", 1)
            if d is None or len(call.args) + len(call.keywords) > 2:
                return None
            if dt is not None and not is_f32(dt):
                return None
            return (("softmax", term, d), f32 or dt is not None, True)
        return None

    returns: list[tuple] = []

    def run(body: list[ast.stmt]) -> str:
        """Interpret ``body``: "ret" when it returns on every path, "fall" when it runs off its end, "bad" where a
        statement is not read. Returned values collect into ``returns``."""
        for st in body:
            if isinstance(st, ast.Expr) and isinstance(const_value(st.value), str) or isinstance(st, (ast.Pass, ast.Assert)):
                continue
            if isinstance(st, ast.Return):
                v = ev(st.value) if st.value is not None else None
                if v is None:
                    return "bad"
                returns.append(v)
                return "ret"
            if isinstance(st, (ast.Expr, ast.Assign)) and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Attribute) \
                    and st.value.func.attr == "exp_" and isinstance(st.value.func.value, ast.Name) and not st.value.args \
                    and (isinstance(st, ast.Expr) or len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)):
                # ``y.exp_()`` / ``y = y.exp_()``: in place, so only on a tensor this body made
                old = env.get(st.value.func.value.id)
                if old is None or not old[2]:
                    return "bad"
                for k in [k for k, v in env.items() if v is old]:
                    env[k] = None
                new = (("exp", old[0]), old[1], True)
                env[st.value.func.value.id] = new
                if isinstance(st, ast.Assign):
                    env[st.targets[0].id] = new
                continue
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                value = st.value
                if isinstance(value, ast.Attribute) and value.attr == "dtype" and isinstance(value.value, ast.Name) and value.value.id == x:
                    env[st.targets[0].id] = (("dtype",), False, False)  # ``in_type = x.dtype``, for the cast back
                    continue
                v = ev(value)
                if v is None and _flag_value(value, env):
                    v = (("flag",), False, False)  # ``on = deepspeed_is_installed and comm.is_initialized()``: for tests only
                if v is None:
                    return "bad"
                env[st.targets[0].id] = v
                continue
            if isinstance(st, ast.AugAssign) and isinstance(st.target, ast.Name) and isinstance(st.op, ast.Div):
                old, right = env.get(st.target.id), ev(st.value)
                if old is None or right is None or not old[2]:
                    return "bad"  # in place on the caller's tensor (or on something unread)
                for k in [k for k, v in env.items() if v is old]:
                    env[k] = None  # other names of the same tensor: changed too, no longer read
                env[st.target.id] = (("div", old[0], right[0]), old[1] or right[1], True)
                continue
            if isinstance(st, ast.With) and all(isinstance(i.context_expr, ast.Call) and (dotted(i.context_expr.func) or "").endswith("autocast")
                                                 and i.optional_vars is None for i in st.items):
                got = run(st.body)
                if got != "fall":
                    return got
                continue
            if isinstance(st, ast.If):
                # a flag: whichever side runs must give the same value (checked on the returns and the names after);
                # a test with a call other than a predicate might change something
                if any(isinstance(n, ast.Call) and not (dotted(n.func) or "").rpartition(".")[2].startswith(("is_", "isinstance", "hasattr"))
                       for n in ast.walk(st.test)) or any(isinstance(n, ast.NamedExpr) for n in ast.walk(st.test)):
                    return "bad"
                saved = dict(env)
                got_body = run(st.body)
                body_env = dict(env)
                env.clear()
                env.update(saved)
                got_else = run(st.orelse)
                if "bad" in (got_body, got_else):
                    return "bad"
                if got_body == got_else == "ret":
                    return "ret"
                if got_else == "ret":
                    env.clear()
                    env.update(body_env)
                elif got_body == "fall":
                    for k in set(body_env) | set(env):
                        if body_env.get(k) != env.get(k):
                            env[k] = None  # differs by side: not read after the if
                continue
            return "bad"
        return "fall"

    if run(list(fn.body)) != "ret" or not returns:
        return None
    first = returns[0]
    if any(r[0] != first[0] or r[1] != first[1] for r in returns):
        return None
    term = first[0]
    if term[0] == "softmax" and term[1] == IN:
        return SoftmaxBody(x, term[2], first[1])
    if term[0] == "div" and term[2][0] == "sum" and term[1] == term[2][1]:
        e, d = term[1], term[2][2]
        if e[0] == "exp" and e[1][0] == "sub" and e[1][1] == IN and e[1][2] == ("max", IN, d):
            return SoftmaxBody(x, d, first[1])
    if term[0] == "exp" and term[1][0] == "sub" and term[1][1] == IN and term[1][2][0] == "lse" and term[1][2][1] == IN:
        return SoftmaxBody(x, term[1][2][2], first[1])
    return None


def _flag_value(value: ast.AST, env: dict) -> bool:
    """A value that is no tensor of the body: names other than the body's tensors, constants, attributes, boolean
    logic and comparisons, calls of predicates (``is_initialized()``) only."""
    for n in ast.walk(value):
        if isinstance(n, ast.Name) and n.id in env:
            return False
        if isinstance(n, ast.Call) and not (dotted(n.func) or "").rpartition(".")[2].startswith(("is_", "isinstance", "hasattr")):
            return False
        if not isinstance(n, (ast.Name, ast.Attribute, ast.Constant, ast.BoolOp, ast.UnaryOp, ast.Compare, ast.Call, ast.Load,
                              ast.boolop, ast.unaryop, ast.cmpop)):
            return False
    return True



# --- rope (s35): a tensor's last dim seen as two axes, for callers outside this module ---


def two_axis_view(module: ModuleInfo, node: ast.expr, scope: Scope | None = None) -> tuple[ast.expr, str] | None:
    """(x, "outer2" | "inner2") when ``node`` views x's last dim D as two axes, the 2 outer (``(2, D/2)``: the
    halves, LTX-2's ``rearrange(x, "... (d r) -> ... d r", d=2)``) or inner (``(D/2, 2)``: the lane pairs);
    the spellings :func:`_two_axes` reads (unflatten, view / reshape of ``*x.shape[:-1]``, einops)."""
    return _two_axes(module, node, scope)
