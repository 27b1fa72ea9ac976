"""Per-step JSONL: line-by-line writing, torn last lines, and `npufuse merge-jsonl`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from npufuse.cli import main
from npufuse.verify.jsonl import JsonlWriter, load_pair, merge_runs, read_jsonl


def write(path: Path, records: list[dict]) -> Path:
    with JsonlWriter(path) as w:
        for r in records:
            w.write(r)
    return path


def rec(run: str, step: int, loss, t=0.1, **extra) -> dict:
    return {"candidate": 1, "run": run, "step": step, "loss": loss, "step_time": t, **extra}


def test_writer_flushes_each_line(tmp_path: Path) -> None:
    w = JsonlWriter(tmp_path / "a.jsonl")
    w.write(rec("baseline", 1, 2.0))
    # readable before close: a killed run keeps every completed step
    assert read_jsonl(tmp_path / "a.jsonl")[0]["loss"] == 2.0
    w.close()


def test_torn_last_line_is_ignored_but_not_a_middle_one(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(rec("fused", 1, 2.0)) + "\n" + '{"candidate": 1, "run": "fu')
    assert [r["step"] for r in read_jsonl(p)] == [1]
    p.write_text('{"candidate": 1, "ru\n' + json.dumps(rec("fused", 2, 2.0)) + "\n")
    with pytest.raises(ValueError, match=":1: not a JSON object"):
        read_jsonl(p)


def test_merge_runs_nulls_for_missing_and_nonfinite() -> None:
    base = [rec("baseline", 1, 2.0, 0.1, grad_norm=1.0), rec("baseline", 2, 1.9, None), rec("baseline", 3, 1.8, 0.1)]
    fused = [rec("fused", 1, 2.0, 0.09), rec("fused", 2, "nan", 0.09)]
    rows = merge_runs(base, fused)
    assert rows[0] == {"step": 1, "baseline_loss": 2.0, "baseline_step_time": 0.1, "fused_loss": 2.0, "fused_step_time": 0.09, "baseline_grad_norm": 1.0, "fused_grad_norm": None}
    assert rows[1]["fused_loss"] is None and rows[1]["baseline_step_time"] is None
    assert rows[2]["fused_loss"] is None and rows[2]["fused_step_time"] is None and rows[2]["baseline_loss"] == 1.8


def test_merge_jsonl_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    b = write(tmp_path / "b.jsonl", [rec("baseline", s, 3.0 - s / 10) for s in range(1, 4)])
    f = write(tmp_path / "f.jsonl", [rec("fused", s, 3.0 - s / 10, 0.05) for s in (1, 2, 4)])
    assert main(["merge-jsonl", str(b), str(f)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["fused_loss"] is None and rows[3]["baseline_loss"] is None
    out = tmp_path / "m.json"
    assert main(["merge-jsonl", str(b), str(f), "-o", str(out)]) == 0
    assert json.loads(out.read_text()) == rows


def test_merge_jsonl_one_file_with_both_runs(tmp_path: Path) -> None:
    both = write(tmp_path / "all.jsonl", [rec("baseline", 1, 2.0), rec("fused", 1, 2.1), rec("baseline", 2, 1.9), rec("fused", 2, 2.0)])
    b, f = load_pair(both, both)
    rows = merge_runs(b, f)
    assert [(r["baseline_loss"], r["fused_loss"]) for r in rows] == [(2.0, 2.1), (1.9, 2.0)]


def test_merge_jsonl_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["merge-jsonl", str(tmp_path / "nope.jsonl"), str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "nope.jsonl" in err and err.count("\n") == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": "one"}\n')
    assert main(["merge-jsonl", str(bad), str(bad)]) == 2
    assert "integer `step`" in capsys.readouterr().err
