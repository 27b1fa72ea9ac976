"""s46 (moe46): moe_experts forms read by small hooks in :mod:`npufuse.patterns.moe_experts`.

1. The dtype of the rows the code weights out of place on the sorted paths (sort_permute, sorted_pairs). The original
   ``h = h * gates[:, None]`` promotes (bf16 rows times fp32 routing weights are fp32 rows), and what follows reads
   the weighted rows: an output allocated ``dtype=h.dtype``, and ``index_add`` itself, which takes only a source of
   the output's dtype. The fused text runs that code before the unpermute (which weights), so it now casts the expert
   rows to the promoted dtype first (:func:`weighting_cast_line`): the unpermute then weights and returns in the
   original's dtype. An in-place ``h.mul_(w)`` keeps the rows' dtype: no cast there.
2. Dense gates built by an index put (``g = zeros_like(scores); g[torch.arange(T)[:, None], idx] = w``): the same
   matrix as ``g.scatter_(-1, idx, w)`` when every row of ``g`` is written by its own row of ``idx``, i.e. the
   arange runs over ``g``'s rows and ``idx`` has as many rows. The arange's length is read statically
   (:func:`index_put_gate_indices`: ``g``'s or ``idx``'s row count, or the allocation's own first size), the equal
   row counts are a run-time guard. Other arange lengths (a name computed elsewhere) are not read: with fewer rows
   the rows past it stay zero, with one row it broadcasts every id row into row 0.
3. Positions of the routes of one expert spelled as the 1-D column of ``nonzero`` (FlashMoE's ``pos =
   torch.nonzero(matches, as_tuple=False).reshape(-1)``, ``.view(-1)``, ``.flatten()``, ``.squeeze(-1)`` / ``(1)``,
   ``m.nonzero().squeeze(-1)``) of a mask bound in the loop to ``flat == e``: the ascending positions where it holds,
   as ``torch.where(flat == e)[0]`` (s42c's flat positions) reads them (:func:`positions_as_where`); such positions
   read a token-of-route map (``arange(T).unsqueeze(1).expand(-1, K).reshape(-1)[pos]``) as the pair's token.
4. Flat route arrays sorted together (FlashMoE: ``order = torch.argsort(exp_idx)``; ``exp_sorted = exp_idx[order]``,
   ``tok_sorted = tok_idx[order]``, ``w_sorted = w_flat[order]``) and an expert's positions taken in the sorted ids:
   the positions of expert e there select, through every array sorted by the same order, the same (token, slot)
   routes as the unsorted positions do, in another order; the fused layer replaces the whole loop, so only the set
   matters (the experts are called on the rows as the loop's other readings require). Every array the positions read
   must be sorted by that one order (:func:`sorted_route`); an unsorted array read at sorted positions is refused.
"""

from __future__ import annotations

import ast
from typing import Callable, Optional

from npufuse.patterns._defects_s44 import top_call_of
from npufuse.patterns import _moe_s45a
from npufuse.patterns.base import Fuse, Keep
from npufuse.scan.dataflow import ModuleInfo, Scope, const_value, keyword


def weighting_cast_line(rows: str, weights: str, indent: str) -> str:
    """The cast that gives the expert rows the dtype an out-of-place ``rows * weights`` gives them."""
    return f"{indent}{rows} = {rows}.to(torch.promote_types({rows}.dtype, {weights}.dtype))  # the weighting's dtype"


# -- 2. dense gates written by an index put -------------------------------------------------------------------------

def _row_column(module: ModuleInfo, node: ast.expr) -> Optional[ast.expr]:
    """``R`` of ``torch.arange(R)[:, None]`` (``.unsqueeze(1)`` / ``(-1)``, ``.view(-1, 1)`` / ``.reshape(-1, 1)``,
    ``[..., None]``; ``arange(0, R)``; ``device=`` / ``dtype=`` keywords): a column of the row numbers 0 .. R-1."""
    inner: Optional[ast.expr] = None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.keywords:
        args = [const_value(a) for a in node.args]
        if node.func.attr == "unsqueeze" and args in ([1], [-1]) or node.func.attr in ("view", "reshape") and args == [-1, 1]:
            inner = node.func.value
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 2:
        first, second = node.slice.elts
        whole = isinstance(first, ast.Slice) and first.lower is None and first.upper is None and first.step is None
        if (whole or isinstance(first, ast.Constant) and first.value is Ellipsis) \
                and isinstance(second, ast.Constant) and second.value is None:
            inner = node.value
    if not (isinstance(inner, ast.Call) and (module.canonical(inner.func) or "") == "torch.arange"
            and all(k.arg in ("device", "dtype") for k in inner.keywords)):
        return None
    if len(inner.args) == 1:
        return inner.args[0]
    if len(inner.args) == 2 and const_value(inner.args[0]) == 0 and not isinstance(const_value(inner.args[0]), bool):
        return inner.args[1]
    return None


def _rows_of(node: ast.expr) -> Optional[str]:
    """``t`` of ``t.shape[0]`` / ``t.size(0)`` / ``len(t)``: the row count of a named tensor."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape" \
            and isinstance(node.value.value, ast.Name) and const_value(node.slice) == 0:
        return node.value.value.id
    if isinstance(node, ast.Call) and not node.keywords and len(node.args) == 1:
        if isinstance(node.func, ast.Attribute) and node.func.attr == "size" and isinstance(node.func.value, ast.Name) \
                and const_value(node.args[0]) == 0:
            return node.func.value.id
        if isinstance(node.func, ast.Name) and node.func.id == "len" and isinstance(node.args[0], ast.Name):
            return node.args[0].id
    return None


def _first_size(module: ModuleInfo, zeros: ast.Call) -> Optional[ast.expr]:
    """The first size argument of ``torch.zeros(R, E)`` / ``torch.zeros((R, E))`` / ``t.new_zeros(R, E)``; for
    ``torch.zeros_like(s)``, ``s.shape[0]`` (as a node)."""
    canon = module.canonical(zeros.func) or ""
    if canon == "torch.zeros_like" and len(zeros.args) == 1:
        return ast.Subscript(value=ast.Attribute(value=zeros.args[0], attr="shape", ctx=ast.Load()),
                             slice=ast.Constant(0), ctx=ast.Load())
    sizes = list(zeros.args)
    if len(sizes) == 1 and isinstance(sizes[0], (ast.Tuple, ast.List)):
        sizes = list(sizes[0].elts)
    return sizes[0] if len(sizes) == 2 else None


def _rebound_between(scope: Scope, node: ast.expr, start: int, end: int) -> bool:
    """A name ``node`` reads is assigned on a line in [start, end]."""
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    return any(start <= st.lineno <= end for name in names for st, _v in scope.assignments.get(name, []))


def _row_count_is_gates(module: ModuleInfo, scope: Scope, count: ast.expr, gates: str, idx: str, zeros: ast.Call,
                        made: int, written: int) -> bool:
    """The arange's length is ``gates``' row count: read as such, as the ids' (the guard makes both equal), or spelled
    as the allocation's first size with no name in it rebound between the allocation and the write."""
    if _rows_of(count) in (gates, idx):
        return True
    first = _first_size(module, zeros)
    return first is not None and ast.dump(first) == ast.dump(count) and not _rebound_between(scope, count, made + 1, written)


def index_put_gate_indices(module: ModuleInfo, scope: Scope, gates: str, before: int) -> Optional[tuple[str, str]]:
    """``(idx, guard)`` when ``gates`` is bound once (a statement of the function's body, before ``before``) to zeros
    and written once after, at that level, by ``gates[torch.arange(R)[:, None], idx] = w`` (or
    ``gates.index_put_((rows, idx), w)``), the arange over ``gates``' rows, ``idx`` top-k indices bound once, ``w`` a
    name >= 0 by construction; ``guard`` the run-time facts the reading rests on (2-D, one id row per gate row)."""
    bound = scope.assignments.get(gates, [])
    body = getattr(scope.node, "body", [])
    if len(bound) != 1 or bound[0][0] not in body or bound[0][0].lineno >= before:
        return None
    made, zeros = bound[0]
    if not (isinstance(zeros, ast.Call) and _moe_s45a._zeros(module, zeros)):
        return None
    writes = _moe_s45a._in_place_writes(scope, gates)
    if len(writes) != 1:
        return None
    write = writes[0]
    stmt = next((st for st in body if made.lineno < st.lineno < before and any(n is write for n in ast.walk(st))), None)
    target = getattr(stmt, "targets", [None])
    if isinstance(stmt, ast.Assign) and len(target) == 1 and target[0] is write:
        pair, w = write.slice, stmt.value  # type: ignore[attr-defined]
    elif isinstance(stmt, ast.Expr) and stmt.value is write and write.func.attr == "index_put_" \
            and len(write.args) == 2 and all(k.arg == "accumulate" for k in write.keywords):  # type: ignore[attr-defined]
        accumulate = keyword(write, "accumulate")  # type: ignore[arg-type]
        if accumulate is not None and const_value(accumulate) is not False:
            return None  # (an accumulating put adds where a row repeats an id: not read)
        pair, w = write.args  # type: ignore[attr-defined]
    else:
        return None
    if not (isinstance(pair, ast.Tuple) and len(pair.elts) == 2 and isinstance(pair.elts[1], ast.Name)
            and isinstance(w, ast.Name)):
        return None
    rows, idx = pair.elts[0], pair.elts[1].id
    if isinstance(rows, ast.Name):  # `r = torch.arange(T, device=..)[:, None]` bound once before the write
        rbound = scope.assignments.get(rows.id, [])
        if len(rbound) != 1 or rbound[0][0].lineno >= stmt.lineno:
            return None
        rows = rbound[0][1]
    count = _row_column(module, rows)
    if count is None or len(scope.assignments.get(idx, [])) != 1 \
            or not _row_count_is_gates(module, scope, count, gates, idx, zeros, made.lineno, stmt.lineno) \
            or not _moe_s45a._nonnegative(module, scope, w, before) or top_call_of(module, scope, idx, before) is None:
        return None
    return idx, f"{gates}.dim() == 2 and {idx}.dim() == 2 and {gates}.shape[0] == {idx}.shape[0]"


# -- 3. positions of a flat mask spelled as nonzero's column -----------------------------------------------------------

def _column_of_nonzero(node: ast.expr) -> Optional[ast.expr]:
    """``m`` of ``torch.nonzero(m[, as_tuple=False])`` / ``m.nonzero()`` followed by ``.reshape(-1)`` / ``.view(-1)`` /
    ``.flatten()`` / ``.squeeze(-1)`` / ``.squeeze(1)``: for a 1-D ``m``, the [n] positions where it holds, ascending."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.keywords):
        return None
    args = [const_value(a) for a in node.args]
    if not (node.func.attr in ("reshape", "view") and args == [-1] or node.func.attr == "flatten" and not args
            or node.func.attr == "squeeze" and args in ([-1], [1])):
        return None
    inner = node.func.value
    if not isinstance(inner, ast.Call) or any(not (k.arg == "as_tuple" and const_value(k.value) is False) for k in inner.keywords):
        return None
    if isinstance(inner.func, ast.Attribute) and inner.func.attr == "nonzero" and not inner.args:
        return inner.func.value if not (isinstance(inner.func.value, ast.Name) and inner.func.value.id == "torch") else None
    if isinstance(inner.func, ast.Attribute) and inner.func.attr == "nonzero" and isinstance(inner.func.value, ast.Name) \
            and inner.func.value.id == "torch" and len(inner.args) == 1:
        return inner.args[0]
    return None


def _first_of_where(node: ast.expr) -> Optional[ast.expr]:
    """``m`` of ``torch.where(m)[0]`` / ``m.nonzero(as_tuple=True)[0]`` / ``torch.nonzero(m, as_tuple=True)[0]``."""
    if not (isinstance(node, ast.Subscript) and const_value(node.slice) == 0 and isinstance(node.value, ast.Call)):
        return None
    call = node.value
    is_torch = isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) and call.func.value.id == "torch"
    if is_torch and call.func.attr == "where" and len(call.args) == 1 and not call.keywords:  # type: ignore[attr-defined]
        return call.args[0]
    as_tuple = len(call.keywords) == 1 and call.keywords[0].arg == "as_tuple" and const_value(call.keywords[0].value) is True
    if not (as_tuple and isinstance(call.func, ast.Attribute) and call.func.attr == "nonzero"):
        return None
    if is_torch:
        return call.args[0] if len(call.args) == 1 else None
    return call.func.value if not call.args else None


def positions_as_where(value: ast.expr, body: list[ast.stmt]) -> Optional[ast.expr]:
    """``torch.where(<m's comparison>)[0]`` for ``nonzero(m)``'s column (:func:`_column_of_nonzero`) where ``m`` is a
    name bound once in ``body`` (a loop body), by a statement of it, to an equality, and read nowhere else there (its
    positions stand for it); None otherwise. ``m``'s rank is not known here: the flat-positions reading that takes the
    result checks that the compared tensor is a 1-D view."""
    mask = _column_of_nonzero(value) or _first_of_where(value)
    if not isinstance(mask, ast.Name):
        return None
    binds = [st for st in body if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
             and st.targets[0].id == mask.id]
    loads = [n for st in body for n in ast.walk(st) if isinstance(n, ast.Name) and n.id == mask.id]
    stores = [n for n in loads if not isinstance(n.ctx, ast.Load)]
    if len(binds) != 1 or len(stores) != 1 or len(loads) != 2 or binds[0].lineno >= value.lineno \
            or not (isinstance(binds[0].value, ast.Compare) and len(binds[0].value.ops) == 1
                    and isinstance(binds[0].value.ops[0], ast.Eq)):
        return None
    where = ast.Call(ast.Attribute(ast.Name("torch", ast.Load()), "where", ast.Load()), [binds[0].value], [])
    found = ast.Subscript(where, ast.Constant(0), ast.Load())
    for n in ast.walk(found):
        ast.copy_location(n, value)
    return found


# -- 4. flat route arrays sorted by one order ---------------------------------------------------------------------------

def sorted_route(scope: Scope, name: str, line: int) -> Optional[tuple[str, str, int]]:
    """``(X, order, n)`` when ``name`` reaching ``line`` was bound on line ``n`` (a straight-line statement of the
    function) to ``X[order]``, ``order`` the ascending sort order of ``X`` itself or of another array bound on the same
    terms, ``order`` and ``X`` not rebound from the sort to line ``n`` / the sort to ``line``."""
    from npufuse.patterns.moe_experts import _sorted_operand  # (moe_experts imports this module)

    found = _moe_s45a._straight_line_definition(scope, name, line)
    if found is None:
        return None
    value, n = found
    if not (isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) and isinstance(value.slice, ast.Name)):
        return None
    x, order = value.value.id, value.slice.id
    sorted_at = _moe_s45a._straight_line_definition(scope, order, line)
    if sorted_at is None or _sorted_operand(scope, order, sorted_at[1] + 1) is None \
            or any(sorted_at[1] < st.lineno < n for st, _v in scope.assignments.get(x, [])):
        return None
    return x, order, n


def permuted_by_own_sort(scope: Scope, node: ast.expr, line: int) -> Optional[ast.Name]:
    """``X`` of ``X[order]`` (read on ``line``) with ``order`` the ascending sort order of ``X`` itself, ``X`` not
    rebound between the sort and ``line``: the same values as ``X`` in another order (``torch.unique`` of it is
    ``torch.unique(X)``)."""
    from npufuse.patterns.moe_experts import _sorted_operand  # (moe_experts imports this module)

    if not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and isinstance(node.slice, ast.Name)):
        return None
    x, order = node.value.id, node.slice.id
    sorted_at = _moe_s45a._straight_line_definition(scope, order, line)
    operand = _sorted_operand(scope, order, sorted_at[1] + 1) if sorted_at is not None else None
    if not (isinstance(operand, ast.Name) and operand.id == x) \
            or any(sorted_at[1] < st.lineno < line for st, _v in scope.assignments.get(x, [])):  # type: ignore[index]
        return None
    return node.value


def sorted_ids_view(scope: Scope, flat: str, line: int, view_of: Callable[[Scope, str, int], Optional[str]]
                    ) -> Optional[tuple[str, str]]:
    """``(I, order)`` when ``flat`` is ``F[order]`` (:func:`sorted_route`) with ``order`` the sort order of ``F`` and
    ``F`` a flat view of ``I`` (``view_of``: s42c's reader) that keeps its value up to ``line``."""
    from npufuse.patterns.moe_experts import _sorted_operand

    route = sorted_route(scope, flat, line)
    if route is None:
        return None
    x, order, n = route
    operand = _sorted_operand(scope, order, n)
    indices = view_of(scope, x, n)
    if not (isinstance(operand, ast.Name) and operand.id == x) or indices is None \
            or any(n < st.lineno < line for st, _v in scope.assignments.get(indices, [])):
        return None
    return indices, order


# -- examples (``s46_*``) -------------------------------------------------------------------------------------------

# routing in fp32 (`.float().softmax`), experts and tokens in bf16: `h * gate[:, None]` gives fp32 rows, and the
# output the code allocates between the weighting and the index_add takes their dtype
SORT_PERMUTE_PROMOTED = _moe_s45a._HEAD + '''

class SortMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.n, self.k = n, k
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([Expert(d, h) for _ in range(n)])

    def run_experts(self, rows, counts):
        return torch.cat([self.experts[e](chunk) for e, chunk in enumerate(rows.split(counts.tolist()))])

    def forward(self, x):
        T, D = x.shape
        probs = self.router(x).float().softmax(dim=-1)
        w, ids = probs.topk(self.k, dim=-1)
        with torch.no_grad():
            sorted_ids, order = ids.flatten().sort()
            counts = torch.bincount(sorted_ids, minlength=self.n)
        tok = order // self.k
        gate = w.flatten()[order]
        h = x[tok]
        h = self.run_experts(h, counts)
        h = h * gate[:, None]
        out = torch.zeros(T, D, dtype=h.dtype, device=h.device)
        out = out.index_add(0, tok, h)
        return out
'''
SORT_PERMUTE_PROMOTED_RUN = '''\
torch.manual_seed(0)
m = SortMoE(16, 24, 5, 2).to(torch.bfloat16)
x = torch.randn(9, 16).to(torch.bfloat16).requires_grad_()
out = m(x)
leaves = [x, m.router.weight, m.experts[0].net[0].weight]
'''
# moe45a's sorted routes with fp32 routing over bf16 experts: weighted out of place (fp32 output) or in place (bf16)
SORTED_PAIRS_PROMOTED = _moe_s45a.SORTED_SCATTER_ADD.replace(
    "scores = self.router(hidden).softmax(dim=-1)", "scores = self.router(hidden).float().softmax(dim=-1)")
SORTED_PAIRS_IN_PLACE = SORTED_PAIRS_PROMOTED.replace(
    "y_sorted = y_sorted * gate_sorted.unsqueeze(-1)", "y_sorted.mul_(gate_sorted.unsqueeze(-1))")
SORTED_PAIRS_BF16_RUN = '''\
torch.manual_seed(0)
m = SortedMoE(16, 24, 5, 2).to(torch.bfloat16)
x = torch.randn(2, 7, 16).to(torch.bfloat16).requires_grad_()
out = m(x)
leaves = [x, m.router.weight, m.experts[1].net[0].weight]
'''

_SCATTERED = "        gates = torch.zeros_like(probs).scatter(-1, indices, top_p)\n"
# the dense gates of moe45a's chained form written by an index put over the gates' rows
PUT_ROWS = _moe_s45a.DENSE_CHAINED.replace(_SCATTERED, '''\
        gates = torch.zeros_like(probs)
        gates[torch.arange(gates.shape[0])[:, None], indices] = top_p
''')
# the allocation's own first size, a named row column with a device
PUT_NAMED_ROWS = _moe_s45a.DENSE_CHAINED.replace(_SCATTERED, '''\
        n_tok = flat.shape[0]
        gates = torch.zeros(n_tok, len(self.experts), device=flat.device)
        rows = torch.arange(n_tok, device=flat.device).unsqueeze(1)
        gates[rows, indices] = top_p
''')
# index_put_ with a tuple, new_zeros, the ids' row count
PUT_METHOD = _moe_s45a.DENSE_CHAINED.replace(_SCATTERED, '''\
        gates = probs.new_zeros(probs.shape[0], probs.shape[1])
        gates.index_put_((torch.arange(len(indices)).view(-1, 1), indices), top_p)
''')

# FlashMoE's export path, simplified to this class: flat (token, slot) routes, a token-of-route map, each expert's
# positions as `torch.nonzero(matches, as_tuple=False).reshape(-1)` of a mask bound in the loop
FLAT_NONZERO = _moe_s45a._HEAD + '''

class FlatRoutesMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.k = k
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([Expert(d, h) for _ in range(n)])

    def forward(self, x):
        B = x.size(0)
        K = self.k
        topk_weights, topk_idx = self.gate(x).softmax(dim=-1).topk(K, dim=-1)
        tok_idx = torch.arange(B, device=x.device).unsqueeze(1).expand(-1, K).reshape(-1)
        exp_idx = topk_idx.reshape(-1)
        w_flat = topk_weights.reshape(-1)
        y = torch.zeros_like(x)
        for e in range(len(self.experts)):
            matches = exp_idx == e
            pos = torch.nonzero(matches, as_tuple=False).reshape(-1)
            if pos.numel() == 0:
                continue
            toks = tok_idx[pos]
            ws = w_flat[pos]
            yb = self.experts[e](x[toks])
            y.index_add_(0, toks, yb * ws.unsqueeze(-1))
        return y
'''
FLAT_NONZERO_RUN = '''\
m = FlatRoutesMoE(16, 24, 5, 2)
x = torch.randn(11, 16, requires_grad=True)
out = m(x)
leaves = [x, m.gate.weight, m.experts[0].net[0].weight, m.experts[4].net[2].bias]
'''
# the method spelling, squeezed, the weights' flat view written inline
FLAT_NONZERO_SQUEEZE = FLAT_NONZERO.replace(
    "pos = torch.nonzero(matches, as_tuple=False).reshape(-1)", "pos = matches.nonzero().squeeze(-1)").replace(
    "ws = w_flat[pos]", "ws = topk_weights.view(-1)[pos]")

# the routes sorted by expert first (FlashMoE's export path): positions in the sorted ids, arrays sorted alike
FLAT_SORTED = FLAT_NONZERO.replace("        y = torch.zeros_like(x)\n", """\
        order = torch.argsort(exp_idx)
        exp_sorted = exp_idx[order]
        tok_sorted = tok_idx[order]
        w_sorted = w_flat[order]
        y = torch.zeros_like(x)
""").replace("matches = exp_idx == e", "matches = exp_sorted == e").replace(
    "toks = tok_idx[pos]", "toks = tok_sorted[pos]").replace("ws = w_flat[pos]", "ws = w_sorted[pos]")
# sorted in place (`a = a[order]` rebinding each array), `.sort()`'s order
FLAT_SORTED_REBOUND = FLAT_NONZERO.replace("        y = torch.zeros_like(x)\n", """\
        _, order = exp_idx.sort()
        exp_idx = exp_idx[order]
        tok_idx = tok_idx[order]
        w_flat = w_flat[order]
        y = torch.zeros_like(x)
""")

# the mask spelling of the sorted routes: `toks = tok_sorted[matches]`, emptiness as `matches.any()`
FLAT_SORTED_MASK = FLAT_SORTED.replace("""\
            pos = torch.nonzero(matches, as_tuple=False).reshape(-1)
            if pos.numel() == 0:
                continue
            toks = tok_sorted[pos]
            ws = w_sorted[pos]
""", """\
            if not matches.any():
                continue
            toks = tok_sorted[matches]
            ws = w_sorted[matches]
""")
# positions as `torch.where(matches)[0]` of the named mask (unsorted routes)
FLAT_WHERE_NAMED = FLAT_NONZERO.replace("pos = torch.nonzero(matches, as_tuple=False).reshape(-1)", "pos = torch.where(matches)[0]")

# FlashMoE's loop: over the experts present in the sorted ids (`torch.unique`), each id read back as a Python int
FLAT_SORTED_UNIQUE = FLAT_SORTED.replace("        for e in range(len(self.experts)):\n", """\
        active = torch.unique(exp_sorted)
        for e_t in active:
            e = int(e_t.item())
""")

_NOT_READ = "which npufuse does not read as the tokens routed to this expert"
FUSE = [
    Fuse(SORT_PERMUTE_PROMOTED, name="s46_sort_permute_fp32_weights_bf16_rows_output_of_the_weighted_dtype",
         run=SORT_PERMUTE_PROMOTED_RUN, expect={"routing": "sort_permute", "tokens": "x", "probs": "w"}),
    Fuse(SORTED_PAIRS_PROMOTED, name="s46_sorted_pairs_fp32_weights_out_of_place_promotes", run=SORTED_PAIRS_BF16_RUN,
         expect={"routing": "sorted_pairs", "probs": "top_w"}),
    Fuse(SORTED_PAIRS_IN_PLACE, name="s46_sorted_pairs_fp32_weights_in_place_keeps_the_rows_dtype",
         run=SORTED_PAIRS_BF16_RUN, expect={"routing": "sorted_pairs", "probs": "top_w"}),
    Fuse(PUT_ROWS, name="s46_dense_gates_index_put_over_the_gates_rows", run=_moe_s45a.DENSE_RUN,
         expect={"routing": "mask_where", "indices": "indices"}),
    Fuse(PUT_NAMED_ROWS, name="s46_dense_gates_index_put_named_row_column", run=_moe_s45a.DENSE_RUN,
         expect={"routing": "mask_where", "indices": "indices"}),
    Fuse(PUT_METHOD, name="s46_dense_gates_index_put_method_ids_rows", run=_moe_s45a.DENSE_RUN,
         expect={"routing": "mask_where", "indices": "indices"}),
    Fuse(FLAT_NONZERO, name="s46_flat_routes_nonzero_reshape_positions_token_map", run=FLAT_NONZERO_RUN,
         expect={"indices": "topk_idx", "tokens": "x"}),
    Fuse(FLAT_NONZERO_SQUEEZE, name="s46_flat_routes_nonzero_squeeze_positions_inline_weights", run=FLAT_NONZERO_RUN,
         expect={"indices": "topk_idx"}),
    Fuse(FLAT_SORTED, name="s46_flat_routes_sorted_together_positions_in_sorted_ids", run=FLAT_NONZERO_RUN,
         expect={"indices": "topk_idx", "tokens": "x"}),
    Fuse(FLAT_SORTED_REBOUND, name="s46_flat_routes_sorted_in_place_by_sort_order", run=FLAT_NONZERO_RUN,
         expect={"indices": "topk_idx"}),
    Fuse(FLAT_SORTED_MASK, name="s46_flat_routes_sorted_together_read_through_the_mask", run=FLAT_NONZERO_RUN,
         expect={"indices": "topk_idx"}),
    Fuse(FLAT_WHERE_NAMED, name="s46_flat_routes_where_of_a_named_mask", run=FLAT_NONZERO_RUN, expect={"indices": "topk_idx"}),
    Fuse(FLAT_SORTED_UNIQUE, name="s46_flat_routes_sorted_loop_over_unique_sorted_ids", run=FLAT_NONZERO_RUN,
         expect={"indices": "topk_idx"}),
    # the mask also counted per expert: a statistic replayed as written beside the fused layer
    Fuse(FLAT_NONZERO.replace("        y = torch.zeros_like(x)\n", "        y = torch.zeros_like(x)\n        load = []\n").replace(
        "            if pos.numel() == 0:\n", "            load.append(matches.sum())\n            if pos.numel() == 0:\n").replace(
        "        return y\n", "        return y, torch.stack(load)\n"),
         name="s46_flat_routes_nonzero_positions_mask_counted_too", run=FLAT_NONZERO_RUN, expect={"indices": "topk_idx"}),
]
KEEP = [
    # rows 0 .. b-1 only (b the batch size, not the token count): the original raises or leaves rows at zero there
    Keep(PUT_ROWS.replace("torch.arange(gates.shape[0])", "torch.arange(b)"), reason=_NOT_READ,
         name="s46_dense_gates_index_put_over_another_length"),
    # the size name rebound between the allocation and the put: the arange may not run over the gates' rows
    Keep(PUT_NAMED_ROWS.replace("        rows = torch.arange(", "        n_tok = n_tok // 2\n        rows = torch.arange("),
         reason=_NOT_READ, name="s46_dense_gates_index_put_size_rebound"),
    # shifted weights can be negative, and `gates[:, i] > 0` drops those routes: the permute would keep them
    Keep(PUT_ROWS.replace("        gates = torch.zeros_like(probs)\n",
                          "        shifted = top_p - 0.3\n        gates = torch.zeros_like(probs)\n").replace(
        "indices] = top_p", "indices] = shifted").replace("mask = gates[:, i] != 0", "mask = gates[:, i] > 0"),
         reason=_NOT_READ, name="s46_dense_gates_index_put_of_signed_values"),
    # written again after the put (a shared column): every token reaches expert 0
    Keep(PUT_ROWS.replace("indices] = top_p\n", "indices] = top_p\n        gates[:, 0] = 1.0\n"), reason=_NOT_READ,
         name="s46_dense_gates_index_put_then_a_column_set"),
]
_UNTRACED = "npufuse does not trace those values to the tokens routed to this expert"
KEEP += [
    # a tiled token map (`arange(B).repeat(K)`: route p = t * K + k holds token p % B, not t): the wrong rows
    Keep(FLAT_NONZERO.replace("torch.arange(B, device=x.device).unsqueeze(1).expand(-1, K).reshape(-1)",
                              "torch.arange(B, device=x.device).repeat(K)"), reason=_UNTRACED,
         name="s46_flat_routes_nonzero_positions_tiled_token_map"),
    # the mask narrowed by a weight threshold before its positions are taken: routes below it are dropped
    Keep(FLAT_NONZERO.replace("            matches = exp_idx == e\n", "            matches = exp_idx == e\n            matches &= w_flat > 0.3\n"),
         reason="unrecognised update in the expert loop", name="s46_flat_routes_nonzero_positions_mask_narrowed"),
    # 2-D [n, 1] positions (no reshape): `tok_idx[pos]` is [n, 1], not the routes' tokens as a list
    Keep(FLAT_NONZERO.replace("pos = torch.nonzero(matches, as_tuple=False).reshape(-1)", "pos = torch.nonzero(matches)"),
         reason=_UNTRACED, name="s46_flat_routes_nonzero_positions_not_flattened"),
]
KEEP += [
    # the weights left unsorted but read at positions in the sorted ids: each route would take another route's weight
    Keep(FLAT_SORTED.replace("ws = w_sorted[pos]", "ws = w_flat[pos]"), reason=_UNTRACED,
         name="s46_flat_routes_sorted_weights_read_unsorted"),
    # the token taken as `pos // K` of a position in the sorted ids: not the route's token
    Keep(FLAT_SORTED.replace("toks = tok_sorted[pos]", "toks = pos // K"),
         reason="npufuse does not trace its input to the rows routed to this expert",
         name="s46_flat_routes_sorted_position_divided_by_k"),
]
KEEP += [
    # the mask spelling with the token map left unsorted: the sorted mask picks other routes' tokens
    Keep(FLAT_SORTED_MASK.replace("toks = tok_sorted[matches]", "toks = tok_idx[matches]"), reason="npufuse does not trace",
         name="s46_flat_routes_sorted_mask_reads_an_unsorted_token_map"),
]
KEEP += [
    # only the first two experts present: the others' routes are not computed
    Keep(FLAT_SORTED_UNIQUE.replace("active = torch.unique(exp_sorted)", "active = torch.unique(exp_sorted)[:2]"),
         reason="subset of the experts that received tokens", name="s46_flat_routes_sorted_loop_over_some_unique_ids"),
]
