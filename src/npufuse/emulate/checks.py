"""Argument checks shared by the emulated ops.

The emulator must be as strict as the documented op: every check raises a ``TypeError`` (wrong
type/dtype) or ``ValueError`` (wrong rank/shape/value) whose message starts with
``<api>: <argument>`` so a failing rewrite learns which constraint it broke.
"""

from __future__ import annotations

from typing import Iterable

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def require_tensor(api: str, arg: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{api}: {arg} must be a Tensor, got {type(value).__name__}")
    return value


def require_dtype(api: str, arg: str, t: torch.Tensor, allowed: Iterable[torch.dtype] = FLOATS) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        raise TypeError(f"{api}: {arg} has dtype {dtype_name(t.dtype)}; supported: {names}")


def require_same_dtype(api: str, arg: str, t: torch.Tensor, ref_arg: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(
            f"{api}: {arg} has dtype {dtype_name(t.dtype)} but {ref_arg} has {dtype_name(ref.dtype)}; "
            "they must match"
        )


def require_rank(api: str, arg: str, t: torch.Tensor, lo: int, hi: int | None = None) -> None:
    hi = lo if hi is None else hi
    if not lo <= t.dim() <= hi:
        want = f"{lo}-D" if lo == hi else f"{lo}-D to {hi}-D"
        raise ValueError(f"{api}: {arg} must be {want}, got {t.dim()}-D shape {tuple(t.shape)}")


def require_contiguous(api: str, arg: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{api}: {arg} must be contiguous (call .contiguous() first); strides {t.stride()}")


def require(api: str, arg: str, ok: bool, message: str, exc: type[Exception] = ValueError) -> None:
    """Generic constraint: raises ``exc("<api>: <arg> <message>")`` when ``ok`` is false."""
    if not ok:
        raise exc(f"{api}: {arg} {message}")


class _ForwardOnly(torch.autograd.Function):
    """Identity in forward; raises in backward like torch_npu's autogradNotImplementedFallback."""

    @staticmethod
    def forward(ctx, api: str, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.api = api
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        raise RuntimeError(
            f"derivative for torch_npu.{ctx.api} is not implemented (forward-only op: inference only)"
        )


def forward_only(api: str, *outputs: torch.Tensor):
    """Mark outputs of an op without a registered backward.

    When grad mode is on and an output requires grad, backpropagating through it raises, as the
    real op does (or, for ops with no autograd kernel at all, where PyTorch would not propagate
    gradients: failing loudly is the strict choice). Outside autograd this is free.
    """
    wrapped = tuple(
        _ForwardOnly.apply(api, o) if isinstance(o, torch.Tensor) and o.requires_grad else o for o in outputs
    )
    return wrapped if len(wrapped) != 1 else wrapped[0]
