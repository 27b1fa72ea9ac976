"""npu_rotary_mul takes D < 896 (spec §4.1): where the rotated width is not known from the code, the
fused branch checks it at run time. A rotation of the hidden state before the head split (LTX-Video:
D = the model width, 2048) must run the original code, not a call the op rejects (audit33)."""

from __future__ import annotations

import pytest

from npufuse.patterns.registry import all_patterns
from pattern_harness import check_rewrite_runs, detect_all

ROPE = next(p for p in all_patterns() if p.id == "rope")

# LTX-Video's apply_rotary_emb (its einops pairs written with unflatten / flatten): (cos, sin) tables given by the caller
CODE = '''
import torch


def apply_rotary_emb(input_tensor, freqs_cis):
    cos_freqs = freqs_cis[0]
    sin_freqs = freqs_cis[1]
    t_dup = input_tensor.unflatten(-1, (-1, 2))
    t1, t2 = t_dup.unbind(dim=-1)
    t_dup = torch.stack((-t2, t1), dim=-1)
    input_tensor_rot = t_dup.flatten(-2)
    out = input_tensor * cos_freqs + input_tensor_rot * sin_freqs
    return out
'''

RUN = '''
D = {d}
x = torch.randn(1, 6, D, requires_grad=True)
ang = torch.randn(1, 6, D // 2).repeat_interleave(2, dim=-1)
out = apply_rotary_emb(x, (ang.cos(), ang.sin()))
leaves = [x]
'''


@pytest.mark.parametrize("d, fused", [(16, True), (1024, False)])
def test_width_checked_at_run_time(d, fused):
    findings, _ = detect_all(ROPE, CODE)
    assert findings, "the rotation is a candidate"
    assert any(f"< 896" in f.fused or "< 896" in (f.guard_tensor or "") for f in findings)
    facts = check_rewrite_runs(ROPE, CODE, RUN.format(d=d), findings)
    assert (facts["calls"] >= 1) is fused, facts["all_calls"]
    assert min(facts["cos_out"], default=1.0) >= 0.9999
