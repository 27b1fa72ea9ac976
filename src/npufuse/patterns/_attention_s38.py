"""Attention constructs of the s38 pass (HO14 development data).

* Rank-aware reasons for a key transposed over positive dims (``k.transpose(1, 2)``): dims 1, 2 are the last two of a
  3-D key and not of a 4-D one, so whether "not the last two" is true depends on the key's rank. The rank is read
  where the code states it (:func:`attention.static_rank`); where it does not, the reason says the rank is not
  evident instead of asserting a 4-D layout (:func:`key_transpose_reason`).
* ``q @ k.transpose(1, 2)`` with q built 3-D by the code (a view / reshape with three sizes: UMbreLLa's static KV
  cache folds the query groups into ``[N_kv, G * Sq, D]`` and reads k / v as ``[N_kv, S, D]`` from a per-layer
  cache) while k / v come from places whose rank the code does not state: read as the 3-D bmm it is where the
  three ranks are checked at run time (:func:`three_d_retry_wanted`); other ranks run the original code.
"""

from __future__ import annotations

from typing import Any, Optional


def _rank_of(matcher: Any, node: Any) -> Optional[int]:
    from npufuse.patterns import _attention_s34
    from npufuse.patterns.attention import static_rank

    from npufuse.patterns import _attention_s35

    rank = static_rank(matcher.scope, node, matcher._line)
    if rank is None:
        rank = _attention_s35.rank_through_helpers(matcher, node, facts_only=True)  # s40: through helpers' returns
    if rank is None and _attention_s34.proven_3d(matcher, node):
        rank = 3
    return rank


def _last_two(dims: set, rank: int) -> bool:
    return {d % rank for d in dims if isinstance(d, int)} == {rank - 2, rank - 1} and len(dims) == 2


def key_transpose_reason(matcher: Any, key: Any, query: Any, dims: set, layout: str) -> str:
    """Why ``key.transpose(*dims)`` is refused as Kᵀ of a product read in ``layout``, stated for the key's rank
    where the code shows it: dims that are not the key's last two, or the last two of a key whose rank differs from
    the reading's, or (rank not evident) both possibilities."""
    shown = sorted(d for d in dims if isinstance(d, int))
    rank = _rank_of(matcher, key)
    if rank is not None and rank >= 2:
        if not _last_two(dims, rank):
            return f"key transposed over dims {shown}, not the last two of the {rank}-D key"
        q_rank = _rank_of(matcher, query)
        read = "3-D" if layout == "3D" else "4-D"
        q_text = f"q is {q_rank}-D" if q_rank is not None else "q's rank is not evident"
        return (f"key transposed over dims {shown}, the last two of the {rank}-D key, but the product is read {read} "
                f"({q_text}): the operands' ranks disagree")
    if shown == [1, 2]:
        q_rank = _rank_of(matcher, query)
        q_text = f"q is {q_rank}-D" if q_rank is not None else "q's rank is not evident either"
        return ("key transposed over dims [1, 2]: the last two only if the key is 3-D, and the code does not show the key's "
                f"rank ({q_text})")
    return f"key transposed over dims {shown}: not the last two of a 3-D or 4-D key (the key's rank is not evident)"


def three_d_retry_wanted(matcher: Any, key: Any, query: Any, dims: set, kind: str, layout: str) -> bool:
    """The 4-D reading of ``query @ key.transpose(1, 2)`` fails where the code builds q 3-D: worth reading the product
    as a bmm with every rank checked at run time (the key's rank is not shown, or shown 3-D)."""
    from npufuse.patterns import _attention_s34

    if kind not in ("matmul", "@") or layout == "3D" or dims != {1, 2}:
        return False
    k_rank = _rank_of(matcher, key)
    return k_rank in (None, 3) and _attention_s34.proven_3d(matcher, query)


def unchecked_operand(chain: Any) -> Optional[str]:
    """The role of an operand (q, k or v) whose rank the run-time check cannot read (it reaches the product as a call
    that may change the rank), else None: the 3-D reading of an unproven operand needs every rank checked."""
    from npufuse.patterns import _attention_s35

    for role, op in (("q", chain.q), ("k", chain.k), ("v", chain.v)):
        if op is None or _attention_s35.rank_base(op.leaf) is None:
            return role
    return None


# --- post-softmax zeroing of masked keys in the keep form (BMTrain / ModelCenter: ``score = torch.where(M, score, -inf)``
# then ``torch.where(M, softmax(score), 0)``), also on 3-D / heads-in-batch scores ---
FOLDED_MASK_ROWS = object()  # zero the rows the mask passed to the op masks entirely (3-D / heads-in-batch layouts)


def where_zero_parts(matcher: Any, node: Any) -> Optional[tuple[Any, Any, Any]]:
    """(P, the positions zeroed as a True = masked node, 0) of ``torch.where(M, P, 0)`` (P kept where M holds) or
    ``torch.where(M, 0, P)`` (P zeroed where M holds); the zero a literal or ``torch.scalar_tensor(0, ..)`` /
    ``torch.tensor(0, ..)``; None otherwise."""
    import ast

    from npufuse.patterns.attention import deref
    from npufuse.scan.dataflow import const_value

    if not (isinstance(node, ast.Call) and matcher._fn(node) == "torch.where" and len(node.args) == 3 and not node.keywords):
        return None

    def zero(n: Any) -> bool:
        n = deref(n)
        if isinstance(n, ast.Call) and matcher._fn(n) in ("torch.scalar_tensor", "torch.tensor") and n.args:
            n = deref(n.args[0])
        v = const_value(n)
        return v in (0, 0.0) and not isinstance(v, bool)

    m, a, b = node.args
    if zero(b) and not zero(a):
        return a, ast.UnaryOp(op=ast.Invert(), operand=m), b
    if zero(a) and not zero(b):
        return b, m, a
    return None


def _complement(matcher_free_node: Any) -> Optional[Any]:
    """M of ``~M`` / ``torch.logical_not(M)`` / ``M.logical_not()``, else None."""
    import ast

    from npufuse.patterns.attention import deref

    n = deref(matcher_free_node)
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.Invert, ast.Not)):
        return n.operand
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "logical_not":
        if not n.args and not n.keywords:
            return n.func.value
        if len(n.args) == 1 and not n.keywords:
            return n.args[0]
    return None


def value_key(node: Any) -> str:
    """A structural key of a symbolic value: names read before the block (Refs with no value, whose ``ast.dump`` is
    the same for every name) keep their name and assignment index, so ``mask`` and ``other`` differ."""
    import ast

    from npufuse.patterns.attention import _plain, deref

    return ast.dump(_plain(deref(node), keyed=True))


def same_masked_positions(term: Any, zeroed: Any) -> bool:
    """The mask term masks the scores exactly where ``zeroed`` (True = zeroed) holds: a bool term of the same
    mask (True = masked), or a keep term whose mask is the complement of ``zeroed``."""
    if term.kind == "masked":
        return value_key(term.node) == value_key(zeroed)
    if term.kind == "keep":
        inner = _complement(zeroed)
        return inner is not None and value_key(term.node) == value_key(inner)
    return False
