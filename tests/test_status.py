"""`npufuse status`: the task list from state.json + scan.json, table and --json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import test_verify_helpers as h
from npufuse.cli import main
from npufuse.state import State
from npufuse.status_command import next_step


def test_no_state_yet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--state-dir", str(tmp_path / ".npufuse")]) == 0
    assert "npufuse scan" in capsys.readouterr().out
    assert main(["status", "--state-dir", str(tmp_path / ".npufuse"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = h.rms_repo(tmp_path)
    # a second scanned candidate that was never accepted
    scan = json.loads((sd / "scan.json").read_text())
    scan["candidates"].append({"id": 2, "key": "swiglu@model.py:MLP.forward", "pattern": "swiglu", "file": "model.py", "qualname": "MLP.forward", "line": 30, "end_line": 31})
    (sd / "scan.json").write_text(json.dumps(scan))
    state = State.load(sd)
    state.set_status(1, "concluded")
    state.candidates[1].verdict = "replace: faster"
    state.candidates[1].evidence["perf"] = {"verdict": "faster", "speedup": 1.2, "ci_low": 1.1, "ci_high": 1.3, "backend": "real"}
    state.save()
    assert main(["status", "--state-dir", str(sd)]) == 0
    out = capsys.readouterr().out
    for text in ("rms_norm", "concluded", "replace: faster", "npufuse report html 1", "swiglu", "pending (not applied)", "npufuse apply --accept 2", "model.py:30"):
        assert text in out, text
    assert main(["status", "--state-dir", str(sd), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in rows] == [1, 2]
    assert rows[0]["line"] == State.load(sd).candidates[1].applied["span"][0]  # where the rewritten site is now
    assert rows[0]["evidence"]["perf"]["speedup"] == 1.2 and rows[1]["applied"] is False


def test_repo_text_is_not_rich_markup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = h.rms_repo(tmp_path)
    state = State.load(sd)
    state.candidates[1].verdict = "[bold red]x[/]"
    state.save()
    assert main(["status", "--state-dir", str(sd)]) == 0
    assert "[bold red]x[/]" in capsys.readouterr().out


@pytest.mark.parametrize(
    "status, applied, verdict, evidence, expected",
    [
        ("pending", False, None, {}, "npufuse apply --accept 3"),
        ("pending", True, None, {}, "npufuse verify op 3"),
        ("accuracy_failed", True, "do not replace: accuracy", {}, "npufuse revert 3"),
        ("e2e_checking", True, None, {}, 'npufuse verify e2e 3 --cmd "<your launch command>"'),
        ("perf_checking", True, None, {"e2e": {"cmd": "python train.py --lr 1e-3"}}, "npufuse verify e2e 3 --cmd 'python train.py --lr 1e-3'"),
        ("e2e_failed", True, "do not replace: e2e", {}, "npufuse revert 3"),
        ("concluded", True, "do not replace: slower", {}, "npufuse revert 3"),
        ("concluded", True, "no measurable change", {}, "npufuse report html 3"),
    ],
)
def test_next_step(status: str, applied: bool, verdict: str | None, evidence: dict, expected: str) -> None:
    assert next_step(3, status, applied, verdict, evidence) == expected


def test_unreadable_state_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = tmp_path / ".npufuse"
    sd.mkdir()
    (sd / "state.json").write_text("{not json")
    assert main(["status", "--state-dir", str(sd)]) == 2
    err = capsys.readouterr().err
    assert "unreadable state file" in err and err.count("\n") == 1
