"""A softmax the repository writes itself, read as torch's (s33, HO9 CS336-style code).

Student and from-scratch LLM code (the CS336 assignment family, fairseq-derived TTS) calls a ``softmax`` of its
own: a function of this file or one imported from another file of the repository (``from .nn_utils import
softmax``; ``from fairseq import utils`` ... ``utils.softmax``), or a module built in ``__init__`` from a class of
the repository (``self.softmax = Softmax(i=-1)``). :func:`npufuse.scan.canonical.softmax_body` proves what the
body returns; this module binds that proof to the call: which argument is the input, which the axis (the call's
argument, the definition's default, or the module's constructor argument stored as ``self.<attr>``), and whether
the result is float32. Anything not proven is None: the caller then treats the call as it did before.
"""

from __future__ import annotations

import ast
from typing import Any, Optional

from npufuse.patterns import _attention_s47t
from npufuse.scan import canonical, repo_facts
from npufuse.scan.dataflow import called_outside_def, dotted, fast_walk

_MODULE_BASES = {"Module", "nn.Module", "torch.nn.Module"}


def is_parameter(scope: Any, name: str) -> bool:
    """``name`` is a parameter of ``scope``'s function (it shadows a module-level name of that spelling)."""
    fn = scope.node
    return isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and name in {
        a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg, fn.args.kwarg) if a is not None}


def _float32() -> ast.expr:
    return ast.Attribute(value=ast.Name("torch", ast.Load()), attr="float32", ctx=ast.Load())


def _bind(fn: ast.FunctionDef, call: Any, skip_self: bool) -> Optional[dict[str, Any]]:
    """{parameter: the call's argument, or the definition's default}; None when the call cannot be bound
    (starred arguments, a keyword the function does not take, more positional arguments than parameters)."""
    a = fn.args
    params = [p.arg for p in (*a.posonlyargs, *a.args)][1 if skip_self else 0:]
    if any(isinstance(x, ast.Starred) for x in call.args) or len(call.args) > len(params):
        return None
    bound: dict[str, Any] = dict(zip(params, call.args))
    kwonly = [p.arg for p in a.kwonlyargs]
    for k in call.keywords:
        if k.arg is None or k.arg in bound or k.arg not in params + kwonly:
            return None
        bound[k.arg] = k.value
    positional = [p.arg for p in (*a.posonlyargs, *a.args)]
    for p, d in zip(positional[len(positional) - len(a.defaults):], a.defaults):
        bound.setdefault(p, d)
    for p, d in zip(kwonly, a.kw_defaults):
        if d is not None:
            bound.setdefault(p, d)
    return bound


def _definition(matcher: Any, func: Any) -> Optional[repo_facts.Definition]:
    """The repository definition a callee names: ``softmax`` (a top-level def of this file or one imported by
    name) or ``utils.softmax`` (``from pkg import utils`` / ``import pkg.utils as utils``); None for a local,
    a parameter, or a name the repository does not define."""
    from npufuse.patterns.attention import Ref

    if isinstance(func, Ref):
        if func.idx != -1:
            return None
        name = func.name
    elif isinstance(func, ast.Name):
        name = func.id
    elif isinstance(func, ast.Attribute) and isinstance(func.value, (ast.Name, Ref)):
        head = func.value.id if isinstance(func.value, ast.Name) else func.value.name if func.value.idx == -1 else None
        if head is None or head == "self":
            return None
        name = f"{head}.{func.attr}"
    else:
        return None
    head = name.partition(".")[0]
    if is_parameter(matcher.scope, head) or matcher.scope.assignments.get(head) or (matcher.module.aliases.get(head) or "").startswith("torch"):
        return None
    d = repo_facts.definition(matcher.module, name)
    if d is None and "." in name:
        d = _s43_static_method(matcher, head, name.partition(".")[2])
    if d is None and "." in name:
        d = _module_attribute(matcher, head, name.partition(".")[2])
    return d


def _s43_static_method(matcher: Any, cls: str, attr: str) -> Optional[repo_facts.Definition]:
    """s43: ``Ops.softmax`` where ``Ops`` is a top-level class of this file and ``softmax`` its ``@staticmethod``
    (a CS336-style ``neural_operation.softmax(x, dim)``): the method's definition; None otherwise (an instance method
    called on the class would bind its first argument to ``self``)."""
    node = matcher.module.classes.get(cls)
    if node is None:
        return None
    for st in node.body:
        if isinstance(st, ast.FunctionDef) and st.name == attr:
            static = any(isinstance(dec, ast.Name) and dec.id == "staticmethod" for dec in st.decorator_list)
            return repo_facts.Definition(matcher.module.path, st, matcher.module.tree) if static else None
    return None


def _module_attribute(matcher: Any, head: str, attr: str) -> Optional[repo_facts.Definition]:
    """``from pkg import utils`` then ``utils.<attr>``: the top-level ``attr`` of the file ``pkg/utils.py``."""
    root = repo_facts.repo_root(matcher.module)
    if root is None or "." in attr:
        return None
    target = repo_facts._imported(matcher.module.tree, matcher.module.path, head)
    if target is None:
        return None
    mod = ".".join(p for p in target if p)
    try:
        return repo_facts._find(root, matcher.module.path, mod, attr, 0)
    except (Exception, RecursionError):
        return None


def repo_softmax(matcher: Any, node: Any) -> Optional[tuple[Any, Any, Any]]:
    """(input, dim node, dtype node) of a call of a repository softmax function, as ``softmax_of`` returns for
    torch's; None when ``node`` is not one (or what it computes is not proven)."""
    if not isinstance(node, ast.Call):
        return None
    d = _definition(matcher, node.func)
    if d is None or not isinstance(d.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    body = canonical.softmax_body(d.node, d.tree)
    if body is None:  # s47: a branch over an option the call leaves at a literal (``temperature=1.0``) read as dead
        body = _attention_s47t.specialised_softmax_body(d.node, d.tree, _bind(d.node, node, skip_self=False), matcher.module)
    if body is None:
        return None
    return _bound_softmax(d.node, body, node, skip_self=False)


def _bound_softmax(fn: ast.FunctionDef, body: Any, call: ast.Call, skip_self: bool) -> Optional[tuple[Any, Any, Any]]:
    """(input, dim node, dtype node) of ``call`` to ``fn``, whose body is the softmax ``body``: the call's arguments
    bound to the input and axis parameters (an axis given as a constant in the body is that constant); None where
    they cannot be bound or the axis is not a parameter or a constant."""
    bound = _bind(fn, call, skip_self=skip_self)
    if bound is None or body.input not in bound:
        return None
    if body.dim[0] == "param":
        dim = bound.get(body.dim[1])
    elif body.dim[0] == "const":
        dim = ast.Constant(body.dim[1])
    else:
        return None
    if dim is None:
        return None
    return bound[body.input], dim, _float32() if body.float32 else None


def self_method_softmax(matcher: Any, node: Any) -> Optional[tuple[Any, Any, Any]]:
    """s43: (input, dim node, dtype node) of ``self.softmax(x, dim)`` where ``softmax`` (any method whose name says
    softmax) is a method of the enclosing class, instance or ``@staticmethod``, whose body is a softmax over a
    parameter's or a constant axis (:func:`canonical.softmax_body`); None otherwise, and where anything in the class
    assigns ``self.<name>`` (an instance attribute would shadow the method)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and "softmax" in node.func.attr.lower()):
        return None
    cls = matcher.module.classes.get(matcher.scope.class_name or "")
    if cls is None:
        return None
    cache = matcher.module.__dict__.setdefault("_npufuse_s43_method_softmax", {})
    key = (id(cls), node.func.attr)
    if key not in cache or cache[key][0] is not cls:
        cache[key] = (cls, _class_softmax_method(cls, node.func.attr, matcher.module.tree))
    found = cache[key][1]
    if found is None:
        return None
    fn, body, static = found
    return _bound_softmax(fn, body, node, skip_self=not static)


def _class_softmax_method(cls: ast.ClassDef, name: str, tree: ast.Module) -> Optional[tuple[ast.FunctionDef, Any, bool]]:
    """(the method, its softmax body, whether static) of ``cls.<name>``, None where it is not a softmax or the class
    assigns ``self.<name>`` anywhere."""
    fn = next((st for st in cls.body if isinstance(st, ast.FunctionDef) and st.name == name), None)
    if fn is None:
        return None
    want = f"self.{name}"
    for n in fast_walk(cls):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
        if any(dotted(t) == want for t in targets):
            return None
    static = any(isinstance(dec, ast.Name) and dec.id == "staticmethod" for dec in fn.decorator_list)
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    if not static and (not params or params[0] != "self"):
        return None  # a classmethod or an unusual first parameter: not bound here
    body = canonical.softmax_body(fn, tree)
    return (fn, body, static) if body is not None else None


def repo_softmax_module(matcher: Any, node: Any, ctor: ast.Call) -> Optional[tuple[Any, Any, Any]]:
    """(input, dim node, dtype node) of ``self.<m>(x)`` where ``__init__`` built ``self.<m>`` from a class of the
    repository (a plain ``nn.Module`` with no ``__call__`` of its own) whose ``forward(self, x)`` returns a softmax
    of ``x`` over an axis stored from an ``__init__`` parameter (or a constant); None otherwise."""
    if len(node.args) != 1 or node.keywords or isinstance(node.args[0], ast.Starred):
        return None
    cache = matcher.module.__dict__.setdefault("_npufuse_s33_softmax_modules", {})
    key = id(ctor)
    if key not in cache or cache[key][0] is not ctor:
        cache[key] = (ctor, _module_softmax_axis(matcher, ctor))
    found = cache[key][1]
    return (node.args[0], found[0], found[1]) if found is not None else None


def _module_softmax_axis(matcher: Any, ctor: ast.Call) -> Optional[tuple[Any, Any]]:
    """(dim node, dtype node) of the softmax a repository module class built by ``ctor`` computes, else None."""
    cls_name = canonical.dotted(ctor.func)
    if cls_name is None:
        return None
    d = repo_facts.definition(matcher.module, cls_name)
    cls = d.node if d is not None else None
    if not isinstance(cls, ast.ClassDef) or cls.decorator_list or [canonical.dotted(b) for b in cls.bases] not in ([b] for b in _MODULE_BASES):
        return None
    methods = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    init, fwd = methods.get("__init__"), methods.get("forward")
    if init is None or fwd is None or "__call__" in methods or len(fwd.args.args) != 2:
        return None
    body = canonical.softmax_body(fwd, d.tree)
    if body is None or body.input != fwd.args.args[1].arg:
        return None
    if body.dim[0] == "const":
        dim: Any = ast.Constant(body.dim[1])
    elif body.dim[0] == "self":
        # the axis is ``self.<attr>``: stored once in the class, from an ``__init__`` parameter
        stores = [n for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                  and any(canonical.dotted(t) == f"self.{body.dim[1]}" for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
        if len(stores) != 1 or not isinstance(stores[0], ast.Assign) or not isinstance(stores[0].value, ast.Name) \
                or not any(stores[0] is n for n in ast.walk(init)):
            return None
        bound = _bind(init, ctor, skip_self=True)
        dim = bound.get(stores[0].value.id) if bound is not None else None
        if dim is None or canonical.const_value(dim) is None:
            return None
    else:
        return None
    return dim, _float32() if body.float32 else None


def unread_repo_softmax(matcher: Any, node: Any) -> Optional[str]:
    """The near miss for a call of a repository function named like a softmax whose body :func:`canonical.softmax_body`
    does not prove (a temperature, the unstable ``exp(x) / exp(x).sum()``, an in-place change of the input, an
    unread branch); None when ``node`` is no such call."""
    if not isinstance(node, ast.Call) or "softmax" not in ast.unparse(_plain_callee(node.func)).lower():
        return None
    d = _definition(matcher, node.func)
    if d is None or not isinstance(d.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    branch = _attention_s47t.unevaluated_branch(d.node, d.tree, _bind(d.node, node, skip_self=False))
    if branch:  # s47: the body is a softmax only on one arm of a test this call's argument decides
        return (f"the probabilities come from `{ast.unparse(_plain_callee(node.func))}` (a function of the repository, "
                f"{d.rel}:{d.node.lineno}) whose body branches on {branch}: npufuse cannot check that npu_fusion_attention "
                "computes the same")
    return (f"the probabilities come from `{ast.unparse(_plain_callee(node.func))}` (a function of the repository, {d.rel}:{d.node.lineno}) "
            "whose body is not read as a softmax over one axis (torch's, or exp(x - max) / sum with keepdim): npufuse cannot "
            "check that npu_fusion_attention computes the same")


def _plain_callee(func: Any) -> ast.expr:
    from npufuse.patterns.attention import _plain

    return _plain(func)


def parameter_may_be_number(module: Any, scope: Any, node: Any) -> bool:
    """``node`` is the value a parameter of ``scope``'s function had on entry, and a Python number may reach it: its
    default is a number, or a call of the function in this file passes one (a literal, or a local assigned a number
    on some branch: proteina's ``b = bias(pair) if exists(pair) else 0; self._attn(q, k, v, b, mask)``). Tensor
    methods on a number raise, so the caller guards with ``torch.is_tensor``. Callers in other files are not read."""
    from npufuse.patterns.attention import Ref

    fn = scope.node
    if not isinstance(node, Ref) or node.idx != -1 or not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    positional = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    if node.name not in positional + [a.arg for a in fn.args.kwonlyargs]:
        return False
    defaults = dict(zip(positional[len(positional) - len(fn.args.defaults):], fn.args.defaults))
    defaults.update({a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None})
    if _number(defaults.get(node.name)):
        return True
    method = bool(scope.class_name) and positional[:1] == ["self"]
    pos = positional.index(node.name) - (1 if method else 0) if node.name in positional else None
    # the text decides most cases: no ``self.<name>(`` / ``<name>(`` call spelled anywhere but the ``def``
    if not called_outside_def(module, fn.name, method):  # (the text regexes, tested by hand: dataflow)
        return False
    for caller, call in _calls_by_callee(module).get(("self" if method else "", fn.name), ()):
        arg = next((k.value for k in call.keywords if k.arg == node.name), None)
        if arg is None and pos is not None and 0 <= pos < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[:pos + 1]):
            arg = call.args[pos]
        if arg is None:
            continue
        if _number(arg) or isinstance(arg, ast.IfExp) and (_number(arg.body) or _number(arg.orelse)):
            return True
        if isinstance(arg, ast.Name) and any(_number(v) or isinstance(v, ast.IfExp) and (_number(v.body) or _number(v.orelse))
                                             for _st, v in caller.assignments.get(arg.id, [])):
            return True
    return False


def _calls_by_callee(module: Any) -> dict[tuple[str, str], list[tuple[Any, ast.Call]]]:
    """(caller scope, call) for every call in a function scope of ``module`` (nested defs included, as
    ``ast.walk`` of the scope sees them), keyed ``("self", m)`` for ``self.m(..)`` and ``("", f)`` for ``f(..)``:
    built once per module from the scopes' shared node index, instead of a walk of every scope per question."""
    cached = module.__dict__.get("_npufuse_calls_by_callee")
    if cached is None:
        cached = {}
        for caller in module.scopes:
            if not isinstance(caller.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for call in caller.nodes().get(ast.Call, ()):
                f = call.func
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
                    cached.setdefault(("self", f.attr), []).append((caller, call))
                elif isinstance(f, ast.Name):
                    cached.setdefault(("", f.id), []).append((caller, call))
        module.__dict__["_npufuse_calls_by_callee"] = cached
    return cached


def _number(node: Any) -> bool:
    v = canonical.const_value(node) if isinstance(node, (ast.Constant, ast.UnaryOp)) else None
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def identity_method(matcher: Any, node: Any, chain: Any) -> Optional[Any]:
    """The scores argument of ``self.<m>(scores, ...)`` where ``<m>`` is a method of this class (defined in it, in
    this file) whose body only returns its first parameter (fairseq's ``apply_sparse_mask(self, w, tgt, src, bsz):
    return w``, a hook a sparse subclass overrides). A subclass anywhere may override it, so the fused call runs only
    where ``type(self).<m>`` is still this class's function (``chain.requires``); None for any other call."""
    if isinstance(node, ast.Call) and node.keywords:
        return None
    found = own_method(matcher, node)
    if found is None:
        return None
    owner, fn = found
    params = [a.arg for a in fn.args.args]
    body = [st for st in fn.body if not (isinstance(st, ast.Expr) and isinstance(canonical.const_value(st.value), str))]
    if len(params) < 2 or len(node.args) != len(params) - 1 or fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or fn.args.posonlyargs \
            or len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.Name) or body[0].value.id != params[1]:
        return None
    guard = ast.parse(f"type(self).{fn.name} is {owner}.{fn.name}", mode="eval").body
    chain.requires.append((guard, f"`self.{fn.name}(..)` returns the scores unchanged in `{owner}`; a subclass may override it: the fused call "
                                  f"runs only where `type(self).{fn.name}` is `{owner}`'s"))
    return node.args[0]


def own_method(matcher: Any, node: Any) -> Optional[tuple[str, ast.FunctionDef]]:
    """(the class that defines it, the method) for a call ``self.<m>(..)`` with positional arguments, none starred,
    where ``<m>`` is a plain (undecorated, not async) method of the module-level class of the scope, or of the one
    base class that file names (MegaTTS3's ``RotMultiheadAttention(MultiheadAttention)``); None otherwise."""
    from npufuse.patterns.attention import Ref

    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, Ref)
            and node.func.value.name == "self" and node.func.value.idx == -1 and node.args
            and not any(isinstance(a, ast.Starred) for a in node.args)):
        return None
    cls_name = matcher.scope.class_name
    cls = matcher.module.classes.get(cls_name or "")
    if cls is None or "." in (cls_name or "") or not any(st is cls for st in matcher.module.tree.body):
        return None  # a nested class: its name is not a module-level name the guard can read
    owner, fn = cls.name, _method_of(cls, node.func.attr)
    if fn is None and len(cls.bases) == 1 and isinstance(cls.bases[0], ast.Name):
        base = repo_definition(matcher, cls.bases[0].id)
        if base is not None and isinstance(base.node, ast.ClassDef):
            owner, fn = cls.bases[0].id, _method_of(base.node, node.func.attr)
    if fn is None or fn.decorator_list or not isinstance(fn, ast.FunctionDef):
        return None
    return owner, fn


def _method_of(cls: ast.ClassDef, name: str) -> Optional[ast.AST]:
    return next((st for st in cls.body if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)) and st.name == name), None)


def module_receiver(matcher: Any, node: Any) -> bool:
    """``node`` names a module bound by an import of this file that is not torch (``utils`` of ``from fairseq import
    utils``), or a class of this file: ``utils.softmax(x, dim=-1)`` calls a function of it, not the tensor method
    ``x.softmax``."""
    from npufuse.patterns.attention import Ref

    name = node.id if isinstance(node, ast.Name) else node.name if isinstance(node, Ref) and node.idx == -1 else None
    if name is None or matcher.scope.assignments.get(name) or is_parameter(matcher.scope, name):
        return False
    if name in matcher.module.classes:
        return True  # s43: ``Ops.softmax(x, dim)`` calls a method of a class of this file, not the tensor method
    full = matcher.module.aliases.get(name) or ""
    return bool(full) and not full.startswith(("torch", "numpy", "jax"))


def repo_definition(matcher: Any, name: str) -> Optional[repo_facts.Definition]:
    """What ``name`` (``X`` or ``mod.X``) names in the repository: a top-level definition of this file, one imported
    by name, or ``X`` of a repository module imported as ``mod`` (``from pkg import mod``); None otherwise."""
    d = repo_facts.definition(matcher.module, name)
    if d is None and name.count(".") == 1:
        head, _, attr = name.partition(".")
        d = _module_attribute(matcher, head, attr)
    return d


# the probabilities' NaN entries zeroed after the softmax (``P.masked_fill(torch.isnan(P), 0)``): a marker for
# ``Chain.zero_masked``, whose rows are then the mask's fully masked rows (a softmax gives NaN exactly on a row of -inf)
NAN_ROWS = ast.Name("_npufuse_nan_rows", ast.Load())


def nan_zeroed_probs(matcher: Any, node: Any) -> Optional[Any]:
    """P of ``P.masked_fill(torch.isnan(P), 0)`` / ``P.masked_fill(P.isnan(), 0.0)`` / ``torch.nan_to_num(P, nan=0.0)`` /
    ``P.nan_to_num(0)`` (the same P on both sides); None for anything else."""
    from npufuse.patterns.attention import deref

    if not isinstance(node, ast.Call):
        return None
    name = matcher._fn(node)
    if matcher.method(node, "masked_fill", "masked_fill_") and len(node.args) == 2 and not node.keywords:
        p, m, fill = node.func.value, node.args[0], node.args[1]
    elif name == "torch.masked_fill" and len(node.args) == 3 and not node.keywords:
        p, m, fill = node.args
    elif name == "torch.nan_to_num" or matcher.method(node, "nan_to_num") and name != "torch.nan_to_num":
        args = node.args[1:] if name == "torch.nan_to_num" else node.args
        p = node.args[0] if name == "torch.nan_to_num" and node.args else node.func.value if name != "torch.nan_to_num" else None
        nan = next((k.value for k in node.keywords if k.arg == "nan"), args[0] if args else ast.Constant(0.0))
        if p is None or canonical.const_value(nan) not in (0, 0.0) or isinstance(canonical.const_value(nan), bool):
            return None
        return p
    else:
        return None
    v = canonical.const_value(fill)
    if v not in (0, 0.0) or isinstance(v, bool):
        return None
    m = deref(m)
    if isinstance(m, ast.Call) and matcher._fn(m) == "torch.isnan" and len(m.args) == 1:
        inner = m.args[0]
    elif matcher.method(m, "isnan") and not m.args:
        inner = m.func.value
    else:
        return None
    return p if deref(inner) is deref(p) else None


def may_fill_minus_inf(term: Any) -> bool:
    """A mask term that can leave a score at -inf: a bool mask filled with an infinite value, or an additive term
    (its 0/-inf values are checked, -inf included)."""
    if term.kind == "additive":
        return True
    if term.kind in ("masked", "keep"):
        return "inf" in (term.fill or "").lower()
    return False
