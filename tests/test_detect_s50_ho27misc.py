"""s50 (ho27misc): the judged non-MoE HO27 classes, as invented spellings (no repository code).

1. add_rms_norm: a layer whose norm class is a constructor parameter defaulting to nn.LayerNorm, while a builder of the
   repository passes an own RMSNorm class (its own parameter default, handed down): fused where the norm's run-time
   type is that class; nothing passed anywhere but LayerNorm keeps the old reason.
2. add_rms_norm: an own RMSNorm class whose forward has several arms (the library kernel, an opt-in external kernel
   behind a keyword the call passes, the norm by hand), called with that keyword: fused under `not (<keyword>)`.
3. fused_optimizer: (a) a refusal that holds only on a non-default option (an MoE model type, FSDP) becomes a run-time
   guard on the option; (b) Accelerate: the optimizer is built before `accelerator.prepare` moves the model, so the
   guard tests the accelerator's device, not the parameters' current one.
4. sdpa: F.scaled_dot_product_attention through a module-level alias (`attend = F.scaled_dot_product_attention`).
5. swiglu: a learned bias on the gate before the activation; the SSM output gate `y * silu(z)`.
6. attention: a NaN fallback after the softmax.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pattern_harness import detect_all
from pattern_harness import fused_and_runs as _fused_and_runs, near_miss_says as _near_miss

from npufuse.patterns.sdpa import SdpaPattern
from npufuse.scan.engine import scan_repo


# -- 4. SDPA through a module-level alias ------------------------------------------------------------------------------

_SDPA_ALIAS = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F

attend = F.scaled_dot_product_attention


class Mixer(nn.Module):
    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        o = attend(q, k, v, dropout_p=0.0)
        return o.transpose(1, 2).reshape(b, n, c)
'''

_SDPA_ALIAS_RUN = '''
torch.manual_seed(0)
m = Mixer(16)
x = torch.randn(2, 5, 16, requires_grad=True)
mb = Mixer(16).to(torch.bfloat16)
out = [m(x), mb(x.detach().to(torch.bfloat16)).float()]
leaves = [x, m.qkv.weight]
'''


def test_sdpa_module_level_alias_fuses() -> None:
    facts = _fused_and_runs(SdpaPattern(), _SDPA_ALIAS, _SDPA_ALIAS_RUN, "Mixer.forward", tol=0.999)
    assert facts["all_calls"].get("npu_fusion_attention", 0) >= 1, facts["all_calls"]


def test_sdpa_alias_rebound_or_shadowed_is_not_sdpa() -> None:
    for change in [("attend = F.scaled_dot_product_attention\n",
                    "attend = F.scaled_dot_product_attention\nif torch.cuda.is_available():\n    attend = torch.compile(attend)\n"),
                   ("attend = F.scaled_dot_product_attention\n",
                    "attend = F.scaled_dot_product_attention\n\n\ndef use_math():\n    global attend\n    attend = lambda q, k, v, dropout_p=0.0: q\n"),
                   ("        b, n, c = x.shape\n", "        b, n, c = x.shape\n        attend = self.other\n")]:
        code = _SDPA_ALIAS.replace(*change)
        assert code != _SDPA_ALIAS
        findings, _ = detect_all(SdpaPattern(), code)
        assert not findings, change


# -- 3b. Accelerate: the optimizer is built before prepare moves the model --------------------------------------------

_ACCEL_ORDER = '''\
import torch
import torch.nn as nn
from accelerate import Accelerator

accelerator = Accelerator()
net = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
opt = torch.optim.AdamW(net.parameters(), lr=3e-4)
net, opt = accelerator.prepare(net, opt)


def train(batches):
    for x, y in batches:
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
'''


class _StubAccelerator:
    def __init__(self, device: str, placement: bool) -> None:
        self.device, self.device_placement = torch.device(device), placement


def _guard_device(guard: str, acc: _StubAccelerator) -> object:
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    t = eval(guard, {"torch": torch, "accelerator": acc, "net": net, "_npufuse_os": __import__("os")})
    return None if t is None else t.device


def test_accelerate_optimizer_before_prepare_tests_the_accelerator_device(tmp_path: Path) -> None:
    from apply_support import scan
    from npufuse.patterns.fused_optimizer import FusedOptimizer

    (tmp_path / "train.py").write_text(_ACCEL_ORDER)
    data = scan(tmp_path, patterns=[FusedOptimizer()])
    cands = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer"]
    assert len(cands) == 1, data["near_misses"]
    assert cands[0]["params"].get("device_tested") == "accelerator.device", cands[0]["params"]
    guard = cands[0]["guard_tensor"]
    # the model is on the CPU at the construction; the device read is the one prepare moves it to
    assert _guard_device(guard, _StubAccelerator("meta", True)) == torch.device("meta")
    # an accelerator that does not place the model: the parameters' own device, as before
    assert _guard_device(guard, _StubAccelerator("meta", False)) == torch.device("cpu")


def test_accelerate_prepare_before_the_optimizer_keeps_the_parameter_device(tmp_path: Path) -> None:
    from apply_support import scan
    from npufuse.patterns.fused_optimizer import FusedOptimizer

    code = _ACCEL_ORDER.replace("opt = torch.optim.AdamW(net.parameters(), lr=3e-4)\nnet, opt = accelerator.prepare(net, opt)\n",
                                "net = accelerator.prepare(net)\nopt = torch.optim.AdamW(net.parameters(), lr=3e-4)\nopt = accelerator.prepare(opt)\n")
    assert code != _ACCEL_ORDER
    (tmp_path / "train.py").write_text(code)
    data = scan(tmp_path, patterns=[FusedOptimizer()])
    cands = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer"]
    assert len(cands) == 1 and "device_tested" not in cands[0]["params"], cands
    assert _guard_device(cands[0]["guard_tensor"], _StubAccelerator("meta", True)) == torch.device("cpu")


# -- 1. a LayerNorm-default norm parameter; the repository passes an own RMSNorm class ---------------------------------

_NORMS_FILE = '''\
import torch
import torch.nn as nn


class UnitRMS(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.gain = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.gain.float())).type_as(x)
'''

_BLOCK_FILE = '''\
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width, norm_layer=nn.LayerNorm):
        super().__init__()
        self.mix = nn.Linear(width, width)
        self.post_norm = norm_layer(width)
        self.ff = nn.Linear(width, width)

    def forward(self, x):
        x = x + self.mix(x)
        return self.ff(self.post_norm(x))
'''

_NET_FILE = '''\
import torch.nn as nn

from nets.block import Block
from nets.norms import UnitRMS


class Net(nn.Module):
    def __init__(self, width=32, depth=2, norm_layer=UnitRMS):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width, norm_layer=norm_layer) for _ in range(depth)])
'''


def _norm_repo(root: Path, net: str = _NET_FILE) -> list[dict]:
    (root / "nets").mkdir(parents=True)
    (root / "nets" / "__init__.py").write_text("")
    (root / "nets" / "norms.py").write_text(_NORMS_FILE)
    (root / "nets" / "block.py").write_text(_BLOCK_FILE)
    (root / "nets" / "net.py").write_text(net)
    res = scan_repo(root, jobs=1, only=["add_rms_norm"])
    return [c for c in res.candidates if c["file"] == "nets/block.py"], [m for m in res.near_misses if m["file"] == "nets/block.py"]


def test_layernorm_default_with_repository_rms_class_passed_fuses(tmp_path: Path) -> None:
    cands, misses = _norm_repo(tmp_path)
    assert [c["qualname"] for c in cands] == ["Block.forward"], misses
    text = cands[0]["replacement"]
    assert "type(self.post_norm).__module__ == 'nets.norms'" in text and "type(self.post_norm).__qualname__ == 'UnitRMS'" in text, text
    assert "1.0 + self.post_norm.gain" in text.replace("(1.0 + self.post_norm.gain.float())", "1.0 + self.post_norm.gain"), text


def test_layernorm_default_with_only_layernorms_passed_keeps_its_reason(tmp_path: Path) -> None:
    net = _NET_FILE.replace("norm_layer=UnitRMS", "norm_layer=nn.LayerNorm").replace("from nets.norms import UnitRMS\n", "")
    cands, misses = _norm_repo(tmp_path, net)
    assert not cands
    assert any("norm is not RMSNorm by default" in m["reason"] for m in misses), misses
