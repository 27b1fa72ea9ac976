"""Mutants of every registered pattern, and the machinery that runs `verify op` on them.

A mutant is a text edit of the detector's own ``Finding.fused`` for one of the pattern's ``FUSE``
examples. The example file is "applied" the way ``npufuse apply`` does it (the libcst splice of
:func:`test_verify_helpers.fake_apply`), and the op check is the one ``npufuse verify op --capture``
runs (:func:`npufuse.verify.opcheck.run_op_check`): the inputs are the first call of the target
function captured while the example's own ``run`` snippet executes (the probe's
``install_capture``/``save_capture``, in process instead of in a child), so shapes, dtypes and
the module instance are those the example really uses.

``fused_optimizer`` has no operator to call (``verify op`` skips it: NOT_OP_LEVEL): its mutants
are judged by the rule ``verify e2e`` applies — the loss curve of a short training loop, baseline
vs fused, through :func:`npufuse.verify.stats.compare_losses` (1% of the smoothed curve).

Used by ``tests/test_verify_mutations_registry.py`` and ``bench/mutations.py`` (the table).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import test_verify_helpers as h
from npufuse import emulate
from npufuse.patterns import affinity_index_put, affinity_where
from npufuse.patterns.base import Finding
from npufuse.patterns.registry import get_pattern
from npufuse.rewrite.codegen import splice
from npufuse.verify import inputs as inp
from npufuse.verify import stats
from npufuse.verify.candidate import Candidate, load_candidate
from npufuse.verify.opcheck import OpOptions, OpReport, run_op_check
from npufuse.verify.probe import install_capture, save_capture
from pattern_harness import detect_all

# run snippets of the affinity examples (their FUSE entries carry none)
AFFINITY_RUNS = {**affinity_index_put.CHECKS, **affinity_where.CHECKS}


@dataclass(frozen=True)
class Example:
    pattern: str
    name: str  # the FUSE example's name
    finding: int = 0  # which of its findings (several sites in one example)
    run: str = ""  # replaces the example's run snippet (one whose helper classes would not pickle)
    sweep: bool = True  # the correct replacement is also checked cast to fp32/fp16/bf16


@dataclass(frozen=True)
class Mutant:
    pattern: str
    name: str
    example: str
    edits: tuple[tuple[str, str], ...]  # (anchor, replacement) in Finding.fused; every occurrence replaced
    dtype: str | None = None  # precision of the check (None: the example's own dtypes)
    expect: str = ""  # a reason verify must give (substring)

    @property
    def key(self) -> tuple[str, str]:
        return (self.pattern, self.name)

    @property
    def id(self) -> str:
        return f"{self.pattern}: {self.name} [{self.example}]"


def M(pattern: str, name: str, example: str, *edits: tuple[str, str], dtype: str | None = None, expect: str = "") -> Mutant:
    return Mutant(pattern, name, example, tuple(edits), dtype, expect)


EXAMPLES = [
    Example("rms_norm", "hf_llama_bf16"),
    Example("rms_norm", "hf_llama_fp32_weight_bf16_input"),
    Example("rms_norm", "gemma_one_plus_weight"),
    Example("add_rms_norm", "hf_llama_layer_training"),
    Example("add_rms_norm", "gemma_sandwich_one_plus_weight_bf16"),
    Example("swiglu", "phi3_fused_gate_up_fp16"),
    Example("swiglu", "silu_on_second_half_swapped"),
    Example("geglu", "tanh_on_second_half"),
    Example("geglu", "gelu_on_first_half_fp16"),
    Example("rope", "hf_llama"),
    Example("rope", "hf_bf16_q_fp32_cos", sweep=False),  # the fp32 tables are the point
    Example("attention", "bert_padding_mask"),
    Example("attention", "gpt2_bottom_right_causal_kv_cache"),
    Example("attention", "einsum_cross_attention_triu_top_left"),
    # eager attention returning its probabilities (verify op excuses that output: not produced)
    Example("attention", "hf_llama_eager_gqa"),  # fp32 inputs: the sweep adds fp16/bf16
    Example("attention", "gpt_neo_fp32_qk_bottom_right_plus_padding"),
    Example("sdpa", "timm_fused_attn"),
    Example("sdpa", "gqa_causal_sq_ne_skv"),
    Example("sdpa", "bool_key_padding_mask"),
    Example("sdpa", "bsnd_inline_transpose_bf16"),
    Example("moe_experts", "user_stacked_in_out_unique"),
    Example("moe_experts", "plain_gelu_experts_enumerate"),
    Example("fused_optimizer", "hf_no_trainer_param_groups"),
    Example("fused_optimizer", "cifar_sgd_nesterov_module_alias"),
    Example("affinity_index_put", "hf_labels_pad_to_ignore_index", sweep=False),  # integer labels
    # B == S == H: a mask whose rank is not aligned broadcasts over the wrong dims instead of raising
    Example("affinity_index_put", "hidden_states_rank_aligned_mask", run="h = torch.randn(4, 4, 4, requires_grad=True)\nm = torch.randint(0, 2, (4, 4))\nout = zero_padding(h, m)\nleaves = [h]"),
    Example("affinity_where", "ascend_guide_bbox_clip"),
    Example("affinity_where", "skip_gate_return"),
]
EXAMPLE = {e.name: e for e in EXAMPLES}

_HALF = "[..., : {t}.shape[-1] // 2]"
_PROBS_LINE = "attn_weights = None  # the fused op does not materialise the probabilities (as HF's sdpa/flash paths)"

MUTANTS = [
    # rms_norm
    M("rms_norm", "wrong eps", "hf_llama_bf16", ("epsilon=self.variance_epsilon", "epsilon=self.variance_epsilon * 1e5")),
    M("rms_norm", "missing scale (weight dropped)", "hf_llama_bf16", ("_npu_gamma, epsilon", "torch.ones_like(_npu_gamma), epsilon")),
    M("rms_norm", "dtype cast dropped", "hf_llama_fp32_weight_bf16_input", (")[0].to(torch.promote_types(hidden_states.dtype, self.weight.dtype))", ")[0]"), expect="dtype bfloat16 differs from the original's float32 (values: cosine"),
    M("rms_norm", "1+w dropped", "gemma_one_plus_weight", ("1.0 + self.weight.float()", "self.weight.float()")),
    M("rms_norm", "missing [0]", "gemma_one_plus_weight", ("epsilon=self.eps)[0]", "epsilon=self.eps)"), expect="result tuple without its [0]"),
    # add_rms_norm: the fused code branches on torch.is_grad_enabled(); mutate each branch alone
    M("add_rms_norm", "wrong eps (training branch)", "hf_llama_layer_training", ("variance_epsilon)[0]", "variance_epsilon * 1e5)[0]")),
    M("add_rms_norm", "residual not added (training branch)", "hf_llama_layer_training", ("    hidden_states = residual + hidden_states\n    residual = hidden_states\n", "    residual = hidden_states\n")),
    M("add_rms_norm", "1+w dropped (inference branch)", "gemma_sandwich_one_plus_weight_bf16", ("(1.0 + self.pre_feedforward_layernorm.weight.float()).to(residual.dtype)", "self.pre_feedforward_layernorm.weight.to(residual.dtype)"), expect="(no_grad)"),
    M("add_rms_norm", "normed and sum swapped (inference branch)", "gemma_sandwich_one_plus_weight_bf16", ("_npu_normed, _npu_rstd, hidden_states = ", "hidden_states, _npu_rstd, _npu_normed = "), expect="(no_grad)"),
    M("add_rms_norm", "1+w dropped (both branches)", "gemma_sandwich_one_plus_weight_bf16", ("1.0 + self.pre_feedforward_layernorm.weight.float()", "self.pre_feedforward_layernorm.weight.float()")),
    # swiglu
    M("swiglu", "swapped swiglu halves", "silu_on_second_half_swapped", ("torch.cat(y.chunk(2, dim=-1)[::-1], dim=-1)", "y")),
    M("swiglu", "swapped swiglu halves", "phi3_fused_gate_up_fp16", ("npu_swiglu(up_states.contiguous()", "npu_swiglu(torch.cat(up_states.chunk(2, dim=-1)[::-1], dim=-1)")),
    M("swiglu", "gelu instead of silu", "phi3_fused_gate_up_fp16", ("torch_npu.npu_swiglu(up_states.contiguous(), dim=-1)", "torch_npu.npu_geglu(up_states.contiguous(), dim=-1, approximate=1, activate_left=True)[0]")),
    # geglu
    M("geglu", "swapped halves (activate_left flipped)", "tanh_on_second_half", ("activate_left=False", "activate_left=True")),
    M("geglu", "approximate flipped (tanh -> erf)", "tanh_on_second_half", ("approximate=1", "approximate=0")),
    M("geglu", "missing [0]", "tanh_on_second_half", ("activate_left=False)[0]", "activate_left=False)"), expect="result tuple without its [0]"),
    M("geglu", "approximate flipped (erf -> tanh)", "gelu_on_first_half_fp16", ("approximate=0", "approximate=1"), dtype="float32"),
    # rope
    M("rope", "cos/sin not expanded (half-D)", "hf_llama", ("cos.to(", "cos" + _HALF.format(t="cos") + ".to("), ("sin.to(", "sin" + _HALF.format(t="sin") + ".to("), expect="the fused branch raised NpuOpError: npu_rotary_mul"),
    M("rope", "sin sign flipped", "hf_llama", ("sin.to(_npufuse_k_dtype_npu))", "(-sin).to(_npufuse_k_dtype_npu))")),
    M("rope", "dtype cast dropped", "hf_bf16_q_fp32_cos", ("_npufuse_q_dtype = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), sin.dtype)", "_npufuse_q_dtype = q.dtype"), expect="dtype bfloat16 differs from the original's float32 (values: cosine"),
    # attention (eager)
    M("attention", "inverted mask", "bert_padding_mask", ("(attention_mask < 0)", "(attention_mask >= 0)")),
    M("attention", "missing scale", "bert_padding_mask", ("scale=1.0 / math.sqrt(self.attention_head_size)", "scale=1.0")),
    M("attention", "wrong layout (BSND for BNSD)", "bert_padding_mask", ('_npufuse_q4.shape[1], "BNSD"', '_npufuse_q4.shape[2], "BSND"'), expect="the fused branch raised NpuOpError: npu_fusion_attention: atten_mask shape"),
    M("attention", "missing [0]", "bert_padding_mask", (")[0].flatten(0, _npufuse_lift)", ").flatten(0, _npufuse_lift)"), expect="the fused branch raised AttributeError: 'tuple' object"),
    M("attention", "wrong sparse_mode (2 for 3, Sq<Skv)", "gpt2_bottom_right_causal_kv_cache", ("sparse_mode=3", "sparse_mode=2")),
    M("attention", "wrong sparse_mode (3 for 2, Sq<Skv)", "einsum_cross_attention_triu_top_left", ("sparse_mode=2", "sparse_mode=3")),
    M("attention", "causal sparse_mode without mask", "einsum_cross_attention_triu_top_left", ("atten_mask=_npufuse_masks[q.device],", "atten_mask=None,")),
    # attention returning its probabilities (tests/test_verify_not_produced.py): excusing out[1]
    # must not excuse a wrong out[0], a wrong tensor in out[1]'s place, or a missing out[0]
    M("attention", "missing scale", "hf_llama_eager_gqa", ("scale=scaling", "scale=1.0"), expect="out[0]:"),
    M("attention", "inverted mask", "hf_llama_eager_gqa", ("] < 0) if attention_mask", "] >= 0) if attention_mask"), expect="out[0]:"),
    M("attention", "zeros for the probabilities", "hf_llama_eager_gqa", (_PROBS_LINE, "attn_weights = torch.zeros(query.shape[:-1] + (key.shape[-2],), dtype=query.dtype)"), expect="out[1]:"),
    M("attention", "None for the output", "gpt_neo_fp32_qk_bottom_right_plus_padding", ("attn_output = torch_npu.npu_fusion_attention(", "attn_output = None; _npufuse_unused = torch_npu.npu_fusion_attention("), expect="the fused branch returns 0 tensors"),
    # sdpa
    M("sdpa", "missing scale", "timm_fused_attn", ("scale=q.shape[-1] ** -0.5", "scale=1.0")),
    M("sdpa", "wrong sparse_mode (3 for 2, Sq<Skv)", "gqa_causal_sq_ne_skv", ("sparse_mode=2", "sparse_mode=3")),
    M("sdpa", "causal sparse_mode without mask", "gqa_causal_sq_ne_skv", ("atten_mask=_npufuse_masks[_npufuse_q4.device],", "atten_mask=None,")),
    M("sdpa", "missing [0]", "gqa_causal_sq_ne_skv", (")[0].flatten(0, _npufuse_lift)", ").flatten(0, _npufuse_lift)"), expect="the fused branch raised AttributeError: 'tuple' object"),
    M("sdpa", "inverted mask", "bool_key_padding_mask", ("_npufuse_mask = ~mask", "_npufuse_mask = mask")),
    M("sdpa", "wrong layout (BNSD for BSND)", "bsnd_inline_transpose_bf16", ('_npufuse_autocast(q, k, v), q.shape[2], "BSND"', '_npufuse_autocast(q, k, v), q.shape[1], "BNSD"')),
    # moe_experts
    M("moe_experts", "routing weights dropped", "user_stacked_in_out_unique", ("probs=_npufuse_probs.to(", "probs=torch.ones_like(_npufuse_probs).to(")),
    M("moe_experts", "wrong top-k (1 for 2)", "user_stacked_in_out_unique", ("npu_moe_token_permute(x, _npufuse_idx)", "npu_moe_token_permute(x, _npufuse_idx[:, :1])"), ("torch.histc(_npufuse_idx.flatten()", "torch.histc(_npufuse_idx[:, :1].flatten()"), ("probs=_npufuse_probs.to(", "probs=_npufuse_probs[:, :1].to(")),
    M("moe_experts", "swapped swiglu halves", "user_stacked_in_out_unique", ("torch.cat((self.w1, self.w3), dim=2)", "torch.cat((self.w3, self.w1), dim=2)")),
    M("moe_experts", "activation dropped", "plain_gelu_experts_enumerate", ("_npufuse_h = _npufuse_experts[0].act(_npufuse_h)\n", "")),
    # fused_optimizer (judged by the e2e loss rule)
    M("fused_optimizer", "wrong lr", "hf_no_trainer_param_groups", ("lr=learning_rate)", "lr=learning_rate * 10)")),
    M("fused_optimizer", "wrong eps", "hf_no_trainer_param_groups", ("lr=learning_rate)", "lr=learning_rate, eps=1e-2)")),
    M("fused_optimizer", "param groups lost (no-decay params decayed)", "hf_no_trainer_param_groups", ("optimizer_grouped_parameters", "model.parameters(), weight_decay=weight_decay")),
    M("fused_optimizer", "wrong weight_decay (x100)", "cifar_sgd_nesterov_module_alias", ("weight_decay=5e-4", "weight_decay=5e-2")),
    M("fused_optimizer", "nesterov dropped", "cifar_sgd_nesterov_module_alias", ("nesterov=True", "nesterov=False")),
    M("fused_optimizer", "momentum dropped", "cifar_sgd_nesterov_module_alias", ("momentum=0.9", "momentum=0.0"), ("nesterov=True", "nesterov=False")),
    # affinity rewrites (plain torch: mask polarity, ranks, blend ends)
    M("affinity_index_put", "inverted mask", "hf_labels_pad_to_ignore_index", ("labels == pad_token_id", "labels != pad_token_id"), expect="integer output differs"),
    M("affinity_index_put", "inverted mask", "hidden_states_rank_aligned_mask", ("attention_mask == 0", "attention_mask != 0")),
    M("affinity_index_put", "mask rank not aligned", "hidden_states_rank_aligned_mask", ("_npufuse_mask = _npufuse_mask.reshape(_npufuse_mask.shape + (1,) * (hidden_states.dim() - _npufuse_mask.dim()))\n", "")),
    M("affinity_where", "inverted mask", "ascend_guide_bbox_clip", ("bboxes < min_xy, min_xy, bboxes", "bboxes >= min_xy, min_xy, bboxes")),
    M("affinity_where", "blend ends swapped", "skip_gate_return", ("torch.lerp(_npufuse_b, _npufuse_a,", "torch.lerp(_npufuse_a, _npufuse_b,")),
]

# Mutants that the seed criterion alone (cosine > 0.999 or max-abs < 1e-4, per tensor) would
# have let through; only the dtype-aware relative-error bound or a structural rule catches them.
SEED_BLIND = {
    ("rms_norm", "wrong eps"),  # a ~5% scale of every row: cosine stays above 0.999
    ("rms_norm", "dtype cast dropped"),  # bf16 where the original gives fp32: the values agree
    ("geglu", "approximate flipped (tanh -> erf)"),  # <= 1e-3 relative: far above fp32 rounding
    ("geglu", "approximate flipped (erf -> tanh)"),
    ("rope", "dtype cast dropped"),
}

# fused_optimizer mutants that the e2e loss rule (1% of the smoothed loss, over 60 steps here)
# lets through: their effect on a short loss curve stays far below the tolerance
E2E_BLIND = {("fused_optimizer", "param groups lost (no-decay params decayed)")}


# -- running --------------------------------------------------------------------------------------


def fuse_example(ex: Example):
    pattern = get_pattern(ex.pattern)
    found = [f for f in pattern.FUSE if f.name == ex.name]
    assert found, f"{ex.pattern} has no FUSE example {ex.name!r} any more: update tests/mutation_support.py"
    return found[0]


def finding_of(ex: Example) -> Finding:
    findings, _ = detect_all(get_pattern(ex.pattern), fuse_example(ex).code)
    assert len(findings) > ex.finding, f"{ex.pattern}/{ex.name}: the detector no longer finds site #{ex.finding}"
    return findings[ex.finding]


def run_snippet(ex: Example) -> str:
    run = ex.run or fuse_example(ex).run or AFFINITY_RUNS.get(ex.name, "")
    assert run, f"{ex.pattern}/{ex.name}: no run snippet to capture inputs from"
    return run


def mutate(fused: str, mutant: Mutant) -> str:
    for before, after in mutant.edits:
        assert before in fused, f"{mutant.id}: anchor {before!r} is gone from the {mutant.example} fused code: update MUTANTS"
        fused = fused.replace(before, after)
    return fused


def capture(ex: Example, root: Path, seed: int) -> Path:
    """Run the example's snippet on the original module and save the target's first call (the
    format ``verify op --capture`` reads)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.py").write_text(fuse_example(ex).code)
    out = root / "call.pt"
    qualname = finding_of(ex).qualname
    done: list[bool] = []

    def record(is_method: bool, args: tuple, kwargs: dict) -> None:
        if not done:
            done.append(True)
            save_capture(out, is_method, args, kwargs, 64 << 20, qualname)

    with inp.user_module(root, "model.py") as module:
        install_capture(module, qualname, record)
        torch.manual_seed(seed)
        exec(compile(run_snippet(ex), "<run>", "exec"), module.__dict__)
    assert out.exists(), f"{ex.name}: the run snippet never called {qualname}"
    return out


class Workspace:
    """One folder per check under ``base``; captures cached per (example, seed)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.captures: dict[tuple[str, int], Path] = {}
        self.candidates: dict[tuple[str, str], Candidate] = {}
        self.n = 0

    def capture(self, ex: Example, seed: int) -> Path:
        key = (ex.name, seed)
        if key not in self.captures:
            self.captures[key] = capture(ex, self.base / f"cap_{ex.name}_{seed}", seed)
        return self.captures[key]

    def applied(self, ex: Example, fused: str | None = None) -> Candidate:
        """The example "applied" with ``fused`` (default: the detector's own code), as verify loads it."""
        f = finding_of(ex)
        if fused is not None:
            f = dataclasses.replace(f, fused=fused)
        key = (ex.name, f.fused)
        if key not in self.candidates:
            root = self.base / f"applied{len(self.candidates)}"
            if root.exists():
                shutil.rmtree(root)
            root.mkdir(parents=True)
            (root / "model.py").write_text(fuse_example(ex).code)
            sd = h.fake_apply(root, "model.py", [f])
            scan = json.loads((sd / "scan.json").read_text())
            for c in scan["candidates"]:  # what the real scan records for this pattern
                c["api"], c["training_ok"] = get_pattern(ex.pattern).api, f.training_ok
            (sd / "scan.json").write_text(json.dumps(scan))
            self.candidates[key] = load_candidate(1, sd)
        return self.candidates[key]

    def op_check(self, ex: Example, fused: str | None = None, dtype: str | None = None, seed: int = 0) -> OpReport:
        """`verify op` (the check itself, no state change) of the example applied with ``fused``,
        on its captured inputs (cast to ``dtype`` when given)."""
        cap = self.capture(ex, seed)
        self.n += 1
        return run_op_check(self.applied(ex, fused), OpOptions(dtype=dtype, seed=seed, backend="emulated"), cap)


def seed_alone_passes(report: OpReport) -> bool:
    """Would the seed criterion alone (cosine > 0.999 or max-abs < 1e-4 on every compared tensor)
    have passed this fused branch? It needs numbers for every tensor of the original: a branch that
    raised, returned another number of tensors or lost a gradient gives none."""
    if any(r.startswith(("the fused branch raised", "the fused branch returns", "the fused backward raised")) for r in report.reasons):
        return False
    return bool(report.checks) and all(c.cosine is not None and c.seed_ok for c in report.checks)


# -- fused_optimizer: the e2e loss rule -------------------------------------------------------------

OPT_STEPS = 60
OPT_LOOP = """
torch.manual_seed({seed})
model = Net()
opt = build(model)
x, y = torch.randn(32, 8), torch.randn(32, 4)
losses = {{}}
for step in range(1, {steps} + 1):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses[step] = loss.item()
"""


@dataclass
class OptResult:
    passed: bool
    reason: str
    check: stats.LossCheck | None
    constructed: int


def _exec_module(code: str, name: str) -> dict[str, Any]:
    mod = types.ModuleType(name)
    mod.__file__ = f"<{name}>"
    sys.modules[name] = mod
    try:
        exec(compile(code, f"<{name}>", "exec"), mod.__dict__)
    finally:
        sys.modules.pop(name, None)
    return mod.__dict__


def optimizer_check(ex: Example, fused: str | None = None, seed: int = 0, steps: int = OPT_STEPS) -> OptResult:
    """Baseline vs fused training loss of the example's model, judged as ``verify e2e`` judges it."""
    code = fuse_example(ex).code
    f = finding_of(ex)
    if fused is not None:
        f = dataclasses.replace(f, fused=fused)
    loop = OPT_LOOP.format(seed=seed, steps=steps)
    base = _exec_module(code, "opt_baseline")
    exec(loop, base)
    with emulate.install() as emu:
        try:
            ns = _exec_module(splice(code, [f]), "opt_fused")
            exec(loop, ns)
        except Exception as exc:
            return OptResult(False, f"the fused run raised {type(exc).__name__}: {exc}", None, 0)
        constructed = sum(v for k, v in emu.calls.items() if k.startswith("optim.Npu"))
    if not constructed:
        return OptResult(False, "fused optimizer never constructed", None, 0)
    check = stats.compare_losses(base["losses"], ns["losses"], min_steps=steps - stats.DEFAULT_SKIP)
    return OptResult(check.passed, check.reason or f"loss within {check.tolerance:.0%} (max smoothed rel diff {check.max_rel_diff:.3%})", check, constructed)
