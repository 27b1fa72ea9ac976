"""Where an optimizer object goes after it is built: through the repository's own trainers and helpers
into a wrapper that replaces its params or frees its grads (s37, fused_optimizer class O1).

CoLLiE's example builds ``torch.optim.Adam(model.parameters())`` and hands it to the repository's
``Trainer(optimizer=optimizer)``; the Trainer keeps it as ``self.optimizer`` and hands it to
``setup_ds_engine(optimizer=self.optimizer)`` (another file), which calls ``deepspeed.initialize(optimizer=
optimizer)``. DeepSpeed wraps every client optimizer: with fp16/bf16 or ZeRO the wrapped optimizer steps fp32
master copies whose ``.grad`` DeepSpeed assigns every step, and otherwise the engine's ``zero_grad`` sets every
parameter's grad to None. The flat-buffer NpuFused* classes cannot follow either (spec pitfall 11). The site's own
file names no DeepSpeed, so only following the object finds it.

:func:`handoff` follows the object by dataflow, not by names: through arguments (positional, keyword, ``**kwargs``),
attributes a class stores it in (``self.x = optimizer``), local names, and containers that carry it (a dict literal
``{"optimizer": opt}``, a config object ``Config(optim=opt)``, a dict built by ``dict(optimizer=opt)``), which the
callee reads back as ``cfg.optim`` / ``cfg["optimizer"]`` / ``cfg.get("optimizer")``. Callees are resolved through the
repository's imports (:mod:`npufuse.scan.repo_symbols`): functions, classes (their ``__init__``), methods of an
object the same code built (``t = Trainer(...); t.train(optimizer=opt)``) and ``self.<method>`` calls, a few levels
deep. The object reaching a wrapper outside the repository (:data:`WRAPPERS`) is the answer, with the chain of hops
and the condition the last call sits under (a run-time choice inside the callee that the construction site cannot
test: the candidate would be wrong for every run that takes it, so it is refused, and the reason says so).

:func:`freed_after_handoff` (s38) follows the object the same way to a different end: a callee that frees its grads
with ``zero_grad(set_to_none=<not False>)`` on it (vats-multimodal-lm's ``scripts/.../train.py`` gets the optimizer from
``setup_training_components`` and hands it to ``train(model, loader, optimizer, ...)`` of a third file, whose loop calls
``optimizer.zero_grad(set_to_none=True)``). torch_npu's fused classes raise ValueError on set_to_none=True (spec §10).
A bare ``zero_grad()`` on the optimizer is not this: the fused class's own default is set_to_none=False.
"""

from __future__ import annotations

import ast
from typing import Any, Iterable, Optional

from npufuse.scan.dataflow import dotted

# Callees outside the repository that wrap a client optimizer object and re-create its params or free its grads.
# (prefix of the dotted name, what it does to the optimizer)
WRAPPERS: tuple[tuple[str, str], ...] = (
    ("deepspeed.", "DeepSpeed wraps it: with fp16/bf16 or ZeRO the wrapped optimizer steps fp32 master copies whose "
                   "grads DeepSpeed assigns every step, and without them the engine's zero_grad sets every parameter's "
                   "grad to None"),
    ("apex.amp.initialize", "apex amp sets every parameter's grad to None before each backward and, with master "
                            "weights, steps fp32 copies"),
    ("apex.fp16_utils.", "apex's FP16_Optimizer steps fp32 master copies whose grads it assigns every step"),
    ("colossalai.", "ColossalAI wraps it in its mixed-precision / ZeRO optimizer (fp32 master copies, grads assigned "
                    "every step)"),
    ("megatron.core.optimizer.", "Megatron's mixed-precision optimizer steps fp32 main params whose grads it assigns "
                                 "every step"),
)

# marks a chain whose last call sits under a condition (stripped from the text)
_WHEN = "\x00when:"
_MAX_DEPTH = 4  # callees followed from the construction site
_MAX_VISITS = 64  # (file, function) bodies read for one question


def _path(e: Optional[ast.AST]) -> Optional[str]:
    """``a.b`` for names and attribute chains; ``a["k"]`` and ``a.get("k")`` read as ``a.k`` (a container read back)."""
    if isinstance(e, (ast.Name, ast.Attribute)):
        d = dotted(e)
        if d is not None:
            return d
        if isinstance(e, ast.Attribute):
            inner = _path(e.value)
            return f"{inner}.{e.attr}" if inner else None
        return None
    if isinstance(e, ast.Subscript) and isinstance(e.slice, ast.Constant) and isinstance(e.slice.value, str):
        inner = _path(e.value)
        return f"{inner}.{e.slice.value}" if inner else None
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "get" and e.args \
            and isinstance(e.args[0], ast.Constant) and isinstance(e.args[0].value, str):
        inner = _path(e.func.value)
        return f"{inner}.{e.args[0].value}" if inner else None
    return None


def _carried(e: ast.AST, aliases: set[str]) -> Optional[str]:
    """How ``e`` carries the optimizer: "" (it is the optimizer), ".k..." (the optimizer sits at that key or
    attribute inside it), or None (it does not)."""
    p = _path(e)
    if p is not None:
        if p in aliases:
            return ""
        inside = sorted(a[len(p):] for a in aliases if a.startswith(p + "."))
        return inside[0] if inside else None
    if isinstance(e, ast.Dict):
        for k, v in zip(e.keys, e.values):
            if isinstance(k, ast.Constant) and isinstance(k.value, str) and v is not None:
                s = _carried(v, aliases)
                if s is not None:
                    return f".{k.value}{s}"
    if isinstance(e, ast.Call):
        # a container or config object built around it: `dict(optimizer=opt)`, `TrainConfig(optim=opt)`
        for k in e.keywords:
            s = _carried(k.value, aliases) if k.arg else None
            if s is not None:
                return f".{k.arg}{s}"
    return None


def _own_nodes(fn: ast.AST) -> Iterable[ast.AST]:
    """The nodes of a function body, not those of nested functions or classes (other scopes)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        n = stack.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(n))


def _bind_aliases(nodes: list[ast.AST], aliases: set[str]) -> None:
    """Names and attributes assigned something that carries the optimizer (``self.opt = optimizer``, ``cfg =
    {"optimizer": opt}``, ``opt2 = cfg.optimizer``) join ``aliases`` (in place; a fixpoint over the nodes)."""
    assigns = [n for n in nodes if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None]
    for _ in range(3):
        before = len(aliases)
        for n in assigns:
            s = _carried(n.value, aliases)  # type: ignore[arg-type]
            if s is None:
                continue
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                tp = _path(t)
                if tp is not None:
                    aliases.add(tp + s)
        if len(aliases) == before:
            return


def _params(fn: ast.AST, method: bool) -> tuple[list[str], set[str], Optional[str]]:
    a = fn.args  # type: ignore[attr-defined]
    pos = [x.arg for x in (*a.posonlyargs, *a.args)]
    if method and pos[:1] in (["self"], ["cls"]):
        pos = pos[1:]
    return pos, {x.arg for x in a.kwonlyargs}, (a.kwarg.arg if a.kwarg else None)


def _received(fn: ast.AST, call: ast.Call, aliases: set[str], method: bool) -> set[str]:
    """The callee's own paths that hold the optimizer the call hands it."""
    pos, kwonly, kwargs = _params(fn, method)
    out: set[str] = set()
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred):
            break
        s = _carried(arg, aliases)
        if s is not None and i < len(pos):
            out.add(pos[i] + s)
    for k in call.keywords:
        s = _carried(k.value, aliases) if k.arg else None
        if s is None:
            continue
        if k.arg in pos or k.arg in kwonly:
            out.add(k.arg + s)  # type: ignore[operator]
        elif kwargs:
            out.add(f"{kwargs}.{k.arg}{s}")
    return out


def _condition(fn: ast.AST, call: ast.Call) -> Optional[str]:
    """The test of the innermost ``if`` of ``fn`` whose branch holds ``call`` (with the arm), else None."""
    best: Optional[tuple[int, str]] = None
    for n in _own_nodes(fn):
        if isinstance(n, ast.If):
            for arm, body in (("true", n.body), ("false", n.orelse)):
                if body and body[0].lineno <= call.lineno <= (body[-1].end_lineno or body[-1].lineno):
                    if best is None or n.lineno > best[0]:
                        best = (n.lineno, f"`{' '.join(ast.unparse(n.test).split())[:80]}` is {arm}")
    return best[1] if best else None


def _innermost_if(fn: ast.AST, call: ast.Call) -> Optional[tuple[ast.If, bool]]:
    best: Optional[tuple[ast.If, bool]] = None
    for n in _own_nodes(fn):
        if isinstance(n, ast.If):
            for arm, body in ((True, n.body), (False, n.orelse)):
                if body and body[0].lineno <= call.lineno <= (body[-1].end_lineno or body[-1].lineno):
                    if best is None or n.lineno > best[0].lineno:
                        best = (n, arm)
    return best


def _freeing_zero_grad(rel: str, fn: ast.AST, call: ast.Call, aliases: set[str]) -> Optional[str]:
    """The hop text of ``O.zero_grad(set_to_none=<not provably False>)`` on the optimizer itself (``O`` holds it
    whole), with the condition it sits under (marked), else None. ``zero_grad()`` without the argument is the
    optimizer's own default (False on torch_npu's fused classes): not this."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "zero_grad") or _carried(func.value, aliases) != "":
        return None
    flag = next((k.value for k in call.keywords if k.arg == "set_to_none"), call.args[0] if call.args else None)
    if flag is None or (isinstance(flag, ast.Constant) and not flag.value):
        return None
    given = "True" if isinstance(flag, ast.Constant) else " ".join(ast.unparse(flag).split())[:60]
    cond = _condition(fn, call)
    return f"{_WHEN if cond else ''}`{ast.unparse(func)}(set_to_none={given})` ({rel}:{call.lineno}{', when ' + cond if cond else ''})"


class _Follow:
    """One question: does the optimizer, held by ``aliases`` in a function of ``rel``, reach a wrapper?"""

    def __init__(self, symbols: Any, frees: bool = False) -> None:
        self.symbols = symbols
        # s38: the end looked for is a callee's freeing zero_grad on the object (else: a wrapper of WRAPPERS)
        self.frees = frees
        # s38: calls handed the whole optimizer whose callee the scan cannot resolve (an object of unknown class):
        # (the call as written, its file, its line, the name of the function called, the call, the caller's aliases)
        self.unresolved: list[tuple[str, str, int, str, ast.Call, frozenset[str]]] = []
        self.visits = 0
        self.seen: set[tuple[str, str, frozenset[str]]] = set()
        # hop text of a wrapper call -> (the innermost `if` holding it, the call in its true arm?)
        self.terminal_if: dict[str, tuple[ast.If, bool]] = {}

    def method(self, file: str, cls: ast.ClassDef, name: str, depth: int = 0) -> Optional[tuple[str, ast.ClassDef, ast.AST]]:
        """(file, class, def) of ``cls.name``, looked up through the repository bases."""
        for n in cls.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
                return file, cls, n
        if depth >= 3:
            return None
        for b in cls.bases:
            sym = self.symbols.resolve_node(file, b)
            if sym.kind == "class" and isinstance(sym.node, ast.ClassDef):
                got = self.method(sym.file, sym.node, name, depth + 1)
                if got is not None:
                    return got
        return None

    def body(self, rel: str, fn: ast.AST, nodes: list[ast.AST], aliases: set[str], cls: Optional[ast.ClassDef],
             after: int, depth: int) -> Optional[list[str]]:
        """The hops from the calls in ``nodes`` (at or after line ``after``) to a wrapper, else None."""
        aliases = set(aliases)
        _bind_aliases(nodes, aliases)
        local_objects: dict[str, ast.expr] = {}  # `trainer = Trainer(...)`: its methods are the class's
        for n in nodes:
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) \
                    and isinstance(n.value, ast.Call):
                local_objects[n.targets[0].id] = n.value.func
        calls = sorted((n for n in nodes if isinstance(n, ast.Call) and n.lineno >= after), key=lambda c: (c.lineno, c.col_offset))
        first: Optional[list[str]] = None
        for call in calls:
            # the body the question starts in is the caller's own code, judged where it is read (in-file facts)
            hop = _freeing_zero_grad(rel, fn, call, aliases) if self.frees and depth > 0 else None
            if hop is not None:
                if not hop.startswith(_WHEN):
                    return [hop]
                first = first or [hop]
                continue
            args = [*call.args, *(k.value for k in call.keywords)]
            if not any(_carried(a, aliases) is not None for a in args):
                continue
            got = self.call(rel, fn, call, aliases, cls, local_objects, depth)
            if got is not None and not got[-1].startswith(_WHEN):
                return got  # a hand-off under no condition names the path every run takes
            first = first or got
        return first

    def call(self, rel: str, fn: ast.AST, call: ast.Call, aliases: set[str], cls: Optional[ast.ClassDef],
             local_objects: dict[str, ast.expr], depth: int) -> Optional[list[str]]:
        func = call.func
        if not isinstance(func, (ast.Name, ast.Attribute)):
            return None
        shown = ast.unparse(func)
        scope = fn if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) else None  # its own imports first
        sym = self.symbols.resolve_node(rel, func, scope)
        if sym.kind == "external" and self.frees:
            return None
        if sym.kind == "external":
            whole = any(_carried(a, aliases) == "" for a in [*call.args, *(k.value for k in call.keywords)])
            for prefix, what in WRAPPERS:
                if whole and (sym.target + ".").startswith(prefix):
                    cond = _condition(fn, call)
                    hop = f"{_WHEN if cond else ''}`{shown}` = {sym.target} ({rel}:{call.lineno}{', when ' + cond if cond else ''}): {what}"
                    holder = _innermost_if(fn, call)
                    if holder is not None:
                        self.terminal_if[hop] = holder
                    return [hop]
            return None
        if depth >= _MAX_DEPTH:
            return None
        target: Optional[tuple[str, Optional[ast.ClassDef], ast.AST]] = None
        if sym.kind == "class" and isinstance(sym.node, ast.ClassDef):
            target = self.method(sym.file, sym.node, "__init__")
        elif sym.kind == "function" and isinstance(sym.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            owner: Optional[ast.ClassDef] = None
            if "." in sym.qualname:  # `Cls.method` through the class: the first parameter is the object
                tree, _ = self.symbols.tree(sym.file)
                top = next((c for c in (tree.body if tree else []) if isinstance(c, ast.ClassDef)
                            and c.name == sym.qualname.split(".")[0]), None)
                owner = top
            target = (sym.file, owner, sym.node)
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            recv = func.value.id
            if recv == "self" and cls is not None:
                target = self.method(rel, cls, func.attr)
            elif recv in local_objects:
                made = self.symbols.resolve_node(rel, local_objects[recv])
                if made.kind == "class" and isinstance(made.node, ast.ClassDef):
                    target = self.method(made.file, made.node, func.attr)
        if target is None:
            if self.frees and sym.kind == "unresolved" and any(_carried(a, aliases) == "" for a in [*call.args, *(k.value for k in call.keywords)]):
                self.unresolved.append((shown, rel, call.lineno, func.attr if isinstance(func, ast.Attribute) else func.id, call,
                                        frozenset(aliases)))
            return None
        file, owner, callee = target
        method = owner is not None and not any(isinstance(d, ast.Name) and d.id == "staticmethod"
                                               for d in getattr(callee, "decorator_list", []))
        received = _received(callee, call, aliases, method)
        if not received:
            return None
        rest = self.enter(file, owner, callee, received, depth + 1)
        if rest is None:
            return None
        hop = f"`{shown}` ({rel}:{call.lineno}, defined at {file}:{callee.lineno}) takes it as `{min(received, key=len)}`"  # type: ignore[attr-defined]
        return [(_WHEN if rest[-1].startswith(_WHEN) else "") + hop, *[r[len(_WHEN):] if r.startswith(_WHEN) else r for r in rest]]

    def enter(self, file: str, owner: Optional[ast.ClassDef], callee: ast.AST, received: set[str], depth: int) -> Optional[list[str]]:
        key = (file, f"{owner.name if owner else ''}.{callee.name}", frozenset(received))  # type: ignore[attr-defined]
        if key in self.seen or self.visits >= _MAX_VISITS:
            return None
        self.seen.add(key)
        self.visits += 1
        own = list(_own_nodes(callee))
        if owner is None:
            return self.body(file, callee, own, received, None, 0, depth)
        # a method: what it stores on `self` is read by every method of the class (and its repository bases)
        held = set(received)
        _bind_aliases(own, held)
        stored = {a for a in held if a.startswith("self.")}
        methods = [n for n in owner.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for m in methods:
            _bind_aliases(list(_own_nodes(m)), stored)
        got = self.body(file, callee, own, held | stored, owner, 0, depth)
        if got is not None or not stored:
            return got
        for m in methods:
            if m is callee:
                continue
            self.visits += 1
            got = self.body(file, m, list(_own_nodes(m)), stored, owner, 0, depth)
            if got is not None:
                return got
        return None


def handoff(symbols: Any, rel: str, fn: ast.AST, nodes: list[ast.AST], names: set[str], after: int,
            cls: Optional[ast.ClassDef] = None) -> Optional[str]:
    """Why the optimizer bound to ``names`` in ``nodes`` (the statements of ``fn`` in file ``rel``; calls from line
    ``after`` on) is wrapped by DeepSpeed / apex / ColossalAI through the repository's code, else None. The text
    names each hop with its file and line."""
    got = handoff_at(symbols, rel, fn, nodes, names, after, cls)
    return got[0] if got is not None else None


def handoff_at(symbols: Any, rel: str, fn: ast.AST, nodes: list[ast.AST], names: set[str], after: int,
               cls: Optional[ast.ClassDef] = None) -> Optional[tuple[str, Optional[tuple[ast.If, bool]]]]:
    """:func:`handoff`'s text, and, when the wrapper is called in ``fn`` itself (no callee between), the innermost
    ``if`` holding that call with the arm (True: its body): a test the construction site may evaluate itself."""
    if not names or symbols is None:
        return None
    follow = _Follow(symbols)
    try:
        hops = follow.body(rel, fn, nodes, set(names), cls, after, 0)
    except (RecursionError, ValueError, AttributeError):
        return None
    if not hops:
        return None
    local = follow.terminal_if.get(hops[0]) if len(hops) == 1 else None
    return " -> ".join(h[len(_WHEN):] if h.startswith(_WHEN) else h for h in hops), local


def freed_after_handoff(symbols: Any, rel: str, fn: ast.AST, nodes: list[ast.AST], names: set[str], after: int,
                        cls: Optional[ast.ClassDef] = None) -> Optional[str]:
    """Where the optimizer bound to ``names`` in ``nodes`` (as :func:`handoff`) has its grads freed by a callee of the
    repository that it is handed to (``zero_grad(set_to_none=True)`` or a flag there), else None. The text names each
    hop with its file and line, the last one the zero_grad call (and the condition it sits under)."""
    if not names or symbols is None:
        return None
    follow = _Follow(symbols, frees=True)
    try:
        hops = follow.body(rel, fn, nodes, set(names), cls, after, 0)
        if not hops and follow.unresolved:
            hops = _freed_by_name(symbols, follow)
    except (RecursionError, ValueError, AttributeError):
        return None
    if not hops:
        return None
    return " -> ".join(h[len(_WHEN):] if h.startswith(_WHEN) else h for h in hops)


_MAX_NAME_FILES = 2000  # files read for the functions of one name (the unresolved hand-off below)


def _freed_by_name(symbols: Any, follow: _Follow) -> Optional[list[str]]:
    """An optimizer handed to a call the scan cannot resolve (``trainer.fit(opt)`` where ``trainer`` is of a class
    it cannot tell): the repository's functions and methods of that name that would free its grads if they are
    the callee (the argument's parameter by position or keyword, then as :func:`freed_after_handoff` follows it).
    The hops say the callee was matched by name only."""
    from npufuse.scan.repo_facts import _repo_text

    wanted = {u[3] for u in follow.unresolved}
    follow.visits = 0  # a fresh budget of bodies for the functions of those names
    for rel in symbols.files[:_MAX_NAME_FILES]:
        text = _repo_text(symbols.root, rel) or ""
        if "zero_grad(" not in text or not any(f"def {a}(" in text for a in wanted):
            continue
        tree, _why = symbols.tree(rel)
        for owner, fn in _defs(tree):
            for shown, where, line, attr, call, aliases in follow.unresolved:
                if fn.name != attr:
                    continue
                received = _received(fn, call, set(aliases), owner is not None)
                rest = follow.enter(rel, owner, fn, received, 1) if received else None
                if rest is not None:
                    hop = (f"`{shown}` ({where}:{line}, a call the scan cannot resolve; the repository's "
                           f"`{(owner.name + '.') if owner else ''}{fn.name}` at {rel}:{fn.lineno} would take it as "
                           f"`{min(received, key=len)}`)")
                    return [hop, *rest]
    return None


def _defs(tree: Optional[ast.Module]) -> Iterable[tuple[Optional[ast.ClassDef], ast.AST]]:
    """Module-level functions and the methods of module-level classes."""
    for n in tree.body if tree is not None else ():
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield None, n
        elif isinstance(n, ast.ClassDef):
            for m in n.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield n, m
