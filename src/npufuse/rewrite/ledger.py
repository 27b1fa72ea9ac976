"""What npufuse has rewritten, kept in ``.npufuse/state.json`` so ``revert`` (and a later
``apply`` in the same file) can find each site again — and stays truthful across a crash.

An applied candidate's ``applied`` record holds:

``switch`` / ``switch_description`` / ``off``
    the switch guarding the fused branch, as scan.json spells it, in prose, and how to turn the
    original back on (``NPUFUSE_RMS_NORM=0``);
``guard``
    the exact guard expression written (a later apply in the same file re-renders it);
``span``
    first and last line of the site's ``if``/``else`` block in the file as npufuse last wrote it;
``scan_span``
    the site's lines in the scanned original;
``file_sha256_before`` / ``file_sha256_after``
    the scanned original and the file as npufuse last wrote it (shared by every site of a file);
``backup``
    the copy of the original, relative to the state folder.

Journal: before a file is written, ``begin`` records ``{file, from, to, before}`` (hashes and the
records it replaces) in ``state.pending`` and saves; ``commit`` clears it after the write. A
process killed in between leaves a pending entry; ``reconcile`` (run first by every command)
keeps the new records when the file holds ``to``, restores ``before`` when it still holds
``from``, and otherwise leaves it, naming the file.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from npufuse.rewrite.files import FileProblem, _read_regular, safe_path, sha256_bytes
from npufuse.rewrite.transform import MarkedSite, marked_sites
from npufuse.state import CandidateState, State


def applied_in(state: State, rel: str) -> list[CandidateState]:
    """Candidates recorded as rewritten in ``rel``, in the order of their scanned lines."""
    found = [c for c in state.candidates.values() if c.applied and c.file == rel]
    return sorted(found, key=lambda c: (tuple(c.applied.get("scan_span") or (0, 0)), c.id))


def file_hash_after(entries: list[CandidateState]) -> str | None:
    hashes = {c.applied.get("file_sha256_after") for c in entries if c.applied}
    return hashes.pop() if len(hashes) == 1 else None


@dataclass
class Located:
    sites: dict[int, MarkedSite]  # candidate id -> its marked if in the text
    problems: dict[int, str]  # candidate id -> why it could not be found


def locate(text: str, entries: list[CandidateState]) -> Located:
    """Find each applied candidate's marked ``if`` by pattern + qualname + order: marked sites
    keep their relative order, so the k-th recorded site of a (pattern, function) is the k-th
    marked one there — even after edits elsewhere moved every line."""
    marks = marked_sites(text)
    result = Located({}, {})
    groups: dict[tuple[str, str], list[CandidateState]] = {}
    for c in entries:
        groups.setdefault((c.pattern, c.qualname or "<module>"), []).append(c)
    for (pattern, qualname), group in groups.items():
        there = [m for m in marks if m.pattern == pattern and m.qualname == qualname]
        if len(there) != len(group):
            # the function may have been renamed since: fall back to the pattern's order in the file
            same_pattern = [c for c in entries if c.pattern == pattern]
            anywhere = [m for m in marks if m.pattern == pattern]
            if len(anywhere) == len(same_pattern):
                for c, m in zip(same_pattern, anywhere):
                    if c in group:
                        result.sites[c.id] = m
                continue
            for c in group:
                result.problems[c.id] = (
                    f"{c.file}: found {len(there)} npufuse-marked {pattern} site(s) in {qualname}, state.json records {len(group)}; "
                    "cannot tell which is this candidate (restore it by hand from the backup)"
                )
            continue
        for c, m in zip(group, there):
            result.sites[c.id] = m
    return result


def begin(state: State, rel: str, old_sha: str, new_sha: str, changes: dict[int, dict[str, Any] | None]) -> dict[str, Any]:
    """Record the intended write of ``rel`` and the new ``applied`` records, then save."""
    entry = {
        "file": rel,
        "from": old_sha,
        "to": new_sha,
        "before": {str(cid): copy.deepcopy(state.candidates[cid].applied) for cid in changes},
    }
    for cid, record in changes.items():
        state.candidates[cid].applied = record
    state.pending.append(entry)
    state.save()
    return entry


def commit(state: State, entry: dict[str, Any]) -> None:
    state.pending = [p for p in state.pending if p is not entry]
    state.save()


def abort(state: State, entry: dict[str, Any]) -> None:
    """The write failed (and left the file as it was): put the earlier records back."""
    _restore(state, entry)
    commit(state, entry)


def _restore(state: State, entry: dict[str, Any]) -> None:
    from npufuse.state import _applied_problem

    before = entry.get("before")
    if not isinstance(before, dict):  # a hand-edited journal: nothing to put back
        return
    for cid, record in before.items():
        try:
            c = state.candidates.get(int(cid))
        except (TypeError, ValueError):
            continue
        if record is not None and not (isinstance(record, dict) and _applied_problem(record) is None):
            continue
        if c is not None:
            c.applied = record
            c.history.append({"status": c.status, "note": f"write of {entry.get('file')} did not happen; record restored"})


def _remove_temp_files(path: Path) -> None:
    # safe_write's temp files (".<name>.<random>.npufuse-tmp") a killed process could not remove
    for tmp in path.parent.glob(f".{path.name}.*.npufuse-tmp"):
        try:
            tmp.unlink()
        except OSError:
            pass


def reconcile(state: State, root: Path) -> list[str]:
    """Settle writes a killed process left half-recorded. Returns notes for the user."""
    notes: list[str] = []
    if not state.pending:
        return notes
    keep: list[dict[str, Any]] = []
    for entry in state.pending:
        rel = entry.get("file", "")
        if not isinstance(rel, str):
            rel = repr(rel)[:80]
        try:
            path = safe_path(root, rel)
            data, _ = _read_regular(path, rel)  # a FIFO named by a tampered journal must not block
            _remove_temp_files(path)
        except (FileProblem, OSError):
            keep.append(entry)
            notes.append(f"{rel}: an interrupted npufuse write is recorded but the file cannot be read")
            continue
        sha = sha256_bytes(data)
        if sha == entry.get("to"):
            notes.append(f"{rel}: the interrupted npufuse write had completed; state updated")
        elif sha == entry.get("from"):
            _restore(state, entry)
            notes.append(f"{rel}: the interrupted npufuse write had not happened; the file is unchanged")
        else:
            keep.append(entry)
            notes.append(f"{rel}: changed after an interrupted npufuse write; check it against its backup")
    state.pending = keep
    state.save()
    return notes
