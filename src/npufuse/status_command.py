"""``npufuse status [--json]``: the task list — every candidate, where it stands, what to run next.

Rows come from ``.npufuse/state.json`` (applied/verified candidates) and ``.npufuse/scan.json``
(candidates not accepted yet, shown ``pending``, not applied). Columns: id, pattern, file:line,
status, verdict, next step. ``--json`` prints the same rows as a list of objects (plus the last
evidence summary of each candidate).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from npufuse.cli import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", default=".npufuse", help="npufuse state folder (default .npufuse)")
    parser.add_argument("--json", action="store_true", help="print the task list as JSON")


def next_step(cid: int, status: str, applied: bool, verdict: str | None, evidence: dict[str, Any]) -> str:
    """The command that moves a candidate on (or the last word, once it is concluded)."""
    if not applied:
        return f"npufuse apply --accept {cid}"
    if status in ("pending", "accuracy_checking"):
        return f"npufuse verify op {cid}"
    if status in ("e2e_checking", "perf_checking"):
        e2e = _as_dict(_as_dict(evidence).get("e2e"))
        cmd = e2e.get("cmd") if isinstance(e2e.get("cmd"), str) else None
        return f"npufuse verify e2e {cid} --cmd {shlex.quote(cmd)}" if cmd else f'npufuse verify e2e {cid} --cmd "<your launch command>"'
    if status in ("accuracy_failed", "e2e_failed"):
        return f"npufuse revert {cid}"
    if status == "concluded":
        if isinstance(verdict, str) and verdict.startswith("do not replace"):
            return f"npufuse revert {cid}"
        return f"npufuse report html {cid}"
    return ""


def _as_dict(value: Any) -> dict[str, Any]:
    # state.json is hand-editable: a field of another shape is shown as absent, never a crash
    return value if isinstance(value, dict) else {}


def _evidence_summary(evidence: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    evidence = _as_dict(evidence)
    op = _as_dict(evidence.get("op"))
    if op:
        out["op"] = {k: op.get(k) for k in ("passed", "backend", "min_cosine", "max_rel")}
    e2e = _as_dict(evidence.get("e2e"))
    if e2e:
        loss = _as_dict(e2e.get("loss"))
        out["e2e"] = {"passed": e2e.get("passed"), "backend": e2e.get("backend"), "max_rel_diff": loss.get("max_rel_diff"),
                      "runs": {k: _as_dict(v).get("status") for k, v in _as_dict(e2e.get("runs")).items()}}  # fmt: skip
    perf = _as_dict(evidence.get("perf"))
    if perf:
        out["perf"] = {k: perf.get(k) for k in ("verdict", "speedup", "ci_low", "ci_high", "backend")}
    return out


def task_list(state_dir: Path) -> list[dict[str, Any]]:
    from npufuse.state import State

    try:
        state = State.load(state_dir)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    from npufuse.rewrite.apply import Refused, read_scan_json

    scan: dict[str, Any] = {}
    try:
        got = read_scan_json(state_dir)  # no link, FIFO or deep JSON (a repo may ship it)
    except Refused as exc:
        raise UsageError(str(exc)) from None
    if got is not None:
        scan = got[0] if isinstance(got[0], dict) else {}
        if not isinstance(scan.get("candidates", []), list):
            scan = {}
    scanned = {c.get("key"): c for c in scan.get("candidates", []) if isinstance(c, dict)}
    rows: list[dict[str, Any]] = []
    seen_keys = set()
    for cid, c in sorted(state.candidates.items()):
        seen_keys.add(c.key)
        s = scanned.get(c.key, {})
        span = (c.applied or {}).get("span")
        # where the site is now: the rewritten if/else once applied, the scanned line before
        line = span[0] if c.applied and isinstance(span, list) and span else s.get("line")
        rows.append({
            "id": cid, "pattern": c.pattern, "file": c.file, "line": line, "qualname": c.qualname, "status": c.status,
            "applied": bool(c.applied), "verdict": c.verdict, "reasons": c.reasons,
            "next": next_step(cid, c.status, bool(c.applied), c.verdict, c.evidence), "evidence": _evidence_summary(c.evidence),
        })  # fmt: skip
    for s in scan.get("candidates", []):
        if not isinstance(s, dict) or not isinstance(s.get("id"), int) or s.get("key") in seen_keys or s["id"] in state.candidates:
            continue
        cid = int(s["id"])
        rows.append({
            "id": cid, "pattern": s.get("pattern"), "file": s.get("file"), "line": s.get("line"), "qualname": s.get("qualname"),
            "status": "pending", "applied": False, "verdict": None, "reasons": [], "next": next_step(cid, "pending", False, None, {}), "evidence": {},
        })  # fmt: skip
    rows.sort(key=lambda r: r["id"])
    return rows


def run(args: argparse.Namespace) -> int:
    from npufuse.state_folder import UnsafeStatePath, state_file_exists

    state_dir = Path(args.state_dir)
    try:
        present = state_file_exists(state_dir, "state.json") or state_file_exists(state_dir, "scan.json")
    except UnsafeStatePath as exc:
        raise UsageError(str(exc)) from None
    if not present:
        if args.json:
            print("[]")
        else:
            print(f"no npufuse state in {state_dir}: run `npufuse scan PATH` first")
        return 0
    rows = task_list(state_dir)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"npufuse task list ({state_dir / 'state.json'})")
    for col in ("id", "pattern", "file:line", "status", "verdict", "next step"):
        table.add_column(col, overflow="fold")
    from npufuse.text_safety import TROJAN_SOURCE_WARNING, escape_text, has_unsafe

    unsafe = False
    for r in rows:
        where = f"{r['file']}:{r['line']}" if r["line"] else str(r["file"])
        # repository text (file names, hand-edited verdicts): controls shown escaped
        cells = [str(r["id"]), str(r["pattern"]), where, r["status"] + ("" if r["applied"] else " (not applied)"), str(r["verdict"] or "—"), str(r["next"])]
        unsafe = unsafe or any(has_unsafe(c) for c in cells)
        table.add_row(*(escape(escape_text(c)) for c in cells))
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped/CI output: don't fold commands into 80 columns
    console.print(table)
    if unsafe:
        console.print(escape(TROJAN_SOURCE_WARNING))
    return 0
