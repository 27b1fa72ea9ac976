"""s30 optnorm: an optimizer built by a factory function in one file, whose caller (another file)
hands the model it gave the factory to a helper (a third file) that sets some of its parameters'
grads to None (SlowFast's ``contrastive_parameter_surgery(model, ...)`` in the training loop): the
next backward allocates grads outside the fused class's flat buffer, so the construction is a near
miss naming the helper call and the free. A helper that only reads the grads keeps the candidate."""

from __future__ import annotations

from pathlib import Path

from apply_support import scan
from npufuse.patterns.fused_optimizer import FusedOptimizer

_FACTORY = '''\
import torch


def construct_optimizer(model, lr):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
'''

_SURGERY = '''\
def parameter_surgery(model, epoch):
    if epoch < 1:
        for name, p in model.named_parameters():
            if "prototypes" in name:
                p.grad = None
    return model


def grad_report(model, epoch):
    return sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)
'''

_TRAIN = '''\
import torch
import optimizer as optim
from surgery import {helper}


def train(model, steps=3):
    opt = optim.construct_optimizer(model, 1e-2)
    for epoch in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        {helper}(model, epoch)
        opt.step()
        opt.zero_grad(set_to_none=False)
'''


def _scan(tmp_path: Path, helper: str) -> dict:
    root = tmp_path / helper
    root.mkdir()
    for rel, text in {"optimizer.py": _FACTORY, "surgery.py": _SURGERY, "train.py": _TRAIN.format(helper=helper)}.items():
        (root / rel).write_text(text, encoding="utf-8")
    return scan(root, patterns=[FusedOptimizer()])


def test_helper_freeing_the_models_grads_in_the_callers_file_refuses(tmp_path: Path) -> None:
    data = _scan(tmp_path, "parameter_surgery")
    assert not [c for c in data["candidates"] if c["qualname"] == "construct_optimizer"]
    near = [m for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["qualname"] == "construct_optimizer"]
    assert len(near) == 1, data["near_misses"]
    assert "`parameter_surgery` (train.py:10) is handed the model and sets grads to None (surgery.py:5)" in near[0]["reason"]


def test_helper_only_reading_grads_keeps_the_candidate(tmp_path: Path) -> None:
    data = _scan(tmp_path, "grad_report")
    assert [c for c in data["candidates"] if c["qualname"] == "construct_optimizer"], data["near_misses"]
