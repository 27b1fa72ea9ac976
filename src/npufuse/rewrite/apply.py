"""Stage 2 gate: rewrite exactly the accepted candidates of the current scan.

:func:`plan_apply` reads every file involved and computes the new text of each without writing
anything (so a refusal — stale scan, unknown id, dirty file — leaves every file untouched, and
``--dry-run`` is the plan's diff); :func:`write_plan` then writes file by file, atomically, with
a backup of each original and a journal entry around each write (:mod:`npufuse.rewrite.ledger`).

A file may have been rewritten by an earlier ``apply`` of the same scan. When its bytes are
exactly what npufuse last wrote, reverting npufuse's own sites in memory must give back the
scanned bytes (checked by hash); the earlier and the new sites are then rendered together on the
scanned original, where scan.json's line numbers hold — so applying 1 then 3 writes the same
file as applying 1,3 at once — and removing the new sites from the result must give back the
current file (checked), so nothing else moves.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from npufuse.patterns.base import Finding
from npufuse.rewrite import ledger, nesting
from npufuse.rewrite.codegen import Switch, env_switch, guard_expression, source_lines
from npufuse.rewrite.files import FileProblem, SourceFile, backup_path, git_changes, read_source_file, sha256_bytes
from npufuse.rewrite.transform import SiteEdit, revert_source, rewrite_source
from npufuse.safe_write import write_bytes_atomic
from npufuse.state import State


class Refused(ValueError):
    """The whole command is refused before anything is written; the message is one line."""


# -- scan.json -------------------------------------------------------------------------------------


@dataclass
class Scan:
    data: dict[str, Any]
    sha256: str
    path: Path
    root: Path

    @property
    def candidates(self) -> list[dict[str, Any]]:
        return self.data.get("candidates", [])

    def by_id(self) -> dict[int, dict[str, Any]]:
        return {int(c["id"]): c for c in self.candidates}


_REQUIRED = ("id", "key", "pattern", "file", "line", "end_line", "fused", "guard_tensor", "file_sha256")


_FIELD_TYPES = {"id": int, "line": int, "end_line": int, "key": str, "pattern": str, "file": str, "fused": str, "guard_tensor": str, "file_sha256": str}


def read_scan_json(state_dir: Path) -> tuple[Any, bytes] | None:
    """scan.json's parsed content and bytes (None when absent), read through the state folder's
    no-symlink reader; raises Refused for a link, special file, bad bytes or too deep JSON."""
    from npufuse.state_folder import read_state_file

    path = Path(state_dir) / "scan.json"
    try:
        raw = read_state_file(state_dir, "scan.json")
    except OSError as exc:
        raise Refused(str(exc) if exc.filename else f"{path}: cannot read ({exc.strerror or exc})") from None
    if raw is None:
        return None
    try:
        return json.loads(raw.decode("utf-8")), raw
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Refused(f"{path}: not a readable scan ({exc}); run `npufuse scan` again") from None
    except RecursionError:
        raise Refused(f"{path}: not a readable scan (nested too deeply); run `npufuse scan` again") from None


def load_scan(state_dir: Path, root: str | None = None) -> Scan:
    path = Path(state_dir) / "scan.json"
    got = read_scan_json(state_dir)
    if got is None:
        raise Refused(f"no scan at {path}; run `npufuse scan PATH` first")
    data, raw = got
    if not isinstance(data, dict) or data.get("tool") != "npufuse" or not isinstance(data.get("candidates"), list):
        raise Refused(f"{path}: not an npufuse scan.json (no candidates list); run `npufuse scan` again")
    seen: set[int] = set()
    for c in data["candidates"]:
        missing = [k for k in _REQUIRED if not isinstance(c, dict) or k not in c]
        if missing:
            cid = c.get("id", "?") if isinstance(c, dict) else "?"
            raise Refused(f"{path}: candidate {str(cid)[:20]} lacks {', '.join(missing)}; this scan.json is from another npufuse version, run `npufuse scan` again")
        wrong = [k for k, t in _FIELD_TYPES.items() if not isinstance(c[k], t) or isinstance(c[k], bool)]
        if wrong or c["id"] in seen:
            why = f"{', '.join(wrong)} of the wrong type" if wrong else "a duplicate id"
            raise Refused(f"{path}: candidate {str(c['id'])[:20]} has {why}; run `npufuse scan` again")
        seen.add(c["id"])
    return Scan(data, sha256_bytes(raw), path, resolve_root(data, Path(state_dir), root))


def resolve_root(scan: dict[str, Any], state_dir: Path, override: str | None = None) -> Path:
    """The folder scan.json's paths are relative to: ``--root``, else scan.json's ``root``
    (absolute, or relative to the folder holding the state dir — where ``npufuse scan`` ran —
    or to the current folder), else the folder holding the state dir itself.

    scan.json may come with a cloned repository, so its ``root`` is believed only when it lies
    inside the folder holding the state dir (the repository), or when this user's npufuse wrote
    this very scan.json (:func:`npufuse.user_secret.vouches_for_scan`); anything else is
    refused, naming ``--root`` to confirm it."""
    if override:
        return Path(override)
    base = Path(state_dir).resolve().parent
    label = scan.get("root") if isinstance(scan.get("root"), str) and scan.get("root") else "."
    options = [Path(label)] if Path(label).is_absolute() else [base / label, Path.cwd() / label, base]
    files = [c.get("file") for c in scan.get("candidates", []) if isinstance(c, dict) and isinstance(c.get("file"), str) and c.get("file")]
    chosen = options[0]
    for option in options:
        try:
            if option.is_dir() and all((option / f).exists() for f in files[:20]):
                chosen = option
                break
        except (OSError, ValueError):  # a name with NUL or too long: not this option
            continue
    _check_root(chosen, base, state_dir)
    return chosen


def _check_root(root: Path, base: Path, state_dir: Path) -> None:
    from npufuse.user_secret import vouches_for_scan

    try:
        resolved = root.resolve()
    except (OSError, RuntimeError, ValueError):
        resolved = root
    if resolved == base or base in resolved.parents:
        return
    if vouches_for_scan(Path(state_dir)):
        return
    raise Refused(
        f"{Path(state_dir) / 'scan.json'}: its root {str(root)[:200]!r} is outside {base} (the folder holding the state dir), "
        f"and this scan.json was not written by npufuse for this user; pass --root {str(root)[:200]} to confirm, or run `npufuse scan` again"
    )


def expand_ids(tokens: Iterable[str], known: Iterable[int], what: str) -> tuple[list[int], list[str]]:
    """The ids named by ``tokens`` (``3``, ``2-4``), and the tokens naming ids not in ``known``.
    A range is checked against the known ids, never expanded number by number: ``1-1000000000``
    costs what the known ids cost. Raises Refused for a token that is not an id or a range."""
    known_sorted = sorted(set(known))
    ids: set[int] = set()
    unknown: list[str] = []
    for part in tokens:
        try:
            if "-" in part[1:]:
                a_text, b_text = part[0] + part[1:].split("-", 1)[0], part[1:].split("-", 1)[1]
                a, b = int(a_text), int(b_text)
                if a > b:
                    raise ValueError
                inside = [i for i in known_sorted if a <= i <= b]
                if len(inside) != b - a + 1:
                    unknown.append(part)
                ids.update(inside)
            else:
                n = int(part)
                (ids.add(n) if n in known_sorted else unknown.append(part))
        except ValueError:
            raise Refused(f"{what} {part[:40]!r}: expected candidate ids such as 1,3 or 2-4") from None
    return sorted(ids), unknown


def parse_ids(text: str, known: Iterable[int]) -> list[int] | None:
    """``1,3``, ``2-4``, or ``all`` (None). Raises Refused for anything else or unknown ids."""
    text = text.strip()
    if text.lower() == "all":
        return None
    known = set(known)
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise Refused("--accept: no candidate ids given (e.g. --accept 1,3 or --accept all)")
    try:
        ids, unknown = expand_ids(parts, known, "--accept")
    except Refused:
        raise Refused(f"--accept {text[:60]!r}: expected candidate ids such as 1,3 or 2-4, or all") from None
    if unknown:
        have = f"the scan has ids {min(known)}-{max(known)}" if known else "the scan has no candidates"
        raise Refused(f"unknown candidate id{'s' if len(unknown) > 1 else ''} {', '.join(u[:40] for u in unknown[:10])} ({have}; see report.md)")
    return ids


# -- results -----------------------------------------------------------------------------------------


@dataclass
class SiteResult:
    id: int
    pattern: str
    file: str
    qualname: str
    status: str  # applied | would apply | already fused | skipped | reverted | would revert
    reason: str = ""
    switch: Switch | None = None
    span: tuple[int, int] | None = None
    scan_span: tuple[int, int] | None = None


@dataclass
class FilePlan:
    rel: str
    source: SourceFile
    new_text: str
    new_bytes: bytes
    scan_sha: str
    first_rewrite: bool  # no npufuse site in the file yet: the current bytes are the original
    changes: dict[int, dict[str, Any] | None]  # candidate id -> its new ``applied`` record

    def diff(self) -> str:
        return unified_diff(self.rel, self.source.text, self.new_text)


@dataclass
class ApplyPlan:
    results: list[SiteResult] = field(default_factory=list)
    files: list[FilePlan] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def skipped(self) -> list[SiteResult]:
        return [r for r in self.results if r.status == "skipped"]


def unified_diff(rel: str, old: str, new: str) -> str:
    def lines(text: str) -> list[str]:
        out = source_lines(text)
        if out and not out[-1].endswith(("\n", "\r")):
            out[-1] += "\n\\ No newline at end of file\n"
        return out

    return "".join(difflib.unified_diff(lines(old), lines(new), fromfile=f"a/{rel}", tofile=f"b/{rel}"))


# -- planning --------------------------------------------------------------------------------------


def candidate_switch(candidate: dict[str, Any], override: Switch | None) -> Switch:
    if override is not None:
        return override
    try:
        return Switch.from_json(candidate.get("switch"))
    except ValueError:
        return env_switch(candidate["pattern"])  # DESIGN.md rule 1's default


def recorded_switch(rec: dict[str, Any], default: Switch | None) -> Switch | None:
    """The switch a state.json record names, or ``default`` when it names none or a malformed
    one (state.json is hand-editable: shown, never trusted to parse)."""
    try:
        return Switch.from_json(rec.get("switch")) if rec.get("switch") else default
    except ValueError:
        return default


def _finding(c: dict[str, Any]) -> Finding:
    return Finding(
        pattern=c["pattern"], qualname=c.get("qualname", ""), line=int(c["line"]), end_line=int(c["end_line"]),
        params=c.get("params") or {}, fused=c["fused"], guard_tensor=c["guard_tensor"],
    )


def sync_state_with_scan(state: State, scan: Scan) -> None:
    """The state's ids are the scan's ids. A new scan renumbers candidates, so state entries of
    an older scan are dropped — unless one is still rewritten in its file, which would lose
    track of it: then refuse, saying how to get back to a consistent place."""
    if state.scan_sha256 in ("", scan.sha256):
        state.scan_sha256 = scan.sha256
        return
    live = sorted(c.id for c in state.candidates.values() if c.applied)
    if live:
        raise Refused(
            f"{state.path} records candidate(s) {', '.join(map(str, live))} applied from an earlier scan, and scan.json has changed since; "
            "run `npufuse revert` first, then `npufuse scan` and `npufuse apply` again"
        )
    by_id = scan.by_id()
    state.candidates = {cid: c for cid, c in state.candidates.items() if cid in by_id and by_id[cid]["key"] == c.key}
    state.scan_sha256 = scan.sha256


def plan_apply(
    scan: Scan,
    state: State,
    ids: list[int] | None,
    *,
    only: list[str] | None = None,
    switch: Switch | None = None,
    force: bool = False,
    check_git: bool = True,
) -> ApplyPlan:
    """What ``apply`` would write; raises :class:`Refused` (nothing written) for a stale scan,
    a file that cannot be read, or a file with uncommitted changes (without ``force``)."""
    plan = ApplyPlan()
    by_id = scan.by_id()
    chosen = [by_id[i] for i in (ids if ids is not None else sorted(by_id))]
    accepted = []
    for c in chosen:
        if only and c["pattern"] not in only:
            if ids is not None:  # named explicitly but filtered out: say so
                plan.results.append(SiteResult(int(c["id"]), c["pattern"], c["file"], c.get("qualname", ""), "skipped", f"pattern {c['pattern']} is not selected by --only"))
            continue
        accepted.append(c)
    files: dict[str, list[dict[str, Any]]] = {}
    for c in accepted:
        files.setdefault(c["file"], []).append(c)
    for rel in sorted(files):
        fp = _plan_file(scan, state, rel, files[rel], switch, plan)
        if fp is None:
            continue
        if fp.source.read_only and not force:
            raise Refused(f"{rel} is read-only (its owner has no write permission); make it writable, or pass --force to rewrite it anyway (its mode is kept)")
        if check_git and not force:
            earlier = ledger.applied_in(state, rel)
            ours = bool(earlier) and fp.source.sha256 == ledger.file_hash_after(earlier)
            changes = None if ours else git_changes(scan.root, fp.source.path)
            if changes:
                raise Refused(f"{rel} has uncommitted changes (git status: {changes.splitlines()[0].strip()}); commit or stash them first, or pass --force")
        plan.files.append(fp)
    plan.results.sort(key=lambda r: r.id)
    return plan


def _plan_file(scan: Scan, state: State, rel: str, cands: list[dict[str, Any]], override: Switch | None, plan: ApplyPlan) -> FilePlan | None:
    try:
        src = read_source_file(scan.root, rel)
    except FileProblem as exc:
        raise Refused(str(exc)) from None
    # before any libcst parse: a file nested deeper than libcst's native parser survives would
    # kill the process (SIGSEGV); it is skipped, byte for byte as it is
    too_deep = nesting.problem(src.text)
    if too_deep:
        for c in cands:
            plan.results.append(SiteResult(int(c["id"]), c["pattern"], rel, c.get("qualname", ""), "skipped", f"{rel}: {too_deep}", scan_span=(int(c["line"]), int(c["end_line"]))))
        return None
    scan_sha = cands[0]["file_sha256"]
    earlier = ledger.applied_in(state, rel)
    prior: list = []
    if src.sha256 == scan_sha:
        base = src.text
        if earlier:  # restored outside npufuse (git checkout, editor): the records are stale
            for c in earlier:
                c.applied = None
                c.history.append({"status": c.status, "note": "no longer rewritten: the file is back to the scanned original"})
            plan.notes.append(f"{rel}: npufuse's earlier rewrite is no longer in the file (it holds the scanned original); state updated")
            earlier = []
    elif earlier and src.sha256 == ledger.file_hash_after(earlier):
        reverted = revert_source(src.text)
        if sha256_bytes(src.encode(reverted.text)) != scan_sha:
            raise Refused(f"{rel}: removing npufuse's own sites does not give back the scanned file; run `npufuse revert` and `npufuse scan` again")
        base, prior = reverted.text, earlier
    elif earlier:
        raise Refused(
            f"{rel} changed since npufuse rewrote it; to rewrite more of it, `npufuse revert {' '.join(str(c.id) for c in earlier)}`, "
            "then `npufuse scan` and `npufuse apply` again"
        )
    else:
        raise Refused(f"{rel} changed since the scan (its content hash differs from scan.json's); run `npufuse scan` again")

    applied_ids = {c.id for c in earlier}
    new: list[dict[str, Any]] = []
    for c in cands:
        cid = int(c["id"])
        switch = candidate_switch(c, override)
        if cid in applied_ids:
            rec = state.candidates[cid].applied or {}
            plan.results.append(SiteResult(cid, c["pattern"], rel, c.get("qualname", ""), "already fused", "", recorded_switch(rec, switch), tuple(rec.get("span") or ()) or None, (int(c["line"]), int(c["end_line"]))))
        else:
            new.append(c)
    if not new:
        return None

    edits: list[SiteEdit] = []
    for p in prior:
        rec = p.applied
        a, b = rec["scan_span"]
        edits.append(SiteEdit(a, b, scan.by_id()[p.id]["fused"], rec["guard"], p.pattern, str(p.id)))
    guards: dict[int, tuple[Switch, str]] = {}
    for c in new:
        switch = candidate_switch(c, override)
        guard = guard_expression(_finding(c), switch, int(c["id"]))
        guards[int(c["id"])] = (switch, guard)
        edits.append(SiteEdit(int(c["line"]), int(c["end_line"]), c["fused"], guard, c["pattern"], str(c["id"])))
    try:
        outcome = rewrite_source(base, edits)
    except Exception as exc:  # libcst cannot parse the file: a result for these sites, not a crash
        why = f"{rel}: {exc}" if isinstance(exc, nesting.TooDeep) else f"libcst cannot parse {rel}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        for c in new:
            plan.results.append(SiteResult(int(c["id"]), c["pattern"], rel, c.get("qualname", ""), "skipped", why))
        return None
    reasons = {e.tag: why for e, why in outcome.skipped}
    for p in prior:
        if str(p.id) in reasons:
            raise Refused(f"{rel}: npufuse's earlier site {p.id} no longer renders ({reasons[str(p.id)]}); run `npufuse revert {p.id}` first")
    done = [c for c in new if str(c["id"]) not in reasons]
    for c in new:
        if str(c["id"]) in reasons:
            why = reasons[str(c["id"])]
            status = "already fused" if why.startswith("already fused") else "skipped"
            plan.results.append(SiteResult(int(c["id"]), c["pattern"], rel, c.get("qualname", ""), status, why, guards[int(c["id"])][0], scan_span=(int(c["line"]), int(c["end_line"]))))
    if not done:
        return None
    if prior:
        # Only the new sites may differ from the current file.
        check = revert_source(outcome.text, {outcome.spans[str(c["id"])][0] for c in done})
        if check.text != src.text:
            raise Refused(f"{rel}: cannot add sites to npufuse's earlier rewrite without disturbing it; run `npufuse revert` and apply all sites together")
    new_bytes = src.encode(outcome.text)
    after = sha256_bytes(new_bytes)
    backup = str(backup_path(Path("."), rel).as_posix())
    changes: dict[int, dict[str, Any] | None] = {}
    for p in prior:
        rec = dict(p.applied)
        rec["span"] = list(outcome.spans[str(p.id)])
        rec["file_sha256_after"] = after
        changes[p.id] = rec
    for c in done:
        cid = int(c["id"])
        switch, guard = guards[cid]
        span = outcome.spans[str(cid)]
        changes[cid] = {
            "switch": switch.to_json(),
            "switch_description": switch.describe(),
            "off": switch.off_hint(cid),
            "guard": guard,
            "span": list(span),
            "scan_span": [int(c["line"]), int(c["end_line"])],
            "file_sha256_before": scan_sha,
            "file_sha256_after": after,
            "backup": backup,
        }
        plan.results.append(SiteResult(cid, c["pattern"], rel, c.get("qualname", ""), "would apply", "", switch, span, (int(c["line"]), int(c["end_line"]))))
    for r in plan.results:  # earlier sites moved if a new one landed above them
        if r.file == rel and r.status == "already fused" and r.id in changes:
            r.span = tuple(changes[r.id]["span"])
    return FilePlan(rel, src, outcome.text, new_bytes, scan_sha, not earlier, changes)


# -- writing ---------------------------------------------------------------------------------------


def write_plan(plan: ApplyPlan, state: State, scan: Scan, state_dir: Path, *, write: Callable[[Path, bytes], None] | None = None) -> None:
    """Write every planned file: backup of the original first (first rewrite only, into the
    state folder without following links), then the journal entry, then the atomic replace —
    after hashing the file once more, so an editor's save since planning is never overwritten —
    then the journal cleared. A symlinked source is written through (its target inside the root
    is edited, the link kept). ``write`` is a seam for crash tests (the re-check then runs just
    before it)."""
    from npufuse.safe_write import ChangedMeanwhile
    from npufuse.state_folder import write_state_file

    for c in scan.candidates:
        if any(int(c["id"]) in fp.changes for fp in plan.files):
            state.ensure(c)
    for fp in plan.files:
        if fp.first_rewrite:
            backup = backup_path(Path("."), fp.rel).as_posix()
            try:
                write_state_file(state_dir, backup, fp.source.data)
            except OSError as exc:
                raise Refused(f"{backup_path(state_dir, fp.rel)}: cannot write the backup ({exc.strerror or exc}); {fp.rel} is unchanged") from None
        new_here = [r for r in plan.results if r.status == "would apply" and r.file == fp.rel]
        for r in new_here:
            c = state.candidates[r.id]
            c.history.append({"status": c.status, "note": f"applied behind {fp.changes[r.id]['switch_description']}"})
        entry = ledger.begin(state, fp.rel, fp.source.sha256, sha256_bytes(fp.new_bytes), fp.changes)
        try:
            write_source(fp.source, fp.new_bytes, write)
        except OSError as exc:  # disk full, permissions, edited meanwhile: the file is as it was
            ledger.abort(state, entry)
            done = [f.rel for f in plan.files[: plan.files.index(fp)]]
            what = exc.strerror if isinstance(exc, ChangedMeanwhile) else f"cannot write ({exc.strerror or exc}); it is unchanged"
            raise Refused(f"{fp.rel}: {what}" + (f" (already written: {', '.join(done)})" if done else "")) from None
        ledger.commit(state, entry)
    for r in plan.results:
        if r.status == "would apply":
            r.status = "applied"


def write_source(source: SourceFile, data: bytes, write: Callable[[Path, bytes], None] | None = None) -> None:
    """Replace a source file that was read as ``source`` by ``data``, unless its bytes changed
    since (:class:`~npufuse.safe_write.ChangedMeanwhile`). Mode and owner are kept; a symlink's
    target is what is written."""
    from npufuse.safe_write import ChangedMeanwhile, _sha256_now

    target = source.write_path
    if write is None:
        write_bytes_atomic(target, data, expect_sha256=source.sha256)
        return
    if _sha256_now(target) != source.sha256:
        raise ChangedMeanwhile(11, "changed while npufuse was writing it (an editor saved?); left as it is now", str(target))
    write(target, data)
