"""s44 (helper sweep44): rope forms the s44 sweep found missed, read by class.

1. The rotated halves written as named parts (``y1 = x1 * cos + x2 * sin``; ``y2 = x1 * (-sin) + x2 * cos``;
   ``cat((y1, y2), 3)``) over halves cut with the last axis spelled by its index on a 4-D tensor
   (``x1, x2 = x.chunk(2, dim=3)``, a single-file MLA's rotary): the named-halves reader found the halves' tensor
   through the shared lane reader, which reads ``-1`` only, while the rotation's own halves reader (``_Halves``)
   and the joining ``cat(.., 3)`` already take 3 as the last axis of the 4-D tensor the op requires. The tensor
   is taken from a ``chunk`` / ``split`` call that ``_Halves`` itself accepts as x's halves.
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Optional

from npufuse.scan.dataflow import Scope


def _split_receiver(call: ast.expr) -> Optional[ast.expr]:
    """x of ``x.chunk(..)`` / ``x.split(..)`` / ``torch.chunk(x, ..)`` / ``torch.split(x, ..)``; None otherwise."""
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute) or call.func.attr not in ("chunk", "split"):
        return None
    if isinstance(call.func.value, ast.Name) and call.func.value.id == "torch":
        return call.args[0] if call.args else None
    return call.func.value


def indexed_split_source(scope: Scope, factors: list[ast.expr], resolve: Callable[[Scope, ast.expr], ast.expr],
                         halves_of: Callable[[ast.expr], Any]) -> Optional[ast.expr]:
    """The tensor whose halves one of ``factors`` is (``x1`` bound by ``x1, x2 = x.chunk(2, dim=3)``), where the
    rotation's halves reader built for that tensor (``halves_of(x)``) names the factor its first or second half;
    None otherwise. ``resolve`` follows a name to its value (``a, b = call`` gives ``call[0]``)."""
    for f in factors:
        value = resolve(scope, f)
        if not (isinstance(value, ast.Subscript) and isinstance(value.value, ast.Call)):
            continue
        x = _split_receiver(value.value)
        if x is None:
            continue
        if halves_of(x).part(f) in ("first", "second"):
            return x
    return None
