"""Fused attention (spec §5): FlashAttention training op and the three inference ops.

All four APIs convert their inputs to one fp32 BNSD problem and run the same core
(:func:`_build_keep` for the mask/sparse/varlen rules, :func:`_attend` for logits, softmax,
sink and dropout). Conventions shared by every op (spec §13.1-4):

* masks are **True / non-zero = masked out** (the inverse of SDPA's boolean mask);
* the default scale is 1.0, never 1/sqrt(D);
* GQA maps query head ``h`` to kv head ``h // (Nq / Nkv)`` (contiguous groups, HF ``repeat_kv``);
* a row with no attended key (fully masked) yields **zeros** (flash-attn convention: the logits
  are filled with -inf and the resulting NaN row is zeroed). The real kernel's value for such
  rows is UNCERTAIN (spec §5.1: the golden averages, ``inner_precise=2`` presumably zeroes).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Sequence

import torch

from npufuse.emulate.checks import (
    NpuOpError,
    dtype_name,
    no_gradient_formula,
    require,
    require_contiguous,
    require_dtype,
    require_rank,
    require_same_dtype,
    require_tensor,
)
from npufuse.emulate.registry import emulated

FA = "npu_fusion_attention"
PFA = "npu_prompt_flash_attention"
IFA = "npu_incre_flash_attention"
FIA = "npu_fused_infer_attention_score"

INT_MAX = 2147483647
COMPRESSED = 2048  # side of the compressed causal/band mask of sparse_mode 2/3/4
_MASK_DTYPES_FA = (torch.bool, torch.uint8)
_MASK_DTYPES_INFER = (torch.bool, torch.int8, torch.uint8)
_HALF_FLOATS = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# small argument helpers


def _int(api: str, arg: str, value: object) -> int:
    # bool is an int subclass; True for an int attribute is a caller bug
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{api}: {arg} must be an int, got {type(value).__name__}")
    return value


def _float(api: str, arg: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{api}: {arg} must be a float, got {type(value).__name__}")
    return float(value)


def _str(api: str, arg: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{api}: {arg} must be a str, got {type(value).__name__}")
    return value


def _int_list(api: str, arg: str, value: object) -> list[int] | None:
    """``int[]?`` arguments: a list/tuple of Python ints (what ``cu_seqlens[1:].tolist()`` gives)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{api}: {arg} must be a list of int (e.g. tensor.tolist()), got {type(value).__name__}")
    out = []
    for x in value:
        if isinstance(x, bool):
            raise TypeError(f"{api}: {arg} must contain ints, got bool")
        try:
            out.append(operator.index(x))
        except TypeError:
            raise TypeError(f"{api}: {arg} must contain ints, got {type(x).__name__}") from None
    return out


def _reject(api: str, **args: object) -> None:
    """Raise for any argument that is set although the emulation does not implement it."""
    for name, value in args.items():
        if value is not None:
            raise NpuOpError(
                f"{api}: {name} is not supported by the npufuse emulation (quantised / paged / "
                "shared-prefix / rope / padding paths are not emulated); pass None"
            )


def _cumulative_to_lengths(api: str, arg: str, cum: list[int], total: int, total_name: str) -> list[int]:
    """Cumulative end offsets without a leading 0 -> per-sequence lengths.

    Trailing zeros disable trailing batches (``[2, 5, 9, 0, 0]``): they count as empty sequences.
    """
    require(api, arg, len(cum) >= 1, "must not be empty")
    last = len(cum)
    while last > 0 and cum[last - 1] == 0:
        last -= 1
    norm = cum[:last] + [cum[last - 1] if last else 0] * (len(cum) - last)
    prev = 0
    lengths = []
    for x in norm:
        require(
            api, arg, x >= prev,
            f"must be cumulative (non-decreasing, >= 0) end offsets without a leading 0, got {cum}",
        )
        lengths.append(x - prev)
        prev = x
    require(api, arg, prev == total, f"last non-zero value ({prev}) must equal {total_name} ({total})")
    return lengths


def _per_batch_lengths(api: str, arg: str, lens: list[int] | None, batch: int, full: int) -> list[int] | None:
    """PFA/IFA/FIA per-batch lengths: length 1 broadcasts, length >= B uses the first B."""
    if lens is None:
        return None
    require(api, arg, len(lens) == 1 or len(lens) >= batch, f"must have 1 or >= B ({batch}) entries, got {len(lens)}")
    lens = lens * batch if len(lens) == 1 else lens[:batch]
    for x in lens:
        require(api, arg, 0 <= x <= full, f"entries must lie in [0, {full}] (the tensor's S), got {x}")
    return lens


# --------------------------------------------------------------------------------------------
# layouts


def _split_heads(t: torch.Tensor, layout: str, n: int) -> torch.Tensor:
    """Query/key/value in ``layout`` -> [B, N, S, D] (a view; TND stays [T, N, D])."""
    if layout == "BSH":
        b, s, h = t.shape
        return t.view(b, s, n, h // n).transpose(1, 2)
    if layout == "SBH":
        s, b, h = t.shape
        return t.view(s, b, n, h // n).permute(1, 2, 0, 3)
    if layout == "BSND":
        return t.transpose(1, 2)
    return t  # BNSD, BNSD_BSND, TND


def _merge_heads(t: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, N, S, D] -> output ``layout`` (TND input is already [T, N, D])."""
    if layout == "BSH":
        b, n, s, d = t.shape
        return t.transpose(1, 2).reshape(b, s, n * d)
    if layout == "SBH":
        b, n, s, d = t.shape
        return t.permute(2, 0, 1, 3).reshape(s, b, n * d)
    if layout in ("BSND", "BNSD_BSND"):
        return t.transpose(1, 2).contiguous()
    return t


def _pad_varlen(t: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[T, N, D] packed sequences -> zero-padded [B, N, maxS, D] (differentiable)."""
    b, smax = len(lengths), max(lengths, default=0)
    idx_b = torch.repeat_interleave(torch.arange(b, device=t.device), torch.tensor(lengths, device=t.device))
    starts = torch.tensor([0] + lengths[:-1], device=t.device).cumsum(0)
    idx_s = torch.arange(t.shape[0], device=t.device) - starts[idx_b]
    out = t.new_zeros(b, smax, *t.shape[1:]).index_put((idx_b, idx_s), t)
    return out.transpose(1, 2)


def _valid_rows(lengths: list[int], smax: int, device: torch.device) -> torch.Tensor:
    """[B, maxS] bool: which padded rows hold a real token (row-major order = packed order)."""
    return torch.arange(smax, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


def _unpad_varlen(t: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[B, N, maxS, ...] -> packed [T, N, ...]."""
    return t.transpose(1, 2)[_valid_rows(lengths, t.shape[2], t.device)]


# --------------------------------------------------------------------------------------------
# masks


def _mask_4d(
    api: str, mask: torch.Tensor, patterns: Sequence[str], dims: dict[str, int], padded_ok: bool
) -> torch.Tensor:
    """Match ``mask`` against shape ``patterns`` and return a bool [b, n, sq, skv] view (True = masked).

    A pattern names its dims in B, N, Sq, Skv order (``"B 1 Sq Skv"``, ``"Sq Skv"``, ``"B Skv"``);
    ``1`` is a literal size. With ``padded_ok`` the Sq/Skv dims may exceed the problem's (PFA/FIA
    recommend padding Skv to 32-byte alignment) and are cropped to the top-left block.
    """
    shape = tuple(mask.shape)
    for pat in patterns:
        names = pat.split()
        if len(names) != len(shape):
            continue
        ok = True
        for name, size in zip(names, shape):
            if name == "1":
                ok &= size == 1
            elif name in ("Sq", "Skv") and padded_ok:
                ok &= size >= dims[name]
            else:
                ok &= size == dims[name]
        if ok:
            got = dict(zip(names, shape))
            m4 = mask.reshape(got.get("B", 1), got.get("N", 1), got.get("Sq", 1), got.get("Skv", 1))
            return m4[:, :, : dims["Sq"], : dims["Skv"]].bool()
    want = " or ".join("[" + ", ".join(str(dims.get(n, n)) for n in p.split()) + "]" for p in patterns)
    extra = " (Sq/Skv may be padded up)" if padded_ok else ""
    raise NpuOpError(f"{api}: atten_mask shape {list(shape)} not supported; expected {want}{extra}")


@functools.lru_cache(maxsize=8)
def _compressed_reference(device: torch.device) -> torch.Tensor:
    return torch.triu(torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool, device=device), diagonal=1)


def _check_compressed(api: str, mask: torch.Tensor, mode: int, shapes: Sequence[tuple[int, ...]]) -> None:
    """sparse_mode 2/3/4 take the compressed 2048x2048 ``triu(ones, 1).bool()`` mask.

    Its content is checked too: a ``tril`` (keep-polarity) mask is the classic mistake (§13.1).
    """
    require(
        api,
        "atten_mask",
        tuple(mask.shape) in shapes,
        f"for sparse_mode {mode} must be the compressed mask of shape "
        f"{' or '.join(str(list(s)) for s in shapes)} (torch.triu(torch.ones(2048, 2048), diagonal=1).bool()), "
        f"got {list(mask.shape)}",
    )
    ref = _compressed_reference(mask.device)
    require(
        api,
        "atten_mask",
        torch.equal(mask.reshape(COMPRESSED, COMPRESSED).bool(), ref),
        f"for sparse_mode {mode} must be torch.triu(torch.ones(2048, 2048), diagonal=1).bool() "
        "(True = masked, above the diagonal); got a different pattern (inverted polarity / tril?)",
    )


def _build_keep(
    sq: int,
    skv: int,
    device: torch.device,
    *,
    mask: torch.Tensor | None,
    mode: int,
    pre: int,
    nxt: int,
    sq_lens: list[int] | None = None,
    skv_lens: list[int] | None = None,
) -> torch.Tensor | None:
    """Bool keep-matrix broadcastable to [B, N, Sq, Skv] (True = attended), or None for "all".

    ``mask`` (True = masked, 4-D) is the user mask for modes 0/1 and None otherwise. The sparse
    mode applies only when the caller passes ``mode >= 0``; ``mode=-1`` means "no sparse rule"
    (the ``atten_mask is None`` case). ``sq_lens``/``skv_lens`` give per-batch valid lengths in
    local (per-sequence) coordinates: rows/columns past them are never attended, and the
    bottom-right origin of modes 3/4 uses them (``off_b = skv_b - sq_b``).
      mode 0: ~mask & (i - pre <= j <= i + nxt)         (top-left origin)
      mode 1: ~mask
      mode 2: j <= i                                    (top-left causal)
      mode 3: j <= i + off                              (bottom-right causal)
      mode 4: i + off - pre <= j <= i + off + nxt       (bottom-right band)
    """
    i = torch.arange(sq, device=device).view(sq, 1)
    j = torch.arange(skv, device=device).view(1, skv)
    if sq_lens is not None:
        lq = torch.tensor(sq_lens, device=device).view(-1, 1, 1, 1)
        lk = torch.tensor(skv_lens, device=device).view(-1, 1, 1, 1)
        off: torch.Tensor | int = lk - lq
    else:
        off = skv - sq
    keep: torch.Tensor | None = None

    def both(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
        return b if a is None else a & b

    if mode in (0, 1):
        keep = ~mask
        if mode == 0 and (pre < sq or nxt < skv):  # defaults (INT_MAX) restrict nothing
            keep = keep & (j >= i - pre) & (j <= i + nxt)
    elif mode == 2:
        keep = j <= i
    elif mode == 3:
        keep = j <= i + off
    elif mode == 4:
        keep = (j >= i + off - pre) & (j <= i + off + nxt)
    if sq_lens is not None:
        keep = both(keep, (i < lq) & (j < lk))
    return keep


# --------------------------------------------------------------------------------------------
# the core


class _MaskedSoftmax(torch.autograd.Function):
    """Row softmax of masked logits (-inf = masked), with an optional per-head sink column.

    ``forward(s, sink4)`` -> ``(P, row_max, row_sum)``: ``m = max(max_j S, sink)`` (the max of
    an all -inf row without sink is -inf and is shifted by 0 instead), ``P = exp(S - m) / denom``
    with ``denom = sum_j exp(S - m) [+ exp(sink - m)]``; a row with ``denom == 0`` (fully masked,
    no sink) keeps P = 0 (the "zero the NaN rows" convention, without producing NaNs).

    The backward is the standard softmax backward ``dS = P * (dP - sum_j P * dP)`` (torch's
    softmax, FlashAttention and the NPU kernels): differentiating exp / sum / divide one by one
    instead rounds far worse in fp32 where a row of grad q/k cancels (up to ~200x the error of
    torch's softmax backward on the HF eager attention examples, so ``verify op`` flagged their
    correct rewrites at fp32: tests/test_verify_mutations_registry.py). The sink column
    is a logit of the same softmax whose probability is dropped, so its gradient is
    ``-p_sink * sum_j P * dP``, summed over every row of that head.

    Only first order (``once_differentiable``): the real fused kernels have no double backward
    either, and the saved sink probability is not an output the graph could differentiate.
    """

    @staticmethod
    def forward(ctx, s: torch.Tensor, sink4: torch.Tensor | None):  # type: ignore[override]
        if s.shape[-1] == 0:
            m = s.new_full(s.shape[:-1] + (1,), float("-inf"))
        else:
            m = s.amax(dim=-1, keepdim=True)
        if sink4 is not None:
            m = torch.maximum(m, sink4)
        # softmax is shift-invariant: any finite shift is exact math; -inf rows shift by 0 (no NaN)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m_safe)
        denom = p.sum(dim=-1, keepdim=True)
        e_sink = None
        if sink4 is not None:
            e_sink = torch.exp(sink4 - m_safe)
            denom = denom + e_sink
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        p = p / safe
        p_sink = None if e_sink is None else e_sink / safe
        ctx.mark_non_differentiable(m, denom)
        ctx.save_for_backward(p, p_sink)
        return p, m, denom

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dp: torch.Tensor, _dm: torch.Tensor, _ddenom: torch.Tensor):  # type: ignore[override]
        p, p_sink = ctx.saved_tensors
        dot = (p * dp).sum(dim=-1, keepdim=True)
        ds = p * (dp - dot) if ctx.needs_input_grad[0] else None
        dsink = None
        if p_sink is not None and ctx.needs_input_grad[1]:
            # sink4 is [1, N, 1, 1], broadcast over batch and rows
            dsink = -(p_sink * dot).sum(dim=(0, 2, 3), keepdim=True)
        return ds, dsink


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    keep: torch.Tensor | None,
    pse: torch.Tensor | None = None,
    pse_before_scale: bool = True,
    sink: torch.Tensor | None = None,
    drop_keep: torch.Tensor | None = None,
    keep_prob: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 BNSD attention: returns (out [B,Nq,Sq,Dv], row_max [B,Nq,Sq], row_sum [B,Nq,Sq]).

    ``q`` [B,Nq,Sq,D], ``k`` [B,Nkv,Skv,D], ``v`` [B,Nkv,Skv,Dv], all fp32; Nq % Nkv == 0.
    Logits ``S = (QK^T + pse) * scale`` (pse_type 1) or ``QK^T * scale + pse``; masked entries
    are -inf. With a per-head ``sink`` logit the softmax has one extra (unscaled, value-less)
    column: ``m = max(max_j S, sink)``, ``P = exp(S - m) / (sum_j exp(S - m) + exp(sink - m))``;
    row_max/row_sum then include the sink (so ``row_max + log(row_sum)`` is the true log
    normaliser). Fully masked rows give row_max -inf, row_sum 0 and a zero output row.
    Dropout multiplies the normalised P by ``drop_keep / keep_prob`` after the statistics.
    The softmax step is :class:`_MaskedSoftmax` (standard softmax backward; row_max/row_sum
    are not differentiable).
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2)
    if pse is None:
        s = s * scale
    elif pse_before_scale:
        s = (s + pse) * scale
    else:
        s = s * scale + pse
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    sink4 = None if sink is None else sink.view(1, -1, 1, 1)
    p, m, denom = _MaskedSoftmax.apply(s, sink4)
    if drop_keep is not None:
        p = p * drop_keep.to(p.dtype) / keep_prob
    out = p @ v
    return out, m.squeeze(-1), denom.squeeze(-1)


# --------------------------------------------------------------------------------------------
# dropout (npu_fusion_attention only)


def _dropout_keep(
    api: str,
    shape: tuple[int, int, int, int],
    numels: int,
    valid: torch.Tensor | None,
    keep_prob: float,
    dropout_mask: torch.Tensor | None,
    seed: int,
    offset: int,
    device: torch.device,
) -> tuple[torch.Tensor, int, int]:
    """Keep-mask [B,N,Sq,Skv] for dropout, plus the (seed, offset) that regenerate it.

    The mask is defined over ``numels`` elements in canonical order (BNSS row-major; TND: per
    sequence ``[N, Sq_b, Skv_b]`` concatenated); ``valid`` places them into the padded shape.
    """
    if dropout_mask is not None:
        require_tensor(api, "dropout_mask", dropout_mask)
        require_dtype(api, "dropout_mask", dropout_mask, (torch.uint8, torch.bool))
        flat = dropout_mask.reshape(-1).to(device)
        if flat.numel() == numels:  # one element per position, non-zero = keep
            bits = flat != 0
        elif dropout_mask.dtype == torch.uint8 and flat.numel() * 8 >= numels:
            # bit-packed like the kernel's generated mask (LSB first within a byte: UNCERTAIN)
            shifts = torch.arange(8, device=device, dtype=torch.uint8)
            bits = ((flat.view(-1, 1) >> shifts) & 1).reshape(-1)[:numels] != 0
        else:
            raise NpuOpError(
                f"{api}: dropout_mask has {flat.numel()} elements; expected {numels} (one per position, "
                f"non-zero = keep) or a bit-packed uint8 tensor of >= {math.ceil(numels / 8)} bytes"
            )
    else:
        if seed == 0 and offset == 0:
            # fresh draw from torch's default generator, so torch.manual_seed makes runs repeatable
            seed = int(torch.randint(1, 2**31 - 1, (1,)).item())
        gen = torch.Generator(device=device)
        gen.manual_seed((seed * 1_000_003 + offset) % (2**63))
        bits = torch.rand(numels, generator=gen, device=device) < keep_prob
    if valid is None:
        return bits.view(shape), seed, offset
    out = torch.zeros(shape, dtype=torch.bool, device=device)
    out[valid.expand(shape)] = bits
    return out, seed, offset


# --------------------------------------------------------------------------------------------
# npu_fusion_attention


_FA_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
_FA_MODES = {"TND": (0, 1, 2, 3, 4, 6, 7, 8), "": (0, 1, 2, 3, 4, 5, 6)}
_MODE_NAMES = {
    5: "prefix", 6: "prefix compressed", 7: "varlen split rightDown", 8: "varlen split leftUp", 9: "tree mask"
}


@emulated(FA, autograd=True, spec="5.1",
    verified=(
        'BSH fp16 forward',
        'TND with GQA (8 over 2 heads): forward, backward, softmax_max/sum in softmax_layout TND',
        'external dropout_mask (keep_prob 0.9) and its reproducibility',
        'seed/offset returned as given without dropout',
        'outputs 0-3 differentiable',
        'sparse_mode 0-4 with Sq == Skv: band mask with pre/next, no mask, compressed 2048x2048 causal mask (BNSD fp16)',
    ),
    docs_only=(
        'sparse_mode 3/4 with Sq != Skv (bottom-right, from the kernel docs); user masks of other shapes',
        'pse placement scale*(QK^T+pse) (grad kernel source)',
        'BNSD/BSND/SBH layouts',
        'sink',
        'fully masked rows',
        "generated dropout bits (never the NPU's)",
    ),
    held_by=(
        'tests/test_emulate_upstream_attention.py::test_fusion_attention_bsh',
        'tests/test_emulate_upstream_attention.py::test_fusion_attention_tnd_gqa_forward_backward_and_stats',
        'tests/test_emulate_upstream_attention.py::test_fusion_attention_with_external_dropout_mask',
        'tests/test_emulate_upstream_attention.py::test_fusion_attention_without_dropout_returns_seed_and_offset',
        'tests/test_emulate_upstream_attention.py::test_fusion_attention_sparse_modes',
        'tests/test_emulate_upstream_attention.py::test_fusion_attention_keep_prob_zero_is_a_runtime_error',
    ),
)
def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """FlashAttention: softmax(mask((QK^T + pse) * scale)) -> dropout(keep_prob) -> @ V.

    Layouts BSH [B,S,N*D], SBH [S,B,N*D], BSND, BNSD, TND [T,N,D] (case-insensitive; TND needs
    ``actual_seq_qlen``/``actual_seq_kvlen`` = cumulative ends without a leading 0, and each
    sequence attends only within itself, masks in local indices). ``atten_mask`` is bool/uint8,
    True = masked, shapes [B,N,Sq,Skv], [B,1,Sq,Skv], [1,1,Sq,Skv], [Sq,Skv] (TND: [maxSq,maxSkv]);
    sparse_mode 2/3/4 need the compressed ``triu(ones(2048,2048),1).bool()`` mask (checked).
    **With atten_mask=None, sparse_mode/pre_tockens/next_tockens are ignored: full attention.**
    GQA (Nq % Nkv == 0), Dv != Dq, pse (added before scaling, pse_type 1), per-head ``sink``
    logit, dropout (keep_prob = 1 - p). Differentiable w.r.t. query/key/value/pse/sink.

    Returns ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``:
    out in query's dtype and layout with D -> Dv; softmax_max/sum float32 [B,N,Sq,8] (TND
    [T,N,8]) = per-row max of the scaled masked logits and sum_j exp(S - max), replicated 8x
    (differentiable outputs like attention_out, derivatives.yaml, but a gradient reaching them is
    dropped: the backward reads only attention_out's); softmax_out empty; seed/offset as given
    when keep_prob == 1 (the generated ones otherwise); numels = B*N*Sq*Skv (TND: N * sum_b
    Sq_b*Skv_b).

    Settled from op-plugin's sources and tests (issue 20): pse is placed inside the scale,
    ``scale * (QK^T + pse)`` (pse_type 1, the grad kernel's formula); sparse_mode 4 with
    Sq != Skv is the bottom-right band ``i + (Skv - Sq) - pre <= j <= i + (Skv - Sq) + next``.

    Choices where the spec is UNCERTAIN:
    * fully masked rows -> zero output, softmax_max -inf, softmax_sum 0;
    * sparse_mode 0 with a mask: pre/next are intersected with the mask (top-left origin
      ``i-pre <= j <= i+next``); the real kernel uses them for block skipping, so an
      inconsistent pair is "wrong results" there and a deterministic intersection here;
    * sparse_modes 5-8 (prefix / varlen split) are not emulated: NpuOpError when a mask is given;
    * with ``sink`` softmax_max/softmax_sum include the sink column;
    * TND softmax_max/sum keep the shape [T,N,8]; with softmax_layout="" the buffer holds NTD
      order (``.view(N, T, 8)`` reads rows), with "TND" it is plain [T,N,8] order;
    * ``dropout_mask`` (used only when keep_prob < 1): uint8/bool with one element per
      position (canonical BNSS order, non-zero = keep) or bit-packed uint8 (LSB first);
    * without dropout_mask, the mask comes from a torch generator seeded by (seed, offset); if
      both are 0 a seed is drawn from torch's default generator. The returned (seed, offset)
      regenerate the same mask when passed back; the numbers never match NPU Philox streams;
    * pse with TND and compressed ALiBi pse ([*, N, 1024, Skv] with Sq > 1024) are rejected.
    """
    api = FA
    for name, t in (("query", query), ("key", key), ("value", value)):
        require_tensor(api, name, t)
        require_dtype(api, name, t)
    require_same_dtype(api, "key", key, "query", query)
    require_same_dtype(api, "value", value, "query", query)
    head_num = _int(api, "head_num", head_num)
    layout = _str(api, "input_layout", input_layout).upper()
    require(
        api, "input_layout", layout in _FA_LAYOUTS,
        f"must be one of {', '.join(_FA_LAYOUTS)} (case-insensitive), got {input_layout!r}",
    )
    require(api, "head_num", 1 <= head_num <= 256, f"must lie in [1, 256], got {head_num}")
    _reject(api, padding_mask=padding_mask)
    scale = _float(api, "scale", scale)
    keep_prob = _float(api, "keep_prob", keep_prob)
    require(api, "keep_prob", 0.0 < keep_prob <= 1.0, f"must lie in (0, 1] (probability of keeping), got {keep_prob}")
    pre = _int(api, "pre_tockens", pre_tockens)
    nxt = _int(api, "next_tockens", next_tockens)
    inner_precise = _int(api, "inner_precise", inner_precise)
    require(api, "inner_precise", inner_precise in (0, 1, 2), f"must be 0, 1 or 2, got {inner_precise}")
    sparse_mode = _int(api, "sparse_mode", sparse_mode)
    seed, offset = _int(api, "seed", seed), _int(api, "offset", offset)
    for name, flag in (("gen_mask_parallel", gen_mask_parallel), ("sync", sync)):
        if not isinstance(flag, bool):
            raise TypeError(f"{api}: {name} must be a bool, got {type(flag).__name__}")
    softmax_layout = _str(api, "softmax_layout", softmax_layout)
    require(api, "softmax_layout", softmax_layout in ("", "TND"), f"must be '' or 'TND', got {softmax_layout!r}")
    require(
        api, "softmax_layout", softmax_layout == "" or layout == "TND", "'TND' is only allowed with input_layout TND",
    )
    allowed_modes = _FA_MODES["TND" if layout == "TND" else ""]
    require(
        api, "sparse_mode", sparse_mode in allowed_modes,
        f"{sparse_mode} is not supported with input_layout {layout} (allowed: {list(allowed_modes)})",
    )
    if prefix is not None:
        raise NpuOpError(f"{api}: prefix is used only by sparse_mode 5/6, which the npufuse emulation does not emulate")
    qlen = _int_list(api, "actual_seq_qlen", actual_seq_qlen)
    kvlen = _int_list(api, "actual_seq_kvlen", actual_seq_kvlen)

    # ---- shapes -> BNSD
    if layout == "TND":
        for name, t in (("query", query), ("key", key), ("value", value)):
            require_rank(api, name, t, 3)
        require(
            api, "actual_seq_qlen", qlen is not None,
            "is required for input_layout TND (cumulative ends, no leading 0)",
        )
        require(
            api, "actual_seq_kvlen", kvlen is not None,
            "is required for input_layout TND (cumulative ends, no leading 0)",
        )
        require(
            api, "actual_seq_kvlen", len(kvlen) == len(qlen),
            f"must have as many entries as actual_seq_qlen ({len(qlen)}), got {len(kvlen)}",
        )
        sq_lens = _cumulative_to_lengths(api, "actual_seq_qlen", qlen, query.shape[0], "query's T")
        skv_lens = _cumulative_to_lengths(api, "actual_seq_kvlen", kvlen, key.shape[0], "key's T")
        require(
            api, "head_num", query.shape[1] == head_num,
            f"({head_num}) must equal query's N ({query.shape[1]}) for TND",
        )
        nq, d, nkv, dv = query.shape[1], query.shape[2], key.shape[1], value.shape[2]
        require(
            api, "value", value.shape[:2] == key.shape[:2],
            f"shape {list(value.shape)} must match key {list(key.shape)} except D",
        )
    else:
        require(api, "actual_seq_qlen", qlen is None, f"is only used with input_layout TND (got layout {layout})")
        require(api, "actual_seq_kvlen", kvlen is None, f"is only used with input_layout TND (got layout {layout})")
        sq_lens = skv_lens = None
        rank = 3 if layout in ("BSH", "SBH") else 4
        for name, t in (("query", query), ("key", key), ("value", value)):
            require_rank(api, name, t, rank)
        if rank == 3:
            hq, hk, hv = query.shape[2], key.shape[2], value.shape[2]
            require(api, "head_num", hq % head_num == 0, f"({head_num}) must divide query's H ({hq}) for {layout}")
            d = hq // head_num
            require(api, "key", d > 0 and hk % d == 0, f"H ({hk}) must be a multiple of D = H_q / head_num = {d}")
            nq, nkv = head_num, hk // d
            require(api, "value", nkv > 0 and hv % nkv == 0, f"H ({hv}) must be a multiple of key's N ({nkv})")
            dv = hv // nkv
            sdim, bdim = (1, 0) if layout == "BSH" else (0, 1)
        else:
            ndim, sdim = (2, 1) if layout == "BSND" else (1, 2)
            bdim = 0
            nq, d, nkv, dv = query.shape[ndim], query.shape[3], key.shape[ndim], value.shape[3]
            require(api, "head_num", nq == head_num, f"({head_num}) must equal query's N ({nq}) for {layout}")
            require(api, "value", value.shape[ndim] == nkv, f"N ({value.shape[ndim]}) must equal key's N ({nkv})")
        require(
            api, "key", key.shape[bdim] == query.shape[bdim],
            f"batch ({key.shape[bdim]}) must equal query's ({query.shape[bdim]})",
        )
        require(
            api, "value", value.shape[bdim] == key.shape[bdim] and value.shape[sdim] == key.shape[sdim],
            f"shape {list(value.shape)} must match key {list(key.shape)} except D",
        )
    require(
        api, "key", nkv > 0 and nq % nkv == 0,
        f"heads ({nkv}) must divide query heads ({nq}) (GQA needs Nq % Nkv == 0)",
    )
    require(
        api, "key", key.shape[-1] == d or layout in ("BSH", "SBH"),
        f"head dim ({key.shape[-1]}) must equal query's ({d})",
    )
    require(api, "query", 1 <= d <= 768, f"head dim D={d} must lie in [1, 768]")
    require(api, "value", 1 <= dv <= d, f"head dim Dv={dv} must lie in [1, Dk={d}] (Dk >= Dv)")

    device = query.device
    qf, kf, vf = (_split_heads(t.float(), layout, n) for t, n in ((query, nq), (key, nkv), (value, nkv)))
    if layout == "TND":
        qf, kf, vf = _pad_varlen(qf, sq_lens), _pad_varlen(kf, skv_lens), _pad_varlen(vf, skv_lens)
    b, _, sq, _ = qf.shape
    skv = kf.shape[2]

    # ---- mask / sparse mode
    user_mask = None
    mode = -1  # atten_mask None: sparse_mode / pre / next ignored (documented), full attention
    if atten_mask is not None:
        require_tensor(api, "atten_mask", atten_mask)
        require_dtype(api, "atten_mask", atten_mask, _MASK_DTYPES_FA)
        mode = sparse_mode
        if mode in (5, 6, 7, 8):
            raise NpuOpError(f"{api}: sparse_mode {mode} ({_MODE_NAMES[mode]}) is not emulated by npufuse")
        if mode in (2, 3, 4):
            _check_compressed(api, atten_mask, mode, [(COMPRESSED, COMPRESSED)])
        elif layout == "TND":
            require(
                api, "atten_mask", tuple(atten_mask.shape) == (sq, skv),
                f"for TND must be [maxSq, maxSkv] = [{sq}, {skv}], got {list(atten_mask.shape)}",
            )
            user_mask = atten_mask.bool().view(1, 1, sq, skv)
            for bi, (lq, lk) in enumerate(zip(sq_lens, skv_lens)):
                if lq and lk and bool(user_mask[0, 0, :lq, :lk].all(dim=-1).any()):
                    raise NpuOpError(
                        f"{api}: atten_mask has a fully masked row in sequence {bi}; TND masks must not pad rows"
                    )
        else:
            dims = {"B": b, "N": nq, "Sq": sq, "Skv": skv}
            user_mask = _mask_4d(
                api, atten_mask, ("B N Sq Skv", "B 1 Sq Skv", "1 1 Sq Skv", "Sq Skv"), dims, padded_ok=False,
            )
        if mode in (0, 4):
            require(
                api, "next_tockens", pre + nxt >= 0,
                f"and pre_tockens must leave a non-empty band (pre_tockens + next_tockens >= 0), got {pre} + {nxt}",
            )

    # ---- pse / sink
    pse_f = None
    if pse is not None:
        require_tensor(api, "pse", pse)
        require_same_dtype(api, "pse", pse, "query", query)
        require(api, "pse", layout != "TND", "with input_layout TND is not emulated by npufuse")
        require_rank(api, "pse", pse, 4)
        ps = tuple(pse.shape)
        require(
            api, "pse", not (ps[2] == 1024 and sq != 1024),
            "in ALiBi-compressed form ([*, N, 1024, Skv]) is not emulated by npufuse",
        )
        require(
            api, "pse", ps in ((b, nq, sq, skv), (b, nq, 1, skv), (1, nq, sq, skv)),
            f"shape {list(ps)} not supported; expected [{b}, {nq}, {sq}, {skv}], [{b}, {nq}, 1, {skv}] "
            f"or [1, {nq}, {sq}, {skv}]",
        )
        pse_f = pse.float()
    sink_f = None
    if sink is not None:
        require_tensor(api, "sink", sink)
        require_dtype(api, "sink", sink, (torch.float32,))
        require(api, "sink", tuple(sink.shape) == (nq,), f"shape {list(sink.shape)} must be [head_num] = [{nq}]")
        sink_f = sink

    keep = _build_keep(sq, skv, device, mask=user_mask, mode=mode, pre=pre, nxt=nxt, sq_lens=sq_lens, skv_lens=skv_lens)

    # ---- dropout
    if layout == "TND":
        numels = nq * sum(a * c for a, c in zip(sq_lens, skv_lens))
        valid = _build_keep(sq, skv, device, mask=None, mode=-1, pre=pre, nxt=nxt, sq_lens=sq_lens, skv_lens=skv_lens)
    else:
        numels, valid = b * nq * sq * skv, None
    drop_keep = None
    out_seed, out_offset = seed, offset  # returned as given when dropout is off (op-plugin passes them through)
    if keep_prob < 1.0:
        drop_keep, out_seed, out_offset = _dropout_keep(
            api, (b, nq, sq, skv), numels, valid, keep_prob, dropout_mask, seed, offset, device,
        )

    out, row_max, row_sum = _attend(
        qf, kf, vf, scale=scale, keep=keep, pse=pse_f, sink=sink_f, drop_keep=drop_keep, keep_prob=keep_prob,
    )

    if layout == "TND":
        out = _unpad_varlen(out, sq_lens)  # [T, N, Dv]
        row_max, row_sum = (_unpad_varlen(t.unsqueeze(-1), sq_lens).squeeze(-1) for t in (row_max, row_sum))  # [T, N]
        if softmax_layout == "":
            t_total = row_max.shape[0]
            row_max, row_sum = (
                x.t().unsqueeze(-1).expand(nq, t_total, 8).contiguous().view(t_total, nq, 8) for x in (row_max, row_sum)
            )
        else:
            row_max, row_sum = (x.unsqueeze(-1).expand(*x.shape, 8).contiguous() for x in (row_max, row_sum))
    else:
        out = _merge_heads(out, layout)
        row_max, row_sum = (x.unsqueeze(-1).expand(*x.shape, 8).contiguous() for x in (row_max, row_sum))
    out, row_max, row_sum, softmax_out = out.to(query.dtype), row_max, row_sum, query.new_empty(0)
    if torch.is_grad_enabled() and out.requires_grad:
        out, row_max, row_sum, softmax_out = _DifferentiableStats.apply(out, row_max, row_sum, softmax_out)
    return (out, row_max, row_sum, softmax_out, out_seed, out_offset, numels)


class _DifferentiableStats(torch.autograd.Function):
    """Make softmax_max/softmax_sum/softmax_out differentiable outputs, as derivatives.yaml does.

    ``output_differentiability: [true, true, true, true, false, false, false]``, while the
    backward (``npu_fusion_attention_grad(..., grad, ...)``) reads only the gradient of
    attention_out: what reaches outputs 1-3 is dropped, as here.
    """

    @staticmethod
    def forward(ctx, out, row_max, row_sum, softmax_out):  # type: ignore[override]
        return out.clone(), row_max.clone(), row_sum.clone(), softmax_out.clone()

    @staticmethod
    def backward(ctx, grad_out, _gmax, _gsum, _gsoftmax):  # type: ignore[override]
        return grad_out, None, None, None


# --------------------------------------------------------------------------------------------
# inference ops (PFA / IFA / FIA): one shared path


def _infer_attention(
    api: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    layout: str,
    layouts: Sequence[str],
    num_heads: int,
    num_key_value_heads: int,
    scale: float,
    atten_mask: torch.Tensor | None,
    pse_shift: torch.Tensor | None,
    q_lens: list[int] | None,
    kv_lens: list[int] | None,
    q_lens_arg: str,
    kv_lens_arg: str,
    sparse_mode: int,
    pre: int,
    nxt: int,
    decode: bool | None,
    mask_patterns: Sequence[str],
    decode_mask_patterns: Sequence[str],
    compressed_shapes: Sequence[tuple[int, ...]],
    mode1_needs_mask: bool,
    contiguous: bool,
    pre_arg: str = "pre_tokens",
    next_arg: str = "next_tokens",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate and compute PFA/IFA/FIA. Returns (out in the output layout, lse).

    ``decode`` None: decide by Q_S == 1 (FIA); True: IFA (Q_S must be 1); False: PFA.
    On the decode path sparse_mode/pre/next are ignored and the mask only masks.
    lse is float32 [B,N,Sq,1] (TND [T,N,1]) = row max + log(row sum), -inf for rows with no key.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        require_tensor(api, name, t)
        if t.dtype == torch.int8 or t.dtype == torch.int32:
            raise TypeError(
                f"{api}: {name} has dtype {dtype_name(t.dtype)}: quantised inputs are not emulated by npufuse"
            )
        require_dtype(api, name, t, _HALF_FLOATS)
        if contiguous:
            require_contiguous(api, name, t)
    require_same_dtype(api, "key", key, "query", query)
    require_same_dtype(api, "value", value, "query", query)
    layout = _str(api, "input_layout", layout)
    if layout in ("TND_NTD", "NTD_TND", "NTD"):
        raise NpuOpError(f"{api}: input_layout {layout!r} is not emulated by npufuse (use TND)")
    require(api, "input_layout", layout in layouts, f"must be one of {', '.join(layouts)}, got {layout!r}")
    num_heads = _int(api, "num_heads", num_heads)
    num_key_value_heads = _int(api, "num_key_value_heads", num_key_value_heads)
    require(api, "num_heads", 1 <= num_heads <= 256, f"must lie in [1, 256], got {num_heads}")
    nkv = num_key_value_heads or num_heads
    require(
        api, "num_key_value_heads", 0 <= num_key_value_heads and num_heads % nkv == 0,
        f"({num_key_value_heads}) must divide num_heads ({num_heads}) (0 = num_heads)",
    )
    require(
        api, "num_key_value_heads", num_heads // nkv <= 64,
        f"num_heads / num_key_value_heads must be <= 64, got {num_heads // nkv}",
    )
    scale = _float(api, "scale" if api == FIA else "scale_value", scale)
    sparse_mode, pre, nxt = _int(api, "sparse_mode", sparse_mode), _int(api, pre_arg, pre), _int(api, next_arg, nxt)

    # ---- shapes -> BNSD
    tnd = layout == "TND"
    rank = 3 if layout in ("BSH", "TND") else 4
    for name, t in (("query", query), ("key", key), ("value", value)):
        require_rank(api, name, t, rank)
    if layout == "BSH":
        hq, hk, hv = query.shape[2], key.shape[2], value.shape[2]
        require(api, "num_heads", hq % num_heads == 0, f"({num_heads}) must divide query's H ({hq})")
        d = hq // num_heads
        require(
            api, "num_key_value_heads", hk == nkv * d,
            f"({nkv} after 0 -> num_heads) times D ({d}) must equal key's H ({hk})",
        )
        bdim, sdim = 0, 1
    elif tnd:
        require(api, "num_heads", query.shape[1] == num_heads, f"({num_heads}) must equal query's N ({query.shape[1]})")
        require(
            api, "num_key_value_heads", key.shape[1] == nkv,
            f"({nkv} after 0 -> num_heads) must equal key's N ({key.shape[1]})",
        )
        d = query.shape[2]
        bdim = sdim = None
    else:
        ndim, sdim = (2, 1) if layout == "BSND" else (1, 2)
        bdim = 0
        require(
            api, "num_heads", query.shape[ndim] == num_heads,
            f"({num_heads}) must equal query's N ({query.shape[ndim]}) for {layout}",
        )
        require(
            api, "num_key_value_heads", key.shape[ndim] == nkv,
            f"({nkv} after 0 -> num_heads) must equal key's N ({key.shape[ndim]}) for {layout}",
        )
        d = query.shape[3]
        require(api, "key", key.shape[3] == d, f"head dim ({key.shape[3]}) must equal query's ({d})")
    if tnd:
        require(api, "key", key.shape[2] == d, f"head dim ({key.shape[2]}) must equal query's ({d})")
        require(
            api, "value", value.shape[:2] == key.shape[:2],
            f"shape {list(value.shape)} must match key {list(key.shape)} except D",
        )
        dv = value.shape[2]
    else:
        require(api, "value", value.shape == key.shape, f"shape {list(value.shape)} must equal key's {list(key.shape)}")
        require(
            api, "key", key.shape[bdim] == query.shape[bdim],
            f"batch ({key.shape[bdim]}) must equal query's ({query.shape[bdim]})",
        )
        dv = d
    require(api, "query", 1 <= d <= 512 and dv <= 512, f"head dim must lie in [1, 512], got D={d}, Dv={dv}")

    sq_full = query.shape[0] if tnd else query.shape[sdim]
    if decode is None:
        decode = not tnd and sq_full == 1
    elif decode:
        require(api, "query", sq_full == 1, f"must have S == 1 (one decode step), got S={sq_full}")
    if api == FIA and not decode and query.dtype in _HALF_FLOATS:
        require(api, "query", d % 16 == 0, f"head dim ({d}) must be a multiple of 16 when Q_S > 1 (fp16/bf16)")
    if layout == "BNSD_BSND":
        require(api, "input_layout", not decode, "BNSD_BSND is only supported with Q_S > 1")

    device = query.device
    qf, kf, vf = (_split_heads(t.float(), layout, n) for t, n in ((query, num_heads), (key, nkv), (value, nkv)))

    # ---- lengths
    if tnd:
        require(api, q_lens_arg, q_lens is not None, "is required for input_layout TND (cumulative)")
        require(api, kv_lens_arg, kv_lens is not None, "is required for input_layout TND (cumulative)")
        require(
            api, kv_lens_arg, len(kv_lens) == len(q_lens), f"must have as many entries as {q_lens_arg} ({len(q_lens)})",
        )
        sq_lens = _cumulative_to_lengths(api, q_lens_arg, q_lens, query.shape[0], "query's T")
        skv_lens = _cumulative_to_lengths(api, kv_lens_arg, kv_lens, key.shape[0], "key's T")
        # documented TND constraints (PFA §5.3 / FIA): bf16, equal heads, D 192, Dv 128/192
        require(api, "query", query.dtype == torch.bfloat16, "must be bfloat16 for input_layout TND", TypeError)
        require(api, "query", query.shape[0] <= 65536, f"T ({query.shape[0]}) must be <= 65536 for TND")
        require(
            api, "num_heads", num_heads in (8, 16, 32, 64, 128) and nkv == num_heads,
            "must be 8/16/32/64/128 and equal to the kv heads for TND",
        )
        require(
            api, "query", d == 192 and dv in (128, 192),
            f"TND needs Dq = Dk = 192 and Dv in (128, 192), got D={d}, Dv={dv}",
        )
        require(api, "pse_shift", pse_shift is None, "is not supported with input_layout TND")
        qf, kf, vf = _pad_varlen(qf, sq_lens), _pad_varlen(kf, skv_lens), _pad_varlen(vf, skv_lens)
    else:
        b_, skv_full = qf.shape[0], kf.shape[2]
        sq_lens = None if decode else _per_batch_lengths(api, q_lens_arg, q_lens, b_, sq_full)
        skv_lens = _per_batch_lengths(api, kv_lens_arg, kv_lens, b_, skv_full)
        if sq_lens is not None or skv_lens is not None:
            sq_lens = sq_lens or [sq_full] * b_
            skv_lens = skv_lens or [skv_full] * b_
    b, nq, sq, _ = qf.shape
    skv = kf.shape[2]

    # ---- mask / sparse mode
    dims = {"B": b, "N": nq, "Sq": sq, "Skv": skv}
    user_mask = None
    mode = -1
    if decode:
        if atten_mask is not None:  # IFA branch: sparse_mode / pre / next are ignored
            require_tensor(api, "atten_mask", atten_mask)
            require_dtype(api, "atten_mask", atten_mask, _MASK_DTYPES_INFER)
            user_mask = _mask_4d(api, atten_mask, decode_mask_patterns, dims, padded_ok=True)
            mode = 1
    else:
        require(api, "sparse_mode", sparse_mode in (0, 1, 2, 3, 4), f"must be 0-4 (emulated), got {sparse_mode}")
        if tnd:
            has_mask = atten_mask is not None
            ok = (sparse_mode == 0 and not has_mask) or (sparse_mode == 3 and has_mask) or (
                api == FIA and sparse_mode == 4 and has_mask
            )
            require(
                api, "sparse_mode", ok,
                "with TND must be 0 without atten_mask or 3 (FIA: 3/4) with the compressed atten_mask",
            )
            if sparse_mode == 3:
                require(
                    api, q_lens_arg, all(a <= c for a, c in zip(sq_lens, skv_lens)),
                    "per-batch lengths must not exceed the kv lengths for sparse_mode 3 with TND",
                )
            if sparse_mode == 4:
                require(
                    api, pre_arg, all(pre >= -a and nxt >= -c for a, c in zip(sq_lens, skv_lens)),
                    "must satisfy pre_tokens >= -q_len and next_tokens >= -kv_len for TND band",
                )
        if sparse_mode in (2, 3, 4):
            require(
                api, "atten_mask", atten_mask is not None,
                f"is required for sparse_mode {sparse_mode} (the compressed 2048x2048 mask)",
            )
        if sparse_mode == 1 and mode1_needs_mask:
            require(api, "atten_mask", atten_mask is not None, "is required for sparse_mode 1 (allMask)")
        if atten_mask is not None:
            require_tensor(api, "atten_mask", atten_mask)
            require_dtype(api, "atten_mask", atten_mask, _MASK_DTYPES_INFER)
            if contiguous:
                require_contiguous(api, "atten_mask", atten_mask)
            mode = sparse_mode
            if mode in (2, 3, 4):
                _check_compressed(api, atten_mask, mode, compressed_shapes)
            else:
                user_mask = _mask_4d(api, atten_mask, mask_patterns, dims, padded_ok=True)
            if mode in (0, 4):
                require(
                    api, next_arg, pre + nxt >= 0,
                    f"and {pre_arg} must leave a non-empty band ({pre_arg} + {next_arg} >= 0), got {pre} + {nxt}",
                )

    # ---- pse_shift (added after scaling: UNCERTAIN, spec §5.3)
    pse_f = None
    if pse_shift is not None:
        require_tensor(api, "pse_shift", pse_shift)
        require_same_dtype(api, "pse_shift", pse_shift, "query", query)
        require_rank(api, "pse_shift", pse_shift, 4)
        ps = tuple(pse_shift.shape)
        require(
            api, "pse_shift", ps[0] in (1, b) and ps[1] == nq and ps[2] >= sq and ps[3] >= skv,
            f"shape {list(ps)} not supported; expected [{b} or 1, {nq}, >= {sq}, >= {skv}]",
        )
        if contiguous:
            require_contiguous(api, "pse_shift", pse_shift)
        if api == IFA:
            require(api, "pse_shift", d % 16 == 0, f"needs a head dim that is a multiple of 16, got {d}")
        pse_f = pse_shift[:, :, :sq, :skv].float()

    keep = _build_keep(sq, skv, device, mask=user_mask, mode=mode, pre=pre, nxt=nxt, sq_lens=sq_lens, skv_lens=skv_lens)
    out, row_max, row_sum = _attend(qf, kf, vf, scale=scale, keep=keep, pse=pse_f, pse_before_scale=False)
    lse = torch.where(
        row_sum > 0, row_max + torch.log(torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))),
        torch.full_like(row_sum, float("-inf")),
    )
    if tnd:
        out = _unpad_varlen(out, sq_lens)
        lse = _unpad_varlen(lse.unsqueeze(-1), sq_lens)  # [T, N, 1]
    else:
        out = _merge_heads(out, layout)
        lse = lse.unsqueeze(-1)  # [B, N, Sq, 1]
    return out.to(query.dtype), lse


_PFA_MASKS = ("Sq Skv", "B Sq Skv", "1 Sq Skv", "B 1 Sq Skv", "1 1 Sq Skv")
_IFA_MASKS = ("B Skv", "1 Skv", "B 1 Skv", "1 1 Skv", "B 1 1 Skv", "1 1 1 Skv")
_FIA_MASKS = ("1 Sq Skv", "B 1 Sq Skv", "1 1 Sq Skv", "Sq Skv")
_FIA_DECODE_MASKS = ("B Skv", "1 Sq Skv", "B 1 Sq Skv", "1 1 Sq Skv")
_COMPRESSED_INFER = ((COMPRESSED, COMPRESSED), (1, COMPRESSED, COMPRESSED), (1, 1, COMPRESSED, COMPRESSED))


@emulated(PFA, autograd=False, spec="5.3",
    verified=(
        'BNSD fp16 forward without mask (op-plugin test_prompt_flash_attention)',
    ),
    docs_only=(
        'masks, sparse modes, pre/next tokens',
        'TND',
        'actual_seq_lengths',
        'pse_shift placement',
        'no gradient formula (warns)',
    ),
    held_by=(
        'tests/test_emulate_upstream_attention.py::test_prompt_flash_attention_bnsd',
    ),
)
def npu_prompt_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    pse_shift: torch.Tensor | None = None,
    actual_seq_lengths: Sequence[int] | None = None,
    deq_scale1: torch.Tensor | None = None,
    quant_scale1: torch.Tensor | None = None,
    deq_scale2: torch.Tensor | None = None,
    quant_scale2: torch.Tensor | None = None,
    quant_offset2: torch.Tensor | None = None,
    num_heads: int = 1,
    scale_value: float = 1.0,
    pre_tokens: int = 2147483647,
    next_tokens: int = 0,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    actual_seq_lengths_kv: Sequence[int] | None = None,
    sparse_mode: int = 0,
) -> torch.Tensor:
    """Prefill attention (inference): softmax(scale_value * QK^T + pse_shift, masked) @ V.

    Layouts BSH, BSND, BNSD, BNSD_BSND (in BNSD, out BSND), TND (bf16, N in 8..128 equal heads,
    D 192, Dv 128/192, sparse 0 without mask or 3 with mask, cumulative lengths). fp16/bf16,
    contiguous inputs. ``atten_mask`` bool/int8/uint8, 1 = masked, shapes (Sq,Skv), (B,Sq,Skv),
    (1,Sq,Skv), (B,1,Sq,Skv), (1,1,Sq,Skv), Sq/Skv may be padded up. sparse_mode 0-4 (2/3/4
    require the compressed 2048x2048 mask). **Default next_tokens=0: with sparse_mode 0 and a
    mask the band ``i - pre <= j <= i + next`` makes even a padding-only mask causal** — pass
    next_tokens=2147483647 for non-causal masks; without a mask pre/next are ignored.
    ``actual_seq_lengths``/``actual_seq_lengths_kv`` are per-batch valid lengths (1 entry
    broadcasts), cumulative for TND. Returns one Tensor (query's dtype). No derivative registered: backward warns and leaves the inputs' ``.grad`` None (VariableFallbackKernel).

    UNCERTAIN choices: pse_shift is added after scaling (the doc formula); query rows past
    actual_seq_lengths are zero; quantised arguments and padding_mask raise ValueError.
    """
    api = PFA
    _reject(
        api, padding_mask=padding_mask, deq_scale1=deq_scale1, quant_scale1=quant_scale1, deq_scale2=deq_scale2,
        quant_scale2=quant_scale2, quant_offset2=quant_offset2,
    )
    out, _ = _infer_attention(
        api, query, key, value, layout=input_layout, layouts=("BSH", "BSND", "BNSD", "BNSD_BSND", "TND"),
        num_heads=num_heads, num_key_value_heads=num_key_value_heads, scale=scale_value,
        atten_mask=atten_mask, pse_shift=pse_shift,
        q_lens=_int_list(api, "actual_seq_lengths", actual_seq_lengths),
        kv_lens=_int_list(api, "actual_seq_lengths_kv", actual_seq_lengths_kv),
        q_lens_arg="actual_seq_lengths", kv_lens_arg="actual_seq_lengths_kv",
        sparse_mode=sparse_mode, pre=pre_tokens, nxt=next_tokens, decode=False,
        mask_patterns=_PFA_MASKS, decode_mask_patterns=(), compressed_shapes=_COMPRESSED_INFER,
        mode1_needs_mask=False, contiguous=True,
    )
    return no_gradient_formula(api, out, inputs=(query, key, value, pse_shift))


@emulated(IFA, autograd=False, spec="5.4",
    verified=(
        'BSH fp16 decode forward (op-plugin test_incre_flash_attention)',
    ),
    docs_only=(
        'masks',
        'actual_seq_lengths',
        'GQA',
        'pse_shift',
        'no gradient formula (warns)',
    ),
    held_by=(
        'tests/test_emulate_upstream_attention.py::test_incre_flash_attention_bsh',
    ),
)
def npu_incre_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    pse_shift: torch.Tensor | None = None,
    actual_seq_lengths: Sequence[int] | None = None,
    antiquant_scale: torch.Tensor | None = None,
    antiquant_offset: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    dequant_scale1: torch.Tensor | None = None,
    quant_scale1: torch.Tensor | None = None,
    dequant_scale2: torch.Tensor | None = None,
    quant_scale2: torch.Tensor | None = None,
    quant_offset2: torch.Tensor | None = None,
    kv_padding_size: torch.Tensor | None = None,
    num_heads: int = 1,
    scale_value: float = 1.0,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    block_size: int = 0,
    inner_precise: int = 1,
) -> torch.Tensor:
    """Decode attention (inference, query S == 1): softmax(scale_value * qK^T + pse_shift, masked) @ V.

    Layouts BSH (3-D), BNSD, BSND (4-D); fp16/bf16; key and value of identical shape.
    ``actual_seq_lengths`` = **valid KV length per batch** (B or 1 entries): later keys are
    ignored. ``atten_mask`` bool/int8/uint8, 1 = masked, shapes (B,Skv), (B,1,1,Skv) and the
    1-batch / 3-D variants, Skv may be padded up. GQA via num_key_value_heads (ratio <= 64).
    Returns one Tensor shaped like query. No derivative registered: backward warns and leaves the inputs' ``.grad`` None (VariableFallbackKernel).

    UNCERTAIN choices: pse_shift is added after scaling; a batch with 0 valid keys gives zeros.
    Not emulated (ValueError naming the argument): quant/antiquant arguments, PagedAttention
    (block_table, block_size != 0), kv_padding_size (left padding), padding_mask.
    """
    api = IFA
    _reject(
        api, padding_mask=padding_mask, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
        block_table=block_table, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
        dequant_scale2=dequant_scale2, quant_scale2=quant_scale2, quant_offset2=quant_offset2,
        kv_padding_size=kv_padding_size,
    )
    require(
        api, "block_size", _int(api, "block_size", block_size) == 0,
        "is only used with block_table (PagedAttention), which is not emulated; pass 0",
    )
    require(
        api, "inner_precise", _int(api, "inner_precise", inner_precise) in (0, 1),
        f"must be 0 or 1, got {inner_precise}",
    )
    out, _ = _infer_attention(
        api, query, key, value, layout=input_layout, layouts=("BSH", "BNSD", "BSND"),
        num_heads=num_heads, num_key_value_heads=num_key_value_heads, scale=scale_value,
        atten_mask=atten_mask, pse_shift=pse_shift,
        q_lens=None, kv_lens=_int_list(api, "actual_seq_lengths", actual_seq_lengths),
        q_lens_arg="actual_seq_lengths", kv_lens_arg="actual_seq_lengths",
        sparse_mode=0, pre=INT_MAX, nxt=INT_MAX, decode=True,
        mask_patterns=(), decode_mask_patterns=_IFA_MASKS, compressed_shapes=(),
        mode1_needs_mask=False, contiguous=False,
    )
    return no_gradient_formula(api, out, inputs=(query, key, value, pse_shift))


@emulated(FIA, autograd=False, spec="5.5",
    verified=(
        'BNSD fp16 prefill and decode with softmax_lse (golden of op-plugin test_npu_fused_infer_attention_score, whose own asserts are skipped)',
    ),
    docs_only=(
        'masks, sparse modes',
        'TND',
        'actual_seq_lengths',
        'lse when the flag is off (empty)',
        'no gradient formula (warns)',
    ),
    held_by=(
        'tests/test_emulate_upstream_attention.py::test_fused_infer_attention_score_bnsd_with_lse',
    ),
)
def npu_fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: Sequence[int] | None = None,
    actual_seq_lengths_kv: Sequence[int] | None = None,
    dequant_scale1: torch.Tensor | None = None,
    quant_scale1: torch.Tensor | None = None,
    dequant_scale2: torch.Tensor | None = None,
    quant_scale2: torch.Tensor | None = None,
    quant_offset2: torch.Tensor | None = None,
    antiquant_scale: torch.Tensor | None = None,
    antiquant_offset: torch.Tensor | None = None,
    key_antiquant_scale: torch.Tensor | None = None,
    key_antiquant_offset: torch.Tensor | None = None,
    value_antiquant_scale: torch.Tensor | None = None,
    value_antiquant_offset: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    query_padding_size: torch.Tensor | None = None,
    kv_padding_size: torch.Tensor | None = None,
    key_shared_prefix: torch.Tensor | None = None,
    value_shared_prefix: torch.Tensor | None = None,
    actual_shared_prefix_len: Sequence[int] | None = None,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    key_rope_antiquant_scale: torch.Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = 2147483647,
    next_tokens: int = 2147483647,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    antiquant_mode: int = 0,
    key_antiquant_mode: int = 0,
    value_antiquant_mode: int = 0,
    softmax_lse_flag: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused inference attention (PFA for Q_S > 1, IFA for Q_S == 1): returns (out, softmax_lse).

    ``out = softmax(scale * QK^T + pse_shift, masked) @ V`` in query's dtype; layouts BSH, BSND,
    BNSD, BNSD_BSND (Q_S > 1 only; output BSND), TND (bf16, D 192, Dv 128/192, equal heads,
    sparse 0 without mask or 3/4 with mask, cumulative lengths). fp16/bf16, contiguous inputs.
    Mask 1 = masked, bool/int8/uint8; modes 0/1: (1,Sq,Skv), (B,1,Sq,Skv), (1,1,Sq,Skv), plus
    (Sq,Skv) for Q_S > 1 and (B,Skv) for Q_S == 1 (Sq/Skv may be padded up); modes 2/3/4: the
    compressed 2048x2048 mask ((1,)(1,)2048,2048). Default next_tokens is INT_MAX (unlike PFA).
    With Q_S == 1 sparse_mode/pre_tokens/next_tokens/actual_seq_lengths are ignored.
    ``softmax_lse`` float32 [B,N,Sq,1] (TND [T,N,1]) = log(sum exp(S - max)) + max when
    softmax_lse_flag, else an empty float32 tensor (shape [0], as the meta kernel; the doc says
    [1] zeros: UNCERTAIN). No derivative registered: backward warns and leaves the inputs' ``.grad`` None (VariableFallbackKernel).

    UNCERTAIN choices: pse_shift added after scaling; rows without keys: out 0, lse -inf; FIA
    TND mode 3 accepts q_len <= kv_len per batch (doc: "<"). Not emulated (ValueError naming the
    argument): quant/antiquant arguments and modes, PagedAttention (block_table, block_size),
    query/kv padding sizes, shared prefix, MLA rope inputs, sparse_mode 9, TND_NTD/NTD_TND.
    """
    api = FIA
    _reject(
        api, dequant_scale1=dequant_scale1, quant_scale1=quant_scale1, dequant_scale2=dequant_scale2,
        quant_scale2=quant_scale2, quant_offset2=quant_offset2, antiquant_scale=antiquant_scale,
        antiquant_offset=antiquant_offset, key_antiquant_scale=key_antiquant_scale,
        key_antiquant_offset=key_antiquant_offset, value_antiquant_scale=value_antiquant_scale,
        value_antiquant_offset=value_antiquant_offset, block_table=block_table,
        query_padding_size=query_padding_size, kv_padding_size=kv_padding_size,
        key_shared_prefix=key_shared_prefix, value_shared_prefix=value_shared_prefix,
        actual_shared_prefix_len=actual_shared_prefix_len, query_rope=query_rope, key_rope=key_rope,
        key_rope_antiquant_scale=key_rope_antiquant_scale,
    )
    modes = {
        "block_size": block_size, "antiquant_mode": antiquant_mode,
        "key_antiquant_mode": key_antiquant_mode, "value_antiquant_mode": value_antiquant_mode,
    }
    for name, val in modes.items():
        require(
            api, name, _int(api, name, val) == 0,
            "is only used by PagedAttention / antiquant paths, which are not emulated; pass 0",
        )
    require(
        api, "inner_precise", _int(api, "inner_precise", inner_precise) in (0, 1, 2, 3),
        f"must be 0-3, got {inner_precise}",
    )
    if not isinstance(softmax_lse_flag, bool):
        raise TypeError(f"{api}: softmax_lse_flag must be a bool, got {type(softmax_lse_flag).__name__}")
    if _int(api, "sparse_mode", sparse_mode) == 9:
        raise NpuOpError(f"{api}: sparse_mode 9 (tree mask, MLA only) is not emulated by npufuse")
    out, lse = _infer_attention(
        api, query, key, value, layout=input_layout, layouts=("BSH", "BSND", "BNSD", "BNSD_BSND", "TND"),
        num_heads=num_heads, num_key_value_heads=num_key_value_heads, scale=scale,
        atten_mask=atten_mask, pse_shift=pse_shift,
        q_lens=_int_list(api, "actual_seq_lengths", actual_seq_lengths),
        kv_lens=_int_list(api, "actual_seq_lengths_kv", actual_seq_lengths_kv),
        q_lens_arg="actual_seq_lengths", kv_lens_arg="actual_seq_lengths_kv",
        sparse_mode=sparse_mode, pre=pre_tokens, nxt=next_tokens, decode=None,
        mask_patterns=_FIA_MASKS, decode_mask_patterns=_FIA_DECODE_MASKS, compressed_shapes=_COMPRESSED_INFER,
        mode1_needs_mask=True, contiguous=True,
    )
    if not softmax_lse_flag:
        lse = torch.empty(0, dtype=torch.float32, device=query.device)
    return no_gradient_formula(api, out, lse, inputs=(query, key, value, pse_shift))
