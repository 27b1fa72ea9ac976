"""Functions and classes defined under a module-level ``if``/``else``/``try``/``with``/``for``/
``match`` block are scopes like top-level ones (xlstm keeps its kernels under
``if is_xlstm_available(): ... else:``; a ``try: import x except ImportError: def f(...)`` fallback
is common), with the qualname the rest of npufuse spells (no block in it), and apply rewrites a
site inside one. The audit's suspect pool (bench/corpus_findings.py ``functions``) sees them too."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

from apply_support import npufuse, scan, state_of
from bench_scripts import load_bench
from npufuse import emulate
from npufuse.patterns.registry import all_patterns
from npufuse.rewrite.transform import marked_sites
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import _exec, _run


BLOCKS = textwrap.dedent('''\
    import torch

    try:
        from fast_kernels import rms_norm
    except ImportError:
        def rms_norm(x, w, eps=1e-6):
            return x
    if torch.cuda.is_available():
        class A:
            def forward(self):
                def inner():
                    pass
            if True:
                def other(self):
                    pass
    else:
        with open("x") as f:
            def g():
                pass
    for i in range(2):
        def h():
            pass
    while False:
        pass
    else:
        def w():
            pass
    match 1:
        case 1:
            def m():
                pass
    try:
        pass
    finally:
        def fin():
            pass
    def top():
        if x:
            def nested():
                pass
    class B:
        class C:
            def c(self):
                pass
    if False:
        def top():
            pass
    ''')

EXPECTED = [
    ("rms_norm", None), ("A.forward", "A"), ("A.forward.inner", None), ("A.other", "A"), ("g", None), ("h", None),
    ("w", None), ("m", None), ("fin", None), ("top", None), ("top.nested", None), ("B.C.c", "C"), ("top", None),
]  # fmt: skip


def test_defs_under_blocks_are_scopes_with_plain_qualnames() -> None:
    module = ModuleInfo.from_source("m.py", BLOCKS)
    assert [(s.qualname, s.class_name) for s in module.scopes[1:]] == EXPECTED
    # classes and functions under module-level blocks are indexed for the detectors' lookups
    # (self.config of a class, helpers like rotate_half); a nested class or function is not
    assert sorted(module.classes) == ["A", "B"]
    assert {"rms_norm", "g", "h", "w", "m", "fin", "top"} <= set(module.functions)
    assert "inner" not in module.functions and "nested" not in module.functions
    # the top-level `def top` keeps its place over the later `if False: def top()`
    assert module.functions["top"].lineno == BLOCKS.splitlines().index("def top():") + 1


def test_suspect_pool_functions_match_the_scanner_scopes(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(BLOCKS, encoding="utf-8")
    cf = load_bench("corpus_findings")
    found = sorted((f.qualname, f.line) for f in cf.functions(tmp_path, ["m.py"]))
    module = ModuleInfo.from_source("m.py", BLOCKS)
    assert found == sorted((s.qualname, s.node.lineno) for s in module.scopes[1:])


FALLBACK = textwrap.dedent('''\
    import torch
    from torch import nn

    try:
        from fused_norm_kernels import rms_norm  # not installed: the fallback below is defined
    except ImportError:
        def rms_norm(x, weight, eps=1e-6):
            x_fp32 = x.float()
            normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(dim=-1, keepdim=True) + eps)
            return (normed * weight.float()).to(x.dtype)

    if hasattr(torch, "float32"):
        class Norm(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.config = config
                self.weight = nn.Parameter(torch.ones(config.hidden_size))
                self.eps = 1e-6

            def forward(self, hidden_states):
                input_dtype = hidden_states.dtype
                hidden_states = hidden_states.to(torch.float32)
                variance = hidden_states.pow(2).mean(-1, keepdim=True)
                hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
                return self.weight * hidden_states.to(input_dtype)
    ''')

RUN = '''
import types
w = torch.randn(32, requires_grad=True)
x = torch.randn(3, 32, dtype=torch.bfloat16, requires_grad=True)
norm = Norm(types.SimpleNamespace(hidden_size=32))
with torch.no_grad():
    norm.weight.normal_()
out = (rms_norm(x, w, 1e-5), norm(x))
leaves = [x, w, norm.weight]
'''


def test_scan_and_apply_sites_inside_block_defs(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "model.py").write_text(FALLBACK, encoding="utf-8")
    rms = [p for p in all_patterns() if p.id == "rms_norm"]
    data = scan(root, patterns=rms)
    by_qual = {c["qualname"]: c for c in data["candidates"]}
    assert sorted(by_qual) == ["Norm.forward", "rms_norm"]
    # the class under `if` is seen as a class: its self.config carries the new config field
    assert by_qual["Norm.forward"]["switch"]["expr"] == 'getattr(self.config, "use_npu_rms_norm", True)'
    assert by_qual["rms_norm"]["switch"]["kind"] == "env"

    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    rewritten = (root / "model.py").read_text(encoding="utf-8")
    assert rewritten.count("# npufuse: rms_norm") == 2
    # the qualnames apply/revert find the marked sites by are the scan's
    assert sorted(m.qualname for m in marked_sites(rewritten)) == ["Norm.forward", "rms_norm"]
    assert all(c.get("applied") for c in state_of(root / ".npufuse")["candidates"])

    ref, ref_grads = _run(_exec(FALLBACK, "original"), RUN)
    with emulate.install() as emu:
        outs, grads = _run(_exec(rewritten, "rewritten"), RUN)
    assert emu.calls.get("npu_rms_norm") == 2
    for a, b in zip(ref + ref_grads, outs + grads):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    assert npufuse("revert", "--state-dir", str(root / ".npufuse")) == 0
    assert (root / "model.py").read_text(encoding="utf-8") == FALLBACK
