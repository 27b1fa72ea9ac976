"""s39 norm pass: RMSNorm classes of third-party model libraries (HO15a's mini-llm-brawl builds its
models from ``torchtune.modules.RMSNorm``).

The stand-ins below spell their forwards exactly as torchtune's releases do (rms_norm.py at 0.1-0.4
and main; 0.5-0.6.1; models/gemma/rms_norm.py): the swap and the add_rms_norm check compare the
forward's code names with the spellings read, so a forward written otherwise keeps its own code."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from apply_support import make_repo, scan
from npufuse import emulate


class _TorchtuneRMSNorm(nn.Module):
    """torchtune.modules.rms_norm.RMSNorm, 0.1.0-0.4.0 and main (c5c160b on)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        x_normed = (
            x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        ).type_as(x)
        return x_normed * self.scale


class _TorchtuneRMSNorm05(_TorchtuneRMSNorm):
    """The 0.5.0-0.6.1 spelling: F.rms_norm in fp32, the input's dtype out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(
            x.float(),
            normalized_shape=self.normalized_shape,
            weight=self.scale,
            eps=self.eps,
        ).to(x.dtype)


class _TorchtuneRewritten(_TorchtuneRMSNorm):
    """A forward no release has (mean-centred): the swap must leave it alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x - x.mean(-1, keepdim=True)
        return super().forward(x)


class _GemmaRMSNorm(nn.Module):
    """torchtune.models.gemma.rms_norm.GemmaRMSNorm (every release): (1 + scale) in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.scale.float())
        return output.type_as(x)


_MODEL = '''\
import torch
from torch import nn
from torchtune.modules import RMSNorm
from torchtune.models.gemma.rms_norm import GemmaRMSNorm


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.rn1 = RMSNorm(d)
        self.rn2 = RMSNorm(d)
        self.gn = GemmaRMSNorm(d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        x = x + self.proj(self.rn1(x))
        x = x + self.proj(self.rn2(x))
        return self.gn(x)
'''


def _install(monkeypatch, rms: type) -> None:
    from pattern_harness import install_stand_in_modules

    rms.__module__, rms.__name__ = "torchtune.modules.rms_norm", "RMSNorm"
    _GemmaRMSNorm.__module__, _GemmaRMSNorm.__name__ = "torchtune.models.gemma.rms_norm", "GemmaRMSNorm"
    install_stand_in_modules(monkeypatch, {"torchtune.modules": {"RMSNorm": rms}, "torchtune.modules.rms_norm": {"RMSNorm": rms},
                                           "torchtune.models.gemma.rms_norm": {"GemmaRMSNorm": _GemmaRMSNorm}})


def _run(code: str, x: torch.Tensor, weight_dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    ns: dict = {}
    with emulate.install() as emu:
        exec(compile(code, "<model>", "exec"), ns)
        torch.manual_seed(0)
        blk = ns["Block"](16)
        with torch.no_grad():
            for p in blk.parameters():
                p.normal_()
        blk.to(weight_dtype)
        with torch.no_grad():
            out = blk(x)
        return out, dict(emu.calls)


def test_torchtune_norms_are_swapped_where_built_and_keep_torchtune_dtypes(monkeypatch) -> None:
    from pattern_harness import detect_all

    from npufuse.patterns import add_rms_norm as A
    from npufuse.patterns import rms_norm as R
    from npufuse.rewrite.codegen import splice

    findings, _ = detect_all(R.RmsNorm(), _MODEL)
    assert [(f.line, f.variant, f.params["module"]) for f in findings] == [
        (10, "library_rmsnorm", "torchtune.RMSNorm"), (11, "library_rmsnorm", "torchtune.RMSNorm"),
        (12, "library_rmsnorm", "torchtune.GemmaRMSNorm")]
    adds, _ = detect_all(A.AddRmsNorm(), _MODEL)
    assert [(f.line, f.params["weight"], f.params["eps"], f.params["weight_offset"]) for f in adds] == [
        (16, "self.rn2.scale", "self.rn2.eps", 0.0), (17, "self.gn.scale", "self.gn.eps", 1.0)]
    assert "type(self.rn2).__module__ == 'torchtune.modules.rms_norm'" in adds[0].params["condition"]
    swapped = splice(_MODEL, findings)
    with_adds = [splice(_MODEL, findings + [add]) for add in adds]  # the two adds overlap: one at a time
    # (class, input dtype, weight dtype); torchtune 0.1-0.4's RMSNorm gives float32 out for a bf16 input
    # and a float32 scale, so the first residual add there mixes dtypes and is not fused (add, then the norm)
    cases = [(_TorchtuneRMSNorm, torch.bfloat16, torch.float32, (0, 1)), (_TorchtuneRMSNorm, torch.bfloat16, torch.bfloat16, (1, 1)),
             (_TorchtuneRMSNorm05, torch.bfloat16, torch.bfloat16, (1, 1)), (_TorchtuneRMSNorm05, torch.float32, torch.float32, (1, 1))]
    for rms, x_dtype, weight_dtype, adds_fused in cases:
        _install(monkeypatch, rms)
        x = torch.randn(2, 3, 16, dtype=x_dtype)
        ref, _ = _run(_MODEL, x, weight_dtype)
        out, calls = _run(swapped, x, weight_dtype)
        assert out.dtype == ref.dtype, (rms, weight_dtype)
        torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=5e-2)
        assert calls.get("npu_rms_norm", 0) == 3, calls  # rn1, rn2 and the Gemma norm
        for both, fused in zip(with_adds, adds_fused):
            out, calls = _run(both, x, weight_dtype)
            assert out.dtype == ref.dtype, (rms, weight_dtype)
            torch.testing.assert_close(out.float(), ref.float(), atol=8e-2, rtol=8e-2)
            assert calls.get("npu_add_rms_norm", 0) == fused, (rms, x_dtype, weight_dtype, calls)


def test_a_forward_spelt_otherwise_keeps_its_own_code(monkeypatch) -> None:
    from pattern_harness import detect_all

    from npufuse.patterns import add_rms_norm as A
    from npufuse.patterns import rms_norm as R
    from npufuse.rewrite.codegen import splice

    findings, _ = detect_all(R.RmsNorm(), _MODEL)
    adds, _ = detect_all(A.AddRmsNorm(), _MODEL)
    _install(monkeypatch, _TorchtuneRewritten)
    x = torch.randn(2, 3, 16, dtype=torch.float32)
    ref, _ = _run(_MODEL, x, torch.float32)
    out, calls = _run(splice(_MODEL, findings + adds[:1]), x, torch.float32)
    torch.testing.assert_close(out, ref)
    # only the Gemma norm: torchtune's RMSNorm spelt otherwise runs its own forward, its add unfused
    assert calls.get("npu_rms_norm") == 1 and not calls.get("npu_add_rms_norm"), calls


def test_an_rmsnorm_of_a_library_without_a_verified_model_is_a_near_miss_naming_it(tmp_path: Path) -> None:
    from npufuse.patterns.rms_norm import RmsNorm

    model = '''\
from torch import nn
from fancylib.layers import FancyRMSNorm
from pkg.norms import LocalRMSNorm


class Net(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = FancyRMSNorm(d)
        self.b = LocalRMSNorm(d)

    def forward(self, x):
        return self.b(self.a(x))
'''
    norms = '''\
import torch
from torch import nn


class LocalRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
'''
    root = make_repo(tmp_path / "repo", {"pkg/__init__.py": "", "pkg/model.py": model, "pkg/norms.py": norms})
    data = scan(root, patterns=[RmsNorm()])
    misses = [(m["file"], m["line"], m["reason"]) for m in data["near_misses"] if m["pattern"] == "rms_norm"]
    assert [(f, ln) for f, ln, _ in misses] == [("pkg/model.py", 9)], misses
    assert misses[0][2].startswith("fancylib.layers.FancyRMSNorm: an RMSNorm class of a third-party library"), misses
    assert not [c for c in data["candidates"] if c["file"] == "pkg/model.py"]


# -- a norm class returned by a factory that chooses among kernels at construction (Smol-LM) ----------

_CHOOSER = '''\
from torch import nn


def pick_norm_class():
    try:
        from fastkernels.norms import TritonRMS as Fast
        return Fast
    except ImportError:
        from torch.nn import RMSNorm as Plain
        return Plain
'''

_LAYER = '''\
import torch
from torch import nn

from pkg.chooser import pick_norm_class


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        Norm = pick_norm_class()
        self.pre = Norm(d, eps=1e-6)
        self.post = Norm(d, eps=1e-6)
        self.mix = nn.Linear(d, d)
        self.ff = nn.Linear(d, d)

    def forward(self, x):
        h = x + self.mix(self.pre(x))
        return h + self.ff(self.post(h))
'''


def test_norm_class_returned_by_a_factory_is_fused_where_it_is_nn_rmsnorm(tmp_path: Path) -> None:
    from npufuse.patterns.add_rms_norm import AddRmsNorm

    root = make_repo(tmp_path / "repo", {"pkg/__init__.py": "", "pkg/chooser.py": _CHOOSER, "pkg/layer.py": _LAYER})
    data = scan(root, patterns=[AddRmsNorm()])
    cands = [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    assert [(c["line"], c["params"]["condition"]) for c in cands] == [
        (17, "type(self.post).forward is torch.nn.RMSNorm.forward and self.post.weight is not None")], data["near_misses"]
    code = cands[0]["fused"]
    assert "npu_add_rms_norm(_npu_x1, _npu_x2, self.post.weight" in code and "epsilon=(self.post.eps" in code, code


def test_factory_returning_no_nn_rmsnorm_is_not_read_as_one(tmp_path: Path) -> None:
    from npufuse.patterns.add_rms_norm import AddRmsNorm

    chooser = _CHOOSER.replace("from torch.nn import RMSNorm as Plain", "from torch.nn import LayerNorm as Plain")
    root = make_repo(tmp_path / "repo", {"pkg/__init__.py": "", "pkg/chooser.py": chooser, "pkg/layer.py": _LAYER})
    data = scan(root, patterns=[AddRmsNorm()])
    assert not [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"], data["candidates"]


# -- F.normalize over a dim chosen at run time (magvit2's channel-first RMSNorm) -----------------------

_CHOSEN_DIM = '''\
import torch
import torch.nn.functional as F
from torch import nn


class ChanNorm(nn.Module):
    def __init__(self, d, channel_first=False):
        super().__init__()
        self.channel_first = channel_first
        self.scale = d ** 0.5
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.normalize(x, dim=(1 if self.channel_first else -1)) * self.scale * self.g
'''


def test_l2_norm_over_a_chosen_dim_is_fused_where_the_choice_is_the_last_dim() -> None:
    from pattern_harness import detect_all

    from npufuse.patterns import rms_norm as R
    from npufuse.rewrite.codegen import splice

    findings, _ = detect_all(R.RmsNorm(), _CHOSEN_DIM)
    assert [(f.line, f.params.get("condition"), f.params["eps_rule"]) for f in findings] == [
        (14, "not (self.channel_first)", "clamp on the norm")]
    assert any("clamp" in r.detail for r in findings[0].risks)
    text = splice(_CHOSEN_DIM, findings)
    for channel_first, shape, fused in ((False, (2, 5, 16), 1), (True, (2, 16, 16), 0)):
        outs = []
        for code in (_CHOSEN_DIM, text):
            ns: dict = {}
            with emulate.install() as emu:
                exec(compile(code, "<m>", "exec"), ns)
                torch.manual_seed(0)
                m = ns["ChanNorm"](16, channel_first)
                outs.append(m(torch.randn(*shape)))
                calls = dict(emu.calls)
        assert calls.get("npu_rms_norm", 0) == fused, calls
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_l2_norm_over_a_choice_of_two_other_dims_is_not_read_as_rms_norm() -> None:
    from pattern_harness import detect_all

    from npufuse.patterns import rms_norm as R

    findings, _ = detect_all(R.RmsNorm(), _CHOSEN_DIM.replace("else -1", "else 2"))
    assert not findings
