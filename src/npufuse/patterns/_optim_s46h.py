"""s46 (ho23fix46): an optimizer construction that is never used, because its name is rebound first.

HO23b Mini-DiT (a training script at module level)::

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    criterion = nn.MSELoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.05)

The first optimizer is never stepped: replacing it changes nothing (the second construction is the site). Reported as a
near miss with that reason, only where it is exact: the name is rebound by a plain assignment later in the same block,
and no statement between reads it (nothing loads the name, and no call there can reach it: no function of this module,
no ``globals()`` / ``locals()`` / ``eval`` / ``exec``).
"""

from __future__ import annotations

import ast
from typing import Optional

from npufuse.scan.dataflow import ModuleInfo

_REFLECTIVE = {"globals", "locals", "vars", "eval", "exec", "getattr"}


def _may_read(module: ModuleInfo, stmt: ast.stmt, name: str) -> bool:
    for n in ast.walk(stmt):
        if isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Store):
            return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) \
                and (n.func.id in _REFLECTIVE or n.func.id in module.functions or n.func.id in module.classes):
            return True  # a function of this module may read the global; reflection may read anything
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.Global, ast.Nonlocal)):
            return True  # a definition that may capture the name: not followed
    return False


def rebound_before_read(module: ModuleInfo, block: list[ast.stmt], i: int) -> Optional[int]:
    """The line of the plain assignment rebinding the name ``block[i]`` (``name = <optimizer>``) binds, when it comes
    later in the same block and no statement between may read the name; None otherwise."""
    stmt = block[i]
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    name = stmt.targets[0].id
    for later in block[i + 1:]:
        if isinstance(later, ast.Assign) and len(later.targets) == 1 and isinstance(later.targets[0], ast.Name) \
                and later.targets[0].id == name:
            return None if _may_read(module, later, name) else later.lineno  # `opt = wrap(opt)` reads it
        if _may_read(module, later, name) or not isinstance(later, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr)):
            return None  # read, or control flow / a with / an import that may bind or use it: not followed
    return None
