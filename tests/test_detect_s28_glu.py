"""s28 glu classes (held-out 5 misses): what is emitted for weight objects' ``.mm`` and for a split at a
symbolic size. The examples in swiglu.py / geglu.py run end to end under the emulator; these pin the
guards and the refusals."""

from __future__ import annotations

from npufuse.patterns.geglu import Geglu
from npufuse.patterns.swiglu import _S28_SPLIT_AT, _S28_WEIGHT_MM, Swiglu
from tests.pattern_harness import detect_all


def test_weight_objects_mm_shared_input_is_a_two_projection_glu() -> None:
    findings, _ = detect_all(Swiglu(), _S28_WEIGHT_MM)
    assert len(findings) == 1
    assert "torch.cat([gate, up], dim=-1)" in findings[0].fused


def test_weight_objects_mm_gelu_is_geglu_not_swiglu() -> None:
    code = _S28_WEIGHT_MM.replace("out = F.silu(gate) * up", 'out = F.gelu(gate, approximate="tanh") * up')
    assert not detect_all(Swiglu(), code)[0]
    (f,) = detect_all(Geglu(), code)[0]
    assert f.params["approximate"] == 1 and f.params["activate_left"] is True


def test_weight_on_the_left_of_one_and_the_right_of_the_other_is_refused() -> None:
    # `W1.mm(x)` against `x.mm(W3)`: the shared operand rule needs state on one side of both
    code = _S28_WEIGHT_MM.replace("up = layer_weight.up_proj.mm(hidden.view(-1, self.embed_dim))",
                                  "up = hidden.view(-1, self.embed_dim).mm(layer_weight.up_proj.weight)")
    findings, misses = detect_all(Swiglu(), code)
    assert not findings
    assert any("not projections of one input" in m.reason for m in misses)


def test_split_at_symbolic_index_checks_halves_before_the_fused_op() -> None:
    (f,) = detect_all(Swiglu(), _S28_SPLIT_AT)[0]
    lines = f.fused.splitlines()
    assert lines[0] == "if x.shape[-1] == 2 * (self.up_proj_dim):"
    assert "else:" in lines[2] and "tensor_split" in lines[3]
    assert not any(r.kind == "layout" for r in f.risks)


def test_split_by_symbolic_size_checks_halves() -> None:
    code = _S28_SPLIT_AT.replace("torch.tensor_split(x, (self.up_proj_dim,), dim=-1)", "x.split(self.up_proj_dim, dim=-1)")
    (f,) = detect_all(Swiglu(), code)[0]
    assert f.fused.splitlines()[0] == "if x.shape[-1] == 2 * (self.up_proj_dim):"


def test_split_of_an_inline_projection_keeps_the_stated_risk() -> None:
    # the split tensor is computed in the statement: checking its shape first would compute it twice
    code = _S28_SPLIT_AT.replace("        x = self.proj_up_gate_z(x)\n", "").replace(
        "torch.tensor_split(x, (self.up_proj_dim,), dim=-1)", "torch.tensor_split(self.proj_up_gate_z(x), (self.up_proj_dim,), dim=-1)")
    (f,) = detect_all(Swiglu(), code)[0]
    assert not f.fused.startswith("if ")
    assert any(r.kind == "layout" and "symbolic size" in r.detail for r in f.risks)
