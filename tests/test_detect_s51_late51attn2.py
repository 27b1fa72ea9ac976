"""s51 late51attn2: judged HO28 attention classes, own reproducers (FUSE run under the emulator against the original,
KEEP near-miss twins with a true reason)."""

from __future__ import annotations

from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.attention import AttentionPattern

ATTN = AttentionPattern()

# --- class 1: rows with no visible key zeroed after the softmax ----------------------------------------------------
_ROWS = '''
import torch
from torch import nn


class KeyPadAttention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.qkv = nn.Linear(dim, dim * 3)

    def forward(self, x, key_pad):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-2, -1) / self.d ** 0.5
        masked = key_pad[:, None, None, :]
{body}
        y = (p @ v).transpose(1, 2).reshape(b, n, -1)
        return y
'''

_RUN_ROWS = '''
torch.manual_seed(0)
m = KeyPadAttention()
x = torch.randn(3, 6, 32, requires_grad=True)
key_pad = torch.zeros(3, 6, dtype=torch.bool)
key_pad[1, 4:] = True
key_pad[2, :] = {all_masked}
out = m(x, key_pad)
leaves = [x, m.qkv.weight]
'''


def _fused_exact(code: str, run: str) -> str:
    findings, misses = detect_all(ATTN, code)
    assert len(findings) == 1 and not misses, [m.reason for m in misses]
    facts = check_rewrite_runs(ATTN, code, run, findings)
    assert facts["calls"] >= 1
    assert facts["cos_out"] and min(facts["cos_out"]) > 0.99999
    assert facts["cos_grad"] and min(facts["cos_grad"]) > 0.99999
    return facts["rewritten"]


def _kept(code: str) -> str:
    findings, misses = detect_all(ATTN, code)
    assert not findings and len(misses) == 1
    return misses[0].reason


def test_fuse_masked_fill_all_masked_rows() -> None:
    """scCAFM's spelling: ``all_masked = mask.all(dim=-1, keepdim=True)``; ``p.masked_fill(all_masked, 0.0)``."""
    body = '''        s = s.masked_fill(masked, float("-inf"))
        all_masked = masked.all(dim=-1, keepdim=True)
        p = torch.softmax(s, dim=-1)
        p = p.masked_fill(all_masked, 0.0)'''
    out = _fused_exact(_ROWS.format(body=body), _RUN_ROWS.format(all_masked=True))
    assert "[0].masked_fill(" in out


def test_fuse_masked_fill_count_compared_rows() -> None:
    """The predicate written as a count: ``(~masked).sum(-1, keepdim=True) == 0``."""
    body = '''        s = s.masked_fill(masked, float("-inf"))
        empty = (~masked).sum(-1, keepdim=True) == 0
        p = s.softmax(-1).masked_fill(empty, 0)'''
    _fused_exact(_ROWS.format(body=body), _RUN_ROWS.format(all_masked=True))


def test_fuse_function_all_rows() -> None:
    """The function form, the predicate spelled ``torch.all(masked, -1, keepdim=True)``."""
    body = '''        s = s.masked_fill(masked, float("-inf"))
        p = s.softmax(-1)
        p = torch.masked_fill(p, torch.all(masked, -1, keepdim=True), 0.0)'''
    _fused_exact(_ROWS.format(body=body), _RUN_ROWS.format(all_masked=True))


def test_fuse_times_valid_rows() -> None:
    """``p * valid.float()``: (P * r) @ V = r * (P @ V); a finite fill, so no NaN row in the original."""
    body = '''        s = s.masked_fill(masked, torch.finfo(s.dtype).min)
        valid = (~masked).any(-1, keepdim=True)
        p = s.softmax(-1)
        p = p * valid.float()'''
    out = _fused_exact(_ROWS.format(body=body), _RUN_ROWS.format(all_masked=True))
    assert "[0] * " in out


def test_fuse_valid_times_probs_partial_rows() -> None:
    body = '''        s = s.masked_fill(masked, float("-inf"))
        keep_rows = masked.logical_not().any(dim=-1, keepdim=True)
        p = keep_rows.to(s.dtype) * torch.softmax(s, dim=-1)'''
    _fused_exact(_ROWS.format(body=body), _RUN_ROWS.format(all_masked=False))


def test_keep_times_key_mask() -> None:
    """A product with a KEY mask (size Skv on the last axis) re-weights keys: not a row factor."""
    body = '''        s = s.masked_fill(masked, float("-inf"))
        p = s.softmax(-1)
        p = p * (~masked).float()'''
    assert "modified after softmax" in _kept(_ROWS.format(body=body))


def test_keep_rows_filled_with_one() -> None:
    """A fill of 1, not 0: the rows are not zeroed."""
    body = '''        s = s.masked_fill(masked, float("-inf"))
        p = s.softmax(-1)
        p = p.masked_fill(masked.all(-1, keepdim=True), 1.0)'''
    assert "modified after softmax" in _kept(_ROWS.format(body=body))


def test_keep_reduction_over_query_axis() -> None:
    """A keepdim reduction over the QUERY axis (-2) is not a row predicate."""
    body = '''        s = s.masked_fill(masked, float("-inf"))
        p = s.softmax(-1)
        p = p.masked_fill(masked.all(-2, keepdim=True), 0.0)'''
    assert "zero kept positions" in _kept(_ROWS.format(body=body))


# --- class 2: a float term with no q / k operand added to the scores (a bias, not "scores added to scores") ------------
_GRAPH = '''
import torch
import torch.nn.functional as F
from torch import nn


class PooledGraphAttention(nn.Module):
    def __init__(self, dim=32, heads=4, groups=5):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.assign = nn.Linear(dim, groups)
        self.qkv = nn.Linear(dim, dim * 3)
        self.beta = nn.Parameter(torch.tensor(0.3))

    def forward(self, x, adj):
        b = x.shape[0]
        w = torch.softmax(self.assign(x), dim=-1)
        pooled = torch.bmm(w.transpose(1, 2), x)
        g = pooled.shape[1]
        q, k, v = self.qkv(pooled).view(b, g, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        aff = torch.bmm(w.transpose(1, 2), torch.bmm(adj, w))
        aff = aff / aff.sum(-1, keepdim=True).clamp_min(1e-6)
        graph_bias = (F.softplus(self.beta) * torch.log(aff + 1e-6)).unsqueeze(1)
        {scores}
        attn = scores.softmax(dim=-1)
        return (attn @ v).transpose(1, 2).reshape(b, g, -1)
'''

_RUN_GRAPH = '''
torch.manual_seed(0)
m = PooledGraphAttention()
x = torch.randn(2, 7, 32, requires_grad=True)
adj = torch.rand(2, 7, 7)
out = m(x, adj)
leaves = [x, m.beta, m.qkv.weight]
'''


def test_fuse_graph_bias_after_scale() -> None:
    """The bias (bmm products of pooling weights, no q / k) added after the scale: pse."""
    code = _GRAPH.replace("{scores}", "scores = q @ k.transpose(-2, -1) * self.d ** -0.5 + graph_bias")
    out = _fused_exact(code, _RUN_GRAPH)
    assert "pse=" in out


def test_fuse_graph_bias_on_the_left() -> None:
    code = _GRAPH.replace("{scores}", "scores = graph_bias + torch.matmul(q, k.transpose(-1, -2)) / self.d ** 0.5")
    _fused_exact(code, _RUN_GRAPH)


def test_keep_term_reading_k() -> None:
    """A term that reads k (``k @ kᵀ``) is scores: the reason stays "scores added to scores" (true)."""
    code = _GRAPH.replace("{scores}", 'scores = q @ k.transpose(-2, -1) + torch.einsum("bhjd,bhkd->bhjk", k, k)')
    assert "scores added to scores" in _kept(code)


def test_keep_term_reading_q_through_a_view() -> None:
    """A term made from a view of q (``qf = q.reshape(..)``, then an einsum of qf): not free of q."""
    code = _GRAPH.replace("{scores}", "qf = q.reshape(b, self.h, g, self.d)\n"
                          '        scores = q @ k.transpose(-2, -1) + torch.einsum("bhjd,bhkd->bhjk", qf, qf)')
    assert "scores added to scores" in _kept(code)


# --- class 6: an eager function returning its probabilities, picked by a caller when it asks for the map -------------
_PICKED = '''
import torch
import torch.nn.functional as F
from torch import nn


def plain_attention(module, q, k, v, mask, scale):
    w = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    w = w + mask
    w = F.softmax(w, dim=-1)
    out = torch.einsum("bhij,bhjd->bhid", w, v)
    return out.transpose(1, 2).contiguous(), w


def fused_attention(module, q, k, v, mask, scale):
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).contiguous(), None


IMPLS = {"eager": plain_attention, "sdpa": fused_attention}


class Block(nn.Module):
    def __init__(self, impl="sdpa"):
        super().__init__()
        self.impl = impl
        self.qkv = nn.Linear(32, 96)

    def forward(self, x, mask, output_attentions=False):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        attn_fn = IMPLS[self.impl]
        if {test}:
            attn_fn = plain_attention
        out, weights = attn_fn(self, q, k, v, mask, 8 ** -0.5)
        return out.reshape(b, n, -1), weights
'''


def _eager_site(code: str) -> tuple[list, list]:
    findings, misses = detect_all(ATTN, code)
    return ([f for f in findings if f.qualname == "plain_attention"],
            [m for m in misses if m.qualname == "plain_attention"])


def test_keep_eager_picked_when_output_attentions() -> None:
    findings, misses = _eager_site(_PICKED.replace("{test}", 'self.impl == "sdpa" and output_attentions'))
    assert not findings and len(misses) == 1
    assert "`output_attentions`" in misses[0].reason and "picks this function" in misses[0].reason


def test_fuse_eager_picked_under_another_test() -> None:
    """The same fallback under a test that does not ask for the map: the interchangeable eager function is fused."""
    findings, misses = _eager_site(_PICKED.replace("{test}", "x.shape[1] > 4096"))
    assert len(findings) == 1 and not misses, [m.reason for m in misses]


# --- class 5: SDPA mask None on the configured path, its other arm builds a mask with an empty query row ------------
from npufuse.patterns.sdpa import SdpaPattern  # noqa: E402

SDPA = SdpaPattern()

_DISABLED_ARM = '''
import torch
import torch.nn.functional as F
from torch import nn


class ArmAttention(nn.Module):
    def __init__(self, dim=32, heads=4, causal=False):
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.causal = causal

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.qkv(x).reshape(B, L, 3, self.h, self.d).unbind(dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
{mask}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return out.transpose(1, 2).reshape(B, L, D)
'''

_ARM = '''        attn_mask = None
        if self.causal and L > 1:
            # a keep-mask that keeps no key for the last query row
            attn_mask = torch.triu(torch.ones(L, L, device=x.device, dtype=torch.bool), diagonal=1)'''

_RUN_ARM = '''
torch.manual_seed(0)
m = ArmAttention(causal={causal})
x = torch.randn(2, 6, 32, requires_grad=True)
out = m(x)
leaves = [x, m.qkv.weight]
'''


def test_fuse_sdpa_mask_none_on_the_configured_path() -> None:
    code = _DISABLED_ARM.format(mask=_ARM)
    findings, misses = detect_all(SDPA, code)
    assert len(findings) == 1 and not misses, [m.reason for m in misses]
    facts = check_rewrite_runs(SDPA, code, _RUN_ARM.format(causal=False), findings)
    assert facts["calls"] == 1 and min(facts["cos_out"]) > 0.99999 and min(facts["cos_grad"]) > 0.99999
    assert "attn_mask is None" in facts["rewritten"]


def test_fuse_sdpa_arm_taken_runs_the_original() -> None:
    """With the arm taken (a mask built), the original SDPA call runs: no fused call."""
    code = _DISABLED_ARM.format(mask=_ARM)
    findings, _ = detect_all(SDPA, code)
    facts = check_rewrite_runs(SDPA, code, _RUN_ARM.format(causal=True), findings)
    assert facts["calls"] == 0


def test_keep_sdpa_mask_always_built_with_empty_row() -> None:
    """The same mask built on every path (never None): still refused, the row reason unchanged."""
    mask = "        attn_mask = torch.triu(torch.ones(L, L, device=x.device, dtype=torch.bool), diagonal=1)"
    findings, misses = detect_all(SDPA, _DISABLED_ARM.format(mask=mask))
    assert not findings and len(misses) == 1 and "without any key" in misses[0].reason
