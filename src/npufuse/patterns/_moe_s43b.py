"""moe_experts constructs of the s43 pass b (helper moe43b): recall classes read off real missed sites of the HO19b
development set, and one soundness fix of the s42 review, used by small hooks in :mod:`npufuse.patterns.moe_experts`.

* The dense + routed split loop (``if i < S: <dense> else: <routed>``) keeps the run-time rank facts the routed
  half's reads rest on (``(idx == e).any(dim=1)`` is the top-k axis only for 2-D indices), as the plain loop does;
  facts it does not carry (slot loops, coordinate tuples) keep it a near miss (:func:`split_rank_guards`).
* Zeros allocated before code that never names them, then the loop: the span starts at the loop and adds into the
  zeros (:func:`zeros_kept_until`).
* ``out[rows] = expert(x[rows]) + S[rows]`` with ``S`` made before the loop: the routed part fused, ``S`` added once
  per written row (:func:`precomputed_rows_term`, :func:`rows_term_tail`).
* Experts taking any number of conditioning inputs picked with the rows' index, in mask, flat and sorted-run loops
  (:func:`conditioning_args`, :func:`run_conditioning`).
* Per-expert statistics in the loop body: replayed as written in one more loop after the fused dispatch
  (:func:`split_side_statements`, :func:`side_replay_text`).
"""

from __future__ import annotations

import ast
from typing import Any

from npufuse.patterns import _moe_s42b as _s42b
from npufuse.patterns import _moe_s45b as _s45b
from npufuse.scan.dataflow import fast_walk, segment


def split_needs_unread_facts(ev: Any) -> bool:
    """Whether the routed half of a split loop rests on facts the split path does not turn into guards: a top-k slot
    loop (its column checks) or tokens named by coordinate tuples (the weights' shape check); or a shared term of the
    write-back, whose tail the dense half's replay would replace."""
    return bool(ev.slot_var or ev.slot_guards or ev.token_dims > 1
                or ev.shared_call is not None or ev.s43b_rows_term != ("", ""))  # their tails would be overwritten


def split_rank_guards(ev: Any) -> list[str]:
    """The routed half's run-time rank facts as the site's guards (the plain loop's form: parenthesised)."""
    return [f"({g})" for g in ev.rank_guards]


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in fast_walk(node) if isinstance(n, ast.Name)}


def zeros_kept_until(module: Any, scope: Any, block: list[ast.stmt], alloc: ast.stmt, start: int, acc: str) -> bool:
    """Whether ``acc`` is made as zeros by ``alloc`` (``torch.zeros(...)`` / ``zeros_like`` / ``new_zeros``, not
    ``empty``) and still holds them at ``block[start]``: no statement in between names ``acc`` at all (no read, write,
    alias or rebinding), so nothing can reach the fresh tensor. A span starting at ``block[start]`` that adds into
    ``acc`` then computes what the loop's writes into the fresh zeros compute (the statements in between, e.g. a
    shared expert or an auxiliary loss, run before the span in both branches, in their own order)."""
    try:
        first = block.index(alloc)
    except ValueError:
        return False
    if first >= start or not _s42b.made_as_zeros(module, scope, acc, block[start].lineno):
        return False
    if scope.definition(acc, block[start].lineno) is not getattr(alloc, "value", None):
        return False
    # (s45b: reads of its dtype / device / shape only do not reach its values)
    return not any(acc in _names(st) and not _s45b.metadata_reads_only(st, acc) for st in block[first + 1 : start])


def precomputed_rows_term(target: ast.Subscript, value: ast.expr, loop: ast.For) -> tuple[ast.expr, str] | None:
    """(the routed part, ``S``) of a write-back ``out[rows] = <routed> + S[rows]`` (or ``+=``): one term of the sum
    is a tensor ``S`` made before the loop (a name the loop never binds, not ``out`` itself) read at the target's very
    index -- a shared expert's output computed once on all tokens, a residual -- the other terms are the routed part.
    None for anything else (``S`` at another index, several such terms, no routed part)."""
    terms = _s42b._add_operands(value)
    if len(terms) < 2 or not isinstance(target.value, ast.Name):
        return None
    bound = {n.id for n in fast_walk(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if isinstance(loop.target, ast.Name):
        bound.add(loop.target.id)
    index = ast.dump(target.slice)
    picks = [t for t in terms if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
             and t.value.id not in bound and t.value.id != target.value.id and ast.dump(t.slice) == index]
    if len(picks) != 1:
        return None
    return _s42b.sum_without(terms, picks[0]), picks[0].value.id  # type: ignore[union-attr]


def shared_names_only_as_rows_terms(loop: ast.For) -> bool:
    """Every name in the loop that says shared is the ``S`` of a :func:`precomputed_rows_term` of a write-back (a
    shared expert's output made before the loop, added to the rows; not mixed into the experts' input)."""
    allowed: set[int] = set()
    for n in fast_walk(loop):
        target = n.targets[0] if isinstance(n, ast.Assign) and len(n.targets) == 1 else (
            n.target if isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Add) else None)
        if isinstance(target, ast.Subscript):
            split = precomputed_rows_term(target, n.value, loop)  # type: ignore[union-attr]
            if split is not None:
                allowed.update(id(m) for m in fast_walk(n.value) if isinstance(m, ast.Name) and m.id == split[1])
    return bool(allowed) and all(id(n) in allowed for n in fast_walk(loop) if (
        isinstance(n, ast.Name) and "shared" in n.id.lower() or isinstance(n, ast.Attribute) and "shared" in n.attr.lower()))


def rows_term_tail(site: Any, shared: str, mode: str, plain_mask_loop: bool) -> tuple[str, str]:
    """(fused text, "") adding ``shared`` (:func:`precomputed_rows_term`) after the routed part, or ("", the reason it
    cannot). ``assign`` of flat expert ids (each row written by the one expert of its id): ``shared`` once per row;
    ``accumulate`` of [T, K] top-k masks over every expert's own index: once per routed (token, slot), K times."""
    out, ids = site.out_name, site.indices
    # s44 review: only ids that name an expert of the loop write a row (a token routed to a dropped / null id
    # ``E`` -- argmax over E + 1 logits, a sentinel -- is never written, so it gets no S either)
    routed = f"(({ids} >= 0) & ({ids} < {site.bins}))"
    if mode == "assign" and site.routing == "flat_mask" and not site.local_start and site.bins:
        return (f"# `+ {shared}[rows]` of the write-back: each row whose id names an expert is written by exactly that one\n"
                f"{out}.add_(torch.where({routed}.reshape(*{shared}.shape[:-1], 1), {shared}, 0).to({out}.dtype))"), ""
    if mode == "accumulate" and site.routing == "mask_where" and plain_mask_loop and site.bins:
        return (f"# `+ {shared}[rows]` of the write-back: added once per routed (token, slot), i.e. once per top-k id that\n"
                f"# names an expert\n{out}.add_(({routed}.sum(-1, keepdim=True) * {shared}).to({out}.dtype))"), ""
    return "", (f"the write-back adds `{shared}[rows]`, made before the loop, once per expert a token is routed to, which "
                "npufuse replays only for flat expert ids written once or for mask routing over every expert's own index")


def conditioning_args(call: ast.Call, kinds: list[str], loop: ast.For) -> tuple[str, ...] | None:
    """The conditioning tensors of an expert call ``expert(x[sel], c[sel], g[sel], ...)``: every argument after the
    rows is a row pick of a tensor the loop does not bind, with the rows' very index (:func:`conditioning_rows` of
    s42b), all different. None for keywords, starred or other arguments (rows picked otherwise, routing weights)."""
    if call.keywords or len(call.args) < 2 or any(k != "x" for k in kinds) or len(kinds) != len(call.args):
        return None
    conds = [_s42b.conditioning_rows(call.args[0], a, loop) for a in call.args[1:]]
    if any(c is None for c in conds) or len(set(conds)) != len(conds):
        return None
    return tuple(conds)  # type: ignore[arg-type]


def more_conditioning_lines(conds: tuple[str, ...], tokens: str, prefix: str) -> list[str]:
    """Lines putting the conditioning tensors after the first in the permuted order, with the first one's ``src``
    (:func:`_moe_s42b.conditioning_permute_lines` made it)."""
    p = prefix
    return [f"{p}cond{j} = {c}.reshape({p}nrows, *{c}.shape[{tokens}.dim() - 1:])[{p}src]" for j, c in enumerate(conds, 1)]


def more_conditioning_args(conds: tuple[str, ...], prefix: str) -> str:
    """``, <p>cond1_e, <p>cond2_e``: one expert's slices of the conditioning tensors after the first."""
    return "".join(f", {prefix}cond{j}_e" for j in range(1, len(conds) + 1))


def conditioning_zip_head(rows: str, conds: tuple[str, ...], prefix: str) -> str:
    """The per-expert loop header over the experts, their row slices and every conditioning tensor's slices."""
    p = prefix
    names = "".join(f", {p}cond{j}_e" for j in range(1, len(conds) + 1))
    splits = "".join(f", {p}cond{j}.split({p}sizes)" for j in range(1, len(conds) + 1))
    return f"for {p}expert, {rows}, {p}cond_e{names} in zip({p}experts, {p}x.split({p}sizes), {p}cond.split({p}sizes){splits}):"


def run_conditioning(runs: Any, args: list[ast.expr]) -> bool:
    """For an expert call over one sorted run, ``expert(x[t], c[t], g[t])`` (through names bound in the loop): whether
    every argument after the rows is another loop-invariant tensor's rows at the run's tokens (recorded on ``runs``,
    in order, the same tensors on every call); no arguments after the rows is the plain call."""
    conds = []
    for a in args:
        v = runs.ev(a)
        if v[0] != "cond" or isinstance(a, ast.Starred):
            return False
        conds.append(v[1])
    dumps = [ast.dump(c) for c in conds]
    if len(set(dumps)) != len(dumps) or runs.x is not None and ast.dump(runs.x) in dumps:
        return False
    if runs.conds and [ast.dump(c) for c in runs.conds] != dumps:
        return False
    runs.conds = conds
    return True


def run_conditioning_guard(module: Any, conds: list[ast.expr], x: str) -> str:
    """`` and c.shape[0] == x.shape[0] ...``: one conditioning row per token row (the run's token ids index both)."""
    return "".join(f" and {segment(module, c)}.shape[0] == {x}.shape[0]" for c in conds)


def run_conditioning_lines(module: Any, conds: list[ast.expr], k: str, prefix: str) -> list[str]:
    """Fused lines (4 spaces in) putting each conditioning tensor's rows in the permuted order: permuted row
    ``order[i]`` holds the copy ``i`` of token ``i // k`` (``npu_moe_token_permute`` of ``[T, k]`` ids)."""
    if not conds:
        return []
    p = prefix
    lines = [f"    {p}src = torch.empty_like({p}order, dtype=torch.int64)",
             f"    {p}src[{p}order.long()] = torch.arange({p}order.numel(), device={p}order.device) // ({k})"]
    lines += [f"    {p}cond{j} = {segment(module, c)}[{p}src]" for j, c in enumerate(conds, 1)]
    return lines


def run_conditioning_splits(n: int, prefix: str) -> str:
    """``, <p>cond1.split(<p>sizes), ...``: the conditioning tensors' per-expert slices."""
    return "".join(f", {prefix}cond{j}.split({prefix}sizes)" for j in range(1, n + 1))


# --- side statements of an expert loop, replayed as written after the fused dispatch --------------------------------

_RANDOM_WORDS = ("rand", "dropout", "bernoulli", "multinomial", "poisson", "normal_", "uniform_", "exponential_",
                 "geometric_", "cauchy_", "log_normal_", "random_", "sample", "shuffle", "perm")


def _bound(st: ast.stmt) -> set[str]:
    return {n.id for n in fast_walk(st) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _read(st: ast.stmt) -> set[str]:
    return {n.id for n in fast_walk(st) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _runs_an_expert(st: ast.stmt, items: set[str]) -> bool:
    """The statement names the loop's expert item or calls a module: ``self.<...>(...)``, ``<container>[e](...)``, a
    call of the item. Statements that do not may only compute with tensors and functions (replayable as written)."""
    for n in fast_walk(st):
        if isinstance(n, ast.Name) and n.id in items:
            return True
        if isinstance(n, ast.Call):
            f = n.func
            while isinstance(f, ast.Attribute):
                f = f.value
            if isinstance(n.func, ast.Subscript) or isinstance(f, ast.Name) and f.id == "self":
                return True
    return False


def _draws_random(st: ast.stmt) -> bool:
    for n in fast_walk(st):
        if isinstance(n, ast.Call):
            name = (ast.unparse(n.func) if isinstance(n.func, (ast.Name, ast.Attribute)) else "").lower()
            if any(w in name.rsplit(".", 1)[-1] for w in _RANDOM_WORDS):
                return True
    return False


# builtins a statistic may call: they read their arguments and change nothing
_PURE_BUILTINS = frozenset(("len", "int", "float", "bool", "abs", "round", "min", "max", "sum", "str", "range", "enumerate", "zip",
                            "isinstance", "tuple", "list", "dict", "sorted", "any", "all"))
_PURE_HOMES = ("torch.", "math.", "numpy.", "np.")


def _calls_opaque_function(module: Any, st: ast.stmt) -> bool:
    """(s43 review) The statement calls a function npufuse cannot show leaves its arguments alone: one of this file or
    of another module (``shrink_(x, rows)`` may scale the tokens in place, so replaying it after the dispatch would let
    the experts read rows the original had already changed). Builtins above, torch / math / numpy functions (not
    in-place ``*_``) and methods of values (their in-place forms are :func:`_mutated_roots`') are fine."""
    for n in fast_walk(st):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        head = f
        while isinstance(head, ast.Attribute):
            head = head.value
        if not isinstance(head, ast.Name):
            continue
        if head.id in module.aliases or head.id in (getattr(module, "assigned_aliases", None) or {}):
            # a function reached through an import: pure only from torch / math / numpy, and not an in-place one
            canon = module.canonical(f) or ""
            if not canon.startswith(_PURE_HOMES) or canon.rsplit(".", 1)[-1].endswith("_"):
                return True
        elif f is head and f.id not in _PURE_BUILTINS:
            return True  # a function of this file (or a name bound otherwise)
    return False


def _skip_guard(st: ast.stmt) -> bool:
    """``if <test>: continue`` (nothing else): the loop's skip of an expert, kept in both loops."""
    return isinstance(st, ast.If) and not st.orelse and all(isinstance(b, ast.Continue) for b in st.body)


_MUTATORS = ("append", "extend", "insert", "update", "add", "setdefault", "pop", "clear", "remove")
_FACTORIES = ("torch.zeros", "torch.ones", "torch.empty", "torch.full", "torch.zeros_like", "torch.ones_like",
              "torch.empty_like", "torch.full_like", "torch.tensor", "torch.arange")
_SAME_OR_COPY = ("to", "float", "double", "half", "bfloat16", "long", "int", "cuda", "cpu", "clone")


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _mutated_roots(st: ast.stmt) -> set[str]:
    """Names whose object the statement changes in place: subscript / attribute stores, ``t += v`` (in place for a
    tensor), in-place methods (``t.add_(v)``) and container mutators (``l.append(v)``)."""
    roots: set[str | None] = set()
    for n in fast_walk(st):
        if isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.ctx, ast.Store):
            roots.add(_root(n))
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
            roots.add(n.target.id)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and (
                n.func.attr.endswith("_") and not n.func.attr.startswith("_") or n.func.attr in _MUTATORS):
            roots.add(_root(n.func.value))
    return {r for r in roots if r is not None} | ({"?"} if None in roots else set())


def _fresh(module: Any, scope: Any, name: str, line: int) -> bool:
    """``name`` holds storage of its own, made before ``line`` in this function: a tensor factory (zeros, ones,
    empty, full, their ``_like`` / ``new_*`` forms, ``torch.tensor``) optionally moved or cast, a literal list /
    dict or a number; not an argument, a view or another tensor's alias."""
    node = scope.definition(name, line)
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SAME_OR_COPY:
        node = node.func.value
    if isinstance(node, (ast.List, ast.Dict, ast.ListComp, ast.DictComp)):
        return True
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return True  # `aux = 0.0`: the first `aux += t` makes a new tensor nothing else holds
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and isinstance(node.left, ast.List):
        return True
    return isinstance(node, ast.Call) and ((module.canonical(node.func) or "") in _FACTORIES or (
        isinstance(node.func, ast.Attribute) and node.func.attr.startswith("new_")))


def split_side_statements(module: Any, scope: Any, loop: ast.For) -> tuple[list[ast.stmt], list[ast.stmt]] | None:
    """(the dispatch's statements, the replay loop's statements) of an expert loop whose body also keeps per-expert
    statistics (``load[e] += ...``, ``assignment[e][rows] += 1``, a load estimate from the logits); None when there
    is no such split.

    The dispatch is every statement that runs an expert (names the loop's item, calls a module) and everything that
    reads what those bind, plus the statements binding what they read (the routing). The side statements are the
    rest: they read no name the dispatch binds except the routing's (replayed before them), bind no name the dispatch
    reads, name no output the dispatch writes, and draw no random numbers and leave the loop nowhere (no break /
    continue / return / yield): so running the dispatch for every expert first and then the side statements for every
    expert, with the routing and the skip guards, computes what the loop computes."""
    if loop.orelse or not isinstance(loop.target, (ast.Name, ast.Tuple)):
        return None
    targets = [loop.target] if isinstance(loop.target, ast.Name) else list(loop.target.elts)
    if not all(isinstance(t, ast.Name) for t in targets):
        return None
    items = {t.id for t in targets[1:]}  # type: ignore[attr-defined]  # enumerate(experts): the item; range(E): none
    body = loop.body
    guards = [st for st in body if _skip_guard(st)]
    rest = [st for st in body if not _skip_guard(st)]
    dispatch = {id(st) for st in rest if _runs_an_expert(st, items)}
    if not dispatch or len(dispatch) == len(rest):
        return None
    changed = True
    while changed:  # forward: what reads the dispatch's names is dispatch
        changed = False
        made = set().union(*(_bound(st) for st in rest if id(st) in dispatch))
        for st in rest:
            if id(st) not in dispatch and _read(st) & made:
                dispatch.add(id(st))
                changed = True
    routing: set[int] = set()
    changed = True
    while changed:  # backward: what binds the names the dispatch (or routing) reads is routing
        changed = False
        needed = set().union(*(_read(st) for st in rest if id(st) in dispatch | routing))
        for st in rest:
            if id(st) not in dispatch | routing and _bound(st) & needed:
                routing.add(id(st))
                changed = True
    side = [st for st in rest if id(st) not in dispatch | routing]
    if not side:
        return None
    d_stmts = [st for st in rest if id(st) in dispatch]
    d_bound = set().union(*(_bound(st) for st in d_stmts))
    d_names = d_bound | set().union(*(_read(st) for st in d_stmts if id(st) in dispatch))
    r_stmts = [st for st in rest if id(st) in routing]
    for st in r_stmts:  # run twice (in the dispatch and in the replay): plain bindings only
        if not isinstance(st, ast.Assign) or any(isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.ctx, ast.Store)
                                                 or isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                                                 and n.func.attr.endswith("_") for n in fast_walk(st)):
            return None
    index = targets[0].id  # type: ignore[attr-defined]
    for st in side:
        if any(isinstance(n, ast.Subscript) and _root(n) == "self" and index in _read(n) for n in fast_walk(st)):
            return None  # `self.U[i][e]`: a per-expert weight read, an expert's computation rather than a statistic
    for st in side + r_stmts:
        if _runs_an_expert(st, items) or _draws_random(st) or _calls_opaque_function(module, st) or any(
                isinstance(n, (ast.Break, ast.Continue, ast.Return, ast.Yield, ast.YieldFrom, ast.Await)) for n in fast_walk(st)):
            return None
    written = {t.value.id for st in d_stmts for n in fast_walk(st) for t in [n] if isinstance(t, ast.Subscript)
               and isinstance(t.ctx, ast.Store) and isinstance(t.value, ast.Name)}
    written |= {n.func.value.id for st in d_stmts for n in fast_walk(st) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) and n.func.attr.endswith("_")}
    r_names = set().union(*(_read(st) | _bound(st) for st in r_stmts)) if r_stmts else set()
    for st in side:
        if (_bound(st) | _read(st)) & (written | d_bound) or _bound(st) & d_names:
            return None
        for root in _mutated_roots(st):
            # what a side statement changes in place must be its own: fresh storage made before the loop (or a
            # module attribute) that the dispatch never reads, so no later expert sees the change
            if root in d_names | r_names or root != "self" and not _fresh(module, scope, root, loop.lineno):
                return None
        if any(k.arg == "out" for n in fast_walk(st) if isinstance(n, ast.Call) for k in n.keywords):
            return None
    self_attrs = {ast.unparse(n) for st in d_stmts + r_stmts for n in fast_walk(st) if isinstance(n, ast.Attribute)}
    if any(ast.unparse(n) in self_attrs for st in side for n in fast_walk(st)
           if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)):
        return None
    for st in guards:
        if _read(st) & set().union(*(_bound(s) for s in side)):
            return None
    keep = {id(st) for st in d_stmts + r_stmts + guards}
    replay = {id(st) for st in r_stmts + guards + side}
    return [st for st in body if id(st) in keep], [st for st in body if id(st) in replay]


def _as_written(module: Any, st: ast.stmt) -> list[str]:
    """The statement's own source lines, dedented to column 0 (the user's text, not the canonicalised tree's); its
    unparsed form where the lines are not its alone (``a = 1; b = 2``), hold non-ASCII text (byte columns) or a
    multi-line string (dedenting would change it)."""
    lines = [ln.rstrip("\r\n") for ln in module.lines[st.lineno - 1 : st.end_lineno]]  # type: ignore[misc]
    col = st.col_offset
    tail = lines[-1][st.end_col_offset:].strip() if lines else "x"  # type: ignore[index]
    multi_str = any(isinstance(n, ast.Constant) and isinstance(n.value, str) and n.end_lineno != n.lineno for n in fast_walk(st))
    if not lines or not all(ln.isascii() for ln in lines) or lines[0][:col].strip() or tail and not tail.startswith("#") or multi_str:
        return ast.unparse(st).splitlines()
    return [ln[col:] if ln[:col].strip() == "" else ln.lstrip() for ln in lines]


def replayed_names(loop: ast.For, replay: list[ast.stmt]) -> set[str]:
    """Names the side-statement replay binds (its loop's variables and what its statements bind): after it they hold
    what the loop left in them, so reading them after the span is fine."""
    if not replay:
        return set()
    return _bound(ast.Module(body=[ast.Assign(targets=[loop.target], value=ast.Constant(0)), *replay], type_ignores=[]))


def _plain_binding(st: ast.stmt) -> bool:
    """An assignment that changes nothing in place (no subscript / attribute store, no in-place method): running it
    once more rebinds the same names to the same values."""
    return isinstance(st, (ast.Assign, ast.AnnAssign)) and not any(
        isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.ctx, ast.Store)
        or isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and (n.func.attr.endswith("_") or n.func.attr in _MUTATORS)
        for n in fast_walk(st))


def side_replay_text(module: Any, loop: ast.For, replay: list[ast.stmt], span_before: list[ast.stmt]) -> tuple[str, str]:
    """(the loop's side statements, with its routing and skip guards, as one more loop after the fused dispatch, in
    the user's own text; "") or ("", why not). ``span_before``: the statements before the loop the fused text replaces
    (the mask, the hit list): those the replay reads are replayed first, when they are plain bindings."""
    needed = _read(ast.Module(body=[ast.Expr(loop.iter), *replay], type_ignores=[]))
    prefix: list[ast.stmt] = []
    for st in reversed(span_before):
        names = _bound(st)
        if names & needed:
            if not _plain_binding(st):
                return "", (f"the loop's other statements read `{sorted(names & needed)[0]}`, bound at line {st.lineno} by a "
                            "statement the fused text replaces, not a plain assignment it can replay")
            prefix.insert(0, st)
            needed |= _read(st)
    head = f"for {segment(module, loop.target)} in {segment(module, loop.iter)}:"
    body = ["    " + ln if ln else ln for st in replay for ln in _as_written(module, st)]
    return "\n".join(["# the loop's other statements (per-expert statistics), replayed as written without the experts",
                      *(ln for st in prefix for ln in _as_written(module, st)), head, *body]), ""


# --- s43b examples: invented code in the shapes of the real HO19b sites (and the s42 review's split loop) ----------

from npufuse.patterns._moe_s42b import _HEAD, _moe, _run  # noqa: E402  (the s42b FF / MoE scaffolding)
from npufuse.patterns.base import Fuse, Keep  # noqa: E402

# A. dense experts first, routed ones after (`if i < S`), the routed tokens as `.any(dim=1)` of [T, K] indices
_SPLIT_ANY = _HEAD + '''

class SplitMoE(nn.Module):
    def __init__(self, d, h, n, n_dense, k):
        super().__init__()
        self.experts = nn.ModuleList([FF(d, h) for _ in range(n)])
        self.n_dense = n_dense
        self.gate = nn.Linear(d, n - n_dense, bias=False)
        self.k = k

    def forward(self, x):
        gates = F.softmax(self.gate(x), dim=-1)
        top_g, top_i = torch.topk(gates, self.k, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            if i < self.n_dense:
                out += expert(x)
            else:
                mask = (top_i == i - self.n_dense).any(dim=1)
                out[mask] += expert(x[mask]) * gates[mask, i - self.n_dense].unsqueeze(1)
        return out
'''
_SPLIT_RUN = ("m = SplitMoE(16, 24, 6, 2, 2)\nx = torch.randn(9, 16, requires_grad=True)\nout = m(x)\n"
              "leaves = [x, m.gate.weight, m.experts[0].w1.weight, m.experts[4].w2.weight]\n")

# B + C. top-1 argmax routing, a shared expert's output computed before the loop (between the allocation and the
# loop, beside an auxiliary loss) and added to each expert's rows inside it (ziadTeama-dev moe-image-captioning)
_TOP1_SHARED_ROWS = _HEAD + '''

class Top1Shared(nn.Module):
    def __init__(self, d, h, n):
        super().__init__()
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)) for _ in range(n)])
        self.shared = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))

    def forward(self, x, logits):
        top1 = torch.argmax(logits, dim=-1)
        out = torch.zeros_like(x)
        balance = logits.softmax(-1).mean(dim=(0, 1)).var()
        shared_out = self.shared(x)
        for i, expert in enumerate(self.experts):
            m = top1 == i
            if m.any():
                out[m] = expert(x[m]) + shared_out[m]
        return out, balance
'''
_TOP1_RUN = ("m = Top1Shared(16, 24, 4)\nx = torch.randn(2, 5, 16, requires_grad=True)\n"
             "logits = torch.randn(2, 5, 4)\nout = m(x, logits)\nleaves = [x, m.experts[1][0].weight, m.shared[2].weight]\n")

# C. a residual of the tokens made before the loop, added at each routed (token, slot) of top-k routing
_TOPK_ROWS_TERM = _moe('''\
        topk_w, topk_i = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        base = self.shared_expert(x) * 0.5
        out = torch.zeros_like(x)
        for e in range(self.n):
            tok, slot = torch.where(topk_i == e)
            out[tok] += topk_w[tok, slot].unsqueeze(-1) * self.experts[e](x[tok]) + base[tok]
        return out
''')

# D. experts conditioned on two per-token tensors; DeepSeek's training form: every token repeated top-k times, each
# repeated row written by its expert, weighted and summed after the loop (ankitaawasthi-17 Diff-MoE-DiT)
_COND3_EXPERT = '''

class CondExpert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.mod = nn.Linear(d, 2 * d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x, c, g):
        scale, shift = self.mod(c).chunk(2, dim=-1)
        return self.fc2(F.silu(self.fc1(x * (1 + scale) + shift)) * g)


class CondMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.n, self.k = n, k
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([CondExpert(d, h) for _ in range(n)])
'''
_COND3_FLAT = _HEAD + _COND3_EXPERT + '''
    def forward(self, x, c, g):
        w, idx = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        flat = idx.view(-1)
        xr = x.repeat_interleave(self.k, dim=0)
        cr = c.repeat_interleave(self.k, dim=0)
        gr = g.repeat_interleave(self.k, dim=0)
        y = torch.empty_like(xr)
        for i, expert in enumerate(self.experts):
            mask = flat == i
            if mask.sum() == 0:
                continue
            y[mask] = expert(xr[mask], cr[mask], gr[mask]).to(y.dtype)
        return (y.view(*w.shape, -1) * w.unsqueeze(-1)).sum(dim=1)
'''
_COND3_WHERE = _HEAD + _COND3_EXPERT + '''
    def forward(self, x, c, g):
        w, idx = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.n):
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, w[tok, slot, None] * self.experts[e](x[tok], c[tok], g[tok]))
        return out
'''
# E. DeepSeek's moe_infer (runs of argsort-sorted ids between cumulative ends) whose experts take c and g rows too
_COND3_RUNS = _HEAD + _COND3_EXPERT + '''
    @torch.no_grad()
    def forward(self, x, c, g):
        w, idx = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        flat_ids, flat_w = idx.view(-1), w.view(-1, 1)
        cache = torch.zeros_like(x)
        order = flat_ids.argsort()
        ends = flat_ids.bincount().cpu().numpy().cumsum(0)
        token_idxs = order // self.k
        for i, end in enumerate(ends):
            start = 0 if i == 0 else ends[i - 1]
            if start == end:
                continue
            t = token_idxs[start:end]
            out = self.experts[i](x[t], c[t], g[t])
            out.mul_(flat_w[order[start:end]])
            cache.scatter_reduce_(0, t.view(-1, 1).repeat(1, x.shape[-1]), out, reduce="sum")
        return cache
'''
_COND3_RUN = ("m = CondMoE(16, 24, 4, 2)\nx = torch.randn(9, 16, requires_grad=True)\nc = torch.randn(9, 16, requires_grad=True)\n"
              "g = torch.randn(9, 24, requires_grad=True)\nout = m(x, c, g)\n"
              "leaves = [x, c, g, m.gate.weight, m.experts[1].mod.weight, m.experts[3].fc2.weight]\n")
_COND3_RUNS_RUN = ("m = CondMoE(16, 24, 4, 2)\nx = torch.randn(9, 16)\nc = torch.randn(9, 16)\n"
                   "g = torch.randn(9, 24)\nout = m(x, c, g)\n")

# F. per-expert statistics kept in the same loop: an assignment matrix, sample counts and a load estimate from the
# logits (nenuadrian Mixture-of-Expert-Graph-Transformer's MoeveForward)
_SIDE_STATS = _moe('''\
        logits = self.gate(x)
        topk_w, topk_i = torch.topk(logits, self.k)
        topk_w = F.softmax(topk_w, dim=1, dtype=torch.float)
        out = torch.zeros_like(x)
        loads = torch.zeros(self.n, device=x.device)
        counts = torch.zeros(self.n, device=x.device)
        assigned = torch.zeros(self.n, x.shape[0], device=x.device)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(topk_i == e)
            out[rows] += topk_w[rows, slot, None] * expert(x[rows])
            assigned[e][rows] += 1
            others = torch.cat([logits[:, :e], logits[:, e + 1:]], dim=1)
            kth = torch.topk(others, self.k, dim=1)[0][:, self.k - 1]
            loads[e] += torch.sigmoid(logits[:, e] - kth).sum()
            counts[e] += len(rows)
        return out, loads, counts, assigned
''')

# F. a load-balancing term summed in the same loop from the routing alone, read after it
_SIDE_AUX = _moe('''\
        probs = F.softmax(self.gate(x), dim=-1)
        topk_w, topk_i = torch.topk(probs, self.k, dim=-1)
        out = torch.zeros_like(x)
        aux = 0.0
        for e in range(self.n):
            tok, slot = torch.where(topk_i == e)
            aux += probs[:, e].mean() * tok.numel() / x.shape[0]
            out.index_add_(0, tok, topk_w[tok, slot, None] * self.experts[e](x[tok]))
        return out, aux * self.n
''')

FUSE_EXAMPLES = [
    Fuse(_SPLIT_ANY, name="s43b_split_loop_keeps_the_rank_guard_of_any_dim_one", run=_SPLIT_RUN,
         expect={"routing": "mask_where", "indices": "top_i", "output": "out"}),
    Fuse(_SPLIT_ANY.replace("(top_i == i - self.n_dense).any(dim=1)", "torch.any(top_i == i - self.n_dense, 1)"),
         name="s43b_split_loop_function_form_any_dim_one", run=_SPLIT_RUN,
         expect={"routing": "mask_where", "indices": "top_i", "output": "out"}),
    Fuse(_TOP1_SHARED_ROWS, name="s43b_top1_shared_output_rows_added_in_write_back", run=_TOP1_RUN,
         expect={"routing": "flat_mask", "indices": "top1", "tokens": "x", "output": "out"}),
    Fuse(_TOPK_ROWS_TERM, name="s43b_topk_precomputed_rows_added_per_slot", run=_run("9, 16"),
         expect={"routing": "mask_where", "indices": "topk_i", "probs": "topk_w", "output": "out"}),
    Fuse(_COND3_FLAT, name="s43b_three_input_experts_flat_repeated_rows", run=_COND3_RUN,
         expect={"routing": "flat_mask", "indices": "flat", "tokens": "xr", "output": "y"}),
    Fuse(_COND3_WHERE, name="s43b_three_input_experts_where_pairs", run=_COND3_RUN,
         expect={"routing": "mask_where", "indices": "idx", "probs": "w", "tokens": "x", "output": "out"}),
    Fuse(_COND3_RUNS, name="s43b_three_input_experts_sorted_cumulative_runs", run=_COND3_RUNS_RUN,
         expect={"routing": "sorted_cumulative_ends", "indices": "flat_ids", "tokens": "x", "output": "cache"}),
    Fuse(_SIDE_STATS, name="s43b_side_statistics_replayed_after_the_dispatch", run=_run("9, 16"),
         expect={"routing": "mask_where", "indices": "topk_i", "probs": "topk_w", "output": "out"}),
    Fuse(_SIDE_AUX, name="s43b_side_load_balancing_sum_read_after_the_loop", run=_run("9, 16"),
         expect={"routing": "mask_where", "indices": "topk_i", "probs": "topk_w", "output": "out"}),
]

KEEP_EXAMPLES = [
    # the balancing sum goes into a tensor handed in by the caller: changed in place, it may be anything the caller holds
    Keep(_SIDE_AUX.replace("    def forward(self, x):", "    def forward(self, x, aux):").replace("        aux = 0.0\n", ""),
         reason="unrecognised update in the expert loop", name="s43b_side_sum_into_a_tensor_handed_in"),
    # the routed half's tokens: any over the tokens (dim 0), not over the top-k slots
    Keep(_SPLIT_ANY.replace("(top_i == i - self.n_dense).any(dim=1)", "(top_i == i - self.n_dense).any(dim=0)"),
         reason="unrecognised update in the expert loop", name="s43b_split_loop_any_over_tokens"),
    # the statement between the zeros and the loop reads the accumulator (a view of it): not independent of it
    Keep(_TOP1_SHARED_ROWS.replace("        balance = logits.softmax(-1).mean(dim=(0, 1)).var()\n",
                                   "        flat_out = out.view(-1, out.shape[-1])\n        balance = logits.softmax(-1).mean(dim=(0, 1)).var()\n"),
         reason="sits between that allocation and the loop", name="s43b_statement_between_reads_the_accumulator"),
    # an empty buffer before the other statements: its rows are not zeros to add into
    Keep(_TOP1_SHARED_ROWS.replace("out = torch.zeros_like(x)", "out = torch.empty_like(x)"),
         reason="sits between that allocation and the loop", name="s43b_empty_buffer_before_other_statements"),
    # the shared rows read at another index than the written rows (those of expert 0's tokens)
    Keep(_TOP1_SHARED_ROWS.replace("+ shared_out[m]", "+ shared_out[top1 == 0]"),
         reason="a shared expert is mixed into the tokens", name="s43b_shared_rows_at_another_index"),
    # the precomputed rows added over experts 1.. only: tokens of expert 0 would get them K times in the fused text
    Keep(_TOPK_ROWS_TERM.replace("for e in range(self.n):", "for e in range(1, self.n):"),
         reason="which npufuse replays only for flat expert ids written once or for mask routing over every expert",
         name="s43b_rows_term_over_some_experts"),
    # a third input picked with the slot numbers, not the token rows
    Keep(_COND3_WHERE.replace("g[tok])", "g[slot])"),
         reason="conditioning rows only when they are picked", name="s43b_third_input_of_another_index"),
    # the runs' second tensor read at the sorted copies' positions, not at the run's tokens
    Keep(_COND3_RUNS.replace("self.experts[i](x[t], c[t], g[t])", "self.experts[i](x[t], c[order[start:end]], g[t])"),
         reason="sorted runs over cumulative ends", name="s43b_runs_second_input_at_sorted_positions"),
    # a side statement reads the output the dispatch writes: it sees the experts done so far, not all of them
    Keep(_SIDE_STATS.replace("            counts[e] += len(rows)\n", "            counts[e] += out.norm()\n"),
         reason="unrecognised update in the expert loop", name="s43b_side_statement_reads_the_output"),
    # a side statement draws random numbers: the draws would move relative to the experts' own (dropout)
    Keep(_SIDE_STATS.replace("            counts[e] += len(rows)\n", "            counts[e] += torch.rand(()) * len(rows)\n"),
         reason="unrecognised update in the expert loop", name="s43b_side_statement_draws_random_numbers"),
    # a side statement changes the tokens the next experts read
    Keep(_SIDE_STATS.replace("            counts[e] += len(rows)\n", "            x[rows] *= 0.5\n"),
         reason="unrecognised update in the expert loop", name="s43b_side_statement_changes_the_tokens"),
    # (s43 review) a side statement calls a function of the file that may change its arguments in place (here it
    # scales the tokens the next experts read): replayed after the dispatch, the experts would read unscaled rows
    Keep(_SIDE_STATS.replace("            counts[e] += len(rows)\n", "            counts[e] += shrink_(x, rows)\n")
         + "\n\ndef shrink_(t, rows):\n    t.data[rows] *= 0.5\n    return len(rows)\n",
         reason="unrecognised update in the expert loop", name="s43b_side_statement_calls_a_function_that_changes_the_tokens"),
]
