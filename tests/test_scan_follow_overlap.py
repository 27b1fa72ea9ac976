"""The followed installed files (issue 16) are read while the pool's workers analyse the repo
when no recorded outputs can be reused (a cold cache, --no-cache): the scan's outputs are the
same as when they are read after a scan without a pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from npufuse.cli import main
from npufuse.scan import engine, follow
from tests.test_installed_packages import SITE, make_repo


@pytest.fixture(scope="module")
def site() -> Path:
    if not (SITE / "transformers" / "__init__.py").is_file():
        pytest.skip(f"transformers is not installed in {SITE} (make venv installs it)")
    return SITE


def _repo(tmp_path: Path) -> Path:
    # enough files for a process pool (engine.PARALLEL_MIN_FILES)
    extra = {f"pkg/m{i}.py": f"def f{i}(x):\n    return x + {i}\n" for i in range(engine.PARALLEL_MIN_FILES + 4)}
    return make_repo(tmp_path, "import transformers.models.llama.modeling_llama as m\n", extra)


def _scan(repo: Path, site: Path, sd: Path, *extra: str) -> tuple[bytes, bytes]:
    assert main(["scan", str(repo), "--state-dir", str(sd), "-o", str(sd / "report.md"), "--site", str(site), "--no-progress", *extra]) == 0
    return (sd / "scan.json").read_bytes(), (sd / "report.md").read_bytes().replace(str(sd).encode(), b"SD")


def test_imports_followed_during_the_pool_give_the_same_outputs(tmp_path: Path, site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _repo(tmp_path)
    when: list[str] = []
    analysing = [False]
    real_follow, real_all = follow.follow_imports, engine._analyze_all

    def follow_imports(*a, **k):
        when.append("during the analysis" if analysing[0] else "outside it")
        return real_follow(*a, **k)

    def analyze_all(*a, **k):
        analysing[0] = True
        try:
            return real_all(*a, **k)
        finally:
            analysing[0] = False

    monkeypatch.setattr(follow, "follow_imports", follow_imports)
    monkeypatch.setattr(engine, "_analyze_all", analyze_all)
    serial = _scan(repo, site, tmp_path / "one", "--jobs", "1", "--no-cache")
    assert when == ["outside it"]  # no pool: nothing to overlap
    when.clear()
    pooled = _scan(repo, site, tmp_path / "two", "--jobs", "2", "--no-cache")
    assert when == ["during the analysis"]
    assert pooled == serial
    when.clear()
    cold = _scan(repo, site, tmp_path / "three", "--jobs", "2")  # a cold cache: nothing to reuse
    assert when == ["during the analysis"] and cold[0] == serial[0]
    data = json.loads(serial[0])
    assert any(c["file"] == "transformers/models/llama/modeling_llama.py" for c in data["candidates"])
    when.clear()
    warm = _scan(repo, site, tmp_path / "three", "--jobs", "2")  # recorded outputs: followed first, to key them
    assert when == ["outside it"] and warm[0] == serial[0]
