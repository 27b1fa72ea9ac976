"""s40 (wrong40): two precision classes the blind judge found, with invented reproducers.

1. Attention through SDPA or the eager form with a mask built in view whose construction can leave a query row with
   no key (a band that excludes the query itself, a strict causal triangle, a dilated pattern). torch gives such a row
   NaN (or a uniform average with a finite fill); npu_fusion_attention's output there is not pinned down (spec 5.1 /
   14). ``patterns/_mask_rows.py`` evaluates the construction on small sizes: a mask that keeps a key in every row
   (causal with the diagonal) is unchanged; one that does at some sizes only gets a run-time check that every query row
   keeps a key; one that leaves a row empty at every size is a near miss.
2. fused_optimizer over ``self.model`` stored from a trainer's constructor argument: the classes every instantiation
   of the trainer passes decide (``random_skip.handed_in_models``), as for a model built where the optimizer is; a
   driver importing the trainer through a package's ``__init__`` was not found before, so an MoE skipping idle experts
   was fused."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from apply_support import scan
from pattern_harness import detect_all
from scratch_repo import write_files
from test_detect_s39_optim_data_skip import _GUARDED, _MOE, _UNGUARDED, _optim

from npufuse.patterns import _mask_rows
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.fused_optimizer import FusedOptimizer
from npufuse.patterns.sdpa import SdpaPattern
from npufuse.scan.dataflow import ModuleInfo


def _example(pattern: type, name: str) -> str:
    return next(e.code for e in pattern.FUSE + pattern.KEEP if e.name == name)


# -- 1. masks that can leave a query row with no key ------------------------------------------------------------------

def _verdict(body: str, polarity: str) -> str | None:
    code = "import torch\n\ndef f(q, n, w):\n" + "".join(f"    {ln}\n" for ln in body.splitlines()) + "    return m\n"
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "f")
    line = len(code.splitlines())
    node = ast.parse("m", mode="eval").body
    node.lineno = line  # type: ignore[attr-defined]
    v = _mask_rows.row_verdict(node, polarity, _mask_rows.Resolver(module, scope, line))
    return None if v is None else v.kind


@pytest.mark.parametrize("body, polarity, kind", [
    ("m = torch.ones(n, n, dtype=torch.bool).tril()", "keep", "kept"),                      # causal with the diagonal
    ("m = torch.triu(torch.ones(n, n), diagonal=1).bool()", "masked", "kept"),
    ("i = torch.arange(n)\nm = i[None, :] <= i[:, None]", "keep", "kept"),
    ("i = torch.arange(n)\nm = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)", "keep", "kept"),  # sliding window
    ("m = torch.ones(n, n, dtype=torch.bool).tril(diagonal=-1)", "keep", "empty"),          # strict causal: row 0
    ("m = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=0)", "masked", "empty"),
    ("i = torch.arange(n)\nm = ((i[:, None] - i[None, :]).abs() <= w) & (i[:, None] != i[None, :])", "keep", "varies"),
    ("m = torch.eye(n, dtype=torch.bool)", "masked", "varies"),                            # every key but the query's own
    ("m = torch.arange(n)[None, :] < q[:, None]", "keep", None),                            # key padding of lengths handed in
])
def test_row_verdict_by_construction(body: str, polarity: str, kind: str | None) -> None:
    assert _verdict(body, polarity) == kind


def test_band_without_the_query_itself_runs_fused_only_where_every_row_keeps_a_key() -> None:
    (f,), misses = detect_all(SdpaPattern(), _example(SdpaPattern, "s40_band_mask_without_the_query_itself"))
    assert "(keep if keep.dtype == torch.bool else keep >= 0).any(-1).all()" in f.fused.splitlines()[0], f.fused
    assert any("a query row can keep no key" in r.detail for r in f.risks)
    assert not misses


def test_dilated_eager_mask_runs_fused_only_where_every_row_keeps_a_key() -> None:
    (f,), misses = detect_all(AttentionPattern(), _example(AttentionPattern, "s40_dilated_mask_without_the_query_itself"))
    assert f.fused.startswith("if (not bool(masked.all(-1).any())) and "), f.fused
    assert not misses


@pytest.mark.parametrize("pattern, name", [
    (SdpaPattern, "s40_strict_causal_mask_leaves_the_first_row_empty"),
    (AttentionPattern, "s40_strict_causal_comparison_leaves_the_first_row_empty"),
])
def test_strict_causal_masks_are_near_misses_naming_row_zero(pattern: type, name: str) -> None:
    found, misses = detect_all(pattern(), _example(pattern, name))
    assert not found
    assert any("leaves query row 0 without any key at every size" in m.reason for m in misses), [m.reason for m in misses]


def test_causal_comparison_with_the_diagonal_is_unchanged() -> None:
    # Fuse twin: `j <= i` keeps the query itself: no run-time row check
    code = _example(AttentionPattern, "s40_dilated_mask_without_the_query_itself").replace(
        "        masked = (offset % self.stride != 0) | (offset == 0)\n", "        masked = offset < 0\n")
    (f,), misses = detect_all(AttentionPattern(), code)
    assert ".all(-1).any()" not in f.fused and ".any(-1).all()" not in f.fused, f.fused
    assert not misses


def test_rows_the_original_zeroes_after_softmax_need_no_check() -> None:
    # the original zeroes the NaN rows itself; the rewrite zeroes the fully masked rows too: exact, no row check
    code = _example(AttentionPattern, "s40_dilated_mask_without_the_query_itself").replace(
        "        out = scores.softmax(dim=-1) @ v\n",
        "        probs = scores.softmax(dim=-1)\n        probs = probs.masked_fill(torch.isnan(probs), 0)\n        out = probs @ v\n")
    found, _misses = detect_all(AttentionPattern(), code)
    assert all("masked.all(-1).any()" not in f.fused for f in found)


# -- 2. a model handed to a trainer's constructor ------------------------------------------------------------------------

_TRAINER = '''\
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

_DRIVER = '''\
import torch
from pkg.models import Net
from pkg.engine import Trainer


def run():
    model = Net()
    trainer = Trainer(model, lr=1e-3)
    trainer.step(torch.randn(16, 8))
'''


def _package(root: Path, body: str, driver: str = _DRIVER, extra: dict[str, str] | None = None) -> tuple[list[dict], list[str]]:
    # the driver imports the trainer and the model through the packages' `__init__` re-exports
    write_files(root, {"pkg/__init__.py": "", "pkg/models/__init__.py": "from .moe import Net\n",
                       "pkg/engine/__init__.py": "from .trainer import Trainer\n", "pkg/models/moe.py": _MOE.format(body=body),
                       "pkg/engine/trainer.py": _TRAINER, "scripts/train.py": driver, **(extra or {})})
    return _optim(scan(root, patterns=[FusedOptimizer()]), "pkg/engine/trainer.py")


def test_keep_an_moe_handed_to_the_trainer_constructor(tmp_path: Path) -> None:
    cands, near = _package(tmp_path, _GUARDED)
    assert not cands and len(near) == 1, near
    assert near[0].startswith("the model the optimizer takes calls a trainable submodule only when a test on the step's data holds")
    assert "`Router` (pkg/models/moe.py:" in near[0]


def test_a_dense_model_handed_to_the_trainer_constructor_is_fused(tmp_path: Path) -> None:
    cands, near = _package(tmp_path, _UNGUARDED)
    assert len(cands) == 1 and not near, near


def test_every_instantiation_counts(tmp_path: Path) -> None:
    # one driver passes the dense model, another a model class of its own file that skips idle experts
    other = _MOE.format(body=_GUARDED).replace("class Net(", "class MoENet(") + '''

def main():
    from pkg.engine import Trainer
    Trainer(MoENet().to("cpu")).step(torch.randn(16, 8))
'''
    cands, near = _package(tmp_path, _UNGUARDED, extra={"scripts/moe_train.py": other})
    assert not cands and len(near) == 1, near
    assert "scripts/moe_train.py:" in near[0] and near[0].startswith("the model the optimizer takes")


def test_an_unresolved_model_argument_is_named(tmp_path: Path) -> None:
    # the driver passes what a factory returns: the trainer's reachable code decides, and the reason says why
    driver = _DRIVER.replace("    model = Net()\n", "    model = build(Net)\n").replace("def run():", "def build(cls):\n    return cls()\n\n\ndef run():")
    cands, near = _package(tmp_path, _GUARDED, driver=driver)
    assert not cands and len(near) == 1, near
    assert "its model is a constructor argument and `Trainer(...)` at scripts/train.py:" in near[0]
    assert "passes `model`, which npufuse does not resolve to a model class of the repository" in near[0]


def test_a_resolved_moe_is_named_beside_an_unresolved_instantiation(tmp_path: Path) -> None:
    # one driver passes a factory's model, another the MoE: the MoE decides, as the model the optimizer takes
    other = _MOE.format(body=_GUARDED).replace("class Net(", "class MoENet(") + '''

def main():
    from pkg.engine import Trainer
    Trainer(MoENet()).step(torch.randn(16, 8))
'''
    driver = _DRIVER.replace("    model = Net()\n", "    model = build(Net)\n").replace("def run():", "def build(cls):\n    return cls()\n\n\ndef run():")
    cands, near = _package(tmp_path, _UNGUARDED, driver=driver, extra={"scripts/moe_train.py": other})
    assert not cands and len(near) == 1, near
    assert near[0].startswith("the model the optimizer takes") and "scripts/moe_train.py:" in near[0]
