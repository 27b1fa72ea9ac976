"""Issue 14 class 5: grads freed by a zero_grad in ANOTHER file of the repo (a trainer calling
``optimizer.zero_grad(set_to_none=True)``, ``model.zero_grad()``, accelerate's prepare) refuse the
fused optimizer built elsewhere by default, with a reason naming that file and line and the option;
with ``--optimizer-zero-grad-in-place`` the fused branch binds that zero_grad to one that zeroes in
place (npufuse.scan.repo_facts), with the risk stated; the rewritten repo runs under the emulator,
whose fused class raises ValueError on set_to_none=True as torch_npu's does."""

from __future__ import annotations

from pathlib import Path

import torch

from apply_support import npufuse, scan
from npufuse import emulate
from npufuse.patterns.fused_optimizer import FusedOptimizer
from scratch_repo import run_train, write_files

_MODEL = '''\
import torch
import torch.nn as nn


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

    def configure_optimizers(self, weight_decay, learning_rate):
        groups = [{"params": [self.fc1.weight, self.fc2.weight], "weight_decay": weight_decay},
                  {"params": [self.fc1.bias, self.fc2.bias], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))


def build_sgd(model, lr):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return optimizer
'''

_TRAIN = '''\
import torch
from model import GPT, build_sgd


def train(steps=3):
    torch.manual_seed(0)
    model = GPT()
    optimizer = {build}
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        {zero}
    return [p.detach().clone() for p in model.parameters()]
'''


_OPT_IN = "`npufuse scan --optimizer-zero-grad-in-place` makes this a candidate whose fused branch rebinds that zero_grad"


def _scan_apply_run(tmp_path: Path, build: str, zero: str, qualname: str, explicit: bool = True) -> tuple[dict, str]:
    train = _TRAIN.format(build=build, zero=zero)
    ref = _run_files(tmp_path / "ref", train)
    root = tmp_path / "repo"
    write_files(root, {"model.py": _MODEL, "train.py": train})
    # by default the trainer's choice to free grads is kept: a near miss naming train.py's line and the option
    # (a zero_grad that frees by default, `model.zero_grad()`, is zeroed in place without the option too)
    data = scan(root, patterns=[FusedOptimizer()])
    near = [m for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["qualname"] == qualname]
    if explicit:
        assert not [c for c in data["candidates"] if c["qualname"] == qualname]
        assert len(near) == 1 and "train.py:12" in near[0]["reason"] and _OPT_IN in near[0]["reason"], near
        data = scan(root, patterns=[FusedOptimizer()], optimizer_zero_grad_in_place=True)
    else:
        assert near == []
    cands = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer" and c["qualname"] == qualname]
    assert len(cands) == 1 and cands[0]["file"] == "model.py", data["near_misses"]
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    with emulate.install() as emu:
        outs = run_train(root, "model")
    assert sum(emu.calls.values()) >= 1, "the fused branch did not run"
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ref, outs))
    return cands[0], (root / "model.py").read_text(encoding="utf-8")


def _run_files(root: Path, train: str) -> list[torch.Tensor]:
    write_files(root, {"model.py": _MODEL, "train.py": train})
    return run_train(root, "model")


def test_optimizer_set_to_none_elsewhere_returned_construction(tmp_path: Path) -> None:
    cand, rewritten = _scan_apply_run(tmp_path, "model.configure_optimizers(0.1, 1e-2)", "optimizer.zero_grad(set_to_none=True)",
                                      "GPT.configure_optimizers")
    # `return AdamW(...)` is bound to a name first, so its zero_grad can be replaced before it is returned
    assert "_npufuse_optimizer = torch_npu.optim.NpuFusedAdamW(groups" in rewritten
    assert "_npufuse_optimizer.zero_grad = (lambda zero_grad: lambda set_to_none=None" in rewritten
    assert "return _npufuse_optimizer" in rewritten
    assert any("train.py:12" in r["detail"] and "zeroes those grads in place" in r["detail"] for r in cand["risks"])


def test_model_zero_grad_elsewhere_binds_the_builders_parameter(tmp_path: Path) -> None:
    cand, rewritten = _scan_apply_run(tmp_path, "build_sgd(model, 1e-2)", "model.zero_grad()", "build_sgd", explicit=False)
    assert "model.zero_grad = (lambda zero_grad: lambda set_to_none=None: zero_grad(set_to_none=False))(model.zero_grad)" in rewritten
    assert any("`model.zero_grad()` at train.py:12" in r["detail"] for r in cand["risks"])


def test_share_memory_elsewhere_still_refuses(tmp_path: Path) -> None:
    train = _TRAIN.format(build="build_sgd(model, 1e-2)", zero="optimizer.zero_grad(set_to_none=True)").replace(
        "    model = GPT()\n", "    model = GPT()\n    model.share_memory()\n")
    root = tmp_path / "repo"
    write_files(root, {"model.py": _MODEL, "train.py": train})
    data = scan(root, patterns=[FusedOptimizer()])
    # build_sgd: the set_to_none is fixable, the hogwild sharing is not; configure_optimizers is not used
    assert [c["qualname"] for c in data["candidates"]] == ["GPT.configure_optimizers"]
    near = [m for m in data["near_misses"] if m["qualname"] == "build_sgd"]
    assert len(near) == 1 and "share_memory()" in near[0]["reason"]


_BUCKET = '''\
import torch.nn as nn


class BucketDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        self.data = None  # an attribute of the wrapper, not a parameter's storage

    def forward(self, x):
        return self.module(x)

    def finish(self):
        for p in self.module.parameters():
            p.grad = p.main_grad.to(p.dtype)
'''

_TRAIN_WRAPPED = '''\
import torch
from parallel.bucket import BucketDP
from model import GPT

model = GPT()
if torch.cuda.device_count() > 1:
    model = BucketDP(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
'''


def test_a_repo_class_reassigning_grads_wraps_the_model(tmp_path: Path) -> None:
    # the wrapper's code is in another file: repo_symbols resolves `BucketDP` to parallel/bucket.py
    root = tmp_path / "repo"
    write_files(root, {"model.py": _MODEL, "train.py": _TRAIN_WRAPPED})
    (root / "parallel").mkdir()
    (root / "parallel" / "__init__.py").write_text("")
    (root / "parallel" / "bucket.py").write_text(_BUCKET)
    data = scan(root, patterns=[FusedOptimizer()])
    near = [m for m in data["near_misses"] if m["file"] == "train.py"]
    assert [c["file"] for c in data["candidates"] if c["file"] == "train.py"] == []
    assert len(near) == 1 and "class BucketDP, parallel/bucket.py:4" in near[0]["reason"]
    assert "assigns new grads" in near[0]["reason"] and "parallel/bucket.py:15" in near[0]["reason"]
    # a wrapper that only keeps its own attributes re-allocates nothing: the candidate stays
    (root / "parallel" / "bucket.py").write_text(_BUCKET.replace("            p.grad = p.main_grad.to(p.dtype)\n", "            p.grad.zero_()\n"))
    data = scan(root, patterns=[FusedOptimizer()])
    assert [c["line"] for c in data["candidates"] if c["file"] == "train.py"] == [8]


_TRAINER_NO_IMPORT = '''\
import torch


class Trainer:
    def __init__(self, model, config):
        self.model = model

    def run(self, steps=3):
        model = self.model
        self.optimizer = model.configure_optimizers(0.1, 1e-2)
        for _ in range(steps):
            model(torch.randn(4, 8)).square().mean().backward()
            self.optimizer.step()
            model.zero_grad(set_to_none=True)
'''


def test_a_method_defined_once_in_the_repo_is_linked_without_an_import(tmp_path: Path) -> None:
    # minGPT: the trainer never imports the model's module; `configure_optimizers` is defined only
    # in model.py, so `model.configure_optimizers(...)` is that method and the trainer's
    # `model.zero_grad(set_to_none=True)` concerns its parameters
    root = tmp_path / "repo"
    write_files(root, {"model.py": _MODEL, "trainer.py": _TRAINER_NO_IMPORT})
    data = scan(root, patterns=[FusedOptimizer()])
    near = next(m for m in data["near_misses"] if m["qualname"] == "GPT.configure_optimizers")
    assert "`model.zero_grad(set_to_none=...)` at trainer.py:14" in near["reason"] and _OPT_IN in near["reason"]
    data = scan(root, patterns=[FusedOptimizer()], optimizer_zero_grad_in_place=True)
    cand = next(c for c in data["candidates"] if c["qualname"] == "GPT.configure_optimizers")
    assert any("trainer.py:14" in r["detail"] and "zeroes those grads in place" in r["detail"] for r in cand["risks"])
    assert "self.zero_grad = (lambda zero_grad:" in cand["replacement"]
    # a second definition of that name elsewhere: no link (which class the trainer's object is, is unknown)
    (root / "other.py").write_text("class Lit:\n    def configure_optimizers(self, a, b):\n        return None\n")
    data = scan(root, patterns=[FusedOptimizer()], optimizer_zero_grad_in_place=True)
    cand = next(c for c in data["candidates"] if c["qualname"] == "GPT.configure_optimizers")
    assert not any("trainer.py" in r["detail"] for r in cand["risks"]) and "self.zero_grad" not in cand["replacement"]


def test_model_set_to_none_elsewhere_binds_self_of_the_builder_method(tmp_path: Path) -> None:
    cand, rewritten = _scan_apply_run(tmp_path, "model.configure_optimizers(0.1, 1e-2)", "model.zero_grad(set_to_none=True)",
                                      "GPT.configure_optimizers")
    assert "self.zero_grad = (lambda zero_grad: lambda set_to_none=None: zero_grad(set_to_none=False))(self.zero_grad)" in rewritten


def test_warm_scan_from_the_cache_gives_the_same_zeroed_replacement(tmp_path: Path) -> None:
    # per-file results come from the cache on the second scan; the cross-file fix is applied again
    # to them (never stored in a file's cache entry), and renders the same text
    from npufuse.scan.engine import scan_repo

    root = tmp_path / "repo"
    write_files(root, {"model.py": _MODEL, "train.py": _TRAIN.format(build="model.configure_optimizers(0.1, 1e-2)",
                                                                 zero="optimizer.zero_grad(set_to_none=True)")})
    cache = tmp_path / "cache"
    cold = scan_repo(root, patterns=[FusedOptimizer()], jobs=1, cache_dir=cache, optimizer_zero_grad_in_place=True)
    warm = scan_repo(root, patterns=[FusedOptimizer()], jobs=1, cache_dir=cache, optimizer_zero_grad_in_place=True)
    assert warm.stats["from_cache"] == 2
    pick = lambda r: [(c["qualname"], c["replacement"], [x["detail"] for x in c["risks"]]) for c in r.candidates]
    assert pick(cold) == pick(warm)
    assert any("_npufuse_optimizer.zero_grad" in rep for _q, rep, _r in pick(warm))
    # the same cache without the option: its own entries (the option is part of the key), a near miss
    default = scan_repo(root, patterns=[FusedOptimizer()], jobs=1, cache_dir=cache)
    assert default.stats["from_cache"] == 0
    assert not any("_npufuse_optimizer" in rep for _q, rep, _r in pick(default))
    assert any(m["qualname"] == "GPT.configure_optimizers" and _OPT_IN in m["reason"] for m in default.near_misses)
    # the train.py change is seen by the next scan: set_to_none=False needs no fix
    (root / "train.py").write_text((root / "train.py").read_text().replace("set_to_none=True", "set_to_none=False"))
    again = scan_repo(root, patterns=[FusedOptimizer()], jobs=1, cache_dir=cache, optimizer_zero_grad_in_place=True)
    assert not any("_npufuse_optimizer" in rep for _q, rep, _r in pick(again))
