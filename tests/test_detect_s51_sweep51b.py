"""s51 (helper sweep51b): the two classes sweep51 found and left, as invented spellings (no repository code).

1. attention: eager attention in a helper whose q / k / v arrive as 3-D tensors of no stated rank ([H, N, d] heads
   first with no batch axis, or one head [B, N, d]). s41's run-time test fused 4-D operands only, so on the shapes the
   code passes the fused branch never ran. Now 3-D operands run the BNSD call on [1, X, S, D] views; a mask the eager
   broadcast would make 4-D, or mixed ranks, run the original code.
2. swiglu: SSM output gates ``y * silu(z)`` (y the scan output, z a part of the input projection) stay near misses
   (ssm51, integrator decision: the exact ``npu_swiglu(torch.cat([z, y], -1))`` moves ~7N elements against the eager
   code's ~5N in the same two launches); these tests assert the near miss and its reason.
"""

from __future__ import annotations

import torch
from pattern_harness import _exec, check_rewrite_runs, detect_all

from npufuse import emulate
from npufuse.patterns.attention import AttentionPattern
from npufuse.rewrite.codegen import splice


def _outputs(code: str, run: str, findings: list) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, int]]:
    """The original's and the rewrite's outputs (under the emulator) and the fused calls made."""
    ns = _exec(code, "original")
    exec(compile(run, "<run>", "exec"), ns)
    with emulate.install() as emu:
        fns = _exec(splice(code, findings), "rewritten")
        exec(compile(run, "<run>", "exec"), fns)
    return ns["out"], fns["out"], dict(emu.calls)


# -- 1. attention on 3-D operands of no stated rank ---------------------------------------------------------------------

_HEADS_FIRST = '''
import math
import torch
import torch.nn.functional as F


def heads_first_attention(q, k, v, keep=None):
    s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if keep is not None:
        s = s.masked_fill(keep == 0, float("-inf"))
    p = F.softmax(s, dim=-1)
    return torch.matmul(p, v)
'''

# [H, Sq, D] / [H, Skv, D] operands, with no mask, a 3-D [H, Sq, Skv] mask and a 2-D [Sq, Skv] one; 4-D still fused
_HEADS_FIRST_RUN = '''
torch.manual_seed(0)
q = torch.randn(3, 7, 8, requires_grad=True)
k = torch.randn(3, 9, 8, requires_grad=True)
v = torch.randn(3, 9, 8, requires_grad=True)
keep = (torch.rand(3, 7, 9) > 0.3).long()
keep[..., 0] = 1
keep2 = (torch.rand(7, 9) > 0.3).long()
keep2[:, 1] = 1
out = [heads_first_attention(q, k, v), heads_first_attention(q, k, v, keep), heads_first_attention(q, k, v, keep2),
       heads_first_attention(q[None], k[None], v[None])]
leaves = [q, k, v]
'''


def test_heads_first_3d_operands_reach_the_fused_call() -> None:
    findings, misses = detect_all(AttentionPattern(), _HEADS_FIRST)
    assert [f.qualname for f in findings] == ["heads_first_attention"], [m.reason for m in misses]
    facts = check_rewrite_runs(AttentionPattern(), _HEADS_FIRST, _HEADS_FIRST_RUN, findings)
    assert facts["calls"] == 4, facts  # every call: three 3-D ones (no mask, 3-D mask, 2-D mask) and the 4-D one
    assert min(facts["cos_out"]) > 0.99999 and min(facts["cos_grad"]) > 0.99999, facts
    assert all(a == b for a, b in facts["shapes"]) and all(a == b for a, b in facts["dtypes"]), facts
    text = findings[0].fused
    assert "q[None], k[None], v[None]" in text and ".flatten(0, _npufuse_lift)" in text, text
    assert any("[1, X, S, D]" in n for n in findings[0].notes), findings[0].notes


def test_heads_first_3d_operands_bf16() -> None:
    run = _HEADS_FIRST_RUN.replace("torch.randn(3, 7, 8, requires_grad=True)", "torch.randn(3, 7, 8).bfloat16().requires_grad_()") \
        .replace("torch.randn(3, 9, 8, requires_grad=True)", "torch.randn(3, 9, 8).bfloat16().requires_grad_()")
    findings, _ = detect_all(AttentionPattern(), _HEADS_FIRST)
    ref, got, calls = _outputs(_HEADS_FIRST, run, findings)
    assert calls.get("npu_fusion_attention") == 4, calls
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        assert ((a.float() - b.float()).abs().max() / a.float().abs().max()).item() < 2e-2


def test_3d_operands_beside_a_4d_mask_or_mixed_ranks_run_the_original() -> None:
    # a 4-D mask makes the eager result 4-D; a 3-D mask whose first size is neither 1 nor H broadcasts the scores up;
    # a 3-D q against 4-D k / v broadcasts q over the batch: the original code runs (0 fused calls), same outputs
    run = '''
torch.manual_seed(1)
q = torch.randn(3, 7, 8); k = torch.randn(3, 9, 8); v = torch.randn(3, 9, 8)
keep4 = torch.ones(2, 3, 7, 9, dtype=torch.long)
q1 = torch.randn(1, 7, 8); k1 = torch.randn(1, 9, 8); v1 = torch.randn(1, 9, 8)
keep3 = torch.ones(4, 7, 9, dtype=torch.long)
out = [heads_first_attention(q, k, v, keep4), heads_first_attention(q1, k1, v1, keep3),
       heads_first_attention(q, k[None].expand(2, -1, -1, -1), v[None].expand(2, -1, -1, -1)),
       heads_first_attention(q1, k, v), heads_first_attention(q, k[:1], v[:1])]
'''
    findings, _ = detect_all(AttentionPattern(), _HEADS_FIRST)
    ref, got, calls = _outputs(_HEADS_FIRST, run, findings)
    assert calls.get("npu_fusion_attention", 0) == 0, calls
    # (and 3-D operands of different leading sizes, broadcast by the matmuls: one query against three key sets, three
    # queries against one)
    assert [tuple(a.shape) for a in ref] == [(2, 3, 7, 8), (4, 7, 8), (2, 3, 7, 8), (3, 7, 8), (3, 7, 8)]
    for a, b in zip(ref, got):
        assert a.shape == b.shape and torch.equal(a, b)


_BLOCKWISE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class NodeAttention(nn.Module):
    """Heads-first attention over the nodes of concatenated graphs (no batch axis), queries taken in blocks."""

    def __init__(self, width, heads, block=4):
        super().__init__()
        self.heads, self.hd, self.block = heads, width // heads, block
        self.qkv = nn.Linear(width, 3 * width)
        self.drop = nn.Dropout(0.0)

    def blockwise(self, Q, K, V, same=None):
        heads, nodes, hd = Q.shape
        out = torch.zeros_like(V)
        for i in range(0, nodes, self.block):
            j = min(i + self.block, nodes)
            q_blk = Q[:, i:j]
            sc = torch.matmul(q_blk, K.transpose(-2, -1)) / (self.hd ** 0.5)
            if same is not None:
                sc = sc.masked_fill(same[:, i:j, :] == 0, float("-inf"))
            w = F.softmax(sc, dim=-1)
            w = self.drop(w)
            out[:, i:j] = torch.matmul(w, V)
        return out

    def forward(self, x, graph):
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, self.hd).permute(1, 2, 0, 3)
        same = (graph[:, None] == graph[None, :]).unsqueeze(0).expand(self.heads, -1, -1)
        return self.blockwise(q, k, v, same).transpose(0, 1).reshape(x.shape[0], -1)
'''

_BLOCKWISE_RUN = '''
torch.manual_seed(0)
m = NodeAttention(16, 2)
x = torch.randn(10, 16, requires_grad=True)
graph = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
out = [m(x, graph)]
leaves = [x, m.qkv.weight, m.qkv.bias]
'''


def test_blockwise_heads_first_graph_attention_fuses_every_block() -> None:
    findings, misses = detect_all(AttentionPattern(), _BLOCKWISE)
    assert [f.qualname for f in findings] == ["NodeAttention.blockwise"], [m.reason for m in misses]
    facts = check_rewrite_runs(AttentionPattern(), _BLOCKWISE, _BLOCKWISE_RUN, findings)
    assert facts["calls"] == 3, facts  # three query blocks of 4, 4 and 2 nodes
    assert min(facts["cos_out"]) > 0.99999 and min(facts["cos_grad"]) > 0.99999, facts


_SINGLE_HEAD = '''
import torch
import torch.nn as nn


class PointMixer(nn.Module):
    """Single-head attention over the points of each cloud: [B, N, d] operands."""

    def __init__(self, dim):
        super().__init__()
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.scale = dim ** -0.5

    def attend(self, q, k, v, bias=None):
        logits = (q @ k.transpose(-1, -2)) * self.scale
        if bias is not None:
            logits = logits + bias
        return logits.softmax(dim=-1) @ v

    def forward(self, pts, pad=None):
        k, v = self.to_kv(pts).chunk(2, dim=-1)
        bias = None if pad is None else pad[:, None, :].float() * -1e9
        return self.attend(self.to_q(pts), k, v, bias)
'''

_SINGLE_HEAD_RUN = '''
torch.manual_seed(0)
m = PointMixer(8)
pts = torch.randn(2, 6, 8, requires_grad=True)
pad = torch.zeros(2, 6, dtype=torch.bool)
pad[1, 4:] = True
out = [m(pts), m(pts, pad)]
leaves = [pts, m.to_q.weight, m.to_kv.weight]
'''


def test_single_head_batch_first_3d_operands_with_an_additive_mask() -> None:
    findings, misses = detect_all(AttentionPattern(), _SINGLE_HEAD)
    assert [f.qualname for f in findings] == ["PointMixer.attend"], [m.reason for m in misses]
    facts = check_rewrite_runs(AttentionPattern(), _SINGLE_HEAD, _SINGLE_HEAD_RUN, findings)
    assert facts["calls"] == 2, facts
    assert min(facts["cos_out"]) > 0.99999 and min(facts["cos_grad"]) > 0.99999, facts
    assert all(a == b for a, b in facts["shapes"]), facts


# -- 2. swiglu: SSM output gates y * silu(z) ----------------------------------------------------------------------------

from npufuse.patterns.swiglu import Swiglu  # noqa: E402

_SSM = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class LeakySSM(nn.Module):
    """A toy selective block: split the input projection, scan one part, gate the scan's output by the other."""

    def __init__(self, d, inner):
        super().__init__()
        self.in_proj = nn.Linear(d, 2 * inner)
        self.out_proj = nn.Linear(inner, d)
        self.decay = nn.Parameter(torch.rand(inner) * 0.5 + 0.25)
        self.skip = nn.Parameter(torch.ones(inner))

    def scan(self, u):
        h = torch.zeros_like(u[:, 0])
        outs = []
        for t in range(u.shape[1]):
            h = self.decay * h + u[:, t]
            outs.append(h)
        return torch.stack(outs, 1)

    def forward(self, x, keep=None):
        u, z = self.in_proj(x).chunk(2, dim=-1)
        if keep is not None:
            z = z * keep
        y = self.scan(F.silu(u)) + self.skip * u
        y = y * F.silu(z)
        return self.out_proj(y)
'''

_SSM_RUN = '''
torch.manual_seed(0)
m = LeakySSM(8, 6)
x = torch.randn(2, 5, 8, requires_grad=True)
out = [m(x), m(x, (torch.rand(2, 5, 1) > 0.3).float())]
leaves = [x, m.in_proj.weight, m.skip]
'''


_NOT_PROJ = "gate and up are not projections of one input (a gated output, not a GLU MLP)"
_TRANSFORMED = "is transformed after its projection (`self.scan(F.silu(u)) + self.skip * u`)"


def _near_miss(code: str) -> list[str]:
    findings, misses = detect_all(Swiglu(), code)
    assert not findings, [f.qualname for f in findings]
    return [m.reason for m in misses]


def test_ssm_output_gate_is_a_near_miss() -> None:
    # ssm51 (integrator decision): the only exact form, npu_swiglu(cat([z, y])), moves ~7N elements against the eager
    # silu + mul's ~5N in the same two launches, so the SSM output gate stays a near miss with its true reason
    reasons = _near_miss(_SSM)
    assert any(_TRANSFORMED in r and "not a gated product of two projections" in r for r in reasons), reasons


_DECODE = '''
import torch
import torch.nn as nn


class GatedStep(nn.Module):
    """One decode step: the gate is a view of a split part, the silu written out."""

    def __init__(self, d, heads, hd):
        super().__init__()
        self.heads, self.hd = heads, hd
        self.in_proj = nn.Linear(d, 2 * heads * hd + heads)
        self.out_proj = nn.Linear(heads * hd, d)

    def step(self, tok, state):
        b = tok.shape[0]
        z, xs, dt = torch.split(self.in_proj(tok), [self.heads * self.hd, self.heads * self.hd, self.heads], dim=-1)
        z = z.view(b, 1, self.heads, self.hd)
        xs = xs.view(b, 1, self.heads, self.hd)
        state = torch.sigmoid(dt)[:, 0, :, None] * state + xs[:, 0]
        y = state * 0.5 + xs[:, 0]
        y = y * (z[:, 0] * torch.sigmoid(z[:, 0]))
        return self.out_proj(y.reshape(b, 1, -1).to(tok.dtype)), state
'''

_DECODE_RUN = '''
torch.manual_seed(0)
m = GatedStep(8, 2, 4).to(DTYPE)
tok = torch.randn(3, 1, 8, dtype=DTYPE, requires_grad=True)
state = torch.randn(3, 2, 4, dtype=STATE)
out = list(m.step(tok, state))
leaves = [tok]
'''


def test_decode_step_gate_view_is_a_near_miss() -> None:
    # the decode step's y * silu(z[:, 0]) (silu written out): y is the state update, not a projection
    assert _NOT_PROJ in _near_miss(_DECODE)


def test_broadcast_gate_is_a_near_miss() -> None:
    for gate in ("z[..., None]", "z.unsqueeze(-1)"):
        reasons = _near_miss(_SSM.replace("y = y * F.silu(z)", f"y = y * F.silu({gate})"))
        assert any(_TRANSFORMED in r for r in reasons), reasons


def test_number_factor_is_a_near_miss() -> None:
    reasons = _near_miss(_SSM.replace("y = y * F.silu(z)", "g = 0.5\n        y = g * F.silu(z)"))
    assert any("`g` is a constant scale multiplying a tensor, not a gate" in r for r in reasons), reasons


def test_self_gate_sigmoid_gate_and_per_step_gate_stay_refused() -> None:
    # z * silu(z): one tensor, no pair; a sigmoid gate is no silu; a per-step slice inside the Python scan loop
    assert _near_miss(_SSM.replace("y = y * F.silu(z)", "y = z * F.silu(z)"))
    _near_miss(_SSM.replace("y = y * F.silu(z)", "y = y * torch.sigmoid(z)"))
    loop = _SSM.replace("        y = y * F.silu(z)\n", "        for t in range(y.shape[1]):\n            y[:, t] = y[:, t] * F.silu(z[:, t])\n")
    _near_miss(loop)


# -- 1b. the same gap in SDPA: F.scaled_dot_product_attention of 3-D operands of no stated rank ----------------------

from npufuse.patterns.sdpa import SdpaPattern  # noqa: E402

_SDPA = '''
import torch
import torch.nn.functional as F


def attend(q, k, v, mask=None, causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
'''

_SDPA_RUN = '''
torch.manual_seed(0)
q = torch.randn(3, 7, 8, requires_grad=True); k = torch.randn(3, 9, 8, requires_grad=True); v = torch.randn(3, 9, 8, requires_grad=True)
keep = torch.rand(3, 7, 9) > 0.3
keep[..., 0] = True
k7 = torch.randn(3, 7, 8, requires_grad=True); v7 = torch.randn(3, 7, 8, requires_grad=True)
out = [attend(q, k, v), attend(q[None], k[None], v[None]), attend(q, k, v, keep), attend(q, k7, v7, None, True),
       attend(q, k, v, keep[:1])]
leaves = [q, k, v, k7]
'''


def test_sdpa_3d_operands_reach_the_fused_call() -> None:
    findings, misses = detect_all(SdpaPattern(), _SDPA)
    assert [f.qualname for f in findings] == ["attend"], [m.reason for m in misses]
    facts = check_rewrite_runs(SdpaPattern(), _SDPA, _SDPA_RUN, findings)
    assert facts["calls"] == 5, facts  # no mask, 4-D, a 3-D bool mask, causal, a [1, Sq, Skv] mask
    assert min(facts["cos_out"]) > 0.99999 and min(facts["cos_grad"]) > 0.99999, facts
    assert all(a == b for a, b in facts["shapes"]), facts


def test_sdpa_3d_query_beside_4d_keys_runs_the_original() -> None:
    run = '''
torch.manual_seed(0)
q = torch.randn(3, 7, 8); k = torch.randn(2, 3, 9, 8); v = torch.randn(2, 3, 9, 8)
out = [attend(q, k, v)]
'''
    findings, _ = detect_all(SdpaPattern(), _SDPA)
    ref, got, calls = _outputs(_SDPA, run, findings)
    assert calls.get("npu_fusion_attention", 0) == 0 and torch.equal(ref[0], got[0]), calls


def test_scan_output_rebinding_the_other_half_is_a_near_miss() -> None:
    # `a, z = xz.chunk(2)`, then `a` rebound through the scan: a * silu(z) is the SSM gate, a near miss (ssm51)
    code = _SSM.replace("""        u, z = self.in_proj(x).chunk(2, dim=-1)
        if keep is not None:
            z = z * keep
        y = self.scan(F.silu(u)) + self.skip * u
        y = y * F.silu(z)
        return self.out_proj(y)""", """        u, z = self.in_proj(x).chunk(2, dim=-1)
        u = F.silu(u)
        u = self.scan(u)
        u = u * F.silu(z)
        return self.out_proj(u)""")
    assert _NOT_PROJ in _near_miss(code)
