"""s50 (late pass on the s49 / s50 judges' false near-miss class): a method of a tensor attribute is no module call.

The near miss "the replacement would call `self.<attr>.<method>(..)` more often than the original code does (a module
call evaluated twice ...)" was said of a Parameter's dtype cast (``self.weight.to(x.dtype)``, ``self.scale.type_as(x)``)
inside hand-written RMS norms: false (a cast of a Parameter has no effect and draws nothing), and the rms_norm
replacement itself wrote the cast three times (the dtype fix of gamma read it in the test and in both arms). Now:

1. rms_norm: a weight read through a call is bound once before the dtype fix (``_npu_gamma = self.scale.to(x.dtype)``):
   a candidate, its rewrite exact under the emulator in float32 and bfloat16.
2. the "called more often" check counts a tensor attribute's casts and views (``to``, ``type_as``, ``float``, ``view``
   ...) as shape reads were counted in s49: no module call; a submodule's method of the same name still counts.
"""

from __future__ import annotations

from pattern_harness import detect_all
from pattern_harness import fused_and_runs as _fused_and_runs, near_miss_says as _near_miss

from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.rms_norm import RmsNorm

_CAST_WEIGHT = '''\
import torch
import torch.nn as nn


class GainNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.scale.to(x.dtype)
'''

_CAST_RUN = '''
torch.manual_seed(3)
m = GainNorm(24)
with torch.no_grad():
    m.scale.normal_()
x = torch.randn(2, 5, 24, requires_grad=True)
mb = GainNorm(24).to(torch.bfloat16)
out = [m(x), mb(x.detach().to(torch.bfloat16)).float()]
leaves = [x, m.scale]
'''


def test_weight_cast_with_to_fuses_and_is_written_once() -> None:
    facts = _fused_and_runs(RmsNorm(), _CAST_WEIGHT, _CAST_RUN, "GainNorm.forward")
    fused = facts["rewritten"]
    assert fused.count("self.scale.to(x.dtype)") == 2, fused  # once in the fused branch, once in the original


def test_weight_cast_with_type_as_fuses() -> None:
    code = _CAST_WEIGHT.replace("self.scale.to(x.dtype)", "self.scale.type_as(x)")
    facts = _fused_and_runs(RmsNorm(), code, _CAST_RUN, "GainNorm.forward")
    assert facts["rewritten"].count("self.scale.type_as(x)") == 2


def test_a_plain_weight_is_not_rebound() -> None:
    # near miss of the binding: an attribute chain is read as it is (no extra statement)
    code = _CAST_WEIGHT.replace("return h.to(x.dtype) * self.scale.to(x.dtype)", "return h.to(x.dtype) * self.scale")
    findings, _ = detect_all(RmsNorm(), code)
    assert [f.qualname for f in findings] == ["GainNorm.forward"]
    assert "_npu_gamma = self.scale\n" not in findings[0].fused


_CAST_BIAS = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class KeyBiasAttention(nn.Module):
    def __init__(self, width, heads=2, max_keys=16):
        super().__init__()
        self.heads, self.hd = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.key_bias = nn.Parameter(torch.zeros(max_keys))
        self.use_key_bias = True
        self.out = nn.Linear(width, width)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        scores = (q @ k.transpose(-2, -1)) / self.hd ** 0.5
        if self.use_key_bias:
            usable = min(self.key_bias.float().numel(), N)
            if usable == N:
                scores = scores + self.key_bias[:usable].view(1, 1, 1, -1)
        probs = F.softmax(scores, dim=-1)
        return self.out((probs @ v).transpose(1, 2).reshape(B, N, C))
'''

_CAST_BIAS_RUN = '''
torch.manual_seed(5)
m = KeyBiasAttention(32)
with torch.no_grad():
    m.key_bias.normal_()
x = torch.randn(2, 16, 32, requires_grad=True)
out = [m(x), m(x[:, :9])]
leaves = [x, m.key_bias]
'''


def test_cast_of_a_parameter_in_a_bias_branch_fuses() -> None:
    facts = _fused_and_runs(AttentionPattern(), _CAST_BIAS, _CAST_BIAS_RUN, "KeyBiasAttention.forward", tol=0.999)
    assert "pse=" in facts["rewritten"]


def test_cast_named_method_of_a_submodule_still_counts() -> None:
    # `self.key_bias` a module with a `float` method of its own that changes state: a call the fused branch repeats
    code = _CAST_BIAS.replace("self.key_bias = nn.Parameter(torch.zeros(max_keys))", "self.key_bias = Table(max_keys)").replace(
        "class KeyBiasAttention(nn.Module):", """class Table(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))
        self.reads = 0

    def float(self):
        self.reads += 1
        return self.w

    def __getitem__(self, i):
        return self.w[i]


class KeyBiasAttention(nn.Module):""")
    _near_miss(AttentionPattern(), code, "would call `self.key_bias.float()` more often than the original code does")
