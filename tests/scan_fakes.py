"""Tiny fake detectors for testing the scan infrastructure independently of the real ones.

They match by plain syntax (a call name in a statement), which is all the engine, risks,
switches, value plumbing and report need; the real detectors are tested by test_patterns.py.
"""

from __future__ import annotations

import ast

from npufuse.patterns.base import Finding, NearMiss, Pattern, Risk
from npufuse.scan.value import estimate, symbolic


def _calls(module, stmt):
    return [module.call_name(n) for n in ast.walk(stmt) if isinstance(n, ast.Call)]


def _target(stmt):
    if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id
    return None


class FakeRmsNorm(Pattern):
    id = "rms_norm"
    api = "torch_npu.npu_rms_norm"
    title = "RMSNorm (fake)"

    def detect(self, module, scope):
        for block, i, stmt in scope.statements():
            target = _target(stmt)
            if isinstance(stmt, ast.Return) and "torch.rsqrt" in _calls(module, stmt):
                yield Finding(
                    self.id, scope.qualname, stmt.lineno, stmt.end_lineno, params={"eps": "eps", "weight": "weight"},
                    fused="return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]", guard_tensor="x",
                )
            if target and "torch.rsqrt" in _calls(module, stmt):
                src = ast.get_source_segment(module.source, stmt) or ""
                if "- mean" in src:
                    yield NearMiss(self.id, scope.qualname, stmt.lineno, stmt.end_lineno, "mean subtracted: LayerNorm, not RMSNorm")
                    continue
                yield Finding(
                    self.id, scope.qualname, stmt.lineno, stmt.end_lineno,
                    params={"eps": "self.variance_epsilon", "weight": "self.weight", "weight_offset": 0, "upcast": "float32"},
                    fused=f"{target} = torch_npu.npu_rms_norm({target}, torch.ones_like({target}[..., 0:1]), epsilon=1e-6)[0]",
                    guard_tensor=target, variant="fake",
                )

    def assess(self, finding, config):
        h = config.get("hidden_size")
        if not h:
            return symbolic("memory", "reads and writes the activation about 4 times unfused, once fused")
        n = config["batch_size"] * config["seq_len"] * h * config["dtype_bytes"]
        return estimate(bytes_before=5 * n, bytes_after=2 * n, kernels_before=6, kernels_after=1, shapes=f"tokens={config['batch_size'] * config['seq_len']}, hidden={h}")


class FakeAddRmsNorm(Pattern):
    id = "add_rms_norm"
    api = "torch_npu.npu_add_rms_norm"
    title = "Add + RMSNorm (fake)"
    training_ok = False

    def detect(self, module, scope):
        for block, i, stmt in scope.statements():
            if isinstance(stmt, ast.Assign) and ast.unparse(stmt.value) == "residual + hidden_states" and i + 2 < len(block):
                yield Finding(
                    self.id, scope.qualname, stmt.lineno, stmt.lineno,
                    params={"residual": "residual"}, fused="hidden_states = torch.add(residual, hidden_states)",
                    guard_tensor="hidden_states", confidence="medium",
                    risks=[Risk("numerics", "npu_add_rms_norm normalises the fp32 sum (fake)")],
                )


class FakeSdpa(Pattern):
    id = "sdpa"
    api = "torch_npu.npu_fusion_attention"
    title = "SDPA (fake)"
    bound = "compute"

    def detect(self, module, scope):
        for block, i, stmt in scope.statements():
            target = _target(stmt)
            if target and "torch.nn.functional.scaled_dot_product_attention" in _calls(module, stmt):
                yield Finding(
                    self.id, scope.qualname, stmt.lineno, stmt.end_lineno,
                    params={"layout": "BNSD", "causal": True},
                    fused=f"{target} = torch_npu.npu_fusion_attention(q.contiguous(), k.contiguous(), v.contiguous(), q.shape[1], \"BNSD\", actual_seq_qlen=[q.shape[2]] * q.shape[0], scale=q.shape[-1] ** -0.5, sparse_mode=int(q.new_tensor(2).item()))[0]",
                    guard_tensor="q", notes=["enable_gqa: KV heads repeated by the API"],
                )


class FakeOptimizer(Pattern):
    id = "fused_optimizer"
    api = "torch_npu.optim.NpuFusedAdamW"
    title = "Fused optimizer (fake)"
    bound = "launch"

    def detect(self, module, scope):
        for block, i, stmt in scope.statements():
            target = _target(stmt)
            if target and any((c or "").startswith("torch.optim.") for c in _calls(module, stmt)):
                yield Finding(
                    self.id, scope.qualname, stmt.lineno, stmt.end_lineno,
                    params={"optimizer": "AdamW"},
                    fused=f"{target} = torch_npu.optim.NpuFusedAdamW(model.parameters(), lr=args.lr, weight_decay=0.01)",
                    guard_tensor="next(model.parameters())",
                )

    def assess(self, finding, config):
        raise ZeroDivisionError("fake assess failure")


class FakeExploding(Pattern):
    id = "geglu"
    api = "torch_npu.npu_geglu"
    title = "GeGLU (fake, raises)"

    def detect(self, module, scope):
        if scope.qualname.endswith("TinyGeGLU.forward"):
            raise ValueError("fake detector bug")
        return iter(())


FAKES = (FakeRmsNorm(), FakeAddRmsNorm(), FakeSdpa(), FakeOptimizer(), FakeExploding())


# -- fixture helpers ------------------------------------------------------------------------

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "scan_repo"


def copy_fixture(dest: Path) -> Path:
    """The fixture repo copied under ``dest`` (a real .gitignore, plus folders git would not
    keep: .venv, build, __pycache__, node_modules). Returns the copy's root."""
    root = dest / "scan_repo"
    shutil.copytree(FIXTURE, root)
    (root / "dot-gitignore").rename(root / ".gitignore")
    for folder in (".venv/lib", "build/lib", "model/__pycache__", "node_modules/pkg", "dist"):
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "hidden.py").write_text("import torch\nx = torch.rsqrt(torch.ones(1))\n")
    return root


def tree_hashes(root: Path) -> dict[str, str]:
    import hashlib

    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}
