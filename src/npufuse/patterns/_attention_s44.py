"""Attention constructs of the s44 pass (helper attn44: classes read from real development misses).

* **Attention sinks** (gpt-oss reference text, copied into FMS and many from-scratch repositories): a per-head logit
  column concatenated to the [B, N, Sq, Skv] scores on the key axis before the softmax, its probability column sliced
  away after (``torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(b, -1, sq, -1)], -1)``, softmax over -1,
  ``w[..., :-1]``). Spec 5.1 gives the exact semantics of npu_fusion_attention's ``sink`` (float32 ``[head_num]``):
  ``m = max(max_j S, sink_h)``, ``P = exp(S - m) / (sum_j exp(S - m) + exp(sink_h - m))``, the sink NOT scaled: the
  written code when the column holds one value per head (constant over batch and query rows), sits after every
  scale and mask term, and is exactly one column (the last, the one dropped). The column's base must be proved
  ``[1, N, 1, 1]``-shaped: ``X.reshape(1, -1, 1, 1)`` / ``X.view(1, h, 1, 1)`` / ``X[None, :, None, None]``, or a
  module parameter built in ``__init__`` as ``nn.Parameter(torch.<ctor>(1, h, 1, 1))`` (or ``(h, 1, 1)``), expanded
  with its last size kept (``-1`` / ``1``). Anything else keeps the s36 near miss "attention sinks".
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from npufuse.scan.dataflow import const_value, keyword, literal_ellipsis
from npufuse.patterns import _attention_s51p

_CATS = ("torch.cat", "torch.concat", "torch.concatenate")
_PARAM_CTORS = ("empty", "zeros", "ones", "randn", "rand", "full")


@dataclass
class SinkColumn:
    """A sink column found at the probabilities' slice: the softmax call, the scores it normalises without the
    column, and the base tensor holding one logit per head (its elements in head order)."""
    softmax: Any
    scores: Any
    base: Any
    # s48: the node under the slice the probabilities walk resumes at (the softmax, or a cast of it:
    # ``combined.softmax(dim=-1).to(q.dtype)[..., :-1]``, the cast then peeled as any other)
    resume: Any = None


def _is_one(node: Any) -> bool:
    return const_value(node) == 1


def _drops_last_column(matcher: Any, node: Any) -> bool:
    """``w[..., :-1]`` / ``w[:, :, :, :-1]``: every leading index a full slice or the ellipsis, the last ``:-1``."""
    if not isinstance(node, ast.Subscript):
        return False
    parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    last = parts[-1]
    if not (isinstance(last, ast.Slice) and last.lower is None and last.step is None and const_value(last.upper) == -1):
        return False
    lead = parts[:-1]
    # (s45 review) ``...`` is also const_value's "not a literal" answer (``w[b, :-1]``, ``w[0:2, :-1]``): the ellipsis is
    # the literal ``...`` node itself
    if any(not (literal_ellipsis(p) or isinstance(p, ast.Slice) and p.lower is None and p.upper is None and p.step is None)
           for p in lead):
        return False
    # without an ellipsis the index must name all four axes (the sliced one is the key axis)
    return any(literal_ellipsis(p) for p in lead) or len(parts) == 4



def _parameter_head_column(matcher: Any, node: Any) -> bool:
    """``self.<p>`` built in ``__init__`` as ``nn.Parameter(torch.<ctor>(1, h, 1, 1))`` or ``(h, 1, 1)``."""
    ctor = matcher._module_attr_ctor(node) if isinstance(node, ast.Attribute) else None
    if ctor is None or matcher.module.canonical(ctor.func) != "torch.nn.Parameter" or not ctor.args:
        return False
    inner = ctor.args[0]
    if not isinstance(inner, ast.Call):
        return False
    name = matcher.module.canonical(inner.func) or ""
    if not name.startswith("torch.") or name.rpartition(".")[2] not in _PARAM_CTORS:
        return False
    dims = list(inner.args)
    if name.endswith(".full"):
        dims = list(dims[0].elts) if dims and isinstance(dims[0], (ast.Tuple, ast.List)) else []
    elif len(dims) == 1 and isinstance(dims[0], (ast.Tuple, ast.List)):
        dims = list(dims[0].elts)
    if len(dims) == 4:
        return _is_one(dims[0]) and _is_one(dims[2]) and _is_one(dims[3])
    return len(dims) == 3 and _is_one(dims[1]) and _is_one(dims[2])


def _head_base(matcher: Any, node: Any, seen: set[int]) -> Any:
    """The tensor whose elements are the per-head logits of a [1, N, 1, 1] column ``node``, else None."""
    from npufuse.patterns.attention import deref

    node = deref(node, seen)
    if matcher.method(node, "reshape", "view") and len(node.args) == 4 and not node.keywords:
        a = node.args
        if _is_one(a[0]) and _is_one(a[2]) and _is_one(a[3]):
            return node.func.value
        return None
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 4:
        e = node.slice.elts
        if all(const_value(e[i]) is None and isinstance(e[i], ast.Constant) for i in (0, 2, 3)) \
                and isinstance(e[1], ast.Slice) and e[1].lower is None and e[1].upper is None and e[1].step is None:
            return node.value  # ``X[None, :, None, None]``: X is 1-D, else the result would not be 4-D
        return None
    if _parameter_head_column(matcher, node):
        return node
    return None


_FP32_NAMES = ("torch.float32", "torch.float")


def _fp32_cast(matcher: Any, node: Any) -> Any:
    """X of ``X.float()`` / ``X.to(torch.float32)`` / ``X.type(torch.float32)`` (``torch.float`` too), else None.
    (s48) a sink cast to float32 is the same logits the op's float32 ``sink`` reads; a cast to any other dtype
    rounds them, which the op would not, and is not read."""
    if matcher.method(node, "float") and not node.args and not node.keywords:
        return node.func.value
    if matcher.method(node, "to", "type") and len(node.args) == 1 and not node.keywords \
            and matcher.module.canonical(node.args[0]) in _FP32_NAMES:
        return node.func.value
    return None


def _peel_fp32(matcher: Any, node: Any, seen: set[int]) -> Any:
    from npufuse.patterns.attention import deref

    node = deref(node, seen)
    for _ in range(4):
        inner = _fp32_cast(matcher, node)
        if inner is None:
            return node
        node = deref(inner, seen)
    return node


def _sink_base(matcher: Any, column: Any, seen: set[int]) -> Any:
    """The per-head logits of a sink column [B, N, Sq, 1]: ``base.expand(b, -1, sq, -1)`` (or ``.repeat(b, 1, sq, 1)``)
    of a proved [1, N, 1, 1] base; None for anything else (a column per batch or row, several columns)."""
    from npufuse.patterns.attention import deref

    column = _peel_fp32(matcher, column, seen)  # s48: ``sinks.view(1, h, 1, 1).expand(...).float()``
    if matcher.method(column, "expand") and len(column.args) == 4 and not column.keywords:
        if const_value(column.args[3]) not in (-1, 1):
            return None
    elif matcher.method(column, "repeat") and len(column.args) == 4 and not column.keywords:
        if not (_is_one(column.args[1]) and _is_one(column.args[3])):
            return None
    else:
        return None
    return _head_base(matcher, _peel_fp32(matcher, column.func.value, seen), seen)  # s48: ``.view(1, h, 1, 1).float().expand``


def sink_column(matcher: Any, node: Any, seen: set[int]) -> SinkColumn | None:
    """``node`` is ``softmax(cat([scores, <sink column>], -1), -1)[..., :-1]`` (the row max possibly subtracted from the
    concatenation first: no change to a softmax) with a column proved to hold one logit per head: what it reads."""
    from npufuse.patterns.attention import _s36_last_dim_keepdim, deref

    if not _drops_last_column(matcher, node):
        return None
    resume = deref(node.value, seen)
    sm_node = softmax_under_casts(matcher, resume, seen)
    sm = matcher.softmax_of(sm_node)
    if sm is None or const_value(sm[1]) != -1:
        return None
    cat = deref(sm[0], seen)
    if isinstance(cat, ast.BinOp) and isinstance(cat.op, ast.Sub) and _s36_last_dim_keepdim(matcher, cat.right, seen, "max", "amax") is not None:
        cat = deref(cat.left, seen)
    if not (isinstance(cat, ast.Call) and matcher._fn(cat) in _CATS and cat.args and const_value(keyword(cat, "dim", 1)) == -1):
        return None
    parts = cat.args[0]
    if not isinstance(parts, (ast.List, ast.Tuple)) or len(parts.elts) != 2:
        return None
    base = _sink_base(matcher, parts.elts[1], seen)
    if base is None:
        return None
    return SinkColumn(sm_node, parts.elts[0], base, resume)


def softmax_under_casts(matcher: Any, node: Any, seen: set[int]) -> Any:
    """(s48) the softmax under dtype casts of the probabilities (``softmax(x, -1).to(q.dtype)``,
    ``.type_as(v)``): casts the probabilities walk peels anyway (``attention._CASTS``)."""
    from npufuse.patterns.attention import _CASTS, deref

    for _ in range(4):
        if matcher.softmax_of(node) is not None:
            return node
        if matcher.method(node, *_CASTS) and (node.func.attr != "to" or len(node.args) + len(node.keywords) <= 2):
            node = deref(node.func.value, seen)
            continue
        return node
    return node


# -- softmax over a key axis that is not the last ---------------------------------------------------------------------
# LoFTR's FullAttention (``QK = einsum("nlhd,nshd->nlsh", q, k)``, ``softmax(QK, dim=2)``, ``einsum("nlsh,nshd->nlhd",
# A, v)``), Transformer-XL text with sequence-first ``ijbn`` scores (``softmax(dim=1)``): the keys sit on the axis the
# P@V einsum contracts, and the softmax runs over that axis. Each (batch, head) slice is the same attention as in BNSD
# order, so s43's permuted-scores reading (q / k / v permuted to BNSD, mask terms permuted, the result permuted back)
# computes it once the key axis is that einsum's contracted one; the Q@Kᵀ einsum must produce the key letter on the
# same axis. A softmax over any other axis stays the near miss it was.

def einsum_key_axis(c: Any, p_sub: str) -> int | None:
    """The probabilities' axis a 4-D P@V einsum contracts with the values (None unless exactly one, on 4-D P)."""
    if c is None or len(p_sub) != 4 or len(c.summed) != 1 or c.summed not in p_sub:
        return None
    return p_sub.index(c.summed)


def softmax_over_einsum_key(matcher: Any, dim: Any, chain: Any) -> bool:
    """The softmax's ``dim`` names the key axis of 4-D einsum scores that is not the last: recorded on the chain
    (the permuted-scores reading then requires it); False otherwise, the caller's own check deciding."""
    axis = getattr(matcher, "s44_einsum_key", None)
    if axis is None or axis == 3 or getattr(matcher, "three_d", False) or getattr(matcher, "s28_rank", 4) != 4:
        return False
    if not isinstance(dim, int) or isinstance(dim, bool) or dim not in (axis, axis - 4):
        return False
    chain.s44_key_axis = axis
    return True


# -- query rows zeroed after the softmax --------------------------------------------------------------------------------
# retention's SelfAttention (``if padding_mask is not None: W = W.masked_fill(padding_mask.unsqueeze(-1), 0.0)``): the
# probabilities of whole query rows set to 0 after the softmax (padded queries). Row i of P @ V is sum_j P[i, j] v[j],
# so a row of P zeroed zeroes row i of the output and nothing else: the fused output gets the same masked_fill, the
# row mask broadcasting against [.., Sq, D] exactly as it did against [.., Sq, Skv] (its last size is 1 and every other
# axis of the output is the probabilities' own). Read only where the row mask provably has size 1 on the key axis
# (``X.unsqueeze(-1)``, an index ending in ``None``, possibly negated) and the output keeps the probabilities' axes
# (no transposed / permuted / re-viewed product: checked when the call is rendered). A mask over keys, or of unknown
# shape, stays the near miss "modified after softmax".

@dataclass
class ZeroedRows:
    """Query rows of the probabilities zeroed after the softmax: the row mask, and the branch test it runs under."""
    rows: Any
    test: Any = None
    negated: bool = False
    times: bool = False  # s51p: ``P * rows``: the output multiplied by the factor (not zeroed where it is True)


def _key_axis_one(matcher: Any, node: Any) -> bool:
    """``node`` has size 1 on its last axis by construction."""
    from npufuse.patterns.attention import deref

    node = deref(node)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Invert, ast.Not)):
        node = deref(node.operand)
    if matcher.method(node, "unsqueeze") and len(node.args) == 1 and const_value(node.args[0]) == -1:
        return True
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and node.slice.elts:
        # (s45 review) axes the index does not name stay after it: ``keep[:, None]`` of a [B, S] mask is [B, 1, S], a
        # mask over the KEYS. The last axis is the trailing ``None`` only behind an ellipsis (``X[..., None]``) or where
        # the index spells the 4 axes of the probabilities (``X[:, None, :, None]``: more axes of X would make the
        # masked probabilities 5-D, which the product with v and the fused output could not both be)
        elts = node.slice.elts
        last = elts[-1]
        spelled = any(literal_ellipsis(e) for e in elts) or len(elts) == 4
        return isinstance(last, ast.Constant) and last.value is None and spelled
    return False


# conversions a guard may evaluate again (the test ``mask is not None`` reads a mask rebound as ``mask.to(device)``)
_PURE_METHODS = frozenset({"to", "bool", "float", "half", "unsqueeze", "view", "reshape", "contiguous", "type_as", "logical_not"})


def _side_effect_free(matcher: Any, test: Any, pure_test: Any) -> bool:
    """The test calls nothing but pure predicates and tensor conversions (it is evaluated again by the fused branch)."""
    from npufuse.patterns.attention import Ref, is_meta

    if pure_test(matcher, test):
        return True
    stack, seen = [test], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, ast.AST) or id(n) in seen or len(seen) > 2000:
            continue
        seen.add(id(n))
        if is_meta(n):
            continue  # ``scores.device``: metadata, the tensor's values (and the calls making them) are not read
        if isinstance(n, ast.Call) and not (isinstance(n.func, ast.Attribute) and n.func.attr in _PURE_METHODS):
            return False
        if isinstance(n, Ref):
            stack.append(n.value)
            continue
        stack.extend(ast.iter_child_nodes(n))
    return True


def _row_zeroing(matcher: Any, step: Any, plain: Any) -> Any:
    """The row mask of ``step`` = ``plain.masked_fill(rows, 0)`` with rows of size 1 on the key axis, else None."""
    from npufuse.patterns.attention import deref

    step = deref(step)
    if not (matcher.method(step, "masked_fill", "masked_fill_") and len(step.args) == 2 and const_value(step.args[1]) in (0, 0.0)):
        return None
    receiver = step.func.value
    if not (receiver is plain or deref(receiver) is deref(plain)):
        return None
    return step.args[0] if _key_axis_one(matcher, step.args[0]) or _attention_s51p.row_predicate(matcher, step.args[0]) else None


def zeroed_query_rows(matcher: Any, node: Any, chain: Any) -> Any:
    """The probabilities before a query-row zeroing (unconditional, or one branch of ``if <flag>:``): recorded on the
    chain, the fused output zeroed the same way; None for anything else."""
    from npufuse.patterns.attention import Cond, Undef, _heavy, _pure_test

    if isinstance(node, Cond):
        a, b = node.body, node.orelse
        if isinstance(a, Undef) or isinstance(b, Undef):
            return None
        for step, plain, neg in ((a, b, False), (b, a, True)):
            rows = _row_zeroing(matcher, step, plain)
            if rows is not None:
                break
        else:
            return None
        if _heavy(node.test, through_meta=False) or not _side_effect_free(matcher, node.test, _pure_test) or not matcher._qk_softmax(plain):
            return None
        chain.s44_zeroed_rows.append(ZeroedRows(rows, node.test, neg))
        _attention_s51p.mark_rows(rows, chain)  # s51p: the row predicate's statements are steps of the site
        return plain
    if matcher.method(node, "masked_fill", "masked_fill_"):
        rows = _row_zeroing(matcher, node, node.func.value)
        if rows is None or not matcher._qk_softmax(node.func.value):
            return _attention_s51p.scaled_rows(matcher, node, chain)  # s51p: ``torch.masked_fill(P, rows, 0)`` lands here
        chain.s44_zeroed_rows.append(ZeroedRows(rows))
        _attention_s51p.mark_rows(rows, chain)  # s51p: ``all_masked = mask.all(-1, keepdim=True)`` is a step of the site
        return node.func.value
    from npufuse.patterns import _attention_s50c

    got = _attention_s50c.where_zeroed_rows(matcher, node)  # s50c: ``torch.where(valid_rows, p, 0)`` (keepdim rows)
    if got is not None and matcher._qk_softmax(got[0]):
        _attention_s50c.mark_row_statements(got[1], chain)
        chain.s44_zeroed_rows.append(ZeroedRows(got[1]))
        return got[0]
    return _attention_s51p.scaled_rows(matcher, node, chain)  # s51p: ``p * valid_rows``


def zeroed_rows_problem(chain: Any, three_d: bool, folded: bool, layout: str) -> str | None:
    """Why the fused output cannot take the recorded row zeroing (None: it can)."""
    if chain.out_perm is not None or chain.out_transposed or chain.p_transposed or chain.heads_in_batch or chain.scores_viewed \
            or chain.head_axis or folded or getattr(chain, "s43_score_axes", None) is not None \
            or (chain.out_layout != "BNSD" and not three_d):
        return ("query rows of the attention probabilities are zeroed after softmax, and the product with v does not keep the "
                "probabilities' axes here (transposed, permuted or re-viewed): npufuse zeroes the fused output's rows only where it does")
    return None
