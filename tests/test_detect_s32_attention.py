"""s32 attention pass: probabilities stored on the module (proof over the repository), positional scores as pse,
an ``elif`` bias, an einsum contracting the sequence an SDPA sibling reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from npufuse.patterns.attention import _S32_ELIF_BIASES, _S32_POSITIONAL_SCORES, _S32_STORED_PROBS, AttentionPattern
from npufuse.scan.engine import scan_repo
from pattern_harness import detect_all


def _repo(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def _stored(tmp_path: Path, extra: dict[str, str]) -> tuple[list[dict], list[str]]:
    root = _repo(tmp_path, {"tts/attentions.py": _S32_STORED_PROBS, **extra})
    res = scan_repo(root, jobs=1, only=["attention"])
    hits = [c for c in res.candidates if c["file"] == "tts/attentions.py"]
    reasons = [n["reason"] for n in res.near_misses if n["file"] == "tts/attentions.py"]
    return hits, reasons


def test_stored_probabilities_with_unrelated_attn_attributes_elsewhere(tmp_path: Path) -> None:
    # another file's class has its own ``self.attn`` module, imports a module path with the word, and says
    # "attention" in prose: none of it can read MultiHeadAttention's stored map
    other = ("from torch import nn\nfrom tts.attentions import MultiHeadAttention  # attention layers\n\n\n"
             "class Decoder(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
             "        self.attn = MultiHeadAttention(16, 2)\n\n    def forward(self, x, m):\n        return self.attn(x, x, m)\n")
    hits, reasons = _stored(tmp_path, {"tts/decoder.py": other})
    assert len(hits) == 1, reasons
    assert hits[0]["params"]["returns_probs"] == "p_attn"


@pytest.mark.parametrize("reader", [
    # a subclass in another file reads the stored map through ``self``
    "from tts.attentions import MultiHeadAttention\n\n\nclass Logged(MultiHeadAttention):\n    def last(self):\n        return self.attn\n",
    # a grandchild through an intermediate class of a third name
    "from tts.attentions import MultiHeadAttention\n\n\nclass A(MultiHeadAttention):\n    pass\n\n\nclass B(A):\n"
    "    def last(self):\n        return self.attn\n",
    # a plotting helper reads it from a module it is given
    "def plot(block):\n    return block.attn.attn.cpu()\n",
    # a closure inside an unrelated class's method, given the module
    "class Viz:\n    def run(self, blocks):\n        return [b.attn for b in blocks]\n",
])
def test_stored_probabilities_read_in_another_file_stay_a_near_miss(tmp_path: Path, reader: str) -> None:
    hits, reasons = _stored(tmp_path, {"tts/viz.py": reader})
    assert not hits
    assert any("nothing shows a caller accepts None" in r for r in reasons), reasons


def test_stored_probabilities_read_by_a_notebook_stay_a_near_miss(tmp_path: Path) -> None:
    nb = {"cells": [{"cell_type": "code", "source": ["plt.imshow(model.enc.attn_layers[0].attn[0, 0])"]}]}
    hits, reasons = _stored(tmp_path, {"notebooks/plot.ipynb": json.dumps(nb)})
    assert not hits, "a notebook reads `.attn`"


def test_positional_scores_pse_is_scaled_and_computed_on_the_fused_branch() -> None:
    findings, _ = detect_all(AttentionPattern(), _S32_POSITIONAL_SCORES)
    f = findings[0]
    # the positional term, scaled as the sum was (q is pre-scaled and the call gets scale 1.0)
    assert f.params["pse"].startswith("rel_shift(torch.matmul(") and f.params["pse"].endswith("* (self.dk ** (-0.5))"), f.params
    assert f.params["scale"] == "1.0"
    # the positional product runs as written before the fused call; the content product is not computed there
    fused_branch = f.fused.split("else:")[0]
    assert "rel_shift(torch.matmul(" in fused_branch
    assert "einsum(\"bhid,bhjd->bhij\"" not in fused_branch and "einsum('bhid,bhjd->bhij'" not in fused_branch


def test_elif_bias_condition_excludes_the_if_branch() -> None:
    findings, _ = detect_all(AttentionPattern(), _S32_ELIF_BIASES)
    assert "if (not self.use_a and self.use_b):" in findings[0].fused


_HELPER = '''import torch
from torch import nn


class DotAttention(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, q, k, v, scale=None, mask=None):
        scores = torch.matmul(q, k.transpose(-1, -2))
        if scale:
            scores = scores / scale
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attention = self.drop(scores.softmax(dim=-1))
        return torch.matmul(attention, v), attention
'''

_USER_A = '''from torch import nn

from pkg.layers import DotAttention


class TargetAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = DotAttention()

    def forward(self, q, k, v, mask=None):
        out, _ = self.att(q, k, v, scale=8 ** 0.5, mask=mask)
        return out.sum(dim=1)
'''

_USER_B = '''from torch import nn

from pkg.layers.attention import DotAttention


class SelfAttention(nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.blocks = nn.ModuleList([DotAttention() for _ in range(heads)])
        self.dot = DotAttention(0.1)

    def forward(self, x):
        out, weights = self.dot(x, x, x)
        return out
'''


def _cross_file(tmp_path: Path, user_b: str) -> tuple[list[dict], list[str]]:
    root = _repo(tmp_path, {"pkg/__init__.py": "", "pkg/layers/__init__.py": "from .attention import *\n",
                            "pkg/layers/attention.py": _HELPER, "pkg/models/target.py": _USER_A, "pkg/models/selfatt.py": user_b})
    res = scan_repo(root, jobs=1, only=["attention"])
    hits = [c for c in res.candidates if c["file"] == "pkg/layers/attention.py"]
    return hits, [n["reason"] for n in res.near_misses if n["file"] == "pkg/layers/attention.py"]


def test_helper_class_whose_callers_in_other_files_discard_the_probabilities(tmp_path: Path) -> None:
    hits, reasons = _cross_file(tmp_path, _USER_B.replace("        self.blocks = nn.ModuleList([DotAttention() for _ in range(heads)])\n", ""))
    assert len(hits) == 1, reasons
    assert hits[0]["params"]["returns_probs"] == "attention"


@pytest.mark.parametrize("change", [
    ("        return out\n", "        return out, weights\n"),  # handed up to callers nothing checks here
    ("        return out\n", "        self.log(weights)\n        return out\n"),  # read
    ("from pkg.layers.attention import DotAttention", "from pkg.layers.attention import DotAttention as DA"),  # renamed
    ("        out, weights = self.dot(x, x, x)\n", "        out, weights = self.dot.forward(x, x, x)\n"),  # another call path
])
def test_helper_class_with_a_caller_in_another_file_that_may_read_them(tmp_path: Path, change: tuple[str, str]) -> None:
    user_b = _USER_B.replace("        self.blocks = nn.ModuleList([DotAttention() for _ in range(heads)])\n", "").replace(*change)
    hits, reasons = _cross_file(tmp_path, user_b)
    assert not hits
    assert any("returned to the callers" in r for r in reasons), reasons


def test_helper_class_held_in_a_module_list_never_called_is_no_proof_of_a_use(tmp_path: Path) -> None:
    # a ModuleList of instances iterated nowhere: its mentions are accounted (constructions), nothing reads them
    hits, reasons = _cross_file(tmp_path, _USER_B)
    assert len(hits) == 1, reasons


def test_permuted_einsum_head_dim_is_checked_at_run_time() -> None:
    from npufuse.patterns.attention import _S32_CHANNEL_FIRST_WITH_SDPA

    findings, _ = detect_all(AttentionPattern(), _S32_CHANNEL_FIRST_WITH_SDPA)
    # the contracted axis is q's axis 2 as written: the fused call runs only where it fits the op's D <= 768 -- s37: checked
    # by the general head check on the permuted k / v every candidate carries (k's last axis is the contracted one)
    # s38: an einsum's head axis is checked against the op's 256 heads as well
    assert "if _npufuse_v.shape[-1] <= _npufuse_k.shape[-1] <= 768 and _npufuse_q.shape[1] <= 256:" in findings[0].fused
    assert "_npufuse_k = k.permute(0, 1, 3, 2)" in findings[0].fused
