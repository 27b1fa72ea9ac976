"""Runs a pattern's own examples: detection, parameters, near-miss reasons, and the rewritten
code executed under the emulator against the original (the example is the test)."""

from __future__ import annotations

import linecache
import types
from typing import Any

import torch

from npufuse import emulate
from npufuse.patterns.base import Finding, NearMiss, Pattern
from npufuse.rewrite.codegen import splice
from npufuse.scan.dataflow import ModuleInfo


def detect_all(pattern: Pattern, code: str, path: str = "example.py") -> tuple[list[Finding], list[NearMiss]]:
    module = ModuleInfo.from_source(path, code)
    findings: list[Finding] = []
    misses: list[NearMiss] = []
    for scope in module.scopes:
        for r in pattern.detect(module, scope):
            (findings if isinstance(r, Finding) else misses).append(r)
    return findings, misses


def _exec(code: str, name: str) -> dict[str, Any]:
    mod = types.ModuleType(name)
    mod.__file__ = f"<{name}>"
    # TorchScript reads a scripted function's source through inspect (linecache): registered
    # here, @torch.jit.script examples compile as they would from a file
    linecache.cache[f"<{name}>"] = (len(code), None, code.splitlines(keepends=True), f"<{name}>")
    exec(compile(code, f"<{name}>", "exec"), mod.__dict__)
    return mod.__dict__


def _flat(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _flat(o)]
    return []


def _run(namespace: dict[str, Any], run: str) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    torch.manual_seed(0)
    exec(compile(run, "<run>", "exec"), namespace)
    outs = _flat(namespace["out"])
    grads: list[torch.Tensor | None] = []
    leaves = namespace.get("leaves") or []
    if leaves:
        total = sum(o.float().sum() for o in outs if o.requires_grad)
        total.backward()
        grads = [leaf.grad for leaf in leaves]
    return outs, grads


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    if a.numel() == 0 or (a.norm() == 0 and b.norm() == 0):
        return 1.0
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-300))


def check_rewrite_runs(pattern: Pattern, code: str, run: str, findings: list[Finding]) -> dict[str, Any]:
    """Execute original and rewritten module; return comparison facts (asserted by the caller)."""
    rewritten = splice(code, findings)
    orig_ns = _exec(code, "original")
    ref_outs, ref_grads = _run(orig_ns, run)
    with emulate.install() as emu:
        fused_ns = _exec(rewritten, "rewritten")
        outs, grads = _run(fused_ns, run)
    return {
        "rewritten": rewritten,
        # any torch_npu call proves the fused branch ran (add_rms_norm trains via npu_rms_norm)
        "calls": sum(emu.calls.values()),
        "all_calls": dict(emu.calls),
        "dtypes": [(a.dtype, b.dtype) for a, b in zip(ref_outs, outs)],
        "shapes": [(tuple(a.shape), tuple(b.shape)) for a, b in zip(ref_outs, outs)],
        "n_out": (len(ref_outs), len(outs)),
        "cos_out": [cosine(a, b) for a, b in zip(ref_outs, outs)],
        "cos_grad": [cosine(a, b) if a is not None and b is not None else (1.0 if a is None and b is None else 0.0) for a, b in zip(ref_grads, grads)],
    }
