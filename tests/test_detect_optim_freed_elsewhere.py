"""Issue 14 class 5: grads freed by code in ANOTHER file or class (npufuse.scan.repo_facts,
``_freed_through_other_files``): a helper of another file that sets ``p.grad = None`` for the
parameters of the model it is handed (dino's cancel-last-layer during warm-up), reached through the
site's own callees; a base class of another file inherited by the class holding the optimizer
(fairseq's optimizer wrapper whose ``zero_grad`` frees every grad). Dataflow decides, not names: a
helper handed another object, or one that only clips grads in place, leaves the candidate alone,
and that candidate's rewrite runs under the emulator."""

from __future__ import annotations

from pathlib import Path

import torch

from apply_support import npufuse, scan
from npufuse import emulate
from npufuse.patterns.fused_optimizer import FusedOptimizer
from scratch_repo import run_train, write_files

_HELPERS = '''\
import torch


def build_groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def drop_head_grads(epoch, model, frozen_epochs):
    if epoch >= frozen_epochs:
        return
    for name, p in model.named_parameters():
        if name.startswith("fc2"):
            p.grad = None


def clip(model, limit):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data.mul_(min(1.0, limit))
'''

_TRAIN = '''\
import torch
import torch.nn as nn

import helpers


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def one_epoch(net, optimizer, epoch, other):
    for _ in range(2):
        net(torch.randn(4, 8)).square().mean().backward()
        helpers.{helper}
        optimizer.step()
        optimizer.zero_grad()


def train(epochs=2):
    torch.manual_seed(0)
    student = Net()
    teacher = Net()
    groups = helpers.build_groups(student)
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    for epoch in range(epochs):
        one_epoch(student, optimizer, epoch, teacher)
    return [p.detach().clone() for p in student.parameters()]
'''


def _optimizer_sites(data: dict, file: str) -> tuple[list[dict], list[dict]]:
    return ([c for c in data["candidates"] if c["pattern"] == "fused_optimizer" and c["file"] == file],
            [m for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["file"] == file])


def test_helper_of_another_file_freeing_the_models_grads_refuses(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    write_files(root, {"helpers.py": _HELPERS, "train.py": _TRAIN.format(helper="drop_head_grads(epoch, net, 1)")})
    cands, near = _optimizer_sites(scan(root, patterns=[FusedOptimizer()]), "train.py")
    assert cands == [] and len(near) == 1, (cands, near)
    reason = near[0]["reason"]
    # the path the model takes: the site's callee, then the helper of the other file, with its line
    assert "`one_epoch` (train.py:" in reason and "`drop_head_grads` (helpers.py:15) gets `model` and sets grads to None" in reason


def test_helper_handed_another_object_keeps_the_candidate_and_it_runs(tmp_path: Path) -> None:
    # the same helper given the teacher (`other`): the student's grads stay allocated
    train = _TRAIN.format(helper="drop_head_grads(epoch, other, 1)")
    ref_root = tmp_path / "ref"
    write_files(ref_root, {"helpers.py": _HELPERS, "train.py": train})
    ref = run_train(ref_root, "helpers")
    root = tmp_path / "repo"
    write_files(root, {"helpers.py": _HELPERS, "train.py": train})
    cands, near = _optimizer_sites(scan(root, patterns=[FusedOptimizer()]), "train.py")
    assert len(cands) == 1 and near == [], (cands, near)
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    with emulate.install() as emu:
        outs = run_train(root, "helpers")
    assert sum(emu.calls.values()) >= 1, "the fused branch did not run"
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ref, outs))


def test_helper_scaling_grads_in_place_keeps_the_candidate(tmp_path: Path) -> None:
    # `p.grad.data.mul_(...)` changes the grad in place (clip_grad_norm_-like): the buffer stays
    root = tmp_path / "repo"
    write_files(root, {"helpers.py": _HELPERS, "train.py": _TRAIN.format(helper="clip(net, 0.5)")})
    cands, near = _optimizer_sites(scan(root, patterns=[FusedOptimizer()]), "train.py")
    assert len(cands) == 1 and near == [], (cands, near)


def test_helper_reassigning_grad_data_refuses(tmp_path: Path) -> None:
    # `p.grad.data = ...` re-points the grad's storage away from the flat buffer
    helpers = _HELPERS.replace("p.grad.data.mul_(min(1.0, limit))", "p.grad.data = p.grad.data * min(1.0, limit)")
    root = tmp_path / "repo"
    write_files(root, {"helpers.py": helpers, "train.py": _TRAIN.format(helper="clip(net, 0.5)")})
    cands, near = _optimizer_sites(scan(root, patterns=[FusedOptimizer()]), "train.py")
    assert cands == [] and len(near) == 1 and "`clip` (helpers.py:21) gets `model` and assigns new grads" in near[0]["reason"]


_BASE = '''\
class OptimizerBase:
    def __init__(self, cfg):
        self.cfg = cfg

    @property
    def params(self):
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                yield p

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        self._optimizer.step()
'''

_PKG_INIT = "from .base import OptimizerBase\n"

_SGD = '''\
import torch.optim

from . import {base}


class SGDWrapper({base}):
    def __init__(self, cfg, params):
        super().__init__(cfg)
        self._optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
'''


def test_base_class_of_another_file_freeing_what_the_instance_holds_refuses(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    write_files(root, {"optim/__init__.py": _PKG_INIT, "optim/base.py": _BASE, "optim/sgd.py": _SGD.format(base="OptimizerBase")})
    cands, near = _optimizer_sites(scan(root, patterns=[FusedOptimizer()]), "optim/sgd.py")
    assert cands == [] and len(near) == 1
    assert "`SGDWrapper` holds this optimizer and inherits `OptimizerBase.zero_grad` (optim/base.py:13), which sets grads to None" \
        in near[0]["reason"]
    # a base that zeroes through the optimizer itself (in place by default for the fused class) says nothing
    write_files(root, {"optim/base.py": _BASE.replace("        for p in self.params:\n            p.grad = None\n",
                                                 "        self._optimizer.zero_grad()\n")})
    cands, near = _optimizer_sites(scan(root, patterns=[FusedOptimizer()]), "optim/sgd.py")
    assert len(cands) == 1 and near == []
    # a base that asks the optimizer to free them: refused too
    write_files(root, {"optim/base.py": _BASE.replace("        for p in self.params:\n            p.grad = None\n",
                                                 "        self._optimizer.zero_grad(set_to_none=True)\n")})
    cands, near = _optimizer_sites(scan(root, patterns=[FusedOptimizer()]), "optim/sgd.py")
    assert cands == [] and "frees grads (`self._optimizer.zero_grad(set_to_none=...)`)" in near[0]["reason"]


def test_freeing_code_of_an_unrelated_class_elsewhere_does_not_refuse(tmp_path: Path) -> None:
    # the base class is another one (the freeing class exists in the repo but is not inherited)
    root = tmp_path / "repo"
    write_files(root, {"optim/__init__.py": _PKG_INIT + "from .plain import Plain\n", "optim/base.py": _BASE,
                  "optim/plain.py": "class Plain:\n    def __init__(self, cfg):\n        self.cfg = cfg\n",
                  "optim/sgd.py": _SGD.format(base="Plain")})
    cands, near = _optimizer_sites(scan(root, patterns=[FusedOptimizer()]), "optim/sgd.py")
    assert len(cands) == 1 and near == []


def test_helper_of_another_file_run_only_before_the_construction_keeps_the_candidate(tmp_path: Path) -> None:
    # a helper re-allocating the grads runs once before the optimizer is built (the fused class
    # reads parameters and grads at construction and its first step): harmless; in the loop it is not
    train = _TRAIN.format(helper="clip(net, 0.5)").replace(
        "    groups = helpers.build_groups(student)\n", "    helpers.reset(student)\n    groups = helpers.build_groups(student)\n")
    helpers = _HELPERS + "\n\ndef reset(model):\n    for p in model.parameters():\n        p.grad = None\n"
    root = tmp_path / "repo"
    write_files(root, {"helpers.py": helpers, "train.py": train})
    cands, near = _optimizer_sites(scan(root, patterns=[FusedOptimizer()]), "train.py")
    assert len(cands) == 1 and near == [], (cands, near)
    write_files(root, {"train.py": train.replace("        one_epoch(student, optimizer, epoch, teacher)\n",
                                            "        one_epoch(student, optimizer, epoch, teacher)\n        helpers.reset(student)\n")})
    cands, near = _optimizer_sites(scan(root, patterns=[FusedOptimizer()]), "train.py")
    assert cands == [] and "`helpers.reset` (train.py:34) -> `reset` (helpers.py:26) gets `model` and sets grads to None" in near[0]["reason"]


_WRAPPER = '''\
class Wrapped:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)
'''

_WRAPPED_TRAIN = '''\
import torch

from wrap import Wrapped


def build(model):
    {build}
    return opt
'''


def test_wrapper_class_of_another_file_asking_its_optimizer_to_free_refuses(tmp_path: Path) -> None:
    for build in ("opt = Wrapped(torch.optim.AdamW(model.parameters(), lr=1e-3))",
                  "inner = torch.optim.AdamW(model.parameters(), lr=1e-3)\n    opt = Wrapped(inner)"):
        root = tmp_path / f"repo{len(build)}"
        write_files(root, {"wrap.py": _WRAPPER, "train.py": _WRAPPED_TRAIN.format(build=build)})
        cands, near = _optimizer_sites(scan(root, patterns=[FusedOptimizer()]), "train.py")
        assert cands == [] and len(near) == 1, (build, cands, near)
        assert "(class Wrapped, wrap.py:1)" in near[0]["reason"] and "(wrap.py:9)" in near[0]["reason"]
        # the wrapper that zeroes through the optimizer's own default (in place for the fused class)
        write_files(root, {"wrap.py": _WRAPPER.replace("zero_grad(set_to_none=True)", "zero_grad()")})
        cands, near = _optimizer_sites(scan(root, patterns=[FusedOptimizer()]), "train.py")
        assert len(cands) == 1 and near == [], (build, cands, near)


def test_helper_of_another_file_calling_the_models_default_zero_grad_refuses(tmp_path: Path) -> None:
    # `model.zero_grad()` frees by default on torch >= 2.0; the optimizer's own zero_grad() does not
    helpers = _HELPERS + "\n\ndef reset(model, optimizer):\n    optimizer.zero_grad()\n    model.zero_grad()\n"
    root = tmp_path / "repo"
    write_files(root, {"helpers.py": helpers, "train.py": _TRAIN.format(helper="reset(net, optimizer)")})
    cands, near = _optimizer_sites(scan(root, patterns=[FusedOptimizer()]), "train.py")
    assert cands == [] and "`reset` (helpers.py:26) gets `model, optimizer` and frees them with `model.zero_grad()`" \
        in near[0]["reason"], near
    write_files(root, {"helpers.py": helpers.replace("    model.zero_grad()\n", "")})
    cands, near = _optimizer_sites(scan(root, patterns=[FusedOptimizer()]), "train.py")
    assert len(cands) == 1 and near == []
