"""s35 moe_experts: top-k slot loops, n-D torch.where token coordinates, experts keyed by index text.

Each form's run-time guard is checked on the path where it fails: the rewritten module must then run the
loop as written (no torch_npu call) and give the original's values.
"""

from __future__ import annotations

import pytest
import torch

from npufuse.patterns import moe_experts as M
from pattern_harness import check_fuse_found, check_keep_refused, check_rewrite_runs, detect_all, example_cases

PATTERN = M.MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, prefix="s35_", kind="fuse"))
def test_s35_fuse_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, prefix="s35_", kind="keep"))
def test_s35_keep_refused(pattern, example):
    check_keep_refused(pattern, example)


def _guard_off(code: str, run: str) -> None:
    findings, _ = detect_all(PATTERN, code)
    assert len(findings) == 1
    facts = check_rewrite_runs(PATTERN, code, run, findings)
    assert facts["calls"] == 0, "the guard should have sent this call to the original loop"
    assert all(c > 0.999999 for c in facts["cos_out"] + facts["cos_grad"])


def test_dict_keys_of_one_rank_run_the_loop():
    # keys "2", "3": one rank's slice of four experts; rows routed to 0 / 1 stay zero, as the loop leaves them
    run = '''\
bank = nn.ModuleDict({str(i): nn.Linear(16, 16) for i in (2, 3)})
x = torch.randn(7, 16, requires_grad=True)
ids = torch.randn(7, 4).topk(2, dim=-1).indices.reshape(-1)
out = run_bank(x, ids, bank, 2)
leaves = [x, bank["2"].weight]
'''
    _guard_off(M._S35_DICT_FLAT, run)


def test_slot_loop_over_fewer_slots_than_the_indices_runs_the_loop():
    # range(1) over top-2 indices: only slot 0 is dispatched, which the permute of both slots would not be
    run = '''\
blocks = [nn.Linear(16, 16) for _ in range(4)]
h = torch.randn(9, 16, requires_grad=True)
w, ids = torch.randn(9, 4).softmax(-1).topk(2, dim=-1)
out = mix_slots(h, ids, w, blocks)
leaves = [h, blocks[1].weight]
'''
    _guard_off(M._S35_SLOTS_OUTER.replace("range(route_ids.shape[1])", "range(n_slots)")
               .replace("def mix_slots(h, route_ids, route_w, blocks):", "def mix_slots(h, route_ids, route_w, blocks, n_slots=1):"),
               run)


def test_where_3d_weights_of_another_shape_run_the_loop():
    # w[b, t, k] over dense [B, T, E] gates: column k of the gates, not the weight of slot k; the guard keeps the loop
    run = '''\
towers = [nn.Linear(16, 12) for _ in range(4)]
g = torch.randn(2, 5, 16, requires_grad=True)
w, p = torch.randn(2, 5, 4).softmax(-1).topk(2, dim=-1)
out = route_grid(g, p, torch.randn(2, 5, 4), towers)
leaves = [g, towers[0].weight]
'''
    _guard_off(M._S35_WHERE_ND_HELPER, run)


def test_slot_guard_text():
    findings, _ = detect_all(PATTERN, M._S35_SLOTS_INNER)
    (f,) = findings
    assert "top_e.dim() == 2 and top_e.shape[-1] == (self.n_active)" in f.guard_tensor
    assert "top_p.shape == top_e.shape" in f.guard_tensor
    assert torch is not None
