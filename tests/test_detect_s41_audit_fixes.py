"""s41 audit fixes (audit41): the classes behind the wrong / dubious candidates and the false near-miss reasons of
this session's precision audit on 14 repositories new to npufuse (bench/audit_s41_precision.json,
bench/audit_s41_near_misses.json).

W1 rms_norm: the output dtype "like" an intermediate expression was rendered ``a * b.dtype`` (``.dtype`` binds to
   ``b``): a TypeError in the fused branch (SkyReels-V2's ``fast_rms_norm``). The expression is bracketed.
"""

from __future__ import annotations

from npufuse.patterns.rms_norm import RmsNorm
from pattern_harness import check_rewrite_runs, detect_all

# -- W1: the dtype of an intermediate product

_DTYPE_OF_PRODUCT = '''
import torch


def fast_rms_norm(x, weight, eps):
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    x = x.type_as(x) * weight
    return x
'''

_DTYPE_OF_PRODUCT_RUN = "out = fast_rms_norm(torch.randn(2, 5, 16, dtype=torch.bfloat16), torch.randn(16), 1e-6)"


def test_the_dtype_of_an_intermediate_product_is_bracketed() -> None:
    findings, _ = detect_all(RmsNorm(), _DTYPE_OF_PRODUCT)
    assert len(findings) == 1
    assert "(x.float() * torch.rsqrt(" in findings[0].fused
    facts = check_rewrite_runs(RmsNorm(), _DTYPE_OF_PRODUCT, _DTYPE_OF_PRODUCT_RUN, findings)
    assert facts["calls"] >= 1
    assert facts["dtypes"] == [(facts["dtypes"][0][0],) * 2]
    assert min(facts["cos_out"]) > 0.9999
