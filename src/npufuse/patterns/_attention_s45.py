"""s45 (helper attn45): attention / sdpa precision defects left by s44, read by class.

1. SDPA operands of mixed stated ranks. ``F.scaled_dot_product_attention`` broadcasts its operands' leading dims
   (4-D q with 3-D / 2-D k and v runs: MQA keys shared by every head, B = 1), npu_fusion_attention takes 4-D q, k
   and v only. The fused branch of an SDPA call whose ranks are not stated tested ``q.dim() == 4`` alone, so a 4-D q
   beside 3-D keys reached the op (which rejects the shape where the original ran). Now every operand of unstated
   rank is tested, and an operand whose stated rank is not 4 beside an unstated one is a near miss: the 4-D call
   could never run (granite-tsfm PatchTST-FM: ``v`` 5-D from a 6-D permute's ``unbind(0)``, q / k through a norm
   module): the candidate promised a speed-up the run never had.
"""

from __future__ import annotations

import ast
from typing import Any


def sdpa_stated_rank_problem(ranks: dict[str, int | None], texts: dict[str, str]) -> str | None:
    """The near-miss reason where one SDPA operand's rank is stated and not 4 while another's is not stated (the
    4-D call's run-time rank test could never hold, or would pass operands of another rank); None otherwise."""
    if all(r is not None for r in ranks.values()) or all(r is None for r in ranks.values()):
        return None
    odd = [(tag, r) for tag, r in ranks.items() if r is not None and r != 4]
    if not odd:
        return None
    tag, r = odd[0]
    unstated = ", ".join(t for t, x in ranks.items() if x is None)
    return (f"{tag} (`{texts[tag][:40]}`) is {r}-D while the rank of {unstated} is not stated here: SDPA broadcasts "
            f"operands of different ranks, npu_fusion_attention takes 4-D q, k and v only, so the fused call could not run "
            f"on these operands")


def sdpa_unstated_rank_test(ranks: dict[str, int | None], names: dict[str, str], atom_of) -> str:
    """``q.dim() == k.dim() == 4`` over the operands of unstated rank (SDPA accepts keys of a lower rank than the
    query's: each is tested, not only q)."""
    tested = list(dict.fromkeys(atom_of(names[tag]) for tag, r in ranks.items() if r is None))
    return " == ".join(f"{x}.dim()" for x in tested) + " == 4"


# 2. One head indexed out by a loop variable (MiniMax-M2's memory-saving ``for h in range(self.num_heads): q =
#    query_states[:, h, :, :]``, then ``q_chunk = q[:, i:i + chunk, :]``): the products are 3-D [B, S, D] per head,
#    read as 4-D, so the fused branch's ``q_chunk.dim() == 4`` test never held (a candidate promising a speed-up the
#    run never had). A subscript that names every axis (it ends in a full slice) and takes one of them at an integer
#    (a literal, or the target of a ``for`` over ``range``) states a 3-D tensor where its base has as many axes as the
#    subscript has entries: the one-head (bmm) reading, whose ranks the fused branch checks at run time (s34), takes it.
def _range_targets(scope_node: ast.AST) -> set[str]:
    """Names bound as the plain target of a ``for .. in range(..)`` in the function (integers)."""
    cached = getattr(scope_node, "_npufuse_s45_range_targets", None)
    if cached is not None:
        return cached
    found = {st.target.id for st in ast.walk(scope_node)
             if isinstance(st, ast.For) and isinstance(st.target, ast.Name) and isinstance(st.iter, ast.Call)
             and isinstance(st.iter.func, ast.Name) and st.iter.func.id == "range"}
    try:
        scope_node._npufuse_s45_range_targets = found  # type: ignore[attr-defined]  # memoised per function
    except AttributeError:
        pass
    return found


def _integer_index(entry: ast.AST, loop_ints: set[str]) -> bool:
    """A literal integer, or a name (a symbolic Ref carries ``.name``) that a ``for .. in range`` binds."""
    if isinstance(entry, ast.Constant):
        return isinstance(entry.value, int) and not isinstance(entry.value, bool)
    name = entry.id if isinstance(entry, ast.Name) else getattr(entry, "name", None)
    return isinstance(name, str) and name in loop_ints


def head_indexed_3d(node: Any, scope: Any, line: int, depth: int = 0) -> bool:
    """``X[:, h, :, :]`` (integer entries among full / partial slices, the last a full slice, no ``...`` / None /
    tensor index) with three entries left: 3-D where X has as many axes as the subscript has entries (checked at run
    time by the reading that takes it); also ``Y[:, i:j, :]`` (three slices) of such a Y (a chunk of the head)."""
    node = defined_value(node, scope, line)
    if depth > 4 or not isinstance(node, ast.Subscript) or not isinstance(node.slice, ast.Tuple):
        return False
    entries = node.slice.elts
    last = entries[-1] if entries else None
    if not (isinstance(last, ast.Slice) and last.lower is None and last.upper is None and last.step is None):
        return False
    loop_ints = _range_targets(scope.node)
    ints = 0
    for e in entries:
        if isinstance(e, ast.Slice):
            continue
        if not _integer_index(e, loop_ints):
            return False  # a tensor index, ``...`` or None: the rank is not read off the entries
        ints += 1
    if len(entries) - ints != 3:
        return False
    # slices only keep the base's rank: 3-D where the base is a head taken out the same way
    return ints >= 1 or head_indexed_3d(node.value, scope, getattr(node, "lineno", line), depth + 1)

def defined_value(node: Any, scope: Any, line: int) -> Any:
    """``node`` itself, or for a name known only before the block (a symbolic Ref with no value: a loop's body
    reading a name set around the loop), the one definition the scope records for it."""
    if getattr(node, "idx", None) == -1 and getattr(node, "value", None) is None and isinstance(getattr(node, "name", None), str):
        d = scope.definition(node.name, line)
        return d if d is not None else node
    return node


# 3. 5-D operands with a causal mask under a condition, and GQA written as a 5-D grouped query (qwen3_from_scratch's
#    ``q.reshape(B, Hkv, G, S, D)`` against ``k.unsqueeze(2)`` / ``v.unsqueeze(2)``, the causal triangle applied
#    ``if seq_len_q > 1 and is_causal``). npufuse folds 5-D [B, N, W, S, D] operands' first two axes into the op's
#    batch; a mask had to be folded alike, so only a causal flag (sparse_mode) was allowed. A causal triangle is one
#    [Sq, Skv] plane repeated over every leading axis (each term a tril / triu of the two sequence lengths), so its
#    plane passes as the op's 2-D [Sq, Skv] mask whatever the fold. Keys and values of size 1 on the window / group
#    axis (``k.unsqueeze(2)``) fold to one kv head per batch row, which the op's GQA shares across the G query heads
#    (spec 5.1: query head h uses kv head h // (Nq / Nkv)): exactly the broadcast of the eager matmuls.
def causal_terms_only(masks: list) -> bool:
    """Every term of the chain's mask is a causal triangle (under a condition or not; float biases go to pse)."""
    return bool(masks) and all(getattr(m, "causal", None) is not None or type(m).__name__ == "_S28Bias" for m in masks)


def causal_plane_lines(var: str, maybe_none: bool) -> list[str]:
    """The [Sq, Skv] plane of a causal mask broadcast over the 5-D scores' leading axes (identical on each)."""
    guard = f"{var} is not None and " if maybe_none else ""
    return [f"if {guard}{var}.dim() > 2:",
            f"    {var} = {var}[(0,) * ({var}.dim() - 2)]  # a causal triangle: the same [Sq, Skv] plane on every leading axis"]


def fold_shape_test(q: str, k: str, v: str) -> str:
    """The run-time test under which the first two axes of 5-D q / k / v fold into the op's batch: shared leading
    axes (the eager matmuls would broadcast unequal ones, the fold would not), and a window / group axis of k and v
    equal to q's or 1 (one kv head for the G query heads of the op's GQA)."""
    return (f"{k}.shape[:2] == {q}.shape[:2] == {v}.shape[:2] and {k}.shape[2] == {v}.shape[2] "
            f"and {k}.shape[2] in (1, {q}.shape[2])")
