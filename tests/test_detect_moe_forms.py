"""issue 14 class 4 (MoE), second pass: forms outside HF's spellings that the pattern's own
Fuse/Keep examples do not cover alone: experts built in helper methods, ``(flat == e).nonzero()``
row columns (1-D indices proven, never guessed), and grouped_gemm's ``gmm`` (candidates only when
``GROUPED_GEMM_CANDIDATES`` is on; the rewrite checked against the emulator either way)."""

from __future__ import annotations

import ast

import pytest

from npufuse.patterns import moe_experts as moe
from npufuse.scan.canonical import flattened_to_1d
from npufuse.scan.dataflow import ModuleInfo
from npufuse import emulate
from npufuse.rewrite.codegen import splice
from pattern_harness import _exec, check_rewrite_runs, detect_all

PATTERN = moe.MoeExperts()


# -- canonical.flattened_to_1d ---------------------------------------------------------------------


def _one_d(body: str, name: str = "flat") -> bool:
    code = "import torch\nimport torch as th\n\ndef f(idx, x):\n" + "".join(f"    {ln}\n" for ln in body.splitlines()) + "    return x\n"
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "f")
    return flattened_to_1d(module, scope, name, len(code.splitlines()))


@pytest.mark.parametrize("body", [
    "flat = idx.view(-1)",
    "flat = idx.reshape(-1)",
    "flat = idx.flatten()",
    "flat = th.flatten(idx)",
    "flat = idx.view(-1).long()",
    "flat = idx.flatten().to(x.device)",
    "flat = idx.view(2, 3)\nflat = flat.view(-1)",  # the last assignment decides
])
def test_flattened_to_1d_reads_flattening_spellings(body):
    assert _one_d(body)


@pytest.mark.parametrize("body", [
    "flat = idx",  # unknown rank
    "flat = idx.view(-1, 1)",  # 2-D column
    "flat = idx.flatten(1)",  # flattens only trailing dims
    "flat = idx.view(-1)\nflat = flat.unsqueeze(-1)",  # re-shaped after flattening
    "flat = th.flatten(idx, 0, 1)",  # flattens a range of dims only
])
def test_flattened_to_1d_refuses_unproven_ranks(body):
    assert not _one_d(body)


# -- experts built in helper methods __init__ calls --------------------------------------------------


def test_class_init_assigns_follows_helper_methods_once():
    code = '''
class A:
    def __init__(self):
        self.a = 1
        self._build()

    def _build(self):
        self.experts = make()
        self._build()  # recursion: visited once

    def unrelated(self):
        self.b = 2
'''
    module = ModuleInfo.from_source("m.py", code)
    found = moe._class_init_assigns(module, module.classes["A"])
    assert set(found) == {"a", "experts"}
    assert ast.unparse(found["experts"]) == "make()"


# -- (flat == e).nonzero() rows ---------------------------------------------------------------------


def _example(name: str, kind: str = "FUSE"):
    return next(ex for ex in getattr(moe.MoeExperts, kind) if ex.name == name)


def test_nonzero_column_site_spans_loop_and_writes_every_row():
    ex = _example("top1_nonzero_column_rows")
    findings, _ = detect_all(PATTERN, ex.code)
    (f,) = findings
    assert f.params["indices"] == "max_ind" and f.params["routing"] == "flat_mask"
    # the rewrite covers the loop and the fresh accumulator it fills
    lines = ex.code.splitlines()
    assert "output_total = torch.empty_like" in lines[f.line - 1] and "output_total[local_indices, :]" in lines[f.end_line - 1]
    facts = check_rewrite_runs(PATTERN, ex.code, ex.run, findings)
    assert facts["all_calls"].get("npu_grouped_matmul", 0) >= 2
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


@pytest.mark.parametrize("spelling", [
    "local_indices = (max_ind == expert_num).nonzero().squeeze(-1)",
    "local_indices = (max_ind == expert_num).nonzero().view(-1)",
    "local_indices = torch.nonzero(max_ind == expert_num)",
])
def test_nonzero_row_spellings_are_found(spelling):
    ex = _example("top1_nonzero_column_rows")
    code = ex.code.replace("local_indices = (max_ind == expert_num).nonzero()", spelling)
    findings, _ = detect_all(PATTERN, code)
    assert len(findings) == 1
    facts = check_rewrite_runs(PATTERN, code, ex.run, findings)
    assert min(facts["cos_out"]) >= 0.9999


def test_nonzero_rows_written_with_another_index_are_refused():
    ex = _example("top1_nonzero_column_rows")
    code = ex.code.replace("output_total[local_indices, :] = expert(hidden)", "output_total[other, :] = expert(hidden)").replace(
        "for expert_num, expert in", "other = max_ind\n        for expert_num, expert in")
    findings, misses = detect_all(PATTERN, code)
    assert not findings and misses


# -- grouped_gemm's gmm -------------------------------------------------------------------------------


def test_grouped_gemm_is_a_near_miss_naming_the_replacement_by_default():
    ex = moe.GROUPED_GEMM_EXAMPLES[0]
    findings, misses = detect_all(PATTERN, ex.code)
    assert not findings
    assert any("npu_grouped_matmul" in m.reason and "group_list_type=1" in m.reason for m in misses)


@pytest.mark.parametrize("ex", moe.GROUPED_GEMM_EXAMPLES, ids=[e.name for e in moe.GROUPED_GEMM_EXAMPLES])
def test_grouped_gemm_candidates_rewrite_exactly(ex, monkeypatch):
    monkeypatch.setattr(moe, "GROUPED_GEMM_CANDIDATES", True)
    findings, _ = detect_all(PATTERN, ex.code)
    assert findings
    for key, want in ex.expect.items():
        got = findings[0].variant if key == "variant" else findings[0].params.get(key)
        assert got == want, (key, got, want)
    facts = check_rewrite_runs(PATTERN, ex.code, ex.run, findings)
    assert facts["all_calls"].get("npu_grouped_matmul", 0) >= 2
    assert [a == b for a, b in facts["dtypes"]] == [True] * len(facts["dtypes"])
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_grouped_gemm_rows_past_the_counts_come_back_as_zeros(monkeypatch):
    monkeypatch.setattr(moe, "GROUPED_GEMM_CANDIDATES", True)
    ex = moe.GROUPED_GEMM_EXAMPLES[1]
    findings, _ = detect_all(PATTERN, ex.code)
    # 8 rows, counts summing to 6: the last two rows belong to no group (the stand-in returns 6 rows)
    run = "glu = GroupedGLU(3, 16, 8)\nx = torch.randn(8, 16)\nfull = glu(x, torch.tensor([2, 3, 1]))\nout = full[:6]\n"
    facts = check_rewrite_runs(PATTERN, ex.code, run, findings)
    assert min(facts["cos_out"]) >= 0.9999
    with emulate.install():
        ns = _exec(splice(ex.code, findings), "rewritten")
        exec(compile(run, "<run>", "exec"), ns)
    assert tuple(ns["full"].shape) == (8, 16) and not ns["full"][6:].any()


# -- comprehensions read as loops ----------------------------------------------------------------------


def test_comprehension_finding_spans_the_original_statements_and_leaves_the_tree_alone():
    ex = _example("comprehension_inside_cat_over_split_rows")
    module = ModuleInfo.from_source("m.py", ex.code)
    before = ast.dump(module.tree, include_attributes=True)
    findings = [r for s in module.scopes for r in PATTERN.detect(module, s) if not isinstance(r, moe.NearMiss)]
    assert ast.dump(module.tree, include_attributes=True) == before  # synthetic loops never touch the parsed tree
    (f,) = findings
    lines = ex.code.splitlines()
    # from the host counts to the comprehension statement, nothing after it
    assert lines[f.line - 1].strip().startswith("counts = torch.bincount")
    assert lines[f.end_line - 1].strip().startswith("outs = torch.cat([expert(c)")
    assert "_npufuse_list" not in f.fused  # the synthetic list never reaches the replacement


def test_comprehension_experts_follow_the_counts_not_the_module_list():
    # zip(experts, split) stops at the shorter: with fewer counts than experts only those experts run
    ex = _example("comprehension_inside_cat_over_split_rows")
    code = ex.code.replace("counts = torch.bincount(flat, minlength=len(self.experts)).tolist()",
                           "counts = torch.bincount(flat).tolist()")
    findings, _ = detect_all(PATTERN, code)
    (f,) = findings
    run = "m = MoE(16, 24, 5, 1)\nx = torch.randn(7, 16)\nwith torch.no_grad():\n    m.gate.weight[4].fill_(-1e4)\nout = m(x)\n"
    facts = check_rewrite_runs(PATTERN, code, run, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) >= 0.9999


def test_dispatcher_comprehension_keeps_its_reason():
    ex = next(k for k in moe.MoeExperts.KEEP if k.name == "comprehension_over_dispatcher_inputs")
    findings, misses = detect_all(PATTERN, ex.code)
    assert not findings
    assert [m.reason for m in misses if "dispatched before this statement" in m.reason]


# -- where an index comes from (permutation halves outside loops) --------------------------------------


@pytest.mark.parametrize("body,origin", [
    ("pass", "a parameter"),
    ("idx = idx.unsqueeze(1).expand(-1, 4)", "a parameter"),
    ("a, idx, c = self.router(x)", "returned by `self.router(...)`"),
    ("a, idx, c = self.router(x)\n    idx = idx.reshape(-1, 1)", "returned by `self.router(...)`"),
    ("idx = torch.where(x > 0)[0]", None),  # computed here
    ("idx = torch.arange(4)", None),
    ("idx = other[perm]", None),  # reordered here: no claim
])
def test_index_origin(body, origin):
    code = f"import torch\n\ndef f(self, x, idx, other, perm):\n    {body}\n    return idx\n"
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "f")
    root = ast.parse("idx", mode="eval").body
    assert moe._index_origin(module, scope, root, len(code.splitlines())) == origin


def test_self_attribute_index_origin():
    code = "import torch\n\nclass M:\n    def f(self, x):\n        return x\n"
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "M.f")
    assert moe._index_origin(module, scope, ast.parse("self.batch_index", mode="eval").body, 5) == "an attribute set elsewhere"


def test_tuple_returning_experts_replay_their_steps_per_expert():
    ex = _example("switch_expert_returns_output_and_bias")
    findings, _ = detect_all(PATTERN, ex.code)
    (f,) = findings
    assert "output, output_bias = _npufuse_expert(_npufuse_rows_e.unsqueeze(1))" in f.fused
    assert "output_bias = output_bias.expand_as(output)" in f.fused
    assert f.fused.count("npu_moe_token_unpermute") == 2  # one per accumulator
    facts = check_rewrite_runs(PATTERN, ex.code, ex.run, findings)
    assert len(facts["cos_out"]) == 2 and min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_index_add_outside_expert_code_says_nothing():
    # a graph network's message passing: rows added back at caller-given indices, no experts anywhere
    code = '''import torch

def aggregate(messages, dst, num_nodes):
    out = torch.zeros(num_nodes, messages.shape[-1])
    return out.index_add(0, dst, messages)
'''
    findings, misses = detect_all(PATTERN, code)
    assert not findings and not misses


def test_index_computed_by_a_local_tensor_method_makes_no_claim():
    code = "import torch\n\ndef f(self, batch_indices, order):\n    idx = batch_indices.index_select(0, order)\n    return idx\n"
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "f")
    assert moe._index_origin(module, scope, ast.parse("idx", mode="eval").body, 5) is None
    code = code.replace("batch_indices.index_select(0, order)", "compute_gating(order)")
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "f")
    assert moe._index_origin(module, scope, ast.parse("idx", mode="eval").body, 5) == "returned by `compute_gating(...)`"


def test_attribute_set_in_this_function_makes_no_claim():
    code = "import torch\n\nclass M:\n    def f(self, x):\n        self.batch_index = x.argsort()\n        return x\n"
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "M.f")
    assert moe._index_origin(module, scope, ast.parse("self.batch_index", mode="eval").body, 6) is None
