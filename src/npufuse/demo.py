"""``npufuse demo``: the whole flow on the bundled example model, on CPU, under the emulator.

Copies ``examples/tiny_llama`` to an output folder and runs every stage that exists on it,
printing what each produced. Nothing outside the output folder is touched.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from npufuse.cli import main as cli_main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_llama"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="demo-out", help="output folder (default: demo-out)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per e2e run (default 60)")


def _step(title: str, argv: list[str]) -> int:
    print(f"\n=== {title}: npufuse {' '.join(argv)}", flush=True)
    rc = cli_main(argv)
    print(f"--- exit {rc}", flush=True)
    return rc


def run(args: argparse.Namespace) -> int:
    from npufuse.cli import UsageError

    if not EXAMPLE.is_dir():
        raise UsageError(f"bundled example not found at {EXAMPLE} (run from a source checkout)")
    out = Path(args.out).resolve()
    repo = out / "repo"
    if repo.exists():
        shutil.rmtree(repo)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__"))
    print(f"npufuse demo: example model copied to {repo}")
    failures = 0
    failures += _step("emulated torch_npu APIs", ["emulate"]) != 0
    failures += _step("one API's documentation", ["api", "npu_rms_norm"]) != 0
    print("\nnpufuse demo: done" + (f" with {failures} failing step(s)" if failures else ""))
    return 1 if failures else 0
