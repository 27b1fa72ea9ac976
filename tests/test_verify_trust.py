"""Verdicts a user can trust (issue 17 item 2, issue 16 item 5): an op check that compared no
tensor is "not checked", never passed; a forced e2e run never says "accuracy ok"."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import test_verify_helpers as h
from npufuse.cli import main
from npufuse.patterns.base import Finding
from npufuse.state import State
from npufuse.verify.candidate import load_candidate
from npufuse.verify.opcheck import OpOptions, verify_op

# The site writes its result into a buffer and returns nothing (generation loops and in-place
# kernels do): no output and no gradient, so nothing the fused branch computed is compared.
PICK_MODEL = textwrap.dedent(
    """\
    import torch


    @torch.no_grad()
    def pick(hidden_states, weight):
        hf = hidden_states.float()
        y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
        hidden_states.copy_(weight * y.to(hidden_states.dtype))
    """
)
PICK_FUSED = "hidden_states.copy_(torch_npu.npu_rms_norm(hidden_states, weight.to(hidden_states.dtype), epsilon=1e-6)[0])"
# the same site returning argmax: integer outputs, compared exactly (a compared tensor, with a note)
ARGMAX_MODEL = PICK_MODEL.replace("hidden_states.copy_(weight * y.to(hidden_states.dtype))", "return (weight * y.to(hidden_states.dtype)).argmax(-1)")
ARGMAX_FUSED = "return torch_npu.npu_rms_norm(hidden_states, weight.to(hidden_states.dtype), epsilon=1e-6)[0].argmax(-1)"


def _pick_repo(tmp: Path, model: str = PICK_MODEL, fused: str = PICK_FUSED) -> Path:
    (tmp / "pick.py").write_text(model)
    f = Finding(pattern="rms_norm", qualname="pick", line=6, end_line=8, params={}, fused=fused, guard_tensor="hidden_states")
    return h.fake_apply(tmp, "pick.py", [f])


def test_zero_compared_tensors_is_not_checked_never_passed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = _pick_repo(tmp_path)
    report = verify_op(load_candidate(1, sd), OpOptions(shapes=["hidden_states=2x8x32", "weight=32"], dtype="bfloat16"))
    assert report.calls["site_calls_on"] == 1  # the fused branch ran: only the comparison is empty
    assert not report.passed and report.outcome == "not checked" and "0 tensors compared" in (report.not_checked or "")
    c = State.load(sd).candidates[1]
    assert c.status == "pending" and c.verdict == "not checked: op check compared 0 tensors"
    assert c.evidence["op"]["outcome"] == "not checked" and c.evidence["op"]["passed"] is False
    assert "op check passed" not in " ".join(c.reasons)
    # the CLI: exit 1 (not passed), says NOT CHECKED; e2e then refuses without --force
    assert main(["verify", "op", "1", "--state-dir", str(sd), "--quiet", "--shape", "hidden_states=2x8x32", "--shape", "weight=32"]) == 1
    out = capsys.readouterr().out
    assert "NOT CHECKED: 0 tensors compared" in out and "PASSED" not in out
    assert main(["verify", "e2e", "1", "--state-dir", str(sd), "--cmd", "true", "--quiet"]) == 2


def test_integer_outputs_are_compared_exactly_and_say_so(tmp_path: Path) -> None:
    sd = _pick_repo(tmp_path, ARGMAX_MODEL, ARGMAX_FUSED)
    report = verify_op(load_candidate(1, sd), OpOptions(shapes=["hidden_states=2x8x32", "weight=32"], dtype="bfloat16"))
    assert report.passed and [c.name for c in report.checks] == ["out"] and report.checks[0].dtype == "torch.int64"
    assert any(n.startswith("only integer outputs") for n in report.notes)
    assert any(r.startswith("only integer outputs") for r in State.load(sd).candidates[1].reasons)


def test_a_compared_tensor_still_passes(tmp_path: Path) -> None:
    # the control: the same repo helper with a float output is checked and passes
    sd = h.rms_repo(tmp_path)
    report = verify_op(load_candidate(1, sd), OpOptions())
    assert report.passed and report.outcome == "passed" and report.not_checked is None


def test_forced_e2e_never_says_accuracy_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = h.fake_repo(tmp_path)
    state = State.load(sd)
    state.set_status(1, "pending")  # no op check has run
    state.save()
    rc = main(["verify", "e2e", "1", "--state-dir", str(sd), "--cmd", f"{h.PY} train.py --steps 30", "--steps", "15", "--force", "--min-effect", "1000", "--quiet"])
    assert rc == 0
    c = State.load(sd).candidates[1]
    assert c.status == "concluded" and c.verdict.startswith("op check skipped (forced)"), c.verdict
    assert "accuracy ok" not in c.verdict and c.evidence["e2e"]["op_check"] == "skipped (forced)"
    assert c.reasons[0].startswith("op check skipped (forced)")
    conclusions = (sd / "CONCLUSIONS.md").read_text()
    assert "op check skipped (forced)" in conclusions and "accuracy ok" not in conclusions
    capsys.readouterr()
    main(["status", "--state-dir", str(sd)])
    assert "op check skipped (forced)" in capsys.readouterr().out
    # a rerun without --force while the op check still has not passed stays labelled forced
    assert main(["verify", "e2e", "1", "--state-dir", str(sd), "--cmd", f"{h.PY} train.py --steps 30", "--steps", "15", "--min-effect", "1000", "--quiet"]) == 0
    assert State.load(sd).candidates[1].verdict.startswith("op check skipped (forced)")


def test_unforced_e2e_after_a_passed_op_check_is_not_labelled_forced(tmp_path: Path) -> None:
    sd = h.fake_repo(tmp_path)  # status e2e_checking: the op check passed (test set-up)
    assert main(["verify", "e2e", "1", "--state-dir", str(sd), "--cmd", f"{h.PY} train.py --steps 30", "--steps", "15", "--min-effect", "1000", "--quiet"]) == 0
    c = State.load(sd).candidates[1]
    assert "forced" not in (c.verdict or "") and c.evidence["e2e"]["op_check"] == "passed"


# -- autocast in the op-check matrix (issue 17 item 3) ---------------------------------------------

ATTN = textwrap.dedent(
    """\
    import math

    import torch
    import torch.nn.functional as F


    def attend(q, k, v):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att, dim=-1)
        return att @ v
    """
)
AMP_TRAIN = textwrap.dedent(
    """\
    import torch
    from attn import attend

    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attend(q, q, q)
    y.float().sum().backward()
    """
)
SHAPES = ["--shape", "q=1x2x8x16", "--shape", "k=1x2x8x16", "--shape", "v=1x2x8x16"]


def test_autocast_pass_holds_the_fused_output_dtype_to_the_original(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "attn.py").write_text(ATTN)
    (tmp_path / "train.py").write_text(AMP_TRAIN)
    monkeypatch.chdir(tmp_path)
    assert main(["scan", ".", "--no-progress"]) in (0, 1)
    assert main(["apply", "--accept", "1"]) == 0
    sd = tmp_path / ".npufuse"

    def op(*extra: str) -> tuple[int, list[str]]:
        rc = main(["verify", "op", "1", "--quiet", *SHAPES, *extra])
        return rc, [c["name"] for c in State.load(sd).candidates[1].evidence["op"]["checks"]]

    # the scan saw autocast in train.py: the check adds the autocast row by itself
    rc, names = op()
    assert rc == 0 and "out (autocast bfloat16)" in names
    # the fused call without the cast to the autocast dtype: float32 out where the original gives bf16
    good = (tmp_path / "attn.py").read_text()
    assert "*_npufuse_autocast(" in good
    # (s51b: q / k / v of unstated rank reach the call as their 4-D views)
    (tmp_path / "attn.py").write_text(good.replace("*_npufuse_autocast(_npufuse_q4.contiguous(), _npufuse_k4.contiguous(), _npufuse_v4.contiguous())",
                                                   "_npufuse_q4.contiguous(), _npufuse_k4.contiguous(), _npufuse_v4.contiguous()"))
    rc, names = op()
    reasons = " ".join(State.load(sd).candidates[1].reasons)
    assert rc == 1 and "out (autocast bfloat16)" in reasons and "float32 differs from the original's bfloat16" in reasons
    # without the autocast row the same broken branch passes: the row is what catches it
    rc, names = op("--autocast", "off")
    assert rc == 0 and not any("autocast" in n for n in names)


# -- verify op --python (issue 17 item 4) ----------------------------------------------------------


def _interpreter(tmp: Path, name: str, body: str) -> Path:
    path = tmp / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def test_op_check_runs_in_the_users_interpreter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the repo imports a library only the training environment has (like lightning or triton)
    repo = tmp_path / "repo"
    repo.mkdir()
    libs = tmp_path / "userlibs"
    libs.mkdir()
    (libs / "trainlib.py").write_text("MARK = 'from the user environment'\n")
    (repo / "model.py").write_text("import trainlib  # noqa: F401\n" + h.RMSNORM_MODEL)
    span = (h.RMS_SPAN[0] + 1, h.RMS_SPAN[1] + 1)
    sd = h.fake_apply(repo, "model.py", [h.rms_finding(span=span)], config={"hidden_size": 64, "torch_dtype": "bfloat16"})
    args = ["verify", "op", "1", "--state-dir", str(sd), "--quiet"]
    # npufuse's own interpreter cannot import it
    assert main(args) == 2
    assert "No module named 'trainlib'" in capsys.readouterr().err
    # the user's interpreter (a venv Python with its own packages) runs the check: npufuse's
    # checker comes from npufuse's install, the repo's imports from that environment
    user_py = _interpreter(tmp_path, "userpython", f'PYTHONPATH="{libs}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{h.PY}" "$@"')
    assert main([*args, "--python", str(user_py)]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "grad param:weight" in out
    c = State.load(sd).candidates[1]
    assert c.status == "e2e_checking" and c.evidence["op"]["passed"] and c.evidence["op"]["calls"]["site_calls_on"] == 1


def test_an_interpreter_that_cannot_run_the_check_is_named_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = h.rms_repo(tmp_path)
    args = ["verify", "op", "1", "--state-dir", str(sd), "--quiet", "--python"]
    # a Python without torch (-S: no site-packages)
    no_torch = _interpreter(tmp_path, "notorch", f'exec "{h.PY}" -S "$@"')
    assert main([*args, str(no_torch)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot import torch there" in err[0] and "Traceback" not in err[0]
    assert main([*args, str(tmp_path / "nope" / "python")]) == 2
    assert "no such executable" in capsys.readouterr().err
    c = State.load(sd).candidates[1]
    assert c.status == "pending" and "op" not in c.evidence  # nothing ran: the state is as it was
