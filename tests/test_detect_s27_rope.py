"""Rope census pass (issue 14, session 27): mechanisms found by a census of ~290 unlabelled repos.

- Rotated tensors above 4-D (q and k stacked as one 5-D tensor, Infinity-style): npu_rotary_mul takes
  4-D only, so the fused branch merges x's leading axes into one where cos/sin are 1 along them (checked
  at run time) and restores them after; elsewhere the original runs. The test pins that the fused
  branch really runs for the 5-D tensor (the emulator counts the call) and matches the original.
- A rotated copy bound on both paths of one if/elif (lane pairs / halves): each path runs fused with its own
  rotary_mode; several rotations in one branch of a flag (q and k): the branch is fused, the other keeps
  the original. The counts of fused calls per run pin which paths run fused.
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


def _calls(name: str, run: str) -> int:
    code = _example(name).code
    findings, _ = detect_all(PATTERN, code)
    facts = check_rewrite_runs(PATTERN, code, run, findings)
    _assert_same(facts)
    return facts["all_calls"].get("npu_rotary_mul", 0)


_BOTH_PATHS_RUN = '''
S, D = 5, 8
ang = torch.outer(torch.arange(S).float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
x = torch.randn(2, 3, S, D).bfloat16().requires_grad_()
table = ang.repeat_interleave(2, -1) if UNBIND == -1 else torch.cat((ang, ang), -1)
out = apply(x, table.cos(), table.sin(), UNBIND)
leaves = [x]
'''


@pytest.mark.parametrize("unbind", [-1, -2])
def test_rotation_bound_on_both_paths_fuses_each_path_with_its_mode(unbind):
    # the lane-pair path (the common one in diffusers) runs fused in interleave mode, the halves path in half mode
    assert _calls("rotation_bound_on_both_paths_of_an_if", _BOTH_PATHS_RUN.replace("UNBIND", str(unbind))) == 1


_FLAG_BRANCH_RUN = '''
S, D, R = 5, 12, 8
ang = torch.outer(torch.arange(S).float(), 1.0 / (10000 ** (torch.arange(0, R, 2).float() / R)))
cs = torch.cat((ang.cos(), ang.sin()), dim=-1)
q = torch.randn(2, S, 3, D, requires_grad=True)
k = torch.randn(2, S, 1, D, requires_grad=True)
out = turn(q, k, cs, INTERLEAVE)
leaves = [q, k]
'''


def test_flag_branch_fuses_q_and_k_on_the_halves_path_only():
    assert _calls("flag_branch_q_and_k_halves", _FLAG_BRANCH_RUN.replace("INTERLEAVE", "False")) == 2
    assert _calls("flag_branch_q_and_k_halves", _FLAG_BRANCH_RUN.replace("INTERLEAVE", "True")) == 0
