"""s38 opt38 (fused_optimizer): fix37's random-skip refusal narrowed by mechanism.

fix37 refuses an optimizer whose model may skip a trainable submodule on steps drawn at random (its params then
have no grad there; the fused class excludes them from its flat buffers at the first step for good and later
zeroes them in place). Three facts say such a skip cannot leave a trainable parameter without a grad:

* the draw is compared only with a rate the repository leaves 0 (an ``__init__`` default of 0 and no caller,
  config, or command-line default giving another value): wenet's Branchformer attention-branch drop
  (``torch.rand(1).item() < self.attn_branch_drop_rate``, default 0.0, its config 0.0) cost a port label;
* the skipped submodule is frozen (the class freezes it or calls it only under ``torch.no_grad()``, or the
  site's code freezes the object it hands the model: Moore-AnimateAnyone's stage 2,
  ``reference_unet.requires_grad_(False)`` then ``Net(reference_unet, ...)``: audited correct, refused by fix37);
* the training code states DDP ``find_unused_parameters=False``: DDP then fails the step after one where a
  trainable parameter got no grad.

Keeps: a rate a config sets to 0.1, a rate a caller sets, an object unfrozen after the freeze
(``named_parameters()`` loop with ``requires_grad_(True)``), a freeze under a condition,
``find_unused_parameters=True``. The spellings are written for this test."""

from __future__ import annotations

from pathlib import Path

from apply_support import scan
from npufuse.patterns.fused_optimizer import FusedOptimizer
from scratch_repo import write_files

# -- rates: a branch dropped when a draw falls under a rate the model takes from its constructor or a config

_LAYER = '''\
import torch
import torch.nn as nn


class MixLayer(nn.Module):
    def __init__(self, dim=8, branch_drop=0.0):
        super().__init__()
        self.branch_drop = branch_drop
        self.gate = nn.Linear(dim, 1)
        self.body = nn.Linear(dim, dim)

    def forward(self, x):
        if self.training and self.branch_drop > 0 and torch.rand(1).item() < self.branch_drop:
            w = torch.tensor(0.0)
        else:
            w = torch.sigmoid(self.gate(x))
        return x + w * self.body(x)


class Stack(nn.Module):
    def __init__(self, n=2, dim=8, branch_drop=0.0):
        super().__init__()
        self.layers = nn.ModuleList([MixLayer(dim, branch_drop) for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
'''

_REGISTRY = '''\
from nets.mix import Stack

MODELS = {"stack": Stack}


def build(name, conf):
    return MODELS[name](**conf)
'''

_TRAINER = '''\
import torch
import yaml
from nets import registry


def main(path):
    conf = yaml.safe_load(open(path))
    model = registry.build(conf["model"], conf["model_conf"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optimizer
'''


def _optim(data: dict, file: str) -> tuple[list[dict], list[str]]:
    cands = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer" and c["file"] == file]
    near = [m["reason"] for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["file"] == file]
    return cands, near


def _rate_repo(root: Path, conf: str, layer: str = _LAYER, trainer: str = _TRAINER) -> tuple[list[dict], list[str]]:
    write_files(root, {"nets/__init__.py": "", "nets/mix.py": layer, "nets/registry.py": _REGISTRY, "train.py": trainer,
                       "conf/train.yaml": f"model: stack\nmodel_conf:\n  n: 2\n{conf}"})
    return _optim(scan(root, patterns=[FusedOptimizer()]), "train.py")


def test_a_drop_rate_every_config_leaves_at_zero_is_not_a_random_skip(tmp_path: Path) -> None:
    cands, near = _rate_repo(tmp_path, "  branch_drop: 0.0   # only with a learned merge\n")
    assert len(cands) == 1 and not near, near


def test_keep_a_drop_rate_a_config_sets_refuses(tmp_path: Path) -> None:
    cands, near = _rate_repo(tmp_path, "  branch_drop: 0.1\n")
    assert not cands and len(near) == 1, near
    assert "`MixLayer` (nets/mix.py:13) skips the call of `self.gate`" in near[0]


def test_keep_a_drop_rate_a_caller_or_a_default_sets_refuses(tmp_path: Path) -> None:
    by_caller = _LAYER.replace("MixLayer(dim, branch_drop)", "MixLayer(dim, branch_drop=0.2)")
    cands, near = _rate_repo(tmp_path / "caller", "", by_caller)
    assert not cands and near, "a caller's 0.2"
    by_position = _LAYER.replace("MixLayer(dim, branch_drop)", "MixLayer(dim, 0.2)")
    cands, near = _rate_repo(tmp_path / "position", "", by_position)
    assert not cands and near, "a caller's 0.2 by position"
    or_default = _LAYER.replace("MixLayer(dim, branch_drop)", "MixLayer(dim, branch_drop or 0.2)")
    cands, near = _rate_repo(tmp_path / "or", "", or_default)
    assert not cands and near, "a value computed from the rate"
    by_default = _LAYER.replace("def __init__(self, dim=8, branch_drop=0.0)", "def __init__(self, dim=8, branch_drop=0.05)")
    cands, near = _rate_repo(tmp_path / "default", "", by_default)
    assert not cands and near, "a default of 0.05"
    by_cli = _TRAINER.replace("def main(path):", "def main(path):\n    import argparse\n    p = argparse.ArgumentParser()\n"
                              "    p.add_argument('--branch-drop', type=float, default=0.3)\n")
    cands, near = _rate_repo(tmp_path / "cli", "", trainer=by_cli)
    assert not cands and near, "a command-line default of 0.3"
    write_files(tmp_path / "script", {"scripts/run.sh": "python train.py conf/train.yaml --branch-drop 0.2\n"})
    cands, near = _rate_repo(tmp_path / "script", "")
    assert not cands and near, "a run script's 0.2"


def test_a_layer_drop_rate_read_from_a_config_object_defaulting_to_zero(tmp_path: Path) -> None:
    # HF-style: `self.layerdrop = config.layerdrop`, the config class's default 0.0, no config file setting it
    layer = '''\
import torch
import torch.nn as nn


class DecoderConfig:
    def __init__(self, dim=8, n=2, layerdrop=0.0):
        self.dim, self.n, self.layerdrop = dim, n, layerdrop


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layerdrop = config.layerdrop
        self.layers = nn.ModuleList([nn.Linear(config.dim, config.dim) for _ in range(config.n)])

    def forward(self, x):
        for layer in self.layers:
            p = torch.rand([])
            if self.training and p < self.layerdrop:
                continue
            x = layer(x)
        return x


class Stack(Decoder):
    pass
'''
    cands, near = _rate_repo(tmp_path, "", layer.replace("class Stack(Decoder):\n    pass\n", "") +
                             "\n\ndef Stack(**conf):\n    return Decoder(DecoderConfig(**conf))\n")
    assert len(cands) == 1 and not near, near
    cands, near = _rate_repo(tmp_path / "set", "  layerdrop: 0.1\n", layer.replace("class Stack(Decoder):\n    pass\n", "") +
                             "\n\ndef Stack(**conf):\n    return Decoder(DecoderConfig(**conf))\n")
    assert not cands and near and "`Decoder`" in near[0], near


# -- frozen submodules: the unconditional forward skips a reference network the training code freezes

_NET = '''\
import random
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, ref, head):
        super().__init__()
        self.ref = ref
        self.head = head

    def forward(self, x, skip_ref=False):
        feats = x
        if not skip_ref:
            feats = feats + self.ref(x)
        return self.head(feats)


def main(steps=2):
    ref = nn.Linear(8, 8)
    head = nn.Linear(8, 4)
{freeze}
    net = Net(ref, head)
    trainable = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
{ddp}
    for _ in range(steps):
        uncond = random.random() < 0.1
        net(torch.randn(2, 8), uncond).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
'''


def _net(root: Path, freeze: str = "", ddp: str = "") -> tuple[list[dict], list[str]]:
    write_files(root, {"train.py": _NET.format(freeze=freeze, ddp=ddp)})
    return _optim(scan(root, patterns=[FusedOptimizer()]), "train.py")


def test_keep_a_trainable_submodule_skipped_on_drawn_steps_refuses(tmp_path: Path) -> None:
    cands, near = _net(tmp_path)
    assert not cands and near and "skips the call of `self.ref`" in near[0], near


def test_a_submodule_the_site_freezes_before_handing_it_to_the_model(tmp_path: Path) -> None:
    for freeze in ("    ref.requires_grad_(False)", "    for p in ref.parameters():\n        p.requires_grad = False"):
        cands, near = _net(tmp_path / str(len(freeze)), freeze)
        assert len(cands) == 1 and not near, (freeze, near)


def test_keep_a_freeze_undone_or_under_a_condition_refuses(tmp_path: Path) -> None:
    undone = "    ref.requires_grad_(False)\n    for n, p in ref.named_parameters():\n        p.requires_grad_('bias' in n)"
    cands, near = _net(tmp_path / "undone", undone)
    assert not cands and near, "partly unfrozen"
    conditional = "    if steps > 1:\n        ref.requires_grad_(False)"
    cands, near = _net(tmp_path / "cond", conditional)
    assert not cands and near, "frozen only on some runs"


def test_a_submodule_the_class_freezes_or_runs_without_grad(tmp_path: Path) -> None:
    frozen = _NET.replace("        self.head = head\n", "        self.head = head\n        self.ref.requires_grad_(False)\n")
    no_grad = _NET.replace("            feats = feats + self.ref(x)", "            with torch.no_grad():\n"
                                                                          "                feats = feats + self.ref(x)")
    for name, text in (("frozen", frozen), ("no_grad", no_grad)):
        write_files(tmp_path / name, {"train.py": text.format(freeze="", ddp="")})
        cands, near = _optim(scan(tmp_path / name, patterns=[FusedOptimizer()]), "train.py")
        assert len(cands) == 1 and not near, (name, near)


def test_ddp_told_every_parameter_is_used(tmp_path: Path) -> None:
    ddp = "    net = torch.nn.parallel.DistributedDataParallel(net, find_unused_parameters={flag})"
    cands, near = _net(tmp_path / "false", ddp=ddp.format(flag="False"))
    assert len(cands) == 1 and not near, near
    # near miss: DDP told some parameters may be unused
    cands, near = _net(tmp_path / "true", ddp=ddp.format(flag="True"))
    assert not cands and near, near


# -- registries: a registry package's __init__ imports every model family; the configs name the one trained

_FAMILY_OPT = '''\
import torch
import torch.nn as nn
from lm.registry import register_model


class DropDecoder(nn.Module):
    def __init__(self, dim=8, n=2, layerdrop=0.1):
        super().__init__()
        self.layerdrop = layerdrop
        self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(n)])

    def forward(self, x):
        for blk in self.blocks:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            x = blk(x)
        return x


@register_model("dropper")
class DropperLM(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.decoder = DropDecoder(dim)

    def forward(self, x):
        return self.decoder(x)
'''

_FAMILY_PLAIN = '''\
import torch.nn as nn
from lm.registry import register_model


@register_model("plain")
class PlainLM(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(x)
'''

_LM_REGISTRY = '''\
MODELS = {}


def register_model(name):
    def wrap(cls):
        MODELS[name] = cls
        return cls
    return wrap
'''

_LM_TRAIN = '''\
import torch
import yaml
import lm
from lm.registry import MODELS


def main(path):
    cfg = yaml.safe_load(open(path))
    model = MODELS[cfg["arch"]](cfg["dim"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer
'''


def _registry_repo(root: Path, arch: str, train: str = _LM_TRAIN) -> tuple[list[dict], list[str]]:
    write_files(root, {"lm/__init__.py": "from lm.dropper import DropperLM\nfrom lm.plain import PlainLM\n",
                       "lm/registry.py": _LM_REGISTRY, "lm/dropper.py": _FAMILY_OPT, "lm/plain.py": _FAMILY_PLAIN,
                       "train.py": train, "configs/train.yaml": f"arch: {arch}\ndim: 8\n"})
    return _optim(scan(root, patterns=[FusedOptimizer()]), "train.py")


def test_a_skip_class_only_a_registry_entry_no_config_names_builds_is_not_the_trained_model(tmp_path: Path) -> None:
    cands, near = _registry_repo(tmp_path, "plain")
    assert len(cands) == 1 and not near, near


def test_keep_the_registry_entry_a_config_names_refuses(tmp_path: Path) -> None:
    cands, near = _registry_repo(tmp_path, "dropper")
    assert not cands and near and "`DropDecoder`" in near[0] and "not told apart" in near[0], near


def test_keep_the_registry_entry_a_run_script_names_refuses(tmp_path: Path) -> None:
    write_files(tmp_path, {"scripts/train_dropper.sh": "python train.py --arch dropper\n"})
    cands, near = _registry_repo(tmp_path, "plain")
    assert not cands and near, near


def test_keep_a_skip_class_the_code_also_builds_outside_the_registry_refuses(tmp_path: Path) -> None:
    # the trainer's code also builds the family directly (not by name): the registry does not decide
    direct = _LM_TRAIN.replace("    return model, optimizer", "    teacher = lm.DropperLM(8)\n    return model, optimizer, teacher")
    cands, near = _registry_repo(tmp_path, "plain", direct)
    assert not cands and near, near
