"""Ctrl-C during a parallel scan stops it soon: the workers give up the file in hand, the
batches not started never run, the command exits 130 with one line and no traceback, and what
was analysed before stays in the cache. Before this, leaving the pool waited for every batch
already submitted, so an interrupted scan ran to the end of the tree first. And a parent killed
outright takes its workers with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from npufuse.scan import engine

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg") or "fork" not in __import__("multiprocessing").get_all_start_methods(),
                                reason="POSIX process groups and fork-started pools")

N_FILES = 400

# ~1,500 lines a file, with the shapes the detectors look at (a norm, a gated product, a
# rotation): each file costs a worker real time, so a whole scan takes several seconds.
_BLOCK = '''
class Norm{i}(nn.Module):
    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(v + self.eps)
        return self.weight * x.to(torch.bfloat16)


def mlp{i}(self, x):
    return self.down(F.silu(self.gate(x)) * self.up(x))


def rotate{i}(q, cos, sin):
    return (q * cos) + (torch.cat((-q[..., 64:], q[..., :64]), dim=-1) * sin)
'''


def _tree(root: Path, n_files: int = N_FILES) -> Path:
    body = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n" + "".join(_BLOCK.format(i=i) for i in range(100))
    for k in range(n_files):
        folder = root / f"pkg{k % 20}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"modeling_{k}.py").write_text(f"# file {k}\n{body}")
    return root


def _entries(state: Path) -> int:
    # a half-written entry (safe_write's ".<name>.*.npufuse-tmp") is not an entry yet: counting it
    # let the wait below fire at 3 finished entries, and the interrupted write then removed it
    return sum(1 for p in (state / "cache").rglob("*")
               if p.is_file() and p.name != "CACHEDIR.TAG" and not p.name.endswith(".npufuse-tmp"))


@pytest.mark.parametrize("target", ["group", "parent"])
def test_ctrl_c_stops_a_parallel_scan_soon(tmp_path: Path, target: str) -> None:
    """'group': a terminal's Ctrl-C (every process of the group gets SIGINT); 'parent': kill -INT
    of the npufuse process alone (its workers learn it from the parent)."""
    root = _tree(tmp_path / "repo")
    state = tmp_path / "state"
    env = {**os.environ, "PYTHONPATH": str(Path(engine.__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "npufuse", "scan", str(root), "-o", str(tmp_path / "report.md"), "--state-dir", str(state), "--no-progress", "-j", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while (not (state / "cache").is_dir() or _entries(state) < 4) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"the scan ended before it could be interrupted: {proc.stderr.read() if proc.stderr else ''}"
        if target == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert err.strip() == "npufuse scan: interrupted", err
    analysed = _entries(state)
    # the files in hand and the batches already queued may finish; the rest of the tree does not
    assert 4 <= analysed < N_FILES // 2, analysed
    assert not (state / "scan.json").exists()
    assert not (tmp_path / "report.md").exists()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_workers_leave_with_a_killed_parent(tmp_path: Path, sig: str) -> None:
    """A parent killed without shutting its pool down (timeout, a CI runner, the OOM killer) must
    not leave workers waiting forever for work, holding its stdout open: whoever reads that
    output would hang too. Before, both workers stayed, sleeping, under init."""
    root = _tree(tmp_path / "repo")
    state = tmp_path / "state"
    env = {**os.environ, "PYTHONPATH": str(Path(engine.__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "npufuse", "scan", str(root), "-o", str(tmp_path / "report.md"), "--state-dir", str(state), "--no-progress", "-j", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while (not (state / "cache").is_dir() or _entries(state) < 4) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the scan ended before it could be killed"
        proc.send_signal(getattr(signal, sig))
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _group_alive(proc.pid), "workers outlived their killed parent"
        assert proc.stdout is not None
        proc.stdout.read()  # EOF: no worker holds the pipe any more
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert _entries(state) < N_FILES // 2  # they stopped soon, not after the rest of the tree


_ARMED: list[bool] = []


def _signal_in_fork_callback() -> None:
    """An at-fork callback standing in for a Ctrl-C that arrives while os.fork runs: the handler
    runs inside the callback, whose KeyboardInterrupt Python prints and drops."""
    if _ARMED:
        _ARMED.clear()
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # bytecodes for the pending handler to run on, still in here
            pass


os.register_at_fork(after_in_parent=_signal_in_fork_callback)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped one, on purpose
def test_ctrl_c_while_the_pool_forks_is_not_lost(tmp_path: Path) -> None:
    root = _tree(tmp_path / "repo", 2 * engine.PARALLEL_MIN_FILES)  # enough for a pool
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _ARMED.append(True)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine._analyze_all(root, files, engine.registry_patterns(), engine.ScanOptions(), 2, None)
    finally:
        _ARMED.clear()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back as it was


def test_an_interrupted_pool_is_wound_down_before_the_interrupt_leaves_the_scan(tmp_path: Path) -> None:
    """The interrupt leaves the scan only once the pool's manager thread has ended. Before, the
    pool was shut down with wait=False and the interpreter's exit joined that thread instead,
    racing it as it closed its wakeup pipe: now and then an interrupted scan printed
    "Exception ignored in <module 'threading'> ... OSError: [Errno 9] Bad file descriptor"
    after its one line (seen once in a CI run of the test above)."""
    import threading
    from concurrent.futures import process

    root = _tree(tmp_path / "repo", n_files=120)

    def interrupt(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.scan_repo(root, jobs=2, progress=interrupt)
    left = [t for t in threading.enumerate() if isinstance(t, process._ExecutorManagerThread) and t.is_alive()]
    assert not left, left
