"""Fuzzing a hostile repository (issue 19): tampered state.json and scan.json, a state folder
laid out with symlinks, FIFOs and device links, id ranges, numeric options and text carrying
bidi or terminal controls. For every input: exit 0, 1 or 2 — never a traceback — bad input
answered with one line on stderr, and nothing outside the repository created, changed or read
into it. ``bench/fuzz_long.py`` runs these properties unseeded for as long as it is told
(its docstring records the runs); here they run seeded and briefly.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apply_support import HEAD, MODEL, make_repo, scan
from test_fuzz_scan import BUDGET_SCALE, HANG_CPU_S, Budget, Property, cpu_guard, fuzz_settings, run_property

from npufuse.cli import main, number
from npufuse.text_safety import escape_text, has_unsafe

pytestmark = [pytest.mark.filterwarnings("ignore:Generating overly large repr"), pytest.mark.skipif(os.name != "posix", reason="POSIX file types")]
BUDGETS = {k: Budget(v * BUDGET_SCALE) for k, v in {"state_json": 4, "scan_json": 4, "state_tree": 5, "ids": 2, "options": 1, "display": 1}.items()}
KNOWN: list = []

# -- a repository, its scan, and what lies outside it --------------------------------------------

_TEMPLATE: dict[str, Path] = {}


def _template() -> Path:
    """A scanned repo (the fake detectors of apply_support) plus an applied twin, made once."""
    if "dir" not in _TEMPLATE:
        base = Path(tempfile.mkdtemp(prefix="npufuse-hostile-"))
        root = make_repo(base / "repo", {"model.py": MODEL, "head.py": HEAD})
        scan(root)
        # relative, as `npufuse scan .` writes it: the copies below are repositories of their own
        doc = json.loads((root / ".npufuse" / "scan.json").read_text())
        doc["root"] = "."
        (root / ".npufuse" / "scan.json").write_text(json.dumps(doc, indent=2))
        applied = base / "applied"
        shutil.copytree(root, applied)
        with _quiet():
            assert main(["apply", "--accept", "all", "--state-dir", str(applied / ".npufuse")]) == 0
        _TEMPLATE["dir"] = base
    return _TEMPLATE["dir"]


@contextlib.contextmanager
def _quiet():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield out, err


def _snapshot(folder: Path) -> dict[str, Any]:
    """Every entry under ``folder`` (links not followed): kind and, for files, bytes."""
    seen: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            kind = "link" if os.path.islink(p) else "dir" if p.is_dir() else "file" if p.is_file() else "special"
            seen[str(p.relative_to(folder))] = (kind, p.read_bytes() if kind == "file" else os.readlink(p) if kind == "link" else None, st.st_mode)
    return seen


class Sandbox:
    """A fresh copy of the template repo (``applied``: the one with state.json) next to an
    ``outside`` folder that must stay exactly as it is."""

    def __init__(self, applied: bool) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="npufuse-fuzz-"))
        shutil.copytree(_template() / ("applied" if applied else "repo"), self.base / "repo", symlinks=True)
        self.root = self.base / "repo"
        self.sd = self.root / ".npufuse"
        self.outside = self.base / "outside"
        self.outside.mkdir()
        (self.outside / "sitecustomize.py").write_text("# must stay\n")
        (self.outside / "dir").mkdir()
        self.before = _snapshot(self.outside)
        # the per-user secret of this sandbox (never the real user's); no waiting on a lock
        self.env = {"XDG_CACHE_HOME": str(self.base / "user-cache"), "NPUFUSE_LOCK_WAIT": "0"}
        self.saved_env = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def run(self, *argv: str) -> tuple[int, str]:
        with _quiet() as (out, err), cpu_guard(HANG_CPU_S):
            rc = main(list(argv))
        text = err.getvalue()
        assert rc in (0, 1, 2), (argv, rc, text)
        assert "Traceback" not in text, text
        if rc == 2 and "waiting for" not in text:
            lines = [line for line in text.splitlines() if line.strip()]
            assert len(lines) <= 1, text
        return rc, text

    def check_outside(self) -> None:
        assert _snapshot(self.outside) == self.before, "something outside the repository changed"

    def close(self) -> None:
        for k, v in self.saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for dirpath, dirnames, filenames in os.walk(self.base):
            for name in dirnames:
                with contextlib.suppress(OSError):
                    os.chmod(Path(dirpath) / name, 0o755)
        shutil.rmtree(self.base, ignore_errors=True)


# -- strategies ----------------------------------------------------------------------------------

_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["", ".", "..", "../outside/sitecustomize.py", "/etc/hostname", "backup/../../x", "backup/model.py", "model.py",
                     "head.py", "pending", "concluded", "a\u202eb", "x\x1b[2J", "\udce9.py", "0" * 300]),
    st.text(max_size=30),
)
JSON_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)), max_leaves=20)


@st.composite
def mutated_json(draw, which: str) -> tuple[str, str, Any]:
    """How to tamper with the template's scan.json / state.json: a few values replaced (the
    paths picked by index when the document is read, in the check), the whole document replaced
    by random JSON, or deep nesting."""
    mode = draw(st.sampled_from(["mutate", "mutate", "mutate", "replace", "deep"]))
    if mode == "replace":
        return which, mode, draw(JSON_VALUES)
    if mode == "deep":
        return which, mode, draw(st.integers(min_value=500, max_value=100_000))
    return which, mode, draw(st.lists(st.tuples(st.integers(min_value=0, max_value=10**6), JSON_VALUES), min_size=1, max_size=4))


def _tampered(value: tuple[str, str, Any]) -> str:
    which, mode, detail = value
    if mode == "replace":
        return json.dumps(detail)
    if mode == "deep":
        return "[" * detail + "]" * detail
    doc = json.loads((_template() / ("applied" if which == "state" else "repo") / ".npufuse" / f"{which}.json").read_text())
    for index, replacement in detail:
        paths = list(_paths(doc))
        _set(doc, paths[index % len(paths)], replacement)
    return json.dumps(doc)


def _paths(node: Any, prefix: tuple = ()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _set(doc: Any, path: tuple, value: Any) -> None:
    if not path:
        return
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _write_json(path: Path, value: tuple[str, str, Any]) -> None:
    path.write_text(_tampered(value), encoding="utf-8")


# -- properties ----------------------------------------------------------------------------------


def check_state_json(value: tuple[str, Any]) -> None:
    box = Sandbox(applied=True)
    try:
        _write_json(box.sd / "state.json", value)
        box.run("revert", "--state-dir", str(box.sd))
        box.run("status", "--state-dir", str(box.sd))
        box.run("apply", "--accept", "all", "--state-dir", str(box.sd))
        box.check_outside()
    finally:
        box.close()


def check_scan_json(value: tuple[str, Any]) -> None:
    box = Sandbox(applied=False)
    try:
        _write_json(box.sd / "scan.json", value)
        box.run("apply", "--accept", "all", "--state-dir", str(box.sd))
        box.run("revert", "--state-dir", str(box.sd))
        box.check_outside()
    finally:
        box.close()


STATE_ENTRIES = [".npufuse", ".npufuse/backup", ".npufuse/cache", ".npufuse/scan.json", ".npufuse/state.json", ".npufuse/lock",
                 ".npufuse/backup/model.py", ".npufuse/CONCLUSIONS.md", "model.py"]
HOSTILE_KINDS = ["link-outside-dir", "link-outside-file", "link-dangling", "fifo", "link-dev-zero", "read-only"]


@st.composite
def state_trees(draw) -> list[tuple[str, str]]:
    chosen = draw(st.lists(st.sampled_from(STATE_ENTRIES), min_size=1, max_size=3, unique=True))
    return [(entry, draw(st.sampled_from(HOSTILE_KINDS))) for entry in chosen]


def _plant(box: Sandbox, entry: str, kind: str) -> None:
    path = box.root / entry
    if kind == "read-only":
        if path.exists() and not path.is_symlink():
            os.chmod(path, 0o555 if path.is_dir() else 0o444)
        return
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        target = {"link-outside-dir": box.outside / "dir", "link-outside-file": box.outside / "sitecustomize.py",
                  "link-dangling": box.outside / "created-through-a-link.py", "link-dev-zero": Path("/dev/zero")}[kind]
        path.symlink_to(target)


def check_state_tree(layout: list[tuple[str, str]]) -> None:
    box = Sandbox(applied=draw_applied(layout))
    try:
        for entry, kind in layout:
            folders = [box.root.joinpath(*Path(entry).parts[:i]) for i in range(1, len(Path(entry).parts))]
            if any(f.is_symlink() or (os.path.lexists(f) and not f.is_dir()) for f in folders):
                continue  # a folder on its way is already a link or FIFO (planted earlier)
            _plant(box, entry, kind)
        sd = str(box.sd)
        box.run("scan", str(box.root), "--state-dir", sd, "-o", str(box.base / "report.md"), "-j", "1", "--no-progress")
        box.run("apply", "--accept", "all", "--state-dir", sd)
        box.run("revert", "--state-dir", sd)
        box.run("status", "--state-dir", sd)
        box.check_outside()
    finally:
        box.close()


def draw_applied(layout: list[tuple[str, str]]) -> bool:
    return len(layout) % 2 == 1  # half the layouts start from a repo with state.json and backups


ID_TOKENS = st.one_of(st.integers(min_value=-5, max_value=2**40).map(str), st.sampled_from(["all", "1-1000000000", "-1-3", "3-1", "1--2", "0x1", "", " ", "1e9", "١"]),
                      st.tuples(st.integers(min_value=-3, max_value=2**62), st.integers(min_value=-3, max_value=2**62)).map(lambda ab: f"{ab[0]}-{ab[1]}"))


def check_ids(tokens: list[str]) -> None:
    box = Sandbox(applied=True)
    try:
        text = ",".join(tokens)
        box.run("revert", "--dry-run", "--state-dir", str(box.sd), *([text] if text.strip() else []))
        box.run("apply", "--dry-run", "--accept", text or "x", "--state-dir", str(box.sd))
        box.check_outside()
    finally:
        box.close()


def check_options(text: str) -> None:
    """The numeric option parser: a finite number within bounds, or a usage error — never nan,
    inf or a huge value reaching the verb (``--tolerance nan`` passed every loss check)."""
    import argparse
    import math

    for parse in (number(float, above=0, maximum=1e6), number(int, minimum=1, maximum=10**6), number(float, minimum=0, maximum=1)):
        try:
            value = parse(text)
        except argparse.ArgumentTypeError as exc:
            assert str(exc) and "\n" not in str(exc)
            continue
        assert math.isfinite(value) and not isinstance(value, bool)


NUMBER_TEXT = st.one_of(st.floats().map(repr), st.integers().map(str), st.sampled_from(["nan", "-nan", "inf", "-inf", "Infinity", "1e309", "1e-400", "10**12", "0x10", " 5 ", "5_000"]), st.text(max_size=12))

UNSAFE_CHARS = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c\x1b\x07\x00\x7f\x9b\udce9"


def check_display(text: str) -> None:
    shown = escape_text(text)
    assert not has_unsafe(shown)
    shown.encode("utf-8")  # lone surrogates (non-UTF-8 names) escaped too
    if not has_unsafe(text) and all(not 0xD800 <= ord(c) <= 0xDFFF for c in text):
        assert shown == text  # ordinary text is shown as it is


PROPERTIES = {
    "state_json": Property(mutated_json("state"), check_state_json),
    "scan_json": Property(mutated_json("scan"), check_scan_json),
    "state_tree": Property(state_trees(), check_state_tree),
    "ids": Property(st.lists(ID_TOKENS, min_size=0, max_size=4), check_ids),
    "options": Property(NUMBER_TEXT, check_options),
    "display": Property(st.text(alphabet=st.one_of(st.sampled_from(UNSAFE_CHARS), st.sampled_from(string.printable), st.characters()), max_size=60), check_display),
}


@fuzz_settings(max_examples=6)
@given(PROPERTIES["state_json"].strategy)
def test_tampered_state_json_never_crashes_or_writes_outside(value):
    run_property(PROPERTIES, BUDGETS, "state_json", value, KNOWN)


@fuzz_settings(max_examples=6)
@given(PROPERTIES["scan_json"].strategy)
def test_tampered_scan_json_never_crashes_or_writes_outside(value):
    run_property(PROPERTIES, BUDGETS, "scan_json", value, KNOWN)


@fuzz_settings(max_examples=6)
@given(PROPERTIES["state_tree"].strategy)
def test_hostile_state_folder_layouts_never_crash_hang_or_write_outside(value):
    run_property(PROPERTIES, BUDGETS, "state_tree", value, KNOWN)


@fuzz_settings(max_examples=6)
@given(PROPERTIES["ids"].strategy)
def test_id_lists_and_ranges_are_answered_without_expanding_them(value):
    run_property(PROPERTIES, BUDGETS, "ids", value, KNOWN)


@fuzz_settings(max_examples=100)
@given(PROPERTIES["options"].strategy)
def test_numeric_options_are_finite_and_bounded_or_refused(value):
    run_property(PROPERTIES, BUDGETS, "options", value, KNOWN)


@fuzz_settings(max_examples=100)
@given(PROPERTIES["display"].strategy)
def test_repository_text_is_shown_without_controls(value):
    run_property(PROPERTIES, BUDGETS, "display", value, KNOWN)
