"""affinity_where reason fix of the s45 precision audit (helper audit45), read on code npufuse had never seen.

R2 (Score-Entropy-Discrete-Diffusion's ``Uniform.score_entropy``): ``torch.where(x == x0, (self.dim - 1) / self.dim *
ratio * (ratio.log() - 1), ...)``. The near miss is right (``ratio.log()`` is -inf where ``ratio`` is 0, and lerp
turns the unselected -inf * 0 into NaN), but the reason quoted the first division met, ``(self.dim - 1) /
self.dim``: a ratio of configuration numbers (the vocabulary size), not what makes inf/NaN. A division by a bare
``self.<attr>`` with no call in its numerator is quoted only where the branch has no other unsafe op.
"""

from __future__ import annotations

import ast


def attribute_ratio(n: ast.BinOp) -> bool:
    """``(self.dim - 1) / self.dim``: a division by a bare ``self.<attr>`` whose numerator calls nothing (arithmetic on
    names, attributes and literals): usually configuration numbers, a weaker inf/NaN source than any call or a
    division by a computed value, so another unsafe op of the same branch is the one to quote."""
    right = n.right
    if not (isinstance(n.op, ast.Div) and isinstance(right, ast.Attribute) and isinstance(right.value, ast.Name)
            and right.value.id == "self"):
        return False
    return not any(isinstance(m, (ast.Call, ast.Subscript)) for m in ast.walk(n.left))
