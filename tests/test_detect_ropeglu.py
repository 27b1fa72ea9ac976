"""Issue 14 for rope / swiglu / geglu (classes 2, 6, 7), beyond the patterns' own examples.

Class 7: a site inside a ``@torch.jit.script`` function is rewritten as a whole definition at
module level (npufuse.patterns._compiled): the rewritten file is imported from disk (TorchScript
reads the source) with and without the emulated torch_npu, the scripted original stays compiled
and is what runs off the NPU or with the switch off, and revert gives the file back.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from npufuse import emulate
from npufuse.patterns.base import Finding, NearMiss
from npufuse.patterns.registry import get_pattern
from npufuse.rewrite.codegen import splice
from npufuse.rewrite.transform import revert_source
from npufuse.scan.dataflow import ModuleInfo


def _detect(pattern_id: str, code: str) -> tuple[list[Finding], list[NearMiss]]:
    p = get_pattern(pattern_id)
    m = ModuleInfo.from_source("m.py", code)
    out = [r for s in m.scopes for r in p.detect(m, s)]
    return [r for r in out if isinstance(r, Finding)], [r for r in out if isinstance(r, NearMiss)]


def _import(tmp_path: Path, name: str, text: str):
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


SCRIPTED_ROPE = '''import torch


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=x1.ndim - 1)


@torch.jit.script
def apply_rotary(q, k, cos, sin, offset: int = 0):
    """Rotate q and k [S, B, H, D] by the cached angles from ``offset``."""
    cos, sin = (
        cos[offset : q.shape[0] + offset, ...],
        sin[offset : q.shape[0] + offset, ...],
    )
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def attention_scores(q, k, cos, sin):
    q, k = apply_rotary(q, k, cos, sin, 1)
    return q @ k.transpose(-1, -2)
'''


def _inputs():
    torch.manual_seed(0)
    q, k = torch.randn(5, 2, 3, 8), torch.randn(5, 2, 3, 8)
    cos, sin = torch.randn(9, 1, 1, 8), torch.randn(9, 1, 1, 8)
    return q, k, cos, sin


def test_scripted_rope_is_one_module_level_site():
    findings, misses = _detect("rope", SCRIPTED_ROPE)
    assert [(f.qualname, f.line, f.end_line, f.params["lifted_from"]) for f in findings] == [("<module>", 10, 16, "apply_rotary")]
    assert not [m for m in misses if "TorchScript" in m.reason]
    assert any("@torch.jit.script" in r.detail for r in findings[0].risks)


def test_rewritten_file_compiles_with_and_without_torch_npu(tmp_path, monkeypatch):
    findings, _ = _detect("rope", SCRIPTED_ROPE)
    rewritten = splice(SCRIPTED_ROPE, findings)
    q, k, cos, sin = _inputs()
    want = _import(tmp_path, "original_rope", SCRIPTED_ROPE).attention_scores(q, k, cos, sin)

    plain = _import(tmp_path, "rewritten_rope_cpu", rewritten)  # no torch_npu: the original definition
    assert isinstance(plain.apply_rotary, torch.jit.ScriptFunction)
    assert not hasattr(plain, "_npufuse_scripted_apply_rotary")
    assert torch.equal(plain.attention_scores(q, k, cos, sin), want)

    with emulate.install() as emu:
        mod = _import(tmp_path, "rewritten_rope_npu", rewritten)
        assert isinstance(mod._npufuse_scripted_apply_rotary, torch.jit.ScriptFunction)  # still compiles
        assert not isinstance(mod.apply_rotary, torch.jit.ScriptFunction)
        assert mod.apply_rotary.__doc__ == "Rotate q and k [S, B, H, D] by the cached angles from ``offset``."
        got = mod.attention_scores(q, k, cos, sin)
        assert emu.calls.get("npu_rotary_mul", 0) == 2
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # switched off: the scripted original runs, bit for bit
        monkeypatch.setenv("NPUFUSE_ROPE", "0")
        before = dict(emu.calls)
        assert torch.equal(mod.attention_scores(q, k, cos, sin), want)
        assert dict(emu.calls) == before
        monkeypatch.delenv("NPUFUSE_ROPE")
        # a tensor off the NPU: the scripted original (undone before the emulator is removed: a
        # monkeypatch undone at teardown would put the emulator's `is_npu` back on torch.Tensor)
        with monkeypatch.context() as mp:
            mp.setattr(torch.Tensor, "is_npu", property(lambda self: False))
            assert torch.equal(mod.attention_scores(q, k, cos, sin), want)
            assert dict(emu.calls) == before


def test_revert_gives_the_scripted_file_back():
    findings, _ = _detect("rope", SCRIPTED_ROPE)
    rewritten = splice(SCRIPTED_ROPE, findings)
    assert revert_source(rewritten).text == SCRIPTED_ROPE


def test_keyword_only_parameters_are_forwarded(tmp_path):
    code = SCRIPTED_ROPE.replace("def apply_rotary(q, k, cos, sin, offset: int = 0):",
                                 "def apply_rotary(q, k, cos, sin, *, offset: int):").replace(
                                 "apply_rotary(q, k, cos, sin, 1)", "apply_rotary(q, k, cos, sin, offset=1)")
    findings, _ = _detect("rope", code)
    assert "_npufuse_scripted_apply_rotary(q, k, cos, sin, offset=offset)" in findings[0].fused
    q, k, cos, sin = _inputs()
    want = _import(tmp_path, "kw_original", code).attention_scores(q, k, cos, sin)
    with emulate.install():
        mod = _import(tmp_path, "kw_rewritten", splice(code, findings))
        with torch.no_grad():
            torch.testing.assert_close(mod.attention_scores(q, k, cos, sin), want, rtol=1e-5, atol=1e-5)
        mod._npufuse_scripted_apply_rotary(q, k, cos, sin, offset=1)  # the compiled original keeps its signature


def test_method_of_a_scripted_class_is_still_refused():
    code = '''import torch
import torch.nn as nn
import torch.nn.functional as F


class GLU(nn.Module):
    def forward(self, h):
        a, b = h.chunk(2, dim=-1)
        return F.silu(a) * b


scripted = torch.jit.script(GLU())
'''
    findings, misses = _detect("swiglu", code)
    assert not findings
    assert any("TorchScript compiles `GLU (passed to torch.jit.script)`" in m.reason for m in misses)


def test_refused_lift_says_why():
    code = SCRIPTED_ROPE + '''

@torch.jit.script
def scores(q, k, cos, sin):
    q, k = apply_rotary(q, k, cos, sin)
    return q @ k.transpose(-1, -2)
'''
    findings, misses = _detect("rope", code)
    assert not findings
    (m,) = [m for m in misses if "TorchScript" in m.reason]
    assert "compiled code (`scores`) calls it" in m.reason


def _rope_example(name: str):
    p = get_pattern("rope")
    return next(e for e in p.FUSE if e.name == name)


def test_lambda_rope_with_merged_batch_heads_over_the_op_limit_runs_the_original():
    """[(b h), n, d] tokens lifted to [1, b*h, n, d]: interleave mode takes B*N < 1000, so a merged
    batch*heads of 1200 must not reach npu_rotary_mul (the emulator rejects it as the op does)."""
    from pattern_harness import _exec

    ex = _rope_example("rotation_in_a_mapped_lambda")
    findings, _ = _detect("rope", ex.code)
    rewritten = splice(ex.code, findings)
    run = '''
torch.manual_seed(0)
q = torch.randn({bh}, 5, 12)
k = torch.randn({bh}, 5, 12)
ang = torch.randn(1, 4, 4).repeat_interleave(2, dim=-1)
out = rotate_tokens(q, k, (ang.sin(), ang.cos()))
'''
    for bh, calls in ((1200, 0), (96, 2)):
        ref = _exec(ex.code, "orig")
        exec(run.format(bh=bh), ref)
        with emulate.install() as emu:
            ns = _exec(rewritten, "rewritten")
            exec(run.format(bh=bh), ns)
        assert emu.calls.get("npu_rotary_mul", 0) == calls
        for a, b in zip(ref["out"], ns["out"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


MERGED_HEADS_HALF = '''import torch


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(t, cos, sin):
    return t * cos + rotate_half(t) * sin
'''


def test_lifted_half_mode_keeps_the_op_limits():
    """x [(b h), n, d] with tables [n, d]: lifted to [1, b*h, n, d] / [1, 1, n, d] (BNSD, N = b*h);
    half mode takes B < 1000 and N < 1000, so b*h = 1200 runs the original code and 96 the op.
    A token layout [T, N, D] with tables [T, 1, D] (BSND) may have T >= 1000."""
    from pattern_harness import _exec

    findings, _ = _detect("rope", MERGED_HEADS_HALF)
    rewritten = splice(MERGED_HEADS_HALF, findings)
    cases = [((1200, 5, 16), (5, 16), 0), ((96, 5, 16), (5, 16), 1), ((1500, 4, 16), (1500, 1, 16), 1), ((1500, 1200, 16), (1500, 1, 16), 0)]
    for xs, cs, calls in cases:
        torch.manual_seed(0)
        t, cos, sin = torch.randn(*xs), torch.randn(*cs), torch.randn(*cs)
        want = _exec(MERGED_HEADS_HALF, "orig")["apply_rotary"](t, cos, sin)
        with emulate.install() as emu:
            got = _exec(rewritten, "rewritten")["apply_rotary"](t, cos, sin)
        assert emu.calls.get("npu_rotary_mul", 0) == calls, (xs, cs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_decorator_from_another_module_is_a_stated_risk():
    """`@jit_fuser` imported from elsewhere may be torch.jit.script: not visible here, so the finding
    stays and says so; torch's own decorators say nothing."""
    body = "\ndef glu(y):\n    a, b = torch.chunk(y, 2, -1)\n    return F.silu(a) * b\n"
    head = "import torch\nimport torch.nn.functional as F\n"
    imported, _ = _detect("swiglu", head + "from mylib.jit import jit_fuser\n\n\n@jit_fuser" + body)
    assert any("decorated with `@jit_fuser` from another module" in r.detail for r in imported[0].risks)
    plain, _ = _detect("swiglu", head + "\n\n@torch.no_grad()" + body)
    assert not any("from another module" in r.detail for r in plain[0].risks)
