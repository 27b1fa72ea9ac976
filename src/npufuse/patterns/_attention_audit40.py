"""s40 precision audit (helper ``audit40``): attention forms that compiled into a fused call the op rejects.

* An einsum written with ``...`` (``"... i d, ... j d -> ... i j"``) fixes no rank: LLaVA-NeXT's perceiver feeds it
  5-D ``b h t n d`` tensors (einops ``rearrange_many``), which the 4-D BNSD call rejects. Where a rank is not
  known statically it is checked at run time (the original code runs otherwise).
* Heads folded into the batch (``F.multi_head_attention_forward`` copies: DINO / DETR) with a mask applied to the
  3-D ``[B*N, Sq, Skv]`` scores: such a mask is ``[1 | B*N, Sq, Skv]`` and has to become ``[B*N | 1, 1, Sq, Skv]``,
  while a padding mask applied through the ``[B, N, Sq, Skv]`` view is expanded over the heads and folded. Each
  term is brought to that form before the terms are combined (combined first, ``[B,1,1,S] | [1,T,S]`` broadcast to
  ``[B, B*N, T, S]``).
"""

from __future__ import annotations

import ast
import re
from typing import Any, Optional

from npufuse.patterns._attention_s35 import rank_base


_ELLIPSIS_EINSUM = re.compile(r"""einsum\(\s*(?:[rbuf]?)["'][^"']*\.\.\.""")


def ellipsis_einsum(module: Any, first: int, last: int) -> bool:
    """The site's text holds an einsum whose equation uses ``...`` (explicit subscripts state every rank)."""
    text = "".join(module.lines[first - 1:last])
    return "..." in text and _ELLIPSIS_EINSUM.search(text) is not None


def ellipsis_rank_check(chain: Any, operands: Any, ranks: list[Optional[int]]) -> Optional[str]:
    """Require, at run time, the rank the fused call reads (4, or 3 for a key/value shared by every head) of every
    einsum operand whose rank is not known here. Returns a near-miss reason where an operand cannot be checked."""
    tests: list[ast.expr] = []
    for (tag, op, text), rank in zip(operands, ranks):
        if rank is not None:
            continue
        base = rank_base(op.leaf)
        if base is None:
            return (f"the einsum's {tag} (`{text[:30]}`) has no stated rank (`...` in the equation) and reaches the product "
                    "as a call whose rank npufuse does not check at run time: npu_fusion_attention takes 4-D tensors only")
        want = 3 if op.heads_added else 4
        tests.append(ast.Compare(left=ast.Call(func=ast.Attribute(value=base, attr="dim", ctx=ast.Load()), args=[], keywords=[]),
                                 ops=[ast.Eq()], comparators=[ast.Constant(want)]))
    if tests:
        chain.requires.append((ast.BoolOp(op=ast.And(), values=tests) if len(tests) > 1 else tests[0],
                               "the einsum's `...` fixes no rank: q/k/v are checked to be 4-D at run time (other ranks, e.g. "
                               "5-D [B, N, T, S, D] media tokens, run the original code)"))
    return None


def fold_term_lambda(chain: Any, q: str, sq: str, sk: str) -> str:
    """The helper each mask term of a heads-in-batch chain goes through: a 3-D term (on the [B*N, Sq, Skv] scores)
    gains the head axis, a 1-D / 2-D one leading 1s, a 4-D one (on the [B, N, Sq, Skv] view) is expanded over the
    heads and folded like q. s43 (audit43, mmpose's ``residual_attn.unsqueeze(0)`` [1, N, Sq, Skv]): a per-head term
    gives the head count (its dim 1), a per-batch one the batch (its dim 0); B*N is q's dim 0 either way."""
    return (f"_npufuse_fold = lambda t: t.unsqueeze(1) if t.dim() == 3 else t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) "
            f"if t.dim() < 3 else (t.expand({q}.shape[0] // t.shape[1], t.shape[1], {sq}, {sk}) if t.shape[1] != 1 "
            f"else t.expand(t.shape[0], {q}.shape[0] // t.shape[0], {sq}, {sk})).reshape(-1, 1, {sq}, {sk})"
            "  # each mask term to [B*N | 1, 1, Sq, Skv] before they are combined")


def rows_lines(maybe_none: bool, sq: str, sk: str) -> list[str]:
    """The combined folded mask expanded over the query rows and the keys (the op broadcasts neither a [.., 1, Skv]
    nor, s44, a [.., Sq, 1] query-padding mask)."""
    guard = "_npufuse_mask is not None and " if maybe_none else ""
    return [f"if {guard}(_npufuse_mask.shape[2] != {sq} or _npufuse_mask.shape[3] != {sk}):",
            f"    _npufuse_mask = _npufuse_mask.expand(-1, -1, {sq}, {sk}).contiguous()"]


_DTYPE_CASTS = frozenset(("to", "float", "half", "bfloat16", "double", "type", "type_as"))


def cast_over_repeat(module: Any, chain: Any) -> Optional[str]:
    """Phi's ``key_states = repeat_kv(...)`` then ``key_states.to(torch.float32)`` in the product while the values
    are read as repeated: the repeat is there on both, behind a dtype cast on one (s38 and s40 audits found the old
    reason, "repeated on one of them only", false). The reason that holds, or None."""
    from npufuse.patterns.attention import Ref, _plain, repeat_info

    for tag, op in (("keys", chain.k), ("values", chain.v)):
        if op.repeat is not None:
            continue
        leaf = op.leaf
        if not (isinstance(leaf, ast.Call) and isinstance(leaf.func, ast.Attribute) and leaf.func.attr in _DTYPE_CASTS):
            continue
        inner = leaf.func.value
        for _ in range(4):
            if not (isinstance(inner, Ref) and inner.value is not None):
                break
            inner = inner.value
        if isinstance(inner, ast.Call) and repeat_info(module, _plain(inner)) is not None:
            return (f"the {tag} are repeated (GQA) and then cast (`.{leaf.func.attr}(...)`) in the product: npufuse does not read "
                    "the repeat through a dtype cast on one operand (an fp32 upcast of q and k for the scores)")
    return None
