"""s35 optim35: an optimizer reached through a forwarding builder of its file, handed out in a collection.

tinyworlds' ``create_optimizer(model, args)`` returns ``_create_adamw(raw_model, args)`` or
``_create_muon_split(...)``, each of which returns a list of optimizers; the training scripts call
``for opt in optimizers: opt.zero_grad(set_to_none=True)``. The same shape elsewhere: SimMIM's
``build_optimizer`` choosing ``build_pretrain_optimizer`` / ``build_finetune_optimizer``, LLaMA-Factory's
``create_custom_optimizer`` returning one of six ``_create_*_optimizer``, eole's ``build_torch_optimizer``
returning ``_build_sparse_adam_optimizer(...)``; optimizers zeroed in a loop over a collection with
set_to_none=True: modded-nanogpt, OLMo-core, FastVideo, DiffSynth, composer. ``repo_facts`` now reads
the driving file's facts through every module-level function of the builder's file that returns what
the builder returns (or what such a function returns), and the names a loop or a comprehension binds
from the returned collection are the optimizer. The spellings below were written for the test (a
name bound then returned, a comprehension, keyword model)."""

from __future__ import annotations

from pathlib import Path

import torch

from apply_support import npufuse, scan
from npufuse import emulate
from npufuse.patterns.fused_optimizer import FusedOptimizer
from scratch_repo import run_train, write_files

_SETUP = '''\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _plain_sgd(net, lr):
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    return [opt]


def _decoupled(net, lr):
    pool = []
    pool.append(torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.05))
    return pool


def optimizers_for(net, kind="sgd", lr=1e-2):
    if kind == "sgd":
        built = _plain_sgd(net, lr)
        return built
    return _decoupled(net, lr)
'''

_DRIVER = '''\
import torch
from setup_optim import Net, optimizers_for


def train(steps=3):
    torch.manual_seed(0)
    net = Net()
    pool = optimizers_for(net=net, kind="{kind}")
    for _ in range(steps):
        {zero}
        net(torch.randn(4, 8)).square().mean().backward()
        for one in pool:
            one.step()
    return [p.detach().clone() for p in net.parameters()]
'''


def _sites(data: dict) -> tuple[list[str], dict[str, str]]:
    cands = sorted(c["qualname"] for c in data["candidates"] if c["pattern"] == "fused_optimizer")
    near = {m["qualname"]: m["reason"] for m in data["near_misses"] if m["pattern"] == "fused_optimizer"}
    return cands, near


def test_loop_over_forwarded_list_freeing_grads_refuses(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    write_files(root, {"setup_optim.py": _SETUP, "train.py": _DRIVER.format(kind="sgd", zero="for one in pool:\n            one.zero_grad(set_to_none=True)")})
    cands, near = _sites(scan(root, patterns=[FusedOptimizer()]))
    assert cands == []
    for qualname, builder in (("_plain_sgd", "_plain_sgd"), ("_decoupled", "_decoupled")):
        assert "`one.zero_grad(set_to_none=...)` at train.py:11" in near[qualname], near
        assert f"`optimizers_for` returns what `{builder}` builds" in near[qualname]


def test_comprehension_over_forwarded_list_freeing_grads_refuses(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    write_files(root, {"setup_optim.py": _SETUP, "train.py": _DRIVER.format(kind="adamw", zero="[o.zero_grad(set_to_none=True) for o in pool]")})
    cands, near = _sites(scan(root, patterns=[FusedOptimizer()]))
    assert cands == [] and "`o.zero_grad(set_to_none=...)` at train.py:10" in near["_decoupled"], near


def test_loop_zeroing_in_place_keeps_the_candidates_and_they_run(tmp_path: Path) -> None:
    """Keep-side twin: the same loop with set_to_none=False leaves both builders candidates."""
    driver = _DRIVER.format(kind="sgd", zero="for one in pool:\n            one.zero_grad(set_to_none=False)")
    ref = tmp_path / "ref"
    write_files(ref, {"setup_optim.py": _SETUP, "train.py": driver})
    expected = run_train(ref, "setup_optim")
    root = tmp_path / "repo"
    write_files(root, {"setup_optim.py": _SETUP, "train.py": driver})
    cands, near = _sites(scan(root, patterns=[FusedOptimizer()]))
    assert cands == ["_decoupled", "_plain_sgd"], near
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    with emulate.install() as emu:
        outs = run_train(root, "setup_optim")
    assert sum(emu.calls.values()) >= 1, "the fused branch did not run"
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(expected, outs))


def test_opt_in_zeroes_the_forwarded_optimizer_in_place_and_runs(tmp_path: Path) -> None:
    driver = _DRIVER.format(kind="sgd", zero="for one in pool:\n            one.zero_grad(set_to_none=True)")
    ref = tmp_path / "ref"
    write_files(ref, {"setup_optim.py": _SETUP, "train.py": driver.replace("set_to_none=True", "set_to_none=False")})
    expected = run_train(ref, "setup_optim")  # every parameter gets a grad each step: zeroing in place is the same update
    root = tmp_path / "repo"
    write_files(root, {"setup_optim.py": _SETUP, "train.py": driver})
    data = scan(root, patterns=[FusedOptimizer()], optimizer_zero_grad_in_place=True)
    cands, near = _sites(data)
    # `pool.append(AdamW(...))` binds no name whose zero_grad the fused branch could replace: still refused
    assert cands == ["_plain_sgd"] and "at train.py:11" in near["_decoupled"], near
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    assert "opt.zero_grad = " in (root / "setup_optim.py").read_text(encoding="utf-8")
    with emulate.install() as emu:
        outs = run_train(root, "setup_optim")
    assert sum(emu.calls.values()) >= 1, "the fused branch did not run"
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(expected, outs))
