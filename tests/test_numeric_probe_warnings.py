"""The numeric probe runs repository code on sampled tensors; torch's warnings about that code
must not leak into the scan's output (seen on a real repository: `x.T` on a 3-D tensor)."""

from __future__ import annotations

import ast
import textwrap
import warnings

from npufuse.scan import numeric_probe as P
from npufuse.scan.dataflow import ModuleInfo

_TRANSPOSED_TWICE = '''
import torch
from torch import nn


class TNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.T.T
        ms = (y * y).mean(-1, keepdim=True)
        return y * torch.rsqrt(ms + self.eps) * self.g
'''


def test_probe_evaluation_emits_no_torch_warning() -> None:
    module = ModuleInfo.from_source("m.py", textwrap.dedent(_TRANSPOSED_TWICE))
    cls = next(n for n in module.tree.body if isinstance(n, ast.ClassDef))
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        proof = P.prove_rms_norm(module, fn, cls)
    # the probe did evaluate the forward (so the 3-D `x.T` ran) ...
    assert proof.kind in ("proved", "unknown"), proof
    # ... and torch's deprecation warning about it stayed inside the probe
    assert [str(w.message) for w in caught] == []
