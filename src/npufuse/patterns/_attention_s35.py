"""Attention constructs of the s35 pass (HO11 / ports 6 development data).

* Probabilities exposed to the callers under a flag by a conditional expression between the attention steps
  (ViT-pytorch's ``weights = attention_probs if self.vis else None`` and its copies: TransUNet, ModelZoo's
  vit-base): :func:`flag_gated_probabilities`. The fused call runs where the flag is off, where the name holds
  None as in the original; the original code runs where it is on.
"""

from __future__ import annotations

import ast
from typing import Any, Optional

from npufuse.scan.dataflow import fast_walk


def flag_gated_probabilities(matcher: Any, interp: Any, chain: Any, stmt: ast.stmt, s: int, j: int) -> Optional[tuple[str, tuple[Any, bool, str]]]:
    """(name, the ``Chain.excluded`` entry) where ``stmt`` (index ``j`` of the block, inside the span starting at
    ``s``) is ``name = <the probabilities, possibly viewed / cast / detached> if <flag> else None`` (either side
    None) and the flag is a pure test computing no tensor, read before the span; None otherwise."""
    from npufuse.patterns.attention import _flag_gated_weights

    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.IfExp)):
        return None
    names = {n.id for n in fast_walk(stmt.value.test) if isinstance(n, ast.Name)}
    if any(names & interp.assigned[i] for i in range(s, j)):
        return None  # the flag is computed inside the span: a guard before the call could not read it
    value = interp.sym(stmt.value, interp.before[j])
    gated = _flag_gated_weights(matcher, value, chain, s)
    if gated is None:
        return None
    return stmt.targets[0].id, gated


_TENSOR_FACTORIES = frozenset(("torch.ones", "torch.zeros", "torch.full", "torch.tensor", "torch.randn", "torch.rand", "torch.empty",
                               "torch.ones_like", "torch.zeros_like", "torch.full_like", "torch.log", "torch.as_tensor"))
_PARAMETERS = frozenset(("torch.nn.Parameter", "torch.nn.parameter.Parameter"))


def module_tensor(matcher: Any, factor: Any) -> bool:
    """``factor`` is ``self.<attr>`` whose ``__init__`` assignment builds a tensor: ``nn.Parameter(...)`` (XCiT's
    ``nn.Parameter(torch.ones(num_heads, 1, 1))``) or a torch tensor factory (``torch.ones(heads, 1, 1) * t``);
    not a number, so not a Python-float scale."""
    from npufuse.patterns.attention import _is_self_attr, deref

    f = deref(factor)
    if not _is_self_attr(f):
        return False
    ctor = matcher._module_attr_ctor(f)
    while isinstance(ctor, ast.BinOp) or isinstance(ctor, ast.Call) and matcher.module.canonical(ctor.func) in _PARAMETERS:
        # ``nn.Parameter(x)`` holds x's values; ``torch.ones(h, 1, 1) * 10.0`` is still a tensor
        if isinstance(ctor, ast.Call):
            if matcher.module.canonical(ctor.func) in _PARAMETERS:
                return True
        ctor = ctor.left if isinstance(ctor, ast.BinOp) else None
    return isinstance(ctor, ast.Call) and matcher.module.canonical(ctor.func) in _TENSOR_FACTORIES


# --- 3-D per-head attention whose q / k pass through a repository helper (DexVLA / Qwen2-VL's vision rotary:
# ``apply_rotary_pos_emb_vision(q.unsqueeze(0), rope).squeeze(0)`` on [S, H, D], then ``q.transpose(0, 1)``): the
# helper is assumed to keep its first argument's rank while the 3-D reading is tried; the fused call checks every
# rank at run time (``q.dim() == 3``), so a helper that changes it runs the original code ---
RANK_THROUGH_HELPERS: "contextvars.ContextVar[Optional[Any]]"

import contextvars  # noqa: E402

RANK_THROUGH_HELPERS = contextvars.ContextVar("npufuse_rank_through_helpers", default=None)


def _rank_keeping_helper(matcher: Any, call: ast.Call) -> bool:
    """``call`` calls a plain function of the repository (no decorator, a first parameter its body reads, one
    ``return`` at the end, no loop): read as keeping its first argument's rank."""
    from npufuse.patterns import _attention_s33

    if isinstance(call.func, ast.Attribute):
        return False
    d = _attention_s33._definition(matcher, call.func)
    fn = d.node if d is not None else None
    if not isinstance(fn, ast.FunctionDef) or fn.decorator_list or not fn.args.args or not fn.body \
            or not isinstance(fn.body[-1], ast.Return) or fn.body[-1].value is None:
        return False
    if any(isinstance(n, (ast.For, ast.While, ast.Return)) and n is not fn.body[-1] for n in fast_walk(fn)):
        return False
    first = fn.args.args[0].arg
    return any(isinstance(n, ast.Name) and n.id == first and isinstance(n.ctx, ast.Load) for n in fast_walk(fn))


def rank_through_helpers(matcher: Any, node: Any, facts_only: bool = False) -> Optional[int]:
    """:func:`attention.static_rank` of ``node`` reading a call of a repository function / method as the rank its
    ``return`` has (s40, :func:`_attention_s40.helper_return_rank`), else (not ``facts_only``) a call of a plain
    repository function as its first argument (an assumption the fused call checks at run time)."""
    from npufuse.patterns import _attention_s40
    from npufuse.patterns.attention import static_rank

    def through(scope: Any, call: ast.Call, line: int, depth: int) -> Optional[int]:
        r = _attention_s40.helper_return_rank(matcher.module, scope, call, line, depth)
        if r is None and not facts_only and scope is matcher.scope and call.args and _rank_keeping_helper(matcher, call):
            r = static_rank(scope, call.args[0], line, depth + 1)
        return r

    token = RANK_THROUGH_HELPERS.set(through)
    try:
        return static_rank(matcher.scope, node, matcher._line)
    finally:
        RANK_THROUGH_HELPERS.reset(token)


def rank_base(leaf: Any) -> Optional[Any]:
    """The tensor whose rank ``leaf`` has: ``leaf`` through rank-keeping method calls (``q.transpose(0, 1)`` -> q);
    None where that is another call."""
    from npufuse.patterns.attention import _RANK_KEEP

    n = leaf
    while isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _RANK_KEEP:
        n = n.func.value
    return None if isinstance(n, ast.Call) else n


# --- an operand no assignment reaches (Kimi-Audio's DiT block: ``else: q = q * self.scale`` where q, k, v are
# assigned only in the ``if self.fused_attn:`` arm): the original raises UnboundLocalError there, so the branch is
# dead code, not attention to replace ---
def unbound_operand(matcher: Any, chain: Any) -> Optional[str]:
    """A name q, k or v is read from at the site that is a local of the function (assigned in it, not a parameter)
    with no assignment that can reach the site (every one after it, or in the other arm of an ``if`` that holds the
    site); None otherwise."""
    from npufuse.patterns.attention import Ref, deref

    line = getattr(matcher, "_line", None)
    fn = matcher.scope.node
    if line is None or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)} | \
        {a.arg for a in (fn.args.vararg, fn.args.kwarg) if a is not None}
    # ast.walk(fn)'s nodes of these types from the scope's shared index (grouped by type: the order
    # within a type is the walk's; the sets and any() below do not depend on the order across types)
    groups = matcher.scope.nodes()
    declared = {n for t in (ast.Global, ast.Nonlocal) for st in groups.get(t, ()) for n in st.names}
    arms = [(st.body, st.orelse) for st in groups.get(ast.If, ()) if st.orelse]
    loops = [st.body for t in (ast.For, ast.AsyncFor, ast.While) for st in groups.get(t, ())]

    def inside(stmts: list[ast.stmt], at: int) -> bool:
        return bool(stmts) and stmts[0].lineno <= at <= (stmts[-1].end_lineno or stmts[-1].lineno)

    def reaches(st: ast.stmt) -> bool:
        if any(inside(body, st.lineno) and inside(body, line) for body in loops):
            return True  # a later assignment in the loop holding the site reaches it on the next turn
        return st.lineno < line and not any(inside(a, st.lineno) and inside(b, line) or inside(b, st.lineno) and inside(a, line)
                                            for a, b in arms)

    for op in (chain.q, chain.k, chain.v):
        n = op.leaf if op is not None else None
        for _ in range(12):
            n = deref(n)
            if isinstance(n, ast.BinOp):
                n = n.left
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                n = n.func.value
            elif isinstance(n, ast.Subscript):
                n = n.value
            else:
                break
        name = n.name if isinstance(n, Ref) and n.idx == -1 and n.value is None else n.id if isinstance(n, ast.Name) else None
        if name is None or name in params or name in declared or name == "self":
            continue
        assigned = matcher.scope.assignments.get(name, ())
        binders = [st for t in (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.comprehension,
                                ast.ExceptHandler, ast.Import, ast.ImportFrom, ast.NamedExpr, ast.Delete) for st in groups.get(t, ())]
        if not assigned or binders and any(name in {x.id for x in fast_walk(b) if isinstance(x, ast.Name)} or
                                           isinstance(b, (ast.Import, ast.ImportFrom, ast.ExceptHandler)) for b in binders):
            continue  # bound some other way (a loop, a with, an import): not read here
        if not any(reaches(st) for st, _v in assigned):
            return name
    return None


# --- a tensor gate on the probabilities (LLaMA-Adapter's ``self.gate.tanh() * softmax(adapter_scores)`` with
# ``nn.Parameter(torch.zeros(1, heads, 1, 1))``, PEFT / FlagAI's ``self.adaption_gate * F.softmax(..)``): (g·P) @ V =
# g·(P @ V) where g has one value per row of P; checked at run time by :func:`row_constant_guard` ---
_GATE_METHODS = frozenset(("tanh", "sigmoid", "half", "float", "bfloat16", "to", "type_as", "exp", "abs", "clamp"))


def tensor_factor(matcher: Any, factor: Any) -> Optional[Any]:
    """The tensor the module holds (:func:`module_tensor`) that ``factor`` is, through elementwise methods that keep
    its shape (``self.gate.tanh()``, ``self.gate.tanh().half()``): what the run-time shape check reads (the factor
    itself is evaluated once, on the output); None for any other factor."""
    from npufuse.patterns.attention import deref

    n = deref(factor)
    for _ in range(8):
        if module_tensor(matcher, n):
            return n
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _GATE_METHODS:
            n = deref(n.func.value)
            continue
        return None
    return None


def row_constant_guard(factor: Any, rank: int) -> ast.expr:
    """``factor.dim() <= rank and factor.shape[-1] == 1`` as a symbolic test over ``factor``."""
    dim = ast.Compare(left=ast.Call(func=ast.Attribute(value=factor, attr="dim", ctx=ast.Load()), args=[], keywords=[]),
                      ops=[ast.LtE()], comparators=[ast.Constant(rank)])
    last = ast.Compare(left=ast.Subscript(value=ast.Attribute(value=factor, attr="shape", ctx=ast.Load()),
                                          slice=ast.UnaryOp(op=ast.USub(), operand=ast.Constant(1)), ctx=ast.Load()),
                       ops=[ast.Eq()], comparators=[ast.Constant(1)])
    return ast.BoolOp(op=ast.And(), values=[dim, last])


# --- a function returning a comparison is a bool mask, not graded values (LLaMA2-Accessory's ``_make_causal_mask``:
# ``q_idx = torch.arange(q_len) - q_len`` ... ``return q_idx.view(-1, 1) >= kv_idx.view(1, -1)``): positions used
# as values inside it are only compared ---
_BOOL_METHODS = frozenset(("bool", "logical_not", "logical_and", "logical_or", "logical_xor", "eq", "ne", "lt", "le", "gt", "ge",
                           "view", "reshape", "unsqueeze", "expand", "to", "contiguous", "transpose", "permute"))

# torch functions whose result is bool whatever their inputs
_BOOL_FUNCTIONS = frozenset(("logical_not", "logical_and", "logical_or", "logical_xor", "eq", "ne", "lt", "le", "gt", "ge", "isin"))


def local_values(fn: ast.AST) -> dict[str, list[ast.expr]]:
    """name -> every value a plain ``name = value`` assigns it in the function ``fn`` (nested blocks included)."""
    assigned: dict[str, list[ast.expr]] = {}
    for st in fast_walk(fn):
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            assigned.setdefault(st.targets[0].id, []).append(st.value)
    return assigned


def _bound_otherwise(fn: ast.AST) -> set[str]:
    """Names ``fn`` binds other than by the plain ``name = value`` :func:`local_values` lists: ``a = b = v``, tuple /
    starred targets, ``for`` / ``with`` / comprehension targets, augmented and annotated assignments, ``:=``,
    ``del`` / ``global`` / ``nonlocal``."""
    out: set[str] = set()
    for n in fast_walk(fn):
        if isinstance(n, ast.Assign):
            targets = n.targets if len(n.targets) > 1 else [t for t in n.targets if not isinstance(t, ast.Name)]
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)):
            targets = [n.target]
        elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
            targets = [n.target]
        elif isinstance(n, ast.withitem):
            targets = [n.optional_vars] if n.optional_vars is not None else []
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            out.update(n.names)
            continue
        elif isinstance(n, ast.Delete):
            targets = n.targets
        else:
            continue
        for t in targets:
            out |= _target_names(t)
    return out


def _target_names(t: ast.AST | None) -> set[str]:
    """The names an assignment target rebinds (``m[0] = ..`` / ``m.x = ..`` write into ``m``, not rebind it)."""
    if isinstance(t, ast.Name):
        return {t.id}
    if isinstance(t, (ast.Tuple, ast.List)):
        return set().union(*(_target_names(e) for e in t.elts))
    if isinstance(t, ast.Starred):
        return _target_names(t.value)
    return set()


def returns_bool(fn: Any, stored: dict[str, list[ast.expr]] | None = None) -> bool:
    """Every ``return`` of the function ``fn`` gives a bool tensor by construction: a comparison, ``~`` / ``&`` /
    ``|`` / ``^`` of such, a view or ``.bool()`` of one (``.to(device)`` keeps it), through the function's local
    names; False for anything else (and for a class or a function without a returned value). ``stored`` (s43):
    ``self.<attr>`` -> every value ``fn`` stores into ``self.<attr>[...]``, a cache that holds nothing else: an
    entry read from it is one of them."""
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    assigned = local_values(fn)
    returns = [r.value for r in fast_walk(fn) if isinstance(r, ast.Return)]
    # s43 (HO19a GPT-4's ``causal = k <= q; if w > 0: causal = causal & (k >= lower)``): a local rebound from itself is
    # bool where each of its assignments is, the self-reference read as bool (its earlier value is one of the others;
    # a local is never read before its first assignment). Not a parameter: its value on entry is the caller's.
    params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg, fn.args.kwarg) if a is not None}
    open_names: set[str] = set()
    # (s43 review) names also bound otherwise -- unpacked, a ``for`` / ``with`` target, ``m |= c`` -- hold values
    # local_values does not list: their self-reference is not read as bool (walked on the first self-reference)
    bound_otherwise: list[set[str]] = []

    def is_bool(n: Any, depth: int = 0) -> bool:
        if depth > 12 or n is None:
            return False
        if isinstance(n, ast.Compare):
            return True
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Invert):
            return is_bool(n.operand, depth + 1)
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
            return is_bool(n.left, depth + 1) and is_bool(n.right, depth + 1)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
                and n.func.value.id == "torch" and n.func.attr in _BOOL_FUNCTIONS:
            return True  # s42: ``torch.logical_and(a, b)`` / ``torch.lt(p, n)``: bool whatever the inputs
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _BOOL_METHODS:
            if n.func.attr == "bool" and not n.args:
                return True
            if n.func.attr == "to" and any(isinstance(a, ast.Attribute) and a.attr in ("float", "float32", "float16", "bfloat16", "half")
                                           for a in [*n.args, *(k.value for k in n.keywords)]):
                return False
            return is_bool(n.func.value, depth + 1)
        if isinstance(n, ast.Name):
            if n.id in open_names:
                if n.id in params:
                    return False
                if not bound_otherwise:
                    bound_otherwise.append(_bound_otherwise(fn))
                return n.id not in bound_otherwise[0]  # s43: the self-reference of ``m = m & c``
            values = assigned.get(n.id, [])
            open_names.add(n.id)
            try:
                return bool(values) and all(is_bool(v, depth + 1) for v in values)
            finally:
                open_names.discard(n.id)
        if isinstance(n, ast.Subscript):
            return is_bool(n.value, depth + 1)  # s42: ``keep[:, None, None, :]``: an index of a bool tensor is bool
        if stored and isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and f"{n.value.id}.{n.attr}" in stored:
            return all(is_bool(v, depth + 1) for v in stored[f"{n.value.id}.{n.attr}"])  # s43: a cache's entry
        return False

    return bool(returns) and all(is_bool(r) for r in returns)
