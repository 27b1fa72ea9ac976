"""bench/rewrite.py and bench/opcheck.py run and print their judged figures (never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from scan_fakes import copy_fixture

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_bench_rewrite_prints_ms_per_file(tmp_path):
    root = copy_fixture(tmp_path)
    out = subprocess.run([sys.executable, str(BENCH / "rewrite.py"), str(root), "--limit", "2"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    for label in ("ms/file", "peak memory", "outputs parse     2/2", "machine load"):
        assert label in out.stdout


def test_bench_opcheck_prints_the_overhead_ratio():
    out = subprocess.run([sys.executable, str(BENCH / "opcheck.py"), "--repeat", "1"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    for label in ("op check", "bare function", "overhead", "ratio", "peak memory"):
        assert label in out.stdout
