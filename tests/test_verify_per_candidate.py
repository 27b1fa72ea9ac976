"""Per-candidate switches and `verify e2e --all` (issue 17 item 1).

Two rms_norm sites of one file share the pattern-wide switch NPUFUSE_RMS_NORM, as `npufuse
apply` writes them; the second one's fused branch is wrong (scales by 1.05). Each candidate is
verified with its own switch, so the first passes and the second fails — with one shared
switch both runs would have included the broken site."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from test_verify_helpers import FAKE_TORCH_NPU, PY, fake_apply

from npufuse.cli import main
from npufuse.patterns.base import Finding
from npufuse.rewrite.codegen import PRELUDE
from npufuse.state import State
from npufuse.verify.jsonl import read_jsonl

TWO_SITES = textwrap.dedent(
    '''\
    import math


    class Vec(list):
        is_npu = True


    def norm(x, w, eps):
        ms = sum(v * v for v in x) / len(x)
        r = 1.0 / math.sqrt(ms + eps)
        return [v * r * wi for v, wi in zip(x, w)]


    def norm2(x, w, eps):
        ms = sum(v * v for v in x) / len(x)
        r = 1.0 / math.sqrt(ms + eps)
        return [v * r * wi for v, wi in zip(x, w)]
    '''
)
TRAIN = textwrap.dedent(
    '''\
    import math, os, sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fakemodel

    x, w = [0.5, -1.0, 2.0, 0.25], [1.0, 0.9, 1.1, 1.2]
    for step in range(1, int(sys.argv[1]) + 1):
        a = sum(abs(v) for v in fakemodel.norm(fakemodel.Vec(x), w, 1e-6))
        b = sum(abs(v) for v in fakemodel.norm2(fakemodel.Vec(x), w, 1e-6))
        loss = (2.0 * math.exp(-step / 20) + 0.5) * (a + b) / 8
        print(f"step {step} loss {loss:.6f} step_time {0.1 * (1 + 0.02 * math.sin(step * 1.7)):.6f}", flush=True)
    '''
)
OK = "return torch_npu.npu_rms_norm(x, w, eps)"
WRONG = "return [v * 1.05 for v in torch_npu.npu_rms_norm(x, w, eps)]"


def two_site_repo(tmp: Path) -> Path:
    (tmp / "fakemodel.py").write_text(TWO_SITES)
    (tmp / "torch_npu.py").write_text(FAKE_TORCH_NPU)
    (tmp / "train.py").write_text(TRAIN)
    findings = [Finding(pattern="rms_norm", qualname="norm", line=9, end_line=11, params={}, fused=OK, guard_tensor="x"),
                Finding(pattern="rms_norm", qualname="norm2", line=15, end_line=17, params={}, fused=WRONG, guard_tensor="x")]  # fmt: skip
    sd = fake_apply(tmp, "fakemodel.py", findings, pattern_switch=True)
    state = State.load(sd)
    for cid in (1, 2):
        state.set_status(cid, "e2e_checking", "op check passed (test set-up)")
    state.save()
    return sd


def e2e(sd: Path, *args: str) -> int:
    return main(["verify", "e2e", *args, "--state-dir", str(sd), "--cmd", f"{PY} train.py 40", "--steps", "20", "--min-effect", "1000", "--quiet"])


def test_prelude_site_switch_semantics(monkeypatch: pytest.MonkeyPatch) -> None:
    ns: dict = {}
    exec(compile(PRELUDE, "prelude", "exec"), ns)
    site = ns["_npufuse_site"]
    for k in ("NPUFUSE_ONLY", "NPUFUSE_OFF"):
        monkeypatch.delenv(k, raising=False)
    assert site(3) and site(12)
    monkeypatch.setenv("NPUFUSE_OFF", "3, 5")
    assert not site(3) and not site(5) and site(12) and site(35)
    monkeypatch.delenv("NPUFUSE_OFF")
    monkeypatch.setenv("NPUFUSE_ONLY", "12")
    assert site(12) and not site(1) and not site(2)
    monkeypatch.setenv("NPUFUSE_ONLY", "none")
    assert not site(12)


def test_guards_share_the_pattern_switch_but_each_has_its_own(tmp_path: Path) -> None:
    two_site_repo(tmp_path)
    text = (tmp_path / "fakemodel.py").read_text()
    assert text.count('_npufuse_switch("NPUFUSE_RMS_NORM")') == 2
    assert "_npufuse_site(1)" in text and "_npufuse_site(2)" in text


def test_each_candidate_is_verified_with_its_own_switch(tmp_path: Path) -> None:
    sd = two_site_repo(tmp_path)
    assert e2e(sd, "1") == 0
    c1 = State.load(sd).candidates[1]
    ev = c1.evidence["e2e"]
    assert c1.status == "concluded" and ev["switch"]["kind"] == "site" and ev["loss"]["max_rel_diff"] < 1e-9
    assert "NPUFUSE_OFF=1" in ev["switch"]["describe"]
    assert e2e(sd, "2") == 1
    c2 = State.load(sd).candidates[2]
    assert c2.status == "e2e_failed" and c2.verdict == "do not replace: e2e"


def test_all_runs_one_baseline_each_alone_then_jointly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = two_site_repo(tmp_path)
    assert e2e(sd, "--all") == 1  # candidate 2 (and so the joint run) fails
    out = capsys.readouterr().out
    assert "4 runs" in out and "candidate 1 alone: concluded" in out and "candidate 2 alone: e2e_failed" in out
    summary = json.loads((sd / "e2e_all.json").read_text())
    assert list(summary["runs"]) == ["baseline", "alone_1", "alone_2", "joint"]  # N+2 runs, labelled
    assert summary["runs"]["baseline"]["env"] == {"NPUFUSE_ONLY": "none"} and summary["runs"]["baseline"]["by_site"] == {}
    assert summary["runs"]["alone_2"]["env"] == {"NPUFUSE_ONLY": "2"}
    joint = summary["runs"]["joint"]
    assert joint["env"] == {"NPUFUSE_ONLY": "1,2"} and joint["by_site"]["1"] > 0 and joint["by_site"]["2"] > 0 and not joint["passed"]
    # one baseline process: the per-candidate baseline files are copies of it, not runs
    logs = sorted(p.name for p in sd.glob("e2e_*.log"))
    assert logs == ["e2e_1_fused.log", "e2e_2_fused.log", "e2e_all_baseline.log", "e2e_all_joint.log"]
    b1, b2 = read_jsonl(sd / "e2e_1_baseline.jsonl"), read_jsonl(sd / "e2e_2_baseline.jsonl")
    assert [r["loss"] for r in b1] == [r["loss"] for r in b2] and b1[0]["shared_baseline"] == [1, 2] and b2[0]["candidate"] == 2
    j = read_jsonl(sd / "e2e_all_joint.jsonl")
    assert j[0]["run"] == "joint" and j[0]["candidates"] == [1, 2]
    state = State.load(sd)
    c1, c2 = state.candidates[1], state.candidates[2]
    assert c1.status == "concluded" and c1.evidence["e2e"]["mode"] == "alone" and c1.evidence["e2e"]["proof"]["baseline_site_calls"] == 0
    assert c2.status == "e2e_failed"
    assert c1.evidence["e2e_joint"]["passed"] is False and any(r.startswith("joint run") for r in c1.reasons)


def test_all_refuses_a_site_without_its_own_switch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "fakemodel.py").write_text(TWO_SITES)
    f = Finding(pattern="rms_norm", qualname="norm", line=9, end_line=11, params={}, fused=OK, guard_tensor="x")
    sd = fake_apply(tmp_path, "fakemodel.py", [f], site_switch=False)
    state = State.load(sd)
    state.set_status(1, "e2e_checking", "test set-up")
    state.save()
    assert e2e(sd, "--all") == 2
    err = capsys.readouterr().err
    assert "no per-candidate switch" in err and "npufuse revert 1" in err and "Traceback" not in err
    assert e2e(sd, "1", "--all") == 2 and "not both" in capsys.readouterr().err


def test_prelude_autocast_helper_casts_only_inside_autocast() -> None:
    import torch

    ns: dict = {}
    exec(compile(PRELUDE, "prelude", "exec"), ns)
    cast = ns["_npufuse_autocast"]
    q, v, d = torch.randn(2, 3), torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(2, 3, dtype=torch.float64)
    out = cast(q, v, d)
    assert [t.dtype for t in out] == [torch.float32, torch.bfloat16, torch.float64]  # outside autocast: as given
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cast(q, v, d)
    assert [t.dtype for t in out] == [torch.bfloat16, torch.bfloat16, torch.float64]  # autocast leaves float64 alone
