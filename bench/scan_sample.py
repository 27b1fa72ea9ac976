"""Where the per-file analysis of a cold scan spends its CPU: a sampling profile.

    .venv/bin/python bench/scan_sample.py [CORPUS_DIR] [--step N] [--interval-ms 1] [--top 40] [--under FUNC]

Runs ``engine.analyze_file`` on every ``--step``-th file of the corpus (default: the transformers
modeling files of ``bench/scan.py``) in this process, torch imported first (as in the parent of a
scan, so the numeric probe runs here), with a SIGPROF timer firing every ``--interval-ms`` of CPU
time (the kernel rounds it up to its tick: about 4 ms on the 2-core machine); each tick records the
whole Python stack. Prints the shares of the samples by part (parse,
index, repo facts, each detector, candidates, freeing, the engine), then the functions with the
most samples on top of the stack (self) and anywhere on it (inclusive). ``--under FUNC``: the
inclusive shares of what runs below the outermost call of functions whose ``file:line(name)``
holds FUNC. On a shared machine this is the steadier instrument: cProfile times with a wall clock
and adds a per-call cost that inflates small Python functions. Prints figures only.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

Stack = tuple[str, ...]  # innermost frame first


def _key(code) -> str:
    name = code.co_filename
    i = name.find("npufuse/")
    return f"{name[i + 8:] if i >= 0 else os.path.basename(name)}:{code.co_firstlineno}({code.co_name})"


def sample(run, interval: float) -> collections.Counter[Stack]:
    """The stacks seen by a SIGPROF timer while ``run()`` runs."""
    stacks: collections.Counter[Stack] = collections.Counter()

    def tick(signum, frame) -> None:
        chain = []
        while frame is not None:
            chain.append(_key(frame.f_code))
            frame = frame.f_back
        stacks[tuple(chain)] += 1

    previous = signal.signal(signal.SIGPROF, tick)
    signal.setitimer(signal.ITIMER_PROF, interval, interval)
    try:
        run()
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, previous)
    return stacks


def part(chain: Stack) -> str:
    """The part of analyze_file a stack is in (outermost call that names one)."""
    outer = list(reversed(chain))
    joined = " ".join(outer)
    for needle, label in (("(parse_source)", "parse"), ("(from_source)", "index (ModuleInfo.from_source)"),
                          ("repo_search.py", "repo facts"), ("(local_risks)", "candidates: risks"),
                          ("replacement.py", "candidates: replacement text"), ("(site_context)", "candidates: switch context")):
        if needle in joined:
            return label
    for i, k in enumerate(outer):
        if k.startswith("patterns/base.py") and k.endswith("(wrapped)") and i + 1 < len(outer):
            return "detector " + outer[i + 1].split(":")[0].removeprefix("patterns/").removesuffix(".py")
    if chain and chain[0].endswith("(analyze_file)"):
        return "freeing (analyze_file's frame: tree, index, caches)"
    if chain and chain[0].endswith("(_analyze_file)"):
        return "engine loop (_analyze_file itself)"
    return "other: " + (chain[0] if chain else "?")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("corpus", nargs="?", type=Path, default=HERE / ".data" / "transformers")
    ap.add_argument("--step", type=int, default=1, help="every N-th file (default: all)")
    ap.add_argument("--interval-ms", type=float, default=1.0)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--under", help="inclusive shares below the outermost call of this function")
    args = ap.parse_args(argv)

    from npufuse.scan import engine
    from npufuse.scan.walk import walk

    files = walk(args.corpus).files[::args.step]
    patterns, options = list(engine.registry_patterns()), engine.ScanOptions()
    try:
        import torch  # noqa: F401  (the probe's import, paid once by a scan's parent)
    except ImportError:
        pass
    engine.analyze_file(args.corpus, files[0], patterns, options)  # lazy imports of the first file
    t = time.process_time()

    def run() -> None:
        for rel in files:
            engine.analyze_file(args.corpus, rel, patterns, options)

    stacks = sample(run, args.interval_ms / 1000)
    cpu = time.process_time() - t
    n = sum(stacks.values()) or 1
    print(f"{len(files)} files, {cpu:.2f} s CPU, {n} samples, load {os.getloadavg()[0]:.1f}")
    parts: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for chain, c in stacks.items():
        if args.under:
            hits = [i for i, k in enumerate(chain) if args.under in k]
            if not hits:
                continue
            chain = chain[:max(hits) + 1]
        parts[part(chain)] += c
        own[chain[0]] += c
        for k in set(chain):
            inclusive[k] += c
    for title, counter in (("by part", parts), ("self", own), ("inclusive", inclusive)):
        print(f"== {title} ==")
        for k, v in counter.most_common(args.top):
            print(f"{100 * v / n:6.1f}%  {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
