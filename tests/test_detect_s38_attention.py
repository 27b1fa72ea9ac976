"""s38 attention: rank-aware reasons for a key transposed over dims 1, 2; a 3-D query against k / v of unstated rank
read as a bmm with every rank checked at run time; a finding whose guard the enclosing if/else arm makes false is a
near miss (every pattern)."""

from __future__ import annotations

from pattern_harness import detect_all

from npufuse.patterns._guard_arms import contradicted_guard
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.base import Finding
from npufuse.scan.dataflow import ModuleInfo


def _example(name: str) -> str:
    return next(e.code for e in AttentionPattern.FUSE + AttentionPattern.KEEP if e.name == name)


def test_three_d_query_against_a_cache_is_guarded_on_every_rank() -> None:
    (f,), _ = detect_all(AttentionPattern(), _example("s38_three_d_query_against_a_cache_of_unstated_rank"))
    assert f.fused.startswith("if ((q.dim() == 3 and k.dim() == 3 and (v.dim() == 3)))")
    assert '1, "BNSD"' in f.fused and "q.unsqueeze(1)" in f.fused  # [N_kv, G*Sq, D] as B = N_kv, one head


def test_key_transpose_reason_states_the_rank_it_knows() -> None:
    code = '''
import torch


def attend(q, k, v):
    k = k.view(k.shape[0], k.shape[1], 4, 8)
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(1, 2)), dim=-1), v)


def attend_three(q, k, v):
    q = q.view(-1, 5, 8)
    k = k.view(-1, 8, 5)
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(0, 1)), dim=-1), v)
'''
    _, misses = detect_all(AttentionPattern(), code)
    reasons = sorted(m.reason for m in misses)
    assert "key transposed over dims [1, 2], not the last two of the 4-D key" in reasons
    assert "key transposed over dims [0, 1], not the last two of the 3-D key" in reasons
    assert not any("dims [1, 2], not the last two" == r for r in reasons)


def _finding(fused: str, line: int, end_line: int) -> Finding:
    return Finding("rms_norm", "f", line, end_line, {}, fused, "x")


def _scope(code: str) -> object:
    module = ModuleInfo.from_source("example.py", code)
    return next(s for s in module.scopes if s.qualname == "f")


_ARMS = '''
def f(x, fast, mode, cfg):
    if fast and mode is not None:
        y = x * 2
    elif cfg.flag:
        y = x * 3
    else:
        y = x * 4
    return y
'''


def test_guard_contradicted_by_any_arm_of_an_if_elif_else() -> None:
    scope = _scope(_ARMS)
    # the taken arm of `fast and mode is not None`: both operands hold
    assert "false in the taken arm" in contradicted_guard(scope, _finding("if not fast:\n    y = x\nelse:\n    y = x * 2", 4, 4))
    assert "`mode is None`" in contradicted_guard(scope, _finding("if k > 0 and mode is None:\n    y = x\nelse:\n    y = x * 2", 4, 4))
    # the elif arm: the first test is false (as a whole: not its operands), cfg.flag holds
    assert "`not cfg.flag`" in contradicted_guard(scope, _finding("if not cfg.flag:\n    y = x\nelse:\n    y = x * 3", 6, 6))
    assert contradicted_guard(scope, _finding("if fast:\n    y = x\nelse:\n    y = x * 3", 6, 6)) is None
    # the else arm: cfg.flag is false there
    assert "false in the `else` arm" in contradicted_guard(scope, _finding("if cfg.flag:\n    y = x\nelse:\n    y = x * 4", 8, 8))
    # a fork whose `else` is not the span as written (fused code on both sides): not a guard, nothing dropped
    assert contradicted_guard(scope, _finding("if not fast:\n    y = x\nelse:\n    y = fused(x)", 4, 4)) is None
    # a guard the arm does not decide, or fused code with no guard
    assert contradicted_guard(scope, _finding("if x.is_npu:\n    y = x\nelse:\n    y = x * 2", 4, 4)) is None
    assert contradicted_guard(scope, _finding("y = x", 4, 4)) is None


def test_a_test_stored_to_inside_the_arm_is_not_a_fact() -> None:
    code = '''
def f(x, fast, cfg):
    if not fast:
        for _ in range(2):
            y = x * 2
            fast = True
    if cfg.flag:
        cfg.flag = False
        y = x * 3
    return y
'''
    scope = _scope(code)
    assert contradicted_guard(scope, _finding("if fast:\n    y = x\nelse:\n    y = x * 2", 5, 5)) is None
    assert contradicted_guard(scope, _finding("if not cfg.flag:\n    y = x\nelse:\n    y = x * 3", 9, 9)) is None


def test_guard_consistent_with_its_arm_keeps_the_finding() -> None:
    code = _example("s38_guard_contradicted_by_the_enclosing_arm").replace("    if return_attn:\n        w =", "    if not return_attn:\n        w =")
    findings, _ = detect_all(AttentionPattern(), code)
    assert len(findings) == 1 and "not return_attn" in findings[0].fused


def test_where_zeroing_on_heads_in_batch_reads_rows_off_the_folded_mask() -> None:
    (f,), _ = detect_all(AttentionPattern(), _example("s38_probabilities_zeroed_by_where_on_heads_in_batch_scores"))
    assert "_npufuse_rows = _npufuse_mask.all(-1, keepdim=True)" in f.fused
    assert ")[0].masked_fill(_npufuse_rows, 0).squeeze(1)" in f.fused  # zeroed on [B*N, 1, Sq, D], before the squeeze


def test_gluon_masked_softmax_fuses_where_no_mask_is_given() -> None:
    (f,), _ = detect_all(AttentionPattern(), _example("s38_gluon_masked_softmax_helper_run_through"))
    # the masked arm (a dtype-chosen fill, then ``* mask``) runs the original code
    assert f.fused.startswith("if (not (attn_mask is not None)) and ")
    assert "scale=self.scale" in f.fused
