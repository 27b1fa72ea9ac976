"""Issue 14 class 1 (session s25-norms): RMSNorm modules of other libraries (apex FusedRMSNorm /
MixedFusedRMSNorm, xformers.ops.RMSNorm), imported directly or re-exported by a package of the
repository, are swapped where they are built; TransformerEngine's is a near miss with its reason.

apex and xformers are not installed here: small stand-ins registered in ``sys.modules`` play them,
written from the libraries' documented semantics (mean of squares over the trailing normalized
dims, eps inside the root, optional weight), with their classes' ``__module__`` in the library's
package as the real ones have (the swap checks it at run time)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from apply_support import scan
from npufuse import emulate
from npufuse.patterns import rms_norm as R
from npufuse.rewrite.codegen import splice
from tests.pattern_harness import _exec, detect_all, install_stand_in_modules


def _reference_rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float, dims: int) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(tuple(range(-dims, 0)), keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class _XformersRMSNorm(nn.Module):
    def __init__(self, dim: int, include_weight: bool = True, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if include_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _reference_rms(x, self.weight, self.eps, 1)


class _ApexFusedRMSNorm(nn.Module):
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True):
        super().__init__()
        self.normalized_shape = torch.Size((normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape)
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _apex_manual_rms_norm(x, self.weight, self.eps, len(self.normalized_shape))


def _apex_manual_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, dims: int) -> torch.Tensor:
    """What apex's RMSNorm classes run off CUDA (its ``manual_rms_norm``, rewritten here): the product
    with an fp32 rsqrt promotes half input to float32, cast to the weight's dtype only when that is half."""
    variance = x.to(torch.float32).pow(2).mean(tuple(range(-dims, 0)), keepdim=True)
    y = x * torch.rsqrt(variance + eps)
    if weight is None:
        return y
    if weight.dtype in (torch.float16, torch.bfloat16):
        y = y.to(weight.dtype)
    return weight * y


class _ApexMixedFusedRMSNorm(_ApexFusedRMSNorm):
    pass


@pytest.fixture()
def libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    _XformersRMSNorm.__module__ = "xformers.ops.rmsnorm"
    _ApexFusedRMSNorm.__module__ = _ApexMixedFusedRMSNorm.__module__ = "apex.normalization.fused_layer_norm"
    install_stand_in_modules(monkeypatch, {
        "xformers.ops": {"RMSNorm": _XformersRMSNorm},
        "apex.normalization": {"FusedRMSNorm": _ApexFusedRMSNorm, "MixedFusedRMSNorm": _ApexMixedFusedRMSNorm},
    })


_XFORMERS_BLOCK = '''
import torch
from torch import nn
from xformers.ops import RMSNorm


class Block(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps=eps)
        self.sub_norm = RMSNorm(dim, include_weight=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.sub_norm(self.proj(self.attention_norm(x)))
'''

_APEX_BLOCK = '''
import torch
from torch import nn
import apex


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = apex.normalization.MixedFusedRMSNorm(dim, eps=1e-6)
        self.plain = apex.normalization.FusedRMSNorm((4, dim), elementwise_affine=False)

    def forward(self, x):
        return self.plain(self.norm(x))
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
        new.load_state_dict(ref.state_dict())  # the library's parameter names: checkpoints load unchanged
        out = new(x)
        calls = dict(emu.calls)
    return findings, misses, ref(x), out, calls


def test_xformers_rmsnorm_constructions_are_swapped_and_match(libraries: None) -> None:
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    findings, _, ref, out, calls = _run_both(_XFORMERS_BLOCK, lambda ns: ns["Block"](16).to(torch.bfloat16), x)
    assert [(f.line, f.variant) for f in findings] == [(10, "library_rmsnorm"), (11, "library_rmsnorm")]
    assert findings[0].params["module"] == "xformers.ops.RMSNorm"
    assert calls.get("npu_rms_norm") == 2  # both norms, the weightless one with ones
    assert out.dtype == ref.dtype and torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_apex_rmsnorms_with_trailing_shape_and_no_weight(libraries: None) -> None:
    x = torch.randn(3, 4, 8)
    findings, _, ref, out, calls = _run_both(_APEX_BLOCK, lambda ns: ns["Block"](8), x)
    assert [f.line for f in findings] == [10, 11]
    assert calls.get("npu_rms_norm") == 2
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_apex_swap_returns_the_dtype_apex_returns_off_cuda(libraries: None, weight_dtype: torch.dtype) -> None:
    # bf16 input: apex's reference returns float32 with an fp32 (or no) weight, bf16 with a bf16 weight
    x = torch.randn(3, 4, 8, dtype=torch.bfloat16)

    def make(ns):
        blk = ns["Block"](8)
        blk.norm.to(weight_dtype)
        return blk

    findings, _, ref, out, calls = _run_both(_APEX_BLOCK, make, x)
    assert calls.get("npu_rms_norm") == 2
    assert ref.dtype == torch.float32  # the weightless outer norm promotes
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
    single = _run_both(_APEX_BLOCK.replace("return self.plain(self.norm(x))", "return self.norm(x)"), make, x)
    assert single[3].dtype == single[2].dtype == (torch.float32 if weight_dtype == torch.float32 else torch.bfloat16)
    torch.testing.assert_close(single[3].float(), single[2].float(), atol=3e-2, rtol=3e-2)


def test_a_fallback_class_bound_to_the_library_name_keeps_its_own_forward(libraries: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # without apex the except branch binds the name to the repo's own class: the swap leaves it alone
    code = '''
import torch
from torch import nn

try:
    from apex.normalization import FusedRMSNorm as RMSNorm
except ImportError:
    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-5):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return x * self.scale


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = RMSNorm(dim, eps=1e-5)

    def forward(self, x):
        return self.norm(x)
'''
    findings, _ = detect_all(R.RmsNorm(), code)
    assert [f.line for f in findings if f.variant == "library_rmsnorm"] == [20]
    monkeypatch.delitem(sys.modules, "apex.normalization")
    monkeypatch.setitem(sys.modules, "apex", None)  # import apex... raises ImportError
    x = torch.randn(2, 8)
    with emulate.install() as emu:
        blk = _exec(splice(code, findings), "fallback")["Block"](8)
        assert torch.equal(blk(x), x) and not emu.calls.get("npu_rms_norm")


def test_transformer_engine_rmsnorm_is_a_near_miss_saying_why() -> None:
    code = '''
import transformer_engine.pytorch as te
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = te.RMSNorm(dim, eps=1e-5, zero_centered_gamma=True)
'''
    findings, misses = detect_all(R.RmsNorm(), code)
    assert not findings
    assert [m.line for m in misses] == [9] and "TransformerEngine's RMSNorm" in misses[0].reason
    assert "1 + weight" in misses[0].reason


def test_a_norm_named_class_of_the_repo_is_not_a_library_one() -> None:
    code = _XFORMERS_BLOCK.replace("from xformers.ops import RMSNorm", "from mylib.layers import RMSNorm")
    findings, _ = detect_all(R.RmsNorm(), code)
    assert not [f for f in findings if f.variant == "library_rmsnorm"]


def test_apex_class_re_exported_by_a_package_of_the_repo(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "megatron" / "model").mkdir(parents=True)
    (root / "megatron" / "__init__.py").write_text("", encoding="utf-8")
    (root / "megatron" / "model" / "__init__.py").write_text(
        "from apex.normalization import MixedFusedRMSNorm as RMSNorm\nfrom .layers import LocalNorm\n", encoding="utf-8")
    (root / "megatron" / "model" / "layers.py").write_text(
        "from torch import nn\n\n\nclass LocalNorm(nn.Module):\n    pass\n", encoding="utf-8")
    (root / "megatron" / "model" / "transformer.py").write_text('''from torch import nn
from megatron.model import RMSNorm, LocalNorm


class Layer(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps=1e-6)
        self.other_norm = LocalNorm()
''', encoding="utf-8")
    data = scan(root, patterns=[R.RmsNorm()])
    cands = [(c["file"], c["line"], c["variant"]) for c in data["candidates"] if c["pattern"] == "rms_norm"]
    assert cands == [("megatron/model/transformer.py", 8, "library_rmsnorm")]


def test_tgi_in_place_residual_candidate_states_the_in_place_difference() -> None:
    from npufuse.patterns.add_rms_norm import _TGI_NORM, AddRmsNorm

    findings, _ = detect_all(AddRmsNorm(), _TGI_NORM)
    (f,) = findings
    assert f.variant == "optional_residual" and not f.params["residual_aliases"]
    assert any("in place (`hidden_states += residual`)" in r.detail for r in f.risks)
    # inference: the sum comes back as the residual; the caller's tensor is left as it was
    text = splice(_TGI_NORM, findings)
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    ref_x = x.clone()
    ref_out, ref_res = _exec(_TGI_NORM, "o")["FastRMSNorm"](torch.ones(16), 1e-5)(x.clone(), r)
    with torch.no_grad(), emulate.install() as emu:
        out, res = _exec(text, "n")["FastRMSNorm"](torch.ones(16), 1e-5)(x, r)
        assert emu.calls.get("npu_add_rms_norm") == 1
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(res, ref_res)
    assert torch.equal(x, ref_x)


def test_a_re_export_chosen_at_run_time_is_not_taken_for_the_library(tmp_path: Path) -> None:
    # Megatron-DeepSpeed: apex's class on CUDA, the repo's own hand-written RMSNorm elsewhere (on NPU)
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text(
        "import torch\nif torch.cuda.is_available():\n    from apex.normalization import MixedFusedRMSNorm as RMSNorm\n"
        "else:\n    from .rmsnorm import RMSNorm\n", encoding="utf-8")
    (root / "pkg" / "rmsnorm.py").write_text("from torch import nn\n\n\nclass RMSNorm(nn.Module):\n    pass\n", encoding="utf-8")
    (root / "pkg" / "layer.py").write_text(
        "from torch import nn\nfrom pkg import RMSNorm\n\n\nclass Layer(nn.Module):\n    def __init__(self, d):\n"
        "        super().__init__()\n        self.norm = RMSNorm(d, 1e-5)\n", encoding="utf-8")
    data = scan(root, patterns=[R.RmsNorm()])
    assert not [c for c in data["candidates"] if c.get("variant") == "library_rmsnorm"]
