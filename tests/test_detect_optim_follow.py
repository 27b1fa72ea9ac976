"""``npufuse scan --optimizer-zero-grad-in-place`` reaches the scan of followed installed files
(follow.extend_scan): a library's optimizer is judged under the same option as the repo's."""

from __future__ import annotations

from pathlib import Path

from npufuse.scan import follow

# an installed library's training helper that frees the grads through the optimizer it builds
_LIBRARY = '''\
import torch
from torch import nn


def train(model, batches):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x in batches:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
'''


def _followed(tmp_path: Path) -> follow.FollowResult:
    site = tmp_path / "site"
    (site / "somelib").mkdir(parents=True)
    (site / "somelib" / "__init__.py").write_text("")
    (site / "somelib" / "trainer.py").write_text(_LIBRARY)
    pkg = follow.InstalledPackage("somelib", "1.0", site)
    return follow.FollowResult(files=[follow.FollowedFile(pkg, "somelib/trainer.py", "train(...) at run.py:3")])


def _empty_scan() -> dict:
    return {"candidates": [], "near_misses": [], "files_failed": []}


def _optimizer_sites(scan: dict) -> tuple[list[dict], list[dict]]:
    cands = [c for c in scan["candidates"] if c["pattern"] == "fused_optimizer"]
    near = [m for m in scan["near_misses"] if m["pattern"] == "fused_optimizer"]
    return cands, near


def test_followed_file_scanned_with_the_zero_in_place_option(tmp_path: Path) -> None:
    scan = _empty_scan()
    follow.extend_scan(scan, _followed(tmp_path), only=["fused_optimizer"], max_file_bytes=1 << 20, switch_mode="auto",
                       overrides={}, optimizer_zero_grad_in_place=True)
    cands, near = _optimizer_sites(scan)
    assert len(cands) == 1 and not near, (cands, near)
    assert cands[0]["file"] == "somelib/trainer.py"
    # the fused branch zeroes in place where the library frees
    assert "zero_grad(set_to_none=False)" in repr(cands[0])


def test_followed_file_keeps_the_refusal_without_the_option(tmp_path: Path) -> None:
    scan = _empty_scan()
    follow.extend_scan(scan, _followed(tmp_path), only=["fused_optimizer"], max_file_bytes=1 << 20, switch_mode="auto",
                       overrides={})
    cands, near = _optimizer_sites(scan)
    assert not cands and len(near) == 1
    assert "--optimizer-zero-grad-in-place" in near[0]["reason"]
