"""s44 (ho21fix44): classes behind the real misses of the blind sets HO21a / HO21b, with invented reproducers.

1. A double-backward call (``torch.autograd.functional.hessian`` / ``hvp`` / ...) blocks only the files the
   code around it can reach (npufuse.scan.double_backward_reach): a tutorial script that differentiates a toy
   function of its own no longer turns every site of the repository into a near miss.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from apply_support import make_repo, scan
from npufuse.patterns.rms_norm import RmsNorm
from npufuse.patterns.swiglu import Swiglu

# -- 1. double-backward facts tied to the code that reaches the site ------------------------------------------------

_MODEL = '''\
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
'''

_TOY_HESSIAN = '''\
import torch
from torch.autograd.functional import hessian


def g(x):
    return (x ** 3).sum()


x_val = torch.tensor([1.0, 2.0])
H = hessian(g, x_val)
print(H)
'''

_TOY_HVP_MAIN = '''\
import torch


def f(x):
    return (x.sin() ** 2).sum()


def main():
    x = torch.randn(3)
    print(torch.autograd.functional.hvp(f, x, torch.ones(3)))


if __name__ == "__main__":
    main()
'''

_MODEL_HESSIAN = '''\
import torch
from torch.autograd.functional import hessian

from pkg.model import MLP

mlp = MLP(4, 8)
H = hessian(lambda x: mlp(x).sum(), torch.randn(4))
'''

_LOADED_HESSIAN = '''\
import torch
from torch.autograd.functional import hessian

net = torch.load("model.pt", weights_only=False)
H = hessian(lambda x: net(x).sum(), torch.randn(4))
'''

_PATTERNS = (RmsNorm(), Swiglu())


def _model_sites(data: dict[str, Any]) -> list[str]:
    return sorted(c["pattern"] for c in data["candidates"] if c["file"] == "pkg/model.py")


def _blocked(data: dict[str, Any]) -> list[str]:
    return [m["reason"] for m in data["near_misses"] if "double-backward trick" in m["reason"]]


@pytest.mark.parametrize("script, body", [
    ("tutorials_autograd/05_hessian.py", _TOY_HESSIAN),  # module level, in a file no import can name
    ("autograd_demo/hessian_demo.py", _TOY_HESSIAN),  # module level, importable: still only its own imports
    ("autograd_demo/06_hvp.py", _TOY_HVP_MAIN),  # inside a function of a file no import can name
])
def test_toy_double_backward_script_does_not_block_the_model(tmp_path: Path, script: str, body: str) -> None:
    files = {"pkg/__init__.py": "", "pkg/model.py": _MODEL, script: body}
    data = scan(make_repo(tmp_path, files), patterns=_PATTERNS)
    assert _model_sites(data) == ["rms_norm", "swiglu"], data["near_misses"]
    assert not _blocked(data)


@pytest.mark.parametrize("script, body, why", [
    ("scripts/curvature.py", _MODEL_HESSIAN, "the script imports the model and differentiates it twice"),
    ("scripts/05_curvature.py", _LOADED_HESSIAN, "a pickled model is loaded: its classes are imported at run time"),
    ("pkg/train.py", _TOY_HVP_MAIN.replace("def main():\n    x = torch.randn(3)\n",
                                           "def main(f=f):\n    x = torch.randn(3)\n"),
     "the function sits in an importable module: a caller may hand it the model"),
])
def test_double_backward_that_can_reach_the_model_still_blocks(tmp_path: Path, script: str, body: str, why: str) -> None:
    files = {"pkg/__init__.py": "", "pkg/model.py": _MODEL, script: body}
    data = scan(make_repo(tmp_path, files), patterns=_PATTERNS)
    assert _model_sites(data) == [], why
    assert len(_blocked(data)) == 2 and all(f"at {script}:" in r for r in _blocked(data)), data["near_misses"]


# -- 2. rms_norm over trailing dims written relative to the rank ----------------------------------------------------

_RANK_NORM = '''\
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-6):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(self.normalized_shape))

    def _rms(self, h):
        k = len(self.normalized_shape)
        DIMS
        ms = torch.mean(h.pow(2), dim=dims, keepdim=True)
        return torch.sqrt(ms + self.eps)

    def forward(self, h):
        return self.weight * (h / self._rms(h))
'''


def _scan_code(tmp_path: Path, code: str, patterns: tuple[Any, ...]) -> dict[str, Any]:
    return scan(make_repo(tmp_path, {"pkg/__init__.py": "", "pkg/norm.py": code}), patterns=patterns)


def _fused_against_eager(tmp_path: Path, files: dict[str, str], name: str, patterns: tuple[Any, ...], run: Any,
                         atol: float = 1e-5) -> dict[str, int]:
    """Scan and apply every candidate of ``files``, then compare ``run(module)`` of the original and of the rewritten
    module (emulated torch_npu); the emulated op calls made by the rewritten run."""
    import torch

    from apply_support import npufuse
    from npufuse import emulate
    from scratch_repo import import_fresh

    ref = run(import_fresh(make_repo(tmp_path / "ref", files), name))
    root = make_repo(tmp_path / "repo", files)
    scan(root, patterns=patterns)
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    with emulate.install() as emu:
        got = run(import_fresh(root, name))
    for a, b in zip(ref, got):
        assert torch.allclose(a, b, atol=atol), (a - b).abs().max()
    return dict(emu.calls)


@pytest.mark.parametrize("dims", [
    "dims = tuple(range(h.ndim - k, h.ndim))",
    "dims = tuple(range(h.dim() - k, h.dim()))",
    "dims = list(range(len(h.shape) - k, len(h.shape)))",
    "dims = tuple(i for i in range(h.ndim - k, h.ndim))",
])
def test_trailing_dims_from_the_rank_are_fused_where_one_dim(tmp_path: Path, dims: str) -> None:
    data = _scan_code(tmp_path, _RANK_NORM.replace("DIMS", dims), (RmsNorm(),))
    (c,) = [c for c in data["candidates"] if c["pattern"] == "rms_norm"]
    assert c["qualname"] == "RMSNorm.forward"
    assert "-len(self.normalized_shape) == -1" in c["replacement"], c["replacement"]


@pytest.mark.parametrize("dims, why", [
    ("dims = tuple(range(self.weight.ndim - k, self.weight.ndim))", "the rank of another tensor (the weight's), not the input's"),
    ("dims = tuple(range(h.ndim - k, h.ndim - 1))", "the range stops before the last dim"),
    ("dims = tuple(range(h.ndim - k, h.ndim, 2))", "a step of 2 skips dims"),
])
def test_rank_ranges_that_are_not_the_trailing_dims_are_kept(tmp_path: Path, dims: str, why: str) -> None:
    data = _scan_code(tmp_path, _RANK_NORM.replace("DIMS", dims), (RmsNorm(),))
    assert not [c for c in data["candidates"] if c["pattern"] == "rms_norm"], why
    assert any("dims" in m["reason"] for m in data["near_misses"] if m["pattern"] == "rms_norm"), data["near_misses"]


def test_trailing_dims_from_the_rank_rewrite_matches_eager_under_the_emulator(tmp_path: Path) -> None:
    import torch

    files = {"pkg/__init__.py": "", "pkg/norm.py": _RANK_NORM.replace("DIMS", "dims = tuple(range(h.ndim - k, h.ndim))")}

    def run(mod: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        out = []
        for shape in (16, (4, 16)):
            m = mod.RMSNorm(shape)
            with torch.no_grad():
                m.weight.add_(0.1 * torch.randn_like(m.weight))
            x = torch.randn(2, 3, 4, 16, requires_grad=True)
            y = m(x)
            y.sum().backward()
            out += [y.detach(), x.grad]
        return out

    calls = _fused_against_eager(tmp_path, files, "pkg.norm", (RmsNorm(),), run)
    assert calls.get("npu_rms_norm") == 1  # the (16,) norm; the (4, 16) one runs the original


# -- 3. F.normalize times a learnable gain initialised to sqrt(d) (QK-norm) ------------------------------------------

_QK_NORM = '''\
import math
import torch
import torch.nn.functional as F
from torch import nn


class QKNorm(nn.Module):
    def __init__(self, head_dim, n_heads):
        super().__init__()
        self.q_scale = nn.Parameter(INIT)

    def forward(self, q):
        q = F.normalize(q, dim=-1, eps=1e-6) * self.q_scale
        return q
'''


@pytest.mark.parametrize("init", [
    "torch.full((n_heads, 1, 1), head_dim ** 0.5)",
    "torch.ones(n_heads, 1, 1) * math.sqrt(head_dim)",
    "math.sqrt(head_dim) * torch.ones(head_dim)",
    "torch.full((n_heads, 1, 1), fill_value=head_dim ** 0.5)",
])
def test_l2_normalize_times_a_gain_initialised_to_sqrt_d_is_fused(tmp_path: Path, init: str) -> None:
    import torch

    files = {"pkg/__init__.py": "", "pkg/norm.py": _QK_NORM.replace("INIT", init)}
    data = _scan_code(tmp_path / "s", _QK_NORM.replace("INIT", init), (RmsNorm(),))
    (c,) = [c for c in data["candidates"] if c["pattern"] == "rms_norm"]
    assert c["qualname"] == "QKNorm.forward" and c["params"]["eps_rule"] == "clamp on the norm"

    def run(mod: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        m = mod.QKNorm(16, 4)
        with torch.no_grad():
            m.q_scale.mul_(torch.rand_like(m.q_scale) + 0.5)
        q = torch.randn(2, 4, 5, 16, requires_grad=True)
        y = m(q)
        (y * y).sum().backward()
        return [y.detach(), q.grad, m.q_scale.grad]

    assert _fused_against_eager(tmp_path, files, "pkg.norm", (RmsNorm(),), run).get("npu_rms_norm") == 1


@pytest.mark.parametrize("init, why", [
    ("torch.ones(n_heads, 1, 1)", "a gain initialised to one: a unit vector times a free scale (ScaleNorm), no sqrt(d)"),
    ("torch.full((n_heads, 1, 1), 10.0)", "a constant temperature, not sqrt(d)"),
    ("torch.full((n_heads, 1, 1), head_dim ** -0.5)", "1 / sqrt(d): the gain shrinks the unit vector further"),
])
def test_l2_normalize_times_a_gain_without_sqrt_d_is_kept(tmp_path: Path, init: str, why: str) -> None:
    data = _scan_code(tmp_path, _QK_NORM.replace("INIT", init), (RmsNorm(),))
    assert not [c for c in data["candidates"] if c["pattern"] == "rms_norm"], why
    assert any("without a sqrt(d) factor" in m["reason"] for m in data["near_misses"]), data["near_misses"]


# -- 4. MLA decoupled-rope scores: a sum of two products with keys transposed by position ---------------------------

_MLA_SUM = '''\
import math
import torch
import torch.nn.functional as F


def mla(q_c, k_c, q_r, k_r, v, mask=None):
    scores_c = torch.matmul(q_c, KC)
    scores_r = torch.matmul(q_r, KR)
    scores = (scores_c + scores_r) * (1.0 / math.sqrt(q_c.shape[-1] + q_r.shape[-1]))
    if mask is not None:
        scores = scores + mask
    scores = F.softmax(scores.float(), dim=-1).type_as(q_c)
    return torch.matmul(scores, v)
'''


def _attention_patterns() -> tuple[Any, ...]:
    from npufuse.patterns.attention import AttentionPattern

    return (AttentionPattern(),)


@pytest.mark.parametrize("kc, kr", [
    ("k_c.transpose(2, 3)", "k_r.transpose(2, 3)"),
    ("k_c.transpose(3, 2)", "k_r.transpose(-2, -1)"),
    ("k_c.swapaxes(2, 3)", "k_r.mT"),
])
def test_summed_products_with_keys_transposed_by_position_are_fused(tmp_path: Path, kc: str, kr: str) -> None:
    import torch

    code = _MLA_SUM.replace("KC", kc).replace("KR", kr)
    files = {"pkg/__init__.py": "", "pkg/mla.py": code}
    data = _scan_code(tmp_path / "s", code, _attention_patterns())
    (c,) = [c for c in data["candidates"] if c["pattern"] == "attention"]
    assert "k_c.dim() == 4" in c["replacement"], c["replacement"]

    def run(mod: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        qc, kc_, v = (torch.randn(2, 4, 6, 16, requires_grad=True) for _ in range(3))
        qr = torch.randn(2, 4, 6, 8, requires_grad=True)
        kr_ = torch.randn(2, 1, 6, 8, requires_grad=True).expand(2, 4, 6, 8)
        mask = torch.full((6, 6), float("-inf")).triu(1)
        y = mod.mla(qc, kc_, qr, kr_, v, mask)
        y.sum().backward()
        return [y.detach(), qc.grad, qr.grad, v.grad]

    calls = _fused_against_eager(tmp_path, files, "pkg.mla", _attention_patterns(), run)
    assert calls.get("npu_fusion_attention", 0) == 1


def test_keys_transposed_by_position_on_a_lower_rank_run_the_original(tmp_path: Path) -> None:
    """``transpose(1, 2)`` is the last two axes of a 3-D key only: the guard checks the rank at run time."""
    import torch

    from apply_support import npufuse
    from npufuse import emulate
    from scratch_repo import import_fresh

    code = _MLA_SUM.replace("KC", "k_c.transpose(1, 2)").replace("KR", "k_r.transpose(1, 2)")
    files = {"pkg/__init__.py": "", "pkg/mla.py": code}
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=_attention_patterns())
    (c,) = [c for c in data["candidates"] if c["pattern"] == "attention"]
    assert "k_c.dim() == 3" in c["replacement"]
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    torch.manual_seed(0)
    # 3-D q / k / v: the rank check holds, the fused op takes 4-D tensors only, so its own rank check runs the original
    qc, kc, v = torch.randn(2, 6, 16), torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    qr, kr = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    ref = import_fresh(make_repo(tmp_path / "ref", files), "pkg.mla").mla(qc, kc, qr, kr, v)
    with emulate.install():
        got = import_fresh(root, "pkg.mla").mla(qc, kc, qr, kr, v)
    assert torch.allclose(ref, got, atol=1e-5)


@pytest.mark.parametrize("kc, kr, why", [
    ("k_c.transpose(1, 3)", "k_r.transpose(2, 3)", "axes 1 and 3 are not adjacent: not a swap of the last two"),
    ("k_c.transpose(2, 3)", "k_r", "the second key is not transposed (already laid out [.., D, S] or a bug)"),
])
def test_summed_products_with_other_transposes_are_kept(tmp_path: Path, kc: str, kr: str, why: str) -> None:
    code = _MLA_SUM.replace("KC", kc).replace("KR", kr)
    data = _scan_code(tmp_path, code, _attention_patterns())
    assert not [c for c in data["candidates"] if c["pattern"] == "attention"], why
    assert any("scores added to scores" in m["reason"] for m in data["near_misses"]), data["near_misses"]


# -- 5. add + norm: the norm reads a copy of the sum's name; a norm built by a decorator-filled registry --------------

_FACTORY = '''\
class Factory:
    _registry = {"norm": {}, "mlp": {}}

    @classmethod
    def register(cls, kind, name):
        def decorator(impl_cls):
            cls._registry[kind][name] = impl_cls
            return impl_cls

        return decorator

    @classmethod
    def create(cls, kind, config, **kwargs):
        return cls._registry[kind][config[kind]](config, **kwargs)
'''

_NORMS = '''\
import torch
from torch import nn

from pkg.factory import Factory


@Factory.register("norm", "base")
class TorchRmsNorm(nn.Module):
    def __init__(self, config, dim):
        super().__init__()
        self.eps = 1e-5
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        input_dtype = x.dtype
        return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps).to(input_dtype)


@Factory.register("norm", "halved")
class HalvedNorm(TorchRmsNorm):
    def forward(self, x):
        return super().forward(x) * 0.5
'''

_BLOCK = '''\
from torch import nn

from pkg.factory import Factory


class Block(nn.Module):
    def __init__(self, config, dim):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.post_norm = Factory.create("norm", config, dim=dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x):
        inp_x = x
        x = self.attn(x)
        ffn_inp_x = x + inp_x
        x = ffn_inp_x
        x = self.post_norm(x)
        x = self.mlp(x)
        return x + ffn_inp_x
'''


def _registry_files(norms: str = _NORMS, factory: str = _FACTORY) -> dict[str, str]:
    return {"pkg/__init__.py": "", "pkg/factory.py": factory, "pkg/norms.py": norms, "pkg/block.py": _BLOCK}


def _add_patterns() -> tuple[Any, ...]:
    from npufuse.patterns.add_rms_norm import AddRmsNorm

    return (AddRmsNorm(),)


def test_add_then_norm_of_a_registry_built_module_runs_fused_for_the_registered_rms_class(tmp_path: Path) -> None:
    import importlib
    import sys

    import torch

    from apply_support import npufuse
    from npufuse import emulate

    root = make_repo(tmp_path / "repo", _registry_files())
    data = scan(root, patterns=_add_patterns())
    (c,) = [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    assert c["file"] == "pkg/block.py" and 'type(self.post_norm).__qualname__ == "TorchRmsNorm"' in c["replacement"]
    assert 'type(self.post_norm).__module__ == "pkg.norms"' in c["replacement"]
    ref_root = make_repo(tmp_path / "ref", _registry_files())
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0

    def run(where: Path, choice: str) -> torch.Tensor:
        sys.path.insert(0, str(where))
        try:
            for k in [k for k in sys.modules if k == "pkg" or k.startswith("pkg.")]:
                del sys.modules[k]
            importlib.import_module("pkg.norms")  # fills the registry
            block = importlib.import_module("pkg.block")
            torch.manual_seed(0)
            m = block.Block({"norm": choice}, 16).eval()
            with torch.no_grad():
                m.post_norm.weight.add_(0.1 * torch.randn(16))
                return m(torch.randn(2, 3, 16))
        finally:
            sys.path.remove(str(where))
            for k in [k for k in sys.modules if k == "pkg" or k.startswith("pkg.")]:
                del sys.modules[k]

    for choice, fused in (("base", 1), ("halved", 0)):
        ref = run(ref_root, choice)
        with emulate.install() as emu:
            got = run(root, choice)
        assert emu.calls.get("npu_add_rms_norm", 0) == fused, (choice, emu.calls)
        assert torch.allclose(ref, got, atol=1e-5), choice


@pytest.mark.parametrize("norms, factory, why", [
    (_NORMS, _FACTORY.replace("            return impl_cls\n", "            return lambda *a, **k: impl_cls(*a, **k)\n"),
     "the decorator binds a wrapper, not the class: the registered class is not what the name holds"),
    (_NORMS.replace("class HalvedNorm(TorchRmsNorm):\n    def forward(self, x):\n        return super().forward(x) * 0.5\n",
                    "class OtherNorm(nn.Module):\n    def __init__(self, config, dim):\n        super().__init__()\n"
                    "        self.eps = 1e-6\n        self.weight = nn.Parameter(torch.ones(dim))\n\n"
                    "    def forward(self, x):\n        return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)\n"),
     _FACTORY, "two registered classes read as an RMSNorm: each would need its own fused code"),
])
def test_registry_built_norms_that_cannot_be_pinned_to_one_class_are_kept(tmp_path: Path, norms: str, factory: str, why: str) -> None:
    data = scan(make_repo(tmp_path, _registry_files(norms, factory)), patterns=_add_patterns())
    assert not [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"], why


_ALIAS_BLOCK = _MODEL + '''

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.post = RMSNorm(d)
        self.mlp = nn.Linear(d, d)

    def forward(self, x):
        inp_x = x
        x = self.attn(x)
        ffn_inp_x = x + inp_x
        COPY
        x = self.post(x)
        x = self.mlp(x)
        return x + ffn_inp_x
'''


def test_norm_of_a_copy_of_the_sum_name_is_fused(tmp_path: Path) -> None:
    import torch

    files = {"pkg/__init__.py": "", "pkg/m.py": _ALIAS_BLOCK.replace("COPY", "x = ffn_inp_x")}
    root = make_repo(tmp_path / "repo", files)
    (c,) = [c for c in scan(root, patterns=_add_patterns())["candidates"] if c["pattern"] == "add_rms_norm"]
    assert c["qualname"] == "Block.forward"

    def run(mod: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        m = mod.Block(16)
        x = torch.randn(2, 3, 16, requires_grad=True)
        y = m(x)
        y.sum().backward()
        with torch.no_grad():
            z = m(x)
        return [y.detach(), x.grad, z]

    calls = _fused_against_eager(tmp_path / "emu", files, "pkg.m", _add_patterns(), run)
    assert calls.get("npu_add_rms_norm", 0) == 1 and calls.get("npu_rms_norm", 0) == 1, calls


@pytest.mark.parametrize("copy, why", [
    ("x = ffn_inp_x.detach()", "the norm reads a detached copy: not the sum's autograd value"),
    ("x = inp_x", "the norm reads the block's input, not the sum"),
])
def test_norm_of_something_other_than_a_plain_copy_of_the_sum_is_kept(tmp_path: Path, copy: str, why: str) -> None:
    data = _scan_code(tmp_path, _ALIAS_BLOCK.replace("COPY", copy), _add_patterns())
    assert not [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"], why


def test_statistic_helper_over_rank_relative_trailing_dims_gets_a_true_reason(tmp_path: Path) -> None:
    # the helper computes the rms only (the caller applies it): its near miss says that, not "a run-time value"
    data = _scan_code(tmp_path, _RANK_NORM.replace("DIMS", "dims = tuple(range(h.ndim - k, h.ndim))"), (RmsNorm(),))
    reasons = [m["reason"] for m in data["near_misses"] if m["pattern"] == "rms_norm" and m["qualname"] == "RMSNorm._rms"]
    assert all("run-time value" not in r for r in reasons), reasons
