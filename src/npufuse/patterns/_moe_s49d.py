"""s49 moe49: sorted dispatch with per-expert gathers of sorted TOKEN IDS (HO25a iavinas moe_layer.py, sweep48moe
GPT-OSS-Lite ``_dispatch_vectorized``; s48 left both: "a reader of sorted token ids per run is a new loop form").

Before the loop: the flat [T*K] expert ids ``flat = idx.reshape(-1)`` of 2-D [T, K] indices are sorted
(``order = flat.argsort()`` / ``_, order = flat.sort()``, stable or not), the token of each flat slot is carried
along (``tok = arange(T).repeat_interleave(K)[order]``, ``arange(T).unsqueeze(1).expand(T, K).reshape(-1)[order]``
or ``order // K``) and so is its weight (``w.reshape(-1)[order]``, ``w`` shaped like ``idx``); the per-expert
counts are ``bincount(flat or the sorted ids, minlength=E)``. The loop runs each expert on its run of the sorted
slots, cut by offsets of the counts:

* a running offset: ``off = 0``; ``for e, n in enumerate(counts): ... tok[off:off + n] ... off += n`` (the slice may
  be bound first, ``sl = slice(off, off + n)``; an empty-expert skip ``if n == 0: [off += n;] continue``);
* host offsets: ``offs = cat([zeros(1), counts.cumsum(0)[:-1]]).tolist()``; ``for e in range(E): start = offs[e];
  end = start + cnt[e] ...`` with ``cnt = counts.tolist()``.

The run of expert e holds exactly the (token, slot) pairs whose id is e (any order within it), so ``tok[run]`` is
``torch.where(idx == e)[0]`` up to order and ``w_sorted[run]`` the weights of the same pairs, and every sum the loop
makes over the run (``index_add_``, ``out[tok] += ...`` with distinct top-k ids) is the where loop's. The loop is
therefore read as that where loop (a synthetic loop on the original's lines, as s23's comprehensions are), which
the analysis fuses as permute -> experts -> unpermute (every pair once, no capacity, probabilities applied by
unpermute). Run-time guards: ``idx`` is 2-D with K columns, ``w`` has its shape. What is computed before the loop
(the sort, the counts and their host copy) stays as written.
"""

from __future__ import annotations

import ast
import copy
from typing import Any, Optional

from npufuse.scan.dataflow import const_value, dotted, fast_walk

TOK = "_npufuse_s49_tok"
SLOT = "_npufuse_s49_slot"


def _name(n: Optional[ast.AST]) -> Optional[str]:
    return n.id if isinstance(n, ast.Name) else None


def _method(node: Optional[ast.AST], attr: str) -> Optional[ast.Call]:
    return node if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr else None


def _gather_of(node: Optional[ast.expr]) -> Optional[tuple[ast.expr, str]]:
    """``(A, order)`` of ``A[order]`` / ``A.index_select(0, order)``."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name):
        return node.value, node.slice.id
    c = _method(node, "index_select")
    if c is not None and len(c.args) == 2 and const_value(c.args[0]) == 0 and isinstance(c.args[1], ast.Name):
        return c.func.value, c.args[1].id  # type: ignore[attr-defined]
    return None


def _token_ids(me: Any, m: Any, scope: Any, node: Optional[ast.expr], line: int) -> Optional[tuple[str, Optional[ast.expr]]]:
    """``(order, K)`` where ``node`` is the token of each flat slot in sort order: the existing reader's
    ``arange(N).repeat_interleave(K)[order]`` / ``order // K``, or ``arange(N).unsqueeze(1).expand(N, K)
    .reshape(-1)[order]`` (K None: read off the expand)."""
    known = me._slot_token_index(m, scope, node, line)
    if known is not None:
        return known
    if isinstance(node, ast.Name):
        node = scope.definition(node.id, line)
    g = _gather_of(node)
    if g is None:
        return None
    base, order = g
    if isinstance(base, ast.Name):
        base = scope.definition(base.id, line)
    flat = _method(base, "reshape") or _method(base, "view")
    if flat is None or [const_value(a) for a in flat.args] != [-1]:
        fl = _method(base, "flatten")
        flat = fl if fl is not None and not fl.args else None
    if flat is None:
        return None
    exp = _method(flat.func.value, "expand")  # type: ignore[attr-defined]
    if exp is None or len(exp.args) != 2 or exp.keywords:
        return None
    uns = _method(exp.func.value, "unsqueeze")  # type: ignore[attr-defined]
    if uns is None or [const_value(a) for a in uns.args] not in ([1], [-1]):
        return None
    ar = uns.func.value  # type: ignore[attr-defined]
    if not (isinstance(ar, ast.Call) and me._canon(m, ar.func) == "torch.arange" and len(ar.args) == 1):
        return None
    if ast.dump(exp.args[0]) != ast.dump(ar.args[0]) and const_value(exp.args[0]) != -1:
        return None
    return order, exp.args[1]


def _flat_weights(me: Any, scope: Any, name: str, order: str, line: int) -> Optional[str]:
    """``W`` where ``name`` is ``W.reshape(-1)[order]`` (the flat weights carried along the sort)."""
    g = _gather_of(scope.definition(name, line))
    if g is None or g[1] != order:
        return None
    base = g[0]
    if isinstance(base, ast.Name):
        base = scope.definition(base.id, line)
    return me._flat_of(base)


def _counts(me: Any, m: Any, scope: Any, node: Optional[ast.expr], flat2d: str, order: str, line: int) -> Optional[ast.expr]:
    """The ``minlength`` of ``bincount(X, minlength=M)`` (``.tolist()`` / ``.cpu()`` copies allowed) where X is the
    flat ids of ``flat2d`` or those ids in sort order; None otherwise."""
    for _ in range(3):
        if isinstance(node, ast.Name):
            node = scope.definition(node.id, line)
        c = _method(node, "tolist") or _method(node, "cpu") or _method(node, "numpy")
        if c is None or c.args:
            break
        node = c.func.value  # type: ignore[attr-defined]
    if isinstance(node, ast.Name):
        node = scope.definition(node.id, line)
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    if me._canon(m, f) == "torch.bincount" and node.args:
        src, rest = node.args[0], node.args[1:]
    elif isinstance(f, ast.Attribute) and f.attr == "bincount":
        src, rest = f.value, node.args
    else:
        return None
    # bincount(x, weights=None, minlength=0): no weights (counts, not sums), the minlength given
    if any(k.arg == "weights" and const_value(k.value) is not None or k.arg not in ("weights", "minlength") for k in node.keywords) \
            or rest and not (isinstance(rest[0], ast.Constant) and rest[0].value is None):
        return None
    minlength = next((k.value for k in node.keywords if k.arg == "minlength"), rest[1] if len(rest) > 1 else None)
    if minlength is None:
        return None
    if isinstance(src, ast.Name):
        s_def = scope.definition(src.id, line)
        if me._flat_of(s_def) == flat2d:
            return minlength
        # the sorted ids: `vals, order = flat.sort()` gives vals = flat.sort()[0]
        if isinstance(s_def, ast.Subscript) and const_value(s_def.slice) == 0 and isinstance(s_def.value, ast.Call) \
                and _method(s_def.value, "sort") is not None and not s_def.value.args and not s_def.value.keywords:
            inner = s_def.value.func.value  # type: ignore[attr-defined]
            if isinstance(inner, ast.Name):
                inner = scope.definition(inner.id, line)
            if me._flat_of(inner) == flat2d and me._sort_order_source(scope, order, line) is not None:
                return minlength
        g = _gather_of(s_def)
        if g is not None and g[1] == order:
            base = scope.definition(g[0].id, line) if isinstance(g[0], ast.Name) else g[0]
            if me._flat_of(base) == flat2d:
                return minlength
    elif me._flat_of(src) == flat2d:
        return minlength
    return None


def _exclusive_cumsum_of(node: Optional[ast.expr], counts: str) -> bool:
    """``cat([zeros(1...), counts.cumsum(0)[:-1]])`` / ``counts.cumsum(0) - counts`` (host copies stripped by the
    caller): the start of each expert's run."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and _name(node.right) == counts:
        c = _method(node.left, "cumsum")
        return c is not None and _name(c.func.value) == counts and [const_value(a) for a in c.args] in ([0], [-1])  # type: ignore[attr-defined]
    if isinstance(node, ast.Call) and (dotted(node.func) or "") in ("torch.cat", "torch.concat", "torch.concatenate") \
            and node.args and isinstance(node.args[0], (ast.List, ast.Tuple)) and len(node.args[0].elts) == 2:
        z, tail = node.args[0].elts
        zc = z if isinstance(z, ast.Call) else None
        if zc is None or (dotted(zc.func) or "").split(".")[-1] not in ("zeros", "zeros_like", "new_zeros") \
                or [const_value(a) for a in zc.args] not in ([1], [(1,)]) and (dotted(zc.func) or "").split(".")[-1] != "new_zeros":
            return False
        if not (isinstance(tail, ast.Subscript) and isinstance(tail.slice, ast.Slice) and tail.slice.lower is None
                and const_value(tail.slice.upper) == -1 and tail.slice.step is None):
            return False
        c = _method(tail.value, "cumsum")
        return c is not None and _name(c.func.value) == counts and [const_value(a) for a in c.args] in ([0], [-1])  # type: ignore[attr-defined]
    return False


def _host(scope: Any, node: Optional[ast.expr], line: int) -> Optional[ast.expr]:
    """The tensor under ``.tolist()`` / ``.cpu()`` / ``.numpy()`` copies of ``node`` (a name followed once)."""
    if isinstance(node, ast.Name):
        node = scope.definition(node.id, line)
    for _ in range(3):
        c = _method(node, "tolist") or _method(node, "cpu") or _method(node, "numpy")
        if c is None or c.args:
            break
        node = c.func.value  # type: ignore[attr-defined]
    return node


class _Reader:
    def __init__(self, me: Any, m: Any, scope: Any, loop: ast.For) -> None:
        self.me, self.m, self.scope, self.loop = me, m, scope, loop
        self.line = loop.lineno
        self.pairs: Optional[tuple[str, str, str, ast.expr]] = None  # (order, flat2d, tokens-sorted name, K)
        self.sorted_w: dict[str, str] = {}  # sorted weights name -> W (2-D)

    def token_slice(self, name: str) -> bool:
        if name in self.sorted_w:
            return False
        got = _token_ids(self.me, self.m, self.scope, ast.Name(name, ast.Load()), self.line)
        if got is None:
            return False
        order, k = got
        src = self.me._sort_order_source(self.scope, order, self.line)
        if src is None:
            return False
        if self.pairs is not None and self.pairs[2] != name:
            return False
        self.pairs = (order, src[0], name, k)  # type: ignore[assignment]
        return True

    def weight_slice(self, name: str) -> bool:
        if self.pairs is None:
            return False
        w = _flat_weights(self.me, self.scope, name, self.pairs[0], self.line)
        if w is None:
            return False
        self.sorted_w[name] = w
        return True


def read_as_where_loop(m: Any, scope: Any, block: list, i: int, loop: ast.For) -> Any:
    """The analysis's site of the where loop this loop equals (see :func:`as_where_loop`), with its run-time
    guards; False where the loop is not this form (the caller reads it as written)."""
    from npufuse.patterns import moe_experts as me  # the analyser (imports this module)

    if "bincount" not in m.source or not any(isinstance(n, ast.Slice) or isinstance(n, ast.Call) and dotted(n.func) == "slice"
                                             for st in loop.body for n in fast_walk(st)):
        return False  # the cheap gates: the counts are a bincount, the runs are cut by slices
    syn = as_where_loop(me, m, scope, block, i, loop)
    if syn is None:
        return False
    if isinstance(syn, str):
        raise me._Miss(syn)
    site = me._analyze_loop(m, scope, syn[0], syn[1], syn[2])
    if site is not None:
        site.option_guards = [*site.option_guards, *(g for g in syn[3] if g not in site.option_guards)]
    return site


def as_where_loop(me: Any, m: Any, scope: Any, block: list, i: int, loop: ast.For) -> Any:
    """``(block', i, loop', guards)``: the loop read as the where loop it equals (see the module doc), with the
    run-time guards the equality needs; None where the loop is not this form; a near-miss reason (str) where it is
    but the equality fails."""
    if loop.orelse or not loop.body:
        return None
    body = list(loop.body)
    it, tgt = loop.iter, loop.target
    # the header: enumerate(counts) with a running offset, or range(E) with host offsets
    running = isinstance(it, ast.Call) and dotted(it.func) == "enumerate" and len(it.args) == 1 and not it.keywords \
        and isinstance(tgt, ast.Tuple) and len(tgt.elts) == 2 and all(isinstance(e, ast.Name) for e in tgt.elts)
    ranged = isinstance(it, ast.Call) and dotted(it.func) == "range" and len(it.args) == 1 and not it.keywords \
        and isinstance(tgt, ast.Name)
    if not (running or ranged):
        return None
    e_var = tgt.elts[0].id if running else tgt.id  # type: ignore[union-attr, attr-defined]
    rd = _Reader(me, m, scope, loop)
    drop: set[int] = set()
    lo: Optional[ast.expr] = None
    hi: Optional[ast.expr] = None
    names: dict[str, ast.expr] = {}  # slice objects bound in the body: `sl = slice(a, b)`
    bound: set[str] = set()  # names of the offset bookkeeping (dropped with their statements)
    if running:
        n_var = tgt.elts[1].id  # type: ignore[union-attr, attr-defined]
        off = None
        # the offset update: the body's last statement `off += n`
        last = body[-1] if body else None
        if not (isinstance(last, ast.AugAssign) and isinstance(last.op, ast.Add) and isinstance(last.target, ast.Name)
                and _name(last.value) == n_var):
            return None
        off = last.target.id
        drop.add(len(body) - 1)
        start = scope.definition(off, loop.lineno)
        if const_value(start) != 0 or isinstance(const_value(start), bool):
            return None
        lo_text = off
        counts_node = it.args[0]  # type: ignore[union-attr]
        bound |= {off, n_var}
    else:
        counts_node = None
        lo_text = ""
        off = n_var = ""
    # statements before the work: skips of empty runs and bookkeeping
    skips: list[str] = []
    for j, st in enumerate(body):
        if j in drop:
            continue
        if isinstance(st, ast.If) and not st.orelse and isinstance(st.body[-1], ast.Continue) \
                and all(isinstance(s, ast.AugAssign) and isinstance(s.target, ast.Name) and s.target.id == off
                        and _name(s.value) == n_var for s in st.body[:-1]):
            t = st.test
            if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], (ast.Eq, ast.LtE))
                    and const_value(t.comparators[0]) == 0 and isinstance(t.left, ast.Name)):
                return None
            drop.add(j)
            skips.append(t.left.id)
            continue
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            v, name = st.value, st.targets[0].id
            if isinstance(v, ast.Call) and dotted(v.func) == "slice" and len(v.args) == 2 and not v.keywords:
                names[name] = v
                drop.add(j)
                bound.add(name)
                continue
            if ranged and isinstance(v, ast.Subscript) and _name(v.slice) == e_var and isinstance(v.value, ast.Name):
                names[name] = v  # start = offs[e] / cnt = counts[e]
                drop.add(j)
                bound.add(name)
                continue
            if ranged and isinstance(v, ast.BinOp) and isinstance(v.op, ast.Add) and isinstance(v.left, ast.Name) \
                    and v.left.id in names and (isinstance(v.right, ast.Name) and v.right.id in names
                                                or isinstance(v.right, ast.Subscript) and _name(v.right.slice) == e_var):
                names[name] = v  # end = start + cnt / start + counts[e]
                drop.add(j)
                bound.add(name)
                continue
    # the run's bounds as written in the slices: [lo:hi] (or a slice object)
    def run_bounds(sl: ast.expr) -> Optional[tuple[ast.expr, ast.expr]]:
        if isinstance(sl, ast.Name) and sl.id in names and isinstance(names[sl.id], ast.Call):
            a, b = names[sl.id].args  # type: ignore[attr-defined]
            return a, b
        if isinstance(sl, ast.Slice) and sl.step is None and sl.lower is not None and sl.upper is not None:
            return sl.lower, sl.upper
        return None

    replaced: list[tuple[ast.Subscript, str]] = []  # (node, "tok" / W)
    for j, st in enumerate(body):
        if j in drop:
            continue
        for node in ast.walk(st):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
                b = run_bounds(node.slice)
                if b is None:
                    continue
                if lo is None:
                    lo, hi = b
                elif ast.dump(b[0]) != ast.dump(lo) or ast.dump(b[1]) != ast.dump(hi):  # type: ignore[arg-type]
                    return None
                if rd.token_slice(node.value.id):
                    replaced.append((node, "tok"))
                elif rd.weight_slice(node.value.id):
                    replaced.append((node, rd.sorted_w[node.value.id]))
                else:
                    return None
    if rd.pairs is None or lo is None or hi is None:
        return None
    order, flat2d, _, k_node = rd.pairs
    # the where loop reads the indices and weights at the loop: the values the sort and the flat weights read
    read_at = {flat2d: me._sort_order_source(scope, order, loop.lineno)[1]}
    for sw, w in rd.sorted_w.items():  # the weights: read where they are sorted (or flattened before)
        at = getattr(scope.definition(sw, loop.lineno), "lineno", loop.lineno)
        read_at[w] = min(read_at.get(w, at), at)
    for name, at in read_at.items():
        if any(at < st.lineno < loop.lineno for st, _ in scope.assignments.get(name, [])):
            return None
    cut = (f"the expert's rows are sorted (token, slot) pairs `{rd.pairs[2]}[{ast.unparse(lo)}:{ast.unparse(hi)}]`, "
           "which npufuse does not read as the expert's whole run of the sort (offsets and counts from a bincount of "
           "the same expert ids): a cut run (a capacity) or other counts would leave pairs out")
    # the bounds are expert e's run
    if running:
        if not (_name(lo) == off and isinstance(hi, ast.BinOp) and isinstance(hi.op, ast.Add)
                and _name(hi.left) == off and _name(hi.right) == n_var):
            return cut
        minlength = _counts(me, m, scope, counts_node, flat2d, order, loop.lineno)
        if minlength is None:
            return cut
    else:
        lo_v = names.get(_name(lo) or "") if isinstance(lo, ast.Name) else lo
        hi_v = names.get(_name(hi) or "") if isinstance(hi, ast.Name) else hi
        if not (isinstance(lo_v, ast.Subscript) and _name(lo_v.slice) == e_var and isinstance(hi_v, ast.BinOp)
                and isinstance(hi_v.op, ast.Add) and _name(hi_v.left) == _name(lo)):
            return cut
        cnt = hi_v.right
        cnt_v = names.get(cnt.id) if isinstance(cnt, ast.Name) else cnt
        if not (isinstance(cnt_v, ast.Subscript) and _name(cnt_v.slice) == e_var and isinstance(cnt_v.value, ast.Name)):
            return cut
        counts_t = _host(scope, cnt_v.value, loop.lineno)
        offs_t = _host(scope, lo_v.value, loop.lineno)
        if isinstance(offs_t, ast.Name):
            offs_t = scope.definition(offs_t.id, loop.lineno)
        counts_name = _name(counts_t)
        if counts_name is None:
            c_expr = counts_t
            counts_name = ""
        else:
            c_expr = scope.definition(counts_name, loop.lineno)
        minlength = _counts(me, m, scope, cnt_v.value, flat2d, order, loop.lineno)
        if minlength is None or not counts_name or not _exclusive_cumsum_of(offs_t, counts_name) or c_expr is None:
            return cut
        if ast.dump(it.args[0]) != ast.dump(minlength):  # type: ignore[union-attr]
            return None  # range(E) over exactly the counted experts
    # a skip tests this expert's count (an empty run: nothing to add), not another condition
    count_var = n_var if running else _name(cnt)
    if any(sk != count_var for sk in skips):
        return None
    bound |= set(skips)
    # nothing else in the body reads the bookkeeping names (the run slices themselves are replaced)
    cut = {id(n) for n, _ in replaced}

    def reads(node: ast.AST) -> bool:
        if id(node) in cut:
            return False
        if isinstance(node, ast.Name) and node.id in bound:
            return True
        return any(reads(c) for c in ast.iter_child_nodes(node))

    if any(reads(st) for j, st in enumerate(body) if j not in drop):
        return None
    # ... nor anything after the loop (the fused path leaves the offset at 0 and binds no bounds)
    late = sorted(name for name in bound if scope.uses_after(name, loop.end_lineno or loop.lineno))
    if late:
        return (f"a sorted dispatch over runs of the sorted (token, slot) pairs, but `{late[0]}` (the runs' bookkeeping) "
                "is read after the loop, where the fused layer would not have advanced it")
    # the synthetic where loop on the original's lines
    def at(node: ast.AST, like: ast.AST) -> ast.AST:
        for n in ast.walk(node):
            if "lineno" in n._attributes and not hasattr(n, "lineno"):
                n.lineno, n.end_lineno = like.lineno, like.end_lineno  # type: ignore[attr-defined]
                n.col_offset, n.end_col_offset = like.col_offset, like.end_col_offset  # type: ignore[attr-defined]
        return node

    first = body[0]
    where = at(ast.Assign(targets=[ast.Tuple([ast.Name(TOK, ast.Store()), ast.Name(SLOT, ast.Store())], ast.Store())],
                          value=ast.Call(ast.Attribute(ast.Name("torch", ast.Load()), "where", ast.Load()),
                                         [ast.Compare(ast.Name(flat2d, ast.Load()), [ast.Eq()], [ast.Name(e_var, ast.Load())])], [])),
               first)
    skip = at(ast.If(test=ast.Compare(ast.Call(ast.Attribute(ast.Name(TOK, ast.Load()), "numel", ast.Load()), [], []),
                                      [ast.Eq()], [ast.Constant(0)]), body=[ast.Continue()], orelse=[]), first)
    swap = {id(n): kind for n, kind in replaced}

    class _Swap(ast.NodeTransformer):
        def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
            kind = swap.get(id(node))
            if kind == "tok":
                return ast.copy_location(ast.Name(TOK, ast.Load()), node)
            if kind is not None:
                return ast.copy_location(ast.Subscript(ast.Name(kind, ast.Load()), ast.Tuple(
                    [ast.Name(TOK, ast.Load()), ast.Name(SLOT, ast.Load())], ast.Load()), ast.Load()), node)
            self.generic_visit(node)
            return node

    kept = []
    for j, st in enumerate(body):
        if j in drop:
            continue
        if any(id(n) in swap for n in ast.walk(st)):
            st = _Swap().visit(_shallow_tree(st, swap))
        kept.append(_in_place_index_add(me, m, scope, block, i, st))
    header = at(ast.Call(ast.Name("range", ast.Load()), [minlength], []), loop.iter)
    new = ast.For(target=ast.Name(e_var, ast.Store()), iter=header, body=[where, *([skip] if skips else []), *kept], orelse=[])
    new = ast.copy_location(new, loop)
    new.end_lineno, new.end_col_offset = loop.end_lineno, loop.end_col_offset
    guards = [f"({flat2d}.dim() == 2 and {flat2d}.shape[-1] == ({ast.unparse(k_node)}))"] if k_node is not None \
        else [f"({flat2d}.dim() == 2)"]
    guards += [f"({w}.shape == {flat2d}.shape)" for w in sorted(set(rd.sorted_w.values()))]
    return block[:i] + [new] + block[i + 1:], i, new, guards


def _shallow_tree(node: ast.AST, keep: dict) -> ast.AST:
    """A copy of ``node`` whose container nodes are new objects but whose leaves (the Subscripts the swap keys on)
    are the originals: NodeTransformer then replaces them in the copy, never in the parsed tree."""
    if id(node) in keep:
        return node
    new = copy.copy(node)
    for field, value in ast.iter_fields(node):
        if isinstance(value, list):
            setattr(new, field, [_shallow_tree(v, keep) if isinstance(v, ast.AST) else v for v in value])
        elif isinstance(value, ast.AST):
            setattr(new, field, _shallow_tree(value, keep))
    return new


_FRESH = ("zeros_like", "zeros", "new_zeros")


def _in_place_index_add(me: Any, m: Any, scope: Any, block: list, i: int, st: ast.stmt) -> ast.stmt:
    """``out = out.index_add(0, t, v)`` as ``out.index_add_(0, t, v)`` where ``out`` is a fresh zeros accumulator
    bound in this block before the loop and read by nothing between (no other handle on it: rebinding and the
    in-place add then leave the same value under ``out``); any other statement as it is."""
    if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)):
        return st
    out = st.targets[0].id
    c = _method(st.value, "index_add")
    if c is None or _name(c.func.value) != out:  # type: ignore[attr-defined]
        return st
    made = next((j for j in range(i - 1, -1, -1) if isinstance(block[j], ast.Assign) and len(block[j].targets) == 1
                 and _name(block[j].targets[0]) == out), None)
    if made is None:
        return st
    v = block[made].value
    f = v.func if isinstance(v, ast.Call) else None
    if not (f is not None and (dotted(f) or "").split(".")[-1] in _FRESH):
        return st
    if any(isinstance(n, ast.Name) and n.id == out for st2 in block[made + 1:i] for n in ast.walk(st2)):
        return st
    call = ast.copy_location(ast.Call(ast.Attribute(ast.Name(out, ast.Load()), "index_add_", ast.Load()), c.args, c.keywords), c)
    return ast.copy_location(ast.Expr(call), st)
