"""Tracing overhead: the same N steps of a training script, plain and under ``npufuse trace``.

    .venv/bin/python bench/trace.py [--steps 20] [--repeats 3]

Runs the bundled example (examples/tiny_llama, ``train.py --steps N``) in a temporary copy:
1. plain: ``python train.py --steps N`` (whole process wall time, and the median of the step
   times the script prints itself);
2. traced: ``npufuse trace --cmd "python train.py --steps N" --steps N`` (whole wall time,
   including npufuse's merge and sequence mining, and the traced script's own median step time).
Prints both and the ratios. Target (issue 15): traced <= 3x the plain run of the same steps.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"step (\d+) loss \S+ step_time ([0-9.]+)")


def _run(argv: list[str], cwd: Path) -> tuple[float, list[float], str]:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"bench/trace.py: {' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    out = proc.stdout + proc.stderr
    steps = [float(m.group(2)) for m in STEP.finditer(out)]
    return wall, steps, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "tiny_llama"
        shutil.copytree(ROOT / "examples" / "tiny_llama", repo)
        py = sys.executable
        plain_w, traced_w, plain_s, traced_s = [], [], [], []
        for _ in range(args.repeats):
            w, s, _ = _run([py, "train.py", "--steps", str(args.steps)], repo)
            plain_w.append(w)
            plain_s += s[1:]   # the first step pays one-off costs in both runs
            w, s, out = _run([py, "-m", "npufuse", "trace", "--cmd", f"{py} train.py --steps {args.steps}",
                              "--steps", str(args.steps), "--state-dir", str(Path(tmp) / "state")], repo)
            traced_w.append(w)
            log = (Path(tmp) / "state" / "trace" / "output.log").read_text(encoding="utf-8")
            traced_s += [float(m.group(2)) for m in STEP.finditer(log)][1:]
        pw, tw = min(plain_w), min(traced_w)
        ps, ts = statistics.median(plain_s), statistics.median(traced_s)
        print(f"tiny_llama, {args.steps} steps, best of {args.repeats}")
        print(f"plain run       {pw:8.2f} s wall   median step {ps * 1000:8.2f} ms")
        print(f"traced run      {tw:8.2f} s wall   median step {ts * 1000:8.2f} ms   (wall includes merge + mining)")
        print(f"ratio           {tw / pw:8.2f}x wall   {ts / ps:8.2f}x per step   target: <= 3x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
