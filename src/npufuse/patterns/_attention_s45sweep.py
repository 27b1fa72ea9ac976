"""s45 (helper sweep45): attention forms the s45 recall sweep found missed, read by class.

1. A scale read back to the host with ``.item()`` from a tensor made of Python numbers
   (``torch.sqrt(torch.FloatTensor([self.n_heads])).item()``, the Alibaba BST recommender; also
   ``torch.tensor([d]).rsqrt().item()``): the value is a Python float the original already holds before the
   scores are made, so the fused call takes the same name. The ``.item()`` refusal stays for anything read from
   a learned or computed tensor (``self.logit_scale.exp().item()``, a statistic of the scores).
"""

from __future__ import annotations

import ast
from typing import Any, Callable

# the torch constructors whose value is the Python number(s) they are given (CPU tensors unless ``device=``)
_NUMBER_TENSOR_CONSTRUCTORS = frozenset((
    "torch.tensor", "torch.as_tensor", "torch.scalar_tensor", "torch.Tensor", "torch.FloatTensor", "torch.DoubleTensor",
    "torch.HalfTensor", "torch.BFloat16Tensor",
))
# elementwise math that keeps a host-number tensor a host number (one operand, no other tensor read)
_HOST_MATH = frozenset(("sqrt", "rsqrt", "reciprocal", "log", "exp", "float", "double", "abs"))


def _number_tensor(matcher: Any, node: Any, deref: Callable[[Any], Any], scalar_valued: Callable[[Any, Any], bool],
                   depth: int = 0) -> bool:
    """``node`` is a tensor holding one value computed from Python numbers only: a constructor of a number (or of a
    one-item list / tuple of one), elementwise math on such a tensor, or arithmetic with Python numbers."""
    n = deref(node)
    if depth > 6:
        return False
    if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)):
        sides = [scalar_valued(matcher, s) or _number_tensor(matcher, s, deref, scalar_valued, depth + 1) for s in (n.left, n.right)]
        return all(sides) and not all(scalar_valued(matcher, s) for s in (n.left, n.right))
    if not isinstance(n, ast.Call):
        return False
    fn = matcher._fn(n) or ""
    if fn in _NUMBER_TENSOR_CONSTRUCTORS and len(n.args) == 1:
        value = n.args[0]
        if isinstance(value, (ast.List, ast.Tuple)):
            if len(value.elts) != 1:
                return False
            value = value.elts[0]
        return scalar_valued(matcher, value)
    if fn.startswith("torch.") and fn.rpartition(".")[2] in _HOST_MATH and len(n.args) == 1 and not n.keywords:
        return _number_tensor(matcher, n.args[0], deref, scalar_valued, depth + 1)
    if isinstance(n.func, ast.Attribute) and n.func.attr in _HOST_MATH and not n.args and not n.keywords \
            and not fn.startswith(("torch.", "math.", "np.", "numpy.")):
        return _number_tensor(matcher, n.func.value, deref, scalar_valued, depth + 1)
    return False


def item_of_host_number(matcher: Any, factor: Any, deref: Callable[[Any], Any],
                        scalar_valued: Callable[[Any, Any], bool]) -> bool:
    """``factor`` is ``t.item()`` (or ``float(t)``) of a tensor made from Python numbers only: a Python float the
    original computes before the scores exist, so the fused call may take it as its scale."""
    f = deref(factor)
    if not isinstance(f, ast.Call) or f.keywords:
        return False
    if isinstance(f.func, ast.Attribute) and f.func.attr == "item" and not f.args:
        inner = f.func.value
    elif isinstance(f.func, ast.Name) and f.func.id == "float" and len(f.args) == 1:
        inner = f.args[0]
    else:
        return False
    return _number_tensor(matcher, inner, deref, scalar_valued)
