"""s44 audit fixes (audit44): the classes behind the wrong / dubious candidates and the false near-miss reasons of this
session's precision audit on 14 repositories new to npufuse (bench/audit_s44_precision.json,
bench/audit_s44_near_misses.json).

W1 attention (GPTQModel's DeepSeek-VL2 compat ``LlamaAttention.forward``): ``output_attentions =
   kwargs.pop("output_attentions", False)`` then ``if output_attentions: <eager, returns the weights> else:
   attn_weights = None; <sdpa>``. The eager arm was fused and returned None weights to every caller that asked for
   them; the s38 rule read only parameters as the caller's flag. A flag popped from the function's ``**kwargs`` is one.
D1 rope (OpenDiT / Vchitect ``apply_rotary_emb``): ``view_as_real(xc * f).flatten(3)`` with the rank-free pairs view
   ``reshape(*x.shape[:-1], -1, 2)``: on 3-D tokens ``[T, N, D]`` (tables ``[T, 1, D/2]``) the fused branch returned
   ``[T, N, D]`` where the original returns ``[T, N, D/2, 2]`` (flatten(3) of a 4-D view is a no-op). A literal
   flatten(3) now fuses only where x is 4-D.
R1 affinity_where (CogACT's guided-diffusion ``_vb_terms_bpd``): "branch `decoder_nll` computes `mean_flat(..) /
   np.log(2.0)`, which can be inf/NaN": a math / numpy function of positive literals is a nonzero finite constant.
D2 affinity_where (granite-tsfm PatchTST-FM ``forward``): ``torch.where(pred_mask | pad_mask | miss_mask, zeros_like(x), x)``
   became lerp; time-series code keeps missing observations as NaN, which lerp propagates. A condition reading a mask
   named for missing values (``miss_mask``, ``nan_mask``) is a guard: a near miss.
D3 affinity_where (GPTQModel EXL3 ``unpack_bf``): ``torch.where(m, torch.tensor(-1.0, dtype=fp16), torch.tensor(1.0, ..))``:
   0-d CPU tensors beside a device condition, which torch.where takes and torch.lerp does not on every version.
R2 affinity_where (GPTQModel ``_compute_scale_inv``): the reason quoted `torch.full_like(abs_max, float(fp8_max))`,
   the first 40 characters of the branch, as if it were the whole branch (a constant fill is never inf); the quote
   now holds the division (``/ abs_max.clamp_min(eps)``, which overflows to inf at abs_max = 0) or ends in an ellipsis.
"""

from __future__ import annotations

from npufuse.patterns.affinity_where import AffinityWhere
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.rope import RopePattern
from pattern_harness import check_rewrite_runs, detect_all

_KWARGS_FLAG = '''\
import torch


class CompatAttention(torch.nn.Module):
    def forward(self, hidden_states, attention_mask=None, **kwargs):
        output_attentions = kwargs.pop("output_attentions", False)
        q = self.q_proj(hidden_states).view(2, -1, 8, 64).transpose(1, 2)
        k = self.k_proj(hidden_states).view(2, -1, 8, 64).transpose(1, 2)
        v = self.v_proj(hidden_states).view(2, -1, 8, 64).transpose(1, 2)
        if output_attentions:
            attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
            if attention_mask is not None:
                attn_weights = attn_weights + attention_mask
            attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
            attn_output = torch.matmul(attn_weights, v)
        else:
            attn_weights = None
            attn_output = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(attn_output.transpose(1, 2).reshape(2, -1, 512)), attn_weights
'''

# the twin: the same arms chosen by a configuration attribute the caller does not pass stay a candidate
_CONFIG_FLAG = _KWARGS_FLAG.replace('kwargs.pop("output_attentions", False)', "self.config.use_eager_attention")


def test_w1_eager_arm_under_a_kwargs_flag_is_a_near_miss() -> None:
    findings, misses = detect_all(AttentionPattern(), _KWARGS_FLAG)
    assert not findings, [f.line for f in findings]
    assert any("runs only where `output_attentions` is true" in m.reason for m in misses), [m.reason for m in misses]


def test_w1_twin_config_flag_stays_a_candidate() -> None:
    findings, _ = detect_all(AttentionPattern(), _CONFIG_FLAG)
    assert len(findings) == 1


_COMPLEX_FLATTEN3 = '''\
import torch


def apply_rotary_emb(x, freqs_cis):
    x_rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    x_out = torch.view_as_real(x_rotated * freqs_cis).flatten(3)
    return x_out.type_as(x)


def tokens():
    torch.manual_seed(0)
    x = torch.randn(16, 4, 64)
    f = torch.polar(torch.ones(16, 32), torch.randn(16, 32))[:, None]
    return apply_rotary_emb(x, f)


def batched():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 4, 64)
    f = torch.polar(torch.ones(16, 32), torch.randn(16, 32))[:, None]
    return apply_rotary_emb(x, f)
'''


def test_d1_flatten3_keeps_3d_tokens_on_the_original() -> None:
    findings, _ = detect_all(RopePattern(), _COMPLEX_FLATTEN3)
    assert len(findings) == 1
    got = check_rewrite_runs(RopePattern(), _COMPLEX_FLATTEN3, "out = tokens()", findings)
    # flatten(3) of the [T, N, D/2, 2] view is a no-op: the original shape, and no fused call
    assert got["shapes"] == [((16, 4, 32, 2), (16, 4, 32, 2))] and got["calls"] == 0, got


def test_d1_twin_flatten3_of_4d_x_is_fused() -> None:
    findings, _ = detect_all(RopePattern(), _COMPLEX_FLATTEN3)
    got = check_rewrite_runs(RopePattern(), _COMPLEX_FLATTEN3, "out = batched()", findings)
    assert got["calls"] == 1 and got["shapes"] == [((2, 16, 4, 64), (2, 16, 4, 64))] and min(got["cos_out"]) > 0.9999, got


_CONSTANT_DIVISOR = '''\
import numpy as np
import torch as th


def mean_flat(t):
    return t.mean(dim=list(range(1, len(t.shape))))


def vb_terms(decoder_nll, kl, t):
    kl = mean_flat(kl) / np.log(2.0)
    decoder_nll = mean_flat(decoder_nll) / np.log(2.0)
    output = th.where((t == 0), decoder_nll, kl)
    return output
'''

# the twin: a logarithm of a tensor in the branch is still a guarded computation
_LOG_OF_TENSOR = _CONSTANT_DIVISOR.replace("mean_flat(decoder_nll) / np.log(2.0)", "th.log(mean_flat(decoder_nll))")


def test_r1_constant_math_divisor_is_no_guarded_computation() -> None:
    findings, misses = detect_all(AffinityWhere(), _CONSTANT_DIVISOR)
    assert len(findings) == 1 and not misses, [m.reason for m in misses]


def test_r1_twin_log_of_a_tensor_stays_a_near_miss() -> None:
    findings, misses = detect_all(AffinityWhere(), _LOG_OF_TENSOR)
    assert not findings and any("computes `torch.log(mean_flat(decoder_nll))`" in m.reason for m in misses), [m.reason for m in misses]


_CLAMPED_QUOTIENT = '''\
import torch


def compute_scale_inv(abs_max: torch.Tensor, fp8_max: float) -> torch.Tensor:
    abs_max = abs_max.to(torch.float32)
    eps = torch.finfo(torch.float32).tiny
    return torch.where(
        abs_max > 0,
        torch.full_like(abs_max, float(fp8_max)) / abs_max.clamp_min(eps),
        torch.ones_like(abs_max),
    )
'''


def test_r2_reason_quotes_the_whole_division() -> None:
    _, misses = detect_all(AffinityWhere(), _CLAMPED_QUOTIENT)
    assert len(misses) == 1
    assert "computes `torch.full_like(abs_max, float(fp8_max)) / abs_max.clamp_min(eps)`" in misses[0].reason, misses[0].reason


_MISSING_MASK = '''\
import torch


def forward(x_target, pred_mask, pad_mask, miss_mask):
    ts_mask = pred_mask | pad_mask | miss_mask
    x_input = torch.where(ts_mask, torch.zeros_like(x_target), x_target)
    return x_input
'''

# the twin: a padding / prediction mask alone says nothing of missing values: a candidate
_PAD_MASK = _MISSING_MASK.replace("pred_mask | pad_mask | miss_mask", "pred_mask | pad_mask")


def test_d2_mask_of_missing_values_is_a_near_miss() -> None:
    findings, misses = detect_all(AffinityWhere(), _MISSING_MASK)
    assert not findings and any("`miss_mask`, a mask of missing values" in m.reason for m in misses), [m.reason for m in misses]


def test_d2_twin_padding_mask_stays_a_candidate() -> None:
    findings, _ = detect_all(AffinityWhere(), _PAD_MASK)
    assert len(findings) == 1


_HOST_SCALARS = '''\
import torch


def unpack_bf(bits):
    expanded = bits.unsqueeze(-1) > 0
    expanded = torch.where(expanded, torch.tensor(-1.0, dtype=torch.float16), torch.tensor(1.0, dtype=torch.float16))
    return expanded
'''

# the twin: the same 0-d tensors made on the condition's device stay a candidate
_DEVICE_SCALARS = _HOST_SCALARS.replace("dtype=torch.float16)", "dtype=torch.float16, device=bits.device)")


def test_d3_cpu_scalar_tensor_branch_is_a_near_miss() -> None:
    findings, misses = detect_all(AffinityWhere(), _HOST_SCALARS)
    assert not findings and any("built on the CPU (no device=)" in m.reason for m in misses), [m.reason for m in misses]


def test_d3_twin_device_scalar_tensors_stay_a_candidate() -> None:
    findings, _ = detect_all(AffinityWhere(), _DEVICE_SCALARS)
    assert len(findings) == 1
