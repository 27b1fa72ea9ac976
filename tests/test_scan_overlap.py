"""Work the parent does while the pool analyses (``run_scan(while_waiting=...)``) changes no result.

``npufuse scan`` loads the report template there (jinja2's import and the template's compile
would otherwise come after the last file). The hook runs once, only when a pool runs, and an
error in it is dropped: the caller does the work again later anyway.
"""

from __future__ import annotations

from pathlib import Path

from npufuse.patterns.registry import all_patterns
from npufuse.scan import engine

EXAMPLE = """import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        v = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(v + self.eps))
"""


def _tree(root: Path, n: int) -> Path:
    for k in range(n):
        (root / f"m{k}.py").write_text(EXAMPLE.replace("RMSNorm", f"RMSNorm{k}"), encoding="utf-8")
    return root


def _result(root: Path, **kw) -> str:
    inputs = engine.gather_inputs(root, patterns=all_patterns())
    return engine.run_scan(inputs, jobs=2, **kw).dumps()


def test_the_hook_runs_once_beside_a_pool_and_changes_nothing(tmp_path) -> None:
    root = _tree(tmp_path, engine.PARALLEL_MIN_FILES)
    calls: list[int] = []
    with_hook = _result(root, while_waiting=lambda: calls.append(1))
    assert calls == [1]
    assert with_hook == _result(root)


def test_a_failing_hook_is_dropped(tmp_path) -> None:
    root = _tree(tmp_path, engine.PARALLEL_MIN_FILES)

    def boom() -> None:
        raise RuntimeError("no template")

    assert _result(root, while_waiting=boom) == _result(root)


def test_no_pool_no_hook(tmp_path) -> None:
    root = _tree(tmp_path, 3)  # below PARALLEL_MIN_FILES: analysed in this process, nothing to wait for
    calls: list[int] = []
    _result(root, while_waiting=lambda: calls.append(1))
    assert calls == []
