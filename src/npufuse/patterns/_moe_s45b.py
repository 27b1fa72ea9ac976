"""s45 (helper moe45b): moe_experts recall classes read off real development misses (HO21a).

1. A routing switch of the whole call inside the expert loop (HO21a TinyMoE-Playground): ``if self.capacity_factor is
   not None: <capacity-limited dispatch> else: <plain dispatch>``. The loop analysis already follows the off path of
   a loop-invariant option test behind a run-time guard (the original loop is the fallback); a name check refused every
   loop that names a capacity anywhere. Here the capacity may sit in the test of such an option and in the branch the
   analysis does not follow: the fused text runs only where the switch is off (no capacity: every routed token kept),
   the loop as written runs where it is on. Capacity code on the followed path keeps the refusal (true reason). Either
   branch may be the plain one: the analysis follows the branch that names no capacity.
2. Top-1 indices handed back by a router module of the file (``top1, top1_prob, aux = self.router(x)`` whose forward
   returns ``probs.argmax(-1)`` / ``probs.max(-1)`` indices): one expert per token, as when computed in place.
3. Flat (token, slot) routes selected by a boolean mask (HO21a MoE-LLM): ``flat = idx.view(-1)``,
   ``tok_of_route = torch.arange(T).repeat_interleave(K)``, ``m = flat == e``, rows ``x[tok_of_route[m]]``, weights
   ``w.view(-1)[m]``, combined by ``index_add_(0, tok_of_route[m], ...)``. ``A[m]`` of a 1-D route tensor ``A`` is
   ``A[pos]`` with ``pos = torch.where(flat == e)[0]``, which the s42c reading (patterns/_moe_s42c.py) translates into
   (token, slot) pairs; the token of route p is p // K when K is the indices' last dim (a run-time check). Weights
   read through a flat view are the pair's weight where they have the indices' shape (a run-time check).

The functions here read syntax only and return facts (or None); ``moe_experts`` calls them from its loop analysis.
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Optional

from npufuse.patterns import _moe_s42c as s42c
from npufuse.patterns import _moe_s43a
from npufuse.scan.dataflow import Scope, const_value, dotted, fast_walk

# -- class 1: a routing switch inside the loop ----------------------------------------------------------------------

#: words of names that drop or cap tokens per expert (what permute + grouped matmul cannot do)
_CAPACITY_WORDS = ("capacity",)


def _names_capacity(node: ast.AST) -> bool:
    """A name or attribute in ``node`` that says capacity (``capacity_factor``, ``self.expert_capacity``)."""
    for n in fast_walk(node):
        word = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
        if word and any(w in word.lower() for w in _CAPACITY_WORDS):
            return True
    return False


def _stmts_name_capacity(stmts: list[ast.stmt]) -> bool:
    return any(_names_capacity(s) for s in stmts)


def followed_branch(branch: ast.If) -> str:
    """Which branch of an option ``if`` the loop analysis follows: ``"body"`` where only the else branch names a
    capacity (``if self.capacity is None: <plain> else: <capped>``), else ``"orelse"`` (the off path of the option)."""
    if branch.orelse and _stmts_name_capacity(branch.orelse) and not _stmts_name_capacity(branch.body):
        return "body"
    return "orelse"


def capacity_off_the_followed_path(loop: ast.For, is_option: Callable[[ast.expr], bool]) -> bool:
    """Whether every capacity name of the loop is in the test of a loop-invariant option ``if`` (``is_option``) or in
    the branch of one that the analysis does not follow (:func:`followed_branch`): the capacity is a switch the fused
    text's guard reads, not part of the dispatch it replaces. False when a capacity is on the followed path (a header,
    a plain statement, a test that is no option, or both branches of an option)."""
    if _names_capacity(loop.target) or _names_capacity(loop.iter):
        return False
    return _path_free(loop.body, is_option)


def _path_free(stmts: list[ast.stmt], is_option: Callable[[ast.expr], bool]) -> bool:
    for s in stmts:
        if isinstance(s, ast.If) and is_option(s.test):
            if _stmts_name_capacity(s.body) and _stmts_name_capacity(s.orelse):
                return False  # capped on both paths
            if not _path_free(s.body if followed_branch(s) == "body" else s.orelse, is_option):
                return False
            continue
        for _, value in ast.iter_fields(s):
            if isinstance(value, list) and value and all(isinstance(v, ast.stmt) for v in value):
                if not _path_free(value, is_option):
                    return False
            elif isinstance(value, list):
                if any(isinstance(v, ast.AST) and _names_capacity(v) for v in value):
                    return False
            elif isinstance(value, ast.AST) and _names_capacity(value):
                return False
    return True


def option_guard(branch: ast.If, test_text: str) -> str:
    """The run-time condition under which the followed branch of an option ``if`` is the one that runs."""
    return f"({test_text})" if followed_branch(branch) == "body" else f"not ({test_text})"


# -- class 2: top-1 indices from a router module ----------------------------------------------------------------------


def top1_indices_returned(scope: Scope, name: str, line: int,
                          call_output: Callable[[Optional[ast.expr]], Optional[tuple[Scope, ast.expr, int, Any]]]) -> bool:
    """``name`` is an output of a router module / helper call (``call_output`` reads ``a, b = self.router(x)``) whose
    returned name is bound in the callee to the indices of a max or an argmax: one expert per token."""
    out = call_output(scope.definition(name, line))
    if out is None:
        return False
    fscope, returned, end, _ = out
    if isinstance(returned, ast.Name):
        return _moe_s43a.top1_indices(fscope, returned.id, end)
    return _moe_s43a.max_indices(returned)  # `return probs.argmax(-1), ...`


# -- class 3: flat (token, slot) routes picked by a boolean mask ------------------------------------------------------

#: calls on the mask that test or count its routes (read by the loop analysis as the mask's own emptiness tests)
_MASK_TESTS = ("any", "sum", "count_nonzero")


def _arange_of_tokens(node: ast.expr) -> bool:
    """``torch.arange(T)`` (one bound: values 0 .. T - 1; device / dtype keywords allowed)."""
    return isinstance(node, ast.Call) and dotted(node.func) in ("torch.arange", "arange") and len(node.args) == 1 \
        and all(k.arg in ("device", "dtype") for k in node.keywords)


def _repeats(call: ast.Call) -> Optional[ast.expr]:
    """K of ``a.repeat_interleave(K)`` / ``a.repeat_interleave(K, dim=0)`` (1-D ``a``: each value K times in a row)."""
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "repeat_interleave" and call.args):
        return None
    rest = call.args[1:] + [k.value for k in call.keywords if k.arg == "dim"]
    if len(call.args) > 2 or any(k.arg not in ("dim", "output_size") for k in call.keywords) \
            or any(const_value(d) != 0 for d in rest):
        return None
    return call.args[0]


def token_of_route(node: Optional[ast.expr]) -> Optional[str]:
    """K (as written) when ``node`` lists, for flat route p = t * K + k, its token t: ``torch.arange(T)
    .repeat_interleave(K)``, ``torch.arange(T).unsqueeze(1).expand(-1, K).reshape(-1)`` (``[:, None]``, ``.view(-1,
    1)``; ``expand(T, K)``, ``repeat(1, K)``; ``.flatten()``), ``torch.arange(T * K) // K``; else None."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) and isinstance(node.left, ast.Call) \
            and _arange_of_tokens(node.left):
        return ast.unparse(node.right)
    if not isinstance(node, ast.Call):
        return None
    k = _repeats(node)
    if k is not None:
        return ast.unparse(k) if isinstance(node.func, ast.Attribute) and _arange_of_tokens(node.func.value) else None
    if dotted(node.func) == "torch.repeat_interleave" and len(node.args) == 2 and not node.keywords \
            and _arange_of_tokens(node.args[0]):
        return ast.unparse(node.args[1])
    if not _flat_call_of(node):
        return None
    grid = node.func.value  # type: ignore[attr-defined]  # [T, K]: row t holds t
    if not (isinstance(grid, ast.Call) and isinstance(grid.func, ast.Attribute)):
        return None
    if grid.func.attr == "expand" and len(grid.args) == 2 and not grid.keywords:
        k_node = grid.args[1]
    elif grid.func.attr == "repeat" and len(grid.args) == 2 and const_value(grid.args[0]) == 1 and not grid.keywords:
        k_node = grid.args[1]
    else:
        return None
    column = _moe_s43a._as_column(grid.func.value)
    return ast.unparse(k_node) if column is not None and _arange_of_tokens(column) else None


def _flat_call_of(node: ast.Call) -> bool:
    """``<expr>.view(-1)`` / ``.reshape(-1)`` / ``.flatten()`` on any receiver (the grid of a token map)."""
    if not isinstance(node.func, ast.Attribute) or node.keywords:
        return False
    if node.func.attr in ("view", "reshape") and len(node.args) == 1 and const_value(node.args[0]) == -1:
        return True
    return node.func.attr == "flatten" and not node.args


def _equality_sides(value: ast.expr) -> Optional[tuple[ast.expr, ast.expr]]:
    """The two sides of ``a == b``, ``a.eq(b)`` or ``torch.eq(a, b)``; else None."""
    if isinstance(value, ast.Compare) and len(value.ops) == 1 and isinstance(value.ops[0], ast.Eq):
        return value.left, value.comparators[0]
    if isinstance(value, ast.Call) and not value.keywords and isinstance(value.func, ast.Attribute) and value.func.attr == "eq":
        if dotted(value.func) == "torch.eq" and len(value.args) == 2:
            return value.args[0], value.args[1]
        if len(value.args) == 1:
            return value.func.value, value.args[0]
    return None


def flat_mask_routes(scope: Scope, body: list[ast.stmt], mask: str, value: ast.expr, is_expert: Callable[[ast.expr], bool],
                     tok: str, slot: str, line: int) -> Optional[tuple[s42c.FlatPositions, list[str]]]:
    """``mask = (flat == e)`` over ``flat`` a 1-D view of 2-D indices, every read of ``mask`` in ``body`` a row pick
    ``A[mask]`` of a per-route tensor (translated into the (token, slot) pair form: ``fp.reads``) or an emptiness test
    (``mask.any()``, kept). Returns the positions and the run-time facts the translation rests on; None otherwise (the
    loop is then analysed as written)."""
    sides = _equality_sides(value)
    if sides is None:
        return None
    flat, other = sides
    if not isinstance(flat, ast.Name):
        flat, other = other, flat
    if not (isinstance(flat, ast.Name) and is_expert(other)):
        return None
    indices = s42c._flat_view_of(scope, flat.id, line)
    order = ""
    if indices is None:  # s46: flat ids sorted by an order of their own (patterns/_moe_s46.py)
        from npufuse.patterns._moe_s46 import sorted_ids_view

        found = sorted_ids_view(scope, flat.id, line, s42c._flat_view_of)
        if found is None:
            return None
        indices, order = found
    fp = s42c.FlatPositions(flat.id, indices, order=order)
    facts: list[str] = []
    parents = {id(child): node for st in body for node in ast.walk(st) for child in ast.iter_child_nodes(node)}
    tok_node, slot_node = ast.Name(tok, ast.Load()), ast.Name(slot, ast.Load())
    loads = [n for st in body for n in ast.walk(st) if isinstance(n, ast.Name) and n.id == mask and isinstance(n.ctx, ast.Load)]
    for n in loads:
        parent = parents.get(id(n))
        if isinstance(parent, ast.Attribute) and parent.attr in _MASK_TESTS \
                and isinstance(parents.get(id(parent)), ast.Call) and parents[id(parent)].func is parent:  # type: ignore[attr-defined]
            continue  # mask.any(): an emptiness test the loop analysis reads on the mask itself
        if not (isinstance(parent, ast.Subscript) and parent.slice is n and isinstance(parent.ctx, ast.Load)):
            return None
        if fp.order:  # s46: arrays sorted by the same order only
            if not s42c._sorted_position_read(scope, parent, n, fp, tok_node, slot_node, other, line):
                return None
            continue
        read = _route_read(scope, parent.value, fp, tok_node, slot_node, other, facts, line)
        if read is None:
            return None
        fp.reads.append((parent, read))
    if not fp.k_text or not fp.reads:
        return None
    return fp, [s42c.position_guard(fp), *facts]


def _route_read(scope: Scope, source: ast.expr, fp: s42c.FlatPositions, tok: ast.Name, slot: ast.Name,
                expert: ast.expr, facts: list[str], line: int) -> Optional[ast.expr]:
    """The pair form of ``source[mask]``: the expert (``flat[mask]``), the token (a token-of-route map), the token's
    row (``x.repeat_interleave(K, dim=0)``), the pair's weight (a flat view of ``w``, ``w`` shaped like the indices)."""
    inline_view = s42c._flat_view_call(source)
    if inline_view is not None:
        return _pair_weight(inline_view, fp, tok, slot, facts)
    if isinstance(source, ast.Call):
        definition: Optional[ast.expr] = source  # `x.repeat_interleave(K, dim=0)[mask]` written in place
    elif isinstance(source, ast.Name) and source.id == fp.flat:
        return expert
    elif isinstance(source, ast.Name):
        definition = scope.definition(source.id, line)
    else:
        return None
    k = token_of_route(definition)
    if k is not None and definition is not None and _names_unchanged(scope, definition, line):
        if fp.k_text and k != fp.k_text:
            return None
        fp.k_text = k
        return tok
    if isinstance(definition, ast.Call) and _repeats(definition) is not None and isinstance(definition.func, ast.Attribute) \
            and isinstance(definition.func.value, ast.Name) and s42c._unchanged(scope, definition.func.value.id, definition.lineno, line):
        k = ast.unparse(_repeats(definition))  # type: ignore[arg-type]
        rows_of = definition.func.value.id
        if (fp.k_text and k != fp.k_text) or (fp.tokens and fp.tokens != rows_of) or not _dim_zero(definition):
            return None
        fp.k_text, fp.tokens = k, rows_of
        return ast.Subscript(ast.Name(rows_of, ast.Load()), tok, ast.Load())
    weights = s42c._flat_view_of(scope, source.id, line) if isinstance(source, ast.Name) else None
    return _pair_weight(weights, fp, tok, slot, facts) if weights is not None else None


def _dim_zero(call: ast.Call) -> bool:
    """``x.repeat_interleave(K, dim=0)`` (rows repeated): the dim is given and 0 (a 1-D ``repeat_interleave(K)`` of
    tokens would repeat scalars)."""
    dims = call.args[1:] + [k.value for k in call.keywords if k.arg == "dim"]
    return len(dims) == 1 and const_value(dims[0]) == 0


def _names_unchanged(scope: Scope, definition: ast.expr, line: int) -> bool:
    """The names a token-of-route map reads (T, K) are not rebound between its binding and the loop."""
    return all(s42c._unchanged(scope, n.id, definition.lineno, line) for n in fast_walk(definition) if isinstance(n, ast.Name))


def _pair_weight(weights: str, fp: s42c.FlatPositions, tok: ast.Name, slot: ast.Name, facts: list[str]) -> ast.expr:
    fact = f"{weights}.shape == {fp.indices}.shape"  # w.view(-1)[t * K + k] is w[t, k] where w is [T, K]
    if fact not in facts:
        facts.append(fact)
    return ast.Subscript(ast.Name(weights, ast.Load()), ast.Tuple([tok, slot], ast.Load()), ast.Load())


# -- class 4: the weighted expert output cast before it is written back ---------------------------------------------


#: floating dtypes a weighted output may be cast to (an integer cast would round the values the fused text keeps)
_FLOAT_DTYPES = ("float", "float32", "float16", "half", "bfloat16", "float64", "double")


def plain_cast(call: ast.Call) -> bool:
    """``y.to(out.dtype)`` / ``y.to(dtype)`` (a name) / ``y.to(torch.bfloat16)`` / ``y.float()`` / ``y.type_as(out)``:
    a cast to a floating dtype, or to another tensor's dtype, as the write-back into that tensor does anyway. Not
    ``y.to(torch.int8)`` (rounds), nor keywords (``copy=True``, ``non_blocking``), nor ``.type(...)``."""
    f = call.func
    if call.keywords or not isinstance(f, ast.Attribute):
        return False
    if f.attr in ("float", "half", "bfloat16"):
        return not call.args
    if f.attr == "type_as":
        return len(call.args) == 1
    if f.attr != "to" or len(call.args) != 1:
        return False
    arg = call.args[0]
    return isinstance(arg, ast.Name) or isinstance(arg, ast.Attribute) and (
        arg.attr == "dtype" or dotted(arg) in {f"torch.{d}" for d in _FLOAT_DTYPES})


# -- class 5: the accumulator's metadata read between its allocation and the loop -------------------------------------

#: attributes / methods of a tensor that tell its metadata, never its values
_METADATA_ATTRS = ("dtype", "device", "shape", "ndim", "is_cuda")
_METADATA_METHODS = ("size", "dim", "type", "get_device")


def metadata_reads_only(stmt: ast.stmt, name: str) -> bool:
    """Every occurrence of ``name`` in ``stmt`` is a load of its dtype / device / shape (``out_dtype = out.dtype``,
    ``n = out.size(0)``): nothing there reads, writes or aliases the tensor's values. ``type`` is read only
    without arguments (``t.type()`` names the type; ``t.type(dtype)`` casts, a new tensor: still no alias)."""
    parents = {id(child): node for node in ast.walk(stmt) for child in ast.iter_child_nodes(node)}
    for n in ast.walk(stmt):
        if not (isinstance(n, ast.Name) and n.id == name):
            continue
        parent = parents.get(id(n))
        if not isinstance(n.ctx, ast.Load) or not isinstance(parent, ast.Attribute):
            return False
        if parent.attr in _METADATA_ATTRS:
            continue
        call = parents.get(id(parent))
        if parent.attr in _METADATA_METHODS and isinstance(call, ast.Call) and call.func is parent:
            continue
        return False
    return True



# -- class 6: the columns of ``(idx == e).nonzero()`` bound one statement each ----------------------------------------
#
# ``pos = (idx == e).nonzero(as_tuple=False)`` is [n, idx.dim()]: ``b = pos[:, 0]``, ``t = pos[:, 1]``, ``k = pos[:, 2]``
# bound one per statement are the coordinates of ``torch.where(idx == e)`` (s42c reads them unpacked in one
# statement); the token of 3-D [B, T, K] indices is then often named as the row ``b * T + t`` of the flattened tokens.


def _column_number(node: ast.AST, name: str) -> Optional[int]:
    """j of ``name[:, j]`` (j a non-negative integer constant); else None."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == name
            and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 2):
        return None
    whole, j = node.slice.elts
    if not (isinstance(whole, ast.Slice) and whole.lower is None and whole.upper is None and whole.step is None):
        return None
    value = const_value(j)
    return value if type(value) is int and value >= 0 else None


def separate_nonzero_columns(body: list[ast.stmt], name: str, value: ast.expr
                             ) -> Optional[tuple[ast.expr, list[tuple[ast.expr, int]], int]]:
    """For ``name = X.nonzero()`` (``as_tuple=False`` dropped by the caller): (X, [(each column read, its number)], the
    number of columns) when ``name`` is read in ``body`` only through its sizes and as ``name[:, j]`` bound whole to one
    name (``b = name[:, 0]``), every column 0 .. n - 1 read (n >= 2); else None."""
    mask = s42c._nonzero_mask(value)
    if mask is None:
        return None
    parents = {id(child): node for st in body for node in ast.walk(st) for child in ast.iter_child_nodes(node)}
    reads: list[tuple[ast.expr, int]] = []
    for n in (n for st in body for n in ast.walk(st) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)):
        parent = parents.get(id(n))
        if s42c._size_read(parent, n):
            continue
        j = _column_number(parent, name) if parent is not None else None
        bound = parents.get(id(parent))
        if j is None or not (isinstance(bound, ast.Assign) and bound.value is parent and len(bound.targets) == 1
                             and isinstance(bound.targets[0], ast.Name)):
            return None
        reads.append((parent, j))  # type: ignore[arg-type]
    columns = {j for _, j in reads}
    if len(columns) < 2 or columns != set(range(len(columns))) or len(reads) != len(columns):
        return None
    return mask, reads, len(columns)


def flattened_token(node: ast.BinOp, kind_of: Callable[[ast.expr], Any]) -> Optional[ast.expr]:
    """T of ``b * T + t`` (either order of the sum and of the product) where ``b`` and ``t`` are the two token
    coordinates of 3-D indices (``kind_of`` gives their ``tokpart`` values): the row of token (b, t) in the tokens
    flattened to [B * T, ...], when T is the indices' second dim (the caller's run-time check)."""
    if not isinstance(node.op, ast.Add):
        return None
    for prod, t in ((node.left, node.right), (node.right, node.left)):
        if not (isinstance(prod, ast.BinOp) and isinstance(prod.op, ast.Mult)):
            continue
        for b, size in ((prod.left, prod.right), (prod.right, prod.left)):
            kb, kt = kind_of(b), kind_of(t)
            if (kb.kind, kb.args, kt.kind, kt.args) == ("tokpart", (0, 2), "tokpart", (1, 2)):
                return size
    return None

# -- examples (registered on MoeExperts by moe_experts.py) ------------------------------------------------------------

from npufuse.patterns.base import Fuse, Keep  # noqa: E402

_HEAD = "import math\n" + s42c._HEAD
_run = s42c._run

# 1 + 2 + 4 + 5. top-1 routing by a router module of the file, an optional capacity (TinyMoE-Playground's MoEFFNTop1):
# the capped path when a factor is set, the plain one otherwise; the output's dtype read before the loop
_CAPPED = '''            if self.capacity_factor is not None:
                b, t = mask.nonzero(as_tuple=True)
                cap = math.ceil(self.capacity_factor * B * T / self.n)
                b, t = b[:cap], t[:cap]
                y = self.experts[e](x[b, t])
                out[b, t] = (y * top1_prob[b, t].unsqueeze(-1)).to(out_dtype)
            else:
'''
_PLAIN = '''                y = self.experts[e](x[mask])
                y = y * top1_prob[mask].unsqueeze(-1)
                y = y.to(out_dtype)
                out[mask] = y
'''
SWITCHED = _HEAD + '''

class Top1Router(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.proj = nn.Linear(d, n, bias=False)

    def forward(self, x):
        probs = F.softmax(self.proj(x), dim=-1)
        return probs.argmax(dim=-1), probs.max(dim=-1).values


class SwitchMoE(nn.Module):
    def __init__(self, d, h, n, capacity_factor=None):
        super().__init__()
        self.n = n
        self.router = Top1Router(d, n)
        self.experts = nn.ModuleList([GluExpert(d, h) for _ in range(n)])
        self.capacity_factor = capacity_factor

    def forward(self, x):
        B, T, D = x.shape
        top1, top1_prob = self.router(x)
        out = torch.zeros_like(x)
        out_dtype = out.dtype
        for e in range(self.n):
            mask = top1 == e
            if not mask.any():
                continue
''' + _CAPPED + _PLAIN + '''        return out
'''
SWITCHED_RUN = _run("SwitchMoE(16, 12, 4)", "2, 7, 16", "m.router.proj.weight, m.experts[1].w_in.weight")
# the plain path first: `if self.capacity_factor is None: <plain> else: <capped>`
SWITCHED_INVERTED = SWITCHED.replace(_CAPPED + _PLAIN, "            if self.capacity_factor is None:\n" + _PLAIN
                                     + "            else:\n" + _CAPPED.split("\n", 1)[1].rsplit("            else:\n", 1)[0])
# the capacity applied in training only (a factor > 0): the fused text runs in eval
SWITCHED_EVAL = SWITCHED.replace("if self.capacity_factor is not None:",
                                 "if self.training and self.capacity_factor is not None and self.capacity_factor > 0:")

# top-k pairs of torch.where, the pairs cut to a capacity under a switch with no else (the dispatch follows it)
CUT_WHEN_SET = _HEAD + '''

class CutMoE(nn.Module):
    def __init__(self, d, h, n, k, capacity=0):
        super().__init__()
        self.n, self.k, self.capacity = n, k, capacity
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([GluExpert(d, h) for _ in range(n)])

    def forward(self, x):
        w, idx = torch.topk(self.gate(x).softmax(dim=-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.n):
            tok, slot = torch.where(idx == e)
            if self.capacity > 0:
                tok, slot = tok[:self.capacity], slot[:self.capacity]
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out
'''
CUT_RUN = _run("CutMoE(16, 12, 5, 2)", "11, 16", "m.gate.weight, m.experts[2].w_out.weight")

# 3. flat (token, slot) routes picked by a boolean mask (MoE-LLM's MixtureOfExperts): token of each route from
# arange(T).repeat_interleave(K), the pair's weight off the flat weights, index_add_ at the routes' tokens
ROUTES = _HEAD + '''

class RouteMoE(nn.Module):
''' + s42c._init("gate") + '''
    def forward(self, x):
        B, T, D = x.shape
        flat_x = x.view(-1, D)
        n_tok = flat_x.shape[0]
        w, idx = torch.topk(self.gate(flat_x), self.k, dim=-1)
        w = F.softmax(w, dim=-1, dtype=torch.float)
        flat_idx = idx.view(-1)
        token_of = torch.arange(n_tok, device=x.device).repeat_interleave(self.k)
        out = torch.zeros_like(flat_x)
        for i, expert in enumerate(self.experts):
            m = flat_idx == i
            if m.any():
                rows = flat_x[token_of[m]]
                y = expert(rows)
                out.index_add_(0, token_of[m], y * w.view(-1)[m].unsqueeze(1))
        return out.view(B, T, D)
'''
ROUTES_RUN = _run("RouteMoE(16, 12, 5, 2)", "2, 7, 16", "m.gate.weight, m.experts[3].w_in.weight")
_ROUTE_MAP = "        token_of = torch.arange(n_tok, device=x.device).repeat_interleave(self.k)\n"
_ROUTE_BODY = '''            if m.any():
                rows = flat_x[token_of[m]]
                y = expert(rows)
                out.index_add_(0, token_of[m], y * w.view(-1)[m].unsqueeze(1))
'''
# the map as an expanded grid, repeated rows of the tokens, a bound flat view of the weights, a skip, `+=` at the tokens
ROUTES_GRID = ROUTES.replace(_ROUTE_MAP, "        token_of = torch.arange(n_tok).unsqueeze(1).expand(-1, self.k).reshape(-1)\n"
                             "        x_rep = flat_x.repeat_interleave(self.k, dim=0)\n        flat_w = w.reshape(-1)\n") \
    .replace(_ROUTE_BODY, '''            if not m.any():
                continue
            tok = token_of[m]
            out[tok] += expert(x_rep[m]) * flat_w[m][:, None]
''')
# the map as arange(T * K) // K, the mask by `.eq`, the rows repeated in place
ROUTES_DIV = ROUTES.replace(_ROUTE_MAP, "        token_of = torch.arange(n_tok * self.k, device=x.device) // self.k\n") \
    .replace("m = flat_idx == i", "m = flat_idx.eq(i)") \
    .replace("rows = flat_x[token_of[m]]", "rows = flat_x.repeat_interleave(self.k, dim=0)[m]")

# 6. [B, T, K] indices, the coordinates of nonzero() bound one statement each, tokens read as rows b * T + t of the
# flattened tokens (vats-multimodal-lm's MoELayer)
GRID_COLUMNS = _HEAD + """

class GridColumnsMoE(nn.Module):
""" + s42c._init("router") + """
    def forward(self, x):
        B, T, D = x.shape
        w, idx = torch.topk(self.router(x).softmax(dim=-1), self.k, dim=-1)
        x_flat = x.view(-1, D)
        out = torch.zeros_like(x_flat)
        for e in range(self.n):
            hit = idx == e
            if hit.any():
                pos = hit.nonzero(as_tuple=False)
                if pos.numel() > 0:
                    b = pos[:, 0]
                    t = pos[:, 1]
                    k = pos[:, 2]
                    rows = b * T + t
                    y = self.experts[e](x_flat[rows])
                    out[rows] += y * w[b, t, k][..., None]
        return out.view(B, T, D)
"""
GRID_COLUMNS_RUN = _run("GridColumnsMoE(16, 12, 5, 2)", "3, 5, 16", "m.router.weight, m.experts[4].w_out.weight")

FUSE = [
    Fuse(SWITCHED, name="s45b_capacity_switch_off_top1_router_module", run=SWITCHED_RUN),
    Fuse(SWITCHED_INVERTED, name="s45b_capacity_switch_plain_path_first", run=SWITCHED_RUN),
    Fuse(SWITCHED_EVAL, name="s45b_capacity_in_training_only", run=SWITCHED_RUN.replace("SwitchMoE(16, 12, 4)",
                                                                                         "SwitchMoE(16, 12, 4, 1.0).eval()")),
    Fuse(CUT_WHEN_SET, name="s45b_capacity_cut_under_a_switch_without_else", run=CUT_RUN),
    Fuse(ROUTES, name="s45b_flat_routes_by_mask_repeat_interleave_map", run=ROUTES_RUN),
    Fuse(ROUTES_GRID, name="s45b_flat_routes_by_mask_expanded_grid_map", run=ROUTES_RUN),
    Fuse(ROUTES_DIV, name="s45b_flat_routes_by_mask_floor_division_map", run=ROUTES_RUN),
    Fuse(GRID_COLUMNS, name="s45b_nonzero_columns_one_per_statement_flat_rows", run=GRID_COLUMNS_RUN),
    Fuse(GRID_COLUMNS.replace("rows = b * T + t", "rows = t + T * b").replace("out[rows] += y * w[b, t, k][..., None]",
                                                                            "out.index_add_(0, rows, y * w[b, t, k].unsqueeze(-1))"),
         name="s45b_nonzero_columns_flat_rows_other_order_index_add"),
]

KEEP = [
    # the capacity applies on every path (no switch): tokens past it are dropped, the fused layer keeps them
    Keep(SWITCHED.replace(_CAPPED + _PLAIN, "".join(line[4:] + "\n" for line in _CAPPED.splitlines()[1:-1])),
         reason="expert capacity / token dropping inside the loop", name="s45b_capacity_always_applied"),
    # capped on both paths of the switch (another factor in eval)
    Keep(SWITCHED.replace(_PLAIN, _CAPPED.split("\n", 1)[1].rsplit("            else:\n", 1)[0]
                          .replace("self.capacity_factor * B", "2 * self.capacity_factor * B")),
         reason="expert capacity / token dropping inside the loop", name="s45b_capacity_on_both_paths"),
    # a test of this expert's load against the capacity: not a switch of the whole call
    Keep(CUT_WHEN_SET.replace("if self.capacity > 0:", "if len(tok) > self.capacity:"),
         reason="expert capacity / token dropping inside the loop", name="s45b_capacity_test_of_the_expert_load"),
    # the router module samples its expert: one per token, but not the indices of a max, so `top1_prob[mask]` is
    # not proven to be one weight per selected row
    Keep(SWITCHED.replace("return probs.argmax(dim=-1), probs.max(dim=-1).values",
                          "return torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(probs.shape[:-1]), "
                          "probs.max(dim=-1).values"),
         reason="not recognised as the routing weight", name="s45b_router_module_samples_its_expert"),
    # the weighted output cast to an integer type before the write-back: rounds what the fused layer keeps
    Keep(SWITCHED.replace("y = y.to(out_dtype)", "y = y.to(torch.int32)"),
         reason="is not recognised", name="s45b_weighted_output_cast_to_an_integer"),
    # a view of the accumulator taken between its allocation and the loop: an alias of the fresh zeros
    Keep(SWITCHED.replace("        out_dtype = out.dtype\n", "        out_dtype = out.dtype\n        rows_view = out.view(-1, D)\n"),
         reason="other code (line", name="s45b_accumulator_aliased_before_the_loop"),
    # the map tiles the tokens (`repeat`): route p of token p // K reads token p % T
    Keep(ROUTES.replace(".repeat_interleave(self.k)\n", ".repeat(self.k)\n"),
         reason="npufuse does not trace its input to the rows routed to this expert", name="s45b_flat_routes_tiled_map"),
    # the mask narrowed by the weights after it is made: routes under the threshold are dropped
    Keep(ROUTES.replace("            m = flat_idx == i\n", "            m = flat_idx == i\n            m = m & (w.view(-1) > 0.2)\n"),
         reason="which npufuse does not read as the tokens routed to this expert", name="s45b_flat_routes_mask_narrowed"),
    # rows t * B + b: the flattening of a [T, B] layout, not the row of token (b, t) of the [B, T] tokens
    Keep(GRID_COLUMNS.replace("rows = b * T + t", "rows = t * B + b"), reason="npufuse does not trace its input",
         name="s45b_nonzero_columns_rows_of_another_layout"),
    # a column bound twice (the slot read as column 1 again): not the coordinates of torch.where
    Keep(GRID_COLUMNS.replace("k = pos[:, 2]", "k = pos[:, 1]"), reason="over expert indices not shown to be 1-D",
         name="s45b_nonzero_columns_one_column_twice"),
]
