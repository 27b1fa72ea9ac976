"""s28 attention pass: einsum layouts as permutations, float biases as pse, opt_einsum's contract."""

from __future__ import annotations

import ast

from npufuse.patterns.attention import AttentionPattern
from npufuse.scan.canonical import product
from npufuse.patterns.base import Fuse
from pattern_harness import check_replacement_matches, detect_all


def _callee(table: dict[str, str]):
    def name(call: ast.Call) -> str | None:
        f = call.func
        if isinstance(f, ast.Name):
            return table.get(f.id)
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            return table.get(f"{f.value.id}.{f.attr}")
        return None
    return name


def test_opt_einsum_contract_is_an_einsum_product() -> None:
    call = ast.parse("einsum('bqhd,bkhd->bhqk', q, k)", mode="eval").body
    prod = product(call, _callee({"einsum": "opt_einsum.contract"}))
    assert prod is not None and prod.kind == "einsum" and prod.subs is not None
    assert (prod.subs.a, prod.subs.b, prod.subs.out) == ("bqhd", "bkhd", "bhqk")
    # another library's function of the same name is not an einsum
    assert product(call, _callee({"einsum": "mylib.einsum"})) is None


_OPT_EINSUM = '''
import torch
import torch.nn.functional as F
from opt_einsum import contract as einsum


def attend(query, key, value, scaling):
    query = query * scaling
    attn = einsum("bqhd,bkhd->bhqk", query, key)
    attn = F.softmax(attn, dim=-1)
    return einsum("bhqk,bkhd->bqhd", attn, value)
'''


def test_attention_written_with_opt_einsum_is_found() -> None:
    findings, _ = detect_all(AttentionPattern(), _OPT_EINSUM)
    assert [f.qualname for f in findings] == ["attend"]
    assert findings[0].params["layout"] == "BSND"


def test_heads_as_queries_against_one_shared_kv_head_is_permuted() -> None:
    # global column attention: per-head pooled queries [b, i, h, d] against keys [b, k, i, d] with no head
    # axis: per (b, i) it is softmax(QKᵀ)V with the heads as the query rows
    code = '''
import torch


def global_attend(query, key, value):
    attn = torch.einsum("bihd,bkid->bihk", query, key)
    attn = torch.softmax(attn, dim=-1)
    return torch.einsum("bihk,bkid->bihd", attn, value)
'''
    findings, _ = detect_all(AttentionPattern(), code)
    assert len(findings) == 1
    run = """
q = torch.randn(2, 5, 4, 8, requires_grad=True)
k, v = torch.randn(2, 3, 5, 8, requires_grad=True), torch.randn(2, 3, 5, 8, requires_grad=True)
out = global_attend(q, k, v)
leaves = [q, k, v]
"""
    check_replacement_matches(AttentionPattern(), Fuse(code, run=run))


def test_opt_einsum_attention_replacement_matches(monkeypatch) -> None:
    # opt_einsum is not a dependency: a stand-in whose contract is torch.einsum (what opt_einsum's torch
    # backend computes for this equation) lets the rewrite run; the check is of the rewrite, not of opt_einsum
    import sys
    import types

    import torch

    fake = types.ModuleType("opt_einsum")
    fake.contract = torch.einsum  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "opt_einsum", fake)
    run = """
q, k, v = (torch.randn(2, 5, 2, 8, requires_grad=True) for _ in range(3))
out = attend(q, k, v, 8 ** -0.5)
leaves = [q, k, v]
"""
    check_replacement_matches(AttentionPattern(), Fuse(_OPT_EINSUM, run=run))


def test_bias_before_and_after_the_scale() -> None:
    # the bias added before ``/ sqrt(d)`` is divided too; the one added after is not
    code = '''
import math
import torch


def attend(q, k, v, early, late):
    s = torch.matmul(q, k.transpose(-2, -1))
    s = s + early.float()
    s = s / math.sqrt(q.shape[-1])
    s = s + late.float()
    return torch.matmul(torch.softmax(s, dim=-1), v)
'''
    findings, misses = detect_all(AttentionPattern(), code)
    # early/late are parameters: their values are checked at run time as masks (no graded evidence) -- the pse
    # path takes only terms proven to be biases, so nothing here becomes pse
    assert all("pse" not in f.params for f in findings), [f.params for f in findings]


def test_pse_replacement_does_not_depend_on_where_the_op_applies_its_scale(monkeypatch) -> None:
    # spec §5.1 leaves pse's scale placement UNCERTAIN: the emulator adds pse before the scale by default;
    # forced to add it after, the rewritten examples (a bias after the scale and one before it) still match
    import npufuse.emulate.attention as emulated

    real = emulated._attend

    def after_scale(*args, **kwargs):
        kwargs["pse_before_scale"] = False
        return real(*args, **kwargs)

    monkeypatch.setattr(emulated, "_attend", after_scale)
    for name in ("s28_relative_position_bias_as_pse", "s28_bias_added_before_the_scale_is_scaled_in_pse"):
        example = next(f for f in AttentionPattern.FUSE if f.name == name)
        check_replacement_matches(AttentionPattern(), example)


_FOLDED_HEADS_RPE = '''
import torch
from torch import nn


class Attn(nn.Module):
    def __init__(self, heads=2, use_rpe=False):
        super().__init__()
        self.np, self.use_rpe = heads, use_rpe
        self.rpe = nn.Linear(1, heads)

    def forward(self, q, k, v):
        b, sq, sk = q.shape[0] // self.np, q.shape[1], k.shape[1]
        scores = torch.bmm(q, k.transpose(1, 2)) * 0.125
        scores = scores.view(b, self.np, sq, sk)
        if self.use_rpe:
            scores = scores + self.rpe(torch.ones(sq, sk, 1)).permute(2, 0, 1)
        probs = torch.softmax(scores, dim=-1)
        probs = probs.view(b * self.np, sq, sk)
        return torch.bmm(probs, v)
'''


def test_module_bias_on_folded_heads_keeps_the_flag_exclusion() -> None:
    # Megatron's [b*np, sq, sk] scores viewed 4-D: no pse is built there, so a module's term under a flag keeps
    # the earlier reading (the fused call runs where the flag is off) instead of becoming a near miss
    findings, misses = detect_all(AttentionPattern(), _FOLDED_HEADS_RPE)
    assert len(findings) == 1, [m.reason for m in misses]
    assert "pse" not in findings[0].params
    assert "self.use_rpe" in findings[0].fused
