"""s49 (ho26misc): the judged non-MoE HO26 misses and false near-miss reasons, as invented spellings of their classes.

1. rms_norm: an nn.RMSNorm built through a parameter whose default is the class (``norm_layer=nn.RMSNorm``,
   ``partial(nn.RMSNorm, eps=...)``, ``norm_layer = norm_layer or nn.RMSNorm``): swapped where it is built; a caller's
   other class keeps its own forward (the swap applies to nn.RMSNorm instances only).
"""

from __future__ import annotations

import torch
from pattern_harness import check_rewrite_runs, detect_all
from pattern_harness import fused_and_runs as _fused_and_runs, near_miss_says as _near_miss

from npufuse.patterns.rms_norm import RmsNorm


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
                   ("        self.h = n_heads\n", "        self.h = n_heads\n        if width > 64:\n            norm_cls = nn.LayerNorm\n")]:
        code = _PARAM_DEFAULT.replace(*change)
        assert code != _PARAM_DEFAULT
        findings, _ = detect_all(RmsNorm(), "from functools import partial\n" + code)
        assert not findings, (change, [f.line for f in findings])
