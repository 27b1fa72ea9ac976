"""s50 review (review50's reproduced defects in SDPA rewrites, each now a run-time condition that runs the original).

1. The float-bias -> pse path (s50 ho27c) read "float" off the bias helper's arithmetic; a helper ending in a comparison
   hands SDPA a bool mask (True = keep), which pse would add to the scores as 0 / 1 (cos 0.93-0.95). The pse path now
   runs where the bias is a floating tensor (or None), the original otherwise.
2. A bool attn_mask with a run-time is_causal flag (older): with the flag set SDPA applies the mask and the causal
   triangle (torch's CPU kernel; backends disagree, and a literal is_causal=True is refused for that), but the fused
   call received only the triangle (cos 0.63-0.81). The fused call now runs where the flag is off (or the mask None).
"""

from __future__ import annotations

from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.sdpa import SdpaPattern
from test_detect_s50_ho27c import _ALIBI, _alibi_run


def _faithful(code: str, run: str) -> dict:
    findings, misses = detect_all(SdpaPattern(), code)
    assert [f.qualname for f in findings] == ["LinearBiasAttention.forward"], [m.reason for m in misses]
    facts = check_rewrite_runs(SdpaPattern(), code, run, findings)
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999, facts
    return facts


def test_bias_helper_ending_in_a_comparison_runs_the_original() -> None:
    code = _ALIBI.replace("return self.s * (pos[None, :] - pos[:, None])", "return self.s * (pos[None, :] - pos[:, None]) > -0.3")
    facts = _faithful(code, _alibi_run("torch.float32"))
    assert "is_floating_point()" in facts["rewritten"]
    assert facts["calls"] == 0  # a bool bias: the original ran both times


def test_float_bias_still_runs_the_fused_call() -> None:
    facts = _faithful(_ALIBI, _alibi_run("torch.float32"))
    assert facts["all_calls"] == {"npu_fusion_attention": 2}


_CAUSAL_RUN = """
torch.manual_seed(0)
m = LinearBiasAttention(32, 4)
n = LinearBiasAttention(32, 4, causal=False)
n.load_state_dict(m.state_dict())
x = torch.randn(2, 6, 32, requires_grad=True)
out = [m(x), n(x)]
leaves = [x]
"""


def test_bool_mask_with_a_run_time_causal_flag_keeps_the_mask() -> None:
    code = _ALIBI.replace("bias = self.bias(L).unsqueeze(0).to(h.device)", "bias = self.bias(L).unsqueeze(0).to(h.device) > -0.3")
    facts = _faithful(code, _CAUSAL_RUN)
    assert facts["calls"] == 1  # the non-causal module fused, the causal one ran the original
