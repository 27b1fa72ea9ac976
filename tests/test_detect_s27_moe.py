"""s27 moe/optimizer pass: repo-wide facts the fused_optimizer candidate must see (issue 14, class 5).

Sharding applied through the object that holds the model (`task.prepare_fsdp()` in the driver,
`create_optimizer(task.trainable_module)` building the optimizer in another file) makes the
candidate a near miss, or states the risk when the wrapping is chosen at run time; a query on the
holder (`if task.is_fsdp():`) is not a wrapping."""

from __future__ import annotations

from pathlib import Path

from npufuse.scan.engine import scan_repo

_BUILDER = '''\
import torch


def create_optimizer(model, lr=1e-3):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
'''

_DRIVER = '''\
import torch.nn as nn

from optim_build import create_optimizer


class Task:
    def __init__(self):
        self.trainable_module = nn.Linear(4, 4)

    def prepare_fsdp(self, **kwargs):
        pass

    def is_fsdp(self):
        return False


def main(args):
    task = Task()
{sharding}
    optimizer = create_optimizer(task.trainable_module, lr=args.lr)
    return optimizer
'''


def _scan(tmp_path: Path, sharding: str) -> dict:
    (tmp_path / "optim_build.py").write_text(_BUILDER)
    (tmp_path / "main.py").write_text(_DRIVER.format(sharding=sharding))
    return scan_repo(tmp_path, only=["fused_optimizer"]).to_json()


def _fsdp_risks(scan: dict) -> list[str]:
    return [r["detail"] for c in scan["candidates"] for r in c["risks"] if "FSDP" in r["detail"]]


def test_holder_sharded_unconditionally_is_a_near_miss(tmp_path: Path) -> None:
    scan = _scan(tmp_path, "    task.prepare_fsdp(reshard_after_forward=True)")
    assert not scan["candidates"]
    reasons = [m["reason"] for m in scan["near_misses"] if m["file"] == "optim_build.py"]
    assert any("`task.prepare_fsdp` at main.py:19" in r for r in reasons), reasons


def test_holder_sharded_under_a_flag_states_the_risk(tmp_path: Path) -> None:
    scan = _scan(tmp_path, "    if args.fsdp:\n        task.prepare_fsdp(reshard_after_forward=True)")
    risks = _fsdp_risks(scan)
    assert len(scan["candidates"]) == 1 and any("task.prepare_fsdp" in r and "chosen at run time" in r for r in risks), risks


def test_query_on_the_holder_is_not_a_wrapping(tmp_path: Path) -> None:
    scan = _scan(tmp_path, "    if task.is_fsdp():\n        print('sharded')")
    assert len(scan["candidates"]) == 1 and not _fsdp_risks(scan)


def test_sharding_of_another_object_does_not_concern_the_model(tmp_path: Path) -> None:
    scan = _scan(tmp_path, "    other = Task()\n    other.prepare_fsdp(reshard_after_forward=True)")
    assert len(scan["candidates"]) == 1 and not _fsdp_risks(scan)
