"""s45 moe45b: moe_experts recall classes read off real development misses (`s45b_*` examples in
patterns/_moe_s45b.py): a capacity switch of the whole call inside the expert loop (fused behind the switch being
off), top-1 indices handed back by a router module, flat (token, slot) routes picked by a boolean mask, a cast of the
weighted output bound to a name, the accumulator's metadata read between its allocation and the loop."""

from __future__ import annotations

import ast

import pytest

from npufuse.patterns import _moe_s45b
from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, check_rewrite_runs, \
    detect_all, example_cases, only_finding

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s45b_", kind="fuse"))
def test_s45b_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s45b_", kind="keep"))
def test_s45b_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


def test_s45b_capacity_switch_on_runs_the_original_loop():
    # with a capacity factor set, the guard sends the call to the loop as written (tokens past the capacity dropped)
    findings, _ = detect_all(PATTERN, _moe_s45b.SWITCHED)
    run = _moe_s45b.SWITCHED_RUN.replace("SwitchMoE(16, 12, 4)", "SwitchMoE(16, 12, 4, 0.5)")
    facts = check_rewrite_runs(PATTERN, _moe_s45b.SWITCHED, run, findings)
    assert facts["calls"] == 0
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999


def test_s45b_guards_name_the_switch_and_the_shapes():
    f = only_finding(PATTERN, "s45b_capacity_switch_off_top1_router_module")
    assert "not (self.capacity_factor is not None)" in f.guard_tensor
    assert "top1_prob.shape == top1.shape" in f.guard_tensor
    inverted = only_finding(PATTERN, "s45b_capacity_switch_plain_path_first")
    assert "(self.capacity_factor is None)" in inverted.guard_tensor and "not (self.capacity_factor" not in inverted.guard_tensor
    routes = only_finding(PATTERN, "s45b_flat_routes_by_mask_repeat_interleave_map")
    assert "idx.shape[1] == self.k" in routes.guard_tensor and "w.shape == idx.shape" in routes.guard_tensor


def test_s45b_token_of_route_forms():
    def k_of(text: str):
        return _moe_s45b.token_of_route(ast.parse(text, mode="eval").body)

    assert k_of("torch.arange(T).repeat_interleave(K)") == "K"
    assert k_of("torch.arange(T, device=d).repeat_interleave(K, dim=0)") == "K"
    assert k_of("torch.repeat_interleave(torch.arange(T), K)") == "K"
    assert k_of("torch.arange(T)[:, None].expand(T, K).flatten()") == "K"
    assert k_of("torch.arange(T).view(-1, 1).repeat(1, K).view(-1)") == "K"
    assert k_of("torch.arange(T * K) // K") == "K"
    assert k_of("torch.arange(T).repeat(K)") is None  # tiled: route p holds p % T
    assert k_of("torch.arange(1, T).repeat_interleave(K)") is None  # starts at 1: route p holds p // K + 1
    assert k_of("torch.arange(T).unsqueeze(1).expand(-1, K).reshape(K, -1)") is None


def test_s45b_metadata_reads_only():
    def stmt(text: str) -> ast.stmt:
        return ast.parse(text).body[0]

    assert _moe_s45b.metadata_reads_only(stmt("dt = out.dtype"), "out")
    assert _moe_s45b.metadata_reads_only(stmt("n, d = out.size(0), out.shape[-1]"), "out")
    assert not _moe_s45b.metadata_reads_only(stmt("v = out.view(-1)"), "out")
    assert not _moe_s45b.metadata_reads_only(stmt("s = out.sum()"), "out")
    assert not _moe_s45b.metadata_reads_only(stmt("alias = out"), "out")
