"""s35 optim35: a model's parameters handed to a helper of another file that re-allocates their grads.

mistral-finetune's ``_train`` builds ``AdamW(model.parameters())`` and calls
``upcast_mixed_precision(model.parameters(), ...)`` / ``downcast_mixed_precision(...)`` (finetune/
mixed_precision.py) around every step; those set ``p.grad = p.grad.to(dtype)``, so the fused class's flat
grad buffer would go stale. ``repo_facts._callee_freeing`` followed only the model or optimizer object
handed to a callee; an argument ``M.parameters()`` / ``M.named_parameters()`` of a tracked ``M`` now hands
the callee those parameters too. Same call shape elsewhere (non-blind mirrors): HF's wav2vec2
``multiply_grads(model.parameters(), c)`` (in place: stays a candidate), Train-LLM-from-Scratch's
``gradient_clipping(model.parameters(), ...)``, composer's ``_apply_agc``, fairscale's test
``zero_grad(model.parameters())`` (``p.grad = None``). The spellings below were written for the test."""

from __future__ import annotations

from pathlib import Path

from apply_support import scan
from npufuse.patterns.fused_optimizer import FusedOptimizer

_HELPERS = '''\
import torch


def to_master(params, dtype=torch.float32):
    for p in params:
        if p.grad is not None:
            p.grad = p.grad.to(dtype)


def drop_named(named, prefix):
    for name, w in named:
        if name.startswith(prefix):
            w.grad = None


def rescale(params, c):
    for p in params:
        if p.grad is not None:
            p.grad.mul_(c)
'''

_TRAIN = '''\
import torch
import torch.nn as nn

from tools import helpers


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def train(steps=3):
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(4, 8)).square().mean().backward()
        {call}
        opt.step()
    return net
'''


def _scan(tmp_path: Path, call: str) -> tuple[list[int], list[str]]:
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    (root / "tools" / "__init__.py").write_text("")
    (root / "tools" / "helpers.py").write_text(_HELPERS, encoding="utf-8")
    (root / "train.py").write_text(_TRAIN.format(call=call), encoding="utf-8")
    data = scan(root, patterns=[FusedOptimizer()])
    cands = [c["line"] for c in data["candidates"] if c["pattern"] == "fused_optimizer"]
    near = [m["reason"] for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["file"] == "train.py"]
    return cands, near


def test_parameters_handed_to_a_grad_reallocating_helper_refuses(tmp_path: Path) -> None:
    cands, near = _scan(tmp_path, "helpers.to_master(net.parameters(), dtype=torch.float32)")
    assert cands == [] and len(near) == 1, near
    assert "`helpers.to_master` (train.py:23)" in near[0] and "tools/helpers.py:7" in near[0]
    assert "assigns new grads" in near[0]


def test_named_parameters_by_keyword_to_a_freeing_helper_refuses(tmp_path: Path) -> None:
    cands, near = _scan(tmp_path, 'helpers.drop_named(prefix="fc2", named=net.named_parameters())')
    assert cands == [] and len(near) == 1 and "sets grads to None" in near[0], near


def test_parameters_handed_to_an_in_place_helper_keep_the_candidate(tmp_path: Path) -> None:
    """Keep-side twin: the helper scales the grads in place, so the flat buffer still holds them."""
    cands, near = _scan(tmp_path, "helpers.rescale(net.parameters(), 0.5)")
    assert cands == [19] and near == [], near
