"""s42 audit fixes (audit42): the classes behind the wrong / dubious candidates and the false near-miss reasons of
this session's precision audit on 15 repositories new to npufuse (bench/audit_s42_precision.json,
bench/audit_s42_near_misses.json).

W1 fused_optimizer (BenchMARL ``Experiment._setup_algorithm``): ``{group: {name: torch.optim.Adam(params, ...) for
   name, params in groups.items()} ...}``: the guard before the statement read ``params``, bound only inside the
   comprehension (NameError on NPU). An optimizer built from a comprehension's loop variable is a near miss.
W2 swiglu (savanna ``ParallelGLU``): ``self.activation_func = get_activation(global_config, act_default=...)``: the
   getter's first argument is a config object, not the activation's name; the fused branch compared the config object
   with "silu" (never equal: a dead fused branch). A getter given a config object dispatches on the returned object.
W3 affinity_where (Liger's vocab-parallel cross entropy): ``loss = torch.log(s) - p`` then, in an ``if`` arm,
   ``loss = (1 - a) * loss + ...``; ``torch.where(ignore_mask, torch.zeros_like(loss), loss)`` sanitises the ignored
   rows. Only the last assignment was searched for inf/NaN producers, so it became lerp (NaN where loss is -inf).
   Every earlier assignment of the branch name counts.
D1 switch (Liger, 18 sites): ``LIGER_RMS_DEBUG`` (prints from Liger's RMSNorm kernel) was reused as the sites'
   switch; next in line were ``LIGER_RMS_COMPILE_BUCKET`` / ``LIGER_RMS_FORCE_NO_FAST``, knobs of that kernel. An
   environment variable with no flag verb first is a switch only when every word names the topic, an op or a kernel.
R1 affinity_index_put (reason, AQLM ``flat_prev_codes.index_put((topk_indices[:, None], arange), ...)``): "integer
   positions (nonzero) ... index with the mask itself" for positions from topk (no mask exists). Reworded.
R2 moe_experts (reason, Liger's HF-Mixtral benchmark): "a mask that is not one_hot(expert indices).permute(...) built
   in this function" where it is exactly that (built under ``torch.no_grad()``). The reason says npufuse does not
   trace it.
R3 rms_norm (reason, Liger's benchmarks): ``from liger_kernel.transformers.rms_norm import LigerRMSNorm`` with the
   package under ``src/`` was called "an RMSNorm class of a third-party library". The src layout resolves as the
   repository's own.
"""

from __future__ import annotations

from pathlib import Path

from npufuse.patterns.affinity_index_put import AffinityIndexPut
from npufuse.patterns.affinity_where import AffinityWhere
from npufuse.patterns.fused_optimizer import FusedOptimizer
from npufuse.patterns.swiglu import Swiglu
from npufuse.patterns.registry import all_patterns
from npufuse.scan import engine, repo_search
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import detect_all

# -- W1: an optimizer per parameter group, built in a comprehension

_COMPREHENSION = """
import torch


class Experiment:
    def setup(self, groups):
        self.optimizers = {
            group: {
                name: torch.optim.Adam(params, lr=self.lr)
                for name, params in self.get_parameters(group).items()
            }
            for group in groups
        }
"""

_ONE_PER_MODEL = """
import torch


class Experiment:
    def setup(self, model):
        params = list(model.parameters())
        self.optimizers = {name: torch.optim.Adam(params, lr=lr) for name, lr in (("a", 1e-3),)}
"""

_PLAIN = """
import torch


class Experiment:
    def setup(self, model):
        self.optimizer = torch.optim.Adam(model.parameters(), lr=self.lr)
"""


def test_an_optimizer_built_from_a_comprehension_variable_is_a_near_miss() -> None:
    findings, misses = detect_all(FusedOptimizer(), _COMPREHENSION)
    assert not findings
    assert any("comprehension from its loop variable(s) (params)" in m.reason for m in misses)


def test_a_comprehension_variable_read_only_by_a_keyword_is_a_near_miss_too() -> None:
    findings, misses = detect_all(FusedOptimizer(), _ONE_PER_MODEL)
    assert not findings
    assert any("comprehension from its loop variable(s) (lr)" in m.reason for m in misses)


def test_an_optimizer_outside_a_comprehension_is_still_a_candidate() -> None:
    findings, _ = detect_all(FusedOptimizer(), _PLAIN)
    assert len(findings) == 1


# -- W2: an activation getter given a config object

_GETTER_OF_CONFIG = """
import torch
import torch.nn.functional as F
from .activations import get_activation


class ParallelGLU(torch.nn.Module):
    def __init__(self, global_config):
        super().__init__()
        self.global_config = global_config
        self.w1 = torch.nn.Linear(64, 128, bias=False)
        self.w2 = torch.nn.Linear(64, 128, bias=False)
        self.w3 = torch.nn.Linear(128, 64, bias=False)
        self.activation_func = get_activation(global_config, act_default=global_config.glu_activation)

    def forward(self, x):
        w1_out = self.w1(x)
        w2_out = self.w2(x)
        return self.w3(self.activation_func(w1_out) * w2_out)
"""

_GETTER_OF_NAME = _GETTER_OF_CONFIG.replace(
    "get_activation(global_config, act_default=global_config.glu_activation)", "get_activation(global_config.activation)")


def test_a_getter_given_a_config_object_dispatches_on_the_returned_object() -> None:
    findings, _ = detect_all(Swiglu(), _GETTER_OF_CONFIG)
    assert len(findings) == 1
    fused = findings[0].fused
    assert "self.global_config in (" not in fused
    assert "self.activation_func is torch.nn.functional.silu" in fused


def test_a_getter_given_the_name_still_compares_the_name() -> None:
    findings, _ = detect_all(Swiglu(), _GETTER_OF_NAME)
    assert len(findings) == 1
    assert "self.global_config.activation in ('silu', 'swish')" in findings[0].fused


# -- W3: a where that sanitises a value whose first assignment can be -inf

_SANITISED = """
import torch


def ce_forward(sum_exp, predicted, target, ignore_index, smoothing, mean_log_probs):
    loss = torch.log(sum_exp) - predicted
    if smoothing > 0:
        loss = (1.0 - smoothing) * loss + smoothing * (-mean_log_probs)
    ignore_mask = target == ignore_index
    loss = torch.where(ignore_mask, torch.zeros_like(loss), loss)
    return loss
"""

_FINITE = """
import torch


def blend(a, b, target, ignore_index, smoothing):
    loss = a * 2.0 - b
    if smoothing > 0:
        loss = (1.0 - smoothing) * loss + smoothing * b
    ignore_mask = target == ignore_index
    loss = torch.where(ignore_mask, torch.zeros_like(loss), loss)
    return loss
"""


def test_every_earlier_assignment_of_a_branch_is_searched_for_inf() -> None:
    findings, misses = detect_all(AffinityWhere(), _SANITISED)
    assert not findings
    assert any("torch.log(sum_exp)" in m.reason and "not inf-safe" in m.reason for m in misses)


def test_finite_assignments_in_both_arms_stay_a_candidate() -> None:
    findings, _ = detect_all(AffinityWhere(), _FINITE)
    assert len(findings) == 1


# -- D1: environment variables that tune or debug a repository kernel are no switches


def test_knobs_of_a_repository_kernel_are_not_switches() -> None:
    for name in ("LIGER_RMS_DEBUG", "LIGER_RMS_COMPILE_BUCKET", "LIGER_RMS_FORCE_NO_FAST", "LIGER_RMS_FUSED_STRIP_MULT"):
        assert not repo_search.is_switch(name, "env"), name


def test_environment_switches_naming_a_fused_op_are_still_switches() -> None:
    for name in ("NPU_FUSED_ADAMW", "NPUFUSE_RMS_NORM", "NPU_FUSED_ROPE", "FLASH_ATTN_V2", "LIGER_RMS_NORM", "USE_FLASH_ATTN"):
        assert repo_search.is_switch(name, "env"), name


# -- R1: index_put at integer positions that never were a mask

_TOPK_POSITIONS = """
import torch


def update(codes, scores, new_codes, k):
    flat_indices = torch.topk(scores, k).indices
    out = codes.index_put((flat_indices[:, None], torch.arange(codes.shape[1])[None, :]), new_codes)
    return out
"""


def test_the_integer_positions_reason_does_not_claim_a_nonzero_mask() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _TOPK_POSITIONS)
    assert not findings
    reasons = [m.reason for m in misses if "integer positions" in m.reason]
    assert reasons and all("(nonzero)" not in r for r in reasons)
    assert all("where the positions come from `mask.nonzero()`" in r for r in reasons)


# -- R3: a package under src/ is the repository's own

_BENCH = """
import torch
from mylib.transformers.rms_norm import MyRMSNorm


def make(hidden):
    layer = MyRMSNorm(hidden, eps=1e-6)
    return layer
"""


def _library_reasons(root: Path) -> list[str]:
    (root / "benchmark").mkdir()
    (root / "benchmark" / "run.py").write_text(_BENCH, encoding="utf-8")
    out = engine.analyze_file(root, "benchmark/run.py", all_patterns(), engine.ScanOptions())
    return [m["reason"] for m in out.near_misses if "third-party library" in m["reason"]]


def test_a_src_layout_package_is_the_repositorys_own(tmp_path: Path) -> None:
    pkg = tmp_path / "src" / "mylib" / "transformers"
    pkg.mkdir(parents=True)
    (tmp_path / "src" / "mylib" / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "rms_norm.py").write_text("import torch\n\n\nclass MyRMSNorm(torch.nn.Module):\n    pass\n", encoding="utf-8")
    assert _library_reasons(tmp_path) == []


def test_a_package_nowhere_in_the_repository_is_still_a_third_party_library(tmp_path: Path) -> None:
    assert _library_reasons(tmp_path)


# -- R2: a token mask npufuse does not trace

_ROUTER_MASK = """
import torch
from torch import nn


def moe_forward(x, experts, dispatch_mask, top_k_weights):
    final = torch.zeros_like(x)
    for eidx in range(len(experts)):
        top_k_pos, token_idx = torch.where(dispatch_mask[eidx])
        curr = experts[eidx](x[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, curr.to(final.dtype))
    return final
"""


def test_an_untraced_token_mask_is_said_to_be_untraced() -> None:
    from npufuse.patterns.moe_experts import MoeExperts

    findings, misses = detect_all(MoeExperts(), _ROUTER_MASK)
    assert not findings
    reasons = [m.reason for m in misses if "tokens are picked with" in m.reason]
    assert reasons and all("npufuse does not trace" in r and "that is not one_hot" not in r for r in reasons)


# W3 twin: a log whose result is cast to an integer dtype leaves no inf/NaN in the branch (T5's buckets)

_BUCKETS = """
import math
import torch


def bucket(relative_position, max_exact, num_buckets, max_distance):
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1))
    relative_buckets = torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets
"""


def test_a_log_cast_to_an_integer_dtype_is_no_inf_source() -> None:
    findings, misses = detect_all(AffinityWhere(), _BUCKETS)
    assert not findings
    assert [m.reason for m in misses if "not inf-safe" in m.reason] == []
    assert any("integer tensors" in m.reason for m in misses)


def test_an_environment_switch_may_start_with_the_project_prefix() -> None:
    # the first word of an environment variable is often the project's own prefix; the rest must
    # still name the topic, an op or a kernel (integrator fix: the s41 carried-value test
    # records LA_FLASH_ATTN as a switch that carries a value)
    assert repo_search.is_switch("VLLM_USE_TRITON_FLASH_ATTN", "env")
    assert repo_search.is_switch("LA_FLASH_ATTN", "env")
    assert not repo_search.is_switch("LIGER_RMS_COMPILE_BUCKET", "env")
    assert not repo_search.is_switch("LIGER_RMS_FORCE_NO_FAST", "env")
    assert not repo_search.is_switch("LIGER_RMS_DEBUG", "env")
