"""Every benchmark, with options small enough to finish in a few minutes (``make bench``).

    .venv/bin/python bench/run_all.py [--corpus DIR] [--quick]

Runs, each in its own process (so each peak memory is its own), streaming its output:
scan.py (cold and warm scan vs ast.parse on the transformers ``models/`` corpus; then again with
one cheap detector only, ``--only geglu``: the cost of everything but detection; and once on a
copy with Windows line ends, ``--line-ends crlf``), rewrite.py
(ms/file over the files with the most findings, reusing the scan bench's scan.json), opcheck.py
(op-check overhead) and profile.py (profile mining rows/s). Then prints the judged lines of
each with the machine and its load average, the block to paste into the README. Exit status:
1 if a benchmark failed to run (figures that miss a target are printed, not failures).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CORPORA = (ROOT / ".venv" / "transformers-site" / "transformers" / "models", Path("/tmp/tf/transformers/models"), HERE / ".data" / "transformers")
# The lines of each bench's output that carry its judged figures (shown again in the summary).
SUMMARY = re.compile(r"^\s*(files |detectors |ast\.parse only|npufuse scan\s{2,}|warm scan|ratio|paired ratio|cpu time|warm cpu|peak memory|files rewritten|rewrite time|cpu time|outputs parse|"
                     r"op check|bare function|overhead|plain run|traced run|\s*csv \||polars \||target:|machine load)")


def _run(name: str, argv: list[str]) -> tuple[int, list[str], float]:
    print(f"\n=== {name}: {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(HERE / argv[0]), *argv[1:]], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line.rstrip("\n"))
    return proc.wait(), lines, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", help="scan/rewrite corpus (default: the transformers models/ folder make venv installs)")
    ap.add_argument("--quick", action="store_true", help="smaller inputs (rewrite 8 files, 100k profile rows)")
    args = ap.parse_args(argv)
    corpus = Path(args.corpus) if args.corpus else next((c for c in CORPORA if c.is_dir()), None)
    state = Path(tempfile.mkdtemp(prefix="npufuse-bench-all-"))
    load_before = os.getloadavg()
    runs: list[tuple[str, int, list[str], float]] = []
    try:
        if corpus is None:
            print("no transformers corpus (run `make venv`, or pass --corpus): skipping scan and rewrite", file=sys.stderr)
        else:
            runs.append(("scan", *_run("scan", ["scan.py", str(corpus), "--repeat", "1" if args.quick else "3", "--no-subprocess", "--state-dir", str(state)])))
            # the same scan with one cheap detector: what everything but detection costs (the floor)
            runs.append(("scan floor", *_run("scan floor", ["scan.py", str(corpus), "--only", "geglu", "--repeat", "1" if args.quick else "2", "--no-subprocess",
                                                             "--state-dir", str(state / "floor")])))
            # a Windows checkout ("\r\n" line ends): the same fast replacement path, not libcst per site
            runs.append(("scan crlf", *_run("scan crlf", ["scan.py", str(corpus), "--line-ends", "crlf", "--repeat", "1", "--no-subprocess",
                                                           "--state-dir", str(state / "crlf")])))
            scan_json = state / "scan.json"
            extra = ["--scan", str(scan_json)] if scan_json.is_file() else []
            runs.append(("rewrite", *_run("rewrite", ["rewrite.py", str(corpus), "--limit", "8" if args.quick else "20", *extra])))
        runs.append(("opcheck", *_run("opcheck", ["opcheck.py", "--repeat", "3"])))
        runs.append(("profile", *_run("profile", ["profile.py", "--rows", "100000" if args.quick else "300000"])))
        runs.append(("trace", *_run("trace", ["trace.py", "--steps", "20", "--repeats", "1" if args.quick else "3"])))
    finally:
        shutil.rmtree(state, ignore_errors=True)

    load_after = os.getloadavg()
    print("\n=== summary")
    print(f"machine           {platform.node()}: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.platform()}")
    print(f"load average      {load_before[0]:.1f} / {load_before[1]:.1f} / {load_before[2]:.1f} before, "
          f"{load_after[0]:.1f} / {load_after[1]:.1f} / {load_after[2]:.1f} after (1/5/15 min; wall figures mean little above {os.cpu_count()})")
    failed = []
    for name, rc, lines, wall in runs:
        print(f"[{name}] ({wall:.0f} s{', exit ' + str(rc) if rc else ''})")
        for line in lines:
            if SUMMARY.match(line):
                print(f"  {line.strip()}")
        if rc not in (0, 1):  # profile.py exits 1 when a target is missed: a figure, not a failure
            failed.append(name)
    if failed:
        print(f"failed to run: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
