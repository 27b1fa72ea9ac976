"""join_with_scan / render_section_1_2 with hand-made scan.json candidates."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from npufuse.profile.analysis import analyze
from npufuse.profile.join import join_with_scan, render_section_1_2

LLAMA = Path(__file__).parents[1].parent / "shared" / "fixtures" / "ascend_profile" / "llama_like"


def cand(id_: int, pattern: str, file: str, line: int, end_line: int) -> dict:
    return {"id": id_, "key": f"{pattern}@{file}:{line}", "pattern": pattern, "file": file, "line": line,
            "end_line": end_line, "params": {}}


@pytest.fixture(scope="module")
def profile() -> dict:
    if not LLAMA.is_dir():
        pytest.skip("shared fixtures not present")
    return analyze([str(LLAMA)])


def test_links_by_call_stack_and_ranks_by_time(profile: dict) -> None:
    cands = [cand(1, "rms_norm", "model.py", 25, 31), cand(2, "rope", "model.py", 44, 49),
             cand(3, "attention", "model.py", 78, 86), cand(4, "swiglu", "other.py", 101, 101),
             cand(5, "swiglu", "demo/model.py", 99, 102)]
    before = copy.deepcopy(profile)
    ranked, unexplained = join_with_scan(profile, cands)
    assert profile == before                               # pure
    ids = [c["id"] for c in ranked]
    assert ids[0] == 3                                     # attention: the most measured time
    times = [c["profile"]["time_us"] for c in ranked if c["profile"]]
    assert times == sorted(times, reverse=True)
    by_id = {c["id"]: c for c in ranked}
    assert by_id[4]["profile"] is None                     # other.py is not in the stack
    assert by_id[5]["profile"]["link"] == "stack"          # demo/model.py is a suffix of /workspace/demo/model.py
    rms = by_id[1]["profile"]
    # rms_norm and the add_rms_norm sequences whose norm runs at model.py:31 all link to candidate 1
    assert rms["count"] >= 16 and not rms["same_pattern"]
    assert ids[-1] == 4
    left = {u["pattern"] for u in unexplained if u["source_kind"] == "fusion"}
    assert {"confusion_transpose", "fast_gelu", "fused_optimizer"} <= left
    assert not left & {"rms_norm", "rope", "attention", "swiglu"}
    assert all(u["reason"] for u in unexplained)


def test_same_pattern_candidate_wins(profile: dict) -> None:
    cands = [cand(1, "rms_norm", "model.py", 25, 31), cand(2, "add_rms_norm", "model.py", 136, 136)]
    ranked, _ = join_with_scan(profile, cands)
    by_id = {c["id"]: c for c in ranked}
    assert by_id[2]["profile"]["same_pattern"] is True
    assert any(s.startswith("S") for s in by_id[2]["profile"]["sequences"])


def test_pattern_link_without_stacks() -> None:
    prof = {"fusions": [{"id": "S1", "pattern": "rope", "kernels": ["Mul", "Neg"], "count": 4, "time_us": 100.0,
                         "share": 0.1, "kernels_launched": 8, "location": None,
                         "roofline": {"speedup_max": 3.0, "verdict": "launch-bound"}, "step_saving_max": 0.06},
                        {"id": "S2", "pattern": "geglu", "api": "torch_npu.npu_geglu", "kernels": ["GeLU", "Mul"],
                         "count": 2, "time_us": 10.0, "share": 0.01, "location": None,
                         "roofline": {"speedup_max": 2.0, "verdict": "memory-bound"}}],
            "unmapped": [{"kernels": ["Exp", "Sub"], "count": 9, "time_us": 50.0, "share": 0.05, "location": None,
                          "pattern": None, "roofline": {"speedup_max": 1.5, "verdict": "memory-bound"}}]}
    cands = [cand(1, "rope", "a.py", 1, 5), cand(2, "rope", "b.py", 1, 5), cand(3, "rms_norm", "c.py", 1, 2)]
    ranked, unexplained = join_with_scan(prof, cands)
    r1 = next(c for c in ranked if c["id"] == 1)["profile"]
    assert r1["link"] == "pattern" and r1["time_us"] == 50.0 and r1["shared_with"] == 2
    assert next(c for c in ranked if c["id"] == 3)["profile"] is None
    assert [u.get("pattern") for u in unexplained] == ["geglu", None]
    md = render_section_1_2(unexplained)
    assert md.startswith("### 1.2")
    assert "npu_geglu" in md and "Exp > Sub" in md and "none known" in md
    assert "explained" in render_section_1_2([])


def test_empty_inputs() -> None:
    assert join_with_scan({}, []) == ([], [])
    ranked, unexplained = join_with_scan({"fusions": []}, [cand(1, "rope", "a.py", 1, 2)])
    assert ranked[0]["profile"] is None and unexplained == []
