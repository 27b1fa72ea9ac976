"""Code that tests whether a parameter's grad is None (s40, opt40).

torch.optim's ``zero_grad()`` (default ``set_to_none=True`` on torch >= 2.0) leaves every grad None until the
next backward gives one, and a parameter that gets no grad in a step (an expert no token reaches, a branch the
batch does not take) keeps None. torch_npu's fused optimizers keep every grad they combined at the first step
allocated and zero it in place (spec §10): such a test then sees a zero tensor, not None, and the code takes its
other branch (anmoa/PILF's expert choice gives a grad-None expert ``surprise = inf``, a zero-grad one 0).

:func:`reads` lists the tests of one file whose outcome can change that way: ``p.grad is None`` /
``p.grad is not None`` where ``p`` runs over a module's parameters (``for p in model.parameters()``, a
comprehension over ``expert.named_parameters()``, a name bound from one). Left out, as they behave the same with
a zero grad: an optimizer's own loop over its ``param_groups`` (a custom optimizer's ``step``: its own
parameters, not the fused one's), a guarded body that only scales / clears the grad in place, adds its norm to a
sum (``total += p.grad.norm() ** 2``: a zero grad adds 0), checks it for NaN / Inf or logs it, a sum of such norms,
and asserts. torch's own gradient clipping utilities are library code (never read here).
"""

from __future__ import annotations

from npufuse.scan import _grad_none_s50c, _grad_none_s51b

import ast
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from npufuse.scan.random_skip import RepoIndex

WORD = "grad is "
# in-place methods that leave a zero grad zero (`p.grad.mul_(c)`, `p.grad.data.zero_()`)
_ZERO_KEEPING = frozenset(("zero_", "mul_", "div_", "clamp_", "clip_", "nan_to_num_", "masked_fill_"))
# reductions whose value on a zero tensor adds nothing to a sum of non-negative terms
_NORM_LIKE = frozenset(("norm", "pow", "abs", "sum", "square", "item", "float", "double", "detach", "cpu", "vector_norm",
                        "data", "grad", "max", "amax"))


def _grad_test(node: ast.AST) -> Optional[str]:
    """``R`` of ``R.grad is None`` / ``R.grad is not None`` (R a plain name)."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot))
            and isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value is None):
        return None
    left = node.left
    if isinstance(left, ast.Attribute) and left.attr == "grad" and isinstance(left.value, ast.Name):
        return left.value.id
    return None


def _optimizer_loop(it: ast.AST) -> bool:
    """An optimizer's own loop: ``self.param_groups``, ``group["params"]``."""
    for n in ast.walk(it):
        if isinstance(n, ast.Attribute) and n.attr == "param_groups":
            return True
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value == "params":
            return True
    return False


def _module_parameters(it: ast.AST, bound: dict[str, ast.AST]) -> bool:
    """Does ``it`` iterate a module's parameters: a ``.parameters()`` / ``.named_parameters()`` call in it, or a
    name the function binds from one (``params = list(model.parameters())``)?"""
    for n in ast.walk(it):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("parameters", "named_parameters"):
            return True
        if isinstance(n, ast.Name) and n.id in bound and bound[n.id] is not it:
            value = bound.pop(n.id)  # once: a name bound from itself does not loop
            try:
                if _module_parameters(value, bound):
                    return True
            finally:
                bound[n.id] = value
    return False


def _norm_of(expr: ast.AST, name: str, derived: set[str]) -> bool:
    """Is ``expr`` a non-negative reduction of ``name.grad`` (or of names derived from one), which is 0 for a zero
    grad: ``p.grad.data.norm(2).item() ** 2``, ``torch.norm(p.grad)``, ``param_norm ** 2``?"""
    reads = False
    for n in ast.walk(expr):
        if isinstance(n, ast.Name):
            if n.id == name or n.id in derived:
                reads = True
            elif n.id not in ("torch", "math", "float"):
                return False
        elif isinstance(n, ast.Call):
            f = n.func
            last = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if last not in _NORM_LIKE:
                return False
        elif isinstance(n, ast.Attribute) and n.attr not in _NORM_LIKE and n.attr not in ("linalg",):
            if not (isinstance(n.value, ast.Name) and n.value.id in ("torch", "math")):
                return False
        elif isinstance(n, ast.BinOp) and not isinstance(n.op, (ast.Pow, ast.Mult)):
            return False
        elif isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and n.value < 0:
            return False
    return reads


def _zero_keeping(stmts: list[ast.stmt], name: str) -> bool:
    """Do ``stmts`` (run when ``name.grad`` is not None) behave the same for a zero grad as for no statement at all:
    in-place scaling / clearing of the grad, or adding its norm to an accumulator?"""
    derived: set[str] = set()
    for st in stmts:
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Attribute) \
                and st.value.func.attr in _ZERO_KEEPING:
            recv = st.value.func.value
            while isinstance(recv, ast.Attribute) and recv.attr in ("grad", "data"):
                recv = recv.value
            if not (isinstance(recv, ast.Name) and recv.id == name):
                return False
        elif isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) \
                and _norm_of(st.value, name, derived):
            derived.add(st.targets[0].id)
        elif isinstance(st, ast.AugAssign) and isinstance(st.op, ast.Add) and _norm_of(st.value, name, derived):
            continue
        elif isinstance(st, (ast.Pass, ast.Continue)):
            continue
        elif isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and _called_name(st.value) in _LOGGING:
            continue  # what a log shows of a parameter without a grad is no change to the training
        elif isinstance(st, ast.If) and not st.orelse and _false_on_zero(st.test, name):
            continue  # `if torch.isnan(p.grad).any(): ...`: a zero grad never enters it
        else:
            return False
    return True


# s41 (sweep41b, vocos / WavTokenizer ``gradient_norm``): ``grads = [p.grad for p in model.parameters() if p.grad is
# not None]`` then ``torch.norm(torch.stack([torch.norm(g) for g in grads]), 2)``: a zero grad adds a 0 to the norms a
# p-norm (or a max) reduces, so the value is the same. Only where every use of the list is such a norm of its norms.
_TOTAL_NORM = frozenset(("norm", "vector_norm"))


def _norms_only_list(comp: ast.AST, name: str, fn: ast.AST, bound: dict[str, ast.AST]) -> bool:
    """Is ``comp`` (a list of ``name.grad`` or its norms, filtered by a grad-None test) bound to a name in ``fn`` whose
    every use reads it only through a total norm: ``torch.norm(torch.stack([torch.norm(g, t) for g in grads]), t)``
    (``torch.stack(grads)`` of the norms themselves too)? A list used nowhere else, or not at all, is not read so."""
    if isinstance(comp, ast.ListComp) and isinstance(comp.elt, ast.Name) and comp.elt.id == name:
        # s51b: the parameters themselves, read only through their grads' norms (nanoMolmo2's compute_gradient_norm)
        return _grad_none_s51b.params_read_only_for_norms(comp, name, fn, bound)
    if not (isinstance(comp, ast.ListComp) and _norm_of(comp.elt, name, set())):
        return False
    held = next((k for k, v in bound.items() if v is comp), None)
    if held is None:
        return False
    parents: dict[int, ast.AST] = {}
    uses: list[ast.Name] = []
    for n in ast.walk(fn):
        for ch in ast.iter_child_nodes(n):
            parents[id(ch)] = n
        if isinstance(n, ast.Name) and n.id == held and isinstance(n.ctx, ast.Load):
            uses.append(n)
    return bool(uses) and all(_read_by_total_norm(u, parents) for u in uses)


def _norm_call_of(expr: ast.AST, name: str) -> bool:
    """``torch.norm(g.detach(), t)`` / ``torch.linalg.vector_norm(g, t)`` / ``g.norm(t)`` of the plain tensor ``name``
    (or its ``.detach()`` / ``.data`` / ``.float()``): the order ``t`` may be any expression (a norm is >= 0 whatever it is)."""
    if not (isinstance(expr, ast.Call) and _called_name(expr) in _TOTAL_NORM):
        return False
    f = expr.func
    library = isinstance(f, ast.Name) or (isinstance(f, ast.Attribute) and (
        (isinstance(f.value, ast.Name) and f.value.id == "torch") or (isinstance(f.value, ast.Attribute) and f.value.attr == "linalg")))
    x: Optional[ast.AST] = (expr.args[0] if expr.args else None) if library else f.value if isinstance(f, ast.Attribute) else None
    while isinstance(x, ast.Call) and isinstance(x.func, ast.Attribute) and x.func.attr in ("detach", "float", "double") and not x.args:
        x = x.func.value
    while isinstance(x, ast.Attribute) and x.attr == "data":
        x = x.value
    return isinstance(x, ast.Name) and x.id == name


def _read_by_total_norm(use: ast.Name, parents: dict[int, ast.AST]) -> bool:
    """``use`` (the grads list) is the iterable of ``[torch.norm(g, t) for g in <use>]`` stacked as the first argument
    of ``torch.norm`` / ``torch.linalg.vector_norm``."""
    up = parents.get(id(use))
    if not (isinstance(up, ast.comprehension) and up.iter is use and not up.ifs and isinstance(up.target, ast.Name)):
        return False
    stacked = parents.get(id(up))
    if not (isinstance(stacked, ast.ListComp) and len(stacked.generators) == 1 and _norm_call_of(stacked.elt, up.target.id)):
        return False
    call = parents.get(id(stacked))
    if not (isinstance(call, ast.Call) and _called_name(call) == "stack" and call.args and call.args[0] is stacked):
        return False
    total = parents.get(id(call))
    if not (isinstance(total, ast.Call) and _called_name(total) in _TOTAL_NORM and total.args and total.args[0] is call):
        return False
    # a negative order (-inf: the smallest norm) would see the zero; a name (a helper's `norm_type`) is taken as a norm's
    order = total.args[1] if len(total.args) > 1 else next((k.value for k in total.keywords if k.arg in ("p", "ord")), None)
    return not (isinstance(order, ast.UnaryOp) and isinstance(order.op, ast.USub)) and \
        not (isinstance(order, ast.Constant) and isinstance(order.value, (int, float)) and order.value < 0)


_LOGGING = frozenset(("print", "add_histogram", "add_scalar", "add_scalars", "log", "info", "debug", "warning", "log_metrics"))


# s42 (sweep42b, diffusion-forcing's Lightning template ``log_gradient_stats``): ``if p.grad is not None:
# grad_norms.append(torch.norm(p.grad).item()); gpr.append(torch.norm(p.grad) / torch.norm(p))``, the lists turned into
# tensors whose min / max / mean only a ``self.log_dict({...})`` reads. A zero grad adds a 0 to what is logged, no
# change to the training (like the logging calls :func:`_zero_keeping` accepts). Only where every read of the lists,
# and of what is made of them, is a ``len`` or lies inside a logging call's arguments.
_STAT_LOGGING = _LOGGING | frozenset(("log_dict", "add_scalar_dict", "log_scalars"))
_TO_TENSOR = frozenset(("tensor", "as_tensor", "stack", "array", "asarray", "Tensor"))


def _logged_statistics(stmts: list[ast.stmt], name: str, fn: ast.AST) -> bool:
    """Is every statement of ``stmts`` ``L.append(<a norm of name.grad, or a ratio of norms>)``, with each such list
    ``L`` read in ``fn`` only by ``len`` or, once made a tensor (``torch.tensor(L)``), inside a logging call?"""
    lists: set[str] = set()
    for st in stmts:
        call = st.value if isinstance(st, ast.Expr) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "append"
                and isinstance(call.func.value, ast.Name) and len(call.args) == 1 and not call.keywords):
            return False
        value = call.args[0]
        parts = [value.left, value.right] if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Div) else [value]
        if not all(_norm_of(part, name, set()) for part in parts[:1]) or not all(_is_a_norm(part) for part in parts):
            return False
        lists.add(call.func.value.id)
    return bool(lists) and all(_read_only_for_logging(fn, held) for held in lists)


def _is_a_norm(expr: ast.AST) -> bool:
    """``torch.norm(x)`` / ``x.norm()`` / ``torch.linalg.vector_norm(x)``, maybe followed by ``.item()``: >= 0."""
    while isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in ("item", "detach", "cpu", "float"):
        expr = expr.func.value
    return isinstance(expr, ast.Call) and _called_name(expr) in _TOTAL_NORM


def _read_only_for_logging(fn: ast.AST, held: str) -> bool:
    """Every read of ``held`` in ``fn``: the receiver of ``.append``, an argument of ``len``, or the argument of a
    tensor-making call bound to a name that is itself read only so (or inside a logging call's arguments)."""
    parents: dict[int, ast.AST] = {}
    reads: list[ast.Name] = []
    for n in ast.walk(fn):
        for ch in ast.iter_child_nodes(n):
            parents[id(ch)] = n
    names, seen = [held], set()
    while names:
        current = names.pop()
        if current in seen:
            continue
        seen.add(current)
        reads = [n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == current and isinstance(n.ctx, ast.Load)]
        if not reads:
            return False
        for use in reads:
            up = parents.get(id(use))
            if isinstance(up, ast.Attribute) and up.attr == "append" and current == held:
                continue
            if isinstance(up, ast.Call) and _called_name(up) == "len" and up.args and up.args[0] is use:
                continue
            if isinstance(up, ast.Call) and _called_name(up) in _TO_TENSOR and up.args and up.args[0] is use:
                bound = parents.get(id(up))
                if isinstance(bound, ast.Assign) and len(bound.targets) == 1 and isinstance(bound.targets[0], ast.Name):
                    names.append(bound.targets[0].id)
                    continue
                return False
            if not _inside_logging_call(use, parents):
                return False
    return True


def _inside_logging_call(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """``node`` lies in the arguments of a logging call (``self.log_dict({"grad/min": grad_norms.min()})``)."""
    child, up = node, parents.get(id(node))
    while up is not None and not isinstance(up, ast.stmt):
        if isinstance(up, ast.Call) and _called_name(up) in _STAT_LOGGING and child is not up.func:
            return True
        child, up = up, parents.get(id(up))
    return False


def _called_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _false_on_zero(test: ast.AST, name: str) -> bool:
    """Is ``test`` a finiteness check of ``name.grad`` that a zero grad fails: ``torch.isnan(p.grad).any()``,
    ``torch.isinf(...)``, ``not torch.isfinite(p.grad).all()``, an ``or`` of such?"""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        return all(_false_on_zero(v, name) for v in test.values)
    negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
    inner = test.operand if negated else test  # type: ignore[attr-defined]
    if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.func.attr in ("any", "all") and not inner.args:
        inner = inner.func.value
    if not (isinstance(inner, ast.Call) and inner.args):
        return False
    f = inner.func
    check = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    arg = inner.args[0]
    while isinstance(arg, ast.Attribute) and arg.attr in ("grad", "data"):
        arg = arg.value
    if not (isinstance(arg, ast.Name) and arg.id == name):
        return False
    return (check in ("isnan", "isinf") and not negated) or (check == "isfinite" and negated)


class _Reader(ast.NodeVisitor):
    """One walk of a file: each grad test, the loop or comprehension that binds its name, and what it guards."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []
        self.loops: list[tuple[set[str], ast.AST, list[ast.stmt]]] = []  # (target names, iterable, body)
        self.bound: list[dict[str, ast.AST]] = [{}]  # per function: name -> its last plain assignment
        self.reducer: dict[int, str] = {}  # id of a comprehension reduced by builtin sum() / all() / any() -> which
        self.asserts: set[int] = set()
        self.in_optimizer_class = 0
        self.functions: list[ast.AST] = []  # the enclosing defs, innermost last (s41: where a grads list is used)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        optimizer = any("Optimizer" in ast.unparse(b) for b in node.bases)
        self.in_optimizer_class += optimizer
        self.generic_visit(node)
        self.in_optimizer_class -= optimizer

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.bound.append({})
        self.functions.append(node)
        saved, self.loops = self.loops, []
        self.generic_visit(node)
        self.loops = saved
        self.functions.pop()
        self.bound.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            if isinstance(t, ast.Name):
                self.bound[-1][t.id] = node.value
        self.generic_visit(node)

    def visit_Assert(self, node: ast.Assert) -> None:
        self.asserts.update(id(n) for n in ast.walk(node.test))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in ("sum", "all", "any") and node.args:
            self.reducer[id(node.args[0])] = node.func.id
        self.generic_visit(node)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        names = {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
        self.visit(node.iter)
        self.loops.append((names, node.iter, node.body))
        for st in node.body:
            self.visit(st)
        self.loops.pop()
        for st in node.orelse:
            self.visit(st)

    visit_AsyncFor = visit_For  # type: ignore[assignment]

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp) -> None:
        for gen in node.generators:
            names = {n.id for n in ast.walk(gen.target) if isinstance(n, ast.Name)}
            for cond in gen.ifs:
                for n in ast.walk(cond):
                    name = _grad_test(n)
                    if name in names and not self._harmless_comprehension(node, name):
                        self._record(n, gen.iter)
        self.generic_visit(node)

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension  # type: ignore[assignment]

    def _harmless_comprehension(self, node: ast.AST, name: str) -> bool:
        """A sum of the grads' norms (a zero grad adds 0), an ``all`` of finiteness checks (a zero grad is finite), an
        ``any`` of NaN / Inf checks (a zero grad has none)."""
        elt = getattr(node, "elt", None)
        how = self.reducer.get(id(node))
        if elt is not None and how is None and self.functions:
            return _norms_only_list(node, name, self.functions[-1], self.bound[-1])
        if elt is None or how is None:
            return False
        if how == "sum":
            return _norm_of(elt, name, set())
        if how == "any":
            return _false_on_zero(elt, name)
        return _false_on_zero(ast.UnaryOp(op=ast.Not(), operand=elt), name)

    def visit_If(self, node: ast.If) -> None:
        # the test itself, or one conjunct of an `and` (`if p.requires_grad and p.grad is not None:`)
        parts = node.test.values if isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And) else [node.test]
        test = next((t for t in parts if _grad_test(t)), None)
        name = _grad_test(test) if test is not None else None
        loop = next((lp for lp in reversed(self.loops) if name in lp[0]), None) if name else None
        if loop is not None and test is not None:
            is_none = isinstance(test.ops[0], ast.Is)  # type: ignore[attr-defined]
            harmless = False
            if node.orelse:
                pass
            elif is_none and len(parts) == 1 and len(node.body) == 1 and isinstance(node.body[0], ast.Continue):
                # `if p.grad is None: continue` guards the rest of the loop body (the `if` a statement of it)
                at = next((i for i, s in enumerate(loop[2]) if s is node), None)
                harmless = at is not None and _zero_keeping(loop[2][at + 1:], name)  # type: ignore[arg-type]
            elif not is_none:
                harmless = _zero_keeping(node.body, name) or (  # type: ignore[arg-type]
                    bool(self.functions) and _logged_statistics(node.body, name, self.functions[-1]))
            if not harmless:
                self._record(test, loop[1])
        self.generic_visit(node)

    def _record(self, test: ast.AST, iterable: ast.AST) -> None:
        if self.in_optimizer_class or id(test) in self.asserts or _optimizer_loop(iterable):
            return
        if _module_parameters(iterable, dict(self.bound[-1])):
            self.found.append((test.lineno, " ".join(ast.unparse(test).split())))


def reads(text: str, tree: Optional[ast.Module]) -> list[tuple[int, str]]:
    """(line, test) of each grad-None test of a module's parameters whose outcome a zero grad changes (text-gated:
    files that never write ``grad is`` are not walked)."""
    if tree is None or WORD not in text:
        return []
    r = _Reader()
    r.visit(tree)
    return sorted(set(r.found))


def reason(where: str, test: str, whose: str) -> str:
    """The near-miss reason of an optimizer whose parameters' grad None-ness the code at ``where`` tests."""
    return (f"{whose} tests whether a parameter's grad is None (`{test}` at {where}): under torch.optim, zero_grad() "
            "(default set_to_none=True) leaves grads None until the next backward, and a parameter that gets no grad in "
            "a step (an expert no token reaches, an unused branch) stays None; torch_npu fused optimizers keep those "
            "grads allocated and zero them in place, so that test sees a zero tensor instead of None and the code takes "
            "its other branch")


def _selected_by_name(tree: ast.Module, qualname: str, params: str) -> bool:
    """Are the site's params (``params``, a name bound in its function) a part of a model selected by parameter name:
    ``[p for n, p in model.named_parameters() if "gating" in n]`` (a positive ``in`` / ``startswith`` test of the
    name)? Code elsewhere that loops over a model's parameters cannot be tied to such a part (PILF's gating
    optimizer beside the experts' one)."""
    from npufuse.scan.random_skip import _function_of

    fn = _function_of(tree, qualname) if params.isidentifier() else None
    for n in ast.walk(fn) if fn is not None else ():
        if not (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == params for t in n.targets)):
            continue
        if not isinstance(n.value, (ast.ListComp, ast.GeneratorExp)):
            return False
        for gen in n.value.generators:
            names = {x.id for x in ast.walk(gen.target) if isinstance(x, ast.Name)}
            for cond in gen.ifs:
                for c in ast.walk(cond):
                    if isinstance(c, ast.Compare) and len(c.ops) == 1 and isinstance(c.ops[0], ast.In) \
                            and isinstance(c.left, ast.Constant) and isinstance(c.comparators[0], ast.Name) and c.comparators[0].id in names:
                        return True
                    if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in ("startswith", "endswith") \
                            and isinstance(c.func.value, ast.Name) and c.func.value.id in names:
                        return True
        return False
    return False


def site_reads(index: "RepoIndex", rel: str, qualname: str, params: str = "") -> Optional[str]:
    """The near-miss reason for an optimizer site (file ``rel``, function ``qualname``) when a file its trainer
    reaches through imports (the site's file, the files importing its builder, what they import: bounded) tests
    grad None-ness that way; the site's own file is judged by the detector with its regions (not here). Not for
    params selected by parameter name (:func:`_selected_by_name`)."""
    from npufuse.scan.random_skip import _drivers, reachable_files

    tree = index.tree(rel)
    if tree is None or _selected_by_name(tree, qualname, params):
        return None
    for other in reachable_files(index, [rel, *_drivers(index, rel, qualname)]):
        if other == rel:
            continue
        # s50c: a test in a function that builds and steps its own optimizer is not this optimizer's
        hit = next((h for h in index.grad_none_reads(other)
                    if not _grad_none_s50c.concerns_own_optimizer(index.tree(other), h[0], qualname.rpartition(".")[2])), None)
        if hit is not None:
            return reason(f"{other}:{hit[0]}", hit[1], "training code the trainer's imports reach (its model is not told apart)")
    return None
