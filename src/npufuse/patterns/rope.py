"""rope: rotary position embedding written out by hand -> ``torch_npu.npu_rotary_mul``.

Three spellings compute the same rotation (spec §4.1):

* **half** (GPT-NeoX / HF Llama): ``t*cos + rotate_half(t)*sin`` with
  ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])`` (slicing or chunk), cos/sin ``cat(freqs, freqs)``;
* **interleave** (GPT-J ``rotate_every_two``, Cohere): ``stack(-x[..., 1::2], x[..., ::2], -1).flatten(-2)``,
  cos/sin ``repeat_interleave(2)``;
* **complex** (Meta's reference llama): ``view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) * freqs_cis)``,
  which is the interleave rotation with ``cos = freqs_cis.real.repeat_interleave(2)`` and
  ``sin = freqs_cis.imag.repeat_interleave(2)``.

The rotation helper is followed into its definition in the same module and verified, never
trusted by name: a ``rotate_half`` with the sign on the other half rotates the other way and is
a near miss. The site is the statement(s) holding the expression; the fused statement keeps
everything around it (``torch.cat([<rope>, q_pass], -1)`` of partial rotary, ``.to(dtype)``, a
``return``) byte for byte, so live-outs are the original names by construction.
"""

from __future__ import annotations

import ast
import contextvars
import copy
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Iterable


from npufuse.patterns import _library_rope, _rope_s43, _rope_s44sweep, _rope_s45sweep, _rope_s46h, _rope_s47h, _rope_s47sweep
from npufuse.patterns import _rope_s48r, _rope_s49m
from npufuse.patterns import _rope_s51m
from npufuse.patterns._rope_s44audit import flatten3_rank_condition
from npufuse.patterns._site import is_last_dim_expr
from npufuse.patterns._site import scope_text as _site_scope_text
from npufuse.scan import canonical
from npufuse.patterns.base import Finding, Fuse, Keep, NearMiss, Pattern, Result, Risk
from npufuse.scan.dataflow import ModuleInfo, Scope, bound_names, child_nodes, const_value, dotted, fast_walk, keyword, replace_segments, same_expr, scope_text, segment, strip_casts
from npufuse.scan.value import estimate, symbolic

_NEG_CALLS = {"torch.neg", "torch.negative"}
_CAT = {"torch.cat", "torch.concat", "torch.concatenate"}
_BATCH_REASON = "interleave mode with cos/sin that may depend on the batch"
_STACK = {"torch.stack"}
_PAIR_LAST_NAMES = frozenset(n.rpartition(".")[2] for n in _CAT | _STACK)  # _pair_of's gate
_DTYPE_NAMES = {
    "torch.float32": "float32", "torch.float": "float32", "torch.float16": "float16", "torch.half": "float16",
    "torch.bfloat16": "bfloat16", "torch.float64": "float64", "torch.double": "float64",
}
_CAST_TOKENS = {"float": "float32", "half": "float16", "bfloat16": "bfloat16", "double": "float64"}
# npu_rotary_mul: D even and < 896 (spec §4.1)
_MAX_D = 896


# -- small AST helpers -------------------------------------------------------------------------
def _resolve(scope: Scope, node: ast.expr) -> ast.expr:
    """Follow a Name through local assignments, including ``a, b = x, y`` tuple unpacking."""
    for _ in range(12):
        if isinstance(node, ast.Name):
            value = scope.definition(node.id, getattr(node, "lineno", None))
            if value is None:
                return node
            node = _rope_s51m.filled_partner(scope, node, value) or value  # s51: `r = empty_like(x)` + two lane fills
            continue
        # ``a, b = (x, y)`` is recorded as Subscript(Tuple, k): pick the element
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, (ast.Tuple, ast.List))
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, int)
            and node.slice.value < len(node.value.elts)
        ):
            node = node.value.elts[node.slice.value]
            continue
        return node
    return node


def _is_int(node: ast.AST | None, *values: int) -> bool:
    v = const_value(node)
    return isinstance(v, int) and not isinstance(v, bool) and v in values


def _method(node: ast.AST, *names: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names


def _atom(text: str) -> str:
    """Parenthesise ``text`` unless it is already an atom (name, attribute, call, subscript)."""
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return f"({text})"
    if isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)):
        return text
    return f"({text})"


def _ident(text: str) -> str:
    """A readable identifier fragment for a temp name derived from an expression."""
    out = "".join(c if c.isalnum() else "_" for c in text).strip("_")
    while "__" in out:
        out = out.replace("__", "_")
    return (out or "x")[:24]


def _dtype_token(scope: Scope, node: ast.expr, depth: int = 4) -> str | None:
    """The dtype an expression statically has, when a cast says so (``.float()``, ``.to(torch.bfloat16)``,
    ``.to(x.dtype)`` -> "like:x"); None when unknown."""
    if depth == 0:
        return None
    node = _resolve(scope, node)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        attr = node.func.attr
        if attr in _CAST_TOKENS and not node.args:
            return _CAST_TOKENS[attr]
        if attr in ("to", "type"):
            arg = keyword(node, "dtype", 0)
            if arg is not None:
                name = ast.unparse(arg)
                if name in _DTYPE_NAMES:
                    return _DTYPE_NAMES[name]
                if isinstance(arg, ast.Attribute) and arg.attr == "dtype":
                    return "like:" + ast.unparse(arg.value)
        if attr == "type_as" and node.args:
            return "like:" + ast.unparse(node.args[0])
        if attr in ("contiguous", "unsqueeze", "squeeze", "view", "reshape", "transpose", "permute", "expand", "repeat_interleave", "flatten"):
            return _dtype_token(scope, node.func.value, depth - 1)
    if isinstance(node, ast.Subscript):
        return _dtype_token(scope, node.value, depth - 1)
    return None


# -- the rotation helper ---------------------------------------------------------------------------
@dataclass
class _Rotation:
    kind: str | None  # "half" | "interleave" | None (not a rotation)
    reason: str = ""  # why it is not the standard one (near miss), empty when it simply isn't one
    name: str = ""  # helper name for the report
    # a helper chosen at run time (``rotate_fn = rotate_half if neox else rotate_every_two``): the
    # rotary_mode expression choosing between the two verified kinds
    mode_expr: str | None = None
    half_if: str | None = None  # the condition under which the chosen helper is rotate_half
    # a helper with one verified return path of two (chosen by a flag): fused only where this holds
    only_if: str | None = None
    other: str = ""  # why the other path keeps the original code
    upcast: bool = False  # the helper rotates x.float(): its result is fp32 whatever x's dtype
    # verified on its ``if x.dim() == 4:`` branch only (ModelCenter's rank-sliced rotate_every_two): fused
    # where the rotated tensor is 4-D, the test written with the call's argument by _rotation_call
    rank4_only: bool = False
    # halves cut at a split point that is not provably D/2 (``t[..., : self.dim // 2]``): fused only where
    # ``{x}.shape[-1] == 2 * (split)`` holds at run time ({x}: the call's argument, written by _rotation_call)
    split_only_if: str | None = None
    # the rotation is a name bound on a branch of stable ``if`` tests (bert4torch's ``if rank == 'adjacent':
    # x2 = <pairs> elif ...: x2 = <halves>``): the path condition of the binding that reaches the site
    path_if: str | None = None
    # the helper verified for an even last dim (its odd-dim branch pruned): ``only_if`` tests x alone
    # (``x.shape[-1] % 2 == 0``), so it combines with the interleave run-time table check like rank4_only
    x_only: bool = False


def _helper_def(module: ModuleInfo, scope: Scope, func: ast.expr) -> tuple[ast.FunctionDef | None, str]:
    """The definition of a called helper: a module function, or ``self.f`` / ``Cls.f`` in this class."""
    if isinstance(func, ast.Name):
        nested = _nested_def(scope, func)
        if nested is not None:
            return nested, func.id
        fn = module.helper(func.id)
        if fn is not None:
            return fn, func.id
        origin = module.aliases.get(func.id)
        return None, f"{func.id}" + (f" (imported from {origin.rsplit('.', 1)[0]})" if origin else "")
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        cls = _enclosing_class(module, scope) if func.value.id == "self" else module.classes.get(func.value.id)
        # the class's own method, else the first one its in-module bases define (depth-first, left to right:
        # Python's lookup order for single inheritance and simple mixins)
        todo, seen = [cls] if cls is not None else [], set()
        while todo:
            c = todo.pop(0)
            if id(c) in seen or len(seen) > 8:
                continue
            seen.add(id(c))
            for node in c.body:
                if isinstance(node, ast.FunctionDef) and node.name == func.attr:
                    return node, f"{c.name}.{func.attr}"
            todo = [b for b in (module.classes.get(base.id) for base in c.bases if isinstance(base, ast.Name)) if b is not None] + todo
    return None, ast.unparse(func)


def _conditional_tests(module: ModuleInfo, items: list[tuple[int, ast.stmt, list["_Match"]]]) -> list[str]:
    """The tests of the conditional expressions a matched rotation sits in, as written (``(t)`` where it is
    in the body, ``not (t)`` in the orelse), each once, in order."""
    out: list[str] = []
    for _i, stmt, matches in items:
        value = getattr(stmt, "value", None)
        if not matches or value is None:
            continue
        nodes = {id(m.node) for m in matches}
        for cond in fast_walk(value):
            if not isinstance(cond, ast.IfExp):
                continue
            for side, fmt in ((cond.body, "({})"), (cond.orelse, "not ({})")):
                if any(id(n) in nodes for n in fast_walk(side)):
                    text = fmt.format(segment(module, cond.test))
                    if text not in out:
                        out.append(text)
    return out


def _module_classes(module: ModuleInfo) -> list[ast.ClassDef]:
    """Every class the module defines at its top level or in its ``if``/``try`` blocks, each definition of a
    name (``module.classes`` keeps the first: Pointcept's ``PointROPE`` is the CUDA wrapper under ``try:``
    and the PyTorch fallback under ``except``), in ``ast.walk`` order. Cached per module. A class is a
    statement: the module's index gathers them in its walk of the statements."""
    return module.all_classes


def _enclosing_class(module: ModuleInfo, scope: Scope) -> ast.ClassDef | None:
    """The class definition whose body holds the method of ``scope`` (``self``'s class there), or the
    module's class of that name."""
    if not scope.class_name:
        return None
    first = module.classes.get(scope.class_name)
    if first is not None and any(n is scope.node for n in first.body):
        return first
    for cls in _module_classes(module):
        if cls.name == scope.class_name and any(n is scope.node for n in cls.body):
            return cls
    return first


def _nested_def(scope: Scope, func: ast.Name) -> ast.FunctionDef | None:
    """minimind: ``def rotate_half(x): ...`` written inside the calling function, before the call (the
    name's binding there wins over a module-level one). Only a def in the function's own body
    statements (not under an if/loop, where it may not be the binding the call sees)."""
    body = getattr(scope.node, "body", None)
    if not isinstance(body, list):
        return None
    found = None
    for st in body:
        if st.lineno >= func.lineno:
            break
        if isinstance(st, ast.FunctionDef) and st.name == func.id:
            found = st
        elif func.id in scope.assignments and any(b.lineno == st.lineno for b, _v in scope.assignments[func.id]):
            found = None  # rebound to something else after the def
    return found


def _is_name(text: str) -> bool:
    return text.isidentifier() or all(part.isidentifier() for part in text.split("."))


def _block_text(module: ModuleInfo, stmts: list[ast.stmt]) -> str:
    """Verbatim source of consecutive statements, dedented (the original code of a span)."""
    import textwrap

    lines = module.lines[stmts[0].lineno - 1 : stmts[-1].end_lineno or stmts[-1].lineno]
    return textwrap.dedent("".join(lines).replace("\r\n", "\n").replace("\r", "\n")).rstrip("\n")


def _scope_of(module: ModuleInfo, fn: ast.AST) -> Scope | None:
    for s in module.scopes:
        if s.node is fn:
            return s
    return None


def _add_split_checks(m: "_Match", halves: _Halves) -> None:
    """Halves cut at a run-time split point: fused only where it is x's last dim // 2, or, for the halves of
    a rotated prefix ``x[..., :u]`` (``_Halves.prefix``), where it is u // 2 and x is at least u wide: the
    fused call then rotates that prefix (bound to a name inside the fused branch)."""
    if not halves.split_checks:
        return
    checks = list(halves.split_checks)
    if halves.prefix is not None:
        x_src, upper = halves.prefix
        xa = _atom(x_src)
        first_cut = f"{xa}.shape[-1] == 2 * ("
        if not halves.prefix_lanes and not any(c.startswith(first_cut) for c in checks):
            checks.append(f"{xa}.shape[-1] == ({upper})")  # the first half is x's own half: u is x's last dim
        checks = [f"({upper}) == 2 * (" + c[len(first_cut):] if c.startswith(first_cut) else c for c in checks]
        checks.append(f"{xa}.shape[-1] >= ({upper})")
        rotated = f"_npufuse_{_ident(x_src)}_rotated"
        bind = f"{rotated} = {m.x_text}[..., :{upper}]  # the rotated prefix whose halves the original cuts"
        (m.inner_prep if m.anchor is not None else m.prep).append(bind)
        m.x_text, m.rotary_dim = rotated, upper
    checks = list(dict.fromkeys(checks))
    check = " and ".join(checks)
    m.only_if = check if m.only_if is None else f"({m.only_if}) and {check}"
    m.only_note = (m.only_note + "; " if m.only_note else "") + (
        "lanes of a rotated prefix `[..., :u]`: fused where u is even and x at least u wide" if halves.prefix_lanes
        else "halves cut at a run-time split point: fused where it is half the last dim")


def _bounded_lane_source(scope: Scope, node: ast.expr) -> ast.expr | None:
    """x of ``x[..., :u:2]`` / ``x[..., 1:u:2]`` (a name bound to it, possibly through a tuple unpacking):
    strided lanes with an upper bound, the lanes of the prefix ``x[..., :u]`` (the canonical layer reads
    only the unbounded ``x[..., ::2]``)."""
    value = _resolve(scope, node)
    if not isinstance(value, ast.Subscript):
        return None
    sl = _Halves(scope, lambda n: True)._last_dim_slice(value)
    if sl is None or sl.upper is None or not _is_int(sl.step, 2) or not (sl.lower is None or _is_int(sl.lower, 0, 1)):
        return None
    return value.value


def _split_point(scope: Scope, h: ast.expr) -> bool:
    """An int-valued split point safe to re-read where the fused code runs: names (bound at most
    once in the scope), attributes, constants, arithmetic, ``.shape[i]`` / ``.size(i)``."""
    for n in ast.walk(h):
        if isinstance(n, ast.Name):
            if len(scope.assignments.get(n.id, [])) > 1:
                return False
        elif isinstance(n, ast.Call):
            if not (_method(n, "size") and len(n.args) <= 1 and not n.keywords):
                return False
        elif not isinstance(n, (ast.Attribute, ast.Constant, ast.BinOp, ast.UnaryOp, ast.Subscript, ast.Load, ast.operator,
                                ast.unaryop)):
            return False
    c = const_value(h)
    return not isinstance(c, (int, float))  # a literal split is the head dim's own business: left to _is_half_point


class _Halves:
    """Recognises the two halves (or the even/odd lanes) of a tensor ``x`` given by a predicate."""

    def __init__(self, scope: Scope, is_x, module: ModuleInfo | None = None) -> None:
        self.scope = scope
        self.is_x = is_x
        self.module = module  # given: the shared canonical layer answers the spellings not matched here
        self.upcast = False  # a lane came through ``.float()``: the rotation is computed in fp32
        # slices at a split point not provably x's last dim // 2 (``half = Rd // 2`` from the cos width,
        # ``q``'s half used for ``k``): accepted only by callers that fuse under the run-time checks
        # collected here (``x.shape[-1] == 2 * (h)``), the original code running elsewhere
        self.allow_split = False
        self.split_checks: list[str] = []
        # (x, u) where the second half is written ``x[..., h:u]`` with u not provably x's last dim: the halves
        # of the rotated prefix ``x[..., :u]`` (partial rotary cut as two slices, the tail joined after:
        # mlx's RoPE ``x[..., dims // 2 : dims]``, k-diffusion's ``x[..., d : d * 2]``); only under allow_split
        self.prefix: tuple[str, str] | None = None
        # the prefix's even / odd lanes were cut as ``x[..., :u:2]`` / ``x[..., 1:u:2]`` (a nanoGPT variant's
        # partial interleaved rotary): u is no split point of halves, only the prefix's width (even, checked)
        self.prefix_lanes = False
        # s47: a half read through an fp32 cast (``x1 = x1.float()``) is taken, setting ``upcast``; only for the
        # readers that widen the fused dtype on that flag (_rope_s47sweep)
        self.see_fp32 = False
        self.plain_read = False  # s47: some half was read in x's own dtype (not through an fp32 cast)
        self.cast_read = False  # the last _part_read went through a cast

    def _last_dim_slice(self, sub: ast.Subscript) -> ast.Slice | None:
        sl = sub.slice
        if isinstance(sl, ast.Tuple):
            *lead, last = sl.elts
            ok_lead = all(
                (isinstance(e, ast.Constant) and e.value is Ellipsis)
                or (isinstance(e, ast.Slice) and e.lower is None and e.upper is None and e.step is None)
                for e in lead
            )
            has_ellipsis = any(isinstance(e, ast.Constant) and e.value is Ellipsis for e in lead)
            # without an Ellipsis, ``x[:, :, :, s]`` is the last dim of a 4-D tensor (what the op takes)
            if ok_lead and isinstance(last, ast.Slice) and (has_ellipsis or len(sl.elts) == 4):
                return last
        return None

    def _is_half_point(self, node: ast.expr | None) -> bool:
        """``x.shape[-1] // 2`` / ``x.size(-1) // 2`` / ``int(x.shape[-1] / 2)``, possibly via a local."""
        if node is None:
            return False
        node = _resolve(self.scope, node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "int" and node.args:
            node = node.args[0]
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
                return False
        elif not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv)):
            return False
        if not _is_int(node.right, 2):
            return False
        if self._unpacked_last_dim(node.left):
            return True
        size = _resolve(self.scope, node.left)
        if isinstance(size, ast.Subscript) and isinstance(size.value, ast.Attribute) and size.value.attr == "shape":
            return self.is_x(size.value.value) and _is_int(size.slice, -1, 3)
        if _method(size, "size") and size.args:
            return self.is_x(size.func.value) and _is_int(size.args[0], -1, 3)
        return False

    def _is_last_dim(self, node: ast.expr | None) -> bool:
        """``x.shape[-1]`` / ``x.size(-1)`` (or a local bound once to it) / ``d`` unpacked last from x's shape."""
        if node is None:
            return False
        if self._unpacked_last_dim(node):
            return True
        size = _resolve(self.scope, node)
        if isinstance(size, ast.Subscript) and isinstance(size.value, ast.Attribute) and size.value.attr == "shape":
            return self.is_x(size.value.value) and _is_int(size.slice, -1)
        return _method(size, "size") and len(size.args) == 1 and self.is_x(size.func.value) and _is_int(size.args[0], -1)

    def _prefix_second(self, base: ast.expr, lower: ast.expr, upper: ast.expr) -> str | None:
        """``x[..., h:u]``: the second half of the rotated prefix ``x[..., :u]``, fused where ``u == 2 * h``
        and x is at least u wide (the first half's split point is compared with u too: _add_split_checks)."""
        if not (_split_point(self.scope, lower) and _split_point(self.scope, upper)):
            return None
        key = (ast.unparse(base), ast.unparse(upper))
        if self.prefix not in (None, key):
            return None  # two prefixes (or two tensors): not the halves of one
        self.prefix = key
        check = f"({key[1]}) == 2 * ({ast.unparse(lower)})"
        if check not in self.split_checks:
            self.split_checks.append(check)
        return "second"

    def _prefix_lane(self, base: ast.expr, upper: ast.expr, lane: str) -> str | None:
        """``x[..., :u:2]`` / ``x[..., 1:u:2]``: the even / odd lanes of the rotated prefix ``x[..., :u]``,
        fused where u is even and x is at least u wide (_add_split_checks binds the prefix)."""
        if type(const_value(upper)) is not int and not _split_point(self.scope, upper):
            return None
        key = (ast.unparse(base), ast.unparse(upper))
        if self.prefix not in (None, key):
            return None  # two prefixes (or two tensors): not the lanes of one
        self.prefix, self.prefix_lanes = key, True
        check = f"({key[1]}) % 2 == 0"  # an odd u gives one more even lane than odd ones: no lane pairs
        if check not in self.split_checks:
            self.split_checks.append(check)
        return lane

    def _unpacked_last_dim(self, node: ast.expr) -> bool:
        """``d`` bound last by ``b, h, s, d = x.size()`` / ``= x.shape`` (picotron): x's last dim."""
        if not isinstance(node, ast.Name):
            return False
        binds = [(st, v) for st, v in self.scope.assignments.get(node.id, []) if st.lineno <= getattr(node, "lineno", st.lineno)]
        if not binds:
            return False
        st, v = binds[-1]
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Tuple)):
            return False
        elts = st.targets[0].elts
        if not (isinstance(elts[-1], ast.Name) and elts[-1].id == node.id and isinstance(v, ast.Subscript) and const_value(v.slice) == len(elts) - 1):
            return False
        size = v.value
        if _method(size, "size") and not size.args:
            return self.is_x(size.func.value)
        return isinstance(size, ast.Attribute) and size.attr == "shape" and self.is_x(size.value)

    def part(self, node: ast.expr) -> str | None:
        """'first' / 'second' half, 'even' / 'odd' lanes of x, or None."""
        found = self._part_read(node)
        if found is None and self.see_fp32:
            # s47: a half cast to fp32 (``x1 = x1.float()``), read as that half, the rotation made in fp32
            found = _rope_s47sweep.fp32_part(self, node, _resolve)
        elif found is not None and not self.cast_read:
            self.plain_read = True  # (s47: a half read in x's own dtype)
        return found

    def _part_read(self, node: ast.expr) -> str | None:
        self.cast_read = False
        found = self._part(node)
        if found is None and self.module is not None:
            # unflatten / view(*x.shape[:-1], 2, -1) / einops views unbound, strided slices (canonical.lane_of)
            lane = canonical.lane_of(self.module, self.scope, node)
            # not the layer's contiguous slices / split sizes: those are halves only at D/2, which _part proves itself
            if lane is not None and not (lane.kind == "halves" and lane.spelling in ("slice", "split")):
                whole = lane.source
                if lane.before_view is not None and not self.is_x(whole):
                    whole = lane.before_view  # a helper's x is its parameter, the name before it held the view
                src, casts = strip_casts(whole)
                if self.is_x(whole) or (casts and set(casts) <= {".float()"} and self.is_x(src)):
                    # HunyuanVideo: ``x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)``: the rotation of x, made in
                    # fp32 (the caller widens the fused dtype to fp32 to match)
                    self.upcast = self.upcast or bool(casts)
                    self.cast_read = bool(casts)
                    return ("first", "second")[lane.index] if lane.kind == "halves" else ("even", "odd")[lane.index]
        return found

    def _part(self, node: ast.expr) -> str | None:
        node = _resolve(self.scope, node)
        if isinstance(node, ast.Subscript):
            base = node.value
            # x.chunk(2, -1)[k] / torch.chunk(x, 2, dim=-1)[k] (also reached through tuple unpacking)
            if isinstance(base, ast.Call) and _is_int(node.slice, 0, 1):
                k = const_value(node.slice)
                if self._is_split(base):
                    return "first" if k == 0 else "second"
                # x.view(*x.shape[:-1], -1, 2).unbind(-1)[k]: the even (k=0) / odd (k=1) lanes
                if self._is_pair_unbind(base):
                    return "even" if k == 0 else "odd"
                # einops (PaLM): rearrange(x, "... (j d) -> ... j d", j=2).unbind(dim=-2)[k]: the halves
                if self._is_einops_halves(base):
                    return "first" if k == 0 else "second"
            if self.is_x(base):
                sl = self._last_dim_slice(node)
                if sl is None:
                    return None
                if sl.step is None:
                    lower = None if _is_int(sl.lower, 0) else sl.lower  # ``x[..., 0:h]`` is ``x[..., :h]``
                    upper = None if lower is not None and self._is_last_dim(sl.upper) else sl.upper  # x[..., h:D]
                    if lower is None and self._is_half_point(upper):
                        return "first"
                    if upper is None and self._is_half_point(lower):
                        return "second"
                    if self.allow_split and lower is not None and upper is not None:
                        return self._prefix_second(base, lower, upper)
                    h = upper if lower is None else lower if upper is None else None
                    if self.allow_split and h is not None and _split_point(self.scope, h):
                        if _rope_s48r.dead_own_split(self.scope, self.is_x, h):
                            return None  # (s48) from x's own shape, not its last dim's half: a check never true
                        check = f"{_atom(ast.unparse(base))}.shape[-1] == 2 * ({ast.unparse(h)})"
                        if check not in self.split_checks:
                            self.split_checks.append(check)
                        return "first" if lower is None else "second"
                elif _is_int(sl.step, 2) and sl.upper is None:
                    if sl.lower is None or _is_int(sl.lower, 0):
                        return "even"
                    if _is_int(sl.lower, 1):
                        return "odd"
                elif _is_int(sl.step, 2) and self.allow_split and (sl.lower is None or _is_int(sl.lower, 0, 1)):
                    # ``x[..., :u:2]`` / ``x[..., 1:u:2]``: the lanes of the rotated prefix ``x[..., :u]``
                    return self._prefix_lane(base, sl.upper, "odd" if _is_int(sl.lower, 1) else "even")  # type: ignore[arg-type]
        return None

    def _is_einops_halves(self, call: ast.Call) -> bool:
        if not (_method(call, "unbind") and _is_int(keyword(call, "dim", 0), -2)):
            return False
        r = _resolve(self.scope, call.func.value)
        if not (isinstance(r, ast.Call) and (dotted(r.func) or "").split(".")[-1] == "rearrange" and len(r.args) == 2
                and isinstance(r.args[1], ast.Constant) and isinstance(r.args[1].value, str) and self.is_x(r.args[0])):
            return False
        lhs, _, rhs = r.args[1].value.partition("->")
        lt, rt = lhs.replace("(", " ( ").replace(")", " ) ").split(), rhs.split()
        # "... (j d) -> ... j d" with j=2: the last dim cut into 2 x d, the first factor outer
        if len(lt) < 4 or lt[-4:-3] != ["("] or lt[-1] != ")" or len(rt) < 2:
            return False
        j, d = lt[-3], lt[-2]
        return rt[-2:] == [j, d] and lt[:-4] == rt[:-2] and _is_int(keyword(r, j), 2)

    def _is_pair_unbind(self, call: ast.Call) -> bool:
        if not (_method(call, "unbind") and _is_int(keyword(call, "dim", 0), -1)):
            return False
        pairs = _resolve(self.scope, call.func.value)
        if not (_method(pairs, "view", "reshape") and len(pairs.args) >= 2 and _is_int(pairs.args[-1], 2) and _is_int(pairs.args[-2], -1)):
            return False
        lead = pairs.args[:-2]
        # x.view(*x.shape[:-1], -1, 2)
        return (
            len(lead) == 1
            and isinstance(lead[0], ast.Starred)
            and isinstance(lead[0].value, ast.Subscript)
            and isinstance(lead[0].value.value, ast.Attribute)
            and lead[0].value.value.attr == "shape"
            and self.is_x(lead[0].value.value.value)
            and self.is_x(pairs.func.value)
        )

    def _is_split(self, call: ast.Call) -> bool:
        if not isinstance(call.func, ast.Attribute):
            return False
        name = call.func.attr
        if isinstance(call.func.value, ast.Name) and call.func.value.id == "torch" and call.args:
            x, rest = call.args[0], call.args[1:]
        else:
            x, rest = call.func.value, list(call.args)
        if not self.is_x(x):
            return False
        dim = keyword(call, "dim") or (rest[1] if len(rest) > 1 else None)
        if not _is_int(dim, -1, 3):
            return False
        if name == "chunk":
            return bool(rest) and _is_int(rest[0], 2) or _is_int(keyword(call, "chunks"), 2)
        if name == "split":
            size = rest[0] if rest else keyword(call, "split_size_or_sections")
            return self._is_half_point(size) or (_is_int(dim, -1)  # s51: at a checked split point (the last dim only)
                                                 and _rope_s51m.split_at_checked_point(self, size, x, _split_point, _rope_s48r.dead_own_split))
        return False

    def neg_of(self, node: ast.expr) -> ast.expr | None:
        node = _resolve(self.scope, node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return node.operand
        if _method(node, "neg", "negative") and not node.args:
            return node.func.value
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and ast.unparse(node.func) in _NEG_CALLS and node.args:
            return node.args[0]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for a, b in ((node.left, node.right), (node.right, node.left)):
                if const_value(a) == -1:
                    return b
        return None


# bare names this module imports from torch (``from torch import cat, stack``: vit-pytorch), set by
# RopePattern.detect before each statement is matched (a ContextVar: the matchers below take no module)
_TORCH_IMPORTS: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("_rope_torch_imports", default={})


def _unsqueezed_last(node: ast.expr) -> ast.expr | None:
    """t of ``t[..., None]`` / ``t.unsqueeze(-1)`` / ``t.unsqueeze(dim=-1)`` (a new last axis of size 1)."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 2:
        e0, e1 = node.slice.elts
        if isinstance(e0, ast.Constant) and e0.value is Ellipsis and isinstance(e1, ast.Constant) and e1.value is None:
            return node.value
    if _method(node, "unsqueeze") and len(node.args) + len(node.keywords) == 1 and _is_int(keyword(node, "dim", 0), -1):
        return node.func.value
    return None


def _stack_as_cat(call: ast.Call) -> tuple[ast.expr, ast.expr] | None:
    """(a, b) of ``torch.cat([a[..., None], b[..., None]], dim=-1)`` (or ``.unsqueeze(-1)``): the stack of a and b
    on a new last axis, written as the cat of the two with that axis added (mlx's traditional RoPE ported to torch,
    neuronx-distributed's polar rotation; DETR-style grids spell stacks the same way)."""
    fn = ast.unparse(call.func)
    if isinstance(call.func, ast.Name):
        fn = _TORCH_IMPORTS.get().get(fn, fn)
    if fn not in _CAT or not call.args or not isinstance(call.args[0], (ast.Tuple, ast.List)) or len(call.args[0].elts) != 2:
        return None
    dim = keyword(call, "dim", 1)
    if dim is None:
        dim = keyword(call, "axis")
    if not _is_int(dim, -1):  # (a positive dim is the new axis only at one rank)
        return None
    a, b = (_unsqueezed_last(e) for e in call.args[0].elts)
    return (a, b) if a is not None and b is not None else None


def _pair_of(call: ast.Call, names: set[str]) -> tuple[ast.expr, ast.expr] | None:
    """(a, b) of ``torch.cat((a, b), dim=-1)`` / ``torch.stack([a, b], -1)`` (also the stack written as
    ``torch.cat([a[..., None], b[..., None]], -1)``). ``names``: _CAT or _STACK."""
    # most calls are neither: an attribute call names one of the functions' last names, and a callee
    # that is neither a name nor an attribute unparses to no dotted name (unparsed, each cost ~10 us)
    if isinstance(call.func, ast.Attribute):
        if call.func.attr not in _PAIR_LAST_NAMES:
            return None
    elif not isinstance(call.func, ast.Name):
        return None
    fn = ast.unparse(call.func)
    if isinstance(call.func, ast.Name):
        fn = _TORCH_IMPORTS.get().get(fn, fn)
    if names is _STACK and fn in _CAT:
        return _stack_as_cat(call)
    if fn not in names and not (isinstance(call.func, ast.Attribute) and call.func.attr in {n.split(".")[-1] for n in names} and isinstance(call.func.value, ast.Name) and call.func.value.id == "torch"):
        return None
    if not call.args or not isinstance(call.args[0], (ast.Tuple, ast.List)) or len(call.args[0].elts) != 2:
        return None
    dim = keyword(call, "dim", 1)
    if dim is None:
        dim = keyword(call, "axis")  # torch.cat/stack take numpy's ``axis`` as an alias of dim
    # the last dim also as gpt-neox writes it: ``dim=x1.ndim - 1`` (x1 has the result's rank)
    if not (_is_int(dim, -1, 3, 4) or is_last_dim_expr(dim)):
        return None
    a, b = call.args[0].elts
    return a, b


def _classify_pair(halves: _Halves, a: ast.expr, b: ast.expr, lanes: tuple[str, str]) -> tuple[bool, str]:
    """Is ``(a, b)`` == ``(-x_second, x_first)`` (lanes = ("first","second") or ("even","odd"))?

    Returns (standard, reason-if-a-rotation-but-not-standard)."""
    lo, hi = lanes
    na, nb = halves.neg_of(a), halves.neg_of(b)
    pa = halves.part(na) if na is not None else halves.part(a)
    pb = halves.part(nb) if nb is not None else halves.part(b)
    if na is not None and nb is None and pa == hi and pb == lo:
        return True, ""
    if {pa, pb} == {lo, hi}:
        if na is None and nb is not None and pa == hi:
            return False, f"the rotation computes cat(x2, -x1) instead of cat(-x2, x1): sign flipped, it rotates the other way"
        return False, "the rotation is not the standard cat(-x2, x1) of the two halves (halves swapped or sign placement differs)"
    return False, ""


def _rotation_expr(scope: Scope, expr: ast.expr, is_x, module: ModuleInfo | None = None) -> _Rotation:
    """Classify an expression as the half / interleave rotation of x (predicate ``is_x``)."""
    halves = _Halves(scope, is_x, module)
    halves.see_fp32 = True  # s47 (its rot.upcast widens the fused dtype)
    rot = _rotation_of_halves(scope, expr, is_x, halves)
    rot.upcast = rot.kind is not None and halves.upcast
    return rot


def _einops_list_merge(expr: ast.expr) -> tuple[str, ast.expr, ast.expr] | None:
    """("stack", a, b) for einops ``rearrange([a, b], "r ... d -> ... (d r)", r=2)`` (einops stacks a list on a new
    axis 0, then the pattern moves it inside the last dim as the inner factor: stack([a, b], -1).flatten(-2), the
    lanes interleaved; uni2ts / toto's ``_rotate``), ("cat", a, b) for ``"r ... d -> ... (r d)"`` (cat([a, b], -1))."""
    if not (isinstance(expr, ast.Call) and (dotted(expr.func) or "").split(".")[-1] == "rearrange" and len(expr.args) == 2):
        return None
    seq, pattern = expr.args
    if not (isinstance(seq, (ast.List, ast.Tuple)) and len(seq.elts) == 2 and isinstance(const_value(pattern), str)):
        return None
    lhs, arrow, rhs = const_value(pattern).partition("->")
    lt, rt = lhs.split(), rhs.replace("(", " ( ").replace(")", " ) ").split()
    if not arrow or len(lt) < 3 or "(" in lhs or len(rt) != len(lt) + 2 or rt[-4] != "(" or rt[-1] != ")" or rt[:-4] != lt[1:-1]:
        return None
    axis, last = lt[0], lt[-1]
    if not any(kw.arg == axis and const_value(kw.value) == 2 for kw in expr.keywords):
        return None
    if rt[-3:-1] == [last, axis]:
        return "stack", seq.elts[0], seq.elts[1]
    if rt[-3:-1] == [axis, last]:
        return "cat", seq.elts[0], seq.elts[1]
    return None


def _rotation_of_halves(scope: Scope, expr: ast.expr, is_x, halves: _Halves) -> _Rotation:
    expr = _resolve(scope, expr)
    merged = _einops_list_merge(expr)
    if merged is not None:
        how, a, b = merged
        ok, reason = _classify_pair(halves, a, b, ("first", "second") if how == "cat" else ("even", "odd"))
        if ok:
            return _Rotation("half" if how == "cat" else "interleave")
        if reason:
            return _Rotation(None, reason if how == "cat" else reason.replace("cat(", "stack("))
    # half: torch.cat((-x2, x1), dim=-1)
    if isinstance(expr, ast.Call):
        pair = _pair_of(expr, _CAT)
        if pair is not None:
            ok, reason = _classify_pair(halves, *pair, ("first", "second"))
            if ok:
                return _Rotation("half")
            if reason:
                return _Rotation(None, reason)
            ok, reason = _classify_pair(halves, *pair, ("even", "odd"))
            if reason:
                return _Rotation(None, "cat of the even/odd lanes is not a rotation npu_rotary_mul computes (interleave needs stack(-x_odd, x_even, -1).flatten(-2))")
        # interleave: stack((-x2, x1), -1) flattened over the last two dims
        inner = None
        if _method(expr, "flatten"):
            start = keyword(expr, "start_dim", 0)
            end = keyword(expr, "end_dim", 1)
            if _is_int(start, -2, 3) and (end is None or _is_int(end, -1)):
                inner = expr.func.value
        elif _method(expr, "reshape", "view") and expr.args:
            text = ast.unparse(expr)
            if ".shape" in text or ".size(" in text:
                inner = expr.func.value
        elif _method(expr, "reshape_as", "view_as") and len(expr.args) == 1 and is_x(expr.args[0]):
            inner = expr.func.value  # RoFormer: stack([-x[..., 1::2], x[..., ::2]], -1).reshape_as(x)
        elif _einops_last_two_merged(expr) is not None:
            inner = expr.args[0]  # s40: einops with named axes, ``"b h n d two -> b h n (d two)"``
        elif isinstance(expr.func, ast.Name) and expr.func.id == "rearrange" and len(expr.args) >= 2:
            # einops: rearrange(stack(...), "... d j -> ... (d j)") merges the pair axis into the last dim
            pattern = const_value(expr.args[1])
            if isinstance(pattern, str) and re.fullmatch(r"\.\.\.(\w+)(\w+)->\.\.\.\(\1\2\)", pattern.replace(" ", "")) is None:
                spaced = pattern.split("->")
                if len(spaced) == 2:
                    lhs, rhs = spaced[0].split(), spaced[1].replace("(", " ( ").replace(")", " ) ").split()
                    if len(lhs) == 3 and lhs[0] == "..." and rhs == ["...", "(", lhs[1], lhs[2], ")"]:
                        inner = expr.args[0]
            elif isinstance(pattern, str):
                inner = expr.args[0]
        if inner is not None:
            inner = _resolve(scope, inner)
            if isinstance(inner, ast.Call):
                pair = _pair_of(inner, _STACK)
                if pair is not None:
                    ok, reason = _classify_pair(halves, *pair, ("even", "odd"))
                    if ok:
                        return _Rotation("interleave")
                    if reason:
                        return _Rotation(None, reason.replace("cat(", "stack("))
    return _Rotation(None)


def _rotation_call(module: ModuleInfo, scope: Scope, node: ast.expr, x: ast.expr) -> _Rotation:
    """Is ``node`` the rotation of ``x``: a helper call ``R(x)`` (followed and verified) or inline?"""
    if isinstance(node, ast.Name):
        called = _named_rotation_call(scope, node, x)
        if called is not None:
            return _rotation_call(module, scope, called, x)
    upcast = _upcast_helper_rotation(module, scope, node, x)
    if upcast is not None:
        return upcast
    inner, casts = strip_casts(node)
    if casts:
        # Ernie's ``q.float() * cos + rotate_half(q).float() * sin``: the same cast on both sides
        # commutes with the rotation (a permutation with negation is exact in any dtype)
        x_inner, x_casts = strip_casts(x)
        return _rotation_call(module, scope, inner, x_inner) if casts == x_casts else _Rotation(None)
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords and same_expr(node.args[0], x) and isinstance(node.func, ast.Name):
        chosen = scope.definition(node.func.id, node.lineno)
        if not isinstance(chosen, ast.IfExp):
            # ``if flag: f = a`` / ``else: f = b``: the same choice as ``f = a if flag else b``
            chosen = canonical.if_else_binding(scope.body, node.func.id, node.lineno) or chosen
        if isinstance(chosen, ast.IfExp):
            return _chosen_rotation(module, scope, node, chosen)
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords and same_expr(node.args[0], x):
        # a helper's verdict does not depend on the call site: computed once per module
        key = (scope.class_name, ast.dump(node.func))
        cache = module.__dict__.setdefault("_rotation_verdicts", {})
        if key not in cache:
            cache[key] = _rotation_helper(module, scope, node)
        if cache[key].rank4_only:
            return dataclasses.replace(cache[key], only_if=f"{_atom(segment(module, node.args[0]))}.dim() == 4")
        if cache[key].split_only_if is not None:
            return dataclasses.replace(cache[key], only_if=cache[key].split_only_if.format(x=_atom(segment(module, node.args[0]))))
        return dataclasses.replace(cache[key])
    if isinstance(node, ast.Call) and node.args and not isinstance(node.args[0], ast.Starred) and same_expr(node.args[0], x) \
            and _plain_flag_args(node):
        # Megatron's ``_rotate_half(t, rotary_interleaved)``: extra arguments that only pick the helper's
        # return path (checked in _flagged_helper); the verdict depends on them, so they are in the key
        key = (scope.class_name, ast.dump(node.func), tuple(ast.dump(a) for a in node.args[1:]),
               tuple((k.arg, ast.dump(k.value)) for k in node.keywords))
        cache = module.__dict__.setdefault("_rotation_verdicts", {})
        if key not in cache:
            cache[key] = _rotation_helper(module, scope, node)
        return dataclasses.replace(cache[key])
    # inline: torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    rot = _rotation_expr(scope, node, lambda n: same_expr(n, x), module)
    if rot.kind is None and not rot.reason:
        rot = _split_checked_inline(scope, node, x, module) or rot
    rot.name = "inline"
    if rot.kind is not None and isinstance(node, ast.Name):
        return _on_its_branch(scope, node, rot, module, x)
    return rot


def _split_checked_inline(scope: Scope, node: ast.expr, x: ast.expr, module: ModuleInfo) -> _Rotation | None:
    """The inline ``cat((-x2, x1), -1)`` (or a name bound to it) whose halves are cut at a split point
    that is not provably x's last dim // 2 (wav2vec2-conformer's ``x[..., : self.head_size // 2]``, the
    head size the caller viewed x with): the half rotation where ``x.shape[-1] == 2 * (split)`` holds at
    run time, the original code elsewhere. The split point is re-read at the site, so only expressions
    safe to evaluate again there are taken (``_split_point``)."""
    halves = _Halves(scope, lambda n: same_expr(n, x), module)
    halves.allow_split = True
    halves.see_fp32 = True  # s47 (rot.upcast below)
    rot = _rotation_of_halves(scope, node, lambda n: same_expr(n, x), halves)
    if not halves.split_checks or halves.prefix is not None:
        return None  # (halves of a prefix are no rotate_half of x: the widths differ from x's)
    # (a split point read from x's own shape other than its last dim's half -- picotron's unpacked ``seq_length
    # // 2``, ``x.shape[-1] // 3`` -- was refused by _Halves._part itself: s48, _rope_s48r.dead_own_split)
    if rot.kind is None and rot.reason:
        return rot  # the halves of x at that split, combined the wrong way: say so
    if rot.kind != "half":
        return None
    rot.upcast = halves.upcast
    rot.only_if = " and ".join(halves.split_checks)
    rot.other = "halves cut at a split point not provably half the last dim: the original code runs where it is not"
    return rot


def _interleave_rows_ok(x: str, seq_len: str) -> str:
    """npu_rotary_mul's interleave mode takes B*N < 1000 (spec 4.1): x's rows (all dims but the last) over
    the sequence length ``seq_len`` (an expression for the table's one long dim, at least 1 wherever the
    caller's earlier checks hold), as a run-time test on shapes. A fractal AR model runs its rope on
    batch x patches rows (audit34: 64*256 x 8 heads): the original code runs there."""
    return f"{x}.numel() // max({x}.shape[-1], 1) < 1000 * {seq_len}"


def _lifted_limits(x: str, cos: str, mode: str) -> str:
    """A run-time test that npu_rotary_mul's B/N limits hold for ``x`` and ``cos`` lifted to 4-D (spec
    4.1: half B < 1000 and N < 1000, interleave B*N < 1000), or "" where ``cos`` is an expression (it
    would be evaluated again). x's leading dims where the table has size 1 are batch or head dims
    (the sequence dim of the table matches x's); a [(b h), n, d] x lifted to [1, b*h, n, d] puts b*h
    in N. Half mode: those dims below 1000 and at most one other leading dim (the sequence) at or
    above it, and x's batch dim below 1000 where the table has two dims that are not 1; interleave (batch-free tables, one dim not 1): the product of the leading dims over
    the sequence length below 1000."""
    if not (_is_name(cos) and "." not in cos):
        return ""
    if mode == "half":
        # x's leading dims (last first) beside the table's, 1 where the table has fewer: a broadcast
        # dim at or above 1000 counts twice, any other once: at most one (the sequence) may be that long
        # ... and where the table varies along two leading dims (B1SD / BS1D: per-batch positions) the
        # long one need not be the sequence: x's batch dim (-4 in BNSD and BSND, the layouts such tables
        # allow) must then be below 1000 itself (audit35: VideoSys's temporal RoPE, B = b*h*w = 2048)
        return (f"sum((_d >= 1000) + (_c == 1 and _d >= 1000) for _d, _c in "
                f"zip({x}.shape[-2::-1], tuple({cos}.shape[-2::-1]) + (1, 1, 1))) <= 1 and "
                f"(sum(_c != 1 for _c in {cos}.shape[:-1]) <= 1 or ({x}.dim() >= 4 and {x}.shape[-4] < 1000))")
    return _interleave_rows_ok(x, f"max({cos}.shape[:-1], default=1)")


def _lambda_args_plain(lam: ast.Lambda) -> bool:
    a = lam.args
    return len(a.args) == 1 and not (a.posonlyargs or a.kwonlyargs or a.vararg or a.kwarg or a.defaults)


def _lambda_local(module: ModuleInfo, lam: ast.Lambda, stmt: ast.stmt) -> _LocalFn:
    """The local function a lambda becomes; applied to ``map``'s iterable where it is ``map(lam, ...)``."""
    iterable = None
    for n in fast_walk(stmt):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "map" and len(n.args) == 2 and n.args[0] is lam:
            iterable = n.args[1]
    param = lam.args.args[0].arg if lam.args.args else ""
    return _LocalFn("lambda", param, lam.body, lam, "{fn}", segment(module, lam), iterable)


def _comprehension_of(module: ModuleInfo, stmt: ast.stmt, m: "_Match") -> _LocalFn | None:
    """The comprehension of ``stmt`` whose element holds the rotation ``m`` of its own variable, as a
    local function of that variable; None where the rotation is not in such a comprehension."""
    for comp in fast_walk(stmt):
        if not isinstance(comp, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            continue
        if not any(n is m.node for n in fast_walk(comp.elt)):
            continue
        bound = {n.id for g in comp.generators for n in fast_walk(g.target) if isinstance(n, ast.Name)}
        if not bound & {n.id for n in fast_walk(m.x) if isinstance(n, ast.Name)}:
            return None  # the rotated tensor is not the comprehension's variable: live at the statement
        g = comp.generators[0]
        param = g.target.id if len(comp.generators) == 1 and isinstance(g.target, ast.Name) and not g.is_async else ""
        return _LocalFn("comprehension", param, comp.elt, comp.elt, "{fn}(" + param + ")", segment(module, comp), g.iter)
    return None


def _local_guard(local: _LocalFn, m: "_Match | None" = None) -> str | None:
    """A tensor the local function is applied to, live before the statement: the first plain name of
    a tuple or list it iterates over (``map(lam, (q, k))``, ``for t in (q, k)``); else (a list passed
    in, ``[... for t in xs]``) the rotation's cos table when it is a plain name live before the
    statement: every rotated element is multiplied by it, so it sits on their device (the eager
    product fails otherwise). None where neither is there."""
    seq = local.iterable
    elts = seq.elts if isinstance(seq, (ast.Tuple, ast.List)) else []
    if elts and isinstance(elts[0], ast.Name):
        return elts[0].id
    if m is not None and local.kind == "comprehension" and isinstance(m.cos_node, ast.Name) and m.cos_node.id != local.param \
            and not any(isinstance(n, ast.Name) and n.id == m.cos_node.id for n in fast_walk(local.replace)
                        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)):
        return m.cos_node.id
    return None


def _local_refusal(module: ModuleInfo, scope: Scope, local: _LocalFn, m: "_Match") -> str | None:
    """Why a rotation in a lambda / comprehension cannot become a local function (the wording
    completes "rewrites it ... only where"), or None. The local def closes over the same names, so
    the meaning is kept wherever it stands; what must hold: one plain parameter (a single ``for
    <name> in``), the rotation of that parameter, a tensor to guard on (applied to a tuple or list
    of named tensors), and no fused statements tied to the enclosing block."""
    if local.kind == "lambda" and not _lambda_args_plain(local.replace):  # type: ignore[arg-type]
        return "the lambda takes one plain parameter"
    if not local.param:
        return "the comprehension has a single `for <name> in ...`"
    if _local_guard(local, m) is None or (local.kind == "lambda" and "map" in module.functions):
        return (f"the {local.kind} is {'mapped' if local.kind == 'lambda' else 'run'} over a tuple or list of named tensors "
                f"(`{'map(lambda t: ..., (q, k))' if local.kind == 'lambda' else '[... for t in (q, k)]'}`)"
                + (" or its cos table is a plain name of the enclosing code (a tensor to test the device on before the statement)"
                   if local.kind == "comprehension" else ""))
    var = "parameter" if local.kind == "lambda" else "variable"
    if local.param in scope.assignments or local.param in scope.args:
        # the matcher reads the parameter's name through the enclosing function's bindings
        return f"the {local.kind}'s {var} is not also a name of the enclosing function"
    if not any(isinstance(n, ast.Name) and n.id == local.param for n in fast_walk(m.x)):
        return f"the rotated tensor is the {local.kind}'s {var}"
    if m.absorb or m.anchor is not None or m.site_stmt is not None:
        return f"the rotation is one expression of the {local.kind}"
    return None


def _plain_flag_args(call: ast.Call) -> bool:
    """The arguments after the first are names, attributes or constants (read twice, no effect)."""
    rest = [*call.args[1:], *(k.value for k in call.keywords)]
    if not rest or any(k.arg is None for k in call.keywords):
        return False
    return all(isinstance(n, _PLAIN_ARG) for a in rest for n in fast_walk(a))


# what a flag argument may be: read again by the guard at the call site, it must give the same value
_PLAIN_ARG = (ast.Name, ast.Attribute, ast.Constant, ast.Load, ast.UnaryOp, ast.USub, ast.Not)


def _bound_flags(fn: ast.FunctionDef, node: ast.Call, params: list[str]) -> dict[str, ast.expr] | None:
    """The helper's parameters after the first, bound to the call's arguments (or their defaults);
    None where one is unbound or the call passes something the signature does not take."""
    a = fn.args
    if a.vararg is not None or a.kwarg is not None or a.posonlyargs:
        return None
    positional = list(node.args[1:])
    names = params[1:]
    if len(positional) > len(names):
        return None
    bound: dict[str, ast.expr] = dict(zip(names, positional))
    kwonly = [k.arg for k in a.kwonlyargs]
    for k in node.keywords:
        if k.arg in bound or (k.arg not in names and k.arg not in kwonly):
            return None
        bound[k.arg] = k.value  # type: ignore[index]
    defaults = dict(zip([x.arg for x in a.args][len(a.args) - len(a.defaults):], a.defaults))
    defaults.update({k.arg: d for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    for n in [*names, *kwonly]:
        if n not in bound:
            if n not in defaults:
                return None
            bound[n] = defaults[n]
    return bound


def _substituted(test: ast.expr, values: dict[str, ast.expr]) -> ast.expr:
    """``test`` with the named parameters replaced by the call site's argument expressions."""

    class Sub(ast.NodeTransformer):
        def visit_Name(self, n: ast.Name) -> ast.AST:
            return values[n.id] if n.id in values else n

    import copy

    return Sub().visit(copy.deepcopy(test))


def _chosen_rotation(module: ModuleInfo, scope: Scope, node: ast.Call, chosen: ast.IfExp) -> _Rotation:
    """``f = rotate_half if cond else rotate_every_two; ... f(x)``: both helpers verified, the
    mode chosen by the same condition at run time (vLLM/NeoX-style ``is_neox_style`` flags)."""
    kinds = []
    for branch in (chosen.body, chosen.orelse):
        if not isinstance(branch, (ast.Name, ast.Attribute)):
            return _Rotation(None)
        call = ast.copy_location(ast.Call(func=branch, args=node.args, keywords=[]), node)
        rot = _rotation_helper(module, scope, call)
        if rot.kind is None:
            name = ast.unparse(branch)
            return _Rotation(None, rot.reason or f"`{node.func.id}` may be `{name}`, which is not a rotation npufuse verifies", name)  # type: ignore[attr-defined]
        kinds.append(rot.kind)
    test = segment(module, chosen.test)
    name = f"{node.func.id} = {ast.unparse(chosen.body)} if ... else {ast.unparse(chosen.orelse)}"  # type: ignore[attr-defined]
    if kinds[0] == kinds[1]:
        return _Rotation(kinds[0], "", name)
    # the stricter constraints of the two (interleave: batch-independent cos/sin) are checked
    half_if = test if kinds[0] == "half" else f"not {_atom(test)}"
    return _Rotation("interleave", "", name, mode_expr=f'"{kinds[0]}" if {test} else "{kinds[1]}"', half_if=half_if)


def _rotation_helper(module: ModuleInfo, scope: Scope, node: ast.Call) -> _Rotation:
    """Verdict on a called rotation helper (followed into its definition and verified)."""
    fn, name = _helper_def(module, scope, node.func)
    if fn is None:
        imported = _imported_rotation(module, node, name)
        if imported is not None:
            return imported
        if "rotate" in name.lower() or "rot" in name.lower():
            if isinstance(node.func, ast.Name) and any(
                    isinstance(st, ast.Assign) and isinstance(st.value, ast.Lambda)
                    and any(isinstance(t, ast.Name) and t.id == node.func.id for t in st.targets) for st in module.tree.body):
                return _Rotation(None, f"rotation helper `{name}` is a lambda bound at module level: npufuse verifies helpers "
                                 "written with def only", name)
            return _Rotation(None, f"rotation helper `{name}` is not defined in this module: it cannot be verified", name)
        return _Rotation(None)
    hscope = _scope_of(module, fn)
    params = [a.arg for a in fn.args.args]
    if isinstance(node.func, ast.Attribute) and params and params[0] in ("self", "cls") and not any(
        isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list
    ):
        params = params[1:]
    if hscope is None or not params:
        return _Rotation(None)
    pname = params[0]
    rets = [n for n in fast_walk(fn) if isinstance(n, ast.Return) and n.value is not None]

    def is_param(n: ast.AST) -> bool:
        return isinstance(n, ast.Name) and n.id == pname and hscope.definition(pname, n.lineno) is None

    if len(rets) == 2:
        return _flagged_helper(module, node, fn, hscope, rets, is_param, name, pname)
    if len(rets) != 1:
        return _Rotation(None, f"rotation helper `{name}` has {len(rets)} return paths: not verified", name)

    # ``out = empty_like(x); out[..., :h] = -x2; out[..., h:] = x1; return out``: the cat it fills
    filled = canonical.filled_halves(fn, rets[0]) if isinstance(fn, ast.FunctionDef) else None
    rot = _rotation_expr(hscope, filled if filled is not None else rets[0].value, is_param, module)
    if rot.kind is None and isinstance(fn, ast.FunctionDef) and filled is None:
        rot = _rank4_branch_rotation(module, fn, pname) or rot
    if rot.kind is None and filled is None:
        rot = _split_checked_helper(module, node, hscope, rets[0].value, is_param, pname) or rot
    if rot.kind is None and isinstance(fn, ast.FunctionDef) and filled is None:
        rot = _even_dim_rotation(module, fn, pname) or rot
    rot.name = name
    if rot.kind is None and not rot.reason and isinstance(fn, ast.FunctionDef):
        foreign = _foreign_framework(module, fn)
        if foreign is not None:
            rot.reason = (f"helper `{name}` is {foreign[0]} code (`{foreign[1]}`), not PyTorch: npu_rotary_mul replaces "
                          "torch code only")
    if rot.kind is None and not rot.reason and isinstance(fn, ast.FunctionDef):
        # s31: a spelling the matchers above do not read (``x.view(.., 2, d // 2).unbind(-2)`` halves, a buffer
        # filled by slices, ...) is evaluated on sampled inputs by the numeric probe (allowlisted torch only)
        from npufuse.scan import numeric_probe

        proof = numeric_probe.prove_rotation(module, fn, _enclosing_class(module, hscope) if hscope.class_name else None)
        if proof.kind in ("half", "interleave"):
            return _Rotation(proof.kind, "", name)
        if proof.kind == "other" and "rot" in name.lower():
            rot.reason = (f"helper `{name}` does not compute the standard rotate_half cat(-x2, x1) nor the interleaved "
                          f"stack(-x_odd, x_even) (evaluated on sampled inputs: {proof.reason})")
    if rot.kind is None and not rot.reason and ("rot" in name.lower()):
        rot.reason = f"helper `{name}` does not compute the standard rotate_half cat(-x2, x1) nor the interleaved stack(-x_odd, x_even)"
    return rot


def _flagged_helper(module: ModuleInfo, node: ast.Call, fn: ast.FunctionDef, hscope: Scope, rets: list[ast.Return], is_param,
                    name: str, pname: str) -> _Rotation:
    """A helper whose two return paths are chosen by one flag (nanotron's ``rotate_half`` with
    ``if self.interleaved: ... return A else: ... return B``): each path verified on its own.

    The flag must read the same at the call site: only ``self.<attr>`` (the helper called as
    ``self.f(x)`` from the same class) or module-level names, nothing the helper computes or
    receives. Both paths rotations: the mode follows the flag; one path a rotation: that path is
    fused under the flag, the other keeps the original code."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not body or not isinstance(body[0], ast.If):
        return _Rotation(None, f"rotation helper `{name}` has 2 return paths not chosen by one leading `if`: not verified", name)
    branch = body[0]
    then_rets = [r for r in rets if any(r is n for n in fast_walk(ast.Module(body=branch.body, type_ignores=[])))]
    if len(then_rets) != 1 or not isinstance(branch.body[-1], ast.Return):
        return _Rotation(None, f"rotation helper `{name}` has 2 return paths not chosen by one leading `if`: not verified", name)
    other = next(r for r in rets if r is not then_rets[0])
    # the flag, read at the call site: self.<attr> of this class, module-level names, or a parameter
    # after the first bound to a plain argument of the call (Megatron's `_rotate_half(t, rotary_interleaved)`)
    via_self = isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
    local = {a.arg for a in fn.args.args + fn.args.kwonlyargs} | set(hscope.assignments)
    params = [a.arg for a in fn.args.args]
    if isinstance(node.func, ast.Attribute) and params and params[0] in ("self", "cls") and not any(
            isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
        params = params[1:]
    flags: dict[str, ast.expr] = {}
    if len(node.args) > 1 or node.keywords:
        bound = _bound_flags(fn, node, params)
        test_ids = {id(n) for n in fast_walk(branch.test)}
        # each flag parameter is read by the leading test only (the return paths use x alone) and never assigned
        if bound is None or any(isinstance(n, ast.Name) and n.id in bound and (id(n) not in test_ids or not isinstance(n.ctx, ast.Load))
                                for n in fast_walk(fn)):
            return _Rotation(None, f"rotation helper `{name}` takes arguments besides the rotated tensor that its "
                             "return paths use: not verified", name)
        flags = {k: v for k, v in bound.items() if k in {n.id for n in fast_walk(branch.test) if isinstance(n, ast.Name)}}
        if any(not all(isinstance(n, _PLAIN_ARG) for n in fast_walk(v)) for v in flags.values()):
            return _Rotation(None, f"rotation helper `{name}` picks its return path by a default that is not a plain value: not verified", name)
    for n in fast_walk(branch.test):
        if isinstance(n, ast.Call):
            return _Rotation(None, f"rotation helper `{name}` picks its return path by a call (`{ast.unparse(branch.test)}`): not verified", name)
        if isinstance(n, ast.Name) and n.id in flags:
            continue
        if isinstance(n, ast.Name) and (n.id in local and not (via_self and n.id == "self")) and n.id not in module.functions:
            return _Rotation(None, f"rotation helper `{name}` picks its return path by `{ast.unparse(branch.test)}`, "
                             "a value the call site cannot read: not verified", name)
    kinds = []
    for ret in (then_rets[0], other):
        rot = _rotation_expr(hscope, ret.value, is_param, module)
        kinds.append(rot.kind)
    test = ast.unparse(_substituted(branch.test, flags)) if flags else ast.unparse(branch.test)
    if kinds[0] is None and kinds[1] is None:
        return _Rotation(None, f"helper `{name}` does not compute the standard rotate_half cat(-x2, x1) nor the interleaved stack(-x_odd, x_even) on either return path", name)
    if kinds[0] == kinds[1]:
        return _Rotation(kinds[0], "", name)
    if None in kinds:
        # one path only: fused where the flag picks it, the other path runs the original code
        kind = kinds[0] or kinds[1]
        cond = test if kinds[0] is not None else f"not {_atom(test)}"
        rot = _Rotation(kind, "", name, only_if=cond)
        rot.other = f"the other return path of `{name}` (where `{test if kinds[0] is None else 'not ' + _atom(test)}`) is not a rotation npu_rotary_mul computes"
        return rot
    half_if = test if kinds[0] == "half" else f"not {_atom(test)}"
    return _Rotation("interleave", "", name, mode_expr=f'"{kinds[0]}" if {test} else "{kinds[1]}"', half_if=half_if)


# -- cos/sin layout ---------------------------------------------------------------------------------
@dataclass
class _CosInfo:
    rank: int | None = None  # statically known rank, else None
    batch_free: bool = False  # provably no batch-dependent leading dim (interleave mode needs this)
    layout: str = ""  # description for the report
    unsqueeze_dim: str | None = None
    # HF contract: ``cos.unsqueeze(unsqueeze_dim)`` with the dim a parameter (default 1) is documented
    # for [B, S, D] tables, a 4-D result; no run-time lift is written for it
    contract_4d: bool = False


def _cos_info(scope: Scope, node: ast.expr, module: ModuleInfo) -> _CosInfo:
    """What can be said statically about a cos/sin operand's shape."""
    if isinstance(node, ast.Name) and _bound_on_a_branch(scope, node):
        # ``if x.ndim == 3: f = f.view(1, S, D) else: f = f.view(1, S, 1, D)``: which binding reaches the
        # use is decided at run time, so nothing is claimed (the last one textually is not the answer)
        return _CosInfo()
    node = _resolve(scope, node)
    info = _CosInfo()
    # casts / repeat_interleave / cat(freqs, freqs) keep the shape pattern
    while True:
        if _method(node, "to", "float", "half", "bfloat16", "type_as", "contiguous", "type"):
            node = _resolve(scope, node.func.value)
            continue
        if _method(node, "repeat_interleave"):
            node = _resolve(scope, node.func.value)
            continue
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.repeat_interleave",) and node.args:
            node = _resolve(scope, node.args[0])
            continue
        break
    if _method(node, "unsqueeze") and node.args:
        dim = node.args[0]
        inner = _resolve(scope, node.func.value)
        if _method(inner, "unsqueeze") and _is_int(inner.args[0] if inner.args else None, 0):
            # x.unsqueeze(0).unsqueeze(k): leading dim is 1
            info.rank = None
            info.batch_free = True
            info.layout = "1S1D (x BSND)" if _is_int(dim, 2) else "11SD (x BNSD)" if _is_int(dim, 1, 0) else ""
            return info
        if _is_int(dim, 0):
            info.batch_free = True
            info.layout = "leading singleton dim"
            return info
        d = ast.unparse(dim)
        info.unsqueeze_dim = d
        if _is_int(dim, 1):
            info.layout = "B1SD (x BNSD; cos [B,S,D] unsqueezed at 1)"
        elif _is_int(dim, 2):
            info.layout = "BS1D (x BSND; cos [B,S,D] unsqueezed at 2)"
        elif _is_int(dim, -2):
            info.layout = "[..., S, 1, D] (x [..., S, N, D]: BS1D for BSND x)"
        else:
            default = _param_default(scope, d)
            info.contract_4d = default is not None
            info.layout = f"cos.unsqueeze({d})" + (
                f": B1SD (x BNSD) with the default {d}={default}, BS1D (x BSND) with {d}=2" if default == "1" else ""
            )
        return info
    if isinstance(node, ast.Subscript):
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        nones = [isinstance(e, ast.Constant) and e.value is None for e in elts]
        if any(nones):
            # ``t[None, :, None, :]`` adds singleton dims to a tensor of unknown rank: the rank is not
            # known, but two inserted singletons leave at most S and D (a 4-D result is 1S1D / 11SD / S11D)
            info.batch_free = sum(nones) >= 2
            pattern = "".join("1" if n else "x" for n in nones)
            info.layout = {"1x1x": "1S1D (x BSND)", "11xx": "11SD (x BNSD)", "11": "11SD (x BNSD)", "x11x": "S11D (x SBND)",
                           "x1xx": "B1SD (x BNSD)", "x1": "B1SD (x BNSD)", "xx1x": "BS1D (x BSND)"}.get(
                pattern, f"index pattern {pattern}"
            )
            return info
    if _method(node, "view", "reshape") and node.args:
        args = node.args
        if len(args) == 1 and isinstance(args[0], ast.Starred):
            # reshape_for_broadcast-style ``freqs.view(*shape)``: not followed further here
            return info
        if not any(isinstance(a, ast.Starred) for a in args):
            info.rank = len(args)
            info.batch_free = _is_int(args[0], 1)
            info.layout = "view " + ", ".join(ast.unparse(a) for a in args)
            return info
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        fn = module.helper(node.func.id)
        if fn is not None and _broadcast_helper(fn):
            info.batch_free = True
            info.layout = f"{node.func.id}(): 1S1D (x BSND)"
            return info
    return info


def _param_default(scope: Scope, name: str) -> str | None:
    fn = scope.node
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    args = fn.args.args
    defaults = fn.args.defaults
    for a, d in zip(args[len(args) - len(defaults) :], defaults):
        if a.arg == name:
            return ast.unparse(d)
    for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults):
        if a.arg == name and d is not None:
            return ast.unparse(d)
    return None


def _broadcast_helper(fn: ast.FunctionDef) -> bool:
    """Meta's ``reshape_for_broadcast``: ``shape = [d if i == 1 or i == ndim - 1 else 1 ...]``;
    ``return freqs.view(*shape)`` — every dim but S (dim 1) and D becomes 1 (batch-independent,
    1S1D for BSND x). One shape, kept dims 1 and the last only: a helper that chooses among shapes
    (rope-vit's ``i >= ndim - 2`` / ``i >= ndim - 3`` branches keep a per-head table [1, H, S, D/2],
    which npu_rotary_mul's interleave mode rejects) is not this one, so its layout is not known."""
    comps = [n for n in fast_walk(fn) if isinstance(n, ast.ListComp)]
    rets = [n for n in fast_walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    if len(comps) != 1 or len(rets) != 1 or not _method(rets[0].value, "view", "reshape"):
        return False
    if any(isinstance(n, ast.If) for n in fast_walk(fn)):
        return False  # the shape is chosen by a branch
    elt = comps[0].elt
    if not (isinstance(elt, ast.IfExp) and const_value(elt.orelse) == 1):
        return False
    return _keeps_dim_1_and_last(elt.test)


def _keeps_dim_1_and_last(test: ast.expr) -> bool:
    """``i == 1 or i == ndim - 1`` (either order, either side of ``==``): the comprehension keeps
    the sequence dim of a BSND x and the last dim, nothing else."""
    if not (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or) and len(test.values) == 2):
        return False
    kept = []
    for cmp in test.values:
        if not (isinstance(cmp, ast.Compare) and len(cmp.ops) == 1 and isinstance(cmp.ops[0], ast.Eq)):
            return False
        other = cmp.comparators[0] if isinstance(cmp.left, ast.Name) else cmp.left
        if const_value(other) == 1:
            kept.append("1")
        elif isinstance(other, ast.BinOp) and isinstance(other.op, ast.Sub) and const_value(other.right) == 1:
            kept.append("last")
        else:
            return False
    return sorted(kept) == ["1", "last"]


# -- matching one expression ------------------------------------------------------------------------
@dataclass
class _Match:
    node: ast.expr  # the expression replaced by the fused call
    mode: str  # half | interleave | complex
    x: ast.expr  # rotated tensor as written
    cos: str  # cos/sin expressions as the fused call takes them
    sin: str
    cos_node: ast.expr | None
    sin_node: ast.expr | None
    x_text: str
    cos_info: _CosInfo = field(default_factory=_CosInfo)
    rotary_dim: str = "full"
    prep: list[str] = field(default_factory=list)  # statements computing cos/sin for the fused call
    x_dtype: str | None = None
    cs_dtype: str | None = None
    mode_expr: str | None = None  # rotary_mode chosen at run time (a helper picked by a condition)
    only_if: str | None = None  # fused only where this holds (the half choice of such a helper)
    suffix: str = ""  # appended to the fused call (the pair form keeps its [..., D/2, 2] shape)
    absorb: list = field(default_factory=list)  # statements the fused call replaces (named rotated halves)
    only_note: str = ""  # why the code outside ``only_if`` keeps the original
    lift: tuple[str, str, str] | None = None  # (x, cos, sin) names lifted to 4-D at run time
    lift_binds: list[str] = field(default_factory=list)  # statements binding them, inside the fused branch
    chosen_half: bool = False  # fused only where a run-time choice picks rotate_half
    matrix: bool = False  # the per-pair 2x2 rotation-matrix form
    producer: str = ""  # the module's function building that matrix
    # the site's enclosing ``if flag:`` in the block of the absorbed statements, and the statement inside it
    # that the fused code keeps (with the rope replaced): fused only where the flag takes that path
    anchor: ast.stmt | None = None
    site_stmt: ast.stmt | None = None
    inner_prep: list[str] = field(default_factory=list)  # statements inside the fused branch, before the call
    widen: str = ""  # a dtype the eager sum is promoted with too (a helper rotating in fp32)
    post: str = ""  # the original view/reshape applied to the fused result (same elements, same order)
    freqs: ast.expr | None = None  # the complex form's freqs operand (a product bound to a name elsewhere)
    # the rotation is a lambda's body or a comprehension's element: the fused statements go into a
    # local def called there
    local: "_LocalFn | None" = None
    # x above 4-D may run fused with its leading axes merged into one (cos/sin 1 along them, checked at
    # run time; see _merged_lead_rank_ok): the fused call reshapes x/cos/sin to 4-D and restores x's axes
    merge_lead: bool = False
    table_rank_check: str = ""  # the run-time ``cos.dim() <= 4`` of the interleave check, widened when merging
    extra_risks: list = field(default_factory=list)  # Risk entries this form adds (a float64 rotation computed in fp32)
    # the fused result placed in an expression (``{}`` the fused call): a rotated prefix filled into a tensor
    # shaped like x, joined with what the fills leave after it (``torch.cat(({}, x[..., u:]), dim=-1)``); a site
    # whose value spans statements up to a returned merge (``return {}``)
    wrap: str = "{}"


@dataclass
class _LocalFn:
    """A rotation inside a lambda or a comprehension, rewritten as a local function of ``param``
    returning ``body`` (the fused statements inside it), with ``replace`` (a node of the statement)
    replaced by ``call`` (``{fn}`` formatted with the function's name)."""

    kind: str  # "lambda" | "comprehension"
    param: str
    body: ast.expr
    replace: ast.AST
    call: str
    text: str  # the lambda / comprehension as written (report)
    iterable: ast.expr | None  # what it is applied to: the first named tensor there is the guard


def _is_float_cast(node: ast.AST) -> bool:
    return _method(node, "float") or (_method(node, "to") and bool(node.args) and ast.unparse(node.args[0]).endswith("float32"))


def _einops_pairs_source(node: ast.AST) -> ast.expr | None:
    """t of ``rearrange(t, "... (d two) -> ... d two", two=2)`` (or ``(d 2) -> d 2``): the last dim cut into
    [d, 2], consecutive elements paired like ``t.reshape(*t.shape[:-1], -1, 2)``; None otherwise."""
    if not (isinstance(node, ast.Call) and (dotted(node.func) or "").split(".")[-1] == "rearrange" and len(node.args) == 2):
        return None
    pattern = const_value(node.args[1])
    if not isinstance(pattern, str) or pattern.count("->") != 1:
        return None
    lhs, rhs = (side.replace("(", " ( ").replace(")", " ) ").split() for side in pattern.split("->"))
    if len(lhs) < 4 or lhs[-4] != "(" or lhs[-1] != ")" or len(rhs) < 2 or rhs[-2:] != lhs[-3:-1] or lhs[:-4] != rhs[:-2] \
            or "(" in lhs[:-4] or "(" in rhs[:-2]:
        return None
    two = lhs[-2]
    if not (two == "2" or _is_int(keyword(node, two), 2)):
        return None
    return node.args[0]


def _pairs_view(node: ast.AST) -> bool:
    """``t.reshape(..., 2)`` / ``t.view(..., 2)`` / ``t.unflatten(-1, (-1, 2))`` / einops ``(d two) -> d two``:
    consecutive elements paired."""
    if _method(node, "reshape", "view") and node.args and _is_int(node.args[-1], 2):
        return True
    if _einops_pairs_source(node) is not None:
        return True
    if _method(node, "unflatten") and len(node.args) == 2 and _is_int(node.args[0], -1):
        sizes = node.args[1]
        return isinstance(sizes, (ast.Tuple, ast.List)) and len(sizes.elts) == 2 and _is_int(sizes.elts[1], 2)
    return False


def _complex_pairs(scope: Scope, pairs: ast.expr, line: int, allow_f64: bool = False) -> tuple[ast.expr, str | None] | str:
    """(x, cast) when ``view_as_complex(pairs)`` reads lane pairs of x: ``pairs`` is (through local
    names and float casts) ``x.reshape(..., 2)`` / ``x.view(..., 2)`` — a trailing 2 on a view groups
    consecutive elements, the lanes (2i, 2i+1) of an even last dim. A name rebound on several paths
    (nanotron's ``if x.dtype == torch.bfloat16: x = x.float()``) is followed only when every binding
    is that view or a cast of the name itself; the dtype is then unknown (None)."""
    cast: str | None = None
    node = pairs
    certain = True
    for _ in range(8):
        if isinstance(node, ast.Name):
            defs = [(st, v) for st, v in scope.assignments.get(node.id, []) if st.lineno < line]
            if not defs:
                break
            if len(defs) > 1:
                # every earlier binding must be the pairs view itself or a cast of the name
                for _st, v in defs:
                    inner, casts = strip_casts(v)
                    if not (_pairs_view(v)
                            or (casts and isinstance(inner, ast.Name) and inner.id == node.id)):
                        return "complex rope over a tensor rebound on several paths: its lane pairs cannot be proven"
                certain = False
            line = defs[-1][0].lineno
            node = defs[-1][1]
            continue
        if _is_float_cast(node):
            cast = "float32"
            node = node.func.value
            continue
        break
    if not _pairs_view(node):
        node = _rope_s46h.shape_spelled_out(scope, node, line) or node  # s46h: `x.reshape(shape)`, shape built apart
    if not _pairs_view(node):
        return "complex rope whose pairs are not formed by reshape(..., -1, 2) on the last dim: not recognised"
    x = _einops_pairs_source(node) or node.func.value  # type: ignore[attr-defined]
    if _is_float_cast(x):
        cast = "float32"
    if _method(x, "double") or (_method(x, "to", "type") and x.args and ast.unparse(x.args[0]) in ("torch.float64", "torch.double")):
        if allow_f64:
            return x, "float64"  # the caller fuses it in fp32 under a run-time dtype check (_float64_in_fp32) or refuses
        return (f"complex rope computed in float64 (`{ast.unparse(x)}`): npu_rotary_mul takes fp16/bf16/fp32 only, "
                "and computing in fp32 instead would change the numbers this code asks for")
    return x, (cast if certain else None)


def _is_view_as_complex(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and ((isinstance(node.func, ast.Attribute) and node.func.attr == "view_as_complex")
                                           or (isinstance(node.func, ast.Name) and node.func.id == "view_as_complex"))


def _calls_view_as_real(call: ast.Call) -> bool:
    """``torch.view_as_real(..)`` / a bare ``view_as_real(..)`` (cheap: no unparse per node)."""
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "view_as_real") or (isinstance(f, ast.Name) and f.id == "view_as_real")


def _sized_by_leading_dims(scope: Scope, table: ast.expr, x: ast.expr, pairs: ast.expr) -> ast.Call | None:
    """The ``reshape`` / ``view`` (through names) that gives ``table`` x's first two dims as its first two
    sizes (``cache.reshape(xs.shape[0], xs.shape[1], 1, d, 2)``, xs being x or its pairs view): a table
    that varies with the batch by construction. None otherwise."""
    r = _resolve(scope, table)
    r = strip_casts(r)[0] if isinstance(r, ast.Call) else r  # (`.reshape(...).to(torch.float32)`)
    if not (_method(r, "reshape", "view") and len(r.args) >= 3 and not any(isinstance(a, ast.Starred) for a in r.args)):
        return None
    x_base = strip_casts(x)[0]

    def dim_of_x(node: ast.expr) -> int | None:
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
            owner, k = node.value.value, const_value(node.slice)
        elif _method(node, "size") and len(node.args) == 1:
            owner, k = node.func.value, const_value(node.args[0])
        else:
            return None
        seen = _resolve(scope, owner)
        if seen is pairs or same_expr(strip_casts(owner)[0], x_base) or same_expr(strip_casts(seen)[0], x_base):
            return k if isinstance(k, int) and not isinstance(k, bool) else None
        return None
    return r if (dim_of_x(r.args[0]), dim_of_x(r.args[1])) == (0, 1) else None


def _keeps_lead_dim(scope: Scope, node: ast.expr) -> bool:
    """The table is built here by an indexing that keeps the caller's leading dim and inserts a
    broadcast axis after it (HF GPT-J's ``sin[:, :, None, :]`` of [B, S, D/2]): a batch-dependent
    layout written out, not a layout this function cannot see."""
    for _ in range(6):
        val = _resolve(scope, node)
        for n in fast_walk(val):
            if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Tuple) and n.slice.elts:
                first = n.slice.elts[0]
                if isinstance(first, ast.Slice) and first.lower is None and first.upper is None \
                        and any(isinstance(e, ast.Constant) and e.value is None for e in n.slice.elts):
                    return True
        inner = val.args[0] if isinstance(val, ast.Call) and val.args and isinstance(val.args[0], ast.Name) else None
        if inner is None or inner is node:
            return False
        node = inner
    return False


def _s43_bound_per_branch(scope: Scope, table: ast.expr) -> bool:
    """s43 (sweep42 CS336 ``RotaryEmbedding.forward``: ``if positions.dim() == 1: cos = cos.view(1, 1, S, -1)`` /
    ``elif positions.dim() == 2: cos = cos[:, None, :, :]``): the table name reaches the site from several branches, one
    of which builds it without the caller's leading dim. The layout then depends on the branch taken: left to the
    run-time check of :meth:`RopePattern._interleave_checked` (exact on every branch; the fused call runs where the
    tables are batch-free), where one batch-dependent binding alone stays refused."""
    if not isinstance(table, ast.Name):
        return False
    held = _stmt_of(scope, table)
    if held is None:
        return False
    defs, complete = scope.reaching_definitions(table.id, held[2])
    if not complete or len(defs) < 2 or not all(isinstance(d, ast.Assign) and len(d.targets) == 1 for d in defs):
        return False
    return any(not _keeps_lead_dim(scope, d.value) for d in defs)  # type: ignore[attr-defined]


def _named_complex_product(scope: Scope, node: ast.Call) -> tuple[ast.Assign, ast.BinOp] | None:
    """``view_as_real(name)`` where ``name = a * b`` is bound once before, one factor a
    ``view_as_complex(..)`` (through names): (that assignment, the product)."""
    if len(node.args) != 1 or not isinstance(node.args[0], ast.Name):
        return None
    defs = [(st, v) for st, v in scope.assignments.get(node.args[0].id, []) if st.lineno < node.lineno]
    if len(defs) != 1:
        return None
    st, prod = defs[0]
    if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
            and isinstance(prod, ast.BinOp) and isinstance(prod.op, ast.Mult)):
        return None
    for f in (prod.left, prod.right):
        val = _resolve(scope, f)
        if isinstance(val, ast.Call) and ast.unparse(val.func).endswith("view_as_complex"):
            return st, prod
    return None


def _flat_factors(node: ast.expr) -> list[ast.expr]:
    """The factors of a product chain ``a * b * c`` (left to right); ``[node]`` when not a product."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _flat_factors(node.left) + _flat_factors(node.right)
    return [node]


def _product(factors: list[ast.expr]) -> ast.expr:
    """One factor as written, or the product of several (rotary-embedding-torch's ``cos * scale``): a new
    node without a position, written out by ``ast.unparse`` and evaluated once into a name by the lift."""
    if len(factors) == 1:
        return factors[0]
    out = factors[0]
    for f in factors[1:]:
        out = ast.BinOp(left=out, op=ast.Mult(), right=f)
    return out


def _mult_factors(node: ast.expr) -> tuple[ast.expr, ast.expr] | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return node.left, node.right
    return None


def _is_product(node: ast.expr, u: ast.expr, v: ast.expr) -> bool:
    f = _mult_factors(node)
    return f is not None and ((same_expr(f[0], u) and same_expr(f[1], v)) or (same_expr(f[0], v) and same_expr(f[1], u)))


def _stacked_pair(call: ast.AST) -> ast.Call | None:
    """The ``torch.stack([a, b], dim=-1)`` of ``torch.stack([a, b], dim=-1).flatten(3 | -2)``: lane
    pairs (a_i, b_i) merged back into the last dim, a interleaved with b."""
    if not (_method(call, "flatten") and isinstance(call.func.value, ast.Call)):  # type: ignore[union-attr]
        return None
    start, end = keyword(call, "start_dim", 0), keyword(call, "end_dim", 1)  # type: ignore[arg-type]
    inner = call.func.value  # type: ignore[union-attr]
    if not (_is_int(start, -2, 3) and (end is None or _is_int(end, -1))):
        return None
    if _pair_of(inner, _STACK) is None or not _is_int(keyword(inner, "dim", 1), -1):
        return None  # (a stack at dim 3 of 4-D parts would put the pair axis before D/2: halves, not lanes)
    return inner


def _named_pair(call: ast.Call) -> tuple[ast.Name, ast.Name] | None:
    """(y1, y2) of ``torch.cat([y1, y2], <last dim>)`` (halves) or ``torch.stack([y1, y2], -1).flatten(-2)``
    (llama2.c: lane pairs) with two plain names."""
    stacked = _stacked_pair(call)
    if stacked is not None:
        pair = _pair_of(stacked, _STACK)
        return pair if pair is not None and all(isinstance(p, ast.Name) for p in pair) else None  # type: ignore[return-value]
    unmerged = _unmerged_lane_stack(call) if isinstance(call, ast.Call) else None
    if unmerged is not None:
        # ``stack((y_re, y_im), -1)`` left as [.., D/2, 2] (merged, if at all, by code around it that stays)
        return unmerged if all(isinstance(p, ast.Name) for p in unmerged) else None  # type: ignore[return-value]
    pair = _pair_of(call, _CAT) if isinstance(call, ast.Call) else None
    if pair is not None and not all(isinstance(p, ast.Name) for p in pair):
        pair = _uncast_named_pair(pair)
    if pair is None or not all(isinstance(p, ast.Name) for p in pair):
        return None
    return pair  # type: ignore[return-value]


def _signed_products(node: ast.expr) -> list[tuple[int, ast.expr, ast.expr]] | None:
    """``±u*v ± w*z`` as [(sign, u, v), (sign, w, z)]."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub))):
        return None
    out = []
    for term, sign in ((node.left, 1), (node.right, 1 if isinstance(node.op, ast.Add) else -1)):
        if isinstance(term, ast.UnaryOp) and isinstance(term.op, ast.USub):
            term, sign = term.operand, -sign
        f = _mult_factors(term)
        if f is None:
            return None
        out.append((sign, f[0], f[1]))
    return out


def _lane(node: ast.AST, k: int) -> ast.expr | None:
    """``t`` of ``t[..., k]``."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 2:
        e0, e1 = node.slice.elts
        if isinstance(e0, ast.Constant) and e0.value is Ellipsis and _is_int(e1, k):
            return node.value
    return None


def _lane_pair_formula(node: ast.AST) -> tuple[ast.expr, ast.expr] | None:
    """``stack([p0*c0 - p1*c1, p1*c0 + p0*c1], -1)`` with ``p = xs[..., k]`` and ``c = cache[..., k]``
    (factors in any order): returns (xs, cache)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "stack"):
        return None
    seq = node.args[0] if node.args else keyword(node, "tensors")
    dim = keyword(node, "dim", 1)
    if not (isinstance(seq, (ast.List, ast.Tuple)) and len(seq.elts) == 2 and _is_int(dim, -1)):
        return None
    first, second = seq.elts
    if not (isinstance(first, ast.BinOp) and isinstance(first.op, ast.Sub) and isinstance(second, ast.BinOp) and isinstance(second.op, ast.Add)):
        return None

    def lanes(prod: ast.expr) -> tuple[tuple[ast.expr, int], tuple[ast.expr, int]] | None:
        f = _mult_factors(prod)
        if f is None:
            return None
        out = []
        for t in f:
            for k in (0, 1):
                base = _lane(t, k)
                if base is not None:
                    out.append((base, k))
                    break
            else:
                return None
        return out[0], out[1]

    terms = [lanes(t) for t in (first.left, first.right, second.left, second.right)]
    if any(t is None for t in terms):
        return None
    # each product is one lane of xs times one lane of the cache: find which base is xs
    bases = {ast.dump(b) for t in terms for b, _k in t}  # type: ignore[union-attr]
    if len(bases) != 2:
        return None
    want = [(0, 0), (1, 1), (1, 0), (0, 1)]  # xs0*c, xs1*s, xs1*c, xs0*s
    for x_dump in bases:
        got = []
        for t in terms:
            (b0, k0), (b1, k1) = t  # type: ignore[misc]
            if ast.dump(b0) == x_dump and ast.dump(b1) != x_dump:
                got.append((k0, k1))
            elif ast.dump(b1) == x_dump and ast.dump(b0) != x_dump:
                got.append((k1, k0))
            else:
                got.append(None)
        if got == want:
            (b0, _), (b1, _) = terms[0]  # type: ignore[misc]
            xs, cache = (b0, b1) if ast.dump(b0) == x_dump else (b1, b0)
            return xs, cache
    return None


def _pair_formula(node: ast.AST) -> tuple[str, ast.expr, ast.expr, ast.expr, ast.expr] | None:
    """The rotation written out on two parts a, b of x with half-size c, s:
    ``cat([a*c - b*s, b*c + a*s], -1)`` ('cat': DeepSeek's even/odd lanes, gpt-oss's halves) or
    ``stack([...], -1).flatten(-2)`` ('stack': interleaved pairs). Returns (how, a, b, c, s)."""
    merged = canonical.merges_last_two(node)  # .flatten(-2) / .flatten(-2, -1) / torch.flatten(t, -2)
    if isinstance(merged, ast.Call):
        how, pair = "stack", _pair_of(merged, _STACK)
    elif isinstance(node, ast.Call):
        how, pair = "cat", _pair_of(node, _CAT)
        if pair is None:
            how, pair = "pairs", _unmerged_lane_stack(node)
    else:
        return None
    if pair is None:
        return None
    first, second = pair
    if not (isinstance(first, ast.BinOp) and isinstance(first.op, ast.Sub) and isinstance(second, ast.BinOp) and isinstance(second.op, ast.Add)):
        return None
    f1, f2 = _mult_factors(first.left), _mult_factors(first.right)
    if f1 is None or f2 is None:
        return None
    for a, c in (f1, f1[::-1]):
        for b, s_ in (f2, f2[::-1]):
            for p, q in ((second.left, second.right), (second.right, second.left)):
                if _is_product(p, b, c) and _is_product(q, a, s_):
                    return how, a, b, c, s_
    return None


def _read_before_rebound(scope: Scope, name: str, line: int) -> bool:
    """Is ``name``'s value after ``line`` read before it is bound again? (vLLM's golden code reuses
    o1/o2 for the key after the query: those later reads see new values). By reaching definition
    (:meth:`Scope.uses_after`): a rebinding in one arm of an ``if`` does not hide a read after the ``if``."""
    return scope.uses_after(name, line)


def _bound_on_a_branch(scope: Scope, name: ast.Name) -> bool:
    """Is the binding of ``name`` that textually precedes its use made inside a compound statement
    (if / loop / with / try) that does not also hold the use, so another binding may reach it?"""
    line = getattr(name, "lineno", None)
    defs = [st for st, _v in scope.assignments.get(name.id, []) if line is None or st.lineno < line]
    if len(defs) < 2 and not (defs and _if_path(scope, defs[-1])):
        return False
    use = _stmt_of(scope, name)
    if use is None or not defs:
        return False
    around_use = {id(o) for o, _b, _c in _if_path(scope, use[2])}
    return any(id(o) not in around_use for o, _b, _c in _if_path(scope, defs[-1]))


def _stable_test(scope: Scope, test: ast.expr) -> bool:
    """A branch test that reads the same wherever it is evaluated in the scope: no calls, and no
    name the scope assigns (a parameter flag, ``self.is_neox_style``)."""
    for n in fast_walk(test):
        if isinstance(n, (ast.Call, ast.NamedExpr, ast.Await)):
            return False
        if isinstance(n, ast.Name) and n.id in scope.assignments:
            return False
    return True


def _if_path(scope: Scope, stmt: ast.stmt) -> list[tuple[ast.If, bool, ast.stmt]]:
    """The ``if`` statements around ``stmt`` (innermost first): (the If, stmt is in its body, the child
    of the If on the way down)."""
    listing, owners = scope.listing()
    index = scope.__dict__.get("_rope_stmt_index")
    if index is None:
        index = scope.__dict__["_rope_stmt_index"] = {id(st): k for k, (_b, _i, st) in enumerate(listing)}
    out = []
    cur = stmt
    for _ in range(32):
        k = index.get(id(cur))
        owner = owners[k] if k is not None else None
        if owner is None:
            break
        if isinstance(owner, ast.If):
            out.append((owner, any(cur is st for st in owner.body), cur))
        else:
            out.append((owner, False, cur))  # a loop / with / try on the way: not a flag path
        cur = owner
    return out


def _stmt_of(scope: Scope, node: ast.AST) -> tuple[list[ast.stmt], int, ast.stmt] | None:
    """The innermost simple statement holding ``node``."""
    best = None
    end = node.end_lineno or node.lineno
    last = None
    for block, i, st in scope.listing()[0]:
        if isinstance(st, _COMPOUND_STMTS):
            continue
        if st.lineno <= node.lineno and end <= (st.end_lineno or st.lineno):
            best = (block, i, st)
        elif node.lineno <= st.lineno <= end <= (st.end_lineno or st.lineno):
            last = (block, i, st)
    # a value read from several statements (``res = empty_like(x); res[..., ::2], res[..., 1::2] = a, b`` as one
    # stack, _filled_lanes_site) is held by none: the statement it ends in, where its parts are last read
    return best if best is not None else last


_COMPOUND_STMTS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _branch_anchor(scope: Scope, node: ast.AST, first_def: ast.stmt) -> tuple[ast.stmt | None, str | None, ast.stmt | None, Scope]:
    """(anchor, condition, site statement, scope seen on the path) for a site using names defined by
    ``first_def``: the anchor is the statement of first_def's block that holds the site — the site
    itself, or ``if flag:`` statements (one statement per branch on the way) whose stable flags make the
    condition. The path scope drops bindings made on the other side of the same flags."""
    found = _stmt_of(scope, node)
    if found is None:
        return None, None, None, scope
    _block, _i, site = found
    listing, _owners = scope.listing()
    def_block = next((b for b, _j, st in listing if st is first_def), None)
    if def_block is None:
        return None, None, None, scope
    if any(st is site for st in def_block):
        return site, None, site, scope
    conds: list[tuple[str, bool]] = []
    texts: list[str] = []
    for owner, in_body, child in _if_path(scope, site):
        branch = owner.body if in_body else getattr(owner, "orelse", [])
        # the branch holding the site directly may hold more statements (q's and k's sites: _anchor_group;
        # the fused path is that branch with its sites replaced); a branch further out only the inner ``if``
        innermost = child is site
        if not isinstance(owner, ast.If) or not _stable_test(scope, owner.test) or \
                not (any(st is child for st in branch) if innermost else (len(branch) == 1 and branch[0] is child)):
            return None, None, None, scope
        conds.append((ast.dump(owner.test), in_body))
        texts.append(ast.unparse(owner.test) if in_body else f"not {_atom(ast.unparse(owner.test))}")
        if any(st is owner for st in def_block):
            path = scope.__dict__.setdefault("_rope_path_scopes", {})
            key = tuple(conds)
            if key not in path:
                filtered = {}
                for name, binds in scope.assignments.items():
                    filtered[name] = [(st, v) for st, v in binds
                                      if not any(ast.dump(o.test) == t and b != br for o, b, _c in _if_path(scope, st)
                                                 if isinstance(o, ast.If) for t, br in conds)]
                restricted = Scope(scope.qualname, scope.node, scope.class_name, scope.body)
                restricted.assignments = filtered
                path[key] = restricted
            return owner, " and ".join(reversed(texts)), site, path[key]
    return None, None, None, scope


def _complex_halves(scope: Scope, xc: ast.expr) -> ast.expr | None:
    """t of ``view_as_complex(stack(chunk(t, 2, -1), -1))`` (also ``t.chunk(2, dim=-1)``, through a
    local name): complex numbers whose real parts are t's first half and imaginary parts its second."""
    v = _resolve(scope, xc)
    if not (isinstance(v, ast.Call) and ast.unparse(v.func).endswith("view_as_complex") and len(v.args) == 1):
        return None
    st = _resolve(scope, v.args[0])
    regrouped = _halves_regrouped_as_pairs(scope, st)
    if regrouped is not None:
        return regrouped
    if not (isinstance(st, ast.Call) and isinstance(st.func, ast.Attribute) and st.func.attr == "stack" and st.args
            and _is_int(keyword(st, "dim", 1), -1)):
        return None
    ch = st.args[0]
    if not (isinstance(ch, ast.Call) and isinstance(ch.func, ast.Attribute) and ch.func.attr == "chunk"):
        return None
    if isinstance(ch.func.value, ast.Name) and ch.func.value.id == "torch":
        if not ch.args:
            return None
        t, rest = ch.args[0], ch.args[1:]
    else:
        t, rest = ch.func.value, list(ch.args)
    n = rest[0] if rest else keyword(ch, "chunks")
    dim = rest[1] if len(rest) > 1 else keyword(ch, "dim")
    return t if _is_int(n, 2) and _is_int(dim, -1) else None


def _halves_regrouped_as_pairs(scope: Scope, node: ast.expr) -> ast.expr | None:
    """t of ``t.reshape(*t.shape[:-1], 2, -1).transpose(-2, -1)`` (also ``view``, ``unflatten(-1, (2, -1))``,
    ``.contiguous()`` after it, through local names; AWQ's fused llama/qwen2 attention): the [.., D/2, 2]
    pairs (t_i, t_{i + D/2}) of t's two halves, the complex numbers of gemma's ``stack(chunk(t, 2, -1), -1)``."""
    for _ in range(4):
        node = _resolve(scope, node)
        if _method(node, "contiguous") and not node.args:
            node = node.func.value
            continue
        break
    if not (_method(node, "transpose") and len(node.args) == 2 and not node.keywords
            and {const_value(a) for a in node.args} == {-1, -2}):
        return None
    grouped = _resolve(scope, node.func.value)
    if _method(grouped, "unflatten") and len(grouped.args) == 2 and _is_int(grouped.args[0], -1) \
            and isinstance(grouped.args[1], (ast.Tuple, ast.List)) and len(grouped.args[1].elts) == 2 \
            and _is_int(grouped.args[1].elts[0], 2) and _is_int(grouped.args[1].elts[1], -1):
        return grouped.func.value
    if not (_method(grouped, "reshape", "view") and len(grouped.args) == 3 and _is_int(grouped.args[1], 2) and _is_int(grouped.args[2], -1)):
        return None
    owner, t = _lead_shape_of(grouped.args[0]), grouped.func.value
    # ``*t.shape[:-1]`` of t or of t before a cast (``xq.float().reshape(*xq.shape[:-1], 2, -1)``)
    if owner is None or not (same_expr(owner, t) or same_expr(owner, strip_casts(t)[0])):
        return None
    return t


def _lead_shape_of(node: ast.expr) -> ast.expr | None:
    """t of the starred ``*t.shape[:-1]`` (all of t's dims but the last, whatever t's rank), else None."""
    if isinstance(node, ast.Starred) and isinstance(node.value, ast.Subscript) and isinstance(node.value.slice, ast.Slice) \
            and node.value.slice.lower is None and _is_int(node.value.slice.upper, -1) and node.value.slice.step is None \
            and isinstance(node.value.value, ast.Attribute) and node.value.value.attr == "shape":
        return node.value.value.value
    return None


def _matrix_pairs(scope: Scope, node: ast.expr) -> ast.expr | None:
    """x of ``x.reshape(*x.shape[:-1], -1, 1, 2)`` (also ``view``, through a local name): each lane
    pair of x as a 1x2 row, ready to meet a per-pair 2x2 matrix (flux / lingua)."""
    p = _resolve(scope, node)
    # a cast of the pairs view (``x.reshape(..., -1, 1, 2).to(torch.float32)``) casts every lane alike
    p = strip_casts(p)[0] if isinstance(p, ast.Call) else p
    if not (_method(p, "reshape", "view") and len(p.args) == 4 and _is_int(p.args[-1], 2) and _is_int(p.args[-2], 1)
            and _is_int(p.args[-3], -1) and isinstance(p.args[0], ast.Starred)):
        return None
    x = p.func.value
    lead = p.args[0].value
    if not (isinstance(lead, ast.Subscript) and isinstance(lead.value, ast.Attribute) and lead.value.attr == "shape"
            and isinstance(lead.slice, ast.Slice) and lead.slice.lower is None and _is_int(lead.slice.upper, -1)
            and lead.slice.step is None and same_expr(strip_casts(lead.value.value)[0], strip_casts(x)[0])):
        return None
    return x


def _pairs_cast_dtype(view: ast.Call) -> str | None:
    """The dtype (as text) of the outermost cast on a pairs view: ``.float()`` / ``.half()`` /
    ``.bfloat16()`` / ``.double()`` or ``.to(torch.<dtype>)``; None for any other cast (``type_as``,
    ``.to(other)``), whose dtype is not known from the text."""
    f = view.func
    if not isinstance(f, ast.Attribute):
        return None
    named = {"float": "torch.float32", "half": "torch.float16", "bfloat16": "torch.bfloat16", "double": "torch.float64"}
    if f.attr in named and not view.args and not view.keywords:
        return named[f.attr]
    if f.attr == "to" and len(view.args) == 1 and not view.keywords:
        d = dotted(view.args[0]) or ""
        if d in ("torch.float32", "torch.float", "torch.float16", "torch.half", "torch.bfloat16", "torch.float64", "torch.double"):
            return d
    return None


def _matrix_formula(scope: Scope, node: ast.AST) -> tuple[ast.expr, ast.expr, ast.expr | None] | None:
    """The per-pair 2x2 matrix product ``out[..., i] = sum_j F[..., i, j] * x[..., j]`` over the lane pairs
    of x, as (pairs, F, sum-dim): flux's ``F[..., 0] * xp[..., 0] + F[..., 1] * xp[..., 1]`` (sum-dim
    None) or lingua's ``(xp * F).sum(k)``, with ``xp = x.reshape(*x.shape[:-1], -1, 1, 2)``."""
    if _method(node, "sum") and len(node.args) + len(node.keywords) == 1:
        dim = keyword(node, "dim", 0)
        prod = node.func.value
        if not (isinstance(prod, ast.BinOp) and isinstance(prod.op, ast.Mult) and isinstance(const_value(dim), int)):
            return None
        for p, f in ((prod.left, prod.right), (prod.right, prod.left)):
            if _matrix_pairs(scope, p) is not None:
                return p, f, dim
        return None
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)):
        return None
    terms = []
    for t in (node.left, node.right):
        f = _mult_factors(t)
        if f is None:
            return None
        terms.append(f)
    found = []
    for a, b in terms:
        for p, f in ((a, b), (b, a)):
            lp, lf = _lane(p, 0), _lane(f, 0)
            k = 0
            if lp is None or lf is None:
                lp, lf, k = _lane(p, 1), _lane(f, 1), 1
            if lp is not None and lf is not None and _matrix_pairs(scope, lp) is not None:
                found.append((k, lp, lf))
                break
        else:
            return None
    if sorted(k for k, _p, _f in found) != [0, 1] or not (same_expr(found[0][1], found[1][1]) and same_expr(found[0][2], found[1][2])):
        return None
    return found[0][1], found[0][2], None


def _rotation_matrix_producer(module: ModuleInfo) -> str | None:
    """A function of this module that builds the per-pair rotation matrix [[cos, -sin], [sin, cos]] as
    ``stack((cos, -sin, sin, cos), -1)`` (then viewed as 2x2): its name, else None. Computed once."""
    cached = module.__dict__.get("_rope_matrix_producer", 0)
    if cached != 0:
        return cached
    found = None
    if "stack(" in module.source:
        for sc in module.scopes:
            if not isinstance(sc.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for n in fast_walk(sc.node):
                if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "stack" and n.args
                        and isinstance(n.args[0], (ast.Tuple, ast.List)) and len(n.args[0].elts) == 4):
                    continue
                a, nb, b, a2 = n.args[0].elts
                neg = nb.operand if isinstance(nb, ast.UnaryOp) and isinstance(nb.op, ast.USub) else None
                if neg is None or not same_expr(a, a2) or not same_expr(neg, b):
                    continue
                ra, rb = _resolve(sc, a), _resolve(sc, b)

                def trig(e: ast.expr, name: str) -> bool:
                    return (_method(e, name) and not e.args) or (isinstance(e, ast.Call) and ast.unparse(e.func) in (f"torch.{name}", f"math.{name}", f"np.{name}"))
                if trig(ra, "cos") and trig(rb, "sin"):
                    found = f"{sc.qualname} (line {n.lineno})"
                    break
            if found:
                break
    module.__dict__["_rope_matrix_producer"] = found
    return found


def _read_names(m: "_Match") -> set[str]:
    """The names the fused code of ``m`` reads (x, cos, sin and the statements preparing them)."""
    out: set[str] = set()
    for text in [m.x_text, m.cos, m.sin, *m.prep, *m.inner_prep]:
        try:
            tree = ast.parse(text.strip())
        except SyntaxError:
            return {"<unreadable>"}
        out |= {n.id for n in fast_walk(tree) if isinstance(n, ast.Name) and not n.id.startswith("_npufuse_")}
    return out


def _rebound_since_parts(scope: Scope, node: ast.Call, m: "_Match") -> str | None:
    """Why the fused call of the named parts ``cat([y1, y2])`` may not replace the site: it reads x and the
    tables where the site is, while the parts read them at their own lines; a name the fused code reads (and
    the site statement itself does not) bound again between the first part and the site holds another value
    there. None where nothing is."""
    y1, y2 = _named_pair(node)  # type: ignore[misc]
    here = _stmt_of(scope, node)
    if here is None:
        return None
    site = here[2]
    # the binding of each part that reaches the site (the last one before it, as _match_named_halves reads)
    starts = [max((st.lineno for st, _v in scope.assignments.get(y.id, []) if st.lineno < site.lineno), default=None) for y in (y1, y2)]
    if None in starts:
        return None
    first = min(starts)  # type: ignore[type-var]
    # (the names the replaced expression itself reads are read at the site by the original code too)
    at_site = {n.id for n in fast_walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    for name in sorted(_read_names(m) - at_site):
        later = [st.lineno for st, _v in scope.assignments.get(name, []) if first < st.lineno < site.lineno]
        if later:
            return (f"the rotated parts `{y1.id}`, `{y2.id}` are computed before `{name}` is bound again (line {later[0]}), "
                    "and the fused call would read it at the site: not replaced")
    return None


def _flush_unabsorbed(runs: list, pending: list) -> list[tuple[ast.stmt, str]]:
    """Sites whose part statements are not right before them (AWQ's ``xq_ = view_as_complex(..)`` with the
    table lookups in between) become plain sites: the part statements stay where they are (the fused call
    no longer reads them), instead of the sites being dropped without a word. The fused call reads x and the
    tables at the site, so a name among them bound by a statement between the parts and the site (it may hold
    another value there) and not read by the replaced expression itself makes the site a near miss instead:
    returned as (statement, reason)."""
    refused: list[tuple[ast.stmt, str]] = []
    for block, i, stmt, ms in pending:
        first = min((j for j, st in enumerate(block) for m in ms for a in m.absorb if a is st), default=i)
        between = set().union(*(bound_names(st) for st in block[first:i])) if first < i else set()
        # names the replaced expressions read are read at the site by the original code as well; the others it
        # read only through the part statements, at their lines
        at_site = {n.id for m in ms for n in fast_walk(m.node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        rebound = sorted(between & (set().union(*(_read_names(m) for m in ms)) - at_site))
        if rebound:
            refused.append((stmt, f"the rotated parts are computed before `{rebound[0]}` is bound again (line "
                                  f"{next(st.lineno for st in block[first:i] if rebound[0] in bound_names(st))}), and the "
                                  "fused call would read it at the site: not replaced"))
            continue
        for m in ms:
            m.absorb = []
        if runs and runs[-1][0] is block and runs[-1][1][-1][0] == i - 1:
            runs[-1][1].append((i, stmt, ms))
        else:
            runs.append((block, [(i, stmt, ms)]))
    pending.clear()
    return refused


def _doubled_half_tables(module: ModuleInfo, cos: ast.expr, sin: ast.expr, negate: bool, negate_note: str) -> tuple[list[str], tuple[str, str]]:
    """(statements, (cos name, sin name)) widening half-size tables to the full head dim as ``cat((t, t))`` (sin
    negated where the written rotation is by -angle, ``negate_note`` saying how the code shows it)."""
    tag = _ident(segment(module, cos))
    cs = [segment(module, cos), segment(module, sin)]
    full = (f"_npufuse_{tag}_cos_full", f"_npufuse_{tag}_sin_full")
    sin_half = f"-{_atom(cs[1])}" if negate else _atom(cs[1])
    return [f"{full[0]} = torch.cat(({_atom(cs[0])}, {_atom(cs[0])}), dim=-1)  # half-size cos/sin -> the full head dim",
            f"{full[1]} = torch.cat(({sin_half}, {sin_half}), dim=-1)" + (f"  # {negate_note}" if negate else "")], full


# --- s42: half rotation with the TABLES split into halves too ------------------------------------------------------
# ``x1, x2 = x.chunk(2, -1); cos1, cos2 = cos.chunk(2, -1); sin1, sin2 = sin.chunk(2, -1)``,
# ``y1 = x1*cos1 - x2*sin1; y2 = x2*cos2 + x1*sin2; cat((y1, y2), -1)``. npu_rotary_mul's half mode computes
# ``x*cos + rotate_half(x)*sin`` = ``[x1*cos[:h] - x2*sin[:h], x2*cos[h:] + x1*sin[h:]]`` (spec 4.1): with the tables
# the halves were cut from, passed whole, that is exactly the written code whatever the two halves hold (equal
# halves, ``cat((freqs, freqs))``, are not needed). The fused call runs where each table is as wide as x (so its
# halves are cut at x's split point), the original code elsewhere.
def _s42_table_halves(module: ModuleInfo, scope: Scope, line: int, pair: tuple[ast.expr, ast.expr]) -> tuple[ast.expr, list[str], bool] | None:
    """(the table, run-time split checks, swapped) where ``pair`` is the (first, second) half of one table's last dim,
    or (s43) its (second, first) half: ``swapped``, the table passed with its halves exchanged."""
    lane = canonical.lane_of(module, scope, pair[0], line)
    if lane is None or lane.kind != "halves":
        return None
    table = lane.source
    halves = _Halves(scope, lambda n: same_expr(n, table), module)
    halves.allow_split = True
    parts = (halves.part(pair[0]), halves.part(pair[1]))
    if parts not in (("first", "second"), ("second", "first")) or halves.prefix is not None:
        return None
    return table, list(halves.split_checks), parts == ("second", "first")


def _s42_split_tables(module: ModuleInfo, scope: Scope, line: int, cos_pair: tuple[ast.expr, ast.expr],
                      sin_pair: tuple[ast.expr, ast.expr]) -> tuple[ast.expr, ast.expr, list[str], tuple[bool, bool]] | None:
    """(cos table, sin table, split checks, (cos swapped, sin swapped)) of a rotation whose cos / sin factors are the
    halves of two tables."""
    c = _s42_table_halves(module, scope, line, cos_pair)
    s = _s42_table_halves(module, scope, line, sin_pair) if c is not None else None
    if c is None or s is None:
        return None
    return c[0], s[0], c[1] + s[1], (c[2], s[2])


def _s42_split_table_match(pattern: "RopePattern", module: ModuleInfo, scope: Scope, node: ast.Call, base: ast.expr,
                           tables: tuple[ast.expr, ast.expr, list[str], tuple[bool, bool]], negate: bool) -> "_Match | str":
    cos_t, sin_t, checks, swapped = tables
    m = pattern._build_real(module, scope, node, "half", base, cos_t, sin_t)
    if isinstance(m, str):
        return m
    cos_s, sin_s, x_s = segment(module, cos_t), segment(module, sin_t), segment(module, base)
    if negate:
        m.prep = [f"_npufuse_{_ident(sin_s)}_neg = -{_atom(sin_s)}  # y1 = x1*cos + x2*sin: the rotation by -angle"]
        m.sin = f"_npufuse_{_ident(sin_s)}_neg"
    # s43 (HO19a deepseek-v3-mlha's ``cat([x1*cos[:h] - x2*sin[h:], x1*sin[:h] + x2*cos[h:]])``): a table whose halves
    # the code reads the other way round (x1 with its second half, x2 with its first) is the table with the halves
    # exchanged, passed so: the written code exactly, whatever the halves hold (no equal-halves proof needed)
    for is_swapped, attr, src in ((swapped[0], "cos", cos_s), (swapped[1], "sin", sin_s)):
        if is_swapped:
            t, name = _atom(getattr(m, attr)), f"_npufuse_{_ident(src)}_{attr}_swapped"
            m.prep.append(f"{name} = torch.cat(({t}[..., {t}.shape[-1] // 2 :], {t}[..., : {t}.shape[-1] // 2]), dim=-1)"
                          f"  # the code reads this table's halves the other way round")
            setattr(m, attr, name)
    width = [f"{_atom(t)}.shape[-1] == {_atom(x_s)}.shape[-1]" for t in (cos_s, sin_s)]
    check = " and ".join(dict.fromkeys(width + checks))
    m.only_if = check if m.only_if is None else f"({m.only_if}) and {check}"
    m.only_note = (m.only_note + "; " if m.only_note else "") + (
        "cos / sin split into halves like x: passed whole, fused where they are as wide as x (their halves cut where x's are)")
    return m


def _s43_is_pair_view_of(scope: Scope, like: ast.expr, x: ast.expr) -> bool:
    """Is ``like`` (through local names) ``x.view(..., 2)`` / ``x.reshape(..., 2)`` -- x's lanes cut into pairs, the
    last axis 2 -- with every dim of x but the last kept (``*x.shape[:-1]``)?"""
    view = _resolve(scope, like)
    if _rope_s45sweep.spelled_pair_view_of(scope, view, x, _resolve):
        return True  # s45: ``b, s, h, d = x.shape``; ``x.reshape(b, s, h, d // 2, 2)``
    if not (_method(view, "view", "reshape") and len(view.args) == 3 and _is_int(view.args[2], 2)  # type: ignore[union-attr]
            and same_expr(view.func.value, x)):  # type: ignore[union-attr]
        return False
    lead = view.args[0]  # type: ignore[union-attr]
    return isinstance(lead, ast.Starred) and isinstance(lead.value, ast.Subscript) and isinstance(lead.value.value, ast.Attribute) \
        and lead.value.value.attr == "shape" and same_expr(lead.value.value.value, x) and isinstance(lead.value.slice, ast.Slice) \
        and lead.value.slice.lower is None and _is_int(lead.value.slice.upper, -1) and lead.value.slice.step is None


def _s43_inline_split_cat(node: ast.AST) -> tuple[list, list] | None:
    """s43: the signed products of ``cat([p*a ± q*b, r*c ± t*d], -1)`` where the two elements are written inline and
    are not the one-table pair form :func:`_pair_formula` reads (the tables' halves differ between the elements:
    ``cat([x1*cos[..., :h] - x2*sin[..., h:], x1*sin[..., :h] + x2*cos[..., h:]], -1)``). Structure only; the caller
    checks which factors are x's halves and which the tables'."""
    if not (isinstance(node, ast.Call) and isinstance(node.args[0] if node.args else None, (ast.List, ast.Tuple))):
        return None
    pair = _pair_of(node, _CAT)
    if pair is None or _pair_formula(node) is not None:
        return None
    terms = [_signed_products(e) for e in pair]
    if terms[0] is None or terms[1] is None:
        return None
    return terms[0], terms[1]


def _s43_inline_split_match(pattern: "RopePattern", module: ModuleInfo, scope: Scope, node: ast.Call) -> "_Match | str | None":
    """The half rotation written inline with the tables' halves as factors (:func:`_s43_inline_split_cat`):
    ``[x1*cA - x2*sB, x2*cC + x1*sD]`` is npu_rotary_mul's half mode with cos = cat(cA, cC), sin = cat(sB, sD)
    (spec 4.1): each pair must be the two halves of one table (in order, or exchanged: passed exchanged)."""
    found = _s43_inline_split_cat(node)
    if found is None:
        return None
    terms = found
    tried: list[ast.expr] = []
    for _sign, u, v in terms[0]:
        for f in (u, v):
            h = canonical.lane_of(module, scope, f, node.lineno)
            if h is None or h.kind != "halves" or any(same_expr(h.source, t) for t in tried):
                continue
            tried.append(h.source)
            res = _s43_split_terms_match(pattern, module, scope, node, h.source, terms)
            if res is not None:
                return res
    return None


def _s43_split_terms_match(pattern: "RopePattern", module: ModuleInfo, scope: Scope, node: ast.Call, base: ast.expr,
                           terms: tuple[list, list]) -> "_Match | str | None":
    halves = _Halves(scope, lambda n: same_expr(n, base), module)
    halves.allow_split = True

    def by_part(ts: list) -> dict | None:
        out = {}
        for sign, u, v in ts:
            part = halves.part(u)
            if part is None:
                part, u, v = halves.part(v), v, u
            if part not in ("first", "second") or part in out:
                return None
            out[part] = (sign, v)
        return out if len(out) == 2 else None

    a, b = by_part(terms[0]), by_part(terms[1])
    if a is None or b is None:
        return None
    (s1a, c_a), (s1b, s_b) = a["first"], a["second"]   # y1 = ±x1*cA ± x2*sB
    (s2b, c_c), (s2a, s_d) = b["second"], b["first"]   # y2 = ±x2*cC ± x1*sD
    if not (s1a == 1 and s2b == 1 and s1b == -s2a):
        return None
    tables = _s42_split_tables(module, scope, node.lineno, (c_a, c_c), (s_b, s_d))
    if tables is None:
        return (f"the rotation `{segment(module, node)[:80]}` multiplies x's halves by table slices that are not the two "
                "halves of one cos table and one sin table: npufuse passes no table it cannot name whole")
    m = _s42_split_table_match(pattern, module, scope, node, base, tables, negate=s1b == 1)
    if isinstance(m, _Match):
        _add_split_checks(m, halves)
    return m


def _could_rotate_text(body: str) -> bool:
    """A function text that could hold a rotation helper: it concatenates / stacks (or fills a new tensor's halves /
    lanes: ``out = torch.empty_like(x); out[..., :h] = -x2``; s42: or a clone of x whose every lane is filled:
    ``out = x.clone(); out[..., 0::2] = ..``). Monotone: true of a text, true of every text holding it."""
    return "cat(" in body or "stack(" in body or "rearrange(" in body or "concat" in body or "_like(" in body \
        or ".clone()" in body and "] =" in body


class RopePattern(Pattern):
    id = "rope"
    api = "torch_npu.npu_rotary_mul"
    title = "Rotary position embedding (half / interleaved / complex) as one npu_rotary_mul"
    training_ok = True
    bound = "memory"
    # detect's first test (a rotation multiplies: ``a*c + b*s``), made once by the scan
    # review40: the library rope classes too -- ``_library_rope.construction_sites`` finds their construction in
    # an ``__init__`` that need not multiply (``self.rope = RotaryPositionalEmbeddings(head_dim)``)
    SCOPE_WORDS = ("*", "einsum(", *_library_rope._CLASS_NAMES)  # s47: a per-pair matrix rope by einsum has no `*`

    # ---------------------------------------------------------------------------------------------
    def detect(self, module: ModuleInfo, scope: Scope) -> Iterable[Result]:
        yield from _library_rope.construction_sites(module, scope)  # s40: torchtune's rope module, swapped where built
        text = scope_text(module, scope)
        # a rotation needs ``a*c + b*s`` and either a helper call, an inline cat/stack, or view_as_real
        einsum_pairs = _rope_s47h.may_hold(text)  # s47: a per-pair rotation matrix applied by einsum
        if ("*" not in text or ("+" not in text and "view_as_real" not in text and ".sum(" not in text and "addcmul_(" not in text)) \
                and not einsum_pairs:
            return
        hints = self._rotation_hints(module)
        if not einsum_pairs and not any(h in text for h in hints):
            return
        runs: list[tuple[list[ast.stmt], list[tuple[int, ast.stmt, list[_Match]]]]] = []
        pending: list[tuple[list[ast.stmt], int, ast.stmt, list[_Match]]] = []  # sites whose parts were not right before them
        torch_imports = module.__dict__.get("_rope_torch_imports")
        if torch_imports is None:
            torch_imports = module.__dict__["_rope_torch_imports"] = {k: v for k, v in module.aliases.items() if v in _CAT | _STACK}
        filled_done: set[int] = set()  # fill statements of an ``out = empty_like(x)`` site already matched
        has_addcmul = "addcmul_(" in text  # (LTX-2's in-place split rotation: _accumulated_halves_site)
        for block, i, stmt in scope.statements():
            if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Return, ast.Expr, ast.AugAssign)) or id(stmt) in filled_done:
                continue
            _TORCH_IMPORTS.set(torch_imports)
            filled = _filled_site(block, i, stmt)
            if filled is not None:
                res = self._filled_match(module, scope, filled, getattr(filled, "npufuse_alloc", stmt.value))  # type: ignore[attr-defined]
                if isinstance(res, _Match):
                    filled_done.update(id(st) for st in block[i + 1 : i + 3])
                    # s43: ``new_ev = ..; new_od = ..`` right before ``res = empty_like(v)`` go with the site
                    runs.append((block, _rope_s43.parts_before(runs, block, i, res.absorb) + [(i, filled, [res])]))
                    continue
                if isinstance(res, str):
                    yield NearMiss(self.id, scope.qualname, stmt.lineno, block[i + 2].end_lineno or stmt.lineno, res)
            distant = _s41_fills_after_allocation(block, i, stmt) if filled is None and "_like(" in text else None
            if distant is not None:
                alloc, site = distant
                res = self._filled_match(module, scope, site, alloc.value)  # type: ignore[arg-type]
                if isinstance(res, _Match):
                    # the site's value spans the two whole fill statements (their targets too): the rendering rebinds the name
                    res.wrap = f"{site.targets[0].id} = {res.wrap}"  # type: ignore[attr-defined]
                    filled_done.add(id(block[i + 1]))
                    runs.append((block, [(i, site, [res])]))
                    continue
                if isinstance(res, str):
                    yield NearMiss(self.id, scope.qualname, stmt.lineno, block[i + 1].end_lineno or stmt.lineno, res)
            clone_fill = _rope_s49m.clone_fills(block, i, stmt, canonical.filled_output, _s43_pair_axis_output, _s42_clone_as_empty_like) \
                if filled is None and distant is None and ".clone()" in text else None  # s49: the fills after other statements / in same-code arms
            if clone_fill is not None:
                j, site, fills = clone_fill
                res = self._filled_match(module, scope, site, site.npufuse_alloc)  # type: ignore[attr-defined]
                if isinstance(res, _Match):
                    res.wrap = f"{site.targets[0].id} = {res.wrap}"  # type: ignore[attr-defined]
                    filled_done.update(id(st) for st in fills)
                    runs.append((block, [(j, site, [res])]))
                    continue
                if isinstance(res, str):
                    yield NearMiss(self.id, scope.qualname, site.lineno, site.end_lineno or site.lineno, res)
            if has_addcmul and filled is None and isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.BinOp):
                acc = _accumulated_halves_site(module, scope, block, i, stmt)
                if acc is not None:
                    res = acc if isinstance(acc, str) else self._accumulated_match(module, scope, *acc)
                    if isinstance(res, _Match):
                        site = acc[0]  # type: ignore[index]
                        filled_done.update(id(st) for st in block[i + 1 :] if st.lineno <= (site.end_lineno or site.lineno))
                        runs.append((block, [(i, site, [res])]))
                        continue
                    yield NearMiss(self.id, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, res)
            lanes_fill = _filled_lanes_site(scope, block, i, stmt) if filled is None else None
            if lanes_fill is not None:
                site, upper, used = lanes_fill
                res = self._match(module, scope, site.value)
                like = stmt.value.args[0]  # type: ignore[attr-defined]
                want = "full" if upper is None else ast.unparse(upper)
                if isinstance(res, _Match) and not same_expr(like, res.x):
                    res = (f"the rotated lanes are written into `{segment(module, stmt.value)}`, a new tensor shaped "
                           f"like another tensor than the rotated `{segment(module, res.x)}`: not verified")
                elif isinstance(res, _Match) and res.rotary_dim != want:
                    res = (f"the fills write the lanes of `[..., :{want}]` but the rotation reads those of "
                           f"`[..., :{res.rotary_dim}]`: not one prefix")
                elif isinstance(res, _Match):
                    # the fills cast into the new tensor's dtype (x's): the fused result is cast the same way
                    xa = _atom(segment(module, res.x))
                    res.post += f".to({xa}.dtype)"
                    if upper is not None:
                        # what the fills leave in res[..., u:]: zeros from zeros_like; nothing defined from empty_like, where
                        # x's tail is joined (the value the code's own tail copy, if any, writes there next)
                        tail = f"{xa}[..., {ast.unparse(upper)}:]"
                        if stmt.value.func.attr == "zeros_like":  # type: ignore[attr-defined]
                            tail = f"torch.zeros_like({tail})"
                        res.wrap = f"torch.cat(({{}}, {tail}), dim=-1)"
                if isinstance(res, _Match):
                    filled_done.update(id(st) for st in block[i + 1 : i + used])
                    runs.append((block, _rope_s43.parts_before(runs, block, i, res.absorb) + [(i, site, [res])]))
                    continue
                if isinstance(res, str):
                    yield NearMiss(self.id, scope.qualname, stmt.lineno, block[i + used - 1].end_lineno or stmt.lineno, res)
            st_text = segment(module, stmt)
            # (a cat of two named halves computed just before, nanochat's, has no product itself)
            if ("*" not in st_text or ("+" not in st_text and "view_as_real" not in st_text and ".sum(" not in st_text)) and "cat(" not in st_text \
                    and "concatenate(" not in st_text and not (einsum_pairs and _rope_s47h.may_hold(st_text)) \
                    and "view_as_real" not in st_text and ("stack(" not in st_text or ".flatten(" not in st_text and not _s43_merged_here(st_text)
                                                           and not _merged_next(block, i, stmt)):
                continue
            if "lambda" in st_text:
                lambda_sites = 0
                for lam, node in self._lambda_candidates(stmt, scope):
                    res = self._match(module, scope, node)
                    if isinstance(res, _Match):
                        local = _lambda_local(module, lam, stmt)
                        why = _local_refusal(module, scope, local, res) if lambda_sites == 0 else "a second rotation in the same statement"
                        if why is None:
                            res.local = local
                            lambda_sites += 1
                            _TORCH_IMPORTS.set(torch_imports)
                            yield self._finding(module, scope, [(i, stmt, [res])])
                            continue
                        res = (f"the rotation is written in a lambda (`{segment(module, lam)}`): npufuse rewrites it as a local "
                               f"function only where {why}, so it is left as is")
                    if isinstance(res, str):
                        yield NearMiss(self.id, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, res)
                if lambda_sites:
                    continue
            matches: list[_Match] = []
            for node in self._candidates(stmt, scope):
                res = self._match(module, scope, node)
                if isinstance(res, str):
                    yield NearMiss(self.id, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, res)
                elif res is not None:
                    matches.append(res)
            if not matches:
                continue
            comp = next(((m, c) for m in matches if (c := _comprehension_of(module, stmt, m)) is not None), None)
            if comp is not None:
                # `q, k = [t * cos + rotate_half(t) * sin for t in (q, k)]`: its variable is not live at the
                # statement, so the fused code goes into a local function called for each element
                m, local = comp
                why = _local_refusal(module, scope, local, m) if len(matches) == 1 else "a single rotation in the statement"
                if why is None:
                    m.local = local
                    _TORCH_IMPORTS.set(torch_imports)
                    yield self._finding(module, scope, [(i, stmt, [m])])
                else:
                    yield NearMiss(self.id, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno,
                                   f"the rotation is written in a comprehension (`{local.text}`): npufuse rewrites it as a local "
                                   f"function only where {why}, so it is left as is")
                continue
            anchored = [m for m in matches if m.anchor is not None]
            if anchored:
                # the site sits inside ``if flag:`` statements: the run is made of the If in the outer block
                listing = scope.listing()[0]
                block, i, stmt = next(((b, j, st) for b, j, st in listing if st is anchored[0].anchor))
                matches = [anchored[0]]
                grouped = _anchor_group(self, module, scope, anchored[0], block, i)
                if isinstance(grouped, str):
                    yield NearMiss(self.id, scope.qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, grouped)
                    continue
                if grouped is not None:
                    # several rotations in the flag's branch (q and k): one site, the whole branch fused
                    start, group, siblings = grouped
                    filled_done.update(siblings)
                    runs.append((block, [(j, block[j], []) for j in range(start, i)] + [(i, stmt, group)]))
                    continue
            absorb = [a for m in matches for a in m.absorb]
            if absorb:
                # the statements computing the two rotated halves (nanochat's y1 = ..., y2 = ...) go
                # with the site when they are the ones right before it: the fused call replaces them
                # llama2.c computes the parts of q AND k first, then the two stacks: sites right after each
                # other whose parts, all together, are the statements right before the first of them
                group = pending if pending and pending[-1][0] is block and pending[-1][1] == i - 1 else []
                if not group and pending:
                    # (sites whose parts are not right before them: kept where nothing they read is rebound since)
                    for st, why in _flush_unabsorbed(runs, pending):
                        yield NearMiss(self.id, scope.qualname, st.lineno, st.end_lineno or st.lineno, why)
                ids = {id(a) for a in absorb} | {id(a) for _b, _j, _st, ms in group for m in ms for a in m.absorb}
                first = group[0][1] if group else i
                if first >= len(ids) and {id(b) for b in block[first - len(ids) : first]} == ids:
                    start = first - len(ids)
                    if runs and runs[-1][0] is block and runs[-1][1][-1][0] >= start:
                        runs[-1][1][:] = [it for it in runs[-1][1] if it[0] < start]
                        if not runs[-1][1]:
                            runs.pop()
                    pre = [(j, block[j], []) for j in range(start, first)] + [(j, st, ms) for _b, j, st, ms in group]
                    if runs and runs[-1][0] is block and runs[-1][1][-1][0] == start - 1:
                        runs[-1][1].extend(pre + [(i, stmt, matches)])
                    else:
                        runs.append((block, pre + [(i, stmt, matches)]))
                    pending = []
                    continue
                pending = group + [(block, i, stmt, [m for m in matches if m.absorb])]
                matches = [m for m in matches if not m.absorb]
                if not matches:
                    continue
            if runs and runs[-1][0] is block and runs[-1][1][-1][0] == i - 1:
                runs[-1][1].append((i, stmt, matches))
            else:
                runs.append((block, [(i, stmt, matches)]))
        if pending:
            for st, why in _flush_unabsorbed(runs, pending):
                yield NearMiss(self.id, scope.qualname, st.lineno, st.end_lineno or st.lineno, why)
        for _block, items in runs:
            _TORCH_IMPORTS.set(torch_imports)
            yield self._finding(module, scope, items)

    def _filled_match(self, module: ModuleInfo, scope: Scope, site: ast.Assign, alloc: ast.Call) -> _Match | str | None:
        """The rotation a fill site (``out = <the value the fills leave>``) computes, where the buffer ``alloc``
        (``empty_like(x)`` / ``zeros_like(x)``) is shaped like the rotated x; its result cast to x's dtype as the fills
        cast into the buffer. A near miss where the buffer is shaped like another tensor."""
        res = self._match(module, scope, site.value)
        if isinstance(res, _Match) and getattr(site.value, "npufuse_pair_axis", False):
            # s43: fills of a pair axis -- the buffer must be x's own ``(.., D/2, 2)`` view, so it is as wide as the pairs
            if not _s43_is_pair_view_of(scope, alloc.args[0], res.x):
                return (f"the rotated pairs are written into `{segment(module, alloc)}`, a new tensor not shaped like the "
                        f"`(.., D/2, 2)` pairs of the rotated `{segment(module, res.x)}`: not verified")
            res.post += f".to({_atom(segment(module, res.x))}.dtype)"
            return res
        if isinstance(res, _Match) and not same_expr(alloc.args[0], res.x):
            return (f"the rotated halves are written into `{segment(module, alloc)}`, a new tensor shaped "
                    f"like another tensor than the rotated `{segment(module, res.x)}`: not verified")
        if isinstance(res, _Match):
            res.post += f".to({_atom(segment(module, res.x))}.dtype)"
        return res

    @staticmethod
    def _rotation_hints(module: ModuleInfo) -> tuple[str, ...]:
        """Substrings one of which any rope site in this module contains: the names of functions
        defined or imported here (a rotation helper is called by name), inline cat/stack, the
        complex form. Computed once per module."""
        hints = module.__dict__.get("_rope_hints")
        if hints is None:
            # helpers that could be rotations: they concatenate/stack (or are imported/named so)
            scopes = {id(s.node): s for s in module.scopes}

            def could_rotate(fn: ast.AST) -> bool:
                # a function's scope_text is its segment, cut once and shared with every detector
                scope = scopes.get(id(fn))
                # s51 (perf51): the test holds for a text only if it holds for any text containing it, and the segment
                # lies inside the scope's whole lines (``_site.scope_text``, the scan's gate text, cut for every scope
                # anyway): where those fail, the segment fails too and is not cut (most methods of a file)
                if scope is not None and not _could_rotate_text(_site_scope_text(module, scope)):
                    return False
                body = scope_text(module, scope) if scope is not None else segment(module, fn)
                return _could_rotate_text(body)

            names = {n for n, fn in module.functions.items() if could_rotate(fn)} | {n for n in module.aliases if "rot" in n.lower()} \
                | _relative_rotation_imports(module)
            # (module-level ``rotate_half = lambda x: ...``: named so the near miss can say it is a lambda)
            names |= {t.id for st in module.tree.body if isinstance(st, ast.Assign) and isinstance(st.value, ast.Lambda)
                      for t in st.targets if isinstance(t, ast.Name) and "rot" in t.id.lower()}
            for cls in _module_classes(module):
                names |= {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and ("rot" in f.name.lower() or could_rotate(f))}
            names |= _rope_s43.nested_rotation_helpers(module, names, could_rotate)  # s43: ``def apply_rope`` inside forward
            hints = module.__dict__["_rope_hints"] = tuple(sorted(names)) + ("cat(", "concat(", "stack(", "view_as_real", "1, 2)", "addcmul_(")
        return hints

    @staticmethod
    def _candidates(stmt: ast.stmt, scope: Scope) -> list[ast.expr]:
        """Outermost sub-expressions shaped like a rotation: ``a*c + b*s`` or ``view_as_real(..)``."""
        found: list[ast.expr] = []

        def visit(node: ast.AST) -> None:
            if isinstance(node, (ast.Lambda, ast.FunctionDef, ast.ClassDef)):
                return
            if _pair_formula(node) is not None or _lane_pair_formula(node) is not None or (isinstance(node, ast.Call) and _named_pair(node) is not None) \
                    or (isinstance(node, (ast.BinOp, ast.Call)) and _matrix_formula(scope, node) is not None) \
                    or _rope_s47h.einsum_matrix(scope, node) is not None:
                found.append(node)  # the written-out rotation (its ``b*c + a*s`` half is no rope itself)
                return
            if isinstance(node, ast.Call) and _s43_inline_split_cat(node) is not None:
                found.append(node)  # s43: the halves' tables differ between the two elements
                return
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and _mult_factors(node.left) and _mult_factors(node.right):
                found.append(node)
                return
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.BinOp) and isinstance(node.args[0].op, ast.Mult) \
                    and ast.unparse(node.func).endswith("view_as_real") \
                    and any(_complex_halves(scope, f) is not None for f in (node.args[0].left, node.args[0].right)):
                found.append(node)  # gemma: the complex numbers are made of the two halves
                return
            if _method(node, "flatten", "view", "reshape", "view_as") and isinstance(node.func.value, ast.Call) and ast.unparse(node.func.value.func).endswith("view_as_real"):
                found.append(node)
                return
            if isinstance(node, ast.Call):
                pairs = _cat_sub_pairs(node)  # ``cat([a*c - b*s, b*c + a*s, x_pass], -1)``: the rotated pair inside
                if pairs:
                    found.extend(pairs)
                    return
            if isinstance(node, ast.Call) and _calls_view_as_real(node) and _named_complex_product(scope, node) is not None:
                found.append(node)  # hkproj: ``x_rotated = xc * freqs; x_out = view_as_real(x_rotated)``
                return
            if isinstance(node, ast.Call) and _calls_view_as_real(node) and len(node.args) == 1 and isinstance(node.args[0], ast.BinOp) \
                    and isinstance(node.args[0].op, ast.Mult) and any(_is_view_as_complex(_resolve(scope, f)) for f in (node.args[0].left, node.args[0].right)):
                found.append(node)  # ``out = view_as_real(xc * f)`` merged back by a later statement (einops)
                return
            for child in child_nodes(node):
                visit(child)

        visit(stmt)
        # a recursive closure refers to itself through its cell: emptied, the cell lets the
        # function (and the scope it holds, with its tree and indexes) go when this returns,
        # not at the next cyclic collection (engine.analyze_file keeps the collector off)
        visit = None  # type: ignore[assignment]  # noqa: F841
        return found

    @classmethod
    def _lambda_candidates(cls, stmt: ast.stmt, scope: Scope) -> list[tuple[ast.Lambda, ast.expr]]:
        """Rotation-shaped bodies of the lambdas in a statement (vit-pytorch's
        ``q, k = map(lambda t: (t * cos) + (rotate_every_two(t) * sin), (q, k))``)."""
        out = []
        for lam in fast_walk(stmt):
            if isinstance(lam, ast.Lambda):
                holder = ast.Expr(value=lam.body, lineno=stmt.lineno, col_offset=0, end_lineno=stmt.end_lineno, end_col_offset=0)
                out += [(lam, node) for node in cls._candidates(holder, scope)]
        return out

    def _match(self, module: ModuleInfo, scope: Scope, node: ast.expr) -> _Match | str | None:
        mf = _matrix_formula(scope, node)
        if mf is not None:
            return self._match_matrix(module, scope, node, *mf)
        em = _rope_s47h.einsum_matrix(scope, node)
        if em is not None:
            # s47: ``einsum(pairs, M, "... k j, ... k i j -> ... k i")``: flux's per-pair product, M traced to rotations
            traced = _rope_s47h.traced_rotation(module, scope, em[1])
            if traced is None:
                return ("per-pair 2x2 matrix applied by einsum: the matrix is not traced to rotations [[cos, -sin], [sin, cos]] "
                        "built in this function or stored on this class (register_buffer / self.<attr>), so it is not known to be a rotation")
            return self._match_matrix(module, scope, node, _rope_s47h.pairs_as_flux_view(em[0]), em[1], None, producer=traced)
        lp = _lane_pair_formula(node)
        if lp is not None:
            return self._match_lane_pairs(module, scope, node, *lp)
        if isinstance(node, ast.Call) and _named_pair(node) is not None:
            res = self._match_named_halves(module, scope, node)
            if isinstance(res, _Match):
                moved = _rebound_since_parts(scope, node, res)
                if moved is not None:
                    return moved
            return res
        pf = _pair_formula(node)
        if pf is None and isinstance(node, ast.Call):
            res = _s43_inline_split_match(self, module, scope, node)
            if res is not None:
                return res
        if pf is not None:
            res = self._match_pairs(module, scope, node, *pf)
            if res is None:
                # a*c - b*s, b*c + a*s is symmetric in (a, b) <-> (c, s) (a complex product): the tables
                # may be the factors written first (Infinity's ``c * x0 - s * x1``)
                how, a, b, c, s_ = pf
                res = self._match_pairs(module, scope, node, how, c, s_, a, b)
            return res
        if isinstance(node, ast.BinOp):
            return self._match_real(module, scope, node)
        return self._match_complex(module, scope, node)

    def _match_pairs(self, module: ModuleInfo, scope: Scope, node: ast.expr, how: str, a: ast.expr, b: ast.expr, c: ast.expr, s: ast.expr) -> _Match | str | None:
        """The written-out rotation of two parts a, b of one tensor x, with half-size cos c / sin s.

        * cat of the halves (gpt-oss): x*cat(c, c) + rotate_half(x)*cat(s, s), half mode on x;
        * cat of the even/odd lanes (DeepSeek's ``apply_rotary_pos_emb_interleave``): the same on
          the de-interleaved x = cat(a, b) — the original returns that lane order too;
        * stack of the even/odd lanes, flattened: interleave mode with c, s repeat_interleave(2)."""
        ra = _resolve(scope, a)
        lane = canonical.lane_of(module, scope, a, node.lineno)
        cast_base = None if lane is not None or how != "cat" else _rope_s47sweep.cast_halves_source(
            module, scope, a, node.lineno, _resolve, canonical.lane_of)  # s47: halves upcast first (`x[..., :h].float()`)
        if cast_base is not None:
            base = cast_base
        elif lane is not None:
            base = lane.source  # any spelling the shared layer knows (chunk, split, unbind of a view, einops, slices)
        elif isinstance(ra, ast.Subscript) and isinstance(ra.value, ast.Call) and _is_int(ra.slice, 0, 1):
            call = ra.value  # x.chunk(2, -1)[k] / torch.chunk(x, 2, dim=-1)[k]
            base = call.args[0] if isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) and call.func.value.id == "torch" and call.args else getattr(call.func, "value", None)
        elif isinstance(ra, ast.Subscript):
            base = ra.value
        else:
            return None
        if base is None:
            return None
        halves = _Halves(scope, lambda n: same_expr(n, base), module)
        halves.allow_split = True
        halves.see_fp32 = how == "cat"  # s47: widened below where a half went through .float()
        parts = (halves.part(a), halves.part(b))
        if halves.upcast and parts != ("first", "second"):
            return None  # (s47 reads fp32 casts of the halves only)
        if how == "cat" and parts == ("first", "second"):
            mode, x_text = "half", segment(module, base)
        elif how == "cat" and parts == ("even", "odd"):
            mode, x_text = "half", f"torch.cat(({segment(module, a)}, {segment(module, b)}), dim=-1)"
        elif how in ("stack", "pairs") and parts == ("even", "odd"):
            mode, x_text = "interleave", segment(module, base)
        else:
            return None
        m = self._build_real(module, scope, node, mode, base, c, s)
        if isinstance(m, str) and mode == "interleave" and m.startswith(_BATCH_REASON):
            # RoFormer's ``sin, cos = sinusoidal_pos``: tables whose layout is not visible here are
            # checked at run time, as for the ``x*cos + rotate_every_two(x)*sin`` spelling
            m = self._interleave_checked(module, scope, node, base, c, s, m)
        if isinstance(m, str):
            return m
        tag = _ident(segment(module, c))
        cs = [segment(module, c), segment(module, s)]
        full = [f"_npufuse_{tag}_cos_full", f"_npufuse_{tag}_sin_full"]
        widen = "torch.cat(({0}, {0}), dim=-1)" if mode == "half" else "{0}.repeat_interleave(2, dim=-1)"
        m.prep = [f"{full[0]} = {widen.format(_atom(cs[0]))}  # the written-out rotation takes half-size cos/sin; npu_rotary_mul the full head dim",
                  f"{full[1]} = {widen.format(_atom(cs[1]))}"] + m.prep
        if x_text != segment(module, base):
            lanes = f"_npufuse_{_ident(segment(module, base))}_lanes"
            m.prep.append(f"{lanes} = {x_text}  # the original rotates the de-interleaved lanes (even | odd) and returns that order")
            x_text = lanes
        m.cos, m.sin, m.x_text = full[0], full[1], x_text
        if halves.upcast:
            _rope_s47sweep.widen_match(m, halves, x_text, _atom)  # s47: the eager halves are fp32
        _add_split_checks(m, halves)
        if how == "pairs":
            # ``stack([..], -1)`` not merged here: the rotated lanes as [..., D/2, 2] pairs, the fused result viewed so
            m.post = ".unflatten(-1, (-1, 2))" + m.post
        return m

    def _match_named_halves(self, module: ModuleInfo, scope: Scope, node: ast.Call) -> _Match | str | None:
        """nanochat / modded-nanogpt: ``y1 = x1*cos + x2*sin; y2 = x1*(-sin) + x2*cos;
        cat([y1, y2], -1)`` over the halves x1, x2 of x: the half rotation with sin negated
        (or, with the other signs, the standard one), half-size tables."""
        y1, y2 = _named_pair(node)  # type: ignore[misc]
        defs = []
        for y in (y1, y2):
            found = [(st, v) for st, v in scope.assignments.get(y.id, []) if st.lineno < node.lineno]
            if not found or not isinstance(found[-1][0], ast.Assign) or len(found[-1][0].targets) != 1:
                return None
            defs.append(found[-1])
        # vLLM / sglang ``_apply_rotary_emb``: the halves are cut under ``if is_neox_style:`` (chunk) / else
        # (even/odd lanes), o1/o2 written once, and ``if is_neox_style: return cat((o1, o2))`` else a stack:
        # the site is that If, fused under the same flag; the halves are read on the flag's path only
        anchor, only_if, site, path_scope = _branch_anchor(scope, node, defs[0][0])
        if anchor is None:
            return None
        end = anchor.end_lineno or anchor.lineno
        if any(_read_before_rebound(scope, y.id, end) for y in (y1, y2)):
            return None  # the halves are read again: keep them (the site would need them)
        terms = [_signed_products(d[1]) for d in defs]
        def_cast = _common_part_cast(scope, defs, node.lineno) if None in terms else ""
        if def_cast:
            terms = [_signed_products(strip_casts(d[1])[0]) for d in defs]
        elif None in terms and all(strip_casts(d[1])[1] and _signed_products(strip_casts(d[1])[0]) for d in defs):
            return (f"the rotated parts `{y1.id}`, `{y2.id}` are products cast differently (`{segment(module, defs[0][1])}` / "
                    f"`{segment(module, defs[1][1])}`): the joined result has no one dtype the fused call could give it")
        if terms[0] is None or terms[1] is None:
            return None
        scope_for_halves = scope
        scope = path_scope
        # cat([y1, y2]): halves; stack([y1, y2], -1).flatten(-2) (llama2.c's real/imag parts): lane pairs
        kind = "pairs" if _stacked_pair(node) is not None or _unmerged_lane_stack(node) is not None else "halves"
        p0, p1 = ("even", "odd") if kind == "pairs" else ("first", "second")
        base = None
        for _sign, u, v in terms[0] + terms[1]:
            # the shared canonical layer: chunk / split / unbind / slice halves alike
            h = canonical.lane_of(module, scope, u, node.lineno) or canonical.lane_of(module, scope, v, node.lineno)
            if h is not None and h.kind == kind:
                base = h.source
                break
            if kind == "pairs":
                base = _bounded_lane_source(scope, u) or _bounded_lane_source(scope, v)
                if base is not None:
                    break  # (the lanes of a rotated prefix: _Halves reads them under allow_split)
        if base is None and kind == "halves":
            # s44: halves cut with the last axis spelled 3 (``x.chunk(2, dim=3)``), which _Halves reads and the lane layer does not
            base = _rope_s44sweep.indexed_split_source(scope, [f for t in terms[0] + terms[1] for f in t[1:]], _resolve,
                                                       lambda x: _Halves(scope, lambda n: same_expr(n, x), module))
        if base is None and kind == "halves":
            # s47: halves upcast before the rotation (``x1 = x1.float()``)
            base, why = _rope_s47sweep.upcast_lane_source(module, scope, [f for t in terms[0] + terms[1] for f in t[1:]], node.lineno,
                                                          kind, _resolve, canonical.lane_of)
            if why:
                return why
        if base is None:
            return None
        halves = _Halves(scope, lambda n: same_expr(n, base), module)
        halves.allow_split = True
        halves.see_fp32 = kind == "halves"  # s47: the half match below widens to fp32 on halves.upcast

        def canon(ts: list) -> dict | None:
            out = {}
            for sign, u, v in ts:
                # a negated factor (memes2's ``sin * -b``): the minus moves to the term's sign
                if isinstance(u, ast.UnaryOp) and isinstance(u.op, ast.USub):
                    sign, u = -sign, u.operand
                if isinstance(v, ast.UnaryOp) and isinstance(v.op, ast.USub):
                    sign, v = -sign, v.operand
                part = halves.part(u)
                if part is None:
                    part, u, v = halves.part(v), v, u
                if part not in (p0, p1):
                    return None
                neg = halves.neg_of(v)
                if neg is not None:
                    sign, v = -sign, neg
                out[part] = (sign, v)
            return out if len(out) == 2 else None

        a, b = canon(terms[0]), canon(terms[1])
        if a is None or b is None:
            return None
        (s1a, c_a), (s1b, s_a) = a[p0], a[p1]   # y1 = ±x1*c ± x2*s
        (s2b, c_b), (s2a, s_b) = b[p1], b[p0]   # y2 = ±x2*c ± x1*s
        if not (s1a == 1 and s2b == 1 and s1b == -s2a):
            return None
        # s42: ``cos1, cos2 = cos.chunk(2, -1)``, y1 = x1*cos1 - x2*sin1, y2 = x2*cos2 + x1*sin2: the full tables
        split_tables = None
        if not (same_expr(c_a, c_b) and same_expr(s_a, s_b)):
            split_tables = _s42_split_tables(module, scope, node.lineno, (c_a, c_b), (s_a, s_b)) if kind == "halves" else None
            if split_tables is None:
                return None
        negate = s1b == 1  # y1 = x1*c + x2*s: the rotation by -angle, i.e. sin negated
        scope = scope_for_halves
        if kind == "pairs":
            if anchor is not site:
                return None  # (a flag-chosen pair form is vLLM's, handled with its halves above)
            lanes = self._named_lane_pairs(module, scope, node, base, c_a, s_a, negate, [d[0] for d in defs])
            if isinstance(lanes, _Match) and def_cast:
                lanes.post += def_cast  # each part was cast alike: the fused result is cast the same way
            if isinstance(lanes, _Match):
                _add_split_checks(lanes, halves)  # lanes of a rotated prefix ``x[..., :u:2]``: that prefix is rotated
            return lanes
        if split_tables is not None:
            m = _s42_split_table_match(self, module, scope, node, base, split_tables, negate)
            if isinstance(m, str):
                return m
        else:
            m = self._build_real(module, scope, node, "half", base, c_a, s_a)
            if isinstance(m, str):
                return m
            m.prep, (m.cos, m.sin) = _doubled_half_tables(module, c_a, s_a, negate, "y1 = x1*cos + x2*sin: the rotation by -angle")
            m.x_text = segment(module, base)
        if halves.upcast:
            _rope_s47sweep.widen_match(m, halves, segment(module, base), _atom)
        m.absorb = [d[0] for d in defs]
        m.post = _pair_cast_suffix(node) + def_cast + m.post
        if anchor is not site:
            m.anchor, m.site_stmt, m.only_if = anchor, site, only_if
            m.inner_prep, m.prep = m.prep, []  # the widened tables are needed on the fused path only
            m.only_note = f"the other path of `{ast.unparse(anchor.test)}` (the interleaved stack) keeps the original code"  # type: ignore[attr-defined]
        _add_split_checks(m, halves)
        return m

    def _accumulated_match(self, module: ModuleInfo, scope: Scope, site: ast.Assign | ast.Return, x: ast.expr, cos: ast.expr, sin: ast.expr,
                           negate: bool, upcast: bool) -> _Match | str:
        """The fused call for _accumulated_halves_site: the half rotation of x (fp32 where the view upcasts it)
        with the half-size tables duplicated, in the dtype the in-place sums keep (x's, promoted with cos's)."""
        m = self._build_real(module, scope, site.value, "half", x, cos, sin)
        if isinstance(m, str):
            return m
        m.prep, (m.cos, m.sin) = _doubled_half_tables(module, cos, sin, negate, "the rotation by -angle: sin negated")
        cs = [segment(module, cos), segment(module, sin)]
        xa = _atom(segment(module, x))
        m.x_text = f"{xa}.float()" if upcast else segment(module, x)
        if upcast:
            m.x_dtype = "float32"
        # the sums are accumulated in place into x * cos: its dtype (x's, or fp32 where upcast, promoted with cos's)
        m.post = f".to(torch.promote_types({'torch.float32' if upcast else xa + '.dtype'}, {_atom(cs[0])}.dtype))"
        if isinstance(site, ast.Return):
            m.wrap = "return {}"  # the site's value spans from the product statement to the returned merge
        return m

    def _named_lane_pairs(self, module: ModuleInfo, scope: Scope, node: ast.Call, base: ast.expr, c: ast.expr, s: ast.expr,
                          negate: bool, defs: list[ast.stmt]) -> _Match | str:
        """llama2.c: ``r, i = x.float().reshape(..., -1, 2).unbind(-1)``; ``out_r = r*c - i*s``; ``out_i = r*s + i*c``;
        ``stack([out_r, out_i], -1).flatten(3)``: the interleave rotation with half-size c/s (repeat_interleave(2)).
        Where c/s are batch-independent here, the fused call takes them as they are; where their layout is not
        visible (a broadcast helper's view), it is checked at run time (interleave mode takes only
        11SD / 1S1D / S11D cos/sin) and elsewhere the original code runs."""
        cs = [segment(module, c), segment(module, s)]
        tag = _ident(segment(module, base))
        full = [f"_npufuse_{tag}_cos_full", f"_npufuse_{tag}_sin_full"]
        sin_half = f"-{_atom(cs[1])}" if negate else _atom(cs[1])
        prep = [f"{full[0]} = {_atom(cs[0])}.repeat_interleave(2, dim=-1)  # half-size cos/sin of each lane pair -> the full head dim",
                f"{full[1]} = {sin_half}.repeat_interleave(2, dim=-1)" + ("  # out_r = r*cos + i*sin: the rotation by -angle" if negate else "")]
        m = self._build_real(module, scope, node, "interleave", base, c, s)
        if isinstance(m, _Match):
            m.prep, m.cos, m.sin, m.x_text = prep, full[0], full[1], segment(module, base)
        else:
            if not m.startswith("interleave mode with cos/sin that may depend on the batch"):
                return m
            x_text = segment(module, base)
            prep.append(f"{full[0]}, {full[1]} = {full[0]}[(None,) * (4 - {full[0]}.dim())], {full[1]}[(None,) * (4 - {full[1]}.dim())]  # the eager broadcast, made 4-D")
            m = _Match(
                node=node, mode="interleave", x=base, cos=full[0], sin=full[1], cos_node=None, sin_node=None, x_text=x_text,
                cos_info=_CosInfo(batch_free=False, layout="half-size tables of a layout not visible here, checked at run time"),
                prep=prep, x_dtype=_dtype_token(scope, base), cs_dtype=None,
            )
            xa = _atom(x_text)
            # x of 3 dims is lifted to one batch by the fused call (a [(b h), s, d] x puts b*h in N); interleave mode
            # takes B*N < 1000: x's rows over the table's one long dim (spec 4.1; the op rejects larger calls)
            m.only_if = (f"{xa}.dim() in (3, 4) and {full[0]}.dim() == 4 and {full[0]}.shape[0] == 1 and ({full[0]}.shape[1] == 1 or "
                         f"{full[0]}.shape[2] == 1) and {full[0]}.shape == {full[1]}.shape"
                         f" and {_interleave_rows_ok(xa, f'max({full[0]}.shape[:3])')}")
            m.only_note = ("cos/sin of a batch-dependent or non-4-D layout, or B*N of 1000 or more, keep the original code "
                           "(npu_rotary_mul's interleave mode takes only 11SD/1S1D/S11D and B*N < 1000)")
        if _is_int(keyword(node, "start_dim", 0), 3):
            # flatten(3) merges the pair axis only for 4-D parts: the fused call is for 4-D x
            rank = f"{_atom(segment(module, strip_casts(base)[0]))}.dim() == 4"  # (a cast keeps the rank)
            m.only_if = rank if m.only_if is None else (m.only_if if rank in m.only_if else f"({m.only_if}) and {rank}")
        if _unmerged_lane_stack(node) is not None:
            m.post = ".unflatten(-1, (-1, 2))" + m.post  # the stacked pairs' [.., D/2, 2] layout
        m.absorb = defs
        return m

    def _match_matrix(self, module: ModuleInfo, scope: Scope, node: ast.expr, pairs: ast.expr, mat: ast.expr, sum_dim: ast.expr | None,
                      producer: str | None = None) -> _Match | str:
        traced_einsum = producer is not None  # s47: the einsum form, its matrix traced (_rope_s47h)
        """flux / lingua: a per-pair 2x2 matrix F applied to the lane pairs of x. With F the rotation
        [[cos, -sin], [sin, cos]] this is the interleaved rotation (cos = F[..., 0, 0], sin = F[..., 1, 0]),
        kept in the ``[..., D/2, 2]`` shape the code flattens next."""
        producer = producer or _rotation_matrix_producer(module)
        if producer is None:
            return ("per-pair 2x2 matrix form: no function of this module builds the matrix as stack((cos, -sin, sin, cos)) "
                    "([[cos, -sin], [sin, cos]]), so it is not known to be a rotation")
        x = _matrix_pairs(scope, pairs)
        assert x is not None
        # the pairs view cast after the reshape (``x.reshape(..., -1, 1, 2).to(torch.float32)``): the eager
        # product runs in that dtype (promoted with the matrix's)
        pairs_dtype = None
        view = _resolve(scope, pairs)
        if isinstance(view, ast.Call) and strip_casts(view)[0] is not view:
            pairs_dtype = _pairs_cast_dtype(view)
            if pairs_dtype is None:
                return (f"per-pair 2x2 matrix form: the pairs view is cast by `{segment(module, view)[len(segment(module, strip_casts(view)[0])):][:40]}`, "
                        "whose dtype is not read here (only .float() / .half() / .bfloat16() / .to(torch.<dtype>))")
        x_src, f_src = segment(module, x), _atom(segment(module, mat))
        tag = _ident(x_src)
        cos, sin, xv, dt = f"_npufuse_{tag}_cos", f"_npufuse_{tag}_sin", f"_npufuse_{tag}_x", f"_npufuse_{tag}_dtype"
        lead, lift = f"_npufuse_{tag}_lead", f"_npufuse_{tag}_tokens"
        # only shapes are read before the branch: the tensors are made inside it, where the fused call runs
        base = strip_casts(x)[0]
        x_rank = f"{base.id}.dim()" if isinstance(base, ast.Name) else f"{xv}.dim()"
        prep = [f"{lead} = (1,) * (6 - {f_src}.dim()) + tuple({f_src}.shape)  # the matrix's dims as the eager product broadcasts them"]
        if not isinstance(base, ast.Name):
            prep.insert(0, f"{xv} = {x_src}")
        inner = ([] if not isinstance(base, ast.Name) else [f"{xv} = {x_src}  # the pairs (x_2i, x_2i+1) are the lanes of this tensor"]) + [
            # [T, N, D] tokens (a matrix of at most 5 dims, checked): the product is the one of x[None], one batch of T
            f"{lift} = {xv}.dim() == 3",
            f"{xv} = {xv}[None] if {lift} else {xv}",
            f"{cos} = {f_src}[..., 0, 0].repeat_interleave(2, dim=-1)  # [[cos, -sin], [sin, cos]] per pair -> interleave-mode cos/sin",
            f"{sin} = {f_src}[..., 1, 0].repeat_interleave(2, dim=-1)",
            f"{cos}, {sin} = {cos}[(None,) * (4 - {cos}.dim())], {sin}[(None,) * (4 - {sin}.dim())]  # the broadcast of the eager product, made 4-D",
            f"{dt} = torch.promote_types(torch.promote_types({pairs_dtype or xv + '.dtype'}, {cos}.dtype), {sin}.dtype)  # the eager product's dtype",
        ]
        if traced_einsum:
            # s47: einsum's product follows autocast (its bmm runs in autocast's dtype), the fused op does not: the
            # operands in autocast's dtype when it is on (unchanged outside, where einsum takes one dtype)
            inner.insert(len(inner) - 1, f"{xv}, {cos}, {sin} = _npufuse_autocast({xv}, {cos}, {sin})  # einsum's dtype under autocast")
        m = _Match(
            node=node, mode="interleave", x=x, cos=f"{cos}.to({dt})", sin=f"{sin}.to({dt})", cos_node=None, sin_node=None,
            x_text=f"{xv}.to({dt})", cos_info=_CosInfo(rank=4, batch_free=False, layout="from the per-pair rotation matrix; checked at run time"),
            prep=prep, x_dtype="same", cs_dtype="same", suffix=f"[(0,) if {lift} else ()].unflatten(-1, (-1, 2))",
        )
        m.inner_prep = inner
        # x 3-D or 4-D; the matrix at most 2 dims above x, so that the product has x's dims (lifted to 4) plus the 2x2
        checks = [f"{x_rank} in (3, 4)", f"{f_src}.dim() <= {x_rank} + 2"]
        if sum_dim is not None and not _is_int(sum_dim, -1):
            # ``.sum(k)`` sums the pair axis only when k is the last dim of the 6-D product (k == 5 for 4-D x)
            checks.append(f"{const_value(sum_dim)} == {x_rank} + 1")
        # the matrix [..., D/2, 2, 2] gives cos [..., D]: 4-D and batch-independent (11SD/1S1D/S11D, what npu_rotary_mul's
        # interleave mode takes) is checked on its shape; the original code runs otherwise
        # and interleave mode's B*N < 1000: x's rows over the table's long dim (one of lead[1], lead[2]; x 3-D is one batch)
        rows = base.id if isinstance(base, ast.Name) else xv
        m.only_if = " and ".join(checks) + f" and len({lead}) == 6 and {lead}[0] == 1 and ({lead}[1] == 1 or {lead}[2] == 1)" \
            + f" and {_interleave_rows_ok(rows, f'max({lead}[:3])')}"
        m.only_note = f"the matrix is taken to be the rotation built by `{producer}`"
        if not traced_einsum:  # s48: a float64 product (a float64 matrix or pairs) keeps the original code
            fp = _rope_s48r.matrix_dtype_check(x, pairs_dtype, None if isinstance(base, ast.Name) else xv, f_src, _pairs_cast_dtype)
            if fp is None:
                return (f"per-pair 2x2 matrix form: the pairs are cast by `{x_src[len(segment(module, base)):][:40]}`, whose dtype is "
                        "not read here, so a float64 product (which npu_rotary_mul does not take) cannot be told before the call")
            m.only_if += f" and {fp}"
            m.only_note += "; a float64 product (which npu_rotary_mul does not take) keeps the original code"
        if traced_einsum:
            # s47: einsum does not promote: x and the matrix share a dtype, which npu_rotary_mul must take (no fp64)
            m.only_if += f" and {rows}.dtype in (torch.float16, torch.bfloat16, torch.float32)"
            m.only_note = (f"the matrix is the rotation [[cos, -sin], [sin, cos]] built at {producer}; fp64 (which "
                           "npu_rotary_mul does not take) keeps the original code")
        m.matrix, m.producer = True, producer
        return m

    def _match_lane_pairs(self, module: ModuleInfo, scope: Scope, node: ast.expr, pairs: ast.expr, cache: ast.expr) -> _Match | str | None:
        """gpt-fast / lit-llama: ``xs = x.float().reshape(*x.shape[:-1], -1, 2)`` and a real cache
        ``[..., D/2, 2]`` of (cos, sin): ``stack([xs0*c - xs1*s, xs1*c + xs0*s], -1)`` is the
        interleaved rotation of the pairs, kept in the ``[..., D/2, 2]`` shape the code flattens next."""
        xs = _resolve(scope, pairs)
        if self._explicit_pairs_view(scope, xs):
            return self._match_lane_pairs_regrouped(module, scope, node, xs, cache)
        # ``t.reshape(*t.shape[:-1], -1, 2)``: the leading dims kept, the last one cut into lane pairs
        if not (_method(xs, "reshape", "view") and len(xs.args) == 3 and _is_int(xs.args[2], 2) and isinstance(xs.args[0], ast.Starred)):
            return None
        x = xs.func.value  # x.float() (the cast is part of what the original rotates)
        lead = xs.args[0].value
        if not (isinstance(lead, ast.Subscript) and isinstance(lead.value, ast.Attribute) and lead.value.attr == "shape"
                and isinstance(lead.slice, ast.Slice) and lead.slice.lower is None and _is_int(lead.slice.upper, -1)
                and same_expr(strip_casts(lead.value.value)[0], strip_casts(x)[0])):
            return None
        x_src = segment(module, x)
        c_src = segment(module, cache)
        sized = _sized_by_leading_dims(scope, cache, x, xs)
        if sized is not None:
            # a layout written out here with x's batch dim (the batch is dim 0 or 1 of x in every layout
            # npu_rotary_mul takes): refused like the other batch-dependent layouts seen in the function
            return (f"{_BATCH_REASON} (`{c_src}` is reshaped here to x's two leading dims, `{segment(module, sized)[:60]}`): "
                    "npu_rotary_mul's interleave mode takes only 11SD / 1S1D / S11D cos/sin (no per-batch positions)")
        tag = _ident(c_src)
        cos, sin = f"_npufuse_{tag}_cos", f"_npufuse_{tag}_sin"
        xv = f"_npufuse_{_ident(x_src)}_x"
        dt = f"_npufuse_{_ident(x_src)}_dtype"
        prep = [
            f"{xv} = {x_src}  # the pairs (x_2i, x_2i+1) are the lanes of this tensor",
            f"{cos} = {_atom(c_src)}[..., 0].repeat_interleave(2, dim=-1)  # (cos, sin) pairs -> interleave-mode cos/sin",
            f"{sin} = {_atom(c_src)}[..., 1].repeat_interleave(2, dim=-1)",
            f"{cos}, {sin} = {cos}[(None,) * (4 - {cos}.dim())], {sin}[(None,) * (4 - {sin}.dim())]  # the broadcast of the eager product, made 4-D",
            f"{dt} = torch.promote_types(torch.promote_types({xv}.dtype, {cos}.dtype), {sin}.dtype)  # the eager product's dtype",
        ]
        m = _Match(
            node=node, mode="interleave", x=x, cos=f"{cos}.to({dt})", sin=f"{sin}.to({dt})", cos_node=None, sin_node=None,
            x_text=f"{xv}.to({dt})", cos_info=_CosInfo(rank=4, batch_free=False, layout="from the (cos, sin) pair cache; checked at run time"),
            prep=prep, x_dtype="same", cs_dtype="same", suffix=".unflatten(-1, (-1, 2))",
        )
        # npu_rotary_mul takes a 4-D x and, in interleave mode, batch-independent cos/sin only (11SD/1S1D/S11D):
        # checked at run time, the original code runs otherwise
        m.only_if = (f"{xv}.dim() == 4 and {cos}.dim() == 4 and {cos}.shape[0] == 1 and "
                     f"({cos}.shape[1] == 1 or {cos}.shape[2] == 1) and {cos}.shape == {sin}.shape"
                     f" and {_interleave_rows_ok(xv, f'max({cos}.shape[:-1])')}")
        m.only_if += f" and {_rope_s48r.eager_dtype_check(dt)}"  # s48: a float64 cache keeps the original code
        return m

    @staticmethod
    def _explicit_pairs_view(scope: Scope, xs: ast.expr) -> bool:
        """``x.reshape(a0, .., ak, d // 2, 2)`` with every size written out (no ``*``) and d x's last dim
        (``x.shape[-1]``, or the last name unpacked from ``x.shape``): x regrouped by leading dims the code
        chooses (torchtune's vision rope splits tiles from the sequence), the last dim cut into lane pairs."""
        if not (_method(xs, "reshape", "view") and len(xs.args) >= 3 and _is_int(xs.args[-1], 2)
                and not any(isinstance(a, ast.Starred) for a in xs.args)):
            return False
        base = strip_casts(xs.func.value)[0]  # type: ignore[attr-defined]
        halves = _Halves(scope, lambda n: same_expr(n, base) or same_expr(strip_casts(n)[0], base))
        half = xs.args[-2]  # type: ignore[attr-defined]
        return isinstance(half, ast.BinOp) and isinstance(half.op, ast.FloorDiv) and _is_int(half.right, 2) \
            and (halves._unpacked_last_dim(half.left) or halves._is_half_point(half))

    def _match_lane_pairs_regrouped(self, module: ModuleInfo, scope: Scope, node: ast.expr, xs: ast.Call, cache: ast.expr) -> _Match:
        """The lane-pair form over x regrouped as ``[a0, .., ak, D/2, 2]`` (torchtune's vision rope:
        ``[b, tiles, s, n_h, D/2, 2]`` with a ``[1, 1, s, 1, D/2, 2]`` cache). The fused call takes x as
        ``[a0, .., ak, D]``; leading dims over which cos/sin are constant (size 1 there) are merged into one
        so x is 4-D (tiles join the batch), checked at run time with the interleave layout; the result is
        given the original ``[a0, .., ak, D/2, 2]`` shape back."""
        xs_src = segment(module, xs)
        x = xs.func.value  # type: ignore[attr-defined]
        c_src = segment(module, cache)
        tag = _ident(c_src)
        cos, sin = f"_npufuse_{tag}_cos", f"_npufuse_{tag}_sin"
        key = _ident(segment(module, x))
        xv, dt, shape, lead = f"_npufuse_{key}_x", f"_npufuse_{key}_dtype", f"_npufuse_{key}_pairs_shape", f"_npufuse_{key}_lead"
        prep = [
            f"{xv} = {_atom(xs_src)}.flatten(-2)  # x as the code regroups it, lane pairs merged back into the last dim",
            f"{shape} = {xv}.shape[:-1] + (-1, 2)",
            f"{cos} = {_atom(c_src)}[..., 0].repeat_interleave(2, dim=-1)  # (cos, sin) pairs -> interleave-mode cos/sin",
            f"{sin} = {_atom(c_src)}[..., 1].repeat_interleave(2, dim=-1)",
            f"{cos}, {sin} = {cos}[(None,) * ({xv}.dim() - {cos}.dim())], {sin}[(None,) * ({xv}.dim() - {sin}.dim())]  # the eager broadcast",
            f"{lead} = max({xv}.dim() - 4, 0)  # leading dims to merge so x is 4-D",
            f"if {lead} and {cos}.shape[:{lead} + 1] == (1,) * ({lead} + 1) and {sin}.shape == {cos}.shape:",
            f"    {xv}, {cos}, {sin} = {xv}.flatten(0, {lead}), {cos}.flatten(0, {lead}), {sin}.flatten(0, {lead})  # cos/sin are constant over them",
            f"{dt} = torch.promote_types(torch.promote_types({xv}.dtype, {cos}.dtype), {sin}.dtype)  # the eager product's dtype",
        ]
        m = _Match(
            node=node, mode="interleave", x=x, cos=f"{cos}.to({dt})", sin=f"{sin}.to({dt})", cos_node=None, sin_node=None,
            x_text=f"{xv}.to({dt})", cos_info=_CosInfo(rank=4, batch_free=False, layout="from the (cos, sin) pair cache; checked at run time"),
            prep=prep, x_dtype="same", cs_dtype="same", suffix=f".reshape({shape})",
        )
        m.only_if = (f"{xv}.dim() == 4 and {cos}.dim() == 4 and {cos}.shape[0] == 1 and "
                     f"({cos}.shape[1] == 1 or {cos}.shape[2] == 1) and {cos}.shape == {sin}.shape"
                     f" and {_interleave_rows_ok(xv, f'max({cos}.shape[:-1])')}")
        m.only_if += f" and {_rope_s48r.eager_dtype_check(dt)}"  # s48: a float64 cache keeps the original code
        return m

    def _match_real(self, module: ModuleInfo, scope: Scope, node: ast.BinOp) -> _Match | str | None:
        t1, t2 = _flat_factors(node.left), _flat_factors(node.right)
        assert len(t1) >= 2 and len(t2) >= 2
        best_reason = ""
        for rot_term, plain_term in ((t1, t2), (t2, t1)):
            for r_idx in range(len(rot_term)):
                r_node, sin = rot_term[r_idx], _product(rot_term[:r_idx] + rot_term[r_idx + 1:])
                for x_idx in range(len(plain_term)):
                    x, cos = plain_term[x_idx], _product(plain_term[:x_idx] + plain_term[x_idx + 1:])
                    rot = _rotation_call(module, scope, r_node, x)
                    if rot.kind is None:
                        best_reason = best_reason or rot.reason
                        continue
                    m = self._build_real(module, scope, node, rot.kind, x, cos, sin)
                    if isinstance(m, str) and rot.kind == "interleave" and m.startswith(_BATCH_REASON) \
                            and rot.half_if is None and (rot.only_if is None or rot.rank4_only or rot.x_only) and rot.mode_expr is None:
                        m = self._interleave_checked(module, scope, node, x, cos, sin, m)
                    if isinstance(m, _Match) and rot.upcast:
                        # eager: x*cos + R(x).float()*sin is at least fp32: the fused dtype is widened the same way
                        m.x_dtype, m.widen = None, "torch.float32"
                    if isinstance(m, _Match) and rot.only_if is not None and (rot.rank4_only or rot.x_only) and m.only_if is not None:
                        m.only_if, m.only_note = f"{rot.only_if} and ({m.only_if})", f"{rot.other}; {m.only_note}"
                    elif isinstance(m, _Match) and rot.only_if is not None:
                        m.only_if, m.only_note = rot.only_if, rot.other
                    elif isinstance(m, _Match) and rot.mode_expr is not None:
                        m.mode_expr = rot.mode_expr
                    elif isinstance(m, str) and rot.half_if is not None:
                        # interleave's cos/sin constraint is not provable here: fuse the half
                        # choice only, the other one keeps the original code
                        m = self._build_real(module, scope, node, "half", x, cos, sin)
                        if isinstance(m, _Match):
                            m.only_if, m.chosen_half = rot.half_if, True
                    if isinstance(m, _Match) and rot.path_if is not None:
                        _add_path_condition(m, rot)
                    return m
        return best_reason or None

    def _build_real(self, module: ModuleInfo, scope: Scope, node: ast.expr, mode: str, x: ast.expr, cos: ast.expr, sin: ast.expr) -> _Match | str:
        cinfo = _cos_info(scope, cos, module)
        sinfo = _cos_info(scope, sin, module)
        if cinfo.rank not in (None, 4):
            return (
                f"cos/sin are {cinfo.rank}-D ({cinfo.layout}): npu_rotary_mul takes 4-D x and cos/sin broadcast as "
                "11SD/B1SD/BNSD (x BNSD), 1S1D/BS1D/BSND (x BSND) or S11D/SB1D/SBND (x SBND)"
            )
        if mode == "interleave" and not (cinfo.batch_free and sinfo.batch_free):
            return (
                f"{_BATCH_REASON} (`{segment(module, cos)}`: {cinfo.layout or 'shape not known'}): "
                "npu_rotary_mul's interleave mode takes only 11SD / 1S1D / S11D cos/sin (no per-batch positions); "
                "if every row shares its positions, passing cos[:1] / sin[:1] would make it eligible"
            )
        rotary_dim = "full"
        d: object = ...
        xr = _resolve(scope, x)
        if isinstance(xr, ast.Subscript) and xr is not x:
            sl = _Halves(scope, lambda n: True)._last_dim_slice(xr)
            if sl is not None and sl.lower is None and sl.step is None and sl.upper is not None:
                rotary_dim = segment(module, sl.upper)
                d = const_value(_resolve(scope, sl.upper))
        if isinstance(d, int) and not isinstance(d, bool):
            if d % 2:
                return f"rotary dim {d} is odd: npu_rotary_mul needs an even head dim"
            if d >= _MAX_D:
                return f"rotary dim {d} is not below {_MAX_D}, the npu_rotary_mul limit"
        return _Match(
            node=node, mode=mode, x=x, cos=segment(module, cos), sin=segment(module, sin), cos_node=cos, sin_node=sin,
            x_text=segment(module, x), cos_info=cinfo, rotary_dim=rotary_dim,
            x_dtype=_dtype_token(scope, x), cs_dtype=self._same_token(_dtype_token(scope, cos), _dtype_token(scope, sin)),
        )

    def _interleave_checked(self, module: ModuleInfo, scope: Scope, node: ast.expr, x: ast.expr, cos: ast.expr, sin: ast.expr,
                            reason: str) -> _Match | str:
        """The interleave rotation with cos/sin whose layout is not visible here (HunyuanVideo's tables from a
        broadcast helper whose view depends on a flag): their shape, padded with leading 1s the way the eager
        product broadcasts, is checked at run time to be 11SD / 1S1D / S11D (npu_rotary_mul's interleave mode);
        elsewhere (per-batch positions) the original code runs."""
        m = self._build_real(module, scope, node, "half", x, cos, sin)  # (half mode takes any layout: the same checks)
        sinfo = _cos_info(scope, sin, module)
        # a layout described here (HF's cos.unsqueeze(1) of [B, S, D]: B1SD) stays refused: only tables whose
        # layout this function cannot see at all are left to the run-time check
        if isinstance(m, str) or m.cos_info.rank is not None or sinfo.rank is not None or m.cos_info.layout or sinfo.layout \
                or any(_keeps_lead_dim(scope, t) and not _s43_bound_per_branch(scope, t) for t in (cos, sin)):
            return reason  # a layout seen here with a batch dim (GPT-J's [B, S, 1, D]) stays refused
        m.mode = "interleave"
        shape = f"_npufuse_{_ident(segment(module, x))}_cs_shape"
        c0, s0 = _atom(m.cos), _atom(m.sin)
        m.prep = m.prep + [f"{shape} = (1,) * (4 - {c0}.dim()) + tuple({c0}.shape) if {c0}.dim() <= 4 else "
                           f"(({c0}.shape[:-3].numel(),) + tuple({c0}.shape[-3:]))  # cos as the eager product broadcasts it "
                           "(leading 1s), above 4-D its leading axes merged"]
        check = f"{c0}.dim() <= 4 and {c0}.shape == {s0}.shape and {shape}[0] == 1 and ({shape}[1] == 1 or {shape}[2] == 1)"
        m.table_rank_check = f"{c0}.dim() <= 4"
        if _is_name(m.x_text) and "." not in m.x_text:
            # interleave mode takes B*N < 1000: with batch-free tables the leading dims of x other than S
            # (the one dim where cos is not 1) are B and N; a [(b h), n, d] x lifted to [1, b*h, n, d] can pass it
            check += f" and {_interleave_rows_ok(m.x_text, f'max({shape}[:3])')}"
        m.only_if = check if m.only_if is None else f"({m.only_if}) and {check}"
        m.only_note = "cos/sin with a batch-dependent or more than 4-D layout keep the original code (npu_rotary_mul's interleave mode takes only 11SD/1S1D/S11D)"
        m.cos_info = _CosInfo(rank=m.cos_info.rank, batch_free=False, layout="layout not visible here, checked at run time")
        return m

    @staticmethod
    def _same_token(a: str | None, b: str | None) -> str | None:
        return a if a is not None and a == b else None

    def _match_complex(self, module: ModuleInfo, scope: Scope, node: ast.Call) -> _Match | str | None:
        """``torch.view_as_real(xc * freqs).flatten(3)`` with ``xc = view_as_complex(x.float().reshape(..., -1, 2))``."""
        if ast.unparse(node.func).endswith("view_as_real"):
            named = _named_complex_product(scope, node)
            if named is not None:
                return self._match_named_complex(module, scope, node, *named)
            halves = self._match_complex_halves(module, scope, node)
            return halves if halves is not None else self._match_unmerged_complex(module, scope, node)
        post = ""
        rank_check: int | None = None  # x must have more dims than this for ``post`` to equal the original
        if _method(node, "view", "reshape"):
            # ``view_as_real(xc * f).view(b, s, h, d)`` (nanotron): the fused call gives view_as_real(..).flatten(-2),
            # the same elements in the same order, so the original view/reshape is applied to it unchanged
            if not node.args or node.keywords:
                return None
            post = f".{node.func.attr}({', '.join(segment(module, a) for a in node.args)})"
        elif _method(node, "view_as"):
            # ``view_as_real(xc * f).view_as(x)`` (audiocraft): x's shape, the same elements in the same order
            if len(node.args) != 1 or node.keywords:
                return None
            post = f".view_as({segment(module, node.args[0])})"
        elif not _is_int(keyword(node, "start_dim", 0), 3, -2) and not self._merges_pair_axis(scope, node):
            k = self._merges_more_axes(scope, node)
            if k is None:
                k = self._flatten_of_rank_free_pairs(scope, node)
                if k is None:
                    return None
                # ``reshape(*x.shape[:-1], -1, 2)`` has x's rank + 1 whatever x's rank (mistral-src's
                # ``flatten(2)`` of [T, N, D] tokens): flatten(k) is the pair merge then flatten(k) where
                # x has more than k dims; elsewhere (it would merge fewer axes) the original code runs
                rank_check = k
            # ``view_as_real(xc * f).flatten(2)`` of [b, s, n, d/2, 2] (VeOmni's Wan): the lane pairs merged
            # and then the heads too; the fused call gives the first merge, the original flatten the rest
            post = f".flatten({k})"
        real = node.func.value
        if len(real.args) == 1 and isinstance(real.args[0], ast.Name):
            return _rebound_complex_product(self, module, scope, node, real.args[0], post)
        if len(real.args) != 1 or not isinstance(real.args[0], ast.BinOp) or not isinstance(real.args[0].op, ast.Mult):
            return None
        prod = real.args[0]
        for xc, freqs in ((prod.left, prod.right), (prod.right, prod.left)):
            val = _complex_value(module, scope, xc)
            if not (isinstance(val, ast.Call) and ast.unparse(val.func).endswith("view_as_complex") and val.args):
                continue
            got = _complex_pairs(scope, val.args[0], val.lineno, allow_f64=True)
            if isinstance(got, str):
                return got
            x, cast = got
            finfo = _cos_info(scope, freqs, module)
            # s44 (audit44): a literal flatten(3) merges the pairs back only for 4-D x (3-D tokens keep [T, N, D/2, 2])
            flat3 = flatten3_rank_condition(node, _atom(segment(module, xc))) if not post else None
            if not finfo.batch_free or post:
                m = self._complex_checked(module, node, x, xc, freqs, cast)
                m.post = post
                if rank_check is not None:
                    m.only_if = f"{m.only_if} and {_atom(segment(module, xc))}.dim() > {rank_check}"
                if flat3 is not None:
                    m.only_if = f"{m.only_if} and {flat3}"
                return _float64_in_fp32(module, scope, m, x, val.lineno, node) if cast == "float64" else m
            f_src = _atom(segment(module, freqs))
            xc_src = _atom(segment(module, xc))
            tag = _ident(segment(module, freqs))
            cos, sin = f"_npufuse_{tag}_cos", f"_npufuse_{tag}_sin"
            prep = [
                f"{cos} = {f_src}.real.repeat_interleave(2, dim=-1)  # complex form = interleave rotation: cos of each lane pair",
                f"{sin} = {f_src}.imag.repeat_interleave(2, dim=-1)",
            ]
            cinfo = _CosInfo(batch_free=True, layout=finfo.layout or "batch-independent")
            m = _Match(
                node=node, mode="complex", x=x, cos=cos, sin=sin, cos_node=None, sin_node=None,
                # view_as_real(xc) is xc's float pairs again: a free view of the tensor already cast
                x_text=f"torch.view_as_real({xc_src}).flatten(-2)", cos_info=cinfo, prep=prep,
                x_dtype=cast, cs_dtype=None,
            )
            if _is_name(xc_src) and "." not in xc_src:
                # interleave mode takes B*N < 1000 and D < 896 (spec 4.1): a batch-free table does not bound
                # the batch (audit36: CodeLlama's apply_rotary_emb with 32 prompts x 32 heads); x's rows over
                # the table's one long dim, D = 2 * the complex lanes, read at run time; elsewhere the original
                m.only_if = (f"{_interleave_rows_ok(xc_src, f'max({cos}.shape[:-1], default=1)')}"
                             f" and {xc_src}.shape[-1] * 2 < {_MAX_D}")
            # audit40b: batch-free is not enough for interleave mode, which takes 11SD / 1S1D / S11D only: a
            # per-head table [S, N, D/2] (MatrixGame's ``freqs`` of 3 dims) has two leading dims that are not 1
            one_axis = f"sum(_c != 1 for _c in {cos}.shape[:-1]) <= 1"
            m.only_if = one_axis if m.only_if is None else f"{m.only_if} and {one_axis}"
            if flat3 is not None:
                m.only_if = f"{m.only_if} and {flat3}"
            return _float64_in_fp32(module, scope, m, x, val.lineno, node) if cast == "float64" else m
        return _complex_parameter_product(self, module, scope, node, prod, post)

    @staticmethod
    def _merges_pair_axis(scope: Scope, node: ast.Call) -> bool:
        """``view_as_real(xc * f).flatten(k)`` where xc's pairs view names k + 2 sizes (Wan's 3-D tokens
        ``reshape(seq, n, -1, 2)`` then ``flatten(2)``): flatten(k) merges just the last two dims."""
        k = const_value(keyword(node, "start_dim", 0))
        real = node.func.value  # type: ignore[attr-defined]
        if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1 and isinstance(real, ast.Call) and len(real.args) == 1
                and isinstance(real.args[0], ast.BinOp) and isinstance(real.args[0].op, ast.Mult)):
            return False
        for side in (real.args[0].left, real.args[0].right):
            val = _resolve(scope, side)
            if isinstance(val, ast.Call) and ast.unparse(val.func).endswith("view_as_complex") and val.args:
                pairs = _resolve(scope, val.args[0])
                if _method(pairs, "reshape", "view") and not any(isinstance(a, ast.Starred) for a in pairs.args) \
                        and len(pairs.args) == k + 2 and _is_int(pairs.args[-1], 2):
                    return True
        return False

    @staticmethod
    def _merges_more_axes(scope: Scope, node: ast.Call) -> int | None:
        """k of ``view_as_real(xc * f).flatten(k)`` whose pairs view ``reshape(a0, .., a_{R-2}, 2)`` (no
        starred size) has R sizes and 0 <= k <= R - 2: flatten(k) of the R-D real view equals
        ``flatten(-2)`` (the lanes back in order) followed by ``flatten(k)``; None otherwise."""
        k = const_value(keyword(node, "start_dim", 0))
        real = node.func.value  # type: ignore[attr-defined]
        if len(node.args) + len(node.keywords) != 1 or not (isinstance(k, int) and not isinstance(k, bool) and k >= 0) \
                or not (isinstance(real, ast.Call) and len(real.args) == 1 and isinstance(real.args[0], ast.BinOp)
                        and isinstance(real.args[0].op, ast.Mult)):
            return None
        for side in (real.args[0].left, real.args[0].right):
            val = _resolve(scope, side)
            if isinstance(val, ast.Call) and ast.unparse(val.func).endswith("view_as_complex") and val.args:
                pairs = _resolve(scope, val.args[0])
                if _method(pairs, "reshape", "view") and not any(isinstance(a, ast.Starred) for a in pairs.args) \
                        and len(pairs.args) >= 3 and _is_int(pairs.args[-1], 2) and k <= len(pairs.args) - 2:
                    return k
        return None

    @staticmethod
    def _flatten_of_rank_free_pairs(scope: Scope, node: ast.Call) -> int | None:
        """k of ``view_as_real(xc * f).flatten(k)`` (k >= 0, no end dim) whose complex factor pairs the
        lanes by ``reshape(*x.shape[:-1], -1, 2)`` / ``unflatten(-1, (-1, 2))``: a view whose rank is x's
        rank + 1 at run time, not written here; None otherwise."""
        k = const_value(keyword(node, "start_dim", 0))
        real = node.func.value  # type: ignore[attr-defined]
        if len(node.args) + len(node.keywords) != 1 or not (isinstance(k, int) and not isinstance(k, bool) and k >= 0) \
                or not (isinstance(real, ast.Call) and len(real.args) == 1 and isinstance(real.args[0], ast.BinOp)
                        and isinstance(real.args[0].op, ast.Mult)):
            return None
        for side in (real.args[0].left, real.args[0].right):
            val = _resolve(scope, side)
            if isinstance(val, ast.Call) and ast.unparse(val.func).endswith("view_as_complex") and val.args:
                pairs = _resolve(scope, val.args[0])
                if _method(pairs, "unflatten") and _pairs_view(pairs):
                    return k
                if _method(pairs, "reshape", "view") and len(pairs.args) == 3 and _is_int(pairs.args[1], -1) and _is_int(pairs.args[2], 2) \
                        and _lead_shape_of(pairs.args[0]) is not None:
                    return k
        return None

    def _match_named_complex(self, module: ModuleInfo, scope: Scope, node: ast.Call, prod_stmt: ast.Assign, prod: ast.BinOp) -> _Match | str | None:
        """hkproj: ``x_rotated = xc * freqs`` bound to a name, then ``view_as_real(x_rotated)`` [..., D/2, 2]
        (viewed back by a later statement, which is kept): the fused result is given the pairs layout back
        (``unflatten(-1, (-1, 2))``: lane 2i is pair i's real part). The product's statement goes with the
        site when it is the one right before it and its name is read nowhere else."""
        for xc, freqs in ((prod.left, prod.right), (prod.right, prod.left)):
            val = _resolve(scope, xc)
            if not (isinstance(val, ast.Call) and ast.unparse(val.func).endswith("view_as_complex") and val.args):
                continue
            got = _complex_pairs(scope, val.args[0], val.lineno, allow_f64=True)
            if isinstance(got, str):
                return got
            x, cast = got
            # the freqs' layout is what it is at the product's line: the run-time check decides (batch, rank)
            m = self._complex_checked(module, node, x, xc, freqs, cast)
            m.post, m.freqs = ".unflatten(-1, (-1, 2))", freqs
            if cast == "float64":
                m = _float64_in_fp32(module, scope, m, x, val.lineno, node)  # type: ignore[assignment]
                if isinstance(m, str):
                    return m
            name = node.args[0].id  # type: ignore[attr-defined]
            here = _stmt_of(scope, node)
            if here is not None and here[1] > 0 and here[0][here[1] - 1] is prod_stmt and not scope.uses_after(name, node.lineno):
                m.absorb = [prod_stmt]
            return m
        return None

    def _match_unmerged_complex(self, module: ModuleInfo, scope: Scope, node: ast.Call) -> _Match | str | None:
        """``view_as_real(xc * f)`` with xc the complex lane pairs of x, left as [.., D/2, 2] for a later statement
        to merge (einops ``rearrange(out, "... d two -> ... (d two)")``): the fused result is given that layout
        back (``unflatten(-1, (-1, 2))``), the code after it is kept."""
        prod = node.args[0]
        if not (isinstance(prod, ast.BinOp) and isinstance(prod.op, ast.Mult)):
            return None
        for xc, freqs in ((prod.left, prod.right), (prod.right, prod.left)):
            val = _complex_value(module, scope, xc)
            if not (isinstance(val, ast.Call) and ast.unparse(val.func).endswith("view_as_complex") and val.args):
                continue
            got = _complex_pairs(scope, val.args[0], val.lineno, allow_f64=True)
            if isinstance(got, str):
                return got
            x, cast = got
            m = self._complex_checked(module, node, x, xc, freqs, cast)
            m.post, m.freqs = ".unflatten(-1, (-1, 2))", freqs
            return _float64_in_fp32(module, scope, m, x, val.lineno, node) if cast == "float64" else m
        return None

    def _match_complex_halves(self, module: ModuleInfo, scope: Scope, node: ast.Call) -> _Match | str | None:
        """gemma: ``xc = view_as_complex(stack(chunk(t, 2, -1), -1))`` pairs x_i with x_{i+D/2}, so
        ``view_as_real(xc * freqs)`` is the half rotation of t (cos = cat(freqs.real, freqs.real)) laid
        out as [..., D/2, 2] pairs of (first-half, second-half) lanes: the fused result is given that
        layout back (``unflatten(-1, (2, -1)).transpose(-1, -2).contiguous()``: the strides view_as_real gives, so a
        later ``.view`` of it works), and the code after it is kept."""
        prod = node.args[0]
        assert isinstance(prod, ast.BinOp)
        for xc, freqs in ((prod.left, prod.right), (prod.right, prod.left)):
            t = _complex_halves(scope, xc)
            if t is None:
                continue
            f_src = _atom(segment(module, freqs))
            tag = _ident(segment(module, xc))
            cos, sin = f"_npufuse_{tag}_cos", f"_npufuse_{tag}_sin"
            m = _Match(
                node=node, mode="half", x=t, cos=cos, sin=sin, cos_node=None, sin_node=None, x_text=segment(module, t),
                cos_info=_CosInfo(layout="cat(freqs.real, freqs.real), rank as passed"),
                x_dtype=_dtype_token(scope, t), cs_dtype=None,
            )
            m.inner_prep = [f"{cos} = torch.cat(({f_src}.real, {f_src}.real), dim=-1)  # complex pairs of the halves = rotate_half: cos of each half",
                            f"{sin} = torch.cat(({f_src}.imag, {f_src}.imag), dim=-1)"]
            # contiguous like view_as_real's result: a later .view / .view_as of it (a hoisted
            # ``h = view_as_real(xc * f); out = h.view_as(x)``) fails on the transposed view
            m.post = ".unflatten(-1, (2, -1)).transpose(-1, -2).contiguous()"
            xc_val = _resolve(scope, xc)
            if isinstance(xc, ast.Name) and xc_val is not xc and not scope.uses_after(xc.id, node.lineno):
                # ``x_ = view_as_complex(stack(chunk(..)))`` right before: the fused call replaces it (its stack copy too)
                defs = [st for st, v in scope.assignments.get(xc.id, []) if st.lineno < node.lineno]
                if defs and isinstance(defs[-1], ast.Assign) and len(defs[-1].targets) == 1:
                    m.absorb = [defs[-1]]
            return m
        return None

    @staticmethod
    def _complex_checked(module: ModuleInfo, node: ast.expr, x: ast.expr, xc: ast.expr, freqs: ast.expr, cast: str | None) -> _Match:
        """The complex form with freqs whose layout is not visible here (mistral-inference passes
        ``[T, 1, D/2]`` for ``[T, N, D]`` tokens): the shapes are checked at run time. 3-D tokens with
        3-D tables are seen as one batch (``[1, T, N, D]`` with ``1S1D`` cos/sin); the fused call runs
        only where x is 4-D and cos/sin batch-independent (npu_rotary_mul's interleave mode), else
        the original code does."""
        f_src = _atom(segment(module, freqs))
        xc_src = _atom(segment(module, xc))
        # per rotated tensor: the tables are lifted (or not) with their own x
        tag = _ident(segment(module, xc))
        cos, sin = f"_npufuse_{tag}_cos", f"_npufuse_{tag}_sin"
        xv, lift = f"_npufuse_{tag}_x", f"_npufuse_{tag}_tokens"
        prep = [
            f"{cos} = {f_src}.real.repeat_interleave(2, dim=-1)  # complex form = interleave rotation: cos of each lane pair",
            f"{sin} = {f_src}.imag.repeat_interleave(2, dim=-1)",
            f"{xv} = torch.view_as_real({xc_src}).flatten(-2)",
            f"{lift} = {xv}.dim() == 3 and {cos}.dim() == 3  # [T, N, D] tokens with [T, 1, D] tables: one batch of T",
            f"if {lift}:",
            f"    {xv}, {cos}, {sin} = {xv}[None], {cos}[None], {sin}[None]",
            f"{cos}, {sin} = {cos}[(None,) * (4 - {cos}.dim())], {sin}[(None,) * (4 - {sin}.dim())]  # the eager broadcast, made 4-D",
        ]
        m = _Match(
            node=node, mode="complex", x=x, cos=cos, sin=sin, cos_node=None, sin_node=None, x_text=xv,
            cos_info=_CosInfo(batch_free=False, layout="from freqs_cis, checked at run time"), prep=prep,
            x_dtype=cast, cs_dtype=None, suffix=f"[(0,) if {lift} else ()]",
        )
        # complex128 freqs (or float64 x) make the eager product float64, a dtype npu_rotary_mul does not take
        # interleave mode takes B*N < 1000 (spec 4.1): x's rows over the table's one long dim
        m.only_if = (f"{xv}.dim() == 4 and {cos}.dim() == 4 and {cos}.shape[0] == 1 and ({cos}.shape[1] == 1 or "
                     f"{cos}.shape[2] == 1) and {cos}.shape == {sin}.shape and torch.float64 not in ({xv}.dtype, {cos}.dtype)"
                     f" and {_interleave_rows_ok(xv, f'max({cos}.shape[:3])')}")
        return m

    # ---------------------------------------------------------------------------------------------
    def _finding(self, module: ModuleInfo, scope: Scope, items: list[tuple[int, ast.stmt, list[_Match]]]) -> Finding:
        lines: list[str] = []
        emitted_prep: set[str] = set()
        dtype_vars: dict[tuple[str, str, str, str], str] = {}
        all_matches = [m for _, _, ms in items for m in ms]
        risks: list[Risk] = []
        notes: list[str] = []
        promoted = False
        broadcast_note = False
        # a match fused only under a run-time condition may test its prepared cos/sin: its prep comes first
        hoisted: list[str] = []
        for m in all_matches:
            self._plan_lift(m)
        for _i, stmt, matches in items:
            if not matches:
                continue  # a statement the fused call replaces (absorbed halves)
            reps: list[tuple[ast.AST, str]] = []
            for m in matches:
                for p in m.prep:
                    if p not in emitted_prep:
                        (hoisted if m.only_if is not None else lines).append(p)
                        emitted_prep.add(p)
                for p in m.inner_prep:
                    if p not in emitted_prep:
                        lines.append(p)
                        emitted_prep.add(p)
                x, c, s = m.x_text, m.cos, m.sin
                lift_suffix = ""
                if m.lift:
                    # cos/sin (and x) of a rank not visible here (litgpt passes [T, D], vLLM [T, N, D] tokens,
                    # nanotron a [S, 1, D] table): the eager product broadcasts them from the right; npu_rotary_mul
                    # needs them 4-D, so the same broadcast is made explicit (leading 1s; a no-op view when 4-D)
                    x, c, s = m.lift
                    lines.extend(b for b in m.lift_binds if b not in lines)
                    broadcast_note = True
                c0, s0 = c, s  # the tables as named before any broadcast
                if m.lift and m.merge_lead:
                    x, c, s, lift_suffix = _merged_lead_call(x, c, s)
                elif m.lift:
                    c, s = f"{c}[(None,) * (4 - {c}.dim())]", f"{s}[(None,) * (4 - {s}.dim())]"
                    lift_suffix = f"[(0,) * (4 - {x}.dim())]"
                    x = f"{x}[(None,) * (4 - {x}.dim())]"
                same = m.x_dtype is not None and m.x_dtype == m.cs_dtype
                if m.mode == "complex" and m.x_dtype == "float32":
                    same = True  # complex64 freqs: real/imag are float32 like the upcast x
                to_eager = ""
                if not same:
                    key = (x, c, s, m.widen)
                    var = dtype_vars.get(key)
                    if var is None:
                        var = f"_npufuse_{_ident(m.x_text)}_dtype"
                        dtype_vars[key] = var
                        # eager x*cos promotes (bf16 x, fp32 cos -> fp32); npu_rotary_mul computes in x's dtype
                        lines.append(
                            f"{var} = torch.promote_types(torch.promote_types({_atom(m.lift[0] if m.lift else m.x_text)}.dtype, {_atom(c0)}.dtype), {_atom(s0)}.dtype)"
                            + (f"  # the eager x*cos dtype (wider of x, cos, sin)" if not m.widen else
                               f"\n{var} = torch.promote_types({var}, {m.widen})  # the helper rotates in {m.widen}: the eager sum is at least that")
                        )
                        # s42: float64 tables (memes2's ``base.sin()`` of a float64 arange) promote x*cos to float64,
                        # which npu_rotary_mul does not take: it computes in float32 and the result is given the eager dtype
                        lines.append(f"{var}_npu = torch.float32 if {var} == torch.float64 else {var}  # npu_rotary_mul has no float64")
                    promoted = True
                    x, c, s = f"{_atom(x)}.to({var}_npu)", f"{_atom(c)}.to({var}_npu)", f"{_atom(s)}.to({var}_npu)"
                    to_eager = f".to({var})"
                mode_arg = ', rotary_mode="interleave"' if m.mode in ("interleave", "complex") else ""
                if m.mode_expr is not None:
                    mode_arg = f", rotary_mode={m.mode_expr}"
                reps.append((m.node, m.wrap.format(f"torch_npu.npu_rotary_mul({x}, {c}, {s}{mode_arg}){m.suffix}{lift_suffix}{to_eager}{m.post}")))
            target = next((m.site_stmt for m in matches if m.site_stmt is not None), stmt)
            local = matches[0].local
            if matches[0].anchor is not None and len(_branch_of(matches[0].anchor, matches[0].site_stmt) or []) > 1:  # type: ignore[arg-type]
                lines.extend(_branch_with_sites(module, matches, reps))
            elif local is not None:
                lines.append(f"return ({replace_segments(module, local.body, reps)})")  # type: ignore[arg-type]
            else:
                lines.append(replace_segments(module, target, reps))
        if broadcast_note:
            notes.append("cos/sin come from the caller with a rank not visible here: they are given leading size-1 dims up to 4-D, "
                         "the broadcast the eager product makes (npu_rotary_mul rejects 2-D/3-D cos/sin)")
        if promoted:
            notes.append(
                "dtype: the eager q*cos promotes to the wider dtype (an fp32 cos with a bf16 q gives fp32) while npu_rotary_mul "
                "computes in x's dtype, so x, cos and sin are brought to the promoted dtype first (a no-op when they already agree); "
                "float64 (float64 tables) is computed in float32, which the op takes, and the result given the eager dtype"
            )
        first = all_matches[0]
        mode = first.mode
        joined_tail = [m.wrap.startswith("torch.cat(") for m in all_matches]  # a filled prefix joined with x's tail
        if any(m.rotary_dim != "full" and not j for m, j in zip(all_matches, joined_tail)):
            notes.append(
                "partial rotary: only the rotated slice goes through npu_rotary_mul; the pass-through part is concatenated by the original code"
            )
        if any(joined_tail):
            notes.append("partial rotary filled into a new tensor: the rotated prefix goes through npu_rotary_mul and what the fills "
                         "leave in the rest is joined after it (zeros for zeros_like; x's tail for empty_like, whose rest is "
                         "undefined); the original's own copy of the tail into that tensor, if any, still runs")
        ci = first.cos_info
        risks.append(
            Risk(
                "layout",
                "npu_rotary_mul takes 4-D x with cos/sin broadcast as 11SD/B1SD/BNSD (x BNSD), 1S1D/BS1D/BSND (x BSND) or S11D/SB1D/SBND (x SBND)"
                + (" — interleave mode only the batch-independent 11SD/1S1D/S11D" if mode != "half" else "")
                + f"; cos here: {ci.layout or 'as passed by the caller (shape not visible in this function)'}",
            )
        )
        if any(m.cos_node is not None and getattr(m.cos_node, "lineno", None) is None for m in all_matches):
            risks.append(Risk("numerics", "cos/sin are taken with the scale factor(s) of the original products folded in "
                              "(`x * cos * scale`: rounded once more in low precision); npu_rotary_mul documents cos/sin values in "
                              "[-1, 1], which a scale above 1 leaves (whether the kernel depends on it is not known)"))
        if any(isinstance(_resolve(scope, m.x), ast.Subscript) for m in all_matches):
            risks.append(Risk("non_contiguous", "the rotated tensor is a slice view (partial rotary): a strided input"))
        risks.append(Risk("other", "npu_rotary_mul saves x for backward even when cos/sin need no grad: slightly more activation memory than the eager code"))
        risks.extend(r for m in all_matches for r in m.extra_risks if r not in risks)
        if mode == "complex":
            notes.append("complex form: cos/sin are rebuilt from freqs_cis each call (real/imag, repeat_interleave(2)); precompute them once per step to save two small kernels")
        outside = self._rotation_outside(scope, all_matches, items[0][1].lineno)
        if outside:
            notes.append(f"the rotation {', '.join(outside)} is computed before the site and still runs on both branches "
                         "(its neg + cat kernels stay); move it into the site to drop them on the fused branch")  # fmt: skip
        params: dict[str, Any] = {
            "mode": mode,
            "rotary_dim": first.rotary_dim,
            "cos": first.cos if mode != "complex" else "freqs.real.repeat_interleave(2)",
            "sin": first.sin if mode != "complex" else "freqs.imag.repeat_interleave(2)",
            "cos_layout": ci.layout,
            "targets": [m.x_text if m.mode != "complex" else segment(module, strip_casts(m.x)[0]) for m in all_matches],
            "dtype": "promoted to the wider of x and cos/sin" if promoted else "x dtype",
        }
        if outside:
            params["rotation_outside"] = outside
        if ci.unsqueeze_dim is not None:
            params["unsqueeze_dim"] = ci.unsqueeze_dim
        if mode == "complex":
            params["freqs"] = segment(module, self._complex_freqs(first))
        first_stmt, last_stmt = items[0][1], items[-1][1]
        guard = self._guard(first)
        variant = {"half": "rotate_half", "interleave": "rotate_every_two", "complex": "complex_freqs_cis"}[mode]
        if first.rotary_dim != "full":
            variant += "_partial"
        conditions = sorted({m.only_if for m in all_matches if m.only_if is not None})
        if conditions:
            cond = " and ".join(conditions) if len(conditions) == 1 else " and ".join(f"({c})" for c in conditions)
            span = [st for _i, st, _ms in items]
            original = _block_text(module, span) if first.local is None else f"return ({segment(module, first.local.body)})"
            lines = hoisted + [f"if {cond}:"] + ["    " + ln if ln.strip() else ln for ln in "\n".join(lines).splitlines()] + \
                ["else:"] + ["    " + ln if ln.strip() else ln for ln in original.splitlines()]
            if any(m.suffix and m.mode == "complex" for m in all_matches):
                notes.append("complex form with freqs of a layout not visible here: [T, N, D] tokens are seen as one batch [1, T, N, D]; "
                             "fused where x is 4-D and cos/sin batch-independent (npu_rotary_mul's interleave mode takes only "
                             "11SD/1S1D/S11D), checked at run time; elsewhere the original code runs")
                variant = "complex_freqs_cis_checked"
            elif any(m.matrix for m in all_matches):
                notes.append("per-pair 2x2 matrix form: cos = F[..., 0, 0], sin = F[..., 1, 0] repeat_interleave(2); "
                             + "; ".join(sorted({m.only_note for m in all_matches if m.only_note}))
                             + " (the apply function's argument is not traced to it: a risk); fused where x is 4-D and the matrix "
                             "batch-independent (npu_rotary_mul's interleave mode takes only 11SD/1S1D/S11D), checked at run time on "
                             "shapes; elsewhere the original code runs")
                variant = "rotation_matrix_pairs"
                risks.append(Risk("other", "the per-pair matrix is assumed to be the [[cos, -sin], [sin, cos]] rotation built by "
                                  + ", ".join(sorted({f"`{m.producer}`" for m in all_matches if m.matrix}))
                                  + " in this module: the argument applied here is not traced back to it"))
            elif any(m.suffix for m in all_matches):
                notes.append("pairs of a real (cos, sin) cache: fused where x is 4-D and cos/sin batch-independent (npu_rotary_mul's "
                             "interleave mode takes only 11SD/1S1D/S11D), checked at run time; elsewhere the original code runs")
                variant = "interleaved_pairs_real_cache"
            elif any(m.only_note for m in all_matches):
                notes.append(f"fused where `{cond}`; " + "; ".join(sorted({m.only_note for m in all_matches if m.only_note}))
                             + ": there the original code runs")
                checked = any("checked at run time" in (m.cos_info.layout or "") for m in all_matches)
                variant = "interleave_tables_checked" if checked else "rotation_helper_one_path_verified"
                if not checked and all("run-time split point" in m.only_note for m in all_matches if m.only_note):
                    variant = "halves_split_checked"
            elif any(m.chosen_half for m in all_matches):
                notes.append(f"the rotation helper is chosen at run time: its rotate_half choice (where `{cond}`) is fused; the interleaved "
                             "choice keeps the original code (npu_rotary_mul's interleave mode needs batch-independent cos/sin, not provable here)")
                variant = "rotate_half_chosen_at_run_time"
            if any(m.lift and m.merge_lead for m in all_matches):
                notes.append("x above 4-D (e.g. q and k stacked as one tensor) runs fused with its leading axes merged into one "
                             "(npu_rotary_mul takes 4-D only) where cos/sin are 1 along those axes and their product is below "
                             "1000, checked at run time, and gets its axes back after; elsewhere the original code runs")
            elif any(m.lift for m in all_matches):
                notes.append("fused where x is at most 4-D (npu_rotary_mul takes 4-D only; lower ranks get leading 1s, "
                             "the eager broadcast); a higher rank runs the original code")
        if first.mode_expr is not None:
            params["mode"] = f"chosen at run time: {first.mode_expr}"
            variant = "rotation_chosen_at_run_time"
            notes.append(f"the rotation helper is chosen at run time; both choices are verified and rotary_mode follows the same condition ({first.mode_expr})")
        if first.local is not None:
            # the lambda / comprehension element becomes a local function holding the fused statements
            # (closing over the same names); the statement calls it where it held them
            local = first.local
            fn = f"_npufuse_rope_{first_stmt.lineno}"
            lines = [f"def {fn}({local.param}):"] + ["    " + ln if ln.strip() else ln for ln in "\n".join(lines).splitlines()] + \
                [replace_segments(module, first_stmt, [(local.replace, local.call.format(fn=fn))])]
            guard = _local_guard(local, first) or guard
            params[local.kind] = local.text
            notes.append(f"the rotation is written in a {local.kind}: it becomes a local function `{fn}` holding the fused call "
                         "(the same closure over the enclosing names), called where the original computed it")
        tests = _conditional_tests(module, items)
        if tests:
            # a rotation written in a conditional expression (``k_embed = <rot(k)> if k is not None else None``) is
            # computed only where its test holds: the fused branch runs only where every such test holds, so the
            # run-time checks never read the shape of a None operand (audit33: yarn's ReRoPE passes k=None)
            guard = f"{_atom(guard)} if {' and '.join(tests)} else None"
            notes.append("the rotations sit in conditional expressions: the fused branch runs only where "
                         + " and ".join(f"`{t}`" for t in tests) + " hold; elsewhere the original code runs")
        return Finding(
            pattern=self.id, qualname=scope.qualname, line=first_stmt.lineno, end_line=last_stmt.end_lineno or last_stmt.lineno,
            params=params, fused="\n".join(lines), guard_tensor=guard, confidence="high", variant=variant,
            risks=risks, notes=notes,
        )

    @staticmethod
    def _plan_lift(m: _Match) -> None:
        """Decide whether x/cos/sin are lifted to 4-D at run time, binding each to a name inside the
        fused branch (an expression is evaluated once) and fusing only where x is at most 4-D (a 5-D x
        broadcasts in eager code but npu_rotary_mul rejects it, so the original code runs there)."""
        if m.mode == "complex" or m.suffix or m.cos_info.rank == 4 or m.cos_info.contract_4d:
            return
        names, binds = [], []
        for role, text in (("x", m.x_text), ("cos", m.cos), ("sin", m.sin)):
            if _is_name(text) and "." not in text:
                names.append(text)
                continue
            tmp = f"_npufuse_{_ident(m.x_text)}_{role}"
            binds.append(f"{tmp} = {text}")
            names.append(tmp)
        m.lift = (names[0], names[1], names[2])
        m.lift_binds = binds
        # x's rank, read without evaluating x twice: a cast or a last-dim slice keeps the rank of its base
        base = m.x
        while True:
            inner, casts = strip_casts(base)
            if casts:
                base = inner
            elif isinstance(base, ast.Subscript) and _Halves(None, lambda n: True)._last_dim_slice(base) is not None:  # type: ignore[arg-type]
                base = base.value
            elif _method(base, "transpose", "contiguous", "permute"):
                base = base.func.value  # rank kept
            else:
                break
        merged = 0
        if isinstance(base, ast.Call) and canonical.merges_last_two(base) is base.func.value and isinstance(base.func.value, ast.Name):  # type: ignore[attr-defined]
            # a pairs view flattened back (``qk.flatten(-2)`` of ``qk = qk.reshape(.., -1, 2)``): one rank less
            base, merged = base.func.value, 1  # type: ignore[attr-defined]
        if isinstance(base, ast.Name) and merged:
            rank_ok = f"{base.id}.dim() <= 5"
            rank_ok = _merged_lead_rank_ok(m, rank_ok, f"({base.id}.dim() - 1)", f"{base.id}.shape[:-4]")
            if m.mode != "half" and _is_name(m.cos) and "." not in m.cos:
                # interleave: B*N < 1000 (x's rows over the table's one long dim), read on the [.., D/2, 2] view
                rank_ok += (f" and {base.id}.numel() // max({base.id}.shape[-1] * {base.id}.shape[-2], 1)"
                            f" < 1000 * max({m.cos}.shape[:-1], default=1)")
            # the op's head-dim limit (spec §4.1), read at run time: a rotation of the hidden state before the
            # head split rotates D = the model width (LTX-Video: 2048; audit33: the call the op rejects)
            rank_ok += f" and {base.id}.shape[-1] * {base.id}.shape[-2] < {_MAX_D}"
            m.only_if = rank_ok if m.only_if is None else f"({m.only_if}) and {rank_ok}"
        elif isinstance(base, ast.Name):
            # (no merging of leading axes here: a rotation written with positive dims, ``cat(.., 3)``, which
            # _pair_of takes as the last dim of a 4-D x, is another computation on a 5-D x)
            rank_ok = f"{base.id}.dim() <= 4 and {base.id}.shape[-1] < {_MAX_D}"  # (the head-dim limit, as above)
            # the table as the original code names it (a prepared _npufuse_ table is bound later)
            table = m.cos if not m.cos.startswith("_npufuse_") else (m.cos_node.id if isinstance(m.cos_node, ast.Name) else "")
            limits = _lifted_limits(base.id, table, m.mode) if table else ""
            if limits:
                rank_ok = f"{rank_ok} and {limits}"
            m.only_if = rank_ok if m.only_if is None else f"({m.only_if}) and {rank_ok}"

    @staticmethod
    def _rotation_outside(scope: Scope, matches: list[_Match], first_line: int) -> list[str]:
        """Names in the fused expressions whose value (a cat / neg / rotate_half) is computed
        before the site: the eager rotation that keeps running outside the rewritten span."""
        found: list[str] = []
        for m in matches:
            for n in fast_walk(m.node):
                if not isinstance(n, ast.Name) or n.id in ("torch", "self", "F", "nn", "math"):
                    continue
                value = scope.definition(n.id, first_line)
                if value is None:
                    continue
                calls = {getattr(c.func, "attr", None) or getattr(c.func, "id", None) for c in fast_walk(value) if isinstance(c, ast.Call)}
                negs = any(isinstance(c, ast.UnaryOp) and isinstance(c.op, ast.USub) for c in fast_walk(value))
                if calls & {"cat", "stack", "rotate_half", "rotate_every_two"} or (negs and "cat" in calls):
                    tag = f"`{n.id}` (line {value.lineno})"
                    if tag not in found:
                        found.append(tag)
        return found

    @staticmethod
    def _complex_freqs(m: _Match) -> ast.expr:
        if m.freqs is not None:
            return m.freqs
        prod = m.node.func.value.args[0]  # type: ignore[attr-defined]
        return prod.right if ast.unparse(prod.left) in m.x_text else prod.left

    @staticmethod
    def _guard(m: _Match) -> str:
        """A tensor live at the span start: the first plain name inside the rotated tensor's expression."""
        for n in fast_walk(m.x):
            if isinstance(n, ast.Name) and n.id not in ("torch", "self", "F", "nn", "math"):
                return n.id
        return ast.unparse(m.x)

    # ---------------------------------------------------------------------------------------------
    def assess(self, finding: Finding, config: dict[str, Any]) -> dict[str, Any]:
        n_targets = max(1, len(finding.params.get("targets", [])))
        hidden = config.get("hidden_size")
        heads = config.get("num_attention_heads")
        # honest counts: a rotation computed before the site (neg + cat) keeps running on the fused
        # branch, and the dtype promotion casts x/cos/sin (a kernel each when the dtypes differ)
        stay = 2 if finding.params.get("rotation_outside") else 0
        casts = finding.params.get("dtype", "").startswith("promoted")
        after_k = 1 + stay
        tail = ""
        if stay:
            tail += f"; the rotation before the site ({', '.join(finding.params['rotation_outside'])}) still runs: its neg + cat stay"
        if casts:
            tail += "; plus up to 3 cast kernels when x and cos/sin differ in dtype (e.g. bf16 q, fp32 cos under autocast)"
        if not (hidden and heads):
            return symbolic(
                "memory",
                f"memory-bound elementwise chain: per rotated tensor of E elements the eager code runs ~5 kernels "
                f"(mul, neg, cat, mul, add) moving ~10·E·bytes; the fused branch runs {after_k} (npu_rotary_mul reads x once and writes once, ~2·E·bytes){tail}; "
                f"{n_targets} tensor(s) at this site; shapes unknown",
            )
        kv = config.get("num_key_value_heads") or heads
        d = config.get("head_dim") or hidden // heads
        b, s = config.get("batch_size", 1), config.get("seq_length", 4096)
        elems = [b * s * heads * d] + [b * s * kv * d] * (n_targets - 1)
        cs = 2 * b * s * d  # cos + sin (B1SD), read by each mul
        itemsize = 2
        before = sum(10 * e + 2 * cs for e in elems) * itemsize
        after = sum((2 + (4 if stay else 0)) * e + 2 * cs for e in elems) * itemsize  # neg + cat: read/write E twice
        res = estimate(
            bytes_before=before, bytes_after=after, kernels_before=5 * n_targets, kernels_after=after_k * n_targets,
            flops=sum(4 * e for e in elems),
            shapes=f"B={b}{' (assumed)' if 'batch_size' not in config else ''}, S={s}{' (assumed)' if 'seq_length' not in config else ''}, "
            f"heads={heads}, kv_heads={kv}, head_dim={d}, bf16",
        )
        res["estimate"] += tail
        return res

    @staticmethod
    def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str = "half") -> torch.Tensor:
        """Eager rotary embedding: ``x*cos + R(x)*sin`` with R = rotate_half or the interleaved rotation."""
        # torch only when the reference runs: scanning never imports it
        import torch
        if mode == "half":
            x1, x2 = x.chunk(2, dim=-1)
            rot = torch.cat((-x2, x1), dim=-1)
        elif mode in ("interleave", "complex"):
            rot = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        else:
            raise ValueError(f"unknown rotary mode {mode!r}")
        return x * cos + rot * sin

    # -- examples ---------------------------------------------------------------------------------
    FUSE = []  # filled below
    KEEP = []


_HF_ROTATE_HALF = '''
import torch


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
'''

_HF_COS = '''
def _cos_sin(b, s, d, dtype=torch.float32):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    pos = torch.arange(s).float()[None, :].expand(b, s)
    freqs = pos[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
'''

RopePattern.FUSE = [
    Fuse(
        name="hf_llama",
        code=_HF_ROTATE_HALF + '''

def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
''' + _HF_COS,
        expect={"mode": "half", "rotary_dim": "full", "cos": "cos", "unsqueeze_dim": "unsqueeze_dim", "targets": ["q", "k"], "qualname": "apply_rotary_pos_emb"},
        run='''
q = torch.randn(2, 4, 8, 16, requires_grad=True)
k = torch.randn(2, 2, 8, 16, requires_grad=True)
cos, sin = _cos_sin(2, 8, 16)
out = apply_rotary_pos_emb(q, k, cos, sin)
leaves = [q, k]
''',
    ),
    Fuse(
        name="hf_bf16_q_fp32_cos",
        # the eager code promotes bf16 q * fp32 cos to fp32: the fused branch must return fp32 too
        code=_HF_ROTATE_HALF + '''

def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
''' + _HF_COS,
        expect={"mode": "half", "dtype": "promoted to the wider of x and cos/sin"},
        run='''
q = torch.randn(1, 4, 6, 32).bfloat16().requires_grad_()
k = torch.randn(1, 4, 6, 32).bfloat16().requires_grad_()
cos, sin = _cos_sin(1, 6, 32, torch.float32)
out = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
leaves = [q, k]
''',
    ),
    Fuse(
        name="chunk_bsnd_unsqueeze2",
        # rotate_half by chunk; q in BSND with cos unsqueezed at dim 2 (BS1D)
        code='''
import torch


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q, cos, sin):
    cos = cos.unsqueeze(2)
    sin = sin.unsqueeze(2)
    return q * cos + rotate_half(q) * sin
''' + _HF_COS,
        expect={"mode": "half", "cos_layout": "BS1D (x BSND; cos [B,S,D] unsqueezed at 2)", "targets": ["q"]},
        run='''
q = torch.randn(2, 8, 4, 16, requires_grad=True)
cos, sin = _cos_sin(2, 8, 16)
out = apply_rope(q, cos, sin)
leaves = [q]
''',
    ),
    Fuse(
        name="phi_partial_rotary",
        # Phi / GPT-NeoX (transformers >= 4.48): rotary_dim = cos.shape[-1] < head_dim
        code=_HF_ROTATE_HALF + '''

def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)

    # Keep half or full tensor for later concatenation
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]

    # Apply rotary embeddings on the first half or full tensor
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)

    # Concatenate back to full shape
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed
''' + _HF_COS,
        expect={"mode": "half", "rotary_dim": "rotary_dim", "targets": ["q_rot", "k_rot"], "variant": "rotate_half_partial"},
        run='''
q = torch.randn(2, 4, 8, 32, requires_grad=True)
k = torch.randn(2, 4, 8, 32, requires_grad=True)
cos, sin = _cos_sin(2, 8, 16)
out = apply_rotary_pos_emb(q, k, cos, sin)
leaves = [q, k]
''',
    ),
    Fuse(
        name="neox_rotary_ndims_inline_cat",
        # older GPT-NeoX spelling: a method slicing self.rotary_ndims, the rope inline in the cat
        code=_HF_ROTATE_HALF + '''
import torch.nn as nn


class NeoXRotary(nn.Module):
    def __init__(self, head_size, rotary_pct=0.25):
        super().__init__()
        self.rotary_ndims = int(head_size * rotary_pct)

    def forward(self, query, cos, sin):
        cos = cos[:, None, :, :]
        sin = sin[:, None, :, :]
        query_rot = query[..., : self.rotary_ndims]
        query_pass = query[..., self.rotary_ndims :]
        query = torch.cat((query_rot * cos + rotate_half(query_rot) * sin, query_pass), dim=-1)
        return query
''' + _HF_COS,
        expect={"mode": "half", "rotary_dim": "self.rotary_ndims", "cos_layout": "B1SD (x BNSD)", "qualname": "NeoXRotary.forward"},
        run='''
m = NeoXRotary(64)
query = torch.randn(2, 4, 8, 64, requires_grad=True)
cos, sin = _cos_sin(2, 8, 16)
out = m(query, cos, sin)
leaves = [query]
''',
    ),
    Fuse(
        name="qwen2_vl_vision_fp32",
        # Qwen2-VL vision tower style: upcast to fp32, rotate, cast back (here with 4-D BSND x)
        code=_HF_ROTATE_HALF + '''

def apply_rotary_pos_emb_vision(q, k, cos, sin):
    orig_q_dtype = q.dtype
    orig_k_dtype = k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    q_embed = q_embed.to(orig_q_dtype)
    k_embed = k_embed.to(orig_k_dtype)
    return q_embed, k_embed
''' + _HF_COS,
        expect={"mode": "half", "dtype": "x dtype", "targets": ["q", "k"]},
        run='''
q = torch.randn(1, 16, 4, 32).half().requires_grad_()
k = torch.randn(1, 16, 4, 32).half().requires_grad_()
cos, sin = _cos_sin(1, 16, 32)
out = apply_rotary_pos_emb_vision(q, k, cos, sin)
leaves = [q, k]
''',
    ),
    Fuse(
        name="interleaved_batch_free",
        # GPT-J rotate_every_two with a batch-independent 1S1D cos/sin table (interleave mode)
        code='''
import torch


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def apply_rotary_emb(x, sin, cos):
    sin = torch.repeat_interleave(sin, 2, dim=-1)[None, :, None, :]
    cos = torch.repeat_interleave(cos, 2, dim=-1)[None, :, None, :]
    return (x * cos) + (rotate_every_two(x) * sin)


def _tables(s, d):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(s).float()[:, None] * inv
    return freqs.sin(), freqs.cos()
''',
        expect={"mode": "interleave", "cos_layout": "1S1D (x BSND)", "targets": ["x"], "variant": "rotate_every_two"},
        run='''
x = torch.randn(2, 8, 4, 16, requires_grad=True)
sin, cos = _tables(8, 16)
out = apply_rotary_emb(x, sin, cos)
leaves = [x]
''',
    ),
    Fuse(
        name="meta_llama_complex",
        # Meta's reference llama model.py
        code='''
import torch


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor):
    ndim = x.ndim
    assert 0 <= 1 < ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)
''',
        expect={"mode": "complex", "freqs": "freqs_cis", "targets": ["xq", "xk"], "variant": "complex_freqs_cis"},
        run='''
xq = torch.randn(2, 8, 4, 16).bfloat16().requires_grad_()
xk = torch.randn(2, 8, 2, 16).bfloat16().requires_grad_()
freqs_cis = precompute_freqs_cis(16, 8)
out = apply_rotary_emb(xq, xk, freqs_cis)
leaves = [xq, xk]
''',
    ),
]

RopePattern.FUSE.append(
    Fuse(
        name="sam2_rotate_pairwise",
        # SAM2 / EdgeTAM: interleaved rotation via view(..., -1, 2).unbind(-1), fp32 upcast, 2-D cos table
        code='''
import torch


def rotate_pairwise(x):
    x = x.view(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(start_dim=-2)


def apply_rotary_pos_emb_2d(q, k, cos, sin):
    cos = cos[None, None]
    sin = sin[None, None]
    q_embed = q.float()  # force upscale to float32 as in the original implementation
    q_embed = (q_embed * cos) + (rotate_pairwise(q_embed) * sin)
    k_embed = k.float()
    k_embed = (k_embed * cos) + (rotate_pairwise(k_embed) * sin)
    return q_embed.type_as(q), k_embed.type_as(k)
''',
        expect={"mode": "interleave", "cos_layout": "11SD (x BNSD)", "targets": ["q_embed"]},
        run='''
q = torch.randn(2, 4, 8, 16).half().requires_grad_()
k = torch.randn(2, 4, 8, 16).half().requires_grad_()
ang = torch.randn(8, 8)
cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
out = apply_rotary_pos_emb_2d(q, k, cos, sin)
leaves = [q, k]
''',
    )
)

RopePattern.FUSE += [
    Fuse(
        name="deepseek_interleaved_pairs_written_out",
        # DeepSeek-V3 apply_rotary_pos_emb_interleave: the pair rotation written out on the even/odd
        # lanes with half-size cos/sin, concatenated as (even | odd): half mode on the de-interleaved x
        code='''
import torch


def apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)

    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]

    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_embed, k_embed
''' + _HF_COS,
        expect={"mode": "half", "targets": ["_npufuse_q_lanes", "_npufuse_k_lanes"], "line": 12, "end_line": 13},
        run='''
q = torch.randn(2, 4, 8, 16, requires_grad=True)
k = torch.randn(2, 1, 8, 16, requires_grad=True)
cos, sin = _cos_sin(2, 8, 16)
out = apply_rotary_pos_emb_interleave(q, k, cos, sin)
leaves = [q, k]
''',
    ),
    Fuse(
        name="cast_after_rotate_half",
        # Ernie 4.5: x.float() * cos + rotate_half(x).float() * sin — the cast commutes with the rotation
        code=_HF_ROTATE_HALF + '''

def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    original_dtype = q.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q.float() * cos) + (rotate_half(q).float() * sin)
    k_embed = (k.float() * cos) + (rotate_half(k).float() * sin)
    return q_embed.to(original_dtype), k_embed.to(original_dtype)
''' + _HF_COS,
        expect={"mode": "half", "targets": ["q.float()", "k.float()"]},
        run='''
q = torch.randn(2, 4, 8, 16).to(torch.bfloat16).requires_grad_()
k = torch.randn(2, 2, 8, 16).to(torch.bfloat16).requires_grad_()
cos, sin = _cos_sin(2, 8, 16)
out = apply_rotary_pos_emb(q, k, cos, sin)
leaves = [q, k]
''',
    ),
    Fuse(
        name="roformer_stack_reshape_as",
        # RoFormer: the interleaved rotation inline, merged back with reshape_as(x); a batch-free table
        code='''
import torch


def apply_rotary_position_embeddings(sinusoidal_pos, query_layer):
    sin, cos = sinusoidal_pos.chunk(2, dim=-1)
    sin_pos = torch.stack([sin, sin], dim=-1).reshape_as(sinusoidal_pos)[None, None]
    cos_pos = torch.stack([cos, cos], dim=-1).reshape_as(sinusoidal_pos)[None, None]
    rotate_half_query_layer = torch.stack([-query_layer[..., 1::2], query_layer[..., ::2]], dim=-1).reshape_as(query_layer)
    query_layer = query_layer * cos_pos + rotate_half_query_layer * sin_pos
    return query_layer
''',
        expect={"mode": "interleave", "targets": ["query_layer"]},
        run='''
ang = torch.randn(8, 8)
sinusoidal_pos = torch.cat([ang.sin(), ang.cos()], dim=-1)
q = torch.randn(2, 4, 8, 16, requires_grad=True)
out = apply_rotary_position_embeddings(sinusoidal_pos, q)
leaves = [q]
''',
    ),
]

RopePattern.KEEP = [
    Keep(
        name="sign_flipped_rotate_half",
        code='''
import torch


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((x2, -x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
''',
        reason="sign flipped",
    ),
    Keep(
        name="gptj_per_batch_interleave",
        # HF GPT-J: sin/cos gathered by position_ids are [B, S, D/2] -> BS1D, per batch
        code='''
import torch


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)  # in einsum notation: rearrange(x, '... d j -> ... (d j)')


def apply_rotary_pos_emb(tensor: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)
''',
        reason="interleave mode with cos/sin that may depend on the batch",
    ),
    Keep(
        name="odd_partial_rotary_dim",
        code='''
import torch


def rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_partial(q, cos, sin):
    q_rot, q_pass = q[..., :33], q[..., 33:]
    q_rot = q_rot * cos + rotate_half(q_rot) * sin
    return torch.cat((q_rot, q_pass), dim=-1)
''',
        reason="rotary dim 33 is odd",
    ),
    Keep(
        name="three_d_cos",
        # cos/sin indexed to 3-D: the fused op takes 4-D only
        code='''
import torch


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_3d(t, cos, sin):
    cos = cos.view(cos.shape[0], 1, cos.shape[-1])
    sin = sin.view(sin.shape[0], 1, sin.shape[-1])
    return t * cos + rotate_half(t) * sin
''',
        reason="cos/sin are 3-D",
    ),
    Keep(
        name="imported_rotate_half",
        code='''
import torch
from other_models.modeling import rotate_half


def apply_rotary(q, cos, sin):
    return q * cos + rotate_half(q) * sin
''',
        reason="not defined in this module",
    ),
    Keep(
        name="plain_scaled_sum",
        # a weighted sum of two products is not a rotation: nothing to report
        code='''
import torch


def mix(a, b, wa, wb):
    return a * wa + torch.tanh(b) * wb
''',
    ),
]


# -- issue 14, class 2: spellings outside HF ---------------------------------------------------

_ROTATE_EITHER = '''
import torch
from torch import nn


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class Rotary(nn.Module):
    def __init__(self, neox=True):
        super().__init__()
        self.neox = neox

    def forward(self, q, cos, sin):
        rotate_fn = rotate_half if self.neox else rotate_every_two
        return q * cos + rotate_fn(q) * sin
'''

RopePattern.FUSE += [
    Fuse(
        # vLLM/NeoX written out: x1, x2 = chunk(x, 2, -1); cat((x1*cos - x2*sin, x2*cos + x1*sin), -1), half-size tables
        name="neox_chunk_written_out_half_tables",
        code='''
import torch


def apply_rotary(x, cos, sin):
    cos = cos[None, None]
    sin = sin[None, None]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
''',
        expect={"mode": "half", "targets": ["x"], "qualname": "apply_rotary"},
        run='''
x = torch.randn(2, 4, 8, 16, requires_grad=True)
ang = torch.arange(8).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
out = apply_rotary(x, ang.cos(), ang.sin())
leaves = [x]
''',
    ),
    Fuse(
        # litgpt: slices by head_size // 2 and an inline rotated cat, then .to(dtype)
        name="litgpt_inline_rotated_cat",
        code='''
import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    head_size = x.size(-1)
    x1 = x[..., : head_size // 2]
    x2 = x[..., head_size // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    roped = (x * cos) + (rotated * sin)
    return roped.to(dtype=x.dtype)
''',
        expect={"mode": "half", "targets": ["x"]},
        run='''
x = torch.randn(2, 4, 8, 16, dtype=torch.bfloat16, requires_grad=True)
ang = torch.arange(8).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
emb = torch.cat((ang, ang), dim=-1)
out = apply_rope(x, emb.cos(), emb.sin())
leaves = [x]
''',
    ),
    Fuse(
        # the helper is picked by a flag: its rotate_half choice is fused, the interleaved one keeps the original
        name="helper_chosen_by_a_flag",
        code=_ROTATE_EITHER,
        expect={"variant": "rotate_half_chosen_at_run_time", "mode": "half", "targets": ["q"], "qualname": "Rotary.forward"},
        run='''
q = torch.randn(2, 4, 8, 16, requires_grad=True)
ang = torch.arange(8).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
emb = torch.cat((ang, ang), dim=-1)
emb_i = ang.repeat_interleave(2, dim=-1)
out = (Rotary(True)(q, emb.cos(), emb.sin()), Rotary(False)(q, emb_i.cos(), emb_i.sin()))
leaves = [q]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        _ROTATE_EITHER.replace("rotate_half if self.neox else rotate_every_two", "rotate_half if self.neox else self.rotate_custom")
        + '''
    def rotate_custom(self, x):
        return torch.cat((x[..., 1:], x[..., :1]), dim=-1)
''',
        reason="`Rotary.rotate_custom` does not compute the standard rotate_half",
        name="helper_chosen_by_a_flag_one_choice_unverified",
    ),
]

_GPT_FAST_PAIRS = '''
import torch
from torch import Tensor


def precompute_freqs_cis(seq_len: int, n_elem: int, base: int = 10000, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].float() / n_elem))
    t = torch.arange(seq_len, device=freqs.device)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    cache = torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)
    return cache.to(dtype=dtype)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )

    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)
'''

RopePattern.FUSE += [
    Fuse(
        # gpt-fast / lit-llama: (cos, sin) pairs of a real cache times the lanes of x.reshape(..., -1, 2)
        name="gpt_fast_lane_pairs_real_cache",
        code=_GPT_FAST_PAIRS,
        expect={"mode": "interleave", "variant": "interleaved_pairs_real_cache", "qualname": "apply_rotary_emb", "line": 18, "end_line": 24},
        run='''
x = torch.randn(2, 6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
out = apply_rotary_emb(x, precompute_freqs_cis(6, 16))
leaves = [x]
''',
    ),
    Fuse(
        # lit-llama spells the factors the other way round and trims the cache first; fp32 x here
        name="lit_llama_lane_pairs_factors_swapped",
        code=_GPT_FAST_PAIRS.replace("xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1]",
                                     "freqs_cis[..., 0] * xshaped[..., 0] - freqs_cis[..., 1] * xshaped[..., 1]"),
        expect={"mode": "interleave"},
        run='''
x = torch.randn(1, 5, 2, 8, requires_grad=True)
out = apply_rotary_emb(x, precompute_freqs_cis(5, 8, dtype=torch.float16))
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    # the cache reshaped here to x's batch and sequence dims (one row of positions per example, unified-io-2's
    # per-example rope cache): a batch-dependent layout written out, refused like the others seen in the function
    Keep(_GPT_FAST_PAIRS.replace("freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)",
                                 "freqs_cis = freqs_cis.reshape(xshaped.shape[0], xshaped.shape[1], 1, xshaped.shape[3], 2).float()"),
         reason="interleave mode with cos/sin that may depend on the batch", name="lane_pairs_cache_sized_by_the_batch"),
]

RopePattern.KEEP += [
    Keep(
        # the second lane's sign flipped: not a rotation
        _GPT_FAST_PAIRS.replace("xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1]",
                                "xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 1] * freqs_cis[..., 1]"),
        name="lane_pairs_not_a_rotation",
    ),
]

_MISTRAL_TOKENS = '''
from typing import Tuple

import torch


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, None, :]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(-2)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)
'''

RopePattern.FUSE += [
    Fuse(
        # mistral-inference: [T, N, D] tokens (no batch dim), freqs [T, 1, D/2]: seen as [1, T, N, D] with 1S1D tables
        name="mistral_complex_3d_tokens",
        code=_MISTRAL_TOKENS,
        expect={"variant": "complex_freqs_cis_checked", "mode": "complex", "qualname": "apply_rotary_emb"},
        run='''
xq = torch.randn(7, 4, 16, dtype=torch.bfloat16, requires_grad=True)
xk = torch.randn(7, 2, 16, dtype=torch.bfloat16, requires_grad=True)
out = apply_rotary_emb(xq, xk, precompute_freqs_cis(16, 7, 10000.0))
leaves = [xq, xk]
''',
    ),
    Fuse(
        # the same code on batched [B, T, N, D] input: the [T, 1, D] tables broadcast as 1S1D
        name="mistral_complex_batched_input",
        code=_MISTRAL_TOKENS,
        expect={"variant": "complex_freqs_cis_checked"},
        run='''
xq = torch.randn(2, 7, 4, 16, requires_grad=True)
# s34: B*N = 1000 ([250, S, 4, D] with 1S1D tables) is over npu_rotary_mul's interleave limit: the original code runs
wide = torch.randn(250, 7, 4, 16, requires_grad=True)
out = (apply_rotary_emb(xq, torch.randn(2, 7, 2, 16), precompute_freqs_cis(16, 7, 10000.0)),
       apply_rotary_emb(wide, torch.randn(250, 7, 1, 16), precompute_freqs_cis(16, 7, 10000.0)))
leaves = [xq, wide]
''',
    ),
    Fuse(
        # s32 (mistral-src): the pair merge spelled ``flatten(2)``, a positive axis of a view whose rank is x's
        # rank + 1 (``reshape(*x.shape[:-1], -1, 2)``): for [T, N, D] tokens it merges only the lane pairs
        name="mistral_complex_tokens_flatten_positive_axis",
        code=_MISTRAL_TOKENS.replace(".flatten(-2)", ".flatten(2)"),
        expect={"variant": "complex_freqs_cis_checked", "mode": "complex", "qualname": "apply_rotary_emb"},
        run='''
xq = torch.randn(7, 4, 16, dtype=torch.bfloat16, requires_grad=True)
xk = torch.randn(7, 2, 16, dtype=torch.bfloat16, requires_grad=True)
out = apply_rotary_emb(xq, xk, precompute_freqs_cis(16, 7, 10000.0))
leaves = [xq, xk]
''',
    ),
    Fuse(
        # the same spelling on batched [B, T, N, D] input: flatten(2) merges the heads too ([B, T, N*D]), so the
        # fused result is flattened the same way after the call
        name="mistral_complex_flatten_positive_axis_merges_heads",
        code=_MISTRAL_TOKENS.replace(".flatten(-2)", ".flatten(2)").replace("x.shape[:-1], -1, 2)", "x.shape[:-1], -1, 2)"),
        expect={"variant": "complex_freqs_cis_checked"},
        run='''
xq = torch.randn(2, 7, 4, 16, requires_grad=True)
out = apply_rotary_emb(xq, torch.randn(2, 7, 2, 16), precompute_freqs_cis(16, 7, 10000.0))
leaves = [xq]
''',
    ),
    Fuse(
        # ``unflatten(-1, (-1, 2))`` pairs (rank x's + 1 as well) merged by ``flatten(3)`` of 4-D [B, S, N, D]
        # input given tables [S, 1, D/2]: here flatten(3) is the pair merge itself
        name="complex_unflatten_pairs_flatten_positive_axis",
        code='''
import torch


def rope(x, freqs_cis):
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * freqs_cis[:, None, :]).flatten(3).type_as(x)
''',
        expect={"variant": "complex_freqs_cis_checked", "qualname": "rope"},
        run='''
ang = torch.arange(5).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
x = torch.randn(2, 5, 3, 8, dtype=torch.float16, requires_grad=True)
out = rope(x, torch.polar(torch.ones_like(ang), ang))
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the pairs made of the two halves' lanes (``reshape(*x.shape[:-1], 2, -1)``: [.., 2, D/2]) are no lane
        # pairs of x: view_as_complex of them is not the interleaved rotation
        _MISTRAL_TOKENS.replace(".flatten(-2)", ".flatten(2)").replace("-1, 2))", "2, -1))"),
        name="complex_flatten_positive_axis_pairs_not_lanes",
    ),
]

RopePattern.FUSE += [
    Fuse(
        # vLLM-style [T, N, D] tokens with [T, 1, D] tables: x and cos/sin lifted to 4-D (one batch) and back
        name="tokens_3d_half_mode_lifted",
        code=[e for e in RopePattern.FUSE if e.name == "litgpt_inline_rotated_cat"][0].code,
        expect={"mode": "half", "targets": ["x"]},
        run='''
x = torch.randn(7, 4, 16, requires_grad=True)
ang = torch.arange(7).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
emb = torch.cat((ang, ang), dim=-1)[:, None, :]
out = apply_rope(x, emb.cos(), emb.sin())
leaves = [x]
''',
    ),
]

RopePattern.FUSE += [
    Fuse(
        # gpt-neox: rotate_half's cat over `dim=x1.ndim - 1` (the last dim, spelled by rank); [S, B, N, D] layout
        name="gpt_neox_cat_dim_by_rank_sbnd",
        code='''
import torch


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=x1.ndim - 1)


def apply_rotary_pos_emb_torch(q, k, cos, sin, offset: int = 0):
    cos, sin = cos[offset : q.shape[0] + offset, ...], sin[offset : q.shape[0] + offset, ...]
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
''',
        expect={"mode": "half", "targets": ["q", "k"]},
        run='''
q = torch.randn(6, 2, 4, 16, requires_grad=True)
k = torch.randn(6, 2, 4, 16, requires_grad=True)
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
emb = torch.cat((ang, ang), dim=-1)[:, None, None, :]
out = apply_rotary_pos_emb_torch(q, k, emb.cos(), emb.sin())
leaves = [q, k]
''',
    ),
]

_PALM_EINOPS = '''
import torch
from einops import rearrange


def rotate_half(x):
    x = rearrange(x, "... (j d) -> ... j d", j=2)
    x1, x2 = x.unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(pos, t):
    return (t * pos.cos()) + (rotate_half(t) * pos.sin())
'''

RopePattern.FUSE += [
    Fuse(
        # PaLM: einops halves inside rotate_half; the tables computed inline from a [n, d] pos (bound once, made 4-D)
        name="palm_einops_rotate_half",
        code=_PALM_EINOPS,
        expect={"mode": "half", "targets": ["t"]},
    ),
]

RopePattern.KEEP += [
    Keep(
        # j is the inner factor here: "(d j)" pairs neighbouring lanes, which is not rotate_half
        _PALM_EINOPS.replace('    x = rearrange(x, "... (j d) -> ... j d", j=2)\n', '    x = rearrange(x, "... (d j) -> ... j d", j=2)\n'),
        reason="does not compute the standard rotate_half",
        name="einops_inner_pair_axis",
    ),
]

_NANOCHAT = '''
import torch


def apply_rotary_emb(x, cos, sin):
    assert x.ndim == 4  # multihead attention
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    out = torch.cat([y1, y2], 3)
    out = out.to(x.dtype)
    return out
'''

_NANOCHAT_RUN = '''
x = torch.randn(2, 6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
cos, sin = ang.cos()[None, :, None, :].bfloat16(), ang.sin()[None, :, None, :].bfloat16()
out = apply_rotary_emb(x, cos, sin)
leaves = [x]
'''

RopePattern.FUSE += [
    Fuse(
        # nanochat / modded-nanogpt: named rotated halves with the rotation by -angle (sin negated); y1/y2 absorbed
        name="nanochat_named_halves_negative_angle",
        code=_NANOCHAT,
        expect={"mode": "half", "targets": ["x"], "line": 9, "end_line": 11},
        run=_NANOCHAT_RUN,
    ),
    Fuse(
        name="named_halves_standard_signs_chunk",
        code=_NANOCHAT.replace("    d = x.shape[3] // 2\n    x1, x2 = x[..., :d], x[..., d:]", "    x1, x2 = x.chunk(2, dim=-1)")
        .replace("x1 * cos + x2 * sin", "x1 * cos - x2 * sin").replace("x1 * (-sin) + x2 * cos", "x2 * cos + x1 * sin"),
        expect={"mode": "half", "targets": ["x"]},
        run=_NANOCHAT_RUN,
    ),
]

RopePattern.KEEP += [
    # y1 is read again after the cat: the halves stay (no site, nothing claimed)
    Keep(_NANOCHAT.replace("    return out", "    return out, y1"), name="named_halves_reused"),
    # both signs positive: not a rotation
    Keep(_NANOCHAT.replace("x1 * (-sin) + x2 * cos", "x1 * sin + x2 * cos"), name="named_halves_not_a_rotation"),
]


# -- issue 14, class 2 (continued): flagged helpers, rank lifting -----------------------------------

_FLAGGED_ROTATE = '''
import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, interleaved=False):
        super().__init__()
        self.interleaved = interleaved

    def rotate_half(self, x):
        """One helper, two layouts: the flag picks the return path."""
        if self.interleaved:
            even_dims = x[..., ::2]
            odd_dims = x[..., 1::2]
            return torch.cat((-odd_dims, even_dims), dim=-1)
        else:
            first_half = x[..., : x.shape[-1] // 2]
            second_half = x[..., x.shape[-1] // 2 :]
            return torch.cat((-second_half, first_half), dim=-1)

    def forward(self, t, cos, sin):
        # cos/sin are [S, D] tables: unsqueeze(1) gives [S, 1, D], the eager product broadcasts it as 1S1D
        rotated = (t * cos.unsqueeze(1)) + (self.rotate_half(t) * sin.unsqueeze(1))
        return rotated
'''

_FLAGGED_RUN = '''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
emb = torch.cat((ang, ang), dim=-1)
t = torch.randn(2, 6, 4, 16, requires_grad=True)
out = (Rotary(False)(t, emb.cos(), emb.sin()), Rotary(True)(t, emb.cos(), emb.sin()))
leaves = [t]
'''

RopePattern.FUSE += [
    Fuse(
        # nanotron: the helper's two return paths are chosen by self.interleaved; only the rotate_half path is a
        # rotation (the other cats the even/odd lanes, which npu_rotary_mul does not compute): fused under the flag
        name="helper_two_return_paths_one_verified",
        code=_FLAGGED_ROTATE,
        expect={"variant": "rotation_helper_one_path_verified", "mode": "half", "targets": ["t"], "qualname": "Rotary.forward"},
        run=_FLAGGED_RUN,
    ),
    Fuse(
        # both return paths rotations (rotate_half / interleaved stack): the mode follows the flag at run time
        name="helper_two_return_paths_both_rotations",
        code=_FLAGGED_ROTATE.replace("return torch.cat((-odd_dims, even_dims), dim=-1)",
                                     "return torch.stack((-odd_dims, even_dims), dim=-1).flatten(-2)"),
        expect={"mode": "half", "targets": ["t"]},
        run=_FLAGGED_RUN.replace("emb.cos(), emb.sin()), Rotary(True)(t, emb.cos(), emb.sin())",
                                 "emb.cos(), emb.sin()), Rotary(True)(t, ang.repeat_interleave(2, -1).cos(), ang.repeat_interleave(2, -1).sin())"),
    ),
    Fuse(
        # vLLM/sglang [T, N, D] tokens with [T, D/2] tables unsqueezed at -2: x and the widened tables lifted to 4-D
        name="vllm_tokens_3d_written_out",
        code='''
import torch


def apply_rotary_emb_neox(x, cos, sin):
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1)
''',
        expect={"mode": "half", "targets": ["x"]},
        run='''
ang = torch.arange(7).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
x = torch.randn(7, 4, 16, requires_grad=True)
out = apply_rotary_emb_neox(x, ang.cos(), ang.sin())
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the flag is computed from x inside the helper: the call site cannot read it before the call
        _FLAGGED_ROTATE.replace("        if self.interleaved:\n", "        if x.shape[-1] > 64:\n"),
        reason="a value the call site cannot read",
        name="helper_two_return_paths_flag_from_x",
    ),
    Keep(
        # neither return path is a rotation
        _FLAGGED_ROTATE.replace("return torch.cat((-second_half, first_half), dim=-1)", "return torch.cat((second_half, first_half), dim=-1)"),
        reason="on either return path",
        name="helper_two_return_paths_none_verified",
    ),
]

# the per-pair 2x2 rotation-matrix form (flux, lingua) and the complex form viewed back (nanotron)
_MATRIX_SUM_OF_LANES = '''
import torch


def rotation_matrices(pos, dim, theta=10000):
    scale = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    omega = 1.0 / (theta ** scale)
    out = torch.einsum("...n,d->...nd", pos.double(), omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    return out.view(*out.shape[:-1], 2, 2).float()


def apply_rope(xq, xk, freqs_cis):
    xq_ = xq.float().reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = xk.float().reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)
'''

_MATRIX_SUMMED = '''
import torch


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    cos, sin = freqs.cos(), freqs.sin()
    return torch.stack((cos, -sin, sin, cos), dim=-1).view(*freqs.size(), 2, 2)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = xq.reshape(*xq.shape[:-1], -1, 1, 2)  # B S H D -> B S H D/2 1 2
    xk_ = xk.reshape(*xk.shape[:-1], -1, 1, 2)
    freqs_cis = freqs_cis[None, :, None].float()  # S D/2 2 2 -> 1 S 1 D/2 2 2
    xq_out = (xq_ * freqs_cis).sum(5).flatten(3)
    xk_out = (xk_ * freqs_cis).sum(5).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)
'''

RopePattern.FUSE += [
    Fuse(
        # flux: column k of the per-pair matrix times lane k of x, summed by hand; [B, 1, L, D/2, 2, 2] tables
        # (batch-independent here: B = 1 for the table) in the interleave mode, checked at run time
        name="flux_rotation_matrix_lanes",
        code=_MATRIX_SUM_OF_LANES,
        expect={"mode": "interleave", "variant": "rotation_matrix_pairs", "qualname": "apply_rope", "line": 16, "end_line": 17},
        run='''
pe = rotation_matrices(torch.arange(6).float()[None], 16)[:, None]  # [1, 1, L, D/2, 2, 2]
xq = torch.randn(2, 4, 6, 16, dtype=torch.bfloat16, requires_grad=True)
xk = torch.randn(2, 4, 6, 16, dtype=torch.bfloat16, requires_grad=True)
pe_batched = rotation_matrices(torch.arange(12).float().view(2, 6), 16)[:, None]  # per-batch positions: original code
wide = torch.randn(250, 4, 6, 16, requires_grad=True)  # s34: B*N = 1000, over the interleave limit: original code
out = (apply_rope(xq, xk, pe), apply_rope(xq, xk, pe_batched), apply_rope(wide, wide, pe))
leaves = [xq, xk, wide]
''',
    ),
    Fuse(
        # lingua: (pairs * matrix).sum(5) over the 6-D product; bf16 x meets fp32 matrix (the product promotes)
        name="lingua_rotation_matrix_summed",
        code=_MATRIX_SUMMED,
        expect={"mode": "interleave", "qualname": "apply_rotary_emb", "line": 17, "end_line": 18},
        run='''
xq = torch.randn(2, 6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
xk = torch.randn(2, 6, 2, 16, dtype=torch.bfloat16, requires_grad=True)
out = apply_rotary_emb(xq, xk, precompute_freqs_cis(16, 6))
leaves = [xq, xk]
''',
    ),
]

# the matrix form on packed tokens [T, N, D] (one sequence per call, a per-token [T, 1, D/2, 2, 2] matrix built by a
# module's forward), the pairs view cast after the reshape, the sum over the last dim
_MATRIX_TOKENS = '''
import torch
from torch import nn


class AxisRope(nn.Module):
    def __init__(self, dim, max_pos=64, theta=10000.0):
        super().__init__()
        freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        self.register_buffer("angles", torch.outer(torch.arange(max_pos, dtype=freq.dtype), freq).float(), persistent=False)

    def forward(self, pos):
        a = self.angles[pos]
        c, s = torch.cos(a), torch.sin(a)
        m = torch.stack([c, -s, s, c], dim=-1)
        return m.view(*m.shape[:-1], 2, 2).unsqueeze(-4)


def rotate_tokens(x, rope):
    pairs = x.reshape(*x.shape[:-1], -1, 1, 2).to(torch.float32)
    out = (rope * pairs).sum(dim=-1)
    return out.reshape(*x.shape).to(torch.bfloat16)
'''

RopePattern.FUSE += [
    Fuse(
        # [T, N, D] tokens are one batch of T: x[None] with the [1, T, 1, D] tables (1S1D), the leading 1 dropped after;
        # the product runs in fp32 (the cast of the pairs view), bf16 x
        name="rotation_matrix_packed_tokens_cast_pairs",
        code=_MATRIX_TOKENS,
        expect={"mode": "interleave", "variant": "rotation_matrix_pairs", "qualname": "rotate_tokens"},
        run='''
rope = AxisRope(16)(torch.arange(6))
x = torch.randn(6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
x4 = torch.randn(2, 6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
out = (rotate_tokens(x, rope), rotate_tokens(x4, rope[None]))
leaves = [x, x4]
''',
    ),
]

RopePattern.KEEP += [
    # the pairs view cast to another tensor's dtype: the product's dtype is not known from the text
    Keep(_MATRIX_TOKENS.replace(".to(torch.float32)", ".type_as(rope)"), reason="whose dtype is not read here",
         name="rotation_matrix_pairs_cast_type_as"),
]

RopePattern.KEEP += [
    Keep(
        # the matrix built transposed ([[cos, sin], [-sin, cos]]): a rotation the other way, not proven here
        _MATRIX_SUMMED.replace("torch.stack((cos, -sin, sin, cos), dim=-1)", "torch.stack((cos, sin, -sin, cos), dim=-1)"),
        reason="not known to be a rotation",
        name="rotation_matrix_transposed",
    ),
]

_NANOTRON_COMPLEX = '''
import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, end: int, theta: float = 10000.0):
        super().__init__()
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float)[: (dim // 2)] / dim))
        freqs = torch.outer(torch.arange(end), freqs).float()
        self.register_buffer("freqs_cis", torch.view_as_real(torch.polar(torch.ones_like(freqs), freqs)), persistent=False)

    def forward(self, x, position_ids=None):
        batch_size, seq_length, num_heads, inner_dim = x.shape
        dtype = x.dtype
        x = x.view(batch_size, seq_length, num_heads, inner_dim // 2, 2)
        if x.dtype == torch.bfloat16:
            x = x.float()
        complex_x = torch.view_as_complex(x)
        if position_ids is None:
            freqs_cis = self.freqs_cis[None, :seq_length, None, :]
        else:
            freqs_cis = self.freqs_cis[position_ids][:, :, None, :]
        complex_freqs = torch.view_as_complex(freqs_cis)
        x_out = torch.view_as_real(complex_x * complex_freqs).view(batch_size, seq_length, num_heads, inner_dim)
        return x_out.type(dtype)
'''

RopePattern.FUSE += [
    Fuse(
        # nanotron: the RotaryEmbedding module computes freqs AND applies them; x upcast only when bf16, the
        # result viewed back with .view(b, s, h, d) (kept on the fused result); per-batch positions run the original
        name="nanotron_complex_in_forward_viewed_back",
        code=_NANOTRON_COMPLEX,
        expect={"mode": "complex", "variant": "complex_freqs_cis_checked", "qualname": "RotaryEmbedding.forward", "line": 25, "end_line": 25},
        run='''
rope = RotaryEmbedding(16, 32)
x = torch.randn(2, 6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
y = torch.randn(2, 6, 4, 16, requires_grad=True)
pos = torch.arange(12).view(2, 6)
out = (rope(x), rope(y), rope(y, position_ids=pos))
leaves = [x, y]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # x rebound on another path to something that is not its lane pairs: the pairs cannot be proven
        _NANOTRON_COMPLEX.replace("            x = x.float()\n", "            x = x.float()\n        else:\n            x = x.transpose(1, 2)\n"),
        reason="rebound on several paths",
        name="complex_pairs_rebound_on_another_path",
    ),
]

# vLLM / sglang: the halves cut under the style flag, the rotation written once, the result picked by the same flag
_VLLM_APPLY = '''
import torch


def _apply_rotary_emb(x, cos, sin, is_neox_style: bool):
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    else:
        return torch.stack((o1, o2), dim=-1).flatten(-2)


def forward_native(positions, query, cos_sin_cache, head_size, rotary_dim, is_neox_style=True):
    num_tokens = positions.shape[0]
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    query_shape = query.shape
    query = query.view(num_tokens, -1, head_size)
    query_rot = query[..., :rotary_dim]
    query_pass = query[..., rotary_dim:]
    query_rot = _apply_rotary_emb(query_rot, cos, sin, is_neox_style)
    return torch.cat((query_rot, query_pass), dim=-1).reshape(query_shape)


def cos_sin_cache(max_pos, rotary_dim):
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
'''

RopePattern.FUSE += [
    Fuse(
        # [T, N*D] tokens viewed [T, N, D], partial rotary, [T, D/2] tables: the neox path fused (lifted to 4-D),
        # the GPT-J path (interleaved stack, cos/sin layout not provable) keeps the original code
        name="vllm_halves_cut_under_style_flag",
        code=_VLLM_APPLY,
        expect={"mode": "half", "targets": ["x"], "qualname": "_apply_rotary_emb", "line": 13, "end_line": 18},
        run='''
cache = cos_sin_cache(32, 16)
positions = torch.tensor([3, 0, 7, 1, 2])
q = torch.randn(5, 4 * 24, requires_grad=True)
out = (forward_native(positions, q, cache, 24, 16, True), forward_native(positions, q, cache, 24, 16, False))
leaves = [q]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the halves are cut under one flag and the result picked by another: the halves on the cat path are unknown
        _VLLM_APPLY.replace("    if is_neox_style:\n        return torch.cat", "    if cat_halves:\n        return torch.cat")
        .replace("is_neox_style: bool)", "is_neox_style: bool, cat_halves: bool = True)"),
        name="vllm_halves_cut_under_another_flag",
    ),
]

# halves / lane pairs cut by viewing the last dim as two axes and unbinding one (canonical.lane_of)
_EINOPS_PAIRS = '''
import torch
from einops import rearrange


def rotate_half(x):
    x = rearrange(x, "... (d r) -> ... d r", r=2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return rearrange(x, "... d r -> ... (d r)")


def apply_rotary_emb(freqs, t):
    cos = freqs.cos()[None, None]
    sin = freqs.sin()[None, None]
    return t * cos + rotate_half(t) * sin
'''

RopePattern.FUSE += [
    Fuse(
        # rotary-embedding-torch (lucidrains): the interleaved rotation through einops, the view bound to x first
        name="einops_pairs_rotate_rebound",
        code=_EINOPS_PAIRS,
        # einops is not a dependency: tests/test_detect_rope.py runs this one under a minimal stand-in
        expect={"mode": "interleave", "targets": ["t"]},
    ),
    Fuse(
        # NeoX written out on halves cut by unflatten(-1, (2, -1)).unbind(-2)
        name="neox_written_out_unflatten_unbind",
        code='''
import torch


def apply_rotary(x, cos, sin):
    x1, x2 = x.unflatten(-1, (2, -1)).unbind(-2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
''',
        expect={"mode": "half", "targets": ["x"]},
        run='''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
x = torch.randn(2, 6, 4, 16, requires_grad=True)
out = apply_rotary(x, ang.cos()[:, None], ang.sin()[:, None])
leaves = [x]
''',
    ),
    Fuse(
        # GPT-J written out on lane pairs cut by unflatten(-1, (-1, 2)).unbind(-1), batch-free tables
        name="gptj_written_out_pairs_unbind",
        code='''
import torch


def apply_rotary(x, cos, sin):
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
''',
        expect={"mode": "interleave", "targets": ["x"]},
        run='''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
x = torch.randn(2, 6, 4, 16, requires_grad=True)
out = apply_rotary(x, ang.cos(), ang.sin())
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # lane pairs (d r) stacked back as (r d): not the interleaved order, not a rotation npu_rotary_mul computes
        _EINOPS_PAIRS.replace('    x = torch.stack((-x2, x1), dim=-1)\n', '    x = torch.stack((x2, -x1), dim=-1)\n').replace('    cos = freqs.cos()[None, None]\n    sin = freqs.sin()[None, None]\n    return t * cos + rotate_half(t) * sin\n', '    return t * freqs.cos() + rotate_half(t) * freqs.sin()\n'),
        reason="sign flipped",
        name="einops_pairs_sign_flipped",
    ),
]

# gemma: complex numbers made of the two halves (rotate_half semantics in the complex form)
_COMPLEX_HALVES = '''
import torch


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs = torch.outer(torch.arange(end), freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    x_ = torch.view_as_complex(torch.stack(torch.chunk(x.transpose(1, 2).float(), 2, dim=-1), dim=-1))
    x_out = torch.view_as_real(x_ * freqs_cis).type_as(x)
    x_out = torch.cat(torch.chunk(x_out, 2, dim=-1), dim=-2)
    x_out = x_out.reshape(x_out.shape[0], x_out.shape[1], x_out.shape[2], -1).transpose(1, 2)
    return x_out
'''

RopePattern.FUSE += [
    Fuse(
        # [B, S, N, D] x transposed to [B, N, S, D], halves paired as complex numbers, [S, D/2] freqs (11SD once lifted)
        name="gemma_complex_of_halves",
        code=_COMPLEX_HALVES,
        expect={"mode": "half", "targets": ["x.transpose(1, 2).float()"], "line": 12, "end_line": 13},
        run='''
x = torch.randn(2, 6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
out = apply_rotary_emb(x, precompute_freqs_cis(16, 6))
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # chunked along dim 1, not the last dim: not the halves of the head dim
        _COMPLEX_HALVES.replace("torch.chunk(x.transpose(1, 2).float(), 2, dim=-1)", "torch.chunk(x.transpose(1, 2).float(), 2, dim=1)"),
        name="complex_of_chunks_along_another_dim",
    ),
]

RopePattern.FUSE += [
    Fuse(
        # rotary-embedding-torch: a scale factor on both products, the rotated middle slice cat between the rest
        name="scaled_products_middle_slice",
        code='''
import torch


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(freqs, t, start_index=0, scale=1.0):
    rot_dim = freqs.shape[-1]
    end_index = start_index + rot_dim
    t_left = t[..., :start_index]
    t_middle = t[..., start_index:end_index]
    t_right = t[..., end_index:]
    t_transformed = (t_middle * freqs.cos() * scale) + (rotate_half(t_middle) * freqs.sin() * scale)
    return torch.cat((t_left, t_transformed, t_right), dim=-1)
''',
        expect={"mode": "half", "targets": ["t_middle"], "line": 16, "end_line": 16},
        run='''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
freqs = torch.cat((ang, ang), dim=-1)
t = torch.randn(2, 4, 6, 24, requires_grad=True)
out = (apply_rotary_emb(freqs, t, start_index=4, scale=0.5), apply_rotary_emb(freqs, t))
leaves = [t]
''',
    ),
]

RopePattern.FUSE += [
    Fuse(
        # the complex product asked for in float64: the op takes fp16/bf16/fp32 only, so it rotates in fp32 where
        # the tensor before the upcast is fp16/bf16/fp32 (s28: a numerics risk); a float64 input keeps the original
        _MISTRAL_TOKENS.replace("xq.float().reshape", "xq.to(torch.float64).reshape").replace("xk.float().reshape", "xk.double().reshape"),
        name="complex_in_float64",
        expect={"mode": "complex", "qualname": "apply_rotary_emb"},
        run='''
xq = torch.randn(2, 7, 4, 16, dtype=torch.bfloat16, requires_grad=True)
xk = torch.randn(2, 7, 2, 16, dtype=torch.bfloat16, requires_grad=True)
f = precompute_freqs_cis(16, 7, 10000.0)
out = (apply_rotary_emb(xq, xk, f), apply_rotary_emb(xq.double(), xk.double(), f))  # a float64 model: the original runs
leaves = [xq, xk]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the tensor before the float64 upcast is a call's result: it cannot be read again for the run-time dtype test
        _MISTRAL_TOKENS.replace("xq.float().reshape", "torch.tanh(xq).double().reshape").replace("xk.float().reshape", "torch.tanh(xk).double().reshape"),
        reason="cannot be read again at the site",
        name="complex_in_float64_of_a_call",
    ),
]

RopePattern.FUSE += [
    Fuse(
        # the rotation written twice in one function with the names o1/o2 reused for the key: both sites found
        # (the query's o1/o2 are bound again before the key reads them)
        name="vllm_query_and_key_reuse_names",
        code=_VLLM_APPLY.replace('''    query_rot = _apply_rotary_emb(query_rot, cos, sin, is_neox_style)
''', '''    if is_neox_style:
        x1, x2 = torch.chunk(query_rot, 2, dim=-1)
    else:
        x1 = query_rot[..., ::2]
        x2 = query_rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        query_rot = torch.cat((o1, o2), dim=-1)
    else:
        query_rot = torch.stack((o1, o2), dim=-1).flatten(-2)
    key_rot = query_rot.flip(-1)
    if is_neox_style:
        x1, x2 = torch.chunk(key_rot, 2, dim=-1)
    else:
        x1 = key_rot[..., ::2]
        x2 = key_rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        key_rot = torch.cat((o1, o2), dim=-1)
    else:
        key_rot = torch.stack((o1, o2), dim=-1).flatten(-2)
    query_rot = query_rot + key_rot
''').replace("    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)\n",
             "    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)\n    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)\n"),
        expect={"mode": "half"},
        run='''
cache = cos_sin_cache(32, 16)
positions = torch.tensor([3, 0, 7, 1, 2])
q = torch.randn(5, 4 * 24, requires_grad=True)
out = (forward_native(positions, q, cache, 24, 16, True), forward_native(positions, q, cache, 24, 16, False))
leaves = [q]
''',
    ),
]

RopePattern.FUSE += [
    Fuse(
        # pairs by unflatten(-1, (-1, 2)); the table's view depends on x's rank (3-D tokens or 4-D): the layout is
        # not claimed from the last binding, the run-time shape check decides (3-D tokens seen as one batch)
        name="complex_unflatten_pairs_view_by_rank",
        code='''
import torch


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs = torch.outer(torch.arange(end), freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(x, freqs_cis, inverse: bool = False):
    original_dtype = x.dtype
    x_complex = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    if inverse:
        freqs_cis = freqs_cis.conj()
    if x_complex.ndim == 3:
        freqs_cis = freqs_cis.view(x_complex.size(0), 1, x_complex.size(-1))
    else:
        freqs_cis = freqs_cis.view(1, x_complex.size(1), 1, x_complex.size(-1))
    x_rotated = torch.view_as_real(x_complex * freqs_cis).flatten(-2)
    return x_rotated.to(original_dtype)
''',
        expect={"mode": "complex", "variant": "complex_freqs_cis_checked"},
        run='''
f = precompute_freqs_cis(16, 6)
x4 = torch.randn(2, 6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
x3 = torch.randn(6, 4, 16, requires_grad=True)
out = (apply_rotary_emb(x4, f), apply_rotary_emb(x4, f, inverse=True), apply_rotary_emb(x3, f))
leaves = [x4, x3]
''',
    ),
]

_OLMO_ROTATE = '''
import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        B, nh, T, hs = x.size()
        x = x.view(B, nh, T, 2, hs // 2)
        x1, x2 = x.unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(self, pos_sin: torch.Tensor, pos_cos: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((t * pos_cos) + (self.rotate_half(t) * pos_sin)).to(t.dtype)
'''

RopePattern.FUSE += [
    Fuse(
        # OLMo: the halves by viewing x's own unpacked dims with the last one cut as (2, hs // 2), unbound at -2
        name="olmo_view_unpacked_dims_unbind",
        code=_OLMO_ROTATE,
        expect={"mode": "half", "targets": ["t"], "qualname": "RotaryEmbedding.apply_rotary_pos_emb"},
        run='''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
emb = torch.cat((ang, ang), dim=-1)[None, None]
t = torch.randn(2, 4, 6, 16, dtype=torch.bfloat16, requires_grad=True)
out = RotaryEmbedding().apply_rotary_pos_emb(emb.sin(), emb.cos(), t)
leaves = [t]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the view cuts the last dim as (hs // 2, 2) and unbinds -2: lanes of a pair unbound the wrong way, not halves
        _OLMO_ROTATE.replace("x = x.view(B, nh, T, 2, hs // 2)", "x = x.view(B, nh, T, hs // 2, 2)"),
        reason="does not compute the standard rotate_half",
        name="view_unpacked_dims_wrong_axis",
    ),
]

_UPCAST_PAIRS = '''
import torch


def rotate_half(x):
    x_real, x_imag = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return torch.stack([-x_imag, x_real], dim=-1).flatten(3)


def apply_rotary_emb(xq, cos, sin):
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # [S, D] tables, [B, S, H, D] x
    return (xq * cos + rotate_half(xq) * sin).type_as(xq)


def apply_rotary_emb_fp32(xq, cos, sin):
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return xq * cos + rotate_half(xq) * sin  # bf16 xq and tables, fp32 result
'''

RopePattern.FUSE += [
    Fuse(
        # HunyuanVideo: the interleaved helper upcasts x itself (x.float().reshape(..., -1, 2).unbind(-1)); the eager
        # sum is then fp32 whatever xq's dtype: the fused call computes in the same widened dtype
        name="helper_rotates_in_fp32",
        code=_UPCAST_PAIRS,
        expect={"mode": "interleave", "targets": ["xq"]},
        run='''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
emb = ang.repeat_interleave(2, dim=-1)
xq = torch.randn(2, 6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
out = (apply_rotary_emb(xq, emb.cos().bfloat16(), emb.sin().bfloat16()), apply_rotary_emb_fp32(xq, emb.cos().bfloat16(), emb.sin().bfloat16()))
leaves = [xq]
''',
    ),
]

RopePattern.FUSE += [
    Fuse(
        # a RotaryEmbedding module whose forward computes cos/sin AND applies them (no separate apply function)
        name="module_forward_computes_and_applies",
        code='''
import torch
from torch import nn


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, x, seq_dim=1):
        t = torch.arange(x.shape[seq_dim], device=x.device).type_as(self.inv_freq)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos()[None, :, None, :]
        sin = emb.sin()[None, :, None, :]
        x = (x * cos) + (rotate_half(x) * sin)
        return x
''',
        expect={"mode": "half", "targets": ["x"], "qualname": "RotaryEmbedding.forward"},
        run='''
x = torch.randn(2, 6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
out = RotaryEmbedding(16)(x)
leaves = [x]
''',
    ),
]

_UNPACKED_HALVES = '''
import torch


def apply_rotary_pos_emb(x, cos, sin):
    batch_size, num_head, seq_length, head_dim = x.size()
    x1 = x[..., : head_dim // 2]
    x2 = x[..., head_dim // 2 :]
    rotate_half = torch.cat([-x2, x1], dim=-1)
    x = x * cos + rotate_half * sin
    return x
'''

RopePattern.FUSE += [
    Fuse(
        # picotron: the half point is the last of x's dims unpacked from x.size(); the rotated copy is bound to a
        # name (one that reads like a helper) and x is rebound by the sum
        name="halves_cut_at_unpacked_last_dim",
        code=_UNPACKED_HALVES,
        expect={"mode": "half", "targets": ["x"], "qualname": "apply_rotary_pos_emb"},
        run='''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
emb = ang.repeat(1, 2)
x = torch.randn(2, 4, 6, 16, requires_grad=True)
out = apply_rotary_pos_emb(x, emb.cos(), emb.sin())
leaves = [x]
''',
    ),
    Fuse(
        # hkproj/pytorch-llama: the complex product bound to a name, view_as_real of that name, viewed back by the
        # next statement: the fused result is given the [..., D/2, 2] pairs layout, the product's statement goes
        name="complex_product_named_then_viewed_back",
        code='''
import torch


def precompute(head_dim, seq_len, theta=10000.0):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len).float(), inv)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_embeddings(x, freqs_complex, device):
    x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs_complex = freqs_complex.unsqueeze(0).unsqueeze(2)
    x_rotated = x_complex * freqs_complex
    x_out = torch.view_as_real(x_rotated)
    x_out = x_out.reshape(*x.shape)
    return x_out.type_as(x).to(device)
''',
        expect={"mode": "complex", "variant": "complex_freqs_cis_checked", "qualname": "apply_rotary_embeddings", "line": 14, "end_line": 15},
        run='''
x = torch.randn(2, 6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
out = apply_rotary_embeddings(x, precompute(16, 6), "cpu")
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the cut is at the unpacked SEQUENCE length, not the head dim: no halves of the last dim
        _UNPACKED_HALVES.replace('    x1 = x[..., : head_dim // 2]\n    x2 = x[..., head_dim // 2 :]\n', '    x1 = x[..., : seq_length // 2]\n    x2 = x[..., seq_length // 2 :]\n'),
        reason="",
        name="halves_cut_at_unpacked_other_dim",
    ),
    Keep(
        # the complex numbers pair x_i with x_{i+D/2} through a transpose: not the lane pairs the op rotates
        '''
import torch


def apply(x, freqs):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], 2, -1).transpose(-1, -2).contiguous())
    prod = xc * freqs
    out = torch.view_as_real(prod)
    return out.flatten(3)
''',
        reason="complex rope whose pairs are not formed by reshape(..., -1, 2)",
        name="complex_named_product_other_pairs",
    ),
]

_NESTED_HELPER = '''
import torch


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    def rotate_half(x): return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)
    q_embed = ((q * cos.unsqueeze(unsqueeze_dim)) + (rotate_half(q) * sin.unsqueeze(unsqueeze_dim))).to(q.dtype)
    k_embed = ((k * cos.unsqueeze(unsqueeze_dim)) + (rotate_half(k) * sin.unsqueeze(unsqueeze_dim))).to(k.dtype)
    return q_embed, k_embed
'''

RopePattern.FUSE += [
    Fuse(
        # minimind: the rotation helper is a def nested in the function that calls it (followed like a module one)
        name="nested_rotation_helper",
        code=_NESTED_HELPER,
        expect={"mode": "half", "targets": ["q", "k"], "qualname": "apply_rotary_pos_emb"},
        run='''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
emb = torch.cat((ang, ang), dim=-1)
q = torch.randn(2, 6, 4, 16, requires_grad=True)
k = torch.randn(2, 6, 2, 16, requires_grad=True)
out = apply_rotary_pos_emb(q, k, emb.cos()[None], emb.sin()[None], unsqueeze_dim=2)
leaves = [q, k]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the nested helper swaps the halves without negating one: no rotation (the module-level name is not used)
        _NESTED_HELPER.replace("torch.cat((-x[..., x.shape[-1] // 2:]", "torch.cat((x[..., x.shape[-1] // 2:]"),
        reason="the rotation is not the standard cat(-x2, x1) of the two halves",
        name="nested_helper_without_negation",
    ),
]

_REAL_IMAG_PARTS = '''
import torch


def reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(shape)


def apply_rotary_emb(xq, xk, freqs_cos, freqs_sin):
    xq_r, xq_i = xq.float().reshape(xq.shape[:-1] + (-1, 2)).unbind(-1)
    xk_r, xk_i = xk.float().reshape(xk.shape[:-1] + (-1, 2)).unbind(-1)
    freqs_cos = reshape_for_broadcast(freqs_cos, xq_r)
    freqs_sin = reshape_for_broadcast(freqs_sin, xq_r)
    xq_out_r = xq_r * freqs_cos - xq_i * freqs_sin
    xq_out_i = xq_r * freqs_sin + xq_i * freqs_cos
    xk_out_r = xk_r * freqs_cos - xk_i * freqs_sin
    xk_out_i = xk_r * freqs_sin + xk_i * freqs_cos
    xq_out = torch.stack([xq_out_r, xq_out_i], dim=-1).flatten(3)
    xk_out = torch.stack([xk_out_r, xk_out_i], dim=-1).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def apply_rotary_emb_tables(x, cos, sin):
    # tables of a layout not visible here (the caller's): checked at run time
    x_r, x_i = x.unflatten(-1, (-1, 2)).unbind(-1)
    out_r = x_r * cos - x_i * sin
    out_i = x_r * sin + x_i * cos
    return torch.stack([out_r, out_i], dim=-1).flatten(-2)
'''

RopePattern.FUSE += [
    Fuse(
        # llama2.c: real / imaginary parts of the lane pairs rotated in real arithmetic, stacked back and flattened;
        # q's and k's parts are all computed before the two stacks (one site of six statements)
        name="real_imag_parts_stacked",
        code=_REAL_IMAG_PARTS,
        expect={"mode": "interleave", "targets": ["xq.float()", "xk.float()"], "qualname": "apply_rotary_emb", "line": 16, "end_line": 21},
        run='''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
xq = torch.randn(2, 6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
xk = torch.randn(2, 6, 2, 16, dtype=torch.bfloat16, requires_grad=True)
out = apply_rotary_emb(xq, xk, ang.cos(), ang.sin())
leaves = [xq, xk]
''',
    ),
    Fuse(
        # the same form with tables from the caller: 1S1D tables are fused, per-batch tables run the original
        name="real_imag_parts_tables_checked",
        code=_REAL_IMAG_PARTS,
        expect={"mode": "interleave", "qualname": "apply_rotary_emb"},
        run='''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
x = torch.randn(2, 6, 4, 16, requires_grad=True)
per_batch = torch.stack((ang, ang * 0.5))[:, :, None, :]
out = (apply_rotary_emb_tables(x, ang.cos()[None, :, None], ang.sin()[None, :, None]),
       apply_rotary_emb_tables(x, per_batch.cos(), per_batch.sin()),
       apply_rotary_emb_tables(x, ang.cos()[:, None], ang.sin()[:, None]))
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # both parts take + signs: out_r = r*cos + i*sin with out_i = r*sin + i*cos is no rotation
        _REAL_IMAG_PARTS.replace("xq_out_r = xq_r * freqs_cos - xq_i * freqs_sin", "xq_out_r = xq_r * freqs_cos + xq_i * freqs_sin")
        .replace("xk_out_r = xk_r * freqs_cos - xk_i * freqs_sin", "xk_out_r = xk_r * freqs_cos + xk_i * freqs_sin")
        .replace("out_r = x_r * cos - x_i * sin", "out_r = x_r * cos + x_i * sin"),
        reason="",
        name="real_imag_parts_not_a_rotation",
    ),
    Keep(
        # the parts stacked at dim 3 of 4-D parts: the pair axis lands before D/2 (halves, not lanes), not the op's layout
        _REAL_IMAG_PARTS.replace("torch.stack([xq_out_r, xq_out_i], dim=-1).flatten(3)", "torch.stack([xq_out_r, xq_out_i], dim=3).flatten(3)")
        .replace("torch.stack([xk_out_r, xk_out_i], dim=-1).flatten(3)", "torch.stack([xk_out_r, xk_out_i], dim=3).flatten(3)")
        .replace("torch.stack([out_r, out_i], dim=-1).flatten(-2)", "torch.stack([out_r, out_i], dim=-2).flatten(-2)"),
        reason="",
        name="real_imag_parts_stacked_before_lanes",
    ),
]

_FLAG_VIEWED_TABLES = '''
import torch


def reshape_for_broadcast(freqs_cis, x, head_first=False):
    ndim = x.ndim
    if head_first:
        shape = [d if i == ndim - 2 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    else:
        shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis[0].view(*shape), freqs_cis[1].view(*shape)


def rotate_half(x):
    x_real, x_imag = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return torch.stack([-x_imag, x_real], dim=-1).flatten(3)


def apply_rotary_emb(xq, xk, freqs_cis, head_first=False):
    if isinstance(freqs_cis, tuple):
        cos, sin = reshape_for_broadcast(freqs_cis, xq, head_first)
    else:
        cos, sin = freqs_cis.cos(), freqs_cis.sin()  # per-batch tables given whole
    xq_out = (xq.float() * cos + rotate_half(xq.float()) * sin).type_as(xq)
    xk_out = (xk.float() * cos + rotate_half(xk.float()) * sin).type_as(xk)
    return xq_out, xk_out
'''

RopePattern.FUSE += [
    Fuse(
        # HunyuanVideo: the interleaved helper with tables viewed by a flag (11SD or 1S1D) or given per batch: the
        # layout is checked at run time, interleave mode where batch-independent, the original code elsewhere
        name="interleave_tables_layout_checked",
        code=_FLAG_VIEWED_TABLES,
        expect={"mode": "interleave", "targets": ["xq.float()", "xk.float()"], "variant": "interleave_tables_checked"},
        run='''
ang = (torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))).repeat_interleave(2, dim=-1)
xq = torch.randn(2, 6, 4, 16, dtype=torch.bfloat16, requires_grad=True)
xk = torch.randn(2, 4, 6, 16, dtype=torch.bfloat16, requires_grad=True)
per_batch = torch.stack((ang, ang * 0.5))[:, :, None, :]
out = (apply_rotary_emb(xq, xq, (ang.cos(), ang.sin())),
       apply_rotary_emb(xk, xk, (ang.cos(), ang.sin()), head_first=True),
       apply_rotary_emb(xq, xq, per_batch))
leaves = [xq, xk]
''',
    ),
]

_PER_SAMPLE_AXES = '''
import torch


def rope_params(max_seq_len, dim, theta=10000, dtype=torch.float32):
    freqs = torch.outer(torch.arange(max_seq_len), 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(dtype).div(dim)))
    return torch.polar(torch.ones_like(freqs), freqs)


def rope_apply(x, grid_sizes, freqs):
    n, c = x.size(2), x.size(3) // 2
    freqs = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    output = []
    for i, (f, h, w) in enumerate(grid_sizes.tolist()):
        seq_len = f * h * w
        x_i = torch.view_as_complex(x[i, :seq_len].float().reshape(seq_len, n, -1, 2))
        freqs_i = torch.cat([
            freqs[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
            freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ], dim=-1).reshape(seq_len, 1, -1)
        x_i = torch.view_as_real(x_i * freqs_i).flatten(2)
        x_i = torch.cat([x_i, x[i, seq_len:]])
        output.append(x_i)
    return torch.stack(output).float()
'''

RopePattern.FUSE += [
    Fuse(
        # Wan2.1-style video rope: per-sample [L, N, D] tokens, 3-axis (f, h, w) frequencies concatenated, the pairs
        # view names 4 sizes so flatten(2) merges the pair axis; fused per sample as one batch of L tokens (1S1D);
        # complex128 freqs make the product float64, which the run-time check leaves to the original code
        name="per_sample_axis_freqs_3d_tokens",
        code=_PER_SAMPLE_AXES,
        expect={"mode": "complex", "variant": "complex_freqs_cis_checked", "qualname": "rope_apply"},
        run='''
x = torch.randn(2, 30, 4, 24, requires_grad=True)
grid = torch.tensor([[2, 3, 4], [1, 3, 5]])
out = (rope_apply(x, grid, rope_params(8, 24)), rope_apply(x, grid, rope_params(8, 24, dtype=torch.float64)))
leaves = [x]
''',
    ),
]

RopePattern.FUSE += [
    Fuse(
        # Wan2.1 as written: the tokens are cast to float64 before the complex view; rotated in fp32 where the
        # tokens are fp16/bf16/fp32 (s28: a numerics risk), the float64 result given back
        _PER_SAMPLE_AXES.replace("x[i, :seq_len].float()", "x[i, :seq_len].to(torch.float64)"),
        name="per_sample_axis_freqs_float64",
        expect={"mode": "complex", "variant": "complex_freqs_cis_checked", "qualname": "rope_apply"},
        run='''
x = torch.randn(2, 30, 4, 24, dtype=torch.bfloat16, requires_grad=True)
grid = torch.tensor([[2, 3, 4], [1, 3, 5]])
out = (rope_apply(x, grid, rope_params(8, 24, dtype=torch.float64)), rope_apply(x.double(), grid, rope_params(8, 24, dtype=torch.float64)))
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the tokens' name is rebound between the upcast and the site: the run-time dtype test would read another tensor
        _PER_SAMPLE_AXES.replace("x[i, :seq_len].float()", "x[i, :seq_len].to(torch.float64)")
        .replace("        x_i = torch.view_as_real(x_i * freqs_i).flatten(2)\n",
                 "        x = x * 1\n        x_i = torch.view_as_real(x_i * freqs_i).flatten(2)\n"),
        reason="cannot be read again at the site",
        name="per_sample_axis_freqs_float64_tokens_rebound",
    ),
]

_BARE_TORCH_CAT = '''
import torch
from torch import nn, cat


class NdRotary(nn.Module):
    def __init__(self, heads, n_freqs, dim_pos):
        super().__init__()
        self.register_buffer("freqs", torch.randn(heads, n_freqs, dim_pos))

    def forward(self, input, pos):
        x, y = input.float().chunk(2, dim=-1)
        theta = (self.freqs[None, :, None] * pos.float()[:, None, :, None]).sum(-1)  # per (batch, head, position)
        cos_theta = torch.cos(theta)
        sin_theta = torch.sin(theta)
        x_out = x * cos_theta - y * sin_theta
        y_out = x * sin_theta + y * cos_theta
        output = cat((x_out, y_out), dim=-1)
        return output.type_as(input)
'''

RopePattern.FUSE += [
    Fuse(
        # vit-pytorch GoldenGate N-d rope: ``from torch import cat``; theta per batch, head and position (BNSD half mode)
        name="bare_torch_cat_named_halves",
        code=_BARE_TORCH_CAT,
        expect={"mode": "half", "qualname": "NdRotary.forward"},
        run='''
x = torch.randn(2, 4, 6, 16, dtype=torch.bfloat16, requires_grad=True)
out = NdRotary(4, 8, 3)(x, torch.randn(2, 6, 3))
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # a ``cat`` that is not torch's (a local function of the same name): not assumed to be a concatenation
        _BARE_TORCH_CAT.replace("from torch import nn, cat", "from torch import nn\n\n\ndef cat(ts, dim=-1):\n    return ts[0] + ts[1]"),
        reason="",
        name="bare_cat_not_torch",
    ),
]


_REGROUPED_PAIRS = '''
import torch
from torch import nn


class VisionRotary(nn.Module):
    def __init__(self, seq_len, dim):
        super().__init__()
        self.seq_len = seq_len
        ang = torch.arange(seq_len).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("cache", torch.stack((ang.cos(), ang.sin()), dim=-1))  # [s, D/2, 2]

    def forward(self, x):
        bsz, _, n_h, h_d = x.shape
        xshaped = x.float().reshape(bsz, -1, self.seq_len, n_h, h_d // 2, 2)  # tiles split from the sequence
        rope_cache = self.cache.view(1, 1, self.seq_len, 1, h_d // 2, 2)
        x_out = torch.stack(
            [
                xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
            ],
            -1,
        )
        x_out = x_out.reshape(bsz, -1, n_h, h_d)
        return x_out.type_as(x)
'''

RopePattern.FUSE += [
    Fuse(
        # torchtune VisionRotaryPositionalEmbeddings: x regrouped 6-D [b, tiles, s, n_h, D/2, 2], cache [1, 1, s, 1, D/2, 2]:
        # tiles merged into the batch (the cache is constant over them), interleave mode with 1S1D cos/sin
        name="lane_pairs_regrouped_by_tiles",
        code=_REGROUPED_PAIRS,
        expect={"mode": "interleave", "qualname": "VisionRotary.forward", "variant": "interleaved_pairs_real_cache"},
        run='''
x = torch.randn(2, 12, 4, 16, dtype=torch.bfloat16, requires_grad=True)
out = VisionRotary(6, 16)(x)
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the cut before the pairs is the head count, not the head dim: no lane pairs of x's last dim
        _REGROUPED_PAIRS.replace("xshaped = x.float().reshape(bsz, -1, self.seq_len, n_h, h_d // 2, 2)",
                                 "xshaped = x.float().reshape(bsz, -1, self.seq_len, h_d, n_h // 2, 2)"),
        reason="",
        name="regrouped_view_not_head_dim_pairs",
    ),
]

# --- ropeglu: TorchScript functions rewritten as a whole (issue 14, class 7) -------------------

_SCRIPTED_ROPE = '''
import torch


def swap_halves(t):
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


@torch.jit.script
def rotate_qk(q, k, cos, sin, start: int = 0):
    cos = cos[start : q.shape[0] + start]
    sin = sin[start : q.shape[0] + start]
    return q * cos + swap_halves(q) * sin, k * cos + swap_halves(k) * sin
'''

RopePattern.FUSE += [
    Fuse(
        # a @torch.jit.script rope [S, B, H, D] with offset slicing of the cache: the scripted original
        # stays compiled (renamed) as the fallback, a Python wrapper of the same name runs the fused op
        name="torchscript_function_lifted",
        code=_SCRIPTED_ROPE,
        expect={"mode": "half", "qualname": "<module>", "lifted_from": "rotate_qk"},
        run='''
q = torch.randn(5, 2, 3, 8, requires_grad=True)
k = torch.randn(5, 2, 3, 8, requires_grad=True)
cos, sin = torch.randn(9, 1, 1, 8), torch.randn(9, 1, 1, 8)
out = rotate_qk(q, k, cos, sin, 3)
leaves = [q, k]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # another scripted function calls it: that caller would compile the Python wrapper
        _SCRIPTED_ROPE + '''

@torch.jit.script
def attend(q, k, cos, sin):
    q, k = rotate_qk(q, k, cos, sin)
    return q @ k.transpose(-1, -2)
''',
        reason="compiled code (`attend`) calls it",
        name="torchscript_function_called_from_scripted_code",
    ),
    Keep(
        # the rotated tensor is made inside the scripted function: no parameter to test the device of
        # before the scripted original is chosen
        _SCRIPTED_ROPE.replace("def rotate_qk(q, k, cos, sin, start: int = 0):\n",
                               "def rotate_qk(q, k, cos, sin, start: int = 0):\n    q = q.float()\n"),
        reason="is not a parameter left unchanged",
        name="torchscript_guard_tensor_made_inside",
    ),
]


# --- ropeglu: a helper whose return path a parameter picks (issue 14, class 2) -------------------

_FLAG_PARAM_HELPER = '''
import torch


def _swap(x, interleaved: bool):
    if not interleaved:
        a, b = torch.chunk(x, 2, dim=-1)
        return torch.cat((-b, a), dim=-1)
    else:
        ev = x[..., ::2]
        od = x[..., 1::2]
        return torch.stack((-od, ev), dim=-1).flatten(-2)


def rotate_sbhd(t, freqs, interleaved: bool = False, mscale: float = 1.0):
    rot = freqs.shape[-1]
    t, t_pass = t[..., :rot], t[..., rot:]
    cos_ = (torch.cos(freqs) * mscale).to(t.dtype)
    sin_ = (torch.sin(freqs) * mscale).to(t.dtype)
    t = (t * cos_) + (_swap(t, interleaved) * sin_)
    return torch.cat((t, t_pass), dim=-1)
'''

RopePattern.FUSE += [
    Fuse(
        # Megatron-style: the rotate helper's path picked by a parameter the call site passes on, cos/sin
        # computed from freqs with a scale, partial rotary with the pass-through concatenated back, [S, B, H, D]
        name="helper_path_picked_by_a_parameter",
        code=_FLAG_PARAM_HELPER,
        expect={"mode": "half", "variant": "rotate_half_chosen_at_run_time"},
        run='''
t = torch.randn(5, 2, 3, 12, requires_grad=True)
freqs = torch.randn(5, 1, 1, 8)
out = (rotate_sbhd(t, freqs, mscale=0.5), rotate_sbhd(t, freqs, True))
leaves = [t]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the extra parameter also shapes the result (the cat dim): the helper is not a rotation by x alone
        _FLAG_PARAM_HELPER.replace("def _swap(x, interleaved: bool):", "def _swap(x, interleaved: bool, dim: int = -1):")
                          .replace("return torch.cat((-b, a), dim=-1)", "return torch.cat((-b, a), dim=dim)")
                          .replace("_swap(t, interleaved)", "_swap(t, interleaved, -1)"),
        reason="takes arguments besides the rotated tensor that its return paths use",
        name="helper_extra_parameter_used_by_the_rotation",
    ),
    Keep(
        # the flag reaches the helper as a call: evaluated again by the guard, it could differ
        _FLAG_PARAM_HELPER.replace("_swap(t, interleaved)", "_swap(t, bool(interleaved))"),
        reason="",
        name="helper_flag_argument_is_a_call",
    ),
]


# --- ropeglu: the rotation written as a lambda mapped over q and k (issue 14, class 2) -----------

_LAMBDA_ROPE = '''
import torch


def rotate_pairs(x):
    x = x.unflatten(-1, (-1, 2))
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotate_tokens(q, k, pos):
    sin, cos = pos
    rot = sin.shape[-1]
    (q_cls, q), (k_cls, k) = map(lambda t: (t[:, :1], t[:, 1:]), (q, k))
    (q, q_pass), (k, k_pass) = map(lambda t: (t[..., :rot], t[..., rot:]), (q, k))
    q, k = map(lambda t: (t * cos) + (rotate_pairs(t) * sin), (q, k))
    q, k = map(lambda t: torch.cat(t, dim=-1), ((q, q_pass), (k, k_pass)))
    return torch.cat((q_cls, q), dim=1), torch.cat((k_cls, k), dim=1)
'''

RopePattern.FUSE += [
    Fuse(
        # vit-pytorch rvt-style: [(b h), n, d] tokens (3-D), partial rotary, the class token left out, the
        # rotation in a lambda mapped over (q, k): the lambda becomes a local function with the fused call
        name="rotation_in_a_mapped_lambda",
        code=_LAMBDA_ROPE,
        expect={"mode": "interleave", "lambda": "lambda t: (t * cos) + (rotate_pairs(t) * sin)"},
        run='''
q = torch.randn(6, 5, 12, requires_grad=True)
k = torch.randn(6, 5, 12, requires_grad=True)
ang = torch.randn(1, 4, 4).repeat_interleave(2, dim=-1)
out = rotate_tokens(q, k, (ang.sin(), ang.cos()))
leaves = [q, k]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the lambda is bound to a name and called later: no tensor to guard the statement on
        _LAMBDA_ROPE.replace("    q, k = map(lambda t: (t * cos) + (rotate_pairs(t) * sin), (q, k))\n",
                             "    rope = lambda t: (t * cos) + (rotate_pairs(t) * sin)\n    q, k = rope(q), rope(k)\n"),
        reason="only where the lambda is mapped over a tuple or list of named tensors",
        name="rotation_lambda_bound_to_a_name",
    ),
    Keep(
        # the lambda's parameter shadows a local of the function (whose binding the matcher would read)
        _LAMBDA_ROPE.replace("    rot = sin.shape[-1]\n", "    rot = sin.shape[-1]\n    t = q.float()\n"),
        reason="only where the lambda's parameter is not also a name of the enclosing function",
        name="rotation_lambda_parameter_shadows_a_local",
    ),
    Keep(
        # the lambda rotates a tensor it closes over, not its parameter
        _LAMBDA_ROPE.replace("lambda t: (t * cos) + (rotate_pairs(t) * sin)", "lambda t: (q * cos) + (rotate_pairs(q) * sin) + t"),
        reason="only where the rotated tensor is the lambda's parameter",
        name="rotation_lambda_of_a_closed_over_tensor",
    ),
]

RopePattern.FUSE += [
    Fuse(
        # vit-pytorch rvt: the rotation is a lambda body mapped over (q, k) (was a near miss: now a local function)
        name="rotation_in_a_lambda",
        code='''
import torch
from torch import nn


def rotate_every_two(x):
    x = x.unflatten(-1, (-1, 2))
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class Attention(nn.Module):
    def forward(self, q, k, pos_emb):
        sin, cos = pos_emb
        q, k = map(lambda t: (t * cos) + (rotate_every_two(t) * sin), (q, k))
        return q, k
''',
        expect={"mode": "interleave"},
        run='''
q = torch.randn(2, 3, 5, 8, requires_grad=True)
k = torch.randn(2, 3, 5, 8, requires_grad=True)
ang = torch.randn(1, 1, 5, 4).repeat_interleave(2, dim=-1)
out = Attention()(q, k, (ang.sin(), ang.cos()))
leaves = [q, k]
''',
    ),
]


# --- ropeglu: the rotation written in a comprehension over q and k -------------------------------

_COMPREHENSION_ROPE = '''
import torch


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_both(q, k, cos, sin):
    q, k = [t * cos + rotate_half(t) * sin for t in (q, k)]
    return q, k
'''

RopePattern.FUSE += [
    Fuse(
        # the comprehension's variable is not live at the statement (the guard tested it before: a NameError,
        # or another tensor of that name): the element becomes a local function, guarded on q
        name="rotation_in_a_comprehension",
        code=_COMPREHENSION_ROPE,
        expect={"mode": "half", "comprehension": "[t * cos + rotate_half(t) * sin for t in (q, k)]"},
        run='''
q = torch.randn(2, 4, 6, 16, requires_grad=True)
k = torch.randn(2, 4, 6, 16, requires_grad=True)
cos, sin = torch.randn(6, 16), torch.randn(6, 16)
out = rotate_both(q, k, cos, sin)
leaves = [q, k]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # two loops: which variable is the parameter of a local function is not one name
        _COMPREHENSION_ROPE.replace("q, k = [t * cos + rotate_half(t) * sin for t in (q, k)]",
                                    "q, k = [t * cos + rotate_half(t) * sin for pair in ((q, k),) for t in pair]"),
        reason="only where the comprehension has a single `for <name> in ...`",
        name="rotation_in_a_comprehension_of_two_loops",
    ),
]

# a complex multiplier that is no unit rotation (a blend ``rot * scale + (1 - scale)``, audiocraft-like)
# and a result viewed back as the input's shape with ``.view_as(x)``; x cast to a dtype chosen at
# construction (float64 allowed there: checked at run time, the original code runs for it)
_COMPLEX_VIEW_AS = '''
import torch
import torch.nn as nn


class Rotation(nn.Module):
    def __init__(self, dim, scale=1.0, dtype=torch.float32):
        super().__init__()
        self.scale = scale
        self.dtype = dtype
        self.register_buffer("inv", 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=dtype) / dim)))

    def table(self, start, end):
        ang = torch.outer(torch.arange(end, dtype=self.dtype), self.inv)
        return torch.polar(torch.ones_like(ang), ang)[start:end]

    def rotate(self, x, start: int = 0, time_dim: int = 1):
        n = x.shape[time_dim]
        shape = [1] * x.dim()
        shape[time_dim] = n
        shape[-1] = -1
        rot = self.table(start, start + n).view(shape)
        xc = torch.view_as_complex(x.to(self.dtype).reshape(*x.shape[:-1], -1, 2))
        blended = rot * self.scale + (1.0 - self.scale)
        out = torch.view_as_real(xc * blended).view_as(x)
        return out.type_as(x)
'''

RopePattern.FUSE += [
    Fuse(
        name="complex_blend_view_as",
        code=_COMPLEX_VIEW_AS,
        expect={"mode": "complex", "freqs": "blended", "line": 25},
        run='''
x = torch.randn(2, 6, 3, 16, requires_grad=True)
m32 = Rotation(16, scale=0.75)
m64 = Rotation(16, scale=0.5, dtype=torch.float64)
out = (m32.rotate(x), m32.rotate(x, start=2), m64.rotate(x), m32.rotate(x.transpose(1, 2), time_dim=2))
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # pairs (x_i, x_{i+D/2}) made by a transpose: not the lane pairs the complex form reads
        _COMPLEX_VIEW_AS.replace("x.to(self.dtype).reshape(*x.shape[:-1], -1, 2)",
                                 "x.to(self.dtype).reshape(*x.shape[:-1], 2, -1).transpose(-1, -2).contiguous()"),
        reason="pairs are not formed by reshape(..., -1, 2) on the last dim",
        name="complex_blend_pairs_of_halves",
    ),
]

# the comprehension runs over a list passed in (``[... for t in xs]``): no named element to test the
# device on, so the guard tests the cos table (every element is multiplied by it: same device)
_COMPREHENSION_OVER_LIST = '''
import torch


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_all(xs, sin, cos):
    if isinstance(xs, torch.Tensor):
        xs = [xs]
    return [t * cos + rotate_half(t) * sin for t in xs]
'''

RopePattern.FUSE += [
    Fuse(
        name="rotation_in_a_comprehension_over_a_list",
        code=_COMPREHENSION_OVER_LIST,
        expect={"mode": "half", "comprehension": "[t * cos + rotate_half(t) * sin for t in xs]"},
        run='''
q = torch.randn(2, 4, 6, 16, requires_grad=True)
k = torch.randn(2, 6, 16, requires_grad=True)
cos, sin = torch.randn(6, 16), torch.randn(6, 16)
out = (rotate_all([q, k], sin, cos), rotate_all(q, sin, cos), rotate_all([], sin, cos))
leaves = [q, k]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the table is an expression (a slice per call): no plain name to test the device on before the statement
        _COMPREHENSION_OVER_LIST.replace("t * cos + rotate_half(t) * sin for t in xs", "t * cos[: t.shape[-2]] + rotate_half(t) * sin[: t.shape[-2]] for t in xs"),
        reason="or its cos table is a plain name of the enclosing code",
        name="rotation_in_a_comprehension_over_a_list_table_expression",
    ),
]

# ``view_as_real(xc * freqs).flatten(2)`` on [b, s, n, d/2, 2] pairs: the lanes and then the heads merged
# (the token layout [b, s, n*d] back, Wan-like); in float64 it is rotated in fp32 (s28, a numerics risk)
_COMPLEX_FLATTEN_HEADS = '''
import torch


def rope_tokens(x, freqs, head_dim):
    b, s = x.shape[0], x.shape[1]
    x = x.view(b, s, -1, head_dim)
    x_out = torch.view_as_complex(x.float().reshape(x.shape[0], x.shape[1], x.shape[2], -1, 2))
    x_out = torch.view_as_real(x_out * freqs).flatten(2)
    return x_out.to(x.dtype)
'''

RopePattern.FUSE += [
    Fuse(
        name="complex_flatten_heads_too",
        code=_COMPLEX_FLATTEN_HEADS,
        expect={"mode": "complex", "freqs": "freqs", "line": 9},
        run='''
ang = torch.outer(torch.arange(6).float(), 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
freqs = torch.polar(torch.ones_like(ang), ang)[None, :, None, :]
x = torch.randn(2, 6, 3 * 8, requires_grad=True)
out = rope_tokens(x, freqs, 8)
leaves = [x]
''',
    ),
]

RopePattern.FUSE += [
    Fuse(
        _COMPLEX_FLATTEN_HEADS.replace("x.float().reshape", "x.to(torch.float64).reshape"),
        name="complex_flatten_heads_too_float64",
        expect={"mode": "complex", "freqs": "freqs", "line": 9},
        run='''
ang = torch.outer(torch.arange(6).double(), 1.0 / 10000 ** (torch.arange(0, 8, 2).double() / 8))
freqs = torch.polar(torch.ones_like(ang), ang)[None, :, None, :]
x = torch.randn(2, 6, 3 * 8, dtype=torch.bfloat16, requires_grad=True)
out = rope_tokens(x, freqs, 8)
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # flatten(4) of the 5-D real view keeps every axis: no lane merge, not the rotation's output
        _COMPLEX_FLATTEN_HEADS.replace(".flatten(2)", ".flatten(4)"),
        name="complex_flatten_past_the_pairs",
    ),
]

# the rotation helper chosen by if/else statements, each helper filling a new tensor by slice
# assignment (halves: rotate_half; even/odd lanes: the interleaved rotation), lmdeploy-like
_FILLED_HELPERS = '''
import torch


def rotate_half(x):
    h = x.shape[-1] // 2
    x1 = x[..., :h]
    x2 = x[..., h:]
    out = torch.empty_like(x)
    out[..., :h] = -x2
    out[..., h:] = x1
    return out


def rotate_pairs(x):
    even = x[..., 0::2]
    odd = x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = -odd
    out[..., 1::2] = even
    return out


def apply(q, k, cos, sin, pairs: bool = False):
    if pairs:
        rotate_fn = rotate_pairs
    else:
        rotate_fn = rotate_half
    q_out = (q * cos) + (rotate_fn(q) * sin)
    k_out = (k * cos) + (rotate_fn(k) * sin)
    return q_out, k_out
'''

RopePattern.FUSE += [
    Fuse(
        name="filled_helpers_chosen_by_if_else",
        code=_FILLED_HELPERS,
        expect={"mode": "half", "targets": ["q", "k"]},
        run='''
q = torch.randn(2, 3, 6, 8, requires_grad=True)
k = torch.randn(2, 3, 6, 8, requires_grad=True)
cos, sin = torch.randn(6, 8), torch.randn(6, 8)
out = (apply(q, k, cos, sin), apply(q, k, cos, sin, pairs=True))
leaves = [q, k]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the second slice overlaps the first (h-1:): the filled tensor is no rotation of x
        _FILLED_HELPERS.replace("    out[..., h:] = x1\n", "    out[..., h - 1:] = x[..., h - 1:]\n"),
        reason="does not compute the standard rotate_half",
        name="filled_helper_overlapping_slices",
    ),
]


# -- issue 14, class 2: halves cut at a run-time split point (the cos width, q's half for k, per-axis
# chunks of a multi-dimensional rope): fused where the point is half the last dim, checked at run time

_SPLIT_FROM_TABLE = '''
import torch


def rotate_qk(query, key, cos_sin):
    """cos_sin [S, Rd]: cos in the first half, sin in the second; halves cut at the table's width."""
    rd = cos_sin.size(1)
    cos = cos_sin[None, :, None, : rd // 2]
    sin = cos_sin[None, :, None, rd // 2 :]
    half = rd // 2
    q1, q2 = query[..., :half], query[..., half:]
    k1, k2 = key[..., :half], key[..., half:]
    q_out = torch.cat((q1 * cos - q2 * sin, q1 * sin + q2 * cos), dim=-1)
    k_out = torch.cat((k1 * cos - k2 * sin, k1 * sin + k2 * cos), dim=-1)
    return q_out, k_out
'''

_SPLIT_OF_Q_FOR_K = '''
import torch


def rope_pair(q, k, cos, sin):
    """k cut at q's half point: the same head dim in practice, checked where the code runs."""
    h = q.shape[-1] // 2
    q_a, q_b = q[..., :h], q[..., h:]
    k_a, k_b = k[..., :h], k[..., h:]
    return (torch.cat((q_a * cos - q_b * sin, q_b * cos + q_a * sin), dim=-1),
            torch.cat((k_a * cos - k_b * sin, k_b * cos + k_a * sin), dim=-1))
'''

_AXIAL_CHUNKS = '''
import torch


def axial_rope(query, key, cos_sin, ndim: int = 2):
    """2-D (image) rope: the head dim cut into one chunk per axis, each rotated in halves with its
    own slice of the tables."""
    head_dim = query.shape[-1]
    chunk = head_dim // ndim
    half_chunk = chunk // 2
    d = head_dim // 2
    per_axis = d // ndim
    cos_full = cos_sin[None, :, None, :d]
    sin_full = cos_sin[None, :, None, d:]
    q_parts = []
    k_parts = []
    for i in range(ndim):
        qi = query[..., i * chunk : (i + 1) * chunk]
        ki = key[..., i * chunk : (i + 1) * chunk]
        ci = cos_full[..., i * per_axis : (i + 1) * per_axis]
        si = sin_full[..., i * per_axis : (i + 1) * per_axis]
        q1, q2 = qi[..., :half_chunk], qi[..., half_chunk:]
        k1, k2 = ki[..., :half_chunk], ki[..., half_chunk:]
        q_parts.append(torch.cat([q1 * ci - q2 * si, q2 * ci + q1 * si], dim=-1))
        k_parts.append(torch.cat([k1 * ci - k2 * si, k2 * ci + k1 * si], dim=-1))
    return torch.cat(q_parts, dim=-1), torch.cat(k_parts, dim=-1)
'''

_RUN_SPLIT = '''
cs = torch.randn(7, {rd})
q = torch.randn(2, 7, 4, {rd}, requires_grad=True)
k = torch.randn(2, 7, 2, {rd}, requires_grad=True)
out = {call}
leaves = [q, k]
'''

RopePattern.FUSE += [
    Fuse(
        _SPLIT_FROM_TABLE,
        expect={"variant": "halves_split_checked", "mode": "half", "targets": ["query", "key"], "qualname": "rotate_qk"},
        run=_RUN_SPLIT.format(rd=16, call="rotate_qk(q, k, cs)"),
        name="halves_cut_at_the_table_width",
    ),
    Fuse(
        _SPLIT_OF_Q_FOR_K,
        expect={"variant": "halves_split_checked", "mode": "half", "qualname": "rope_pair"},
        run=("q = torch.randn(2, 4, 5, 16, requires_grad=True)\nk = torch.randn(2, 2, 5, 16, requires_grad=True)\n"
             "cos = torch.randn(5, 8)\nsin = torch.randn(5, 8)\nout = rope_pair(q, k, cos, sin)\nleaves = [q, k]\n"),
        name="k_halves_cut_at_q_half_point",
    ),
    Fuse(
        _AXIAL_CHUNKS,
        expect={"variant": "halves_split_checked", "mode": "half", "qualname": "axial_rope"},
        run=_RUN_SPLIT.format(rd=16, call="axial_rope(q, k, cs)"),
        name="axial_rope_chunk_per_axis",
    ),
]

RopePattern.KEEP += [
    Keep(
        # the interleaved lanes with per-sample (gathered by position ids) tables: interleave mode takes
        # no batch-dependent cos/sin (11SD / 1S1D / S11D only)
        '''
import torch


def rotate_gathered(query, cos_sin, position_ids):
    rd = cos_sin.size(1)
    cos = cos_sin[:, : rd // 2][position_ids]
    sin = cos_sin[:, rd // 2 :][position_ids]
    cos = cos.view(cos.size(0), cos.size(1), 1, -1)
    sin = sin.view(sin.size(0), sin.size(1), 1, -1)
    q1, q2 = query[..., 0::2], query[..., 1::2]
    return torch.stack((q1 * cos - q2 * sin, q1 * sin + q2 * cos), dim=-1).flatten(-2)
''',
        reason="interleave mode with cos/sin that may depend on the batch",
        name="interleaved_lanes_with_gathered_tables",
    ),
]

_FLAG_CHOSEN_SPLIT = '''
import torch


def rotate(query, cos_sin, interleave: bool):
    """Halves or lane pairs chosen by a flag, rotated by one written-out formula, partial rotary
    (the rotated width is the table's): the halves path fused, the pairs path as written."""
    B, S, H, D = query.shape
    rd = cos_sin.size(1)
    q_rot, q_pass = query[..., :rd], query[..., rd:]
    if interleave:
        q1, q2 = q_rot.view(B, S, H, -1, 2).unbind(-1)
    else:
        half = rd // 2
        q1, q2 = q_rot[..., :half], q_rot[..., half:]
    cos = cos_sin[None, :, None, : rd // 2]
    sin = cos_sin[None, :, None, rd // 2 :]
    qr = q1 * cos - q2 * sin
    qi = q1 * sin + q2 * cos
    if interleave:
        q_rotated = torch.stack((qr, qi), dim=-1).flatten(-2)
    else:
        q_rotated = torch.cat((qr, qi), dim=-1)
    return torch.cat((q_rotated, q_pass), dim=-1)
'''

RopePattern.FUSE += [
    Fuse(
        _FLAG_CHOSEN_SPLIT,
        expect={"variant": "halves_split_checked", "mode": "half", "rotary_dim": "rd", "qualname": "rotate"},
        run=("cs = torch.randn(6, 8)\nq = torch.randn(2, 6, 3, 12, requires_grad=True)\n"
             "out = (rotate(q, cs, False), rotate(q, cs, True))\nleaves = [q]\n"),
        name="flag_chosen_halves_at_the_table_width_partial",
    ),
]



# --- named rotated halves cast before the cat (issue 14, held-out 4) -------------------------------
#
# dia: ``y1 = x1*cos - x2*sin; y2 = x2*cos + x1*sin; cat((y1.to(dt), y2.to(dt)), -1)``: the same
# cast on both halves is the cast of the cat (a cast is elementwise), so the site is the named
# pair with the cast applied to the fused result. Different casts on the two halves (or any other
# call) are not a pair of halves of one tensor and are left alone.

_PAIR_CASTS = ("to", "float", "half", "bfloat16", "double", "type", "type_as")


def _cast_of(node: ast.expr) -> tuple[ast.Name, str] | None:
    """(y, ".to(...)") of ``y.to(...)`` / ``y.float()`` / ``y.type_as(t)`` with y a plain name."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _PAIR_CASTS             and isinstance(node.func.value, ast.Name) and not any(isinstance(a, ast.Starred) for a in node.args)             and all(k.arg is not None for k in node.keywords):
        return node.func.value, ast.unparse(node)[len(node.func.value.id):]
    return None


def _uncast_named_pair(pair: tuple[ast.expr, ast.expr]) -> tuple[ast.expr, ast.expr] | None:
    """The two names of ``(y1.<cast>, y2.<cast>)`` when both halves take the same cast."""
    a, b = _cast_of(pair[0]), _cast_of(pair[1])
    if a is None or b is None or a[1] != b[1]:
        return None
    return a[0], b[0]


def _pair_cast_suffix(call: ast.Call) -> str:
    """The common cast of the two halves of a named-pair cat, as a suffix for the fused result ("" if none)."""
    pair = _pair_of(call, _CAT)
    if pair is None or all(isinstance(p, ast.Name) for p in pair):
        return ""
    a = _cast_of(pair[0])
    return a[1] if a is not None and _uncast_named_pair(pair) is not None else ""


_HALVES_CAST_BEFORE_CAT = '''
import torch
import torch.nn as nn


class Rotary(nn.Module):
    def __init__(self, dims: int, max_timescale: float = 10000.0, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.out_dtype = dtype
        fraction = (2.0 * torch.arange(0, dims // 2)) / dims
        self.register_buffer("timescale", max_timescale ** fraction, persistent=False)

    def forward(self, x: torch.Tensor, position: torch.Tensor):
        angle = position.unsqueeze(-1).unsqueeze(-1) / self.timescale
        sin = torch.sin(angle)
        cos = torch.cos(angle)
        x1, x2 = torch.chunk(x.to(torch.float32), 2, dim=-1)
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        return torch.cat((y1.to(self.out_dtype), y2.to(self.out_dtype)), dim=-1)
'''

RopePattern.FUSE += [
    Fuse(
        _HALVES_CAST_BEFORE_CAT,
        expect={"qualname": "Rotary.forward", "line": 18, "end_line": 20},
        # per-batch positions: cos/sin (B, T, 1, D/2), x (B, T, N, D) (half mode takes BS1D)
        run='''
m = Rotary(16)
x = torch.randn(2, 5, 3, 16).bfloat16().requires_grad_()
pos = torch.stack([torch.arange(5), torch.arange(5) + 3]).float()
out = m(x, pos)
leaves = [x]
''',
        name="named_halves_cast_before_the_cat",
    ),
]

RopePattern.KEEP += [
    Keep(
        # two different casts: not one tensor's halves cast together
        _HALVES_CAST_BEFORE_CAT.replace("y2.to(self.out_dtype)", "y2.to(torch.float16)"),
        reason="",
        name="named_halves_cast_differently_before_the_cat",
    ),
]


# --- torch.stack/cat with numpy's ``axis`` keyword (issue 14, held-out 4) -------------------------

_STACK_AXIS_KEYWORD = '''
import torch
import torch.nn as nn


class Rotary(nn.Module):
    def rotate_every_two(self, x):
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
        x = torch.stack((-x2, x1), axis=-1)
        return x.flatten(-2)

    def apply_rotary_pos_emb(self, x, sincos, offset=0):
        sin, cos = map(lambda t: t[None, offset : x.shape[-2] + offset, :].repeat_interleave(2, 2), sincos)
        return (x * cos) + (self.rotate_every_two(x) * sin)
'''

RopePattern.FUSE += [
    Fuse(
        _STACK_AXIS_KEYWORD,
        expect={"qualname": "Rotary.apply_rotary_pos_emb"},
        run='''
s, d = 6, 16
inv = 1.0 / (10000 ** (torch.arange(0, d, 2) / d))
ang = torch.einsum("i , j -> i j", torch.arange(s).float(), inv)
x = torch.randn(2, s, 4, d, requires_grad=True).transpose(1, 2)
out = Rotary().apply_rotary_pos_emb(x, (torch.sin(ang), torch.cos(ang)))
leaves = [x]
''',
        name="interleaved_stack_with_numpy_axis_keyword",
    ),
]

RopePattern.KEEP += [
    Keep(
        # stacked on axis -2 then flattened: lanes paired across positions, not a rotation of each pair
        _STACK_AXIS_KEYWORD.replace("axis=-1", "axis=-2"),
        reason="does not compute the standard rotate_half",
        name="stack_on_axis_minus_two_is_not_the_interleave",
    ),
]


# --- rope s25 (issue 14 harvest): rotation helpers imported from elsewhere -----------------------
#
# streaming-llm's ``from transformers.models.llama.modeling_llama import rotate_half`` and a repo's
# ``from .layers import rotate_half``: the helper is not in the scanned file. A known library helper
# is read from canonical.LIBRARY_ROTATIONS; one in another file of the repository is read there
# (repo_facts.definition) and verified with the same rules as a local one.


def _imported_rotation(module: ModuleInfo, node: ast.Call, name: str) -> _Rotation | None:
    """The verdict on an imported rotation helper called as ``f(x)``, or None where it is not one
    npufuse can read (then the caller's "cannot be verified" near miss stands)."""
    kind = canonical.library_rotation(module, node.func)
    if kind is not None:
        return _Rotation(kind, "", f"{name} ({kind} rotation of the library)")
    if not isinstance(node.func, ast.Name) or len(node.args) != 1 or node.keywords:
        return None
    from npufuse.scan import repo_facts

    found = repo_facts.definition(module, node.func.id)
    if found is None or found.rel == module.path or not isinstance(found.node, ast.FunctionDef):
        return None
    cache = _FOREIGN_MODULES
    key = (str(repo_facts.repo_root(module)), found.rel)
    other = cache.get(key)
    if other is None or other.tree is not found.tree:
        root = repo_facts.repo_root(module)
        text = repo_facts._repo_text(root, found.rel) if root is not None else None  # the tree's own text (segments by position)
        if text is None:
            return None
        try:
            other = ModuleInfo.from_source(found.rel, text, found.tree)
        except (Exception, RecursionError):
            return None
        if len(cache) > 64:
            cache.clear()
        cache[key] = other
    call = ast.copy_location(ast.Call(func=ast.copy_location(ast.Name(id=found.node.name, ctx=ast.Load()), node.func),
                                      args=node.args, keywords=[]), node)
    rot = _rotation_helper(other, other.scopes[0], call)
    # a verdict that names code of the other file (a flag read there, a choice made there) is not used here
    if rot.kind is None or rot.mode_expr or rot.only_if or rot.half_if:
        return None if rot.kind is not None or not rot.reason else _Rotation(None, f"{rot.reason} (in {found.rel})", name)
    rot.name = f"{name} (from {found.rel})"
    return rot


_FOREIGN_MODULES: dict[tuple[str, str], ModuleInfo] = {}


def _relative_rotation_imports(module: ModuleInfo) -> set[str]:
    """Names a top-level ``from .layers import rotate_half`` binds that could be rotation helpers (the
    module's alias table holds absolute imports only)."""
    return {a.asname or a.name for node in module.tree.body if isinstance(node, ast.ImportFrom) and node.level
            for a in node.names if "rot" in (a.asname or a.name).lower()}


# --- rope s25 examples (issue 14 harvest): the pair merge spelled flatten(-2, -1) / torch.flatten,
# imported rotation helpers (tests/test_detect_rope_harvest.py: they need a repository) -------------

_ROFORMER_PAIRS = '''
import torch
import torch.nn as nn


class SelfAttention(nn.Module):
    def forward(self, q, sinusoidal_pos):
        return self.apply_rotary(q, sinusoidal_pos)

    @staticmethod
    def apply_rotary(x, sinusoidal_pos):
        sin, cos = sinusoidal_pos
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2, -1)
'''

# the sinusoidal table of RoFormer: [S, D] = sin half | cos half, chunked into half-size sin/cos
_ROFORMER_RUN = '''
s, d = 7, 16
inv = 1.0 / (10000 ** (torch.arange(0, d, 2) / d))
ang = torch.einsum("i , j -> i j", torch.arange(s).float(), inv)
table = torch.cat((torch.sin(ang), torch.cos(ang)), dim=-1)[None, None, :, :]
x = torch.randn(2, 3, s, d, requires_grad=True)
out = SelfAttention()(x, table.chunk(2, dim=-1))
leaves = [x]
'''

RopePattern.FUSE += [
    Fuse(
        _ROFORMER_PAIRS,
        expect={"qualname": "SelfAttention.apply_rotary", "mode": "interleave", "line": 14, "end_line": 14},
        run=_ROFORMER_RUN,
        name="roformer_pairs_flatten_last_two_spelled_out",
    ),
    Fuse(
        _ROFORMER_PAIRS.replace("torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2, -1)",
                                "torch.flatten(torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1), -2)"),
        expect={"qualname": "SelfAttention.apply_rotary", "mode": "interleave"},
        run=_ROFORMER_RUN,
        name="roformer_pairs_torch_flatten",
    ),
    Fuse(
        _ROFORMER_PAIRS.replace(".flatten(-2, -1)", ".flatten(start_dim=-2, end_dim=-1)")
                       .replace("x1, x2 = x[..., 0::2], x[..., 1::2]", "x1 = x[..., ::2]\n        x2 = x[..., 1::2]"),
        expect={"qualname": "SelfAttention.apply_rotary", "mode": "interleave"},
        run=_ROFORMER_RUN,
        name="roformer_pairs_flatten_keywords",
    ),
]


RopePattern.FUSE += [
    Fuse(
        # three axes merged: the pair axis and the one before it (not a re-interleave of the pairs). The
        # stack itself is the rotated lane pairs: s26 fuses it with the [.., D/2, 2] layout given back and
        # keeps this flatten(-3, -1) as written (it was a Keep while only the flattened form was matched)
        _ROFORMER_PAIRS.replace(".flatten(-2, -1)", ".flatten(-3, -1)"),
        expect={"qualname": "SelfAttention.apply_rotary", "mode": "interleave"},
        run=_ROFORMER_RUN,
        name="stack_flattened_over_three_axes_keeps_that_flatten",
    ),
]

RopePattern.KEEP += [
    Keep(
        # per-batch positions visible here: cos [B, 1, S, D/2] (interleave mode takes 11SD/1S1D/S11D only)
        _ROFORMER_PAIRS.replace("sin, cos = sinusoidal_pos", "sin, cos = sinusoidal_pos\n        sin, cos = sin.unsqueeze(1), cos.unsqueeze(1)"),
        reason="interleave mode with cos/sin that may depend on the batch",
        name="roformer_pairs_with_per_batch_tables",
    ),
]


# --- rope s25: a rotation helper that slices by rank (``if x.dim() == 4: x1 = x[:, :, :, ::2] ... else: ...``) --


def _rank4_test(test: ast.expr, pname: str) -> bool:
    """``x.dim() == 4`` / ``x.ndim == 4`` / ``len(x.shape) == 4`` / ``x.dim() == 4`` on the helper's tensor."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq) and _is_int(test.comparators[0], 4)):
        return False
    left = test.left
    if _method(left, "dim") and not left.args:
        left = left.func.value
    elif isinstance(left, ast.Attribute) and left.attr == "ndim":
        left = left.value
    elif isinstance(left, ast.Call) and isinstance(left.func, ast.Name) and left.func.id == "len" and len(left.args) == 1 \
            and isinstance(left.args[0], ast.Attribute) and left.args[0].attr == "shape":
        left = left.args[0].value
    else:
        return False
    return isinstance(left, ast.Name) and left.id == pname


def _specialised_helper_rotation(module: ModuleInfo, fn: ast.FunctionDef, body: list[ast.stmt], pname: str) -> _Rotation | None:
    """The rotation ``fn`` computes when its body is ``body`` (one branch of it kept: a rank or a parity
    test decided): the helper is re-read as a one-function module and its single return interpreted;
    None when it does not parse back or has not exactly one value return."""
    special = ast.FunctionDef(name=fn.name, args=fn.args, body=body, decorator_list=[], returns=None, type_params=[])
    try:
        other = ModuleInfo.from_source(module.path, ast.unparse(ast.fix_missing_locations(ast.Module(body=[special], type_ignores=[]))))
    except (Exception, RecursionError):
        return None
    hscope = next((sc for sc in other.scopes if sc.qualname == fn.name), None)
    rets = [n for n in fast_walk(other.tree) if isinstance(n, ast.Return) and n.value is not None]
    if hscope is None or len(rets) != 1:
        return None

    def is_param(n: ast.AST) -> bool:
        return isinstance(n, ast.Name) and n.id == pname and hscope.definition(pname, n.lineno) is None

    return _rotation_expr(hscope, rets[0].value, is_param, other)


def _rank4_branch_rotation(module: ModuleInfo, fn: ast.FunctionDef, pname: str) -> _Rotation | None:
    """ModelCenter's ``rotate_every_two``: ``if x.dim() == 4: x1 = x[:, :, :, ::2]; x2 = ... else: x1 = x[:, :, ::2] ...``
    then one return. The ``x.dim() == 4`` branch is verified on its own (the helper rewritten with that branch's
    statements in place of the ``if``); the verdict holds where x is 4-D, the other ranks keep the original code.
    Only assignments in both branches, one leading-level ``if``; None otherwise."""
    ifs = [st for st in fn.body if isinstance(st, ast.If)]
    if len(ifs) != 1 or not ifs[0].orelse or not _rank4_test(ifs[0].test, pname):
        return None
    branch = ifs[0]
    if not all(isinstance(st, ast.Assign) for st in branch.body + branch.orelse):
        return None
    body = [st2 for st in fn.body for st2 in (branch.body if st is branch else [st])]
    rot = _specialised_helper_rotation(module, fn, body, pname)
    if rot is None:
        return None
    if rot.kind is None or rot.mode_expr or rot.only_if or rot.half_if:
        return None
    rot.rank4_only = True
    rot.other = f"a rotated tensor that is not 4-D keeps the original code (`{fn.name}` slices it by rank)"
    return rot


_RANK_SLICED = '''
import torch
import torch.nn as nn


class RotaryEmbedding(nn.Module):
    def rotate_every_two(self, x):
        if x.dim() == 4:
            x1 = x[:, :, :, ::2]
            x2 = x[:, :, :, 1::2]
        else:
            x1 = x[:, :, ::2]
            x2 = x[:, :, 1::2]
        x = torch.stack((-x2, x1), axis=-1)
        return x.flatten(-2)

    def apply_rotary_pos_emb(self, x, sincos, offset=0):
        sin, cos = map(lambda t: t[None, offset : x.shape[-2] + offset, :].repeat_interleave(2, 2), sincos)
        return (x * cos) + (self.rotate_every_two(x) * sin)
'''

_RANK_SLICED_RUN = '''
s, d = 6, 16
inv = 1.0 / (10000 ** (torch.arange(0, d, 2) / d))
ang = torch.einsum("i , j -> i j", torch.arange(s).float(), inv)
x = torch.randn(2, 3, s, d, requires_grad=True)
x3 = torch.randn(3, s, d)
m = RotaryEmbedding()
out = (m.apply_rotary_pos_emb(x, (torch.sin(ang), torch.cos(ang))), m.apply_rotary_pos_emb(x3, (torch.sin(ang), torch.cos(ang))))
leaves = [x]
'''

RopePattern.FUSE += [
    Fuse(
        _RANK_SLICED,
        expect={"qualname": "RotaryEmbedding.apply_rotary_pos_emb", "mode": "interleave"},
        run=_RANK_SLICED_RUN,
        name="rotate_every_two_sliced_by_rank",
    ),
    Fuse(
        _RANK_SLICED.replace("if x.dim() == 4:", "if len(x.shape) == 4:"),
        expect={"qualname": "RotaryEmbedding.apply_rotary_pos_emb", "mode": "interleave"},
        run=_RANK_SLICED_RUN,
        name="rotate_every_two_sliced_by_len_shape",
    ),
]

RopePattern.KEEP += [
    Keep(
        # the 4-D branch slices the sequence axis, not the head dim: no rotation of the pairs
        _RANK_SLICED.replace("x1 = x[:, :, :, ::2]\n            x2 = x[:, :, :, 1::2]", "x1 = x[:, :, ::2, :]\n            x2 = x[:, :, 1::2, :]"),
        reason="does not compute the standard rotate_half",
        name="rank_sliced_helper_on_the_wrong_axis",
    ),
]


# --- rope s25: the written-out rotation filled into a new tensor (lerobot's pi0 ``apply_rope``) -------


def _filled_site(block: list[ast.stmt], i: int, stmt: ast.stmt) -> ast.Assign | None:
    """``res = torch.empty_like(x); res[..., :h] = x1*cos - x2*sin; res[..., h:] = x2*cos + x1*sin`` at
    ``block[i]`` as one statement ``res = torch.cat((x1*cos - x2*sin, x2*cos + x1*sin), dim=-1)`` spanning
    the three (canonical.filled_output): the fused call then replaces the three with ``res = <fused>``."""
    if not (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Attribute)
            and stmt.value.func.attr in ("empty_like", "zeros_like", "clone") and i + 2 < len(block)):
        return None
    alloc = _s42_clone_as_empty_like(stmt)
    if alloc is None:
        return None
    found = canonical.filled_output([alloc, *block[i + 1 : i + 3]]) or _s43_pair_axis_output(alloc, block[i + 1 : i + 3])
    if found is None:
        return None
    out, expr = found
    last = block[i + 2]
    target = ast.Name(id=out, ctx=ast.Store(), lineno=stmt.targets[0].lineno, col_offset=stmt.targets[0].col_offset,
                      end_lineno=stmt.targets[0].end_lineno, end_col_offset=stmt.targets[0].end_col_offset)
    site = ast.Assign(targets=[target], value=expr, lineno=stmt.lineno, col_offset=stmt.col_offset,
                      end_lineno=last.end_lineno, end_col_offset=last.end_col_offset)
    site.npufuse_alloc = alloc.value  # type: ignore[attr-defined]  # the buffer as ``empty_like(x)`` (what _filled_match reads)
    return site


def _s42_clone_as_empty_like(stmt: ast.Assign) -> ast.Assign | None:
    """The allocation ``out = x.clone()`` read as ``out = torch.empty_like(x)`` (other allocations as written): where
    the two fills that follow cover every lane of the last dim (canonical.filled_output only takes such fills),
    nothing of the copy survives, and the buffer's dtype and shape are x's as with empty_like. None for a clone with
    arguments (``memory_format=``) or of an expression that is no plain name / attribute (it would be evaluated
    again)."""
    call = stmt.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "clone"):
        return stmt
    if call.args or call.keywords or not isinstance(call.func.value, (ast.Name, ast.Attribute)):
        return None
    empty = ast.copy_location(ast.Call(func=ast.copy_location(ast.Attribute(value=ast.Name("torch", ast.Load()), attr="empty_like",
                                                                            ctx=ast.Load()), call.func),
                                       args=[call.func.value], keywords=[]), call)
    return ast.copy_location(ast.Assign(targets=stmt.targets, value=empty), stmt)


def _filled_lanes_site(scope: Scope, block: list[ast.stmt], i: int, stmt: ast.stmt) -> tuple[ast.Assign, ast.expr | None, int] | None:
    """The spellings of ``_filled_site`` the shared canonical reading does not take, as (the one statement
    ``res = <value>`` spanning them, the upper bound u of the filled lanes or None, the number of statements):

    * the two fills as one statement, ``res[..., ::2], res[..., 1::2] = a, b`` (or the halves' slices);
    * ``torch.empty_like(x, device=x.device)`` (a device keyword that is x's own device: the same tensor);
    * the lanes of a prefix, ``res[..., :u:2], res[..., 1:u:2] = a, b`` (a nanoGPT variant's partial
      interleaved rotary): read as ``torch.stack((a, b), -1).flatten(-2)``, the rotated prefix; the caller
      fuses it only where the rotation is of ``x[..., :u]`` and joins after it what the fills leave in
      ``res[..., u:]`` (zeros from zeros_like; from empty_like nothing defined: x's tail, which the code's own
      tail copy writes there next)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Attribute)
            and stmt.value.func.attr in ("empty_like", "zeros_like") and len(stmt.value.args) == 1 and i + 1 < len(block)):
        return None
    call = stmt.value
    like = call.args[0]
    for kw in call.keywords:
        # device=x.device (or a local bound once to it): the same allocation; any other keyword changes it
        dev = _resolve(scope, kw.value) if kw.arg == "device" else None
        if not (isinstance(dev, ast.Attribute) and dev.attr == "device" and same_expr(dev.value, like)):
            return None
    alloc = ast.Assign(targets=stmt.targets, value=ast.Call(func=call.func, args=call.args, keywords=[]))
    ast.copy_location(alloc, stmt)
    ast.copy_location(alloc.value, call)
    nxt = block[i + 1]
    if isinstance(nxt, ast.Assign) and len(nxt.targets) == 1 and isinstance(nxt.targets[0], ast.Tuple) \
            and len(nxt.targets[0].elts) == 2 and isinstance(nxt.value, ast.Tuple) and len(nxt.value.elts) == 2:
        fills = [ast.copy_location(ast.Assign(targets=[t], value=v), nxt) for t, v in zip(nxt.targets[0].elts, nxt.value.elts)]
        for f in fills:
            f.end_lineno, f.end_col_offset = nxt.end_lineno, nxt.end_col_offset
        used = 2
    elif i + 2 < len(block):
        fills, used = [block[i + 1], block[i + 2]], 3
    else:
        return None
    if not call.keywords and used == 3 and canonical.filled_output([stmt] + fills) is not None:
        return None  # the canonical spelling: _filled_site's
    found = canonical.filled_output([alloc] + fills)
    upper: ast.expr | None = None
    if found is None:
        found = _bounded_lane_fills(alloc, fills)
        if found is None:
            return None
        upper = found[2]
    out, expr = found[0], found[1]
    last = block[i + used - 1]
    target = ast.Name(id=out, ctx=ast.Store())
    ast.copy_location(target, stmt.targets[0])
    site = ast.Assign(targets=[target], value=expr)
    ast.copy_location(site, stmt)
    site.end_lineno, site.end_col_offset = last.end_lineno, last.end_col_offset
    return site, upper, used


def _s41_fills_after_allocation(block: list[ast.stmt], j: int, stmt: ast.stmt) -> tuple[ast.Assign, ast.Assign] | None:
    """s41 (HO17a llama4-tiny-vlm): the two fills ``out[..., 0::2] = A; out[..., 1::2] = B`` (or the halves) at
    ``block[j]``, ``block[j + 1]`` of a buffer ``out = torch.zeros_like(x)`` / ``empty_like(x)`` allocated earlier in
    the block with statements between that never name ``out``, or with the fills indexed ``out[:, :, :, s]`` (the
    last dim of a 4-D tensor, as x's own slices are read): as (the allocation, one statement ``out = <value>``
    spanning the two fills only). The allocation stays as written (an unused buffer: nothing else holds it, as no
    statement between names it); the fused call rebinds ``out`` where the fills were. None for any other shape
    (the adjacent ``[..., s]`` spelling is :func:`_filled_site`'s)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Subscript)
            and isinstance(stmt.targets[0].value, ast.Name) and j + 1 < len(block)):
        return None
    out = stmt.targets[0].value.id
    k = j - 1
    while k >= 0 and not any(isinstance(n, ast.Name) and n.id == out for n in fast_walk(block[k])):
        k -= 1
    if k < 0:
        return None
    alloc = block[k]
    if not (isinstance(alloc, ast.Assign) and len(alloc.targets) == 1 and isinstance(alloc.targets[0], ast.Name)
            and alloc.targets[0].id == out and isinstance(alloc.value, ast.Call) and isinstance(alloc.value.func, ast.Attribute)
            and alloc.value.func.attr in ("empty_like", "zeros_like") and len(alloc.value.args) == 1 and not alloc.value.keywords):
        return None

    def as_ellipsis(st: ast.stmt) -> ast.stmt | None:
        # ``out[:, :, :, s]``: the last dim of a 4-D tensor, written ``out[..., s]`` for the shared reading
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Subscript)):
            return None
        t = st.targets[0]
        sl = t.slice
        if isinstance(sl, ast.Tuple) and len(sl.elts) == 4 and all(isinstance(e, ast.Slice) and e.lower is None and e.upper is None
                                                                   and e.step is None for e in sl.elts[:3]):
            sl = ast.Tuple(elts=[ast.Constant(Ellipsis), sl.elts[3]], ctx=ast.Load())
        target = ast.copy_location(ast.Subscript(value=t.value, slice=sl, ctx=ast.Store()), t)
        return ast.copy_location(ast.Assign(targets=[target], value=st.value), st)

    fills = [as_ellipsis(block[j]), as_ellipsis(block[j + 1])]
    if fills[0] is None or fills[1] is None:
        return None
    adjacent = k == j - 1 and fills[0].targets[0].slice is block[j].targets[0].slice  # type: ignore[attr-defined]
    if adjacent:
        return None  # the canonical spelling, read by _filled_site / _filled_lanes_site
    # the allocation as if written right before the fills: the wrapper nodes then span the two fills only
    value = ast.Call(func=alloc.value.func, args=alloc.value.args, keywords=[])
    ast.copy_location(value, stmt)
    moved = ast.copy_location(ast.Assign(targets=alloc.targets, value=value), stmt)
    for f, orig in zip(fills, (block[j], block[j + 1])):
        f.end_lineno, f.end_col_offset = orig.end_lineno, orig.end_col_offset
    found = canonical.filled_output([moved, *fills]) or _s43_pair_axis_output(moved, fills)  # type: ignore[list-item]
    if found is None:
        return None
    target = ast.copy_location(ast.Name(id=out, ctx=ast.Store()), stmt.targets[0])
    site = ast.copy_location(ast.Assign(targets=[target], value=found[1]), stmt)
    site.end_lineno, site.end_col_offset = block[j + 1].end_lineno, block[j + 1].end_col_offset
    return alloc, site


def _s43_pair_axis_output(alloc: ast.stmt, fills: list[ast.stmt]) -> tuple[str, ast.expr] | None:
    """s43 (HO19a transformer-llm's ``q_ = q.view(*q.shape[:-1], d // 2, 2); q_rot = torch.empty_like(q_);
    q_rot[..., 0] = A; q_rot[..., 1] = B``): the two fills of a pair axis as (``out``, ``torch.stack((A, B), dim=-1)``),
    the pairs left ``[.., D/2, 2]`` (the code's own ``view_as`` after it runs as written). The new nodes span the
    allocation's value to the second fill; the value is marked ``npufuse_pair_axis``: :meth:`RopePattern._filled_match`
    takes it only where the buffer is shaped like the rotated x's own ``(.., D/2, 2)`` view (its last axis 2, so the
    two fills cover it). A and B must not read ``out``. None otherwise."""
    if len(fills) != 2 or not (isinstance(alloc, ast.Assign) and len(alloc.targets) == 1 and isinstance(alloc.targets[0], ast.Name)
                               and isinstance(alloc.value, ast.Call) and isinstance(alloc.value.func, ast.Attribute)
                               and alloc.value.func.attr in ("empty_like", "zeros_like") and len(alloc.value.args) == 1
                               and not alloc.value.keywords):
        return None  # (zeros_like: the two fills cover the whole pair axis, so none of the zeros survives)
    out = alloc.targets[0].id
    values = []
    for k, st in enumerate(fills):
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Subscript)):
            return None
        t = st.targets[0]
        if not (isinstance(t.value, ast.Name) and t.value.id == out and _lane(t, k) is not None):
            return None
        if any(isinstance(n, ast.Name) and n.id == out for n in ast.walk(st.value)):
            return None
        values.append(st.value)

    def at(node: ast.AST) -> ast.AST:
        node.lineno, node.col_offset = alloc.value.lineno, alloc.value.col_offset  # type: ignore[attr-defined]
        node.end_lineno, node.end_col_offset = fills[1].end_lineno, fills[1].end_col_offset  # type: ignore[attr-defined]
        return node

    torch_mod = alloc.value.func.value
    pair = at(ast.Tuple(elts=values, ctx=ast.Load()))
    expr = at(ast.Call(func=at(ast.Attribute(value=torch_mod, attr="stack", ctx=ast.Load())), args=[pair],
                       keywords=[ast.keyword(arg="dim", value=at(ast.UnaryOp(op=ast.USub(), operand=ast.Constant(1))))]))
    expr.npufuse_pair_axis = True  # type: ignore[attr-defined]
    return out, expr  # type: ignore[return-value]


def _bounded_lane_fills(alloc: ast.Assign, fills: list[ast.stmt]) -> tuple[str, ast.expr, ast.expr] | None:
    """(res, ``torch.stack((a, b), dim=-1).flatten(-2)``, u) of ``res[..., :u:2] = a; res[..., 1:u:2] = b``
    (one u for both, neither fill reading res); the new nodes span the allocation's value to the last fill."""
    out = alloc.targets[0].id  # type: ignore[attr-defined]
    parts = []
    for st in fills:
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Subscript)):
            return None
        t = st.targets[0]
        if not (isinstance(t.value, ast.Name) and t.value.id == out) or any(isinstance(n, ast.Name) and n.id == out for n in ast.walk(st.value)):
            return None
        sl = _Halves(None, lambda n: True)._last_dim_slice(t)  # type: ignore[arg-type]
        if sl is None or sl.upper is None or not _is_int(sl.step, 2):
            return None
        parts.append((sl, st.value))
    (s1, a), (s2, b) = parts
    if not ((s1.lower is None or _is_int(s1.lower, 0)) and _is_int(s2.lower, 1) and ast.dump(s1.upper) == ast.dump(s2.upper)):  # type: ignore[arg-type]
        return None
    last = fills[-1]

    def at(node: ast.AST) -> ast.AST:
        node.lineno, node.col_offset = alloc.value.lineno, alloc.value.col_offset  # type: ignore[attr-defined]
        node.end_lineno, node.end_col_offset = last.end_lineno, last.end_col_offset  # type: ignore[attr-defined]
        return node

    torch_mod = alloc.value.func.value  # type: ignore[attr-defined]
    pair = at(ast.Tuple(elts=[a, b], ctx=ast.Load()))
    stacked = at(ast.Call(func=at(ast.Attribute(value=torch_mod, attr="stack", ctx=ast.Load())), args=[pair],
                          keywords=[ast.keyword(arg="dim", value=at(ast.UnaryOp(op=ast.USub(), operand=ast.Constant(1))))]))
    expr = at(ast.Call(func=at(ast.Attribute(value=stacked, attr="flatten", ctx=ast.Load())),
                       args=[at(ast.UnaryOp(op=ast.USub(), operand=ast.Constant(2)))], keywords=[]))
    return out, expr, s1.upper  # type: ignore[return-value]


_FILLED_HALVES = '''
import torch


def apply_rope(x, positions, max_wavelength=10_000):
    d_half = x.shape[-1] // 2
    freq_exponents = (2.0 / x.shape[-1]) * torch.arange(d_half, dtype=torch.float32, device=x.device)
    timescale = max_wavelength**freq_exponents
    radians = positions[..., None].to(torch.float32) / timescale[None, None, :]
    radians = radians[..., None, :]
    sin = torch.sin(radians)
    cos = torch.cos(radians)
    x1, x2 = x.split(d_half, dim=-1)
    res = torch.empty_like(x)
    res[..., :d_half] = x1 * cos - x2 * sin
    res[..., d_half:] = x2 * cos + x1 * sin
    return res
'''

# bf16 x, fp32 tables: the eager fills cast into res (bf16); per-batch positions [B, S] (half mode takes BS1D)
_FILLED_HALVES_RUN = '''
x = torch.randn(2, 5, 3, 16).bfloat16().requires_grad_()
pos = torch.stack([torch.arange(5), torch.arange(5) + 2]).float()
out = apply_rope(x, pos)
leaves = [x]
'''

RopePattern.FUSE += [
    Fuse(
        _FILLED_HALVES,
        expect={"qualname": "apply_rope", "mode": "half", "line": 14, "end_line": 16},
        run=_FILLED_HALVES_RUN,
        name="written_out_halves_filled_into_empty_like",
    ),
    Fuse(
        _FILLED_HALVES.replace("res[..., :d_half] = x1 * cos - x2 * sin\n    res[..., d_half:] = x2 * cos + x1 * sin",
                               "res[..., 0::2] = x1 * cos - x2 * sin\n    res[..., 1::2] = x2 * cos + x1 * sin")
                      .replace("x1, x2 = x.split(d_half, dim=-1)", "x1, x2 = x[..., 0::2], x[..., 1::2]")
                      .replace("radians = radians[..., None, :]", "radians = radians[0, None, :, None, :]"),
        expect={"qualname": "apply_rope", "mode": "interleave"},
        run=_FILLED_HALVES_RUN,
        name="written_out_pairs_filled_into_lanes",
    ),
]

RopePattern.KEEP += [
    Keep(
        # both fills on the same half: the second half of res is never written
        _FILLED_HALVES.replace("res[..., d_half:] = x2 * cos + x1 * sin", "res[..., :d_half] += x2 * cos + x1 * sin"),
        reason="",
        name="filled_output_with_one_half_written_twice",
    ),
    Keep(
        _FILLED_HALVES.replace("res = torch.empty_like(x)", "res = torch.empty_like(positions)"),
        reason="a new tensor shaped like another tensor than the rotated",
        name="filled_output_shaped_like_another_tensor",
    ),
]


# look-alikes from the harvest: a sinusoidal position table added to x, and an ALiBi bias built from
# sin/cos-free slopes (products summed, but no rotation of x's halves or lanes)
_SINUSOID_ADDED = '''
import torch


def add_sinusoid(x, pos, dim):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2) / dim))
    ang = pos[:, None] * inv[None]
    pe = torch.cat((ang.sin(), ang.cos()), dim=-1)
    return x * 1.0 + torch.cat((pe[..., dim // 2:], pe[..., :dim // 2]), dim=-1) * 0.5
'''

_ALIBI = '''
import torch


def alibi_scores(qk, bias, past_slopes, future_slopes):
    return qk * 1.0 + torch.cat((torch.tril(bias * past_slopes), torch.triu(bias * future_slopes)), dim=-1) * 1.0
'''

RopePattern.KEEP += [
    Keep(_SINUSOID_ADDED, reason="", name="sinusoidal_table_added_is_no_rotation"),
    Keep(_ALIBI, reason="", name="alibi_bias_is_no_rotation"),
]


# --- rope s26: the complex form proven by dataflow, not by one spelling -------------------------------
# ``z = z * f; view_as_real(z).flatten(-2)`` (the product rebinds the complex name) and a helper
# ``view_as_real(z * f).flatten(3)`` whose complex operand is a parameter its callers fill with
# ``view_as_complex(pairs)``: the same interleaved rotation as the inline spelling.

def _rebound_complex_product(pat: "RopePattern", module: ModuleInfo, scope: Scope, node: ast.Call, name: ast.Name,
                             post: str) -> _Match | str | None:
    """``view_as_real(name).<merge>`` where the statement right before is ``name = a * b`` with one factor
    a ``view_as_complex`` of x's lane pairs (through names, at that line). The product statement goes with
    the site: the fused path does not compute it; the original path (run-time shape check) runs both."""
    here = _stmt_of(scope, node)
    if here is None or here[1] == 0:
        return None
    block, i, stmt = here
    # the product's statement: the last one of this block before the site binding the name (llama-style code
    # computes q's and k's products first, then both real views: the run takes the products together)
    j = next((j for j in range(i - 1, -1, -1) if name.id in bound_names(block[j])), None)
    if j is None:
        return None
    prev = block[j]
    if not (isinstance(prev, ast.Assign) and len(prev.targets) == 1 and isinstance(prev.targets[0], ast.Name)
            and prev.targets[0].id == name.id and isinstance(prev.value, ast.BinOp) and isinstance(prev.value.op, ast.Mult)):
        return None
    prod = prev.value
    between = set().union(*(bound_names(st) for st in block[j + 1 : i])) if j + 1 < i else set()
    if any(isinstance(n, ast.Name) and n.id in between for n in ast.walk(prod)):
        return None  # an operand of the product is rebound before the site: the fused call would read another value
    for xc, freqs in ((prod.left, prod.right), (prod.right, prod.left)):
        val = _complex_value(module, scope, xc)  # (names in the product resolve to their bindings before its line)
        if not (isinstance(val, ast.Call) and ast.unparse(val.func).endswith("view_as_complex") and val.args):
            continue
        got = _complex_pairs(scope, val.args[0], val.lineno, allow_f64=True)
        if isinstance(got, str):
            return got
        if name.id not in bound_names(stmt) and _read_before_rebound(scope, name.id, stmt.end_lineno or stmt.lineno):
            # the fused path drops the product: a later read of the name would see the unrotated value
            return (f"complex rope whose product `{segment(module, prev)}` is read again after "
                    f"`{segment(module, node)}`: the fused call cannot replace it")
        x, cast = got
        m = pat._complex_checked(module, node, x, xc, freqs, cast)
        m.post, m.freqs, m.absorb = post, freqs, [prev]
        return _float64_in_fp32(module, scope, m, x, val.lineno, node) if cast == "float64" else m
    return None


def _passes_complex(module: ModuleInfo, fn_scope: Scope, param: str) -> bool:
    """Every call of the function in this module (by its name; ``self.<name>`` from a method of the same
    class for a method) passes, for ``param``, a value bound to ``view_as_complex(..)`` in the caller (its
    last binding before the call); at least one call. The fused path checks complexness at run time too."""
    fn = fn_scope.node
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    if param not in params:
        return False
    method = bool(params) and params[0] in ("self", "cls")
    cls_prefix = fn_scope.qualname.rpartition(".")[0] + "."
    owner: dict[int, tuple[Scope, ast.Call]] = {}  # each call with its innermost scope (scopes come outer first)
    for scope in module.scopes:
        if method and not scope.qualname.startswith(cls_prefix):
            continue  # another class's method of the same name
        for call in scope.nodes().get(ast.Call, ()):
            f = call.func  # type: ignore[attr-defined]
            if (isinstance(f, ast.Name) and f.id == fn.name and not method) \
                    or (isinstance(f, ast.Attribute) and f.attr == fn.name and isinstance(f.value, ast.Name) and f.value.id in ("self", "cls") and method):
                owner[id(call)] = (scope, call)  # type: ignore[assignment]
    pos = params.index(param) - (1 if method else 0)
    for scope, call in owner.values():
        if scope.node is fn:
            return False  # a recursive call: not followed
        arg = keyword(call, param, pos)
        if arg is None:
            return False
        if isinstance(arg, ast.Name):
            # the binding before the call's statement (``q = self.f(.., q)`` over several lines rebinds q
            # on the statement's first line, before the argument's own line)
            here = _stmt_of(scope, call)
            if here is None:
                return False
            reaching = _reaching_binding(scope, arg.id, here[2])
            if reaching is None:
                return False
            arg = reaching
        val = _resolve(scope, arg)
        if not (isinstance(val, ast.Call) and ast.unparse(val.func).endswith("view_as_complex")):
            return False
    return bool(owner)


def _reaching_binding(scope: Scope, name: str, stmt: ast.stmt) -> ast.expr | None:
    """The value of the last binding of ``name`` before ``stmt`` that can reach it: a binding in the
    other branch of an ``if`` around ``stmt`` cannot (OLMo-core binds ``k_rot`` in both branches of
    ``if head_first:``, the textually last one is not the one the else branch reads)."""
    mine = {id(i): body for i, body, _c in _if_path(scope, stmt) if isinstance(i, ast.If)}
    for st, value in reversed(scope.assignments.get(name, [])):
        if st.lineno >= stmt.lineno:
            continue
        if any(isinstance(i, ast.If) and id(i) in mine and mine[id(i)] != body for i, body, _c in _if_path(scope, st)):
            continue  # the other branch of an if this statement is in
        return value
    return None


def _complex_parameter_product(pat: "RopePattern", module: ModuleInfo, scope: Scope, node: ast.Call, prod: ast.BinOp,
                               post: str) -> _Match | str | None:
    """``view_as_real(z * f).<merge>`` in a helper whose parameter z its callers in this module fill with
    ``view_as_complex(..)`` of lane pairs. The fused path also runs only where z and f are complex at
    run time (placeholders of rank 1 otherwise make the shape check fail: the original code runs)."""
    fn = scope.node
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    for xc, freqs in ((prod.left, prod.right), (prod.right, prod.left)):
        if not (isinstance(xc, ast.Name) and xc.id in scope.args and not scope.assignments.get(xc.id)):
            continue
        if not _passes_complex(module, scope, xc.id):
            return (f"complex product with the parameter `{xc.id}`: not every call of `{scope.qualname}` in this module "
                    "passes it a view_as_complex(..) value, so its lane pairs are not proven")
        tag = _ident(segment(module, xc))
        ok, zc, fc = f"_npufuse_{tag}_complex", f"_npufuse_{tag}_z", f"_npufuse_{tag}_f"
        f_src, z_src = _atom(segment(module, freqs)), segment(module, xc)
        m = pat._complex_checked(module, node, xc, ast.Name(id=zc, ctx=ast.Load()), ast.Name(id=fc, ctx=ast.Load()), None)
        # (a rank-1 placeholder: x's rank 1 fails the fused path's ``dim() == 4`` check)
        m.prep = [f"{ok} = {z_src}.is_complex() and {f_src}.is_complex()  # its callers pass view_as_complex pairs; checked here too",
                  f"{zc} = {z_src} if {ok} else torch.zeros(1, dtype=torch.complex64, device={z_src}.device)",
                  f"{fc} = {f_src} if {ok} else {zc}"] + m.prep
        m.post, m.freqs = post, freqs
        return m
    return None


_COMPLEX_REBOUND = '''
import torch
import torch.nn as nn


class Turn(nn.Module):
    def __init__(self, dim, n):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        ang = torch.outer(torch.arange(n).float(), inv)
        self.register_buffer("table", torch.view_as_real(torch.polar(torch.ones_like(ang), ang)))

    def forward(self, x):
        f = torch.view_as_complex(self.table)[: x.shape[1]].unsqueeze(1)
        x2 = x.unflatten(-1, (-1, 2))
        z = torch.view_as_complex(x2.float())
        z = z * f
        y = torch.view_as_real(z).flatten(-2)
        return y.type_as(x)
'''

# the complex operand is a parameter of the helper; its callers make it from lane pairs (one of them
# on each branch of an ``if``: the binding in the other branch does not reach the call)
_COMPLEX_PARAMETER = '''
import torch
import torch.nn as nn


class Spin(nn.Module):
    def _turn(self, f, z):
        return torch.view_as_real(z * f).flatten(3)

    def forward(self, q, k, f, heads_first: bool = False):
        qz = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        kz = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
        if heads_first:
            qz = self._turn(f[None, None], qz)
            kz = self._turn(f[None, None], kz)
        else:
            qz = self._turn(f[None, :, None, :], qz)
            kz = self._turn(f[None, :, None, :], kz)
        return qz.type_as(q), kz.type_as(k)
'''

_COMPLEX_PARAMETER_RUN = '''
S, D = 5, 8
ang = torch.outer(torch.arange(S).float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
f = torch.polar(torch.ones_like(ang), ang)
q = torch.randn(2, S, 3, D, requires_grad=True)
k = torch.randn(2, S, 3, D, requires_grad=True)
m = Spin()
out = (m(q, k, f), m(q.transpose(1, 2), k.transpose(1, 2), f, heads_first=True))
leaves = [q, k]
'''

RopePattern.FUSE += [
    Fuse(
        name="complex_product_rebinds_its_name",
        code=_COMPLEX_REBOUND,
        expect={"mode": "complex", "freqs": "f", "variant": "complex_freqs_cis_checked"},
        run='''
x = torch.randn(2, 6, 3, 16, requires_grad=True)
m = Turn(16, 10)
out = (m(x), m(x.half().float()), m(x[:, :4]))
leaves = [x]
''',
    ),
    Fuse(
        name="complex_operand_passed_to_helper",
        code=_COMPLEX_PARAMETER,
        expect={"mode": "complex", "freqs": "f", "qualname": "Spin._turn"},
        run=_COMPLEX_PARAMETER_RUN,
    ),
]

RopePattern.KEEP += [
    Keep(
        # the rotated complex value is read again after the real view: the fused call cannot drop the product
        _COMPLEX_REBOUND.replace("        return y.type_as(x)", "        return y.type_as(x), z.abs()"),
        reason="is read again after",
        name="complex_product_read_again",
    ),
    Keep(
        # one caller passes a real tensor (a real x times complex f is no rotation of lane pairs)
        _COMPLEX_PARAMETER.replace("kz = self._turn(f[None, :, None, :], kz)", "kz = self._turn(f[None, :, None, :], k)"),
        reason="lane pairs are not proven",
        name="complex_parameter_not_from_pairs",
    ),
]


# --- rope s26: a rotation named before use, and helpers cutting at an attribute split point -----------
# ``r = self._swap(x); y = x * cos + r * sin`` is the rotation of the helper call (the name bound once,
# straight before, with x the same binding at both places); fairseq2-style helpers cut the halves at
# ``self.encoding_dim // 2``, which is D/2 only if the module was built for this x: fused where
# ``x.shape[-1] == 2 * (self.encoding_dim // 2)`` holds at run time, the original code elsewhere.

def _named_rotation_call(scope: Scope, name: ast.Name, x: ast.expr) -> ast.Call | None:
    """The call bound to ``name`` (its only binding before the use, in the scope's top block or the same
    block as the use) when its first argument is ``x`` with the binding ``x`` has at the use."""
    binds = [(st, v) for st, v in scope.assignments.get(name.id, []) if st.lineno < name.lineno]
    if len(binds) != 1:
        return None
    st, call = binds[0]
    if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) and isinstance(call, ast.Call)
            and call.args and same_expr(call.args[0], x)):
        return None
    f = call.func
    if not (isinstance(f, ast.Name) or (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("self", "cls"))):
        return None  # a helper function or method, not a tensor method (``stack(..).reshape_as(x)`` is inline code)
    if _bound_on_a_branch(scope, name):
        return None
    for n in fast_walk(x):
        # every name in x reads at the call what it reads at the use (no binding between)
        if isinstance(n, ast.Name) and any(st.lineno <= b.lineno < name.lineno for b, _v in scope.assignments.get(n.id, [])):
            return None
    return call


def _helper_locals_inlined(hscope: Scope, tree: ast.expr, pname: str) -> ast.expr:
    """``tree`` (an expression read in the helper) with each local name the helper binds once, by a plain
    ``name = <expr>`` statement of its own body, replaced by that expression (labml's ``d_2 = self.d // 2``
    before ``x[:, :, :, d_2:]``): what the call site can evaluate again. Names bound otherwise stay."""
    body = getattr(hscope.node, "body", [])
    params = {a.arg for a in getattr(getattr(hscope.node, "args", None), "args", [])}
    for _ in range(4):
        changed = False

        class _Inline(ast.NodeTransformer):
            def visit_Name(self, n: ast.Name) -> ast.AST:
                nonlocal changed
                if n.id in (pname, "self") or n.id in params:
                    return n
                binds = hscope.assignments.get(n.id, [])
                if len(binds) != 1:
                    return n
                st, value = binds[0]
                if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                        and any(st is b for b in body)):
                    return n
                changed = True
                return copy.deepcopy(value)

        tree = _Inline().visit(copy.deepcopy(tree))
        if not changed:
            break
    return tree


def _split_checked_helper(module: ModuleInfo, node: ast.Call, hscope: Scope, ret: ast.expr, is_param, pname: str) -> _Rotation | None:
    """The helper's return is a rotation when its halves may be cut at a split point read from
    ``self.<attr>`` / constants (called as ``self.f(x)`` from a method, so ``self`` is the same object at
    the call): the kind, with the run-time check ``{x}.shape[-1] == 2 * (split)``."""
    if not (isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
        return None
    halves = _Halves(hscope, is_param, module)
    halves.allow_split = True
    rot = _rotation_of_halves(hscope, ret, is_param, halves)
    if rot.kind != "half" or not halves.split_checks or halves.prefix is not None:
        return None
    checks = []
    for check in halves.split_checks:
        tree = _helper_locals_inlined(hscope, ast.parse(check, mode="eval").body, pname)
        if any(isinstance(n, ast.Name) and n.id not in (pname, "self") for n in ast.walk(tree)):
            return None  # only the parameter (the call's argument) and ``self`` can be read at the call site
        for n in ast.walk(tree):
            if isinstance(n, ast.Name) and n.id == pname:
                n.id = "{x}"  # formatted with the call's argument by _rotation_call
        checks.append(ast.unparse(tree))
    if any(c.count("{") != c.count("{x}") or "}" in c.replace("{x}", "") for c in checks):
        return None
    rot.split_only_if = " and ".join(checks)
    rot.other = "the helper cuts its halves at a split point read from the module (not provably half the last dim)"
    return rot


_NAMED_SPLIT_HELPER = '''
import torch
import torch.nn as nn


class HalfTurn(nn.Module):
    def __init__(self, dim, n):
        super().__init__()
        self.dim = dim
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        ang = torch.outer(torch.arange(n).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("c", ang.cos())
        self.register_buffer("s", ang.sin())

    def forward(self, x):
        c = self.c[: x.shape[1]].unsqueeze(1)
        s = self.s[: x.shape[1]].unsqueeze(1)
        xf = x.float()
        r = self._swap(xf)
        xf = (xf * c) + (r * s)
        return xf.type_as(x)

    def _swap(self, t):
        a = t[..., : self.dim // 2]
        b = t[..., self.dim // 2 :]
        return torch.cat((-b, a), dim=-1)
'''

RopePattern.FUSE += [
    Fuse(
        name="named_rotation_of_attribute_split_helper",
        code=_NAMED_SPLIT_HELPER,
        expect={"mode": "half", "variant": "rotation_helper_one_path_verified"},
        run='''
x = torch.randn(2, 6, 3, 8, requires_grad=True)
m = HalfTurn(8, 10)
out = (m(x), m(x[:, :4]), m(x.to(torch.bfloat16)))
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # x is rebound between the named rotation and its use: r is the rotation of the old x
        _NAMED_SPLIT_HELPER.replace("        xf = (xf * c) + (r * s)", "        xf = xf * 2\n        xf = (xf * c) + (r * s)"),
        name="named_rotation_of_another_binding",
    ),
    Keep(
        # the helper is a free function reading a global split point: not the same object at the call
        _NAMED_SPLIT_HELPER.replace("r = self._swap(xf)", "r = swap(xf)").replace(
            "    def _swap(self, t):\n        a = t[..., : self.dim // 2]\n        b = t[..., self.dim // 2 :]\n        return torch.cat((-b, a), dim=-1)\n", "")
        + "\n\nHALF = 4\n\n\ndef swap(t):\n    return torch.cat((-t[..., HALF:], t[..., :HALF]), dim=-1)\n",
        name="free_helper_global_split",
    ),
]

# s32 (labml's annotated RoPE, copied into matcha / chatterbox): [S, B, N, D] input, partial rotary on the first
# ``self.d`` features, a helper whose split point is a local bound once from ``self.d`` and whose halves are cut
# with explicit leading axes (``x[:, :, :, d_2:]``, the last axis of the 4-D tensor the op takes)
_LABML_PARTIAL = '''
import torch
import torch.nn as nn


class RotaryPositionalEmbeddings(nn.Module):
    def __init__(self, d, base=10_000):
        super().__init__()
        self.base = base
        self.d = int(d)
        self.cos_cached = None
        self.sin_cached = None

    def _build_cache(self, x):
        if self.cos_cached is not None and x.shape[0] <= self.cos_cached.shape[0]:
            return
        seq_len = x.shape[0]
        theta = 1.0 / (self.base ** (torch.arange(0, self.d, 2).float() / self.d)).to(x.device)
        seq_idx = torch.arange(seq_len, device=x.device).float()
        idx_theta = torch.einsum("n,d->nd", seq_idx, theta)
        idx_theta2 = torch.cat([idx_theta, idx_theta], dim=1)
        self.cos_cached = idx_theta2.cos()[:, None, None, :]
        self.sin_cached = idx_theta2.sin()[:, None, None, :]

    def _neg_half(self, x):
        d_2 = self.d // 2
        return torch.cat([-x[:, :, :, d_2:], x[:, :, :, :d_2]], dim=-1)

    def forward(self, x):
        x = x.permute(2, 0, 1, 3)  # [B, H, T, D] -> [T, B, H, D]
        self._build_cache(x)
        x_rope, x_pass = x[..., : self.d], x[..., self.d :]
        neg_half_x = self._neg_half(x_rope)
        x_rope = (x_rope * self.cos_cached[: x.shape[0]]) + (neg_half_x * self.sin_cached[: x.shape[0]])
        return torch.cat((x_rope, x_pass), dim=-1).permute(1, 2, 0, 3)
'''

RopePattern.FUSE += [
    Fuse(
        name="labml_partial_rotary_local_split_point",
        code=_LABML_PARTIAL,
        expect={"mode": "half", "qualname": "RotaryPositionalEmbeddings.forward"},
        run='''
x = torch.randn(2, 3, 6, 16, requires_grad=True)
m = RotaryPositionalEmbeddings(8)
out = (m(x), RotaryPositionalEmbeddings(16)(x.to(torch.bfloat16)))
leaves = [x]
''',
    ),
]

# s32: the named rotated parts are not the statements right before the joining cat (another statement between):
# the fused call replaces the cat and reads x and the tables at the site, so nothing it reads may be bound again
# since the parts were computed
_PARTS_THEN_OTHER = '''
import torch


def rope_parts(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    n = x.shape[0]
    return torch.cat([y1, y2], dim=-1), n
'''

RopePattern.FUSE += [
    Fuse(
        name="named_parts_not_right_before_the_cat",
        code=_PARTS_THEN_OTHER,
        expect={"mode": "half", "qualname": "rope_parts"},
        run='''
ang = torch.arange(5).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
x = torch.randn(2, 3, 5, 8, requires_grad=True)
out = rope_parts(x, ang.cos(), ang.sin())[0]
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the table is bound again between the parts and the cat: at the site ``cos`` is another tensor
        _PARTS_THEN_OTHER.replace("    n = x.shape[0]\n", "    cos = cos * 2\n    n = x.shape[0]\n").replace(
            "return torch.cat([y1, y2], dim=-1), n", "return torch.cat([y1, y2], dim=-1), n, cos"),
        reason="is bound again",
        name="named_parts_then_table_rebound",
    ),
]

# s32: einops pairs around the complex product: ``rearrange(x, "... (d two) -> ... d two", two=2)`` makes the lane
# pairs, ``view_as_real(xc * f)`` is left as [.., D/2, 2] and merged by a later ``rearrange(.., "... d two -> ... (d two)")``
_EINOPS_COMPLEX = '''
import torch
from einops import rearrange


def precompute(n, d):
    freqs = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(torch.arange(n).float(), freqs)
    return torch.polar(torch.ones_like(ang), ang)


def rope(x, freqs_cis):
    xc = torch.view_as_complex(rearrange(x.float(), "... (d two) -> ... d two", two=2))
    out = torch.view_as_real(xc * freqs_cis[:, None, :])
    return rearrange(out, "... d two -> ... (d two)").type_as(x)
'''

RopePattern.FUSE += [
    Fuse(
        name="einops_pairs_complex_merged_later",
        code=_EINOPS_COMPLEX,
        # einops is not a dependency: tests/test_detect_s32_rope.py runs this one under a minimal stand-in
        expect={"mode": "complex", "qualname": "rope"},
    ),
]

RopePattern.KEEP += [
    Keep(
        # the einops view pairs the two halves' lanes ("(two d) -> d two"): x_i with x_{i+D/2}, but written as a
        # strided regrouping this pattern does not read as lane pairs
        _EINOPS_COMPLEX.replace('"... (d two) -> ... d two"', '"... (two d) -> ... d two"'),
        reason="not formed by reshape",
        name="einops_pairs_of_halves_not_lanes",
    ),
]

# s32: the rotation helper is a method of a base class in the module (``self.rotate_half`` found by Python's
# lookup through the bases), the rotating module a subclass
_INHERITED_HELPER = '''
import torch
from torch import nn


class RotaryBase(nn.Module):
    def rotate_half(self, x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)


class Mixin:
    def scale(self):
        return 1.0


class Rotary(Mixin, RotaryBase):
    def forward(self, x, cos, sin):
        return x * cos + self.rotate_half(x) * sin
'''

RopePattern.FUSE += [
    Fuse(
        name="rotation_helper_inherited_from_base",
        code=_INHERITED_HELPER,
        expect={"mode": "half", "qualname": "Rotary.forward"},
        run='''
ang = torch.arange(5).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
emb = torch.cat((ang, ang), dim=-1)
x = torch.randn(2, 3, 5, 8, requires_grad=True)
out = Rotary()(x, emb.cos(), emb.sin())
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the subclass overrides the base's helper with one that is no rotation: the subclass's own method is read
        _INHERITED_HELPER.replace("class Rotary(Mixin, RotaryBase):\n",
                                  "class Rotary(Mixin, RotaryBase):\n    def rotate_half(self, x):\n        return torch.cat((x, x), dim=-1)\n\n"),
        reason="does not compute the standard rotate_half",
        name="rotation_helper_overridden_in_subclass",
    ),
    Keep(
        # a module-level lambda: its body is not verified (npufuse reads def helpers)
        '''
import torch

rotate_half = lambda x: torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin
''',
        reason="is a lambda bound at module level",
        name="rotation_helper_module_lambda",
    ),
]

# s32 (k-diffusion's axial rope): the helper merges the pair axis by a starred unpacking of the shape
# (``*shape, d, r = x.shape; x.view(*shape, d * r)``), read by the numeric probe; partial rotary between two
# pass-through parts, tables with a scale factor
_STARRED_MERGE_HELPER = '''
import torch


def rotate_half(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    *shape, d, r = x.shape
    return x.view(*shape, d * r)


def apply_rotary_emb(freqs, t, start_index=0, scale=1.0):
    freqs = freqs.to(t)
    rot_dim = freqs.shape[-1]
    end_index = start_index + rot_dim
    t_left, t, t_right = t[..., :start_index], t[..., start_index:end_index], t[..., end_index:]
    t = (t * freqs.cos() * scale) + (rotate_half(t) * freqs.sin() * scale)
    return torch.cat((t_left, t, t_right), dim=-1)
'''

RopePattern.FUSE += [
    Fuse(
        name="helper_merges_pairs_by_starred_unpacking",
        code=_STARRED_MERGE_HELPER,
        expect={"mode": "interleave", "qualname": "apply_rotary_emb"},
        run='''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
x = torch.randn(2, 3, 6, 12, requires_grad=True)
out = apply_rotary_emb(ang.repeat_interleave(2, dim=-1), x, start_index=2)
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the lanes stacked the other way (stack(x2, -x1)): a rotation by the opposite angle
        _STARRED_MERGE_HELPER.replace("torch.stack((-x2, x1), dim=-1)", "torch.stack((x2, -x1), dim=-1)"),
        reason="does not compute the standard rotate_half",
        name="helper_merges_pairs_by_starred_unpacking_flipped",
    ),
]

# s32 (AWQ's fused llama / qwen2 attention): the complex numbers are the pairs (x_i, x_{i + D/2}) of the two halves,
# regrouped by ``reshape(*x.shape[:-1], 2, -1).transpose(-2, -1)`` and ungrouped the same way after the product; the
# table lookups sit between the complex views and the products (no statement right before the site to replace)
_AWQ_HALVES_COMPLEX = '''
import torch
from torch import nn


class RoPE(nn.Module):
    def __init__(self, head_dim, max_seq_len):
        super().__init__()
        freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2)[: (head_dim // 2)].float() / head_dim))
        freqs = torch.outer(torch.arange(max_seq_len).float(), freqs)
        self.freqs_cis = nn.Parameter(torch.polar(torch.ones_like(freqs), freqs), requires_grad=False)

    @staticmethod
    def reshape_for_broadcast(freqs_cis, x):
        ndim = x.ndim
        shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
        return freqs_cis.view(*shape)

    def forward(self, xq, xk, start_pos: int, seqlen: int):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], 2, -1).transpose(-2, -1).contiguous())
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], 2, -1).transpose(-2, -1).contiguous())
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]
        freqs_cis = self.reshape_for_broadcast(freqs_cis, xq_).to(xq_.device)
        xq_out = torch.view_as_real(xq_ * freqs_cis).transpose(-2, -1).flatten(3)
        xk_out = torch.view_as_real(xk_ * freqs_cis).transpose(-2, -1).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)
'''

RopePattern.FUSE += [
    Fuse(
        name="complex_pairs_of_halves_regrouped_by_transpose",
        code=_AWQ_HALVES_COMPLEX,
        expect={"mode": "half", "qualname": "RoPE.forward"},
        run='''
xq = torch.randn(2, 5, 4, 16, dtype=torch.float16, requires_grad=True)
xk = torch.randn(2, 5, 2, 16, dtype=torch.float16, requires_grad=True)
out = RoPE(16, 12)(xq, xk, 3, 5)
leaves = [xq, xk]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the regrouping view is sized by another tensor (xk's leading dims for xq): not proven to pair xq's halves
        _AWQ_HALVES_COMPLEX.replace("xq.float().reshape(*xq.shape[:-1], 2, -1)", "xq.float().reshape(*xk.shape[:-1], 2, -1)")
        .replace("xk.float().reshape(*xk.shape[:-1], 2, -1)", "xk.float().reshape(*xq.shape[:-1], 2, -1)"),
        name="complex_pairs_regrouped_by_other_tensor_shape",
    ),
]

# s32 (HF wav2vec2-conformer): the inline rotate_half cut at the head size the caller viewed x with
# (``self.head_size // 2``), x rebound by the site itself, [S, B, N, D] after a transpose, S11D tables
_CONFORMER_INLINE_SPLIT = '''
import torch
from torch import nn


class ConformerSelfAttention(nn.Module):
    def __init__(self, num_heads, head_size):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size

    def _apply_rotary_embedding(self, hidden_states, relative_position_embeddings):
        batch_size, sequence_length, hidden_size = hidden_states.size()
        hidden_states = hidden_states.view(batch_size, sequence_length, self.num_heads, self.head_size)
        cos = relative_position_embeddings[0, :sequence_length, ...]
        sin = relative_position_embeddings[1, :sequence_length, ...]
        hidden_states = hidden_states.transpose(0, 1)
        rotated_states_begin = hidden_states[..., : self.head_size // 2]
        rotated_states_end = hidden_states[..., self.head_size // 2 :]
        rotated_states = torch.cat((-rotated_states_end, rotated_states_begin), dim=rotated_states_begin.ndim - 1)
        hidden_states = (hidden_states * cos) + (rotated_states * sin)
        hidden_states = hidden_states.transpose(0, 1)
        return hidden_states.reshape(batch_size, sequence_length, self.num_heads * self.head_size)


def tables(n, d):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.outer(torch.arange(n).float(), inv)
    emb = torch.cat((f, f), dim=-1)
    return torch.stack([emb.cos()[:, None, None, :], emb.sin()[:, None, None, :]])
'''

RopePattern.FUSE += [
    Fuse(
        name="inline_rotate_half_cut_at_attribute_split",
        code=_CONFORMER_INLINE_SPLIT,
        expect={"mode": "half", "qualname": "ConformerSelfAttention._apply_rotary_embedding"},
        run='''
x = torch.randn(2, 5, 3 * 8, requires_grad=True)
out = ConformerSelfAttention(3, 8)._apply_rotary_embedding(x, tables(7, 8))
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the same halves combined the wrong way round (cat(x2, -x1)): a rotation by the opposite angle
        _CONFORMER_INLINE_SPLIT.replace("torch.cat((-rotated_states_end, rotated_states_begin)",
                                        "torch.cat((rotated_states_end, -rotated_states_begin)"),
        reason="sign flipped",
        name="inline_rotate_half_cut_at_attribute_split_flipped",
    ),
]

# s32 (Pointcept's PointROPE, croco-style): the class is defined twice, a CUDA extension wrapper under ``try:``
# and the PyTorch fallback under ``except``; ``self.rotate_half`` is the fallback's own static method
_TWICE_DEFINED_CLASS = '''
import torch

try:
    from fast_rope_ext import rope_cuda

    class PointRope(torch.nn.Module):
        def forward(self, tokens, positions):
            return rope_cuda(tokens, positions)

except ImportError:

    class PointRope(torch.nn.Module):
        def __init__(self, freq=100.0):
            super().__init__()
            self.base = freq

        def get_cos_sin(self, d, n):
            inv = 1.0 / (self.base ** (torch.arange(0, d, 2).float() / d))
            f = torch.outer(torch.arange(n).float(), inv)
            f = torch.cat((f, f), dim=-1)
            return f.cos(), f.sin()

        @staticmethod
        def rotate_half(x):
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
            return torch.cat((-x2, x1), dim=-1)

        def apply_rope1d(self, tokens, pos1d, cos, sin):
            cos = torch.nn.functional.embedding(pos1d, cos)[:, None, :, :]
            sin = torch.nn.functional.embedding(pos1d, sin)[:, None, :, :]
            return (tokens * cos) + (self.rotate_half(tokens) * sin)

        def forward(self, tokens, positions):
            cos, sin = self.get_cos_sin(tokens.size(3), int(positions.max()) + 1)
            return self.apply_rope1d(tokens, positions, cos, sin)
'''

RopePattern.FUSE += [
    Fuse(
        name="rotation_helper_of_class_defined_twice",
        code=_TWICE_DEFINED_CLASS,
        expect={"mode": "half", "qualname": "PointRope.apply_rope1d"},
        run='''
x = torch.randn(2, 3, 5, 8, requires_grad=True)
pos = torch.tensor([[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]])
out = PointRope()(x, pos)
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the fallback's helper rotates the other way (cat(x2, -x1)): read in the class that holds the call
        _TWICE_DEFINED_CLASS.replace("return torch.cat((-x2, x1), dim=-1)", "return torch.cat((x2, -x1), dim=-1)"),
        reason="sign flipped",
        name="rotation_helper_of_class_defined_twice_flipped",
    ),
    Keep(
        # the local split point is rebound (``d_2 += 1``): no single expression the call site can evaluate, and the
        # halves are not cut at D/2
        _LABML_PARTIAL.replace("        d_2 = self.d // 2\n", "        d_2 = self.d // 2\n        d_2 += 1\n"),
        reason="does not compute the standard rotate_half",
        name="labml_split_point_rebound",
    ),
]


# --- rope s26: the rotated lane pairs stacked and left as [..., D/2, 2] (merged by a later statement) ------

def _merged_next(block: list[ast.stmt], i: int, stmt: ast.stmt) -> bool:
    """s39 (vats' ``RoPE._apply_rope``): ``t = stack([r1, r2], dim=-1)`` whose next statement merges the pair axis
    (``t = t.flatten(-2)`` / ``t.reshape(..)`` / ``t.view(..)``, assigned or returned): a stack of the two rotated parts
    computed before it, the merge in a second statement. Read like a stack left as ``[.., D/2, 2]`` (the fused result
    viewed so, :func:`_unmerged_lane_stack`); the merge runs as written."""
    if i + 1 >= len(block) or not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return False
    nxt = block[i + 1]
    value = nxt.value if isinstance(nxt, (ast.Assign, ast.Return)) else None
    name = stmt.targets[0].id
    merged = _einops_last_two_merged(value)  # s40: einops ``rearrange(t, "b h n d two -> b h n (d two)")``
    if merged is not None:
        return isinstance(merged, ast.Name) and merged.id == name
    # s42: ``reshape_as(x)`` / ``view_as(x)`` too (CS336's ``out.reshape_as(in_query_or_key)``): the fused result is the
    # stacked [.., D/2, 2] tensor itself, so whatever merge follows runs as written
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in ("flatten", "reshape", "view", "reshape_as", "view_as") \
        and isinstance(value.func.value, ast.Name) and value.func.value.id == name


def _s43_merged_here(st_text: str) -> bool:
    """s43 (HO19a ModernBabyBERTa's ``torch.stack([even_rot, odd_rot], dim=-1).reshape_as(x1)``): the stacked lane pairs
    merged by a reshape in the same statement. The stack inside is read as left ``[.., D/2, 2]`` (the fused result viewed
    so, :func:`_unmerged_lane_stack`) and the reshape around it runs as written, as :func:`_merged_next` reads a merge
    in the next statement; this only lets the statement past the text gate (the math is checked as for any stack)."""
    return ".reshape_as(" in st_text or ".view_as(" in st_text or ".reshape(" in st_text or ".view(" in st_text


def _einops_last_two_merged(node: ast.AST | None) -> ast.expr | None:
    """t of einops ``rearrange(t, "P a b -> P (a b)")`` (P the same axes on both sides, named or ``...``, no group;
    keywords only sizes of a / b): the last two axes merged, as ``t.flatten(-2)``; None otherwise."""
    if not (isinstance(node, ast.Call) and (dotted(node.func) or "").split(".")[-1] == "rearrange" and len(node.args) == 2):
        return None
    pattern = const_value(node.args[1])
    if not isinstance(pattern, str) or pattern.count("->") != 1:
        return None
    lhs, rhs = (side.replace("(", " ( ").replace(")", " ) ").split() for side in pattern.split("->"))
    if len(lhs) < 2 or "(" in lhs or rhs != lhs[:-2] + ["(", lhs[-2], lhs[-1], ")"] or lhs[-2] == lhs[-1]:
        return None
    if any(kw.arg not in (lhs[-2], lhs[-1]) for kw in node.keywords):
        return None
    return node.args[0]


def _unmerged_lane_stack(node: ast.Call) -> tuple[ast.expr, ast.expr] | None:
    """(a, b) of ``torch.stack([a, b], dim=-1)`` (the pair axis last, not merged in the same expression:
    Infinity's ``qk = stack([...], -1); qk = qk.reshape(*qk.shape[:-2], -1)``): the caller checks that
    a, b are the written-out rotation of x's even/odd lanes."""
    f = node.func
    if not ((isinstance(f, ast.Attribute) and f.attr == "stack") or isinstance(f, ast.Name)):
        return None  # (cheap: asked of every call in a candidate statement)
    pair = _pair_of(node, _STACK)
    if pair is None:
        return None
    dim = keyword(node, "dim", 1)
    if dim is None:
        dim = keyword(node, "axis")
    return pair if _is_int(dim, -1) else None


# the lane pairs indexed out of a (D/2, 2) view bound to the same name, tables written first in each
# product, the stacked pairs left as [.., D/2, 2] for a later reshape; q and k rotated together as one
# stacked tensor (5-D: the fused call does not take it, the original runs there) or one at a time (4-D)
_STACKED_LANES = '''
import torch


def turn_pairs(x, table):
    n = x.shape[-2]
    t = table[..., :n, :]
    x = x.reshape(*x.shape[:-1], -1, 2)
    x = torch.stack([
        t[0] * x[..., 0] - t[1] * x[..., 1],
        t[1] * x[..., 0] + t[0] * x[..., 1],
    ], dim=-1)
    return x.reshape(*x.shape[:-2], -1)


def turn_qk(q, k, table):
    qk = turn_pairs(torch.stack((q, k), dim=0), table[:, None])
    return qk.unbind(0)
'''

_STACKED_LANES_RUN = '''
S, D = 6, 8
ang = torch.outer(torch.arange(S).float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
table = torch.stack((ang.cos(), ang.sin()))[:, None, None]  # [2, 1, 1, S, D/2]
q = torch.randn(2, 3, S, D, requires_grad=True)
k = torch.randn(2, 3, S, D, requires_grad=True)
out = (turn_pairs(q, table), turn_pairs(k.to(torch.bfloat16), table), turn_qk(q, k, table))
leaves = [q, k]
'''

RopePattern.FUSE += [
    Fuse(
        name="stacked_lane_pairs_left_unmerged",
        code=_STACKED_LANES,
        expect={"mode": "interleave", "qualname": "turn_pairs", "variant": "interleave_tables_checked"},
        run=_STACKED_LANES_RUN,
    ),
]

RopePattern.KEEP += [
    Keep(
        # the second lane's sign is flipped: the conjugate product (a rotation by -angle), not cos/sin as given
        _STACKED_LANES.replace("t[1] * x[..., 0] + t[0] * x[..., 1]", "-t[1] * x[..., 0] + t[0] * x[..., 1]"),
        name="stacked_lane_pairs_conjugate",
    ),
    Keep(
        # x is rebound between the pairs view and the rotation: the lanes are not x's any more
        _STACKED_LANES.replace("    x = x.reshape(*x.shape[:-1], -1, 2)\n", "    xs = x.reshape(*x.shape[:-1], -1, 2)\n    x = x * 2\n")
        .replace("x[..., 0]", "xs[..., 0]").replace("x[..., 1]", "xs[..., 1]"),
        name="stacked_lane_pairs_of_an_older_binding",
    ),
]


# the real and imaginary parts named first, then stacked (pair axis last) and reshaped by the caller's
# own code (kept): the fused result is given the [.., D/2, 2] layout the stack had
_NAMED_PARTS_STACKED = '''
import torch


def table_for(cs, x):
    shape = [1 if i != 1 and i != x.ndim - 2 else d for i, d in enumerate(x.shape[:-1])] + [2]
    return cs.view(*shape)


def rotate_qk(q, k, cs):
    q = q.float().reshape(*q.shape[:-1], -1, 2)
    k = k.float().reshape(*k.shape[:-1], -1, 2)
    cs = table_for(cs, q)
    q_re = q[..., 0] * cs[..., 0] - q[..., 1] * cs[..., 1]
    q_im = q[..., 0] * cs[..., 1] + q[..., 1] * cs[..., 0]
    k_re = k[..., 0] * cs[..., 0] - k[..., 1] * cs[..., 1]
    k_im = k[..., 0] * cs[..., 1] + k[..., 1] * cs[..., 0]
    q_out = torch.stack((q_re, q_im), dim=-1).reshape(q.shape).flatten(3)
    k_out = torch.stack((k_re, k_im), dim=-1).reshape(k.shape).flatten(3)
    return q_out, k_out
'''

RopePattern.FUSE += [
    Fuse(
        name="named_parts_stacked_unmerged",
        code=_NAMED_PARTS_STACKED,
        expect={"mode": "interleave", "qualname": "rotate_qk"},
        run='''
S, D = 5, 8
ang = torch.outer(torch.arange(S).float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
cs = torch.stack((ang.cos(), ang.sin()), dim=-1)
q = torch.randn(2, S, 3, D, requires_grad=True)
k = torch.randn(2, S, 3, D, requires_grad=True)
out = (rotate_qk(q, k, cs), rotate_qk(q.to(torch.bfloat16), k, cs))
leaves = [q, k]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the imaginary part reads the real lane twice: not a rotation of the pairs
        _NAMED_PARTS_STACKED.replace("q_im = q[..., 0] * cs[..., 1] + q[..., 1] * cs[..., 0]",
                                     "q_im = q[..., 0] * cs[..., 1] + q[..., 0] * cs[..., 0]")
        .replace("    k_out = torch.stack((k_re, k_im), dim=-1).reshape(k.shape).flatten(3)\n", "    k_out = k\n"),
        name="named_parts_not_a_rotation",
    ),
]


# --- rope s26: ``view_as_complex`` made by a one-line helper (``to_complex(q)`` / ``self.real_to_complex(x)``) ---

def _complex_value(module: ModuleInfo, scope: Scope, xc: ast.expr) -> ast.expr:
    """xc's value through local names; a call of a helper (nested def, module function, method of this
    class) whose only statement is ``return torch.view_as_complex(<expr of its one parameter>)`` is given
    as that return with the call's argument in place of the parameter (the helper's own nodes lose their
    positions, so the text written for them is the substituted code, not the helper's)."""
    val = _resolve(scope, xc)
    if not (isinstance(val, ast.Call) and len(val.args) == 1 and not val.keywords and not isinstance(val.args[0], ast.Starred)):
        return val
    if ast.unparse(val.func).endswith("view_as_complex"):
        return val
    fn, _name = _helper_def(module, scope, val.func)
    if fn is None:
        return val
    params = [a.arg for a in fn.args.args]
    if isinstance(val.func, ast.Attribute) and params and params[0] in ("self", "cls") \
            and not any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
        params = params[1:]
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    if len(params) != 1 or fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or len(body) != 1 or not isinstance(body[0], ast.Return):
        return val
    ret = body[0].value
    if not (isinstance(ret, ast.Call) and ast.unparse(ret.func).endswith("view_as_complex") and len(ret.args) == 1):
        return val
    pname = params[0]
    if any(isinstance(n, ast.Name) and n.id not in (pname, "torch") for n in ast.walk(ret)):
        return val  # the helper reads something besides its parameter: not inlined

    class _Inline(ast.NodeTransformer):
        def visit_Name(self, n: ast.Name) -> ast.AST:
            return copy.deepcopy(val.args[0]) if n.id == pname else n

    inlined = _Inline().visit(copy.deepcopy(ret))
    # strip the helper's positions (not the argument's, whose names resolve at the call's line)
    keep = set()
    for n in ast.walk(inlined):
        if isinstance(n, ast.expr) and same_expr(n, val.args[0]) and getattr(n, "lineno", None) == getattr(val.args[0], "lineno", None):
            keep.update(id(m) for m in ast.walk(n))
    for n in ast.walk(inlined):
        if id(n) not in keep:
            for attr in ("lineno", "end_lineno", "col_offset", "end_col_offset"):
                if hasattr(n, attr):
                    delattr(n, attr)
    inlined.lineno = val.lineno  # (read as the line the pairs are formed at)
    return inlined


# the complex numbers made by a one-line helper (nested def; a method), the product bound or inline
# the toy module both complex-helper examples share: q and k made complex by a nested helper, rotated by f
_COMPLEX_HELPER_FN = '''
import torch


def spin(q, k, f):
    def as_pairs(t):
        return torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))

    qc = as_pairs(q)
    kc = as_pairs(k)
    q_out = torch.view_as_real(qc * f).flatten(3)
    k_out = torch.view_as_real(kc * f).flatten(3)
    return q_out.type_as(q), k_out.type_as(k)
'''

_COMPLEX_BY_HELPER = _COMPLEX_HELPER_FN + '''

class Spin:
    def to_c(self, t):
        return torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2))

    def forward(self, q, f):
        z = self.to_c(q.float())
        z = z * f
        return torch.view_as_real(z).flatten(-2).type_as(q)
'''

# their run: [B, S, N, D] q and k, f a [1, S, 1, D/2] complex table
_COMPLEX_HELPER_RUN = '''
S, D = 5, 8
ang = torch.outer(torch.arange(S).float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
f = torch.polar(torch.ones_like(ang), ang)[None, :, None, :]
q = torch.randn(2, S, 3, D, requires_grad=True)
k = torch.randn(2, S, 3, D, requires_grad=True)
'''

RopePattern.FUSE += [
    Fuse(
        name="complex_made_by_a_helper",
        code=_COMPLEX_BY_HELPER,
        expect={"mode": "complex", "qualname": "spin"},
        run=_COMPLEX_HELPER_RUN + '''
out = (spin(q, k, f), Spin().forward(q, f), Spin().forward(q.to(torch.bfloat16), f))
leaves = [q, k]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the helper pairs x_i with x_{i+D/2} (a transpose of a (2, D/2) view): not the lane pairs
        _COMPLEX_BY_HELPER.replace("t.float().reshape(*t.shape[:-1], -1, 2)", "t.float().reshape(*t.shape[:-1], 2, -1).transpose(-1, -2)")
        .replace("        return torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2))", "        return torch.view_as_complex(t.reshape(*t.shape[:-1], 2, -1).transpose(-1, -2))"),
        reason="pairs are not formed by reshape(..., -1, 2) on the last dim",
        name="complex_helper_pairs_of_halves",
    ),
]


# both products first, then both real views (the products' statements go with the sites as one run)
_COMPLEX_PRODUCTS_FIRST = _COMPLEX_HELPER_FN.replace("def spin(", "def apply(").replace(
    "    q_out = torch.view_as_real(qc * f).flatten(3)\n    k_out = torch.view_as_real(kc * f).flatten(3)\n"
    "    return q_out.type_as(q), k_out.type_as(k)\n",
    "    qr = qc * f\n    kr = kc * f\n    qr = torch.view_as_real(qr).flatten(-2)\n    kr = torch.view_as_real(kr).flatten(-2)\n"
    "    return qr.type_as(q), kr.type_as(k)\n")

RopePattern.FUSE += [
    Fuse(
        name="complex_products_first_then_real_views",
        code=_COMPLEX_PRODUCTS_FIRST,
        expect={"mode": "complex", "qualname": "apply"},
        run=_COMPLEX_HELPER_RUN + '''
out = (apply(q, k, f), apply(q.to(torch.bfloat16), k, f[:, :, :, :]))
leaves = [q, k]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # kc is rebound between k's product and its real view: the fused call would rotate another value
        _COMPLEX_PRODUCTS_FIRST.replace("    kr = torch.view_as_real(kr).flatten(-2)\n",
                                        "    kc = kc * 2\n    kr = torch.view_as_real(kr).flatten(-2)\n")
        .replace("    qr = torch.view_as_real(qr).flatten(-2)\n", "    qr = torch.view_as_real(qr)\n"),
        name="complex_product_operand_rebound_before_the_view",
    ),
]


# --- rope s27: x above 4-D (q and k stacked into one 5-D tensor) runs fused with its leading axes merged ---

def _merged_lead_rank_ok(m: _Match, rank_ok: str, rank: str, lead: str) -> str:
    """``rank_ok`` (x at most 4-D) widened to a higher rank of x whose leading axes (all but the last
    three) can be merged into one: the eager product broadcasts cos/sin from the right, so where they
    are 1 along those axes (and have no more axes than x) every merged row sees the same table, which
    is the 4-D call npu_rotary_mul takes; the merged size must stay below 1000 (spec 4.1: B < 1000).
    ``rank`` is x's rank and ``lead`` x's leading axes as expressions of names bound before the site.
    Only where cos/sin are names bound before the run-time test (the caller's, or prepared ones that
    are hoisted above it); else ``rank_ok`` is returned as is."""
    def bound_before(t: str) -> bool:
        if not (_is_name(t) and "." not in t):
            return False
        return not t.startswith("_npufuse_") or any(p.startswith((f"{t} =", f"{t}, ")) for p in m.prep)
    if not (bound_before(m.cos) and bound_before(m.sin)):
        return rank_ok
    c, s = m.cos, m.sin
    high = (f"({rank} <= 8 and {c}.dim() <= {rank} and {s}.dim() <= {rank} and {c}.shape[:-3].numel() == 1 "
            f"and {s}.shape[:-3].numel() == 1 and {lead}.numel() < 1000)")
    m.merge_lead = True
    if m.table_rank_check and m.only_if is not None:
        # the interleave run-time check refused tables above 4-D: their merged 4-D view is checked instead
        # (the table may be above 4-D only where x is, the test above)
        m.only_if = m.only_if.replace(m.table_rank_check, f"({m.table_rank_check} or {rank} > 4)", 1)
    return f"({rank_ok} or {high})"


def _merged_lead_call(x: str, c: str, s: str) -> tuple[str, str, str, str]:
    """x, cos, sin as npu_rotary_mul's 4-D arguments and the suffix restoring x's shape: up to 4-D the
    leading 1s of the eager broadcast (indexed away after), above 4-D x's leading axes merged into one
    and cos/sin (1 there, checked before) reshaped alike, unflattened after."""
    lead = f"max({x}.dim() - 4, 0)"
    x4 = f"{x}[(None,) * (4 - {x}.dim())].flatten(0, {lead})"
    c4 = f"{c}[(None,) * (max({x}.dim(), 4) - {c}.dim())].flatten(0, {lead})"
    s4 = f"{s}[(None,) * (max({x}.dim(), 4) - {s}.dim())].flatten(0, {lead})"
    suffix = f"[(0,) * (4 - {x}.dim())].unflatten(0, {x}.shape[:-3] if {x}.dim() > 4 else (-1,))"
    return x4, c4, s4, suffix


# --- rope s27: several rotations in one branch of a flag's ``if`` (q and k under ``if not interleave:``) ---

def _branch_of(anchor: ast.If, site: ast.stmt) -> list[ast.stmt] | None:
    """The branch of ``anchor`` (body or else) holding ``site`` as a direct statement."""
    for branch in (anchor.body, anchor.orelse):
        if any(st is site for st in branch):
            return branch
    return None


def _anchor_group(pat: "RopePattern", module: ModuleInfo, scope: Scope, first: _Match, block: list[ast.stmt],
                  i: int) -> tuple[int, list[_Match], set[int]] | str | None:
    """Every rotation in the branch of ``first``'s flag ``if`` (eole's ``if interleave: ... else:`` cutting
    q's AND k's halves, then recombining both): (index in ``block`` of the first statement the sites
    absorb, the matches in branch order, ids of the branch statements handled here), or None where the
    branch holds one site (the one-statement path handles it) or a statement this cannot vouch for: a
    second rotation that is refused or fused under another condition, a site's parts that are not all
    written right before the ``if``. The fused path is the branch itself with each site replaced, so
    other statements of the branch run there unchanged."""
    anchor, site = first.anchor, first.site_stmt
    if not isinstance(anchor, ast.If) or site is None:
        return None
    branch = _branch_of(anchor, site)
    if branch is None or len(branch) < 2:
        return None
    group: list[_Match] = []
    for st in branch:
        if not isinstance(st, (ast.Assign, ast.AnnAssign, ast.Return, ast.Expr, ast.AugAssign)):
            if any(isinstance(n, (ast.Call, ast.BinOp)) for n in fast_walk(st)) and "*" in segment(module, st):
                return None  # a compound statement that may hold a rotation of its own: not vouched for
            continue
        if st is site:
            group.append(first)
            continue
        found: list[_Match] = []
        for node in pat._candidates(st, scope):
            res = pat._match(module, scope, node)
            if isinstance(res, str):
                return None
            if res is not None:
                found.append(res)
        if not found:
            continue
        if len(found) != 1 or found[0].anchor is not anchor or found[0].site_stmt is not st or found[0].only_if is None \
                or not found[0].only_if.startswith(first.only_if.split(" and ")[0]):
            return None
        group.append(found[0])
    ids = {id(a) for m in group for a in m.absorb}
    start = i - len(ids)
    if start < 0 or {id(b) for b in block[start:i]} != ids:
        if not ids:
            return None
        parts = ", ".join(f"`{segment(module, a.targets[0])}`" for m in group for a in m.absorb if isinstance(a, ast.Assign))
        return (f"the rotated parts {parts} are not the statements right before `if {ast.unparse(anchor.test)}:` (other "
                "statements stand between them): the fused branch would have to drop statements it does not replace")
    if len(group) < 2:
        return None
    return start, group, {id(st) for st in branch}


def _branch_with_sites(module: ModuleInfo, matches: list[_Match], reps: list[tuple[ast.AST, str]]) -> list[str]:
    """The flag's branch with each site's rotation replaced by its fused call (statements of the branch
    without a site kept verbatim), in the branch's order."""
    first = matches[0]
    branch = _branch_of(first.anchor, first.site_stmt)  # type: ignore[arg-type]
    by_node = {id(n): r for n, r in reps}
    out: list[str] = []
    for st in branch or []:
        mine = [(m.node, by_node[id(m.node)]) for m in matches if m.site_stmt is st and id(m.node) in by_node]
        out.append(replace_segments(module, st, mine))
    return out


# q and k cut into halves (or lane pairs) under one flag, rotated by one shared formula, recombined under the
# same flag: the halves branch holds both sites and is fused as a whole; the lane-pair branch keeps the original
_FLAG_BRANCH_QK = '''
import torch


def turn(q, k, cs, interleave: bool):
    n = cs.size(1)
    q_rot, q_rest = q[..., :n], q[..., n:]
    k_rot, k_rest = k[..., :n], k[..., n:]
    if interleave:
        q1, q2 = q_rot.unflatten(-1, (-1, 2)).unbind(-1)
        k1, k2 = k_rot.unflatten(-1, (-1, 2)).unbind(-1)
    else:
        h = n // 2
        q1, q2 = q_rot[..., :h], q_rot[..., h:]
        k1, k2 = k_rot[..., :h], k_rot[..., h:]
    c = cs[None, :, None, : n // 2]
    s = cs[None, :, None, n // 2 :]
    qa = q1 * c - q2 * s
    qb = q1 * s + q2 * c
    ka = k1 * c - k2 * s
    kb = k1 * s + k2 * c
    if interleave:
        qo = torch.stack((qa, qb), dim=-1).flatten(-2)
        ko = torch.stack((ka, kb), dim=-1).flatten(-2)
    else:
        qo = torch.cat((qa, qb), dim=-1)
        ko = torch.cat((ka, kb), dim=-1)
    return torch.cat((qo, q_rest), dim=-1), torch.cat((ko, k_rest), dim=-1)
'''

_FLAG_BRANCH_QK_RUN = '''
S, D, R = 5, 12, 8
ang = torch.outer(torch.arange(S).float(), 1.0 / (10000 ** (torch.arange(0, R, 2).float() / R)))
cs = torch.cat((ang.cos(), ang.sin()), dim=-1)  # [S, R]: cos | sin, half-size each
q = torch.randn(2, S, 3, D, requires_grad=True)
k = torch.randn(2, S, 1, D, requires_grad=True)
out = (turn(q, k, cs, False), turn(q, k, cs, True))
leaves = [q, k]
'''

RopePattern.FUSE += [
    Fuse(
        name="flag_branch_q_and_k_halves",
        code=_FLAG_BRANCH_QK,
        expect={"mode": "half", "qualname": "turn", "variant": "halves_split_checked", "targets": ["q_rot", "k_rot"]},
        run=_FLAG_BRANCH_QK_RUN,
    ),
    Fuse(
        # a statement of the branch that is no rotation runs on the fused path too (kept verbatim)
        name="flag_branch_q_and_k_halves_with_other_statement",
        code=_FLAG_BRANCH_QK.replace("        ko = torch.cat((ka, kb), dim=-1)\n",
                                     "        ko = torch.cat((ka, kb), dim=-1)\n        qo = qo * 2\n"),
        expect={"mode": "half", "qualname": "turn"},
        run=_FLAG_BRANCH_QK_RUN,
    ),
]

RopePattern.KEEP += [
    Keep(
        # k's second half is rotated with the wrong sign (ka = k1*c + k2*s): the branch holds a product that is
        # no rotation beside q's, so the branch is not fused at all
        _FLAG_BRANCH_QK.replace("ka = k1 * c - k2 * s", "ka = k1 * c + k2 * s"),
        reason="are not the statements right before `if interleave:`",
        name="flag_branch_second_site_not_a_rotation",
    ),
    Keep(
        # the flag is reassigned in the function: the two ``if interleave:`` may take different paths
        _FLAG_BRANCH_QK.replace("    n = cs.size(1)\n", "    n = cs.size(1)\n    interleave = n > 64 or interleave\n"),
        name="flag_branch_flag_not_stable",
    ),
]


# --- rope s27: a rotation bound on a branch (``if mode == 'adjacent': x2 = <pairs> elif ...: x2 = <halves>``) ---

def _on_its_branch(scope: Scope, name: ast.Name, rot: _Rotation, module: ModuleInfo | None = None,
                   x: ast.expr | None = None) -> _Rotation:
    """``rot`` (the rotation ``name`` was resolved to: its textually last binding before the use) valid only
    where that binding is the one reaching the use. Bound outside any branch: as is. Bound under ``if``
    statements whose tests read the same at the use (stable: no calls, no names this scope rebinds): the
    rotation holds where those tests take the binding's path, so the fused code runs under that
    condition and the original elsewhere. Bound in a loop / with / try, or under a test that may change:
    not a rotation this can vouch for."""
    if not _bound_on_a_branch(scope, name):
        return rot
    line = getattr(name, "lineno", 0)
    defs = [st for st, _v in scope.assignments.get(name.id, []) if st.lineno < line]
    use = _stmt_of(scope, name)
    if not defs or use is None:
        return _Rotation(None)
    around_use = {id(o) for o, _b, _c in _if_path(scope, use[2])}
    conds: list[str] = []
    for owner, in_body, _child in _if_path(scope, defs[-1]):
        if id(owner) in around_use:
            continue
        if not isinstance(owner, ast.If) or not _stable_test(scope, owner.test):
            return _Rotation(None, f"the rotation `{name.id}` is bound on a branch (line {defs[-1].lineno}) whose test may read "
                                   "differently at the site, or inside a loop / with / try: which binding reaches the site is not known")
        test = ast.unparse(owner.test)
        conds.append(test if in_body else f"not ({test})")
    if not conds:
        return rot
    path_if = " and ".join(f"({c})" for c in reversed(conds))
    other = _other_branch_rotation(scope, name, defs, module, x) if module is not None and x is not None else None
    if other is not None:
        # the name is bound on both paths of one ``if``/``elif`` (diffusers' ``use_real_unbind_dim == -1`` lane pairs,
        # ``== -2`` halves): each path is fused with its own rotary_mode, chosen by the same test at run time
        kind, cond = other
        both = f"(({cond}) or ({path_if}))"  # one atom: callers join it with ``and``
        if kind == rot.kind:
            return dataclasses.replace(rot, path_if=both)
        half_if = cond if kind == "half" else path_if
        return dataclasses.replace(rot, kind="interleave", path_if=both, mode_expr=f'"{kind}" if {cond} else "{rot.kind}"', half_if=half_if)
    return dataclasses.replace(rot, path_if=path_if)


def _other_branch_rotation(scope: Scope, name: ast.Name, defs: list[ast.stmt], module: ModuleInfo, x: ast.expr) -> tuple[str, str] | None:
    """(kind, path condition) of the binding of ``name`` on the other path of the ``if`` whose ``else`` holds
    its last binding: exactly two bindings before the use, the first in the body of an ``if`` (stable tests
    on its path) and the last under that ``if``'s else (elif); the first must be a rotation of x too."""
    binds = [(st, v) for st, v in scope.assignments.get(name.id, []) if st.lineno < (getattr(name, "lineno", 0))]
    if len(binds) != 2 or len(defs) != 2 or not isinstance(binds[0][0], ast.Assign):
        return None
    first_path = _if_path(scope, binds[0][0])
    if not first_path or not isinstance(first_path[0][0], ast.If) or not first_path[0][1]:
        return None
    owner = first_path[0][0]
    if not any(o is owner and not in_body for o, in_body, _c in _if_path(scope, defs[-1])):
        return None  # the last binding is not on the else side of the same ``if``
    use = _stmt_of(scope, name)
    around_use = {id(o) for o, _b, _c in _if_path(scope, use[2])} if use is not None else set()
    conds = []
    for o, in_body, _c in first_path:
        if id(o) in around_use:
            continue
        if not isinstance(o, ast.If) or not _stable_test(scope, o.test):
            return None
        test = ast.unparse(o.test)
        conds.append(test if in_body else f"not ({test})")
    kind = _rotation_expr(scope, binds[0][1], lambda n: same_expr(n, x), module).kind
    if kind is None or not conds:
        return None
    return kind, " and ".join(f"({c})" for c in reversed(conds))


def _add_path_condition(m: _Match, rot: _Rotation) -> None:
    """Fuse ``m`` only where its rotation's binding is the one on the path taken (checked first: the
    other conditions may read names bound on that path only)."""
    m.only_if = rot.path_if if m.only_if is None else f"({rot.path_if}) and ({m.only_if})"
    note = f"the rotation is bound under `{rot.path_if}`: fused there, the other paths keep the original code"
    m.only_note = f"{note}; {m.only_note}" if m.only_note else note


# the rotation named on the branches of a mode test (pairs on one, halves on the other): the site is fused
# under the path of the binding that reaches it (the last one), the other path runs the original code
_BRANCH_BOUND_ROTATION = '''
import torch


class Pos(torch.nn.Module):
    def __init__(self, rank: str):
        super().__init__()
        self.rank = rank

    def forward(self, x, cos, sin):
        if self.rank == "pairs":
            x2 = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape_as(x)
        elif self.rank == "halves":
            x2 = torch.cat([-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]], dim=-1)
        return x * cos + x2 * sin
'''

RopePattern.FUSE += [
    Fuse(
        name="rotation_bound_on_a_mode_branch",
        code=_BRANCH_BOUND_ROTATION,
        expect={"mode": "half", "qualname": "Pos.forward"},
        run='''
S, D = 5, 8
ang = torch.outer(torch.arange(S).float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
cos_h, sin_h = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
cos_p, sin_p = ang.repeat_interleave(2, -1).cos(), ang.repeat_interleave(2, -1).sin()
x = torch.randn(2, 3, S, D, requires_grad=True)
out = (Pos("halves")(x, cos_h, sin_h), Pos("pairs")(x, cos_p, sin_p))
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the mode is a local name rebound in the function: the test may read differently at the site
        _BRANCH_BOUND_ROTATION.replace("    def forward(self, x, cos, sin):\n",
                                       "    def forward(self, x, cos, sin):\n        rank = self.rank\n")
        .replace("if self.rank ==", "if rank ==").replace("elif self.rank ==", "elif rank =="),
        reason="is bound on a branch (line 15) whose test may read differently at the site",
        name="rotation_bound_on_an_unstable_branch",
    ),
]


# --- rope s27: the rotated parts each cast alike where they are named (``a = (x1*c - x2*s).type_as(x)``) ---

def _common_part_cast(scope: Scope, defs: list[tuple[ast.stmt, ast.expr]], site_line: int) -> str:
    """The one cast (``.type_as(x)``, ``.to(torch.bfloat16)``, ``.float()``...) wrapping both named parts'
    values, as a suffix for the fused result ("" if they differ or are not cast): casting each part
    before they are joined is casting the joined result (cast and cat/stack commute elementwise). The
    names the cast reads must not be rebound between the parts and the site (it is evaluated there)."""
    stripped = [strip_casts(v) for _st, v in defs]
    # the cast as written after its operand (strip_casts' text assumes an unparenthesised operand)
    casts = [[ast.unparse(ast.Call(func=ast.Attribute(value=ast.Name("_"), attr=v.func.attr), args=v.args, keywords=v.keywords))[1:]]
             if c else [] for (_st, v), (_i, c) in zip(defs, stripped)]  # type: ignore[attr-defined]
    if not casts[0] or casts[0] != casts[1] or len(stripped[0][1]) != 1 or len(stripped[1][1]) != 1:
        return ""
    cast_node = defs[0][1]
    first = min(st.lineno for st, _v in defs)
    for n in fast_walk(cast_node):
        if isinstance(n, ast.Name) and n is not stripped[0][0] and \
                any(first <= b.lineno < site_line for b, _v in scope.assignments.get(n.id, [])):
            if any(n is m for m in fast_walk(stripped[0][0])):
                continue  # a name of the rotated expression itself, not of the cast
            return ""
    return casts[0][0]


_PARTS_CAST_ALIKE = '''
import torch


def turn_lanes(x, fc, fs):
    ev = x[..., 0::2]
    od = x[..., 1::2]
    re_part = (ev * fc - od * fs).type_as(x)
    im_part = (ev * fs + od * fc).type_as(x)
    return torch.stack([re_part, im_part], dim=-1).flatten(-2)


def turn_halves(x, c, s):
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    y1 = (x1 * c - x2 * s).to(torch.bfloat16)
    y2 = (x2 * c + x1 * s).to(torch.bfloat16)
    return torch.cat((y1, y2), dim=-1)
'''

RopePattern.FUSE += [
    Fuse(
        name="named_parts_cast_alike_lanes",
        code=_PARTS_CAST_ALIKE,
        expect={"mode": "interleave", "qualname": "turn_lanes"},
        run='''
S, D = 5, 8
ang = torch.outer(torch.arange(S).float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
x = torch.randn(2, 3, S, D).bfloat16().requires_grad_()
out = (turn_lanes(x, ang.cos(), ang.sin()), turn_halves(x, ang.cos(), ang.sin()))
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the two parts take different casts: the joined tensor has no one dtype (torch.stack promotes)
        _PARTS_CAST_ALIKE.replace("im_part = (ev * fs + od * fc).type_as(x)", "im_part = (ev * fs + od * fc).float()")
        .replace("y2 = (x2 * c + x1 * s).to(torch.bfloat16)", "y2 = (x2 * c + x1 * s).to(torch.float16)"),
        reason="are products cast differently",
        name="named_parts_cast_differently",
    ),
]


# --- rope s27: ``x.float() * cos + R(x) * sin`` where the helper R upcasts inside (``x.float().reshape(..)``) ---

_FP32_CASTS = {".float()", ".to(torch.float32)", ".to(dtype=torch.float32)", ".type(torch.float32)", ".to(torch.float)"}


def _upcast_helper_rotation(module: ModuleInfo, scope: Scope, node: ast.expr, x: ast.expr) -> _Rotation | None:
    """The rotation of ``x = t.float()`` written as ``R(t)`` with a helper R that rotates ``t.float()`` itself
    (JoyImage's ``xq.float() * cos + _rotate_half(xq) * sin``): R(t) is then R(t.float()) exactly (the helper's
    result is fp32 whatever t's dtype), so it is the rotation of x. None where that does not hold."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(x, ast.Call)):
        return None
    x_inner, x_casts = strip_casts(x)
    if len(x_casts) != 1 or not same_expr(node.args[0], x_inner) or strip_casts(node)[1]:
        return None
    cast = ast.unparse(ast.Call(func=ast.Attribute(value=ast.Name("_"), attr=x.func.attr), args=x.args, keywords=x.keywords))[1:]  # type: ignore[attr-defined]
    if cast.replace(" ", "") not in {c.replace(" ", "") for c in _FP32_CASTS}:
        return None
    rot = _rotation_call(module, scope, node, x_inner)
    return rot if rot.kind is not None and rot.upcast else None


_UPCAST_INSIDE_HELPER = '''
import torch


def spin(xq, xk, cos, sin):
    def _turn(t):
        re_, im_ = t.float().reshape(*t.shape[:-1], -1, 2).unbind(-1)
        return torch.stack([-im_, re_], dim=-1).flatten(-2)

    xq_out = (xq.float() * cos + _turn(xq) * sin).type_as(xq)
    xk_out = (xk.float() * cos + _turn(xk) * sin).type_as(xk)
    return xq_out, xk_out
'''

RopePattern.FUSE += [
    Fuse(
        name="upcast_inside_the_helper",
        code=_UPCAST_INSIDE_HELPER,
        expect={"mode": "interleave", "qualname": "spin"},
        run='''
S, D = 5, 8
ang = torch.outer(torch.arange(S).float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
cos, sin = ang.repeat_interleave(2, -1).cos()[None, None], ang.repeat_interleave(2, -1).sin()[None, None]
q = torch.randn(2, 3, S, D).bfloat16().requires_grad_()
k = torch.randn(2, 3, S, D).bfloat16().requires_grad_()
out = spin(q, k, cos, sin)
leaves = [q, k]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the plain term is cast to fp16, the helper rotates in fp32: not the same tensor rotated
        _UPCAST_INSIDE_HELPER.replace("xq_out = (xq.float() * cos", "xq_out = (xq.half() * cos")
        .replace("xk_out = (xk.float() * cos", "xk_out = (xk.half() * cos"),
        name="upcast_inside_the_helper_other_cast",
    ),
]


# the rotated copy bound on both paths of one if/elif (lane pairs under one test, halves under the other):
# each path fused with its own rotary_mode, the test choosing it at run time
_BRANCH_BOUND_BOTH_PATHS = '''
import torch


def apply(x, cos, sin, unbind_dim: int = -1):
    cos = cos[None, None]
    sin = sin[None, None]
    if unbind_dim == -1:
        x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    elif unbind_dim == -2:
        x_real, x_imag = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)
        x_rotated = torch.cat([-x_imag, x_real], dim=-1)
    else:
        raise ValueError(unbind_dim)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)
'''

RopePattern.FUSE += [
    Fuse(
        name="rotation_bound_on_both_paths_of_an_if",
        code=_BRANCH_BOUND_BOTH_PATHS,
        expect={"qualname": "apply", "variant": "rotation_chosen_at_run_time"},
        run='''
S, D = 5, 8
ang = torch.outer(torch.arange(S).float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
x = torch.randn(2, 3, S, D).bfloat16().requires_grad_()
pairs = ang.repeat_interleave(2, -1)
halves = torch.cat((ang, ang), -1)
out = (apply(x, pairs.cos(), pairs.sin(), -1), apply(x, halves.cos(), halves.sin(), -2))
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the halves path's sign is flipped (cat([x_imag, -x_real]): the rotation by -angle, not cos/sin as given):
        # the binding that reaches the site on that path is no rotation, so neither path is fused
        _BRANCH_BOUND_BOTH_PATHS.replace("torch.cat([-x_imag, x_real], dim=-1)", "torch.cat([x_imag, -x_real], dim=-1)"),
        reason="sign flipped",
        name="rotation_bound_on_both_paths_neither_verified",
    ),
]


# --- s28 rope: the rotated pair inside a longer cat (``cat([a*c - b*s, b*c + a*s, x_pass], -1)``) -----------
# recurrentgemma / JAX ports write partial rotary as ONE concatenation of the two rotated parts and the
# pass-through part. ``cat([p, q, r], d) == cat([cat([p, q], d), r], d)`` exactly (for any d), so two
# adjacent elements are matched as the two-element cat every rotation form knows (inline formula, named
# parts), as a sub-node spanning those two elements: the fused call replaces that text only
# (``cat([<fused>, x_pass], -1)``), the rest of the cat stays byte for byte.

def _cat_sub_pairs(call: ast.Call) -> list[ast.Call]:
    """Two-element cats over adjacent elements of a cat of three or more tensors whose pair is a rotation
    shape (the written-out formula or two named parts); [] for anything else."""
    f = call.func
    # cheap tests first: this runs on every call of a statement that may hold a rotation
    if not ((isinstance(f, ast.Attribute) and f.attr in ("cat", "concat", "concatenate")) or isinstance(f, ast.Name)):
        return []
    if not call.args or not isinstance(call.args[0], (ast.List, ast.Tuple)) or len(call.args[0].elts) < 3:
        return []
    fn = ast.unparse(f)
    if isinstance(f, ast.Name):
        fn = _TORCH_IMPORTS.get().get(fn, fn)
    elts = call.args[0].elts
    if fn not in _CAT or any(isinstance(e, ast.Starred) for e in elts):
        return []
    out: list[ast.Call] = []
    i = 0
    while i + 1 < len(elts):
        a, b = elts[i], elts[i + 1]
        seq = type(call.args[0])(elts=[a, b], ctx=ast.Load())
        sub = ast.Call(func=call.func, args=[seq, *call.args[1:]], keywords=call.keywords)
        for n in (seq, sub):
            n.lineno, n.col_offset = a.lineno, a.col_offset
            n.end_lineno, n.end_col_offset = b.end_lineno, b.end_col_offset
        if _pair_formula(sub) is not None or _named_pair(sub) is not None:
            out.append(sub)
            i += 2
            continue
        i += 1
    return out


# own reproducer: the first half of each head rotated (positions per batch row, BSND), its halves' rotated
# parts and the untouched second half concatenated in one call
_CAT_WITH_PASS = '''
import torch


def rotate_first_half(inputs, positions, max_wavelength: int = 10_000):
    b, t = positions.shape
    x_rot, x_pass = torch.chunk(inputs, 2, dim=-1)
    positions = positions.reshape(b, t, 1, 1)
    freq = torch.arange(x_rot.shape[-1] // 2, device=inputs.device)
    inv = 1.0 / max_wavelength ** (2 * freq / x_rot.shape[-1])
    angle = positions * inv
    sin = torch.sin(angle).type_as(inputs)
    cos = torch.cos(angle).type_as(inputs)
    lo, hi = torch.chunk(x_rot, 2, dim=-1)
    part_a = lo * cos - hi * sin
    part_b = hi * cos + lo * sin
    return torch.concatenate([part_a, part_b, x_pass], dim=-1)
'''

# the same written inline, the pass-through part first
_CAT_WITH_PASS_INLINE = '''
import torch


def rotate_tail(x, cos, sin, n_pass: int):
    x_pass, x_rot = x[..., :n_pass], x[..., n_pass:]
    h = x_rot.shape[-1] // 2
    a, b = x_rot[..., :h], x_rot[..., h:]
    return torch.cat((x_pass, a * cos - b * sin, b * cos + a * sin), dim=-1)
'''

RopePattern.FUSE += [
    Fuse(
        name="rotated_parts_and_pass_through_in_one_cat",
        code=_CAT_WITH_PASS,
        expect={"qualname": "rotate_first_half", "mode": "half"},
        run='''
pos = torch.stack([torch.arange(6), torch.arange(6) + 3]).float()
x = torch.randn(2, 6, 3, 16).requires_grad_()
out = rotate_first_half(x, pos)
leaves = [x]
''',
    ),
    Fuse(
        name="pass_through_then_rotated_parts_inline_in_one_cat",
        code=_CAT_WITH_PASS_INLINE,
        expect={"qualname": "rotate_tail", "mode": "half"},
        run='''
ang = torch.outer(torch.arange(5).float(), 1.0 / (10000 ** (torch.arange(0, 6, 2).float() / 6)))
x = torch.randn(2, 3, 5, 10).requires_grad_()
out = rotate_tail(x, ang.cos(), ang.sin(), 4)
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the two rotated parts cast to different dtypes: joined, they have no one dtype the fused call could give
        _CAT_WITH_PASS.replace("part_a = lo * cos - hi * sin", "part_a = (lo * cos - hi * sin).float()")
        .replace("part_b = hi * cos + lo * sin", "part_b = (hi * cos + lo * sin).half()"),
        reason="cast differently",
        name="rotated_parts_in_one_cat_cast_differently",
    ),
]



# --- s28 rope: a rotation helper verified for an even last dim (its odd-dim branch pruned) ----------------
# Cerebras' ``rotate_every_two`` supports an odd head dim: ``if head_dim % 2: <pass the last element
# through>`` and ``cat((<stack(-x2, x1)>.flatten(-2), x[..., :0]), -1)``. npu_rotary_mul takes an even last
# dim only (spec 4.1), so the helper is read as it runs for an even one: every leading-level ``if`` on the
# parity of the argument's last dim takes the branch an even dim takes, and a cat operand that is an empty
# last-dim slice (``t[..., :0]``) is dropped; the rest is verified as any helper is. The verdict holds where
# ``x.shape[-1] % 2 == 0``, checked at run time (an odd dim runs the original code).

def _last_dim_of(node: ast.expr, pname: str) -> bool:
    """``x.shape[-1]`` / ``x.size(-1)`` / ``x.size()[-1]`` / ``x.shape[x.dim() - 1]``-free forms on the parameter."""
    if isinstance(node, ast.Subscript) and _is_int(node.slice, -1):
        base = node.value
        if isinstance(base, ast.Attribute) and base.attr == "shape":
            return isinstance(base.value, ast.Name) and base.value.id == pname
        if _method(base, "size") and not base.args:
            return isinstance(base.func.value, ast.Name) and base.func.value.id == pname
        return False
    return _method(node, "size") and len(node.args) == 1 and _is_int(node.args[0], -1) \
        and isinstance(node.func.value, ast.Name) and node.func.value.id == pname


def _parity_value(test: ast.expr, pname: str, values: dict[str, ast.expr]) -> bool | None:
    """The value ``test`` has where the parameter's last dim is even (``D % 2`` -> False, ``D % 2 == 0`` ->
    True, ``not D % 2`` -> True, ...), names read through ``values`` (bound once in the helper); None where
    ``test`` is no parity test of that dim."""
    def resolved(n: ast.expr) -> ast.expr:
        for _ in range(4):
            if isinstance(n, ast.Name) and n.id in values:
                n = values[n.id]
        return n

    def is_mod2(n: ast.expr) -> bool:
        n = resolved(n)
        return isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) and _is_int(n.right, 2) and _last_dim_of(resolved(n.left), pname)

    test = resolved(test)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _parity_value(test.operand, pname, values)
        return None if inner is None else not inner
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "bool" and len(test.args) == 1:
        return _parity_value(test.args[0], pname, values)
    if is_mod2(test):
        return False  # D % 2 == 0: falsy
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and is_mod2(test.left):
        k = const_value(test.comparators[0])
        if type(k) is not int:
            return None
        op = test.ops[0]
        if isinstance(op, ast.Eq):
            return k == 0
        if isinstance(op, ast.NotEq):
            return k != 0
        if isinstance(op, ast.Gt):
            return 0 > k
        return None
    return None


def _empty_last_dim_slice(node: ast.expr) -> bool:
    """``t[..., :0]`` (or ``t[..., 0:0]``): an empty slice of the last dim."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 2):
        return False
    lead, sl = node.slice.elts
    return isinstance(lead, ast.Constant) and lead.value is Ellipsis and isinstance(sl, ast.Slice) and sl.step is None \
        and _is_int(sl.upper, 0) and (sl.lower is None or _is_int(sl.lower, 0))


def _even_dim_rotation(module: ModuleInfo, fn: ast.FunctionDef, pname: str) -> _Rotation | None:
    """The helper's verdict where its argument's last dim is even (see the block comment); None where it has
    no parity ``if`` or is still no rotation."""
    if "% 2" not in segment(module, fn):
        return None
    stores: dict[str, int] = {}
    for n in fast_walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            stores[n.id] = stores.get(n.id, 0) + 1
    values = {st.targets[0].id: st.value for st in fn.body
              if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
              and stores.get(st.targets[0].id) == 1}
    body: list[ast.stmt] = []
    pruned = False
    for st in fn.body:
        val = _parity_value(st.test, pname, values) if isinstance(st, ast.If) else None
        if val is None:
            body.append(st)
            continue
        body.extend(st.body if val else st.orelse)
        pruned = True
    if not pruned or not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    ret = body[-1].value
    if isinstance(ret, ast.Call) and _pair_of(ret, _CAT) is not None:
        a, b = _pair_of(ret, _CAT)  # type: ignore[misc]
        singles = {t.targets[0].id: t.value for t in body
                   if isinstance(t, ast.Assign) and len(t.targets) == 1 and isinstance(t.targets[0], ast.Name)}
        counts: dict[str, int] = {}
        for t in body:
            for n in fast_walk(t):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    counts[n.id] = counts.get(n.id, 0) + 1

        def empty(e: ast.expr) -> bool:
            if isinstance(e, ast.Name) and counts.get(e.id) == 1 and e.id in singles:
                e = singles[e.id]
            return _empty_last_dim_slice(e)

        if empty(b) and not empty(a):
            body[-1] = ast.Return(value=a)
        elif empty(a) and not empty(b):
            body[-1] = ast.Return(value=b)
    rot = _specialised_helper_rotation(module, fn, body, pname)
    if rot is None:
        return None
    if rot.kind is None and rot.reason:
        return _Rotation(None, f"{rot.reason} (helper `{fn.name}` read for an even last dim)")
    if rot.kind is None or rot.mode_expr or rot.only_if or rot.half_if:
        return None
    rot.split_only_if, rot.x_only = "{x}.shape[-1] % 2 == 0", True
    rot.other = f"an odd last dim keeps the original code (`{fn.name}` handles it on a branch; npu_rotary_mul takes an even one)"
    return rot



# own reproducer: a lane-pair rotation helper that also takes an odd head dim (the last lane passed through),
# applied by an autograd.Function whose backward is written out (the fused forward keeps it: same math)
_ODD_DIM_HELPER = '''
import torch


def turn_pairs(t):
    d = t.size(-1)
    is_odd = d % 2 == 1
    even, odd = t[..., 0::2], t[..., 1::2]
    tail = t[..., :0]
    if is_odd:
        tail = even[..., -1:]
        even = even[..., :-1]
    else:
        pass
    t = torch.stack((-odd, even), dim=-1)
    return torch.cat((t.flatten(-2), tail), dim=-1)


class PairRotation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, sin, cos):
        ctx.save_for_backward(sin, cos)
        return t * cos + turn_pairs(t) * sin

    @staticmethod
    def backward(ctx, grad):
        sin, cos = ctx.saved_tensors
        return grad * cos - turn_pairs(grad * sin), None, None
'''

RopePattern.FUSE += [
    Fuse(
        name="pair_helper_with_an_odd_dim_branch",
        code=_ODD_DIM_HELPER,
        expect={"qualname": "PairRotation.forward", "mode": "interleave", "variant": "interleave_tables_checked"},
        run='''
def tables(S, D):
    ang = torch.outer(torch.arange(S).float(), 1.0 / (10000 ** (torch.arange(0, D // 2 * 2, 2).float() / D)))
    c, s = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    if D % 2:
        c, s = torch.cat((c, torch.ones(S, 1)), -1), torch.cat((s, torch.zeros(S, 1)), -1)
    return c[None, :, None, :], s[None, :, None, :]
x8 = torch.randn(2, 5, 3, 8).requires_grad_()
x7 = torch.randn(2, 5, 3, 7).requires_grad_()
c8, s8 = tables(5, 8)
c7, s7 = tables(5, 7)
out = (PairRotation.apply(x8, s8, c8), PairRotation.apply(x7, s7, c7))
leaves = [x8, x7]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # on the even path the pair is (odd, -even): the rotation by -angle, not what cos/sin ask for
        _ODD_DIM_HELPER.replace("torch.stack((-odd, even), dim=-1)", "torch.stack((odd, -even), dim=-1)"),
        reason="sign flipped",
        name="pair_helper_with_an_odd_dim_branch_sign_flipped",
    ),
]



# --- s28 rope: a complex rope asked for in float64 (Wan-style ``x.to(torch.float64)``), fused in fp32 -------------
# npu_rotary_mul takes fp16/bf16/fp32 only (spec 4.1). Where the tensor before the upcast is one of those, its values
# are exact in fp32: the fused call rotates in fp32 (the widest dtype the op takes; cos/sin taken from the float64 or
# complex128 tables as fp32) and gives the float64 result back, so the code after it sees the dtype it saw. The
# rotation's precision changes (fp32 rounding, ~1e-7 relative, instead of float64): stated as a numerics risk.
# Where the tensor is float64 itself (a float64 model), fp32 would drop bits of the input: the run-time check leaves
# it to the original code.

def _plain_read(node: ast.expr) -> bool:
    """Names, attributes, subscripts, slices and constants only: safe to evaluate again for a dtype test."""
    return all(isinstance(n, (ast.Name, ast.Attribute, ast.Subscript, ast.Slice, ast.Tuple, ast.Constant, ast.Load,
                              ast.UnaryOp, ast.USub, ast.BinOp, ast.operator)) for n in fast_walk(node))


def _float64_in_fp32(module: ModuleInfo, scope: Scope, m: "_Match", x_cast: ast.expr, cast_line: int, node: ast.AST) -> "_Match | str":
    """``m`` (a complex-form match whose lane pairs come from ``x_cast`` = ``t.to(torch.float64)``) computed in fp32
    where ``t`` is fp16/bf16/fp32 at run time; the refusal reason where ``t`` cannot be read again at the site."""
    t = strip_casts(x_cast)[0]
    refusal = (f"complex rope computed in float64 (`{ast.unparse(x_cast)}`): npu_rotary_mul takes fp16/bf16/fp32 only, and "
               "the tensor before the upcast cannot be read again at the site to check it is one of those")
    if t is x_cast or not _plain_read(t):
        return refusal
    site_line = getattr(node, "lineno", cast_line)
    for n in fast_walk(t):
        if isinstance(n, ast.Name) and any(cast_line <= st.lineno <= site_line and st.lineno != site_line
                                           for st, _v in scope.assignments.get(n.id, [])):
            return refusal  # rebound between the upcast and the site: the test would read another tensor
    t_src = _atom(segment(module, t))
    cos, sin = m.cos, m.sin
    if _is_name(m.x_text) and "." not in m.x_text:
        m.prep = m.prep + [f"{m.x_text}, {cos}, {sin} = {m.x_text}.float(), {cos}.float(), {sin}.float()  # float64 asked for: "
                           "npu_rotary_mul takes fp16/bf16/fp32, fp32 is the widest"]
    else:
        m.prep = m.prep + [f"{cos}, {sin} = {cos}.float(), {sin}.float()  # float64 asked for: npu_rotary_mul takes fp16/bf16/fp32, fp32 is the widest"]
        m.x_text = f"{_atom(m.x_text)}.float()"
    m.x_dtype, m.cs_dtype = "float32", "float32"
    check = f"{t_src}.dtype in (torch.float16, torch.bfloat16, torch.float32)"
    m.only_if = check if m.only_if is None else f"({m.only_if}) and {check}"
    m.only_note = (m.only_note + "; " if m.only_note else "") + (
        f"a float64 `{t_src}` (a float64 model) keeps the original code (fp32 would drop bits of its input)")
    m.post = m.post + ".to(torch.float64)"
    m.extra_risks = m.extra_risks + [Risk("numerics", f"the original rotates in float64 (`{ast.unparse(x_cast)}`); npu_rotary_mul takes "
                                          "fp16/bf16/fp32 only, so the fused call rotates in fp32 and casts the result back to "
                                          "float64: values differ from the original by fp32 rounding (~1e-7 relative)")]
    return m



# --- s28 rope: a rotation helper written in another framework (TF / JAX / NumPy ports next to the torch model) --
# Hugging Face's modeling_tf_* / modeling_flax_* files hold ``rotate_half`` / ``rotate_every_two`` built with
# ``tf.concat`` / ``jnp.stack``: the rotation is the standard one, but not torch code. The near miss says that,
# not that the helper computes something else.

_FOREIGN_ROOTS = {"tensorflow": "TensorFlow", "jax": "JAX", "flax": "JAX", "numpy": "NumPy", "mindspore": "MindSpore",
                  "paddle": "Paddle"}
_JOIN_CALLS = ("cat", "concat", "concatenate", "stack", "split", "reshape")


def _foreign_framework(module: ModuleInfo, fn: ast.FunctionDef) -> tuple[str, str] | None:
    """(framework, call) where the helper joins or splits its halves with another framework's calls and none
    of torch's; None otherwise."""
    found = None
    for n in fast_walk(fn):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _JOIN_CALLS):
            continue
        name = module.canonical(n.func) or ""
        root = name.split(".")[0]
        if root == "torch":
            return None
        if root in _FOREIGN_ROOTS and found is None:
            found = (_FOREIGN_ROOTS[root], dotted(n.func) or name)
    return found


_TF_ROTATE_HALF = '''
import tensorflow as tf


def rotate_half(x):
    x1, x2 = tf.split(x, 2, axis=-1)
    return tf.concat((-x2, x1), axis=-1)


def apply_rotary_pos_emb(x, cos, sin):
    return (x * cos) + (rotate_half(x) * sin)
'''

_JAX_ROTATE_PAIRS = '''
import jax.numpy as jnp


def rotate_every_two(t):
    r = jnp.stack((-t[:, :, :, 1::2], t[:, :, :, ::2]), axis=-1)
    return r.reshape(r.shape[:-2] + (-1,))


def apply_rotary_pos_emb(t, cos, sin):
    return (t * cos) + (rotate_every_two(t) * sin)
'''

RopePattern.KEEP += [
    Keep(_TF_ROTATE_HALF, reason="is TensorFlow code (`tf.split`), not PyTorch", name="tensorflow_rotate_half_helper"),
    Keep(_JAX_ROTATE_PAIRS, reason="is JAX code (`jnp.stack`), not PyTorch", name="jax_rotate_every_two_helper"),
]


# s31: rotation helpers in spellings no matcher reads, proved by evaluating them (numeric_probe.prove_rotation):
# TransformerEngine's halves from a [.., 2, d/2] view unbound; pairs from a [.., d/2, 2] reshape spread with *shape
_S31_TE_HALVES = '''
import torch


def _rotate_half_te(x: torch.Tensor) -> torch.Tensor:
    x = x.view(x.shape[:-1] + torch.Size((2, x.shape[-1] // 2)))
    x1, x2 = x.unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(t, cos_freqs, sin_freqs):
    return (t * cos_freqs) + (_rotate_half_te(t) * sin_freqs)
'''

_S31_PAIRS_RESHAPED = '''
import torch
from torch import nn


class Rotary(nn.Module):
    def rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        x_reshaped = x.reshape(*x.shape[:-1], -1, 2)
        x1 = x_reshaped[..., 0]
        x2 = x_reshaped[..., 1]
        return torch.stack((-x2, x1), dim=-1).reshape(*x.shape)

    def forward(self, q, cos, sin):
        return q * cos + self.rotate_half(q) * sin
'''

RopePattern.FUSE += [
    Fuse(
        name="s31_rotate_half_of_an_unbound_view_proved_by_evaluation",
        code=_S31_TE_HALVES,
        expect={"mode": "half"},
        run='''
t = torch.randn(2, 6, 3, 16, requires_grad=True)
ang = torch.randn(6, 1, 8)
cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
out = apply_rotary(t, cos, sin)
leaves = [t]
''',
    ),
    Fuse(
        name="s31_interleaved_pairs_of_a_spread_reshape_proved_by_evaluation",
        code=_S31_PAIRS_RESHAPED,
        expect={"mode": "interleave"},
        run='''
q = torch.randn(2, 3, 6, 16, requires_grad=True)
ang = torch.randn(1, 1, 6, 8)
cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
out = Rotary()(q, cos, sin)
leaves = [q]
''',
    ),
]

RopePattern.KEEP += [
    # the same helpers with the sign on the other half: evaluated, they compute neither rotation
    Keep(_S31_TE_HALVES.replace("torch.cat((-x2, x1), dim=-1)", "torch.cat((x2, -x1), dim=-1)"),
         reason="evaluated on sampled inputs", name="s31_unbound_view_helper_with_the_sign_swapped"),
    Keep(_S31_PAIRS_RESHAPED.replace("torch.stack((-x2, x1), dim=-1)", "torch.stack((-x1, x2), dim=-1)"),
         # (s41: the lanes indexed off the pair view are read statically: the sign placement is named, not evaluated)
         reason="is not the standard stack(-x2, x1)", name="s31_spread_reshape_helper_that_is_no_rotation"),
]


# --- s32: a broadcast helper that chooses among table shapes (the s32 precision audit) ------------
# rope-vit's reshape_for_broadcast keeps the last two dims of a [S, D/2] table (11SD) or the last
# three of a per-head [H, S, D/2] one (1HSD): npufuse read it as Meta's helper (1S1D, one shape) and
# emitted an unchecked interleave call, which the op rejects for the per-head table. Only a helper
# with one shape keeping dims 1 and the last is Meta's; any other gets the run-time layout check.
_S32_BRANCHING_BROADCAST = '''\
import torch


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor):
    ndim = x.ndim
    if freqs_cis.shape == (x.shape[-2], x.shape[-1]):
        shape = [d if i >= ndim - 2 else 1 for i, d in enumerate(x.shape)]
    elif freqs_cis.shape == (x.shape[-3], x.shape[-2], x.shape[-1]):
        shape = [d if i >= ndim - 3 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)
'''

RopePattern.FUSE += [
    Fuse(_S32_BRANCHING_BROADCAST, name="s32_broadcast_helper_choosing_table_shapes_checked",
         expect={"variant": "complex_freqs_cis_checked", "mode": "complex"},
         # a shared [S, D/2] table (fused) and a per-head [H, S, D/2] one (the original runs)
         run='''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
shared = torch.polar(torch.ones_like(ang), ang)
per_head = torch.polar(torch.ones(3, 6, 8), torch.rand(3, 6, 8))
xq = torch.randn(2, 3, 6, 16, requires_grad=True)
xk = torch.randn(2, 3, 6, 16, requires_grad=True)
out = (*apply_rotary_emb(xq, xk, shared), *apply_rotary_emb(xq, xk, per_head))
leaves = [xq, xk]
'''),
]


# --- s32: the pairs-of-halves layout given back contiguous (spelling bench, hoisted temporaries) ---
# ``h4 = view_as_real(xc * blended); out = h4.view_as(x)`` with xc the complex pairs of the two halves:
# the fused result was handed back as a transposed view, and .view_as raised on it in the rewritten
# program ("view size is not compatible with input tensor's size and stride").
RopePattern.FUSE += [
    Fuse(
        _COMPLEX_VIEW_AS.replace("x.to(self.dtype).reshape(*x.shape[:-1], -1, 2)",
                                 "x.to(self.dtype).reshape(*x.shape[:-1], 2, -1).transpose(-1, -2).contiguous()")
        .replace("        out = torch.view_as_real(xc * blended).view_as(x)\n",
                 "        pairs = torch.view_as_real(xc * blended)\n        out = pairs.view_as(x)\n"),
        name="s32_pairs_of_halves_viewed_back_later",
        expect={"mode": "half"},
        run='''
x = torch.randn(2, 6, 3, 16, requires_grad=True)
m32 = Rotation(16, scale=0.75)
out = (m32.rotate(x), m32.rotate(x, start=2), m32.rotate(x.transpose(1, 2), time_dim=2))
leaves = [x]
''',
    ),
]

# --- audit33: rotations written in conditional expressions (a caller passes None for q or k) ---
RopePattern.FUSE.append(
    Fuse(
        name="rotations_in_conditional_expressions",
        # yarn's ReRoPE apply_rotary_pos_emb: each rotation under ``if x is not None else None`` and a caller that
        # passes k=None: the fused branch runs only where both tests hold (its checks read k's shape)
        code='''
import torch


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    q_embed = (q * cos) + (rotate_half(q) * sin) if q is not None else None
    k_embed = (k * cos) + (rotate_half(k) * sin) if k is not None else None
    return q_embed, k_embed
''',
        expect={"mode": "half"},
        run='''
q = torch.randn(2, 4, 6, 16, requires_grad=True)
k = torch.randn(2, 4, 6, 16, requires_grad=True)
ang = torch.randn(1, 1, 6, 8).repeat(1, 1, 1, 2)
both = apply_rotary_pos_emb(q, k, ang.cos(), ang.sin())
out = (both[0], both[1], apply_rotary_pos_emb(q, None, ang.cos(), ang.sin())[0], apply_rotary_pos_emb(None, k, ang.cos(), ang.sin())[1])
leaves = [q, k]
''',
    )
)

# s34: the halves of a rotated prefix cut as two slices with explicit bounds (partial rotary without a named
# ``x_rot``): k-diffusion's ``x[..., :d], x[..., d : d * 2], x[..., d * 2 :]`` (d the tables' width), lightllm /
# ColossalAI's kernel references ``x[..., 0 : dim // 2]`` / ``x[..., dim // 2 : dim]``, mlx's RoPE ported to torch
# ``x[..., dims // 2 : dims]``. ``x[..., h:u]`` is the second half of ``x[..., :u]``: the fused call rotates that prefix
# where ``u == 2 * h`` and x is at least u wide (checked at run time), the original code elsewhere; an explicit ``0``
# start is no start, and an end that is x's own last dim is no end
_PREFIX_HALVES = '''
import torch


def rotate_prefix(x, cos, sin):
    d = cos.shape[-1]
    x1, x2, x_pass = x[..., :d], x[..., d : d * 2], x[..., d * 2 :]
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    return torch.cat((y1, y2, x_pass), dim=-1)


def rotate_heads(x, cos, sin):
    b, h, s, dim = x.shape
    x0 = x[..., 0 : dim // 2]
    x1 = x[..., dim // 2 : dim]
    o0 = x0 * cos - x1 * sin
    o1 = x0 * sin + x1 * cos
    return torch.cat((o0, o1), dim=-1)


def rotate_first(x, cos, sin, rot: int):
    x0 = x[..., 0 : rot // 2]
    x1 = x[..., rot // 2 : rot]
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
'''

RopePattern.FUSE += [
    Fuse(
        name="s34_prefix_halves_cut_by_explicit_slices",
        code=_PREFIX_HALVES,
        expect={"mode": "half"},
        run='''
x = torch.randn(2, 3, 5, 16, requires_grad=True)
ang = torch.randn(1, 1, 5, 4)
full = torch.randn(1, 1, 5, 8)
out = (rotate_prefix(x, ang.cos(), ang.sin()), rotate_heads(x, full.cos(), full.sin()),
       rotate_first(x, ang.cos(), ang.sin(), 8), rotate_first(x, full.cos(), full.sin(), 16),
       rotate_prefix(x.to(torch.bfloat16), full.cos(), full.sin()))
leaves = [x]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the second "half" is cut from another tensor: no rotation of one x
        _PREFIX_HALVES.replace("def rotate_prefix(x, cos, sin):", "def rotate_prefix(x, k, cos, sin):")
        .replace("x1, x2, x_pass = x[..., :d], x[..., d : d * 2], x[..., d * 2 :]", "x1, x2, x_pass = x[..., :d], k[..., d : d * 2], x[..., d * 2 :]")
        .split("\n\n\ndef rotate_heads")[0] + "\n",
        name="s34_prefix_halves_of_two_tensors",
    ),
    Keep(
        # the end of the second slice is rebound in a loop: not a split point the fused code could read again
        '''
import torch


def rotate_blocks(x, cos, sin):
    d = cos.shape[-1]
    outs = []
    for end in (2 * d, 4 * d):
        x1, x2 = x[..., end - 2 * d : end - d], x[..., end - d : end]
        outs.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
    return torch.cat(outs, dim=-1)
''',
        name="s34_prefix_halves_moving_window",
    ),
]

# s34: the stack of the rotated lane pairs written as the cat of the two with a new last axis added
# (``cat([a.unsqueeze(-1), b.unsqueeze(-1)], -1)``: neuronx-distributed's polar rotation; ``cat([a[..., None],
# b[..., None]], -1)``: mlx's traditional RoPE ported to torch), merged by flatten(-2): read as stack([a, b], -1)
_STACK_AS_CAT = '''
import torch


def rotate_lanes(x, cos, sin):
    real, imag = x[..., ::2], x[..., 1::2]
    rot_real = real * cos - imag * sin
    rot_imag = real * sin + imag * cos
    return torch.cat([rot_real.unsqueeze(-1), rot_imag.unsqueeze(dim=-1)], dim=-1).flatten(-2)


def rotate_lanes_inline(x, cos, sin):
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.cat(((a * cos - b * sin)[..., None], (a * sin + b * cos)[..., None]), -1).flatten(-2)
'''

RopePattern.FUSE += [
    Fuse(
        name="s34_lane_stack_written_as_cat_of_unsqueezed",
        code=_STACK_AS_CAT,
        expect={"mode": "interleave"},
        run='''
x = torch.randn(2, 3, 5, 16, requires_grad=True)
ang = torch.randn(1, 1, 5, 8)
# [(b h), s, d] tokens with [s, d/2] tables (lifted to one batch: 11SD), and B*N = 1000 (the op's interleave limit:
# the original code runs there)
tokens = torch.randn(6, 5, 16, requires_grad=True)
wide = torch.randn(250, 4, 5, 8, requires_grad=True)
out = (rotate_lanes(x, ang.cos(), ang.sin()), rotate_lanes_inline(x, ang.cos(), ang.sin()),
       rotate_lanes(tokens, ang[0, 0].cos(), ang[0, 0].sin()), rotate_lanes(wide, ang[..., :4].cos(), ang[..., :4].sin()))
leaves = [x, tokens, wide]
''',
    ),
]

RopePattern.KEEP += [
    Keep(
        # the new axes joined along dim -2: flatten(-2) then gives cat(rot_real, rot_imag), the halves, not the pairs
        _STACK_AS_CAT.split("\n\n\ndef rotate_lanes_inline")[0].replace("rot_imag.unsqueeze(dim=-1)], dim=-1)", "rot_imag.unsqueeze(dim=-1)], dim=-2)") + "\n",
        name="s34_unsqueezed_parts_joined_on_another_axis",
    ),
]

# s34: einops rotation helpers that cut the last dim with the 2-sized factor moved to the front and unpack it
# (``x1, x2 = rearrange(x, "... (dim r) -> r ... dim", r=2)``: uni2ts / toto; CS336's ``(half_d xy) -> xy ... half_d``)
# and join a list by einops (``rearrange([-x2, x1], "r ... dim -> ... (dim r)", r=2)``: einops stacks the list on a
# new axis 0): inner factor = the even/odd lanes and their re-interleave, outer factor = the halves and their cat
_EINOPS_FRONT_AXIS = '''
import torch
import torch.nn as nn
from einops import rearrange


class LaneRotary(nn.Module):
    def __init__(self, dim, max_len=64):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        ang = torch.outer(torch.arange(max_len).float(), inv).repeat_interleave(2, dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    @staticmethod
    def _turn(x):
        x_even, x_odd = rearrange(x, "... (d two) -> two ... d", two=2)
        return rearrange([-x_odd, x_even], "two ... d -> ... (d two)", two=2)

    def forward(self, x):
        pos = torch.arange(x.shape[-2], device=x.device)
        return self.cos[pos].to(x.dtype) * x + self.sin[pos].to(x.dtype) * self._turn(x)


def swap_halves(t):
    lo, hi = rearrange(t, "... (two d) -> two ... d", two=2)
    return rearrange((-hi, lo), "two ... d -> ... (two d)", two=2)


def rotate(t, cos, sin):
    return t * cos + swap_halves(t) * sin
'''

RopePattern.FUSE += [
    Fuse(
        # einops is not a dependency: tests/test_detect_s34_rope.py runs this one under a minimal stand-in
        name="s34_einops_pair_axis_unpacked_and_list_joined",
        code=_EINOPS_FRONT_AXIS,
        expect={"mode": "interleave", "qualname": "LaneRotary.forward"},
    ),
]

RopePattern.KEEP += [
    Keep(
        # the lanes joined back as two halves ("(two d)"): cat(-x_odd, x_even) is no rotation npu_rotary_mul computes
        _EINOPS_FRONT_AXIS.split("\n\n\ndef swap_halves")[0].replace('return rearrange([-x_odd, x_even], "two ... d -> ... (d two)", two=2)',
                                                                     'return rearrange([-x_odd, x_even], "two ... d -> ... (two d)", two=2)') + "\n",
        reason="does not compute the standard rotate_half",
        name="s34_einops_lanes_joined_as_halves",
    ),
]

# s35: the rotated lane pairs written into a new tensor shaped like x by strided slice assignment, the two fills
# as one statement (``out[..., ::2], out[..., 1::2] = a, b``), the allocation given x's own device
# (``torch.empty_like(x, device=x.device)``), and the lanes of a rotated prefix (``x[..., :u:2]`` / ``x[..., 1:u:2]``
# filled into ``out[..., :u:2]`` / ``out[..., 1:u:2]``, x's tail copied after: a nanoGPT variant's partial
# interleaved rotary). The fill reads as ``stack((a, b), -1).flatten(-2)`` of the prefix; the fused call rotates
# ``x[..., :u]`` and joins ``x[..., u:]`` (zeros for zeros_like) after it, where u is even and x at least u wide
# (checked at run time). The same bounded lanes stacked inline (``turn_inline``) rotate the prefix alone
_FILLED_PREFIX_LANES = '''
import torch
import torch.nn as nn


class PrefixRotary(nn.Module):
    def __init__(self, config, size=None):
        super().__init__()
        self.dim = size
        self.rope_length = config.rope_length if config.rope_length else size
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, self.rope_length // 2).float() / (self.rope_length // 2)))

    def forward(self, x):
        seq_len = x.shape[-2]
        device = x.device
        pos = torch.arange(0, seq_len, device=device).type_as(self.inv_freq)
        angles = torch.einsum("i,d->id", pos, self.inv_freq)
        sin_angles = angles.sin()
        cos_angles = angles.cos()
        x_even, x_odd = x[..., :self.rope_length:2], x[..., 1:self.rope_length:2]
        x_rotated_even = x_even * cos_angles - x_odd * sin_angles
        x_rotated_odd = x_even * sin_angles + x_odd * cos_angles
        x_combined = torch.empty_like(x, device=device)
        x_combined[..., :self.rope_length:2], x_combined[..., 1:self.rope_length:2] = x_rotated_even, x_rotated_odd
        if self.rope_length < self.dim:
            x_combined[..., self.rope_length:] = x[..., self.rope_length:]
        return x_combined


def turn_leading(t, c, s, width: int):
    lo = t[..., 0:width:2]
    hi = t[..., 1:width:2]
    turned_lo = c * lo - s * hi
    turned_hi = s * lo + c * hi
    res = torch.zeros_like(t)
    res[..., 0:width:2] = turned_lo
    res[..., 1:width:2] = turned_hi
    res[..., width:] = t[..., width:]
    return res


def turn_leading_zero_tail(t, c, s, width: int):
    lo, hi = t[..., :width:2], t[..., 1:width:2]
    a = lo * c - hi * s
    b = hi * c + lo * s
    res = torch.zeros_like(t)
    res[..., :width:2], res[..., 1:width:2] = a, b
    return res


def turn_pairs(t, c, s):
    re, im = t.unflatten(-1, (-1, 2)).unbind(-1)
    new_re = re * c - im * s
    new_im = re * s + im * c
    res = torch.empty_like(t, device=t.device)
    res[..., ::2], res[..., 1::2] = new_re, new_im
    return res


def turn_inline(t, c, s, w):
    return torch.stack((t[..., :w:2] * c - t[..., 1:w:2] * s, t[..., :w:2] * s + t[..., 1:w:2] * c), -1).flatten(-2)
'''

_FILLED_PREFIX_LANES_RUN = '''
class _Cfg:
    rope_length = 8


x = torch.randn(2, 3, 5, 16, requires_grad=True)
ang = torch.randn(5, 4)
full = torch.randn(5, 8)
wide = torch.randn(250, 4, 5, 16, requires_grad=True)  # B*N = 1000: over the interleave limit, the original code runs
out = (PrefixRotary(_Cfg(), 16)(x), PrefixRotary(_Cfg(), 8)(x[..., :8]), turn_leading(x, ang.cos(), ang.sin(), 8),
       turn_leading(x, full.cos(), full.sin(), 16), turn_pairs(x, full.cos(), full.sin()),
       turn_pairs(x.to(torch.bfloat16), full.cos(), full.sin()), turn_leading(wide, ang.cos(), ang.sin(), 8),
       turn_leading_zero_tail(x, ang.cos(), ang.sin(), 8), turn_inline(x, ang.cos(), ang.sin(), 8))
leaves = [x, wide]
'''

RopePattern.FUSE += [
    Fuse(
        name="s35_prefix_lanes_filled_into_a_new_tensor",
        code=_FILLED_PREFIX_LANES,
        expect={"mode": "interleave", "qualname": "PrefixRotary.forward"},
        run=_FILLED_PREFIX_LANES_RUN,
    ),
]

RopePattern.KEEP += [
    Keep(
        # the rotated lanes written back swapped (the odd lane's value into the even lanes): no rotation
        _FILLED_PREFIX_LANES.split("\n\n\ndef turn_leading")[0].replace(
            "= x_rotated_even, x_rotated_odd", "= x_rotated_odd, x_rotated_even") + "\n",
        name="s35_prefix_lanes_filled_swapped",
    ),
    Keep(
        # the new tensor lives on another device than x: the fused result would not
        _FILLED_PREFIX_LANES.split("\n\n\ndef turn_leading")[0].replace(
            "torch.empty_like(x, device=device)", 'torch.empty_like(x, device="cpu")') + "\n",
        name="s35_prefix_lanes_filled_on_another_device",
    ),
    Keep(
        # the fills write the lanes of a wider prefix than the rotation reads: not one prefix
        "\nimport torch\n\n\ndef turn_leading" + _FILLED_PREFIX_LANES.split("\n\n\ndef turn_leading")[1].split("\n\n\ndef turn_leading_zero_tail")[0]
        .replace("res[..., 0:width:2] = turned_lo\n    res[..., 1:width:2] = turned_hi",
                 "res[..., 0:2 * width:2] = turned_lo\n    res[..., 1:2 * width:2] = turned_hi") + "\n",
        name="s35_prefix_lanes_filled_at_another_width",
    ),
]


# --- rope s35: the half rotation accumulated in place into the two halves of x * cos (LTX-2's split RoPE) ---


def _unsqueezed_at(node: ast.expr, scope: Scope) -> ast.expr | None:
    """t of ``t.unsqueeze(-2)`` / ``t.unsqueeze(dim=-2)`` / ``t[..., None, :]`` (directly or through a name bound
    once): a half-size table given the size-1 axis that broadcasts it over the two halves."""
    node = _resolve(scope, node)
    if _method(node, "unsqueeze") and len(node.args) + len(node.keywords) == 1:  # type: ignore[union-attr]
        dim = node.args[0] if node.args else keyword(node, "dim")  # type: ignore[union-attr,arg-type]
        if _is_int(dim, -2):
            return node.func.value  # type: ignore[union-attr]
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 3:
        e0, e1, e2 = node.slice.elts
        if isinstance(e0, ast.Constant) and e0.value is Ellipsis and isinstance(e1, ast.Constant) and e1.value is None \
                and isinstance(e2, ast.Slice) and e2.lower is None and e2.upper is None and e2.step is None:
            return node.value
    return None


def _half_row(node: ast.expr) -> tuple[ast.expr, int] | None:
    """(t, k) of ``t[..., k:k+1, :]`` / ``t[..., k, :]`` (k 0 or 1; ``:1`` / ``1:`` / ``0:1`` / ``1:2``): one
    of the two rows of a [..., 2, D/2] view (in place, a view writes into t)."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 3):
        return None
    e0, e1, e2 = node.slice.elts
    if not (isinstance(e0, ast.Constant) and e0.value is Ellipsis and isinstance(e2, ast.Slice)
            and e2.lower is None and e2.upper is None and e2.step is None):
        return None
    if _is_int(e1, 0, 1):
        return node.value, const_value(e1)  # type: ignore[return-value]
    if isinstance(e1, ast.Slice) and e1.step is None:
        lo, hi = (0 if e1.lower is None else const_value(e1.lower)), (None if e1.upper is None else const_value(e1.upper))
        if lo == 0 and hi == 1:
            return node.value, 0
        if lo == 1 and hi in (None, 2):
            return node.value, 1
    return None


def _merged_pair_axes(module: ModuleInfo, node: ast.expr) -> ast.expr | None:
    """t of an expression merging t's last two axes: ``t.flatten(-2)`` (canonical.merges_last_two),
    ``rearrange(t, "... d r -> ... (d r)")``, ``t.reshape(*t.shape[:-2], n)`` / ``t.view(*t.shape[:-2], -1)``."""
    inner = canonical.merges_last_two(node)
    if inner is not None:
        return inner
    if isinstance(node, ast.Call) and (dotted(node.func) or "").split(".")[-1] == "rearrange" and len(node.args) == 2 \
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        lhs, _, rhs = node.args[1].value.partition("->")
        lt, rt = lhs.split(), rhs.replace("(", " ( ").replace(")", " ) ").split()
        if len(lt) >= 2 and rt[-4:] == ["(", lt[-2], lt[-1], ")"] and rt[:-4] == lt[:-2] and "(" not in lhs:
            return node.args[0]
        return None
    if _method(node, "reshape", "view") and len(node.args) == 2 and not node.keywords:  # type: ignore[union-attr]
        lead = node.args[0]  # type: ignore[union-attr]
        t = node.func.value  # type: ignore[union-attr]
        if isinstance(lead, ast.Starred) and isinstance(lead.value, ast.Subscript) and isinstance(lead.value.value, ast.Attribute) \
                and lead.value.value.attr == "shape" and same_expr(lead.value.value.value, t) and isinstance(lead.value.slice, ast.Slice) \
                and lead.value.slice.lower is None and _is_int(lead.value.slice.upper, -2) and lead.value.slice.step is None:
            return t  # (one size for the merged axis: any other than 2 * D/2 fails in the eager code too)
    return None


def _accumulated_halves_site(module: ModuleInfo, scope: Scope, block: list[ast.stmt], i: int, stmt: ast.stmt
                             ) -> tuple[ast.Assign | ast.Return, ast.expr, ast.expr, ast.expr, bool, bool] | str | None:
    """LTX-2's split RoPE (and its copies in diffusers, DiffSynth, FastVideo, VeOmni):

        s = rearrange(x, "... (d r) -> ... d r", d=2)      # [..., 2, D/2]: the halves as an axis
        out = s * cos.unsqueeze(-2)
        lo, hi = out[..., :1, :], out[..., 1:, :]           # views of out
        lo.addcmul_(-sin.unsqueeze(-2), s[..., 1:, :])      # x1*cos - x2*sin, in place
        hi.addcmul_(sin.unsqueeze(-2), s[..., :1, :])       # x2*cos + x1*sin
        out = rearrange(out, "... d r -> ... (d r)")

    is ``cat((x1*cos - x2*sin, x2*cos + x1*sin), -1)``: the half rotation with half-size tables. Returned as
    (the one statement ``out = <value>`` spanning the product to the merge, x, cos, sin, whether sin is negated
    (the rotation by -angle), whether the view upcasts x to fp32); a reason where the shape is there but
    something else is written; None where it is not this shape."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.BinOp) and isinstance(stmt.value.op, ast.Mult)):
        return None
    out = stmt.targets[0].id
    view = cos = None
    for a, b in ((stmt.value.left, stmt.value.right), (stmt.value.right, stmt.value.left)):
        c = _unsqueezed_at(b, scope)
        inner, casts = strip_casts(_resolve(scope, a))
        got = _halves_axis_view(module, scope, inner) if isinstance(inner, ast.Call) else None
        if c is not None and got is not None and set(casts) <= {".float()"}:
            view, cos, x, upcast = a, c, got, bool(casts)
            break
    if view is None or cos is None:
        return None
    if isinstance(x, ast.Name) and isinstance(view, ast.Name):
        made = [st.lineno for st, _v in scope.assignments.get(view.id, []) if st.lineno < stmt.lineno]
        if not made or any(made[-1] < st.lineno < stmt.lineno for st, _v in scope.assignments.get(x.id, [])):
            return None  # x rebound between the view and the product: the fused call would read another x
    # the statements after: views of out's two rows (names or inline), two addcmul_, then the merge of out
    rows: dict[str, int] = {}
    acc: dict[int, tuple[int, ast.expr]] = {}
    j = i + 1
    while j < len(block):
        st = block[j]
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            row = _half_row(st.value)
            if row is not None and isinstance(row[0], ast.Name) and row[0].id == out:
                rows[st.targets[0].id] = row[1]
                j += 1
                continue
            break
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Tuple) and isinstance(st.value, ast.Tuple) \
                and len(st.targets[0].elts) == len(st.value.elts):
            pairs = [(t, _half_row(v)) for t, v in zip(st.targets[0].elts, st.value.elts)]
            if all(isinstance(t, ast.Name) and r is not None and isinstance(r[0], ast.Name) and r[0].id == out for t, r in pairs):
                rows.update({t.id: r[1] for t, r in pairs})  # type: ignore[union-attr,index]
                j += 1
                continue
            break
        if isinstance(st, ast.Expr) and _method(st.value, "addcmul_"):
            call = st.value
            recv = call.func.value  # type: ignore[union-attr]
            k = rows.get(recv.id) if isinstance(recv, ast.Name) else None
            if k is None:
                row = _half_row(recv)
                k = row[1] if row is not None and isinstance(row[0], ast.Name) and row[0].id == out else None
            value = keyword(call, "value")  # type: ignore[arg-type]
            if k is None or len(call.args) != 2 or (call.keywords and (len(call.keywords) != 1 or value is None)) or k in acc:  # type: ignore[union-attr]
                return None
            sign = 1 if value is None else const_value(value)
            if sign not in (1, -1):
                return None
            acc[k] = (sign, call)  # type: ignore[assignment]
            j += 1
            continue
        break
    if sorted(acc) != [0, 1] or j >= len(block):
        return None
    merge = block[j]
    returned = isinstance(merge, ast.Return) and merge.value is not None  # ``return rearrange(out, ...)`` (FastVideo)
    if not returned and not (isinstance(merge, ast.Assign) and len(merge.targets) == 1 and isinstance(merge.targets[0], ast.Name)
                             and merge.targets[0].id == out):
        return None
    merged = _merged_pair_axes(module, merge.value)  # type: ignore[arg-type]
    if not (isinstance(merged, ast.Name) and merged.id == out):
        return None
    # each row k gets sign * t1 * t2 with one factor the other half of the view and the other ±sin.unsqueeze(-2)
    halves = _Halves(scope, lambda n: same_expr(_resolve(scope, n), _resolve(scope, view)) or same_expr(n, view), module)
    sin = None
    signs = {}
    for k, (sign, call) in acc.items():
        found = None
        for t1, t2 in ((call.args[0], call.args[1]), (call.args[1], call.args[0])):  # type: ignore[attr-defined]
            row = _half_row(_resolve(scope, t1))
            s_node, s_sign = t2, sign
            neg = halves.neg_of(t2)
            if neg is not None:
                s_node, s_sign = neg, -sign
            s = _unsqueezed_at(s_node, scope)
            if row is not None and s is not None and (same_expr(row[0], view) or same_expr(_resolve(scope, row[0]), _resolve(scope, view))):
                found = (row[1], s, s_sign)
                break
        if found is None or found[0] != 1 - k:
            return (f"`{segment(module, call)}` adds to one half of `{out}` what is not the other half of "  # type: ignore[arg-type]
                    f"`{segment(module, view)}` times a sin table: not the half rotation")
        if sin is not None and not same_expr(sin, found[1]):
            return None
        sin, signs[k] = found[1], found[2]
    if signs[0] != -signs[1]:
        return (f"the two halves of `{out}` get the sin products with the same sign: a shear, not the rotation")
    # the row views must not be read after the merge (the fused code never binds them)
    end = merge.end_lineno or merge.lineno
    for name in rows:
        if _read_before_rebound(scope, name, end):
            return f"the half view `{name}` of `{out}` is read after the merge: the fused code does not bind it"
    value = ast.Tuple(elts=[], ctx=ast.Load())
    site: ast.Assign | ast.Return = ast.Return(value=value) if returned else ast.Assign(targets=[stmt.targets[0]], value=value)
    ast.copy_location(site, stmt)
    site.end_lineno, site.end_col_offset = merge.end_lineno, merge.end_col_offset
    # (a returned merge: the value spans the whole statement, the fused text says ``return``: _accumulated_match)
    ast.copy_location(value, stmt if returned else stmt.value)
    value.end_lineno, value.end_col_offset = merge.end_lineno, merge.end_col_offset
    return site, x, cos, sin, signs[0] == 1, upcast  # type: ignore[return-value]


def _halves_axis_view(module: ModuleInfo, scope: Scope, node: ast.Call) -> ast.expr | None:
    """x of a [..., 2, D/2] view of x (its halves as an axis): the canonical spellings, and
    ``x.reshape(*x.shape[:-1], 2, h)`` with h x's last dim // 2 (diffusers' LTX-2 port)."""
    got = canonical.two_axis_view(module, node, scope)
    if got is not None:
        return got[0] if got[1] == "outer2" else None
    if _method(node, "reshape", "view") and len(node.args) == 3 and not node.keywords:
        lead, two, h = node.args
        t = node.func.value  # type: ignore[attr-defined]
        if isinstance(lead, ast.Starred) and isinstance(lead.value, ast.Subscript) and isinstance(lead.value.value, ast.Attribute) \
                and lead.value.value.attr == "shape" and same_expr(lead.value.value.value, t) and isinstance(lead.value.slice, ast.Slice) \
                and lead.value.slice.lower is None and _is_int(lead.value.slice.upper, -1) and lead.value.slice.step is None \
                and _is_int(two, 2) and _Halves(scope, lambda n: same_expr(n, t))._is_half_point(h):
            return t
    return None


# s35: the half rotation accumulated in place (LTX-2's ``apply_split_rotary_emb`` and its copies in diffusers,
# DiffSynth-Studio, FastVideo, VeOmni): x's halves viewed as an axis [..., 2, D/2], multiplied by cos.unsqueeze(-2),
# then ``addcmul_`` of ∓sin times the other half into each half's view, the two axes merged back. Spellings below
# that none of those use: unflatten views with the rows updated inline and the sign given as ``value=-1``, a
# ``[..., None, :]`` table axis with the rows unpacked from a tuple and ``return y.flatten(-2)`` (FastVideo returns
# its einops merge), a class method
_ACCUMULATED_HALVES = '''
import torch
import torch.nn as nn


def split_rotate(x, cos, sin):
    last = x.shape[-1]
    r = last // 2
    split_x = x.reshape(*x.shape[:-1], 2, r).float()
    first_x = split_x[..., :1, :]
    second_x = split_x[..., 1:, :]
    cos_u = cos.unsqueeze(-2)
    sin_u = sin.unsqueeze(-2)
    out = split_x * cos_u
    first_out = out[..., :1, :]
    second_out = out[..., 1:, :]
    first_out.addcmul_(-sin_u, second_x)
    second_out.addcmul_(sin_u, first_x)
    out = out.reshape(*out.shape[:-2], last)
    return out.to(x.dtype)


def turn_by_rows(t, c, s):
    rows = t.unflatten(-1, (2, -1))
    acc = c.unsqueeze(dim=-2) * rows
    acc[..., 0:1, :].addcmul_(s.unsqueeze(-2), rows[..., 1:2, :], value=-1)
    acc[..., 1:2, :].addcmul_(rows[..., 0:1, :], s.unsqueeze(-2))
    acc = acc.flatten(-2)
    return acc


class HalfTurn(nn.Module):
    def forward(self, q, c, s):
        halves = q.view(*q.shape[:-1], 2, -1)
        y = halves * c[..., None, :]
        top, bottom = y[..., :1, :], y[..., 1:, :]
        top.addcmul_(halves[..., 1:, :], -s[..., None, :])
        bottom.addcmul_(halves[..., :1, :], s[..., None, :])
        return y.flatten(-2)
'''

_ACCUMULATED_HALVES_RUN = '''
x = torch.randn(2, 3, 5, 16, requires_grad=True)
ang = torch.randn(5, 8)
batch = torch.randn(2, 1, 5, 8)
xb = x.detach().to(torch.bfloat16).requires_grad_()
out = (split_rotate(x, ang.cos(), ang.sin()), split_rotate(xb, ang.cos(), ang.sin()), turn_by_rows(x, ang.cos(), ang.sin()),
       turn_by_rows(x, batch.cos(), batch.sin()), HalfTurn()(x, ang.cos(), ang.sin()))
leaves = [x, xb]
'''

RopePattern.FUSE += [
    Fuse(
        name="s35_half_rotation_accumulated_in_place",
        code=_ACCUMULATED_HALVES,
        expect={"mode": "half", "qualname": "split_rotate"},
        run=_ACCUMULATED_HALVES_RUN,
    ),
]

RopePattern.KEEP += [
    Keep(
        # both halves get +sin times the other: a shear, not the rotation
        _ACCUMULATED_HALVES.split("\n\n\ndef turn_by_rows")[0].replace("first_out.addcmul_(-sin_u, second_x)", "first_out.addcmul_(sin_u, second_x)") + "\n",
        name="s35_accumulated_halves_same_sign",
    ),
    Keep(
        # the first half accumulates its own half: x1 * (cos - sin), no rotation
        _ACCUMULATED_HALVES.split("\n\n\ndef turn_by_rows")[0].replace("first_out.addcmul_(-sin_u, second_x)", "first_out.addcmul_(-sin_u, first_x)") + "\n",
        name="s35_accumulated_halves_own_half",
    ),
    Keep(
        # the view puts the lane pairs on the last axis ([..., D/2, 2]): its rows ``[..., :1, :]`` are the first pair
        # of lanes, not a half of the head dim
        "\nimport torch\n\n\ndef turn_by_rows" + _ACCUMULATED_HALVES.split("\n\n\ndef turn_by_rows")[1].split("\n\n\nclass HalfTurn")[0]
        .replace("t.unflatten(-1, (2, -1))", "t.unflatten(-1, (-1, 2))") + "\n",
        name="s35_accumulated_rows_of_lane_pairs",
    ),
]

# s39 (HO14a vats ``RoPE._apply_rope``): the interleaved rotation's parts stacked in one statement and the pair axis
# merged in the next (``t = stack([r1, r2], -1)`` then ``t = t.flatten(-2)``): the stack statement is the site (its
# result viewed [.., D/2, 2] as written), the merge runs as written after it
_S39_STACK_THEN_FLATTEN = '''
import torch
from torch import nn


class RoPE(nn.Module):
    def __init__(self, head_dim=8, max_len=16):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        ang = torch.outer(torch.arange(max_len).float(), inv)
        self.register_buffer("cos_cached", ang.cos())
        self.register_buffer("sin_cached", ang.sin())

    def forward(self, x):
        T = x.size(1)
        cos_freqs = self.cos_cached[None, :T, None, :]
        sin_freqs = self.sin_cached[None, :T, None, :]
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
        rotated_x1 = x1 * cos_freqs - x2 * sin_freqs
        rotated_x2 = x1 * sin_freqs + x2 * cos_freqs
        rotated_x = torch.stack([rotated_x1, rotated_x2], dim=-1)
        rotated_x = rotated_x.flatten(-2)
        return rotated_x
'''

RopePattern.FUSE += [
    Fuse(_S39_STACK_THEN_FLATTEN, expect={"mode": "interleave", "qualname": "RoPE.forward"}, run='''
m = RoPE()
x = torch.randn(2, 5, 3, 8, requires_grad=True)
out = m(x)
leaves = [x]
''', name="s39_interleaved_stack_merged_in_the_next_statement"),
]
RopePattern.KEEP += [
    Keep(
        # both parts add their products: a shear of the lane pairs, not a rotation
        _S39_STACK_THEN_FLATTEN.replace("x1 * cos_freqs - x2 * sin_freqs", "x1 * cos_freqs + x2 * sin_freqs"),
        name="s39_stack_then_flatten_of_a_shear",
    ),
    Keep(
        # a rotated part is read again after the stack: the fused call does not produce it
        _S39_STACK_THEN_FLATTEN.replace("        return rotated_x\n", "        return rotated_x, rotated_x1\n"),
        name="s39_stack_then_flatten_part_read_later",
    ),
]

# s40 (HO16b reflow): the interleaved rotation written as complex arithmetic on einops real / imaginary parts with named
# axes (the pair axis split to the front and unpacked; the rotated parts stacked in their own statement and merged by
# ``rearrange(.., "b h n d split -> b h n (d split)")``): interleave mode with repeat_interleave'd tables
_S40_EINOPS_NAMED_AXES = '''
import torch
from einops import rearrange


def apply_rope(q, freq_cos, freq_sin):
    q_r, q_i = rearrange(q, "b h n (d split) -> split b h n d", split=2)
    q_out_r = q_r * freq_cos - q_i * freq_sin
    q_out_i = q_r * freq_sin + q_i * freq_cos
    q_out = torch.stack([q_out_r, q_out_i], dim=-1)
    return rearrange(q_out, "b h n d split -> b h n (d split)", split=2)
'''

RopePattern.FUSE += [
    # einops is not a dependency: tests/test_detect_s40_attention.py runs this one under a minimal stand-in
    Fuse(_S40_EINOPS_NAMED_AXES, expect={"mode": "interleave", "targets": ["q"]}, name="s40_einops_named_axes_real_imag"),
]
RopePattern.KEEP += [
    Keep(
        # merged as (split d): the rotated parts laid out as halves, from interleaved input: no one mode computes that
        _S40_EINOPS_NAMED_AXES.replace('"b h n d split -> b h n (d split)"', '"b h n d split -> b h n (split d)"'),
        name="s40_einops_parts_merged_as_halves",
    ),
]

# s40 (HO15a mini-llm-brawl): torchtune's RotaryPositionalEmbeddings built in the model (the rotation runs in the
# library's forward): swapped where built (``_library_rope``); tests/test_detect_s40_attention.py runs it against a
# stand-in spelled as torchtune's releases
_S40_TORCHTUNE_ROPE = '''
import torch
from torch import nn
from torchtune.modules import RotaryPositionalEmbeddings


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qk = nn.Linear(d, 2 * d)
        self.pos_emb = RotaryPositionalEmbeddings(d // heads, 64)

    def forward(self, x):
        b, s, _ = x.shape
        q, k = self.qk(x).view(b, s, 2, self.heads, -1).unbind(2)
        return self.pos_emb(q), self.pos_emb(k)
'''

RopePattern.FUSE += [
    Fuse(_S40_TORCHTUNE_ROPE, expect={"module": "torchtune.RotaryPositionalEmbeddings", "mode": "interleave"},
         name="s40_torchtune_rope_module_swapped_where_built"),
]
RopePattern.KEEP += [
    Keep(
        # the repository's own class of that name: not the library's, nothing to swap (its forward is read where defined)
        _S40_TORCHTUNE_ROPE.replace("from torchtune.modules import RotaryPositionalEmbeddings\n",
                                    "\n\nclass RotaryPositionalEmbeddings(nn.Module):\n    def forward(self, x):\n        return x\n"),
        name="s40_rope_class_of_the_repository_named_like_the_library",
    ),
]
