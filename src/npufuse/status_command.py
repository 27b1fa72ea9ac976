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
        e2e = evidence.get("e2e") or {}
        cmd = e2e.get("cmd")
        return f"npufuse verify e2e {cid} --cmd {shlex.quote(cmd)}" if cmd else f'npufuse verify e2e {cid} --cmd "<your launch command>"'
    if status in ("accuracy_failed", "e2e_failed"):
        return f"npufuse revert {cid}"
    if status == "concluded":
        if verdict and verdict.startswith("do not replace"):
            return f"npufuse revert {cid}"
        return f"npufuse report html {cid}"
    return ""


def _evidence_summary(evidence: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    op = evidence.get("op") or {}
    if op:
        out["op"] = {k: op.get(k) for k in ("passed", "backend", "min_cosine", "max_rel")}
    e2e = evidence.get("e2e") or {}
    if e2e:
        loss = e2e.get("loss") or {}
        out["e2e"] = {"passed": e2e.get("passed"), "backend": e2e.get("backend"), "max_rel_diff": loss.get("max_rel_diff"),
                      "runs": {k: v.get("status") for k, v in (e2e.get("runs") or {}).items()}}  # fmt: skip
    perf = evidence.get("perf") or {}
    if perf:
        out["perf"] = {k: perf.get(k) for k in ("verdict", "speedup", "ci_low", "ci_high", "backend")}
    return out


def task_list(state_dir: Path) -> list[dict[str, Any]]:
    from npufuse.state import State

    try:
        state = State.load(state_dir)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    scan: dict[str, Any] = {}
    scan_path = state_dir / "scan.json"
    if scan_path.exists():
        try:
            scan = json.loads(scan_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"{scan_path}: unreadable scan file ({exc})") from None
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
        if not isinstance(s, dict) or s.get("key") in seen_keys or int(s.get("id", 0)) in state.candidates:
            continue
        cid = int(s["id"])
        rows.append({
            "id": cid, "pattern": s.get("pattern"), "file": s.get("file"), "line": s.get("line"), "qualname": s.get("qualname"),
            "status": "pending", "applied": False, "verdict": None, "reasons": [], "next": next_step(cid, "pending", False, None, {}), "evidence": {},
        })  # fmt: skip
    rows.sort(key=lambda r: r["id"])
    return rows


def run(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir)
    if not (state_dir / "state.json").exists() and not (state_dir / "scan.json").exists():
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
    for r in rows:
        where = f"{r['file']}:{r['line']}" if r["line"] else str(r["file"])
        table.add_row(str(r["id"]), escape(str(r["pattern"])), escape(where), r["status"] + ("" if r["applied"] else " (not applied)"),
                      escape(r["verdict"] or "—"), escape(r["next"]))  # fmt: skip
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped/CI output: don't fold commands into 80 columns
    console.print(table)
    return 0
