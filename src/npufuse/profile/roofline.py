"""Value assessment of an op sequence: bytes, FLOPs, arithmetic intensity, bound, speed-up limit.

Estimates only. Bytes come from the kernels' shapes and dtypes as kernel_details.csv prints them;
FLOPs are counted for matmuls exactly (2*M*N*K) and for element-wise kernels as a few per element.
The fused kernel is assumed to read the sequence's external inputs and write its last outputs once
(an input whose shape and dtype equal an earlier output of the sequence is taken as internal).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

from npufuse.profile.readers import MIN_TIME_US

# No tensor has more elements than an int64 can count; a shape beyond it (a corrupt cell of 400
# digits) is unknown, not a number of bytes too large for a float.
MAX_NUMEL = 2**63


@dataclass(frozen=True)
class Assumptions:
    """Peak numbers of the SoC. Defaults: Atlas A2 training series (Ascend 910B class)."""

    soc: str = "Atlas A2 (Ascend 910B class), nominal"
    peak_bw_gbs: float = 1600.0      # HBM bandwidth, GB/s
    peak_tflops: float = 313.0       # FP16/BF16 cube peak, TFLOP/s
    launch_us: float = 2.0           # the shortest a fused kernel can take (launch + tail)
    host_gap_us: float = 10.0        # without a trace, idle gaps above this count as host-bound

    @property
    def ridge(self) -> float:
        """FLOP/byte where the roofline turns from memory- to compute-bound."""
        return self.peak_tflops * 1e12 / (self.peak_bw_gbs * 1e9)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ridge_flop_per_byte"] = round(self.ridge, 1)
        return d


_DTYPE_BYTES = {"BF16": 2, "BFLOAT16": 2, "FLOAT16": 2, "FP16": 2, "HALF": 2, "FLOAT": 4, "FLOAT32": 4,
                "FP32": 4, "DOUBLE": 8, "FLOAT64": 8, "INT64": 8, "UINT64": 8, "INT32": 4, "UINT32": 4,
                "INT16": 2, "UINT16": 2, "INT8": 1, "UINT8": 1, "BOOL": 1, "HIFLOAT8": 1, "FLOAT8_E4M3FN": 1,
                "FLOAT8_E5M2": 1, "INT4": 0.5, "COMPLEX64": 8}
_MATMUL = re.compile(r"(?i)(matmul|batchmatmul|grouped_?matmul|gemm|conv)")
_HEAVY = re.compile(r"(?i)(softmax|gelu|swish|silu|layernorm|groupnorm|rmsnorm|exp|log|tanh|sigmoid)")


def dtype_bytes(name: str) -> float | None:
    n = name.strip().upper()
    if n.startswith("DT_"):
        n = n[3:]
    return _DTYPE_BYTES.get(n)


@lru_cache(maxsize=65536)
def parse_shapes(text: str) -> tuple[tuple[int, ...] | None, ...]:
    """'"4,2048,4096;4,2048,1"' -> ((4, 2048, 4096), (4, 2048, 1)); '' inside -> () (a scalar)."""
    t = text.strip().strip('"').strip()
    if not t:
        return ()
    out: list[tuple[int, ...] | None] = []
    for part in t.split(";"):
        part = part.strip().strip('"').strip()
        if not part:
            out.append(())
            continue
        try:
            dims = tuple(int(d) for d in part.split(",") if d.strip())
        except ValueError:
            out.append(None)   # symbolic or unknown dims
            continue
        # a negative dim (-1: dynamic) or an impossible element count is unknown too
        out.append(dims if all(d >= 0 for d in dims) and _numel(dims) <= MAX_NUMEL else None)
    return tuple(out)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


@dataclass
class KernelCost:
    inputs: list[tuple[tuple[int, ...], str, float]]    # (shape, dtype, bytes)
    outputs: list[tuple[tuple[int, ...], str, float]]
    flops: float
    known: bool

    @property
    def bytes(self) -> float:
        return sum(b for _, _, b in self.inputs) + sum(b for _, _, b in self.outputs)


@lru_cache(maxsize=65536)
def kernel_cost(ktype: str, key: tuple[str, str, str, str]) -> KernelCost:
    in_s, in_d, out_s, out_d = key
    ins = _tensors(in_s, in_d)
    outs = _tensors(out_s, out_d)
    if ins and not outs and not out_s.strip().strip('"') and not out_d.strip():
        # an in-place update (ForeachAddList, ApplyAdamW, InplaceCopy) lists no outputs but writes its
        # first input back: its bytes count, the kernel is not "shapes unknown"
        outs = [ins[0]]
    known = ins is not None and outs is not None and bool(outs)
    ins, outs = ins or [], outs or []
    flops = 0.0
    if known:
        out_el = sum(_numel(s) for s, _, _ in outs)
        special = _shaped_flops(ktype, [t[0] for t in ins], [t[0] for t in outs])
        if special is not None:
            flops = special
        elif _MATMUL.search(ktype) and ins and ins[0][0]:
            flops = 2.0 * out_el * _contracted([t[0] for t in ins], outs[0][0])
        elif _HEAVY.search(ktype):
            flops = 5.0 * max(out_el, sum(_numel(s) for s, _, _ in ins))
        else:
            flops = float(max(out_el, sum(_numel(s) for s, _, _ in ins)))
    return KernelCost(ins, outs, flops, known)


_CONV = re.compile(r"(?i)^conv\d?d?(transpose)?(backprop(input|filter))?(v\d+)?(d)?$")
_FLASH = re.compile(r"(?i)flashattention(score)?(grad)?|fusedinferattentionscore|promptflashattention|"
                    r"increflashattention")


def _contracted(ins: list[tuple[int, ...]], out: tuple[int, ...]) -> int:
    """K of a matmul: the dim of each operand that is not in the output. kernel_details writes the
    operands as stored, so a transposed A ("81920,4096" for a 4096-row output) has K first. Where
    A's and B's K disagree (a misprinted cell) the smaller is taken: FLOPs are never inflated."""
    a = ins[0]
    if len(a) < 2 or len(out) < 2:
        return a[-1] if a else 1
    m, n = out[-2], out[-1]
    ks = []
    if a[-2] == m or a[-1] == m:
        ks.append(a[-1] if a[-2] == m else a[-2])
    b = ins[1] if len(ins) > 1 else ()
    if len(b) >= 2 and (b[-1] == n or b[-2] == n):
        ks.append(b[-2] if b[-1] == n else b[-1])
    return min(ks) if ks else a[-1]


def _channels(t: tuple[int, ...]) -> int:
    """Channels of an activation: NC1HWC0 (5-D, Ascend's 5HD layout) -> C1*C0, NCHW -> C."""
    if len(t) == 5:
        return t[1] * t[4]
    return t[1] if len(t) >= 2 else 1


def _shaped_flops(ktype: str, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]]) -> float | None:
    """FLOPs of kernels whose work is not one output element per input row: convolutions and fused
    attention, from their shapes. None when the kernel is neither or its shapes do not fit."""
    t = ktype.strip()
    if _CONV.match(t):
        # 2 * output elements * (Cin*kh*kw): the weight holds Cout*Cin*kh*kw (padded alike in
        # FRACTAL_Z), so per output channel it is weight elements / Cout. Forward: y = out[0],
        # w = in[1]; backprop-input: dy = in[-1], w = in[1]; backprop-filter: dy = in[-1], dw = out[0].
        tl = t.lower()
        if "backpropfilter" in tl:
            y, w = (ins[-1] if ins else None), (outs[0] if outs else None)
        elif "backpropinput" in tl:
            y, w = (ins[-1] if ins else None), (ins[1] if len(ins) > 1 else None)
        else:
            y, w = (outs[0] if outs else None), (ins[1] if len(ins) > 1 else None)
        if not y or not w or len(y) < 4:
            return None
        cout = _channels(y)
        return 2.0 * _numel(y) * _numel(w) / cout if cout else None
    m = _FLASH.search(t)
    if m:
        # q, k, v first. Two matmuls (Q K^T, P V) of 2*B*N*Sq*Skv*D each: 4 * numel(q) * Skv; the
        # backward does 5 such products: 2.5x. Sq from the softmax statistics (B, N, Sq, 8) or the
        # mask (Sq, Skv); without either, self-attention over the longest dim of q. No causal mask
        # is assumed (a causal kernel does about half).
        if len(ins) < 3 or not ins[0] or not ins[1]:
            return None
        q, k = ins[0], ins[1]
        stats = [x for x in ins[3:] + outs if len(x) == 4 and x[-1] == 8]
        masks = [x for x in ins[3:] if len(x) == 2]
        if masks:
            sq, skv = masks[0]
        elif stats:
            sq = stats[0][2]
            skv = sq * _numel(k) // max(1, _numel(q))
        else:
            sq = skv = max(q)
        if sq <= 0 or skv <= 0:
            return None
        fwd = 4.0 * _numel(q) * skv
        return fwd * (2.5 if m.group(2) or "grad" in t.lower() else 1.0)
    return None


def _tensors(shapes: str, dtypes: str) -> list[tuple[tuple[int, ...], str, float]] | None:
    if not shapes.strip().strip('"') and not dtypes.strip():
        return None
    sh = parse_shapes(shapes)
    dts = [d.strip() for d in dtypes.strip().strip('"').split(";")] if dtypes.strip() else []
    out = []
    for i, s in enumerate(sh):
        if s is None:
            return None
        dt = dts[i] if i < len(dts) else (dts[-1] if dts else "")
        b = dtype_bytes(dt)
        if b is None:
            return None
        out.append((s, dt, _numel(s) * b))
    return out


def assess(types: list[str], keys: list[tuple[str, str, str, str]], span_us: float, kernel_us: float,
           a: Assumptions, longest_us: float = 0.0, pipes: Any = None) -> dict[str, Any]:
    """Roofline row for one occurrence of a sequence (``span_us`` first start to last end).

    The fused kernel is bounded below by (1) the roofline of its bytes and FLOPs, (2) the longest
    kernel it replaces (``longest_us``: fusion removes launches and intermediate traffic, it does
    not make the heaviest kernel's own work faster), and (3) one dispatch (``a.launch_us``). The
    gaps between the kernels shrink by at most one dispatch per kernel removed; a longer gap is the
    host doing something else, or a wait on another stream, which fusion does not remove.
    ``pipes`` (pipes.PipeUse), where the file has pipe metrics, is checked against the verdict."""
    n = len(types)
    costs = [kernel_cost(t, k) for t, k in zip(types, keys)]
    known = bool(costs) and all(c.known for c in costs)
    bw = a.peak_bw_gbs * 1e3          # bytes per us
    fl = a.peak_tflops * 1e6          # FLOP per us
    gaps = max(0.0, span_us - kernel_us)
    row: dict[str, Any] = {"kernels": n, "span_us": round(span_us, 3), "kernel_us": round(kernel_us, 3),
                           "gap_us": round(gaps, 3)}
    notes: list[str] = []
    if known:
        unfused = sum(c.bytes for c in costs)
        flops = sum(c.flops for c in costs)
        produced: dict[tuple[tuple[int, ...], str], int] = {}
        external = 0.0
        for c in costs:
            for s, d, b in c.inputs:
                if produced.get((s, d)):
                    continue
                external += b
            for s, d, _ in c.outputs:
                produced[(s, d)] = produced.get((s, d), 0) + 1
        fused = external + sum(b for _, _, b in costs[-1].outputs)
        ai = flops / unfused if unfused else 0.0
        t_roof_unfused = sum(max(c.bytes / bw, c.flops / fl) for c in costs)
        bw_eff, fl_eff = bw, fl
        if kernel_us >= MIN_TIME_US and t_roof_unfused > kernel_us * 1.05:
            # the kernels moved more bytes per us than the assumed peak allows: the peak (or the
            # shapes) are off; bound the fused kernel with what was observed instead
            bw_eff = max(bw, unfused / kernel_us)
            fl_eff = max(fl, flops / kernel_us)
            notes.append(f"measured kernels beat the roofline ({unfused / kernel_us / 1e3:,.0f} GB/s observed): "
                         f"check --peak-bw/--peak-tflops or the shapes; the bound uses the observed rate")
        # nothing runs faster than the profiler can time: the bound never divides by less than that
        t_kernel = max(fused / bw_eff, flops / fl_eff, longest_us, MIN_TIME_US)
        t_fused = _after_fusion(t_kernel, gaps, n, a)
        row.update(bytes=int(unfused), bytes_fused=int(fused), flops=int(flops),
                   intensity=round(ai, 2), roofline_us=round(t_roof_unfused, 3),
                   fused_min_us=round(t_fused, 3))
    else:
        ai = None
        # no shapes: the only safe bound counts the gaps and launches between kernels
        t_fused = _after_fusion(max(kernel_us, MIN_TIME_US), gaps, n, a)
        row.update(bytes=None, bytes_fused=None, flops=None, intensity=None, roofline_us=None,
                   fused_min_us=round(t_fused, 3))
        notes.append("no shapes/dtypes: bytes unknown; the bound counts only gaps between kernels")
    mean_k = kernel_us / n if n else 0.0
    if ai is not None and ai >= a.ridge:
        # at high intensity the math decides, however short the kernels are
        verdict = "compute-bound"
    elif n > 1 and (gaps >= kernel_us or mean_k < 2 * a.launch_us):
        verdict = "launch-bound"
    elif ai is None:
        verdict = "unknown"
    elif ai < a.ridge:
        verdict = "memory-bound"
    else:
        verdict = "compute-bound"
    speedup = span_us / t_fused
    if speedup < 1.0:
        notes.append("fused lower bound is not below the measured time: no gain predicted")
        speedup = 1.0
    kept = gaps - min(gaps, max(0, n - 1) * a.launch_us)
    if kept > 0.5 * span_us and n > 1:
        notes.append(f"{kept:,.0f} us of the gaps are longer than a dispatch per kernel ({a.launch_us:g} us): "
                     f"the host was busy elsewhere or the stream waited, fusion does not remove that")
    row.update(longest_kernel_us=round(longest_us, 3), verdict=verdict, speedup_max=round(speedup, 2), notes=notes)
    if pipes is not None:
        from npufuse.profile.pipes import check_verdict

        check = check_verdict(verdict, pipes)
        row["pipes"] = check
        if "note" in check:
            notes.append(str(check["note"]))
    return row


def _after_fusion(t_kernel: float, gaps: float, n: int, a: Assumptions) -> float:
    """The shortest time the sequence can take fused: the fused kernel, plus what stays of the gaps
    (each kernel removed saves at most one dispatch, ``a.launch_us``), never under one dispatch."""
    saved = min(gaps, max(0, n - 1) * a.launch_us)
    return max(t_kernel + gaps - saved, a.launch_us, MIN_TIME_US)
