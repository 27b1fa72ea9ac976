"""The task list: ``.npufuse/state.json``, one entry per candidate, so any command can resume.

Statuses (DESIGN.md): ``pending`` → ``accuracy_checking`` → (``accuracy_failed`` |
``e2e_checking``) → (``e2e_failed`` | ``perf_checking``) → ``concluded``. Each entry keeps its
evidence (op check, e2e, perf), the verdict and the reasons, and a history of transitions.
``CONCLUSIONS.md`` beside the state file says the same in prose (written by ``save``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from npufuse.safe_write import write_text_atomic

STATUSES = (
    "pending",
    "accuracy_checking",
    "accuracy_failed",
    "e2e_checking",
    "e2e_failed",
    "perf_checking",
    "concluded",
    "not_reached",  # a traced run never executed the site (npufuse trace): nothing to verify there
)
STATE_DIR = ".npufuse"


@dataclass
class CandidateState:
    id: int
    key: str
    pattern: str
    file: str
    qualname: str = ""
    status: str = "pending"
    # set while the site is rewritten in its file (npufuse.rewrite.ledger documents the keys):
    # {"switch": {...}, "switch_description": ..., "guard": ..., "span": [a, b],
    #  "file_sha256_before": ..., "file_sha256_after": ..., "backup": ..., "scan_span": [l, e]}
    applied: dict[str, Any] | None = None
    evidence: dict[str, Any] = field(default_factory=dict)  # "op", "e2e", "perf" -> facts
    verdict: str | None = None  # e.g. "replace: faster", "do not replace: accuracy", "no measurable change"
    reasons: list[str] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class State:
    path: Path
    scan_sha256: str = ""
    candidates: dict[int, CandidateState] = field(default_factory=dict)
    # file writes begun but not yet confirmed (apply/revert journal; see npufuse.rewrite.ledger)
    pending: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, state_dir: Path | str = STATE_DIR) -> "State":
        path = Path(state_dir) / "state.json"
        state = cls(path=path)
        if path.exists():
            try:
                raw = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"{path}: unreadable state file ({exc}); move it away to start over") from exc
            state.scan_sha256 = raw.get("scan_sha256", "")
            state.pending = list(raw.get("pending", []))
            for item in raw.get("candidates", []):
                c = CandidateState(**item)
                state.candidates[c.id] = c
        return state

    def ensure(self, candidate: dict[str, Any]) -> CandidateState:
        """The entry of a scan.json candidate (created pending on first sight)."""
        cid = int(candidate["id"])
        if cid not in self.candidates:
            self.candidates[cid] = CandidateState(
                id=cid,
                key=candidate["key"],
                pattern=candidate["pattern"],
                file=candidate["file"],
                qualname=candidate.get("qualname", ""),
            )
        return self.candidates[cid]

    def set_status(self, cid: int, status: str, note: str = "") -> None:
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}")
        c = self.candidates[cid]
        c.status = status
        c.history.append({"status": status, "note": note})

    def to_json(self) -> dict[str, Any]:
        return {
            "tool": "npufuse",
            "scan_sha256": self.scan_sha256,
            "candidates": [asdict(c) for _, c in sorted(self.candidates.items())],
            "pending": self.pending,
        }

    def save(self) -> None:
        write_text_atomic(self.path, json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n")
        write_text_atomic(self.path.with_name("CONCLUSIONS.md"), conclusions_markdown(self))


def conclusions_markdown(state: State) -> str:
    lines = ["# npufuse conclusions", "", "Where every candidate stands (from `.npufuse/state.json`).", ""]
    if not state.candidates:
        lines.append("No candidate has been applied or verified yet.")
    for cid, c in sorted(state.candidates.items()):
        lines.append(f"## {cid}. {c.pattern} in `{c.file}` ({c.qualname or 'module'})")
        lines.append("")
        lines.append(f"- status: **{c.status}**" + (f"; verdict: **{c.verdict}**" if c.verdict else ""))
        if c.applied:
            lines.append(f"- applied behind {c.applied.get('switch_description', 'a switch')}")
        for reason in c.reasons:
            lines.append(f"- {reason}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
