"""s44 recall sweep (helper sweep44): the classes behind the misses on bench/detect_labels_sweep44.json, five
repositories labelled before npufuse was run on them (development data).

A rope: the named-halves rotation (``y1 = x1 * cos + x2 * sin``; ``y2 = x1 * (-sin) + x2 * cos``; ``cat((y1, y2), 3)``)
   over halves cut with the last axis spelled by its index (``x1, x2 = x.chunk(2, dim=3)``, a single-file MLA's
   rotary). Near miss: the same halves cut along axis 1 (a channel axis) are no rotation of the features.
B swiglu: a Mamba-2 in_proj split into five parts whose sizes list is held by a local name
   (``split_sizes = [d_mlp, d_mlp, ...]``; ``z0, x0, ... = torch.split(zxbcdt, split_sizes, dim=-1)``; ``silu(z0) * x0``).
   Near misses: the list changed in place before the split (``split_sizes.append(..)``); parts of different sizes.
C swiglu: two equal-width slices of one projection's last axis, one cut at both ends (``z0 = t[:, :, :d]``;
   ``x0 = t[:, :, d:2 * d]``). Near miss: widths not provably equal (``t[:, :, d:3 * d]``).
"""

from __future__ import annotations

from npufuse.patterns.rope import RopePattern
from npufuse.patterns.swiglu import Swiglu
from pattern_harness import detect_all, found_and_faithful


# -- A: halves cut along axis 3 of a 4-D tensor

_AXIS3_ROPE = '''
import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        self.register_buffer("inv_freq", (1 / base) ** (torch.arange(0, dim, 2) / dim))

    def forward(self, x):
        t = torch.arange(x.shape[1], device=x.device)
        freqs = torch.outer(t, self.inv_freq)
        cos, sin = freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]
        x1, x2 = x.chunk(2, dim=3)
        y1 = x1 * cos + x2 * sin
        y2 = x1 * (-sin) + x2 * cos
        return torch.cat((y1, y2), 3).type_as(x)
'''

_AXIS3_RUN = '''
rope = Rotary(16)
x = torch.randn(2, 6, 4, 16, requires_grad=True)
out = rope(x)
leaves = [x]
'''


def test_named_halves_cut_along_axis_3_are_found_and_run() -> None:
    findings = found_and_faithful(RopePattern(), _AXIS3_ROPE, _AXIS3_RUN)
    assert [(f.qualname, f.line) for f in findings] == [("Rotary.forward", 16)]


def test_halves_cut_along_a_channel_axis_are_no_rotation() -> None:
    code = _AXIS3_ROPE.replace("x.chunk(2, dim=3)", "x.chunk(2, dim=1)").replace("torch.cat((y1, y2), 3)", "torch.cat((y1, y2), 1)")
    assert detect_all(RopePattern(), code)[0] == []


# -- B: a five-part split whose sizes list is held by a name

_NAMED_SIZES = '''
import torch
import torch.nn.functional as F
from torch import nn


class Mamba2Mlp(nn.Module):
    def __init__(self, d_model, d_inner, nheads):
        super().__init__()
        self.d_inner = d_inner
        self.nheads = nheads
        self.in_proj = nn.Linear(d_model, 4 * d_inner + nheads)
        self.out_proj = nn.Linear(d_inner * 3 + nheads, d_model)

    def forward(self, u):
        zxbcdt = self.in_proj(u)
        d_mlp = self.d_inner
        split_sizes = [d_mlp, d_mlp, self.d_inner, self.d_inner, self.nheads]
        z0, x0, z, xbc, dt = torch.split(zxbcdt, split_sizes, dim=-1)
        mlp_skip = F.silu(z0) * x0
        return self.out_proj(torch.cat([mlp_skip, z, xbc, dt], dim=-1))
'''

_NAMED_SIZES_RUN = '''
m = Mamba2Mlp(8, 6, 2)
x = torch.randn(2, 5, 8, requires_grad=True)
out = m(x)
leaves = [x] + list(m.parameters())
'''


def test_split_sizes_held_by_a_name_are_read_as_sized_parts() -> None:
    findings = found_and_faithful(Swiglu(), _NAMED_SIZES, _NAMED_SIZES_RUN)
    assert [(f.qualname, f.line) for f in findings] == [("Mamba2Mlp.forward", 20)]


def test_a_sizes_list_changed_before_the_split_is_not_followed() -> None:
    code = _NAMED_SIZES.replace("        z0, x0, z, xbc, dt =", "        split_sizes.reverse()\n        z0, x0, z, xbc, dt =")
    assert detect_all(Swiglu(), code)[0] == []


def test_parts_of_different_sizes_through_a_name_are_no_pair() -> None:
    code = _NAMED_SIZES.replace("[d_mlp, d_mlp, self.d_inner", "[d_mlp, self.nheads, self.d_inner")
    findings, misses = detect_all(Swiglu(), code)
    assert findings == [] and any("not provably equal" in m.reason for m in misses)


# -- C: two equal-width slices of one projection, one cut at both ends

_SLICED = '''
import torch
import torch.nn.functional as F
from torch import nn


class SimpleSSM(nn.Module):
    def __init__(self, d_model, d_inner):
        super().__init__()
        self.d_inner = d_inner
        self.in_proj = nn.Linear(d_model, 3 * d_inner)
        self.out_proj = nn.Linear(2 * d_inner, d_model)

    def forward(self, x):
        p = self.in_proj(x)
        z0 = p[:, :, :self.d_inner]
        x0 = p[:, :, self.d_inner:2 * self.d_inner]
        rest = p[:, :, 2 * self.d_inner:]
        mlp_skip = F.silu(z0) * x0
        return self.out_proj(torch.cat([mlp_skip, rest], dim=-1))
'''

_SLICED_RUN = '''
m = SimpleSSM(8, 6)
x = torch.randn(2, 5, 8, requires_grad=True)
out = m(x)
leaves = [x] + list(m.parameters())
'''


def test_equal_width_slices_of_one_projection_are_found_and_run() -> None:
    findings = found_and_faithful(Swiglu(), _SLICED, _SLICED_RUN)
    assert [f.qualname for f in findings] == ["SimpleSSM.forward"]


def test_slices_of_unproven_equal_width_are_no_pair() -> None:
    code = _SLICED.replace("self.d_inner:2 * self.d_inner]", "self.d_inner:3 * self.d_inner]")
    assert detect_all(Swiglu(), code)[0] == []
