"""Issue 14 class 5: `**mapping` keyword arguments whose keys only the run time knows. The guard
checks the keys when the optimizer is built (a key the fused class does not take, such as
maximize=, keeps torch.optim); implementation choices (fused=, foreach=) are filtered out of the
fused call. Runs the rewritten code under the emulator."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apply_support import load_module, npufuse, scan
from npufuse import emulate
from npufuse.patterns.fused_optimizer import FusedOptimizer

_CODE = '''\
import torch
import torch.nn as nn


def train(extra, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    kwargs = {"lr": 1e-2}
    kwargs.update(extra)
    opt = torch.optim.Adam(model.parameters(), **kwargs)
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]
'''


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("kwargs")
    (root / "train.py").write_text(_CODE, encoding="utf-8")
    data = scan(root, patterns=[FusedOptimizer()])
    assert [c["params"]["guard"] for c in data["candidates"]] == ["fresh_generator_kwargs_checked"]
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    return (root / "train.py").read_text(encoding="utf-8")


@pytest.mark.parametrize("extra,fused", [
    ({"betas": (0.8, 0.9), "eps": 1e-6}, True),  # arguments the fused class takes
    ({"fused": False, "foreach": True}, True),  # implementation choices: filtered out
    ({"maximize": True}, False),  # changes the update: torch.optim runs
    ({"weight_decay": 0.1, "differentiable": False}, False),  # not taken by NpuFusedAdam: torch.optim runs
])
def test_keys_decide_at_run_time(rewritten: str, extra: dict, fused: bool) -> None:
    ref = load_module(_CODE, "original")["train"](dict(extra))
    with emulate.install() as emu:
        out = load_module(rewritten, "rewritten")["train"](dict(extra))
    assert (sum(emu.calls.values()) >= 1) is fused
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ref, out))
