"""``npufuse scan PATH``: stage 1, read-only.

Writes the identification report (``report.md`` in the current folder, or ``-o FILE``) and the
scan state (``.npufuse/scan.json`` in the current folder, or ``--state-dir DIR``), which
``npufuse apply`` reads. ``--format json`` prints scan.json on stdout instead of writing the
report (unless ``-o`` is given too). Never touches the scanned source. Exit 0; 2 for bad input
(a path that does not exist, an unknown pattern id).

Module-level imports stay light: the engine, jinja2 and rich load only when the verb runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="the model repository (a folder) or one Python file")
    parser.add_argument("-o", "--output", metavar="FILE", help="report path (default: report.md in the current folder)")
    parser.add_argument("--state-dir", metavar="DIR", default=".npufuse", help="folder for scan.json (default: .npufuse in the current folder)")
    parser.add_argument("--format", choices=("md", "json"), default="md", help="md: write the report (default); json: print scan.json on stdout")
    parser.add_argument("--only", metavar="IDS", help="comma-separated pattern ids to run, e.g. rms_norm,swiglu")
    parser.add_argument("--profile", metavar="DIR", help="Ascend profiler output to join with the candidates (report section 1.2)")
    parser.add_argument("--max-file-mb", type=float, default=10.0, metavar="MB", help="skip Python files larger than this (default 10)")
    parser.add_argument("-j", "--jobs", type=int, default=None, metavar="N", help="worker processes (default: all cores; small trees run in-process)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="N", help="batch size for the value estimate (default: read from the repo, else 4)")
    parser.add_argument("--seq-len", type=int, default=None, metavar="N", help="sequence length for the value estimate (default: read from the repo, else 2048)")
    parser.add_argument("--switch", choices=("auto", "env", "none"), default="auto",
                        help="how fused branches are switched: auto = DESIGN rule 1 (repo switch > new config field > env var); env = always NPUFUSE_<ID>; none = only the NPU check")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (it is shown only when stderr is a terminal)")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the per-file result cache (STATE_DIR/cache)")


def _progress(enabled: bool):
    """A rich progress bar on stderr, or None. Manual refresh: no thread (the pool forks)."""
    if not enabled:
        return None, None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("scanning"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True), auto_refresh=False, transient=True)
    task = bar.add_task("scan", total=None)
    state = {"n": 0}

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)
        state["n"] += 1
        if state["n"] % 8 == 0 or done == total:
            bar.refresh()

    return bar, update


def _join_profile(scan: dict[str, Any], profile_dir: str) -> str:
    """Profile result joined onto the candidates (in place); returns report section 1.2."""
    from npufuse.profile.analysis import analyze
    from npufuse.profile.join import join_with_scan, render_section_1_2

    result = analyze([profile_dir])
    ranked, unexplained = join_with_scan(result, scan["candidates"])
    by_id = {c.get("id"): c for c in ranked}
    for c in scan["candidates"]:
        joined = by_id.get(c["id"], {})
        c["profile"] = joined.get("profile")
        if joined.get("profile_covers"):
            c["profile_covers"] = joined["profile_covers"]
    scan["profile"] = {"source": profile_dir, "unexplained": unexplained}
    return render_section_1_2(unexplained)


def _write(path: Path, text: str) -> None:
    """Atomic write; a new file gets the usual umask permissions (mkstemp would give 0600)."""
    import os

    from npufuse.safe_write import write_bytes_atomic

    mode = None
    if not path.exists():
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    write_bytes_atomic(path, text.encode("utf-8"), mode=mode)


def run(args: argparse.Namespace) -> int:
    from npufuse.cli import UsageError
    from npufuse.scan import engine

    target = Path(args.path)
    if not target.exists() and not target.is_symlink():
        raise UsageError(f"{args.path}: no such file or folder")
    if args.output and Path(args.output).suffix in (".py", ".pyi"):
        raise UsageError(f"-o {args.output}: refusing to write the report over a Python file")
    if args.max_file_mb <= 0:
        raise UsageError("--max-file-mb must be positive")
    if args.profile and not Path(args.profile).exists():
        raise UsageError(f"--profile {args.profile}: no such file or folder")
    only = [s for s in args.only.split(",")] if args.only else None

    bar, update = _progress(sys.stderr.isatty() and not args.no_progress)
    try:
        if bar is not None:
            bar.start()
        result = engine.scan_repo(
            target,
            only=only,
            max_file_bytes=int(args.max_file_mb * 1024 * 1024),
            jobs=args.jobs,
            switch_mode=args.switch,
            overrides={"batch_size": args.batch_size, "seq_len": args.seq_len},
            progress=update,
            cache_dir=None if args.no_cache else Path(args.state_dir) / "cache",
        )
    except engine.UnknownPatternError as exc:
        raise UsageError(f"--only: {exc}") from None
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    finally:
        if bar is not None:
            bar.stop()

    scan = result.to_json()
    profile_section = _join_profile(scan, args.profile) if args.profile else None
    if profile_section is not None:
        scan["suggested_order"] = engine.suggested_order(scan["candidates"])
    state_path = Path(args.state_dir) / "scan.json"
    text = json.dumps(scan, indent=2, ensure_ascii=False) + "\n"
    try:
        _write(state_path, text)
        report_path = None
        if args.format == "md" or args.output:
            from npufuse.report.markdown import render_markdown

            report_path = Path(args.output or "report.md")
            _write(report_path, render_markdown(scan, state_path=state_path.as_posix(), order_rule=engine.order_rule(profile_section is not None), profile_section=profile_section))
    except OSError as exc:
        raise UsageError(f"cannot write {exc.filename or 'output'}: {exc.strerror or exc}") from None

    summary = (
        f"npufuse scan: {scan['files_scanned']} files, {len(scan['candidates'])} candidates, "
        f"{len(scan['near_misses'])} near misses, {len(scan['files_failed'])} problems -> "
        + ", ".join(p.as_posix() for p in (report_path, state_path) if p is not None)
    )
    if args.format == "json":
        sys.stdout.write(text)
        print(summary, file=sys.stderr)
    else:
        print(summary)
    return 0
