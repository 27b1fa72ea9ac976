"""Fixes from the s36 precision audit (a helper judged 151 candidates on 27 new repositories against
the spec: 147 correct, 2 wrong, 2 dubious). Each test fails without its fix."""

from __future__ import annotations

import pytest

from npufuse.patterns import rope
from pattern_harness import check_rewrite_runs, detect_all

# Meta-style complex rope with a batch-free table ([S, D/2] viewed as [1, S, 1, D/2]): nothing in the
# table bounds the batch, and npu_rotary_mul's interleave mode takes B*N < 1000 (spec 4.1)
_COMPLEX_BATCH_FREE = '''
import torch


def broadcastable(table, xc):
    nd = xc.ndim
    assert table.shape == (xc.shape[1], xc.shape[-1])
    shape = [n if i == 1 or i == nd - 1 else 1 for i, n in enumerate(xc.shape)]
    return table.view(*shape)


def rotate(q, k, table):
    qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    kc = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
    table = broadcastable(table, qc)
    q_out = torch.view_as_real(qc * table).flatten(3)
    k_out = torch.view_as_real(kc * table).flatten(3)
    return q_out.type_as(q), k_out.type_as(k)
'''

_RUN = '''
b, s, h, d = {b}, 3, {h}, 8
angles = torch.outer(torch.arange(s).float(), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
table = torch.polar(torch.ones_like(angles), angles)
q = torch.randn(b, s, h, d, requires_grad=True)
k = torch.randn(b, s, h, d, requires_grad=True)
out = rotate(q, k, table)
leaves = [q, k]
'''


@pytest.mark.parametrize("b,h,fused", [(2, 4, True), (32, 32, False), (1000, 1, False)])
def test_complex_rope_with_a_batch_free_table_checks_the_interleave_row_limit(b: int, h: int, fused: bool) -> None:
    pattern = rope.RopePattern()
    findings, _ = detect_all(pattern, _COMPLEX_BATCH_FREE)
    assert findings and findings[0].params["mode"] == "complex" and findings[0].variant == "complex_freqs_cis"
    facts = check_rewrite_runs(pattern, _COMPLEX_BATCH_FREE, _RUN.format(b=b, h=h), findings)
    assert "< 1000 *" in facts["rewritten"]
    assert (facts["calls"] > 0) is fused  # B*N >= 1000: the original code runs, not a call the op rejects
    assert all(c > 0.9999 for c in facts["cos_out"] + facts["cos_grad"])
