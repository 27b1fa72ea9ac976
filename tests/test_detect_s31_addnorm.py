"""s31 add_rms_norm pass (HO6/HO7 development data): what needs a repository. The single-file forms
are examples in patterns/add_rms_norm.py; here the norm helper is imported from another file of the
repository (HRM's ``from models.layers import rms_norm``): read there, bound to this call's
arguments, rewritten and run under the emulator."""

from __future__ import annotations

import types
from pathlib import Path

import torch

from apply_support import make_repo, npufuse, scan
from npufuse import emulate
from npufuse.patterns.add_rms_norm import AddRmsNorm
from scratch_repo import import_fresh, run_block

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


def test_norm_helper_imported_from_another_file_is_read_there(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/layers.py": _LAYERS, "pkg/model.py": _MODEL}
    ref = run_block(import_fresh(make_repo(tmp_path / "ref", files), "pkg.model"))
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
        outs = run_block(import_fresh(root, "pkg.model"))
    assert emu.calls["npu_add_rms_norm"] == 2, emu.calls
    for a, b in zip(ref, outs):
        assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


# -- norm classes defined in another file of the repository --------------------------------------

_NORMS = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F

FLOOR = 1e-6


class Norm(nn.Module):
    """Gemma-style (1 + weight), whatever its name says."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        return (output * (1.0 + self.weight.float())).type_as(x)


class LibNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class RMSNorm(nn.Module):
    """A LayerNorm under an RMSNorm name."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias


class FlooredRMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + FLOOR) * self.weight
'''

_BLOCKS = '''\
import torch
from torch import nn

from pkg.norms import Norm, LibNorm
from .norms import RMSNorm, FlooredRMSNorm


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.attn_norm = Norm(d)
        self.ffn_norm = Norm(d)

    def forward(self, x):
        h = x + self.attn(self.attn_norm(x))
        out = h + self.mlp(self.ffn_norm(h))
        return out
''' + "".join(f"""

class {name}(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.norm = {ctor}

    def forward(self, x):
        h = x + self.attn(x)
        return self.norm(h)
""" for name, ctor in (("LibBlock", "LibNorm(d, eps=1e-5)"), ("LnBlock", "RMSNorm(d)"), ("FlooredBlock", "FlooredRMSNorm(d)"))) + '''

class FlagBlock(nn.Module):
    """LightningDiT: a LayerNorm without weight unless a flag asks for the repository's norm."""

    def __init__(self, d, use_rmsnorm=True):
        super().__init__()
        self.attn = nn.Linear(d, d)
        if not use_rmsnorm:
            self.norm = nn.LayerNorm(d, elementwise_affine=False)
        else:
            self.norm = Norm(d)

    def forward(self, x):
        h = x + self.attn(x)
        return self.norm(h)
'''


def _run_blocks(mod: types.ModuleType) -> list[torch.Tensor]:
    torch.manual_seed(0)
    outs = []
    for blk in (mod.Block(32), mod.LibBlock(32), mod.FlagBlock(32), mod.FlagBlock(32, use_rmsnorm=False)):
        with torch.no_grad():
            for p in blk.parameters():
                p.add_(0.1 * torch.randn_like(p))
        x = torch.randn(2, 5, 32)
        with torch.no_grad():
            outs.append(blk.to(torch.bfloat16)(x.to(torch.bfloat16)))
        outs.append(blk.float()(x))  # grad enabled: the add, then npu_rms_norm
    return outs


def test_norm_class_from_another_file_is_read_there(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/norms.py": _NORMS, "pkg/blocks.py": _BLOCKS}
    ref = _run_blocks(import_fresh(make_repo(tmp_path / "ref", files), "pkg.blocks"))
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=[AddRmsNorm()])
    cands = {c["qualname"]: c for c in data["candidates"] if c["pattern"] == "add_rms_norm"}
    assert set(cands) - {"FlooredBlock.forward"} == {"Block.forward", "LibBlock.forward", "FlagBlock.forward"}, (sorted(cands), data["near_misses"])
    # the attribute may hold another module on another path: fused where it is exactly the class read
    assert "type(self.norm) is Norm" in cands["FlagBlock.forward"]["params"]["condition"]
    # read, not assumed: the (1 + weight) offset and eps of the class's own code, high confidence
    blk = cands["Block.forward"]
    assert blk["params"]["norm_class"] == "Norm (from pkg/norms.py)" and blk["confidence"] == "high"
    assert blk["params"]["weight_offset"] == 1 and blk["params"]["eps"] == "self.ffn_norm.eps"
    assert cands["LibBlock.forward"]["variant"] == "library_norm"
    near = {m["qualname"]: m["reason"] for m in data["near_misses"] if m["pattern"] == "add_rms_norm"}
    # the LayerNorm named RMSNorm is no longer taken on its name
    assert "mean subtracted" in near.get("LnBlock.forward", ""), near
    # a class reading a constant of its own file is not followed; its name still says RMSNorm,
    # so the unverified reading (medium confidence, checked at run time) stands as before
    assert cands["FlooredBlock.forward"]["confidence"] == "medium" and cands["FlooredBlock.forward"]["variant"] == "external_norm"
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    with emulate.install() as emu:
        outs = _run_blocks(import_fresh(root, "pkg.blocks"))
    assert emu.calls["npu_add_rms_norm"] == 3, emu.calls  # not the FlagBlock holding a LayerNorm
    for a, b in zip(ref, outs):
        assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


# -- a norm factory of another file (torchtitan / cosmos ``create_norm``), a compiled method, and the
# add that ends an optional branch before the norm ------------------------------------------------

_FACTORY = '''\
import torch
import torch.nn as nn


def create_norm(norm_type: str, dim: int, eps: float = 1e-6):
    norm_type = norm_type.lower()
    if norm_type == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=False)
    elif norm_type == "rmsnorm":
        return RMSNorm(dim, eps=eps, compile=False)
    else:
        raise NotImplementedError(norm_type)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, compile: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.rmsnorm_fn = torch.compile(self.compute_rmsnorm, fullgraph=True) if compile else self.compute_rmsnorm

    @staticmethod
    def compute_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float):
        def _norm(x, eps):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

        output = _norm(x.float(), eps).type_as(x)
        return output * weight

    def forward(self, x: torch.Tensor):
        return self.rmsnorm_fn(x, self.weight, self.eps)
'''

_FACTORY_BLOCK = '''\
import torch
from torch import nn

from pkg.normalization import create_norm


class TransformerBlock(nn.Module):
    def __init__(self, dim, norm_type="rmsnorm", cross=False):
        super().__init__()
        self.attention = nn.Linear(dim, dim)
        self.has_cross_attention = cross
        self.cross_attention = nn.Linear(dim, dim)
        self.cross_attention_norm = create_norm(norm_type, dim=dim, eps=1e-5)
        self.feed_forward = nn.Linear(dim, dim)
        self.attention_norm = create_norm(norm_type, dim=dim, eps=1e-5)
        self.ffn_norm = create_norm(norm_type, dim=dim, eps=1e-5)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        if self.has_cross_attention:
            h = h + self.cross_attention(self.cross_attention_norm(h))
        out = h + self.feed_forward(self.ffn_norm(h))
        return out
'''


def _run_factory(mod: types.ModuleType) -> list[torch.Tensor]:
    torch.manual_seed(0)
    outs = []
    for kw in ({"cross": True}, {"cross": False}, {"cross": True, "norm_type": "layernorm"}):
        blk = mod.TransformerBlock(32, **kw)
        with torch.no_grad():
            for p in blk.parameters():
                p.add_(0.1 * torch.randn_like(p))
        x = torch.randn(2, 5, 32)
        with torch.no_grad():
            outs.append(blk.to(torch.bfloat16)(x.to(torch.bfloat16)))
        outs.append(blk.float()(x))
    return outs


def test_norm_factory_of_another_file_with_a_run_time_type_check(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/normalization.py": _FACTORY, "pkg/model.py": _FACTORY_BLOCK}
    ref = _run_factory(import_fresh(make_repo(tmp_path / "ref", files), "pkg.model"))
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=[AddRmsNorm()])
    cands = [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    # the add before the optional branch (normalised inside it), and the add ending the branch
    # (normalised after it): two sites sharing the ``if``, one rewritten at a time
    assert [(c["line"], c["end_line"]) for c in cands] == [(19, 21), (20, 22)], data["near_misses"]
    tail = cands[1]
    assert 'type(self.ffn_norm).__module__ == "pkg.normalization"' in tail["params"]["condition"]
    assert tail["params"]["norm_class"] == "RMSNorm (returned by create_norm(...) (from pkg/normalization.py))"
    for cid in (str(c["id"]) for c in cands):
        work = make_repo(tmp_path / f"repo{cid}", files)
        scan(work, patterns=[AddRmsNorm()])
        assert npufuse("apply", "--accept", cid, "--state-dir", str(work / ".npufuse")) == 0
        with emulate.install() as emu:
            outs = _run_factory(import_fresh(work, "pkg.model"))
        # bf16 inference with the RMSNorm of the factory, the cross-attention branch taken: fused
        assert emu.calls["npu_add_rms_norm"] == 1, (cid, emu.calls)
        for a, b in zip(ref, outs):
            assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)
