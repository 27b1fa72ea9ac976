"""``npufuse demo``: the whole flow on the bundled example model, on CPU, under the emulator.

Copies ``examples/tiny_llama`` (a small Llama-style decoder with hand-written RMSNorm, SwiGLU,
RoPE, eager attention and a Mixtral-style MoE layer, plus a train script printing step, loss and
step time) into a working folder, then: scan → show the report → accept all → apply → verify op
for each → verify e2e for each (50 steps, emulated) → HTML report → status. Nothing outside the
working folder is touched.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

from npufuse.cli import UsageError, number
from npufuse.cli import main as cli_main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_llama"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="demo-out", help="working folder (default: demo-out); its repo/ is replaced")
    parser.add_argument("--steps", type=number(int, minimum=1, maximum=10**6), default=50, help="training steps per e2e run (default 50)")
    parser.add_argument("--skip-e2e", action="store_true", help="stop after the op checks")


class _Flow:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.t0 = time.perf_counter()
        self.failures: list[str] = []

    def step(self, title: str, argv: list[str], ok: tuple[int, ...] = (0,)) -> int:
        elapsed = time.perf_counter() - self.t0
        print(f"\n[{elapsed:6.1f}s] === {title}\n$ npufuse {shlex.join(argv)}", flush=True)
        rc = cli_main(argv)
        if rc not in ok:
            self.failures.append(f"{title} (exit {rc})")
        return rc


def run(args: argparse.Namespace) -> int:
    import os

    if not EXAMPLE.is_dir():
        raise UsageError(f"bundled example not found at {EXAMPLE} (run from a source checkout)")
    out = Path(args.out).resolve()
    repo = out / "repo"
    out.mkdir(parents=True, exist_ok=True)
    for stale in (repo, out / ".npufuse"):
        if stale.exists():
            shutil.rmtree(stale)
    shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__"))
    os.chdir(out)  # state (.npufuse/) and reports live in the working folder
    # The demo trainer is tiny: one thread per process is faster than fighting over 2 cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    flow = _Flow(out)
    print(f"npufuse demo: example model copied to {repo}")

    flow.step("stage 1: scan (read-only)", ["scan", "repo", "-o", "report.md", "--no-progress"])
    report = out / "report.md"
    if report.exists():
        text = report.read_text(encoding="utf-8")
        start = text.find("### 1.1")
        end = text.find("## 2.", start)
        print(text[start:end].strip() if start >= 0 else text[:1500])
    scan = json.loads((out / ".npufuse" / "scan.json").read_text(encoding="utf-8"))
    if not scan.get("candidates"):
        print("npufuse demo: the scan found no candidates; nothing more to show")
        return 1

    # exit 1 = some accepted sites were skipped (each with its reason); the rest was applied
    flow.step("stage 2 gate: accept all, apply", ["apply", "--accept", "all"], ok=(0, 1))
    state = json.loads((out / ".npufuse" / "state.json").read_text(encoding="utf-8"))
    applied = [c["id"] for c in state.get("candidates", []) if c.get("applied")]
    print(f"applied candidates: {applied}")

    for cid in applied:
        flow.step(f"verify op {cid}", ["verify", "op", str(cid), "--quiet"], ok=(0, 1))
    if not args.skip_e2e:
        cmd = f"{shlex.quote(sys.executable)} train.py --steps {args.steps}"
        for cid in applied:
            cur = json.loads((out / ".npufuse" / "state.json").read_text(encoding="utf-8"))
            status = next((c["status"] for c in cur["candidates"] if c["id"] == cid), "")
            if status == "accuracy_failed":
                print(f"\ncandidate {cid}: accuracy failed at op level; no e2e run")
                continue
            flow.step(
                f"verify e2e {cid}",
                ["verify", "e2e", str(cid), "--cmd", cmd, "--steps", str(args.steps), "--env", "OMP_NUM_THREADS=1", "--quiet"],
                ok=(0, 1),
            )
    flow.step("validation report", ["report", "html", "-o", "report.html"])
    flow.step("task list", ["status"])

    jsonl = sorted(str(p.relative_to(out)) for p in (out / ".npufuse").rglob("*.jsonl"))
    print(f"\nnpufuse demo finished in {time.perf_counter() - flow.t0:.0f}s (results are emulated: numerics, not NPU speed)")
    print(f"  identification report : {report}")
    print(f"  scan data             : {out / '.npufuse' / 'scan.json'}")
    print(f"  task list             : {out / '.npufuse' / 'state.json'}  (+ CONCLUSIONS.md)")
    print(f"  per-step JSONL        : " + (", ".join(str(out / j) for j in jsonl) or "none"))
    print(f"  HTML validation report: {out / 'report.html'}")
    print(f"  rewritten repository  : {repo}")
    if flow.failures:
        print("failing steps: " + "; ".join(flow.failures))
        return 1
    return 0
