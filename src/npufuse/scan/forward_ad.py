"""Repositories that run code under forward-mode AD or a functorch transform (s41, fwdad41).

torch_npu's fused operators have backward formulas only: no forward-mode derivative (spec
torch_npu_api.md documents none) and no derivative of their backward. A consistency / flow model
whose training loss calls ``torch.func.jvp(model_fn, primals, tangents)`` runs every fused branch
of the model under forward-mode AD, so every training step would fail on the NPU. The same holds
under the other functorch transforms (``vmap``, ``grad``, ``jacfwd``, ``jacrev``, ``hessian``,
``vjp``, ``linearize``: functorch's levels wrap the op with rules torch_npu does not register) and
inside ``torch.autograd.forward_ad.dual_level()`` (``make_dual``; ``torch.autograd.functional``'s
``jacobian`` / ``hessian`` with a forward-mode strategy run there).

The fact is gathered per file in the workers (:func:`uses`, kept in ``FileFacts.transforms``; a
gate on its imports and one regex first, the tree walked only when the file names one of the APIs)
and applied once per scan in the parent (:func:`apply`). Scope: the whole repository. The function handed to ``jvp`` is
usually a closure over a model that a config builds in another file (``model_fn = lambda x, t:
net(x, t)``), so which modules it reaches cannot be told reliably from the text; the run-time
test below costs two attribute reads per call and leaves the fused branch on everywhere no
transform is active, so applying it to every site of such a repository loses nothing but speed
inside the transform itself.

* A transform the fused branch can see at run time (functorch's levels:
  ``torch._C._are_functorch_transforms_active()``; forward AD: ``torch.autograd.forward_ad.
  _current_level >= 0`` inside a ``dual_level``): every fused branch of the repository falls back
  to the original while one is active. Its guard gets :data:`codegen.NO_TRANSFORM`, and a guard
  that npufuse writes inside the fused code (an nn.RMSNorm swap checks the device on every call)
  gets it too. Both are plain torch calls: torch.compile traces them (dynamo folds the first to a
  constant and guards on the second); TorchScript code gets no fused branch at all
  (:mod:`npufuse.patterns._compiled`).
* ``torch.autograd.functional.jvp`` / ``hvp`` / ``vhp`` / ``hessian`` (reverse-over-reverse):
  computed by differentiating the backward again (the double-backward trick). Nothing at run time
  tells that this is happening (no transform, no dual level), so no guard can be written: every
  candidate of the repository whose fused code calls a torch_npu operator becomes a near miss
  naming the file and line of the call.

Repositories without any of these get byte-identical output. Never raises.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, Optional

from npufuse.rewrite.codegen import TRANSFORM_PARAM, transform_guarded
from npufuse.scan import double_backward_reach

# The APIs are reached through an import of their module or name (found in ModuleInfo.aliases, no
# text read) or spelled out from ``torch`` (``torch.func.jvp``, ``torch.vmap``): one regex whose
# literal prefix makes it a fast scan (~1% of ast.parse's time on the transformers corpus).
_SPELLED = re.compile(r"torch\.(?:func\b|vmap\b|_functorch\b|autograd\.(?:forward_ad|functional)\b)")
_MODULES = ("torch.func", "functorch", "torch._functorch", "torch.autograd.forward_ad", "torch.autograd.functional", "torch.vmap")
# functorch transforms (torch.func.*, functorch.*, torch.vmap): functorch's levels are active inside them
_FUNCTORCH = frozenset(("jvp", "vjp", "vmap", "grad", "grad_and_value", "jacfwd", "jacrev", "hessian", "linearize"))
_FUNCTORCH_HOMES = ("torch.func.", "functorch.", "torch._functorch.")
_DUAL = frozenset(("dual_level", "make_dual", "enter_dual_level"))
# torch.autograd.functional APIs that differentiate a backward again (no level to test at run time)
_DOUBLE_BACKWARD = frozenset(("jvp", "hvp", "vhp", "hessian"))
_FUNCTIONAL = "torch.autograd.functional."
# patterns whose fused code is never differentiated (an optimizer built once) or is plain torch
_NOT_DIFFERENTIATED = "fused_optimizer"
_PLAIN_TORCH = frozenset(("affinity_index_put", "affinity_where"))

TRANSFORM = "transform"
DOUBLE_BACKWARD = "double_backward"


def _strategy(call: ast.Call | None, keyword: str) -> str | None:
    """The literal value of ``keyword`` in ``call`` ("" when not a literal, None when absent)."""
    if call is None:
        return None
    for k in call.keywords:
        if k.arg == keyword:
            return k.value.value if isinstance(k.value, ast.Constant) and isinstance(k.value.value, str) else ""
    return None


def _kind(api: str, call: ast.Call | None) -> str | None:
    """TRANSFORM, DOUBLE_BACKWARD or None (not one of the APIs) for the canonical name ``api``
    (``call``: the call it is the callee of, if any)."""
    last = api.rsplit(".", 1)[-1]
    if api == "torch.vmap" or (api.startswith(_FUNCTORCH_HOMES) and last in _FUNCTORCH):
        return TRANSFORM
    if api.startswith("torch.autograd.forward_ad.") and last in _DUAL:
        return TRANSFORM
    if api.startswith(_FUNCTIONAL) and api.count(".") == 3:
        if last == "jacobian":
            # reverse mode (the default) is a first-order backward; forward mode runs in a dual level
            s = _strategy(call, "strategy")
            return TRANSFORM if s is not None and s != "reverse-mode" else None
        if last == "hessian" and _strategy(call, "outer_jacobian_strategy") == "forward-mode":
            return TRANSFORM  # forward-over-reverse: the backward runs inside a dual level
        if last in _DOUBLE_BACKWARD:
            return DOUBLE_BACKWARD
    return None


def uses(module: Any) -> list[tuple[str, int, str]]:
    """(kind, line, api) of every place ``module`` (a ModuleInfo) names a functorch transform,
    forward-mode AD or a double-backward functional API (first 8); [] for most files (gate: imports, one regex)."""
    if _SPELLED.search(module.source) is None and not any(
            v == m or v.startswith(m + ".") for v in module.aliases.values() for m in _MODULES):
        return []
    callee: dict[int, ast.Call] = {}
    found: list[tuple[str, int, str]] = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Call):
            callee[id(node.func)] = node
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
            api = module.canonical(node)
            kind = _kind(api, callee.get(id(node))) if api else None
            if kind is not None:
                found.append((kind, node.lineno, api))
    # ast.walk visits a call before its callee: the calls are known when their names are read
    found = sorted(set(found), key=lambda u: (u[1], u[0], u[2]))
    return found[:8]


def _needs_guard(finding: Any) -> bool:
    """Fused code that runs a torch_npu operator where the model is differentiated."""
    if finding.pattern == _NOT_DIFFERENTIATED:
        return False
    return finding.pattern not in _PLAIN_TORCH or "torch_npu" in finding.fused


def apply(outcomes: list[Any], near: list[dict[str, Any]], root: Optional[Path] = None,
          files: Optional[list[str]] = None) -> None:
    """Every candidate's fused branch of a repository with such a use falls back under an active
    transform, or, with a double-backward use that can reach its file (``root`` / ``files``: the
    repository, to follow the using file's imports; without them every file is reached), becomes a
    near miss (appended to ``near``). Mutates ``outcomes``' hits; nothing changes in a repository
    without such a use."""
    try:
        _apply(outcomes, near, double_backward_reach.Reach(root, files or []))
    except (Exception, RecursionError):  # an analysis aid: never lose the scan over it
        return


def _apply(outcomes: list[Any], near: list[dict[str, Any]], reach: double_backward_reach.Reach) -> None:
    found = sorted((o.file, line, api, kind) for o in outcomes if o.facts is not None
                   for kind, line, api in getattr(o.facts, "transforms", ()) or ())
    if not found:
        return
    double = [u for u in found if u[3] == DOUBLE_BACKWARD]
    guarded = [u for u in found if u[3] == TRANSFORM]
    for o in outcomes:
        if not o.hits:
            continue
        kept = []
        for h in o.hits:
            f = h.finding
            if _needs_guard(f):
                # s44: a double-backward call blocks only the files its code can reach (a toy script does not)
                reaching = [u for u in double if reach.reaches(u[0], u[1], o.file)]
                why = _double_backward_reason(reaching[0]) if reaching else _mark(h, guarded) if guarded else None
                if why is not None:
                    near.append({"pattern": f.pattern, "file": o.file, "qualname": f.qualname, "line": f.line,
                                 "end_line": f.end_line, "reason": why})
                    continue
            kept.append(h)
        o.hits = kept


def _mark(hit: Any, guarded: list[tuple[str, int, str, str]]) -> str | None:
    """Give ``hit``'s finding the fallback (its params, the guards inside its fused code, a note);
    the reason it cannot be given otherwise."""
    f = hit.finding
    rel, line, api, _ = guarded[0]
    fused = transform_guarded(f.fused)
    if fused is None:
        return (f"`{api}` at {rel}:{line} runs code under a functorch transform or forward-mode AD, where torch_npu's fused "
                "ops have no derivative, and npufuse could not add the fallback to the guards inside this fused code")
    if fused != f.fused:
        f.fused = fused
        hit.body = None  # the precomputed text holds the old fused lines: rendered again
    f.params[TRANSFORM_PARAM] = f"{rel}:{line}"
    more = f" and {len(guarded) - 1} more place(s)" if len(guarded) > 1 else ""
    f.notes.append(f"the repository runs code under a functorch transform or forward-mode AD (`{api}` at {rel}:{line}{more}); "
                   "torch_npu's fused ops have no forward-mode derivative, so the fused branch falls back to the original "
                   "while one is active (torch._C._are_functorch_transforms_active(), a forward_ad dual level)")
    return None


def _double_backward_reason(use: tuple[str, int, str, str]) -> str:
    rel, line, api, _ = use
    return (f"`{api}` at {rel}:{line} differentiates a backward again (torch.autograd.functional's jvp / hvp / vhp / hessian "
            "use the double-backward trick); torch_npu's fused ops have backward formulas only, with no derivative of the "
            "backward, and no run-time test tells when that code runs, so the fused branch cannot fall back there: "
            "rewrite by hand if the model never runs under it")
