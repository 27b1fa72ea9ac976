"""s47 (fix47h): softmax helpers decorated with AMP's ``custom_fwd``.

HO23a JorgeVanco/LLM-from-scratch (CS336 style; the softmax lives in ``src/utils/utils.py``)::

    @torch.amp.custom_fwd(device_type='cuda', cast_inputs=torch.float32)
    def softmax(x, dim):
        max_x = x.amax(dim=dim, keepdim=True)
        e = (x - max_x).exp()
        return e / e.sum(dim=dim, keepdim=True)

``canonical.softmax_body`` refused every decorator outside a short identity list, so the attention whose
probabilities come from this helper had no softmax at all: the site was dropped without a near miss. What the
decorator does (torch/amp/autocast_mode.py ``custom_fwd``): it records the autocast dtype on its first argument;
without ``cast_inputs`` it calls the function as written; with ``cast_inputs=torch.float32`` it calls it as written
when autocast is off for ``device_type`` and, when autocast is on, on float32 copies of the floating inputs with
autocast off. Either way the value is the softmax of the input (computed in float32 under autocast, as the fused
attention computes its softmax), so the body is read as the softmax it spells. ``cast_inputs`` of any other dtype
(fp16 / bf16: a lower precision softmax) is not accepted.
"""

from __future__ import annotations

import ast
from typing import Optional

# torch.amp.custom_fwd (torch >= 2.4), its deprecated torch.cuda.amp / torch.cpu.amp spellings, and the module path
CUSTOM_FWD = {"torch.amp.custom_fwd", "torch.cuda.amp.custom_fwd", "torch.cpu.amp.custom_fwd",
              "torch.amp.autocast_mode.custom_fwd", "torch.cuda.amp.autocast_mode.custom_fwd"}
_F32 = {"torch.float32", "torch.float"}


def _dotted(node: ast.AST) -> Optional[str]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def keeps_softmax(dec: ast.expr, canon: dict[str, str]) -> bool:
    """Whether ``dec`` is AMP's ``custom_fwd`` (``@custom_fwd``, ``@torch.amp.custom_fwd(device_type=..)``) with no
    ``cast_inputs`` or ``cast_inputs=torch.float32``: the decorated softmax computes the softmax of its input.
    ``canon`` maps a file's local import names to dotted torch names (``canonical._file_aliases``)."""
    call = dec if isinstance(dec, ast.Call) else None
    written = _dotted(call.func if call is not None else dec)
    if written is None:
        return False
    head, _, rest = written.partition(".")
    if canon.get(head, head) + ("." + rest if rest else "") not in CUSTOM_FWD:
        return False
    if call is None:
        return True
    if call.args:
        return False  # custom_fwd(fwd) called on a function, or a positional we do not read
    for kw in call.keywords:
        if kw.arg == "device_type":
            continue
        if kw.arg != "cast_inputs":
            return False
        if isinstance(kw.value, ast.Constant) and kw.value.value is None:
            continue
        name = _dotted(kw.value)
        if name is None:
            return False
        h, _, r = name.partition(".")
        if canon.get(h, h) + ("." + r if r else "") not in _F32:
            return False
    return True


# the words of the reason below that s30's one-axis retry (attention._s30_ellipsis_as_one_axis) looks for, beside "5-D"
ELLIPSIS_RANK = "`...` stands for any number of axes"


def einsum_rank_reason(spec: Optional[ast.AST], rank: int) -> str:
    """The reason for an einsum P@V whose probabilities are read with ``rank`` axes (not 3 or 4): where the equation
    has ``...`` (read as two axes, whatever the tensors' rank), the rank is unknown, not ``rank``."""
    text = spec.value if isinstance(spec, ast.Constant) and isinstance(spec.value, str) else ""
    if isinstance(spec, ast.JoinedStr):
        text = "".join(v.value for v in spec.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    if "..." in text:
        return (f"einsum with `...` over the probabilities (`{text.strip()[:70]}`): {ELLIPSIS_RANK}, so "
                "the probabilities' rank is not known (npu_fusion_attention takes 4-D, or 3-D as one head)")
    return f"einsum over {rank}-D probabilities (npu_fusion_attention takes 4-D, or 3-D as one head)"
