"""`npufuse verify op` on a rewritten tiny RMSNorm (the same libcst splice as apply), emulated.

The broken fused branches show what each rule catches; in particular a 2% scale of one row
passes the seed criterion (cosine > 0.999) on every tensor and is rejected only by the
dtype-aware relative-error bound.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import test_verify_helpers as h
from npufuse.cli import main
from npufuse.patterns.base import Finding
from npufuse.rewrite.codegen import Switch, splice
from npufuse.state import State
from npufuse.verify.candidate import load_candidate
from npufuse.verify.opcheck import OpOptions, verify_op


def op(sd: Path, *extra: str) -> int:
    return main(["verify", "op", "1", "--state-dir", str(sd), "--quiet", *extra])


def test_correct_replacement_passes_forward_and_backward(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = h.rms_repo(tmp_path)
    assert op(sd) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "grad param:weight" in out
    c = State.load(sd).candidates[1]
    assert c.status == "e2e_checking" and c.reasons[0].startswith("op check passed (emulated)")
    ev = c.evidence["op"]
    assert ev["passed"] and ev["backend"] == "emulated" and ev["backward"] == "checked"
    assert ev["calls"]["site_calls_on"] == 1 and ev["calls"]["site_calls_off"] == 0
    assert ev["inputs"]["source"] == "config" and ev["inputs"]["arguments"]["hidden_states"] == [[2, 16, 64], "bfloat16"]
    kinds = {x["name"]: x for x in ev["checks"]}
    assert set(kinds) == {"out", "grad hidden_states", "grad param:weight"}
    assert all(x["cosine"] > 0.9999 and x["violations"] == 0 for x in kinds.values())
    lines = [json.loads(ln) for ln in (sd / "op_1.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and lines[-1]["summary"] and lines[0]["candidate"] == 1 and "max_rel" in lines[0]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_correct_replacement_passes_other_dtypes(tmp_path: Path, dtype: str) -> None:
    sd = h.rms_repo(tmp_path, config={"torch_dtype": dtype, "hidden_size": 256})
    for seed in range(3):  # no false alarm across seeds
        assert verify_op(load_candidate(1, sd), OpOptions(seed=seed)).passed


def test_row_scale_bug_passes_cosine_but_fails_relative_bound(tmp_path: Path) -> None:
    sd = h.rms_repo(tmp_path, h.FUSED_ROW_SCALE)
    report = verify_op(load_candidate(1, sd), OpOptions())
    assert not report.passed
    assert all(c.seed_ok for c in report.checks)  # cosine > 0.999 everywhere: the seed criterion is blind
    out = next(c for c in report.checks if c.name == "out")
    assert out.cosine > 0.9999 and out.violations > 0 and out.worst["index"][:2] == [0, 0]  # the scaled row
    assert out.row_cos_min > 0.9999  # row cosine is scale-invariant too
    c = State.load(sd).candidates[1]
    assert c.status == "accuracy_failed" and c.verdict == "do not replace: accuracy"
    assert out.rows_over >= 1 and any("rows over the row bound" in r and "cosine 0.99" in r for r in c.reasons)


def test_forgotten_weight_fails(tmp_path: Path) -> None:
    sd = h.rms_repo(tmp_path, h.FUSED_NO_WEIGHT)
    report = verify_op(load_candidate(1, sd), OpOptions())
    assert not report.passed
    reasons = " ".join(report.reasons)
    # the weight was all ones at construction; the perturbation makes forgetting it visible
    assert "grad param:weight: no gradient reaches it" in reasons and "out: cosine" in reasons
    assert any("perturbed" in n for n in report.inputs["notes"])


def test_dropped_dtype_cast_fails(tmp_path: Path) -> None:
    sd = h.rms_repo(tmp_path, h.FUSED_NO_CAST)
    report = verify_op(load_candidate(1, sd), OpOptions())
    assert not report.passed and any("dtype float32 differs from the original's bfloat16" in r for r in report.reasons)


def test_fused_branch_that_never_calls_torch_npu_fails(tmp_path: Path) -> None:
    sd = h.rms_repo(tmp_path, h.FUSED_NO_CALL)
    assert op(sd, "--dtype", "float32") == 1
    c = State.load(sd).candidates[1]
    assert c.status == "accuracy_failed" and "fused branch never executed" in " ".join(c.reasons)


def test_fused_branch_that_raises_fails(tmp_path: Path) -> None:
    sd = h.rms_repo(tmp_path, "return torch_npu.npu_rms_norm(hidden_states, self.weight[:3])[0]")
    report = verify_op(load_candidate(1, sd), OpOptions())
    assert not report.passed and "the fused branch raised NpuOpError: npu_rms_norm: gamma" in report.reasons[0]


def test_explicit_shapes_and_dtype(tmp_path: Path) -> None:
    sd = h.rms_repo(tmp_path)
    assert op(sd, "--shape", "hidden_states=3x5x64:float16") == 0
    ev = State.load(sd).candidates[1].evidence["op"]
    assert ev["inputs"]["source"] == "shape" and ev["inputs"]["arguments"]["hidden_states"] == [[3, 5, 64], "float16"]


def test_bad_shape_is_one_line_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = h.rms_repo(tmp_path)
    assert op(sd, "--shape", "nonsense=2y3") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--shape" in err
    assert State.load(sd).candidates[1].status == "pending"  # a usage error is no verdict: status unchanged


FUNC_MODEL = textwrap.dedent(
    """\
    import torch

    USE_FUSED = True


    def rms(x, w, eps=1e-6):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (y * w.float()).to(x.dtype)
    """
)


def test_function_target_with_repo_switch(tmp_path: Path) -> None:
    # a plain function behind an existing repo switch (no env var): off = module's torch_npu None
    f = Finding(pattern="rms_norm", qualname="rms", line=7, end_line=9, params={}, fused="return torch_npu.npu_rms_norm(x, w.to(x.dtype), epsilon=eps)[0]", guard_tensor="x")
    (tmp_path / "ops.py").write_text(FUNC_MODEL)
    sd = h.fake_apply(tmp_path, "ops.py", [f])
    (tmp_path / "ops.py").write_text(splice(FUNC_MODEL, [f], {7: Switch("existing", expr="USE_FUSED")}))
    cand = load_candidate(1, sd)
    assert cand.site is not None and cand.site.env_switch is None
    report = verify_op(cand, OpOptions(shapes=["x=2x8x32", "w=32"], dtype="bfloat16"))
    assert report.passed, report.reasons
    assert report.calls["site_calls_on"] == 1 and report.calls["site_calls_off"] == 0
    assert {c.name for c in report.checks} == {"out", "grad x", "grad w"}


CTOR_MODEL = textwrap.dedent(
    """\
    import torch
    from torch import nn


    class Norm(nn.Module):
        def __init__(self, hidden_size, mode, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.eps = eps
            self.mode = mode

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
    """
)


def test_constructor_heuristics_need_init_for_unknown_parameters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = Finding(pattern="rms_norm", qualname="Norm.forward", line=13, end_line=14, params={}, fused="return torch_npu.npu_rms_norm(x, self.weight, epsilon=self.eps)[0]", guard_tensor="x")
    (tmp_path / "m.py").write_text(CTOR_MODEL)
    sd = h.fake_apply(tmp_path, "m.py", [f], config={"hidden_size": 48, "torch_dtype": "bfloat16"})
    assert op(sd) == 2
    err = capsys.readouterr().err
    assert "no value for __init__ parameter `mode`" in err and "--init mode=VALUE" in err
    assert State.load(sd).candidates[1].status == "pending"  # a usage error is no verdict
    assert op(sd, "--init", "mode='fast'") == 0


def test_module_level_candidate_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = "import torch\nx = torch.ones(4, 8)\ny = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)\n"
    f = Finding(pattern="rms_norm", qualname="<module>", line=3, end_line=3, params={}, fused="y = torch_npu.npu_rms_norm(x, torch.ones(8))[0]", guard_tensor="x")
    (tmp_path / "top.py").write_text(src)
    sd = h.fake_apply(tmp_path, "top.py", [f])
    assert op(sd) == 2
    assert "module-level code" in capsys.readouterr().err


def test_unknown_and_unapplied_candidates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = h.rms_repo(tmp_path)
    assert main(["verify", "op", "7", "--state-dir", str(sd)]) == 2
    assert "no candidate 7" in capsys.readouterr().err
    state = State.load(sd)
    state.candidates[1].applied = None
    state.save()
    assert op(sd) == 2
    assert "not applied" in capsys.readouterr().err


def test_fused_optimizer_has_no_op_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = "import torch\n\n\ndef make(params):\n    return torch.optim.AdamW(params, lr=1e-3)\n"
    f = Finding(pattern="fused_optimizer", qualname="make", line=5, end_line=5, params={}, fused="return torch_npu.optim.NpuFusedAdamW(params, lr=1e-3)", guard_tensor="params[0]")
    (tmp_path / "opt.py").write_text(src)
    sd = h.fake_apply(tmp_path, "opt.py", [f])
    assert op(sd) == 0
    assert "verified end to end" in capsys.readouterr().out
    c = State.load(sd).candidates[1]
    assert c.status == "e2e_checking" and c.evidence["op"]["passed"] is None and "skipped" in c.evidence["op"]


def test_site_is_found_below_a_page_break(tmp_path: Path) -> None:
    # a form feed is a line break to str.splitlines, not to Python or libcst: the site's guard and
    # fused branch were read one line off after one
    from npufuse.verify.candidate import locate_site

    sd = h.rms_repo(tmp_path)
    plain = locate_site(load_candidate(1, sd))
    model = tmp_path / "model.py"
    text = model.read_text()
    assert "\n\n\nclass RMSNorm" in text
    model.write_text(text.replace("\n\n\nclass RMSNorm", "\n\x0c\n\nclass RMSNorm"))
    paged = locate_site(load_candidate(1, sd))
    assert paged == plain and "_npufuse_on_npu(" in paged.guard and "npu_rms_norm" in paged.fused_text
