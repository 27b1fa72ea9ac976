"""Pattern.SCOPE_WORDS gates on a corpus: the same scan with and without them, and what they save.

    .venv/bin/python bench/scan_gates.py [CORPUS_DIR] [--step N]

Analyses every file (every ``--step``-th) in this process twice -- gates on (the scan as it
runs) and off (``engine.SCOPE_GATES = False``: every detector on every scope) -- and compares
what each file contributes to scan.json: findings (span, params, fused code, replacement text)
and near misses with their reasons. Prints the number of files that differ (must be 0: a word
list that misses a form the detector matches shows here on real code, as
tests/test_scan_speed_paths.py shows it on the examples), the CPU seconds of each pass, and per
pattern the detector calls the gates skipped. Default corpus: bench/scan.py's. Asserts nothing;
exit status 1 when a file differs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


def _summary(out) -> tuple:
    hits = sorted((h.finding.pattern, h.finding.qualname, h.finding.line, h.finding.end_line, repr(h.finding.params),
                   h.finding.fused, h.finding.guard_tensor, h.finding.variant, repr(h.body)) for h in out.hits)
    near = sorted((m["pattern"], m["qualname"], m["line"], m["end_line"], m["reason"]) for m in out.near_misses)
    return hits, near, sorted((f.kind, f.error) for f in out.failures)


def main(argv: list[str] | None = None) -> int:
    from npufuse.scan import engine
    from npufuse.scan.dataflow import ModuleInfo

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("corpus", nargs="?", default=str(HERE / ".data" / "transformers"))
    ap.add_argument("--step", type=int, default=1, help="every N-th file (default: all)")
    args = ap.parse_args(argv)
    root = Path(args.corpus)
    if not root.is_dir():
        print(f"scan_gates: no corpus folder {root}", file=sys.stderr)
        return 2
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.py"))[:: max(1, args.step)]
    patterns = list(engine.registry_patterns())
    options = engine.ScanOptions()
    results: dict[bool, list[tuple]] = {}
    cpu: dict[bool, float] = {}
    for on in (False, True, False, True):  # twice each, alternating: the best of two
        engine.SCOPE_GATES = on
        t = time.process_time()
        results[on] = [_summary(engine.analyze_file(root, rel, patterns, options)) for rel in files]
        spent = time.process_time() - t
        cpu[on] = min(cpu.get(on, spent), spent)
    engine.SCOPE_GATES = True
    differ = [rel for rel, a, b in zip(files, results[True], results[False]) if a != b]
    # detector calls skipped, per pattern (parsed again: counting is not timed)
    skipped = {p.id: 0 for p in patterns}
    calls = 0
    for rel in files:
        text, _sha, failure = engine.read_source(root / rel, rel, options.max_file_bytes)
        tree, failure = engine.parse_source(rel, text) if failure is None else (None, failure)
        if tree is None:
            continue
        module = ModuleInfo.from_source(rel, text, tree)
        gates = [engine.gate_words(module, p) for p in patterns]
        for scope in module.scopes:
            calls += len(patterns)
            for p, words in zip(patterns, gates):
                skipped[p.id] += engine.gated_out(module, scope, words)
    n_find = sum(len(r[0]) for r in results[True])
    n_near = sum(len(r[1]) for r in results[True])
    print(f"corpus            {root} ({len(files)} files)")
    print(f"same outputs      {len(files) - len(differ)} of {len(files)} files identical with gates on and off "
          f"({n_find} findings, {n_near} near misses)")
    for rel in differ[:20]:
        print(f"  DIFFERS         {rel}")
    print(f"cpu               gates off {cpu[False]:.2f} s, on {cpu[True]:.2f} s (best of 2 each): saved {cpu[False] - cpu[True]:.2f} s")
    print(f"detector calls    {sum(skipped.values())} of {calls} skipped by the gates")
    for pid, n in sorted(skipped.items(), key=lambda kv: -kv[1]):
        declared = next(p for p in patterns if p.id == pid).SCOPE_WORDS
        print(f"  {pid:20s} {n:7d}  {'SCOPE_WORDS ' + repr(declared) if declared is not None else '(no SCOPE_WORDS)'}")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
