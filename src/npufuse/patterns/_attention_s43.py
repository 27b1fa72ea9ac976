"""Attention / SDPA constructs of the s43 pass (helper attnrope43: classes read from the real HO19a / HO19b misses).

* An additive term ``torch.where(c, <zeros>, <-inf>)`` (either order) holds only 0 and -inf whatever ``c`` is (torch.where
  takes its values from the two branches only; ``c`` must be a bool tensor): a 0 / -inf mask by construction, passed as
  the op's ``atten_mask`` (``term < 0``, True = masked out), even where ``c`` comes from a method of the class
  (HO19a deepseek-v3.2-from-scratch BlockSparseAttention: ``c`` is a block mask from ``self.get_block_mask(..)``
  expanded to tokens). The branches may be tensors, as written there: ``torch.zeros(1, ..)`` and ``torch.full((1,),
  float('-inf'), ..)``. A branch with any other value (a graded bias, a learned table) leaves the term as it was read.
"""

from __future__ import annotations

import ast
from typing import Any

from npufuse.patterns._attention_s42 import _VIEW_METHODS, _ZERO_TENSORS, _large_negative, _zero
from npufuse.scan.dataflow import dotted


def _last_name(call: ast.Call) -> str:
    name = dotted(call.func) or ""
    return name.rpartition(".")[2] if name else (call.func.attr if isinstance(call.func, ast.Attribute) else "")


def _zero_branch(n: Any) -> bool:
    """0 as a number, ``torch.zeros(..)`` / ``zeros_like(..)`` / ``x.new_zeros(..)`` or ``torch.tensor(0.)``."""
    if _zero(n):
        return True
    if not isinstance(n, ast.Call):
        return False
    last = _last_name(n)
    return last in _ZERO_TENSORS or last == "tensor" and bool(n.args) and _zero(n.args[0])


def _negative_branch(n: Any) -> bool:
    """-inf / finfo.min / <= -1e4 as a number, or a tensor filled with it: ``torch.full(shape, v)``,
    ``torch.full_like(x, v)``, ``x.new_full(shape, v)``, ``torch.tensor(v)``."""
    if _large_negative(n):
        return True
    if not isinstance(n, ast.Call):
        return False
    last = _last_name(n)
    if last in ("full", "full_like", "new_full") and len(n.args) >= 2:
        return _large_negative(n.args[1])
    fill = next((k.value for k in n.keywords if k.arg == "fill_value"), None)
    if last in ("full", "full_like", "new_full") and fill is not None:
        return _large_negative(fill)
    return last == "tensor" and bool(n.args) and _large_negative(n.args[0])


def where_zero_minus_inf(node: Any) -> bool:
    """``node`` (plain ast) is ``torch.where(c, zero, -inf)`` or ``torch.where(c, -inf, zero)``, possibly under views
    / float casts: a 0 / -inf tensor by construction, whatever ``c``."""
    for _ in range(8):
        if isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _VIEW_METHODS:
            node = node.func.value
        else:
            break
    if not (isinstance(node, ast.Call) and dotted(node.func) in ("torch.where", "where") and len(node.args) == 3 and not node.keywords):
        return False
    a, b = node.args[1], node.args[2]
    return _zero_branch(a) and _negative_branch(b) or _negative_branch(a) and _zero_branch(b)
