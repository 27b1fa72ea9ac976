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
    return (blk, k, merged, merged_from) if merged_from else None


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

FUSE_EXAMPLES = [
    Fuse(_ROW_VIEW, name="s43a_add_through_row_view_of_zero_output", run=_run("2, 5, 16"),
         expect={"routing": "mask_where", "indices": "flat_idx", "tokens": "flat_x", "output": "out"}),
    Fuse(_ROW_VIEW.replace("out = torch.zeros_like(x)", "out = x.new_zeros(x.shape)"),
         name="s43a_add_through_row_view_of_new_zeros", run=_run("2, 5, 16"), expect={"output": "out"}),
    Fuse(_ROW_VIEW_WHERE, name="s43a_where_rows_added_through_row_view", run=_run("9, 16"),
         expect={"routing": "mask_where", "indices": "idx", "probs": "w", "output": "out"}),
    Fuse(_CHAINED, name="s43a_dispatch_chained_over_three_loops", run=_run("9, 16"),
         expect={"routing": "mask_where", "indices": "idx", "probs": "w", "output": "out"}),
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
    # the slot loop's weight column is another slot's (k + 1): not the weight of the slot that routed the rows
    Keep(_SLOT_OUTER_ROUTED.replace("prob = top_p[:, k].unsqueeze(-1)", "prob = top_p[:, (k + 1) % self.k].unsqueeze(-1)"),
         reason="not recognised as the routing weight", name="s43a_slot_loop_weight_of_another_slot"),
]
