"""s50 (ho27misc): ``F.scaled_dot_product_attention`` called through a module-level alias.

``attention = torch.nn.functional.scaled_dot_product_attention`` at the top of a file, then
``attention(q, k, v, attn_mask=..)`` in a forward: the call site names no SDPA word and the import
alias table does not hold an assignment, so the call was never seen (judge50, HO27b). The alias is
SDPA's itself where the file binds the name exactly once, at module level, to SDPA's dotted name,
no function rebinds it (``global``) and the calling function does not bind it locally; the site
is then read as the direct call it is (the call's arguments are SDPA's, positions included).
"""

from __future__ import annotations

import ast
import re

from npufuse.scan import bound_callee
from npufuse.scan.dataflow import ModuleInfo, Scope

_WORD = "scaled_dot_product_attention"


def assigned_aliases(module: ModuleInfo, names: set[str]) -> tuple[str, ...]:
    """The module-level names bound once, by ``name = <SDPA>`` (``names``: SDPA's canonical names), and by no
    ``global`` statement of the file (cached per module)."""
    cached = module.__dict__.get("_npufuse_s50_sdpa_assigned")
    if cached is not None:
        return cached
    found: list[str] = []
    if _WORD in module.source:
        for st in module.tree.body:
            if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                    and isinstance(st.value, (ast.Name, ast.Attribute)) and module.canonical(st.value) in names):
                continue
            name = st.targets[0].id
            if len(bound_callee.module_bindings(module, name)) != 1:
                continue  # bound again (another import, an ``if`` arm): which callable runs is not this one
            if re.search(rf"\bglobal\b[^\n]*\b{re.escape(name)}\b", module.source):
                continue  # a function may rebind it at run time
            found.append(name)
    cached = module.__dict__["_npufuse_s50_sdpa_assigned"] = tuple(found)
    return cached


def alias_call(module: ModuleInfo, scope: Scope, call: ast.Call, names: set[str]) -> bool:
    """``call`` calls SDPA through one of :func:`assigned_aliases` that the calling function sees unchanged."""
    f = call.func
    if not (isinstance(f, ast.Name) and f.id in assigned_aliases(module, names)):
        return False
    seen = bound_callee.name_bindings(module, scope.node, f.id)
    # the binding the function sees is the module-level one (not a local or an enclosing function's)
    return seen is not None and len(seen) == 1 and seen[0][0] is bound_callee.module_bindings(module, f.id)[0][0]
