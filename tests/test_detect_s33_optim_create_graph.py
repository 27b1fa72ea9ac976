"""s33 optim33: ``loss.backward(create_graph=True)`` runs the backward in grad mode, where autograd's
AccumulateGrad adds each new grad out of place (``grad = grad + new``): every step after the first gives each
parameter a new grad tensor, which the fused class's combined grad buffer never sees (AdaHessian's shared
CIFAR loop, where SGD/Adam/AdamW baselines share the second-order optimizer's backward). In the site's own
file and in a file that drives the optimizer its builder makes, an unconditional literal create_graph=True
refuses; ``torch.autograd.grad(create_graph=True)`` (a gradient penalty) never touches ``.grad``."""

from __future__ import annotations

from pathlib import Path

import pytest

from apply_support import scan
from npufuse.patterns.fused_optimizer import FusedOptimizer

_BUILDER = '''\
import torch


def make_optimizer(model, lr=1e-3):
    return torch.optim.Adam(model.parameters(), lr=lr)
'''

_DRIVER = '''\
import torch
from optim_factory import make_optimizer


def train(model, batches):
    optimizer = make_optimizer(model)
    for x in batches:
        loss = model(x).square().mean()
{backward}
        optimizer.step()
        optimizer.zero_grad()
'''


def _scan(tmp_path: Path, backward: str) -> dict:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "optim_factory.py").write_text(_BUILDER, encoding="utf-8")
    (root / "train.py").write_text(_DRIVER.format(backward=backward), encoding="utf-8")
    return scan(root, patterns=[FusedOptimizer()])


@pytest.mark.parametrize("backward", ["        loss.backward(create_graph=True)",
                                      "        torch.autograd.backward(loss, None, None, True)"])
def test_second_order_backward_in_the_driving_file_refuses(tmp_path: Path, backward: str) -> None:
    data = _scan(tmp_path, backward)
    assert not [c for c in data["candidates"] if c["qualname"] == "make_optimizer"]
    near = [m for m in data["near_misses"] if m["qualname"] == "make_optimizer"]
    assert near and "(create_graph=True)` at train.py:9, in the file that drives the optimizer" in near[0]["reason"]


@pytest.mark.parametrize("backward", ["        loss.backward()",
                                      "        g, = torch.autograd.grad(loss, x, create_graph=True)\n        (loss + g.sum()).backward()",
                                      "        if x.numel() > 4:\n            loss.backward(create_graph=True)\n        else:\n            loss.backward()"])
def test_first_order_or_conditional_keeps_the_candidate(tmp_path: Path, backward: str) -> None:
    data = _scan(tmp_path, backward)
    found = [c for c in data["candidates"] if c["qualname"] == "make_optimizer"]
    assert found, data["near_misses"]
    # a conditional second-order backward is a risk of the candidate, not a refusal
    said = any("create_graph=True" in r["detail"] for r in found[0]["risks"])
    assert said == ("if x.numel()" in backward)
