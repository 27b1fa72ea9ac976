"""s40 attention / sdpa / rope: ranks read through helper calls by dataflow (a helper's return rank given its
arguments' ranks), ..."""

from __future__ import annotations

import pytest
from pattern_harness import detect_all

from npufuse.patterns.attention import AttentionPattern


def _example(name: str) -> str:
    return next(e.code for e in AttentionPattern.FUSE + AttentionPattern.KEEP if e.name == name)


def test_three_d_heads_through_a_helper_method_checks_every_rank() -> None:
    (f,), misses = detect_all(AttentionPattern(), _example("s40_three_d_heads_through_a_helper_method"))
    assert f.fused.startswith("if (q.dim() == 3 and k.dim() == 3 and (v.dim() == 3)):"), f.fused
    assert not misses


@pytest.mark.parametrize("name, reason", [
    ("s40_helper_returns_a_four_d_key", "not the last two of the 4-D key"),
    ("s40_helper_returns_ranks_that_differ", "the code does not show the key's rank"),
])
def test_helper_return_rank_near_misses(name: str, reason: str) -> None:
    found, misses = detect_all(AttentionPattern(), _example(name))
    assert not found
    assert any(reason in m.reason for m in misses), [m.reason for m in misses]


def test_mask_from_a_helper_method_is_bound_once() -> None:
    (f,), misses = detect_all(AttentionPattern(), _example("s40_mask_from_a_helper_method_bound_once"))
    # one per arm of the bound conditional (one runs), one in the original code of the else branch
    assert f.fused.count("self._sliding_window_mask(") == 3
    assert "_npufuse_mask = (_npufuse_term_0) if _npufuse_term_0 is not None else None" in f.fused
    assert not misses


def test_calls_in_the_arms_of_a_conditional_expression_count_once() -> None:
    import ast

    from npufuse.patterns.base import _module_calls_in

    assert _module_calls_in(ast.parse("((self.f(x) if a else self.f(x)) if b else self.f(x))")) == {"self.f(x)": 1}
    assert _module_calls_in(ast.parse("self.f(x) if self.f(x) is not None else None")) == {"self.f(x)": 2}
    assert _module_calls_in(ast.parse("self.f(x) + (self.f(x) if c else 0)")) == {"self.f(x)": 2}


def test_a_method_called_twice_is_not_called_a_module_with_dropout() -> None:
    from npufuse.patterns.base import _is_class_method_call
    from npufuse.scan.dataflow import ModuleInfo

    module = ModuleInfo.from_source("m.py", "class A:\n    def mask(self, n):\n        return n\n    def forward(self, x):\n        return x\n")
    assert _is_class_method_call(module, "A.forward", "self.mask(L)")
    assert not _is_class_method_call(module, "A.forward", "self.drop(L)")


def test_optional_mask_with_is_causal_runs_fused_where_the_mask_is_none() -> None:
    from npufuse.patterns.sdpa import SdpaPattern

    code = next(e.code for e in SdpaPattern.FUSE if e.name == "s40_optional_mask_with_is_causal")
    (f,), misses = detect_all(SdpaPattern(), code)
    assert f.fused.startswith("if attention_mask is None and "), f.fused
    assert "sparse_mode=2" in f.fused and "atten_mask=_npufuse_mask," not in f.fused
    assert not misses


def _named_axes_einops():
    """A stand-in for the two einops patterns of the named-axes rope example (einops is not a dependency)."""
    import types

    mod = types.ModuleType("einops")

    def rearrange(t, pattern: str, **sizes: int):
        compact = pattern.replace(" ", "")
        if compact == "bhn(dsplit)->splitbhnd":
            return t.unflatten(-1, (-1, sizes["split"])).movedim(-1, 0)
        if compact == "bhndsplit->bhn(dsplit)":
            return t.flatten(-2)
        if compact == "bhndsplit->bhn(splitd)":
            return t.transpose(-1, -2).flatten(-2)
        raise NotImplementedError(pattern)

    mod.rearrange = rearrange  # type: ignore[attr-defined]
    return mod


def test_einops_named_axes_interleaved_rope_rewrites_to_the_same_numbers(monkeypatch) -> None:
    import sys

    from pattern_harness import check_rewrite_runs

    from npufuse.patterns.rope import RopePattern

    monkeypatch.setitem(sys.modules, "einops", _named_axes_einops())
    pattern = RopePattern()
    code = next(e.code for e in RopePattern.FUSE if e.name == "s40_einops_named_axes_real_imag")
    findings, _ = detect_all(pattern, code)
    assert len(findings) == 1 and 'rotary_mode="interleave"' in findings[0].fused
    run = '''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
q = torch.randn(2, 4, 6, 16, requires_grad=True)
out = apply_rope(q, ang.cos(), ang.sin())
leaves = [q]
'''
    facts = check_rewrite_runs(pattern, code, run, findings)
    assert facts["calls"] >= 1, facts["all_calls"]
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_einops_last_two_axes_merge_is_read_by_its_axes() -> None:
    import ast

    from npufuse.patterns.rope import _einops_last_two_merged

    def merged(pattern: str):
        return _einops_last_two_merged(ast.parse(f"rearrange(t, '{pattern}', split=2)", mode="eval").body)

    assert merged("b h n d split -> b h n (d split)") is not None
    assert merged("... d split -> ... (d split)") is not None
    assert merged("b h n d split -> b h n (split d)") is None  # the other order: halves, not the pairs
    assert merged("b h n d split -> b n h (d split)") is None  # a transpose besides the merge
    assert merged("b h (n d) split -> b h n (d split)") is None
