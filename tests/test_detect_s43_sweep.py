"""s43 recall sweep (helper sweep43): the classes behind the misses on bench/detect_labels_sweep43.json, nine
repositories labelled before npufuse was run on them. Every spelling here is invented, in the styles of those
repositories; each class has a Fuse (found, and run under the emulator against the original) and a Keep.

1. rope: ``from rotary_embedding_torch.rotary_embedding_torch import rotate_half`` (lucidrains' helper: adjacent
   pairs ``(-x2, x1)``) is a known library rotation of interleave kind (``canonical.LIBRARY_ROTATIONS``). Near miss:
   another package's ``rotate_half`` is still "not defined in this module: it cannot be verified".
2. add_rms_norm: the sum's norm is a class the numeric probe proves an RMSNorm only under a guard it assumed
   (``(1 / self.d_model) * torch.sum(x ** 2, -1)``: ``self.d_model == x.shape[-1]``). The guard is now checked at
   run time on the instance (else the original statements) instead of dropping the norm; the add may be spelled
   ``x += residual``. Near miss: a mean divided by a module constant (``1 / D_MODEL``) is not proved by the probe
   (nothing ties the constant to the input's width): no candidate.
3. attention: the probabilities from ``Ops.softmax(scores, dim=-1)``, a ``@staticmethod`` of a helper class of the
   file written as exp(x - max) / sum (CS336 style). The call was read as the tensor method ``Ops.softmax`` (the
   class as the input); a class of the file is now a receiver whose function is read (``staticmethod`` is an
   identity decorator for the softmax reader). Near miss: the static softmax with a temperature is not a softmax
   npufuse reads; an instance method called on the class is not read either.
4. attention: ``self.softmax(scores, dim=-1)`` where ``softmax`` is a method of the enclosing module class (instance
   or static) written as exp(x - max) / sum: read like a repository softmax function (nothing was reported before).
   Near miss: the class also assigns ``self.softmax = <a function>`` in ``__init__`` (the instance attribute shadows
   the method): no candidate.
"""

from __future__ import annotations

import types

import pytest
import torch

from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.rope import RopePattern
from pattern_harness import check_rewrite_runs, detect_all, install_stand_in_modules


def _close(facts: dict) -> None:
    assert facts["calls"] >= 1, facts["all_calls"]
    assert facts["shapes"] and all(a == b for a, b in facts["shapes"])
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"], default=1.0) > 0.9999


# -- 1. rope through rotary_embedding_torch's rotate_half -------------------------------------------------------

def _lucidrains_rotate_half(x: torch.Tensor) -> torch.Tensor:
    # the library's text, spelled without einops: '... (d r) -> ... d r', stack((-x2, x1), -1), flatten back
    x = x.unflatten(-1, (-1, 2))
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


_AXIAL_ROPE = """
import torch
from torch import nn
from rotary_embedding_torch.rotary_embedding_torch import rotate_half


class AxialRope(nn.Module):
    def __init__(self, dim, size):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        ang = torch.arange(size).float()[:, None] * inv[None, :]
        self.register_buffer("angles", ang.repeat_interleave(2, dim=-1), persistent=False)

    def forward(self, x):
        ang = self.angles[: x.shape[-2]]
        return x * ang.cos() + rotate_half(x) * ang.sin()
"""

_ROPE_RUN = """
m = AxialRope(8, 16)
x = torch.randn(2, 3, 5, 8, requires_grad=True)
out = m(x)
leaves = [x]
"""


def test_rotary_embedding_torch_rotate_half_is_an_interleave_rotation(monkeypatch: pytest.MonkeyPatch) -> None:
    install_stand_in_modules(monkeypatch, {"rotary_embedding_torch.rotary_embedding_torch": {"rotate_half": _lucidrains_rotate_half}})
    findings, _ = detect_all(RopePattern(), _AXIAL_ROPE)
    assert [(f.qualname, f.params.get("mode")) for f in findings] == [("AxialRope.forward", "interleave")]
    _close(check_rewrite_runs(RopePattern(), _AXIAL_ROPE, _ROPE_RUN, findings))


def test_another_packages_rotate_half_stays_unverified() -> None:
    code = _AXIAL_ROPE.replace("from rotary_embedding_torch.rotary_embedding_torch import rotate_half",
                               "from some_other_pkg.layers import rotate_half")
    findings, misses = detect_all(RopePattern(), code)
    assert not findings
    assert any("is not defined in this module: it cannot be verified" in m.reason for m in misses)


# -- 2. add + a probe-proved norm with a guard on the instance -----------------------------------------------------

_SUM_OVER_D_NORM = """
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d_model, eps=1e-5):
        super().__init__()
        self.d_model = d_model
        self.eps = eps
        self.gain = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        rms = torch.sqrt((1 / self.d_model) * torch.sum(x ** 2, dim=-1, keepdim=True) + self.eps)
        return (x / rms) * self.gain


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.ff = nn.Linear(d, d)
        self.norm1 = RMSNorm(d)
        self.norm2 = RMSNorm(d)

    def forward(self, x):
        residual = x
        x = self.attn(self.norm1(x))
        x += residual
        residual = x
        x = self.ff(self.norm2(x))
        x += residual
        return x
"""

_BLOCK_RUN = """
m = Block(16)
with torch.no_grad():
    for p in m.parameters():
        p.normal_()
    infer = m(torch.randn(2, 5, 16))
x = torch.randn(2, 5, 16, requires_grad=True)
out = (infer, m(x))
leaves = [x]
"""


def test_augmented_add_then_a_guarded_probe_norm_is_fused() -> None:
    findings, _ = detect_all(AddRmsNorm(), _SUM_OVER_D_NORM)
    assert [(f.qualname, f.line) for f in findings] == [("Block.forward", 29)]
    assert "self.norm2.d_model == " in findings[0].fused
    facts = check_rewrite_runs(AddRmsNorm(), _SUM_OVER_D_NORM, _BLOCK_RUN, findings)
    assert facts["all_calls"].get("npu_add_rms_norm"), facts["all_calls"]
    _close(facts)


def test_the_instance_guard_sends_a_wrong_width_to_the_original() -> None:
    # a norm whose d_model disagrees with the input width: the guard is false, the original statements run
    code = _SUM_OVER_D_NORM.replace("self.norm2 = RMSNorm(d)", "self.norm2 = RMSNorm(d)\n        self.norm2.d_model = d + 1")
    findings, _ = detect_all(AddRmsNorm(), code)
    facts = check_rewrite_runs(AddRmsNorm(), code, _BLOCK_RUN, findings)
    assert not facts["all_calls"].get("npu_add_rms_norm"), facts["all_calls"]
    assert min(facts["cos_out"]) > 0.9999


def test_a_mean_over_a_module_constant_is_not_taken() -> None:
    code = _SUM_OVER_D_NORM.replace("import torch\nfrom torch import nn\n", "import torch\nfrom torch import nn\n\nD_MODEL = 16\n", 1)
    code = code.replace("(1 / self.d_model)", "(1 / D_MODEL)")
    findings, _ = detect_all(AddRmsNorm(), code)
    assert not findings


# -- 3. a softmax written as a static method of a helper class ----------------------------------------------------

_STATIC_SOFTMAX = """
import torch


class Ops:
    @staticmethod
    def softmax(x: torch.Tensor, dim: int):
        x_max = x.max(dim=dim, keepdim=True).values
        e_x = torch.exp(x - x_max)
        return e_x / e_x.sum(dim=dim, keepdim=True)

    @staticmethod
    def attend(q, k, v, mask):
        d_k = q.size(-1)
        scores = (q @ k.transpose(-2, -1)) / torch.sqrt(torch.tensor(d_k, dtype=q.dtype, device=q.device))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = Ops.softmax(scores, dim=-1)
        return probs @ v
"""

_STATIC_RUN = """
q = torch.randn(2, 2, 5, 8, requires_grad=True)
k = torch.randn(2, 2, 5, 8, requires_grad=True)
v = torch.randn(2, 2, 5, 8, requires_grad=True)
mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))[None, None]
out = (Ops.attend(q, k, v, mask), Ops.attend(q, k, v, None))
leaves = [q, k, v]
"""


def test_a_static_method_softmax_of_a_helper_class_is_read() -> None:
    findings, _ = detect_all(AttentionPattern(), _STATIC_SOFTMAX)
    assert [f.qualname for f in findings] == ["Ops.attend"]
    _close(check_rewrite_runs(AttentionPattern(), _STATIC_SOFTMAX, _STATIC_RUN, findings))


def test_a_static_softmax_with_a_temperature_is_not_read() -> None:
    code = _STATIC_SOFTMAX.replace("def softmax(x: torch.Tensor, dim: int):", "def softmax(x: torch.Tensor, dim: int, t: float = 2.0):")
    code = code.replace("e_x = torch.exp(x - x_max)", "e_x = torch.exp((x - x_max) / t)")
    findings, misses = detect_all(AttentionPattern(), code)
    assert not findings
    assert any("is not read as a softmax over one axis" in m.reason for m in misses)


def test_an_instance_method_softmax_called_on_the_class_is_not_read() -> None:
    code = _STATIC_SOFTMAX.replace("    @staticmethod\n    def softmax(x: torch.Tensor, dim: int):", "    def softmax(x: torch.Tensor, dim: int):")
    assert "@staticmethod\n    def softmax" not in code
    findings, _ = detect_all(AttentionPattern(), code)
    assert not findings


# -- 4. a softmax method of the module class itself -----------------------------------------------------------------

_SELF_SOFTMAX = """
import torch
from torch import nn


class Attn(nn.Module):
    def __init__(self, d, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)

    def softmax(self, x, dim):
        x_max = x.max(dim=dim, keepdim=True).values
        e_x = torch.exp(x - x_max)
        return e_x / e_x.sum(dim=dim, keepdim=True)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        probs = self.softmax(scores, dim=-1)
        return (probs @ v).transpose(1, 2).reshape(b, s, d)
"""

_SELF_RUN = """
m = Attn(16)
x = torch.randn(2, 5, 16, requires_grad=True)
out = m(x)
leaves = [x]
"""


def test_a_softmax_method_of_the_module_class_is_read() -> None:
    findings, _ = detect_all(AttentionPattern(), _SELF_SOFTMAX)
    assert [f.qualname for f in findings] == ["Attn.forward"]
    _close(check_rewrite_runs(AttentionPattern(), _SELF_SOFTMAX, _SELF_RUN, findings))


def test_a_softmax_method_shadowed_by_an_instance_attribute_is_not_read() -> None:
    code = _SELF_SOFTMAX.replace("        self.qkv = nn.Linear(d, 3 * d)\n",
                                 "        self.qkv = nn.Linear(d, 3 * d)\n        self.softmax = torch.special.log_softmax\n")
    assert "self.softmax = " in code
    findings, _ = detect_all(AttentionPattern(), code)
    assert not findings
