"""A write that is interrupted leaves every file either the original or the complete rewrite,
and the next command finds a consistent state (the journal in state.json)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from apply_support import HEAD, MODEL, make_repo, npufuse, scan, state_of
from npufuse.safe_write import write_bytes_atomic


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")


@pytest.fixture
def repo(tmp_path):
    root = make_repo(tmp_path / "repo", {"model.py": MODEL, "head.py": HEAD})
    scan(root)
    # what a complete apply writes, computed on a twin
    twin = make_repo(tmp_path / "twin", {"model.py": MODEL, "head.py": HEAD})
    scan(twin)
    assert npufuse("apply", "--accept", "all", "--state-dir", str(twin / ".npufuse")) == 0
    full = {name: (twin / name).read_bytes() for name in ("model.py", "head.py")}
    return root, root / ".npufuse", full


def assert_each_file_whole(root: Path, full: dict[str, bytes]) -> dict[str, str]:
    originals = {"model.py": MODEL.encode(), "head.py": HEAD.encode()}
    seen = {}
    for name in ("model.py", "head.py"):
        data = (root / name).read_bytes()
        assert data in (originals[name], full[name]), f"{name} is neither the original nor the complete rewrite"
        seen[name] = "original" if data == originals[name] else "rewritten"
    return seen


def test_write_failing_after_the_temp_file_leaves_the_original(repo, monkeypatch, capsys):
    root, sd, full = repo
    real = os.replace

    def failing(src, dst, *a, **k):
        if str(dst).endswith("model.py") and ".npufuse" not in str(dst) and "dst_dir_fd" not in k:  # state folder writes go by dir fd
            assert Path(src).read_bytes() == full["model.py"]  # the temp file was completely written
            raise OSError(28, "No space left on device")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", failing)
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 2
    err = capsys.readouterr().err
    assert "model.py: cannot write (No space left on device); it is unchanged (already written: head.py)" in err
    assert assert_each_file_whole(root, full) == {"model.py": "original", "head.py": "rewritten"}
    assert not list(root.glob(".*npufuse-tmp"))  # safe_write removed its temp file
    st = state_of(sd)
    assert st["pending"] == []
    assert {c["file"] for c in st["candidates"] if c["applied"]} == {"head.py"}
    monkeypatch.setattr(os, "replace", real)
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 0
    assert {n: (root / n).read_bytes() for n in full} == full


def test_atomic_write_never_exposes_a_partial_file(tmp_path, monkeypatch):
    target = tmp_path / "f.py"
    target.write_bytes(b"old\n")
    real_fsync = os.fsync

    def boom(fd):
        real_fsync(fd)
        raise KeyboardInterrupt  # interrupted between writing the temp file and the rename

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        write_bytes_atomic(target, b"new content\n" * 1000)
    assert target.read_bytes() == b"old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["f.py"]


HOOK = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path

    mode, name, ready = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    real = os.replace
    armed = [False]

    def slow(src, dst, *a, **k):
        dst = str(dst)
        ours = "/.npufuse/" not in dst and "dst_dir_fd" not in k  # state folder writes go by dir fd
        if armed[0] or (mode == "before" and dst.endswith(name) and ours):
            ready.write_text("stopped")  # temp file complete, rename (or state commit) pending
            time.sleep(120)
        result = real(src, dst, *a, **k)
        if mode == "after" and dst.endswith(name) and ours:
            armed[0] = True  # stop at the next write: the journal commit in state.json
        return result

    os.replace = slow
    from npufuse.cli import main
    sys.exit(main(sys.argv[4:]))
''')


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
@pytest.mark.parametrize("mode,name,expect", [
    ("before", "head.py", {"head.py": "original", "model.py": "original"}),
    ("before", "model.py", {"head.py": "rewritten", "model.py": "original"}),
    ("after", "model.py", {"head.py": "rewritten", "model.py": "rewritten"}),
])
def test_sigkill_mid_apply_then_rerun(repo, tmp_path, mode, name, expect, capsys):
    root, sd, full = repo
    ready = tmp_path / "ready"
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "COLUMNS": "300"}
    proc = subprocess.Popen([sys.executable, "-c", HOOK, mode, name, str(ready), "apply", "--accept", "all", "--state-dir", str(sd)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the hook was never reached"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert assert_each_file_whole(root, full) == expect
    assert state_of(sd)["pending"]  # the journal shows the write in flight
    # the next run settles the journal, cleans temp files and finishes the job
    capsys.readouterr()
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 0
    out = capsys.readouterr().out
    assert "interrupted npufuse write" in out
    assert {n: (root / n).read_bytes() for n in full} == full
    assert not list(root.glob(".*npufuse-tmp"))
    st = state_of(sd)
    assert st["pending"] == [] and all(c["applied"] for c in st["candidates"])
    assert npufuse("revert", "--state-dir", str(sd)) == 0
    assert (root / "model.py").read_text() == MODEL and (root / "head.py").read_text() == HEAD


def test_sigkill_mid_revert_then_rerun(repo, tmp_path):
    root, sd, full = repo
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 0
    ready = tmp_path / "ready"
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen([sys.executable, "-c", HOOK, "before", "model.py", str(ready), "revert", "--state-dir", str(sd)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert (root / "model.py").read_bytes() == full["model.py"]
    assert (root / "head.py").read_text() == HEAD  # reverted before the kill
    assert npufuse("revert", "--state-dir", str(sd)) == 0
    assert (root / "model.py").read_text() == MODEL
    assert all(c["applied"] is None for c in state_of(sd)["candidates"]) and state_of(sd)["pending"] == []
