"""The bench scripts run (on the small fixture; figures are printed, never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from scan_fakes import copy_fixture

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_bench_scan_prints_the_figures(tmp_path):
    root = copy_fixture(tmp_path)
    out = subprocess.run([sys.executable, str(BENCH / "scan.py"), str(root), "--repeat", "1", "--no-subprocess", "--check-render", "-1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    for label in ("files/s", "lines/s", "ratio", "paired ratio", "cpu time", "render check"):
        assert label in out.stdout


def test_bench_scan_with_windows_line_ends_checks_every_replacement(tmp_path):
    root = copy_fixture(tmp_path)
    out = subprocess.run([sys.executable, str(BENCH / "scan.py"), str(root), "--line-ends", "crlf", "--repeat", "1", "--no-subprocess", "--check-render", "-1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    checked = next(line for line in out.stdout.splitlines() if line.startswith("render check"))
    same, total = checked.split()[2].split("/")
    assert int(total) > 0 and same == total, out.stdout  # the fast path's "\r\n" text is libcst's
    assert "npufuse-bench-crlf-" in out.stdout  # it scanned the converted copy


def test_bench_scan_without_a_corpus_says_so(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "scan.py"), str(tmp_path / "none")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "--fetch-transformers" in out.stderr


def test_corpus_findings_tables(tmp_path):
    root = copy_fixture(tmp_path)
    md = tmp_path / "findings.md"
    out = subprocess.run([sys.executable, str(BENCH / "corpus_findings.py"), str(root), "--suspects", "--markdown", str(md)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "| pattern | candidates | near misses |" in out.stdout
    assert "## Unflagged suspects (recall check)" in out.stdout
    assert md.read_text() == out.stdout


def test_bench_scan_ab_compares_two_source_trees(tmp_path):
    root = copy_fixture(tmp_path)
    src = str(BENCH.parent / "src")
    out = subprocess.run([sys.executable, str(BENCH / "scan_ab.py"), src, src, str(root), "--rounds", "1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "files whose results differ between A and B: 0" in out.stdout and "round 1 B" in out.stdout
    assert subprocess.run([sys.executable, str(BENCH / "scan_ab.py"), src, str(tmp_path / "nope"), str(root)],
                          capture_output=True, text=True, timeout=60).returncode == 2
