"""s46 attn46: attention / sdpa dead candidates and real development misses, each pinned by class (Fuse forms run
rewritten under the emulator against the original; near misses carry true reasons).

1. Ranks stated through einops and layers (UniAnimate's temporal attention, audit45's dead candidate): q / k / v from
   ``rearrange(qkv[i], '... n (h d) -> ... h n d')`` of ``qkv = self.to_qkv(x).chunk(3, dim=-1)`` with ``x`` 4-D are
   5-D; the candidate's run-time ``q.dim() == 4`` never held. Now: folded where attn45's fold applies (no mask), a near
   miss naming the 5-D operand beside a bias / mask.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from pattern_harness import check_rewrite_runs
from test_detect_s45_attention import _close, _fused, _near_miss  # the s45 file's helpers: a fused / near-miss site, outputs close
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.sdpa import SdpaPattern


# -- 1. ranks stated through einops rearrange, chunks and layers -------------------------------------------------------

def _rearrange(t: torch.Tensor, pattern: str, **axes: int) -> torch.Tensor:
    """The few einops patterns the examples use (einops is not installed in the test environment)."""
    if pattern == "b c f h w -> b (h w) f c":
        return t.permute(0, 3, 4, 2, 1).flatten(1, 2)
    if pattern == "... n (h d) -> ... h n d":
        return t.unflatten(-1, (axes["h"], -1)).transpose(-2, -3)
    if pattern == "... h n d -> ... n (h d)":
        return t.transpose(-2, -3).flatten(-2)
    if pattern == "b (h w) f c -> b c f h w":
        b, hw, f, c = t.shape
        return t.reshape(b, axes["h"], hw // axes["h"], f, c).permute(0, 4, 3, 1, 2)
    raise NotImplementedError(pattern)


@pytest.fixture()
def fake_einops(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("einops")
    module.rearrange = _rearrange  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "einops", module)


_TEMPORAL = '''
import torch
from torch import nn
from einops import rearrange


class TemporalAttention(nn.Module):
    def __init__(self, dim, heads=2):
        super().__init__()
        self.scale = (dim // heads) ** -0.5
        self.heads = heads
        self.norm = nn.GroupNorm(2, dim)
        self.to_qkv = nn.Linear(dim, dim * 3)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x{param}):
        height = x.shape[-2]
        x = self.norm(x)
        x = rearrange(x, 'b c f h w -> b (h w) f c')
        qkv = self.to_qkv(x).chunk(3, dim=-1)
        q = rearrange(qkv[0], '... n (h d) -> ... h n d', h=self.heads)
        k = rearrange(qkv[1], '... n (h d) -> ... h n d', h=self.heads)
        v = rearrange(qkv[2], '... n (h d) -> ... h n d', h=self.heads)
        q = q * self.scale
        sim = torch.einsum('... h i d, ... h j d -> ... h i j', q, k){bias}
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        out = torch.einsum('... h i j, ... h j d -> ... h i d', attn, v)
        out = rearrange(out, '... h n d -> ... n (h d)')
        out = self.to_out(out)
        return rearrange(out, 'b (h w) f c -> b c f h w', h=height)
'''
_RUN_TEMPORAL = ("m = TemporalAttention(8)\nx = torch.randn(2, 8, 5, 3, 2, requires_grad=True)\n"
                 "out = m(x)\nleaves = [x] + list(m.parameters())\n")


def test_five_d_operands_from_einops_fold_into_the_batch(fake_einops: None) -> None:
    code = _TEMPORAL.format(param="", bias="")
    findings = _fused(AttentionPattern(), code)
    assert "q.dim() == 4" not in findings[0].fused  # the rank is stated: 5-D, folded
    _close(check_rewrite_runs(AttentionPattern(), code, _RUN_TEMPORAL, findings))


def test_five_d_operands_from_einops_beside_a_bias_are_a_near_miss() -> None:
    # UniAnimate: a positional bias beside the 5-D operands; the fused branch tested q.dim() == 4, never true
    code = _TEMPORAL.format(param=", pos_bias=None", bias="\n        if pos_bias is not None:\n            sim = sim + pos_bias")
    assert "q (`q`) is 5-D" in _near_miss(AttentionPattern(), code)


def test_a_rearrange_that_is_not_einops_states_no_rank() -> None:
    # the file's own `rearrange` may do anything: the rank stays unstated and is checked at run time
    code = _TEMPORAL.format(param=", pos_bias=None", bias="\n        if pos_bias is not None:\n            sim = sim + pos_bias")
    code = code.replace("from einops import rearrange", "from mylib import rearrange")
    findings = _fused(AttentionPattern(), code)
    assert "q.dim() == 4" in findings[0].fused


def test_four_d_einops_operands_need_no_run_time_rank_test(fake_einops: None) -> None:
    code = _TEMPORAL.format(param="", bias="").replace("'b c f h w -> b (h w) f c'", "'b c f h w -> b (f h w) c'")
    findings = _fused(AttentionPattern(), code)
    assert "q.dim() == 4" not in findings[0].fused


# -- 2. masks npufuse does not evaluate that can still empty a query row ----------------------------------------------

_UNREAD_MASK = '''
import math
import torch
from torch import nn


class Attn(nn.Module):
    def __init__(self, d, n, window=2):
        super().__init__()
        self.n, self.hd, self.window = n, d // n, window
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, pad):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n, self.hd).permute(2, 0, 3, 1, 4)
        i = torch.arange(s, device=x.device)
        blocks = torch.div(i, self.window, rounding_mode="floor")
        keep = {keep}
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.hd)
        scores = scores.masked_fill(~keep, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v)
'''
_RUN_UNREAD = ("m = Attn(8, 2)\nx = torch.randn(2, 6, 8, requires_grad=True)\npad = torch.ones(2, 6, dtype=torch.bool)\n"
               "out = m(x, pad)\nleaves = [x] + list(m.parameters())\n")
# `repeat_interleave` is not evaluated by _mask_rows: the constructions below are read only by what they are made of
_BLOCKS = "blocks[:, None] {op} blocks[None, :].repeat_interleave(1, dim=0)"
_PADDED_TOO = "(pad[:, None, :] & pad[:, :, None]).unsqueeze(1)"


@pytest.mark.parametrize("op, calls", [(">=", True), (">", False)])
def test_an_unread_bucketed_mask_runs_fused_only_where_every_row_keeps_a_key(op: str, calls: bool) -> None:
    # block-causal over buckets `i // window`: `>=` keeps each row's own block; strict `>` empties block 0's rows
    code = _UNREAD_MASK.format(keep=_BLOCKS.format(op=op))
    findings = _fused(AttentionPattern(), code)
    assert "not bool((~keep).all(-1).any())" in findings[0].fused
    assert any(r.kind == "host_sync" for r in findings[0].risks)
    facts = check_rewrite_runs(AttentionPattern(), code, _RUN_UNREAD, findings)
    if calls:
        _close(facts)
    else:
        assert facts["calls"] == 0  # block 0's rows keep no key (NaN in torch): the original runs


@pytest.mark.parametrize("padded_too", [_PADDED_TOO, "(pad.float().unsqueeze(2) @ pad.float().unsqueeze(1)).bool().unsqueeze(1)"])
def test_a_padding_vector_over_queries_and_keys_gets_the_row_check(padded_too: str) -> None:
    # every padded query row masks all keys: torch NaN, the op's value not pinned down
    code = _UNREAD_MASK.format(keep=padded_too)
    findings = _fused(AttentionPattern(), code)
    assert "not bool((~keep).all(-1).any())" in findings[0].fused
    _close(check_rewrite_runs(AttentionPattern(), code, _RUN_UNREAD, findings))
    padded = _RUN_UNREAD.replace("pad = torch.ones(2, 6, dtype=torch.bool)", "pad = torch.arange(6) < torch.tensor([[6], [4]])")
    facts = check_rewrite_runs(AttentionPattern(), code, padded, findings)
    assert facts["calls"] == 0  # the padded rows: the original runs


@pytest.mark.parametrize("keep", [
    "torch.ones(s, s, dtype=torch.bool, device=x.device).tril().repeat_interleave(1, dim=0)",  # a plain causal triangle
    "pad[:, None, None, :].repeat_interleave(1, dim=0)",  # key padding only
    "torch.ones(s // 2 * 2, s, dtype=torch.bool, device=x.device).tril().repeat_interleave(1, dim=0)",  # `//` in a size
])
def test_unread_masks_that_keep_a_key_in_every_row_get_no_check(keep: str) -> None:
    findings = _fused(AttentionPattern(), _UNREAD_MASK.format(keep=keep))
    assert ".all(-1).any()" not in findings[0].fused


# -- 3. true near-miss reasons -----------------------------------------------------------------------------------------

_GRAPH = '''
import math
import torch
import torch.nn.functional as F
from torch import nn


class GraphAttention(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.n, self.hd = n, d // n
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)

    def forward(self, x, adj):
        nodes = x.size(0)
        q = self.q(x).reshape(nodes, self.n, self.hd)
        k = self.k(x).reshape(nodes, self.n, self.hd)
        v = self.v(x).reshape(nodes, self.n, self.hd)
        scores = torch.einsum("nhd,mhd->nmh", q, k) / math.sqrt(self.hd)
        scores = scores.transpose(-1, -2)
        scores = scores.masked_fill(~adj.unsqueeze(1), float("-inf"))
        attn = F.softmax(scores, dim=-1)
        out = torch.einsum("nhm,mhd->nhd", attn, v)
        return out.reshape(nodes, -1)
'''


def test_unbatched_multi_head_attention_is_called_attention() -> None:
    # graph-transformers (HO22b): [N, H, D] node attention; s45's reason said "not [B, S, D] attention"
    reason = _near_miss(AttentionPattern(), _GRAPH)
    assert "attention over 3-D operands whose shared axis `h` is not the leading one" in reason
    assert "not [B, S, D] attention" not in reason


def test_a_three_d_product_that_is_no_attention_keeps_its_reason() -> None:
    # the values share no axis with the probabilities but the contracted one: no attention form
    code = _GRAPH.replace('"nhm,mhd->nhd", attn, v', '"nhm,mde->nhde", attn, v.unsqueeze(-1)')
    assert "attention over 3-D operands" not in _near_miss(AttentionPattern(), code)


_SDPA_TEMPORAL = '''
import torch
import torch.nn.functional as F
from torch import nn
from einops import rearrange


class TemporalAttention(nn.Module):
    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, dim * 3)

    def forward(self, x, mask=None):
        x = rearrange(x, 'b c f h w -> b (h w) f c')
        qkv = self.to_qkv(x).chunk(3, dim=-1)
        q = rearrange(qkv[0], '... n (h d) -> ... h n d', h=self.heads)
        k = rearrange(qkv[1], '... n (h d) -> ... h n d', h=self.heads)
        v = rearrange(qkv[2], '... n (h d) -> ... h n d', h=self.heads)
        out = F.scaled_dot_product_attention(q, k, v{mask})
        return rearrange(out, '... h n d -> ... n (h d)')
'''
_RUN_SDPA_TEMPORAL = ("m = TemporalAttention(8)\nx = torch.randn(2, 8, 5, 3, 2, requires_grad=True)\n"
                      "out = m(x)\nleaves = [x] + list(m.parameters())\n")


def test_sdpa_five_d_einops_operands_fold(fake_einops: None) -> None:
    code = _SDPA_TEMPORAL.format(mask="")
    findings = _fused(SdpaPattern(), code)
    assert "q.dim() == k.dim() == v.dim() == 5" in findings[0].fused
    _close(check_rewrite_runs(SdpaPattern(), code, _RUN_SDPA_TEMPORAL, findings))


def test_sdpa_five_d_einops_operands_with_a_mask_are_a_near_miss() -> None:
    # the 4-D call's `q.dim() == 4` test never held: now the near miss says why
    assert "q/k/v are 5-D with an attn_mask" in _near_miss(SdpaPattern(), _SDPA_TEMPORAL.format(mask=", attn_mask=mask"))


_TRY_WINDOW = '''
import torch


def attend(q, k, v, kwargs):
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k)
    try:
        bias = kwargs["bias"].to(q.dtype)
    except TypeError:
        print("bad kwargs")
    scores = scores + bias
    return torch.matmul(torch.softmax(scores, dim=-1), v)
'''


def test_a_value_assigned_in_a_try_is_named_with_its_statement() -> None:
    # foundation-model-stack's sinks attention: s45 said "assigned inside the attention" of a `try` before it
    reason = _near_miss(AttentionPattern(), _TRY_WINDOW)
    assert "`bias`, which the attention reads, is assigned in a `try` statement (line 7)" in reason


_DEVICE_OF_SCORES = '''
import math
import torch
from torch import nn


class Attn(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.n, self.hd = n, d // n
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n, self.hd).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.hd)
        mask = torch.full((1, 1, s, s), float("-inf"))
        mask = torch.triu(mask, diagonal=1).to(scores.device)
        scores = scores + mask
        return torch.matmul(torch.softmax(scores, dim=-1), v)
'''


def test_a_mask_placed_on_the_scores_device_reads_no_division_from_them() -> None:
    # collie / minimind: `.to(scores.device)` / `scores.size(-1)` are metadata: the scores' `/ sqrt(d)` is no bucketing
    findings = _fused(AttentionPattern(), _DEVICE_OF_SCORES)
    assert ".any(-1).all()" not in findings[0].fused and ".all(-1).any()" not in findings[0].fused


def test_a_value_assigned_in_a_loop_inside_an_if_names_the_loop() -> None:
    # pytorch-llm-from-scratch: `if mask is not None: while mask.dim() < scores.dim(): mask = mask.unsqueeze(0)`
    code = _TRY_WINDOW.replace('''    try:
        bias = kwargs["bias"].to(q.dtype)
    except TypeError:
        print("bad kwargs")''', '''    bias = kwargs["bias"]
    if bias is not None:
        while bias.dim() < scores.dim():
            bias = bias.unsqueeze(0)''')
    reason = _near_miss(AttentionPattern(), code)
    assert "`bias`, which the attention reads, is assigned in a `while` loop (line 9) inside an `if` statement (line 8)" in reason


def test_a_layer_stored_again_elsewhere_states_no_rank() -> None:
    # `self.to_qkv` swapped by another method: what it returns is not known, the rank stays checked at run time
    code = _TEMPORAL.format(param=", pos_bias=None", bias="\n        if pos_bias is not None:\n            sim = sim + pos_bias")
    code = code.replace("    def forward(", "    def set_proj(self, proj):\n        self.to_qkv = proj\n\n    def forward(")
    findings = _fused(AttentionPattern(), code)
    assert "q.dim() == 4" in findings[0].fused
