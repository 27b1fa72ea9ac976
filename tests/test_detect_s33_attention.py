"""s33 attention pass: a softmax the repository writes itself (a function imported from another file, fairseq's
``utils.softmax`` through ``from pkg import utils``), a dropout subclass reached as ``layers.Dropout``, and the
body reader ``canonical.softmax_body`` on the spellings seen in the corpus."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from npufuse.scan.canonical import einops_equation_subscripts, softmax_body
from npufuse.scan.engine import scan_repo


def _repo(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


_ATTN_WITH_IMPORTED_SOFTMAX = '''
import math
import torch
{imp}


def attention(Q, K, V, mask=None):
    scores = torch.matmul(Q, K.transpose(-2, -1)) / math.sqrt(Q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(mask == 0, float("-inf"))
    weights = {call}(scores, dim=-1)
    return torch.matmul(weights, V)
'''

_CS336_SOFTMAX = '''
import torch


def softmax(x, dim):
    x_exp = torch.exp(x - x.max(dim=dim, keepdim=True).values)
    return x_exp / x_exp.sum(dim=dim, keepdim=True)
'''

_FAIRSEQ_UTILS = '''
import torch
import torch.nn.functional as F


def softmax(x, dim: int, onnx_trace: bool = False):
    if onnx_trace:
        return F.softmax(x.float(), dim=dim)
    else:
        return F.softmax(x, dim=dim, dtype=torch.float32)
'''


@pytest.mark.parametrize("imp,call,helper", [
    ("from .nn_utils import softmax", "softmax", ("pkg/nn_utils.py", _CS336_SOFTMAX)),
    ("from pkg import nn_utils", "nn_utils.softmax", ("pkg/nn_utils.py", _CS336_SOFTMAX)),
    ("from pkg import utils", "utils.softmax", ("pkg/utils.py", _FAIRSEQ_UTILS)),
])
def test_softmax_helper_of_another_file(tmp_path: Path, imp: str, call: str, helper: tuple[str, str]) -> None:
    root = _repo(tmp_path, {"pkg/__init__.py": "", "pkg/model.py": _ATTN_WITH_IMPORTED_SOFTMAX.format(imp=imp, call=call),
                            helper[0]: helper[1]})
    res = scan_repo(root, jobs=1, only=["attention"])
    hits = [c for c in res.candidates if c["file"] == "pkg/model.py"]
    assert len(hits) == 1, [n["reason"] for n in res.near_misses]
    if helper[1] is _FAIRSEQ_UTILS:
        assert hits[0]["params"]["softmax_dtype"] == "torch.float32"


def test_softmax_helper_of_another_file_with_a_temperature_is_a_near_miss(tmp_path: Path) -> None:
    hot = _CS336_SOFTMAX.replace("torch.exp(x - x.max(dim=dim, keepdim=True).values)", "torch.exp((x - x.max(dim=dim, keepdim=True).values) / 2)")
    root = _repo(tmp_path, {"pkg/__init__.py": "", "pkg/nn_utils.py": hot,
                            "pkg/model.py": _ATTN_WITH_IMPORTED_SOFTMAX.format(imp="from .nn_utils import softmax", call="softmax")})
    res = scan_repo(root, jobs=1, only=["attention"])
    assert not [c for c in res.candidates if c["file"] == "pkg/model.py"]
    assert any("whose body is not read as a softmax" in n["reason"] for n in res.near_misses), res.near_misses


def test_dropout_subclass_reached_through_a_module_of_the_repository(tmp_path: Path) -> None:
    # unified-io-2: ``from pkg import layers`` ... ``self.attn_drop = layers.Dropout(p)``, a subclass of nn.Dropout whose
    # misspelt ``foward`` overrides nothing
    layers = ("from torch import nn\n\n\nclass Dropout(nn.Dropout):\n    def __init__(self, p=0.5, inplace=False, broadcast_dims=()):\n"
              "        super().__init__(p, inplace)\n        self.broadcast_dims = broadcast_dims\n\n"
              "    def foward(self, x):\n        return x * 2\n")
    model = ("import torch\nimport torch.nn.functional as F\nfrom torch import nn\nfrom pkg import layers\n\n\n"
             "class Attn(nn.Module):\n    def __init__(self, p=0.1):\n        super().__init__()\n        self.attn_drop = layers.Dropout(p)\n\n"
             "    def forward(self, q, k, v):\n        w = torch.einsum('bqhd,bkhd->bhqk', q * 0.125, k)\n"
             "        w = F.softmax(w, dim=-1)\n        w = self.attn_drop(w)\n        return torch.einsum('bhqk,bkhd->bqhd', w, v)\n")
    root = _repo(tmp_path, {"pkg/__init__.py": "", "pkg/layers.py": layers, "pkg/model.py": model})
    res = scan_repo(root, jobs=1, only=["attention"])
    hits = [c for c in res.candidates if c["file"] == "pkg/model.py"]
    assert len(hits) == 1, [n["reason"] for n in res.near_misses]
    # overriding forward makes it another computation
    root2 = _repo(tmp_path / "b", {"pkg/__init__.py": "", "pkg/layers.py": layers.replace("def foward", "def forward"), "pkg/model.py": model})
    res2 = scan_repo(root2, jobs=1, only=["attention"])
    assert not [c for c in res2.candidates if c["file"] == "pkg/model.py"]


def _body(src: str):
    tree = ast.parse(src)
    fn = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)][-1]
    return softmax_body(fn, tree)


@pytest.mark.parametrize("src", [
    # OpenFold's softmax_no_cast: a flag computed from predicates, autocast off on one branch
    "import torch\n\ndef softmax_no_cast(t, dim=-1):\n    d = t.dtype\n    on = installed and comm.is_initialized()\n"
    "    if d is torch.bfloat16 and not on:\n        with torch.cuda.amp.autocast(enabled=False):\n"
    "            s = torch.nn.functional.softmax(t, dim=dim)\n    else:\n        s = torch.nn.functional.softmax(t, dim=dim)\n    return s\n",
    # logsumexp form
    "import torch\n\ndef sm(x, dim=-1):\n    return torch.exp(x - torch.logsumexp(x, dim=dim, keepdim=True))\n",
    # torch.max(...)[0], detached
    "import torch as th\n\ndef sm(x, dim=-1):\n    e = th.exp(x - th.max(x, dim, keepdim=True)[0].detach())\n    return e / th.sum(e, dim, keepdim=True)\n",
])
def test_softmax_body_reads(src: str) -> None:
    assert _body(src) is not None


@pytest.mark.parametrize("src", [
    # the branches disagree: one is a softmax, the other the input
    "import torch\n\ndef sm(x, dim, on=False):\n    if on:\n        return x\n    return torch.softmax(x, dim)\n",
    # the float32 result on one branch only
    "import torch\n\ndef sm(x, dim, on=False):\n    if on:\n        return torch.softmax(x, dim, dtype=torch.float32)\n    return torch.softmax(x, dim)\n",
    # in place on the caller's tensor
    "import torch\n\ndef sm(x, dim):\n    x.exp_()\n    return x / x.sum(dim, keepdim=True)\n",
    # a max over another axis than the sum
    "import torch\n\ndef sm(x, dim):\n    e = torch.exp(x - x.amax(0, keepdim=True))\n    return e / e.sum(dim, keepdim=True)\n",
    # the input cast to half
    "import torch\n\ndef sm(x, dim):\n    return torch.softmax(x.half(), dim)\n",
    # no max subtracted
    "import torch\n\ndef sm(x, dim):\n    e = torch.exp(x)\n    return e / e.sum(dim, keepdim=True)\n",
    # a call in the flag's test that may change state
    "import torch\n\ndef sm(x, dim):\n    if step():\n        return torch.softmax(x, dim)\n    return torch.softmax(x, dim)\n",
])
def test_softmax_body_refuses(src: str) -> None:
    assert _body(src) is None


def test_einops_word_axis_names() -> None:
    assert einops_equation_subscripts(ast.Constant("... queries d_k, ... keys d_k -> ... queries keys")) == ("BHab", "BHcb", "BHac")
    assert einops_equation_subscripts(ast.Constant("batch h i d, batch h j d -> batch h i j")) == ("ahid", "ahjd", "ahij")
    # a grouping, a word axis named like the ellipsis's letters
    assert einops_equation_subscripts(ast.Constant("b (h d), b h d -> b h")) is None
    assert einops_equation_subscripts(ast.Constant("... B d, ... B d -> ... B")) is None
