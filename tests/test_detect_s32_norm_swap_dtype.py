"""The nn.RMSNorm swap (rms_norm ``nn_rmsnorm``) and the weight's dtype: npu_rms_norm takes gamma in
the input's dtype or float32 with an fp16/bf16 input (spec 2.1). A weight loaded in another dtype
(``load_state_dict(..., assign=True)`` of a bf16 checkpoint into a module fed ``q.float()``) must not
reach the op as an unsupported pair: fp32 input takes the weight upcast (what torch computes), any
other mismatch runs nn.RMSNorm's own forward. Run under the emulator, original vs rewritten."""

from __future__ import annotations

import pytest
import torch

from npufuse.patterns.registry import all_patterns
from pattern_harness import check_rewrite_runs, detect_all

CODE = '''\
import torch
from torch import nn


class QKNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.query_norm = nn.RMSNorm(d)

    def forward(self, q):
        return self.query_norm(q.float()).type_as(q)
'''

RUN = '''\
torch.manual_seed(0)
m = QKNorm(16)
with torch.no_grad():
    m.query_norm.weight.normal_()
m.query_norm.weight.data = m.query_norm.weight.data.to({wdtype})
q = torch.randn(2, 3, 16, dtype={xdtype}).requires_grad_()
out = (m(q), m.query_norm(q))
leaves = [q]
'''


@pytest.mark.parametrize("wdtype, xdtype, fused_calls", [
    ("torch.bfloat16", "torch.float32", 2),  # fp32 input, bf16 weight: the weight upcast, both calls fused
    ("torch.bfloat16", "torch.float16", 1),  # fp16 input, bf16 weight: the direct call runs nn.RMSNorm's forward
    ("torch.float32", "torch.bfloat16", 2),  # bf16 input, fp32 weight: an accepted pair
])
def test_swap_takes_only_weight_dtypes_the_op_accepts(wdtype: str, xdtype: str, fused_calls: int) -> None:
    pattern = next(p for p in all_patterns() if p.id == "rms_norm")
    findings, _ = detect_all(pattern, CODE)
    assert [f.variant for f in findings] == ["nn_rmsnorm"]
    facts = check_rewrite_runs(pattern, CODE, RUN.format(wdtype=wdtype, xdtype=xdtype), findings)
    assert facts["all_calls"].get("npu_rms_norm", 0) == fused_calls
    assert all(a == b for a, b in facts["dtypes"]), facts["dtypes"]
    assert min(facts["cos_out"]) >= 0.999 and min(facts["cos_grad"]) >= 0.999
