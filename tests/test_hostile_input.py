"""A tampered scan.json/state.json cannot make apply, revert or verify touch files outside the
scanned root, and ``verify e2e`` runs ``--cmd`` as argv (no shell) unless ``--shell`` is given."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from apply_support import HEAD, MODEL, make_repo, npufuse, scan
from test_verify_helpers import PY, fake_repo

from npufuse.cli import main
from npufuse.verify import runner

ESCAPES = ["../outside.py", "sub/../../outside.py", "/etc/hostname", "{abs_outside}"]


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")


@pytest.fixture
def repo(tmp_path: Path):
    root = make_repo(tmp_path / "repo", {"model.py": MODEL, "head.py": HEAD})
    outside = tmp_path / "outside.py"
    outside.write_text(MODEL)  # a Python file the tampered paths point at: must stay untouched
    data = scan(root)
    return root, root / ".npufuse", data, outside


def _escape(template: str, outside: Path) -> str:
    return template.format(abs_outside=str(outside))


def _one_line_refusal(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("bad", ESCAPES)
def test_apply_refuses_a_scan_path_outside_the_root(repo, capsys, bad):
    root, sd, data, outside = repo
    before = outside.read_bytes()
    tampered = json.loads((sd / "scan.json").read_text())
    tampered["candidates"][0]["file"] = _escape(bad, outside)
    (sd / "scan.json").write_text(json.dumps(tampered))
    capsys.readouterr()
    assert npufuse("apply", "--state-dir", str(sd), "--accept", str(tampered["candidates"][0]["id"])) == 2
    err = _one_line_refusal(capsys)
    assert "not a path inside the scanned root" in err or "resolves outside the scanned root" in err
    assert outside.read_bytes() == before
    assert not (sd / "state.json").exists()


def test_apply_refuses_a_symlink_leading_out(repo, capsys):
    root, sd, data, outside = repo
    (root / "link.py").symlink_to(outside)
    tampered = json.loads((sd / "scan.json").read_text())
    tampered["candidates"][0]["file"] = "link.py"
    (sd / "scan.json").write_text(json.dumps(tampered))
    capsys.readouterr()
    assert npufuse("apply", "--state-dir", str(sd), "--accept", str(tampered["candidates"][0]["id"])) == 2
    assert "resolves outside the scanned root" in _one_line_refusal(capsys)


@pytest.mark.parametrize("bad", ESCAPES)
def test_revert_refuses_a_state_path_outside_the_root(repo, capsys, bad):
    root, sd, data, outside = repo
    assert npufuse("apply", "--state-dir", str(sd), "--accept", "all") == 0
    state = json.loads((sd / "state.json").read_text())
    for c in state["candidates"].values() if isinstance(state["candidates"], dict) else state["candidates"]:
        c["file"] = _escape(bad, outside)
        if c.get("applied"):
            c["applied"]["file"] = c["file"]
    (sd / "state.json").write_text(json.dumps(state))
    before = outside.read_bytes()
    capsys.readouterr()
    assert npufuse("revert", "--state-dir", str(sd)) == 2
    err = _one_line_refusal(capsys)
    assert "not a path inside the scanned root" in err or "resolves outside the scanned root" in err
    assert outside.read_bytes() == before


@pytest.mark.parametrize("where", ["scan_root", "state_file"])
@pytest.mark.parametrize("bad", ESCAPES)
def test_verify_op_refuses_a_path_outside_the_root(tmp_path, capsys, bad, where):
    repo_dir = tmp_path / "r"
    repo_dir.mkdir()
    sd = fake_repo(repo_dir)
    outside = tmp_path / "outside.py"
    outside.write_text((repo_dir / "fakemodel.py").read_text())  # a plausible target, marked site and all
    state = json.loads((sd / "state.json").read_text())
    cands = state["candidates"].values() if isinstance(state["candidates"], dict) else state["candidates"]
    for c in cands:
        c["file"] = _escape(bad, outside)
    (sd / "state.json").write_text(json.dumps(state))
    if where == "scan_root":  # scan.json's candidate file tampered the same way
        scan_data = json.loads((sd / "scan.json").read_text())
        for c in scan_data["candidates"]:
            c["file"] = _escape(bad, outside)
        (sd / "scan.json").write_text(json.dumps(scan_data))
    capsys.readouterr()
    assert main(["verify", "op", "1", "--state-dir", str(sd)]) == 2
    err = _one_line_refusal(capsys)
    assert "not a path inside the scanned root" in err or "resolves outside the scanned root" in err


def test_verify_e2e_without_shell_passes_metacharacters_as_arguments(tmp_path, capsys):
    sd = fake_repo(tmp_path)
    pwned = tmp_path / "pwned"
    cmd = f"{PY} train.py --steps 60 ; touch {pwned}1 $(touch {pwned}2) `touch {pwned}3` && touch {pwned}4"
    rc = main(["verify", "e2e", "1", "--state-dir", str(sd), "--cmd", cmd, "--quiet"])
    assert rc == 2  # train.py's argparse rejects the extra (literal) arguments: the baseline fails
    assert not any(tmp_path.glob("pwned*")), "a shell interpreted the command"


def test_argv_mode_hands_the_literal_strings_to_the_program(tmp_path):
    out = tmp_path / "argv.json"
    script = tmp_path / "echo_argv.py"
    script.write_text(f"import json, sys\nopen({str(out)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    argv = runner.split_command(f"{sys.executable} {script} ';' 'rm -rf x' '$(id)' '`id`' '|' '&&' '$HOME'", shell=False)
    assert isinstance(argv, list)
    res = runner.run_child(argv, env=dict(os.environ), cwd=tmp_path, timeout_s=60)
    assert res.returncode == 0
    assert json.loads(out.read_text()) == [";", "rm -rf x", "$(id)", "`id`", "|", "&&", "$HOME"]
    # --shell is the explicit opt-in: only then is it a string for /bin/sh
    assert isinstance(runner.split_command("echo $HOME; true", shell=True), str)
