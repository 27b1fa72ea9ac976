"""Column-tolerant loading of Ascend PyTorch Profiler output.

Reads the ``*_ascend_pt/ASCEND_PROFILER_OUTPUT/`` files (any subset that exists) or a bare
``kernel_details.csv``. Column names differ between CANN / torch_npu versions, so every CSV is
read through an alias table and the loader reports which header it used for each field.

Nothing here raises for bad *content*: a malformed file, row or cell becomes a :class:`Problem`
(file, row, column, message) and the readable rest is still returned. Only the caller decides
whether the remainder is enough to go on.

Line ends: LF, CRLF and a bare CR (old-Mac files, or a stray CR) all end a row outside quotes, as
the ``csv`` module reads them; row numbers in problems count lines that way. polars knows only LF
(and CRLF), so a file with a bare CR is always read by the csv module, and both readers agree.
Likewise for a quote that RFC 4180 does not allow (mid-cell, or closing a cell that goes on): the
csv module takes it as a literal character, polars as the start of quoting (`_has_stray_quote`).

Short kernel rows: one that stops before a column a kernel cannot do without (type or name,
duration, start) is skipped and named; one that stops before an optional column read here
(stream, step, wait, shapes) is kept with those cells unknown, and named. A row short only in
columns not read, or longer than the header, is read by position without a problem (polars does
not reliably see a long row, so naming it would make the readers disagree). polars cannot tell a
short row from empty cells, so a file with rows empty from the last column read to the end is
read by the csv module (the reference) too.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

OUTPUT_DIR = "ASCEND_PROFILER_OUTPUT"
KNOWN_FILES = ("kernel_details.csv", "op_statistic.csv", "operator_details.csv", "trace_view.json",
               "step_trace_time.csv")
# A row-level problem is reported this many times per (file, column); the rest are counted.
MAX_PROBLEMS_PER_KIND = 5
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # call stacks in operator_details are long


@dataclass(frozen=True)
class Problem:
    """Something in the input that could not be read; crosses file boundaries as data."""

    file: str
    message: str
    row: int | None = None        # 1-based physical line in the file (header = 1; a bare CR ends a line)
    column: str | None = None

    def __post_init__(self) -> None:
        # a problem is one line: cells and headers can hold quoted line breaks
        object.__setattr__(self, "message", _one_line(self.message))
        if self.column:
            object.__setattr__(self, "column", _one_line(self.column))

    def __str__(self) -> str:
        where = self.file
        if self.row is not None:
            where += f", row {self.row}"
        if self.column:
            where += f", column '{self.column}'"
        return f"{where}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "row": self.row, "column": self.column, "message": self.message}


_LINE_BREAK = re.compile(r"[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]")


def _one_line(text: str) -> str:
    """``text`` with line breaks escaped as ``repr`` writes them (``\\n``), so it prints as one line."""
    return _LINE_BREAK.sub(lambda m: repr(m.group())[1:-1], text)


def _show(cell: str) -> str:
    """A cell quoted for a message: ``repr`` of its first 40 characters (escapes line breaks)."""
    return repr(cell.strip()[:40])


# No profiler time or counter reaches this (ns since the epoch are ~2e18); a cell beyond it is
# corrupt, and adding up such cells would overflow to inf (not JSON).
MAX_NUMBER = 1e20


def parse_number(cell: Any) -> float | None:
    """The one rule for a numeric cell: a finite float within ±MAX_NUMBER, else None (not a number,
    nan, inf, 1e400, 1e308)."""
    try:
        v = float(cell)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if -MAX_NUMBER <= v <= MAX_NUMBER else None   # (False for nan)


# The profiler's time resolution is 1 ns. A time shorter than that (a denormal 1e-320 us, say) is
# not a measurement, and dividing by it overflows to inf, which is not JSON: shares and rates divide
# only by times at least this long, and a shorter divisor makes the ratio unknown.
MIN_TIME_US = 1e-3


def share(part: float, whole_us: float) -> float:
    """``part / whole_us`` (a share of a time), 0.0 when ``whole_us`` is too short to divide by
    (below MIN_TIME_US: unknown) or the quotient is not finite."""
    if not whole_us >= MIN_TIME_US:   # (also False for nan)
        return 0.0
    q = part / whole_us
    return q if math.isfinite(q) else 0.0


def _not_a_number(cell: str) -> str:
    """Why parse_number refused ``cell``, for a problem message."""
    try:
        v = float(cell)
    except (TypeError, ValueError, OverflowError):
        return f"{_show(cell)} is not a number"
    return f"{_show(cell)} is not a finite number" if not math.isfinite(v) else \
        f"{_show(cell)} is out of range (beyond ±{MAX_NUMBER:g})"


_INT64 = 2**63


def parse_int(cell: Any, default: int) -> int:
    """An integer cell (stream, step): exact for integer text, else truncated from a finite float;
    ``default`` when it is not a number or does not fit int64."""
    try:
        v = int(cell)
    except (TypeError, ValueError, OverflowError):
        f = parse_number(cell)
        if f is None:
            return default
        v = int(f)
    return v if -_INT64 <= v < _INT64 else default


class _ProblemLog:
    """Collects problems, capping repeats of the same kind so a broken 1M-row file stays readable."""

    def __init__(self) -> None:
        self.items: list[Problem] = []
        self._seen: dict[tuple[str, str | None, str], int] = {}

    def add(self, file: str, message: str, row: int | None = None, column: str | None = None,
            kind: str = "") -> None:
        key = (file, column, kind or message)
        n = self._seen.get(key, 0) + 1
        self._seen[key] = n
        if n <= MAX_PROBLEMS_PER_KIND:
            self.items.append(Problem(file, message, row, column))

    def finish(self) -> list[Problem]:
        out = list(self.items)
        for (file, column, kind), n in self._seen.items():
            if n > MAX_PROBLEMS_PER_KIND:
                out.append(Problem(file, f"{n - MAX_PROBLEMS_PER_KIND} more rows with the same problem "
                                         f"({kind})", None, column))
        return out


# ------------------------------------------------------------------------------------ columns

# canonical field -> header spellings seen across CANN / torch_npu versions (compared after
# lower-casing and dropping spaces/underscores, so "Stream Id" == "stream_id").
KERNEL_ALIASES: dict[str, tuple[str, ...]] = {
    "type": ("Type", "OP Type", "Op Type", "Kernel Type"),
    "name": ("Name", "Op Name", "OP Name", "Kernel Name"),
    "stream": ("Stream ID", "Stream Id"),
    "start": ("Start Time(us)", "Task Start Time(us)", "Start Time", "Start Time(ns)"),
    "duration": ("Duration(us)", "Task Duration(us)", "Duration", "Duration(ns)"),
    "wait": ("Wait Time(us)", "Task Wait Time(us)", "Wait Time"),
    "step": ("Step Id", "Step ID", "Step"),
    "core": ("Accelerator Core", "Task Type", "Core Type"),
    "in_shapes": ("Input Shapes",),
    "in_dtypes": ("Input Data Types",),
    "out_shapes": ("Output Shapes",),
    "out_dtypes": ("Output Data Types",),
    "device": ("Device_id", "Device ID", "Device Id"),
}
OP_STAT_ALIASES: dict[str, tuple[str, ...]] = {
    "type": ("OP Type", "Op Type", "Type"),
    "core": ("Core Type", "Accelerator Core"),
    "count": ("Count",),
    "total": ("Total Time(us)", "Total Time"),
}
STEP_ALIASES: dict[str, tuple[str, ...]] = {
    "step": ("Step", "Step Id", "Step ID"),
    "computing": ("Computing",),
    "free": ("Free",),
    "stage": ("Stage",),
    "communication": ("Communication(Not Overlapped)",),
}
OPERATOR_ALIASES: dict[str, tuple[str, ...]] = {
    "name": ("Name",),
    "stack": ("Call Stack",),
    "device_total": ("Device Total Duration(us)",),
    "host_total": ("Host Total Duration(us)",),
}


# the kernel fields the readers take in (the others are resolved only to be reported as used)
KERNEL_FIELDS_READ = ("type", "name", "stream", "start", "duration", "wait", "step", "in_shapes", "in_dtypes",
                      "out_shapes", "out_dtypes")


def _norm(header: str) -> str:
    return re.sub(r"[\s_]", "", header.strip().lower())


@dataclass
class ColumnMap:
    """Which header each canonical field came from, and what was left unused."""

    used: dict[str, str] = field(default_factory=dict)        # field -> header as written
    index: dict[str, int] = field(default_factory=dict)       # field -> column index
    ignored: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        metrics = [h for h in self.ignored if re.match(r"(?i)(aic|aiv)_", h)]
        other = [h for h in self.ignored if h not in metrics]
        return {"used": dict(self.used), "ignored_metric_columns": len(metrics), "ignored": other}


def resolve_columns(header: list[str], aliases: dict[str, tuple[str, ...]]) -> ColumnMap:
    """Map canonical fields to header positions; the first alias present wins."""
    cm = ColumnMap()
    normed = {}
    for i, h in enumerate(header):
        normed.setdefault(_norm(h), i)
    for fld, names in aliases.items():
        for name in names:
            i = normed.get(_norm(name))
            if i is not None:
                cm.used[fld] = header[i].strip()
                cm.index[fld] = i
                break
    taken = set(cm.index.values())
    cm.ignored = [h.strip() for i, h in enumerate(header) if i not in taken and h.strip()]
    return cm


# ------------------------------------------------------------------------------------ kernels

@dataclass
class KernelTable:
    """Device kernels of one rank, column-wise (numpy arrays), in file order."""

    source: str
    types: list[str]              # vocabulary; ``type_code`` indexes it
    type_code: np.ndarray         # int32
    start: np.ndarray             # float64, us (row order if the file has no start column)
    dur: np.ndarray               # float64, us
    wait: np.ndarray | None       # float64, us
    stream: np.ndarray            # int64 (0 when the file has no stream column)
    step: np.ndarray | None       # int64, -1 where unknown
    shape_keys: list[tuple[str, str, str, str]]   # (in_shapes, in_dtypes, out_shapes, out_dtypes)
    shape_code: np.ndarray        # int32 index into shape_keys
    names: list[str] = field(default_factory=list)  # vocabulary of kernel names (optional)
    name_code: np.ndarray | None = None
    columns: ColumnMap = field(default_factory=ColumnMap)
    backend: str = "csv"
    notes: list[str] = field(default_factory=list)
    # busiest compute / memory pipe ratio per kernel (aic_*/aiv_* metric columns), NaN where unknown;
    # None when the reader did not take them (see profile.pipes)
    pipe_compute: np.ndarray | None = None
    pipe_memory: np.ndarray | None = None

    @property
    def n(self) -> int:
        return int(self.dur.shape[0])


_TRAILING_INDEX = re.compile(r"(?:_\d+)+$")
_NUMBERED_OP = re.compile(r"(.*?[A-Za-z])\d+$")
# cells that mean "no type recorded": torch_npu's default Level0 writes N/A in every Type cell
NO_TYPE_CELLS = frozenset(("", "N/A", "NA", "-"))


def _type_from_name(name: str) -> str:
    """The op type a kernel name stands for, as Level1's Type column writes it.

    torch_npu names look like "aclnnCast_CastAiCore_Cast" (type: the last part), "trans_TransData_17"
    and "Conv2D1" / "ReduceSum7" (graph-node names with an index: TransData, Conv2D, ReduceSum) and
    "hcom_allReduce__586_0_1" (Level1 types it "hcom_allReduce_"). A trailing number is an index,
    never the type, except a version suffix ("MatMulV2", "LogSoftmaxV2")."""
    base = _TRAILING_INDEX.sub("", name) or name
    if base.startswith("hcom_"):
        return base
    t = base.rsplit("_", 1)[-1] or base
    m = _NUMBERED_OP.fullmatch(t)
    if m and not m.group(1).endswith("V"):
        t = m.group(1)
    return t


def _encode(values: list[str]) -> tuple[list[str], np.ndarray]:
    vocab: dict[str, int] = {}
    codes = np.fromiter((vocab.setdefault(v, len(vocab)) for v in values), dtype=np.int32,
                        count=len(values))
    return list(vocab), codes


def read_kernel_details(path: Path, *, backend: str = "auto") -> tuple[KernelTable | None, list[Problem]]:
    """Read one kernel_details.csv. Returns (table or None, problems).

    ``backend``: "auto" (polars when importable, else the stdlib csv module), "polars" or "csv".
    The csv path is also the fallback whenever polars refuses a file (ragged rows), because it
    can name the exact row that is broken.
    """
    log = _ProblemLog()
    fname = str(path)
    try:
        with open(path, newline="", encoding="utf-8-sig", errors="replace") as fp:
            header = next(csv.reader(fp), None)
    except OSError as exc:
        return None, [Problem(fname, f"cannot read: {exc.strerror or exc}")]
    if not header or not any(h.strip() for h in header):
        return None, [Problem(fname, "empty file (no header row)")]
    cm = resolve_columns(header, KERNEL_ALIASES)
    if "duration" not in cm.index or ("type" not in cm.index and "name" not in cm.index):
        missing = [f for f in ("type", "duration") if f not in cm.index and not (f == "type" and "name" in cm.index)]
        want = " / ".join(KERNEL_ALIASES[m][0] for m in missing)
        return None, [Problem(fname, f"no known kernel columns: missing {want}; header has "
                                     f"{', '.join(h.strip() for h in header[:8])}{' ...' if len(header) > 8 else ''}",
                              row=1)]
    table = None
    # one pass over the file answers both (a bare CR, a stray quote): 297 MiB read once, not twice
    if backend in ("auto", "polars") and not _has_stray_quote(path, bare_cr_too=True):
        table = _read_kernels_polars(path, header, cm, log, strict=backend == "polars")
    if table is None:
        table = _read_kernels_csv(path, header, cm, log)
    if table is not None:
        if "start" not in cm.index:
            table.notes.append("no start-time column: kernels ordered as written")
        if "stream" not in cm.index:
            table.notes.append("no stream column: all kernels taken as one stream")
        if "step" not in cm.index:
            table.notes.append("no Step Id column: steps from trace_view.json if present")
        if table.n == 0:
            log.add(fname, "no kernel rows", kind="empty")
            table = None
    return table, log.finish()


def _has_bare_cr(path: Path, chunk: int = 1 << 20) -> bool:
    """Whether the file holds a CR not followed by LF. The csv module ends a row there and polars
    does not (it even drops a CR before a comma), so such a file goes to the csv reader, the
    reference. One pass with numpy in cache-sized chunks: CRLF files (the csv module's default)
    have a CR on every line, and bytes.count(b"\\r\\n") takes twice as long; LF files cost one
    memchr a chunk. ~0.25 s CPU for 1M kernel rows (284 MiB) on a loaded 2-core machine."""
    try:
        with open(path, "rb") as fp:
            prev_cr = False
            while True:
                buf = fp.read(chunk)
                if not buf:
                    return prev_cr
                if prev_cr and buf[0] != 0x0A:
                    return True
                prev_cr = buf[-1] == 0x0D   # its LF, if any, starts the next chunk
                if b"\r" not in buf:
                    continue
                a = np.frombuffer(buf, dtype=np.uint8)
                cr = np.flatnonzero(a[:-1] == 0x0D)
                if cr.size and (a[cr + 1] != 0x0A).any():
                    return True
    except OSError:
        return False   # the csv reader then reports why it cannot read the file


def _cell_fits(cell: str, integer: bool, required: bool) -> bool:
    c = cell.strip()
    if c in UNKNOWN_CELLS:
        return not required
    return c.isdigit() if integer else parse_number(c) is not None


def _missing_cell_positions(row: list[str], ncols: int, numeric_ix: list[int], integer_ix: set[int],
                            required_ix: set[int]) -> list[int]:
    """Where the cells a short row lacks can be, as far as its cells tell: the positions at which
    empty cells put back make every numeric cell a number (a run of them for several missing)."""
    k = ncols - len(row)
    return [p for p in range(len(row) + 1)
            if all(_cell_fits((row[:p] + [""] * k + row[p:])[i], i in integer_ix, i in required_ix)
                   for i in numeric_ix)]


def _read_kernels_csv(path: Path, header: list[str], cm: ColumnMap, log: _ProblemLog) -> KernelTable | None:
    fname = str(path)
    ix = cm.index
    ncols = len(header)
    i_type, i_name = ix.get("type"), ix.get("name")
    i_dur, i_start, i_wait = ix["duration"], ix.get("start"), ix.get("wait")
    i_stream, i_step = ix.get("stream"), ix.get("step")
    shape_ix = [ix.get(k) for k in ("in_shapes", "in_dtypes", "out_shapes", "out_dtypes")]
    has_shapes = any(i is not None for i in shape_ix)   # keep whichever of the four are present
    # a row must reach every column a kernel cannot do without; one that stops before an
    # optional column read here is padded (those cells unknown) and named
    need = max(i for i in (i_type, i_name, i_dur, i_start) if i is not None)
    optional = sorted((i, cm.used[f]) for f, i in ix.items() if f in KERNEL_FIELDS_READ and i > need)
    used = optional[-1][0] if optional else need
    types: list[str] = []
    names: list[str] = []
    durs: list[str] = []
    starts: list[str] = []
    waits: list[str] = []
    streams: list[str] = []
    steps: list[str] = []
    lines: list[int] = []
    shape_vocab: dict[tuple[str, str, str, str], int] = {}
    shape_codes: list[int] = []
    empty4 = ("", "", "", "")
    from npufuse.profile.pipes import metric_columns

    comp_ix, mem_ix = metric_columns(header)
    pipe_ix = comp_ix + mem_ix
    pipe_cells: list[list[str]] = [[] for _ in pipe_ix]
    try:
        with open(path, newline="", encoding="utf-8-sig", errors="replace") as fp:
            reader = csv.reader(fp)
            next(reader, None)
            integer_ix = {i for i in (i_stream, i_step) if i is not None}
            numeric_ix = sorted(integer_ix | {i for i in (i_dur, i_start, i_wait) if i is not None})
            for row in reader:
                if 0 < len(row) < ncols and any(c.strip() for c in row):
                    fits = _missing_cell_positions(row, ncols, numeric_ix, integer_ix,
                                                   {i for i in (i_dur, i_start) if i is not None})
                    if fits != [len(row)]:
                        # a cell may be missing in the middle: read by position, every cell after it would
                        # sit under the wrong column (a Level0 row without its Type puts the duration
                        # under Start), so the row is named and not read
                        where = [header[p].strip() for p in fits] or [header[len(row)].strip()]
                        log.add(fname, f"row has {len(row)} fields, header has {ncols}: a cell is missing "
                                       f"(in column {' or '.join(dict.fromkeys((where[0], where[-1])))}) or the row is "
                                       f"truncated; not read, its cells would fall under the wrong columns",
                                row=reader.line_num, column=where[0] if len(where) == 1 else f"{where[0]}..{where[-1]}",
                                kind="short row")
                        continue
                    # only the end is missing (a truncated row): its cells are where the header says
                if len(row) <= used:
                    if not row:
                        continue   # a blank line
                    if len(row) <= need:
                        log.add(fname, f"row has {len(row)} fields, header has {ncols} (truncated?); skipped",
                                row=reader.line_num, kind="short row")
                        continue
                    lost = [h for i, h in optional if i >= len(row)]
                    log.add(fname, f"row has {len(row)} fields, header has {ncols} (truncated?); "
                                   f"{', '.join(lost)} taken as unknown", row=reader.line_num, column=lost[0],
                            kind="short row, optional cells lost")
                    row = row + [""] * (used + 1 - len(row))
                lines.append(reader.line_num)
                t = row[i_type] if i_type is not None else ""
                if i_name is not None:
                    names.append(row[i_name])
                    if t.strip() in NO_TYPE_CELLS:
                        t = _type_from_name(row[i_name])
                types.append(t)
                durs.append(row[i_dur])
                if i_start is not None:
                    starts.append(row[i_start])
                if i_wait is not None:
                    waits.append(row[i_wait])
                if i_stream is not None:
                    streams.append(row[i_stream])
                if i_step is not None:
                    steps.append(row[i_step])
                key = tuple(row[i] if i is not None else "" for i in shape_ix) if has_shapes else empty4
                code = shape_vocab.get(key)  # type: ignore[arg-type]
                if code is None:
                    code = shape_vocab[key] = len(shape_vocab)  # type: ignore[index]
                shape_codes.append(code)
                for cells, i in zip(pipe_cells, pipe_ix):
                    cells.append(row[i] if i < len(row) else "")
    except csv.Error as exc:
        log.add(fname, f"CSV parse error: {exc}; rows after it were not read", row=None, kind="csv error")
    except OSError as exc:
        log.add(fname, f"cannot read: {exc.strerror or exc}")
        return None
    n = len(durs)
    keep = np.ones(n, dtype=bool)
    dur = _floats(durs, lines, keep, fname, cm.used["duration"], log, required=True)
    start = _floats(starts, lines, keep, fname, cm.used.get("start", ""), log, required=True) \
        if i_start is not None else np.arange(n, dtype=np.float64)
    wait = _floats(waits, lines, None, fname, cm.used.get("wait", ""), log, required=False) \
        if i_wait is not None else None
    stream = _ints(streams, 0) if i_stream is not None else np.zeros(n, dtype=np.int64)
    step = _ints(steps, -1) if i_step is not None else None
    vocab, tcode = _encode(types)
    nvocab, ncode = _encode(names) if names else ([], None)
    table = KernelTable(source=fname, types=vocab, type_code=tcode, start=start, dur=dur, wait=wait,
                        stream=stream, step=step, shape_keys=list(shape_vocab) or [empty4],
                        shape_code=np.asarray(shape_codes, dtype=np.int32) if shape_codes
                        else np.zeros(n, dtype=np.int32),
                        names=nvocab, name_code=ncode, columns=cm, backend="csv")
    if pipe_ix:
        ratios = [_ratios(c) for c in pipe_cells]
        table.pipe_compute = _fmax(ratios[:len(comp_ix)], n)
        table.pipe_memory = _fmax(ratios[len(comp_ix):], n)
    return _drop(table, keep)


def _ratios(cells: list[str]) -> np.ndarray:
    """Pipe ratio cells as numbers; not a number or outside 0..1: unknown (NaN), as the polars reader."""
    v = np.fromiter((_float_or_nan(c) for c in cells), dtype=np.float64, count=len(cells))
    return np.where((v >= 0) & (v <= 1), v, np.nan)


def _float_or_nan(cell: str) -> float:
    if cell != cell.strip():
        return float("nan")   # as polars' cast, which takes no blanks around a number
    try:
        return float(cell)
    except ValueError:
        return float("nan")


def _fmax(columns: list[np.ndarray], n: int) -> np.ndarray:
    out = np.full(n, np.nan)
    for c in columns:
        out = np.fmax(out, c)
    return out


def _floats(values: list[str], lines: list[int], keep: np.ndarray | None, fname: str, column: str,
            log: _ProblemLog, required: bool) -> np.ndarray:
    try:
        # float() strips whitespace, which covers torch_npu's "<ts>\t" start-time cells
        out = np.fromiter(map(float, values), dtype=np.float64, count=len(values))
        if (np.abs(out) <= MAX_NUMBER).all():   # (False for nan)
            return out
    except ValueError:
        pass
    out = np.empty(len(values), dtype=np.float64)
    for i, v in enumerate(values):
        f = parse_number(v)
        if f is not None:
            out[i] = f
            continue
        out[i] = np.nan
        if required and keep is not None:
            keep[i] = False
            log.add(fname, f"{_not_a_number(v)}; row skipped", row=lines[i], column=column,
                    kind="not a number")
        elif v.strip() not in UNKNOWN_CELLS:
            log.add(fname, f"{_not_a_number(v)}; taken as unknown", row=lines[i],
                    column=column, kind="not a number")
    return out


UNKNOWN_CELLS = ("", "N/A", "NA", "-")  # an optional numeric cell left empty on purpose


def _ints(values: list[str], default: int) -> np.ndarray:
    try:
        return np.fromiter(map(int, values), dtype=np.int64, count=len(values))
    except (ValueError, OverflowError):
        return np.fromiter((parse_int(v, default) for v in values), dtype=np.int64, count=len(values))


def _drop(table: KernelTable, keep: np.ndarray) -> KernelTable:
    if keep.all():
        return table
    for attr in ("type_code", "start", "dur", "wait", "stream", "step", "shape_code", "name_code", "pipe_compute",
                 "pipe_memory"):
        arr = getattr(table, attr)
        if arr is not None:
            setattr(table, attr, arr[keep])
    return table


class _Fallback(Exception):
    """The polars fast path met a cell it cannot judge like the csv reader: let that one read the file."""


_SEPARATORS = np.array([0x2C, 0x0A, 0x0D], dtype=np.uint8)   # what may stand beside a field's quotes


def _is_separator(b: np.ndarray) -> np.ndarray:
    # three compares: np.isin sorts its arguments on every call (6M quote runs per 1M kernel rows)
    return (b == 0x2C) | (b == 0x0A) | (b == 0x0D)


def _has_stray_quote(path: Path, chunk: int = 1 << 20, bare_cr_too: bool = False) -> bool:
    """Whether a ``"`` stands where RFC 4180 quoting has none: one opening a quoted field anywhere
    but at the field's start (a NUL and then a quoted shape cell), one closing a field that goes
    on before the next comma or line end, or a quote left open at the end of the file. The csv
    module reads such a quote as a literal character and splits the cell at its commas; polars
    lets it quote the rest of the cell; so such a file goes to the csv reader, the reference, like
    a bare CR. ~0.1 s CPU for 500k kernel rows (91 MiB) with two quoted shape cells each.

    Quote state is the parity of the quotes before a position (escaped quotes come in pairs), so
    one vectorised pass over each run of quotes does it: a run outside a field must follow a
    separator (or the file's start), and a run that leaves the field closed must be followed by
    one (or the end). A run of quotes at a chunk's end is carried into the next chunk with the
    byte before it, so chunking does not change the answer.

    ``bare_cr_too``: also True where ``_has_bare_cr`` would be, in the same pass."""
    try:
        with open(path, "rb") as fp:
            ctx, pending, odd = b"\n", b"", 0   # byte before `pending` (a file starts like a line); quotes seen, mod 2
            prev_cr = False
            while True:
                data = fp.read(chunk)
                eof = not data
                if bare_cr_too:
                    if eof and prev_cr:
                        return True
                    if data and prev_cr and data[0] != 0x0A:
                        return True
                    if data:
                        prev_cr = data[-1] == 0x0D   # its LF, if any, starts the next chunk
                        if b"\r" in data:
                            d = np.frombuffer(data, dtype=np.uint8)
                            cr = np.flatnonzero(d[:-1] == 0x0D)
                            if cr.size and (d[cr + 1] != 0x0A).any():
                                return True
                buf = ctx + pending + (b"\n" if eof else data)   # at the end, the file's end acts as a line end
                keep = len(buf) if eof else len(buf.rstrip(b'"'))   # a trailing run waits for its next byte
                a = np.frombuffer(buf, dtype=np.uint8, count=keep)
                q = np.flatnonzero(a == 0x22)
                if q.size:
                    first = np.concatenate(([0], np.flatnonzero(np.diff(q) != 1) + 1))   # index in q of each run's start
                    start = q[first]
                    length = np.diff(np.append(first, q.size))
                    before = (first + odd) % 2           # 1: the run starts inside a quoted field
                    closed = (before + length) % 2 == 0  # the field is closed after the run
                    bad = ((before == 0) & ~_is_separator(a[start - 1])) | (closed & ~_is_separator(a[start + length]))
                    if bad.any():
                        return True
                    odd = (odd + q.size) % 2
                if eof:
                    return bool(odd)   # a quote never closed: the readers disagree on where the cell ends
                ctx, pending = buf[keep - 1 : keep], buf[keep:]
    except OSError:
        return False   # the csv reader then reports why it cannot read the file


def _read_kernels_polars(path: Path, header: list[str], cm: ColumnMap, log: _ProblemLog,
                         strict: bool) -> KernelTable | None:
    """The fast path for well-formed files. It returns None (the csv reader then reads the file, names
    the bad rows by physical line and is the reference for what is kept) whenever the file is not
    clean: ragged rows, a quote in the header, no rows, or any numeric cell that is not a finite
    number (which includes blank lines, read by polars as rows of nulls)."""
    if any('"' in h for h in header):
        return None   # polars and the csv module disagree on where such a header ends
    try:
        import polars as pl
    except ImportError:
        if strict:
            log.add(str(path), "polars is not installed; read with the csv module")
        return None
    fname = str(path)
    fields = {f: i for f, i in cm.index.items() if f in KERNEL_FIELDS_READ}
    from npufuse.profile.pipes import metric_columns

    # the pipe utilisation columns ride along in the same read (a pass of their own cost 0.75 s CPU
    # at 1M rows, these ~0.35 s)
    comp_ix, mem_ix = metric_columns(header)
    # by position, not name (duplicate headers); plus the header's last column, to spot short rows
    idx = sorted(set(fields.values()) | {len(header) - 1} | set(comp_ix) | set(mem_ix))
    try:
        # everything as text: numeric columns are validated below so bad cells name their row
        df = pl.read_csv(path, columns=idx, infer_schema=False, encoding="utf8-lossy",
                         quote_char='"', raise_if_empty=False)
    except Exception:   # polars raises several error types for ragged/corrupt files
        return None     # the csv path re-reads it and names the broken row
    if len(df.columns) != len(idx):
        return None
    # polars must have seen the same header as the csv module (it keeps surrounding whitespace and
    # renames a repeated header "<name>_duplicated_<k>")
    name_at = dict(zip(idx, df.columns))
    if any(name_at[i] != header[i] and not name_at[i].startswith(f"{header[i]}_duplicated_") for i in idx):
        return None
    by_field = {f: name_at[i] for f, i in fields.items()}
    n = df.height
    if n == 0:
        return None

    def empty(name: str) -> Any:
        s = df[name]
        return s.is_null() | (s == "")

    # polars fills the cells a short row lacks with nulls and says nothing; the csv reader names a
    # row that stops before a column read here. Such a row has that column and every later one
    # empty, so it is among the rows whose last column read and last column are both empty: a file
    # with any (also a row of genuinely empty cells there) goes to the csv reader.
    # a row missing a middle cell also ends with an empty last column (issue 18): the csv reader
    # then names it instead of polars reading its cells shifted
    short = empty(name_at[len(header) - 1])
    if short.any():
        return None

    def num(fld: str, required: bool) -> np.ndarray:
        raw = df[by_field[fld]]
        if required and raw.null_count() == 0:
            # fast path: every cell a plain number (no blanks, no tab): one cast, no copy of the text
            try:
                v = raw.cast(pl.Float64, strict=True)
                if bool(((v.abs() <= MAX_NUMBER) & ~v.is_nan()).all()):
                    return v.to_numpy().astype(np.float64, copy=False)
            except pl.exceptions.InvalidOperationError:
                pass
        s = raw.str.strip_chars()
        v = s.cast(pl.Float64, strict=False)
        bad = ~((v.abs() <= MAX_NUMBER) & ~v.is_nan()).fill_null(False)   # as parse_number
        if not required:
            bad = bad & s.is_not_null() & ~s.is_in(list(UNKNOWN_CELLS))
        if bad.any():
            raise _Fallback
        return v.fill_null(float("nan")).to_numpy().astype(np.float64, copy=False)

    def codes(fld: str) -> tuple[list[str], np.ndarray]:
        return codes_of(df[by_field[fld]])

    def ints(fld: str, default: int) -> np.ndarray:
        # as parse_int: integer text exactly, else a finite float truncated, else the default
        raw = df[by_field[fld]]
        if raw.null_count() == 0:
            try:   # fast path: every cell plain integer text
                return raw.cast(pl.Int64, strict=True).to_numpy().astype(np.int64, copy=False)
            except pl.exceptions.InvalidOperationError:
                pass
        s = raw.str.strip_chars()
        f = s.cast(pl.Float64, strict=False)
        exact = s.cast(pl.Int64, strict=False)
        fits = f.is_finite().fill_null(False) & (f.abs() < float(_INT64)).fill_null(False)
        if (s.is_not_null() & exact.is_null() & ~fits & ~s.is_in(list(UNKNOWN_CELLS))).any():
            raise _Fallback
        ok = fits.to_numpy()
        out = np.full(n, default, dtype=np.int64)
        out[ok] = f.to_numpy()[ok].astype(np.int64)
        has = exact.is_not_null().to_numpy()
        out[has] = exact.fill_null(0).to_numpy()[has]
        return out

    try:
        dur = num("duration", True)
        start = num("start", True) if "start" in by_field else np.arange(n, dtype=np.float64)
        wait = num("wait", False) if "wait" in by_field else None
        stream = ints("stream", 0) if "stream" in by_field else np.zeros(n, dtype=np.int64)
        step = ints("step", -1) if "step" in by_field else None
    except _Fallback:
        return None
    if "type" in by_field:
        types, tcode = codes("type")
    else:
        names_, ncode_ = codes("name")
        types, tcode = _encode([_type_from_name(x) for x in names_])
        tcode = tcode[ncode_]
    names, ncode = codes("name") if "name" in by_field else ([], None)
    if "type" in by_field and "name" in by_field and ncode is not None \
            and any(t.strip() in NO_TYPE_CELLS for t in types):
        # rows with an empty or N/A Type cell (all of Level0): take the type from the kernel name
        fixed = list(types)
        remap = np.arange(len(types), dtype=np.int32)
        empties = [k for k, t in enumerate(types) if t.strip() in NO_TYPE_CELLS]
        rows = np.flatnonzero(np.isin(tcode, empties))
        for nc in np.unique(ncode[rows]).tolist():
            t = _type_from_name(names[nc])
            if t not in fixed:
                fixed.append(t)
            sel = rows[ncode[rows] == nc]
            tcode[sel] = fixed.index(t)
        del remap
        types = fixed
    shape_fields = [f for f in ("in_shapes", "in_dtypes", "out_shapes", "out_dtypes")]
    if any(f in by_field for f in shape_fields):
        # whichever of the four are present (the csv reader does the same); the others are empty
        key = df.select(pl.concat_str([pl.col(by_field[f]).fill_null("") if f in by_field else pl.lit("")
                                       for f in shape_fields], separator="\x1f")).to_series()
        skeys, scode = codes_of(key)
        shape_keys = [tuple(k.split("\x1f")) for k in skeys]  # type: ignore[misc]
        if any(len(k) != 4 for k in shape_keys):
            return None   # a cell holds the separator itself: the csv reader keeps it intact
    else:
        shape_keys, scode = [("", "", "", "")], np.zeros(n, dtype=np.int32)
    table = KernelTable(source=fname, types=types, type_code=tcode.astype(np.int32), start=start, dur=dur,
                        wait=wait, stream=stream, step=step, shape_keys=shape_keys,  # type: ignore[arg-type]
                        shape_code=scode, names=names, name_code=ncode, columns=cm, backend="polars")
    if comp_ix or mem_ix:
        table.pipe_compute = _busiest(df, [name_at[i] for i in comp_ix], n)
        table.pipe_memory = _busiest(df, [name_at[i] for i in mem_ix], n)
    return table


def _busiest(df: Any, cols: list[str], n: int) -> np.ndarray:
    """Per row, the largest of these ratio columns (a ratio outside 0..1 or not a number: unknown)."""
    import polars as pl

    out = np.full(n, np.nan)
    for c in cols:
        # no strip: a ratio cell padded with blanks is unknown here and in the csv reader alike
        v = df[c].cast(pl.Float64, strict=False).to_numpy().astype(np.float64, copy=False)
        v = np.where((v >= 0) & (v <= 1), v, np.nan)
        out = np.fmax(out, v)
    return out


def codes_of(series: Any) -> tuple[list[str], np.ndarray]:
    """Integer codes of a polars string Series and its vocabulary (first-seen order).

    Casting to an Enum of the distinct values is ~20x faster than a dense rank."""
    import polars as pl

    s = series.fill_null("")
    vocab = s.unique(maintain_order=True).to_list()
    return vocab, s.cast(pl.Enum(vocab)).to_physical().to_numpy().astype(np.int32)


# ------------------------------------------------------------------------------------ other CSVs

def _read_rows(path: Path, aliases: dict[str, tuple[str, ...]], need: Iterable[str],
               log: _ProblemLog) -> tuple[ColumnMap | None, list[tuple[int, dict[str, str]]]]:
    fname = str(path)
    rows: list[tuple[int, dict[str, str]]] = []
    try:
        with open(path, newline="", encoding="utf-8-sig", errors="replace") as fp:
            reader = csv.reader(fp)
            header = next(reader, None)
            if not header or not any(h.strip() for h in header):
                log.add(fname, "empty file (no header row)")
                return None, []
            cm = resolve_columns(header, aliases)
            missing = [aliases[f][0] for f in need if f not in cm.index]
            if missing:
                log.add(fname, f"missing column(s) {', '.join(missing)}; file not used", row=1)
                return None, []
            for row in reader:
                if not row:
                    continue
                if len(row) < len(header) and max(cm.index.values()) >= len(row):
                    log.add(fname, f"row has {len(row)} fields, header has {len(header)} (truncated?); skipped",
                            row=reader.line_num, kind="short row")
                    continue
                rows.append((reader.line_num, {f: row[i] for f, i in cm.index.items()}))
    except csv.Error as exc:
        log.add(fname, f"CSV parse error: {exc}; rows after it were not read")
        return None, rows
    except OSError as exc:
        log.add(fname, f"cannot read: {exc.strerror or exc}")
        return None, []
    return cm, rows


def _num(v: str, fname: str, line: int, column: str, log: _ProblemLog) -> float | None:
    f = parse_number(v)
    if f is None:
        log.add(fname, f"{_not_a_number(v)}; cell ignored", row=line, column=column,
                kind="not a number")
    return f


@dataclass
class StepTimes:
    source: str
    steps: dict[int, dict[str, float]]   # step -> {"stage", "computing", "free", ...}
    columns: ColumnMap


def read_step_trace_time(path: Path) -> tuple[StepTimes | None, list[Problem]]:
    """Per-step totals (Stage = step time, Free = device idle) from step_trace_time.csv."""
    log = _ProblemLog()
    cm, rows = _read_rows(path, STEP_ALIASES, ("stage",), log)
    if cm is None:
        return None, log.finish()
    steps: dict[int, dict[str, float]] = {}
    for k, (line, r) in enumerate(rows):
        sid = parse_int(r.get("step") or k + 1, k + 1)
        vals = {}
        for f in ("stage", "computing", "free", "communication"):
            if f in r:
                v = _num(r[f], str(path), line, cm.used[f], log)
                if v is not None:
                    vals[f] = v
        if "stage" in vals and not vals["stage"] >= MIN_TIME_US:
            # shares divide by the step time: zero, negative or sub-nanosecond is not one
            log.add(str(path), f"{_show(r['stage'])} is not a step time (below {MIN_TIME_US:g} us); row not counted",
                    row=line, column=cm.used["stage"], kind="not a step time")
            continue
        if "stage" in vals:
            # several devices in one file: add up per step
            cur = steps.setdefault(sid, {})
            for f, v in vals.items():
                cur[f] = cur.get(f, 0.0) + v
    return StepTimes(str(path), steps, cm), log.finish()


@dataclass
class OpStatistic:
    source: str
    rows: list[dict[str, Any]]   # {"type", "core", "count", "total_us"}
    columns: ColumnMap


def read_op_statistic(path: Path) -> tuple[OpStatistic | None, list[Problem]]:
    """Kernel totals by OP Type: used for totals when kernel_details.csv is absent."""
    log = _ProblemLog()
    cm, rows = _read_rows(path, OP_STAT_ALIASES, ("type", "total"), log)
    if cm is None:
        return None, log.finish()
    out = []
    for line, r in rows:
        total = _num(r["total"], str(path), line, cm.used["total"], log)
        if total is None:
            continue
        count = _num(r.get("count", "0") or "0", str(path), line, cm.used.get("count", "Count"), log) or 0
        out.append({"type": r["type"], "core": r.get("core", ""), "count": int(count), "total_us": total})
    return OpStatistic(str(path), out, cm), log.finish()


@dataclass
class OperatorDetails:
    source: str
    rows: int
    with_stack: int
    columns: ColumnMap


def read_operator_details(path: Path) -> tuple[OperatorDetails | None, list[Problem]]:
    """Only summarised: it tells whether the run recorded call stacks (with_stack=True)."""
    log = _ProblemLog()
    cm, rows = _read_rows(path, OPERATOR_ALIASES, ("name",), log)
    if cm is None:
        return None, log.finish()
    with_stack = sum(1 for _, r in rows if r.get("stack", "").strip())
    return OperatorDetails(str(path), len(rows), with_stack, cm), log.finish()


# ------------------------------------------------------------------------------------ trace

def read_trace_view(path: Path) -> tuple[list[dict[str, Any]] | None, list[Problem]]:
    """The chrome-trace event list of trace_view.json (a list, or {"traceEvents": [...]})."""
    fname = str(path)
    try:
        with open(path, "rb") as fp:
            data = json.load(fp)
    except json.JSONDecodeError as exc:
        return None, [Problem(fname, f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                              row=exc.lineno)]
    except UnicodeDecodeError as exc:
        return None, [Problem(fname, f"not valid JSON: bad encoding at byte {exc.start}")]
    except OSError as exc:
        return None, [Problem(fname, f"cannot read: {exc.strerror or exc}")]
    if isinstance(data, dict):
        data = data.get("traceEvents")
    if not isinstance(data, list):
        return None, [Problem(fname, "not a chrome trace: expected a list of events or {\"traceEvents\": [...]}")]
    events = [e for e in data if isinstance(e, dict)]
    probs = []
    if len(events) < len(data):
        probs.append(Problem(fname, f"{len(data) - len(events)} entries are not event objects; ignored"))
    return events, probs


# ------------------------------------------------------------------------------------ discovery

@dataclass
class RankSource:
    """The files of one rank (one *_ascend_pt result, or a bare CSV)."""

    label: str                 # what the user passed / the folder name
    rank: int | None
    files: dict[str, Path]     # known file name -> path

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "rank": self.rank, "files": {k: str(v) for k, v in self.files.items()}}


def _rank_of(output_dir: Path) -> int | None:
    root = output_dir.parent if output_dir.name == OUTPUT_DIR else output_dir
    for info in sorted(root.glob("profiler_info*.json")):
        try:
            with open(info, encoding="utf-8") as fp:
                rid = json.load(fp).get("rank_id")
            if isinstance(rid, int) and rid >= 0:
                return rid
        except (OSError, ValueError, AttributeError):
            pass
        m = re.search(r"profiler_info_(\d+)\.json$", info.name)
        if m:
            return int(m.group(1))
    return None


PROFILER_DB = "profiler.db"   # role of ascend_pytorch_profiler*.db (the sqlite export)


def _files_in(d: Path) -> dict[str, Path]:
    found = {name: d / name for name in KNOWN_FILES if (d / name).is_file()}
    dbs = sorted(x for x in d.glob("ascend_pytorch_profiler*.db") if x.is_file())
    if dbs:
        found[PROFILER_DB] = dbs[0]
    return found


def discover(paths: list[str]) -> tuple[list[RankSource], list[Problem]]:
    """Find profiler results under each path: *_ascend_pt folders, ASCEND_PROFILER_OUTPUT folders,
    a flat folder of the known files, or one file (a bare kernel_details.csv / trace_view.json)."""
    sources: list[RankSource] = []
    problems: list[Problem] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            problems.append(Problem(raw, "no such file or directory"))
            continue
        if p.is_file():
            role = p.name if p.name in KNOWN_FILES else ("trace_view.json" if p.suffix == ".json"
                                                         else PROFILER_DB if p.suffix == ".db"
                                                         else "kernel_details.csv")
            sources.append(RankSource(raw, None, {role: p}))
            continue
        found: list[Path] = []
        direct = _files_in(p)
        if direct:
            found.append(p)
        else:
            for dirpath, dirnames, _ in os.walk(p):
                dirnames.sort()
                depth = Path(dirpath).relative_to(p).parts
                if len(depth) > 5:   # profiler results sit a few levels down at most
                    dirnames[:] = []
                    continue
                d = Path(dirpath)
                if d.name == OUTPUT_DIR or (d != p and _files_in(d) and d.parent.name != OUTPUT_DIR):
                    if _files_in(d):
                        found.append(d)
                        dirnames[:] = []
        if not found:
            problems.append(Problem(raw, f"no Ascend profiler output here (looked for {OUTPUT_DIR}/ with "
                                         f"{', '.join(KNOWN_FILES)})"))
            continue
        for d in found:
            label = str(d.parent if d.name == OUTPUT_DIR else d)
            sources.append(RankSource(label, _rank_of(d), _files_in(d)))
    # ranks must be distinct: unknown or clashing ones get the next free number
    used: set[int] = set()
    for s in sources:
        if s.rank is not None and s.rank not in used:
            used.add(s.rank)
        else:
            s.rank = None
    nxt = 0
    for s in sources:
        if s.rank is None:
            while nxt in used:
                nxt += 1
            s.rank = nxt
            used.add(nxt)
    return sources, problems
