"""Normalization fusions (spec §2, §9): RMSNorm, add+RMSNorm, Gemma RMSNorm, add+LayerNorm, GroupNorm+SiLU.

Every op computes in float32 and rounds the main output once to the output dtype, as the kernel
goldens do. Statistics (``rstd``/``mean``) are never differentiable.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
import torch.nn.functional as F

from npufuse.emulate.checks import (
    dtype_name,
    forward_only,
    no_gradient_formula,
    require,
    require_contiguous,
    require_dtype,
    require_rank,
    require_same_dtype,
    require_tensor,
)
from npufuse.emulate.registry import emulated

_HALF = (torch.float16, torch.bfloat16)


def _require_eps(api: str, arg: str, value: object) -> float:
    # bool is an int subclass but never a meaningful epsilon
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{api}: {arg} must be a float, got {type(value).__name__}")
    return float(value)


def _require_trailing(api: str, arg: str, t: torch.Tensor, x_arg: str, x: torch.Tensor) -> int:
    """``t`` must be 1-D..x.dim()-D and equal to the trailing dims of ``x``; returns its rank."""
    r = t.dim()
    require(api, arg, 1 <= r <= x.dim(), f"must be 1-D to {x.dim()}-D (the trailing dims of {x_arg}), got {r}-D")
    require(
        api,
        arg,
        tuple(t.shape) == tuple(x.shape[x.dim() - r :]),
        f"shape {tuple(t.shape)} must equal the trailing dims of {x_arg} {tuple(x.shape)}",
    )
    return r


def _require_nonempty(api: str, arg: str, t: torch.Tensor) -> None:
    require(api, arg, t.numel() > 0, f"must not be empty (shape {tuple(t.shape)}); the op does not accept empty tensors")


def _rms(xf: torch.Tensor, r: int, eps: float) -> torch.Tensor:
    dims = tuple(range(xf.dim() - r, xf.dim()))
    return torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + eps)


@emulated("npu_rms_norm", autograd=True, spec="2.1",
    verified=(
        'fp32 and fp16-x/fp32-gamma forward y and rstd (op-plugin test_npu_rms_norm)',
        'fp32 backward dx/dgamma (test_npu_rms_norm_backward)',
    ),
    docs_only=(
        'bfloat16',
        'multi-dim gamma',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_rms_norm_forward',
        'tests/test_emulate_upstream.py::test_rms_norm_backward',
    ),
)
def npu_rms_norm(input: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over gamma's trailing dims: y = x * rsqrt(mean(x^2) + epsilon) * gamma; returns (y, rstd).

    ``rstd = rsqrt(mean(input.float()**2, last gamma.dim() dims, keepdim=True) + epsilon)`` (eps inside
    the sqrt); ``y = (input.float() * rstd * gamma.float()).to(input.dtype)``: gamma is applied in fp32
    and the result rounded once (HF LlamaRMSNorm rounds before the weight: ≤1-ulp differences).

    Returns ``(y, rstd)``: ``y`` has the shape/dtype of ``input``; ``rstd`` is float32 with shape
    ``input.shape[:input.dim()-gamma.dim()] + (1,)*gamma.dim()`` and is not differentiable.
    Autograd w.r.t. ``input`` and ``gamma``.

    Constraints: ``input`` 2-8-D (wheel doc; the op-plugin doc also allows 1-D — the stricter wheel
    reading is chosen so that a rewrite verified here also runs on NPU) and float16/bfloat16/float32;
    ``gamma.shape == input.shape[-gamma.dim():]``; gamma has input's dtype, or float32 with a
    float16/bfloat16 ``input`` (A2/A3 mixed mode). Non-contiguous and empty tensors are accepted.
    """
    api = "npu_rms_norm"
    require_tensor(api, "input", input)
    require_tensor(api, "gamma", gamma)
    require_dtype(api, "input", input)
    require_dtype(api, "gamma", gamma)
    if gamma.dtype != input.dtype:
        require(
            api,
            "gamma",
            input.dtype in _HALF and gamma.dtype == torch.float32,
            f"has dtype {dtype_name(gamma.dtype)} but input has {dtype_name(input.dtype)}; gamma must match "
            "input, or be float32 with a float16/bfloat16 input",
            TypeError,
        )
    require_rank(api, "input", input, 2, 8)
    r = _require_trailing(api, "gamma", gamma, "input", input)
    eps = _require_eps(api, "epsilon", epsilon)
    xf = input.float()
    rstd = _rms(xf, r, eps)
    y = (xf * rstd * gamma.float()).to(input.dtype)
    return y, rstd.detach()


@emulated("npu_add_rms_norm", autograd=False, spec="2.2",
    verified=(
        'fp32 y, rstd, x and fp16 y, with the sum rounded to the input dtype (op-plugin test_npu_add_rms_norm)',
    ),
    docs_only=(
        'bfloat16',
        'backward raises (NotImplemented fallback)',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_add_rms_norm',
    ),
)
def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: x = x1 + x2, y = rms_norm(x) * gamma; returns (y, rstd, x).

    Return order is *normed output, rstd, residual sum*: ``y`` and ``x`` have the shape/dtype of
    ``x1``; ``rstd`` is float32 with the keepdim shape of ``npu_rms_norm``.

    Sum rounding (UNCERTAIN in the spec, settled by op-plugin's test_npu_add_rms_norm golden):
    ``x = x1 + x2`` in the input dtype (the residual the caller gets back, and what HF computes),
    then ``rstd`` and ``y`` from ``x.float()``; ``y`` rounded once.

    Constraints: x1, x2, gamma all the same dtype (float16/bfloat16/float32); x1 and x2 the same
    shape, 1-8-D, not empty; ``gamma.shape == x1.shape[-gamma.dim():]``.

    Forward only: the real op registers a NotImplemented autograd fallback, so backpropagating
    through any output raises. For training use ``x1 + x2`` followed by ``npu_rms_norm``.
    """
    api = "npu_add_rms_norm"
    for name, t in (("x1", x1), ("x2", x2), ("gamma", gamma)):
        require_tensor(api, name, t)
    require_dtype(api, "x1", x1)
    require_same_dtype(api, "x2", x2, "x1", x1)
    require_same_dtype(api, "gamma", gamma, "x1", x1)
    require_rank(api, "x1", x1, 1, 8)
    require(api, "x2", x2.shape == x1.shape, f"shape {tuple(x2.shape)} must equal x1 shape {tuple(x1.shape)}")
    _require_nonempty(api, "x1", x1)
    r = _require_trailing(api, "gamma", gamma, "x1", x1)
    eps = _require_eps(api, "epsilon", epsilon)
    x = x1 + x2
    xf = x.float()
    rstd = _rms(xf, r, eps)
    y = (xf * rstd * gamma.float()).to(x1.dtype)
    return forward_only(api, y, rstd, x)


@emulated("npu_gemma_rms_norm", autograd=False, spec="2.3",
    verified=(
        'fp32/fp16 y and float32 rstd (op-plugin test_npu_gemma_rms_norm)',
    ),
    docs_only=(
        'bfloat16',
        'no gradient formula (warns)',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_gemma_rms_norm',
        'tests/test_emulate_upstream.py::test_no_gradient_warning_shows_once_under_default_filters',
    ),
)
def npu_gemma_rms_norm(
    input: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma RMSNorm: y = x * rsqrt(mean(x^2) + epsilon) * (1 + gamma); returns (y, rstd).

    Computed in fp32 (``(1 + gamma.float())``) and rounded once to ``input.dtype``. ``rstd`` is
    float32 with the keepdim shape of ``npu_rms_norm`` (per the meta kernel and the C++ wrapper; the
    wheel doc's "same dtype as input" is wrong, spec §2.3).

    Constraints: ``input`` 1-8-D float16/bfloat16/float32; gamma the same dtype with
    ``gamma.shape == input.shape[-gamma.dim():]``; both contiguous (not contiguous-tolerant) and
    not empty.

    No derivative registered: backward warns and leaves the inputs' ``.grad`` None (VariableFallbackKernel).
    """
    api = "npu_gemma_rms_norm"
    require_tensor(api, "input", input)
    require_tensor(api, "gamma", gamma)
    require_dtype(api, "input", input)
    require_same_dtype(api, "gamma", gamma, "input", input)
    require_rank(api, "input", input, 1, 8)
    r = _require_trailing(api, "gamma", gamma, "input", input)
    _require_nonempty(api, "input", input)
    require_contiguous(api, "input", input)
    require_contiguous(api, "gamma", gamma)
    eps = _require_eps(api, "epsilon", epsilon)
    xf = input.float()
    rstd = _rms(xf, r, eps)
    y = (xf * rstd * (1.0 + gamma.float())).to(input.dtype)
    return no_gradient_formula(api, y, rstd, inputs=(input, gamma))


@emulated("npu_add_layer_norm", autograd=True, spec="2.5",
    verified=(
        'fp32 and mixed fp16/fp32 inputs with additional_output=True: y, mean, rstd, x (op-plugin test_npu_add_layer_norm)',
        'fp32 backward dx1, dx2, dgamma, dbeta (test_npu_add_layer_norm_backward)',
    ),
    docs_only=(
        'gradient through x (additional_output)',
        'x when additional_output=False',
        'bfloat16',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_add_layer_norm',
        'tests/test_emulate_upstream.py::test_add_layer_norm_backward',
    ),
)
def npu_add_layer_norm(
    x1: torch.Tensor,
    x2: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    epsilon: float = 1e-05,
    additional_output: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x = x1 + x2, then LayerNorm over gamma's dims: y = (x - mean) * rstd * gamma + beta; returns (y, mean, rstd, x).

    The sum and the statistics are computed in fp32 (``x1.float() + x2.float()``, biased variance,
    ``rstd = 1/sqrt(var + epsilon)``) over the last ``gamma.dim()`` dims; ``y`` and ``x`` are
    rounded once to x1's dtype, or are float32 when ``x1.dtype != x2.dtype``.

    Returns ``(y, mean, rstd, x)``. ``mean``/``rstd`` are float32, not differentiable, with shape
    ``x1.shape[:x1.dim()-gamma.dim()] + (1,)`` — the op-plugin C++ wrapper (what eager runs)
    appends a single 1; the meta kernel appends ``gamma.dim()`` ones; identical for 1-D gamma.

    UNCERTAIN in the spec (content of ``x`` when ``additional_output=False``): the kernel does not
    write it, so the emulation returns ``x`` filled with NaN (not attached to the graph) — code
    that reads it without asking for it fails verification instead of passing by luck.

    Constraints: x1/x2 float16/bfloat16/float32, 1-8-D, same shape; if their dtypes differ one of
    them must be float32; gamma and beta the same dtype and shape, equal to x1's trailing dims,
    with x1's dtype or float32.

    Autograd w.r.t. x1, x2, gamma, beta through ``y`` and (with ``additional_output``) ``x``.
    """
    api = "npu_add_layer_norm"
    for name, t in (("x1", x1), ("x2", x2), ("gamma", gamma), ("beta", beta)):
        require_tensor(api, name, t)
        require_dtype(api, name, t)
    if x1.dtype != x2.dtype:
        require(
            api,
            "x2",
            torch.float32 in (x1.dtype, x2.dtype),
            f"has dtype {dtype_name(x2.dtype)} but x1 has {dtype_name(x1.dtype)}; mixed inputs need one float32",
            TypeError,
        )
    require_same_dtype(api, "beta", beta, "gamma", gamma)
    require(
        api,
        "gamma",
        gamma.dtype in (x1.dtype, torch.float32),
        f"has dtype {dtype_name(gamma.dtype)}; it must be x1's dtype ({dtype_name(x1.dtype)}) or float32",
        TypeError,
    )
    require_rank(api, "x1", x1, 1, 8)
    require(api, "x2", x2.shape == x1.shape, f"shape {tuple(x2.shape)} must equal x1 shape {tuple(x1.shape)}")
    r = _require_trailing(api, "gamma", gamma, "x1", x1)
    require(api, "beta", beta.shape == gamma.shape, f"shape {tuple(beta.shape)} must equal gamma shape {tuple(gamma.shape)}")
    eps = _require_eps(api, "epsilon", epsilon)
    require(api, "additional_output", isinstance(additional_output, bool), "must be a bool", TypeError)

    out_dtype = x1.dtype if x1.dtype == x2.dtype else torch.float32
    xf = x1.float() + x2.float()
    dims = tuple(range(x1.dim() - r, x1.dim()))
    mean = xf.mean(dim=dims, keepdim=True)
    var = (xf - mean).pow(2).mean(dim=dims, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    y = ((xf - mean) * rstd * gamma.float() + beta.float()).to(out_dtype)
    stat_shape = tuple(x1.shape[: x1.dim() - r]) + (1,)
    if additional_output:
        x = xf.to(out_dtype)
    else:
        x = torch.full(x1.shape, math.nan, dtype=out_dtype, device=x1.device)
    return y, mean.detach().reshape(stat_shape), rstd.detach().reshape(stat_shape), x


@emulated("npu_group_norm_silu", autograd=False, spec="9.1",
    verified=(
        'fp32 and fp16-x/fp32-gamma forward, mean and rstd (op-plugin test_group_norm_silu)',
    ),
    docs_only=(
        'weight/bias None',
        'bfloat16',
        'no gradient formula (warns)',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_group_norm_silu',
    ),
)
def npu_group_norm_silu(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    group: int,
    eps: float = 1e-05,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """silu(group_norm(input, group, weight, bias, eps)) over channel dim 1; returns (out, mean, rstd).

    Statistics per (sample, group) in fp32 with biased variance, ``rstd = 1/sqrt(var + eps)``;
    ``out`` rounded once to ``input.dtype``. ``mean``/``rstd`` have shape ``(N, group)`` and
    input's dtype — the op-plugin C++ wrapper and the wheel doc allocate them like ``input``
    (the meta kernel uses weight's dtype when weight/bias are given; eager behaviour is followed).

    Constraints: input 2-8-D float16/bfloat16/float32 with ``C = input.shape[1]`` divisible by
    ``group`` (a positive int); weight/bias optional, 1-D ``[C]``, the same dtype as each other and
    of precision ≥ input's (input's dtype, or float32). Non-contiguous input is accepted.

    No derivative registered: backward warns and leaves the inputs' ``.grad`` None (VariableFallbackKernel). For
    training use ``npu_group_norm_swish``.
    """
    api = "npu_group_norm_silu"
    require_tensor(api, "input", input)
    require_dtype(api, "input", input)
    require_rank(api, "input", input, 2, 8)
    if isinstance(group, bool) or not isinstance(group, int):
        raise TypeError(f"{api}: group must be an int, got {type(group).__name__}")
    require(api, "group", group > 0, f"must be positive, got {group}")
    n, c = input.shape[0], input.shape[1]
    require(api, "group", c % group == 0, f"({group}) must divide the channel dim input.shape[1] = {c}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        require_tensor(api, name, t)
        require(
            api,
            name,
            t.dtype in (input.dtype, torch.float32),
            f"has dtype {dtype_name(t.dtype)}; it must be input's dtype ({dtype_name(input.dtype)}) or float32",
            TypeError,
        )
        require(api, name, tuple(t.shape) == (c,), f"shape {tuple(t.shape)} must be (C,) = ({c},)")
    if weight is not None and bias is not None:
        require_same_dtype(api, "bias", bias, "weight", weight)
    epsilon = _require_eps(api, "eps", eps)

    # explicit group size: reshape(..., -1) is ambiguous for an empty batch
    xf = input.float().reshape(n, group, (c // group) * math.prod(input.shape[2:]))
    mean = xf.mean(dim=-1)
    var = (xf - mean.unsqueeze(-1)).pow(2).mean(dim=-1)
    rstd = torch.rsqrt(var + epsilon)
    normed = ((xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)).reshape(input.shape)
    channel_shape = (1, c) + (1,) * (input.dim() - 2)
    if weight is not None:
        normed = normed * weight.float().reshape(channel_shape)
    if bias is not None:
        normed = normed + bias.float().reshape(channel_shape)
    out = F.silu(normed).to(input.dtype)
    return no_gradient_formula(api, out, mean.to(input.dtype), rstd.to(input.dtype), inputs=(input, weight, bias))


__all__ = ["npu_rms_norm", "npu_add_rms_norm", "npu_gemma_rms_norm", "npu_add_layer_norm", "npu_group_norm_silu"]
