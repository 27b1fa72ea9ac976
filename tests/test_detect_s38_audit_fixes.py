"""s38 audit fixes (audit38): the classes behind the WRONG candidates of this session's precision audit
(bench/audit_s38_precision.json; 13 repositories new to npufuse).

A1 sdpa: SDPA takes q/k/v of any rank, npu_fusion_attention 4-D only. 3-D [B*N, S, D] operands (DiffBIR's
   ``map(lambda t: ....reshape(b * heads, n, d), (q, k, v))``, its VAE's ``reshape(B, hw, C)``) were passed as
   BNSD: now one head ([B*N, 1, S, D]) when the code states 3-D, a run-time ``q.dim() == 4`` check when it
   states nothing, a near miss when it states another rank.
A2 affinity_index_put: a mask made by comparing (or doing arithmetic on) a tensor built on the CPU
   (RF2AA's ``torch.rand(B, L) < self.p_mask`` for a device ``state``) is a CPU mask: indexing takes it,
   masked_fill_ does not. Now placement-checked at run time like the bitwise-combined ones.
A3 attention: an eager block that runs only in the arm of ``if not output_attentions: ... weights = None
   else: <eager>`` (LLaVA's monkey-patched ``xformers_forward``) returns the probabilities to every caller
   that reaches it: a near miss, not a fused branch returning None.
A4 rms_norm: an epsilon read off an ``nn.Parameter`` (icefall / VoiceCraft ``BasicNorm``, ``learn_eps``)
   cannot go to npu_rms_norm's float ``epsilon``: a near miss; a buffer stays a candidate.
A5 attention: an einsum puts whichever batch-like axis it likes in the op's head position (RF2AA's
   ``bihd,bkid->bihk`` puts the residues there); npu_fusion_attention takes at most 256 heads: checked at
   run time, else the original runs.
"""

from __future__ import annotations

import pytest

from npufuse.patterns.affinity_index_put import AffinityIndexPut
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.base import Fuse, Keep
from npufuse.patterns.rms_norm import RmsNorm
from npufuse.patterns.sdpa import SdpaPattern
from pattern_harness import check_keep_refused, check_replacement_matches, check_rewrite_runs, detect_all

# -- A1: SDPA operands of a stated (or unstated) rank other than 4

_SDPA_MAP_3D = '''
import torch
import torch.nn.functional as F
from torch import nn


class CrossAttn(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.dim_head = heads, dim // heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x, context):
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        b, _, _ = q.shape
        q, k, v = map(
            lambda t: t.unsqueeze(3).reshape(b, t.shape[1], self.heads, self.dim_head).permute(0, 2, 1, 3)
            .reshape(b * self.heads, t.shape[1], self.dim_head).contiguous(),
            (q, k, v),
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return out.reshape(b, self.heads, -1, self.dim_head).transpose(1, 2).reshape(b, -1, self.heads * self.dim_head)
'''

_SDPA_3D_MASK = '''
import torch
import torch.nn.functional as F


def pixel_attention(x, keep, c=16):
    b = x.shape[0]
    q = x.reshape(b, -1, c)
    k = (x * 0.5).reshape(b, -1, c)
    v = (x + 1.0).reshape(b, -1, c)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
'''

_SDPA_UNSTATED = '''
import torch
import torch.nn.functional as F


def attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)
'''

_SDPA_5D = '''
import torch
import torch.nn.functional as F


def window_attend(x, heads=2):
    b, w, n, c = x.shape
    q = x.reshape(b, w, heads, n, c // heads)
    return F.scaled_dot_product_attention(q, q, q)
'''

SDPA_FUSE = [
    Fuse(_SDPA_MAP_3D, name="s38_map_lambda_reshape_to_three_d_runs_as_one_head", run='''
m = CrossAttn()
x = torch.randn(2, 6, 32, requires_grad=True)
ctx = torch.randn(2, 5, 32, requires_grad=True)
out = m(x, ctx)
leaves = [x, ctx, m.to_q.weight]
'''),
    Fuse(_SDPA_3D_MASK, name="s38_three_d_operands_with_a_per_batch_bool_mask", run='''
x = torch.randn(3, 4, 4, 16, requires_grad=True)
keep = torch.rand(3, 16, 16) > 0.3
keep[..., 0] = True
out = pixel_attention(x, keep)
leaves = [x]
'''),
]


@pytest.mark.parametrize("example", SDPA_FUSE, ids=lambda e: e.name)
def test_three_d_sdpa_operands_run_the_fused_branch_and_match(example: Fuse) -> None:
    check_replacement_matches(SdpaPattern(), example)
    (finding,) = detect_all(SdpaPattern(), example.code)[0]
    assert ".unsqueeze(1).contiguous()), 1, \"BNSD\"" in finding.fused.replace("\n", "").replace("        ", "")
    assert "q.dim() == 4" not in finding.fused  # the rank is stated: no run-time rank check


def test_an_unstated_rank_is_checked_and_a_three_d_call_runs_on_4d_views() -> None:
    findings, _ = detect_all(SdpaPattern(), _SDPA_UNSTATED)
    # s45: every operand of unstated rank; s51b: tested on the 4-D views (3-D operands lifted to [1, X, S, D])
    assert "if _npufuse_q4.dim() == _npufuse_k4.dim() == _npufuse_v4.dim() == 4 and " in findings[0].fused
    run = "q = torch.randn(2, 5, 8, requires_grad=True)\nout = attend(q, q * 0.5, q + 1)\nleaves = [q]\n"
    facts = check_rewrite_runs(SdpaPattern(), _SDPA_UNSTATED, run, findings)
    assert facts["calls"] == 1 and min(facts["cos_out"]) > 0.9999  # s51b: was 0 (the 3-D call ran the original)
    run4 = "q = torch.randn(2, 3, 5, 8, requires_grad=True)\nout = attend(q, q * 0.5, q + 1)\nleaves = [q]\n"
    assert check_rewrite_runs(SdpaPattern(), _SDPA_UNSTATED, run4, findings)["calls"] == 1


def test_a_stated_five_d_sdpa_merges_its_leading_dims_and_with_a_mask_is_a_near_miss() -> None:
    # s41 (misses41): without a mask the two leading dims merge into the op's batch (it was a near miss until s40)
    findings, _ = detect_all(SdpaPattern(), _SDPA_5D)
    assert len(findings) == 1 and "q.flatten(0, 1)" in findings[0].fused
    run = "x = torch.randn(2, 3, 5, 16, requires_grad=True)\nout = window_attend(x)\nleaves = [x]\n"
    facts = check_rewrite_runs(SdpaPattern(), _SDPA_5D, run, findings)
    assert facts["calls"] == 1 and min(facts["cos_out"]) > 0.9999
    masked = _SDPA_5D.replace("def window_attend(x, heads=2):", "def window_attend(x, m, heads=2):").replace("(q, q, q)", "(q, q, q, attn_mask=m)")
    check_keep_refused(SdpaPattern(), Keep(masked, reason="q/k/v are 5-D with an attn_mask"))


# -- A2: a mask compared off a CPU-built tensor

_HOST_RANDOM_MASK = '''
import torch
from torch import nn


class AtomEmbed(nn.Module):
    def __init__(self, d=8, p_mask=0.15):
        super().__init__()
        self.p_mask = p_mask
        self.proj = nn.Linear(d, d)

    def forward(self, state):
        B, L = state.shape[:2]
        mask = torch.rand({args}) < self.p_mask
        state = state.reshape(B, L, 1, -1).repeat(1, 1, 3, 1)
        state[mask] = 0.0
        return self.proj(state)
'''


def test_a_comparison_of_a_host_random_tensor_is_placement_checked() -> None:
    (finding,) = detect_all(AffinityIndexPut(), _HOST_RANDOM_MASK.format(args="B, L"))[0]
    assert finding.variant.endswith("_placement_checked")
    assert "_npufuse_mask.device == state.device" in finding.fused
    run = "m = AtomEmbed()\nx = torch.randn(2, 5, 8, requires_grad=True)\nout = m(x)\nleaves = [x]\n"
    facts = check_rewrite_runs(AffinityIndexPut(), _HOST_RANDOM_MASK.format(args="B, L"), run, [finding])
    assert min(facts["cos_out"]) > 0.9999


def test_the_same_draw_on_the_states_device_needs_no_placement_check() -> None:
    (finding,) = detect_all(AffinityIndexPut(), _HOST_RANDOM_MASK.format(args="B, L, device=state.device"))[0]
    assert not finding.variant.endswith("_placement_checked")


# -- A3: the eager block runs only where the caller asked for the weights

_ASKED_ONLY = '''
import math
import torch
from torch import nn


def fast_attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def patched_forward(self, hidden_states, output_attentions: bool = False):
    b, s, _ = hidden_states.shape
    q, k, v = self.qkv(hidden_states).view(b, s, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
    if not output_attentions:
        out = fast_attention(q, k, v)
        attn_weights = None
    else:
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, v)
    return out.transpose(1, 2).reshape(b, s, -1), attn_weights


class Block(nn.Module):
    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)


Block.forward = patched_forward
'''

_NULLED_AFTER = '''
import math
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, hidden_states, output_attentions: bool = False):
        b, s, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, s, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, v)
        if not output_attentions:
            attn_weights = None
        return out.transpose(1, 2).reshape(b, s, -1), attn_weights
'''


def test_an_eager_arm_taken_only_when_weights_are_asked_is_a_near_miss() -> None:
    check_keep_refused(AttentionPattern(), Keep(_ASKED_ONLY, reason="the site runs only where `output_attentions` is true"))


def test_the_hf_form_that_nulls_the_weights_after_the_site_still_fuses() -> None:
    findings, _ = detect_all(AttentionPattern(), _NULLED_AFTER)
    assert findings and "output_attentions" in findings[0].fused.splitlines()[0]


# -- A4: a learned epsilon

_BASIC_NORM = '''
import torch
from torch import nn


class BasicNorm(nn.Module):
    def __init__(self, num_channels, eps=0.25, learn_eps=True):
        super().__init__()
        self.num_channels = num_channels
        if learn_eps:
            {learned}
        else:
            self.register_buffer("eps", torch.tensor(eps).log().detach())

    def forward(self, x):
        eps = self.eps
        scales = (torch.mean(x ** 2, dim=-1, keepdim=True) + eps.exp()) ** -0.5
        return x * scales
'''


def test_an_epsilon_that_is_a_parameter_is_a_near_miss() -> None:
    code = _BASIC_NORM.format(learned='self.eps = nn.Parameter(torch.tensor(eps).log().detach())')
    check_keep_refused(RmsNorm(), Keep(code, reason="an nn.Parameter"))


def test_an_epsilon_buffer_stays_a_candidate() -> None:
    code = _BASIC_NORM.format(learned='self.register_buffer("eps", torch.tensor(eps).log().detach())')
    findings, misses = detect_all(RmsNorm(), code)
    assert findings, [m.reason for m in misses]


# -- A5: the einsum's head axis against the op's 256-head limit

_COLUMN_GLOBAL = '''
import torch
import torch.nn.functional as F
from torch import einsum, nn


class ColumnGlobalAttention(nn.Module):
    def __init__(self, d_msa=16, heads=4, dim=8):
        super().__init__()
        self.h, self.dim = heads, dim
        self.to_q = nn.Linear(d_msa, heads * dim)
        self.to_k = nn.Linear(d_msa, dim)
        self.to_v = nn.Linear(d_msa, dim)
        self.scaling = dim ** -0.5

    def forward(self, msa):
        B, N, L = msa.shape[:3]
        query = self.to_q(msa).reshape(B, N, L, self.h, self.dim).mean(dim=1)
        key = self.to_k(msa)
        value = self.to_v(msa)
        query = query * self.scaling
        attn = einsum('bihd,bkid->bihk', query, key)
        attn = F.softmax(attn, dim=-1)
        out = einsum('bihk,bkid->bihd', attn, value).reshape(B, 1, L, -1)
        return out
'''


@pytest.mark.parametrize("length,fused", [(12, 1), (300, 0)])
def test_an_einsum_head_axis_over_256_runs_the_original(length: int, fused: int) -> None:
    findings, misses = detect_all(AttentionPattern(), _COLUMN_GLOBAL)
    assert findings, [m.reason for m in misses]
    assert "query.shape[1] <= 256" in findings[0].fused
    run = f"m = ColumnGlobalAttention()\nmsa = torch.randn(1, 3, {length}, 16, requires_grad=True)\nout = m(msa)\nleaves = [msa]\n"
    facts = check_rewrite_runs(AttentionPattern(), _COLUMN_GLOBAL, run, findings)
    # the emulator rejects head_num > 256 as the op does: without the check the long case fails
    assert facts["calls"] == fused and min(facts["cos_out"]) > 0.9999


# -- A6 (audit38's dubious): an eager method its SDPA subclass falls back to when the weights are asked for

_EAGER_WITH_SDPA_SUBCLASS = '''
import torch
from torch import nn


class EagerAttention(nn.Module):
    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, width // heads
        self.scale = self.hd ** -0.5
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, hidden_states, output_attentions=False):
        b, s, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, s, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scale
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v)
        return attn_output.transpose(1, 2).reshape(b, s, -1), attn_weights
{subclass}
'''

_SDPA_SUBCLASS = '''

class SdpaAttention(EagerAttention):
    def forward(self, hidden_states, output_attentions=False):
        if output_attentions:
            return super().forward(hidden_states=hidden_states, output_attentions=output_attentions)
        b, s, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, s, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(b, s, -1), None
'''


def test_the_eager_method_an_sdpa_subclass_falls_back_to_is_gated_on_the_flag() -> None:
    code = _EAGER_WITH_SDPA_SUBCLASS.format(subclass=_SDPA_SUBCLASS)
    findings, misses = detect_all(AttentionPattern(), code)
    (finding,) = [f for f in findings if f.qualname == "EagerAttention.forward"]
    assert "not output_attentions" in finding.fused.splitlines()[0]
    run = '''
m = EagerAttention()
x = torch.randn(2, 5, 32, requires_grad=True)
plain, weights = m(x, output_attentions=True)
out = (m(x)[0], plain, weights)
leaves = [x, m.qkv.weight]
'''
    facts = check_rewrite_runs(AttentionPattern(), code, run, [finding])
    # the flagged call keeps the original (its weights are a tensor, not None); the plain one is fused
    assert facts["calls"] == 1 and facts["n_out"][0] == facts["n_out"][1] == 3 and min(facts["cos_out"]) > 0.9999


def test_without_such_a_subclass_returned_weights_stay_a_near_miss() -> None:
    # nothing shows when callers want the weights: the probabilities returned keep it a near miss
    check_keep_refused(AttentionPattern(), Keep(_EAGER_WITH_SDPA_SUBCLASS.format(subclass=""), reason="are returned to the callers"))
