"""`verify op` and outputs the fused API does not produce by design.

HF's eager attention returns ``(attn_output, attn_weights)``; ``npu_fusion_attention`` does not
materialise the probabilities, so the attention replacement sets ``attn_weights = None`` (scan:
``params.returns_probs``, a risk). verify op reports such an output as "not compared: <reason>"
instead of failing — but only that output, only while the fused branch really returns None
there, and only at the places every ``return`` of the target puts that very name.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest
import torch

import mutation_support as ms
from npufuse.report.html import build_report_data
from npufuse.verify import opcheck
from npufuse.verify.candidate import NOT_PRODUCED_PARAMS, load_candidate, returned_names
from npufuse.verify.opcheck import OpOptions, verify_op

LLAMA = ms.Example("attention", "hf_llama_eager_gqa")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> ms.Workspace:
    return ms.Workspace(tmp_path_factory.mktemp("not_produced"))


# -- which returned places hold the name -------------------------------------------------------------

SOURCE = textwrap.dedent("""\
    class Attn:
        def forward(self, q):
            w = q
            out = q
            if q is None:
                return out, None
            def inner():
                return w, out  # a nested function's return is not the target's
            return out, w

        def two_places(self, q):
            if q:
                return q, w
            return w, q

        def starred(self, q):
            return (*q, w)

        def nested(self, q):
            return {"a": out, "b": (q, w)}

    def free(q):
        return w
    """)


@pytest.mark.parametrize("qualname, expected", [
    ("Attn.forward", {"out[1]": "w"}),  # `return out, None` fills no second place; inner() is not the target
    ("Attn.two_places", {}),  # w at place 1 in one return, place 0 in the other: never excused
    ("Attn.starred", {}),  # the places after a starred element depend on the run
    ("Attn.nested", {"out['b'][1]": "w"}),
    ("free", {"out": "w"}),
    ("Attn.missing", {}),
])  # fmt: skip
def test_returned_names(qualname: str, expected: dict[str, str]) -> None:
    assert returned_names(SOURCE, qualname, {"w"}) == expected


def test_returned_names_of_an_unparseable_file_are_none() -> None:
    assert returned_names("def f(:\n", "f", {"w"}) == {}


# -- the candidate as verify loads it ----------------------------------------------------------------


def test_scan_record_and_fused_branch_name_the_probabilities(ws: ms.Workspace) -> None:
    cand = ws.applied(LLAMA)
    assert cand.scan["params"]["returns_probs"] == "attn_weights"
    assert cand.not_produced() == {"out[1]": ("attn_weights", NOT_PRODUCED_PARAMS["returns_probs"])}


def test_rescanned_candidate_falls_back_on_the_replacement_comment(ws: ms.Workspace) -> None:
    cand = ws.applied(LLAMA)
    sd = cand.state_dir
    saved = (sd / "scan.json").read_text()
    try:
        (sd / "scan.json").write_text(json.dumps({"tool": "npufuse", "root": str(cand.root), "candidates": []}))
        again = load_candidate(1, sd)
        assert again.scan == {} and list(again.not_produced()) == ["out[1]"]
    finally:
        (sd / "scan.json").write_text(saved)


def test_scan_saying_nothing_is_unproduced_is_believed(ws: ms.Workspace) -> None:
    cand = ws.applied(LLAMA)
    told = dataclasses.replace(cand, scan={**cand.scan, "params": {**cand.scan["params"], "returns_probs": None}})
    assert told.not_produced() == {}


def test_a_fused_branch_that_computes_the_probabilities_is_compared(ws: ms.Workspace) -> None:
    fused = ms.finding_of(LLAMA).fused
    line = next(ln for ln in fused.splitlines() if ln.lstrip().startswith("attn_weights = None"))
    indent = line[: len(line) - len(line.lstrip())]   # the fused body sits under the mask-value check
    cand = ws.applied(LLAMA, fused.replace(line, indent + "attn_weights = torch.zeros(1)"))
    assert cand.not_produced() == {}


# -- the op check --------------------------------------------------------------------------------------


def _mutant(name: str, example: str, *edits: tuple[str, str]) -> ms.Mutant:
    return ms.M("attention", name, example, *edits)


PROBS_LINE = "attn_weights = None  # the fused op does not materialise the probabilities (as HF's sdpa/flash paths)"
# Each must be rejected although the probabilities are excused. fp16: the example's fp32 case
# carries an emulator rounding issue of its own (test_verify_mutations_registry).
MUST_FAIL = [
    (_mutant("missing scale", "hf_llama_eager_gqa", ("scale=scaling", "scale=1.0")), "out[0]:"),
    (_mutant("inverted mask", "hf_llama_eager_gqa", ("] < 0) if attention_mask", "] >= 0) if attention_mask")), "out[0]:"),
    # something other than None where the probabilities were: compared, and wrong
    (_mutant("zeros for the probabilities", "hf_llama_eager_gqa", (PROBS_LINE, "attn_weights = torch.zeros(query.shape[:-1] + (key.shape[-2],), dtype=query.dtype)")), "out[1]:"),
    # None for the attention output itself, which is supposed to be produced
    (_mutant("None for the output", "gpt_neo_fp32_qk_bottom_right_plus_padding", ("attn_output = torch_npu.npu_fusion_attention(", "attn_output = None; _npufuse_unused = torch_npu.npu_fusion_attention(")),
     "the fused branch returns 0 tensors"),
]  # fmt: skip


@pytest.mark.parametrize("m, expect", MUST_FAIL, ids=[m.name for m, _ in MUST_FAIL])
def test_broken_attention_with_probabilities_still_fails(ws: ms.Workspace, m: ms.Mutant, expect: str) -> None:
    ex = ms.EXAMPLE.get(m.example) or ms.Example("attention", m.example)
    report = ws.op_check(ex, ms.mutate(ms.finding_of(ex).fused, m), dtype="float16")
    assert not report.passed
    assert any(expect in r for r in report.reasons), report.reasons


def test_none_moved_to_another_place_fails(ws: ms.Workspace) -> None:
    """The output and the None swapped: compared place by place, it fails (no pairing of unrelated tensors)."""
    ex = ms.Example("attention", "gpt_neo_fp32_qk_bottom_right_plus_padding")
    fused = ms.finding_of(ex).fused.replace("    " + PROBS_LINE + "\n", "").replace("attn_output = torch_npu.npu_fusion_attention(", "attn_weights = torch_npu.npu_fusion_attention(")
    report = ws.op_check(ex, fused + "\nattn_output = None", dtype="float16")
    assert not report.passed and not report.not_compared
    assert any(r.startswith("the fused branch returns 1 tensors (out[1])") for r in report.reasons), report.reasons


def test_pass_records_not_compared_in_state_jsonl_and_html(ws: ms.Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    ex = ms.Example("attention", "gpt_neo_fp32_qk_bottom_right_plus_padding")  # fp16: its own precision
    cap = ws.capture(ex, 0)
    cand = ws.applied(ex)
    # the captured call of the example's run snippet stands in for `--capture CMD`
    monkeypatch.setattr(opcheck, "capture_inputs", lambda *a, **k: cap)
    report = verify_op(cand, OpOptions(capture="(captured)", backend="emulated"))
    assert report.passed, report.reasons
    line = "out[1] (`attn_weights`): not compared: the attention probabilities"
    assert len(report.not_compared) == 1 and report.not_compared[0].startswith(line)
    assert "not through out[1]" in report.backward
    state = json.loads((cand.state_dir / "state.json").read_text())
    entry = state["candidates"][0]
    assert entry["status"] == "e2e_checking" and any(r.startswith(line) for r in entry["reasons"]), entry["reasons"]
    summary = json.loads(Path(report.jsonl).read_text().splitlines()[-1])
    assert summary["passed"] and summary["not_compared"] == report.not_compared
    page = build_report_data(cand.state_dir)["candidates"][0]
    assert any(r.startswith(line) for r in page["reasons"]), page["reasons"]
