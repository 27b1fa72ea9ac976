"""s47 (helper ho24norm): add_rms_norm norms npufuse could not resolve (HO24a / HO24b misses, read by the judge).

A a norm forward starting with an input check that raises where the input's trailing dims are not the shape its weight
   is built with (``if x.shape[-len(self.normalized_shape):] != self.normalized_shape: raise``), the norm picked by a
   constructor flag (``RMSNorm(d) if use_rms_norm else nn.LayerNorm(d)``). npu_(add_)rms_norm refuses such a gamma,
   so the fused call raises where the check does. Keep: a check of another property (the rank).
B a norm forward returning early on a device branch an NPU tensor never takes (``x.device.type == "privateuseone"``,
   DirectML; ``"mps"``), its return inside ``with torch.autocast(..., enabled=False):``. Keep: a branch on ``"npu"``.
C a library RMSNorm under another name (``from liger_kernel.transformers import LigerRMSNorm as LayerNorm``,
   ``LayerNorm = LigerRMSNorm`` in this file or in the repository file it is imported from): the import decides.
   Keep: a library LayerNorm under such an alias, a repository alias of ``nn.LayerNorm``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from apply_support import make_repo, scan
from npufuse.patterns.add_rms_norm import AddRmsNorm
from pattern_harness import check_rewrite_runs, detect_all, found_and_faithful, install_stand_in_modules

def _line(code: str, text: str) -> int:
    return next(i for i, ln in enumerate(code.splitlines(), 1) if text in ln)


# -- A: a shape check raising before the norm, the norm chosen by a flag

_CHECKED = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-05):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = normalized_shape
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(self.normalized_shape))

    def forward(self, x):
        if x.shape[-len(self.normalized_shape):] != self.normalized_shape:
            exp_shape = f"(*, {', '.join(str(_) for _ in self.normalized_shape)})"
            raise RuntimeError(f"Expected input shape {exp_shape}, but got {x.shape}.")
        norm_dims = tuple(range(-len(self.normalized_shape), 0))
        ms = x.float().square().mean(dim=norm_dims, keepdim=True)
        rms = torch.sqrt(ms + self.eps).to(x.dtype)
        norm = x / rms
        return norm * self.weight


class Block(nn.Module):
    def __init__(self, dim, use_rms_norm=False, dropout=0.0):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.ln1 = RMSNorm(dim) if use_rms_norm else nn.LayerNorm(dim)
        self.ff = nn.Linear(dim, dim)
        self.ln2 = RMSNorm(dim) if use_rms_norm else nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        out = x
        attn = self.attn(self.ln1(out))
        out = out + self.dropout(attn)
        out = out + self.dropout(self.ff(self.ln2(out)))
        return out
'''

_CHECKED_RUN = '''
torch.manual_seed(0)
block = Block(16, use_rms_norm=True).to(DTYPE)
with torch.no_grad():
    block.ln2.weight.uniform_(0.5, 1.5)
x = torch.randn(2, 5, 16, dtype=DTYPE, requires_grad=True)
out = block(x).float()
leaves = [x, block.ln2.weight]
'''

# a second spelling: the last dim against the width the weight is built from, a ValueError
_CHECKED_WIDTH = _CHECKED.replace(
    '''        if x.shape[-len(self.normalized_shape):] != self.normalized_shape:
            exp_shape = f"(*, {', '.join(str(_) for _ in self.normalized_shape)})"
            raise RuntimeError(f"Expected input shape {exp_shape}, but got {x.shape}.")
        norm_dims = tuple(range(-len(self.normalized_shape), 0))
        ms = x.float().square().mean(dim=norm_dims, keepdim=True)''',
    '''        if x.size(-1) != self.dim:
            raise ValueError(f"expected width {self.dim}, got {x.size(-1)}")
        ms = x.float().square().mean(dim=-1, keepdim=True)''').replace(
    '''        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = normalized_shape
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(self.normalized_shape))''',
    '''        self.dim = normalized_shape
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(normalized_shape))''')


@pytest.mark.parametrize("code", [_CHECKED, _CHECKED_WIDTH], ids=["trailing_shape", "last_width"])
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_a_norm_with_a_weight_shape_check_chosen_by_a_flag_is_fused_and_runs(code: str, dtype: str) -> None:
    findings = found_and_faithful(AddRmsNorm(), code, _CHECKED_RUN.replace("DTYPE", dtype))
    assert [(f.qualname, f.line) for f in findings] == [("Block.forward", _line(code, "out = out + self.dropout(attn)"))]
    # the run-time class test sends the LayerNorm configuration to the original code
    assert "type(self.ln2) is RMSNorm" in findings[0].fused


def test_a_fused_ops_refuse_the_shapes_the_check_refuses() -> None:
    # the check raises where the input's trailing dims are not the weight's shape; so do the fused ops (spec: gamma's
    # shape is the input's trailing dims), so dropping the check with the norm call loses no refusal
    from npufuse import emulate

    with emulate.install():
        import torch_npu

        x, gamma = torch.randn(2, 5, 12), torch.ones(16)
        with pytest.raises(Exception):
            torch_npu.npu_rms_norm(x, gamma, epsilon=1e-5)
        with pytest.raises(Exception):
            torch_npu.npu_add_rms_norm(x, x, gamma, epsilon=1e-5)


@pytest.mark.parametrize("check", ["x.ndim != 3", "x.shape[-2:] != self.normalized_shape"])
def test_a_check_of_another_property_stays_unfused(check: str) -> None:
    code = _CHECKED.replace("x.shape[-len(self.normalized_shape):] != self.normalized_shape", check)
    findings, misses = detect_all(AddRmsNorm(), code)
    assert findings == []
    reasons = [m.reason for m in misses if m.line == _line(code, "out = out + self.dropout(attn)")]
    assert len(reasons) == 1 and f"first checks `{check}` and raises" in reasons[0]
    assert reasons[0].startswith("no module this choice builds can be fused")


# -- B: a device branch an NPU tensor never takes, returning inside an autocast block

_DEVICE_BRANCH = '''
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if x.device.type == 'privateuseone':
            with torch.autocast('privateuseone', enabled=False):
                x_float = x.float()
                variance = (x_float * x_float).mean(-1, keepdim=True)
                normed = x_float * torch.rsqrt(variance + self.eps)
                return normed * self.weight
        variance = (x * x).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.eps) * self.weight


class TransformerBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attention = nn.Linear(dim, dim)
        self.feed_forward = nn.Linear(dim, dim)
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)

    def forward(self, x):
        attn_out = self.attention(self.attention_norm(x))
        h = x + attn_out
        out = h + self.feed_forward(self.ffn_norm(h))
        return out
'''

_DEVICE_RUN = '''
torch.manual_seed(0)
block = TransformerBlock(16)
with torch.no_grad():
    block.ffn_norm.weight.uniform_(0.5, 1.5)
x = torch.randn(2, 5, 16, requires_grad=True)
out = block(x)
leaves = [x, block.ffn_norm.weight]
'''


@pytest.mark.parametrize("device", ["privateuseone", "mps"])
def test_b_norm_returning_early_on_a_device_branch_is_fused_and_runs(device: str) -> None:
    code = _DEVICE_BRANCH.replace("'privateuseone'", repr(device))
    findings = found_and_faithful(AddRmsNorm(), code, _DEVICE_RUN)
    assert [(f.qualname, f.line) for f in findings] == [("TransformerBlock.forward", _line(code, "h = x + attn_out"))]


def test_b_branch_taken_on_an_npu_tensor_stays_unfused() -> None:
    code = _DEVICE_BRANCH.replace("if x.device.type == 'privateuseone':", "if x.device.type == 'npu':")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert findings == []
    assert [m.line for m in misses if "true for an NPU tensor" in m.reason] == [_line(code, "h = x + attn_out")]


# -- C: a library RMSNorm under another name

_LIGER_ALIAS = '''
import torch
import torch.nn as nn
from liger_kernel.transformers import LigerRMSNorm as LayerNorm


class EncoderBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = nn.Linear(dim, dim)
        self.norm1 = LayerNorm(dim)
        self.ff = nn.Linear(dim, dim)
        self.norm2 = LayerNorm(dim)

    def forward(self, hidden_states):
        attn = self.attn(self.norm1(hidden_states))
        hidden_states = hidden_states + attn
        normed = self.norm2(hidden_states)
        return hidden_states + self.ff(normed)
'''


class _LigerRMSNorm(nn.Module):
    """Stand-in with liger's attributes and llama casting (fp32 statistics, cast back before the weight)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)
        return y * (self.offset + self.weight)


_LigerRMSNorm.__name__ = "LigerRMSNorm"

_LIGER_RUN = '''
torch.manual_seed(0)
block = EncoderBlock(16)
with torch.no_grad():
    block.norm2.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 16)
    out = block(x)
leaves = []
'''


@pytest.mark.parametrize("spelling", ["import_as", "module_alias"])
def test_c_library_rms_norm_under_an_alias_is_fused_and_runs(monkeypatch: pytest.MonkeyPatch, spelling: str) -> None:
    install_stand_in_modules(monkeypatch, {"liger_kernel.transformers": {"LigerRMSNorm": _LigerRMSNorm}})
    code = _LIGER_ALIAS if spelling == "import_as" else _LIGER_ALIAS.replace(
        "from liger_kernel.transformers import LigerRMSNorm as LayerNorm",
        "from liger_kernel.transformers import LigerRMSNorm\n\nLayerNorm = LigerRMSNorm")
    findings, _ = detect_all(AddRmsNorm(), code)
    assert len(findings) == 1 and "type(self.norm2).__name__ == 'LigerRMSNorm'" in findings[0].fused
    # inference is fused (training keeps the library module's call)
    facts = check_rewrite_runs(AddRmsNorm(), code, _LIGER_RUN, findings)
    assert facts["all_calls"].get("npu_add_rms_norm", 0) == 1 and min(facts["cos_out"]) > 0.9999


def test_c_alias_defined_in_another_file_of_the_repository_is_resolved(tmp_path: Path) -> None:
    component = "from liger_kernel.transformers.rms_norm import LigerRMSNorm\n\nLayerNorm = LigerRMSNorm\n"
    block = _LIGER_ALIAS.replace("from liger_kernel.transformers import LigerRMSNorm as LayerNorm",
                                 "from pkg._component import LayerNorm")
    data = scan(make_repo(tmp_path / "a", {"pkg/__init__.py": "", "pkg/_component.py": component, "pkg/block.py": block}),
                patterns=(AddRmsNorm(),))
    assert [(c["qualname"], c["line"]) for c in data["candidates"]] == [("EncoderBlock.forward", _line(block, "hidden_states = hidden_states + attn"))]
    # a repository alias of torch's LayerNorm is no RMSNorm
    other = "import torch.nn as nn\n\nLayerNorm = nn.LayerNorm\n"
    data = scan(make_repo(tmp_path / "b", {"pkg/__init__.py": "", "pkg/_component.py": other, "pkg/block.py": block}),
                patterns=(AddRmsNorm(),))
    assert data["candidates"] == []


def test_c_library_layer_norm_under_an_alias_stays_unfused() -> None:
    code = _LIGER_ALIAS.replace("LigerRMSNorm as LayerNorm", "LigerLayerNorm as LayerNorm")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert findings == []
    assert [m.reason for m in misses] == [
        "norm is not RMSNorm (`LayerNorm` is liger_kernel.transformers.LigerLayerNorm, a LayerNorm: mean subtracted)"]


# -- D: a factor multiplied into the norm's output afterwards (a constant ``position_scale`` buffer, in place): not
#    folded into gamma yet; the near miss says so (it said "not x * rsqrt(mean(x^2) + eps) * weight", which is false)

_POST_SCALED = '''
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, d_model, eps=1e-5, position=None):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d_model))
        self.eps = eps
        scale = torch.tensor(1.0) if position is None else torch.rsqrt(torch.tensor(float(position)))
        self.register_buffer("position_scale", scale, persistent=False)

    def forward(self, x):
        in_dtype = x.dtype
        x = x.to(torch.float32)
        with torch.autocast("cuda", enabled=False):
            reverse_rms = torch.rsqrt((x * x).mean(-1) + self.eps).unsqueeze(-1)
            out = x * reverse_rms * self.gain
        out.mul_(self.position_scale)
        return out.to(in_dtype)


class Block(nn.Module):
    def __init__(self, d_model, position=None):
        super().__init__()
        self.ln1 = RMSNorm(d_model, position=position)
        self.attn = nn.Linear(d_model, d_model)
        self.ln2 = RMSNorm(d_model, position=position)
        self.ffn = nn.Linear(d_model, d_model)

    def forward(self, x):
        attn_out = self.attn(self.ln1(x))
        y = x + attn_out
        return y + self.ffn(self.ln2(y))
'''


@pytest.mark.parametrize("scale", ["out.mul_(self.position_scale)", "out = out * self.position_scale"])
def test_d_post_scaled_norm_gets_a_true_near_miss(scale: str) -> None:
    """s48 (fix48) lifted this near miss: the 0-dim buffer folds into a float32 gamma (tests/test_detect_s48_fix48.py);
    a factor not proven one number keeps the s47 reason."""
    code = _POST_SCALED.replace("out.mul_(self.position_scale)", scale)
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [f.qualname for f in findings] == ["Block.forward"]
    code = code.replace('self.register_buffer("position_scale", scale, persistent=False)',
                        'self.register_buffer("position_scale", scale * torch.ones(d_model), persistent=False)')
    findings, misses = detect_all(AddRmsNorm(), code)
    assert findings == []
    assert [m.line for m in misses] == [_line(code, "y = x + attn_out")]
    assert "position_scale" in misses[0].reason, misses[0].reason


# -- E: the add + norm inside a closure of the method, reading the method's ``self`` (run directly or checkpointed)

_CLOSURE = '''
import torch
import torch.nn as nn
import torch.utils.checkpoint


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        variance = (x * x).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.eps) * self.weight


class TransformerBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attention = nn.Linear(dim, dim)
        self.feed_forward = nn.Linear(dim, dim)
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)
        self.use_checkpoint = False

    def forward(self, x, mask=None):
        def _forward_block(x, mask):
            attn_out = self.attention(self.attention_norm(x))
            h = x + attn_out
            out = h + self.feed_forward(self.ffn_norm(h))
            return out

        if self.use_checkpoint and self.training:
            return torch.utils.checkpoint.checkpoint(_forward_block, x, mask, use_reentrant=False)
        return _forward_block(x, mask)
'''

# a second spelling: the closure takes one argument and the block's both sums are in it
_CLOSURE_2 = _CLOSURE.replace('''        def _forward_block(x, mask):
            attn_out = self.attention(self.attention_norm(x))
            h = x + attn_out
            out = h + self.feed_forward(self.ffn_norm(h))
            return out
''', '''        def _forward_block(h, mask):
            h = h + self.attention(self.attention_norm(h))
            h = h + self.feed_forward(self.ffn_norm(h))
            return h
''')

_CLOSURE_RUN = '''
torch.manual_seed(0)
block = TransformerBlock(16)
block.use_checkpoint = CKPT
with torch.no_grad():
    block.ffn_norm.weight.uniform_(0.5, 1.5)
    block.attention_norm.weight.uniform_(0.5, 1.5)
x = torch.randn(2, 5, 16, requires_grad=True)
out = block(x)
leaves = [x, block.ffn_norm.weight]
'''


@pytest.mark.parametrize("code", [_CLOSURE, _CLOSURE_2], ids=["named_sum", "rebound_input"])
@pytest.mark.parametrize("ckpt", ["False", "True"])
def test_e_add_norm_in_a_closure_of_the_method_is_fused_and_runs(code: str, ckpt: str) -> None:
    findings = found_and_faithful(AddRmsNorm(), code, _CLOSURE_RUN.replace("CKPT", ckpt))
    want = "h = x + attn_out" if code is _CLOSURE else "h = h + self.attention(self.attention_norm(h))"
    assert [(f.qualname, f.line) for f in findings] == [("TransformerBlock.forward._forward_block", _line(code, want))]


def test_e_closure_over_a_layer_norm_gets_a_true_near_miss() -> None:
    code = _CLOSURE.replace("self.ffn_norm = RMSNorm(dim)", "self.ffn_norm = nn.LayerNorm(dim)")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert findings == []
    assert [(m.qualname, m.reason) for m in misses] == [
        ("TransformerBlock.forward._forward_block", "norm is not RMSNorm (nn.LayerNorm: mean subtracted); npu_add_layer_norm fuses "
         "add + LayerNorm (not an npufuse pattern yet)")]


# -- F: mean over the last dim without keepdim, the column restored by ``.unsqueeze(-1)`` (== keepdim=True)

_UNSQUEEZED = '''
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-8):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_squared = x.pow(2)
        x_mean_squared = x_squared.mean(-1)
        rms = (x_mean_squared + self.eps).sqrt()
        rms = rms.unsqueeze(-1)
        x_norm = x / rms
        return x_norm * self.weight
'''

# a second spelling: fp32, the rsqrt unsqueezed in one expression, one cast back (HO24a core.py without its post-scale)
_UNSQUEEZED_RSQRT = '''
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, d_model, eps=1e-5):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x):
        in_dtype = x.dtype
        x = x.to(torch.float32)
        reverse_rms = torch.rsqrt((x * x).mean(-1) + self.eps).unsqueeze(-1)
        out = x * reverse_rms * self.gain
        return out.to(in_dtype)
'''

_NORM_RUN = '''
torch.manual_seed(0)
norm = RMSNorm(16)
with torch.no_grad():
    for p in norm.parameters():
        p.uniform_(0.5, 1.5)
norm = norm.to(DTYPE)
x = torch.randn(2, 5, 16, dtype=DTYPE, requires_grad=True)
out = norm(x).float()
leaves = [x, *norm.parameters()]
'''


@pytest.mark.parametrize("code", [_UNSQUEEZED, _UNSQUEEZED_RSQRT], ids=["sqrt_divide", "rsqrt_fp32"])
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_f_mean_without_keepdim_then_unsqueeze_is_fused_and_runs(code: str, dtype: str) -> None:
    from npufuse.patterns.rms_norm import RmsNorm

    findings = found_and_faithful(RmsNorm(), code, _NORM_RUN.replace("DTYPE", dtype))
    assert [f.qualname for f in findings] == ["RMSNorm.forward"] and findings[0].variant != "numeric_probe"


def test_f_kept_mean_unsqueezed_again_stays_unfused() -> None:
    from npufuse.patterns.rms_norm import RmsNorm

    code = _UNSQUEEZED_RSQRT.replace("(x * x).mean(-1)", "(x * x).mean(-1, keepdim=True)")
    findings, misses = detect_all(RmsNorm(), code)
    assert findings == []
    assert any("keepdim=True, then unsqueeze(-1)" in m.reason for m in misses)


def test_f_add_and_a_norm_of_another_file_spelled_so_is_fused(tmp_path: Path) -> None:
    block = '''
import torch.nn as nn

from pkg.rms_norm import RMSNorm


class TransformerBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.norm2 = RMSNorm(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x):
        x_in = x
        out = self.attn(self.norm1(x))
        x = x_in + out
        x_in = x
        x = self.norm2(x)
        x = self.mlp(x)
        return x_in + x
'''
    data = scan(make_repo(tmp_path, {"pkg/__init__.py": "", "pkg/rms_norm.py": _UNSQUEEZED, "pkg/block.py": block}),
                patterns=(AddRmsNorm(),))
    assert [(c["qualname"], c["line"]) for c in data["candidates"]] == [("TransformerBlock.forward", _line(block, "x = x_in + out"))]


def test_a_module_that_is_no_norm_is_not_called_one() -> None:
    # a gated residual module called on the sum (transformers' qwen4_exp hyper-connections), checking its input first:
    # no reason may call it a norm
    code = _CHECKED_WIDTH.replace('''        ms = x.float().square().mean(dim=-1, keepdim=True)
        rms = torch.sqrt(ms + self.eps).to(x.dtype)
        norm = x / rms
        return norm * self.weight''', '''        return x * torch.sigmoid(self.weight)''').replace("class RMSNorm", "class GatedResidual").replace(
        "RMSNorm(dim) if use_rms_norm", "GatedResidual(dim) if use_rms_norm").replace(
        "if x.size(-1) != self.dim:", "if x.size(-1) != 2 * self.dim:")
    assert "2 * self.dim" in code and "GatedResidual(dim)" in code
    findings, misses = detect_all(AddRmsNorm(), code)
    assert findings == [] and not any("first checks" in m.reason for m in misses)
