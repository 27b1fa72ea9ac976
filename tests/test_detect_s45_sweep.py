"""s45 recall sweep (helper sweep45): the classes behind the misses on bench/detect_labels_sweep45.json, seven
repositories labelled before npufuse was run on them (development data), and one HO21a dev miss.

A attention: a scale read back with ``.item()`` from a tensor made of Python numbers
   (``torch.sqrt(torch.FloatTensor([self.n_heads])).item()``, a BST recommender whose softmax is an ``nn.Softmax``
   attribute). Near miss: ``.item()`` of a learned tensor (``self.logit_scale.exp().item()``).
B rope: interleaved pairs cut with x's dims spelled from an unpacking of its shape
   (``b, s, h, d = q.shape``; ``q.reshape(b, s, h, d // 2, 2)``) and written into ``zeros_like(pairs)``.
   Near miss: a leading size that is not x's (``q.reshape(b, s, 4, d // 2, 2)`` with 4 a literal).
C rms_norm: the mean over ``tuple(range(-len(self.normalized_shape), 0))`` (the last len(shape) dims, fused where
   that is one dim). Near miss: ``range(-2, 0)``, two dims, never the last alone.
D add_rms_norm (HO21a MoE-LLM): a residual sum (one add per arm of a ReZero flag), then a checkpoint switch whose
   ``else`` normalises the sum in both arms of an ``isinstance`` fork. Near misses: a flag arm scaling the whole
   sum (``(residual + attn_out) * alpha``: no x1 + x2 left); a switch test that reads the sum.
"""

from __future__ import annotations

from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.rms_norm import RmsNorm
from npufuse.patterns.rope import RopePattern
from pattern_harness import detect_all, found_and_faithful


# -- A: a host-number scale read back with .item()

_ITEM_SCALE = '''
import torch
from torch import nn


class MultiHeadAttention(nn.Module):
    def __init__(self, att_dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.att_size = att_dim // n_heads
        self.q = nn.Linear(att_dim, att_dim, bias=False)
        self.k = nn.Linear(att_dim, att_dim, bias=False)
        self.v = nn.Linear(att_dim, att_dim, bias=False)
        self.activation = nn.Softmax(dim=-1)

    def forward(self, x, mask):
        scale_factor = torch.sqrt(torch.FloatTensor([self.n_heads])).item()
        b = x.size(0)
        q = self.q(x).view(b, -1, self.n_heads, self.att_size).transpose(1, 2)
        k = self.k(x).view(b, -1, self.n_heads, self.att_size).transpose(1, 2)
        v = self.v(x).view(b, -1, self.n_heads, self.att_size).transpose(1, 2)
        score = torch.matmul(q, k.transpose(-2, -1)) / scale_factor
        score = score.masked_fill(mask.unsqueeze(1) == 0, -1e9)
        score = self.activation(score)
        z = torch.matmul(score, v)
        return z.transpose(1, 2).reshape(b, -1, self.att_size * self.n_heads)
'''

_ITEM_SCALE_RUN = '''
attn = MultiHeadAttention(32, 4)
x = torch.randn(2, 6, 32, requires_grad=True)
mask = torch.tril(torch.ones(1, 6, 6, dtype=torch.uint8)).expand(2, 6, 6)
out = attn(x, mask)
leaves = [x]
'''


def test_a_host_number_scale_read_back_with_item_is_found_and_runs() -> None:
    findings = found_and_faithful(AttentionPattern(), _ITEM_SCALE, _ITEM_SCALE_RUN)
    assert [f.qualname for f in findings] == ["MultiHeadAttention.forward"]


def test_a_learned_scale_read_back_with_item_stays_a_near_miss() -> None:
    code = _ITEM_SCALE.replace(
        "scale_factor = torch.sqrt(torch.FloatTensor([self.n_heads])).item()",
        "scale_factor = self.logit_scale.exp().item()",
    ).replace("        self.activation = nn.Softmax(dim=-1)\n",
              "        self.activation = nn.Softmax(dim=-1)\n        self.logit_scale = nn.Parameter(torch.zeros(()))\n")
    findings, misses = detect_all(AttentionPattern(), code)
    assert findings == []
    assert any("learned / computed" in m.reason for m in misses)


# -- B: interleaved pairs cut with the dims unpacked from x.shape

_SPELLED_PAIRS = '''
import torch


def apply_rotary_pos_emb(q, k, cos, sin):
    b_q, s_q, h_q, d_q = q.shape
    b_k, s_k, h_k, d_k = k.shape
    q_pairs = q.reshape(b_q, s_q, h_q, d_q // 2, 2)
    k_pairs = k.reshape(b_k, s_k, h_k, d_k // 2, 2)
    q_out = torch.zeros_like(q_pairs)
    q_out[..., 0] = q_pairs[..., 0] * cos - q_pairs[..., 1] * sin
    q_out[..., 1] = q_pairs[..., 0] * sin + q_pairs[..., 1] * cos
    k_out = torch.zeros_like(k_pairs)
    k_out[..., 0] = k_pairs[..., 0] * cos - k_pairs[..., 1] * sin
    k_out[..., 1] = k_pairs[..., 0] * sin + k_pairs[..., 1] * cos
    return q_out.reshape(b_q, s_q, h_q, d_q), k_out.reshape(b_k, s_k, h_k, d_k)
'''

_SPELLED_PAIRS_RUN = '''
q = torch.randn(2, 5, 4, 8, requires_grad=True)
k = torch.randn(2, 5, 2, 8, requires_grad=True)
ang = torch.outer(torch.arange(5.0), 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))
cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
out = apply_rotary_pos_emb(q, k, cos, sin)
leaves = [q, k]
'''


def test_pairs_cut_with_unpacked_dims_are_found_and_run() -> None:
    findings = found_and_faithful(RopePattern(), _SPELLED_PAIRS, _SPELLED_PAIRS_RUN)
    assert [(f.qualname, f.line) for f in findings] == [("apply_rotary_pos_emb", 10), ("apply_rotary_pos_emb", 13)]


def test_pairs_cut_with_a_size_that_is_not_the_tensors_stay_unverified() -> None:
    code = _SPELLED_PAIRS.replace("q.reshape(b_q, s_q, h_q, d_q // 2, 2)", "q.reshape(b_q, s_q, 4, d_q // 2, 2)")
    findings, _ = detect_all(RopePattern(), code)
    assert [f.line for f in findings] == [13]  # k's rotation only: q's pairs are not proven q's own


# -- C: the trailing dims counted up to zero

_COUNTED_TO_ZERO = '''
import torch
import torch.nn as nn


class GatedRMSNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-8):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = normalized_shape
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(*normalized_shape))

    def forward(self, x, g):
        dims = tuple(range(-len(self.normalized_shape), 0))
        rms = torch.sqrt(torch.mean(x.pow(2), dim=dims, keepdim=True) + self.eps)
        x_hat = x / rms
        x_hat = x_hat * self.weight
        return x_hat * torch.sigmoid(g)
'''

_COUNTED_TO_ZERO_RUN = '''
norm = GatedRMSNorm(16)
with torch.no_grad():
    norm.weight.uniform_(0.5, 1.5)
x = torch.randn(2, 3, 16, requires_grad=True)
g = torch.randn(2, 3, 16)
out = norm(x, g)
leaves = [x]
'''


def test_trailing_dims_counted_to_zero_are_found_with_a_run_time_check() -> None:
    findings = found_and_faithful(RmsNorm(), _COUNTED_TO_ZERO, _COUNTED_TO_ZERO_RUN)
    assert [f.qualname for f in findings] == ["GatedRMSNorm.forward"]
    assert findings[0].params["dim_check"] == "-len(self.normalized_shape) == -1"


def test_two_trailing_dims_counted_to_zero_stay_a_near_miss() -> None:
    code = _COUNTED_TO_ZERO.replace("tuple(range(-len(self.normalized_shape), 0))", "tuple(range(-2, 0))")
    findings, misses = detect_all(RmsNorm(), code)
    assert findings == []
    assert any("mean over dim `dims`" in m.reason for m in misses)


# -- D: add_rms_norm, the norm of the sum inside one arm of a switch right after the add (HO21a MoE-LLM)


_SWITCH_ARM = '''
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


class Experts(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return self.fc(x), x.pow(2).mean()


class Block(nn.Module):
    def __init__(self, d, use_rezero=True, use_experts=True):
        super().__init__()
        self.use_rezero = use_rezero
        self.use_gradient_checkpointing = True
        self.ln2 = RMSNorm(d)
        self.attn = nn.Linear(d, d)
        self.mlp = Experts(d) if use_experts else nn.Linear(d, d)
        self.rezero_alpha_attn = nn.Parameter(torch.full((1,), 0.5))

    def _forward_mlp(self, x):
        return self.mlp(self.ln2(x))

    def forward(self, x):
        residual = x
        use_checkpoint = self.training and self.use_gradient_checkpointing
        attn_out = self.attn(x)
        if self.use_rezero:
            x = residual + self.rezero_alpha_attn * attn_out
        else:
            x = residual + attn_out
        residual = x
        if use_checkpoint:
            mlp_out, aux = checkpoint(self._forward_mlp, x, use_reentrant=False)
        else:
            if isinstance(self.mlp, Experts):
                mlp_out, aux = self.mlp(self.ln2(x))
            else:
                mlp_out = self.mlp(self.ln2(x))
                aux = torch.tensor(0.0, device=x.device)
        return residual + mlp_out, aux
'''

_SWITCH_ARM_RUN = '''
torch.manual_seed(0)
block = Block(16).eval()
plain = Block(16, use_rezero=False, use_experts=False).eval()
x = torch.randn(2, 5, 16, requires_grad=True)
out = (block(x), plain(x))
leaves = [x]
'''


def test_the_norm_heading_the_else_of_a_switch_after_a_flag_sum_is_found_and_runs() -> None:
    findings = found_and_faithful(AddRmsNorm(), _SWITCH_ARM, _SWITCH_ARM_RUN)
    assert [(f.qualname, f.line, f.end_line) for f in findings] == [("Block.forward", 46, 58)]
    assert findings[0].fused.startswith("if use_checkpoint:\n")


def test_a_flag_arm_scaling_the_whole_sum_stays_unfused() -> None:
    code = _SWITCH_ARM.replace("x = residual + self.rezero_alpha_attn * attn_out",
                               "x = (residual + attn_out) * self.rezero_alpha_attn")
    assert detect_all(AddRmsNorm(), code)[0] == []


def test_a_switch_whose_test_reads_the_sum_stays_unfused() -> None:
    code = _SWITCH_ARM.replace("        if use_checkpoint:\n", "        if use_checkpoint or x.requires_grad:\n")
    assert detect_all(AddRmsNorm(), code)[0] == []
