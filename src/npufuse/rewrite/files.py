"""The source files ``apply`` and ``revert`` touch: read exactly, write back in the same encoding,
stay inside the scanned root, keep a backup, and leave files with uncommitted work alone.

Bytes are decoded without newline translation (libcst keeps ``\\r\\n``), with the file's own
PEP 263 encoding and BOM, so an unchanged text encodes back to the identical bytes.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tokenize
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from npufuse.untrusted_git import run_git


class FileProblem(ValueError):
    """A file that cannot be read, decoded or safely addressed; the message names the file."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class SourceFile:
    rel: str  # path relative to the root, as scan.json spells it (posix separators)
    path: Path
    data: bytes
    encoding: str  # codec of the file, e.g. "utf-8", "utf-8-sig" (BOM), "latin-1"
    text: str
    mode: int = 0o100644  # st_mode when read

    @property
    def read_only(self) -> bool:
        """No write bit for its owner: the user marked it not to be changed."""
        return not self.mode & 0o200

    @property
    def write_path(self) -> Path:
        """Where a rewrite goes: a symlink's target (inside the root: :func:`safe_path` checked
        it), so the link stays a link and the file it names is edited."""
        return Path(os.path.realpath(self.path))

    @property
    def sha256(self) -> str:
        return sha256_bytes(self.data)

    def encode(self, text: str) -> bytes:
        try:
            return text.encode(self.encoding)
        except UnicodeEncodeError as exc:
            raise FileProblem(f"{self.rel}: the rewritten text cannot be written as {self.encoding} ({exc.reason})") from None


def safe_path(root: Path, rel: str) -> Path:
    """``root/rel`` for a path from scan.json; refuses absolute paths and anything that leaves
    the root (``..``, or a symlink pointing outside), so a tampered scan cannot write elsewhere."""
    pure = PurePosixPath(rel.replace("\\", "/"))
    if not rel or pure.is_absolute() or ".." in pure.parts or (len(rel) > 1 and rel[1] == ":"):
        raise FileProblem(f"{rel!r}: not a path inside the scanned root; refusing (is scan.json edited by hand?)")
    path = root / Path(*pure.parts)
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        raise FileProblem(f"{rel}: resolves outside the scanned root ({path.resolve()}); refusing") from None
    return path


# the scan skips Python files over --max-file-mb (default 10); apply never needs more than this
MAX_SOURCE_BYTES = 256 << 20


def _read_regular(path: Path, rel: str) -> tuple[bytes, os.stat_result]:
    """The bytes of a regular file, its type checked on the open descriptor first (opened
    non-blocking: a FIFO or a link to /dev/zero named in a tampered scan.json or state.json
    neither blocks nor fills memory) and its size capped."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileProblem(f"{rel}: listed in the scan but missing") from None
    except OSError as exc:
        raise FileProblem(f"{rel}: cannot read ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileProblem(f"{rel}: not a regular file (a FIFO, device or folder); refusing to read or rewrite it")
        if st.st_size > MAX_SOURCE_BYTES:
            raise FileProblem(f"{rel}: {st.st_size} bytes, over the {MAX_SOURCE_BYTES >> 20} MB npufuse rewrites")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > MAX_SOURCE_BYTES:
                raise FileProblem(f"{rel}: grew past {MAX_SOURCE_BYTES >> 20} MB while read")
        return b"".join(chunks), st
    except OSError as exc:
        raise FileProblem(f"{rel}: cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def read_source_file(root: Path, rel: str) -> SourceFile:
    path = safe_path(root, rel)
    try:
        data, st = _read_regular(path, rel)
    except FileProblem as exc:
        if "missing" in str(exc):
            raise FileProblem(f"{rel}: listed in the scan but missing under {root}") from None
        raise
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        text = data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        raise FileProblem(f"{rel}: cannot decode ({exc})") from None
    if encoding == "utf-8" and text.startswith("\ufeff"):  # BOM without detect_encoding noticing
        encoding, text = "utf-8-sig", text[1:]
    return SourceFile(rel=rel, path=path, data=data, encoding=encoding, text=text, mode=st.st_mode)


def backup_path(state_dir: Path, rel: str) -> Path:
    """Where the original of ``rel`` is kept: ``<state_dir>/backup/<rel>``."""
    return Path(state_dir) / "backup" / Path(*PurePosixPath(rel.replace("\\", "/")).parts)


def git_changes(root: Path, path: Path) -> str | None:
    """``git status --porcelain`` line(s) of ``path`` when ``root`` is inside a git work tree and
    the file has uncommitted (or untracked) changes; None when clean, not a repo, or no git."""
    inside = run_git(["rev-parse", "--is-inside-work-tree"], root, timeout=30)
    if inside is None or inside.returncode != 0 or inside.stdout.strip() != b"true":
        return None
    status = run_git(["status", "--porcelain", "--", path.name], path.parent)
    if status is None or status.returncode != 0:
        return None
    out = status.stdout.decode("utf-8", "replace").strip()
    return out or None
