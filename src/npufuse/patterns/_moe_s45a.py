"""s45 (moe45a): expert ids outside [0, E) on the sorted-dispatch paths, read by small hooks in
:mod:`npufuse.patterns.moe_experts`.

defects44 proved / masked the ids of the mask- and flat-routing loops (:mod:`._defects_s44`). The sorted paths
differ in what such an id does in the original:

* sorted dispatch written by hand (sort_permute, sorted_pairs, sorted_dispatch): the code sorts the flat ids
  itself, so a -1 drop marker sorts FIRST and the experts between (kept as written) see it there; an id >= E sorts
  last and the code between leaves its rows as it leaves them. ``npu_moe_token_permute`` takes ids in
  [0, 16777215) only (spec 8.6) and raised on the -1. The permute is given the ids shifted by their minimum where
  that is negative: a monotone shift, so the sort order (and every row the experts see) is the original's, on the
  device, no host sync (:func:`permute_key`). Not needed where the ids are top-k / argmax indices (never negative)
  or where the original itself raises on a negative id before the experts run (a bincount / one-hot / scatter of
  those ids: :func:`negative_ids_raise`).
* runs of sorted ids (``for s, e in zip(starts, ends): self.experts[host[s]](...)``): Python indexing runs the
  LAST expert for a -1 (``experts[-1]``), so the fused permute takes ids wrapped the same way
  (:func:`wrapped_ids_line`); ids < -E and >= E raise IndexError in the original.
"""

from __future__ import annotations

import ast
from typing import Optional

from npufuse.patterns._defects_s44 import top_call_of
from npufuse.patterns import _moe_s44a as s44a
from npufuse.patterns import _moe_s47review
from npufuse.patterns import _rope_s48r
from npufuse.patterns.base import Fuse, Keep
from npufuse.scan.dataflow import ModuleInfo, Scope, const_value, dotted, fast_walk, keyword

# calls after which a tensor still holds every value of the ids (layout, integer type)
_ALL_VALUES = {"view", "reshape", "flatten", "long", "int", "contiguous", "detach", "clone", "squeeze", "unsqueeze"}


def ids_nonnegative(module: ModuleInfo, scope: Scope, ids: str, line: int) -> bool:
    """``ids`` are the indices of a top-k / argmax (through value-keeping steps, never rebound or written in
    place): every value is >= 0."""
    return top_call_of(module, scope, ids, line) is not None


def _holds_the_ids(module: ModuleInfo, scope: Scope, node: ast.expr, ids: str, line: int) -> bool:
    """``node`` holds every value of ``ids``: the ids themselves, a view / flatten / integer cast of them, their
    sorted values (``v.sort()[0]``, ``torch.sort(v)[0]``, ``v[argsort(v)]``), through names bound once."""
    for _ in range(8):
        if isinstance(node, ast.Name):
            if node.id == ids:
                return True
            if not _rope_s48r.stored_once(scope, node.id):  # s50: the one "bound once" reader (for / with / walrus too)
                return False
            value = scope.definition(node.id, line)
            if value is None:
                return False
            node = value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _ALL_VALUES:
            node = node.func.value
        elif isinstance(node, ast.Subscript) and const_value(node.slice) == 0 and _sorted_operand(module, node.value) is not None:
            node = _sorted_operand(module, node.value)  # type: ignore[assignment]
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name):
            from npufuse.patterns.moe_experts import _argsort_of  # (a permutation of all of them: `flat[order]`)

            if not isinstance(node.value, ast.Name) or _argsort_of(scope, node.slice.id, line) != node.value.id:
                return False
            node = node.value
        else:
            return False
    return False


def _sorted_operand(module: ModuleInfo, node: ast.expr) -> Optional[ast.expr]:
    """``v`` of ``v.sort(..)`` / ``torch.sort(v, ..)`` (its values half holds every value of v)."""
    if not isinstance(node, ast.Call):
        return None
    if (module.canonical(node.func) or "") == "torch.sort":
        return node.args[0] if node.args else None
    return node.func.value if isinstance(node.func, ast.Attribute) and node.func.attr == "sort" else None


def _raising_operand(module: ModuleInfo, call: ast.Call) -> Optional[ast.expr]:
    """The operand a call raises on when it holds a negative value: ``torch.bincount(v)`` / ``v.bincount()``,
    ``F.one_hot(v, ..)``, ``t.scatter_(d, v, ..)`` / ``scatter`` / ``scatter_add(_)`` (index out of range)."""
    canon = module.canonical(call.func) or ""
    f = call.func
    if canon in ("torch.bincount", "torch.nn.functional.one_hot") and call.args:
        return call.args[0]
    if isinstance(f, ast.Attribute) and not canon.startswith("torch."):
        if f.attr == "bincount" and not call.args:
            return f.value
        if f.attr in ("scatter", "scatter_", "scatter_add", "scatter_add_"):
            return keyword(call, "index", 1)
    return None


def negative_ids_raise(module: ModuleInfo, scope: Scope, ids: str, before: int) -> bool:
    """The function, on its straight-line path before line ``before`` (its body and ``with`` blocks, not inside an
    ``if`` / loop), counts, one-hots or scatters ``ids`` (or their sorted / flattened values) with an op that
    raises on a negative id: then the original never runs the experts on one."""
    body = list(getattr(scope.node, "body", []))
    first = min((st.lineno for st, _v in scope.assignments.get(ids, [])), default=0)
    while body:
        st = body.pop(0)
        if st.lineno >= before:
            return False
        if isinstance(st, (ast.With, ast.AsyncWith)):
            body[:0] = st.body
            continue
        if isinstance(st, (ast.If, ast.For, ast.While, ast.Try, ast.FunctionDef, ast.ClassDef, ast.Return)) \
                or st.lineno < first:
            continue
        for n in fast_walk(st):
            if isinstance(n, (ast.Lambda, ast.ListComp, ast.GeneratorExp, ast.DictComp, ast.SetComp, ast.IfExp)):
                break  # (parts that may not run)
            operand = _raising_operand(module, n) if isinstance(n, ast.Call) else None
            if operand is not None and _holds_the_ids(module, scope, operand, ids, st.lineno + 1):
                return True
    return False


def slot_ids(ids: str, k: str, tokens: str, weights: str, prefix: str) -> tuple[str, str, list[str]]:
    """(the [T, K] ids' text, the run-time condition, lines) for a sorted dispatch over the flat slots of ``ids``:
    slot j (row-major) is token j // K whatever the ids' rank, so ``ids.reshape(-1, K)`` is the permute's [T, K]."""
    flat = f"{prefix}ids"
    guard = (f"({k}) == {ids}.shape[-1] and {tokens}.dim() == 2 and {tokens}.shape[0] * ({k}) == {ids}.numel() "
             f"and {weights}.numel() == {ids}.numel()")
    return flat, guard, [f"{flat} = {ids}.reshape(-1, {k})  # [T, K]: slot j of the flat ids is token j // K"]


def permute_key(module: ModuleInfo, scope: Scope, ids: str, text: str, line: int, prefix: str) -> tuple[str, list[str], str]:
    """(an extra run-time condition, lines, the ids to permute by) for a sorted dispatch that hands ``ids`` (written
    ``text`` there) to ``npu_moe_token_permute`` in place of the code's own ascending sort of them. Ids that may be
    negative are shifted by their minimum where it is negative (the sort order is unchanged: every row lands where the
    code's own sort put it); the condition keeps an empty batch (no minimum) on the path as written."""
    if ids_nonnegative(module, scope, ids, line) or negative_ids_raise(module, scope, ids, line):
        return "", [], text
    key = f"{prefix}key"
    return f" and {ids}.numel() > 0", [
        "# ids the code sorts itself: a negative one (a -1 drop marker) sorts first there; the permute takes ids",
        "# in [0, 16777215) only, so they are shifted by their minimum when it is negative (the same order)",
        f"{key} = {text} - {text}.min().clamp(max=0)",
    ], key


def wrapped_ids_line(ids: str, n: str) -> str:
    """Runs of sorted ids index the experts with Python's negative indexing (``experts[-1]`` is the last one)."""
    return f"{ids} = torch.where({ids} < 0, {ids} + {n}, {ids})  # experts[-1] is the last expert, as the loop indexes them"


# -- dense gates scattered from top-k weights, read as `gates[:, e] > 0` (Spektron MixtureOfExperts) -----------------

# calls whose output is >= 0 wherever it is defined (an underflow gives exactly 0: see scattered_gate_indices)
_NONNEGATIVE_API = {"torch.softmax", "torch.nn.functional.softmax", "torch.sigmoid", "torch.nn.functional.sigmoid",
                    "torch.exp"}
_NONNEGATIVE_METHODS = {"softmax", "sigmoid", "exp"}
_SIGN_KEEPING = {"to", "float", "half", "bfloat16", "double", "type_as", "detach", "contiguous", "view", "reshape",
                 "flatten", "squeeze", "unsqueeze", "clone"}


def _nonnegative(module: ModuleInfo, scope: Scope, node: ast.expr, line: int) -> bool:
    """``node`` is >= 0 by construction: a softmax / sigmoid / exp, the values half of a top-k of one, through
    casts and views, or such a value divided by its own sum (a renormalisation), through names bound once."""
    for _ in range(10):
        if isinstance(node, ast.Name):
            reaching = _straight_line_definition(scope, node.id, line)
            if reaching is None:
                return False
            node, line = reaching
            continue
        if isinstance(node, ast.Subscript) and const_value(node.slice) == 0 and isinstance(node.value, ast.Call) \
                and _top_values_source(module, node.value) is not None:
            node = _top_values_source(module, node.value)  # type: ignore[assignment]
            continue
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _sum_of(node.right, node.left):
            node = node.left  # w / w.sum(-1, keepdim=True) (+ a positive constant)
            continue
        if not isinstance(node, ast.Call):
            return False
        canon = module.canonical(node.func) or ""
        if canon in _NONNEGATIVE_API:
            return True
        if isinstance(node.func, ast.Attribute) and not canon.startswith("torch."):
            if node.func.attr in _NONNEGATIVE_METHODS:
                return True
            if node.func.attr in _SIGN_KEEPING:
                node = node.func.value
                continue
        return False
    return False


def _straight_line_definition(scope: Scope, name: str, line: int) -> Optional[tuple[ast.expr, int]]:
    """(the value ``name`` holds at ``line``, the line it was bound on) where every binding of it is a statement of the
    function's straight-line body (or a ``with`` block in it): then the last one before ``line`` is the one that reaches
    it (``w = w / w.sum(-1, keepdim=True)`` rebinding ``w``). None for a binding under an ``if`` / loop, or none."""
    top: set[int] = set()
    todo = list(getattr(scope.node, "body", []))
    while todo:
        st = todo.pop()
        if isinstance(st, (ast.With, ast.AsyncWith)):
            todo.extend(st.body)
        top.add(id(st))
    bound = scope.assignments.get(name, [])
    if not bound or any(id(st) not in top for st, _v in bound):
        return None
    before = [(st, v) for st, v in bound if st.lineno < line]
    if not before:
        return None
    st, value = max(before, key=lambda b: b[0].lineno)
    return value, st.lineno


def _top_values_source(module: ModuleInfo, call: ast.Call) -> Optional[ast.expr]:
    """The tensor a ``topk`` is taken of (its values half holds values of it)."""
    canon = module.canonical(call.func) or ""
    if canon == "torch.topk" and call.args:
        return call.args[0]
    if isinstance(call.func, ast.Attribute) and call.func.attr == "topk" and not canon.startswith("torch."):
        return call.func.value
    return None


def _sum_of(node: ast.expr, of: ast.expr) -> bool:
    """``of.sum(..)`` (plus a positive constant): the positive denominator of a renormalisation."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        c = const_value(node.right)
        if isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0:
            node = node.left
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "sum" \
        and ast.dump(node.func.value) == ast.dump(of)


def _scatter_of(node: ast.expr) -> Optional[tuple[ast.expr, ast.expr, ast.expr, ast.expr]]:
    """``(receiver, dim, index, src)`` of ``R.scatter_(dim, index, src)`` / ``R.scatter(..)`` (positional or
    ``dim=`` / ``index=`` / ``src=`` / ``value=`` keywords); None otherwise."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("scatter_", "scatter")):
        return None
    args: dict[str, ast.expr] = dict(zip(("dim", "index", "src"), node.args))
    for k in node.keywords:
        key = "src" if k.arg == "value" else k.arg
        if key not in ("dim", "index", "src") or key in args:
            return None
        args[key] = k.value  # type: ignore[index]
    if set(args) != {"dim", "index", "src"} or len(node.args) > 3:
        return None
    return node.func.value, args["dim"], args["index"], args["src"]


def _one_hot_weighted(module: ModuleInfo, node: ast.expr) -> Optional[tuple[str, str]]:
    """``(idx, w)`` of ``(F.one_hot(idx, E) * w.unsqueeze(-1)).sum(dim=1)`` (``w[..., None]``, ``w[:, :, None]``,
    either order, a cast of the one-hot, ``.sum(-2)``): each row's weights at its ids, zeros elsewhere."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "sum"):
        return None
    dims = [const_value(a) for a in node.args] + [const_value(k.value) for k in node.keywords if k.arg == "dim"]
    prod = node.func.value
    if dims not in ([1], [-2]) or any(k.arg != "dim" for k in node.keywords) \
            or not (isinstance(prod, ast.BinOp) and isinstance(prod.op, ast.Mult)):
        return None
    for oh, w in ((prod.left, prod.right), (prod.right, prod.left)):
        while isinstance(oh, ast.Call) and isinstance(oh.func, ast.Attribute) and oh.func.attr in ("float", "to", "type_as", "half", "bfloat16"):
            oh = oh.func.value
        if not (isinstance(oh, ast.Call) and (module.canonical(oh.func) or "") == "torch.nn.functional.one_hot"
                and oh.args and isinstance(oh.args[0], ast.Name)):
            continue
        col = None
        if isinstance(w, ast.Call) and isinstance(w.func, ast.Attribute) and w.func.attr == "unsqueeze" \
                and [const_value(a) for a in w.args] == [-1] and not w.keywords:
            col = w.func.value
        elif isinstance(w, ast.Subscript) and isinstance(w.slice, ast.Tuple) and isinstance(w.slice.elts[-1], ast.Constant) \
                and w.slice.elts[-1].value is None and all(
                    isinstance(p, ast.Slice) and p.lower is None and p.upper is None and p.step is None
                    or isinstance(p, ast.Constant) and p.value is Ellipsis for p in w.slice.elts[:-1]):
            col = w.value
        if isinstance(col, ast.Name):
            return oh.args[0].id, col.id
    return None


def _in_place_writes(scope: Scope, name: str) -> list[ast.AST]:
    """Every ``name[..] = ..`` / ``name += ..`` / ``name.<op>_(..)`` of the scope."""
    nodes = scope.nodes()
    found: list[ast.AST] = [s for s in nodes.get(ast.Subscript, ()) if isinstance(s.ctx, ast.Store)  # type: ignore[attr-defined]
                            and isinstance(s.value, ast.Name) and s.value.id == name]  # type: ignore[attr-defined]
    found += [a for a in nodes.get(ast.AugAssign, ()) if isinstance(a.target, ast.Name) and a.target.id == name]  # type: ignore[attr-defined]
    found += [c for c in nodes.get(ast.Call, ()) if isinstance(c.func, ast.Attribute)  # type: ignore[attr-defined]
              and c.func.attr.endswith("_") and not c.func.attr.endswith("__")  # type: ignore[attr-defined]
              and isinstance(c.func.value, ast.Name) and c.func.value.id == name]  # type: ignore[attr-defined]
    return found


def _scatter_build(module: ModuleInfo, scope: Scope, gates: str, before: int) -> Optional[tuple[str, str, int]]:
    """``(idx, w, dim)`` when ``gates`` is bound once in ``scope`` to zeros and one ``gates.scatter_(dim, idx, w)``
    follows at the function's top level (or ``gates = zeros(..).scatter(dim, idx, w)`` in one expression, or a
    weighted one-hot summed over the slots), nothing else writes it in place, ``idx`` and ``w`` are names."""
    bound = scope.assignments.get(gates, [])
    if len(bound) != 1 or bound[0][0].lineno >= before:
        return None
    stmt, value = bound[0]
    writes = _in_place_writes(scope, gates)
    one_hot = _one_hot_weighted(module, value)
    if one_hot is not None:
        return (one_hot[0], one_hot[1], -1) if not writes else None
    scatter = _scatter_of(value)
    if not _zeros(module, scatter[0] if scatter is not None else value):
        return None
    if scatter is None:
        body = getattr(scope.node, "body", [])
        calls = [st.value for st in body if isinstance(st, ast.Expr) and stmt.lineno < st.lineno < before
                 and isinstance(st.value, ast.Call) and st.value.func.__class__ is ast.Attribute
                 and st.value.func.attr == "scatter_" and isinstance(st.value.func.value, ast.Name)  # type: ignore[attr-defined]
                 and st.value.func.value.id == gates]  # type: ignore[attr-defined]
        if len(calls) != 1 or writes != calls:
            return None  # (another in-place write: not only the scattered weights)
        scatter = _scatter_of(calls[0])
    elif writes:
        return None
    if scatter is None:
        return None
    _, dim, index, src = scatter
    d = const_value(dim)
    if d not in (1, -1) or isinstance(d, bool) or not isinstance(index, ast.Name) or not isinstance(src, ast.Name):
        return None
    return index.id, src.id, int(d)  # type: ignore[call-overload]


def _zeros(module: ModuleInfo, node: ast.expr) -> bool:
    """``torch.zeros_like(t[, dtype=..])`` / ``torch.zeros(..)`` / ``t.new_zeros(..)``: all zeros."""
    if not isinstance(node, ast.Call):
        return False
    canon = module.canonical(node.func) or ""
    if canon in ("torch.zeros_like", "torch.zeros"):
        return all(k.arg in ("dtype", "device", "layout") for k in node.keywords)
    return isinstance(node.func, ast.Attribute) and node.func.attr == "new_zeros" and not canon.startswith("torch.") \
        and all(k.arg in ("dtype", "device") for k in node.keywords)


def scattered_gate_indices(module: ModuleInfo, scope: Scope, gates: str, before: int) -> Optional[tuple[str, int]]:
    """``(idx, scatter dim)`` when ``gates`` holds >= 0 top-k weights scattered into zeros at the top-k indices ``idx``
    (a name of this function): built here, or returned by a helper method / function of this module beside the
    indices (``gates, idx = self._compute_gating(x)``). Then ``gates[:, e] > 0`` holds for the tokens whose top-k ids
    hold e (the ids of one row are distinct), except where a weight is exactly 0 (an underflowed softmax): such a
    token adds ``0 * expert(x)`` in the fused layer, which is 0 for a finite expert output; its gradients are 0 too
    (the softmax's backward multiplies by that 0 probability). None otherwise."""
    bound = scope.assignments.get(gates, [])
    if len(bound) != 1 or bound[0][0].lineno >= before:
        return None
    stmt, value = bound[0]
    from npufuse.patterns.moe_experts import _helper_call

    if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Call) and isinstance(const_value(value.slice), int):
        call, k = value.value, int(const_value(value.slice))  # type: ignore[arg-type]
        helper = _helper_call(module, scope, call)
        if helper is None or not isinstance(stmt, ast.Assign) or not isinstance(stmt.targets[0], ast.Tuple) \
                or not 0 <= k < len(helper.returned) or not isinstance(helper.returned[k], ast.Name):
            return None
        inner = helper.scope
        end = inner.node.body[-1].lineno  # type: ignore[attr-defined]
        built = _scatter_build(module, inner, helper.returned[k].id, end)  # type: ignore[attr-defined]
        if built is None or not _nonnegative(module, inner, ast.Name(built[1], ast.Load()), end) \
                or top_call_of(module, inner, built[0], end) is None:
            return None
        # the caller's name of the same call's element that returns the scatter's indices
        names = stmt.targets[0].elts  # type: ignore[attr-defined]
        j = next((j for j, r in enumerate(helper.returned) if isinstance(r, ast.Name) and r.id == built[0]), None)
        if j is None or j >= len(names) or not isinstance(names[j], ast.Name) \
                or len(scope.assignments.get(names[j].id, [])) != 1:
            return None
        return names[j].id, built[2]
    built = _scatter_build(module, scope, gates, before)
    if built is None or not _nonnegative(module, scope, ast.Name(built[1], ast.Load()), before) \
            or top_call_of(module, scope, built[0], before) is None:
        return None
    return built[0], built[2]


# -- examples (``s45a_*``) ----------------------------------------------------------------------------------------------

_HEAD = '''\
import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))

    def forward(self, x):
        return self.net(x)
'''

# Spektron's form: the gating helper returns dense gates (softmax over the top-k logits scattered into zeros) beside
# the ids; the loop selects each expert's tokens as `gates[:, i] > 0`
DENSE_HELPER = _HEAD + '''

class DenseGateMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.k = k
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([Expert(d, h) for _ in range(n)])

    def _gating(self, x):
        logits = self.gate(x)
        top_logits, top_idx = logits.topk(self.k, dim=-1)
        top_gates = F.softmax(top_logits.float(), dim=-1).to(top_logits.dtype)
        gates = torch.zeros_like(logits, dtype=top_gates.dtype)
        gates.scatter_(1, top_idx, top_gates)
        return gates, top_idx

    def forward(self, x):
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        gates, indices = self._gating(flat)
        load = gates.sum(dim=0).detach()
        output = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            mask = gates[:, i] > 0
            if mask.any():
                out_i = expert(flat[mask])
                output[mask] += gates[mask, i].unsqueeze(-1) * out_i
        return output.reshape(b, s, d), load
'''
DENSE_RUN = '''\
m = DenseGateMoE(16, 24, 5, 2)
x = torch.randn(2, 7, 16, requires_grad=True)
out, load = m(x)
leaves = [x, m.gate.weight, m.experts[0].net[0].weight, m.experts[4].net[2].bias]
'''
# in the function: chained scatter over the last dim, `!= 0`, renormalised top-k probabilities, a range(E) loop
DENSE_CHAINED = DENSE_HELPER.replace('''        gates, indices = self._gating(flat)
''', '''        probs = self.gate(flat).softmax(dim=-1)
        top_p, indices = torch.topk(probs, self.k, dim=-1)
        top_p = top_p / (top_p.sum(dim=-1, keepdim=True) + 1e-9)
        gates = torch.zeros_like(probs).scatter(-1, indices, top_p)
''').replace("for i, expert in enumerate(self.experts):\n            mask = gates[:, i] > 0",
             "for i in range(len(self.experts)):\n            expert = self.experts[i]\n            mask = gates[:, i] != 0")
# a weighted one-hot summed over the slots, sigmoid weights, a `.bool()` column, keyword scatter arguments elsewhere
DENSE_ONE_HOT = DENSE_CHAINED.replace('''        top_p = top_p / (top_p.sum(dim=-1, keepdim=True) + 1e-9)
        gates = torch.zeros_like(probs).scatter(-1, indices, top_p)
''', '''        top_p = torch.sigmoid(top_p)
        gates = (F.one_hot(indices, num_classes=len(self.experts)).float() * top_p.unsqueeze(-1)).sum(dim=1)
''').replace("mask = gates[:, i] != 0", "mask = gates[:, i].bool()")
DENSE_KEYWORDS = DENSE_HELPER.replace("gates.scatter_(1, top_idx, top_gates)", "gates.scatter_(dim=1, index=top_idx, src=top_gates)")

FUSE = [
    # moe44a's membership matrix scattered with the softmax weights themselves (>= 0), its column read `.bool()`
    Fuse(s44a.SCATTERED.replace(s44a._SCATTER, "        expert_mask.scatter_(1, top_idx, weights)\n"),
         name="s45a_dense_gates_softmax_weights_scattered_bool_column", run=s44a.SCATTERED_RUN,
         expect={"routing": "mask_where", "indices": "top_idx"}),
    Fuse(DENSE_HELPER, name="s45a_dense_gates_scattered_by_a_helper_column_gt_zero", run=DENSE_RUN,
         expect={"routing": "mask_where", "indices": "indices", "tokens": "flat"}),
    Fuse(DENSE_CHAINED, name="s45a_dense_gates_chained_scatter_renormalised_ne_zero", run=DENSE_RUN,
         expect={"routing": "mask_where", "indices": "indices"}),
    Fuse(DENSE_ONE_HOT, name="s45a_dense_gates_weighted_one_hot_sigmoid_bool", run=DENSE_RUN,
         expect={"routing": "mask_where", "indices": "indices"}),
    Fuse(DENSE_KEYWORDS, name="s45a_dense_gates_scatter_keywords", run=DENSE_RUN, expect={"routing": "mask_where"}),
]

_NOT_READ = "which npufuse does not read as the tokens routed to this expert"
KEEP = [
    # raw logits scattered: a negative weight fails `> 0`, so the loop drops a routed token the permute would keep
    Keep(DENSE_HELPER.replace("gates.scatter_(1, top_idx, top_gates)", "gates.scatter_(1, top_idx, top_logits)"),
         reason=_NOT_READ, name="s45a_dense_gates_of_raw_logits"),
    # a shared column written after the scatter: every token reaches expert 0, not only its top-k
    Keep(DENSE_HELPER.replace("        return gates, top_idx\n", "        gates[:, 0] = 1.0\n        return gates, top_idx\n"),
         reason=_NOT_READ, name="s45a_dense_gates_changed_after_the_scatter"),
    # a per-expert count of `gates[:, i] > 0`: a routed token whose weight underflowed to 0 is not counted there,
    # while the fused layer's count of the ids includes it
    Keep(DENSE_HELPER.replace("        output = torch.zeros_like(flat)\n", "        output = torch.zeros_like(flat)\n"
                              "        usage = torch.zeros(len(self.experts))\n").replace(
        "            if mask.any():\n", "            usage[i] = mask.sum()\n            if mask.any():\n"),
         reason="which leaves out routed tokens whose weight is 0", name="s45a_dense_gates_counted_per_expert"),
    # a threshold: tokens whose weight is below it are dropped (a capacity-like filter)
    Keep(DENSE_HELPER.replace("mask = gates[:, i] > 0", "mask = gates[:, i] > 0.2"), reason=_NOT_READ,
         name="s45a_dense_gates_above_a_threshold"),
    # ids handed in (not top-k: a row may repeat an id, and scatter keeps one of the weights)
    Keep(DENSE_CHAINED.replace("    def forward(self, x):\n", "    def forward(self, x, indices):\n").replace(
        "        top_p, indices = torch.topk(probs, self.k, dim=-1)\n", "        top_p = probs.gather(-1, indices)\n"),
         reason=_NOT_READ, name="s45a_dense_gates_at_ids_handed_in"),
]


# -- sorted dispatch combined by scatter_add_ (FoundationTS MOELayer) ---------------------------------------------------

def flattens(node: ast.expr) -> bool:
    """``E.reshape(M)`` / ``E.view(N * K)``: a reshape to ONE dim keeps every element in row-major order (or raises),
    whatever M is: the flatten. A ``view`` whose argument may be a dtype (a bit reinterpretation) is not this."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("view", "reshape")
            and len(node.args) == 1 and not node.keywords):
        return False
    arg = node.args[0]
    c = const_value(arg)
    if isinstance(c, int) and not isinstance(c, bool):
        return True
    # s47 review: arithmetic of numbers (a BinOp of tuples, ``E.shape[:-1] + (-1,)``, is a shape of several dims)
    size = isinstance(arg, ast.BinOp) and _moe_s47review.size_expr(arg) or isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) \
        and arg.func.attr in ("numel", "nelement")
    return size or node.func.attr == "reshape" and isinstance(arg, ast.Name)


def scatter_add_rows(call: ast.Call, stmt: ast.stmt, scope: Scope) -> Optional[tuple[ast.Name, ast.Name] | str]:
    """``(tok, rows)`` of ``out.scatter_add_(0, tok.unsqueeze(-1).expand(-1, W), rows)`` (``index=`` / ``src=``
    keywords; the index ``tok[:, None]`` / ``tok.view(-1, 1)``, ``.expand_as(rows)`` / ``.expand(-1, W)`` /
    ``.expand(n, W)``, inline or bound just before): row j of ``rows`` added to row ``tok[j]`` of ``out`` over the
    columns both cover, which is ``index_add_(0, tok, rows)`` where ``W`` is ``rows``' width or ``out``'s (the fused
    text adds the overlap: :func:`overlap_add_line`). ``W`` must be written as one of those widths: a row-add index
    of another width gives the reason (a str); other forms None."""
    dim, index, src = keyword(call, "dim", 0), keyword(call, "index", 1), keyword(call, "src", 2)
    if not (dim is not None and const_value(dim) == 0 and index is not None and isinstance(src, ast.Name)):
        return None
    if isinstance(index, ast.Name):
        bound = scope.assignments.get(index.id, [])
        if len(bound) != 1:
            return None
        index = bound[0][1]
    if not (isinstance(index, ast.Call) and isinstance(index.func, ast.Attribute) and index.func.attr in ("expand", "expand_as")):
        return None
    col = index.func.value
    tok: Optional[ast.expr] = None
    if isinstance(col, ast.Call) and isinstance(col.func, ast.Attribute) and not col.keywords and (
            col.func.attr == "unsqueeze" and [const_value(a) for a in col.args] in ([1], [-1])
            or col.func.attr in ("view", "reshape") and [const_value(a) for a in col.args] == [-1, 1]):
        tok = col.func.value
    elif isinstance(col, ast.Subscript) and isinstance(col.slice, ast.Tuple) and len(col.slice.elts) == 2 \
            and isinstance(col.slice.elts[0], ast.Slice) and const_value(col.slice.elts[1]) is None \
            and isinstance(col.slice.elts[1], ast.Constant):
        tok = col.value
    if not isinstance(tok, ast.Name):
        return None
    why = (f"rows are added back by `{ast.unparse(call.func)}` at `{ast.unparse(index)[:60]}`, whose width npufuse does "
           f"not read as all the columns of `{src.id}` or of the output (a narrower index adds only some columns)")
    if index.func.attr == "expand_as":
        ok = len(index.args) == 1 and isinstance(index.args[0], ast.Name) and index.args[0].id == src.id
    else:
        ok = len(index.args) == 2 and not index.keywords and _width_of_either(index.args[1], src.id, call, scope, stmt)
    return (tok, src) if ok else why


def _width_of_either(width: ast.expr, rows: str, call: ast.Call, scope: Scope, stmt: ast.stmt) -> bool:
    """``width`` is written as the rows' last dim (``rows.shape[-1]`` / ``rows.size(1)``) or as the last size of
    the output's allocation (``out = torch.zeros(N, D)`` and ``expand(-1, D)``)."""
    text = ast.unparse(width)
    if text in (f"{rows}.shape[-1]", f"{rows}.shape[1]", f"{rows}.size(-1)", f"{rows}.size(1)"):
        return True
    out = call.func.value if isinstance(call.func, ast.Attribute) else None
    if not isinstance(out, ast.Name):
        return False
    alloc = scope.definition(out.id, stmt.lineno)
    if isinstance(alloc, ast.Call) and isinstance(alloc.func, ast.Attribute) and alloc.func.attr in ("zeros", "new_zeros") \
            and alloc.args and not any(isinstance(a, ast.Starred) for a in alloc.args):
        dims = alloc.args[0].elts if len(alloc.args) == 1 and isinstance(alloc.args[0], (ast.Tuple, ast.List)) else alloc.args
        return len(dims) == 2 and ast.unparse(dims[-1]) == text
    return False


def sorted_other_way(scope: Scope, order: str, line: int) -> bool:
    """``order`` is a sort order, but descending or along another dim (``x.sort(descending=True)[1]``, ``argsort(x,
    dim=0, descending=True)``): the rows are grouped by expert in another order than the permute's."""
    node = scope.definition(order, line)
    if isinstance(node, ast.Subscript) and const_value(node.slice) == 1:
        node = node.value
    return isinstance(node, ast.Call) and (dotted(node.func) or "").rsplit(".", 1)[-1] in ("sort", "argsort") \
        and any(k.arg in ("descending", "dim") for k in node.keywords)


def overlap_add_line(target: str, y: str) -> str:
    """``target`` += ``y`` over the columns both have: what the scatter_add over an index as wide as one of them adds."""
    return f"{target}[..., :{y}.shape[-1]] += {y}[..., :{target}.shape[-1]]  # (the columns the scatter_add index covers)"


# FoundationTS's form: routes sorted by expert, offsets of a bincount, per-expert slices skipped when empty, weighted
# and added back with scatter_add_ over the token index expanded across the output's columns
SORTED_SCATTER_ADD = _HEAD + '''

class SortedMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.n, self.k = n, k
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([Expert(d, h) for _ in range(n)])

    def forward(self, hidden):
        B, T, D = hidden.shape
        N = B * T
        scores = self.router(hidden).softmax(dim=-1)
        top_w, top_i = torch.topk(scores, k=self.k)
        x = hidden.reshape(N, D)
        M = N * self.k
        expert_for_route = top_i.reshape(M)
        gate_for_route = top_w.reshape(M)
        token_ids = torch.arange(N, device=x.device)
        token_for_route = token_ids.repeat_interleave(self.k)
        expert_sorted, order = torch.sort(expert_for_route)
        gate_sorted = gate_for_route[order]
        token_sorted = token_for_route[order]
        x_sorted = x[token_sorted]
        counts = torch.bincount(expert_sorted, minlength=self.n)
        offsets = torch.cumsum(counts, dim=0)
        starts = offsets - counts
        y_sorted = torch.empty_like(x_sorted)
        for i, expert in enumerate(self.experts):
            s_i, t = starts[i], offsets[i]
            if s_i == t:
                continue
            y_sorted[s_i:t] = expert(x_sorted[s_i:t])
        y_sorted = y_sorted * gate_sorted.unsqueeze(-1)
        y_out = torch.zeros(N, D, device=y_sorted.device, dtype=y_sorted.dtype)
        y_out.scatter_add_(0, index=token_sorted.unsqueeze(-1).expand(-1, D), src=y_sorted)
        return y_out.reshape(B, T, D), counts
'''
SORTED_SCATTER_ADD_RUN = '''\
m = SortedMoE(16, 24, 5, 2)
x = torch.randn(2, 7, 16, requires_grad=True)
out = m(x)
leaves = [x, m.router.weight, m.experts[0].net[0].weight, m.experts[4].net[2].bias]
'''
# argsort (stable), histc counts with host offsets, the index `tok[:, None].expand_as(rows)`, scatter_add (not in place)
SORTED_HISTC = SORTED_SCATTER_ADD.replace(
    "        expert_sorted, order = torch.sort(expert_for_route)\n",
    "        order = torch.argsort(expert_for_route, stable=True)\n        expert_sorted = expert_for_route[order]\n").replace(
    '''        counts = torch.bincount(expert_sorted, minlength=self.n)
        offsets = torch.cumsum(counts, dim=0)
        starts = offsets - counts
''', '''        counts = torch.histc(expert_sorted.float(), bins=self.n, min=0, max=self.n - 1).long()
        offsets = counts.cumsum(0).tolist()
        starts = [0] + offsets[:-1]
''').replace('''        y_out = torch.zeros(N, D, device=y_sorted.device, dtype=y_sorted.dtype)
        y_out.scatter_add_(0, index=token_sorted.unsqueeze(-1).expand(-1, D), src=y_sorted)
''', '''        base = torch.zeros(N, D, device=y_sorted.device, dtype=y_sorted.dtype)
        y_out = base.scatter_add(0, token_sorted[:, None].expand_as(y_sorted), y_sorted)
''')
# per-expert counts by comparison, `// K` tokens (no arange), a named index of the rows' width, in-place weighting
SORTED_FLOOR = SORTED_SCATTER_ADD.replace('''        token_ids = torch.arange(N, device=x.device)
        token_for_route = token_ids.repeat_interleave(self.k)
        expert_sorted, order = torch.sort(expert_for_route)
        gate_sorted = gate_for_route[order]
        token_sorted = token_for_route[order]
''', '''        expert_sorted, order = expert_for_route.sort()
        gate_sorted = gate_for_route[order]
        token_sorted = order // self.k
''').replace('''        counts = torch.bincount(expert_sorted, minlength=self.n)
''', '''        counts = (expert_sorted[:, None] == torch.arange(self.n, device=x.device)).sum(0)
''').replace('''        y_out.scatter_add_(0, index=token_sorted.unsqueeze(-1).expand(-1, D), src=y_sorted)
''', '''        rows_index = token_sorted.view(-1, 1).expand(-1, y_sorted.shape[-1])
        y_out.scatter_add_(0, rows_index, y_sorted)
''')

FUSE += [
    Fuse(SORTED_SCATTER_ADD, name="s45a_sorted_routes_bincount_offsets_scatter_add", run=SORTED_SCATTER_ADD_RUN,
         expect={"routing": "sorted_pairs", "tokens": "x", "indices": "top_i", "probs": "top_w", "output": "y_out"}),
    Fuse(SORTED_HISTC, name="s45a_sorted_routes_stable_argsort_histc_scatter_add_copy", run=SORTED_SCATTER_ADD_RUN,
         expect={"routing": "sorted_pairs", "indices": "top_i", "output": "y_out"}),
    Fuse(SORTED_FLOOR, name="s45a_sorted_routes_floor_tokens_named_index", run=SORTED_SCATTER_ADD_RUN,
         expect={"routing": "sorted_pairs", "indices": "top_i"}),
]
KEEP += [
    # an index narrower than both the rows and the output: only the first half of the columns is added back
    Keep(SORTED_SCATTER_ADD.replace(".expand(-1, D)", ".expand(-1, D // 2)"), reason="whose width npufuse does not read",
         name="s45a_sorted_routes_scatter_add_of_half_the_columns"),
    # the weights taken in token order, not in the sort order: each sorted row would get another slot's weight
    Keep(SORTED_SCATTER_ADD.replace("gate_sorted = gate_for_route[order]", "gate_sorted = gate_for_route[token_sorted]"),
         reason="is not the flat routing weights taken in the sort order", name="s45a_sorted_routes_weights_in_token_order"),
    # sorted descending: the rows are grouped by expert in the other order than the permute's
    Keep(SORTED_SCATTER_ADD.replace("torch.sort(expert_for_route)", "torch.sort(expert_for_route, descending=True)"),
         reason="is not the ascending sort order", name="s45a_sorted_routes_sorted_descending"),
]
