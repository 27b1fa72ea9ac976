"""``npufuse scan`` end to end through ``npufuse.cli.main``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from npufuse.cli import main
from npufuse.scan import engine
from scan_fakes import FAKES, copy_fixture, tree_hashes

PROFILE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "ascend_profile" / "llama_like"


@pytest.fixture
def repo(tmp_path, monkeypatch):
    root = copy_fixture(tmp_path)
    monkeypatch.setattr(engine, "registry_patterns", lambda: FAKES)
    monkeypatch.chdir(tmp_path)
    return root


def test_default_outputs_in_the_current_folder(repo, capsys):
    before = tree_hashes(repo)
    assert main(["scan", "scan_repo"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("npufuse scan: 6 files, 4 candidates") and out.rstrip().endswith("report.md, .npufuse/scan.json")
    assert err == ""  # no progress bar when stderr is not a terminal
    scan = json.loads(Path(".npufuse/scan.json").read_text())
    assert scan["root"] == "scan_repo" and len(scan["candidates"]) == 4
    assert Path("report.md").read_text().startswith("# npufuse scan report")
    assert tree_hashes(repo) == before


def test_output_and_state_dir_options(repo, tmp_path):
    assert main(["scan", "scan_repo", "-o", "out/r.md", "--state-dir", "st"]) == 0
    assert Path("out/r.md").is_file() and Path("st/scan.json").is_file()
    assert "`st/scan.json`" in Path("out/r.md").read_text()


def test_format_json_prints_scan_json(repo, capsys):
    assert main(["scan", "scan_repo", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out)
    assert printed == json.loads(Path(".npufuse/scan.json").read_text())
    assert not Path("report.md").exists()
    assert err.startswith("npufuse scan:")


def test_only_filters(repo, capsys):
    assert main(["scan", "scan_repo", "--only", "rms_norm, sdpa", "--format", "json"]) == 0
    scan = json.loads(capsys.readouterr().out)
    assert scan["patterns"] == ["rms_norm", "sdpa"]
    assert {c["pattern"] for c in scan["candidates"]} == {"rms_norm", "sdpa"}


def test_single_file(repo, capsys):
    assert main(["scan", "scan_repo/train.py", "--format", "json"]) == 0
    scan = json.loads(capsys.readouterr().out)
    assert scan["root"] == "scan_repo" and scan["files_scanned"] == 1
    assert [c["file"] for c in scan["candidates"]] == ["train.py"]


def test_shape_overrides_and_switch_mode(repo, capsys):
    assert main(["scan", "scan_repo", "--batch-size", "2", "--seq-len", "128", "--switch", "env", "--format", "json"]) == 0
    scan = json.loads(capsys.readouterr().out)
    c = scan["candidates"][0]
    assert c["shapes"]["batch_size"] == {"value": 2, "from": "command line"}
    assert all(x["switch"]["kind"] == "env" for x in scan["candidates"])


@pytest.mark.parametrize("argv,needle", [
    (["scan", "missing_dir"], "no such file or folder"),
    (["scan", "scan_repo", "-o", "model.py"], "refusing to write the report over a Python file"),
    (["scan", "scan_repo", "--profile", "no_profile_here"], "--profile"),
    (["scan", "scan_repo", "--max-file-mb", "0"], "--max-file-mb"),
])
def test_usage_errors_exit_2_with_one_line(repo, capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.skipif(not PROFILE.is_dir(), reason="shared profiler fixture not present")
def test_profile_join_adds_section_1_2(repo):
    pytest.importorskip("npufuse.profile.join")
    assert main(["scan", "scan_repo", "--profile", str(PROFILE)]) == 0
    report = Path("report.md").read_text()
    assert "### 1.2" in report
    scan = json.loads(Path(".npufuse/scan.json").read_text())
    assert "profile" in scan and all("profile" in c for c in scan["candidates"])
    assert "measured time in the joined profile" in report


def test_an_abbreviated_option_is_an_error_not_a_guess(tmp_path, capsys):
    """argparse's prefix matching took ``--out DIR`` as ``--output DIR`` and wrote the report to a
    file named DIR (a helper session's scan wrote into the checkout it ran from): abbreviations
    are refused, on the verb's options as on the global ones."""
    from npufuse.cli import main

    assert main(["scan", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "--out" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main(["--vers"]) == 2
    assert main(["scan", str(tmp_path), "--output", str(tmp_path / "r.md"), "--state-dir", str(tmp_path / "s")]) == 0
    assert (tmp_path / "r.md").exists()
