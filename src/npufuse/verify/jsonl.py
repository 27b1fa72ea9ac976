"""Per-step JSONL (DESIGN.md): writing line by line, reading back, merging two runs.

Each record is one line ``{"candidate": 1, "run": "baseline"|"fused", "step": 1, "loss": 2.31,
"step_time": 0.145, ...}``, written and flushed as soon as the step is parsed, so a run that is
killed leaves every completed step on disk. A torn last line (the writer killed mid-write) is
skipped on reading. NaN/Inf, which JSON lacks, are the strings ``"nan"``, ``"inf"``, ``"-inf"``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import IO, Any, Iterable


class JsonlWriter:
    """Appends one flushed line per record (``truncate=True`` starts the file afresh)."""

    def __init__(self, path: Path, truncate: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: IO[str] | None = open(self.path, "w" if truncate else "a", encoding="utf-8")
        self.count = 0

    def write(self, record: dict[str, Any]) -> None:
        assert self._fh is not None
        self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())  # a step on disk is a step the resume can trust
        self.count += 1

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def number(v: Any) -> float | None:
    """A loss/step-time field as float (``"nan"``/``"inf"`` strings included); None if absent."""
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of ``path`` in file order. Raises ``OSError`` if unreadable and ``ValueError``
    for a malformed line that is not the last one (a torn last line is ignored)."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.splitlines()
    out: list[dict[str, Any]] = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) and not text.endswith("\n"):
                break  # torn last line of a killed writer
            raise ValueError(f"{path}:{i}: not a JSON object") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or isinstance(rec.get("step"), bool):
            raise ValueError(f"{path}:{i}: a record needs an integer `step`")
        out.append(rec)
    return out


def first_per_step(records: Iterable[dict[str, Any]], run: str | None = None) -> list[dict[str, Any]]:
    """The first record of each step (of ``run`` only, if given), sorted by step."""
    out: dict[int, dict[str, Any]] = {}
    for rec in records:
        if run is None or rec.get("run") in (None, run):
            out.setdefault(rec["step"], rec)
    return [out[k] for k in sorted(out)]


def read_jsonl(path: Path, run: str | None = None) -> list[dict[str, Any]]:
    """``first_per_step(read_records(path), run)``."""
    return first_per_step(read_records(path), run)


def _runs_in(records: Iterable[dict[str, Any]]) -> set[str]:
    return {str(r["run"]) for r in records if r.get("run")}


def merge_runs(baseline: list[dict[str, Any]], fused: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics array of the HTML report, one object per step present in either run::

        [{"step": n, "baseline_loss": .., "fused_loss": .., "baseline_step_time": .., "fused_step_time": ..}, ...]

    sorted by step; a value a run lacks (step missing, no step time) is null, and so is a
    non-finite loss (JSON has no NaN; the report shows the gap). Optional per-step fields present
    in the records (grad_norm, tokens_per_s, memory, ...) are carried as ``baseline_<f>``/``fused_<f>``.
    """
    core = {"candidate", "run", "step", "loss", "step_time", "step_time_source"}
    b = {r["step"]: r for r in baseline}
    f = {r["step"]: r for r in fused}
    extras = sorted({k for r in (*baseline, *fused) for k in r if k not in core})
    rows = []
    for step in sorted(set(b) | set(f)):
        row: dict[str, Any] = {"step": step}
        for prefix, recs in (("baseline", b), ("fused", f)):
            r = recs.get(step, {})
            row[f"{prefix}_loss"] = _finite(number(r.get("loss")))
            row[f"{prefix}_step_time"] = _finite(number(r.get("step_time")))
        for k in extras:
            for prefix, recs in (("baseline", b), ("fused", f)):
                v = recs.get(step, {}).get(k)
                row[f"{prefix}_{k}"] = _finite(v) if isinstance(v, float) else v
        rows.append(row)
    return rows


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def load_pair(base: Path, fused: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The two runs from two files. A file holding records of both runs (``run`` field)
    contributes only its matching run, so ``merge-jsonl ALL.jsonl ALL.jsonl`` works too."""
    b_all = read_records(base)
    f_all = b_all if Path(fused).resolve() == Path(base).resolve() else read_records(fused)
    b_run = "baseline" if len(_runs_in(b_all)) > 1 else None
    f_run = "fused" if len(_runs_in(f_all)) > 1 else None
    return first_per_step(b_all, b_run), first_per_step(f_all, f_run)
