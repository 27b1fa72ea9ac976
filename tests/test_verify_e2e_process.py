"""The `verify e2e` child process runner under hostile launches (issue 19, items 2 and 6).

A command may leave processes in their own session holding the output pipe (``setsid``,
daemons, double forks), ignore SIGTERM, or flood the pipe. The runner must never wait for a pipe
to close, must end every process the launch started (no descendant outlives the run), and must
keep its memory and the saved log bounded while stop decisions (NaN) are taken on the very line
that calls for them. No test here measures speed: "never hangs" is asserted as "returned without
hitting a generous timeout", and boundedness on sizes and line counts.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest

from test_verify_helpers import PY, fake_repo

from npufuse.cli import main
from npufuse.state import State
from npufuse.verify import runner
from npufuse.verify.logparse import LogParser

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="process-tree tracking reads /proc (Linux)")

# A daemon in its own session (double fork + setsid) that holds the inherited stdout open and
# ignores SIGTERM; it records its pid. Run with -I so no probe/sitecustomize loads into it:
# nothing but the runner may end it.
DAEMON = textwrap.dedent(
    """\
    import os, signal, sys, time
    pidfile = sys.argv[1]
    if os.fork():
        os._exit(0)          # the launcher's child exits at once: the daemon is orphaned
    os.setsid()
    if os.fork():
        os._exit(0)          # double fork: not a session leader, parent gone
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(pidfile + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pidfile + ".tmp", pidfile)
    print("daemon up", flush=True)
    time.sleep(90)  # bounded, so a regression fails (see the .done check) instead of hanging for good
    open(pidfile + ".done", "w").close()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) counts as dead
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_file(path: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def _script(tmp: Path, name: str, body: str) -> Path:
    (tmp / "daemon.py").write_text(DAEMON)
    p = tmp / name
    p.write_text(textwrap.dedent(body))
    return p


def _run(tmp: Path, argv: list[str] | str, **kw) -> runner.ChildResult:
    kw.setdefault("timeout_s", 120)
    return runner.run_child(argv, env=dict(os.environ), cwd=tmp, **kw)


def _pids(tmp: Path, pattern: str = "daemon*.pid") -> list[int]:
    # a daemon that lived out its sleep was waited for, not killed: the runner hung on it
    assert not list(tmp.glob("*.done")), "the run waited for a daemon to end by itself"
    return [int(p.read_text()) for p in tmp.glob(pattern) if p.read_text().strip()]


# -- item 2: never block on a pipe close; end the whole tree ----------------------------------


def test_setsid_grandchild_holding_stdout_does_not_hang_and_dies(tmp_path: Path) -> None:
    # three daemons in their own sessions keep the pipe open; the launched program exits at once
    main_py = _script(tmp_path, "main.py", """\
        import subprocess, sys, time
        for i in range(3):
            subprocess.run([sys.executable, "-I", "daemon.py", f"daemon{i}.pid"], check=True)
        while len([1 for i in range(3) if __import__("os").path.exists(f"daemon{i}.pid")]) < 3:
            time.sleep(0.01)
        print("step 1 loss 1.5", flush=True)
        """)
    seen: list[str] = []
    res = _run(tmp_path, [PY, str(main_py)], on_line=lambda ln: seen.append(ln) and None, timeout_s=120)
    assert not res.timed_out and res.returncode == 0
    assert "step 1 loss 1.5" in seen and "daemon up" in seen
    assert res.held_output  # the child exited while its descendants still held the pipe
    pids = _pids(tmp_path)
    assert len(pids) == 3
    assert not [p for p in pids if _alive(p)], "a setsid descendant outlived the run"
    assert res.descendants_killed >= 3


def test_shell_command_backgrounding_a_daemon(tmp_path: Path) -> None:
    _script(tmp_path, "unused.py", "")
    res = _run(tmp_path, f"{PY} -I daemon.py daemon.pid; echo 'step 1 loss 2.0'", timeout_s=120)
    assert not res.timed_out and "step 1 loss 2.0" in res.tail
    (pid,) = _pids(tmp_path)
    assert not _alive(pid)


def test_timeout_ends_a_tree_that_holds_the_pipe(tmp_path: Path) -> None:
    # the program itself never exits and has a setsid daemon: only the timeout ends the run
    main_py = _script(tmp_path, "main.py", """\
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # needs the SIGKILL after the grace period
        subprocess.run([sys.executable, "-I", "daemon.py", "daemon.pid"], check=True)
        print("step 1 loss 1.0", flush=True)
        time.sleep(600)
        """)
    res = _run(tmp_path, [PY, str(main_py)], timeout_s=3, grace_s=0.5)
    assert res.timed_out and res.stop_reason == "timeout"
    assert res.describe_exit().startswith("timed out") and res.returncode == -signal.SIGKILL
    (pid,) = _pids(tmp_path)
    assert not _alive(pid)


def test_fallback_without_subreaper_ends_descendants_it_saw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # where PR_SET_CHILD_SUBREAPER is unavailable, descendants sampled while still attached to
    # the tree are remembered by (pid, start time) and ended after they are orphaned to init
    real = runner._prctl
    monkeypatch.setattr(runner, "_prctl", lambda opt, arg: None if opt in (runner._PR_SET_CHILD_SUBREAPER, runner._PR_GET_CHILD_SUBREAPER) else real(opt, arg))
    main_py = _script(tmp_path, "main.py", """\
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-I", "-c", "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open('daemon.pid', 'w').write(str(os.getpid())); time.sleep(600)"], start_new_session=True)
        time.sleep(1.0)  # attached long enough to be sampled
        print("step 1 loss 1.0", flush=True)
        """)
    res = _run(tmp_path, [PY, str(main_py)], grace_s=0.5)
    assert not res.timed_out
    (pid,) = _pids(tmp_path)
    assert not _alive(pid)


def _npufuse(sd: Path, cmd: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.Popen(
        [PY, "-m", "npufuse", "verify", "e2e", "1", "--state-dir", str(sd), "--cmd", cmd, "--quiet", *extra],
        cwd=sd.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


WRAPPED_TRAIN = """\
import runpy, subprocess, sys
subprocess.run([sys.executable, "-I", "daemon.py", "daemon.pid"], check=True)
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_signal_to_npufuse_during_a_run_with_a_setsid_daemon(tmp_path: Path, sig: int) -> None:
    sd = fake_repo(tmp_path)
    (tmp_path / "daemon.py").write_text(DAEMON)
    (tmp_path / "wrapped.py").write_text(WRAPPED_TRAIN)
    proc = _npufuse(sd, f"{PY} wrapped.py --steps 2000 --sleep 0.05", "--steps", "1000")
    try:
        pid = int(_wait_file(tmp_path / "daemon.pid"))
        deadline = time.monotonic() + 60
        while not (sd / "e2e_1_baseline.jsonl").exists() or (sd / "e2e_1_baseline.jsonl").read_text().count("\n") < 3:
            assert time.monotonic() < deadline and proc.poll() is None, "the baseline never started"
            time.sleep(0.02)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)  # "never hangs": well within this bound
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted" in err
    assert not _alive(pid) and not (tmp_path / "daemon.pid.done").exists()
    c = State.load(sd).candidates[1]
    assert c.evidence["e2e"]["runs"]["baseline"]["status"] == "interrupted"


def test_cli_timeout_with_a_daemon_holding_the_output(tmp_path: Path) -> None:
    sd = fake_repo(tmp_path)
    (tmp_path / "daemon.py").write_text(DAEMON)
    (tmp_path / "wrapped.py").write_text(WRAPPED_TRAIN)
    argv = ["verify", "e2e", "1", "--state-dir", str(sd), "--cmd", f"{PY} wrapped.py --steps 20 --hang-at 3", "--steps", "20", "--timeout", "3", "--quiet"]
    assert main(argv) == 2
    (pid,) = _pids(tmp_path)
    assert not _alive(pid)
    assert not _alive(int((tmp_path / "grandchild.pid").read_text()))
    assert State.load(sd).candidates[1].evidence["e2e"]["runs"]["baseline"]["status"] == "failed"


# -- item 6: bounded reading -----------------------------------------------------------------

FLOOD = """\
import sys
junk = ("x" * 1000 + "\\n").encode()
out = sys.stdout.buffer
for i in range(1, {before} + 1):
    out.write(junk)
out.write(b"step 1 loss 2.0\\nstep 2 loss nan\\n")
while True:              # and it never stops on its own
    out.write(junk)
"""


def test_flood_keeps_memory_and_log_bounded_and_stops_on_the_nan_line(tmp_path: Path) -> None:
    before = 12_000  # ~12 MB of noise before the NaN step, then an endless flood
    script = tmp_path / "flood.py"
    script.write_text(FLOOD.format(before=before))
    parser = LogParser()

    def on_line(line: str) -> str | None:
        rec = parser.feed(line)
        return f"loss is nan at step {rec.step}" if rec is not None and math.isnan(rec.loss) else None

    cap = 1 << 20
    log = tmp_path / "flood.log"
    tracemalloc.start()
    try:
        res = _run(tmp_path, [PY, str(script)], on_line=on_line, log_path=log, log_cap_bytes=cap, keep_lines=40, grace_s=0.5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the decision is taken on the NaN line itself: no line after it was consumed
    assert res.stop_reason == "loss is nan at step 2" and not res.timed_out
    assert res.lines == before + 2
    assert res.output_bytes > 10 * cap
    assert peak < 16 << 20, f"reading {res.output_bytes} bytes peaked at {peak} bytes of Python memory"
    size = log.stat().st_size
    # the first `cap` bytes, two marker lines, and at most LOG_TAIL_LINES lines of <= 1001 bytes
    assert cap < size <= cap + 400 + runner.LOG_TAIL_LINES * 1001
    assert res.log_bytes_dropped > 0 and res.log_bytes_dropped + cap >= res.output_bytes - runner.READ_CHUNK
    text = log.read_bytes()
    assert b"log capped at" in text and text.rstrip().endswith(b"step 2 loss nan")
    assert len(res.head) == 40 and len(res.tail) == 40 and res.tail[-1] == "step 2 loss nan"


def test_gigantic_single_line_is_cut_and_the_next_lines_still_parse(tmp_path: Path) -> None:
    script = tmp_path / "giant.py"
    script.write_text(textwrap.dedent("""\
        import sys
        out = sys.stdout.buffer
        chunk = b"y" * (1 << 20)
        for _ in range(40):      # one 40 MiB line
            out.write(chunk)
        out.write(b"\\nstep 1 loss 0.5\\nstep 2 loss 0.4\\n")
        out.write(b"z" * 5000)   # and an unterminated last line
        """))
    lines: list[str] = []
    parser = LogParser()
    steps: list[int] = []

    def on_line(line: str) -> None:
        lines.append(line[:50])
        rec = parser.feed(line)
        if rec is not None:
            steps.append(rec.step)
        return None

    cap = 2 << 20
    log = tmp_path / "giant.log"
    tracemalloc.start()
    try:
        res = _run(tmp_path, [PY, str(script)], on_line=on_line, log_path=log, log_cap_bytes=cap, max_line_chars=4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert res.returncode == 0 and not res.timed_out
    assert steps == [1, 2]
    assert res.lines == 4 and res.truncated_lines == 2  # the giant line and the 5000-char tail
    assert len(res.head[0]) == 4096 and res.head[-1] == "z" * 4096
    assert peak < 16 << 20
    assert log.stat().st_size <= cap + 400 + 2 * 4096 + 100


def test_defaults_are_the_stated_caps() -> None:
    assert runner.MAX_LINE_CHARS == 16 * 1024 and runner.LOG_CAP_BYTES == 64 << 20 and runner.LOG_TAIL_LINES == 200


@pytest.mark.parametrize(
    "chunks, expected",
    [
        ([b"a\nb\n"], ["a", "b"]),
        ([b"a\r", b"\nb\r\n"], ["a", "b"]),  # CRLF split across two reads is one line end
        ([b"  1%|1/100\r  2%|2/100\r{'loss': 1.0}\n"], ["  1%|1/100", "  2%|2/100", "{'loss': 1.0}"]),
        ([b"\xc3", b"\xa9t\xc3\xa9\n"], ["été"]),  # a UTF-8 character split across reads
        ([b"a\n\nb"], ["a", "", "b"]),
    ],
)
def test_line_splitter(chunks: list[bytes], expected: list[str]) -> None:
    sp = runner.LineSplitter(100)
    out = [ln for c in chunks for ln in sp.feed(c)] + list(sp.flush())
    assert out == expected and sp.truncated == 0


def test_line_splitter_cuts_long_lines_by_characters() -> None:
    sp = runner.LineSplitter(10)
    out = [ln for c in [b"0123456789abc", "é".encode() * 50, b"\nok\n"] for ln in sp.feed(c)]
    assert out == ["0123456789", "ok"] and sp.truncated == 1
    sp = runner.LineSplitter(3)
    assert list(sp.feed("éééé\n".encode())) == ["ééé"] and sp.truncated == 1


def test_symlink_at_the_log_path_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "victim.txt"
    target.write_text("keep")
    (tmp_path / "run.log").symlink_to(target)
    with pytest.raises(OSError):
        _run(tmp_path, [PY, "-c", "print('step 1 loss 1')"], log_path=tmp_path / "run.log")
    assert target.read_text() == "keep"
