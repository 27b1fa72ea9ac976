"""s31 add_rms_norm pass (HO6/HO7 development data): what needs a repository. The single-file forms
are examples in patterns/add_rms_norm.py; here the norm helper is imported from another file of the
repository (HRM's ``from models.layers import rms_norm``): read there, bound to this call's
arguments, rewritten and run under the emulator."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import torch

from apply_support import make_repo, npufuse, scan
from npufuse import emulate
from npufuse.patterns.add_rms_norm import AddRmsNorm

_LAYERS = '''\
import torch

EPS_FLOOR = 1e-6


def rms_norm(hidden_states: torch.Tensor, variance_epsilon: float) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.square().mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + variance_epsilon)
    return hidden_states.to(input_dtype)


def floored_rms_norm(x, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + max(eps, EPS_FLOOR))


def layer_norm(x, eps=1e-5):
    x = x - x.mean(-1, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
'''

_MODEL = '''\
import torch
from torch import nn

from pkg.layers import rms_norm
from .layers import floored_rms_norm, layer_norm


class Block(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.self_attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.norm_eps = eps

    def forward(self, hidden_states):
        hidden_states = rms_norm(hidden_states + self.self_attn(hidden_states), variance_epsilon=self.norm_eps)
        hidden_states = rms_norm(hidden_states + self.mlp(hidden_states), variance_epsilon=self.norm_eps)
        return hidden_states


class Floored(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mlp = nn.Linear(d, d)

    def forward(self, x):
        return floored_rms_norm(x + self.mlp(x))


class Post(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mlp = nn.Linear(d, d)

    def forward(self, x):
        return layer_norm(x + self.mlp(x))
'''


def _import_fresh(root: Path, name: str) -> types.ModuleType:
    sys.path.insert(0, str(root))
    try:
        for key in [k for k in sys.modules if k == "pkg" or k.startswith("pkg.")]:
            del sys.modules[key]
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(root))
        for key in [k for k in sys.modules if k == "pkg" or k.startswith("pkg.")]:
            del sys.modules[key]


def _run(mod: types.ModuleType) -> list[torch.Tensor]:
    torch.manual_seed(0)
    blk = mod.Block(32).to(torch.bfloat16)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        inference = blk(x)
    train = blk.float()(x.float())
    return [inference, train]


def test_norm_helper_imported_from_another_file_is_read_there(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/layers.py": _LAYERS, "pkg/model.py": _MODEL}
    ref = _run(_import_fresh(make_repo(tmp_path / "ref", files), "pkg.model"))
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=[AddRmsNorm()])
    cands = [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    assert sorted((c["qualname"], c["line"]) for c in cands) == [("Block.forward", 16), ("Block.forward", 17)], data["near_misses"]
    assert all(c["params"]["eps"] == "self.norm_eps" and c["params"]["norm_class"] == "rms_norm (from pkg/layers.py)" for c in cands)
    # a helper reading another name of its file (EPS_FLOOR) is not followed: no site, no guess
    assert not any(m["qualname"] == "Floored.forward" for m in data["near_misses"])
    # the mean-subtracting helper is refused with the reason found in its file
    post = [m for m in data["near_misses"] if m["qualname"] == "Post.forward"]
    assert post and "pkg/layers.py" in post[0]["reason"] and "is not RMSNorm" in post[0]["reason"], data["near_misses"]
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    assert "npu_add_rms_norm" in (root / "pkg" / "model.py").read_text(encoding="utf-8")
    with emulate.install() as emu:
        outs = _run(_import_fresh(root, "pkg.model"))
    assert emu.calls["npu_add_rms_norm"] == 2, emu.calls
    for a, b in zip(ref, outs):
        assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)
