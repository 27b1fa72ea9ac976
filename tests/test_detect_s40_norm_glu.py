"""s40 sweep of the rms_norm / add_rms_norm / swiglu / geglu development misses: timm's RMSNorm classes
after a residual add.

add_rms_norm read every outside class with an RMSNorm-like name as Hugging Face's (x * rsqrt(mean(x^2) +
eps) * weight) under a run-time check of attribute names (``weight``, ``eps``, no ``dim``), which timm's
classes pass although not all compute that: timm <= 1.0.12's RmsNorm divides by the root of the unbiased
variance (mean subtracted, timm issue #2380) and RmsNorm2d normalises dim 1 of NCHW input. The stand-ins
below spell timm's forwards as its releases do (timm/layers/norm.py and fast_norm.py at v1.0.12, v1.0.13+)."""

from __future__ import annotations

import torch
from torch import nn

from npufuse import emulate


class _RmsNormMain(nn.Module):
    """timm.layers.norm.RmsNorm, 1.0.13 and later (``_fast_norm`` False: timm's rms_norm, mean of squares)."""

    def __init__(self, channels: int, eps: float = 1e-6, affine: bool = True) -> None:
        super().__init__()
        self.normalized_shape = (channels,)
        self.eps = eps
        self.elementwise_affine = affine
        self._fast_norm = False
        self.weight = nn.Parameter(torch.ones(self.normalized_shape)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = torch.mean(x.pow(2), dim=(-1,), keepdim=True)
        x = x * torch.rsqrt(v + self.eps)
        return x * self.weight if self.weight is not None else x


class _RmsNorm1012(_RmsNormMain):
    """timm.layers.norm.RmsNorm at 1.0.12 and before: no ``_fast_norm``, the fast path's fallback
    ``x * rsqrt(var(x) + eps) * weight`` (mean-centred, unbiased)."""

    def __init__(self, channels: int, eps: float = 1e-6, affine: bool = True) -> None:
        super().__init__(channels, eps, affine)
        del self._fast_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = torch.var(x, dim=(-1,), keepdim=True)
        x = x * torch.rsqrt(v + self.eps)
        return x * self.weight if self.weight is not None else x


class _RmsNormFp32(_RmsNormMain):
    """timm.layers.norm.RmsNormFp32: statistics and weight in fp32, x's dtype out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        v = torch.mean(xf.pow(2), dim=(-1,), keepdim=True)
        return (xf * torch.rsqrt(v + self.eps) * self.weight.float()).to(x.dtype)


_MODEL = '''\
import torch
from torch import nn
from timm.layers import RmsNorm, RmsNormFp32


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1 = RmsNorm(d, eps=1e-6)
        self.norm2 = RmsNorm(d, eps=1e-6)
        self.attn = nn.Linear(d, d)
        self.ffn = nn.Linear(d, d)

    def forward(self, x):
        origin_x = x
        x = self.attn(self.norm1(x))
        x = x + origin_x
        origin_x = x
        x = self.norm2(x)
        return self.ffn(x) + origin_x


class Fp32Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = RmsNormFp32(d, eps=1e-5)
        self.ffn = nn.Linear(d, d)

    def forward(self, x, y):
        h = x + y
        return h + self.ffn(self.norm(h))
'''

_CONV = '''\
from torch import nn
from timm.layers import RmsNorm2d


class ConvBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = RmsNorm2d(d, eps=1e-6)
        self.conv = nn.Conv2d(d, d, 3, padding=1)

    def forward(self, x, y):
        x = x + self.conv(y)
        h = self.norm(x)
        return x + self.conv(h)
'''


def _install(monkeypatch, rms: type) -> None:
    from pattern_harness import install_stand_in_modules

    for cls, name in ((rms, "RmsNorm"), (_RmsNormFp32, "RmsNormFp32")):
        cls.__module__, cls.__name__ = "timm.layers.norm", name
    install_stand_in_modules(monkeypatch, {"timm.layers": {"RmsNorm": rms, "RmsNormFp32": _RmsNormFp32},
                                           "timm.layers.norm": {"RmsNorm": rms, "RmsNormFp32": _RmsNormFp32}})


def _run(code: str, cls: str, args: tuple[torch.Tensor, ...], dtype: torch.dtype, **kw) -> tuple[torch.Tensor, dict]:
    ns: dict = {}
    with emulate.install() as emu:
        exec(compile(code, "<model>", "exec"), ns)
        torch.manual_seed(0)
        blk = ns[cls](16, **kw)
        with torch.no_grad():
            for p in blk.parameters():
                p.normal_()
        blk.to(dtype)
        with torch.no_grad():
            out = blk(*args)
        return out, dict(emu.calls)


def _adds():
    from pattern_harness import detect_all

    from npufuse.patterns import add_rms_norm as A

    return detect_all(A.AddRmsNorm(), _MODEL)


def test_timm_rmsnorm_after_an_add_is_fused_under_timms_class_and_version(monkeypatch) -> None:
    from npufuse.rewrite.codegen import splice

    adds, _ = _adds()
    assert [(f.line, f.params["library_class"], f.params["output_dtype"]) for f in adds] == [
        (17, "timm.RmsNorm", "promote(input, weight)"), (30, "timm.RmsNormFp32", "input")]
    assert 'not getattr(self.norm2, "_fast_norm", True)' in adds[0].params["condition"]
    assert 'type(self.norm).__name__ == "RmsNormFp32"' in adds[1].params["condition"]
    _install(monkeypatch, _RmsNormMain)
    for add, cls, args in ((adds[0], "Block", (torch.randn(2, 5, 16),)), (adds[1], "Fp32Block", (torch.randn(2, 5, 16), torch.randn(2, 5, 16)))):
        for dtype in (torch.float32, torch.bfloat16):
            inputs = tuple(a.to(dtype) for a in args)
            ref, _ = _run(_MODEL, cls, inputs, dtype)
            out, calls = _run(splice(_MODEL, [add]), cls, inputs, dtype)
            assert out.dtype == ref.dtype
            torch.testing.assert_close(out.float(), ref.float(), atol=6e-2, rtol=6e-2)
            assert calls.get("npu_add_rms_norm") == 1, (cls, dtype, calls)


def test_timm_1_0_12_mean_centred_rmsnorm_keeps_its_own_forward(monkeypatch) -> None:
    """Near miss at run time: the generic reading's attribute check passed on timm 1.0.12's RmsNorm (weight,
    eps, no dim) and replaced its variance by the mean of squares."""
    from npufuse.rewrite.codegen import splice

    adds, _ = _adds()
    _install(monkeypatch, _RmsNorm1012)
    x = torch.randn(2, 5, 16) + 3.0  # a mean far from zero: var and mean of squares differ
    ref, _ = _run(_MODEL, "Block", (x,), torch.float32)
    out, calls = _run(splice(_MODEL, adds[:1]), "Block", (x,), torch.float32)
    torch.testing.assert_close(out, ref)
    assert not calls.get("npu_add_rms_norm"), calls


def test_timm_rmsnorm2d_after_an_add_is_a_near_miss_naming_its_channel_dim() -> None:
    from pattern_harness import detect_all

    from npufuse.patterns import add_rms_norm as A

    found, misses = detect_all(A.AddRmsNorm(), _CONV)
    assert found == []
    assert [m.reason for m in misses] == [
        "norm timm.RmsNorm2d normalises dim 1 (the channels of NCHW input), not the last dim that npu_add_rms_norm normalises"]


class _OutsideRMSNorm(nn.Module):
    """An RMSNorm of a library npufuse has no model of (HF semantics), built with or without a weight and with
    liger's ``offset`` attribute (the gain is ``offset + weight``)."""

    def __init__(self, d: int, eps: float = 1e-6, affine: bool = True, offset: float = 0.0) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(d)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (y * (self.offset + self.weight.float()) if self.weight is not None else y).to(x.dtype)


_OUTSIDE = '''\
from torch import nn
from fancylib.layers import FancyRMSNorm


class Block(nn.Module):
    def __init__(self, d, **kw):
        super().__init__()
        self.norm = FancyRMSNorm(d, **kw)
        self.ffn = nn.Linear(d, d)

    def forward(self, x, y):
        h = x + y
        return h + self.ffn(self.norm(h))
'''


def test_an_outside_rmsnorm_without_a_weight_or_with_an_offset_keeps_its_own_forward(monkeypatch) -> None:
    """The generic reading's run-time check named ``hasattr(norm, "weight")``, true for a weight of None
    (the fused code then called ``None.to``), and never looked at an ``offset`` attribute."""
    from pattern_harness import detect_all, install_stand_in_modules

    from npufuse.patterns import add_rms_norm as A
    from npufuse.rewrite.codegen import splice

    adds, _ = detect_all(A.AddRmsNorm(), _OUTSIDE)
    assert [f.line for f in adds] == [12]
    install_stand_in_modules(monkeypatch, {"fancylib.layers": {"FancyRMSNorm": _OutsideRMSNorm}})
    x, y = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    for kw, fused in (({}, 1), ({"affine": False}, 0), ({"offset": 1.0}, 0)):
        ref, _ = _run(_OUTSIDE, "Block", (x, y), torch.float32, **kw)
        out, calls = _run(splice(_OUTSIDE, adds), "Block", (x, y), torch.float32, **kw)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert calls.get("npu_add_rms_norm", 0) == fused, (kw, calls)


_QWEN_VL_LAYER = '''\
import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLDecoderLayer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer


class MoEDecoderLayer(Qwen2_5_VLDecoderLayer):
    def forward(self, hidden_states, token_types=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = hidden_states.to(self.post_attention_layernorm.weight.dtype)
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class PlainLayer(Qwen2DecoderLayer):
    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states))
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)
'''


def test_a_subclass_of_a_qwen_vl_decoder_layer_reads_the_base_norm_at_run_time() -> None:
    """lerobot's wall_x: a subclass of transformers' Qwen2_5_VLDecoderLayer (its norms are Qwen2_5_VLRMSNorm,
    LlamaRMSNorm's code under another name) adds, casts the sum to the norm's weight dtype, then norms it."""
    from pattern_harness import detect_all

    from npufuse.patterns import add_rms_norm as A

    adds, _ = detect_all(A.AddRmsNorm(), _QWEN_VL_LAYER)
    assert [(f.qualname, f.line) for f in adds] == [("MoEDecoderLayer.forward", 11), ("PlainLayer.forward", 22)]
    vl = adds[0].params["condition"]
    assert '"Qwen2_5_VLRMSNorm"' in vl and 'type(self.post_attention_layernorm).__module__.startswith("transformers.")' in vl
    # the cast of the sum stays on the unfused path; a weight dtype other than the sum's takes it
    assert "self.post_attention_layernorm.weight.dtype != residual.dtype" in adds[0].fused


def test_a_subclass_of_another_vl_family_stays_silent() -> None:
    """Near miss: a family whose norm npufuse has not compared with LlamaRMSNorm (Gemma 3's, with its
    ``1 + weight`` gain) is not read from the base class."""
    from pattern_harness import detect_all

    from npufuse.patterns import add_rms_norm as A

    code = _QWEN_VL_LAYER.replace("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLDecoderLayer",
                                  "transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer as Qwen2_5_VLDecoderLayer")
    adds, _ = detect_all(A.AddRmsNorm(), code)
    assert [f.qualname for f in adds] == ["PlainLayer.forward"]
