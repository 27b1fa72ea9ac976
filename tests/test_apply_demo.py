"""The bundled demo model (examples/tiny_llama), copied: the real ``npufuse scan`` → ``npufuse
apply --accept all`` → the rewritten model trains with the switches on (emulated torch_npu) and
off, with the same step-1 loss (1e-4 relative) as the untouched original."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from apply_support import npufuse, state_of
from npufuse import emulate

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_llama"
STEPS = 3


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")


def _train(folder: Path, steps: int = STEPS, config_off: tuple[str, ...] = ()) -> list[float]:
    """The demo's own train.py (its model, optimizer, data and seed), in-process: fresh imports of
    train.py and the model.py beside it, so the module prelude sees the current torch_npu."""
    sys.modules.pop("model", None)
    spec = importlib.util.spec_from_file_location(f"demo_train_{id(folder)}", folder / "train.py")
    train = importlib.util.module_from_spec(spec)
    out = io.StringIO()
    try:
        spec.loader.exec_module(train)  # inserts its folder into sys.path and imports model
        for name in config_off:  # a config-field switch: off for every config the script builds
            setattr(train.ModelConfig, name, False)
        with contextlib.redirect_stdout(out):
            assert train.main(["--steps", str(steps), "--batch-size", "4", "--seq-len", "16"]) == 0
    finally:
        sys.modules.pop("model", None)
        while str(folder) in sys.path:
            sys.path.remove(str(folder))
    return [float(m.group(1)) for m in re.finditer(r"^step \d+ loss (\S+)", out.getvalue(), re.M)]


def _switches_off(records: list[dict], monkeypatch) -> tuple[str, ...]:
    """Turn every applied site's switch off: env variables to 0; returns the config fields npufuse
    introduced (``getattr(self.config, "use_npu_<id>", True)``), to be set False."""
    fields = []
    for rec in records:
        sw = rec["switch"]
        if sw["kind"] == "env":
            monkeypatch.setenv(sw["name"], "0")
        else:
            m = re.fullmatch(r'getattr\(self\.config, "(\w+)", True\)', sw["expr"])
            assert m, f"no way to turn off switch {sw['expr']!r} in this test"
            fields.append(m.group(1))
    return tuple(fields)


def test_demo_scan_apply_train_on_and_off(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "tiny_llama"
    shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(tmp_path)
    if importlib.util.find_spec("npufuse.scan.command") is None:
        pytest.skip("`npufuse scan` is not available yet")
    assert npufuse("scan", "tiny_llama") in (0, 1)
    scan = (tmp_path / ".npufuse" / "scan.json").read_text()
    if '"candidates": []' in scan:
        pytest.skip("no detector found a candidate in the demo yet")
    assert npufuse("apply", "--accept", "all") in (0, 1)  # 1: overlapping candidates, one of each applied
    records = [c["applied"] for c in state_of(tmp_path / ".npufuse")["candidates"] if c["applied"]]
    assert records
    files = {c["file"] for c in state_of(tmp_path / ".npufuse")["candidates"] if c["applied"]}
    assert "model.py" in files

    baseline = _train(EXAMPLE)
    with emulate.install() as emu:
        on = _train(repo)
    scanned = {c["id"]: c for c in json.loads(scan)["candidates"]}
    applied_patterns = set()
    for c in state_of(tmp_path / ".npufuse")["candidates"]:
        if c["applied"]:  # every rewritten site's fused branch ran: one of the APIs it calls was called
            applied_patterns.add(c["pattern"])
            names = set(re.findall(r"torch_npu\.([\w.]+)\(", scanned[c["id"]]["fused"]))
            assert any(emu.calls[n] for n in names), (c["key"], sorted(names), dict(emu.calls))
    fields = _switches_off(records, monkeypatch)
    with emulate.install() as emu:
        off = _train(repo, config_off=fields)
    assert sum(emu.calls.values()) == 0, dict(emu.calls)
    assert len(baseline) == len(on) == len(off) == STEPS
    assert abs(on[0] - baseline[0]) <= 1e-4 * abs(baseline[0]), (on, baseline, applied_patterns)
    assert off == baseline  # switched off: the original code, bit for bit
    assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(on, baseline))
    # and back: revert restores the demo byte for byte
    assert npufuse("revert") == 0
    for name in ("model.py", "train.py"):
        assert (repo / name).read_bytes() == (EXAMPLE / name).read_bytes()


def _report_code(report: str, cid: int) -> str:
    """The replacement code block the stage-1 report shows for candidate ``cid``."""
    section = report.split(f"### Candidate {cid}:", 1)[1].split("### Candidate ", 1)[0].split("\n## ", 1)[0]
    blocks = [b.split("```\n", 1)[0] for b in section.split("```python\n")[1:]]
    guarded = [b for b in blocks if "# npufuse: " in b]  # the report also quotes the original code
    assert len(guarded) == 1, f"candidate {cid}: {len(guarded)} replacement blocks in the report"
    return guarded[0]


def test_stage1_report_code_equals_what_apply_writes(tmp_path, monkeypatch):
    if importlib.util.find_spec("npufuse.scan.command") is None:
        pytest.skip("`npufuse scan` is not available yet")
    repo = tmp_path / "tiny_llama"
    shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(tmp_path)
    assert npufuse("scan", "tiny_llama") in (0, 1)
    report = (tmp_path / "report.md").read_text()
    scan = __import__("json").loads((tmp_path / ".npufuse" / "scan.json").read_text())
    if not scan["candidates"]:
        pytest.skip("no detector found a candidate in the demo yet")
    assert npufuse("apply", "--accept", "all") == 0
    spans = {c["id"]: c["applied"]["span"] for c in state_of(tmp_path / ".npufuse")["candidates"]}
    from apply_support import block_of

    for c in scan["candidates"]:
        written = block_of((repo / c["file"]).read_text(), spans[c["id"]])
        assert written == c["replacement"], c["key"]
        assert _report_code(report, c["id"]) == written, c["key"]
