"""``npufuse profile DIR|kernel_details.csv ...``: mine Ascend profiler output for fusable sequences.

Prints a rich table (default) or the result as JSON (``--format json``, stdout); ``--markdown FILE``
writes the report section. Input problems go to stderr as one line each, naming file, row and
column; the command still reports what it could read. Exit 2 only when nothing was usable.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from npufuse.cli import number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="DIR|kernel_details.csv",
                        help="*_ascend_pt folder(s), ASCEND_PROFILER_OUTPUT folder(s), a parent of several ranks' "
                             "folders, or a bare kernel_details.csv / trace_view.json")
    parser.add_argument("--format", choices=("table", "json"), default="table", help="stdout format")
    parser.add_argument("--markdown", metavar="FILE", help="write the report section as markdown")
    parser.add_argument("--kb", metavar="FILE", help="knowledge base YAML (default: the bundled one)")
    parser.add_argument("--reader", choices=("auto", "polars", "csv"), default="auto",
                        help="kernel_details.csv reader (auto: polars when installed)")
    parser.add_argument("--peak-bw", type=number(float, above=0, maximum=1e9), default=None, metavar="GB/s",
                        help="peak memory bandwidth of the SoC (default: Atlas A2, 1600)")
    parser.add_argument("--peak-tflops", type=number(float, above=0, maximum=1e9), default=None, metavar="TFLOP/s",
                        help="peak FP16/BF16 compute (default: Atlas A2, 313)")
    parser.add_argument("--launch-us", type=number(float, minimum=0, maximum=1e9), default=None, metavar="US",
                        help="shortest time a fused kernel can take (default 2)")
    parser.add_argument("--host-gap-us", type=number(float, minimum=0, maximum=1e9), default=None, metavar="US",
                        help="without a trace, idle gaps longer than this count as host-bound (default 10)")
    parser.add_argument("--top", type=number(int, minimum=1, maximum=10**6), default=10, help="sequences listed per table (default 10)")


# GB/s and TFLOP/s: far beyond any SoC either way, and safe to divide by
PEAK_RANGE = (1e-6, 1e9)


def _options(args: argparse.Namespace) -> Any:
    from npufuse.cli import UsageError
    from npufuse.profile.analysis import Options
    from npufuse.profile.roofline import Assumptions

    base = Assumptions()
    vals = {}
    for flag, attr in (("peak_bw", "peak_bw_gbs"), ("peak_tflops", "peak_tflops"), ("launch_us", "launch_us"),
                       ("host_gap_us", "host_gap_us")):
        v = getattr(args, flag, None)
        if v is not None:
            if not v > 0 or not math.isfinite(v):
                raise UsageError(f"--{flag.replace('_', '-')} must be a positive number, got {v}")
            # the roofline divides by the peaks: a denormal one would make every bound inf (not JSON)
            if attr.startswith("peak") and not PEAK_RANGE[0] <= v <= PEAK_RANGE[1]:
                raise UsageError(f"--{flag.replace('_', '-')} must be between {PEAK_RANGE[0]:g} and "
                                 f"{PEAK_RANGE[1]:g}, got {v:g}")
            vals[attr] = v
    soc = base.soc if not ({"peak_bw_gbs", "peak_tflops"} & set(vals)) else "user-given peaks"
    if args.top < 1:
        raise UsageError(f"--top must be at least 1, got {args.top}")
    kb = Path(args.kb) if args.kb else None
    if kb is not None and not kb.is_file():
        raise UsageError(f"{kb}: knowledge base file not found")
    return Options(backend=args.reader, kb_path=kb, top=args.top,
                   assumptions=Assumptions(soc=soc, **{k: v for k, v in vals.items()}))


def _problem_line(p: dict[str, Any]) -> str:
    where = p["file"]
    if p.get("row") is not None:
        where += f", row {p['row']}"
    if p.get("column"):
        where += f", column '{p['column']}'"
    return f"{where}: {p['message']}"


def run(args: argparse.Namespace) -> int:
    from npufuse.cli import UsageError
    from npufuse.profile.analysis import analyze
    from npufuse.profile.render import render_markdown, render_terminal

    result = analyze(list(args.paths), _options(args))
    if not result["usable"]:
        msgs = [_problem_line(p) for p in result["problems"]] or ["no operator data found"]
        raise UsageError("; ".join(msgs[:3]) + (f" (+{len(msgs) - 3} more)" if len(msgs) > 3 else ""))
    for p in result["problems"]:
        print(f"npufuse profile: warning: {_problem_line(p)}", file=sys.stderr)
    if args.markdown:
        try:
            Path(args.markdown).write_text(render_markdown(result), encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"{args.markdown}: cannot write: {exc.strerror or exc}") from None
    if args.format == "json":
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        render_terminal(result)
    return 0
