"""s38 glumoe38: a pattern's scan result and its figures do not depend on which other patterns run.

swiglu and geglu read gated products with one reader that gives each product to one of them; a
product whose injected activation defaults to GELU (zoology's GLU: ``activation=F.gelu``) is geglu's
candidate and dispatches to npu_swiglu as well at run time. ``npufuse scan --only swiglu`` used not
to run geglu's detector at all, and ``bench/detect_corpus.py --only swiglu`` dropped every candidate
of an unscored pattern before reading what its dispatch covers: the site was missed either way.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench_scripts import load_bench
from npufuse.scan.engine import scan_repo
from test_detect_corpus import _mirror_with_tree

detect_corpus = load_bench("detect_corpus")

# invented: an injected activation defaulting to GELU (dispatched on the object at run time), and a
# fixed erf GELU (geglu only: npu_swiglu never computes it)
MODEL = '''import torch
import torch.nn.functional as F
from torch import nn


class GatedUnit(nn.Module):
    def __init__(self, d, h, nonlinearity=F.gelu):
        super().__init__()
        self.a = nn.Linear(d, h)
        self.b = nn.Linear(d, h)
        self.out = nn.Linear(h, d)
        self.nonlinearity = nonlinearity

    def forward(self, x):
        x = self.a(x) * self.nonlinearity(self.b(x))
        return self.out(x)


class FixedGelu(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.a = nn.Linear(d, h)
        self.b = nn.Linear(d, h)

    def forward(self, x):
        return F.gelu(self.a(x)) * self.b(x)
'''


def _repo(tmp_path: Path) -> Path:
    work = tmp_path / "src"
    work.mkdir()
    (work / "model.py").write_text(MODEL)
    return work


def test_only_swiglu_reports_a_geglu_candidate_that_dispatches_to_swiglu(tmp_path):
    root = _repo(tmp_path)
    full = scan_repo(root)
    by_line = {c["line"]: c for c in full.candidates}
    assert by_line[15]["pattern"] == "geglu" and "swiglu" in by_line[15]["params"]["dispatches_to"]
    assert by_line[26]["pattern"] == "geglu" and "swiglu" not in (by_line[26]["params"].get("dispatches_to") or ())
    only = scan_repo(root, only=["swiglu"])
    # the shared site is reported (same candidate as the full scan), the GELU-only one is not
    assert [(c["line"], c["pattern"]) for c in only.candidates] == [(15, "geglu")]
    assert only.candidates[0]["fused"] == by_line[15]["fused"]
    assert only.patterns == ["swiglu"]
    # geglu alone still reports both, and asking for an unrelated pattern adds no GLU detector
    assert sorted(c["line"] for c in scan_repo(root, only=["geglu"]).candidates) == [15, 26]
    assert scan_repo(root, only=["rms_norm"]).candidates == []


def _row(out: str, pattern: str) -> list[str]:
    return next(ln.split() for ln in out.splitlines() if ln.split()[:1] == [pattern])


def test_corpus_figures_of_a_pattern_do_not_depend_on_only(tmp_path, capsys):
    mirrors, commit = _mirror_with_tree(tmp_path, {"model.py": MODEL})
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps({"repos": [{"repo": "someone/model", "commit": commit, "files": [{"path": "model.py", "sites": [
        {"pattern": "swiglu", "qualname": "GatedUnit.forward", "line": 15, "end_line": 15, "label": "fuse"},
        # near miss of the class: a GELU-only product is not a swiglu site, whoever scores it
        {"pattern": "swiglu", "qualname": "FixedGelu.forward", "line": 26, "end_line": 26, "label": "keep"},
    ]}]}]}))
    rows = []
    for extra in ([], ["--only", "swiglu"]):
        assert detect_corpus.main(["--labels", str(labels), "--mirrors", str(mirrors), *extra]) == 0
        rows.append(_row(capsys.readouterr().out, "swiglu")[1:5])
    # TP 1 (the geglu candidate covers the swiglu label), no false positive: the geglu-only candidate
    # is false only under its own pattern, which this label file does not score
    assert rows == [["1", "0", "0", "0"], ["1", "0", "0", "0"]]
