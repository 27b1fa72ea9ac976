"""s40 audit fixes (audit40): the classes behind the WRONG candidates, the dead switches and the false near-miss
reasons of this session's precision audit (bench/audit_s40_precision.json, bench/audit_s40_near_misses.json; 14
repositories new to npufuse).

W1 affinity_index_put: ``mask_indices = [k for k in range(n) if random.random() < 0.1]`` then
   ``x[mask_indices] = 0`` (tango's classifier-free-guidance drop, 9 sites): the rewrite tested
   ``_npufuse_mask.dtype`` on a list (AttributeError). A list index is a near miss, and a mask of unknown type
   is tested with ``isinstance(.., torch.Tensor)`` before its dtype.
W2 attention: an einsum written with ``...`` fixes no rank; LLaVA-NeXT's perceiver feeds it 5-D tensors, which the
   4-D BNSD call rejects. The ranks are checked at run time.
W3 attention: heads folded into the batch (``F.multi_head_attention_forward`` copies, DINO): a mask applied to the
   3-D ``[B*N, Sq, Skv]`` scores was passed as it was (3-D, rejected by the op) or combined with the padding mask
   of the 4-D view by broadcasting (``[B,1,1,S] | [1,T,S]`` -> ``[B, B*N, T, S]``). Each term is folded first.
D1 every pattern (switch): a repo flag the site's own branch requires off (``if not self.use_ft_flash_attn:``, the
   ``else`` of ``if flag:``) was reused as the site's switch: the fused branch could never run (HLLM, 4 sites).
R1 affinity_index_put (reason): ``row[ATTENTION_MASK_KEY] = ...`` (a dict key, open-instruct) was reported as a
   masked assignment; ``tokenizer.convert_tokens_to_ids(..)`` was called "a tensor".
R2 attention (reason): Phi's keys go through ``repeat_kv`` and then ``.to(torch.float32)`` in the product: "GQA
   on one of them only" was false (also found by audit38 on Show-o).
R3 rms_norm (reason): ``w / (n ** 0.5 + 1)`` (FasterViT's step size) was called "eps outside the sqrt" of a norm.
"""

from __future__ import annotations

from npufuse.patterns.affinity_index_put import AffinityIndexPut
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.base import Keep
from npufuse.patterns.rms_norm import RmsNorm
from npufuse.scan import repo_search
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import check_keep_refused, check_rewrite_runs, detect_all

# -- W1: a Python list as the index

_LIST_INDEX = '''
import random
import torch


def drop_text(encoder_hidden_states, prompt):
    mask_indices = [k for k in range(len(prompt)) if random.random() < 0.1]
    if len(mask_indices) > 0:
        encoder_hidden_states[mask_indices] = 0
    return encoder_hidden_states
'''

_TENSOR_PARAM_MASK = '''
import torch


def drop_text(encoder_hidden_states, mask_indices):
    encoder_hidden_states[mask_indices] = 0
    return encoder_hidden_states
'''


def test_a_python_list_index_is_a_near_miss() -> None:
    check_keep_refused(AffinityIndexPut(), Keep(_LIST_INDEX, reason="is a Python list"))
    _, misses = detect_all(AffinityIndexPut(), _LIST_INDEX)
    assert any("Python list (line 7)" in m.reason for m in misses)


def test_a_mask_of_unknown_type_is_tested_as_a_tensor_before_its_dtype() -> None:
    findings, _ = detect_all(AffinityIndexPut(), _TENSOR_PARAM_MASK)
    assert len(findings) == 1
    facts = check_rewrite_runs(AffinityIndexPut(), _TENSOR_PARAM_MASK, "x = torch.randn(4, 3)\nout = drop_text(x, [0, 2])", findings)
    assert "isinstance(_npufuse_mask, torch.Tensor) and _npufuse_mask.dtype == torch.bool" in facts["rewritten"]
    assert facts["cos_out"][0] > 0.999999  # a list of positions runs the original IndexPut (no AttributeError)
    facts = check_rewrite_runs(AffinityIndexPut(), _TENSOR_PARAM_MASK,
                               "x = torch.randn(4, 3)\nout = drop_text(x, torch.tensor([True, False, True, False]))", findings)
    assert facts["cos_out"][0] > 0.999999


# -- W2: an einsum with `...` fixes no rank

_ELLIPSIS_EINSUM = '''
import torch
from torch import nn, einsum


class PerceiverAttention(nn.Module):
    def __init__(self, dim, heads=2, dim_head=8):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * heads * dim_head, bias=False)

    def forward(self, x, latents):
        q = self.to_q(latents)
        k, v = self.to_kv(torch.cat((x, latents), dim=-2)).chunk(2, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).movedim(-2, 1) for t in (q, k, v))
        q = q * self.scale
        sim = einsum("... i d, ... j d -> ... i j", q, k)
        attn = sim.softmax(dim=-1)
        out = einsum("... i j, ... j d -> ... i d", attn, v)
        return out
'''


def test_an_ellipsis_einsum_checks_the_rank_at_run_time() -> None:
    findings, _ = detect_all(AttentionPattern(), _ELLIPSIS_EINSUM)
    assert len(findings) == 1
    run5 = "torch.manual_seed(0)\nm = PerceiverAttention(16)\nout = m(torch.randn(2, 3, 5, 16), torch.randn(2, 3, 4, 16))"
    facts = check_rewrite_runs(AttentionPattern(), _ELLIPSIS_EINSUM, run5, findings)
    assert "q.dim() == 4" in facts["rewritten"]
    assert facts["calls"] == 0 and facts["cos_out"][0] > 0.9999  # 5-D media tokens: the original code
    run4 = "torch.manual_seed(0)\nm = PerceiverAttention(16)\nout = m(torch.randn(2, 5, 16), torch.randn(2, 4, 16))"
    facts = check_rewrite_runs(AttentionPattern(), _ELLIPSIS_EINSUM, run4, findings)
    assert facts["calls"] >= 1 and facts["cos_out"][0] > 0.999  # 4-D: fused


# -- W3: heads folded into the batch, a mask on the 3-D scores beside a padding mask on the 4-D view

_MHA_FOLDED = '''
import torch
import torch.nn.functional as F


def mha_core(q, k, v, bsz, num_heads, attn_mask=None, key_padding_mask=None, dropout_p=0.0, training=False,
             need_weights=False):
    tgt_len, src_len = q.shape[1], k.shape[1]
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)
    attn_output_weights = torch.bmm(q, k.transpose(1, 2))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_output_weights.masked_fill_(attn_mask, float("-inf"))
        else:
            attn_output_weights += attn_mask
    if key_padding_mask is not None:
        attn_output_weights = attn_output_weights.view(bsz, num_heads, tgt_len, src_len)
        attn_output_weights = attn_output_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2), float("-inf"))
        attn_output_weights = attn_output_weights.view(bsz * num_heads, tgt_len, src_len)
    attn_output_weights = F.softmax(attn_output_weights, dim=-1)
    attn_output_weights = F.dropout(attn_output_weights, p=dropout_p, training=training)
    attn_output = torch.bmm(attn_output_weights, v)
    if need_weights:
        return attn_output, attn_output_weights
    return attn_output, None
'''

_MHA_SETUP = """
torch.manual_seed(0)
b, n, t, s, d = 2, 3, 5, 6, 8
q, k, v = torch.randn(b * n, t, d), torch.randn(b * n, s, d), torch.randn(b * n, s, d)
causal = torch.ones(t, s, dtype=torch.bool).triu(1)
pad = torch.zeros(b, s, dtype=torch.bool)
pad[1, -2:] = True
"""


def test_heads_in_batch_masks_are_folded_term_by_term() -> None:
    findings, _ = detect_all(AttentionPattern(), _MHA_FOLDED)
    assert len(findings) == 1
    for call in ("mha_core(q, k, v, b, n, attn_mask=causal)",  # a 2-D mask made [1, T, S]: 3-D on the bmm scores
                 "mha_core(q, k, v, b, n, attn_mask=causal, key_padding_mask=pad)",  # beside the view's padding mask
                 "mha_core(q, k, v, b, n, attn_mask=causal.expand(b * n, t, s).clone(), key_padding_mask=pad)",
                 "mha_core(q, k, v, b, n, key_padding_mask=pad)"):
        facts = check_rewrite_runs(AttentionPattern(), _MHA_FOLDED, _MHA_SETUP + f"out = {call}[0]", findings)
        assert facts["calls"] >= 1, call
        assert facts["shapes"] == [((6, 5, 8), (6, 5, 8))] and facts["cos_out"][0] > 0.9999, (call, facts["cos_out"])
    assert "_npufuse_fold(" in facts["rewritten"]


_MHA_ONE_MASK = _MHA_FOLDED.replace('''    if key_padding_mask is not None:
        attn_output_weights = attn_output_weights.view(bsz, num_heads, tgt_len, src_len)
        attn_output_weights = attn_output_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2), float("-inf"))
        attn_output_weights = attn_output_weights.view(bsz * num_heads, tgt_len, src_len)
''', '')


def test_a_single_three_d_mask_on_folded_heads_gains_the_head_axis() -> None:
    findings, _ = detect_all(AttentionPattern(), _MHA_ONE_MASK)
    assert len(findings) == 1
    for call in ("mha_core(q, k, v, b, n, attn_mask=causal)", "mha_core(q, k, v, b, n, attn_mask=causal.expand(b * n, t, s).clone())"):
        facts = check_rewrite_runs(AttentionPattern(), _MHA_ONE_MASK, _MHA_SETUP + f"out = {call}[0]", findings)
        assert facts["calls"] >= 1 and facts["cos_out"][0] > 0.9999, (call, facts["cos_out"])


# -- D1: a repo switch the site's own branch requires off

_OFF_BRANCH = '''
class Attention:
    def __init__(self, config):
        self.use_ft_flash_attn = config.use_ft_flash_attn

    def forward(self, x):
        if not self.use_ft_flash_attn:
            y = eager(x)
        else:
            y = flash(x)
        if self.use_ft_flash_attn:
            z = flash(x)
        else:
            z = eager(x)
        return y, z
'''


def test_a_switch_off_on_the_sites_path_is_not_reused() -> None:
    module = ModuleInfo.from_source("m.py", _OFF_BRANCH)
    scope = next(s for s in module.scopes if s.qualname.endswith("forward"))
    sw = {"name": "use_ft_flash_attn", "kind": "config_field", "file": "m.py", "line": 1}
    for line, off in ((8, True), (10, False), (14, True), (12, False)):
        ctx = repo_search.site_context(module, scope, line)
        switch, reused, notes = repo_search.choose_switch("attention", ctx, [sw], "auto", None)
        if off:
            assert reused is None and any("runs only where it is off" in n for n in notes), line
        else:
            assert reused is sw, line


# -- R1: dict keys and tokenizer values

_DICT_KEY = '''
import torch

ATTENTION_MASK_KEY = "attention_mask"


def tokenize_fn(row, tokenizer):
    row[ATTENTION_MASK_KEY] = [1] * len(row["input_ids"])
    return row
'''

_TOKENIZER_VALUE = '''
import torch


def mlm(data, tokenizer):
    indices_replaced = torch.bernoulli(torch.full(data.shape, 0.8)).bool()
    data[indices_replaced] = tokenizer.convert_tokens_to_ids(tokenizer.mask_token)
    return data
'''


def test_a_constant_dict_key_is_no_masked_assignment() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _DICT_KEY)
    assert not findings and not misses
    # an imported ALL_CAPS constant the function does not bind: the same
    findings, misses = detect_all(AffinityIndexPut(), _DICT_KEY.replace('ATTENTION_MASK_KEY = "attention_mask"', "from keys import ATTENTION_MASK_KEY"))
    assert not findings and not misses


def test_a_tokenizer_method_is_not_called_a_tensor() -> None:
    _, misses = detect_all(AffinityIndexPut(), _TOKENIZER_VALUE)
    assert len(misses) == 1 and "is not known to be a scalar" in misses[0].reason and "is a tensor" not in misses[0].reason


# -- R2: the repeat behind a dtype cast

_PHI_CAST = '''
import math
import torch
from torch import nn


class PhiAttention(nn.Module):
    def forward(self, query_states, key_states, value_states):
        key_states = torch.repeat_interleave(key_states, self.num_key_value_groups, dim=1)
        value_states = torch.repeat_interleave(value_states, self.num_key_value_groups, dim=1)
        attn_weights = torch.matmul(query_states.to(torch.float32), key_states.to(torch.float32).transpose(2, 3)) / math.sqrt(self.head_dim)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(value_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        return attn_output
'''


def test_a_cast_over_repeat_kv_is_named_as_such() -> None:
    _, misses = detect_all(AttentionPattern(), _PHI_CAST)
    assert len(misses) == 1
    assert "repeated (GQA) and then cast" in misses[0].reason and "one of them only" not in misses[0].reason


# -- R3: a root of a count is no norm

_STEP_SIZE = '''
import torch
from torch import nn


class FrozenNorm(nn.Module):
    def forward(self, x):
        rm = self.running_mean.reshape(1, -1, 1, 1)
        scale = w * (rv + eps).rsqrt()
        return x * scale + rm


class PosEmb(nn.Module):
    def forward(self, input_tensor, local_window_size):
        if not self.cached:
            n_global = input_tensor.shape[2] - local_window_size
            if n_global > 0 and self.correct:
                step = self.window_size[0] / (n_global ** 0.5 + 1)
                self.indices = [int((i + 1) * step) for i in range(4)]
        return input_tensor
'''

_EPS_OUTSIDE = '''
import torch
from torch import nn


class Norm(nn.Module):
    def forward(self, x):
        norm = x.pow(2).mean(-1, keepdim=True) ** 0.5
        return x / (norm + self.eps)
'''


def test_a_root_of_a_count_is_not_called_a_norm() -> None:
    _, misses = detect_all(RmsNorm(), _STEP_SIZE)
    assert not any("eps outside the sqrt" in m.reason for m in misses)
    # the root of a mean of squares with eps added after it keeps its reason
    findings, misses = detect_all(RmsNorm(), _EPS_OUTSIDE)
    assert not findings and any("eps outside the sqrt" in m.reason for m in misses), [m.reason for m in misses]
