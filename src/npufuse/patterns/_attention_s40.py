"""Attention constructs of the s40 pass (HO16 development data).

* Rank through helper calls by dataflow (HO16a tiny-qwen's vision attention: ``q, k, v = qkv.reshape(s, 3, h,
  -1).permute(1, 0, 2, 3).unbind(0)`` then ``q = self._apply_rotary(q.unsqueeze(0), freqs).squeeze(0)``): the rank
  of a call of a repository function or of a method of the class is the rank its ``return`` has given the ranks of
  the arguments it is passed (:func:`helper_return_rank`), read inside the helper with :func:`attention.static_rank`
  and the parameters bound to the callers' ranks. A fact, not a name or an assumption: every ``return`` must agree.
"""

from __future__ import annotations

import ast
import contextvars
from typing import Any, Optional

from npufuse.scan.dataflow import fast_walk  # (s50: for ast.walk, the same nodes in the same order)

# parameter ranks of the helpers being read: {id(helper FunctionDef): {parameter: rank}} (nested helpers stack)
_PARAM_RANKS: "contextvars.ContextVar[dict[int, dict[str, int]]]" = contextvars.ContextVar("npufuse_param_ranks", default={})
_MAX_NESTING = 3  # helper inside helper inside helper: deeper reads say nothing


def param_rank(scope: Any, name: str) -> Optional[int]:
    """The rank bound to parameter ``name`` of ``scope``'s function while a call of it is read, else None."""
    return _PARAM_RANKS.get().get(id(scope.node), {}).get(name)


def _callee(module: Any, scope: Any, call: ast.Call) -> Optional[tuple[ast.FunctionDef, list[str], Any]]:
    """(definition, the parameters the call's positional arguments bind, the helper's scope) of a call of a
    repository function (``f(x)``, by the file's own definitions and imports) or of a method of the class or
    of another class of the file (``self.m(x)`` in a method of ``scope``'s class, ``Cls.m(x)``: a staticmethod, or a plain / class method through
    ``self`` / ``cls``); None for anything else (a module attribute, a decorated function, a tensor method)."""
    from npufuse.patterns._attention_s33 import is_parameter
    from npufuse.scan import repo_facts

    class_name = scope.class_name
    func = call.func
    head = getattr(func.value, "id", getattr(func.value, "name", None)) if isinstance(func, ast.Attribute) else None
    fn: Any = None
    bound = 0  # leading parameters the call binds implicitly (self / cls)
    if isinstance(func, ast.Attribute) and head is not None:
        cls = module.classes.get(class_name or "") if head in ("self", "cls") else module.classes.get(head)
        if cls is None:
            return None
        fn = next((st for st in cls.body if isinstance(st, ast.FunctionDef) and st.name == func.attr), None)
        if fn is None:
            return None
        decorators = {getattr(d, "id", None) for d in fn.decorator_list}
        if decorators == {"staticmethod"}:
            bound = 0
        elif head in ("self", "cls") and (not decorators or decorators == {"classmethod"}):
            bound = 1
        else:
            return None
    else:
        name = getattr(func, "id", getattr(func, "name", None))
        if not isinstance(name, str) or getattr(func, "idx", -1) != -1 or name in scope.assignments or is_parameter(scope, name):
            return None  # a local or a parameter of that name is not the file's definition
        d = repo_facts.definition(module, name)
        fn = d.node if d is not None else None
        if not isinstance(fn, ast.FunctionDef) or fn.decorator_list:
            return None
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)][bound:]
    return fn, params, _scope_of(module, fn)


def _scope_of(module: Any, fn: ast.FunctionDef) -> Any:
    """The scan's scope of ``fn`` (a scope built once per definition for one of another file)."""
    from npufuse.scan.dataflow import Scope

    table = module.__dict__.setdefault("_npufuse_s40_helper_scopes", {})
    hit = table.get(id(fn))
    if hit is None or hit[0] is not fn:
        scope = next((s for s in module.scopes if s.node is fn), None)
        if scope is None:  # another file's: its names mean nothing in this file, so calls inside it are not followed
            scope = Scope(qualname=fn.name, node=fn, class_name=None, body=fn.body)
            module.__dict__.setdefault("_npufuse_s40_foreign", set()).add(id(scope))
        hit = table[id(fn)] = (fn, scope)
    return hit[1]


def _straight_line(fn: ast.FunctionDef) -> bool:
    """Every name the function assigns is assigned by a statement of its own body, not inside a loop, an ``if`` arm,
    a ``with`` or a ``try``: :func:`attention.static_rank` reads the last assignment before a line as the value,
    which holds only there (a loop's ``base = base.unsqueeze(0)`` runs any number of times)."""
    for st in fn.body:
        if isinstance(st, (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.If)) or type(st).__name__ in ("TryStar", "Match"):
            if any(isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr, ast.For)) for n in fast_walk(st)):
                return False
    return True


def helper_return_rank(module: Any, scope: Any, call: ast.Call, line: int, depth: int) -> Optional[int]:
    """The rank of ``call``'s result where the callee is a repository function / method whose every ``return`` has a
    rank that :func:`attention.static_rank` reads with the parameters bound to the ranks of the arguments the call
    passes (positional and keyword; the caller's ranks read in ``scope`` before ``line``, its class the one whose
    ``self`` methods are looked up); None otherwise, and for calls inside a helper of another file."""
    from npufuse.patterns.attention import static_rank

    nesting = _PARAM_RANKS.get()
    if len(nesting) >= _MAX_NESTING or any(isinstance(a, ast.Starred) for a in call.args) \
            or id(scope) in module.__dict__.get("_npufuse_s40_foreign", ()):
        return None
    found = _callee(module, scope, call)
    if found is None:
        return None
    fn, params, helper_scope = found
    if id(fn) in nesting or len(call.args) > len(params) or not _straight_line(fn):
        return None  # recursion, *args, or assignments a line order does not settle: not read
    bound: dict[str, int] = {}
    passed = list(zip(params, call.args)) + [(k.arg, k.value) for k in call.keywords if k.arg is not None]
    for param, arg in passed:
        r = static_rank(scope, arg, line, depth + 1)
        if r is not None:
            bound[param] = r
    if not bound:
        return None
    memo = module.__dict__.setdefault("_npufuse_s40_return_ranks", {})
    key = (id(fn), tuple(sorted(bound.items())))
    if key in memo and memo[key][0] is fn:
        return memo[key][1]
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
    token = _PARAM_RANKS.set({**nesting, id(fn): bound})
    try:
        ranks = {static_rank(helper_scope, r.value, r.lineno, 0) if r.value is not None else None for r in returns}
    finally:
        _PARAM_RANKS.reset(token)
    rank = ranks.pop() if len(ranks) == 1 else None
    memo[key] = (fn, rank)
    return rank


# --- a mask term tested against None and built by a call in the span (HO16a gemma3's ``sw_mask =
# self._sliding_window_mask(L, x.device)`` combined into ``mask`` before ``if mask is not None: masked_fill``) ---
def none_tested_term(term: Any, text: str) -> Optional[str]:
    """``is not None`` / ``is None`` where the term's condition tests the term's own value against None and its text
    makes a call (evaluated in the test and again in the arm if both were rendered from the value); None otherwise."""
    from npufuse.patterns._attention_s38 import value_key
    from npufuse.patterns.attention import deref

    cond = deref(term.cond) if term.cond is not None else None
    if not (isinstance(cond, ast.Compare) and len(cond.ops) == 1 and isinstance(cond.ops[0], (ast.Is, ast.IsNot))
            and isinstance(cond.comparators[0], ast.Constant) and cond.comparators[0].value is None):
        return None
    if "(" not in text or value_key(cond.left) != value_key(term.node):
        return None
    return "is not None" if isinstance(cond.ops[0], ast.IsNot) else "is None"


# --- an ``if`` of the span read as values (its assignments folded into the fused call's inputs) that also does
# something else: ``print(m)``, ``self.calls += 1``, ``self.cache = m`` in an arm. The fused branch does not run the
# statement, so it would silently drop that effect ---
def effect_in_folded_if(stmt: ast.stmt, scope: Any = None) -> Optional[str]:
    """A near-miss reason naming the first statement of an ``if`` (its arms, nested ``if``s included) that is not a
    binding of local names (an assignment to names, a write into / an in-place method of a local tensor, a ``raise`` / ``assert`` / ``pass``), else None (also for a statement that is not an ``if``)."""
    if not isinstance(stmt, ast.If):
        return None
    # tensors the ``if`` itself creates: writes into them change nothing the caller holds
    own = {t.id for n in fast_walk(stmt) if isinstance(n, (ast.Assign, ast.AnnAssign))
           for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    if scope is not None:
        # and the function's own locals (amago's ``if self.causal: scores.masked_fill_(mask, -inf)`` on the scores it
        # computed): not a parameter, whose tensor the caller holds
        from npufuse.patterns._attention_s33 import is_parameter

        own |= {name for name in scope.assignments if not is_parameter(scope, name)}
    stack = [*stmt.body, *stmt.orelse]
    while stack:
        st = stack.pop(0)
        if isinstance(st, ast.If):
            stack[:0] = [*st.body, *st.orelse]
            continue
        if isinstance(st, ast.With):
            stack[:0] = list(st.body)  # Megatron's ``with rng_fork(): probs = dropout(probs)``: what it binds is read
            continue
        if _binds_locals_only(st, own):
            continue
        text = " ".join(ast.unparse(st).split())[:60]
        return (f"the `if` at line {stmt.lineno} is read as values of the attention's inputs, but it also runs `{text}` "
                f"(line {st.lineno}), which the fused branch would not run")
    return None


def _binds_locals_only(st: ast.stmt, own: set[str]) -> bool:
    if isinstance(st, (ast.Pass, ast.Raise, ast.Assert)):
        return True
    if isinstance(st, ast.Expr):
        v = st.value
        if isinstance(v, ast.Constant):
            return True  # a string used as a comment
        return isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and isinstance(v.func.value, ast.Name) \
            and v.func.attr.endswith("_") and not v.func.attr.startswith("_") and v.func.value.id in own
    targets = st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(st, (ast.AnnAssign, ast.AugAssign)) else None
    if targets is None:
        return False
    for t in targets:
        for n in ast.walk(t):
            if isinstance(n, (ast.Attribute, ast.Subscript)) and isinstance(n.ctx, ast.Store):
                base = n.value
                while isinstance(base, (ast.Subscript, ast.Attribute)):
                    base = base.value
                if isinstance(n, ast.Attribute) or not isinstance(base, ast.Name) or base.id not in own:
                    return False  # a store into an object the caller may hold: an effect the fused branch does not make
    return True


# --- SDPA with an optional mask and ``is_causal=True`` (HO16a Zenith) ---
def mask_may_be_none(scope: Any, mask: Any, line: int) -> bool:
    """``mask`` is a parameter of the function that the code says may be None (a ``None`` default or an
    ``Optional[...]`` / ``... | None`` annotation) and that no assignment rebinds before ``line``."""
    fn = scope.node
    if not isinstance(mask, ast.Name) or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    if any(st.lineno < line for st, _v in scope.assignments.get(mask.id, [])):
        return False
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    defaults: dict[str, Any] = dict(zip([a.arg for a in positional][len(positional) - len(args.defaults):], args.defaults))
    defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
    arg = next((a for a in (*positional, *args.kwonlyargs) if a.arg == mask.id), None)
    if arg is None:
        return False
    default = defaults.get(mask.id)
    if isinstance(default, ast.Constant) and default.value is None:
        return True
    note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
    return note.startswith("Optional[") or note.endswith("| None") or note.startswith("None |")
