"""s46 (review46): a correctness review of the code that landed in s45. Each defect test fails on the session's
start code (/tmp/start46); its twin (where there is one) pins the form that was already right.

1. add_rms_norm, ho22fix45's width-adapting norm (``if x.size(-1) != self.dim: x = x[..., :self.dim]``) followed by
   ``if self.weight is not None: return <weighted> else: return <plain>``: the width test replaced the arm's own
   test, so the fused call read ``self.norm.weight`` where it is None (AttributeError under the emulator).
2. moe_experts, ho22fix45's router outputs handed to a helper method: a chain of helper methods each calling the
   next several times was read once per path through the chain (n ** k readings on hostile input); memoised per
   file now.
3. attention mask rows, ho22fix45's ``reaching_store`` (the last plain ``b = ..`` before the read): a loop / with /
   tuple / walrus binding of the same name between the stores was not seen, so a mask whose first row is empty
   (``for b in (arange(n) + 1,)``) read "every row keeps a key" and took no row check. The same blind spot with one
   plain store (pre-s45) is closed by the same check: such a name is unread (the run-time row check).
4. attention, attn45's tiled online-softmax loop nest read as one call. (a) The exponent reading an alias of the
   scores taken before the mask block (``raw = s; if mask is not None: s = s + mask[..]``, ``exp(raw - m_new)``) was
   read as the masked scores (the loop's softmax leaves the mask out: cos 0.77). (b) A name the inner body reads and
   reassigns at its end (``xv = xv * 1.5``, ``scale = scale * 1.5``) carries a value across key blocks: not one
   attention (cos 0.76 / 0.93). (c) The key loop bounded by the query block's end (``range(0, i_end, B)``: block-causal
   by bounds) and a scale reading a loop variable: the fused text read those names before the loop
   (UnboundLocalError). (d) A learned scale (``self.s = nn.Parameter(..)``) reached the op as a tensor (TypeError):
   the fused branch now runs where the scale is a Python number.
5. One reader of "is ``self.<attr>`` changed by code outside ``__init__``" (``bound_callee.changed_outside_init``)
   serves swiglu's reassigned activation, defects44's ``__init__`` values and ``_site``'s method held by an
   attribute. Each caller now also sees ``setattr`` / ``delattr(self, ..)``, ``del self.<attr>`` and hooks nested in
   ``__init__`` (they run after construction); seeing more changes only refuses more.
6. eps placed outside the root / as a clamp (probed norms; ho22fix45 mapped "added outside the root" for the add +
   norm too): the probe measures the class's default eps, but the fused branch ran with any instance's eps
   (``RMSNorm(d, eps=0.5)``: cos 0.9989). The fused branch now tests the instance's eps' against the bound it was
   accepted under (add_rms_norm and rms_norm alike).
"""

from __future__ import annotations

import time

import pytest
from pattern_harness import check_rewrite_runs, detect_all
from test_detect_s40_wrong_classes import _verdict
from test_detect_s43_sweep import _BLOCK_RUN
from test_detect_s45_ho22 import _EPS_OUTSIDE, _HELPER_MOE
from test_detect_s45_attention import _CAUSAL, _TILED, _TILED_RUN
from test_detect_s45_review import _moe_code
from test_detect_s45_swiglu_reassigned import _MLP

from npufuse.patterns import _moe_s45h
from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.moe_experts import MoeExperts
from npufuse.patterns.rms_norm import RmsNorm
from npufuse.patterns.swiglu import Swiglu
from npufuse.scan import bound_callee
from npufuse.scan.dataflow import ModuleInfo

# -- 1. a width-adapting norm whose weight is optional ---------------------------------------------------------------

_WIDTH_NORM_OPTIONAL_WEIGHT = '''\
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, affine=True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.dim = dim

    def forward(self, x):
        if x.size(-1) != self.dim:
            x = x[..., :self.dim]
        if self.weight is not None:
            return x * torch.rsqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + self.eps) * self.weight
        else:
            return x * torch.rsqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + self.eps)


class Block(nn.Module):
    def __init__(self, d, affine=False):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.norm2 = RMSNorm(d, affine=affine)
        self.ffn = nn.Linear(d, d)

    def forward(self, x):
        x = x + self.attn(x)
        x = x + self.ffn(self.norm2(x))
        return x
'''


@pytest.mark.parametrize("affine, fused", [(False, False), (True, True)], ids=["weight_none_runs_original", "weight_set_fused"])
def test_width_adapting_norm_keeps_the_weight_arm_test(affine: bool, fused: bool) -> None:
    findings, misses = detect_all(AddRmsNorm(), _WIDTH_NORM_OPTIONAL_WEIGHT)
    assert [f.qualname for f in findings] == ["Block.forward"], [m.reason for m in misses]
    head = findings[0].fused.splitlines()[0]
    assert "self.norm2.weight is not None" in head and "x.shape[-1] == self.norm2.dim" in head, head
    run = _BLOCK_RUN.replace("Block(16)", f"Block(16, affine={affine})")
    facts = check_rewrite_runs(AddRmsNorm(), _WIDTH_NORM_OPTIONAL_WEIGHT, run, findings)
    assert bool(facts["calls"]) == fused, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.99999 and min(facts["cos_grad"]) > 0.99999, facts


# -- 2. helper-method chains read once per method ---------------------------------------------------------------------


def _chained_helpers(levels: int, calls: int) -> str:
    methods = "".join(
        f"    def _l{i}(self, x, rw, sel):\n        return {' + '.join([f'self._l{i - 1}(x, rw, sel)'] * calls)}\n"
        for i in range(1, levels + 1))
    code = _HELPER_MOE.replace("    def _experts(self, x, routing_weights, selected):",
                               methods + "    def _l0(self, x, routing_weights, selected):")
    return code.replace("out = self._experts(flat, routing_weights, selected)", f"out = self._l{levels}(flat, routing_weights, selected)")


def test_helper_method_chains_are_read_once_per_method(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = []
    every_call_binds = _moe_s45h._every_call_binds
    monkeypatch.setattr(_moe_s45h, "_every_call_binds", lambda *a: readings.append(a[1]) or every_call_binds(*a))
    start = time.process_time()
    findings, _ = detect_all(MoeExperts(), _chained_helpers(5, 5))
    assert [f.qualname for f in findings] == ["MoE._l0"]  # the loop is still read through the chain
    assert len(readings) <= 12, len(readings)  # 3,906 before (5 ** 5 + ...)
    assert time.process_time() - start < 5


# -- 3. a helper's local bound by a loop / with / tuple / walrus beside its plain stores ---------------------------------

_REBINDINGS = {
    "for": "    for b in (torch.arange(n) + 1,):\n        pass\n",
    "tuple": "    b, c = torch.arange(n) + 1, 0\n",
    "with": "    with ctx() as b:\n        pass\n",
    "walrus": "    c = (b := torch.arange(n) + 1)\n",
}


@pytest.mark.parametrize("rebind", list(_REBINDINGS.values()), ids=list(_REBINDINGS))
@pytest.mark.parametrize("after", ["    b = b * 1\n", ""], ids=["second_plain_store", "one_plain_store"])
def test_a_local_rebound_by_another_binding_is_not_read_from_its_plain_store(rebind: str, after: str) -> None:
    # b = arange(n) + 1 at the read: row 0 (0 >= j + 1 for every j) keeps no key; the plain store alone says causal
    helper = ("def mk(n):\n    b = torch.arange(n)\n" + rebind + "    m = torch.arange(n)[:, None] >= b[None, :]\n"
              + after + "    return m\nm = mk(n)")
    assert _verdict(helper, "keep") == "varies"


def test_straight_line_plain_stores_still_read_the_reaching_one() -> None:
    helper = ("def mk(n):\n    b = torch.arange(n) + 1\n    m = torch.arange(n)[:, None] >= b[None, :]\n    b = b * 0\n"
              "    return m\nm = mk(n)")
    assert _verdict(helper, "keep") == "empty"


# -- 4. tiled online-softmax loops ------------------------------------------------------------------------------------

_PARAM_SCALE = ("self.qkv = nn.Linear(dim, 3 * dim, bias=False)",
                "self.qkv = nn.Linear(dim, 3 * dim, bias=False)\n        self.s = nn.Parameter(torch.tensor(0.3))")


def _tiled(*changes: tuple[str, str]) -> str:
    code = _TILED
    for old, new in changes:
        assert old in code, old
        code = code.replace(old, new)
    return code


@pytest.mark.parametrize("changes", [
    # the exponent reads the scores taken before the mask block
    [("                if mask is not None:\n                    mask_ij", "                raw_ij = scores_ij\n                if mask is not None:\n                    mask_ij"),
     ("p_ij = torch.exp(scores_ij - m_new)", "p_ij = torch.exp(raw_ij - m_new)")],
    # values / scale changed at the end of each key block: carried into the next
    [("                m_i = m_new\n", "                m_i = m_new\n                xv = xv * 1.5\n")],
    [("                m_i = m_new\n", "                m_i = m_new\n                scale = scale * 1.5\n")],
    # a scale reading the key loop's variable (the fused text read it before the loop)
    [("torch.matmul(q_block, k_block.transpose(2, 3)) * scale", "torch.matmul(q_block, k_block.transpose(2, 3)) * (1.0 / (j_start + 1))")],
], ids=["alias_before_the_mask", "values_carried", "scale_carried", "scale_of_a_loop_variable"])
def test_tiled_loops_that_are_not_one_attention_are_not_fused(changes: list[tuple[str, str]]) -> None:
    findings, _ = detect_all(AttentionPattern(), _tiled(*changes))
    assert not [f for f in findings if f.variant.startswith("tiled")], findings[0].fused


def test_tiled_loop_with_keys_bounded_by_the_query_block_is_a_near_miss() -> None:
    code = _tiled(("for j_start in range(0, seqlen, self.block_size):", "for j_start in range(0, i_end, self.block_size):"),
                  ("j_end = min(j_start + self.block_size, seqlen)", "j_end = min(j_start + self.block_size, i_end)"))
    findings, misses = detect_all(AttentionPattern(), code)
    assert not [f for f in findings if f.variant.startswith("tiled")]
    assert any("the key loop's range reads `i_end`, which the query loop sets" in m.reason for m in misses), [m.reason for m in misses]


@pytest.mark.parametrize("changes", [
    [_PARAM_SCALE, ("scale = 1.0 / math.sqrt(self.head_dim)\n", "scale = self.s\n")],
    [_PARAM_SCALE, ("torch.matmul(q_block, k_block.transpose(2, 3)) * scale", "torch.matmul(q_block, k_block.transpose(2, 3)) * self.s")],
], ids=["named", "inline"])
def test_tiled_loop_with_a_learned_scale_runs_the_original(changes: list[tuple[str, str]]) -> None:
    code = _tiled(*changes)
    findings, _ = detect_all(AttentionPattern(), code)
    assert [f.variant for f in findings] == ["tiled_online_softmax+additive_float"]
    facts = check_rewrite_runs(AttentionPattern(), code, _TILED_RUN.format(mask=_CAUSAL), findings)
    assert not facts["calls"] and min(facts["cos_out"]) > 0.99999 and min(facts["cos_grad"]) > 0.99999, facts


def test_tiled_loop_with_a_number_scale_still_fuses() -> None:
    findings, _ = detect_all(AttentionPattern(), _TILED)
    assert "isinstance(scale, (int, float))" in findings[0].fused
    facts = check_rewrite_runs(AttentionPattern(), _TILED, _TILED_RUN.format(mask=_CAUSAL), findings)
    assert facts["calls"] and min(facts["cos_out"]) > 0.9999, facts


# -- 5. one reader of attributes changed outside __init__ ----------------------------------------------------------------

_CHANGES = '''
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d, self.e = 1, 2, [3], 4, 5
        self.register_forward_pre_hook(lambda mod, inp: setattr(self, "e", 6))

    def first(self):
        self.a = 2

    def second(self, other):
        self.a += 1
        del self.b
        self.c.pop()
        other.d = 0
'''


def test_changed_outside_init_names_the_first_method_and_how() -> None:
    module = ModuleInfo.from_source("m.py", _CHANGES)
    found = {k: (v.method, v.how) for k, v in bound_callee.changed_outside_init(module, "M").items()}
    assert found == {"a": ("M.first", "stored"), "b": ("M.second", "deleted"), "c": ("M.second", "pop()"),
                     "d": ("M.second", "stored on `other`"), "e": ("M.__init__.<lambda>", "setattr")}, found


@pytest.mark.parametrize("extra, said", [
    ("\n    def set_activation(self):\n        setattr(self, 'act', nn.GELU())\n", "changed in `MLP.set_activation` (setattr)"),
    ("        self.register_forward_pre_hook(lambda m, i: setattr(self, 'act', nn.GELU()))\n", "changed in `MLP.__init__.<lambda>`"),
    ("\n    def drop(self):\n        del self.act\n", "changed in `MLP.drop` (deleted)"),
], ids=["setattr", "hook_in_init", "del"])
def test_swiglu_activation_changed_outside_init_is_a_near_miss(extra: str, said: str) -> None:
    findings, misses = detect_all(Swiglu(), _MLP.format(extra=extra))
    assert not findings and any(said in m.reason for m in misses), [m.reason for m in misses]


def test_moe_bound_set_by_setattr_in_another_method_gets_the_run_time_id_mask() -> None:
    code = _moe_code(methods="\n    def shrink(self):\n        setattr(self, 'n', self.n - 1)\n")
    findings, misses = detect_all(MoeExperts(), code)
    assert findings and "_npufuse_named" in findings[0].fused, [m.reason for m in misses]


_HELD_NORM = '''
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.rmsnorm_fn = self.compute_rmsnorm
EXTRA
    @staticmethod
    def compute_rmsnorm(x, weight, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def forward(self, x):
        return self.rmsnorm_fn(x, self.weight, self.eps)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.norm2 = RMSNorm(d)
        self.ffn = nn.Linear(d, d)

    def forward(self, x):
        x = x + self.attn(x)
        x = x + self.ffn(self.norm2(x))
        return x
'''


@pytest.mark.parametrize("extra, fused", [
    ("", True),
    ("    def use_plain(self):\n        self.rmsnorm_fn = lambda x, w, e: x * w\n", False),
    ("    def use_plain(self, f):\n        setattr(self, 'rmsnorm_fn', f)\n", False),
    ("        def hook(*a):\n            self.rmsnorm_fn = lambda x, w, e: x * w\n        self.register_forward_pre_hook(hook)\n", False),
], ids=["held", "stored_in_a_method", "setattr_in_a_method", "hook_in_init"])
def test_method_held_by_an_attribute_changed_later_is_not_read(extra: str, fused: bool) -> None:
    findings, misses = detect_all(AddRmsNorm(), _HELD_NORM.replace("EXTRA", extra))
    assert bool(findings) == fused, [m.reason for m in misses]


# -- 6. eps placed otherwise than the op: the instance's eps, not the class default the probe measured ------------------


@pytest.mark.parametrize("eps, fused", [("0.5", False), ("1e-9", True)], ids=["large_instance_eps_runs_original", "small_eps_fused"])
def test_add_into_a_norm_with_eps_outside_the_root_tests_the_instance_eps(eps: str, fused: bool) -> None:
    code = _EPS_OUTSIDE.replace("self.norm2 = RMSNorm(d)", f"self.norm2 = RMSNorm(d, eps={eps})")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert [f.qualname for f in findings] == ["Block.forward"], [m.reason for m in misses]
    assert "(self.norm2.eps) ** 2 <= " in findings[0].fused, findings[0].fused
    run = _BLOCK_RUN.replace("infer = m(torch.randn(2, 5, 16))", "infer = m(torch.randn(2, 5, 16) * 0.3)")
    facts = check_rewrite_runs(AddRmsNorm(), code, run, findings)
    assert bool(facts["all_calls"].get("npu_add_rms_norm")) == fused, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.99999, facts


def test_probed_rms_norm_with_eps_outside_the_root_tests_the_instance_eps() -> None:
    code = _EPS_OUTSIDE.split("\n\nclass Block")[0] + "\n"
    findings, misses = detect_all(RmsNorm(), code)
    assert findings and "(self.eps) ** 2 <= " in findings[0].fused.splitlines()[0], [m.reason for m in misses]
    run = "m = RMSNorm(16, eps=0.5)\nx = torch.randn(3, 16, requires_grad=True) * 0.3\nout = m(x)\nleaves = []\n"
    facts = check_rewrite_runs(RmsNorm(), code, run, findings)
    assert not facts["calls"] and min(facts["cos_out"]) > 0.99999, facts


@pytest.mark.parametrize("skip", ["if mask is not None and j_start > i_end:", "if mask is not None and i_end <= j_start:"],
                         ids=["strictly_after", "reversed"])
def test_tiled_loop_skipping_later_blocks_otherwise_spelled_fuses(skip: str) -> None:
    # `j > i_end` skips a subset of the later blocks (the run-time check that the mask masks every later key covers
    # both); it is no windowed attention, which the near miss used to say
    code = _tiled(("if mask is not None and j_start >= i_end:", skip))
    findings, misses = detect_all(AttentionPattern(), code)
    assert [f.variant for f in findings] == ["tiled_online_softmax+additive_float"], [m.reason for m in misses]
    for mask in (_CAUSAL, "mask = torch.zeros(1, 1, 9, 9)"):
        facts = check_rewrite_runs(AttentionPattern(), code, _TILED_RUN.format(mask=mask), findings)
        assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999, facts
