"""What a pattern is, and what it hands to the rest of npufuse.

A pattern is one class in one file of this package (``patterns/<id>.py``), in the Fixit style:
it carries its own ``FUSE`` and ``KEEP`` examples, which are its tests. It

* detects sites in a parsed module (``detect``), returning :class:`Finding` for replaceable
  sites and :class:`NearMiss` (with the blocking reason) for look-alikes — never a silent skip;
* writes the fused-branch statements for a finding (``Finding.fused``): real code using the
  ``torch_npu`` name, producing exactly the original statements' live-out values (same names,
  same dtype and shape, or the same ``return``). The guard, the switch and the verbatim original
  fallback are added around it by :mod:`npufuse.rewrite.codegen` — the single generator used by
  both the stage-1 report and ``npufuse apply``;
* provides an eager ``reference`` (ground truth shared by the op check and the benchmarks).

Adding a fusion is one file here: the registry (``npufuse.patterns.registry``) finds every
``Pattern`` subclass, and the tests parametrize over it.
"""

from __future__ import annotations

import ast
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Union

if TYPE_CHECKING:
    from npufuse.scan.dataflow import ModuleInfo, Scope


@dataclass
class Risk:
    """A reason the replacement may misbehave or disappoint; shown per candidate in the report."""

    kind: str  # dynamic_shape | non_contiguous | dtype | autocast | inference_only | host_sync | layout | numerics | other
    detail: str


@dataclass
class Finding:
    """A replaceable site. Spans are 1-based inclusive lines of whole statements in one block."""

    pattern: str
    qualname: str  # innermost function holding the computation ("<module>" at top level)
    line: int
    end_line: int
    params: dict[str, Any]  # what the replacement needs (eps, weight, offset, upcast, order, ...)
    fused: str  # fused-branch statements, dedented, without guard or marker
    guard_tensor: str  # expression of a tensor live at the span start; fused only if it is on NPU
    confidence: str = "high"  # high | medium | low
    variant: str = ""  # short name of the matched spelling, e.g. "hf_llama", "t5", "one_plus_weight"
    risks: list[Risk] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # facts for the report (e.g. "activation chosen by config")
    training_ok: bool = True  # False when the fused API has no backward

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class NearMiss:
    """A look-alike that must not be replaced as-is, with the reason."""

    pattern: str
    qualname: str
    line: int
    end_line: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


Result = Union[Finding, NearMiss]


@dataclass(frozen=True)
class Fuse:
    """An example that must be found.

    ``expect`` is a subset of the finding's ``params`` (plus optionally ``variant``/``qualname``).
    ``run`` (optional) is Python executed in the module's namespace after ``torch.manual_seed(0)``:
    it must set ``out`` (a tensor or tuple of tensors) and may set ``leaves`` (tensors whose grads
    are compared after ``out.sum().backward()``). The test harness runs it on the original module
    and on the rewritten module under the emulator (switch on), and compares outputs, dtypes and
    gradients, and that the fused API was called.
    """

    code: str
    expect: dict[str, Any] = field(default_factory=dict)
    run: str = ""
    name: str = ""


@dataclass(frozen=True)
class Keep:
    """A near miss: must produce no Finding for this pattern, and a NearMiss whose reason contains
    ``reason`` (case-insensitive) — or, with ``reason=""``, nothing at all (plainly unrelated code)."""

    code: str
    reason: str = ""
    name: str = ""


class Pattern:
    """Base class of a fusion pattern. Subclasses set the class attributes and implement detect."""

    id: ClassVar[str]
    api: ClassVar[str]  # e.g. "torch_npu.npu_rms_norm"
    title: ClassVar[str]
    #: the fused API has a backward (training-safe); False = inference only
    training_ok: ClassVar[bool] = True
    #: memory | compute | launch — the usual bound of the unfused code (refined by assess)
    bound: ClassVar[str] = "memory"
    FUSE: ClassVar[list[Fuse]] = []
    KEEP: ClassVar[list[Keep]] = []
    #: Words the scan looks for before it calls ``detect`` on a scope: where the scope's own text
    #: (``engine.gate_text``: a function's whole lines, the whole file for ``<module>``) holds
    #: none of them, nor the name of an import alias whose target holds one, ``detect`` is not
    #: called there (the detector's own text gate, done once by the scan instead of by each
    #: detector on each of the ~20 scopes of a typical file). None: every scope. Declare it only
    #: where ``detect`` yields nothing at all (no finding, no near miss) for such a scope, helpers
    #: it follows included (a helper named in the scope need not hold the word: then the words
    #: cannot be static). Derive the words from the detector's own first text test where it has
    #: one. tests/test_scan_speed_paths.py checks the declaration on every example and sample file
    #: and that every FUSE/KEEP example gives the same findings and reasons with gates on and off.
    #: Words are ASCII; text outside ASCII is NFKD-decomposed first (identifiers are read in NFKC).
    #: The word ``"*"`` means a product (s40, ``engine.multiplies``): a star that can be an operator
    #: or any ``mul`` spelling; a scope whose only stars unpack (``**kwargs``) does not hold it.
    #: Declare it only where every result hangs on a product; a form that multiplies by another
    #: spelling (``einsum``, ``torch.prod``) needs its own word.
    SCOPE_WORDS: ClassVar[tuple[str, ...] | None] = None
    #: Ids of patterns whose detector reads the same sites and decides which of them reports each
    #: (swiglu / geglu: one gated product, owned by the activation's default, may dispatch to both
    #: at run time). A scan that chooses this pattern runs those too and then keeps what they report
    #: for the chosen ids (engine.select_patterns), so ``--only`` never changes a chosen pattern's result.
    SHARES_SITES_WITH: ClassVar[tuple[str, ...]] = ()

    def detect(self, module: "ModuleInfo", scope: "Scope") -> Iterable[Result]:
        """Yield findings and near misses inside ``scope`` (one function body or the module body)."""
        raise NotImplementedError

    def with_scan_options(self, options: Any) -> "Pattern":
        """The detector for a scan with ``options`` (npufuse.scan.engine.ScanOptions): itself, or a
        configured copy where an option changes what it reports (the copy's attributes are part of
        the cache's fingerprint). Never mutates the registry's shared instance."""
        return self

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "detect" in cls.__dict__:
            cls.detect = _outside_compiled_code(cls.__dict__["detect"])  # type: ignore[method-assign]

    def assess(self, finding: Finding, config: dict[str, Any]) -> dict[str, Any]:
        """Value estimate: ``{"bound": ..., "estimate": "...", ...}``; ``config`` holds shapes read
        from the repo's config (hidden_size, num_attention_heads, ...), possibly empty."""
        return {"bound": self.bound, "estimate": "no estimate for this pattern yet"}

    @staticmethod
    def reference(*args: Any, **kwargs: Any) -> Any:
        """Eager ground truth of what the matched code computes (used by op checks and benches)."""
        raise NotImplementedError


_COMPILED: tuple[Any, Any] | None = None


def _load_compiled() -> tuple[Any, Any]:
    """(compiled_reason, may_compile), imported on first use (_compiled imports the scan package)."""
    global _COMPILED
    from npufuse.patterns._compiled import compiled_reason, may_compile

    _COMPILED = (compiled_reason, may_compile)
    return _COMPILED


def _outside_compiled_code(detect: Any) -> Any:
    """Every pattern's ``detect``, with findings in TorchScript-compiled code turned into near
    misses (:mod:`npufuse.patterns._compiled`): one rule for all patterns, applied where each
    detector's results come out, so the scan and the examples' tests see the same thing."""
    import functools

    @functools.wraps(detect)
    def wrapped(self: Pattern, module: "ModuleInfo", scope: "Scope") -> Iterable[Result]:
        # (an import statement here would run on each of the scan's ~20 calls per scope)
        compiled_reason, may_compile = _COMPILED or _load_compiled()
        # the text test is made once per module (detect runs for every scope of every pattern);
        # the scope is looked up only once it has a finding (most scopes have none)
        has_jit = module.__dict__.get("_npufuse_has_jit")
        if has_jit is None:
            has_jit = module.__dict__["_npufuse_has_jit"] = may_compile(module.source)
        reason: str | None = None
        looked = not has_jit
        lifted = False  # the scope is a scripted function rewritten as a whole from <module>
        for r in detect(self, module, scope):
            if isinstance(r, Finding):
                if not looked:
                    reason, looked = compiled_reason(module, scope), True
                    if reason is not None:
                        lifted = _lift_refusal(module, scope.qualname) is None
                if lifted:
                    continue  # yielded by the <module> scope, as a module-level rewrite
                if reason is not None:
                    why = _lift_refusal(module, scope.qualname) if "." not in scope.qualname else None
                    yield NearMiss(r.pattern, r.qualname, r.line, r.end_line, reason + (f" (npufuse rewrites a scripted function as a whole only when it can: here {why})" if why else ""))
                    continue
                opaque = _imported_decorators(module, scope)
                if opaque:
                    r.risks.append(Risk("other", f"`{scope.qualname}` is decorated with {', '.join(f'`@{d}`' for d in opaque)} from another "
                                        "module: if that compiles it with TorchScript (Megatron's `jit_fuser` is torch.jit.script "
                                        "before torch 2.2), the fused branch does not compile and the module fails to import"))
                twice = _called_more_often(module, r)
                if twice is not None:
                    what = ("a method of the class evaluated again: double the work, and a different result where it draws "
                            "random numbers or changes state") if _is_class_method_call(module, r.qualname, twice) else \
                        "a module call evaluated twice: double the work, and a different result with dropout"
                    yield NearMiss(r.pattern, r.qualname, r.line, r.end_line,
                                   f"the replacement would call `{twice}` more often than the original code does ({what})")
                    continue
                dead = _contradicted_guard(scope, r) or _unreachable(scope, r)
                if dead is not None:
                    yield NearMiss(r.pattern, r.qualname, r.line, r.end_line, dead)
                    continue
            yield r
        if has_jit and scope.qualname == "<module>":
            yield from _lifted_sites(self, detect, module)

    return wrapped


# decorators whose effect is known: they do not compile the function with TorchScript
_KNOWN_DECORATORS = ("torch.", "functools.", "typing.", "contextlib.", "abc.", "dataclasses.", "staticmethod", "classmethod",
                     "property", "override", "lru_cache", "cache", "wraps")


def _imported_decorators(module: "ModuleInfo", scope: "Scope") -> list[str]:
    """Decorators of ``scope``'s function imported from another (non-torch) module: what they do
    to the function is not visible here."""
    out = []
    for d in getattr(scope.node, "decorator_list", ()):
        target = d.func if isinstance(d, ast.Call) else d
        name = module.canonical(target) or ""
        head = name.split(".")[0]
        local = getattr(target, "id", None) or (getattr(target, "value", None) and getattr(target.value, "id", None))  # type: ignore[union-attr]
        if not name or name.startswith(_KNOWN_DECORATORS) or name in _KNOWN_DECORATORS:
            continue
        if isinstance(local, str) and local in module.aliases and "." in module.aliases[local] and head not in ("torch",):
            out.append(ast.unparse(target))
    return out


def _contradicted_guard(scope: "Scope", finding: Finding) -> str | None:
    from npufuse.patterns._guard_arms import contradicted_guard

    return contradicted_guard(scope, finding)


def _unreachable(scope: "Scope", finding: Finding) -> str | None:
    from npufuse.patterns._guard_arms import unreachable_site

    return unreachable_site(scope, finding)


def _lift_refusal(module: "ModuleInfo", qualname: str) -> str | None:
    from npufuse.patterns._compiled import lift_refusal

    return lift_refusal(module, qualname)


def _lifted_sites(pattern: Pattern, detect: Any, module: "ModuleInfo") -> Iterable[Result]:
    """The findings of ``detect`` inside each ``@torch.jit.script`` function of ``module`` that can be
    rewritten as a whole (:mod:`npufuse.patterns._compiled`), as one module-level finding per
    function; a near miss saying why where the wrapper cannot be written."""
    from npufuse.patterns._compiled import _compiled, lifted_text

    functions, _classes = _compiled(module)
    for scope in module.scopes:
        if scope.qualname not in functions or "." in scope.qualname or _lift_refusal(module, scope.qualname) is not None:
            continue
        found = [r for r in detect(pattern, module, scope) if isinstance(r, Finding) and _called_more_often(module, r) is None]
        if not found:
            continue
        first = found[0]
        fn = scope.node
        text = lifted_text(module, scope.qualname, [(f.line, f.end_line, f.fused) for f in found], first.guard_tensor)
        if text is None:
            for f in found:
                yield NearMiss(f.pattern, f.qualname, f.line, f.end_line,
                               f"TorchScript compiles `{scope.qualname}` at import, and npufuse cannot write its Python wrapper "
                               f"(the fused site's guard tensor `{first.guard_tensor}` is not a parameter left unchanged, or the "
                               "fused code does not fit the wrapper); rewrite by hand outside the scripted code")
            continue
        risks = [x for f in found for x in f.risks]
        risks.append(Risk("other", f"`{scope.qualname}` is @torch.jit.script: with torch_npu importable it becomes a Python "
                                   f"function that calls the scripted original (`_npufuse_scripted_{scope.qualname}`) off the NPU; "
                                   "code elsewhere that passes it to torch.jit.script or calls it from scripted code would now "
                                   "compile the Python wrapper"))
        notes = [n for f in found for n in f.notes]
        notes.append(f"rewritten at module level: the scripted original stays compiled as the fallback, the fused "
                     f"statements run in a Python wrapper named `{scope.qualname}` (lines {', '.join(f'{f.line}-{f.end_line}' for f in found)})")
        params = dict(first.params)
        params["lifted_from"] = scope.qualname
        yield Finding(first.pattern, "<module>", fn.lineno, fn.end_lineno or fn.lineno, params, text, first.guard_tensor,
                      confidence=first.confidence, variant=first.variant, risks=risks, notes=notes,
                      training_ok=all(f.training_ok for f in found))


def _module_calls(stmts: list[ast.stmt], chains: frozenset[str] | None = None) -> dict[str, int]:
    """How often each ``self.<...>(...)`` call runs on the costliest path through ``stmts``
    (an ``if``/``else`` counts its busier branch: one of them runs). ``chains``: count only the
    calls whose callee is one of these ``self.a.b`` chains (the others are not unparsed)."""
    total: dict[str, int] = {}

    def add(counts: dict[str, int]) -> None:
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v

    for st in stmts:
        if isinstance(st, ast.If):
            add(_module_calls_in(st.test, chains))
            a, b = _module_calls(st.body, chains), _module_calls(st.orelse, chains)
            # the keys in the branches' order (a set union's order depends on the string hash
            # seed, and the first call found is the one a near miss names)
            add({k: max(a.get(k, 0), b.get(k, 0)) for k in (*a, *(k for k in b if k not in a))})
        else:
            add(_module_calls_in(st, chains))
    return total


def _self_chain(call: ast.AST) -> str | None:
    """``self.a.b`` for a call ``self.a.b(...)`` (attributes all the way down to ``self``), else None."""
    if type(call) is not ast.Call or not isinstance(call.func, ast.Attribute):  # type: ignore[attr-defined]
        return None
    parts = []
    base = call.func  # type: ignore[attr-defined]
    while isinstance(base, ast.Attribute):
        parts.append(base.attr)
        base = base.value
    if isinstance(base, ast.Name) and base.id == "self":
        return ".".join(["self", *reversed(parts)])
    return None


def _self_chains(stmts: list[ast.stmt]) -> set[str]:
    from npufuse.scan.dataflow import fast_walk

    return {c for st in stmts for n in fast_walk(st) if (c := _self_chain(n)) is not None}


def _module_calls_in(node: ast.AST, chains: frozenset[str] | None = None) -> dict[str, int]:
    from npufuse.scan.dataflow import fast_walk

    out: dict[str, int] = {}
    arms = []  # s40: a conditional expression runs its test and one arm, as an if / else does
    for n in fast_walk(node):  # ast.walk's nodes in its order (the first call found is reported)
        if type(n) is ast.IfExp:
            arms.append(n)
        chain = _self_chain(n)
        if chain is not None and (chains is None or chain in chains):
            key = ast.unparse(n)
            out[key] = out.get(key, 0) + 1
    if not arms or not out:
        return out
    inner = {id(x) for n in arms for arm in (n.body, n.orelse) for x in fast_walk(arm) if type(x) is ast.IfExp}
    for n in arms:
        if id(n) in inner:
            continue  # counted within the arm that holds it
        a, b = _module_calls_in(n.body, chains), _module_calls_in(n.orelse, chains)
        for k in a.keys() | b.keys():  # both arms were counted by the walk above: one of them runs
            out[k] -= _raw_calls(n.body, k) + _raw_calls(n.orelse, k) - max(a.get(k, 0), b.get(k, 0))
    return out


def _raw_calls(node: ast.AST, key: str) -> int:
    """How many calls unparsed ``key`` the expression holds, whichever arms run."""
    from npufuse.scan.dataflow import fast_walk

    return sum(1 for n in fast_walk(node) if type(n) is ast.Call and _self_chain(n) is not None and ast.unparse(n) == key)


# fused code -> its parsed statements (None: it does not parse); detectors often yield the
# same fused text many times over (one helper called from several scopes), and the tree is
# only read here
_PARSED_CODE: dict[str, list[ast.stmt] | None] = {}


def parsed_code(code: str) -> list[ast.stmt] | None:
    """``ast.parse(code).body`` (None where it raises SyntaxError/ValueError), cached per text in
    this process. Callers only read the statements (they are shared)."""
    body = _PARSED_CODE.get(code, False)
    if body is False:
        try:
            body = ast.parse(code).body
        except (SyntaxError, ValueError):
            body = None
        if len(_PARSED_CODE) > 4096:
            _PARSED_CODE.clear()
        _PARSED_CODE[code] = body
    return body  # type: ignore[return-value]


def _is_class_method_call(module: "ModuleInfo", qualname: str, call_text: str) -> bool:
    """``call_text`` (``self.<m>(...)``) calls a method ``m`` defined in the class of the site's function (s40: the
    reason spoke of a module with dropout for gemma3's mask-building method)."""
    cls = module.classes.get(qualname.rpartition(".")[0]) if "." in qualname else None
    head = call_text.partition("(")[0]
    if cls is None or not head.startswith("self.") or head.count(".") != 1:
        return False
    return any(isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == head[5:] for fn in cls.body)


def _called_more_often(module: "ModuleInfo", f: Finding) -> str | None:
    """A ``self.<module>(...)`` call the fused branch makes more often than the original span."""
    if "self." not in f.fused:
        return None
    # only a call the original span makes too counts: without `self` there is none
    text = "".join(module.lines[f.line - 1 : f.end_line])
    if "self" not in text:
        return None
    # the answer depends on the two texts alone: copied code (transformers' "Copied from" modules)
    # yields the same span and fused text in many files, and each was parsed, walked and unparsed
    pure = _pure_methods(module, f.qualname)
    found = _more_often_cached(text, f.fused, pure)
    if found is not None and (reads := _shape_reads(module, f.qualname, found)):
        found = _more_often_cached(text, f.fused, pure | reads)  # s49: `self.<Parameter>.size(0)` is no module call
    return found


def _more_often_cached(text: str, fused: str, pure: frozenset[str]) -> str | None:
    key = (text, fused, pure)
    found = _MORE_OFTEN.get(key, False)
    if found is False:
        found = _called_more_often_in(text, fused, pure)
        if len(_MORE_OFTEN) > 4096:
            _MORE_OFTEN.clear()
        _MORE_OFTEN[key] = found
    return found  # type: ignore[return-value]


# (original span text, fused text, pure methods) -> _called_more_often_in's answer, in this process
_MORE_OFTEN: dict[tuple[str, str, frozenset[str]], str | None] = {}

# what a pure method may call: tensor views / shape reads, and a few builtins (anything else may be a module, a draw)
_PURE_TENSOR_METHODS = {"view", "reshape", "transpose", "permute", "contiguous", "flatten", "unflatten", "unsqueeze", "squeeze",
                        "size", "dim", "expand", "expand_as", "view_as", "reshape_as", "chunk", "split", "unbind", "movedim"}
_PURE_BUILTINS = {"len", "int", "tuple", "list", "range", "min", "max"}


def _shape_reads(module: "ModuleInfo", qualname: str, call_text: str) -> frozenset[str]:
    """s49: where ``call_text`` is ``self.<attr>.size(..)`` (dim / numel; s50: or a cast / view such as ``.to(..)``,
    ``.type_as(..)``) of a Parameter / buffer / tensor attribute of the site's class, every such chain of the class
    (calling them again has no effect); empty otherwise (looked at only once a repeated call is found)."""
    from npufuse.patterns._attention_s49w import _SHAPE_READS, tensor_shape_reads

    head = call_text.partition("(")[0]
    cls = module.classes.get(qualname.rpartition(".")[0]) if "." in qualname else None
    if cls is None or head.count(".") != 2 or not head.startswith("self.") or head.rpartition(".")[2] not in _SHAPE_READS:
        return frozenset()
    reads = tensor_shape_reads(module, cls)
    return frozenset(reads) if head in reads else frozenset()


def _pure_methods(module: "ModuleInfo", qualname: str) -> frozenset[str]:
    """``self.<m>`` chains of the site's class whose method ``m`` (defined in the class, undecorated) calls nothing on
    ``self``, stores nothing on ``self`` and draws nothing random (rtdl's ``_reshape``: views of its argument): calling
    it twice gives the same value, so the fused branch's extra call costs work, never a different result. (s34)"""
    from npufuse.patterns._attention_s47t import pure_torch_function
    from npufuse.scan.dataflow import dotted, fast_walk

    cls = module.classes.get(qualname.rpartition(".")[0]) if "." in qualname else None
    if cls is None:
        return frozenset()
    out = set()
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.decorator_list or fn.name.startswith("__"):
            continue
        impure = False
        for n in fast_walk(fn):
            if isinstance(n, ast.Call):
                f = n.func
                impure = not (isinstance(f, ast.Name) and f.id in _PURE_BUILTINS
                              or isinstance(f, ast.Attribute) and f.attr in _PURE_TENSOR_METHODS and (dotted(f) or "").partition(".")[0] != "self"
                              or pure_torch_function(f))  # s47: torch.einsum & co. (stateless, deterministic)
            elif isinstance(n, (ast.Attribute, ast.Subscript)) and isinstance(n.ctx, ast.Store):
                impure = True
            elif isinstance(n, (ast.Global, ast.Nonlocal, ast.Yield, ast.YieldFrom, ast.Await)):
                impure = True
            if impure:
                break
        if not impure:
            out.add(f"self.{fn.name}")
    return frozenset(out)


def _called_more_often_in(text: str, fused_text: str, pure: frozenset[str] = frozenset()) -> str | None:
    """:func:`_called_more_often` of an original span's text and the fused code; calls of ``pure`` chains do not count."""
    import textwrap

    original = parsed_code(textwrap.dedent(text))
    if original is None:
        return None
    fused = parsed_code(fused_text)
    if fused is None:
        return None
    # a call counts only where both make it: the same text has the same callee chain, so only
    # calls on a chain both hold are unparsed and counted (the rest would count 0 before)
    common = frozenset(_self_chains(original) & _self_chains(fused)) - pure
    if not common:
        return None
    before = _module_calls(original, common)
    for call, n in _module_calls(fused, common).items():
        if n > before.get(call, 0) and before.get(call, 0) > 0:
            return call
    return None


def node_span(node: ast.AST) -> tuple[int, int]:
    return node.lineno, getattr(node, "end_lineno", node.lineno) or node.lineno
