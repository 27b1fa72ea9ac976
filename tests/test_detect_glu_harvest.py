"""GLU spellings harvested from fifteen repositories npufuse had not seen (issue 14; helper
session glu, s25): activations computed in fp32 and cast back, projections through identity hook
modules or written as matmul plus bias, activations set by a base class in another file or held
by a local callable, ``t *= a`` products, hand-written autograd Functions that keep the
activation, and forwards a jit-scripted subclass inherits. The examples live in the pattern files
(names starting ``harvest_``) and run, like every example, in tests/test_patterns.py: detection with
parameters, near-miss reasons, and every Fuse example rewritten and run under the emulator. This
file checks the harvest classes all have examples, plus facts about particular rewrites."""

from __future__ import annotations

import ast

import pytest

from npufuse.patterns import _compiled
from npufuse.patterns import swiglu as W
from npufuse.patterns.geglu import Geglu
from npufuse.patterns.swiglu import Swiglu
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import check_rewrite_runs, detect_all, example_cases

_PATTERNS = (Swiglu(), Geglu())


def test_every_harvest_class_has_examples() -> None:
    # detection, reasons and the emulator rewrite of each example run in test_patterns.py
    # (pytest tests/test_patterns.py -k harvest_); this file checks the classes are all there
    cases = example_cases(_PATTERNS, "harvest_", "fuse") + example_cases(_PATTERNS, "harvest_", "keep")
    names = {c.values[1].name for c in cases}
    for word in ("cast", "hook", "inherited", "local_callable", "augment", "bias", "autograd", "scripted"):
        assert any(word in n for n in names), word
    assert example_cases(_PATTERNS, "harvest_", "run"), "no harvest example is run under the emulator"


def test_fused_branch_keeps_the_gate_dtype_for_a_cast_back_activation() -> None:
    """The fused op takes the gate itself, not its fp32 copy: in bf16 the output stays bf16."""
    ex = next(e for e in Swiglu.FUSE if e.name == "harvest_activation_cast_back_with_to_dtype")
    findings, _ = detect_all(Swiglu(), ex.code)
    facts = check_rewrite_runs(Swiglu(), ex.code, ex.run, findings)
    assert "torch.cat([g, self.w3(x)]" in facts["rewritten"]
    assert "g.float()" not in facts["rewritten"].split("npu_swiglu")[1].split("\n")[0]


def test_augmented_product_rewritten_as_a_rebinding() -> None:
    ex = next(e for e in Swiglu.FUSE if e.name == "harvest_product_as_augmented_assignment_after_an_in_place_activation")
    findings, _ = detect_all(Swiglu(), ex.code)
    facts = check_rewrite_runs(Swiglu(), ex.code, ex.run, findings)
    assert "b = torch_npu.npu_swiglu(torch.cat([a, b], dim=-1), dim=-1)" in facts["rewritten"]
    assert facts["all_calls"].get("npu_swiglu") == 3  # two chunks of the loop, then forward_up_first


def test_scripted_bases_follow_the_class_chain() -> None:
    code = (
        "import torch\nfrom torch import nn\n\n"
        "class A(nn.Module):\n    def forward(self, x):\n        return x\n\n"
        "class B(A):\n    pass\n\n"
        "class C(B):\n    pass\n\n"
        "class D(nn.Module):\n    pass\n\n"
        "c = torch.jit.script(C())\n"
    )
    module = ModuleInfo.from_source("m.py", code)
    assert _compiled._scripted_bases(module, {"C"}) == {"A", "B"}
    scope = next(s for s in module.scopes if s.qualname == "A.forward")
    assert "TorchScript compiles" in (_compiled.compiled_reason(module, scope) or "")


@pytest.mark.parametrize("src,expected", [
    ("x @ w.transpose(-2, -1) + b", "x @ w.transpose(-2, -1)"),
    ("b + F.linear(x, w)", "F.linear(x, w)"),
    ("x @ w + self.bias", "x @ w"),
    ("x @ w + x", "x @ w + x"),  # the projection's own input: a residual
    ("x @ w + y * 2", "x @ w + y * 2"),
    ("x @ w + local", "x @ w + local"),  # a local: not known to be a bias
])
def test_biased_projection(src: str, expected: str) -> None:
    code = f"import torch.nn.functional as F\n\ndef f(x, w, b, y):\n    local = y + 1\n    return {src}\n"
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "f")
    ret = scope.node.body[-1].value
    got = W._biased_projection(ret, W.S.Ctx(scope, ret.lineno))
    assert ast.unparse(got) == expected


@pytest.mark.parametrize("src,kind", [
    ("get_activation_fn(activation='gelu')", "gelu"),
    ("get_activation_fn('swish')", "silu"),
    ("get_activation_fn(activation=name)", "config"),
    ("get_activation_fn()", None),
])
def test_activation_getter_named_by_keyword(src: str, kind: str | None) -> None:
    module = ModuleInfo.from_source("m.py", "name = 'x'\n")
    got = W._module_act(module, ast.parse(src, mode="eval").body)
    assert (got[0] if got else None) == kind
