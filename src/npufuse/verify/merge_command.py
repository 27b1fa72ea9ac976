"""``npufuse merge-jsonl BASE FUSED [-o OUT]``: two runs' per-step JSONL → the report's metrics array.

Output (stdout, or ``-o``): a JSON array, one object per step present in either run, sorted::

    [{"step": 1, "baseline_loss": 2.31, "fused_loss": 2.31, "baseline_step_time": 0.145, "fused_step_time": 0.139}, ...]

A step missing from a run, a run without step times, and non-finite losses give ``null``.
Optional per-step fields (grad_norm, tokens_per_s, ...) are carried as ``baseline_<field>`` /
``fused_<field>``. A file holding both runs (records with ``"run"``) may be given twice.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from npufuse.cli import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("base", help="baseline JSONL (e.g. .npufuse/e2e_1_baseline.jsonl)")
    parser.add_argument("fused", help="fused JSONL (e.g. .npufuse/e2e_1_fused.jsonl)")
    parser.add_argument("-o", "--output", help="write the array here instead of stdout")


def run(args: argparse.Namespace) -> int:
    from npufuse.safe_write import write_output
    from npufuse.verify.jsonl import load_pair, merge_runs

    try:
        base, fused = load_pair(Path(args.base), Path(args.fused))
    except OSError as exc:
        raise UsageError(f"{exc.filename or args.base}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    text = json.dumps(merge_runs(base, fused), indent=1) + "\n"
    if args.output:
        try:  # -o /dev/stdout, a FIFO or a symlink is written through, not replaced
            write_output(Path(args.output), text.encode("utf-8"))
        except OSError as exc:
            raise UsageError(f"{exc.filename or args.output}: {exc.strerror or exc}") from None
        print(f"{args.output}: {len(set(r['step'] for r in base) | set(r['step'] for r in fused))} steps", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
