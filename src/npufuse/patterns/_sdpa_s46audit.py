"""SDPA fixes of the s46 precision audit (helper audit46).

* The run-time device test (``_npufuse_on_npu(guard)``) read the first name of the query's text, which for a query
  written as a call of a plain function (auto-round's ``F.scaled_dot_product_attention(nhd_to_hnd(q), ...)``,
  ``apply_rope(q)``, ``rearrange(q, ...)``) is the function itself: a function has no ``is_npu``, so the fused
  branch could never run while the report promised a speed-up. The guard now names a tensor operand (the eager
  attention pattern's guard had the same defect: ``rearrange(q, ...)`` was guarded on ``rearrange``).
"""

from __future__ import annotations

import ast

from npufuse.scan.dataflow import fast_walk

_NOT_TENSORS = ("torch", "self", "F")


def guard_operand_name(q_src: str, not_tensors: tuple[str, ...] = _NOT_TENSORS) -> str:
    """The first name in source order in the query's text that is neither a module alias nor a called function (the
    name a call's ``func`` is): the tensor whose device the fused branch tests. The whole text when there is none."""
    tree = ast.parse(q_src, mode="eval")
    called = {id(n.func) for n in fast_walk(tree) if isinstance(n, ast.Call)}
    names = sorted((n.lineno, n.col_offset, n.id) for n in fast_walk(tree)
                   if isinstance(n, ast.Name) and n.id not in not_tensors and id(n) not in called)
    return names[0][2] if names else q_src
