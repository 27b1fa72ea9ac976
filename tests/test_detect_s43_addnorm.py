"""s43 (helper addnorm43): add_rms_norm recall classes read from the real HO19a / HO19b misses (development data).

1. A gap ``if <flag>:`` between the add and the norm whose body only reads the sum (DeepSeek-V3 shakespeare's
   ``if debug_nan: if torch.isnan(x).any(): print(...); return None, None``): the site is fused where the flag is
   false, the original statements run where it holds. Keep: a NaN test on the sum itself (not a flag) between them.
2. Profiling markers between the add and the norm (llm-infer-engine's ``torch.cuda.nvtx.range_pop()`` /
   ``range_push("FFN")``, logging calls): re-emitted in their order on every path. Keep: a marker whose argument
   calls a function (a true near miss), a ``torch.cuda.synchronize()`` between (no candidate).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apply_support import make_repo, npufuse, scan
from npufuse import emulate
from pattern_harness import check_rewrite_runs, detect_all
from scratch_repo import import_fresh

from npufuse.patterns.add_rms_norm import AddRmsNorm


def _fused_runs_like_original(code: str, run: str, findings: list) -> dict:
    """The rewritten code runs npu_add_rms_norm and matches the original's outputs and gradients."""
    facts = check_rewrite_runs(AddRmsNorm(), code, run, findings)
    assert facts["all_calls"].get("npu_add_rms_norm"), facts["all_calls"]
    assert facts["n_out"][0] == facts["n_out"][1]
    assert all(c > 0.99999 for c in facts["cos_out"]), facts["cos_out"]
    assert all(c > 0.99999 for c in facts["cos_grad"]), facts["cos_grad"]
    return facts


_RMS = '''
import logging

import torch
import torch.nn as nn

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-4):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
'''

_RUN = '''
m = Block(16)
with torch.no_grad():
    for p in m.parameters():
        p.normal_()
    infer = [m(torch.randn(2, 5, 16), *extra) for extra in ({extras})]
x = torch.randn(2, 5, 16, requires_grad=True)
out = (infer, m(x))
leaves = [x]
'''

# -- 1. a debug block between the add and the norm --------------------------------------------------------------------

# a pre-norm block: attention and feed-forward, each after its own RMSNorm
_BLOCK = _RMS + '''

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attention_norm = RMSNorm(d)
        self.attention = nn.Linear(d, d)
        self.ffn_norm = RMSNorm(d)
        self.feed_forward = nn.Linear(d, d)
'''

_DEBUG_GAP = _BLOCK + '''

    def forward(self, x, debug_nan=False):
        attn_out = self.attention(self.attention_norm(x))
        x = x + attn_out
        {gap}
        ffn_norm_out = self.ffn_norm(x)
        return x + self.feed_forward(ffn_norm_out)
'''

_FLAG_GAP = '''if debug_nan:
            if torch.isnan(x).any() or torch.isinf(x).any():
                print(f"NaN count: {torch.isnan(x).sum().item()}")
                return None'''


def test_debug_check_of_the_sum_under_a_flag_between_add_and_norm_is_fused_where_the_flag_is_off() -> None:
    code = _DEBUG_GAP.replace("{gap}", _FLAG_GAP)
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [f.qualname for f in findings] == ["Block.forward"], misses
    assert findings[0].params["condition"].startswith("not (debug_nan)")
    _fused_runs_like_original(code, _RUN.format(extras="(), (True,)"), findings)


def test_nan_check_reading_the_sum_itself_between_add_and_norm_is_not_fused() -> None:
    # the test calls torch.isnan on the sum: it cannot be evaluated before the fused add (no flag to test first)
    gap = '''if torch.isnan(x).any():
            raise ValueError("NaN after attention")'''
    findings, _misses = detect_all(AddRmsNorm(), _DEBUG_GAP.replace("{gap}", gap))
    assert not findings


def test_flag_gap_whose_body_normalises_the_sum_itself_is_not_read_as_a_gap() -> None:
    # the body's own norm of the sum is the wrapper form's site; the gap reading (norm after the if) is not taken
    gap = '''if debug_nan:
            y = self.ffn_norm(x)
            print(y.abs().max())'''
    findings, _misses = detect_all(AddRmsNorm(), _DEBUG_GAP.replace("{gap}", gap))
    assert not any(f.params.get("condition", "").startswith("not (debug_nan)") for f in findings)


# -- 2. profiling markers between the add and the norm ----------------------------------------------------------------

_MARKED = _BLOCK + '''

    def forward(self, x, layer_idx=0):
        torch.cuda.nvtx.range_push(f"Attn_{layer_idx}")
        x = x + self.attention(
            self.attention_norm(x),
        )
        torch.cuda.nvtx.range_pop()
        {between}
        torch.cuda.nvtx.range_push(f"FFN_{layer_idx}")
        x = x + self.feed_forward(self.ffn_norm(x))
        torch.cuda.nvtx.range_pop()
        return x
'''


@pytest.fixture()
def nvtx_events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """torch.cuda.nvtx push / pop recorded (a CPU build has no NVTX); the list of events in call order."""
    events: list[str] = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda msg: events.append(f"push {msg}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: events.append("pop"))
    return events


def _balanced(events: list[str]) -> bool:
    depth = 0
    for e in events:
        depth += 1 if e.startswith("push") else -1
        if depth < 0:
            return False
    return depth == 0


def test_nvtx_range_markers_between_add_and_norm_travel_with_the_site(nvtx_events: list[str]) -> None:
    code = _MARKED.replace("{between}", 'logger.debug("layer %d attention done", layer_idx)')
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [(f.qualname, f.params["norm"]) for f in findings] == [("Block.forward", "self.ffn_norm")], misses
    _fused_runs_like_original(code, _RUN.format(extras="(), (1,)"), findings)
    # the original and the rewritten runs each pushed and popped the same ranges, in the same order
    half = len(nvtx_events) // 2
    assert nvtx_events[:half] == nvtx_events[half:] and _balanced(nvtx_events[:half]), nvtx_events
    assert "push FFN_1" in nvtx_events


def test_marker_whose_argument_calls_a_function_is_a_near_miss() -> None:
    code = _MARKED.replace("{between}", "").replace('range_push(f"FFN_{layer_idx}")', "range_push(describe(x))")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert not findings
    assert any("calls `describe`" in m.reason for m in misses), [m.reason for m in misses]


def test_synchronize_between_add_and_norm_is_not_moved() -> None:
    # not a marker: a statement npufuse does not move past the fused norm
    findings, _misses = detect_all(AddRmsNorm(), _MARKED.replace("{between}", "torch.cuda.synchronize()"))
    assert not findings


# -- 3. a norm forward returning from an if/else on its weight; a norm attribute built beside None --------------------

_OPTIONAL_WEIGHT = '''
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, trainable=False):
        super().__init__()
        self.eps = eps
        if trainable:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.weight = None

    def forward(self, x):
        x_dtype = x.dtype
        x = x.float()
        norm = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        {arms}


class Block(nn.Module):
    def __init__(self, d, trainable=True, cross=True):
        super().__init__()
        self.attn = nn.Linear(d, d)
        if cross:
            self.norm2 = RMSNorm(d, trainable=trainable)
            self.cross = nn.Linear(d, d)
        else:
            self.norm2 = None
            self.cross = None
        self.norm3 = RMSNorm(d, trainable=trainable)
        self.mlp = nn.Linear(d, d)

    def forward(self, x, gate):
        x = x + self.attn(x) * gate
        if self.norm2 is not None:
            h = self.norm2(x)
            x = x + self.cross(h) * gate
        h = self.norm3(x)
        return x + self.mlp(h)
'''

_WEIGHT_ARMS = '''if self.weight is not None:
            return (x * norm * self.weight).to(dtype=x_dtype)
        else:
            return (x * norm).to(dtype=x_dtype)'''

_OPTIONAL_RUN = '''
models = [Block(16), Block(16, trainable=False), Block(16, cross=False)]
with torch.no_grad():
    for m in models:
        for p in m.parameters():
            p.normal_()
    infer = [m(torch.randn(2, 5, 16), torch.rand(2, 1, 16)) for m in models]
x = torch.randn(2, 5, 16, requires_grad=True)
out = (infer, [m(x, torch.rand(2, 1, 16)) for m in models])
leaves = [x]
'''


def test_norm_forward_returning_from_an_if_on_its_weight_is_fused_where_the_weight_exists() -> None:
    code = _OPTIONAL_WEIGHT.replace("{arms}", _WEIGHT_ARMS)
    findings, misses = detect_all(AddRmsNorm(), code)
    assert sorted(f.params["norm"] for f in findings) == ["self.norm2", "self.norm3"], misses
    assert all(f"(self.{n}.weight is not None)" in f.params["condition"]
               for f, n in zip(sorted(findings, key=lambda f: f.params["norm"]), ("norm2", "norm3")))
    # each candidate alone (their spans overlap: the report asks to accept one of them)
    for f in findings:
        _fused_runs_like_original(code, _OPTIONAL_RUN, [f])


def test_weightless_arm_first_is_read_under_the_negated_test() -> None:
    arms = '''if self.weight is None:
            return (x * norm).to(dtype=x_dtype)
        return (x * norm * self.weight).to(dtype=x_dtype)'''
    code = _OPTIONAL_WEIGHT.replace("{arms}", arms)
    findings, misses = detect_all(AddRmsNorm(), code)
    assert findings and all("not (self.norm" in f.params["condition"] and "weight is None)" in f.params["condition"] for f in findings), misses
    _fused_runs_like_original(code, _OPTIONAL_RUN, [findings[0]])


def test_forward_choosing_its_arm_by_the_input_is_not_fused() -> None:
    # the test reads the input, not the module: npufuse does not re-evaluate it at the call site
    arms = '''if x_dtype == torch.float16:
            return (x * norm * self.weight).to(dtype=x_dtype)
        return x * norm * self.weight'''
    findings, _misses = detect_all(AddRmsNorm(), _OPTIONAL_WEIGHT.replace("{arms}", arms))
    assert not findings


def test_layer_norm_built_beside_none_is_a_true_near_miss() -> None:
    code = _OPTIONAL_WEIGHT.replace("{arms}", _WEIGHT_ARMS).replace(
        "self.norm2 = RMSNorm(d, trainable=trainable)", "self.norm2 = nn.LayerNorm(d)")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [f.params["norm"] for f in findings] == ["self.norm3"]
    assert any("mean subtracted" in m.reason for m in misses), [m.reason for m in misses]


# -- 4. a plain function handed the model (its class read from the file's callers) ------------------------------------

_HANDED_MODEL = '''
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-4):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        rms = torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + self.eps)
        return (x / rms) * self.weight


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attention_norm = RMSNorm(d)
        self.attention = nn.Linear(d, d)
        self.ffn_norm = {ffn_norm}
        self.feed_forward = nn.Linear(d, d)


class Model(nn.Module):
    def __init__(self, d, n=2):
        super().__init__()
        self.layers = nn.ModuleList([Layer(d) for _ in range(n)])


def update_load_balancing(model, x):
    for layer in model.layers:
        x = x + layer.attention(layer.attention_norm(x))
        x_norm = layer.ffn_norm(x)
        x = x + layer.feed_forward(x_norm)
    return x


def train(x, d=16):
    model = Model(d)
    model = model.to(x.device)
    {more}
    return update_load_balancing(model, x)
'''

_HANDED_RUN = '''
m = Model(16)
with torch.no_grad():
    for p in m.parameters():
        p.normal_()
    infer = update_load_balancing(m, torch.randn(2, 5, 16))
x = torch.randn(2, 5, 16, requires_grad=True)
out = (infer, update_load_balancing(m, x))
leaves = [x]
'''


def test_norm_of_a_layer_of_a_model_handed_to_a_plain_function_is_fused_under_its_class_test() -> None:
    code = _HANDED_MODEL.replace("{ffn_norm}", "RMSNorm(d)").replace("{more}", "")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [(f.qualname, f.params["norm"]) for f in findings] == [("update_load_balancing", "layer.ffn_norm")], misses
    assert "type(layer.ffn_norm) is RMSNorm" in findings[0].params["condition"]
    _fused_runs_like_original(code, _HANDED_RUN, findings)


def test_model_handed_by_callers_of_two_classes_is_not_read() -> None:
    # another call hands an object of another class: which layers the function walks is not one class
    more = "update_load_balancing(Other(), x)\n    other = nn.Sequential()\n    update_load_balancing(other, x)"
    code = _HANDED_MODEL.replace("{ffn_norm}", "RMSNorm(d)").replace("{more}", more)
    findings, _misses = detect_all(AddRmsNorm(), code)
    assert not findings


def test_layer_norm_of_a_handed_model_is_a_true_near_miss() -> None:
    code = _HANDED_MODEL.replace("{ffn_norm}", "nn.LayerNorm(d)").replace("{more}", "")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert not findings
    assert any("mean subtracted" in m.reason for m in misses), [m.reason for m in misses]


# -- 4b. the same across files: the plain function in a training script, the model and its norm in other files; a
# model file importing only ``from torch import nn`` (kimi-exp: the replacement names torch, which the rewrite's
# prelude imports; it was refused as a name "only the norm class's file imports") -------------------------------------

# the same RMSNorm class, in a file of its own
_PKG_NORM = "import torch\nfrom torch import nn\n\n\n" + _RMS[_RMS.index("class RMSNorm"):]

_PKG_MODEL = '''\
from torch import nn

from .norm import RMSNorm


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1 = RMSNorm(d)
        self.attn = nn.Linear(d, d)
        self.ln2 = RMSNorm(d)
        self.mlp = nn.Linear(d, d)

    def forward(self, x):
        residual = x
        x = self.ln1(x)
        x = self.attn(x)
        x = x + residual

        residual = x
        x = self.ln2(x)
        x = self.mlp(x)
        return x + residual


class Model(nn.Module):
    def __init__(self, d, n=2):
        super().__init__()
        self.layers = nn.ModuleList([Layer(d) for _ in range(n)])
'''

_PKG_TRAIN = '''\
import torch

from pkg.model import Model


def update_load_balancing(model, x):
    for layer in model.layers:
        x = x + layer.attn(layer.ln1(x))
        h = layer.ln2(x)
        x = x + layer.mlp(h)
    return x


def train(x):
    model = Model(16)
    model = torch.compile(model) if x.is_cuda else model
    return update_load_balancing(model, x)

'''


def test_plain_function_of_a_training_script_and_a_model_file_without_torch_are_fused(tmp_path: Path) -> None:
    files = {"pkg/__init__.py": "", "pkg/norm.py": _PKG_NORM, "pkg/model.py": _PKG_MODEL, "pkg/train.py": _PKG_TRAIN}

    def outputs(root: Path) -> list[torch.Tensor]:
        train, model_file = import_fresh(root, "pkg.train"), import_fresh(root, "pkg.model")
        torch.manual_seed(0)
        model = model_file.Model(16)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
            x = torch.randn(2, 5, 16)
            outs = [train.update_load_balancing(model, x), model.layers[0](x)]
        return outs + [train.update_load_balancing(model, x), model.layers[0](x)]

    ref = outputs(make_repo(tmp_path / "ref", files))
    root = make_repo(tmp_path / "repo", files)
    data = scan(root, patterns=[AddRmsNorm()])
    cands = {(c["file"], c["qualname"]): c for c in data["candidates"] if c["pattern"] == "add_rms_norm"}
    assert set(cands) == {("pkg/train.py", "update_load_balancing"), ("pkg/model.py", "Layer.forward")}, \
        (sorted(cands), data["near_misses"])
    # another file's class: told at run time by its qualname and its forward's file
    assert '__qualname__ == "RMSNorm"' in cands[("pkg/train.py", "update_load_balancing")]["params"]["condition"]
    assert npufuse("apply", "--accept", "all", "--state-dir", str(root / ".npufuse")) == 0
    assert "import torch  # npufuse" in (root / "pkg/model.py").read_text()
    with emulate.install() as emu:
        outs = outputs(root)
    # without grad: two layers walked by the script, one layer forward; with grad the add, then npu_rms_norm
    assert emu.calls["npu_add_rms_norm"] == 3 and emu.calls["npu_rms_norm"] == 3, emu.calls
    for a, b in zip(ref, outs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


# -- 5. a norm applied through a None-guarding helper method ------------------------------------------------------------

_GUARDING_HELPER = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d_model, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(variance + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, d, use_rmsnorm=True, pre_norm=True):
        super().__init__()
        self.pre_norm = pre_norm
        self.ln1 = RMSNorm(d) if use_rmsnorm else None
        self.ln2 = RMSNorm(d) if use_rmsnorm else None
        self.attn = nn.Linear(d, d)
        self.ffn = nn.Linear(d, d)

    def _norm(self, norm, x):
        {helper}

    def forward(self, x):
        if self.pre_norm:
            x = x + self.attn(self._norm(self.ln1, x))
            x = x + self.ffn(self._norm(self.ln2, x))
            return x
        x = self._norm(self.ln1, x + self.attn(x))
        x = self._norm(self.ln2, x + self.ffn(x))
        return x
'''

_HELPER_RUN = '''
models = [Block(16), Block(16, pre_norm=False), Block(16, use_rmsnorm=False), Block(16, False, False)]
with torch.no_grad():
    for m in models:
        for p in m.parameters():
            p.normal_()
    infer = [m(torch.randn(2, 5, 16)) for m in models]
x = torch.randn(2, 5, 16, requires_grad=True)
out = (infer, [m(x) for m in models])
leaves = [x]
'''


@pytest.mark.parametrize("helper", ["return norm(x) if norm is not None else x",
                                    "if norm is None:\n            return x\n        return norm(x)"])
def test_norm_applied_through_a_none_guarding_helper_is_fused_where_the_module_exists(helper: str) -> None:
    code = _GUARDING_HELPER.replace("{helper}", helper)
    findings, misses = detect_all(AddRmsNorm(), code)
    # the pre-norm pair (x + attn, then ln2 inside the next add) and both post-norm lines
    assert sorted((f.params["sum"] or "inline", f.params["condition"]) for f in findings) == [
        ("inline", "self.ln1 is not None"), ("inline", "self.ln2 is not None"), ("x", "self.ln2 is not None")], misses
    _fused_runs_like_original(code, _HELPER_RUN, findings)


@pytest.mark.parametrize("helper", ["return norm(x) if norm is not None else x.float()",
                                    "return 2 * norm(x) if norm is not None else x",
                                    "return norm(x) if x.dim() == 3 else x"])
def test_helper_that_does_more_than_guard_the_norm_is_not_read(helper: str) -> None:
    # another value where the module is None, a factor on the norm, a test of the input: not ``norm(x)`` or ``x``
    findings, _misses = detect_all(AddRmsNorm(), _GUARDING_HELPER.replace("{helper}", helper))
    assert not findings
