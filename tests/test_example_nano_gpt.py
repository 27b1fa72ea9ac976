"""The second bundled example (examples/nano_gpt): a nanoGPT-style repo with its own log format
(`iter N: loss X, time Yms`) training under bf16 autocast, taken through scan -> apply ->
verify op (captured from the train script, autocast replayed) -> verify e2e --all, emulated on
CPU, with a verdict per candidate (issue 17 items 1 and 3).

Under autocast the rotated q/k leave RoPE in float32 while v is bf16: the attention rewrite must
meet them in one dtype as the original's matmuls do, or npu_fusion_attention rejects them (the
crash of issue 17 item 3, reproduced below by removing the cast)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import test_verify_helpers as h
from npufuse.cli import main
from npufuse.state import State

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nano_gpt"
# nanoGPT's own log line; step_time is in ms here (the verdict is emulated: speed is not judged)
LOG_REGEX = r"iter (?P<step>\d+): loss (?P<loss>\S+), time (?P<step_time>[\d.]+)ms"
CAPTURE = "python train.py --max-iters 1"


@pytest.fixture()
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "nano_gpt"
    shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(root)
    monkeypatch.setenv("PATH", str(Path(h.PY).parent) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["scan", ".", "--no-progress"]) in (0, 1)
    assert main(["apply", "--accept", "all"]) == 0
    return root


def _scan(root: Path) -> dict:
    return json.loads((root / ".npufuse" / "scan.json").read_text())


def test_scan_sees_amp_and_every_site_has_its_own_switch(repo: Path) -> None:
    cands = _scan(repo)["candidates"]
    assert {c["pattern"] for c in cands} >= {"attention", "rope", "rms_norm", "swiglu", "fused_optimizer"}
    attn = next(c for c in cands if c["pattern"] == "attention")
    amp = [r for r in attn["risks"] if r["kind"] == "autocast"]
    assert amp and "train.py" in amp[0]["detail"] and "q/k/v to the autocast dtype" in amp[0]["detail"]
    assert "_npufuse_autocast(" in attn["replacement"]
    text = (repo / "model.py").read_text()
    for c in cands:
        assert f"_npufuse_site({c['id']})" in (repo / c["file"]).read_text()
    assert "def _npufuse_autocast" in text


def test_attention_under_autocast_fails_without_the_dtype_cast(repo: Path) -> None:
    cid = next(c["id"] for c in _scan(repo)["candidates"] if c["pattern"] == "attention")
    path = repo / "model.py"
    good = path.read_text()
    broken = good.replace("*_npufuse_autocast(q.contiguous(), k.contiguous(), v.contiguous())", "q.contiguous(), k.contiguous(), v.contiguous()")
    assert broken != good
    path.write_text(broken)
    assert main(["verify", "op", str(cid), "--capture", CAPTURE, "--quiet"]) == 1
    c = State.load(repo / ".npufuse").candidates[cid]
    assert c.status == "accuracy_failed" and "value has dtype bfloat16 but query has float32" in " ".join(c.reasons)
    path.write_text(good)
    assert main(["verify", "op", str(cid), "--capture", CAPTURE, "--quiet"]) == 0
    op = State.load(repo / ".npufuse").candidates[cid].evidence["op"]
    assert any("ran under autocast (bfloat16)" in n for n in op["inputs"]["notes"])


def test_verify_op_then_e2e_all_gives_a_verdict_per_candidate(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cands = _scan(repo)["candidates"]
    for c in cands:
        assert main(["verify", "op", str(c["id"]), "--capture", CAPTURE, "--quiet"]) == 0, c["key"]
    capsys.readouterr()
    # no --log-regex: the nanoGPT preset reads `iter N: loss X, time Yms` by itself (detected)
    rc = main(["verify", "e2e", "--all", "--cmd", "python train.py --max-iters 70", "--steps", "60", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"{len(cands) + 2} runs" in out
    state = State.load(repo / ".npufuse")
    for c in cands:
        entry = state.candidates[c["id"]]
        assert entry.status == "concluded", (c["key"], entry.reasons)
        assert entry.evidence["e2e"]["mode"] == "alone" and entry.evidence["e2e"]["proof"]["fused_site_calls"] > 0
        assert entry.evidence["e2e_joint"]["passed"] is True
        want = "op check not applicable; loss ok" if c["pattern"] == "fused_optimizer" else "accuracy ok"
        assert entry.verdict.startswith(want) and "speed not judged (emulated)" in entry.verdict, entry.verdict
    summary = json.loads((repo / ".npufuse" / "e2e_all.json").read_text())
    rows = [json.loads(x) for f in (repo / ".npufuse").rglob("e2e_*.jsonl") for x in f.read_text().splitlines() if x.strip()]
    timed = [r["step_time"] for r in rows if r.get("step_time") is not None]
    # the preset's unit: "time 30.12ms" is 0.03012 s, never 30 s
    assert timed and all(t < 5.0 for t in timed), timed[:3]
    assert len(summary["runs"]) == len(cands) + 2 and summary["runs"]["joint"]["passed"]
