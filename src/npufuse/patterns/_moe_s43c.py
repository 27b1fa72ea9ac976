"""s43 (helper moe43c): moe_experts recall classes of the routing-weight reads the s43 blind sets missed.

Each class is a spelling of "the routing weight of the (token, slot) pairs this expert takes" that the loop
analysis did not read:

1. ``w[mask, k]`` with ``mask = idx[:, k] == e`` inside a slot loop ``for k in range(K)``: the slot-k weight of
   each selected token, ``[n]`` (s42b read only ``w[mask, k:k + 1]`` and ``w[:, k][mask]``);
2. ``w[pairs]`` with ``pairs = torch.nonzero(idx == e, as_tuple=True)`` (or ``torch.where(idx == e)``) used whole as
   the index: ``w[pairs[0], pairs[1]]``, the pairs' weights;
3. ``(idx[tok] == e).nonzero()[:, 1]`` with ``tok = (idx == e).any(-1)``: the slot of e in each selected row (one per
   row where the top-k ids of a row are distinct, in row order), so ``w[tok, col]`` is each selected token's weight;
4. ``y *= w`` on the expert output ``y`` (in place): the same value as ``y = y * w`` where nothing else holds ``y``
   (no alias read between its binding and the in-place product).

The functions here read syntax only and return facts (or None); ``moe_experts`` calls them from its loop analysis.
"""

from __future__ import annotations

import ast
from typing import Optional

from npufuse.patterns import _moe_s42c as s42c
from npufuse.patterns.base import Fuse, Keep
from npufuse.scan.dataflow import const_value


def is_slot_name(node: ast.expr, slot_var: str) -> bool:
    """``k``: the slot loop's variable itself (class 1: ``w[mask, k]``)."""
    return isinstance(node, ast.Name) and node.id == slot_var


def pair_tuple_parts(sl: ast.expr) -> Optional[list[ast.expr]]:
    """``[pairs[0], pairs[1]]`` for an index that is one bare name ``pairs`` (class 2): the caller checks it holds
    the (token, slot) pairs of 2-D indices; None for any other index."""
    if not isinstance(sl, ast.Name):
        return None
    return [ast.copy_location(ast.Subscript(ast.Name(sl.id, ast.Load()), ast.Constant(j), ast.Load()), sl) for j in (0, 1)]


def nonzero_receiver(node: ast.Call) -> Optional[ast.expr]:
    """X of ``X.nonzero()`` / ``torch.nonzero(X)`` without as_tuple (class 3)."""
    return s42c._nonzero_mask(node)


def is_second_column(sl: ast.expr) -> bool:
    """``[:, 1]`` / ``[:, -1]``: the column index of ``nonzero()``'s ``[m, 2]`` rows of a 2-D mask (class 3)."""
    if not (isinstance(sl, ast.Tuple) and len(sl.elts) == 2 and isinstance(sl.elts[0], ast.Slice)):
        return False
    whole = sl.elts[0]
    col = const_value(sl.elts[1])
    return whole.lower is None and whole.upper is None and whole.step is None and not isinstance(col, bool) and col in (1, -1)


def inplace_product(s: ast.stmt) -> Optional[tuple[str, ast.BinOp]]:
    """``y *= f`` / ``y.mul_(f)`` (class 4): (``y``, the product ``y * f`` it stands for); else None."""
    if isinstance(s, ast.AugAssign) and isinstance(s.op, ast.Mult) and isinstance(s.target, ast.Name):
        name, factor = s.target.id, s.value
    elif isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and isinstance(s.value.func, ast.Attribute) \
            and s.value.func.attr == "mul_" and isinstance(s.value.func.value, ast.Name) and len(s.value.args) == 1 \
            and not s.value.keywords:
        name, factor = s.value.func.value.id, s.value.args[0]
    else:
        return None
    product = ast.BinOp(ast.Name(name, ast.Load()), ast.Mult(), factor)
    return name, ast.copy_location(product, s)  # type: ignore[return-value]


def read_since_bound(loop: ast.AST, name: str, at: ast.stmt) -> bool:
    """Whether ``name`` is read in ``loop`` on a line after its last binding before ``at`` and before ``at`` (class 4),
    or is not bound there at all: such a read may have kept another handle on the tensor (``z = y``, ``y.view(...)``),
    which the in-place product changes too. (A read on a continuation line of the binding counts: a refusal.)"""
    names = [n for n in ast.walk(loop) if isinstance(n, ast.Name) and n.id == name and n.lineno < at.lineno]
    bound = [n.lineno for n in names if isinstance(n.ctx, ast.Store)]
    if not bound:
        return True
    return any(isinstance(n.ctx, ast.Load) and n.lineno > max(bound) for n in names)


# -- examples (registered on MoeExperts by moe_experts.py) ------------------------------------

_HEAD = s42c._HEAD
_run = s42c._run


def _init(gate: str, expert: str = "GluExpert(d, h)") -> str:
    """``__init__(d, h, n, k)`` of an example MoE: a bias-free router named ``gate`` and n experts."""
    return (f"    def __init__(self, d, h, n, k):\n        super().__init__()\n        self.n, self.k = n, k\n"
            f"        self.{gate} = nn.Linear(d, n, bias=False)\n"
            f"        self.experts = nn.ModuleList([{expert} for _ in range(n)])\n")


# 1. nested (expert, slot) loops, boolean slot masks, the weight read as w[mask, k] (renormalised top-k)
SLOT_MASK_WEIGHT = _HEAD + '''

class NestedSlotMoE(nn.Module):
''' + _init("gate") + '''
    def forward(self, x):
        shape = x.shape
        flat = x.view(-1, shape[-1])
        probs = F.softmax(self.gate(flat), dim=-1)
        weights, indices = torch.topk(probs, self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for i in range(self.n):
            for k in range(self.k):
                mask = (indices[:, k] == i)
                if mask.any():
                    out[mask] += self.experts[i](flat[mask]) * weights[mask, k].unsqueeze(-1)
        return out.view(*shape)
'''
SLOT_MASK_WEIGHT_RUN = _run("NestedSlotMoE(16, 12, 5, 2)", "2, 6, 16", "m.gate.weight, m.experts[2].w_in.weight")

# 2. the expert output scaled in place by the pairs' weights, then added back per token
INPLACE_SCALE = _HEAD + '''

class InPlaceMoE(nn.Module):
''' + _init("router") + '''
    def forward(self, x):
        b, t, d = x.shape
        w, idx = torch.topk(F.softmax(self.router(x), dim=-1), self.k, dim=-1)
        x_flat = x.contiguous().view(b * t, d)
        w = w.contiguous().view(b * t, self.k)
        idx = idx.contiguous().view(b * t, self.k)
        routed = torch.zeros_like(x_flat)
        for i, expert in enumerate(self.experts):
            row, slot = torch.where(idx == i)
            y = expert(x_flat[row])
            y *= w[row, slot].unsqueeze(-1)
            routed[row] += y
        return routed.view(b, t, d)
'''
INPLACE_SCALE_RUN = _run("InPlaceMoE(16, 12, 5, 2)", "2, 6, 16", "m.router.weight, m.experts[4].w_out.weight")

# 3. the pairs of nonzero(as_tuple=True) used whole as the weights' index, added back with index_add_
PAIR_TUPLE = _HEAD + '''

class PairTupleMoE(nn.Module):
''' + _init("gate") + '''
    def forward(self, x):
        top_w, top_i = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            pairs = torch.nonzero(top_i == i, as_tuple=True)
            if pairs[0].numel() > 0:
                y = expert(x[pairs[0]])
                w_e = top_w[pairs]
                out.index_add_(0, pairs[0], y * w_e.unsqueeze(-1))
        return out
'''
PAIR_TUPLE_RUN = _run("PairTupleMoE(16, 12, 5, 2)", "11, 16", "m.gate.weight, m.experts[0].w_in.weight")

# 4. a token mask (idx == e).any(dim=1), the slot of e in each selected row found with nonzero()[:, 1]
ROW_SLOTS = _HEAD + '''

class RowSlotMoE(nn.Module):
''' + _init("gate", "nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))") + '''
    def forward(self, x):
        B, T, D = x.shape
        x_flat = x.reshape(-1, D)
        vals, idx = torch.topk(F.softmax(self.gate(x_flat), dim=1), k=2, dim=1)
        output = torch.zeros_like(x_flat)
        for e in range(self.n):
            mask = (idx == e)
            if not mask.any():
                continue
            rows = mask.any(dim=1)
            y = self.experts[e](x_flat[rows])
            col = (idx[rows] == e).nonzero()[:, 1]
            output[rows] += vals[rows, col].unsqueeze(-1) * y
        return output.view(B, T, D)
'''
ROW_SLOTS_RUN = _run("RowSlotMoE(16, 12, 5, 2)", "2, 6, 16", "m.gate.weight, m.experts[1][0].weight")

FUSE = [
    Fuse(SLOT_MASK_WEIGHT, name="s43c_slot_loop_weight_at_mask_and_slot", run=SLOT_MASK_WEIGHT_RUN),
    Fuse(INPLACE_SCALE, name="s43c_expert_output_scaled_in_place", run=INPLACE_SCALE_RUN),
    Fuse(INPLACE_SCALE.replace("            y *= w[row, slot].unsqueeze(-1)\n", "            y.mul_(w[row, slot].unsqueeze(-1))\n"),
         name="s43c_expert_output_mul_in_place", run=INPLACE_SCALE_RUN),
    Fuse(PAIR_TUPLE, name="s43c_weights_indexed_by_the_pair_tuple", run=PAIR_TUPLE_RUN),
    Fuse(PAIR_TUPLE.replace("torch.nonzero(top_i == i, as_tuple=True)", "torch.where(top_i == i)"),
         name="s43c_weights_indexed_by_the_where_tuple", run=PAIR_TUPLE_RUN),
    Fuse(ROW_SLOTS, name="s43c_row_slots_from_nonzero_column", run=ROW_SLOTS_RUN),
    Fuse(ROW_SLOTS.replace("(idx[rows] == e).nonzero()[:, 1]", "torch.nonzero(idx[rows] == e)[:, -1]"),
         name="s43c_row_slots_from_torch_nonzero_last_column", run=ROW_SLOTS_RUN),
    Fuse(ROW_SLOTS.replace("(idx[rows] == e).nonzero()[:, 1]", "torch.where(idx[rows] == e)[1]"),
         name="s43c_row_slots_from_the_where_tuple", run=ROW_SLOTS_RUN),
    Fuse(ROW_SLOTS.replace("(idx[rows] == e).nonzero()[:, 1]", "(idx[rows] == e).nonzero(as_tuple=True)[1]"),
         name="s43c_row_slots_from_the_nonzero_tuple", run=ROW_SLOTS_RUN),
    Fuse(SLOT_MASK_WEIGHT.replace("weights[mask, k].unsqueeze(-1)", "weights[mask][:, k:k + 1]"),
         name="s43c_slot_loop_weight_column_after_the_rows", run=SLOT_MASK_WEIGHT_RUN),
]

KEEP = [
    # class 1: another slot's weight (slot k - 1) multiplies the rows of slot k
    Keep(SLOT_MASK_WEIGHT.replace("weights[mask, k]", "weights[mask, k - 1]"),
         reason="not recognised as the routing weight", name="s43c_slot_loop_weight_of_another_slot"),
    # class 1: the [n] weights without a trailing dim broadcast along the hidden dim, not per row
    Keep(SLOT_MASK_WEIGHT.replace("weights[mask, k].unsqueeze(-1)", "weights[mask, k]"),
         reason="broadcasts along the hidden dim", name="s43c_slot_loop_weight_without_trailing_dim"),
    # class 2: the transposed weights indexed by (token, slot) pairs: not the pairs' weights
    Keep(PAIR_TUPLE.replace("top_w[pairs]", "top_w.t()[pairs]"),
         reason="not recognised as the routing weight", name="s43c_pair_tuple_of_transposed_weights"),
    # class 1: the rows of the slot mask, then a fixed column 0: slot 0's weight for the rows of every slot
    Keep(SLOT_MASK_WEIGHT.replace("weights[mask, k].unsqueeze(-1)", "weights[mask][:, 0:1]"),
         reason="not recognised as the routing weight", name="s43c_slot_loop_weight_column_zero_after_the_rows"),
    # class 3: the first tensor of the tuple is the row's number among the selected rows, not its slot
    Keep(ROW_SLOTS.replace("(idx[rows] == e).nonzero()[:, 1]", "torch.where(idx[rows] == e)[0]"),
         reason="not recognised", name="s43c_row_slots_first_tensor_of_the_where_tuple"),
    # class 3: column 0 of nonzero() is the row's number among the selected rows, not its slot
    Keep(ROW_SLOTS.replace("nonzero()[:, 1]", "nonzero()[:, 0]"),
         reason="not recognised", name="s43c_row_slots_first_column"),
    # class 4: the expert output was bound to a second name before the in-place product (that alias is scaled too)
    Keep(INPLACE_SCALE.replace("            y *= w[row, slot].unsqueeze(-1)\n            routed[row] += y\n",
                               "            z = y\n            y *= w[row, slot].unsqueeze(-1)\n            routed[row] += z\n"),
         reason="is scaled in place", name="s43c_expert_output_scaled_in_place_after_an_alias"),
    # class 4: the routing weight scales the expert's input rows in place, not its output
    Keep(INPLACE_SCALE.replace("            y = expert(x_flat[row])\n            y *= w[row, slot].unsqueeze(-1)\n",
                               "            rows = x_flat[row]\n            rows *= w[row, slot].unsqueeze(-1)\n            y = expert(rows)\n"),
         reason="unrecognised update in the expert loop", name="s43c_expert_input_scaled_in_place"),
]
