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

from npufuse.text_safety import safe_report_text
from npufuse.state_folder import UnsafeStatePath, read_state_file, write_state_file

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
        """The state of ``state_dir`` (empty when there is none). state.json is untrusted input
        (it may come with a cloned repository): read without following links, its shape checked
        field by field; anything else raises ValueError naming the file."""
        path = Path(state_dir) / "state.json"
        state = cls(path=path)
        try:
            data = read_state_file(state_dir, "state.json")
        except UnsafeStatePath as exc:
            raise ValueError(str(exc)) from None
        except OSError as exc:
            raise ValueError(f"{path}: unreadable state file ({exc.strerror or exc}); move it away to start over") from None
        if data is None:
            return state
        try:
            raw = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise ValueError(f"{path}: unreadable state file ({why}); move it away to start over") from None
        problem = _shape_problem(raw)
        if problem:
            raise ValueError(f"{path}: not an npufuse state file ({problem}); move it away to start over")
        state.scan_sha256 = raw.get("scan_sha256", "")
        state.pending = list(raw.get("pending", []))
        for item in raw.get("candidates", []):
            c = CandidateState(**item)
            if not isinstance(c.evidence, dict):  # verify adds its facts under "op"/"e2e"/"perf"
                c.evidence = {}
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
        # through the state folder's no-symlink writer: a repo shipping .npufuse/state.json as a
        # link must not have npufuse write through it
        write_state_file(self.path.parent, "state.json", (json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n").encode("utf-8"))
        write_state_file(self.path.parent, "CONCLUSIONS.md", safe_report_text(conclusions_markdown(self)).encode("utf-8"))


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "id": (int,), "key": (str,), "pattern": (str,), "file": (str,), "qualname": (str,), "status": (str,),
    "applied": (dict, type(None)), "history": (list,),
    # evidence, verdict and reasons are shown, never acted on: the report renders odd shapes of
    # a hand-edited state.json as they are
    "evidence": (object,), "verdict": (object,), "reasons": (object,),
}
_REQUIRED_FIELDS = ("id", "key", "pattern", "file")


def _shape_problem(raw: Any) -> str | None:
    """What makes ``raw`` not a state.json npufuse wrote (None when it is one)."""
    if not isinstance(raw, dict):
        return f"the top level is {type(raw).__name__}, not an object"
    if not isinstance(raw.get("scan_sha256", ""), str):
        return "scan_sha256 is not a string"
    if not isinstance(raw.get("pending", []), list) or not all(isinstance(p, dict) for p in raw.get("pending", [])):
        return "pending is not a list of objects"
    cands = raw.get("candidates", [])
    if not isinstance(cands, list):
        return "candidates is not a list"
    seen: set[int] = set()
    for n, item in enumerate(cands):
        if not isinstance(item, dict):
            return f"candidates[{n}] is not an object"
        for name in _REQUIRED_FIELDS:
            if name not in item:
                return f"candidates[{n}] lacks {name}"
        for name, value in item.items():
            if name not in _FIELD_TYPES:
                return f"candidates[{n}] has an unknown field {name!r}"
            if not isinstance(value, _FIELD_TYPES[name]) or (name == "id" and isinstance(value, bool)):
                return f"candidates[{n}].{name} is {type(value).__name__}"
        if item.get("status", "pending") not in STATUSES:
            return f"candidates[{n}].status {str(item['status'])[:40]!r} is not a status"
        if item["id"] in seen:
            return f"candidate id {item['id']} appears twice"
        seen.add(item["id"])
        applied = item.get("applied")
        if applied is not None:
            problem = _applied_problem(applied)
            if problem:
                return f"candidates[{n}].applied: {problem}"
    return None


def _applied_problem(rec: dict[str, Any]) -> str | None:
    for name in ("span", "scan_span"):
        if name in rec:
            span = rec[name]
            if not (isinstance(span, list) and len(span) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in span)):
                return f"{name} is not two line numbers"
    for name in ("guard", "switch_description", "off", "file_sha256_before", "backup"):
        if name in rec and not isinstance(rec[name], str):
            return f"{name} is not a string"
    if "file_sha256_after" in rec and not isinstance(rec["file_sha256_after"], (str, type(None))):
        return "file_sha256_after is not a string"
    if isinstance(rec.get("backup"), str) and rec["backup"]:
        # recorded relative to the state folder, under backup/ (ledger); anything else could
        # make revert copy a file from elsewhere into the repository
        pure = rec["backup"].replace("\\", "/")
        if not pure.startswith("backup/") or pure.startswith("/") or ".." in pure.split("/"):
            return f"backup {rec['backup'][:80]!r} is not inside the state folder's backup/"
    return None


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
        for reason in c.reasons if isinstance(c.reasons, list) else [c.reasons] if c.reasons else []:
            lines.append(f"- {reason}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
