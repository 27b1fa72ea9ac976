"""Held-out 4 development misses of rms_norm / add_rms_norm / rope / attention / sdpa (issue 14):
each class end to end (detected, rewritten, run under the emulator against the original)."""

from __future__ import annotations

import sys
import types

import torch

from npufuse import emulate
from npufuse.patterns import rms_norm as R
from npufuse.rewrite.codegen import splice
from pattern_harness import _exec, detect_all


class _StandInLlamaRMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm forward, written out (transformers is not a dependency)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _StandInDecoderLayer(torch.nn.Module):
    """An inherited forward calling the norms (the repo's subclass never calls them itself)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.proj = torch.nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        h = x + self.proj(self.input_layernorm(x))
        return self.post_attention_layernorm(h)


class _StandInModel(torch.nn.Module):
    def __init__(self, config):
        super().__init__()

    def forward(self, x):
        return self.norm(x)


def _install_stand_in_transformers(monkeypatch) -> None:
    for name in ("transformers", "transformers.models", "transformers.models.llama"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    llama = types.ModuleType("transformers.models.llama.modeling_llama")
    llama.LlamaRMSNorm = _StandInLlamaRMSNorm  # type: ignore[attr-defined]
    llama.LlamaDecoderLayer = _StandInDecoderLayer  # type: ignore[attr-defined]
    llama.LlamaModel = _StandInModel  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, llama.__name__, llama)


def test_transformers_rmsnorm_built_for_inherited_forward_is_swapped_and_matches(monkeypatch):
    _install_stand_in_transformers(monkeypatch)
    code = R._HF_NORM_BUILT_FOR_INHERITED
    findings, _ = detect_all(R.RmsNorm(), code)
    assert [(f.qualname, f.line, f.variant) for f in findings] == [
        ("SparseLayer.__init__", 10, "hf_norm_construction"),
        ("SparseLayer.__init__", 11, "hf_norm_construction"),
        ("Backbone.__init__", 19, "hf_norm_construction"),
    ]
    text = splice(code, findings)
    cfg = types.SimpleNamespace(hidden_size=16, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    ref_mod = _exec(code, "orig")["SparseLayer"](cfg, 0).to(torch.bfloat16)
    with torch.no_grad():
        ref_mod.input_layernorm.weight.normal_()
        ref_mod.post_attention_layernorm.weight.normal_()
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    ref = ref_mod(x)
    with emulate.install() as emu:
        mod = _exec(text, "new")["SparseLayer"](cfg, 0).to(torch.bfloat16)
        mod.load_state_dict(ref_mod.state_dict())  # the state_dict keys are unchanged by the swap
        out = mod(x)
        assert emu.calls.get("npu_rms_norm") == 2
        fp32 = _exec(text, "new32")["Backbone"](cfg)
        y = torch.randn(3, 16)
        assert torch.allclose(fp32(y), _StandInLlamaRMSNorm(16, 1e-5)(y), atol=1e-6)
        assert emu.calls.get("npu_rms_norm") == 3
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.nn.functional.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0) > 0.999


def test_transformers_rmsnorm_called_by_its_own_class_stays_a_call_site_finding():
    # the class calls self.norm itself: the call is the finding (hf_norm_module), not the construction
    findings, _ = detect_all(R.RmsNorm(), R._HF_NORM_IMPORTED)
    assert {f.variant for f in findings} == {"hf_norm_module"}
