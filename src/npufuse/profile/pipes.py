"""Pipe utilisation of each kernel type, from kernel_details.csv's aic_*/aiv_* metric columns
(Level1/Level2, or ``aic_metrics=PipeUtilization``): the measured counterpart of the roofline verdict.

The ratios are fractions of the kernel's time a pipe was busy: ``*_mac_*`` (cube) and ``*_vec_*``
(vector) compute, ``*_mte2_*`` (global memory -> on-chip loads) and ``*_mte3_*`` (on-chip -> global
memory stores). Per kernel, compute = the busiest compute pipe and memory = the busiest memory pipe;
per type they are averaged weighted by duration. Both kernel readers take the columns in their
read (``KernelTable.pipe_compute`` / ``pipe_memory``); a cell that is not a ratio is unknown and is
left out of the average.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

_COMPUTE = re.compile(r"(?i)^(aic_mac(_fp16|_int8)?|aiv_vec(_fp32|_fp16|_int32|_misc)?)_ratio$")
_MEMORY = re.compile(r"(?i)^(aic|aiv)_mte[23]_ratio$")
# utilisation at or above this is a saturated pipe; below it on both, neither bound is reached
BUSY = 0.5


@dataclass
class PipeUse:
    compute: float | None     # duration-weighted busiest-compute-pipe ratio
    memory: float | None      # duration-weighted busiest-memory-pipe ratio
    time_us: float            # kernel time the averages cover
    columns: tuple[str, ...]  # the metric columns read


def metric_columns(header: list[str]) -> tuple[list[int], list[int]]:
    comp = [i for i, h in enumerate(header) if _COMPUTE.match(h.strip())]
    mem = [i for i, h in enumerate(header) if _MEMORY.match(h.strip())]
    return comp, mem


def from_table(table: Any) -> dict[str, PipeUse]:
    """Kernel type -> its pipe use, from the per-kernel ratios the polars reader took in the same
    read as the kernels; {} when it took none."""
    if table.pipe_compute is None and table.pipe_memory is None:
        return {}
    k = len(table.types)
    code = table.type_code
    dur = np.where(table.dur > 0, table.dur, 0.0)
    total = np.bincount(code, weights=dur, minlength=k)

    def avg(ratio: Any) -> tuple[np.ndarray, np.ndarray]:
        if ratio is None:
            return np.zeros(k), np.zeros(k)
        ok = ~np.isnan(ratio)
        w = np.where(ok, dur, 0.0)
        return np.bincount(code, weights=np.where(ok, ratio, 0.0) * w, minlength=k), \
            np.bincount(code, weights=w, minlength=k)

    cn, cd = avg(table.pipe_compute)
    mn, md = avg(table.pipe_memory)
    cols = tuple(h for h in table.columns.ignored if _COMPUTE.match(h) or _MEMORY.match(h))
    return {table.types[t]: PipeUse(float(cn[t] / cd[t]) if cd[t] else None, float(mn[t] / md[t]) if md[t] else None,
                                    float(total[t]), cols)
            for t in range(k) if total[t] > 0}


def combine(uses: list[tuple[PipeUse | None, float]]) -> PipeUse | None:
    """One sequence's pipe use: its kernels' uses weighted by their time in it."""
    parts = [(u, w) for u, w in uses if u is not None and w > 0]
    if not parts:
        return None

    def avg(get: str) -> float | None:
        num = sum(getattr(u, get) * w for u, w in parts if getattr(u, get) is not None)
        den = sum(w for u, w in parts if getattr(u, get) is not None)
        return num / den if den else None

    return PipeUse(avg("compute"), avg("memory"), sum(w for _, w in parts), parts[0][0].columns)


def check_verdict(verdict: str, use: PipeUse) -> dict[str, object]:
    """What the pipes say against the roofline's verdict, and whether they agree (None: not comparable).

    A pipe at or above ``BUSY`` is saturated. Only a clear split contradicts a verdict: compute-bound
    while the compute pipes idle and a memory pipe is saturated, or the reverse. Both saturated (a
    well-fed matmul loads while it multiplies) contradicts neither; a launch-bound verdict is about
    the gaps between kernels, which pipe ratios inside them do not measure."""
    c, m = use.compute, use.memory
    c_busy = c is not None and c >= BUSY
    m_busy = m is not None and m >= BUSY
    if c_busy and m_busy:
        measured = "both pipes busy"
    elif c_busy and m is not None:
        measured = "compute-bound"
    elif m_busy and c is not None:
        measured = "memory-bound"
    elif c is not None and m is not None:
        measured = "neither pipe busy"
    elif c_busy:
        measured = "compute-bound"   # no memory metric in this file: the compute pipe alone
    else:
        measured = "unknown"
    agrees: bool | None = None
    if verdict in ("compute-bound", "memory-bound"):
        if measured in ("compute-bound", "memory-bound"):
            agrees = verdict == measured
        elif measured == "both pipes busy":
            agrees = True
    pct = lambda v: "n/a" if v is None else f"{v:.0%}"  # noqa: E731
    out: dict[str, object] = {"compute_ratio": None if c is None else round(c, 3),
                              "memory_ratio": None if m is None else round(m, 3),
                              "measured": measured, "agrees": agrees}
    if agrees is False:
        out["note"] = (f"pipe utilisation disagrees with the roofline: it says {verdict}, the kernels' pipes say "
                       f"{measured} (compute {pct(c)}, memory {pct(m)} busy)")
    elif measured == "neither pipe busy" and verdict in ("compute-bound", "memory-bound"):
        out["note"] = (f"no pipe is saturated (compute {pct(c)}, memory {pct(m)} busy): the kernels run below "
                       f"the roofline; latency or scalar work bounds them")
    return out
