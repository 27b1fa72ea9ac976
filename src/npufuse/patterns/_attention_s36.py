"""Attention constructs of the s36 pass (HO12 / ports 7 development data).

* A module that passes the scores or the probabilities through unchanged (DeiT / PatchConvNet's
  ``attn = self.id(attn)`` with ``self.id = nn.Identity()``, a placeholder kept so that users can hook the
  attention map): :func:`identity_module`. What the attribute holds is decided from the class's assignments to it
  (``nn.Identity`` in at least one of them, possibly chosen by a flag), and the fused call runs only where, at run
  time, it IS an ``nn.Identity`` with no forward hook on it (a hook could read or replace the map); the original
  code runs otherwise.
"""

from __future__ import annotations

import ast
from typing import Any, Optional

# s50: fast_walk for ast.walk (the same nodes in the same order; a root walked before in the file is not walked again)
from npufuse.scan.dataflow import fast_walk

_IDENTITY = frozenset(("torch.nn.Identity", "torch.nn.modules.linear.Identity"))


def identity_module(matcher: Any, node: Any, chain: Any) -> Optional[Any]:
    """The tensor argument of ``self.<attr>(x)`` where the class assigns ``self.<attr>`` an ``nn.Identity`` (in any
    of its assignments, directly or in one arm of a conditional expression); ``chain.requires`` gets the run-time
    test that the attribute holds an ``nn.Identity`` without forward hooks. None for any other call."""
    from npufuse.patterns.attention import _is_self_attr

    if not (isinstance(node, ast.Call) and _is_self_attr(node.func) and len(node.args) == 1 and not node.keywords
            and not isinstance(node.args[0], ast.Starred)):
        return None
    cls = matcher.module.classes.get(matcher.scope.class_name or "")
    if cls is None:
        return None
    attr = node.func.attr
    identity = _identity_class_text(matcher, cls, attr)
    if identity is None:
        return None
    held = f"self.{attr}"
    guard = ast.parse(f"isinstance({held}, {identity}) and not {held}._forward_hooks and not {held}._forward_pre_hooks",
                      mode="eval").body
    chain.requires.append((guard, f"`{held}` is built as `{identity}()`: it returns its input unchanged; the fused call runs "
                                  f"where it is one at run time with no forward hook on it (a hook may read or replace the "
                                  f"attention map), the original code otherwise"))
    chain.spelling.append("identity_module")
    return node.args[0]


def _identity_class_text(matcher: Any, cls: ast.ClassDef, attr: str) -> Optional[str]:
    """How this file spells ``nn.Identity`` (``nn.Identity``, ``torch.nn.Identity``, ``Identity``) in an assignment
    ``self.<attr> = ...`` of the class (an arm of a conditional expression counts), where the spelling is bound by a
    module-level import (the guard reads it at the site); None where no assignment builds one."""
    want = f"self.{attr}"
    for n in fast_walk(cls):
        if not isinstance(n, ast.Assign):
            continue
        if not any(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and f"{t.value.id}.{t.attr}" == want
                   for t in n.targets):
            continue
        values = [n.value]
        while values:
            v = values.pop()
            if isinstance(v, ast.IfExp):
                values += [v.body, v.orelse]
                continue
            if isinstance(v, ast.Call) and not v.keywords and matcher.module.canonical(v.func) in _IDENTITY:
                text = ast.unparse(v.func)
                if text.split(".")[0] in _module_level_imports(matcher.module.tree):
                    return text
    return None


def _module_level_imports(tree: ast.Module) -> set[str]:
    """The names the file's top-level ``import`` statements bind (not those of an import inside a function)."""
    names: set[str] = set()
    for st in tree.body:
        if isinstance(st, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in st.names}
        elif isinstance(st, ast.ImportFrom):
            names |= {a.asname or a.name for a in st.names}
    return names


# --- a masking value returned by a method of the class or a function of the repository ---------------------------

def callee_fill(matcher: Any, fill: Any, chain: Any) -> Optional[tuple[bool, bool]]:
    """(is a masking value, is finite) of a fill a call computes: ``self.<m>(..)`` (a method of this class, or of the
    one base the file names) or a repository function, whose every ``return`` gives a masking value by its dataflow:
    the returned expression, a local name's assignments in the callee, or an attribute of ``self`` the callee caches
    (GPT-BigCode / CodeShell ``_get_mask_value``: ``if self.mask_value is None or ..: self.mask_value = torch.full([],
    torch.finfo(dtype).min, ..)``, then ``return self.mask_value``: the class's other assignments of the attribute
    count too, a ``None`` among them only where the callee replaces a None before returning it). A method may be
    overridden by a subclass: the fused call then runs only where ``type(self).<m>`` is the method read
    (``chain.requires``). None where the callee or a returned value is not read."""
    from npufuse.patterns.attention import Ref, _is_self_attr, deref

    f = deref(fill)
    if not isinstance(f, ast.Call):
        return None
    owner, fn = None, None
    if _is_self_attr(f.func):
        owner, fn = _self_method(matcher, f.func.attr)
    elif isinstance(f.func, (ast.Name, Ref)):
        from npufuse.patterns._attention_s33 import repo_definition

        name = f.func.id if isinstance(f.func, ast.Name) else f.func.name if f.func.idx == -1 else None
        d = repo_definition(matcher, name) if name and not matcher.scope.assignments.get(name) else None
        fn = d.node if d is not None and isinstance(d.node, ast.FunctionDef) and not d.node.decorator_list else None
    if fn is None:
        return None
    values = _returned_values(fn, matcher.module.classes.get(owner or "") if owner else None)
    if not values:
        return None
    verdicts = [matcher._fill_ok(v) for v in values]
    if not all(ok for ok, _finite in verdicts):
        return None
    if owner is not None:
        chain.requires.append((ast.parse(f"type(self).{fn.name} is {owner}.{fn.name}", mode="eval").body,
                               f"the masking value comes from `self.{fn.name}(..)` of `{owner}`; a subclass may override it: "
                               f"the fused call runs only where `type(self).{fn.name}` is `{owner}`'s"))
    return True, any(finite for _ok, finite in verdicts)


def _self_method(matcher: Any, name: str) -> tuple[Optional[str], Optional[ast.FunctionDef]]:
    """(owning class name, method) of ``self.<name>`` for the site's class, defined in it or in the one base its
    header names; (None, None) for a nested class (its name is not a module-level name a guard can read) or none."""
    from npufuse.patterns._attention_s33 import _method_of, repo_definition

    cls_name = matcher.scope.class_name
    cls = matcher.module.classes.get(cls_name or "")
    if cls is None or "." in (cls_name or "") or not any(st is cls for st in matcher.module.tree.body):
        return None, None
    fn = _method_of(cls, name)
    owner = cls.name
    if fn is None and len(cls.bases) == 1 and isinstance(cls.bases[0], ast.Name):
        base = repo_definition(matcher, cls.bases[0].id)
        if base is not None and isinstance(base.node, ast.ClassDef):
            owner, fn = cls.bases[0].id, _method_of(base.node, name)
    if not isinstance(fn, ast.FunctionDef) or fn.decorator_list:
        return None, None
    return owner, fn


def _returned_values(fn: ast.FunctionDef, cls: Optional[ast.ClassDef]) -> list[ast.expr]:
    """Every value ``fn`` can return, read through its local names and the ``self`` attributes it caches; [] where
    one is not read (a bare ``return``, a name assigned by anything but a plain ``=``, an attribute of another object)."""
    body_nodes = [n for n in _own_nodes(fn)]
    values: list[ast.expr] = []
    for ret in (n for n in body_nodes if isinstance(n, ast.Return)):
        if ret.value is None:
            return []
        v = ret.value
        if isinstance(v, ast.Name):
            assigned = _assignments(body_nodes, lambda t: isinstance(t, ast.Name) and t.id == v.id)
            if assigned is None or not assigned:
                return []
            values += assigned
        elif isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "self":
            attr = v.attr
            is_it = lambda t: isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" and t.attr == attr  # noqa: E731
            here = _assignments(body_nodes, is_it)
            everywhere = _assignments(list(fast_walk(cls)), is_it) if cls is not None else None
            if not here or everywhere is None:
                return []
            replaced = _replaces_none(fn, attr)
            values += [a for a in everywhere if not (replaced and isinstance(a, ast.Constant) and a.value is None)]
        else:
            values.append(_locals_substituted(v, body_nodes))
    return values


def _locals_substituted(expr: ast.expr, body_nodes: list[ast.AST]) -> ast.expr:
    """``expr`` with each name the callee assigns exactly once by plain ``=`` replaced by that value
    (``big = torch.finfo(t.dtype).max`` ... ``return -big``), so that the value's text is what it computes."""
    import copy

    class _Sub(ast.NodeTransformer):
        def visit_Name(self, n: ast.Name) -> ast.AST:
            found = _assignments(body_nodes, lambda t: isinstance(t, ast.Name) and t.id == n.id)
            return copy.deepcopy(found[0]) if found is not None and len(found) == 1 else n

    return _Sub().visit(copy.deepcopy(expr))


def _own_nodes(fn: ast.FunctionDef) -> list[ast.AST]:
    """The nodes of ``fn``'s body, not of functions / classes / lambdas nested in it."""
    out, stack = [], list(fn.body)
    while stack:
        n = stack.pop()
        out.append(n)
        stack += [c for c in ast.iter_child_nodes(n) if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))]
    return out


def _assignments(nodes: list[ast.AST], is_target: Any) -> Optional[list[ast.expr]]:
    """The values assigned by plain ``=`` to a target ``is_target`` accepts; None where another statement binds it
    (``+=``, a ``for`` / ``with`` target, a tuple target)."""
    found: list[ast.expr] = []
    for n in nodes:
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if is_target(t):
                    found.append(n.value)
                elif isinstance(t, (ast.Tuple, ast.List)) and any(is_target(e) for e in t.elts):
                    return None
        elif isinstance(n, ast.AnnAssign) and is_target(n.target):
            if n.value is None:
                continue
            found.append(n.value)
        elif isinstance(n, (ast.AugAssign, ast.For, ast.AsyncFor)) and is_target(n.target):
            return None
        elif isinstance(n, (ast.With, ast.AsyncWith)) and any(i.optional_vars is not None and is_target(i.optional_vars) for i in n.items):
            return None
    return found


def _replaces_none(fn: ast.FunctionDef, attr: str) -> bool:
    """``fn`` starts (before any return) with ``if self.<attr> is None [or ...]: ... self.<attr> = <value>``: a None
    the attribute holds is replaced before it is returned."""
    for st in fn.body:
        if isinstance(st, ast.Return):
            return False
        if not isinstance(st, ast.If):
            continue
        tests = st.test.values if isinstance(st.test, ast.BoolOp) and isinstance(st.test.op, ast.Or) else [st.test]
        none_test = any(isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Is)
                        and ast.unparse(t.left) == f"self.{attr}" and isinstance(t.comparators[0], ast.Constant)
                        and t.comparators[0].value is None for t in tests)
        assigns = any(isinstance(s, ast.Assign) and any(ast.unparse(t) == f"self.{attr}" for t in s.targets) for s in st.body)
        if none_test and assigns:
            return True
    return False


# --- SDPA whose scale is computed from a learned tensor (MONAI CABlock's ``scale = float(self.temperature.mean())``) --

_PARAMETERS = frozenset(("torch.nn.Parameter", "torch.nn.parameter.Parameter"))


def learned_scale(module: Any, scope: Any, scale: Any) -> bool:
    """``scale`` reads a parameter the class builds with ``nn.Parameter`` (directly or through the one local assignment
    of a name): a learned temperature, the mark of channel attention (XCiT / Restormer / MONAI CABlock), whose head dim
    is the pixels when a caller makes the layout."""
    if scale is None:
        return False
    cls = module.classes.get(scope.class_name or "") if getattr(scope, "class_name", None) else None
    if cls is None:
        return False
    value = scale
    if isinstance(scale, ast.Name):
        found = scope.assignments.get(scale.id) or []
        if len(found) != 1:
            return False
        value = found[0][1]
    attrs = {n.attr for n in fast_walk(value) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}
    for n in fast_walk(cls):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and module.canonical(n.value.func) in _PARAMETERS \
                and any(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" and t.attr in attrs
                        for t in n.targets):
            return True
    return False
