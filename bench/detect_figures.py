"""The README's detection tables: ``detect_corpus.py`` run on every label file, summary rows only.

    .venv/bin/python bench/detect_figures.py [--labels-dir bench] [--mirrors /work/.mirror] [--jobs 2]
                                             [--out DIR] [--only FILE,FILE]

Runs ``bench/detect_corpus.py --labels F`` (a process each, ``--jobs`` at a time) for every
``detect_*.json`` label file of ``--labels-dir`` and prints two Markdown tables:

* every file's per-pattern precision / recall (recall only for a ``recall_only`` file: ports);
* the blind files (``BLIND`` below: labels nobody tuned the detectors on), each with its overall
  precision and recall and their Wilson 95% intervals, and per-pattern recall (precision where it
  is below 1.00).

Each file's full output (every miss and extra when ``--list`` is given) is kept in ``--out``.
Reading the figures of a blind file is fine; reading its miss list defeats it: the miss lists are
written only for files not in ``BLIND``. Prints figures only; asserts nothing. A file whose
repositories have no mirrors prints an empty row (``detect_corpus.py`` says what it skipped).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Label files that are the project's honest test sets (never read for tuning). A file moves out of this
# list, with a README note, when it becomes development data.
BLIND = ("detect_labels_heldout28a.json", "detect_labels_heldout28b.json", "detect_labels_heldout28c.json", "detect_ports3_blind.json", "detect_ports4.json")
PATTERNS = ("rms_norm", "add_rms_norm", "rope", "attention", "sdpa", "swiglu", "geglu", "moe_experts", "fused_optimizer", "all")
_ROW = re.compile(r"^(\w+)\s+(\d+)\s+(\d+|-)\s+(\d+|-)\s+(\d+)\s")
_HEAD = re.compile(r"^\d+ of \d+ repositories")


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of k successes in n trials (0, 0 for n = 0)."""
    if n == 0:
        return 0.0, 0.0
    p = k / n
    d = 1 + z * z / n
    c = p + z * z / (2 * n)
    a = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (c - a) / d, (c + a) / d


def parse_rows(text: str) -> tuple[dict[str, tuple[int, int, int]], str]:
    """detect_corpus.py's summary: pattern -> (TP, FP, FN), and its 'N of M repositories' line."""
    rows: dict[str, tuple[int, int, int]] = {}
    head = ""
    for line in text.splitlines():
        if _HEAD.match(line):
            head = line
        m = _ROW.match(line)
        if m and m.group(1) in PATTERNS:
            rows[m.group(1)] = (int(m.group(2)), 0 if m.group(3) == "-" else int(m.group(3)), int(m.group(5)))
    return rows, head


def _recall_only(path: Path) -> bool:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and bool(data.get("recall_only"))


def _cell(row: tuple[int, int, int] | None, recall_only: bool) -> str:
    if row is None:
        return "—"
    tp, fp, fn = row
    rec = f"{tp / (tp + fn):.2f}" if tp + fn else "n/a"
    if recall_only:
        return rec
    return (f"{tp / (tp + fp):.2f}" if tp + fp else "n/a") + " / " + rec


def render_tables(results: dict[str, tuple[dict[str, tuple[int, int, int]], str]], recall_only: dict[str, bool]) -> str:
    """The two Markdown tables (all files; blind files with intervals)."""
    names = [n for n in results if results[n][0]]
    out = ["| pattern | " + " | ".join(n.removeprefix("detect_").removesuffix(".json") + (" R" if recall_only[n] else " P / R") for n in names) + " |",
           "|" + "---|" * (len(names) + 1)]
    for p in PATTERNS:
        out.append(f"| {p} | " + " | ".join(_cell(results[n][0].get(p), recall_only[n]) for n in names) + " |")
    out += ["", "| blind file | P [95% CI] | R [95% CI] | per pattern R (P where below 1.00) |", "|---|---|---|---|"]
    for n in names:
        if n not in BLIND or "all" not in results[n][0]:
            continue
        rows, head = results[n]
        tp, fp, fn = rows["all"]
        per = []
        for p in PATTERNS[:-1]:
            if p not in rows:
                continue
            a, b, c = rows[p]
            s = f"{p} {a / (a + c):.2f}" if a + c else f"{p} n/a"
            if not recall_only[n] and a + b and a / (a + b) < 1:
                s += f" (P {a / (a + b):.2f})"
            per.append(s)
        lo, hi = wilson(tp, tp + fp)
        rlo, rhi = wilson(tp, tp + fn)
        prec = "—" if recall_only[n] or tp + fp == 0 else f"{tp / (tp + fp):.2f} [{lo:.2f}, {hi:.2f}]"
        rec = f"{tp / (tp + fn):.2f} [{rlo:.2f}, {rhi:.2f}]" if tp + fn else "n/a"
        out.append(f"| {n} ({head.split(' scanned')[0]}) | {prec} | {rec} | {', '.join(per)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels-dir", type=Path, default=HERE)
    ap.add_argument("--mirrors", type=Path, default=None, help="passed on to detect_corpus.py")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="folder for each file's full output (default: a temporary folder)")
    ap.add_argument("--only", default="", help="comma-separated label file names")
    ap.add_argument("--list", action="store_true", help="keep every miss and extra of the non-blind files in --out")
    args = ap.parse_args(argv)
    files = sorted(p for p in args.labels_dir.glob("detect_*.json"))
    if args.only:
        wanted = {w.strip() for w in args.only.split(",") if w.strip()}
        files = [p for p in files if p.name in wanted]
    if not files:
        print(f"no detect_*.json label files in {args.labels_dir}", file=sys.stderr)
        return 2
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="npufuse-figures-"))
    out_dir.mkdir(parents=True, exist_ok=True)

    def run(path: Path) -> tuple[str, tuple[dict[str, tuple[int, int, int]], str]]:
        cmd = [sys.executable, str(HERE / "detect_corpus.py"), "--labels", str(path)]
        if args.mirrors:
            cmd += ["--mirrors", str(args.mirrors)]
        if args.list and path.name not in BLIND:
            cmd.append("--list")
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")})
        (out_dir / (path.name + ".txt")).write_text(proc.stdout + proc.stderr, encoding="utf-8")
        print(f"{path.name}: exit {proc.returncode}", file=sys.stderr, flush=True)
        return path.name, parse_rows(proc.stdout)

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = dict(pool.map(run, files))
    print(render_tables(results, {p.name: _recall_only(p) for p in files}), end="")
    print(f"\n(full outputs in {out_dir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
