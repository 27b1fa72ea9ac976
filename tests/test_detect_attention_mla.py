"""Issue 14 class 3 for attention: MLA scores written as a sum of two products (canonical.summed_product)."""

from __future__ import annotations

import ast

from npufuse.patterns.attention import AttentionPattern
from npufuse.scan.canonical import Product, summed_product
from pattern_harness import check_rewrite_runs, detect_all

PATTERN = AttentionPattern()


def _example(name: str):
    return next(ex for ex in PATTERN.FUSE + PATTERN.KEEP if ex.name == name)


def _mm(src: str) -> Product:
    node = ast.parse(src, mode="eval").body
    assert isinstance(node, ast.BinOp)
    return Product(node.left, node.right, "@")


def test_summed_product_concatenates_features_and_states_its_condition() -> None:
    out = summed_product(_mm("a1 @ b1.mT"), _mm("a2 @ b2.transpose(-1, -2)"))
    assert out is not None
    prod, guard = out
    assert ast.unparse(prod.a) == "torch.cat([a1, a2], dim=-1)"
    # s40: keys that are names are expanded over a head axis one of them may have once (a shared rope key)
    assert ast.unparse(prod.b) == ("torch.cat([b1.expand(*torch.broadcast_shapes(b1.shape[:-1], b2.shape[:-1]), -1), "
                                   "b2.expand(*torch.broadcast_shapes(b1.shape[:-1], b2.shape[:-1]), -1)], dim=-1).mT")
    assert ast.unparse(guard) == ("a1.shape[:-1] == a2.shape[:-1] and b1.dim() == b2.dim() >= 3 and (b1.shape[:-3] == b2.shape[:-3]) "
                                  "and (b1.shape[-2] == b2.shape[-2]) and (b1.shape[-3] == b2.shape[-3] or b1.shape[-3] == 1 or b2.shape[-3] == 1)")
    prod, guard = summed_product(_mm("a1 @ b1.mT"), _mm("a2 @ b2.unsqueeze(1).mT"))  # a key that is a call: not read twice
    assert ast.unparse(prod.b) == "torch.cat([b1, b2.unsqueeze(1)], dim=-1).mT"
    assert ast.unparse(guard) == "a1.shape[:-1] == a2.shape[:-1] and b1.shape[:-1] == b2.unsqueeze(1).shape[:-1]"
    # a key that is not a visible transpose, or a scaled product: not one product
    assert summed_product(_mm("a1 @ b1.mT"), _mm("a2 @ b2")) is None
    assert summed_product(_mm("a1 @ b1.mT"), None) is None


def test_mla_summed_products_match_under_emulator() -> None:
    ex = _example("mla_summed_products_shared_value")
    findings, misses = detect_all(PATTERN, ex.code)
    assert findings, [m.reason for m in misses]
    first = findings[0].fused.splitlines()[0]
    # both run-time conditions guard the fused call; the one-head check reads each part's size
    assert "q_pe.shape[:-1] == q_nope.shape[:-1]" in first and "k_pe.shape[1] == 1 and compressed_kv.unsqueeze(-3).shape[1] == 1" in first
    assert "compressed_kv.unsqueeze(1)" in findings[0].fused
    facts = check_rewrite_runs(PATTERN, ex.code, ex.run, findings)
    # three calls, the last with a 4-head key: the original code runs there
    assert facts["calls"] == 2
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_sum_with_an_untransposed_key_stays_a_near_miss() -> None:
    findings, misses = detect_all(PATTERN, _example("summed_products_key_not_transposed").code)
    assert not findings
    assert any("scores added to scores" in m.reason for m in misses)
