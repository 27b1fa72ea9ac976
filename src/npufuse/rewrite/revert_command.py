"""``npufuse revert [ID ...]``: restore the original code of rewritten sites (no ids: all).

    npufuse revert [ID ...] [--dry-run] [--force] [--state-dir .npufuse] [--root DIR]

Works from ``.npufuse/state.json`` alone (scan.json is only read to find the root), so it also
works after the scan was redone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from npufuse.cli import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ids", nargs="*", metavar="ID", help="candidate ids to revert (default: every applied one); 1,3 and 2-4 work too")
    parser.add_argument("--dry-run", action="store_true", help="print the unified diff; write nothing")
    parser.add_argument("--force", action="store_true", help="revert in files with uncommitted git changes that are not npufuse's own")
    parser.add_argument("--state-dir", default=".npufuse", help="folder holding state.json (default .npufuse)")
    parser.add_argument("--root", help="folder the recorded paths are relative to (default: from scan.json)")


def _ids(raw: list[str], known: list[int], state_path: Path) -> list[int] | None:
    """The ids named on the command line; ranges are checked against ``known`` (the ids in
    state.json), not expanded number by number (``revert 1-1000000000`` must not allocate)."""
    from npufuse.rewrite.apply import Refused, expand_ids

    if not raw:
        return None
    tokens = [t.strip() for t in ",".join(raw).split(",") if t.strip()]
    try:
        ids, unknown = expand_ids(tokens, known, "revert:")
    except Refused as exc:
        raise UsageError(f"{exc}; not a candidate id") from None
    if unknown:
        many = len(unknown) > 1
        raise UsageError(f"candidate{'s' if many else ''} {', '.join(u[:40] for u in unknown[:10])} {'are' if many else 'is'} not in {state_path} (nothing applied under that id)")
    return ids


def _root(state_dir: Path, override: str | None) -> Path:
    from npufuse.rewrite.apply import read_scan_json, resolve_root

    if override:
        return Path(override)
    got = read_scan_json(state_dir)
    scan = got[0] if got is not None else {}
    return resolve_root(scan if isinstance(scan, dict) else {}, state_dir)


def run(args: argparse.Namespace) -> int:
    from npufuse.state_folder import StateBusy, UnsafeStatePath, lock, state_file_exists

    state_dir = Path(args.state_dir)
    try:
        if not state_file_exists(state_dir, "state.json"):
            raise UsageError(f"no {state_dir / 'state.json'}: nothing has been applied here")
        if args.dry_run:
            return _run(args, state_dir)
        with lock(state_dir, verb="npufuse revert"):
            return _run(args, state_dir)
    except (UnsafeStatePath, StateBusy) as exc:
        raise UsageError(str(exc)) from None


def _run(args: argparse.Namespace, state_dir: Path) -> int:
    from npufuse.rewrite import ledger
    from npufuse.rewrite.apply import Refused, unified_diff
    from npufuse.rewrite.command import print_results
    from npufuse.rewrite.revert import plan_revert, write_revert
    from npufuse.state import State

    try:
        state = State.load(state_dir)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    ids = _ids(args.ids, list(state.candidates), state.path)
    # issue 16: candidates patched in npufuse_patches.py (installed packages) are reverted there
    from npufuse.rewrite import patch_module as pm

    try:
        root = _root(state_dir, args.root)
        from npufuse.rewrite.apply import load_scan

        patched, message = pm.revert(state, root, lambda: load_scan(state_dir, args.root), ids, dry_run=args.dry_run)
    except (pm.PatchRefused, Refused, OSError) as exc:
        raise UsageError(str(exc)) from None
    if patched:
        print(f"npufuse revert: candidate(s) {', '.join(map(str, patched))}: {message}")
        # the rest (sites rewritten in place) go on to the rewrite's revert
        rest = ids if ids is not None else sorted(cid for cid, c in state.candidates.items() if c.applied)
        ids = [i for i in rest if i not in patched]
        if not ids:
            return 0
    try:
        root = _root(state_dir, args.root)
        notes = ledger.reconcile(state, root) if not args.dry_run else []
        plan = plan_revert(state, root, state_dir, ids, force=args.force)
    except Refused as exc:
        raise UsageError(str(exc)) from None
    notes += plan.notes
    if args.dry_run:
        for rf in plan.files:
            sys.stdout.write(unified_diff(rf.rel, rf.source.text, rf.new_bytes.decode(rf.source.encoding)))
        print_results(plan.results, "npufuse revert --dry-run (nothing written)", notes)
        return 1 if any(r.status == "skipped" for r in plan.results) else 0
    try:
        write_revert(plan, state)
    except Refused as exc:
        raise UsageError(str(exc)) from None
    n = sum(r.status == "reverted" for r in plan.results)
    print_results(plan.results, f"npufuse revert: {n} site(s) restored in {len(plan.files)} file(s)" if plan.results else "npufuse revert: nothing applied", notes)
    return 1 if any(r.status == "skipped" for r in plan.results) else 0
