"""Issue 14, norm classes: library modules swapped where they are built, L2 spellings through helpers,
optional weights in a branch, in-place residual adds. The patterns' own Fuse/Keep examples cover
detection and the emulated rewrite; these tests check what a user relies on besides."""

from __future__ import annotations

import ast
import copy

import torch

from npufuse import emulate
from npufuse.patterns import rms_norm as R
from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.rewrite.codegen import splice
from npufuse.scan import canonical
from npufuse.scan.dataflow import ModuleInfo
from tests.pattern_harness import _exec, detect_all

_BLOCK = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(self.norm(x.transpose(1, 2)))
'''


def _rewritten(code: str):
    findings, _ = detect_all(R.RmsNorm(), code)
    return findings, splice(code, findings)


def test_nn_rmsnorm_site_is_the_construction_and_every_call_is_fused():
    findings, text = _rewritten(_BLOCK)
    assert [(f.line, f.qualname) for f in findings] == [(9, "Block.__init__")]
    torch.manual_seed(0)
    ref = _exec(_BLOCK, "orig")["Block"](8)
    x = torch.randn(2, 8, 3)
    with emulate.install() as emu:
        blk = _exec(text, "new")["Block"](8)
        blk.load_state_dict(ref.state_dict())  # same parameter names: checkpoints load unchanged
        out = blk(x)
        assert emu.calls.get("npu_rms_norm") == 1  # the call site with a transposed input goes through the swap
        twin = copy.deepcopy(blk)  # the copy's forward is bound to the copy, not to the original
        with torch.no_grad():
            twin.norm.weight.mul_(2)
        assert not torch.allclose(twin(x), out)
    assert torch.allclose(out, ref(x), atol=1e-5)
    assert set(blk.state_dict()) == set(ref.state_dict())


def test_nn_rmsnorm_swap_off_by_switch_and_without_torch_npu(monkeypatch):
    findings, text = _rewritten(_BLOCK)
    x = torch.randn(2, 8, 3)
    monkeypatch.setenv("NPUFUSE_RMS_NORM", "0")
    with emulate.install() as emu:
        _exec(text, "off")["Block"](8)(x)
        assert not emu.calls  # the switch is read where the module is built
    monkeypatch.delenv("NPUFUSE_RMS_NORM")
    ns = _exec(text, "plain")  # no emulator: torch_npu is absent, the original construction runs
    assert type(ns["Block"](8).norm).forward is torch.nn.RMSNorm.forward and "forward" not in vars(ns["Block"](8).norm)


def test_rewritten_construction_is_not_found_again():
    findings, text = _rewritten(_BLOCK)
    again, misses = detect_all(R.RmsNorm(), text)
    assert not [f for f in again if f.variant == "nn_rmsnorm"]
    assert any("already rewritten by npufuse" in m.reason for m in misses)


def test_a_subclass_with_its_own_forward_is_not_swapped_at_its_constructions():
    code = _BLOCK.replace("nn.RMSNorm(dim, eps=1e-5)", "Scaled(dim)") + '''

class Scaled(nn.RMSNorm):
    def forward(self, x):
        return super().forward(x) * 2
'''
    findings, _ = detect_all(R.RmsNorm(), code)
    assert not [f for f in findings if f.variant == "nn_rmsnorm"]


def test_swap_runs_the_original_forward_for_a_one_dim_input():
    # npu_rms_norm takes 2-8-D input: a 1-D vector goes to nn.RMSNorm's own forward
    findings, text = _rewritten(_BLOCK)
    with emulate.install() as emu:
        blk = _exec(text, "v")["Block"](8)
        y = blk.norm(torch.randn(8))
        assert not emu.calls and y.shape == (8,)


def _call(module: ModuleInfo, src: str) -> ast.Call:
    node = ast.parse(src).body[0].value  # type: ignore[attr-defined]
    assert isinstance(node, ast.Call)
    return node


def test_l2_normalize_of_reads_direct_calls_and_one_line_helpers():
    code = '''
import torch.nn.functional as F


def l2norm(t):
    """unit vectors"""
    return F.normalize(t, dim=-1)


def chan_norm(t):
    return F.normalize(t, dim=1)


def l1norm(t):
    return F.normalize(t, p=1, dim=-1)


def eps_norm(t, eps=1e-6):
    return F.normalize(t, dim=-1, eps=eps)
'''
    module = ModuleInfo.from_source("m.py", code)
    direct = canonical.l2_normalize_of(module, _call(module, "F.normalize(x, dim=-1, eps=1e-8)"))
    assert direct is not None and ast.unparse(direct.x) == "x" and ast.unparse(direct.eps) == "1e-08" and direct.via_helper is None
    helper = canonical.l2_normalize_of(module, _call(module, "l2norm(q * 2)"))
    assert helper is not None and ast.unparse(helper.x) == "q * 2" and helper.via_helper == "l2norm" and helper.eps is None
    # s34 (norm34): a helper's defaulted parameters are bound per call, so eps_norm(x) is a last-dim L2 norm with eps 1e-6
    defaulted = canonical.l2_normalize_of(module, _call(module, "eps_norm(x)"))
    assert defaulted is not None and ast.unparse(defaulted.eps) == "1e-06" and defaulted.via_helper == "eps_norm"
    for other in ("chan_norm(x)", "l1norm(x)", "F.normalize(x)", "l2norm(x, 1)", "eps_norm(x, 1e-6, 3)"):
        assert canonical.l2_normalize_of(module, _call(module, other)) is None, other


def test_in_place_add_after_a_parameter_is_refused():
    # `h` is the caller's tensor: the original adds into it, a rebinding would not
    code = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.RMSNorm(dim)

    def forward(self, h, r):
        h += r
        return self.norm(h)
'''
    findings, misses = detect_all(AddRmsNorm(), code)
    assert not findings and any("in-place residual add" in m.reason for m in misses)


class _StandInLlamaRMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm forward, written out (transformers is not a dependency)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def test_imported_transformers_rmsnorm_call_is_fused_and_checked_at_run_time(monkeypatch):
    import sys
    import types

    for name in ("transformers", "transformers.models", "transformers.models.llama"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    llama = types.ModuleType("transformers.models.llama.modeling_llama")
    llama.LlamaRMSNorm = _StandInLlamaRMSNorm  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, llama.__name__, llama)
    code = R._HF_NORM_IMPORTED
    findings, _ = detect_all(R.RmsNorm(), code)
    assert [(f.qualname, f.line) for f in findings] == [("Patchify.forward", 15)]  # Down's flag-chosen norm is not a site
    text = splice(code, findings)
    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)
    torch.manual_seed(0)
    ref_mod = _exec(code, "orig")["Patchify"](16).to(torch.bfloat16)
    with torch.no_grad():
        ref_mod.norm.weight.normal_()
    ref = ref_mod(x)
    with emulate.install() as emu:
        mod = _exec(text, "new")["Patchify"](16).to(torch.bfloat16)
        mod.load_state_dict(ref_mod.state_dict())
        out = mod(x)
        assert emu.calls.get("npu_rms_norm") == 1
        mod.norm = _exec(text, "new2")["nn"].LayerNorm(16).to(torch.bfloat16)  # another module there: the original call
        mod(x)
        assert emu.calls.get("npu_rms_norm") == 1
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.nn.functional.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0) > 0.999


def test_in_place_add_before_a_layer_norm_says_layer_norm():
    # HF embeddings: ``embeddings += position_embeddings; embeddings = self.LayerNorm(embeddings)``: the
    # reason is the LayerNorm, not the in-place add
    code = '''
import torch
from torch import nn


class Embeddings(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.pos = nn.Embedding(16, dim)
        self.LayerNorm = nn.LayerNorm(dim)

    def forward(self, embeddings, position_ids):
        position_embeddings = self.pos(position_ids)
        embeddings += position_embeddings
        embeddings = self.LayerNorm(embeddings)
        return embeddings
'''
    findings, misses = detect_all(AddRmsNorm(), code)
    assert not findings and [m.reason.split(" (")[0] for m in misses] == ["norm is not RMSNorm"]


def test_functional_rms_norm_gate_reads_the_whole_word_and_import_aliases():
    """The functional branch is entered only where a callee can be ``rms_norm`` (bench/scan.py:
    most transformers scopes hold only ``rms_norm_eps``); an aliased import still is one."""
    from npufuse.patterns import _library_norm as L

    aliased = '''
import torch
from torch.nn.functional import rms_norm as rn


def norm(x, w, cfg):
    eps = cfg.rms_norm_eps
    return rn(x, (x.shape[-1],), w, eps)
'''
    module = ModuleInfo.from_source("m.py", aliased)
    assert L._may_call_rms_norm(module, aliased)
    assert not L._may_call_rms_norm(module, "eps = cfg.rms_norm_eps\nrms_norm_weight = 1\n")
    assert L._may_call_rms_norm(module, "y = F.rms_norm (x, s)")
    assert L._may_call_rms_norm(module, "y = torch.\\\n    rms_norm(x, s)")
    findings, _ = detect_all(R.RmsNorm(), aliased)
    assert [f.qualname for f in findings] == ["norm"]
    # only the eps word: nothing to find, and no walk needed to say so
    eps_only = aliased.replace("rn(x, (x.shape[-1],), w, eps)", "x * eps")
    assert detect_all(R.RmsNorm(), eps_only)[0] == []
