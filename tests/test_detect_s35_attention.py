"""s35 attention constructs (HO11 development data): probabilities exposed under a flag by a conditional
expression, a learned tensor temperature folded into q, channel attention's D <= 768 run-time check."""

from __future__ import annotations

import re

from pathlib import Path

import pytest

from npufuse.patterns.attention import AttentionPattern
from npufuse.scan.engine import scan_repo


@pytest.fixture
def candidates(tmp_path: Path):
    def run(code: str) -> list[str]:
        (tmp_path / "m.py").write_text(code)
        res = scan_repo(tmp_path, jobs=1, only=["attention"])
        return [c["replacement"] for c in res.candidates]
    return run


def _example(name: str) -> str:
    return next(e.code for e in AttentionPattern.FUSE if e.name == name)


def test_flag_exposed_probabilities_guard_the_flag_and_bind_none(candidates) -> None:
    (text,) = candidates(_example("s35_probabilities_exposed_under_a_module_flag_by_a_conditional_expression"))
    assert "not self.keep_maps" in text
    assert "maps = None" in text


def test_learned_temperature_is_folded_into_q_with_a_shape_guard(candidates) -> None:
    (text,) = candidates(_example("s35_learned_per_head_temperature_divides_the_scores"))
    assert "scale=1.0" in text
    assert "self.tau.shape[-1] == 1" in text
    assert "scale=self.tau" not in text and "/ self.tau," not in text


def test_channel_attention_checks_the_tokens_against_the_op_limit(candidates) -> None:
    # s37: channel attention's D (its tokens) is bounded by the general head check every candidate carries (v's head dim
    # <= k's <= 768: k's contracted axis is q's), so no special check on q is made any more
    for name in ("s35_channel_attention_with_a_learned_temperature_from_a_5d_permute", "s35_channel_attention_transposed_by_a_method_result"):
        (text,) = candidates(_example(name))
        assert re.search(r"\.shape\[-?\d\] <= \S+\.shape\[-?\d\] <= 768", text), name
        assert "q.shape[-1] <= 768" not in text, name
    # s36 (audit36): every candidate now checks the op's D <= 768 on k with v's head dim (Emu3's channel attention
    # had its 1024 channels as D behind a bmm of a permuted q, where no named q carried the check)
    (text,) = candidates(_example("s36_identity_module_on_the_scores"))
    assert "k.shape[-1] <= 768" in text
