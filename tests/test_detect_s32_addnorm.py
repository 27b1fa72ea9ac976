"""s32 add_rms_norm pass (HO8 development data): TriForce's decoder methods call a functional RMSNorm of
another file with keywords only (``RMSNorm(hidden_states=h, layernorm_variance_epsilon=...,
layernorm_weight=self.layers[i].w)``). The sum is the argument bound to the helper's first parameter
in its own file; the rewrite is run under the emulator against the original."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Callable

import torch

from apply_support import make_repo, npufuse, scan
from npufuse import emulate
from npufuse.patterns.add_rms_norm import AddRmsNorm
from scratch_repo import import_fresh

_OPS = '''\
import torch


def RMSNorm(hidden_states, layernorm_variance_epsilon, layernorm_weight):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + layernorm_variance_epsilon)
    hidden_states = layernorm_weight * hidden_states.to(input_dtype)
    return hidden_states


def LayerNorm(hidden_states, layernorm_variance_epsilon, layernorm_weight):
    hidden_states = hidden_states - hidden_states.mean(-1, keepdim=True)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return layernorm_weight * (hidden_states * torch.rsqrt(variance + layernorm_variance_epsilon))
'''

_MODEL = '''\
import torch
from torch import nn

from .ops import RMSNorm, LayerNorm


class LayerWeights(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.wo = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.post_weight = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.post_eps = 1e-6


class Decoder(nn.Module):
    def __init__(self, d, n=2):
        super().__init__()
        self.layers = nn.ModuleList([LayerWeights(d) for _ in range(n)])

    def layer_compute(self, layer_idx, hidden_states):
        residual = hidden_states
        hidden_states = self.layers[layer_idx].wo(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = RMSNorm(
            hidden_states=hidden_states,
            layernorm_variance_epsilon=self.layers[layer_idx].post_eps,
            layernorm_weight=self.layers[layer_idx].post_weight,
        )
        hidden_states = self.layers[layer_idx].mlp(hidden_states)
        return residual + hidden_states

    def layer_ln(self, layer_idx, hidden_states):
        hidden_states = hidden_states + self.layers[layer_idx].wo(hidden_states)
        return LayerNorm(hidden_states=hidden_states, layernorm_variance_epsilon=1e-5,
                         layernorm_weight=self.layers[layer_idx].post_weight)

    def forward(self, x):
        for i in range(len(self.layers)):
            x = self.layer_compute(i, x)
        return x
'''


def _run(mods: list[torch.nn.Module]) -> list[torch.Tensor]:
    """Each module in bf16 without grad (npu_add_rms_norm), then in fp32 with grad (the add, npu_rms_norm)."""
    outs = []
    for m in mods:
        x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
        with torch.no_grad():
            outs.append(m.to(torch.bfloat16)(x))
        outs.append(m.float()(x.float()))
    return outs


def _apply_and_compare(root: Path, name: str, run: Callable[[types.ModuleType], list[torch.Tensor]], ref: list[torch.Tensor],
                       fused: int) -> None:
    """Accept every candidate, then run the rewritten module under the emulator against ``ref``."""
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    assert "npu_add_rms_norm" in (root / (name.replace(".", "/") + ".py")).read_text(encoding="utf-8")
    with emulate.install() as emu:
        outs = run(import_fresh(root, name))
    assert emu.calls["npu_add_rms_norm"] == fused, emu.calls
    for a, b in zip(ref, outs):
        assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def _decoders(mod: types.ModuleType) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return _run([mod.Decoder(32)])


def test_keyword_only_norm_helper_of_another_file(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/ops.py": _OPS, "pkg/model.py": _MODEL}
    ref = _decoders(import_fresh(make_repo(tmp_path / "ref", files), "pkg.model"))
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=[AddRmsNorm()])
    cands = [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    assert [(c["qualname"], c["line"]) for c in cands] == [("Decoder.layer_compute", 24)], data["near_misses"]
    assert cands[0]["params"]["eps"] == "self.layers[layer_idx].post_eps"
    assert cands[0]["params"]["norm_class"] == "RMSNorm (from pkg/ops.py)"
    # the mean-subtracting helper, called the same way, is refused with the reason found in its file
    ln = [m for m in data["near_misses"] if m["qualname"] == "Decoder.layer_ln"]
    assert ln and "pkg/ops.py" in ln[0]["reason"] and "is not RMSNorm" in ln[0]["reason"], data["near_misses"]
    _apply_and_compare(root, "pkg.model", _decoders, ref, fused=2)


# -- a decoder loop over the layers of a model built from another file ------------------------------

_MODELING = '''\
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DecoderLayer(nn.Module):
    def __init__(self, d, rms=True):
        super().__init__()
        self.input_layernorm = RMSNorm(d)
        self.self_attn = nn.Linear(d, d)
        self.post_attention_layernorm = RMSNorm(d) if rms else nn.LayerNorm(d)
        self.mlp = nn.Linear(d, d)


class LnLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.self_attn = nn.Linear(d, d)
        self.post_attention_layernorm = nn.LayerNorm(d)


class Model(nn.Module):
    def __init__(self, d, n=2, rms=True):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(n):
            self.layers.append(DecoderLayer(d, rms))
        self.ln_layers = nn.ModuleList([LnLayer(d) for _ in range(n)])
'''

_RUNNER = '''\
import torch
from torch import nn

from .modeling import Model


class Runner(nn.Module):
    def __init__(self, d, rms=True):
        super().__init__()
        self.model = Model(d, rms=rms)

    def forward(self, hidden_states):
        for i, decode_layer in enumerate(self.model.layers):
            residual = hidden_states
            hidden_states = decode_layer.input_layernorm(hidden_states)
            hidden_states = decode_layer.self_attn(hidden_states)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = decode_layer.post_attention_layernorm(hidden_states)
            hidden_states = decode_layer.mlp(hidden_states)
            hidden_states = residual + hidden_states
        return hidden_states

    def layer_norm_loop(self, hidden_states):
        for layer in self.model.ln_layers:
            hidden_states = hidden_states + layer.self_attn(hidden_states)
            hidden_states = layer.post_attention_layernorm(hidden_states)
        return hidden_states
'''


def _run_runner(mod: types.ModuleType) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return _run([mod.Runner(32, rms=True), mod.Runner(32, rms=False)])


def test_decoder_loop_over_layers_of_a_model_of_another_file(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/modeling.py": _MODELING, "pkg/runner.py": _RUNNER}
    ref = _run_runner(import_fresh(make_repo(tmp_path / "ref", files), "pkg.runner"))
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=[AddRmsNorm()])
    cands = [c for c in data["candidates"] if c["pattern"] == "add_rms_norm" and c["file"] == "pkg/runner.py"]
    assert [(c["qualname"], c["line"]) for c in cands] == [("Runner.forward", 17)], data["near_misses"]
    p = cands[0]["params"]
    assert p["norm"] == "decode_layer.post_attention_layernorm" and p["norm_class"] == "RMSNorm (from pkg/modeling.py)", p
    assert 'type(decode_layer.post_attention_layernorm).__qualname__ == "RMSNorm"' in p["condition"], p
    ln = [m for m in data["near_misses"] if m["qualname"] == "Runner.layer_norm_loop"]
    assert ln and "nn.LayerNorm" in ln[0]["reason"] and "pkg/modeling.py" in ln[0]["reason"], data["near_misses"]
    # two layers fused in inference with the RMSNorm; the LayerNorm built by the flag runs the original
    _apply_and_compare(root, "pkg.runner", _run_runner, ref, fused=2)
