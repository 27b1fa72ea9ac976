"""`npufuse verify op` of an nn.RMSNorm swapped where it is constructed (rms_norm's ``nn_rmsnorm``
variant): the check builds the module with the switch off and on and runs the original and the
swapped forward (forward and backward), proving the fused branch ran by its npu_rms_norm calls
from the site; then ``verify e2e`` and ``report html`` on the same tiny model (emulated)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from npufuse.cli import main

SRC = Path(__file__).resolve().parents[1] / "src"

MODEL = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Block(nn.Module):
        def __init__(self, dim=32, eps=1e-6):
            super().__init__()
            self.norm = nn.RMSNorm(dim, eps=eps)
            self.proj = nn.Linear(dim, dim)

        def forward(self, x):
            return x + self.proj(self.norm(x))


    class Tiny(nn.Module):
        def __init__(self, dim=32, vocab=64):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.block = Block(dim)
            self.head = nn.Linear(dim, vocab)

        def forward(self, ids):
            return self.head(self.block(self.emb(ids)))
''')

TRAIN = textwrap.dedent('''
    import sys
    import time

    import torch

    from model import Tiny

    if __name__ == "__main__":
        steps = int(sys.argv[1])
        torch.manual_seed(0)
        model = Tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            ids = torch.randint(0, 64, (2, 8))
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"step {step} loss {loss.item():.6f} step_time {time.perf_counter() - t0:.4f}", flush=True)
''')


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture()
def applied(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, list[str], int]:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "model.py").write_text(MODEL)
    (repo / "train.py").write_text(TRAIN)
    sd = repo / ".npufuse"
    st = ["--state-dir", str(sd)]
    rc, out, err = run(["scan", str(repo), *st, "-o", str(repo / "report.md"), "--no-cache"], capsys)
    assert rc == 0, out + err
    scan = json.loads((sd / "scan.json").read_text())
    ours = [c for c in scan["candidates"] if c["pattern"] == "rms_norm" and c["qualname"] == "Block.__init__"]
    assert len(ours) == 1, scan["candidates"]
    cid = ours[0]["id"]
    rc, out, err = run(["apply", "--accept", str(cid), *st], capsys)
    assert rc == 0, out + err
    assert "_npufuse_rms_norm_swap" in (repo / "model.py").read_text()
    return repo, st, cid


def test_construction_swap_op_check_runs_the_module_forward_and_backward(applied: tuple[Path, list[str], int], capsys: pytest.CaptureFixture[str]) -> None:
    repo, st, cid = applied
    rc, out, err = run(["verify", "op", str(cid), *st, "--json"], capsys)
    assert rc == 0, out + err
    report = json.loads(out)
    assert report["passed"] and report["backend"] == "emulated", report
    # the fused branch ran: npu_rms_norm calls from the site's lines with the switch on, none off
    assert report["calls"]["site_calls_on"] >= 1 and report["calls"]["site_calls_off"] == 0, report["calls"]
    names = {c["name"] for c in report["checks"]}
    # forward output, the input's gradient and the (shared) weight's gradient are all compared
    assert {"out", "grad x", "grad param:original.weight"} <= names, names
    assert report["inputs"]["arguments"]["x"][0][-1] == 32  # normalized_shape of the module built at the site
    assert report["backward"].startswith("checked")


def test_construction_swap_with_an_explicit_shape_and_dtype(applied: tuple[Path, list[str], int], capsys: pytest.CaptureFixture[str]) -> None:
    repo, st, cid = applied
    rc, out, err = run(["verify", "op", str(cid), *st, "--json", "--shape", "3x5x32", "--dtype", "float16"], capsys)
    assert rc == 0, out + err
    report = json.loads(out)
    assert report["passed"] and report["inputs"]["arguments"]["x"] == [[3, 5, 32], "float16"], report["inputs"]


def test_a_wrong_swap_fails_the_op_check(applied: tuple[Path, list[str], int], capsys: pytest.CaptureFixture[str]) -> None:
    repo, st, cid = applied
    # the swapped forward forgets the weight: the check must see it (the weight is perturbed from ones)
    text = (repo / "model.py").read_text()
    broken = text.replace("torch_npu.npu_rms_norm(x, gamma, epsilon=eps)[0]", "torch_npu.npu_rms_norm(x, torch.ones_like(gamma), epsilon=eps)[0]")
    assert broken != text
    (repo / "model.py").write_text(broken)
    rc, out, err = run(["verify", "op", str(cid), *st, "--json"], capsys)
    report = json.loads(out)
    assert not report["passed"], report
    assert report["calls"]["site_calls_on"] >= 1


def test_construction_swap_e2e_and_report_html(applied: tuple[Path, list[str], int], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    repo, st, cid = applied
    rc, out, err = run(["verify", "op", str(cid), *st], capsys)
    assert rc == 0, out + err
    monkeypatch.setenv("PYTHONPATH", str(SRC))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc, out, err = run(["verify", "e2e", str(cid), *st, "--root", str(repo), "--cmd", f"{sys.executable} train.py 20", "--steps", "20",
                            "--env", "OMP_NUM_THREADS=1"], capsys)
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, (out + err)[-3000:]
    state = json.loads((repo / ".npufuse" / "state.json").read_text())
    entry = next(e for e in state["candidates"] if e["id"] == cid)
    e2e = entry["evidence"]["e2e"]
    assert e2e["passed"], e2e
    # the swapped forward ran in the training script (counted from the site's lines), never with the switch off
    assert e2e["proof"]["fused_site_calls"] > 0 and e2e["proof"]["baseline_site_calls"] == 0, e2e["proof"]
    html = repo / "report.html"
    rc, out, err = run(["report", "html", *st, "-o", str(html)], capsys)
    assert rc == 0, out + err
    page = html.read_text()
    assert "Block.__init__" in page and "npufuse: rms_norm" in page
    assert os.path.getsize(html) > 0
