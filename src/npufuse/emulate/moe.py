"""Grouped matmul and MoE routing ops (spec §7, §8).

Index conventions matter here (spec §13.9): the v1 routing ops (``npu_moe_gating_top_k_softmax``,
``npu_moe_init_routing``, ``npu_moe_finalize_routing`` modes 0/1) use k-major flat positions
``k*N + i``; finalize modes 2/3 use row-major ``i*K + k``; torch_npu's permute/unpermute
``sorted_indices`` is the inverse permutation (src -> dst), not Megatron's argsort.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from npufuse.emulate.checks import (
    NpuOpError,
    dtype_name,
    forward_only,
    no_gradient_formula,
    require,
    require_dtype,
    require_rank,
    require_same_dtype,
    require_tensor,
)
from npufuse.emulate.registry import emulated

# --------------------------------------------------------------------------------------------
# npu_grouped_matmul (§7.1)
# --------------------------------------------------------------------------------------------

_GMM = "npu_grouped_matmul"
_GMM_MAX_LIST = 128  # x / weight list length, and groups with a weight list
_GMM_MAX_GROUPS_3D = 1024  # groups with a single [E, K, N] weight
_GMM_INNER_LIMIT = 65536  # K and N must each be < 65536
# bias dtype per x dtype (non-quant table of the wheel doc)
_GMM_BIAS_DTYPE = {torch.float16: torch.float16, torch.bfloat16: torch.float32, torch.float32: torch.float32}


def _is_transposed_view(t: torch.Tensor) -> bool:
    """op-plugin's ``is_weight_trans``: last two dims stored transposed (``w.transpose(-1, -2)``)."""
    return (not t.is_contiguous()) and t.stride(-2) == 1 and t.stride(-1) == t.shape[-2]


def _tensor_list(arg: str, value: object) -> list[torch.Tensor]:
    require(
        _GMM,
        arg,
        isinstance(value, (list, tuple)),
        f"must be a list of Tensors (it is always a Python list, even for one tensor), got {type(value).__name__}",
        TypeError,
    )
    for i, t in enumerate(value):  # type: ignore[union-attr]
        require_tensor(_GMM, f"{arg}[{i}]", t)
    return list(value)  # type: ignore[arg-type]


def _group_sizes(
    group_list: Union[torch.Tensor, Sequence[int]], group_list_type: int, total: int, axis: str
) -> list[int]:
    """Per-group sizes along the grouped axis; validates the documented value rules."""
    values = group_list.tolist() if isinstance(group_list, torch.Tensor) else list(group_list)
    require(_GMM, "group_list", all(v >= 0 for v in values), f"values must be non-negative, got {values}")
    if group_list_type == 1:
        require(_GMM, "group_list", len(values) != 1, "with group_list_type=1 (counts) must not have length 1")
        require(
            _GMM, "group_list", sum(values) == total, f"counts {values} must sum to {axis}={total} (group_list_type=1)"
        )
        return values
    require(
        _GMM,
        "group_list",
        all(b >= a for a, b in zip(values, values[1:])),
        f"cumulative offsets {values} must be non-decreasing (group_list_type=0)",
    )
    require(
        _GMM,
        "group_list",
        bool(values) and values[-1] == total,
        f"cumulative offsets {values} must end at {axis}={total} (group_list_type=0; use 1 for per-group counts)",
    )
    return [b - a for a, b in zip([0] + values[:-1], values)]


def _check_bias(bias: Optional[list[torch.Tensor]], weights: list[torch.Tensor], single_3d: bool, x_dtype: torch.dtype):
    if bias is None:
        return None
    bias = _tensor_list("bias", bias)
    require(_GMM, "bias", len(bias) == len(weights), f"must have one tensor per weight ({len(weights)}), got {len(bias)}")
    want_dtype = _GMM_BIAS_DTYPE[x_dtype]
    for i, (b, w) in enumerate(zip(bias, weights)):
        require(
            _GMM,
            f"bias[{i}]",
            b.dtype == want_dtype,
            f"has dtype {dtype_name(b.dtype)}; with {dtype_name(x_dtype)} x it must be {dtype_name(want_dtype)}",
            TypeError,
        )
        want = (w.shape[0], w.shape[-1]) if single_3d else (w.shape[-1],)
        require(_GMM, f"bias[{i}]", tuple(b.shape) == want, f"must have shape {want}, got {tuple(b.shape)}")
    return bias


def _check_weights(weights: list[torch.Tensor], x0: torch.Tensor) -> None:
    trans = None
    for i, w in enumerate(weights):
        require_same_dtype(_GMM, f"weight[{i}]", w, "x[0]", x0)
        require(_GMM, f"weight[{i}]", w.dim() in (2, 3), f"must be 2-D or 3-D, got {w.dim()}-D")
        t = _is_transposed_view(w)
        if trans is not None:
            require(_GMM, f"weight[{i}]", t == trans, "transposed-ness must be the same for every weight in the list")
        trans = t
        for name, size in (("K", w.shape[-2]), ("N", w.shape[-1])):
            require(
                _GMM, f"weight[{i}]", size < _GMM_INNER_LIMIT, f"{name}={size} must be < {_GMM_INNER_LIMIT} (inner-axis limit)"
            )


def _check_k(i: int, x_k: int, w: torch.Tensor) -> None:
    if w.shape[-2] == x_k:
        return
    hint = ""
    if w.shape[-1] == x_k:
        hint = (
            "; it looks like [.., N, K] (nn.Linear out x in) storage: pass w.transpose(-1, -2) as a view "
            "(logical [.., K, N]), without .contiguous()"
        )
    raise NpuOpError(f"{_GMM}: weight[{i}] has K={w.shape[-2]} (shape {tuple(w.shape)}) but x has K={x_k}{hint}")


def _mm(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    y = torch.matmul(x.float(), w.float())
    if b is not None:
        y = y + b.float()
    return y.to(dtype)


@emulated("npu_grouped_matmul", autograd=False, spec="7.1",
    verified=(
        'op-plugin test_npu_grouped_matmul_0/1/2/3/4/6/7: independent pairs, single [E,K,N] weight, multi-x single-y, [E,N] bias, K grouping (group_type 2), fp32 x with a weight list',
        'no gradient formula: warns and leaves .grad None',
        'RuntimeError for empty lists and unknown group_type',
    ),
    docs_only=(
        'List[int] group_list overload',
        'bfloat16',
        'group_list_type 1',
        'quantized forms (not emulated)',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_grouped_matmul_0_multi_multi_multi',
        'tests/test_emulate_upstream.py::test_grouped_matmul_1_3d_weight_and_3_weight_list',
        'tests/test_emulate_upstream.py::test_grouped_matmul_2_multi_multi_single',
        'tests/test_emulate_upstream.py::test_grouped_matmul_4_list_group_list_and_3d_bias',
        'tests/test_emulate_upstream.py::test_grouped_matmul_6_k_grouping',
        'tests/test_emulate_upstream.py::test_grouped_matmul_7_fp32_x_with_weight_list',
        'tests/test_emulate_upstream.py::test_grouped_matmul_has_no_gradient_formula',
        'tests/test_emulate_upstream.py::test_grouped_matmul_runtime_errors',
    ),
)
def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias: Optional[list[torch.Tensor]] = None,
    scale: Optional[list[torch.Tensor]] = None,
    offset: Optional[list[torch.Tensor]] = None,
    antiquant_scale: Optional[list[torch.Tensor]] = None,
    antiquant_offset: Optional[list[torch.Tensor]] = None,
    per_token_scale: Optional[list[torch.Tensor]] = None,
    group_list: Optional[Union[torch.Tensor, Sequence[int]]] = None,
    activation_input: Optional[list[torch.Tensor]] = None,
    activation_quant_scale: Optional[list[torch.Tensor]] = None,
    activation_quant_offset: Optional[list[torch.Tensor]] = None,
    split_item: Optional[int] = 0,
    group_type: Optional[int] = None,
    group_list_type: Optional[int] = 0,
    act_type: Optional[int] = 0,
    tuning_config: Optional[Sequence[int]] = None,
    output_dtype: Optional[torch.dtype] = None,
    x_dtype: Optional[int] = None,
    weight_dtype: Optional[int] = None,
    scale_dtype: Optional[int] = None,
    per_token_scale_dtype: Optional[int] = None,
) -> list[torch.Tensor]:
    """Grouped matmul y_g = x_g @ weight_g (+ bias_g); always returns a list of tensors.

    ``x`` and ``weight`` are Python lists. A single 3-D weight is logical ``[E, K, N]``; experts
    stored ``[E, N, K]`` must be passed as ``w.transpose(1, 2)`` (a view; detected by strides
    like op-plugin's ``is_weight_trans``). Computed in fp32 per group, cast to x's dtype.

    Overloads: a Tensor (int64, 1-D) or None ``group_list`` selects the Tensor overload, which
    needs an explicit ``group_type`` (else "Requires manual passing group_type"):

    * ``group_type=-1``: independent pairs ``x[i] @ weight[i]`` (x 2-6-D, weights 2-D),
      ``split_item`` 0/1, ``group_list`` must be None; one output per pair.
    * ``group_type=0`` (MoE, grouping along M), ``split_item`` 2/3, one concatenated ``[M, N]``
      output: single 2-D x + single ``[E, K, N]`` weight (<= 1024 groups), single x + list of 2-D
      weights with equal N (<= 128), or lists of x and weights (group_list optional, must match
      the x row counts). ``group_list_type`` 0 = cumulative ends (non-decreasing, last == M),
      1 = counts (sum == M, length != 1).
    * ``group_type=2`` (grouping along K): single 2-D x ``[M, K]``, single 2-D weight ``[K, N]``,
      ``split_item`` 2/3, output ``[G, M, N]`` with ``y[g] = x[:, K_g] @ w[K_g, :]``.

    A ``List[int]`` ``group_list`` selects the ``.List`` overload: cumulative, non-decreasing,
    length != 1, ``group_type`` None, ``group_list_type`` 0 (default). ``split_item`` 0/1: single
    x split into one output per weight (group_list required) or independent pairs; 2/3: one
    concatenated output (single x needs group_list ending at M).

    Constraints: non-quant fp16/bf16/fp32, x and weights the same dtype; fp32 in the Tensor
    overload only with a single x and a single y (split_item 2/3), with one weight or a list of them
    (op-plugin test_npu_grouped_matmul_7 runs fp32 x with a list of three weights); bias ``[N]`` per 2-D weight or
    ``[E, N]`` for a 3-D weight, fp16 for fp16 x and fp32 otherwise; K and N < 65536; x must not
    be a transposed view (except for group_type=2); list lengths <= 128; ``act_type`` 0 (others
    exist only in the per-token-quant scenario); ``output_dtype`` None or x's dtype. Quantized
    and pseudo-quantized forms (scale, antiquant_*, per_token_scale, *_dtype) are not emulated.

    Autograd: none. No derivative registered: backward warns and leaves the inputs' ``.grad`` None (VariableFallbackKernel).

    group_type=2 operand convention settled by op-plugin's test_npu_grouped_matmul_6: x is the
    [M, K] view ``x1.T`` of a [K, M] tensor, weight one [K, N] tensor, group_list the cumulative
    K ends; ``y[g] = x[:, K_g] @ weight[K_g, :]`` stacked to [G, M, N]; split_item 2/3 only. ``group_type=0`` with split_item 0/1 is
    rejected per the doc's scenario table although op-plugin's C++ would build per-group outputs.
    """
    api = _GMM
    xs = _tensor_list("x", x)
    ws = _tensor_list("weight", weight)
    graph_inputs = [*xs, *ws, *(bias if isinstance(bias, (list, tuple)) else ())]
    require(api, "x", len(xs) > 0, "must not be empty")
    require(api, "weight", len(ws) > 0, "must not be empty")
    require(api, "x", len(xs) <= _GMM_MAX_LIST, f"list length must be <= {_GMM_MAX_LIST}, got {len(xs)}")
    require(api, "weight", len(ws) <= _GMM_MAX_LIST, f"list length must be <= {_GMM_MAX_LIST}, got {len(ws)}")
    for name, value in (
        ("scale", scale),
        ("antiquant_scale", antiquant_scale),
        ("antiquant_offset", antiquant_offset),
        ("per_token_scale", per_token_scale),
        ("x_dtype", x_dtype),
        ("weight_dtype", weight_dtype),
        ("scale_dtype", scale_dtype),
        ("per_token_scale_dtype", per_token_scale_dtype),
    ):
        if value is not None:
            raise NotImplementedError(f"{api}: {name} is set: quantized grouped matmul is not emulated (non-quant only)")
    for name, value in (
        ("offset", offset),
        ("activation_input", activation_input),
        ("activation_quant_scale", activation_quant_scale),
        ("activation_quant_offset", activation_quant_offset),
    ):
        require(api, name, value is None, "must be None (only None is supported)")
    require(api, "act_type", act_type in (None, 0), f"must be 0: activations apply only in the per-token-quant scenario, got {act_type}")
    split = 0 if split_item is None else split_item
    require(api, "split_item", split in (0, 1, 2, 3), f"must be one of 0/1/2/3, got {split_item}")
    if tuning_config is not None:
        require(api, "tuning_config", all(isinstance(v, int) for v in tuning_config), "must be a list of ints", TypeError)

    dtype = xs[0].dtype
    require_dtype(api, "x[0]", xs[0])
    for i, t in enumerate(xs[1:], 1):
        require_same_dtype(api, f"x[{i}]", t, "x[0]", xs[0])
    _check_weights(ws, xs[0])
    require(
        api,
        "output_dtype",
        output_dtype is None or output_dtype == dtype,
        f"must be None or x's dtype {dtype_name(dtype)} in the non-quant scenario, got {output_dtype}",
    )
    for i, t in enumerate(xs):
        require(
            api, f"x[{i}]", t.shape[-1] < _GMM_INNER_LIMIT, f"K={t.shape[-1]} must be < {_GMM_INNER_LIMIT} (inner-axis limit)"
        )

    single_3d = len(ws) == 1 and ws[0].dim() == 3
    if single_3d:
        require(api, "weight", len(xs) == 1, "is a single 3-D [E, K, N] tensor, which needs a single x")
    else:
        for i, w in enumerate(ws):
            require(api, f"weight[{i}]", w.dim() == 2, f"must be 2-D in a weight list, got {w.dim()}-D")
    bias_list = _check_bias(bias, ws, single_3d, dtype)

    is_list_form = isinstance(group_list, (list, tuple))
    if group_list is not None and not is_list_form:
        require(
            api,
            "group_list",
            isinstance(group_list, torch.Tensor),
            f"must be a Tensor, a list of ints or None, got {type(group_list).__name__}",
            TypeError,
        )

    if is_list_form:
        values = list(group_list)  # type: ignore[arg-type]
        require(api, "group_list", all(isinstance(v, int) and not isinstance(v, bool) for v in values), "must hold ints", TypeError)
        require(api, "group_type", group_type is None, f"must be None with a List[int] group_list, got {group_type}")
        require(
            api,
            "group_list_type",
            group_list_type in (None, 0),
            f"must be 0/None with a List[int] group_list (it is always cumulative), got {group_list_type}",
        )
        require(api, "group_list", len(values) != 1, "as a List[int] must not have length 1")
        require(
            api,
            "weight",
            not single_3d,
            "is a single 3-D [E, K, N] tensor, which needs a Tensor group_list with group_type=0",
        )
        gl: Optional[list[int]] = values if values else None
        gtype = 0 if split in (2, 3) else -1
        gl_type = 0
    else:
        require(
            api,
            "group_type",
            group_type is not None,
            "is None: Requires manual passing group_type with a Tensor or None group_list (-1, 0 or 2)",
        )
        require(
            api,
            "group_type",
            group_type in (-1, 0, 2),
            f"must be -1 (none), 0 (M) or 2 (K), got {group_type} (N grouping is unsupported)",
        )
        gl_type = 0 if group_list_type is None else group_list_type
        require(api, "group_list_type", gl_type in (0, 1), f"must be 0 (cumsum) or 1 (counts), got {group_list_type}")
        if isinstance(group_list, torch.Tensor):
            require_dtype(api, "group_list", group_list, (torch.int64,))
            require_rank(api, "group_list", group_list, 1)
        gl = group_list  # type: ignore[assignment]
        gtype = group_type  # type: ignore[assignment]
        if dtype == torch.float32:
            require(
                api,
                "x[0]",
                len(xs) == 1 and split in (2, 3),
                "is float32, which the Tensor overload supports only with a single x and a single y (split_item 2/3)",
                TypeError,
            )

    def bias_of(i: int) -> Optional[torch.Tensor]:
        return None if bias_list is None else bias_list[i]

    if gtype == 2:
        require(api, "split_item", split in (2, 3), f"must be 2 or 3 with group_type=2 (K grouping), got {split}")
        require(api, "x", len(xs) == 1 and xs[0].dim() == 2, "must be a single 2-D [M, K] tensor with group_type=2")
        require(api, "weight", len(ws) == 1 and ws[0].dim() == 2, "must be a single 2-D [K, N] tensor with group_type=2")
        require(api, "group_list", gl is not None, "is required with group_type=2")
        require(api, "bias", bias_list is None, "is not supported with group_type=2")
        xm, w = xs[0], ws[0]
        _check_k(0, xm.shape[1], w)
        sizes = _group_sizes(gl, gl_type, xm.shape[1], "K")  # type: ignore[arg-type]
        outs, start = [], 0
        for size in sizes:
            outs.append(_mm(xm[:, start : start + size], w[start : start + size], None, dtype))
            start += size
        return _as_list(graph_inputs, torch.stack(outs) if outs else xm.new_empty((0, xm.shape[0], w.shape[-1])))

    for i, t in enumerate(xs):
        require(api, f"x[{i}]", not _is_transposed_view(t), "must not be a transposed view (x transposition is unsupported)")

    if gtype == -1:
        # Independent pairs (Tensor overload group_type=-1, or List overload split_item 0/1).
        require(api, "split_item", split in (0, 1), f"must be 0 or 1 for independent groups (group_type=-1), got {split}")
        if not is_list_form:
            require(api, "group_list", gl is None, "must be None with group_type=-1")
        require(api, "weight", not single_3d, "is a single 3-D [E, K, N] tensor, which needs group_type=0 and split_item 2/3")
        if len(xs) == 1 and gl is not None:
            # List overload, single x split along M into one output per weight.
            require(api, "x[0]", xs[0].dim() == 2, "must be 2-D when split by group_list")
            require(api, "group_list", len(gl) == len(ws), f"must have one entry per weight ({len(ws)}), got {len(gl)}")
            sizes = _group_sizes(gl, 0, xs[0].shape[0], "M")
            return _as_list(graph_inputs, *_per_group(xs[0], ws, sizes, bias_of, dtype))
        require(api, "weight", len(ws) == len(xs), f"must have one tensor per x tensor ({len(xs)}), got {len(ws)}")
        rank = xs[0].dim()
        for i, t in enumerate(xs):
            require(api, f"x[{i}]", 2 <= t.dim() <= 6 and t.dim() == rank, f"must be 2-6-D and all x the same rank, got {t.dim()}-D")
        if gl is not None:
            require(api, "group_list", rank == 2, "must be empty when x tensors are more than 2-D")
            require(api, "group_list", len(gl) == len(xs), f"must have one entry per x ({len(xs)}), got {len(gl)}")
            sizes = _group_sizes(gl, 0, sum(t.shape[0] for t in xs), "M")
            for i, (t, s) in enumerate(zip(xs, sizes)):
                require(api, "group_list", t.shape[0] == s, f"group {i} size {s} must equal x[{i}] rows {t.shape[0]}")
        outs = []
        for i, (t, w) in enumerate(zip(xs, ws)):
            _check_k(i, t.shape[-1], w)
            outs.append(_mm(t, w, bias_of(i), dtype))
        return _as_list(graph_inputs, *outs)

    # gtype == 0: grouping along M, one concatenated output.
    require(api, "split_item", split in (2, 3), f"must be 2 or 3 with group_type=0 (one concatenated output), got {split}")
    for i, t in enumerate(xs):
        require(api, f"x[{i}]", t.dim() == 2, f"must be 2-D with group_type=0, got {t.dim()}-D")
    n = ws[0].shape[-1]
    for i, w in enumerate(ws):
        require(api, f"weight[{i}]", w.shape[-1] == n, f"N={w.shape[-1]} must equal weight[0]'s N={n} (single output)")
    if len(xs) == 1:
        num_groups = ws[0].shape[0] if single_3d else len(ws)
        limit = _GMM_MAX_GROUPS_3D if single_3d else _GMM_MAX_LIST
        require(api, "group_list", gl is not None, "is required when a single x is grouped along M")
        require(api, "group_list", len(gl) == num_groups, f"must have one entry per expert ({num_groups}), got {len(gl)}")
        require(api, "group_list", num_groups <= limit, f"supports at most {limit} groups here, got {num_groups}")
        sizes = _group_sizes(gl, gl_type, xs[0].shape[0], "M")
        experts = list(ws[0].unbind(0)) if single_3d else ws
        if single_3d and bias_list is not None:
            bias_rows = list(bias_list[0].unbind(0))
            parts = _per_group(xs[0], experts, sizes, lambda i: bias_rows[i], dtype)
        else:
            parts = _per_group(xs[0], experts, sizes, bias_of, dtype)
        return _as_list(graph_inputs, torch.cat(parts, dim=0))
    require(api, "weight", len(ws) == len(xs), f"must have one tensor per x tensor ({len(xs)}), got {len(ws)}")
    if gl is not None:
        require(api, "group_list", len(gl) == len(xs), f"must have one entry per x ({len(xs)}), got {len(gl)}")
        sizes = _group_sizes(gl, gl_type, sum(t.shape[0] for t in xs), "M")
        for i, (t, s) in enumerate(zip(xs, sizes)):
            require(api, "group_list", t.shape[0] == s, f"group {i} size {s} must equal x[{i}] rows {t.shape[0]}")
    outs = []
    for i, (t, w) in enumerate(zip(xs, ws)):
        _check_k(i, t.shape[-1], w)
        outs.append(_mm(t, w, bias_of(i), dtype))
    return _as_list(graph_inputs, torch.cat(outs, dim=0))


def _per_group(xm: torch.Tensor, experts: Sequence[torch.Tensor], sizes: list[int], bias_of, dtype: torch.dtype):
    parts, start = [], 0
    for e, (w, size) in enumerate(zip(experts, sizes)):
        _check_k(e, xm.shape[1], w)
        parts.append(_mm(xm[start : start + size], w, bias_of(e), dtype))
        start += size
    return parts


def _as_list(graph_inputs: list[object], *outs: torch.Tensor) -> list[torch.Tensor]:
    wrapped = no_gradient_formula(_GMM, *outs, inputs=graph_inputs)
    return list(wrapped) if isinstance(wrapped, tuple) else [wrapped]


# --------------------------------------------------------------------------------------------
# npu_moe_token_permute / npu_moe_token_unpermute (§8.6)
# --------------------------------------------------------------------------------------------

_INDEX_LIMIT = 16777215  # indices: numel < 2^24 - 1, values in [0, 2^24 - 1)
_MAX_TOPK = 512


@emulated("npu_moe_token_permute", autograd=True, spec="8.6",
    verified=(
        'bf16 forward for topk 1/4, sorted_indices as the inverse permutation, backward (op-plugin test_npu_moe_token_permute_and_unpermute(_backward))',
    ),
    docs_only=(
        'num_out_tokens dropping',
        'padded_mode (rejected)',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_moe_token_permute_unpermute_and_backward',
    ),
)
def npu_moe_token_permute(
    tokens: torch.Tensor,
    indices: torch.Tensor,
    num_out_tokens: Optional[int] = None,
    padded_mode: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replicate each token topK times and sort the copies by expert id (stable).

    ``flat = indices.flatten()`` (row-major; topK = ``indices.shape[1]``, or 1 for 1-D indices),
    ``order = argsort(flat, stable=True)``, ``permuted_tokens[j] = tokens[order[j] // topK]``.
    Returns ``(permuted_tokens, sorted_indices)`` where ``sorted_indices = argsort(order)`` (int32,
    ``[N*topK]``) is the inverse permutation: ``permuted_tokens[sorted_indices[i]] ==
    tokens[i // topK]``. Feed it to ``npu_moe_token_unpermute``; it is *not* Megatron's
    dst->src ``sorted_indices``.

    ``num_out_tokens``: None/0 keep all rows; > 0 keep the first ``min(n, N*topK)``; < 0 keep
    ``N*topK + n``. tokens 2-D fp16/bf16/fp32 (non-contiguous allowed); indices 1-D/2-D int32/int64
    with fewer than 16777215 elements and values in [0, 16777215); topK <= 512; ``padded_mode``
    only False.

    Autograd: yes (w.r.t. tokens). UNCERTAIN (spec §8.6): the older duplicate docstring uses the
    dst->src convention; this follows the newer docstring and the kernel (src->dst).
    """
    api = "npu_moe_token_permute"
    require_tensor(api, "tokens", tokens)
    require_tensor(api, "indices", indices)
    require_dtype(api, "tokens", tokens)
    require_dtype(api, "indices", indices, (torch.int32, torch.int64))
    require_rank(api, "tokens", tokens, 2)
    require_rank(api, "indices", indices, 1, 2)
    require(api, "padded_mode", padded_mode is False, "must be False (padded mode is not supported)")
    topk = indices.shape[1] if indices.dim() == 2 else 1
    require(api, "indices", indices.shape[0] == tokens.shape[0], f"has {indices.shape[0]} rows but tokens has {tokens.shape[0]}")
    require(api, "indices", topk <= _MAX_TOPK, f"topK={topk} must be <= {_MAX_TOPK}")
    require(api, "indices", indices.numel() < _INDEX_LIMIT, f"must have fewer than {_INDEX_LIMIT} elements")
    flat = indices.reshape(-1).long()
    if flat.numel():
        lo, hi = int(flat.min()), int(flat.max())
        require(api, "indices", lo >= 0 and hi < _INDEX_LIMIT, f"values must be in [0, {_INDEX_LIMIT}), got [{lo}, {hi}]")
    total = flat.numel()
    if num_out_tokens is None or num_out_tokens == 0:
        keep = total
    else:
        require(api, "num_out_tokens", isinstance(num_out_tokens, int), "must be an int or None", TypeError)
        keep = min(num_out_tokens, total) if num_out_tokens > 0 else total + num_out_tokens
        require(api, "num_out_tokens", keep >= 0, f"{num_out_tokens} drops more than the {total} permuted rows")
    order = torch.argsort(flat, stable=True)
    sorted_indices = torch.argsort(order).to(torch.int32)
    permuted = tokens.index_select(0, torch.div(order[:keep], topk, rounding_mode="floor"))
    return permuted, sorted_indices


@emulated("npu_moe_token_unpermute", autograd=True, spec="8.6",
    verified=(
        'bf16 forward with and without probs, permute/unpermute round trip (op-plugin test_npu_moe_token_permute_and_unpermute)',
    ),
    docs_only=(
        'backward w.r.t. probs',
        'rows dropped by num_out_tokens',
        'restore_shape / padded_mode (rejected)',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_moe_token_permute_unpermute_and_backward',
    ),
)
def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    padded_mode: bool = False,
    restore_shape: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """out[i] = sum_k permuted_tokens[sorted_indices[i*topK + k]] * probs[i, k] (inverse of permute).

    ``sorted_indices`` is the src->dst map produced by ``npu_moe_token_permute`` (1-D int32,
    ``[N*topK]``, values in ``[0, N*topK)``, no duplicates). ``probs`` ``[N, topK]`` gives the
    weights; None means topK = 1 and weight 1. Rows dropped by permute's ``num_out_tokens``
    (index >= ``permuted_tokens.shape[0]``) contribute zero. Returns ``[N, H]`` in
    ``permuted_tokens``' dtype, computed in fp32. topK <= 512; ``padded_mode`` only False and
    ``restore_shape`` only None.

    Autograd: yes (w.r.t. permuted_tokens and probs).
    """
    api = "npu_moe_token_unpermute"
    require_tensor(api, "permuted_tokens", permuted_tokens)
    require_tensor(api, "sorted_indices", sorted_indices)
    require_dtype(api, "permuted_tokens", permuted_tokens)
    require_dtype(api, "sorted_indices", sorted_indices, (torch.int32,))
    require_rank(api, "permuted_tokens", permuted_tokens, 2)
    require_rank(api, "sorted_indices", sorted_indices, 1)
    require(api, "padded_mode", padded_mode is False, "must be False (padded mode is not supported)")
    require(api, "restore_shape", restore_shape is None, "must be None (used only by the unsupported padded mode)")
    total = sorted_indices.numel()
    if probs is not None:
        require_tensor(api, "probs", probs)
        require_dtype(api, "probs", probs)
        require_rank(api, "probs", probs, 2)
        topk = probs.shape[1]
        require(
            api, "probs", probs.numel() == total, f"shape {tuple(probs.shape)} must hold one weight per sorted index ({total})"
        )
    else:
        topk = 1
    require(api, "probs", topk <= _MAX_TOPK, f"topK={topk} must be <= {_MAX_TOPK}")
    idx = sorted_indices.long()
    if total:
        lo, hi = int(idx.min()), int(idx.max())
        require(api, "sorted_indices", lo >= 0 and hi < total, f"values must be in [0, {total}), got [{lo}, {hi}]")
        require(api, "sorted_indices", torch.unique(idx).numel() == total, "must not contain duplicates")
    rows = permuted_tokens.shape[0]
    require(
        api,
        "permuted_tokens",
        rows <= total,
        f"has {rows} rows, more than the {total} sorted indices (N*topK)",
    )
    valid = idx < rows
    gathered = permuted_tokens.index_select(0, torch.where(valid, idx, torch.zeros_like(idx))).float()
    gathered = gathered * valid.unsqueeze(1)
    gathered = gathered.view(total // topk, topk, permuted_tokens.shape[1])
    if probs is not None:
        gathered = gathered * probs.float().unsqueeze(-1)
    return gathered.sum(dim=1).to(permuted_tokens.dtype)


# --------------------------------------------------------------------------------------------
# npu_moe_gating_top_k_softmax / npu_moe_init_routing / npu_moe_finalize_routing (§8.1, 8.2, 8.4)
# --------------------------------------------------------------------------------------------

_GATING_MAX_K = 1024


@emulated("npu_moe_gating_top_k_softmax", autograd=False, spec="8.1",
    verified=(
        'fp16/fp32 y, expert_idx with finished rows, k-major row_idx (op-plugin test_npu_moe_gating_top_k_softmax)',
    ),
    docs_only=(
        '3-D x',
        'y of finished rows',
        'backward (raises)',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_moe_gating_top_k_softmax',
    ),
)
def npu_moe_gating_top_k_softmax(
    x: torch.Tensor,
    finished: Optional[torch.Tensor] = None,
    k: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax over experts, then top-k: returns (y, expert_idx, row_idx), NOT renormalized.

    ``sm = softmax(x.float(), -1).to(x.dtype)``; ``expert_idx`` = the k largest of ``sm``
    (stable: ties go to the lower expert id); ``y = sm.gather(-1, expert_idx)``. Rows with
    ``finished[i] == True`` get ``expert_idx = num_experts`` (= ``x.shape[-1]``).
    ``row_idx[i, k] = k*N + i`` over the N flattened rows (k-major, as ``npu_moe_init_routing``
    expects). Shapes ``x.shape[:-1] + (k,)``; y in x's dtype, indices int32.

    Mixtral-style routing needs ``y / y.sum(-1, keepdim=True)`` afterwards.
    x 2-D/3-D fp16/bf16/fp32; finished bool with shape ``x.shape[:-1]``; 0 < k <= experts, k <= 1024.

    Autograd: none (backward raises). ``y`` for finished rows keeps the normal top-k softmax
    values, as op-plugin's test_npu_moe_gating_top_k_softmax golden does (spec §8.1 UNCERTAIN).
    """
    api = "npu_moe_gating_top_k_softmax"
    require_tensor(api, "x", x)
    require_dtype(api, "x", x)
    require_rank(api, "x", x, 2, 3)
    num_experts = x.shape[-1]
    require(api, "k", isinstance(k, int) and not isinstance(k, bool), "must be an int", TypeError)
    require(api, "k", 0 < k <= num_experts and k <= _GATING_MAX_K, f"must satisfy 0 < k <= {min(num_experts, _GATING_MAX_K)}, got {k}")
    if finished is not None:
        require_tensor(api, "finished", finished)
        require_dtype(api, "finished", finished, (torch.bool,))
        require(
            api,
            "finished",
            tuple(finished.shape) == tuple(x.shape[:-1]),
            f"shape {tuple(finished.shape)} must be x.shape[:-1] = {tuple(x.shape[:-1])}",
        )
    sm = torch.softmax(x.float(), dim=-1).to(x.dtype)
    # sort on the x-dtype-rounded probabilities, as the golden does (ties -> lower expert id)
    expert_idx = torch.argsort(sm.detach().float(), dim=-1, descending=True, stable=True)[..., :k]
    y = sm.gather(-1, expert_idx)
    expert_idx = expert_idx.to(torch.int32)
    if finished is not None:
        expert_idx = torch.where(finished.unsqueeze(-1), torch.full_like(expert_idx, num_experts), expert_idx)
    rows = x.shape[:-1].numel()
    row_idx = torch.arange(rows * k, dtype=torch.int32, device=x.device).view(k, rows).t().reshape(*x.shape[:-1], k)
    return forward_only(api, y), expert_idx, row_idx


_INIT_ROUTING_MAX_NUMEL = 1 << 24


@emulated("npu_moe_init_routing", autograd=False, spec="8.2",
    verified=(
        'fp16/fp32 expanded_x, expanded_row_idx, expanded_expert_idx with active_num = N (op-plugin test_npu_moe_init_routing)',
    ),
    docs_only=(
        'active_num < N',
        'no gradient formula (warns)',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_moe_init_routing',
    ),
)
def npu_moe_init_routing(
    x: torch.Tensor,
    row_idx: torch.Tensor,
    expert_idx: torch.Tensor,
    active_num: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort token copies by expert: returns (expanded_x, expanded_row_idx, expanded_expert_idx).

    Exact golden (spec §8.2)::

        perm = argsort(expert_idx.flatten(), stable=True)   # row-major flatten of [N, K]
        expanded_expert_idx = expert_idx.flatten()[perm]
        dst_to_src = row_idx.flatten()[perm]                 # k-major source ids k*N + i
        expanded_row_idx[dst_to_src] = arange(N*K)           # src (k-major) -> dst
        expanded_x = x[dst_to_src[: min(N, active_num)*K] % N]

    Shapes ``[min(N, active_num)*K, H]`` (x's dtype), ``[N*K]`` int32, ``[N*K]`` int32.
    x 2-D fp16/bf16/fp32 with numel < 2^24; row_idx and expert_idx int32 ``[N, K]``; row_idx
    must be a permutation of ``[0, N*K)`` (normally ``npu_moe_gating_top_k_softmax``'s third
    output); active_num >= 0. No derivative registered: backward warns and leaves the inputs' ``.grad`` None (VariableFallbackKernel).
    """
    api = "npu_moe_init_routing"
    require_tensor(api, "x", x)
    require_tensor(api, "row_idx", row_idx)
    require_tensor(api, "expert_idx", expert_idx)
    require_dtype(api, "x", x)
    require_dtype(api, "row_idx", row_idx, (torch.int32,))
    require_dtype(api, "expert_idx", expert_idx, (torch.int32,))
    require_rank(api, "x", x, 2)
    require_rank(api, "expert_idx", expert_idx, 2)
    require(api, "x", x.numel() < _INIT_ROUTING_MAX_NUMEL, f"numel {x.numel()} must be < 2^24")
    n, kk = expert_idx.shape
    require(api, "expert_idx", n == x.shape[0], f"has {n} rows but x has {x.shape[0]}")
    require(api, "row_idx", tuple(row_idx.shape) == (n, kk), f"shape {tuple(row_idx.shape)} must equal expert_idx's {(n, kk)}")
    require(api, "active_num", isinstance(active_num, int) and not isinstance(active_num, bool), "must be an int", TypeError)
    require(api, "active_num", active_num >= 0, f"must be >= 0, got {active_num}")
    flat_rows = row_idx.reshape(-1).long()
    total = n * kk
    require(
        api,
        "row_idx",
        torch.equal(torch.sort(flat_rows).values, torch.arange(total, device=flat_rows.device)),
        f"must be a permutation of [0, {total}) (k-major source positions k*N + i)",
    )
    flat_experts = expert_idx.reshape(-1)
    perm = torch.argsort(flat_experts.long(), stable=True)
    expanded_expert_idx = flat_experts[perm].to(torch.int32)
    dst_to_src = flat_rows[perm]
    expanded_row_idx = torch.empty(total, dtype=torch.int32, device=x.device)
    expanded_row_idx[dst_to_src] = torch.arange(total, dtype=torch.int32, device=x.device)
    active = min(n, active_num) * kk
    expanded_x = x.index_select(0, dst_to_src[:active] % n) if n else x.new_empty((0, x.shape[1]))
    return no_gradient_formula(api, expanded_x, inputs=(x,)), expanded_row_idx, expanded_expert_idx


@emulated("npu_moe_finalize_routing", autograd=False, spec="8.4",
    verified=(),
    docs_only=(
        'everything: op-plugin has tests for the v2 op only (drop_pad_mode 0-3, skips, bias, scales from the docs)',
        'no gradient formula (warns)',
    ),
    held_by=(
        'tests/test_emulate_moe.py::test_finalize_routing_modes',
        'tests/test_emulate_moe.py::test_v1_pipeline_gating_init_finalize',
    ),
)
def npu_moe_finalize_routing(
    expanded_permuted_rows: torch.Tensor,
    skip1: Optional[torch.Tensor],
    skip2: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    scales: Optional[torch.Tensor],
    expanded_src_to_dst_row: torch.Tensor,
    export_for_source_row: Optional[torch.Tensor],
    drop_pad_mode: Optional[int] = 0,
    k: Optional[int] = 1,
) -> torch.Tensor:
    """Combine expert outputs: out[i] = skip1 + skip2 + sum_k scales[i,k]*(rows[r] + bias[e]).

    ``r = expanded_src_to_dst_row[idx(i, k)]``, ``e = export_for_source_row[i, k]``, with
    ``idx = k*N + i`` for ``drop_pad_mode`` 0/1 (v1 column layout, pairs with
    ``npu_moe_init_routing``) and ``i*K + k`` for 2/3 (v2 row layout, ``npu_moe_init_routing_v2``).
    Modes 1/3 are drop-pad: ``expanded_permuted_rows`` is ``[E, C, H]`` (read flattened) and
    ``r = -1`` contributes 0. ``scales`` None means weight 1 with K = ``k``. Skips are optional
    (the sum of those given; zeros if none). Returns ``[N, H]`` in the rows' dtype, computed in fp32.

    Constraints: rows fp16/bf16/fp32 (2-D for modes 0/2, 3-D for 1/3); skip1/skip2 ``[N, H]``,
    bias ``[E, H]``, scales ``[N, K]``, all the rows' dtype; expanded_src_to_dst_row int32
    ``[N*K]`` with values in range (-1 allowed only in drop-pad modes); export_for_source_row int32
    ``[N, K]`` in ``[0, E)``, required when bias is given.
    No derivative registered: backward warns and leaves the inputs' ``.grad`` None (VariableFallbackKernel).

    Choice (spec §8.4): the wheel doc says "skip2 None requires skip1 None", the op-plugin doc
    the reverse; the golden accepts any combination, and so does this.
    """
    api = "npu_moe_finalize_routing"
    rows = require_tensor(api, "expanded_permuted_rows", expanded_permuted_rows)
    require_dtype(api, "expanded_permuted_rows", rows)
    mode = 0 if drop_pad_mode is None else drop_pad_mode
    require(api, "drop_pad_mode", mode in (0, 1, 2, 3), f"must be 0, 1, 2 or 3, got {drop_pad_mode}")
    drop_pad = mode in (1, 3)
    require_rank(api, "expanded_permuted_rows", rows, 3 if drop_pad else 2)
    h = rows.shape[-1]
    flat_rows = rows.reshape(-1, h)
    src = require_tensor(api, "expanded_src_to_dst_row", expanded_src_to_dst_row)
    require_dtype(api, "expanded_src_to_dst_row", src, (torch.int32,))
    require_rank(api, "expanded_src_to_dst_row", src, 1)
    if scales is not None:
        require_tensor(api, "scales", scales)
        require_same_dtype(api, "scales", scales, "expanded_permuted_rows", rows)
        require_rank(api, "scales", scales, 2)
        n, kk = scales.shape
        require(api, "scales", n * kk == src.numel(), f"shape {tuple(scales.shape)} must be [N, K] with N*K = {src.numel()}")
    else:
        kk = 1 if k is None else k
        require(api, "k", isinstance(kk, int) and kk > 0, f"must be a positive int when scales is None, got {k}")
        require(api, "k", src.numel() % kk == 0, f"{kk} must divide expanded_src_to_dst_row's {src.numel()} entries")
        n = src.numel() // kk
    for name, t in (("skip1", skip1), ("skip2", skip2)):
        if t is not None:
            require_tensor(api, name, t)
            require_same_dtype(api, name, t, "expanded_permuted_rows", rows)
            require(api, name, tuple(t.shape) == (n, h), f"shape {tuple(t.shape)} must be the output's {(n, h)}")
    if bias is not None:
        require_tensor(api, "bias", bias)
        require_same_dtype(api, "bias", bias, "expanded_permuted_rows", rows)
        require_rank(api, "bias", bias, 2)
        require(api, "bias", bias.shape[1] == h, f"shape {tuple(bias.shape)} must be [E, {h}]")
        require(api, "export_for_source_row", export_for_source_row is not None, "is required when bias is given")
    if export_for_source_row is not None:
        require_tensor(api, "export_for_source_row", export_for_source_row)
        require_dtype(api, "export_for_source_row", export_for_source_row, (torch.int32,))
        require(
            api,
            "export_for_source_row",
            tuple(export_for_source_row.shape) == (n, kk),
            f"shape {tuple(export_for_source_row.shape)} must be [N, K] = {(n, kk)}",
        )
        if bias is not None and export_for_source_row.numel():
            lo, hi = int(export_for_source_row.min()), int(export_for_source_row.max())
            require(api, "export_for_source_row", lo >= 0 and hi < bias.shape[0], f"values must be in [0, {bias.shape[0]}), got [{lo}, {hi}]")
    idx = src.long()
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        low = -1 if drop_pad else 0
        require(
            api,
            "expanded_src_to_dst_row",
            lo >= low and hi < flat_rows.shape[0],
            f"values must be in [{low}, {flat_rows.shape[0]}) for drop_pad_mode={mode}, got [{lo}, {hi}]",
        )
    # [N, K] view of the destination row of each (token, k) pair
    pos = idx.view(kk, n).t() if mode in (0, 1) else idx.view(n, kk)
    valid = pos >= 0
    picked = flat_rows.index_select(0, torch.where(valid, pos, torch.zeros_like(pos)).reshape(-1)).float().view(n, kk, h)
    if bias is not None:
        picked = picked + bias.float().index_select(0, export_for_source_row.reshape(-1).long()).view(n, kk, h)
    picked = picked * valid.unsqueeze(-1)
    weights = scales.float() if scales is not None else torch.ones(n, kk, device=rows.device)
    out = (picked * weights.unsqueeze(-1)).sum(dim=1)
    for t in (skip1, skip2):
        if t is not None:
            out = out + t.float()
    return no_gradient_formula(api, out.to(rows.dtype), inputs=(rows, skip1, skip2, bias, scales))
