"""Rope fixes of the s44 precision audit (helper audit44), read on code npufuse had never seen.

* ``view_as_real(xc * f).flatten(3)`` merges the lane-pair axis back only where the real view is 5-D, i.e. x is 4-D
  (OpenDiT / Vchitect ``apply_rotary_emb``). The complex form's fused branch also takes 3-D tokens ``[T, N, D]``
  (lifted to one batch) and returns ``[T, N, D]``, where ``flatten(3)`` of the 4-D real view ``[T, N, D/2, 2]`` is a
  no-op: the original returns ``[T, N, D/2, 2]``. With a literal ``flatten(3)`` the fused call runs only on 4-D x.
  (``flatten(-2)`` merges the last two dims whatever the rank: unchanged.)
"""

from __future__ import annotations

import ast

from npufuse.scan.dataflow import const_value, keyword


def flatten3_rank_condition(node: ast.AST, xc_src: str) -> str | None:
    """The run-time test ``xc.dim() == 4`` where ``node`` is ``<view_as_real(..)>.flatten(3)`` (start dim the literal 3,
    no end dim), the complex lanes ``xc`` being what x's pairs view gives; None for any other merge."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "flatten"):
        return None
    if len(node.args) + len(node.keywords) != 1:
        return None
    start = const_value(keyword(node, "start_dim", 0))
    if start != 3 or isinstance(start, bool):
        return None
    return f"{xc_src}.dim() == 4"
