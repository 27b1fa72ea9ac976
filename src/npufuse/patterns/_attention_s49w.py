"""s49 ho26misc: attention readings of the HO26 misses (no mask reading here: the mask readers are another helper's).

1. Heads folded into the batch (``(b h) n d``), the scores a ``torch.matmul`` / ``@`` of q and kᵀ, the product with V an
   einsum over 3-D subscripts (``b i j, b j d -> b i d``): the einsum proves the probabilities 3-D, so the scores, and
   the matmul making them, are 3-D. The matmul was read as a 4-D BNSD product where npufuse could not read q's rank
   (q unpacked from ``map(lambda t: rearrange(..), (q, k, v))``), and the near miss said the two products "disagree on
   the rank (3-D vs 4-D)" (false: both are 3-D). The product is read as the 3-D one it is; q's and k's ranks are
   checked at run time (a 2-D q broadcast against a 3-D k would also give 3-D scores).
"""

from __future__ import annotations

import ast
from typing import Any


def matmul_under_3d_einsum(matcher: Any, kind: str, chain: Any) -> bool:
    """Q@Kᵀ written as ``matmul`` / ``@`` inside a chain whose P@V is a 3-D einsum (see the module docstring)."""
    if kind not in ("matmul", "@") or not getattr(matcher, "three_d", False) or chain.spelling[-1:] != ["einsum"]:
        return False
    chain.s49_qk_rank_unproven = True
    return True


def require_3d_ranks(chain: Any) -> str | None:
    """After the scores are read: the run-time rank check of q and k for :func:`matmul_under_3d_einsum`; a reason where
    an operand is a call whose rank cannot be checked without evaluating it again."""
    if not getattr(chain, "s49_qk_rank_unproven", False) or chain.q is None or chain.k is None:
        return None
    from npufuse.patterns import _attention_s35

    bases = [_attention_s35.rank_base(op.leaf) for op in (chain.q, chain.k)]
    if any(b is None for b in bases):
        return ("the probabilities' einsum is 3-D, so the scores' matmul is too, but q or k reaches it as a call whose rank "
                "npufuse does not check at run time (a 2-D operand would broadcast)")
    ranks = [ast.Compare(left=ast.Call(func=ast.Attribute(value=b, attr="dim", ctx=ast.Load()), args=[], keywords=[]),
                         ops=[ast.Eq()], comparators=[ast.Constant(3)]) for b in bases]
    chain.requires.append((ast.BoolOp(op=ast.And(), values=ranks),
                           "the scores' matmul is read as 3-D (the einsum with the values is 3-D): q's and k's ranks are "
                           "checked at run time; other ranks run the original code"))
    return None


# --- 3. ``self.<tensor>.size(0)`` is no module call (HO26b neural-operator's ``min(self.relative_position_bias.size(0),
# ..)`` in an optional bias branch): a shape read of a Parameter / buffer / tensor attribute has no effect, so the fused
# branch reading it again costs nothing; the near miss called it "a module call evaluated twice" (false) ---

# (s50) and the tensor methods that return a new tensor (a cast, a view) or a shape without touching state or drawing
# numbers: ``self.weight.to(x.dtype)`` / ``self.scale.type_as(x)`` of a Parameter is no module call either
_SHAPE_READS = ("size", "dim", "numel", "nelement", "ndimension", "to", "type_as", "float", "half", "bfloat16", "double",
                "contiguous", "detach", "view", "reshape", "view_as", "reshape_as", "t", "transpose", "permute", "unsqueeze",
                "squeeze", "expand", "expand_as", "flatten")
_TENSOR_CTORS = ("torch.nn.Parameter", "torch.nn.parameter.Parameter", "torch.zeros", "torch.ones", "torch.empty", "torch.randn",
                 "torch.rand", "torch.tensor", "torch.arange", "torch.full", "torch.eye", "torch.linspace")


def tensor_shape_reads(module: Any, cls: ast.ClassDef) -> set[str]:
    """``self.<attr>.size`` (and dim / numel) chains of a class whose every assignment of ``self.<attr>`` in its methods
    is an ``nn.Parameter(..)`` or a torch tensor factory, or which registers ``<attr>`` as a buffer (and never assigns
    it otherwise): reading its shape twice has no effect."""
    from npufuse.scan.dataflow import const_value, dotted, fast_walk

    cache = module.__dict__.setdefault("_npufuse_s49_shape_reads", {})
    if cls.name in cache:
        return cache[cls.name]
    kinds: dict[str, bool] = {}
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in fast_walk(fn):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "register_buffer" \
                    and dotted(n.func.value) == "self" and n.args and isinstance(const_value(n.args[0]), str):
                kinds.setdefault(const_value(n.args[0]), True)
                continue
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                for part in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                    if not (isinstance(part, ast.Attribute) and dotted(part.value) == "self"):
                        continue
                    value = n.value if isinstance(n, (ast.Assign, ast.AnnAssign)) and part is t else None
                    ok = isinstance(value, ast.Call) and (module.canonical(value.func) or "") in _TENSOR_CTORS
                    kinds[part.attr] = kinds.get(part.attr, True) and ok
    out = cache[cls.name] = {f"self.{a}.{m}" for a, ok in kinds.items() if ok for m in _SHAPE_READS}
    return out


# --- 2. a window bias and a window mask added in one sum through a 5-D view of the scores (Pangu-style Earth attention:
# ``s = s.view(B // nW, nW, H, T, T); s = s + bias + mask; s = s.view(B, H, T, T)``). _attention_s37.view_around_add
# reads ``(s.view(A) + M).view(B)`` with one term; here the sum holds several terms. Each term is broadcast in the
# viewed shape, the sum of zeros viewed as A and the terms (in the code's order) brought back with ``view_as`` is the
# pse: exact for any float values (a learned bias, a finite shifted-window mask) ---

def view_around_sum(m: Any, node: Any, chain: Any, stop: Any) -> Any:
    """(the scores before the round trip, the terms in the scores' shape) where ``node`` is ``(s.view(A) + M1 + M2 ..)
    .view(B)`` with two or more terms, exactly one operand reaching the scores; None otherwise."""
    from npufuse.patterns import _attention_s37 as s37
    from npufuse.patterns.attention import Ref, deref

    if not s37._view_call(m, node) or len(node.args) < 2:
        return None
    summed = deref(node.func.value)
    operands: list[Any] = []

    def flat(n: Any) -> None:
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add) and len(operands) < 8:
            flat(n.left)
            flat(n.right)
        else:
            operands.append(n)

    if not (isinstance(summed, ast.BinOp) and isinstance(summed.op, ast.Add)):
        return None
    flat(summed)
    if len(operands) < 3:
        return None  # one term: _attention_s37.view_around_add
    reaching = [i for i, o in enumerate(operands) if m._reaches(o, stop)]
    if len(reaching) != 1:
        return None
    inner = operands[reaching[0]]
    viewed = deref(inner)
    if not (s37._view_call(m, viewed) and len(viewed.args) > len(node.args)):
        return None
    base = viewed.func.value
    if not isinstance(base, Ref) or not m._reaches(base, stop):
        return None
    if [ast.dump(s37._plain(a)) for a in viewed.args[-2:]] != [ast.dump(s37._plain(a)) for a in node.args[-2:]]:
        return None
    deref(node.func.value, chain.seen)
    deref(inner, chain.seen)
    zeros = ast.Call(func=ast.Attribute(value=ast.Name("torch", ast.Load()), attr="zeros_like", ctx=ast.Load()), args=[base], keywords=[])
    spread = ast.Call(func=ast.Attribute(value=zeros, attr=viewed.func.attr, ctx=ast.Load()), args=list(viewed.args), keywords=[])
    total: Any = None
    for i, o in enumerate(operands):
        t = spread if i == reaching[0] else o
        total = t if total is None else ast.BinOp(left=total, op=ast.Add(), right=t)
    back = ast.Call(func=ast.Attribute(value=total, attr="view_as", ctx=ast.Load()), args=[base], keywords=[])
    chain.spelling.append("term_added_through_a_view")
    terms = " + ".join(m.src(o)[:40] for i, o in enumerate(operands) if i != reaching[0])
    chain.notes.append(f"`{m.src(node)[:60]}`: the scores viewed as `{m.src(viewed)[:60]}` to add `{terms}`, then viewed back: "
                       "the terms are broadcast in the viewed shape and passed in the scores' shape (pse)")
    return base, back
