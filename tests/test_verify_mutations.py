"""Mutation tests of `verify op` on the demo model as `npufuse scan` + `apply` rewrite it.

Each deliberately wrong fused branch (a text edit of the generated code) must be rejected, and
every correct one must pass with no false alarm (bf16, config-derived shapes, emulated).
``SEED_BLIND`` lists the mutations the seed criterion alone (cosine > 0.999 or max-abs < 1e-4)
would have let through: only the relative-error bound catches them.

Skipped where this build has no scan/apply or no detector for a pattern; a mutation whose
anchor text is gone from the generated code fails loudly (update the mutation, don't lose it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from npufuse.cli import main
from npufuse.verify.candidate import load_candidate
from npufuse.verify.opcheck import OpOptions, verify_op

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_llama"

# pattern -> (name, generated text, mutated text)
MUTATIONS = {
    "rms_norm": [
        ("weight dropped", "_npu_gamma, epsilon", "torch.ones_like(_npu_gamma), epsilon"),
        ("wrong eps", "epsilon=self.variance_epsilon)", "epsilon=self.variance_epsilon * 1e5)"),
    ],
    "rope": [
        ("sin sign flipped", "sin.to(_npufuse_q_dtype_npu))", "(-sin).to(_npufuse_q_dtype_npu))"),
        ("cos/sin swapped", "cos.to(_npufuse_k_dtype_npu), sin.to(_npufuse_k_dtype_npu)", "sin.to(_npufuse_k_dtype_npu), cos.to(_npufuse_k_dtype_npu)"),
    ],
    "attention": [
        ("inverted mask", "_npufuse_mask = attention_mask < 0", "_npufuse_mask = attention_mask >= 0"),
        ("missing scale", "scale=self.scaling,", "scale=1.0,"),
        ("mask dropped", "atten_mask=_npufuse_mask,", "atten_mask=None,"),
    ],
    "swiglu": [
        ("swapped swiglu halves", "torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)", "torch.cat([self.up_proj(x), self.gate_proj(x)], dim=-1)"),
    ],
    "add_rms_norm": [
        ("wrong eps", "epsilon=self.post_attention_layernorm.variance_epsilon)[0]", "epsilon=self.post_attention_layernorm.variance_epsilon * 1e5)[0]"),
    ],
    "moe_experts": [
        ("swapped swiglu halves", "(_npufuse_e.gate_proj.weight, _npufuse_e.up_proj.weight)", "(_npufuse_e.up_proj.weight, _npufuse_e.gate_proj.weight)"),
        ("routing weights dropped", "probs=routing_weights.to(_npufuse_h.dtype)", "probs=torch.ones_like(routing_weights).to(_npufuse_h.dtype)"),
    ],
}
SEED_BLIND = {("rms_norm", "wrong eps"), ("add_rms_norm", "wrong eps")}  # a ~5% per-row scale: cosine stays above 0.999


@pytest.fixture(scope="module")
def applied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    import importlib.util

    if importlib.util.find_spec("npufuse.scan.command") is None or importlib.util.find_spec("npufuse.rewrite.command") is None:
        pytest.skip("this build has no npufuse scan/apply yet")
    repo = tmp_path_factory.mktemp("mut") / "tiny_llama"
    shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__"))
    cwd = os.getcwd()
    os.chdir(repo)
    try:
        assert main(["scan", "."]) in (0, 1)
        scan = json.loads((repo / ".npufuse" / "scan.json").read_text())
        ids = {c["pattern"]: c["id"] for c in scan["candidates"] if c["pattern"] in MUTATIONS}
        if ids:
            assert main(["apply", "--accept", ",".join(str(i) for i in ids.values()), "--force"]) == 0
    finally:
        os.chdir(cwd)
    return repo, ids


def _copy(repo: Path, dest: Path) -> Path:
    shutil.copytree(repo, dest)
    return dest


@pytest.mark.parametrize("pattern", sorted(MUTATIONS))
def test_correct_replacement_passes(applied: tuple[Path, dict[str, int]], pattern: str) -> None:
    repo, ids = applied
    if pattern not in ids:
        pytest.skip(f"no {pattern} detector in this build")
    report = verify_op(load_candidate(ids[pattern], repo / ".npufuse"), OpOptions(dtype="bfloat16", batch=1, seq_len=16))
    assert report.passed, report.reasons


CASES = [(p, *m) for p, ms in MUTATIONS.items() for m in ms]


@pytest.mark.parametrize("pattern, name, before, after", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_mutation_is_rejected(applied: tuple[Path, dict[str, int]], tmp_path: Path, pattern: str, name: str, before: str, after: str) -> None:
    repo, ids = applied
    if pattern not in ids:
        pytest.skip(f"no {pattern} detector in this build")
    copy = _copy(repo, tmp_path / "repo")
    model = copy / "model.py"
    text = model.read_text()
    assert before in text, f"mutation anchor {before!r} is gone from the generated {pattern} code: update MUTATIONS"
    model.write_text(text.replace(before, after, 1))
    report = verify_op(load_candidate(ids[pattern], copy / ".npufuse"), OpOptions(dtype="bfloat16", batch=1, seq_len=16))
    assert not report.passed
    seed_alone_passes = all(c.seed_ok for c in report.checks) and all(c.problem is None or "relative error" in c.problem for c in report.checks)
    assert seed_alone_passes == ((pattern, name) in SEED_BLIND), report.reasons
