"""bench/corpus_audit.py: the estimator's arithmetic and the entries' resolution against code that
moves, changes or disappears — on a tiny synthetic corpus, never the real one."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import yaml

from bench_scripts import BENCH, load_bench

ca = load_bench("corpus_audit")

MODEL = '''import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x


class ChannelRMSNorm(nn.Module):
    def __init__(self, channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels, 1, 1))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def not_a_norm(x):
    return torch.rsqrt(x.mean(-1))
'''


def test_wilson_interval_matches_the_closed_form():
    lo, hi = ca.wilson(0, 10)
    assert lo == 0.0 and math.isclose(hi, ca.Z95**2 / (10 + ca.Z95**2))
    lo, hi = ca.wilson(38, 40)
    assert 0.83 < lo < 0.84 and 0.98 < hi < 0.99  # 0.95 of 40: the usual Wilson band
    assert ca.wilson(0, 0) == (0.0, 1.0)


def test_estimate_arithmetic():
    t = ca.Tally(n_candidates=100, n_near=10, n_unfound=50, correct=38, wrong=2,
                 right_reason=6, wrong_reason=1, should_be_candidate=2, not_the_pattern_near=1,
                 missed=3, not_the_pattern_unfound=57)
    e = ca.estimate(t)
    assert math.isclose(e.precision, 0.95) and math.isclose(e.near_accuracy, 0.6) and math.isclose(e.q, 0.05)
    # reported: F = P·Nc + r·Nn with r = (6 + 1 + 2)/10 = 0.9: 95 + 9; missed q·U = 2.5
    assert math.isclose(e.recall, 104 / 106.5)
    # candidates: P·Nc / (P·Nc + s·Nn + q·U) = 95 / (95 + 2 + 2.5)
    assert math.isclose(e.recall_candidates, 95 / 99.5)
    lo, hi = e.recall_candidates_bounds
    assert lo < e.recall_candidates < hi
    lo, hi = e.recall_bounds
    assert lo < e.recall < hi


def test_estimate_with_empty_and_unjudged_populations():
    # nothing unfound and no near misses: recall is precision's business only
    e = ca.estimate(ca.Tally(n_candidates=5, correct=5))
    assert e.recall == 1.0 and e.recall_candidates == 1.0
    # unfound suspects exist but none judged: recall unknown, not guessed
    e = ca.estimate(ca.Tally(n_candidates=5, n_unfound=3, correct=5))
    assert e.recall is None and e.recall_candidates is None


def _run(argv: list[str], corpus: Path, tmp: Path, capsys) -> tuple[int, str]:
    rc = ca.main(argv + ["--corpus", str(corpus), "--audit-dir", str(tmp / "audit"), "--cache-dir", str(tmp / "cache")])
    return rc, capsys.readouterr().out


def _judge(path: Path, verdicts: dict[str, str]) -> dict:
    data = yaml.safe_load(path.read_text())
    for section in ca.SECTIONS:
        for e in data[section]:
            e["verdict"] = verdicts[section]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return data


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "model.py").write_text(MODEL)
    return root


def test_draw_score_and_resolution(corpus: Path, tmp_path: Path, capsys):
    rc, out = _run(["draw", "--pattern", "rms_norm"], corpus, tmp_path, capsys)
    assert rc == 0, out
    path = tmp_path / "audit" / "rms_norm.yaml"
    data = yaml.safe_load(path.read_text())
    assert [(e["qualname"], e["found"]) for e in data["candidates"]] == [("RMSNorm.forward", "candidate")]
    assert [(e["qualname"], e["found"]) for e in data["near_misses"]] == [("ChannelRMSNorm.forward", "near_miss")]
    assert [e["qualname"] for e in data["unfound_suspects"]] == ["not_a_norm"]
    assert data["candidates"][0]["snippet"] == "variance = x.pow(2).mean(-1, keepdim=True)"
    assert all(e["verdict"] == "?" for s in ca.SECTIONS for e in data[s])

    _judge(path, {"candidates": "correct", "near_misses": "right_reason", "unfound_suspects": "missed"})
    rc, out = _run(["score"], corpus, tmp_path, capsys)
    assert rc == 0, out
    assert "P = 1.000  (1 correct / 1 judged" in out
    assert "A = 1.000" in out and "q = 1.000  (1 missed / 1 judged" in out
    # F = 1·1 + 1·1 = 2 reported, q·U = 1 missed: 2/3; candidates: 1 / (1 + 0 + 1)
    assert "recall (reported)   = 0.667" in out and "recall (candidates) = 0.500" in out
    assert "not covered" in out or "not sampled" in out

    # re-drawing keeps the verdicts
    rc, _ = _run(["draw", "--pattern", "rms_norm"], corpus, tmp_path, capsys)
    assert rc == 0
    assert {e["verdict"] for s in ca.SECTIONS for e in yaml.safe_load(path.read_text())[s]} == {"correct", "right_reason", "missed"}

    # code shifted down by a few lines: every entry still resolves, by snippet not line
    (corpus / "model.py").write_text("# a licence header\n\n\n" + MODEL)
    rc, out = _run(["score"], corpus, tmp_path, capsys)
    assert rc == 0 and "unresolved 0" in out and "P = 1.000" in out

    # the detector output a verdict was about changed (another eps): stale, not counted
    (corpus / "model.py").write_text(MODEL.replace("torch.rsqrt(variance + self.eps)\n        return self.weight * x",
                                                   "torch.rsqrt(variance + 1e-5)\n        return self.weight * x"))
    rc, out = _run(["score"], corpus, tmp_path, capsys)
    assert rc == 0 and "stale 1" in out and "0 correct / 0 judged" in out

    # a judged function is gone: the score says so and fails
    (corpus / "model.py").write_text(MODEL.split("\n\ndef not_a_norm")[0] + "\n")
    rc, out = _run(["score"], corpus, tmp_path, capsys)
    assert rc == 1 and "UNRESOLVED" in out and "not_a_norm" in out


def test_found_status_is_current(corpus: Path, tmp_path: Path, capsys):
    """A suspect judged `missed` that the detector now reports is counted as moved, not in q."""
    _run(["draw", "--pattern", "rms_norm"], corpus, tmp_path, capsys)
    path = tmp_path / "audit" / "rms_norm.yaml"
    _judge(path, {"candidates": "correct", "near_misses": "right_reason", "unfound_suspects": "missed"})
    fixed = MODEL.replace("def not_a_norm(x):\n    return torch.rsqrt(x.mean(-1))",
                          "def not_a_norm(x):\n    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)")
    (corpus / "model.py").write_text(fixed)
    rc, out = _run(["score"], corpus, tmp_path, capsys)
    assert rc == 0, out
    assert "moved 1" in out and "judged missed as nothing, now" in out
    assert "0 missed / 0 judged" in out


def test_unknown_verdict_fails(corpus: Path, tmp_path: Path, capsys):
    _run(["draw", "--pattern", "rms_norm"], corpus, tmp_path, capsys)
    path = tmp_path / "audit" / "rms_norm.yaml"
    _judge(path, {"candidates": "yes", "near_misses": "?", "unfound_suspects": "?"})
    rc, out = _run(["score"], corpus, tmp_path, capsys)
    assert rc == 1 and "unknown verdict 'yes'" in out


def test_bench_is_not_put_on_sys_path() -> None:
    assert str(BENCH) not in sys.path
    import profile

    assert "bench" not in str(getattr(profile, "__file__", ""))


# -- a pattern audited on its own named corpus (fused_optimizer on the optimizer sdists) --------

OPTIM_FILE = '''import torch
import torch.nn as nn
from torch.optim import Adagrad


def build(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


if True:  # a class defined in a block, as peft's `if is_megatron_available():`
    class TestLoop:
        def test_step(self):
            model = nn.Linear(2, 2)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()


weights = [nn.Parameter(torch.ones(2))]
# (a plain module-level alias `opt_cls = Adagrad` now resolves to torch.optim.Adagrad, a near miss of its own:
# torch_npu.optim has no fused Adagrad; another library's optimizer is no site of the scan's)
import thirdparty_optim
opt = thirdparty_optim.Adagrad(weights)  # module-level code: a suspect of its own, not held by the functions' findings
'''


def test_unpack_py_keeps_only_safe_python_files(tmp_path: Path):
    import io
    import tarfile

    archive = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in (("pkg-1.0/src/pkg/a.py", b"x = 1\n"), ("pkg-1.0/README.md", b"# no\n"),
                           ("pkg-1.0/../evil.py", b"bad\n"), ("/abs.py", b"bad\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    dest = tmp_path / "out"
    assert ca._unpack_py(archive, dest) == 1
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == ["pkg-1.0/src/pkg/a.py"]
    assert not (tmp_path / "evil.py").exists()


def test_corpus_choice_per_pattern(tmp_path: Path):
    spec, path = ca.corpus_for("fused_optimizer", None, None)
    assert spec.name == "optimizer" and path == ca.OPTIM_CORPUS
    spec, path = ca.corpus_for("rms_norm", None, None)
    assert spec.name == "transformers" and path == ca.CORPUS
    # the yaml's recorded corpus wins over the default; --corpus over both
    assert ca.corpus_for("rms_norm", {"corpus_name": "optimizer"}, None)[0].name == "optimizer"
    assert ca.corpus_for("fused_optimizer", {"corpus_name": "optimizer"}, "transformers")[0].name == "transformers"
    assert ca.corpus_for("fused_optimizer", None, str(tmp_path)) == (None, tmp_path)
    with pytest.raises(ValueError, match="unknown corpus_name"):
        ca.corpus_for("rms_norm", {"corpus_name": "nope"}, None)


def test_named_corpus_is_recorded_and_checked(tmp_path: Path, capsys, monkeypatch):
    root = tmp_path / "optim"
    root.mkdir()
    (root / "train.py").write_text(OPTIM_FILE)
    (root / "SOURCE").write_text("pkg==1.0\n# pkg-1.0.tar.gz: 1 .py files\n")
    monkeypatch.setitem(ca.CORPORA, "optimizer", ca.CorpusSpec("optimizer", root, ("pkg==1.0",), "a test"))
    argv = ["--audit-dir", str(tmp_path / "audit"), "--cache-dir", str(tmp_path / "cache")]

    # no --corpus: fused_optimizer goes to its own corpus (PATTERN_CORPUS)
    assert ca.main(["draw", "--pattern", "fused_optimizer", *argv]) == 0, capsys.readouterr().out
    path = tmp_path / "audit" / "fused_optimizer.yaml"
    data = yaml.safe_load(path.read_text())
    assert data["corpus_name"] == "optimizer" and data["corpus_sources"] == ["pkg==1.0"]
    assert [e["qualname"] for e in data["candidates"]] == ["build", "TestLoop.test_step"]
    # the block-nested method resolves (the shallow index of the default corpus would not find it)
    corpus = ca.Corpus.of(root, None, deep=True)
    assert corpus.spans("train.py", "TestLoop.test_step")
    # module-level code is its own suspect (named by its first line of code): the findings in
    # functions do not hold it
    assert [(e["qualname"], e["snippet"]) for e in data["unfound_suspects"]] == [("<module>", "import torch")]

    _judge(path, {"candidates": "correct", "near_misses": "right_reason", "unfound_suspects": "missed"})
    capsys.readouterr()
    assert ca.main(["score", "--pattern", "fused_optimizer", *argv]) == 0
    out = capsys.readouterr().out
    assert "corpus: optimizer" in out and "P = 1.000  (2 correct / 2 judged" in out and "1 missed / 1 judged" in out

    # the corpus on disk is not the one the verdicts were judged on: said, and the score fails
    (root / "SOURCE").write_text("pkg==2.0\n")
    assert ca.main(["score", "--pattern", "fused_optimizer", *argv]) == 1
    assert "CORPUS MISMATCH" in capsys.readouterr().out

    # re-drawing on another corpus would orphan the judged entries: refused
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.py").write_text(OPTIM_FILE)
    assert ca.main(["draw", "--pattern", "fused_optimizer", "--corpus", str(other), *argv]) == 2
    assert "was judged on" in capsys.readouterr().err
