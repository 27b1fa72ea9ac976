"""s51 (optim51): refusals true only of a non-default option, turned into run-time guards.

A fused_optimizer site was refused as a whole where only some runs are unsound (s50 ho27misc, item "fused_optimizer
(a)"): the fused branch now runs under a guard that reads, where the optimizer is built, the same values the code
reads, and every other run keeps the original construction.

1. **Skipping classes of a model npufuse does not tell apart.** The random-skip reader (``scan/random_skip.py``)
   refuses an optimizer whose model it cannot resolve when any class the trainer's code reaches calls a trainable
   submodule only on some steps (an MoE layer behind ``--model_type``). Those classes are repository
   ``nn.Module`` classes: a model none of whose modules is an instance of one of them (by class name, through the
   MRO, so a subclass counts) runs none of their forwards as a submodule, so no parameter the optimizer takes is
   skipped by them. The guard tests ``model.modules()`` for every such class (all of them are collected, not the
   first); a class the reader cannot show to be an ``nn.Module`` keeps the refusal, and so does a skip drawn at random
   (layer drop is most often part of every model variant: the guard would always fall back).
2. **A sharding test on ``self``.** ``if self.config.use_fsdp and self.world_size > 1: self.model = setup_fsdp(..)``
   in ``__init__`` and the optimizer built in another method of the same class: the test is evaluated again at the
   site when every attribute it reads is assigned in the class only in the test's method before the test, nothing
   in the file stores an attribute of the same name further down the chain, and the site's method is called (in
   the file) only from the test's method after the test. The flag read in the ``if`` test itself, and a keyword that
   turns the option off (``TrainingConfig(use_fsdp=False)``), are reads of the option, not sharding.
"""

from __future__ import annotations

import ast
import re
from typing import Optional

from npufuse.scan.dataflow import ModuleInfo, Scope, fast_walk

_MODULE_BASES = frozenset({"Module", "ModuleList", "ModuleDict", "Sequential"})
_GUARD_MODEL = re.compile(r"next\(([A-Za-z_][\w.]*)\.parameters\(\)")  # as random_skip reads the guard
_MAX_CLASSES = 8  # more skipping classes than this: the refusal stands (a guard naming them all says little)


def _is_module_class(skip: object) -> bool:
    """Does the skip's class derive from ``torch.nn.Module`` directly (a base named ``Module`` / ``nn.Module`` /
    ``Sequential`` / ``ModuleList`` / ``ModuleDict``)? A repository base class is not followed: the refusal stands."""
    node = getattr(skip, "node", None)
    if not isinstance(node, ast.ClassDef):
        return False
    for b in node.bases:
        name = b.attr if isinstance(b, ast.Attribute) else b.id if isinstance(b, ast.Name) else ""
        if name in _MODULE_BASES:
            return True
    return False


def skip_class_names(skips: list) -> Optional[list[str]]:
    """The class names a guard must test for, or None where one cannot be guarded (not shown to be an
    ``nn.Module``; too many)."""
    names: list[str] = []
    for s in skips:
        # a random draw (layer drop, a stochastic branch) is most often part of every model variant (the s38 registry of
        # one Stack): the guard would always fall back, so the refusal stands; an expert reached only by routed tokens
        # is the option a model type turns on (an MoE variant beside dense ones)
        if not getattr(s, "data_dependent", False) or not _is_module_class(s):
            return None
        name = str(getattr(s, "cls", "")).rsplit(".", 1)[-1]
        if not name.isidentifier():
            return None
        if name not in names:
            names.append(name)
    return names if 0 < len(names) <= _MAX_CLASSES else None


def variant_switch(index: object, skips: list) -> bool:
    """Does some file of the repository build both a class of a skipping class's file (the MoE model) and an
    ``nn.Module`` class of a file that names none of the skipping classes (a dense model): a model-type switch, so
    that the guard can pass? Where every model the repository builds holds the skipping class (s39's one ``Net``),
    the guard would always fall back and the refusal stands."""
    names = {str(getattr(s, "cls", "")).rsplit(".", 1)[-1] for s in skips}
    skip_files = {getattr(s, "rel", "") for s in skips}
    files = list(getattr(index, "files", []))[:2000]
    holders: set[str] = set()
    others: set[str] = set()
    for rel in files:
        text = index.text(rel) or ""  # type: ignore[attr-defined]
        if "class " not in text:
            continue
        defined = re.findall(r"^class\s+(\w+)\s*\(([^)]*)\)", text, re.M)
        if rel in skip_files:
            holders.update(c for c, _b in defined)
        elif not any(re.search(rf"\b{re.escape(n)}\b", text) for n in names):
            others.update(c for c, b in defined if re.search(r"\b(?:Module|Sequential)\b", b))
    holders -= names
    if not holders or not others:
        return False
    built = re.compile(r"\b(\w+)\(")
    for rel in files:
        called = set(built.findall(index.text(rel) or ""))  # type: ignore[attr-defined]
        if called & holders and called & others:
            return True
    return False


def no_skip_test(model: str, names: list[str]) -> str:
    """The guard's condition: ``model`` has ``modules()`` (an ``nn.Module``; no ``torch`` name is read: the file need
    not import torch) and none of its modules is (a subclass of) one of ``names``."""
    return (f"callable(getattr({model}, 'modules', None)) and not any(_c.__name__ in {tuple(names)!r} "
            f"for _m in {model}.modules() for _c in type(_m).__mro__)")


def random_skip_verdict(module: ModuleInfo, scope: Scope, guard: str, params: str
                        ) -> tuple[Optional[str], Optional[list[str]]]:
    """(the random-skip near-miss reason, the class names a guard can test instead) for a site; the names only where
    the model is not told apart (a told model's own class skips on its default path) and the guard reads the model."""
    from npufuse.scan import random_skip
    from npufuse.scan.repo_facts import repo_root

    text = module.source
    if "def forward" not in text and "import" not in text:
        return None, None
    try:
        index = random_skip.RepoIndex(repo_root(module), [module.path], 1 << 24)
        index.seed(module.path, text, module.tree)
        every: list = []
        found = random_skip.site_random_skip(index, module.path, scope.qualname, guard, params, every)
    except (Exception, RecursionError):  # an analysis aid: never lose the site over it
        return None, None
    if found is None:
        return None, None
    why = random_skip.reason(*found)
    model = guard_model_name(guard)
    if found[1] or not model or not variant_switch(index, every):
        return why, None
    return why, skip_class_names(every)


def guard_model_name(guard: str) -> str:
    """The one model whose fresh ``parameters()`` generator the guard reads (``next(model.parameters(), ..)``, however
    deep in the run-time tests wrapped around it), else ''."""
    names = set(_GUARD_MODEL.findall(guard or ""))
    return names.pop() if len(names) == 1 else ""


def repo_pass_checked(finding_params: dict, skips: list) -> bool:
    """Does the finding's guard already test every class in ``skips`` (the repository pass found the same unresolved
    skips the per-file pass guarded)?"""
    checked = finding_params.get("skip_classes_checked")
    if not checked:
        return False
    names = skip_class_names(skips)
    return names is not None and set(names) <= set(checked)


def guard_in_repo_pass(finding: object, skips: list, index: object) -> bool:
    """The repository pass found skipping classes of a model it does not tell apart (``skips``; the per-file pass did
    not see them): where the finding's guard reads the model, guard it on them as the per-file pass does (the finding
    is updated in place) and say so; False where that cannot be done (the near miss stands)."""
    guard = getattr(finding, "guard_tensor", "") or ""
    params = getattr(finding, "params", None)
    model = guard_model_name(guard)
    names = skip_class_names(skips)
    if not model or not names or not isinstance(params, dict) or not variant_switch(index, skips):
        return False
    if "dtypes_checked" in str(params.get("guard", "")):
        return False  # the model is also cast to a run-time dtype (bf16 by default in HO27a deepseek-replica): the refusal stands
    finding.guard_tensor = f"({guard}) if {no_skip_test(model, names)} else None"  # type: ignore[attr-defined]
    params["skip_classes_checked"] = names
    params["guard"] = str(params.get("guard", "")) + "_skipping_classes_checked"
    getattr(finding, "notes").append(skip_note(model, names))
    return True


def skip_note(model: str, names: list[str]) -> str:
    return (f"classes the trainer's code reaches call a trainable submodule only on some steps ({', '.join(names)}), and "
            f"npufuse does not tell which model `{model}` is: the guard runs the fused class only where no module of "
            f"`{model}` is (a subclass of) one of them; models that include one keep torch.optim")


# -- 2. sharding tests on `self` ---------------------------------------------------------------------------------

def option_read(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """Is ``node`` a read of a sharding option, not a cause of sharding: inside the test of an ``if`` /
    conditional expression, or a keyword that turns it off (``use_fsdp=False`` / None / 0)?"""
    if isinstance(node, ast.keyword):
        return isinstance(node.value, ast.Constant) and node.value.value in (False, None, 0)
    child, parent = node, parents.get(id(node))
    while parent is not None and not isinstance(parent, ast.stmt):
        if isinstance(parent, ast.IfExp) and child is parent.test:
            return True
        child, parent = parent, parents.get(id(parent))
    return isinstance(parent, (ast.If, ast.While)) and child is parent.test


def _self_chains(test: ast.expr) -> Optional[list[list[str]]]:
    """The attribute chains ``self.a.b`` the test reads (as ['a', 'b']), None if it reads another name or a
    ``self`` that is not the head of an attribute chain."""
    chains: list[list[str]] = []
    inner: set[int] = set()
    for n in fast_walk(test):
        if isinstance(n, ast.Attribute) and id(n) not in inner:
            parts: list[str] = []
            cur: ast.expr = n
            while isinstance(cur, ast.Attribute):
                inner.add(id(cur))
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "self":
                chains.append(parts[::-1])
        elif isinstance(n, ast.Name) and n.id != "self":
            return None
    names = sum(1 for n in fast_walk(test) if isinstance(n, ast.Name))
    return chains if chains and names == len(chains) else None


def _method_of(module: ModuleInfo, node: ast.AST) -> tuple[Optional[ast.ClassDef], Optional[ast.FunctionDef]]:
    """The class and method whose body holds ``node`` (methods directly in a class body only)."""
    line = getattr(node, "lineno", 0)
    for cls in module.tree.body if isinstance(module.tree, ast.Module) else []:
        if isinstance(cls, ast.ClassDef) and cls.lineno <= line <= (cls.end_lineno or cls.lineno):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.lineno <= line <= (fn.end_lineno or fn.lineno):
                    return cls, fn
    return None, None


def _self_first(fn: ast.FunctionDef) -> bool:
    return bool(fn.args.args) and fn.args.args[0].arg == "self" and not any(
        isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod") for d in fn.decorator_list)


def self_test_holds(module: ModuleInfo, scope: Scope, stmt: ast.stmt, test: ast.expr) -> bool:
    """Can the ``self`` test (in a method of the site's class) be evaluated again at the site with the same value?"""
    chains = _self_chains(test)
    if chains is None:
        return False
    cls, test_fn = _method_of(module, test)
    site_fn = scope.node
    if cls is None or test_fn is None or not isinstance(site_fn, ast.FunctionDef) or site_fn not in cls.body:
        return False
    if not (_self_first(test_fn) and _self_first(site_fn)):
        return False
    roots = {c[0] for c in chains}
    deeper = {a for c in chains for a in c[1:]}
    test_line = test.lineno
    for n in fast_walk(module.tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("setattr", "delattr", "vars", "exec"):
            return False
        targets: list[ast.expr] = []
        if isinstance(n, ast.Assign):
            targets = list(n.targets)
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            targets = [n.target]
        elif isinstance(n, ast.Delete):
            targets = list(n.targets)
        for t in targets:
            for e in fast_walk(t):
                if not (isinstance(e, ast.Attribute) and isinstance(e.ctx, (ast.Store, ast.Del))):
                    continue
                if e.attr in deeper:
                    return False  # `cfg.use_fsdp = True` somewhere: the chain's value may change
                if e.attr in roots and isinstance(e.value, ast.Name) and e.value.id == "self":
                    in_test_fn = test_fn.lineno <= e.lineno <= (test_fn.end_lineno or test_fn.lineno)
                    if not (in_test_fn and e.lineno < test_line and _method_of(module, e)[1] is test_fn):
                        return False
    if site_fn is not test_fn:
        # the site's method runs only from the test's method, after the test (its attributes are set by then)
        calls = [n for n in fast_walk(module.tree) if isinstance(n, ast.Attribute) and n.attr == site_fn.name
                 and isinstance(n.ctx, ast.Load)]
        if not calls:
            return False
        for c in calls:
            if not (isinstance(c.value, ast.Name) and c.value.id == "self" and _method_of(module, c)[1] is test_fn
                    and c.lineno > (test.end_lineno or test_line)):
                return False
    elif stmt.lineno <= (test.end_lineno or test_line):
        return False  # built before the test in the same method: the attributes may not be set yet
    return True
