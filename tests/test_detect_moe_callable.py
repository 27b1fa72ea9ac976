"""moe_experts, fourth pass (issue 14 class 4): experts reached through a callable given the expert index,
rows handed over with a leading 1, and dispatch loops in files that never say "expert"."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from pattern_harness import check_rewrite_runs, detect_all  # noqa: E402

from npufuse.patterns import moe_experts as M  # noqa: E402
from npufuse.scan.dataflow import ModuleInfo  # noqa: E402


def _one(code: str):
    findings, misses = detect_all(M.MoeExperts(), code)
    assert len(findings) == 1, [m.reason for m in misses]
    return findings[0]


def test_keyword_index_and_kwargs_are_replayed_per_expert():
    f = _one(M._INDEX_FUNCTION_KW)
    # one callable per expert, index bound early, the caller's **kw passed on as in the loop
    assert "ffn_apply(self, _npufuse_r, expert_id=_npufuse_e, **kw)" in f.fused
    assert "for _npufuse_i in range(self.num_local)" in f.fused
    res = check_rewrite_runs(M.MoeExperts(), M._INDEX_FUNCTION_KW, M._INDEX_FUNCTION_KW_RUN, [f])
    assert res["all_calls"].get("npu_moe_token_permute") == 1
    assert min(res["cos_out"]) > 0.9999


def test_kwargs_reach_the_callable_in_the_rewrite():
    # scale=0 through **kw must give zeros from the fused path too (the kwargs are not dropped)
    run = M._INDEX_FUNCTION_KW_RUN.replace("scale=0.5", "scale=0.0")
    res = check_rewrite_runs(M.MoeExperts(), M._INDEX_FUNCTION_KW, run, [_one(M._INDEX_FUNCTION_KW)])
    assert res["all_calls"].get("npu_moe_token_unpermute") == 1
    assert min(res["cos_out"]) > 0.9999  # both all zero (a dropped **kw would leave the fused output non-zero)


def test_callee_read_in_this_file_is_named_and_an_unreadable_hook_is_a_risk():
    resolved = _one(M._INDEX_METHOD)
    assert any("method StackedMoE.run_one" in n and "no random draws" in n for n in resolved.notes)
    assert not any("not defined in this file" in r.detail for r in resolved.risks)
    hook = _one(M._INDEX_HOOK)
    assert any("not defined in this file" in r.detail for r in hook.risks)
    assert "run(rows=_npufuse_r, e=_npufuse_e)" in hook.fused


def test_callee_with_random_draws_is_a_numerics_risk():
    code = M._INDEX_METHOD.replace("return F.gelu(rows @ self.w_in[e]) @ self.w_out[e]",
                                   "return F.dropout(F.gelu(rows @ self.w_in[e]), 0.1, self.training) @ self.w_out[e]")
    f = _one(code)
    assert any(r.kind == "numerics" and "F.dropout" in r.detail for r in f.risks)


def test_index_in_a_varying_expression_is_not_the_callable_form():
    # the rows are those of expert e but the callable gets e + 1: not this expert's index
    code = M._INDEX_METHOD.replace("y = self.run_one(e, x[tok])", "y = self.run_one(e + 1, x[tok])")
    findings, misses = detect_all(M.MoeExperts(), code)
    assert not findings
    assert misses and "not recognised" in misses[0].reason


def test_leading_one_rows_are_given_to_the_expert_as_in_the_loop():
    f = _one(M._LEAD_ROWS)
    assert "_npufuse_rows_e.unsqueeze(0)" in f.fused
    # an expert that sees the leading dim (a sum over dim 0 is the identity only on [1, n, H])
    code = M._LEAD_ROWS.replace("return self.b(F.relu(self.a(x)))", "return self.b(F.relu(self.a(x))).sum(0, keepdim=True)")
    res = check_rewrite_runs(M.MoeExperts(), code, M._LEAD_ROWS_RUN, [_one(code)])
    assert min(res["cos_out"]) > 0.9999


def test_experts_without_rows_are_not_called():
    # an expert that fails on zero rows: the loop's `if torch.any(...)` skip is kept by the rewrite
    code = M._LEAD_ROWS.replace("return self.b(F.relu(self.a(x)))",
                                "assert x.shape[1] > 0\n        return self.b(F.relu(self.a(x)))")
    run = M._LEAD_ROWS_RUN.replace("w, ids = torch.randn(7, 4).softmax(-1).topk(2, dim=-1)",
                                   "w, ids = torch.randn(7, 4).softmax(-1).topk(2, dim=-1)\nids = ids.clamp(max=2)")
    res = check_rewrite_runs(M.MoeExperts(), code, run, [_one(code)])
    assert res["all_calls"].get("npu_moe_token_permute") == 1
    assert min(res["cos_out"]) > 0.9999


def test_file_gate_lets_wordless_dispatch_files_through_silently():
    assert "xpert" not in M._LEAD_ROWS and "index_add" not in M._LEAD_ROWS
    assert M._relevant(ModuleInfo.from_source("a.py", M._LEAD_ROWS))
    # a wordless file whose loop has no dispatch shape: nothing at all, not even a near miss
    plain = M._LEAD_ROWS.replace("y[flat == i] = ffn(x[flat == i].unsqueeze(0)).to(dtype=y.dtype)",
                                 "y = y + ffn(x).to(dtype=y.dtype)")
    assert detect_all(M.MoeExperts(), plain) == ([], [])
    # files without torch stay out
    assert not M._relevant(ModuleInfo.from_source("b.py", "def f(a, i):\n    return a == i\n"))


def test_dispatch_shape_needs_a_selection_by_the_loop_variable_and_a_write_back():
    import ast

    def shape(src: str) -> bool:
        loop = ast.parse(src).body[0]
        assert isinstance(loop, ast.For)
        return M._dispatch_shape(loop)

    assert shape("for i in range(n):\n    y[ids == i] = f(x[ids == i])\n")
    assert shape("for e in range(n):\n    t, k = torch.where(m[e])\n    out.index_add_(0, t, g(x[t]))\n")
    assert not shape("for i in range(n):\n    y = f(x[ids == i])\n")  # no write-back
    assert not shape("for i in range(n):\n    y[ids == j] = f(x)\n")  # selection not by the loop variable


# -- runs of equal ids in the argsort order -------------------------------------------------------------


def _runs_of(code: str):
    import ast

    module = ModuleInfo.from_source("r.py", code)
    for scope in module.scopes:
        for _, _, st in scope.statements():
            if isinstance(st, ast.For):
                return M._sorted_runs(module, scope, st)
    raise AssertionError("no loop")


_RUNS = '''
import torch
def f(x, ids, experts):
    flat = ids.view(-1)
    n = flat.size(0)
    order = torch.argsort(flat)
    s_ids = flat[order].tolist()
    starts = [0] + [j for j in range(1, n) if s_ids[j] != s_ids[j - 1]]
    ends = starts[1:] + [n]
    y = torch.empty_like(x)
    for s, e in zip(starts, ends):
        y[order[s:e]] = experts[s_ids[s]](x[order[s:e]])
    return y
'''


def test_runs_are_proven_from_the_sorted_host_list():
    runs = _runs_of(_RUNS)
    assert runs is not None and (runs.flat, runs.order, runs.sorted_ids) == ("flat", "order", "s_ids")
    # the comparison written the other way round, the length as len() of the host list
    assert _runs_of(_RUNS.replace("s_ids[j] != s_ids[j - 1]", "s_ids[j - 1] != s_ids[j]")
                    .replace("[n]", "[len(s_ids)]")) is not None


def test_runs_that_are_not_the_runs_of_equal_ids_are_refused():
    assert _runs_of(_RUNS.replace("flat = ids.view(-1)", "flat = ids")) is None  # 2-D ids: argsort per row
    assert _runs_of(_RUNS.replace("range(1, n)", "range(2, n)")) is None  # a change at row 1 missed
    assert _runs_of(_RUNS.replace("s_ids[j - 1]", "s_ids[j - 2]")) is None  # not neighbours
    assert _runs_of(_RUNS.replace("flat[order].tolist()", "flat.tolist()")) is None  # not in sorted order
    # a name rebound between the sort and the loop: the runs may belong to another tensor
    assert _runs_of(_RUNS.replace("ends = starts[1:] + [n]", "ends = starts[1:] + [n]\n    n = 3")) is None
    assert _runs_of(_RUNS.replace("    y = torch.empty_like(x)\n", "    flat = flat.flip(0)\n    y = torch.empty_like(x)\n")) is None
    assert _runs_of(_RUNS.replace("+ [n]\n", "+ [n // 2]\n")) is None


def test_runs_span_replaces_the_sort_and_keeps_what_is_read_later():
    f = _one(M._SORTED_RUNS)
    lines = M._SORTED_RUNS.splitlines()
    assert lines[f.line - 1].strip().startswith("order = torch.argsort(flat")
    # the sorted host list read after the loop: its statement (and the sort before it) stay outside the span
    code = M._SORTED_RUNS.replace("    return (y.view(", "    print(len(sorted_ids))\n    return (y.view(")
    g = _one(code)
    assert code.splitlines()[g.line - 1].strip().startswith("starts = ")


def test_runs_rewrite_with_experts_that_get_no_rows():
    # ids clamped: experts 3 and up get no run, the permute gives them empty slices and they are not called
    code = M._SORTED_RUNS.replace("return self.b(F.relu(self.a(x)))", "assert x.shape[0] > 0\n        return self.b(F.relu(self.a(x)))")
    run = M._LEAD_ROWS_RUN.replace("w, ids = torch.randn(7, 4).softmax(-1).topk(2, dim=-1)",
                                   "w, ids = torch.randn(7, 4).softmax(-1).topk(2, dim=-1)\nids = ids.clamp(max=2)")
    res = check_rewrite_runs(M.MoeExperts(), code, run, [_one(code)])
    assert res["all_calls"].get("npu_moe_token_permute") == 1
    assert min(res["cos_out"]) > 0.9999


def test_leading_one_spellings_read_the_same():
    import pytest

    for spelling in ("ffn(x[flat == i][None])", "ffn(x[None, flat == i])", "ffn(x[flat == i].unsqueeze(dim=0))"):
        code = M._LEAD_ROWS.replace("ffn(x[flat == i].unsqueeze(0))", spelling)
        f = _one(code)
        assert f.params["routing"] == "flat_mask" and "_npufuse_rows_e.unsqueeze(0)" in f.fused, spelling
        res = check_rewrite_runs(M.MoeExperts(), code, M._LEAD_ROWS_RUN, [f])
        assert min(res["cos_out"]) > 0.9999, spelling
    # a leading 1 on another axis is not the same call: the expert would see [n, 1, H]
    code = M._LEAD_ROWS.replace("ffn(x[flat == i].unsqueeze(0))", "ffn(x[flat == i].unsqueeze(1))")
    with pytest.raises(AssertionError):
        _one(code)


# -- files that never say "expert" ---------------------------------------------------------------------


def test_word_free_files_report_candidates_but_no_near_misses():
    skipped = M._LEAD_ROWS.replace("if torch.any(flat == i):", "if i % 2 == 0:")
    assert detect_all(M.MoeExperts(), skipped) == ([], [])  # refused, silently
    findings, misses = detect_all(M.MoeExperts(), skipped + "\n# experts\n")
    assert not findings and [m.reason.split(":")[0] for m in misses] == ["conditional code inside the loop"]  # s40 audit40b: a loop naming no expert is "the loop"


def test_dispatch_forms_are_found_whatever_the_experts_are_called():
    # the same examples with every "expert" renamed: found by what they compute, and the rewrite still runs
    by_name = {ex.name: ex for ex in M.MoeExperts.FUSE}
    for name in ("zip_masks_with_experts", "deepseek_v3_moe_infer_sorted_counts", "experts_passed_into_init_enumerate_where",
                 "arange_eq_masks_zip_biased_experts", "split_by_counts_sorted_tokens_index_add",
                 "comprehension_inside_cat_over_split_rows", "range_loop_over_split_pieces",
                 "comprehension_list_then_cat_with_filter", "range_comprehension_over_split_pieces"):
        ex = by_name[name]
        code = M._no_word(ex.code)
        assert "xpert" not in code
        findings, _ = detect_all(M.MoeExperts(), code)
        assert len(findings) == 1, name
        original, _ = detect_all(M.MoeExperts(), ex.code)
        assert findings[0].params["routing"] == original[0].params["routing"], name
