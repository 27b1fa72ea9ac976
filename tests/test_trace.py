"""npufuse trace: one recorded run of the user's command decides what static reading guesses.

The fixture repo (tests/fixtures/trace_repo) has, on purpose:
* an eager attention under ``if self.flash:``'s else branch, dead with the default flash=True;
* an ALiBi attention whose "mask" is an arbitrary float bias (never a 0/-inf mask);
* a bf16 autocast forward; an AdamW whose grads are freed by zero_grad(set_to_none=True);
* ``transpose(1, 2).contiguous().reshape`` that no static detector knows (confusion_transpose),
  and ``view(...).transpose(1, 2)`` lines that are adjacent in time but not a fusion.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from npufuse.cli import main
from npufuse.trace import facts

FIXTURE = Path(__file__).parent / "fixtures" / "trace_repo"


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> dict:
    repo = tmp_path_factory.mktemp("trace") / "repo"
    shutil.copytree(FIXTURE, repo)
    import os

    old = os.getcwd()
    os.chdir(repo)
    try:
        assert main(["scan", ".", "--no-progress", "--no-cache"]) == 0
        cmd = f"{sys.executable} train.py --iters 40"
        assert main(["trace", "--cmd", cmd, "--steps", "3"]) == 0
        trace = json.loads((repo / ".npufuse" / "trace.json").read_text())
        scan_after_trace = json.loads((repo / ".npufuse" / "scan.json").read_text())
        assert main(["scan", ".", "--no-progress", "--no-cache", "--trace", ".npufuse/trace.json"]) == 0
        scan = json.loads((repo / ".npufuse" / "scan.json").read_text())
        report = (repo / "report.md").read_text()
    finally:
        os.chdir(old)
    return {"repo": repo, "trace": trace, "scan": scan, "scan_after_trace": scan_after_trace, "report": report}


def _cand(scan: dict, pattern: str, qualname: str) -> dict:
    found = [c for c in scan["candidates"] if c["pattern"] == pattern and c["qualname"] == qualname]
    assert len(found) == 1, [(c["pattern"], c["qualname"]) for c in scan["candidates"]]
    return found[0]


def test_the_run_stopped_after_the_requested_steps(traced: dict) -> None:
    t = traced["trace"]
    assert t["steps"] == 3
    assert t["exit"] == "stopped by npufuse after 3 optimizer steps"
    assert t["processes"] == 1


def test_dead_eager_attention_is_not_reached_and_ranked_last(traced: dict) -> None:
    scan = traced["scan"]
    dead = _cand(scan, "attention", "CausalSelfAttention.forward")
    assert dead["runtime"]["reached"] is False
    assert any(r["kind"] == "not_reached" for r in dead["risks"])
    assert scan["suggested_order"][-1] == dead["id"]
    live = _cand(scan, "sdpa", "CausalSelfAttention.forward")
    assert live["runtime"]["reached"] is True and live["runtime"]["calls"] == 3
    assert "| **no** |" in traced["report"]


def test_trace_annotates_an_existing_scan_json_too(traced: dict) -> None:
    dead = _cand(traced["scan_after_trace"], "attention", "CausalSelfAttention.forward")
    assert dead["runtime"]["reached"] is False


def test_alibi_float_bias_is_recorded_as_float_and_flagged(traced: dict) -> None:
    alibi = _cand(traced["scan"], "attention", "AlibiAttention.forward")
    assert alibi["runtime"]["facts"]["mask_kind"] == "float"
    assert any(r["kind"] == "runtime_mask_values" and r["level"] == "high" for r in alibi["risks"])
    assert "`runtime_mask_values` (high, from the traced run)" in traced["report"]


def test_autocast_state_comes_from_the_run(traced: dict) -> None:
    norm = _cand(traced["scan"], "rms_norm", "RMSNorm.forward")
    assert norm["runtime"]["facts"]["autocast"] == "bfloat16"
    assert any(r["kind"] == "autocast" and r["source"] == "run" for r in norm["risks"])
    sdpa = _cand(traced["scan"], "sdpa", "CausalSelfAttention.forward")
    assert "bfloat16" in sdpa["runtime"]["facts"]["dtypes"]


def test_run_time_only_candidate_with_file_line_and_api(traced: dict) -> None:
    found = traced["trace"]["runtime_candidates"]
    ct = [f for f in found if f["pattern"] == "confusion_transpose"]
    # model.py:42 `y.transpose(1, 2).contiguous().reshape(B, T, C)`: one dataflow chain
    assert {"file": "model.py", "line": 42} in [{"file": f["file"], "line": f["line"]} for f in ct]
    assert all(f["api"] == "torch_npu.npu_confusion_transpose" for f in ct)
    # `view(...).transpose(1, 2)` on line 31 then `view` on line 32: adjacent, not linked
    assert not any(f["line"] in (31, 32) for f in ct)
    assert any(r.startswith("model.py:31 confusion_transpose") for r in traced["trace"]["runtime_rejected"])
    assert "Found at run time" in traced["report"] and "model.py:42" in traced["report"]


def test_optimizer_sequence_is_placed_at_its_construction_with_the_static_reason(traced: dict) -> None:
    opt = [f for f in traced["trace"]["runtime_candidates"] if f["pattern"] == "fused_optimizer"]
    assert len(opt) == 1
    assert (opt[0]["file"], opt[0]["line"]) == ("train.py", 17)
    assert "set_to_none=True" in opt[0]["static_near_miss"]


def test_mask_operand_rule() -> None:
    # the smaller operand is the mask; equal sizes: the one without a gradient
    assert facts._mask_operand([["float:grad", 1024], ["additive_0_neginf", 256]]) == "additive_0_neginf"
    assert facts._mask_operand([["float:grad", 1024], ["float", 1024]]) == "float"
    assert facts._mask_operand([["float", 1024], ["float", 1024]]) is None
    assert facts._mask_kind({"masked_fill": [[["float:grad", 16], ["bool", 16]]]}) == "bool"
    assert facts._mask_kind({"add": [[["float:grad", 64], ["float", 16]]]}) == "float"
    assert facts._mask_kind({}) is None


def test_malformed_records_are_skipped_not_fatal(tmp_path: Path) -> None:
    rec = tmp_path / "records"
    rec.mkdir()
    (rec / "record_1.json").write_text("{not json")
    (rec / "record_2.json").write_text(json.dumps({"lines": [{"path": 3}, "x", {"path": str(tmp_path / "a.py"),
                                                                          "line": "9", "ops": {"mul": "many"}}]}))
    (rec / "record_3.json").write_text(json.dumps([1, 2]))
    lines, totals = facts.merge_records(rec, tmp_path)
    assert totals["processes"] == 1
    assert lines == [{"file": "a.py", "line": 0, "func": "", "in_root": True, "calls": 0, "ops": {"mul": 0},
                      "signatures": [], "values": {}, "batch_uniform": {}, "modules": {}, "autocast": {}}]


@pytest.mark.parametrize("content, why", [
    ("{", "not JSON"),
    ('{"kind": "profile", "lines": []}', "not a trace.json"),
    ("[" * 100000 + "]" * 100000, "not JSON"),
])
def test_scan_refuses_a_bad_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, why: str) -> None:
    (tmp_path / "m.py").write_text("x = 1\n")
    bad = tmp_path / "t.json"
    bad.write_text(content)
    assert main(["scan", str(tmp_path), "--no-progress", "--state-dir", str(tmp_path / ".s"), "-o",
                 str(tmp_path / "r.md"), "--trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--steps", "x"], ["--timeout", "nan"], ["--timeout", "-1"],
                                  ["--root", "/nonexistent/dir"]])
def test_trace_rejects_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    rc = main(["trace", "--cmd", "true", "--state-dir", str(tmp_path / ".s"), *argv])
    assert rc == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_command_that_never_imports_torch_records_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["trace", "--cmd", f"{sys.executable} -c print(1)", "--root", str(tmp_path),
               "--state-dir", str(tmp_path / ".s")])
    assert rc == 1
    assert "nothing was recorded" in capsys.readouterr().err
    assert json.loads((tmp_path / ".s" / "trace.json").read_text())["lines"] == []


SITE = Path(__file__).resolve().parents[1] / ".venv" / "transformers-site"
QWEN_TRAIN = '''
import sys
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

cfg = Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                     shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
torch.manual_seed(0)
model = Qwen2MoeForCausalLM(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(int(sys.argv[1])):
    ids = torch.randint(0, 128, (2, 16))
    out = model(input_ids=ids, labels=ids)
    opt.zero_grad()
    out.loss.backward()
    opt.step()
    print(f"step {step} loss {out.loss.item():.4f}", flush=True)
'''


@pytest.mark.skipif(not (SITE / "transformers").is_dir(), reason="transformers is not unpacked at .venv/transformers-site (make venv)")
def test_qwen2_moe_records_installed_package_lines_and_the_default_paths(tmp_path: Path) -> None:
    """transformers' defaults (sdpa attention, grouped_mm experts) bypass the eager code: the
    record says which lines of the installed package ran, and finds its RMSNorm at run time."""
    (tmp_path / "train.py").write_text(QWEN_TRAIN)
    state = tmp_path / ".npufuse"
    rc = main(["trace", "--cmd", f"{sys.executable} train.py 10", "--steps", "2", "--root", str(tmp_path),
               "--state-dir", str(state), "--env", f"PYTHONPATH={SITE}"])
    assert rc == 0
    t = json.loads((state / "trace.json").read_text())
    ran = {(ln["file"].rsplit("transformers/", 1)[-1], ln["func"]) for ln in t["lines"] if ln["calls"] and not ln["in_root"]}
    assert ("integrations/sdpa_attention.py", "sdpa_attention_forward") in ran
    assert ("integrations/moe.py", "grouped_mm_experts_forward") in ran
    assert ("models/qwen2_moe/modeling_qwen2_moe.py", "eager_attention_forward") not in ran
    experts = [ln for ln in t["lines"] if ln["file"].endswith("modeling_qwen2_moe.py") and ln["func"] == "forward"
               and "Qwen2MoeExperts" in "".join(ln["modules"])]
    assert experts, "the call of the experts module is recorded with its class"
    found = {(f["file"].rsplit("/", 1)[-1], f["pattern"]) for f in t["runtime_candidates"]}
    assert ("modeling_qwen2_moe.py", "rms_norm") in found
    assert ("modeling_qwen2_moe.py", "add_rms_norm") in found


def test_verify_op_says_not_reached_and_uses_the_recorded_shapes(traced: dict, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import os

    repo = tmp_path / "repo"
    shutil.copytree(traced["repo"], repo)
    norm = _cand(traced["scan"], "rms_norm", "RMSNorm.forward")["id"]
    dead = _cand(traced["scan"], "attention", "CausalSelfAttention.forward")["id"]
    old = os.getcwd()
    os.chdir(repo)
    try:
        assert main(["apply", "--accept", f"{norm},{dead}"]) == 0
        capsys.readouterr()
        assert main(["verify", "op", str(dead)]) == 1
        assert "not reached" in capsys.readouterr().out
        state = json.loads((repo / ".npufuse" / "state.json").read_text())
        entry = [c for c in state["candidates"] if c["id"] == dead][0] if isinstance(state["candidates"], list) \
            else state["candidates"][str(dead)]
        assert entry["status"] == "not_reached"
        assert main(["verify", "op", str(norm), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
    finally:
        os.chdir(old)
    assert out["passed"] is True
    assert any("x=2x16x32:float32" in n for n in out["notes"])           # train.py: batch 2, 16 tokens, dim 32
    assert any("__init__ arguments: dim=32" in n for n in out["notes"])  # Tiny(dim=32) built RMSNorm(dim)
    assert any("bfloat16 autocast" in n for n in out["notes"])
    # the traced run trained under bf16 autocast: the op check has its autocast pass
    assert any("autocast bfloat16" in c["name"] for c in out["checks"]), [c["name"] for c in out["checks"]]


def test_recorded_shapes_are_scaled_down_when_huge_and_said_so() -> None:
    from npufuse.trace.inputs import recorded_shapes

    entry = {"qualname": "Attn.forward", "runtime": {"source": "t.json", "arguments": {
        "self": {"type": "m.Attn"}, "q": {"tensor": [64, 32, 4096, 128], "dtype": "bfloat16"},
        "mask": {"tensor": [1, 1, 16, 16], "dtype": "bool"}, "n": 3, "bad name": {"tensor": [2], "dtype": "float32"}}}}
    items, notes = recorded_shapes(entry)
    # a bool mask is no float tensor of its shape (issue 16): left to its default or the naming heuristics
    assert items == ["q=2x32x256x128:bfloat16"]
    assert any("q 64x32x4096x128 -> 2x32x256x128" in n for n in notes)
    assert recorded_shapes({"runtime": {"arguments": "junk"}}) == ([], [])


from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                     max_leaves=20)
_line = st.fixed_dictionaries({"file": st.sampled_from(["m.py", "x/m.py", 3]), "line": st.one_of(st.integers(-3, 9), _json)},
                              optional={k: _json for k in ("calls", "ops", "values", "batch_uniform", "signatures",
                                                           "modules", "autocast", "in_root", "func")})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_line, max_size=5), extra=st.dictionaries(st.sampled_from(
    ["functions", "runtime_candidates", "steps", "command", "backend", "processes"]), _json, max_size=4))
def test_a_tampered_trace_json_never_raises(tmp_path: Path, lines: list, extra: dict) -> None:
    """scan --trace reads trace.json as untrusted input: any content gives a report, or exit 2."""
    repo = tmp_path / "r"
    repo.mkdir(exist_ok=True)
    (repo / "m.py").write_text(
        "import torch\n\nclass N(torch.nn.Module):\n    def forward(self, x):\n"
        "        v = x.pow(2).mean(-1, keepdim=True)\n        return self.weight * (x * torch.rsqrt(v + self.eps))\n")
    t = tmp_path / "trace.json"
    t.write_text(json.dumps({"kind": "trace", "lines": lines, **extra}))
    rc = main(["scan", str(repo), "--no-progress", "--no-cache", "--state-dir", str(tmp_path / "s"), "-o",
               str(tmp_path / "r.md"), "--trace", str(t)])
    assert rc in (0, 2)


@pytest.mark.parametrize("link", [".npufuse", ".npufuse/trace"])
def test_trace_never_writes_through_a_symlinked_state_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             link: str) -> None:
    """Issue 19 item 1 holds for this verb too: a repo that ships .npufuse (or .npufuse/trace) as a
    link to elsewhere gets exit 2, and nothing is written or removed there."""
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    repo.mkdir()
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("x")
    target = repo / link
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(elsewhere, target_is_directory=True)
    rc = main(["trace", "--cmd", f"{sys.executable} -c print(1)", "--root", str(repo), "--state-dir", str(repo / ".npufuse")])
    assert rc == 2
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]
    assert "Traceback" not in capsys.readouterr().err
