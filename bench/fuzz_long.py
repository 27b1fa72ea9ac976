"""The fuzz properties of tests/test_fuzz_*.py, unseeded, for a fixed time (issue 7 acceptance:
"a longer run is documented with its result").

    .venv/bin/python bench/fuzz_long.py --minutes 30 [--only scan.analyze,rewrite.spans] [--out FILE]

Runs every property in turn, in chunks of ``--chunk`` examples, with fresh random seeds until the
time is up (a chunk that is shrinking a failure may finish a little late). Prints examples run and
distinct failures per property, then each failure's falsifying input (truncated; ``--out`` keeps
them whole, as JSON). Exit status 1 when anything failed.

The CI budgets of the test modules do not apply here: this script sets its own time box.
Examples that hit a bug with an open xfail reproducer (a ``KNOWN`` entry) are tallied, not failed.

Documented runs (2 CPUs shared with other engineers' jobs; Python 3.11.7, hypothesis 6.170.15,
libcst 1.9.0, polars 2.1.0; 13 properties, round-robin):

* 20 min, 20,314 examples: no npufuse failure. One harness finding: the CPU guard's Hang was
  swallowed by the engine's per-file ``except Exception`` on a legitimately slow 300 KB file
  (libcst renders one site of it in ~20 s CPU); the guard now re-raises after the block.
* 15 min, 24,439 examples: 4 new bugs in profile/readers.py and profile/analysis.py (a truncated
  row raises IndexError; polars/csv disagree on truncated rows and on a bare CR; a denormal step
  time gives inf shares in the JSON), now xfail reproducers in tests/test_fuzz_profile.py.
* 12 min, 19,582 examples: 1 distinct failure, another face of the truncated-row bug (now mapped
  to its reproducer); known-bug hits: truncated row x5, polars shapes x16, bare CR x1, scan offers
  a site apply refuses x1.
* 15 min, 29,755 examples (19,364 by round 58 at 9.9 min, 3 failures then), 5 distinct failures,
  4 causes, all fixed with regression tests: fused_optimizer ``ast.unparse`` of a 500-link
  ``x.pow(2)...`` receiver raised RecursionError with a stack-depth-dependent message, so
  ``npufuse scan`` and scan_repo disagreed on files_failed (patterns/fused_optimizer.py: the
  receiver's source text instead); polars and csv split a cell with a quote that does not open
  it (after a NUL) differently, x2 (profile/readers.py: ``_has_stray_quote`` sends such files to
  the csv reader, as a bare CR); the fast replacement path offered a site whose first line holds
  ``a; b``, which apply refuses (scan/engine.py ``_shares_line``: a near miss with apply's
  reason); the spans property did not accept apply's refusal of a file libcst does not
  round-trip (a line holding only a backslash), x2 (tests/test_fuzz_rewrite.py: accepted for
  exactly such files, with exactly that reason).
* 4 min, 4,975 examples, those 4 properties only (scan.scan_repo, profile.kernels,
  rewrite.findings, rewrite.spans), after the fixes: no failure.
* 10 min, 10,050 examples, all 12 properties (825-850 each), after the cold-cache scan path
  (no up-front hashing), lazy scope assignments and the faster cache writes: no failure.
* 30 min (39.8 min wall: the last chunks were shrinking), 25,946 examples, all 12 properties
  (2,150-2,274 each): 2 distinct failures, both fixed with regression tests. rewrite.spans: a line
  holding only a backslash right before an indented block makes libcst reject a file ast
  accepts, and the scan offered its sites as candidates apply then skipped (now near misses with
  the reason; test_bug_lone_backslash_before_an_indented_block). scan.scan_repo: a 300 KB file
  with a top-level ``match`` took 55 s CPU (the 90 s guard called it a hang under load), every
  site rendered by libcst because default_indent gave up on match statements (now read from the
  first ``case`` line: 1.1 s; test_default_indent_of_match_files_is_libcsts).
* 10 min, 10,235 examples, all 12 properties, after those fixes: 2 more distinct failures in
  rewrite.spans, both fixed. revert_source dropped a line of only spaces right after a site (it
  lay inside the else block's indentation, so libcst made it that block's footer;
  test_bug_revert_keeps_indented_lines_after_a_site). And the property compared the fallback of
  a span starting at a decorated ``def`` without its decorators, which belong to the statement
  (test_bug_span_at_a_decorated_def_keeps_its_decorators_in_the_fallback).
* 15 min, 14,160 examples, 13 properties (the new rewrite.findings_crlf: 875 examples, every
  mutated seed rewritten with "\r\n" line ends, no failure): 1 distinct failure in
  scan.scan_repo, fixed. A guard tensor cut from two source lines (``torch.cat((a, b), dim\n=-1)``)
  split the replacement's ``if`` header, so the npufuse marker no longer ended its first line;
  the engine now writes such a guard on one line
  (test_bug_guard_tensor_spanning_lines_splits_the_if_header).
* 10 min, 8,600 examples, 14 properties (600-625 each; the new rewrite.twins: a text, its
  "\r\n" twin and its page-break twin find the same), after the CRLF, page-break and guard
  fixes: no failure.

* Issue 19, the hostile-repository families of tests/test_fuzz_hostile.py (``--only
  hostile.state_json,hostile.scan_json,hostile.state_tree,hostile.ids,hostile.options,hostile.display``:
  tampered state.json / scan.json, state-folder layouts with symlinks out, dangling links, FIFOs,
  /dev/zero links and read-only entries, id ranges up to 2**62, numeric option text, bidi and
  terminal controls in shown text; each example checks exit 0/1/2, no traceback, one-line
  errors and a byte-identical folder outside the repository). A first 7 min run was OOM-killed
  at 23 GB RSS, most likely ``npufuse status`` reading a scan.json linked to /dev/zero without
  bound (the only unbounded reader left in the verbs it runs then; status now reads scan.json
  through the state folder's reader, and later runs held under ``ulimit -v 8000000``). 8.2 min,
  2,939 examples: 1 distinct failure, fixed with a regression test: ``status`` crashed on a
  state.json ``"evidence": null`` (test_status_and_conclusions_take_odd_evidence_shapes). Then
  7.0 min, 2,900 examples (475-500 each), after the fix: no failure.

Earlier, shorter runs found the bugs fixed meanwhile in ad1f52b and dd29c6a; their reproducers
are regression tests now.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the property modules, and their shared strategies


def _load():
    import warnings

    warnings.filterwarnings("ignore")  # hypothesis' large-repr warnings: huge inputs are the point
    import test_fuzz_hostile
    import test_fuzz_profile
    import test_fuzz_rewrite
    import test_fuzz_scan

    mods = {"scan": test_fuzz_scan, "rewrite": test_fuzz_rewrite, "profile": test_fuzz_profile, "hostile": test_fuzz_hostile}
    for mod in mods.values():
        for b in mod.BUDGETS.values():
            b.seconds = math.inf
    return {f"{m}.{name}": (prop, list(getattr(mod, "KNOWN", ()))) for m, mod in mods.items() for name, prop in mod.PROPERTIES.items()}


def _where(exc: BaseException) -> str:
    """The innermost npufuse frame: where a crash is, not where it surfaced."""
    from test_fuzz_scan import innermost_npufuse_frame

    return innermost_npufuse_frame(exc) or "tests"


def _signature(prop: str, exc: BaseException) -> str:
    """Failures with the same cause count once: tmp paths and numbers masked."""
    first = (str(exc).strip().splitlines() or [""])[0]
    first = re.sub(r"/tmp/\S+", "<tmp>", first)
    first = re.sub(r"\d+", "N", first)[:120]
    return f"{prop}: {type(exc).__name__} at {_where(exc)}: {first}"


def _counted(check, runs: dict[str, int], name: str, known, hits: dict[str, int]):
    """The property, counting examples; hits of bugs that already have a reproducer are tallied
    instead of failing, so the run keeps looking for new ones (``--strict`` turns that off)."""

    def one(value):
        runs[name] += 1
        try:
            check(value)
        except Exception as exc:
            bug = next((b for b in known if b.matches(exc, value)), None)
            if bug is None:
                raise
            hits[bug.test] = hits.get(bug.test, 0) + 1

    return one


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, required=True)
    ap.add_argument("--only", default="", help="comma-separated property names (default: all)")
    ap.add_argument("--chunk", type=int, default=25, help="examples per hypothesis run")
    ap.add_argument("--out", help="write the failures, with whole inputs, as JSON")
    ap.add_argument("--strict", action="store_true", help="fail on known bugs too (those with xfail reproducers)")
    args = ap.parse_args(argv)

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import InvalidArgument


    props = _load()
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in props]
        if unknown:
            ap.error(f"unknown properties {unknown}; known: {', '.join(props)}")
        props = {k: props[k] for k in wanted}
    runs = {k: 0 for k in props}
    hits: dict[str, int] = {}
    broken: set[str] = set()
    failures: dict[str, dict] = {}
    start = time.monotonic()
    end = start + args.minutes * 60
    # no wall-clock deadline: on a loaded machine it would report slowness; the CPU guard of every
    # property still turns a hang into a failure
    loose = settings(max_examples=args.chunk, derandomize=False, database=None, deadline=None,
                     suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.target, Phase.shrink],
                     report_multiple_bugs=False)
    print(f"fuzzing {len(props)} properties for {args.minutes:g} min on {platform.node()} "
          f"({os.cpu_count()} CPUs, Python {platform.python_version()})", flush=True)
    rounds = 0
    last_note = start
    while time.monotonic() < end:
        rounds += 1
        for name, (prop, known) in props.items():
            if time.monotonic() >= end:
                break
            if name in broken:
                continue
            test = loose(given(prop.strategy)(_counted(prop.check, runs, name, [] if args.strict else known, hits)))
            try:
                test()
            except KeyboardInterrupt:
                end = 0
                break
            except InvalidArgument as exc:  # a broken strategy, not a finding: report it, drop the property
                failures[f"{name}: harness error"] = {"property": name, "count": 1, "error": f"InvalidArgument: {exc}",
                                                      "example": "", "traceback": traceback.format_exc(limit=8)}
                print(f"  HARNESS ERROR in {name}: {exc}; not run again", flush=True)
                broken.add(name)
                continue
            except BaseException as exc:  # a property failure (hypothesis re-raises it, shrunk)
                sig = _signature(name, exc)
                notes = "\n".join(getattr(exc, "__notes__", []))
                entry = failures.setdefault(sig, {"property": name, "count": 0, "error": f"{type(exc).__name__}: {exc}",
                                                  "example": notes, "traceback": traceback.format_exc(limit=6)})
                entry["count"] += 1
                if entry["count"] == 1:
                    print(f"  FAIL {sig}", flush=True)
        done = time.monotonic() - start
        if time.monotonic() - last_note > 60 or time.monotonic() >= end:
            last_note = time.monotonic()
            print(f"  round {rounds}: {sum(runs.values())} examples, {len(failures)} distinct failures, {done / 60:.1f} min", flush=True)

    elapsed = (time.monotonic() - start) / 60
    print(f"\nran {elapsed:.1f} min, {sum(runs.values())} examples (shrink steps included), {len(failures)} distinct failures")
    width = max(len(k) for k in props)
    for name in props:
        n_fail = sum(1 for f in failures.values() if f["property"] == name)
        print(f"  {name:<{width}}  {runs[name]:>7} examples  {n_fail} failures")
    if hits:
        print("known bugs hit (they have xfail reproducers): " + ", ".join(f"{k} x{v}" for k, v in sorted(hits.items())))
    for sig, f in failures.items():
        print(f"\n== {sig} (x{f['count']})\n{f['error'][:600]}\n{f['example'][:800]}")
    if args.out:
        Path(args.out).write_text(json.dumps({"minutes": elapsed, "examples": runs, "known_bug_hits": hits, "failures": list(failures.values())}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
