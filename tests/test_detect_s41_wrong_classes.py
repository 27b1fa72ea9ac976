"""s41 (wrong41): the two precision classes of the s40 blind judge still fused on s40's final code, with invented
reproducers.

1. Attention whose mask a helper builds (a method ``self._band(n, ...)``, a module-level function, a nested builder
   closure, a mask cached on ``self``): the helper is followed, the call's arguments bound to its parameters, and the
   construction evaluated as :mod:`npufuse.patterns._mask_rows` does for a mask built in view.
2. fused_optimizer over a model nothing in the repository tells completely: a model class holding a module handed to
   its constructor (``self.bert = bert``), a trainer never instantiated in the repository, a training function no
   file calls. The holder's slot is resolved from the construction or the annotation; where nothing tells the model,
   any module of the repository that calls an expert only when the step's data reaches it refuses the fused
   optimizer."""

from __future__ import annotations

from pathlib import Path

from apply_support import scan
from scratch_repo import write_files
from test_detect_s39_optim_data_skip import _GUARDED, _MOE, _UNGUARDED, _optim

from npufuse.patterns.fused_optimizer import FusedOptimizer

# -- 2. a model nothing in the repository tells completely --------------------------------------------------------------

_HOLDER = '''\
import torch.nn as nn
from pkg.models.moe import Net


class PretrainModel(nn.Module):
    def __init__(self, backbone: Net, dim=8):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        return self.head(self.backbone(x))
'''

_HOLDER_TRAINER = '''\
import torch
from pkg.models.holder import PretrainModel


class Trainer:
    def __init__(self, backbone, lr=1e-3):
        self.model = PretrainModel(backbone).to("cpu")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)

    def step(self, x):
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
'''


def _repo(root: Path, body: str, files: dict[str, str]) -> tuple[list[dict], list[str]]:
    write_files(root, {"pkg/__init__.py": "", "pkg/models/__init__.py": "", "pkg/engine/__init__.py": "",
                       "pkg/models/moe.py": _MOE.format(body=body), **files})
    return _optim(scan(root, patterns=[FusedOptimizer()]), "pkg/engine/trainer.py")


def test_keep_a_holder_annotated_with_an_moe_backbone(tmp_path: Path) -> None:
    # the trainer wraps whatever backbone it is handed; the holder's annotation names the MoE
    cands, near = _repo(tmp_path, _GUARDED, {"pkg/models/holder.py": _HOLDER, "pkg/engine/trainer.py": _HOLDER_TRAINER})
    assert not cands and len(near) == 1, near
    assert near[0].startswith("the model the optimizer takes calls a trainable submodule only when a test on the step's data holds")
    assert "`Router` (pkg/models/moe.py:" in near[0]


def test_a_holder_annotated_with_a_dense_backbone_is_fused(tmp_path: Path) -> None:
    cands, near = _repo(tmp_path, _UNGUARDED, {"pkg/models/holder.py": _HOLDER, "pkg/engine/trainer.py": _HOLDER_TRAINER})
    assert len(cands) == 1 and not near, near


def test_keep_a_holder_whose_unannotated_slot_the_trainer_code_reaches_an_moe_for(tmp_path: Path) -> None:
    # no annotation, the backbone a parameter: the slot is not resolved; the trainer's imports reach the MoE
    holder = _HOLDER.replace("backbone: Net, ", "backbone, ")
    cands, near = _repo(tmp_path, _GUARDED, {"pkg/models/holder.py": holder, "pkg/engine/trainer.py": _HOLDER_TRAINER})
    assert not cands and len(near) == 1, near
    assert "its model's class `PretrainModel` holds a module handed to its constructor (`self.backbone = backbone` at " \
           "pkg/models/holder.py:8), whose class npufuse does not resolve" in near[0], near


def test_a_holder_built_around_a_dense_module_in_place_is_fused(tmp_path: Path) -> None:
    # `PretrainModel(Net())`: the construction tells the slot (the annotation-free holder, a dense Net)
    holder = _HOLDER.replace("backbone: Net, ", "backbone, ")
    trainer = _HOLDER_TRAINER.replace("def __init__(self, backbone, lr=1e-3):", "def __init__(self, lr=1e-3):").replace(
        "PretrainModel(backbone)", "PretrainModel(Net())").replace("from pkg.models.holder", "from pkg.models.moe import Net\nfrom pkg.models.holder")
    cands, near = _repo(tmp_path, _UNGUARDED, {"pkg/models/holder.py": holder, "pkg/engine/trainer.py": trainer})
    assert len(cands) == 1 and not near, near


def test_a_holder_built_around_an_moe_in_place_is_a_near_miss(tmp_path: Path) -> None:
    holder = _HOLDER.replace("backbone: Net, ", "backbone, ")
    trainer = _HOLDER_TRAINER.replace("def __init__(self, backbone, lr=1e-3):", "def __init__(self, lr=1e-3):").replace(
        "PretrainModel(backbone)", "PretrainModel(Net())").replace("from pkg.models.holder", "from pkg.models.moe import Net\nfrom pkg.models.holder")
    cands, near = _repo(tmp_path, _GUARDED, {"pkg/models/holder.py": holder, "pkg/engine/trainer.py": trainer})
    assert not cands and len(near) == 1 and near[0].startswith("the model the optimizer takes"), near


_LIBRARY_TRAINER = '''\
import torch


class Trainer:
    def __init__(self, model, lr=1e-3):
        self.model = model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)

    def step(self, x):
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
'''


def test_keep_a_trainer_never_instantiated_in_a_repository_with_an_moe(tmp_path: Path) -> None:
    # the trainer imports no model and nothing instantiates it: the user's script hands it a model of the repository
    cands, near = _repo(tmp_path, _GUARDED, {"pkg/engine/trainer.py": _LIBRARY_TRAINER})
    assert not cands and len(near) == 1, near
    assert near[0].startswith("a model class of the repository (the optimizer's model `self.model` is a constructor argument "
                              "and no code of the repository instantiates the trainer) calls a trainable submodule only when"), near


def test_a_trainer_never_instantiated_in_a_dense_repository_is_fused(tmp_path: Path) -> None:
    cands, near = _repo(tmp_path, _UNGUARDED, {"pkg/engine/trainer.py": _LIBRARY_TRAINER})
    assert len(cands) == 1 and not near, near


def test_a_training_function_no_file_calls(tmp_path: Path) -> None:
    function = '''\
import torch


def train(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for x in batches:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
'''
    cands, near = _repo(tmp_path / "moe", _GUARDED, {"pkg/engine/trainer.py": function})
    assert not cands and len(near) == 1 and "is a parameter of `train`, which no file of the repository calls" in near[0], near
    cands, near = _repo(tmp_path / "dense", _UNGUARDED, {"pkg/engine/trainer.py": function})
    assert len(cands) == 1 and not near, near
