"""s42 (helper addnorm42): add_rms_norm / rms_norm recall classes the s42 blind judge found (classes only; every
spelling here is invented, in the styles of development repositories). Each class has a Fuse (found, run under the
emulator against the original where it runs) and a Keep (no candidate; a true reason where one is given).

1. add + norm across a layer loop or inside a helper: GPT-2's ``block.ln_2(x)`` / ``self.layers[i].ln_2(h)`` (no
   "norm" in the scope's text: the member-norm reading never started), and a norm handed to a function as an
   argument (``def _block(x, norm, attn)``, ``self._sub(x, f, self.norms[0])``), read as the one construction every
   caller in the file hands it, fused under a run-time class test.
2. a norm class whose forward calls a custom (Triton) kernel before its torch path: a CUDA test of the input is false
   for every NPU tensor, a flag test is checked false at run time; the torch path is read. A kernel-only forward or a
   test npufuse cannot read is a near miss saying so.
3. an optional norm after the add: ``nn.RMSNorm(d, elementwise_affine=False)`` (ones as gamma) and ``RMSNorm(d) if
   cfg.final_norm else nn.Identity()`` (the Identity side takes the original under the class test).
4. RMSNorm with a clamp instead of an added eps: ``x * rsqrt(ms.clamp(min=eps))`` / ``x / sqrt(clamp(ms, min=eps))``
   (numeric probe: eps' = eps, a stated risk) and the add + norm on it or on an rms clamp (eps' = eps ** 2: the mapped
   eps, never the raw one).
"""

from __future__ import annotations

import pytest

from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.rms_norm import RmsNorm


def _close(facts: dict, tol: float = 0.99999) -> None:
    assert facts["n_out"][0] == facts["n_out"][1]
    assert all(c > tol for c in facts["cos_out"]), facts["cos_out"]
    assert all(c > tol for c in facts["cos_grad"]), facts["cos_grad"]


# every model of the run with random parameters: an inference pass (fused by npu_add_rms_norm), then a training pass
_RUN = '''
models = [{ctors}]
with torch.no_grad():
    for m in models:
        for p in m.parameters():
            p.normal_()
    infer = [{call} for m in models for x in [torch.randn(2, 5, 16)]]
x = torch.randn(2, 5, 16, requires_grad=True)
out = (infer, [{call} for m in models])
leaves = [x]
'''


def _run(*ctors: str, call: str = "m(x)") -> str:
    return _RUN.format(ctors=", ".join(ctors), call=call)


def _fused_runs_like_original(code: str, run: str, findings: list) -> None:
    """The rewritten code runs npu_add_rms_norm and matches the original's outputs and gradients."""
    facts = check_rewrite_runs(AddRmsNorm(), code, run, findings)
    assert facts["all_calls"].get("npu_add_rms_norm"), facts["all_calls"]
    _close(facts)


_RMS = '''
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
'''

# -- 1. across a layer loop, or a norm handed to a helper ---------------------------------------------------------------

_GPT_LOOP = _RMS + '''

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln_1 = {ln}
        self.attn = nn.Linear(d, d)
        self.ln_2 = {ln}
        self.mlp = nn.Linear(d, d)


class GPT(nn.Module):
    def __init__(self, d, n=2):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block.attn(block.ln_1(x))
            x = x + block.mlp(block.ln_2(x))
        return x

    def unrolled(self, x):
        h = x + self.blocks[0].attn(self.blocks[0].ln_1(x))
        return h + self.blocks[0].mlp(self.blocks[0].ln_2(h))
'''



def test_gpt2_layer_loop_ln_2_after_the_residual_add_is_fused() -> None:
    code = _GPT_LOOP.format(ln="RMSNorm(d)")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert sorted(f.qualname for f in findings) == ["GPT.forward", "GPT.unrolled"], misses
    assert all("type(" in f.params["condition"] and "ln_2) is RMSNorm" in f.params["condition"] for f in findings)
    _fused_runs_like_original(code, _run("GPT(16)", call="(m(x), m.unrolled(x))"), findings)


def test_gpt2_layer_loop_with_layer_norm_is_a_true_near_miss() -> None:
    findings, misses = detect_all(AddRmsNorm(), _GPT_LOOP.format(ln="nn.LayerNorm(d)"))
    assert not findings
    assert misses and all("mean subtracted" in m.reason for m in misses), [m.reason for m in misses]


_HANDED = _RMS + '''

def residual_block(x, sublayer, norm):
    x = x + sublayer(x)
    return norm(x)


def mixed_block(x, sublayer, norm):
    x = x + sublayer(x)
    return norm(x)


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.post_norm = RMSNorm(d)
        self.ln = nn.LayerNorm(d)
        self.norms = nn.ModuleList([RMSNorm(d) for _ in range(2)])

    def _sub(self, x, f, norm):
        x = x + f(x)
        x = norm(x)
        return x

    def forward(self, x):
        x = self._sub(x, self.attn, self.norms[0])
        x = self._sub(x, self.mlp, self.norms[1])
        x = residual_block(x, self.mlp, self.post_norm)
        return x

    def other(self, x):
        return mixed_block(mixed_block(x, self.attn, self.post_norm), self.mlp, self.ln)
'''



def test_norm_handed_to_a_helper_is_read_through_its_callers() -> None:
    findings, misses = detect_all(AddRmsNorm(), _HANDED)
    assert sorted(f.qualname for f in findings) == ["Layer._sub", "residual_block"], misses
    assert all(f.params["condition"] == "type(norm) is RMSNorm" for f in findings), [f.params for f in findings]
    # mixed_block's callers hand it an RMSNorm and a LayerNorm: no candidate, the reason says so
    why = [m.reason for m in misses if m.qualname == "mixed_block"]
    assert why and "2 constructions" in why[0], [(m.qualname, m.reason) for m in misses]
    _fused_runs_like_original(_HANDED, _run("Layer(16)", call="(m(x), m.other(x))"), findings)


def test_norm_parameter_without_a_caller_in_the_file_is_fused_only_where_it_is_torchs_rmsnorm() -> None:
    # s46 (sweep46a): no caller says which module the parameter is; the fused code runs where its run-time type is
    # PyTorch's nn.RMSNorm (checked), the original statements elsewhere (this file's own RMSNorm included)
    code = _RMS + '''

def block(x, sublayer, norm):
    x = x + sublayer(x)
    return norm(x)
'''
    findings, _ = detect_all(AddRmsNorm(), code)
    assert [f.qualname for f in findings] == ["block"]
    assert findings[0].fused.startswith("if isinstance(norm, torch.nn.RMSNorm) and type(norm).forward is torch.nn.RMSNorm.forward")


# -- 2. a kernel branch before the torch path --------------------------------------------------------------------

_KERNEL = '''
import torch
import torch.nn as nn

try:
    from my_kernels import rms_norm_triton
    HAS_TRITON = True
except ImportError:
    rms_norm_triton = None
    HAS_TRITON = False


class TritonRMSNorm(nn.Module):
    """RMSNorm: x / sqrt(mean(x^2) + eps) * weight; a Triton kernel on CUDA, torch otherwise."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _torch_forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).type_as(x) * self.weight

    def forward(self, x):
        if {test}:
            return rms_norm_triton(x, self.weight, self.eps)
        return self._torch_forward(x)


class FlagRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, fused=False):
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if self.fused and HAS_TRITON:
            return rms_norm_triton(x, self.weight, self.eps)
        else:
            variance = x.pow(2).mean(-1, keepdim=True)
            return self.weight * (x * torch.rsqrt(variance + self.eps))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.norm1 = TritonRMSNorm(d)
        self.norm2 = FlagRMSNorm(d)

    def forward(self, x):
        h = x + self.attn(x)
        out = self.norm1(h)
        h = h + self.mlp(out)
        return self.norm2(h)
'''



def test_kernel_branch_dead_on_npu_or_a_flag_reads_the_torch_path() -> None:
    for test in ("HAS_TRITON and x.is_cuda", 'x.device.type == "cuda"'):
        code = _KERNEL.format(test=test)
        findings, misses = detect_all(AddRmsNorm(), code)
        assert [f.line for f in findings] == [55, 57], (test, [m.reason for m in misses])
        first, second = findings
        assert "condition" not in first.params, first.params  # false for every NPU tensor: no run-time test
        assert second.params["condition"] == "not (self.norm2.fused and HAS_TRITON)", second.params
        _fused_runs_like_original(code, _run("Block(16)"), findings)


def test_kernel_branch_under_an_unread_test_or_without_a_torch_path_is_a_near_miss() -> None:
    # ``x.device.type != "cpu"`` holds on an NPU tensor: the kernel would run there
    code = _KERNEL.format(test='x.device.type != "cpu"')
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [f.line for f in findings] == [57]
    assert any("cannot prove false where the fused code runs" in m.reason for m in misses), [m.reason for m in misses]
    kernel_only = code.replace('''        if x.device.type != "cpu":
            return rms_norm_triton(x, self.weight, self.eps)
        return self._torch_forward(x)''', "        return rms_norm_triton(x, self.weight, self.eps)")
    findings, misses = detect_all(AddRmsNorm(), kernel_only)
    assert [f.line for f in findings] == [55]
    assert any("a kernel npufuse does not read, with no torch path" in m.reason for m in misses), [m.reason for m in misses]


# -- 3. an optional / weightless norm after the add ------------------------------------------------------------------

_OPTIONAL = _RMS + '''

class Block(nn.Module):
    def __init__(self, d, final_norm=True):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.plain = nn.RMSNorm(d, eps=1e-5, elementwise_affine={affine})
        self.final = RMSNorm(d) if final_norm else nn.Identity()

    def forward(self, x):
        x = x + self.attn(x)
        x = self.plain(x)
        x = x + self.mlp(x)
        x = self.final(x)
        return x
'''



def test_weightless_library_norm_and_identity_optional_norm_after_the_add_are_fused() -> None:
    code = _OPTIONAL.format(affine="False")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [f.line for f in findings] == [25, 27], [m.reason for m in misses]
    plain, final = findings
    assert plain.params["weight"] is None and plain.params["eps"] == "1e-5", plain.params
    assert final.params["condition"] == "type(self.final) is RMSNorm", final.params
    _fused_runs_like_original(code, _run("Block(16)", "Block(16, final_norm=False)"), findings)


def test_library_norm_with_a_weight_flag_npufuse_cannot_read_is_not_fused_as_weightless() -> None:
    # ``elementwise_affine=affine`` (a value of the caller): whether there is a weight is not known
    findings, _ = detect_all(AddRmsNorm(), _OPTIONAL.format(affine="final_norm"))
    assert [f.line for f in findings] == [27]
    # a normalized_shape over two dims: ones of the last dim would be the wrong gamma
    code = _OPTIONAL.format(affine="False").replace("nn.RMSNorm(d, eps", "nn.RMSNorm((4, d), eps")
    findings, _ = detect_all(AddRmsNorm(), code)
    assert [f.line for f in findings] == [27]


# -- 4. a clamp instead of an added eps ------------------------------------------------------------------------------

_CLAMPED = '''
import torch
import torch.nn as nn


class ClampMsNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        ms = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(ms.clamp(min=self.eps)) * self.weight


class SqrtClampNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        ms = torch.mean(x * x, dim=-1, keepdim=True)
        return self.weight * (x / torch.sqrt(torch.clamp(ms, min=self.eps)))


class RmsClampNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        rms = x.pow(2).mean(dim=-1, keepdim=True).sqrt()
        return x / rms.clamp_min(self.eps) * self.scale


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.n1 = ClampMsNorm(d)
        self.n2 = SqrtClampNorm(d)
        self.n3 = RmsClampNorm(d)

    def forward(self, x):
        h = x + self.attn(x)
        y = self.n1(h)
        h = h + self.mlp(y)
        y = self.n2(h)
        h = h + self.attn(y)
        return self.n3(h)
'''



def test_rms_norm_with_the_mean_square_clamped_is_fused_with_a_stated_risk() -> None:
    findings, misses = detect_all(RmsNorm(), _CLAMPED)
    by = {f.qualname: f for f in findings}
    assert set(by) == {"ClampMsNorm.forward", "SqrtClampNorm.forward", "RmsClampNorm.forward"}, [m.reason for m in misses]
    for name in ("ClampMsNorm.forward", "SqrtClampNorm.forward"):
        p = by[name].params
        assert p["eps"] == "self.eps" and p["eps_rule"] == "clamp on the mean square", p
        assert any("clamps the mean square from below" in r.detail for r in by[name].risks)
    assert by["RmsClampNorm.forward"].params["eps"] == "(self.eps) ** 2"


def test_add_then_clamped_norm_is_fused_with_the_mapped_eps() -> None:
    findings, misses = detect_all(AddRmsNorm(), _CLAMPED)
    assert [f.params["eps"] for f in findings] == ["self.n1.eps", "self.n2.eps", "(self.n3.eps) ** 2"], [m.reason for m in misses]
    for f in findings:
        assert f.params["eps_rule"].startswith("clamp on the"), f.params
        assert any("puts eps otherwise than npu_add_rms_norm" in r.detail for r in f.risks)
    _fused_runs_like_original(_CLAMPED, _run("Block(16)"), findings)


def test_clamped_norm_with_a_large_eps_runs_fused_for_half_inputs_only() -> None:
    # eps 1e-4 on the mean square: 5e-5 relative at rms 1, above fp32's tolerance, within fp16 / bf16's
    code = _CLAMPED.replace("class ClampMsNorm(nn.Module):\n    def __init__(self, dim, eps=1e-6)",
                            "class ClampMsNorm(nn.Module):\n    def __init__(self, dim, eps=1e-4)")
    findings, _ = detect_all(AddRmsNorm(), code)
    first = findings[0]
    assert first.params["eps"] == "self.n1.eps" and first.params["eps_bound"] > 1e-6, first.params
    assert "_npu_x1.dtype == torch.float32" in first.fused, first.fused


def test_clamp_far_above_the_tolerance_is_not_fused() -> None:
    # a floor of 0.1 on the mean square differs by 5% at rms 1: kept by rms_norm and by the add + norm
    code = _CLAMPED.replace("class ClampMsNorm(nn.Module):\n    def __init__(self, dim, eps=1e-6)",
                            "class ClampMsNorm(nn.Module):\n    def __init__(self, dim, eps=0.1)")
    assert "ClampMsNorm.forward" not in {f.qualname for f in detect_all(RmsNorm(), code)[0]}
    findings, _ = detect_all(AddRmsNorm(), code)
    assert "self.n1.eps" not in [f.params["eps"] for f in findings]


_TORCH_FIRST = '''
import torch
import torch.nn as nn
from my_kernels import fused_rms_norm

USE_KERNEL = True


class InvRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if {test}:
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return fused_rms_norm(x, self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.norm = InvRMSNorm(d)

    def forward(self, x):
        x = x + self.attn(x)
        return self.norm(x)
'''


def test_torch_path_first_under_a_test_true_on_npu_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    code = _TORCH_FIRST.format(test="not x.is_cuda or not USE_KERNEL")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [f.line for f in findings] == [29], [m.reason for m in misses]
    assert "condition" not in findings[0].params
    stub = types.ModuleType("my_kernels")
    stub.fused_rms_norm = None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "my_kernels", stub)
    _fused_runs_like_original(code, _run("Block(16)"), findings)
    # ``x.is_cuda or ...`` is not true for every NPU tensor: the kernel may run there
    findings, _ = detect_all(AddRmsNorm(), _TORCH_FIRST.format(test="x.is_cuda or not USE_KERNEL"))
    assert not findings


_STRIDED = _RMS + '''

class Net(nn.Module):
    def __init__(self, d, n=2):
        super().__init__()
        self.norms = nn.ModuleList([RMSNorm(d) for _ in range(2 * n)])
        self.attns = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])
        self.mlps = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])

    def forward(self, x):
        for i in range(len(self.attns)):
            x = x + self.attns[i](self.norms[2 * i](x))
            x = x + self.mlps[i](self.norms[2 * i + 1](x))
        return x

    def picked(self, x):
        x = x + self.attns[0](x)
        return self.norms[int(x.sum() > 0)](x)
'''


def test_norm_list_indexed_by_arithmetic_in_a_layer_loop_is_fused() -> None:
    findings, misses = detect_all(AddRmsNorm(), _STRIDED)
    # ``self.norms[int(x.sum() > 0)]``: an index computed by a call is not read (it may differ between two reads)
    assert [(f.qualname, f.params["eps"]) for f in findings] == [("Net.forward", "self.norms[2 * i + 1].eps")], [m.reason for m in misses]
    _fused_runs_like_original(_STRIDED, _run("Net(16)"), findings)


_IFEXP = _RMS + '''

class Block(nn.Module):
    def __init__(self, d, use_residual=True, skip=False):
        super().__init__()
        self.use_residual = use_residual
        self.skip = skip
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
        self.norm1 = RMSNorm(d)
        self.norm2 = RMSNorm(d)

    def gate(self, x):
        return bool(x.mean() > 0)

    def forward(self, x):
        h = self.attn(x)
        x = x + h if self.use_residual else h
        x = self.norm1(x)
        h = self.mlp(x)
        x = h if self.skip else h + x
        return self.norm2(x)

    def gated(self, x):
        h = self.attn(x)
        x = x + h if self.gate(x) else h
        return self.norm1(x)
'''


def test_residual_add_in_a_conditional_expression_is_fused_where_its_test_holds() -> None:
    findings, misses = detect_all(AddRmsNorm(), _IFEXP)
    # ``if self.gate(x)``: a test with a call is not evaluated twice (it may differ): not read
    assert [(f.qualname, f.params["condition"]) for f in findings] == [
        ("Block.forward", "(self.use_residual)"), ("Block.forward", "not (self.skip)")], [m.reason for m in misses]
    _fused_runs_like_original(_IFEXP, _run("Block(16)", "Block(16, use_residual=False, skip=True)"), findings)


_IF_BODY_ALIAS = _RMS + '''

class Block(nn.Module):
    def __init__(self, d, use_residual=True):
        super().__init__()
        self.use_residual = use_residual
        self.attn = nn.Linear(d, d)
        self.norm = RMSNorm(d)

    def forward(self, x):
        residual = x
        h = self.attn(x)
        if self.use_residual:
            x = x + h
            residual = x
        x = self.norm(x)
        return x, residual
'''


def test_add_and_its_alias_inside_an_if_then_the_norm_is_fused() -> None:
    findings, misses = detect_all(AddRmsNorm(), _IF_BODY_ALIAS)
    assert [(f.line, f.end_line, f.params["residual_aliases"]) for f in findings] == [(26, 29, ["residual"])], [m.reason for m in misses]
    _fused_runs_like_original(_IF_BODY_ALIAS, _run("Block(16)", "Block(16, use_residual=False)"), findings)
    # an alias of another name after the add (``other = residual``) is not the sum's: not read
    code = _IF_BODY_ALIAS.replace("            residual = x\n", "            residual = x\n            other = residual\n")
    assert not detect_all(AddRmsNorm(), code)[0]


def test_no_kernel_reason_for_the_files_own_code_nor_for_a_builder_in_init() -> None:
    # ``RMSNorm._norm(x, ...)``: a function of the class itself, not a kernel; ``norm(ch)`` in ``__init__`` builds a
    # module from a class handed in, over channel counts: neither gets a near miss saying otherwise
    code = '''
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    @torch.compile
    def _norm(x, eps, weight):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).type_as(x) * weight

    def forward(self, x):
        return RMSNorm._norm(x, self.eps, self.weight)


class Up(nn.Module):
    def __init__(self, in_ch, out_ch, norm=nn.BatchNorm2d):
        super().__init__()
        ch = in_ch + out_ch
        self.bn = norm(ch)
        self.attn = nn.Linear(ch, ch)
        self.ln = RMSNorm(ch)

    def forward(self, x):
        x = x + self.attn(x)
        return self.ln(x)
'''
    findings, misses = detect_all(AddRmsNorm(), code)
    assert not [m.reason for m in misses if "kernel" in m.reason or "parameter of" in m.reason], [m.reason for m in misses]


def test_weightless_library_norm_chosen_beside_a_layer_norm_is_fused_under_its_class_test() -> None:
    from test_detect_s40_reasons import _NORM_BLOCK, _NORM_HEAD

    build = ("if cfg.use_rms:\n            self.norm = nn.RMSNorm(cfg.d, elementwise_affine=False)\n"
             "        else:\n            self.norm = nn.LayerNorm(cfg.d)")
    code = _NORM_HEAD + _NORM_BLOCK.format(build=build)
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [f.params["condition"] for f in findings] == ["type(self.norm) is torch.nn.RMSNorm and self.norm.weight is None"], misses
    run = '''
rms, ln = Block(Cfg(True)), Block(Cfg(False))
with torch.no_grad():
    x0, h0 = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    infer = (rms(x0, h0), ln(x0, h0))
x = torch.randn(2, 3, 16, requires_grad=True)
h = torch.randn(2, 3, 16, requires_grad=True)
out = (infer, rms(x, h), ln(x, h))
leaves = [x, h]
'''
    _fused_runs_like_original(code, run, findings)
