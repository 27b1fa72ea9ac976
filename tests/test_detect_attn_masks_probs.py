"""Issue 14 class 3 (attention / sdpa): multiplicative 0/1 masks, flag-guarded dropout with an RNG fork, returned
probabilities that a caller relies on, and SDPA calls control never reaches."""

from __future__ import annotations

import pytest
import torch

from npufuse.patterns.attention import AttentionPattern, _zero_one_built, zero_one_exact
from npufuse.patterns.sdpa import SdpaPattern
from pattern_harness import check_rewrite_runs, detect_all

ATTN = AttentionPattern()
SDPA = SdpaPattern()


def _example(pattern, name: str):
    return next(ex for ex in pattern.FUSE + pattern.KEEP if ex.name == name)


def _one(pattern, code: str):
    findings, misses = detect_all(pattern, code)
    return findings, [m.reason for m in misses]


# -- multiplicative 0/1 masks ------------------------------------------------------------------------------------

_MUL = """
import torch


def attend(q, k, v, m):
    s = q @ k.transpose(-2, -1) * 0.25
    s = {expr}
    return torch.softmax(s, dim=-1) @ v
"""


@pytest.mark.parametrize("expr", [
    "s * m - 10000.0 * (1.0 - m)",
    "torch.mul(s, m) - (1.0 - m) * 10000.0",
    "m * s + (1 - m) * -1e9",
    "s.mul(m) + -65504.0 * (1.0 - m)",
])
def test_multiplicative_spellings_become_a_checked_keep_mask(expr: str) -> None:
    findings, reasons = _one(ATTN, _MUL.format(expr=expr))
    assert findings, reasons
    f = findings[0]
    assert f.params["mask"] == ["keep01: m"] and f.params["mask_kind"] == "multiplicative_01"
    # m's values are unknown: the fused branch runs only where m holds 0 and 1 and (s49) a 1 in every row, the mask
    # passed is m == 0 (True = masked)
    assert f.params["mask_values_checked"] and "bool(((m == 0) | (m == 1)).all() & (m == 1).any(-1).all())" in f.fused
    assert "_npufuse_mask = m == 0" in f.fused
    assert "scale=0.25" in f.fused  # m is never taken as a scale


def test_multiplicative_mask_runs_fused_only_for_zero_one_values() -> None:
    code = _MUL.format(expr="s * m - 10000.0 * (1.0 - m)")
    findings, _ = _one(ATTN, code)
    run01 = """
q = torch.randn(2, 2, 5, 16, requires_grad=True); k = torch.randn(2, 2, 5, 16, requires_grad=True); v = torch.randn(2, 2, 5, 16, requires_grad=True)
m = torch.ones(2, 1, 5, 5).tril()
out = attend(q, k, v, m)
leaves = [q, k, v]
"""
    facts = check_rewrite_runs(ATTN, code, run01, findings)
    assert facts["calls"] == 1 and min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999
    # a fractional m scales the logits instead: the original code runs (no fused call), results identical
    facts = check_rewrite_runs(ATTN, code, run01.replace(".tril()", ".tril() * 0.5 + 0.25"), findings)
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.999999


def test_mask_polarity_is_keep_where_one() -> None:
    # a mask that keeps only the first key: every query attends to key 0 alone, so the output is v[..., 0, :]
    code = _MUL.format(expr="s * m - 10000.0 * (1.0 - m)")
    findings, _ = _one(ATTN, code)
    run = """
q = torch.randn(1, 2, 4, 16); k = torch.randn(1, 2, 4, 16); v = torch.randn(1, 2, 4, 16)
m = torch.zeros(1, 1, 4, 4); m[..., 0] = 1.0
out = (attend(q, k, v, m), v[:, :, :1, :].expand(1, 2, 4, 16))
"""
    facts = check_rewrite_runs(ATTN, code, run, findings)
    assert facts["calls"] == 1 and min(facts["cos_out"]) > 0.9999


@pytest.mark.parametrize("src,built", [
    ("(ids != 0).float()", True),
    ("(ids > 0).to(q.dtype)[:, None, None, :]", True),
    ("mask.bool().long()", True),
    ("((a > 0) & (b > 0)).half()", True),
    ("mask.float()", False),  # a float of unknown values
    ("1.0 - (ids == 0).float()", False),  # arithmetic on it: not read as built
])
def test_zero_one_by_construction(src: str, built: bool) -> None:
    import ast
    assert _zero_one_built(ast.parse(src, mode="eval").body) is built


def test_zero_one_check_text() -> None:
    # s49 mask49: a row with no 1 is a uniform row in the original (a finite offset), the op's fully masked row
    assert zero_one_exact("m") == "bool(((m == 0) | (m == 1)).all() & (m == 1).any(-1).all())"
    assert zero_one_exact("a.b + c") == "bool((((a.b + c) == 0) | ((a.b + c) == 1)).all() & ((a.b + c) == 1).any(-1).all())"
    assert zero_one_exact("m", None) == "bool(((m == 0) | (m == 1)).all())"


@pytest.mark.parametrize("expr,reason", [
    ("s * m - 10.0 * (1.0 - m)", "the masked logits become -10"),
    ("s * m + 10000.0 * (1.0 - m)", "the masked logits become 10000"),
])
def test_small_or_positive_offset_is_not_a_mask(expr: str, reason: str) -> None:
    findings, reasons = _one(ATTN, _MUL.format(expr=expr))
    assert not findings and any(reason in r for r in reasons), reasons


def test_offset_before_the_product_is_not_read_as_a_mask() -> None:
    # ``10000 * (1 - m) - s * m`` negates the scores: not a masking of them
    findings, _ = _one(ATTN, _MUL.format(expr="10000.0 * (1.0 - m) - s * m"))
    assert not any(f.params.get("mask_kind") == "multiplicative_01" for f in findings)


def test_comparison_built_factor_without_offset_is_refused_not_a_scale() -> None:
    ex = _example(ATTN, "multiplicative_mask_without_offset")
    findings, reasons = _one(ATTN, ex.code)
    assert not findings
    assert any("masked logits become 0 (still attended)" in r for r in reasons), reasons


def test_comparison_built_keep_mask_needs_no_value_check() -> None:
    findings, _ = _one(ATTN, _example(ATTN, "multiplicative_mask_from_comparison").code)
    assert findings and not findings[0].params["mask_values_checked"]
    assert "bool(" not in findings[0].fused  # no reduction, no host sync
    assert any("0/1 mask applied by multiplication" in r.detail for r in findings[0].risks)


# -- dropout under a flag and an RNG fork ------------------------------------------------------------------------

def test_nested_rng_fork_dropout_is_one_dropout() -> None:
    ex = _example(ATTN, "dropout_under_flag_and_rng_fork")
    findings, reasons = _one(ATTN, ex.code)
    assert findings, reasons
    f = findings[0]
    assert "keep_prob=(1.0 - attention_dropout.p) if (attention_dropout is not None) and attention_dropout.training else 1.0" in f.fused
    assert any("inside `with rng.fork():`" in r.detail for r in f.risks)
    facts = check_rewrite_runs(ATTN, ex.code, ex.run, findings)
    assert facts["calls"] == 2 and min(facts["cos_out"]) > 0.9999


# -- returned probabilities --------------------------------------------------------------------------------------

_RETURNS = """
import torch


def attention(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
    return p @ v, p
{extra}
"""


@pytest.mark.parametrize("extra,fused", [
    ("", False),  # nothing shows None is accepted: a caller may plot them
    ("\nIMPLEMENTATIONS = {'eager': attention}\n", True),  # one of interchangeable implementations
    ("\ndef caller(q, k, v):\n    out, probs = attention(q, k, v)\n    return probs\n", False),  # a call is no evidence
])
def test_returned_probabilities_need_evidence_of_none(extra: str, fused: bool) -> None:
    findings, reasons = _one(ATTN, _RETURNS.format(extra=extra))
    assert bool(findings) is fused, reasons
    if fused:
        assert findings[0].params["returns_probs"] == "p" and "p = None" in findings[0].fused
    else:
        assert any("are returned to the callers, and nothing shows a caller accepts None" in r for r in reasons), reasons


_METHOD = """
import torch
from torch import nn


class Attn(nn.Module):
    def _attn(self, q, k, v):
        w = torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
        return w @ v, w

    def forward(self, q, k, v, flag=False):
        out, w = self._attn(q, k, v)
        {use}
"""


@pytest.mark.parametrize("use,fused", [
    ("return (out, w) if flag else (out,)", True),  # read only under the caller's flag
    ("if flag:\n            return out, w\n        return out", True),
    ("self.last = w\n        return out", False),  # stored unconditionally
    ("return out, w", False),
])
def test_in_class_callers_reading_weights_only_under_a_flag(use: str, fused: bool) -> None:
    findings, reasons = _one(ATTN, _METHOD.format(use=use))
    assert bool(findings) is fused, reasons


def test_vit_returning_attention_is_a_near_miss() -> None:
    ex = _example(ATTN, "vit_returns_attention_for_visualisation")
    findings, reasons = _one(ATTN, ex.code)
    assert not findings and any("`attn`" in r and "returned to the callers" in r for r in reasons)


# -- unreachable SDPA calls --------------------------------------------------------------------------------------

_SDPA = """
import torch.nn.functional as F


def attend(q, k, v, flag):
{body}
"""


@pytest.mark.parametrize("body,reachable", [
    ("    raise NotImplementedError\n    return F.scaled_dot_product_attention(q, k, v)", False),
    ("    try:\n        raise RuntimeError()\n        out = F.scaled_dot_product_attention(q, k, v)\n    except RuntimeError:\n        out = q\n    return out", False),
    ("    for _ in range(2):\n        continue\n        q = F.scaled_dot_product_attention(q, k, v)\n    return q", False),
    ("    if flag:\n        raise ValueError()\n    return F.scaled_dot_product_attention(q, k, v)", True),
    ("    try:\n        return q\n    finally:\n        out = F.scaled_dot_product_attention(q, k, v)", True),
    ("    try:\n        raise RuntimeError()\n    except RuntimeError:\n        out = F.scaled_dot_product_attention(q, k, v)\n    return out", True),
])
def test_sdpa_after_an_unconditional_exit(body: str, reachable: bool) -> None:
    findings, reasons = _one(SDPA, _SDPA.format(body=body))
    assert bool(findings) is reachable, reasons
    if not reachable:
        assert any("the call is unreachable" in r for r in reasons)


_BERT = """
import torch
from torch import nn


class SelfAttention(nn.Module):
    def forward(self, q, k, v, output_attentions=False):
        probs = torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
        ctx = probs @ v
        {ret}
{sibling}
"""


@pytest.mark.parametrize("ret,sibling,fused", [
    ("return (ctx, probs) if output_attentions else (ctx,)", "", True),  # read only under the caller's flag
    ("return (ctx, probs) if not output_attentions else (ctx,)", "", True),  # a flag either way: the caller chooses
    ("return ctx, probs", "", False),
    # another class of the file with the same method returns None there: interchangeable implementations
    ("return ctx, probs", "\nclass FlashSelfAttention(nn.Module):\n    def forward(self, q, k, v, output_attentions=False):\n        return q, None\n", True),
    ("return (ctx, probs) if q.shape[0] > 1 else (ctx,)", "", False),  # a data test, not the caller's flag
])
def test_probabilities_returned_under_a_flag_or_beside_a_none_sibling(ret: str, sibling: str, fused: bool) -> None:
    findings, reasons = _one(ATTN, _BERT.format(ret=ret, sibling=sibling))
    assert bool(findings) is fused, reasons


@pytest.mark.parametrize("body,fused", [
    ("    m = mask[:, None]\n    s = q @ k.transpose(-2, -1) * m", False),  # the mask parameter itself, re-viewed
    ("    s = (q @ k.transpose(-2, -1)) * mask\n    n = mask.shape[-1]", False),  # used as a tensor elsewhere
    ("    s = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5)", True),  # computed from q's metadata: a float
    ("    s = q @ k.transpose(-2, -1) * mask", True),  # nothing says it is a tensor: taken as a scale, as before
])
def test_factor_used_as_a_tensor_is_not_a_scale(body: str, fused: bool) -> None:
    code = f"import torch\n\n\ndef attend(q, k, v, mask):\n{body}\n    return torch.softmax(s, dim=-1) @ v\n"
    findings, reasons = _one(ATTN, code)
    assert bool(findings) is fused, reasons
    if not fused:
        assert any("is used as a tensor in this function" in r for r in reasons), reasons
