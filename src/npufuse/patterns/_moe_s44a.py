"""s44 (helper moe44a): moe_experts skip guards written in other ways.

A loop over experts may skip (``if <empty>: continue``) or guard (``if <non-empty>: <body>``) an expert on a count
of its rows. The loop analysis read a fixed set of spellings (``count == 0``, ``count > 0``, ``not mask.any()``); real
code also writes ``counts[i] > 0`` around the body (counts from ``bincount`` of the indices), ``0 < n``,
``n >= 1``, ``n < 1``, a bare ``if n:`` or ``not n``. All of these say "this count is (not) zero" when the count is a
non-negative integer; :func:`emptiness` turns them into one normal form, and the loop analysis then proves the count
is the number of rows this expert takes (the same mask / index / bincount of the indices the body dispatches).
Anything else (``n > 1``, ``n >= 0``, a capacity, a flag) is not an emptiness test and stays refused.

The functions here read syntax only and return facts (or None); ``moe_experts`` calls them from its loop analysis.
"""

from __future__ import annotations

import ast
from typing import Callable, Optional

from npufuse.patterns import _moe_s42c as s42c
from npufuse.patterns._moe_s43c import _init
from npufuse.patterns.base import Fuse, Keep
from npufuse.patterns import _rope_s48r
from npufuse.scan.dataflow import Scope, const_value

# comparison of a count c with a constant on the right: (operator, constant) -> True when the test is "c > 0",
# False when it is "c == 0" (c a non-negative integer)
_COUNT_FORMS: dict[tuple[type, int], bool] = {
    (ast.Gt, 0): True, (ast.NotEq, 0): True, (ast.GtE, 1): True,
    (ast.Eq, 0): False, (ast.LtE, 0): False, (ast.Lt, 1): False,
}
# the same comparison with the constant on the left (`0 < c` is `c > 0`)
_MIRRORED: dict[type, type] = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE,
                               ast.Eq: ast.Eq, ast.NotEq: ast.NotEq}


def _int_constant(node: ast.expr) -> Optional[int]:
    value = const_value(node)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def emptiness(test: ast.expr, strip: Callable[[ast.expr], ast.expr]) -> Optional[tuple[bool, ast.expr]]:
    """``(nonempty, count)`` when ``test`` is true exactly when the non-negative integer ``count`` is non-zero
    (``nonempty`` True: ``c > 0``, ``c != 0``, ``c >= 1``, ``0 < c``, a bare ``c``) or zero (False: ``c == 0``,
    ``c <= 0``, ``c < 1``, ``not c``); ``strip`` removes conversions that keep zero-ness (``int(c)``, ``c.item()``).
    None for any other test: whether ``count`` counts this expert's rows is the caller's proof."""
    test = strip(test)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = emptiness(test.operand, strip)
        return (not inner[0], inner[1]) if inner is not None else None
    if isinstance(test, ast.Compare):
        if len(test.ops) != 1:
            return None
        op, left, right = type(test.ops[0]), test.left, test.comparators[0]
        if _int_constant(right) is None and _int_constant(left) is not None:
            op, left, right = _MIRRORED.get(op, ast.Is), right, left
        constant = _int_constant(right)
        if constant is None or _int_constant(left) is not None:
            return None
        nonempty = _COUNT_FORMS.get((op, constant))
        return (nonempty, strip(left)) if nonempty is not None else None
    if isinstance(test, (ast.BoolOp, ast.Constant, ast.Name)):
        return None  # `a and b`; a constant; a bare name (a flag as often as a count)
    return True, test  # `if counts[i]:`, `if rows.shape[0]:`: truthy exactly when non-zero


def subscript_of_index(node: ast.expr, is_index: Callable[[ast.expr], bool]) -> Optional[str]:
    """``counts`` of ``counts[e]`` (``e`` the loop's expert index, ``counts`` a plain name), else None."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and is_index(node.slice):
        return node.value.id
    return None


def counted_tensor(count: ast.expr) -> Optional[ast.Name]:
    """``X`` of a count of X's rows or entries: ``X.sum()``, ``X.any()``, ``X.numel()``, ``X.count_nonzero()``,
    ``X.size(0)``, ``X.shape[0]``, ``len(X)``, ``torch.any(X)`` / ``torch.sum(X)`` (X a plain name); else None."""
    node: ast.expr = count
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
        node = node.value.value
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in ("sum", "any", "numel", "count_nonzero", "size", "nelement"):
        node = node.func.value
    elif isinstance(node, ast.Call) and len(node.args) == 1 and (
            isinstance(node.func, ast.Name) and node.func.id == "len"
            or isinstance(node.func, ast.Attribute) and node.func.attr in ("any", "sum", "numel", "count_nonzero")):
        node = node.args[0]
    else:
        return None
    return node if isinstance(node, ast.Name) else None


def _scatter_of(node: ast.expr) -> Optional[tuple[ast.expr, ast.expr, ast.expr, ast.expr]]:
    """``(receiver, dim, index, value)`` of ``R.scatter_(dim, index, value)`` / ``R.scatter(dim, index, value)``
    (positional, or ``value=`` / ``index=`` / ``dim=`` keywords); else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("scatter_", "scatter")):
        return None
    args: dict[str, ast.expr] = dict(zip(("dim", "index", "value"), node.args))
    for k in node.keywords:
        if k.arg not in ("dim", "index", "value") or k.arg in args:
            return None
        args[k.arg] = k.value
    if set(args) != {"dim", "index", "value"}:
        return None
    return node.func.value, args["dim"], args["index"], args["value"]


def _zeros_2d(node: ast.expr) -> bool:
    """``torch.zeros(a, b, ...)`` / ``torch.zeros((a, b))`` / ``t.new_zeros(a, b)`` (two dims, keywords free)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("zeros", "new_zeros")):
        return False
    dims = node.args[0].elts if len(node.args) == 1 and isinstance(node.args[0], (ast.Tuple, ast.List)) else node.args
    return len(dims) == 2 and not any(isinstance(d, ast.Starred) for d in dims)


def scatter_membership(fn: ast.AST, loop: ast.For, matrix: str, assignments: dict[str, list[tuple[ast.stmt, ast.expr]]],
                       is_index: Callable[[ast.expr], bool], scope: Optional[Scope] = None) -> Optional[str]:
    """The indices ``idx`` when ``matrix`` is a [T, E] membership matrix of them: bound once in the function, before
    the loop, to 2-D zeros that one ``matrix.scatter_(1, idx, c)`` (or a chained ``zeros(..).scatter_(1, idx, c)``)
    fills with a non-zero constant c, read nowhere else but ``matrix[:, e]`` inside the loop; ``idx`` (a name) is not
    rebound after the scatter nor in the loop. Then ``matrix[:, e] != 0`` holds exactly for the rows whose top-k ids
    hold e: ``(idx == e).any(dim=-1)``. None otherwise (deepsaia moe_llama's router mask, written in one function)."""
    bound = assignments.get(matrix, [])
    if len(bound) != 1 or bound[0][0].lineno >= loop.lineno:
        return None
    if scope is not None and not _rope_s48r.stored_once(scope, matrix):
        return None  # s50: the one "bound once" reader (a for / with / walrus target rebinding it too)
    stmt, value = bound[0]
    scatter = _scatter_of(value)
    scatter_line = stmt.lineno
    if scatter is not None and not _zeros_2d(scatter[0]):
        return None
    if scatter is None and not _zeros_2d(value):
        return None
    reads_ok: set[int] = set()
    for n in ast.walk(loop):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == matrix \
                and isinstance(n.slice, ast.Tuple) and len(n.slice.elts) == 2 and isinstance(n.slice.elts[0], ast.Slice) \
                and n.slice.elts[0].lower is None and n.slice.elts[0].upper is None and n.slice.elts[0].step is None \
                and is_index(n.slice.elts[1]) and isinstance(n.ctx, ast.Load):
            reads_ok.add(id(n.value))
    for n in ast.walk(fn):
        if isinstance(n, ast.Expr) and scatter is None and _scatter_of(n.value) is not None:
            found = _scatter_of(n.value)
            if isinstance(found[0], ast.Name) and found[0].id == matrix:  # type: ignore[index]
                if scatter is not None or not (stmt.lineno < n.lineno < loop.lineno):
                    return None
                scatter, scatter_line = found, n.lineno
                reads_ok.add(id(found[0]))  # type: ignore[index]
    if scatter is None or not reads_ok:
        return None
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and n.id == matrix and isinstance(n.ctx, ast.Load) and id(n) not in reads_ok:
            return None  # read (or changed) anywhere else: not provably the scattered membership
    _, dim, index, fill = scatter
    c = const_value(fill)
    # (s45 review) c in [1, 127]: a negative c fails ``M[:, e] > 0`` for every member; a fraction truncates to 0 in an
    # integer matrix (``zeros(.., dtype=torch.long)``) and a large one wraps in int8: the column would not be membership
    if const_value(dim) not in (1, -1) or not isinstance(index, ast.Name) or isinstance(c, bool) \
            or not isinstance(c, (int, float)) or not 1 <= c <= 127:
        return None
    idx = index.id
    if any(st.lineno > scatter_line for st, _ in assignments.get(idx, []) if st.lineno < loop.lineno) \
            or any(isinstance(n, ast.Name) and n.id == idx and isinstance(n.ctx, ast.Store) for n in ast.walk(loop)):
        return None
    return idx


def membership_column(node: ast.expr, matrix_of: Callable[[str], Optional[str]], is_index: Callable[[ast.expr], bool]) -> Optional[tuple[str, ast.expr]]:
    """``(idx, e)`` for a boolean read of a membership matrix's column: ``M[:, e].bool()``, ``M[:, e] > 0``,
    ``M[:, e] != 0``, ``M[:, e].to(torch.bool)``, with ``matrix_of(M)`` the indices M was scattered from."""
    col: Optional[ast.expr] = None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.keywords and (
            node.func.attr == "bool" and not node.args
            or node.func.attr == "to" and len(node.args) == 1 and ast.unparse(node.args[0]) == "torch.bool"):
        col = node.func.value
    elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Gt, ast.NotEq)) \
            and const_value(node.comparators[0]) == 0 and not isinstance(const_value(node.comparators[0]), bool):
        col = node.left
    if not (isinstance(col, ast.Subscript) and isinstance(col.value, ast.Name) and isinstance(col.slice, ast.Tuple)
            and len(col.slice.elts) == 2 and is_index(col.slice.elts[1])):
        return None
    idx = matrix_of(col.value.id)
    return (idx, col.slice.elts[1]) if idx is not None else None


def handed_in_offsets(loop: ast.For, g: str, args: list[str], assigned: set[str]) -> Optional[ast.Name]:
    """``T`` when the loop over groups ``g`` reads ``T[g + 1]`` of a table ``T`` that is a parameter of the function
    and never rebound (ppl.pmx's ``expert_offset``: ``X[T[g]:T[g + 1]]``, rows already sorted by expert): group g's
    rows would be ``T[g]:T[g + 1]``, a grouped matmul over ``diff(T)`` where ``T[0] == 0`` and ``T`` never decreases
    (run-time checks of the caller); None otherwise."""
    for n in ast.walk(loop):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id in args \
                and n.value.id not in assigned and isinstance(n.slice, ast.BinOp) and isinstance(n.slice.op, ast.Add) \
                and isinstance(n.slice.left, ast.Name) and n.slice.left.id == g and const_value(n.slice.right) == 1:
            return n.value
    return None


def group_size_difference(count: ast.expr, is_end: Callable[[ast.expr], bool], is_start: Callable[[ast.expr], bool]) -> bool:
    """``T[g + 1] - T[g]``: the size of group g in a table of offsets (the caller says which reads are which)."""
    return isinstance(count, ast.BinOp) and isinstance(count.op, ast.Sub) and is_end(count.left) and is_start(count.right)


def group_bias(node: ast.expr, is_group: Callable[[ast.expr], bool],
               invariant: Callable[[ast.expr], bool]) -> Optional[tuple[ast.expr, Optional[ast.expr]]]:
    """``(B, test)`` for the bias argument of ``F.linear(rows, W[g], <bias>)`` in a loop over groups g: ``B[g]``
    (test None), ``B[g] if <test> else None`` or ``None if <not test> else B[g]`` with a test the loop never changes
    (ppl.pmx's ``B[i] if B is not None else None``); ``(None, None)``-like absence is the caller's two-argument form.
    None for anything else (a bias that is not one row per group of a stacked table)."""
    def row(n: ast.expr) -> Optional[ast.expr]:
        if isinstance(n, ast.Subscript) and is_group(n.slice) and isinstance(n.value, (ast.Name, ast.Attribute)) \
                and invariant(n.value):
            return n.value
        return None

    if row(node) is not None:
        return row(node), None  # type: ignore[return-value]
    if isinstance(node, ast.IfExp) and invariant(node.test):
        if row(node.body) is not None and isinstance(node.orelse, ast.Constant) and node.orelse.value is None:
            return row(node.body), node.test  # type: ignore[return-value]
        if row(node.orelse) is not None and isinstance(node.body, ast.Constant) and node.body.value is None:
            return row(node.orelse), ast.UnaryOp(op=ast.Not(), operand=node.test)  # type: ignore[return-value]
    return None


# calls an assertion may make: sizes, ranks and types of tensors (metadata, never their values)
_METADATA_CALLS = frozenset({"len", "isinstance", "dim", "ndimension", "size", "numel", "nelement"})
_METADATA_NODES = (ast.Name, ast.Attribute, ast.Subscript, ast.Constant, ast.Compare, ast.BoolOp, ast.UnaryOp,
                   ast.BinOp, ast.Tuple, ast.List, ast.Slice, ast.expr_context, ast.cmpop, ast.boolop, ast.unaryop,
                   ast.operator, ast.Call)


def metadata_assert(s: ast.stmt) -> bool:
    """``assert <test>[, msg]`` whose test reads only shapes, ranks, sizes and types (``mask.shape == (B, T, K)``,
    ``rows.dim() == 1``, ``len(rows) == len(slots)``): a check that computes nothing and binds nothing, so the fused
    layer needs not run it (``python -O`` drops it too; only a failing check would differ: the original raises). The
    message is evaluated only when the check fails. Tests reading values (``(w > 0).all()``) are not this."""
    if not isinstance(s, ast.Assert):
        return False
    for node in ast.walk(s.test):
        if not isinstance(node, _METADATA_NODES):
            return False
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name not in _METADATA_CALLS or node.keywords:
                return False
    return True


# -- examples (registered on MoeExperts by moe_experts.py) ------------------------------------

_HEAD = s42c._HEAD
_run = s42c._run

# DeepSeek-V3 inference text (learn-llm-by-hands NLP/Moe.py): host counts from bincount, the body guarded by them
COUNTS_AROUND_BODY = _HEAD + '''

class CountedMoE(nn.Module):
''' + _init("gate") + '''
    def forward(self, x):
        shape = x.size()
        x = x.view(-1, shape[-1])
        weights, indices = self.gate(x).softmax(-1).topk(self.k, dim=-1)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.n).tolist()
        for i in range(self.n):
            if counts[i] > 0:
                expert = self.experts[i]
                idx, top = torch.where(indices == i)
                y[idx] += expert(x[idx]) * weights[idx, top, None]
        return y.view(shape)
'''
COUNTS_RUN = _run("CountedMoE(16, 12, 6, 2)", "2, 7, 16", "m.gate.weight, m.experts[3].w_in.weight")

_GUARDED_BODY = '''            if counts[i] > 0:
                expert = self.experts[i]
                idx, top = torch.where(indices == i)
                y[idx] += expert(x[idx]) * weights[idx, top, None]
'''


def _skipping(test: str) -> str:
    """COUNTS_AROUND_BODY with the guard written as ``if <test>: continue`` before the body."""
    body = ('            if TEST:\n                continue\n            expert = self.experts[i]\n'
            '            idx, top = torch.where(indices == i)\n            y[idx] += expert(x[idx]) * weights[idx, top, None]\n')
    return COUNTS_AROUND_BODY.replace(_GUARDED_BODY, body.replace("TEST", test))


def _guarding(test: str) -> str:
    """COUNTS_AROUND_BODY with the body guarded by ``if <test>:``."""
    return COUNTS_AROUND_BODY.replace("            if counts[i] > 0:\n", f"            if {test}:\n")


# boolean-mask dispatch whose skip guard counts the mask's rows in several ways
MASK_GUARD = _HEAD + '''

class MaskMoE(nn.Module):
''' + _init("router") + '''
    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        w, idx = torch.topk(self.router(flat).softmax(dim=-1), self.k, dim=-1)
        out = torch.zeros_like(flat)
        for e in range(self.n):
            tok, slot = torch.where(idx == e)
            if len(tok) < 1:
                continue
            out[tok] += self.experts[e](flat[tok]) * w[tok, slot].unsqueeze(-1)
        return out.view_as(x)
'''
MASK_RUN = _run("MaskMoE(16, 12, 5, 2)", "3, 5, 16", "m.router.weight, m.experts[1].w_out.weight")

# shape checks inside the expert loop (vats-multimodal-lm's `assert expert_mask.shape == (B, T, self.top_k)`)
ASSERTED = _HEAD + '''

class CheckedMoE(nn.Module):
''' + _init("router") + '''
    def forward(self, x):
        B, T, D = x.shape
        flat = x.view(-1, D)
        w, idx = torch.topk(self.router(flat).softmax(dim=-1), self.k, dim=-1)
        out = torch.zeros_like(flat)
        for e in range(self.n):
            mask = idx == e
            assert mask.shape == (B * T, self.k), f"mask has shape {mask.shape}"
            rows, slots = torch.where(mask)
            assert rows.dim() == 1 and len(rows) == len(slots)
            out[rows] += self.experts[e](flat[rows]) * w[rows, slots, None]
        return out.view(B, T, D)
'''
ASSERTED_RUN = _run("CheckedMoE(16, 12, 5, 2)", "2, 6, 16", "m.router.weight, m.experts[2].w_in.weight")

# rows already sorted by expert, an offsets table of E + 1 entries handed in (ppl.pmx MoeRowParallelLinear /
# MoeColumnParallelLinear): each expert's projection over its run X[T[i]:T[i + 1]] written into the output's rows
HANDED_OFFSETS = '''\
import torch
import torch.nn.functional as F


def experts_linear(X, expert_offset, W, B, num_experts):
    X_flat = X.view(-1, X.shape[-1])
    out = torch.zeros(X_flat.shape[0], W.shape[1], dtype=X.dtype)
    for i in range(num_experts):
        if expert_offset[i + 1] - expert_offset[i] <= 0:
            continue
        out[expert_offset[i]:expert_offset[i + 1]] = F.linear(X_flat[expert_offset[i]:expert_offset[i + 1]], W[i], B[i] if B is not None else None)
    return out
'''
HANDED_OFFSETS_RUN = '''\
W = torch.randn(4, 12, 16, requires_grad=True)
B = torch.randn(4, 12, requires_grad=True)
X = torch.randn(11, 16, requires_grad=True)
out = [experts_linear(X, torch.tensor([0, 3, 3, 9, 11]), W, B, 4), experts_linear(X, torch.tensor([0, 2, 5, 5, 9]), W, None, 4),
       experts_linear(X, torch.tensor([2, 3, 3, 9, 11]), W, B, 4), experts_linear(X, [0, 4, 6, 8, 11], W, B, 4)]
leaves = [X, W, B]
'''
_GUARD = "        if expert_offset[i + 1] - expert_offset[i] <= 0:\n            continue\n"
_HANDED_PRODUCT = "F.linear(X_flat[expert_offset[i]:expert_offset[i + 1]], W[i], B[i] if B is not None else None)"

# a [T, E] membership matrix scattered from the top-k ids, read per expert as a boolean column (the local form of
# deepsaia moe_llama's router mask); the slot weight picked by (idx[rows] == e) and summed
SCATTERED = _HEAD + '''

class ScatterMoE(nn.Module):
''' + _init("router") + '''
    def forward(self, x):
        x = x.view(-1, x.shape[-1])
        top_logits, top_idx = torch.topk(self.router(x), self.k, dim=-1)
        weights = F.softmax(top_logits, dim=-1)
        expert_mask = torch.zeros(x.size(0), self.n, device=x.device)
        expert_mask.scatter_(1, top_idx, 1.0)
        out = torch.zeros_like(x)
        for e in range(self.n):
            token_mask = expert_mask[:, e].bool()
            if token_mask.sum() == 0:
                continue
            y = self.experts[e](x[token_mask])
            w = (weights[token_mask] * (top_idx[token_mask] == e)).sum(dim=1)
            out[token_mask] += y * w.unsqueeze(-1)
        return out
'''
SCATTERED_RUN = _run("ScatterMoE(16, 12, 6, 2)", "13, 16", "m.router.weight, m.experts[1].w_in.weight")
_SCATTER = "        expert_mask.scatter_(1, top_idx, 1.0)\n"

FUSE = [
    Fuse(SCATTERED, name="s44a_scatter_membership_column_bool", run=SCATTERED_RUN),
    Fuse(SCATTERED.replace("expert_mask[:, e].bool()", "expert_mask[:, e] > 0"),
         name="s44a_scatter_membership_column_positive", run=SCATTERED_RUN),
    Fuse(SCATTERED.replace("        expert_mask = torch.zeros(x.size(0), self.n, device=x.device)\n" + _SCATTER,
                           "        expert_mask = x.new_zeros(x.size(0), self.n).scatter_(-1, top_idx, value=1)\n")
         .replace("expert_mask[:, e].bool()", "expert_mask[:, e] != 0"),
         name="s44a_scatter_membership_chained_new_zeros", run=SCATTERED_RUN),
    Fuse(HANDED_OFFSETS, name="s44a_handed_in_offsets_linear_with_optional_bias", run=HANDED_OFFSETS_RUN),
    Fuse(HANDED_OFFSETS.replace(_HANDED_PRODUCT, "F.linear(X_flat[expert_offset[i]:expert_offset[i + 1]], W[i])"),
         name="s44a_handed_in_offsets_linear_without_bias", run=HANDED_OFFSETS_RUN),
    Fuse(HANDED_OFFSETS.replace(_HANDED_PRODUCT, "F.linear(X_flat[expert_offset[i]:expert_offset[i + 1]], W[i], B[i])")
         .replace("        if expert_offset[i + 1] - expert_offset[i] <= 0:\n            continue\n", ""),
         name="s44a_handed_in_offsets_linear_bias_no_guard", run=HANDED_OFFSETS_RUN.replace("W, None, 4)", "W, B, 4)")),
    Fuse(HANDED_OFFSETS.replace(_HANDED_PRODUCT, "X_flat[expert_offset[i]:expert_offset[i + 1]] @ W[i].transpose(0, 1)")
         .replace("if expert_offset[i + 1] - expert_offset[i] <= 0:", "if not expert_offset[i + 1] - expert_offset[i]:"),
         name="s44a_handed_in_offsets_matmul_not_guard", run=HANDED_OFFSETS_RUN),
    Fuse(ASSERTED, name="s44a_shape_asserts_in_the_expert_loop", run=ASSERTED_RUN),
    Fuse(ASSERTED.replace("assert rows.dim() == 1 and len(rows) == len(slots)", "assert isinstance(rows, torch.Tensor) and rows.numel() == slots.size(0)"),
         name="s44a_type_and_size_asserts_in_the_expert_loop", run=ASSERTED_RUN),
    # a check of values is not dropped: s43b replays it after the fused layer, in a loop of the routing statements
    Fuse(ASSERTED.replace("assert rows.dim() == 1 and len(rows) == len(slots)", "assert (w[rows, slots] > 0).all()"),
         name="s44a_value_assert_replayed_after_the_fused_layer", run=ASSERTED_RUN),
    Fuse(COUNTS_AROUND_BODY, name="s44a_bincount_counts_guard_the_body", run=COUNTS_RUN),
    Fuse(_guarding("counts[i] >= 1"), name="s44a_bincount_counts_at_least_one", run=COUNTS_RUN),
    Fuse(_guarding("0 < counts[i]"), name="s44a_bincount_counts_zero_on_the_left", run=COUNTS_RUN),
    Fuse(_guarding("counts[i]"), name="s44a_bincount_counts_bare_truth", run=COUNTS_RUN),
    Fuse(_guarding("int(counts[i]) != 0").replace(".tolist()", ""), name="s44a_bincount_device_counts_as_int",
         run=COUNTS_RUN),
    Fuse(_skipping("not counts[i]"), name="s44a_bincount_counts_not_continue", run=COUNTS_RUN),
    Fuse(_skipping("counts[i] < 1"), name="s44a_bincount_counts_below_one_continue", run=COUNTS_RUN),
    Fuse(_skipping("0 == counts[i]"), name="s44a_bincount_counts_zero_equals_continue", run=COUNTS_RUN),
    Fuse(MASK_GUARD, name="s44a_rows_fewer_than_one_continue", run=MASK_RUN),
    Fuse(MASK_GUARD.replace("            if len(tok) < 1:\n                continue\n",
                            "            if not tok.numel():\n                continue\n"),
         name="s44a_rows_not_numel_continue", run=MASK_RUN),
    Fuse(MASK_GUARD.replace("            if len(tok) < 1:\n                continue\n",
                            "            if 0 == tok.shape[0]:\n                continue\n"),
         name="s44a_rows_zero_equals_shape_continue", run=MASK_RUN),
]

KEEP = [
    # the raw top-k logits scattered, not a constant: a negative logit fails the column test and drops a routed token
    # (s45 moe45a: scattered softmax weights, >= 0, are read: patterns/_moe_s45a.py)
    Keep(SCATTERED.replace(_SCATTER, "        expert_mask.scatter_(1, top_idx, top_logits)\n"),
         reason="the loop skips experts without rows of `token_mask`", name="s44a_scatter_of_weights_not_membership"),
    # a shared-expert column set for every token after the scatter (deepsaia's form): the matrix is changed again
    Keep(SCATTERED.replace(_SCATTER, _SCATTER + "        expert_mask[:, 0] = 1\n"),
         reason="the loop skips experts without rows of `token_mask`", name="s44a_scatter_membership_changed_after"),
    # the ids rebound after the scatter (one slot kept): the loop's (top_idx == e) is not the scattered membership
    Keep(SCATTERED.replace(_SCATTER, _SCATTER + "        top_idx = top_idx[:, :1]\n"),
         reason="the loop skips experts without rows of `token_mask`", name="s44a_scatter_ids_rebound_after"),
    # scattered along the token dim (rows of experts): not a [T, E] membership matrix
    Keep(SCATTERED.replace(_SCATTER, "        expert_mask.scatter_(0, top_idx, 1.0)\n"),
         reason="the loop skips experts without rows of `token_mask`", name="s44a_scatter_along_tokens"),
    # the bias row of expert 0 for every run: not one bias row per group
    Keep(HANDED_OFFSETS.replace("B[i] if B is not None else None", "B[0] if B is not None else None")
         .replace(_GUARD, ""), reason="rows are written through", name="s44a_handed_in_offsets_bias_of_one_expert"),
    # runs T[i]:T[i + 2] overlap: not one run per expert
    Keep(HANDED_OFFSETS.replace("out[expert_offset[i]:expert_offset[i + 1]] = F.linear(X_flat[expert_offset[i]:expert_offset[i + 1]]",
                                "out[expert_offset[i]:expert_offset[i + 2]] = F.linear(X_flat[expert_offset[i]:expert_offset[i + 2]]")
         .replace("if expert_offset[i + 1] - expert_offset[i] <= 0:", "if expert_offset[i + 2] - expert_offset[i] <= 0:"),
         # (s47: the skip only tests the emptiness of the rows written, T[i]:T[i + 2]: those rows are the reason)
         reason="rows are written through", name="s44a_handed_in_offsets_overlapping_runs"),
    # skips runs of one row too (a threshold, not an empty run)
    Keep(HANDED_OFFSETS.replace("if expert_offset[i + 1] - expert_offset[i] <= 0:", "if expert_offset[i + 1] - expert_offset[i] <= 1:"),
         reason="the loop skips experts on", name="s44a_handed_in_offsets_skip_short_runs"),
    # the table is rebound in the function (shifted by one row): not the offsets the caller handed in
    Keep(HANDED_OFFSETS.replace("    X_flat = X.view(-1, X.shape[-1])\n", "    X_flat = X.view(-1, X.shape[-1])\n    expert_offset = expert_offset + 1\n")
         .replace(_GUARD, ""), reason="rows are written through", name="s44a_offsets_table_rebound_in_the_function"),
    # an assertion that binds a name (a walrus) the body then reads
    Keep(ASSERTED.replace("assert rows.dim() == 1 and len(rows) == len(slots)", "assert (n := len(rows)) >= 0")
         .replace("* w[rows, slots, None]", "* w[rows, slots, None] / max(n, 1) * max(n, 1)"),
         reason="unrecognised statement in the expert loop: `assert", name="s44a_assert_binding_a_name"),
    # skips experts with exactly one token too: not "this expert has no rows"
    Keep(_guarding("counts[i] > 1"), reason="conditional code inside the expert loop",
         name="s44a_bincount_counts_above_one"),
    # the counts of the previous expert: expert i runs even without rows, and is skipped when i - 1 has none
    Keep(_guarding("counts[i - 1] > 0"), reason="conditional code inside the expert loop",
         name="s44a_bincount_counts_of_another_expert"),
    # counts of another tensor's ids, not of the indices the loop dispatches
    Keep(_guarding("counts[i] > 0").replace("torch.bincount(indices.flatten()", "torch.bincount(slots.flatten()")
         .replace("def forward(self, x):", "def forward(self, x, slots):"),
         reason="not of the expert indices", name="s44a_bincount_of_another_tensor"),
    # weighted counts (a sum of routing weights) are not token counts
    Keep(_guarding("counts[i] > 0").replace("minlength=self.n)", "weights=weights.flatten(), minlength=self.n)"),
         reason="conditional code inside the expert loop", name="s44a_weighted_bincount_guard"),
    # a capacity threshold, not emptiness: experts with one or two rows are skipped
    Keep(MASK_GUARD.replace("if len(tok) < 1:", "if len(tok) < 3:"), reason="the loop skips experts on `len(tok) < 3`",
         name="s44a_rows_below_a_capacity_continue"),
]
