"""s45 (ho22fix45): classes behind the real misses and the wrong extra of the blind sets HO22a / HO22b, with
invented reproducers.

1. A mask built from bucket boundaries (``t >= ceil((j + 1) * T / P) - 1``, a Linformer projected-KV causal mask):
   at ``T > P`` the first query rows keep no bucket; torch gives them NaN, npu_fusion_attention's value there is not
   pinned down (spec 5.1 / 14). ``_mask_rows`` now reads rounding / clamping and a helper's local stored twice in
   straight-line code, so such a mask takes the run-time check that every query row keeps a key.
2. add_rms_norm into a norm class whose forward first adapts an input of another width (``if x.size(-1) !=
   self.dim: pad / truncate``): fused under the run-time test that the width is the norm's (the branch does not run),
   the original otherwise.
3. moe_experts: a per-expert loop in a helper method whose routing weights and top-k indices are its parameters
   (shown shaped alike at every call of the method), the weight read as ``(w * (idx == e)).sum(1)[token_rows]``
   with the rows ``mask.any(1).nonzero(as_tuple=True)[0]``.
4. 1-D expert indices through selections: ``flat = idx.reshape(-1)`` (or ``ravel``) then ``flat[keep]`` /
   ``flat[order]`` with ``order = argsort(flat)`` stay 1-D, so ``(flat == e).nonzero()`` lists rows.
5. add_rms_norm into a norm class with eps added outside the root (``x / (||x|| * d ** -0.5 + eps) * g``): mapped to
   eps' = eps ** 2 as rms_norm maps it alone (the probe's bound decides: every dtype, fp16 / bf16 only, or refused).
"""

from __future__ import annotations


import pytest
from pattern_harness import check_rewrite_runs, detect_all
from test_detect_s40_wrong_classes import _verdict
from test_detect_s43_sweep import _BLOCK_RUN

from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.moe_experts import MoeExperts
from npufuse.scan.dataflow import ModuleInfo

# -- 1. bucket-causal masks that can empty a query row -----------------------------------------------------------------


@pytest.mark.parametrize("body, polarity, kind", [
    # bucket boundaries: row 0 keeps bucket 0 only where n <= p
    ("b = torch.ceil((torch.arange(w) + 1) * (n / w)).long() - 1\nb = torch.clamp(b, max=n - 1)\n"
     "m = torch.arange(n).unsqueeze(-1) >= b.unsqueeze(0)", "keep", "varies"),
    ("b = ((torch.arange(w) + 1) * n / w).ceil().long() - 1\nb = b.clamp(max=n - 1)\n"
     "m = torch.arange(n)[:, None] < b[None, :]", "masked", "varies"),
    ("b = torch.floor(torch.arange(w) * (n / w)).long()\nm = torch.arange(n)[:, None] >= b[None, :]", "keep", "kept"),
    # near miss: a strict comparison with a non-negative boundary leaves row 0 empty at every size
    ("b = torch.clamp(torch.floor(torch.arange(w) * (n / w)).long(), min=0)\nm = torch.arange(n)[:, None] > b[None, :]",
     "keep", "empty"),
])
def test_bucket_boundary_masks_are_read(body: str, polarity: str, kind: str) -> None:
    assert _verdict(body, polarity) == kind


def test_a_store_inside_a_branch_is_not_read_as_straight_line() -> None:
    # the helper's second store runs only under its branch: not the one store that reaches the return
    helper = ("def mk(n):\n    b = torch.arange(n)\n    if q:\n        b = b + 1\n"
              "    return torch.arange(n)[:, None] >= b[None, :]\nm = mk(n)")
    assert _verdict(helper, "keep") == "varies"
    straight = helper.replace("    if q:\n        b = b + 1\n", "    b = b + 1\n")
    assert _verdict(straight, "keep") == "empty"


_LINFORMER = '''\
import math
import torch
from torch import nn
import torch.nn.functional as F


class ProjectedAttention(nn.Module):
    def __init__(self, dim=32, heads=4, block=16, proj=4):
        super().__init__()
        self.heads, self.hd, self.proj = heads, dim // heads, proj
        self.qkv = nn.Linear(dim, 3 * dim)
        self.e_k = nn.Parameter(torch.randn(block, proj) / math.sqrt(proj))
        self.e_v = nn.Parameter(torch.randn(block, proj) / math.sqrt(proj))

    def _bucket_mask(self, T, device):
        t = torch.arange(T, device=device)
        limits = torch.ceil((torch.arange(self.proj, device=device) + 1) * (T / self.proj)).long() - 1
        limits = torch.clamp(limits, max=T - 1)
        return t.unsqueeze(-1) >= limits.unsqueeze(0)

    def forward(self, x):
        B, T, _ = x.size()
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        k = torch.einsum('bnth,tp->bnph', k, self.e_k[:T])
        v = torch.einsum('bnth,tp->bnph', v, self.e_v[:T])
        att = torch.einsum('bnth,bnph->bntp', q, k) * (1.0 / math.sqrt(self.hd))
        keep = self._bucket_mask(T, x.device)
        att = att.masked_fill(~keep.view(1, 1, T, self.proj), float('-inf'))
        att = F.softmax(att, dim=-1)
        y = torch.einsum('bntp,bnph->bnth', att, v)
        return y.transpose(1, 2).reshape(B, T, -1)
'''


def _run_linformer(T: int) -> str:
    return f'''
m = ProjectedAttention()
x = torch.randn(2, {T}, 32, requires_grad=True)
out = m(x)
leaves = [x]
'''


def test_bucket_causal_mask_takes_the_every_row_keeps_a_key_check() -> None:
    (f,), misses = detect_all(AttentionPattern(), _LINFORMER)
    assert f.fused.startswith("keep = self._bucket_mask(T, x.device)\nif (not bool((~keep.view(1, 1, T, self.proj)).all(-1).any()))"), f.fused
    assert any("a query row can keep no key" in r.detail for r in f.risks)
    # T <= P: every row keeps a bucket, the fused call runs and matches
    facts = check_rewrite_runs(AttentionPattern(), _LINFORMER, _run_linformer(4), [f])
    assert facts["calls"] >= 1 and min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999, facts


def test_bucket_causal_mask_with_empty_rows_runs_the_original() -> None:
    (f,), _ = detect_all(AttentionPattern(), _LINFORMER)
    # T = 16 > P = 4: rows 0-2 keep no bucket; the original (NaN rows) runs, not the fused call
    facts = check_rewrite_runs(AttentionPattern(), _LINFORMER, _run_linformer(16), [f])
    assert facts["calls"] == 0, facts["all_calls"]


def test_bucket_mask_emptying_row_zero_at_every_size_is_a_near_miss() -> None:
    code = _LINFORMER.replace("limits = torch.clamp(limits, max=T - 1)", "limits = torch.clamp(limits, min=0)") \
        .replace("return t.unsqueeze(-1) >= limits", "return t.unsqueeze(-1) > limits")
    findings, misses = detect_all(AttentionPattern(), code)
    assert not findings
    assert any("leaves query row 0 without any key at every size" in m.reason for m in misses), [m.reason for m in misses]


# -- 2. a norm that adapts an input of another width first ---------------------------------------------------------------

_WIDTH_NORM = '''\
import torch
from torch import nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))
        self.dim = dim

    def forward(self, x):
        if x.size(-1) != self.dim:
            if x.size(-1) < self.dim:
                x = F.pad(x, (0, self.dim - x.size(-1)))
            else:
                x = x[..., :self.dim]
        rms = torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + self.eps)
        return x / rms * self.scale


class Block(nn.Module):
    def __init__(self, d, norm_dim=None):
        super().__init__()
        self.norm1 = RMSNorm(d)
        self.attn = nn.Linear(d, d)
        self.norm2 = RMSNorm(norm_dim or d)
        self.ffn = nn.Linear(norm_dim or d, d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        x = x + self.ffn(self.norm2(x))
        return x
'''

_TRUNCATE_ONLY = _WIDTH_NORM.replace('''        if x.size(-1) != self.dim:
            if x.size(-1) < self.dim:
                x = F.pad(x, (0, self.dim - x.size(-1)))
            else:
                x = x[..., :self.dim]
''', '''        if self.dim != x.shape[-1]:
            x = x[..., :self.dim]
''')

@pytest.mark.parametrize("code", [_WIDTH_NORM, _TRUNCATE_ONLY], ids=["pad_or_truncate", "truncate_reversed_test"])
def test_norm_adapting_another_width_is_fused_where_the_widths_agree(code: str) -> None:
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [f.qualname for f in findings] == ["Block.forward"], [m.reason for m in misses]
    assert "x.shape[-1] == self.norm2.dim" in findings[0].fused.splitlines()[0], findings[0].fused
    facts = check_rewrite_runs(AddRmsNorm(), code, _BLOCK_RUN, findings)
    assert facts["all_calls"].get("npu_add_rms_norm"), facts["all_calls"]
    assert min(facts["cos_out"]) > 0.99999 and min(facts["cos_grad"]) > 0.99999, facts


def test_norm_adapting_another_width_runs_the_original_where_the_widths_differ() -> None:
    findings, _ = detect_all(AddRmsNorm(), _WIDTH_NORM)
    facts = check_rewrite_runs(AddRmsNorm(), _WIDTH_NORM, _BLOCK_RUN.replace("Block(16)", "Block(16, norm_dim=20)"), findings)
    assert not facts["all_calls"].get("npu_add_rms_norm") and not facts["all_calls"].get("npu_rms_norm"), facts["all_calls"]
    assert min(facts["cos_out"]) > 0.99999, facts


@pytest.mark.parametrize("change, why", [
    # the branch returns another computation: not a width adaptation before the norm
    ("                x = x[..., :self.dim]\n", "                return x[..., :self.dim]\n"),
    # the input is rebound after the branch too (scaled): the norm of a value computed from the input
    ("        rms = torch.sqrt(", "        x = x * 2.0\n        rms = torch.sqrt("),
    # the test reads something other than the input's width
    ("        if x.size(-1) != self.dim:\n", "        if x.size(0) != self.dim:\n"),
], ids=["returning_branch", "rebound_after", "other_size"])
def test_width_adaptations_that_change_the_value_stay_unfused(change: tuple[str, str], why: str) -> None:
    code = _WIDTH_NORM.replace(change, why)
    assert code != _WIDTH_NORM
    findings, _ = detect_all(AddRmsNorm(), code)
    assert not findings, findings[0].fused


# -- 3. routing weights and indices handed to a helper method ------------------------------------------------------------

_HELPER_MOE = '''\
import torch
from torch import nn
import torch.nn.functional as F


class Router(nn.Module):
    def __init__(self, d, n, k):
        super().__init__()
        self.gate = nn.Linear(d, n, bias=False)
        self.k = k

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        w, idx = torch.topk(probs, self.k, dim=-1)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-8)
        return w, idx, probs


class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    def __init__(self, d=16, h=32, n=4, k=2):
        super().__init__()
        self.num_experts = n
        self.router = Router(d, n, k)
        self.experts = nn.ModuleList([Expert(d, h) for _ in range(n)])

    def forward(self, x):
        B, T, D = x.shape
        flat = x.view(-1, D)
        routing_weights, selected, _ = self.router(flat)
        out = self._experts(flat, routing_weights, selected)
        return out.view(B, T, D)

    def _experts(self, x, routing_weights, selected):
        N, D = x.shape
        output = torch.zeros(N, D, device=x.device, dtype=x.dtype)
        for e in range(self.num_experts):
            mask = (selected == e)
            if not mask.any():
                continue
            rows = mask.any(dim=1).nonzero(as_tuple=True)[0]
            y = self.experts[e](x[rows])
            weights = (routing_weights * mask.float()).sum(dim=1)
            output.index_add_(0, rows, y * weights[rows].unsqueeze(-1))
        return output
'''

_HELPER_MOE_RUN = """
torch.manual_seed(0)
m = MoE()
x = torch.randn(2, 6, 16, requires_grad=True)
out = m(x)
leaves = [x]
"""


def test_expert_loop_in_a_helper_method_reads_the_callers_router_outputs() -> None:
    findings, misses = detect_all(MoeExperts(), _HELPER_MOE)
    assert [f.qualname for f in findings] == ["MoE._experts"], [m.reason for m in misses]
    facts = check_rewrite_runs(MoeExperts(), _HELPER_MOE, _HELPER_MOE_RUN, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999, facts


def test_expert_loop_with_local_router_outputs_reads_the_weight_at_the_token_rows() -> None:
    # the same loop inline: the weight `(w * mask).sum(1)[rows]` at rows from `mask.any(1).nonzero(as_tuple=True)[0]`
    code = _HELPER_MOE.replace("        out = self._experts(flat, routing_weights, selected)\n",
                               "        x = flat\n        N = x.shape[0]\n        output = torch.zeros_like(x)\n"
                               "        for e in range(self.num_experts):\n            mask = (selected == e)\n"
                               "            rows = mask.any(dim=1).nonzero(as_tuple=True)[0]\n"
                               "            weights = (routing_weights * mask.float()).sum(dim=1)\n"
                               "            output.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows].unsqueeze(-1))\n"
                               "        out = output\n")
    findings, misses = detect_all(MoeExperts(), code)
    assert "MoE.forward" in [f.qualname for f in findings], [m.reason for m in misses]
    f = next(f for f in findings if f.qualname == "MoE.forward")
    facts = check_rewrite_runs(MoeExperts(), code, _HELPER_MOE_RUN, [f])
    assert facts["calls"] >= 1 and min(facts["cos_out"]) >= 0.9999, facts


@pytest.mark.parametrize("change", [
    # one caller hands the softmax over every expert as the weights: [N, E] beside [N, K] indices, not shaped alike
    ("        out = self._experts(flat, routing_weights, selected)\n",
     "        out = self._experts(flat, routing_weights, selected)\n        out = out + self._experts(flat, _, selected)\n"),
    # the method is also reached as a stored bound method: its callers are not all known
    ("        out = self._experts(flat, routing_weights, selected)\n",
     "        run = self._experts\n        out = run(flat, routing_weights, selected)\n"),
], ids=["dense_probs_at_one_caller", "stored_bound_method"])
def test_helper_method_weights_not_shown_shaped_like_the_indices_stay_unfused(change: tuple[str, str]) -> None:
    code = _HELPER_MOE.replace(*change)
    assert code != _HELPER_MOE
    findings, misses = detect_all(MoeExperts(), code)
    assert "MoE._experts" not in [f.qualname for f in findings]


# -- 4. 1-D indices through selections ------------------------------------------------------------------------------------


def _one_d(body: str, name: str) -> bool:
    from npufuse.scan.canonical import flattened_to_1d

    code = "import torch\n\ndef f(idx, w, k):\n" + "".join(f"    {ln}\n" for ln in body.splitlines()) + "    return None\n"
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "f")
    return flattened_to_1d(module, scope, name, len(code.splitlines()))


@pytest.mark.parametrize("body, one_d", [
    ("e = idx.reshape(-1)\nkeep = w.reshape(-1) > 1e-12\ne = e[keep]\norder = torch.argsort(e)\ns = e[order]", True),
    ("e = idx.ravel()\ns = e[e.argsort()]", True),
    ("e = torch.ravel(idx).long()\ns = e[e != k]", True),
    ("e = idx.view(-1)\ns = e[w]", False),          # w: not shown 1-D nor a mask (could be a [n, 2] index)
    ("e = idx[w > 0]", False),                       # idx itself not shown 1-D (a mask of a 2-D idx is 1-D, not read)
    ("e = idx.reshape(-1)\ns = e[:, None]", False),  # a new axis: 2-D
    ("s = idx[torch.argsort(idx)]", False),          # idx of unknown rank
])
def test_selections_from_a_flattened_index_stay_one_d(body: str, one_d: bool) -> None:
    assert _one_d(body, "s" if "s =" in body else "e") is one_d


# -- 5. add + a norm with eps outside the root ---------------------------------------------------------------------------

_EPS_OUTSIDE = '''\
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-8):
        super().__init__()
        self.scale = dim ** -0.5
        self.eps = eps
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        norm = torch.norm(x, dim=-1, keepdim=True) * self.scale
        return x / (norm + self.eps) * self.g


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1 = RMSNorm(d)
        self.attn = nn.Linear(d, d)
        self.norm2 = RMSNorm(d)
        self.ffn = nn.Linear(d, d)

    def forward(self, x):
        residual = x
        h = self.norm1(x)
        x = residual + self.attn(h)
        residual = x
        h = self.norm2(x)
        return residual + self.ffn(h)
'''


def test_add_into_a_norm_with_eps_outside_the_root_maps_eps() -> None:
    findings, misses = detect_all(AddRmsNorm(), _EPS_OUTSIDE)
    assert [f.qualname for f in findings] == ["Block.forward"], [m.reason for m in misses]
    f = findings[0]
    assert f.params["eps_rule"] == "added outside the root" and f.params["eps"] == "(self.norm2.eps) ** 2", f.params
    facts = check_rewrite_runs(AddRmsNorm(), _EPS_OUTSIDE, _BLOCK_RUN, findings)
    assert facts["all_calls"].get("npu_add_rms_norm"), facts["all_calls"]
    assert min(facts["cos_out"]) > 0.99999 and min(facts["cos_grad"]) > 0.99999, facts


def test_add_into_a_norm_with_a_large_eps_outside_the_root_stays_unfused() -> None:
    # eps 1e-2 outside the root differs from any eps inside it by far more than fp16's tolerance at rms 1
    findings, _ = detect_all(AddRmsNorm(), _EPS_OUTSIDE.replace("eps=1e-8", "eps=1e-2"))
    assert not findings, findings[0].fused
