"""s41 review (helper review41): defects found reading the session's change, each with a test failing before its fix.

1. moe_experts: a per-expert count written in a loop that picks its tokens as ``w > 0`` of the summed slot weights
   (StoryMixtral's skip with sidrocks' count): the loop leaves out routed tokens whose weight is 0 (an underflowed
   softmax), the histc of the indices counts them.
2. moe_experts: the histc counts stay on the indices' device while the loop wrote into a CPU tensor (``.item()``):
   ``torch.where`` / ``+=`` across devices fail where the loop did not.
3. attention: intermediates read after the site in both arms of one flag gave the guard ``(flag) and (not flag)``.
4. _mask_rows: a helper's ``if ...: raise`` after a ``return`` was taken as a check of the sizes that return runs at.
5. _mask_rows: constant sizes (a helper's ``torch.ones(65536, 65536)``) were allocated by the evaluation.
"""

from __future__ import annotations

import ast

from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns import _mask_rows
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.moe_experts import _S41_COUNT_STAT, _S41_POSITIVE_SELECT, MoeExperts

# -- 1. counts of tokens picked by their weights -------------------------------------------------------------------------

_COUNTED_POSITIVE_SELECT = _S41_POSITIVE_SELECT.replace(
    "        out = torch.zeros_like(x)\n", "        out = torch.zeros_like(x)\n        usage = torch.zeros(self.n)\n").replace(
    "            y = self.experts[e](x[selected])", "            usage[e] = selected.sum()\n            y = self.experts[e](x[selected])").replace(
    "        return out\n", "        return out, usage\n")


def test_a_count_of_tokens_picked_by_positive_weight_is_a_near_miss() -> None:
    # the count leaves out routed tokens whose softmax weight underflowed to 0 (gate logits 1000x: counts differed,
    # e.g. 0 vs 2 for an expert), the histc of the indices counts them
    assert "usage[e] = selected.sum()" in _COUNTED_POSITIVE_SELECT
    found, misses = detect_all(MoeExperts(), _COUNTED_POSITIVE_SELECT)
    assert not found, found[0].fused
    assert any("picked as `w > 0`" in m.reason and "weight is 0" in m.reason for m in misses), [m.reason for m in misses]


def test_a_count_of_routed_tokens_stays_fused() -> None:
    # Fuse twin: the count of the routing mask with the tokens picked by the mask itself (no weight test)
    (f,), _ = detect_all(MoeExperts(), _S41_COUNT_STAT)
    assert "torch.histc(" in f.fused


# -- 2. the counts' device -----------------------------------------------------------------------------------------------

def test_histc_counts_move_to_the_device_of_the_tensor_the_loop_wrote() -> None:
    code = _S41_COUNT_STAT.replace("usage[e] = tok.sum()", "usage[e] = tok.sum().item()")
    (f,), _ = detect_all(MoeExperts(), code)
    line = next(ln for ln in f.fused.splitlines() if ln.startswith("_npufuse_cnt = torch.histc("))
    assert line.endswith(".to(usage.device)"), line


# -- 3. intermediates read under both arms of one flag --------------------------------------------------------------------

def _rel_pos_read_in_both_arms() -> str:
    import test_detect_s41_sweep as sweep

    code = sweep._REL_POS.replace('''        if self.relative_position:
            out = out + torch.einsum("b t s, t s d -> b t d", sim, self.rel_v(len_q, len_k))
''', '''        if self.relative_position:
            out = out + torch.einsum("b t s, t s d -> b t d", sim, self.rel_v(len_q, len_q))
        else:
            out = out * (len_k / len_k)
''').replace('''        if self.relative_position:
            len_q, len_k = q.shape[1], k.shape[1]
''', '''        len_k = k.shape[1]
        if self.relative_position:
            len_q, len_k = q.shape[1], k.shape[1]
''')
    assert "out * (len_k / len_k)" in code and "        len_k = k.shape[1]\n" in code
    return code


def test_intermediates_read_under_both_arms_of_one_flag_are_a_near_miss() -> None:
    # was a candidate guarded by `(self.relative_position) and (not self.relative_position)`: never fused
    found, misses = detect_all(AttentionPattern(), _rel_pos_read_in_both_arms())
    assert not found, found[0].fused
    assert any("where `self.relative_position` holds" in m.reason and "no value of the test" in m.reason for m in misses), \
        [m.reason for m in misses]


def test_intermediates_read_under_one_arm_stay_fused() -> None:
    # Fuse twin: the else arm reads nothing of the attention
    import test_detect_s41_sweep as sweep

    code = _rel_pos_read_in_both_arms().replace("out = out * (len_k / len_k)", "out = out * 1.0")
    (f,), _ = detect_all(AttentionPattern(), code)
    assert "not self.relative_position" in f.fused.splitlines()[0], f.fused
    facts = check_rewrite_runs(AttentionPattern(), code, sweep._REL_RUN, [f])
    assert facts["all_calls"].get("npu_fusion_attention") == 1 and all(c > 0.99999 for c in facts["cos_out"]), facts
