"""s34 precision audit (bench/audit_s34_precision.json): the wrong replacements it found, one test per class.

* A class whose text says ``self.configure_schedulers()`` does not hold ``self.config``: the new switch field
  ``getattr(self.config, ...)`` raised AttributeError on NPU (DynamiCrafter's LightningModule)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from npufuse.scan.engine import scan_repo
from scan_fakes import FakeRmsNorm

_NORM_IN = """
import torch
from torch import nn


class Norm(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def forward(self, h):
        self.{attr}()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h
"""


def _switch(tmp_path: Path, attr: str) -> dict:
    (tmp_path / "norm.py").write_text(textwrap.dedent(_NORM_IN.format(attr=attr)), encoding="utf-8")
    res = scan_repo(tmp_path, patterns=[FakeRmsNorm()], jobs=1)
    assert len(res.candidates) == 1
    return res.candidates[0]["switch"]


def test_a_method_named_config_something_is_no_config_attribute(tmp_path: Path) -> None:
    sw = _switch(tmp_path, "configure_schedulers")
    assert sw["kind"] != "new_field" and "self.config" not in sw["expr"], sw


def test_a_read_of_self_config_still_gives_the_config_field(tmp_path: Path) -> None:
    sw = _switch(tmp_path, "config.validate")
    assert sw["kind"] == "new_field" and sw["expr"].startswith("getattr(self.config,"), sw


# * npu_rotary_mul's interleave mode takes B*N < 1000 (spec 4.1): the lane-pair, regrouped and 2x2-matrix
#   interleave forms read it at run time (fractalgen's AR rope ran on 64*256 patches x 8 heads).
def test_interleave_pairs_check_the_rows_limit(tmp_path: Path) -> None:
    from apply_support import scan
    from npufuse.patterns import rope

    example = next(f for f in rope.RopePattern.FUSE if f.name == "gpt_fast_lane_pairs_real_cache")
    (tmp_path / "model.py").write_text(example.code, encoding="utf-8")
    data = scan(tmp_path, patterns=[rope.RopePattern()])
    fused = [c for c in data["candidates"] if c["variant"] == "interleaved_pairs_real_cache"]
    assert fused, data["near_misses"]
    code = fused[0]["replacement"]
    assert ".numel() // max(" in code and "< 1000 * max(" in code, code


# * The fused optimizers combine and re-point the params' storage: FSDP2's DTensor params (and any tensor
#   subclass: FSDP1's FlatParameter) keep torch.optim, checked at run time by every guard (blt builds its
#   optimizer after fully_shard, with fp32 sharded params the dtype test alone let through).
def test_optimizer_guard_refuses_tensor_subclass_params() -> None:
    import torch

    from npufuse.patterns import fused_optimizer

    class DTensor(torch.Tensor):
        pass

    guard = eval(fused_optimizer._GROUPS_GUARD)  # the lambda the rewritten code applies to the params list
    plain = torch.nn.Parameter(torch.zeros(3))
    sharded = torch.zeros(3).as_subclass(DTensor).requires_grad_()
    assert guard([plain]) is plain
    assert guard([{"params": [plain]}, {"params": [sharded]}]) is None
    assert guard([plain, torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)]) is None


# * A build script's environment variable is no switch for model code (ml-sigmoid-attention's vendored
#   setup.py read FLASH_ATTENTION_FORCE_BUILD, which then guarded attention sites: off by default).
def test_build_script_env_vars_are_no_switches(tmp_path: Path) -> None:
    (tmp_path / "setup.py").write_text(
        "import os\nfrom setuptools import setup\nFORCE = os.getenv('FLASH_ATTENTION_FORCE_BUILD', 'FALSE') == 'TRUE'\nsetup(name='x')\n",
        encoding="utf-8")
    (tmp_path / "run.py").write_text("import os\nUSE = os.getenv('USE_FLASH_ATTENTION', '0') == '1'\n", encoding="utf-8")
    res = scan_repo(tmp_path, patterns=[FakeRmsNorm()], jobs=1)
    names = [s["name"] for s in res.switches]
    assert "FLASH_ATTENTION_FORCE_BUILD" not in names and "USE_FLASH_ATTENTION" in names, names
