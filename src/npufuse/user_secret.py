"""A per-user secret kept outside every repository, so what a cloned repository ships in its
``.npufuse`` folder is never mistaken for what this user's npufuse wrote.

The secret (32 random bytes) lives in the user's cache folder (``$XDG_CACHE_HOME/npufuse`` or
``~/.cache/npufuse``, mode 0700/0600). It is mixed into the scan cache's entry names and run
records (:mod:`npufuse.scan.cache`), so a shipped ``.npufuse/cache`` is never looked up, and it
vouches for the scan.json files this user's ``npufuse scan`` wrote (:func:`remember_scan`): only
those may name a root outside the folder holding the state dir.

When the cache folder cannot be written there is no secret: the scan cache is then off (speed
only) and every scan.json root must lie inside the repository.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import os
import stat
from pathlib import Path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def user_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or ""
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".cache"
    return root / "npufuse"


def secret() -> bytes | None:
    """This user's secret (made on first use); None when it cannot be kept."""
    return _secret_at(str(user_dir()))


@functools.lru_cache(maxsize=8)
def _secret_at(folder: str) -> bytes | None:
    path = os.path.join(folder, "secret")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        for _ in range(3):
            got = _read_secret(path)
            if got is not None:
                return got
            tmp = f"{path}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o600)
            try:
                os.write(fd, os.urandom(32))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # fails when another process made it first: then read theirs
            except FileExistsError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    except OSError:
        return None
    return None


def _read_secret(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"{path}: not a private file of this user")
        data = os.read(fd, 64)
    finally:
        os.close(fd)
    if len(data) != 32:
        raise PermissionError(f"{path}: not an npufuse secret")
    return data


def keyed(text: str) -> str | None:
    """HMAC-SHA256 of ``text`` under this user's secret (hex); None without a secret."""
    key = secret()
    if key is None:
        return None
    return hmac.new(key, text.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def _scan_marker(state_dir: Path, data: bytes) -> Path | None:
    try:
        where = os.path.abspath(state_dir)
    except (OSError, ValueError):
        return None
    tag = keyed(f"scan\0{where}\0{hashlib.sha256(data).hexdigest()}")
    return None if tag is None else user_dir() / "scans" / tag


def remember_scan(state_dir: Path, data: bytes) -> None:
    """Record that this user's npufuse wrote ``data`` as ``state_dir/scan.json``."""
    marker = _scan_marker(state_dir, data)
    if marker is None:
        return
    with contextlib.suppress(OSError):
        marker.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | _NOFOLLOW, 0o600))


def vouches_for_scan(state_dir: Path) -> bool:
    """Whether ``state_dir/scan.json`` is exactly what this user's ``npufuse scan`` wrote there."""
    from npufuse.state_folder import read_state_file

    try:
        data = read_state_file(state_dir, "scan.json")
    except OSError:
        return False
    if data is None:
        return False
    marker = _scan_marker(state_dir, data)
    return marker is not None and marker.is_file()
