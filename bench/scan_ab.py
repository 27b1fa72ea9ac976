"""Two versions of npufuse on one corpus: per-file analysis CPU time, alternating, and whether they
find the same things.

    .venv/bin/python bench/scan_ab.py SRC_A SRC_B [CORPUS_DIR] [--rounds 3] [--step N]

SRC_A and SRC_B are ``src`` folders of two checkouts (e.g. a ``git worktree`` of the commit before
a change, and this one). Each round runs, in a fresh subprocess per side (A then B, then B then A in
the next round, and so on), an ``ast.parse`` pass over the corpus and then ``engine.analyze_file``
over every file (every ``--step``-th), all detectors, in one process: no pool, no cache, no outputs
-- the part of a cold scan whose cost a detector change moves. Prints per side the best CPU
seconds over the rounds and its ratio to the ``ast.parse`` pass of the same subprocess (on this
shared 2-core machine, CPU seconds inflate with the load: the ratio within one process, taken
together, is the steadier figure), and the load average. Then the number of files whose
findings (span, params, fused code, replacement text), near misses (with reasons) or problems
differ between A and B (0 when the change is speed only). Asserts nothing; exit status 1 when a
file differs.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

_CHILD = r'''
import ast, gc, os, pickle, sys, time, warnings
from pathlib import Path
root, step, out = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
from npufuse.scan import engine
from npufuse.scan.walk import walk
files = walk(root).files[::step]
patterns = list(engine.registry_patterns())
options = engine.ScanOptions()
t = time.process_time()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for rel in files:
        try:
            ast.parse((root / rel).read_bytes())
        except (SyntaxError, ValueError):
            pass
parse = time.process_time() - t
gc.collect()
summaries = {}
t = time.process_time()
for rel in files:
    o = engine.analyze_file(root, rel, patterns, options)
    hits = sorted((h.finding.pattern, h.finding.qualname, h.finding.line, h.finding.end_line, repr(h.finding.params),
                   h.finding.fused, h.finding.guard_tensor, h.finding.variant, repr(h.body)) for h in o.hits)
    near = sorted((m["pattern"], m["qualname"], m["line"], m["end_line"], m["reason"]) for m in o.near_misses)
    summaries[rel] = (hits, near, sorted((f.kind, f.error) for f in o.failures))
scan = time.process_time() - t
with open(out, "wb") as fh:
    pickle.dump({"parse": parse, "scan": scan, "load": os.getloadavg()[0], "summaries": summaries}, fh)
'''


def _run(src: Path, corpus: Path, step: int, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    subprocess.run([sys.executable, "-c", _CHILD, str(corpus), str(step), str(out)], check=True, env=env)
    with open(out, "rb") as fh:
        return pickle.load(fh)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src_a", type=Path)
    ap.add_argument("src_b", type=Path)
    ap.add_argument("corpus", nargs="?", type=Path, default=HERE / ".data" / "transformers")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step", type=int, default=1, help="every N-th file (default: all)")
    args = ap.parse_args(argv)
    for p in (args.src_a, args.src_b, args.corpus):
        if not p.is_dir():
            print(f"scan_ab: no folder {p}", file=sys.stderr)
            return 2
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="npufuse-ab-") as tmp:
        for r in range(args.rounds):
            order = ("A", "B") if r % 2 == 0 else ("B", "A")
            for side in order:
                src = args.src_a if side == "A" else args.src_b
                res = _run(src, args.corpus, args.step, Path(tmp) / f"{side}{r}.pkl")
                print(f"round {r + 1} {side}: analyze_file {res['scan']:6.2f} s CPU, ast.parse {res['parse']:5.2f} s: "
                      f"{res['scan'] / res['parse']:.2f}x (load {res['load']:.1f})", flush=True)
                if runs[side]:
                    res["same_as_first"] = res["summaries"] == runs[side][0]["summaries"]
                    res["summaries"] = None  # one copy per side is enough
                runs[side].append(res)
    for side in ("A", "B"):
        best = min(runs[side], key=lambda x: x["scan"])
        ratios = sorted(x["scan"] / x["parse"] for x in runs[side])
        print(f"{side} {args.src_a if side == 'A' else args.src_b}: best {best['scan']:.2f} s CPU ({best['scan'] / best['parse']:.2f}x its ast.parse); "
              f"ratios {', '.join(f'{q:.2f}' for q in ratios)}")
    a, b = runs["A"][0]["summaries"], runs["B"][0]["summaries"]
    differ = sorted(rel for rel in set(a) | set(b) if a.get(rel) != b.get(rel))
    hits = sum(len(v[0]) for v in a.values())
    near = sum(len(v[1]) for v in a.values())
    print(f"files {len(a)}: A has {hits} findings and {near} near misses; files whose results differ between A and B: {len(differ)}")
    for rel in differ[:20]:
        print(f"  differs: {rel}")
    unstable = [side for side in ("A", "B") if not all(x.get("same_as_first", True) for x in runs[side])]
    if unstable:
        print(f"results changed between rounds of the same side: {', '.join(unstable)}")
    print(json.dumps({"differ": len(differ)}))
    return 1 if differ or unstable else 0


if __name__ == "__main__":
    sys.exit(main())
