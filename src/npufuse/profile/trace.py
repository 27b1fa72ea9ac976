"""What trace_view.json adds to the kernel table: which host op launched each kernel, that op's
call stack / enclosing nn.Module, its step, and when the host launched it.

Module identity ("scope") is a chain of interned *invocation* ids, outermost first. From an
``nn.Module`` python_function event it is exact (one id per module call). From a call-stack string
``file(line): func;...`` it is approximated: frame *d* identifies the invocation of ``func`` in
``file`` called from exactly the frames before it. The line of the innermost frame is left out on
purpose, because consecutive ops of one function differ only in that line.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from npufuse.profile.readers import MAX_NUMBER

_FRAME = re.compile(r"^(?P<file>.*)\((?P<line>\d+)\):\s*(?P<func>.*)$")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_OPTIMIZER = re.compile(r"^Optimizer\.step#(?P<cls>[\w.]+)\.step$")
_AUTOGRAD = re.compile(r"^autograd::engine::evaluate_function:\s*(?P<fn>\S+)")
_MODULE = re.compile(r"^nn\.Module:\s*(?P<mod>\S+)")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.func}"


@dataclass
class HostOp:
    name: str
    tid: Any
    ts: float
    end: float
    frames: tuple[Frame, ...] | None = None    # outermost first
    chain: tuple[int, ...] | None = None       # invocation ids, outermost first
    chain_kind: str | None = None              # "stack" | "module" | "autograd"
    module: str | None = None                  # innermost nn.Module / autograd node label
    step: int | None = None
    launch: float | None = None                # host time of the kernel launch (CANN api)


@dataclass
class TraceInfo:
    source: str
    ops: list[HostOp] = field(default_factory=list)
    # (stream, start-ts) of a device kernel -> index into ops
    kernel_op: dict[tuple[int, float], int] = field(default_factory=dict)
    # device kernels seen in the trace (used when kernel_details.csv is absent)
    device: list[tuple[str, int, float, float]] = field(default_factory=list)  # name, stream, ts, dur
    steps: list[tuple[int, float, float]] = field(default_factory=list)        # host spans
    optimizer_spans: list[tuple[str, Any, float, float]] = field(default_factory=list)
    host_streams: dict[Any, list[int]] = field(default_factory=dict)  # tid -> top-level op indices
    has_stacks: bool = False
    has_modules: bool = False
    invocation_labels: list[str] = field(default_factory=list)

    def scope_label(self, inv: int) -> str:
        return self.invocation_labels[inv]


def _f(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError, OverflowError):
        return float("nan")


def _key(v: Any) -> Any:
    """A JSON pid/tid/id as a dict key: scalars as they are, anything else (a list, an object) as a
    tuple that no scalar equals, so a malformed id neither crashes nor matches a real one."""
    if v is None or isinstance(v, (str, int, float)):
        return v
    return ("non-scalar", repr(v))


def _args(e: dict[str, Any]) -> dict[str, Any]:
    a = e.get("args")
    return a if isinstance(a, dict) else {}


def parse_stack(stack: str) -> tuple[Frame, ...]:
    """torch_npu writes frames innermost-last, separated by ';' (and '\\r\\n' in trace_view)."""
    frames = []
    for part in stack.split(";"):
        part = part.strip()
        if not part:
            continue
        m = _FRAME.match(part)
        if m:
            frames.append(Frame(m.group("file"), int(m.group("line")), m.group("func").strip()))
        else:
            frames.append(Frame(part, 0, ""))
    # real torch_npu traces write the innermost frame first (the script's "<module>" frame, or the
    # spawn bootstrap's "<string>(1): <module>", comes last): "<module>" is always the outermost frame
    if len(frames) > 1 and frames[-1].func == "<module>" and frames[0].func != "<module>":
        frames.reverse()
    return tuple(frames)


_LIBRARY_PARTS = ("site-packages/", "dist-packages/", "/lib/python", "\\lib\\python", "\\site-packages\\")


def is_library_frame(fr: Frame) -> bool:
    """A frame that is not the user's code: an installed package, the standard library, or a
    frame without a file ("<string>" of a multiprocessing spawn bootstrap, "<frozen ...>")."""
    f = fr.file
    return f.startswith("<") or not f or any(p in f for p in _LIBRARY_PARTS)


def location_frame(frames: tuple[Frame, ...]) -> Frame:
    """The frame a finding is located at: the innermost frame of the user's code (frames are
    outermost first), else the innermost frame."""
    for fr in reversed(frames):
        if not is_library_frame(fr):
            return fr
    return frames[-1]


class _Interner:
    def __init__(self) -> None:
        self.ids: dict[Any, int] = {}
        self.labels: list[str] = []

    def get(self, key: Any, label: str) -> int:
        i = self.ids.get(key)
        if i is None:
            i = self.ids[key] = len(self.labels)
            self.labels.append(label)
        return i


def _stack_chain(frames: tuple[Frame, ...], interner: _Interner) -> tuple[int, ...]:
    chain = []
    exact: tuple[str, ...] = ()
    for fr in frames:
        key = ("py", exact, fr.file, fr.func)
        chain.append(interner.get(key, f"{fr.file}:{fr.func}"))
        exact = exact + (f"{fr.file}({fr.line}):{fr.func}",)
    return tuple(chain)


def analyze_trace(events: list[dict[str, Any]], source: str) -> TraceInfo:
    """Build host ops, their scopes and the kernel -> op links from chrome-trace events."""
    info = TraceInfo(source)
    pname: dict[Any, str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[_key(e.get("pid"))] = str(_args(e).get("name", ""))
    hw_pids = {p for p, n in pname.items() if "ascend hardware" in n.lower() or n.lower() == "npu"}
    cann_pids = {p for p, n in pname.items() if n.upper() == "CANN"}

    ops: list[HostOp] = []
    spans: dict[Any, list[tuple[float, float, str, str]]] = {}   # tid -> (ts, end, kind, label)
    flows_s: dict[Any, tuple[Any, Any, float]] = {}
    flows_f: dict[Any, tuple[Any, float]] = {}
    acl_by_conn: dict[Any, float] = {}
    hw_conn: dict[tuple[int, float], Any] = {}
    op_at: dict[tuple[Any, Any, float], int] = {}
    interner = _Interner()
    stack_cache: dict[str, tuple[tuple[Frame, ...], tuple[int, ...]]] = {}

    for e in events:
        ph = e.get("ph")
        pid = _key(e.get("pid"))
        if ph == "X":
            name = str(e.get("name", ""))
            ts = _f(e.get("ts"))
            dur = _f(e.get("dur", 0))
            if pid in hw_pids:
                stream = _int(e.get("tid"))
                if not (abs(ts) <= MAX_NUMBER and abs(dur) <= MAX_NUMBER):   # (False for nan)
                    continue   # a device kernel without a usable time is no kernel to count
                info.device.append((name, stream, ts, dur))
                conn = _key(_args(e).get("connection_id"))
                if conn is not None:
                    hw_conn[(stream, ts)] = conn
                continue
            if pid in cann_pids:
                conn = _key(_args(e).get("connection_id"))
                if conn is not None and name.startswith("AscendCL@"):
                    acl_by_conn[conn] = ts
                continue
            tid = _key(e.get("tid"))
            end = ts + (dur if dur == dur else 0.0)
            m = _STEP.match(name)
            if m:
                info.steps.append((int(m.group(1)), ts, end))
                continue
            m = _OPTIMIZER.match(name)
            if m:
                info.optimizer_spans.append((m.group("cls"), tid, ts, end))
                spans.setdefault(tid, []).append((ts, end, "opt", m.group("cls")))
                continue
            m = _AUTOGRAD.match(name)
            if m:
                spans.setdefault(tid, []).append((ts, end, "bwd", m.group("fn")))
                continue
            m = _MODULE.match(name)
            if m:
                info.has_modules = True
                spans.setdefault(tid, []).append((ts, end, "mod", m.group("mod")))
                continue
            if e.get("cat") == "cpu_op" or name.startswith("aten::"):
                args = _args(e)
                op = HostOp(name, tid, ts, end)
                stack = args.get("Call stack") or args.get("Call Stack")
                if isinstance(stack, str) and stack.strip():
                    cached = stack_cache.get(stack)
                    if cached is None:
                        frames = parse_stack(stack)
                        cached = stack_cache[stack] = (frames, _stack_chain(frames, interner))
                    op.frames, op.chain = cached
                    op.chain_kind = "stack"
                    info.has_stacks = True
                op_at[(pid, tid, ts)] = len(ops)
                ops.append(op)
        elif ph in ("s", "f") and (e.get("cat") == "async_npu" or e.get("name") == "torch_to_npu"):
            if ph == "s":
                flows_s[_key(e.get("id"))] = (pid, _key(e.get("tid")), _f(e.get("ts")))
            else:
                flows_f[_key(e.get("id"))] = (_int(e.get("tid")), _f(e.get("ts")))

    _attach_spans(ops, spans, interner, info)
    info.ops = ops
    info.invocation_labels = interner.labels

    # steps of host ops, from the ProfilerStep# spans
    if info.steps:
        st = sorted(info.steps, key=lambda s: s[1])
        starts = [s[1] for s in st]
        for op in ops:
            k = bisect.bisect_right(starts, op.ts) - 1
            if k >= 0 and op.ts <= st[k][2]:
                op.step = st[k][0]

    # kernel -> launching op: flow events first (torch_npu's own link) ...
    by_tid: dict[Any, tuple[list[float], list[int]]] = {}
    for fid, (stream, kts) in flows_f.items():
        s = flows_s.get(fid)
        if s is None:
            continue
        idx = op_at.get(s)
        if idx is None:
            idx = _containing(ops, by_tid, s[1], s[2])
        if idx is not None:
            info.kernel_op[(stream, kts)] = idx
    # ... and the CANN launch (same connection_id as the device task) for the launch time
    if acl_by_conn:
        for key, conn in hw_conn.items():
            launch = acl_by_conn.get(conn)
            idx = info.kernel_op.get(key)
            if launch is not None and idx is not None and ops[idx].launch is None:
                ops[idx].launch = launch

    # top-level host ops per thread: the op stream of a trace without device kernels
    for tid in {op.tid for op in ops}:
        idxs = sorted((i for i, op in enumerate(ops) if op.tid == tid), key=lambda i: (ops[i].ts, -ops[i].end))
        top: list[int] = []
        cur_end = -float("inf")
        for i in idxs:
            # nested aten ops (aten::linear > aten::matmul) belong to their parent
            if ops[i].name.startswith("aten::") and ops[i].ts >= cur_end:
                top.append(i)
                cur_end = ops[i].end
        if top:
            info.host_streams[tid] = top
    return info


def _int(v: Any) -> int:
    """A stream id (tid of a device lane): 0 unless an integer-valued finite number in int64 range."""
    try:
        i = int(v)
    except (TypeError, ValueError, OverflowError):
        return 0
    return i if -2**63 <= i < 2**63 else 0


def _containing(ops: list[HostOp], cache: dict[Any, tuple[list[float], list[int]]], tid: Any,
                ts: float) -> int | None:
    """The op on ``tid`` that was running at ``ts`` (the outermost one with a stack, if any)."""
    if tid not in cache:
        idx = sorted((i for i, o in enumerate(ops) if o.tid == tid), key=lambda i: ops[i].ts)
        cache[tid] = ([ops[i].ts for i in idx], idx)
    starts, idx = cache[tid]
    k = bisect.bisect_right(starts, ts) - 1
    best = None
    for j in range(k, max(-1, k - 8), -1):
        op = ops[idx[j]]
        if op.ts <= ts <= op.end:
            if best is None or (op.chain is not None and ops[best].chain is None):
                best = idx[j]
    return best


def _attach_spans(ops: list[HostOp], spans: dict[Any, list[tuple[float, float, str, str]]],
                  interner: _Interner, info: TraceInfo) -> None:
    """Give every op the chain of its enclosing nn.Module / autograd-node spans (a sweep per thread)."""
    by_tid: dict[Any, list[int]] = {}
    for i, op in enumerate(ops):
        by_tid.setdefault(op.tid, []).append(i)
    for tid, idxs in by_tid.items():
        sp = sorted(spans.get(tid, []), key=lambda s: (s[0], -s[1]))
        if not sp:
            continue
        idxs.sort(key=lambda i: ops[i].ts)
        open_: list[tuple[float, float, str, str, int]] = []
        k = 0
        for i in idxs:
            op = ops[i]
            while k < len(sp) and sp[k][0] <= op.ts:
                s = sp[k]
                while open_ and open_[-1][1] < s[0]:
                    open_.pop()
                open_.append((s[0], s[1], s[2], s[3], k))
                k += 1
            while open_ and open_[-1][1] < op.ts:
                open_.pop()
            live = [s for s in open_ if s[1] >= op.ts]
            mods = [s for s in live if s[2] == "mod"]
            if mods:
                # exact module identity: one invocation id per module call (span)
                op.chain = tuple(interner.get(("mod", tid, s[4]), s[3]) for s in mods)
                op.module = mods[-1][3]
                op.chain_kind = "module"
            elif op.chain is None:
                bwd = [s for s in live if s[2] == "bwd"]
                if bwd:
                    s = bwd[-1]
                    op.chain = (interner.get(("bwd", tid, s[4]), f"autograd {s[3]}"),)
                    op.module = f"autograd {s[3]}"
                    op.chain_kind = "autograd"
            if op.module is None:
                opt = [s for s in live if s[2] == "opt"]
                if opt:
                    op.module = f"Optimizer.step#{opt[-1][3]}.step"


def kernel_links(info: TraceInfo, stream: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Index of the launching host op for each kernel row (-1 when the trace does not say).

    kernel_details.csv and trace_view.json print the same start-time string, so a linked kernel
    matches exactly; a tolerance of 0.5 us absorbs versions that round differently.
    """
    out = np.full(stream.shape[0], -1, dtype=np.int64)
    if not info.kernel_op:
        return out
    by_stream: dict[int, list[tuple[float, int]]] = {}
    for (s, t), j in info.kernel_op.items():
        by_stream.setdefault(s, []).append((t, j))
    for s, pairs in by_stream.items():
        pairs.sort()
        ts = np.array([p[0] for p in pairs])
        idx = np.array([p[1] for p in pairs], dtype=np.int64)
        rows = np.flatnonzero(stream == s)
        if rows.size == 0 or ts.size == 0:
            continue
        q = start[rows]
        pos = np.searchsorted(ts, q)
        lo = np.clip(pos - 1, 0, ts.size - 1)
        hi = np.clip(pos, 0, ts.size - 1)
        pick = np.where(np.abs(q - ts[lo]) <= np.abs(q - ts[hi]), lo, hi)
        ok = np.abs(ts[pick] - q) <= 0.5
        out[rows[ok]] = idx[pick[ok]]
    return out


def kernel_links_by_time(info: TraceInfo, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a kernel_details.csv without a Stream ID column (torch_npu's Level0): the launching host
    op and the device lane (trace tid) of each kernel, matched on start time alone over every lane
    of the trace (-1 / -1 where no device kernel of the trace starts within 0.5 us)."""
    n = start.shape[0]
    ops = np.full(n, -1, dtype=np.int64)
    lanes = np.full(n, -1, dtype=np.int64)
    if not info.kernel_op or n == 0:
        return ops, lanes
    pairs = sorted((t, s, j) for (s, t), j in info.kernel_op.items())
    ts = np.array([p[0] for p in pairs])
    lane = np.array([p[1] for p in pairs], dtype=np.int64)
    idx = np.array([p[2] for p in pairs], dtype=np.int64)
    pos = np.searchsorted(ts, start)
    lo = np.clip(pos - 1, 0, ts.size - 1)
    hi = np.clip(pos, 0, ts.size - 1)
    pick = np.where(np.abs(start - ts[lo]) <= np.abs(start - ts[hi]), lo, hi)
    ok = np.abs(ts[pick] - start) <= 0.5
    ops[ok] = idx[pick[ok]]
    lanes[ok] = lane[pick[ok]]
    return ops, lanes
