"""moe_experts constructs of the s43 pass a (helper moe43a): recall classes of the real HO19a misses, read by small
hooks in :mod:`npufuse.patterns.moe_experts`.

* Rows added through a row view of the accumulator (``out.view(-1, D)[mask] += v``): ``view`` keeps the logical
  row-major order of its base, so row r of the view is row r of the flattened accumulator; the fused result, reshaped
  to the accumulator's shape, lands on the same elements (:func:`row_view_target`). ``reshape`` / ``flatten`` may
  copy (the write is then lost): not read.
* Dispatch split over several loops: ``tasks.append((e, rows, x_e, w_e))``, then ``for e, rows, x_e, w_e in tasks:
  outs.append((rows, y))``, then ``for rows, y in outs: <combine>``; an empty list made between two of the loops is
  made before the first (:func:`hoistable_list_inits`), and the s42 two-phase merge is applied pairwise along the
  chain (:func:`chained_phases`).
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Optional

from npufuse.patterns._moe_s42b import _moe, _run
from npufuse.patterns.base import Fuse, Keep
from npufuse.scan.dataflow import fast_walk


def _is_row_view(node: ast.expr) -> bool:
    """``name.view(-1, d)``: a 2-D row view whose first size is inferred (rows of the flattened leading dims)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "view"
            and isinstance(node.func.value, ast.Name) and len(node.args) == 2 and not node.keywords
            and isinstance(node.args[0], ast.UnaryOp) and isinstance(node.args[0].op, ast.USub)
            and isinstance(node.args[0].operand, ast.Constant) and node.args[0].operand.value == 1
            and not isinstance(node.args[1], ast.Starred))


def _copying_reshape(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("reshape", "flatten") \
        and isinstance(node.func.value, ast.Name)


def row_view_target(stmt: ast.stmt) -> ast.AugAssign | str | None:
    """``out.view(-1, D)[rows] += v`` read as ``out[rows] += v`` over the flattened rows of ``out`` (the caller marks
    the site as flat rows: the fused result is reshaped to ``out``'s shape); a refusal's reason for the same add through
    ``reshape`` / ``flatten``; None for any other statement."""
    if not (isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Add) and isinstance(stmt.target, ast.Subscript)):
        return None
    if _copying_reshape(stmt.target.value):
        return (f"rows are added through `{ast.unparse(stmt.target.value)[:40]}`, which returns a copy where the output "
                "is not contiguous (the add then never reaches the output): npufuse reads such adds through `.view` only")
    if not _is_row_view(stmt.target.value):
        return None
    base = stmt.target.value.func.value  # type: ignore[attr-defined]
    target = ast.Subscript(value=ast.Name(base.id, ast.Store()), slice=stmt.target.slice, ctx=ast.Store())
    return ast.copy_location(ast.AugAssign(target=ast.copy_location(target, stmt.target), op=stmt.op, value=stmt.value), stmt)


#: methods whose result shares storage with (or is) their receiver, as far as an in-place write through it goes
_SAME_STORAGE = ("view", "view_as", "reshape", "flatten", "contiguous", "squeeze", "unsqueeze", "to", "float", "detach")


def _storage_root(scope: Any, node: ast.expr, line: int) -> Optional[str]:
    """The local name whose storage ``node`` may share: through names bound to other names, row views and
    subscripts (a few steps; None when it ends in anything else, e.g. a fresh allocation)."""
    for _ in range(6):
        while isinstance(node, ast.Subscript) or isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _SAME_STORAGE:
            node = node.value if isinstance(node, ast.Subscript) else node.func.value  # type: ignore[union-attr]
        if not isinstance(node, ast.Name):
            return None
        bound = scope.definition(node.id, line)
        if bound is None or not (isinstance(bound, (ast.Name, ast.Subscript)) or isinstance(bound, ast.Call)
                                 and isinstance(bound.func, ast.Attribute) and bound.func.attr in _SAME_STORAGE):
            return node.id
        node = bound
    return None


def output_aliases_tokens(scope: Any, output: str, tokens: str, line: int) -> Optional[str]:
    """A refusal's reason when the loop's output shares storage with the tokens it dispatches (``x.view(-1, D)[m] +=
    y`` with ``flat_x = x.view(-1, D)``; ``out = x``): a token routed to two experts is read by the second after the
    first's add changed it, while the fused layer reads every token once, before any add; else None."""
    try:
        tok = ast.parse(tokens, mode="eval").body
    except SyntaxError:
        return None
    root = _storage_root(scope, ast.Name(output, ast.Load()), line)
    if root is None or root != _storage_root(scope, tok, line):
        return None
    return (f"the loop adds into `{output}`, which shares storage with the tokens `{tokens}` it dispatches: a token "
            "routed to several experts is read after an earlier expert changed it, while the fused layer reads "
            "every token before any add")


def without_default_as_tuple(call: ast.Call) -> ast.Call:
    """``nonzero(m, as_tuple=False)`` spelled as the default ``nonzero(m)`` (the same [n, d] result); ``call`` itself
    for any other call."""
    if not any(k.arg == "as_tuple" and isinstance(k.value, ast.Constant) and k.value.value is False for k in call.keywords):
        return call
    keywords = [k for k in call.keywords if k.arg != "as_tuple"]
    return ast.copy_location(ast.Call(func=call.func, args=call.args, keywords=keywords), call)


def column_of_row_view(scope: Any, name: str, before_line: int) -> bool:
    """``name`` is bound (last, before ``before_line``) to ``a[:, c]`` (``c`` an integer) with ``a`` -- or the name
    it is bound to -- ``t.view(-1, k)`` / ``t.reshape(-1, k)``: one column of a 2-D tensor, so 1-D (jha-vikas'
    ``selected_expert = topk_indices_flat[:, 0]``)."""
    node = scope.definition(name, before_line)
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 2):
        return False
    whole, col = node.slice.elts
    if not (isinstance(whole, ast.Slice) and whole.lower is None and whole.upper is None and whole.step is None
            and isinstance(col, ast.Constant) and type(col.value) is int):
        return False
    base = scope.definition(node.value.id, before_line) if isinstance(node.value, ast.Name) else node.value
    return (isinstance(base, ast.Call) and isinstance(base.func, ast.Attribute) and base.func.attr in ("view", "reshape")
            and len(base.args) == 2 and not base.keywords and isinstance(base.args[0], ast.UnaryOp)
            and isinstance(base.args[0].op, ast.USub) and isinstance(base.args[0].operand, ast.Constant)
            and base.args[0].operand.value == 1)


def top1_indices(scope: Any, name: str, before_line: int) -> bool:
    """``name`` is bound (last, before ``before_line``) to the indices of a max: ``v.max(dim=-1)[1]`` /
    ``torch.max(v, dim)`` unpacked, or ``argmax`` -- one expert per token by construction, whatever the shape."""
    return max_indices(scope.definition(name, before_line))


def max_indices(node: Optional[ast.expr]) -> bool:
    """``v.max(dim=-1)[1]`` / ``torch.max(v, dim)[1]`` (s45b: ``.indices``) or ``v.argmax(dim)``: the indices of a max
    over one dim (a max over all elements, with no dim, is one index, not one per token)."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == 1 \
            or isinstance(node, ast.Attribute) and node.attr == "indices":
        call = node.value
        return isinstance(call, ast.Call) and (
            isinstance(call.func, ast.Attribute) and call.func.attr == "max" and len(call.args) + len(call.keywords) >= (
                1 if not (isinstance(call.func.value, ast.Name) and call.func.value.id == "torch") else 2))
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "argmax" \
        and bool(node.args or node.keywords)


def _as_column(node: ast.expr) -> Optional[ast.expr]:
    """``v`` of ``v.unsqueeze(-1)`` / ``v.unsqueeze(1)`` / ``v[:, None]`` / ``v.view(-1, 1)`` / ``v.reshape(-1, 1)``
    (an [n] vector as an [n, 1] column); else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.keywords:
        # (s44 review: ``-a.operand.value`` of any constant raised on ``v.view(-None, 1)``: integers only)
        args = [a.value if isinstance(a, ast.Constant) else -a.operand.value  # type: ignore[attr-defined]
                if isinstance(a, ast.UnaryOp) and isinstance(a.op, ast.USub) and isinstance(a.operand, ast.Constant)
                and type(a.operand.value) is int else None for a in node.args]
        if node.func.attr == "unsqueeze" and args in ([-1], [1]) or node.func.attr in ("view", "reshape") and args == [-1, 1]:
            return node.func.value
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 2:
        whole, new = node.slice.elts
        if isinstance(whole, ast.Slice) and whole.lower is None and whole.upper is None and whole.step is None \
                and isinstance(new, ast.Constant) and new.value is None:
            return node.value
    return None


def flat_row_weight(node: ast.expr, kind_of: Callable[[ast.expr], Any], bound_in_loop: dict[str, ast.expr]
                    ) -> Optional[tuple[str, str, str]]:
    """(weights name, flat indices name, kind of the rows) for the [n, 1] column (:func:`_as_column`) of ``w[rows]`` -- written in place
    or bound to a name earlier in the loop -- with ``rows`` this expert's rows of flat expert indices
    (``(flat == e).nonzero().squeeze(-1)`` or the mask ``flat == e``) and ``w`` a name from before the loop: each
    selected row's own weight when ``w`` has the indices' shape (the caller proves the indices 1-D and adds that
    run-time check). ``kind_of`` evaluates a node in the loop; ``bound_in_loop`` maps a name to the value the loop
    body last bound it to so far. Cheap on anything that is not a column-making call or subscript."""
    if not isinstance(node, (ast.Subscript, ast.Call)):
        return None
    inner = _as_column(node)
    if isinstance(inner, ast.Name):
        inner = bound_in_loop.get(inner.id)
    if not (isinstance(inner, ast.Subscript) and isinstance(inner.value, ast.Name)) or kind_of(inner.value).kind != "outer":
        return None
    rows = kind_of(inner.slice)
    if rows.kind not in ("flatrow", "flatmask") or not rows.args:
        return None
    return inner.value.id, rows.args[0], rows.kind


def _fresh_empty_list(stmt: ast.stmt) -> Optional[str]:
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
            and isinstance(stmt.value, ast.List) and not stmt.value.elts:
        return stmt.targets[0].id
    return None


def hoistable_list_inits(block: list[ast.stmt], i: int) -> Optional[list[ast.stmt]]:
    """``block`` with the ``name = []`` statements right after the loop ``block[i]`` (up to the next loop) moved
    before it, when the loop and everything before it in the block never name them (so making the list earlier
    changes nothing) and the statement after them is a ``for`` over a list; None when there is nothing to move."""
    j = i + 1
    moved: list[ast.stmt] = []
    while j < len(block) and _fresh_empty_list(block[j]) is not None:
        moved.append(block[j])
        j += 1
    if not moved or j >= len(block) or not isinstance(block[j], ast.For) or not isinstance(block[j].iter, ast.Name):
        return None
    names = {_fresh_empty_list(st) for st in moved}
    if len(names) != len(moved):
        return None
    if any(isinstance(n, ast.Name) and n.id in names for st in block[: i + 1] for n in fast_walk(st)):
        return None
    return block[:i] + moved + [block[i]] + block[j:]



def chained_phases(scope: Any, block: list[ast.stmt], i: int, loop: ast.For, two_phase: Callable[..., Any]
                   ) -> Optional[tuple[list[ast.stmt], int, ast.For, list[ast.For]]]:
    """A dispatch split over loops joined by lists, with the lists of the later phases made between the loops:
    (the block to analyse, the merged loop's index in it, the merged loop, the loops merged into it). Each step
    is the s42 two-phase merge (``two_phase``: the combine of a list item runs where the item is appended), after
    the empty lists made between the two loops are moved before the first (:func:`hoistable_list_inits`). None
    when the first merge does not apply."""
    blk = hoistable_list_inits(block, i) or block
    merged, merged_from = loop, []
    k = next(j for j, st in enumerate(blk) if st is loop)
    while True:
        pair = two_phase(scope, blk, k, merged)
        if pair is None:
            break
        merged, combine = pair
        merged_from.append(combine)
        blk = blk[:k] + [merged] + blk[k + 2:]
        moved = hoistable_list_inits(blk, k)
        if moved is not None:
            blk = moved
            k = next(j for j, st in enumerate(blk) if st is merged)
    if not merged_from:
        return None
    # the merged lists are named nowhere else (checked by each merge): their `= []` are left out of the analysis,
    # so that nothing stands between the output's allocation and the loop
    lists = {c.iter.id for c in merged_from if isinstance(c.iter, ast.Name)}
    blk = [st for st in blk if _fresh_empty_list(st) not in lists]
    return blk, next(j for j, st in enumerate(blk) if st is merged), merged, merged_from


# -- examples (tests/test_detect_s43_moe43a.py) ------------------------------------------------------------------------

# 1. ArchTune / makemore-MoE: the output is [B, T, D], the loop works on flattened rows and adds through a row view
_ROW_VIEW = _moe('''\
        B, T, D = x.shape
        logits = self.gate(x)
        w, idx = torch.topk(logits, self.k, dim=-1)
        gates = F.softmax(torch.full_like(logits, float("-inf")).scatter(-1, idx, w), dim=-1)
        out = torch.zeros_like(x)
        flat_x = x.view(-1, D)
        flat_idx = idx.view(-1, self.k)
        flat_gates = gates.view(-1, gates.size(-1))
        for e, expert in enumerate(self.experts):
            mask = (flat_idx == e).any(dim=-1)
            if mask.any():
                y = expert(flat_x[mask]) * flat_gates[mask, e].unsqueeze(1)
                out.view(-1, D)[mask] += y
        return out
''')

# 2. 2-D tokens, torch.where over [T, K] indices, the add through a row view of a [T, D] output
_ROW_VIEW_WHERE = _moe('''\
        w, idx = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=x.dtype)
        for e in range(self.n):
            tok, slot = torch.where(idx == e)
            out.view(-1, x.shape[-1])[tok] += self.experts[e](x[tok]) * w[tok, slot, None]
        return out
''')

# 3. DeepSeek-from-scratch: top-k slots outside, the experts in `self.routed_experts` (not `.experts`)
_SLOT_OUTER_ROUTED = _moe('''\
        flat_x = x.view(-1, x.shape[-1])
        probs = F.softmax(self.gate(flat_x), dim=-1)
        top_p, top_i = torch.topk(probs, self.k, dim=-1)
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        routed = torch.zeros_like(flat_x)
        for k in range(self.k):
            idx = top_i[:, k]
            prob = top_p[:, k].unsqueeze(-1)
            for expert_idx, expert in enumerate(self.routed_experts):
                mask = (idx == expert_idx)
                if mask.any():
                    expert_output = expert(flat_x[mask])
                    routed[mask] = routed[mask] + expert_output * prob[mask]
        return routed.view(x.shape)
''', init_extra="        self.routed_experts = nn.ModuleList([FF(d, h) for _ in range(n)])\n")

# 4. dispatch chained over three loops joined by lists, the later list made between the loops (jha-vikas' shape)
_CHAINED = _moe('''\
        w, idx = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        tasks = []
        for e in range(self.n):
            tok, slot = torch.where(idx == e)
            if tok.numel() > 0:
                tasks.append((e, tok, slot))
        results = []
        for e, tok, slot in tasks:
            y = self.experts[e](x[tok])
            results.append((tok, slot, y))
        for tok, slot, y in results:
            out.index_add_(0, tok, y * w[tok, slot].unsqueeze(-1))
        return out
''')

# 5. Switch-style top-1: 1-D expert indices, each expert's rows weighted in the loop and assigned
_TOP1_WEIGHTED = _moe('''\
        B, T, D = x.shape
        w, ids = torch.topk(F.softmax(self.gate(x), dim=-1), 1, dim=-1)
        idx = ids.view(-1)
        gate = w.view(-1)
        flat_x = x.view(-1, D)
        out = torch.zeros_like(flat_x)
        for e in range(self.n):
            mask = idx == e
            if mask.any():
                out[mask] = self.experts[e](flat_x[mask]) * gate[mask].unsqueeze(-1)
        return out.view(B, T, D)
''')

# 5b. Switch top-1 by max over [B, T, E] probs: [B, T] indices and gates, boolean masks over the 3-D tokens
_TOP1_MAX = _moe('''\
        gate, idx = F.softmax(self.gate(x), dim=-1).max(dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.n):
            mask = idx == e
            if mask.any():
                out[mask] = self.experts[e](x[mask]) * gate[mask].unsqueeze(-1)
        return out
''')

# 6. jha-vikas: top-1 column of [N, K] indices, tasks gathered by nonzero rows, computed, then scattered in three loops
_TOP1_THREE_LOOPS = _moe('''\
        B, T, C = x.shape
        probs = torch.sigmoid(self.gate(x))
        topk_probs, topk_indices = torch.topk(probs, self.k, dim=-1)
        x_flat = x.view(-1, C)
        selected_expert = topk_indices.view(-1, self.k)[:, 0]
        selected_prob = topk_probs.view(-1, self.k)[:, 0]
        out_flat = torch.zeros_like(x_flat)
        tasks = []
        for expert_id in range(self.n):
            mask = (selected_expert == expert_id)
            if mask.any():
                indices = torch.nonzero(mask, as_tuple=False).squeeze(-1)
                tasks.append((expert_id, indices, x_flat[indices], selected_prob[indices]))
        outputs = []
        for expert_id, indices, expert_input, expert_weights in tasks:
            y = self.experts[expert_id](expert_input)
            y = y * expert_weights.unsqueeze(-1)
            outputs.append((indices, y))
        for indices, y in outputs:
            out_flat[indices] = y
        return out_flat.view(B, T, C)
''')

FUSE_EXAMPLES = [
    Fuse(_ROW_VIEW, name="s43a_add_through_row_view_of_zero_output", run=_run("2, 5, 16"),
         expect={"routing": "mask_where", "indices": "flat_idx", "tokens": "flat_x", "output": "out"}),
    Fuse(_ROW_VIEW.replace("out = torch.zeros_like(x)", "out = x.new_zeros(x.shape)"),
         name="s43a_add_through_row_view_of_new_zeros", run=_run("2, 5, 16"), expect={"output": "out"}),
    Fuse(_ROW_VIEW_WHERE, name="s43a_where_rows_added_through_row_view", run=_run("9, 16"),
         expect={"routing": "mask_where", "indices": "idx", "probs": "w", "output": "out"}),
    Fuse(_CHAINED, name="s43a_dispatch_chained_over_three_loops", run=_run("9, 16"),
         expect={"routing": "mask_where", "indices": "idx", "probs": "w", "output": "out"}),
    Fuse(_TOP1_WEIGHTED, name="s43a_top1_flat_indices_weighted_in_the_loop", run=_run("2, 5, 16"),
         expect={"routing": "flat_mask", "indices": "idx", "probs": "gate", "output": "out"}),
    Fuse(_TOP1_WEIGHTED.replace("gate[mask].unsqueeze(-1)", "gate[mask][:, None]"),
         name="s43a_top1_weight_column_by_none", run=_run("2, 5, 16"), expect={"routing": "flat_mask", "probs": "gate"}),
    Fuse(_TOP1_MAX, name="s43a_top1_max_masks_over_3d_tokens", run=_run("2, 5, 16"),
         expect={"routing": "flat_mask", "indices": "idx", "probs": "gate", "output": "out"}),
    Fuse(_TOP1_THREE_LOOPS, name="s43a_top1_column_tasks_three_loops", run=_run("2, 5, 16"),
         expect={"routing": "flat_mask", "indices": "selected_expert", "probs": "selected_prob", "output": "out_flat"}),
    Fuse(_SLOT_OUTER_ROUTED, name="s43a_slot_loop_around_routed_experts", run=_run("2, 5, 16"),
         expect={"routing": "mask_where", "indices": "top_i", "probs": "top_p", "output": "routed"}),
]

KEEP_EXAMPLES = [
    # reshape copies a non-contiguous output: the in-place add would be lost, and npufuse does not prove contiguity
    Keep(_ROW_VIEW.replace("out.view(-1, D)[mask] += y", "out.reshape(-1, D)[mask] += y"),
         reason="returns a copy where the output is not contiguous", name="s43a_add_through_reshape_of_output"),
    # the row view's rows are those of the tokens, but the weight is another expert's gate column (e + 1)
    Keep(_ROW_VIEW.replace("flat_gates[mask, e].unsqueeze(1)", "flat_gates[mask, (e + 1) % self.n].unsqueeze(1)"),
         reason="not recognised as the routing weight", name="s43a_row_view_weight_of_another_expert"),
    # the add goes into the input itself (its row view): with k = 2 the second expert of a token reads the row the
    # first one already changed
    Keep(_ROW_VIEW.replace("out.view(-1, D)[mask] += y", "x.view(-1, D)[mask] += y").replace("return out", "return x"),
         reason="shares storage with the tokens", name="s43a_row_view_adds_into_the_input"),
    Keep(_ROW_VIEW.replace("out.view(-1, D)[mask] += y", "flat_x[mask] += y").replace("return out", "return x"),
         reason="shares storage with the tokens", name="s43a_adds_into_the_flat_tokens"),
    # the middle loop's results are also returned: the list is read after the loops, so they are not one loop
    Keep(_CHAINED.replace("        return out\n", "        return out, results\n"),
         reason="appended to a list but the loop is not over per-expert token counts",
         name="s43a_chained_results_read_after_the_loops"),
    # the weights of the next row: not the selected rows' own weights
    Keep(_TOP1_WEIGHTED.replace("gate[mask].unsqueeze(-1)", "gate.roll(1)[mask].unsqueeze(-1)"),
         reason="not recognised as the routing weight", name="s43a_top1_weight_of_another_row"),
    # the top-1 weight scales the expert's input: the same as weighting its output only for a linear expert
    Keep(_TOP1_MAX.replace("self.experts[e](x[mask]) * gate[mask].unsqueeze(-1)",
                           "self.experts[e](x[mask] * gate[mask].unsqueeze(-1))"),
         reason="scale the expert's input", name="s43a_top1_weight_on_the_expert_input"),
    # a column of [B, T, K] indices viewed 3-D is [B, K]-shaped rows of slots, not 1-D: nonzero lists pairs
    Keep(_TOP1_THREE_LOOPS.replace("topk_indices.view(-1, self.k)[:, 0]", "topk_indices.view(B, -1, self.k)[:, 0]"),
         reason="not shown to be 1-D", name="s43a_top1_column_of_a_3d_view"),
    # the slot loop's weight column is another slot's (k + 1): not the weight of the slot that routed the rows
    Keep(_SLOT_OUTER_ROUTED.replace("prob = top_p[:, k].unsqueeze(-1)", "prob = top_p[:, (k + 1) % self.k].unsqueeze(-1)"),
         reason="not recognised as the routing weight", name="s43a_slot_loop_weight_of_another_slot"),
]
