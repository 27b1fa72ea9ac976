"""What the (detector, scope) pairs of a cold scan cost, and how many of them yield anything.

    .venv/bin/python bench/scan_pairs.py [CORPUS_DIR] [--step N]

Runs ``engine.analyze_file`` over every file (every ``--step``-th) in this process, all detectors,
with torch imported first (the numeric probe's import is a once-per-scan cost, not a pair's), and
times each ``detect`` call the scan makes (scopes the ``SCOPE_WORDS`` gates skip are not called).
Prints per detector: calls, calls that yielded a finding or near miss, CPU seconds of all calls and
of the idle ones (yielding nothing), and the idle calls' CPU by duration (under 20 us ... over 1 ms).
The idle seconds bound what any gate in front of the detector can save; the short idle calls are
what a cheap gate saves, the long ones need a condition as strong as the detector's own analysis.
Default corpus: bench/scan.py's. Asserts nothing.
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

_BUCKETS = (20e-6, 50e-6, 100e-6, 300e-6, 1e-3, float("inf"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("corpus", nargs="?", type=Path, default=HERE / ".data" / "transformers")
    ap.add_argument("--step", type=int, default=1, help="every N-th file (default: all)")
    args = ap.parse_args(argv)
    import torch  # noqa: F401  (the probe's import, paid before the timings)

    from npufuse.scan import engine
    from npufuse.scan.walk import walk

    files = walk(args.corpus).files[:: args.step]
    patterns = list(engine.registry_patterns())
    clock = time.process_time
    # per pattern: calls, yielding calls, seconds, idle seconds, idle (count, seconds) per bucket
    stats: dict[str, list] = collections.defaultdict(lambda: [0, 0, 0.0, 0.0, [[0, 0.0] for _ in _BUCKETS]])

    def timed(pattern):  # type: ignore[no-untyped-def]
        inner = pattern.detect

        def detect(module, scope):  # type: ignore[no-untyped-def]
            t = clock()
            results = list(inner(module, scope))
            dt = clock() - t
            s = stats[pattern.id]
            s[0] += 1
            s[2] += dt
            if results:
                s[1] += 1
            else:
                s[3] += dt
                b = next(k for k, top in enumerate(_BUCKETS) if dt < top)
                s[4][b][0] += 1
                s[4][b][1] += dt
            return iter(results)

        pattern.detect = detect

    for p in patterns:
        timed(p)
    t0 = clock()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rel in files:
            try:
                ast.parse((args.corpus / rel).read_bytes())
            except (SyntaxError, ValueError):
                pass
    parse = clock() - t0
    t0 = clock()
    for rel in files:
        engine.analyze_file(args.corpus, rel, patterns, engine.ScanOptions())
    scan = clock() - t0
    detect = sum(s[2] for s in stats.values())
    idle = sum(s[3] for s in stats.values())
    print(f"files {len(files)}: ast.parse {parse:.2f} s, analyze_file {scan:.2f} s CPU ({scan / parse:.2f}x), load {os.getloadavg()[0]:.1f}")
    print(f"detect calls {detect:.2f} s, of which idle {idle:.2f} s; the rest of the analysis {scan - detect:.2f} s")
    print(f"{'pattern':18s} {'calls':>6s} {'yield':>6s} {'all s':>6s} {'idle s':>6s}   idle by duration: <20us <50us <100us <300us <1ms >1ms (calls/s)")
    for pid, s in sorted(stats.items(), key=lambda kv: -kv[1][3]):
        spread = " ".join(f"{c}/{t:.2f}" for c, t in s[4])
        print(f"{pid:18s} {s[0]:6d} {s[1]:6d} {s[2]:6.2f} {s[3]:6.2f}   {spread}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
