"""The bundled demo model (examples/tiny_llama), copied: the real ``npufuse scan`` → ``npufuse
apply --accept all`` → the rewritten model trains with the switches on (emulated torch_npu) and
off, with the same step-1 loss (1e-4 relative) as the untouched original."""

from __future__ import annotations

import importlib.util
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


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(model_mod, train_mod, config_attrs: dict[str, bool] | None = None) -> list[float]:
    """train.py's loop (same seed, data and optimizer), in-process and a few steps long."""
    torch.manual_seed(0)
    config = model_mod.ModelConfig.from_json(EXAMPLE / "config.json")
    for name, value in (config_attrs or {}).items():
        setattr(config, name, value)
    model = model_mod.TinyLlama(config)
    model.apply(model_mod.TinyLlama.init_weights)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        inputs, labels = train_mod.make_batch(data, 4, 16, config.vocab_size)
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _switches_off(records: list[dict], monkeypatch) -> dict[str, bool]:
    """Turn every applied site's switch off: env variables to 0, config fields to False."""
    attrs = {}
    for rec in records:
        sw = rec["switch"]
        if sw["kind"] == "env":
            monkeypatch.setenv(sw["name"], "0")
        else:
            m = re.fullmatch(r'getattr\(self\.config, "(\w+)", True\)', sw["expr"])
            assert m, f"no way to turn off switch {sw['expr']!r} in this test"
            attrs[m.group(1)] = False
    return attrs


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
    assert npufuse("apply", "--accept", "all") == 0
    records = [c["applied"] for c in state_of(tmp_path / ".npufuse")["candidates"]]
    assert records and all(records)
    rewritten = (repo / "model.py").read_text()
    assert rewritten.count("# npufuse: ") >= len(records)

    sys.path.insert(0, str(repo))
    try:
        train_mod = _import(repo / "train.py", "demo_train")
        original = _import(EXAMPLE / "model.py", "demo_model_original")
        baseline = _train(original, train_mod)
        with emulate.install() as emu:  # the prelude looks for torch_npu at import
            on = _train(_import(repo / "model.py", "demo_model_on"), train_mod)
        assert sum(emu.calls.values()) > 0
        applied_patterns = {c["pattern"] for c in state_of(tmp_path / ".npufuse")["candidates"]}
        attrs = _switches_off(records, monkeypatch)
        with emulate.install() as emu:
            off = _train(_import(repo / "model.py", "demo_model_off"), train_mod, attrs)
        assert sum(emu.calls.values()) == 0, dict(emu.calls)
    finally:
        sys.path.remove(str(repo))
    assert abs(on[0] - baseline[0]) <= 1e-4 * abs(baseline[0]), (on, baseline, applied_patterns)
    assert off == baseline  # switched off: the original code, bit for bit
    assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(on, baseline))
    # and back: revert restores the demo byte for byte
    assert npufuse("revert") == 0
    assert (repo / "model.py").read_bytes() == (EXAMPLE / "model.py").read_bytes()
