"""bench/detect_corpus.py: labels + a git mirror -> per-pattern precision/recall (figures only)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "detect_corpus.py"
spec = importlib.util.spec_from_file_location("detect_corpus", BENCH)
detect_corpus = importlib.util.module_from_spec(spec)
sys.modules["detect_corpus"] = detect_corpus  # dataclasses look their module up there
spec.loader.exec_module(detect_corpus)  # type: ignore[union-attr]

MODEL = '''import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(self.norm(x))


def hand_norm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))
'''


def _mirror(tmp_path: Path) -> tuple[Path, str]:
    work = tmp_path / "src"
    work.mkdir()
    (work / "model.py").write_text(MODEL)
    git = ["git", "-C", str(work), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "model.py"], check=True)
    subprocess.run(git + ["commit", "-qm", "m"], check=True)
    commit = subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    mirrors = tmp_path / "mirrors"
    (mirrors / "someone+model").mkdir(parents=True)
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(mirrors / "someone+model" / "repo")], check=True)
    return mirrors, commit


def _labels(tmp_path: Path, commit: str, sites: list[dict]) -> Path:
    p = tmp_path / "labels.json"
    p.write_text(json.dumps({"repos": [
        {"repo": "someone/model", "commit": commit, "files": [{"path": "model.py", "sites": sites}]},
        {"repo": "absent/repo", "commit": commit, "files": [{"path": "x.py", "sites": []}]},
    ]}))
    return p


def test_scores_a_labelled_mirror(tmp_path, capsys):
    mirrors, commit = _mirror(tmp_path)
    labels = _labels(tmp_path, commit, [
        # nn.RMSNorm: the site is where the module is built (the module is swapped there)
        {"pattern": "rms_norm", "qualname": "Block.__init__", "line": 8, "end_line": 8, "label": "fuse"},
        {"pattern": "rms_norm", "qualname": "hand_norm", "line": 16, "end_line": 16, "label": "keep"},  # judged keep on purpose
        {"pattern": "swiglu", "qualname": "FeedForward.forward", "line": 27, "end_line": 27, "label": "fuse"},
        {"pattern": "swiglu", "qualname": "nowhere", "line": 3, "end_line": 3, "label": "fuse"},
    ])
    assert detect_corpus.main(["--labels", str(labels), "--mirrors", str(mirrors), "--list"]) == 0
    out = capsys.readouterr().out
    assert "skipped absent/repo: no mirror" in out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.split() and ln.split()[0] in ("rms_norm", "swiglu", "all")}
    # rms_norm: the nn.RMSNorm construction matched (TP 1); the hand-written norm is a candidate on a keep label (FP 1, on keep 1)
    assert rows["rms_norm"][1:5] == ["1", "1", "1", "0"]
    # swiglu: one label matched, one missed
    assert rows["swiglu"][1:5] == ["1", "0", "0", "1"]
    assert "missed  swiglu" in out and "model.py:3-3" in out


def test_alt_qualnames_name_the_other_place_a_site_may_be_reported(tmp_path, capsys):
    mirrors, commit = _mirror(tmp_path)
    # a split site labelled at one function whose computation the scan reports in its helper
    site = {"pattern": "rms_norm", "qualname": "Block.forward", "line": 11, "end_line": 12, "label": "fuse"}

    def rms_row(sites: list[dict]) -> list[str]:
        labels = _labels(tmp_path, commit, sites)
        assert detect_corpus.main(["--labels", str(labels), "--mirrors", str(mirrors)]) == 0
        out = capsys.readouterr().out
        return next(ln.split() for ln in out.splitlines() if ln.split()[:1] == ["rms_norm"])

    # without alt_qualnames the helper's candidate is an extra and the label a miss
    assert rms_row([site])[1:5] == ["0", "2", "0", "1"]
    # naming the helper: its candidate is the site (TP); the unlabelled construction stays an extra
    assert rms_row([dict(site, alt_qualnames=["hand_norm"])])[1:5] == ["1", "1", "0", "0"]
    # a keep label's alt place counts a candidate there as a false positive on a keep site
    assert rms_row([dict(site, label="keep", alt_qualnames=["hand_norm"])])[1:5] == ["0", "2", "1", "0"]


def test_recall_only_labels_do_not_count_unlabelled_candidates(tmp_path, capsys):
    mirrors, commit = _mirror(tmp_path)
    labels = _labels(tmp_path, commit, [
        {"pattern": "swiglu", "qualname": "FeedForward.forward", "line": 27, "end_line": 27, "label": "fuse"},
        {"pattern": "rms_norm", "qualname": "nowhere", "line": 3, "end_line": 3, "label": "fuse"},
    ])
    data = json.loads(labels.read_text())
    data["recall_only"] = True
    labels.write_text(json.dumps(data))
    assert detect_corpus.main(["--labels", str(labels), "--mirrors", str(mirrors), "--list"]) == 0
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.split() and ln.split()[0] in ("rms_norm", "swiglu", "all")}
    # the two rms_norm candidates are not labelled: no false positive is counted, the label is missed
    assert rows["rms_norm"][1:5] == ["0", "-", "0", "1"] and "n/a (recall-only)" in " ".join(rows["rms_norm"])
    assert rows["swiglu"][1:5] == ["1", "-", "0", "0"]
    assert "extra " not in out
    data["recall_only"] = "yes"
    labels.write_text(json.dumps(data))
    assert detect_corpus.main(["--labels", str(labels), "--mirrors", str(mirrors)]) == 2


def test_wilson_interval():
    lo, hi = detect_corpus.wilson(19, 20)
    assert abs(lo - 0.7639) < 1e-3 and abs(hi - 0.9911) < 1e-3  # the textbook figures for 19/20
    assert detect_corpus.wilson(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize("text", ["not json", '{"repos": 3}', '{"repos": [{"repo": "a/b", "files": [{"path": "../x.py", "sites": []}]}]}',
                                  '{"repos": [{"repo": "a/b", "files": [{"path": "x.py", "sites": [{"pattern": "rms_norm", "line": 1, "label": "maybe"}]}]}]}'])
def test_bad_labels_exit_2_with_one_line(tmp_path, capsys, text):
    p = tmp_path / "l.json"
    p.write_text(text)
    assert detect_corpus.main(["--labels", str(p), "--mirrors", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("detect_corpus: ")


def _mirror_with_tree(tmp_path: Path, files: dict[str, str], links: dict[str, str] | None = None) -> tuple[Path, str]:
    work = tmp_path / "tree"
    for rel, text in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    for rel, target in (links or {}).items():
        (work / rel).symlink_to(target)
    git = ["git", "-C", str(work), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "m"], check=True)
    commit = subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    mirrors = tmp_path / "mirrors"
    (mirrors / "someone+model").mkdir(parents=True)
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(mirrors / "someone+model" / "repo")], check=True)
    return mirrors, commit


def test_repo_sources_take_the_whole_repo_but_only_labelled_test_files(tmp_path):
    mirrors, commit = _mirror_with_tree(tmp_path, {
        "model.py": MODEL, "pkg/train.py": "x = 1\n", "tests/test_model.py": MODEL, "examples/labelled.py": MODEL,
        "configs/config.json": "{}", "README.md": "hi",
    }, links={"pkg/link.py": "../model.py"})
    gd = detect_corpus.git_dir(mirrors, "someone/model")
    blobs, left_out = detect_corpus.repo_sources(gd, commit, ["examples/labelled.py"])
    paths = sorted(p for p, _ in blobs)
    # the symlink is not extracted, tests/ is left out (counted), the labelled example file is in
    assert paths == ["configs/config.json", "examples/labelled.py", "model.py", "pkg/train.py"]
    assert left_out == 1
    dest = tmp_path / "out"
    detect_corpus.extract_blobs(gd, blobs, dest)
    assert (dest / "examples/labelled.py").read_text() == MODEL and (dest / "pkg/train.py").read_text() == "x = 1\n"


def test_whole_repo_mode_scores_only_labelled_files_and_reports_the_scan(tmp_path, capsys):
    # the same model text in a tests/ folder: the default (whole repo) mode leaves it out, the labelled
    # copy under examples/ is scanned and scored; model.py is scanned but not labelled, so not scored
    mirrors, commit = _mirror_with_tree(tmp_path, {"model.py": MODEL, "tests/t.py": MODEL, "examples/m.py": MODEL})
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps({"repos": [{"repo": "someone/model", "commit": commit, "files": [{"path": "examples/m.py", "sites": [
        {"pattern": "swiglu", "qualname": "FeedForward.forward", "line": 27, "end_line": 27, "label": "fuse"}]}]}]}))
    assert detect_corpus.main(["--labels", str(labels), "--mirrors", str(mirrors), "--only", "swiglu"]) == 0
    out = capsys.readouterr().out
    assert "scanned someone/model: 2 files in" in out and "(1 .py files under tests/examples/docs folders left out)" in out
    row = next(ln.split() for ln in out.splitlines() if ln.startswith("swiglu"))
    assert row[1:5] == ["1", "0", "0", "0"]
    assert detect_corpus.main(["--labels", str(labels), "--mirrors", str(mirrors), "--only", "swiglu", "--labelled-only"]) == 0
    out = capsys.readouterr().out
    assert "scanned someone/model: 1 files in" in out and "labelled files only" in out
