"""s48 (moe48): classes behind the sweep48moe development misses (bench/detect_labels_sweep48moe.json), with
invented reproducers (a second spelling each, and near-miss twins).

1. moe_experts: the host copy of the bincount counts held under a second name (``expert_counts = bincount(
   indices.flatten()); counts = expert_counts.tolist()``; ``if counts[i] == 0: continue``): read as the counts
   themselves (the empty-expert skip of a where / nonzero loop), where the first name is bound once and never
   changed in place.
"""

from __future__ import annotations

import torch
from pattern_harness import fused_and_runs as _fused_and_runs, near_miss_says as _near_miss

from npufuse.patterns.moe_experts import MoeExperts


# -- 1. moe_experts: the counts' host copy under a second name --------------------------------------------------------

# the sweep48moe spelling (a DeepSeek-V3-style gate returning weights and ids, a where loop over the experts)
_COPY_WHERE = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Ffn(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class RoutedLayer(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.n, self.k = n, k
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(Ffn(d, h) for _ in range(n))

    def forward(self, x):
        b, t, d = x.size()
        x = x.view(-1, d)
        scores = self.router(x).sigmoid()
        ids = scores.topk(self.k, dim=-1)[1]
        gates = scores.gather(1, ids)
        gates = gates / gates.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        per_expert = torch.bincount(ids.flatten(), minlength=self.n)
        host_counts = per_expert.tolist()
        for i, expert in enumerate(self.experts):
            if host_counts[i] == 0:
                continue
            rows, slot = torch.where(ids == i)
            y[rows] += expert(x[rows]) * gates[rows, slot, None]
        return y.view(b, t, d)
'''

_COPY_WHERE_RUN = '''
torch.manual_seed(0)
m = RoutedLayer(16, 24, 6, 2)
x = torch.randn(2, 5, 16, requires_grad=True)
out = m(x)
leaves = [x, m.router.weight, m.experts[0].up.weight, m.experts[5].down.bias]
'''

# a second spelling: `.cpu().numpy()` copy, `.bincount()` method on `view(-1)`, a range loop, nonzero rows, index_add_
_COPY_NUMPY = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Mlp(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fc1 = nn.Linear(d, h, bias=False)
        self.fc2 = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class NumpyCountsMoE(nn.Module):
    def __init__(self, d, h, n_exp, top):
        super().__init__()
        self.n_exp, self.top = n_exp, top
        self.w_gate = nn.Linear(d, n_exp)
        self.mlps = nn.ModuleList([Mlp(d, h) for _ in range(n_exp)])

    def forward(self, h):
        shape = h.shape
        tokens = h.reshape(-1, shape[-1])
        probs = F.softmax(self.w_gate(tokens), dim=-1)
        top_p, top_e = probs.topk(self.top, dim=-1)
        hist = top_e.view(-1).bincount(minlength=self.n_exp)
        load = hist.cpu().numpy()
        out = tokens.new_zeros(tokens.shape)
        for e in range(self.n_exp):
            if load[e] == 0:
                continue
            tok, k = (top_e == e).nonzero(as_tuple=True)
            out.index_add_(0, tok, self.mlps[e](tokens[tok]) * top_p[tok, k].unsqueeze(-1))
        return out.reshape(shape)
'''

_COPY_NUMPY_RUN = '''
torch.manual_seed(1)
m = NumpyCountsMoE(12, 20, 5, 2)
x = torch.randn(3, 4, 12, requires_grad=True)
out = m(x)
leaves = [x, m.w_gate.weight, m.mlps[0].fc1.weight, m.mlps[4].fc2.weight]
'''


def test_counts_copy_under_a_second_name_where_loop() -> None:
    facts = _fused_and_runs(MoeExperts(), _COPY_WHERE, _COPY_WHERE_RUN, "RoutedLayer.forward")
    assert facts["calls"] >= 1


def test_counts_copy_numpy_method_bincount_nonzero_index_add() -> None:
    _fused_and_runs(MoeExperts(), _COPY_NUMPY, _COPY_NUMPY_RUN, "NumpyCountsMoE.forward")


def test_counts_copy_bf16_runs() -> None:
    run = _COPY_WHERE_RUN.replace("m = RoutedLayer(16, 24, 6, 2)", "m = RoutedLayer(16, 24, 6, 2).to(torch.bfloat16)") \
        .replace("x = torch.randn(2, 5, 16, requires_grad=True)", "x = torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True)")
    _fused_and_runs(MoeExperts(), _COPY_WHERE, run, "RoutedLayer.forward", tol=0.999)


def test_twin_counts_changed_in_place_before_the_copy() -> None:
    # the first counts are edited before the host copy: the skip no longer tests this expert's rows
    code = _COPY_WHERE.replace("        host_counts = per_expert.tolist()\n",
                               "        per_expert[0] = 0\n        host_counts = per_expert.tolist()\n")
    _near_miss(MoeExperts(), code, "the loop skips experts on `host_counts[i] == 0`")


def test_twin_counts_copy_bound_twice() -> None:
    code = _COPY_WHERE.replace("        host_counts = per_expert.tolist()\n",
                               "        host_counts = per_expert.tolist()\n").replace(
        "        per_expert = torch.bincount(ids.flatten(), minlength=self.n)\n",
        "        per_expert = torch.bincount(ids.flatten(), minlength=self.n)\n"
        "        if self.training:\n            per_expert = torch.ones_like(per_expert)\n")
    _near_miss(MoeExperts(), code, "the loop skips experts on `host_counts[i] == 0`")


def test_twin_counts_copy_of_other_indices() -> None:
    # the copied counts count another routing's ids (a second top-k): not the experts this loop dispatches
    code = _COPY_WHERE.replace("        per_expert = torch.bincount(ids.flatten(), minlength=self.n)\n",
                               "        other = scores.topk(1, dim=-1)[1]\n"
                               "        per_expert = torch.bincount(other.flatten(), minlength=self.n)\n")
    _near_miss(MoeExperts(), code, "counts of `other`, not of the expert indices `ids`")
