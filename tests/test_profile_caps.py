"""Issue 18 item 3: no share of the step passes 100%, and where the input forces more the output says
why (a step time shorter than the kernels, kernels of one stream overlapping in time).

The forcing inputs are (a) the real AlexNet Level1 profile with its step_trace_time.csv's Stage cut
to 1 ms (the kernels span ~116 ms), (b) a stream whose kernels each start 1 us after the previous
one but run 100 us, (c) the real msprof-analyze compute_advice cut, which repeats rows
(4 x MatMulV5 at one start time): inconsistent timestamps as published.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from npufuse.cli import main
from npufuse.profile.analysis import analyze

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "real_profiles"
ALEX = REAL / "msinsight_alexnet"
MSPROF = REAL / "msprof_analyze" / "test" / "ut" / "advisor"
real = pytest.mark.skipif(not ALEX.is_dir(), reason="shared real profiler fixtures not present")

EVERY_INPUT = [ALEX / "level0", ALEX / "level1", ALEX / "level2",
               ALEX / "level0" / "rank1_ascend_pt", ALEX / "level2" / "rank0_ascend_pt",
               MSPROF / "advisor_backend" / "compute_advice" / "kernel_details.csv",
               MSPROF / "compute_advice" / "data" / "kernel_details.csv",
               MSPROF / "timeline_advice" / "trace_view.json"]


def _shares(obj: object, path: str = "") -> list[tuple[str, float]]:
    """Every number whose key ends in 'share', anywhere in the result (per rank, per stream too)."""
    out: list[tuple[str, float]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and str(k).endswith("share"):
                out.append((f"{path}.{k}", float(v)))
            else:
                out += _shares(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _shares(v, f"{path}[{i}]")
    return out


def _within_step(r: dict) -> None:
    shares = _shares(r)
    assert shares
    for where, v in shares:
        assert 0.0 <= v <= 1.0, (where, v)
    g = r["gaps"]
    assert g.get("host_bound_share", 0.0) + g.get("wait_share", 0.0) <= 1.0 + 1e-6
    c = r["communication"]
    assert c["exposed_share"] <= c["share"] + 1e-9


@real
@pytest.mark.parametrize("path", EVERY_INPUT, ids=lambda p: "/".join(p.parts[-2:]))
def test_no_share_or_gap_exceeds_100_percent_on_every_real_input(path: Path) -> None:
    # acceptance: every level, every rank alone and together, every published file
    r = analyze([str(path)])
    assert r["usable"]
    _within_step(r)
    step = {p["rank"]: p["step_time_us"] for p in r["totals"]["per_rank"]}
    for rank in r["gaps"]["per_rank"]:
        if step[rank["rank"]] > 0:
            assert rank["host_bound_us"] + rank["wait_us"] <= step[rank["rank"]] * 1.0001


@real
@pytest.mark.parametrize("level", ["level0", "level1", "level2"])
def test_consistent_real_input_is_not_capped(level: str) -> None:
    # the AlexNet step holds every kernel: nothing is capped, so no cap note either
    r = analyze([str(ALEX / level)])
    assert not [p for p in r["problems"] if "100%" in p["message"]]
    assert max(v for _, v in _shares(r)) < 1.0


def _short_step_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "level1"
    shutil.copytree(ALEX / "level1", dst)
    for st in dst.glob("rank*_ascend_pt/ASCEND_PROFILER_OUTPUT/step_trace_time.csv"):
        head, row = st.read_text().splitlines()[:2]
        cols = head.split(",")
        cells = row.split(",")
        cells[cols.index("Stage")] = "1000"
        st.write_text(head + "\n" + ",".join(cells) + "\n")
    return dst


@real
def test_a_step_shorter_than_its_kernels_is_capped_and_named(tmp_path: Path) -> None:
    r = analyze([str(_short_step_copy(tmp_path))])
    assert r["usable"]
    _within_step(r)
    assert r["totals"]["step_time_us"] == pytest.approx(1000.0)
    # the shares that would be far past 100% (communication alone is ~85 ms here) are shown as 100%
    assert r["communication"]["share"] == 1.0 and r["communication"]["exposed_share"] == 1.0
    assert any(s["share"] == 1.0 for s in r["sequences"]["by_time"])
    msgs = [p["message"] for p in r["problems"]]
    # why, per rank, with both figures, and what was done about it
    short = [m for m in msgs if "shorter than the kernels' own span" in m]
    assert len(short) == 2 and all("1,000.0 us" in m for m in short)
    assert any(m.startswith("communication time exceeds the step time") and "shown as 100%" in m for m in msgs)
    assert not [m for m in msgs if m.startswith("kernels of stream")]


@real
def test_the_cap_and_its_reason_reach_the_markdown(tmp_path: Path) -> None:
    md = tmp_path / "p.md"
    assert main(["profile", str(_short_step_copy(tmp_path)), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "### Input problems" in text
    problems = text.split("### Input problems", 1)[1]
    assert "shorter than the kernels" in problems and "shown as 100%" in problems
    assert "1000%" not in text and "8551" not in text


def test_overlapping_kernels_on_one_stream_are_capped_and_named(tmp_path: Path) -> None:
    # each kernel starts 1 us after the previous but lasts 100 us: one stream cannot do that. The
    # "Add > Mul" windows span 101 us each, 40 of them in a ~180 us step
    head = "Step Id,Stream ID,Name,Type,Accelerator Core,Start Time(us),Duration(us),Wait Time(us)\n"
    rows = []
    for k in range(80):
        typ = "Add" if k % 2 == 0 else "Mul"
        rows.append(f"1,3,{typ}_{k},{typ},AI_VECTOR_CORE,{1000 + k},100,0")
    p = tmp_path / "kernel_details.csv"
    p.write_text(head + "\n".join(rows) + "\n")
    r = analyze([str(p)])
    assert r["usable"]
    _within_step(r)
    top = r["sequences"]["by_time"][0]
    assert top["kernels"][:2] in (["Add", "Mul"], ["Mul", "Add"]) and top["share"] == 1.0
    msgs = [q["message"] for q in r["problems"]]
    assert any("kernels of stream 3 overlap in time" in m and "8,000.0 us of kernel time" in m for m in msgs)
    assert any("exceeds the step time" in m and "shown as 100%" in m for m in msgs)


def test_kernels_one_after_another_raise_no_overlap_problem(tmp_path: Path) -> None:
    # the same kernels laid out as a stream runs them: no problem, no cap
    head = "Step Id,Stream ID,Name,Type,Accelerator Core,Start Time(us),Duration(us),Wait Time(us)\n"
    rows = [f"1,3,k{k},{'Add' if k % 2 == 0 else 'Mul'},AI_VECTOR_CORE,{1000 + 101 * k},100,0" for k in range(80)]
    p = tmp_path / "kernel_details.csv"
    p.write_text(head + "\n".join(rows) + "\n")
    r = analyze([str(p)])
    assert r["usable"] and not r["problems"]
    assert max(v for _, v in _shares(r)) < 1.0


@real
def test_published_duplicate_rows_are_named_as_overlap() -> None:
    # the msprof-analyze compute_advice cut repeats rows (4 x MatMulV5 at one start time, a
    # FlashAttentionScore twice): 10,061 us of kernel time in 8,092 us of one stream's wall-clock
    r = analyze([str(MSPROF / "compute_advice" / "data" / "kernel_details.csv")])
    msgs = [q["message"] for q in r["problems"]]
    assert any("kernels of stream 2 overlap in time" in m and "10,061.2 us" in m for m in msgs), msgs
    _within_step(r)
