"""Gated products across calls and run-time chosen activations (issue 14, class 6/7): the
swiglu/geglu examples of this topic, detection, near-miss reasons and the rewrite under the
emulator (the examples themselves live in the pattern files; these tests run them by name)."""

from __future__ import annotations

import pytest

from npufuse.patterns.geglu import Geglu
from npufuse.patterns.swiglu import Swiglu
from pattern_harness import check_rewrite_runs, detect_all

_TOPIC = ("gating_", "activation_held_by", "foreign_callable", "activation_from_getattr", "activation_from_own_table", "product_")


def _cases(kind: str):
    for p in (Swiglu(), Geglu()):
        for ex in getattr(p, kind):
            if ex.name.startswith(_TOPIC):
                yield pytest.param(p, ex, id=f"{p.id}-{ex.name}")


@pytest.mark.parametrize("pattern,example", list(_cases("FUSE")))
def test_fuse_found_with_params(pattern, example) -> None:
    findings, _ = detect_all(pattern, example.code)
    assert findings, example.name
    for key, want in example.expect.items():
        got = getattr(findings[0], key) if key in ("line", "end_line", "qualname") else findings[0].params.get(key)
        assert got == want, (key, got, want)


@pytest.mark.parametrize("pattern,example", [c for c in _cases("FUSE") if c.values[1].run])
def test_fuse_rewrite_matches_under_emulator(pattern, example) -> None:
    findings, _ = detect_all(pattern, example.code)
    facts = check_rewrite_runs(pattern, example.code, example.run, findings)
    assert facts["calls"] >= 1, facts["all_calls"]
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"], default=1.0) >= 0.9999


@pytest.mark.parametrize("pattern,example", list(_cases("KEEP")))
def test_keep_refused_with_reason(pattern, example) -> None:
    findings, misses = detect_all(pattern, example.code)
    assert not findings
    if example.reason:
        assert any(example.reason.lower() in m.reason.lower() for m in misses), [m.reason for m in misses]
