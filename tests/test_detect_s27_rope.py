"""Rope census pass (issue 14, session 27): mechanisms found by a census of ~290 unlabelled repos.

- Rotated tensors above 4-D (q and k stacked as one 5-D tensor, Infinity-style): npu_rotary_mul takes
  4-D only, so the fused branch merges x's leading axes into one where cos/sin are 1 along them (checked
  at run time) and restores them after; elsewhere the original runs. The test pins that the fused
  branch really runs for the 5-D tensor (the emulator counts the call) and matches the original.
"""

from __future__ import annotations

import pytest

from npufuse.patterns import rope as R
from pattern_harness import check_rewrite_runs, detect_all

PATTERN = R.RopePattern()


def _example(name: str):
    return next(ex for ex in PATTERN.FUSE if ex.name == name)


_FIVE_D_ONLY = '''
S, D = 6, 8
ang = torch.outer(torch.arange(S).float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
table = torch.stack((ang.cos(), ang.sin()))[:, None, None]  # [2, 1, 1, S, D/2]
q = torch.randn(2, 3, S, D, requires_grad=True)
k = torch.randn(2, 3, S, D, requires_grad=True)
out = turn_qk(q, k, table)
leaves = [q, k]
'''


def _assert_same(facts) -> None:
    assert facts["n_out"][0] == facts["n_out"][1]
    assert all(a == b for a, b in facts["dtypes"]) and all(a == b for a, b in facts["shapes"])
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"], default=1.0) >= 0.9999


def test_stacked_five_d_qk_runs_the_fused_branch():
    code = _example("stacked_lane_pairs_left_unmerged").code
    findings, _ = detect_all(PATTERN, code)
    facts = check_rewrite_runs(PATTERN, code, _FIVE_D_ONLY, findings)
    assert facts["all_calls"].get("npu_rotary_mul", 0) >= 1, facts["all_calls"]
    _assert_same(facts)


def test_stacked_five_d_qk_with_per_batch_table_keeps_the_original():
    # the table varies along the stacked axis (one table for q, another for k): merging that axis
    # into the batch would pair the wrong rows, so the run-time check sends it to the original code
    code = _example("stacked_lane_pairs_left_unmerged").code
    run = _FIVE_D_ONLY.replace("table = torch.stack((ang.cos(), ang.sin()))[:, None, None]",
                               "table = torch.stack((ang.cos(), ang.sin()))[:, None, None].expand(2, 2, 1, S, D // 2) * "
                               "torch.tensor([1.0, 0.5]).view(1, 2, 1, 1, 1)")
    findings, _ = detect_all(PATTERN, code)
    facts = check_rewrite_runs(PATTERN, code, run, findings)
    assert facts["all_calls"].get("npu_rotary_mul", 0) == 0, facts["all_calls"]
    _assert_same(facts)
