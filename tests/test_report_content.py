"""What the scan report says matches what the rewrite does (issue 17 item 6): the optimizer class
named is the one written, a swiglu whose own estimate is a slowdown says "slower as written" and
offers the merged-weight form, RoPE's kernel counts include the rotation that keeps running."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from npufuse.cli import main


def scan(tmp: Path, files: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict], str]:
    for name, text in files.items():
        (tmp / name).write_text(textwrap.dedent(text))
    monkeypatch.chdir(tmp)
    assert main(["scan", ".", "--no-progress", "-o", "report.md"]) in (0, 1)
    return json.loads((tmp / ".npufuse" / "scan.json").read_text())["candidates"], (tmp / "report.md").read_text()


TRAIN = """\
    import torch


    def main(model, steps):
        optimizer = torch.optim.{opt}(model.parameters(), lr=0.1)
        for _ in range(steps):
            loss = model(torch.randn(2, 4)).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    """


@pytest.mark.parametrize("opt,fused", [("SGD", "NpuFusedSGD"), ("AdamW", "NpuFusedAdamW")])
def test_optimizer_class_named_is_the_one_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, opt: str, fused: str) -> None:
    cands, report = scan(tmp_path, {"train.py": TRAIN.format(opt=opt)}, monkeypatch)
    c = next(c for c in cands if c["pattern"] == "fused_optimizer")
    assert c["api"] == f"torch_npu.optim.{fused}" and f"torch_npu.optim.{fused}(" in c["replacement"]
    row = next(ln for ln in report.splitlines() if ln.startswith("| [1](#candidate-1)"))  # the summary table's row
    assert f"torch_npu.optim.{fused}" in row
    other = "NpuFusedAdamW" if fused == "NpuFusedSGD" else "NpuFusedSGD"
    assert other not in report


MLP = """\
    import torch.nn.functional as F
    from torch import nn


    class MLP(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


    class Fused(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)

        def forward(self, x):
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return F.silu(gate) * up
    """
CONFIG = json.dumps({"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16, "batch_size": 8, "seq_length": 1024, "torch_dtype": "bfloat16"})


def test_swiglu_slowdown_says_slower_and_offers_merged_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cands, report = scan(tmp_path, {"mlp.py": MLP, "config.json": CONFIG}, monkeypatch)
    two = next(c for c in cands if c["pattern"] == "swiglu" and c["qualname"] == "MLP.forward")
    v = two["value"]
    assert v["speedup_bound"] < 0.95 and v["verdict"].startswith("slower as written") and "little gain" not in v["verdict"]
    assert v["merged_speedup_bound"] > 1.0
    assert "self.gate_proj_up_proj = nn.Linear(" in v["merged_form"] and "npu_swiglu(self.gate_proj_up_proj(x), dim=-1)" in v["merged_form"]
    assert "slower as written (0." in report and "Merged-weight form (offered" in report
    # one projection split in two: nothing to merge, no offer
    one = next(c for c in cands if c["pattern"] == "swiglu" and c["qualname"] == "Fused.forward")
    assert "merged_form" not in one["value"] and not one["value"]["verdict"].startswith("slower")


ROPE_LITGPT = """\
    import torch


    def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        head_size = x.size(-1)
        x1 = x[..., : head_size // 2]
        x2 = x[..., head_size // 2 :]
        rotated = torch.cat((-x2, x1), dim=-1)
        roped = (x * cos) + (rotated * sin)
        return roped.to(dtype=x.dtype)


    def rotate_half(x):
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)


    def apply_rotary_pos_emb(q, cos, sin):
        return (q * cos) + (rotate_half(q) * sin)
    """


def test_rope_kernel_counts_include_the_rotation_left_outside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cands, report = scan(tmp_path, {"rope.py": ROPE_LITGPT, "config.json": CONFIG}, monkeypatch)
    lit = next(c for c in cands if c["qualname"] == "apply_rope")
    assert lit["params"]["rotation_outside"] == ["`rotated` (line 8)"] and "torch.cat" not in lit["fused"]
    assert lit["value"]["kernels_before"] == 5 and lit["value"]["kernels_after"] == 3  # neg + cat still run
    assert "still runs" in lit["value"]["estimate"] and any("still runs on both branches" in n for n in lit["notes"])
    # rotate_half called inside the site: the fused call replaces all of it
    hf = next(c for c in cands if c["qualname"] == "apply_rotary_pos_emb")
    assert "rotation_outside" not in hf["params"] and hf["value"]["kernels_after"] == 1
