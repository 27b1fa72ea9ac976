"""s33 optim33: every fused_optimizer guard checks at run time that the trainable parameters are
fp32/fp16 (a model handed in by a caller may be bf16: the fused class raises TypeError at its first
step). Where every call of the builder in the repository hands it a model the caller has just cast to
bfloat16 (nanoGRPO: ``model = model.to(torch.bfloat16)`` in ``train.py``, then ``GRPO(model, ...)``), the
fused branch would never run: a near miss naming the cast. A caller that casts only under a condition,
or another caller with an fp32 model, keeps the guarded candidate."""

from __future__ import annotations

from pathlib import Path

from apply_support import scan
from npufuse.patterns.fused_optimizer import FusedOptimizer

_TRAINER = '''\
import torch


class Trainer:
    def __init__(self, model, lr=1e-3):
        self.model = model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def step(self, x):
        self.optimizer.zero_grad()
        self.model(x).float().square().mean().backward()
        self.optimizer.step()
'''

_TRAIN = '''\
import torch
import torch.nn as nn
from trainer import Trainer

model = nn.Linear(8, 4)
{cast}
trainer = Trainer(model, lr=1e-4)
'''


def _scan(tmp_path: Path, cast: str, extra: str = "") -> dict:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "trainer.py").write_text(_TRAINER, encoding="utf-8")
    (root / "train.py").write_text(_TRAIN.format(cast=cast), encoding="utf-8")
    if extra:
        (root / "eval_run.py").write_text(extra, encoding="utf-8")
    return scan(root, patterns=[FusedOptimizer()])


def _found(data: dict) -> list[dict]:
    return [c for c in data["candidates"] if c["qualname"] == "Trainer.__init__"]


def test_every_caller_hands_a_bf16_model(tmp_path: Path) -> None:
    data = _scan(tmp_path, "model = model.to(torch.bfloat16)")
    assert not _found(data)
    near = [m for m in data["near_misses"] if m["qualname"] == "Trainer.__init__"]
    assert near and "every call of `Trainer` in the repository hands it a model just cast to bfloat16 (train.py:6)" in near[0]["reason"]


def test_fp32_model_is_a_candidate_whose_guard_checks_the_dtype(tmp_path: Path) -> None:
    data = _scan(tmp_path, "model = model.to(torch.float32)")
    found = _found(data)
    assert found, data["near_misses"]
    assert "for p in self.model.parameters() if p.requires_grad" in found[0]["guard_tensor"]


def test_conditional_cast_keeps_the_guarded_candidate(tmp_path: Path) -> None:
    data = _scan(tmp_path, "if torch.cuda.is_available():\n    model = model.to(torch.bfloat16)")
    assert _found(data), data["near_misses"]


def test_another_caller_with_an_fp32_model_keeps_the_guarded_candidate(tmp_path: Path) -> None:
    other = "import torch.nn as nn\nfrom trainer import Trainer\n\n\ndef run():\n    return Trainer(nn.Linear(8, 4))\n"
    data = _scan(tmp_path, "model = model.bfloat16()", extra=other)
    assert _found(data), data["near_misses"]
