"""``npufuse revert``: put the original code of rewritten sites back, byte for byte.

Each site's marked ``if`` is found by pattern + qualname + order (:func:`ledger.locate`) and
replaced by its ``else`` statements (:func:`transform.revert_source`), which keeps every edit the
user made elsewhere in the file. When every site of a file is reverted and the file is still
exactly what npufuse wrote, the backup taken before the first rewrite is the same bytes; it is
restored directly (and checked by hash against the scanned original).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from npufuse.rewrite import ledger, nesting
from npufuse.rewrite.apply import Refused, SiteResult
from npufuse.rewrite.files import FileProblem, SourceFile, git_changes, read_source_file, sha256_bytes
from npufuse.rewrite.transform import revert_source
from npufuse.state import CandidateState, State


@dataclass
class RevertFile:
    rel: str
    source: SourceFile
    new_bytes: bytes
    method: str  # "backup" | "in place"
    changes: dict[int, dict | None]
    reverted: list[int]


@dataclass
class RevertPlan:
    results: list[SiteResult] = field(default_factory=list)
    files: list[RevertFile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _result(c: CandidateState, status: str, reason: str = "") -> SiteResult:
    rec = c.applied or {}
    from npufuse.rewrite.apply import recorded_switch

    switch = recorded_switch(rec, None)
    return SiteResult(c.id, c.pattern, c.file, c.qualname, status, reason, switch, tuple(rec.get("span") or ()) or None, tuple(rec.get("scan_span") or ()) or None)


def plan_revert(state: State, root: Path, state_dir: Path, ids: list[int] | None, *, force: bool = False, check_git: bool = True, use_backup: bool = True) -> RevertPlan:
    """What ``revert`` would write. Raises :class:`Refused` for unknown ids, unreadable files and
    files with uncommitted changes that are not npufuse's own (without ``force``)."""
    plan = RevertPlan()
    applied = {cid: c for cid, c in state.candidates.items() if c.applied}
    if ids is None:
        targets = sorted(applied)
    else:
        unknown = [i for i in ids if i not in state.candidates]
        if unknown:
            raise Refused(f"candidate{'s' if len(unknown) > 1 else ''} {', '.join(map(str, unknown))} {'are' if len(unknown) > 1 else 'is'} not in {state.path} (nothing applied under that id)")
        for i in ids:
            if i not in applied:
                plan.results.append(_result(state.candidates[i], "skipped", "not applied"))
        targets = [i for i in ids if i in applied]
    by_file: dict[str, list[int]] = {}
    for cid in targets:
        by_file.setdefault(applied[cid].file, []).append(cid)
    for rel in sorted(by_file):
        try:
            src = read_source_file(root, rel)
        except FileProblem as exc:
            raise Refused(str(exc)) from None
        everyone = ledger.applied_in(state, rel)
        wanted = [c for c in everyone if c.id in by_file[rel]]
        before = everyone[0].applied.get("file_sha256_before")
        after = ledger.file_hash_after(everyone)
        if src.sha256 == before:
            for c in everyone:
                plan.results.append(_result(c, "reverted", "the file already holds the scanned original"))
            plan.files.append(RevertFile(rel, src, src.data, "none", {c.id: None for c in everyone}, [c.id for c in everyone]))
            continue
        if src.read_only and not force:
            raise Refused(f"{rel} is read-only (its owner has no write permission); make it writable, or pass --force to revert it anyway (its mode is kept)")
        if check_git and not force and src.sha256 != after:
            changes = git_changes(root, src.path)
            if changes:
                raise Refused(f"{rel} has uncommitted changes (git status: {changes.splitlines()[0].strip()}); commit or stash them first, or pass --force")
        # before any libcst parse: a file edited to nest deeper than libcst's native parser
        # survives would kill the process (SIGSEGV); its sites are skipped, the file left as it is
        too_deep = nesting.problem(src.text)
        if too_deep:
            for c in wanted:
                plan.results.append(_result(c, "skipped", f"{rel}: {too_deep}"))
            continue
        try:
            found = ledger.locate(src.text, everyone)
        except Exception as exc:  # edited into something libcst cannot parse: a result, not a crash
            first = str(exc).splitlines()[0] if str(exc) else ""
            for c in wanted:
                plan.results.append(_result(c, "skipped", f"libcst cannot parse {rel}: {type(exc).__name__}: {first}; fix the file (or restore it from the backup) and revert again"))
            continue
        go = [c for c in wanted if c.id in found.sites]
        for c in wanted:
            if c.id in found.problems:
                plan.results.append(_result(c, "skipped", found.problems[c.id]))
        if not go:
            continue
        method = "in place"
        new_bytes = b""
        recorded = everyone[0].applied.get("backup")
        if use_backup and len(go) == len(everyone) and src.sha256 == after and isinstance(recorded, str) and recorded:
            data = _read_backup(state_dir, recorded)
            if data is not None and sha256_bytes(data) == before:
                new_bytes, method = data, "backup"
        notes: list[str] = []
        if method != "backup":
            outcome = revert_source(src.text, {found.sites[c.id].line for c in go})
            notes = outcome.notes
            new_bytes = src.encode(outcome.text)
        new_text = new_bytes.decode(src.encoding)
        changes: dict[int, dict | None] = {c.id: None for c in go}
        rest = [c for c in everyone if c.id not in changes]
        if rest:
            where = ledger.locate(new_text, rest)
            for c in rest:
                rec = dict(c.applied)
                if c.id in where.sites:
                    rec["span"] = [where.sites[c.id].line, where.sites[c.id].end_line]
                # Still "as npufuse wrote it from the original" only if it was before this revert;
                # with the user's edits in it, neither the backup nor apply's reconstruction holds.
                rec["file_sha256_after"] = sha256_bytes(new_bytes) if src.sha256 == after else None
                changes[c.id] = rec
        for c in go:
            plan.results.append(_result(c, "would revert", "; ".join(notes)))
        plan.notes += [f"{rel}: {n}" for n in notes]
        plan.files.append(RevertFile(rel, src, new_bytes, method, changes, [c.id for c in go]))
    plan.results.sort(key=lambda r: r.id)
    return plan


def _read_backup(state_dir: Path, recorded: str) -> bytes | None:
    """The backup state.json names, read only from under the state folder's ``backup/`` without
    following links (state.json may be tampered with); None when it is not there or not safe."""
    from npufuse.state_folder import read_state_file

    if not recorded.replace("\\", "/").startswith("backup/"):
        return None
    try:
        return read_state_file(state_dir, recorded)
    except OSError:
        return None


def write_revert(plan: RevertPlan, state: State, *, write: Callable[[Path, bytes], None] | None = None) -> None:
    """Write each planned file (journalled like apply; re-checked against the bytes planned on)."""
    from npufuse.rewrite.apply import write_source
    from npufuse.safe_write import ChangedMeanwhile

    for rf in plan.files:
        for cid in rf.reverted:
            c = state.candidates[cid]
            how = {"backup": "restored from the backup", "in place": "original statements put back", "none": "file already original"}[rf.method]
            c.history.append({"status": c.status, "note": f"reverted ({how})"})
        entry = ledger.begin(state, rf.rel, rf.source.sha256, sha256_bytes(rf.new_bytes), rf.changes)
        if rf.new_bytes != rf.source.data:
            try:
                write_source(rf.source, rf.new_bytes, write)
            except OSError as exc:
                ledger.abort(state, entry)
                what = exc.strerror if isinstance(exc, ChangedMeanwhile) else f"cannot write ({exc.strerror or exc}); it is unchanged"
                raise Refused(f"{rf.rel}: {what}") from None
        ledger.commit(state, entry)
    for r in plan.results:
        if r.status == "would revert":
            r.status = "reverted"
