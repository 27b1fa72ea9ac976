"""s33 optim33: params from a method of the model (ReChorus' ``model.customize_parameters()``, called in a
runner that gets the model as an argument) are a list the guard may read when every definition of that
method in the repository only builds fresh lists from its object's parameters and returns one (a subclass
deferring to ``super()`` included): the guard calls it once more and gets the same tensors. A definition
with another effect (it counts its calls on the object) keeps the near miss."""

from __future__ import annotations

from pathlib import Path

import pytest

from apply_support import scan
from npufuse.patterns.fused_optimizer import FusedOptimizer

_MODELS = '''\
import torch.nn as nn


class BaseModel(nn.Module):
    def customize_parameters(self) -> list:
        weight_p, bias_p = [], []
        for name, p in filter(lambda x: x[1].requires_grad, self.named_parameters()):
            if 'bias' in name:
                bias_p.append(p)
            else:
                weight_p.append(p)
        optimize_dict = [{'params': weight_p}, {'params': bias_p, 'weight_decay': 0}]
        return optimize_dict


class Staged(BaseModel):
    def customize_parameters(self):
        if self.stage == 2:
            return [{'params': [p for p in self.parameters() if p.requires_grad]}]
        else:
            {extra}return super().customize_parameters()
'''

_RUNNER = '''\
import torch


class BaseRunner:
    def __init__(self, optimizer_name="Adam", lr=1e-3, l2=0.0):
        self.optimizer_name, self.learning_rate, self.l2 = optimizer_name, lr, l2

    def _build_optimizer(self, model):
        optimizer = eval('torch.optim.{}'.format(self.optimizer_name))(
            model.customize_parameters(), lr=self.learning_rate, weight_decay=self.l2)
        return optimizer

    def fit(self, model, batches):
        optimizer = self._build_optimizer(model)
        for x in batches:
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
'''


def _scan(tmp_path: Path, extra: str) -> dict:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "models.py").write_text(_MODELS.replace("{extra}", extra), encoding="utf-8")
    (root / "runner.py").write_text(_RUNNER, encoding="utf-8")
    return scan(root, patterns=[FusedOptimizer()])


def test_pure_listing_method_in_every_class_is_a_guarded_candidate(tmp_path: Path) -> None:
    data = _scan(tmp_path, "")
    found = [c for c in data["candidates"] if c["qualname"] == "BaseRunner._build_optimizer"]
    assert len(found) == 1, data["near_misses"]
    assert "(model.customize_parameters())" in found[0]["guard_tensor"]
    assert "getattr(torch.optim, str(self.optimizer_name), None)" in found[0]["guard_tensor"]


@pytest.mark.parametrize("extra", ["self.calls = 1\n            ", "print(self.stage)\n            "])
def test_a_definition_with_another_effect_keeps_the_near_miss(tmp_path: Path, extra: str) -> None:
    data = _scan(tmp_path, extra)
    assert not [c for c in data["candidates"] if c["qualname"] == "BaseRunner._build_optimizer"]
    near = [m for m in data["near_misses"] if m["qualname"] == "BaseRunner._build_optimizer"]
    assert near and "may be a one-shot iterator" in near[0]["reason"]
