"""Which files a scan reads: gitignore, skipped folders, symlinks, order."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from npufuse.scan.walk import walk


def _touch(root: Path, rel: str, text: str = "x = 1\n") -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_sorted_relative_posix_paths(tmp_path):
    for rel in ("b.py", "a/z.py", "a/b/c.py", "a.py", "notes.txt", "a/data.json"):
        _touch(tmp_path, rel)
    res = walk(tmp_path)
    assert res.files == sorted(["a.py", "a/b/c.py", "a/z.py", "b.py"])
    assert all("\\" not in f for f in res.files)
    assert res.failed == []


def test_gitignore_root_nested_and_negation(tmp_path):
    _touch(tmp_path, ".gitignore", "ignored/\n*.gen.py\n!keep.gen.py\n")
    _touch(tmp_path, "ignored/m.py")
    _touch(tmp_path, "x.gen.py")
    _touch(tmp_path, "keep.gen.py")
    _touch(tmp_path, "sub/.gitignore", "local.py\n")
    _touch(tmp_path, "sub/local.py")
    _touch(tmp_path, "sub/kept.py")
    _touch(tmp_path, "local.py")  # the nested rule applies only below sub/
    res = walk(tmp_path)
    assert res.files == ["keep.gen.py", "local.py", "sub/kept.py"]
    assert {"path": "ignored/", "reason": ".gitignore"} in res.skipped


def test_enclosing_gitignore_up_to_the_work_tree(tmp_path):
    (tmp_path / ".git").mkdir()
    _touch(tmp_path, ".gitignore", "generated/\n")
    _touch(tmp_path, "pkg/generated/a.py")
    _touch(tmp_path, "pkg/src.py")
    res = walk(tmp_path / "pkg")
    assert res.files == ["src.py"]


@pytest.mark.parametrize("folder", [".venv", "venv", "site-packages", "build", "dist", ".git", "node_modules", "__pycache__", ".tox", "x.egg-info", ".npufuse"])
def test_skipped_folders(tmp_path, folder):
    _touch(tmp_path, f"{folder}/inner.py")
    _touch(tmp_path, "kept.py")
    res = walk(tmp_path)
    assert res.files == ["kept.py"]
    assert [s["path"] for s in res.skipped] == [f"{folder}/"]


def test_virtualenv_by_marker_under_any_name(tmp_path):
    _touch(tmp_path, "myenv/pyvenv.cfg", "home = /usr\n")
    _touch(tmp_path, "myenv/lib/python3.11/site.py")
    _touch(tmp_path, "conda/conda-meta/history", "")
    _touch(tmp_path, "conda/lib/x.py")
    res = walk(tmp_path)
    assert res.files == []
    assert {s["reason"] for s in res.skipped} == {"virtualenv", "conda environment"}


def test_symlink_loop_to_ancestor_is_reported_not_followed(tmp_path):
    _touch(tmp_path, "pkg/a.py")
    os.symlink(tmp_path / "pkg", tmp_path / "pkg" / "loop")
    res = walk(tmp_path)
    assert res.files == ["pkg/a.py"]
    assert [(f.file, f.kind) for f in res.failed] == [("pkg/loop/", "symlink_loop")]


def test_self_referential_symlink_file(tmp_path):
    os.symlink("self.py", tmp_path / "self.py")
    _touch(tmp_path, "ok.py")
    res = walk(tmp_path)
    assert res.files == ["ok.py"]
    assert [(f.file, f.kind) for f in res.failed] == [("self.py", "symlink_loop")]
    assert "symlink loop" in res.failed[0].error


def test_broken_symlink_and_duplicates(tmp_path):
    os.symlink(tmp_path / "missing.py", tmp_path / "dangling.py")
    _touch(tmp_path, "real/a.py")
    os.symlink(tmp_path / "real", tmp_path / "alias")  # the same folder twice: scanned once
    os.symlink(tmp_path / "real" / "a.py", tmp_path / "b.py")  # the same file twice: scanned once
    res = walk(tmp_path)
    assert len([f for f in res.files if f.endswith("a.py") or f == "b.py"]) == 1
    assert [(f.file, f.kind) for f in res.failed] == [("dangling.py", "broken_symlink")]


def test_single_file_target(tmp_path):
    _touch(tmp_path, "pkg/model.py")
    res = walk(tmp_path / "pkg" / "model.py")
    assert res.root == tmp_path / "pkg"
    assert res.files == ["model.py"]


def test_data_files_named_for_configuration(tmp_path):
    for rel in ("config.json", "configs/llama.yaml", "model/generation_config.json", "data.json", "x.yaml"):
        _touch(tmp_path, rel, "{}")
    assert walk(tmp_path).data_files == ["config.json", "configs/llama.yaml", "model/generation_config.json"]


def test_an_explicitly_named_ignored_folder_is_scanned(tmp_path):
    (tmp_path / ".git").mkdir()
    _touch(tmp_path, ".gitignore", "/data/\n")
    _touch(tmp_path, "data/corpus/m.py")
    assert walk(tmp_path / "data" / "corpus").files == ["m.py"]
    assert walk(tmp_path).files == []


def test_tests_examples_tutorials_are_skipped_unless_asked(tmp_path):
    for rel in ("model/llama.py", "tests/test_llama.py", "model/tests/test_norm.py", "examples/train.py",
                "Tutorials/intro.py", "docs/conf.py", "testing_utils/helpers.py"):
        _touch(tmp_path, rel)
    res = walk(tmp_path)
    # "testing_utils" is not one of the names: only whole folder names count
    assert res.files == ["model/llama.py", "testing_utils/helpers.py"]
    reasons = {s["path"]: s["reason"] for s in res.skipped}
    assert set(reasons) == {"Tutorials/", "docs/", "examples/", "model/tests/", "tests/"}
    assert all("--include-tests" in r for r in reasons.values())
    full = walk(tmp_path, include_tests=True)
    assert len(full.files) == 7 and full.skipped == []


def test_a_root_named_examples_is_scanned(tmp_path):
    # the demo scans a copy of examples/tiny_llama; a user may point npufuse at examples/ itself
    _touch(tmp_path, "examples/tiny.py")
    _touch(tmp_path, "examples/tests/t.py")
    res = walk(tmp_path / "examples")
    assert res.files == ["tiny.py"]
    assert [s["path"] for s in res.skipped] == ["tests/"]


def test_scan_cli_include_tests_flag(tmp_path, monkeypatch):
    import json

    from npufuse.cli import main

    _touch(tmp_path, "repo/tests/test_norm.py", "import torch\n\ndef rms(x, w):\n    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))\n")
    _touch(tmp_path, "repo/m.py")
    monkeypatch.chdir(tmp_path)
    assert main(["scan", "repo", "--format", "json", "--no-cache", "--no-progress", "--state-dir", "s1"]) == 0
    first = json.loads((tmp_path / "s1" / "scan.json").read_text())
    assert first["candidates"] == [] and {"path": "tests/", "reason": "tests, examples or tutorials (--include-tests scans them)"} in first["skipped"]
    assert main(["scan", "repo", "--format", "json", "--no-cache", "--no-progress", "--state-dir", "s2", "--include-tests"]) == 0
    second = json.loads((tmp_path / "s2" / "scan.json").read_text())
    assert [c["file"] for c in second["candidates"]] == ["tests/test_norm.py"]


def _git(root: Path, *args: str) -> None:
    import subprocess

    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, env=env)


git_only = pytest.mark.skipif(__import__("shutil").which("git") is None, reason="needs the git command")


@git_only
def test_files_git_tracks_are_read_even_where_gitignore_matches(tmp_path):
    # A clone whose .gitignore lists models/ (and *.gen.py) while its model package is committed:
    # git reads tracked files whatever the ignore patterns say, so does the scan. Untracked files
    # the patterns match stay out, and an ignored folder with nothing tracked is still skipped.
    _touch(tmp_path, ".gitignore", "models/\n*.gen.py\nout/\n")
    _touch(tmp_path, "models/attention.py")
    _touch(tmp_path, "models/deep/norm.py")
    _touch(tmp_path, "models/scratch.py")  # untracked
    _touch(tmp_path, "models/tmp/junk.py")  # untracked folder below a tracked one
    _touch(tmp_path, "layer.gen.py")
    _touch(tmp_path, "other.gen.py")  # untracked
    _touch(tmp_path, "out/run.py")  # untracked
    _touch(tmp_path, "train.py")
    _touch(tmp_path, "pkg/.gitignore", "gen/\n")
    _touch(tmp_path, "pkg/gen/a.py")
    _touch(tmp_path, "pkg/gen/b.py")  # untracked
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-f", ".gitignore", "models/attention.py", "models/deep/norm.py", "layer.gen.py", "train.py", "pkg/.gitignore", "pkg/gen/a.py")
    _git(tmp_path, "commit", "-q", "-m", "x")
    res = walk(tmp_path)
    assert res.files == ["layer.gen.py", "models/attention.py", "models/deep/norm.py", "pkg/gen/a.py", "train.py"]
    assert {"path": "out/", "reason": ".gitignore"} in res.skipped
    assert {"path": "models/tmp/", "reason": ".gitignore"} in res.skipped
    # Scanning a sub-folder of the work tree: git answers relative to it.
    assert walk(tmp_path / "pkg").files == ["gen/a.py"]


@git_only
def test_a_repository_config_command_is_not_run_by_the_walk(tmp_path):
    # The repository is untrusted: its .git/config may name a command git runs on some reads
    # (core.fsmonitor). The walk asks git only for the index, with that hook switched off.
    marker = tmp_path / "ran"
    repo = tmp_path / "repo"
    _touch(repo, ".gitignore", "models/\n")
    _touch(repo, "models/a.py")
    _git(repo, "init", "-q")
    _git(repo, "add", "-f", ".gitignore", "models/a.py")
    _git(repo, "commit", "-q", "-m", "x")
    _git(repo, "config", "core.fsmonitor", f"touch {marker}; echo")
    res = walk(repo)
    assert res.files == ["models/a.py"]
    assert not marker.exists()


def test_without_git_the_ignore_patterns_decide(tmp_path, monkeypatch):
    # A work tree (a .git folder) where git cannot answer (not installed, or not a real repository):
    # the patterns decide alone, as before.
    (tmp_path / ".git").mkdir()
    _touch(tmp_path, ".gitignore", "models/\n")
    _touch(tmp_path, "models/a.py")
    _touch(tmp_path, "b.py")
    monkeypatch.setenv("PATH", str(tmp_path / "no-such-bin"))
    res = walk(tmp_path)
    assert res.files == ["b.py"]
    assert {"path": "models/", "reason": ".gitignore"} in res.skipped
