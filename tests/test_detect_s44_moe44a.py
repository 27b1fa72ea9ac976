"""s44 moe44a: moe_experts skip guards that count an expert's rows in other spellings (`s44a_*` examples,
patterns/_moe_s44a.py): `counts[i] > 0` around the body with counts from bincount of the dispatched indices,
`0 < n`, `n >= 1`, `n < 1`, bare `if n:` / `not n`; near misses: other thresholds, another expert's count,
counts of another tensor, weighted counts."""

from __future__ import annotations

import ast

import pytest

from npufuse.patterns import _moe_s44a as s44a
from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import check_fuse_found, check_keep_refused, example_cases

PATTERN = MoeExperts()


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s44a_", kind="fuse"))
def test_s44a_fuse_example_is_found(pattern, example):
    check_fuse_found(pattern, example)


@pytest.mark.parametrize("pattern,example", example_cases(PATTERN, "s44a_", kind="keep"))
def test_s44a_keep_example_is_refused_with_its_reason(pattern, example):
    check_keep_refused(pattern, example)


def _strip(node: ast.expr) -> ast.expr:
    # int(c) keeps whether c is zero
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "int" and len(node.args) == 1:
        return node.args[0]
    return node


@pytest.mark.parametrize("text,nonempty,count", [
    ("c.x > 0", True, "c.x"), ("c.x != 0", True, "c.x"), ("c.x >= 1", True, "c.x"), ("0 < c.x", True, "c.x"),
    ("1 <= c.x", True, "c.x"), ("c.x", True, "c.x"), ("int(c.x) > 0", True, "c.x"),
    ("c.x == 0", False, "c.x"), ("c.x <= 0", False, "c.x"), ("c.x < 1", False, "c.x"), ("0 == c.x", False, "c.x"),
    ("not c.x", False, "c.x"), ("not c.x > 0", False, "c.x"), ("not c.x == 0", True, "c.x"),
])
def test_s44a_emptiness_normal_form(text, nonempty, count):
    test = ast.parse(text, mode="eval").body
    found = s44a.emptiness(test, _strip)
    assert found is not None and found[0] is nonempty and ast.unparse(found[1]) == count


@pytest.mark.parametrize("text", ["n.x > 1", "n.x >= 0", "n.x < 2", "n.x == 1", "n.x > 0 and m.x > 0", "flag", "True",
                                  "n.x > m.x", "0 < n.x < 5", "n.x is None"])
def test_s44a_emptiness_refuses_other_tests(text):
    assert s44a.emptiness(ast.parse(text, mode="eval").body, _strip) is None


@pytest.mark.parametrize("name,replayed", [("s44a_shape_asserts_in_the_expert_loop", False),
                                           ("s44a_type_and_size_asserts_in_the_expert_loop", False),
                                           ("s44a_value_assert_replayed_after_the_fused_layer", True)])
def test_s44a_metadata_asserts_need_no_replay_loop(name, replayed):
    # a shape check is dropped from the fused text; a value check is replayed after it (the s43b side loop, which
    # re-runs the loop's torch.where per expert: host syncs the shape checks no longer cost)
    from pattern_harness import only_finding
    finding = only_finding(PATTERN, name)
    assert ("for e in range(self.n):" in finding.fused) is replayed


@pytest.mark.parametrize("text,metadata", [
    ("assert m.shape == (B, T, self.k), f'{m.shape}'", True), ("assert rows.dim() == 1 and len(rows) == len(s)", True),
    ("assert isinstance(r, torch.Tensor)", True), ("assert r.numel() == s.size(0)", True), ("assert x.shape[-1] % 2 == 0", True),
    ("assert (w > 0).all()", False), ("assert torch.isfinite(y).all()", False), ("assert (n := len(r)) > 0", False),
    ("assert r.size(dim=0) > 0", False), ("assert f(r)", False), ("x = 1", False),
])
def test_s44a_metadata_assert(text, metadata):
    assert s44a.metadata_assert(ast.parse(text).body[0]) is metadata


def test_s44a_handed_in_offsets_run_only_where_the_table_starts_at_zero():
    # the loop never writes rows before T[0] nor reads past the rows: the grouped matmul runs only where T[0] == 0,
    # T[-1] <= rows and the runs never shrink (the emulator run's third call, T[0] == 2, takes the loop as written)
    from pattern_harness import only_finding
    finding = only_finding(PATTERN, "s44a_handed_in_offsets_linear_with_optional_bias")
    assert "int(expert_offset[0]) == 0" in finding.fused and "int(expert_offset[-1]) <= X_flat.shape[0]" in finding.fused
    assert "(_npufuse_counts >= 0).all()" in finding.fused
    assert "torch.repeat_interleave(B.to(X_flat.dtype), _npufuse_counts, dim=0, output_size=_npufuse_m) if B is not None else 0" \
        in finding.fused
    assert finding.params["routing"] == "prefix_offsets"


def test_s44a_group_bias_forms():
    def bias(text: str):
        node = ast.parse(text, mode="eval").body
        found = s44a.group_bias(node, lambda n: isinstance(n, ast.Name) and n.id == "g",
                                lambda n: "g" not in {m.id for m in ast.walk(n) if isinstance(m, ast.Name)})
        return None if found is None else (ast.unparse(found[0]), found[1] and ast.unparse(found[1]))
    assert bias("B[g]") == ("B", None)
    assert bias("self.b[g] if self.b is not None else None") == ("self.b", "self.b is not None")
    assert bias("None if B is None else B[g]") == ("B", "not B is None")
    assert bias("B[0]") is None and bias("B[g] if g > 0 else None") is None and bias("B[g] if f else B[0]") is None


@pytest.mark.parametrize("test,found", [("tok.shape[0]", True), ("0 < len(tok)", True), ("tok[0]", False),
                                        ("tok[0] > 0", False), ("tok.sum()", False), ("slot.max()", False),
                                        ("flat[tok].sum()", False)])
def test_s44a_guard_around_the_body_is_read_only_as_a_row_count(test, found):
    # a bare value is truthy when non-zero: only a size of the expert's rows says "this expert has rows"
    # (the first selected token index, or the sum of the indices, is 0 whenever token 0 is among them)
    from pattern_harness import detect_all
    code = s44a.MASK_GUARD.replace("            if len(tok) < 1:\n                continue\n", f"            if {test}:\n") \
        .replace("            out[tok] += self.experts[e]", "                out[tok] += self.experts[e]")
    findings, misses = detect_all(PATTERN, code)
    assert bool(findings) is found and bool(misses) is not found
