"""s49 (ho26misc): the judged non-MoE HO26 misses and false near-miss reasons, as invented spellings of their classes.

1. rms_norm: an nn.RMSNorm built through a parameter whose default is the class (``norm_layer=nn.RMSNorm``,
   ``partial(nn.RMSNorm, eps=...)``, ``norm_layer = norm_layer or nn.RMSNorm``): swapped where it is built; a caller's
   other class keeps its own forward (the swap applies to nn.RMSNorm instances only).
2. rope: an interleaved rope written as strided slice assignments into a clone of the input with half-width cos / sin,
   the halves named between the clone and the fills, or the fills written in both (same) arms of an ``if``: read as
   the adjacent spelling is (npu_rotary_mul interleave, the tables repeated to full width); arms that differ, or the
   cloned tensor rebound before the fills, are no candidate.
3. add_rms_norm: a (conditional) add, then an own norm class whose forward is ``if flag: return F.rms_norm(..)`` and a
   hand-written float32 RMS norm with the same weight and eps: both arms are the norm, the torch path is read (the
   class in another file of the repository too, where the reason said it was not an RMS norm); arms with different
   eps are a near miss saying so.
4. attention: heads folded into the batch, the scores a matmul, the product with V a 3-D einsum (``b i j, b j d -> b i
   d``): read as the 3-D product it is, q's and k's ranks checked at run time (the near miss said 3-D vs 4-D: false);
   an optional bias branch behind ``min(self.<Parameter>.size(0), N)``: a shape read of a Parameter (or buffer) is no
   module call, so the fused branch reading it again is no near miss (it said "a module call evaluated twice": false);
   window attention whose scores are viewed 5-D to add a per-window bias and a shifted-window mask in one sum, then
   viewed back: the terms go to pse (the one-term form was read before).
"""

from __future__ import annotations

import torch
from pattern_harness import check_rewrite_runs, detect_all
from pattern_harness import fused_and_runs as _fused_and_runs, near_miss_says as _near_miss

from pathlib import Path

from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.rms_norm import RmsNorm
from npufuse.patterns.rope import RopePattern
from npufuse.scan.engine import scan_repo


# -- 1. nn.RMSNorm through a parameter default ---------------------------------------------------------------------

_PARAM_DEFAULT = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, width, n_heads=4, use_qk_norm=True, norm_cls: type = nn.RMSNorm):
        super().__init__()
        self.h = n_heads
        self.dh = width // n_heads
        self.to_qkv = nn.Linear(width, 3 * width)
        self.qn = norm_cls(self.dh) if use_qk_norm else nn.Identity()
        self.kn = norm_cls(self.dh, eps=1e-5) if use_qk_norm else nn.Identity()

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        q, k = self.qn(q), self.kn(k)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
'''

_PARAM_DEFAULT_RUN = '''
torch.manual_seed(0)
m = SelfAttention(32)
with torch.no_grad():
    m.qn.weight.add_(torch.randn(8) * 0.1)
    m.kn.weight.add_(torch.randn(8) * 0.1)
x = torch.randn(2, 6, 32, requires_grad=True)
mb = SelfAttention(32).to(torch.bfloat16)
other = SelfAttention(32, norm_cls=nn.LayerNorm)
out = [m(x), mb(x.detach().to(torch.bfloat16)).float(), other(x)]
leaves = [x, m.qn.weight, m.kn.weight]
'''

_PARTIAL_BUILDER = '''\
from functools import partial

import torch
from torch import nn


def make_norms(dim, depth, norm_fn=partial(nn.RMSNorm, eps=1e-6)):
    return nn.ModuleList([norm_fn(dim) for _ in range(depth)])


class Stack(nn.Module):
    def __init__(self, dim, depth=2, make_norm=None):
        super().__init__()
        make_norm = make_norm or nn.RMSNorm
        self.norms = make_norms(dim, depth)
        self.out_norm = make_norm(dim, elementwise_affine=False)
        self.lins = nn.ModuleList([nn.Linear(dim, dim) for _ in range(depth)])

    def forward(self, x):
        for norm, lin in zip(self.norms, self.lins):
            x = lin(norm(x))
        return self.out_norm(x)
'''

_PARTIAL_BUILDER_RUN = '''
torch.manual_seed(1)
s = Stack(16)
x = torch.randn(3, 4, 16, requires_grad=True)
sb = Stack(16).to(torch.bfloat16)
out = [s(x), sb(x.detach().to(torch.bfloat16)).float()]
leaves = [x, s.norms[0].weight]
'''


def test_rms_norm_parameter_default_class_fuses() -> None:
    findings, misses = detect_all(RmsNorm(), _PARAM_DEFAULT)
    assert [(f.qualname, f.line) for f in findings] == [("SelfAttention.__init__", 12), ("SelfAttention.__init__", 13)], \
        [m.reason for m in misses]
    assert "default of `norm_cls`" in findings[0].params["module"]
    facts = check_rewrite_runs(RmsNorm(), _PARAM_DEFAULT, _PARAM_DEFAULT_RUN, findings)
    assert facts["all_calls"].get("npu_rms_norm", 0) >= 4, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999, facts
    assert all(a == b for a, b in facts["dtypes"]) and all(a == b for a, b in facts["shapes"]), facts
    # only an nn.RMSNorm instance is swapped: a caller's LayerNorm keeps its own forward
    assert "isinstance(_npufuse_norm := norm_cls(self.dh), torch.nn.RMSNorm)" in facts["rewritten"]


def test_rms_norm_partial_default_and_or_rebinding_fuse() -> None:
    findings, misses = detect_all(RmsNorm(), _PARTIAL_BUILDER)
    assert sorted(f.qualname for f in findings) == ["Stack.__init__", "make_norms"], [m.reason for m in misses]
    facts = check_rewrite_runs(RmsNorm(), _PARTIAL_BUILDER, _PARTIAL_BUILDER_RUN, findings)
    assert facts["all_calls"].get("npu_rms_norm", 0) >= 6, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999, facts
    assert all(a == b for a, b in facts["dtypes"]), facts


def test_rms_norm_parameter_default_not_rms_or_rebound_kept() -> None:
    for change in [("norm_cls: type = nn.RMSNorm", "norm_cls: type = nn.LayerNorm"),
                   ("norm_cls: type = nn.RMSNorm", "norm_cls: type = partial(nn.RMSNorm, 8)"),
                   ("        self.h = n_heads\n", "        self.h = n_heads\n        if width > 64:\n            norm_cls = nn.LayerNorm\n"),
                   # a construction in a comprehension's iterable: the guarded swap's `:=` is refused there
                   ("        self.qn = norm_cls(self.dh) if use_qk_norm else nn.Identity()\n        self.kn = norm_cls(self.dh, eps=1e-5) if use_qk_norm else nn.Identity()\n",
                    "        self.qn, self.kn = [m for m in (norm_cls(self.dh), norm_cls(self.dh))]\n")]:
        code = _PARAM_DEFAULT.replace(*change)
        assert code != _PARAM_DEFAULT
        findings, _ = detect_all(RmsNorm(), "from functools import partial\n" + code)
        assert not findings, (change, [f.line for f in findings])


# -- 3. add, then a norm class with a library arm and a hand-written arm -------------------------------------------

_TWO_ARM_NORM = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class ScaleNorm(nn.Module):
    """RMS normalisation; the fused PyTorch kernel when this build has one."""

    def __init__(self, features, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(features))
        self.use_kernel = hasattr(F, "rms_norm")

    def forward(self, h):
        if self.use_kernel:
            return F.rms_norm(h, (h.shape[-1],), self.scale, self.eps)
        else:
            orig = h.dtype
            ms = h.float().square().mean(dim=-1, keepdim=True)
            h = h * torch.rsqrt(ms + self.eps)
            return (h * self.scale).to(orig)
'''

_MIXER = '''
class Mixer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.body = nn.Linear(width, width)
        self.side = nn.Linear(width, width)
        self.post = ScaleNorm(width)

    def forward(self, tokens, extra=None):
        y = self.body(tokens)
        if extra is not None:
            y = y + 0.25 * self.side(extra)
        return tokens + self.post(y)
'''

_MIXER_RUN = '''
torch.manual_seed(3)
m = Mixer(16)
with torch.no_grad():
    m.post.scale.add_(torch.randn(16) * 0.1)
t = torch.randn(2, 5, 16, requires_grad=True)
e = torch.randn(2, 5, 16)
mb = Mixer(16).to(torch.bfloat16)
out = [m(t, e), m(t), mb(t.detach().to(torch.bfloat16), e.to(torch.bfloat16)).float()]
with torch.no_grad():
    out.append(m(t.detach(), e))
leaves = [t, m.post.scale]
'''


def test_add_then_two_arm_norm_class_fuses() -> None:
    facts = _fused_and_runs(AddRmsNorm(), _TWO_ARM_NORM + _MIXER, _MIXER_RUN, "Mixer.forward", tol=0.999)
    assert facts["all_calls"].get("npu_add_rms_norm", 0) >= 1 and facts["all_calls"].get("npu_rms_norm", 0) >= 1, facts["all_calls"]
    # both arms are the norm: no run-time test of the flag
    assert "use_kernel" not in facts["rewritten"].split("class Mixer")[1]


def test_add_then_two_arm_norm_class_of_another_file_fuses(tmp_path: Path) -> None:
    (tmp_path / "layers").mkdir()
    (tmp_path / "layers" / "__init__.py").write_text("")
    (tmp_path / "layers" / "norms.py").write_text(_TWO_ARM_NORM)
    (tmp_path / "layers" / "mixer.py").write_text("import torch\nimport torch.nn as nn\n\nfrom .norms import ScaleNorm\n\n" + _MIXER)
    res = scan_repo(tmp_path, jobs=1, only=["add_rms_norm"])
    assert [(c["file"], c["qualname"]) for c in res.candidates] == [("layers/mixer.py", "Mixer.forward")], res.near_misses
    assert "F.rms_norm with the same weight and eps" in res.candidates[0]["params"]["norm_class"]


def test_add_then_two_arm_norm_whose_arms_differ_says_so() -> None:
    code = (_TWO_ARM_NORM + _MIXER).replace("(h.shape[-1],), self.scale, self.eps)", "(h.shape[-1],), self.scale, 1e-5)")
    _near_miss(AddRmsNorm(), code, "two arms under `self.use_kernel` (F.rms_norm, and a hand-written norm) that are not read as using the same weight and eps")


# -- 4a. folded heads, matmul scores, einsum with the values ------------------------------------------------------

_FOLDED_EINSUM = '''\
import torch
import torch.nn as nn


class ContextAttention(nn.Module):
    def __init__(self, dim, ctx_dim, heads=2, head_dim=16, p=0.0):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(ctx_dim, 2 * heads * head_dim, bias=False)
        self.out_proj = nn.Linear(heads * head_dim, dim)
        self.attn_drop = nn.Dropout(p)

    def forward(self, x, context):
        B, H, D = x.shape[0], self.heads, self.head_dim
        q = self.q_proj(x)
        k, v = self.kv_proj(context).chunk(2, dim=-1)
        q, k, v = map(lambda t: t.reshape(B, -1, H, D).transpose(1, 2).reshape(B * H, -1, D), (q, k, v))
        logits = q @ k.transpose(-2, -1) * self.scale
        probs = logits.softmax(dim=-1)
        probs = self.attn_drop(probs)
        out = torch.einsum("z i j, z j c -> z i c", probs, v)
        out = out.reshape(B, H, -1, D).transpose(1, 2).reshape(B, -1, H * D)
        return self.out_proj(out)
'''

_FOLDED_EINSUM_RUN = '''
torch.manual_seed(4)
m = ContextAttention(24, 12)
x = torch.randn(2, 7, 24, requires_grad=True)
c = torch.randn(2, 5, 12, requires_grad=True)
mb = ContextAttention(24, 12).to(torch.bfloat16)
out = [m(x, c), mb(x.detach().to(torch.bfloat16), c.detach().to(torch.bfloat16)).float()]
leaves = [x, c, m.q_proj.weight]
'''


def test_folded_heads_matmul_scores_einsum_values_fuses() -> None:
    facts = _fused_and_runs(AttentionPattern(), _FOLDED_EINSUM, _FOLDED_EINSUM_RUN, "ContextAttention.forward", tol=0.999)
    assert "q.dim() == 3 and k.dim() == 3" in facts["rewritten"]
    assert facts["all_calls"].get("npu_fusion_attention", 0) >= 2, facts["all_calls"]
    # the matmul spelled torch.matmul reads alike
    code = _FOLDED_EINSUM.replace("logits = q @ k.transpose(-2, -1) * self.scale", "logits = torch.matmul(q, k.transpose(-2, -1)) * self.scale")
    _fused_and_runs(AttentionPattern(), code, _FOLDED_EINSUM_RUN, "ContextAttention.forward", tol=0.999)


def test_folded_heads_matmul_of_a_call_says_its_rank_is_unchecked() -> None:
    code = _FOLDED_EINSUM.replace("logits = q @ k.transpose(-2, -1) * self.scale",
                                  "logits = self.q_proj.weight.new_ones(1).mul(q) @ k.transpose(-2, -1) * self.scale")
    findings, misses = detect_all(AttentionPattern(), code)
    assert not findings
    assert not any("3-D vs 4-D" in m.reason for m in misses), [m.reason for m in misses]


# -- 4c. an optional bias branch behind the shape of a Parameter ---------------------------------------------------

_SIZED_BIAS = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class KeyBiasAttention(nn.Module):
    def __init__(self, width, heads=2, max_keys=16):
        super().__init__()
        self.heads, self.hd = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.key_bias = nn.Parameter(torch.zeros(max_keys))
        self.register_buffer("key_gain", torch.ones(max_keys))
        self.use_key_bias = True
        self.out = nn.Linear(width, width)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        scores = (q @ k.transpose(-2, -1)) / self.hd ** 0.5
        if self.use_key_bias:
            usable = min(self.key_bias.size(0), self.key_gain.numel(), N)
            if usable == N:
                scores = scores + (self.key_bias[:usable] * self.key_gain[:usable]).view(1, 1, 1, -1)
        probs = F.softmax(scores, dim=-1)
        return self.out((probs @ v).transpose(1, 2).reshape(B, N, C))
'''

_SIZED_BIAS_RUN = '''
torch.manual_seed(5)
m = KeyBiasAttention(32)
with torch.no_grad():
    m.key_bias.normal_()
x = torch.randn(2, 16, 32, requires_grad=True)
mb = KeyBiasAttention(32).to(torch.bfloat16)
with torch.no_grad():
    mb.key_bias.normal_()
out = [m(x), m(x[:, :9]), mb(x.detach().to(torch.bfloat16)).float()]
leaves = [x, m.key_bias]
'''


def test_bias_branch_behind_a_parameter_shape_fuses() -> None:
    facts = _fused_and_runs(AttentionPattern(), _SIZED_BIAS, _SIZED_BIAS_RUN, "KeyBiasAttention.forward", tol=0.999)
    assert "pse=" in facts["rewritten"]


def test_size_of_a_submodule_still_counts_as_a_module_call() -> None:
    # `self.key_bias` a module with a method `size` of its own: a call the fused branch repeats
    code = _SIZED_BIAS.replace("self.key_bias = nn.Parameter(torch.zeros(max_keys))", "self.key_bias = Table(max_keys)").replace(
        "class KeyBiasAttention(nn.Module):", """class Table(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))
        self.reads = 0

    def size(self, d):
        self.reads += 1
        return self.w.size(d)

    def __getitem__(self, i):
        return self.w[i]


class KeyBiasAttention(nn.Module):""")
    _near_miss(AttentionPattern(), code, "would call `self.key_bias.size(0)` more often than the original code does")


# -- 4b. a bias and a window mask added in one sum through a 5-D view of the scores ---------------------------------

_WINDOW_SUM = '''\
import torch
import torch.nn as nn


class ShiftedWindowAttention(nn.Module):
    def __init__(self, dim, tokens, windows, heads=2):
        super().__init__()
        self.heads, self.windows = heads, windows
        self.hd = dim // heads
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.window_bias = nn.Parameter(torch.zeros(1, windows, heads, tokens, tokens))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, shift_mask):
        Bw, T, C = x.shape
        nw = self.windows
        q, k, v = self.to_qkv(x).reshape(Bw, T, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        logits = (q * self.hd ** -0.5) @ k.transpose(-2, -1)
        logits = logits.reshape(Bw // nw, nw, self.heads, T, T)
        logits = logits + self.window_bias + shift_mask[None, :, None]
        logits = logits.reshape(-1, self.heads, T, T)
        weights = logits.softmax(dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(Bw, T, C)
        return self.proj(y)
'''

_WINDOW_SUM_RUN = '''
torch.manual_seed(6)
m = ShiftedWindowAttention(16, 6, 4)
with torch.no_grad():
    m.window_bias.normal_()
mask = torch.zeros(4, 6, 6)
mask[1:, :3, 3:] = -100.0
mask[1:, 3:, :3] = -100.0
x = torch.randn(8, 6, 16, requires_grad=True)
mb = ShiftedWindowAttention(16, 6, 4).to(torch.bfloat16)
with torch.no_grad():
    mb.window_bias.normal_()
out = [m(x, mask), mb(x.detach().to(torch.bfloat16), mask.to(torch.bfloat16)).float()]
leaves = [x, m.window_bias]
'''


def test_window_bias_and_mask_summed_through_a_5d_view_fuse() -> None:
    facts = _fused_and_runs(AttentionPattern(), _WINDOW_SUM, _WINDOW_SUM_RUN, "ShiftedWindowAttention.forward", tol=0.999)
    assert "pse=" in facts["rewritten"] and "atten_mask" not in facts["rewritten"]


def test_window_sum_with_a_second_term_from_the_scores_is_kept() -> None:
    code = _WINDOW_SUM.replace("logits = logits + self.window_bias + shift_mask[None, :, None]",
                               "logits = logits + self.window_bias + logits.detach().amax(-1, keepdim=True)")
    _near_miss(AttentionPattern(), code, "unsupported operation on the attention scores")


# -- 2. interleaved rope by strided slice assignment into a clone ---------------------------------------------------

_LANES = '''\
import torch
import torch.nn as nn


class PairRotary(nn.Module):
    def __init__(self, base=10000.0):
        super().__init__()
        self.base = base

    def tables(self, n, d, device):
        t = torch.arange(n, dtype=torch.float32, device=device)
        inv = self.base ** (-torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
        ang = torch.outer(t, inv)
        return ang.cos(), ang.sin()

    def forward(self, h):
        # h: [batch, seq, width]
        c, s = self.tables(h.shape[1], h.shape[-1], h.device)
        c = c.unsqueeze(0)
        s = s.unsqueeze(0)
        rotated = h.clone()
        even, odd = h[..., 0::2], h[..., 1::2]
        rotated[..., 0::2] = even * c - odd * s
        rotated[..., 1::2] = even * s + odd * c
        return rotated
'''

_LANES_RUN = '''
torch.manual_seed(7)
r = PairRotary()
h = torch.randn(2, 6, 16, requires_grad=True)
out = [r(h), r(h.detach().to(torch.bfloat16)).float()]
leaves = [h]
'''

_ARMS = '''\
import torch
import torch.nn as nn


class HeadRotary(nn.Module):
    def forward(self, q, cos, sin):
        # q: [B, S, H, D] or [B, S, D]; cos / sin: [S, D // 2]
        per_head = q.dim() == 4
        if per_head:
            cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        else:
            cos, sin = cos[None], sin[None]
        q_out = q.clone()
        if per_head:
            q_out[..., ::2] = q[..., ::2] * cos - q[..., 1::2] * sin
            q_out[..., 1::2] = q[..., 1::2] * cos + q[..., ::2] * sin
        else:
            q_out[..., ::2] = q[..., ::2] * cos - q[..., 1::2] * sin
            q_out[..., 1::2] = q[..., 1::2] * cos + q[..., ::2] * sin
        return q_out
'''

_ARMS_RUN = '''
torch.manual_seed(8)
ang = torch.arange(5).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
q4 = torch.randn(2, 5, 3, 8, requires_grad=True)
q3 = torch.randn(2, 5, 8, requires_grad=True)
m = HeadRotary()
out = [m(q4, ang.cos(), ang.sin()), m(q3, ang.cos(), ang.sin()),
       m(q4.detach().to(torch.bfloat16), ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)).float()]
leaves = [q4, q3]
'''


def test_interleaved_rope_into_a_clone_with_named_halves_fuses() -> None:
    facts = _fused_and_runs(RopePattern(), _LANES, _LANES_RUN, "PairRotary.forward", tol=0.999)
    assert 'rotary_mode="interleave"' in facts["rewritten"] and "repeat_interleave(2" in facts["rewritten"]
    assert facts["all_calls"].get("npu_rotary_mul", 0) >= 2, facts["all_calls"]


def test_interleaved_rope_fills_in_same_code_arms_fuse() -> None:
    facts = _fused_and_runs(RopePattern(), _ARMS, _ARMS_RUN, "HeadRotary.forward", tol=0.999)
    assert facts["all_calls"].get("npu_rotary_mul", 0) >= 3, facts["all_calls"]
    fused = facts["rewritten"].split("npu_rotary_mul")[0]
    assert "q_out = q.clone()" in fused  # the clone stays as written; the fused call rebinds q_out


def test_interleaved_rope_clone_keeps() -> None:
    # arms that differ (one rotates the other way): which runs is not read
    differ = _ARMS.replace("            q_out[..., 1::2] = q[..., 1::2] * cos + q[..., ::2] * sin\n        return",
                           "            q_out[..., 1::2] = q[..., 1::2] * cos - q[..., ::2] * sin\n        return")
    # the cloned tensor rebound before the fills: the buffer is not the rotated tensor's
    rebound = _LANES.replace("        even, odd = h[..., 0::2], h[..., 1::2]\n",
                             "        h = h.double()\n        even, odd = h[..., 0::2], h[..., 1::2]\n")
    for code in (differ, rebound):
        assert code not in (_ARMS, _LANES)
        findings, misses = detect_all(RopePattern(), code)
        assert not findings, [f.line for f in findings]
