"""s37 moeopt37 (fused_optimizer class O1): an optimizer object handed, through the repository's own trainers and
helpers, to a wrapper that re-creates its params or frees its grads.

Found as a wrong candidate on blind code: CoLLiE's ``examples/alpaca/train.py`` builds ``torch.optim.Adam(...)`` and
hands it to the repository's ``Trainer(optimizer=...)``, which keeps it as ``self.optimizer`` and passes it to
``setup_ds_engine`` (another file), which calls ``deepspeed.initialize(optimizer=...)``. DeepSpeed's fp16/ZeRO
optimizers step fp32 master copies whose grads they assign every step; without them the engine's zero_grad sets
every grad to None. The site's file names no DeepSpeed. Same family in the non-blind mirrors: FlagAI's
``EnvTrainer.train(model, optimizer=...)`` (``deepspeed.initialize(optimizer=optimizer)`` under ``'deepspeed' in
self.env_type``), OpenRLHF-style strategies (``strategy.prepare((model, optim, sched))`` ->
``_ds_init_train_model(model, optim, ...)`` -> ``deepspeed.initialize``), LLM-Dojo's copy, the two CoLLiE mirrors.

The spellings below were written for this test (none is the CoLLiE code): a trainer storing it under another name and
handing it on from another method through a helper of a third file, a dict config read back by key, a dataclass
config read back by attribute, a ``**kwargs`` bag, a method of an object the script built, a builder in another file
whose caller hands the result on. The Keep spelling differs only in the semantics: the trainer gives DeepSpeed the
model and its own config, never the optimizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from apply_support import scan
from npufuse.patterns.fused_optimizer import _NET, FusedOptimizer
from scratch_repo import write_files

_ENGINES = '''\
import deepspeed as ds


def wrap_engine(model, opt, cfg):
    engine, opt, _, _ = ds.initialize(model=model, optimizer=opt, config=cfg)
    return engine, opt


def launch(model, optim, steps=3):
    engine, optim, _, _ = ds.initialize(model=model, optimizer=optim, config={"fp16": {"enabled": True}})
    for _ in range(steps):
        engine.step()


def start_distributed(model, cfg):
    engine, _, _, _ = ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine
'''

# a trainer storing the optimizer under another name; another method hands it to a helper of a third file
_TRAINER = '''\
from pkg.engines import wrap_engine, start_distributed


class Fitter:
    def __init__(self, net, optim, cfg=None):
        self.net = net
        self._opt = optim
        self.cfg = cfg or {}

    def _setup(self):
        self.engine, self._opt = wrap_engine(self.net, self._opt, self.cfg)

    def fit(self):
        self._setup()


class LightFitter:
    """Gives DeepSpeed the model and its own config; steps the optimizer itself."""

    def __init__(self, net, optim, cfg=None):
        self.net = net
        self._opt = optim
        self.engine = start_distributed(net, cfg or {})

    def fit(self, steps=3):
        for _ in range(steps):
            self._opt.step()
            self._opt.zero_grad(set_to_none=False)
'''

_RUNNERS = '''\
from dataclasses import dataclass
from typing import Any

from deepspeed import initialize


def run_training(cfg):
    engine, _, _, _ = initialize(model=cfg["model"], optimizer=cfg["optim"], config=cfg.get("ds"))
    return engine


@dataclass
class TrainArgs:
    optimizer: Any
    epochs: int = 1


class Runner:
    def __init__(self, model, args):
        self.model = model
        self.args = args

    def go(self):
        return initialize(model=self.model, optimizer=self.args.optimizer, config={})


class Session:
    def __init__(self, model, **options):
        self.model = model
        self.options = options

    def begin(self):
        return initialize(model=self.model, optimizer=self.options["optimizer"])


class Engine:
    def train(self, model, optimizer=None):
        import apex

        return apex.amp.initialize(model, optimizer, opt_level="O2")
'''

_BUILDERS = '''\
import torch


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)
'''

_SCRIPTS = {
    "trainer_other_name_other_method": "from pkg.trainer import Fitter\n\n\ndef main():\n    net = Net()\n"
                                       "    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)\n    Fitter(net, opt).fit()\n",
    "dict_config_read_by_key": "from pkg.runners import run_training\n\n\ndef main():\n    net = Net()\n"
                               "    sgd = torch.optim.SGD(net.parameters(), lr=0.1)\n"
                               "    run_training({\"model\": net, \"optim\": sgd, \"steps\": 3})\n",
    "dataclass_config_read_by_attribute": "from pkg.runners import Runner, TrainArgs\n\n\ndef main():\n    net = Net()\n"
                                          "    adam = torch.optim.Adam(net.parameters(), lr=1e-3)\n"
                                          "    args = TrainArgs(optimizer=adam, epochs=2)\n    Runner(net, args).go()\n",
    "kwargs_bag": "from pkg.runners import Session\n\n\ndef main():\n    net = Net()\n"
                  "    o = torch.optim.AdamW(net.parameters(), lr=1e-3)\n    s = Session(net, optimizer=o)\n    s.begin()\n",
    "method_of_a_built_object": "from pkg.runners import Engine\n\n\ndef main():\n    net = Net()\n"
                                "    o = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)\n    eng = Engine()\n"
                                "    eng.train(net, optimizer=o)\n",
}


def _scan(tmp_path: Path, script: str) -> tuple[list[int], list[str]]:
    root = tmp_path / "repo"
    write_files(root, {"pkg/__init__.py": "", "pkg/engines.py": _ENGINES, "pkg/trainer.py": _TRAINER,
                       "pkg/runners.py": _RUNNERS, "pkg/builders.py": _BUILDERS, "train.py": _NET + script})
    data = scan(root, patterns=[FusedOptimizer()])
    cands = [c["line"] for c in data["candidates"] if c["pattern"] == "fused_optimizer" and c["file"] == "train.py"]
    near = [m["reason"] for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["file"] == "train.py"]
    return cands, near


@pytest.mark.parametrize("name", sorted(_SCRIPTS))
def test_optimizer_handed_through_the_repository_to_a_wrapper_is_refused(tmp_path: Path, name: str) -> None:
    cands, near = _scan(tmp_path, "\n\n" + _SCRIPTS[name])
    assert cands == [], name
    assert len(near) == 1 and "the optimizer is handed on" in near[0], near
    assert "would go stale" in near[0]


def test_the_reason_names_every_hop(tmp_path: Path) -> None:
    _, near = _scan(tmp_path, "\n\n" + _SCRIPTS["trainer_other_name_other_method"])
    text = near[0]
    assert "`Fitter` (train.py:" in text and "defined at pkg/trainer.py:" in text
    assert "`wrap_engine` (pkg/trainer.py:11, defined at pkg/engines.py:4) takes it as `opt`" in text
    assert "deepspeed.initialize (pkg/engines.py:5)" in text


def test_builder_of_another_file_whose_caller_hands_the_result_on(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    write_files(root, {"pkg/__init__.py": "", "pkg/engines.py": _ENGINES, "pkg/builders.py": _BUILDERS,
                       "run.py": "from pkg.builders import make_optimizer\nfrom pkg.engines import launch\nfrom model import Net\n\n\n"
                                 "def main():\n    net = Net()\n    optimizer = make_optimizer(net)\n    launch(net, optimizer)\n",
                       "model.py": _NET})
    data = scan(root, patterns=[FusedOptimizer()])
    assert not [c for c in data["candidates"] if c["pattern"] == "fused_optimizer"]
    near = [m["reason"] for m in data["near_misses"] if m["pattern"] == "fused_optimizer"]
    assert near and "is handed on: `launch` (run.py:9, defined at pkg/engines.py:9)" in near[0], near


def test_keep_trainer_gives_deepspeed_the_model_but_not_the_optimizer(tmp_path: Path) -> None:
    script = ("\n\nfrom pkg.trainer import LightFitter\n\n\ndef main():\n    net = Net()\n"
              "    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)\n    LightFitter(net, opt).fit()\n")
    cands, near = _scan(tmp_path, script)
    assert not any("handed on" in r for r in near), near
    assert len(cands) == 1


# --- the wrapper called by the site's own code under a test the construction can evaluate: a guarded candidate ---
_GUARDED = '''

from apex.fp16_utils import FP16_Optimizer


def train(use_half=False):
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    {between}if use_half:
        opt = FP16_Optimizer(opt, dynamic_loss_scale=True)
    return net, opt


def train_else(precision="fp32"):
    net = Net()
    adam = torch.optim.Adam(net.parameters(), lr=1e-3)
    if precision == "fp32":
        scale = 1.0
    else:
        adam = FP16_Optimizer(adam, static_loss_scale=128.0)
    return net, adam
'''


def test_wrapper_under_a_test_of_the_site_is_a_guarded_candidate(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    write_files(root, {"train.py": _NET + _GUARDED.format(between="")})
    data = scan(root, patterns=[FusedOptimizer()])
    cands = {c["qualname"]: c for c in data["candidates"] if c["pattern"] == "fused_optimizer"}
    assert set(cands) == {"train", "train_else"}, [m["reason"] for m in data["near_misses"]]
    assert "if not (use_half) else None" in cands["train"]["replacement"]
    assert "if (precision == 'fp32') else None" in cands["train_else"]["replacement"]
    assert any("handed on under a condition" in r["detail"] for r in cands["train"]["risks"])
    for c in cands.values():  # the rendered branch parses
        compile("if True:\n" + "\n".join("    " + ln for ln in c["replacement"].splitlines()), "x", "exec")


def test_keep_the_test_rebound_after_the_construction_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    write_files(root, {"train.py": _NET + _GUARDED.format(between="use_half = not use_half\n    ")})
    data = scan(root, patterns=[FusedOptimizer()])
    assert not [c for c in data["candidates"] if c["qualname"] == "train"]
    near = [m["reason"] for m in data["near_misses"] if m["qualname"] == "train"]
    assert near and "apex.fp16_utils.FP16_Optimizer" in near[0] and "when `use_half` is true" in near[0], near
