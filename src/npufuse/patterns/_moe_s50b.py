"""s50 moe50b: canonical-layer extensions of the moe_experts analysis (helper moe50b).

* A dead statistic in the expert loop (sweep50moe Shumatsurontek ``token_counts[e] += n`` with the logging of it
  commented out): a statement whose only effect is a write into a tensor this function made and never reads
  anywhere (no read after the loop, none in it, not returned, not stored, not aliased) changes nothing anyone can
  observe, so the expert loop is read without it (:func:`dead_statistic`). Statistics that ARE read keep their own
  readers (s41's count replay, s43b's side-statement replay).
"""

from __future__ import annotations

import ast
from typing import Any

from npufuse.scan.dataflow import dotted, fast_walk

#: constructors of fresh tensors (storage of their own, nothing else holds it)
_FACTORIES = ("zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like", "full_like", "tensor",
              "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor")
#: calls inside the statistic's value that neither mutate nor draw random numbers nor run a module
_PURE_CALLS = ("numel", "sum", "item", "size", "len", "int", "float", "count_nonzero", "long", "float", "to",
               "detach", "shape", "dim", "mean", "max", "min", "any", "all", "bool")
_MOVES = ("to", "cuda", "cpu", "int", "long", "float", "double", "half", "bfloat16", "detach", "requires_grad_")


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Subscript, ast.Attribute)) and not (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
        node = node.value
    return node


def _factory(node: ast.expr | None) -> bool:
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MOVES:
        node = node.func.value
    if not isinstance(node, ast.Call):
        return False
    name = (dotted(node.func) or "").split(".")[-1] if not isinstance(node.func, ast.Attribute) else node.func.attr
    return name in _FACTORIES


def _pure(node: ast.expr) -> bool:
    for n in fast_walk(node):
        if isinstance(n, (ast.NamedExpr, ast.Lambda, ast.Await, ast.Yield, ast.YieldFrom)):
            return False
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else (dotted(f) or "")
            if name not in _PURE_CALLS:
                return False
    return True


def dead_statistic(scope: Any, loop: ast.For, s: ast.stmt) -> bool:
    """Whether ``s`` (a statement of the expert loop ``loop``) only writes into a local tensor that a tensor factory
    made before the loop and that no other statement of the function names: ``stat[e] += n`` / ``stat[e] = n`` /
    ``stat += n`` with a value of plain reads and pure calls (no module run, no random draw, no in-place call). Such a
    write is unobservable (the function never reads, returns or hands on ``stat``), so the loop means what it means
    without it."""
    if isinstance(s, ast.AugAssign):
        target, value = s.target, s.value
    elif isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Subscript):
        target, value = s.targets[0], s.value
    else:
        return False
    root = _root(target)
    if not isinstance(root, ast.Name) or not _pure(value) or not _pure(target):
        return False
    if isinstance(target, ast.Subscript) and any(isinstance(n, ast.Slice) for n in fast_walk(target.slice)):
        return False
    stat = root.id
    if stat in scope.args or not _factory(scope.definition(stat, loop.lineno)):
        return False
    # every other mention of the name in the function is a plain binding of it to a fresh tensor (its definition)
    fn = scope.node
    defs = [st for st in fast_walk(fn) if isinstance(st, ast.Assign) and len(st.targets) == 1
            and isinstance(st.targets[0], ast.Name) and st.targets[0].id == stat]
    if not defs or not all(_factory(d.value) and d.lineno < loop.lineno for d in defs):
        return False
    mentions = sum(1 for n in fast_walk(fn) if isinstance(n, ast.Name) and n.id == stat)
    own = sum(1 for n in fast_walk(s) if isinstance(n, ast.Name) and n.id == stat)
    if own != 1:
        return False
    # nested functions / lambdas / comprehensions counted too (fast_walk visits them): one mention each definition
    return mentions == len(defs) + 1


_VALUE_CASTS = ("float", "half", "bfloat16", "double", "long", "int", "bool", "to", "type", "type_as", "contiguous")


def one_hot_column(ev: Any, node: ast.Subscript) -> ast.expr | None:
    """``c == e`` for ``oh[:, e]`` / ``oh[..., e]`` with ``oh = F.one_hot(c, E)`` (casts around it allowed): column e
    of a one-hot is 1 exactly where ``c == e`` (the same nonzero rows, the same 0 / 1 values), so the routing readers
    of the comparison (s35's slot masks, the flat / token masks) read it (sweep50moe Shumatsurontek:
    ``mask = F.one_hot(top_k_indices[:, k], E).float(); rows = mask[:, e].nonzero().squeeze(1)``). None otherwise; the
    caller accepts ``[:, e]`` only where ``c`` is one slot's [T] column (``[:, e]`` of a 3-D one-hot is another axis)."""
    if not isinstance(node.value, ast.Name) or not isinstance(node.slice, ast.Tuple) or len(node.slice.elts) != 2:
        return None
    lead, e = node.slice.elts
    if not (isinstance(lead, ast.Constant) and lead.value is Ellipsis) and not (
            isinstance(lead, ast.Slice) and lead.lower is None and lead.upper is None and lead.step is None):
        return None
    if not ev._is_eidx(e):
        return None
    made = ev.s43a_bound.get(node.value.id)
    if made is None:
        made = ev.scope.definition(node.value.id, ev.loop.lineno)
    for _ in range(4):
        if isinstance(made, ast.Call) and isinstance(made.func, ast.Attribute) and made.func.attr in _VALUE_CASTS:
            made = made.func.value
    if not (isinstance(made, ast.Call) and ev.m.canonical(made.func) == "torch.nn.functional.one_hot" and made.args
            and not isinstance(made.args[0], ast.Starred)):
        return None
    cmp = ast.Compare(left=made.args[0], ops=[ast.Eq()], comparators=[e])
    return ast.copy_location(cmp, node)


def _size_read(node: ast.expr) -> bool:
    """``rows.numel()`` / ``rows.size(0)`` / ``len(rows)`` / ``rows.shape[0]`` / ``mask.sum()`` (a count, read once)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("numel", "nelement", "sum") \
            and not node.args and not node.keywords:
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size" \
            and len(node.args) == 1 and isinstance(node.args[0], ast.Constant) and node.args[0].value == 0:
        return True
    if isinstance(node, ast.Call) and dotted(node.func) == "len" and len(node.args) == 1:
        return True
    return isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape" \
        and isinstance(node.slice, ast.Constant) and node.slice.value == 0


def inline_size_name(bound: dict[str, ast.expr], test: ast.expr) -> ast.expr:
    """``rows.numel() == 0`` for ``n == 0`` with ``n = rows.numel()`` bound in the loop body (sweep50moe Shumatsurontek:
    ``n_tokens = tokens_for_expert.numel(); if n_tokens == 0: continue``): the emptiness readers see the size read
    itself. ``test`` unchanged where no operand is such a name."""
    def sub(node: ast.expr) -> ast.expr:
        if isinstance(node, ast.Name) and isinstance(bound.get(node.id), ast.expr) and _size_read(bound[node.id]):
            return ast.copy_location(bound[node.id], node)
        return node

    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, right = sub(test.left), sub(test.comparators[0])
        if left is not test.left or right is not test.comparators[0]:
            return ast.copy_location(ast.Compare(left=left, ops=test.ops, comparators=[right]), test)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        operand = sub(test.operand)
        if operand is not test.operand:
            return ast.copy_location(ast.UnaryOp(op=test.op, operand=operand), test)
    return test


def foreign_expert_class(an: Any, why: str) -> tuple[Any, ast.ClassDef] | None:
    """(the other file's ModuleInfo, the class) for experts built from a class that this file imports from another file
    of the scanned repository (sweep50moe Venish12 ``from expert import Expert``; ``why`` is ``_expert_class``'s refusal
    naming it): the class is read in its own file, with that file's imports, so the token-wise proof (s49) judges it
    as it judges a class of this file. None where the class is not found or not a plain top-level class there."""
    from npufuse.scan import repo_facts
    from npufuse.scan.dataflow import ModuleInfo

    prefix = "the expert class `"
    if not why.startswith(prefix) or "` is not defined in this file" not in why:
        return None
    name = why[len(prefix):why.index("`", len(prefix))]
    if "." in name:
        return None
    m = an.m
    cache = m.__dict__.setdefault("_npufuse_s50b_foreign", {})
    if name in cache:
        return cache[name]
    cache[name] = None
    d = repo_facts.definition(m, name)
    if d is None or not isinstance(d.node, ast.ClassDef) or d.rel == m.path:
        return None
    root = repo_facts.repo_root(m)
    text = repo_facts._repo_text(root, d.rel) if root is not None else None
    if text is None:
        return None
    try:
        other = ModuleInfo.from_source(d.rel, text, d.tree)
    except Exception:
        return None
    repo_facts.attach_root(other, root)
    cls = other.classes.get(name)
    if cls is None:
        return None
    cache[name] = (other, cls)
    return cache[name]


def token_slot_experts_tokenwise(module: Any, scope: Any, loop: ast.For, container: ast.expr) -> bool:
    """The token-wise proof (s49's ``tokenwise_experts``, reading a class of another file of the repository as above)
    for the experts ``container`` (``self.experts``) of the older direct per-(token, slot) form
    (``_token_slot_site``), which calls each expert on one token's row while its fused form calls it on all its rows:
    the same condition the canonical per-token reader (s50c) requires, so the two forms agree."""
    from npufuse.patterns import _moe_s49s

    class _Shim:  # the fields the expert-class readers take from the analyser
        indexed_module = indexed_call = template = None
        loop_kind = "range"
        s49_expert_loop = None

    an = _Shim()
    an.m, an.scope, an.loop, an.experts_node = module, scope, loop, container  # type: ignore[attr-defined]
    return _moe_s49s.tokenwise_experts(an)
