"""Shared set-up for the verification tests: a tiny repo "applied" the way ``npufuse apply`` does it
(the same libcst splice, an env switch per candidate, scan.json + state.json with ``applied``),
so verify can be tested while apply is written elsewhere. Also the fake trainer for e2e tests."""

from __future__ import annotations

import hashlib
import json
import sys
import textwrap
from pathlib import Path

from npufuse.patterns.base import Finding
from npufuse.rewrite.codegen import env_switch, splice
from npufuse.rewrite.transform import marked_sites
from npufuse.state import State

PY = sys.executable

RMSNORM_MODEL = textwrap.dedent(
    '''\
    import torch
    from torch import nn


    class RMSNorm(nn.Module):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, hidden_states):
            input_dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states.to(input_dtype)
    '''
)
RMS_SPAN = (12, 16)  # the body of RMSNorm.forward

FUSED_OK = "return torch_npu.npu_rms_norm(hidden_states, self.weight.to(hidden_states.dtype), epsilon=self.variance_epsilon)[0]"
# forgets the weight: an all-ones gamma
FUSED_NO_WEIGHT = "return torch_npu.npu_rms_norm(hidden_states, torch.ones_like(self.weight, dtype=hidden_states.dtype), epsilon=self.variance_epsilon)[0]"
# scales the first row by 2%: cosine stays above 0.999
FUSED_ROW_SCALE = """\
y = torch_npu.npu_rms_norm(hidden_states, self.weight.to(hidden_states.dtype), epsilon=self.variance_epsilon)[0]
scale = torch.ones(y.shape[:-1] + (1,), dtype=y.dtype)
scale.view(-1)[0] = 1.02
return y * scale"""
# drops the dtype cast back: returns float32 for a bfloat16 input
FUSED_NO_CAST = "return torch_npu.npu_rms_norm(hidden_states.float(), self.weight.float(), epsilon=self.variance_epsilon)[0]"
# never calls torch_npu at all
FUSED_NO_CALL = "return self.weight * (hidden_states.float() * torch.rsqrt(hidden_states.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(hidden_states.dtype)"


def rms_finding(fused: str = FUSED_OK, qualname: str = "RMSNorm.forward", span: tuple[int, int] = RMS_SPAN) -> Finding:
    return Finding(pattern="rms_norm", qualname=qualname, line=span[0], end_line=span[1], params={}, fused=fused, guard_tensor="hidden_states")


def fake_apply(root: Path, file: str, findings: list[Finding], config: dict | None = None, ids: list[int] | None = None,
               pattern_switch: bool = False, site_switch: bool = True) -> Path:  # fmt: skip
    """Rewrite ``root/file`` with ``findings`` and write .npufuse/scan.json and state.json the way
    apply does (ids 1..n, env switch NPUFUSE_<PATTERN>_<ID>, or apply's NPUFUSE_<PATTERN> shared by
    every site of a pattern with ``pattern_switch``; the per-candidate ``_npufuse_site(ID)`` unless
    ``site_switch`` is False). Returns the state dir."""
    path = root / file
    original = path.read_text()
    ids = ids or list(range(1, len(findings) + 1))
    switches = {f.line: env_switch(f.pattern, None if pattern_switch else i) for f, i in zip(findings, ids)}
    rewritten = splice(original, findings, switches, {f.line: i for f, i in zip(findings, ids)} if site_switch else None)
    path.write_text(rewritten)
    sites = marked_sites(rewritten)
    sd = root / ".npufuse"
    sd.mkdir(exist_ok=True)
    shapes = {k: {"value": v, "from": "config.json"} for k, v in (config or {}).items()}
    cands = []
    for f, i in zip(findings, ids):
        cands.append({
            "id": i, "key": f"{f.pattern}@{file}:{f.qualname}#{i}", "pattern": f.pattern, "api": "torch_npu.npu_rms_norm" if f.pattern == "rms_norm" else f"torch_npu.npu_{f.pattern}",
            "file": file, "qualname": f.qualname, "line": f.line, "end_line": f.end_line, "training_ok": True,
            "switch": {"kind": "env", "name": switches[f.line].name}, "shapes": shapes,
            "params": json.loads(json.dumps(f.params, default=str)),  # as the scan records them (plain JSON)
        })  # fmt: skip
    (sd / "scan.json").write_text(json.dumps({"tool": "npufuse", "root": str(root), "candidates": cands}))
    state = State.load(sd)
    sha = hashlib.sha256(rewritten.encode()).hexdigest()
    for c, f in zip(cands, findings):
        entry = state.ensure(c)
        site = next(s for s in sites if s.qualname == f.qualname)
        entry.applied = {"switch": c["switch"], "span": [site.line, site.end_line], "file_sha256_after": sha}
    state.save()
    return sd


def rms_repo(tmp: Path, fused: str = FUSED_OK, config: dict | None = None) -> Path:
    """A one-file repo with an applied rms_norm candidate (id 1); returns the state dir."""
    (tmp / "model.py").write_text(RMSNORM_MODEL)
    cfg = {"hidden_size": 64, "batch_size": 2, "seq_len": 16, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}
    cfg.update(config or {})
    return fake_apply(tmp, "model.py", [rms_finding(fused)], config=cfg)


def test_fake_apply_writes_guarded_site(tmp_path: Path) -> None:
    sd = rms_repo(tmp_path)
    text = (tmp_path / "model.py").read_text()
    assert '_npufuse_switch("NPUFUSE_RMS_NORM_1")' in text and "# npufuse: rms_norm" in text
    state = json.loads((sd / "state.json").read_text())
    assert state["candidates"][0]["applied"]["span"][0] > 0


# -- a torch-free fake trainer for e2e tests ------------------------------------------------------
# Pure Python so each child starts in milliseconds: the repo ships its own `torch_npu.py` stub,
# which the probe treats as the real torch_npu (instrumented, backend "real").

FAKE_MODEL = textwrap.dedent(
    '''\
    import math


    class Vec(list):
        is_npu = True


    def norm(x, w, eps):
        ms = sum(v * v for v in x) / len(x)
        r = 1.0 / math.sqrt(ms + eps)
        return [v * r * wi for v, wi in zip(x, w)]
    '''
)
FAKE_SPAN = (9, 11)
FAKE_FUSED = {
    "ok": "return torch_npu.npu_rms_norm(x, w, eps)",
    "diverge": "return [v * 1.05 for v in torch_npu.npu_rms_norm(x, w, eps)]",
    "nan": "return [float('nan') for v in torch_npu.npu_rms_norm(x, w, eps)]",
    "crash": "raise RuntimeError('fused kernel exploded')",
    "nocall": "return [v * (1.0 / math.sqrt(sum(u * u for u in x) / len(x) + eps)) * wi for v, wi in zip(x, w)]",
}

FAKE_TORCH_NPU = textwrap.dedent(
    '''\
    """Test stub standing in for torch_npu (pure Python)."""
    import math

    CALLS = [0]


    def npu_rms_norm(x, w, epsilon=1e-6):
        CALLS[0] += 1
        ms = sum(v * v for v in x) / len(x)
        r = 1.0 / math.sqrt(ms + epsilon)
        return [v * r * wi for v, wi in zip(x, w)]
    '''
)

FAKE_TRAIN = textwrap.dedent(
    '''\
    import argparse, math, os, subprocess, sys, time
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fakemodel

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--crash-at", type=int, default=0)
    p.add_argument("--hang-at", type=int, default=0)
    p.add_argument("--format", default="step")
    p.add_argument("--faster", type=float, default=1.0, help="printed step time factor when the fused op ran")
    a = p.parse_args()
    x = [0.5, -1.0, 2.0, 0.25]
    w = [1.0, 0.9, 1.1, 1.2]
    ref = sum(abs(v) for v in [v * wi / math.sqrt(sum(u * u for u in x) / 4 + 1e-6) for v, wi in zip(x, w)])
    for step in range(1, a.steps + 1):
        if step == a.crash_at:
            raise SystemExit("trainer crashed on purpose")
        if step == a.hang_at:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            open("grandchild.pid", "w").write(str(child.pid))
            time.sleep(300)
        try:
            import torch_npu
            before = torch_npu.CALLS[0]
        except ImportError:
            before = 0
        y = fakemodel.norm(fakemodel.Vec(x), w, 1e-6)
        fused = "torch_npu" in sys.modules and sys.modules["torch_npu"].CALLS[0] > before
        loss = (2.0 * math.exp(-step / 20) + 0.5) * sum(abs(v) for v in y) / ref
        st = 0.1 * (a.faster if fused else 1.0) * (1 + 0.02 * math.sin(step * 1.7))
        if a.sleep:
            time.sleep(a.sleep)
        if a.format == "hf":
            print({"loss": round(loss, 6), "grad_norm": 1.0, "learning_rate": 5e-5, "epoch": step / 100})
        elif a.format == "megatron":
            print(f" iteration {step:8d}/     100 | consumed samples: {step * 8} | elapsed time per iteration (ms): {st * 1000:.1f} | lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: 1.234 |")
        else:
            print(f"step {step} loss {loss:.6f} step_time {st:.6f}")
        sys.stdout.flush()
    '''
)


def fake_repo(tmp: Path, variant: str = "ok") -> Path:
    """The fake trainer repo with candidate 1 (fakemodel.norm) applied; returns the state dir."""
    (tmp / "fakemodel.py").write_text(FAKE_MODEL)
    (tmp / "torch_npu.py").write_text(FAKE_TORCH_NPU)
    (tmp / "train.py").write_text(FAKE_TRAIN)
    f = Finding(pattern="rms_norm", qualname="norm", line=FAKE_SPAN[0], end_line=FAKE_SPAN[1], params={}, fused=FAKE_FUSED[variant], guard_tensor="x")
    sd = fake_apply(tmp, "fakemodel.py", [f])
    state = State.load(sd)
    state.set_status(1, "e2e_checking", "op check passed (test set-up)")
    state.save()
    return sd
