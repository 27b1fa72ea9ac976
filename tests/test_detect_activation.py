"""Issue 14, classes 6 and 7 for the activation patterns (swiglu / geglu), run end to end: the
rewritten file is executed, not only read.

* Class 7: a rewrite never goes inside TorchScript-compiled code (the fused branch does not
  compile there); the rest of the same file is rewritten, the file still imports with
  ``torch.jit.script`` really compiling its functions, and code that ``torch.compile`` traces
  runs through the fused branch. A gate projection split into gate/up is evaluated once per
  call in both branches of the rewritten code.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from npufuse import emulate
from npufuse.patterns.base import Finding, NearMiss
from npufuse.patterns.registry import get_pattern
from npufuse.rewrite.codegen import splice
from npufuse.scan.dataflow import ModuleInfo


def _detect(pattern_id: str, code: str) -> tuple[list[Finding], list[NearMiss]]:
    p = get_pattern(pattern_id)
    m = ModuleInfo.from_source("m.py", code)
    out = [r for s in m.scopes for r in p.detect(m, s)]
    return [r for r in out if isinstance(r, Finding)], [r for r in out if isinstance(r, NearMiss)]


def _import(tmp_path: Path, name: str, text: str):
    """Import ``text`` as a real module file (TorchScript reads the source from the file)."""
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    finally:
        sys.modules.pop(name, None)
    return mod


SCRIPTED = '''import torch
import torch.nn as nn
import torch.nn.functional as F


@torch.jit.script
def scripted_glu(h: torch.Tensor) -> torch.Tensor:
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b


def plain_glu(h):
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b


def helper(h: torch.Tensor) -> torch.Tensor:
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b


compiled_helper = torch.jit.script(helper)
'''


def test_scripted_functions_stay_untouched_and_the_rewritten_file_scripts(tmp_path):
    findings, misses = _detect("swiglu", SCRIPTED)
    # the @torch.jit.script function is rewritten as a whole at module level (patterns/_compiled.py:
    # scripted original renamed, Python wrapper of its name); the function passed to
    # torch.jit.script(helper) stays untouched
    assert [(f.qualname, f.params.get("lifted_from")) for f in findings] == [("<module>", "scripted_glu"), ("plain_glu", None)]
    assert sorted(m.qualname for m in misses if "TorchScript compiles" in m.reason) == ["helper"]
    rewritten = splice(SCRIPTED, findings)
    assert "npu_swiglu" in rewritten
    with emulate.install() as emu:
        mod = _import(tmp_path, "rewritten_scripted", rewritten)  # torch.jit.script runs at import
        h = torch.randn(3, 8)
        assert isinstance(mod._npufuse_scripted_scripted_glu, torch.jit.ScriptFunction)
        assert isinstance(mod.compiled_helper, torch.jit.ScriptFunction)
        want = torch.nn.functional.silu(h[:, :4]) * h[:, 4:]
        for fn in (mod.scripted_glu, mod.compiled_helper, mod.plain_glu):
            torch.testing.assert_close(fn(h), want)
        assert emu.calls.get("npu_swiglu", 0) == 2  # plain_glu and the scripted_glu wrapper took the fused branch
    plain = _import(tmp_path, "rewritten_scripted_cpu", rewritten)  # without torch_npu: the original, scripted
    assert isinstance(plain.scripted_glu, torch.jit.ScriptFunction)


def test_the_rule_is_what_keeps_the_scripted_file_importable(tmp_path):
    # without the rule the scripted function is rewritten too, and the file no longer imports
    p = get_pattern("swiglu")
    m = ModuleInfo.from_source("m.py", SCRIPTED)
    raw = type(p).detect.__wrapped__
    findings = [r for s in m.scopes for r in raw(p, m, s) if isinstance(r, Finding)]
    assert {f.qualname for f in findings} >= {"scripted_glu", "plain_glu"}
    with emulate.install(), pytest.raises(Exception, match="torch_npu|_npufuse"):
        _import(tmp_path, "rewritten_unruled", splice(SCRIPTED, findings))


FFN = '''import torch
import torch.nn as nn
import torch.nn.functional as F


class FFN(nn.Module):
    def __init__(self, d=8, h=16):
        super().__init__()
        self.w12 = nn.Linear(d, 2 * h, bias=False)
        self.w3 = nn.Linear(h, d, bias=False)

    def forward(self, x):
{body}
'''

SPLITS = {
    "chunk": "        x1, x2 = self.w12(x).chunk(2, dim=-1)\n        return self.w3(F.silu(x1) * x2)",
    "split": "        x1, x2 = torch.split(self.w12(x), self.w3.in_features, dim=-1)\n        return self.w3(F.silu(x1) * x2)",
    "inline_chunk": "        h = self.w12(x)\n        return self.w3(F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1])",
    "second_half_gate": "        x1, gate = self.w12(x).chunk(2, dim=-1)\n        return self.w3(x1 * F.silu(gate))",
}


@pytest.mark.parametrize("form", sorted(SPLITS))
def test_the_gate_projection_runs_once_in_both_branches(form, tmp_path):
    code = FFN.format(body=SPLITS[form])
    findings, misses = _detect("swiglu", code)
    assert findings, [m.reason for m in misses]
    rewritten = splice(code, findings)
    for fused in (False, True):
        torch.manual_seed(0)
        if fused:
            with emulate.install() as emu:
                mod = _import(tmp_path, f"ffn_{form}_fused", rewritten)
                out, calls = _count_w12(mod.FFN())
            assert emu.calls.get("npu_swiglu", 0) >= 1
        else:
            mod = _import(tmp_path, f"ffn_{form}_orig", rewritten)  # no torch_npu: the original branch
            out, calls = _count_w12(mod.FFN())
        assert calls == 1, f"{form}: self.w12 ran {calls} times in the {'fused' if fused else 'original'} branch"
        torch.manual_seed(0)
        ref, ref_calls = _count_w12(_import(tmp_path, f"ffn_{form}_ref", code).FFN())
        assert ref_calls == 1
        torch.testing.assert_close(out, ref)


def _count_w12(model: torch.nn.Module) -> tuple[torch.Tensor, int]:
    calls = []
    model.w12.register_forward_hook(lambda *_: calls.append(1))
    torch.manual_seed(1)
    out = model(torch.randn(2, 3, 8))
    return out, len(calls)


def test_torch_compiled_code_runs_the_fused_branch(tmp_path):
    code = FFN.format(body=SPLITS["chunk"]) + "\n\nmodel = FFN()\ncompiled = torch.compile(model, backend='eager')\n"
    findings, _ = _detect("swiglu", code)
    assert findings  # torch.compile traces Python: the guarded branch is ordinary code there
    torch.manual_seed(0)
    ref = _import(tmp_path, "compiled_ref", code)
    x = torch.randn(2, 3, 8)
    want = ref.model(x)
    torch.manual_seed(0)
    with emulate.install() as emu:
        mod = _import(tmp_path, "compiled_fused", splice(code, findings))
        torch._dynamo.reset()
        got = mod.compiled(x)
    torch.testing.assert_close(got, want)
    assert emu.calls.get("npu_swiglu", 0) >= 1


def test_the_call_count_sees_a_projection_evaluated_twice(tmp_path):
    # the measure above can fail: a fused branch that evaluates self.w12(x) twice is counted twice
    code = FFN.format(body=SPLITS["chunk"])
    (f,) = _detect("swiglu", code)[0]
    twice = Finding(f.pattern, f.qualname, f.line, f.end_line, f.params,
                    "x1 = self.w12(x).chunk(2, dim=-1)[0]\nx2 = self.w12(x).chunk(2, dim=-1)[1]\n"
                    "return self.w3(torch_npu.npu_swiglu(torch.cat((x1, x2), -1)))\n", f.guard_tensor)
    with emulate.install():
        mod = _import(tmp_path, "ffn_twice", splice(code, [twice]))
        _, calls = _count_w12(mod.FFN())
    assert calls == 2


# -- class 6: activations chosen by configuration (run-time dispatch) ---------------------------


def test_a_configured_activation_the_fused_ops_lack_runs_the_original_code() -> None:
    """get_activation(...) may return relu: the fused branch must leave it to the original
    code (exact output, no torch_npu call), and fuse the silu/gelu choices."""
    sys.path.insert(0, str(Path(__file__).parent))
    from pattern_harness import check_rewrite_runs

    from npufuse.patterns.swiglu import _GET_ACTIVATION, _RUN_GET_ACTIVATION

    findings, _ = _detect("swiglu", _GET_ACTIVATION)
    assert len(findings) == 1 and findings[0].confidence == "medium"
    pattern = get_pattern("swiglu")
    relu = check_rewrite_runs(pattern, _GET_ACTIVATION, _RUN_GET_ACTIVATION.format(act="relu"), findings)
    assert relu["calls"] == 0 and min(relu["cos_out"]) > 0.99999
    silu = check_rewrite_runs(pattern, _GET_ACTIVATION, _RUN_GET_ACTIVATION.format(act="swiglu"), findings)
    assert silu["all_calls"].get("npu_swiglu", 0) >= 1
    gelu = check_rewrite_runs(pattern, _GET_ACTIVATION, _RUN_GET_ACTIVATION.format(act="geglu"), findings)
    assert gelu["all_calls"].get("npu_geglu", 0) >= 1 and min(gelu["cos_out"]) > 0.9999


def test_a_helper_returning_one_activation_is_resolved_statically() -> None:
    code = '''
import torch.nn.functional as F
from torch import nn


def get_activation(name):
    return F.silu, name == "swiglu"


class GatedMLP(nn.Module):
    def __init__(self, args, d, h):
        super().__init__()
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.act, self.is_gated = get_activation(args.activation)

    def forward(self, x):
        return self.act(self.gate(x)) * self.up(x)
'''
    findings, _ = _detect("swiglu", code)
    assert len(findings) == 1 and findings[0].confidence == "high" and "elif" not in findings[0].fused


# -- class 6: objects from imported builders, partial objects, defaults through callers --------


def _harness():
    sys.path.insert(0, str(Path(__file__).parent))
    from pattern_harness import check_rewrite_runs

    return check_rewrite_runs


def test_an_imported_builders_object_dispatches_at_run_time() -> None:
    """Nothing in the file says what ``self.act = copy.deepcopy(act)`` is: silu runs npu_swiglu,
    gelu npu_geglu, relu the original code exactly (no torch_npu call)."""
    from npufuse.patterns.swiglu import _BUILT_ACT, _RUN_BUILT_ACT

    check = _harness()
    findings, _ = _detect("swiglu", _BUILT_ACT)
    assert len(findings) == 1 and findings[0].params.get("conditional") is True
    pattern = get_pattern("swiglu")
    relu = check(pattern, _BUILT_ACT, _RUN_BUILT_ACT.format(act="nn.ReLU()"), findings)
    assert relu["calls"] == 0 and min(relu["cos_out"]) > 0.99999
    silu = check(pattern, _BUILT_ACT, _RUN_BUILT_ACT.format(act="nn.SiLU()"), findings)
    assert silu["all_calls"].get("npu_swiglu", 0) >= 1
    gelu = check(pattern, _BUILT_ACT, _RUN_BUILT_ACT.format(act="nn.GELU()"), findings)
    assert gelu["all_calls"].get("npu_geglu", 0) >= 1


@pytest.mark.parametrize("act,fused", [
    ("partial(F.gelu, approximate='tanh')", "npu_geglu"),
    ("partial(F.gelu)", "npu_geglu"),
    ("partial(F.silu)", "npu_swiglu"),
    # bound differently: not what the fused ops compute, so the original code runs
    ("partial(F.silu, inplace=True)", None),
    ("partial(F.leaky_relu, negative_slope=0.2)", None),
])
def test_partial_objects_are_recognised_at_run_time(act: str, fused: str | None) -> None:
    from npufuse.patterns.geglu import _CALLER_DEFAULT, _RUN_CALLER_DEFAULT

    check = _harness()
    findings, _ = _detect("geglu", _CALLER_DEFAULT)
    assert len(findings) == 1
    facts = check(get_pattern("geglu"), _CALLER_DEFAULT, _RUN_CALLER_DEFAULT.format(arg=f"activation_fn={act}"), findings)
    if fused is None:
        assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.99999
    else:
        assert facts["all_calls"].get(fused, 0) >= 1 and min(facts["cos_out"]) > 0.9999


@pytest.mark.parametrize("default,pattern_id", [
    ('partial(F.gelu, approximate="tanh")', "geglu"),
    ("F.gelu", "geglu"),
    ("partial(F.silu)", "swiglu"),
    ("F.silu", "swiglu"),
])
def test_the_default_handed_down_by_the_modules_constructors_picks_the_pattern(default: str, pattern_id: str) -> None:
    from npufuse.patterns.geglu import _CALLER_DEFAULT

    code = _CALLER_DEFAULT.replace('DEFAULT_ACTIVATION_FN = partial(F.gelu, approximate="tanh")', f"DEFAULT_ACTIVATION_FN = {default}")
    other = "swiglu" if pattern_id == "geglu" else "geglu"
    assert len(_detect(pattern_id, code)[0]) == 1
    assert _detect(other, code)[0] == []


def test_a_resolver_default_naming_silu_reports_swiglu_for_the_inherited_attribute() -> None:
    from npufuse.patterns.geglu import _INHERITED_ACT

    code = _INHERITED_ACT.replace('{"name": "gelu", "approximate": "none"}', '{"name": "silu"}')
    assert len(_detect("swiglu", code)[0]) == 1 and _detect("geglu", code)[0] == []
    assert len(_detect("geglu", _INHERITED_ACT)[0]) == 1


def test_a_dtype_cast_on_the_activation_is_not_peeled_like_a_device_move() -> None:
    from npufuse.patterns.geglu import _INHERITED_ACT

    code = _INHERITED_ACT.replace(".to(device=x.device)", ".to(torch.float16)")
    assert _detect("geglu", code)[0] == [] and _detect("swiglu", code)[0] == []


def test_sized_split_parts_of_unequal_sizes_say_which_sizes() -> None:
    from npufuse.patterns.swiglu import _SIZED_SPLIT

    code = _SIZED_SPLIT.replace("F.silu(z0) * x0", "F.silu(z) * x0")
    findings, misses = _detect("swiglu", code)
    assert findings == []
    assert any("sizes self.d_ssm and d_mlp" in m.reason for m in misses)
