"""s44 (defects44): expert ids that may name no expert of the loop.

An expert loop over ``range(E)`` (``enumerate(self.experts)``, ...) runs only ids 0 .. E - 1: a token whose id is
negative (a ``-1`` drop marker) or >= E (top-k over a gate wider than the loop, a sentinel ``E``) is skipped and its
rows keep the accumulator's zeros. ``npu_moe_token_permute`` rejects negative ids (spec 8.6: values in
[0, 16777215)) and the fused layer's unpermute combines every slot, so such ids changed the result. Here:
``ids_name_an_expert`` proves statically that the original cannot go on with such ids (top-k / argmax over a gate
exactly as wide as the loop, a one-hot mask of that many classes, which raises on any other id); where it cannot,
``named_ids_lines`` masks them at run time: elementwise on the [T, K] ids, no host sync, no graph break.
"""

from __future__ import annotations

import ast
from typing import Optional

from npufuse.scan import bound_callee
from npufuse.scan.dataflow import ModuleInfo, Scope, const_value, keyword

# calls that keep every value of the ids (layout or integer type only)
_VALUE_KEEPING = {"view", "reshape", "flatten", "long", "int", "to", "contiguous", "squeeze", "unsqueeze", "detach",
                  "clone", "view_as", "reshape_as"}

_Text = tuple[str, str]  # (where the text is read: "fwd" | "init" | "self", source text)


def ids_name_an_expert(module: ModuleInfo, scope: Scope, loop: ast.For, indices: str, one_hot_classes: str) -> bool:
    """True where every id of ``indices`` the loop sees is in [0, E) for the loop's E, or the original raises on
    the others: the ids are top-k / argmax indices over the last dim of ``self.<gate>(x)`` (an ``nn.Linear``) or of
    a ``.view(.., W)``, or one-hot masks of ``one_hot_classes`` classes are built of them, and that width is the
    loop's bound as written (through ``self.<attr>`` set once in ``__init__`` and ``len`` of a ``ModuleList`` built
    over ``range(n)``). Any in-place write to the ids (or a name they were read from) between makes it False."""
    init = _InitValues(module, scope)
    bound = _loop_bound(loop)
    if bound is None:
        return False
    bounds = _closure({_tag(bound, "fwd")}, scope, init, loop.lineno)
    widths: set[_Text] = set()
    if one_hot_classes:
        widths.add(_tag(one_hot_classes, "fwd"))
    traced = _traced_width(module, scope, init, indices, loop.lineno)
    if traced is not None:
        widths.add(traced)
    return bool(_closure(widths, scope, init, loop.lineno) & bounds - {("fwd", ""), ("init", ""), ("self", "")})


def named_ids_lines(indices: str, n: str, prefix: str) -> list[str]:
    """``<prefix>named``: which ids name an expert of the loop (the others it skips)."""
    return [
        f"# ids outside [0, {n}) name no expert of the loop (a -1 drop marker, a gate wider than the loop): the loop",
        "# skips their tokens, which keep zero rows",
        f"{prefix}named = ({indices} >= 0) & ({indices} < {n})",
    ]


def _loop_bound(loop: ast.For) -> Optional[ast.expr]:
    """E of ``range(E)`` / ``range(0, E)``, or ``len(C)`` of ``enumerate(C)`` / ``C`` (C an attribute: the experts)."""
    it = loop.iter
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and not it.keywords:
        if it.func.id == "range" and len(it.args) == 1:
            return it.args[0]
        if it.func.id == "range" and len(it.args) == 2 and const_value(it.args[0]) == 0:
            return it.args[1]
        if it.func.id == "enumerate" and len(it.args) == 1 and isinstance(it.args[0], ast.Attribute):
            it = it.args[0]
    if isinstance(it, ast.Attribute):
        return ast.Call(func=ast.Name(id="len", ctx=ast.Load()), args=[it], keywords=[])
    return None


def _tag(node: ast.expr | str, where: str) -> _Text:
    """Texts that read only ``self`` mean the same in every method; others are read in their own method."""
    try:
        tree = ast.parse(node.strip(), mode="eval").body if isinstance(node, str) else node
    except SyntaxError:
        return (where, "")  # (a text that does not parse on its own equals nothing)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - {"len"}
    return ("self" if names <= {"self"} else where, ast.unparse(tree))


class _InitValues:
    """``self.<attr> = value`` (tuple targets too) and local names of ``__init__`` of the scope's class, each kept
    only where it is assigned exactly once there (a value assigned twice is unknown). A parameter of ``__init__``
    that is assigned there holds two values (the caller's, then the new one), and an attribute another method of
    the class stores, deletes or shrinks (``pop``) may change after ``__init__``: both unknown (s45 review)."""

    def __init__(self, module: ModuleInfo, scope: Scope) -> None:
        self.attrs: dict[str, Optional[ast.expr]] = {}
        self.locals: dict[str, Optional[ast.expr]] = {}
        cls = module.classes.get(scope.class_name or "")
        init = next((s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None) \
            if cls is not None else None
        if init is None:
            return
        params = {a.arg for a in (*init.args.posonlyargs, *init.args.args, *init.args.kwonlyargs)}
        for node in ast.walk(init):
            pairs: list[tuple[ast.expr, Optional[ast.expr]]] = []
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(t.elts) == len(node.value.elts):
                        pairs += list(zip(t.elts, node.value.elts))
                    elif isinstance(t, ast.Tuple):
                        pairs += [(e, None) for e in t.elts]
                    else:
                        pairs.append((t, node.value))
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                pairs.append((node.target, None if isinstance(node, ast.AugAssign) else node.value))
            elif isinstance(node, (ast.For, ast.comprehension)):
                pairs += [(n, None) for n in ast.walk(node.target) if isinstance(n, ast.Name)]
            for target, value in pairs:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    self.attrs[target.attr] = value if target.attr not in self.attrs else None
                elif isinstance(target, ast.Name):
                    self.locals[target.id] = value if target.id not in self.locals and target.id not in params else None
        # an attribute code outside __init__ stores, deletes or shrinks (``self.experts.pop()``): its __init__ value
        # may not hold later (s46: bound_callee's one reader)
        for attr in bound_callee.changed_outside_init(module, scope.class_name):
            self.attrs[attr] = None


def _closure(start: set[_Text], scope: Scope, init: _InitValues, line: int) -> set[_Text]:
    """Texts equal to those of ``start``: a forward name's value, ``self.<attr>``'s ``__init__`` value, an
    ``__init__`` local's value, and ``n`` for ``len(self.<experts>)`` built as ``ModuleList([.. for _ in range(n)])``."""
    seen, todo = set(start), list(start)
    while todo and len(seen) < 24:
        where, text = todo.pop()
        if not text:
            continue
        node = ast.parse(text, mode="eval").body
        more: list[_Text] = []
        if isinstance(node, ast.Name) and where == "fwd":
            value = scope.definition(node.id, line)
            if value is not None and len(scope.assignments.get(node.id, [])) == 1:
                more.append(_tag(value, "fwd"))
        elif isinstance(node, ast.Name) and where == "init" and init.locals.get(node.id) is not None:
            more.append(_tag(init.locals[node.id], "init"))  # type: ignore[arg-type]
        elif _self_attr(node) and init.attrs.get(_self_attr(node)) is not None:
            more.append(_tag(init.attrs[_self_attr(node)], "init"))  # type: ignore[arg-type]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len" and len(node.args) == 1:
            built = init.attrs.get(_self_attr(node.args[0])) if _self_attr(node.args[0]) else None
            count = _built_over_range(built)
            if count is not None:
                more.append(_tag(count, "init"))
        for t in more:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    # a name of __init__ assigned there twice (or bound by a loop) is not one value: drop texts that read it
    return {(w, t) for w, t in seen if w != "init" or not any(
        isinstance(n, ast.Name) and n.id in init.locals and init.locals[n.id] is None for n in ast.walk(ast.parse(t, mode="eval")))}


def _self_attr(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" else ""


def _built_over_range(value: Optional[ast.expr]) -> Optional[ast.expr]:
    """n of ``nn.ModuleList([.. for _ in range(n)])`` / ``ModuleList(.. for _ in range(n))`` / ``[.. for _ in range(n)]``."""
    if isinstance(value, ast.Call) and len(value.args) == 1 and (ast.unparse(value.func).endswith("ModuleList")):
        value = value.args[0]
    if isinstance(value, (ast.ListComp, ast.GeneratorExp)) and len(value.generators) == 1:
        gen = value.generators[0]
        it = gen.iter
        if not gen.ifs and isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range" \
                and len(it.args) == 1 and not it.keywords:
            return it.args[0]
    return None


def _traced_width(module: ModuleInfo, scope: Scope, init: _InitValues, indices: str, line: int) -> Optional[_Text]:
    """The width W of the logits whose top-k / argmax gives ``indices`` (followed through value-keeping steps),
    or None (unknown source, or an in-place write on the way)."""
    call = top_call_of(module, scope, indices, line)
    return _logits_width(module, scope, init, _top_source(module, call), line) if call is not None else None


def top_call_of(module: ModuleInfo, scope: Scope, indices: str, line: int) -> Optional[ast.Call]:
    """The top-k / argmax call whose indices ``indices`` are (followed through value-keeping steps: every value of
    it is that call's, so in [0, its dim's size)), or None (unknown source, a rebinding or an in-place write)."""
    try:
        node: ast.expr = ast.parse(indices, mode="eval").body
    except SyntaxError:
        return None
    names: list[str] = []
    for _ in range(12):
        if isinstance(node, ast.Name):
            if node.id in names or len(scope.assignments.get(node.id, [])) != 1:
                return None  # rebound (e.g. `ids = torch.where(keep, ids, -1)`): its values are not the top-k's
            names.append(node.id)
            value = scope.definition(node.id, line)
            if value is None:
                return None
            node = value
            continue
        picked = False  # the indices half of topk's / max's (values, indices)
        if isinstance(node, ast.Subscript) and const_value(node.slice) == 1 and _is_top(module, node.value, True):
            node, picked = node.value, True  # `_, ids = torch.topk(..)` / `torch.max(.., dim=-1)[1]`
        elif isinstance(node, ast.Attribute) and node.attr == "indices" and _is_top(module, node.value, True):
            node, picked = node.value, True
        if isinstance(node, ast.Call) and _is_top(module, node, picked):
            return None if _written_in_place(scope, names) else node
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _VALUE_KEEPING:
            if node.func.attr == "to" and any(isinstance(a, ast.Constant) for a in node.args):
                return None
            node = node.func.value
            continue
        return None
    return None


def _is_top(module: ModuleInfo, call: ast.expr, pair: bool) -> bool:
    """``topk(src, k[, dim=-1])`` / ``max(src, dim=-1)`` (``pair``: their indices half) or ``argmax(src, dim=-1)``."""
    if not isinstance(call, ast.Call):
        return False
    canon = module.canonical(call.func) or ""
    method = isinstance(call.func, ast.Attribute) and not canon.startswith("torch.")
    name = call.func.attr if isinstance(call.func, ast.Attribute) else canon.rsplit(".", 1)[-1]
    if canon and not method and canon not in ("torch.topk", "torch.argmax", "torch.max"):
        return False
    first = 0 if method else 1
    if (name == "argmax") == pair:
        return False
    if name == "topk":
        dim = keyword(call, "dim", first + 1)
        return (method or bool(call.args)) and (dim is None or const_value(dim) == -1)
    if name in ("argmax", "max"):
        dim = keyword(call, "dim", first)
        return (method or bool(call.args)) and dim is not None and const_value(dim) == -1
    return False


def _top_source(module: ModuleInfo, call: ast.Call) -> ast.expr:
    method = isinstance(call.func, ast.Attribute) and not (module.canonical(call.func) or "").startswith("torch.")
    return call.func.value if method else call.args[0]  # type: ignore[union-attr]


def _logits_width(module: ModuleInfo, scope: Scope, init: _InitValues, node: ast.expr, line: int) -> Optional[_Text]:
    # the calls s40's top-k reading takes to keep the logits' rows keep their last dim too (the gate's width)
    from npufuse.patterns.moe_experts import _S40_ROW_KEEPING as width_keeping, _S40_ROW_KEEPING_API as width_keeping_api

    for _ in range(12):
        if isinstance(node, ast.Name):
            if len(scope.assignments.get(node.id, [])) != 1 or _written_in_place(scope, [node.id]):
                return None
            value = scope.definition(node.id, line)
            if value is None:
                return None
            node = value
            continue
        if not isinstance(node, ast.Call):
            return None
        f = node.func
        if (module.canonical(f) or "") in width_keeping_api and node.args:
            node = node.args[0]
        elif isinstance(f, ast.Attribute) and f.attr in ("view", "reshape") and node.args and not node.keywords \
                and not isinstance(node.args[-1], ast.Starred) and const_value(node.args[-1]) != -1 \
                and not isinstance(node.args[0], (ast.Tuple, ast.List)):
            return _tag(node.args[-1], "fwd")  # `.view(-1, W)`: last dim W as written
        elif isinstance(f, ast.Attribute) and f.attr in width_keeping:
            node = f.value
        elif _self_attr(f) and len(node.args) == 1 and not node.keywords:
            layer = init.attrs.get(_self_attr(f))
            if isinstance(layer, ast.Call) and (module.canonical(layer.func) or "") == "torch.nn.Linear":
                width = keyword(layer, "out_features", 1)
                return _tag(width, "init") if width is not None else None
            return None
        else:
            return None
    return None


def _written_in_place(scope: Scope, names: list[str]) -> bool:
    """Any ``name[..] = ..`` / ``name[..] += ..`` / ``name.<op>_(..)`` / ``name += ..`` for the names in the scope."""
    wanted = set(names)
    nodes = scope.nodes()
    for sub in nodes.get(ast.Subscript, ()):
        if isinstance(sub.ctx, ast.Store) and isinstance(sub.value, ast.Name) and sub.value.id in wanted:  # type: ignore[attr-defined]
            return True
    for aug in nodes.get(ast.AugAssign, ()):
        if isinstance(aug.target, ast.Name) and aug.target.id in wanted:  # type: ignore[attr-defined]
            return True
    for call in nodes.get(ast.Call, ()):
        f = call.func  # type: ignore[attr-defined]
        if isinstance(f, ast.Attribute) and f.attr.endswith("_") and not f.attr.endswith("__") \
                and isinstance(f.value, ast.Name) and f.value.id in wanted:
            return True
    return False
