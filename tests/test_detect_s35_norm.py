"""s35 add_rms_norm pass (HO11 development data): norm helpers of another file that return a library
RMSNorm kernel of their input (ShadowKV's flashinfer ``layer_norm``, LTX-2's ``F.rms_norm`` helper with an
optional weight): the call site's arguments name gamma and eps; the helper's file is never rendered."""

from __future__ import annotations

import types
from pathlib import Path

import torch

from apply_support import make_repo, npufuse, scan
from npufuse import emulate
from npufuse.patterns.add_rms_norm import AddRmsNorm
from scratch_repo import import_fresh, run_block

_OPS = '''\
import torch
from flashinfer.norm import rmsnorm


def layer_norm(hidden_states: torch.Tensor, eps: float, w: torch.Tensor):
    return rmsnorm(hidden_states.view(-1, hidden_states.size(-1)), w, eps).view_as(hidden_states)


def gemma_like(hidden_states, eps, w):
    return rmsnorm(hidden_states.view(-1, hidden_states.size(-1)), w + 1, eps).view_as(hidden_states)
'''

_ENGINE = '''\
import torch
import torch.nn.functional as F

from .ops import layer_norm, gemma_like


class Engine:
    def post_attention(self, attn_output, residual, buffer):
        hidden_states = F.linear(attn_output, buffer.wo)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = layer_norm(hidden_states, buffer.post_eps, buffer.post_weight)
        return F.linear(hidden_states, buffer.up) + residual

    def other(self, attn_output, residual, buffer):
        hidden_states = residual + attn_output
        return gemma_like(hidden_states, buffer.post_eps, buffer.post_weight)
'''

_UTILS = '''\
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight=weight, eps=eps)
'''

_MODEL = '''\
import torch
from torch import nn

from pkg.utils import rms_norm


class Block(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.ff = nn.Linear(d, d)
        self.norm_eps = eps

    def forward(self, x):
        h = x + self.attn(x)
        out = self.ff(rms_norm(h, eps=self.norm_eps))
        return out + h
'''


def test_kernel_helper_of_another_file_is_a_library_norm(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo", {"pkg/__init__.py": "", "pkg/ops.py": _OPS, "pkg/engine.py": _ENGINE})
    data = scan(root, patterns=[AddRmsNorm()])
    cands = [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    assert [(c["qualname"], c["line"]) for c in cands] == [("Engine.post_attention", 10)], data["near_misses"]
    p = cands[0]["params"]
    assert (p["weight"], p["eps"], p["residual_aliases"]) == ("buffer.post_weight", "buffer.post_eps", ["residual"])
    assert p["norm_class"] == "layer_norm (from pkg/ops.py) (rmsnorm kernel)"
    # a weight computed inside the helper (``w + 1``) cannot be named at the call: not followed
    assert not any(c["qualname"] == "Engine.other" for c in cands)
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    text = (root / "pkg" / "engine.py").read_text(encoding="utf-8")
    assert "npu_add_rms_norm(" in text and "buffer.post_weight.to(" in text


def test_weightless_f_rms_norm_helper_of_another_file_runs(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/utils.py": _UTILS, "pkg/model.py": _MODEL}
    ref = run_block(import_fresh(make_repo(tmp_path / "ref", files), "pkg.model"))
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=[AddRmsNorm()])
    cands = [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    assert [(c["qualname"], c["params"]["eps"], c["params"]["weight"]) for c in cands] == [
        ("Block.forward", "(self.norm_eps if self.norm_eps is not None else torch.finfo(torch.float32).eps)", None)], \
        data["near_misses"]
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    with emulate.install() as emu:
        outs = run_block(import_fresh(root, "pkg.model"))
    assert emu.calls["npu_add_rms_norm"] == 1, emu.calls
    for a, b in zip(ref, outs):
        assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


# -- a norm class the caller passes, imported from another file ------------------------------------

_NORMS = '''\
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight
'''

_BLOCK = '''\
import torch
from torch import nn

from pkg.norms import RMSNorm


class Block(nn.Module):
    def __init__(self, d, norm_class):
        super().__init__()
        self.ln1 = norm_class(d)
        self.attn = nn.Linear(d, d)
        self.ln2 = norm_class(d)
        self.mlp = nn.Linear(d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x
'''


def _run_passed(mod: types.ModuleType, norm_class: type) -> torch.Tensor:
    torch.manual_seed(0)
    blk = mod.Block(32, norm_class).to(torch.bfloat16)
    with torch.no_grad():
        return blk(torch.randn(2, 5, 32, dtype=torch.bfloat16))


def test_norm_class_passed_by_the_caller_is_fused_where_it_is_the_rms_class(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/norms.py": _NORMS, "pkg/block.py": _BLOCK}
    ref_mod = import_fresh(make_repo(tmp_path / "ref", files), "pkg.block")
    ref = [_run_passed(ref_mod, ref_mod.RMSNorm), _run_passed(ref_mod, torch.nn.LayerNorm)]
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=[AddRmsNorm()])
    cands = [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    assert [(c["qualname"], c["params"]["condition"]) for c in cands] == [("Block.forward", "type(self.ln2) is RMSNorm")], \
        data["near_misses"]
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    with emulate.install() as emu:
        mod = import_fresh(root, "pkg.block")
        rms = _run_passed(mod, mod.RMSNorm)
        assert emu.calls["npu_add_rms_norm"] == 1, emu.calls
        layer = _run_passed(mod, torch.nn.LayerNorm)  # the type check fails: the original statements
        assert emu.calls["npu_add_rms_norm"] == 1, emu.calls
    for a, b in zip(ref, [rms, layer]):
        assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


# -- a norm wrapper of another file choosing its inner RMSNorm by a test ---------------------------

def test_norm_wrapper_of_another_file_is_fused_where_its_rms_branch_runs(tmp_path: Path) -> None:
    from npufuse.patterns.add_rms_norm import _S35_DISPATCH

    norms = _S35_DISPATCH.split("class Layer")[0]
    layer = "import torch\nfrom torch import nn\n\nfrom .norms import Switch\n\n\nclass Layer" + _S35_DISPATCH.split("class Layer")[1].split("class Wrapped")[0]
    files = {"pkg/__init__.py": "", "pkg/norms.py": norms, "pkg/layer.py": layer}

    def run(mod: types.ModuleType) -> list[torch.Tensor]:
        torch.manual_seed(0)
        plain, cond = mod.Layer(32).to(torch.bfloat16), mod.Layer(32, cond_dim=8).to(torch.bfloat16)
        x, c = torch.randn(2, 5, 32, dtype=torch.bfloat16), torch.randn(2, 5, 8, dtype=torch.bfloat16)
        with torch.no_grad():
            return [plain(x), cond(x, c), cond(x)]

    ref = run(import_fresh(make_repo(tmp_path / "ref", files), "pkg.layer"))
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=[AddRmsNorm()])
    cands = [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    assert [c["qualname"] for c in cands] == ["Layer.forward"], data["near_misses"]
    assert "type(self.norm) is Switch" in cands[0]["params"]["condition"]
    assert 'endswith("/pkg/norms.py")' in cands[0]["params"]["condition"]
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    with emulate.install() as emu:
        outs = run(import_fresh(root, "pkg.layer"))
    # the unconditioned layer runs the fused branch; the FiLM one (with or without conditioning) the original
    assert emu.calls["npu_add_rms_norm"] == 1, emu.calls
    for a, b in zip(ref, outs):
        assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)
