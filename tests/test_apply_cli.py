"""``npufuse apply`` / ``npufuse revert`` end to end on a small repo scanned by the real engine."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from apply_support import HEAD, MODEL, block_of, fallback_of, make_repo, npufuse, same_statements, scan, state_of
from npufuse.rewrite.codegen import PRELUDE_MARKER, source_lines
from npufuse.rewrite.revert import plan_revert, write_revert
from npufuse.rewrite.transform import marked_sites
from npufuse.state import State


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # rich wraps table cells at 80 columns otherwise


@pytest.fixture
def repo(tmp_path):
    root = make_repo(tmp_path / "repo", {"model.py": MODEL, "head.py": HEAD})
    data = scan(root)
    ids = {c["key"]: c["id"] for c in data["candidates"]}
    return root, root / ".npufuse", data, ids


def ids_of(data, file):
    return [c["id"] for c in data["candidates"] if c["file"] == file]


def apply(sd, *extra):
    return npufuse("apply", "--state-dir", str(sd), *extra)


def test_scan_finds_the_fixture_sites(repo):
    _, _, data, ids = repo
    assert set(ids) == {"swiglu@head.py:gated", "rms_norm@model.py:RMSNorm.forward", "swiglu@model.py:MLP.forward", "rms_norm@model.py:final_norm"}
    assert all(c["file_sha256"] and c["switch"]["kind"] == "env" for c in data["candidates"])


def test_dry_run_prints_the_diff_and_writes_nothing(repo, capsys):
    root, sd, data, ids = repo
    cid = ids["rms_norm@model.py:RMSNorm.forward"]
    before = {p: p.read_bytes() for p in root.rglob("*.py")}
    assert apply(sd, "--accept", "all", "--dry-run") == 0
    out = capsys.readouterr().out
    assert "--- a/model.py" in out and "+++ b/model.py" in out and "--- a/head.py" in out
    assert f"+        if _npufuse_on_npu(hidden_states) and _npufuse_site({cid}) and _npufuse_switch(\"NPUFUSE_RMS_NORM\"):  # npufuse: rms_norm" in out
    assert "would apply" in out
    assert {p: p.read_bytes() for p in root.rglob("*.py")} == before
    assert not (sd / "state.json").exists() and not (sd / "backup").exists()


def test_apply_rewrites_only_accepted_sites_and_records_them(repo, capsys):
    root, sd, data, ids = repo
    cid = ids["rms_norm@model.py:RMSNorm.forward"]
    assert apply(sd, "--accept", str(cid)) == 0
    out = capsys.readouterr().out
    assert "applied" in out and "NPUFUSE_RMS_NORM=0" in out
    text = (root / "model.py").read_text()
    assert [m.qualname for m in marked_sites(text)] == ["RMSNorm.forward"]
    assert (root / "head.py").read_text() == HEAD  # not accepted: untouched
    st = state_of(sd)
    entry = next(c for c in st["candidates"] if c["id"] == cid)
    rec = entry["applied"]
    assert rec["switch"]["name"] == "NPUFUSE_RMS_NORM" and "NPUFUSE_RMS_NORM=0" in rec["switch_description"]
    assert rec["off"] == f"NPUFUSE_OFF={cid} (this site) or NPUFUSE_RMS_NORM=0 (the pattern)"
    # the site's own switch comes right after the device check (issue 17 item 1)
    assert block_of(text, rec["span"]).lstrip().startswith(f"if _npufuse_on_npu(hidden_states) and _npufuse_site({cid}) and ")
    import hashlib

    assert rec["file_sha256_after"] == hashlib.sha256((root / "model.py").read_bytes()).hexdigest()
    assert (sd / "backup" / "model.py").read_text() == MODEL
    assert "applied behind environment variable NPUFUSE_RMS_NORM" in (sd / "CONCLUSIONS.md").read_text()
    assert st["pending"] == []


def test_report_replacement_equals_what_apply_writes(repo):
    root, sd, data, _ = repo
    assert apply(sd, "--accept", "all") == 0
    st = {c["id"]: c for c in state_of(sd)["candidates"]}
    for c in data["candidates"]:
        text = (root / c["file"]).read_text()
        block = block_of(text, st[c["id"]]["applied"]["span"])
        assert block == c["replacement"], c["key"]
        assert same_statements(fallback_of(block), c["code"]), c["key"]  # the fallback is the original


def test_revert_dry_run_writes_nothing(repo, capsys):
    root, sd, _, _ = repo
    assert apply(sd, "--accept", "all") == 0
    before = (root / "model.py").read_bytes()
    capsys.readouterr()
    assert npufuse("revert", "--dry-run", "--state-dir", str(sd)) == 0
    out = capsys.readouterr().out
    assert "--- a/model.py" in out and "-        if _npufuse_on_npu(hidden_states)" in out and "would revert" in out
    assert (root / "model.py").read_bytes() == before and all(c["applied"] for c in state_of(sd)["candidates"])


def test_apply_one_then_another_in_the_same_file_equals_applying_both(repo, tmp_path):
    root, sd, data, ids = repo
    a, b = ids["rms_norm@model.py:RMSNorm.forward"], ids["rms_norm@model.py:final_norm"]
    c = ids["swiglu@model.py:MLP.forward"]
    twin = tmp_path / "twin"
    shutil.copytree(root, twin)
    assert apply(sd, "--accept", str(b)) == 0
    assert apply(sd, "--accept", str(a)) == 0
    assert apply(sd, "--accept", str(c)) == 0
    assert apply(twin / ".npufuse", "--accept", f"{a},{b},{c}", "--root", str(twin)) == 0
    assert (root / "model.py").read_bytes() == (twin / "model.py").read_bytes()
    # every record points at its own block after the later inserts moved the earlier ones
    text = (root / "model.py").read_text()
    for entry in state_of(sd)["candidates"]:
        if entry["file"] == "model.py":
            assert f"# npufuse: {entry['pattern']}" in source_lines(text)[entry["applied"]["span"][0] - 1]
    assert (sd / "backup" / "model.py").read_text() == MODEL  # the backup is the scanned original


def test_applying_twice_is_a_no_op_reported_as_already_fused(repo, capsys):
    root, sd, _, _ = repo
    assert apply(sd, "--accept", "all") == 0
    snapshot = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in root.glob("*.py")}
    capsys.readouterr()
    assert apply(sd, "--accept", "all") == 0
    out = capsys.readouterr().out
    assert out.count("already fused") >= 4 and "0 site(s) rewritten" in out
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in root.glob("*.py")} == snapshot


def test_stale_scan_is_refused_and_nothing_is_written(repo, capsys):
    root, sd, _, _ = repo
    (root / "model.py").write_text(MODEL + "\n# edited after the scan\n")
    before = (root / "head.py").read_bytes()
    assert apply(sd, "--accept", "all") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.py changed since the scan" in err and "npufuse scan" in err
    assert (root / "head.py").read_bytes() == before  # refused as a whole, before any write


def test_unknown_id_no_scan_and_bad_input_exit_2_with_one_line(repo, tmp_path, capsys):
    root, sd, _, _ = repo
    cases = [
        (["--accept", "99"], "unknown candidate id 99"),
        (["--accept", "1,x"], "expected candidate ids"),
        (["--accept", "1", "--only", "nonsense"], "unknown pattern id 'nonsense'"),
        (["--accept", "1", "--switch", "self.flag and"], "neither an UPPER_CASE"),
    ]
    for argv, message in cases:
        assert apply(sd, *argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert npufuse("apply", "--accept", "1", "--state-dir", str(tmp_path / "nowhere")) == 2
    err = capsys.readouterr().err
    assert "no scan at" in err and "npufuse scan" in err
    (sd / "scan.json").write_text("{not json")
    assert apply(sd, "--accept", "1") == 2
    assert "not a readable scan" in capsys.readouterr().err


def test_only_filters_patterns(repo, capsys):
    root, sd, data, _ = repo
    assert apply(sd, "--accept", "all", "--only", "swiglu") == 0
    assert [m.pattern for m in marked_sites((root / "model.py").read_text())] == ["swiglu"]
    assert [m.pattern for m in marked_sites((root / "head.py").read_text())] == ["swiglu"]
    rms = [c["id"] for c in data["candidates"] if c["pattern"] == "rms_norm"]
    capsys.readouterr()
    assert apply(sd, "--accept", str(rms[0]), "--only", "swiglu") == 1
    assert "not selected by --only" in capsys.readouterr().out


@pytest.mark.parametrize(
    "switch,guard_part,off",
    [
        ("MY_FUSED", '_npufuse_switch("MY_FUSED")', "MY_FUSED=0"),
        ("getattr(self, 'use_npu', True)", "and (getattr(self, 'use_npu', True))", "make `getattr(self, 'use_npu', True)` false"),
    ],
)
def test_switch_override(repo, switch, guard_part, off):
    root, sd, _, ids = repo
    cid = ids["rms_norm@model.py:RMSNorm.forward"]
    assert apply(sd, "--accept", str(cid), "--switch", switch) == 0
    text = (root / "model.py").read_text()
    assert guard_part in text
    rec = next(c for c in state_of(sd)["candidates"] if c["id"] == cid)["applied"]
    assert rec["off"] == f"NPUFUSE_OFF={cid} (this site) or {off} (the pattern)" and rec["switch"]["kind"] in ("env", "user")


def test_revert_all_restores_every_byte(repo, capsys):
    root, sd, _, _ = repo
    assert apply(sd, "--accept", "all") == 0
    assert npufuse("revert", "--state-dir", str(sd)) == 0
    assert (root / "model.py").read_text() == MODEL and (root / "head.py").read_text() == HEAD
    assert all(c["applied"] is None for c in state_of(sd)["candidates"])
    assert "reverted" in capsys.readouterr().out
    # and it can be applied again afterwards
    assert apply(sd, "--accept", "all") == 0
    assert len(marked_sites((root / "model.py").read_text())) == 3


def test_revert_one_site_after_unrelated_edits_elsewhere(repo):
    root, sd, _, ids = repo
    assert apply(sd, "--accept", "all") == 0
    text = (root / "model.py").read_text()
    edited = text.replace("class MLP(nn.Module):\n", "class MLP(nn.Module):\n    \"\"\"Edited by the user after apply.\"\"\"\n\n")
    edited = "# a header line the user added\n" + edited + "\n\nEXTRA = 1\n"
    (root / "model.py").write_text(edited)
    cid = ids["rms_norm@model.py:RMSNorm.forward"]
    assert npufuse("revert", str(cid), "--state-dir", str(sd)) == 0
    after = (root / "model.py").read_text()
    assert [m.qualname for m in marked_sites(after)] == ["MLP.forward", "final_norm"]
    assert "Edited by the user after apply." in after and after.endswith("\n\nEXTRA = 1\n")
    assert MODEL.split("class MLP")[0].split("class RMSNorm")[1] in after  # RMSNorm's code is back verbatim
    # the rest reverts too, and then only the user's edits remain
    assert npufuse("revert", "--state-dir", str(sd)) == 0
    expected = MODEL.replace("class MLP(nn.Module):\n", "class MLP(nn.Module):\n    \"\"\"Edited by the user after apply.\"\"\"\n\n")
    assert (root / "model.py").read_text() == "# a header line the user added\n" + expected + "\n\nEXTRA = 1\n"


def test_revert_from_backup_and_in_place_give_the_same_bytes(repo, tmp_path):
    root, sd, _, _ = repo
    assert apply(sd, "--accept", "all") == 0
    state = State.load(sd)
    via_backup = plan_revert(state, root, sd, None, use_backup=True)
    in_place = plan_revert(state, root, sd, None, use_backup=False)
    assert {f.rel: f.method for f in via_backup.files} == {"model.py": "backup", "head.py": "backup"}
    assert {f.rel: f.method for f in in_place.files} == {"model.py": "in place", "head.py": "in place"}
    assert {f.rel: f.new_bytes for f in via_backup.files} == {f.rel: f.new_bytes for f in in_place.files}
    write_revert(in_place, state)
    assert (root / "model.py").read_text() == MODEL


def test_revert_unknown_or_unapplied_ids(repo, capsys):
    root, sd, _, ids = repo
    assert npufuse("revert", "--state-dir", str(sd)) == 2
    assert "nothing has been applied" in capsys.readouterr().err
    cid = ids["rms_norm@model.py:RMSNorm.forward"]
    assert apply(sd, "--accept", str(cid)) == 0
    assert npufuse("revert", "42", "--state-dir", str(sd)) == 2
    assert "42 is not in" in capsys.readouterr().err


def test_rescan_with_applied_sites_is_refused_until_reverted(repo, capsys):
    root, sd, _, ids = repo
    assert apply(sd, "--accept", str(ids["rms_norm@model.py:RMSNorm.forward"])) == 0
    scan(root)  # renumbers: the applied site is now a near miss
    capsys.readouterr()
    assert apply(sd, "--accept", "all") == 2
    assert "npufuse revert" in capsys.readouterr().err
    assert npufuse("revert", "--state-dir", str(sd)) == 0  # revert needs only state.json
    assert (root / "model.py").read_text() == MODEL
    scan(root)
    assert apply(sd, "--accept", "all") == 0


def test_paths_escaping_the_root_are_refused(repo, capsys):
    root, sd, data, _ = repo
    tampered = json.loads((sd / "scan.json").read_text())
    tampered["candidates"][0]["file"] = "../outside.py"
    (sd / "scan.json").write_text(json.dumps(tampered))
    assert apply(sd, "--accept", str(tampered["candidates"][0]["id"])) == 2
    assert "not a path inside the scanned root" in capsys.readouterr().err


def test_skipped_sites_carry_their_reason_and_exit_1(repo, capsys):
    root, sd, data, _ = repo
    tampered = json.loads((sd / "scan.json").read_text())
    c = next(c for c in tampered["candidates"] if c["key"] == "rms_norm@model.py:RMSNorm.forward")
    c["line"], c["end_line"] = c["line"] - 2, c["line"] - 1  # a statement and the comment below it
    (sd / "scan.json").write_text(json.dumps(tampered))
    assert apply(sd, "--accept", "all") == 1
    out = capsys.readouterr().out
    assert f"skipped: lines {c['line']}-{c['end_line']} are not whole statements of one block" in out
    assert len(marked_sites((root / "model.py").read_text())) == 2  # the others went in


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(cwd), "PATH": "/usr/bin:/bin:/usr/local/bin"})


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_files_with_uncommitted_changes_are_refused_unless_forced(repo, capsys):
    root, sd, data, ids = repo
    _git(root, "init", "-q")
    _git(root, "add", "model.py", "head.py")
    _git(root, "commit", "-q", "-m", "base")
    # our own earlier apply is not "uncommitted work": applying more in the same file works
    assert apply(sd, "--accept", str(ids["rms_norm@model.py:RMSNorm.forward"])) == 0
    assert apply(sd, "--accept", str(ids["swiglu@model.py:MLP.forward"])) == 0
    # a user's uncommitted edit is
    (root / "head.py").write_text(HEAD + "# wip\n")
    scan(root, state_dir=root / ".npufuse2")
    sd2 = root / ".npufuse2"
    capsys.readouterr()
    head_id = next(c["id"] for c in json.loads((sd2 / "scan.json").read_text())["candidates"] if c["file"] == "head.py")
    assert apply(sd2, "--accept", str(head_id)) == 2
    err = capsys.readouterr().err
    assert "head.py has uncommitted changes" in err and "--force" in err
    assert (root / "head.py").read_text() == HEAD + "# wip\n"
    assert apply(sd2, "--accept", str(head_id), "--force") == 0
    assert marked_sites((root / "head.py").read_text())
    # revert puts back exactly the bytes the forced apply found, the user's wip included
    assert npufuse("revert", "--state-dir", str(sd2)) == 0
    assert (root / "head.py").read_text() == HEAD + "# wip\n"
    # a file npufuse rewrote and the user then edited (uncommitted): revert needs --force
    (root / "model.py").write_text((root / "model.py").read_text() + "# more wip\n")
    capsys.readouterr()
    assert npufuse("revert", "--state-dir", str(sd)) == 2
    assert "model.py has uncommitted changes" in capsys.readouterr().err
    assert npufuse("revert", "--state-dir", str(sd), "--force") == 0
    assert (root / "model.py").read_text() == MODEL + "# more wip\n"


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_repository_config_command_is_not_run_by_the_uncommitted_check(repo, tmp_path, capsys):
    # A repository that arrives with its own .git folder is untrusted: git status would run the
    # core.fsmonitor command its .git/config names; the check runs git with that hook switched off
    # and still sees the user's uncommitted edit.
    root, _, _, _ = repo
    marker = tmp_path / "ran"
    _git(root, "init", "-q")
    _git(root, "add", "model.py", "head.py")
    _git(root, "commit", "-q", "-m", "base")
    _git(root, "config", "core.fsmonitor", f"touch {marker}; echo")
    (root / "head.py").write_text(HEAD + "# wip\n")
    scan(root, state_dir=root / ".npufuse2")
    sd2 = root / ".npufuse2"
    head_id = next(c["id"] for c in json.loads((sd2 / "scan.json").read_text())["candidates"] if c["file"] == "head.py")
    assert apply(sd2, "--accept", str(head_id)) == 2
    assert "head.py has uncommitted changes" in capsys.readouterr().err
    assert not marker.exists()


def test_no_git_repo_means_no_check(repo):
    root, sd, _, _ = repo
    (root / "model.py").write_bytes((root / "model.py").read_bytes())  # untouched content, no repo
    assert apply(sd, "--accept", "all") == 0


def test_non_utf8_and_crlf_files_keep_their_encoding(tmp_path):
    latin = "# -*- coding: latin-1 -*-\n# auteur: Ren\xe9\n" + HEAD
    crlf = MODEL.replace("\n", "\r\n")
    root = tmp_path / "repo"
    root.mkdir()
    (root / "head.py").write_bytes(latin.encode("latin-1"))
    (root / "model.py").write_bytes(crlf.encode("utf-8"))
    scan(root)
    assert apply(root / ".npufuse", "--accept", "all") == 0
    head = (root / "head.py").read_bytes()
    assert b"Ren\xe9" in head and PRELUDE_MARKER.encode() in head
    model = (root / "model.py").read_bytes()
    assert b"\n" not in model.replace(b"\r\n", b"")
    assert npufuse("revert", "--state-dir", str(root / ".npufuse")) == 0
    assert (root / "head.py").read_bytes() == latin.encode("latin-1")
    assert (root / "model.py").read_bytes() == crlf.encode("utf-8")


def test_revert_one_then_apply_it_again_gives_the_apply_all_file(repo):
    root, sd, _, ids = repo
    assert apply(sd, "--accept", "all") == 0
    full = (root / "model.py").read_bytes()
    cid = ids["swiglu@model.py:MLP.forward"]
    assert npufuse("revert", str(cid), "--state-dir", str(sd)) == 0
    assert [m.pattern for m in marked_sites((root / "model.py").read_text())] == ["rms_norm", "rms_norm"]
    assert apply(sd, "--accept", str(cid)) == 0
    assert (root / "model.py").read_bytes() == full


def test_a_rewritten_file_edited_later_is_refused_with_the_way_out(repo, capsys):
    root, sd, _, ids = repo
    assert apply(sd, "--accept", str(ids["rms_norm@model.py:RMSNorm.forward"])) == 0
    (root / "model.py").write_text((root / "model.py").read_text() + "\n# user edit\n")
    capsys.readouterr()
    assert apply(sd, "--accept", str(ids["swiglu@model.py:MLP.forward"])) == 2
    err = capsys.readouterr().err
    assert "model.py changed since npufuse rewrote it" in err and f"npufuse revert {ids['rms_norm@model.py:RMSNorm.forward']}" in err
