"""s38 norm pass (HO14a / HO14b development data): norms npufuse could not name.

Each test builds a small repository of invented code in the construct's class and checks the scan's
finding (or its silence for the near miss) and, where a rewrite is made, that it runs the fused op
and computes what the original computed."""

from __future__ import annotations

import types
from pathlib import Path

import torch

from apply_support import make_repo, npufuse, scan
from npufuse import emulate
from npufuse.patterns.rms_norm import RmsNorm
from scratch_repo import import_fresh

# -- a norm class a repository module binds at import time to one of several library RMSNorms -----------
# (Lumina-Video's components.py: apex's FusedRMSNorm where apex imports, torch's nn.RMSNorm elsewhere)

_CHOICE = '''\
try:
    from apex.normalization import FusedRMSNorm as RMSNorm
except ImportError:
    from torch.nn import RMSNorm
'''

_BLOCK = '''\
import torch
from torch import nn

from .layers import RMSNorm


class Block(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.pre = RMSNorm(width, eps=eps)
        self.mix = nn.Linear(width, width)
        self.post = RMSNorm(width, eps=eps)

    def forward(self, t):
        return self.post(t + self.mix(self.pre(t)))
'''


def _run_block(mod: types.ModuleType) -> torch.Tensor:
    torch.manual_seed(0)
    blk = mod.Block(32)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_()
        return blk(torch.randn(2, 5, 32))


def test_library_norm_chosen_at_import_in_another_module_is_swapped_for_each_arm(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/layers.py": _CHOICE, "pkg/model.py": _BLOCK}
    ref = _run_block(import_fresh(make_repo(tmp_path / "ref", files), "pkg.model"))
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=[RmsNorm()])
    cands = [c for c in data["candidates"] if c["pattern"] == "rms_norm"]
    assert [(c["qualname"], c["line"], c["params"]["module"]) for c in cands] == [
        ("Block.__init__", 10, "apex.normalization.FusedRMSNorm|torch.nn.RMSNorm"),
        ("Block.__init__", 12, "apex.normalization.FusedRMSNorm|torch.nn.RMSNorm")], data["near_misses"]
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    with emulate.install() as emu:
        out = _run_block(import_fresh(root, "pkg.model"))  # no apex here: torch's nn.RMSNorm, swapped
        assert emu.calls["npu_rms_norm"] == 2, emu.calls
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_import_time_choice_with_a_layer_norm_arm_is_not_swapped(tmp_path: Path) -> None:
    # the fallback is a LayerNorm under the RMSNorm name: on a machine without apex nothing is an RMSNorm
    layers = _CHOICE.replace("from torch.nn import RMSNorm", "from torch.nn import LayerNorm as RMSNorm")
    root = make_repo(tmp_path / "repo", {"pkg/__init__.py": "", "pkg/layers.py": layers, "pkg/model.py": _BLOCK})
    data = scan(root, patterns=[RmsNorm()])
    assert not [c for c in data["candidates"] if c["pattern"] == "rms_norm"]


def test_import_time_choice_with_an_assigned_arm_is_not_swapped(tmp_path: Path) -> None:
    # a binding made by code (a partial, an assignment) is not a class npufuse can name
    layers = _CHOICE.replace("from torch.nn import RMSNorm", "import functools\n    from torch import nn\n"
                             "    RMSNorm = functools.partial(nn.RMSNorm, elementwise_affine=False)")
    root = make_repo(tmp_path / "repo", {"pkg/__init__.py": "", "pkg/layers.py": layers, "pkg/model.py": _BLOCK})
    data = scan(root, patterns=[RmsNorm()])
    assert not [c for c in data["candidates"] if c["pattern"] == "rms_norm"]


# -- the optional residual bound in both arms of an if/else, normed over an axis handed in (ppl.pmx) -------

def test_optional_residual_with_else_checks_the_axis_on_x1_before_the_fused_add() -> None:
    from pattern_harness import detect_all

    from npufuse.patterns.add_rms_norm import _S38_SKIP_NORM, AddRmsNorm

    findings, _ = detect_all(AddRmsNorm(), _S38_SKIP_NORM)
    assert [f.variant for f in findings] == ["optional_residual"]
    cond = findings[0].params["condition"]
    # the sum ``out`` does not exist yet where the condition is tested: its dim is read on x1
    # (s48: npu_add_rms_norm takes fp16 / bf16 / fp32 only, so x1's dtype is checked too)
    assert cond.startswith("skip is not None and not torch.is_grad_enabled() and x.dtype == skip.dtype "
                           "and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.shape == skip.shape "
                           "and (axis in (-1, (-1,), x.dim() - 1) and (weight is None or weight.dim() == 1))"), cond
    assert "out" not in cond.replace("torch.", ""), cond
    assert findings[0].guard_tensor == "x"


def test_import_time_choice_with_a_repository_class_arm_is_left_to_that_class(tmp_path: Path) -> None:
    # apex where it imports, the repository's own class elsewhere (on NPU): the class's forward is the site
    layers = _CHOICE.replace("from torch.nn import RMSNorm", "from .own_norm import RMSNorm")
    own = ("import torch\nfrom torch import nn\n\n\nclass RMSNorm(nn.Module):\n    def __init__(self, d, eps=1e-6):\n"
           "        super().__init__()\n        self.eps = eps\n        self.weight = nn.Parameter(torch.ones(d))\n\n"
           "    def forward(self, x):\n        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight\n")
    root = make_repo(tmp_path / "repo", {"pkg/__init__.py": "", "pkg/layers.py": layers, "pkg/own_norm.py": own, "pkg/model.py": _BLOCK})
    data = scan(root, patterns=[RmsNorm()])
    assert [(c["file"], c["qualname"]) for c in data["candidates"] if c["pattern"] == "rms_norm"] == [("pkg/own_norm.py", "RMSNorm.forward")]
