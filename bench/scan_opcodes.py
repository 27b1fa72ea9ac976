"""Python opcodes that ``engine.analyze_file`` executes over a corpus, for one or more versions of npufuse:
a work figure that does not move with the machine's load (CPU seconds on the shared 2-core machine swing
by more than most exact speed cuts).

    .venv/bin/python bench/scan_opcodes.py SRC [SRC ...] [--corpus DIR] [--step 16] [--top 0]

Each SRC (a checkout's ``src`` folder) runs in its own subprocess with ``PYTHONHASHSEED=0`` (set and dict
orders fixed, so the same code takes the same paths): torch is imported and two files are analysed first
(lazy imports and per-process caches out of the count), then every ``--step``-th file is analysed under
``sys.settrace`` with per-frame opcode tracing. Prints the total per SRC and, with ``--top N``, the N code
objects that execute the most opcodes (a deterministic profile). What it does not see: time inside C
(``compile``, regular expressions, freeing), so a cut of C work needs a CPU measurement (``scan_ab.py``).
Slow: tracing multiplies the analysis's time ~10-50x (every 64th file, 9 files: ~5 min per SRC at load 15).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

_CHILD = r'''
import collections, json, sys
from pathlib import Path
import torch  # the numeric probe's import, out of the count
from npufuse.scan import engine
from npufuse.scan.walk import walk
root, step, top = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
listed = walk(root).files
patterns = list(engine.registry_patterns())
options = engine.ScanOptions()
for rel in listed[1:3]:
    engine.analyze_file(root, rel, patterns, options)
per_code = collections.Counter()

def on_opcode(frame, event, arg):
    if event == "opcode":
        per_code[frame.f_code] += 1
    return on_opcode

def on_call(frame, event, arg):
    frame.f_trace_opcodes = True
    return on_opcode

files = listed[::step]
for rel in files:
    sys.settrace(on_call)
    try:
        engine.analyze_file(root, rel, patterns, options)
    finally:
        sys.settrace(None)
rows = [(n, f"{c.co_filename.rsplit('npufuse/', 1)[-1]}:{c.co_firstlineno}({c.co_name})") for c, n in per_code.most_common(top)]
print(json.dumps({"files": len(files), "opcodes": sum(per_code.values()), "top": rows}))
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("srcs", nargs="+", type=Path)
    ap.add_argument("--corpus", type=Path, default=HERE / ".data" / "transformers")
    ap.add_argument("--step", type=int, default=16, help="every N-th file (default 16: 34 transformers files)")
    ap.add_argument("--top", type=int, default=0, help="also list the N code objects executing the most opcodes")
    args = ap.parse_args(argv)
    if not args.corpus.is_dir():
        print(f"no corpus at {args.corpus} (bench/scan.py --fetch-transformers)", file=sys.stderr)
        return 2
    first: int | None = None
    for src in args.srcs:
        env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}
        run = subprocess.run([sys.executable, "-c", _CHILD, str(args.corpus), str(args.step), str(args.top)],
                             check=True, env=env, capture_output=True, text=True)
        got = json.loads(run.stdout.strip().splitlines()[-1])
        first = got["opcodes"] if first is None else first
        change = f" ({(got['opcodes'] - first) / first * 100:+.2f}% against the first)" if src != args.srcs[0] else ""
        print(f"{src}: {got['opcodes']:,} opcodes over {got['files']} files{change}")
        for n, where in got["top"]:
            print(f"  {n:>11,} {n / got['opcodes'] * 100:5.2f}%  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
