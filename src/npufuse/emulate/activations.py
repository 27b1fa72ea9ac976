"""Gated and fast activations (spec §3): SwiGLU, GeGLU, GeLU-mul, FastGeLU.

Which half is activated differs per op (spec §13.6): ``npu_swiglu`` silu(first)·second,
``npu_geglu`` first·gelu(second) by default, ``npu_gelu_mul`` gelu(first)·second.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from npufuse.emulate.checks import (
    no_gradient_formula,
    require,
    require_contiguous,
    require_dtype,
    require_rank,
    require_tensor,
)
from npufuse.emulate.registry import emulated


def _require_int(api: str, arg: str, value: object) -> int:
    # bool is an int subclass; passing True/False for an int attribute is a bug in the caller
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{api}: {arg} must be an int, got {type(value).__name__}")
    return value


def _halves(api: str, t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``t`` into equal (first, second) halves along ``dim`` after validating ``dim``."""
    dim = _require_int(api, "dim", dim)
    nd = t.dim()
    require(api, "dim", -nd <= dim < nd, f"({dim}) out of range [{-nd}, {nd - 1}] for a {nd}-D input")
    size = t.shape[dim]
    require(api, "input", size % 2 == 0, f"size {size} along dim {dim} must be even (split into two halves)")
    half = size // 2
    # narrow (not chunk) so an empty split dim still yields two empty halves
    return t.narrow(dim, 0, half), t.narrow(dim, half, half)


@emulated("npu_swiglu", autograd=True, spec="3.1",
    verified=(
        'bf16 forward, computed in fp32 and rounded once (op-plugin test_npu_swi_glu)',
        'bf16 backward (test_npu_swi_glu_backward)',
    ),
    docs_only=(
        'fp16/fp32 inputs',
        'dim other than -1',
        'rank 1-8 and contiguity limits',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_swiglu_bf16_forward_and_backward',
    ),
)
def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SwiGLU: split input in halves (A, B) along dim and return silu(A) * B.

    A is the **first** half. Computed in fp32 and rounded once to input's dtype, as the kernel
    does (``silu(A.float()) * B.float()``; rounding silu first put 26% of bf16 elements one step
    off on op-plugin's test shape); the gradient is likewise fp32 math rounded once. Output has
    ``size(dim) // 2`` along ``dim``.

    Constraints: input 1-8-D, float16/bfloat16/float32, contiguous (the op-plugin doc says it is not
    contiguous-tolerant), even size along ``dim``. Autograd: yes.
    """
    api = "npu_swiglu"
    require_tensor(api, "input", input)
    require_dtype(api, "input", input)
    require_rank(api, "input", input, 1, 8)
    require_contiguous(api, "input", input)
    a, b = _halves(api, input, dim)
    if input.dtype == torch.float32:
        return torch.sigmoid(a) * a * b
    return (F.silu(a.float()) * b.float()).to(input.dtype)


_GELU_MODES = {0: "none", 1: "tanh"}


@emulated("npu_geglu", autograd=True, spec="3.2",
    verified=(
        'fp16 forward and out_gelu, backward (torch_npu test_npu_geglu / _backward)',
    ),
    docs_only=(
        'approximate 0 vs 1 (the upstream golden is within tolerance of both)',
        'activate_left',
        'bfloat16',
        'out_gelu not differentiable (derivatives.yaml)',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_geglu_forward_and_backward',
    ),
)
def npu_geglu(
    input: torch.Tensor, dim: int = -1, approximate: int = 1, activate_left: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """GeGLU: halves (A, B) along dim; out = A * gelu(B), or gelu(A) * B if activate_left; returns (out, out_gelu).

    ``approximate``: 0 = erf GELU (``F.gelu`` default), **1 = tanh (the default)**.
    ``activate_left=False`` (default) activates the **second** half: ``out = A * gelu(B)``,
    ``out_gelu = gelu(B)``; ``activate_left=True``: ``out = gelu(A) * B``, ``out_gelu = gelu(A)``.
    Both outputs have ``size(dim) // 2`` along ``dim`` and input's dtype; computed in fp32, each
    rounded once. Autograd flows through ``out`` only (``out_gelu`` is not differentiable).

    Constraints: input 1-8-D float16/bfloat16/float32 (non-contiguous accepted), even size along
    ``dim``. The wheel doc lets a 0-D input pass the dim range check (dim ∈ [-1, 0]) but a scalar
    has no halves and the meta kernel rejects 0-D, so 0-D is refused.
    """
    api = "npu_geglu"
    require_tensor(api, "input", input)
    require_dtype(api, "input", input)
    require_rank(api, "input", input, 1, 8)
    mode = _require_int(api, "approximate", approximate)
    require(api, "approximate", mode in _GELU_MODES, f"must be 0 (erf) or 1 (tanh), got {mode}")
    require(api, "activate_left", isinstance(activate_left, bool), "must be a bool", TypeError)
    a, b = _halves(api, input, dim)
    gate, other = (a, b) if activate_left else (b, a)
    gelu = F.gelu(gate.float(), approximate=_GELU_MODES[mode])
    out = (gelu * other.float()).to(input.dtype)
    return out, gelu.detach().to(input.dtype)


@emulated("npu_gelu_mul", autograd=False, spec="3.3",
    verified=(
        'fp16/fp32 forward, approximate none/tanh (op-plugin test_npu_gelu_mul)',
    ),
    docs_only=(
        'no gradient formula: warns, .grad None (derivatives.yaml has no entry)',
        'bfloat16',
        'size limits',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_gelu_mul',
        'tests/test_emulate_activations.py::test_gelu_mul_backward_warns_and_leaves_grad_none',
    ),
)
def npu_gelu_mul(input: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    """GeLU-mul: split the last dim in halves and return gelu(left) * right.

    Note the activated side is the **left** half (opposite to ``npu_geglu``'s default).
    ``approximate`` is ``"none"`` (erf) or ``"tanh"``. Computed in fp32 and rounded once to
    input's dtype; output's last dim is half of input's.

    Constraints: input 2-8-D float16/bfloat16/float32 (non-contiguous accepted); last dim even and
    ≤ 1024; product of the other dims ≤ 200000.

    No derivative registered: backpropagating through the output warns and leaves the inputs'
    ``.grad`` None (VariableFallbackKernel), so a training rewrite through it loses gradients.
    """
    api = "npu_gelu_mul"
    require_tensor(api, "input", input)
    require_dtype(api, "input", input)
    require_rank(api, "input", input, 2, 8)
    require(api, "approximate", isinstance(approximate, str), "must be a str", TypeError)
    require(api, "approximate", approximate in ("none", "tanh"), f"must be 'none' or 'tanh', got {approximate!r}")
    last = input.shape[-1]
    require(api, "input", last % 2 == 0 and last <= 1024, f"last dim ({last}) must be even and <= 1024")
    rows = math.prod(input.shape[:-1])
    require(api, "input", rows <= 200000, f"product of the non-last dims ({rows}) must be <= 200000")
    xf = input.float()
    x1, x2 = xf.narrow(-1, 0, last // 2), xf.narrow(-1, last // 2, last // 2)
    out = (F.gelu(x1, approximate=approximate) * x2).to(input.dtype)
    return no_gradient_formula(api, out, inputs=(input,))


def _fast_gelu(x: torch.Tensor) -> torch.Tensor:
    # x * sigmoid(1.702 x): torch.sigmoid is already the numerically stable form the 910 kernel spells out
    xf = x.float()
    return (xf * torch.sigmoid(1.702 * xf)).to(x.dtype)


@emulated("npu_fast_gelu", autograd=True, spec="3.4",
    verified=(
        'fp32 values and gradient (op-plugin test_fast_gelu / _backward)',
    ),
    docs_only=(
        'fp16/bf16 rounding',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_fast_gelu_values_and_grad',
    ),
)
def npu_fast_gelu(input: torch.Tensor) -> torch.Tensor:
    """FastGeLU (QuickGELU): x * sigmoid(1.702 * x), elementwise.

    Computed in fp32 and rounded to input's dtype. Not ``F.gelu(approximate='tanh')``.
    Constraints: input 0-8-D, float16/bfloat16/float32 (bfloat16 on A2/A3), non-contiguous
    accepted. Autograd: yes.
    """
    api = "npu_fast_gelu"
    require_tensor(api, "input", input)
    require_dtype(api, "input", input)
    require_rank(api, "input", input, 0, 8)
    return _fast_gelu(input)


@emulated("fast_gelu", autograd=True, spec="3.4",
    verified=(
        'fp32 values and gradient (op-plugin test_fast_gelu / _backward)',
    ),
    docs_only=(
        'fp16 rounding',
        'bfloat16 refused',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_fast_gelu_values_and_grad',
    ),
)
def fast_gelu(input: torch.Tensor) -> torch.Tensor:
    """FastGeLU, older aclop variant: x * sigmoid(1.702 * x), elementwise; float16/float32 only.

    Same math as ``npu_fast_gelu`` (fp32 compute, rounded to input's dtype) but the documented
    dtypes are float16 and float32 only, so bfloat16 is refused. Autograd: yes.
    """
    api = "fast_gelu"
    require_tensor(api, "input", input)
    require_dtype(api, "input", input, (torch.float16, torch.float32))
    return _fast_gelu(input)


__all__ = ["npu_swiglu", "npu_geglu", "npu_gelu_mul", "npu_fast_gelu", "fast_gelu"]
