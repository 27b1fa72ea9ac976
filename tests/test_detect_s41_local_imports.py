"""s41 (helper local41): names imported inside a function resolve like module-level imports (issue 14).

Research code imports inside the method that uses the name: ``if cfg.use_rms: from .layers import RMSNorm`` in
``__init__`` (HO17a vjsingh1984 mamba.py), ``try: from flash_attn import f as attn / except ImportError: from
torch.nn.functional import scaled_dot_product_attention as attn`` in ``forward``. ``bound_callee`` read only
module-level bindings and the foreign-definition lookup only top-level relative imports, so such a class or function
was unknown. Now a function's own imports (in either ``if`` arm, under ``try``), then an enclosing function's, are
read first (Python's scoping rule), each member with the condition it is bound under; a name imported differently
on two paths keeps both members, fused only under a run-time identity / class test."""

from __future__ import annotations

import ast
from pathlib import Path

from apply_support import make_repo, scan
from pattern_harness import detect_all

from npufuse.scan import bound_callee
from npufuse.scan.dataflow import ModuleInfo

_RMS = '''\
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        {body}
'''

_RMS_BODY = "rms = torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + self.eps)\n        return x / rms * self.weight"
_MEAN_BODY = ("x = x - x.mean(-1, keepdim=True)\n"
              "        rms = torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + self.eps)\n        return x / rms * self.weight")

_BLOCK = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.use_rmsnorm:
            from .layers import RMSNorm
            self.norm = RMSNorm(cfg.d)
        else:
            self.norm = nn.LayerNorm(cfg.d)
        self.mix = nn.Linear(cfg.d, cfg.d)
        self.up = nn.Linear(cfg.d, cfg.d)

    def forward(self, x):
        h = self.norm(x)
        x = x + self.mix(h)
        h = self.norm(x)
        return x + self.up(h)
'''


def _norm_scan(tmp_path: Path, body: str) -> dict:
    from npufuse.patterns.add_rms_norm import AddRmsNorm

    root = make_repo(tmp_path / "repo", {"pkg/__init__.py": "", "pkg/layers.py": _RMS.format(body=body), "pkg/block.py": _BLOCK})
    return scan(root, patterns=[AddRmsNorm()])


def test_norm_class_imported_in_an_init_flag_arm_is_fused_under_its_class(tmp_path: Path) -> None:
    data = _norm_scan(tmp_path, _RMS_BODY)
    cands = [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"]
    assert [c["line"] for c in cands] == [19], (data["candidates"], data["near_misses"])
    cond = cands[0]["params"]["condition"]
    # the class is not bound at module level: the test names its qualname and the file its forward comes from
    assert 'type(self.norm).__qualname__ == "RMSNorm"' in cond and "pkg/layers.py" in cond, cond
    assert "RMSNorm(" not in cands[0]["fused"]


def test_locally_imported_norm_class_subtracting_the_mean_stays_a_near_miss(tmp_path: Path) -> None:
    data = _norm_scan(tmp_path, _MEAN_BODY)
    assert not [c for c in data["candidates"] if c["pattern"] == "add_rms_norm"], data["candidates"]
    reasons = [m["reason"] for m in data["near_misses"] if m["pattern"] == "add_rms_norm" and m["line"] == 19]
    assert reasons and "nn.LayerNorm" in reasons[0] and "RMSNorm" in reasons[0], data["near_misses"]


def test_bound_callee_reads_local_imports_in_both_arms_and_enclosing_functions() -> None:
    code = '''
import torch.nn as nn
from torch.nn import GELU as Act


def build(cfg):
    if cfg.fast:
        from fastlib import FusedAct as Act
    else:
        from torch.nn import SiLU as Act
    return Act()


def outer(cfg):
    try:
        from flash_attn import flash_attn_func as attn
    except ImportError:
        from torch.nn.functional import scaled_dot_product_attention as attn

    def inner(q, k, v):
        return attn(q, k, v)
    return inner


def plain():
    return Act()
'''
    module = ModuleInfo.from_source("m.py", code)
    scopes = {s.qualname: s for s in module.scopes}

    def names(qual: str) -> tuple[list[str], list[str], bool]:
        ret = next(n for n in ast.walk(scopes[qual].node) if isinstance(n, ast.Return))
        callee = ret.value.func  # type: ignore[union-attr]
        choice = bound_callee.choices(module, scopes[qual], callee)
        assert choice is not None
        return choice.names(), [m.condition for m in choice.members], choice.complete

    got, conds, complete = names("build")
    # the module-level GELU is shadowed inside build (a local import makes the name local to the whole function)
    assert got == ["fastlib.FusedAct", "torch.nn.SiLU"] and complete, got
    assert conds == ["`if cfg.fast:`", "the `else` of `if cfg.fast:`"], conds
    got, conds, _ = names("outer.inner")
    assert got == ["flash_attn.flash_attn_func", "torch.nn.functional.scaled_dot_product_attention"], got
    assert conds == ["the `try` block succeeding", "`except ImportError`"], conds
    assert names("plain")[0] == ["torch.nn.GELU"]


def test_sdpa_imported_in_forward_under_try_is_fused_only_under_its_identity_test() -> None:
    from npufuse.patterns.sdpa import SdpaPattern

    for first, second in (("flash_attn import flash_attn_func", "torch.nn.functional import scaled_dot_product_attention"),
                          ("torch.nn.functional import scaled_dot_product_attention", "flash_attn import flash_attn_func")):
        code = f'''
import torch
import torch.nn as nn


class Attn(nn.Module):
    def forward(self, q, k, v):
        try:
            from {first} as attn
        except ImportError:
            from {second} as attn
        return attn(q, k, v)
'''
        findings, misses = detect_all(SdpaPattern(), code)
        assert len(findings) == 1, (first, findings, misses)
        assert "if attn is torch.nn.functional.scaled_dot_product_attention and" in findings[0].fused, findings[0].fused


def test_sdpa_imported_in_forward_with_a_keyword_it_does_not_take_is_a_near_miss() -> None:
    from npufuse.patterns.sdpa import SdpaPattern

    code = '''
import torch
import torch.nn as nn


class Attn(nn.Module):
    def forward(self, q, k, v):
        try:
            from flash_attn import flash_attn_func as attn
        except ImportError:
            from torch.nn.functional import scaled_dot_product_attention as attn
        return attn(q, k, v, causal=True)
'''
    findings, misses = detect_all(SdpaPattern(), code)
    assert not findings
    assert any("`causal`" in m.reason and "flash_attn.flash_attn_func" in m.reason for m in misses), [m.reason for m in misses]


def test_norm_class_imported_in_an_init_flag_arm_runs_fused_and_original_arms(tmp_path: Path) -> None:
    """The fused text spliced into the block's file, imported as a package under the emulator: the RMSNorm arm runs
    npu_add_rms_norm with the original's result, the LayerNorm arm the original code."""
    import importlib
    import sys
    import textwrap
    from types import SimpleNamespace

    import torch

    from npufuse import emulate

    data = _norm_scan(tmp_path, _RMS_BODY)
    cand = next(c for c in data["candidates"] if c["pattern"] == "add_rms_norm")
    lines = _BLOCK.splitlines(keepends=True)
    fused = textwrap.indent(cand["fused"], " " * 8) + "\n"
    spliced = "import torch_npu\n" + "".join(lines[:cand["line"] - 1]) + fused + "".join(lines[cand["end_line"]:])
    (tmp_path / "repo" / "pkg" / "fused_block.py").write_text(spliced, encoding="utf-8")
    sys.path.insert(0, str(tmp_path / "repo"))
    try:
        with emulate.install() as emu:
            for name in [n for n in sys.modules if n == "pkg" or n.startswith("pkg.")]:
                del sys.modules[name]
            original = importlib.import_module("pkg.block")
            rewritten = importlib.import_module("pkg.fused_block")
            for rms in (True, False):
                cfg = SimpleNamespace(use_rmsnorm=rms, d=16)
                torch.manual_seed(0)
                ref = original.Block(cfg).eval()
                torch.manual_seed(0)
                new = rewritten.Block(cfg).eval()
                x = torch.randn(2, 5, 16)
                before = emu.calls.get("npu_add_rms_norm", 0)
                with torch.no_grad():
                    torch.testing.assert_close(new(x), ref(x), atol=1e-5, rtol=1e-5)
                assert (emu.calls.get("npu_add_rms_norm", 0) - before == 1) == rms, (rms, dict(emu.calls))
    finally:
        sys.path.remove(str(tmp_path / "repo"))
        for name in [n for n in sys.modules if n == "pkg" or n.startswith("pkg.")]:
            del sys.modules[name]


def test_name_imported_as_flash_attention_here_and_as_sdpa_in_another_function_is_not_fused_here() -> None:
    from npufuse.patterns.sdpa import SdpaPattern

    code = '''
import torch
import torch.nn as nn


class Flash(nn.Module):
    def forward(self, q, k, v):
        from flash_attn import flash_attn_func as attn
        return attn(q, k, v)


class Plain(nn.Module):
    def forward(self, q, k, v):
        from torch.nn.functional import scaled_dot_product_attention as attn
        return attn(q, k, v)
'''
    findings, misses = detect_all(SdpaPattern(), code)
    assert [f.qualname for f in findings] == ["Plain.forward"], (findings, misses)
    assert [m.qualname for m in misses if "not SDPA" in m.reason] == ["Flash.forward"], [m.reason for m in misses]
