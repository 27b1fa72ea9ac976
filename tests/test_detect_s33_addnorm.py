"""s33 add_rms_norm pass (HO9b development data, vision / multimodal / protein code): a norm class
built through the submodule that defines it (Unified-IO 2's ``from uio2 import layers`` then
``layers.UIOLayerNorm(dim)``), a norm chosen by a flag between a class of another file and
``nn.LayerNorm`` (AMPLIFY's ``RMSNorm(d, eps) if config.rms_norm else nn.LayerNorm(d, eps)``), and a
norm heading the body of an ``if`` right after the add (Unified-IO 2's decoder layer with an
optional cross-attention). The rewrite runs under the emulator against the original."""

from __future__ import annotations

import types
from pathlib import Path

import torch

from apply_support import make_repo, scan
from npufuse.patterns.add_rms_norm import AddRmsNorm
from scratch_repo import import_fresh
from test_detect_s32_addnorm import _apply_and_compare, _run

_LAYERS = '''\
import torch
from torch import nn


class T5Norm(nn.Module):
    """T5's norm: no bias, no mean subtraction."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(size))
        self.eps = eps

    def forward(self, x):
        orig_type = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)
        return self.scale.to(orig_type) * x.to(orig_type)


class CenteredNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return self.scale * x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)
'''

_MODEL = '''\
import torch
from torch import nn

from pkg import layers
from pkg.layers import T5Norm


class EncoderLayer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.pre_mlp_norm = layers.T5Norm(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, inputs):
        x = self.attn(inputs)
        x = x + inputs
        y = self.pre_mlp_norm(x)
        y = self.mlp(y)
        return y + x


class CenteredLayer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.pre_mlp_norm = layers.CenteredNorm(dim)

    def forward(self, inputs):
        x = self.attn(inputs) + inputs
        y = self.pre_mlp_norm(x)
        return y + x


class FlagBlock(nn.Module):
    def __init__(self, dim, rms=True):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.ffn_norm = T5Norm(dim) if rms else nn.LayerNorm(dim)
        self.ffn = nn.Linear(dim, dim)

    def forward(self, x):
        x = x + self.attn(x)
        x = x + self.ffn(self.ffn_norm(x))
        return x


class DecoderLayer(nn.Module):
    def __init__(self, dim, cross=True):
        super().__init__()
        self.cross = cross
        self.attn = nn.Linear(dim, dim)
        self.pre_cross_norm = layers.T5Norm(dim)
        self.cross_attn = nn.Linear(dim, dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, inputs):
        x = self.attn(inputs)
        x = x + inputs
        if self.cross:
            y = self.pre_cross_norm(x)
            y = self.cross_attn(y)
            y = y + x
        else:
            y = x
        return self.mlp(y) + y
'''


def _blocks(mod: types.ModuleType) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return _run([mod.EncoderLayer(32), mod.FlagBlock(32), mod.FlagBlock(32, rms=False),
                 mod.DecoderLayer(32), mod.DecoderLayer(32, cross=False)])


def test_norm_classes_of_a_submodule_a_flag_and_an_if_body(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/layers.py": _LAYERS, "pkg/model.py": _MODEL}
    ref = _blocks(import_fresh(make_repo(tmp_path / "ref", files), "pkg.model"))
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=[AddRmsNorm()])
    cands = {c["qualname"]: c for c in data["candidates"] if c["pattern"] == "add_rms_norm"}
    assert sorted(cands) == ["DecoderLayer.forward", "EncoderLayer.forward", "FlagBlock.forward"], data["near_misses"]
    # ``layers.T5Norm``: the class of pkg/layers.py, read there, the fused code guarded on its type
    enc = cands["EncoderLayer.forward"]
    assert (enc["line"], enc["end_line"]) == (17, 18)
    assert enc["params"]["weight"] == "self.pre_mlp_norm.scale" and "type(self.pre_mlp_norm) is layers.T5Norm" in enc["params"]["condition"]
    # ``T5Norm(dim) if rms else nn.LayerNorm(dim)``: fused where the attribute is the T5Norm
    flag = cands["FlagBlock.forward"]
    assert "type(self.ffn_norm) is T5Norm" in flag["params"]["condition"], flag["params"]
    # the norm heads the if's body: the add moves into both branches
    dec = cands["DecoderLayer.forward"]
    assert (dec["line"], dec["end_line"]) == (59, 65), dec
    # the mean-subtracting class of the submodule is refused with the reason found in its file
    centered = [m for m in data["near_misses"] if m["qualname"] == "CenteredLayer.forward"]
    assert centered and "is not RMSNorm" in centered[0]["reason"] and "pkg/layers.py" in centered[0]["reason"], data["near_misses"]
    # EncoderLayer, FlagBlock(rms=True) and DecoderLayer(cross=True) fuse in their bf16 no-grad runs
    _apply_and_compare(root, "pkg.model", _blocks, ref, fused=3)
