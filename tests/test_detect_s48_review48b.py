"""s48 review48b: review of the s48 detection code (fix48, moe48, ho25fix).

1. moe_experts: a routing weight stored slot by slot with ``=`` (fix48's unrolled writes ``tw[pos_k] = w[sel, k][pos_k]``,
   fix47h's slot loop ``for k in range(K): tw[km] = w[sel, k][km]``) was read as the dense-gates sum
   ``(w * (idx == e)).sum(-1)[sel]`` for indices of any source. A row listing e in two slots keeps the LAST slot's
   weight in the original, where the sum (and the fused dispatch) adds both: a wrong replacement for indices drawn
   with replacement (``torch.multinomial(p, K, replacement=True)``: cos 0.9487 against the original on the start
   code). A plain store is now read only for a last-dim topk's indices (distinct per row); ``+=`` (the sum for any
   indices) still fuses for them, and topk indices still fuse with ``=``.
"""

from __future__ import annotations

import pytest
from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.moe_experts import MoeExperts
import test_detect_s48_fix48 as F

_TOPK = "w, idx = self.gate(flat).topk(k=2, dim=-1)\n        w = F.softmax(w, dim=-1)"
_DRAWN = ("p = F.softmax(self.gate(flat), dim=-1)\n        idx = torch.multinomial(p, 2, replacement=True)\n"
          "        w = p.gather(-1, idx)")
_WRITES = """                pos0 = idx[sel, 0] == e
                pos1 = idx[sel, 1] == e
                tw[pos0] = w[sel, 0][pos0]
                tw[pos1] = w[sel, 1][pos1]
"""
_LOOP = """                for k in range(2):
                    km = idx[sel, k] == e
                    tw[km] = w[sel, k][km]
"""
# two experts and a fixed seed: rows listing one expert in both slots occur
_DRAWN_RUN = F._UNROLLED_RUN.replace("TwoSlotMoE(16, 24, 5)", "TwoSlotMoE(16, 24, 2)").replace(
    "out = [m(x)]", "torch.manual_seed(5)\nout = [m(x)]")


def _variant(drawn: bool, loop: bool, add: bool) -> str:
    code = F._UNROLLED
    if drawn:
        code = code.replace(_TOPK, _DRAWN)
    if loop:
        code = code.replace(_WRITES, _LOOP)
    if add:
        code = code.replace("tw[pos0] = w", "tw[pos0] += w").replace("tw[pos1] = w", "tw[pos1] += w").replace(
            "tw[km] = w", "tw[km] += w")
    assert code != F._UNROLLED or not (drawn or loop or add)
    return code


@pytest.mark.parametrize("loop", [False, True], ids=["unrolled", "slot_loop"])
def test_plain_slot_stores_of_drawn_indices_are_not_fused(loop: bool) -> None:
    code = _variant(drawn=True, loop=loop, add=False)
    findings, misses = detect_all(MoeExperts(), code)
    assert not findings, [f.qualname for f in findings]
    assert any("exact only for distinct indices per row" in m.reason and "`idx` is not shown to be the indices of a topk"
               in m.reason for m in misses), [m.reason for m in misses]


@pytest.mark.parametrize("loop", [False, True], ids=["unrolled", "slot_loop"])
@pytest.mark.parametrize("drawn,add", [(True, True), (False, False)], ids=["drawn_sum", "topk_store"])
def test_summed_or_topk_slot_writes_still_fuse_and_match(loop: bool, drawn: bool, add: bool) -> None:
    """Twins: `+=` is the sum for any indices; `=` is exact for a topk's distinct indices."""
    code = _variant(drawn=drawn, loop=loop, add=add)
    findings, misses = detect_all(MoeExperts(), code)
    assert [f.qualname for f in findings] == ["TwoSlotMoE.forward"], [m.reason for m in misses]
    facts = check_rewrite_runs(MoeExperts(), code, _DRAWN_RUN if drawn else F._UNROLLED_RUN, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.99999 and min(facts["cos_grad"]) > 0.9999, facts
