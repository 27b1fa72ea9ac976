"""s39 cold-scan cuts (helper speed39): each cut gives the same answers and skips work on the common path."""

from __future__ import annotations

import pytest

from npufuse.patterns import _guard_arms, base
from npufuse.patterns._guard_arms import contradicted_guard
from npufuse.patterns.base import Finding
from npufuse.scan.dataflow import ModuleInfo

_PLAIN = '''
def f(x, fast):
    y = x * 2
    return y
'''

_ARM = '''
def f(x, fast):
    if fast:
        y = x * 2
    else:
        y = x * 3
    return y
'''


def _scope(code: str) -> object:
    module = ModuleInfo.from_source("example.py", code)
    return next(s for s in module.scopes if s.qualname == "f")


def _finding(fused: str, line: int) -> Finding:
    return Finding("rms_norm", "f", line, line, {}, fused, "x")


def test_contradicted_guard_parses_no_fused_text_for_a_span_in_no_if_arm(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[str] = []
    real = _guard_arms.ast.parse

    def counted(code: str, *a: object, **k: object) -> object:
        parsed.append(code)
        return real(code, *a, **k)

    scope, finding = _scope(_PLAIN), _finding("if not fast:\n    y = x\nelse:\n    y = x * 2", 3)
    base._PARSED_CODE.pop(finding.fused, None)
    with monkeypatch.context() as m:
        m.setattr(_guard_arms.ast, "parse", counted)
        answer = contradicted_guard(scope, finding)
    assert answer is None and parsed == []


def test_contradicted_guard_still_reads_the_arm() -> None:
    scope = _scope(_ARM)
    assert "false in the taken arm" in contradicted_guard(scope, _finding("if not fast:\n    y = x\nelse:\n    y = x * 2", 4))
    assert "false in the `else` arm" in contradicted_guard(scope, _finding("if fast:\n    y = x\nelse:\n    y = x * 3", 6))
    assert contradicted_guard(scope, _finding("if not fast:\n    y = x\nelse:\n    y = fused(x)", 4)) is None
    assert contradicted_guard(scope, _finding("if not fast:\n    y = (", 4)) is None  # fused text that does not parse
