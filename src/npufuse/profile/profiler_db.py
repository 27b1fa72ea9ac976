"""Read device kernels from the sqlite export of the Ascend PyTorch profiler (``ascend_pytorch_profiler*.db``).

The table layout follows the msprof export documentation: ``TASK`` (startNs, endNs, streamId,
globalTaskId, ...) joined on ``globalTaskId`` with ``COMPUTE_TASK_INFO`` (name, opType, inputShapes,
inputDataTypes, outputShapes, outputDataTypes: ids into ``STRING_IDS(id, value)``), and
``COMMUNICATION_OP`` (opName, startNs, endNs) for HCCL collectives when present. It has not been
checked against a real export (none was available): a file that lacks these tables or columns is
reported as a problem naming what is missing, never read by guess.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np

from npufuse.profile.readers import KernelTable, Problem, _encode, _type_from_name

NEEDED = {"TASK": ("startNs", "endNs", "streamId", "globalTaskId"),
          "COMPUTE_TASK_INFO": ("globalTaskId", "name", "opType"),
          "STRING_IDS": ("id", "value")}
SHAPE_COLUMNS = ("inputShapes", "inputDataTypes", "outputShapes", "outputDataTypes")
# HCCL collectives are drawn on a lane of their own: no compute stream uses a negative id
COMMUNICATION_STREAM = -1


def read_profiler_db(path: Path) -> tuple[KernelTable | None, list[Problem]]:
    """Device kernels of one rank's DB export; (None, problems) when it cannot be read."""
    fname = str(path)
    try:
        # read-only: the file is untrusted input and is never changed
        con = sqlite3.connect(f"file:{path.resolve().as_posix()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        return None, [Problem(fname, f"cannot open as sqlite: {exc}")]
    try:
        return _read(con, fname)
    except sqlite3.Error as exc:
        return None, [Problem(fname, f"cannot read the profiler database: {exc}")]
    finally:
        con.close()


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in con.execute(f'PRAGMA table_info("{table}")')}


def _read(con: sqlite3.Connection, fname: str) -> tuple[KernelTable | None, list[Problem]]:
    problems: list[Problem] = []
    have = {t: _columns(con, t) for t in (*NEEDED, "COMMUNICATION_OP")}
    for table, cols in NEEDED.items():
        if not have[table]:
            return None, [Problem(fname, f"table {table} not found (not an Ascend profiler DB export?)")]
        missing = [c for c in cols if c not in have[table]]
        if missing:
            return None, [Problem(fname, f"table {table} lacks column(s) {', '.join(missing)}", column=missing[0])]
    strings = dict(con.execute("SELECT id, value FROM STRING_IDS"))
    shape_cols = [c for c in SHAPE_COLUMNS if c in have["COMPUTE_TASK_INFO"]]
    sel = ", ".join(f"c.{c}" for c in ("name", "opType", *shape_cols))
    rows = con.execute(f"SELECT t.startNs, t.endNs, t.streamId, {sel} FROM TASK t "
                       f"JOIN COMPUTE_TASK_INFO c ON t.globalTaskId = c.globalTaskId").fetchall()
    if have["COMMUNICATION_OP"] >= {"opName", "startNs", "endNs"}:
        rows += [(s, e, COMMUNICATION_STREAM, n, None) + (None,) * len(shape_cols)
                 for n, s, e in con.execute("SELECT opName, startNs, endNs FROM COMMUNICATION_OP")]
    starts, durs, streams, names, types, keys = [], [], [], [], [], []
    for k, r in enumerate(rows, 1):
        s, e, stream = r[0], r[1], r[2]
        if not isinstance(s, int) or not isinstance(e, int) or e < s:
            problems.append(Problem(fname, f"task {k}: start/end {s!r}/{e!r} are not a time span; skipped",
                                    column="startNs"))
            continue
        name = str(strings.get(r[3], "")) if r[3] is not None else ""
        op_type = str(strings.get(r[4], "")) if r[4] is not None else ""
        starts.append(s / 1000.0)
        durs.append((e - s) / 1000.0)
        streams.append(int(stream) if isinstance(stream, int) else 0)
        names.append(name)
        types.append(op_type if op_type and op_type != "N/A" else _type_from_name(name))
        vals = {c: str(strings.get(v, "")) if v is not None else "" for c, v in zip(shape_cols, r[5:])}
        keys.append(tuple(vals.get(c, "") for c in SHAPE_COLUMNS))
    if not starts:
        return None, problems + [Problem(fname, "no device task with a time span in TASK")]
    order = np.argsort(np.array(starts), kind="stable")
    tv, tcode = _encode([types[i] for i in order])
    nv, ncode = _encode([names[i] for i in order])
    kv, kcode = _encode([keys[i] for i in order])   # type: ignore[arg-type]
    return KernelTable(source=fname, types=tv, type_code=tcode, start=np.array(starts)[order],
                       dur=np.array(durs)[order], wait=None, stream=np.array(streams, dtype=np.int64)[order],
                       step=None, shape_keys=list(kv), shape_code=kcode, names=nv, name_code=ncode,
                       backend="sqlite"), problems
