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


def test_branch_chain_repeats_the_statements_between_once_per_path() -> None:
    from npufuse.patterns.swiglu import _S28_BRANCH_ACT

    findings, _ = detect_all(Swiglu(), _S28_BRANCH_ACT)
    f = next(f for f in findings if f.qualname == "MLP.forward")
    lines = f.fused.splitlines()
    # every arm and the no-arm path project `up` exactly once, after the test that chose it
    assert [ln.strip() for ln in lines].count("up = self.up_proj.forward(x)") == 4
    assert lines[0] == 'if self.act == "silu":' and lines[-3].startswith("else:")
    assert lines[-1].strip() == "y *= up"  # no arm taken: the original product (y unbound, as before)
    assert f.params["dispatches_to"] == ["geglu", "swiglu"]


def test_branch_chain_gelu_only_is_filed_under_geglu() -> None:
    from npufuse.patterns.swiglu import _S28_BRANCH_ACT

    code = _S28_BRANCH_ACT.split("def mlp_fallback")[0].replace("y = F.silu(gate)", "y = F.gelu(gate)")
    assert not detect_all(Swiglu(), code)[0]
    (f,) = detect_all(Geglu(), code)[0]
    assert f.params["branch_kinds"] == ["gelu", "gelu_tanh"]
    assert "approximate=0" in f.fused and "approximate=1" in f.fused


def test_branch_chain_with_the_gate_rebound_between_is_left_alone() -> None:
    from npufuse.patterns.swiglu import _S28_BRANCH_ACT

    code = _S28_BRANCH_ACT.split("def mlp_fallback")[0].replace(
        "        up = self.up_proj.forward(x)\n", "        up = self.up_proj.forward(x)\n        gate = gate * 2\n")
    assert not [f for f in detect_all(Swiglu(), code)[0] if f.params.get("activation") == "branch"]


def test_glu_kernel_is_fused_under_a_shape_check_with_a_stated_risk() -> None:
    from npufuse.patterns.swiglu import _S28_GLU_KERNEL

    findings, _ = detect_all(Swiglu(), _S28_GLU_KERNEL)
    f = next(f for f in findings if f.qualname == "SwiGLUActivation.forward")
    assert f.fused.splitlines()[0] == "if x2.shape == x1.shape:"
    assert any("callers npufuse cannot see" in r.detail for r in f.risks)
