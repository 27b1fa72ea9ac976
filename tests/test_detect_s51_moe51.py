"""s51 (moe51): classes from the moe51 labels-first sweep. Invented reproducers (no repository code) of the any-mask
expert loop whose gate is scattered into a fresh [T] zeros buffer from the (token, slot) pairs of ``torch.where(ids ==
e)`` and read back at the token mask (``_moe_s51m``, hooked in s50h's any-mask reader). Each FUSE case is rewritten and
run against the original under the emulator (outputs and gradients, fp32 and bf16); each KEEP twin is not fused.
"""

from __future__ import annotations

import torch
from pattern_harness import check_rewrite_runs, detect_all, fused_and_runs

from npufuse.patterns.moe_experts import MoeExperts

_HEAD = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F
'''

# -- 1. the gate scattered into a [T] buffer -----------------------------------------------------------------------

_SCATTER = _HEAD + '''

class Mlp(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, z):
        return self.down(F.gelu(self.up(z)))


class ScatterGateMoe(nn.Module):
    def __init__(self, d, n, k):
        super().__init__()
        self.k = k
        self.score = nn.Linear(d, n)
        self.experts = nn.ModuleList([Mlp(d, 3 * d) for _ in range(n)])

    def forward(self, h):
        b, s, d = h.shape
        flat = h.reshape(-1, d)
        probs = F.softmax(self.score(flat), dim=-1)
        top_p, top_i = torch.topk(probs, self.k, dim=-1)
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        result = torch.zeros_like(flat)
        for idx, expert in enumerate(self.experts):
            hit = top_i == idx
            rows = hit.any(dim=-1)
            if rows.any():
                picked = flat[rows]
                y = expert(picked)
                tok, slot = torch.where(hit)
                gate = torch.zeros(flat.size(0), device=flat.device)
                gate[tok] = top_p[tok, slot]
                y = y * gate[rows].unsqueeze(-1)
                result[rows] += y
        return result.reshape(b, s, d)
'''

_SCATTER_RUN = '''
torch.manual_seed(0)
m = ScatterGateMoe(8, 5, 2)
x = torch.randn(2, 6, 8, requires_grad=True)
out = m(x)
leaves = [x, m.score.weight, m.experts[1].up.weight, m.experts[3].down.bias]
'''


def _bf16(run: str, ctor: str) -> str:
    return run.replace(ctor, ctor + ".to(torch.bfloat16)").replace("requires_grad=True", "dtype=torch.bfloat16, requires_grad=True")


def _not_fused(code: str) -> list[str]:
    findings, misses = detect_all(MoeExperts(), code)
    assert not findings, [f.qualname for f in findings]
    return [m.reason for m in misses]


def test_scattered_gate_fused_and_exact_fp32() -> None:
    facts = fused_and_runs(MoeExperts(), _SCATTER, _SCATTER_RUN, "ScatterGateMoe.forward")
    assert facts["all_calls"].get("npu_moe_token_permute") == 1
    # the buffer is the default dtype: the loop weights the rows in it; the reading holds the weights' dtype
    assert "top_p.dtype == torch.get_default_dtype()" in facts["rewritten"]


def test_scattered_gate_with_the_weights_dtype_needs_no_dtype_guard() -> None:
    code = _SCATTER.replace("gate = torch.zeros(flat.size(0), device=flat.device)",
                            "gate = torch.zeros(flat.size(0), device=flat.device, dtype=top_p.dtype)")
    facts = fused_and_runs(MoeExperts(), code, _SCATTER_RUN, "ScatterGateMoe.forward")
    assert "get_default_dtype" not in facts["rewritten"]


def test_scattered_gate_bf16_model_runs_exactly() -> None:
    # bf16 weights: the default-dtype buffer guard fails, so the original runs (no fused call, same values)
    code = _SCATTER.replace("gate = torch.zeros(flat.size(0), device=flat.device)",
                            "gate = torch.zeros(flat.size(0), device=flat.device, dtype=top_p.dtype)")
    findings, _ = detect_all(MoeExperts(), code)
    facts = check_rewrite_runs(MoeExperts(), code, _bf16(_SCATTER_RUN, "ScatterGateMoe(8, 5, 2)"), findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.999 and min(facts["cos_grad"]) > 0.99, facts


def test_scattered_gate_default_dtype_guard_keeps_the_originals_error() -> None:
    # bf16 weights into the default-dtype buffer: the original raises (index_put dtypes differ); the guard sends the
    # rewritten code to the original, which raises the same error (no fused call hides it)
    import pytest

    findings, _ = detect_all(MoeExperts(), _SCATTER)
    with pytest.raises(RuntimeError, match="Index put requires"):
        check_rewrite_runs(MoeExperts(), _SCATTER, _bf16(_SCATTER_RUN, "ScatterGateMoe(8, 5, 2)"), findings)


_HANDED = _SCATTER.replace("    def forward(self, h):\n        b, s, d = h.shape",
                           "    def forward(self, h, top_i):\n        b, s, d = h.shape").replace(
    "        top_p, top_i = torch.topk(probs, self.k, dim=-1)\n", "        top_p = probs.gather(-1, top_i)\n")


def test_scattered_gate_ids_not_a_topk_get_the_distinct_rows_check() -> None:
    findings, _ = detect_all(MoeExperts(), _HANDED)
    assert [f.qualname for f in findings] == ["ScatterGateMoe.forward"]
    run = _SCATTER_RUN.replace("out = m(x)", "ids = torch.tensor([[0, 3], [1, 1], [2, 4], [4, 0], [3, 3], [1, 2]] * 2)\nout = m(x, ids)")
    facts = check_rewrite_runs(MoeExperts(), _HANDED, run, findings)
    assert "torch.diff(torch.sort(top_i" in facts["rewritten"]
    # rows [1, 1] / [3, 3] repeat an expert: the loop keeps one slot's weight, so the original runs
    assert facts["calls"] == 0 and min(facts["cos_out"]) > 0.9999, facts


def test_scattered_gate_distinct_handed_ids_fused_and_exact() -> None:
    findings, _ = detect_all(MoeExperts(), _HANDED)
    run = _SCATTER_RUN.replace("out = m(x)", "ids = torch.tensor([[0, 3], [1, 2], [2, 4], [4, 0], [3, 1], [1, 2]] * 2)\nout = m(x, ids)")
    facts = check_rewrite_runs(MoeExperts(), _HANDED, run, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999, facts


# KEEP twins

def test_scatter_of_one_slot_column_is_not_read() -> None:
    # slot 0's weight whatever slot chose e: not the pair's weight
    _not_fused(_SCATTER.replace("gate[tok] = top_p[tok, slot]", "gate[tok] = top_p[tok, 0]"))


def test_scatter_into_a_2d_buffer_is_not_read() -> None:
    _not_fused(_SCATTER.replace("gate = torch.zeros(flat.size(0), device=flat.device)",
                                "gate = torch.zeros((flat.size(0), 1), device=flat.device)"))


def test_scatter_with_the_pairs_used_again_is_not_read() -> None:
    _not_fused(_SCATTER.replace("                result[rows] += y\n",
                                "                result[rows] += y\n                result[tok] *= 1.0\n"))


def test_scatter_accumulated_is_not_read() -> None:
    _not_fused(_SCATTER.replace("gate[tok] = top_p[tok, slot]", "gate[tok] += top_p[tok, slot]"))


def test_scatter_buffer_of_another_dtype_is_not_read() -> None:
    _not_fused(_SCATTER.replace("gate = torch.zeros(flat.size(0), device=flat.device)",
                                "gate = torch.zeros(flat.size(0), device=flat.device, dtype=torch.float16)"))


def test_scattered_gate_carries_the_weights_shape_check() -> None:
    # w[r, c] is the pair's weight only for w shaped like the [T, K] ids: checked at run time (a router of another
    # file cannot be read statically)
    findings, _ = detect_all(MoeExperts(), _SCATTER)
    facts = check_rewrite_runs(MoeExperts(), _SCATTER, _SCATTER_RUN, findings)
    assert "(top_p.shape == top_i.shape)" in facts["rewritten"] and facts["calls"] >= 1
