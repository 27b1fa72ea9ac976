"""s50 moe50: a canonical reading of per-(token, slot) MoE loops (HO26a RushilJ2603 ``deepseek_modules.py``,
sweep50moe Venish12 ``moe_layer.py``; HO24a keeratpreetsingh's unrolled-slot form is the same meaning but keeps
its output in a Python list, not read here).

The loops visit the routed pairs one token at a time::

    for b in range(B):                       # one loop per token dim of the ids
        for s in range(S):
            for k in range(K):               # the top-k slot loop (absent for [T] top-1 ids)
                e = ids[b, s, k].item()      # or int(ids[b][s][k]), or the subscript used directly
                w = wts[b, s, k]
                y = experts[e](x[b, s].unsqueeze(0))
                out[b, s] += w * y.squeeze(0)      # `out[t] = experts[e](x[t])` for [T] ids (one pair per token)

Its MEANING is the routed-expert sum out[t] = sum_k w[t, k] E_{ids[t, k]}(x[t]) over every (token, slot) pair
once, which is exactly the canonical where loop the analysis already fuses::

    for _e in range(len(experts)):
        _b, _s, _k = torch.where(ids == _e)  # (`_m = ids == _e` for [T] ids)
        out[_b, _s] += wts[_b, _s, _k, None] * experts[_e](x[_b, _s])

so the loop is read as that synthetic loop on the original's lines (s49d's and s23's precedent) and every check,
guard, risk and rendering of the where-loop analysis applies (a fresh zeros accumulator, distinct ids for the
indexed accumulate, the experts' token-wise proof). The equality needs the loops to cover the ids' token dims
and all K slots: the run-time guard ``tuple(ids.shape) == (B, S, K)`` (the range bounds as written, evaluated
before the loop) sends any other shape to the original. The per-token expert call on a [1, H] (or [H]) row
equals its rows of the batched call for the token-wise experts the analysis accepts.
"""

from __future__ import annotations

import ast
import copy
from typing import Any, Optional, Union

from npufuse.patterns import _moe_s50b, _moe_s50h
from npufuse.scan.dataflow import const_value, dotted

_P = "_npufuse_s50_"
_MARK = "_npufuse_s50_per_token"


def place_at(node: ast.AST, like: ast.AST) -> ast.AST:
    """``node`` (built for a synthetic loop) placed on ``like``'s lines without columns: its text is its unparse, never
    a slice of the source line (copied original nodes keep their own positions and text)."""
    for n in ast.walk(node):
        if "lineno" in n._attributes and not hasattr(n, "lineno"):
            n.lineno, n.end_lineno = like.lineno, like.end_lineno  # type: ignore[attr-defined]
            n.col_offset = n.end_col_offset = None  # type: ignore[attr-defined]
    return node


def _range_arg(node: ast.expr) -> Optional[ast.expr]:
    if isinstance(node, ast.Call) and dotted(node.func) == "range" and len(node.args) == 1 and not node.keywords:
        return node.args[0]
    return None


def _strip_scalar(node: ast.expr) -> ast.expr:
    """``a`` of ``a.item()`` / ``int(a)`` (a host copy of one id)."""
    if isinstance(node, ast.Call) and dotted(node.func) == "int" and len(node.args) == 1 and not node.keywords:
        node = node.args[0]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "item" \
            and not node.args and not node.keywords:
        node = node.func.value
    return node


def _same_index(e: ast.expr, v: str) -> bool:
    """``e`` is the loop variable ``v``, or (s50b: an unrolled slot, ``v`` = ``"#j"``) the integer constant j."""
    if v.startswith("#"):
        return isinstance(e, ast.Constant) and type(e.value) is int and e.value == int(v[1:])
    return isinstance(e, ast.Name) and e.id == v


def _pair_index(node: ast.expr, idx_vars: list[str]) -> Optional[str]:
    """``a`` of ``a[v0, v1, ...]`` / ``a[v0][v1]...`` indexed by exactly the loop variables ``idx_vars`` in order
    (``"#j"`` in ``idx_vars``: the constant j, an unrolled slot)."""
    node = _strip_scalar(node)
    if not isinstance(node, ast.Subscript):
        return None
    if isinstance(node.slice, ast.Tuple):
        elts = node.slice.elts
        if isinstance(node.value, ast.Name) and len(elts) == len(idx_vars) \
                and all(_same_index(e, v) for e, v in zip(elts, idx_vars)):
            return node.value.id
        return None
    seq: list[ast.expr] = []
    cur: ast.expr = node
    while isinstance(cur, ast.Subscript) and not isinstance(cur.slice, (ast.Tuple, ast.Slice)):
        seq.insert(0, cur.slice)
        cur = cur.value
    if isinstance(cur, ast.Name) and len(seq) == len(idx_vars) \
            and all(_same_index(e, v) for e, v in zip(seq, idx_vars)):
        return cur.id
    return None


def _unit(node: ast.expr, attr: str) -> Optional[ast.expr]:
    """``a`` of ``a.unsqueeze(0)`` / ``a.squeeze(0)`` (attr)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr \
            and [const_value(a) for a in node.args] == [0] and not node.keywords:
        return node.func.value
    return None


class _Inline(ast.NodeTransformer):
    """Replaces the names of ``env`` by their (already inlined) values, counting each name's reads in ``used``."""

    def __init__(self, env: dict[str, ast.expr], used: dict[str, int]) -> None:
        self.env = env
        self.used = used

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if isinstance(node.ctx, ast.Load) and node.id in self.env:
            self.used[node.id] = self.used.get(node.id, 0) + 1
            return self.visit(copy.deepcopy(self.env[node.id]))
        return node


def as_where_loop(me: Any, m: Any, scope: Any, block: list, i: int, loop: ast.For) -> Union[None, str, tuple]:
    """``(block', i, loop', guards)``: the per-(token, slot) loop nest read as the where loop it equals (module doc);
    None where the loop is not this form; a near-miss reason (str) where it is but the equality is not shown."""
    # the nest: token loops, then an optional slot loop, each `for v in range(bound)` with nothing else in it
    shared = _moe_s50h.shared_in_token_loop(loop)  # s50 ho27moe: `out[t] += self.shared(x[t])` beside the slot loop
    zipped = _moe_s50h.zip_slot_nest(shared[0] if shared is not None else loop)  # s50 ho27moe: `zip(wts[t], ids[t])`
    nest: list[ast.For] = [zipped[0] if zipped is not None else shared[0] if shared is not None else loop]
    while len(nest[-1].body) == 1 and isinstance(nest[-1].body[0], ast.For):
        nest.append(nest[-1].body[0])  # type: ignore[arg-type]
    if any(f.orelse or not isinstance(f.target, ast.Name) or _range_arg(f.iter) is None for f in nest):
        return None
    if len(nest) > 4:
        return None
    vars_ = [f.target.id for f in nest]  # type: ignore[attr-defined]
    if len(set(vars_)) != len(vars_):
        return None
    body = nest[-1].body
    if not body or len(body) > 8:
        return None
    *pre, comb = body
    env: dict[str, ast.expr] = {}
    used: dict[str, int] = {}
    for st in pre:
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)):
            return None
        name = st.targets[0].id
        if name in env or name in vars_:
            return None
        env[name] = _Inline(env, used).visit(copy.deepcopy(st.value))
    # the combine: out[tokens] += value, or out[tokens] = value (one pair per token)
    listed = None
    if isinstance(comb, ast.AugAssign) and isinstance(comb.op, ast.Add):
        target, value, plain = comb.target, comb.value, False
    elif isinstance(comb, ast.Assign) and len(comb.targets) == 1:
        target, value, plain = comb.targets[0], comb.value, True
    elif (listed := _moe_s50b.appended_row(comb, vars_, block, i, loop)) is not None:
        target, value, plain = listed  # s50b: `rows.append(v)` into a fresh list, one row per token: `rows[t] = v`
    else:
        return None
    value = _Inline(env, used).visit(copy.deepcopy(value))
    if any(used.get(n, 0) != 1 for n in env):
        return None  # every bound name is read exactly once, on the way to the combine (nothing else happens per pair)
    if not isinstance(target, ast.Subscript) or not isinstance(target.value, ast.Name):
        return None
    # which loops are token loops: the accumulator's index; a remaining one the slot loop
    n_tok = len(vars_) if plain else len(vars_) - 1
    if n_tok < 1:
        return None
    tok_vars, slot = vars_[:n_tok], (vars_[n_tok] if n_tok < len(vars_) else None)
    if _pair_index(target, tok_vars) != target.value.id:
        return None
    out = target.value.id
    unrolled = _moe_s50b.unrolled_slots(value, tok_vars, _pair_index, f"{_P}k") if slot is None else None
    if unrolled is not None:
        # s50b: `e0 = E[ids[t][0]](x[t]) * w[t][0]; e1 = ...; out[t] = e0 + e1`: the top-k slots written out, one
        # term per slot 0..K-1: the slot loop `for k in range(K): out[t] += E[ids[t][k]](x[t]) * w[t][k]` into zeros
        value, slot, plain = unrolled[0], f"{_P}k", False
    pair_vars = tok_vars + ([slot] if slot else [])
    # the expert call: CONTAINER[ids[pair]](x[tokens]) (the row maybe unsqueezed, the result squeezed)
    calls = [n for n in ast.walk(value) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)]
    if len(calls) != 1:
        return None
    call = calls[0]
    ids = _pair_index(call.func.slice, pair_vars)  # type: ignore[attr-defined]
    container = call.func.value  # type: ignore[attr-defined]
    if ids is None or not isinstance(container, (ast.Attribute, ast.Name)) \
            or {n.id for n in ast.walk(container) if isinstance(n, ast.Name)} & (set(vars_) | {out}):
        return None
    inside = _pair_index(call.args[1], pair_vars) if len(call.args) == 2 and not plain else None
    if len(call.args) != 1 and inside is None or call.keywords:
        return None  # s50 ho27moe: or `experts[e](x[t], w[t, k])`: the expert weights its own output (analysed as such)
    arg = call.args[0]
    unsq = _unit(arg, "unsqueeze")
    row = unsq if unsq is not None else arg
    tokens = _pair_index(row, tok_vars)
    if tokens is None:
        return None
    # the weighting: value is the call (plain `=`, or `+=` of unweighted pairs) or w[pair] * call (either order)
    def strip_sq(node: ast.expr) -> Optional[ast.expr]:
        if unsq is not None:
            node = _unit(node, "squeeze")  # type: ignore[assignment]
        return node if node is call else None

    weights = None
    if inside is not None and strip_sq(value) is None:
        return None  # the weight given to the expert and the output weighted again: not read
    if strip_sq(value) is None:
        if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult)):
            return None
        for a, b in ((value.left, value.right), (value.right, value.left)):
            if strip_sq(a) is not None and isinstance(b, ast.Subscript) and _pair_index(b, pair_vars) is not None:
                weights = _pair_index(b, pair_vars)
        if weights is None:
            return None
    if plain and slot is not None:
        return None
    if plain and weights is not None:
        return None  # `out[t] = w * y` over [T] ids is read by the analysis as written only where it is a mask form
    # names the loop binds stay inside it
    for name in env:
        if scope.uses_after(name, loop.end_lineno or loop.lineno):
            return None
    for name in (ids, tokens, out, *([weights] if weights else []), *([inside] if inside else [])):
        if name in vars_ or name in env:
            return None
    # the synthetic where loop on the original's lines
    e = f"{_P}e"

    at = place_at

    def nm(s: str, ctx: ast.expr_context = ast.Load()) -> ast.Name:
        return ast.Name(s, ctx)

    if slot is None and n_tok == 1:
        rows: list[str] = [f"{_P}m"]
        where = ast.Assign(targets=[nm(rows[0], ast.Store())],
                           value=ast.Compare(nm(ids), [ast.Eq()], [nm(e)]))
        tok_index: ast.expr = nm(rows[0])
    else:
        rows = [f"{_P}t{j}" for j in range(n_tok)] + ([f"{_P}k"] if slot else [])
        where = ast.Assign(targets=[ast.Tuple([nm(r, ast.Store()) for r in rows], ast.Store())],
                           value=ast.Call(ast.Attribute(nm("torch"), "where", ast.Load()),
                                          [ast.Compare(nm(ids), [ast.Eq()], [nm(e)])], []))
        tok_index = nm(rows[0]) if n_tok == 1 else ast.Tuple([nm(r) for r in rows[:n_tok]], ast.Load())
    expert_call = ast.Call(ast.Subscript(copy.deepcopy(container), nm(e), ast.Load()),
                           [ast.Subscript(nm(tokens), copy.deepcopy(tok_index), ast.Load())], [])
    if inside is not None:
        expert_call.args.append(ast.Subscript(nm(inside), ast.Tuple([nm(r) for r in rows] + [ast.Constant(None)], ast.Load()),
                                              ast.Load()))
    if weights is not None:
        w_col = ast.Subscript(nm(weights), ast.Tuple([nm(r) for r in rows] + [ast.Constant(None)], ast.Load()), ast.Load())
        new_value: ast.expr = ast.BinOp(w_col, ast.Mult(), expert_call)
    else:
        new_value = expert_call
    tgt = ast.Subscript(nm(out), copy.deepcopy(tok_index), ast.Store())
    comb_new = ast.Assign([tgt], new_value) if plain else ast.AugAssign(tgt, ast.Add(), new_value)
    header = ast.Call(nm("range"), [ast.Call(nm("len"), [copy.deepcopy(container)], [])], [])
    first = body[0]
    new = ast.For(target=nm(e, ast.Store()), iter=at(header, loop.iter), body=[at(where, first), at(comb_new, comb)], orelse=[])
    new = ast.copy_location(new, loop)
    new.end_lineno, new.end_col_offset = loop.end_lineno, loop.end_col_offset
    setattr(new, _MARK, True)  # finish_site: this loop called its experts one token at a time
    bounds = [ast.unparse(_range_arg(f.iter)) for f in nest]  # type: ignore[arg-type]
    if unrolled is not None:
        bounds.append(str(unrolled[1]))  # the ids have exactly the K slots written out
    # the loops cover every pair of the ids, and each token index picks one [H] row of the tokens (the where
    # loop's rows): other shapes (per-sample ids over [B, T, H] tokens, a loop over part of the ids) run as written
    guards = [f"(tuple({ids}.shape) == ({', '.join(bounds)},))",
              f"({tokens}.dim() == {n_tok + 1} and tuple({tokens}.shape[:{n_tok}]) == ({', '.join(bounds[:n_tok])},))"]
    guards += zipped[1] if zipped is not None else []
    if listed is not None:
        # s50b: the list the loop appended to is the fresh buffer's rows; with weights the original's rows keep the
        # promoted dtype of `expert(row) * w` (no write into a buffer of the tokens' dtype): same dtypes only
        block = _moe_s50b.list_as_zeros(block, i, out, tokens)
        if weights is not None:
            guards.append(f"({weights}.dtype == {tokens}.dtype)")
    tail = None
    if shared is not None:
        tail = _moe_s50h.shared_tail(m, scope, shared[1], out, tokens, container, tok_vars) if slot and not plain else None
        if tail is None:
            return None
    return block[:i] + [new] + block[i + 1:], i, new, guards, ids, (out if listed is not None else None), tail


def read_as_where_loop(m: Any, scope: Any, block: list, i: int, loop: ast.For) -> Any:
    """The analysis's site of the where loop a per-(token, slot) loop equals, with its run-time guard; False where
    the loop is not this form (the caller reads it as written)."""
    from npufuse.patterns import moe_experts as me  # the analyser (imports this module)

    # the cheap gate: a range loop whose body indexes a container with a subscript (the expert of the pair)
    if not (isinstance(loop.iter, ast.Call) and dotted(loop.iter.func) == "range"):
        return False
    syn = as_where_loop(me, m, scope, block, i, loop)
    if syn is None:
        return False
    if isinstance(syn, str):
        raise me._Miss(syn)
    try:
        site = me._analyze_loop(m, scope, syn[0], syn[1], syn[2])
    except me._Miss as miss:
        # the reason in the reader's words: the synthetic names shortened to what they stand for
        said = str(miss).replace(_P, "")
        raise me._Miss(f"a per-(token, slot) loop, read as the loop over experts with `torch.where({syn[4]} == e)` it "
                       f"equals: {said}") from None
    if site is not None:
        site.option_guards = [*site.option_guards, *(g for g in syn[3] if g not in site.option_guards)]
        if syn[5] is not None:
            site.dense_tail = "\n".join(t for t in (site.dense_tail, _moe_s50b.list_tail(syn[5])) if t)
        if syn[6] is not None:
            site.dense_tail = "\n".join(t for t in (site.dense_tail, syn[6]) if t)  # s50 ho27moe: the shared expert
    return site


def finish_site(an: Any, site: Any, miss: Any) -> None:
    """A synthetic where loop read from a per-token loop: the original called each expert on ONE token's row and the
    fused form calls it on all its rows at once, equal only for an expert that computes each token on its own (an
    MLP read off the class for the grouped matmul, or experts the token-wise reader of s49 shows); otherwise a true
    reason (``miss``). In place; nothing for other loops."""
    from npufuse.patterns import _moe_s49s

    if not getattr(getattr(an, "loop", None), _MARK, False) or site.mlp is None or site.mlp.layout != "opaque":
        return
    if _moe_s49s.tokenwise_experts(an):
        return
    raise miss("the loop calls each expert on one token's row at a time; the fused layer calls it once on all its "
               "rows, equal only for an expert that computes each token on its own, which npufuse does not show "
               f"({site.mlp.why_opaque or 'its class is not read'})")
