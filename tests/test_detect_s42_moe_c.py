"""s42 moe42c: moe_experts recall classes left open by moe42 (`s42c_*` examples, patterns/_moe_s42c.py):

4. expert parallelism over a contiguous range of this rank's expert ids built in __init__: the global loop's
   `if e not in self.local_experts: continue` (fused only where the list holds every expert: one rank) and a loop
   `for e in self.local_expert_ids` (read as range(L[0], L[0] + len(L)) under a run-time check that L is that range);
3. the rows of `(idx == e).nonzero()` unpacked column by column (`b, t, k = nz[:, 0], nz[:, 1], nz[:, 2]`,
   `.unbind(-1)`) read as torch.where(idx == e); `out.index_put_((b, t), v, accumulate=True)` as `out[b, t] += v`;
5. flat positions `pos = torch.where(idx.view(-1) == e)[0]` read as (pos // K, pos % K) pairs (repeated rows, flat
   weights), dense gates read at (token, expert).
"""

from __future__ import annotations

import pytest
import torch

from npufuse.patterns import _moe_s42c as s42c
from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, check_rewrite_runs, \
    detect_all, example_cases

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s42c_", kind="fuse"))
def test_s42c_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s42c_", kind="keep"))
def test_s42c_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


def _finding(code: str):
    findings, _ = detect_all(PATTERN, code)
    assert len(findings) == 1
    return findings[0]


def test_s42c_membership_skip_runs_the_loop_on_a_shard():
    f = _finding(s42c.MEMBERSHIP_SKIP)
    assert "all(_npufuse_e in self.local_experts for _npufuse_e in range(self.n))" in f.guard_tensor
    torch.manual_seed(0)
    facts = check_rewrite_runs(PATTERN, s42c.MEMBERSHIP_SKIP, s42c.MEMBERSHIP_SKIP_SHARD_RUN, [f])
    assert facts["calls"] == 0  # rank 1 of 2 holds experts 3..5: the loop as written
    assert min(facts["cos_out"]) >= 0.9999


def test_s42c_local_ids_guard_refuses_a_list_that_is_not_a_range():
    f = _finding(s42c.LOCAL_IDS_LOOP)
    flat = torch.zeros(3, 2)

    class _M:
        local_expert_ids = [3, 4, 5]

    assert eval(f.guard_tensor, {"self": _M, "flat": flat}) is flat
    _M.local_expert_ids = [3, 5]  # reassigned after __init__: not a range
    assert eval(f.guard_tensor, {"self": _M, "flat": flat}) is None
    _M.local_expert_ids = []
    assert eval(f.guard_tensor, {"self": _M, "flat": flat}) is None


@pytest.mark.parametrize("built", ["range(a, b)", "tuple(range(b))", "sorted(range(a, b))", "torch.arange(a, b).tolist()",
                                   "[j for j in range(a, b)]"])
def test_s42c_contiguous_range_spellings(built):
    import ast
    assert s42c._contiguous_range(ast.parse(built, mode="eval").body)


@pytest.mark.parametrize("built", ["range(0, n, 2)", "[j for j in range(n) if j % 2]", "[2 * j for j in range(n)]",
                                   "list(ids)", "[0, 2]"])
def test_s42c_not_a_contiguous_range(built):
    import ast
    assert not s42c._contiguous_range(ast.parse(built, mode="eval").body)


def test_s42c_flat_positions_rest_on_run_time_shapes():
    from npufuse.patterns._moe_s42c import DENSE_GATES
    f = _finding(DENSE_GATES)
    x = torch.zeros(6, 4)

    class _M:
        k = 2

    ok = {"self": _M, "x": x, "top_i": torch.zeros(6, 2, dtype=torch.long), "gates": torch.zeros(6, 5)}
    assert eval(f.guard_tensor, ok) is x
    assert eval(f.guard_tensor, {**ok, "top_i": torch.zeros(6, 3, dtype=torch.long)}) is None  # K is not self.k
    assert eval(f.guard_tensor, {**ok, "top_i": torch.zeros(2, 3, 2, dtype=torch.long)}) is None  # [B, T, K]


def test_s42c_nonzero_columns_carry_a_rank_check():
    from npufuse.patterns._moe_s42c import NONZERO_COLUMNS
    assert "(idx.dim() == 3)" in _finding(NONZERO_COLUMNS).guard_tensor  # every column of the rows is unpacked
