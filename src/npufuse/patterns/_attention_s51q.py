"""s51 late51attn2: a float term added to the scores that holds no query / key operand is a bias, not scores.

HO28c HyperFlowNet: ``scores = q @ k.transpose(-2, -1) * scale + graph_bias`` with ``graph_bias`` a learned log graph
affinity built by ``torch.bmm`` of pooling weights and an adjacency (no q or k in it). The peel found a matrix product
on both sides of the ``+`` and said "scores added to scores", which is false: only one side is a product of q and k.
Read by data flow, not by spelling: for each side taken as the scores, the other side is a bias where none of the
scores side's products, their operands, nor the tensors those operands are views / transposes of occur in it
(a tensor upstream of q and k, such as the input both are computed from, may). Where exactly one side reads as the
scores that way, or both do and one side's nearest product is closer to the sum (``q @ kᵀ * c`` against a bias whose
products sit under a log and a normalisation), the term goes the ordinary additive way (a bias -> pse, s28). A term
reading q or k (``q @ kᵀ + k @ kᵀ``) is still "scores added to scores".
"""

from __future__ import annotations

import ast
from typing import Any, Optional

# views / casts / transposes of a q or k operand: the tensor under them is the operand too
_VIEWS = frozenset({"transpose", "permute", "view", "reshape", "contiguous", "float", "half", "bfloat16", "to", "type_as",
                    "unsqueeze", "squeeze", "flatten", "unflatten", "mT", "T", "clone"})


def _operand_nodes(node: Any) -> set[int]:
    """ids of the operand and of the tensors it is a view / cast of (through Refs)."""
    from npufuse.patterns.attention import Ref

    out: set[int] = set()
    for _ in range(12):
        if node is None or id(node) in out:
            break
        out.add(id(node))
        if isinstance(node, Ref):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _VIEWS:
            node = node.func.value
        elif isinstance(node, ast.Attribute) and node.attr in ("mT", "T"):
            node = node.value
        else:
            break
    return out


def _products(matcher: Any, side: Any) -> list[tuple[Any, Any]]:
    """The outermost products of ``side`` (not those under another product: the input projections q and k are made by
    are upstream of the scores, not the scores)."""
    from npufuse.patterns.attention import Ref, is_meta

    found, stack, seen = [], [side], set()
    while stack and len(seen) < 4000:
        n = stack.pop()
        if not isinstance(n, ast.AST) or id(n) in seen or is_meta(n):
            continue
        seen.add(id(n))
        p = matcher.is_matmul(n)
        if p is not None:
            found.append((n, p))
            continue
        if isinstance(n, Ref):
            if n.value is not None:
                stack.append(n.value)
            continue
        stack.extend(ast.iter_child_nodes(n))
    return found


def _nearest_product(matcher: Any, side: Any) -> int:
    """Breadth-first distance from the side's top to its first product (Refs followed; 99: none within reach)."""
    from npufuse.patterns.attention import Ref, is_meta

    level, seen = [side], set()
    for depth in range(16):
        nxt = []
        for n in level:
            if not isinstance(n, ast.AST) or id(n) in seen or is_meta(n):
                continue
            seen.add(id(n))
            if matcher.is_matmul(n) is not None:
                return depth
            if isinstance(n, Ref):
                if n.value is not None:
                    nxt.append(n.value)
                continue
            nxt.extend(ast.iter_child_nodes(n))
        level = nxt
    return 99


def _free_of(matcher: Any, scores: Any, term: Any) -> bool:
    """No product of ``scores``, no operand of one (nor what the operand views) occurs in ``term``."""
    from npufuse.patterns.attention import walk_values

    prods = _products(matcher, scores)
    if not prods:
        return False
    banned: set[int] = set()
    for n, p in prods:
        banned.add(id(n))
        banned |= _operand_nodes(p.a) | _operand_nodes(p.b)
    return not any(id(n) in banned for n in walk_values(term, limit=4000))


def split_bias(matcher: Any, node: ast.BinOp) -> Optional[tuple[Any, Any]]:
    """(scores side, bias term) of ``a + b`` where one side holds no q / k operand of the other's products; else None."""
    fits = [(s, t) for s, t in ((node.left, node.right), (node.right, node.left)) if _free_of(matcher, s, t)]
    if len(fits) == 2:
        near = [_nearest_product(matcher, s) for s, _ in fits]
        if near[0] == near[1]:
            return None  # nothing tells which side is the scores
        fits = [fits[0] if near[0] < near[1] else fits[1]]
    return fits[0] if fits else None
