"""s39 opt39 (fused_optimizer): a model that calls a trainable submodule only when a test on the step's data holds.

An MoE layer that runs an expert only for the tokens routed to it and skips it when none are (``if mask.any():``,
``if len(idx) == 0: continue``, a loop over the expert ids present in the batch) leaves that expert without a grad
on such a step. torch.optim, whose ``zero_grad`` sets grads to None by default, skips the expert then; the fused
classes zero grads in place (spec section 10) and still apply momentum / weight decay / Adam moments to it (and
exclude for good a param without a grad at the first step). HO15b's diff-MoE (``train.py:44``) was the judge's case.
The refusal shares fix37's random-skip mechanism (the model's classes when told, else those the trainer reaches;
freezes, DDP ``find_unused_parameters=False``, registries).

Fuse (near misses of the class): an expert run on an empty selection without a test (its grad is a zero tensor in
both optimizers), a test on a configuration attribute (``if self.use_aux:``, fixed per run), a shape test against a
constructor width. The spellings are written for this test."""

from __future__ import annotations

from pathlib import Path

from apply_support import scan
from npufuse.patterns.fused_optimizer import FusedOptimizer
from scratch_repo import write_files

_MOE = '''\
import torch
import torch.nn as nn


class Router(nn.Module):
    def __init__(self, dim=8, n_experts=4, top=2):
        super().__init__()
        self.top = top
        self.gate = nn.Linear(dim, n_experts)
        self.experts = nn.ModuleList([nn.Linear(dim, dim) for _ in range(n_experts)])

    def forward(self, x):
        scores = self.gate(x).softmax(-1)
        weight, chosen = scores.topk(self.top, dim=-1)
        out = torch.zeros_like(x)
{body}
        return out


class Net(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.moe = Router(dim)

    def forward(self, x):
        return self.moe(self.inp(x))
'''

_GUARDED = '''\
        for e in range(len(self.experts)):
            rows, slot = torch.where(chosen == e)
            if rows.numel() > 0:
                out[rows] += weight[rows, slot, None] * self.experts[e](x[rows])'''

_CONTINUE = '''\
        for e, expert in enumerate(self.experts):
            hit = (chosen == e).any(-1)
            if not hit.any():
                continue
            out[hit] += expert(x[hit])'''

_SELECTED = '''\
        for e in chosen.unique().tolist():
            rows, slot = torch.where(chosen == e)
            out[rows] += weight[rows, slot, None] * self.experts[e](x[rows])'''

_UNGUARDED = '''\
        for e in range(len(self.experts)):
            rows, slot = torch.where(chosen == e)
            out[rows] += weight[rows, slot, None] * self.experts[e](x[rows])'''

_CONFIG_TEST = '''\
        for e in range(len(self.experts)):
            rows, slot = torch.where(chosen == e)
            if self.top > 1:
                out[rows] += weight[rows, slot, None] * self.experts[e](x[rows])
            else:
                out[rows] += self.experts[e](x[rows])'''

_SHAPE_TEST = '''\
        if x.shape[-1] == 8:
            out = out + self.experts[0](x)'''

# a list the model's configuration fixes: its length is the same every step (DeepCTR's `len(sparse_embedding_list)`)
_CONFIG_LENGTH = '''\
        parts = [x[..., : self.top], x[..., self.top:]]
        if len(parts) > 1:
            out = out + self.experts[0](x)'''

_SAME_FILE = '''

def main(steps=3):
    model = Net().to("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(steps):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
'''

# the optimizer built over a model handed in: the trainer's driver builds it from the model file
_TRAIN = '''\
import torch


def train(model, loader, optimizer=None, lr=1e-3):
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for x in loader:
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model
'''

_MAIN = '''\
import torch
from model import Net
from train import train

if __name__ == "__main__":
    train(Net(), [torch.randn(16, 8) for _ in range(3)])
'''


def _optim(data: dict, file: str) -> tuple[list[dict], list[str]]:
    cands = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer" and c["file"] == file]
    near = [m["reason"] for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["file"] == file]
    return cands, near


def _same_file(root: Path, body: str) -> tuple[list[dict], list[str]]:
    write_files(root, {"net.py": _MOE.format(body=body) + _SAME_FILE})
    return _optim(scan(root, patterns=[FusedOptimizer()]), "net.py")


def test_keep_an_expert_called_only_when_tokens_reach_it(tmp_path: Path) -> None:
    for name, body, test in (("guarded", _GUARDED, "rows.numel() > 0"), ("continue", _CONTINUE, "not hit.any()"),
                             ("selected", _SELECTED, "for e in chosen.unique().tolist()")):
        cands, near = _same_file(tmp_path / name, body)
        assert not cands and len(near) == 1, (name, near)
        assert "the model the optimizer takes calls a trainable submodule only when a test on the step's data holds" in near[0]
        assert f"`self.experts` depending on the step's data (`{test}`)" in near[0], (name, near)
        assert "set_to_none=True" in near[0] and "zero grads in place" in near[0]


def test_an_expert_run_on_an_empty_selection_or_a_run_fixed_test_is_fused(tmp_path: Path) -> None:
    # an empty selection still gives the expert a (zero) grad in both optimizers; `self.top`, a width and the length
    # of a list the code builds are fixed
    for name, body in (("unguarded", _UNGUARDED), ("config", _CONFIG_TEST), ("shape", _SHAPE_TEST), ("length", _CONFIG_LENGTH)):
        cands, near = _same_file(tmp_path / name, body)
        assert len(cands) == 1 and not near, (name, near)


def test_keep_a_model_handed_in_whose_driver_builds_a_data_dependent_model(tmp_path: Path) -> None:
    write_files(tmp_path, {"model.py": _MOE.format(body=_GUARDED), "train.py": _TRAIN, "main.py": _MAIN})
    cands, near = _optim(scan(tmp_path, patterns=[FusedOptimizer()]), "train.py")
    assert not cands and len(near) == 1, near
    assert "a model class the trainer's code reaches (its model is not told apart)" in near[0]
    assert "`Router` (model.py:" in near[0]


def test_ddp_told_every_parameter_is_used_fuses_the_data_dependent_model(tmp_path: Path) -> None:
    # DDP with find_unused_parameters=False fails a step where a parameter has no grad: the repository states none
    ddp = _SAME_FILE.replace('    model = Net().to("cpu")\n', '    model = Net().to("cpu")\n'
                             '    model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)\n')
    write_files(tmp_path, {"net.py": _MOE.format(body=_GUARDED) + ddp})
    cands, near = _optim(scan(tmp_path, patterns=[FusedOptimizer()]), "net.py")
    assert len(cands) == 1 and not near, near


# -- registries as if/elif chains on a configuration string (wenet's `init_model`): opt38's registry rule read dict
# literals and `register` decorators only

_ENCODERS = '''\
import torch
import torch.nn as nn


class DropEncoder(nn.Module):
    def __init__(self, dim=8, n=2, layer_drop=0.2):
        super().__init__()
        self.layer_drop = layer_drop
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand(1).item() < self.layer_drop:
                continue
            x = layer(x)
        return x


class PlainEncoder(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.body = nn.Linear(dim, dim)

    def forward(self, x):
        return self.body(x)
'''

_INIT_MODEL = '''\
from nets.encoders import DropEncoder, PlainEncoder


def init_model(configs):
    if configs["encoder"] == "dropformer":
        encoder = DropEncoder(**configs["encoder_conf"])
    elif configs["encoder"] in ("plain", "linear"):
        encoder = PlainEncoder()
    else:
        raise ValueError(configs["encoder"])
    return encoder
'''

_TRAINER = '''\
import torch
import yaml
from nets.init_model import init_model


def main(path):
    configs = yaml.safe_load(open(path))
    model = init_model(configs)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optimizer
'''


def _registry_repo(root: Path, encoder: str, init: str = _INIT_MODEL) -> tuple[list[dict], list[str]]:
    write_files(root, {"nets/__init__.py": "", "nets/encoders.py": _ENCODERS, "nets/init_model.py": init,
                       "train.py": _TRAINER, "conf/train.yaml": f"encoder: {encoder}\nencoder_conf:\n  n: 2\n"})
    return _optim(scan(root, patterns=[FusedOptimizer()]), "train.py")


def test_a_skip_class_only_an_if_arm_no_config_names_builds_is_not_the_trained_model(tmp_path: Path) -> None:
    cands, near = _registry_repo(tmp_path, "plain")
    assert len(cands) == 1 and not near, near


def test_keep_a_skip_class_an_if_arm_builds_under_a_configured_name(tmp_path: Path) -> None:
    cands, near = _registry_repo(tmp_path, "dropformer")
    assert not cands and len(near) == 1 and "`DropEncoder` (nets/encoders.py:" in near[0], near
    # the default arm (no name test) builds it: any configuration may reach it
    by_default = _INIT_MODEL.replace('    else:\n        raise ValueError(configs["encoder"])\n', '    else:\n        encoder = DropEncoder()\n')
    assert by_default != _INIT_MODEL
    cands, near = _registry_repo(tmp_path / "default", "plain", by_default)
    assert not cands and near, near


def test_a_torch_loss_computed_only_for_batches_with_targets_is_no_skipped_submodule(tmp_path: Path) -> None:
    loss_model = _MOE.replace("        self.inp = nn.Linear(dim, dim)\n",
                              "        self.inp = nn.Linear(dim, dim)\n        self.crit = nn.MSELoss()\n").replace(
        "    def forward(self, x):\n        return self.moe(self.inp(x))\n",
        "    def forward(self, x, y=None):\n        h = self.moe(self.inp(x))\n        if y is not None and y.numel() > 0:\n"
        "            return self.crit(h, y)\n        return h\n")
    write_files(tmp_path, {"net.py": loss_model.format(body=_UNGUARDED) + _SAME_FILE})
    cands, near = _optim(scan(tmp_path, patterns=[FusedOptimizer()]), "net.py")
    assert len(cands) == 1 and not near, near
