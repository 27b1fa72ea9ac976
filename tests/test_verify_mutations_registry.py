"""Mutation tests of `verify op` over every registered pattern (issue 5, first acceptance item).

For each pattern, deliberately wrong replacements — text edits of the detector's own fused code
for one of its FUSE examples (``tests/mutation_support.py``) — must be rejected by the op check,
and the detector's correct replacements must pass with no false alarm at the example's own
precision and cast to fp32/fp16/bf16, for two input seeds. ``SEED_BLIND`` names the mutants the
seed criterion alone (cosine > 0.999 or max-abs < 1e-4) would have let through; the test asserts
that list, so it stays true. ``fused_optimizer`` has no op check (verify op skips it: there is
no operator to call); its mutants are held to the e2e loss rule instead, whose blind spots are
``E2E_BLIND``. ``bench/mutations.py`` prints the whole table.

A new pattern without at least two mutants fails ``test_every_pattern_has_mutants``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import mutation_support as ms
from npufuse.patterns.registry import all_patterns
from npufuse.verify.opcheck import NOT_OP_LEVEL, compare
from npufuse.verify.probe import LineTrace

OP_EXAMPLES = [e for e in ms.EXAMPLES if e.pattern not in NOT_OP_LEVEL]
OP_MUTANTS = [m for m in ms.MUTANTS if m.pattern not in NOT_OP_LEVEL]
OPT_EXAMPLES = [e for e in ms.EXAMPLES if e.pattern == "fused_optimizer"]
OPT_MUTANTS = [m for m in ms.MUTANTS if m.pattern == "fused_optimizer"]
PRECISIONS = ("float32", "float16", "bfloat16")
SEEDS = (0, 1)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny shapes: on a shared 2-core machine, intra-op threads only contend (30 ms per op instead of 40 µs)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> ms.Workspace:
    return ms.Workspace(tmp_path_factory.mktemp("mutants"))


@pytest.mark.parametrize("pattern", [p.id for p in all_patterns()])
def test_every_pattern_has_mutants(pattern: str) -> None:
    mine = [m for m in ms.MUTANTS if m.pattern == pattern]
    assert len(mine) >= 2, f"{pattern} has {len(mine)} mutants: add at least 2 to MUTANTS in tests/mutation_support.py"
    for m in mine:
        assert m.example in ms.EXAMPLE and ms.EXAMPLE[m.example].pattern == pattern, m.id
        assert ms.mutate(ms.finding_of(ms.EXAMPLE[m.example]).fused, m) != ms.finding_of(ms.EXAMPLE[m.example]).fused


# Known false alarms, each one exact (pattern, example, dtype, seed) and the check it trips; any
# other alarm fails. Since npu_swiglu rounds once in fp32 as the real op does (issue 20 item 2), one
# row of this example's w2 gradient in bf16 seed 1 (a row of small, cancelling sums) exceeds the
# per-row bound (RMS rel err 0.0218 > 0.0183; cosine 0.999994). Double rounding passed it: the
# verdict an NPU would give is the same. Open: widen the row bound for cancelling rows, or not.
KNOWN_FALSE_ALARMS = {("moe_experts", "user_stacked_in_out_unique", "bfloat16", 1): "grad param:w2"}


@pytest.mark.parametrize("ex", OP_EXAMPLES, ids=[f"{e.pattern}-{e.name}" for e in OP_EXAMPLES])
def test_correct_replacement_passes(ws: ms.Workspace, ex: ms.Example) -> None:
    combos = [(None, s) for s in SEEDS] + ([(d, s) for d in PRECISIONS for s in SEEDS] if ex.sweep else [])
    alarms = []
    for dtype, seed in combos:
        report = ws.op_check(ex, dtype=dtype, seed=seed)
        assert report.calls["site_calls_on"] > 0 and report.calls["site_calls_off"] == 0
        known = KNOWN_FALSE_ALARMS.get((ex.pattern, ex.name, dtype, seed))
        if not report.passed and not (known and all(r.startswith(known) for r in report.reasons)):
            alarms.append(f"{dtype or 'own dtypes'}, seed {seed}: {report.reasons[:3]}")
    assert not alarms, "false alarms:\n" + "\n".join(alarms)


@pytest.mark.parametrize("m", OP_MUTANTS, ids=[m.id for m in OP_MUTANTS])
def test_mutant_is_rejected(ws: ms.Workspace, m: ms.Mutant) -> None:
    ex = ms.EXAMPLE[m.example]
    report = ws.op_check(ex, ms.mutate(ms.finding_of(ex).fused, m), m.dtype)
    assert not report.passed and report.reasons
    if m.expect:
        assert any(m.expect in r for r in report.reasons), report.reasons
    assert ms.seed_alone_passes(report) == (m.key in ms.SEED_BLIND), report.reasons


# Eager attention returning its probabilities (HF ``return attn_output, attn_weights``): the fused
# branch returns None for them (npu_fusion_attention does not produce them); verify op reports
# that output as not compared and checks the attention output and its gradients.
PROBS = "out[1] (`attn_weights`): not compared: the attention probabilities"
PROBS_CASES = [("hf_llama_eager_gqa", d, s) for d in ("float16", "bfloat16") for s in SEEDS] + \
              [("gpt_neo_fp32_qk_bottom_right_plus_padding", d, s) for d in (None, "bfloat16") for s in SEEDS]  # fmt: skip


@pytest.mark.parametrize("name, dtype, seed", PROBS_CASES, ids=[f"{n}-{d or 'own'}-{s}" for n, d, s in PROBS_CASES])
def test_attention_returning_probabilities_passes(ws: ms.Workspace, name: str, dtype: str | None, seed: int) -> None:
    report = ws.op_check(ms.Example("attention", name), dtype=dtype, seed=seed)
    assert report.passed, report.reasons
    assert len(report.not_compared) == 1 and report.not_compared[0].startswith(PROBS), report.not_compared
    assert {"out[0]", "grad query", "grad key", "grad value"} <= {c.name for c in report.checks}


def test_bug_emulated_attention_fp32_backward_rounding(ws: ms.Workspace) -> None:
    for name, seed in (("hf_llama_eager_gqa", 0), ("hf_llama_eager_gqa", 3), ("gpt_neo_fp32_qk_bottom_right_plus_padding", 0)):
        report = ws.op_check(ms.Example("attention", name), dtype="float32", seed=seed)
        assert report.passed, (name, seed, report.reasons)


# -- fused_optimizer: no op check; the e2e loss rule -----------------------------------------------


def test_verify_op_has_no_optimizer_check() -> None:
    assert "fused_optimizer" in NOT_OP_LEVEL


@pytest.mark.parametrize("ex", OPT_EXAMPLES, ids=[e.name for e in OPT_EXAMPLES])
def test_optimizer_correct_replacement_passes_the_e2e_loss_rule(ex: ms.Example) -> None:
    for seed in SEEDS:
        result = ms.optimizer_check(ex, seed=seed)
        assert result.passed and result.constructed, result.reason


@pytest.mark.parametrize("m", OPT_MUTANTS, ids=[m.id for m in OPT_MUTANTS])
def test_optimizer_mutant_against_the_e2e_loss_rule(m: ms.Mutant) -> None:
    ex = ms.EXAMPLE[m.example]
    result = ms.optimizer_check(ex, ms.mutate(ms.finding_of(ex).fused, m))
    assert result.passed == (m.key in ms.E2E_BLIND), result.reason


# -- the verify fixes these mutants needed -----------------------------------------------------------


def test_rows_zero_up_to_rounding_are_held_to_the_absolute_tolerance() -> None:
    gen = torch.Generator().manual_seed(0)
    golden = torch.randn(4, 32, generator=gen, dtype=torch.float64)
    golden[1] = torch.randn(32, generator=gen, dtype=torch.float64) * 1e-7  # a gradient that cancels
    orig = golden.float()
    fused = golden.float().clone()
    fused[1] = 0.0  # exact where the original carries rounding noise
    assert compare("grad", "grad_input", golden, orig, fused, 2.0, False).passed
    fused[1] = 5e-4  # an absolute error above the seed's 1e-4 is still judged
    assert not compare("grad", "grad_input", golden, orig, fused, 2.0, False).passed
    scaled = golden.float().clone()
    scaled[2] *= 1.02  # a live row 2% off: still over the row bound
    c = compare("grad", "grad_input", golden, orig, scaled, 2.0, False)
    assert not c.passed and c.rows_over == 1 and c.worst["index"][0] == 2


def test_golden_is_float64_on_the_cpu(ws: ms.Workspace) -> None:
    report = ws.op_check(ms.EXAMPLE["gqa_causal_sq_ne_skv"], dtype="float32")
    assert report.passed, report.reasons  # against an fp32 golden, cancelling rows of grad q failed
    assert {c.golden_dtype for c in report.checks} == {"float64"}


def test_affinity_rewrite_is_proven_by_a_line_trace(ws: ms.Workspace) -> None:
    report = ws.op_check(ms.EXAMPLE["ascend_guide_bbox_clip"])
    assert report.passed, report.reasons
    assert report.calls["proof"].startswith("line trace") and report.calls["site_calls_off"] == 0


def test_line_trace_counts_only_its_span(tmp_path: Path) -> None:
    src = tmp_path / "traced.py"
    src.write_text(textwrap.dedent("""\
        def f(x):
            if x:
                y = 1
            else:
                y = 2
            return y
        """))
    ns: dict = {}
    exec(compile(src.read_text(), str(src), "exec"), ns)
    trace = LineTrace(str(src), (3, 3))
    with trace:
        ns["f"](False)
    assert trace.hits == 0
    with trace:
        ns["f"](True)
    assert trace.hits == 1
