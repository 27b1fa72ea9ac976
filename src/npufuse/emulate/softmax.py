"""Softmax / dropout / layout fusions (spec §6).

``npu_scaled_masked_softmax`` (Megatron FusedScaleMaskSoftmax), ``npu_dropout_with_add_softmax``
(axpy + softmax + dropout; its result is ``[2]``) and ``npu_confusion_transpose`` (reshape and
permute in one op).
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import torch

from npufuse.emulate.checks import (
    require,
    require_dtype,
    require_rank,
    require_same_dtype,
    require_tensor,
)
from npufuse.emulate.registry import emulated

_MASK_FILL = -10000.0  # finite fill: a fully masked row becomes uniform, never NaN
_SOFTMAX_S_MIN, _SOFTMAX_S_MAX, _SOFTMAX_S_ALIGN = 32, 4096, 32
_DROPOUT_HW = (128, 256, 384, 512)
_DROPOUT_NC_ALIGN = 32
_MASK_ALIGN = 128  # DropOutGenMaskV3 buffer length is rounded up to a multiple of 128


def _require_scalar(api: str, arg: str, value: object) -> float:
    """A Scalar argument: a real Python number or a 0-dim real tensor (as the op binding accepts)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool:
        return float(value)
    require(
        api,
        arg,
        isinstance(value, numbers.Real) and not isinstance(value, bool),
        f"must be a real number (Scalar), got {type(value).__name__}",
        TypeError,
    )
    return float(value)  # type: ignore[arg-type]


@emulated("npu_scaled_masked_softmax", autograd=True, spec="6.1",
    verified=(
        'fp16/fp32 forward and backward with full and broadcast masks (op-plugin test_scaled_masked_softmax)',
    ),
    docs_only=(
        'fixed_triu_mask (rejected)',
        'bfloat16',
        'S limits',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_scaled_masked_softmax_forward_and_backward',
    ),
)
def npu_scaled_masked_softmax(
    x: torch.Tensor,
    mask: torch.Tensor,
    scale: float = 1,
    fixed_triu_mask: bool = False,
) -> torch.Tensor:
    """softmax((x*scale).masked_fill(mask, -10000), dim=-1), mask True = masked out.

    ``x`` is 4-D ``[B, N, S1, S2]`` fp16/bf16/fp32 with S1 and S2 in [32, 4096] and multiples of
    32; ``mask`` is a **bool** tensor ``[B|1, N|1, S1, S2]`` (a float/additive mask is rejected:
    convert with ``mask < 0``). The fill is the finite −10000, so fully masked rows come out
    uniform rather than NaN. Computed in fp32, returned in ``x``'s dtype and shape.

    ``fixed_triu_mask=True`` (use an auto-generated ``triu(ones, 1)`` mask) is reserved in the
    op; only False is supported, so True is rejected.

    Autograd: yes, w.r.t. ``x``.
    """
    api = "npu_scaled_masked_softmax"
    require_tensor(api, "x", x)
    require_tensor(api, "mask", mask)
    require_dtype(api, "x", x)
    require_dtype(api, "mask", mask, (torch.bool,))
    scale = _require_scalar(api, "scale", scale)
    require(api, "fixed_triu_mask", isinstance(fixed_triu_mask, bool), "must be a bool", TypeError)
    require(api, "fixed_triu_mask", not fixed_triu_mask, "must be False (True is reserved and not supported)")
    require_rank(api, "x", x, 4)
    b, n, s1, s2 = x.shape
    for name, s in (("S1", s1), ("S2", s2)):
        require(
            api,
            "x",
            _SOFTMAX_S_MIN <= s <= _SOFTMAX_S_MAX and s % _SOFTMAX_S_ALIGN == 0,
            f"{name}={s} must be in [{_SOFTMAX_S_MIN}, {_SOFTMAX_S_MAX}] and a multiple of {_SOFTMAX_S_ALIGN} "
            f"(shape {tuple(x.shape)})",
        )
    require_rank(api, "mask", mask, 4)
    mb, mn, ms1, ms2 = mask.shape
    require(
        api,
        "mask",
        mb in (1, b) and mn in (1, n) and (ms1, ms2) == (s1, s2),
        f"shape {tuple(mask.shape)} must be [B|1, N|1, S1, S2] for x {tuple(x.shape)}",
    )
    logits = (x.float() * scale).masked_fill(mask, _MASK_FILL)
    return torch.softmax(logits, dim=-1).to(x.dtype)


class _DropoutAddSoftmax(torch.autograd.Function):
    """Forward returns (mask, softmax_out, dropout_out); only dropout_out is differentiable."""

    @staticmethod
    def forward(ctx, self_, x1, alpha, prob, dim, keep):  # type: ignore[override]
        dtype = x1.dtype
        y = torch.softmax(x1.float() + alpha * self_.float(), dim=dim)
        scale = 1.0 / (1.0 - prob)
        dropout = y * keep * scale
        ctx.save_for_backward(y, keep)
        ctx.alpha, ctx.scale, ctx.dim = alpha, scale, dim
        numel = keep.numel()
        flat = torch.zeros(math.ceil(numel / _MASK_ALIGN) * _MASK_ALIGN, dtype=torch.uint8, device=keep.device)
        flat[:numel] = keep.flatten().to(torch.uint8)
        softmax_out = y.to(dtype)
        # derivatives.yaml: output_differentiability [false, false, true]
        ctx.mark_non_differentiable(flat, softmax_out)
        return flat, softmax_out, dropout.to(dtype)

    @staticmethod
    def backward(ctx, grad_mask, grad_softmax, grad_dropout):  # type: ignore[override]
        y, keep = ctx.saved_tensors
        if grad_dropout is None:
            return None, None, None, None, None, None
        g = grad_dropout.float() * keep * ctx.scale
        d_add = y * (g - (y * g).sum(dim=ctx.dim, keepdim=True))
        grad_self = (ctx.alpha * d_add).to(grad_dropout.dtype)
        # op-plugin's npu_dropout_with_add_softmax_backward returns (result, grad): x1 receives the
        # incoming gradient unchanged, not the softmax gradient
        return grad_self, grad_dropout, None, None, None, None


@emulated("npu_dropout_with_add_softmax", autograd=True, spec="6.2",
    verified=(
        'prob 0 forward and the gradient of input (alpha * softmax grad), fp16/fp32 (op-plugin test_dropout_with_add_softmax_backward)',
    ),
    docs_only=(
        "x1's gradient passed through unchanged (C++ backward source)",
        'mask layout and dropout bits',
        'only output 2 differentiable (derivatives.yaml)',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_dropout_with_add_softmax_backward',
    ),
)
def npu_dropout_with_add_softmax(
    input: torch.Tensor,
    x1: torch.Tensor,
    alpha: float,
    prob: float,
    dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax(x1 + alpha*input, dim), then dropout with DROP probability prob; result is [2].

    Returns ``(mask, softmax_out, dropout_out)`` — the usable result is **``[2]``**:
    ``dropout_out = softmax_out * keep / (1 - prob)``. ``mask`` is the flat uint8 keep buffer
    (1 = kept) of length ``ceil(numel/128)*128``, not shaped like the input. Typical use:
    ``input`` = attention scores, ``x1`` = additive mask, ``alpha = 1/sqrt(head_dim)``.

    Constraints: ``input`` and ``x1`` 4-D ``(N, C, H, W)`` with the same shape and dtype
    (fp16/bf16/fp32), H and W each in {128, 256, 384, 512}, ``(N*C) % 32 == 0``, ``dim`` the last
    axis (-1; 3 names the same axis and is accepted), ``0 <= prob < 1``. The keep mask is drawn
    from torch's default generator (seed with ``torch.manual_seed``); it cannot match the NPU's
    DropOutGenMaskV3 bits. Computed in fp32, returned in ``x1``'s dtype.

    Autograd: yes, for ``input`` and ``x1``, through ``dropout_out`` only (``mask`` and
    ``softmax_out`` are not differentiable, derivatives.yaml ``[false, false, true]``). The
    gradients are the C++ backward's, not the mathematical ones: ``d(input) = alpha *
    softmax_grad(grad * keep / (1 - prob))`` and ``d(x1) = grad`` passed through unchanged
    (``return std::tie(result, grad)``).

    Choices: same dtype for ``input`` and ``x1`` is required (the doc is silent; the op casts both
    to fp16 internally); ``prob == 1`` is rejected (keep probability 0 divides by zero).
    """
    api = "npu_dropout_with_add_softmax"
    require_tensor(api, "input", input)
    require_tensor(api, "x1", x1)
    require_dtype(api, "input", input)
    require_same_dtype(api, "x1", x1, "input", input)
    alpha = _require_scalar(api, "alpha", alpha)
    prob = _require_scalar(api, "prob", prob)
    require(api, "dim", isinstance(dim, int) and not isinstance(dim, bool), "must be an int", TypeError)
    require(api, "prob", 0.0 <= prob < 1.0, f"is the drop probability and must be in [0, 1), got {prob}")
    require_rank(api, "input", input, 4)
    require(api, "x1", tuple(x1.shape) == tuple(input.shape), f"shape {tuple(x1.shape)} must equal input's {tuple(input.shape)}")
    n, c, h, w = input.shape
    require(api, "input", h in _DROPOUT_HW and w in _DROPOUT_HW, f"H and W must each be one of {_DROPOUT_HW}, got H={h}, W={w}")
    require(api, "input", (n * c) % _DROPOUT_NC_ALIGN == 0, f"N*C must be a multiple of {_DROPOUT_NC_ALIGN}, got {n}*{c}={n * c}")
    require(api, "dim", dim in (-1, 3), f"must be -1 (the last axis), got {dim}")
    keep = (torch.rand(input.shape, device=input.device) >= prob).float()
    return _DropoutAddSoftmax.apply(input, x1, alpha, prob, -1, keep)


_CONFUSION_DTYPES = (
    torch.float16,
    torch.float32,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)


def _require_int_list(api: str, arg: str, value: object) -> list[int]:
    ok = isinstance(value, (list, tuple, torch.Size)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )
    require(api, arg, ok, f"must be a list of ints, got {value!r}", TypeError)
    return list(value)  # type: ignore[arg-type]


@emulated("npu_confusion_transpose", autograd=True, spec="6.3",
    verified=(
        'fp32/fp16/int64 in both directions, fp32 backward (op-plugin test_confusion_transpose / _backward)',
    ),
    docs_only=(
        'bfloat16 rejected',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_confusion_transpose',
    ),
)
def npu_confusion_transpose(
    input: torch.Tensor,
    perm: Sequence[int],
    shape: Sequence[int],
    transpose_first: bool,
) -> torch.Tensor:
    """Permute then reshape (transpose_first=True) or reshape then permute (False), contiguous.

    ``transpose_first=True``: ``input.permute(perm).contiguous().view(shape)`` (head merge
    ``[B,N,S,D] -> [B,S,H]`` with ``perm=(0,2,1,3)``); ``False``: ``input.view(shape).permute(perm)``
    materialized contiguous (head split ``[B,S,H] -> [B,N,S,D]``). ``perm`` must be a permutation
    of the dims it applies to; ``shape`` must keep the element count (one -1 is inferred).

    dtypes are the wheel doc's list: float16, float32 and the 8/16/32/64-bit ints (bfloat16 is
    not listed and is rejected). Autograd: yes.
    """
    api = "npu_confusion_transpose"
    require_tensor(api, "input", input)
    require_dtype(api, "input", input, _CONFUSION_DTYPES)
    perm = _require_int_list(api, "perm", perm)
    shape = _require_int_list(api, "shape", shape)
    require(api, "transpose_first", isinstance(transpose_first, bool), "must be a bool", TypeError)
    known = [s for s in shape if s != -1]
    require(api, "shape", len(known) >= len(shape) - 1 and all(s >= 0 for s in known), f"{shape} is not a valid shape")
    prod = math.prod(known)
    if len(known) == len(shape):
        ok = prod == input.numel()
    else:
        ok = prod > 0 and input.numel() % prod == 0
    require(api, "shape", ok, f"{shape} does not match input's {input.numel()} elements (shape {tuple(input.shape)})")
    rank = input.dim() if transpose_first else len(shape)
    require(
        api,
        "perm",
        sorted(perm) == list(range(rank)),
        f"{perm} must be a permutation of range({rank}) ({'input' if transpose_first else 'shape'} is {rank}-D)",
    )
    if transpose_first:
        return input.permute(perm).reshape(shape).contiguous()
    return input.reshape(shape).permute(perm).contiguous()
