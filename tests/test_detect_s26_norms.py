"""Issue 14 class 1 (session s26-norms): library RMSNorm families found by package and class name
(timm's ``RmsNorm`` / ``RmsNormFp32`` through any of timm's re-exporting modules), and pure-torch
fallbacks of optional kernel imports (``try: from flash_attn.ops.rms_norm import rms_norm as impl /
except ImportError: def impl(...)``), including the in-place ``.add_(eps)`` spelling of the eps add.

timm is not installed here: a small stand-in registered in ``sys.modules`` plays it, written from
timm's documented semantics (timm/layers/norm.py: mean of squares over the trailing dims in the
input's dtype, eps inside the root, optional weight; RmsNormFp32 on float32 and cast back), with
the classes' ``__module__`` in timm's package as the real ones have (the swap checks it at run time)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from npufuse import emulate
from npufuse.patterns import _library_norm as L
from npufuse.patterns import rms_norm as R
from npufuse.rewrite.codegen import splice
from tests.pattern_harness import _exec, detect_all, install_stand_in_modules


def _timm_rms_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    v = torch.mean(x.pow(2), dim=tuple(range(-1, -len(shape) - 1, -1)), keepdim=True)
    x = x * torch.rsqrt(v + eps)
    return x * weight if weight is not None else x


class _TimmRmsNorm(nn.Module):
    def __init__(self, channels: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.normalized_shape = (channels,)
        self.eps = eps
        self._fast_norm = False
        self.weight = nn.Parameter(torch.ones(channels)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _timm_rms_norm(x, self.normalized_shape, self.weight, self.eps)


class _TimmRmsNormFp32(_TimmRmsNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float() if self.weight is not None else None
        return _timm_rms_norm(x.float(), self.normalized_shape, w, self.eps).to(x.dtype)


_TimmRmsNorm.__name__ = "RmsNorm"
_TimmRmsNormFp32.__name__ = "RmsNormFp32"


@pytest.fixture()
def timm(monkeypatch: pytest.MonkeyPatch) -> None:
    _TimmRmsNorm.__module__ = _TimmRmsNormFp32.__module__ = "timm.layers.norm"
    norms = {"RmsNorm": _TimmRmsNorm, "RmsNormFp32": _TimmRmsNormFp32}
    install_stand_in_modules(monkeypatch, {"timm.layers": norms, "timm.models.vision_transformer": norms})


_TIMM_BLOCK = '''
import torch
from torch import nn
from timm.models.vision_transformer import RmsNorm
import timm.layers


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm1 = RmsNorm(dim, eps=1e-6)
        self.norm2 = timm.layers.RmsNormFp32(dim, eps=1e-5)
        self.plain = RmsNorm(dim, affine=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.plain(self.norm2(self.proj(self.norm1(x))))
'''


def _run_both(code: str, make, x: torch.Tensor):
    findings, misses = detect_all(R.RmsNorm(), code)
    text = splice(code, findings)
    torch.manual_seed(0)
    ref = make(_exec(code, "orig"))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    with emulate.install() as emu:
        new = make(_exec(text, "new"))
        new.load_state_dict(ref.state_dict())  # timm's parameter names: checkpoints load unchanged
        out = new(x)
        calls = dict(emu.calls)
    return findings, misses, ref(x), out, calls


@pytest.mark.parametrize(("x_dtype", "model_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                      (torch.bfloat16, torch.float32)])
def test_timm_rmsnorms_through_a_model_module_reexport_are_swapped_and_match(timm: None, x_dtype, model_dtype) -> None:
    x = torch.randn(2, 3, 16, dtype=x_dtype)
    findings, _, ref, out, calls = _run_both(_TIMM_BLOCK, lambda ns: ns["Block"](16).to(model_dtype), x)
    assert [(f.line, f.variant) for f in findings] == [(11, "library_rmsnorm"), (12, "library_rmsnorm"), (13, "library_rmsnorm")]
    assert findings[0].params["module"] == "timm.RmsNorm" and findings[1].params["module"] == "timm.RmsNormFp32"
    assert calls.get("npu_rms_norm") == 3
    # bf16 input with fp32 weights: timm's RmsNorm promotes to float32, and so must the swap
    assert out.dtype == ref.dtype
    tol = 1e-5 if x_dtype == model_dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_timm_fast_norm_mode_keeps_timms_forward(timm: None) -> None:
    x = torch.randn(2, 16)

    def make(ns):
        blk = ns["Block"](16)
        for m in (blk.norm1, blk.plain):
            m._fast_norm = True  # timm's set_fast_norm(): autocast-dtype casts the swap does not copy
        return blk

    *_, calls = _run_both(_TIMM_BLOCK, make, x)
    assert calls.get("npu_rms_norm", 0) == 1  # only RmsNormFp32, which has no fast mode


def test_timm_rmsnorm_without_the_fast_norm_attribute_keeps_timms_forward(timm: None) -> None:
    # timm <= 1.0.12: RmsNorm has no `_fast_norm` and its forward always took the fast path, which without
    # apex is mean-centred (var(x)); only the swap of RmsNormFp32 (never a fast path) may run
    x = torch.randn(2, 16)

    def make(ns):
        blk = ns["Block"](16)
        for m in (blk.norm1, blk.norm2, blk.plain):
            del m._fast_norm  # real timm's RmsNormFp32 has none either
        return blk

    *_, calls = _run_both(_TIMM_BLOCK, make, x)
    assert calls.get("npu_rms_norm", 0) == 1


def test_a_repo_class_bound_to_the_timm_name_keeps_its_own_forward(timm: None, monkeypatch: pytest.MonkeyPatch) -> None:
    code = '''
import torch
from torch import nn

try:
    from timm.layers import RmsNorm
except ImportError:
    class RmsNorm(nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return x * self.scale


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = RmsNorm(dim, eps=1e-6)

    def forward(self, x):
        return self.norm(x)
'''
    monkeypatch.delitem(sys.modules, "timm.layers")
    monkeypatch.setitem(sys.modules, "timm", None)  # import fails: the except branch's class is used
    findings, _, ref, out, calls = _run_both(code, lambda ns: ns["Block"](8), torch.randn(2, 8))
    assert [f.line for f in findings] == [20]
    assert calls.get("npu_rms_norm", 0) == 0
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("name", ["RmsNorm2d", "RmsNorm2dFp32", "SimpleNorm", "LayerNorm"])
def test_timm_norms_that_are_not_trailing_dim_rms_are_not_in_the_family(name: str) -> None:
    code = f'''
from torch import nn
from timm.layers import {name}


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = {name}(dim)
'''
    findings, _ = detect_all(R.RmsNorm(), code)
    assert findings == []


def test_family_class_needs_the_library_package() -> None:
    from npufuse.scan.dataflow import ModuleInfo

    m = ModuleInfo.from_source("m.py", "from mylib.layers import RmsNorm\nimport timm.layers as tl\n")
    import ast

    assert L.library_family_class(m, ast.parse("RmsNorm", mode="eval").body) is None
    assert L.library_family_class(m, ast.parse("tl.RmsNorm", mode="eval").body) == "timm.RmsNorm"
    assert L.library_family_class(m, ast.parse("tl.RmsNorm2d", mode="eval").body) is None


_KERNEL_FALLBACK = '''
import torch
from torch import nn

try:
    from flash_attn.ops.rms_norm import rms_norm as rms_norm_impl
except ImportError:
    def rms_norm_impl(x, weight, epsilon):
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(epsilon))) * weight


class FastRMSNorm(nn.Module):
    def __init__(self, C, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(C))

    def forward(self, x):
        src_type = x.dtype
        return rms_norm_impl(x.float(), self.weight, epsilon=self.eps).to(src_type)
'''


def test_kernel_import_fallback_is_replaced_at_its_caller_only() -> None:
    findings, _ = detect_all(R.RmsNorm(), _KERNEL_FALLBACK)
    # the fallback def is what runs without the kernel package; its only caller is the site
    assert [(f.qualname, f.line) for f in findings] == [("FastRMSNorm.forward", 19)]
    text = splice(_KERNEL_FALLBACK, findings)
    torch.manual_seed(0)
    ns = _exec(_KERNEL_FALLBACK, "orig")
    ref_m = ns["FastRMSNorm"](32)
    with torch.no_grad():
        ref_m.weight.normal_()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with emulate.install() as emu:
        new_m = _exec(text, "new")["FastRMSNorm"](32)
        new_m.load_state_dict(ref_m.state_dict())
        out = new_m(x)
    assert emu.calls.get("npu_rms_norm") == 1
    ref = ref_m(x)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_fallback_def_called_on_its_own_stays_a_site() -> None:
    code = _KERNEL_FALLBACK + "\n\ndef qk(q):\n    return rms_norm_impl(q, torch.ones(q.shape[-1]), 1e-6) + 1\n"
    findings, _ = detect_all(R.RmsNorm(), code)
    assert ("rms_norm_impl", 9) in [(f.qualname, f.line) for f in findings]


def test_inplace_eps_add_on_a_named_variance_is_not_accepted() -> None:
    code = '''
import torch


def norm(x, w, eps):
    var = x.pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(var.add_(eps)) * w
    return y, var
'''
    findings, _ = detect_all(R.RmsNorm(), code)
    assert findings == []
