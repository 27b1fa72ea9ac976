"""Scan throughput on a corpus: files/s, lines/s, and the ratio of ``npufuse scan`` wall time to
a plain ``ast.parse`` of the same files in one process.

    .venv/bin/python bench/scan.py --fetch-transformers     # pip download transformers, unpack modeling files
    .venv/bin/python bench/scan.py [CORPUS_DIR] [--jobs N] [--repeat 3] [--only IDS] [--line-ends crlf] [--components] [--phases] [--check-render N]

Downloads nothing unless ``--fetch-transformers`` is given: it runs ``pip download --no-deps
transformers`` into ``bench/.data/`` (gitignored) and unpacks ``transformers/models/*/modeling_*.py``
into ``bench/.data/transformers/``, the default corpus. Prints figures only; asserts nothing.

Scan timings: *cold* (``npufuse.cli.main(["scan", ...])`` in-process, detectors already
imported, an empty result cache: every file parsed and its cache entry written; target
<= 1.0x ast.parse using all cores), *warm* (the same scan again on the filled cache: nothing
parsed; target <= 0.1x) and *end to end* (``python -m npufuse scan --no-cache`` as a subprocess:
interpreter start and imports included). The baseline reads and parses the files the scan
reads, sequentially, in this process, right before each cold scan: the *paired ratio* is each
cold scan over the baseline run just before it (median and range over ``--repeat`` pairs), the
figure to judge on a shared machine whose speed drifts between runs; *ratio* divides the best of
each. Peak memory is this process's ru_maxrss (the pool's workers: RUSAGE_CHILDREN).

``--line-ends crlf`` scans a copy of the corpus with Windows line ends (every ``.py`` line ending
in "\\r\\n"): the replacement text must take the same fast path as for "\\n" files.

``--only IDS`` times a scan running just those detectors (``npufuse scan --only``): with one
cheap detector (``--only geglu``) the ratio is what reading, parsing, indexing, repo facts, the
cache and the outputs cost without detection -- the floor under the cold figure.
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / ".data"
CORPUS = DATA / "transformers"
sys.path.insert(0, str(HERE.parent / "src"))


def fetch_transformers(version: str | None) -> Path:
    """pip download the transformers wheel (no deps) and unpack its modeling files."""
    dl = DATA / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    spec = f"transformers=={version}" if version else "transformers"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", spec, "-d", str(dl)], check=True)
    wheels = sorted(dl.glob("transformers-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise SystemExit("pip download produced no transformers wheel")
    wheel = wheels[-1]
    if CORPUS.exists():
        shutil.rmtree(CORPUS)
    rx = re.compile(r"transformers/models/[^/]+/modeling_[^/]+\.py")
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if rx.fullmatch(name):
                out = CORPUS / name
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(name))
                n += 1
    (CORPUS / "SOURCE").write_text(f"{wheel.name}\n")
    print(f"unpacked {n} modeling files from {wheel.name} into {CORPUS}")
    return CORPUS


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the scan's pool workers)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def baseline(root: Path, files: list[str]) -> tuple[float, int, float]:
    """Seconds to read + decode + ast.parse every file, sequentially; total lines; CPU seconds."""
    c0 = _cpu()
    t0 = time.perf_counter()
    lines = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rel in files:
            data = (root / rel).read_bytes()
            try:
                ast.parse(data, filename=rel)
            except (SyntaxError, ValueError):
                pass
            lines += data.count(b"\n")
    return time.perf_counter() - t0, lines, _cpu() - c0


def crlf_copy(corpus: Path, dest: Path) -> Path:
    """A copy of ``corpus`` under ``dest`` whose .py files end every line with "\\r\\n" (other
    files as they are): the line ends of a repository checked out on Windows."""
    target = dest / corpus.name
    for src in sorted(corpus.rglob("*")):
        out = target / src.relative_to(corpus)
        if src.is_dir():
            out.mkdir(parents=True, exist_ok=True)
        elif src.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            data = src.read_bytes()
            out.write_bytes(data.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n") if src.suffix == ".py" else data)
    return target


def components(root: Path, files: list[str]) -> list[tuple[str, float]]:
    """CPU seconds of each part of ``analyze_file`` over the corpus, in this process (one pass):
    read, parse, index, repo facts, every detector (summed over scopes) and the per-candidate
    work (risks, replacement text, switch context); then each detector's time on the scopes it
    yielded nothing for (what a ``Pattern.SCOPE_WORDS`` gate could save at most). The parts are timed by wrapping the
    functions ``analyze_file`` calls (about a microsecond per call, included in the figures);
    "other" is what analyze_file spends outside them."""
    from npufuse.scan import engine, replacement, repo_search, risks
    from npufuse.scan.dataflow import ModuleInfo

    spent: dict[str, float] = {}
    idle: dict[str, float] = {}  # detector time on scopes it yielded nothing for
    clock = time.process_time
    saved: list[tuple[object, str, object]] = []

    def timed(owner: object, name: str, label: str) -> None:
        fn = getattr(owner, name)
        saved.append((owner, name, owner.__dict__[name]))

        def wrapper(*a, **k):
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + clock() - t

        setattr(owner, name, classmethod(lambda cls, *a, **k: wrapper(*a, **k)) if isinstance(owner.__dict__[name], classmethod) else wrapper)

    timed(engine, "read_source", "read (+ sha256, decode)")
    timed(engine, "parse_source", "parse (ast.parse)")
    timed(ModuleInfo, "from_source", "index (ModuleInfo: imports, scopes)")
    timed(repo_search, "file_facts", "repo facts (switches, torch_npu code)")
    timed(risks, "local_risks", "candidates: local risks")
    timed(replacement, "fast_body", "candidates: replacement text")
    timed(repo_search, "site_context", "candidates: switch context")
    patterns = engine.registry_patterns()
    for p in patterns:
        cls = type(p)
        saved.append((cls, "detect", cls.__dict__["detect"]))

        def detect(self, module, scope, _f=cls.__dict__["detect"], _label=f"detector {p.id}"):
            t = clock()
            out: list = []
            try:
                out = list(_f(self, module, scope))
                return out
            finally:
                d = clock() - t
                spent[_label] = spent.get(_label, 0.0) + d
                if not out:  # what a scope gate (Pattern.SCOPE_WORDS) could save at most
                    idle[_label] = idle.get(_label, 0.0) + d

        cls.detect = detect
    try:
        t0 = clock()
        for rel in files:
            engine.analyze_file(root, rel, patterns, engine.ScanOptions())
        total = clock() - t0
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
    rows = sorted(spent.items(), key=lambda kv: -kv[1])
    rows += [("other (analyze_file itself, freeing trees)", total - sum(spent.values())), ("total", total)]
    rows.append(("detectors on scopes yielding nothing (all)", sum(idle.values())))
    rows += sorted(((f"  {k.removeprefix('detector ')}, nothing yielded", v) for k, v in idle.items()), key=lambda kv: -kv[1])
    return rows


def phases(corpus: Path, out: Path, jobs: int, only: tuple[str, ...] | list[str] = ()) -> list[tuple[str, float, float]]:
    """One cold scan in this process with a timestamp around each of its phases in the parent:
    (phase, wall seconds, parent CPU seconds). With a pool, "analyse" is the workers' time and
    everything else is this process alone: the serial part that adds to the wall time."""
    from npufuse.cli import main as cli_main
    from npufuse.report import markdown
    from npufuse.scan import command, engine

    marks: list[tuple[str, float, float]] = []
    saved = []

    def wrap(owner: object, name: str, label: str) -> None:
        fn = getattr(owner, name)
        saved.append((owner, name, fn))

        def timed(*a, **k):
            marks.append((label + " start", time.perf_counter(), time.process_time()))
            try:
                return fn(*a, **k)
            finally:
                marks.append((label + " end", time.perf_counter(), time.process_time()))

        setattr(owner, name, timed)

    wrap(engine, "gather_inputs", "walk + hash")
    wrap(engine, "_analyze_all", "analyse")
    wrap(engine, "_candidates", "candidates")
    wrap(command, "dumps", "scan.json")
    wrap(markdown, "render_markdown", "report.md")
    shutil.rmtree(out / "cache", ignore_errors=True)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        cli_main(["scan", str(corpus), "-o", str(out / "report.md"), "--state-dir", str(out), "--no-progress", "--jobs", str(jobs), *only])
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    t1, c1 = time.perf_counter(), time.process_time()
    rows, prev = [], ("start", t0, c0)
    for label, t, c in marks + [("end (writes, run record)", t1, c1)]:
        rows.append((f"{prev[0]} -> {label}", t - prev[1], c - prev[2]))
        prev = (label, t, c)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", nargs="?", help=f"folder to scan (default: {CORPUS.relative_to(HERE.parent)})")
    ap.add_argument("--fetch-transformers", action="store_true", help="pip download transformers into bench/.data and unpack its modeling files")
    ap.add_argument("--transformers-version", default=None, help="with --fetch-transformers: a version (default: latest)")
    ap.add_argument("--jobs", type=int, default=None, help="worker processes for the scan (default: all cores)")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions; the best is reported (default 3)")
    ap.add_argument("--only", metavar="IDS", help="run only these detectors (comma-separated pattern ids, as npufuse scan --only)")
    ap.add_argument("--no-subprocess", action="store_true", help="skip the end-to-end subprocess timing")
    ap.add_argument("--state-dir", help="keep scan.json, report.md and the cache here (default: a temp folder, deleted)")
    ap.add_argument("--components", action="store_true", help="also time each part of the per-file analysis (parse, index, each detector, ...) in one process")
    ap.add_argument("--phases", action="store_true", help="also time the phases of one cold scan in the parent (walk, pool, candidates, outputs): its serial part")
    ap.add_argument("--line-ends", choices=("as-is", "crlf"), default="as-is",
                    help="crlf: scan a copy of the corpus whose Python files end every line with \\r\\n (a checkout made on Windows)")
    ap.add_argument("--check-render", type=int, default=0, metavar="N",
                    help="also check N random candidates' replacement against render_site on the whole file (0: none, -1: all)")
    args = ap.parse_args(argv)

    if args.fetch_transformers:
        fetch_transformers(args.transformers_version)
    corpus = Path(args.corpus) if args.corpus else CORPUS
    if not corpus.is_dir():
        print(f"no corpus at {corpus}; run with --fetch-transformers or pass a folder", file=sys.stderr)
        return 2

    if args.line_ends == "crlf":
        import atexit

        copy_dir = Path(tempfile.mkdtemp(prefix="npufuse-bench-crlf-"))
        atexit.register(shutil.rmtree, copy_dir, True)
        corpus = crlf_copy(corpus, copy_dir)

    from npufuse.cli import main as cli_main
    from npufuse.scan import engine
    from npufuse.scan.walk import walk

    engine.registry_patterns()  # import the detectors before timing (they are the same in every run)
    walked = walk(corpus)
    files = walked.files
    cores = os.cpu_count() or 1
    jobs = args.jobs if args.jobs is not None else cores
    out = Path(args.state_dir) if args.state_dir else Path(tempfile.mkdtemp(prefix="npufuse-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    only = ["--only", args.only] if args.only else []

    def timed_scan() -> tuple[float, float]:
        c0 = _cpu()
        t0 = time.perf_counter()
        rc = cli_main(["scan", str(corpus), "-o", str(out / "report.md"), "--state-dir", str(out), "--no-progress", "--jobs", str(jobs), *only])
        if rc != 0:
            raise SystemExit(f"npufuse scan exited {rc}")
        return time.perf_counter() - t0, _cpu() - c0

    # Each cold scan right after its own baseline: this machine's speed drifts by 10-20% within
    # a minute (shared host), so the ratio of a pair taken together is the steadier figure;
    # the best of each is printed too.
    base_runs, scan_times = [], []
    for _ in range(args.repeat):
        base_runs.append(baseline(walked.root, files))
        shutil.rmtree(out / "cache", ignore_errors=True)  # cold: an empty cache every time
        scan_times.append(timed_scan())
    t_parse, lines, c_parse = min(base_runs, key=lambda r: r[0])
    t_scan, c_scan = min(scan_times)
    pairs = sorted(s[0] / b[0] for b, s in zip(base_runs, scan_times))
    cold_bytes = (out / "scan.json").read_bytes(), (out / "report.md").read_bytes()
    warm_times = [timed_scan() for _ in range(args.repeat)]
    t_warm, c_warm = min(warm_times)
    identical = cold_bytes == ((out / "scan.json").read_bytes(), (out / "report.md").read_bytes())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    import json

    scan = json.loads((out / "scan.json").read_text())
    t_e2e = None
    if not args.no_subprocess:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "npufuse", "scan", str(corpus), "-o", str(out / "r2.md"), "--state-dir", str(out / "s2"), "--no-progress", "--no-cache", "--jobs", str(jobs), *only],
                       check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")})
        t_e2e = time.perf_counter() - t0

    by_pattern: dict[str, int] = {}
    for c in scan["candidates"]:
        by_pattern[c["pattern"]] = by_pattern.get(c["pattern"], 0) + 1
    print(f"corpus            {corpus} ({(corpus / 'SOURCE').read_text().strip() if (corpus / 'SOURCE').exists() else 'local folder'})")
    print(f"files             {len(files)} Python files, {lines} lines ({scan['files_scanned']} scanned, {len(scan['files_failed'])} problems)")
    print(f"detectors         {', '.join(scan['patterns']) or 'none'}")
    print(f"candidates        {len(scan['candidates'])} ({', '.join(f'{k} {v}' for k, v in sorted(by_pattern.items()))}); near misses {len(scan['near_misses'])}")
    print(f"cores             {cores} (scan jobs {jobs})")
    print(f"ast.parse only    {t_parse:.2f} s  ({len(files) / t_parse:.0f} files/s, {lines / t_parse:.0f} lines/s), one process")
    print(f"npufuse scan      {t_scan:.2f} s  ({len(files) / t_scan:.0f} files/s, {lines / t_scan:.0f} lines/s), cold (empty cache), in-process, best of {args.repeat}")
    print(f"warm scan         {t_warm:.2f} s  ({len(files) / t_warm:.0f} files/s), every file from the cache, best of {args.repeat}; "
          f"scan.json and report.md {'byte-identical to' if identical else 'DIFFER FROM'} the cold scan's")
    print(f"ratio             cold {t_scan / t_parse:.2f} (target <= 1.0), warm {t_warm / t_parse:.3f} (target <= 0.1)  (npufuse scan / ast.parse wall time, best of each)")
    print(f"paired ratio      cold median {statistics.median(pairs):.2f}, range {pairs[0]:.2f}-{pairs[-1]:.2f} over {len(pairs)} pair(s) "
          f"(each cold scan / the ast.parse baseline run just before it: {', '.join(f'{r:.2f}' for r in pairs)})")
    print(f"cpu time          ast.parse {c_parse:.2f} s, npufuse scan {c_scan:.2f} s (all processes): cpu ratio {c_scan / c_parse:.2f}, "
          f"i.e. a wall ratio of about {c_scan / c_parse / min(jobs, cores):.2f} on {min(jobs, cores)} idle cores")
    print(f"warm cpu time     {c_warm:.2f} s: cpu ratio {c_warm / c_parse:.3f}")
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"peak memory       {me:.0f} MiB this process, {kids:.0f} MiB largest child (a pool worker or the end-to-end run)")
    print(f"machine load      {load:.1f} (1-min load average after the runs; wall figures are only meaningful when it is below {cores})")
    if t_e2e is not None:
        print(f"end to end        {t_e2e:.2f} s  (python -m npufuse scan, start-up and imports included; ratio {t_e2e / t_parse:.2f})")

    if args.components:
        parts = components(walked.root, files)
        print(f"components        CPU seconds of analyze_file's parts, one process, one pass (ast.parse baseline {c_parse:.2f} s):")
        for label, secs in parts:
            print(f"  {label:44s} {secs:6.2f}  ({secs / c_parse:.2f}x ast.parse)")

    if args.phases:
        rows = phases(corpus, out, jobs, only)
        serial = sum(w for label, w, _c in rows if not label.startswith("analyse start"))
        print(f"phases            one cold scan, {jobs} jobs, wall and parent CPU seconds (serial part outside the pool: {serial:.2f} s):")
        for label, wall, cpu in rows:
            print(f"  {label:58s} {wall:6.3f}  cpu {cpu:6.3f}")

    if args.check_render:
        from npufuse.patterns.base import Finding
        from npufuse.rewrite.codegen import Switch, render_site

        cands = scan["candidates"]
        sample = cands if args.check_render < 0 else random.Random(0).sample(cands, min(args.check_render, len(cands)))
        same = 0
        for c in sample:
            src = (walked.root / c["file"]).read_bytes().decode("utf-8")  # its own line ends (read_text would make "\r\n" "\n")
            f = Finding(c["pattern"], c["qualname"], c["line"], c["end_line"], c["params"], c["fused"], c["guard_tensor"])
            sw = Switch(c["switch"]["kind"], c["switch"]["expr"], c["switch"]["name"])
            try:
                ok = render_site(src, f, sw, c["id"]) == c["replacement"]  # the per-candidate switch names its id
            except Exception as exc:  # render_site cannot do it at all: counted as a mismatch
                ok = False
                print(f"  render_site failed for {c['key']}: {type(exc).__name__}: {exc}")
            same += ok
            if not ok:
                print(f"  replacement differs from render_site: {c['key']} (lines {c['line']}-{c['end_line']})")
        print(f"render check      {same}/{len(sample)} replacements identical to render_site on the whole file")
    if not args.state_dir:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
