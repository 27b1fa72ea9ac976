"""s41 precision audit (helper ``audit41``): an attention form that compiled into a fused call computing something else.

* A boolean tensor ADDED to the scores (Kimi-VL's MoonViT ``eager_attention``: ``attention_mask = torch.zeros([1, S, S],
  dtype=torch.bool)``, True inside each packed sequence, then ``attn_weight += attention_mask``): the sum adds 1 where
  the mask is True and masks nothing, while the additive-mask conversion (``mask < 0``) read it as an all-False mask
  and, the tensor being built from ``zeros``, skipped the 0/-inf value check. Such a term is a near miss.
"""

from __future__ import annotations

import ast
from typing import Any, Optional



def _bool_dtype(node: Any) -> bool:
    """``torch.bool`` (its base may be a symbolic reference to ``torch``) or ``bool``."""
    return (isinstance(node, ast.Attribute) and node.attr == "bool") or (isinstance(node, ast.Name) and node.id == "bool")


def boolean_built(node: Any) -> bool:
    """``node`` (a symbolic value, dereferenced) is a boolean tensor by construction: a factory with
    ``dtype=torch.bool``, ``.bool()``, ``.to(torch.bool)`` or a comparison."""
    if isinstance(node, ast.Compare):
        return True
    if not isinstance(node, ast.Call):
        return False
    if any(k.arg == "dtype" and _bool_dtype(k.value) for k in node.keywords):
        return True
    if isinstance(node.func, ast.Attribute):
        if node.func.attr == "bool" and not node.args:
            return True
        if node.func.attr == "to" and any(_bool_dtype(a) for a in node.args):
            return True
    return False


def added_boolean_reason(text: str) -> str:
    return (f"the mask `{text[:40]}` added to the scores is a boolean tensor: the sum adds 1 where it is True (a bias, "
            "not a mask; nothing is masked), which no attention mask of npu_fusion_attention reproduces")




# * q, k, v whose rank nothing states (parameters of a helper: MoonViT's ``eager_attention(q, k, v, ...)`` takes packed
#   ``[T, N, D]`` tokens, transposed to 3-D ``[N, T, D]``): the matmuls run on any rank, the BNSD call takes 4-D only.
#   As for SDPA (``q.dim() == 4``, s38) and ``...`` einsums (s40), the rank is checked at run time, on the operands
#   bound for the call (before a shared key/value gains its head axis).
def unstated_ranks(operands: Any, ranks: list[Optional[int]]) -> list[tuple[str, int]]:
    """(tag, rank the fused call reads) of every operand whose rank is not known here."""
    return [(tag, 3 if op.heads_added else 4) for (tag, op, _text), rank in zip(operands, ranks) if rank is None]


def rank_test(unstated: list[tuple[str, int]], bound: dict[str, str], atom: Any) -> str:
    """The run-time rank condition on the bound operands (``q.dim() == 4 and k.dim() == 4``)."""
    return " and ".join(f"{atom(bound[tag])}.dim() == {want}" for tag, want in unstated)


# * ``F.softmax(sim, dim=1)`` on ``sim = a @ b.transpose(-1, -2)`` of 2-D operands (CLAP's prototype weighting): dim 1 IS
#   the key axis of 2-D [Sq, Skv] scores, so "not the last (key) dim" was false there. The reason names both cases.
DIM_ONE_SOFTMAX = ("softmax over dim 1: the key axis only of 2-D [Sq, Skv] scores (no batch or head axis), which "
                   "npufuse does not convert to the 4-D call; on 3-D / 4-D scores dim 1 is not the key axis")
