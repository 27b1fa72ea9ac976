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

import pytest

from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns import _mask_rows
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.moe_experts import _S41_COUNT_STAT, _S41_POSITIVE_SELECT, MoeExperts


def _without_value_rows(text: str) -> str:
    """``text`` without s49's row half of the value checks (``(m == 0).any(-1).all()`` of an additive mask, ``(m == 1)``
    of a 0 / 1 one, in the same host sync as the values): what is left is _mask_rows' own row check, if any."""
    return text.replace(" == 0).any(-1).all()", " == 0)").replace(" == 1).any(-1).all()", " == 1)")


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


# -- 4. a helper's size check after an early return -----------------------------------------------------------------------

_EARLY_RETURN = '''
import torch
import torch.nn.functional as F
from torch import nn


def band(q_len, k_len, bottom_right=True):
    if bottom_right:
        return torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    if k_len < q_len:
        raise ValueError("fewer keys than queries")
    return torch.ones(q_len, k_len, dtype=torch.bool).tril()


class Cross(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)

    def forward(self, x, ctx):
        b, n, c = x.shape
        m = ctx.shape[1]
        q = self.q(x).view(b, n, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(ctx).view(b, m, 2, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        keep = band(n, m)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return out.transpose(1, 2).reshape(b, n, c)
'''


def _sdpa_guard(code: str) -> str:
    from npufuse.patterns.sdpa import SdpaPattern

    (f,), _ = detect_all(SdpaPattern(), code)
    return f.fused.splitlines()[0]


def test_a_size_check_after_an_early_return_does_not_cover_that_return() -> None:
    # the default path returns bottom-right causal before the check: more queries than keys empty its first rows
    # (was "kept": no run-time row check)
    assert ".any(-1).all()" in _sdpa_guard(_EARLY_RETURN)


def test_a_size_check_before_every_return_still_excludes_its_sizes() -> None:
    # twin: the check moved before the early return covers both paths: kept, no row check
    code = _EARLY_RETURN.replace('''    if bottom_right:
        return torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    if k_len < q_len:
        raise ValueError("fewer keys than queries")
''', '''    if k_len < q_len:
        raise ValueError("fewer keys than queries")
    if bottom_right:
        return torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
''')
    assert ".any(-1).all()" not in _without_value_rows(_sdpa_guard(code))


# -- 5. constant sizes the evaluation would allocate ----------------------------------------------------------------------

def _big_helper(mask: str) -> str:
    """wrong41's module-function site, its mask built from helpers with hostile constant sizes."""
    from test_detect_s41_wrong_classes import _HELPER_FN

    helper = "def make_mask(n, device=None):\n    return torch.ones(n, n, dtype=torch.bool, device=device).tril()\n"
    assert helper in _HELPER_FN and "        keep = make_mask(n, x.device)\n" in _HELPER_FN
    return _HELPER_FN.replace(helper, (
        "def full_causal():\n    return torch.ones(65536, 65536, dtype=torch.bool).tril()\n\n\n"
        "def positions(n):\n    return torch.arange(n)\n")).replace(
        "        keep = make_mask(n, x.device)\n", f"        i = positions(1099511627776)\n        keep = {mask}\n")


@pytest.mark.parametrize("mask", ["full_causal()[:n, :n] & (i[:n, None] >= i[None, :n])",
                                  "(i[:n, None] >= i[None, :n]) & full_causal()[:n, :n]"])
def test_the_mask_evaluation_allocates_no_tensor_of_a_hostile_size(monkeypatch, mask: str) -> None:
    import torch

    from npufuse.patterns.sdpa import SdpaPattern

    asked: list[str] = []
    real_ones, real_arange = torch.ones, torch.arange

    def ones(*size, **kw):
        shape = size[0] if len(size) == 1 and isinstance(size[0], tuple) else size
        if torch.Size(shape).numel() > 1 << 24:
            asked.append(f"ones{tuple(shape)}")
            raise RuntimeError("refused by the test")
        return real_ones(*size, **kw)

    def arange(*args, **kw):
        if args and max(abs(a) for a in args if isinstance(a, (int, float))) > 1 << 24:
            asked.append(f"arange{args}")
            raise RuntimeError("refused by the test")
        return real_arange(*args, **kw)

    _mask_rows._load_torch()
    monkeypatch.setattr(torch, "ones", ones)
    monkeypatch.setattr(torch, "arange", arange)
    found, misses = detect_all(SdpaPattern(), _big_helper(mask))
    assert not asked, asked
    assert found or misses  # the site is still read (the construction itself is not: no row verdict)


# -- 6. a helper's parameters bound to the caller's expressions ------------------------------------------------------------

_NARROW = '''
import torch
from torch import nn


def narrow(base, n, w):
    i = torch.arange(n)
    return base & (i[None, :] > i[:, None] - w)


class Local(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, n, w):
        b, _, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        wide = causal & (torch.arange(n)[None, :] > torch.arange(n)[:, None] - 4)
        keep = narrow(wide, n, w - 1)
        scores = q @ k.transpose(-2, -1) / self.hd ** 0.5
        scores = scores.masked_fill(~keep, float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return out.transpose(1, 2).reshape(b, n, c)
'''


def _verdicts(code: str, monkeypatch) -> list:
    seen: list = []
    real = _mask_rows.row_verdict

    def spy(node, polarity, resolve):
        verdict = real(node, polarity, resolve)
        seen.append(verdict.kind if verdict is not None else None)
        return verdict

    monkeypatch.setattr(_mask_rows, "row_verdict", spy)
    detect_all(AttentionPattern(), code)
    return seen


def test_a_helper_parameter_is_the_callers_expression(monkeypatch) -> None:
    # `w - 1` is 0 at w = 1 (the band then drops the diagonal: every row empty) and keeps it from w = 2: the run-time
    # check decides. Unbound, the parameter `w` was sampled as the caller's own `w` (>= 1): "kept", no check
    assert _verdicts(_NARROW, monkeypatch) == ["varies"]
    (f,), _ = detect_all(AttentionPattern(), _NARROW)
    assert ".all(-1).any()" in f.fused.splitlines()[0], f.fused


def test_a_helper_evaluated_inside_its_own_argument_is_not_read_as_kept(monkeypatch) -> None:
    # `narrow(narrow(...), w - 1)` through a local: both calls read the same nodes of `narrow`; the inner evaluation
    # rebound them under the outer one's reading ("kept"). Not followed now (no verdict), as before s41
    code = _NARROW.replace("        wide = causal & (torch.arange(n)[None, :] > torch.arange(n)[:, None] - 4)\n",
                           "        wide = narrow(causal, n, 4)\n")
    assert "kept" not in _verdicts(code, monkeypatch)


# -- 7. integer names in camelCase or with the word at a part's end --------------------------------------------------------

@pytest.mark.parametrize("name", ["tokenPositions", "kvcacheindex"])
def test_integer_names_stay_integer_after_the_whole_part_reading(name: str) -> None:
    # integer tensors before audit41's R1 (the word anywhere), torch.lerp candidates after it (a part had to START
    # with the word, and camelCase was one part): lerp takes floating point only
    from npufuse.patterns.affinity_where import AffinityWhere

    code = f"import torch\n\n\ndef shift(ids, {name}):\n    {name} = torch.where({name} == -1, ids, {name})\n    return {name}\n"
    found, misses = detect_all(AffinityWhere(), code)
    assert not found and any("integer tensors" in m.reason for m in misses), [m.reason for m in misses]
