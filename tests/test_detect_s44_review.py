"""s44 review of the code merged late in s43 (`git diff 2deb8cf..00548ed -- src/`): each defect found on invented
code, pinned here first (each test fails on b237412), then fixed; the Fuse forms run under the emulator against the
original, outputs and gradients."""

from __future__ import annotations

import ast

from pattern_harness import check_rewrite_runs, detect_all
from npufuse.patterns.add_rms_norm import AddRmsNorm

import test_detect_s43_ho20 as ho20


def _close(facts: dict, tol: float = 0.9999) -> None:
    assert facts["calls"] >= 1, facts["all_calls"]
    assert all(a == b for a, b in facts["dtypes"]), facts["dtypes"]
    assert all(c > tol for c in facts["cos_out"]), facts["cos_out"]
    assert all(c > tol for c in facts["cos_grad"]), facts["cos_grad"]


# -- 1. _norm_s43.exiting_if_arm: the arm's test was moved onto the instance by text ---------------------------------

def test_exiting_if_test_keeps_a_string_that_holds_self_dot() -> None:
    # `re.sub(r"\bself\.", ..)` also rewrote the string constant: `self.kind != "self.plain"` became
    # `self.pre_mlp.kind != 'self.pre_mlp.plain'` (always true), so the weighted arm ran where the original returns
    # the bare value (here: the weightless layer's gain is None, the rewrite raised)
    code = ho20._OPTIONAL_WEIGHT.format(test='self.kind != "self.plain"', weighted="unit * self.gain").replace(
        "        self.eps = eps\n", "        self.eps = eps\n        self.kind = 'w' if learnable else 'self.plain'\n")
    findings, _ = detect_all(AddRmsNorm(), code)
    assert findings and all(f.params.get("condition") == "(self.pre_mlp.kind != 'self.plain')" for f in findings)
    _close(check_rewrite_runs(AddRmsNorm(), code, ho20._RUN_LAYER, findings))


# -- 2. _moe_s43b.rows_term_tail: the precomputed rows term added to rows no expert writes ----------------------------

import pytest  # noqa: E402

from npufuse.patterns import _moe_s43b  # noqa: E402
from npufuse.patterns.moe_experts import MoeExperts  # noqa: E402

_NULL_ID = "logits = torch.randn(2, 5, 5)"  # one logit more than experts: argmax may pick id 4, which no expert takes
_SENTINEL = ("top1 = torch.argmax(logits, dim=-1)",
             "top1 = torch.argmax(logits, dim=-1)\n        top1 = torch.where(logits.max(-1).values > 0.5, top1, len(self.experts))")


@pytest.mark.parametrize("code,run", [
    (_moe_s43b._TOP1_SHARED_ROWS, _moe_s43b._TOP1_RUN.replace("logits = torch.randn(2, 5, 4)", _NULL_ID)),
    (_moe_s43b._TOP1_SHARED_ROWS.replace(*_SENTINEL), _moe_s43b._TOP1_RUN),
], ids=["argmax_over_more_logits_than_experts", "sentinel_id_of_dropped_tokens"])
def test_shared_rows_term_is_added_only_to_rows_an_expert_writes(code: str, run: str) -> None:
    # `out[m] = expert(x[m]) + shared_out[m]` over flat ids: a row whose id names no expert stays zero in the
    # original; the fused tail added `shared_out` to every row (emulator cos 0.98)
    findings, misses = detect_all(MoeExperts(), code)
    assert findings, [m.reason for m in misses]
    _close(check_rewrite_runs(MoeExperts(), code, run, findings))


# -- 3. affinity_where._attribute_values: a NaN fill stored by an annotated or a tuple assignment --------------------

from npufuse.patterns.affinity_where import AffinityWhere  # noqa: E402

import test_detect_s43_audit_fixes as audit43  # noqa: E402

_STORE = "self.fill_float = fill_float"


@pytest.mark.parametrize("store", ["self.fill_float: float = fill_float", "self.mode, self.fill_float = 0, fill_float",
                                   "self.fill_float: float = float('nan')"])
def test_nan_fill_attribute_stored_annotated_or_unpacked_is_not_inf_safe(store: str) -> None:
    # audit43's W3 read `self.<attr> = v` only: lerp(val, nan, 0) is NaN on every row, where the original keeps val
    findings, misses = detect_all(AffinityWhere(), audit43._NAN_ATTRIBUTE.replace(_STORE, store))
    assert not findings
    assert len([m for m in misses if "NaN" in m.reason]) == 2


@pytest.mark.parametrize("store", ["self.fill_float: float = fill_float", "self.mode, self.fill_float = 0, fill_float"])
def test_finite_fill_attribute_stored_annotated_or_unpacked_still_becomes_lerp(store: str) -> None:
    findings, _ = detect_all(AffinityWhere(), audit43._FINITE_ATTRIBUTE.replace(_STORE, store))
    assert len(findings) == 1


# -- 4. sdpa._filled_base_kind: zeros changed in place before the -inf fill --------------------------------------------

from npufuse.patterns.sdpa import SdpaPattern  # noqa: E402

_FILLED_BIAS = '''
import torch
import torch.nn.functional as F


def attend(q, k, v, alibi, pad):
    b, h, t, d = q.shape
    bias = torch.zeros(b, h, t, t, dtype=q.dtype)
{change}
    bias = bias.masked_fill(pad, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
'''
_FILLED_RUN = '''
q = torch.randn(2, 2, 5, 8, requires_grad=True)
k = torch.randn(2, 2, 5, 8)
v = torch.randn(2, 2, 5, 8)
alibi = torch.randn(2, 2, 5, 5)
pad = torch.zeros(2, 1, 1, 5, dtype=torch.bool)
pad[..., -1] = True
out = attend(q, k, v, alibi, pad)
leaves = [q]
'''


@pytest.mark.parametrize("change", ["    bias.add_(alibi)", "    bias[:] = alibi", "    bias[..., :] += alibi"])
def test_zeros_changed_in_place_before_the_fill_are_no_0_inf_mask(change: str) -> None:
    # audit43's W1 took `zeros(..).masked_fill(m, -inf)` as a 0/-inf mask from the definition alone: an in-place add of
    # the ALiBi bias in between was dropped by the fused call (emulator cos 0.84); now its values are checked at run
    # time, which sends this input (graded values) to the original code
    code = _FILLED_BIAS.format(change=change)
    findings, _ = detect_all(SdpaPattern(), code)
    facts = check_rewrite_runs(SdpaPattern(), code, _FILLED_RUN, findings)
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999, facts


def test_untouched_zeros_filled_with_minus_inf_still_run_fused() -> None:
    code = _FILLED_BIAS.format(change="    scale = 1.0")
    findings, _ = detect_all(SdpaPattern(), code)
    _close(check_rewrite_runs(SdpaPattern(), code, _FILLED_RUN, findings))


# -- 5. _moe_s43a._as_column: a negated constant that is no integer ---------------------------------------------------

from npufuse.patterns import _moe_s43a  # noqa: E402


def test_column_reading_does_not_raise_on_a_negated_non_integer() -> None:
    # `-a.operand.value` of `v.view(-None, 1)` raised TypeError: a detector error for the whole file (hostile input
    # must leave a near miss at most)
    code = _moe_s43a._TOP1_WEIGHTED.replace("gate[mask].unsqueeze(-1)", "gate[mask].view(-None, 1)")
    findings, misses = detect_all(MoeExperts(), code)
    assert not findings and misses
    for spelling in ("v.view(-None, 1)", "v.view(-'a', 1)", "v.unsqueeze(-1.5)"):
        assert _moe_s43a._as_column(ast.parse(spelling, mode="eval").body) is None
    assert _moe_s43a._as_column(ast.parse("v.view(-1, 1)", mode="eval").body) is not None


# -- 6. _norm_s43.lift_over_exiting_if: a kept statement before the if changes what the moved test reads --------------

from npufuse.patterns.rms_norm import RmsNorm  # noqa: E402


def _norm_findings(code: str) -> list:
    return [f for f in detect_all(RmsNorm(), code)[0] if f.qualname == "ScaleFreeRMSNorm.forward"]


def test_exiting_if_test_is_not_moved_before_a_statement_that_writes_what_it_reads() -> None:
    # the fused code evaluates `self.use_gain` before the kept `self.use_gain = ..` ran: the second call took the
    # weighted arm where the original returned the bare value (emulator cos 0.12)
    code = ho20._OPTIONAL_WEIGHT.format(test="self.use_gain", weighted="unit * self.gain").replace(
        "        unit = h / denom\n", "        unit = h / denom\n        self.use_gain = self.gain is not None and not self.use_gain\n").replace(
        "        self.eps = eps\n", "        self.eps = eps\n        self.use_gain = False\n")
    assert not _norm_findings(code)


def test_exiting_if_with_a_kept_statement_the_test_does_not_read_is_still_fused() -> None:
    code = ho20._OPTIONAL_WEIGHT.format(**ho20._PLAIN).replace(
        "        unit = h / denom\n", "        unit = h / denom\n        self.calls = getattr(self, 'calls', 0) + 1\n")
    findings = _norm_findings(code)
    assert findings and "self.calls = getattr(self, 'calls', 0) + 1" in findings[0].fused.split("else:")[0]
    _close(check_rewrite_runs(RmsNorm(), code, ho20._RUN_NORM, findings))
