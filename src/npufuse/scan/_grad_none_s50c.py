"""s50 (ho27c): a grad-None test tied to the optimizer it concerns.

``site_reads`` took the first grad-None test of any file the trainer's imports reach as evidence against the optimizer
site (judge50c: ahriuwu's ``create_optimizer`` was refused over ``p.grad is not None`` in a ``smoke_test`` that builds
its own ``torch.optim.AdamW`` and never calls the factory). A test that sits in a function constructing its own
optimizer, and calling neither the site's builder nor any function of the file that does, concerns that optimizer: it is
not counted against this one. Any other test still counts (the trainer of this optimizer may run it)."""

from __future__ import annotations

import ast
from typing import Optional

_OPTIMIZER_NAMES = frozenset({"Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "LBFGS",
                              "AdamW8bit", "Adam8bit", "Lion"})


def _enclosing(tree: ast.Module, line: int) -> list[ast.AST]:
    """The functions holding ``line``, outermost first (a test in a closure of the function that builds the optimizer)."""
    return sorted((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and n.lineno <= line <= (n.end_lineno or n.lineno)), key=lambda n: n.lineno)


def _called(fn: ast.AST) -> set[str]:
    out = set()
    for c in ast.walk(fn):
        if isinstance(c, ast.Call):
            f = c.func
            out.add(f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")
    return out


def concerns_own_optimizer(tree: Optional[ast.Module], line: int, builder: str) -> bool:
    """The grad-None test at ``line`` sits in a function that constructs an optimizer of its own (``torch.optim.AdamW(..)``
    and the like) and calls neither ``builder`` (the site's function name) nor a function of the file that calls it."""
    if tree is None:
        return False
    helpers = None
    for fn in _enclosing(tree, line):
        called = _called(fn)
        if not called & _OPTIMIZER_NAMES or builder in called:
            continue
        if helpers is None:
            helpers = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and builder in _called(n)}
        if not called & helpers:
            return True
    return False


# --- DDP with gradient_as_bucket_view chosen at run time, in a trainer of this optimizer: a run-time guard -----------
# judge50c (ahriuwu): ``if ddp: model = DDP(model, ..., gradient_as_bucket_view=True)`` then
# ``optimizer = create_optimizer(model.parameters(), ...)``. repo_facts tied the wrap to the builder only through names
# handed to it (``create_optimizer(model, ...)``), not through ``model.parameters()``; and a wrap under a condition was
# a risk line only. The fused optimizer then runs only where no process group is initialised (a DDP wrap needs one):
# multi-process runs keep torch.optim.
def parameter_owners(args: list[ast.AST]) -> set[str]:
    """``model`` of ``model.parameters()`` / ``model.named_parameters()`` handed to the builder."""
    from npufuse.scan.dataflow import dotted

    out = set()
    for a in args:
        if isinstance(a, ast.Call) and isinstance(a.func, ast.Attribute) and a.func.attr in ("parameters", "named_parameters"):
            name = dotted(a.func.value)
            if name:
                out.add(name)
    return out


_NO_PROCESS_GROUP = ('not (__import__("torch").distributed.is_available() and '
                     '__import__("torch").distributed.is_initialized())')
DDP_GUARD_NOTE = ("a trainer of this optimizer wraps the model in DDP with gradient_as_bucket_view under a run-time "
                  "condition: the fused optimizer is built only where no torch.distributed process group is initialised "
                  "(DDP needs one), so multi-process runs keep torch.optim (DDP's reducer re-points each grad into its bucket "
                  "on every backward, and the fused optimizer would read a stale flat buffer)")


def guard_without_process_group(h: object) -> None:
    f = h.finding  # type: ignore[attr-defined]
    if "ddp_bucket_view" in f.params:
        return
    f.guard_tensor = f"({f.guard_tensor}) if {_NO_PROCESS_GROUP} else None"
    f.params["ddp_bucket_view"] = True
    f.notes.append(DDP_GUARD_NOTE)
