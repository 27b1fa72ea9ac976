"""s48 (fix48): a token's routing weight written slot by slot into a fresh buffer, the slots written out one by one.

HO24a keeratpreetsingh ``simplified moe(faster).py`` (s47 ho24attn gave it a true near miss)::

    tw = torch.zeros(sel.sum(), device=x.device)
    pos0 = idx[sel, 0] == e
    pos1 = idx[sel, 1] == e
    tw[pos0] = w[sel, 0][pos0]
    tw[pos1] = w[sel, 1][pos1]

is fix47h's slot loop (``for k in range(K): km = idx[sel, k] == e; tw[km] += w[sel, k][km]``) unrolled: each
selected row gets the weight of the slot holding expert ``e`` (one slot: top-k indices are distinct; ``+=`` sums
them either way). Read as the same dense-gates statement ``tw = (w * (idx == e)).sum(-1)[sel]`` under the run-time
guard ``K == idx.shape[-1]``, where the literal slots written are exactly 0..K-1, each once, every write reads the
same ``idx`` / ``w`` / ``sel`` / ``e``, the slot mask of a write is the comparison for that write's own slot (inline
or a name bound to it just before and read nowhere else) and the buffer is ``zeros`` in float32 or the weights' dtype
(fix47h's rule: a float32 copy of the weights is exact). Anything else (a missing slot, one slot's weight for
another, another expert, a scaled weight) is left to the old reading (the true s47 near miss)."""

from __future__ import annotations

import ast
from typing import Any, Optional

from npufuse.patterns._moe_s47h import _buffer_dtype_ok, _same, _zeros_alloc
from npufuse.scan.dataflow import const_value


SLOT_WRITES_READ = ("and per-slot writes only as a fresh `zeros` buffer in float32 or the weights' dtype followed by "
                    "`buf[idx[sel, k] == e] = w[sel, k][idx[sel, k] == e]` (or `+=`) for each literal slot k = 0..K-1 "
                    "once, with one `idx`, `w`, `sel` and `e`, the slot masks read nowhere else: these writes are not that")


def _slot_cmp(node: ast.expr, is_eidx: Any) -> Optional[tuple[str, ast.expr, int, ast.expr]]:
    """(idx, sel, k, e) of ``idx[sel, <int k>] == e`` (either side); None otherwise."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)):
        return None
    for col, e in ((node.left, node.comparators[0]), (node.comparators[0], node.left)):
        if is_eidx(e) and isinstance(col, ast.Subscript) and isinstance(col.value, ast.Name) \
                and isinstance(col.slice, ast.Tuple) and len(col.slice.elts) == 2:
            sel, k = col.slice.elts
            kv = const_value(k)
            if isinstance(sel, ast.Name) and isinstance(kv, int) and not isinstance(kv, bool) and kv >= 0:
                return col.value.id, sel, kv, e
    return None


def _reads(stmts: list[ast.stmt], names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for st in stmts for n in ast.walk(st))


def unrolled_slot_writes(body: list[ast.stmt], i: int, is_eidx: Any) -> Optional[tuple[ast.Assign, str, int]]:
    """(synthetic statement, run-time guard, index of the last statement folded) for ``body[i]`` a ``zeros`` buffer
    followed by its slot writes written out (see the module); None for anything else."""
    alloc = _zeros_alloc(body[i])
    if alloc is None:
        return None
    tw, dtype = alloc
    masks: dict[str, tuple[str, ast.expr, int, ast.expr]] = {}
    used: set[str] = set()
    slots: list[int] = []
    key: Optional[tuple[str, str, str, str]] = None  # (idx, sel, e, w) as text
    e_node: Optional[ast.expr] = None
    sel_node: Optional[ast.expr] = None
    j = i + 1
    while j < len(body):
        st = body[j]
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            cmp = _slot_cmp(st.value, is_eidx)
            name = st.targets[0].id
            if cmp is None or name in masks or name in used or name == tw:
                break
            masks[name] = cmp
            j += 1
            continue
        if isinstance(st, ast.AugAssign) and isinstance(st.op, ast.Add):
            tgt, value = st.target, st.value
        elif isinstance(st, ast.Assign) and len(st.targets) == 1:
            tgt, value = st.targets[0], st.value
        else:
            break
        if not (isinstance(tgt, ast.Subscript) and isinstance(tgt.value, ast.Name) and tgt.value.id == tw
                and isinstance(value, ast.Subscript) and _same(value.slice, tgt.slice)):
            break
        pos = tgt.slice
        if isinstance(pos, ast.Name):
            if pos.id not in masks or pos.id in used:
                return None
            used.add(pos.id)
            cmp = masks[pos.id]
        else:
            cmp = _slot_cmp(pos, is_eidx)
            if cmp is None:
                return None
        idx, sel, k, e = cmp
        wsel = value.value  # w[sel, k]
        if not (isinstance(wsel, ast.Subscript) and isinstance(wsel.value, ast.Name) and isinstance(wsel.slice, ast.Tuple)
                and len(wsel.slice.elts) == 2 and _same(wsel.slice.elts[0], sel)
                and const_value(wsel.slice.elts[1]) == k and not isinstance(const_value(wsel.slice.elts[1]), bool)):
            return None
        this = (idx, ast.dump(sel), ast.dump(e), wsel.value.id)
        if key is not None and this != key:
            return None
        key, e_node, sel_node = this, e, sel
        slots.append(k)
        j += 1
    if key is None or e_node is None or sorted(slots) != list(range(len(slots))) or set(masks) != used:
        return None
    idx, _, _, w = key
    sel_name = sel_node.id  # type: ignore[union-attr]
    names = {tw, idx, w} | {n.id for n in ast.walk(e_node) if isinstance(n, ast.Name)}
    if len(names | {sel_name}) != len(names) + 1 or (set(masks) & (names | {sel_name})):
        return None
    if not _buffer_dtype_ok(dtype, w):
        return None
    # the slot masks are read nowhere after their writes
    if _reads(body[j:], set(masks)):
        return None
    dense = ast.BinOp(left=ast.Name(w, ast.Load()), op=ast.Mult(),
                      right=ast.Compare(left=ast.Name(idx, ast.Load()), ops=[ast.Eq()], comparators=[e_node]))
    summed = ast.Call(func=ast.Attribute(value=dense, attr="sum", ctx=ast.Load()),
                      args=[ast.UnaryOp(op=ast.USub(), operand=ast.Constant(1))], keywords=[])
    synth = ast.Assign(targets=[ast.Name(tw, ast.Store())],
                       value=ast.Subscript(value=summed, slice=ast.Name(sel_name, ast.Load()), ctx=ast.Load()))
    synth = ast.fix_missing_locations(ast.copy_location(synth, body[i]))
    last = body[j - 1]
    for n in ast.walk(synth):
        n.lineno, n.end_lineno = body[i].lineno, last.end_lineno  # type: ignore[attr-defined]
        n.col_offset, n.end_col_offset = 0, 0  # type: ignore[attr-defined]
    return synth, f"{len(slots)} == {idx}.shape[-1]", j - 1
