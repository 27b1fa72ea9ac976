"""The state folder (``.npufuse``) of a repository that may be hostile.

A cloned repository can ship its own ``.npufuse``: ``backup`` as a symlink to a folder on
``sys.path`` made ``apply`` drop a ``sitecustomize.py`` there (issue 19). So every file npufuse
keeps in the state folder is reached through directory file descriptors opened with
``O_NOFOLLOW`` one component at a time, from the state folder down: the state folder and every
folder under it must be real directories, a symlink anywhere there is refused, files are
created with ``O_EXCL|O_NOFOLLOW`` and renamed into place inside that same directory, and reads
accept regular files only (opened non-blocking: a FIFO or a link to ``/dev/zero`` cannot hang
or exhaust memory), up to a size cap.

The path *leading to* the state folder is the user's own choice (``--state-dir``, the working
folder) and is followed as usual; from the state folder's own name down, nothing is.

:func:`lock` is the exclusive lock every state-changing verb holds (``<state>/lock``, flock).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
import time
from pathlib import Path, PurePosixPath
from typing import Iterator, Sequence

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# state.json and scan.json of a real repository are far below this; a bigger one is refused
# rather than read into memory
MAX_STATE_FILE_BYTES = 1 << 30


class UnsafeStatePath(OSError):
    """A path in the state folder that is a symlink, a special file or too large; the message
    names it and says what to do."""

    def __init__(self, path: Path | str, why: str) -> None:
        super().__init__(errno.ELOOP, f"{why}; refusing (move it away to start over)", str(path))

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def parts_of(rel: str) -> tuple[str, ...]:
    """The components of a path relative to the state folder; refuses absolute paths, ``..``
    and empty names (a tampered state.json naming a backup elsewhere)."""
    pure = PurePosixPath(str(rel).replace("\\", "/"))
    if not str(rel) or pure.is_absolute() or any(p in ("..", "") for p in pure.parts) or ":" in pure.parts[0]:
        raise UnsafeStatePath(rel, "not a path inside the state folder")
    return tuple(p for p in pure.parts if p != ".")


def _open_dir_at(parent_fd: int | None, name: str, shown: Path, *, create: bool, follow: bool = False) -> int:
    flags = os.O_RDONLY | _DIRECTORY | _CLOEXEC | (0 if follow else _NOFOLLOW)
    if create:
        try:
            os.mkdir(name, 0o777, dir_fd=parent_fd)
        except FileExistsError:
            pass
    try:
        return os.open(name, flags, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            try:
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            except OSError:
                raise exc from None
            what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise UnsafeStatePath(shown, f"is {what}, where npufuse keeps a folder of its own state") from None
        raise


def open_state_dir(state_dir: Path | str, sub: Sequence[str] = (), *, create: bool = False) -> int:
    """A directory fd of ``state_dir/sub...``: the state folder itself and each folder under it
    opened with ``O_NOFOLLOW`` (made when ``create``). Raises FileNotFoundError when absent
    (without ``create``) and :class:`UnsafeStatePath` for a symlink or non-directory."""
    state_dir = Path(state_dir)
    parent = state_dir.parent
    name = state_dir.name
    if name in ("", ".", ".."):  # "--state-dir ." / ".." : the folder itself is the user's choice
        fd = os.open(str(state_dir), os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    else:
        if create:
            parent.mkdir(parents=True, exist_ok=True)
        pfd = os.open(str(parent), os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        try:
            fd = _open_dir_at(pfd, name, state_dir, create=create)
        finally:
            os.close(pfd)
    shown = state_dir
    for part in sub:
        shown = shown / part
        try:
            nfd = _open_dir_at(fd, part, shown, create=create)
        finally:
            os.close(fd)
        fd = nfd
    return fd


def check_state_dir(state_dir: Path | str, *, create: bool = False) -> None:
    """Raise :class:`UnsafeStatePath` when the state folder exists but is a symlink or not a
    directory (made when ``create``)."""
    try:
        os.close(open_state_dir(state_dir, create=create))
    except FileNotFoundError:
        if create:
            raise


def _file_kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def read_state_file(state_dir: Path | str, rel: str, *, max_bytes: int = MAX_STATE_FILE_BYTES) -> bytes | None:
    """The bytes of ``state_dir/rel``, or None when it (or a folder on the way) does not exist.
    Raises :class:`UnsafeStatePath` for a symlink, special file or a file over ``max_bytes``."""
    parts = parts_of(rel)
    shown = Path(state_dir).joinpath(*parts)
    try:
        dfd = open_state_dir(state_dir, parts[:-1])
    except FileNotFoundError:
        return None
    try:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENXIO, errno.EISDIR):
                st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
                raise UnsafeStatePath(shown, f"is {_file_kind(st.st_mode)}, where npufuse keeps a file of its own state") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeStatePath(shown, f"is {_file_kind(st.st_mode)}, where npufuse keeps a file of its own state")
            if st.st_size > max_bytes:
                raise UnsafeStatePath(shown, f"is {st.st_size} bytes, more than npufuse ever writes there ({max_bytes})")
            chunks = []
            total = 0
            while True:
                chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                if total > max_bytes:  # grew while read
                    raise UnsafeStatePath(shown, f"is more than {max_bytes} bytes")
            return b"".join(chunks)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


def state_file_exists(state_dir: Path | str, rel: str) -> bool:
    """Whether ``state_dir/rel`` is there (anything, a symlink included: readers then refuse it)."""
    parts = parts_of(rel)
    try:
        dfd = open_state_dir(state_dir, parts[:-1])
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(dfd)


def write_state_file(state_dir: Path | str, rel: str, data: bytes, *, mode: int | None = None) -> None:
    """Replace ``state_dir/rel`` with ``data`` atomically (temp file, fsync, rename in the same
    directory fd), making missing folders; never through a symlink. An existing symlink or special
    file at ``rel`` is refused rather than replaced."""
    parts = parts_of(rel)
    shown = Path(state_dir).joinpath(*parts)
    dfd = open_state_dir(state_dir, parts[:-1], create=True)
    name = parts[-1]
    try:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeStatePath(shown, f"is {_file_kind(st.st_mode)}, where npufuse keeps a file of its own state")
        except FileNotFoundError:
            pass
        for attempt in range(100):
            tmp = f".{name}.{os.getpid()}.{time.monotonic_ns() % 10**9}.{attempt}.npufuse-tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600 if mode is None else mode & 0o777, dir_fd=dfd)
                break
            except FileExistsError:
                continue
        else:  # pragma: no cover - a hundred collisions
            raise FileExistsError(errno.EEXIST, "cannot make a temporary file", str(shown))
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
                if mode is not None:
                    os.fchmod(fd, mode & 0o7777)
                else:
                    umask = os.umask(0)
                    os.umask(umask)
                    os.fchmod(fd, 0o666 & ~umask)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)


# -- the lock ------------------------------------------------------------------------------------

LOCK_NAME = "lock"


class StateBusy(Exception):
    """Another npufuse command holds the state folder's lock."""


def _lock_wait_default() -> float:
    try:
        value = float(os.environ.get("NPUFUSE_LOCK_WAIT", "60"))
    except ValueError:
        return 60.0
    return value if value == value and 0 <= value < 1e9 else 60.0


@contextlib.contextmanager
def lock(state_dir: Path | str, *, wait_s: float | None = None, verb: str = "npufuse") -> Iterator[None]:
    """Hold ``state_dir/lock`` exclusively (flock) for the block: every verb that changes the
    state folder (scan, apply, revert, verify) runs inside it, so two of them never interleave
    their read-modify-write of state.json. A second one waits up to ``wait_s`` seconds
    (``NPUFUSE_LOCK_WAIT``, default 60), saying so once, then raises :class:`StateBusy`."""
    import fcntl

    wait_s = _lock_wait_default() if wait_s is None else wait_s
    dfd = open_state_dir(state_dir, create=True)
    try:
        try:
            st = os.stat(LOCK_NAME, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeStatePath(Path(state_dir) / LOCK_NAME, f"is {_file_kind(st.st_mode)}, where npufuse keeps its lock file")
        except FileNotFoundError:
            pass
        fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC, 0o666, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _holder(fd)
                    raise StateBusy(
                        f"another npufuse command{holder} is changing {state_dir}; wait for it to finish "
                        "(NPUFUSE_LOCK_WAIT=SECONDS waits longer)"
                    ) from None
                if not told:
                    print(f"{verb}: waiting for another npufuse command{_holder(fd)} to release {Path(state_dir) / LOCK_NAME}", file=sys.stderr)
                    told = True
                time.sleep(0.1)
        with contextlib.suppress(OSError):  # who holds it, for the message of the next one
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (pid {text})" if text.isdigit() else ""
