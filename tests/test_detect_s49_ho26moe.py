"""s49 (ho26moe): moe_experts classes behind the judged HO26a / HO26b misses (bench/judge_s49_heldout26.md), with
invented reproducers in other spellings and near-miss twins.

a. ``rows, slots = mask.nonzero(as_tuple=False).T``: nonzero's default spelled out, read as ``torch.where(mask)``.
b. ``out[rows, :] += expert(x[rows]) * w[rows, slot]``: a trailing whole-dim slice on the indexed accumulate.
"""

from __future__ import annotations

from pattern_harness import detect_all, fused_and_runs as _fused_and_runs, near_miss_says as _near_miss

from npufuse.patterns.moe_experts import MoeExperts


def _bf16(run: str, model: str, x: str) -> str:
    return run.replace(model, model + ".to(torch.bfloat16)").replace(x, x.replace("requires_grad=True", "dtype=torch.bfloat16, requires_grad=True"))


_FFN = '''\
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
'''

# -- a. nonzero(as_tuple=False).T unpacked -----------------------------------------------------------------------------

_NZ_T = _FFN + '''

class RoutedFfn(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.k = k
        self.n = n
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([Ffn(d, h) for _ in range(n)])

    def forward(self, x):
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        scores, picks = torch.topk(self.router(flat), self.k, dim=-1)
        gates = scores.softmax(dim=-1)
        acc = torch.zeros_like(flat)
        for i in range(self.n):
            hit = picks == i
            if not hit.any():
                continue
            rows, slots = hit.nonzero(as_tuple=False).T
            y = self.experts[i](flat[rows])
            acc.index_add_(0, rows, y * gates[rows, slots].unsqueeze(-1))
        return acc.view(b, s, d)
'''

_NZ_T_RUN = '''
torch.manual_seed(0)
m = RoutedFfn(16, 24, 5, 2)
x = torch.randn(3, 7, 16, requires_grad=True)
out = m(x)
leaves = [x, m.router.weight, m.experts[0].up.weight, m.experts[4].down.bias]
'''


def test_nonzero_as_tuple_false_transposed_index_add() -> None:
    facts = _fused_and_runs(MoeExperts(), _NZ_T, _NZ_T_RUN, "RoutedFfn.forward")
    assert facts["all_calls"].get("npu_moe_token_unpermute") == 1


def test_nonzero_as_tuple_false_transposed_bf16() -> None:
    run = _bf16(_NZ_T_RUN, "m = RoutedFfn(16, 24, 5, 2)", "x = torch.randn(3, 7, 16, requires_grad=True)")
    _fused_and_runs(MoeExperts(), _NZ_T, run, "RoutedFfn.forward", tol=0.999)


def test_nonzero_as_tuple_false_torch_function_t() -> None:
    code = _NZ_T.replace("rows, slots = hit.nonzero(as_tuple=False).T", "rows, slots = torch.nonzero(hit, as_tuple=False).t()")
    _fused_and_runs(MoeExperts(), code, _NZ_T_RUN, "RoutedFfn.forward")


def test_twin_nonzero_columns_read_swapped() -> None:
    # the weights read [slot, token]: not the (token, slot) layout of the top-k weights
    _near_miss(MoeExperts(), _NZ_T.replace("gates[rows, slots]", "gates[slots, rows]"), "indexed [k, token]")


# -- b. out[rows, :] += ... ---------------------------------------------------------------------------------------------

_ROWS_ALL = _FFN + '''

class WhereMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.k = k
        self.n = n
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([Ffn(d, h) for _ in range(n)])

    def forward(self, x):
        b, s, d = x.shape
        flat = x.view(b * s, d)
        probs = self.router(flat).softmax(-1)
        top_p, top_i = probs.topk(self.k, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        acc = torch.zeros(b * s, d, device=x.device, dtype=x.dtype)
        for i in range(self.n):
            rows, slot = torch.where(top_i == i)
            net = self.experts[i]
            picked = flat[rows]
            coef = top_p[rows, slot].unsqueeze(-1)
            acc[rows, :] += net(picked) * coef
        return acc.reshape(b, s, d)
'''

_ROWS_ALL_RUN = '''
torch.manual_seed(0)
m = WhereMoE(16, 20, 4, 2)
x = torch.randn(2, 9, 16, requires_grad=True)
out = m(x)
leaves = [x, m.router.weight, m.experts[1].up.weight, m.experts[3].down.weight]
'''


def test_rows_and_whole_slice_accumulate() -> None:
    _fused_and_runs(MoeExperts(), _ROWS_ALL, _ROWS_ALL_RUN, "WhereMoE.forward")


def test_rows_and_whole_slice_accumulate_bf16() -> None:
    run = _bf16(_ROWS_ALL_RUN, "m = WhereMoE(16, 20, 4, 2)", "x = torch.randn(2, 9, 16, requires_grad=True)")
    _fused_and_runs(MoeExperts(), _ROWS_ALL, run, "WhereMoE.forward", tol=0.999)


def test_rows_and_ellipsis_accumulate() -> None:
    _fused_and_runs(MoeExperts(), _ROWS_ALL.replace("acc[rows, :] +=", "acc[rows, ...] +="), _ROWS_ALL_RUN, "WhereMoE.forward")


def test_twin_rows_and_partial_slice_accumulate() -> None:
    # half the hidden dim written: not the whole rows the fused layer adds
    code = _ROWS_ALL.replace("acc[rows, :] += net(picked) * coef", "acc[rows, : d // 2] += (net(picked) * coef)[:, : d // 2]")
    _near_miss(MoeExperts(), code, "unrecognised update in the expert loop")
