"""s51 (late51misc, HO28a myllm): norms held in an ``nn.ModuleDict`` and looked up by the loop key.

``self.norms = nn.ModuleDict({name: RMSNorm(d) for name in names})`` then ``self.norms[name](x + h)``: the
list reader (``_list_elements``) took ``nn.ModuleList`` / ``nn.Sequential`` only, so a dict of norms gave no finding
and no near miss while the same add + norm on an attribute is found. A ModuleDict's values are read like a list's
elements: a dict comprehension's one value expression, a dict display's values, or ``self.norms[k] = X`` stores in
``__init__`` of an empty ``nn.ModuleDict()``; every value must be the same construction (the caller checks), so
whatever key the loop reads, the norm is that construction. Anything else changing the dict in ``__init__``
(``update``, ``pop``, ``setdefault``, a call taking it) leaves it unread.
"""

from __future__ import annotations

import ast

from npufuse.scan.dataflow import ModuleInfo, dotted, fast_walk


def dict_values(file: ModuleInfo, init: ast.FunctionDef | None, attr: str, value: ast.expr) -> list[ast.expr] | None:
    """The value constructions of ``self.<attr> = nn.ModuleDict(...)`` (``value``), None when not read."""
    if not (isinstance(value, ast.Call) and file.canonical(value.func) == "torch.nn.ModuleDict"
            and len(value.args) <= 1 and not value.keywords):
        return None
    elts: list[ast.expr] = []
    if value.args:
        arg = value.args[0]
        if isinstance(arg, ast.DictComp):
            elts = [arg.value]
        elif isinstance(arg, ast.Dict) and None not in arg.keys:
            elts = list(arg.values)
        else:
            return None  # a list of pairs, a dict built elsewhere: not read
    for n in fast_walk(init) if init is not None else ():
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and dotted(n.func.value) == f"self.{attr}":
            return None  # update / pop / setdefault
        if isinstance(n, ast.Subscript) and dotted(n.value) == f"self.{attr}" and isinstance(n.ctx, (ast.Store, ast.Del)):
            parent = next((p for p in fast_walk(init) if isinstance(p, ast.Assign) and n in p.targets), None)
            if parent is None or len(parent.targets) != 1:
                return None
            elts.append(parent.value)
    return elts or None
