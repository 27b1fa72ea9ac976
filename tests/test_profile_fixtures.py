"""Acceptance on the shared fixtures: seeded fusions found and located; no cross-module fusion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from npufuse.cli import main
from npufuse.profile.analysis import Options, analyze

SHARED = Path(__file__).parents[1].parent / "shared"
FIXTURES = SHARED / "fixtures" / "ascend_profile"
LLAMA = FIXTURES / "llama_like"
FALSEPOS = FIXTURES / "false_positive_demo"

pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared fixtures not present")

# What gen_ascend_profile.py seeds in the llama scenario, and where (model.py / train.py lines).
SEEDED = {
    "rms_norm": ("torch_npu.npu_rms_norm", 31),
    "add_rms_norm": ("torch_npu.npu_add_rms_norm", 31),
    "rope": ("torch_npu.npu_rotary_mul", 48),
    "attention": ("torch_npu.npu_fusion_attention", 82),
    "swiglu": ("torch_npu.npu_swiglu", 101),
    "confusion_transpose": ("torch_npu.npu_confusion_transpose", 70),
    "add_layer_norm": ("torch_npu.npu_add_layer_norm", 160),
    "fast_gelu": ("torch_npu.fast_gelu", 160),
    "fused_optimizer": ("torch_npu.optim.NpuFusedAdamW", 95),
}


@pytest.fixture(scope="module")
def llama() -> dict:
    return analyze([str(LLAMA)], Options(backend="csv"))


def test_every_seeded_fusion_is_found_with_its_source_line(llama: dict) -> None:
    assert llama["problems"] == []
    assert llama["module_confirmed"]
    for pattern, (api, line) in SEEDED.items():
        hits = [f for f in llama["fusions"] if f["pattern"] == pattern]
        assert hits, f"{pattern} not found"
        assert all(f["api"] == api for f in hits)
        assert any(f["location"] and line in f["location"]["lines"] for f in hits), (pattern, [
            f["location"] for f in hits])
        assert all(f["module_confirmed"] for f in hits)


def test_seeded_counts_and_subsumption(llama: dict) -> None:
    def count(p: str) -> int:
        return sum(f["count"] for f in llama["fusions"] if f["pattern"] == p)

    # 2 steps x 4 layers: 2 norms per layer, the first of each step has no residual add before it
    assert count("rms_norm") + count("add_rms_norm") == 16
    assert count("add_rms_norm") == 14
    assert count("rope") == 16 and count("attention") == 8 and count("swiglu") == 8
    att = next(f for f in llama["fusions"] if f["pattern"] == "attention")
    assert att["subsumes"] == {"scaled_masked_softmax": 8}
    assert att["location"]["function"] == "eager_attention"
    rope = next(f for f in llama["fusions"] if f["pattern"] == "rope")
    assert rope["kernels"] == ["Mul", "Neg", "ConcatD", "Mul", "Add"]
    assert any("rotate_half" in fr for fr in rope["location"]["frames"])


def test_roofline_rows_are_complete(llama: dict) -> None:
    a = llama["assumptions"]
    assert a["peak_bw_gbs"] == 1600 and a["peak_tflops"] == 313
    for f in llama["fusions"]:
        r = f["roofline"]
        assert r["verdict"] in {"memory-bound", "compute-bound", "launch-bound"}
        assert r["bytes"] > 0 and r["speedup_max"] >= 1.0 and r["kernels"] >= 1
        assert 0 < f["share"] < 1
    att = next(f for f in llama["fusions"] if f["pattern"] == "attention")
    assert att["roofline"]["bytes_fused"] < att["roofline"]["bytes"] / 10   # scores never leave the chip
    g = llama["gaps"]
    assert g["host_bound_us"] > 0 and g["wait_us"] > 0 and "trace" in g["method"]


def test_cross_module_fixture_reports_no_spanning_fusion() -> None:
    r = analyze([str(FALSEPOS)])
    assert r["usable"]
    for f in r["fusions"]:
        loc = f["location"]
        assert loc is not None and f["module_confirmed"]
        funcs = {fr.rsplit(" ", 1)[-1] for fr in loc["frames"]}
        assert len(funcs) == 1, f"{f['pattern']} spans {funcs}"
    patterns = {f["pattern"] for f in r["fusions"]}
    assert "affinity_addcmul" not in patterns          # mul (ModuleA) + mul, add (ModuleB)
    assert "scaled_masked_softmax" not in patterns     # softmax (Head) + add (Loss)
    rej = [x for x in r["rejected"] if x["pattern"] == "affinity_addcmul"]
    assert rej and "ModuleA.forward" in rej[0]["reason"] and "ModuleB.forward" in rej[0]["reason"]
    # the real SwiGLU is found although another thread's op is interleaved
    sw = [f for f in r["fusions"] if f["pattern"] == "swiglu"]
    assert sw and sw[0]["kernels"] == ["chunk", "silu", "mul"]
    assert sw[0]["location"]["lines"] == [60, 61, 62]
    # a lone exact GELU may map to fast_gelu, but never silently: the caveat says it is approximate
    for f in r["fusions"]:
        if f["pattern"] == "fast_gelu":
            assert "approximat" in f["caveat"]
    # mined sequences obey the same rule
    for s in r["sequences"]["by_time"] + r["sequences"]["by_count"]:
        if s["location"]:
            assert len({fr.rsplit(" ", 1)[-1] for fr in s["location"]["frames"]}) == 1


def test_cli_json_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = tmp_path / "profile.md"
    assert main(["profile", str(LLAMA), "--format", "json", "--markdown", str(md), "--reader", "csv"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {f["pattern"] for f in out["fusions"]} >= set(SEEDED)
    text = md.read_text()
    assert "### Fusion candidates (roofline)" in text and "npu_rms_norm" in text
    assert "1600 GB/s" in text and "aic_/aiv_ metric columns ignored" in text


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", str(LLAMA), "--peak-bw", "800"]) == 0
    out = capsys.readouterr().out
    assert "Fusion candidates" in out and "add_rms_norm" in out and "800 GB/s" in out
