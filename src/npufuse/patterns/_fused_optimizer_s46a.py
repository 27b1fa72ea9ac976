"""s46 (helper sweep46a): fused_optimizer forms from the s46 LLM recall sweep, read by class.

An implementation-choice keyword (``fused=``, ``foreach=``, ``capturable=``) whose value asks the runtime a
question: ``fused=fused and torch.cuda.is_available()`` (a hybrid Mamba / xLSTM trainer),
``foreach=torch.cuda.device_count() > 0``, ``fused="fused" in inspect.signature(AdamW).parameters``. Those
keywords pick how torch.optim runs, not what it computes, at any value; the question they ask reads device or
signature facts and changes nothing, so dropping it from the fused call drops no work. Near miss kept: any
other call in the value (``fused=make_flag()`` may do work the program relies on).
"""

from __future__ import annotations

import ast

from npufuse.scan.dataflow import dotted, fast_walk

# Calls that only read facts of the runtime (device availability and capability, a signature, an attribute's
# presence or a type): evaluating them or not changes nothing the program computes
_QUERY_CALLS = ("is_available", "is_bf16_supported", "is_built", "device_count", "get_device_capability",
                "signature", "hasattr", "isinstance", "getattr")


def runtime_query(node: ast.AST) -> bool:
    """Is every call inside ``node`` a runtime query of ``_QUERY_CALLS`` (and nothing else has effects)?"""
    for n in fast_walk(node):
        if isinstance(n, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom, ast.Lambda)):
            return False
        if isinstance(n, ast.Call):
            name = dotted(n.func)
            if name is None or name.rsplit(".", 1)[-1] not in _QUERY_CALLS or n.keywords:
                return False
    return True
