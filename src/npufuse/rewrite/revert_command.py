"""``npufuse revert [ID ...]``: restore the original code of rewritten sites (no ids: all).

    npufuse revert [ID ...] [--dry-run] [--force] [--state-dir .npufuse] [--root DIR]

Works from ``.npufuse/state.json`` alone (scan.json is only read to find the root), so it also
works after the scan was redone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from npufuse.cli import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ids", nargs="*", metavar="ID", help="candidate ids to revert (default: every applied one); 1,3 and 2-4 work too")
    parser.add_argument("--dry-run", action="store_true", help="print the unified diff; write nothing")
    parser.add_argument("--force", action="store_true", help="revert in files with uncommitted git changes that are not npufuse's own")
    parser.add_argument("--state-dir", default=".npufuse", help="folder holding state.json (default .npufuse)")
    parser.add_argument("--root", help="folder the recorded paths are relative to (default: from scan.json)")


def _ids(raw: list[str]) -> list[int] | None:
    if not raw:
        return None
    out: list[int] = []
    for token in ",".join(raw).split(","):
        token = token.strip()
        if not token:
            continue
        try:
            if "-" in token[1:]:
                a, b = token.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            else:
                out.append(int(token))
        except ValueError:
            raise UsageError(f"revert: {token!r} is not a candidate id") from None
    return sorted(set(out))


def _root(state_dir: Path, override: str | None) -> Path:
    from npufuse.rewrite.apply import resolve_root

    if override:
        return Path(override)
    scan = {}
    path = state_dir / "scan.json"
    if path.is_file():
        try:
            scan = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            scan = {}
    return resolve_root(scan if isinstance(scan, dict) else {}, state_dir)


def run(args: argparse.Namespace) -> int:
    from npufuse.rewrite import ledger
    from npufuse.rewrite.apply import Refused, unified_diff
    from npufuse.rewrite.command import print_results
    from npufuse.rewrite.revert import plan_revert, write_revert
    from npufuse.state import State

    state_dir = Path(args.state_dir)
    if not (state_dir / "state.json").is_file():
        raise UsageError(f"no {state_dir / 'state.json'}: nothing has been applied here")
    try:
        state = State.load(state_dir)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    root = _root(state_dir, args.root)
    ids = _ids(args.ids)
    # issue 16: candidates patched in npufuse_patches.py (installed packages) are reverted there
    from npufuse.rewrite import patch_module as pm

    try:
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
