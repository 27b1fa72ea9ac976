"""s28 (issue 14 class 5), facts from other files of the repo:

* an optimizer class injected through a base class in another file (stable-baselines3's
  ``self.optimizer_class(...)``, default ``th.optim.Adam``) is a candidate whose guard tests the
  class at run time: the default runs the fused class, any other injected class the original call;
* a ``zero_grad()`` on an object that is or holds the model (minGPT's ``model`` of ``raw_model =
  model.module if ... else model``, diamond's ``self.agent`` of ``getattr(self.agent, name)``) frees
  the model's grads: a near miss naming that file and line, as a zero_grad on the model itself;
* a method defined in several files (RWKV-LM's one model.py per version) is reached from the
  trainer beside its own definition."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from apply_support import npufuse, scan
from npufuse import emulate
from npufuse.patterns.fused_optimizer import FusedOptimizer
from scratch_repo import write_files

_BASE = '''\
import torch as th
import torch.nn as nn


class BaseModel(nn.Module):
    def __init__(self, optimizer_class=th.optim.Adam, optimizer_kwargs=None):
        super().__init__()
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = optimizer_kwargs if optimizer_kwargs is not None else {}
'''

_POLICY = '''\
import torch as th
import torch.nn as nn

from pkg.common.policies import BaseModel


class Policy(BaseModel):
    def __init__(self, optimizer_class=th.optim.Adam, optimizer_kwargs=None):
        super().__init__(optimizer_class=optimizer_class, optimizer_kwargs=optimizer_kwargs)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self._build(1e-2)

    def forward(self, x):
        return self.fc2(th.relu(self.fc1(x)))

    def _build(self, lr):
        self.optimizer = self.optimizer_class(
            self.parameters(),
            lr=lr,
            **self.optimizer_kwargs,
        )


def train(steps=3, **kwargs):
    th.manual_seed(0)
    policy = Policy(**kwargs)
    x, y = th.randn(6, 8), th.randn(6, 4)
    for _ in range(steps):
        (policy(x) - y).square().mean().backward()
        policy.optimizer.step()
        policy.optimizer.zero_grad()
    return type(policy.optimizer).__name__, [p.detach().clone() for p in policy.parameters()]
'''


def _run_policy(root: Path, **kwargs: object) -> tuple[str, list[torch.Tensor]]:
    saved = {k: v for k, v in sys.modules.items() if k == "pkg" or k.startswith("pkg.")}
    sys.path.insert(0, str(root))
    try:
        for k in list(saved):
            sys.modules.pop(k)
        ns: dict = {}
        exec(compile((root / "pkg/sac/policies.py").read_text(encoding="utf-8"), str(root / "pkg/sac/policies.py"), "exec"), ns)
        return ns["train"](**kwargs)
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k == "pkg" or k.startswith("pkg.")]:
            sys.modules.pop(k)
        sys.modules.update(saved)


def test_injected_class_through_a_base_in_another_file(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/common/__init__.py": "", "pkg/common/policies.py": _BASE,
             "pkg/sac/__init__.py": "", "pkg/sac/policies.py": _POLICY}
    ref_root = tmp_path / "ref"
    write_files(ref_root, files)
    ref_adam = _run_policy(ref_root)
    ref_rms = _run_policy(ref_root, optimizer_class=torch.optim.RMSprop, optimizer_kwargs={"alpha": 0.9})
    root = tmp_path / "repo"
    write_files(root, files)
    data = scan(root, patterns=[FusedOptimizer()])
    cands = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer"]
    assert [(c["file"], c["line"]) for c in cands] == [("pkg/sac/policies.py", 18)], data["near_misses"]
    assert cands[0]["params"]["class_chosen_at_run_time"] == "self.optimizer_class is th.optim.Adam"
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    with emulate.install() as emu:
        name, outs = _run_policy(root)
    assert sum(emu.calls.values()) >= 1, "the fused branch did not run for the default class"
    assert name == "NpuFusedAdam"
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ref_adam[1], outs))
    # another injected class keeps the original construction (the test is false), same updates
    with emulate.install():
        name, outs = _run_policy(root, optimizer_class=torch.optim.RMSprop, optimizer_kwargs={"alpha": 0.9})
    assert name == "RMSprop"
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ref_rms[1], outs))


def test_injected_class_without_a_torch_optim_binding_is_not_a_site(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    write_files(root, {"pkg/__init__.py": "", "pkg/common/__init__.py": "",
                  "pkg/common/policies.py": _BASE.replace("optimizer_class=th.optim.Adam", "optimizer_class=None"),
                  "pkg/sac/__init__.py": "",
                  "pkg/sac/policies.py": _POLICY.replace("optimizer_class=th.optim.Adam", "optimizer_class=None")})
    data = scan(root, patterns=[FusedOptimizer()])
    assert [c for c in data["candidates"] if c["pattern"] == "fused_optimizer"] == []


_GPT = '''\
import torch
import torch.nn as nn


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)

    def configure_optimizers(self, config):
        return torch.optim.AdamW(self.parameters(), lr=config.lr)
'''

_MINGPT_TRAINER = '''\
import torch


class Trainer:
    def __init__(self, model, config):
        self.model = model
        self.config = config

    def train(self):
        model, config = self.model, self.config
        raw_model = model.module if hasattr(self.model, "module") else model
        optimizer = raw_model.configure_optimizers(config)
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
            model.zero_grad({flag})
'''


def test_zero_grad_on_what_holds_the_model_in_another_file(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    # two versions of the repo each define GPT.configure_optimizers: the trainer beside v1's model reaches v1's
    write_files(root, {"v1/src/model.py": _GPT, "v1/src/trainer.py": _MINGPT_TRAINER.format(flag=""),
                  "v2/src/model.py": _GPT, "v2/src/trainer.py": _MINGPT_TRAINER.format(flag="set_to_none=False")})
    data = scan(root, patterns=[FusedOptimizer()])
    near = [m for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["file"] == "v1/src/model.py"]
    assert len(near) == 1 and "`model.zero_grad()` at v1/src/trainer.py:16" in near[0]["reason"], data["near_misses"]
    assert "is or holds the model" in near[0]["reason"]
    # v2's trainer zeroes in place: its model's optimizer stays a candidate
    assert [c["file"] for c in data["candidates"] if c["pattern"] == "fused_optimizer"] == ["v2/src/model.py"]


_CONFIGURE = '''\
import torch


def configure_opt(model, lr):
    return torch.optim.AdamW(model.parameters(), lr=lr)
'''

_AGENT_TRAINER = '''\
import torch
import torch.nn as nn

from utils import configure_opt


class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.actor = nn.Linear(8, 4)
        self.critic = nn.Linear(8, 1)


class Trainer:
    def __init__(self):
        self.agent = Agent()
        self.opt = {{name: configure_opt(getattr(self.agent, name), 1e-3) for name in ("actor", "critic")}}

    def step(self, x):
        self.agent.zero_grad({flag})
        self.agent.actor(x).sum().backward()
        self.opt["actor"].step()
'''


def test_zero_grad_on_the_object_getattr_reads_the_model_from(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    write_files(root, {"utils.py": _CONFIGURE, "trainer.py": _AGENT_TRAINER.format(flag="")})
    data = scan(root, patterns=[FusedOptimizer()])
    near = [m for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["file"] == "utils.py"]
    assert len(near) == 1 and "`self.agent.zero_grad()` at trainer.py:20" in near[0]["reason"], data["near_misses"]
    # zeroing in place there: the candidate stays
    write_files(root, {"trainer.py": _AGENT_TRAINER.format(flag="set_to_none=False")})
    data = scan(root, patterns=[FusedOptimizer()])
    assert [c["file"] for c in data["candidates"] if c["pattern"] == "fused_optimizer"] == ["utils.py"]
