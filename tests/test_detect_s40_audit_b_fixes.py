"""s40 second precision audit (audit40b): the classes behind the WRONG / dubious candidates found on 15 repositories
new to npufuse (bench/audit_s40b_precision.json: quantization, speech, video generation, 3-D, molecules, hybrid SSMs,
embedding and inference-engine code).

C1 sdpa: ``F.scaled_dot_product_attention(q, k, v, **attn_kwargs)`` with ``attn_kwargs = {"attn_mask": ..., "is_causal":
   ..., "scale": ...}`` (FastVideo's SDPA backend): the fused call dropped the splat, so mask, causality and scale were
   lost. A splat is now read: a dict carrying anything but ``enable_gqa`` (or one not visible here) is a near miss.
C2 rope: the complex form with a batch-free table was fused with no layout check, but npu_rotary_mul's interleave mode
   takes only 11SD / 1S1D / S11D tables: MatrixGame's per-head ``freqs_i`` [S, N, D/2] reached it. Now checked at run
   time (at most one leading dim of the table not 1), else the original.
C3 add_rms_norm: npu_add_rms_norm adds tensors of one shape; ``h = h + temb_proj(t)[:, None, :]`` then the norm (an
   addend that broadcasts) now takes the add, then the fused norm.
C4 rms_norm (numeric probe): ``x.pow(2).sum(-1) / self.mean_dim`` (QuaRot's RMSN) was proved with the constructor's
   width set to the feature size and fused unconditionally; the fused branch now checks ``self.mean_dim ==
   x.shape[-1]``.
"""

from __future__ import annotations

import torch

from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.base import Keep
from npufuse.patterns.rms_norm import RmsNorm
from npufuse.patterns.rope import RopePattern as Rope
from npufuse.patterns.sdpa import SdpaPattern
from pattern_harness import check_keep_refused, check_rewrite_runs, detect_all

# -- C1: keywords splatted into SDPA

_SDPA_SPLAT = '''
import torch
import torch.nn.functional as F


class SdpaBackend:
    def __init__(self, causal, softmax_scale, dropout_p=0.0):
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.dropout = dropout_p

    def forward(self, query, key, value, attn_mask=None):
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
{build}
        out = F.scaled_dot_product_attention(query, key, value, **attn_kwargs)
        return out.transpose(1, 2)
'''

_SPLAT_WITH_MASK = '''        attn_kwargs = {"attn_mask": attn_mask, "dropout_p": self.dropout, "is_causal": self.causal,
                       "scale": self.softmax_scale}
        if query.shape[1] != key.shape[1]:
            attn_kwargs["enable_gqa"] = True'''
_SPLAT_GQA_ONLY = '''        attn_kwargs = {}
        if query.shape[1] != key.shape[1]:
            attn_kwargs["enable_gqa"] = True'''


def test_sdpa_splat_carrying_the_mask_or_scale_is_a_near_miss() -> None:
    code = _SDPA_SPLAT.format(build=_SPLAT_WITH_MASK)
    check_keep_refused(SdpaPattern(), Keep(code, reason="`**attn_kwargs` passes attn_mask, dropout_p, is_causal, scale"))


def test_sdpa_splat_of_a_parameter_is_a_near_miss() -> None:
    code = '''
import torch.nn.functional as F


def attend(q, k, v, **sdpa_kwargs):
    return F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)
'''
    check_keep_refused(SdpaPattern(), Keep(code, reason="keywords passed through `**sdpa_kwargs` are not visible here"))


def test_sdpa_splat_of_enable_gqa_alone_stays_a_candidate() -> None:
    code = _SDPA_SPLAT.format(build=_SPLAT_GQA_ONLY)
    findings, _ = detect_all(SdpaPattern(), code)
    assert [f.pattern for f in findings] == ["sdpa"]
    q = "torch.randn(2, 8, 4, 16)"
    facts = check_rewrite_runs(SdpaPattern(), code, f"m = SdpaBackend(False, None)\nout = m.forward({q}, {q}, {q})\n", findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.9999


# -- C2: complex RoPE with a batch-free but per-head table

_COMPLEX_PER_HEAD = '''
import torch


def apply_rope(x, freqs_i):
    x_complex = torch.view_as_complex(x.to(torch.float32).reshape(x.shape[0], x.shape[1], x.shape[2], -1, 2))
    out = torch.view_as_real(x_complex * freqs_i.unsqueeze(0).to(x_complex.dtype)).flatten(3)
    return out.to(dtype=x.dtype)
'''

_COMPLEX_RUN = '''
def table(s, n, d):
    ang = torch.randn(s, n, d // 2)
    return torch.polar(torch.ones_like(ang), ang)

x = torch.randn(2, 6, 4, 16)
out = (apply_rope(x, table(6, 1, 16)), apply_rope(x, table(6, 4, 16)))
'''


def test_complex_rope_checks_the_table_has_one_leading_axis() -> None:
    findings, _ = detect_all(Rope(), _COMPLEX_PER_HEAD)
    assert [f.pattern for f in findings] == ["rope"]
    assert "sum(_c != 1 for _c in" in findings[0].fused
    # the per-position table [1, S, 1, D] is fused; the per-head one [1, S, N, D] (outside interleave mode's
    # 11SD / 1S1D / S11D) runs the original code (without the check the emulator rejects it)
    facts = check_rewrite_runs(Rope(), _COMPLEX_PER_HEAD, _COMPLEX_RUN, findings)
    assert facts["all_calls"].get("npu_rotary_mul") == 1
    assert min(facts["cos_out"]) > 0.9999


# -- C3: add + RMSNorm where the addend broadcasts

_ADD_BROADCAST = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Block(nn.Module):
    def __init__(self, d=16, t=8):
        super().__init__()
        self.temb_proj = nn.Linear(t, d)
        self.norm = RMSNorm(d)
        self.out = nn.Linear(d, d)

    def forward(self, h, temb):
        h = h + self.temb_proj(temb)[:, None, :]
        h = self.norm(h)
        return self.out(h)
'''


def test_add_rms_norm_with_a_broadcast_addend_adds_before_the_fused_norm() -> None:
    findings, _ = detect_all(AddRmsNorm(), _ADD_BROADCAST)
    assert [f.pattern for f in findings] == ["add_rms_norm"]
    run = ("m = Block()\nwith torch.no_grad():\n"
           "    out = (m(torch.randn(2, 5, 16), torch.randn(2, 8)), m(torch.randn(2, 1, 16), torch.randn(2, 8)))\n")
    facts = check_rewrite_runs(AddRmsNorm(), _ADD_BROADCAST, run, findings)
    # the broadcast call takes add + npu_rms_norm, the same-shape one npu_add_rms_norm
    assert facts["all_calls"].get("npu_rms_norm") == 1 and facts["all_calls"].get("npu_add_rms_norm") == 1
    assert min(facts["cos_out"]) > 0.9999


# -- C4: a probe-proved norm dividing by a width the constructor was given

_SUM_OVER_WIDTH = '''
import torch


class RMSN(torch.nn.Module):
    def __init__(self, mean_dim: int, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.mean_dim = mean_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        if x.dtype == torch.float16:
            x = x.to(torch.float32)
        variance = x.pow(2).sum(-1, keepdim=True) / self.mean_dim
        x = x * torch.rsqrt(variance + self.eps)
        return x.to(input_dtype)
'''


def test_probe_proved_norm_checks_the_constructor_width_is_the_last_dim() -> None:
    findings, _ = detect_all(RmsNorm(), _SUM_OVER_WIDTH)
    assert [f.params.get("found_by") for f in findings] == ["numeric_probe"]
    assert "self.mean_dim == x.shape[-1]" in findings[0].params["guards"]
    run = "x = torch.randn(2, 5, 16)\nout = (RMSN(16)(x), RMSN(32)(x))\n"
    facts = check_rewrite_runs(RmsNorm(), _SUM_OVER_WIDTH, run, findings)
    assert facts["all_calls"].get("npu_rms_norm") == 1  # RMSN(32) on 16 features keeps the original
    assert min(facts["cos_out"]) > 0.9999


# -- C5 (near-miss reasons): loops of a file that says "expert" elsewhere, admitted by their dispatch shape

from npufuse.patterns.moe_experts import MoeExperts  # noqa: E402

_FIRST_TOKEN_LOOP = '''
import torch

# the model's experts are configured elsewhere; this helper only finds the first image token


def first_positions(input_ids, token):
    firsts = []
    for seq in input_ids:
        hits = (seq == token).nonzero(as_tuple=True)[0]
        if len(hits) > 0:
            firsts.append(hits[0].item())
        else:
            firsts.append(0)
    return firsts
'''

_STATE_ALIAS_LOOP = '''
import torch

# an optimizer used with mixture-of-experts models


class Opt(torch.optim.Optimizer):
    def check_aliases(self, state):
        seen = {}
        for param_id, saved in state["state"].items():
            shared_id = id(self.state[param_id]["step"])
            if shared_id in seen and seen[shared_id] == param_id:
                continue
            seen[shared_id] = param_id
'''


def test_loop_naming_no_expert_is_not_called_an_expert_loop() -> None:
    findings, misses = detect_all(MoeExperts(), _FIRST_TOKEN_LOOP)
    assert not findings
    assert misses and not any("expert" in m.reason for m in misses), [m.reason for m in misses]
    assert any("conditional code inside the loop" in m.reason for m in misses)


def test_shared_id_is_not_a_shared_expert() -> None:
    findings, misses = detect_all(MoeExperts(), _STATE_ALIAS_LOOP)
    assert not findings
    assert not any("shared expert" in m.reason for m in misses), [m.reason for m in misses]


# -- C6 (near-miss reason): a product whose operand comes from a ``with`` block, with no softmax anywhere

from npufuse.patterns.attention import AttentionPattern  # noqa: E402

_ZERO_SHOT_LOGITS = '''
import torch


def evaluate(vision, dataloader, classifier, dtype):
    top1 = 0
    with torch.no_grad():
        for images, target in dataloader:
            with torch.no_grad():
                embeddings = vision(input_ids=images)["embedding"]
            logits = 100.0 * torch.matmul(embeddings.to(dtype), classifier)
            pred = logits.topk(5, 1, True, True)[1].t()
            top1 += pred.eq(target.view(1, -1).expand_as(pred))[:1].sum().item()
    return top1
'''

_PROBS_UNDER_NO_GRAD = '''
import torch


def attend(q, k, v):
    with torch.no_grad():
        p = torch.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1)
    return p @ v
'''


def test_matmul_without_softmax_is_no_attention_near_miss() -> None:
    findings, misses = detect_all(AttentionPattern(), _ZERO_SHOT_LOGITS)
    assert not findings and not any("attention probabilities" in m.reason for m in misses), [m.reason for m in misses]


def test_probabilities_under_a_context_stay_a_near_miss() -> None:
    check_keep_refused(AttentionPattern(), Keep(_PROBS_UNDER_NO_GRAD, reason="computed inside `with torch.no_grad():`"))


# -- C7 (near-miss reason): a child module's stacked expert weights are stacked, only not this module's

_CHILD_STACKED = '''
import torch
import torch.nn.functional as F
from torch import nn


class GroupedExperts(nn.Module):
    def __init__(self, n, d, h):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, h, d))
        self.w2 = nn.Parameter(torch.randn(n, d, h))
        self.w3 = nn.Parameter(torch.randn(n, h, d))


class SparseMoeBlock(nn.Module):
    def __init__(self, n=4, d=16, h=32):
        super().__init__()
        self.experts = GroupedExperts(n, d, h)

    def run_experts_for_loop(self, tokens, counts):
        splits = torch.split(tokens, counts.tolist(), dim=0)
        outputs = []
        for expert_index, expert_tokens in enumerate(splits):
            if expert_tokens.numel() == 0:
                continue
            hidden = F.silu(expert_tokens @ self.experts.w1[expert_index].transpose(-2, -1))
            hidden = hidden * (expert_tokens @ self.experts.w3[expert_index].transpose(-2, -1))
            outputs.append(hidden @ self.experts.w2[expert_index].transpose(-2, -1))
        return torch.cat(outputs, dim=0)
'''


def test_child_module_stacked_weight_reason_says_what_is_checked() -> None:
    findings, misses = detect_all(MoeExperts(), _CHILD_STACKED)
    reasons = [m.reason for m in misses]
    assert not findings
    assert not any("is not a stacked parameter indexed by the expert" in r for r in reasons), reasons


# -- C8 (near-miss reason): ``self.config.get(...)`` is a lookup, not an activation the config holds

from npufuse.patterns.swiglu import Swiglu  # noqa: E402

_CONFIG_LOOKUPS = '''
import torch


class TpModel:
    def __init__(self, config):
        self.config = config

    def init_rotary(self):
        if self.config.get("rope_scaling", {}) is None:
            factor = 1.0
        else:
            factor = self.config.get("rope_scaling", {}).get("factor", 1.0)
        n = self.config.get("max_position_embeddings", 2048)
        return n * factor
'''


def test_config_lookup_times_a_number_is_no_gated_product() -> None:
    findings, misses = detect_all(Swiglu(), _CONFIG_LOOKUPS)
    assert not findings and not misses, [m.reason for m in misses]


_EULER_STEP = '''
import torch


class FlowDenoisingStage(PipelineStage):
    def __init__(self, transformer, scheduler) -> None:
        self.scheduler = scheduler

    def forward(self, batch, latents, delta):
        for index, timestep in enumerate(self.scheduler.timesteps):
            flow = self.transformer.guided_flow(
                float(batch.guidance_scale),
            )
            # the exact Euler step of the published sampler
            latents = latents + delta * flow
        return latents
'''


def test_child_model_method_is_not_an_activation() -> None:
    findings, misses = detect_all(Swiglu(), _EULER_STEP)
    assert not findings and not misses, [m.reason for m in misses]


# -- C9 (near-miss reason): ``2 ** bits`` with an int ``bits`` cannot be inf/NaN

from npufuse.patterns.affinity_where import AffinityWhere  # noqa: E402

_TWO_COMPL = '''
import torch


def two_compl(x, bits: int):
    return torch.where(x < 0, 2 ** bits + x, x)
'''

_GUARDED_DIVISION = '''
import torch


def safe_ratio(x, d):
    return torch.where(d > 0, x / d, x)
'''


def test_power_of_a_literal_to_an_int_is_not_called_inf() -> None:
    findings, misses = detect_all(AffinityWhere(), _TWO_COMPL)
    assert not any("inf/NaN" in m.reason for m in misses), [m.reason for m in misses]
    # now a candidate: lerp for a float x (exact: 2 ** bits + x is finite), torch.where kept for an int x
    assert [f.variant for f in findings] == ["where_to_lerp"]
    run = "out = (two_compl(torch.randn(4, 8) * 8, 4), two_compl(torch.randint(-8, 8, (4, 8)), 4))\n"
    facts = check_rewrite_runs(AffinityWhere(), _TWO_COMPL, run, findings)
    assert min(facts["cos_out"]) > 0.9999 and facts["dtypes"][1] == (torch.int64, torch.int64)


def test_division_by_a_tensor_under_where_stays_a_near_miss() -> None:
    check_keep_refused(AffinityWhere(), Keep(_GUARDED_DIVISION, reason="which can be inf/NaN where it is not selected"))


# -- C10 (near-miss reason): a re-view of the probabilities is no modification of their values

_PROBS_REVIEWED = '''
import torch
import torch.nn.functional as F


def attend(q, k, v, batch_size, num_heads):
    scores = (q @ k.transpose(-1, -2)) / 8.0
    probs = F.softmax(scores, dim=-1)
    probs4 = probs.view(batch_size, num_heads, q.shape[1], k.shape[1])
    out = (probs4 @ v.view(batch_size, num_heads, -1, 64)).flatten(0, 1)
    return out
'''


def test_probabilities_re_viewed_are_not_called_modified() -> None:
    check_keep_refused(AttentionPattern(), Keep(_PROBS_REVIEWED, reason="the attention probabilities are re-viewed before P@V"))
