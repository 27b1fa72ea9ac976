"""s45 (helper moe45b): moe_experts recall classes read off real development misses (HO21a).

1. A routing switch of the whole call inside the expert loop (HO21a TinyMoE-Playground): ``if self.capacity_factor is
   not None: <capacity-limited dispatch> else: <plain dispatch>``. The loop analysis already follows the off path of
   a loop-invariant option test behind a run-time guard (the original loop is the fallback); a name check refused every
   loop that names a capacity anywhere. Here the capacity may sit in the test of such an option and in the branch the
   analysis does not follow: the fused text runs only where the switch is off (no capacity: every routed token kept),
   the loop as written runs where it is on. Capacity code on the followed path keeps the refusal (true reason). Either
   branch may be the plain one: the analysis follows the branch that names no capacity.
2. Top-1 indices handed back by a router module of the file (``top1, top1_prob, aux = self.router(x)`` whose forward
   returns ``probs.argmax(-1)`` / ``probs.max(-1)`` indices): one expert per token, as when computed in place.
3. Flat (token, slot) routes selected by a boolean mask (HO21a MoE-LLM): ``flat = idx.view(-1)``,
   ``tok_of_route = torch.arange(T).repeat_interleave(K)``, ``m = flat == e``, rows ``x[tok_of_route[m]]``, weights
   ``w.view(-1)[m]``, combined by ``index_add_(0, tok_of_route[m], ...)``. ``A[m]`` of a 1-D route tensor ``A`` is
   ``A[pos]`` with ``pos = torch.where(flat == e)[0]``, which the s42c reading (patterns/_moe_s42c.py) translates into
   (token, slot) pairs; the token of route p is p // K when K is the indices' last dim (a run-time check). Weights
   read through a flat view are the pair's weight where they have the indices' shape (a run-time check).

The functions here read syntax only and return facts (or None); ``moe_experts`` calls them from its loop analysis.
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Optional

from npufuse.patterns import _moe_s42c as s42c
from npufuse.patterns import _moe_s43a
from npufuse.scan.dataflow import Scope, const_value, dotted, fast_walk

# -- class 1: a routing switch inside the loop ----------------------------------------------------------------------

#: words of names that drop or cap tokens per expert (what permute + grouped matmul cannot do)
_CAPACITY_WORDS = ("capacity",)


def _names_capacity(node: ast.AST) -> bool:
    """A name or attribute in ``node`` that says capacity (``capacity_factor``, ``self.expert_capacity``)."""
    for n in fast_walk(node):
        word = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
        if word and any(w in word.lower() for w in _CAPACITY_WORDS):
            return True
    return False


def _stmts_name_capacity(stmts: list[ast.stmt]) -> bool:
    return any(_names_capacity(s) for s in stmts)


def followed_branch(branch: ast.If) -> str:
    """Which branch of an option ``if`` the loop analysis follows: ``"body"`` where only the else branch names a
    capacity (``if self.capacity is None: <plain> else: <capped>``), else ``"orelse"`` (the off path of the option)."""
    if branch.orelse and _stmts_name_capacity(branch.orelse) and not _stmts_name_capacity(branch.body):
        return "body"
    return "orelse"


def capacity_off_the_followed_path(loop: ast.For, is_option: Callable[[ast.expr], bool]) -> bool:
    """Whether every capacity name of the loop is in the test of a loop-invariant option ``if`` (``is_option``) or in
    the branch of one that the analysis does not follow (:func:`followed_branch`): the capacity is a switch the fused
    text's guard reads, not part of the dispatch it replaces. False when a capacity is on the followed path (a header,
    a plain statement, a test that is no option, or both branches of an option)."""
    if _names_capacity(loop.target) or _names_capacity(loop.iter):
        return False
    return _path_free(loop.body, is_option)


def _path_free(stmts: list[ast.stmt], is_option: Callable[[ast.expr], bool]) -> bool:
    for s in stmts:
        if isinstance(s, ast.If) and is_option(s.test):
            if _stmts_name_capacity(s.body) and _stmts_name_capacity(s.orelse):
                return False  # capped on both paths
            if not _path_free(s.body if followed_branch(s) == "body" else s.orelse, is_option):
                return False
            continue
        for _, value in ast.iter_fields(s):
            if isinstance(value, list) and value and all(isinstance(v, ast.stmt) for v in value):
                if not _path_free(value, is_option):
                    return False
            elif isinstance(value, list):
                if any(isinstance(v, ast.AST) and _names_capacity(v) for v in value):
                    return False
            elif isinstance(value, ast.AST) and _names_capacity(value):
                return False
    return True


def option_guard(branch: ast.If, test_text: str) -> str:
    """The run-time condition under which the followed branch of an option ``if`` is the one that runs."""
    return f"({test_text})" if followed_branch(branch) == "body" else f"not ({test_text})"


# -- class 2: top-1 indices from a router module ----------------------------------------------------------------------


def top1_indices_returned(scope: Scope, name: str, line: int,
                          call_output: Callable[[Optional[ast.expr]], Optional[tuple[Scope, ast.expr, int, Any]]]) -> bool:
    """``name`` is an output of a router module / helper call (``call_output`` reads ``a, b = self.router(x)``) whose
    returned name is bound in the callee to the indices of a max or an argmax: one expert per token."""
    out = call_output(scope.definition(name, line))
    if out is None:
        return False
    fscope, returned, end, _ = out
    return isinstance(returned, ast.Name) and _moe_s43a.top1_indices(fscope, returned.id, end)


# -- class 3: flat (token, slot) routes picked by a boolean mask ------------------------------------------------------

#: calls on the mask that test or count its routes (read by the loop analysis as the mask's own emptiness tests)
_MASK_TESTS = ("any", "sum", "count_nonzero")


def _arange_of_tokens(node: ast.expr) -> bool:
    """``torch.arange(T)`` (one bound: values 0 .. T - 1; device / dtype keywords allowed)."""
    return isinstance(node, ast.Call) and dotted(node.func) in ("torch.arange", "arange") and len(node.args) == 1 \
        and all(k.arg in ("device", "dtype") for k in node.keywords)


def _repeats(call: ast.Call) -> Optional[ast.expr]:
    """K of ``a.repeat_interleave(K)`` / ``a.repeat_interleave(K, dim=0)`` (1-D ``a``: each value K times in a row)."""
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "repeat_interleave" and call.args):
        return None
    rest = call.args[1:] + [k.value for k in call.keywords if k.arg == "dim"]
    if len(call.args) > 2 or any(k.arg not in ("dim", "output_size") for k in call.keywords) \
            or any(const_value(d) != 0 for d in rest):
        return None
    return call.args[0]


def token_of_route(node: Optional[ast.expr]) -> Optional[str]:
    """K (as written) when ``node`` lists, for flat route p = t * K + k, its token t: ``torch.arange(T)
    .repeat_interleave(K)``, ``torch.arange(T).unsqueeze(1).expand(-1, K).reshape(-1)`` (``[:, None]``, ``.view(-1,
    1)``; ``expand(T, K)``, ``repeat(1, K)``; ``.flatten()``), ``torch.arange(T * K) // K``; else None."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) and isinstance(node.left, ast.Call) \
            and _arange_of_tokens(node.left):
        return ast.unparse(node.right)
    if not isinstance(node, ast.Call):
        return None
    k = _repeats(node)
    if k is not None:
        return ast.unparse(k) if isinstance(node.func, ast.Attribute) and _arange_of_tokens(node.func.value) else None
    if dotted(node.func) == "torch.repeat_interleave" and len(node.args) == 2 and not node.keywords \
            and _arange_of_tokens(node.args[0]):
        return ast.unparse(node.args[1])
    if not _flat_call_of(node):
        return None
    grid = node.func.value  # type: ignore[attr-defined]  # [T, K]: row t holds t
    if not (isinstance(grid, ast.Call) and isinstance(grid.func, ast.Attribute)):
        return None
    if grid.func.attr == "expand" and len(grid.args) == 2 and not grid.keywords:
        k_node = grid.args[1]
    elif grid.func.attr == "repeat" and len(grid.args) == 2 and const_value(grid.args[0]) == 1 and not grid.keywords:
        k_node = grid.args[1]
    else:
        return None
    column = _moe_s43a._as_column(grid.func.value)
    return ast.unparse(k_node) if column is not None and _arange_of_tokens(column) else None


def _flat_call_of(node: ast.Call) -> bool:
    """``<expr>.view(-1)`` / ``.reshape(-1)`` / ``.flatten()`` on any receiver (the grid of a token map)."""
    if not isinstance(node.func, ast.Attribute) or node.keywords:
        return False
    if node.func.attr in ("view", "reshape") and len(node.args) == 1 and const_value(node.args[0]) == -1:
        return True
    return node.func.attr == "flatten" and not node.args


def flat_mask_routes(scope: Scope, body: list[ast.stmt], mask: str, value: ast.expr, is_expert: Callable[[ast.expr], bool],
                     tok: str, slot: str, line: int) -> Optional[tuple[s42c.FlatPositions, list[str]]]:
    """``mask = (flat == e)`` over ``flat`` a 1-D view of 2-D indices, every read of ``mask`` in ``body`` a row pick
    ``A[mask]`` of a per-route tensor (translated into the (token, slot) pair form: ``fp.reads``) or an emptiness test
    (``mask.any()``, kept). Returns the positions and the run-time facts the translation rests on; None otherwise (the
    loop is then analysed as written)."""
    if not (isinstance(value, ast.Compare) and len(value.ops) == 1 and isinstance(value.ops[0], ast.Eq)):
        return None
    flat, other = value.left, value.comparators[0]
    if not isinstance(flat, ast.Name):
        flat, other = other, flat
    if not (isinstance(flat, ast.Name) and is_expert(other)):
        return None
    indices = s42c._flat_view_of(scope, flat.id, line)
    if indices is None:
        return None
    fp = s42c.FlatPositions(flat.id, indices)
    facts: list[str] = []
    parents = {id(child): node for st in body for node in ast.walk(st) for child in ast.iter_child_nodes(node)}
    tok_node, slot_node = ast.Name(tok, ast.Load()), ast.Name(slot, ast.Load())
    loads = [n for st in body for n in ast.walk(st) if isinstance(n, ast.Name) and n.id == mask]
    for n in loads:
        parent = parents.get(id(n))
        if not isinstance(n.ctx, ast.Load):
            return None  # rebound in the loop body
        if isinstance(parent, ast.Attribute) and parent.attr in _MASK_TESTS \
                and isinstance(parents.get(id(parent)), ast.Call) and parents[id(parent)].func is parent:  # type: ignore[attr-defined]
            continue  # mask.any(): an emptiness test the loop analysis reads on the mask itself
        if not (isinstance(parent, ast.Subscript) and parent.slice is n and isinstance(parent.ctx, ast.Load)):
            return None
        read = _route_read(scope, parent.value, fp, tok_node, slot_node, other, facts, line)
        if read is None:
            return None
        fp.reads.append((parent, read))
    if not fp.k_text or not fp.reads:
        return None
    return fp, [s42c.position_guard(fp), *facts]


def _route_read(scope: Scope, source: ast.expr, fp: s42c.FlatPositions, tok: ast.Name, slot: ast.Name,
                expert: ast.expr, facts: list[str], line: int) -> Optional[ast.expr]:
    """The pair form of ``source[mask]``: the expert (``flat[mask]``), the token (a token-of-route map), the token's
    row (``x.repeat_interleave(K, dim=0)``), the pair's weight (a flat view of ``w``, ``w`` shaped like the indices)."""
    inline_view = s42c._flat_view_call(source)
    if inline_view is not None:
        return _pair_weight(inline_view, fp, tok, slot, facts)
    if not isinstance(source, ast.Name):
        return None
    if source.id == fp.flat:
        return expert
    definition = scope.definition(source.id, line)
    k = token_of_route(definition)
    if k is not None and definition is not None and _names_unchanged(scope, definition, line):
        if fp.k_text and k != fp.k_text:
            return None
        fp.k_text = k
        return tok
    if isinstance(definition, ast.Call) and _repeats(definition) is not None and isinstance(definition.func, ast.Attribute) \
            and isinstance(definition.func.value, ast.Name) and s42c._unchanged(scope, definition.func.value.id, definition.lineno, line):
        k = ast.unparse(_repeats(definition))  # type: ignore[arg-type]
        rows_of = definition.func.value.id
        if (fp.k_text and k != fp.k_text) or (fp.tokens and fp.tokens != rows_of) or not _dim_zero(definition):
            return None
        fp.k_text, fp.tokens = k, rows_of
        return ast.Subscript(ast.Name(rows_of, ast.Load()), tok, ast.Load())
    weights = s42c._flat_view_of(scope, source.id, line)
    return _pair_weight(weights, fp, tok, slot, facts) if weights is not None else None


def _dim_zero(call: ast.Call) -> bool:
    """``x.repeat_interleave(K, dim=0)`` (rows repeated): the dim is given and 0 (a 1-D ``repeat_interleave(K)`` of
    tokens would repeat scalars)."""
    dims = call.args[1:] + [k.value for k in call.keywords if k.arg == "dim"]
    return len(dims) == 1 and const_value(dims[0]) == 0


def _names_unchanged(scope: Scope, definition: ast.expr, line: int) -> bool:
    """The names a token-of-route map reads (T, K) are not rebound between its binding and the loop."""
    return all(s42c._unchanged(scope, n.id, definition.lineno, line) for n in fast_walk(definition) if isinstance(n, ast.Name))


def _pair_weight(weights: str, fp: s42c.FlatPositions, tok: ast.Name, slot: ast.Name, facts: list[str]) -> ast.expr:
    fact = f"{weights}.shape == {fp.indices}.shape"  # w.view(-1)[t * K + k] is w[t, k] where w is [T, K]
    if fact not in facts:
        facts.append(fact)
    return ast.Subscript(ast.Name(weights, ast.Load()), ast.Tuple([tok, slot], ast.Load()), ast.Load())


# -- class 4: the weighted expert output cast before it is written back ---------------------------------------------


def plain_cast(call: ast.Call) -> bool:
    """``y.to(dtype)`` / ``y.to(other.dtype)`` / ``y.float()`` / ``y.type_as(out)``: a dtype cast only (one positional
    argument at most, no keywords: ``to(device, non_blocking=True)`` and ``to(dtype=..., copy=True)`` are not read)."""
    return not call.keywords and len(call.args) <= 1


# -- class 5: the accumulator's metadata read between its allocation and the loop -------------------------------------

#: attributes / methods of a tensor that tell its metadata, never its values
_METADATA_ATTRS = ("dtype", "device", "shape", "ndim", "is_cuda")
_METADATA_METHODS = ("size", "dim", "type", "get_device")


def metadata_reads_only(stmt: ast.stmt, name: str) -> bool:
    """Every occurrence of ``name`` in ``stmt`` is a load of its dtype / device / shape (``out_dtype = out.dtype``,
    ``n = out.size(0)``): nothing there reads, writes or aliases the tensor's values. ``type`` is read only
    without arguments (``t.type()`` names the type; ``t.type(dtype)`` casts, a new tensor: still no alias)."""
    parents = {id(child): node for node in ast.walk(stmt) for child in ast.iter_child_nodes(node)}
    for n in ast.walk(stmt):
        if not (isinstance(n, ast.Name) and n.id == name):
            continue
        parent = parents.get(id(n))
        if not isinstance(n.ctx, ast.Load) or not isinstance(parent, ast.Attribute):
            return False
        if parent.attr in _METADATA_ATTRS:
            continue
        call = parents.get(id(parent))
        if parent.attr in _METADATA_METHODS and isinstance(call, ast.Call) and call.func is parent:
            continue
        return False
    return True
