"""Golden files: report.md and scan.json of the fixture repo and of the bundled example repo.

Regenerate after an intended change (new detectors, new report wording):

    NPUFUSE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_scan_golden.py

The ``*.fake.*`` goldens use the fake detectors of scan_fakes.py and so pin the scan
infrastructure alone. The others run the real registry; while detectors are being added they
are skipped whenever the set of registered patterns differs from the one the golden recorded.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
from pathlib import Path

import pytest

from npufuse.cli import main
from npufuse.scan import engine
from scan_fakes import FAKES, copy_fixture

GOLDEN = Path(__file__).parent / "golden"
EXAMPLE = Path(__file__).parent.parent / "examples" / "tiny_llama"
UPDATE = os.environ.get("NPUFUSE_UPDATE_GOLDEN") == "1"
REGENERATE = "NPUFUSE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_scan_golden.py"


def _cli_scan(cwd: Path, target: str, monkeypatch) -> tuple[str, str]:
    monkeypatch.chdir(cwd)
    assert main(["scan", target, "--no-progress"]) == 0
    return (cwd / ".npufuse" / "scan.json").read_text(), (cwd / "report.md").read_text()


def _compare(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"no golden file {path.name}; create it with: {REGENERATE}")
    want = path.read_text()
    if text != want:
        diff = "".join(list(difflib.unified_diff(want.splitlines(True), text.splitlines(True), f"golden/{name}", "now"))[:80])
        pytest.fail(f"{name} differs from the golden file (if intended, regenerate: {REGENERATE}):\n{diff}")


def _skip_if_registry_changed(name: str) -> None:
    if UPDATE:
        return
    path = GOLDEN / name
    if not path.exists():
        pytest.fail(f"no golden {name} yet; create it with: {REGENERATE}")
    recorded = json.loads(path.read_text()).get("patterns")
    current = [p.id for p in engine.registry_patterns()]
    if recorded != current:
        # a new or removed detector must come with regenerated goldens: fail, never skip silently
        pytest.fail(f"registered detectors changed ({recorded} -> {current}); regenerate: {REGENERATE}")


def test_golden_fixture_with_fake_detectors(tmp_path, monkeypatch):
    copy_fixture(tmp_path)
    monkeypatch.setattr(engine, "registry_patterns", lambda: FAKES)
    scan_json, report = _cli_scan(tmp_path, "scan_repo", monkeypatch)
    _compare("scan_repo.fake.json", scan_json)
    _compare("scan_repo.fake.md", report)


def test_golden_fixture_with_the_registry(tmp_path, monkeypatch):
    _skip_if_registry_changed("scan_repo.json")
    copy_fixture(tmp_path)
    scan_json, report = _cli_scan(tmp_path, "scan_repo", monkeypatch)
    _compare("scan_repo.json", scan_json)
    _compare("scan_repo.md", report)


@pytest.mark.skipif(not EXAMPLE.is_dir(), reason="examples/tiny_llama not present")
def test_golden_bundled_example_with_the_registry(tmp_path, monkeypatch):
    _skip_if_registry_changed("tiny_llama.json")
    shutil.copytree(EXAMPLE, tmp_path / "tiny_llama", ignore=shutil.ignore_patterns("__pycache__"))
    scan_json, report = _cli_scan(tmp_path, "tiny_llama", monkeypatch)
    _compare("tiny_llama.json", scan_json)
    _compare("tiny_llama.md", report)
