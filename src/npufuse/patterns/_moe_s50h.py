"""s50 ho27moe: the any-mask expert loop read as the canonical where loop (HO27a Itera-Lite / EmberNet, HO27b
CanCellCap: three repositories, each with its own spelling).

The loop picks each expert's tokens by "e is in any slot of the token" and weights the rows by the token's
routing weights summed over the slots that chose e::

    for e in range(E):                            # or `for e, expert in enumerate(self.experts)`
        m = (ids == e).any(dim=-1)                # maybe `.cpu()`, maybe aliased as `m.view(-1)` ([T, K] ids)
        if not m.any():                           # or `if m.any(): <the rest>`
            continue
        b, s = torch.where(m)                     # [B, S, K] ids: one name per token dim, or rows `x[m]`
        y = self.experts[e](x[b, s])
        g = (w[b, s] * (ids[b, s] == e).float()).sum(dim=-1, keepdim=True)
        out[b, s] += y * g                        # or `((ids == e).float() * w).sum(-1)[m].unsqueeze(-1)`

Its MEANING is out[t] += E_e(x[t]) * sum_k w[t, k] [ids[t, k] == e] over the tokens of e: with top-k ids (one slot
of e per token, which the where-loop analysis shows: its distinct-ids proof) that is exactly the canonical where
loop::

    for e in range(E):
        _t.., _k = torch.where(ids == e)
        out[_t..] += w[_t.., _k, None] * self.experts[e](x[_t..])

so the loop is read as that synthetic loop on the original's lines (s50c's mechanism, s49d's and s23's precedent)
and every check, guard, risk and rendering of the where-loop analysis applies. Equalities used:
``x[torch.where(m)]`` is ``x[m]`` (the same rows in the same row-major order); ``m.cpu()`` is ``m`` (the same
values; the fused layer's own indices live on the tokens' device); ``m.view(-1)`` is ``m`` for 1-D ``m``, i.e. 2-D
[T, K] ids: the run-time guard ``ids.dim() == 2`` (evaluated before the loop) sends other ranks to the original;
``if not m.any(): continue`` skips an expert whose where-rows are empty (adds nothing either way).

Not read (the loop's old analysis stands): any other statement in the loop (a count, a log, a statistic), a name
bound in the loop and read after it, an expert called twice, weights not shaped as above (a dense [T, E] gate read
at column e, a weight summed over another dim), a selector other than the mask.
"""

from __future__ import annotations

import ast
import copy
from typing import Any, Optional, Union

from npufuse.patterns import _moe_s51m
from npufuse.scan.dataflow import const_value, dotted

_P = "_npufuse_s50h_"
_MOVES = ("cpu", "cuda", "detach")  # the same values on another device / without the graph (a bool mask has none)
_CASTS = ("float", "to", "type_as", "half", "bfloat16", "double")  # 0/1 values of a bool mask in another dtype
_FLAT = ("view", "reshape")


def _method(node: ast.AST, names: tuple[str, ...]) -> Optional[ast.Call]:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names:
        return node
    return None


def _last_dim(call: ast.Call, pos: int = 0) -> bool:
    """The call's dim argument (positional ``pos`` or ``dim=``) is -1."""
    dims = [a for a in call.args[pos:pos + 1]] + [k.value for k in call.keywords if k.arg == "dim"]
    return len(dims) == 1 and const_value(dims[0]) == -1


class _Mask:
    """What the loop's selector stands for: ``(ids == e).any(dim=-1)`` (``flat``: read through a ``view(-1)``)."""

    def __init__(self, ids: str, flat: bool) -> None:
        self.ids, self.flat = ids, flat


def _eq_ids(node: ast.expr, e: str) -> Optional[str]:
    """``ids`` of ``ids == e`` / ``e == ids`` (casts of the comparison allowed)."""
    while (c := _method(node, _CASTS)) is not None:
        node = c.func.value  # type: ignore[attr-defined]
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
        for a, b in ((node.left, node.comparators[0]), (node.comparators[0], node.left)):
            if isinstance(a, ast.Name) and isinstance(b, ast.Name) and b.id == e:
                return a.id
    return None


def _any_mask(node: ast.expr, e: str) -> Optional[_Mask]:
    """``(ids == e).any(dim=-1)`` / ``torch.any(ids == e, dim=-1)``, maybe moved (``.cpu()``) or flattened
    (``.view(-1)``, ``.reshape(-1)``, ``.flatten()``)."""
    flat = False
    while True:
        if (c := _method(node, _MOVES)) is not None and not c.args and not c.keywords:
            node = c.func.value  # type: ignore[attr-defined]
        elif (c := _method(node, _FLAT)) is not None and [const_value(a) for a in c.args] == [-1] and not c.keywords:
            node, flat = c.func.value, True  # type: ignore[attr-defined]
        elif (c := _method(node, ("flatten",))) is not None and not c.args and not c.keywords:
            node, flat = c.func.value, True  # type: ignore[attr-defined]
        else:
            break
    if (c := _method(node, ("any",))) is not None and _last_dim(c) and len(c.args) + len(c.keywords) == 1:
        ids = _eq_ids(c.func.value, e)  # type: ignore[attr-defined]
    elif isinstance(node, ast.Call) and dotted(node.func) == "torch.any" and len(node.args) >= 1 \
            and _last_dim(node, 1) and len(node.args) + len(node.keywords) == 2:
        ids = _eq_ids(node.args[0], e)
    else:
        return None
    return _Mask(ids, flat) if ids is not None else None


class _Inline(ast.NodeTransformer):
    """The loop's names replaced by their (inlined) values; the where-unpacked token names ``T[b, s]`` by ``T[m]``."""

    def __init__(self, env: dict[str, ast.expr], used: dict[str, int], unpacked: dict[tuple[str, ...], ast.expr]) -> None:
        self.env, self.used, self.unpacked = env, used, unpacked

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        sl = node.slice
        key = tuple(e.id for e in sl.elts if isinstance(e, ast.Name)) if isinstance(sl, ast.Tuple) else \
            ((sl.id,) if isinstance(sl, ast.Name) else ())
        if key in self.unpacked and (not isinstance(sl, ast.Tuple) or len(key) == len(sl.elts)):
            for n in key:
                self.used[n] = self.used.get(n, 0) + 1
            return ast.Subscript(self.visit(node.value), copy.deepcopy(self.unpacked[key]), node.ctx)
        return self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if isinstance(node.ctx, ast.Load) and node.id in self.env:
            self.used[node.id] = self.used.get(node.id, 0) + 1
            return copy.deepcopy(self.env[node.id])
        return node


def _strip_col(node: ast.expr) -> tuple[ast.expr, bool]:
    """``v`` of ``v.unsqueeze(-1)`` / ``v.unsqueeze(1)`` / ``v[:, None]`` / ``v[..., None]`` (True: a column made)."""
    if (c := _method(node, ("unsqueeze",))) is not None and [const_value(a) for a in c.args] in ([-1], [1]) \
            and not c.keywords:
        return c.func.value, True  # type: ignore[attr-defined]
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 2 \
            and isinstance(node.slice.elts[1], ast.Constant) and node.slice.elts[1].value is None \
            and (isinstance(node.slice.elts[0], ast.Slice) and node.slice.elts[0].lower is None
                 and node.slice.elts[0].upper is None and node.slice.elts[0].step is None
                 or isinstance(node.slice.elts[0], ast.Constant) and node.slice.elts[0].value is Ellipsis):
        return node.value, True
    return node, False


def _sum_last(node: ast.expr) -> Optional[tuple[ast.expr, bool]]:
    """``(p, keepdim)`` of ``p.sum(dim=-1[, keepdim=..])`` / ``torch.sum(p, dim=-1[, keepdim])``."""
    if (c := _method(node, ("sum",))) is not None and _last_dim(c):
        base, rest = c.func.value, c  # type: ignore[attr-defined]
        first = 0
    elif isinstance(node, ast.Call) and dotted(node.func) == "torch.sum" and node.args and _last_dim(node, 1):
        base, rest, first = node.args[0], node, 1
    else:
        return None
    keep = [k.value for k in rest.keywords if k.arg == "keepdim"] + list(rest.args[first + 1:first + 2])
    if len(rest.args) > first + 2 or any(k.arg not in ("dim", "keepdim") for k in rest.keywords):
        return None
    if keep and const_value(keep[0]) not in (True, False):
        return None
    return base, bool(keep and const_value(keep[0]) is True)


def _is_sel(node: ast.expr, e: str, ids: str) -> bool:
    m = _any_mask(node, e)
    return m is not None and m.ids == ids


def _weights(node: ast.expr, e: str, ids: str) -> Optional[str]:
    """The routing weights ``w`` of the column of the slot-summed weights of e at the selected rows (module doc):
    ``(w[m] * (ids[m] == e)).sum(-1, keepdim=True)`` or ``((ids == e) * w).sum(-1)[m].unsqueeze(-1)``."""
    node, col = _strip_col(node)
    rows_first = True
    if isinstance(node, ast.Subscript) and _is_sel(node.slice, e, ids):
        node, rows_first = node.value, False
    summed = _sum_last(node)
    if summed is None:
        return None
    prod, keep = summed
    if keep == col or not (keep or col):  # exactly one [n, 1] column: keepdim, or a sum unsqueezed
        return None
    if not (isinstance(prod, ast.BinOp) and isinstance(prod.op, ast.Mult)):
        return None
    for a, b in ((prod.left, prod.right), (prod.right, prod.left)):
        while (c := _method(a, _CASTS)) is not None:
            a = c.func.value  # type: ignore[attr-defined]
        if rows_first:
            if not (isinstance(a, ast.Subscript) and isinstance(a.value, ast.Name) and _is_sel(a.slice, e, ids)):
                continue
            a = a.value
            if not (isinstance(b, ast.Compare) or _method(b, _CASTS)):
                continue
            cmp = b
            while (c := _method(cmp, _CASTS)) is not None:
                cmp = c.func.value  # type: ignore[attr-defined]
            if not (isinstance(cmp, ast.Compare) and len(cmp.ops) == 1 and isinstance(cmp.ops[0], ast.Eq)):
                continue
            sides = [cmp.left, cmp.comparators[0]]
            ok = any(isinstance(s, ast.Subscript) and isinstance(s.value, ast.Name) and s.value.id == ids
                     and _is_sel(s.slice, e, ids) and isinstance(o, ast.Name) and o.id == e
                     for s, o in (sides, sides[::-1]))
            if ok and isinstance(a, ast.Name):
                return a.id
        elif isinstance(a, ast.Name) and _eq_ids(b, e) == ids:
            return a.id
    return None


def as_where_loop(m: Any, scope: Any, block: list, i: int, loop: ast.For) -> Union[None, tuple]:
    """``(block', i, loop', guards)``: the any-mask loop read as the where loop it equals (module doc); None
    where the loop is not this form."""
    tgt = loop.target
    item: Optional[str] = None
    if isinstance(tgt, ast.Name):
        e = tgt.id
    elif isinstance(tgt, ast.Tuple) and len(tgt.elts) == 2 and all(isinstance(t, ast.Name) for t in tgt.elts) \
            and isinstance(loop.iter, ast.Call) and dotted(loop.iter.func) == "enumerate":
        e, item = tgt.elts[0].id, tgt.elts[1].id  # type: ignore[attr-defined]
    else:
        return None
    if loop.orelse:
        return None
    option = _option_branches(scope, loop, e)
    if option is None:
        return None
    loop, opt_guard = option
    body = list(loop.body)
    env: dict[str, ast.expr] = {}
    used: dict[str, int] = {}
    unpacked: dict[tuple[str, ...], ast.expr] = {}
    bound: set[str] = set()
    comb: Optional[ast.AugAssign] = None
    mask: Optional[_Mask] = None
    scattered: list[str] = []  # s51: run-time guards of a scattered gate
    j = 0
    while j < len(body):
        st = body[j]
        j += 1
        if isinstance(st, ast.If) and not st.orelse:
            test = st.test
            neg = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
            inner = test.operand if neg else test  # type: ignore[attr-defined]
            inner = _Inline(env, used, unpacked).visit(copy.deepcopy(inner))
            c = _method(inner, ("any",))
            if c is None or c.args or c.keywords or _any_mask(c.func.value, e) is None:  # type: ignore[attr-defined]
                return None
            if neg and len(st.body) == 1 and isinstance(st.body[0], ast.Continue):
                continue  # an expert without tokens: its where-rows are empty, nothing is added either way
            if not neg and j == len(body):
                body = body[:j] + list(st.body)  # `if m.any(): <the rest>`
                continue
            return None
        if (sg := _moe_s51m.scatter_gate(m, scope, loop, body, j - 1, e, _Inline(env, used, unpacked).visit, _eq_ids, bound)) is not None:
            j, gate, env[gate], more = sg  # s51 moe51: the gate scattered into a fresh [T] buffer is the slot sum
            bound.add(gate)
            scattered.extend(more)
            continue
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Tuple) \
                and all(isinstance(t, ast.Name) for t in st.targets[0].elts) and isinstance(st.value, ast.Call) \
                and dotted(st.value.func) == "torch.where" and len(st.value.args) == 1 and not st.value.keywords:
            names = tuple(t.id for t in st.targets[0].elts)  # type: ignore[attr-defined]
            sel = _Inline(env, used, unpacked).visit(copy.deepcopy(st.value.args[0]))
            if len(set(names)) != len(names) or set(names) & (bound | {e}) or _any_mask(sel, e) is None:
                return None
            unpacked[names] = sel
            bound.update(names)
            continue
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            name = st.targets[0].id
            if name == e or name == item or any(name in k for k in unpacked):
                return None
            value = _Inline(env, used, unpacked).visit(copy.deepcopy(st.value))
            if name in env and used.get(name, 0) == 0 and name not in _names(value):
                return None  # a value bound and rebound unread
            env[name] = value
            used.pop(name, None)
            bound.add(name)
            continue
        if isinstance(st, ast.AugAssign) and isinstance(st.op, ast.Add) and j == len(body):
            comb = st
            continue
        return None
    if comb is None or not isinstance(comb.target, ast.Subscript) or not isinstance(comb.target.value, ast.Name):
        return None
    target = _Inline(env, used, unpacked).visit(copy.deepcopy(comb.target))
    value = _Inline(env, used, unpacked).visit(copy.deepcopy(comb.value))
    out = target.value.id
    mask = _any_mask(target.slice, e)
    if mask is None or out in bound or out == e:
        return None
    ids = mask.ids
    # the value: the expert called on the selected rows, times the slot-summed weight column (either order)
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult)):
        return None
    call = weights = None
    for a, b in ((value.left, value.right), (value.right, value.left)):
        if isinstance(a, ast.Call) and len(a.args) == 1 and not a.keywords:
            f = a.func
            picks = isinstance(f, ast.Subscript) and isinstance(f.slice, ast.Name) and f.slice.id == e \
                and isinstance(f.value, (ast.Name, ast.Attribute)) and item is None
            named = isinstance(f, ast.Name) and item is not None and f.id == item
            row = a.args[0]
            if (picks or named) and isinstance(row, ast.Subscript) and isinstance(row.value, ast.Name) \
                    and _is_sel(row.slice, e, ids):
                w = _weights(b, e, ids)
                if w is not None:
                    call, weights = a, w
    if call is None or weights is None:
        return None
    tokens = call.args[0].value.id  # type: ignore[attr-defined]
    if {tokens, weights, ids, out} & (bound | {e}):
        return None
    # every bound name that calls a module is read exactly once (no expert call duplicated or dropped)
    for name, v in env.items():
        if any(isinstance(n, ast.Call) for n in ast.walk(v) if not _pure_call(n)) and used.get(name, 0) != 1:
            return None
    calls = [n for n in ast.walk(value) if isinstance(n, ast.Call) and not _pure_call(n)]
    if calls != [call]:
        return None
    for name in bound:
        if scope.uses_after(name, loop.end_lineno or loop.lineno):
            return None
    # the where-token names are read only as the row selector (x[b, s], w[b, s], ids[b, s], out[b, s])
    for names in unpacked:
        left = [n for n in ast.walk(ast.Module(body=[target, value], type_ignores=[]))
                if isinstance(n, ast.Name) and n.id in names]
        if left:
            return None
    n_tok = max((len(k) for k in unpacked), default=1)
    guards: list[str] = ([opt_guard] if opt_guard else []) + scattered
    if not unpacked or mask.flat:
        n_tok = 1
        guards.append(f"({ids}.dim() == 2)")  # `x[m]` / `m.view(-1)` with m over [T] tokens: [T, K] ids
    return _synthetic(block, i, loop, e, ids, weights, out, tokens, call, n_tok), guards


def _option_branches(scope: Any, loop: ast.For, e: str) -> Optional[tuple[ast.For, str]]:
    """EmberNet: ``A if opt else B`` with ``opt`` a name the loop does not bind (an on-demand loading switch), in the
    loop's iterable (a name bound once before the loop: ``todo = ids.unique().tolist() if opt else range(E)``) and in
    the loop's statements (``f = loaded[e] if opt else self.experts[e]``): the loop read on the branch that is the
    plain expert loop (``range(..)``, ``self.<container>[e]``) under the run-time guard that picks it (``(not opt)`` or
    ``(opt)``, evaluated before the loop: the fused text runs only where every such branch is the one read; the
    original runs otherwise). ``(loop', guard)``; the loop itself and "" without such branches; None where the
    branches are not of this form (two options, or both polarities)."""
    bound = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    picked: set[tuple[str, bool]] = set()

    def pick(node: ast.IfExp, plain) -> Optional[ast.expr]:
        test = node.test
        if not isinstance(test, ast.Name) or test.id in bound or test.id == e:
            return None
        if len(scope.assignments.get(test.id, [])) > 1:
            return None
        for branch, positive in ((node.orelse, False), (node.body, True)):
            if plain(branch):
                picked.add((test.id, positive))
                return branch
        return None

    it = loop.iter
    new_iter = None
    if isinstance(it, ast.Name) and len(scope.assignments.get(it.id, [])) == 1 and it.id not in bound:
        stmt, value = scope.assignments[it.id][0]
        if stmt.lineno < loop.lineno and isinstance(value, ast.IfExp):
            new_iter = pick(value, lambda b: isinstance(b, ast.Call) and dotted(b.func) == "range")
            if new_iter is None:
                return None
    ifexps = [n for st in loop.body for n in ast.walk(st) if isinstance(n, ast.IfExp)]
    if new_iter is None and not ifexps:
        return loop, ""
    new = copy.deepcopy(loop)
    if new_iter is not None:
        new.iter = copy.deepcopy(new_iter)
    for st in new.body:
        if not (isinstance(st, ast.Assign) and isinstance(st.value, ast.IfExp)):
            continue
        got = pick(st.value, lambda b: isinstance(b, ast.Subscript) and isinstance(b.slice, ast.Name)
                   and b.slice.id == e and isinstance(b.value, ast.Attribute)
                   and isinstance(b.value.value, ast.Name) and b.value.value.id == "self")  # the module's experts
        if got is None:
            return None
        st.value = copy.deepcopy(got)
    if any(isinstance(n, ast.IfExp) for st in new.body for n in ast.walk(st)) or len(picked) != 1:
        return None
    name, positive = picked.pop()
    return new, (f"({name})" if positive else f"(not {name})")


def zip_slot_nest(loop: ast.For) -> Optional[tuple[ast.For, list[str]]]:
    """my-transformer: the per-token loop nest of s50c whose slot loop walks the pair's weights and ids together,
    ``for w, e in zip(wts[t], ids[t]): ...``, read as ``for k in range(ids.shape[n]): w = wts[t, k]; e = ids[t, k]; ...``
    (a copy of the nest; n the number of token loops). zip stops at the shorter of the two rows: the run-time guard
    ``wts.shape == ids.shape`` makes them the same K slots (other shapes run the original). None for other loops."""
    from npufuse.patterns._moe_s50c import _pair_index, _range_arg  # s50c imports this module

    chain = [loop]
    while len(chain[-1].body) == 1 and isinstance(chain[-1].body[0], ast.For):
        chain.append(chain[-1].body[0])  # type: ignore[arg-type]
    last = chain[-1]
    outer = chain[:-1]
    if not outer or any(not isinstance(f.target, ast.Name) or _range_arg(f.iter) is None for f in outer):
        return None
    tgt, it = last.target, last.iter
    if last.orelse or not (isinstance(tgt, ast.Tuple) and len(tgt.elts) == 2
                           and all(isinstance(t, ast.Name) for t in tgt.elts)):
        return None
    if not (isinstance(it, ast.Call) and dotted(it.func) == "zip" and len(it.args) == 2 and not it.keywords):
        return None
    tok_vars = [f.target.id for f in outer]  # type: ignore[attr-defined]
    bases = [_pair_index(a, tok_vars) for a in it.args]
    names = [t.id for t in tgt.elts]  # type: ignore[attr-defined]
    if None in bases or len(set(names)) != 2 or bases[0] == bases[1] or set(names) & set(tok_vars):
        return None
    new = copy.deepcopy(loop)
    inner = new
    for _ in outer[1:]:
        inner = inner.body[0]  # type: ignore[assignment]
    k = f"{_P}zk"
    slot = inner.body[0]
    assert isinstance(slot, ast.For)
    slot.target = ast.copy_location(ast.Name(k, ast.Store()), slot.target)
    bound = ast.parse(f"{bases[1]}.shape[{len(tok_vars)}]", mode="eval").body
    slot.iter = ast.copy_location(ast.Call(ast.Name("range", ast.Load()), [bound], []), slot.iter)
    reads = []
    for name, base in zip(names, bases):
        sub = ast.Subscript(ast.Name(base, ast.Load()), ast.Tuple([ast.Name(v, ast.Load()) for v in tok_vars + [k]],
                                                                  ast.Load()), ast.Load())
        reads.append(ast.Assign(targets=[ast.Name(name, ast.Store())], value=sub))
    for st in reads:
        for n in ast.walk(st):
            if "lineno" in n._attributes:
                n.lineno, n.end_lineno = slot.lineno, slot.lineno  # type: ignore[attr-defined]
                n.col_offset = n.end_col_offset = None  # type: ignore[attr-defined]
    slot.body = reads + slot.body
    return new, [f"({bases[0]}.shape == {bases[1]}.shape)"]


def shared_in_token_loop(loop: ast.For) -> Optional[tuple[ast.For, ast.AugAssign]]:
    """my-transformer deepseek: ``out[t] += self.shared(x[t])`` beside the slot loop in the per-token loop (a shared
    expert every token runs once, unrouted, weight 1). ``(a copy of the nest without it, the statement)``; None for
    other loops. The caller reads the rest as usual and adds the shared module once on all rows after the fused layer
    (``shared_tail``): out[t] = shared(x[t]) + sum_k w[t, k] E(x[t]) either way (the sum in another order)."""
    cur, depth = loop, 0
    while len(cur.body) == 1 and isinstance(cur.body[0], ast.For):
        cur, depth = cur.body[0], depth + 1  # type: ignore[assignment]
    if len(cur.body) != 2 or not any(isinstance(s, ast.AugAssign) for s in cur.body):
        return None  # (checked on the original: the copy only for this form)
    new = copy.deepcopy(loop)
    cur = new
    for _ in range(depth):
        cur = cur.body[0]  # type: ignore[assignment]
    fors = [s for s in cur.body if isinstance(s, ast.For)]
    adds = [s for s in cur.body if isinstance(s, ast.AugAssign)]
    if len(fors) != 1 or len(adds) != 1 or not isinstance(adds[0].op, ast.Add):
        return None
    add = adds[0]
    v = add.value
    if not (isinstance(add.target, ast.Subscript) and isinstance(add.target.value, ast.Name)
            and isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and dotted(v.func) is not None
            and len(v.args) == 1 and not v.keywords and isinstance(v.args[0], ast.Subscript)
            and ast.dump(v.args[0].slice) == ast.dump(add.target.slice)):
        return None
    cur.body = fors
    return new, add


def shared_tail(m: Any, scope: Any, add: ast.AugAssign, out: str, tokens: str, container: ast.expr,
                tok_vars: list[str]) -> Optional[str]:
    """The text that adds the shared module of ``add`` once on all rows (``shared_in_token_loop``), or None where the
    equality is not shown: the statement must add to the loop's accumulator at the token, on the experts' token row,
    and the shared module must be of the experts' class (built in ``__init__``), whose per-token calls the reader
    already proves equal to batched ones (an MLP read off the class, or s49's token-wise reading)."""
    from npufuse.patterns._moe_s50c import _pair_index
    from npufuse.patterns.moe_experts import _class_init_assigns

    call = add.value
    assert isinstance(call, ast.Call)
    if _pair_index(add.target, tok_vars) != out or _pair_index(call.args[0], tok_vars) != tokens:
        return None
    if scope.class_name is None or scope.class_name not in m.classes:
        return None
    if not (isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) and call.func.value.id == "self"
            and isinstance(container, ast.Attribute) and isinstance(container.value, ast.Name)
            and container.value.id == "self"):
        return None
    init = _class_init_assigns(m, m.classes[scope.class_name])
    shared, experts = init.get(call.func.attr), init.get(container.attr)
    elt = experts.args[0] if isinstance(experts, ast.Call) and experts.args else None
    if isinstance(elt, (ast.ListComp, ast.GeneratorExp)):
        elt = elt.elt
    if not (isinstance(shared, ast.Call) and isinstance(elt, ast.Call) and dotted(shared.func) is not None
            and dotted(shared.func) == dotted(elt.func) and dotted(shared.func) in m.classes):
        return None
    text = ast.unparse(call.func)
    return (f"# `{text}` of the per-token loop: an unrouted shared expert, added once per token on all rows\n"
            f"{out}.add_({text}({tokens}).reshape({out}.shape).to({out}.dtype))")


def device_move(node: ast.Call) -> bool:
    """``m.cpu()`` / ``m.cuda()`` / ``m.to(<x>.device)`` / ``m.to(device=...)``: the same mask values on another device
    (indexing the tokens with it picks the same rows; the fused layer does not read the mask at all)."""
    if not isinstance(node.func, ast.Attribute):
        return False
    if node.func.attr in ("cpu", "cuda") and not node.args and not node.keywords:
        return True
    from npufuse.patterns.moe_experts import _device_move_of  # the analyser's own reading of `.to(device)`

    return _device_move_of(node, None)


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


_PURE = {"any", "sum", "float", "to", "type_as", "half", "bfloat16", "double", "unsqueeze", "cpu", "cuda", "detach",
         "view", "reshape", "flatten", "squeeze"}


def _pure_call(n: ast.AST) -> bool:
    """A tensor method of the mask / weight reading (no module call, no randomness)."""
    return isinstance(n, ast.Call) and (isinstance(n.func, ast.Attribute) and n.func.attr in _PURE
                                        or dotted(n.func) in ("torch.any", "torch.sum"))


def _synthetic(block: list, i: int, loop: ast.For, e: str, ids: str, weights: str, out: str, tokens: str,
               call: ast.Call, n_tok: int) -> tuple:
    def nm(s: str, ctx: ast.expr_context = ast.Load()) -> ast.Name:
        return ast.Name(s, ctx)

    from npufuse.patterns._moe_s50c import place_at as at

    rows = [f"{_P}t{j}" for j in range(n_tok)] + [f"{_P}k"]
    where = ast.Assign(targets=[ast.Tuple([nm(r, ast.Store()) for r in rows], ast.Store())],
                       value=ast.Call(ast.Attribute(nm("torch"), "where", ast.Load()),
                                      [ast.Compare(nm(ids), [ast.Eq()], [nm(e)])], []))
    tok_index: ast.expr = nm(rows[0]) if n_tok == 1 else ast.Tuple([nm(r) for r in rows[:n_tok]], ast.Load())
    expert_call = ast.Call(copy.deepcopy(call.func), [ast.Subscript(nm(tokens), copy.deepcopy(tok_index), ast.Load())], [])
    w_col = ast.Subscript(nm(weights), ast.Tuple([nm(r) for r in rows] + [ast.Constant(None)], ast.Load()), ast.Load())
    comb = ast.AugAssign(ast.Subscript(nm(out), copy.deepcopy(tok_index), ast.Store()), ast.Add(),
                         ast.BinOp(w_col, ast.Mult(), expert_call))
    first, last = loop.body[0], loop.body[-1]
    new = ast.For(target=copy.deepcopy(loop.target), iter=copy.deepcopy(loop.iter),
                  body=[at(where, first), at(comb, last)], orelse=[])
    new = ast.copy_location(new, loop)
    new.end_lineno, new.end_col_offset = loop.end_lineno, loop.end_col_offset
    return block[:i] + [new] + block[i + 1:], i, new


_AS_WRITTEN: set[int] = set()  # loops being analysed as written (the reader steps aside for them)


def syn_weights(new: ast.For) -> str:
    """The weights name of the synthetic loop's combine ``out[..] += w[.., None] * call``."""
    return new.body[1].value.left.value.id  # type: ignore[attr-defined]


def syn_ids(new: ast.For) -> str:
    """The ids name of the synthetic loop's ``torch.where(ids == e)``."""
    return new.body[0].value.args[0].left.id  # type: ignore[attr-defined]


def read_as_where_loop(m: Any, scope: Any, block: list, i: int, loop: ast.For) -> Any:
    """The analysis's site of the where loop an any-mask loop equals, with its run-time guard; False where the loop
    is not this form (the caller reads it as written)."""
    from npufuse.patterns import moe_experts as me  # the analyser (imports this module)

    # the cheap gate: `.any(` in the loop's first statements
    if not any(isinstance(n, ast.Attribute) and n.attr == "any" for st in loop.body[:3] for n in ast.walk(st)):
        return False
    if id(loop) in _AS_WRITTEN:
        return False
    syn = as_where_loop(m, scope, block, i, loop)
    if syn is None:
        return False
    (new_block, j, new), guards = syn
    # the loop as written first: the older readings stand where they read it (a [B, T] mask with rows `x[m]`, which
    # the synthetic loop would send to the original by its rank guard); the synthetic reading only where they miss
    _AS_WRITTEN.add(id(loop))
    try:
        return me._analyze_loop(m, scope, block, i, loop)
    except me._Miss as miss:
        as_written = miss
    finally:
        _AS_WRITTEN.discard(id(loop))
    # the slot sum is the pair's weight only for one weight per slot: weights shown shaped like the indices (a dense
    # [T, E] score times the [T, K] slot mask is not); where that or the synthetic loop's analysis fails, the reason
    # of the loop as written stands (true of it: it was not read)
    if not me._s41_shaped_like_indices(m, scope, syn_weights(new), syn_ids(new), loop.lineno) \
            and _moe_s51m.shape_guard(syn_weights(new), syn_ids(new)) not in guards:  # s51: checked at run time
        raise as_written
    try:
        site = me._analyze_loop(m, scope, new_block, j, new)
    except me._Miss:
        raise as_written from None
    if site is not None:
        site.option_guards = [*site.option_guards, *(g for g in guards if g not in site.option_guards)]
    return site
