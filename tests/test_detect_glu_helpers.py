"""Gated products across calls and run-time chosen activations (issue 14, class 6/7): the
swiglu/geglu examples of this topic live in the pattern files and run, like every example, in
tests/test_patterns.py (detection with parameters, near-miss reasons, the rewrite under the
emulator; select them with -k). This file checks that every class of the topic keeps its examples."""

from __future__ import annotations

import pytest

from npufuse.patterns.geglu import Geglu
from npufuse.patterns.swiglu import Swiglu
from pattern_harness import example_cases

_PATTERNS = (Swiglu(), Geglu())
_TOPIC = ("gating_", "activation_held_by", "foreign_callable", "activation_from_getattr", "activation_from_own_table", "product_")


@pytest.mark.parametrize("prefix", _TOPIC)
def test_every_topic_class_has_examples(prefix: str) -> None:
    assert example_cases(_PATTERNS, prefix, "fuse") + example_cases(_PATTERNS, prefix, "keep"), prefix


def test_topic_has_near_misses_with_reasons_and_run_examples() -> None:
    keeps = example_cases(_PATTERNS, _TOPIC, "keep")
    assert any(c.values[1].reason for c in keeps), "no Keep example of the topic names its reason"
    assert example_cases(_PATTERNS, _TOPIC, "run"), "no example of the topic is run under the emulator"
