"""Rotary position embedding: ``npu_rotary_mul`` and ``npu_apply_rotary_pos_emb`` (spec §4).

Both compute ``out = x * cos + R(x) * sin`` in fp32 and cast back to ``x``'s dtype, with
``R = rotate_half`` (``'half'``, GPT-NeoX / HF LLaMA) or ``R = rotate_interleave``
(``'interleave'``, GPT-J / complex form). cos/sin always carry the full head dim D.
Constraints are those of Atlas A2/A3 with the default ``jit_compile=False`` (the training and
inference SoCs npufuse targets); Ascend 950-only modes and layouts are rejected.
"""

from __future__ import annotations

from typing import Optional

import torch

from npufuse.emulate.checks import (
    NpuOpError,
    require,
    require_dtype,
    require_rank,
    require_same_dtype,
    require_tensor,
)
from npufuse.emulate.registry import emulated

_MAX_D = 896  # D < 896 on A2/A3 (jit_compile=False)
_MAX_BN = 1000  # half: B < 1000 and N < 1000; interleave: B*N < 1000
_MAX_BN_WITH_COS_GRAD = 1024  # half: B*N <= 1024 when grads of cos/sin are needed

# For each x layout: positions of B and N among the three leading dims, and the r1/r2 shapes the
# kernel accepts, written as which leading dims r1 keeps (True) or has as 1 (False).
_LAYOUTS = {
    "BNSD": (0, 1),
    "BSND": (0, 2),
    "SBND": (1, 2),
}
_HALF_R_SHAPES = {
    "BNSD": {"11SD": (False, False, True), "B1SD": (True, False, True), "BNSD": (True, True, True)},
    "BSND": {"1S1D": (False, True, False), "BS1D": (True, True, False), "BSND": (True, True, True)},
    "SBND": {"S11D": (True, False, False), "SB1D": (True, True, False), "SBND": (True, True, True)},
}
# interleave: positions only, never batch-dependent
_INTERLEAVE_R_SHAPES = {
    "BNSD": {"11SD": (False, False, True)},
    "BSND": {"1S1D": (False, True, False)},
    "SBND": {"S11D": (True, False, False)},
}
_ROTARY_MODES_950_ONLY = ("quarter", "interleave-half")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x[..., D/2:], x[..., :D/2])``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleave(x: torch.Tensor) -> torch.Tensor:
    """``out[2k] = -x[2k+1]``, ``out[2k+1] = x[2k]``."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _r_layouts(x_shape: torch.Size, r_shape: torch.Size, table: dict) -> list[str]:
    """Layouts of ``x`` under which ``r_shape`` is one of the accepted cos/sin shapes."""
    lead = tuple(x_shape[:3])
    found = []
    for layout, shapes in table.items():
        for keep in shapes.values():
            if tuple(r_shape[:3]) == tuple(d if k else 1 for d, k in zip(lead, keep)):
                found.append(layout)
                break
    return found


def _allowed_text(table: dict) -> str:
    return "; ".join(f"{layout} x: {'/'.join(shapes)}" for layout, shapes in table.items())


@emulated("npu_rotary_mul", autograd=True, spec="4.1",
    verified=(
        'half mode fp16/fp32 forward on BSND/SBND/BNSD broadcasts (op-plugin test_npu_rotary_mul)',
        'interleave mode forward',
        'fp32 backward for input, r1, r2 in both modes (test_npu_rotary_mul_backward)',
    ),
    docs_only=(
        'rotate= forward and its rotary_mode backward (derivatives.yaml)',
        'bfloat16',
        'B/N/D limits',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_rotary_mul_forward',
        'tests/test_emulate_upstream.py::test_rotary_mul_backward',
        'tests/test_emulate_upstream.py::test_rotary_mode_rejection_is_a_runtime_error',
    ),
)
def npu_rotary_mul(
    input: torch.Tensor,
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
    rotate: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """RoPE x*cos + R(x)*sin with R = rotate_half ('half') or rotate_interleave ('interleave').

    ``input`` is the 4-D input (BNSD, BSND or SBND; the op takes no layout argument, so the
    layout is inferred from how ``r1``/``r2`` broadcast), ``r1`` is cos and ``r2`` is sin, both
    with the full last dim D (``cat(freqs, freqs)`` for half, ``repeat_interleave(2)`` for
    interleave). If ``rotate`` (D×D) is given, ``R(x) = x @ rotate`` instead; ``rotary_mode`` is
    still validated and its layout rules still apply.

    Returns a new tensor with ``input``'s shape and dtype. ``r1``/``r2`` are cast to ``input``'s
    dtype first (as the op does), then everything is computed in fp32 and cast back.

    Constraints (A2/A3, jit_compile=False): fp16/bf16/fp32; D even and < 896; ``r1`` and ``r2``
    have the same shape, one of 11SD/B1SD/BNSD (for BNSD x), 1S1D/BS1D/BSND (BSND), S11D/SB1D/SBND
    (SBND) in half mode, only the position-only 11SD/1S1D/S11D in interleave mode (no per-batch
    cos). half: B < 1000 and N < 1000, and B*N <= 1024 when cos/sin need grads; interleave:
    B*N < 1000. ``'quarter'``/``'interleave-half'`` exist only on Ascend 950 and are rejected.
    cos/sin values are expected in [-1, 1]; that data range is not checked (it would need a
    host sync).

    Autograd: yes for ``input``, ``r1``, ``r2``, also with ``rotate`` (derivatives.yaml: the
    backward is ``npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode)``, which does not see
    ``rotate``: the gradient is that of ``rotary_mode``'s R; ``rotate`` is non_differentiable).

    Choices where the spec is UNCERTAIN: only 4-D input is accepted (the 2.14 wheel doc says 4-D;
    the newer op-plugin doc's 3-D/TND form is not known to work in 2.14). ``rotate`` is applied
    literally as ``x @ rotate``; the doc's interleave example matrix (no sign flip) therefore
    does not reproduce rotate_interleave, and the emulation does not "fix" it.
    """
    api = "npu_rotary_mul"
    require_tensor(api, "input", input)
    require_tensor(api, "r1", r1)
    require_tensor(api, "r2", r2)
    require(api, "rotary_mode", isinstance(rotary_mode, str), f"must be a str, got {type(rotary_mode).__name__}", TypeError)
    require(
        api,
        "rotary_mode",
        rotary_mode not in _ROTARY_MODES_950_ONLY,
        f"{rotary_mode!r} is supported only on Ascend 950; A2/A3 accept 'half' and 'interleave'",
    )
    require(api, "rotary_mode", rotary_mode in ("half", "interleave"), f"must be 'half' or 'interleave', got {rotary_mode!r}")
    require_dtype(api, "input", input)
    require_dtype(api, "r1", r1)
    require_dtype(api, "r2", r2)
    require_rank(api, "input", input, 4)
    require_rank(api, "r1", r1, 4)
    require_rank(api, "r2", r2, 4)
    d = input.shape[-1]
    require(api, "input", d % 2 == 0 and 0 < d < _MAX_D, f"last dim D must be even and < {_MAX_D}, got {d}")
    require(
        api,
        "r1",
        r1.shape[-1] == d,
        f"must have the full last dim D={d} of input (cat(freqs, freqs) / repeat_interleave(2) style), "
        f"got {r1.shape[-1]}; partial rotary is not supported",
    )
    require(api, "r2", tuple(r2.shape) == tuple(r1.shape), f"shape {tuple(r2.shape)} must equal r1's {tuple(r1.shape)}")

    table = _HALF_R_SHAPES if rotary_mode == "half" else _INTERLEAVE_R_SHAPES
    layouts = _r_layouts(input.shape, r1.shape, table)
    if not layouts:
        extra = " (interleave mode takes no per-batch cos/sin)" if rotary_mode == "interleave" else ""
        raise NpuOpError(
            f"{api}: r1 shape {tuple(r1.shape)} is not an allowed {rotary_mode}-mode broadcast of input "
            f"{tuple(input.shape)}{extra}; allowed: {_allowed_text(table)}"
        )
    # The layout is ambiguous when shapes coincide; reject only if no consistent layout fits.
    cos_grad = torch.is_grad_enabled() and (r1.requires_grad or r2.requires_grad)

    def limits_ok(layout: str) -> bool:
        b_idx, n_idx = _LAYOUTS[layout]
        b, n = input.shape[b_idx], input.shape[n_idx]
        if rotary_mode == "interleave":
            return b * n < _MAX_BN
        return b < _MAX_BN and n < _MAX_BN and (not cos_grad or b * n <= _MAX_BN_WITH_COS_GRAD)

    if not any(limits_ok(layout) for layout in layouts):
        if rotary_mode == "interleave":
            rule = f"B*N < {_MAX_BN}"
        else:
            rule = f"B < {_MAX_BN} and N < {_MAX_BN}" + (
                f", and B*N <= {_MAX_BN_WITH_COS_GRAD} when r1/r2 require grad" if cos_grad else ""
            )
        raise NpuOpError(f"{api}: input shape {tuple(input.shape)} (layout {'/'.join(layouts)}) violates {rule}")

    dtype = input.dtype
    x = input.float()
    cos = r1.to(dtype).float()
    sin = r2.to(dtype).float()
    standard = rotate_half(x) if rotary_mode == "half" else rotate_interleave(x)
    out = x * cos + standard * sin
    if rotate is not None:
        require_tensor(api, "rotate", rotate)
        require_dtype(api, "rotate", rotate)
        require(api, "rotate", tuple(rotate.shape) == (d, d), f"must be ({d}, {d}) (D x D), got {tuple(rotate.shape)}")
        matrix_out = x * cos + (x @ rotate.detach().to(dtype).float()) * sin
        # derivatives.yaml: npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode) ignores rotate,
        # so the gradient is the rotary_mode one whatever the matrix; rotate is non_differentiable
        out = matrix_out.detach() + (out - out.detach())  # exact: out - out.detach() is 0
    return out.to(dtype)
    return out


_APPLY_API = "npu_apply_rotary_pos_emb"
_APPLY_D = (64, 128)
_APPLY_LAYOUTS_950_ONLY = ("SBND", "BNSD")


class _ApplyRotaryInPlace(torch.autograd.Function):
    """Writes the rotated query/key into the inputs and marks them dirty.

    ``mark_dirty`` keeps the returned objects identical to the inputs (the op's aliasing) while
    giving them a grad_fn whose backward raises, like op-plugin's autogradNotImplementedFallback.
    """

    @staticmethod
    def forward(ctx, query, key, cos, sin, q_new, k_new):  # type: ignore[override]
        # cos/sin are inputs only so that the outputs require grad whenever any input does.
        query.copy_(q_new)
        key.copy_(k_new)
        ctx.mark_dirty(query, key)
        return query, key

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        raise RuntimeError(
            f"derivative for torch_npu.{_APPLY_API} is not implemented (forward-only op: inference only)"
        )


@emulated("npu_apply_rotary_pos_emb", autograd=False, spec="4.2",
    verified=(
        'fp16 BSND and TND forward (op-plugin test_npu_apply_rotary_pos_emb)',
    ),
    docs_only=(
        'in-place aliasing of query/key',
        'backward raises',
        'bfloat16/fp32',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_apply_rotary_pos_emb',
    ),
)
def npu_apply_rotary_pos_emb(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: str = "BSND",
    rotary_mode: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: query <- query*cos + rotate_half(query)*sin, and the same for key.

    Overwrites ``query`` and ``key`` and returns ``(query, key)`` — the very same tensor objects
    (the schema has no ``(a!)`` annotation, but the kernel updates in place).

    Layouts (A2/A3): ``'BSND'`` with query ``(B,S,Nq,D)``, key ``(B,S,Nk,D)``, cos/sin
    ``(B,S,1,D)``; ``'TND'`` with query ``(T,Nq,D)``, key ``(T,Nk,D)``, cos/sin ``(T,1,D)``.
    ``'SBND'``/``'BNSD'`` are Ascend 950-only and rejected; any other string silently means
    ``'BSND'``, as in the op. Only ``rotary_mode='half'`` (``'quarter'``/``'interleave'`` are
    950-only). D must be 64 or 128 and equal across query/key/cos/sin; all four the same dtype
    (fp16/bf16/fp32); no empty tensors. Computed in fp32, cast back.

    Autograd: none (inference only). Backward through the results raises; a leaf query/key that
    requires grad is rejected up front because it would be overwritten in place.
    """
    api = _APPLY_API
    for name, t in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        require_tensor(api, name, t)
    require(api, "layout", isinstance(layout, str), f"must be a str, got {type(layout).__name__}", TypeError)
    require(api, "rotary_mode", isinstance(rotary_mode, str), f"must be a str, got {type(rotary_mode).__name__}", TypeError)
    require(
        api,
        "layout",
        layout not in _APPLY_LAYOUTS_950_ONLY,
        f"{layout!r} is supported only on Atlas 350/Ascend 950; A2/A3 accept 'BSND' and 'TND'",
    )
    if layout != "TND":
        layout = "BSND"  # the op maps every unknown layout string to BSND
    require(
        api,
        "rotary_mode",
        rotary_mode == "half",
        f"must be 'half' on A2/A3 ('quarter' and 'interleave' are Ascend 950-only), got {rotary_mode!r}",
    )
    require_dtype(api, "query", query)
    for name, t in (("key", key), ("cos", cos), ("sin", sin)):
        require_same_dtype(api, name, t, "query", query)
    rank = 3 if layout == "TND" else 4
    for name, t in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        require_rank(api, name, t, rank)
        require(api, name, t.numel() > 0, f"must not be empty, got shape {tuple(t.shape)}")
    d = query.shape[-1]
    require(api, "query", d in _APPLY_D, f"last dim D must be 64 or 128, got {d}")
    require(api, "key", key.shape[-1] == d, f"last dim {key.shape[-1]} must equal query's D={d}")
    lead = 1 if layout == "TND" else 2
    lead_name = "T" if layout == "TND" else "B and S"
    for name, t in (("key", key), ("cos", cos), ("sin", sin)):
        require(
            api,
            name,
            tuple(t.shape[:lead]) == tuple(query.shape[:lead]),
            f"{lead_name} {tuple(t.shape[:lead])} must equal query's {tuple(query.shape[:lead])} ({layout})",
        )
    want = tuple(query.shape[:lead]) + (1, d)
    for name, t in (("cos", cos), ("sin", sin)):
        require(api, name, tuple(t.shape) == want, f"must have shape {want} ({layout}: N=1, full D), got {tuple(t.shape)}")
    require(
        api,
        "key",
        key.untyped_storage().data_ptr() != query.untyped_storage().data_ptr(),
        "must not share memory with query (both are overwritten in place)",
    )
    for name, t in (("query", query), ("key", key)):
        require(
            api,
            name,
            not (t.is_leaf and t.requires_grad),
            "is a leaf that requires grad; the op overwrites it in place and has no backward (inference only)",
            RuntimeError,
        )

    dtype = query.dtype
    c = cos.float()
    s = sin.float()
    with torch.no_grad():
        q = query.float()
        k = key.float()
        q_new = (q * c + rotate_half(q) * s).to(dtype)
        k_new = (k * c + rotate_half(k) * s).to(dtype)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, cos, sin)):
        return _ApplyRotaryInPlace.apply(query, key, cos, sin, q_new, k_new)
    query.copy_(q_new)
    key.copy_(k_new)
    return query, key
