"""s37 norm pass (HO13 development data): norm modules whose construction npufuse cannot read.

A norm attribute built by a base class of another file (VisionLLaMA's ``RBlockRMSNorm(timm Block)``
handing ``norm_layer=RMSNorm`` to ``super().__init__``): the class the subclass hands on is fused where
the attribute's run-time type is exactly it; another class there runs the original statements."""

from __future__ import annotations

import types
from pathlib import Path

import torch

from apply_support import make_repo, npufuse, scan
from npufuse import emulate
from npufuse.patterns.add_rms_norm import AddRmsNorm
from scratch_repo import import_fresh

_LAYERS = '''\
import torch
from torch import nn


class ResidualUnit(nn.Module):
    """Builds its norms from the class it is handed (the subclass's file never assigns them)."""

    def __init__(self, width, hidden, make_norm=nn.LayerNorm):
        super().__init__()
        self.norm_a = make_norm(width)
        self.norm_b = make_norm(width)
        self.token_mix = nn.Linear(width, width)
        self.channel_mix = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
'''

_MODEL = '''\
import torch
from torch import nn

from pkg.layers import ResidualUnit


class PixelRMS(nn.Module):
    def __init__(self, width, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, t):
        return self.scale * (t.float() * torch.rsqrt(t.float().square().mean(-1, keepdim=True) + self.eps)).to(t.dtype)


class Block(ResidualUnit):
    def __init__(self, width, make_norm=PixelRMS):
        super().__init__(width, 2 * width, make_norm)
        self.gamma = nn.Parameter(torch.full((width,), 0.5))

    def forward(self, t):
        t = t + self.gamma * self.token_mix(self.norm_a(t))
        t = t + self.gamma * self.channel_mix(self.norm_b(t))
        return t
'''


def _run(mod: types.ModuleType, norm: type | None) -> torch.Tensor:
    torch.manual_seed(0)
    blk = (mod.Block(32) if norm is None else mod.Block(32, norm)).to(torch.bfloat16)
    with torch.no_grad():
        return blk(torch.randn(2, 5, 32, dtype=torch.bfloat16))


def test_norm_built_by_a_base_of_another_file_is_fused_where_it_is_the_handed_class(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/layers.py": _LAYERS, "pkg/model.py": _MODEL}
    ref_mod = import_fresh(make_repo(tmp_path / "ref", files), "pkg.model")
    ref = [_run(ref_mod, None), _run(ref_mod, torch.nn.LayerNorm)]
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=[AddRmsNorm()])
    cands = [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    assert [(c["qualname"], c["params"]["condition"], c["params"]["weight"]) for c in cands] == [
        ("Block.forward", "type(self.norm_b) is PixelRMS", "self.norm_b.scale")], data["near_misses"]
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    with emulate.install() as emu:
        mod = import_fresh(root, "pkg.model")
        rms = _run(mod, None)
        assert emu.calls["npu_add_rms_norm"] == 1, emu.calls
        layer = _run(mod, torch.nn.LayerNorm)  # the type check fails: the original statements
        assert emu.calls["npu_add_rms_norm"] == 1, emu.calls
    for a, b in zip(ref, [rms, layer]):
        assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_layer_norm_handed_to_a_base_of_another_file_is_a_near_miss(tmp_path: Path) -> None:
    model = _MODEL.replace("make_norm=PixelRMS", "make_norm=nn.LayerNorm")
    root = make_repo(tmp_path / "repo", {"pkg/__init__.py": "", "pkg/layers.py": _LAYERS, "pkg/model.py": model})
    data = scan(root, patterns=[AddRmsNorm()])
    assert not [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    reasons = [m["reason"] for m in data["near_misses"] if m["pattern"] == "add_rms_norm"]
    assert any("handed to the base is not RMSNorm (nn.LayerNorm" in r and "ResidualUnit" in r for r in reasons), reasons


# -- a forward installed on transformers' decoder layers (MoE-LLaVA's closure factory) ---------------

_PATCH = '''\
import torch


def make_forward(self):
    def forward(hidden_states, position_embeddings=None, **kw):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states, position_embeddings=position_embeddings, attention_mask=None, **kw)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states

    return forward


def install(layer):
    layer.forward = make_forward(layer)
    return layer
'''


def test_forward_installed_on_a_transformers_layer_is_fused_where_the_norm_is_llama_style(tmp_path: Path) -> None:
    from test_apply_transformers import _transformers

    tf = _transformers()
    from transformers.models.llama import modeling_llama as ml

    files = {"pkg/__init__.py": "", "pkg/patch.py": "from transformers import LlamaConfig\n" + _PATCH}

    def run(mod: types.ModuleType) -> torch.Tensor:
        torch.manual_seed(0)
        cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4)
        cfg._attn_implementation = "eager"
        layer = mod.install(ml.LlamaDecoderLayer(cfg, 0).to(torch.bfloat16))
        x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
        rope = ml.LlamaRotaryEmbedding(cfg)
        pos = rope(x, torch.arange(5)[None])
        with torch.no_grad():
            return layer(x, position_embeddings=pos)

    ref = run(import_fresh(make_repo(tmp_path / "ref", files), "pkg.patch"))
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=[AddRmsNorm()])
    cands = [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    assert [c["qualname"] for c in cands] == ["make_forward.forward"], data["near_misses"]
    assert 'type(self.post_attention_layernorm).__module__.startswith("transformers.")' in cands[0]["params"]["condition"]
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    with emulate.install() as emu:
        out = run(import_fresh(root, "pkg.patch"))
    assert emu.calls["npu_add_rms_norm"] == 1, emu.calls
    assert out.dtype == ref.dtype and torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


# -- diffusers' RMSNorm built in a norm-layer factory (SeedVR's ``get_norm_layer``) ---------------------

class _DiffusersRMSNorm(torch.nn.Module):
    """diffusers' RMSNorm before 0.33 (src/diffusers/models/normalization.py, 0.30+ with the optional bias)."""

    def __init__(self, dim, eps: float, elementwise_affine: bool = True, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.dim = torch.Size((dim,) if isinstance(dim, int) else dim)
        self.weight = torch.nn.Parameter(torch.ones(self.dim)) if elementwise_affine else None
        self.bias = torch.nn.Parameter(torch.zeros(self.dim)) if elementwise_affine and bias else None

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        if self.weight is not None:
            if self.weight.dtype in [torch.float16, torch.bfloat16]:
                hidden_states = hidden_states.to(self.weight.dtype)
            hidden_states = hidden_states * self.weight
            if self.bias is not None:
                hidden_states = hidden_states + self.bias
        else:
            hidden_states = hidden_states.to(input_dtype)
        return hidden_states


_FACTORY = '''\
import torch
from torch import nn
from diffusers.models.normalization import RMSNorm


def make_norm(kind):
    def build(width, eps, affine, **extra):
        if kind == "layer":
            return nn.LayerNorm(width, eps=eps, elementwise_affine=affine)
        if kind == "rms":
            return RMSNorm(width, eps=eps, elementwise_affine=affine, **extra)
        raise ValueError(kind)

    return build


class Block(nn.Module):
    def __init__(self, width, kind="rms", affine=True, **extra):
        super().__init__()
        self.norm = make_norm(kind)(width, 1e-6, affine, **extra)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        return self.proj(self.norm(x))
'''


def test_diffusers_rmsnorm_built_by_a_factory_is_swapped_and_returns_diffusers_dtypes(monkeypatch) -> None:
    from pattern_harness import detect_all, install_stand_in_modules

    from npufuse.patterns import rms_norm as R
    from npufuse.rewrite.codegen import splice

    _DiffusersRMSNorm.__module__ = "diffusers.models.normalization"
    install_stand_in_modules(monkeypatch, {"diffusers.models.normalization": {"RMSNorm": _DiffusersRMSNorm}})
    findings, _ = detect_all(R.RmsNorm(), _FACTORY)
    assert [(f.qualname, f.variant, f.params["module"]) for f in findings] == [
        ("make_norm.build", "library_rmsnorm", "diffusers.models.normalization.RMSNorm")]
    text = splice(_FACTORY, findings)

    def run(code: str, x: torch.Tensor, weight_dtype, **kw) -> tuple[torch.Tensor, dict]:
        ns: dict = {}
        with emulate.install() as emu:
            exec(compile(code, "<block>", "exec"), ns)
            torch.manual_seed(0)
            blk = ns["Block"](16, **kw)
            with torch.no_grad():
                for p in blk.norm.parameters():
                    p.normal_()
            blk.norm.to(weight_dtype)
            out = blk.norm(x)
            return out, dict(emu.calls)

    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    for weight_dtype, kw in [(torch.bfloat16, {}), (torch.float32, {}), (torch.float32, {"affine": False}), (torch.float32, {"bias": True})]:
        ref, _ = run(_FACTORY, x, weight_dtype, **kw)
        out, calls = run(text, x, weight_dtype, **kw)
        assert out.dtype == ref.dtype, (weight_dtype, kw)
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
        # a bias keeps diffusers' own forward
        assert calls.get("npu_rms_norm", 0) == (0 if kw.get("bias") else 1), (kw, calls)
