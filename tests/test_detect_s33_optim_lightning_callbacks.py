"""s33 optim33: an optimizer built in a LightningModule's ``configure_optimizers`` is driven by the
Trainer, and the repository's Lightning callbacks reach that module and its optimizers through their
hooks' arguments. A callback that frees the module's grads (proteina's NaN-skip callback:
``pl_module.zero_grad()``, nn.Module's default set_to_none=True on torch >= 2.0) or wraps
``trainer.optimizers`` in a torch.optim.Optimizer subclass that inherits Optimizer.zero_grad (NeMo's
EMA callback copied into proteina) makes the construction a near miss naming the callback. A callback
that only reads the grads, or zeroes them in place, keeps the candidate."""

from __future__ import annotations

from pathlib import Path

import pytest

from apply_support import scan
from npufuse.patterns.fused_optimizer import FusedOptimizer

_MODULE = '''\
import pytorch_lightning as pl
import torch
import torch.nn as nn


class Task(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 4)

    def training_step(self, batch, batch_idx):
        return self.net(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-3)
'''

_NAN_SKIP = '''\
from pytorch_lightning import Callback


class SkipNanGrad(Callback):
    def on_after_backward(self, trainer, pl_module):
        if any(p.grad is not None and p.grad.isnan().any() for p in pl_module.parameters()):
            pl_module.zero_grad({args})
'''

_EMA = '''\
import torch
from lightning.pytorch import Callback


class EMAOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer, decay=0.999):
        self.optimizer = optimizer
        self.decay = decay

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def __getattr__(self, name):
        return getattr(self.optimizer, name)
{zero_grad}

class EMA(Callback):
    def on_fit_start(self, trainer, pl_module):
        trainer.optimizers = [EMAOptimizer(o) for o in trainer.optimizers if not isinstance(o, EMAOptimizer)]
'''

_OWN_ZERO_GRAD = '''
    def zero_grad(self, set_to_none=False):
        self.optimizer.zero_grad(set_to_none=set_to_none)
'''


def _scan(tmp_path: Path, callbacks: str) -> dict:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "task.py").write_text(_MODULE, encoding="utf-8")
    (root / "callbacks.py").write_text(callbacks, encoding="utf-8")
    return scan(root, patterns=[FusedOptimizer()])


def _near(data: dict) -> list[dict]:
    return [m for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["qualname"] == "Task.configure_optimizers"]


def _candidates(data: dict) -> list[dict]:
    return [c for c in data["candidates"] if c["qualname"] == "Task.configure_optimizers"]


@pytest.mark.parametrize("args", ["", "set_to_none=True"])
def test_callback_freeing_the_modules_grads_refuses(tmp_path: Path, args: str) -> None:
    data = _scan(tmp_path, _NAN_SKIP.format(args=args))
    assert not _candidates(data)
    near = _near(data)
    assert len(near) == 1, data["near_misses"]
    assert "(`SkipNanGrad.on_after_backward`, callbacks.py:7) calls `pl_module.zero_grad()`" in near[0]["reason"]


def test_callback_zeroing_in_place_keeps_the_candidate(tmp_path: Path) -> None:
    data = _scan(tmp_path, _NAN_SKIP.format(args="set_to_none=False"))
    assert _candidates(data), data["near_misses"]


def test_ema_wrapper_inheriting_optimizer_zero_grad_refuses(tmp_path: Path) -> None:
    data = _scan(tmp_path, _EMA.format(zero_grad=""))
    near = _near(data)
    assert len(near) == 1, data["near_misses"]
    assert "replaces `trainer.optimizers` with `EMAOptimizer` wrappers" in near[0]["reason"]
    assert "inherits torch.optim.Optimizer.zero_grad" in near[0]["reason"]


def test_ema_wrapper_with_its_own_zero_grad_still_refuses_as_unchecked(tmp_path: Path) -> None:
    # the wrapper's own zero_grad is not read: the reason says what npufuse does not check
    data = _scan(tmp_path, _EMA.format(zero_grad=_OWN_ZERO_GRAD))
    near = _near(data)
    assert len(near) == 1, data["near_misses"]
    assert "npufuse does not check what they do to the grads" in near[0]["reason"]


def test_callback_only_reading_grads_keeps_the_candidate(tmp_path: Path) -> None:
    reading = _NAN_SKIP.format(args="").replace("            pl_module.zero_grad()\n", "            print('nan grad')\n")
    data = _scan(tmp_path, reading)
    assert _candidates(data), data["near_misses"]
