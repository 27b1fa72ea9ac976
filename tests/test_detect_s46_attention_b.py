"""s46 attention split across methods (helper attn46b): the wenet / FunASR / CosyVoice / InspireMusic lineage.

``forward`` makes ``scores = matmul(q, kᵀ) / sqrt(d_k)`` (over a KV cache concatenated first, the new cache returned
beside the output) and returns ``self.forward_attention(v, scores, mask)``; the helper masks a keep mask
(``mask.eq(0)`` is masked) with -inf under ``if mask.size(2) > 0`` (the ``torch.ones((0, 0, 0))`` sentinel skips it),
softmaxes, zeroes the masked probabilities after the softmax, drops out and multiplies by V.

Fuse classes (each rewritten and run under the emulator against the original):
A the probabilities zeroed after the softmax under the mask's test: the fused output's fully masked rows are zeroed
  (checked with an emulator whose fully masked rows are garbage: the spec leaves them open);
B the helper defined by the base class (RelPosition's ``forward`` calls the inherited ``forward_attention``), with
  Transformer-XL's position term summed a statement after the products are made (``(ac + bd) / sqrt(d_k)``: pse);
C a subclass that overrides the helper runs the call as written (run-time ``type(self).m is Base.m``).
Near misses: the zeroing of another mask than the one the scores got; the zeroing beside a second mask term; a helper
that keeps the probabilities on ``self``; the class nested in a function (no name for the run-time check); a
subclass of two bases (the helper's owner is not read).
"""

from __future__ import annotations

import pytest

from npufuse.patterns.attention import AttentionPattern
from pattern_harness import check_rewrite_runs, detect_all


_WENET = '''
import math
from typing import Tuple

import torch
from torch import nn


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head: int = 2, n_feat: int = 16, dropout_rate: float = 0.0):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value: torch.Tensor, scores: torch.Tensor,
                          mask: torch.Tensor = torch.ones((0, 0, 0), dtype=torch.bool)) -> torch.Tensor:
        n_batch = value.size(0)
        if mask.size(2) > 0:
            mask = mask.unsqueeze(1).eq(0)
            mask = mask[:, :, :, :scores.size(-1)]
            scores = scores.masked_fill(mask, -float('inf'))
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        p_attn = self.dropout(attn)
        x = torch.matmul(p_attn, value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask: torch.Tensor = torch.ones((0, 0, 0), dtype=torch.bool),
                pos_emb: torch.Tensor = torch.empty(0),
                cache: torch.Tensor = torch.zeros((0, 0, 0, 0))) -> Tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.forward_qkv(query, key, value)
        if cache.size(0) > 0:
            key_cache, value_cache = torch.split(cache, cache.size(-1) // 2, dim=-1)
            k = torch.cat([key_cache, k], dim=2)
            v = torch.cat([value_cache, v], dim=2)
        new_cache = torch.cat((k, v), dim=-1)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask), new_cache
'''

_REL_POS = '''

class RelPositionMultiHeadedAttention(MultiHeadedAttention):
    def __init__(self, n_head: int = 2, n_feat: int = 16, dropout_rate: float = 0.0):
        super().__init__(n_head, n_feat, dropout_rate)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.randn(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.randn(self.h, self.d_k))

    def rel_shift(self, x):
        zero_pad = torch.zeros((x.size(0), x.size(1), x.size(2), 1), device=x.device, dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=-1).view(x.size(0), x.size(1), x.size(3) + 1, x.size(2))
        return x_padded[:, :, 1:].view_as(x)[:, :, :, : x.size(-1) // 2 + 1]

    def forward(self, query, key, value, mask: torch.Tensor = torch.ones((0, 0, 0), dtype=torch.bool),
                pos_emb: torch.Tensor = torch.empty(0),
                cache: torch.Tensor = torch.zeros((0, 0, 0, 0))) -> Tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.forward_qkv(query, key, value)
        q = q.transpose(1, 2)
        if cache.size(0) > 0:
            key_cache, value_cache = torch.split(cache, cache.size(-1) // 2, dim=-1)
            k = torch.cat([key_cache, k], dim=2)
            v = torch.cat([value_cache, v], dim=2)
        new_cache = torch.cat((k, v), dim=-1)
        n_batch_pos = pos_emb.size(0)
        p = self.linear_pos(pos_emb).view(n_batch_pos, -1, self.h, self.d_k).transpose(1, 2)
        q_with_bias_u = (q + self.pos_bias_u).transpose(1, 2)
        q_with_bias_v = (q + self.pos_bias_v).transpose(1, 2)
        matrix_ac = torch.matmul(q_with_bias_u, k.transpose(-2, -1))
        matrix_bd = torch.matmul(q_with_bias_v, p.transpose(-2, -1))
        if matrix_ac.shape != matrix_bd.shape:
            matrix_bd = self.rel_shift(matrix_bd)
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask), new_cache
'''

# key padding [B, 1, T2] (batch 1 keeps 4 keys), a chunk mask [B, T1, T2] with one fully masked query row, the
# empty sentinel, and a KV cache in front of the keys
_INPUTS = '''
torch.manual_seed(0)
x = torch.randn(2, 5, 16, requires_grad=True)
pad = torch.ones(2, 1, 5, dtype=torch.bool)
pad[1, :, 4:] = False
chunk = torch.ones(2, 5, 5, dtype=torch.bool).tril()
chunk[0, 2] = False
cache = torch.randn(2, 2, 3, 16)
chunk_cached = torch.ones(2, 5, 8, dtype=torch.bool)
chunk_cached[1, 3] = False
'''

_RUN = _INPUTS + '''
m = MultiHeadedAttention().eval()
out = (*m(x, x, x), *m(x, x, x, pad), *m(x, x, x, chunk), *m(x, x, x, chunk_cached, cache=cache))
leaves = [x]
'''

_REL_RUN = _INPUTS + '''
m = RelPositionMultiHeadedAttention().eval()
pos = torch.randn(1, 5, 16)
pos_cached = torch.randn(1, 8, 16)
out = (*m(x, x, x, pos_emb=pos), *m(x, x, x, pad, pos), *m(x, x, x, chunk, pos),
       *m(x, x, x, chunk_cached, pos_cached, cache=cache))
leaves = [x, m.pos_bias_u]
'''


@pytest.fixture
def garbage_on_fully_masked_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulated op gives 7.0 on rows whose every key is masked (spec 5.1 leaves that value open): a rewrite that
    does not zero them itself differs from the original there."""
    import npufuse.emulate.attention as emulated

    real = emulated._attend

    def unspecified_rows(*args, **kwargs):
        out, row_max, row_sum = real(*args, **kwargs)
        keep = kwargs.get("keep")
        if keep is not None:
            out = out.masked_fill(~keep.any(-1, keepdim=True), 7.0)
        return out, row_max, row_sum

    monkeypatch.setattr(emulated, "_attend", unspecified_rows)


def _runs(code: str, run: str, qualnames: list[str], calls: int) -> list:
    findings, _ = detect_all(AttentionPattern(), code)
    assert sorted(f.qualname for f in findings) == sorted(qualnames), findings
    facts = check_rewrite_runs(AttentionPattern(), code, run, findings)
    assert facts["calls"] == calls, facts["all_calls"]
    assert [a == b for a, b in facts["shapes"]] == [True] * len(facts["shapes"])
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999, facts
    return findings


def test_zeroed_masked_branch_under_the_mask_test_is_fused(garbage_on_fully_masked_rows: None) -> None:
    findings = _runs(_WENET, _RUN, ["MultiHeadedAttention.forward"], 4)
    (f,) = findings
    assert "_npufuse_rows = _npufuse_mask.all(-1, keepdim=True)" in f.fused
    assert "if mask.size(2) > 0 else None" in f.fused  # the sentinel: no mask, nothing zeroed
    assert f.fused.startswith("if type(self).forward_attention is not MultiHeadedAttention.forward_attention:\n")
    assert f.line == _WENET.splitlines().index(
        "        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)") + 1


def test_mask_is_not_none_form_fuses_its_masked_branch_too(garbage_on_fully_masked_rows: None) -> None:
    # espnet / FunASR SANM: ``if mask is not None`` instead of the sentinel; before s46b only mask=None was fused
    code = _WENET.replace("if mask.size(2) > 0:", "if mask is not None:")
    run = _RUN.replace("*m(x, x, x), ", "*m(x, x, x, None), ")
    _runs(code, run, ["MultiHeadedAttention.forward"], 4)


def test_inherited_helper_with_a_position_term_is_fused(garbage_on_fully_masked_rows: None) -> None:
    code = _WENET + _REL_POS
    findings = _runs(code, _REL_RUN, ["MultiHeadedAttention.forward", "RelPositionMultiHeadedAttention.forward"], 4)
    rel = next(f for f in findings if f.qualname.startswith("RelPosition"))
    assert "pse=_npufuse_pse" in rel.fused and "scale=1.0" in rel.fused  # q pre-scaled: either pse placement agrees
    assert rel.fused.startswith("if type(self).forward_attention is not MultiHeadedAttention.forward_attention:\n")


def test_inherited_helper_runs_with_pse_added_after_the_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    # spec 5.1 / 14: pse placement is UNCERTAIN; the rewrite passes scale 1.0, so both placements agree
    import npufuse.emulate.attention as emulated

    real = emulated._attend
    monkeypatch.setattr(emulated, "_attend", lambda *a, **kw: real(*a, **{**kw, "pse_before_scale": False}))
    _runs(_WENET + _REL_POS, _REL_RUN, ["MultiHeadedAttention.forward", "RelPositionMultiHeadedAttention.forward"], 4)


_OVERRIDE = '''

class TemperedAttention(MultiHeadedAttention):
    def forward_attention(self, value, scores, mask=torch.ones((0, 0, 0), dtype=torch.bool)):
        return super().forward_attention(value, scores * 0.5, mask)
'''


def test_a_subclass_overriding_the_helper_runs_the_call_as_written() -> None:
    run = _RUN + '''
t = TemperedAttention().eval()
t.load_state_dict(m.state_dict())
out = (*out, *t(x, x, x), *t(x, x, x, pad))
'''
    # the base instance's four calls fuse; the subclass's call goes to its own helper (the check is false there)
    _runs(_WENET + _OVERRIDE, run, ["MultiHeadedAttention.forward"], 4)


_NEAR_MISSES = {
    # the zeroing reads another mask than the -inf fill: it would zero kept positions
    "zeroes_another_mask": ("attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)",
                            "attn = torch.softmax(scores, dim=-1).masked_fill(mask.transpose(-2, -1), 0.0)",
                            "not the mask the scores were masked with"),
    # a second mask term (a causal triangle) beside the zeroed one: rows it alone empties are not the zeroed rows
    "beside_a_second_mask": ("            scores = scores.masked_fill(mask, -float('inf'))\n",
                             "            scores = scores.masked_fill(mask, -float('inf'))\n"
                             "            scores = scores.masked_fill(torch.ones(scores.size(-2), scores.size(-1), dtype=torch.bool, "
                             "device=scores.device).triu(1), -float('inf'))\n",
                             "beside other mask terms"),
    # the probabilities kept on the module (espnet's ``self.attn``, read by attention plots)
    "keeps_the_probabilities": ("        p_attn = self.dropout(attn)\n",
                                "        self.attn = attn\n        p_attn = self.dropout(attn)\n",
                                "the fused op does not materialise them"),
}


@pytest.mark.parametrize("variant", sorted(_NEAR_MISSES))
def test_split_attention_near_misses(variant: str) -> None:
    old, new, reason = _NEAR_MISSES[variant]
    code = _WENET.replace(old, new)
    assert code != _WENET
    findings, misses = detect_all(AttentionPattern(), code)
    assert findings == [], findings
    # said at the caller, whose reading inlines the helper (the helper alone keeps its own "made by a caller" reason)
    assert any(m.qualname == "MultiHeadedAttention.forward" and "inlined at line" in m.reason and reason in m.reason
               for m in misses), [m.reason for m in misses]


def test_a_class_nested_in_a_function_is_not_inlined() -> None:
    # no module-level name for the run-time check that the helper called is the one inlined
    body = _WENET.split("class MultiHeadedAttention(nn.Module):\n", 1)[1]
    code = _WENET.split("class MultiHeadedAttention", 1)[0] + "def build():\n    class MultiHeadedAttention(nn.Module):\n" + \
        "".join("    " + ln if ln.strip() else ln for ln in body.splitlines(keepends=True)) + "    return MultiHeadedAttention\n"
    findings, _ = detect_all(AttentionPattern(), code)
    assert findings == [], findings


def test_a_subclass_of_two_bases_does_not_inline_the_inherited_helper() -> None:
    # with two bases the method resolution order is not read: which class's helper runs is not decided
    code = _WENET + _REL_POS.replace("class RelPositionMultiHeadedAttention(MultiHeadedAttention):",
                                     "class Mixin:\n    pass\n\n\nclass RelPositionMultiHeadedAttention(Mixin, MultiHeadedAttention):")
    findings, misses = detect_all(AttentionPattern(), code)
    assert [f.qualname for f in findings] == ["MultiHeadedAttention.forward"], findings
