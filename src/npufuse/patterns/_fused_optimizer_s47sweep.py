"""s47 (sweep47a): an optimizer built in a function that only ever reads its ``param_groups``.

Ovis's ``train``: ``optimizer = torch.optim.AdamW(parameters, ...)`` is built to map each trainable parameter to its
learning rate for a printout (``for group in optimizer.param_groups: ...``); the HF ``Trainer`` is then made
without ``optimizers=`` and builds its own optimizer. Nothing steps the AdamW: the fused class would change no
update, and the candidate's value claim was untrue. Here such a construction is a near miss: the name it binds is a
local of a function (bound once, not global / nonlocal, no ``locals()`` / ``vars()`` / ``eval`` / ``exec`` in the
function), and every read of it (nested functions included) is ``<name>.param_groups``; the object is never called,
stepped, handed to a call, returned, yielded or stored.
"""

from __future__ import annotations

import ast
from typing import Any, Optional

_REFLECT = {"locals", "vars", "eval", "exec", "globals"}


def only_groups_read(scope: Any, stmt: ast.stmt) -> Optional[str]:
    """The near-miss reason when the optimizer ``stmt`` binds is only ever read for its ``param_groups``; None
    otherwise (a module-level construction, another target, any other read)."""
    node = scope.node
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        name = stmt.targets[0].id
    elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
        name = stmt.target.id
    else:
        return None
    if name in getattr(scope, "args", ()) or len(scope.assignments.get(name, [])) != 1:
        return None
    nodes = scope.nodes()
    if any(name in n.names for kind in (ast.Global, ast.Nonlocal) for n in nodes.get(kind, ())):
        return None
    if any(isinstance(c.func, ast.Name) and c.func.id in _REFLECT for c in nodes.get(ast.Call, ())):
        return None
    # any other binding of the name (a loop / with / del / walrus / nested def) leaves the reads undecided
    for n in nodes.get(ast.Name, ()):
        if n.id == name and not isinstance(n.ctx, ast.Load) and n is not getattr(stmt, "targets", [getattr(stmt, "target", None)])[0]:
            return None
    groups = {id(a.value) for a in nodes.get(ast.Attribute, ())
              if a.attr == "param_groups" and isinstance(a.value, ast.Name) and a.value.id == name and isinstance(a.ctx, ast.Load)}
    loads = scope.name_loads().get(name, [])
    if not loads or any(id(n) not in groups for n in loads):
        return None  # (never read at all: left to the other readers; read otherwise: it may step)
    lines = sorted({n.lineno for n in loads})
    where = ", ".join(str(ln) for ln in lines[:4]) + (", ..." if len(lines) > 4 else "")
    return (f"the optimizer `{name}` is never stepped here: `{scope.qualname}` only reads its `param_groups` (line "
            f"{where}) and never calls it, hands it to a call, returns or stores it, so a fused class in its place "
            "would run no update")
