"""s49 (ho26moe): moe_experts classes behind the judged HO26a / HO26b misses (bench/judge_s49_heldout26.md), with
invented reproducers in other spellings and near-miss twins.

a. ``rows, slots = mask.nonzero(as_tuple=False).T``: nonzero's default spelled out, read as ``torch.where(mask)``.
b. ``out[rows, :] += expert(x[rows]) * w[rows, slot]``: a trailing whole-dim slice on the indexed accumulate.
"""

from __future__ import annotations

import pytest
import torch
from pattern_harness import check_rewrite_runs, detect_all, fused_and_runs as _fused_and_runs, near_miss_says as _near_miss

from npufuse import emulate
from npufuse.patterns.moe_experts import MoeExperts
from npufuse.rewrite.codegen import splice


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


# -- d. slot-outer loop with a load statistic divided by a loop-invariant number ------------------------------------------

_LOAD = _FFN + '''

class BiasedMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.k = k
        self.n = n
        self.score = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([Ffn(d, h) for _ in range(n)])

    def forward(self, x):
        b, t, d = x.shape
        p = torch.sigmoid(self.score(x))
        w, idx = torch.topk(p, self.k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        y = torch.zeros_like(x)
        usage = torch.zeros(self.n, device=x.device)
        for slot in range(self.k):
            chosen = idx[:, :, slot]
            col = w[..., slot:slot + 1]
            for e in range(self.n):
                sel = chosen == e
                if sel.any():
                    usage[e] += sel.sum().float() / (b * t * self.k)
                    y[sel] += col[sel] * self.experts[e](x[sel])
        return y, usage
'''

_LOAD_RUN = '''
torch.manual_seed(0)
m = BiasedMoE(16, 24, 6, 2)
x = torch.randn(3, 5, 16, requires_grad=True)
out = m(x)
leaves = [x, m.score.weight, m.experts[0].up.weight, m.experts[5].down.bias]
'''


def test_slot_outer_load_statistic_divided() -> None:
    facts = _fused_and_runs(MoeExperts(), _LOAD, _LOAD_RUN, "BiasedMoE.forward")
    assert "/ (b * t * self.k)" in facts["rewritten"]


def test_slot_outer_load_statistic_divided_bf16() -> None:
    run = _bf16(_LOAD_RUN, "m = BiasedMoE(16, 24, 6, 2)", "x = torch.randn(3, 5, 16, requires_grad=True)")
    _fused_and_runs(MoeExperts(), _LOAD, run, "BiasedMoE.forward", tol=0.999)


def test_slot_column_slice_without_statistic() -> None:
    code = _LOAD.replace("                    usage[e] += sel.sum().float() / (b * t * self.k)\n", "")
    _fused_and_runs(MoeExperts(), code, _LOAD_RUN, "BiasedMoE.forward")


def test_twin_load_statistic_divided_by_a_loop_value() -> None:
    # divided by this slot's selection size: a different number per iteration, not one division of the counts
    code = _LOAD.replace("/ (b * t * self.k)", "/ sel.numel()")
    _near_miss(MoeExperts(), code, "unrecognised update in the expert loop: `usage[e] += sel.sum().float() / sel.numel()`")


def test_twin_load_statistic_assigned_per_slot() -> None:
    # `=` in a slot loop keeps the last slot's count only: not every expert's count
    code = _LOAD.replace("usage[e] += sel.sum().float() / (b * t * self.k)", "usage[e] = sel.sum().float()")
    _near_miss(MoeExperts(), code, "unrecognised update in the expert loop: `usage[e] = sel.sum().float()`",
               "the loop also writes one value per expert")


# -- e. routing weight gathered slot by slot into a fresh buffer, rows indexed inside the gather --------------------------

_GATHER = _FFN + '''

class GatherMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.top_k = k
        self.n_exp = n
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([Ffn(d, h) for _ in range(n)])

    def forward(self, hs):
        shape = hs.shape
        flat = hs.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(flat), dim=-1)
        topw, topi = torch.topk(probs, self.top_k, dim=-1)
        res = torch.zeros_like(flat)
        for eid in range(self.n_exp):
            hit = (topi == eid).any(dim=-1)
            if not hit.any():
                continue
            ids = hit.nonzero(as_tuple=True)[0]
            coef = torch.zeros(ids.shape[0], device=hs.device, dtype=hs.dtype)
            for k in range(self.top_k):
                here = topi[ids, k] == eid
                coef[here] = topw[ids[here], k]
            res[ids] += coef.unsqueeze(-1) * self.experts[eid](flat[ids])
        return res.reshape(shape)
'''

_GATHER_RUN = '''
torch.manual_seed(0)
m = GatherMoE(16, 24, 5, 2)
x = torch.randn(4, 6, 16, requires_grad=True)
out = m(x)
leaves = [x, m.gate.weight, m.experts[0].up.weight, m.experts[4].down.bias]
'''


def test_slot_gathered_weight_buffer() -> None:
    facts = _fused_and_runs(MoeExperts(), _GATHER, _GATHER_RUN, "GatherMoE.forward")
    assert "hs.dtype in (topw.dtype, torch.float32)" in facts["rewritten"]


def test_slot_gathered_weight_buffer_bf16() -> None:
    run = _bf16(_GATHER_RUN, "m = GatherMoE(16, 24, 5, 2)", "x = torch.randn(4, 6, 16, requires_grad=True)")
    _fused_and_runs(MoeExperts(), _GATHER, run, "GatherMoE.forward", tol=0.999)


def test_slot_gathered_weight_buffer_other_dtype_runs_the_original() -> None:
    # float32 routing weights stored into a bf16 buffer: the original raises (index_put dtypes differ); the guard sends
    # the call to the original (which raises the same way) instead of a fused path that would run
    code = _GATHER.replace("probs = F.softmax(self.gate(flat), dim=-1)", "probs = F.softmax(self.gate(flat).float(), dim=-1)")
    findings, _ = detect_all(MoeExperts(), code)
    assert [f.qualname for f in findings] == ["GatherMoE.forward"]
    rewritten = splice(code, findings)
    assert "hs.dtype in (topw.dtype, torch.float32)" in rewritten
    ns: dict = {}
    with emulate.install() as emu:
        exec(compile(rewritten, "<rewritten>", "exec"), ns)
        torch.manual_seed(0)
        m = ns["GatherMoE"](16, 24, 5, 2).to(torch.bfloat16)
        with pytest.raises(RuntimeError, match="Index put requires the source and destination dtypes match"):
            m(torch.randn(4, 6, 16, dtype=torch.bfloat16))
    assert not emu.calls.get("npu_moe_token_unpermute")


def test_slot_gathered_weight_accumulated() -> None:
    code = _GATHER.replace("coef[here] = topw[ids[here], k]", "coef[here] += topw[ids[here], k]")
    _fused_and_runs(MoeExperts(), code, _GATHER_RUN, "GatherMoE.forward")


def test_twin_slot_gathered_weight_of_a_fixed_slot() -> None:
    # every hit takes slot 0's weight: not the weight of the slot that routed it
    code = _GATHER.replace("coef[here] = topw[ids[here], k]", "coef[here] = topw[ids[here], 0]")
    _near_miss(MoeExperts(), code, "written slot by slot into the fresh buffer `coef`")


_ROUTER = '''

class TopRouter(nn.Module):
    def __init__(self, d, n, k):
        super().__init__()
        self.k = k
        self.proj = nn.Linear(d, n, bias=False)

    def forward(self, h):
        logits = self.proj(h)
        p = F.softmax(logits, dim=-1)
        vals, inds = torch.topk(p, self.k, dim=-1)
        vals = vals / vals.sum(dim=-1, keepdim=True)
        return vals, inds, logits
'''

_GATHER_ROUTED = _GATHER.replace("        self.gate = nn.Linear(d, n, bias=False)\n", "        self.gate = TopRouter(d, n, k)\n") \
    .replace("        probs = F.softmax(self.gate(flat), dim=-1)\n        topw, topi = torch.topk(probs, self.top_k, dim=-1)\n",
             "        topw, topi, _ = self.gate(flat)\n") + _ROUTER


def test_slot_gathered_weight_indices_from_a_router_module() -> None:
    assert "topw, topi, _ = self.gate(flat)" in _GATHER_ROUTED
    run = _GATHER_RUN.replace("m.gate.weight", "m.gate.proj.weight")
    _fused_and_runs(MoeExperts(), _GATHER_ROUTED, run, "GatherMoE.forward")


def test_twin_slot_gathered_weight_sampled_router_indices() -> None:
    # a router that samples its experts with replacement: a row may list one expert twice, and `=` keeps one weight
    code = _GATHER_ROUTED.replace("vals, inds = torch.topk(p, self.k, dim=-1)",
                                  "inds = torch.multinomial(p, self.k, replacement=True)\n        vals = p.gather(-1, inds)")
    _near_miss(MoeExperts(), code, "a row listing the expert in two slots keeps the last slot's weight")


# -- f. capacity branch off by default: `if cap and <per expert count> > cap: <capped> else: <plain>` --------------------

_CAP = _FFN + '''

class CappedMoE(nn.Module):
    def __init__(self, d, h, n, k, cf=-1.0):
        super().__init__()
        self.k = k
        self.n = n
        self.cf = cf
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([Ffn(d, h) for _ in range(n)])
        self.dropped = 0

    def forward(self, x):
        b, s, d = x.shape
        flat = x.view(-1, d)
        probs = self.router(flat).softmax(dim=-1)
        top_w, top_i = probs.topk(self.k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        limit = int(b * s * self.k / self.n * self.cf) if self.cf > 0 else None
        self.dropped = 0
        acc = torch.zeros(b * s, d, dtype=x.dtype, device=x.device)
        for i in range(self.n):
            rows, slots = torch.where(top_i == i)
            if limit and rows.numel() > limit:
                _, keep = torch.topk(probs[rows, i], k=limit, sorted=False)
                rows, slots = rows[keep], slots[keep]
                acc[rows] += self.experts[i](flat[rows]) * top_w[rows, slots].unsqueeze(-1)
                self.dropped += int(top_i.eq(i).sum()) - limit
            else:
                acc[rows] += self.experts[i](flat[rows]) * top_w[rows, slots].unsqueeze(-1)
        return acc.view(b, s, d)
'''

_CAP_RUN = '''
torch.manual_seed(0)
m = CappedMoE(16, 24, 4, 2)
x = torch.randn(3, 8, 16, requires_grad=True)
out = m(x)
leaves = [x, m.router.weight, m.experts[0].up.weight, m.experts[3].down.bias]
'''


def test_capacity_off_by_default_fused_under_guard() -> None:
    facts = _fused_and_runs(MoeExperts(), _CAP, _CAP_RUN, "CappedMoE.forward")
    assert "not (limit)" in facts["rewritten"]


def test_capacity_off_by_default_bf16() -> None:
    run = _bf16(_CAP_RUN, "m = CappedMoE(16, 24, 4, 2)", "x = torch.randn(3, 8, 16, requires_grad=True)")
    _fused_and_runs(MoeExperts(), _CAP, run, "CappedMoE.forward", tol=0.999)


def test_capacity_on_runs_the_original() -> None:
    # with a capacity factor the guard fails and the original (dropping) loop runs: the same outputs, no fused call
    findings, _ = detect_all(MoeExperts(), _CAP)
    run = _CAP_RUN.replace("m = CappedMoE(16, 24, 4, 2)", "m = CappedMoE(16, 24, 4, 2, cf=0.5)")
    facts = check_rewrite_runs(MoeExperts(), _CAP, run, findings)
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.99999 and min(facts["cos_grad"]) > 0.99999, facts


def test_twin_capacity_test_per_expert_first() -> None:
    # the per-expert count is tested first: no option that alone decides the branch for every expert
    code = _CAP.replace("if limit and rows.numel() > limit:", "if rows.numel() > (limit or rows.numel()):")
    _near_miss(MoeExperts(), code, "conditional code inside the expert loop: `if rows.numel() > (limit or rows.numel())`")


def test_twin_plain_path_needs_the_per_expert_test() -> None:
    # the plain path is the body, taken only where `rows.numel() <= capacity` holds for this expert: no option alone
    # decides it, so there is no run-time guard to fuse under
    plain = "                acc[rows] += self.experts[i](flat[rows]) * top_w[rows, slots].unsqueeze(-1)\n"
    capped = ("                _, keep = torch.topk(probs[rows, i], k=capacity, sorted=False)\n"
              "                rows, slots = rows[keep], slots[keep]\n" + plain)
    head = "            if capacity and rows.numel() <= capacity:\n"
    start = _CAP.index("            if limit and")
    end = _CAP.index("        return acc.view(b, s, d)")
    code = _CAP[:start].replace("limit", "capacity") + head + plain + "            else:\n" + capped + _CAP[end:]
    _near_miss(MoeExperts(), code, "conditional code inside the expert loop: `if capacity and rows.numel() <= capacity`")


# -- g. multi-task MMoE: a task loop around a comprehension over the experts (a true reason, not fused) -----------------

_MMOE = _FFN + '''

class RowRouter:
    def __init__(self, n, gates):
        self.n = n
        self.gates = gates
        nz = torch.nonzero(gates)
        order = nz[:, 1].argsort(stable=True)
        self.rows = nz[order, 0]
        self.cols = nz[order, 1]
        self.sizes = (gates > 0).sum(0).tolist()

    def scatter(self, x):
        return torch.split(x[self.rows], self.sizes, dim=0)

    def gather(self, outs):
        cat = torch.cat(outs, 0) * self.gates[self.rows, self.cols].unsqueeze(1)
        return torch.zeros(self.gates.shape[0], cat.shape[1], dtype=cat.dtype).index_add(0, self.rows, cat)


class MultiTaskMoE(nn.Module):
    def __init__(self, d, h, n_experts, n_tasks, k):
        super().__init__()
        self.k = k
        self.n_experts = n_experts
        self.n_tasks = n_tasks
        self.task_gates = nn.ModuleList([nn.Linear(d, n_experts) for _ in range(n_tasks)])
        self.experts = nn.ModuleList([Ffn(d, h) for _ in range(n_experts)])

    def forward(self, x):
        heads = []
        for t in range(self.n_tasks):
            logits = self.task_gates[t](x)
            v, i = logits.topk(self.k, dim=-1)
            g = torch.zeros_like(logits).scatter(1, i, v.softmax(-1))
            router = RowRouter(self.n_experts, g)
            parts = router.scatter(x)
            outs = [self.experts[t](parts[t]) for t in range(self.n_experts)]
            heads.append(router.gather(outs))
        return heads
'''


def test_twin_task_loop_around_expert_comprehension() -> None:
    _near_miss(MoeExperts(), _MMOE, "the loop over `range(self.n_tasks)` is not the expert loop: `t` picks an expert only "
               "inside the comprehension `[self.experts[t](parts[t]) for t in range(self.n_experts)]`")
    _near_miss(MoeExperts(), _MMOE, "helper object's `router.scatter(...)` / `router.gather(...)`")


# -- c. sorted dispatch: the experts fill a sorted buffer run by run, weighted in place and index-added after ------------

_SORTED_BUF = _FFN + '''

class SortedMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.k = k
        self.n = n
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList([Ffn(d, h) for _ in range(n)])

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        t = flat.shape[0]
        out = torch.zeros_like(flat)
        logits = self.router(flat)
        vals, ids = torch.topk(logits, k=self.k, dim=-1)
        probs = F.softmax(vals, dim=-1)
        ids_flat = ids.reshape(-1)
        probs_flat = probs.reshape(-1)
        ids_sorted, perm = torch.sort(ids_flat)
        counts = torch.bincount(ids_sorted, minlength=self.n)
        tok_rep = torch.repeat_interleave(torch.arange(t, device=x.device), repeats=self.k)
        tok_sorted = tok_rep[perm]
        rows = flat[tok_sorted]
        p_sorted = probs_flat[perm]
        buf = torch.zeros_like(rows)
        pos = 0
        for e, c_t in enumerate(counts):
            c = c_t.item()
            if c == 0:
                continue
            buf[pos:pos + c] = self.experts[e](rows[pos:pos + c])
            pos += c
        buf *= p_sorted[:, None]
        out.index_add_(dim=0, index=tok_sorted, source=buf)
        return out.reshape(shape)
'''

_SORTED_BUF_RUN = '''
torch.manual_seed(0)
m = SortedMoE(16, 24, 5, 2)
x = torch.randn(3, 7, 16, requires_grad=True)
out = m(x)
leaves = [x, m.router.weight, m.experts[0].up.weight, m.experts[4].down.bias]
'''


def test_sorted_buffer_weighted_in_place_functional_repeat() -> None:
    facts = _fused_and_runs(MoeExperts(), _SORTED_BUF, _SORTED_BUF_RUN, "SortedMoE.forward")
    assert facts["all_calls"].get("npu_moe_token_permute") == 1 and facts["all_calls"].get("npu_moe_token_unpermute") == 1


def test_sorted_buffer_weighted_in_place_bf16() -> None:
    run = _bf16(_SORTED_BUF_RUN, "m = SortedMoE(16, 24, 5, 2)", "x = torch.randn(3, 7, 16, requires_grad=True)")
    _fused_and_runs(MoeExperts(), _SORTED_BUF, run, "SortedMoE.forward", tol=0.999)


def test_sorted_buffer_repeat_interleave_positional() -> None:
    code = _SORTED_BUF.replace("repeats=self.k)", "self.k)")
    _fused_and_runs(MoeExperts(), code, _SORTED_BUF_RUN, "SortedMoE.forward")


def test_twin_sorted_buffer_weighted_in_another_order() -> None:
    # the weights taken in the reversed sort order: not each sorted pair's own weight
    code = _SORTED_BUF.replace("buf *= p_sorted[:, None]", "buf *= probs_flat[perm.flip(0)][:, None]")
    _near_miss(MoeExperts(), code, "is not the flat routing weights taken in the sort order `perm`")


def test_twin_sorted_buffer_repeat_interleave_other_dim() -> None:
    # repeat_interleave along dim 1 of a [T, 1] column is not the flat token of each slot: the reader stays off
    code = _SORTED_BUF.replace("torch.repeat_interleave(torch.arange(t, device=x.device), repeats=self.k)",
                               "torch.repeat_interleave(torch.arange(t, device=x.device)[:, None], repeats=self.k, dim=1).reshape(-1)")
    findings, _ = detect_all(MoeExperts(), code)
    assert not findings


def test_twin_load_statistic_divided_by_a_slot_loop_value() -> None:
    # the divisor is bound in the slot loop around the expert loop: a different number per slot
    code = _LOAD.replace("            col = w[..., slot:slot + 1]\n", "            col = w[..., slot:slot + 1]\n            share = (slot + 1) * b * t\n") \
        .replace("/ (b * t * self.k)", "/ share")
    _near_miss(MoeExperts(), code, "unrecognised update in the expert loop: `usage[e] += sel.sum().float() / share`")


def test_twin_slot_gathered_weight_buffer_dtype_of_a_loop_tensor() -> None:
    # the buffer takes the dtype of the expert's own rows (bound in the loop): no guard can read it before the loop
    code = _GATHER.replace("            coef = torch.zeros(ids.shape[0], device=hs.device, dtype=hs.dtype)\n",
                           "            part = flat[ids]\n            coef = torch.zeros(ids.shape[0], device=hs.device, dtype=part.dtype)\n")
    _near_miss(MoeExperts(), code, "a fresh `zeros` buffer in float32 or the weights' dtype")
