"""Writes that never leave a half-written file: temp file in the same folder, fsync, rename."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


def write_bytes_atomic(path: Path, data: bytes, *, mode: int | None = None, expect_sha256: str | None = None) -> None:
    """Replace ``path`` with ``data`` atomically: readers see the old or the new file, never a mix.
    Keeps the original file's permission bits and (where the process may) its owner and group.
    With ``expect_sha256``, the file's bytes are hashed again right before the rename and a
    difference (a user's editor saved meanwhile) raises :class:`ChangedMeanwhile`, the file as it
    is now untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        old = os.stat(path)
    except FileNotFoundError:
        old = None
    if mode is None and old is not None:
        mode = old.st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".npufuse-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
            if old is not None and (old.st_uid, old.st_gid) != (os.fstat(fh.fileno()).st_uid, os.fstat(fh.fileno()).st_gid):
                try:
                    os.fchown(fh.fileno(), old.st_uid, old.st_gid)
                except PermissionError:
                    raise PermissionError(errno.EPERM, "cannot keep its owner and group (the new file would belong to this user)", str(path)) from None
        if mode is not None:
            os.chmod(tmp, mode)
        if expect_sha256 is not None:
            now = _sha256_now(path)
            if now != expect_sha256:
                raise ChangedMeanwhile(errno.EAGAIN, "changed while npufuse was writing it (an editor saved?); left as it is now", str(path))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class ChangedMeanwhile(OSError):
    """The file's bytes differ from what the write was planned against."""


def _sha256_now(path: Path) -> str | None:
    import hashlib

    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return None


def write_text_atomic(path: Path, text: str) -> None:
    # newline="" semantics: the text is written exactly as given (no \n translation)
    write_bytes_atomic(path, text.encode("utf-8"))


def read_regular_file(path: Path, *, max_bytes: int) -> bytes | None:
    """The bytes of ``path`` when it is a regular file of at most ``max_bytes`` (links followed);
    else None: a FIFO, device or terminal (``/dev/stdout``) is never read, so a comparison
    against an output's old content cannot block or read without end."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return None
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks) if total <= max_bytes else None
    except OSError:
        return None
    finally:
        os.close(fd)


def write_output(path: Path, data: bytes) -> None:
    """Write a user-named output (``-o FILE``) the way the user meant it: a regular file (or a
    new one) is replaced atomically, keeping its mode and owner; a symlink is written through
    (its target replaced, the link kept); a character device or FIFO (``/dev/null``,
    ``/dev/stdout``, a named pipe with a reader) is written to in place — never replaced by a
    regular file; anything else (a folder, a block device, a socket, a FIFO nobody reads) is
    refused with an OSError naming it."""
    import errno
    import fcntl
    import stat

    path = Path(path)
    try:
        st = os.stat(path)  # follows a symlink: its target is what the user meant
    except FileNotFoundError:
        st = None
    if st is not None and (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        try:
            fd = os.open(path, os.O_WRONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                raise OSError(errno.ENXIO, "a FIFO nobody is reading; refusing to wait for a reader", str(path)) from None
            raise
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~getattr(os, "O_NONBLOCK", 0))
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        return
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a special file"
        raise OSError(errno.EINVAL, f"is {kind}; refusing to replace it", str(path))
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    mode = None
    if st is None:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    write_bytes_atomic(target, data, mode=mode)
