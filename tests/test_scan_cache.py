"""The on-disk scan cache: hits skip parsing, every input that matters invalidates, a corrupt
entry is a miss, and a warm scan writes byte-identical scan.json and report.md."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from npufuse.cli import main
from npufuse.scan import cache as scan_cache
from npufuse.scan import engine
from scan_fakes import copy_fixture


def _entries(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.rglob("*.pkl"))


def _scan(root: Path, out: Path, *extra: str) -> tuple[bytes, bytes]:
    rc = main(["scan", str(root), "-o", str(out / "report.md"), "--state-dir", str(out / "state"), "--no-progress", *extra])
    assert rc == 0
    return (out / "state" / "scan.json").read_bytes(), (out / "report.md").read_bytes()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return copy_fixture(tmp_path / "src")


def _count_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    parsed: list[str] = []
    real = engine.parse_source

    def spy(rel: str, text: str):
        parsed.append(rel)
        return real(rel, text)

    monkeypatch.setattr(engine, "parse_source", spy)
    return parsed


def test_warm_scan_is_byte_identical_and_parses_nothing(repo, tmp_path, monkeypatch):
    out = tmp_path / "o"  # one output folder: the report names the state path
    out.mkdir()
    reference = _scan(repo, out, "--no-cache", "-j", "1")
    assert not (out / "state" / "cache").exists()  # --no-cache writes nothing either

    parsed = _count_parses(monkeypatch)
    cold = _scan(repo, out, "-j", "1")
    assert parsed, "the cold scan parses"
    cache_dir = out / "state" / "cache"
    assert _entries(cache_dir)
    assert (cache_dir / ".gitignore").read_text().strip().endswith("*")

    parsed.clear()
    warm = _scan(repo, out, "-j", "1")
    assert parsed == []
    assert cold == reference
    assert warm == reference


def test_hits_and_misses_counted(repo, tmp_path):
    patterns, _ = engine.select_patterns(None)
    options = engine.ScanOptions()
    key = scan_cache.fingerprint(patterns, options)
    assert key is not None
    from npufuse.scan.walk import walk

    walked = walk(repo)
    first = scan_cache.ScanCache(tmp_path / "c", key)
    engine._analyze_all(walked.root, walked.files, patterns, options, 1, None, first)
    assert first.hits == 0 and first.misses == len(walked.files)
    second = scan_cache.ScanCache(tmp_path / "c", key)
    again = engine._analyze_all(walked.root, walked.files, patterns, options, 1, None, second)
    readable = [o for o in again if o.sha256 is not None]
    assert second.hits == len(readable) and second.hits > 0


def test_content_change_misses_only_that_file(repo, tmp_path, monkeypatch):
    out = tmp_path / "o"
    out.mkdir()
    import json

    first = json.loads(_scan(repo, out, "-j", "1")[0])
    rel = first["candidates"][0]["file"]  # a scanned file with findings
    target = repo / rel
    target.write_text(target.read_text() + "\n# edited\n")
    parsed = _count_parses(monkeypatch)
    scan_json, _ = _scan(repo, out, "-j", "1")
    assert parsed == [rel]
    parsed.clear()
    out2 = tmp_path / "o2"
    out2.mkdir()
    assert scan_json == _scan(repo, out2, "--no-cache", "-j", "1")[0]


def test_version_change_misses(repo, tmp_path, monkeypatch):
    out = tmp_path / "o"
    out.mkdir()
    _scan(repo, out, "-j", "1")
    monkeypatch.setattr(scan_cache, "__version__", "999.0.0")
    parsed = _count_parses(monkeypatch)
    _scan(repo, out, "-j", "1")
    assert parsed  # a new version: everything re-parsed
    assert (out / "state" / "cache" / "999.0.0").is_dir()


@pytest.mark.parametrize("edited", ["patterns/rms_norm.py", "patterns/_site.py", "scan/dataflow.py"])
def test_pattern_source_change_invalidates(monkeypatch, tmp_path, edited):
    import shutil

    patterns, _ = engine.select_patterns(None)
    options = engine.ScanOptions()
    copy = tmp_path / "npufuse"  # a copy of the sources: the real ones are not ours to edit
    for sub in scan_cache._PACKAGES:
        shutil.copytree(scan_cache.PACKAGE / sub, copy / sub)
    monkeypatch.setattr(scan_cache, "PACKAGE", copy)
    before = scan_cache.fingerprint(patterns, options)
    assert scan_cache.fingerprint(patterns, options) == before  # stable
    target = copy / edited
    if not target.exists():
        pytest.skip(f"{edited} is not in this build")
    target.write_text(target.read_text() + "\n# a detector edit\n")
    scan_cache.package_digest.cache_clear()  # a new process
    assert scan_cache.fingerprint(patterns, options) != before


def test_fingerprint_is_fixed_for_the_process(monkeypatch, tmp_path):
    import shutil

    patterns, _ = engine.select_patterns(None)
    copy = tmp_path / "npufuse"
    for sub in scan_cache._PACKAGES:
        shutil.copytree(scan_cache.PACKAGE / sub, copy / sub)
    monkeypatch.setattr(scan_cache, "PACKAGE", copy)
    before = scan_cache.fingerprint(patterns, engine.ScanOptions())
    (copy / "scan" / "engine.py").write_text("# edited after this process imported it\n")
    assert scan_cache.fingerprint(patterns, engine.ScanOptions()) == before


def test_pattern_set_and_options_change_the_key():
    patterns, _ = engine.select_patterns(None)
    full = scan_cache.fingerprint(patterns, engine.ScanOptions())
    assert scan_cache.fingerprint(patterns[:1], engine.ScanOptions()) != full
    assert scan_cache.fingerprint(patterns, engine.ScanOptions(max_file_bytes=1234)) != full


def test_only_flag_uses_its_own_entries(repo, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    full, _ = _scan(repo, out, "-j", "1")
    only, _ = _scan(repo, out, "-j", "1", "--only", "rms_norm")
    ref = tmp_path / "r"
    ref.mkdir()
    assert only == _scan(repo, ref, "-j", "1", "--only", "rms_norm", "--no-cache")[0]
    assert only != full


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign_class", "empty"])
def test_corrupt_entry_is_a_miss_and_rewritten(repo, tmp_path, monkeypatch, damage):
    import pickle

    out = tmp_path / "o"
    out.mkdir()
    reference, _ = _scan(repo, out, "-j", "1")
    entries = _entries(out / "state" / "cache")
    for e in entries:
        data = e.read_bytes()
        if damage == "truncate":
            e.write_bytes(data[: len(data) // 2])
        elif damage == "garbage":
            e.write_bytes(os.urandom(64))
        elif damage == "empty":
            e.write_bytes(b"")
        else:  # a well-formed pickle that would call os.system: refused, never run
            e.write_bytes(scan_cache._MAGIC + pickle.dumps(os.system, protocol=2))
    for record in (out / "state" / "cache").rglob("run-*.json"):
        record.unlink()  # else the unchanged repo reuses the outputs whole and reads no entry
    parsed = _count_parses(monkeypatch)
    again, _ = _scan(repo, out, "-j", "1")
    assert again == reference
    assert len(parsed) == len(entries)
    assert all(scan_cache._MAGIC and e.read_bytes().startswith(scan_cache._MAGIC) and len(e.read_bytes()) > 64 for e in entries)


def test_malicious_reduce_is_not_executed(tmp_path):
    import pickle

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    c = scan_cache.ScanCache(tmp_path / "c", "f")
    path = c._path(c.key("a.py", "0" * 64))
    path.parent.mkdir(parents=True)
    path.write_bytes(scan_cache._MAGIC + pickle.dumps(Boom()))
    assert c.get("a.py", "0" * 64) is None
    assert not (tmp_path / "pwned").exists()


def test_unwritable_cache_dir_does_not_break_the_scan(repo, tmp_path):
    blocker = tmp_path / "state"
    blocker.mkdir()
    (blocker / "cache").write_text("a file where the cache folder should be")
    out = tmp_path / "o"
    out.mkdir()
    rc = main(["scan", str(repo), "-o", str(out / "report.md"), "--state-dir", str(blocker), "--no-progress", "-j", "1"])
    assert rc == 0


def test_parallel_scan_fills_and_uses_the_cache(tmp_path, monkeypatch):
    # enough files for the pool; workers write the entries
    root = tmp_path / "many"
    src = next(Path(__file__).parent.joinpath("fixtures", "scan_repo").rglob("*.py"))
    for i in range(engine.PARALLEL_MIN_FILES + 2):
        (root / f"m{i:03d}").mkdir(parents=True)
        (root / f"m{i:03d}" / "model.py").write_bytes(src.read_bytes())
    out = tmp_path / "o"
    out.mkdir()
    cold, _ = _scan(root, out, "-j", "2")
    assert len(_entries(out / "state" / "cache")) == engine.PARALLEL_MIN_FILES + 2
    parsed = _count_parses(monkeypatch)
    warm, _ = _scan(root, out, "-j", "2")
    assert parsed == [] and warm == cold


def test_pattern_without_source_disables_the_cache(tmp_path):
    from npufuse.patterns.base import Pattern

    ns: dict = {}
    exec("from npufuse.patterns.base import Pattern\nclass P(Pattern):\n    id='x'\n    api='a'\n    title='t'\n    def detect(self, m, s):\n        return []\n", ns)
    ns["P"].__module__ = "not_a_module_anywhere"
    assert scan_cache.fingerprint([ns["P"]()], engine.ScanOptions()) is None
    assert engine._open_cache(tmp_path, [ns["P"]()], engine.ScanOptions()) is None
    assert isinstance(Pattern, type)


def _outcome(rel: str, sha: str) -> engine.FileOutcome:
    return engine.FileOutcome(rel, parsed=True, sha256=sha, lines=3)


def test_put_survives_a_stale_temporary_name_and_a_removed_folder(tmp_path):
    """put names its temporary file by pid and count: one left behind by a killed process with
    the same pid is not overwritten (mkstemp picks another name), and an entry folder removed
    after this process made it is made again. Either way the entry lands whole, and no
    temporary file is left behind by put itself."""
    c = scan_cache.ScanCache(tmp_path / "c", "f")
    c.put(_outcome("a.py", "1" * 64))
    assert c.get("a.py", "1" * 64).lines == 3
    key = c.key("b.py", "2" * 64)
    folder = c._path(key).parent
    folder.mkdir(parents=True, exist_ok=True)
    stale = folder / f".tmp-{os.getpid()}-{c._tmp_count + 1}.pkl"
    stale.write_bytes(b"left by a killed scan")
    c.put(_outcome("b.py", "2" * 64))
    assert c.get("b.py", "2" * 64).lines == 3
    assert stale.read_bytes() == b"left by a killed scan"
    import shutil

    shutil.rmtree(c._path(c.key("a.py", "1" * 64)).parent)  # the folder put made for a.py
    c.put(_outcome("a.py", "1" * 64))
    assert c.get("a.py", "1" * 64).lines == 3
    leftovers = [p for p in (tmp_path / "c").rglob(".tmp-*") if p != stale]
    assert leftovers == []
