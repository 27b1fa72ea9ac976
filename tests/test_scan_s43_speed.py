"""s43 (issue 14 item 3): the scan command's parent process runs with the cyclic garbage collector
paused (``engine.collector_paused``). Its automatic full collections traversed the workers'
outcomes, the candidates, the encoded outputs and everything else the process held (torch's
modules once the numeric probe imported it) while nothing of it could be garbage. The pause must
restore the collector's state on every way out, hold for the whole scan command (pool wait,
candidates, scan.json / report.md), and change nothing the scan writes.
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path
from typing import Any, Iterator

import pytest

from npufuse.cli import main as cli_main
from npufuse.scan import engine

from test_scan_prefilter import _texts


@contextlib.contextmanager
def _collector(enabled: bool) -> Iterator[None]:
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        yield
    finally:
        (gc.enable if was else gc.disable)()


def test_the_pause_restores_the_collector_as_it_found_it() -> None:
    with _collector(True):
        with engine.collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(KeyError):
            with engine.collector_paused():
                raise KeyError("a failing scan")
        assert gc.isenabled()  # back on after an exception too
    with _collector(False):
        with engine.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # a caller that had it off keeps it off


def _corpus(root: Path, n: int) -> None:
    texts = _texts()
    for i in range(n):
        (root / f"m{i:03d}.py").write_text(texts[i % len(texts)], encoding="utf-8")


def _scan(corpus: Path, out: Path, jobs: int) -> tuple[bytes, bytes]:
    rc = cli_main(["scan", str(corpus), "-o", str(out / "report.md"), "--state-dir", str(out), "--no-progress", "--no-cache",
                   "--no-follow-imports", "--jobs", str(jobs)])
    assert rc == 0
    return (out / "scan.json").read_bytes(), (out / "report.md").read_bytes()


def test_the_scan_command_runs_paused_and_writes_the_same_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = tmp_path / "repo"
    corpus.mkdir()
    _corpus(corpus, 12)
    seen: dict[str, bool] = {}
    run_scan, render = engine.run_scan, __import__("npufuse.report.markdown", fromlist=["render_markdown"]).render_markdown

    def watched_run_scan(*a: Any, **k: Any) -> Any:
        seen["analysis"] = gc.isenabled()
        return run_scan(*a, **k)

    def watched_render(*a: Any, **k: Any) -> Any:
        seen["report"] = gc.isenabled()
        return render(*a, **k)

    monkeypatch.setattr(engine, "run_scan", watched_run_scan)
    monkeypatch.setattr("npufuse.report.markdown.render_markdown", watched_render)
    with _collector(True):
        paused = _scan(corpus, tmp_path / "a", 1)
        assert gc.isenabled()  # on again once the command returns
    assert seen == {"analysis": False, "report": False}
    # the same command with the pause taken out writes the same bytes (the report names its state folder)
    monkeypatch.setattr(engine, "collector_paused", contextlib.nullcontext)
    seen.clear()
    with _collector(True):
        plain = _scan(corpus, tmp_path / "b", 1)
    assert seen == {"analysis": True, "report": True}
    assert paused[0] == plain[0]
    assert paused[1].replace(str(tmp_path / "a").encode(), b"") == plain[1].replace(str(tmp_path / "b").encode(), b"")


def test_a_pooled_scan_command_writes_what_an_in_process_one_does(tmp_path: Path) -> None:
    corpus = tmp_path / "repo"
    corpus.mkdir()
    _corpus(corpus, max(engine.PARALLEL_MIN_FILES, 50))
    with _collector(True):
        alone = _scan(corpus, tmp_path / "a", 1)
        pooled = _scan(corpus, tmp_path / "b", 2)
        assert gc.isenabled()
    assert alone[0] == pooled[0]
