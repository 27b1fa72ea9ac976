"""Communication kernels (HCCL collectives) are not compute: they are split off the kernel table
before mining and gap accounting, and reported as communication, exposed or overlapped.

A kernel is communication when its type or name is an HCCL collective (``hcom_allReduce_``,
``hcom_broadcast__445_0``, ``HcclAllReduce``...) — Level0 writes ``N/A`` types but keeps the
``hcom_`` names, and puts everything on one "stream" (no Stream ID column), where a collective
would otherwise be mined as a fusion sequence and its wait counted as host-bound time.

Intervals are merged per rank; *exposed* communication is the part of the communication union
that no compute kernel overlaps (what the step waits for), *overlapped* the rest.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from npufuse.profile.readers import KernelTable

# a collective's type: hcom_*/Hccl*/Lccl* kernels, or exactly one of HCCL's op types (BroadcastTo,
# a compute op, is not one of them)
_COMM = re.compile(r"^(hcom|hccl|lccl)|^(allreduce|allgather|allgatherv|reducescatter|reducescatterv|alltoall|"
                   r"alltoallv|alltoallvc|broadcast|batchsendrecv|send|receive|recv|reduce)_?$", re.I)


def is_communication(type_name: str, kernel_name: str = "") -> bool:
    return bool(_COMM.search(type_name.strip()) or kernel_name.strip().lower().startswith(("hcom_", "hccl")))


def split_communication(table: KernelTable) -> tuple[KernelTable, dict[str, np.ndarray] | None]:
    """(compute-only table, communication kernels as arrays) — the table itself is not changed."""
    by_type = np.array([is_communication(t) for t in table.types] or [False], dtype=bool)
    mask = by_type[table.type_code] if table.types else np.zeros(table.n, dtype=bool)
    if table.name_code is not None and table.names:
        by_name = np.array([is_communication("", n) for n in table.names], dtype=bool)
        mask = mask | by_name[table.name_code]
    if not mask.any():
        return table, None
    comm = {"start": table.start[mask], "dur": table.dur[mask], "type_code": table.type_code[mask]}
    keep = ~mask
    compute = dataclasses.replace(table)
    for attr in ("type_code", "start", "dur", "wait", "stream", "step", "shape_code", "name_code"):
        arr = getattr(table, attr)
        if arr is not None:
            setattr(compute, attr, arr[keep])
    compute.notes = list(table.notes) + [f"{int(mask.sum())} communication kernels (HCCL) set apart: reported as "
                                         f"communication, never mined as fusion sequences"]
    return compute, comm


def merge_intervals(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, disjoint [s, e) covering the union of the given intervals."""
    if start.size == 0:
        return start.astype(float), end.astype(float)
    order = np.argsort(start, kind="stable")
    s, e = start[order].astype(float), end[order].astype(float)
    run_end = np.maximum.accumulate(e)
    new = np.concatenate([[True], s[1:] > run_end[:-1]])
    idx = np.flatnonzero(new)
    ends = np.append(run_end[idx[1:] - 1], run_end[-1]) if idx.size > 1 else np.array([run_end[-1]])
    return s[idx], ends


def covered(ms: np.ndarray, me: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Length of [a, b) covered by the merged intervals (ms, me), elementwise."""
    if ms.size == 0:
        return np.zeros_like(np.asarray(a, dtype=float))
    lengths = np.concatenate([[0.0], np.cumsum(me - ms)])

    def upto(x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(ms, x, side="right") - 1
        kk = np.clip(k, 0, ms.size - 1)
        inside = np.clip(x - ms[kk], 0, me[kk] - ms[kk])
        return np.where(k >= 0, lengths[kk] + inside, 0.0)

    return np.clip(upto(np.asarray(b, dtype=float)) - upto(np.asarray(a, dtype=float)), 0, None)


def communication_report(comm: dict[str, np.ndarray] | None, compute: KernelTable | None, types: list[str],
                         step_us: float, step_trace: Any = None) -> dict[str, Any] | None:
    """Per rank: communication time (union), the part no compute kernel overlaps (exposed) and the
    rest (overlapped), by collective type; with step_trace_time.csv's own figures when present."""
    out: dict[str, Any] = {}
    if comm is not None and comm["start"].size:
        cs, ce = merge_intervals(comm["start"], comm["start"] + comm["dur"])
        total = float((ce - cs).sum())
        if compute is not None and compute.n:
            ks, ke = merge_intervals(compute.start, compute.start + compute.dur)
            overlapped = float(covered(ks, ke, cs, ce).sum())
        else:
            overlapped = 0.0
        by_type: dict[str, float] = {}
        for code, d in zip(comm["type_code"].tolist(), comm["dur"].tolist()):
            by_type[types[code]] = by_type.get(types[code], 0.0) + float(d)
        out.update({"kernels": int(comm["start"].size), "time_us": round(total, 3),
                    "exposed_us": round(total - overlapped, 3), "overlapped_us": round(overlapped, 3),
                    "by_type": {k: round(v, 3) for k, v in sorted(by_type.items(), key=lambda kv: -kv[1])},
                    "intervals": (cs, ce)})
        if step_us > 0:
            out["exposed_share"] = round(min(1.0, (total - overlapped) / step_us), 6)
    if step_trace is not None and getattr(step_trace, "raw", None):
        out["step_trace_time"] = step_trace.raw
    return out or None
