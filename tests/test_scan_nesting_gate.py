"""The scan's cheap gate before apply's nesting check (engine._nesting_ok): the measure runs only
where a physical line is at least nesting.LIMIT characters long, because every level it counts
takes a character of the line. These tests hold the premise for the costliest constructs per
character and check that the gate measures exactly where it must."""

from __future__ import annotations

import pytest

from npufuse.rewrite import nesting
from npufuse.scan import engine

LIMIT = nesting.LIMIT


def _fit(unit: str, head: str = "x = ", tail: str = "1") -> str:
    """``head`` + as many ``unit`` as fit in a line of LIMIT - 1 characters (newline included)."""
    room = LIMIT - 2 - len(head) - len(tail)
    return head + unit * (room // len(unit)) + tail + "\n"


@pytest.mark.parametrize("line", [
    "x = " + "(" * 190 + "1" + ")" * 190 + "\n",  # one level per bracket: CPython stops at 200
    _fit("-"),  # unary minus: the cheapest chain per character
    _fit("lambda: "),
    _fit("1 + "),
    _fit("a."),
    _fit('"" '),
    'x = f"' + "(" * (LIMIT - 10) + '"\n',  # an f-string's brackets count one level each
    " " * 8 + "if x:\n" + " " * 9 + "y = " + "-" * (LIMIT - 16) + "1\n",  # indentation counts as levels
])  # fmt: skip
def test_a_statement_on_one_short_line_stays_below_the_limit(line: str) -> None:
    assert all(len(ln) < LIMIT for ln in line.splitlines(keepends=True))
    assert nesting.measure(line).depth < LIMIT


def test_the_gate_measures_only_files_with_a_long_line(monkeypatch) -> None:
    calls: list[int] = []
    real = nesting.problem
    monkeypatch.setattr(nesting, "problem", lambda text, limit=None: calls.append(len(text)) or real(text, limit))
    short = "import torch\n\n\ndef f(x):\n    return x * 2\n"
    assert engine._nesting_ok(short, short.splitlines(keepends=True)) and calls == []
    deep = short + "H = " + "lambda: " * 1000 + "1\n"
    assert not engine._nesting_ok(deep, deep.splitlines(keepends=True)) and len(calls) == 1
    long_but_flat = short + "S = [" + "1, " * 400 + "]\n"
    assert engine._nesting_ok(long_but_flat, long_but_flat.splitlines(keepends=True)) and len(calls) == 2
