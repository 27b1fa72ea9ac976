"""Rules every pattern's results pass through (patterns/base.py, issue 14 class 7): no finding in
TorchScript-compiled code, and no replacement that calls a module more often than the original."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from npufuse.patterns.base import Finding, NearMiss, Pattern
from npufuse.rewrite.codegen import splice
from npufuse.scan.dataflow import ModuleInfo


class _Echo(Pattern):
    """A fake pattern: one finding per ``forward`` with the fused text the test gives."""

    id = "swiglu"
    api = "torch_npu.npu_swiglu"
    title = "fake"
    fused = ""

    def detect(self, module, scope):
        if scope.qualname.endswith("forward"):
            stmt = scope.node.body[-1]
            yield Finding("swiglu", scope.qualname, stmt.lineno, stmt.end_lineno, {}, self.fused, "x")


CODE = '''
import torch
import torch.nn.functional as F


class FFN(torch.nn.Module):
    def forward(self, x):
        return F.silu(self.w1(x)) * self.w3(x)
'''


def _results(code: str, fused: str) -> list:
    p = _Echo()
    p.fused = fused
    m = ModuleInfo.from_source("m.py", code)
    return [r for s in m.scopes for r in p.detect(m, s)]


def test_a_module_call_made_twice_is_a_near_miss():
    (r,) = _results(CODE, "h = self.w1(x)\nreturn torch_npu.npu_swiglu(torch.cat((self.w1(x), self.w3(x)), -1))")
    assert isinstance(r, NearMiss) and "`self.w1(x)` more often" in r.reason


def test_once_per_branch_is_once():
    fused = "if x.dim() == 2:\n    return torch_npu.npu_swiglu(torch.cat((self.w1(x), self.w3(x)), -1))\nelse:\n    return F.silu(self.w1(x)) * self.w3(x)"
    (r,) = _results(CODE, fused)
    assert isinstance(r, Finding)


def test_torchscript_method_of_a_scripted_class_is_a_near_miss():
    code = CODE + "\n\nscripted = torch.jit.script(FFN())\n"
    (r,) = _results(code, "return torch_npu.npu_swiglu(torch.cat((self.w1(x), self.w3(x)), -1))")
    assert isinstance(r, NearMiss) and "TorchScript compiles `FFN (passed to torch.jit.script)`" in r.reason


def test_jit_ignore_stays_python():
    code = CODE.replace("    def forward", "    @torch.jit.ignore\n    def forward") + "\n\nscripted = torch.jit.script(FFN())\n"
    (r,) = _results(code, "return torch_npu.npu_swiglu(torch.cat((self.w1(x), self.w3(x)), -1))")
    assert isinstance(r, Finding)


def test_the_rewrite_the_rule_prevents_really_fails_to_import(tmp_path):
    # the fact the near-miss reason states: a guarded rewrite inside @torch.jit.script does not import
    from npufuse.patterns.registry import get_pattern

    code = '''import torch


@torch.jit.script
def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
'''
    m = ModuleInfo.from_source("m.py", code)
    raw = type(get_pattern("rms_norm")).detect.__wrapped__  # the detector without the rule
    findings = [r for s in m.scopes for r in raw(get_pattern("rms_norm"), m, s) if isinstance(r, Finding)]
    assert findings
    path = tmp_path / "rewritten_mod.py"
    path.write_text(splice(code, findings))
    spec = importlib.util.spec_from_file_location("rewritten_mod", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["rewritten_mod"] = mod
    try:
        with pytest.raises(RuntimeError, match="torch_npu"):
            spec.loader.exec_module(mod)  # type: ignore[union-attr]
    finally:
        sys.modules.pop("rewritten_mod", None)
