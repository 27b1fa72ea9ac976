"""Attention fixes of the s44 precision audit (helper audit44), read on code npufuse had never seen.

* A flag the caller passes through ``**kwargs`` is the caller's choice as much as a parameter is (GPTQModel's
  DeepSeek-VL2 compat ``LlamaAttention.forward``: ``output_attentions = kwargs.pop("output_attentions", False)``, then
  ``if output_attentions: <eager attention returning the weights> else: attn_weights = None; <sdpa>``). The eager arm
  runs only where the caller asked for the weights: a fused call there returned None to every such caller.
"""

from __future__ import annotations

import ast

from npufuse.scan.dataflow import Scope


def flag_from_caller_kwargs(scope: Scope, name: str) -> bool:
    """``name`` is bound only from ``kwargs.pop("...")`` / ``kwargs.get("...")`` of the function's own ``**kwargs``
    parameter: a flag the caller passes, like a parameter of that name."""
    node = scope.node
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.args.kwarg is None:
        return False
    kwargs = node.args.kwarg.arg
    bound = scope.assignments.get(name, [])
    return bool(bound) and all(
        isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in ("pop", "get")
        and isinstance(value.func.value, ast.Name) and value.func.value.id == kwargs
        for _stmt, value in bound)
