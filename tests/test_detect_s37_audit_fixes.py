"""s37 audit fixes (fix37): the classes behind the WRONG candidates of this session's precision audit.

F1 fused_optimizer: a model whose forward skips a trainable submodule (or zeroes its output) on
steps drawn at random leaves its params without a grad on such steps; the fused class builds its
flat buffers at the first step from the params that have one (the rest are excluded for good) and
zeroes grads in place. Found in the model's class (same file or the classes it builds), through the
trainer's imports when the model is not told apart, or a config's ``_target_`` for ``instantiate``.
F2 fused_optimizer: DDP's ``gradient_as_bucket_view`` makes every grad a view into its bucket.
F3 sdpa/attention: a 3-D mask [1|N, S, S] is broadcast as [1, 1|N, S, S]; the op takes 4-D/2-D only.
F4 attention/sdpa: a -inf-built bias plus a caller's float mask is checked at run time before `< 0`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apply_support import scan
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.fused_optimizer import FusedOptimizer
from npufuse.patterns.sdpa import SdpaPattern
from pattern_harness import check_replacement_matches, detect_all

# -- F1: the model lives in another module the trainer imports; the builder takes a dict of models

_BUILDER = '''\
import torch
from torch.optim import AdamW


def build_optimizer(models, lr):
    out = {}
    for key, model in models.items():
        out[key] = AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    return out
'''

_DIT = '''\
import torch
import torch.nn as nn


class Denoiser(nn.Module):
    def __init__(self, dim=8, uncond_prob=0.1):
        super().__init__()
        self.uncond_prob = uncond_prob
        self.cond_in = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, cond):
        dropped = False
        if self.training and torch.rand(1) < self.uncond_prob:
            dropped = True
        c = self.cond_in(cond)
        c = torch.zeros_like(c) if dropped else c
        return self.out(x + c)
'''

_FACTORY = '''\
from modules.dit import Denoiser


def build_model(dim):
    return {"dit": Denoiser(dim)}
'''

_TRAIN = '''\
from modules.factory import build_model
from optim_utils import build_optimizer


def main():
    models = build_model(8)
    optimizers = build_optimizer(models, 1e-4)
    return models, optimizers
'''


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")


def _optimizer_results(data: dict) -> tuple[list[dict], list[dict]]:
    cands = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer"]
    near = [m for m in data["near_misses"] if m["pattern"] == "fused_optimizer"]
    return cands, near


def test_random_condition_drop_reached_through_the_trainers_imports_refuses(tmp_path: Path) -> None:
    _write(tmp_path, {"optim_utils.py": _BUILDER, "modules/__init__.py": "", "modules/dit.py": _DIT,
                      "modules/factory.py": _FACTORY, "train.py": _TRAIN})
    cands, near = _optimizer_results(scan(tmp_path, patterns=[FusedOptimizer()]))
    assert not cands
    (miss,) = [m for m in near if m["file"] == "optim_utils.py"]
    assert "`Denoiser` (modules/dit.py:17) replaces by a constant the output of `self.cond_in`" in miss["reason"]
    assert "not told apart" in miss["reason"]


def test_the_same_model_without_the_random_draw_stays_a_candidate(tmp_path: Path) -> None:
    fixed = _DIT.replace("torch.rand(1) < self.uncond_prob", "self.uncond_prob >= 1.0")
    _write(tmp_path, {"optim_utils.py": _BUILDER, "modules/__init__.py": "", "modules/dit.py": fixed,
                      "modules/factory.py": _FACTORY, "train.py": _TRAIN})
    cands, _near = _optimizer_results(scan(tmp_path, patterns=[FusedOptimizer()]))
    assert [c["file"] for c in cands] == ["optim_utils.py"]


def test_a_config_target_for_instantiate_counts_as_reached(tmp_path: Path) -> None:
    trainer = '''\
import hydra
from optim_utils import build_optimizer


def main(cfg):
    model = hydra.utils.instantiate(cfg.model)
    return build_optimizer({"m": model}, 1e-4)
'''
    _write(tmp_path, {"optim_utils.py": _BUILDER, "modules/__init__.py": "", "modules/dit.py": _DIT,
                      "train.py": trainer, "configs/model.yaml": "model:\n  _target_: modules.dit.Denoiser\n  dim: 8\n"})
    cands, near = _optimizer_results(scan(tmp_path, patterns=[FusedOptimizer()]))
    assert not cands
    assert any("modules/dit.py:17" in m["reason"] for m in near)


def test_a_model_class_told_apart_without_a_skip_is_not_refused_for_another_class(tmp_path: Path) -> None:
    trainer = '''\
import torch
import torch.nn as nn
from modules.dit import Denoiser


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


def main():
    aux = Denoiser()
    net = Plain()
    return torch.optim.AdamW(net.parameters(), lr=1e-3)
'''
    _write(tmp_path, {"modules/__init__.py": "", "modules/dit.py": _DIT, "train.py": trainer})
    cands, _near = _optimizer_results(scan(tmp_path, patterns=[FusedOptimizer()]))
    assert [c["file"] for c in cands] == ["train.py"]


@pytest.mark.parametrize("name", ["s37_condition_dropout_zeroes_a_submodule_output", "s37_layer_drop_skips_the_call",
                                  "s37_unconditional_forward_drawn_by_the_trainer"])
def test_random_skip_keep_examples_name_the_skip(name: str) -> None:
    (example,) = [k for k in FusedOptimizer.KEEP if k.name == name]
    findings, misses = detect_all(FusedOptimizer(), example.code)
    assert not findings
    assert any("on random steps" in m.reason for m in misses)


# -- F2: DDP's bucket-view grads, in the builder's file and in the file that drives it

def test_ddp_bucket_view_in_the_builders_class_refuses() -> None:
    (example,) = [k for k in FusedOptimizer.KEEP if k.name == "s37_ddp_bucket_view_grads_before_the_optimizer"]
    findings, misses = detect_all(FusedOptimizer(), example.code)
    assert not findings
    assert any("`gradient_as_bucket_view` is set (line 24)" in m.reason for m in misses)


def test_ddp_bucket_view_in_the_driving_file_refuses(tmp_path: Path) -> None:
    builder = "import torch\n\n\ndef make_optimizer(model, lr):\n    return torch.optim.AdamW(model.parameters(), lr=lr)\n"
    driver = '''\
from torch.nn.parallel import DistributedDataParallel
from builder import make_optimizer


def run(model, rank, views=True):
    model = DistributedDataParallel(model, device_ids=[rank], gradient_as_bucket_view=views)
    return make_optimizer(model, 1e-3)
'''
    _write(tmp_path, {"builder.py": builder, "driver.py": driver})
    cands, near = _optimizer_results(scan(tmp_path, patterns=[FusedOptimizer()]))
    assert not cands
    assert any("gradient_as_bucket_view" in m["reason"] and "driver.py:6" in m["reason"] for m in near)
    _write(tmp_path, {"driver.py": driver.replace("gradient_as_bucket_view=views", "gradient_as_bucket_view=False")})
    cands, _near = _optimizer_results(scan(tmp_path, patterns=[FusedOptimizer()]))
    assert [c["file"] for c in cands] == ["builder.py"]


# -- F3 / F4: the replacements run and match the originals under the emulator (shape-checked op)

@pytest.mark.parametrize("pattern,name", [
    (SdpaPattern(), "s37_three_d_block_mask_gets_the_broadcast_leading_dim"),
    (SdpaPattern(), "s37_per_head_three_d_mask_expanded_over_the_batch"),
    (AttentionPattern(), "s37_three_d_keep_mask_broadcast_over_batch_and_heads"),
    (SdpaPattern(), "s37_causal_bias_plus_caller_mask_values_checked"),
    (AttentionPattern(), "s37_causal_bias_plus_a_caller_float_mask_values_checked"),
])
def test_mask_examples_run_the_fused_branch_and_match(pattern, name: str) -> None:
    (example,) = [f for f in type(pattern).FUSE if f.name == name]
    check_replacement_matches(pattern, example)


def test_a_caller_float_mask_added_to_a_minus_inf_bias_is_value_checked() -> None:
    (example,) = [f for f in AttentionPattern.FUSE if f.name == "s37_causal_bias_plus_a_caller_float_mask_values_checked"]
    (finding,) = detect_all(AttentionPattern(), example.code)[0]
    assert finding.params["mask_values_checked"] is True
    assert "((bias == 0) | (bias <= -1000.0)).all()" in finding.fused
    (example,) = [f for f in SdpaPattern.FUSE if f.name == "s37_causal_bias_plus_caller_mask_values_checked"]
    (finding,) = detect_all(SdpaPattern(), example.code)[0]
    assert "<= -1000" in finding.fused


def test_random_skip_index_never_reads_a_link_out_of_the_repository(tmp_path):
    """The random-skip pass reads other files of an untrusted repository through the repo passes'
    reader: a ``.py`` link that leads outside the repository is not read (nor parsed)."""
    from npufuse.scan.random_skip import RepoIndex

    outside = tmp_path / "outside.py"
    outside.write_text("import torch\n\nclass Net(torch.nn.Module):\n    def forward(self, x):\n        return x\n")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "inside.py").write_text("x = 1\n")
    (repo / "model.py").symlink_to(outside)
    index = RepoIndex(repo, ["inside.py", "model.py"], 1 << 20)
    assert index.text("inside.py") == "x = 1\n" and index.tree("inside.py") is not None
    assert index.text("model.py") is None and index.tree("model.py") is None
