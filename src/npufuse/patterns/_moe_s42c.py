"""s42 (helper moe42c): moe_experts recall classes for expert-parallel loops over this rank's experts.

An expert-parallel layer keeps the global expert loop and skips the experts another rank holds
(``if e not in self.local_experts: continue``), or loops over this rank's expert ids directly
(``for e in self.local_expert_ids:``). Where the id list is built in ``__init__`` as one contiguous
``range`` (``list(range(rank * n, (rank + 1) * n))``), a single rank (or no expert parallelism)
holds every expert: then the skip never fires and the loop is the plain ``range(E)`` dispatch the
fused layer replaces. That is a run-time fact, so the fused text runs only where the list covers
every expert the loop visits; a shard keeps the loop as written. Lists that are not a range (a
literal subset, a strided ``range(rank, E, world)``) keep the true near miss: they say nothing
about which experts one rank holds.

The functions here read syntax only and return guard texts (or None); ``moe_experts`` calls them
from its loop analysis.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Callable, Optional

from npufuse.patterns.base import Fuse, Keep
from npufuse.scan.dataflow import Scope, const_value, dotted

_RANGE_WRAPPERS = {"list", "tuple", "set", "sorted"}


def _contiguous_range(node: ast.expr) -> bool:
    """``range(a, b)`` / ``range(b)`` (no step), or that range wrapped in ``list`` / ``tuple`` / ``set`` /
    ``sorted``, or ``[i for i in range(a, b)]``, or ``torch.arange(a, b).tolist()``: consecutive integers."""
    if isinstance(node, ast.Call) and not node.keywords and dotted(node.func) == "range":
        return 1 <= len(node.args) <= 2
    if isinstance(node, ast.Call) and not node.keywords and dotted(node.func) in _RANGE_WRAPPERS and len(node.args) == 1:
        return _contiguous_range(node.args[0])
    if isinstance(node, ast.ListComp) and len(node.generators) == 1:
        gen = node.generators[0]
        return (not gen.ifs and not gen.is_async and isinstance(gen.target, ast.Name) and isinstance(node.elt, ast.Name)
                and node.elt.id == gen.target.id and _contiguous_range(gen.iter))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "tolist" \
            and not node.args and not node.keywords:
        inner = node.func.value
        return (isinstance(inner, ast.Call) and dotted(inner.func) in ("torch.arange", "arange")
                and 1 <= len(inner.args) <= 2 and not inner.keywords)
    return False


def local_range_list(node: ast.expr, init_assigns: dict[str, ast.expr]) -> Optional[str]:
    """The text of ``self.<attr>`` when ``__init__`` (``init_assigns``: the class's ``self.<attr> = value``) binds
    it to a contiguous range of expert ids; else None."""
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self" and isinstance(node.ctx, ast.Load)):
        return None
    value = init_assigns.get(node.attr)
    if value is None or not _contiguous_range(value):
        return None
    return f"self.{node.attr}"


def membership_skip_guard(local_list: str, bins: str, prefix: str) -> str:
    """``if e not in L: continue`` in ``for e in range(bins)``: the skip never fires where every visited id is in L."""
    return f"all({prefix}e in {local_list} for {prefix}e in range({bins}))"


def local_ids_loop_guard(local_list: str) -> str:
    """``for e in L`` is ``for e in range(L[0], L[0] + len(L))`` where L holds those ids in order at run time (the
    __init__ code that built it may not have run as read: a subclass, a later reassignment)."""
    return f"(len({local_list}) > 0 and list({local_list}) == list(range({local_list}[0], {local_list}[0] + len({local_list}))))"



# -- class 5: flat positions of [T, K] top-k pairs -------------------------------------------
#
# ``flat = idx.view(-1)``; ``pos = torch.where(flat == e)[0]`` lists the flat positions p = t * K + k of the pairs
# routed to e, ascending: exactly ``torch.where(idx == e)`` of the 2-D indices, as (p // K, p % K). The loop then
# reads the token as ``pos // K``, the slot as ``pos % K``, the token's row as ``x.repeat_interleave(K, dim=0)[pos]``
# (row p of the repeated tokens is x[p // K]) and the pair's weight as ``w.view(-1)[pos]``. Each read is translated
# into the (token, slot) pair form the loop analysis knows; K, 2-D indices and 2-D tokens are checked at run time.


@dataclass
class FlatPositions:
    """``pos`` = positions of expert e in ``flat`` (a 1-D view of the 2-D indices ``indices``)."""

    flat: str
    indices: str
    k_text: str = ""  # K as the loop writes it (``pos // K``, ``repeat_interleave(K)``): one text for every read
    tokens: str = ""  # x of ``x.repeat_interleave(K, dim=0)`` rows read at pos
    order: str = ""  # s46: the flat ids are sorted by this order: every array read at pos must be sorted by it too
    weights: str = ""  # s46: W of weights read as W[tok, slot] on that path (checked shaped like the indices)
    reads: list[tuple[ast.expr, ast.expr]] = field(default_factory=list)  # (read as written, its pair form)


def _flat_view_of(scope: Scope, name: str, line: int) -> Optional[str]:
    """``I`` when ``name`` was last bound to ``I.view(-1)`` / ``I.reshape(-1)`` / ``I.flatten()`` (I a name) and I is
    not rebound between that and ``line`` (the loop reads I itself in place of the view)."""
    node = scope.definition(name, line)
    source = _flat_view_call(node)
    return source if source is not None and node is not None and _unchanged(scope, source, node.lineno, line) else None


def _unchanged(scope: Scope, name: str, since: int, line: int) -> bool:
    """No assignment to ``name`` after line ``since`` and before ``line``."""
    return not any(since < st.lineno < line for st, _ in scope.assignments.get(name, []))


def _flat_view_call(node: Optional[ast.expr]) -> Optional[str]:
    """``I`` of ``I.view(-1)`` / ``I.reshape(-1)`` / ``I.flatten()`` (I a name)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and not node.keywords):
        return None
    if node.func.attr in ("view", "reshape") and len(node.args) == 1 and const_value(node.args[0]) == -1:
        return node.func.value.id
    if node.func.attr == "flatten" and not node.args:
        return node.func.value.id
    return None


def flat_positions(scope: Scope, value: ast.expr, is_expert: Callable[[ast.expr], bool], line: int) -> Optional[FlatPositions]:
    """``torch.where(flat == e)[0]`` / ``(flat == e).nonzero(as_tuple=True)[0]`` with ``flat`` a 1-D view of a name."""
    if not (isinstance(value, ast.Subscript) and const_value(value.slice) == 0 and isinstance(value.value, ast.Call)):
        return None
    call = value.value
    if dotted(call.func) == "torch.where" and len(call.args) == 1 and not call.keywords:
        test = call.args[0]
    elif isinstance(call.func, ast.Attribute) and call.func.attr == "nonzero" and not call.args \
            and len(call.keywords) == 1 and call.keywords[0].arg == "as_tuple" and const_value(call.keywords[0].value) is True:
        test = call.func.value
    else:
        return None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return None
    flat, other = test.left, test.comparators[0]
    if not isinstance(flat, ast.Name):
        flat, other = other, flat
    if not (isinstance(flat, ast.Name) and is_expert(other)):
        return None
    indices = _flat_view_of(scope, flat.id, line)
    if indices is None:  # s46: flat ids sorted by an order of their own (patterns/_moe_s46.py)
        from npufuse.patterns._moe_s46 import sorted_ids_view

        found = sorted_ids_view(scope, flat.id, line, _flat_view_of)
        return FlatPositions(flat.id, found[0], order=found[1]) if found is not None else None
    return FlatPositions(flat.id, indices) if indices is not None else None


def translate_position_reads(scope: Scope, body: list[ast.stmt], pos: str, fp: FlatPositions, tok: str, slot: str,
                             expert: ast.expr, line: int) -> Optional[str]:
    """Fill ``fp.reads`` with the pair form of every read of ``pos`` in ``body``; None when all are translated, else
    the read that is not (the loop is then analysed as written). ``tok`` / ``slot`` name the pair's coordinates."""
    loads = [n for st in body for n in ast.walk(st) if isinstance(n, ast.Name) and n.id == pos and isinstance(n.ctx, ast.Load)]
    parents: dict[int, ast.AST] = {}
    for st in body:
        for node in ast.walk(st):
            for child in ast.iter_child_nodes(node):
                parents[id(child)] = node
    tok_node, slot_node = ast.Name(tok, ast.Load()), ast.Name(slot, ast.Load())
    for n in loads:
        parent = parents.get(id(n))
        if fp.order:  # s46: sorted positions read only arrays sorted by the same order (and sizes)
            if _sorted_position_read(scope, parent, n, fp, tok_node, slot_node, expert, line):
                continue
            return ast.unparse(parent) if parent is not None else pos
        if isinstance(parent, ast.BinOp) and parent.left is n and isinstance(parent.op, (ast.FloorDiv, ast.Mod)):
            k = ast.unparse(parent.right)
            if fp.k_text and k != fp.k_text:
                return ast.unparse(parent)
            fp.k_text = k
            fp.reads.append((parent, tok_node if isinstance(parent.op, ast.FloorDiv) else slot_node))
            continue
        if isinstance(parent, ast.Attribute) and parent.attr in ("numel", "nelement", "shape", "size"):
            continue  # the number of pairs: the same for the pair coordinates
        if isinstance(parent, ast.Call) and dotted(parent.func) == "len" and parent.args == [n]:
            continue
        if isinstance(parent, ast.Subscript) and not isinstance(parent.ctx, ast.Load):
            return ast.unparse(parent)  # written through: not a read of the pair's rows
        if isinstance(parent, ast.Subscript) and parent.slice is n and _flat_view_call(parent.value) is not None:
            pair = ast.Tuple([tok_node, slot_node], ast.Load())  # w.view(-1)[pos] written inline
            fp.reads.append((parent, ast.Subscript(ast.Name(_flat_view_call(parent.value), ast.Load()), pair, ast.Load())))
            continue
        if isinstance(parent, ast.Subscript) and parent.slice is n and isinstance(parent.value, ast.Name):
            src = parent.value.id
            if src == fp.flat:
                fp.reads.append((parent, expert))  # flat[pos] == e
                continue
            d = scope.definition(src, line)
            if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "repeat_interleave" \
                    and isinstance(d.func.value, ast.Name) and len(d.args) >= 1 and len(d.args) + len(d.keywords) == 2:
                dim = d.args[1] if len(d.args) == 2 else (d.keywords[0].value if d.keywords[0].arg == "dim" else None)
                k = ast.unparse(d.args[0])
                if dim is None or const_value(dim) != 0 or (fp.k_text and k != fp.k_text) \
                        or (fp.tokens and fp.tokens != d.func.value.id) \
                        or not _unchanged(scope, d.func.value.id, d.lineno, line):
                    return ast.unparse(parent)
                fp.k_text, fp.tokens = k, d.func.value.id
                fp.reads.append((parent, ast.Subscript(ast.Name(fp.tokens, ast.Load()), tok_node, ast.Load())))
                continue
            k = _token_map_k(scope, d, line)  # s46: a token-of-route map read at the positions is the token
            if k is not None and not (fp.k_text and k != fp.k_text):
                fp.k_text = k
                fp.reads.append((parent, tok_node))
                continue
            w = _flat_view_of(scope, src, line)
            if w is not None:
                pair = ast.Tuple([tok_node, slot_node], ast.Load())
                fp.reads.append((parent, ast.Subscript(ast.Name(w, ast.Load()), pair, ast.Load())))
                continue
        return ast.unparse(parent) if parent is not None else pos
    return None if fp.k_text else pos


def _sorted_position_read(scope: Scope, parent: Optional[ast.AST], n: ast.Name, fp: FlatPositions, tok: ast.Name,
                          slot: ast.Name, expert: ast.expr, line: int) -> bool:
    """s46: a read of positions in ids sorted by ``fp.order``: a size, the sorted ids, or ``A[pos]`` of an array
    ``A = X[order]`` sorted by the same order whose unsorted ``X`` is a token-of-route map or a flat view of the
    weights (read as the pair's token / weight); ``fp.reads`` takes it. False for anything else (``pos // K`` of a
    sorted position is no token)."""
    from npufuse.patterns._moe_s46 import sorted_route

    if isinstance(parent, ast.Attribute) and parent.attr in ("numel", "nelement", "shape", "size") \
            or isinstance(parent, ast.Call) and dotted(parent.func) == "len" and parent.args == [n]:
        return True
    if not (isinstance(parent, ast.Subscript) and parent.slice is n and isinstance(parent.ctx, ast.Load)
            and isinstance(parent.value, ast.Name)):
        return False
    if parent.value.id == fp.flat:
        fp.reads.append((parent, expert))
        return True
    route = sorted_route(scope, parent.value.id, line)
    if route is None or route[1] != fp.order:
        return False
    x, _, at = route
    k = _token_map_k(scope, scope.definition(x, at), line)
    if k is not None and not (fp.k_text and k != fp.k_text):
        fp.k_text = k
        fp.reads.append((parent, tok))
        return True
    w = _flat_view_of(scope, x, at)
    if w is None or not _unchanged(scope, w, at, line):
        return False
    if fp.weights and fp.weights != w:
        return False
    fp.weights = w
    fp.reads.append((parent, ast.Subscript(ast.Name(w, ast.Load()), ast.Tuple([tok, slot], ast.Load()), ast.Load())))
    return True


def _token_map_k(scope: Scope, definition: Optional[ast.expr], line: int) -> Optional[str]:
    """K (as written) of a token-of-route map (s45b's ``token_of_route``) whose names are not rebound before ``line``."""
    from npufuse.patterns._moe_s45b import _names_unchanged, token_of_route  # (s45b imports this module)

    k = token_of_route(definition)
    return k if k is not None and definition is not None and _names_unchanged(scope, definition, line) else None


def position_guard(fp: FlatPositions) -> str:
    """The run-time facts the pair reading rests on: 2-D [T, K] indices with K the divisor, 2-D tokens of T rows."""
    facts = [f"{fp.indices}.dim() == 2", f"{fp.indices}.shape[1] == {fp.k_text}"]
    if fp.tokens:
        facts += [f"{fp.tokens}.dim() == 2", f"{fp.tokens}.shape[0] == {fp.indices}.shape[0]"]
    if fp.weights:  # s46 (sorted routes): W.view(-1)[p] is W[t, k] where W is [T, K]
        facts.append(f"{fp.weights}.shape == {fp.indices}.shape")
    return " and ".join(facts)



def accumulated_put(call: ast.Call) -> Optional[tuple[ast.expr, ast.expr]]:
    """(the rows, the values) of ``out.index_put_(indices, values, accumulate=True)`` (indices a literal tuple; one
    element stands for itself): the same sum as ``out[indices] += values`` where the rows are distinct (an expert's
    tokens are: top-k indices are distinct)."""
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "index_put_"):
        return None
    names = ("indices", "values", "accumulate")
    given = dict(zip(names, call.args))
    for kw in call.keywords:
        if kw.arg not in names or kw.arg in given:
            return None
        given[kw.arg] = kw.value
    rows, values, acc = given.get("indices"), given.get("values"), given.get("accumulate")
    if len(call.args) > 3 or values is None or acc is None or const_value(acc) is not True or not isinstance(rows, ast.Tuple):
        return None
    return (rows.elts[0] if len(rows.elts) == 1 else rows), values



# -- class 3: the rows of ``(idx == e).nonzero()`` read column by column ---------------------
#
# ``nz = (idx == e).nonzero()`` is [n, idx.dim()]: its columns are ``torch.where(idx == e)``, in the same order. A loop
# that reads nz only as whole columns unpacked into names (``b, t, k = nz[:, 0], nz[:, 1], nz[:, 2]``,
# ``b, t, k = nz.unbind(-1)``, ``= nz.t()``) or through its size reads the pairs of torch.where.


def _size_read(parent: Optional[ast.AST], n: ast.Name) -> bool:
    return (isinstance(parent, ast.Attribute) and parent.attr in ("numel", "nelement", "shape", "size")) or (
        isinstance(parent, ast.Call) and dotted(parent.func) == "len" and parent.args == [n])


def _columns_of(value: ast.expr, name: str, count: int) -> bool:
    """``name[:, 0], ..., name[:, count - 1]`` in order, ``name.unbind(-1 | 1)``, ``name.t()`` or ``name.T``."""
    if isinstance(value, ast.Tuple):
        return len(value.elts) == count and all(
            isinstance(c, ast.Subscript) and isinstance(c.value, ast.Name) and c.value.id == name
            and isinstance(c.slice, ast.Tuple) and len(c.slice.elts) == 2 and isinstance(c.slice.elts[0], ast.Slice)
            and c.slice.elts[0].lower is None and c.slice.elts[0].upper is None and c.slice.elts[0].step is None
            and const_value(c.slice.elts[1]) == j for j, c in enumerate(value.elts))
    if isinstance(value, ast.Attribute) and value.attr == "T":
        return isinstance(value.value, ast.Name) and value.value.id == name
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and isinstance(value.func.value, ast.Name)
            and value.func.value.id == name):
        return False
    if value.func.attr == "t":
        return not value.args and not value.keywords
    if value.func.attr == "unbind":
        dim = value.args[0] if len(value.args) == 1 and not value.keywords else (
            value.keywords[0].value if not value.args and len(value.keywords) == 1 and value.keywords[0].arg == "dim" else None)
        return dim is not None and const_value(dim) in (-1, 1)
    return False


def nonzero_columns(body: list[ast.stmt], name: str, value: ast.expr) -> Optional[tuple[ast.expr, list[tuple[ast.expr, int]]]]:
    """For ``name = X.nonzero()`` / ``torch.nonzero(X)`` (no as_tuple): (X, [(each unpacked column read, its number of
    names)]) when the body reads ``name`` only as unpacked columns or sizes; else None."""
    mask = _nonzero_mask(value)
    if mask is None:
        return None
    parents: dict[int, ast.AST] = {}
    unpacks: dict[int, tuple[ast.expr, int]] = {}
    for st in body:
        for node in ast.walk(st):
            for child in ast.iter_child_nodes(node):
                parents[id(child)] = node
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple) \
                    and all(isinstance(e, ast.Name) for e in node.targets[0].elts) \
                    and _columns_of(node.value, name, len(node.targets[0].elts)):
                unpacks[id(node.value)] = (node.value, len(node.targets[0].elts))
    reads: list[tuple[ast.expr, int]] = []
    for st in body:
        for n in ast.walk(st):
            if not (isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)):
                continue
            parent = parents.get(id(n))
            if _size_read(parent, n):
                continue
            owner = parent
            while owner is not None and id(owner) not in unpacks:
                owner = parents.get(id(owner))
            if owner is None:
                return None
            if unpacks[id(owner)] not in reads:
                reads.append(unpacks[id(owner)])
    return (mask, reads) if reads else None



def inline_nonzero_unpack(value: ast.expr) -> Optional[ast.expr]:
    """X of ``X.nonzero().unbind(-1)`` / ``torch.nonzero(X).t()`` / ``X.nonzero().T`` written as an unpacked value."""
    if isinstance(value, ast.Attribute):
        inner = value.value
    elif isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
        inner = value.func.value
    else:
        return None
    mask = _nonzero_mask(inner)
    return mask if mask is not None and _columns_of(_renamed(value, inner), "_nz", 0) else None


def _renamed(value: ast.expr, inner: ast.expr) -> ast.expr:
    """``value`` with its receiver ``inner`` replaced by the name ``_nz`` (to test the column spelling)."""
    if isinstance(value, ast.Attribute):
        return ast.Attribute(ast.Name("_nz", ast.Load()), value.attr, ast.Load())
    assert isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
    return ast.Call(ast.Attribute(ast.Name("_nz", ast.Load()), value.func.attr, ast.Load()), value.args, value.keywords)


def _nonzero_mask(value: ast.expr) -> Optional[ast.expr]:
    """X of ``X.nonzero()`` / ``torch.nonzero(X)`` (no as_tuple)."""
    if not (isinstance(value, ast.Call) and not value.keywords):
        return None
    if isinstance(value.func, ast.Attribute) and value.func.attr == "nonzero" and not value.args:
        return value.func.value
    if dotted(value.func) == "torch.nonzero" and len(value.args) == 1:
        return value.args[0]
    return None


# -- examples (registered on MoeExperts by moe_experts.py) ------------------------------------

_HEAD = '''\
import torch
import torch.nn.functional as F
from torch import nn


class GluExpert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w_in = nn.Linear(d, 2 * h, bias=False)
        self.w_out = nn.Linear(h, d, bias=False)

    def forward(self, x):
        a, b = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(F.silu(a) * b)
'''


def _run(make: str, x_shape: str, leaves: str) -> str:
    """The run of an example: the module, random tokens of ``x_shape``, gradients of ``x`` and ``leaves``."""
    return f"m = {make}\nx = torch.randn({x_shape}, requires_grad=True)\nout = m(x)\nleaves = [x, {leaves}]\n"


# 4a. the global expert loop skips the experts of other ranks by membership in a contiguous id list
MEMBERSHIP_SKIP = _HEAD + '''

class RankMoE(nn.Module):
    def __init__(self, d, h, n, k, rank=0, world=1):
        super().__init__()
        self.n, self.k = n, k
        per = n // world
        self.local_experts = list(range(rank * per, (rank + 1) * per))
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([GluExpert(d, h) for _ in range(n)])

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        topk_w, topk_i = torch.topk(probs, self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.n):
            if e not in self.local_experts:
                continue
            token_idx, slot_idx = torch.where(topk_i == e)
            if token_idx.numel() == 0:
                continue
            y = self.experts[e](x[token_idx])
            out.index_add_(0, token_idx, topk_w[token_idx, slot_idx, None] * y)
        return out
'''
MEMBERSHIP_SKIP_RUN = _run("RankMoE(16, 12, 6, 2)", "10, 16", "m.gate.weight, m.experts[5].w_in.weight")
MEMBERSHIP_SKIP_SHARD_RUN = _run("RankMoE(16, 12, 6, 2, rank=1, world=2)", "10, 16", "m.gate.weight, m.experts[5].w_in.weight")

# 4b. the loop runs this rank's expert ids (a contiguous range built in __init__) over [B, S, H] tokens
LOCAL_IDS_LOOP = _HEAD + '''

class ShardMoE(nn.Module):
    def __init__(self, d, h, n, k, rank=0, world=1):
        super().__init__()
        self.k = k
        per = n // world
        self.local_expert_ids = [i for i in range(rank * per, (rank + 1) * per)]
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([GluExpert(d, h) for _ in range(n)])

    def forward(self, x):
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        weights, chosen = torch.topk(torch.sigmoid(self.router(flat)), self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        result = torch.zeros_like(flat)
        for expert_id in self.local_expert_ids:
            rows, slots = (chosen == expert_id).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            result.index_add_(0, rows, self.experts[expert_id](flat[rows]) * weights[rows, slots].unsqueeze(-1))
        return result.view(b, s, d)
'''
LOCAL_IDS_LOOP_RUN = _run("ShardMoE(16, 12, 6, 2)", "2, 5, 16", "m.router.weight, m.experts[5].w_in.weight")
LOCAL_IDS_LOOP_SHARD_RUN = _run("ShardMoE(16, 12, 6, 2, rank=1, world=2)", "2, 5, 16",
                                "m.router.weight, m.experts[5].w_in.weight")

def _init(gate: str) -> str:
    """``__init__(d, h, n, k)`` of an example MoE: a bias-free router named ``gate`` and n GLU experts."""
    return (f"    def __init__(self, d, h, n, k):\n        super().__init__()\n        self.n, self.k = n, k\n"
            f"        self.{gate} = nn.Linear(d, n, bias=False)\n"
            "        self.experts = nn.ModuleList([GluExpert(d, h) for _ in range(n)])\n")


# 5a. flat positions of the top-k pairs: repeated token rows, the token as pos // K, the weight off the flat weights
FLAT_POSITIONS = _HEAD + '''

class RepeatMoE(nn.Module):
''' + _init('gate') + '''
    def forward(self, x):
        shape = x.shape
        x = x.view(-1, shape[-1])
        topk_w, topk_i = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        flat_idx = topk_i.view(-1)
        flat_w = topk_w.view(-1)
        x_rep = x.repeat_interleave(self.k, dim=0)
        out = torch.zeros_like(x)
        for i in range(self.n):
            pos = torch.where(flat_idx == i)[0]
            if pos.numel() == 0:
                continue
            y = self.experts[i](x_rep[pos])
            out.index_add_(0, pos // self.k, y * flat_w[pos].unsqueeze(1))
        return out.view(shape)
'''
FLAT_POSITIONS_RUN = _run("RepeatMoE(16, 12, 5, 2)", "2, 6, 16", "m.gate.weight, m.experts[3].w_in.weight")

# 5b. the same positions from nonzero(as_tuple=True), dense gates read at (token, expert), written per token
DENSE_GATES = _HEAD + '''

class DenseGateMoE(nn.Module):
''' + _init('router') + '''
    def forward(self, x):
        logits = self.router(x)
        top_v, top_i = logits.topk(self.k, dim=-1)
        gates = torch.zeros_like(logits).scatter(-1, top_i, F.softmax(top_v, dim=-1))
        flat = top_i.reshape(-1)
        result = torch.zeros_like(x)
        for e in range(self.n):
            pos = (flat == e).nonzero(as_tuple=True)[0]
            if len(pos) == 0:
                continue
            tok = pos // self.k
            y = self.experts[e](x[tok])
            result.index_add_(0, tok, y * gates[tok, e].unsqueeze(-1))
        return result
'''
DENSE_GATES_RUN = _run("DenseGateMoE(16, 12, 5, 2)", "9, 16", "m.router.weight, m.experts[1].w_out.weight")

# 3a. [B, T, K] indices, the rows of nonzero() unpacked column by column, added back with index_put_(accumulate=True)
NONZERO_COLUMNS = _HEAD + '''

class GridMoE(nn.Module):
''' + _init('gate') + '''
    def forward(self, x):
        w, idx = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.n):
            hits = (idx == e).nonzero()
            if hits.shape[0] == 0:
                continue
            b, t, k = hits[:, 0], hits[:, 1], hits[:, 2]
            y = self.experts[e](x[b, t])
            out.index_put_((b, t), y * w[b, t, k].unsqueeze(-1), accumulate=True)
        return out
'''
NONZERO_COLUMNS_RUN = _run("GridMoE(16, 12, 5, 2)", "2, 6, 16", "m.gate.weight, m.experts[0].w_in.weight")

# 3b. the same pairs unbound inline, added back per token
NONZERO_UNBIND = NONZERO_COLUMNS.replace(
    "            hits = (idx == e).nonzero()\n            if hits.shape[0] == 0:\n                continue\n"
    "            b, t, k = hits[:, 0], hits[:, 1], hits[:, 2]\n",
    "            b, t, k = torch.nonzero(idx == e).unbind(-1)\n").replace(
    "            out.index_put_((b, t), y * w[b, t, k].unsqueeze(-1), accumulate=True)\n",
    "            out[b, t] += w[b, t, k, None] * y\n")

_LIST = "list(range(rank * per, (rank + 1) * per))"
_COMP = "[i for i in range(rank * per, (rank + 1) * per)]"

FUSE = [
    Fuse(MEMBERSHIP_SKIP, name="s42c_global_loop_skips_experts_not_in_a_local_range", run=MEMBERSHIP_SKIP_RUN),
    Fuse(LOCAL_IDS_LOOP, name="s42c_loop_over_local_expert_ids_of_a_range", run=LOCAL_IDS_LOOP_RUN),
    # rank 1 of 2: the ids are range(3, 6), the fused text runs only those experts' rows (the others come back zero)
    Fuse(LOCAL_IDS_LOOP, name="s42c_loop_over_local_expert_ids_second_rank", run=LOCAL_IDS_LOOP_SHARD_RUN),
]

FUSE += [
    Fuse(FLAT_POSITIONS, name="s42c_flat_positions_of_repeated_rows", run=FLAT_POSITIONS_RUN),
    Fuse(DENSE_GATES, name="s42c_flat_positions_dense_gates_at_token_expert", run=DENSE_GATES_RUN),
]

FUSE += [
    Fuse(NONZERO_COLUMNS, name="s42c_nonzero_columns_of_btk_indices_index_put", run=NONZERO_COLUMNS_RUN),
    Fuse(NONZERO_UNBIND, name="s42c_nonzero_unbound_inline_btk", run=NONZERO_COLUMNS_RUN),
]

KEEP = [
    # the columns unpacked out of order: (t, b) is not the token of (b, t)
    Keep(NONZERO_COLUMNS.replace("b, t, k = hits[:, 0], hits[:, 1], hits[:, 2]", "t, b, k = hits[:, 1], hits[:, 0], hits[:, 2]")
         .replace("x[b, t]", "x[t, b]"),
         reason="lists (row, slot) pairs, not rows", name="s42c_nonzero_columns_out_of_order"),
    # index_put_ without accumulate writes the rows (the last expert's value wins), it does not add them
    Keep(NONZERO_COLUMNS.replace(", accumulate=True)", ")"),
         reason="which the fused layer would not", name="s42c_index_put_without_accumulate"),
    # the repeated rows repeat each token 2 times while the positions are divided by self.k: row p of x_rep is not
    # x[p // self.k] unless K == 2 (the reads do not agree on one K)
    Keep(FLAT_POSITIONS.replace("x.repeat_interleave(self.k, dim=0)", "x.repeat_interleave(2, dim=0)"),
         reason="not a token dispatch", name="s42c_flat_positions_rows_repeated_another_k"),
    # the tokens rebound after they were repeated: x_rep[pos] is a row of the old x, not of the x the loop reads
    Keep(FLAT_POSITIONS.replace("        out = torch.zeros_like(x)\n", "        x = x * 2\n        out = torch.zeros_like(x)\n"),
         reason="not a token dispatch", name="s42c_flat_positions_tokens_rebound_after_the_repeat"),
    # a slot-major flatten (position k * T + t): pos // K is not the token
    Keep(FLAT_POSITIONS.replace("flat_idx = topk_i.view(-1)", "flat_idx = topk_i.t().reshape(-1)"),
         reason="not a token dispatch", name="s42c_flat_positions_of_a_transposed_flatten"),
    # the positions themselves used as token rows (no // K): the flat position is not a token
    Keep(FLAT_POSITIONS.replace("out.index_add_(0, pos // self.k,", "out.index_add_(0, pos,"),
         reason="is not recognised as the routing weight", name="s42c_flat_positions_added_at_the_position"),
    # gates read at the token and another expert: not this pair's weight
    Keep(DENSE_GATES.replace("gates[tok, e]", "gates[tok, (e + 1) % self.n]"),
         reason="not recognised as the routing weight", name="s42c_dense_gates_at_another_expert"),

    # a strided id list (rank, rank + world, ...): not a range of consecutive experts the fused text could map onto
    Keep(MEMBERSHIP_SKIP.replace(_LIST, "list(range(rank, n, world))"),
         reason="the loop skips experts on `e not in self.local_experts`", name="s42c_membership_in_a_strided_list"),
    # the id list is a constructor argument: nothing says it is a range
    Keep(MEMBERSHIP_SKIP.replace(_LIST, "list(local_ids)").replace("rank=0, world=1", "local_ids=(0, 2, 4)"),
         reason="the loop skips experts on `e not in self.local_experts`", name="s42c_membership_in_a_given_list"),
    # looping over a strided list of ids
    Keep(LOCAL_IDS_LOOP.replace(_COMP, "list(range(rank, n, world))"),
         reason="the experts iterated read `self`", name="s42c_loop_over_strided_expert_ids"),
]
