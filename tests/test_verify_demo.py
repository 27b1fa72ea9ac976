"""Verification on the bundled demo (examples/tiny_llama), emulated on CPU.

The rms_norm candidate is applied by the real `npufuse scan` + `npufuse apply` when this build
has them (else by the same libcst splice, see test_verify_helpers), then: `verify op --capture`
with the train script's real first call, `verify e2e --cmd "python train.py --steps 50"` (50
steps, loss check passes, JSONL written), and a deliberately broken fused branch that is
stopped early and marked failed while the completed baseline is reused.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

import test_verify_helpers as h
from npufuse.cli import main
from npufuse.state import State
from npufuse.verify.jsonl import read_jsonl

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_llama"
VENV_BIN = str(Path(h.PY).parent)


def _real_apply_available() -> bool:
    if importlib.util.find_spec("npufuse.scan.command") is None or importlib.util.find_spec("npufuse.rewrite.command") is None:
        return False
    try:
        from npufuse.patterns.registry import get_pattern

        get_pattern("rms_norm")
    except Exception:
        return False
    return True


def _apply_rms_norm(repo: Path) -> tuple[Path, int]:
    """(state dir, candidate id) of RMSNorm.forward applied behind its env switch."""
    sd = repo / ".npufuse"
    if _real_apply_available():
        assert main(["scan", "."]) in (0, 1)
        scan = json.loads((sd / "scan.json").read_text())
        cid = next(c["id"] for c in scan["candidates"] if c["pattern"] == "rms_norm" and c["qualname"] == "RMSNorm.forward")
        assert main(["apply", "--accept", str(cid), "--force"]) == 0
        return sd, cid
    tree = ast.parse((repo / "model.py").read_text())
    fwd = next(n for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "RMSNorm" for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    span = (fwd.body[0].lineno, fwd.body[-1].end_lineno or fwd.body[-1].lineno)
    cfg = json.loads((repo / "config.json").read_text())
    return h.fake_apply(repo, "model.py", [h.rms_finding(h.FUSED_OK, span=span)], config=cfg), 1


@pytest.fixture()
def demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, int]:
    repo = tmp_path / "tiny_llama"
    shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(repo)
    # `python` in the user's command must be this venv's; one thread per child on a 2-core box
    monkeypatch.setenv("PATH", VENV_BIN + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sd, cid = _apply_rms_norm(repo)
    return repo, sd, cid


def test_demo_op_capture_e2e_and_broken_branch(demo: tuple[Path, Path, int], capsys: pytest.CaptureFixture[str]) -> None:
    repo, sd, cid = demo
    # op check on the shapes the train script really uses (captured from its first call)
    assert main(["verify", "op", str(cid), "--capture", "python train.py --steps 1", "--quiet"]) == 0
    op = State.load(sd).candidates[cid].evidence["op"]
    assert op["inputs"]["source"] == "capture" and op["inputs"]["arguments"]["hidden_states"] == [[8, 32, 64], "float32"]
    assert op["passed"] and op["backend"] == "emulated" and op["calls"]["site_calls_on"] == 1

    # e2e: 50 steps each, loss within 1%, the fused branch proven to run
    assert main(["verify", "e2e", str(cid), "--cmd", "python train.py --steps 50", "--steps", "50", "--quiet"]) == 0
    c = State.load(sd).candidates[cid]
    e = c.evidence["e2e"]
    assert c.status == "concluded" and e["passed"] and e["backend"] == "emulated"
    assert len(read_jsonl(sd / f"e2e_{cid}_baseline.jsonl")) == 50 and len(read_jsonl(sd / f"e2e_{cid}_fused.jsonl")) == 50
    assert e["loss"]["steps_compared"] == 40 and e["loss"]["max_rel_diff"] < 0.01
    assert e["proof"]["fused_site_calls"] >= 50 * 5 and e["proof"]["baseline_site_calls"] == 0  # 5 norms per step
    perf = c.evidence["perf"]
    assert perf["backend"] == "emulated" and perf["verdict"] in ("faster", "no measurable change", "slower")
    assert "not NPU performance" in c.reasons[-1] and "emulated" in c.verdict
    print(f"\nDEMO e2e: loss max rel diff {e['loss']['max_rel_diff']:.2e}; speed-up {perf['speedup']:.3f} CI [{perf['ci_low']:.3f}, {perf['ci_high']:.3f}] (emulated)")

    # a deliberately broken fused branch (output scaled by 1.5): stopped early, e2e_failed,
    # and the completed baseline is reused (the fused branch is not part of its fingerprint)
    base_mtime = (sd / f"e2e_{cid}_baseline.jsonl").stat().st_mtime_ns
    model = repo / "model.py"
    text = model.read_text()
    assert text.count("return torch_npu.npu_rms_norm(") == 1
    model.write_text(text.replace("return torch_npu.npu_rms_norm(", "return 1.5 * torch_npu.npu_rms_norm(", 1))
    assert main(["verify", "e2e", str(cid), "--cmd", "python train.py --steps 50", "--steps", "50", "--quiet"]) == 1
    c = State.load(sd).candidates[cid]
    assert c.status == "e2e_failed" and "stopped early" in c.evidence["e2e"]["reason"]
    assert len(read_jsonl(sd / f"e2e_{cid}_fused.jsonl")) < 50
    assert (sd / f"e2e_{cid}_baseline.jsonl").stat().st_mtime_ns == base_mtime
    assert main(["status", "--state-dir", str(sd)]) == 0
    assert f"npufuse revert {cid}" in capsys.readouterr().out


def test_demo_killed_run_resumes(demo: tuple[Path, Path, int]) -> None:
    """Ctrl-C during the fused run on the demo: state and JSONL stay consistent, and a rerun
    resumes — the completed baseline is reused, only the fused run is repeated."""
    import signal
    import subprocess
    import sys
    import time

    repo, sd, cid = demo
    assert main(["verify", "op", str(cid), "--quiet"]) == 0  # e2e only after the op check
    cmd = [sys.executable, "-m", "npufuse", "verify", "e2e", str(cid), "--cmd", "python train.py --steps 50", "--steps", "50", "--quiet"]
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    fused = sd / f"e2e_{cid}_fused.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if fused.exists() and len(fused.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"verify ended before the fused run was under way: {proc.stderr.read()[-500:]}"
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-500:]

    # consistent after the interrupt: the state loads, the JSONL lines all parse
    c = State.load(sd).candidates[cid]
    assert c.status == "e2e_checking"
    baseline = sd / f"e2e_{cid}_baseline.jsonl"
    assert len(read_jsonl(baseline)) == 50
    partial = read_jsonl(fused) if fused.exists() else []
    assert len(partial) < 50
    base_mtime = baseline.stat().st_mtime_ns

    # the rerun resumes: baseline reused (not rewritten), fused completed, concluded
    assert main(["verify", "e2e", str(cid), "--cmd", "python train.py --steps 50", "--steps", "50", "--quiet"]) == 0
    c = State.load(sd).candidates[cid]
    assert c.status == "concluded" and c.evidence["e2e"]["passed"]
    assert baseline.stat().st_mtime_ns == base_mtime
    assert len(read_jsonl(fused)) == 50
