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
from typing import Optional

from npufuse.patterns.base import Fuse, Keep
from npufuse.scan.dataflow import dotted

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

_LIST = "list(range(rank * per, (rank + 1) * per))"
_COMP = "[i for i in range(rank * per, (rank + 1) * per)]"

FUSE = [
    Fuse(MEMBERSHIP_SKIP, name="s42c_global_loop_skips_experts_not_in_a_local_range", run=MEMBERSHIP_SKIP_RUN),
    Fuse(LOCAL_IDS_LOOP, name="s42c_loop_over_local_expert_ids_of_a_range", run=LOCAL_IDS_LOOP_RUN),
    # rank 1 of 2: the ids are range(3, 6), the fused text runs only those experts' rows (the others come back zero)
    Fuse(LOCAL_IDS_LOOP, name="s42c_loop_over_local_expert_ids_second_rank", run=LOCAL_IDS_LOOP_SHARD_RUN),
]

KEEP = [
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
