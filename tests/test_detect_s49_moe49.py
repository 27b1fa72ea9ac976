"""s49 (moe49): moe_experts classes behind the development misses of HO25b / sweep48moe, with invented reproducers
(a second spelling each, and near-miss twins).

1. Per-sample (per-sequence) routing: one top-k choice per batch row (indices / weights [B, K]), its experts run on
   the row's whole [T, H] sequence (``out[mask] += expert(x[mask]) * w[mask, k].view(-1, 1, 1)``, or the samples'
   rows flattened for the expert and shaped back): the token loop over the sample's choice repeated over its
   tokens, fused where the experts are read as computing each token on its own.
2. ``w[mask, k].view(-1, 1)``: the [n, 1] column of one slot's weights (the token loop's ``.unsqueeze(-1)``).
3. Masked dense experts: ``expert(x)[mask]`` (the expert on every token, its rows picked after) read as
   ``expert(x[mask])`` where the expert computes each token on its own.
4. Sorted dispatch with per-expert gathers of sorted token ids: the flat (token, slot) pairs sorted by expert, the
   loop cutting each expert's run by offsets of bincount counts (a running offset, or host offsets of their
   exclusive cumsum), gathering its tokens and adding the weighted outputs back: read as the where loop it equals.
5. Stacked experts whose gate is a row-wise method of the class (``self._apply_gate(F.linear(rows, w13[e]))``, the
   clamped SwiGLU of transformers' v5 experts, the limit a config field): the method is called between the grouped
   matmuls.
"""

from __future__ import annotations

import torch
from pattern_harness import detect_all, fused_and_runs as _fused_and_runs, near_miss_says as _near_miss

from npufuse.patterns.moe_experts import MoeExperts


# -- 1. per-sample routing --------------------------------------------------------------------------------------------

# slot-outer / expert-inner loop, a [n, 1, 1] view of the slot weight, SwiGLU experts read off their class
_SLOT_VIEW = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class GatedFfn(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w_in = nn.Linear(d, h, bias=False)
        self.w_gate = nn.Linear(d, h, bias=False)
        self.w_out = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w_out(F.silu(self.w_gate(x)) * self.w_in(x))


class ClipRouted(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.k = k
        self.select = nn.Linear(d, n)
        self.experts = nn.ModuleList([GatedFfn(d, h) for _ in range(n)])

    def forward(self, seq, summary):
        p = self.select(summary).softmax(-1)
        w, picks = p.topk(self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        y = torch.zeros_like(seq)
        for j in range(self.k):
            for e, expert in enumerate(self.experts):
                rows = picks[:, j] == e
                if rows.any():
                    y[rows] += expert(seq[rows]) * w[rows, j].view(-1, 1, 1)
        return y
'''

_SLOT_VIEW_RUN = '''
torch.manual_seed(0)
m = ClipRouted(16, 24, 5, 2)
x = torch.randn(8, 5, 16, requires_grad=True)
s = torch.randn(8, 16)
out = m(x, s)
leaves = [x, m.select.weight, m.experts[0].w_in.weight, m.experts[4].w_out.weight]
'''

# expert loop over torch.where pairs, token-wise experts with a dropout (called as they are), unsqueezed twice
_WHERE_PAIRS = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class FeedForwardExpert(nn.Module):
    def __init__(self, dim, hidden, p=0.0):
        super().__init__()
        self.fc_in = nn.Linear(dim, hidden)
        self.fc_out = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(p)

    def forward(self, h):
        return self.fc_out(self.drop(F.gelu(self.fc_in(h))))


class SequenceRoutedMoE(nn.Module):
    def __init__(self, dim, hidden, num_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(FeedForwardExpert(dim, hidden) for _ in range(num_experts))

    def forward(self, tokens):
        pooled = tokens.mean(dim=1)
        weights, chosen = torch.topk(F.softmax(self.gate(pooled), dim=-1), self.top_k, dim=-1)
        mixed = tokens.new_zeros(tokens.shape)
        for e in range(len(self.experts)):
            seq_ids, slot = torch.where(chosen == e)
            if seq_ids.numel() == 0:
                continue
            mixed[seq_ids] += self.experts[e](tokens[seq_ids]) * weights[seq_ids, slot].unsqueeze(-1).unsqueeze(-1)
        return mixed
'''

_WHERE_PAIRS_RUN = '''
torch.manual_seed(0)
m = SequenceRoutedMoE(16, 24, 4, 2)
x = torch.randn(6, 5, 16, requires_grad=True)
out = m(x)
leaves = [x, m.gate.weight, m.experts[1].fc_in.weight, m.experts[2].fc_out.bias]
'''

# Mixtral-style one-hot masks per sequence, the samples' rows flattened for nn.Sequential experts and shaped back,
# the output scaled in place
_FLAT_BACK = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class PerSequenceMoE(nn.Module):
    def __init__(self, width, inner, n_experts, k):
        super().__init__()
        self.n_experts, self.k = n_experts, k
        self.router = nn.Linear(width, n_experts, bias=False)
        self.experts = nn.ModuleList([
            nn.Sequential(nn.Linear(width, inner), nn.SiLU(), nn.Linear(inner, width)) for _ in range(n_experts)
        ])

    def forward(self, h):
        bsz, length, width = h.shape
        summary = h.max(dim=1).values
        probs = F.softmax(self.router(summary), dim=1, dtype=torch.float)
        probs, picked = torch.topk(probs, self.k, dim=-1)
        probs = (probs / probs.sum(dim=-1, keepdim=True)).to(h.dtype)
        result = torch.zeros((bsz, length, width), dtype=h.dtype, device=h.device)
        hits = F.one_hot(picked, num_classes=self.n_experts).permute(2, 1, 0)
        for i in range(self.n_experts):
            slot, seqs = torch.where(hits[i])
            if seqs.shape[0] == 0:
                continue
            flat = h[seqs].reshape(-1, width)
            y = self.experts[i](flat).view(-1, length, width)
            y *= probs[seqs, slot][:, None].unsqueeze(-1)
            result[seqs] += y.to(h.dtype)
        return result
'''

_FLAT_BACK_RUN = '''
torch.manual_seed(2)
m = PerSequenceMoE(12, 20, 4, 2)
x = torch.randn(7, 3, 12, requires_grad=True)
out = m(x)
leaves = [x, m.router.weight, m.experts[0][0].weight, m.experts[3][2].bias]
'''

# an expert that mixes the tokens of its sequence (a mean over them): per-token dispatch would change it
_MIXER = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class MixerExpert(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, h):
        ctx = h.mean(dim=1, keepdim=True)
        return self.down(F.gelu(self.up(h + ctx)))


class SequenceRoutedMoE(nn.Module):
    def __init__(self, dim, hidden, num_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(MixerExpert(dim, hidden) for _ in range(num_experts))

    def forward(self, tokens):
        pooled = tokens.mean(dim=1)
        weights, chosen = torch.topk(F.softmax(self.gate(pooled), dim=-1), self.top_k, dim=-1)
        mixed = tokens.new_zeros(tokens.shape)
        for e in range(len(self.experts)):
            seq_ids, slot = torch.where(chosen == e)
            if seq_ids.numel() == 0:
                continue
            mixed[seq_ids] += self.experts[e](tokens[seq_ids]) * weights[seq_ids, slot].unsqueeze(-1).unsqueeze(-1)
        return mixed
'''


def _detect(code: str):  # type: ignore[no-untyped-def]
    return detect_all(MoeExperts(), code)


def _bf16(run: str, model: str, x: str) -> str:
    return run.replace(model, model + ".to(torch.bfloat16)").replace(x, x.replace("requires_grad=True", "dtype=torch.bfloat16, requires_grad=True"))


def test_sample_rows_slot_loop_view_swiglu_grouped_matmul() -> None:
    facts = _fused_and_runs(MoeExperts(), _SLOT_VIEW, _SLOT_VIEW_RUN, "ClipRouted.forward")
    assert facts["all_calls"].get("npu_grouped_matmul", 0) >= 2, facts["all_calls"]
    assert "unsqueeze(1).expand(-1, seq.shape[1], -1)" in facts["rewritten"]


def test_sample_rows_slot_loop_bf16() -> None:
    run = _bf16(_SLOT_VIEW_RUN, "m = ClipRouted(16, 24, 5, 2)", "x = torch.randn(8, 5, 16, requires_grad=True)") \
        .replace("s = torch.randn(8, 16)", "s = torch.randn(8, 16, dtype=torch.bfloat16)")
    _fused_and_runs(MoeExperts(), _SLOT_VIEW, run, "ClipRouted.forward", tol=0.999)


def test_sample_rows_where_pairs_dropout_experts() -> None:
    facts = _fused_and_runs(MoeExperts(), _WHERE_PAIRS, _WHERE_PAIRS_RUN, "SequenceRoutedMoE.forward")
    assert facts["all_calls"].get("npu_moe_token_unpermute") == 1


def test_sample_rows_where_pairs_bf16() -> None:
    run = _bf16(_WHERE_PAIRS_RUN, "m = SequenceRoutedMoE(16, 24, 4, 2)", "x = torch.randn(6, 5, 16, requires_grad=True)")
    _fused_and_runs(MoeExperts(), _WHERE_PAIRS, run, "SequenceRoutedMoE.forward", tol=0.999)


def test_sample_rows_flattened_and_shaped_back() -> None:
    facts = _fused_and_runs(MoeExperts(), _FLAT_BACK, _FLAT_BACK_RUN, "PerSequenceMoE.forward")
    assert "h.shape[1] == length and h.shape[2] == width" in facts["rewritten"]


def test_sample_rows_flattened_bf16() -> None:
    run = _bf16(_FLAT_BACK_RUN, "m = PerSequenceMoE(12, 20, 4, 2)", "x = torch.randn(7, 3, 12, requires_grad=True)")
    _fused_and_runs(MoeExperts(), _FLAT_BACK, run, "PerSequenceMoE.forward", tol=0.999)


def test_sample_rows_fused_path_only_for_3d_tokens() -> None:
    # the same layer given [B, H] tokens would not broadcast in the loop; the fused path's guard sends them there
    facts = _fused_and_runs(MoeExperts(), _WHERE_PAIRS, _WHERE_PAIRS_RUN, "SequenceRoutedMoE.forward")
    assert "(tokens.dim() == 3 and chosen.dim() == 2)" in facts["rewritten"]


def test_twin_expert_mixes_the_sequence() -> None:
    _near_miss(MoeExperts(), _MIXER, "npufuse does not show that they compute each token on its own")


def test_twin_transformer_layer_experts() -> None:
    code = _WHERE_PAIRS.replace(
        "nn.ModuleList(FeedForwardExpert(dim, hidden) for _ in range(num_experts))",
        "nn.ModuleList(nn.TransformerEncoderLayer(dim, 2, hidden, batch_first=True) for _ in range(num_experts))")
    _near_miss(MoeExperts(), code, "npufuse does not show that they compute each token on its own")


def test_twin_per_sample_capacity_cut() -> None:
    code = _WHERE_PAIRS.replace("            if seq_ids.numel() == 0:\n",
                                "            seq_ids, slot = seq_ids[:4], slot[:4]\n            if seq_ids.numel() == 0:\n")
    _near_miss(MoeExperts(), code, "a capacity", "capacity")


def test_twin_per_sample_weight_of_another_slot() -> None:
    # every selected sequence weighted by its first slot's weight, whichever slot chose this expert
    code = _FLAT_BACK.replace("y *= probs[seqs, slot][:, None].unsqueeze(-1)", "y *= probs[seqs, 0][:, None].unsqueeze(-1)")
    _near_miss(MoeExperts(), code, "is not recognised as the routing weight of the selected tokens")


# -- 2. one slot's weight as an [n, 1] view ---------------------------------------------------------------------------

_SLOT_VIEW_2D = _SLOT_VIEW.replace(".view(-1, 1, 1)", ".view(-1, 1)")

_SLOT_VIEW_2D_RUN = '''
torch.manual_seed(3)
m = ClipRouted(16, 24, 5, 2)
x = torch.randn(30, 16, requires_grad=True)
out = m(x, x)
leaves = [x, m.select.weight, m.experts[1].w_gate.weight, m.experts[3].w_out.weight]
'''


def test_slot_weight_view_column_token_loop() -> None:
    _fused_and_runs(MoeExperts(), _SLOT_VIEW_2D, _SLOT_VIEW_2D_RUN, "ClipRouted.forward")


# -- 3. the expert run on every token, its rows picked after ----------------------------------------------------------

_DENSE_MASKED = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyExpert(nn.Module):
    def __init__(self, d, r):
        super().__init__()
        self.a = nn.Linear(d, r, bias=False)
        self.b = nn.Linear(r, d, bias=False)

    def forward(self, h):
        return self.b(F.gelu(self.a(h)))


class AllTokenExperts(nn.Module):
    def __init__(self, d, r, n, k):
        super().__init__()
        self.n, self.k = n, k
        self.route = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([TinyExpert(d, r) for _ in range(n)])

    def forward(self, x):
        gate_w, gate_i = torch.topk(torch.softmax(self.route(x), dim=-1), self.k, dim=-1)
        y = torch.zeros_like(x)
        for s in range(self.k):
            ids = gate_i[..., s]
            col = gate_w[..., s].unsqueeze(-1)
            for e in range(self.n):
                hit = ids == e
                if hit.any():
                    y[hit] += self.experts[e](x)[hit] * col[hit]
        return y
'''

_DENSE_MASKED_RUN = '''
torch.manual_seed(4)
m = AllTokenExperts(16, 8, 4, 2)
x = torch.randn(3, 6, 16, requires_grad=True)
out = m(x)
leaves = [x, m.route.weight, m.experts[0].a.weight, m.experts[3].b.weight]
'''

# the expert convolves over the sequence: its output rows depend on the neighbouring tokens
_DENSE_CONV = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class ContextExpert(nn.Module):
    def __init__(self, d, r):
        super().__init__()
        self.a = nn.Linear(d, r)
        self.b = nn.Linear(r, d)
        self.mix = nn.Conv1d(d, d, 3, padding=1)

    def forward(self, h):
        h = h + self.mix(h.transpose(1, 2)).transpose(1, 2)
        return self.b(F.gelu(self.a(h)))


class AllTokenExperts(nn.Module):
    def __init__(self, d, r, n, k):
        super().__init__()
        self.n, self.k = n, k
        self.route = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([ContextExpert(d, r) for _ in range(n)])

    def forward(self, x):
        gate_w, gate_i = torch.topk(torch.softmax(self.route(x), dim=-1), self.k, dim=-1)
        y = torch.zeros_like(x)
        for s in range(self.k):
            ids = gate_i[..., s]
            col = gate_w[..., s].unsqueeze(-1)
            for e in range(self.n):
                hit = ids == e
                if hit.any():
                    y[hit] += self.experts[e](x)[hit] * col[hit]
        return y
'''


def test_dense_masked_expert_read_mlp() -> None:
    facts = _fused_and_runs(MoeExperts(), _DENSE_MASKED, _DENSE_MASKED_RUN, "AllTokenExperts.forward")
    assert facts["all_calls"].get("npu_grouped_matmul", 0) >= 2, facts["all_calls"]


def test_dense_masked_expert_bf16() -> None:
    run = _bf16(_DENSE_MASKED_RUN, "m = AllTokenExperts(16, 8, 4, 2)", "x = torch.randn(3, 6, 16, requires_grad=True)")
    _fused_and_runs(MoeExperts(), _DENSE_MASKED, run, "AllTokenExperts.forward", tol=0.999)


def test_dense_masked_token_wise_module_called_as_it_is() -> None:
    # biases and a dropout: the MLP is not read for a grouped matmul, the token-wise reader shows the rows are independent
    code = _DENSE_MASKED.replace("nn.Linear(d, r, bias=False)", "nn.Linear(d, r)").replace(
        "        self.b = nn.Linear(r, d, bias=False)\n",
        "        self.b = nn.Linear(r, d)\n        self.drop = nn.Dropout(0.0)\n").replace(
        "return self.b(F.gelu(self.a(h)))", "return self.drop(self.b(F.gelu(self.a(h))))")
    facts = _fused_and_runs(MoeExperts(), code, _DENSE_MASKED_RUN, "AllTokenExperts.forward")
    assert "npu_grouped_matmul" not in facts["all_calls"], facts["all_calls"]


def test_twin_dense_masked_expert_mixes_the_sequence() -> None:
    _near_miss(MoeExperts(), _DENSE_CONV, "the expert runs on all tokens and its output is masked after")


# -- 4. sorted dispatch, per-expert gathers of the sorted token ids ---------------------------------------------------

# a running offset over the host counts, an empty-run skip, index_add_
_SORTED_RUNNING = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Ffn(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.out = nn.Linear(h, d)

    def forward(self, v):
        return self.out(F.relu(self.inp(v)))


class SortedExperts(nn.Module):
    def __init__(self, d, h, num_experts, top_k):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.scorer = nn.Linear(d, num_experts, bias=False)
        self.experts = nn.ModuleList([Ffn(d, h) for _ in range(num_experts)])

    def forward(self, hidden):
        lead = hidden.shape[:-1]
        flat = hidden.reshape(-1, hidden.shape[-1])
        topw, topi = torch.topk(self.scorer(flat).softmax(-1), self.top_k, dim=-1)
        ids = topi.view(-1)
        token_of = torch.arange(flat.shape[0], device=flat.device).repeat_interleave(self.top_k)
        wts = topw.view(-1)
        _, perm = ids.sort(stable=True)
        src_tok = token_of[perm]
        src_w = wts[perm]
        sizes = torch.bincount(ids, minlength=self.num_experts).tolist()
        acc = torch.zeros_like(flat)
        pos = 0
        for j, size in enumerate(sizes):
            if size == 0:
                continue
            rows = src_tok[pos:pos + size]
            acc.index_add_(0, rows, self.experts[j](flat[rows]) * src_w[pos:pos + size].unsqueeze(-1))
            pos += size
        return acc.reshape(*lead, -1)
'''

_SORTED_RUNNING_RUN = '''
torch.manual_seed(5)
m = SortedExperts(16, 24, 5, 2)
x = torch.randn(4, 6, 16, requires_grad=True)
out = m(x)
leaves = [x, m.scorer.weight, m.experts[0].inp.weight, m.experts[4].out.bias]
'''

# host offsets (exclusive cumsum of the counts), `order // K` tokens, `out[sel] +=`
_SORTED_OFFSETS = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class GluFfn(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.wg = nn.Linear(d, h, bias=False)
        self.wu = nn.Linear(d, h, bias=False)
        self.wd = nn.Linear(h, d, bias=False)

    def forward(self, v):
        return self.wd(F.silu(self.wg(v)) * self.wu(v))


class OffsetDispatchMoE(nn.Module):
    def __init__(self, d, h, n_exp, top_k):
        super().__init__()
        self.n_exp, self.top_k = n_exp, top_k
        self.gate = nn.Linear(d, n_exp, bias=False)
        self.experts = nn.ModuleList(GluFfn(d, h) for _ in range(n_exp))

    def route(self, x):
        probs = self.gate(x).softmax(dim=-1)
        gate_w, expert_ids = probs.topk(self.top_k, dim=-1)
        return gate_w / gate_w.sum(dim=-1, keepdim=True), expert_ids

    def forward(self, x):
        gate_w, expert_ids = self.route(x)
        flat_e = expert_ids.flatten()
        order = torch.argsort(flat_e)
        pair_tok = order // self.top_k
        pair_w = gate_w.reshape(-1)[order]
        n_per = torch.bincount(flat_e, minlength=self.n_exp)
        starts = (n_per.cumsum(0) - n_per).tolist()
        n_list = n_per.tolist()
        out = torch.zeros_like(x)
        for e in range(self.n_exp):
            s = starts[e]
            t = s + n_list[e]
            sel = pair_tok[s:t]
            out[sel] += self.experts[e](x[sel]) * pair_w[s:t].unsqueeze(1)
        return out
'''

_SORTED_OFFSETS_RUN = '''
torch.manual_seed(6)
m = OffsetDispatchMoE(16, 20, 6, 2)
x = torch.randn(30, 16, requires_grad=True)
out = m(x)
leaves = [x, m.gate.weight, m.experts[0].wg.weight, m.experts[5].wd.weight]
'''


def test_sorted_running_offset_expert_modules() -> None:
    facts = _fused_and_runs(MoeExperts(), _SORTED_RUNNING, _SORTED_RUNNING_RUN, "SortedExperts.forward")
    assert "(topi.dim() == 2 and topi.shape[-1] == (self.top_k))" in facts["rewritten"]


def test_sorted_running_offset_bf16() -> None:
    run = _bf16(_SORTED_RUNNING_RUN, "m = SortedExperts(16, 24, 5, 2)", "x = torch.randn(4, 6, 16, requires_grad=True)")
    _fused_and_runs(MoeExperts(), _SORTED_RUNNING, run, "SortedExperts.forward", tol=0.999)


def test_sorted_running_offset_slice_object_out_of_place_add() -> None:
    # the run as a slice object, the skip advancing the offset too, out = out.index_add(...) on a fresh zeros
    code = _SORTED_RUNNING.replace(
        "            if size == 0:\n                continue\n            rows = src_tok[pos:pos + size]\n",
        "            if size == 0:\n                pos += size\n                continue\n            run = slice(pos, pos + size)\n"
        "            rows = src_tok[run]\n").replace(
        "            acc.index_add_(0, rows, self.experts[j](flat[rows]) * src_w[pos:pos + size].unsqueeze(-1))\n",
        "            acc = acc.index_add(0, rows, self.experts[j](flat[rows]) * src_w[run].unsqueeze(-1))\n")
    _fused_and_runs(MoeExperts(), code, _SORTED_RUNNING_RUN, "SortedExperts.forward")


def test_sorted_host_offsets_swiglu_grouped_matmul() -> None:
    facts = _fused_and_runs(MoeExperts(), _SORTED_OFFSETS, _SORTED_OFFSETS_RUN, "OffsetDispatchMoE.forward")
    assert facts["all_calls"].get("npu_grouped_matmul", 0) >= 2, facts["all_calls"]


def test_sorted_host_offsets_bf16() -> None:
    run = _bf16(_SORTED_OFFSETS_RUN, "m = OffsetDispatchMoE(16, 20, 6, 2)", "x = torch.randn(30, 16, requires_grad=True)")
    _fused_and_runs(MoeExperts(), _SORTED_OFFSETS, run, "OffsetDispatchMoE.forward", tol=0.999)


def test_twin_sorted_run_cut_to_a_capacity() -> None:
    code = _SORTED_OFFSETS.replace("            t = s + n_list[e]", "            t = s + min(n_list[e], 4)")
    _near_miss(MoeExperts(), code, "which npufuse does not read as the expert's whole run of the sort")


def test_twin_sorted_offset_read_after_the_loop() -> None:
    code = _SORTED_RUNNING.replace("        return acc.reshape(*lead, -1)",
                                   "        assert pos == flat.shape[0] * self.top_k\n        return acc.reshape(*lead, -1)")
    _near_miss(MoeExperts(), code, "`pos` (the runs' bookkeeping) is read after the loop")


def test_twin_sorted_descending_order() -> None:
    # runs in descending expert order while the offsets count from expert 0: other experts' pairs
    code = _SORTED_OFFSETS.replace("order = torch.argsort(flat_e)", "order = torch.argsort(flat_e, descending=True)")
    findings, misses = _detect(code)
    assert not findings and misses, [m.reason for m in misses]


def test_twin_sorted_skip_on_another_condition() -> None:
    code = _SORTED_RUNNING.replace("            if size == 0:\n", "            if j == 0:\n")
    findings, _ = _detect(code)
    assert not findings


def test_twin_sorted_indices_rebound_before_the_loop() -> None:
    # the indices the pairs were sorted from are rebound before the loop: the where loop would read other ones
    code = _SORTED_RUNNING.replace("        sizes = torch.bincount(ids, minlength=self.num_experts).tolist()\n",
                                   "        topi = topi.flip(-1)\n        sizes = torch.bincount(ids, minlength=self.num_experts).tolist()\n")
    findings, _ = _detect(code)
    assert not findings


# -- 5. a row-wise gate method between stacked projections ------------------------------------------------------------

_CLAMPED_METHOD = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Cfg:
    def __init__(self, hidden, inner, experts, limit):
        self.hidden, self.inner, self.experts, self.limit = hidden, inner, experts, limit


class StackedClampedExperts(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n = cfg.experts
        self.w_in = nn.Parameter(torch.randn(cfg.experts, 2 * cfg.inner, cfg.hidden) * 0.3)
        self.w_out = nn.Parameter(torch.randn(cfg.experts, cfg.hidden, cfg.inner) * 0.3)
        self.cap = cfg.limit

    def _gated(self, both):
        g, u = both.chunk(2, dim=-1)
        g = g.clamp(max=self.cap)
        u = u.clamp(min=-self.cap, max=self.cap)
        return F.silu(g) * u

    def forward(self, states, expert_ids, expert_w):
        result = torch.zeros_like(states)
        hits = F.one_hot(expert_ids, num_classes=self.n).permute(2, 1, 0)
        for e in range(self.n):
            slot, tok = torch.where(hits[e])
            if tok.numel() == 0:
                continue
            h = self._gated(F.linear(states[tok], self.w_in[e]))
            h = F.linear(h, self.w_out[e]) * expert_w[tok, slot, None]
            result.index_add_(0, tok, h.to(result.dtype))
        return result
'''

_CLAMPED_METHOD_RUN = '''
torch.manual_seed(7)
m = StackedClampedExperts(Cfg(16, 12, 5, 0.5))
x = torch.randn(24, 16, requires_grad=True)
w, ids = torch.topk(torch.randn(24, 5).softmax(-1), 2, dim=-1)
out = m(x, ids, w)
leaves = [x, m.w_in, m.w_out]
'''


def test_clamped_gate_method_stacked_grouped_matmul() -> None:
    facts = _fused_and_runs(MoeExperts(), _CLAMPED_METHOD, _CLAMPED_METHOD_RUN, "StackedClampedExperts.forward")
    assert "self._gated(" in facts["rewritten"] and facts["all_calls"].get("npu_grouped_matmul", 0) >= 2


def test_clamped_gate_method_bf16() -> None:
    run = _CLAMPED_METHOD_RUN.replace("m = StackedClampedExperts(Cfg(16, 12, 5, 0.5))",
                                      "m = StackedClampedExperts(Cfg(16, 12, 5, 0.5)).to(torch.bfloat16)") \
        .replace("x = torch.randn(24, 16, requires_grad=True)", "x = torch.randn(24, 16, dtype=torch.bfloat16, requires_grad=True)")
    _fused_and_runs(MoeExperts(), _CLAMPED_METHOD, run, "StackedClampedExperts.forward", tol=0.999)


def test_twin_gate_method_mixes_rows() -> None:
    # the gate centres over the rows: each row's output depends on the other rows the expert got
    code = _CLAMPED_METHOD.replace("        g = g.clamp(max=self.cap)", "        g = (g - g.mean(dim=0, keepdim=True)).clamp(max=self.cap)")
    _near_miss(MoeExperts(), code, "is not recognised: only silu-gated, act(gate) * up and plain act(x) experts")
