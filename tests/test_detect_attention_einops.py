"""Issue 14 class 3 for attention: einops ``einsum`` (equation last) read as a product."""

from __future__ import annotations

import ast
import importlib.util
import sys
import types

import pytest
import torch

from npufuse.patterns.attention import AttentionPattern
from npufuse.scan.canonical import einops_equation_subscripts
from pattern_harness import check_rewrite_runs, detect_all

PATTERN = AttentionPattern()


def _example(name: str):
    return next(ex for ex in PATTERN.FUSE + PATTERN.KEEP if ex.name == name)


def test_einops_equation_reads_each_word_as_one_axis() -> None:
    assert einops_equation_subscripts(ast.Constant("b h i d, b h j d -> b h i j")) == ("bhid", "bhjd", "bhij")
    # a word is one axis to einops (torch would read two letters): since s33 it is renamed to one letter
    a, b, out = einops_equation_subscripts(ast.Constant("bh i d, bh j d -> bh i j"))
    assert (len(a), len(b), len(out)) == (3, 3, 3) and a[0] == b[0] == out[0] not in "ijd"
    assert (a[1:], b[1:], out[1:]) == ("id", "jd", "ij")
    assert einops_equation_subscripts(ast.Name("eq")) is None


_RUN = """
q = torch.randn(2, 4, 1, 16, requires_grad=True)
k = torch.randn(2, 4, 9, 16, requires_grad=True)
v = torch.randn(2, 4, 9, 16, requires_grad=True)
pad = torch.zeros(2, 1, 1, 9)
pad[1, ..., :3] = float("-inf")
out = (decode(q, k, v), decode(q, k, v, pad))
leaves = [q, k, v]
"""


def _einops_stand_in(*args: object) -> torch.Tensor:
    # einops is not a dependency: for one-letter axis names its einsum is torch's with the equation moved first
    *operands, equation = args
    return torch.einsum(equation, *operands)  # type: ignore[arg-type]


def test_einops_einsum_attention_matches_under_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    if "einops" not in sys.modules and importlib.util.find_spec("einops") is None:
        monkeypatch.setitem(sys.modules, "einops", types.SimpleNamespace(einsum=_einops_stand_in))
    ex = _example("einops_einsum_equation_last")
    findings, misses = detect_all(PATTERN, ex.code)
    assert findings, [m.reason for m in misses]
    facts = check_rewrite_runs(PATTERN, ex.code, _RUN, findings)
    assert facts["calls"] == 2
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_einops_word_axis_names_are_one_axis_each() -> None:
    """``"bh i d"`` is three axes to einops: a 3-D single-head product (a near miss until s32); read the
    same way, the softmax over the query axis stays a near miss."""
    findings, misses = detect_all(PATTERN, _example("einops_einsum_word_axis_names").code)
    assert [f.params["layout"] for f in findings] == ["3D (bmm) -> BNSD with N=1"], [m.reason for m in misses]
    findings, misses = detect_all(PATTERN, _example("einops_einsum_word_axis_names_over_the_query_axis").code)
    assert not findings and any("does not contract the probabilities' last (key) axis" in m.reason for m in misses)


def test_read_only_in_other_branch_is_not_live_after_the_site() -> None:
    ex = _example("bias_reassigned_read_only_in_other_branch")
    findings, misses = detect_all(PATTERN, ex.code)
    assert findings, [m.reason for m in misses]
    facts = check_rewrite_runs(PATTERN, ex.code, ex.run, findings)
    assert facts["calls"] == 2
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_read_in_other_branch_inside_a_loop_stays_live() -> None:
    findings, misses = detect_all(PATTERN, _example("bias_reassigned_read_in_other_branch_of_a_loop").code)
    assert not findings
    assert any("intermediate `bias` is used after the attention" in m.reason for m in misses)


def test_sdpa_bias_returned_by_a_method_from_a_learned_table_is_a_near_miss() -> None:
    from npufuse.patterns.sdpa import SdpaPattern

    sdpa = SdpaPattern()
    ex = next(e for e in sdpa.KEEP if e.name == "relative_position_bias_from_method")
    findings, misses = detect_all(sdpa, ex.code)
    assert not findings
    assert any("`self._bias(...)`, which returns values of `self.table`, a learned Parameter" in m.reason for m in misses)


def test_inline_return_expression_binds_arguments_and_refuses_globals() -> None:
    from npufuse.scan.canonical import inline_return_expression, returns_its_argument

    fn = ast.parse("def f(s, m=None):\n    return s if m is None else s + m\n").body[0]
    call = ast.parse("f(a, mask)", mode="eval").body
    out = inline_return_expression(fn, call, lambda d: False)  # type: ignore[arg-type]
    assert out is not None and ast.unparse(out) == "a if mask is None else a + mask"
    only_first = inline_return_expression(fn, ast.parse("f(a)", mode="eval").body, lambda d: False)  # type: ignore[arg-type]
    assert only_first is not None and ast.unparse(only_first) == "a if None is None else a + None"
    glob = ast.parse("def g(s):\n    return s * SCALE\n").body[0]
    assert inline_return_expression(glob, ast.parse("g(a)", mode="eval").body, lambda d: True) is None  # type: ignore[arg-type]
    decorated = ast.parse("@deco\ndef f(s):\n    return s\n").body[0]
    assert inline_return_expression(decorated, ast.parse("f(a)", mode="eval").body, lambda d: False) is None  # type: ignore[arg-type]
    assert returns_its_argument(ast.parse("def reg(fn):\n    TABLE.add(fn)\n    return fn\n").body[0])
    assert not returns_its_argument(ast.parse("def wrap(fn):\n    def inner(*a):\n        return fn(*a)\n    return inner\n").body[0])


def test_one_expression_helper_on_scores_matches_under_emulator() -> None:
    ex = _example("one_expression_helper_adds_mask")
    findings, misses = detect_all(PATTERN, ex.code)
    assert findings, [m.reason for m in misses]
    facts = check_rewrite_runs(PATTERN, ex.code, ex.run, findings)
    assert facts["calls"] == 2
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_helper_near_misses_say_why() -> None:
    findings, misses = detect_all(PATTERN, _example("helper_with_a_wrapping_decorator").code)
    assert not findings and any("unsupported operation on the attention scores: `maybe_add_mask" in m.reason for m in misses)
    findings, misses = detect_all(PATTERN, _example("mask_helper_given_the_scores").code)
    assert not findings and any("computed by `resolve_mask(q.shape[-2], attn, causal)`, a function given the scores" in m.reason for m in misses)


def test_probabilities_chosen_by_a_flag_fuse_only_where_the_plain_softmax_runs() -> None:
    ex = _example("probabilities_chosen_by_flag")
    findings, misses = detect_all(PATTERN, ex.code)
    assert findings, [m.reason for m in misses]
    assert findings[0].fused.startswith("if (not inverted) and v.shape[-1] <= k.shape[-1] <= 768:")
    facts = check_rewrite_runs(PATTERN, ex.code, ex.run, findings)
    assert facts["calls"] == 1  # the inverted call runs the original code
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999
    findings, misses = detect_all(PATTERN, _example("probabilities_chosen_by_a_computed_condition").code)
    assert not findings and any("modified after softmax under `if torch.rand(()) < 0.1`" in m.reason for m in misses)


def test_softmax_module_called_inline_matches_under_emulator() -> None:
    ex = _example("softmax_module_called_inline")
    findings, misses = detect_all(PATTERN, ex.code)
    assert findings, [m.reason for m in misses]
    facts = check_rewrite_runs(PATTERN, ex.code, ex.run, findings)
    assert facts["calls"] == 1
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999
