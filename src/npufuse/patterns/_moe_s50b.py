"""s50 moe50b: canonical-layer extensions of the moe_experts analysis (helper moe50b).

* A dead statistic in the expert loop (sweep50moe Shumatsurontek ``token_counts[e] += n`` with the logging of it
  commented out): a statement whose only effect is a write into a tensor this function made and never reads
  anywhere (no read after the loop, none in it, not returned, not stored, not aliased) changes nothing anyone can
  observe, so the expert loop is read without it (:func:`dead_statistic`). Statistics that ARE read keep their own
  readers (s41's count replay, s43b's side-statement replay).
"""

from __future__ import annotations

import ast
import copy
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
    other = repo_facts.definition_module(root, d) if root is not None else None
    if other is None:
        return None
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


# -- the per-(token, slot) canonical reader (s50c), two more spellings (HO24a keeratpreetsingh) -------------------------

def appended_row(comb: ast.stmt, loop_vars: list[str], block: list, i: int, loop: ast.For) -> tuple | None:
    """``(rows[t], v, True)`` for a per-token loop whose last statement ``rows.append(v)`` adds one row per token to a
    list bound to ``[]`` before the loop and named nowhere in between nor elsewhere in the loop: after the loop the
    list holds row t at index t, which is what ``rows[t] = v`` into a fresh buffer computes (the fused branch hands
    the list back as the buffer's rows, :func:`list_tail`). One token loop only (no slot loop: one row per token)."""
    if not (isinstance(comb, ast.Expr) and isinstance(comb.value, ast.Call) and isinstance(comb.value.func, ast.Attribute)
            and comb.value.func.attr == "append" and isinstance(comb.value.func.value, ast.Name)
            and len(comb.value.args) == 1 and not comb.value.keywords and not isinstance(comb.value.args[0], ast.Starred)):
        return None
    if len(loop_vars) != 1 or list_binding(block, i, comb.value.func.value.id) is None:
        return None
    acc = comb.value.func.value.id
    if sum(1 for n in fast_walk(loop) if isinstance(n, ast.Name) and n.id == acc) != 1:
        return None
    target = ast.Subscript(ast.Name(acc, ast.Load()), ast.Name(loop_vars[0], ast.Load()), ast.Store())
    return target, comb.value.args[0], True


def list_binding(block: list, i: int, acc: str) -> int | None:
    """The index in ``block`` of the statement ``acc = []`` before ``block[i]``, with no statement in between naming
    ``acc``; None otherwise."""
    for j in range(i - 1, -1, -1):
        st = block[j]
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) \
                and st.targets[0].id == acc:
            return j if isinstance(st.value, ast.List) and not st.value.elts else None
        if any(isinstance(n, ast.Name) and n.id == acc for n in fast_walk(st)):
            return None
    return None


def list_as_zeros(block: list, i: int, acc: str, tokens: str) -> list:
    """``block`` with ``acc = []`` read as ``acc = torch.zeros_like(tokens)`` (the fresh buffer whose rows the loop
    writes), on the original statement's line (its text is its unparse: no columns)."""
    j = list_binding(block, i, acc)
    assert j is not None
    old = block[j]
    new = ast.Assign(targets=[ast.Name(acc, ast.Store())],
                     value=ast.Call(ast.Attribute(ast.Name("torch", ast.Load()), "zeros_like", ast.Load()),
                                    [ast.Name(tokens, ast.Load())], []))
    for n in ast.walk(new):
        if "lineno" in n._attributes:
            n.lineno, n.end_lineno = old.lineno, old.end_lineno  # type: ignore[attr-defined]
            n.col_offset = n.end_col_offset = None  # type: ignore[attr-defined]
    return block[:j] + [new] + block[j + 1:]


def list_tail(acc: str) -> str:
    """The fused branch's last line for a list accumulator: the code after the loop reads a Python list of [H] rows
    (``torch.stack(rows)``, ``len(rows)``, ``rows[t]``): the fused [T, H] result's rows as such a list."""
    return f"# the loop's list `{acc}` of per-token rows, as the code after it reads it\n{acc} = list({acc}.unbind(0))"


def _terms(node: ast.expr) -> list[ast.expr]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _terms(node.left) + _terms(node.right)
    return [node]


def unrolled_slots(value: ast.expr, tok_vars: list[str], pair_index: Any, slot: str) -> tuple[ast.expr, int] | None:
    """``(term with the slot index as the name slot, K)`` where ``value`` is ``t_0 + ... + t_{K-1}`` (any order), term j
    ``E[ids[tok.., j]](x[tok..]) * w[tok.., j]`` (either factor order, ``.item()`` / ``int()`` ids), the same experts,
    ids, rows and weights in every term and each slot 0..K-1 exactly once; None otherwise."""
    terms = _terms(value)
    if len(terms) < 2:
        return None
    k = len(terms)
    seen: dict[int, ast.expr] = {}
    shapes: set[str] = set()
    for term in terms:
        if not (isinstance(term, ast.BinOp) and isinstance(term.op, ast.Mult)):
            return None
        found = None
        for call, w in ((term.left, term.right), (term.right, term.left)):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript)):
                continue
            for j in range(k):
                pair = tok_vars + [f"#{j}"]
                ids, wts = pair_index(call.func.slice, pair), pair_index(w, pair)
                if ids is not None and wts is not None:
                    found = (j, ids, wts, call)
        if found is None or found[0] in seen:
            return None
        j, ids, wts, call = found
        seen[j] = term
        # everything but the slot constant is the same in every term
        shapes.add(f"{ids}|{wts}|{ast.dump(call.func.value)}|{[ast.dump(a) for a in call.args]}|{[ast.dump(kw) for kw in call.keywords]}")
    if sorted(seen) != list(range(k)) or len(shapes) != 1:
        return None
    ids, wts = shapes.pop().split("|")[:2]
    template = copy.deepcopy(seen[0])

    class _Slot(ast.NodeTransformer):
        def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
            self.generic_visit(node)
            base = node.value
            while isinstance(base, ast.Subscript):
                base = base.value
            if not (isinstance(base, ast.Name) and base.id in (ids, wts)):
                return node
            if isinstance(node.slice, ast.Constant) and node.slice.value == 0 and type(node.slice.value) is int:
                node.slice = ast.Name(slot, ast.Load())
            elif isinstance(node.slice, ast.Tuple) and node.slice.elts and isinstance(node.slice.elts[-1], ast.Constant) \
                    and node.slice.elts[-1].value == 0 and type(node.slice.elts[-1].value) is int:
                node.slice.elts[-1] = ast.Name(slot, ast.Load())
            return node

    return _Slot().visit(template), k


def calls_indexed_experts(loop: ast.For) -> bool:
    """The loop calls a module picked by index from a container whose name says experts (``self.list_of_experts[i]
    (x)``, HO24a keeratpreetsingh): worth analysing, whatever the loop's header says (``.experts`` was the gate)."""
    for n in fast_walk(loop):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript):
            base = n.func.value
            name = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else ""
            if "expert" in name.lower():
                return True
    return False
