"""s32 optmoe: an optimizer that goes through accelerate's ``prepare`` runs under whatever
``accelerate launch --config_file x.yaml`` chooses. ``distributed_type: DEEPSPEED`` / ``FSDP`` /
``MEGATRON_LM`` wraps it in an engine that flattens the parameters or re-assigns their grads every
step, and the code never says so (the launcher tells the Accelerator through environment
variables). So every accelerate-prepared candidate's guard reads that environment where the
optimizer is built (those runs keep torch.optim), whether the ``prepare`` is in the candidate's file
or in the file that drives it; and where every accelerate launch configuration the repository ships
shards (MC-SMoE's scripts all launch ``static/finetune_config.yaml``, DeepSpeed ZeRO-1), the site is a
near miss naming those files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from apply_support import scan
from npufuse.patterns.fused_optimizer import ACCELERATE_SHARDING_ENV, FusedOptimizer, accelerate_launch_guard, guard_model

_TRAIN = '''\
import torch
import torch.nn as nn
from accelerate import Accelerator


def main(lr=1e-3):
    accelerator = Accelerator(gradient_accumulation_steps=1)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(3):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.randn(2, 8)).sum())
            optimizer.step()
            optimizer.zero_grad()
'''

_DEEPSPEED_YAML = '''\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  zero_stage: 1
distributed_type: DEEPSPEED
mixed_precision: bf16
num_processes: 1
'''

_DDP_JSON = '{"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": 2}\n'


def _scan(root: Path, files: dict[str, str]) -> dict:
    root.mkdir()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return scan(root, patterns=[FusedOptimizer()])


def _site(data: dict, qualname: str) -> tuple[list[dict], list[dict]]:
    return ([c for c in data["candidates"] if c["qualname"] == qualname],
            [m for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["qualname"] == qualname])


def test_every_launch_config_shards_makes_a_near_miss(tmp_path: Path) -> None:
    data = _scan(tmp_path / "repo", {"train.py": _TRAIN, "static/finetune_config.yaml": _DEEPSPEED_YAML})
    cands, near = _site(data, "main")
    assert not cands
    assert len(near) == 1, data["near_misses"]
    reason = near[0]["reason"]
    assert "accelerate's prepare (line 10)" in reason
    assert "static/finetune_config.yaml (distributed_type: DEEPSPEED)" in reason


def test_mixed_launch_configs_keep_a_guarded_candidate(tmp_path: Path) -> None:
    data = _scan(tmp_path / "repo", {"train.py": _TRAIN, "configs/ds.yaml": _DEEPSPEED_YAML, "configs/ddp.json": _DDP_JSON})
    cands, near = _site(data, "main")
    assert len(cands) == 1 and not near, data["near_misses"]
    c = cands[0]
    assert c["params"]["guard"] == "fresh_generator_accelerate_launch_checked"
    assert all(name in c["guard_tensor"] for name in ACCELERATE_SHARDING_ENV)


def test_no_launch_config_keeps_a_guarded_candidate(tmp_path: Path) -> None:
    data = _scan(tmp_path / "repo", {"train.py": _TRAIN})
    cands, _near = _site(data, "main")
    assert len(cands) == 1 and "ACCELERATE_USE_DEEPSPEED" in cands[0]["guard_tensor"]


_BUILDER = '''\
import torch


def get_optimizer(model, lr):
    return torch.optim.Adam(model.parameters(), lr=lr)
'''

_DRIVER = '''\
import torch
from accelerate import Accelerator
from optim_utils import get_optimizer


def train(model):
    accelerator = Accelerator()
    opt = get_optimizer(model, 1e-3)
    model, opt = accelerator.prepare(model, opt)
    for _ in range(3):
        accelerator.backward(model(torch.randn(2, 8)).sum())
        opt.step()
        opt.zero_grad()
'''


def test_prepare_in_the_driving_file_guards_the_builder(tmp_path: Path) -> None:
    data = _scan(tmp_path / "repo", {"optim_utils.py": _BUILDER, "train.py": _DRIVER})
    cands, near = _site(data, "get_optimizer")
    assert len(cands) == 1, near
    c = cands[0]
    assert c["params"]["accelerate_prepare"] == "train.py:9"
    assert "ACCELERATE_USE_FSDP" in c["guard_tensor"]
    assert "zero_grad" in c["fused"]  # the in-place zero_grad rebinding is still there


def test_driving_file_prepare_with_sharded_launch_configs_is_a_near_miss(tmp_path: Path) -> None:
    data = _scan(tmp_path / "repo", {"optim_utils.py": _BUILDER, "train.py": _DRIVER, "accelerate_ds.yaml": _DEEPSPEED_YAML})
    cands, near = _site(data, "get_optimizer")
    assert not cands and len(near) == 1
    assert "accelerate's prepare (train.py:9)" in near[0]["reason"]


@pytest.mark.parametrize("value, fused", [("", True), ("false", True), ("0", True), ("true", False), ("1", False), ("YES", False)])
def test_guard_reads_the_launchers_environment(monkeypatch: pytest.MonkeyPatch, value: str, fused: bool) -> None:
    model = torch.nn.Linear(2, 2)
    guard = accelerate_launch_guard("next(model.parameters(), None)")
    for name in ACCELERATE_SHARDING_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", value)
    got = eval(guard, {"_npufuse_os": os, "model": model})
    assert (got is not None) is fused
    assert guard_model(guard) == "model"


# -- the same for a LightningModule: the Trainer's strategy, read where configure_optimizers builds it ----------

class FSDPStrategy:  # the names Lightning's strategies have (only the class name is read)
    pass


class DDPStrategy:
    pass


class DeepSpeedPlugin:  # pytorch_lightning 1.2-1.5: `trainer.training_type_plugin`
    pass


class _Trainer:
    def __init__(self, strategy=None, plugin=None):
        if strategy is not None:
            self.strategy = strategy
        if plugin is not None:
            self.training_type_plugin = plugin


class _Module(torch.nn.Linear):
    def __init__(self, trainer=None, old_style=False):
        super().__init__(2, 2)
        if old_style:
            self.trainer = trainer  # Lightning 1.0: a plain attribute
        else:
            self._trainer = trainer


@pytest.mark.parametrize("trainer, old_style, fused", [
    (None, False, True),  # configure_optimizers called by hand
    (_Trainer(DDPStrategy()), False, True),
    (_Trainer(FSDPStrategy()), False, False),
    (_Trainer(plugin=DeepSpeedPlugin()), False, False),
    (_Trainer(FSDPStrategy()), True, False),
    (_Trainer(DDPStrategy()), True, True),
])
def test_lightning_guard_reads_the_attached_trainers_strategy(trainer, old_style: bool, fused: bool) -> None:
    from npufuse.patterns.fused_optimizer import lightning_strategy_guard

    module = _Module(trainer, old_style)
    guard = lightning_strategy_guard("next(self.parameters(), None)", "self")
    got = eval(guard, {"self": module})
    assert (got is not None) is fused
    assert guard_model(guard) == "self"
