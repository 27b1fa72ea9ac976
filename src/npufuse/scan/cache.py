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
make ``npufuse scan`` run code. Nor is a shipped cache ever read: entry names and run records
are keyed with this user's secret (:mod:`npufuse.user_secret`, kept outside every repository),
so a cache made on another machine or by another user is never looked up; without a secret
there is no cache. Folders are checked to be real directories (no symlink) before anything is
written into them, and files are created with ``O_EXCL|O_NOFOLLOW``.

One level up, a *run record* (``<cache dir>/<version>/run-<slot>.json``, one per pair of output
paths) remembers the digest of every input of the last complete scan (:func:`run_key`: npufuse's
whole source, the Python and library versions, the detectors, the options, the walk's result and
each file's content sha256) and the sha256 of the scan.json and report.md it wrote. When the
digest and the on-disk outputs still match, those outputs are what a full scan would write again,
so ``npufuse scan`` stops there. Anything that cannot be keyed (an unreadable file, a profile
join) gets no record, and a record that does not parse is ignored.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import json
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

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
        return _file_sha256(os.path.abspath(path))
    except (OSError, TypeError):
        return None


@functools.lru_cache(maxsize=256)
def _file_sha256(path: str) -> str:
    """Once per process, like :func:`package_digest`: a detector module edited on disk after this
    process imported it must not file the old code's results under the new source's key (nor
    make every later scan in the process miss)."""
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


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
    # the interpreter too: ast.unparse (parameters in an outcome) differs between versions
    h = hashlib.sha256(f"{FORMAT}\0{__version__}\0{sys.version}\0{options!r}\0{package}\0".encode())
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
        self._dir = os.fspath(self.dir)  # lookups build paths as strings: pathlib costs more than the read
        self.fingerprint = fingerprint
        from npufuse.user_secret import secret

        # None: no per-user secret can be kept, so no entry can be told apart from a shipped one
        self.secret = secret()
        self.hits = 0
        self.misses = 0
        self._made: set[str] = set()  # entry folders this process made (or found) already
        self._tmp_count = 0

    def is_empty(self) -> bool:
        """Whether this npufuse version has written nothing here yet (no entry, no run record):
        then no lookup can hit, and the scan need not hash its files up front."""
        if self.secret is None:
            return True
        try:
            with os.scandir(self._dir) as it:
                return next(it, None) is None
        except OSError:
            return True  # absent (or unreadable: every lookup would miss anyway)

    def key(self, rel: str, sha256: str) -> str:
        # rel is part of the key: paths recorded in the outcome (facts, near misses) depend on it
        # the secret first: nobody without it can name (and so plant) an entry this user reads
        return hashlib.sha256((self.secret or b"") + f"\0{self.fingerprint}\0{rel}\0{sha256}".encode("utf-8", "surrogatepass")).hexdigest()

    def _path(self, key: str) -> Path:
        return Path(self._entry(key))

    def _entry(self, key: str) -> str:
        return os.path.join(self._dir, key[:2], key + ".pkl")

    def get(self, rel: str, sha256: str) -> FileOutcome | None:
        from npufuse.scan.engine import FileOutcome

        if self.secret is None:
            self.misses += 1
            return None
        try:
            with open(self._entry(self.key(rel, sha256)), "rb") as fh:
                data = fh.read()
        except OSError:
            self.misses += 1
            return None
        try:
            if not data.startswith(_MAGIC):
                raise pickle.UnpicklingError("not a cache entry")
            stream = io.BytesIO(data)  # shares the bytes (no copy of the entry, as a slice would make)
            stream.seek(len(_MAGIC))
            outcome = _Unpickler(stream).load()
            if not isinstance(outcome, FileOutcome) or outcome.file != rel or outcome.sha256 != sha256:
                raise pickle.UnpicklingError("entry is for another file")
        except Exception:  # corrupt or foreign: a miss; the fresh result overwrites it
            self.misses += 1
            return None
        self.hits += 1
        return outcome

    def put(self, outcome: FileOutcome) -> None:
        if outcome.sha256 is None or self.secret is None:
            return  # unreadable or too large: nothing to key it by, and cheap to redo
        entry = self._entry(self.key(outcome.file, outcome.sha256))
        folder = os.path.dirname(entry)
        try:
            data = _MAGIC + pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
            # A cold scan writes thousands of entries: the folders are made (and the cache
            # marked) once per process, and the temporary file is named, not searched for
            # (mkstemp's random names and fdopen cost more syscalls than the entry's own write).
            if folder not in self._made:
                _check_real_dirs(self.base, folder, make=True)
                if not self._made:
                    self._mark()
                self._made.add(folder)
            self._tmp_count += 1
            tmp = os.path.join(folder, f".tmp-{os.getpid()}-{self._tmp_count}.pkl")
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileExistsError:  # left by a killed process that had this pid
                fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".pkl")
            except FileNotFoundError:  # the folder was removed since this process made it
                _check_real_dirs(self.base, folder, make=True)
                fd = os.open(tmp, flags, 0o600)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
                os.replace(tmp, entry)  # atomic: readers see the old entry or the whole new one
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except (OSError, pickle.PicklingError, TypeError, AttributeError, RecursionError):
            pass  # a cache that cannot be written costs speed only

    def _mark(self) -> None:
        """Keep the cache out of git and backups (as ruff and pytest do), once per folder; never
        through a symlink a repository shipped there."""
        _check_real_dirs(self.base, os.fspath(self.base))
        for name, text in ((".gitignore", "# created by npufuse scan\n*\n"), ("CACHEDIR.TAG", "Signature: 8a477f597d28d172789f06886806bc55\n# npufuse scan cache\n")):
            try:
                fd = os.open(self.base / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
            except FileExistsError:
                continue
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)


def _check_real_dirs(base: Path, folder: str, *, make: bool = False) -> None:
    """Raise OSError unless ``base`` and every folder from it down to ``folder`` is a real
    directory (made one by one when ``make``, each checked before anything is made inside it):
    a cache folder a repository shipped as a symlink is not written through."""
    import stat

    here = Path(base)
    rest = Path(folder).relative_to(here).parts if Path(folder) != here else ()
    for part in ("",) + tuple(rest):
        here = here / part if part else here
        if make:
            try:
                os.mkdir(here)
            except FileExistsError:
                pass
        if not stat.S_ISDIR(os.lstat(here).st_mode):
            raise OSError(40, "not a real directory (a symlink?); the cache is not written there", os.fspath(here))


def lookup(cache: ScanCache, root: Path, rel: str, max_bytes: int) -> FileOutcome | None:
    """The cached outcome of ``root/rel`` as it is on disk now, or None (read errors included:
    the full analysis reports them)."""
    digest = file_digest(root / rel, max_bytes)
    if digest is None or digest.startswith("size:"):
        return None
    return cache.get(rel, digest)


def file_digest(path: Path, max_bytes: int) -> str | None:
    """sha256 (hex) of a file's bytes, as :func:`npufuse.scan.engine.read_source` would hash
    them; ``"size:N"`` for a file over ``max_bytes`` (its scan result depends on the size only);
    None when it cannot be read."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > max_bytes:
                return f"size:{size}"
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return None


# -- the run record: the whole scan's outputs, reused when no input changed --------------------

RUN_FORMAT = 1
# Third-party code whose behaviour shapes the outputs of a scan that reads no changed file:
# jinja2 renders the report, libcst the rare replacement the fast renderer declines, PyYAML
# reads YAML configs. (pathspec decides the walk, which runs every time.)
_LIBRARIES = ("jinja2", "libcst", "yaml")


@functools.lru_cache(maxsize=4)
def code_digest(package: Path) -> str | None:
    """One hash over every file of the npufuse package (sources, templates, data), once per
    process like :func:`package_digest`: the report's code and templates decide report.md as
    much as the detectors decide the findings. None when a file cannot be read."""
    h = hashlib.sha256()
    try:
        for path in sorted(package.rglob("*")):
            if "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo") or not path.is_file():
                continue
            h.update(f"{path.relative_to(package).as_posix()}={hashlib.sha256(path.read_bytes()).hexdigest()}\0".encode())
    except OSError:
        return None
    return h.hexdigest()


def _environment() -> str:
    """The interpreter (ast.unparse and friends vary between versions) and the installed
    libraries of :data:`_LIBRARIES`, named by their package file's path, size and mtime: an
    upgrade or reinstall rewrites it. Found without importing them (a warm run must not)."""
    import importlib.util

    parts = [sys.implementation.cache_tag or "", sys.version]
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None) if module is not None else None
        try:
            spec = spec or importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        origin = getattr(spec, "origin", None)
        try:
            st = os.stat(origin) if origin else None
        except OSError:
            st = None
        parts.append(f"{name}={origin}:{st.st_size}:{st.st_mtime_ns}" if st else f"{name}=absent")
    return "\0".join(parts)


def run_key(fingerprint: str, parts: Iterable[Any]) -> str | None:
    """The digest of every input of a scan's outputs: the per-file ``fingerprint`` (version,
    options, detectors), npufuse's whole code, the environment and ``parts`` (each turned into
    text with ``repr``: walk result, file digests, settings). None: npufuse's code is unreadable."""
    code = code_digest(PACKAGE)
    if code is None:
        return None
    h = hashlib.sha256(f"run{RUN_FORMAT}\0{__version__}\0{fingerprint}\0{code}\0{_environment()}\0".encode())
    for part in parts:
        h.update(repr(part).encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def _record_path(cache_dir: Path, outputs: Sequence[Path]) -> Path:
    # one record per set of output files: a new key replaces the old record rather than piling up
    # keyed with this user's secret: a run record shipped with a repository is never found
    from npufuse.user_secret import secret

    key = secret()
    if key is None:
        raise OSError(1, "no per-user secret: run records are off")
    slot = hashlib.sha256(key + "\0".join(os.path.abspath(p) for p in outputs).encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return Path(cache_dir) / __version__ / f"run-{slot}.json"


def _sha256_of(path: Path) -> tuple[str, bytes] | None:
    # regular files only: an output named /dev/stdout or a FIFO must not be read (it would block)
    from npufuse.safe_write import read_regular_file

    data = read_regular_file(path, max_bytes=1 << 31)
    if data is None:
        return None
    return hashlib.sha256(data).hexdigest(), data


def reuse_outputs(cache_dir: Path, key: str, outputs: Sequence[Path]) -> tuple[dict[str, Any], dict[Path, bytes]] | None:
    """(the record's ``info``, each output's bytes) when the last complete scan writing these
    ``outputs`` had the inputs ``key`` and every output on disk is still exactly what it wrote;
    else None (no record, another key, an output missing or edited, a corrupt record)."""
    try:
        record = json.loads(_record_path(cache_dir, outputs).read_bytes())
        if not isinstance(record, dict) or record.get("format") != RUN_FORMAT or record.get("key") != key:
            return None
        written = record["outputs"]
        info = record["info"]
        if not isinstance(written, list) or not isinstance(info, dict) or len(written) != len(outputs):
            return None
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or interrupted / garbage: a full scan
        return None
    found: dict[Path, bytes] = {}
    for path, entry in zip(outputs, written):
        if not isinstance(entry, dict) or entry.get("path") != os.path.abspath(path):
            return None
        got = _sha256_of(path)
        if got is None or got[0] != entry.get("sha256"):
            return None  # deleted or edited since: write it again, from a full scan
        found[path] = got[1]
    return info, found


def save_outputs(cache_dir: Path, key: str, outputs: dict[Path, bytes], info: dict[str, Any]) -> None:
    """Record that a complete scan with inputs ``key`` wrote exactly ``outputs``. Atomic; a
    record that cannot be written costs the next run speed only."""
    paths = list(outputs)
    record = {
        "format": RUN_FORMAT,
        "key": key,
        "outputs": [{"path": os.path.abspath(p), "sha256": hashlib.sha256(data).hexdigest()} for p, data in outputs.items()],
        "info": info,
    }
    try:
        target = _record_path(cache_dir, paths)
        _check_real_dirs(Path(cache_dir), os.fspath(target.parent), make=True)
        ScanCache(cache_dir, "")._mark()
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(record, fh)
            os.replace(tmp, target)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except (OSError, TypeError, ValueError):
        pass


def forget_outputs(cache_dir: Path, outputs: Sequence[Path]) -> None:
    """Drop the record for ``outputs`` (their new content was not keyed: the next run scans)."""
    try:
        _record_path(cache_dir, outputs).unlink()
    except OSError:
        pass
