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
    if name == "torch.einsum":
        if len(node.args) == 3:
            a, b = node.args[1], node.args[2]
        elif len(node.args) == 2 and isinstance(node.args[1], (ast.List, ast.Tuple)) and len(node.args[1].elts) == 2 \
                and not any(isinstance(e, ast.Starred) for e in node.args[1].elts):
            a, b = node.args[1].elts  # CvT: einsum(spec, [q, k])
        else:
            return None
        return Product(a, b, "einsum", contraction(einsum_subscripts(node.args[0])), spec=node.args[0])
    if name == "torch.baddbmm" and len(node.args) == 3 and const_value(_kw(node, "beta")) in (0, 0.0):
        return Product(node.args[1], node.args[2], "baddbmm", alpha=_kw(node, "alpha"))
    if isinstance(node.func, ast.Attribute) and name not in MATMUL_NAMES + ("torch.einsum", "torch.baddbmm"):
        attr = node.func.attr
        if attr in ("matmul", "bmm") and len(node.args) == 1 and not node.keywords:
            return Product(node.func.value, node.args[0], attr)
        if attr == "baddbmm" and len(node.args) == 2 and const_value(_kw(node, "beta")) in (0, 0.0):
            return Product(node.args[0], node.args[1], "baddbmm", alpha=_kw(node, "alpha"))
    return None


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
