"""On-disk cache of per-file scan results, so an unchanged re-scan skips parsing (like ruff's).

One entry per file version: the key hashes the file's relative path and content sha256, the
npufuse version, the detectors (ids plus a hash of their source files and of the scan
machinery that shapes a :class:`~npufuse.scan.engine.FileOutcome`) and the scan options. Editing
a detector, upgrading npufuse or changing the file therefore misses; nothing is ever stale.

Layout: ``<cache dir>/<version>/<key[:2]>/<key>.pkl``. Each entry is written to a temporary file
and renamed into place, so concurrent scans (and the pool's workers) only ever see whole
entries; the last writer wins with identical content. A corrupt, truncated or foreign entry is a
miss and is rewritten; a cache folder that cannot be written only costs speed, never the scan.

Entries are pickles read back by a restricted unpickler that can build only the scan's own
result types and builtin containers: a state folder that came with a cloned repository cannot
make ``npufuse scan`` run code.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import os
import pickle
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from npufuse import __version__

if TYPE_CHECKING:
    from npufuse.patterns.base import Pattern
    from npufuse.scan.engine import FileOutcome, ScanOptions

# Bump when the entry format changes in a way the source hash below would not notice.
FORMAT = 1
_MAGIC = b"npufuse-scan-cache\n"

# Subpackages whose code decides what a FileOutcome contains: every file, not only the modules
# named by the detectors, since detectors share helpers (patterns/_site.py) that they import.
_PACKAGES = ("scan", "patterns", "rewrite")
PACKAGE = Path(__file__).resolve().parents[1]

# The only globals an entry may reference (see the module docstring).
_ALLOWED = {
    ("npufuse.scan.engine", "FileOutcome"),
    ("npufuse.scan.engine", "Hit"),
    ("npufuse.scan.walk", "Failure"),
    ("npufuse.scan.repo_search", "FileFacts"),
    ("npufuse.scan.repo_search", "SiteContext"),
    ("npufuse.scan.config_shapes", "ConfigSource"),
    ("npufuse.patterns.base", "Finding"),
    ("npufuse.patterns.base", "NearMiss"),
    ("npufuse.patterns.base", "Risk"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a scan result type")


def _source_digest(obj: Any) -> str | None:
    """sha256 of the file defining ``obj``; None when it has no readable source file."""
    try:
        path = inspect.getsourcefile(obj)
        if path is None:
            return None
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except (OSError, TypeError):
        return None


@functools.lru_cache(maxsize=4)
def package_digest(package: Path) -> str | None:
    """One hash over npufuse's scan, patterns and rewrite sources. Computed once per process, at
    the first scan: the code in memory is what was on disk then, and a source edited later (by
    someone working on npufuse) must not file this process's results under the new code's key."""
    h = hashlib.sha256()
    try:
        for sub in _PACKAGES:
            for path in sorted((package / sub).rglob("*.py")):
                h.update(f"{path.relative_to(package).as_posix()}={hashlib.sha256(path.read_bytes()).hexdigest()}\0".encode())
    except OSError:
        return None
    return h.hexdigest()


def fingerprint(patterns: Sequence[Pattern], options: ScanOptions) -> str | None:
    """What, besides the file itself, a cached outcome depends on. None: do not cache (a
    detector without a source file could change without the key noticing)."""
    package = package_digest(PACKAGE)
    if package is None:
        return None
    h = hashlib.sha256(f"{FORMAT}\0{__version__}\0{options!r}\0{package}\0".encode())
    seen: dict[str, str] = {}
    for p in patterns:
        cls = type(p)
        where = inspect.getmodule(cls)
        if where is None:
            return None
        if where.__name__ not in seen:
            digest = _source_digest(where)
            if digest is None:
                return None
            seen[where.__name__] = digest
        # the instance's attributes too: two configurations of one class must not share entries
        h.update(f"{p.id}\0{cls.__module__}.{cls.__qualname__}\0{sorted(vars(p).items())!r}\0".encode())
    for name in sorted(seen):
        h.update(f"{name}={seen[name]}\0".encode())
    return h.hexdigest()


class ScanCache:
    """Get and put FileOutcomes for one scan configuration (picklable: the pool's workers use it)."""

    def __init__(self, directory: str | os.PathLike[str], fingerprint: str) -> None:
        self.base = Path(directory)
        self.dir = self.base / __version__
        self.fingerprint = fingerprint
        self.hits = 0
        self.misses = 0

    def key(self, rel: str, sha256: str) -> str:
        # rel is part of the key: paths recorded in the outcome (facts, near misses) depend on it
        return hashlib.sha256(f"{self.fingerprint}\0{rel}\0{sha256}".encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.pkl"

    def get(self, rel: str, sha256: str) -> FileOutcome | None:
        from npufuse.scan.engine import FileOutcome

        path = self._path(self.key(rel, sha256))
        try:
            data = path.read_bytes()
        except OSError:
            self.misses += 1
            return None
        try:
            if not data.startswith(_MAGIC):
                raise pickle.UnpicklingError("not a cache entry")
            outcome = _Unpickler(io.BytesIO(data[len(_MAGIC):])).load()
            if not isinstance(outcome, FileOutcome) or outcome.file != rel or outcome.sha256 != sha256:
                raise pickle.UnpicklingError("entry is for another file")
        except Exception:  # corrupt or foreign: a miss; the fresh result overwrites it
            self.misses += 1
            return None
        self.hits += 1
        return outcome

    def put(self, outcome: FileOutcome) -> None:
        if outcome.sha256 is None:
            return  # unreadable or too large: nothing to key it by, and cheap to redo
        path = self._path(self.key(outcome.file, outcome.sha256))
        try:
            data = _MAGIC + pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._mark()
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pkl")
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, path)  # atomic: readers see the old entry or the whole new one
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except (OSError, pickle.PicklingError, TypeError, AttributeError, RecursionError):
            pass  # a cache that cannot be written costs speed only

    def _mark(self) -> None:
        """Keep the cache out of git and backups (as ruff and pytest do), once per folder."""
        tag = self.base / ".gitignore"
        if not tag.exists():
            tag.write_text("# created by npufuse scan\n*\n")
            (self.base / "CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55\n# npufuse scan cache\n")


def lookup(cache: ScanCache, root: Path, rel: str, max_bytes: int) -> FileOutcome | None:
    """The cached outcome of ``root/rel`` as it is on disk now, or None (read errors included:
    the full analysis reports them)."""
    path = root / rel
    try:
        if path.stat().st_size > max_bytes:
            return None
        data = path.read_bytes()
    except OSError:
        return None
    return cache.get(rel, hashlib.sha256(data).hexdigest())
