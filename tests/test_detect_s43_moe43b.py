"""s43 moe43b: moe_experts recall classes read off real HO19b misses (`s43b_*` examples in patterns/_moe_s43b.py):
zeros allocated before independent statements, tensors made before the loop added at the written rows, experts taking
any number of conditioning inputs (flat / where / sorted-run dispatch), per-expert statistics replayed after the
fused dispatch; and the s42 review's split loop, which now keeps the rank guards of its routed half."""

from __future__ import annotations

import pytest

from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, detect_all, example_cases, only_finding

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s43b_", kind="fuse"))
def test_s43b_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s43b_", kind="keep"))
def test_s43b_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


def _finding(name: str):
    return only_finding(PATTERN, name)


@pytest.mark.parametrize("name", ["s43b_split_loop_keeps_the_rank_guard_of_any_dim_one",
                                  "s43b_split_loop_function_form_any_dim_one"])
def test_s43b_split_loop_runs_only_on_two_dim_indices(name):
    # s42 review: the split path dropped `top_i.dim() == 2`; on [B, T, K] indices `.any(dim=1)` is not the slot axis
    f = _finding(name)
    assert "top_i.dim() == 2" in f.guard_tensor
    assert "if i < self.n_dense" in f.fused  # the dense half replayed as written


def test_s43b_split_loop_with_a_rows_term_is_not_split():
    # the split path sets the dense half as the site's tail: a routed half with its own tail is not split
    code = next(e for e in PATTERN.FUSE if e.name == "s43b_split_loop_keeps_the_rank_guard_of_any_dim_one").code
    code = code.replace("out[mask] += expert(x[mask]) * gates[mask, i - self.n_dense].unsqueeze(1)",
                        "out[mask] += expert(x[mask]) * gates[mask, i - self.n_dense].unsqueeze(1) + base[mask]")
    code = code.replace("        out = torch.zeros_like(x)\n", "        base = x * 2\n        out = torch.zeros_like(x)\n")
    findings, misses = detect_all(PATTERN, code)
    assert not findings and misses


def test_s43b_zeros_before_other_statements_are_added_into():
    name = "s43b_top1_shared_output_rows_added_in_write_back"
    f = _finding(name)
    code = next(e for e in PATTERN.FUSE if e.name == name).code.splitlines()
    # the span is the loop: the allocation, the loss and the shared expert stay before it, in both branches
    assert code[f.line - 1].strip() == "for i, expert in enumerate(self.experts):"
    assert "out.add_(torch_npu.npu_moe_token_unpermute(" in f.fused
    # (s44 review) only rows whose id names an expert: the original never writes the others
    assert "out.add_(torch.where(((top1 >= 0) & (top1 < len(_npufuse_experts))).reshape(*shared_out.shape[:-1], 1), shared_out, 0)" \
        ".to(out.dtype))" in f.fused
    assert "(shared_out.shape == x.shape)" in f.guard_tensor


def test_s43b_rows_term_of_topk_is_added_top_k_times():
    f = _finding("s43b_topk_precomputed_rows_added_per_slot")
    # (s44 review) once per top-k id that names an expert (K where every id does)
    assert "out.add_((((topk_i >= 0) & (topk_i < self.n)).sum(-1, keepdim=True) * base).to(out.dtype))" in f.fused
    assert "topk_i.dim() == 2" in f.guard_tensor  # K is the last dim of [T, K] indices


def test_s43b_every_conditioning_input_is_permuted_and_guarded():
    f = _finding("s43b_three_input_experts_flat_repeated_rows")
    assert "_npufuse_expert(_npufuse_rows_e, _npufuse_cond_e, _npufuse_cond1_e)" in f.fused
    assert "cr.shape[:xr.dim() - 1] == xr.shape[:-1]" in f.guard_tensor
    assert "gr.shape[:xr.dim() - 1] == xr.shape[:-1]" in f.guard_tensor
    f = _finding("s43b_three_input_experts_sorted_cumulative_runs")
    assert "c.shape[0] == x.shape[0] and g.shape[0] == x.shape[0]:" in f.fused
    assert "_npufuse_cond2 = g[_npufuse_src]" in f.fused


def test_s43b_side_statements_are_replayed_as_written_without_the_experts():
    f = _finding("s43b_side_statistics_replayed_after_the_dispatch")
    fused = f.fused
    tail = fused[fused.index("# the loop's other statements"):]
    assert "for e, expert in enumerate(self.experts):" in tail
    assert "kth = torch.topk(others, self.k, dim=1)[0][:, self.k - 1]" in tail  # the user's text, not canonicalised
    assert "expert(" not in tail.replace("enumerate(self.experts)", "")
    assert "out[" not in tail


_SIDE_LOOP = '''
import torch


def f(self, x, idx, w):
    out = torch.zeros_like(x)
    load = torch.zeros(4)
    for e, expert in enumerate(self.experts):
        rows, slot = torch.where(idx == e)
        out[rows] += w[rows, slot, None] * expert(x[rows])
        load[e] += STAT
    return out, load
'''


def _split(stat: str):
    from npufuse.patterns import _moe_s43b
    from npufuse.scan.dataflow import ModuleInfo
    import ast

    module = ModuleInfo.from_source("m.py", _SIDE_LOOP.replace("STAT", stat))
    scope = next(s for s in module.scopes if s.qualname == "f")
    loop = next(n for n in ast.walk(scope.node) if isinstance(n, ast.For))
    return _moe_s43b.split_side_statements(module, scope, loop)


def test_s43b_side_split_keeps_routing_in_both_loops_and_statistics_in_the_replay():
    split = _split("rows.numel()")
    assert split is not None
    dispatch, replay = split
    assert [type(s).__name__ for s in dispatch] == ["Assign", "AugAssign"]  # routing + the write-back
    assert [type(s).__name__ for s in replay] == ["Assign", "AugAssign"]  # routing + the count


@pytest.mark.parametrize("stat", [
    "self.bias[e].sum()",  # a per-expert weight: an expert's computation, not a statistic
    "out.sum()",  # reads the output the dispatch writes
    "torch.randn(()).abs()",  # draws random numbers
    "x.sum()\n        x.mul_(0.5)",  # changes the tokens the next experts read
])
def test_s43b_side_split_refuses_what_reordering_would_change(stat):
    assert _split(stat) is None
