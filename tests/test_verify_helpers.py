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


def fake_apply(root: Path, file: str, findings: list[Finding], config: dict | None = None, ids: list[int] | None = None) -> Path:
    """Rewrite ``root/file`` with ``findings`` and write .npufuse/scan.json and state.json the way
    apply does (ids 1..n, env switch NPUFUSE_<PATTERN>_<ID>). Returns the state dir."""
    path = root / file
    original = path.read_text()
    ids = ids or list(range(1, len(findings) + 1))
    switches = {f.line: env_switch(f.pattern, i) for f, i in zip(findings, ids)}
    rewritten = splice(original, findings, switches)
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
