"""add_rms_norm over a norm class another file of the repository defines (s43, from the s43 blind judge's one
wrong extra): when the class is read in its own file and its forward is NOT proved an RMSNorm, its name must
not make npufuse assume HF semantics (the fused code would apply the raw weight of a zero-centred
``(1 + weight)`` norm and skip its post-step). A class read there as a plain RMSNorm stays a candidate."""

from __future__ import annotations

import textwrap

from npufuse.scan.engine import scan_repo

BLOCK = textwrap.dedent('''\
    import torch
    import torch.nn as nn

    from .norms import {cls}


    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.input_layernorm = {cls}(d)
            self.post_attention_layernorm = {cls}(d)
            self.attn = nn.Linear(d, d)
            self.mlp = nn.Linear(d, d)

        def forward(self, hidden_states):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states = self.attn(hidden_states)
            hidden_states = residual + hidden_states

            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            return residual + hidden_states
''')

NORMS = textwrap.dedent('''\
    import torch
    import torch.nn as nn


    class ZeroCenteredRMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-4):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.zeros(dim))

        def forward(self, x):
            norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            output = norm * (1.0 + self.weight.float())
            return output - output.mean(-1, keepdim=True)


    class PlainRMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
''')


def _scan(tmp_path, cls):
    pkg = tmp_path / "repo" / "model"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "norms.py").write_text(NORMS)
    (pkg / "block.py").write_text(BLOCK.format(cls=cls))
    return scan_repo(tmp_path / "repo", jobs=1, only=["add_rms_norm"]).to_json()


def test_zero_centred_class_of_another_file_is_a_near_miss_with_a_true_reason(tmp_path):
    data = _scan(tmp_path, "ZeroCenteredRMSNorm")
    assert not [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    reasons = [m["reason"] for m in data["near_misses"] if m["pattern"] == "add_rms_norm"]
    assert reasons and all("ZeroCenteredRMSNorm (from model/norms.py)" in r and "not read as an RMSNorm" in r for r in reasons)


def test_plain_rms_norm_class_of_another_file_stays_a_candidate(tmp_path):
    data = _scan(tmp_path, "PlainRMSNorm")
    found = [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    assert found and all(c["file"] == "model/block.py" for c in found)
