"""`npufuse verify e2e` on a fake, torch-free trainer (children start in milliseconds).

The repo under test ships its own pure-Python ``torch_npu.py``: the probe treats it as the real
torch_npu (instrumented per site, backend "real"), so these tests also cover the NPU verdicts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from test_verify_helpers import PY, fake_apply, fake_repo, FAKE_MODEL, FAKE_SPAN, FAKE_TORCH_NPU, FAKE_TRAIN

from npufuse.cli import main
from npufuse.patterns.base import Finding
from npufuse.rewrite.codegen import Switch, splice
from npufuse.state import State
from npufuse.verify.jsonl import read_jsonl


def e2e(sd: Path, *extra: str, cmd: str = f"{PY} train.py --steps 60") -> int:
    return main(["verify", "e2e", "1", "--state-dir", str(sd), "--cmd", cmd, "--quiet", *extra])


def entry(sd: Path):
    return State.load(sd).candidates[1]


def test_passing_run_writes_jsonl_proof_and_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = fake_repo(tmp_path)
    assert e2e(sd, "--steps", "50", cmd=f"{PY} train.py --steps 80 --faster 0.8") == 0
    c = entry(sd)
    assert c.status == "concluded" and c.verdict == "replace: faster"
    base, fused = read_jsonl(sd / "e2e_1_baseline.jsonl"), read_jsonl(sd / "e2e_1_fused.jsonl")
    assert len(base) == 50 and len(fused) == 50  # stopped after --steps
    assert set(base[0]) >= {"candidate", "run", "step", "loss", "step_time"} and base[0]["run"] == "baseline"
    e = c.evidence["e2e"]
    assert e["passed"] and e["loss"]["max_rel_diff"] < 1e-9 and e["loss"]["steps_compared"] == 40
    assert e["proof"]["fused_site_calls"] >= 50 and e["proof"]["baseline_site_calls"] == 0
    perf = c.evidence["perf"]
    assert perf["verdict"] == "faster" and perf["ci_low"] < 1.25 < perf["ci_high"]  # printed step times: 0.8x
    assert perf["memory"]["fused"]["maxrss_bytes"] > 0
    metrics = json.loads((sd / "e2e_1_metrics.json").read_text())
    assert len(metrics) == 50 and metrics[0]["baseline_loss"] == metrics[0]["fused_loss"]
    history = [h["status"] for h in c.history]
    assert history[-3:] == ["e2e_checking", "perf_checking", "concluded"]
    assert "CONCLUSIONS.md" in os.listdir(sd) and "replace: faster" in (sd / "CONCLUSIONS.md").read_text()


def test_divergence_stops_fused_run_early(tmp_path: Path) -> None:
    sd = fake_repo(tmp_path, "diverge")  # fused branch scales its output by 1.05
    t0 = time.monotonic()
    assert e2e(sd, "--steps", "50", cmd=f"{PY} train.py --steps 400 --sleep 0.01") == 1
    c = entry(sd)
    assert c.status == "e2e_failed" and c.verdict == "do not replace: e2e"
    fused = read_jsonl(sd / "e2e_1_fused.jsonl")
    assert len(fused) == 11  # first compared step (after --skip 10) is the last one run
    assert "stopped early at step 11" in c.evidence["e2e"]["reason"]
    assert c.evidence["e2e"]["runs"]["fused"]["exit"].startswith("stopped by npufuse")
    assert time.monotonic() - t0 < 4 + 400 * 0.01  # the baseline stops at 50 steps, the fused at 11


def test_nan_stops_at_first_step(tmp_path: Path) -> None:
    sd = fake_repo(tmp_path, "nan")
    assert e2e(sd, "--steps", "20") == 1
    c = entry(sd)
    assert c.status == "e2e_failed" and len(read_jsonl(sd / "e2e_1_fused.jsonl")) == 1
    assert "fused loss is nan at step 1" in c.evidence["e2e"]["reason"]
    assert read_jsonl(sd / "e2e_1_fused.jsonl")[0]["loss"] == "nan"


def test_fused_crash_is_e2e_failed_with_output(tmp_path: Path) -> None:
    sd = fake_repo(tmp_path, "crash")
    assert e2e(sd, "--steps", "20") == 1
    c = entry(sd)
    assert c.status == "e2e_failed"
    assert "exit code 1" in c.evidence["e2e"]["reason"] and "fused kernel exploded" in c.evidence["e2e"]["reason"]


def test_fused_branch_never_executed(tmp_path: Path) -> None:
    sd = fake_repo(tmp_path, "nocall")  # same math, but no torch_npu call
    assert e2e(sd, "--steps", "20") == 1
    reason = entry(sd).evidence["e2e"]["reason"]
    assert "fused branch never executed" in reason and "npu_rms_norm" in reason


def test_baseline_crash_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = fake_repo(tmp_path)
    assert e2e(sd, "--steps", "20", cmd=f"{PY} train.py --crash-at 5") == 2
    err = capsys.readouterr().err
    assert "baseline run ended (exit code 1) after 4 of 20 steps" in err and "trainer crashed on purpose" in err
    c = entry(sd)
    assert c.status == "e2e_checking" and c.evidence["e2e"]["runs"]["baseline"]["status"] == "failed"


def test_nothing_parses_shows_first_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = fake_repo(tmp_path)
    assert e2e(sd, "--steps", "15", "--log-regex", r"iter (?P<step>\d+) L=(?P<loss>\S+)") == 2
    err = capsys.readouterr().err
    assert "no step/loss lines recognised" in err and "step 1 loss" in err  # the output is shown


def test_command_not_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = fake_repo(tmp_path)
    assert e2e(sd, cmd="no-such-launcher-xyz --steps 3") == 2
    assert "cannot start" in capsys.readouterr().err


def test_timeout_kills_the_process_group(tmp_path: Path) -> None:
    sd = fake_repo(tmp_path)
    # the trainer spawns a grandchild and hangs at step 3; only a group kill ends the grandchild
    assert e2e(sd, "--steps", "20", "--timeout", "2", cmd=f"{PY} train.py --hang-at 3") == 2
    pid = int((tmp_path / "grandchild.pid").read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid)
    c = entry(sd)
    assert c.evidence["e2e"]["runs"]["baseline"]["status"] == "failed" and c.status == "e2e_checking"


def test_megatron_and_hf_logs_end_to_end(tmp_path: Path) -> None:
    sd = fake_repo(tmp_path)
    # these logs carry measured times: on a loaded machine the perf verdict may come out
    # "slower" (exit 1). This test is about parsing, so no speed difference counts here.
    any_speed = ("--min-effect", "1000")
    assert e2e(sd, "--steps", "20", *any_speed, cmd=f"{PY} train.py --format megatron") == 0
    assert entry(sd).evidence["e2e"]["runs"]["fused"]["format"] == "megatron"
    assert e2e(sd, "--steps", "20", "--rerun-baseline", *any_speed, cmd=f"{PY} train.py --format hf") == 0
    c = entry(sd)
    assert c.evidence["e2e"]["runs"]["baseline"]["format"] == "hf" and c.status == "concluded"


def test_shell_mode_and_env(tmp_path: Path) -> None:
    sd = fake_repo(tmp_path)
    cmd = f'test "$MY_FLAG" = yes && {PY} train.py --steps 30'
    assert e2e(sd, "--steps", "15", "--shell", "--env", "MY_FLAG=yes", cmd=cmd) == 0
    assert e2e(sd, "--steps", "15", "--rerun-baseline", cmd=cmd) == 2  # without --shell, `test` gets "$MY_FLAG" literally


def test_baseline_reused_when_unchanged(tmp_path: Path) -> None:
    sd = fake_repo(tmp_path)
    assert e2e(sd, "--steps", "20") == 0
    mtime = (sd / "e2e_1_baseline.jsonl").stat().st_mtime_ns
    assert e2e(sd, "--steps", "15") == 0  # fewer steps: still reusable
    assert (sd / "e2e_1_baseline.jsonl").stat().st_mtime_ns == mtime
    assert e2e(sd, "--steps", "15", "--env", "X=1") == 0  # a different environment: rerun
    assert (sd / "e2e_1_baseline.jsonl").stat().st_mtime_ns != mtime


def test_non_env_switch_baseline_disables_the_module(tmp_path: Path) -> None:
    (tmp_path / "fakemodel.py").write_text(FAKE_MODEL + "\nUSE_FUSED = True\n")
    (tmp_path / "torch_npu.py").write_text(FAKE_TORCH_NPU)
    (tmp_path / "train.py").write_text(FAKE_TRAIN)
    f = Finding(pattern="rms_norm", qualname="norm", line=FAKE_SPAN[0], end_line=FAKE_SPAN[1], params={}, fused="return torch_npu.npu_rms_norm(x, w, eps)", guard_tensor="x")
    sd = fake_apply(tmp_path, "fakemodel.py", [f])
    # re-render the site behind an existing repo switch instead of the env variable
    text = splice(FAKE_MODEL + "\nUSE_FUSED = True\n", [f], {f.line: Switch("existing", expr="USE_FUSED")})
    (tmp_path / "fakemodel.py").write_text(text)
    # measured step times: "slower" (exit 1) can happen on a loaded machine; not this test's subject
    assert e2e(sd, "--steps", "15", "--force", "--min-effect", "1000") == 0
    e = entry(sd).evidence["e2e"]
    assert e["switch"]["kind"] == "module" and e["proof"]["baseline_site_calls"] == 0 and e["proof"]["fused_site_calls"] > 0


def test_refuses_before_op_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = fake_repo(tmp_path)
    state = State.load(sd)
    state.set_status(1, "pending")
    state.save()
    assert e2e(sd) == 2
    assert "verify op 1" in capsys.readouterr().err


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as dead
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _runner(sd: Path, cmd: str, steps: int = 40) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-m", "npufuse", "verify", "e2e", "1", "--state-dir", str(sd), "--cmd", cmd, "--steps", str(steps), "--quiet"],
        cwd=sd.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _wait_lines(path: Path, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count("\n") >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"{path} never reached {n} lines")


def _trainer_pids(root: Path) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmdline = (d / "cmdline").read_bytes().split(b"\0")
                cwd = os.readlink(d / "cwd")
            except OSError:
                continue
            if b"train.py" in cmdline and cwd == str(root) and _alive(int(d.name)):
                pids.append(int(d.name))
    return pids


def test_killed_runner_leaves_consistent_state_and_resumes(tmp_path: Path) -> None:
    sd = fake_repo(tmp_path)
    cmd = f"{PY} train.py --steps 200 --sleep 0.02"
    proc = _runner(sd, cmd)
    _wait_lines(sd / "e2e_1_fused.jsonl", 5)  # baseline done, fused under way
    proc.send_signal(signal.SIGKILL)  # no cleanup at all: the worst case
    proc.wait()
    # state.json is valid and says where it stopped; the orphaned trainer dies with its runner
    c = entry(sd)
    assert c.status == "e2e_checking" and c.evidence["e2e"]["runs"]["baseline"]["status"] == "complete"
    assert c.evidence["e2e"]["runs"]["fused"]["status"] == "running"
    partial = read_jsonl(sd / "e2e_1_fused.jsonl")
    assert 5 <= len(partial) < 40
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _trainer_pids(tmp_path):
        time.sleep(0.1)
    assert not _trainer_pids(tmp_path)
    base_mtime = (sd / "e2e_1_baseline.jsonl").stat().st_mtime_ns
    # the rerun resumes: the completed baseline is reused, the fused run starts over
    assert e2e(sd, "--steps", "40", cmd=cmd) == 0
    assert (sd / "e2e_1_baseline.jsonl").stat().st_mtime_ns == base_mtime
    c = entry(sd)
    assert c.status == "concluded" and len(read_jsonl(sd / "e2e_1_fused.jsonl")) == 40


def test_ctrl_c_marks_run_interrupted(tmp_path: Path) -> None:
    sd = fake_repo(tmp_path)
    proc = _runner(sd, f"{PY} train.py --steps 200 --sleep 0.02")
    _wait_lines(sd / "e2e_1_baseline.jsonl", 3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and "interrupted" in err
    c = entry(sd)
    assert c.evidence["e2e"]["runs"]["baseline"]["status"] == "interrupted" and c.status == "e2e_checking"
    assert any("interrupted" in h["note"] for h in c.history)
    assert not _trainer_pids(tmp_path)


def test_steps_must_exceed_skip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = fake_repo(tmp_path)
    assert e2e(sd, "--steps", "10") == 2  # --skip defaults to 10: nothing left to compare
    assert "leaves nothing to compare" in capsys.readouterr().err
