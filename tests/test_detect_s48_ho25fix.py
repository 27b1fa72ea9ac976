"""s48 (ho25fix): the judged HO25a / HO25b misses (not blind any more), with invented second spellings and
near-miss twins.

1. rms_norm / add_rms_norm: an own RMSNorm whose compute dtype is an if-else on the input's dtype
   (``compute_dtype = torch.float32 if x.dtype in (fp16, bf16) else x.dtype``): float32 for every dtype
   npu_rms_norm takes, so it is the op's own upcast; fused under ``x.dtype in (fp16, bf16, fp32)`` (float64 keeps
   the original, whose emulated op would raise).
"""

from __future__ import annotations

import pytest
import torch
from pattern_harness import check_rewrite_runs, detect_all
from pattern_harness import fused_and_runs as _fused_and_runs, near_miss_says as _near_miss

from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.rms_norm import RmsNorm


# -- 1. a conditional upcast dtype -----------------------------------------------------------------------------------

_COND = '''\
import torch
import torch.nn as nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    in_dtype = x.dtype
    compute_dtype = torch.float32 if in_dtype in (torch.float16, torch.bfloat16) else in_dtype
    x = x.to(compute_dtype)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x.to(in_dtype) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn_norm = RMSNorm(d)
        self.ffn_norm = RMSNorm(d)
        self.attn = nn.Linear(d, d)
        self.ffn = nn.Linear(d, d)

    def forward(self, x):
        h = x + self.attn(self.attn_norm(x))
        h = h + self.ffn(self.ffn_norm(h))
        return h
'''

_COND_RUN = '''
torch.manual_seed(0)
n = RMSNorm(16)
with torch.no_grad():
    n.weight.add_(torch.randn(16) * 0.1)
x = torch.randn(3, 5, 16, requires_grad=True)
xd = torch.randn(3, 16, dtype=torch.float64)
out = [n(x), n(x.to(torch.bfloat16)).float(), n(x.half()).float(), rms_norm(xd, n.weight.double(), 1e-5)]
leaves = [x, n.weight]
'''

_COND_BLOCK_RUN = '''
torch.manual_seed(0)
b = Block(16)
with torch.no_grad():
    b.ffn_norm.weight.add_(torch.randn(16) * 0.1)
x = torch.randn(3, 5, 16, requires_grad=True)
out = [b(x)]
with torch.no_grad():
    out.append(b(x.detach()))
bd = Block(16).double()
out.append(bd(torch.randn(2, 16, dtype=torch.float64)))
leaves = [x, b.ffn_norm.weight]
'''

# the second spelling: a method, the test on the tensor's own dtype written with `==` / `or`, the dtype name unused
# elsewhere, `.type()` as the cast and `type_as` back
_COND2 = '''\
import torch
from torch import nn


class SafeRMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.g = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, hidden):
        acc = torch.float if (hidden.dtype == torch.half or hidden.dtype == torch.bfloat16) else hidden.dtype
        h = hidden.type(acc)
        var = h.square().mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + self.eps)
        return self.g * h.type_as(hidden)
'''

_COND2_RUN = '''
torch.manual_seed(2)
n = SafeRMSNorm(24)
with torch.no_grad():
    n.g.add_(torch.randn(24) * 0.1)
x = torch.randn(4, 24, requires_grad=True)
out = [n(x), n(x.to(torch.bfloat16)).float(), n.double()(x.detach().double())]
leaves = [x]
'''


def test_conditional_upcast_helper_fuses() -> None:
    facts = _fused_and_runs(RmsNorm(), _COND, _COND_RUN, "rms_norm", tol=0.999)
    assert "x.dtype in (torch.float16, torch.bfloat16, torch.float32)" in facts["rewritten"]


def test_conditional_upcast_second_spelling_fuses() -> None:
    facts = _fused_and_runs(RmsNorm(), _COND2, _COND2_RUN, "SafeRMSNorm.forward", tol=0.999)
    assert "hidden.dtype in (torch.float16, torch.bfloat16, torch.float32)" in facts["rewritten"]
    # read statically (the start code found this class only by its numeric probe, at medium confidence)
    (f,), _ = detect_all(RmsNorm(), _COND2)
    assert f.variant == "cast_then_weight" and "found_by" not in f.params, (f.variant, f.params)


def test_add_then_conditional_upcast_norm_fuses() -> None:
    findings, misses = detect_all(AddRmsNorm(), _COND)
    assert [f.qualname for f in findings] == ["Block.forward"], [m.reason for m in misses]
    facts = check_rewrite_runs(AddRmsNorm(), _COND, _COND_BLOCK_RUN, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.999 and min(facts["cos_grad"]) > 0.999, facts
    assert all(a == b for a, b in facts["dtypes"]), facts
    # tested on the first operand before the add (the sum `h` is not computed yet)
    assert "if x.dtype in (torch.float16, torch.bfloat16, torch.float32)" in facts["rewritten"]


@pytest.mark.parametrize("change", [
    # bf16 stays bf16: computed in bf16 where npu_rms_norm computes in float32
    ("torch.float32 if in_dtype in (torch.float16, torch.bfloat16) else in_dtype",
     "torch.float32 if in_dtype == torch.float16 else in_dtype"),
    # float32 computes in float16
    ("torch.float32 if in_dtype in (torch.float16, torch.bfloat16) else in_dtype",
     "torch.float32 if in_dtype in (torch.float16, torch.bfloat16) else torch.float16"),
])
def test_conditional_dtype_not_float32_is_a_true_near_miss(change: tuple[str, str]) -> None:
    code = _COND.replace(*change)
    assert code != _COND
    _near_miss(RmsNorm(), code, "which is not float32 for every input npu_rms_norm takes")


def test_conditional_on_another_tensor_is_not_read() -> None:
    """The test reads another tensor's dtype: not the cast operand's, so no upcast is proven."""
    code = _COND2.replace("(hidden.dtype == torch.half or hidden.dtype == torch.bfloat16)",
                          "(self.g.dtype == torch.half or self.g.dtype == torch.bfloat16)")
    assert code != _COND2
    findings, _ = detect_all(RmsNorm(), code)
    assert not findings


# -- 2. moe_experts: the routing weight as a masked sum over the slots of the selected rows ------------------------

from npufuse.patterns.moe_experts import MoeExperts  # noqa: E402

_MASKSUM = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)
        self.w3 = nn.Linear(d, h, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    def __init__(self, d, n, k):
        super().__init__()
        self.k = k
        self.proj = nn.Linear(d, n, bias=False)

    def forward(self, x):
        probs = self.proj(x).softmax(dim=-1)
        w, idx = torch.topk(probs, self.k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        return probs, idx, w


class DeepSeekMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.num_experts = n
        self.num_experts_per_tok = k
        self.gate = Router(d, n, k)
        self.experts = nn.ModuleList([Expert(d, h) for _ in range(n)])

    def forward(self, hidden_states):
        B, L, D = hidden_states.shape
        router_probs, selected_experts, expert_weights = self.gate(hidden_states)
        hidden_flat = hidden_states.view(-1, D)
        selected_flat = selected_experts.view(-1, self.num_experts_per_tok)
        weights_flat = expert_weights.view(-1, self.num_experts_per_tok)
        routed_output = torch.zeros(B * L, D, device=hidden_states.device, dtype=hidden_states.dtype)
        for expert_idx in range(self.num_experts):
            expert_mask = (selected_flat == expert_idx)
            token_indices = expert_mask.any(dim=-1).nonzero(as_tuple=True)[0]
            if len(token_indices) == 0:
                continue
            expert_input = hidden_flat[token_indices]
            token_weights = (expert_mask[token_indices].float() * weights_flat[token_indices]).sum(dim=-1, keepdim=True)
            expert_output = self.experts[expert_idx](expert_input)
            weighted_output = expert_output * token_weights
            routed_output.index_add_(0, token_indices, weighted_output)
        return routed_output.view(B, L, D)
'''

_MASKSUM_RUN = '''
torch.manual_seed(3)
m = DeepSeekMoE(16, 24, 6, 2)
x = torch.randn(2, 7, 16, requires_grad=True)
out = [m(x)]
leaves = [x, m.gate.proj.weight, m.experts[2].w1.weight]
'''

# the second spelling: the mask named `hit`, rows by torch.where, the weights first and the mask cast to their
# dtype, a sum without keepdim made a column by unsqueeze, the product written the other way round, added back in place
_MASKSUM2 = '''\
import torch
from torch import nn


class Mlp(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class TokenChoice(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.n, self.k = n, k
        self.router = nn.Linear(d, n)
        self.mlps = nn.ModuleList(Mlp(d, h) for _ in range(n))

    def forward(self, tokens):
        scores = self.router(tokens).softmax(-1)
        weights, routes = scores.topk(self.k, dim=-1)
        result = torch.zeros_like(tokens)
        for i in range(self.n):
            hit = routes == i
            rows = torch.where(hit.any(-1))[0]
            g = (weights[rows] * hit[rows].to(weights.dtype)).sum(-1)
            result[rows] += g.unsqueeze(-1) * self.mlps[i](tokens[rows])
        return result
'''

_MASKSUM2_RUN = '''
torch.manual_seed(4)
m = TokenChoice(12, 20, 5, 3)
x = torch.randn(17, 12, requires_grad=True)
out = [m(x)]
leaves = [x, m.router.weight, m.mlps[1].up.weight]
'''


def test_masked_slot_sum_of_selected_rows_fuses() -> None:
    _fused_and_runs(MoeExperts(), _MASKSUM, _MASKSUM_RUN, "DeepSeekMoE.forward", tol=0.99999)


def test_masked_slot_sum_second_spelling_fuses() -> None:
    _fused_and_runs(MoeExperts(), _MASKSUM2, _MASKSUM2_RUN, "TokenChoice.forward", tol=0.99999)


@pytest.mark.parametrize("change", [
    # the dense [T, E] probabilities under the [T, K] slot mask: not the slots' weights
    ("weights_flat = expert_weights.view(-1, self.num_experts_per_tok)",
     "weights_flat = router_probs.view(-1, self.num_experts)"),
    # reshaped by another function than the indices (not read; the reason says what is not shown)
    ("weights_flat = expert_weights.view(-1, self.num_experts_per_tok)",
     "weights_flat = expert_weights.reshape(-1, self.num_experts_per_tok)"),
])
def test_masked_slot_sum_of_unaligned_weights_is_a_true_near_miss(change: tuple[str, str]) -> None:
    code = _MASKSUM.replace(*change)
    assert code != _MASKSUM
    _near_miss(MoeExperts(), code, "has the shape of the expert indices `selected_flat`")


def test_masked_slot_sum_with_rows_of_another_mask_is_not_fused() -> None:
    """The weights picked at other rows than the mask's: not the selected rows' slots."""
    code = _MASKSUM2.replace("(weights[rows] * hit[rows].to(weights.dtype))", "(weights[rows.flip(0)] * hit[rows].to(weights.dtype))")
    assert code != _MASKSUM2
    findings, _ = detect_all(MoeExperts(), code)
    assert not findings


def test_reshaped_pair_guard_keeps_the_original_for_another_last_dim() -> None:
    """The fused branch runs only where the reshape keeps the slots as the last dim."""
    (f,), _ = detect_all(MoeExperts(), _MASKSUM)
    assert "selected_flat.shape[-1] == selected_experts.shape[-1]" in f.fused or \
        "selected_flat.shape[-1] == selected_experts.shape[-1]" in str(f.guard_tensor)


# -- 4. add_rms_norm: a forward installed on a transformers Gemma-family layer ((1 + weight) norms) -------------------

import sys  # noqa: E402
import types  # noqa: E402

_GEMMA_STUB = '''
import torch
from torch import nn


class GemmaRMSNorm(nn.Module):  # transformers' code (4.38 - 4.5x); Gemma2RMSNorm / Gemma3RMSNorm are the same
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class Gemma2RMSNorm(GemmaRMSNorm):
    pass


class GemmaDecoderLayer(nn.Module):
    def __init__(self, d, norm=GemmaRMSNorm):
        super().__init__()
        self.input_layernorm = norm(d)
        self.post_attention_layernorm = norm(d)
        self.pre_feedforward_layernorm = norm(d)
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Linear(d, d)
'''


def _stub_gemma() -> dict:
    names = ["transformers", "transformers.models", "transformers.models.gemma", "transformers.models.gemma.modeling_gemma",
             "transformers.models.gemma2", "transformers.models.gemma2.modeling_gemma2"]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    ns: dict = {"__name__": "transformers.models.gemma.modeling_gemma"}
    exec(_GEMMA_STUB, ns)
    g, g2 = sys.modules[names[3]], sys.modules[names[5]]
    for k in ("GemmaRMSNorm", "GemmaDecoderLayer"):
        setattr(g, k, ns[k])
    ns["Gemma2RMSNorm"].__module__ = names[5]
    g2.Gemma2RMSNorm = ns["Gemma2RMSNorm"]  # type: ignore[attr-defined]
    g2.Gemma2DecoderLayer = lambda d: ns["GemmaDecoderLayer"](d, ns["Gemma2RMSNorm"])  # type: ignore[attr-defined]
    sys.modules["transformers.models.gemma2"].modeling_gemma2 = g2  # type: ignore[attr-defined]
    return saved


def _restore(saved: dict) -> None:
    for n, m in saved.items():
        if m is None:
            sys.modules.pop(n, None)
        else:
            sys.modules[n] = m


@pytest.fixture
def gemma_stub():
    saved = _stub_gemma()
    yield
    _restore(saved)


_GEMMA = '''\
import torch
from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer


def _gemma_decoder_layer_custom_forward(self: "GemmaDecoderLayer", hidden_states):
    pre_att = self.input_layernorm(hidden_states)
    out_att = self.attn(pre_att)
    res_att = hidden_states + out_att
    pre_mlp = self.post_attention_layernorm(res_att)
    out_mlp = self.mlp(pre_mlp)
    return res_att + out_mlp
'''

_GEMMA_RUN = '''
import types as _t
from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer as _L
torch.manual_seed(6)
layer = _L(16)
with torch.no_grad():
    for p in layer.parameters():
        p.normal_(0, 0.3)
fwd = _gemma_decoder_layer_custom_forward
x = torch.randn(2, 5, 16)
with torch.no_grad():
    out = [fwd(layer, x), fwd(layer.to(torch.bfloat16), x.to(torch.bfloat16)).float()]
layer = layer.float()
xg = torch.randn(2, 5, 16, requires_grad=True)
out.append(fwd(layer, xg))
leaves = [xg, layer.post_attention_layernorm.weight]
'''

# the second spelling: Gemma2's layer (a post-attention norm on the branch, the sum normed by pre_feedforward_layernorm),
# the modeling module imported whole, the residual named before the attention
_GEMMA2 = '''\
import torch
from transformers.models.gemma2 import modeling_gemma2


def gemma2_layer_forward(self, hidden_states):
    residual = hidden_states
    h = self.attn(self.input_layernorm(hidden_states))
    h = self.post_attention_layernorm(h)
    mixed = residual + h
    normed = self.pre_feedforward_layernorm(mixed)
    return mixed + self.mlp(normed)
'''

_GEMMA2_RUN = '''
from transformers.models.gemma2 import modeling_gemma2 as _m
torch.manual_seed(7)
layer = _m.Gemma2DecoderLayer(24)
with torch.no_grad():
    for p in layer.parameters():
        p.normal_(0, 0.3)
x = torch.randn(3, 24)
with torch.no_grad():
    out = [gemma2_layer_forward(layer, x), gemma2_layer_forward(layer.to(torch.bfloat16), x.to(torch.bfloat16)).float()]
leaves = []
'''


def test_gemma_installed_forward_add_norm_fuses(gemma_stub) -> None:
    findings, misses = detect_all(AddRmsNorm(), _GEMMA)
    assert [f.qualname for f in findings] == ["_gemma_decoder_layer_custom_forward"], [m.reason for m in misses]
    facts = check_rewrite_runs(AddRmsNorm(), _GEMMA, _GEMMA_RUN, findings)
    assert facts["all_calls"].get("npu_add_rms_norm", 0) >= 2, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999, facts
    assert all(a == b for a, b in facts["dtypes"]), facts
    assert "(1.0 + self.post_attention_layernorm.weight.float())" in facts["rewritten"]
    assert '"GemmaRMSNorm"' in facts["rewritten"] and 'startswith("transformers.")' in facts["rewritten"]


def test_gemma2_installed_forward_second_spelling_fuses(gemma_stub) -> None:
    findings, misses = detect_all(AddRmsNorm(), _GEMMA2)
    assert [f.qualname for f in findings] == ["gemma2_layer_forward"], [m.reason for m in misses]
    facts = check_rewrite_runs(AddRmsNorm(), _GEMMA2, _GEMMA2_RUN, findings)
    assert facts["all_calls"].get("npu_add_rms_norm", 0) >= 2, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.9999, facts
    assert all(a == b for a, b in facts["dtypes"]), facts


def test_gemma_look_alike_of_another_module_runs_the_original(gemma_stub) -> None:
    """A class named GemmaRMSNorm from outside transformers (here without the 1 + weight gain): the run-time
    check sends it to the original call, so the fused branch never changes its result."""
    findings, _ = detect_all(AddRmsNorm(), _GEMMA)
    run = _GEMMA_RUN.replace("layer = _L(16)", (
        "class GemmaRMSNorm(torch.nn.Module):\n"
        "    def __init__(self, d):\n"
        "        super().__init__()\n"
        "        self.weight = torch.nn.Parameter(torch.ones(d))\n"
        "    def forward(self, x):\n"
        "        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight\n"
        "layer = _L(16, GemmaRMSNorm)"))
    facts = check_rewrite_runs(AddRmsNorm(), _GEMMA, run, findings)
    assert facts["all_calls"].get("npu_add_rms_norm", 0) == 0, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.99999, facts


def test_llama_family_file_keeps_the_llama_reading(gemma_stub) -> None:
    """A file importing a Llama family too: s37's Llama reading (its run-time check never holds for a Gemma norm)."""
    code = _GEMMA.replace("import torch\n", "import torch\nfrom transformers.models.llama import modeling_llama\n", 1)
    (f,), _ = detect_all(AddRmsNorm(), code)
    assert '"LlamaRMSNorm"' in f.fused and "GemmaRMSNorm" not in f.fused
