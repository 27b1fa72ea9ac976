"""s40 (wrong40): can a mask built in view leave a query row with no key?

A row every key of which is masked gives NaN in torch (SDPA with a bool mask, a ``-inf`` fill before softmax) or a
uniform average (a finite fill); npu_fusion_attention's output there is not pinned down (spec 5.1 / 14). A causal
triangle with its diagonal, or key padding of a non-empty sequence, keeps a key in every row; a band that excludes
the query itself (``(i - j).abs() <= w & (i != j)``), a strict causal triangle (``j < i``: row 0 empty), a dilated
pattern need not. Decided by mechanism: the mask's construction, when it is made of index arithmetic this module
reads (``arange``, ``ones`` / ``eye`` / ``full``, ``tril`` / ``triu``, comparisons, ``& | ~ ^``, ``abs``, ``%``,
``where``, ``masked_fill``, broadcasting subscripts), is evaluated on small sizes, every other scalar it reads (a
length, a window, a stride) given the positive values 1, 2, 3, 5 and 8 in every combination (fewer values each where two or three combine). Verdicts:

* ``kept``: every evaluation keeps a key in every row: nothing changes;
* ``empty``: every evaluation leaves some row (``rows``) without a key: no rewrite (a near miss saying so);
* ``varies``: some do and some do not (``w = 0``-like sizes, a band of width 1 on one key): the fused branch runs
  only under a run-time check that every query row keeps a key.

None when the construction is not read (a mask handed in, a module call): what the detectors did before holds."""

from __future__ import annotations

import ast
import itertools
import math
from typing import Any, Callable, Iterator, Optional

from npufuse.patterns import _attention_s45h
# s46: fast_walk / child_nodes for ast.walk / ast.iter_child_nodes (the same nodes, in the same order)
from npufuse.scan.dataflow import child_nodes, fast_walk

# torch is imported only when a mask construction is evaluated: a scan imports no torch otherwise (~1.7 s of start-up)
torch: Any = None


def _load_torch() -> None:
    global torch
    if torch is None:
        import torch as _torch

        torch = _torch

SAMPLES = (1, 2, 3, 5, 8)
_GRIDS = {2: (1, 2, 5, 8), 3: (1, 2, 8), 4: (1, 2, 8)}  # fewer values per unknown where several combine
_MAX_UNKNOWNS = 4
# s41 review: the evaluation builds real tensors, and a repository's constants (a helper's ``torch.ones(65536, 65536)``,
# a bound argument ``make_mask(100_000)``) are read as written: every tensor it would build is bounded first (a larger
# one is not evaluated: the construction is not read), so a hostile file cannot make the scan allocate gigabytes
_MAX_ELEMENTS = 1 << 22
_INDEX_WORDS = ("arange", "tril", "triu", "eye")
_CASTS = frozenset(("bool", "float", "half", "long", "int", "double", "bfloat16", "contiguous", "clone", "detach", "cpu",
                    "cuda", "npu", "requires_grad_"))


class _Unread(Exception):
    """A part of the construction this module does not evaluate."""


class _Excluded(Exception):
    """Sizes the helper refuses (its ``if <test>: raise`` / ``assert`` holds for them): not a size it runs at."""


class RowVerdict:
    """``kind``: kept / empty / varies; ``rows``: the query rows every evaluation leaves empty (``empty``)."""

    __slots__ = ("kind", "rows")

    def __init__(self, kind: str, rows: tuple[int, ...] = ()) -> None:
        self.kind, self.rows = kind, rows

    def describe(self) -> str:
        if self.kind == "empty":
            which = f"query row {self.rows[0]}" if len(self.rows) == 1 else \
                "query rows " + ", ".join(str(r) for r in self.rows[:3]) if self.rows else "some query row"
            return (f"its construction leaves {which} without any key at every size npufuse evaluates it at "
                    f"(each length / window / stride it reads set to values from {SAMPLES[0]} to {SAMPLES[-1]}): torch gives such a row NaN (or a uniform average with a finite fill), "
                    "npu_fusion_attention's output on a fully masked row is not pinned down (spec 5.1 / 14)")
        return ("its construction can leave a query row without any key (it does at some of the sizes npufuse evaluates "
                "it at, keeps one at others)")


def _name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _is_torch_fn(call: ast.Call) -> bool:
    f = call.func
    return isinstance(f, ast.Attribute) and _key(f.value) in ("torch", "th")


def _key(n: Any) -> str:
    """A leaf's text, a detector's symbolic local (``Ref``) read as its name."""
    if type(n).__name__ == "Ref":
        return str(getattr(n, "name", "?"))
    if isinstance(n, ast.Name):
        return n.id
    if isinstance(n, ast.Attribute):
        return f"{_key(n.value)}.{n.attr}"
    if isinstance(n, ast.Subscript):
        return f"{_key(n.value)}[{_key(n.slice)}]"
    if isinstance(n, ast.Constant):
        return repr(n.value)
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
        return f"-{_key(n.operand)}"
    if isinstance(n, ast.Call):
        return f"{_key(n.func)}({', '.join(_key(a) for a in n.args)})"
    if isinstance(n, ast.Tuple):
        return f"({', '.join(_key(a) for a in n.elts)})"
    return type(n).__name__


class _Evaluator:
    """Evaluates one construction with ``env`` (unknown scalar text -> int); ``resolve`` maps a Name / Ref /
    ``self.`` attribute to the expression it holds (None: unknown scalar)."""

    def __init__(self, resolve: Callable[[Any], Any], env: dict[str, int]) -> None:
        self.resolve, self.env, self.depth = resolve, env, 0

    def scalar(self, node: Any) -> int:
        key = _key(node)
        if key not in self.env:
            raise _Unread(key)
        return self.env[key]

    def ev(self, node: Any) -> Any:
        self.depth += 1
        if self.depth > 200:
            raise _Unread("too deep")
        try:
            return self._ev(node)
        finally:
            self.depth -= 1

    def _ev(self, node: Any) -> Any:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (int, float, bool)) or node.value is None:
                return node.value
            raise _Unread("constant")
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(self.ev(e) for e in node.elts)
        if isinstance(node, ast.Name) and node.id in ("None",):
            return None
        if isinstance(node, ast.expr) and type(node).__name__ in ("Ref", "Name", "Attribute") \
                or isinstance(node, ast.Subscript) and _shape_read(node):
            if isinstance(node, ast.Attribute) and _key(node) in ("math.inf", "torch.inf", "np.inf", "numpy.inf"):
                return math.inf
            value = self.resolve(node)
            if value is not None:
                return self.ev(value)
            return self.scalar(node)
        if isinstance(node, ast.UnaryOp):
            x = self.ev(node.operand)
            if isinstance(node.op, ast.USub):
                return -x
            if isinstance(node.op, ast.Invert):
                if not isinstance(x, torch.Tensor):
                    raise _Unread("~ of a scalar")  # an unknown read as a number was a mask tensor
                return ~x
            if isinstance(node.op, ast.Not) and not isinstance(x, torch.Tensor):
                return not x
            raise _Unread("unary")
        if isinstance(node, ast.BinOp):
            a, b = self.ev(node.left), self.ev(node.right)
            ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b, ast.FloorDiv: lambda: a // b,
                   ast.Mod: lambda: a % b, ast.BitAnd: lambda: a & b, ast.BitOr: lambda: a | b, ast.BitXor: lambda: a ^ b,
                   ast.Div: lambda: a / b}
            op = ops.get(type(node.op))
            if op is None:
                raise _Unread("binop")
            if isinstance(node.op, (ast.BitAnd, ast.BitOr, ast.BitXor)) and not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                raise _Unread("a logical operation with a scalar")  # an unknown read as a number was a mask tensor
            _bounded(a, b)
            return op()
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            a, b = self.ev(node.left), self.ev(node.comparators[0])
            ops = {ast.Lt: lambda: a < b, ast.LtE: lambda: a <= b, ast.Gt: lambda: a > b, ast.GtE: lambda: a >= b,
                   ast.Eq: lambda: a == b, ast.NotEq: lambda: a != b}
            op = ops.get(type(node.ops[0]))
            if op is None:
                raise _Unread("compare")
            _bounded(a, b)
            return op()
        if isinstance(node, ast.Subscript):
            base = self.ev(node.value)
            if not isinstance(base, torch.Tensor):
                raise _Unread("subscript")
            return base[self._index(node.slice)]
        if isinstance(node, ast.BoolOp):
            vals = [self.ev(v) for v in node.values]
            if any(isinstance(v, torch.Tensor) for v in vals):
                raise _Unread("a boolean operator over tensors")
            return all(vals) if isinstance(node.op, ast.And) else any(vals)
        if isinstance(node, ast.IfExp):
            raise _Unread("conditional")
        if isinstance(node, ast.Call):
            return self._call(node)
        raise _Unread(type(node).__name__)

    def check_guards(self, node: Any) -> None:
        """Raises :class:`_Excluded` where a guard of the helper returning ``node`` holds for these sizes (a size the
        helper refuses, ``if key_length < query_length: raise``); a guard it cannot evaluate is not applied."""
        for test in getattr(self.resolve, "guards", {}).get(id(node), ()):
            try:
                hit = self.ev(test)
            except (_Unread, RuntimeError, TypeError, ValueError, IndexError, KeyError, ZeroDivisionError, AttributeError):
                continue
            if not isinstance(hit, torch.Tensor) and hit:
                raise _Excluded()

    def _index(self, s: Any) -> Any:
        if isinstance(s, ast.Tuple):
            return tuple(self._index(e) for e in s.elts)
        if isinstance(s, ast.Slice):
            return slice(*(self.ev(x) if x is not None else None for x in (s.lower, s.upper, s.step)))
        if isinstance(s, ast.Constant) and s.value is Ellipsis:
            return Ellipsis
        v = self.ev(s)
        if isinstance(v, torch.Tensor):
            raise _Unread("tensor index")
        return v

    def _sizes(self, args: list[Any]) -> tuple[int, ...]:
        vals = [self.ev(a) for a in args]
        if len(vals) == 1 and isinstance(vals[0], tuple):
            vals = list(vals[0])
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            raise _Unread("sizes")
        _bounded_shape(vals)
        return tuple(vals)

    def _call(self, call: ast.Call) -> Any:
        name = _name(call)
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        as_bool = "dtype" in kw and _key(kw["dtype"]) == "torch.bool"
        func = call.func
        method = isinstance(func, ast.Attribute) and not _is_torch_fn(call)
        if name == "float" and isinstance(func, ast.Name) and call.args:
            text = call.args[0].value if isinstance(call.args[0], ast.Constant) else None
            if isinstance(text, str) and text.strip().lower() in ("-inf", "inf", "+inf", "-infinity"):
                return -math.inf if text.strip().startswith("-") else math.inf
            raise _Unread("float")
        if name in ("len",) and isinstance(func, ast.Name) or name in ("size",) and method or name == "numel":
            return self.scalar(call)
        if name == "min" and isinstance(func, ast.Attribute) and "finfo" in _key(func.value):
            return -math.inf  # the most negative float: masks like -inf
        inline = getattr(self.resolve, "inline", None)
        body = inline(call) if inline is not None and not _is_torch_fn(call) else None
        if body is not None:
            self.check_guards(body)
            return self.ev(body)  # s41: a helper's one return, its parameters bound to the call's arguments
        if not method:
            if not _is_torch_fn(call):
                raise _Unread(name)
            out = self._torch(name, call, kw)
        else:
            recv = self.ev(func.value)  # type: ignore[union-attr]
            if not isinstance(recv, torch.Tensor):
                raise _Unread("method of a scalar")
            out = self._method(name, recv, call, kw)
        if as_bool and isinstance(out, torch.Tensor):
            out = out.bool()
        return out

    def _torch(self, name: str, call: ast.Call, kw: dict[str, Any]) -> Any:
        args = call.args
        if name == "arange":
            vals = [self.ev(a) for a in args]
            if "end" in kw:
                vals.append(self.ev(kw["end"]))
            if "start" in kw:
                vals.insert(0, self.ev(kw["start"]))
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals) or not vals:
                raise _Unread("arange bounds")
            lo, hi, step = (0, vals[0], 1) if len(vals) == 1 else (vals[0], vals[1], vals[2] if len(vals) > 2 else 1)
            if step == 0 or (hi - lo) / step > _MAX_ELEMENTS:
                raise _Unread("a longer arange than npufuse evaluates")
            return torch.arange(*vals)
        if name in ("ones", "zeros", "empty_like_never"):
            return (torch.ones if name == "ones" else torch.zeros)(self._sizes(list(args)))
        if name == "full" and len(args) >= 2:
            return torch.full(self._sizes([args[0]]), float(self.ev(args[1])))
        if name == "eye" and args:
            return torch.eye(*self._sizes(list(args)))
        if name in ("tril", "triu") and args:
            d = self.ev(args[1]) if len(args) > 1 else self.ev(kw["diagonal"]) if "diagonal" in kw else 0
            return getattr(torch, name)(self.ev(args[0]), int(d))
        if name in ("abs", "logical_not") and len(args) == 1:
            return getattr(torch, name)(self.ev(args[0]))
        if name in ("logical_and", "logical_or", "logical_xor", "remainder", "fmod", "eq", "ne", "lt", "le", "gt", "ge",
                    "minimum", "maximum") and len(args) == 2:
            x, y = torch.as_tensor(self.ev(args[0])), torch.as_tensor(self.ev(args[1]))
            _bounded(x, y)
            return getattr(torch, name)(x, y)
        if name == "where" and len(args) == 3:
            c, a, b = (self.ev(x) for x in args)
            _bounded(c, a, b)
            return torch.where(c, torch.as_tensor(a), torch.as_tensor(b))
        if name in ("zeros_like", "ones_like") and args:
            return getattr(torch, name)(self.ev(args[0]))
        if name in _attention_s45h.ROUNDING + _attention_s45h.CLAMPS and args:  # s45: bucket boundaries (ceil, clamp)
            out = _attention_s45h.rounding_op(torch, name, self.ev(args[0]), [self.ev(a) for a in args[1:]], kw, self.ev)
            if out is not NotImplemented:
                return out
        raise _Unread(f"torch.{name}")

    def _method(self, name: str, recv: torch.Tensor, call: ast.Call, kw: dict[str, Any]) -> Any:
        args = [self.ev(a) for a in call.args]
        if name in _CASTS:
            return recv.bool() if name == "bool" else recv if name not in ("float", "half", "double", "bfloat16", "long", "int") \
                else recv.float() if name in ("float", "half", "double", "bfloat16") else recv.long()
        if name == "to":
            text = _key(call.args[0]) if call.args else _key(kw.get("dtype", ast.Constant(None)))
            return recv.bool() if text == "torch.bool" else recv.float() if "float" in text or "half" in text else recv
        if name in ("tril", "triu"):
            d = args[0] if args else self.ev(kw["diagonal"]) if "diagonal" in kw else 0
            return getattr(recv, name)(int(d))
        if name in ("unsqueeze", "squeeze") and len(args) <= 1:
            return getattr(recv, name)(*args)
        if name in ("abs", "logical_not", "t"):
            return getattr(recv, name)()
        if name in ("logical_and", "logical_or", "logical_xor", "eq", "ne", "lt", "le", "gt", "ge", "remainder", "fmod") and len(args) == 1:
            _bounded(recv, args[0])
            return getattr(recv, name)(torch.as_tensor(args[0]))
        if name in ("masked_fill",) and len(args) == 2 and isinstance(args[0], torch.Tensor):
            _bounded(recv, args[0])
            return recv.float().masked_fill(args[0].bool(), float(args[1])) if not recv.is_floating_point() and not isinstance(args[1], bool) \
                else recv.masked_fill(args[0].bool(), args[1])
        if name in ("view", "reshape", "expand") and all(isinstance(a, int) for a in args):
            if name == "expand":
                _bounded_shape([s if a == -1 else a for a, s in zip(args, (1,) * (len(args) - recv.dim()) + tuple(recv.shape))])
            return getattr(recv, name)(*args)
        if name == "transpose" and len(args) == 2:
            return recv.transpose(*args)
        if name in _attention_s45h.ROUNDING + _attention_s45h.CLAMPS:  # s45: bucket boundaries (ceil, clamp)
            out = _attention_s45h.rounding_op(torch, name, recv, args, kw, self.ev)
            if out is not NotImplemented:
                return out
        raise _Unread(f".{name}")


def _bounded_shape(shape: Any) -> None:
    """Raises :class:`_Unread` for a tensor of more than ``_MAX_ELEMENTS`` elements (or a negative size)."""
    n = 1
    for d in shape:
        if not isinstance(d, int) or d < 0:
            raise _Unread("sizes")
        n *= d
        if n > _MAX_ELEMENTS:
            raise _Unread("a larger tensor than npufuse evaluates")


def _bounded(*values: Any) -> None:
    """The broadcast of ``values`` (tensors among scalars) is not larger than ``_MAX_ELEMENTS``: checked before an
    elementwise operation builds it."""
    shapes = [tuple(v.shape) for v in values if isinstance(v, torch.Tensor)]
    if len(shapes) > 1:
        try:
            _bounded_shape(torch.broadcast_shapes(*shapes))
        except RuntimeError as exc:
            raise _Unread("shapes that do not broadcast") from exc


def _inlined(resolve: Callable[[Any], Any], n: Any) -> Any:
    """The one return of the repository helper the call ``n`` runs (None: not a call, not a helper, several returns)."""
    inline = getattr(resolve, "inline", None)
    return inline(n) if inline is not None and isinstance(n, ast.Call) and not _is_torch_fn(n) else None


def _shape_read(node: ast.Subscript) -> bool:
    # s45: ``x.size()[1]`` (a tuple unpacked from ``x.size()``) is a size read as ``x.shape[1]`` is
    return isinstance(node.value, ast.Attribute) and node.value.attr == "shape" or isinstance(node.value, ast.Call) \
        and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "size" and not node.value.args


_OVER_BUDGET = object()


def _each_once(stack: list[Any], budget: int) -> Iterator[Any]:
    """Pops ``stack`` (which the caller extends while it walks) and yields each AST node once, then ``_OVER_BUDGET``
    (and stops) after ``budget`` nodes."""
    seen: set[int] = set()
    while stack:
        n = stack.pop()
        if id(n) in seen or not isinstance(n, ast.AST):
            continue
        seen.add(id(n))
        budget -= 1
        if budget < 0:
            yield _OVER_BUDGET
            return
        yield n


def _unknowns(node: Any, resolve: Callable[[Any], Any], limit: int = 400) -> Optional[list[str]]:
    """The texts of the scalar leaves the evaluation will ask for (names / attributes / shape reads without a
    definition it follows), in order; None past ``limit`` nodes."""
    out: list[str] = []
    stack: list[Any] = [node]
    for n in _each_once(stack, limit):
        if n is _OVER_BUDGET:
            return None
        leaf = type(n).__name__ in ("Ref", "Name", "Attribute") or isinstance(n, ast.Subscript) and _shape_read(n) \
            or isinstance(n, ast.Call) and (_name(n) == "len" and isinstance(n.func, ast.Name) or _name(n) in ("size", "numel")
                                            and isinstance(n.func, ast.Attribute))
        if leaf and not isinstance(n, ast.Call):
            if isinstance(n, ast.Attribute) and _key(n) in ("math.inf", "torch.inf", "torch.bool", "np.inf"):
                continue
            if _key(n) in ("torch", "th", "math", "None", "True", "False"):
                continue
            value = resolve(n)
            if value is not None:
                stack.append(value)
                continue
            text = _key(n)
            if text not in out:
                out.append(text)
            continue
        if isinstance(n, ast.Call) and leaf:
            text = _key(n)
            if text not in out:
                out.append(text)
            continue
        body = _inlined(resolve, n)
        if body is not None:
            stack.append(body)  # s41: a helper's return, read with its parameters bound
            continue
        if isinstance(n, ast.Call):
            # the callee's receiver is evaluated (a method), a torch function's name is not a leaf; keywords other
            # than sizes / diagonal (device, dtype) are not read
            f = n.func
            if isinstance(f, ast.Attribute) and not _is_torch_fn(n):
                stack.append(f.value)
            stack += list(n.args) + [k.value for k in n.keywords if k.arg in ("diagonal", "end", "start", "min", "max")]
            continue
        if isinstance(n, ast.Attribute):
            continue
        stack += child_nodes(n)
    return out


_METADATA = frozenset(("device", "dtype", "shape", "ndim", "size", "dim", "numel", "finfo", "iinfo"))
_SIZE_FACTORIES = frozenset(("arange", "ones", "zeros", "full", "eye", "empty", "ones_like", "zeros_like", "full_like"))


def construction_nodes(node: Any, resolve: Callable[[Any], Any], budget: int = 400) -> Iterator[tuple[ast.AST, bool]]:
    """(node, read as a size) over a mask's construction: names / ``self.`` attributes followed through ``resolve``, a
    helper's one return inlined (at most ``budget`` visits); the arguments of ``arange`` / ``ones`` / ``eye`` / ...
    and what they read are sizes, not index values, as is what metadata (``.device``, ``.shape``, ``.size()``) is
    read from."""
    stack: list[tuple[Any, bool]] = [(node, False)]
    seen: set[int] = set()
    while stack and budget:
        budget -= 1
        n, sized = stack.pop()
        if id(n) in seen or not isinstance(n, ast.AST):
            continue
        seen.add(id(n))
        yield n, sized
        body = _inlined(resolve, n)
        if body is not None:
            stack.append((body, sized))
            continue
        if isinstance(n, ast.Attribute) and n.attr in _METADATA:
            stack.append((n.value, True))  # ``scores.device`` / ``x.shape``: what it is read from gives no index value
            continue
        if type(n).__name__ in ("Ref", "Name", "Attribute"):
            value = resolve(n)
            if value is not None:
                stack.append((value, sized))
            if isinstance(n, ast.Attribute):
                stack.append((n.value, sized))
            continue
        inner = sized or isinstance(n, ast.Call) and _name(n) in _METADATA or isinstance(n, ast.Call) and _name(n) in _SIZE_FACTORIES
        stack += [(c, inner) for c in child_nodes(n)]


def index_built(node: Any, resolve: Callable[[Any], Any]) -> bool:
    """Does the construction (followed through ``resolve``) call ``arange`` / ``tril`` / ``triu`` / ``eye``?"""
    return any(isinstance(n, ast.Call) and _name(n) in _INDEX_WORDS for n, _sized in construction_nodes(node, resolve))


def row_verdict(node: Any, polarity: str, resolve: Callable[[Any], Any]) -> Optional[RowVerdict]:
    """Whether the mask ``node`` keeps a key in every query row (see the module's doc). ``polarity``: ``keep``
    (True = attended), ``masked`` (True = masked), ``additive`` (masked where < 0), ``keep01`` (masked where 0),
    ``auto`` (bool: keep, else additive).

    s41 (wrong41): a mask a repository helper returns (``self._band(n, w)``, a module function, a nested builder, a
    mask cached and rebuilt) is read per path: every ``return`` of the helper (a local stored more than once: each
    store), each evaluated with the helper's parameters bound to the call's arguments. All keep a key: ``kept``; all
    leave a row empty: ``empty``; otherwise, where the helper builds its mask from index arithmetic (a path npufuse
    does not evaluate -- a cache lookup, a size it cannot read -- may still empty a row): ``varies``, the run-time
    check decides."""
    paths = _helper_paths(node, resolve)
    if paths is not None:
        verdict = _combined([p if p is _NO_MASK else _one_verdict(p, polarity, resolve) for p in paths],
                            any(p is not _NO_MASK and index_built(p, resolve) for p in paths))
    else:
        verdict = _one_verdict(node, polarity, resolve)
    if (verdict is None or verdict.kind == "varies") and paths is not None:
        from npufuse.patterns import _attention_s50c

        if _attention_s50c.diagonal_kept(node, polarity, resolve):
            return RowVerdict("kept")  # s50c: key j = i proved kept on every path of the helper, for every size
    if verdict is None:
        from npufuse.patterns import _attention_s46

        return _attention_s46.unread_rows(node, resolve)  # s46: a construction not evaluated that can still empty a row
    return verdict


def _combined(verdicts: list[Optional[RowVerdict] | object], index_made: bool) -> Optional[RowVerdict]:
    kinds = ["kept" if v is _NO_MASK else v.kind if isinstance(v, RowVerdict) else None for v in verdicts]
    if kinds and all(k == "kept" for k in kinds):
        return RowVerdict("kept")
    if kinds and all(k == "empty" for k in kinds):
        rows = set.intersection(*(set(v.rows) for v in verdicts if isinstance(v, RowVerdict)))
        return RowVerdict("empty", tuple(sorted(rows)))
    if any(k in ("empty", "varies") for k in kinds) or index_made:
        return RowVerdict("varies")
    return None


_NO_MASK = object()  # a helper path returning None: no mask, every key kept
_MAX_PATHS = 8


def _helper_paths(node: Any, resolve: Callable[[Any], Any]) -> Optional[list[Any]]:
    """The expressions a mask reaching the site from a repository helper may be (each ``return`` of the helper, each
    store of a local it returns, followed into helpers those call), None when the mask comes from no helper."""
    paths_of = getattr(resolve, "paths", None)
    if paths_of is None:
        return None
    out: list[Any] = []
    through_helper = False
    stack: list[tuple[Any, int]] = [(node, 0)]
    seen: set[int] = set()
    while stack:
        n, depth = stack.pop()
        if id(n) in seen:
            continue  # a cache storing the value it read: nothing new on this path
        seen.add(id(n))
        if len(out) + len(stack) > _MAX_PATHS or depth > 12:
            return out + [_UNREAD_NODE] if through_helper else None
        if isinstance(n, ast.Constant) and n.value is None:
            out.append(_NO_MASK)
            continue
        while isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and (n.func.attr in _CASTS or n.func.attr == "to") \
                and not _is_torch_fn(n):
            n = n.func.value  # a cast / move of the helper's result keeps its rows
        got = paths_of(n)
        if got is None:
            out.append(n)
            continue
        helper, values = got
        through_helper = through_helper or helper
        stack += [(v, depth + 1) for v in reversed(values)]
    return out if through_helper else None


def _one_verdict(node: Any, polarity: str, resolve: Callable[[Any], Any]) -> Optional[RowVerdict]:
    if not index_built(node, resolve):
        return None
    names = _unknowns(node, resolve)
    if names is None or len(names) > _MAX_UNKNOWNS:
        return None
    _load_torch()
    empties: list[bool] = []
    common: Optional[set[int]] = None
    grid = SAMPLES if len(names) <= 1 else _GRIDS[len(names)]  # 5, 16 or 27 evaluations
    for values in itertools.product(grid, repeat=len(names)):
        try:
            with torch.no_grad():
                evaluator = _Evaluator(resolve, dict(zip(names, values)))
                evaluator.check_guards(node)
                m = evaluator.ev(node)
        except _Excluded:
            continue  # s41: sizes the helper raises on
        except (_Unread, RuntimeError, TypeError, ValueError, IndexError, KeyError, ZeroDivisionError, AttributeError):
            return None
        if not isinstance(m, torch.Tensor) or m.dim() == 0 or m.numel() == 0:
            return None
        keep = _keep(m, polarity)
        if keep.dim() == 1:
            keep = keep.unsqueeze(0)
        no_key = ~keep.any(-1)  # [..., Sq]: True where the row keeps no key
        empty = bool(no_key.any())
        empties.append(empty)
        if len(set(empties)) == 2:
            return RowVerdict("varies")  # both seen: the answer is the run-time check's
        if empty:
            rows = set(torch.nonzero(no_key.reshape(-1, no_key.shape[-1]).any(0)).flatten().tolist())
            common = rows if common is None else common & rows
    if not empties:
        return None
    if not any(empties):
        return RowVerdict("kept")
    if all(empties):
        return RowVerdict("empty", tuple(sorted(common or ())))
    return RowVerdict("varies")


def _keep(m: torch.Tensor, polarity: str) -> torch.Tensor:
    if polarity == "keep" or polarity == "auto" and m.dtype == torch.bool:
        return m.bool()
    if polarity == "masked":
        return ~m.bool()
    if polarity == "keep01":
        return m != 0
    return ~(m < 0)


def repeated_call(text: str) -> Optional[str]:
    """The first call of a method of the object or of a repository function in the mask's text (``self.get_mask(i,
    j)``, ``make_mask(n)``): a run-time check rendering the text before the fused branch renders it again calls it
    twice (s41). None when the text calls none (torch functions, tensor methods)."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return text
    for n in fast_walk(tree):
        if isinstance(n, ast.Call) and not _is_torch_fn(n) and (
                isinstance(n.func, ast.Name) and n.func.id not in ("float", "int", "bool", "len", "min", "max", "abs")
                or isinstance(n.func, ast.Attribute) and _key(n.func.value) == "self"):
            return ast.unparse(n)
    return None


def row_check(text: str, polarity: str) -> str:
    """A run-time condition that every query row of the mask ``text`` keeps a key."""
    t = text if text.isidentifier() else f"({text})"
    if polarity == "keep":
        return f"bool({t}.any(-1).all())"
    if polarity == "masked":
        return f"not bool({t}.all(-1).any())"
    if polarity == "keep01":
        return f"bool(({t} != 0).any(-1).all())"
    if polarity == "additive":
        return f"bool(({t} >= 0).any(-1).all())"
    return f"bool(({t} if {t}.dtype == torch.bool else {t} >= 0).any(-1).all())"


ROW_CHECK_RISK = ("the mask is built so that a query row can keep no key (every key masked): torch gives such a row NaN "
                  "(or a uniform average), npu_fusion_attention's value there is not pinned down (spec 5.1 / 14); the fused "
                  "call runs where every query row keeps a key (checked at run time: a host sync), the original otherwise")


class _Frame:
    """A function whose code a mask's construction is read in: ``fn``; ``params``: what its parameters stand for (the
    call's argument, a constant default; None: an unknown scalar); ``parent``: the enclosing function's frame (a
    nested builder's free variables are its); ``same_class``: a method of the site's class (``self.`` attributes are
    the site's); ``site_closure``: a function nested in the site's own function (free variables are the site's)."""

    __slots__ = ("fn", "params", "parent", "same_class", "site_closure")

    def __init__(self, fn: ast.AST, params: Optional[dict[str, Any]] = None, parent: Optional["_Frame"] = None,
                 same_class: bool = False, site_closure: bool = False) -> None:
        self.fn, self.params, self.parent = fn, params or {}, parent
        self.same_class, self.site_closure = same_class, site_closure

    def chain(self) -> list[ast.AST]:
        out, fr = [], self
        while fr is not None:
            out.append(fr.fn)
            fr = fr.parent
        return out


_MAX_FRAMES = 4  # helpers followed inside helpers


def _frames(frame: Optional[_Frame]) -> list[_Frame]:
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.parent
    return out


def _truth(test: ast.AST, params: dict[str, Any]) -> Optional[bool]:
    """A helper's ``if`` test on a parameter the call binds to a constant (``if include_self:``, ``if not causal:``,
    ``if w is None:``): its value; None when it is not known."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _truth(test.operand, params)
        return None if inner is None else not inner
    if isinstance(test, ast.Name) and isinstance(params.get(test.id), ast.Constant):
        return bool(params[test.id].value)
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot)) \
            and isinstance(test.left, ast.Name) and isinstance(params.get(test.left.id), ast.Constant) \
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None:
        same = params[test.left.id].value is None
        return same if isinstance(test.ops[0], ast.Is) else not same
    return None


def _returns(stmts: list[ast.stmt], truth: Callable[[ast.AST], Optional[bool]]) -> tuple[list[ast.Return], bool]:
    """The ``return`` statements of a function body that can run (an ``if`` arm a constant-bound test rules out, and
    statements after a branch that always returns, are left out), and whether the block always returns."""
    out: list[ast.Return] = []
    for st in stmts:
        if isinstance(st, ast.Return):
            out.append(st)
            return out, True
        if isinstance(st, ast.If):
            t = truth(st.test)
            arms = [st.body] if t is True else [st.orelse] if t is False else [st.body, st.orelse]
            ends = []
            for arm in arms:
                got, ended = _returns(arm, truth)
                out += got
                ends.append(ended)
            if all(ends):
                return out, True
        elif not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out += [r for r in _own_nodes(st) if isinstance(r, ast.Return)] + ([st] if isinstance(st, ast.Return) else [])
    return out, False


def _own_nodes(fn: ast.AST) -> list[ast.AST]:
    """The nodes of ``fn``'s own body: a nested function's (or class's, lambda's) body is its own."""
    out: list[ast.AST] = []
    stack = child_nodes(fn)
    while stack:
        n = stack.pop()
        out.append(n)
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack += child_nodes(n)
    return out


class Resolver:
    """Maps a leaf of a mask construction to the expression it holds: a local through the scope's assignments
    (``ref_value`` reads a detector's own symbolic values first), a ``self.<attr>`` buffer / attribute through the
    class's one store of it (``register_buffer("m", v)`` or ``self.m = v``, a local there through that function's one
    store). None: an unknown scalar (a parameter, a length, a window).

    s41 (wrong41): a call of a repository helper -- a method of the site's class, a function nested in the site's
    function or in a helper, a module-level function of the file or one it imports -- is followed into the helper:
    :meth:`inline` (its one ``return``) and :meth:`paths` (every ``return``), its parameters bound to the call's
    arguments (a constant, or a tensor built from index arithmetic; any other argument is an unknown scalar, as a
    parameter of the site's function is)."""

    def __init__(self, module: Any, scope: Any, line: int, ref_value: Optional[Callable[[Any], Any]] = None) -> None:
        self.module, self.scope, self.line, self.ref_value = module, scope, line, ref_value
        self.foreign: dict[int, _Frame] = {}  # id(node of a value read in another function) -> that function's frame
        self._helpers: dict[int, Optional[tuple[ast.AST, _Frame]]] = {}
        # id(a helper's return value) -> the tests of the helper's `if <test>: raise` / `assert` statements (s41)
        self.guards: dict[int, list[ast.AST]] = {}

    def __call__(self, n: Any) -> Any:
        if self.ref_value is not None and type(n).__name__ == "Ref":
            return self.ref_value(n)
        frame = self.foreign.get(id(n))
        if isinstance(n, ast.Name):
            if frame is not None:
                found = self._in_frame(frame, n.id, n)
                return found[0] if found is not None and len(found) == 1 else None if found is None else _UNREAD_NODE
            return self.scope.definition(n.id, getattr(n, "lineno", None) or self.line)
        if isinstance(n, ast.Attribute) and _key(n.value) == "self" and (frame is None or frame.same_class):
            # (s45: the site's ``self`` may be a detector's symbolic local, read as its name)
            return self._attribute(n.attr)
        return None

    def _in_frame(self, frame: _Frame, name: str, read: Optional[ast.AST] = None) -> Optional[list[Any]]:
        """What ``name`` read in ``frame`` holds: [value] (a parameter's binding, the function's one store), every store
        when it has several, None for an unknown scalar."""
        fr: Optional[_Frame] = frame
        while fr is not None:
            if name in fr.params:
                return None if fr.params[name] is None else [fr.params[name]]
            own = _own_nodes(fr.fn)
            stores = [a for a in own if isinstance(a, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                      and any(isinstance(t, ast.Name) and t.id == name for t in (a.targets if isinstance(a, ast.Assign) else [a.target]))]
            if stores:
                if any(isinstance(a, ast.AugAssign) or a.value is None for a in stores) \
                        or _attention_s45h.bound_otherwise(own, name, stores):
                    return [_UNREAD_NODE]  # (s46 review: a loop / with / tuple target binds it too: not these stores)
                # s45: ``b = ceil(..); b = clamp(b, ..)`` in straight-line code
                reaching = _attention_s45h.reaching_store(fr.fn, stores, read) if read is not None and fr is frame \
                    and len(stores) > 1 else None
                if reaching is not None:
                    return [self._adopt(fr, reaching.value)]  # type: ignore[attr-defined]
                return [self._adopt(fr, a.value) for a in stores]  # type: ignore[misc]
            if fr.parent is None and fr.site_closure:
                value = self.scope.definition(name, self.line)
                return None if value is None else [value]
            fr = fr.parent
        return None

    def _adopt(self, frame: _Frame, value: ast.AST) -> ast.AST:
        for sub in fast_walk(value):
            self.foreign[id(sub)] = frame
        return value

    def _attribute(self, attr: str) -> Any:
        cls = getattr(self.module, "classes", {}).get(getattr(self.scope, "class_name", None) or "")
        if cls is None:
            return None
        found: list[tuple[ast.AST, ast.AST]] = []
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in fast_walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register_buffer" \
                        and len(node.args) >= 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value == attr:
                    found.append((fn, node.args[1]))
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and any(
                        isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" and t.attr == attr
                        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
                    found.append((fn, node.value))
        if len(found) != 1:
            return _UNREAD_NODE if found else None
        fn, value = found[0]
        return self._adopt(_Frame(fn), value)

    # -- s41: helpers ------------------------------------------------------------------------------------------------

    def inline(self, call: ast.Call) -> Any:
        """The expression the repository helper ``call`` runs returns, when it has one ``return`` (None otherwise)."""
        got = self._helper(call)
        if got is None:
            return None
        fn, frame = got
        returns = [r for r in _own_nodes(fn) if isinstance(r, ast.Return)]
        if len(returns) != 1 or returns[0].value is None:
            return None
        return self._guarded(fn, frame, returns[0].value)

    def _guarded(self, fn: ast.AST, frame: _Frame, value: ast.AST) -> ast.AST:
        """``value`` read in ``frame``, with the helper's argument checks (sizes it raises on are not evaluated): those
        before the first statement that may return, which every return runs after (s41 review: a check after an
        early ``return`` does not refuse the sizes that return runs at)."""
        tests: list[ast.AST] = []
        for st in getattr(fn, "body", []):
            if isinstance(st, ast.Return) or any(isinstance(n, ast.Return) for n in _own_nodes(st)):
                break
            if isinstance(st, ast.If) and not st.orelse and st.body and isinstance(st.body[-1], ast.Raise):
                tests.append(self._adopt(frame, st.test))
            elif isinstance(st, ast.Assert):
                tests.append(self._adopt(frame, ast.UnaryOp(op=ast.Not(), operand=st.test)))
        if tests:
            self.guards[id(value)] = tests
        return self._adopt(frame, value)

    def paths(self, n: Any) -> Optional[tuple[bool, list[Any]]]:
        """(through a helper?, the expressions ``n`` may be): a helper call's every ``return`` (a bare ``return``: None),
        a name's value (each store, for a local a helper stores more than once); None for anything else."""
        cached = self._cache_stores(n)
        if cached is not None:
            return False, cached
        if isinstance(n, ast.Call):
            got = self._helper(n)
            if got is None:
                return None
            fn, frame = got
            returns = _returns(fn.body, lambda test: _truth(test, frame.params))[0]  # type: ignore[attr-defined]
            return True, [self._guarded(fn, frame, r.value) if r.value is not None else ast.Constant(None) for r in returns] \
                or [ast.Constant(None)]
        if type(n).__name__ == "Ref" or isinstance(n, ast.Attribute):
            value = self(n)
            return None if value is None else (False, [value])
        if isinstance(n, ast.Name):
            frame = self.foreign.get(id(n))
            if frame is None:
                value = self.scope.definition(n.id, getattr(n, "lineno", None) or self.line)
                return None if value is None else (False, [value])
            found = self._in_frame(frame, n.id)
            return None if found is None else (False, found)
        return None

    def _cache_stores(self, n: Any) -> Optional[list[Any]]:
        """A read of a cache on ``self`` (``self._cache.get(key)``, ``self._cache[key]``): the values the class's
        methods store into it (``self._cache[key] = mask``; ``.get`` may also give None), None when ``n`` is no such
        read or nothing is stored."""
        frame = self.foreign.get(id(n))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args:
            container = n.func.value
        elif isinstance(n, ast.Subscript):
            container = n.value
        else:
            return None
        if not (isinstance(container, ast.Attribute) and _key(container.value) == "self") \
                or frame is not None and not frame.same_class:
            return None
        cls = getattr(self.module, "classes", {}).get(getattr(self.scope, "class_name", None) or "")
        chain = {id(fr.fn): fr for fr in _frames(frame)}
        out: list[Any] = []
        for fn in (cls.body if cls is not None else []):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for a in fast_walk(fn):
                if isinstance(a, ast.Assign) and any(isinstance(t, ast.Subscript) and _key(t.value) == _key(container)
                                                     for t in a.targets):
                    out.append(self._adopt(chain.get(id(fn)) or _Frame(fn, same_class=True), a.value))
        if not out:
            return None
        return out + ([ast.Constant(None)] if isinstance(n, ast.Call) else [])

    def _helper(self, call: ast.Call) -> Optional[tuple[ast.AST, _Frame]]:
        key = id(call)
        if key not in self._helpers:
            self._helpers[key] = None  # a helper calling itself is not followed
            self._helpers[key] = self._find_helper(call)
        return self._helpers[key]

    def _find_helper(self, call: ast.Call) -> Optional[tuple[ast.AST, _Frame]]:
        caller = self.foreign.get(id(call))
        chain = caller.chain() if caller is not None else []
        if len(chain) >= _MAX_FRAMES:
            return None
        f = call.func
        fn: Optional[ast.AST] = None
        parent: Optional[_Frame] = None
        same_class = site_closure = False
        if type(f).__name__ == "Ref":
            f = ast.Name(id=str(getattr(f, "name", "")), ctx=ast.Load())  # a detector's symbolic local read as its name
        if isinstance(f, ast.Attribute) and _key(f.value) == "self":
            if caller is not None and not caller.same_class:
                return None
            cls = getattr(self.module, "classes", {}).get(getattr(self.scope, "class_name", None) or "")
            fn = next((m for m in (cls.body if cls is not None else []) if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                       and m.name == f.attr), None)
            same_class = True
        elif isinstance(f, ast.Name):
            # a function nested in the calling function (or one enclosing it), else in the site's function, else the
            # file's module-level function, else one the file imports from the repository
            for i, outer in enumerate(chain):
                fn = next((d for d in _own_nodes(outer) if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and d.name == f.id), None)
                if fn is not None:
                    parent = caller
                    for _ in range(i):
                        parent = parent.parent if parent is not None else None
                    break
            site_fn = getattr(self.scope, "node", None)
            if fn is None and caller is None and isinstance(site_fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                fn = next((d for d in _own_nodes(site_fn) if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and d.name == f.id), None)
                site_closure = fn is not None
            if fn is None:
                fn = getattr(self.module, "functions", {}).get(f.id)
            if fn is None and f.id[:1].islower() and hasattr(self.module, "tree"):
                from npufuse.scan.repo_facts import definition

                d = definition(self.module, f.id)
                fn = d.node if d is not None and isinstance(d.node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn in chain:
            return None
        frame = _Frame(fn, None, parent, same_class=same_class and (caller is None or caller.same_class), site_closure=site_closure)
        frame.params = self._bind(fn, call, skip_first=same_class and not any(
            isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list))
        if any(v is not None and self._reaches(v, fn) for v in frame.params.values()):
            # s41 review: ``narrow(narrow(causal, 4), w)`` (or through a local): the helper's nodes are read in one frame
            # at a time, so an argument evaluated by the same helper would rebind them under the outer call's reading
            return None
        return fn, frame

    def _plain_size(self, node: Any, budget: int = 40) -> bool:
        """``node`` is integer arithmetic (``+ - * //``, unary minus) of constants and of leaves that are unknown
        scalars here (a parameter, a shape read, ``len``), followed through the locals it reads."""
        stack = [node]
        while stack:
            n = stack.pop()
            budget -= 1
            if budget < 0:
                return False
            if isinstance(n, ast.Constant):
                if not isinstance(n.value, int) or isinstance(n.value, bool):
                    return False
            elif isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)):
                stack += [n.left, n.right]
            elif isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
                stack.append(n.operand)
            elif type(n).__name__ in ("Ref", "Name", "Attribute") or isinstance(n, ast.Subscript) and _shape_read(n):
                value = self(n)
                if value is _UNREAD_NODE:
                    return False
                if value is not None:
                    stack.append(value)
            elif not (isinstance(n, ast.Call) and (_name(n) == "len" and isinstance(n.func, ast.Name)
                                                   or _name(n) in ("size", "numel") and isinstance(n.func, ast.Attribute))):
                return False
        return True

    def _reaches(self, node: Any, fn: ast.AST, budget: int = 200) -> bool:
        """Does evaluating ``node`` (through the locals it reads and the helpers it calls) run the helper ``fn``?
        True also when the walk runs out of budget (not shown otherwise)."""
        stack: list[Any] = [node]
        for n in _each_once(stack, budget):
            if n is _OVER_BUDGET:
                return True
            if isinstance(n, ast.Call) and not _is_torch_fn(n):
                got = self._helper(n)
                if got is not None:
                    if got[0] is fn:
                        return True
                    # its returns read in its frame (adopted there, as the evaluation reads them: a call inside them
                    # is then found from that frame), and what the call binds
                    returned = self.paths(n)
                    stack += [v for v in (returned[1] if returned is not None else ()) if isinstance(v, ast.AST)]
                    stack += [v for v in got[1].params.values() if v is not None]
            if type(n).__name__ in ("Ref", "Name"):
                value = self(n)
                if isinstance(value, ast.AST):
                    stack.append(value)
            stack += child_nodes(n)
        return False

    def _bind(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call, skip_first: bool) -> dict[str, Any]:
        """Each parameter of ``fn`` -> the call's argument (a constant, a tensor built from index arithmetic, integer
        arithmetic of sizes: read in the caller), its constant default, else None (an unknown scalar)."""
        a = fn.args
        positional = (a.posonlyargs + a.args)[1 if skip_first else 0:]
        out: dict[str, Any] = {p.arg: None for p in positional + a.kwonlyargs}
        for p, d in zip(positional[len(positional) - len(a.defaults):], a.defaults):
            out[p.arg] = d if isinstance(d, ast.Constant) else None
        for p, d in zip(a.kwonlyargs, a.kw_defaults):
            out[p.arg] = d if isinstance(d, ast.Constant) else None
        given: dict[str, ast.AST] = {}
        for p, arg in zip(positional, call.args):
            if isinstance(arg, ast.Starred):
                break
            given[p.arg] = arg
        given.update({k.arg: k.value for k in call.keywords if k.arg in out})
        for name, arg in given.items():
            # s41 review: a size expression of the caller is bound too (``band(n, w - 1)``: the parameter is ``w - 1``
            # of the caller's unknown ``w``; left unbound it was an unknown of its own name, sampled as the caller's
            # ``w`` itself). One npufuse cannot evaluate (``min(..)``) stays an unknown of its own
            read = isinstance(arg, ast.Constant) or index_built(arg, self) or self._plain_size(arg)
            out[name] = arg if read else None
        if a.vararg is not None:
            out[a.vararg.arg] = None
        if a.kwarg is not None:
            out[a.kwarg.arg] = None
        return out


# a value this module does not read (several stores): the evaluation stops there
_UNREAD_NODE = ast.Starred(value=ast.Constant(None))
