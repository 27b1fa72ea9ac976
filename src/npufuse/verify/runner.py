"""Running the user's launch command as a child we fully control.

* Own process group (``start_new_session``): a terminal Ctrl-C reaches npufuse only.
* The whole process *tree* is tracked, not only the group: a launch may leave processes in
  their own session (``setsid``, daemons, double forks) that no ``killpg`` reaches. While a
  child runs, npufuse is a child subreaper (``PR_SET_CHILD_SUBREAPER``, Linux >= 3.4, no root
  needed), so orphaned descendants are re-parented to npufuse instead of init and stay findable
  by PID ancestry in ``/proc``; the tree is also sampled a few times a second (the fallback
  where the prctl is unavailable). Stopping a run: SIGTERM to the group and every descendant,
  a grace period, then SIGKILL until none is left (pidfd signals where available, so a reused
  PID is never hit). The tree is swept after a normal exit too: no descendant outlives the run.
* If npufuse itself is killed (SIGKILL leaves no chance to clean up), the direct child gets
  SIGTERM from the kernel (``PR_SET_PDEATHSIG``, Linux) and the probe's watchdog thread in every
  child Python kills its group (see :mod:`npufuse.verify.probe`).
* Output (stdout and stderr merged, unbuffered via ``PYTHONUNBUFFERED``) is read in this thread
  with ``select`` and non-blocking reads: no call ever waits for a pipe to close, so a
  descendant holding the pipe open cannot stall Ctrl-C, SIGTERM or the timeout. Once the direct
  child has exited, the pipe is drained for at most ``DRAIN_S`` seconds, then the tree is ended.
* Bounded: reads of ``READ_CHUNK`` bytes are split into lines (``\\n``, ``\\r\\n`` and ``\\r``:
  progress bars redraw with ``\\r``) of at most ``MAX_LINE_CHARS`` characters (the rest of a longer
  line is dropped and counted); each line goes to ``on_line`` as soon as it is read, so a stop
  decision (enough steps, NaN, divergence) is never behind a backlog: there is no queue, and a
  flooding child is simply held back by the pipe. The saved log keeps the first ``LOG_CAP_BYTES``
  of raw output, then a marker and, at the end of the run, the last ``LOG_TAIL_LINES`` lines.
* A wall-clock timeout, checked on every read.
* SIGTERM to npufuse during a run is turned into ``KeyboardInterrupt`` so the caller's cleanup
  (state saved as interrupted) runs for ``kill`` as for Ctrl-C; a second Ctrl-C or SIGTERM while
  the tree is being stopped skips the grace period instead of abandoning the cleanup.
"""

from __future__ import annotations

import errno
import os
import re
import selectors
import shlex
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

GRACE_S = 3.0
DRAIN_S = 5.0  # after the direct child exits: read what is left for at most this long ...
DRAIN_QUIET_S = 1.0  # ... or until the output has been quiet this long
READ_CHUNK = 64 * 1024
MAX_LINE_CHARS = 16 * 1024  # real trainer lines are < 2 KiB; the parsers' regexes stay cheap
LOG_CAP_BYTES = 64 * 1024 * 1024
LOG_TAIL_LINES = 200
TREE_SAMPLE_S = 0.25
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


@dataclass
class ChildResult:
    returncode: int | None
    stop_reason: str | None  # why npufuse stopped it (``on_line`` asked, or "timeout"); None if it ended by itself
    timed_out: bool
    wall_s: float
    head: list[str] = field(default_factory=list)  # first lines of output
    tail: list[str] = field(default_factory=list)  # last lines of output
    lines: int = 0
    truncated_lines: int = 0  # lines longer than MAX_LINE_CHARS (cut to that length)
    output_bytes: int = 0
    log_bytes_dropped: int = 0  # raw output past LOG_CAP_BYTES, not in the saved log
    held_output: bool = False  # the direct child exited while a descendant still held the pipe
    descendants_killed: int = 0  # processes of the launch npufuse had to end (after a stop, or left behind)

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


def _prctl(option: int, arg: int) -> int | None:
    """``prctl(option, arg)``; None where there is no prctl (not Linux) or it failed."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if option == _PR_GET_CHILD_SUBREAPER:
            out = ctypes.c_int(0)
            rc = libc.prctl(option, ctypes.byref(out), 0, 0, 0)
            return int(out.value) if rc == 0 else None
        rc = libc.prctl(option, arg, 0, 0, 0)
        return 0 if rc == 0 else None
    except Exception:
        return None


def _pdeathsig() -> None:
    # runs in the child between fork and exec: keep it tiny and never raise
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except Exception:
        pass


# -- the process tree ------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time in clock ticks) of ``pid`` from ``/proc``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(rest[1]), rest[0].decode("ascii", "replace"), int(rest[19])
    except (IndexError, ValueError):
        return None


def _all_stats() -> dict[int, tuple[int, str, int]]:
    out: dict[int, tuple[int, str, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


class ProcessTree:
    """Every process a launch started, found by PID ancestry in ``/proc``.

    Members: the launched child, its descendants, and processes re-parented to npufuse (the
    subreaper) that started after the launch did and were not our children before it. Each is
    remembered with its start time, so a PID the kernel reuses for an unrelated process is never
    taken for a member."""

    def __init__(self) -> None:
        self.me = os.getpid()
        self.have_proc = os.path.isdir("/proc/self")
        before = _all_stats() if self.have_proc else {}
        self.preexisting = {(pid, st[2]) for pid, st in before.items() if st[0] == self.me}
        self.saved_subreaper = _prctl(_PR_GET_CHILD_SUBREAPER, 0)
        self.subreaper = self.saved_subreaper is not None and _prctl(_PR_SET_CHILD_SUBREAPER, 1) == 0
        self.root: tuple[int, int] | None = None
        self.known: dict[int, int] = {}  # pid -> start time of every member ever seen
        self.killed: set[tuple[int, int]] = set()

    def set_root(self, pid: int) -> None:
        st = _stat(pid)
        self.root = (pid, st[2] if st else 0)
        self.known[pid] = self.root[1]

    def release(self) -> None:
        if self.subreaper and not self.saved_subreaper:
            _prctl(_PR_SET_CHILD_SUBREAPER, 0)

    def members(self) -> dict[int, tuple[int, str, int]]:
        """The live (and zombie) members now; updates what is known."""
        if not self.have_proc or self.root is None:
            return {}
        stats = _all_stats()
        root_pid, root_start = self.root
        children: dict[int, list[int]] = {}
        for pid, (ppid, _state, _start) in stats.items():
            children.setdefault(ppid, []).append(pid)
        seeds = [pid for pid, st in stats.items() if self.known.get(pid) == st[2]]
        for pid in children.get(self.me, []):
            start = stats[pid][2]
            if (pid, start) not in self.preexisting and start >= root_start:
                seeds.append(pid)  # an orphan of the launch, re-parented to us (subreaper)
        found: dict[int, tuple[int, str, int]] = {}
        todo = list(seeds)
        while todo:
            pid = todo.pop()
            if pid in found or pid == self.me or pid not in stats:
                continue
            found[pid] = stats[pid]
            todo.extend(children.get(pid, []))
        for pid, st in found.items():
            self.known[pid] = st[2]
        return found

    def alive(self, exclude_zombies: bool = True) -> dict[int, tuple[int, str, int]]:
        self.reap()
        return {p: st for p, st in self.members().items() if not (exclude_zombies and st[1] in "ZX")}

    def reap(self) -> None:
        """Collect members that died as our children (re-parented orphans): never ``waitpid(-1)``,
        which would steal the exit status of children other code waits for."""
        if self.root is None:
            return
        for pid, st in self.members().items():
            if st[0] == self.me and st[1] == "Z" and pid != self.root[0]:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def signal_all(self, sig: int) -> int:
        """Send ``sig`` to every live member; returns how many were sent to."""
        n = 0
        for pid, st in self.alive().items():
            if _send(pid, st[2], sig):
                n += 1
                self.killed.add((pid, st[2]))
        return n


def _send(pid: int, start: int, sig: int) -> bool:
    """Signal ``pid`` only if it is still the process that started at ``start``."""
    fd = None
    try:
        if hasattr(os, "pidfd_open"):
            fd = os.pidfd_open(pid)  # pins the process: the check below cannot race a PID reuse
        st = _stat(pid)
        if st is None or st[2] != start:
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EINVAL) and fd is None:
            return False
        try:
            os.kill(pid, sig)
            return True
        except OSError:
            return False
    finally:
        if fd is not None:
            os.close(fd)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_tree(proc: subprocess.Popen, tree: ProcessTree, grace_s: float = GRACE_S, hurry: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM the launch's group and every member of its tree, wait up to ``grace_s`` (cut short
    when ``hurry()``), then SIGKILL until no member is left."""
    _killpg(proc.pid, signal.SIGTERM)  # start_new_session: the child leads its own group
    tree.signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not hurry():
        proc.poll()
        if not tree.alive() and not _group_alive(proc.pid):
            return
        time.sleep(0.05)
    for _ in range(200):  # a forking member is caught on the next round
        _killpg(proc.pid, signal.SIGKILL)
        if not tree.signal_all(signal.SIGKILL) and not _group_alive(proc.pid):
            break
        proc.poll()
        time.sleep(0.02)
    proc.poll()
    tree.reap()


def kill_group(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM the child's process group, wait up to ``grace_s``, then SIGKILL the group."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _group_alive(pgid):
            return
        time.sleep(0.05)
    _killpg(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


# -- signals ---------------------------------------------------------------------------------


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


class _DeferSignals:
    """While the tree is being stopped, Ctrl-C and SIGTERM only set ``hurry`` (skip the grace
    period): raising there would abandon the cleanup and leave processes behind. The interrupt
    is raised once the cleanup is done."""

    def __init__(self) -> None:
        self.hurry = False
        self.saved: dict[int, object] = {}

    def _note(self, signum: int, frame: object) -> None:
        self.hurry = True

    def __enter__(self) -> "_DeferSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.saved[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        if self.hurry and exc_type is None:
            raise KeyboardInterrupt


# -- output ----------------------------------------------------------------------------------

_SEP = re.compile(rb"\r\n|\r|\n")


class LineSplitter:
    """Bytes in, text lines out, with a bounded line length (the rest of a longer line is
    dropped and counted) and ``\\r`` taken as a line end like ``\\n`` (a ``\\r\\n`` split across
    two reads is one line end)."""

    def __init__(self, max_chars: int = MAX_LINE_CHARS) -> None:
        self.max_bytes = max_chars * 4  # UTF-8: at most 4 bytes a character; cut again after decoding
        self.max_chars = max_chars
        self.pending = bytearray()
        self.overflow = False
        self.after_cr = False
        self.truncated = 0

    def _add(self, seg: bytes) -> None:
        if self.overflow:
            return
        room = self.max_bytes - len(self.pending)
        self.pending += seg[:room]
        if len(seg) > room:
            self.overflow = True

    def _take(self) -> str:
        text = self.pending.decode("utf-8", errors="replace")
        if self.overflow or len(text) > self.max_chars:
            self.truncated += 1
            text = text[: self.max_chars]
        self.pending = bytearray()
        self.overflow = False
        return text

    def feed(self, data: bytes) -> Iterator[str]:
        start = 1 if (self.after_cr and data[:1] == b"\n") else 0
        self.after_cr = data.endswith(b"\r")
        for m in _SEP.finditer(data, start):
            self._add(data[start : m.start()])
            start = m.end()
            yield self._take()
        self._add(data[start:])

    def flush(self) -> Iterator[str]:
        if self.pending or self.overflow:
            yield self._take()


class BoundedLog:
    """The raw output as it came, up to ``cap`` bytes; past it, a marker now and the last
    ``tail_lines`` lines at close. Opened without following a symlink planted at its path."""

    def __init__(self, path: Path, cap: int = LOG_CAP_BYTES, tail_lines: int = LOG_TAIL_LINES) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.f = os.fdopen(fd, "wb")
        self.cap = cap
        self.written = 0
        self.dropped = 0
        self.dropped_lines = 0
        self.tail: deque[str] = deque(maxlen=tail_lines)

    def write(self, data: bytes) -> None:
        room = self.cap - self.written
        if room > 0:
            part = data[:room]
            self.f.write(part)
            self.written += len(part)
            if len(data) > room:
                self.f.write(f"\n[npufuse: log capped at {self.cap} bytes; later output not saved except the last lines below]\n".encode())
            self.f.flush()
        if len(data) > max(room, 0):
            self.dropped += len(data) - max(room, 0)

    def line(self, text: str) -> None:
        if self.dropped:
            self.tail.append(text)
            self.dropped_lines += 1

    def close(self) -> None:
        try:
            if self.dropped:
                kept = len(self.tail)
                self.f.write(f"[npufuse: {self.dropped} bytes not saved; the last {kept} lines of output follow]\n".encode())
                self.f.write("".join(ln + "\n" for ln in self.tail).encode("utf-8", errors="replace"))
        finally:
            self.f.close()


# -- the run ---------------------------------------------------------------------------------


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
    log_cap_bytes: int = LOG_CAP_BYTES,
    max_line_chars: int = MAX_LINE_CHARS,
    grace_s: float = GRACE_S,
) -> ChildResult:
    """Run ``cmd`` (argv, or a shell string) to completion, a stop request, or the timeout.

    ``on_line(line)`` returns a reason to stop the run, or None. ``should_stop()`` is polled a few
    times a second (e.g. "the capture file exists"). ``KeyboardInterrupt`` (Ctrl-C, or SIGTERM to
    npufuse) stops the child's whole tree and propagates. Raises ``OSError`` when the command
    cannot start (not found, not executable). On return no process of the launch is left."""
    shell = isinstance(cmd, str)
    start = time.monotonic()
    head: list[str] = []
    tail: deque[str] = deque(maxlen=keep_lines)
    n = 0
    stop_reason: str | None = None
    timed_out = False
    held = False
    total = 0
    splitter = LineSplitter(max_line_chars)
    log = BoundedLog(log_path, log_cap_bytes) if log_path else None
    tree = ProcessTree()
    proc: subprocess.Popen | None = None
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
                bufsize=0,
            )
            sel = selectors.DefaultSelector()

            def take(line: str) -> str | None:
                nonlocal n
                n += 1
                if len(head) < keep_lines:
                    head.append(line)
                tail.append(line)
                if log:
                    log.line(line)
                return on_line(line) if on_line is not None else None

            exited_at: float | None = None
            last_data = time.monotonic()
            next_sample = 0.0
            try:
                # inside the try: an interrupt from here on still ends the tree
                tree.set_root(proc.pid)
                assert proc.stdout is not None
                fd = proc.stdout.fileno()
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ)
                while stop_reason is None:
                    now = time.monotonic()
                    remaining = timeout_s - (now - start)
                    if remaining <= 0:
                        timed_out, stop_reason = True, "timeout"
                        break
                    data = b""
                    eof = False
                    if sel.select(timeout=min(0.2, remaining)):
                        try:
                            data = os.read(fd, READ_CHUNK)
                            eof = not data
                        except BlockingIOError:
                            pass
                    if data:
                        last_data = time.monotonic()
                        total += len(data)
                        if log:
                            log.write(data)
                        for line in splitter.feed(data):
                            stop_reason = take(line)
                            if stop_reason:
                                break
                        if stop_reason:
                            break
                    if eof:
                        for line in splitter.flush():
                            stop_reason = take(line) or stop_reason
                        break
                    if should_stop is not None:
                        stop_reason = should_stop()
                        if stop_reason:
                            break
                    now = time.monotonic()
                    if not tree.subreaper and now >= next_sample:
                        tree.members()  # remember descendants before they can be orphaned to init
                        next_sample = now + TREE_SAMPLE_S
                    if exited_at is None and proc.poll() is not None:
                        exited_at = now
                    if exited_at is not None and (now - exited_at > DRAIN_S or now - max(last_data, exited_at) > DRAIN_QUIET_S):
                        # the child is gone but something it started still holds the pipe:
                        # never wait for that pipe to close (the sweep below ends the holder)
                        held = True
                        for line in splitter.flush():
                            take(line)
                        break
            finally:
                sel.close()
                # Always sweep the tree: a normal exit may leave (setsid) descendants; a stop or
                # an interrupt must end everything the launch started.
                with _DeferSignals() as deferred:
                    if proc.poll() is None or tree.alive() or _group_alive(proc.pid):
                        stop_tree(proc, tree, grace_s, hurry=lambda: deferred.hurry)
                    try:
                        proc.wait(timeout=2.0)
                    except subprocess.TimeoutExpired:
                        pass
                    if proc.stdout is not None:
                        proc.stdout.close()  # no reader thread: closing cannot block
    finally:
        tree.release()
        if log:
            log.close()
    return ChildResult(
        returncode=proc.returncode if proc else None,
        stop_reason=stop_reason,
        timed_out=timed_out,
        wall_s=time.monotonic() - start,
        head=head,
        tail=list(tail),
        lines=n,
        truncated_lines=splitter.truncated,
        output_bytes=total,
        log_bytes_dropped=log.dropped if log else 0,
        held_output=held,
        descendants_killed=len({k for k in tree.killed if tree.root is None or k != tree.root}),
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
