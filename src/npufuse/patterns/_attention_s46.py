"""s46 (helper attn46): attention / sdpa, dead candidates and real development misses, read by class.

1. Ranks the code states through einops and module layers. :func:`attention.static_rank` did not read
   ``rearrange(x, '... n (h d) -> ... h n d')`` (einops: the output has the pattern's right-hand groups, an ellipsis
   standing for the input's unnamed leading axes), ``qkv[i]`` of ``qkv = x.chunk(3, dim=-1)`` (each chunk keeps the
   input's rank) or ``self.to_qkv(x)`` of an ``nn.Linear`` / norm / dropout layer (rank kept). UniAnimate's temporal
   attention builds q / k / v 5-D that way ([b, h*w, heads, f, d] from a 4-D [b, h*w, f, c]); the candidate's run-time
   ``q.dim() == 4`` test never held (audit45: a dead candidate). With the ranks read, 5-D operands take attn45's fold
   where it applies (no mask, or causal terms only) and are a near miss that says so otherwise.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
from typing import Any, Callable, Iterator, Optional

from npufuse.patterns import _attention_s48r
from npufuse.scan.dataflow import const_value, dotted

# the file being read while operand ranks are worked out (``self.<layer>(x)`` needs the class's constructors)
_MODULE: "contextvars.ContextVar[Any]" = contextvars.ContextVar("npufuse_s46_rank_module", default=None)

# layers that map only the last axis (or normalise over trailing axes): the output has the input's rank
_RANK_KEEPING_LAYERS = {"Linear", "LayerNorm", "GroupNorm", "Dropout", "Identity", "RMSNorm", "LazyLinear"}


def _einops_groups(side: str) -> Optional[list[str]]:
    """The top-level axis groups of one side of an einops pattern (``'b (h w) f c'`` -> ['b', '(h w)', 'f', 'c']),
    ``'...'`` kept as a group; None for text that is not a well-formed side."""
    groups: list[str] = []
    depth, cur = 0, ""
    for ch in side.strip() + " ":
        if ch == "(":
            if depth:
                return None
            depth, cur = 1, "("
        elif ch == ")":
            if not depth:
                return None
            depth = 0
            groups.append(cur + ")")
            cur = ""
        elif ch.isspace():
            if not depth and cur:
                groups.append(cur)
                cur = ""
            elif depth:
                cur += " "
        else:
            cur += ch
    if depth or any(g != "..." and not g.startswith("(") and not (g.isidentifier() or g.isdigit()) for g in groups):
        return None
    return groups


def rearrange_rank(pattern: Any, input_rank: Optional[int]) -> Optional[int]:
    """The rank of ``einops.rearrange(x, pattern)`` for an ``x`` of ``input_rank`` (None when unknown); None when the
    pattern is not a literal einops pattern or its rank depends on an unknown input rank."""
    text = const_value(pattern)
    if not isinstance(text, str) or text.count("->") != 1:
        return None
    lhs, rhs = (_einops_groups(side) for side in text.split("->"))
    if lhs is None or rhs is None or lhs.count("...") > 1 or lhs.count("...") != rhs.count("..."):
        return None
    if "..." not in lhs:
        return len(rhs)
    if input_rank is None or input_rank < len(lhs) - 1:
        return None
    return input_rank - (len(lhs) - 1) + (len(rhs) - 1)


def _layer_keeps_rank(module: Any, class_name: Optional[str], attr: str) -> bool:
    """``self.<attr>`` is built in the class as a layer that keeps its input's rank (``nn.Linear(...)``), and every
    store to it in the class is such a layer (a method that swaps in another module would change what is called)."""
    cls = module.classes.get(class_name or "")
    if cls is None:
        return False
    table = module.__dict__.setdefault("_npufuse_s46_layer_stores", {})
    stores = table.get(id(cls))
    if stores is None or stores[0] is not cls:
        found = _attention_s48r.layer_stores(cls)  # s48: tuple targets, setattr, for / with targets too
        stores = table[id(cls)] = (cls, found)
    values = stores[1].get(attr)
    if not values or _attention_s48r.ANY in stores[1]:
        return False
    for value in values:
        name = module.canonical(value.func) if isinstance(value, ast.Call) else None
        if name is None or not name.startswith("torch.nn.") or name.rpartition(".")[2] not in _RANK_KEEPING_LAYERS:
            return False
    return True


def _split_call(node: Any) -> Optional[tuple[str, Any]]:
    """(``chunk`` / ``split`` / ``unbind``, the tensor split) of ``x.chunk(..)`` / ``torch.chunk(x, ..)``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) or node.func.attr not in ("chunk", "split", "unbind"):
        return None
    if dotted(node.func.value) == "torch":
        return (node.func.attr, node.args[0]) if node.args else None
    return node.func.attr, node.func.value


def _callee_name(func: Any) -> Optional[str]:
    """The dotted name of a callee, a detector Ref read as its name (``rearrange`` imported at module level)."""
    from npufuse.patterns.attention import Ref

    return func.name if isinstance(func, Ref) and func.idx == -1 and func.value is None else dotted(func)


def _value_of(scope: Any, base: Any, line: int) -> Any:
    """The expression a name (a plain Name, or the detector's Ref: its value, else the local before the block) holds."""
    from npufuse.patterns.attention import Opaque, Ref, Undef

    if isinstance(base, ast.Name):
        return scope.definition(base.id, line)
    if isinstance(base, Ref):
        if base.value is not None and not isinstance(base.value, (Opaque, Undef)):
            return base.value
        return scope.definition(base.name, line) if base.idx == -1 else None
    return None


def stated_rank(scope: Any, node: Any, line: int, depth: int, rank: Callable[..., Optional[int]]) -> Optional[int]:
    """What :func:`attention.static_rank` (``rank``) leaves unread: einops ``rearrange`` with a literal pattern, an
    integer index of a name holding ``x.chunk(..)`` / ``split`` / ``unbind``, a rank-keeping layer ``self.<attr>(x)``."""
    if isinstance(node, ast.Call):
        name = _callee_name(node.func)
        module = _MODULE.get()
        if name is not None and len(node.args) >= 2 and \
                (module.canonical(ast.Name(name, ast.Load())) if module is not None and "." not in name else name) == "einops.rearrange":
            inner = rearrange_rank(node.args[1], None)
            return inner if inner is not None else rearrange_rank(node.args[1], rank(scope, node.args[0], line, depth + 1))
        func = node.func
        if module is not None and isinstance(func, ast.Attribute) and len(node.args) == 1 and not node.keywords \
                and _callee_name(func.value) == "self" \
                and _layer_keeps_rank(module, scope.class_name, func.attr):
            return rank(scope, node.args[0], line, depth + 1)
        return None
    if isinstance(node, ast.Subscript) and isinstance(const_value(node.slice), int):
        base = node.value
        value = _value_of(scope, base, line)
        split = _split_call(value)
        if split is None:
            return None
        r = rank(scope, split[1], getattr(value, "lineno", line), depth + 1)
        return None if r is None else r - 1 if split[0] == "unbind" else r
    return None


@contextlib.contextmanager
def reading_module(module: Any) -> Iterator[None]:
    """Ranks worked out inside read ``module``'s imports (einops) and layer constructors (``self.to_qkv``)."""
    token = _MODULE.set(module)
    try:
        yield
    finally:
        _MODULE.reset(token)


def operand_ranks(module: Any, scope: Any, operands: list[tuple[Any, Any]], line: int,
                  rank: Callable[..., Optional[int]]) -> list[Optional[int]]:
    """The ranks of the attention operands ``(stated rank or None, leaf)``, reading the file's layer constructors."""
    with reading_module(module):
        return [r if r is not None else rank(scope, leaf, line) for r, leaf in operands]


# --- 2. masks whose construction npufuse cannot evaluate but which can still empty a query row --------------------------
# :mod:`_mask_rows` evaluates a mask built from index arithmetic on small sizes; where it cannot (a helper it does not
# follow, an operation it does not evaluate), nothing used to be checked. Spec 5.1 / 14: a fully masked row has no
# pinned-down value in npu_fusion_attention. A plain causal triangle (``tril`` / ``triu`` at the diagonal, ``j <= i``)
# or a key-padding vector keeps a key in every row of a non-empty sequence; these constructions need not:
#   * bucketed or strided index arithmetic (``//``, ``%``, ``/``, ``ceil`` / ``floor`` / ``round``): Linformer's bucket
#     limit ``ceil((j + 1) * T / P) - 1`` leaves the first query rows without a bucket;
#   * windows (``abs(i - j) <= w``) and offset comparisons (``j <= i + off``, ``tril(diagonal=off)`` with ``off``
#     unknown or not 0 / 1): a negative offset or an empty band empties rows;
#   * a key-padding vector applied to the queries too (``m[:, None, :] * m[:, :, None]``,
#     ``m.unsqueeze(1) & m.unsqueeze(2)``): every padded query row masks all keys.
# Only these get the run-time row check (a host sync); other unread constructions keep the old behaviour.
_BUCKET_CALLS = {"ceil", "floor", "round", "trunc", "remainder", "fmod", "div", "floor_divide", "true_divide"}


def _is_index_compare_offset(node: ast.Compare) -> bool:
    return any(isinstance(side, ast.BinOp) and isinstance(side.op, (ast.Add, ast.Sub))
               for side in (node.left, *node.comparators))


def _diagonal_offset(call: ast.Call) -> bool:
    """``tril`` / ``triu`` with a diagonal other than the causal 0 / 1 (an unknown one, or another constant)."""
    diag = next((k.value for k in call.keywords if k.arg == "diagonal"), None)
    if diag is None:
        # torch.tril(x, d) / tril(x, d) take the tensor first; x.tril(d) does not
        method = isinstance(call.func, ast.Attribute) and dotted(call.func.value) not in ("torch", "th")
        pos = 0 if method else 1
        diag = call.args[pos] if len(call.args) > pos else None
    if diag is None:
        return False
    value = const_value(diag)
    return not isinstance(value, int) or value not in (0, 1)


def _axis_positions(node: Any) -> Optional[tuple[int, ...]]:
    """The positions of the new axes of ``m[:, None, :]`` / ``m.unsqueeze(1)``; None for anything else."""
    if isinstance(node, ast.Subscript):
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        new = tuple(i for i, e in enumerate(elts) if isinstance(e, ast.Constant) and e.value is None)
        if new and all(isinstance(e, ast.Slice) or isinstance(e, ast.Constant) and e.value is None for e in elts):
            return new
        return None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "unsqueeze" \
            and len(node.args) == 1 and isinstance(const_value(node.args[0]), int):
        return (const_value(node.args[0]),)
    return None


def _outer_padding(node: Any) -> bool:
    """``m[:, None, :] * m[:, :, None]`` / ``q_mask[:, :, None] * kv_mask[:, None, :]`` (``&``, ``logical_and``, the
    outer product ``m.unsqueeze(2) @ m.unsqueeze(1)``): padding over the queries as well as the keys."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.BitAnd, ast.MatMult)):
        pair = (node.left, node.right)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("logical_and", "mul", "bmm", "matmul") \
            and len(node.args) == 2 and dotted(node.func.value) == "torch":
        pair = (node.args[0], node.args[1])
    else:
        return False
    a, b = (_axis_positions(x) for x in pair)
    return a is not None and b is not None and a != b


def unread_row_reason(node: Any, resolve: Callable[[Any], Any]) -> Optional[str]:
    """What in a mask's construction (one npufuse did not evaluate) can leave a query row with no key; None when
    nothing (see the comment above)."""
    from npufuse.patterns import _mask_rows

    index_made, found = False, None
    for n, sized in _mask_rows.construction_nodes(node, resolve):
        if _outer_padding(n):
            return "padding over the queries as well as the keys, an outer product: a padded query row masks every key"
        if isinstance(n, ast.Call) and _mask_rows._name(n) in _mask_rows._INDEX_WORDS:
            index_made = True
        if sized or found is not None:
            continue  # the sizes of arange / ones / eye bound no row
        name = _mask_rows._name(n) if isinstance(n, ast.Call) else None
        if name in ("tril", "triu") and _diagonal_offset(n):
            found = "a triangle with an offset diagonal"
        elif name in _BUCKET_CALLS:
            found = f"bucketed index arithmetic (`{name}`)"
        elif name == "abs":
            found = "a window (`abs` of an index difference)"
        elif isinstance(n, ast.BinOp) and isinstance(n.op, (ast.FloorDiv, ast.Mod, ast.Div)):
            found = "bucketed or strided index arithmetic (`//`, `%` or `/`)"
        elif isinstance(n, ast.Compare) and _is_index_compare_offset(n):
            found = "an index comparison with an offset"
    return found if index_made else None


class UnreadRows:
    """A :class:`_mask_rows.RowVerdict` of kind ``varies`` for a construction npufuse did not evaluate: ``why``."""

    __slots__ = ("kind", "rows", "why")

    def __init__(self, why: str) -> None:
        self.kind, self.rows, self.why = "varies", (), why

    def describe(self) -> str:
        return (f"its construction ({self.why}) can leave a query row without any key, and npufuse does not evaluate it: "
                "torch gives such a row NaN (or a uniform average with a finite fill), npu_fusion_attention's output there "
                "is not pinned down (spec 5.1 / 14)")


def unread_rows(node: Any, resolve: Callable[[Any], Any]) -> Optional[UnreadRows]:
    why = unread_row_reason(node, resolve)
    return UnreadRows(why) if why is not None else None


# --- 3. true reasons ---------------------------------------------------------------------------------------------------
def unbatched_heads(p_sub: str, v_sub: str, out: str) -> Optional[str]:
    """The head letter of a 3-D einsum that is multi-head attention with no batch axis (P@V ``nhm,mhd->nhd``; Q@Kᵀ
    ``nhd,mhd->nmh``: one letter shared by both operands and the output, one contracted, one per operand): graph
    transformers over the nodes of one graph; None for any other 3-D product."""
    if not (len(p_sub) == len(v_sub) == len(out) == 3) or len(set(p_sub)) != 3 or len(set(v_sub)) != 3:
        return None
    shared = set(p_sub) & set(v_sub)
    kept = [x for x in shared if x in out]
    summed = [x for x in shared if x not in out]
    if len(kept) != 1 or len(summed) != 1 or set(out) != set(p_sub) ^ set(v_sub) | set(kept):
        return None
    return kept[0]


def unbatched_reason(eq: str, p_sub: str, v_sub: str, out: str) -> Optional[str]:
    """The near-miss reason for :func:`unbatched_heads`' form (it is attention: s45's reason said it was not)."""
    h = unbatched_heads(p_sub, v_sub, out)
    if h is None:
        return None
    return (f"einsum `{eq}`: attention over 3-D operands whose shared axis `{h}` is not the leading one (multi-head [S, N, D] "
            "with no batch axis, e.g. one graph's nodes, or a sequence-first [S, B, D] one-head layout): npufuse reads 4-D "
            "[B, N, S, D] / [B, S, N, D] or 3-D [B, S, D] operands, and does not add the batch axis or move that axis this form needs")


_STATEMENT_KINDS = {ast.Try: "a `try` statement", ast.For: "a `for` loop", ast.AsyncFor: "a `for` loop", ast.While: "a `while` loop",
                    ast.With: "a `with` statement", ast.AsyncWith: "a `with` statement", ast.If: "an `if` statement",
                    ast.FunctionDef: "a nested function", ast.AsyncFunctionDef: "a nested function"}


def unfollowed_assignment(name: str, block: list[ast.stmt], idx: int) -> Optional[str]:
    """The reason for a local the attention reads whose value the block interpreter does not follow: the statement
    kind that assigns it and its line (s45's reason said only "inside the attention", also for a ``try`` before it)."""
    if not 0 <= idx < len(block):
        return None
    stmt = block[idx]
    kind = _STATEMENT_KINDS.get(type(stmt))
    if kind is None:
        return None
    # the innermost loop / try / with / nested def under the statement that assigns the name (breadth-first: the last)
    inner = [n for n in ast.walk(stmt) if n is not stmt and type(n) in _STATEMENT_KINDS and not isinstance(n, ast.If)
             and any(isinstance(t, ast.Name) and t.id == name and isinstance(t.ctx, ast.Store) for t in ast.walk(n))]
    where = f"{kind} (line {stmt.lineno})"
    if inner:
        where = f"{_STATEMENT_KINDS[type(inner[-1])]} (line {inner[-1].lineno}) inside {kind} (line {stmt.lineno})"
    return (f"`{name}`, which the attention reads, is assigned in {where} whose effect npufuse does not follow: its value "
            "at the attention is not known")
