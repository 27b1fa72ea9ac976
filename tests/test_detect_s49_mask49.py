"""s49 (helper mask49): a float mask binarised for npu_fusion_attention must leave every query row a key.

An additive float mask handed in (HF / BERT style, a bias) is converted with ``mask < 0`` (True = masked) after the
run-time check "every entry is 0 or <= -1000". A row with no 0 passed that check before: a per-head bias of -2000
everywhere, a query row padded with -10000. Eager softmax is shift-invariant (such a row is the softmax of the scores,
a real attention row), the op sees a fully masked row (spec 5.1 / 14: its value is not pinned down; the emulator zeroes
it). Now the check also requires a 0 in every row (a 1 in every row of a 0 / 1 multiplicative mask): such inputs run
the original code, ordinary causal / padding masks (every row keeps a key) still run the fused op. Every case runs the
rewritten module under the emulator against the original, outputs and gradients, fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns._attention_s49m import additive_exact, zero_one_exact
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.sdpa import SdpaPattern

ATTN, SDPA = AttentionPattern(), SdpaPattern()

# a BERT-style self-attention: the extended mask is handed in and added to the scaled scores
_EAGER = '''
import math
import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d=32, n_head=4):
        super().__init__()
        self.n_head, self.head_dim = n_head, d // n_head
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, attention_mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + attention_mask
        probs = nn.functional.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, v)
        return ctx.transpose(1, 2).reshape(b, s, -1)
'''

# the same with SDPA and the mask handed through as attn_mask
_SDPA = '''
import torch
from torch import nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, d=32, n_head=4):
        super().__init__()
        self.n_head, self.head_dim = n_head, d // n_head
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, attention_mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return ctx.transpose(1, 2).reshape(b, s, -1)
'''

# a 0 / 1 keep mask applied by multiplication and a finite offset
_KEEP01 = '''
import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d=32, n_head=4):
        super().__init__()
        self.n_head, self.head_dim = n_head, d // n_head
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, keep):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
        att = att * keep - 10000.0 * (1.0 - keep)
        att = att.softmax(dim=-1)
        y = att @ v
        return y.transpose(1, 2).reshape(b, s, -1)
'''

# the original zeroes the NaN rows of the probabilities (rows whose every score is -inf)
_NAN_ZEROED = '''
import math
import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d=32, n_head=4):
        super().__init__()
        self.n_head, self.head_dim = n_head, d // n_head
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, attention_mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + attention_mask
        probs = torch.softmax(scores, dim=-1)
        probs = probs.masked_fill(torch.isnan(probs), 0.0)
        ctx = torch.matmul(probs, v)
        return ctx.transpose(1, 2).reshape(b, s, -1)
'''

_B, _S = 2, 6


def _run_script(mask: str, dtype: str) -> str:
    return (f"torch.manual_seed(0)\nm = SelfAttention().to(torch.{dtype})\n"
            f"x = torch.randn({_B}, {_S}, 32, dtype=torch.{dtype}, requires_grad=True)\n"
            f"mask = ({mask}).to(torch.{dtype}) if ({mask}).is_floating_point() else ({mask})\n"
            "out = m(x, mask)\nleaves = [x, *m.parameters()]\n")


# masks every row of which keeps a key: the fused op runs
_KEPT = {
    "causal_minus_inf": "torch.full((6, 6), float('-inf')).triu(1)",
    "causal_finfo_min": "torch.zeros(6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)",
    "padding_minus_10000": "(1.0 - torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.float32)[:, None, None, :]) * -10000.0",
    "causal_and_padding_finfo_min": ("torch.zeros(2, 1, 6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1) | "
                                     "torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1]], dtype=torch.bool)[:, None, None, :], "
                                     "torch.finfo(torch.float32).min)"),
}

# masks with a row of no 0: the original code runs (the fused op's fully masked row is not the eager row)
_ROW_MASKED = {
    "per_head_bias_minus_2000": "torch.tensor([0.0, -2000.0, 0.0, 0.0]).view(1, 4, 1, 1)",
    "query_row_padded_minus_10000": "torch.zeros(2, 1, 6, 6).index_fill(2, torch.tensor([5]), -10000.0)",
    "whole_sequence_padded_finfo_min": ("torch.tensor([[0.0] * 6, [torch.finfo(torch.bfloat16).min] * 6])[:, None, None, :]"),
    "row_of_minus_1000_and_minus_inf": ("torch.zeros(1, 1, 6, 6).index_fill(2, torch.tensor([2]), -1000.0)"
                                        ".index_fill(3, torch.tensor([0]), float('-inf'))"),
}


def _facts(pattern, code: str, mask: str, dtype: str, backward: bool = True) -> dict:
    findings, misses = detect_all(pattern, code)
    assert [f.qualname for f in findings] == ["SelfAttention.forward"], [m.reason for m in misses]
    run = _run_script(mask, dtype) + ("" if backward else "leaves = []\n")
    return check_rewrite_runs(pattern, code, run, findings)


def _same(facts: dict, dtype: str) -> None:
    tol = 0.9999 if dtype == "float32" else 0.999
    assert min(facts["cos_out"]) > tol and min(facts["cos_grad"], default=1.0) > tol, facts
    assert all(a == b for a, b in facts["dtypes"]) and all(a == b for a, b in facts["shapes"]), facts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("code,pattern", [(_EAGER, ATTN), (_SDPA, SDPA)], ids=["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(_ROW_MASKED))
def test_a_row_masked_throughout_runs_the_original(name: str, code: str, pattern, dtype: str) -> None:
    facts = _facts(pattern, code, _ROW_MASKED[name], dtype)
    assert facts["calls"] == 0, facts["all_calls"]  # the value / row check sent it to the original code
    _same(facts, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("code,pattern", [(_EAGER, ATTN), (_SDPA, SDPA)], ids=["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(_KEPT))
def test_masks_that_keep_a_key_per_row_run_the_fused_op(name: str, code: str, pattern, dtype: str) -> None:
    facts = _facts(pattern, code, _KEPT[name], dtype)
    assert facts["all_calls"].get("npu_fusion_attention", 0) >= 1, facts["all_calls"]
    assert "== 0).any(-1).all()" in facts["rewritten"]  # the row half of the check is in the guard
    _same(facts, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_keep01_row_without_a_one_runs_the_original(dtype: str) -> None:
    rows = "torch.tensor([[1.0] * 6, [1.0] * 6]).view(2, 1, 1, 6).expand(2, 1, 6, 6).clone().index_fill(2, torch.tensor([3]), 0.0)"
    facts = _facts(ATTN, _KEEP01, rows, dtype)
    assert facts["calls"] == 0, facts["all_calls"]
    _same(facts, dtype)
    facts = _facts(ATTN, _KEEP01, "torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2]).view(2, 1, 1, 6)", dtype)
    assert facts["all_calls"].get("npu_fusion_attention", 0) >= 1, facts["all_calls"]
    _same(facts, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nan_zeroed_rows_keep_minus_inf_rows_fused_and_finite_rows_original(dtype: str) -> None:
    # a query row of -inf: NaN in the original, zeroed there; the rewrite zeroes the fully masked rows: fused (forward
    # only: the original's backward through the NaN row is NaN for q and k, the fused op's is finite)
    inf_row = "torch.zeros(2, 1, 6, 6).index_fill(2, torch.tensor([5]), float('-inf'))"
    facts = _facts(ATTN, _NAN_ZEROED, inf_row, dtype, backward=False)
    assert facts["all_calls"].get("npu_fusion_attention", 0) >= 1, facts["all_calls"]
    _same(facts, dtype)
    # a query row of -10000: no NaN, the original averages the keys; the op's row would be zeroed: original code
    facts = _facts(ATTN, _NAN_ZEROED, "torch.zeros(2, 1, 6, 6).index_fill(2, torch.tensor([5]), -10000.0)", dtype)
    assert facts["calls"] == 0, facts["all_calls"]
    _same(facts, dtype)


def test_check_texts() -> None:
    assert additive_exact("m") == "bool(((m == 0) | (m <= -1000.0)).all() & (m == 0).any(-1).all())"
    assert additive_exact("a + b", None) == "bool((((a + b) == 0) | ((a + b) <= -1000.0)).all())"
    assert additive_exact("m", "nan") == ("bool(((m == 0) | (m <= -1000.0)).all() & ((m == 0).any(-1) | "
                                          "(m == float('-inf')).all(-1)).all())")
    assert zero_one_exact("m") == "bool(((m == 0) | (m == 1)).all() & (m == 1).any(-1).all())"
    # the checks evaluate on a broadcast mask ([1, N, 1, 1]), a 1-D mask and a 0-dim one
    env = {"torch": torch}
    for m, want in ((torch.tensor([0.0, -2000.0]).view(1, 2, 1, 1), False), (torch.tensor([0.0, -1e4]), True),
                    (torch.tensor(0.0), True), (torch.tensor(-1e4), False)):
        assert eval(additive_exact("m"), {**env, "m": m}) is want


def test_value_check_risk_names_the_rows() -> None:
    findings, _ = detect_all(ATTN, _EAGER)
    text = " ".join(r.detail for r in findings[0].risks)
    assert "every query row keeps a 0" in text


# padding over queries and keys (an outer product) built into a -1e9 float mask: _mask_rows reads it as a construction
# that can empty a query row; the value check's row half is that row check (one reduction, one host sync, not two)
_PAIR_PADDING = '''
import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d=32, n_head=4):
        super().__init__()
        self.n_head, self.head_dim = n_head, d // n_head
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, keep):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        pair = keep[:, None, :, None] & keep[:, None, None, :]
        bias = torch.zeros(pair.shape, dtype=x.dtype).masked_fill(~pair, -1e9)
        att = q @ k.transpose(-2, -1) * self.head_dim ** -0.5 + bias
        y = att.softmax(dim=-1) @ v
        return y.transpose(1, 2).reshape(b, s, -1)
'''


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_query_and_key_padding_is_checked_once(dtype: str) -> None:
    findings, _ = detect_all(ATTN, _PAIR_PADDING)
    guard = next(ln for ln in findings[0].fused.splitlines() if ln.lstrip().startswith("if ("))
    assert guard.count(".any(-1).all()") == 1, guard
    assert not any("a query row can keep no key" in r.detail for r in findings[0].risks)
    facts = _facts(ATTN, _PAIR_PADDING, "torch.tensor([[True] * 6, [True] * 4 + [False] * 2])", dtype)
    assert facts["calls"] == 0, facts["all_calls"]  # padded query rows: the original code
    _same(facts, dtype)
    facts = _facts(ATTN, _PAIR_PADDING, "torch.ones(2, 6, dtype=torch.bool)", dtype)
    assert facts["all_calls"].get("npu_fusion_attention", 0) >= 1, facts["all_calls"]
    _same(facts, dtype)


# -- 2. an attention helper whose every call takes the branch the fused call excludes (HO25b extra, harmless) --------------

_MEMORY_BLOCK = '''
import math
import torch
import torch.nn.functional as F
from torch import nn


def softmax_plus_one(x, dim=-1):
    top = x.amax(dim=dim, keepdim=True)
    e = torch.exp(x - top)
    return e / (torch.exp(-top) + e.sum(dim=dim, keepdim=True))


class MemoryBlock(nn.Module):
    def __init__(self, d=32, n_head=4, variant="softmax"):
        super().__init__()
        self.n_head, self.head_dim, self.variant = n_head, d // n_head, variant
        self.q = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def _eager(self, q, k, v):
        w = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        if self.variant == "plus_one":
            w = softmax_plus_one(w, dim=-1)
        else:
            w = F.softmax(w, dim=-1)
        w = self.drop(w)
        return torch.matmul(w, v)

    def forward(self, x, mk, mv, need_weights=False):
        b = x.shape[0]
        q = self.q(x).view(b, -1, self.n_head, self.head_dim).transpose(1, 2)
        k = mk.view(b, -1, self.n_head, self.head_dim).transpose(1, 2)
        v = mv.view(b, -1, self.n_head, self.head_dim).transpose(1, 2)
        if self.variant == "plus_one":
            out = self._eager(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.drop.p if self.training else 0.0)
        return out.transpose(1, 2).reshape(b, -1, self.n_head * self.head_dim)
'''


def test_helper_called_only_under_the_excluded_branch_is_a_near_miss() -> None:
    findings, misses = detect_all(ATTN, _MEMORY_BLOCK)
    assert [f.qualname for f in findings] == []
    (miss,) = [m for m in misses if m.qualname == "MemoryBlock._eager"]
    assert miss.reason.startswith("every call of `_eager` (line 36) is made where `self.variant == 'plus_one'` selects "
                                  "`softmax_plus_one(w, dim=-1)` on the probabilities"), miss.reason
    assert "would never run" in miss.reason


def test_inverted_test_in_the_caller_keeps_the_guarded_candidate() -> None:
    # the caller's test reads the other branch: the helper runs with F.softmax there
    code = _MEMORY_BLOCK.replace('        if self.variant == "plus_one":\n            out = self._eager',
                                 '        if self.variant != "plus_one":\n            out = self._eager')
    findings, _ = detect_all(ATTN, code)
    assert [f.qualname for f in findings] == ["MemoryBlock._eager"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_helper_also_called_for_the_weights_stays_fused_and_runs(dtype: str) -> None:
    # a second call outside the flag (attention maps requested): the softmax branch is reached, the candidate stays
    code = _MEMORY_BLOCK.replace(
        '        if self.variant == "plus_one":\n            out = self._eager(q, k, v)\n',
        '        if self.variant == "plus_one" or need_weights:\n            out = self._eager(q, k, v)\n')
    findings, misses = detect_all(ATTN, code)
    assert [f.qualname for f in findings] == ["MemoryBlock._eager"], [m.reason for m in misses]
    run = (f"torch.manual_seed(0)\nm = MemoryBlock().to(torch.{dtype}).eval()\n"
           f"x = torch.randn(2, 3, 32, dtype=torch.{dtype}, requires_grad=True)\n"
           f"mk = torch.randn(2, 5, 32, dtype=torch.{dtype}, requires_grad=True)\n"
           f"mv = torch.randn(2, 5, 32, dtype=torch.{dtype}, requires_grad=True)\n"
           "out = m(x, mk, mv, need_weights=True)\nleaves = [x, mk, mv]\n")
    facts = check_rewrite_runs(ATTN, code, run, findings)
    assert facts["all_calls"].get("npu_fusion_attention", 0) >= 1, facts["all_calls"]
    _same(facts, dtype)


def test_a_second_class_calling_the_helper_keeps_the_candidate() -> None:
    # a subclass calls the helper unconditionally: its mention is not one of the flagged calls
    code = _MEMORY_BLOCK + '''

class PlainBlock(MemoryBlock):
    def forward(self, q, k, v):
        return self._eager(q, k, v)
'''
    findings, _ = detect_all(ATTN, code)
    assert [f.qualname for f in findings] == ["MemoryBlock._eager"]


# -- 3. several terms: a handed-in padding bias beside a causal triangle built in view ----------------------------------
# each term keeps a key in every row; with left padding their union masks the first query's only key (the triangle
# leaves key 0, the padding masks it): the eager row is then a softmax over finite -10000 entries (all weight on key 0)

_CAUSAL_AND_PADDING = '''
import math
import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d=32, n_head=4):
        super().__init__()
        self.n_head, self.head_dim = n_head, d // n_head
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, attention_mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        causal = torch.full((s, s), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + causal + attention_mask
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
'''


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_left_padding_beside_a_causal_triangle_runs_the_original(dtype: str) -> None:
    findings, _ = detect_all(ATTN, _CAUSAL_AND_PADDING)
    assert "not bool(_npufuse_mask.all(-1).any())" in findings[0].fused
    left = "torch.tensor([[0.0] * 6, [-10000.0] * 2 + [0.0] * 4])[:, None, None, :]"
    facts = _facts(ATTN, _CAUSAL_AND_PADDING, left, dtype)
    assert facts["calls"] == 0, facts["all_calls"]
    _same(facts, dtype)
    right = "torch.tensor([[0.0] * 6, [0.0] * 4 + [-10000.0] * 2])[:, None, None, :]"
    facts = _facts(ATTN, _CAUSAL_AND_PADDING, right, dtype)
    assert facts["all_calls"].get("npu_fusion_attention", 0) >= 1, facts["all_calls"]
    _same(facts, dtype)


def test_a_namesake_method_of_an_unrelated_class_is_set_aside() -> None:
    # another block of the file defines and calls its own `_eager` (a plain eager path): its mentions are its own
    code = _MEMORY_BLOCK + '''

class OtherBlock(nn.Module):
    def _eager(self, q, k, v):
        return q

    def forward(self, q, k, v):
        return self._eager(q, k, v)
'''
    findings, misses = detect_all(ATTN, code)
    assert "MemoryBlock._eager" not in [f.qualname for f in findings]
    assert any(m.qualname == "MemoryBlock._eager" and "every call of `_eager`" in m.reason for m in misses)
    # the same class as a subclass of MemoryBlock: its own `_eager` overrides, its calls are not set aside
    findings, _ = detect_all(ATTN, code.replace("class OtherBlock(nn.Module):", "class OtherBlock(MemoryBlock):"))
    assert "MemoryBlock._eager" in [f.qualname for f in findings]


# -- 4. scores in another axis order (LoFTR-style einsum, the keys on axis 2): the term's last axis is the heads, so
# its rows are checked on the boolean mask the op gets ([B, N, Sq, Skv]) rather than on the term's own last axis

_KEYS_ON_AXIS_TWO = '''
import torch


def attend(q, k, v, bias):
    qk = torch.einsum("nlhd,nshd->nlsh", q, k)
    qk = qk + bias
    a = torch.softmax(qk / q.size(3) ** 0.5, dim=2)
    return torch.einsum("nlsh,nshd->nlhd", a, v)
'''


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_keys_on_another_axis_are_checked_on_the_op_mask(dtype: str) -> None:
    findings, misses = detect_all(ATTN, _KEYS_ON_AXIS_TWO)
    assert [f.qualname for f in findings] == ["attend"], [m.reason for m in misses]
    assert "not bool(_npufuse_mask.all(-1).any())" in findings[0].fused
    assert "== 0).any(-1).all()" not in findings[0].fused  # the term's last axis is the heads, not the keys
    run = (f"torch.manual_seed(0)\nq, k, v = (torch.randn(2, 5, 4, 8, dtype=torch.{dtype}, requires_grad=True) for _ in range(3))\n"
           "bias = torch.zeros(2, 5, 5, 1, dtype=torch.{dtype})\nbias[1, :, 3:] = -10000.0\n{row}"
           "out = attend(q, k, v, bias)\nleaves = [q, k, v]\n")
    facts = check_rewrite_runs(ATTN, _KEYS_ON_AXIS_TWO, run.format(dtype=dtype, row=""), findings)
    assert facts["all_calls"].get("npu_fusion_attention", 0) >= 1, facts["all_calls"]
    _same(facts, dtype)
    # query 2 of sequence 0 sees no key (every key of its row -10000): the original code
    facts = check_rewrite_runs(ATTN, _KEYS_ON_AXIS_TWO, run.format(dtype=dtype, row="bias[0, 2] = -10000.0\n"), findings)
    assert facts["calls"] == 0, facts["all_calls"]
    _same(facts, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nan_zeroing_beside_causal_and_padding_checks_the_union(dtype: str) -> None:
    # the first query of a left-padded row: -10000 on key 0, -inf on the others: no NaN in the original (all weight on
    # key 0), a fully masked row for the op, which the rewrite would zero: the original code runs
    code = _CAUSAL_AND_PADDING.replace("        probs = torch.softmax(scores, dim=-1)\n",
                                       "        probs = torch.softmax(scores, dim=-1)\n"
                                       "        probs = probs.masked_fill(torch.isnan(probs), 0.0)\n")
    findings, _ = detect_all(ATTN, code)
    assert "not bool(_npufuse_mask.all(-1).any())" in findings[0].fused
    left = "torch.tensor([[0.0] * 6, [-10000.0] * 2 + [0.0] * 4])[:, None, None, :]"
    facts = _facts(ATTN, code, left, dtype)
    assert facts["calls"] == 0, facts["all_calls"]
    _same(facts, dtype)
    right = "torch.tensor([[0.0] * 6, [0.0] * 4 + [-10000.0] * 2])[:, None, None, :]"
    facts = _facts(ATTN, code, right, dtype)
    assert facts["all_calls"].get("npu_fusion_attention", 0) >= 1, facts["all_calls"]
    _same(facts, dtype)


# -- 5. add + norm of a transformers decoder layer unrolled in a function (HO25b mamba-vla miss) -------------------------
# the layer's class is told only by the annotation of the function's parameter: a repository class whose __init__
# annotates the model attribute with a Qwen3-VL class its file imports from transformers

_UNROLL = '''\
import torch
from vlmpkg.wrapper import VLMWrapper


@torch.inference_mode()
def probe_layer(wrapper: VLMWrapper, hidden, target):
    text = wrapper.vlm.language_model
    for i, layer in enumerate(text.layers):
        if i == target:
            residual = hidden
            branch = layer.self_attn(layer.input_layernorm(hidden))
            hidden = residual + branch
            residual = hidden
            hidden = layer.post_attention_layernorm(hidden)
            hidden = residual + layer.mlp(hidden)
            break
        hidden = layer(hidden)
    return hidden
'''

_WRAPPER = '''\
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration


class VLMWrapper(nn.Module):
    def __init__(self, loader):
        super().__init__()
        self.vlm: "Qwen3VLForConditionalGeneration" = loader()
'''

_QWEN_NORM = '''
import torch
from torch import nn


class Qwen3VLTextRMSNorm(nn.Module):  # transformers' code (LlamaRMSNorm's, token for token)
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)
'''

_UNROLL_RUN = '''
import types as _t
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm as _N
torch.manual_seed(3)


class _Layer(torch.nn.Module):
    def __init__(self, d, norm):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = norm(d), norm(d)
        self.self_attn, self.mlp = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, h):
        return h + self.mlp(self.post_attention_layernorm(h))


layers = torch.nn.ModuleList(_Layer(16, NORM) for _ in range(3))
with torch.no_grad():
    for p in layers.parameters():
        p.normal_(0, 0.3)
w = _t.SimpleNamespace(vlm=_t.SimpleNamespace(language_model=_t.SimpleNamespace(layers=layers)))
x = torch.randn(2, 5, 16)
out = [probe_layer(w, x, 1), probe_layer(_t.SimpleNamespace(vlm=_t.SimpleNamespace(language_model=_t.SimpleNamespace(
    layers=layers.to(torch.bfloat16)))), x.to(torch.bfloat16), 2).float()]
leaves = []
'''


def _unroll_findings(tmp_path, code: str, wrapper: str = _WRAPPER) -> tuple[list, list]:
    from npufuse.patterns.add_rms_norm import AddRmsNorm
    from npufuse.scan import repo_facts
    from npufuse.scan.dataflow import ModuleInfo

    (tmp_path / "vlmpkg").mkdir(exist_ok=True)
    (tmp_path / "vlmpkg" / "__init__.py").write_text("")
    (tmp_path / "vlmpkg" / "wrapper.py").write_text(wrapper)
    (tmp_path / "probe.py").write_text(code)
    module = ModuleInfo.from_source("probe.py", code)
    repo_facts.attach_root(module, tmp_path)
    found, misses = [], []
    for scope in module.scopes:
        for r in AddRmsNorm().detect(module, scope):
            (misses if hasattr(r, "reason") else found).append(r)
    return found, misses


@pytest.fixture
def qwen_stub(monkeypatch):
    from pattern_harness import install_stand_in_modules

    ns: dict = {"__name__": "transformers.models.qwen3_vl.modeling_qwen3_vl"}
    exec(_QWEN_NORM, ns)
    install_stand_in_modules(monkeypatch, {
        "transformers.models.qwen3_vl.modeling_qwen3_vl": {"Qwen3VLTextRMSNorm": ns["Qwen3VLTextRMSNorm"]},
        "vlmpkg.wrapper": {"VLMWrapper": object},
    })
    return ns["Qwen3VLTextRMSNorm"]


def test_unrolled_decoder_layer_norm_fuses_and_runs(tmp_path, qwen_stub) -> None:
    from npufuse.patterns.add_rms_norm import AddRmsNorm

    findings, misses = _unroll_findings(tmp_path, _UNROLL)
    assert [(f.qualname, f.line) for f in findings] == [("probe_layer", 12)], [m.reason for m in misses]
    assert '"Qwen3VLTextRMSNorm"' in findings[0].fused and 'startswith("transformers.")' in findings[0].fused
    facts = check_rewrite_runs(AddRmsNorm(), _UNROLL, _UNROLL_RUN.replace("NORM", "_N"), findings)
    assert facts["all_calls"].get("npu_add_rms_norm", 0) >= 2, facts["all_calls"]
    assert facts["cos_out"][0] > 0.9999 and facts["cos_out"][1] > 0.999, facts
    assert all(a == b for a, b in facts["dtypes"]), facts


def test_unrolled_layer_of_another_norm_runs_the_original(tmp_path, qwen_stub) -> None:
    # a LayerNorm where the layer holds one: the run-time class check sends it to the original call
    from npufuse.patterns.add_rms_norm import AddRmsNorm

    findings, _ = _unroll_findings(tmp_path, _UNROLL)
    facts = check_rewrite_runs(AddRmsNorm(), _UNROLL, _UNROLL_RUN.replace("NORM", "torch.nn.LayerNorm"), findings)
    assert facts["all_calls"].get("npu_add_rms_norm", 0) == 0, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.99999, facts


@pytest.mark.parametrize("wrapper", [
    _WRAPPER.replace('self.vlm: "Qwen3VLForConditionalGeneration" = loader()', "self.vlm = loader()"),  # no annotation
    _WRAPPER.replace("qwen3_vl.modeling_qwen3_vl", "t5.modeling_t5"),  # a family whose norm is another class
], ids=["unannotated_attribute", "other_family"])
def test_unrolled_layer_without_the_chain_is_not_read(tmp_path, wrapper: str) -> None:
    findings, _ = _unroll_findings(tmp_path, _UNROLL, wrapper)
    assert findings == []


def test_unrolled_layer_of_an_unannotated_parameter_is_not_read(tmp_path) -> None:
    findings, _ = _unroll_findings(tmp_path, _UNROLL.replace("wrapper: VLMWrapper", "wrapper"))
    assert findings == []


@pytest.mark.parametrize("rebind", [
    "    wrapper = wrapper.module\n",  # once
    "    wrapper = wrapper.module\n    wrapper = wrapper.inner\n",  # twice: the parameter's annotation no longer tells either
], ids=["once", "twice"])
def test_unrolled_layer_of_a_rebound_parameter_is_not_read(tmp_path, qwen_stub, rebind: str) -> None:
    code = _UNROLL.replace("    text = wrapper.vlm.language_model\n", rebind + "    text = wrapper.vlm.language_model\n")
    findings, _ = _unroll_findings(tmp_path, code)
    assert findings == []
