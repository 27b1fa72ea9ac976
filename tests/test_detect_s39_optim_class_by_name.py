"""s39 opt39 (fused_optimizer): an optimizer class resolved by name from a configuration string.

HO15a's LLaMA-pretrain: ``opt_class = load_class(opt_conf.name)`` where ``load_class`` splits a dotted path and
returns ``getattr(importlib.import_module(module), name)``; the dataclass default is ``"torch.optim.AdamW"``. The
classes such a loader may yield are the dotted optimizer paths the repository spells (the file's strings and its
configuration files): all of them fusable torch.optim classes -> a candidate whose guard checks the loaded class (any
other class runs the original call); another class spelt (bitsandbytes' 8-bit AdamW) or none -> a near miss naming it.
A dict of several torch.optim classes looked up and called at once takes the same class guard. The loader's other
uses (a scheduler whose first argument is the optimizer) are no optimizer. The spellings are written for this test."""

from __future__ import annotations

from pathlib import Path

from apply_support import scan
from npufuse.patterns.fused_optimizer import FusedOptimizer
from pattern_harness import check_rewrite_runs, detect_all
from scratch_repo import write_files

_LOADER = '''\
import importlib

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


def import_by_path(path: str):
    """The class a dotted path names."""
    module_name, class_name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), class_name)


class OptimSettings:
    target = "{path}"
    kwargs = {{"lr": 1e-3, "weight_decay": 0.01}}


class Runner:
    def __init__(self, model, settings=OptimSettings()):
        self.model = model
        optim_class = import_by_path(settings.target)
        self.optim = optim_class(self.model.parameters(), **settings.kwargs)
        sched_class = import_by_path("torch.optim.lr_scheduler.StepLR")
        self.sched = sched_class(self.optim, step_size=10)

    def step(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        self.optim.step()
        self.optim.zero_grad()
'''

_RUN = '''\
runner = Runner(Net())
x, y = torch.randn(6, 8), torch.randn(6, 4)
for _ in range(3):
    runner.step(x, y)
out = tuple(p.detach().clone() for p in runner.model.parameters())
'''


def _optim(data: dict, file: str) -> tuple[list[dict], list[str]]:
    cands = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer" and c["file"] == file]
    near = [m["reason"] for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["file"] == file]
    return cands, near


def test_a_class_a_path_loader_yields_is_a_guarded_candidate() -> None:
    code = _LOADER.format(path="torch.optim.AdamW")
    findings, near = detect_all(FusedOptimizer(), code)
    assert len(findings) == 1 and not near, near  # the scheduler the loader also builds is no optimizer
    f = findings[0]
    assert f.params["class_looked_up"] == "optim_class" and "in ('AdamW',))(optim_class)" in (f.guard_tensor or "")
    assert "getattr(torch_npu.optim, 'NpuFused' + optim_class.__name__)" in f.fused
    facts = check_rewrite_runs(FusedOptimizer(), code, _RUN, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.99999


def test_keep_a_path_to_a_class_without_a_fused_counterpart(tmp_path: Path) -> None:
    # the file's default is fusable, a config names bitsandbytes' 8-bit AdamW: which one runs is the config's
    write_files(tmp_path, {"train.py": _LOADER.format(path="torch.optim.AdamW"),
                           "conf/big.yaml": "optim:\n  target: bitsandbytes.optim.AdamW8bit\n  lr: 1e-4\n"})
    cands, near = _optim(scan(tmp_path, patterns=[FusedOptimizer()]), "train.py")
    assert not cands and len(near) == 1, near
    assert "loaded from a dotted path at run time (`import_by_path(settings.target)`)" in near[0]
    assert "`bitsandbytes.optim.AdamW8bit`, which torch_npu.optim has no fused counterpart of" in near[0]


def test_keep_a_path_nothing_spells() -> None:
    code = _LOADER.format(path="{}").replace('target = "{}"', "target = None")
    findings, near = detect_all(FusedOptimizer(), code)
    assert not findings and any("no file or configuration of the repository spells the path" in m.reason for m in near), near


def test_keep_a_loader_that_does_more_than_load() -> None:
    # a loader that logs is not proved a pure lookup: the guard would run it a second time
    code = _LOADER.format(path="torch.optim.AdamW").replace('    module_name, class_name = path.rsplit(".", 1)\n',
                                                           '    print("loading", path)\n    module_name, class_name = path.rsplit(".", 1)\n')
    findings, _near = detect_all(FusedOptimizer(), code)
    assert not findings
