"""Running the user's launch command as a child we fully control.

* Own process group (``start_new_session``): a terminal Ctrl-C reaches npufuse only, and npufuse
  stops the *whole* launch (launchers, workers, data loader processes) with one ``killpg``:
  SIGTERM, a grace period, then SIGKILL. The group is also swept after a normal exit, so no
  stray grandchild outlives the run.
* If npufuse itself is killed (SIGKILL leaves no chance to clean up), the direct child gets
  SIGTERM from the kernel (``PR_SET_PDEATHSIG``, Linux) and the probe's watchdog thread in every
  child Python kills the group (see :mod:`npufuse.verify.probe`).
* Output (stdout and stderr merged, unbuffered via ``PYTHONUNBUFFERED``) is read by a thread and
  handed line by line to ``on_line``, which may ask to stop the run (enough steps, NaN, divergence).
* A wall-clock timeout; the raw output is kept in a log file next to the JSONL.
* SIGTERM to npufuse during a run is turned into ``KeyboardInterrupt`` so the caller's cleanup
  (state saved as interrupted) runs for ``kill`` as for Ctrl-C.
"""

from __future__ import annotations

import os
import queue
import shlex
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

GRACE_S = 3.0
_PR_SET_PDEATHSIG = 1


@dataclass
class ChildResult:
    returncode: int | None
    stop_reason: str | None  # why npufuse stopped it (``on_line`` asked, or "timeout"); None if it ended by itself
    timed_out: bool
    wall_s: float
    head: list[str] = field(default_factory=list)  # first lines of output
    tail: list[str] = field(default_factory=list)  # last lines of output
    lines: int = 0

    def describe_exit(self) -> str:
        if self.timed_out:
            return f"timed out after {self.wall_s:.0f} s"
        rc = self.returncode
        if rc is None:
            return "did not exit"
        if rc < 0:
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exit code {rc}"


def split_command(cmd: str | Sequence[str], shell: bool) -> list[str] | str:
    """``--cmd`` as argv (``shlex.split``) or, with ``--shell``, the string for ``/bin/sh -c``."""
    if shell:
        return cmd if isinstance(cmd, str) else shlex.join(cmd)
    argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    if not argv:
        raise ValueError("empty command")
    return argv


def _pdeathsig() -> None:
    # runs in the child between fork and exec: keep it tiny and never raise
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except Exception:
        pass


def kill_group(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM the child's process group, wait up to ``grace_s``, then SIGKILL the group."""
    pgid = proc.pid  # start_new_session: the child leads its own group
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _group_alive(pgid):
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class _TermAsInterrupt:
    """While active (main thread only), SIGTERM raises KeyboardInterrupt."""

    def __enter__(self) -> "_TermAsInterrupt":
        self.saved = None
        if threading.current_thread() is threading.main_thread():
            self.saved = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            signal.signal(signal.SIGTERM, self.saved)


def run_child(
    cmd: list[str] | str,
    *,
    env: Mapping[str, str],
    cwd: Path,
    timeout_s: float,
    on_line: Callable[[str], str | None] | None = None,
    log_path: Path | None = None,
    should_stop: Callable[[], str | None] | None = None,
    keep_lines: int = 40,
) -> ChildResult:
    """Run ``cmd`` (argv, or a shell string) to completion, a stop request, or the timeout.

    ``on_line(line)`` returns a reason to stop the run, or None. ``should_stop()`` is polled a few
    times a second (e.g. "the capture file exists"). ``KeyboardInterrupt`` (Ctrl-C, or SIGTERM to
    npufuse) kills the child's group and propagates. Raises ``OSError`` when the command cannot
    start (not found, not executable)."""
    shell = isinstance(cmd, str)
    start = time.monotonic()
    head: list[str] = []
    tail: deque[str] = deque(maxlen=keep_lines)
    n = 0
    stop_reason: str | None = None
    timed_out = False
    log = open(log_path, "w", encoding="utf-8", errors="replace") if log_path else None
    lines: queue.Queue[str | None] = queue.Queue()
    try:
        with _TermAsInterrupt():
            proc = subprocess.Popen(
                cmd,
                shell=shell,
                cwd=str(cwd),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_pdeathsig,
                text=True,
                encoding="utf-8",
                errors="replace",
                bufsize=1,
            )

            def pump() -> None:
                assert proc.stdout is not None
                for raw in proc.stdout:
                    lines.put(raw)
                lines.put(None)

            reader = threading.Thread(target=pump, daemon=True, name="npufuse-child-output")
            reader.start()
            eof = False
            exited_at: float | None = None
            try:
                while True:
                    remaining = timeout_s - (time.monotonic() - start)
                    if remaining <= 0:
                        timed_out, stop_reason = True, "timeout"
                        break
                    try:
                        raw = lines.get(timeout=min(0.2, remaining))
                    except queue.Empty:
                        raw = ""
                        if proc.poll() is not None:
                            # the child is gone; a grandchild may still hold the pipe open, so
                            # don't wait for EOF longer than a moment (the sweep below ends it)
                            exited_at = exited_at or time.monotonic()
                            if not reader.is_alive() or time.monotonic() - exited_at > 1.0:
                                eof = True
                    if raw is None:
                        eof = True
                    elif raw:
                        n += 1
                        line = raw.rstrip("\r\n")
                        if log:
                            log.write(line + "\n")
                            log.flush()
                        if len(head) < keep_lines:
                            head.append(line)
                        tail.append(line)
                        if on_line is not None:
                            stop_reason = on_line(line)
                            if stop_reason:
                                break
                    if should_stop is not None:
                        stop_reason = should_stop()
                        if stop_reason:
                            break
                    if eof:
                        break
            finally:
                # Always sweep the group: a normal exit may leave grandchildren; a stop or an
                # interrupt must end everything the launch started.
                if proc.poll() is None or _group_alive(proc.pid):
                    kill_group(proc)
                try:
                    proc.wait(timeout=GRACE_S + 2)
                except subprocess.TimeoutExpired:
                    pass
                reader.join(timeout=1.0)
                if proc.stdout is not None:
                    proc.stdout.close()
    finally:
        if log:
            log.close()
    return ChildResult(
        returncode=proc.returncode,
        stop_reason=stop_reason,
        timed_out=timed_out,
        wall_s=time.monotonic() - start,
        head=head,
        tail=list(tail),
        lines=n,
    )


def child_env(extra: Mapping[str, str], probe_cfg: Path | None, bootstrap_dir: Path | None) -> dict[str, str]:
    """The child's environment: ours + the user's ``--env`` + unbuffered output + the probe
    (its folder first on ``PYTHONPATH``; see :func:`npufuse.verify.probe.write_bootstrap`)."""
    env = dict(os.environ)
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"  # steps must arrive as they happen, not in 8 KiB blocks
    if probe_cfg is not None and bootstrap_dir is not None:
        from npufuse.verify.probe import write_bootstrap

        parts = [str(bootstrap_dir)]
        if not write_bootstrap(bootstrap_dir):
            import npufuse

            parts.append(str(Path(npufuse.__file__).resolve().parents[1]))
        parts += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(parts)
        env["NPUFUSE_PROBE"] = str(probe_cfg)
    return env
