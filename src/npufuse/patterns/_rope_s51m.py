"""s51 (late51misc, HO28b toy-wm / s49 cr21): the rotation partner of an interleaved rope filled lane by lane.

``r = torch.empty_like(x); r[..., 0::2] = -x[..., 1::2]; r[..., 1::2] = x[..., 0::2]`` then ``x * cos + r * sin``:
the two fills write every lane of ``r`` (even lanes, then odd lanes; ``canonical.filled_output`` takes only such
pairs, and neither fill reads ``r``), so ``r`` holds ``stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)``, the
interleaved rotate the reader knows. Only where the allocation and the two fills are consecutive statements of one
block and nothing else stores into ``r`` (a name, a subscript or an attribute target, an augmented assignment, a call
taking ``r``) between the fills and the read, so the value at the read is the filled one.
"""

from __future__ import annotations

import ast

from npufuse.scan import canonical
from npufuse.scan.dataflow import Scope

_BLOCK_FIELDS = ("body", "orelse", "finalbody")


def _blocks(fn: ast.AST):
    for node in ast.walk(fn):
        for field in _BLOCK_FIELDS:
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block


def _touches(stmt: ast.stmt, name: str) -> bool:
    """``stmt`` may change what ``name`` holds: stores to it or into it, or passes it to a call (in-place ops)."""
    for n in ast.walk(stmt):
        if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, (ast.Store, ast.Del)):
            return True
        if isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.ctx, ast.Store):
            base = n.value
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name) and base.id == name:
                return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) \
                and n.func.value.id == name and n.func.attr.endswith("_"):
            return True
    return False


def filled_partner(scope: Scope, name: ast.Name, alloc_value: ast.expr) -> ast.expr | None:
    """The value ``name`` holds at its read when its definition ``alloc_value`` (``empty_like(x)`` /
    ``zeros_like(x)``) is followed right away by two lane fills covering the last dim; None otherwise."""
    if not (isinstance(alloc_value, ast.Call) and isinstance(alloc_value.func, ast.Attribute)
            and alloc_value.func.attr in ("empty_like", "zeros_like")):
        return None
    fn = scope.node
    use_line = getattr(name, "lineno", None)
    if fn is None or use_line is None:
        return None
    for block in _blocks(fn):
        for i, st in enumerate(block):
            if not (isinstance(st, ast.Assign) and st.value is alloc_value):
                continue
            if i + 3 > len(block):
                return None
            found = canonical.filled_output(block[i:i + 3])
            if found is None or found[0] != name.id:
                return None
            after = block[i + 3:]
            end = block[i + 2].end_lineno or block[i + 2].lineno
            if use_line <= end:
                return None
            for later in after:
                if later.lineno >= use_line:
                    break
                if _touches(later, name.id):
                    return None
            if not any(later.lineno <= use_line <= (later.end_lineno or later.lineno) for later in after):
                return None  # the read sits in another block (a loop, a branch): not shown to follow the fills
            return found[1]
    return None


# -- 2. ``x.split(h, -1)`` at a split point not provably x's last dim // 2 (HO28a IISuperluminaLII) ------------------
#
#     q1, q2 = q.split(self.head_dim // 2, -1)
#
# The halves reader took ``split`` only at ``x.shape[-1] // 2`` while the same point written as slices
# (``q[..., :h]``, ``q[..., h:]``) is taken under the run-time check ``q.shape[-1] == 2 * (h)`` (the original code
# runs elsewhere). ``split(h, -1)`` gives exactly the two halves where that check holds, so it is read the same way,
# by callers that fuse under the collected checks (``allow_split``) only.


def split_at_checked_point(halves, size: ast.expr | None, x: ast.expr, split_point, dead_own_split) -> bool:
    """``x.split(size, -1)`` as the halves of x under the check ``x.shape[-1] == 2 * (size)`` (appended to
    ``halves.split_checks``); False where the caller takes no checks or ``size`` is no re-readable split point."""
    if size is None or not halves.allow_split or not split_point(halves.scope, size):
        return False
    if dead_own_split(halves.scope, halves.is_x, size):
        return False  # from x's own shape, not its last dim's half: a check never true
    text = ast.unparse(x)
    base = text if isinstance(x, (ast.Name, ast.Attribute)) else f"({text})"
    check = f"{base}.shape[-1] == 2 * ({ast.unparse(size)})"
    if check not in halves.split_checks:
        halves.split_checks.append(check)
    return True
