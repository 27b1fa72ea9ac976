"""s46 audit fixes (audit46): the classes behind the dead candidates and the false near-miss reasons of this session's
precision audit on 16 repositories new to npufuse (bench/audit_s46_precision.json, bench/audit_s46_near_misses.json).

D1 every pattern's contradicted-guard rule (the s45 judge's harmless extra, F5-like TTS ``models/dit.py``): the eager
   attention sits inside ``if return_attn_weights:``; the fused call needs ``not return_attn_weights``, so it could
   never run. The s38 rule compared the module's respelled tree (``scores.softmax(dim=-1)``) with the fallback as
   written (``torch.softmax(scores, dim=-1)``) and never matched: the fallback is now compared respelled too.
D2 sdpa / attention (auto-round's ``bench_sparse_topk.py``: ``F.scaled_dot_product_attention(nhd_to_hnd(q), ...)``):
   the device guard named ``nhd_to_hnd``, a function (no ``is_npu``): the fused branch never ran. It names the tensor.
R1 affinity_index_put (mmdet's ``show_result``): ``color_mask`` (``np.random.randint``) was called "a tensor not
   gathered with the mask"; it is a numpy array.
R2 affinity_index_put (trl's XPO): ``scores[m] -= self.args.penalty``: "the value is not a scalar" -> "not known to be".
R3 affinity_where (Theseus' SE2 ``exp_map``): ``(cosine - 1) / theta_nz`` with ``theta_nz = torch.where(small_theta,
   non_zero, theta)`` "can be inf/NaN"; the reason now says what npufuse does not show about that sanitised divisor.
"""

from __future__ import annotations

from npufuse.patterns.affinity_index_put import AffinityIndexPut
from npufuse.patterns.affinity_where import AffinityWhere
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.sdpa import SdpaPattern
from pattern_harness import detect_all

_ATTENTION_HEAD = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class MultiHeadAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x, return_attn_weights=False):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, -1, self.heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, -1, self.heads, self.head_dim).transpose(1, 2)
'''

_EAGER = '''\
scale = self.head_dim ** -0.5
scores = torch.matmul(q, k.transpose(-2, -1)) * scale
weights = torch.softmax(scores, dim=-1)
out = torch.matmul(weights, v)
out = out.transpose(1, 2).contiguous().view(B, T, -1)
'''


def _indented(text: str, depth: int) -> str:
    return "".join(" " * 4 * depth + line + "\n" for line in text.splitlines())


# the eager attention only inside the arm that returns the probabilities (the fused SDPA call after it)
_WEIGHTS_ARM = _ATTENTION_HEAD + "        if return_attn_weights:\n" + _indented(_EAGER, 3) + (
    "            return self.o_proj(out), weights\n"
    "        out = F.scaled_dot_product_attention(q, k, v)\n"
    "        out = out.transpose(1, 2).contiguous().view(B, T, -1)\n"
    "        return self.o_proj(out)\n")

# the twin: the eager attention runs for every call and the weights are returned only under the flag: the fused call
# runs where the flag is off (a run-time check), a candidate as before
_WEIGHTS_RETURNED_UNDER_FLAG = _ATTENTION_HEAD + _indented(_EAGER, 2) + (
    "        if return_attn_weights:\n"
    "            return self.o_proj(out), weights\n"
    "        return self.o_proj(out)\n")


def test_d1_eager_attention_inside_the_weights_arm_is_a_near_miss() -> None:
    findings, misses = detect_all(AttentionPattern(), _WEIGHTS_ARM)
    assert not findings, [f.fused for f in findings]
    assert any("requires `not return_attn_weights`, which is false in the taken arm of `if return_attn_weights:`" in m.reason
               and "could never run" in m.reason for m in misses), [m.reason for m in misses]


def test_d1_twin_weights_returned_under_the_flag_stays_a_candidate() -> None:
    findings, _ = detect_all(AttentionPattern(), _WEIGHTS_RETURNED_UNDER_FLAG)
    assert len(findings) == 1, findings
    assert "not return_attn_weights" in findings[0].fused


_SDPA_OF_A_CALL = '''\
import torch
import torch.nn.functional as F


def nhd_to_hnd(x):
    return x.transpose(1, 2).contiguous()


def dense(q_nhd, k_nhd, v_nhd):
    return F.scaled_dot_product_attention(nhd_to_hnd(q_nhd), nhd_to_hnd(k_nhd), nhd_to_hnd(v_nhd), is_causal=True)
'''


def test_d2_sdpa_device_guard_names_the_query_tensor_not_the_function() -> None:
    findings, _ = detect_all(SdpaPattern(), _SDPA_OF_A_CALL)
    assert len(findings) == 1, findings
    assert findings[0].guard_tensor == "q_nhd", findings[0].guard_tensor


def test_d2_attention_guard_skips_called_functions() -> None:
    assert AttentionPattern._guard("rearrange(q, 'b n (h d) -> b h n d', h=h)") == "q"
    assert AttentionPattern._guard("(q * scale).view(b * h, ch, t)") == "q"


_NUMPY_VALUE = '''\
import numpy as np
import pycocotools.mask as maskUtils
import torch


def show_result(img, segms, inds):
    img_show = img[:10, :10, :]
    for i in inds:
        color_mask = np.random.randint(0, 256, (1, 3), dtype=np.uint8)
        mask = maskUtils.decode(segms[i]).astype(np.bool)
        img_show[mask] = img_show[mask] * 0.5 + color_mask * 0.5
    return img_show
'''


def test_r1_numpy_operand_of_the_value_is_named_as_numpy() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _NUMPY_VALUE)
    assert not findings
    reasons = [m.reason for m in misses]
    assert any("`color_mask` in the value is a numpy array" in r for r in reasons), reasons
    assert not any("is a tensor not gathered" in r for r in reasons), reasons


_CONFIG_PENALTY = '''\
import torch


class Trainer:
    def rewards(self, scores, input_ids, eos_id):
        contains_eos = torch.any(input_ids == eos_id, dim=-1)
        scores[~contains_eos] -= self.args.missing_eos_penalty
        return scores
'''


def test_r2_configuration_value_is_not_said_to_be_no_scalar() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _CONFIG_PENALTY)
    assert not findings
    reasons = [m.reason for m in misses]
    assert any("the value is not known to be a scalar" in r for r in reasons), reasons
    assert not any("the value is not a scalar" in r for r in reasons), reasons


_SANITISED_DIVISOR = '''\
import torch


def exp_map(theta, cosine, eps):
    small_theta = theta.abs() < eps
    non_zero = torch.ones(1, dtype=theta.dtype, device=theta.device)
    theta3 = theta ** 3
    theta_nz = torch.where(small_theta, non_zero, theta)
    c = torch.where(small_theta, -theta / 2 + theta3 / 24, (cosine - 1) / theta_nz)
    return c
'''

# the twin: a plain divisor keeps the "can be inf/NaN" reason
_PLAIN_DIVISOR = _SANITISED_DIVISOR.replace("(cosine - 1) / theta_nz", "(cosine - 1) / theta")


def test_r3_sanitised_divisor_reason_says_what_is_not_shown() -> None:
    findings, misses = detect_all(AffinityWhere(), _SANITISED_DIVISOR)
    reasons = [m.reason for m in misses if m.line == 9]
    assert not [f for f in findings if f.line == 9]
    assert any("divides by `theta_nz` (`torch.where(small_theta, non_zero, theta)`)" in r
               and "the test `small_theta` replaces every zero of `theta`" in r
               for r in reasons), reasons
    assert not any("which can be inf/NaN" in r for r in reasons), reasons


def test_r3_twin_plain_divisor_keeps_the_inf_reason() -> None:
    _, misses = detect_all(AffinityWhere(), _PLAIN_DIVISOR)
    assert any(m.line == 9 and "which can be inf/NaN" in m.reason for m in misses), [m.reason for m in misses]


_SANITISED_IN_THE_ELSE = '''\
import torch


def reciprocal(t, scale):
    safe_t = torch.where(t != 0, t, torch.ones_like(t))
    return torch.where(t != 0, scale / safe_t, scale)
'''


def test_r3_stand_in_in_the_else_branch_names_the_kept_value() -> None:
    _, misses = detect_all(AffinityWhere(), _SANITISED_IN_THE_ELSE)
    reasons = [m.reason for m in misses]
    assert not any("which can be inf/NaN" in r for r in reasons), reasons
    assert not any("every zero of `torch.ones_like" in r for r in reasons), reasons


_NUMPY_SCALAR_VALUE = '''\
import numpy as np
import torch


def f0_to_coarse(f0, f0_bin=256, f0_max=900.0, f0_min=50.0):
    f0_mel_min = 1127 * np.log(1 + f0_min / 700)
    f0_mel_max = 1127 * np.log(1 + f0_max / 700)
    f0_mel = 1127 * (1 + f0 / 700).log()
    f0_mel[f0_mel > 0] = (f0_mel[f0_mel > 0] - f0_mel_min) * (f0_bin - 2) / (f0_mel_max - f0_mel_min) + 1
    return f0_mel
'''


def test_r1_twin_numpy_scalar_is_not_called_an_array() -> None:
    _, misses = detect_all(AffinityIndexPut(), _NUMPY_SCALAR_VALUE)
    assert not any("is a numpy array" in m.reason for m in misses), [m.reason for m in misses]
