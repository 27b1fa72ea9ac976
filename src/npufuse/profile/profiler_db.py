"""Read device kernels from the sqlite export of the Ascend PyTorch profiler (``ascend_pytorch_profiler*.db``).

The layout is that of real exports (checked against the AlexNet DDP exports that Ascend/msinsight
publishes as test data, test/data/pytorch/db/level{0,1,2}, schema version 1.0.0, and against the
readers of Ascend/msprof-analyze: advisor/common/profiling/op_summary.py, compare_tools'
npu_profiling_db_parser.py)::

    TASK (startNs INTEGER, endNs INTEGER, deviceId, connectionId, globalTaskId, globalPid, taskType,
          contextId, streamId INTEGER, taskId, modelId, depth)
    COMPUTE_TASK_INFO (name, globalTaskId PRIMARY KEY, blockDim, mixBlockDim, taskType, opType,
          inputFormats, inputDataTypes, inputShapes, outputFormats, outputDataTypes, outputShapes,
          attrInfo, waitNs)              -- every text column is an id into STRING_IDS
    STRING_IDS (id INTEGER PRIMARY KEY, value TEXT)
    COMMUNICATION_OP (opName, startNs, endNs, connectionId, groupName, opId PRIMARY KEY, relay, retry,
          dataType, algType, count, opType, waitNs)   -- HCCL collectives; opName/opType are string ids
    COMMUNICATION_TASK_INFO (name, globalTaskId, ..., opId)  -- a collective's tasks in TASK (its stream)
    STEP_TIME (id, startNs, endNs)       -- the profiler's step marks

Times are integer nanoseconds since the epoch (read as us, like kernel_details.csv). At Level0 the
string ids of opType and the shape columns point at "N/A": the type is then taken from the name, as
for kernel_details.csv. A row whose name, start or end is NULL, or whose id is not in STRING_IDS,
is a problem naming its table, row and column; it is skipped, never read as another row's value.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from npufuse.profile.readers import NO_TYPE_CELLS, KernelTable, Problem, _encode, _ProblemLog, _type_from_name

NEEDED = {"TASK": ("startNs", "endNs", "streamId", "globalTaskId"),
          "COMPUTE_TASK_INFO": ("globalTaskId", "name", "opType"),
          "STRING_IDS": ("id", "value")}
SHAPE_COLUMNS = ("inputShapes", "inputDataTypes", "outputShapes", "outputDataTypes")
# a collective whose tasks cannot be found in TASK is drawn on a lane of its own: no compute
# stream uses a negative id
COMMUNICATION_STREAM = -1


def read_profiler_db(path: Path) -> tuple[KernelTable | None, list[Problem]]:
    """Device kernels of one rank's DB export; (None, problems) when it cannot be read."""
    fname = str(path)
    try:
        # read-only and immutable: the file is untrusted input and is never changed (no journal,
        # no -wal file created beside it)
        # the path is percent-encoded: a "?", "#" or "%" in a folder name would end or change the URI
        con = sqlite3.connect(f"file:{quote(path.resolve().as_posix())}?mode=ro&immutable=1", uri=True)
    except (sqlite3.Error, ValueError) as exc:
        return None, [Problem(fname, f"cannot open as sqlite: {exc}")]
    try:
        return _read(con, fname)
    except (sqlite3.Error, OverflowError, MemoryError) as exc:
        return None, [Problem(fname, f"cannot read the profiler database: {exc}")]
    finally:
        con.close()


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in con.execute(f'PRAGMA table_info("{table}")')}


def _ns(v: Any) -> int | None:
    """A time stamp in ns: INTEGER in TASK, TEXT in some tables of the same export (PYTORCH_API)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, (str, bytes)):
        try:
            return int(v)
        except ValueError:
            return None
    if isinstance(v, float) and v == v and abs(v) < 2**63:
        return int(v)
    return None


class _Strings:
    """STRING_IDS lookups that report a NULL or dangling id with the row and column it came from."""

    def __init__(self, con: sqlite3.Connection, fname: str, log: _ProblemLog) -> None:
        self.ids = dict(con.execute("SELECT id, value FROM STRING_IDS"))
        self.fname, self.log = fname, log

    def get(self, v: Any, table: str, row: int, key: str, column: str, required: bool) -> str | None:
        """The string of id ``v``; None (and a problem) when it is missing and ``required``, "" when
        it is missing from an optional column (the value is then unknown, as an empty cell)."""
        if v is None:
            if required:
                self.log.add(self.fname, f"{table} row {row} ({key}): {column} is NULL; the row is skipped",
                             column=f"{table}.{column}", kind=f"{table}.{column} NULL")
                return None
            return ""
        s = self.ids.get(v)
        if s is None:
            what = "the row is skipped" if required else "read as unknown"
            self.log.add(self.fname, f"{table} row {row} ({key}): {column} id {v!r} is not in STRING_IDS; {what}",
                         column=f"{table}.{column}", kind=f"{table}.{column} dangling id")
            return None if required else ""
        return str(s)


def _read(con: sqlite3.Connection, fname: str) -> tuple[KernelTable | None, list[Problem]]:
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    have = {t: _columns(con, t) for t in (*NEEDED, "COMMUNICATION_OP", "COMMUNICATION_TASK_INFO", "STEP_TIME")
            if t in tables}
    for table, cols in NEEDED.items():
        if table not in have:
            return None, [Problem(fname, f"table {table} not found (not an Ascend profiler DB export?)")]
        missing = [c for c in cols if c not in have[table]]
        if missing:
            return None, [Problem(fname, f"table {table} lacks column(s) {', '.join(missing)}",
                                  column=f"{table}.{missing[0]}")]
    log = _ProblemLog()
    strings = _Strings(con, fname, log)
    shape_cols = [c for c in SHAPE_COLUMNS if c in have["COMPUTE_TASK_INFO"]]
    sel = ", ".join(f"c.{c}" for c in ("name", "opType", *shape_cols))
    # LEFT JOIN: a compute task without its TASK row is named, not dropped silently
    compute = con.execute(f"SELECT c.rowid, c.globalTaskId, t.startNs, t.endNs, t.streamId, {sel}, "
                          f"t.globalTaskId IS NULL "
                          f"FROM COMPUTE_TASK_INFO c LEFT JOIN TASK t ON t.globalTaskId = c.globalTaskId")
    starts: list[int] = []
    ends: list[int] = []
    streams: list[int] = []
    names: list[str] = []
    types: list[str] = []
    keys: list[tuple[str, str, str, str]] = []

    def times(table: str, row: int, key: str, s: Any, e: Any, sc: str, ec: str) -> tuple[int, int] | None:
        s_ns, e_ns = _ns(s), _ns(e)
        bad = sc if s_ns is None else ec if e_ns is None else ec if e_ns < s_ns else None
        if bad is not None:
            val = s if bad == sc and s_ns is None else e
            why = "is not a time in ns" if val is None or _ns(val) is None else f"ends before it starts ({s!r})"
            log.add(fname, f"{table} row {row} ({key}): {bad} {val!r} {why}; the row is skipped",
                    column=f"{table}.{bad}", kind=f"{table}.{bad} time")
            return None
        return s_ns, e_ns  # type: ignore[return-value]

    for r in compute:
        rowid, gid = r[0], r[1]
        key = f"globalTaskId {gid}"
        if r[-1]:
            log.add(fname, f"COMPUTE_TASK_INFO row {rowid} ({key}): no TASK row with this globalTaskId; skipped",
                    column="TASK.globalTaskId", kind="no TASK row")
            continue
        span = times("TASK", rowid, key, r[2], r[3], "startNs", "endNs")
        if span is None:
            continue
        name = strings.get(r[5], "COMPUTE_TASK_INFO", rowid, key, "name", required=True)
        if name is None:
            continue
        op_type = strings.get(r[6], "COMPUTE_TASK_INFO", rowid, key, "opType", required=False) or ""
        vals = {c: strings.get(v, "COMPUTE_TASK_INFO", rowid, key, c, required=False) or ""
                for c, v in zip(shape_cols, r[7:-1])}
        starts.append(span[0])
        ends.append(span[1])
        streams.append(int(r[4]) if isinstance(r[4], int) else 0)
        names.append(name)
        # Level0 writes "N/A" for the type: taken from the name, as kernel_details.csv's reader does
        types.append(op_type if op_type not in NO_TYPE_CELLS else _type_from_name(name))
        keys.append(tuple("" if vals.get(c, "") in NO_TYPE_CELLS else vals[c]    # type: ignore[misc]
                          for c in SHAPE_COLUMNS))
    comm = have.get("COMMUNICATION_OP", set())
    if comm >= {"opName", "startNs", "endNs"}:
        lanes = _collective_streams(con, have)
        has_id = "opId" in comm
        has_type = "opType" in comm
        q = (f"SELECT rowid, opName, startNs, endNs, {'opId' if has_id else 'NULL'}, "
             f"{'opType' if has_type else 'NULL'} FROM COMMUNICATION_OP")
        for rowid, op_name, s, e, op_id, op_type_id in con.execute(q):
            key = f"opId {op_id}" if has_id else f"rowid {rowid}"
            span = times("COMMUNICATION_OP", rowid, key, s, e, "startNs", "endNs")
            if span is None:
                continue
            name = strings.get(op_name, "COMMUNICATION_OP", rowid, key, "opName", required=True)
            if name is None:
                continue
            op_type = strings.get(op_type_id, "COMMUNICATION_OP", rowid, key, "opType", required=False) or ""
            starts.append(span[0])
            ends.append(span[1])
            streams.append(lanes.get(op_id, COMMUNICATION_STREAM))
            names.append(name)
            types.append(op_type if op_type not in NO_TYPE_CELLS else _type_from_name(name))
            keys.append(("", "", "", ""))
    problems = log.finish()
    if not starts:
        return None, problems + [Problem(fname, "no device task with a time span in TASK / COMMUNICATION_OP")]
    s_ns = np.array(starts, dtype=np.int64)
    e_ns = np.array(ends, dtype=np.int64)
    order = np.argsort(s_ns, kind="stable")
    s_ns, e_ns = s_ns[order], e_ns[order]
    step = _steps(con, have, s_ns)
    # us, as kernel_details.csv writes them (its 3 decimals are these ns). ns since the epoch do not fit
    # a float64 (1.7e18, 256 ns apart), so whole us and the ns rest are converted apart: one rounding,
    # the same value a reader of the CSV's "....403" gets
    start_us = (s_ns // 1000).astype(np.float64) + (s_ns % 1000) / 1000.0
    dur_us = (e_ns - s_ns) / 1000.0
    tv, tcode = _encode([types[i] for i in order])
    nv, ncode = _encode([names[i] for i in order])
    kv, kcode = _encode([keys[i] for i in order])   # type: ignore[arg-type]
    return KernelTable(source=fname, types=tv, type_code=tcode, start=start_us, dur=dur_us, wait=None,
                       stream=np.array(streams, dtype=np.int64)[order], step=step, shape_keys=list(kv),
                       shape_code=kcode, names=nv, name_code=ncode, backend="sqlite"), problems


def _collective_streams(con: sqlite3.Connection, have: dict[str, set[str]]) -> dict[Any, int]:
    """opId -> the stream its tasks ran on (COMMUNICATION_TASK_INFO -> TASK), where the export has it:
    an HCCL stream of its own, as kernel_details.csv shows the collective apart from compute."""
    info = have.get("COMMUNICATION_TASK_INFO", set())
    if not info >= {"opId", "globalTaskId"}:
        return {}
    out: dict[Any, int] = {}
    for op_id, stream in con.execute("SELECT i.opId, MIN(t.streamId) FROM COMMUNICATION_TASK_INFO i "
                                     "JOIN TASK t ON t.globalTaskId = i.globalTaskId GROUP BY i.opId"):
        if isinstance(stream, int):
            out[op_id] = stream
    return out


def _steps(con: sqlite3.Connection, have: dict[str, set[str]], start_ns: np.ndarray) -> np.ndarray | None:
    """The step of each task from STEP_TIME (id, startNs, endNs), -1 outside every step; None when the
    export has no step marks (then the whole file is one window, as a kernel_details.csv without a
    Step Id column)."""
    if not have.get("STEP_TIME", set()) >= {"id", "startNs", "endNs"}:
        return None
    marks = []
    for sid, s, e in con.execute("SELECT id, startNs, endNs FROM STEP_TIME"):
        s_ns, e_ns = _ns(s), _ns(e)
        if isinstance(sid, int) and s_ns is not None and e_ns is not None and e_ns >= s_ns:
            marks.append((s_ns, e_ns, sid))
    if not marks:
        return None
    step = np.full(start_ns.shape[0], -1, dtype=np.int64)
    for s_ns, e_ns, sid in sorted(marks):
        lo, hi = np.searchsorted(start_ns, [s_ns, e_ns], side="left")
        step[lo:hi] = sid
    return step
