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

from npufuse.scan import _grad_none_s50c

import ast
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Iterator, Optional

from npufuse.patterns.base import Risk
from npufuse.patterns import _optim_s46
from npufuse.scan.dataflow import _statements_bfs, dotted, names_bound_from

_PATTERN = "fused_optimizer"
# words a driving file must contain for this pass to parse it
_WORDS = ("zero_grad", "share_memory", "fsdp", "FSDP", "FullyShard", "fully_shard", "DeepSpeed", "deepspeed", "Zero", "prepare",
          "create_graph", "gradient_as_bucket_view", "optim")
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
        _sharded_accelerate_launches(root, outcomes, near)
        _s33_lightning_callbacks_free(root, list(files), outcomes, near, max_bytes)
        _s33_bf16_from_every_caller(root, list(files), outcomes, near, max_bytes)
        from npufuse.scan import random_skip  # s37 (fix37): models that skip a submodule on random steps

        random_skip.apply(root, list(files), outcomes, near, max_bytes)
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
        # s35: the builder of a forwarder (below): the driving file's facts are read through it
        self.via: Optional["_Builder"] = None
        self.inherited = False  # s46: a base class's method forwarding the builder (_optim_s46)
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
    _s37_handed_to_wrapper(root, files, outcomes, near, max_bytes)
    _freed_through_other_files(root, files, outcomes, near, max_bytes)
    _s38_freed_at_site(root, files, outcomes, near, max_bytes, zero_in_place)
    hits = [(o, h) for o in outcomes for h in o.hits if h.finding.pattern == _PATTERN]
    if not hits:
        return
    from npufuse.scan import repo_symbols

    symbols = repo_symbols.shared(root, files, max_bytes)
    builders: dict[tuple[str, str], _Builder] = {}
    for o, h in hits:
        if (o.file, h.finding.qualname) not in builders:
            builders[(o.file, h.finding.qualname)] = _Builder(o.file, h.finding.qualname, _parse(_read(root, o.file, max_bytes)))
    # s35: a module-level function of the builder's own file that hands out what the builder returns
    # (tinyworlds' `create_optimizer` returning `_create_adamw(raw_model, args)`, SimMIM's
    # `build_optimizer` choosing between two builders) is how other files reach the optimizer
    chains: dict[tuple[str, str], list[_Builder]] = {}
    for key, b in builders.items():
        chains[key] = [b, *_forwarders(_parse(_read(root, b.rel, max_bytes)), b)]
        # s46: a base class of another file whose method calls this builder method on self (NATSpeech's
        # BaseTask.configure_optimizers calling build_optimizer): the trainer reaches the optimizer through it
        chains[key] += _optim_s46.inherited_forwarders(symbols, b)
    names = {c.function for chain in chains.values() for c in chain if c.function and c.module}
    if not names:
        return
    # s39: a function of another file that returns what a builder (or its forwarder) returns
    # (`setup()` of training/setup.py returning `build_optimizer(...)` of optim/factory.py): the trainer calling it is
    # a third file, where the grads may be freed
    trees: dict[str, Optional[ast.Module]] = {}  # parsed once: the forwarders' search and the driving files share it
    for _round in range(2):
        texts: dict[str, str] = {}
        mentions: dict[str, str] = {}  # the files naming a builder (where a forwarder of another file may be)
        defined: dict[str, set[str]] = {}  # builder name -> the files defining a function/method of that name
        for rel in files:
            text = _read(root, rel, max_bytes)
            if text is None or not any(n in text for n in names):
                continue
            mentions[rel] = text
            for n in names:
                if f"def {n}(" in text:
                    defined.setdefault(n, set()).add(rel)
            if any(w in text for w in _WORDS):
                texts[rel] = text
        if _round or not _s39_cross_file_forwarders(mentions, chains, trees):
            break
        # a forwarder was found: its callers are read with the builders' (one more read of the files, rare)
        names = {c.function for chain in chains.values() for c in chain if c.function and c.module}
    imports_read: dict[tuple[str, str], tuple[bool, set[str]]] = {}  # (file, module) -> _imports, read once
    for o, h in list(hits):
        for b in chains[(o.file, h.finding.qualname)]:
            if b.function and h in o.hits and _drive(root, o, h, b, texts, trees, defined, symbols, near, max_bytes, zero_in_place,
                                                     imports_read):
                break


def _s39_cross_file_forwarders(mentions: dict[str, str], chains: dict[tuple[str, str], list[_Builder]],
                               trees: dict[str, Optional[ast.Module]]) -> bool:
    """Add to each chain the module-level functions of other files (``mentions``: path -> text of the files naming a
    builder) that import a function builder of the chain and return what it returns (:func:`_forwarders` read in
    that file, one file further); True when one was added."""
    added = False
    found_for: dict[tuple[str, str], list[_Builder]] = {}  # (builder file, function) -> its forwarders elsewhere
    for chain in chains.values():
        for b in list(chain):
            if b.cls or not b.function or not b.module or b.via is not None and b.via.rel != b.rel:
                continue  # a method is reached through objects; a cross-file forwarder is not followed further
            key = (b.rel, b.function)
            if key not in found_for:
                found_for[key] = []
                # text first: the file imports the builder on one line and calls it (most mentions are neither)
                imports = _re.compile(rf"\b{_re.escape(b.module)}\b[^\n]*\bimport\b[^\n]*\b{_re.escape(b.function)}\b"
                                      rf"|\b{_re.escape(b.module)}\b[^\n]*\bimport\s*\(|^\s*import\b[^\n]*\b{_re.escape(b.module)}\b", _re.M)
                for rel, text in mentions.items():
                    if rel == b.rel or f"{b.function}(" not in text or not imports.search(text):
                        continue
                    if rel not in trees:
                        trees[rel] = _parse(text)
                    tree = trees[rel]
                    if tree is None:
                        continue
                    found, imported = _imports(tree, b.module)
                    if found and ("*" in imported or b.function in imported):
                        found_for[key] += _forwarders(tree, b, rel=rel)
            for fwd in found_for[key]:
                if not any(c.rel == fwd.rel and c.function == fwd.function for c in chain):
                    chain.append(fwd)
                    added = True
    return added


def _forwarders(tree: Optional[ast.Module], b: _Builder, depth: int = 2, rel: Optional[str] = None) -> list[_Builder]:
    """Module-level functions of ``b``'s file (``rel``: of that other file, s39) that return what the module-level
    builder ``b`` returns (``return build(model, args)``, or a name bound from that call and returned; any ``return``
    of the function, so a choice between builders counts), and those that return what these return (``depth``
    levels). Each is a builder another file calls to get the same optimizer."""
    if tree is None or b.cls or not b.function:
        return []
    out: list[_Builder] = []
    todo, seen = [(b, 0)], {b.function}
    while todo:
        inner, level = todo.pop(0)
        if level >= depth:
            continue
        for fn in tree.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name in seen:
                continue
            bound = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                     and isinstance(n.value.func, ast.Name) and n.value.func.id == inner.function
                     for t in n.targets if isinstance(t, ast.Name)}
            if any(isinstance(n, ast.Return) and n.value is not None and (
                    (isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name) and n.value.func.id == inner.function)
                    or (isinstance(n.value, ast.Name) and n.value.id in bound)) for n in ast.walk(fn)):
                fwd = _Builder(rel or b.rel, fn.name, tree)
                fwd.via = b
                seen.add(fn.name)
                out.append(fwd)
                todo.append((fwd, level + 1))
    return out


def _drive(root: Path, o: Any, h: Any, b: _Builder, texts: dict[str, str], trees: dict[str, Optional[ast.Module]],
           defined: dict[str, set[str]], symbols: Any, near: list[dict[str, Any]], max_bytes: int, zero_in_place: bool,
           imports_read: Optional[dict[tuple[str, str], tuple[bool, set[str]]]] = None) -> bool:
    """Judge the candidate ``h`` by the files that call its builder ``b`` (the builder itself or a
    forwarder of it); True when a file turned it into a near miss."""
    # a method defined nowhere else in the repo is reached through any object (minGPT's trainer
    # gets the model as an argument and calls `model.configure_optimizers(...)`, importing nothing)
    unique = bool(b.cls) and defined.get(b.function) == {b.rel}
    for rel in sorted(texts):
        unique = unique or _s28_nearest_definer(rel, b, defined.get(b.function, set()))
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
        imported = imports_read.get((rel, b.module)) if imports_read is not None else None
        if imported is None:
            imported = _imports(tree, b.module)
            if imports_read is not None:
                imports_read[(rel, b.module)] = imported
        # a function is reached by its imported name (or module.function); a method through an
        # object of its class, which the file must import (or the module holding it)
        found, names_ = imported
        reach = b.cls if b.cls else b.function
        if not unique and (not found or not ("*" in names_ or reach in names_)):
            continue
        if not b.cls and symbols is not None and _s38_resolves_elsewhere(symbols, rel, tree, b):
            continue  # the file calls a function of that name from another module of the same stem
        verdict = _verdict(tree, rel, b, symbols, _s38_returned_position(root, b, h, max_bytes))
        if verdict is None:
            continue
        blocked, text, fix, explicit = verdict
        f = h.finding
        # accelerate's prepare in the driving file: also guarded against sharded launches (below)
        prepared_here = fix == "accelerate"
        fix = "optimizer" if prepared_here else fix
        # an explicit set_to_none=True (or a flag) is the code's choice to free grads: zeroed in
        # place only on request; a free by default (`model.zero_grad()` on torch >= 2.0,
        # accelerate's prepared `zero_grad()`) is zeroed in place as fused_optimizer does in one file
        target = _zero_target(root, h, b, fix, max_bytes) if blocked and fix is not None else None
        if target is not None and (zero_in_place or not explicit):
            _zero_in_place(o, h, fix, target, text)
            if prepared_here:
                where_ = _re.search(r"accelerate's prepare \(([^)]*)\)", text)
                _guard_accelerate_launch(h, where_.group(1) if where_ else rel)
            continue  # the fused branch now zeroes those grads in place (a risk says so); other files may still block
        if target is not None:  # explicit, without the option
            from npufuse.patterns.fused_optimizer import ZERO_IN_PLACE_OPT_IN

            text += ZERO_IN_PLACE_OPT_IN
        if blocked:
            if h in o.hits:
                o.hits.remove(h)
            near.append({"pattern": f.pattern, "file": o.file, "qualname": f.qualname, "line": f.line,
                         "end_line": f.end_line, "reason": text})
            return True
        if "gradient_as_bucket_view" in text:
            _grad_none_s50c.guard_without_process_group(h)  # s50c: a conditional DDP bucket-view wrap: guarded
        # a detector risk (the candidate's own "other" risks would hide a generic one of that kind)
        f.risks.append(Risk("other", text))
    return False


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


def _verdict(tree: ast.Module, rel: str, b: _Builder, symbols: Any = None,
             position: Optional[int] = None) -> Optional[tuple[bool, str, Optional[str], bool]]:
    """(blocks?, reason or risk text, fix, explicit) of the facts ``rel`` holds about the optimizer ``b``
    builds (``position``: its index in the tuple the builder returns, when known). ``fix``: "optimizer" / "model" / "self" (the receiver of the builder method) where the blocker is grads freed by that object's
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
            models |= _flat_names(args) | _grad_none_s50c.parameter_owners(args)  # s50c: `model.parameters()` too
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
    # s35: a builder handing out a collection of optimizers (`return [optimizer]`, a list it appended
    # to): the names a loop or a comprehension binds from what it returned are the optimizers
    optimizers |= {t for n in ast.walk(tree) if isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension))
                   and dotted(n.iter) in optimizers for t in _flat_names([n.target])}
    optimizers -= models
    via = f"`{b.function}` is used at {rel}:{where}"
    if b.via is not None:
        via = f"`{b.function}` returns what `{b.via.function}` builds and is used at {rel}:{where}"
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
                              "zero_grad(set_to_none=False)"), "accelerate", False
        elif attr == "zero_grad" and recv in models:
            if flag is None or not (isinstance(flag, ast.Constant) and flag.value is False):
                return True, (f"`{recv}.zero_grad({'' if flag is None else 'set_to_none=...'})` at {rel}:{node.lineno} on the "
                              f"model whose parameters the optimizer takes ({via}) sets their grads to None"
                              f"{' (torch >= 2.0 default)' if flag is None else ''}: the next backward allocates new ones outside "
                              "the fused optimizer's flat buffer and its update silently uses stale grads (torch_npu fused "
                              "optimizers read grads only from that buffer and raise ValueError on zero_grad(set_to_none=True)); "
                              "pass set_to_none=False there"), ("self" if b.cls and recv in receivers else "model"), flag is not None
        elif attr == "backward" and _s33_literal_create_graph(node, full):
            # s33: the driving file's backward builds a graph of the grads (AdaHessian-style trainers)
            text = (f"`{dotted(func) or attr}(create_graph=True)` at {rel}:{node.lineno}, in the file that drives the optimizer "
                    f"this builds ({via}), runs the backward in grad mode, where autograd accumulates each grad out of "
                    "place (`p.grad = p.grad + g`: a new grad tensor every step after the first), so the fused optimizer "
                    "keeps updating from its combined grad buffer, which no longer receives the grads")
            if cond is None:
                return True, text, None, False
            risk = risk or f"{text}; that backward runs under a condition (line {cond}): switch the fused optimizer off for those runs"
        elif attr == "share_memory" and recv in models:
            return True, (f"`{recv}.share_memory()` at {rel}:{node.lineno}: the model's parameters are shared between "
                          f"processes (hogwild) and the optimizer is built per process ({via}); the fused optimizer re-points "
                          "every parameter's storage into its own flat buffer at the first step, so the processes would "
                          "stop sharing them"), None, False
        elif attr in ("prepare", "prepare_optimizer") and _flat_names(node.args) & optimizers:
            prepared = prepared or node.lineno
        elif _s37_bucket_view_wrap(node) and ((_flat_names(node.args) & models) or _s27_shards_holder(tree, node, recv, models)):
            # s37 (fix37): DDP(model, gradient_as_bucket_view=True): every grad a view into DDP's bucket
            text = (f"`{dotted(func) or attr}(..., gradient_as_bucket_view=...)` at {rel}:{node.lineno} wraps what `{b.function}` "
                    f"gets or builds ({via}): every grad becomes a view into DDP's flat all-reduce bucket, which the fused "
                    "optimizer sizes by storage (the whole bucket) when it combines the grads and re-points; its combined "
                    "grad buffer is not the parameters' grads (torch.optim takes view grads)")
            if cond is None:
                return True, text, None, False
            risk = risk or (f"{text}; that wrapping is chosen at run time (the condition at {rel}:{cond}): run the fused "
                            "branch only where it is not taken (switch the fused optimizer off for those runs)")
        elif any(s in full for s in _SHARDING_PARTS) and ((_flat_names([*node.args, *(k.value for k in node.keywords)]) & (models | optimizers))
                                                           or _s27_shards_holder(tree, node, recv, models)):
            text = (f"parameters flattened/re-allocated by FSDP/DeepSpeed/ZeRO (`{dotted(func) or attr}` at {rel}:{node.lineno}, on what "
                    f"`{b.function}` gets or builds: {via}): the fused optimizer's combined buffers would go stale")
            if cond is None:
                return True, text, None, False
            risk = risk or (f"{text}; that wrapping is chosen at run time (the condition at {rel}:{cond}): run the fused "
                            "branch only where it is not taken (switch the fused optimizer off for those runs)")
    held = _s28_holder_zero_grad(tree, rel, b, models, via)
    if held is not None:
        return held
    freed = _s30_handed_to_freeing(symbols, rel, tree, models) if symbols is not None and models else None
    if freed is not None:
        # s38: a bare `M.zero_grad()` there frees by default (torch >= 2.0), as in this file: zeroed in place by the
        # fused branch when the model is the builder's (fix "model"), else a near miss
        return True, (f"{freed[0]} of the model whose parameters the optimizer this builds takes ({via}): the next backward "
                      "allocates new grads outside the fused optimizer's flat buffer and its update silently uses stale "
                      "ones; torch.optim handles freed grads"), ("model" if freed[1] else None), False
    # s37: the file that gets the optimizer from the builder hands it on, through the repository's code, to DeepSpeed
    # the names followed: the one at the optimizer's position of a returned tuple (`optimizer, scheduler, scaler = ...`)
    # when the builder's returns say which, else every name the call's result is bound to
    followed = _s38_names_at(tree, b, position) or optimizers
    handed = _s37_handoff(symbols, rel, tree, list(ast.walk(tree)), followed, 0) if symbols is not None and followed else None
    if handed is not None:
        return True, f"the optimizer this builds ({via}) is handed on: {handed}{_S37_STALE}", None, False
    # s38: ... or to a loop of the repository that frees its grads with zero_grad(set_to_none=True)
    freed = _s38_freed_after_handoff(symbols, rel, tree, list(ast.walk(tree)), followed, 0) if symbols is not None and followed else None
    if freed is not None:
        return True, f"the optimizer this builds ({via}) is handed on ({freed}){_S38_FREES}", "optimizer", True
    if risk is not None:
        return False, risk, None, False
    return None


def _s37_bucket_view_wrap(node: ast.Call) -> bool:
    """Does the call pass ``gradient_as_bucket_view`` with a value that is not provably false?"""
    k = next((k for k in node.keywords if k.arg == "gradient_as_bucket_view"), None)
    return k is not None and not (isinstance(k.value, ast.Constant) and not k.value.value)


def _s30_handed_to_freeing(symbols: Any, rel: str, tree: ast.Module, models: set[str]) -> Optional[tuple[str, bool]]:
    """Where the file that calls an optimizer builder hands the model the builder got to a function
    (of any file of the repo) that frees or re-allocates its parameters' grads (SlowFast's training
    loop calls ``contrastive_parameter_surgery(model, ...)``, which sets ``p.grad = None`` for some of
    ``model.named_parameters()``): the text naming the call and the free, and whether the free is a bare
    ``M.zero_grad()`` (s38: torch >= 2.0 frees by default; the other frees are explicit). One call deep; methods
    (which work on their own object) are not followed."""
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call) or not isinstance(call.func, (ast.Name, ast.Attribute)):
            continue
        passed = [i for i, a in enumerate(call.args) if dotted(a) in models]
        named = [k.arg for k in call.keywords if k.arg and dotted(k.value) in models]
        if not passed and not named:
            continue
        sym = symbols.resolve_node(rel, call.func)
        fn = sym.node
        if sym.kind != "function" or "." in sym.qualname or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
        got = {params[i] for i in passed if i < len(params)} | {k for k in named if k in params or k in {a.arg for a in fn.args.kwonlyargs}}
        if not got:
            continue
        derived = _derived(fn, got)
        hit = _frees(fn, lambda _fn, recv: recv.split(".")[0] in derived)
        bare = hit is None
        hit = hit if hit is not None else _module_zero_grad(fn, derived)
        if hit is not None:
            what, line = hit
            return f"`{dotted(call.func)}` ({rel}:{call.lineno}) is handed the model and {what} ({sym.file}:{line})", bare
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
    if b.via is not None and fix != "optimizer":
        return None  # the model a forwarder is handed is not known to be the builder's parameter (not bound)
    if fix == "self":
        target: Optional[str] = "self"  # the driving file frees the grads of the object whose method builds the optimizer
    elif fix == "model":
        from npufuse.patterns.fused_optimizer import guard_model

        target = guard_model(f.guard_tensor or "")
        if target is None:
            return None
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


def _guard_accelerate_launch(h: Any, where: str) -> None:
    """The candidate's optimizer goes through accelerate's prepare in another file (``where``): its
    guard also keeps torch.optim for runs ``accelerate launch`` configures for DeepSpeed/FSDP/Megatron
    (as fused_optimizer does when the prepare is in the candidate's own file)."""
    from npufuse.patterns.fused_optimizer import ACCELERATE_LAUNCH_NOTE, accelerate_launch_guard

    f = h.finding
    if "accelerate_prepare" in f.params:
        return
    f.guard_tensor = accelerate_launch_guard(f.guard_tensor)
    f.params["accelerate_prepare"] = where
    f.params["guard"] = str(f.params.get("guard", "")) + "_accelerate_launch_checked"
    f.notes.append(ACCELERATE_LAUNCH_NOTE)  # (the precomputed body follows the `if` line: still valid)


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
                given = [*call.args, *(k.value for k in call.keywords)]
                args = {dotted(a) for a in given}
                # `Wrapper(torch.optim.AdamW(...))`: the optimizer built inline as the wrapper's argument
                inline = [a for a in given if isinstance(a, ast.Call) and f.line <= a.lineno and (a.end_lineno or a.lineno) <= f.end_line
                          and isinstance(a.func, (ast.Name, ast.Attribute)) and (dotted(a.func) or "").rsplit(".", 1)[-1][:1].isupper()]
                if not (args & handed) and not inline:
                    continue
                sym = symbols.resolve_node(o.file, call.func)
                if sym.kind != "class" or not isinstance(sym.node, ast.ClassDef):
                    continue
                where = _reallocates(sym.node)
                found = (where[0], sym.file, where[1]) if where is not None else _frees_through_bases(symbols, sym.file, sym.node)
                if found is None:
                    continue
                what, wfile, line = found
                takes = ", ".join(sorted(args & handed)) or " ".join(ast.unparse(inline[0].func).split())[:60] + "(...)"
                o.hits.remove(h)
                near.append({"pattern": f.pattern, "file": o.file, "qualname": f.qualname, "line": f.line, "end_line": f.end_line,
                             "reason": f"`{dotted(call.func)}` (class {sym.qualname}, {sym.file}:{sym.node.lineno}) takes "
                                       f"`{takes}` at line {call.lineno} and {what} ({wfile}:{line}): "
                                       "the fused optimizer's combined buffers would go stale"})
                break


# --- s37: the optimizer object handed, through the repository's code, to DeepSpeed / apex / ColossalAI ----------
# CoLLiE's example hands `torch.optim.Adam(...)` to the repository's `Trainer(optimizer=...)`, which hands it to
# `setup_ds_engine` (another file), which calls `deepspeed.initialize(optimizer=...)`; the site's file names no
# DeepSpeed. optimizer_handoff follows the object by dataflow (arguments, stored attributes, containers).
_S37_STALE = ("; the flat-buffer fused optimizer cannot follow re-created params or freed grads (its combined "
              "buffers would go stale); torch.optim can")


def _s37_handoff(symbols: Any, rel: str, fn: ast.AST, nodes: list[ast.AST], names: set[str], after: int,
                 cls: Optional[ast.ClassDef] = None) -> Optional[str]:
    from npufuse.scan.optimizer_handoff import handoff

    return handoff(symbols, rel, fn, nodes, names, after, cls)


def _s37_handed_to_wrapper(root: Path, files: list[str], outcomes: list[Any], near: list[dict[str, Any]], max_bytes: int) -> None:
    """Candidates whose optimizer the site's own code hands, through the repository's trainers and helpers, to a
    wrapper that re-creates its params or frees its grads: near misses naming every hop."""
    from npufuse.scan.optimizer_handoff import handoff_at

    for symbols, o, h, (name, fn, nodes, cls) in _s37_site_scopes(root, files, outcomes, max_bytes):
        f = h.finding
        got = handoff_at(symbols, o.file, fn, nodes, {name}, f.line, cls)
        if got is None:
            continue
        text, local = got
        test = _s37_site_test(fn, nodes, local, f.line, name) if local is not None else None
        if test is not None:
            # the wrapping is chosen by a test of the site's own code that the construction can evaluate
            # (transformer-xl's `if args.cuda and args.fp16: optimizer = FP16_Optimizer(optimizer, ...)`):
            # the fused class only for runs where that test keeps the wrapper away
            f.guard_tensor = f"({f.guard_tensor}) if {test} else None"
            f.params["guard"] = str(f.params.get("guard", "")) + "_unwrapped_runs_only"
            f.risks.append(Risk("other", f"the optimizer is handed on under a condition: {text}; the guard evaluates "
                                f"`{test}` when the optimizer is built and runs the fused class only then (the "
                                "wrapped runs keep torch.optim)"))
            h.body = None  # render again with the new guard
            continue
        o.hits.remove(h)
        near.append({"pattern": f.pattern, "file": o.file, "qualname": f.qualname, "line": f.line, "end_line": f.end_line,
                     "reason": f"the optimizer is handed on: {text}{_S37_STALE}"})


def _s37_site_scopes(root: Path, files: list[str], outcomes: list[Any], max_bytes: int
                     ) -> Iterable[tuple[Any, Any, Any, tuple[str, ast.AST, list[ast.AST], Optional[ast.ClassDef]]]]:
    """(symbols, outcome, hit, :func:`_s37_site_scope`) of every fused_optimizer hit whose site binds its optimizer
    to a name (a snapshot of the hits: a caller may remove the one it is given)."""
    from npufuse.scan import repo_symbols

    symbols = repo_symbols.shared(root, files, max_bytes)
    for o in outcomes:
        for h in [h for h in o.hits if h.finding.pattern == _PATTERN]:
            scope = _s37_site_scope(symbols, o.file, h.finding)
            if scope is not None:
                yield symbols, o, h, scope


def _s37_site_scope(symbols: Any, rel: str, f: Any) -> Optional[tuple[str, ast.AST, list[ast.AST], Optional[ast.ClassDef]]]:
    """(the name the construction binds, the site's function (the module for <module>), its own nodes, the class of a
    method) for following the optimizer from its site; None for a returned construction (the files calling its
    builder are read by _verdict) or a file that does not parse."""
    from npufuse.scan.optimizer_handoff import _own_nodes

    name = _bound_name(f.fused) if isinstance(f.fused, str) else None
    if not name or name.startswith("_npufuse"):
        return None
    tree, _why = symbols.tree(rel)
    if tree is None:
        return None
    if f.qualname == "<module>":
        return name, tree, [n for st in tree.body if not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                            for n in ast.walk(st)], None
    region = _region(tree, f.qualname)
    if not region:
        return None
    owner = _region(tree, f.qualname.rsplit(".", 1)[0]) if "." in f.qualname else None
    return name, region[0], list(_own_nodes(region[0])), (owner[0] if owner and isinstance(owner[0], ast.ClassDef) else None)


# --- s38: the optimizer handed, through the repository's code, to a loop that frees its grads ---------------------
# vats-multimodal-lm: `optimizer = AdamW(...)` returned by `setup_training_components` (one file), bound by the
# training script (another) and handed to `train(model, loader, optimizer, ...)` of a third, whose loop calls
# `optimizer.zero_grad(set_to_none=True)`: torch_npu's fused classes raise ValueError on it (spec §10).

_S38_FREES = (", which frees its grads: torch_npu fused optimizers raise ValueError on zero_grad(set_to_none=True) "
              "(grads must stay allocated in their flat buffer); pass set_to_none=False there")


def _s38_freed_after_handoff(symbols: Any, rel: str, fn: ast.AST, nodes: list[ast.AST], names: set[str], after: int,
                             cls: Optional[ast.ClassDef] = None) -> Optional[str]:
    from npufuse.scan.optimizer_handoff import freed_after_handoff

    return freed_after_handoff(symbols, rel, fn, nodes, names, after, cls)


def _s38_resolves_elsewhere(symbols: Any, rel: str, tree: ast.Module, b: _Builder) -> bool:
    """Does every call of the builder's name in ``rel`` that the repository's imports resolve name a function of
    another file (two ``setup_training_components.py`` in two packages: the module stem alone does not tell which
    one a file imports)? False when none resolves (the earlier text test stands)."""
    files = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _refers(node.func, b.function):
            sym = symbols.resolve_node(rel, node.func)
            if sym.kind == "function":
                files.add(sym.file)
    return bool(files) and b.rel not in files


def _s38_returned_position(root: Path, b: _Builder, h: Any, max_bytes: int) -> Optional[int]:
    """The index of the candidate's optimizer in the tuple its builder returns (``return optimizer, scheduler,
    scaler`` -> 0), when every ``return`` of the builder returns a tuple holding the name the construction binds at
    that same index; else None."""
    name = _bound_name(h.finding.fused) if isinstance(h.finding.fused, str) else None
    if not name or b.via is not None or not b.function:
        return None
    tree = _parse(_read(root, b.rel, max_bytes))
    region = _region(tree, f"{b.cls}.{b.function}" if b.cls else b.function) if tree is not None else None
    if not region:
        return None
    from npufuse.scan.optimizer_handoff import _own_nodes

    found: set[Optional[int]] = set()
    for n in _own_nodes(region[0]):
        if isinstance(n, ast.Return):
            elts = n.value.elts if isinstance(n.value, (ast.Tuple, ast.List)) else []
            found.add(next((i for i, e in enumerate(elts) if dotted(e) == name), None))
    return found.pop() if len(found) == 1 else None


def _s38_names_at(tree: ast.Module, b: _Builder, position: Optional[int]) -> set[str]:
    """The names ``rel`` binds, from a call of the builder, at the optimizer's position of the returned tuple."""
    out: set[str] = set()
    if position is None:
        return out
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _refers(node.value.func, b.function):
            for t in node.targets:
                if isinstance(t, (ast.Tuple, ast.List)) and position < len(t.elts) and not any(isinstance(e, ast.Starred) for e in t.elts):
                    name = dotted(t.elts[position])
                    if name:
                        out.add(name)
    return out


def _s38_freed_at_site(root: Path, files: list[str], outcomes: list[Any], near: list[dict[str, Any]], max_bytes: int,
                       zero_in_place: bool) -> None:
    """Candidates whose optimizer the site's own code hands on (a trainer's constructor, a loop function, a method
    of an object it built; any file) to code that calls ``zero_grad(set_to_none=<not False>)`` on it: near misses
    naming every hop, or, with ``--optimizer-zero-grad-in-place``, a fused branch whose zero_grad zeroes in place
    (the object is the same wherever it goes)."""
    for symbols, o, h, (name, fn, nodes, cls) in _s37_site_scopes(root, files, outcomes, max_bytes):
        f = h.finding
        text = _s38_freed_after_handoff(symbols, o.file, fn, nodes, {name}, f.line, cls)
        if text is None:
            continue
        text = f"the optimizer is handed on ({text}){_S38_FREES}"
        if zero_in_place:
            _zero_in_place(o, h, "optimizer", name, text)
            continue
        from npufuse.patterns.fused_optimizer import ZERO_IN_PLACE_OPT_IN

        o.hits.remove(h)
        near.append({"pattern": f.pattern, "file": o.file, "qualname": f.qualname, "line": f.line, "end_line": f.end_line,
                     "reason": text + ZERO_IN_PLACE_OPT_IN})


def _s37_site_test(fn: ast.AST, nodes: list[ast.AST], local: tuple[ast.If, bool], site_line: int, optimizer: str) -> Optional[str]:
    """The test under which the site's own code does *not* call the wrapper, as source the construction can
    evaluate with the same value (``not (A)`` for a wrapper in the body of ``if A:``, ``(A)`` for one in its
    else), else None: the test calls nothing, reads no name of the optimizer, and every name in it is bound
    before the site and not bound again in this scope between the site and the ``if``."""
    import builtins

    from npufuse.patterns.fused_optimizer import _side_effect_free

    holder, in_body = local
    test = holder.test
    if holder.lineno <= site_line or not _side_effect_free(test):
        return None
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    if optimizer.split(".")[0] in names:
        return None
    params: set[str] = set()
    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = fn.args
        params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    for name in names:
        binds = [n.lineno for n in nodes if _s37_binds(n, name)]
        if any(site_line <= ln < holder.lineno for ln in binds):
            return None  # bound again between the construction and the test
        if name not in params and not any(ln < site_line for ln in binds) and not hasattr(builtins, name):
            return None
    src = " ".join(ast.unparse(test).split())
    return f"not ({src})" if in_body else f"({src})"


def _s37_binds(node: ast.AST, name: str) -> bool:
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(isinstance(t, ast.Name) and t.id == name for tg in targets for t in ast.walk(tg))
    if isinstance(node, (ast.For, ast.AsyncFor, ast.With)):
        tgts = [node.target] if isinstance(node, (ast.For, ast.AsyncFor)) else [i.optional_vars for i in node.items if i.optional_vars]
        return any(isinstance(t, ast.Name) and t.id == name for tg in tgts for t in ast.walk(tg))
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) == name for a in node.names)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    return isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name) and node.target.id == name


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
    from npufuse.patterns.fused_optimizer import guard_model

    out: set[str] = set()
    model = guard_model(f.guard_tensor or "")
    if model:
        out.add(model)
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


# --- attention: classes and functions of other files of the repo (issue 14, class 3) ---
# Megatron-style attention gets its probabilities from a softmax MODULE built in ``__init__`` from a class
# of another file (FusedScaleMaskSoftmax: scale, mask function, softmax), with the mask function passed in
# by the constructor's caller, often from a third file. The attention detector asks here what such a class
# and such a function compute. The scan's root is attached to each parsed file (``attach_root``) so that a
# detector can read the repo; files are parsed on demand (size-limited, cached per scan root) and only when
# a detector asks, which happens for the rare sites that reach a class or function not defined in their file.
# Nothing here raises: what cannot be read or recognised is None, and the detector says so.
import os
import re as _re
from dataclasses import dataclass as _dataclass

_ROOT_KEY = "_npufuse_repo_root"
_DEF_MAX_BYTES = 1 << 20
_PARSED: dict[tuple[str, str], Optional[ast.Module]] = {}
_PY_FILES: dict[str, list[str]] = {}
_SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", ".venv", "venv", "node_modules", "site-packages", ".tox", "build", "dist"}


_DEPENDENT: set[tuple[str, str]] = set()  # (root, file) whose analysis read other files of the repo (this process)


def reads_other_files(root: Path, rel: str) -> bool:
    """Did analysing ``rel`` read other files of the repo (a class, a mask function, callers)? Such a file's
    outcome depends on them, so the per-file cache (keyed by the file's own content) must not keep it."""
    return (str(root), rel) in _DEPENDENT


def _depends(root: Optional[Path], rel: str) -> None:
    if root is not None:
        if len(_DEPENDENT) > 100000:
            _DEPENDENT.clear()
        _DEPENDENT.add((str(root), rel))


def reset() -> None:
    """Forget the files parsed and listed for earlier scans (a scan reads the repo as it is now)."""
    _PARSED.clear()
    _PARSED_TEXT.clear()
    _PY_FILES.clear()
    _RESOLVED_ROOTS.clear()
    _DEPENDENT.clear()
    _LAUNCH_CONFIGS.clear()
    _PURE_LIST_METHODS.clear()
    _s28_reset_quoted()


def attach_root(module: Any, root: Path) -> None:
    """Record the scan root on a parsed file (``ModuleInfo``) so detectors can resolve other files."""
    try:
        module.__dict__[_ROOT_KEY] = Path(root)
    except Exception:
        pass


def definition_module(root: Path, d: Any) -> Any:
    """The ModuleInfo of the other repository file holding definition ``d`` (``definition``'s answer), its scan root
    attached; None where the file cannot be read or indexed (the callers then refuse)."""
    from npufuse.scan.dataflow import ModuleInfo

    text = _repo_text(root, d.rel)
    if text is None:
        return None
    try:
        other = ModuleInfo.from_source(d.rel, text, d.tree)
    except Exception:
        return None
    attach_root(other, root)
    return other


def repo_root(module: Any) -> Optional[Path]:
    return getattr(module, "__dict__", {}).get(_ROOT_KEY)


@_dataclass(frozen=True)
class Definition:
    """A class or function definition: the repo-relative file that holds it, the node, the file's tree."""

    rel: str
    node: ast.AST
    tree: ast.Module


def _repo_text(root: Path, rel: str) -> Optional[str]:
    """The text of a file of the repo, or None: absent, larger than the limit, or a link that leads
    out of the repo (an untrusted repo's ``x.py -> /etc/...`` is never read)."""
    try:
        path = (root / rel).resolve()
        if path.is_relative_to(_resolved_root(root)) and path.is_file() and path.stat().st_size <= _DEF_MAX_BYTES:
            return path.read_text(encoding="utf-8", errors="replace")
    except (OSError, ValueError, RuntimeError):
        pass
    return None


_RESOLVED_ROOTS: dict[Path, Path] = {}


def _resolved_root(root: Path) -> Path:
    """``root.resolve()``, once per root and scan: ``_repo_text`` asked it for every file it read
    (each a ``realpath`` of every component of the root's path)."""
    got = _RESOLVED_ROOTS.get(root)
    if got is None:
        if len(_RESOLVED_ROOTS) > 64:
            _RESOLVED_ROOTS.clear()
        got = _RESOLVED_ROOTS[root] = root.resolve()
    return got


def _parse_repo_file(root: Path, rel: str) -> Optional[ast.Module]:
    key = (str(root), rel)
    if key in _PARSED:
        return _PARSED[key]
    tree = None
    try:
        text = _repo_text(root, rel)
        tree = ast.parse(text) if text is not None else None
    except (Exception, RecursionError):
        tree = None
    if len(_PARSED) > 512:
        _PARSED.clear()
        _PARSED_TEXT.clear()
    _PARSED[key] = tree
    if tree is not None:
        _PARSED_TEXT[id(tree)] = (tree, text)  # (the tree is held with its text: its id is not reused meanwhile)
    return tree


# id of a tree _parse_repo_file made -> (the tree, the text it was parsed from): what a question
# about the tree may first ask of the text (registering_calls' lines)
_PARSED_TEXT: dict[int, tuple[ast.Module, str]] = {}


def _imported(tree: ast.Module, rel: str, name: str) -> Optional[tuple[str, str]]:
    """(module, attribute) a top-level import of ``tree`` binds ``name`` to (relative imports resolved
    against ``rel``; ``import a.b as c`` with ``name`` ``c.X``; ``from a import b`` with ``name`` ``b.X``:
    X of the submodule ``a.b``). Imports are statements: the statements of ``ast.walk``, in its
    order, find the same first import (a whole-tree walk, ~4 ms, where the name is not imported)."""
    head, _, rest = name.partition(".")
    for node in _statements_bfs(tree):
        if isinstance(node, ast.ImportFrom) and (not rest or "." not in rest):
            for a in node.names:
                if (a.asname or a.name) == (head if rest else name):
                    if node.level == 0:
                        parts = (node.module or "").split(".") if node.module else []
                    else:
                        base = PurePosixPath(rel).parent
                        for _ in range(node.level - 1):
                            base = base.parent
                        parts = [p for p in base.parts if p not in ("", ".")] + ((node.module or "").split(".") if node.module else [])
                    if rest:
                        # ``from pkg import layers`` then ``layers.X``: X of the submodule pkg.layers
                        return (".".join([*parts, a.name]), rest)
                    return (".".join(parts), a.name)
        elif isinstance(node, ast.Import) and rest and "." not in rest:
            for a in node.names:
                if a.asname == head or (a.asname is None and a.name == head):
                    return (a.name, rest)
    return None


def _top_def(tree: ast.Module, name: str) -> Optional[ast.AST]:
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def _find(root: Path, from_rel: str, mod: str, attr: str, depth: int) -> Optional[Definition]:
    if depth > 3 or not mod or any(p in ("", "..") for p in mod.split(".")):
        return None
    parts = mod.split(".")
    bases = [PurePosixPath(".")] + list(PurePosixPath(from_rel).parents)
    for base in dict.fromkeys(bases):
        for cand in (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py")):
            rel = str(cand)
            tree = _parse_repo_file(root, rel)
            if tree is None:
                continue
            node = _top_def(tree, attr)
            if node is not None:
                return Definition(rel, node, tree)
            again = _imported(tree, rel, attr)  # re-exported by the package
            if again is not None:
                return _find(root, rel, again[0], again[1], depth + 1)
            return None
    return None


def definition_in(root: Optional[Path], rel: str, tree: ast.Module, name: str) -> Optional[Definition]:
    """What ``name`` (as used in file ``rel``) denotes: a top-level class/function of that file or one
    imported from a file of the repo; None when it is not found or not readable."""
    if "." not in name:
        node = _top_def(tree, name)
        if node is not None:
            return Definition(rel, node, tree)
    if root is None:
        return None
    target = _imported(tree, rel, name)
    if target is None:
        return None
    try:
        return _find(root, rel, target[0], target[1], 0)
    except (Exception, RecursionError):
        return None


def definition(module: Any, name: str) -> Optional[Definition]:
    """``definition_in`` for a parsed file (``ModuleInfo``) of the scan."""
    root = repo_root(module)
    if "." in name or _top_def(module.tree, name) is None:
        _depends(root, module.path)  # found or not, the answer depends on other files
    return definition_in(root, module.path, module.tree, name)


def _is_minus_large(node: ast.AST | None) -> Optional[str]:
    """Source of a masking fill value (a constant <= -1e4, -inf, ``-finfo.max`` / ``finfo.min``), else None."""
    if node is None:
        return None
    text = ast.unparse(node).replace(" ", "")
    if _re.fullmatch(r"(-float\(['\"]inf['\"]\)|float\(['\"]-inf['\"]\)|-(math|torch|np|numpy)\.inf)", text):
        return ast.unparse(node)
    if ".finfo(" in text and (text.endswith(".min") or (text.startswith("-") and text.endswith(".max"))):
        return ast.unparse(node)
    try:
        v = ast.literal_eval(node)
    except Exception:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= -1e4:
        return ast.unparse(node)
    return None


def mask_fill_info(fn: ast.AST) -> Optional[tuple[str, bool]]:
    """(fill value, slices the mask) for a mask function: :func:`mask_fill`'s forms, or statements that on every
    path fill ``scores`` once at the mask or at the mask sliced on its last two axes by the scores' own sizes
    (Megatron-DeepSpeed's curriculum branch ``m = m[:, :, :n, :n]`` with ``n = scores.size()[2]``), with the same
    value, branching on anything but the scores' values; else None."""
    fill = mask_fill(fn)
    if fill is not None:
        return fill, False
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(fn.args.args) != 2 or fn.args.vararg or fn.args.kwarg:
        return None
    s, m = (a.arg for a in fn.args.args)
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    if not body or not (isinstance(body[-1], ast.Return) and isinstance(body[-1].value, ast.Name) and body[-1].value.id == s):
        return None

    def reads_scores_values(node: ast.AST) -> bool:
        sizes = {id(n.value) for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr in ("size", "shape", "dtype", "device")}
        return any(isinstance(n, ast.Name) and n.id == s and id(n) not in sizes for n in ast.walk(node))

    def sized_by_scores(node: ast.AST, env: dict[str, str]) -> bool:
        return isinstance(node, ast.Name) and env.get(node.id) == "size" or not reads_scores_values(node) and any(
            isinstance(n, ast.Attribute) and n.attr in ("size", "shape") and isinstance(n.value, ast.Name) and n.value.id == s for n in ast.walk(node))

    fills: set[str] = set()

    def run(stmts: list[ast.stmt], env: dict[str, str], filled: bool) -> Optional[tuple[dict[str, str], bool, bool]]:
        sliced = False
        for st in stmts:
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                name, v = st.targets[0].id, st.value
                if name in (s, m):
                    return None
                while isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "contiguous" and not v.args:
                    v = v.func.value
                if isinstance(v, ast.Name) and env.get(v.id, "") in ("mask", "mask_sliced"):
                    env[name] = env[v.id]
                elif isinstance(v, ast.Subscript) and isinstance(v.value, ast.Name) and env.get(v.value.id, "") in ("mask", "mask_sliced") \
                        and isinstance(v.slice, ast.Tuple) and all(isinstance(e, ast.Slice) and e.lower is None and e.step is None for e in v.slice.elts) \
                        and all(e.upper is None for e in v.slice.elts[:-2]) and all(e.upper is not None and sized_by_scores(e.upper, env) for e in v.slice.elts[-2:]):
                    env[name], sliced = "mask_sliced", True
                elif sized_by_scores(v, env):
                    env[name] = "size"
                elif not reads_scores_values(v) and not any(isinstance(n, ast.Name) and env.get(n.id, "").startswith("mask") for n in ast.walk(v)):
                    env[name] = "other"  # a configuration read (``args = get_args()``)
                else:
                    return None
            elif isinstance(st, ast.If):
                if reads_scores_values(st.test):
                    return None
                a = run(st.body, dict(env), filled)
                b = run(st.orelse, dict(env), filled)
                if a is None or b is None:
                    return None
                env = {k: ("mask_sliced" if "mask_sliced" in (a[0].get(k), b[0].get(k)) else a[0].get(k, b[0].get(k, "")))
                       for k in set(a[0]) | set(b[0])}
                if a[1] != b[1]:
                    return None  # filled on one path only
                filled, sliced = a[1], sliced or a[2] or b[2]
            elif isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Attribute) \
                    and st.value.func.attr == "masked_fill_" and isinstance(st.value.func.value, ast.Name) and st.value.func.value.id == s \
                    and len(st.value.args) == 2 and isinstance(st.value.args[0], ast.Name) and env.get(st.value.args[0].id, "") in ("mask", "mask_sliced") \
                    and not filled:
                value = _is_minus_large(st.value.args[1])
                if value is None:
                    return None
                fills.add(value)
                sliced = sliced or env[st.value.args[0].id] == "mask_sliced"
                filled = True
            elif isinstance(st, ast.Pass):
                continue
            else:
                return None
        return env, filled, sliced

    out = run(body[:-1], {m: "mask"}, False)
    if out is None or not out[1] or len(fills) != 1:
        return None
    return next(iter(fills)), out[2]


def mask_fill(fn: ast.AST) -> Optional[str]:
    """The fill value when ``fn`` (a two-parameter def or lambda ``(scores, mask)``) returns ``scores``
    with the True positions of ``mask`` filled by a large negative value (``masked_fill_`` then
    ``return scores``, ``return scores.masked_fill(mask, v)``); else None."""
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return None
    params = [a.arg for a in fn.args.args]
    if len(params) != 2 or fn.args.vararg or fn.args.kwarg:
        return None
    s, m = params

    def fill_of(call: ast.AST, method: str, base: str) -> Optional[str]:
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == method \
                and isinstance(call.func.value, ast.Name) and call.func.value.id == base and len(call.args) == 2 \
                and isinstance(call.args[0], ast.Name) and call.args[0].id == m and not call.keywords:
            return _is_minus_large(call.args[1])
        return None

    if isinstance(fn, ast.Lambda):
        return fill_of(fn.body, "masked_fill", s)
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    # ``v = torch.finfo(scores.dtype).min; v = torch.tensor(v, dtype=..., device=...)`` before the fill: the fill
    # value through local names (a tensor of it holds the same value)
    local: dict[str, ast.AST] = {}
    while len(body) > 2 and isinstance(body[0], ast.Assign) and len(body[0].targets) == 1 and isinstance(body[0].targets[0], ast.Name) \
            and body[0].targets[0].id not in (s, m):
        value = body[0].value
        if isinstance(value, ast.Call) and (dotted(value.func) or "").endswith("tensor") and len(value.args) == 1:
            value = value.args[0]
        if isinstance(value, ast.Name) and value.id in local:
            value = local[value.id]
        if _is_minus_large(value) is None:
            return None
        local[body[0].targets[0].id] = value
        body = body[1:]

    def fill_of(call: ast.AST, method: str, base: str, _inner: Any = fill_of) -> Optional[str]:  # type: ignore[no-redef]
        if isinstance(call, ast.Call) and len(call.args) == 2 and isinstance(call.args[1], ast.Name) and call.args[1].id in local:
            call = ast.Call(func=call.func, args=[call.args[0], local[call.args[1].id]], keywords=call.keywords)
        return _inner(call, method, base)
    if len(body) == 1 and isinstance(body[0], ast.Return):
        return fill_of(body[0].value, "masked_fill", s) if body[0].value is not None else None
    if len(body) == 2 and isinstance(body[1], ast.Return) and isinstance(body[1].value, ast.Name) and body[1].value.id == s:
        first = body[0]
        if isinstance(first, ast.Expr):
            return fill_of(first.value, "masked_fill_", s)
        if isinstance(first, ast.Assign) and len(first.targets) == 1 and isinstance(first.targets[0], ast.Name) and first.targets[0].id == s:
            return fill_of(first.value, "masked_fill", s)
    return None


@_dataclass(frozen=True)
class SoftmaxModule:
    """What a softmax module class computes on its torch path: ``softmax(mask_func(x * self.<scale>, mask))``
    (``scale`` applied when not None, the mask function applied when the mask is not None)."""

    rel: str
    name: str
    scale_attr: Optional[str]
    mask_attr: str
    mask_param: str  # the __init__ parameter stored as the mask function
    init_params: tuple[str, ...]  # __init__'s parameters after self, in order
    makes_mask_when_none: bool  # the torch path builds a (causal) mask itself when none is given
    other_paths: tuple[str, ...]  # methods of forward's other branches (CUDA kernels)


def _self_attr(node: ast.AST | None) -> Optional[str]:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


_CAST_ATTRS = {"float", "half", "bfloat16", "to", "type", "type_as", "contiguous"}


def _is_cast_of(value: ast.AST, name: str) -> bool:
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _CAST_ATTRS \
        and isinstance(value.func.value, ast.Name) and value.func.value.id == name


def _softmax_last(call: ast.AST) -> Optional[ast.AST]:
    """The input of a softmax over the last dim (``nn.Softmax(dim=-1)(y)``, ``F.softmax(y, dim=-1)``,
    ``torch.softmax(y, -1)``, ``y.softmax(-1)``), else None."""
    if not isinstance(call, ast.Call) or len(call.args) < 1:
        return None

    def last(n: Optional[ast.AST]) -> bool:
        try:
            return n is not None and ast.literal_eval(n) == -1
        except Exception:
            return False

    def kw(c: ast.Call, name: str, pos: int) -> Optional[ast.AST]:
        for k in c.keywords:
            if k.arg == name:
                return k.value
        return c.args[pos] if len(c.args) > pos else None

    f = call.func
    if isinstance(f, ast.Call) and (dotted(f.func) or "").rpartition(".")[2] == "Softmax" and last(kw(f, "dim", 0)) and len(call.args) == 1:
        return call.args[0]
    if isinstance(f, ast.Attribute) and f.attr == "softmax":
        if dotted(f.value) in ("torch", "F", "functional", "nn.functional", "torch.nn.functional", "torch.special"):
            return call.args[0] if last(kw(call, "dim", 1)) else None
        method = ast.Call(func=f, args=[f.value, *call.args], keywords=call.keywords)  # ``y.softmax(-1)``: dim is argument 0
        return f.value if last(kw(method, "dim", 1)) else None
    return None


def _torch_path(fn: ast.FunctionDef) -> Optional[tuple[Optional[str], str, bool]]:
    """(scale attr, mask-function attr, builds a mask when none) when ``fn(self, x, mask)`` is the plain
    scale -> mask function -> softmax path (casts, asserts, size reads allowed), else None."""
    params = [a.arg for a in fn.args.args]
    if len(params) != 3 or params[0] != "self":
        return None
    x, mask = params[1], params[2]
    cur, scale, mfunc, makes, probs = x, None, None, False, None
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))]
    for st in body:
        if isinstance(st, (ast.Assert, ast.Pass)):
            continue
        checked = [b for b in st.body if not isinstance(b, ast.Assert)] if isinstance(st, ast.If) else []
        if probs is None and isinstance(st, ast.If) and not st.orelse and len(checked) == 1 and isinstance(checked[0], ast.Assign):
            a = checked[0]
            tgt = a.targets[0] if len(a.targets) == 1 and isinstance(a.targets[0], ast.Name) else None
            if tgt is not None and tgt.id == cur and _is_cast_of(a.value, cur):
                continue
            if tgt is not None and tgt.id == cur and isinstance(a.value, ast.BinOp) and isinstance(a.value.op, ast.Mult) \
                    and isinstance(a.value.left, ast.Name) and a.value.left.id == cur and _self_attr(a.value.right) and scale is None:
                scale = _self_attr(a.value.right)
                continue
            if tgt is not None and tgt.id == mask and mfunc is None and any(
                    isinstance(n, ast.Compare) and isinstance(n.left, ast.Name) and n.left.id == mask and isinstance(n.ops[0], ast.Is)
                    for n in ast.walk(st.test)):
                makes = True
                continue
            return None
        if probs is not None and isinstance(st, ast.If):
            inner = st.body + st.orelse
            ok = all(isinstance(b, ast.Assign) and len(b.targets) == 1 and isinstance(b.targets[0], ast.Name) and b.targets[0].id == probs
                     and _is_cast_of(b.value, probs) or isinstance(b, ast.If) and all(
                         isinstance(c, ast.Assign) and len(c.targets) == 1 and isinstance(c.targets[0], ast.Name)
                         and c.targets[0].id == probs and _is_cast_of(c.value, probs) for c in b.body + b.orelse) for b in inner)
            if ok:
                continue
            return None
        if isinstance(st, ast.Assign) and len(st.targets) == 1:
            tgt = st.targets[0]
            if probs is None and isinstance(tgt, ast.Tuple) and all(isinstance(e, ast.Name) and e.id not in (cur, mask) for e in tgt.elts) \
                    and all(isinstance(n, (ast.Name, ast.Attribute, ast.Call, ast.Tuple, ast.Constant, ast.Load)) for n in ast.walk(st.value)) \
                    and all(isinstance(c.func, ast.Attribute) and c.func.attr in ("size", "dim") for c in ast.walk(st.value) if isinstance(c, ast.Call)):
                continue  # ``sq, sk = x.size(2), x.size(3)``
            if not isinstance(tgt, ast.Name):
                return None
            v = st.value
            if probs is None and tgt.id == cur and _is_cast_of(v, cur):
                continue
            if probs is None and mfunc is None and isinstance(v, ast.IfExp) and isinstance(v.orelse, ast.Name) and v.orelse.id == cur \
                    and isinstance(v.body, ast.Call) and _self_attr(v.body.func) and [getattr(a, "id", None) for a in v.body.args] == [cur, mask] \
                    and isinstance(v.test, ast.Compare) and isinstance(v.test.left, ast.Name) and v.test.left.id == mask \
                    and isinstance(v.test.ops[0], ast.IsNot):
                mfunc, cur = _self_attr(v.body.func), tgt.id
                continue
            if probs is None and mfunc is not None:
                src = _softmax_last(v)
                if isinstance(src, ast.Name) and src.id == cur:
                    probs = tgt.id
                    continue
            if probs is not None and tgt.id == probs and _is_cast_of(v, probs):
                continue
            return None
        if isinstance(st, ast.Return) and probs is not None and isinstance(st.value, ast.Name) and st.value.id == probs:
            return (scale, mfunc, makes)
        return None
    return None


def softmax_module(d: Definition) -> Optional[SoftmaxModule]:
    """What a softmax module class computes, when its ``forward(self, x, mask)`` reaches (directly or
    through one method call per branch) the plain torch path of :func:`_torch_path`, and its ``__init__``
    stores the mask function from one of its parameters; else None."""
    cls = d.node
    if not isinstance(cls, ast.ClassDef):
        return None
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    init, fwd = methods.get("__init__"), methods.get("forward")
    if init is None or fwd is None:
        return None
    found = _torch_path(fwd)
    other: list[str] = []
    if found is None:
        called = [a for n in ast.walk(fwd) if isinstance(n, ast.Call) and (a := _self_attr(n.func)) in methods]
        paths = [(m, _torch_path(methods[m])) for m in dict.fromkeys(called)]
        torch_paths = [(m, p) for m, p in paths if p is not None]
        if len(torch_paths) != 1:
            return None
        found = torch_paths[0][1]
        other = [m for m, p in paths if p is None and m != torch_paths[0][0] and not m.startswith(("is_", "get_"))]
    scale, mattr, makes = found
    params = tuple(a.arg for a in init.args.args[1:])
    stored = {}
    for n in ast.walk(init):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and _self_attr(n.targets[0]) and isinstance(n.value, ast.Name) and n.value.id in params:
            stored.setdefault(_self_attr(n.targets[0]), n.value.id)
    if mattr not in stored:
        return None
    return SoftmaxModule(d.rel, cls.name, scale, mattr, stored[mattr], params, makes, tuple(other))


def _repo_py_files(root: Path) -> list[str]:
    key = str(root)
    if key not in _PY_FILES:
        out: list[str] = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
            for f in sorted(filenames):
                if f.endswith(".py"):
                    out.append(str(PurePosixPath(Path(dirpath).relative_to(root).as_posix()) / f))
            if len(out) > 20000:
                break
        if len(_PY_FILES) > 8:
            _PY_FILES.clear()
        _PY_FILES[key] = out
    return _PY_FILES[key]


def _enclosing(tree: ast.Module, target: ast.AST) -> tuple[Optional[ast.ClassDef], Optional[ast.FunctionDef]]:
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and any(n is target for n in ast.walk(fn)):
                return cls, fn
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and any(n is target for n in ast.walk(fn)):
            return None, fn
    return None, None


def _arg_for(call: ast.Call, params: tuple[str, ...], param: str) -> Optional[ast.AST]:
    for k in call.keywords:
        if k.arg == param:
            return k.value
    i = params.index(param) if param in params else -1
    if 0 <= i < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[: i + 1]):
        return call.args[i]
    return None


def resolve_function(root: Optional[Path], rel: str, tree: ast.Module, expr: ast.AST, scope: Optional[tuple[ast.ClassDef | None, ast.FunctionDef | None]],
                     depth: int = 0) -> tuple[Optional[str], str, bool]:
    """(fill value, where, slices the mask to the scores' size) when ``expr`` (as written in file ``rel``, inside ``scope``: (class, function))
    is a mask function of :func:`mask_fill`'s form — a lambda, a function of this or another file of the
    repo, or a parameter of ``__init__`` (stored as ``self.<attr>`` or not) that every constructor call in
    the repo fills with such a function (followed through up to four constructors) — else (None, why)."""
    if depth == 0:
        _depends(root, rel)
    if depth > 4:
        return None, "passed through more constructors than npufuse follows", False
    cls, fn = scope if scope is not None else (None, None)
    if isinstance(expr, ast.Lambda):
        fill = mask_fill(expr)
        return (fill, f"the lambda at {rel}:{expr.lineno}", False) if fill else (None, f"the lambda at {rel}:{expr.lineno} is not a plain mask fill", False)
    param = None
    attr = _self_attr(expr)
    if attr is not None and cls is not None:
        init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is not None:
            for n in ast.walk(init):
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and _self_attr(n.targets[0]) == attr and isinstance(n.value, ast.Name):
                    param, fn = n.value.id, init
                    break
        if param is None:
            return None, f"`self.{attr}` is not set from a parameter of `{cls.name}.__init__`", False
    elif isinstance(expr, ast.Name):
        if fn is not None and expr.id in [a.arg for a in fn.args.args + fn.args.kwonlyargs]:
            param = expr.id
        else:
            d = definition_in(root, rel, tree, expr.id)
            if d is None:
                return None, f"`{expr.id}` is not defined in {rel} nor in a file of the repo it imports", False
            info = mask_fill_info(d.node)
            return (info[0], f"`{expr.id}` ({d.rel}:{getattr(d.node, 'lineno', 0)})", info[1]) if info else \
                (None, f"`{expr.id}` ({d.rel}:{getattr(d.node, 'lineno', 0)}) is not a plain masked_fill of the scores", False)
    else:
        return None, f"`{ast.unparse(expr)}` is not a function npufuse can read", False
    # a parameter: what the callers pass
    if fn is None or fn.name != "__init__" or cls is None:
        return None, f"`{param}` is a parameter of `{fn.name if fn else '?'}`: what the callers pass is not followed", False
    params = tuple(a.arg for a in fn.args.args[1:])
    if root is None:
        return None, f"`{param}` is passed into `{cls.name}.__init__` by its callers, in files npufuse was not given", False
    fills: list[tuple[str, str, bool]] = []
    texts: dict[str, str] = {}
    for other in _repo_py_files(root):
        text = _repo_text(root, other)
        if text is not None and cls.name in text:
            texts[other] = text
    # subclasses that keep the constructor (``class LayerPipe(Layer)`` without an ``__init__``) are built with it too
    names = {cls.name}
    for other in texts:
        t = _parse_repo_file(root, other)
        for n in ast.walk(t) if t is not None else ():
            if isinstance(n, ast.ClassDef) and any((dotted(b) or "").rpartition(".")[2] == cls.name for b in n.bases) \
                    and not any(isinstance(f, ast.FunctionDef) and f.name == "__init__" for f in n.body):
                names.add(n.name)
    for other in texts:
        t = _parse_repo_file(root, other)
        if t is None:
            continue
        for call in ast.walk(t):
            if not isinstance(call, ast.Call):
                continue
            if (dotted(call.func) or "").rpartition(".")[2] in names:
                arg = _arg_for(call, params, param)
            elif call.args and (dotted(call.args[0]) or "").rpartition(".")[2] in names:
                # a factory given the class and its constructor's keywords (DeepSpeed ``LayerSpec(Cls, **kw)``)
                arg = next((k.value for k in call.keywords if k.arg == param), None)
            else:
                continue
            if arg is None:
                continue  # the default: the code raises or skips without a mask function
            fill, where, sliced = resolve_function(root, other, t, arg, _enclosing(t, call), depth + 1)
            if fill is None:
                return None, f"`{cls.name}(...)` at {other}:{call.lineno} passes `{ast.unparse(arg)}` as `{param}`: {where}", False
            fills.append((fill, where, sliced))
    if not fills:
        return None, f"`{param}` is passed into `{cls.name}.__init__` by its callers, and no call of `{cls.name}(...)` in the repo passes it", False
    if len({f for f, _w, _s in fills}) != 1:
        return None, f"the callers of `{cls.name}` pass mask functions with different fill values", False
    return fills[0][0], fills[0][1], any(sl for _f, _w, sl in fills)


# --- fused_optimizer: grads freed by code of other files (issue 14 class 5) ----------------------
# dino's `train_one_epoch(student, ...)` calls `utils.cancel_gradients_last_layer(epoch, student, n)`
# (utils.py: `p.grad = None` for the last layer's params during the first epochs); fairseq's
# `class SGD(LegacyFairseqOptimizer)` holds `self._optimizer = torch.optim.SGD(...)` and inherits
# `FairseqOptimizer.zero_grad` (another file: `for p in self.params: p.grad = None`). The code that
# frees is in another file; repo_symbols finds it. Followed by dataflow only: the objects the site
# hands on (the model whose parameters the guard reads, the name the optimizer is bound to), through
# the parameters of the functions they are passed to (three calls deep), or the instance itself for
# a class's inherited methods. Freed grads are re-allocated by the next backward outside the fused
# optimizer's flat buffer (and a parameter without a grad at the first step is left out of it).

_CALL_DEPTH = 3
_BASE_DEPTH = 8


def _freed_through_other_files(root: Path, files: list[str], outcomes: list[Any], near: list[dict[str, Any]], max_bytes: int) -> None:
    from npufuse.scan import repo_symbols

    symbols = repo_symbols.shared(root, files, max_bytes)
    for o in outcomes:
        for h in [h for h in o.hits if h.finding.pattern == _PATTERN]:
            f = h.finding
            tree, _why = symbols.tree(o.file)
            if tree is None:
                continue
            reason = _inherited_freeing(symbols, o.file, tree, f.qualname) or _callee_freeing(symbols, o.file, tree, f)
            if reason is None:
                continue
            o.hits.remove(h)
            near.append({"pattern": f.pattern, "file": o.file, "qualname": f.qualname, "line": f.line, "end_line": f.end_line,
                         "reason": reason + ": the next backward allocates new grads outside the fused optimizer's flat "
                                   "buffer and its update silently uses stale ones (a parameter without a grad at the first "
                                   "step is left out of that buffer for good); torch.optim handles freed grads"})


def _frees(fn: ast.AST, held: Any) -> Optional[tuple[str, int]]:
    """(what, line) where ``fn`` frees or re-allocates the grad of an object ``held(fn, receiver)``
    accepts: ``X.grad = ...``, ``X.grad.data = ...``, ``X.zero_grad(set_to_none=<not False>)``."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Attribute) and t.attr == "data" and isinstance(t.value, ast.Attribute) and t.value.attr == "grad":
                    t = t.value
                if isinstance(t, ast.Attribute) and t.attr == "grad" and held(fn, dotted(t.value) or ""):
                    return ("sets grads to None" if isinstance(n.value, ast.Constant) and n.value.value is None
                            else "assigns new grads (`.grad = ...`)"), n.lineno
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "zero_grad":
            flag = next((k.value for k in n.keywords if k.arg == "set_to_none"), n.args[0] if n.args else None)
            if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False) and held(fn, dotted(n.func.value) or ""):
                return f"frees grads (`{dotted(n.func) or 'zero_grad'}(set_to_none=...)`)", n.lineno
    return None


def _frees_through_bases(symbols: Any, file: str, cls: ast.ClassDef) -> Optional[tuple[str, str, int]]:
    """(what, file, line) where a method of ``cls`` or of one of its bases (any file of the repo)
    frees the grads of what the instance holds (``self.optimizer.zero_grad(set_to_none=True)``,
    ``for p in self.params: p.grad = None``)."""
    from npufuse.patterns.fused_optimizer import held_by_instance

    todo: list[tuple[str, ast.ClassDef, int]] = [(file, cls, 0)]
    seen: set[tuple[str, int]] = set()
    while todo:
        f, node, depth = todo.pop(0)
        if (f, node.lineno) in seen or depth > _BASE_DEPTH:
            continue
        seen.add((f, node.lineno))
        for m in node.body:
            if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                hit = _frees(m, held_by_instance)
                if hit is not None:
                    return hit[0], f, hit[1]
        for base in node.bases:
            sym = symbols.resolve_node(f, base)
            if sym.kind == "class" and isinstance(sym.node, ast.ClassDef):
                todo.append((sym.file, sym.node, depth + 1))
    return None


def _inherited_freeing(symbols: Any, rel: str, tree: ast.Module, qualname: str) -> Optional[str]:
    """A site in a method of a module-level class: does a base class (of any file of the repo)
    free the grads of what the instance holds?"""
    from npufuse.patterns.fused_optimizer import held_by_instance

    parts = qualname.split(".")
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == parts[0]), None) if len(parts) > 1 else None
    if cls is None:
        return None
    for file, base in _optim_s46.base_classes(symbols, rel, cls, _BASE_DEPTH):
        for m in base.body:
            if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                hit = _frees(m, held_by_instance)
                if hit is not None:
                    what, line = hit
                    return (f"`{cls.name}` holds this optimizer and inherits `{base.name}.{m.name}` "
                            f"({file}:{line}), which {what} of what the instance holds")
    return None


def _derived(fn: ast.AST, names: set[str]) -> set[str]:
    """``names`` and the local names bound from them in ``fn`` (``for p in model.parameters()``,
    ``params = list(model.parameters())``), to a fixed point (three passes at most)."""
    return names_bound_from(fn, names, 3)


def _param_sources(region: list[ast.AST], f: Any) -> set[str]:
    """The objects the optimizer's params argument is built from (``params_groups`` of
    ``params_groups = utils.get_params_groups(student)`` gives ``student``), two definitions deep
    in the site's function; names in call position (functions, modules) and ``self`` are not."""
    try:
        given = f.params.get("params") if isinstance(f.params, dict) else None
        expr = ast.parse(given if isinstance(given, str) else "", mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return set()

    def operands(node: ast.AST) -> set[str]:
        # bare names only: `args` of `args.wd` is a configuration object read for a value, not the
        # object whose parameters are taken (that one is handed whole: `get_groups(model, args.wd)`)
        read = {id(a.value) for a in ast.walk(node) if isinstance(a, ast.Attribute)}
        read |= {id(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)}
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and id(n) not in read and n.id != "self"}

    names = operands(expr)
    for _ in range(2):
        for root in region:
            for n in ast.walk(root):
                if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id in names for t in n.targets):
                    names |= operands(n.value)
    return names


def _runs_before(region: list[ast.AST], call: ast.Call, site_line: int) -> bool:
    """Does ``call`` (in the site's own function) run only before the optimizer is built: above
    the construction and in no loop that also holds it (the fused class reads its parameters and
    grads at construction and at its first step)?"""
    if call.lineno >= site_line:
        return False
    for root in region:
        for n in ast.walk(root):
            if isinstance(n, (ast.For, ast.AsyncFor, ast.While)) and n.lineno <= call.lineno <= (n.end_lineno or n.lineno) \
                    and n.lineno <= site_line <= (n.end_lineno or n.lineno):
                return False
    return True


def _module_zero_grad(fn: ast.AST, modules: set[str]) -> Optional[tuple[str, int]]:
    """(what, line) of ``M.zero_grad()`` without set_to_none on one of ``modules`` (torch >= 2.0
    frees by default)."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "zero_grad" and not n.args \
                and not any(k.arg == "set_to_none" for k in n.keywords) and (dotted(n.func.value) or "").split(".")[0] in modules:
            return f"frees them with `{dotted(n.func)}()` (set_to_none=True by default on torch >= 2.0)", n.lineno
    return None


def _tracked_arg(arg: ast.AST, tracked: set[str]) -> bool:
    """Is ``arg`` a tracked object, or (s35) the parameters of one (``model.parameters()``,
    ``model.named_parameters()``: mistral-finetune hands ``model.parameters()`` to helpers that set
    ``p.grad = p.grad.to(dtype)`` around every step)? The callee then gets those parameters."""
    if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr in ("parameters", "named_parameters"):
        arg = arg.func.value
    name = dotted(arg)
    return name is not None and name in tracked and name.split(".")[0] in tracked


def _callee_freeing(symbols: Any, rel: str, tree: ast.Module, f: Any) -> Optional[str]:
    """Does a function the site's function hands the model or the optimizer to (directly or through
    up to three calls, in any file of the repo) free or re-allocate their grads?"""
    region = _region(tree, f.qualname)
    handed = _handed_names(f) | (_param_sources(region, f) if region is not None else set())
    if region is None or not handed:
        return None
    # the objects whose parameters the optimizer takes (not the optimizer itself): their own
    # `zero_grad()` frees by default (torch >= 2.0), an optimizer's (the fused class's) does not
    bound = _bound_name(f.fused) if isinstance(f.fused, str) else None
    modules = handed - {bound}
    todo: list[tuple[str, list[ast.AST], set[str], set[str], Optional[ast.AST], int, str]] = [
        (rel, region, handed, modules, region[0] if len(region) == 1 else None, 0, "")]
    seen: set[tuple[str, str, frozenset[str]]] = set()
    while todo:
        file, roots, tracked, mods, scope, depth, path = todo.pop(0)
        for root in roots:
            for call in ast.walk(root):
                if not isinstance(call, ast.Call) or not isinstance(call.func, (ast.Name, ast.Attribute)):
                    continue
                passed = [(i, a) for i, a in enumerate(call.args) if _tracked_arg(a, tracked)]
                named = [(k.arg, k.value) for k in call.keywords if k.arg and _tracked_arg(k.value, tracked)]
                if not passed and not named:
                    continue
                sym = symbols.resolve_node(file, call.func, scope if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
                fn = sym.node
                if sym.kind != "function" or "." in sym.qualname or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue  # a method or a class: its code works on its own object
                params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
                got = {params[i] for i, _a in passed if i < len(params)} | {k for k, _v in named if k in params or fn.args.kwonlyargs}
                got &= {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
                got_mods = {params[i] for i, a in passed if i < len(params) and dotted(a) in mods} | \
                    {k for k, v in named if dotted(v) in mods} & got
                key = (sym.file, sym.qualname, frozenset(got))
                if not got or key in seen or (depth == 0 and _runs_before(region, call, f.line)):
                    continue
                seen.add(key)
                here = f"{path}`{dotted(call.func)}` ({file}:{call.lineno}) -> "
                derived = _derived(fn, got)
                # a function of the site's own file was judged with the file (which knows when it runs)
                hit = _frees(fn, lambda _fn, recv: recv.split(".")[0] in derived) if sym.file != rel else None
                if hit is None and sym.file != rel:
                    hit = _module_zero_grad(fn, _derived(fn, got_mods))
                if hit is not None:
                    what, line = hit
                    return (f"{here}`{sym.qualname}` ({sym.file}:{line}) gets "
                            f"`{', '.join(sorted(got))}` and {what}" + ("" if what.startswith("frees them") else " of them"))
                if depth + 1 < _CALL_DEPTH:
                    todo.append((sym.file, [fn], got, got_mods, fn, depth + 1, here))
    return None


# --- norms (s25): where a name re-exported by the repository really comes from ------------------
# Yuan's ``megatron/model/__init__.py`` holds ``from apex.normalization import MixedFusedRMSNorm as
# RMSNorm`` and transformer.py builds ``RMSNorm(hidden, eps=1e-6)`` from ``from megatron.model import
# RMSNorm``: the class is apex's, which the file itself never names.

def external_origin(module: Any, name: str) -> Optional[str]:
    """The dotted name outside the repository that ``name`` (a canonical ``pkg.mod.Attr`` as file
    ``module`` imports it) stands for, following the repository's re-exports; the name itself when
    its module is not a file of the repo; None when it is defined in the repo (or unreadable)."""
    root = repo_root(module)
    if root is None or "." not in name:
        return None
    _depends(root, module.path)  # found or not, the answer depends on other files
    mod, attr = name.rsplit(".", 1)
    found = _trace_reexport(root, module.path, mod, attr)
    return found if isinstance(found, str) else None


@_dataclass(frozen=True)
class _ChosenAtImport:
    """A repository file binding the traced name more than once (``try: from apex... import X except
    ImportError: from torch.nn import X``): which binding holds is decided when the file is imported."""

    rel: str
    tree: ast.Module
    attr: str


def _trace_reexport(root: Path, from_rel: str, mod: str, attr: str, hops: int = 4) -> "Optional[str] | _ChosenAtImport":
    """``mod.attr`` as file ``from_rel`` imports it, followed through the repository's re-exports: the
    outside name, None (defined in the repo, or unreadable) or the file that binds it several times."""
    for _hop in range(hops):
        if not mod or any(p in ("", "..") for p in mod.split(".")):
            return None
        parts = mod.split(".")
        # the repository root, its `src/` folder (the src layout: `src/liger_kernel/...` imported as
        # `liger_kernel...`, audit42) and the importing file's folders
        bases = [PurePosixPath("."), PurePosixPath("src")] + list(PurePosixPath(from_rel).parents)
        found: Optional[tuple[str, ast.Module]] = None
        for base in dict.fromkeys(bases):
            for cand in (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py")):
                tree = _parse_repo_file(root, str(cand))
                if tree is not None:
                    found = (str(cand), tree)
                    break
            if found is not None:
                break
        if found is None:
            return f"{mod}.{attr}"
        rel, tree = found
        if _top_def(tree, attr) is not None and _bindings(tree, attr) == 1:
            return None  # defined here
        if _bindings(tree, attr) > 1:
            return _ChosenAtImport(rel, tree, attr)  # Megatron-DeepSpeed: apex's on CUDA, its own elsewhere
        again = _imported(tree, rel, attr)
        if again is None:
            return None
        mod, attr = again
        from_rel = rel
    return None


def import_time_origins(module: Any, name: str) -> Optional[tuple[Optional[str], ...]]:
    """Where a name the repository re-exports may come from when the re-exporting file binds it more
    than once at import time, each binding a module-level import or class (Lumina-Video's
    ``components.py``: ``try: from apex.normalization import FusedRMSNorm as RMSNorm except
    ImportError: from torch.nn import RMSNorm``): one entry per binding, the outside dotted name or
    None for a class of the repository. ``name``: canonical (``pkg.mod.Attr``) or a local name the
    file imports relatively. None when the name is bound once (``external_origin``), by
    anything else (an assignment, a function: a value chosen by code), or is unreadable."""
    root = repo_root(module)
    if root is None:
        return None
    # a class this file defines at module level is not an import (every transformers model builds its
    # own ``XRMSNorm``): answered from the module body, before _imported's walk of the whole tree,
    # which costs ~4 ms a call when the name is not imported at all (+18% of the cold analysis)
    if "." not in name and any(isinstance(n, ast.ClassDef) and n.name == name for n in module.tree.body):
        return None
    # a relative import (``from .components import RMSNorm``) has no canonical dotted name: the
    # file's own import says where the name comes from
    target = tuple(name.rsplit(".", 1)) if "." in name else _imported(module.tree, module.path, name)
    if target is None or len(target) != 2:
        return None  # a class of this file (or not imported): no other file read, the outcome stays cacheable
    _depends(root, module.path)
    mod, attr = target
    chosen = _trace_reexport(root, module.path, mod, attr)
    if not isinstance(chosen, _ChosenAtImport):
        return None
    out: list[Optional[str]] = []
    for node in _module_level_statements(chosen.tree.body):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if (a.asname or a.name) != chosen.attr:
                    continue
                base = PurePosixPath(chosen.rel).parent
                for _ in range(max(node.level - 1, 0)):
                    base = base.parent
                parts = ([p for p in base.parts if p not in ("", ".")] if node.level else []) + \
                    ((node.module or "").split(".") if node.module else [])
                origin = _trace_reexport(root, chosen.rel, ".".join(parts), a.name)
                if isinstance(origin, _ChosenAtImport):
                    return None
                out.append(origin)
        elif isinstance(node, ast.Import):
            if any((a.asname or a.name.split(".")[0]) == chosen.attr for a in node.names):
                return None  # a module bound to the name, not a class
        elif isinstance(node, ast.ClassDef) and node.name == chosen.attr:
            out.append(None)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) \
                and chosen.attr in _flat_names(node.targets if isinstance(node, ast.Assign) else [node.target]) \
                or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == chosen.attr:
            return None
    return tuple(out) if len(out) > 1 else None


def _module_level_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements run when the module is imported: the body and the blocks of its ``try`` /
    ``if`` statements (not the bodies of functions or classes)."""
    for node in body:
        yield node
        if isinstance(node, ast.Try):
            yield from _module_level_statements(node.body)
            for h in node.handlers:
                yield from _module_level_statements(h.body)
            yield from _module_level_statements(node.orelse)
            yield from _module_level_statements(node.finalbody)
        elif isinstance(node, ast.If):
            yield from _module_level_statements(node.body)
            yield from _module_level_statements(node.orelse)


def _bindings(tree: ast.Module, name: str) -> int:
    """How many statements of the file bind ``name`` (imports, definitions, assignments)."""
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            n += sum(1 for a in node.names if (a.asname or a.name.split(".")[0]) == name)
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            n += 1
        elif isinstance(node, ast.Assign):
            n += sum(1 for t in node.targets if isinstance(t, ast.Name) and t.id == name)
    return n


# --- s27: sharding applied through the object holding the model (issue 14 class 5 precision) ----
# open_clip's driver calls `task.prepare_fsdp(...)` and then `create_optimizer(task.trainable_module)`:
# the FSDP wrapping is a method of the object that holds the model, not a call taking the model as
# an argument. A sharding-named call counts when its receiver is the model or holds it (`task` of
# `task.trainable_module`) and it is a statement of its own (an action on that object, its result
# unused): a query such as `if task.is_fsdp():` is a test, not a wrapping.

def _s27_shards_holder(tree: ast.Module, node: ast.Call, recv: Optional[str], models: set[str]) -> bool:
    if not recv or not any(m == recv or m.startswith(recv + ".") for m in models):
        return False
    return any(isinstance(s, ast.Expr) and s.value is node for s in ast.walk(tree))


# --- s28: grads freed through an object that holds the model (issue 14 class 5 precision) -------
# minGPT-style trainers call `raw_model.configure_optimizers(config)` with
# `raw_model = model.module if hasattr(model, "module") else model` and then `model.zero_grad()`;
# diamond builds `configure_opt(getattr(self.agent, name))` and calls `self.agent.zero_grad()`.
# nn.Module.zero_grad() recurses into every submodule, so the zero_grad of an object that IS the
# model or HOLDS it (an attribute chain above it, the object given to `getattr`, a name the model
# was bound from) frees the model's grads: the same near miss as a zero_grad on the model itself,
# without a fix (the fused branch cannot reach that object from the builder's file).

def _s28_value_names(expr: ast.AST) -> set[str]:
    """Dotted names ``expr`` evaluates to or reads an attribute of (its holders), through
    conditional expressions, ``a or b`` and ``getattr(X, ...)``; ``self``/``cls`` alone are not
    objects of interest (their zero_grad is their own method)."""
    out: set[str] = set()
    if isinstance(expr, ast.IfExp):
        return _s28_value_names(expr.body) | _s28_value_names(expr.orelse)
    if isinstance(expr, ast.BoolOp):
        for v in expr.values:
            out |= _s28_value_names(v)
        return out
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "getattr" and expr.args:
        expr = expr.args[0]
    name = dotted(expr)
    if not name:
        return out
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix not in ("self", "cls"):
            out.add(prefix)
    return out


def _s28_unit_of(tree: ast.Module, line: int) -> Optional[ast.AST]:
    """The module-level function or method of a module-level class holding ``line``."""
    for node in tree.body:
        members = node.body if isinstance(node, ast.ClassDef) else [node]
        for m in members:
            if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.lineno <= line <= (m.end_lineno or m.lineno):
                return m
    return None


def _s28_holder_zero_grad(tree: ast.Module, rel: str, b: "_Builder", models: set[str], via: str
                          ) -> Optional[tuple[bool, str, Optional[str], bool]]:
    units: dict[int, ast.AST] = {}
    holders: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _refers(node.func, b.function):
            exprs = [*node.args, *(k.value for k in node.keywords if k.arg)]
            if isinstance(node.func, ast.Attribute):
                exprs.append(node.func.value)
            for e in exprs:
                holders |= _s28_value_names(e)
            unit = _s28_unit_of(tree, node.lineno)
            if unit is not None:
                units[id(unit)] = unit
    if not holders:
        return None
    # names the model (or what holds it) was bound from, in the builder call's own function
    for _ in range(3):
        grown = set(holders)
        for unit in units.values():
            for n in ast.walk(unit):
                if not isinstance(n, ast.Assign):
                    continue
                for t in n.targets:
                    pairs = (list(zip(t.elts, n.value.elts)) if isinstance(t, (ast.Tuple, ast.List)) and isinstance(n.value, (ast.Tuple, ast.List))
                             and len(t.elts) == len(n.value.elts) else [(t, n.value)])
                    for target, value in pairs:
                        if dotted(target) in holders:
                            grown |= _s28_value_names(value)
        if grown == holders:
            break
        holders = grown
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "zero_grad"):
            continue
        recv = dotted(node.func.value)
        if not recv or recv in models or recv not in holders:
            continue
        if "." not in recv and not any(u.lineno <= node.lineno <= (u.end_lineno or u.lineno) for u in units.values()):
            continue  # a local name of another function: another object
        flag = next((k.value for k in node.keywords if k.arg == "set_to_none"), node.args[0] if node.args else None)
        if flag is not None and isinstance(flag, ast.Constant) and flag.value is False:
            continue
        return True, (f"`{recv}.zero_grad({'' if flag is None else 'set_to_none=...'})` at {rel}:{node.lineno} on an object "
                      f"that is or holds the model whose parameters the optimizer takes ({via}): nn.Module.zero_grad() "
                      "recurses into every submodule and sets their grads to None"
                      f"{' (torch >= 2.0 default)' if flag is None else ''}, so the next backward allocates new ones "
                      "outside the fused optimizer's flat buffer and its update silently uses stale grads; pass "
                      "set_to_none=False there"), None, flag is not None
    return None


def _s28_nearest_definer(rel: str, b: "_Builder", definers: set[str]) -> bool:
    """A method defined in several files of the repo (RWKV-LM's RWKV-v1/src/model.py and
    RWKV-v4/src/model.py both define ``GPT.configure_optimizers``): the driving file ``rel``
    reaches the builder's definition when that file shares strictly more folders with it than
    with every other definition (a trainer beside its model.py, handed the model as an argument)."""
    if not b.cls or b.rel not in definers or len(definers) < 2:
        return False

    def shared(a: str, c: str) -> int:
        pa, pc = PurePosixPath(a).parent.parts, PurePosixPath(c).parent.parts
        n = 0
        while n < min(len(pa), len(pc)) and pa[n] == pc[n]:
            n += 1
        return n

    mine = shared(rel, b.rel)
    return mine > 0 and all(shared(rel, d) < mine for d in definers if d != b.rel)



# --- s28 speed ---------------------------------------------------------------------------------
# A detector that asks "does another file of the repo hold the string '<attr>' and one of these
# words?" once per attribute read every file of the repo again for every attribute (the transformers
# corpus: 24 attributes x 544 files, a tenth of the scan). Each file's text is read once per scan
# instead and kept as the set of identifier-like words it holds between two quotes of one kind.

import re as _re

_QUOTED_WORD = _re.compile(r"""(['"])(?=(\w+)\1)""")
_WORD_ONLY = _re.compile(r"\w+")
_QUOTED: dict[tuple[str, str, tuple[str, ...]], Optional[frozenset[str]]] = {}


def holds_quoted(root: Path, rel: str, word: str, needs: tuple[str, ...]) -> bool:
    """``any(q in text for q in ("'word'", '"word"'))`` for the text of ``rel`` (``_repo_text``)
    that holds one of ``needs``; False where it holds none, or cannot be read. A ``word`` of word
    characters only is looked up in the file's set of quoted words, read once per scan (a quote,
    then word characters up to the same quote: the maximal run, so the set holds the word exactly
    where the text holds it quoted); any other word is looked for in the text itself."""
    if not _WORD_ONLY.fullmatch(word):
        text = _repo_text(root, rel)
        return bool(text) and any(n in text for n in needs) and any(q in text for q in (f"'{word}'", f'"{word}"'))  # type: ignore[operator]
    key = (str(root), rel, needs)
    if key not in _QUOTED:
        if len(_QUOTED) > 65536:
            _QUOTED.clear()
        text = _repo_text(root, rel)
        words: Optional[frozenset[str]] = None
        if text and any(n in text for n in needs):
            words = frozenset(m.group(2) for m in _QUOTED_WORD.finditer(text))
        _QUOTED[key] = words
    words = _QUOTED[key]
    return words is not None and word in words


def _s28_reset_quoted() -> None:
    _QUOTED.clear()
    _REGISTERING.clear()
    _REGISTERS_ON_OTHERS.clear()


# s38 speed: ``self.register_buffer(...)`` / ``setattr(self, ...)`` as written (ASCII ``self`` or
# ``cls`` as a whole name, whitespace allowed where Python allows it without a line continuation)
# (s50: each name with its left boundary after it: the same matches, searched by their first letters)
_SELF_REGISTER_BUFFER = _re.compile(r"(?:self(?<![\w.]self)|cls(?<![\w.]cls))\s*\.\s*register_buffer")
_SELF_SETATTR = _re.compile(r"setattr\s*\(\s*(?:self|cls)\s*,")
_REGISTERS_ON_OTHERS: dict[tuple[str, str], bool] = {}


def may_register_on_another(root: Path, rel: str) -> bool:
    """False only where no call of file ``rel`` can be one ``registering_calls`` lists with a
    receiver among its function's parameters less self / cls (what a search for the function that
    registers an attribute on a module handed to it matches): every ``register_buffer`` of the
    text is ``self.register_buffer`` / ``cls.register_buffer`` and every ``setattr`` is
    ``setattr(self, ...)`` / ``setattr(cls, ...)`` (an occurrence in a longer name or a string is
    no such call either way). Text whose identifiers may be NFKC spellings of others (a character
    outside ASCII decomposing to ASCII: ``dataflow.folds_to_ascii``) or that cannot be read says
    True. Most repo files that name an attribute quoted and ``setattr`` (HF's rotary classes:
    ``setattr(self, f"{layer_type}_inv_freq", ...)``) were parsed for nothing. Once per file
    and scan."""
    key = (str(root), rel)
    got = _REGISTERS_ON_OTHERS.get(key)
    if got is None:
        text = _repo_text(root, rel)
        got = True
        if text is not None:
            from types import SimpleNamespace

            from npufuse.scan.dataflow import folds_to_ascii

            if text.isascii() or not folds_to_ascii(SimpleNamespace(source=text)):  # type: ignore[arg-type]
                # s41: the regexes only where the text names the call (no count, no match: not more
                # calls than matches); the register_buffer one, led by a lookbehind, has no literal
                # to search for and tried every position of the file (0.49 s over the transformers files)
                registers, setattrs = text.count("register_buffer"), text.count("setattr")
                got = (registers > 0 and registers > len(_SELF_REGISTER_BUFFER.findall(text))) \
                    or (setattrs > 0 and setattrs > len(_SELF_SETATTR.findall(text)))
        if len(_REGISTERS_ON_OTHERS) > 65536:
            _REGISTERS_ON_OTHERS.clear()
        _REGISTERS_ON_OTHERS[key] = got
    return got


# Per tree: each function (``fast_walk`` order) with its parameters less self/cls and, in
# ``fast_walk`` order, the calls in it that may set an attribute of another object
# (``m.register_buffer(a, b, ...)``, ``setattr(a, b, c)``): a search for the function that
# registers one attribute asked it of every call of every function, once per attribute.
_REGISTERING: dict[int, tuple[ast.Module, list[tuple[ast.AST, set[str], list[ast.Call]]]]] = {}


def registering_calls(tree: ast.Module, owner: Any = None) -> list[tuple[ast.AST, set[str], list[ast.Call]]]:
    """The index above for ``tree``, kept on ``owner`` (the scanned file's ModuleInfo, freed
    with it) or, for another file's tree, until the next scan (the tree is held with its entry,
    so its id is not reused meanwhile). Where the tree's text is known (``owner.source``, or the
    text ``_parse_repo_file`` parsed it from), only the functions spanning a line that names
    ``register_buffer`` or ``setattr`` are listed (``_registering_lines``): the others' call
    lists were empty, and the walk entered every node of the file for them."""
    if owner is not None:
        got = owner.__dict__.get("_npufuse_registering_calls")
        if got is None:
            got = owner.__dict__["_npufuse_registering_calls"] = _registering_index(tree, _registering_lines(owner.source))
        return got
    entry = _REGISTERING.get(id(tree))
    if entry is None or entry[0] is not tree:
        if len(_REGISTERING) > 512:
            _REGISTERING.clear()
        parsed = _PARSED_TEXT.get(id(tree))
        lines = _registering_lines(parsed[1]) if parsed is not None and parsed[0] is tree else None
        entry = _REGISTERING[id(tree)] = (tree, _registering_index(tree, lines))
    return entry[1]


_REGISTERING_WORDS = ("register_buffer", "setattr")


def _registering_lines(text: str) -> Optional[list[int]]:
    """The lines of ``text`` where a registering call's name can be written (``dataflow.lines_with``:
    the lines holding ``register_buffer`` or ``setattr``, and those outside ASCII where a name
    there may be an NFKC spelling of one), or None (every line: "\r" line ends)."""
    from types import SimpleNamespace

    from npufuse.scan.dataflow import lines_with

    return lines_with(SimpleNamespace(source=text), _REGISTERING_WORDS)  # type: ignore[arg-type]


def _registering_index(tree: ast.Module, lines: Optional[list[int]] = None) -> list[tuple[ast.AST, set[str], list[ast.Call]]]:
    """One breadth-first walk of ``tree`` (``fast_walk``'s order), each node carrying the call
    lists of the functions around it: a registering call joins each of them. The nodes of a
    subtree come in the same order in the walk of the tree as in a walk of the subtree (by
    depth, then by their parents' order), so each list is in ``fast_walk(fn)`` order -- what
    one walk per function gave, without walking a nested function's body once per def around it.
    ``lines`` (sorted; None: all): a statement spanning none of them is not entered, so the
    functions there (whose lists would stay empty) are left out; leaving whole subtrees out of a
    breadth-first walk keeps the order of the rest."""
    from npufuse.scan.dataflow import child_fields, spans_a_line

    out: list[tuple[ast.AST, set[str], list[ast.Call]]] = []
    todo: list[ast.AST] = [tree]
    around: list[tuple[list[ast.Call], ...]] = [()]  # around[i]: the call lists of todo[i]'s enclosing functions
    AST, Call, Attribute, Name, stmt = ast.AST, ast.Call, ast.Attribute, ast.Name, ast.stmt
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    i = 0
    while i < len(todo):
        n, lists = todo[i], around[i]
        i += 1
        if isinstance(n, functions):
            a = n.args
            calls: list[ast.Call] = []
            out.append((n, {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs} - {"self", "cls"}, calls))
            lists = (*lists, calls)
        elif lists and isinstance(n, Call):
            f = n.func
            if (isinstance(f, Attribute) and f.attr == "register_buffer" and len(n.args) >= 2) or (
                    isinstance(f, Name) and f.id == "setattr" and len(n.args) == 3):
                for calls in lists:
                    calls.append(n)
        for name in child_fields(type(n)):
            v = getattr(n, name, None)
            if type(v) is list:
                for x in v:
                    if isinstance(x, AST):
                        if lines is not None and isinstance(x, stmt) and not spans_a_line(x, lines):
                            continue
                        todo.append(x)
                        around.append(lists)
            elif isinstance(v, AST):
                todo.append(v)
                around.append(lists)
    return out


# --- accelerate launch configurations of the repo (s32) ------------------------------------------
# An accelerate-prepared optimizer runs under whatever `accelerate launch --config_file x.yaml` says:
# `distributed_type: DEEPSPEED` / `FSDP` / `MEGATRON_LM` wraps it in an engine that flattens the
# parameters or re-assigns their grads every step (the candidate's guard keeps torch.optim for such
# runs: fused_optimizer.accelerate_launch_guard). When every accelerate configuration the repo ships
# chooses one of those, the fused branch would never run in the repo's own launches: a near miss.

_LAUNCH_SUFFIXES = (".yaml", ".yml", ".json")
_LAUNCH_MAX_BYTES = 64 * 1024
_DISTRIBUTED_TYPE = _re.compile(r"""(?<![\w-])["']?distributed_type["']?\s*:\s*["']?([A-Za-z_]+)""")
_SHARDED_TYPES = ("DEEPSPEED", "FSDP", "MEGATRON_LM")
_LAUNCH_CONFIGS: dict[str, list[tuple[str, str]]] = {}


def accelerate_launch_configs(root: Path) -> list[tuple[str, str]]:
    """(file, distributed_type) of every accelerate launch configuration in the repo: a small YAML/JSON
    file with a ``distributed_type`` key (accelerate's own key name), files of skipped folders left out."""
    key = str(root)
    if key not in _LAUNCH_CONFIGS:
        out: list[tuple[str, str]] = []
        seen = 0
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
            for name in sorted(filenames):
                if not name.lower().endswith(_LAUNCH_SUFFIXES):
                    continue
                seen += 1
                path = Path(dirpath) / name
                try:
                    if path.is_symlink() or path.stat().st_size > _LAUNCH_MAX_BYTES:
                        continue
                    text = path.read_text(encoding="utf-8", errors="replace")
                except OSError:
                    continue
                m = _DISTRIBUTED_TYPE.search(text) if "distributed_type" in text else None
                if m:
                    out.append((path.relative_to(root).as_posix(), m.group(1).upper()))
            if seen > 5000:
                break
        if len(_LAUNCH_CONFIGS) > 8:
            _LAUNCH_CONFIGS.clear()
        _LAUNCH_CONFIGS[key] = out
    return _LAUNCH_CONFIGS[key]


def _sharded_accelerate_launches(root: Path, outcomes: list[Any], near: list[dict[str, Any]]) -> None:
    hits = [(o, h) for o in outcomes for h in o.hits
            if h.finding.pattern == _PATTERN and "accelerate_prepare" in (h.finding.params or {})]
    if not hits:
        return
    configs = accelerate_launch_configs(root)
    if not configs or not all(kind in _SHARDED_TYPES for _rel, kind in configs):
        return
    named = ", ".join(f"{rel} (distributed_type: {kind})" for rel, kind in configs[:3]) + (", ..." if len(configs) > 3 else "")
    for o, h in hits:
        f = h.finding
        o.hits.remove(h)
        near.append({"pattern": f.pattern, "file": o.file, "qualname": f.qualname, "line": f.line, "end_line": f.end_line,
                     "reason": (f"the optimizer goes through accelerate's prepare ({f.params['accelerate_prepare']}) and every "
                                f"accelerate launch configuration in the repo chooses DeepSpeed, FSDP or Megatron-LM ({named}): "
                                "that engine flattens the parameters or re-assigns their grads behind the optimizer, so the "
                                "flat-buffer fused class cannot take over in the repo's own launches (a guarded rewrite would "
                                "always run torch.optim)")})


def _s33_lightning_callbacks_free(root: Path, files: list[str], outcomes: list[Any], near: list[dict[str, Any]], max_bytes: int) -> None:
    """An optimizer built in a LightningModule method is driven by the Trainer, and the repository's
    Lightning callbacks act on that module and its optimizers through their hooks' arguments
    (``on_after_backward(self, trainer, pl_module)``, ``on_before_zero_grad(self, trainer, pl_module,
    optimizer)``). A callback that frees the module's grads (``pl_module.zero_grad()``: nn.Module's
    default is set_to_none=True on torch >= 2.0; proteina's NaN-skip callback) or replaces
    ``trainer.optimizers`` with wrappers (NeMo's EMA callback: an ``EMAOptimizer`` that subclasses
    torch.optim.Optimizer and inherits its zero_grad, which frees the wrapped param groups' grads)
    makes the flat-buffer fused class update stale buffers: such candidates become near misses."""
    hits = [(o, h) for o in outcomes for h in o.hits
            if h.finding.pattern == _PATTERN and "_lightning_strategy_checked" in str((h.finding.params or {}).get("guard", ""))]
    if not hits:
        return
    found: Optional[str] = None
    for rel in files:
        text = _read(root, rel, max_bytes)
        if not text or "Callback" not in text or "lightning" not in text or ("zero_grad" not in text and ".optimizers" not in text):
            continue
        tree = _parse(text)
        found = _s33_freeing_callback(tree, rel) if tree is not None else None
        if found is not None:
            break
    if found is None:
        return
    for o, h in hits:
        f = h.finding
        o.hits.remove(h)
        near.append({"pattern": f.pattern, "file": o.file, "qualname": f.qualname, "line": f.line, "end_line": f.end_line,
                     "reason": f"the optimizer is built for Lightning's Trainer, and a Lightning callback of the repository {found}: "
                               "the next backward allocates new grads outside the fused optimizer's flat buffer and its "
                               "update silently uses stale ones (torch.optim handles freed grads)"})


def _s33_freeing_callback(tree: ast.Module, rel: str) -> Optional[str]:
    """What a Lightning ``Callback`` subclass of ``tree`` does to the grads of the module or the
    optimizers its hooks are given (a clause of the near-miss reason), or None."""
    classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}
    for cls in classes.values():
        if not any((dotted(b) or "").split(".")[-1] == "Callback" for b in cls.bases):
            continue
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.name.startswith("on_") or len(fn.args.args) < 3:
                continue
            names = [a.arg for a in fn.args.args]
            trainer, module, optimizer = names[1], names[2], names[3] if len(names) > 3 else None
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "zero_grad" \
                        and isinstance(node.func.value, ast.Name):
                    flag = next((k.value for k in node.keywords if k.arg == "set_to_none"), node.args[0] if node.args else None)
                    kept = isinstance(flag, ast.Constant) and flag.value is False
                    freed = isinstance(flag, ast.Constant) and flag.value is True
                    if node.func.value.id == module and not kept:
                        return (f"(`{cls.name}.{fn.name}`, {rel}:{node.lineno}) calls `{module}.zero_grad()` on the LightningModule, "
                                "which sets its parameters' grads to None (nn.Module's default on torch >= 2.0)")
                    if node.func.value.id == optimizer and freed:
                        return (f"(`{cls.name}.{fn.name}`, {rel}:{node.lineno}) calls `{optimizer}.zero_grad(set_to_none=True)` "
                                "on the Trainer's optimizer")
                if isinstance(node, ast.Assign) and any(
                        isinstance(t, ast.Attribute) and t.attr == "optimizers" and isinstance(t.value, ast.Name) and t.value.id == trainer
                        for t in node.targets):
                    built = [c for c in ast.walk(node.value) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
                    wrapper = next((classes[c.func.id] for c in built if c.func.id in classes), None)
                    if wrapper is not None and any((dotted(b) or "").endswith("Optimizer") for b in wrapper.bases) and not any(
                            isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name == "zero_grad" for m in wrapper.body):
                        return (f"(`{cls.name}.{fn.name}`, {rel}:{node.lineno}) replaces `{trainer}.optimizers` with `{wrapper.name}` "
                                f"wrappers, which Lightning then zeroes: `{wrapper.name}` inherits torch.optim.Optimizer.zero_grad, "
                                "whose default set_to_none=True (torch >= 2.0) sets the wrapped param groups' grads to None")
                    if built:
                        return (f"(`{cls.name}.{fn.name}`, {rel}:{node.lineno}) replaces `{trainer}.optimizers` with "
                                f"`{dotted(built[0].func) or 'other'}` objects that Lightning then steps and zeroes in the "
                                "optimizer's place (npufuse does not check what they do to the grads; they may free them)")
    return None



_PURE_LIST_METHODS: dict[tuple[str, str], bool] = {}
# calls a parameter-listing method may make without an effect beyond its own fresh lists
_LISTING_CALLS = frozenset({"named_parameters", "parameters", "append", "extend", "filter", "list", "len", "any", "all",
                            "isinstance", "hasattr", "getattr", "id", "set", "add", "startswith", "endswith", "split"})


def pure_list_method(module: Any, name: str) -> bool:
    """s33: does every definition of a method ``name`` in the repository (at least one, each a method of a
    module-level class, no function of that name) only build fresh lists from the object's parameters and
    return one (ReChorus' ``customize_parameters``: ``[{'params': weight_p}, {'params': bias_p, ...}]``)?
    Calling such a method twice gives the same tensors in fresh lists, with no other effect, so a guard may
    read its own call's result. Bounded: at most 24 definitions; any unparsable file holding the text
    ``def <name>(`` answers False."""
    root = repo_root(module)
    if root is None or not name.isidentifier():
        return False
    _depends(root, module.path)
    key = (str(root), name)
    if key not in _PURE_LIST_METHODS:
        defs: Optional[list[ast.AST]] = []
        needle = f"def {name}("
        for rel in _repo_py_files(root):
            text = _repo_text(root, rel)
            if text is None or needle not in text:
                continue
            tree = _parse_repo_file(root, rel)
            if tree is None or any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body):
                defs = None
                break
            found = [m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body
                     if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name == name]
            if not found or len(defs) + len(found) > 24:  # the text only in a nested def, or too many: unknown
                defs = None
                break
            defs.extend(found)
        if len(_PURE_LIST_METHODS) > 256:
            _PURE_LIST_METHODS.clear()
        _PURE_LIST_METHODS[key] = bool(defs) and all(_builds_parameter_lists(fn) for fn in defs or ())
    return _PURE_LIST_METHODS[key]


def _builds_parameter_lists(fn: ast.AST) -> bool:
    """``fn`` binds names only to list literals/comprehensions (or loop/lambda variables), calls only
    listing calls (:data:`_LISTING_CALLS`) on its own names and ``self``, assigns no attribute or
    subscript, and every ``return`` gives a list literal/comprehension or a name bound only to one."""
    if not isinstance(fn, ast.FunctionDef) or not fn.args.args or fn.decorator_list:
        return False
    lists: dict[str, bool] = {}
    for node in ast.walk(fn):
        if isinstance(node, (ast.Global, ast.Nonlocal, ast.Yield, ast.YieldFrom, ast.Await, ast.Delete, ast.AugAssign,
                             ast.NamedExpr, ast.With, ast.Try, ast.ClassDef, ast.AsyncFunctionDef)) \
                or (isinstance(node, ast.FunctionDef) and node is not fn):
            return False
        if isinstance(node, ast.Assign):
            for t in node.targets:
                for n in ast.walk(t):
                    if isinstance(n, (ast.Attribute, ast.Subscript, ast.Starred)):
                        return False
                    if isinstance(n, ast.Name):
                        fresh = isinstance(node.value, (ast.List, ast.ListComp)) or (
                            isinstance(node.value, ast.Tuple) and isinstance(t, ast.Tuple)
                            and all(isinstance(v, (ast.List, ast.ListComp)) for v in node.value.elts))
                        lists[n.id] = lists.get(n.id, True) and fresh
        if isinstance(node, ast.Call):
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id if isinstance(node.func, ast.Name) else None
            if _is_super_call(node, fn.name) or (isinstance(node.func, ast.Name) and node.func.id == "super" and not node.args):
                continue  # the base class's definition: one of the repo's definitions, checked too
            if callee not in _LISTING_CALLS:
                return False
            if callee in ("append", "extend", "add") and not (
                    isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) and node.func.value.id in lists):
                return False  # only the method's own fresh lists grow
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
    return bool(returns) and all(isinstance(r.value, (ast.List, ast.ListComp)) or _is_super_call(r.value, fn.name) or (
        isinstance(r.value, ast.Name) and lists.get(r.value.id, False)) for r in returns)


def _is_super_call(node: Optional[ast.AST], name: str) -> bool:
    """``super().<name>()`` without arguments."""
    return (isinstance(node, ast.Call) and not node.args and not node.keywords and isinstance(node.func, ast.Attribute)
            and node.func.attr == name and isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Name)
            and node.func.value.func.id == "super" and not node.func.value.args)


def _s33_bf16_from_every_caller(root: Path, files: list[str], outcomes: list[Any], near: list[dict[str, Any]], max_bytes: int) -> None:
    """A candidate whose model is a parameter of its builder (``def train(model, ...)``, or ``self.model =
    model`` in ``__init__``) is guarded at run time against bf16 parameters. Where every call of the builder
    in the repository hands it a model the caller has just cast to bfloat16 (nanoGRPO's ``train.py``:
    ``model = model.to(torch.bfloat16)`` then ``GRPO(model, ...)``), the fused branch never runs in the
    repository's own code: a near miss naming the cast says so instead."""
    from npufuse.patterns.fused_optimizer import guard_model
    from npufuse.scan import repo_symbols

    hits = [(o, h) for o in outcomes for h in o.hits if h.finding.pattern == _PATTERN and "requires_grad" in (h.finding.guard_tensor or "")]
    if not hits:
        return
    symbols = repo_symbols.shared(root, files, max_bytes)
    for o, h in hits:
        f = h.finding
        model = guard_model(f.guard_tensor or "")
        tree, _why = symbols.tree(o.file)
        if model is None or tree is None:
            continue
        callee, index, param = _s33_model_parameter(tree, f.qualname, model)
        if callee is None:
            continue
        casts: list[str] = []
        stem = PurePosixPath(o.file).stem
        for rel in files:
            text = _read(root, rel, max_bytes)
            # another file reaches the builder through its module (imported by name or as module.callee)
            if text is None or f"{callee}(" not in text or (rel != o.file and stem not in text):
                continue
            ctree = tree if rel == o.file else symbols.tree(rel)[0]
            if ctree is None:
                casts = []
                break
            found = _s33_bf16_handed(ctree, callee, index, param)
            if found is None:
                casts = []
                break
            casts += [f"{rel}:{ln}" for ln in found]
        if not casts:
            continue
        o.hits.remove(h)
        near.append({"pattern": f.pattern, "file": o.file, "qualname": f.qualname, "line": f.line, "end_line": f.end_line,
                     "reason": f"every call of `{callee}` in the repository hands it a model just cast to bfloat16 ({', '.join(casts[:3])}): "
                               "torch_npu fused optimizers take fp32/fp16 params only (TypeError at the first step), so the "
                               "guarded fused branch would never run here (keep fp32 master weights to use it)"})


def _s33_model_parameter(tree: ast.Module, qualname: str, model: str) -> tuple[Optional[str], int, str]:
    """(name callers call, positional index, parameter name) of the builder parameter ``model`` comes from:
    a module-level function's parameter, or a class's ``__init__`` parameter stored as ``self.<attr>``."""
    parts = qualname.split(".")
    top = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    fn: Optional[ast.AST] = None
    callee = None
    if len(parts) == 1 and isinstance(top.get(parts[0]), ast.FunctionDef):
        fn, callee = top[parts[0]], parts[0]
    elif len(parts) == 2 and parts[1] == "__init__" and isinstance(top.get(parts[0]), ast.ClassDef):
        fn = next((m for m in top[parts[0]].body if isinstance(m, ast.FunctionDef) and m.name == "__init__"), None)
        callee = parts[0]
    if not isinstance(fn, ast.FunctionDef) or fn.args.vararg or fn.args.kwarg:
        return None, 0, ""
    names = [a.arg for a in fn.args.args]
    offset = 1 if callee != parts[-1] else 0  # a method's self
    param = model
    if model.startswith("self.") and offset:
        stored = [n.value.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and len(n.targets) == 1
                  and dotted(n.targets[0]) == model and isinstance(n.value, ast.Name)]
        param = stored[0] if len(stored) == 1 else ""
    if param not in names[offset:]:
        return None, 0, ""
    return callee, names.index(param) - offset, param


def _s33_bf16_handed(tree: ast.Module, callee: str, index: int, param: str) -> Optional[list[int]]:
    """Lines of the bf16 casts behind every call of ``callee`` in ``tree`` (a positional argument at
    ``index`` or keyword ``param``, a name the caller's own body last bound, at its top level, to a
    bfloat16 cast: ``m = m.to(torch.bfloat16)`` / ``.bfloat16()`` / ``.to(dtype=torch.bfloat16)``); None when
    a call hands anything else (a different or unknown model: the guard decides at run time)."""
    out: list[int] = []
    bodies: list[list[ast.stmt]] = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for body in bodies:
        for i, stmt in enumerate(body):
            for call in _s33_own_nodes(stmt):
                if not (isinstance(call, ast.Call) and (dotted(call.func) or "").split(".")[-1] == callee):
                    continue
                arg = call.args[index] if index < len(call.args) else next((k.value for k in call.keywords if k.arg == param), None)
                if not isinstance(arg, ast.Name):
                    return None
                last = next((s for s in reversed(body[:i]) if isinstance(s, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == arg.id for t in s.targets)), None)
                if last is None or not _s33_bf16_cast(last.value):
                    return None
                out.append(last.lineno)
    return out


def _s33_own_nodes(stmt: ast.stmt) -> Iterable[ast.AST]:
    """The nodes of ``stmt`` outside the functions and classes it defines (their calls belong to their own bodies)."""
    todo: list[ast.AST] = [stmt]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node)
                    if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)))


def _s33_bf16_cast(value: ast.AST) -> bool:
    """``x.to(torch.bfloat16)`` / ``x.to(dtype=torch.bfloat16)`` / ``x.bfloat16()`` (the outermost call)."""
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)):
        return False
    if value.func.attr == "bfloat16" and not value.args:
        return True
    return value.func.attr == "to" and any((dotted(a) or "") in ("torch.bfloat16", "bfloat16")
                                           for a in [*value.args, *(k.value for k in value.keywords if k.arg == "dtype")])


def _s33_literal_create_graph(call: ast.Call, full: str) -> bool:
    """``t.backward(create_graph=True)`` / ``torch.autograd.backward(ts, create_graph=True)`` with a literal true
    (keyword, or the third / fourth positional argument)."""
    position = 3 if full.endswith("autograd.backward") else 2
    flag = next((k.value for k in call.keywords if k.arg == "create_graph"), call.args[position] if len(call.args) > position else None)
    return isinstance(flag, ast.Constant) and bool(flag.value)
