"""s43 sweep43b: classes found by the recall sweep on unseen non-LLM code (bench/detect_labels_sweep43b.json).

1. attention: a method returns ``(output, probabilities)`` and every caller in its file drops the probabilities
   (``out, _ = self.attn(x, x, x, mask)``); the proof that no other repository file reads them gave up when a
   sibling file (a copied model folder, ``try_1 - Copy/models/patchtst.py``) defines its *own* class of the same
   name. That file's mentions are its own definition, not calls of the scanned class
   (npufuse.patterns._sweep43b_callers). Near misses: the sibling imports the scanned module (it may call the
   scanned class), or a caller in the file reads the probabilities.
"""

from __future__ import annotations

from pathlib import Path

from apply_support import scan
from npufuse.patterns.attention import AttentionPattern
from scratch_repo import write_files

# iPatchTF's try_1/models/patchtst.py, cut down: the encoder layer drops the returned probabilities
_PATCHTST = '''\
import math
import torch
import torch.nn as nn
import torch.nn.functional as F


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.d_model = d_model
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)
        self.scale = math.sqrt(self.d_k)

    def forward(self, query, key, value, mask=None):
        batch_size = query.size(0)
        Q = self.w_q(query).view(batch_size, -1, self.n_heads, self.d_k).transpose(1, 2)
        K = self.w_k(key).view(batch_size, -1, self.n_heads, self.d_k).transpose(1, 2)
        V = self.w_v(value).view(batch_size, -1, self.n_heads, self.d_k).transpose(1, 2)
        scores = torch.matmul(Q, K.transpose(-2, -1)) / self.scale
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attention_weights = F.softmax(scores, dim=-1)
        attention_weights = self.dropout(attention_weights)
        context = torch.matmul(attention_weights, V)
        context = context.transpose(1, 2).contiguous().view(batch_size, -1, self.d_model)
        return self.w_o(context), attention_weights


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.self_attention = MultiHeadAttention(d_model, n_heads)
        self.norm1 = nn.LayerNorm(d_model)

    def forward(self, x, mask=None):
        attn_output, _ = self.self_attention(x, x, x, mask)
        return self.norm1(x + attn_output)
'''

# the copied folder's file: its own MultiHeadAttention, whose caller keeps the probabilities
_COPY = _PATCHTST.replace("        attn_output, _ = self.self_attention(x, x, x, mask)\n        return self.norm1(x + attn_output)\n",
                          "        attn_output, weights = self.self_attention(x, x, x, mask)\n        return self.norm1(x + attn_output), weights\n")


def _attention(root: Path, files: dict[str, str]) -> tuple[list[dict], list[str]]:
    write_files(root, files)
    data = scan(root, patterns=[AttentionPattern()])
    file = "try_1/models/patchtst.py"
    cands = [c for c in data["candidates"] if c["pattern"] == "attention" and c["file"] == file]
    near = [m["reason"] for m in data["near_misses"] if m["pattern"] == "attention" and m["file"] == file]
    return cands, near


def test_fuse_when_a_sibling_file_defines_its_own_class_of_that_name(tmp_path: Path) -> None:
    cands, near = _attention(tmp_path, {"try_1/models/patchtst.py": _PATCHTST, "try_1 - Copy/models/patchtst_copy.py": _COPY})
    assert len(cands) == 1 and not near, near
    assert cands[0]["qualname"] == "MultiHeadAttention.forward"


def test_keep_when_the_sibling_imports_the_scanned_module_or_a_caller_reads_them(tmp_path: Path) -> None:
    importing = "from try_1.models.patchtst import TransformerEncoderLayer\n" + _COPY
    star = "from try_1.models.patchtst import *\n" + _COPY
    reader = _PATCHTST.replace("        attn_output, _ = self.self_attention(x, x, x, mask)\n",
                               "        attn_output, self.last = self.self_attention(x, x, x, mask)\n        print(self.last)\n")
    cases = {
        "imports": {"try_1/models/patchtst.py": _PATCHTST, "other/user.py": importing},
        "star": {"try_1/models/patchtst.py": _PATCHTST, "other/user.py": star},
        "reader": {"try_1/models/patchtst.py": reader, "try_1 - Copy/models/patchtst_copy.py": _COPY},
    }
    for name, files in cases.items():
        cands, near = _attention(tmp_path / name, files)
        assert not cands and len(near) == 1, (name, cands, near)
        assert "are returned to the callers" in near[0], (name, near)
