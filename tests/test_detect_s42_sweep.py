"""s42 recall sweep (helper sweep42): the classes behind the misses on bench/detect_labels_sweep42.json, seven
repositories labelled before npufuse was run on them.

A1 rms_norm / add_rms_norm (memes2, 8 + 1 sites): ``nn.RMSNorm`` constructed through a module-level alias
   (``LayerNormImpl = nn.RMSNorm``; ``LayerNormImpl([d], elementwise_affine=True)``) was not seen: names bound once at
   module level to a torch API now resolve to that API (``ModuleInfo.assigned_aliases``). Near misses: a name bound
   twice, or bound to a conditional choice, or to LayerNorm, is no RMSNorm.
"""

from __future__ import annotations

from pathlib import Path

from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.registry import all_patterns
from npufuse.patterns.rope import RopePattern
from npufuse.scan import engine
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import detect_all, found_and_faithful


def _scan(tmp_path: Path, code: str) -> engine.FileOutcome:
    (tmp_path / "site.py").write_text(code, encoding="utf-8")
    return engine.analyze_file(tmp_path, "site.py", all_patterns(), engine.ScanOptions())


def _hits(out: engine.FileOutcome, pattern: str) -> list[tuple[str, int]]:
    return [(h.finding.qualname, h.finding.line) for h in out.hits if h.finding.pattern == pattern]


def _nothing_found(pattern, code: str) -> bool:
    return not detect_all(pattern, code)[0]


# -- A1: a module-level alias of nn.RMSNorm

_ALIASED_NORM = """
import torch
from torch import nn

NormImpl = nn.RMSNorm


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn_norm = NormImpl([d], elementwise_affine=True)
        self.ff_norm = NormImpl([d], elementwise_affine=True)
        self.attn = nn.Linear(d, d)
        self.ff = nn.Linear(d, d)

    def forward(self, x):
        h = self.attn(self.attn_norm(x))
        x = h + x
        h = self.ff_norm(x)
        return x + self.ff(h)
"""


def test_a_module_level_alias_resolves_to_the_torch_api() -> None:
    import ast

    info = ModuleInfo.from_source("m.py", _ALIASED_NORM, ast.parse(_ALIASED_NORM))
    assert info.assigned_aliases == {"NormImpl": "torch.nn.RMSNorm"}
    assert info.canonical(ast.parse("NormImpl").body[0].value) == "torch.nn.RMSNorm"


def test_rmsnorm_built_through_a_module_level_alias_is_found(tmp_path: Path) -> None:
    out = _scan(tmp_path, _ALIASED_NORM)
    assert _hits(out, "rms_norm") == [("Block.__init__", 11), ("Block.__init__", 12)]
    assert [q for q, _ in _hits(out, "add_rms_norm")] == ["Block.forward"]


def test_a_name_bound_twice_is_no_alias(tmp_path: Path) -> None:
    code = _ALIASED_NORM.replace("NormImpl = nn.RMSNorm\n", "NormImpl = nn.RMSNorm\nNormImpl = nn.LayerNorm\n")
    out = _scan(tmp_path, code)
    assert not _hits(out, "rms_norm")
    # the add + norm stays a candidate only behind the run-time class test it always had
    for h in out.hits:
        if h.finding.pattern == "add_rms_norm":
            assert h.finding.params["condition"].startswith("type(self.ff_norm) is torch.nn.RMSNorm")


def test_a_conditional_choice_of_norm_class_is_no_alias(tmp_path: Path) -> None:
    code = _ALIASED_NORM.replace("NormImpl = nn.RMSNorm\n", "USE_RMS = True\nNormImpl = nn.RMSNorm if USE_RMS else nn.LayerNorm\n")
    out = _scan(tmp_path, code)
    assert not _hits(out, "rms_norm")


def test_an_alias_of_layernorm_is_no_rmsnorm(tmp_path: Path) -> None:
    out = _scan(tmp_path, _ALIASED_NORM.replace("nn.RMSNorm", "nn.LayerNorm"))
    assert not _hits(out, "rms_norm") and not _hits(out, "add_rms_norm")


# -- A2: rope with the minus written on a factor (``sin * -b``)

_NEG_FACTOR_ROPE = '''
import torch
from torch import nn


class RotaryPositionalEncoding(nn.Module):
    def __init__(self, d_hidden, seq_len, base=50000):
        super().__init__()
        dim_idx = torch.arange(0, d_hidden, 2, dtype=torch.float64)
        theta = base ** (-dim_idx / d_hidden)
        angles = theta.unsqueeze(0) * torch.arange(seq_len).type_as(theta).unsqueeze(-1)
        self.register_buffer("sin_cached", angles.sin(), persistent=False)
        self.register_buffer("cos_cached", angles.cos(), persistent=False)

    def forward(self, x):
        dtype = x.dtype
        a = x[..., 0::2]
        b = x[..., 1::2]
        cos = self.cos_cached.narrow(-2, 0, a.shape[-2])
        sin = self.sin_cached.narrow(-2, 0, a.shape[-2])
        a2 = (cos * a + sin * -b).to(dtype=dtype)
        b2 = (sin * a + cos * b).to(dtype=dtype)
        return torch.stack((a2, b2), dim=-1).flatten(-2, -1)
'''

_NEG_FACTOR_RUN = '''
rope = RotaryPositionalEncoding(16, 32)
x = torch.randn(2, 4, 8, 16, requires_grad=True)
out = rope(x)
leaves = [x]
'''


def test_rope_with_the_minus_on_a_factor_is_found_and_runs() -> None:
    findings = found_and_faithful(RopePattern(), _NEG_FACTOR_ROPE, _NEG_FACTOR_RUN)
    assert [(f.qualname, f.line) for f in findings] == [("RotaryPositionalEncoding.forward", 21)]


def test_the_minus_on_the_wrong_factor_is_no_rotation() -> None:
    # (cos*a - sin*b, -sin*a + cos*b)... written with the minus on `a` in the second part: a reflection, not a rotation
    assert _nothing_found(RopePattern(), _NEG_FACTOR_ROPE.replace("b2 = (sin * a + cos * b)", "b2 = (sin * -a - cos * b)"))


# -- A3: CS336's functional rope: lane pairs cut by ``x.reshape(*x.shape[:-1], d_k // 2, 2)`` (a size written out
# beside the 2), rotated parts stacked into a name that the next statement merges with ``reshape_as``

_CS336_ROPE = '''
import torch


def rope(d_k, theta, in_query_or_key, token_positions):
    dtype = in_query_or_key.dtype
    inv_freq = 1.0 / (theta ** (torch.arange(0, d_k, 2, dtype=dtype) / d_k))
    angles = token_positions.to(dtype)[..., None] * inv_freq
    cos = torch.cos(angles)
    sin = torch.sin(angles)
    x = in_query_or_key.reshape(*in_query_or_key.shape[:-1], d_k // 2, 2)
    x1 = x[..., 0]
    x2 = x[..., 1]
    out1 = x1 * cos - x2 * sin
    out2 = x1 * sin + x2 * cos
    out = torch.stack([out1, out2], dim=-1)
    return out.reshape_as(in_query_or_key)
'''

_CS336_RUN = '''
q = torch.randn(2, 4, 8, 16, requires_grad=True)
out = rope(16, 10000.0, q, torch.arange(8))
leaves = [q]
'''


def test_cs336_lane_pair_rope_is_found_and_runs() -> None:
    findings = found_and_faithful(RopePattern(), _CS336_ROPE, _CS336_RUN)
    assert [(f.qualname, f.params["mode"]) for f in findings] == [("rope", "interleave")]


def test_a_two_by_half_view_indexed_on_its_last_axis_is_no_lane_pair() -> None:
    # (2, d_k // 2): x[..., 0] is a column of the halves view, not the even lanes
    assert _nothing_found(RopePattern(), _CS336_ROPE.replace("d_k // 2, 2)", "2, d_k // 2)"))


def test_stacked_parts_in_the_wrong_order_are_no_rotation() -> None:
    assert _nothing_found(RopePattern(), _CS336_ROPE.replace("torch.stack([out1, out2]", "torch.stack([out2, out1]"))


# -- A4: add_rms_norm with CS336's functional norm: ``rmsnorm(d_model, eps, weights, in_features)`` normalizes its
# LAST parameter (passed by keyword) and the weight is read from a state dict by a string key

_FUNCTIONAL_BLOCK = '''
import math
import torch


def rmsnorm(d_model, eps, weights, in_features):
    variance = in_features.pow(2).mean(dim=-1, keepdim=True)
    normalized = in_features / torch.sqrt(variance + eps)
    return normalized * weights


def ffn(w, x):
    return torch.relu(x @ w.t())


def block(d_model, weights, in_features):
    x = in_features
    h = ffn(weights["attn.weight"], rmsnorm(d_model, eps=1e-5, weights=weights["ln1.weight"], in_features=x))
    x = x + h
    x_norm = rmsnorm(d_model, eps=1e-5, weights=weights["ln2.weight"], in_features=x)
    return x + ffn(weights["ffn.weight"], x_norm)
'''

_FUNCTIONAL_RUN = '''
d = 16
weights = {k: torch.randn(d, d) if "ln" not in k else torch.rand(d) + 0.5 for k in ("attn.weight", "ffn.weight", "ln1.weight", "ln2.weight")}
x = torch.randn(2, 5, d, requires_grad=True)
out = block(d, weights, x)
leaves = [x]
'''


def test_a_functional_norm_of_a_later_parameter_after_the_add_is_found_and_runs() -> None:
    findings = found_and_faithful(AddRmsNorm(), _FUNCTIONAL_BLOCK, _FUNCTIONAL_RUN)
    assert [(f.qualname, f.line, f.end_line) for f in findings] == [("block", 19, 20)]


def test_the_sum_passed_as_the_weight_is_no_norm_of_the_sum() -> None:
    assert _nothing_found(AddRmsNorm(), _FUNCTIONAL_BLOCK.replace('weights=weights["ln2.weight"], in_features=x)',
                                                                  'weights=x, in_features=weights["ln2.weight"])'))


def test_a_weight_row_of_a_tensor_stays_refused() -> None:
    # ``weights[1]``: an integer index may be a row of one tensor (a per-layer table), not a stored gamma
    assert _nothing_found(AddRmsNorm(), _FUNCTIONAL_BLOCK.replace('weights["ln2.weight"], in_features=x)', 'weights[1], in_features=x)'))
