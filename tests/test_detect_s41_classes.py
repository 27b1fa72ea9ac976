"""s41 recall classes outside MoE (helper classes41): attention scores masked by a helper method of the same
class; norms / GLUs in files that never ``import torch`` (``from torch import Tensor, nn``; ``Tensor.rsqrt(x)``);
each class with Fuse and near-miss (Keep) examples, the Fuse ones run under the emulator against the original."""

from __future__ import annotations

import pytest
from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.attention import AttentionPattern

# --- attention: the causal (or other boolean) mask applied by a method of the same class ----------------------

_HELPER_HEAD = '''
import math
import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, d=32, nh=4):
        super().__init__()
        self.nh, self.hd = nh, d // nh
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("bias", torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16))
        self.slopes = nn.Parameter(torch.linspace(0.1, 0.5, nh))
'''

# nanoGPT's projection to [B, heads, T, head_dim]
_SPLIT_HEADS = '''        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, T, self.nh, self.hd).transpose(1, 2)
        v = v.view(B, T, self.nh, self.hd).transpose(1, 2)'''

_HELPER_FORWARD = '''
    def forward(self, x):
SPLIT_HEADS
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        scores = CALL
        att = F.softmax(scores, dim=-1)
        return (att @ v).transpose(1, 2).reshape(B, T, C)
'''.replace("SPLIT_HEADS", _SPLIT_HEADS)

_RUN = '''
m = SelfAttention()
x = torch.randn(2, 6, 32, requires_grad=True)
out = m(x)
leaves = [x]
'''

# (name, method text, call) of masking methods as real repositories write them
_MASKING_METHODS = [
    ("triu_bool_minus_inf", '''
    def _apply_causal(self, scores):
        T = scores.size(-1)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=scores.device), diagonal=1)
        return scores.masked_fill(mask, float("-inf"))
''', "self._apply_causal(scores)"),
    ("tril_eq_zero_large_negative_with_length", '''
    def mask_fn(self, scores, T):
        causal = torch.tril(torch.ones(T, T, device=scores.device)).view(1, 1, T, T)
        return scores.masked_fill(causal == 0, -1e9)
''', "self.mask_fn(scores, T)"),
    ("registered_buffer_in_place", '''
    def causal_mask(self, att, T):
        """nanoGPT's buffer, sliced to the length."""
        att.masked_fill_(self.bias[:, :, :T, :T] == 0, float("-inf"))
        return att
''', "self.causal_mask(scores, T=T)"),
]


def _masking_code(method: str, call: str) -> str:
    return _HELPER_HEAD + method + _HELPER_FORWARD.replace("CALL", call)


@pytest.mark.parametrize("name, method, call", _MASKING_METHODS, ids=[m[0] for m in _MASKING_METHODS])
def test_causal_mask_from_a_method_of_the_class_fuses(name: str, method: str, call: str) -> None:
    code = _masking_code(method, call)
    (f,), misses = detect_all(AttentionPattern(), code)
    assert not misses
    fn = call.split("(")[0].split(".")[1]
    assert f"type(self).{fn} is SelfAttention.{fn}" in f.fused  # a subclass may override the method
    assert "sparse_mode=2" in f.fused, f.fused
    facts = check_rewrite_runs(AttentionPattern(), code, _RUN, [f])
    assert facts["calls"] >= 1, facts["all_calls"]
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_a_padding_mask_from_a_method_passes_as_atten_mask() -> None:
    code = _masking_code('''
    def _mask_padding(self, scores, keep):
        return scores.masked_fill(~keep[:, None, None, :], float("-inf"))
''', "self._mask_padding(scores, keep)").replace("def forward(self, x):", "def forward(self, x, keep):")
    (f,), misses = detect_all(AttentionPattern(), code)
    assert "atten_mask=" in f.fused and "sparse_mode" not in f.fused, f.fused
    run = _RUN.replace("out = m(x)", "keep = torch.ones(2, 6, dtype=torch.bool)\nkeep[1, 4:] = False\nout = m(x, keep)")
    facts = check_rewrite_runs(AttentionPattern(), code, run, [f])
    assert facts["calls"] >= 1 and min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


@pytest.mark.parametrize("method, call, reason", [
    # ALiBi written as a method: a float bias per head and distance, no boolean mask
    ('''
    def _apply_alibi(self, scores):
        T = scores.size(-1)
        pos = torch.arange(T, device=scores.device)
        return scores + self.slopes.view(1, -1, 1, 1) * (pos[None, :] - pos[:, None]).float()
''', "self._apply_alibi(scores)", "adds `"),
    # a soft penalty: future keys scaled down, still attended
    ('''
    def _soften_future(self, scores):
        T = scores.size(-1)
        future = torch.triu(torch.ones(T, T, device=scores.device), diagonal=1)
        return scores * (1.0 - 0.5 * future)
''', "self._soften_future(scores)", "scales the scores"),
    # top-k sparsification: the mask is computed from the scores' values
    ('''
    def _topk(self, scores):
        kth = scores.topk(3, dim=-1).values[..., -1:]
        return scores.masked_fill(scores < kth, float("-inf"))
''', "self._topk(scores)", "computed from the attention scores themselves"),
    # the future filled with 0 (still attended), not a large negative value
    ('''
    def _zero_future(self, scores):
        T = scores.size(-1)
        return scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool, device=scores.device), 1), 0.0)
''', "self._zero_future(scores)", "masked with `0.0`, not −inf or a large negative value"),
    # a branch inside the method: not straight-line code, not read
    ('''
    def _maybe_causal(self, scores):
        if self.training:
            return scores
        T = scores.size(-1)
        return scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=scores.device).triu(1), float("-inf"))
''', "self._maybe_causal(scores)", "unsupported operation on the attention scores: `self._maybe_causal(scores)`"),
])
def test_a_method_that_does_not_mask_the_scores_is_a_near_miss(method: str, call: str, reason: str) -> None:
    found, misses = detect_all(AttentionPattern(), _masking_code(method, call))
    assert not found
    assert any(reason in m.reason for m in misses), [m.reason for m in misses]


def test_a_module_level_name_the_caller_rebinds_is_not_inlined() -> None:
    # the method reads the module-level NEG; the caller has a local NEG of its own: the inlined text would name it
    code = _masking_code('''
    def _apply_causal(self, scores):
        T = scores.size(-1)
        return scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=scores.device).triu(1), NEG)
''', "self._apply_causal(scores)").replace("import math\n", "import math\nNEG = float('-inf')\n") \
        .replace("        scores = (q @", "        NEG = 0.0\n        scores = (q @")
    found, misses = detect_all(AttentionPattern(), code)
    assert not found
    assert any("self._apply_causal(scores)" in m.reason for m in misses), [m.reason for m in misses]


# --- files that never ``import torch``: ``from torch import Tensor, nn``, ``Tensor.rsqrt(v)`` -------------------

_NO_TORCH_NORM = '''
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int = 16, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(Tensor(dim).uniform_(0.5, 1.5))

    def forward(self, x: Tensor) -> Tensor:
        return x * Tensor.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.scale
'''

_NO_TORCH_ATTENTION = '''
from torch import Tensor, nn


class Attention(nn.Module):
    def __init__(self, d: int = 32, nh: int = 4):
        super().__init__()
        self.nh = nh
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.nh, C // self.nh).permute(2, 0, 3, 1, 4).unbind(0)
        attn = Tensor.matmul(q, k.transpose(-2, -1)) * (C // self.nh) ** -0.5
        attn = Tensor.softmax(attn, dim=-1)
        return Tensor.matmul(attn, v).transpose(1, 2).reshape(B, N, C)
'''


def test_unbound_tensor_methods_read_as_method_calls() -> None:
    import ast

    from npufuse.scan.dataflow import canonicalise_unbound_tensor_methods

    tree = ast.parse("from torch import Tensor as T\nimport torch\ny = T.rsqrt(v + 1) + torch.Tensor.mean(x, -1) + T.__add__(a, b)\n")
    src = "from torch import Tensor as T\nimport torch\ny = T.rsqrt(v + 1) + torch.Tensor.mean(x, -1) + T.__add__(a, b)\n"
    # the line holds ``Tensor.mean(``: every unbound call of torch's Tensor on it is respelled, dunders are not
    assert canonicalise_unbound_tensor_methods(tree, src) == 2
    assert ast.unparse(tree).endswith("(v + 1).rsqrt() + x.mean(-1) + T.__add__(a, b)")
    src = "from torch import Tensor\ny = Tensor.rsqrt(v + 1) * Tensor.__mul__(a, b)\n"
    tree = ast.parse(src)
    assert canonicalise_unbound_tensor_methods(tree, src) == 1
    assert ast.unparse(tree).endswith("y = (v + 1).rsqrt() * Tensor.__mul__(a, b)")
    # ``Tensor`` from another library is not torch's
    src = "from jax import Tensor\ny = Tensor.rsqrt(v)\n"
    tree = ast.parse(src)
    assert canonicalise_unbound_tensor_methods(tree, src) == 0


@pytest.mark.parametrize("code, pattern_id, run", [
    (_NO_TORCH_NORM, "rms_norm", "m = RMSNorm()\nx = torch.randn(2, 3, 16, requires_grad=True)\nout = m(x)\nleaves = [x]\n"),
    (_NO_TORCH_ATTENTION, "attention", "m = Attention()\nx = torch.randn(2, 5, 32, requires_grad=True)\nout = m(x)\nleaves = [x]\n"),
], ids=["rms_norm", "attention"])
def test_a_file_without_import_torch_fuses_and_the_rewrite_imports_torch(code: str, pattern_id: str, run: str) -> None:
    from npufuse.patterns.registry import get_pattern

    pattern = get_pattern(pattern_id)
    (f,), misses = detect_all(pattern, code)
    assert not misses
    facts = check_rewrite_runs(pattern, "import torch\n" + code, run, detect_all(pattern, "import torch\n" + code)[0])
    assert facts["calls"] >= 1 and min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999
    from npufuse.rewrite.transform import binds_torch, names_torch

    # the fused text names torch (dtypes, promote_types) or not; where it does, the file does not bind it, so
    # apply's prelude adds ``import torch`` (test_apply covers the prelude itself)
    import ast

    assert not binds_torch(ast.parse(code))
    if pattern_id == "rms_norm":
        assert names_torch([f.fused])


@pytest.mark.parametrize("code, reason", [
    # channel-first: the mean is over dim 1 of NCHW input
    (_NO_TORCH_NORM.replace("mean(dim=-1", "mean(dim=1"), "mean over dim 1, not the last dim"),
    # eps added outside the root
    (_NO_TORCH_NORM.replace("x * Tensor.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)",
                            "x / (Tensor.sqrt(x.pow(2).mean(dim=-1, keepdim=True)) + self.eps)"), "eps outside the sqrt"),
], ids=["channel_first", "eps_outside_the_root"])
def test_no_torch_file_norm_near_misses(code: str, reason: str) -> None:
    from npufuse.patterns.rms_norm import RmsNorm

    found, misses = detect_all(RmsNorm(), code)
    assert not found
    assert any(reason in m.reason for m in misses), [m.reason for m in misses]


# --- interleaved rope: lanes indexed off a pair view, the un-split projection, the view rebound to the name -----

_ROPE_LANES = '''
import torch
import torch.nn as nn


def rope_indexed_lanes(x, cos, sin):
    x = x.float().reshape(*x.shape[:-1], -1, 2)
    x0, x1 = x[..., 0], x[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def rope_rebound_view(q, cos, sin):
    B, T, C = q.shape
    q = q.view(B, T, -1, 2)
    q0, q1 = q.unbind(-1)
    return torch.stack((q0 * cos - q1 * sin, q0 * sin + q1 * cos), -1).flatten(-2)


class Attention(nn.Module):
    """rope on the projection before the head split: the pair view is sized by the layer's input."""

    def __init__(self, d=16, nh=2):
        super().__init__()
        self.nh = nh
        self.wq = nn.Linear(d, d, bias=False)
        self.proj = nn.Linear(d, d)

    def forward(self, h, cos, sin):
        B, T, C = h.shape
        q = self.wq(h)
        q = q.view(B, T, -1, 2)
        q0, q1 = q.unbind(-1)
        q = torch.stack((q0 * cos - q1 * sin, q0 * sin + q1 * cos), -1).flatten(-2)
        q = q.view(B, T, self.nh, C // self.nh)
        return self.proj(q.flatten(2))
'''

_ROPE_RUN = '''
ang = torch.arange(6).float()[:, None] * torch.rand(8)
c, s = ang.cos(), ang.sin()
x = torch.randn(2, 6, 3, 16, requires_grad=True)
h = torch.randn(2, 6, 16, requires_grad=True)
out = (rope_indexed_lanes(x, c[:, None], s[:, None]), rope_rebound_view(h, c, s), Attention()(h, c, s))
leaves = [x, h]
'''


def test_interleaved_rope_lane_spellings_fuse_in_interleave_mode() -> None:
    from npufuse.patterns.rope import RopePattern

    found, misses = detect_all(RopePattern(), _ROPE_LANES)
    assert sorted(f.qualname for f in found) == ["Attention.forward", "rope_indexed_lanes", "rope_rebound_view"], misses
    assert all(f.params.get("mode") == "interleave" for f in found)
    # the name holds the pair view where the lanes are read: the op's input is that view flattened back
    assert all("q.flatten(-2)" in f.fused for f in found if f.qualname == "rope_rebound_view")
    facts = check_rewrite_runs(RopePattern(), _ROPE_LANES, _ROPE_RUN, found)
    assert facts["calls"] >= 3, facts["all_calls"]
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


@pytest.mark.parametrize("old, new", [
    # both parts with + signs: no rotation
    ("torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)", "torch.stack((x0 * cos + x1 * sin, x0 * sin + x1 * cos), dim=-1)"),
    # stacked before the lanes: halves, not the interleaved layout
    ("torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)", "torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-2)"),
    # a 1x1 convolution in place of the linear layer: the sizes read off its input are not its output's leading dims
    ("self.wq = nn.Linear(d, d, bias=False)", "self.wq = nn.Conv1d(d, d, 1)"),
    # the sizes of another tensor than the layer's input
    ("B, T, C = h.shape\n        q = self.wq(h)", "B, T, C = cos.shape[0], cos.shape[0], 0\n        q = self.wq(h)"),
], ids=["not_a_rotation", "stacked_before_the_lanes", "not_a_linear_layer", "sizes_of_another_tensor"])
def test_interleaved_rope_near_misses(old: str, new: str) -> None:
    from npufuse.patterns.rope import RopePattern

    assert old in _ROPE_LANES
    found, _ = detect_all(RopePattern(), _ROPE_LANES.replace(old, new))
    expected = {"rope_indexed_lanes", "rope_rebound_view", "Attention.forward"}
    expected.discard("rope_indexed_lanes" if "x0" in old else "Attention.forward")
    assert {f.qualname for f in found} == expected


# --- attention: an optional score transform, off by default, gated by a flag ------------------------------------

_FLAGGED_TEMPERATURE = '''
import torch
import torch.nn as nn


class Attention(nn.Module):
    def __init__(self, d=32, nh=4, learn_temp=False):
        super().__init__()
        self.nh, self.hd = nh, d // nh
        self.qkv = nn.Linear(d, 3 * d)
        self.learn_temp = learn_temp
        self.temperature = nn.Parameter(torch.ones(nh, 1, 1))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.nh, self.hd).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * self.hd ** -0.5
        if self.learn_temp:
            attn = attn * self.temperature
        attn = attn.softmax(dim=-1)
        return (attn @ v).transpose(1, 2).reshape(B, T, C)
'''


def test_a_flag_gated_per_head_temperature_runs_fused_where_the_flag_is_off() -> None:
    # before s41 the factor was read as the float scale ``temperature if flag else 1.0``: a [heads, 1, 1] tensor
    # passed as npu_fusion_attention's float ``scale`` where the flag is on
    (f,), _ = detect_all(AttentionPattern(), _FLAGGED_TEMPERATURE)
    assert f.fused.startswith("if (not self.learn_temp) and "), f.fused
    assert "self.temperature if" not in f.fused
    run = '''
out = []
for flag in (True, False):
    m = Attention(learn_temp=flag)
    with torch.no_grad():
        m.temperature.uniform_(0.5, 2.0)
    x = torch.randn(2, 6, 32, requires_grad=True)
    out.append(m(x))
leaves = [x]
'''
    facts = check_rewrite_runs(AttentionPattern(), _FLAGGED_TEMPERATURE, run, [f])
    assert facts["calls"] == 1, facts["all_calls"]  # the flag-off module only
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_a_flag_gated_float_scale_stays_a_scale() -> None:
    # near miss of the class above: a number under the flag is still folded into ``scale`` (no exclusion)
    code = _FLAGGED_TEMPERATURE.replace("attn = attn * self.temperature", "attn = attn * 2.0")
    (f,), _ = detect_all(AttentionPattern(), code)
    assert "not self.learn_temp" not in f.fused and "2.0 if self.learn_temp else 1.0" in f.fused, f.fused


def test_a_temperature_under_a_computed_test_is_a_near_miss() -> None:
    # the test computes from a tensor (not a flag read at run time): no exclusion is possible
    code = _FLAGGED_TEMPERATURE.replace("if self.learn_temp:", "if x.mean() > 0:")
    found, misses = detect_all(AttentionPattern(), code)
    assert not found
    assert any("the scale is applied only under `if x.mean() > 0`" in m.reason for m in misses), [m.reason for m in misses]


_FLAGGED_SINKS = '''
import math
import torch
import torch.nn as nn
import torch.nn.functional as F


class SinkAttention(nn.Module):
    """gpt-oss style sinks, optional: one learned logit per head joins every row, dropped after the softmax."""

    def __init__(self, d=32, nh=4, use_sinks=False):
        super().__init__()
        self.nh, self.hd, self.use_sinks = nh, d // nh, use_sinks
        self.qkv = nn.Linear(d, 3 * d)
        self.sinks = nn.Parameter(torch.zeros(nh))

    def forward(self, x):
SPLIT_HEADS
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.hd)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        scores = scores.masked_fill(causal, float("-inf"))
        if self.use_sinks:
            sink = self.sinks.view(1, -1, 1, 1).expand(B, -1, T, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = F.softmax(scores, dim=-1)
        if self.use_sinks:
            probs = probs[..., :-1]
        y = torch.matmul(probs, v)
        return y.transpose(1, 2).reshape(B, T, C)
'''.replace("SPLIT_HEADS", _SPLIT_HEADS)


def test_flag_gated_attention_sinks_run_fused_where_the_flag_is_off() -> None:
    (f,), misses = detect_all(AttentionPattern(), _FLAGGED_SINKS)
    assert not misses
    # one test of the flag however many intermediates it gates (sweep41 writes a shared test once)
    assert f.fused.startswith("if (not self.use_sinks) and "), f.fused
    assert f.fused.split(":", 1)[0].count("self.use_sinks") == 1, f.fused
    assert "sparse_mode=2" in f.fused
    run = '''
out = []
for flag in (True, False):
    m = SinkAttention(use_sinks=flag)
    with torch.no_grad():
        m.sinks.uniform_(-1.0, 1.0)
    x = torch.randn(2, 6, 32, requires_grad=True)
    out.append(m(x))
leaves = [x]
'''
    facts = check_rewrite_runs(AttentionPattern(), _FLAGGED_SINKS, run, [f])
    assert facts["calls"] == 1, facts["all_calls"]
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_sinks_sliced_off_on_every_path_are_a_near_miss() -> None:
    # the extra column is always there (zero where the flag is off) and always sliced off: no path is plain attention
    code = _FLAGGED_SINKS.replace('''        if self.use_sinks:
            sink = self.sinks.view(1, -1, 1, 1).expand(B, -1, T, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = F.softmax(scores, dim=-1)
        if self.use_sinks:
            probs = probs[..., :-1]''', '''        sink = self.sinks.view(1, -1, 1, 1).expand(B, -1, T, 1)
        if self.use_sinks:
            scores = torch.cat([scores, sink], dim=-1)
        else:
            scores = torch.cat([scores, sink * 0], dim=-1)
        probs = F.softmax(scores, dim=-1)[..., :-1]''')
    found, misses = detect_all(AttentionPattern(), code)
    assert not found
    assert any("attention probabilities are modified after softmax" in m.reason for m in misses), [m.reason for m in misses]


def test_causal_mask_from_a_function_of_the_file_fuses() -> None:
    # the same class as a module-level function of several statements (one ``return`` is _inlined_helper's)
    code = _masking_code("", "apply_causal(scores)").replace("class SelfAttention", '''def apply_causal(scores):
    T = scores.size(-1)
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=scores.device), diagonal=1)
    return scores.masked_fill(mask, float("-inf"))


class SelfAttention''')
    (f,), misses = detect_all(AttentionPattern(), code)
    assert not misses and "sparse_mode=2" in f.fused and "type(self)" not in f.fused, f.fused
    facts = check_rewrite_runs(AttentionPattern(), code, _RUN, [f])
    assert facts["calls"] >= 1 and min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999
    # near miss: the function adds a distance bias (ALiBi-like), not a mask
    biased = code.replace('return scores.masked_fill(mask, float("-inf"))', "return scores - mask.float() * 0.5")
    found, misses = detect_all(AttentionPattern(), biased)
    assert not found
    assert any(m.reason.startswith("`apply_causal(..)` subtracts `") and "from the scores (a float bias, not a mask)" in m.reason
               for m in misses), [m.reason for m in misses]
