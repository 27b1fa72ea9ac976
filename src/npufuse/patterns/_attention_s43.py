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


# --- the reference of a closeness check ----------------------------------------------------------------------------
# (HO19a llm-infer-engine's ``test_flash_attention``: ``out_ref = F.scaled_dot_product_attention(..)`` then
# ``assert torch.allclose(out_flash.cpu(), out_ref.cpu(), ..)``.) A kernel test compares the kernel under test with
# PyTorch's own attention; replacing that reference with the fused op compares one kernel with another instead of the
# math. Decided by dataflow, not by names: the site's result (the name it binds) is an argument of a closeness check
# later in the same function, or every call of the function holding the site feeds one (rms_norm's s28 rule).
_CLOSENESS_CHECKS = ("allclose", "assert_close", "assert_allclose", "isclose")


def closeness_reference(module: Any, scope: Any, stmt: ast.stmt) -> str | None:
    """The near-miss reason where what ``stmt`` computes is the reference a closeness check compares against."""
    from npufuse.scan.dataflow import fast_walk, text_holds_any

    if not text_holds_any(module, _CLOSENESS_CHECKS):
        return None  # cheap gate: no closeness check anywhere in the file
    fn = scope.node
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        name, line = stmt.targets[0].id, stmt.end_lineno or stmt.lineno
        for n in fast_walk(fn):
            if isinstance(n, ast.Call) and n.lineno > line \
                    and (getattr(n.func, "attr", None) in _CLOSENESS_CHECKS or getattr(n.func, "id", None) in _CLOSENESS_CHECKS):
                args = [*n.args, *(k.value for k in n.keywords)]
                if any(isinstance(m, ast.Name) and m.id == name for a in args for m in ast.walk(a)):
                    check = (dotted(n.func) or getattr(n.func, "attr", "check"))
                    return (f"reference implementation: `{name}` is compared with `{check}(..)` (line {n.lineno}) against the "
                            "output under test; replacing it would compare that output with the fused op instead of PyTorch's "
                            "reference")
    from npufuse.patterns.rms_norm import _s28_reference_check

    return _s28_reference_check(module, scope)
