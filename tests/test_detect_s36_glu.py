"""s36 glu36 (HO12a development data): an injected activation (``self.a = activation_fn``, default
``nn.ReLU()``) whose values come from the constructions of the class anywhere in the repository
(FMS's GatedLinearUnit built by every model file with ``str_to_activation(config.x)``; labml's
FeedForward built with ``nn.SiLU()`` positionally by its experiments). A same-named class of another
file is another class; a subclass of another file hands its own parameter on."""

from __future__ import annotations

from pathlib import Path

from apply_support import make_repo, scan
from npufuse.patterns.geglu import Geglu
from npufuse.patterns.swiglu import Swiglu

_FFN = '''\
import torch
from torch import nn


class GatedUnit(nn.Module):
    def __init__(self, d, h, activation_fn=nn.ReLU()):
        super().__init__()
        self.h = h
        self.wg1 = nn.Linear(d, 2 * h)
        self.w2 = nn.Linear(h, d)
        self.a = activation_fn

    def forward(self, x):
        wg, w1 = torch.split(self.wg1(x), [self.h, self.h], dim=-1)
        return self.w2(self.a(wg) * w1)
'''

_MODEL_LOOKUP = '''\
from torch import nn

from pkg.ffn import GatedUnit
from pkg.util import str_to_activation


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ff = GatedUnit(config.dim, config.hidden, activation_fn=str_to_activation(config.act))
'''

_UTIL = '''\
from torch import nn

_TABLE = {"relu": nn.ReLU, "swish": nn.SiLU}


def str_to_activation(name):
    return _TABLE[name]()
'''

_MODEL_RELU = '''\
from torch import nn

from pkg.ffn import GatedUnit


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ff = GatedUnit(d, 4 * d, nn.ReLU())
'''

# another file's own class of the same name, built with a SiLU: not a construction of pkg.ffn's
_OTHER_SAME_NAME = '''\
from torch import nn


class GatedUnit(nn.Module):
    def __init__(self, d, h, activation_fn=None):
        super().__init__()
        self.lin = nn.Linear(d, h)


def build(d):
    return GatedUnit(d, d, activation_fn=nn.SiLU())
'''

# a subclass in another file (relative import under another name) with a GELU default of its own
_SUBCLASS = '''\
from torch import nn

from .ffn import GatedUnit as GU


class WideUnit(GU):
    def __init__(self, d, act=nn.GELU()):
        super().__init__(d, 8 * d, activation_fn=act)
'''


def _glu(data: dict) -> tuple[list[tuple[str, str]], list[str]]:
    cands = [(c["pattern"], c["qualname"]) for c in data["candidates"] if c["file"] == "pkg/ffn.py"]
    misses = [n["reason"] for n in data["near_misses"] if n["file"] == "pkg/ffn.py"]
    return cands, misses


def test_construction_through_a_config_lookup_in_another_file_is_a_candidate(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo", {"pkg/__init__.py": "", "pkg/ffn.py": _FFN, "pkg/model.py": _MODEL_LOOKUP, "pkg/util.py": _UTIL})
    cands, misses = _glu(scan(root, patterns=[Swiglu(), Geglu()]))
    assert cands == [("swiglu", "GatedUnit.forward")], misses
    data = scan(root, patterns=[Swiglu()])
    c = next(c for c in data["candidates"] if c["file"] == "pkg/ffn.py")
    assert c["params"]["dispatches_to"] == ["swiglu", "geglu"] and c["params"]["default_activation"] == "relu"
    # the run-time dispatch: npu_swiglu for a SiLU, npu_geglu for a GELU, the original otherwise
    assert "isinstance(self.a, torch.nn.SiLU)" in c["replacement"] and "else:  # an activation the fused ops do not compute" in c["replacement"]


def test_only_non_fusable_constructions_stay_a_near_miss(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/ffn.py": _FFN, "pkg/model.py": _MODEL_RELU, "pkg/other.py": _OTHER_SAME_NAME}
    cands, misses = _glu(scan(make_repo(tmp_path / "repo", files), patterns=[Swiglu(), Geglu()]))
    assert cands == [], cands
    assert any("every construction of the class in the repository (1) passes" in m for m in misses), misses


def test_no_construction_keeps_the_default_near_miss(tmp_path: Path) -> None:
    cands, misses = _glu(scan(make_repo(tmp_path / "repo", {"pkg/__init__.py": "", "pkg/ffn.py": _FFN}), patterns=[Swiglu()]))
    assert cands == [] and any("defaults to relu" in m and "no construction" in m for m in misses), misses


def test_subclass_of_another_file_hands_its_gelu_default_on(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/ffn.py": _FFN, "pkg/model.py": _MODEL_RELU, "pkg/wide.py": _SUBCLASS}
    cands, misses = _glu(scan(make_repo(tmp_path / "repo", files), patterns=[Swiglu()]))
    assert cands == [("swiglu", "GatedUnit.forward")], misses
