"""Argument checks shared by the emulated ops.

The emulator must be as strict as the documented op: every check raises a ``TypeError`` (wrong
type/dtype) or an :class:`NpuOpError` (wrong rank/shape/value) whose message starts with
``<api>: <argument>`` so a failing rewrite learns which constraint it broke.

``NpuOpError`` is a ``RuntimeError`` because that is what torch_npu raises for a rejected
argument value (``TORCH_CHECK`` in op-plugin, e.g. an unknown ``rotary_mode``, ``group_type``,
an empty tensor list, ``keep_prob=0``); it is also a ``ValueError`` so callers written against
the earlier emulator keep working.
"""

from __future__ import annotations

import warnings
from typing import Iterable

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


class NpuOpError(RuntimeError, ValueError):
    """A value the real op rejects with ``TORCH_CHECK`` (a RuntimeError in torch_npu)."""


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
        raise NpuOpError(f"{api}: {arg} must be {want}, got {t.dim()}-D shape {tuple(t.shape)}")


def require_contiguous(api: str, arg: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise NpuOpError(f"{api}: {arg} must be contiguous (call .contiguous() first); strides {t.stride()}")


def require(api: str, arg: str, ok: bool, message: str, exc: type[Exception] = NpuOpError) -> None:
    """Generic constraint: raises ``exc("<api>: <arg> <message>")`` when ``ok`` is false."""
    if not ok:
        raise exc(f"{api}: {arg} {message}")


FALLBACK_WARNING = "an autograd kernel was not registered to the Autograd key(s) but we are trying to backprop through it"


class _NoGradientFormula(torch.autograd.Function):
    """Outputs attached straight to the op's tensor inputs; backward warns and returns no gradient.

    torch_npu registers no autograd kernel for these ops, so PyTorch's autograd fallback (mode
    "warn", the default) gives the outputs one node, connected to the op's inputs, that warns and
    returns undefined gradients: the inputs' ``.grad`` stays None. Python's default warning
    filter shows the warning once per place.
    """

    @staticmethod
    def forward(ctx, api: str, n_out: int, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.api, ctx.n_in = api, len(tensors) - n_out
        return tuple(t.clone() for t in tensors[:n_out])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        warnings.warn(
            f"torch_npu.{ctx.api}: {FALLBACK_WARNING}. This may lead to silently incorrect behavior "
            "(no gradient reaches its inputs)",
            UserWarning,
            stacklevel=2,
        )
        return (None, None) + (None,) * (len(grads) + ctx.n_in)


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
    """Mark outputs of an op registered with autogradNotImplementedFallback: backward raises.

    Outside autograd this is free.
    """
    wrapped = tuple(
        _ForwardOnly.apply(api, o) if isinstance(o, torch.Tensor) and o.requires_grad else o for o in outputs
    )
    return wrapped if len(wrapped) != 1 else wrapped[0]


def no_gradient_formula(api: str, *outputs: torch.Tensor, inputs: Iterable[object] = ()):
    """Mark outputs of an op with no derivative registered at all: backward warns, grads stay None.

    That is torch_npu's behaviour for ops missing from derivatives.yaml (VariableFallbackKernel):
    a training rewrite through such an op silently loses its gradients, which ``verify op``
    reports as a missing gradient. ``inputs`` are the op's tensor arguments (others are skipped):
    the outputs hang off them directly, as the real op's do, so no intermediate step of the
    emulation can turn "no gradient" into zeros.
    """
    graph_inputs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not (torch.is_grad_enabled() and graph_inputs):
        wrapped = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)
    else:
        tensors = [o for o in outputs if isinstance(o, torch.Tensor)]
        attached = iter(_NoGradientFormula.apply(api, len(tensors), *(t.detach() for t in tensors), *graph_inputs))
        wrapped = tuple(next(attached) if isinstance(o, torch.Tensor) else o for o in outputs)
    return wrapped if len(wrapped) != 1 else wrapped[0]
