"""Facts from OTHER files of the repo that decide whether a candidate is safe (issue 14 class 5).

A fused optimizer is often built in one file (``GPT.configure_optimizers`` in model.py, a
``train(rank, args, model)`` worker in train.py) and driven from another (train.py's loop calling
``optimizer.zero_grad(set_to_none=True)``, main.py's hogwild ``model.share_memory()``). The
detector sees one file; this pass runs once per scan, in the parent, after every file is analysed,
and only when there is a ``fused_optimizer`` candidate. Cost: the text of the repo's files is
searched for the builder's name (a substring test); only files that name the builder AND one of
the facts below are parsed.

A file *drives* a candidate when it imports the candidate's module (by its module name) and
refers to the function or method that builds the optimizer (calls it, or hands it on, as in
``mp.Process(target=train, args=(..., model, ...))``). The objects it hands that function (the
call's arguments, the receiver of ``model.configure_optimizers(...)``) are the model; the names
the call's result is bound to are the optimizer. Facts on those names, in that file:

* ``O.zero_grad(set_to_none=True)`` (or a non-constant flag): torch_npu's fused class raises
  ValueError on it (spec §10) -> near miss;
* ``M.zero_grad()`` (torch >= 2.0 default set_to_none=True) or ``M.zero_grad(set_to_none=True)``:
  grads freed and re-allocated outside the flat buffer, the update silently uses stale grads ->
  near miss;
* ``M.share_memory()`` (hogwild): the fused class re-points every param's storage into its own
  flat buffer at the first step, so the processes would stop sharing parameters -> near miss;
* FSDP / DeepSpeed / ZeRO wrapping of M or O: params flattened behind the optimizer -> near miss,
  or a risk when the wrapping sits under an ``if`` / conditional expression (a run-time choice);
* accelerate ``prepare`` of O followed by ``O.zero_grad()``: AcceleratedOptimizer passes
  set_to_none=True -> near miss.

A zero_grad that frees grads by default (``M.zero_grad()``, accelerate's ``O.zero_grad()``) makes
the candidate's fused branch rebind that zero_grad to zero in place instead, with the risk stated
(as fused_optimizer does when the call is in the candidate's own file). An explicit
``set_to_none=True`` (or a flag) is the code's choice: that rebinding only with ``npufuse scan
--optimizer-zero-grad-in-place``; without it the near miss's reason names that option.

Every reason names the other file and line. Never raises: a file it cannot read or parse says
nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Optional

from npufuse.patterns.base import Risk
from npufuse.scan.dataflow import dotted

_PATTERN = "fused_optimizer"
# words a driving file must contain for this pass to parse it
_WORDS = ("zero_grad", "share_memory", "fsdp", "FSDP", "FullyShard", "fully_shard", "DeepSpeed", "deepspeed", "Zero", "prepare")
_SHARDING_PARTS = ("fsdp", "fullyshard", "fully_shard", "deepspeed", "zeroredundancy")


def apply(root: Path, files: Iterable[str], outcomes: list[Any], near: list[dict[str, Any]], max_bytes: int,
          zero_in_place: bool = False) -> None:
    """Turn fused_optimizer hits that another file makes unsafe into near misses (appended to
    ``near``) and attach risks for run-time-chosen sharding. Mutates ``outcomes``' hits.
    ``zero_in_place`` (``npufuse scan --optimizer-zero-grad-in-place``): grads another file frees
    through a zero_grad are zeroed in place by the fused branch instead (:func:`_zero_in_place`);
    without it those are near misses whose reason names the option."""
    try:
        _apply(root, list(files), outcomes, near, max_bytes, zero_in_place)
    except (Exception, RecursionError):  # an analysis aid: never lose the scan over it
        return


class _Builder:
    """One candidate: the file, and the module-level function or method of a module-level class
    that builds the optimizer (a nested function cannot be reached from another file: "")."""

    def __init__(self, rel: str, qualname: str, tree: Optional[ast.Module]) -> None:
        self.rel = rel
        p = PurePosixPath(rel)
        self.module = p.parent.name if p.stem == "__init__" else p.stem
        self.function = ""
        self.cls = ""
        parts = qualname.split(".")
        top = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))} if tree else {}
        if len(parts) == 1 and isinstance(top.get(parts[0]), (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.function = parts[0]
        elif len(parts) == 2 and isinstance(top.get(parts[0]), ast.ClassDef):
            cls = top[parts[0]]
            if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == parts[1] for n in cls.body):
                self.function, self.cls = parts[1], parts[0]


def _apply(root: Path, files: list[str], outcomes: list[Any], near: list[dict[str, Any]], max_bytes: int, zero_in_place: bool) -> None:
    hits = [(o, h) for o in outcomes for h in o.hits if h.finding.pattern == _PATTERN]
    if not hits:
        return
    _wrapped_by_reallocating_class(root, files, outcomes, near, max_bytes)
    hits = [(o, h) for o in outcomes for h in o.hits if h.finding.pattern == _PATTERN]
    if not hits:
        return
    builders: dict[tuple[str, str], _Builder] = {}
    for o, h in hits:
        if (o.file, h.finding.qualname) not in builders:
            builders[(o.file, h.finding.qualname)] = _Builder(o.file, h.finding.qualname, _parse(_read(root, o.file, max_bytes)))
    names = {b.function for b in builders.values() if b.function and b.module}
    if not names:
        return
    texts: dict[str, str] = {}
    defined: dict[str, set[str]] = {}  # builder name -> the files defining a function/method of that name
    for rel in files:
        text = _read(root, rel, max_bytes)
        if text is not None:
            for n in names:
                if f"def {n}(" in text:
                    defined.setdefault(n, set()).add(rel)
        if text is not None and any(n in text for n in names) and any(w in text for w in _WORDS):
            texts[rel] = text
    trees: dict[str, Optional[ast.Module]] = {}
    for o, h in list(hits):
        b = builders[(o.file, h.finding.qualname)]
        if not b.function:
            continue
        # a method defined nowhere else in the repo is reached through any object (minGPT's trainer
        # gets the model as an argument and calls `model.configure_optimizers(...)`, importing nothing)
        unique = bool(b.cls) and defined.get(b.function) == {b.rel}
        for rel in sorted(texts):
            if rel == b.rel or b.function not in texts[rel] or (b.module not in texts[rel] and not unique):
                continue
            if rel not in trees:
                try:
                    trees[rel] = ast.parse(texts[rel])
                except (SyntaxError, ValueError, RecursionError, MemoryError):
                    trees[rel] = None
            tree = trees[rel]
            if tree is None:
                continue
            imported = _imports(tree, b.module)
            # a function is reached by its imported name (or module.function); a method through an
            # object of its class, which the file must import (or the module holding it)
            found, names_ = imported
            reach = b.cls if b.cls else b.function
            if not unique and (not found or not ("*" in names_ or reach in names_)):
                continue
            verdict = _verdict(tree, rel, b)
            if verdict is None:
                continue
            blocked, text, fix, explicit = verdict
            f = h.finding
            # an explicit set_to_none=True (or a flag) is the code's choice to free grads: zeroed in
            # place only on request; a free by default (`model.zero_grad()` on torch >= 2.0,
            # accelerate's prepared `zero_grad()`) is zeroed in place as fused_optimizer does in one file
            target = _zero_target(root, h, b, fix, max_bytes) if blocked and fix is not None else None
            if target is not None and (zero_in_place or not explicit):
                _zero_in_place(o, h, fix, target, text)
                continue  # the fused branch now zeroes those grads in place (a risk says so); other files may still block
            if target is not None:  # explicit, without the option
                from npufuse.patterns.fused_optimizer import ZERO_IN_PLACE_OPT_IN

                text += ZERO_IN_PLACE_OPT_IN
            if blocked:
                if h in o.hits:
                    o.hits.remove(h)
                near.append({"pattern": f.pattern, "file": o.file, "qualname": f.qualname, "line": f.line,
                             "end_line": f.end_line, "reason": text})
                break
            # a detector risk (the candidate's own "other" risks would hide a generic one of that kind)
            f.risks.append(Risk("other", text))


def _parse(text: Optional[str]) -> Optional[ast.Module]:
    if text is None:
        return None
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _read(root: Path, rel: str, max_bytes: int) -> Optional[str]:
    try:
        with open(Path(root) / rel, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError:
        return None
    if len(data) > max_bytes:
        return None
    return data.decode("utf-8", errors="replace")


def _imports(tree: ast.Module, module: str) -> tuple[bool, set[str]]:
    """(the file imports ``module`` as a module, the names it imports from it: ``from .module
    import GPT`` gives {"GPT"}). ``import a.module`` / ``from pkg import module`` import the
    module itself (its names reached as ``module.x``: every name counts)."""
    whole = False
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(module in a.name.split(".") for a in node.names):
                whole = True
        elif isinstance(node, ast.ImportFrom):
            if node.module and node.module.split(".")[-1] == module:
                names |= {a.name for a in node.names}
            elif any(a.name == module for a in node.names):
                whole = True
    if whole:
        return True, {"*"}
    return bool(names), names


def _walk_with_branch(tree: ast.AST) -> Iterable[tuple[ast.AST, Optional[int]]]:
    """Every node with the line of the innermost ``if`` / conditional expression whose branch
    holds it (None: unconditional)."""
    stack: list[tuple[ast.AST, Optional[int]]] = [(tree, None)]
    while stack:
        node, cond = stack.pop()
        yield node, cond
        if isinstance(node, ast.If):
            stack.append((node.test, cond))
            stack.extend((c, node.lineno) for c in [*node.body, *node.orelse])
        elif isinstance(node, ast.IfExp):
            stack.append((node.test, cond))
            stack.extend([(node.body, node.lineno), (node.orelse, node.lineno)])
        else:
            stack.extend((c, cond) for c in ast.iter_child_nodes(node))


def _refers(node: ast.AST, function: str) -> bool:
    return (isinstance(node, ast.Name) and node.id == function) or (isinstance(node, ast.Attribute) and node.attr == function)


def _handed(node: ast.AST, function: str) -> bool:
    """A function handed on by name (``Process(target=train)``), not any attribute of that name."""
    return isinstance(node, ast.Name) and node.id == function


def _flat_names(nodes: Iterable[ast.AST]) -> set[str]:
    out: set[str] = set()
    for n in nodes:
        if isinstance(n, (ast.Tuple, ast.List)):
            out |= _flat_names(n.elts)
        elif isinstance(n, ast.Starred):
            out |= _flat_names([n.value])
        else:
            name = dotted(n)
            if name:
                out.add(name)
    return out


def _verdict(tree: ast.Module, rel: str, b: _Builder) -> Optional[tuple[bool, str, Optional[str], bool]]:
    """(blocks?, reason or risk text, fix, explicit) of the facts ``rel`` holds about the optimizer ``b``
    builds. ``fix``: "optimizer" / "model" / "self" (the receiver of the builder method) where the blocker is grads freed by that object's
    zero_grad, which the fused branch can make zero in place (:func:`_zero_in_place`); ``explicit``: that
    zero_grad is given set_to_none=True or a flag (the code's choice; in place only with the option)."""
    models: set[str] = set()
    receivers: set[str] = set()  # objects whose builder method is called: `self` in that method
    optimizers: set[str] = set()
    where = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call) and _refers(node.value.func, b.function):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            optimizers |= _flat_names(targets)
        if not isinstance(node, ast.Call):
            continue
        args = [*node.args, *(k.value for k in node.keywords)]
        if _refers(node.func, b.function):
            where = where or node.lineno
            models |= _flat_names(args)
            if isinstance(node.func, ast.Attribute):
                recv = dotted(node.func.value)
                if recv:
                    models.add(recv)
                    receivers.add(recv)
        elif not b.cls and any(_handed(a, b.function) for a in args):  # handed on: Process(target=train, args=(...))
            where = where or node.lineno
            models |= _flat_names(args)
    if not where:
        return None
    optimizers -= models
    via = f"`{b.function}` is used at {rel}:{where}"
    risk: Optional[str] = None
    prepared: Optional[int] = None
    calls = sorted(((n, c) for n, c in _walk_with_branch(tree) if isinstance(n, ast.Call)), key=lambda nc: (nc[0].lineno, nc[0].col_offset))
    for node, cond in calls:
        func = node.func
        recv = dotted(func.value) if isinstance(func, ast.Attribute) else None
        attr = func.attr if isinstance(func, ast.Attribute) else (func.id if isinstance(func, ast.Name) else "")
        full = (dotted(func) or attr).lower()
        flag = next((k.value for k in node.keywords if k.arg == "set_to_none"), node.args[0] if node.args else None)
        if attr == "zero_grad" and recv in optimizers:
            frees = flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False)
            if frees:
                return True, (f"`{recv}.zero_grad(set_to_none=...)` at {rel}:{node.lineno} on the optimizer this builds ({via}): "
                              "torch_npu fused optimizers raise ValueError on set_to_none=True (grads must stay allocated); "
                              "pass set_to_none=False there"), "optimizer", True
            if prepared is not None and flag is None:
                return True, (f"the optimizer this builds ({via}) goes through accelerate's prepare ({rel}:{prepared}) and "
                              f"`{recv}.zero_grad()` is called ({rel}:{node.lineno}): AcceleratedOptimizer.zero_grad() passes "
                              "set_to_none=True and torch_npu fused optimizers raise ValueError on it; call "
                              "zero_grad(set_to_none=False)"), "optimizer", False
        elif attr == "zero_grad" and recv in models:
            if flag is None or not (isinstance(flag, ast.Constant) and flag.value is False):
                return True, (f"`{recv}.zero_grad({'' if flag is None else 'set_to_none=...'})` at {rel}:{node.lineno} on the "
                              f"model whose parameters the optimizer takes ({via}) sets their grads to None"
                              f"{' (torch >= 2.0 default)' if flag is None else ''}: the next backward allocates new ones outside "
                              "the fused optimizer's flat buffer and its update silently uses stale grads (torch_npu fused "
                              "optimizers read grads only from that buffer and raise ValueError on zero_grad(set_to_none=True)); "
                              "pass set_to_none=False there"), ("self" if b.cls and recv in receivers else "model"), flag is not None
        elif attr == "share_memory" and recv in models:
            return True, (f"`{recv}.share_memory()` at {rel}:{node.lineno}: the model's parameters are shared between "
                          f"processes (hogwild) and the optimizer is built per process ({via}); the fused optimizer re-points "
                          "every parameter's storage into its own flat buffer at the first step, so the processes would "
                          "stop sharing them"), None, False
        elif attr in ("prepare", "prepare_optimizer") and _flat_names(node.args) & optimizers:
            prepared = prepared or node.lineno
        elif any(s in full for s in _SHARDING_PARTS) and (_flat_names([*node.args, *(k.value for k in node.keywords)]) & (models | optimizers)):
            text = (f"parameters flattened/re-allocated by FSDP/DeepSpeed/ZeRO (`{dotted(func) or attr}` at {rel}:{node.lineno}, on what "
                    f"`{b.function}` gets or builds: {via}): the fused optimizer's combined buffers would go stale")
            if cond is None:
                return True, text, None, False
            risk = risk or (f"{text}; that wrapping is chosen at run time (the condition at {rel}:{cond}): run the fused "
                            "branch only where it is not taken (switch the fused optimizer off for those runs)")
    if risk is not None:
        return False, risk, None, False
    return None


# --- grads freed in another file, zeroed in place by the fused branch (issue 14 class 5) --------

def _zero_target(root: Path, h: Any, b: _Builder, fix: str, max_bytes: int) -> Optional[str]:
    """The name whose zero_grad the candidate's fused branch would bind to zero in place (as
    fused_optimizer does for calls in the candidate's own file, with the option): ``fix``
    "optimizer": the name the construction binds (a ``return`` gets one bound first); "model": the
    object whose ``parameters()`` the guard reads, when that is what the driving file hands over
    (``self`` of a method, or a parameter of the builder function). None: no such name."""
    f = h.finding
    if not isinstance(f.fused, str) or not f.fused:
        return None
    if fix == "self":
        target: Optional[str] = "self"  # the driving file frees the grads of the object whose method builds the optimizer
    elif fix == "model":
        guard = f.guard_tensor or ""
        if not (guard.startswith("next(") and guard.endswith(".parameters(), None)")):
            return None
        target = guard[len("next("):-len(".parameters(), None)")]
        fn = _builder_def(root, b, max_bytes)
        params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)} if fn is not None else set()
        if not (target.isidentifier() and ((b.cls and target == "self") or (not b.cls and target in params and target != "self"))):
            return None
    else:
        target = _bound_name(f.fused) or ("_npufuse_optimizer" if f.fused.startswith("return ") else None)
    return target


def _zero_in_place(o: Any, h: Any, fix: str, target: str, text: str) -> None:
    """Make the candidate's fused branch bind ``target``'s zero_grad (:func:`_zero_target`) to one
    that zeroes in place, with the risk stated (``--optimizer-zero-grad-in-place`` only)."""
    from npufuse.patterns.base import Risk
    from npufuse.patterns.fused_optimizer import ZERO_IN_PLACE_COMMENT, zero_in_place

    f = h.finding
    done = f.__dict__.setdefault("_npufuse_zeroed_in_place", set())
    if target in done:
        return
    if f.fused.startswith("return "):
        # `return Cls(...)`: bind it first, so zero_grad can be replaced before it is handed out
        f.fused = f"_npufuse_optimizer = {f.fused[len('return '):]}return _npufuse_optimizer\n"
    what = f"`{target}`" if fix != "optimizer" else "the optimizer"
    added = (f"# another file frees these grads with a zero_grad of {what}: zero them in place\n"
             f"{target}.zero_grad = {zero_in_place(target)}\n") if fix != "optimizer" else \
        f"{ZERO_IN_PLACE_COMMENT}\n{target}.zero_grad = {zero_in_place(target)}\n"
    tail = "return _npufuse_optimizer\n"
    f.fused = f.fused[: -len(tail)] + added + tail if f.fused.endswith(tail) else f.fused + added
    done.add(target)
    h.body = None  # the precomputed replacement predates this: render it again from the finding
    f.risks.append(Risk("other", f"{text.split(': ')[0]}: the fused branch zeroes those grads in place instead (torch_npu's "
                        "fused optimizers raise ValueError on set_to_none=True and read grads from their flat buffer); a "
                        "parameter that gets no grad in some step is then updated with a zero grad (weight decay and "
                        "momentum still apply) where torch.optim would skip it"))


def _bound_name(fused: str) -> Optional[str]:
    """The one dotted name the fused text's first statement assigns (``optimizer = ...``)."""
    try:
        first = ast.parse(fused).body[0]
    except (SyntaxError, ValueError, IndexError, RecursionError):
        return None
    if isinstance(first, ast.Assign) and len(first.targets) == 1:
        return dotted(first.targets[0])
    if isinstance(first, ast.AnnAssign) and first.value is not None:
        return dotted(first.target)
    return None


def _builder_def(root: Path, b: _Builder, max_bytes: int) -> Optional[ast.AST]:
    tree = _parse(_read(root, b.rel, max_bytes))
    for n in tree.body if tree is not None else ():
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == b.function and not b.cls:
            return n
    return None


# --- a repository class that re-allocates grads wraps the model or the optimizer ----------------
# picotron's `model = DataParallelBucket(model)` (its hook sets `p.grad = p.main_grad.to(...)` every
# step), InternEvo's `HybridZeroOptimizer(naive_optimizer)` (`flat_param.grad = ...`): the wrapper's
# code is in another file; repo_symbols finds it.

def _wrapped_by_reallocating_class(root: Path, files: list[str], outcomes: list[Any], near: list[dict[str, Any]], max_bytes: int) -> None:
    from npufuse.scan import repo_symbols

    symbols = repo_symbols.shared(root, files, max_bytes)
    for o in outcomes:
        for h in [h for h in o.hits if h.finding.pattern == _PATTERN]:
            f = h.finding
            tree, _why = symbols.tree(o.file)
            if tree is None:
                continue
            region = _region(tree, f.qualname)
            if region is None:
                continue
            handed = _handed_names(f)
            for call in [n for r in region for n in ast.walk(r) if isinstance(n, ast.Call)]:
                if not isinstance(call.func, (ast.Name, ast.Attribute)):
                    continue
                args = {dotted(a) for a in [*call.args, *(k.value for k in call.keywords)]}
                if not (args & handed):
                    continue
                sym = symbols.resolve_node(o.file, call.func)
                if sym.kind != "class" or not isinstance(sym.node, ast.ClassDef):
                    continue
                where = _reallocates(sym.node)
                if where is None:
                    continue
                what, line = where
                o.hits.remove(h)
                near.append({"pattern": f.pattern, "file": o.file, "qualname": f.qualname, "line": f.line, "end_line": f.end_line,
                             "reason": f"`{dotted(call.func)}` (class {sym.qualname}, {sym.file}:{sym.node.lineno}) takes "
                                       f"`{', '.join(sorted(args & handed))}` at line {call.lineno} and {what} ({sym.file}:{line}): "
                                       "the fused optimizer's combined buffers would go stale"})
                break


def _region(tree: ast.Module, qualname: str) -> Optional[list[ast.AST]]:
    """The statements of the candidate's function (or the module's own statements for <module>)."""
    if qualname == "<module>":
        return [st for st in tree.body if not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    body: list[ast.stmt] = tree.body
    node: Optional[ast.AST] = None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            return None
        body = node.body  # type: ignore[attr-defined]
    return [node] if node is not None else None


def _handed_names(f: Any) -> set[str]:
    """The model whose parameters the guard reads and the names the optimizer is bound to."""
    out: set[str] = set()
    guard = f.guard_tensor or ""
    if guard.startswith("next(") and ".parameters()" in guard:
        out.add(guard[len("next("):guard.index(".parameters()")])
    name = _bound_name(f.fused) if isinstance(f.fused, str) else None
    if name and not name.startswith("_npufuse"):
        out.add(name)
    return {n for n in out if n}


def _reallocates(cls: ast.ClassDef) -> Optional[tuple[str, int]]:
    """(what, line) where the class's own code assigns a tensor's ``.grad`` or ``.data`` (not
    ``self.data``): a new tensor, or None (freed), every time it runs."""
    for n in ast.walk(cls):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Attribute) and t.attr == "grad":
                    return ("sets grads to None" if isinstance(n.value, ast.Constant) and n.value.value is None
                            else "assigns new grads (`.grad = ...`)"), n.lineno
                if isinstance(t, ast.Attribute) and t.attr == "data" and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")):
                    return "re-points parameters (`.data = ...`)", n.lineno
    return None
