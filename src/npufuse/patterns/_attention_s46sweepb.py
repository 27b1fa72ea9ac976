"""s46 (helper sweep46b): attention forms the s46 non-LLM recall sweep found missed, read by class.

1. NaN rows zeroed AFTER the dropout of the probabilities: ``torch.nan_to_num(self.dropout(softmax(s)))``
   (Spacetimeformer / Informer-family ``FullAttention``; also ``drop(p).masked_fill(torch.isnan(...), 0)`` spelt
   with nan_to_num). A row is NaN after the softmax exactly when every score of it is -inf; dropout keeps a NaN row
   NaN (NaN * 0 and NaN / (1 - p) are NaN) and leaves every other row NaN-free, so zeroing NaN after the dropout
   zeroes the same rows as zeroing it before: the s33 "NaN rows" handling applies unchanged. Anything else
   between the softmax and the nan_to_num (a scale, a second activation) stays a near miss.
2. The same NaN-row zeroing on BSND scores (einsum ``blhe,bshe->bhls`` with a ``blhd`` output): the fused output
   is [B, S, N, D] there, so the rows read off the [B, N | 1, Sq, Skv] mask are swapped to [B, Sq, N | 1, 1]
   (a 2-D [Sq, Skv] mask gives [Sq, 1, 1]).
"""

from __future__ import annotations

import ast
from typing import Any, Callable


def nan_zeroed_dropout(matcher: Any, zeroed: Any, deref: Callable[[Any], Any]) -> Any:
    """``zeroed`` (the operand of a NaN -> 0 step) when it is a dropout of a softmax: the dropout call, which the
    probability walk then strips as usual; None otherwise."""
    drop = matcher.dropout_of(deref(zeroed))
    if drop is None:
        return None
    return zeroed if matcher.softmax_of(deref(drop[0])) is not None else None


def bsnd_nan_rows(q: str) -> list[str]:
    """The lines binding ``_npufuse_rows``: the rows of a BSND fused output the original zeroed (NaN: every score
    -inf), read off the mask the call gets ([B, N | 1, Sq, Skv] -> [B, Sq, N | 1, 1]; [Sq, Skv] -> [Sq, 1, 1])."""
    return [f"_npufuse_rows = _npufuse_mask.all(-1, keepdim=True) if _npufuse_mask is not None else torch.zeros((), dtype=torch.bool, device={q}.device)",
            "_npufuse_rows = _npufuse_rows.transpose(-3, -2) if _npufuse_rows.dim() >= 3 else _npufuse_rows.unsqueeze(-2) "
            "if _npufuse_rows.dim() == 2 else _npufuse_rows  # [B, Sq, N | 1, 1]: rows the original zeroed (NaN: all -inf)"]


def common_factor_sum(matcher: Any, node: Any, reaches: Callable[[Any], bool], deref: Callable[[Any], Any]) -> Any:
    """3. ``(q @ kᵀ) * c + (q @ tableᵀ) * c`` (lucidrains' Conformer: Shaw's relative scores, each product scaled
    by the same ``self.scale`` before the sum) regrouped as ``(q @ kᵀ + q @ tableᵀ) * c``, which the positional-
    score reading takes apart; None unless both sides are ``X * c`` (or ``X / c``) with the same factor ``c`` that
    reads no score (a scalar: a name, an attribute, a constant)."""
    a, b = deref(node.left), deref(node.right)
    if not (isinstance(a, ast.BinOp) and isinstance(b, ast.BinOp) and type(a.op) is type(b.op)
            and isinstance(a.op, (ast.Mult, ast.Div))):
        return None
    if isinstance(a.op, ast.Div):
        pairs = [(a.left, a.right, b.left, b.right)]
    else:
        pairs = [(x1, f1, x2, f2) for x1, f1 in ((a.left, a.right), (a.right, a.left)) for x2, f2 in ((b.left, b.right), (b.right, b.left))]
    for x1, f1, x2, f2 in pairs:
        if not isinstance(f1, (ast.Name, ast.Attribute, ast.Constant)) or ast.dump(f1) != ast.dump(f2) or reaches(f1):
            continue
        if not (reaches(x1) and reaches(x2)):
            continue
        summed = ast.copy_location(ast.BinOp(left=x1, op=ast.Add(), right=x2), node)
        return ast.copy_location(ast.BinOp(left=summed, op=type(a.op)(), right=f1), node)
    return None
