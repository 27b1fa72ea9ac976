"""``npufuse report html [ID…]``: the validation report as one self-contained HTML file.

Kept free of heavy imports: the CLI imports every verb module to build ``--help``; jinja2 and
the renderer load only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _ids(values: list[str]) -> list[int]:
    """``1 3``, ``1,3`` or a mix; every id a positive integer."""
    from npufuse.cli import UsageError

    out: list[int] = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            if not part.isdigit() or int(part) < 1:
                raise UsageError(f"candidate id {part!r} is not a positive integer")
            out.append(int(part))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="format", metavar="FORMAT")
    html = sub.add_parser(
        "html",
        help="self-contained HTML: code change, op check, loss and step-time charts, verdict",
        description="Render the validation report of candidates (default: every candidate in the "
        "state file) as one HTML file that opens from disk with no network.",
    )
    html.add_argument("ids", nargs="*", metavar="ID", help="candidate ids (default: all in .npufuse/state.json)")
    html.add_argument("-o", "--out", default="report.html", help="output file (default: report.html)")
    html.add_argument("--state-dir", default=".npufuse", help="folder of state.json and scan.json (default: .npufuse)")
    html.add_argument("--scan", default=None, help="scan.json to take the code change from (default: STATE_DIR/scan.json)")
    html.add_argument(
        "--jsonl",
        action="append",
        default=[],
        metavar="FILE",
        help="per-step JSONL, or a metrics array from `npufuse merge-jsonl`, to include (repeatable); "
        "JSONL under STATE_DIR and files named in the evidence are read anyway",
    )


def run(args: argparse.Namespace) -> int:
    from npufuse.cli import UsageError

    if getattr(args, "format", None) != "html":
        raise UsageError("name the report format: `npufuse report html [ID…]`")
    from npufuse.report.html import ReportInputError, build_report_data, write_report

    ids = _ids(args.ids)
    try:
        data = build_report_data(args.state_dir, scan_path=args.scan, jsonl=args.jsonl, ids=ids or None)
    except ReportInputError as exc:
        raise UsageError(str(exc)) from exc
    out = Path(args.out)
    if out.is_dir():
        raise UsageError(f"{out}: is a folder; give a file name for the report")
    try:
        write_report(data, out)
    except OSError as exc:
        raise UsageError(f"{out}: cannot write the report ({exc.strerror or exc})") from exc
    n = len(data["candidates"])
    note = "; EMULATED backend: step times are not NPU performance" if data["any_emulated"] else ""
    for w in data["warnings"]:
        print(f"npufuse report html: warning: {w}", file=sys.stderr)
    print(f"npufuse report html: wrote {out} ({n} candidate{'s' if n != 1 else ''}{note})")
    return 0
