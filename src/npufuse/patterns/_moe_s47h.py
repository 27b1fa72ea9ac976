"""s47 (fix47h): skips of empty experts are never the reason a MoE loop is refused.

A loop that skips experts without rows (``if cnt == 0: continue``) computes what the loop without the skip
computes: an expert called on no rows adds nothing. Two classes, from HO23a moe-routers (``cnt =
int(counts[e].item()); if cnt == 0: continue`` in an ``enumerate(self.experts)`` loop over sorted routes):

1. **a count bound to a name in the loop**: ``cnt = int(counts[e].item())`` (``counts[e].item()``, ``int(counts[e])``)
   then ``if cnt == 0`` / ``cnt <= 0`` / ``cnt < 1`` / ``not cnt``: the same test as ``if counts[e] == 0`` (which the
   analyser reads with ``counts = bincount(...)``), so it is read the same way.
2. **an emptiness test npufuse cannot read** (``v == 0``, ``v <= 0``, ``v < 1``, ``not v`` of a value not traced to this
   expert's rows): it no longer stops the analysis at the ``if``. The loop is read on; a later
   blocker is the reason reported (true of the loop whatever the skip does), and where nothing else blocks, the
   unread skip is the reason (as before): no candidate is ever made past a skip that is not proven to skip only
   empty experts. A test of another shape (a threshold ``n < 4``, a flag) is the blocker itself, reported at once.
"""

from __future__ import annotations

import ast
from typing import Optional

from npufuse.scan.dataflow import const_value, dotted


def _zero_test(test: ast.expr) -> Optional[ast.expr]:
    """The operand of ``v == 0`` / ``v <= 0`` / ``v < 1`` / ``0 == v`` / ``not v``; None for any other test."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return test.operand
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, op, right = test.left, test.ops[0], test.comparators[0]
        for v, c, flipped in ((left, right, False), (right, left, True)):
            k = const_value(c)
            if not isinstance(k, int) or isinstance(k, bool):
                continue
            if isinstance(op, ast.Eq) and k == 0:
                return v
            if not flipped and ((isinstance(op, ast.LtE) and k == 0) or (isinstance(op, ast.Lt) and k == 1)):
                return v
            if flipped and ((isinstance(op, ast.GtE) and k == 0) or (isinstance(op, ast.Gt) and k == 1)):
                return v
    return None


def emptiness_shaped(test: ast.expr) -> bool:
    """``test`` has the shape of an emptiness test (``v == 0``, ``v <= 0``, ``v < 1``, ``not v``), whatever ``v`` is."""
    return _zero_test(test) is not None


def _host_number(node: ast.expr) -> ast.expr:
    """``counts[e]`` of ``int(counts[e].item())`` / ``counts[e].item()`` / ``int(counts[e])``."""
    for _ in range(3):
        if isinstance(node, ast.Call) and dotted(node.func) == "int" and len(node.args) == 1 and not node.keywords:
            node = node.args[0]
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "item" \
                and not node.args and not node.keywords:
            node = node.func.value
            continue
        break
    return node


def counted_read(loop: ast.For, test: ast.expr, line: int) -> Optional[ast.Subscript]:
    """``counts[e]`` where ``test`` (at ``line``, a statement of the loop's body) tests for zero a name bound once in the
    loop's body, before ``line`` and at its top level, to ``int(counts[e].item())`` (or a spelling above); None
    otherwise."""
    v = _zero_test(test)
    if not isinstance(v, ast.Name):
        return None
    binds = []
    for st in ast.walk(loop):
        if isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.With, ast.NamedExpr)) and st is not loop:
            targets = st.targets if isinstance(st, ast.Assign) else [getattr(st, "target", None)] if not isinstance(st, ast.With) \
                else [it.optional_vars for it in st.items]
            for t in targets:
                if t is not None and any(isinstance(n, ast.Name) and n.id == v.id for n in ast.walk(t)):
                    binds.append(st)
    if len(binds) != 1 or not isinstance(binds[0], ast.Assign) or len(binds[0].targets) != 1 \
            or not isinstance(binds[0].targets[0], ast.Name) or binds[0].lineno >= line \
            or not any(st is binds[0] for st in loop.body):
        return None
    value = _host_number(binds[0].value)
    return value if isinstance(value, ast.Subscript) else None


# -- 3. a token's routing weight summed over its top-k slots by an inner loop -----------------------------------------

def _zeros_alloc(st: ast.stmt) -> Optional[tuple[str, Optional[ast.expr]]]:
    """(name, dtype node or None) of ``name = torch.zeros(n, ...)`` (``device=`` allowed, ``dtype=`` returned)."""
    if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
            and isinstance(st.value, ast.Call) and (dotted(st.value.func) or "") in ("torch.zeros", "zeros")
            and len(st.value.args) == 1 and not isinstance(st.value.args[0], ast.Starred)):
        return None
    dtype = None
    for k in st.value.keywords:
        if k.arg == "dtype":
            dtype = k.value
        elif k.arg not in ("device", "requires_grad"):
            return None
    return st.targets[0].id, dtype


def _buffer_dtype_ok(dtype: Optional[ast.expr], w: str) -> bool:
    """A zeros buffer for routing weights made with no dtype, float32, or the weights' own ``<w>.dtype``: a float32
    copy of bf16 / fp16 / fp32 weights is exact, so the original's buffer changes no value."""
    if dtype is None:
        return True
    text = dotted(dtype) or ""
    return text in ("torch.float32", "torch.float") or (
        isinstance(dtype, ast.Attribute) and dtype.attr == "dtype" and isinstance(dtype.value, ast.Name) and dtype.value.id == w)


def _same(a: ast.AST, b: ast.AST) -> bool:
    return ast.dump(a) == ast.dump(b)


def slot_weight_sum(body: list[ast.stmt], i: int, is_eidx) -> Optional[tuple[ast.Assign, str]]:
    """HO23a capybara moe-router: the weight of each selected token summed over its top-k slots by a loop::

        tw = torch.zeros(mask.sum(), device=x.device)
        for k in range(K):
            km = idx[mask, k] == e
            tw[km] += w[mask, k][km]          # (or ``= ``, or ``km`` written inline)

    is ``sum_k w[t, k] * (idx[t, k] == e)`` over the rows of ``mask`` for the first K slots: (the synthetic statement
    ``tw = (w * (idx == e)).sum(-1)[mask]``, the dense-gates reading, and the run-time guard ``K == idx.shape[-1]``)
    for ``body[i]`` / ``body[i + 1]``; None for anything else. ``tw`` keeps its dtype in the original (float32 from
    ``zeros`` without ``dtype``): the weights' values are the same (a float32 copy of bf16 / fp16 / fp32 weights is
    exact); a ``dtype=`` other than float32 / the weights' own is not read (it would round them)."""
    if i + 1 >= len(body):
        return None
    alloc = _zeros_alloc(body[i])
    loop = body[i + 1]
    if alloc is None or not isinstance(loop, ast.For) or loop.orelse or not isinstance(loop.target, ast.Name):
        return None
    tw, dtype = alloc
    k = loop.target.id
    it = loop.iter
    if not (isinstance(it, ast.Call) and dotted(it.func) == "range" and not it.keywords and len(it.args) in (1, 2)):
        return None
    if len(it.args) == 2 and const_value(it.args[0]) != 0:
        return None
    bound = it.args[-1]
    if any(isinstance(n, ast.Name) and n.id == k for n in ast.walk(bound)):
        return None
    stmts = loop.body
    km_name, km = None, None
    if len(stmts) == 2 and isinstance(stmts[0], ast.Assign) and len(stmts[0].targets) == 1 \
            and isinstance(stmts[0].targets[0], ast.Name):
        km_name, km = stmts[0].targets[0].id, stmts[0].value
        upd = stmts[1]
    elif len(stmts) == 1:
        upd = stmts[0]
    else:
        return None
    if isinstance(upd, ast.AugAssign) and isinstance(upd.op, ast.Add):
        tgt, value = upd.target, upd.value
    elif isinstance(upd, ast.Assign) and len(upd.targets) == 1:
        tgt, value = upd.targets[0], upd.value
    else:
        return None
    # tw[km] (+)= w[mask, k][km]
    if not (isinstance(tgt, ast.Subscript) and isinstance(tgt.value, ast.Name) and tgt.value.id == tw
            and isinstance(value, ast.Subscript) and _same(value.slice, tgt.slice)):
        return None
    sel = tgt.slice
    if km_name is not None:
        if not (isinstance(sel, ast.Name) and sel.id == km_name):
            return None
    else:
        km = sel
    # km: idx[mask, k] == e (either side)
    if not (isinstance(km, ast.Compare) and len(km.ops) == 1 and isinstance(km.ops[0], ast.Eq)):
        return None
    for col, e in ((km.left, km.comparators[0]), (km.comparators[0], km.left)):
        if is_eidx(e) and isinstance(col, ast.Subscript) and isinstance(col.value, ast.Name) \
                and isinstance(col.slice, ast.Tuple) and len(col.slice.elts) == 2:
            break
    else:
        return None
    idx = col.value.id
    mask, kk = col.slice.elts
    if not (isinstance(kk, ast.Name) and kk.id == k) or not isinstance(mask, ast.Name):
        return None
    wsel = value.value  # w[mask, k]
    if not (isinstance(wsel, ast.Subscript) and isinstance(wsel.value, ast.Name) and isinstance(wsel.slice, ast.Tuple)
            and len(wsel.slice.elts) == 2 and _same(wsel.slice.elts[0], mask) and isinstance(wsel.slice.elts[1], ast.Name)
            and wsel.slice.elts[1].id == k):
        return None
    w = wsel.value.id
    if len({tw, k, idx, w, mask.id} | ({km_name} if km_name else set())) != 5 + bool(km_name):
        return None
    if not _buffer_dtype_ok(dtype, w):
        return None
    # names the synthetic statement reads must not change inside the slot loop
    written = {n.id for st in stmts for n in ast.walk(st) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if written & {idx, w, mask.id, k} or any(isinstance(n, ast.Name) and n.id in written for n in ast.walk(e)):
        return None
    dense = ast.BinOp(left=ast.Name(w, ast.Load()), op=ast.Mult(),
                      right=ast.Compare(left=ast.Name(idx, ast.Load()), ops=[ast.Eq()], comparators=[e]))
    summed = ast.Call(func=ast.Attribute(value=dense, attr="sum", ctx=ast.Load()),
                      args=[ast.UnaryOp(op=ast.USub(), operand=ast.Constant(1))], keywords=[])
    synth = ast.Assign(targets=[ast.Name(tw, ast.Store())],
                       value=ast.Subscript(value=summed, slice=ast.Name(mask.id, ast.Load()), ctx=ast.Load()))
    synth = ast.fix_missing_locations(ast.copy_location(synth, body[i]))
    for n in ast.walk(synth):
        n.lineno, n.end_lineno = body[i].lineno, loop.end_lineno  # type: ignore[attr-defined]
        n.col_offset, n.end_col_offset = 0, 0  # type: ignore[attr-defined]
    return synth, f"({ast.unparse(bound)}) == {idx}.shape[-1]"
