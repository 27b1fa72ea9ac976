"""``npufuse apply``: the stage 2 gate (see :mod:`npufuse.rewrite.apply`).

    npufuse apply --accept 1,3|all [--only rms_norm,...] [--dry-run] [--switch NAME|EXPR]
                  [--force] [--state-dir .npufuse] [--root DIR]

Exit 0 when every accepted site is rewritten (or already was), 1 when some were skipped (each
with its reason), 2 for bad input (no scan, unknown id, stale scan, dirty file, bad --switch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable

from npufuse.cli import UsageError

PATTERN_HELP = "comma-separated pattern ids (rms_norm,swiglu,...)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--accept", required=True, metavar="IDS", help="candidate ids from the scan report: 1,3 or 2-4 or all")
    parser.add_argument("--only", metavar="PATTERNS", help=f"restrict to these patterns: {PATTERN_HELP}")
    parser.add_argument("--dry-run", action="store_true", help="print the unified diff; write nothing")
    parser.add_argument(
        "--switch", metavar="NAME",
        help="switch for the rewritten sites instead of the scan's choice: an UPPER_CASE name is an environment "
        "variable (on unless set to 0), anything else a Python expression used as is (e.g. self.config.use_npu_fused)",
    )
    parser.add_argument("--force", action="store_true", help="rewrite files with uncommitted git changes too")
    parser.add_argument("--state-dir", default=".npufuse", help="folder holding scan.json and state.json (default .npufuse)")
    parser.add_argument("--root", help="folder scan.json's paths are relative to (default: from scan.json)")


def _only(text: str | None, scan_patterns: Iterable[str]) -> list[str] | None:
    if not text:
        return None
    from npufuse.patterns.registry import PATTERN_IDS

    wanted = [w.strip() for w in text.split(",") if w.strip()]
    known = set(PATTERN_IDS) | set(scan_patterns)
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise UsageError(f"--only: unknown pattern id {', '.join(repr(u) for u in unknown)}; known ids: {', '.join(sorted(known))}")
    return wanted


def print_results(results, title: str, notes: list[str]) -> None:
    """The summary table (rich); every skipped site with its reason."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from npufuse.text_safety import TROJAN_SOURCE_WARNING, escape_text, has_unsafe

    console = Console(highlight=False)
    # file names, qualnames and reasons come from the repository: bidi and terminal controls
    # are shown escaped (Trojan Source), with a warning
    unsafe = any(has_unsafe(f"{r.file}{r.qualname}{r.reason}") for r in results) or any(has_unsafe(n) for n in notes)
    table = Table(title=title, title_justify="left", show_lines=False)
    for col in ("id", "pattern", "site", "result", "switch"):
        table.add_column(col, overflow="fold")
    for r in results:
        span = r.span or r.scan_span
        where = f"{r.file}:{span[0]}-{span[1]}" if span else r.file
        if r.qualname:
            where += f" ({r.qualname})"
        result = r.status + (f": {r.reason}" if r.reason else "")
        table.add_row(str(r.id), escape(escape_text(r.pattern)), escape(escape_text(where)), escape(escape_text(result)), escape(escape_text(r.switch.off_hint()) if r.switch and r.status != "skipped" else ""))
    console.print(table)
    for note in notes:
        console.print(f"note: {escape(escape_text(note))}")
    if unsafe:
        console.print(escape(TROJAN_SOURCE_WARNING))


def print_switches(results) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    groups: dict[str, list] = {}
    for r in results:
        if r.switch is not None and r.status in ("applied", "would apply", "already fused"):
            groups.setdefault(r.switch.describe(), []).append(r)
    if not groups:
        return
    console.print("Switches (fused only where torch_npu is importable and the tensor is on an NPU):")
    for describe, rs in groups.items():
        ids = ", ".join(str(r.id) for r in rs)
        pats = ", ".join(sorted({r.pattern for r in rs}))
        extra = "" if rs[0].switch.kind == "env" else f"; {describe}"
        console.print(f"  {escape(rs[0].switch.off_hint())}  runs the original code of candidate(s) {ids} ({pats}){escape(extra)}")
    every = sorted({r.id for rs in groups.values() for r in rs})
    console.print(f"  NPUFUSE_OFF=<ids> runs the original code of just those candidates, NPUFUSE_ONLY=<ids> keeps just those fused "
                  f"(each site's own switch; e.g. NPUFUSE_ONLY={every[0]})")


def run(args: argparse.Namespace) -> int:
    from npufuse.state_folder import StateBusy, UnsafeStatePath, lock

    state_dir = Path(args.state_dir)
    try:
        if args.dry_run or not state_dir.is_dir():  # no state folder: _run says there is no scan
            return _run(args, state_dir)
        with lock(state_dir, verb="npufuse apply"):
            return _run(args, state_dir)
    except (UnsafeStatePath, StateBusy) as exc:
        raise UsageError(str(exc)) from None


def _run(args: argparse.Namespace, state_dir: Path) -> int:
    from npufuse.rewrite import apply as ap
    from npufuse.rewrite import ledger
    from npufuse.rewrite.codegen import parse_switch
    from npufuse.state import State

    try:
        switch = parse_switch(args.switch) if args.switch is not None else None
        scan = ap.load_scan(state_dir, args.root)
        only = _only(args.only, scan.data.get("patterns") or [c["pattern"] for c in scan.candidates])
        ids = ap.parse_ids(args.accept, scan.by_id())
        # issue 16: candidates in installed packages go to the generated npufuse_patches.py
        from npufuse.rewrite import patch_module as pm

        ids, patch_ids = pm.split_ids(scan, ids)
        try:
            state = State.load(state_dir)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        notes = ledger.reconcile(state, scan.root) if not args.dry_run else []
        ap.sync_state_with_scan(state, scan)
        # the module holds every patched candidate: those patched before stay in it
        patch_ids = sorted({i for i in patch_ids if not only or scan.by_id()[i]["pattern"] in only} | set(pm.patched_ids(state)))
        patches = pm.plan_patches(scan, [scan.by_id()[i] for i in patch_ids], switch) if patch_ids else None
        plan = ap.plan_apply(scan, state, ids, only=only, switch=switch, force=args.force)
    except (ap.Refused, ValueError) as exc:  # pm.PatchRefused is a ValueError
        raise UsageError(str(exc)) from None
    notes += plan.notes
    if patches is not None and patches.functions:
        if args.dry_run:
            sys.stdout.write(patches.text)
        else:
            try:
                pm.write_patches(scan.root, patches)
            except (pm.PatchRefused, OSError) as exc:
                raise UsageError(str(exc)) from None
            pm.record(state, scan, patches)
            state.save()
        print(f"npufuse apply: candidate(s) {', '.join(map(str, patches.ids))} (installed packages) {'would be ' if args.dry_run else ''}patched in {pm.PATCH_FILE}; "
              f"site-packages is not edited. Add this line to your training script, before the model is built:\n    {pm.USER_LINE}")
    if args.dry_run:
        for fp in plan.files:
            sys.stdout.write(fp.diff())
        sys.stdout.flush()
        print_results(plan.results, "npufuse apply --dry-run (nothing written)", notes)
        print_switches(plan.results)
        return 1 if plan.skipped else 0
    if not plan.files and not plan.results:
        if patches is not None and patches.functions:
            return 0  # only installed-package candidates: reported above
        print_results([], "npufuse apply: nothing selected", notes)
        return 0
    try:
        ap.write_plan(plan, state, scan, state_dir)
    except ap.Refused as exc:
        raise UsageError(str(exc)) from None
    if not plan.files:
        state.save()  # stale records cleared by planning
    n_files = len(plan.files)
    n_applied = sum(r.status == "applied" for r in plan.results)
    n_already = sum(r.status == "already fused" for r in plan.results)
    title = f"npufuse apply: {n_applied} site(s) rewritten in {n_files} file(s), {n_already} already fused, {len(plan.skipped)} skipped"
    print_results(plan.results, title, notes)
    print_switches(plan.results)
    if n_files:
        from rich.console import Console
        from rich.markup import escape

        Console(highlight=False).print(
            f"Originals backed up under {escape(str(state_dir / 'backup'))}/; state in {escape(str(state.path))}; "
            f"undo with `npufuse revert {' '.join(str(r.id) for r in plan.results if r.status == 'applied')}`"
        )
    return 1 if plan.skipped else 0
