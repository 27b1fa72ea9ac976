"""s39 attention / shared liveness: a read after a rebinding is not a use of the old value (reaching definition, in
Scope.uses_after / loads_after that every detector's "used after" reads); scores masked through a boolean-index write
read as masked_fill under a run-time check; true near-miss reasons for other index writes and for masks computed from
another product."""

from __future__ import annotations

from pattern_harness import detect_all

from npufuse.patterns.attention import AttentionPattern
from npufuse.scan.dataflow import ModuleInfo


def _example(name: str) -> str:
    return next(e.code for e in AttentionPattern.FUSE + AttentionPattern.KEEP if e.name == name)


def _scope(code: str, qualname: str = "f"):
    module = ModuleInfo.from_source("example.py", code)
    return next(s for s in module.scopes if s.qualname == qualname)


_LIVENESS = '''
def f(x, c, fs):
    p = x + 1
    y = p * 2
    if c:
        p = x * 3
        y = y + p
    z = p
    q = x + 2
    q = q + 1
    w = q + x
    r = x + 3
    fs.append(lambda: r)
    r = x + 4
    s = x + 5
    s += 1
    return y, z, w, fs
'''


def test_a_read_after_a_rebinding_in_its_block_is_not_a_use() -> None:
    scope = _scope(_LIVENESS)
    # line 3 `p = x + 1`: read on line 4; the rebinding on line 6 is in one arm only, so `z = p` (line 8) may read it
    assert scope.uses_after("p", 4)
    assert [n.lineno for n in scope.loads_after("p", 4)] == [8]  # line 7 reads the arm's own `p`
    # line 9 `q = x + 2`: line 10 reads it (and rebinds it); line 11 reads line 10's value only
    assert [n.lineno for n in scope.loads_after("q", 9)] == [10]
    assert [n.lineno for n in scope.loads_after("q", 10)] == [11]
    # a read inside a lambda counts whatever follows it in the block (it runs when called)
    assert scope.uses_after("r", 12)
    # `s += 1` reads the old `s` through its target (a Store: not counted, as before s39); nothing reads it later
    assert not scope.uses_after("s", 16)


def test_an_augmented_assignment_does_not_hide_later_reads() -> None:
    # `p += 1` reads the old value and, on a tensor, changes that very object: the later read still sees it
    scope = _scope('''
def f(s, v):
    p = s.softmax(-1)
    out = p @ v
    p += 1
    return out, p
''')
    assert scope.uses_after("p", 4)


def test_both_attentions_found_when_the_second_reuses_the_probabilities_name() -> None:
    found, misses = detect_all(AttentionPattern(), _example("s39_probabilities_name_reused_by_a_later_attention"))
    assert len(found) == 2, [m.reason for m in misses]
    assert not misses


def test_boolean_index_write_checks_dtype_and_rank_at_run_time() -> None:
    (f,), _ = detect_all(AttentionPattern(), _example("s39_scores_masked_through_a_boolean_index"))
    assert f.fused.startswith("if (keep.dtype == torch.bool and keep.dim() == 4)")
    assert "_npufuse_mask = ~keep  # True = masked" in f.fused
    assert any("write through an index" in r.detail for r in f.risks)


def test_boolean_index_write_under_a_condition_and_three_d() -> None:
    code = '''
import torch


def attend(q, k, v, drop=None):
    s = torch.bmm(q, k.transpose(1, 2)) * 0.125
    if drop is not None:
        s[drop] = float("-inf")
    return torch.bmm(torch.softmax(s, dim=-1), v)
'''
    (f,), _ = detect_all(AttentionPattern(), code)
    assert "not (drop is not None) or drop.dtype == torch.bool and drop.dim() == 3" in f.fused


def test_mask_from_another_product_is_refused_with_a_true_reason() -> None:
    code = '''
import torch


def select_attend(q, k, v, est_k, budget: int):
    s = torch.matmul(q, k.transpose(-1, -2)) * 0.25
    est = torch.matmul(q, est_k.transpose(-1, -2))
    keep = est >= est.topk(budget, dim=-1).values[..., -1:]
    s = s.masked_fill(~keep, float("-inf"))
    return torch.matmul(s.softmax(dim=-1), v)


def topk_attend(q, k, v):
    sim = torch.matmul(q, k.transpose(-1, -2)) * 0.25
    cutoff = sim.topk(4, dim=-1).values[..., -1:]
    sim = sim.masked_fill(sim < cutoff, float("-inf"))
    return torch.matmul(sim.softmax(dim=-1), v)
'''
    found, misses = detect_all(AttentionPattern(), code)
    assert not found
    reasons = {m.qualname: m.reason for m in misses}
    assert "computed from a matrix product other than the scores" in reasons["select_attend"]
    assert "computed from the attention scores themselves" in reasons["topk_attend"]


def test_rope_stack_merged_in_the_next_statement_is_a_site() -> None:
    from npufuse.patterns.rope import RopePattern

    code = next(e.code for e in RopePattern.FUSE if e.name == "s39_interleaved_stack_merged_in_the_next_statement")
    (f,), _ = detect_all(RopePattern(), code)
    # the two parts and the stack are the site; the merge (``rotated_x.flatten(-2)``) runs as written after it
    assert (f.line, f.end_line) == (20, 22)
    assert 'rotary_mode="interleave")' in f.fused and ".unflatten(-1, (-1, 2))" in f.fused


def test_sdpa_through_functools_partial() -> None:
    from npufuse.patterns.sdpa import SdpaPattern

    code = next(e.code for e in SdpaPattern.FUSE if e.name == "s39_sdpa_through_functools_partial")
    found, misses = detect_all(SdpaPattern(), code)
    by = {f.qualname: f for f in found}
    assert set(by) == {"CausalBlock.forward", "local_attend"} and not misses
    # the held partial is checked at run time (a subclass may set the attribute to something else)
    assert by["CausalBlock.forward"].fused.startswith(
        "if getattr(self.attend, 'func', None) is F.scaled_dot_product_attention and not self.attend.args "
        "and self.attend.keywords == {'is_causal': True, 'scale': 0.25}")
    assert "sparse_mode=2" in by["CausalBlock.forward"].fused and "scale=0.25" in by["CausalBlock.forward"].fused
    assert "keep_prob=1.0 - p" in by["local_attend"].fused
