"""Op-check overhead: ``npufuse verify op`` on a small applied candidate (a Llama-style RMSNorm,
hidden 64, batch 2 x seq 16, bf16, emulated torch_npu) against running the bare function.

    .venv/bin/python bench/opcheck.py [--repeat 5] [--hidden 64]

The candidate repo is built the way the verify tests build it (tests/test_verify_helpers.py:
rewritten with the same libcst splice as apply, state.json as apply writes it) in a temp folder.
Timed: one full ``verify_op`` (load the candidate, import the rewritten module, golden/original/
fused runs forward and backward, compare, write JSONL and state) — first call (imports of the
emulator included) and best of ``--repeat`` — and the bare module's forward + backward on the
same input shape (the work of one of the op check's runs). Prints both, the overhead in ms and
the ratio it is judged by (op check / bare call), and peak memory (ru_maxrss). Asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # the candidate repo builder the verify tests use


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="timed op checks after the first (default 5)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size of the RMSNorm (default 64)")
    args = ap.parse_args(argv)

    import torch

    import test_verify_helpers as helpers
    from npufuse.verify.candidate import load_candidate
    from npufuse.verify.opcheck import OpOptions, verify_op

    work = Path(tempfile.mkdtemp(prefix="npufuse-bench-opcheck-"))
    sd = helpers.rms_repo(work, config={"hidden_size": args.hidden})
    opts = OpOptions(backend="emulated")

    def one_check() -> float:
        t0 = time.perf_counter()
        report = verify_op(load_candidate(1, sd), opts)
        dt = time.perf_counter() - t0
        if not report.passed:
            raise SystemExit(f"op check failed unexpectedly: {report.reasons}")
        return dt

    first = one_check()
    checks = [one_check() for _ in range(max(1, args.repeat))]
    best_check = min(checks)

    # The bare function: the rewritten module itself (switch off: its original branch).
    spec = importlib.util.spec_from_file_location("npufuse_bench_model", work / "model.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    norm = module.RMSNorm(args.hidden)
    x = torch.randn(2, 16, args.hidden, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):  # warm-up
        norm(x).float().sum().backward()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        norm(x).float().sum().backward()
    bare = (time.perf_counter() - t0) / n

    print(f"candidate         rms_norm, RMSNorm(hidden {args.hidden}) on [2, 16, {args.hidden}] bfloat16, emulated torch_npu")
    print(f"op check          {best_check * 1000:.1f} ms best of {len(checks)} (first call {first * 1000:.1f} ms, emulator imports included)")
    print(f"bare function     {bare * 1e6:.0f} us forward + backward (mean of {n})")
    print(f"overhead          {(best_check - bare) * 1000:.1f} ms per op check")
    print(f"ratio             {best_check / bare:.0f}x  (op check / one bare forward+backward)")
    print(f"peak memory       {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB ru_maxrss (torch included)")
    print(f"machine load      {os.getloadavg()[0]:.1f} (1-min load average, {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
