"""rms_norm whose statistics are fp32 but whose rstd factor is cast back to the input's dtype before the product
(``x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)``, then the weight): the normalized value
is in the input's dtype, so the result is ``promote(x.dtype, weight.dtype)``. Read as fp32 before s43, the fused
branch returned float32 where the original returns bf16 (found by ho20fix43, confirmed on the s43 start code)."""

from __future__ import annotations

import pytest
import torch

from pattern_harness import check_rewrite_runs, detect_all
from npufuse.patterns.rms_norm import RmsNorm

_NORM = '''
import torch
import torch.nn as nn


class Norm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        out = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).{cast}
{tail}
'''
_TAILS = {
    "plain": "        return out * self.weight",
    "optional": "        if self.weight is not None:\n            out = out * self.weight\n        return out",
}
_RUN = '''
torch.manual_seed(0)
m = Norm(64).to({wdt})
with torch.no_grad():
    m.weight.mul_(torch.rand(64, dtype={wdt}) + 0.5)
x = torch.randn(2, 8, 64, dtype={xdt})
out = m(x)
'''


@pytest.mark.parametrize("tail", sorted(_TAILS))
@pytest.mark.parametrize("cast", ["to(x.dtype)", "type_as(x)"])
@pytest.mark.parametrize("xdt,wdt", [("torch.bfloat16", "torch.bfloat16"), ("torch.float16", "torch.float16"),
                                     ("torch.bfloat16", "torch.float32"), ("torch.float32", "torch.float32")])
def test_factor_cast_back_keeps_the_original_dtype(tail, cast, xdt, wdt):
    code = _NORM.format(cast=cast, tail=_TAILS[tail])
    findings, _ = detect_all(RmsNorm(), code)
    assert findings, "the norm is a candidate"
    facts = check_rewrite_runs(RmsNorm(), code, _RUN.format(xdt=xdt, wdt=wdt), findings)
    assert facts["calls"] >= 1  # the fused branch ran
    assert all(a == b for a, b in facts["dtypes"]), facts["dtypes"]
    assert min(facts["cos_out"]) > 0.999


def test_factor_left_in_fp32_still_returns_fp32():
    # near twin: no cast on the factor, so the product promotes to fp32 as the original's does
    code = _NORM.format(cast="float()", tail=_TAILS["plain"])
    findings, _ = detect_all(RmsNorm(), code)
    assert findings
    facts = check_rewrite_runs(RmsNorm(), code, _RUN.format(xdt="torch.bfloat16", wdt="torch.bfloat16"), findings)
    assert facts["dtypes"] == [(torch.float32, torch.float32)]
