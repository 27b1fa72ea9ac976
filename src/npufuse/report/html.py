"""The validation report: one self-contained HTML page for one or more candidates.

Two steps over plain data, so each can be tested alone:

* :func:`build_report_data` reads ``.npufuse/state.json`` (status, evidence, verdict),
  ``.npufuse/scan.json`` (the code change) and per-step JSONL (DESIGN.md format) and returns
  ``REPORT_DATA``: one JSON-safe dict holding everything the page shows.
* :func:`render_html` turns it into the page: jinja2 with autoescape on renders every table and
  text server-side (the numbers are in the DOM without JavaScript); the same dict is embedded
  once as ``<script type="application/json" id="report-data">`` and the bundled uPlot draws the
  charts from it. Nothing is fetched: uPlot, its CSS and the page script are inlined, and a
  Content-Security-Policy allows only those two scripts (by hash) and no network at all.

Text from the user's repository (file names, code, reasons) only ever reaches the page through
autoescaped ``{{ }}`` or inside the JSON block, where ``<``, ``>`` and ``&`` are written as
``\\u003c`` etc. so no ``</script>`` can end the block early.

The evidence written by ``npufuse verify`` is read tolerantly (see ``_OP_METRICS`` and the
``_first`` calls): unknown keys are shown as plain key/value rows rather than dropped, so a new
field appears in the report without a change here.
"""

from __future__ import annotations

import base64
import dataclasses
import difflib
import hashlib
import json
import math
import re
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

from npufuse import __version__

UPLOT_VERSION = "1.6.32"
SCHEMA = "npufuse.report/1"
# Used only when neither the perf nor the e2e evidence says how many steps were warm-up; the
# first steps of a run carry compilation and allocator warm-up that would swamp a histogram.
DEFAULT_WARMUP = 5
RUNS = ("baseline", "fused")

STATUS_LABELS = {
    "pending": "pending",
    "accuracy_checking": "accuracy checking",
    "accuracy_failed": "accuracy failed",
    "e2e_checking": "e2e checking",
    "e2e_failed": "e2e failed",
    "perf_checking": "perf checking",
    "concluded": "concluded",
    "not_applied": "not applied",
}

# Canonical op-check metric -> the names a verifier might use for it.
_OP_METRICS: dict[str, tuple[str, ...]] = {
    "cosine": ("cosine", "cos", "cosine_similarity", "cos_sim"),
    "max_abs": ("max_abs", "max_abs_err", "max_abs_error", "max_abs_diff"),
    "max_rel": ("max_rel", "max_rel_err", "max_rel_error", "max_rel_diff"),
    "row_agreement": ("row_agreement", "rowwise_agreement", "row_wise_agreement", "rowwise", "row_match"),
}
_PASS_KEYS = ("passed", "pass", "ok", "accepted")
_ROW_LIST_KEYS = ("checks", "results", "tensors", "rows", "metrics", "comparisons")


class ReportInputError(ValueError):
    """Unusable input (missing or malformed state/scan/JSONL); one line naming the file."""


# -- small readers ---------------------------------------------------------------------------------


def _first(d: dict[str, Any] | None, *keys: str, default: Any = None) -> Any:
    """The value of the first of ``keys`` present in ``d`` (verifiers name things differently)."""
    if not isinstance(d, dict):
        return default
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(v: Any) -> float | None:
    """A finite float, else None (NaN/Inf cannot go into JSON and are reported separately)."""
    if _is_num(v) and math.isfinite(v):
        return float(v)
    return None


def _passed(d: Any) -> bool | None:
    if not isinstance(d, dict):
        return None
    v = _first(d, *_PASS_KEYS)
    if isinstance(v, bool):
        return v
    result = _first(d, "result", "outcome")
    if isinstance(result, str):
        low = result.strip().lower()
        if low in ("pass", "passed", "ok"):
            return True
        if low in ("fail", "failed", "error"):
            return False
    return None


def _jsonable(v: Any) -> Any:
    """Plain JSON: non-finite floats become their text ("nan"), so the page can still show them."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return str(v)


def _details(d: dict[str, Any] | None, skip: Iterable[str] = ()) -> list[list[Any]]:
    """Key/value rows of an evidence dict, so fields this renderer does not know still show."""
    if not isinstance(d, dict):
        return []
    skipped = set(skip)
    rows = []
    for k, v in d.items():
        if k in skipped:
            continue
        if isinstance(v, dict) and v and all(not isinstance(x, (dict, list)) for x in v.values()):
            rows += [[f"{k}.{sub}", _jsonable(x)] for sub, x in v.items()]
            continue
        if isinstance(v, (dict, list)):
            v = json.dumps(_jsonable(v), ensure_ascii=False, sort_keys=True)
        rows.append([str(k), _jsonable(v)])
    return rows


def _backend_of(d: Any) -> str | None:
    """"emulated", "npu" or the recorded backend text; None when the section says nothing."""
    if not isinstance(d, dict):
        return None
    if d.get("emulated") is True:
        return "emulated"
    for key in ("backend", "device_backend", "torch_npu", "torch_npu_version"):
        v = d.get(key)
        if isinstance(v, str) and v.strip():
            low = v.strip().lower()
            if "emul" in low:
                return "emulated"
            if low == "none":  # the probe saw no torch_npu import: says nothing about a backend
                continue
            return "npu (real torch_npu)" if low == "real" else v.strip()
    if d.get("emulated") is False:
        return "npu"
    return None


# -- inputs ----------------------------------------------------------------------------------------


def _load_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ReportInputError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{path}: the {what} is not valid JSON ({exc})") from exc


def load_state_candidates(state_dir: Path) -> tuple[list[dict[str, Any]], str]:
    """The candidates of ``state.json`` as plain dicts (none if the file is absent) and its scan hash."""
    from npufuse.state import State

    try:
        state = State.load(state_dir)
    except (ValueError, TypeError, KeyError) as exc:
        # State.load names the file for unreadable JSON; a wrong shape gets the name added here.
        text = str(exc)
        raise ReportInputError(text if str(state_dir) in text else f"{Path(state_dir) / 'state.json'}: {text}") from exc
    return [dataclasses.asdict(c) for _, c in sorted(state.candidates.items())], state.scan_sha256


def load_scan(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = _load_json(path, "scan")
    if not isinstance(data, dict) or not isinstance(data.get("candidates", []), list):
        raise ReportInputError(f"{path}: not a scan.json (no candidates list)")
    return data


@dataclasses.dataclass
class StepRecords:
    """Per-step records grouped by candidate, with what was wrong in the files."""

    by_candidate: dict[int, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    unattributed: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    files: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)


def _number(v: Any) -> float | None | str:
    """A loss/step-time value: float (NaN/Inf included — the verifier writes them as the strings
    "nan"/"inf"/"-inf", JSON having none), None when absent, or the text "bad" when not a number."""
    if v is None:
        return None
    if _is_num(v):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            pass
    return "bad"


def _step_record(obj: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(normalised record, None), (None, problem), or (None, None) for a line that is not a
    per-step record at all."""
    if not isinstance(obj, dict) or "run" not in obj or "step" not in obj:
        return None, None
    if obj["run"] == "joint" and "candidate" not in obj:
        return None, None  # `verify e2e --all`'s joint run: in e2e_all.json and each candidate's e2e_joint, not one candidate's curve
    if obj["run"] not in RUNS:
        return None, f'"run" is {obj["run"]!r}, expected "baseline" or "fused"'
    if not isinstance(obj["step"], int) or isinstance(obj["step"], bool):
        return None, f'"step" is {obj["step"]!r}, expected an integer'
    if "candidate" in obj and (not isinstance(obj["candidate"], int) or isinstance(obj["candidate"], bool)):
        return None, f'"candidate" is {obj["candidate"]!r}, expected an integer id'
    rec = dict(obj)
    for key in ("loss", "step_time"):
        value = _number(obj.get(key))
        if value == "bad":
            return None, f'"{key}" is {obj[key]!r}, expected a number'
        rec[key] = value
    return rec, None


def _metrics_rows(data: Any) -> tuple[int | None, list[dict[str, Any]]] | None:
    """``npufuse merge-jsonl`` output — ``[{"step", "baseline_loss", "fused_loss",
    "baseline_step_time", "fused_step_time", "baseline_<f>", ...}]``, bare or as
    ``{"candidate": N, "metrics": [...]}`` — as per-step records; None if it is not that."""
    cid = None
    if isinstance(data, dict):
        cid = data.get("candidate") if isinstance(data.get("candidate"), int) else None
        data = data.get("metrics", data.get("rows"))
    if not isinstance(data, list) or not all(isinstance(r, dict) and "step" in r for r in data):
        return None
    out = []
    for row in data:
        for run in RUNS:
            fields = {k[len(run) + 1 :]: v for k, v in row.items() if k.startswith(run + "_")}
            if not fields or all(v is None for v in fields.values()):
                continue  # this run has no such step
            out.append(dict(fields, run=run, step=row["step"], **({"candidate": cid} if cid is not None else {})))
    return cid, out


def read_jsonl(path: Path, records: StepRecords, *, strict: bool) -> None:
    """Add the per-step records of one file to ``records``: DESIGN.md JSONL, or the metrics
    array ``npufuse merge-jsonl`` writes.

    ``strict`` (a file the user named): a malformed line is an input error. Otherwise (found by
    looking around ``.npufuse/``) lines that are not per-step records — op-check logs share the
    folder — are skipped silently and malformed ones with a warning. Either way an unparsable
    *last* line without a newline is a run still writing (or killed mid-write): skipped, noted.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{path}: cannot read per-step records ({getattr(exc, 'strerror', None) or exc})") from exc
    records.files.append(str(path))
    lines: list[tuple[int, Any]] = []
    whole = None
    if text.lstrip().startswith("["):
        try:
            whole = _metrics_rows(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ReportInputError(f"{path}: looks like a JSON array but does not parse ({exc})") from exc
        if whole is None:
            raise ReportInputError(f"{path}: a JSON array, but not the metrics array of `npufuse merge-jsonl`")
        lines = [(0, r) for r in whole[1]]
    else:
        raw = text.split("\n")
        for n, line in enumerate(raw, start=1):
            if not line.strip():
                continue
            try:
                lines.append((n, json.loads(line)))
            except json.JSONDecodeError as exc:
                if n == len(raw):  # no trailing newline: a partial write
                    records.warnings.append(f"{path}:{n}: incomplete last line skipped (a run still writing, or killed mid-write)")
                    continue
                if strict:
                    raise ReportInputError(f"{path}:{n}: not a JSON object ({exc.msg})") from exc
                records.warnings.append(f"{path}:{n}: not JSON, skipped")
    for n, obj in lines:
        where = f"{path}:{n}" if n else str(path)
        rec, problem = _step_record(obj)
        if rec is None and problem is None:
            if strict:
                raise ReportInputError(f'{where}: not a per-step record (needs "run" and "step")')
            continue
        if problem:
            if strict:
                raise ReportInputError(f"{where}: {problem}")
            records.warnings.append(f"{where}: {problem}; skipped")
            continue
        assert rec is not None
        rec["_where"] = where
        if "candidate" in rec:
            records.by_candidate.setdefault(rec["candidate"], []).append(rec)
        elif strict:
            records.unattributed.append(rec)


def _evidence_jsonl_paths(cand: dict[str, Any]) -> list[str]:
    """JSONL files the verifier named in its evidence (any key ending in "jsonl")."""
    out: list[str] = []
    evidence = cand.get("evidence") or {}
    for section in evidence.values() if isinstance(evidence, dict) else ():
        if not isinstance(section, dict):
            continue
        for k, v in section.items():
            if not k.lower().endswith("jsonl"):
                continue
            for item in v if isinstance(v, list) else [v]:
                if isinstance(item, str) and item.strip():
                    out.append(item)
    return out


# -- per-candidate sections ------------------------------------------------------------------------


def _code_section(cid: int, scan_cand: dict[str, Any] | None, scan_present: bool, scan_path: Path) -> dict[str, Any]:
    if scan_cand is None:
        why = (
            f"{scan_path} is missing" if not scan_present else f"{scan_path} has no candidate {cid} with this key (scanned again since apply?)"
        )
        return {"present": False, "missing": f"The code change is not available: {why}. `npufuse scan PATH` writes it.", "diff": []}
    original = scan_cand.get("code") if isinstance(scan_cand.get("code"), str) else None
    replacement = scan_cand.get("replacement") if isinstance(scan_cand.get("replacement"), str) else None
    if replacement is None and original is None:
        return {"present": False, "missing": f"scan.json candidate {cid} carries neither its code nor a replacement.", "diff": []}
    line = scan_cand.get("line") if isinstance(scan_cand.get("line"), int) else 1
    diff = _diff_rows(original or "", replacement or "", line) if original and replacement else []
    return {
        "present": True,
        "original": original,
        "replacement": replacement,
        "diff": diff,
        "missing": None if replacement else "No replacement in scan.json: only the original code is shown.",
    }


def _diff_rows(old: str, new: str, first_line: int) -> list[list[Any]]:
    """Unified diff rows ``[tag, old_line_no | None, text]``; tag is " ", "-" or "+".

    Lines are matched ignoring indentation: the replacement keeps the original statements
    verbatim in its ``else`` branch, one level deeper, and a plain diff would show every one of
    them as removed and re-added. Matched lines are shown as in the replacement.
    """
    a = old.splitlines()
    b = new.splitlines()
    sm = difflib.SequenceMatcher(a=[x.strip() for x in a], b=[x.strip() for x in b], autojunk=False)
    rows: list[list[Any]] = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            for k in range(i2 - i1):
                rows.append([" ", first_line + i1 + k, b[j1 + k]])
            continue
        for k in range(i1, i2):
            rows.append(["-", first_line + k, a[k]])
        for k in range(j1, j2):
            rows.append(["+", None, b[k]])
    return rows


def _row_note(item: dict[str, Any]) -> str:
    parts = []
    if item.get("problem"):
        parts.append(str(item["problem"]))
    shape = item.get("shape")
    if isinstance(shape, list) and all(isinstance(x, int) for x in shape):
        parts.append("×".join(map(str, shape)) + (f" {item['dtype']}" if isinstance(item.get("dtype"), str) else ""))
    elif "problem" not in item:
        extra = [f"{k}={_jsonable(v)}" for k, v in item.items() if k in ("note", "notes", "reason", "detail")]
        parts += extra
    return "; ".join(parts)


def _op_rows(op: dict[str, Any]) -> list[dict[str, Any]]:
    raw: list[tuple[str | None, Any]] = []
    for key, kind in (("outputs", "forward"), ("forward", "forward"), ("grads", "backward"), ("gradients", "backward"), ("backward", "backward")):
        v = op.get(key)
        if isinstance(v, list):
            raw += [(kind, item) for item in v]
        elif isinstance(v, dict):
            raw += [(kind, dict(m, name=name) if isinstance(m, dict) else {"name": name, "value": m}) for name, m in v.items()]
    for key in _ROW_LIST_KEYS:
        v = op.get(key)
        if isinstance(v, list):
            raw += [(None, item) for item in v]
        elif isinstance(v, dict):
            raw += [(None, dict(m, name=name) if isinstance(m, dict) else {"name": name, "value": m}) for name, m in v.items()]
    rows = []
    known = {a for names in _OP_METRICS.values() for a in names} | set(_PASS_KEYS) | {"name", "tensor", "output", "kind", "phase", "direction"}
    for n, (kind, item) in enumerate(raw, start=1):
        if not isinstance(item, dict):
            continue
        item_kind = _first(item, "kind", "phase", "direction") or kind or ""
        low = str(item_kind).lower()
        if low.startswith(("grad", "back", "bwd")):
            item_kind = "backward"
        elif low.startswith(("out", "forw", "fwd")):
            item_kind = "forward"
        row = {
            "name": str(_first(item, "name", "tensor", "output", default=f"#{n}")),
            "kind": str(item_kind),
            "passed": _passed(item),
            # the column says what matters to a reader (the problem, the shape); every other field
            # of the record is in the raw records below the evidence, not a key=value dump here
            "note": _row_note(item),
            "raw": "; ".join(f"{k}={_jsonable(v)}" for k, v in item.items() if k not in known),
        }
        for metric, names in _OP_METRICS.items():
            v = _first(item, *names)
            row[metric] = _jsonable(v) if (_is_num(v) or v is None) else str(v)
        rows.append(row)
    return rows


def _op_section(cid: int, cand: dict[str, Any], applied: bool) -> dict[str, Any]:
    op = (cand.get("evidence") or {}).get("op")
    if not isinstance(op, dict) or not op:
        if not applied:
            missing = f"No operator check: the candidate is not applied yet. Run `npufuse apply --accept {cid}`, then `npufuse verify op {cid}`."
        elif cand.get("status") == "accuracy_checking":
            missing = f"An operator check was started but recorded no result (interrupted?). Rerun `npufuse verify op {cid}`."
        else:
            missing = f"No operator check yet. Run `npufuse verify op {cid}`."
        return {"present": False, "passed": None, "outcome": None, "rows": [], "details": [], "missing": missing, "backend": None}
    rows = _op_rows(op)
    passed = _passed(op)
    if passed is None and rows and all(r["passed"] is not None for r in rows):
        passed = all(r["passed"] for r in rows)
    skip = set(_PASS_KEYS) | {"outputs", "forward", "grads", "gradients", "backward", *_ROW_LIST_KEYS}
    outcome = op.get("outcome") if op.get("outcome") in ("passed", "failed", "not checked") else None
    if op.get("skipped") and passed is None:
        outcome = "not applicable"
    return {
        "present": True,
        "passed": passed if outcome != "not checked" else None,
        "outcome": outcome or ("passed" if passed is True else "failed" if passed is False else None),
        "rows": rows,
        "details": _details(op, skip=skip),
        "missing": None if rows else "The op evidence holds no per-tensor rows; its fields are listed below.",
        "backend": _backend_of(op),
    }


def _dedupe(records: list[dict[str, Any]], warnings: list[str], cid: int) -> dict[str, dict[int, dict[str, Any]]]:
    """run -> step -> record. A step recorded twice (a resumed run, or the same run in two
    files) keeps its first record, as ``npufuse.verify.jsonl`` does: the verdict was computed
    on those."""
    out: dict[str, dict[int, dict[str, Any]]] = {r: {} for r in RUNS}
    dupes = 0
    for rec in records:
        steps = out[rec["run"]]
        if rec["step"] in steps:
            dupes += 1
        else:
            steps[rec["step"]] = rec
    if dupes:
        warnings.append(f"candidate {cid}: {dupes} step(s) recorded more than once (a resumed run?); the first record of each is shown")
    return out


def _series(runs: dict[str, dict[int, dict[str, Any]]], warmup: int) -> dict[str, Any]:
    steps = sorted(set(runs["baseline"]) | set(runs["fused"]))

    def col(run: str, key: str) -> list[float | None]:
        return [_finite(runs[run][s].get(key)) if s in runs[run] else None for s in steps]

    base_loss, fused_loss = col("baseline", "loss"), col("fused", "loss")
    rel = []
    for b, f in zip(base_loss, fused_loss):
        rel.append(None if b is None or f is None or b == 0 else (f - b) / abs(b) * 100.0)
    nonfinite = {
        run: [s for s, r in sorted(runs[run].items()) if isinstance(r.get("loss"), float) and not math.isfinite(r["loss"])] for run in RUNS
    }
    return {
        "steps": steps,
        "baseline_loss": base_loss,
        "fused_loss": fused_loss,
        "rel_diff_pct": rel,
        "baseline_time": col("baseline", "step_time"),
        "fused_time": col("fused", "step_time"),
        # steps < warmup_end are warm-up: steps <= warmup, as npufuse.verify.stats counts them
        "warmup_end": warmup + 1,
        "nonfinite_loss": nonfinite,
    }


def _quantile(sorted_vals: list[float], q: float) -> float:
    pos = (len(sorted_vals) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _run_summary(runs: dict[str, dict[int, dict[str, Any]]], warmup_end: int) -> list[dict[str, Any]]:
    out = []
    for run in RUNS:
        recs = [r for _, r in sorted(runs[run].items())]
        if not recs:
            continue
        times = sorted(t for r in recs if r["step"] >= warmup_end and (t := _finite(r.get("step_time"))) is not None)
        mem = [m for r in recs if (m := _finite(_first(r, "memory", "peak_memory", "max_memory"))) is not None]
        tps = sorted(t for r in recs if r["step"] >= warmup_end and (t := _finite(r.get("tokens_per_s"))) is not None)
        out.append({
            "run": run,
            "steps": len(recs),
            "last_step": recs[-1]["step"],
            # the last step's loss as recorded: a run that ended on NaN must not show an earlier value
            "final_loss": _jsonable(recs[-1].get("loss")) if _is_num(recs[-1].get("loss")) else None,
            "timed_steps": len(times),
            "median_time": _quantile(times, 0.5) if times else None,
            "p10_time": _quantile(times, 0.1) if times else None,
            "p90_time": _quantile(times, 0.9) if times else None,
            "median_tokens_per_s": _quantile(tps, 0.5) if tps else None,
            "max_memory": max(mem) if mem else None,
        })
    return out


def _histogram(runs: dict[str, dict[int, dict[str, Any]]], warmup_end: int) -> dict[str, Any] | None:
    """Common bins for both runs' post-warm-up step times (so the two shapes compare)."""
    vals = {
        run: [t for s, r in runs[run].items() if s >= warmup_end and (t := _finite(r.get("step_time"))) is not None] for run in RUNS
    }
    every = vals["baseline"] + vals["fused"]
    if not every:
        return None
    lo, hi = min(every), max(every)
    bins = max(5, min(30, math.ceil(math.sqrt(len(every)))))
    if hi <= lo:  # every time equal: one visible bin around the value
        lo, hi, bins = lo * 0.99, hi * 1.01 if hi else 1e-9, 1
    width = (hi - lo) / bins
    edges = [lo + k * width for k in range(bins + 1)]
    counts = {}
    for run in RUNS:
        c = [0] * bins
        for t in vals[run]:
            c[min(bins - 1, int((t - lo) / width))] += 1
        counts[run] = c
    return {"edges": edges, "baseline": counts["baseline"], "fused": counts["fused"]}


def _warmup(cand: dict[str, Any]) -> tuple[int, bool]:
    """(warm-up steps, assumed?) from the perf evidence, else the e2e evidence, else the default."""
    evidence = cand.get("evidence") or {}
    for section in ("perf", "e2e"):
        v = _first(evidence.get(section), "warmup", "warmup_steps", "warm_up", "skip_steps")
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v, False
    return DEFAULT_WARMUP, True


def _time_scale(series: dict[str, Any]) -> tuple[str, float]:
    times = [t for t in series["baseline_time"] + series["fused_time"] if t is not None]
    if times and max(times) < 1.0:
        return "ms", 1000.0
    return "s", 1.0


def _e2e_section(cid: int, cand: dict[str, Any], op: dict[str, Any], runs: dict[str, dict[int, Any]], looked_in: str) -> dict[str, Any]:
    e2e = (cand.get("evidence") or {}).get("e2e")
    present = isinstance(e2e, dict) and bool(e2e)
    have = {run: len(runs[run]) for run in RUNS}
    missing = None
    if op.get("passed") is False and not present and not any(have.values()):
        missing = "Not run: the operator check failed, which ends this candidate's validation."
    elif not present and not any(have.values()):
        if not op.get("present"):
            missing = f'Not run yet: first `npufuse verify op {cid}`, then `npufuse verify e2e {cid} --cmd "<your launch command>"`.'
        elif cand.get("status") in ("e2e_checking", "perf_checking"):
            missing = (
                f"An end-to-end run was started but no per-step records for candidate {cid} were found ({looked_in}): "
                f'interrupted, or its JSONL is elsewhere (`--jsonl FILE`). `npufuse verify e2e {cid} --cmd "..."` resumes it.'
            )
        else:
            missing = f'No end-to-end run yet. Run `npufuse verify e2e {cid} --cmd "<your launch command>"`.'
    elif not any(have.values()):
        missing = f"The e2e evidence is recorded but no per-step JSONL for candidate {cid} was found ({looked_in}); pass it with `--jsonl FILE`."
    elif not have["fused"]:
        missing = f"Only the baseline run has steps; the fused run has none yet (`npufuse verify e2e {cid}` resumes it)."
    elif not have["baseline"]:
        missing = "Only the fused run has steps; the baseline run has none."
    skip = set(_PASS_KEYS) | {k for k in (e2e or {}) if k.lower().endswith("jsonl")}
    return {
        "present": present,
        "passed": _passed(e2e) if present else None,
        "details": _details(e2e, skip=skip) if present else [],
        "missing": missing,
        "steps": have,
        "backend": _backend_of(e2e),
    }


def _perf_section(cid: int, cand: dict[str, Any], e2e: dict[str, Any], has_times: bool) -> dict[str, Any]:
    perf = (cand.get("evidence") or {}).get("perf")
    present = isinstance(perf, dict) and bool(perf)
    missing = None
    if not present:
        if e2e.get("passed") is False or cand.get("status") == "e2e_failed":
            missing = "Not measured: the end-to-end loss check failed; step time is compared only once the loss matches."
        elif has_times:
            missing = (
                f"No step-time verdict recorded yet (`npufuse verify e2e {cid}` writes it after the loss check); "
                "the charts show the raw per-step times."
            )
        else:
            missing = f'No step times yet: `npufuse verify e2e {cid} --cmd "..."` measures them after the loss check.'
    speedup = _finite(_first(perf, "speedup", "speed_up", "speedup_median"))
    ci = _first(perf, "speedup_ci", "ci", "confidence_interval", "speedup_ci95")
    if ci is None and _finite(_first(perf, "ci_low")) is not None and _finite(_first(perf, "ci_high")) is not None:
        ci = [perf["ci_low"], perf["ci_high"]]  # npufuse.verify.stats.PerfResult
    if not (isinstance(ci, list) and len(ci) == 2 and all(_finite(x) is not None for x in ci)):
        ci = None
    return {
        "present": present,
        "details": _details(perf) if present else [],
        "speedup": speedup,
        "ci": ci,
        "verdict": _first(perf, "verdict", "conclusion", "result") if present else None,
        "missing": missing,
        "backend": _backend_of(perf),
    }


def _verdict_class(verdict: str | None) -> str:
    if not verdict:
        return "none"
    low = verdict.lower()
    if low.startswith(("do not", "don't", "reject", "keep")):
        return "bad"
    if low.startswith(("replace", "accept")):
        return "good"
    return "neutral"


def _candidate(
    cid: int,
    cand: dict[str, Any] | None,
    scan_cand: dict[str, Any] | None,
    scan_present: bool,
    scan_path: Path,
    records: list[dict[str, Any]],
    warnings: list[str],
    looked_in: str,
) -> dict[str, Any]:
    in_state = cand is not None
    cand = dict(cand or {"id": cid, "status": "not_applied", "evidence": {}, "reasons": []})
    # state.json is hand-editable and written by several commands: coerce shapes, never crash
    if not isinstance(cand.get("evidence"), dict):
        cand["evidence"] = {}
    reasons = cand.get("reasons")
    cand["reasons"] = [reasons] if isinstance(reasons, str) else (list(reasons) if isinstance(reasons, list) else [])
    verdict = cand.get("verdict")
    cand["verdict"] = None if verdict in (None, "") else (verdict if isinstance(verdict, str) else json.dumps(_jsonable(verdict)))
    src = scan_cand or {}
    applied = bool(cand.get("applied"))
    warmup, assumed = _warmup(cand)
    runs = _dedupe(records, warnings, cid)
    series = _series(runs, warmup)
    unit, scale = _time_scale(series)
    op = _op_section(cid, cand, applied)
    e2e = _e2e_section(cid, cand, op, runs, looked_in)
    has_times = any(t is not None for t in series["baseline_time"] + series["fused_time"])
    perf = _perf_section(cid, cand, e2e, has_times)
    run_backends = sorted({str(_backend_of(r)) for r in records if _backend_of(r)})
    timing = [b for b in (e2e["backend"], perf["backend"], *run_backends) if b]
    backends = [b for b in (op["backend"], *timing) if b]
    emulated = any(b == "emulated" for b in backends)
    # Step times are labelled emulated when their own backend says so, and also when it is not
    # recorded but another section ran emulated: an emulated time must never pass for NPU time.
    timing_emulated = any(b == "emulated" for b in timing) or (not timing and emulated)
    backend = "emulated" if emulated else (backends[0] if backends else "unknown")
    status = cand.get("status") or "pending"
    applied_info = cand.get("applied") if isinstance(cand.get("applied"), dict) else {}
    charts = []
    if any(v is not None for v in series["baseline_loss"] + series["fused_loss"]):
        charts.append("loss")
    # step times are evidence only when real: an emulated run's are CPU times of the stand-in
    if has_times and not timing_emulated:
        charts.append("step_time")
    hist = _histogram(runs, series["warmup_end"])
    if hist is not None and not timing_emulated:
        charts.append("step_time_hist")
    tolerance = _finite(_first((cand.get("evidence") or {}).get("e2e") or {}, "tolerance", "threshold"))
    thresholds = ((cand.get("evidence") or {}).get("e2e") or {}).get("thresholds")
    if tolerance is None and isinstance(thresholds, dict):
        tolerance = _finite(thresholds.get("tolerance"))
    if tolerance is not None:
        # the loss overlay's band: baseline ± tolerance (the check itself compares EMA-smoothed curves)
        series["band_lo"] = [None if v is None else v * (1 - tolerance) for v in series["baseline_loss"]]
        series["band_hi"] = [None if v is None else v * (1 + tolerance) for v in series["baseline_loss"]]
    pattern = cand.get("pattern") or src.get("pattern") or "?"
    return {
        "id": cid,
        "anchor": f"candidate-{cid}-{re.sub(r'[^A-Za-z0-9_-]', '-', str(pattern))}",
        "in_state": in_state,
        "key": cand.get("key") or src.get("key") or "",
        "pattern": pattern,
        "api": src.get("api") or "",
        "title": src.get("title") or "",
        "file": cand.get("file") or src.get("file") or "",
        "line": src.get("line"),
        "end_line": src.get("end_line"),
        "qualname": cand.get("qualname") or src.get("qualname") or "",
        "status": status,
        "status_label": STATUS_LABELS.get(status, status),
        "verdict": cand.get("verdict"),
        "verdict_class": _verdict_class(cand.get("verdict")),
        "reasons": [str(r) for r in cand["reasons"]],
        "applied": _jsonable(applied_info) if applied else None,
        "switch": str(applied_info.get("switch_description") or _first(src.get("switch"), "description", "expr", "name", default="") or ""),
        "backend": backend,
        "emulated": emulated,
        "timing_emulated": timing_emulated,
        "backends": {"op": op["backend"], "e2e": e2e["backend"], "perf": perf["backend"], "runs": run_backends},
        "code": _code_section(cid, scan_cand, scan_present, scan_path),
        "op": op,
        "e2e": e2e,
        "perf": perf,
        "series": series,
        "warmup": warmup,
        "warmup_assumed": assumed,
        "time_unit": unit,
        "time_scale": scale,
        "hist": hist,
        "run_summary": _run_summary(runs, series["warmup_end"]),
        "charts": charts,
        "tolerance": tolerance,
        "forced": bool(((cand.get("evidence") or {}).get("e2e") or {}).get("forced")),
    }


def build_report_data(
    state_dir: Path | str = ".npufuse",
    *,
    scan_path: Path | str | None = None,
    jsonl: Sequence[Path | str] = (),
    ids: Sequence[int] | None = None,
    generated_at: str | None = None,
) -> dict[str, Any]:
    """REPORT_DATA for ``ids`` (default: every candidate in the state file).

    Raises :class:`ReportInputError` for missing or malformed input, naming the file.
    """
    state_dir = Path(state_dir)
    scan_path = Path(scan_path) if scan_path is not None else state_dir / "scan.json"
    state_file = state_dir / "state.json"
    state_cands, scan_sha = load_state_candidates(state_dir)
    scan = load_scan(scan_path)
    if not state_file.is_file() and scan is None:
        raise ReportInputError(f"{state_file}: no state and no {scan_path.name} here; run `npufuse scan PATH` and `npufuse apply --accept IDS` first")
    warnings: list[str] = []
    if scan is not None and scan_sha:
        actual = hashlib.sha256(scan_path.read_bytes()).hexdigest()
        if actual != scan_sha:
            warnings.append(f"{scan_path} changed since `npufuse apply` (sha256 differs from the state's): the code shown is the current scan's")
    by_id_state = {int(c["id"]): c for c in state_cands}
    scan_list = [c for c in (scan or {}).get("candidates", []) if isinstance(c, dict) and isinstance(c.get("id"), int)]
    scan_by_id = {int(c["id"]): c for c in scan_list}
    scan_by_key = {c.get("key"): c for c in scan_list}
    if ids:
        unknown = [i for i in ids if i not in by_id_state and i not in scan_by_id]
        if unknown:
            known = sorted(set(by_id_state) | set(scan_by_id))
            raise ReportInputError(
                f"no candidate {', '.join(map(str, unknown))} in {state_file} or {scan_path}"
                + (f" (known: {', '.join(map(str, known))})" if known else "")
            )
        chosen = list(dict.fromkeys(ids))
    else:
        chosen = sorted(by_id_state)
        if not chosen:
            raise ReportInputError(
                f"{state_file}: no candidate has been applied yet; run `npufuse apply --accept IDS`, or name scan candidate ids to report on"
            )

    records = StepRecords()
    for p in jsonl:
        read_jsonl(Path(p), records, strict=True)
    if records.unattributed:
        if len(chosen) != 1:
            where = records.unattributed[0]["_where"]
            raise ReportInputError(f"{where}: record has no \"candidate\" field; name one candidate ID to report it under")
        for rec in records.unattributed:
            records.by_candidate.setdefault(chosen[0], []).append(dict(rec, candidate=chosen[0]))
    seen = {str(Path(f).resolve()) for f in records.files}
    auto: list[Path] = []
    for cid in chosen:
        for name in _evidence_jsonl_paths(by_id_state.get(cid) or {}):
            p = Path(name)
            for cand_path in ([p] if p.is_absolute() else [state_dir.parent / p, p, state_dir / p]):
                if cand_path.is_file():
                    auto.append(cand_path)
                    break
            else:
                warnings.append(f"candidate {cid}: the evidence names {name}, which is not there")
    if state_dir.is_dir():
        auto += sorted(state_dir.rglob("*.jsonl"))
    for p in auto:
        if str(p.resolve()) not in seen:
            seen.add(str(p.resolve()))
            read_jsonl(p, records, strict=False)
    warnings += records.warnings
    looked_in = f"looked in {state_dir}/ and the files the evidence names"

    candidates = []
    for cid in chosen:
        st = by_id_state.get(cid)
        sc = scan_by_id.get(cid)
        if st is not None and sc is not None and st.get("key") and sc.get("key") != st.get("key"):
            sc = scan_by_key.get(st.get("key"))  # the scan was redone and renumbered: match by key
        recs = [r for r in records.by_candidate.get(cid, [])]
        candidates.append(_candidate(cid, st, sc, scan is not None, scan_path, recs, warnings, looked_in))
    for c in candidates:
        for run in RUNS:
            if c["series"]["nonfinite_loss"][run]:
                steps = c["series"]["nonfinite_loss"][run]
                c["e2e"]["details"].append([f"{run} loss not finite at step(s)", ", ".join(map(str, steps[:20])) + (" …" if len(steps) > 20 else "")])

    root = state_dir.resolve().parent
    data = {
        "schema": SCHEMA,
        "tool": "npufuse",
        "version": __version__,
        "generated_at": generated_at or datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "library": {"name": "uPlot", "version": UPLOT_VERSION, "license": "MIT"},
        "sources": {"state": str(state_file), "scan": str(scan_path) if scan is not None else None, "jsonl": records.files},
        "scan_root": (scan or {}).get("root"),
        "any_emulated": any(c["emulated"] for c in candidates),
        "warnings": warnings,
        "candidates": candidates,
    }
    return scrub_paths(data, root)


# An absolute path of two or more parts: /home/me/x.py, /tmp/a/b/e2e_1.log
_ABS_PATH = re.compile(r"(?<![\w.~/-])/(?:[\w.+@-]+/)+([\w.+@-]+)")
_CODE_KEYS = frozenset({"code"})  # the code section is the user's source, shown byte for byte


def scrub_paths(data: Any, root: Path) -> Any:
    """The report without machine paths: paths under the project folder become relative to it,
    any other absolute path keeps only its last part ("…/python3"). A report is shared; the
    folder layout of the machine that made it is nobody's business and only adds noise."""
    base = str(root).rstrip("/")

    def text(v: str) -> str:
        if "/" not in v:
            return v
        v = v.replace(base + "/", "").replace(base, ".")
        return _ABS_PATH.sub(lambda m: "…/" + m.group(1), v)

    def walk(v: Any, key: str = "") -> Any:
        if key in _CODE_KEYS:
            return v
        if isinstance(v, str):
            return text(v)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple):
            return tuple(walk(x) for x in v)
        if isinstance(v, dict):
            return {k: walk(x, k) for k, x in v.items()}
        return v

    return walk(data)


# -- rendering -------------------------------------------------------------------------------------


def json_for_script(data: Any) -> str:
    """JSON safe inside a ``<script type="application/json">`` element.

    ``<``, ``>`` and ``&`` become ``\\u003c`` / ``\\u003e`` / ``\\u0026`` (a stricter form of
    ``</`` → ``<\\/``): the HTML parser then never sees ``</script`` or ``<!--`` in the block,
    whatever the repo's text holds, and ``JSON.parse`` gives back the original characters.
    U+2028/2029 are escaped too, for any consumer that evaluates the text as JavaScript.
    """
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, sort_keys=False, separators=(",", ":"))
    return (
        text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    )


def _resource(*parts: str) -> str:
    return resources.files("npufuse.report").joinpath(*parts).read_text(encoding="utf-8")


def _inline_check(text: str, tag: str, name: str) -> str:
    """Our own bundled file, inlined raw: refuse it if it could end its element early."""
    low = text.lower()
    if f"</{tag}" in low or "<!--" in low:
        raise RuntimeError(f"bundled {name} contains '</{tag}' or '<!--' and cannot be inlined safely")
    return text


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


def _fmt_num(v: Any, sig: int = 4) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool) or not _is_num(v):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    return f"{v:.{sig}g}"


def _fmt_time(v: Any) -> str:
    if not _is_num(v):
        return "—"
    return f"{v * 1000:.4g} ms" if abs(v) < 1.0 else f"{v:.4g} s"


def _fmt_value(v: Any) -> str:
    """A details cell: numbers compact, the rest as text."""
    if isinstance(v, float):
        return _fmt_num(v, 5)
    return "—" if v is None else str(v)


def _escape_leaves(obj: Any, hit: list[bool]) -> Any:
    """Every string in ``obj`` with bidi/terminal-control characters shown escaped (Trojan source:
    repo text must look in the page as Python reads it); ``hit[0]`` says whether any was."""
    from npufuse.text_safety import escape_text

    if isinstance(obj, str):
        out = escape_text(obj)
        if out != obj:
            hit[0] = True
        return out
    if isinstance(obj, dict):
        return {(_escape_leaves(k, hit) if isinstance(k, str) else k): _escape_leaves(v, hit) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_escape_leaves(v, hit) for v in obj]
    return obj


def render_html(data: dict[str, Any]) -> str:
    """The page for REPORT_DATA ``data``: one string, no external reference."""
    import jinja2  # imported here: `npufuse --help` imports every verb module
    from markupsafe import Markup

    from npufuse.text_safety import TROJAN_SOURCE_WARNING

    hit = [False]
    data = _escape_leaves(data, hit)

    vendor_js = _inline_check(_resource("vendor", "uPlot.iife.min.js"), "script", "uPlot.iife.min.js")
    license_text = _resource("vendor", "LICENSE")
    if "*/" in license_text:
        raise RuntimeError("bundled uPlot LICENSE contains '*/' and cannot go into a JS comment")
    # The licence travels with every copy of the library (MIT's one condition).
    uplot_script = f"/*! uPlot v{UPLOT_VERSION} (MIT)\n{license_text.strip()}\n*/\n{vendor_js}"
    uplot_script = _inline_check(uplot_script, "script", "uPlot licence header")
    app_script = _inline_check(_resource("templates", "report.js"), "script", "report.js")
    css = _inline_check(_resource("vendor", "uPlot.min.css") + "\n" + _resource("templates", "report.css"), "style", "CSS")

    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: _resource("templates", name)),
        autoescape=True,  # every {{ }} is escaped: repo text is shown, never interpreted
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = _fmt_num
    env.filters["time"] = _fmt_time
    env.filters["value"] = _fmt_value
    template = env.get_template("report.html.j2")
    csp = (
        "default-src 'none'; "
        f"script-src {_csp_hash(uplot_script)} {_csp_hash(app_script)}; "
        "style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"
    )
    # Markup only for text this module produced or bundled: the JSON is escaped by
    # json_for_script, the scripts and CSS are our own files checked by _inline_check.
    page = template.render(
        d=data,
        report_json=Markup(json_for_script(data)),
        uplot_script=Markup(uplot_script),
        app_script=Markup(app_script),
        css=Markup(css),
        csp=csp,
    )
    if hit[0]:
        import html as _html

        banner = f'<p class="trojan-warning" role="alert"><strong>{_html.escape(TROJAN_SOURCE_WARNING)}</strong></p>'
        page = page.replace('<body data-charts-drawn="0">', '<body data-charts-drawn="0">\n' + banner, 1)
    return page


def extract_report_data(html: str) -> dict[str, Any]:
    """REPORT_DATA back out of a rendered page (tests, and tools that post-process reports)."""
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html, re.S)
    if not m:
        raise ValueError("no REPORT_DATA block in this page")
    return json.loads(m.group(1))


def write_report(data: dict[str, Any], out: Path | str) -> Path:
    from npufuse.safe_write import write_output

    out = Path(out)
    # A new report gets the usual 0666 & ~umask (it is meant to be shared and opened), an
    # existing file keeps its mode; -o /dev/stdout, a FIFO or a symlink is written through
    write_output(out, render_html(data).encode("utf-8"))
    return out
