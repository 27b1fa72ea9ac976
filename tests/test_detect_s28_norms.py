"""s28 norms pass (issue 14, held-out 5 development data): the classes this pass handled, with
their counts asserted (the pattern examples check detection, reasons and the emulated rewrite)."""

from __future__ import annotations

from npufuse.patterns import rms_norm as rms
from tests.pattern_harness import detect_all

PATTERN = rms.RmsNorm()


def test_cast_of_a_full_norm_helper_call_is_not_a_second_site() -> None:
    findings, _ = detect_all(PATTERN, rms._S28_CAST_OF_HELPER)
    assert [f.qualname for f in findings] == ["Projector.offset_norm"]


def test_a_factor_outside_the_helper_call_is_still_its_own_site() -> None:
    # a weightless helper: the caller's product with the weight is the finding (Meta's _norm style)
    code = rms._S28_CAST_OF_HELPER.replace("        out = out * (1.0 + weight.float())\n", "")
    code = code.replace("self.offset_norm(x.float(), self.norm_w).to(torch.bfloat16)",
                        "self.offset_norm(x.float(), self.norm_w).to(torch.bfloat16) * self.norm_w")
    findings, _ = detect_all(PATTERN, code)
    assert "Projector.forward" in [f.qualname for f in findings]


def test_named_norm_binding_is_taken_into_the_span_only_when_read_nowhere_else() -> None:
    code = rms._S28_NAMED_NORM.split("class PlainRootNorm")[0]
    findings, _ = detect_all(PATTERN, code)
    assert [(f.line, f.end_line) for f in findings] == [(14, 16)]
    # the norm is also returned: its statement stays before the span (run on both paths)
    kept = code.replace("        return unit * self.gain", "        return unit * self.gain, n")
    findings, _ = detect_all(PATTERN, kept)
    assert [(f.line, f.end_line) for f in findings] == [(15, 16)]
    assert "vector_norm" not in findings[0].fused


def test_reference_also_timed_in_the_checking_function_stays_a_reference() -> None:
    code = rms._S28_REFERENCE + "    for _ in range(3):\n        reference_rmsnorm(x, w, eps)\n"
    findings, misses = detect_all(PATTERN, code)
    assert not findings
    assert any(m.qualname == "reference_rmsnorm" and m.reason.startswith("reference implementation") for m in misses)


def test_reference_whose_result_is_only_printed_is_a_site() -> None:
    # no closeness check reads the result: nothing shows it is a test reference
    code = rms._S28_REFERENCE.replace("    assert torch.allclose(got, want, atol=1e-2)\n", "    print(got, want)\n")
    findings, _ = detect_all(PATTERN, code)
    assert [f.qualname for f in findings] == ["reference_rmsnorm"]
