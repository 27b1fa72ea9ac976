"""One applied candidate, as verification needs it: scan.json facts + state.json entry + the site
as it stands in the rewritten file now.

The rewritten source is the ground truth for *where* the fused branch is and *which* switch
guards it (the ``_npufuse_switch("NAME")`` call in the marked ``if``): line numbers in the state
file go stale when the user edits the file, the marker comments do not.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from npufuse.cli import UsageError
from npufuse.state import STATE_DIR, CandidateState, State

_ENV_GUARD = re.compile(r"""_npufuse_switch\(\s*["']([A-Za-z_][A-Za-z0-9_]*)["']\s*\)""")
_API_NAME = re.compile(r"\b(npu_[A-Za-z0-9_]+|Npu[A-Za-z0-9_]+)\b")


@dataclass
class Site:
    """The marked ``if``/``else`` of one candidate in the current rewritten file."""

    line: int  # the ``if`` line (1-based)
    end_line: int  # last line of the else branch
    pattern: str
    qualname: str
    guard: str  # the if-header text, for messages
    env_switch: str | None  # NAME of ``_npufuse_switch("NAME")`` in the guard, if any
    fused_text: str  # the fused branch's source (to find which torch_npu APIs it calls)
    fused_lines: tuple[int, int] | None = None  # first and last line of the fused branch's body


@dataclass
class Candidate:
    id: int
    key: str
    pattern: str
    file: str  # relative to root, as in scan.json
    qualname: str
    root: Path  # absolute repository root
    state_dir: Path
    status: str
    applied: dict[str, Any]
    scan: dict[str, Any] = field(default_factory=dict)  # the scan.json candidate ({} if rescanned away)
    site: Site | None = None

    @property
    def path(self) -> Path:
        return self.root / self.file

    @property
    def apis(self) -> list[str]:
        """torch_npu API names this candidate's fused branch calls (scan's ``api`` first)."""
        names: list[str] = []
        for text in (str(self.scan.get("api", "")), self.site.fused_text if self.site else ""):
            for n in _API_NAME.findall(text):
                if n not in names:
                    names.append(n)
        return names

    @property
    def plain_torch(self) -> bool:
        """The pattern's replacement is plain torch (the affinity rewrites: its API is not a
        torch_npu one), so no torch_npu call can prove that the fused branch ran: a line trace must."""
        from npufuse.patterns.registry import get_pattern

        try:
            return not get_pattern(self.pattern).api.startswith("torch_npu")
        except KeyError:
            return False

    @property
    def training_ok(self) -> bool:
        return bool(self.scan.get("training_ok", True))

    def config_shapes(self) -> dict[str, Any]:
        """Canonical config values (hidden_size, ...) scan read for this candidate's file."""
        shapes = self.scan.get("shapes") or {}
        out = {}
        for k, v in shapes.items():
            out[k] = v.get("value") if isinstance(v, dict) else v
        return out

    def shape_sources(self) -> dict[str, str]:
        shapes = self.scan.get("shapes") or {}
        return {k: str(v.get("from", "")) for k, v in shapes.items() if isinstance(v, dict)}

    def file_sha256(self) -> str:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return ""


def _scan_candidates(state_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    path = state_dir / "scan.json"
    if not path.exists():
        return {}, []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: unreadable scan file ({exc})") from None
    return data, [c for c in data.get("candidates", []) if isinstance(c, dict)]


def resolve_root(state_dir: Path, scan: dict[str, Any], root: str | os.PathLike[str] | None) -> Path:
    """The scanned repository: ``--root``, else scan.json's ``root`` (relative to the folder that
    holds the state dir, where scan was run), else that folder."""
    if root is not None:
        return Path(root).resolve()
    base = state_dir.resolve().parent
    label = scan.get("root")
    if isinstance(label, str) and label:
        p = Path(label)
        return (p if p.is_absolute() else base / p).resolve()
    return base


def load_state(state_dir: Path) -> State:
    try:
        return State.load(state_dir)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def load_candidate(cid: int, state_dir: str | os.PathLike[str] = STATE_DIR, root: str | os.PathLike[str] | None = None, *, need_site: bool = True) -> Candidate:
    """The applied candidate ``cid``. Raises :class:`UsageError` (one line) when there is no state,
    the candidate is unknown or not applied, or its marked site is gone from the file."""
    sd = Path(state_dir)
    state = load_state(sd)
    entry = state.candidates.get(cid)
    if entry is None:
        known = ", ".join(str(i) for i in sorted(state.candidates)) or "none"
        raise UsageError(f"{sd / 'state.json'}: no candidate {cid} (known: {known}); run `npufuse apply --accept {cid}` first")
    if not entry.applied:
        raise UsageError(f"candidate {cid} ({entry.pattern} in {entry.file}) is not applied; run `npufuse apply --accept {cid}` first")
    scan, cands = _scan_candidates(sd)
    # ids are per scan: trust the id only when the key agrees, else find the key
    match = next((c for c in cands if c.get("id") == cid and c.get("key") == entry.key), None)
    match = match or next((c for c in cands if c.get("key") == entry.key), None) or {}
    cand = Candidate(
        id=cid,
        key=entry.key,
        pattern=entry.pattern,
        file=entry.file,
        qualname=entry.qualname or str(match.get("qualname", "")),
        root=resolve_root(sd, scan, root),
        state_dir=sd,
        status=entry.status,
        applied=dict(entry.applied),
        scan=match,
    )
    _refuse_escape(cand, sd)
    if not cand.path.is_file():
        raise UsageError(f"{cand.path}: file of candidate {cid} not found (wrong --root?)")
    if need_site:
        cand.site = locate_site(cand)
    return cand


def _refuse_escape(cand: Candidate, state_dir: Path) -> None:
    """A hand-edited state.json/scan.json must not make verify read or import a file outside
    the scanned root (``../``, absolute, or a symlink out): the same rule apply and revert use."""
    from npufuse.rewrite.files import FileProblem, safe_path

    if not isinstance(cand.file, str):
        raise UsageError(f"{state_dir / 'state.json'}: candidate {cand.id} has no file path; run `npufuse apply` again")
    try:
        safe_path(cand.root, cand.file)
    except FileProblem as exc:
        raise UsageError(f"{state_dir / 'state.json'}: candidate {cand.id}: {exc}") from None


def locate_site(cand: Candidate) -> Site:
    from npufuse.rewrite.transform import marked_sites

    try:
        source = cand.path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{cand.path}: cannot read ({exc})") from None
    try:
        sites = [s for s in marked_sites(source) if s.pattern == cand.pattern]
    except Exception as exc:  # libcst parse error: the user broke the file after apply
        raise UsageError(f"{cand.path}: does not parse ({type(exc).__name__}); fix the file first") from None
    if not sites:
        raise UsageError(f"{cand.path}: no `# npufuse: {cand.pattern}` branch found (reverted or edited by hand?)")
    same = [s for s in sites if s.qualname == cand.qualname] or sites
    span = cand.applied.get("span")
    anchor = int(span[0]) if isinstance(span, (list, tuple)) and span else int(cand.scan.get("line", same[0].line))
    site = min(same, key=lambda s: abs(s.line - anchor))
    lines = source.splitlines()
    header = []
    for text in lines[site.line - 1 : site.end_line]:
        header.append(text)
        if "# npufuse:" in text:
            break
    fused: list[str] = []
    indent = len(lines[site.line - 1]) - len(lines[site.line - 1].lstrip())
    for text in lines[site.line - 1 + len(header) : site.end_line]:
        stripped = text.lstrip()
        if stripped.startswith("else:") and len(text) - len(stripped) == indent:
            break
        fused.append(text)
    guard = "\n".join(header)
    m = _ENV_GUARD.search(guard)
    first = site.line + len(header)
    span = (first, first + len(fused) - 1) if fused else None
    return Site(site.line, site.end_line, site.pattern, site.qualname, guard.strip(), m.group(1) if m else None, "\n".join(fused), span)


def update_state(cand: Candidate, mutate: Callable[[CandidateState], None] | None = None, status: str | None = None, note: str = "") -> CandidateState:
    """Reload state.json, change this candidate only, save (state.json + CONCLUSIONS.md).

    Reloading first keeps a concurrent verification of another candidate from being overwritten."""
    state = load_state(cand.state_dir)
    entry = state.candidates.get(cand.id)
    if entry is None:
        raise UsageError(f"{cand.state_dir / 'state.json'}: candidate {cand.id} disappeared during verification")
    if mutate is not None:
        mutate(entry)
    if status is not None:
        state.set_status(cand.id, status, note)
    state.save()
    cand.status = entry.status
    return entry
