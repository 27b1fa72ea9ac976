"""s51 (optim51): fused_optimizer refusals true only of a non-default option become run-time guards.

Invented reproducers (no repository code): (1) a trainer whose model npufuse cannot tell apart, in a repository
where a model type chosen by a flag holds an MoE layer that calls its experts only when tokens reach them: the
fused class runs where the model holds no such module; (2) an FSDP wrap under ``if self.cfg.use_fsdp and
self.world_size > 1`` in ``__init__`` and the optimizer built in another method: the same test guards the fused
branch. Twins keep the refusal where the guard could not read the same values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from npufuse.scan.engine import scan_repo

_MOE = """import torch
from torch import nn


class RoutedFFN(nn.Module):
    def __init__(self, dim, n_experts=4):
        super().__init__()
        self.gate = nn.Linear(dim, n_experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_experts))

    def forward(self, x):
        top = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            hit = top == i
            if hit.any():
                out[hit] = expert(x[hit])
        return out


class MoENet(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.ffn = RoutedFFN(dim)

    def forward(self, x):
        return self.ffn(self.inp(x))
"""

_DENSE = """from torch import nn


class DenseNet(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        return self.out(self.inp(x).relu())
"""

_PRETRAIN = """import torch


def pretrain(model, batches, lr=1e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for x in batches:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
"""

_MAIN = """import argparse

from nets.dense import DenseNet
from nets.moe import MoENet
from loop.pretrain import pretrain


def build(kind):
    if kind == "dense":
        return DenseNet()
    return MoENet()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="dense")
    args = ap.parse_args()
    pretrain(build(args.kind), [])
"""


def _skip_repo(tmp_path: Path, moe: str = _MOE) -> Any:
    for d in ("nets", "loop"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "nets" / "moe.py").write_text(moe)
    (tmp_path / "nets" / "dense.py").write_text(_DENSE)
    (tmp_path / "loop" / "pretrain.py").write_text(_PRETRAIN)
    (tmp_path / "main.py").write_text(_MAIN)
    return scan_repo(tmp_path, jobs=1, only=["fused_optimizer"])


def _guard_value(guard: str, model: nn.Module) -> Any:
    """The guard evaluated as the rewritten file would (no NPU here: the tensor it yields, or None)."""
    return eval(guard, {"__builtins__": __builtins__}, {"model": model})  # noqa: S307 - the scanner's own guard text


def test_untold_model_with_a_skipping_class_fuses_under_a_module_test(tmp_path: Path) -> None:
    res = _skip_repo(tmp_path)
    got = [c for c in res.candidates if c["file"] == "loop/pretrain.py"]
    assert len(got) == 1, res.near_misses
    guard = got[0]["guard_tensor"]
    assert "RoutedFFN" in guard and "modules()" in guard
    # dense model: the guard yields the parameters' tensor (the fused class may run); a model holding the MoE layer
    # (or a subclass of it): None, torch.optim runs
    from nets_stub import DenseStub, MoEStub, SubMoEStub  # type: ignore[import-not-found]
    assert isinstance(_guard_value(guard, DenseStub()), torch.Tensor)
    assert _guard_value(guard, MoEStub()) is None
    assert _guard_value(guard, SubMoEStub()) is None


def test_skipping_class_not_shown_to_be_a_module_keeps_the_reason(tmp_path: Path) -> None:
    moe = _MOE.replace("class RoutedFFN(nn.Module):", "class Block(nn.Module):\n    pass\n\n\nclass RoutedFFN(Block):")
    res = _skip_repo(tmp_path, moe)
    assert not [c for c in res.candidates if c["file"] == "loop/pretrain.py"]
    assert any("RoutedFFN" in m["reason"] for m in res.near_misses if m["file"] == "loop/pretrain.py"), res.near_misses


def test_told_model_with_a_skipping_class_keeps_the_reason(tmp_path: Path) -> None:
    res = _skip_repo(tmp_path)
    (tmp_path / "loop" / "pretrain.py").write_text(_PRETRAIN.replace(
        "import torch\n", "import torch\n\nfrom nets.moe import MoENet\n").replace(
        "def pretrain(model, batches, lr=1e-3):\n", "def pretrain(batches, lr=1e-3):\n    model = MoENet()\n"))
    res = scan_repo(tmp_path, jobs=1, only=["fused_optimizer"])
    assert not [c for c in res.candidates if c["file"] == "loop/pretrain.py"]
    assert any("RoutedFFN" in m["reason"] for m in res.near_misses if m["file"] == "loop/pretrain.py"), res.near_misses


_FSDP_TRAINER = """import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


@dataclass
class Cfg:
    lr: float = 1e-3
    use_fsdp: bool = False


class Trainer:
    def __init__(self, model, cfg=None):
        self.cfg = cfg or Cfg()
        self.model = model
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if self.cfg.use_fsdp and self.world_size > 1:
            self.model = FSDP(self.model)
        self.opt = self._make_opt()

    def _make_opt(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr)

    def step(self, x):
        self.opt.zero_grad()
        self.model(x).sum().backward()
        self.opt.step()


def main():
    Trainer(nn.Linear(4, 4), Cfg(use_fsdp=False)).step(torch.randn(2, 4))
"""


def _fsdp_scan(tmp_path: Path, text: str) -> Any:
    (tmp_path / "trainer.py").write_text(text)
    return scan_repo(tmp_path, jobs=1, only=["fused_optimizer"])


def test_sharding_test_on_self_in_init_guards_the_other_method(tmp_path: Path) -> None:
    res = _fsdp_scan(tmp_path, _FSDP_TRAINER)
    got = [c for c in res.candidates if c["file"] == "trainer.py"]
    assert len(got) == 1, res.near_misses
    guard = got[0]["guard_tensor"]
    assert "not (self.cfg.use_fsdp and self.world_size > 1)" in guard

    class _Self:  # the trainer's state where the optimizer is built
        def __init__(self, fsdp: bool, world: int) -> None:
            self.cfg, self.world_size, self.model = type("C", (), {"use_fsdp": fsdp})(), world, nn.Linear(4, 4)

    for fsdp, world, fused in ((False, 1, True), (True, 1, True), (False, 4, True), (True, 4, False)):
        value = eval(guard, {"__builtins__": __builtins__}, {"self": _Self(fsdp, world)})  # noqa: S307
        assert isinstance(value, torch.Tensor) is fused, (fsdp, world)


def test_sharding_attribute_set_in_another_method_keeps_the_reason(tmp_path: Path) -> None:
    text = _FSDP_TRAINER.replace("    def step(self, x):", "    def resize(self, n):\n        self.world_size = n\n\n    def step(self, x):")
    res = _fsdp_scan(tmp_path, text)
    assert not [c for c in res.candidates if c["file"] == "trainer.py"]
    assert any("FSDP" in m["reason"] for m in res.near_misses), res.near_misses


def test_factory_method_called_before_the_test_keeps_the_reason(tmp_path: Path) -> None:
    text = _FSDP_TRAINER.replace("        self.model = model\n", "        self.model = model\n        self.warm = self._make_opt()\n")
    res = _fsdp_scan(tmp_path, text)
    assert not [c for c in res.candidates if c["file"] == "trainer.py"]
    assert any("FSDP" in m["reason"] for m in res.near_misses), res.near_misses
