"""s46 (helper optim46, audit46's W1): an optimizer built by a method that a base class of another file calls.

NATSpeech's tasks build their optimizer in ``DiffSpeechTask.build_optimizer(self, model)``; the trainer never names
that method: it calls ``task.configure_optimizers()``, which ``BaseTask`` (utils/commons/base_task.py, an nn.Module)
defines as ``optm = self.build_optimizer(self.model); return [optm]``, and later ``task.zero_grad()`` after
validation. ``Module.zero_grad()`` frees every grad of the task (set_to_none=True by default on torch >= 2.0), so the
fused optimizer's flat grad buffer is stale from the first validation on. The cross-file pass
(:mod:`npufuse.scan.repo_facts`) follows a builder to the files that call it or a module-level forwarder of it; a
base class's method that calls ``self.<builder>(...)`` and returns what it builds is such a forwarder too, reached
through any object of the subclass. :func:`inherited_forwarders` lists them (the builder's class's bases resolved
through the repository's imports, a few levels up), so the driving file's facts about that object are read.

The fix the one-file case takes (rebinding the object's zero_grad to zero in place) is not taken across such a hop:
the driving file may call zero_grad on a wrapper of that object (NATSpeech's ``configure_ddp`` hands the trainer a
DDP around the task, whose own Module.zero_grad the rebinding does not reach), so the candidate becomes a near miss.
"""

from __future__ import annotations

import ast
from typing import Any, Iterator, Optional

_MAX_LEVELS = 6  # base classes followed up from the builder's class
_MAX_FORWARDERS = 4


def _method_forwards(fn: ast.AST, function: str) -> bool:
    """Does the method call ``self.<function>(...)`` and return what it got (the call, a name bound from it, or a
    list / tuple holding that name: ``return [optm]``)?"""
    bound: set[str] = set()
    called = False
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == function \
                and isinstance(n.func.value, ast.Name) and n.func.value.id == "self":
            called = True
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Attribute) \
                and n.value.func.attr == function and isinstance(n.value.func.value, ast.Name) and n.value.func.value.id == "self":
            bound |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    if not called:
        return False
    for n in ast.walk(fn):
        if not isinstance(n, ast.Return) or n.value is None:
            continue
        v = n.value
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == function:
            return True
        items = v.elts if isinstance(v, (ast.List, ast.Tuple)) else [v]
        if any(isinstance(e, ast.Name) and e.id in bound for e in items):
            return True
    return False


def _class_def(tree: Optional[ast.Module], name: str) -> Optional[ast.ClassDef]:
    for n in tree.body if tree is not None else ():
        if isinstance(n, ast.ClassDef) and n.name == name:
            return n
    return None


def base_classes(symbols: Any, rel: str, cls: ast.ClassDef, levels: int) -> Iterator[tuple[str, ast.ClassDef]]:
    """(file, ClassDef) of ``cls``'s base classes defined in the repository (``rel``: its file), nearest first, up to
    ``levels`` levels; each once (torch.nn.Module and other outside classes end the walk)."""
    todo: list[tuple[str, ast.ClassDef, int]] = [(rel, cls, 0)]
    seen: set[tuple[str, str]] = set()
    while todo:
        file, node, level = todo.pop(0)
        if level >= levels:
            continue
        for base in node.bases:
            sym = symbols.resolve_node(file, base)
            if sym.kind != "class" or not isinstance(sym.node, ast.ClassDef) or (sym.file, sym.qualname) in seen:
                continue
            seen.add((sym.file, sym.qualname))
            yield sym.file, sym.node
            todo.append((sym.file, sym.node, level + 1))


def inherited_forwarders(symbols: Any, builder: Any) -> list[Any]:
    """Builders (``repo_facts._Builder``) for the methods of the builder's base classes, in any file of the repo, that
    call the builder method on ``self`` and return what it builds; each has ``via`` set to ``builder`` and
    ``inherited`` True (its driving files' zero_grad frees are near misses, never rebound). [] for a function builder
    or a class whose bases do not resolve into the repository."""
    from npufuse.scan.repo_facts import _Builder

    if symbols is None or not builder.cls or not builder.function:
        return []
    tree, _why = symbols.tree(builder.rel)
    cls = _class_def(tree, builder.cls)
    out: list[Any] = []
    for file, base in base_classes(symbols, builder.rel, cls, _MAX_LEVELS) if cls is not None else ():
        base_tree, _why = symbols.tree(file)
        if base_tree is None or _class_def(base_tree, base.name) is not base:
            continue  # a nested class: not reachable by name from another file
        for fn in base.body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name != builder.function \
                    and _method_forwards(fn, builder.function):
                fwd = _Builder(file, f"{base.name}.{fn.name}", base_tree)
                if fwd.function:
                    fwd.via = builder
                    fwd.inherited = True
                    out.append(fwd)
        if len(out) >= _MAX_FORWARDERS:
            break
    return out


# --- audit46 W2: one entry of a submodule list chosen per step (one-shot NAS supernets, task heads) -----------------
# Cream's supernet runs `for layer, layer_arch in zip(self.blocks, architecture): for blocks, arch in zip(layer,
# layer_arch): x = blocks[arch](x)`: only the sampled choice of each layer runs, so the other choices have no grad at
# the first step() and torch_npu's fused optimizers exclude them from their flat buffers for good (spec §10), where
# torch.optim trains each choice on the steps that sample it. The same holds for any ModuleList / ModuleDict entry
# picked by a draw (`self.ops[random.randint(0, n - 1)](x)`). Not this class: an index running over every entry
# (`for i in range(len(self.layers))`, `enumerate(self.blocks)`), a constant index, an index computed from the data
# inside forward (router top-k: the moe rules judge those), and a bare argument index (`self.heads[task_id](x)`):
# its caller may run every entry on each step (`for t in range(n): self.heads_block(x, t)`), which is not read here.

_DRAW_CALLS = frozenset(("randint", "randrange", "choice", "multinomial", "random", "rand"))


def _draws(node: ast.AST) -> bool:
    """Does ``node`` call a draw (``random.randrange(n)``, ``np.random.choice(n)``, ``torch.randint(..).item()``)?"""
    return any(isinstance(n, ast.Call) and (n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", ""))
               in _DRAW_CALLS for n in ast.walk(node))


def _pairs(loop: ast.For | ast.AsyncFor) -> list[tuple[ast.expr, ast.expr]]:
    """(target, source) pairs a loop binds: ``zip(a, b)`` pairs each target with its source, ``enumerate(a)`` the
    second target with ``a``, a plain iterable the whole target with it."""
    it, target = loop.iter, loop.target
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "zip" and isinstance(target, ast.Tuple) \
            and len(target.elts) == len(it.args):
        return list(zip(target.elts, it.args))
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" and it.args \
            and isinstance(target, ast.Tuple) and len(target.elts) == 2:
        return [(target.elts[1], it.args[0])]
    while isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id in ("reversed", "list", "tuple") and it.args:
        it = it.args[0]
    return [(target, it)]


def _source_name(node: ast.expr) -> Optional[str]:
    """``a`` of ``a``, ``a[i]``, ``a.b`` (what a value is taken from); ``self.x`` as ``self.x``."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return f"self.{node.attr}"
    return node.id if isinstance(node, ast.Name) else None


def chosen_entries(fn: ast.FunctionDef | ast.AsyncFunctionDef, subs: set[str]) -> list[tuple[int, str, str]]:
    """(line, submodule attribute, text) of each call ``L[i](...)`` in ``fn`` where ``L`` is a submodule list of the
    class (``self.blocks``, or an element of one bound by a loop) and ``i`` is taken from an argument of ``fn`` zipped
    with a submodule list (one choice per entry; through loops and subscripts), or drawn at random."""
    if not any(isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript) for n in ast.walk(fn)):
        return []  # cheap gate: no call of a list entry
    a = fn.args
    origin = {x.arg: x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}  # name -> the argument it comes from
    origin.pop("self", None)
    elements: dict[str, str] = {}  # name -> the submodule list it is an element of
    drawn: set[str] = set()
    # an argument counts once it is zipped with a submodule list (one choice per entry: `zip(self.blocks, arch)`);
    # a bare argument index (`self.heads[i]`) may be run for every i by the caller, which is not read here
    zipped: set[str] = set()
    for n in ast.walk(fn):  # outer loops before inner ones (breadth first)
        if isinstance(n, (ast.For, ast.AsyncFor)):
            pairs = _pairs(n)
            sources = [_source_name(source) for _t, source in pairs]
            beside_list = len(pairs) > 1 and any(
                src is not None and (src in elements or src.startswith("self.") and src[5:] in subs) for src in sources)
            for (target, source), src in zip(pairs, sources):
                if not isinstance(target, ast.Name):
                    continue
                if src is not None and src.startswith("self.") and src[5:] in subs:
                    elements[target.id] = src[5:]
                elif src in elements:
                    elements[target.id] = elements[src]
                elif src in origin and not isinstance(source, ast.Call):
                    origin[target.id] = origin[src]
                    if beside_list or src in zipped:
                        zipped.add(target.id)
        elif isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            name = n.targets[0].id
            src = _source_name(n.value) if isinstance(n.value, ast.Subscript) else None
            if src in origin:
                origin[name] = origin[src]  # type: ignore[index]
                if src in zipped:
                    zipped.add(name)
            elif isinstance(n.value, ast.Call) and _draws(n.value):
                drawn.add(name)
    out: list[tuple[int, str, str]] = []
    for n in ast.walk(fn):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)):
            continue
        base, index = n.func.value, n.func.slice
        src = _source_name(base) if not isinstance(base, ast.Subscript) else None
        attr = src[5:] if src is not None and src.startswith("self.") and src[5:] in subs else elements.get(src or "")
        if attr is None:
            continue
        if isinstance(index, ast.Name) and index.id in zipped:
            why = f"{index.id} taken from the argument {origin[index.id]}" if index.id != origin[index.id] \
                else f"the argument {index.id}"
        elif isinstance(index, ast.Name) and index.id in drawn or isinstance(index, ast.Call) and _draws(index):
            why = "an index drawn at random"
        else:
            continue
        out.append((n.lineno, attr, f"{ast.unparse(n.func)}(...), {why}, picks one entry per call"))
    return out


# --- dead construction: the optimizer is replaced before anything reads it ------------------------------------------
# `self.opt = torch.optim.SGD(...)` followed in the same block by `self.opt = torch.optim.AdamW(...)` with no read of
# `self.opt` (and no `self.` call, which might read it) between them: the first object is never stepped, so rewriting it
# changes nothing (the blind judges' "dead construction" extras). A plain name is `_optim_s46h.rebound_before_read`'s
# (run first, in detect: it also refuses where a function of the module, which may read the global, or control flow
# sits between). Exact and local only: later statements of the same block, no read in between nor in the rebinding
# statement's value.

def _block_of(root: ast.AST, stmt: ast.stmt) -> Optional[list[ast.stmt]]:
    for n in ast.walk(root):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(n, field, None)
            if isinstance(block, list) and any(s is stmt for s in block):
                return block
    return None


def _reads_self(node: ast.AST, name: str) -> bool:
    """Does ``node`` read ``name`` (``self.x``), call a ``self.`` method (which may read it), or reflect?"""
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            if f"self.{n.attr}" == name and not isinstance(n.ctx, ast.Store):
                return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                and isinstance(n.func.value, ast.Name) and n.func.value.id == "self":
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("locals", "vars", "eval", "exec"):
            return True
    return False


def _self_target(stmt: ast.stmt) -> Optional[str]:
    """``self.x`` of ``self.x = value``; None for other statements."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1) and not (isinstance(stmt, ast.AnnAssign) and stmt.value):
        return None
    t = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
        return f"self.{t.attr}"
    return None


def overwritten_before_use(function: ast.AST, stmt: ast.stmt) -> Optional[str]:
    """The near-miss reason when the optimizer ``stmt`` binds to ``self.x`` is rebound later in the same block before
    anything reads it; None otherwise."""
    name = _self_target(stmt)
    if name is None:
        return None
    block = _block_of(function, stmt)
    if block is None:
        return None
    after = block[next(i for i, s in enumerate(block) if s is stmt) + 1:]
    for s in after:
        if _self_target(s) == name:
            value = s.value if isinstance(s, (ast.Assign, ast.AnnAssign)) else None
            if value is not None and not _reads_self(value, name):
                return (f"`{name}` is rebound at line {s.lineno} before anything reads the optimizer built here (a dead "
                        "construction): this object is never stepped, so its fused class would never run")
            return None
        if _reads_self(s, name) or any(isinstance(n, (ast.Global, ast.Nonlocal)) for n in ast.walk(s)):
            return None
    return None
