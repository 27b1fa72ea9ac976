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
        return None
    if isinstance(f, ast.Attribute) and f.attr in ("view", "reshape") and len(node.args) >= 3 and scope is not None:
        # OLMo: ``B, nh, T, hs = x.size(); x.view(B, nh, T, 2, hs // 2)``: x's own dims, the last one cut in two
        return _explicit_two_axes(scope, node, f.value)
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


def _explicit_two_axes(scope: Scope, view: ast.Call, x: ast.expr) -> tuple[ast.expr, str] | None:
    """``x.view(d0, .., dk-1, 2, dk // 2)`` (or ``dk // 2, 2``) with ``d0, .., dk = x.size()`` unpacked
    in this scope: (x, "outer2" | "inner2")."""
    *lead, a, b = view.args
    names = []
    unpack = None
    for i, arg in enumerate(lead):
        if not isinstance(arg, ast.Name):
            return None
        binds = [(st, v) for st, v in scope.assignments.get(arg.id, []) if st.lineno < view.lineno]
        if not binds:
            return None
        st, v = binds[-1]
        if not (isinstance(v, ast.Subscript) and const_value(v.slice) == i and _size_of(v.value, x)):
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
    last = elts[-1].id

    def half_of_last(e: ast.expr) -> bool:
        return const_value(e) == -1 or (isinstance(e, ast.BinOp) and isinstance(e.op, ast.FloorDiv)
                                        and isinstance(e.left, ast.Name) and e.left.id == last and const_value(e.right) == 2)
    if const_value(a) == 2 and half_of_last(b):
        return x, "outer2"
    if const_value(b) == 2 and half_of_last(a):
        return x, "inner2"
    return None


def _size_of(node: ast.expr, x: ast.expr) -> bool:
    """``x.size()`` / ``x.shape``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size" and not node.args:
        return same(node.func.value, x)
    return isinstance(node, ast.Attribute) and node.attr == "shape" and same(node.value, x)


def _unbound_lanes(module: ModuleInfo, scope: Scope, call: ast.expr) -> tuple[ast.expr, str, str] | None:
    """(x, kind, spelling) for ``<two-axis view of x>.unbind(axis)`` unbinding the 2-sized axis (the
    view inline or bound to a name first, as rotary-embedding-torch's ``x = rearrange(...)`` does)."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "unbind"):
        return None
    dim = call.args[0] if call.args else _kw(call, "dim")
    receiver = call.func.value
    if isinstance(receiver, ast.Name):
        receiver = scope.resolve(receiver, getattr(call, "lineno", None), depth=1)
    view = _two_axes(module, receiver, scope)
    if view is None:
        return None
    x, how = view
    if how == "outer2" and const_value(dim) == -2:
        return x, "halves", "unbind"
    if how == "inner2" and const_value(dim) == -1:
        return x, "pairs", "unbind"
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
            if inner is not None and (stmt is None or _unpacks_two(stmt) or not isinstance(stmt, ast.Assign)
                                      or not isinstance(stmt.targets[0], ast.Tuple)):
                return Lane(inner[0], k, inner[1], inner[2])
    if stmt is not None and isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple):
        inner = _unbound_lanes(module, scope, value)
        elts = stmt.targets[0].elts
        if inner is not None and len(elts) == 2:
            idx = next((i for i, e in enumerate(elts) if isinstance(e, ast.Name) and e.id == node.id), None)  # type: ignore[attr-defined]
            if idx is not None:
                return Lane(inner[0], idx, inner[1], inner[2])
    # chunk / split / slices (and unbind of a 2-wide last dim, whose halves are its two lanes) — after the
    # views above, which name the tensor before the view
    h = half_of(module, scope, node, before_line)
    if h is not None:
        return Lane(h.source, h.index, "halves", h.spelling)
    return None
