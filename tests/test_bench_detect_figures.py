"""bench/detect_figures.py: the README's detection tables from detect_corpus.py's summary rows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# loaded from its file, not by putting bench/ on sys.path: bench/profile.py would shadow the stdlib
# `profile` for every later test in the process (tests/test_corpus_audit.py checks that)
_SPEC = importlib.util.spec_from_file_location("detect_figures", Path(__file__).resolve().parent.parent / "bench" / "detect_figures.py")
assert _SPEC is not None and _SPEC.loader is not None
detect_figures = importlib.util.module_from_spec(_SPEC)
sys.modules["detect_figures"] = detect_figures
_SPEC.loader.exec_module(detect_figures)

SUMMARY = """\
3 of 4 repositories scanned (whole repositories: 120 files, scan 2.0s), 9 labelled files, 12 fuse / 5 keep labels
pattern                TP   FP (keep)   FN  precision [95% CI]       recall [95% CI]
rms_norm                4    1      1    0  0.80 [0.38, 0.96]        1.00 [0.51, 1.00]
rope                    1    0      0    3  1.00 [0.21, 1.00]        0.25 [0.05, 0.70]
all                     5    1      1    3  0.83 [0.44, 0.97]        0.62 [0.31, 0.86]
missed  rope   some/repo/file.py:10-20 f: no near miss either
"""


def test_wilson_matches_the_known_interval():
    lo, hi = detect_figures.wilson(5, 6)
    assert (round(lo, 2), round(hi, 2)) == (0.44, 0.97)
    assert detect_figures.wilson(0, 0) == (0.0, 0.0)


def test_summary_rows_are_read_and_miss_lines_ignored():
    rows, head = detect_figures.parse_rows(SUMMARY)
    assert rows == {"rms_norm": (4, 1, 0), "rope": (1, 0, 3), "all": (5, 1, 3)}
    assert head.startswith("3 of 4 repositories")


@pytest.mark.parametrize("name, blind", [(detect_figures.BLIND[0], True), ("detect_labels_heldout8.json", False)])
def test_only_blind_files_get_the_interval_table(name, blind):
    text = detect_figures.render_tables({name: detect_figures.parse_rows(SUMMARY)}, {name: False})
    assert "| rms_norm | 0.80 / 1.00 |" in text and "| rope | 1.00 / 0.25 |" in text
    line = [ln for ln in text.splitlines() if ln.startswith(f"| {name}")]
    if blind:
        assert line == [f"| {name} (3 of 4 repositories) | 0.83 [0.44, 0.97] | 0.62 [0.31, 0.86] | rms_norm 1.00 (P 0.80), rope 0.25 |"]
    else:
        assert line == []


def test_recall_only_files_print_recall_alone():
    name = "detect_ports4.json"
    text = detect_figures.render_tables({name: detect_figures.parse_rows(SUMMARY)}, {name: True})
    assert "| rms_norm | 1.00 |" in text
    assert f"| {name} (3 of 4 repositories) | — | 0.62 [0.31, 0.86] | rms_norm 1.00, rope 0.25 |" in text
