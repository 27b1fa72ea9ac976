"""s39 opt39 (fused_optimizer): an optimizer returned through two builder files.

opt38 left it: s35's forwarders (a function returning what the builder returns) were read in the builder's own file
only, so a trainer freeing grads (``zero_grad(set_to_none=True)``, which the fused classes reject, spec section 10)
through ``setup()`` of another file that returns ``build_optimizer(...)`` was never read: a wrong candidate. The
forwarder of another file (importing the builder) is now followed one file further. Fuse: the same chain with a
plain ``zero_grad()``. The spellings are written for this test."""

from __future__ import annotations

from pathlib import Path

from apply_support import scan
from npufuse.patterns.fused_optimizer import FusedOptimizer
from scratch_repo import write_files

_FACTORY = '''\
import torch


def build_optimizer(model, lr=1e-3):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
'''

_SETUP = '''\
from optim.factory import build_optimizer


def prepare_training(model, cfg):
    optimizer = build_optimizer(model, cfg["lr"])
    return optimizer
'''

_TRAIN = '''\
import torch
import torch.nn as nn
from training.setup import prepare_training


def main(loader, steps=3):
    net = nn.Linear(8, 4)
    opt = prepare_training(net, {{"lr": 1e-3}})
    for x, y in loader:
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad({flag})
'''


def _optim(data: dict, file: str) -> tuple[list[dict], list[str]]:
    cands = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer" and c["file"] == file]
    near = [m["reason"] for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["file"] == file]
    return cands, near


def _repo(root: Path, flag: str) -> tuple[list[dict], list[str]]:
    write_files(root, {"optim/__init__.py": "", "optim/factory.py": _FACTORY, "training/__init__.py": "",
                       "training/setup.py": _SETUP, "train.py": _TRAIN.format(flag=flag)})
    return _optim(scan(root, patterns=[FusedOptimizer()]), "optim/factory.py")


def test_keep_grads_freed_by_a_trainer_two_files_away(tmp_path: Path) -> None:
    cands, near = _repo(tmp_path, "set_to_none=True")
    assert not cands and len(near) == 1, near
    assert "`prepare_training` returns what `build_optimizer` builds and is used at train.py:" in near[0], near


def test_a_plain_zero_grad_two_files_away_is_fused(tmp_path: Path) -> None:
    cands, near = _repo(tmp_path, "")
    assert len(cands) == 1 and not near, near
