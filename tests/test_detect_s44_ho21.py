"""s44 (ho21fix44): classes behind the real misses of the blind sets HO21a / HO21b, with invented reproducers.

1. A double-backward call (``torch.autograd.functional.hessian`` / ``hvp`` / ...) blocks only the files the
   code around it can reach (npufuse.scan.double_backward_reach): a tutorial script that differentiates a toy
   function of its own no longer turns every site of the repository into a near miss.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from apply_support import make_repo, scan
from npufuse.patterns.rms_norm import RmsNorm
from npufuse.patterns.swiglu import Swiglu

# -- 1. double-backward facts tied to the code that reaches the site ------------------------------------------------

_MODEL = '''\
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
'''

_TOY_HESSIAN = '''\
import torch
from torch.autograd.functional import hessian


def g(x):
    return (x ** 3).sum()


x_val = torch.tensor([1.0, 2.0])
H = hessian(g, x_val)
print(H)
'''

_TOY_HVP_MAIN = '''\
import torch


def f(x):
    return (x.sin() ** 2).sum()


def main():
    x = torch.randn(3)
    print(torch.autograd.functional.hvp(f, x, torch.ones(3)))


if __name__ == "__main__":
    main()
'''

_MODEL_HESSIAN = '''\
import torch
from torch.autograd.functional import hessian

from pkg.model import MLP

mlp = MLP(4, 8)
H = hessian(lambda x: mlp(x).sum(), torch.randn(4))
'''

_LOADED_HESSIAN = '''\
import torch
from torch.autograd.functional import hessian

net = torch.load("model.pt", weights_only=False)
H = hessian(lambda x: net(x).sum(), torch.randn(4))
'''

_PATTERNS = (RmsNorm(), Swiglu())


def _model_sites(data: dict[str, Any]) -> list[str]:
    return sorted(c["pattern"] for c in data["candidates"] if c["file"] == "pkg/model.py")


def _blocked(data: dict[str, Any]) -> list[str]:
    return [m["reason"] for m in data["near_misses"] if "double-backward trick" in m["reason"]]


@pytest.mark.parametrize("script, body", [
    ("tutorials_autograd/05_hessian.py", _TOY_HESSIAN),  # module level, in a file no import can name
    ("autograd_demo/hessian_demo.py", _TOY_HESSIAN),  # module level, importable: still only its own imports
    ("autograd_demo/06_hvp.py", _TOY_HVP_MAIN),  # inside a function of a file no import can name
])
def test_toy_double_backward_script_does_not_block_the_model(tmp_path: Path, script: str, body: str) -> None:
    files = {"pkg/__init__.py": "", "pkg/model.py": _MODEL, script: body}
    data = scan(make_repo(tmp_path, files), patterns=_PATTERNS)
    assert _model_sites(data) == ["rms_norm", "swiglu"], data["near_misses"]
    assert not _blocked(data)


@pytest.mark.parametrize("script, body, why", [
    ("scripts/curvature.py", _MODEL_HESSIAN, "the script imports the model and differentiates it twice"),
    ("scripts/05_curvature.py", _LOADED_HESSIAN, "a pickled model is loaded: its classes are imported at run time"),
    ("pkg/train.py", _TOY_HVP_MAIN.replace("def main():\n    x = torch.randn(3)\n",
                                           "def main(f=f):\n    x = torch.randn(3)\n"),
     "the function sits in an importable module: a caller may hand it the model"),
])
def test_double_backward_that_can_reach_the_model_still_blocks(tmp_path: Path, script: str, body: str, why: str) -> None:
    files = {"pkg/__init__.py": "", "pkg/model.py": _MODEL, script: body}
    data = scan(make_repo(tmp_path, files), patterns=_PATTERNS)
    assert _model_sites(data) == [], why
    assert len(_blocked(data)) == 2 and all(f"at {script}:" in r for r in _blocked(data)), data["near_misses"]
