"""Which files a scan reads: Python sources under a root, in a stable order.

Honours ``.gitignore`` (the root's, nested ones, and those of enclosing folders up to the git
work tree top, plus ``.git/info/exclude``) the way git does: a file git tracks is read even where an
ignore pattern matches it (a repository that ignores ``models/`` but commits its model package is
scanned in full), skips virtualenvs, build/dist/cache folders and VCS
metadata, follows folder symlinks once (a link back to an ancestor is reported as a loop, never
followed), and names every path relative to the root with ``/``. Problems are returned as
:class:`Failure` entries, never raised: one bad folder must not stop the scan.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pathspec

from npufuse.untrusted_git import run_git

# Folder names never descended into, with the reason shown in the report.
SKIP_DIRS: dict[str, str] = {
    ".git": "version control",
    ".hg": "version control",
    ".svn": "version control",
    ".venv": "virtualenv",
    "venv": "virtualenv",
    "site-packages": "installed packages",
    "dist-packages": "installed packages",
    "node_modules": "node_modules",
    "__pycache__": "cache",
    ".mypy_cache": "cache",
    ".pytest_cache": "cache",
    ".ruff_cache": "cache",
    ".hypothesis": "cache",
    ".ipynb_checkpoints": "cache",
    ".cache": "cache",
    ".tox": "test environments",
    ".nox": "test environments",
    ".eggs": "build output",
    "build": "build output",
    "dist": "build output",
    ".npufuse": "npufuse state",
}

# Folders of code that is not the model: test suites, tutorials and usage examples. Skipped by
# default (a scan is about the model a repo ships; a test's hand-written reference RMSNorm is not
# a site anyone ports), listed in the report with this reason; ``include_tests=True`` (the CLI's
# ``--include-tests``) scans them. The scan root itself is never skipped, whatever its name: the
# demo scans a copy of ``examples/tiny_llama``, and a user may point npufuse at ``examples/``.
NON_MODEL_DIRS: frozenset[str] = frozenset({
    "test", "tests", "testing", "unittest", "unittests", "unit_tests", "integration_tests",
    "tutorial", "tutorials", "example", "examples", "notebooks", "docs", "doc",
})
NON_MODEL_REASON = "tests, examples or tutorials (--include-tests scans them)"

PYTHON_SUFFIXES = (".py",)
# Shape sources read by config_shapes (small JSON/YAML files named for configuration).
DATA_SUFFIXES = (".json", ".yaml", ".yml")


@dataclass(frozen=True)
class Failure:
    """A file (or folder, ending in ``/``) that could not be scanned, and why."""

    file: str
    kind: str  # binary | encoding | syntax | too_large | unreadable | symlink_loop | broken_symlink | detector_error | assess_error
    error: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "error": self.error, "kind": self.kind}


@dataclass
class WalkResult:
    root: Path  # folder every path below is relative to
    files: list[str] = field(default_factory=list)  # Python sources
    data_files: list[str] = field(default_factory=list)  # config.json / *config*.yaml candidates
    failed: list[Failure] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)  # folders not descended: {"path", "reason"}


def is_data_file(rel: str) -> bool:
    """Configuration files that may carry model shapes (``config.json``, ``configs/x.yaml``)."""
    name = rel.rsplit("/", 1)[-1].lower()
    parent = rel.rsplit("/", 2)[-2].lower() if rel.count("/") else ""
    if not name.endswith(DATA_SUFFIXES):
        return False
    return "config" in name or parent in ("config", "configs", "conf")


def _skip_reason(path: str, name: str, include_tests: bool = False) -> str | None:
    if name in SKIP_DIRS:
        return SKIP_DIRS[name]
    if not include_tests and name.lower() in NON_MODEL_DIRS:
        return NON_MODEL_REASON
    if name.endswith(".egg-info"):
        return "build output"
    # A virtualenv or conda env under any name: its marker file says so. (os.path, not pathlib:
    # this runs for every folder of every scan, warm ones included.)
    if os.path.isfile(os.path.join(path, "pyvenv.cfg")):
        return "virtualenv"
    if os.path.isdir(os.path.join(path, "conda-meta")):
        return "conda environment"
    return None


class _Ignore:
    """Stacked gitignore specs: the deepest file with a matching pattern decides (git's rule)."""

    def __init__(self, specs: list[tuple[str, pathspec.GitIgnoreSpec]]):
        self.specs = specs  # (base relative to the walk root with trailing '/', or a '../' prefix form)

    def with_dir(self, base: str, folder: str | Path) -> "_Ignore":
        spec = _read_spec(os.path.join(folder, ".gitignore"))
        return _Ignore(self.specs + [(base, spec)]) if spec is not None else self

    def ignored(self, rel: str, is_dir: bool) -> bool:
        verdict = None
        for base, spec in self.specs:
            if base.startswith("@"):  # an enclosing folder: prefix is the path from it to the root
                sub = base[1:] + rel
            elif rel.startswith(base) or not base:
                sub = rel[len(base):]
            else:
                continue
            res = spec.check_file(sub + "/" if is_dir else sub)
            if res.include is not None:
                verdict = res.include
        return bool(verdict)


class _Tracked:
    """The files git tracks under the walk root, asked only when an ignore pattern first matches a
    Python file or a folder (most scans never ask). ``None`` where the root is not in a git work
    tree, git is absent or refuses (another user's repository): the ignore patterns then decide
    alone, as before.

    The repository is untrusted: ``git ls-files --cached`` only reads the index, through
    :func:`npufuse.untrusted_git.run_git` (the repository's ``core.fsmonitor`` command switched off)."""

    def __init__(self, root: str):
        self.root = root
        self._files: frozenset[str] | None = None
        self._dirs: frozenset[str] = frozenset()
        self._asked = False

    def _ask(self) -> None:
        self._asked = True
        out = run_git(["ls-files", "--cached", "-z"], self.root)
        if out is None or out.returncode != 0:
            return
        files = frozenset(p for p in out.stdout.decode("utf-8", "surrogateescape").split("\0") if p)
        dirs: set[str] = set()
        for f in files:
            cut = f.rfind("/")
            while cut > 0 and f[: cut + 1] not in dirs:
                dirs.add(f[: cut + 1])
                cut = f.rfind("/", 0, cut)
        self._files, self._dirs = files, frozenset(dirs)

    def has_file(self, rel: str) -> bool:
        if not self._asked:
            self._ask()
        return self._files is not None and rel in self._files

    def has_dir(self, rel_dir: str) -> bool:
        """True when git tracks a file somewhere below ``rel_dir`` (ending in ``/``)."""
        if not self._asked:
            self._ask()
        return rel_dir in self._dirs


def _read_spec(path: str | Path) -> pathspec.GitIgnoreSpec | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    return pathspec.GitIgnoreSpec.from_lines(text.splitlines())


def _enclosing_top(real: Path) -> Path | None:
    """The git work tree holding the resolved folder ``real`` (the nearest folder with ``.git``), or None."""
    for folder in [real, *real.parents]:
        if (folder / ".git").exists():
            return folder
    return None


def _enclosing_specs(real: Path, top: Path) -> list[tuple[str, pathspec.GitIgnoreSpec]]:
    """.gitignore files of folders above the resolved root ``real`` up to the git work tree ``top``."""
    chain = [real, *real.parents]
    chain = chain[: chain.index(top) + 1]
    specs: list[tuple[str, pathspec.GitIgnoreSpec]] = []
    exclude = _read_spec(top / ".git" / "info" / "exclude") if (top / ".git").is_dir() else None
    above = list(reversed(chain[1:]))  # top .. root's parent (root's own .gitignore comes later)
    if exclude is not None:
        specs.append(("@" + _prefix(top, real), exclude))
    for folder in above:
        spec = _read_spec(folder / ".gitignore")
        if spec is not None:
            specs.append(("@" + _prefix(folder, real), spec))
    # A folder the work tree ignores but the user named explicitly is scanned in full.
    if _Ignore(specs).ignored("", is_dir=True):
        return []
    return specs


def _prefix(ancestor: Path, root: Path) -> str:
    rel = root.relative_to(ancestor).as_posix()
    return "" if rel == "." else rel + "/"


def walk(target: Path | str, include_tests: bool = False) -> WalkResult:
    """Python files under ``target`` (a folder or one file). ``target`` must exist (the caller
    turns a missing path into a usage error). Folders named in :data:`NON_MODEL_DIRS` below the
    root are skipped (and listed in ``skipped``) unless ``include_tests``."""
    target = Path(target)
    if not target.is_dir():
        # One file: scanned whatever its name; gitignore does not apply to an explicit path.
        result = WalkResult(root=target.parent)
        rel = target.name
        try:
            target.stat()
        except OSError as exc:
            result.failed.append(_os_failure(rel, exc))
            return result
        result.files.append(rel)
        return result

    result = WalkResult(root=target)
    try:
        real: Path | None = target.resolve()
    except OSError:
        real = None
    top = _enclosing_top(real) if real is not None else None
    ignore = _Ignore(_enclosing_specs(real, top) if real is not None and top is not None else []).with_dir("", target)
    seen_dirs: set[tuple[int, int]] = set()
    seen_files: set[tuple[int, int]] = set()
    try:
        st = target.stat()
        seen_dirs.add((st.st_dev, st.st_ino))
    except OSError as exc:
        result.failed.append(_os_failure("./", exc))
        return result
    tracked = _Tracked(os.fspath(target)) if top is not None else None
    _walk_dir(os.fspath(target), "", ignore, [(st.st_dev, st.st_ino)], seen_dirs, seen_files, result, include_tests, tracked)
    result.files.sort()
    result.data_files.sort()
    result.failed.sort(key=lambda f: (f.file, f.kind))
    result.skipped.sort(key=lambda s: s["path"])
    return result


def _walk_dir(
    folder: str,
    rel_dir: str,
    ignore: _Ignore,
    ancestors: list[tuple[int, int]],
    seen_dirs: set[tuple[int, int]],
    seen_files: set[tuple[int, int]],
    result: WalkResult,
    include_tests: bool = False,
    tracked: _Tracked | None = None,
    only_tracked: bool = False,
) -> None:
    # only_tracked: this folder is ignored, but git tracks files below it: read just those.
    try:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        result.failed.append(_os_failure(rel_dir or "./", exc))
        return
    for entry in entries:
        rel = rel_dir + entry.name
        path = entry.path
        try:
            is_link = entry.is_symlink()
            st = os.stat(entry.path)  # follows links; ELOOP for a link to itself
        except OSError as exc:
            if entry.name.endswith(PYTHON_SUFFIXES) or _is_link_quiet(entry):
                result.failed.append(_os_failure(rel, exc, link=True))
            continue
        if stat.S_ISDIR(st.st_mode):
            reason = _skip_reason(path, entry.name, include_tests)
            sub_only_tracked = only_tracked
            if reason is None and (only_tracked or ignore.ignored(rel, is_dir=True)):
                if tracked is not None and tracked.has_dir(rel + "/"):
                    sub_only_tracked = True
                else:
                    reason = ".gitignore"
            if reason is not None:
                result.skipped.append({"path": rel + "/", "reason": reason})
                continue
            ident = (st.st_dev, st.st_ino)
            if ident in ancestors:
                result.failed.append(Failure(rel + "/", "symlink_loop", "symlink loop: the link points back to one of its own parent folders (not followed)"))
                continue
            if ident in seen_dirs:
                if is_link:
                    result.skipped.append({"path": rel + "/", "reason": "symlink to a folder already scanned"})
                continue
            seen_dirs.add(ident)
            _walk_dir(path, rel + "/", ignore.with_dir(rel + "/", path), ancestors + [ident], seen_dirs, seen_files, result, include_tests, tracked, sub_only_tracked)
        elif stat.S_ISREG(st.st_mode):
            python = entry.name.endswith(PYTHON_SUFFIXES)
            if not python and not is_data_file(rel):
                continue  # neither kind is read: no need to ask the gitignore specs
            if (only_tracked or ignore.ignored(rel, is_dir=False)) and not (tracked is not None and tracked.has_file(rel)):
                continue
            if python:
                ident = (st.st_dev, st.st_ino)
                if ident in seen_files:
                    continue  # the same file reached through a symlink: scanned once
                seen_files.add(ident)
                result.files.append(rel)
            else:
                result.data_files.append(rel)


def _is_link_quiet(entry: os.DirEntry) -> bool:
    try:
        return entry.is_symlink()
    except OSError:
        return False


def _os_failure(rel: str, exc: OSError, link: bool = False) -> Failure:
    if exc.errno == errno.ELOOP:
        return Failure(rel, "symlink_loop", "symlink loop: the link resolves to itself (too many levels of symbolic links)")
    if exc.errno == errno.ENOENT and link:
        return Failure(rel, "broken_symlink", "broken symlink: its target does not exist")
    if isinstance(exc, PermissionError):
        return Failure(rel, "unreadable", "unreadable: permission denied")
    return Failure(rel, "unreadable", f"unreadable: {exc.strerror or exc}")
