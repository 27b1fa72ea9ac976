"""Issue 14, class 3: attention read whatever its spelling (canonical products), and an additive
float term told apart from a 0/-inf mask by its dataflow, never by its name.

The pattern's own Fuse/Keep examples (tests/test_patterns.py, tests/test_apply_patterns.py) carry the
end-to-end checks of each new form; this file holds the canonical layer's unit behaviour and the
decisions that need more than one example to show (renaming changes nothing; a graded float passed
under any name never reaches the fused call).
"""

from __future__ import annotations

import ast

import pytest
import torch

from npufuse import emulate
from npufuse.patterns.registry import get_pattern
from npufuse.rewrite.codegen import splice
from npufuse.scan.canonical import contraction, einops_permutation, einsum_subscripts, product, swaps_last_two
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import _exec, detect_all

ATTENTION = get_pattern("attention")


def _expr(text: str) -> ast.expr:
    return ast.parse(text, mode="eval").body


# -- canonical layer: products ------------------------------------------------------------------


@pytest.mark.parametrize("spec,want", [
    ('"bhid,bhjd->bhij"', ("bhid", "bhjd", "bhij")),
    ('"b h i d, b j d -> b h i j"', ("bhid", "bjd", "bhij")),
    ('f"b h i d, b h j d -> b h i j"', ("bhid", "bhjd", "bhij")),
    ('"...id,...jd->...ij"', ("BHid", "BHjd", "BHij")),
])
def test_einsum_subscripts_read_literal_and_fstring_equations(spec, want):
    assert einsum_subscripts(_expr(spec)) == want


@pytest.mark.parametrize("spec", ['f"b {h} i d, b j d -> b h i j"', '"bhid,bhjd"', '"ii,ij->ij"', '"a,b,c->abc"', "spec"])
def test_einsum_subscripts_refuse_what_is_not_a_two_operand_product(spec):
    assert einsum_subscripts(_expr(spec)) is None


def test_contraction_names_each_letter_role():
    c = contraction(("bhid", "bjd", "bhij"))
    assert (c.batch, c.a_free, c.b_free, c.summed) == ("b", "hi", "j", "d")
    assert contraction(("bhid", "bhjd", "bhi")) is None  # j summed over one operand only: a reduction


def _product(code: str, imports: str = "import torch"):
    module = ModuleInfo.from_source("x.py", imports + "\n" + code + "\n")
    node = module.tree.body[-1].value
    return product(node, module.call_name)


def test_product_reads_every_spelling_as_a_and_b():
    assert _product("q @ k").kind == "@"
    assert _product("torch.matmul(q, k)").kind == "matmul"
    assert _product("q.bmm(k)").kind == "bmm"
    p = _product('th.einsum("bhid,bhjd->bhij", [q, k])', "import torch as th")
    assert p.kind == "einsum" and ast.unparse(p.a) == "q" and p.subs.summed == "d"
    p = _product('einsum("bnd,bmd->bnm", q, k)', "from torch import einsum")
    assert p.kind == "einsum" and p.subs.out == "bnm"


def test_baddbmm_is_a_product_only_when_beta_is_zero():
    p = _product("torch.baddbmm(buf, q, k.transpose(1, 2), beta=0.0, alpha=1.0 / norm)")
    assert p.kind == "baddbmm" and ast.unparse(p.alpha) == "1.0 / norm" and ast.unparse(p.a) == "q"
    assert _product("buf.baddbmm(q, k, beta=0, alpha=0.5)").kind == "baddbmm"
    assert _product("torch.baddbmm(bias, q, k, alpha=0.5)") is None  # beta=1: the bias is added


def test_einops_permutation_reads_pure_reorders_only():
    assert einops_permutation(_expr('"b i j -> b j i"')) == (0, 2, 1)
    assert swaps_last_two(einops_permutation(_expr('"b h i j -> b h j i"')))
    assert not swaps_last_two(einops_permutation(_expr('"b h i j -> h b i j"')))
    assert einops_permutation(_expr('"b c h w -> b (h w) c"')) is None


# -- the decisions -------------------------------------------------------------------------------

BUILT = '''
import torch


def attend(q, k, v):
    s = q.shape[-2]
    NAME = BUILD
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    scores = scores + NAME
    return torch.matmul(torch.softmax(scores, dim=-1), v)
'''

ALIBI = "torch.arange(s)[None, :] - torch.arange(s)[:, None]"
CAUSAL = 'torch.full((s, s), float("-inf")).triu(1)'


@pytest.mark.parametrize("name", ["mask", "attn_bias", "position_bias", "m"])
def test_a_term_built_from_positions_is_a_bias_whatever_its_name(name):
    findings, misses = detect_all(ATTENTION, BUILT.replace("NAME", name).replace("BUILD", ALIBI))
    # s28: a bias is passed as pse (q pre-scaled, scale 1.0), never binarised as a mask
    assert findings and findings[0].params["mask_kind"] == "pse" and findings[0].params["pse"] == name
    assert "< 0" not in findings[0].fused and "atten_mask" not in findings[0].fused


@pytest.mark.parametrize("name", ["mask", "attn_bias", "position_bias", "m"])
def test_a_term_filled_with_minus_inf_is_a_mask_whatever_its_name(name):
    findings, _ = detect_all(ATTENTION, BUILT.replace("NAME", name).replace("BUILD", CAUSAL))
    assert findings and findings[0].params["mask_values_checked"] is False


def test_positions_compared_make_a_mask_not_a_bias():
    build = f'torch.where(torch.arange(s)[None, :] > torch.arange(s)[:, None], float("-inf"), 0.0)'
    findings, _ = detect_all(ATTENTION, BUILT.replace("NAME", "bias").replace("BUILD", build))
    assert findings


PARAM = '''
import torch


def attend(q, k, v, NAME):
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    scores = scores + NAME
    return torch.matmul(torch.softmax(scores, dim=-1), v)
'''


def _alibi(heads: int, s: int) -> torch.Tensor:
    slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)])
    return (slopes[:, None, None] * (torch.arange(s)[None, :] - torch.arange(s)[:, None]).clamp(max=0).float())[None]


@pytest.mark.parametrize("name", ["alibi", "mask"])
def test_a_parameter_of_unknown_values_is_checked_at_run_time_under_any_name(name):
    code = PARAM.replace("NAME", name)
    findings, _ = detect_all(ATTENTION, code)
    assert findings and findings[0].params["mask_values_checked"] is True
    q, k, v = (torch.randn(2, 4, 6, 16) for _ in range(3))
    for bias, fused in ((_alibi(4, 6), False), (torch.full((6, 6), float("-inf")).triu(1), True)):
        ref = _exec(code, "original")["attend"](q, k, v, bias)
        with emulate.install() as emu:
            out = _exec(splice(code, findings), "rewritten")["attend"](q, k, v, bias)
        assert (sum(emu.calls.values()) > 0) is fused  # graded values never reach `mask < 0`
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_a_caller_building_the_bias_from_positions_makes_a_near_miss():
    code = PARAM.replace("NAME", "mask") + '''

def block(q, k, v):
    s = q.shape[-2]
    return attend(q, k, v, torch.arange(s)[None, :] * 0.5)
'''
    findings, misses = detect_all(ATTENTION, code)
    assert not findings and any("a caller (`block`" in m.reason and "token positions" in m.reason for m in misses)


BRANCHES = '''
import torch
import torch.nn.functional as F


def attend(q, k, v, mask=None):
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    return torch.matmul(F.softmax(scores, dim=-1), v)
'''


def test_bool_or_float_branches_a_graded_float_runs_the_original():
    findings, _ = detect_all(ATTENTION, BRANCHES)
    assert findings
    q, k, v = (torch.randn(2, 4, 6, 16) for _ in range(3))
    for mask, fused in ((_alibi(4, 6), False), (torch.ones(6, 6, dtype=torch.bool).tril(), True), (None, True)):
        ref = _exec(BRANCHES, "original")["attend"](q, k, v, mask)
        with emulate.install() as emu:
            out = _exec(splice(BRANCHES, findings), "rewritten")["attend"](q, k, v, mask)
        assert (sum(emu.calls.values()) > 0) is fused
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


SOFTCAP = '''
import torch


class Attn(torch.nn.Module):
    def __init__(self, cap=None):
        super().__init__()
        self.cap = cap

    def forward(self, q, k, v):
        s = torch.einsum("bhid,bhjd->bhij", q, k) * 0.25
        if self.cap is not None:
            s = torch.tanh(s / self.cap) * self.cap
        return torch.einsum("bhij,bhjd->bhid", s.softmax(dim=-1), v)
'''


def test_optional_softcap_runs_fused_only_without_the_cap():
    findings, _ = detect_all(ATTENTION, SOFTCAP)
    assert findings and any("soft-capped" in r.detail for r in findings[0].risks)
    q, k, v = (torch.randn(2, 4, 6, 16) for _ in range(3))
    for cap, fused in ((None, True), (5.0, False)):
        ref = _exec(SOFTCAP, "original")["Attn"](cap)(q, k, v)
        with emulate.install() as emu:
            out = _exec(splice(SOFTCAP, findings), "rewritten")["Attn"](cap)(q, k, v)
        assert (sum(emu.calls.values()) > 0) is fused
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_softcap_inside_a_mask_branch_stays_a_near_miss():
    code = SOFTCAP.replace("        if self.cap is not None:\n            s = torch.tanh(s / self.cap) * self.cap\n",
                           "        if self.cap is not None:\n            s = torch.tanh(s / self.cap) * self.cap\n"
                           "        else:\n            s = s.clamp(min=-30.0)\n")
    findings, misses = detect_all(ATTENTION, code)
    assert not findings and misses


def test_rearranged_probabilities_are_read_as_a_transpose():
    code = '''
import torch
from einops import rearrange


def spatial(q, k, v, c):
    w_ = torch.einsum("bij,bjk->bik", q, k) * (int(c) ** (-0.5))
    w_ = torch.nn.functional.softmax(w_, dim=2)
    w_ = rearrange(w_, "b i j -> b j i")
    return torch.einsum("bij,bjk->bik", v, w_)
'''
    findings, _ = detect_all(ATTENTION, code)
    assert findings and findings[0].params["output_layout"] == "3D"
    assert ".squeeze(1).transpose(1, 2)" in findings[0].fused  # the result is [B, C, HW] like the original's
    # the same without the transpose is not attention over the keys: no candidate
    findings, _ = detect_all(ATTENTION, code.replace('    w_ = rearrange(w_, "b i j -> b j i")\n', ""))
    assert not findings


MODULES = '''
import torch
from torch import nn


class RelPosBias(nn.Module):
    def __init__(self, heads=4, buckets=32):
        super().__init__()
        self.table = nn.Embedding(buckets, heads)

    def forward(self, n):
        pos = torch.arange(n)
        return self.table((pos[None, :] - pos[:, None]).clamp(0, 31)).permute(2, 0, 1)


def causal_mask(n):
    i = torch.arange(n)
    return torch.where(i[None, :] > i[:, None], float("-inf"), 0.0)


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.rel_pos = RelPosBias()

    def biased(self, q, k, v):
        sim = q @ k.transpose(-2, -1) * 0.125
        sim = sim + self.rel_pos(q.shape[-2])
        return sim.softmax(dim=-1) @ v

    def masked(self, q, k, v):
        sim = q @ k.transpose(-2, -1) * 0.125
        sim = sim + causal_mask(q.shape[-2])
        return sim.softmax(dim=-1) @ v
'''


def test_a_module_or_helper_of_the_file_tells_bias_from_mask_by_what_it_builds():
    findings, misses = detect_all(ATTENTION, MODULES)
    kinds = {f.qualname: f.params["mask_kind"] for f in findings}
    assert kinds["Attn.masked"] != "pse"  # positions compared and filled with -inf: a mask
    assert kinds["Attn.biased"] == "pse"  # s28: graded values from the module: a bias, passed as pse


def test_a_bias_with_a_causal_fill_is_still_a_bias():
    # ALiBi with the causal positions filled with -inf: graded values plus -inf, never a 0/-inf mask
    build = 'torch.arange(s)[None, :].float().masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))'
    findings, misses = detect_all(ATTENTION, BUILT.replace("NAME", "mask").replace("BUILD", build))
    # s28: the whole term (graded values and -inf) is the pse; never binarised with `< 0`
    assert findings and findings[0].params["mask_kind"] == "pse" and "< 0" not in findings[0].fused


# -- canonical layer: einsum equations with a conditional placeholder ------------------------------


def _variants(code: str):
    from npufuse.scan.canonical import equation_variants

    tree = ast.parse(code)
    assign = tree.body[0]
    spec = tree.body[1].value.args[0]
    return equation_variants(spec, lambda e: assign.value if isinstance(e, ast.Name) and e.id == assign.targets[0].id else None)


def test_equation_variants_read_both_values_of_a_conditional_placeholder():
    got = _variants("kv = 'b j d' if k.ndim == 3 else 'b h j d'\neinsum(f'b h i d, {kv} -> b h i j', q, k)")
    assert [(v.equation.replace(" ", ""), v.when_true) for v in got] == [("bhid,bjd->bhij", True), ("bhid,bhjd->bhij", False)]
    assert all(ast.unparse(v.test) == "k.ndim == 3" for v in got)
    assert got[0].subs.batch == "b" and got[1].subs.batch == "bh"


@pytest.mark.parametrize("code", [
    "kv = 'b j d' if c else 'b h j j'\neinsum(f'b h i d, {kv} -> b h i j', q, k)",  # one value is not a product
    "kv = 'b j d' if c else x\neinsum(f'b h i d, {kv} -> b h i j', q, k)",  # one value is not a constant
    "kv = 'b h j d'\neinsum(f'b h i d, {kv} -> b h i j', q, k)",  # not a conditional
    "kv = 'b j d' if c else 'b h j d'\neinsum(f'b h i d, {kv!r} -> b h i j', q, k)",  # a conversion
    "kv = 'b j d' if c else 'b h j d'\neinsum(f'b h i d, {other} -> b h i j', q, k)",  # an unknown placeholder
])
def test_equation_variants_refuse_anything_else(code):
    assert _variants(code) is None


def test_placeholder_reassigned_between_its_condition_and_the_site_is_not_read():
    code = '''
import torch
from torch import einsum


def attend(q, k, v):
    kv_eq = 'b j d' if k.ndim == 3 else 'b h j d'
    k = k.flatten(1, 2)
    sim = einsum(f"b h i d, {kv_eq} -> b h i j", q, k) * 0.25
    attn = sim.softmax(dim=-1)
    return einsum(f"b h i j, {kv_eq} -> b h i d", attn, v)
'''
    findings, misses = detect_all(ATTENTION, code)
    assert not findings
    assert any("does not parse" in m.reason for m in misses)


def test_softmax_module_attribute_is_found_only_when_the_class_builds_one():
    base = '''
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, scale=0.25):
        super().__init__()
        self.scale = scale
        self.attend = CTOR

    def forward(self, q, k, v):
        dots = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        return torch.matmul(self.attend(dots), v)
'''
    findings, _ = detect_all(ATTENTION, base.replace("CTOR", "nn.Softmax(dim=-1)"))
    assert [f.qualname for f in findings] == ["Attention.forward"]
    assert detect_all(ATTENTION, base.replace("CTOR", "nn.Identity()")) == ([], [])
