"""s42 ports42: misses of the twelfth port set (bench/detect_ports12.json, ModelZoo / MindIE ports), fixed by class.

1. fused_optimizer (cornac's VAECF ``learn``): ``u_batch.data = np.ones(len(u_batch.data))`` binarises a scipy sparse
   batch before it becomes a tensor; it was read as a parameter re-allocation (``.data = ...``) and the Adam the port
   replaced with ``NpuFusedAdam`` was refused. ``Tensor.data`` accepts only a Tensor (torch raises TypeError for a
   numpy array or a Python literal), so an ``X.data`` given such a value is no parameter. Near miss kept: a parameter
   given ``torch.from_numpy(...)`` (a tensor) is still a re-allocation.
The spellings are written for this test.
"""

from __future__ import annotations

from pathlib import Path

from apply_support import scan
from npufuse.patterns.fused_optimizer import FusedOptimizer
from scratch_repo import write_files

_SPARSE_BATCH = '''\
import numpy as np
import torch
import torch.nn as nn


class VAE(nn.Module):
    def __init__(self, n_items=32, k=8):
        super().__init__()
        self.enc = nn.Linear(n_items, k)
        self.dec = nn.Linear(k, n_items)

    def forward(self, x):
        return self.dec(torch.tanh(self.enc(x)))


def learn(vae, matrix, n_epochs, batch_size, learn_rate):
    optimizer = torch.optim.Adam(params=vae.parameters(), lr=learn_rate)
    for _ in range(n_epochs):
        for start in range(0, matrix.shape[0], batch_size):
            u_batch = matrix[start:start + batch_size, :]
            u_batch.data = np.ones(len(u_batch.data))
            u_batch = torch.tensor(u_batch.toarray(), dtype=torch.float32)
            loss = (vae(u_batch) - u_batch).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return vae
'''


def _optim(root: Path, source: str) -> tuple[list[dict], list[str]]:
    write_files(root, {"vaecf.py": source})
    data = scan(root, patterns=[FusedOptimizer()])
    cands = [c for c in data["candidates"] if c["pattern"] == "fused_optimizer" and c["file"] == "vaecf.py"]
    near = [m["reason"] for m in data["near_misses"] if m["pattern"] == "fused_optimizer" and m["file"] == "vaecf.py"]
    return cands, near


def test_data_given_a_numpy_array_or_a_literal_is_no_parameter(tmp_path: Path) -> None:
    cands, near = _optim(tmp_path / "numpy", _SPARSE_BATCH)
    assert len(cands) == 1 and cands[0]["line"] == 17 and not near, near
    literal = _SPARSE_BATCH.replace("np.ones(len(u_batch.data))", "[1.0 for _ in u_batch.data]")
    cands, near = _optim(tmp_path / "literal", literal)
    assert len(cands) == 1 and not near, near


def test_keep_a_parameter_given_a_tensor_made_from_numpy(tmp_path: Path) -> None:
    realloc = _SPARSE_BATCH.replace(
        "            u_batch.data = np.ones(len(u_batch.data))\n",
        "            for p in vae.parameters():\n"
        "                p.data = torch.from_numpy(np.ones(tuple(p.shape), dtype=np.float32))\n")
    cands, near = _optim(tmp_path / "realloc", realloc)
    assert not cands and "parameters are re-allocated (`.data = ...` at line 22)" in near[0], near
