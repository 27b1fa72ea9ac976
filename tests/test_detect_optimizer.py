"""Issue 14 class 5: facts from other files of the repo decide fused_optimizer candidates
(npufuse.scan.repo_facts), params built as lists are guarded, third-party optimizers named."""

from __future__ import annotations

from pathlib import Path

from npufuse.scan.engine import scan_repo

_MODEL = '''\
import torch
import torch.nn as nn


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)

    def configure_optimizers(self, weight_decay, learning_rate):
        optimizer = torch.optim.AdamW(self.parameters(), lr=learning_rate, weight_decay=weight_decay)
        return optimizer
'''

_TRAIN = '''\
import torch
from model import GPT

model = GPT()
optimizer = model.configure_optimizers(0.1, 6e-4)
for step in range(10):
    loss = model(torch.randn(2, 4)).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad({flag})
'''


def _scan(tmp_path: Path, files: dict[str, str], in_place: bool = False):
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return scan_repo(tmp_path, only=["fused_optimizer"], jobs=1, optimizer_zero_grad_in_place=in_place)


_OPT_IN = "`npufuse scan --optimizer-zero-grad-in-place` makes this a candidate whose fused branch rebinds that zero_grad"


def _opt(result):
    cands = [c for c in result.candidates if c["pattern"] == "fused_optimizer"]
    near = [m for m in result.near_misses if m["pattern"] == "fused_optimizer"]
    return cands, near


def test_trainer_elsewhere_with_set_to_none_true_is_a_near_miss_naming_the_option(tmp_path: Path) -> None:
    cands, near = _opt(_scan(tmp_path, {"model.py": _MODEL, "train.py": _TRAIN.format(flag="set_to_none=True")}))
    assert cands == [] and [(m["file"], m["line"]) for m in near] == [("model.py", 14)]
    reason = near[0]["reason"]
    assert reason.startswith("`optimizer.zero_grad(set_to_none=...)` at train.py:10 on the optimizer this builds")
    assert "raise ValueError on set_to_none=True" in reason and _OPT_IN in reason
    assert "weight decay and momentum still apply" in reason


def test_trainer_elsewhere_with_set_to_none_true_is_zeroed_in_place_with_the_option(tmp_path: Path) -> None:
    # tests/test_detect_optimizer_crossfile.py runs such a rewrite under the emulator
    cands, near = _opt(_scan(tmp_path, {"model.py": _MODEL, "train.py": _TRAIN.format(flag="set_to_none=True")}, in_place=True))
    assert near == [] and [(c["file"], c["line"]) for c in cands] == [("model.py", 14)]
    risk = next(r["detail"] for r in cands[0]["risks"] if "zeroes those grads in place" in r["detail"])
    assert "train.py:10" in risk and "ValueError" in risk and "`configure_optimizers` is used at train.py:5" in risk
    assert "optimizer.zero_grad = (lambda zero_grad: lambda set_to_none=None: zero_grad(set_to_none=False))" in cands[0]["replacement"]


def test_trainer_elsewhere_zeroing_in_place_keeps_the_candidate(tmp_path: Path) -> None:
    cands, near = _opt(_scan(tmp_path, {"model.py": _MODEL, "train.py": _TRAIN.format(flag="set_to_none=False")}))
    assert [c["line"] for c in cands] == [14] and near == []
    cands, near = _opt(_scan(tmp_path, {"model.py": _MODEL, "train.py": _TRAIN.format(flag="")}))
    assert [c["line"] for c in cands] == [14] and near == []  # the fused class's own default keeps grads


def test_a_file_that_does_not_import_the_builder_module_says_nothing(tmp_path: Path) -> None:
    other = _TRAIN.format(flag="set_to_none=True").replace("from model import GPT", "from othermodel import GPT")
    # another class of the repo defines configure_optimizers too: no link without the import (a
    # method defined in one file only is linked through any object: the next test file's minGPT case)
    twin = "class Other:\n    def configure_optimizers(self, weight_decay, learning_rate):\n        return None\n"
    cands, near = _opt(_scan(tmp_path, {"model.py": _MODEL, "train.py": other, "other.py": twin}))
    assert [c["line"] for c in cands] == [14] and near == []


def test_model_zero_grad_default_elsewhere_binds_self_zero_grad(tmp_path: Path) -> None:
    train = _TRAIN.format(flag="").replace("    optimizer.zero_grad()", "    model.zero_grad()")
    # frees by default (torch >= 2.0), not by the code's choice: zeroed in place without the option too
    for in_place in (False, True):
        cands, near = _opt(_scan(tmp_path, {"model.py": _MODEL, "train.py": train}, in_place=in_place))
        assert near == [] and len(cands) == 1
    assert near == [] and len(cands) == 1
    risk = next(r["detail"] for r in cands[0]["risks"] if "zeroes those grads in place" in r["detail"])
    assert "`model.zero_grad()` at train.py:10" in risk and "torch >= 2.0 default" in risk
    # the method's model is `self`: the driving file's `model` is its receiver
    assert "self.zero_grad = (lambda zero_grad:" in cands[0]["replacement"]


_WORKER = '''\
import torch.optim as optim


def train(rank, args, model, device):
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    for step in range(3):
        optimizer.zero_grad()
        model(None).sum().backward()
        optimizer.step()
'''

_HOGWILD = '''\
import torch.multiprocessing as mp
from net import Net
from train import train

if __name__ == "__main__":
    model = Net()
    model.share_memory()
    processes = []
    for rank in range(4):
        p = mp.Process(target=train, args=(rank, None, model, "cpu"))
        p.start()
        processes.append(p)
'''


def test_hogwild_share_memory_in_the_launcher_is_a_near_miss(tmp_path: Path) -> None:
    cands, near = _opt(_scan(tmp_path, {"train.py": _WORKER, "main.py": _HOGWILD}))
    assert cands == [] and len(near) == 1
    assert near[0]["file"] == "train.py" and "`model.share_memory()` at main.py:7" in near[0]["reason"]
    assert "hogwild" in near[0]["reason"]
    # without share_memory the same launcher leaves the candidate alone
    cands, near = _opt(_scan(tmp_path, {"main.py": _HOGWILD.replace("    model.share_memory()\n", "    pass\n")}))
    assert [c["file"] for c in cands] == ["train.py"] and near == []


_FSDP_LAUNCH = '''\
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from model import GPT

model = GPT()
{wrap}
optimizer = model.configure_optimizers(0.1, 6e-4)
'''


def test_fsdp_elsewhere_blocks_and_a_conditional_one_is_a_risk(tmp_path: Path) -> None:
    cands, near = _opt(_scan(tmp_path, {"model.py": _MODEL, "train.py": _FSDP_LAUNCH.format(wrap="model = FSDP(model)")}))
    assert cands == [] and "`FSDP` at train.py:6" in near[0]["reason"]
    cands, near = _opt(_scan(tmp_path, {"model.py": _MODEL, "train.py": _FSDP_LAUNCH.format(wrap="if torch.cuda.device_count() > 1:\n    model = FSDP(model)")}))
    assert near == [] and len(cands) == 1
    details = [r["detail"] for r in cands[0]["risks"]]
    assert any("chosen at run time (the condition at train.py:6)" in d and "`FSDP` at train.py:7" in d for d in details)


def test_conditional_deepspeed_guard_is_off_when_the_sharding_test_holds() -> None:
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from pattern_harness import detect_all

    from npufuse.patterns.fused_optimizer import _CONDITIONAL_DEEPSPEED, FusedOptimizer

    findings, _ = detect_all(FusedOptimizer(), _CONDITIONAL_DEEPSPEED)
    (f,) = findings
    model = torch.nn.Linear(2, 2)
    assert eval(f.guard_tensor, {"model": model, "devices": 1}) is model.weight
    assert eval(f.guard_tensor, {"model": model, "devices": 2}) is None  # DeepSpeed runs keep torch.optim
    assert any("chosen at run time" in r.detail and "`devices > 1`" in r.detail for r in f.risks)


def test_an_attribute_named_like_the_builder_is_not_a_link(tmp_path: Path) -> None:
    """The builder is reached by its imported name; `self.optimizer` in another file that imports
    the module for something else is not the function `optimizer`."""
    builder = '''\
import torch


def make_model():
    return torch.nn.Linear(2, 2)


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)
'''
    trainer = '''\
from helpers import make_model


class Trainer:
    def __init__(self):
        self.model = make_model()
        self.optimizer = None

    def step(self):
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad()
'''
    cands, near = _opt(_scan(tmp_path, {"helpers.py": builder, "trainer.py": trainer}))
    assert [c["file"] for c in cands] == ["helpers.py"] and near == []
    # imported and called: the same facts now concern it
    linked = trainer.replace("from helpers import make_model", "from helpers import make_model, optimizer").replace(
        "self.optimizer = None", "self.optimizer = optimizer(self.model)")
    cands, near = _opt(_scan(tmp_path, {"trainer.py": linked}))
    assert cands == [] and [m["file"] for m in near] == ["helpers.py"] and "trainer.py:10" in near[0]["reason"]
    cands, near = _opt(_scan(tmp_path, {"trainer.py": linked}, in_place=True))
    assert near == [] and [c["file"] for c in cands] == ["helpers.py"]
    assert any("trainer.py:10" in r["detail"] and "ValueError" in r["detail"] for r in cands[0]["risks"])
    assert "_npufuse_optimizer.zero_grad = " in cands[0]["replacement"]


def test_accelerate_prepare_elsewhere_with_zero_grad_is_zeroed_in_place(tmp_path: Path) -> None:
    train = '''\
from accelerate import Accelerator
from model import GPT

accelerator = Accelerator()
model = GPT()
optimizer = model.configure_optimizers(0.1, 6e-4)
model, optimizer = accelerator.prepare(model, optimizer)
for step in range(3):
    optimizer.step()
    optimizer.zero_grad()
'''
    # accelerate passes set_to_none=True by itself (the code asks for no free): zeroed in place in both modes
    for in_place in (True, False):
        cands, near = _opt(_scan(tmp_path, {"model.py": _MODEL, "train.py": train}, in_place=in_place))
        assert near == [] and len(cands) == 1
    # the code's own explicit set_to_none=True through accelerate: kept by default, the option named
    explicit = train.replace("optimizer.zero_grad()", "optimizer.zero_grad(set_to_none=True)")
    cands, near = _opt(_scan(tmp_path, {"model.py": _MODEL, "train.py": explicit}))
    assert cands == [] and "`optimizer.zero_grad(set_to_none=...)` at train.py:10" in near[0]["reason"] and _OPT_IN in near[0]["reason"]
    cands, near = _opt(_scan(tmp_path, {"model.py": _MODEL, "train.py": train}))
    assert any("accelerate's prepare (train.py:7)" in r["detail"] and "train.py:10" in r["detail"] for r in cands[0]["risks"])
    assert "optimizer.zero_grad = (lambda zero_grad:" in cands[0]["replacement"]
    # prepared but zeroed in place: nothing passes set_to_none=True
    cands, near = _opt(_scan(tmp_path, {"train.py": train.replace("zero_grad()", "zero_grad(set_to_none=False)")}))
    assert [c["file"] for c in cands] == ["model.py"] and near == []
