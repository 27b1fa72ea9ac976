"""The whole-scan shortcut: an unchanged re-scan reuses scan.json and report.md as they are
(nothing parsed, nothing rendered, nothing written), any changed input scans again, and in every
case the outputs are byte-identical to a ``--no-cache`` scan's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from npufuse.cli import main
from npufuse.scan import cache as scan_cache
from npufuse.scan import command, engine
from scan_fakes import copy_fixture


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return copy_fixture(tmp_path / "src")


@pytest.fixture
def out(tmp_path: Path) -> Path:
    folder = tmp_path / "o"  # one output folder for every run: the report names the state path
    folder.mkdir()
    return folder


def _scan(root: Path, out: Path, *extra: str) -> tuple[bytes, bytes]:
    rc = main(["scan", str(root), "-o", str(out / "report.md"), "--state-dir", str(out / "state"), "--no-progress", "-j", "1", *extra])
    assert rc == 0
    return (out / "state" / "scan.json").read_bytes(), (out / "report.md").read_bytes()


def _records(out: Path) -> list[Path]:
    return sorted((out / "state" / "cache").rglob("run-*.json"))


def _reference(root: Path, out: Path, *extra: str) -> tuple[bytes, bytes]:
    """The outputs of a --no-cache scan to the same paths (run last: it overwrites them)."""
    ref = _scan(root, out, "--no-cache", *extra)
    assert command.last_run.shortcut == "off" and command.last_run.files_from_cache == 0
    return ref


def test_unchanged_repo_reuses_the_outputs(repo, out):
    cold = _scan(repo, out)
    assert command.last_run.shortcut == "miss" and command.last_run.files_analyzed > 0
    assert len(_records(out)) == 1
    stamps = [os.stat(out / "state" / "scan.json").st_mtime_ns, os.stat(out / "report.md").st_mtime_ns]

    warm = _scan(repo, out)
    info = command.last_run
    assert info.shortcut == "hit"
    assert info.files_analyzed == 0 and info.files_from_cache == 0 and info.written == []
    assert info.files == len(engine.walk(repo).files) > 0
    assert [os.stat(out / "state" / "scan.json").st_mtime_ns, os.stat(out / "report.md").st_mtime_ns] == stamps  # not rewritten
    assert warm == cold == _reference(repo, out)


def test_shortcut_hit_renders_and_parses_nothing(repo, out, monkeypatch):
    _scan(repo, out)

    def boom(*a, **k):
        raise AssertionError("the shortcut must not scan")

    monkeypatch.setattr(engine, "run_scan", boom)
    monkeypatch.setattr(engine, "parse_source", boom)
    _scan(repo, out)
    assert command.last_run.shortcut == "hit"


def _edit_py(repo: Path) -> None:
    p = repo / "model" / "modeling_tiny.py"
    p.write_text(p.read_text() + "\n# edited\n")


def _edit_config(repo: Path) -> None:
    p = repo / "config.json"
    data = json.loads(p.read_text())
    data["hidden_size"] = int(data.get("hidden_size", 64)) * 2
    p.write_text(json.dumps(data))


def _add_py(repo: Path) -> None:
    (repo / "extra.py").write_text("import torch\n\ndef f(x, w):\n    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w\n")


def _remove_py(repo: Path) -> None:
    (repo / "train.py").unlink()


def _gitignore(repo: Path) -> None:
    with open(repo / ".gitignore", "a") as fh:
        fh.write("\nops/\n")


def _same_size_same_mtime(repo: Path) -> None:
    # other bytes of the same size, mtime put back: a content hash notices what size/mtime would not
    p = repo / "model" / "modeling_tiny.py"
    st = os.stat(p)
    data = p.read_bytes()
    assert b"eps=1e-6" in data
    p.write_bytes(data.replace(b"eps=1e-6", b"eps=1e-5", 1))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("change", [_edit_py, _edit_config, _add_py, _remove_py, _gitignore, _same_size_same_mtime], ids=lambda f: f.__name__.strip("_"))
def test_any_changed_input_scans_again(repo, out, change):
    _scan(repo, out)
    change(repo)
    after = _scan(repo, out)
    assert command.last_run.shortcut == "miss"
    assert after == _reference(repo, out)
    _scan(repo, out)  # and the new state is reusable in turn
    assert command.last_run.shortcut == "hit"


@pytest.mark.parametrize("option", [("--only", "rms_norm"), ("--switch", "env"), ("--batch-size", "8"), ("--seq-len", "512"), ("--max-file-mb", "0.001")])
def test_changed_option_scans_again(repo, out, option):
    _scan(repo, out)
    changed = _scan(repo, out, *option)
    assert command.last_run.shortcut == "miss"
    assert changed == _reference(repo, out, *option)
    _scan(repo, out, *option)
    assert command.last_run.shortcut == "hit"
    _scan(repo, out)  # back to the defaults: the outputs on disk are the option's, so it scans
    assert command.last_run.shortcut == "miss"


def test_jobs_do_not_change_the_key(repo, out):
    _scan(repo, out)
    main(["scan", str(repo), "-o", str(out / "report.md"), "--state-dir", str(out / "state"), "--no-progress", "-j", "2"])
    assert command.last_run.shortcut == "hit"


def test_version_change_scans_again(repo, out, monkeypatch):
    _scan(repo, out)
    monkeypatch.setattr(scan_cache, "__version__", "999.0.0")
    _scan(repo, out)
    assert command.last_run.shortcut == "miss"


def test_npufuse_source_change_scans_again(repo, out, monkeypatch, tmp_path):
    # a copy of the package stands in for npufuse's code: editing its report template must
    # change the key (the real sources are not ours to edit)
    copy = tmp_path / "npufuse"
    shutil.copytree(scan_cache.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(scan_cache, "PACKAGE", copy)
    _scan(repo, out)
    _scan(repo, out)
    assert command.last_run.shortcut == "hit"
    template = copy / "report" / "templates" / "report.md.j2"
    template.write_text(template.read_text() + "\n")
    scan_cache.code_digest.cache_clear()  # as in a new process
    _scan(repo, out)
    assert command.last_run.shortcut == "miss"


def test_library_change_changes_the_key(monkeypatch, tmp_path):
    lib = tmp_path / "fakelib.py"
    lib.write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(scan_cache, "_LIBRARIES", ("fakelib",))
    before = scan_cache.run_key("f", [1])
    assert scan_cache.run_key("f", [1]) == before
    st = os.stat(lib)
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # reinstalled / upgraded
    assert scan_cache.run_key("f", [1]) != before
    assert scan_cache.run_key("f", [2]) != scan_cache.run_key("f", [1])


@pytest.mark.parametrize("damage", ["delete", "edit", "truncate"])
def test_output_deleted_or_edited_is_written_again(repo, out, damage):
    cold = _scan(repo, out)
    for p in (out / "report.md", out / "state" / "scan.json"):
        if damage == "delete":
            p.unlink()
        elif damage == "edit":
            p.write_bytes(p.read_bytes().replace(b"npufuse", b"NPUFUSE", 1))
        else:
            p.write_bytes(p.read_bytes()[:100])
    again = _scan(repo, out)
    assert command.last_run.shortcut == "miss"
    assert sorted(command.last_run.written) == sorted([(out / "report.md").as_posix(), (out / "state" / "scan.json").as_posix()])
    assert again == cold == _reference(repo, out)


def test_one_output_edited_rewrites_only_that_one(repo, out):
    cold = _scan(repo, out)
    (out / "report.md").write_text("my notes\n")
    assert _scan(repo, out) == cold
    assert command.last_run.shortcut == "miss"
    assert command.last_run.written == [(out / "report.md").as_posix()]


def test_other_output_paths_have_their_own_record(repo, out, tmp_path):
    _scan(repo, out)
    other = tmp_path / "p"
    other.mkdir()
    main(["scan", str(repo), "-o", str(other / "r.md"), "--state-dir", str(out / "state"), "--no-progress", "-j", "1"])
    assert command.last_run.shortcut == "miss"  # a report nobody vouched for yet
    assert (other / "r.md").read_bytes() == (out / "report.md").read_bytes()
    assert len(_records(out)) == 2
    _scan(repo, out)
    assert command.last_run.shortcut == "hit"  # the first pair's record is still there


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "wrong_types", "no_counts"])
def test_corrupt_run_record_is_ignored(repo, out, damage):
    cold = _scan(repo, out)
    (record,) = _records(out)
    data = record.read_bytes()
    if damage == "truncate":
        record.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        record.write_bytes(os.urandom(256))
    elif damage == "empty":
        record.write_bytes(b"")
    elif damage == "wrong_types":
        record.write_text(json.dumps({**json.loads(data), "outputs": {"a": 1}}))
    else:
        record.write_text(json.dumps({**json.loads(data), "info": {"files_scanned": "many"}}))
    again = _scan(repo, out)
    assert command.last_run.shortcut == "miss"
    assert command.last_run.files_analyzed == 0  # the per-file entries are still good
    assert again == cold == _reference(repo, out)
    json.loads(record.read_bytes())  # rewritten whole
    _scan(repo, out)
    assert command.last_run.shortcut == "hit"


def test_corrupt_file_entries_with_good_record_still_hit_but_never_lie(repo, out):
    # the record vouches for the outputs, not for the per-file entries: damaged entries do not
    # matter to an unchanged repo, and are simply redone once a file changes
    cold = _scan(repo, out)
    for e in (out / "state" / "cache").rglob("*.pkl"):
        e.write_bytes(b"garbage")
    assert _scan(repo, out) == cold and command.last_run.shortcut == "hit"
    _edit_py(repo)
    after = _scan(repo, out)
    assert command.last_run.shortcut == "miss" and command.last_run.files_analyzed > 1  # the garbage entries were redone too
    assert after == _reference(repo, out)


def test_no_cache_bypasses_record_and_entries(repo, out):
    _scan(repo, out, "--no-cache")
    assert not (out / "state" / "cache").exists()
    _scan(repo, out, "--no-cache")
    assert command.last_run.shortcut == "off" and command.last_run.files_analyzed > 0


def test_profile_never_takes_the_shortcut(repo, out, tmp_path):
    profile = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "ascend_profile" / "llama_like"
    if not profile.is_dir():
        pytest.skip("no shared profile fixture")
    _scan(repo, out, "--profile", str(profile))
    _scan(repo, out, "--profile", str(profile))
    assert command.last_run.shortcut == "off"
    assert _records(out) == []  # and the run it wrote is vouched for by no record
    _scan(repo, out)
    assert command.last_run.shortcut == "miss"


def test_unkeyable_file_disables_the_shortcut(repo, out, monkeypatch):
    real = scan_cache.file_digest

    def unreadable_train(path, max_bytes):
        return None if Path(path).name == "train.py" else real(path, max_bytes)

    monkeypatch.setattr(scan_cache, "file_digest", unreadable_train)
    _scan(repo, out)
    _scan(repo, out)
    assert command.last_run.shortcut == "off"
    assert command.last_run.files_from_cache > 0  # the per-file cache still serves the other files


def test_file_edited_during_the_scan_is_not_recorded(repo, out, monkeypatch):
    target = repo / "model" / "modeling_tiny.py"
    original = target.read_bytes()
    real = engine.run_scan

    def edit_then_scan(inputs, **kw):
        target.write_bytes(original + b"\n# edited while scanning\n")
        return real(inputs, **kw)

    # the files are hashed before the analysis, as they are where the cache holds anything
    monkeypatch.setattr(scan_cache.ScanCache, "is_empty", lambda self: False)
    monkeypatch.setattr(engine, "run_scan", edit_then_scan)
    _scan(repo, out)
    monkeypatch.setattr(engine, "run_scan", real)
    assert _records(out) == []
    target.write_bytes(original)  # back to what was hashed: the outputs on disk describe the edit
    again = _scan(repo, out)
    assert command.last_run.shortcut == "miss"
    assert again == _reference(repo, out)


def test_cold_scan_keys_what_it_read(repo, out, monkeypatch):
    """A cold cache hashes nothing up front: the record names the content the analysis read, so
    a file edited while the scan ran is recorded as edited, and putting the original back is a
    miss (a fresh scan), never a reuse of outputs that describe the edit."""
    target = repo / "model" / "modeling_tiny.py"
    original = target.read_bytes()
    real = engine.run_scan

    def edit_then_scan(inputs, **kw):
        assert inputs.cold and inputs.key is None
        target.write_bytes(original + b"\n# edited while scanning\n")
        return real(inputs, **kw)

    monkeypatch.setattr(engine, "run_scan", edit_then_scan)
    edited = _scan(repo, out)
    monkeypatch.setattr(engine, "run_scan", real)
    assert len(_records(out)) == 1
    assert _scan(repo, out) == edited and command.last_run.shortcut == "hit"  # still the edited file
    target.write_bytes(original)
    again = _scan(repo, out)
    assert command.last_run.shortcut == "miss"
    assert again == _reference(repo, out)


def test_engine_run_key_and_stats(repo, tmp_path):
    inputs = engine.gather_inputs(repo, cache_dir=tmp_path / "c")
    # an empty cache: nothing hashed up front, the key comes from what the analysis read
    assert inputs.cold and inputs.key is None and set(inputs.digests) == set(inputs.walked.data_files)
    first = engine.run_scan(inputs, jobs=1)
    assert first.run_key is not None and first.run_key == inputs.key
    assert first.stats["analyzed"] == first.stats["files"] > 0 and first.stats["from_cache"] == 0
    again = engine.gather_inputs(repo, cache_dir=tmp_path / "c")
    assert not again.cold and set(again.walked.files) <= set(again.digests)
    assert again.key == first.run_key  # hashing up front gives the key the cold scan made
    second = engine.run_scan(again, jobs=1)
    readable = sum(1 for d in again.digests.values() if not d.startswith("size:")) - len(again.walked.data_files)
    assert second.stats["from_cache"] == readable and second.stats["analyzed"] == second.stats["files"] - readable
    assert second.to_json() == first.to_json()
    assert engine.gather_inputs(repo).key is None  # no cache: nothing hashed, nothing keyed
    assert engine.gather_inputs(repo, cache_dir=tmp_path / "c", switch_mode="env").key != inputs.key


def test_format_json_hit_prints_the_same(repo, out, capsys):
    args = ["scan", str(repo), "--format", "json", "--state-dir", str(out / "state"), "--no-progress", "-j", "1"]
    assert main(args) == 0
    first = capsys.readouterr()
    assert main(args) == 0
    second = capsys.readouterr()
    assert command.last_run.shortcut == "hit"
    assert second.out == first.out == (out / "state" / "scan.json").read_text()
    assert second.err == first.err


def test_warm_hit_imports_no_renderer(repo, out):
    """A hit loads neither jinja2 nor rich nor libcst nor torch (checked in a fresh interpreter)."""
    code = (
        "import sys\n"
        "from npufuse.cli import main\n"
        f"rc = main(['scan', {str(repo)!r}, '-o', {str(out / 'report.md')!r}, '--state-dir', {str(out / 'state')!r}, '--no-progress', '-j', '1'])\n"
        "from npufuse.scan import command\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jinja2', 'rich', 'libcst', 'torch', 'yaml'))\n"
        "print(rc, command.last_run.shortcut, heavy)\n"
    )
    # both runs in fresh interpreters: npufuse's code digest is taken once per process, and this
    # one's may predate an edit to the sources
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert first.stdout.strip().splitlines()[-1].startswith("0 miss ['jinja2'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "0 hit []"


def test_single_file_target(repo, out):
    target = repo / "model" / "modeling_tiny.py"
    first = _scan(target, out)
    _scan(target, out)
    assert command.last_run.shortcut == "hit" and command.last_run.files == 1
    (repo / "model" / "sibling.py").write_text("x = 1\n")  # not an input of a one-file scan
    assert _scan(target, out) == first and command.last_run.shortcut == "hit"
    _edit_py(repo)
    assert _scan(target, out) == _reference(target, out)
