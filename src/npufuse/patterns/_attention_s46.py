"""s46 (helper attn46): attention / sdpa, dead candidates and real development misses, read by class.

1. Ranks the code states through einops and module layers. :func:`attention.static_rank` did not read
   ``rearrange(x, '... n (h d) -> ... h n d')`` (einops: the output has the pattern's right-hand groups, an ellipsis
   standing for the input's unnamed leading axes), ``qkv[i]`` of ``qkv = x.chunk(3, dim=-1)`` (each chunk keeps the
   input's rank) or ``self.to_qkv(x)`` of an ``nn.Linear`` / norm / dropout layer (rank kept). UniAnimate's temporal
   attention builds q / k / v 5-D that way ([b, h*w, heads, f, d] from a 4-D [b, h*w, f, c]); the candidate's run-time
   ``q.dim() == 4`` test never held (audit45: a dead candidate). With the ranks read, 5-D operands take attn45's fold
   where it applies (no mask, or causal terms only) and are a near miss that says so otherwise.
"""

from __future__ import annotations

import ast
import contextvars
from typing import Any, Callable, Optional

from npufuse.scan.dataflow import const_value, dotted

# the file being read while operand ranks are worked out (``self.<layer>(x)`` needs the class's constructors)
_MODULE: "contextvars.ContextVar[Any]" = contextvars.ContextVar("npufuse_s46_rank_module", default=None)

# layers that map only the last axis (or normalise over trailing axes): the output has the input's rank
_RANK_KEEPING_LAYERS = {"Linear", "LayerNorm", "GroupNorm", "Dropout", "Identity", "RMSNorm", "LazyLinear"}


def _einops_groups(side: str) -> Optional[list[str]]:
    """The top-level axis groups of one side of an einops pattern (``'b (h w) f c'`` -> ['b', '(h w)', 'f', 'c']),
    ``'...'`` kept as a group; None for text that is not a well-formed side."""
    groups: list[str] = []
    depth, cur = 0, ""
    for ch in side.strip() + " ":
        if ch == "(":
            if depth:
                return None
            depth, cur = 1, "("
        elif ch == ")":
            if not depth:
                return None
            depth = 0
            groups.append(cur + ")")
            cur = ""
        elif ch.isspace():
            if not depth and cur:
                groups.append(cur)
                cur = ""
            elif depth:
                cur += " "
        else:
            cur += ch
    if depth or any(g != "..." and not g.startswith("(") and not (g.isidentifier() or g.isdigit()) for g in groups):
        return None
    return groups


def rearrange_rank(pattern: Any, input_rank: Optional[int]) -> Optional[int]:
    """The rank of ``einops.rearrange(x, pattern)`` for an ``x`` of ``input_rank`` (None when unknown); None when the
    pattern is not a literal einops pattern or its rank depends on an unknown input rank."""
    text = const_value(pattern)
    if not isinstance(text, str) or text.count("->") != 1:
        return None
    lhs, rhs = (_einops_groups(side) for side in text.split("->"))
    if lhs is None or rhs is None or lhs.count("...") > 1 or lhs.count("...") != rhs.count("..."):
        return None
    if "..." not in lhs:
        return len(rhs)
    if input_rank is None or input_rank < len(lhs) - 1:
        return None
    return input_rank - (len(lhs) - 1) + (len(rhs) - 1)


def _layer_keeps_rank(module: Any, class_name: Optional[str], attr: str) -> bool:
    """``self.<attr>`` is built in the class as a layer that keeps its input's rank (``nn.Linear(...)``)."""
    from npufuse.patterns.attention import _self_attr_ctor

    ctor = _self_attr_ctor(module, class_name, attr)
    name = module.canonical(ctor.func) if ctor is not None else None
    return name is not None and name.startswith("torch.nn.") and name.rpartition(".")[2] in _RANK_KEEPING_LAYERS


def _split_call(node: Any) -> Optional[tuple[str, Any]]:
    """(``chunk`` / ``split`` / ``unbind``, the tensor split) of ``x.chunk(..)`` / ``torch.chunk(x, ..)``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) or node.func.attr not in ("chunk", "split", "unbind"):
        return None
    if dotted(node.func.value) == "torch":
        return (node.func.attr, node.args[0]) if node.args else None
    return node.func.attr, node.func.value


def _callee_name(func: Any) -> Optional[str]:
    """The dotted name of a callee, a detector Ref read as its name (``rearrange`` imported at module level)."""
    from npufuse.patterns.attention import Ref

    return func.name if isinstance(func, Ref) and func.idx == -1 and func.value is None else dotted(func)


def _value_of(scope: Any, base: Any, line: int) -> Any:
    """The expression a name (a plain Name, or the detector's Ref: its value, else the local before the block) holds."""
    from npufuse.patterns.attention import Opaque, Ref, Undef

    if isinstance(base, ast.Name):
        return scope.definition(base.id, line)
    if isinstance(base, Ref):
        if base.value is not None and not isinstance(base.value, (Opaque, Undef)):
            return base.value
        return scope.definition(base.name, line) if base.idx == -1 else None
    return None


def stated_rank(scope: Any, node: Any, line: int, depth: int, rank: Callable[..., Optional[int]]) -> Optional[int]:
    """What :func:`attention.static_rank` (``rank``) leaves unread: einops ``rearrange`` with a literal pattern, an
    integer index of a name holding ``x.chunk(..)`` / ``split`` / ``unbind``, a rank-keeping layer ``self.<attr>(x)``."""
    if isinstance(node, ast.Call):
        name = _callee_name(node.func)
        module = _MODULE.get()
        if name is not None and len(node.args) >= 2 and \
                (module.canonical(ast.Name(name, ast.Load())) if module is not None and "." not in name else name) == "einops.rearrange":
            inner = rearrange_rank(node.args[1], None)
            return inner if inner is not None else rearrange_rank(node.args[1], rank(scope, node.args[0], line, depth + 1))
        func = node.func
        if module is not None and isinstance(func, ast.Attribute) and len(node.args) == 1 and not node.keywords \
                and _callee_name(func.value) == "self" \
                and _layer_keeps_rank(module, scope.class_name, func.attr):
            return rank(scope, node.args[0], line, depth + 1)
        return None
    if isinstance(node, ast.Subscript) and isinstance(const_value(node.slice), int):
        base = node.value
        value = _value_of(scope, base, line)
        split = _split_call(value)
        if split is None:
            return None
        r = rank(scope, split[1], getattr(value, "lineno", line), depth + 1)
        return None if r is None else r - 1 if split[0] == "unbind" else r
    return None


def operand_ranks(module: Any, scope: Any, operands: list[tuple[Any, Any]], line: int,
                  rank: Callable[..., Optional[int]]) -> list[Optional[int]]:
    """The ranks of the attention operands ``(stated rank or None, leaf)``, reading the file's layer constructors."""
    token = _MODULE.set(module)
    try:
        return [r if r is not None else rank(scope, leaf, line) for r, leaf in operands]
    finally:
        _MODULE.reset(token)
