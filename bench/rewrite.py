"""Rewrite time per file: every finding of a scan applied to its file with the libcst transform
``npufuse apply`` runs (:func:`npufuse.rewrite.transform.rewrite_source` over
:func:`npufuse.rewrite.codegen.site_edit` edits, the body of ``codegen.splice``), in memory.

    .venv/bin/python bench/rewrite.py [CORPUS_DIR] [--scan SCAN_JSON] [--limit N] [--repeat 1]

Without ``--scan`` it first runs ``python -m npufuse scan`` on the corpus in a child process (its
memory is not counted here; the result cache makes a repeat cheap). Prints ms/file (mean,
median, max), sites/s, how many outputs parse, and peak memory (ru_maxrss of this process, which
only imports npufuse and rewrites). Nothing is written to the corpus. Asserts nothing.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
DEFAULT_CORPORA = (ROOT / ".venv" / "transformers-site" / "transformers" / "models", HERE / ".data" / "transformers")


def default_corpus() -> Path | None:
    return next((c for c in DEFAULT_CORPORA if c.is_dir()), None)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", nargs="?", help="folder to scan and rewrite (default: the transformers models/ folder)")
    ap.add_argument("--scan", help="an existing scan.json of CORPUS (default: scan it now)")
    ap.add_argument("--limit", type=int, default=0, help="rewrite a seeded random sample of N of the files with findings (0: all)")
    ap.add_argument("--repeat", type=int, default=1, help="timed repetitions per file; the best is kept (default 1)")
    args = ap.parse_args(argv)

    corpus = Path(args.corpus) if args.corpus else default_corpus()
    if corpus is None or not corpus.is_dir():
        print(f"no corpus at {corpus}; pass a folder (make venv installs transformers)", file=sys.stderr)
        return 2
    if args.scan:
        scan = json.loads(Path(args.scan).read_text())
    else:
        state = Path(tempfile.gettempdir()) / "npufuse-bench-rewrite-state"  # kept: its cache makes the next run quick
        subprocess.run([sys.executable, "-m", "npufuse", "scan", str(corpus), "--state-dir", str(state), "-o", str(state / "report.md"), "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        scan = json.loads((state / "scan.json").read_text())

    from npufuse.patterns.base import Finding
    from npufuse.rewrite.codegen import Switch, site_edit
    from npufuse.rewrite.transform import rewrite_source

    by_file: dict[str, list[dict]] = {}
    for c in scan["candidates"]:
        by_file.setdefault(c["file"], []).append(c)
    files = sorted(by_file)
    if 0 < args.limit < len(files):
        # a random sample, not the largest files: ms/file should describe a typical file
        files = sorted(random.Random(0).sample(files, args.limit))
    rewrite_source("import torch\n", [])  # warm-up: libcst's parser and metadata machinery load on first use
    rss_before = _rss_mib()

    times: list[float] = []
    cpu0 = time.process_time()
    sites = applied = skipped = parses = 0
    for rel in files:
        source = (corpus / rel).read_text(encoding="utf-8")
        edits = []
        for c in by_file[rel]:
            f = Finding(c["pattern"], c["qualname"], c["line"], c["end_line"], c["params"], c["fused"], c["guard_tensor"])
            edits.append(site_edit(f, Switch(c["switch"]["kind"], c["switch"]["expr"], c["switch"]["name"])))
        best = float("inf")
        for _ in range(max(1, args.repeat)):
            t0 = time.perf_counter()
            outcome = rewrite_source(source, edits)
            best = min(best, time.perf_counter() - t0)
        times.append(best)
        sites += len(edits)
        applied += len(outcome.applied)
        skipped += len(outcome.skipped)  # overlapping candidates: apply takes one of them
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ast.parse(outcome.text)
            parses += 1
        except SyntaxError:
            pass

    if not times:
        print("no findings in the corpus: nothing to rewrite", file=sys.stderr)
        return 2
    total = sum(times)
    cpu = time.process_time() - cpu0  # on a loaded machine the figure to trust (one process, no children)
    ms = [t * 1000 for t in times]
    load = os.getloadavg()[0]
    print(f"corpus            {corpus}")
    print(f"files rewritten   {len(files)} of {len(by_file)} files with findings ({sites} sites: {applied} applied, {skipped} skipped as overlapping)")
    print(f"rewrite time      {statistics.mean(ms):.1f} ms/file mean, {statistics.median(ms):.1f} median, {max(ms):.1f} max; "
          f"{sites / total:.0f} sites/s; {total:.2f} s in all (best of {args.repeat})")
    print(f"cpu time          {cpu * 1000 / len(files):.1f} ms/file (user+sys; wall above is inflated when the load is over the core count)")
    print(f"outputs parse     {parses}/{len(files)}")
    print(f"peak memory       {_rss_mib():.0f} MiB ru_maxrss ({rss_before:.0f} MiB before the first rewrite: imports and the scan.json)")
    print(f"ratio             {statistics.mean(ms):.1f} ms/file (judged: rewrite time per file)")
    print(f"machine load      {load:.1f} (1-min load average, {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
