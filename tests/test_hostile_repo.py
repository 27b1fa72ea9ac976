"""A cloned repository is untrusted input (issue 19): what it ships in ``.npufuse`` (symlinked
folders, tampered scan.json / state.json / cache), special files among its sources, and two
npufuse commands at once must never make npufuse write outside the repository, lose an edit,
hang, or print a traceback."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from apply_support import HEAD, MODEL, make_repo, npufuse, scan, state_of

from npufuse.cli import main
from npufuse.scan import command as scan_command

import npufuse as npufuse_package

SRC = str(Path(npufuse_package.__file__).resolve().parents[1])  # child processes import the same npufuse
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX file types and flock")


@pytest.fixture(autouse=True)
def private_user_cache(tmp_path, monkeypatch):
    # the per-user secret lives in the user's cache folder: one per test, never the real one
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    monkeypatch.setenv("COLUMNS", "300")


@pytest.fixture
def repo(tmp_path: Path):
    root = make_repo(tmp_path / "repo", {"model.py": MODEL, "head.py": HEAD})
    data = scan(root)
    return root, root / ".npufuse", data


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    return err


def _ids(data, file: str) -> list[int]:
    return [c["id"] for c in data["candidates"] if c["file"] == file]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=SRC, XDG_CACHE_HOME=str(tmp_path / "user-cache"), COLUMNS="300")
    env.update(extra)
    return env


# -- item 1: the state folder is the repository's, never a way out -------------------------------


def test_a_symlinked_backup_folder_is_refused_and_nothing_lands_in_its_target(repo, tmp_path, capsys):
    root, sd, data = repo
    site_packages = tmp_path / "site-packages"  # a folder on sys.path, as in the audit
    site_packages.mkdir()
    (sd / "backup").symlink_to(site_packages)
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 2
    err = _one_line(capsys)
    assert "backup" in err and "symlink" in err
    assert list(site_packages.iterdir()) == []
    assert (root / "model.py").read_text() == MODEL and (root / "head.py").read_text() == HEAD


def test_a_symlinked_backup_file_is_not_written_through(repo, tmp_path, capsys):
    root, sd, data = repo
    target = tmp_path / "sitecustomize.py"
    (sd / "backup").mkdir()
    (sd / "backup" / "head.py").symlink_to(target)  # dangling: a write through it creates target
    assert npufuse("apply", "--accept", ",".join(map(str, _ids(data, "head.py"))), "--state-dir", str(sd)) == 2
    assert "symlink" in _one_line(capsys)
    assert not target.exists() and (root / "head.py").read_text() == HEAD


@pytest.mark.parametrize("verb", ["apply", "revert", "scan", "status-like-verify"])
def test_a_symlinked_state_folder_is_refused_by_every_verb(tmp_path, capsys, verb):
    root = make_repo(tmp_path / "repo", {"model.py": MODEL})
    elsewhere = tmp_path / "elsewhere"
    scan(root, state_dir=elsewhere)
    (elsewhere / "state.json").write_text(json.dumps({"tool": "npufuse", "candidates": []}))
    before = sorted(p.name for p in elsewhere.iterdir())
    (root / ".npufuse").symlink_to(elsewhere)
    sd = str(root / ".npufuse")
    argv = {
        "apply": ["apply", "--accept", "all", "--state-dir", sd],
        "revert": ["revert", "--state-dir", sd],
        "scan": ["scan", str(root), "--state-dir", sd, "-o", str(tmp_path / "r.md"), "-j", "1", "--no-progress"],
        "status-like-verify": ["verify", "op", "1", "--state-dir", sd],
    }[verb]
    assert main(argv) == 2
    assert "symlink" in _one_line(capsys)
    assert sorted(p.name for p in elsewhere.iterdir()) == before  # no lock, no cache, no backup there
    assert (root / "model.py").read_text() == MODEL


@pytest.mark.parametrize("name", ["state.json", "scan.json"])
def test_state_files_that_are_links_or_devices_are_refused_without_reading(repo, tmp_path, capsys, name):
    root, sd, data = repo
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    if name == "state.json":
        (sd / name).symlink_to("/dev/zero")  # reading it would never end
    else:
        (sd / name).unlink()
        (sd / name).symlink_to(outside)
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 2
    assert "symlink" in _one_line(capsys)
    assert outside.read_text() == "{}" and (root / "model.py").read_text() == MODEL


def test_a_scan_json_root_outside_the_repo_is_refused_unless_confirmed(repo, tmp_path, capsys):
    root, sd, data = repo
    victim = make_repo(tmp_path / "victim", {"model.py": MODEL, "head.py": HEAD})
    tampered = json.loads((sd / "scan.json").read_text())
    tampered["root"] = str(victim)
    (sd / "scan.json").write_text(json.dumps(tampered))
    (root / "model.py").unlink()  # so the repo itself is not an option the root search could take
    (root / "head.py").unlink()
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 2
    err = _one_line(capsys)
    assert "outside" in err and "--root" in err
    assert (victim / "model.py").read_text() == MODEL
    # the user naming it is the confirmation
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd), "--root", str(victim)) == 0
    assert (victim / "model.py").read_text() != MODEL


def test_a_scan_this_user_ran_may_name_a_repo_elsewhere(tmp_path, monkeypatch, capsys):
    root = make_repo(tmp_path / "repo", {"model.py": MODEL})
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["scan", str(root), "-j", "1", "--no-progress"]) == 0
    assert json.loads((work / ".npufuse" / "scan.json").read_text())["root"] == str(root)
    assert main(["apply", "--accept", "all"]) == 0
    assert (root / "model.py").read_text() != MODEL
    assert main(["revert"]) == 0 and (root / "model.py").read_text() == MODEL


def test_a_state_json_backup_path_outside_the_state_folder_is_refused(repo, tmp_path, capsys):
    root, sd, data = repo
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 0
    secret = tmp_path / "secret.txt"
    secret.write_text("do not copy me into the repo\n")
    st = state_of(sd)
    for c in st["candidates"]:
        c["applied"]["backup"] = "../../secret.txt"
    (sd / "state.json").write_text(json.dumps(st))
    capsys.readouterr()
    assert npufuse("revert", "--state-dir", str(sd)) == 2
    assert "backup" in _one_line(capsys)
    assert "do not copy" not in (root / "model.py").read_text()


def _scan_cli(root: Path, out: Path) -> None:
    assert main(["scan", str(root), "-o", str(out / "report.md"), "--state-dir", str(out / "state"), "-j", "1", "--no-progress"]) == 0


def test_a_cache_made_under_another_users_secret_is_never_read(tmp_path, monkeypatch):
    root = make_repo(tmp_path / "repo", {"model.py": MODEL, "head.py": HEAD})
    out = tmp_path / "out"
    _scan_cli(root, out)
    _scan_cli(root, out)
    assert scan_command.last_run.shortcut == "hit"  # same user: the cache works
    (out / "report.md").unlink()  # no whole-run shortcut: per-file lookups
    _scan_cli(root, out)
    assert scan_command.last_run.files_from_cache == 2
    # the same folder on another machine / for another user (a repo shipping .npufuse/cache)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other-user"))
    (out / "report.md").unlink()
    _scan_cli(root, out)
    assert scan_command.last_run.shortcut == "miss"
    assert scan_command.last_run.files_from_cache == 0 and scan_command.last_run.files_analyzed == 2


def test_a_symlinked_cache_folder_is_not_written_through(tmp_path):
    root = make_repo(tmp_path / "repo", {"model.py": MODEL})
    out = tmp_path / "out"
    (out / "state").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "state" / "cache").symlink_to(elsewhere)
    _scan_cli(root, out)  # the cache costs speed only: the scan still works
    assert json.loads((out / "state" / "scan.json").read_text())["candidates"]
    assert list(elsewhere.rglob("*")) == []


# -- item 3: one state-changing verb at a time ---------------------------------------------------

HOLD_LOCK = """
import sys
from npufuse.state_folder import lock
with lock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.read()
"""


def test_a_second_state_changing_verb_waits_or_exits_2_while_another_holds_the_lock(repo, tmp_path, monkeypatch, capsys):
    root, sd, data = repo
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(sd)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_env(tmp_path), text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        monkeypatch.setenv("NPUFUSE_LOCK_WAIT", "0")
        for argv in (["apply", "--accept", "all"], ["revert"], ["scan", str(root), "-j", "1", "--no-progress", "-o", str(tmp_path / "r.md")]):
            if argv[0] == "revert":
                (sd / "state.json").write_text(json.dumps({"tool": "npufuse", "candidates": []}))
            assert main(argv + ["--state-dir", str(sd)]) == 2
            err = capsys.readouterr().err
            assert f"another npufuse command (pid {holder.pid}) is changing" in err and "Traceback" not in err
        assert (root / "model.py").read_text() == MODEL
    finally:
        holder.communicate("", timeout=60)
    (sd / "state.json").unlink()
    assert main(["apply", "--accept", "all", "--state-dir", str(sd)]) == 0


# a rendezvous right after reading state.json: two unlocked applies then both hold the old
# state and each writes back its own records only (the audit: 7 of 8 trials lost one). With the
# lock the second cannot read before the first is done; the first stops waiting after 5 s.
SLOW_LOAD = """
import os, sys, time
from pathlib import Path
import npufuse.state as state
real = state.State.load.__func__
meet = Path(os.environ["MEET_DIR"])
def slow_load(cls, *a, **k):
    loaded = real(cls, *a, **k)
    (meet / str(os.getpid())).touch()
    deadline = time.monotonic() + 5
    while len(list(meet.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return loaded
state.State.load = classmethod(slow_load)
from npufuse.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_two_concurrent_applies_keep_both_records(repo, tmp_path):
    root, sd, data = repo
    a, b = ",".join(map(str, _ids(data, "model.py"))), ",".join(map(str, _ids(data, "head.py")))
    meet = tmp_path / "meet"
    meet.mkdir()
    procs = [
        subprocess.Popen([sys.executable, "-c", SLOW_LOAD, "apply", "--accept", ids, "--state-dir", str(sd)], env=_env(tmp_path, MEET_DIR=str(meet)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for ids in (a, b)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    applied = {c["id"] for c in state_of(sd)["candidates"] if c["applied"]}
    assert applied == set(_ids(data, "model.py")) | set(_ids(data, "head.py"))
    assert npufuse("revert", "--state-dir", str(sd)) == 0
    assert (root / "model.py").read_text() == MODEL and (root / "head.py").read_text() == HEAD


# -- item 4: an edit saved while apply runs is never overwritten ---------------------------------


def test_an_edit_saved_during_apply_is_kept_and_the_write_refused(repo, monkeypatch, capsys):
    from npufuse.rewrite import ledger

    root, sd, data = repo
    real_begin = ledger.begin

    def begin_then_user_saves(state, rel, *a, **k):
        entry = real_begin(state, rel, *a, **k)
        if rel == "model.py":  # the editor saves between npufuse's read and its replace
            (root / "model.py").write_text(MODEL + "# my edit\n")
        return entry

    monkeypatch.setattr(ledger, "begin", begin_then_user_saves)
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd), "--force") == 2
    err = _one_line(capsys)
    assert "model.py" in err and "changed while npufuse was writing it" in err
    assert (root / "model.py").read_text() == MODEL + "# my edit\n"
    st = state_of(sd)
    assert st["pending"] == []
    assert not any(c["applied"] for c in st["candidates"] if c["file"] == "model.py")


# -- item 5: outputs that are devices, FIFOs or symlinks -----------------------------------------


def test_report_to_a_fifo_is_written_through_and_the_fifo_kept(tmp_path):
    root = make_repo(tmp_path / "repo", {"model.py": MODEL})
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    keep_open = os.open(fifo, os.O_WRONLY)  # no EOF for the reader before the scan writes
    os.set_blocking(rfd, True)
    got: list[bytes] = []

    def read_all() -> None:
        while chunk := os.read(rfd, 65536):
            got.append(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()
    try:
        assert main(["scan", str(root), "-o", str(fifo), "--state-dir", str(tmp_path / "sd"), "-j", "1", "--no-progress"]) == 0
    finally:
        os.close(keep_open)
        reader.join()
        os.close(rfd)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert b"".join(got).startswith(b"# npufuse scan report")


def test_report_to_a_fifo_nobody_reads_is_refused_not_waited_on(tmp_path, capsys):
    root = make_repo(tmp_path / "repo", {"model.py": MODEL})
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    assert main(["scan", str(root), "-o", str(fifo), "--state-dir", str(tmp_path / "sd"), "-j", "1", "--no-progress"]) == 2
    assert "nobody is reading" in _one_line(capsys)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_report_to_a_symlink_writes_its_target(tmp_path):
    root = make_repo(tmp_path / "repo", {"model.py": MODEL})
    target = tmp_path / "reports" / "scan.md"
    target.parent.mkdir()
    target.write_text("old\n")
    link = tmp_path / "report.md"
    link.symlink_to(target)
    assert main(["scan", str(root), "-o", str(link), "--state-dir", str(tmp_path / "sd"), "-j", "1", "--no-progress"]) == 0
    assert link.is_symlink() and target.read_text().startswith("# npufuse scan report")


def test_report_to_dev_stdout_goes_to_stdout(tmp_path):
    root = make_repo(tmp_path / "repo", {"model.py": MODEL})
    out = subprocess.run(
        [sys.executable, "-m", "npufuse", "scan", str(root), "-o", "/dev/stdout", "--state-dir", str(tmp_path / "sd"), "-j", "1", "--no-progress"],
        env=_env(tmp_path), capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "# npufuse scan report" in out.stdout


def test_write_output_never_replaces_a_device(tmp_path):
    from npufuse.safe_write import write_output

    before = os.stat("/dev/null")
    write_output(Path("/dev/null"), b"discarded\n")
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


# -- item 7: file metadata -----------------------------------------------------------------------


def test_a_symlinked_source_inside_the_repo_is_edited_through_the_link(tmp_path):
    root = make_repo(tmp_path / "repo", {"impl/model_impl.py": MODEL})
    (root / "model.py").symlink_to("impl/model_impl.py")
    data = scan(root)
    # the walk records the link's target; a scan.json naming the link itself (another tool's,
    # or an older scan) must edit the target too, not replace the link by a regular file
    for c in data["candidates"]:
        c["file"] = "model.py"
    (root / ".npufuse" / "scan.json").write_text(json.dumps(data))
    ids = ",".join(str(c["id"]) for c in data["candidates"])
    assert npufuse("apply", "--accept", ids, "--state-dir", str(root / ".npufuse")) == 0
    assert (root / "model.py").is_symlink()
    assert "# npufuse:" in (root / "impl" / "model_impl.py").read_text()
    assert npufuse("revert", "--state-dir", str(root / ".npufuse")) == 0
    assert (root / "model.py").is_symlink() and (root / "impl" / "model_impl.py").read_text() == MODEL


def test_read_only_files_are_refused_without_force_and_keep_their_mode(repo, capsys):
    root, sd, data = repo
    os.chmod(root / "model.py", 0o444)
    try:
        assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 2
        assert "read-only" in _one_line(capsys)
        assert (root / "model.py").read_text() == MODEL
        assert npufuse("apply", "--accept", "all", "--state-dir", str(sd), "--force") == 0
        assert "# npufuse:" in (root / "model.py").read_text()
        assert stat.S_IMODE(os.stat(root / "model.py").st_mode) == 0o444
        capsys.readouterr()
        assert npufuse("revert", "--state-dir", str(sd)) == 2
        assert "read-only" in _one_line(capsys)
        assert npufuse("revert", "--state-dir", str(sd), "--force") == 0
        assert (root / "model.py").read_text() == MODEL
    finally:
        os.chmod(root / "model.py", 0o644)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="changing a file's owner needs root")
def test_owner_and_mode_are_kept(repo):
    root, sd, data = repo
    os.chown(root / "model.py", 4321, 4321)
    os.chmod(root / "model.py", 0o640)
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 0
    st = os.stat(root / "model.py")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (4321, 4321, 0o640)


# -- item 8: bad input gives one line, never a traceback or a hang -------------------------------

BAD_STATES = [
    [],
    {"candidates": {"1": {}}},
    {"candidates": [1]},
    {"candidates": [{"id": "1", "key": "k", "pattern": "p", "file": "f"}]},
    {"candidates": [{"id": 1, "key": "k", "pattern": "p", "file": "f", "applied": "yes"}]},
    {"candidates": [{"id": 1, "key": "k", "pattern": "p", "file": "f", "applied": {"span": "1-2"}}]},
    {"candidates": [{"id": 1, "key": "k", "pattern": "p", "file": "f", "status": "done"}]},
    {"candidates": [{"id": 1, "key": "k", "pattern": "p", "file": "f", "extra": 1}]},
    {"pending": "x"},
    {"scan_sha256": 5},
]


@pytest.mark.parametrize("bad", BAD_STATES, ids=range(len(BAD_STATES)))
@pytest.mark.parametrize("verb", ["apply", "revert"])
def test_malformed_state_json_is_one_line(repo, capsys, bad, verb):
    root, sd, data = repo
    (sd / "state.json").write_text(json.dumps(bad))
    argv = ["apply", "--accept", "all"] if verb == "apply" else ["revert"]
    assert npufuse(*argv, "--state-dir", str(sd)) == 2
    assert "state.json" in _one_line(capsys)
    assert (root / "model.py").read_text() == MODEL


@pytest.mark.parametrize("name", ["state.json", "scan.json"])
def test_deeply_nested_json_is_one_line(repo, capsys, name):
    root, sd, data = repo
    (sd / name).write_text("[" * 200_000 + "]" * 200_000)
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 2
    assert name in _one_line(capsys)


def test_a_fifo_named_by_the_scan_is_refused_without_blocking(repo, capsys):
    root, sd, data = repo
    tampered = json.loads((sd / "scan.json").read_text())
    (root / "pipe.py").unlink(missing_ok=True)
    os.mkfifo(root / "pipe.py")
    for c in tampered["candidates"]:
        c["file"] = "pipe.py"
    (sd / "scan.json").write_text(json.dumps(tampered))
    # a code path that blocked on the FIFO would hang the suite: unblock it after a while with
    # an empty write (a later assertion then fails instead)
    unblock = threading.Timer(30, lambda: os.close(os.open(root / "pipe.py", os.O_WRONLY)))
    unblock.start()
    try:
        assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 2
        assert "not a regular file" in _one_line(capsys)
    finally:
        unblock.cancel()


def test_revert_of_a_huge_id_range_is_checked_against_known_ids(repo, capsys):
    root, sd, data = repo
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 0
    capsys.readouterr()
    assert npufuse("revert", "1-1000000000", "--state-dir", str(sd)) == 2
    assert "1-1000000000 is not in" in _one_line(capsys)
    assert npufuse("apply", "--accept", "1-1000000000", "--state-dir", str(sd)) == 2
    assert "unknown candidate id 1-1000000000" in _one_line(capsys)
    known = sorted(c["id"] for c in data["candidates"])
    assert npufuse("revert", f"{known[0]}-{known[-1]}", "--state-dir", str(sd)) == 0


@pytest.mark.parametrize("argv, needle", [
    (["scan", "no-such-repo-npufuse", "--max-file-mb", "nan"], "not a finite number"),
    (["scan", "no-such-repo-npufuse", "--max-file-mb", "inf"], "not a finite number"),
    (["scan", "no-such-repo-npufuse", "-j", "100000000000"], "out of range"),
    (["verify", "e2e", "1", "--cmd", "true", "--tolerance", "nan"], "not a finite number"),
    (["verify", "e2e", "1", "--cmd", "true", "--bootstrap", "1000000000000"], "out of range"),
    (["verify", "e2e", "1", "--cmd", "true", "--ema=-inf"], "not a finite number"),
    (["verify", "op", "1", "--factor", "nan"], "not a finite number"),
    (["profile", "no-such-profile-npufuse", "--peak-bw", "nan"], "not a finite number"),
])
def test_non_finite_and_huge_numeric_options_are_usage_errors(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_disk_full_while_saving_state_is_one_line(repo, monkeypatch, capsys):
    import npufuse.state as state_module

    root, sd, data = repo

    def full(*a, **k):
        raise OSError(28, "No space left on device", str(sd / "state.json"))

    monkeypatch.setattr(state_module, "write_state_file", full)
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 2
    assert "No space left on device" in _one_line(capsys)
    assert (root / "model.py").read_text() == MODEL and (root / "head.py").read_text() == HEAD


def test_revert_of_a_file_edited_into_a_syntax_error_is_a_skipped_result(repo, capsys):
    root, sd, data = repo
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 0
    broken = (root / "model.py").read_text() + "\ndef (:\n"
    (root / "model.py").write_text(broken)
    capsys.readouterr()
    assert npufuse("revert", "--state-dir", str(sd), "--force") == 1
    out = capsys.readouterr()
    assert "libcst cannot parse model.py" in out.out and "Traceback" not in out.err
    assert (root / "model.py").read_text() == broken and (root / "head.py").read_text() == HEAD


def test_non_utf8_names_and_bidi_characters_are_shown_escaped_with_a_warning(tmp_path, monkeypatch, capsys):
    root = make_repo(tmp_path / "repo", {"model.py": MODEL})
    (root / os.fsdecode(b"caf\xe9.py")).write_bytes(HEAD.encode())
    (root / "bidi\u202e\x1b[31m.py").write_text(MODEL.replace("# mean of squares", "# \u202e reversed"))
    monkeypatch.chdir(root)
    assert main(["scan", ".", "-j", "1", "--no-progress"]) == 0
    report = (root / "report.md").read_text(encoding="utf-8")
    assert "\u202e" not in report and "\x1b" not in report and "\\u202e" in report
    assert "Trojan Source" in report.splitlines()[0]
    capsys.readouterr()
    assert main(["apply", "--accept", "all"]) == 0
    out = capsys.readouterr().out
    assert "\u202e" not in out and "\x1b" not in out and "\\u202e" in out and "caf\\udce9.py" in out
    assert "Trojan Source" in out
    assert main(["revert"]) == 0
    assert (root / os.fsdecode(b"caf\xe9.py")).read_bytes() == HEAD.encode()


def test_the_state_folder_lock_file_is_not_a_way_out(repo, tmp_path, capsys):
    root, sd, data = repo
    target = tmp_path / "victim"
    target.write_text("keep\n")
    (sd / "lock").symlink_to(target)
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 2
    assert "symlink" in _one_line(capsys)
    assert target.read_text() == "keep\n"


def test_backups_are_byte_exact_copies(repo):
    root, sd, data = repo
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 0
    backup = sd / "backup" / "model.py"
    assert not backup.is_symlink() and hashlib.sha256(backup.read_bytes()).hexdigest() == hashlib.sha256(MODEL.encode()).hexdigest()


@pytest.mark.parametrize("evidence, verdict, reasons", [(None, 5, 7), ({"op": "passed", "e2e": [1]}, {"a": 1}, "one"), ([], None, None)])
def test_status_and_conclusions_take_odd_evidence_shapes(repo, capsys, evidence, verdict, reasons):
    # found by bench/fuzz_long.py (hostile.state_json): status crashed on "evidence": null
    root, sd, data = repo
    assert npufuse("apply", "--accept", "all", "--state-dir", str(sd)) == 0
    st = state_of(sd)
    for c in st["candidates"]:
        c["evidence"], c["verdict"], c["reasons"], c["status"] = evidence, verdict, reasons, "e2e_checking"
    (sd / "state.json").write_text(json.dumps(st))
    capsys.readouterr()
    assert main(["status", "--state-dir", str(sd)]) == 0
    assert main(["status", "--json", "--state-dir", str(sd)]) == 0
    assert npufuse("revert", "--state-dir", str(sd)) == 0  # saves state.json and CONCLUSIONS.md
    assert "Traceback" not in capsys.readouterr().err
