"""s45 moe45a: expert ids outside [0, E) on the moe_experts paths defects44 did not audit.

defects44 proved / masked the ids of the mask-routing and flat-routing loops. The other paths, each run here
original vs rewritten under the emulator with -1 drop markers and ids past the experts:

* sorted dispatch (sort_permute, sorted_pairs, sorted_dispatch): the code sorts the flat ids itself and runs the
  experts between on its own sorted ids; a -1 sorts first there, where ``npu_moe_token_permute`` raised (values in
  [0, 16777215), spec 8.6). Fixed: ids not proven top-k indices are shifted by their minimum when negative (a
  monotone shift keeps the sort order exactly; no host sync).
* runs of sorted ids (``for s, e in zip(starts, ends)``: ``self.experts[host[s]]``): a -1 run calls the LAST
  expert (Python indexing), where the permute raised. Fixed: negative ids wrap as Python indexing does.
* token-slot loops (``self.experts[ids[t, k]]``) and gathered weights (``W[idx]``) already check their ids at
  run time (``(ids >= 0).all()`` / ``[0, E)``) and run as written otherwise: pinned here (pass before and after).
* ids >= E: every sorted path runs the experts between as written on the same sorted rows (ids past the
  experts keep the rows the code leaves them), the runs / token-slot loops raise IndexError in the original.
"""

from __future__ import annotations

import pytest

from pattern_harness import check_rewrite_runs, detect_all
from test_detect_s44_defects import _close  # (outputs and gradients close, the fused branch ran)
from npufuse.patterns._moe_s42b import _HEAD
from npufuse.patterns.moe_experts import MoeExperts


def _fused(code: str) -> list:
    findings, misses = detect_all(MoeExperts(), code)
    assert findings, [m.reason for m in misses]
    return findings


def _matches(code: str, run: str) -> dict:
    findings = _fused(code)
    facts = check_rewrite_runs(MoeExperts(), code, run, findings)
    _close(facts)
    return facts


# -- sort_permute: the experts module takes the sorted ids (a mask per expert: -1 rows stay zero) ----------------

_SORTED_EXPERTS = _HEAD + '''

class Experts(nn.Module):
    def __init__(self, n, d, h):
        super().__init__()
        self.n = n
        self.ffs = nn.ModuleList([FF(d, h) for _ in range(n)])

    def forward(self, rows, sorted_ids):
        out = torch.zeros_like(rows)
        for e in range(self.n):
            m = sorted_ids == e
            out[m] = self.ffs[e](rows[m])
        return out


class MoE(nn.Module):
    def __init__(self, n, d, h, k):
        super().__init__()
        self.k = k
        self.experts = Experts(n, d, h)

    def forward(self, x, router_weights, selected_experts):
        sorted_ids, sorted_pos = selected_experts.flatten().sort()
        T = x.size(0)
        token = sorted_pos // self.k
        gates = router_weights.flatten()[sorted_pos]
        h = x[token]
        h = self.experts(h, sorted_ids)
        h = h * gates.unsqueeze(-1)
        zeros = torch.zeros((T, x.size(1)), dtype=h.dtype, device=h.device)
        out = zeros.index_add(0, token, h)
        return out
'''
_DROPS_RUN = '''\
moe = MoE(5, 16, 24, 2)
x = torch.randn(9, 16, requires_grad=True)
w, idx = torch.randn(9, 5).softmax(-1).topk(2, dim=-1)
idx = idx.clone()
idx[::3, 1] = -1
w = w.detach().requires_grad_()
out = moe(x, w, idx)
leaves = [x, w, moe.experts.ffs[1].w1.weight]
'''
_PAST_E_RUN = _DROPS_RUN.replace("idx[::3, 1] = -1", "idx[::3, 1] = 5")
_PLAIN_RUN = _DROPS_RUN.replace("idx[::3, 1] = -1\n", "")
_MINUS_TWO_RUN = _DROPS_RUN.replace("idx[::3, 1] = -1", "idx[::3, 1] = -1\nidx[1, 0] = -2")


@pytest.mark.parametrize("run", [_DROPS_RUN, _MINUS_TWO_RUN, _PAST_E_RUN, _PLAIN_RUN],
                         ids=["minus_one", "minus_one_and_two", "past_E", "plain"])
def test_sort_permute_ids_outside_the_experts(run: str) -> None:
    facts = _matches(_SORTED_EXPERTS, run)
    assert "npu_moe_token_permute" in facts["rewritten"]


def test_sort_permute_ids_outside_the_experts_get_the_shifted_key() -> None:
    assert "_npufuse_key = _npufuse_ids - _npufuse_ids.min().clamp(max=0)" in _fused(_SORTED_EXPERTS)[-1].fused


# -- sorted_pairs: ids handed in, the experts fill a zero buffer through masks of the sorted ids -----------------------

_PAIRS = _HEAD + '''

class PairsMoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)) for _ in range(n)])
        self.n, self.k = n, k

    def forward(self, x, probs, ids):
        order = ids.view(-1).argsort()
        tok = order // self.k
        rows = x[tok]
        sids = ids.view(-1)[order]
        buf = torch.zeros_like(rows)
        for e in range(self.n):
            m = sids == e
            if m.any():
                buf[m] = self.experts[e](rows[m]) + 0 * rows[m].sum()
        buf = buf * probs.flatten()[order][:, None]
        out = torch.zeros_like(x)
        out = out.index_add(0, tok, buf)
        return out
'''
_PAIRS_STABLE_SORT = _PAIRS.replace("order = ids.view(-1).argsort()", "order = torch.sort(ids.reshape(-1), stable=True)[1]")
_PAIRS_RUN = _DROPS_RUN.replace("moe = MoE(5, 16, 24, 2)", "moe = PairsMoE(16, 24, 5, 2)").replace(
    "moe.experts.ffs[1].w1.weight", "moe.experts[1][0].weight")


@pytest.mark.parametrize("code", [_PAIRS, _PAIRS_STABLE_SORT], ids=["argsort", "stable_sort"])
@pytest.mark.parametrize("run", [_PAIRS_RUN, _PAIRS_RUN.replace("idx[::3, 1] = -1", "idx[::3, 1] = 5"),
                                 _PAIRS_RUN.replace("idx[::3, 1] = -1\n", "")], ids=["minus_one", "past_E", "plain"])
def test_sorted_pairs_ids_outside_the_experts(code: str, run: str) -> None:
    facts = _matches(code, run)
    assert "_npufuse_key = _npufuse_ids - _npufuse_ids.min().clamp(max=0)" in facts["rewritten"]


# -- the original raises on a negative id before the experts run, or the ids are top-k's: the text is as before -----

def test_ids_counted_by_bincount_or_scattered_keep_the_permute_text() -> None:
    from npufuse.patterns.moe_experts import _DEEPSEEK_V3_RUN, _SORT_PERMUTE, _SORT_PERMUTE_RUN, _SORTED_DISPATCH_OPAQUE
    from npufuse.patterns.moe_experts import _SORTED_PAIRS, _SORTED_PAIRS_RUN

    # bincount of the sorted ids (sort_permute), scatter_ of the ids into counts (DeepSeek's moe_infer), top-k ids
    for code, run in ((_SORT_PERMUTE, _SORT_PERMUTE_RUN), (_SORTED_DISPATCH_OPAQUE, _DEEPSEEK_V3_RUN),
                      (_SORTED_PAIRS, _SORTED_PAIRS_RUN)):
        findings = _fused(code)
        assert not any("_npufuse_key" in f.fused for f in findings)
        _close(check_rewrite_runs(MoeExperts(), code, run, findings))


def test_a_bincount_under_a_condition_is_no_proof() -> None:
    from npufuse.patterns.moe_experts import _SORT_PERMUTE

    code = _SORT_PERMUTE.replace(
        "            expert_frequency = torch.bincount(sorted_expert_idxs, minlength=self.num_experts)\n",
        "            expert_frequency = torch.histc(sorted_expert_idxs.float(), bins=self.num_experts, min=0,"
        " max=self.num_experts - 1).long()\n            if x.requires_grad:\n"
        "                torch.bincount(sorted_expert_idxs)\n")
    assert "_npufuse_key" in _fused(code)[0].fused


# -- runs of sorted ids: experts[-1] is the last expert in the original --------------------------------------------

def _runs_module(ids_handed_in: bool) -> str:
    from npufuse.patterns.moe_experts import _SORTED_RUNS_MODULE

    if not ids_handed_in:
        return _SORTED_RUNS_MODULE
    return _SORTED_RUNS_MODULE.replace("    def forward(self, x):\n        w, ids = self.router(x).softmax(-1).topk(self.k, dim=-1)\n",
                                       "    def forward(self, x, w, ids):\n")


_RUNS_MODULE_RUN = '''\
m = RunMoE(16, 24, 5, 2)
x = torch.randn(9, 16)
w, ids = torch.randn(9, 5).softmax(-1).topk(2, dim=-1)
ids = ids.clone()
ids[::3, 1] = -1
ids[1, 0] = -5
out = m(x, w, ids)
leaves = [m.ffns[4].a.weight, m.ffns[2].a.weight]
'''


@pytest.mark.parametrize("run", [_RUNS_MODULE_RUN, _RUNS_MODULE_RUN.replace("ids[1, 0] = -5\n", ""),
                                 _RUNS_MODULE_RUN.replace("ids[::3, 1] = -1\nids[1, 0] = -5\n", "")],
                         ids=["minus_one_and_minus_E", "minus_one", "plain"])
def test_runs_of_sorted_ids_run_the_last_expert_for_minus_one(run: str) -> None:
    facts = _matches(_runs_module(True), run)
    assert "experts[-1] is the last expert" in facts["rewritten"]


def test_runs_of_sorted_function_ids_handed_in() -> None:
    from npufuse.patterns.moe_experts import _LEAD_ROWS_RUN, _SORTED_RUNS

    run = _LEAD_ROWS_RUN.replace("out = routed(", "ids = ids.clone()\nids[::2, 0] = -1\nout = routed(")
    facts = _matches(_SORTED_RUNS, run)
    assert "experts[-1] is the last expert" in facts["rewritten"]


def test_runs_of_top_k_ids_keep_the_text() -> None:
    from npufuse.patterns.moe_experts import _SORTED_RUNS_MODULE_RUN

    facts = _matches(_runs_module(False), _SORTED_RUNS_MODULE_RUN)
    assert "experts[-1] is the last expert" not in facts["rewritten"]


def test_runs_past_the_experts_raise_in_the_original() -> None:
    findings = _fused(_runs_module(True))
    from pattern_harness import _exec, _run  # the original's own IndexError, not the fused text's

    with pytest.raises(IndexError):
        _run(_exec(_runs_module(True), "original"), _RUNS_MODULE_RUN.replace("ids[1, 0] = -5", "ids[1, 0] = 5"))
    assert findings


# -- token-slot loops and gathered weights check their ids at run time already (pinned: pass before and after) --------

def test_token_slot_loop_with_minus_one_ids_runs_as_written() -> None:
    code = _HEAD + '''

class MoE(nn.Module):
    def __init__(self, d, h, n):
        super().__init__()
        self.experts = nn.ModuleList([FF(d, h) for _ in range(n)])

    def forward(self, x, w, ids):
        out = torch.zeros_like(x)
        for t in range(ids.size(0)):
            for k in range(ids.size(1)):
                expert = self.experts[ids[t, k]]
                out[t] += expert(x[t]) * w[t, k]
        return out
'''
    run = _DROPS_RUN.replace("MoE(5, 16, 24, 2)", "MoE(16, 24, 5)").replace("moe.experts.ffs[1]", "moe.experts[4]")
    facts = check_rewrite_runs(MoeExperts(), code, run, _fused(code))
    assert "bool((ids >= 0).all())" in facts["rewritten"]  # -1 (experts[-1] in the loop) takes the loop as written
    assert all(c > 0.9999 for c in facts["cos_out"] + facts["cos_grad"]), facts


def test_gathered_weights_with_minus_one_ids_run_as_written() -> None:
    from npufuse.patterns.moe_experts import _S34_GATHER_BMM, _S34_GATHER_BMM_RUN

    run = _S34_GATHER_BMM_RUN.replace("out = m(x, ids)", "ids[::3] = -1\nout = m(x, ids)")
    facts = check_rewrite_runs(MoeExperts(), _S34_GATHER_BMM, run, _fused(_S34_GATHER_BMM))
    assert "(expert_ids >= 0) & (expert_ids < self.w_in.shape[0])" in facts["rewritten"]  # else: as written
    assert all(c > 0.9999 for c in facts["cos_out"] + facts["cos_grad"]), facts
