"""Runs a pattern's own examples: detection, parameters, near-miss reasons, and the rewritten
code executed under the emulator against the original (the example is the test)."""

from __future__ import annotations

import linecache
import sys
import types
from collections.abc import Iterable
from typing import Any

import pytest
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


def only_finding(pattern: Pattern, name: str) -> Finding:
    """The one finding of the pattern's Fuse example ``name`` (asserted to be exactly one)."""
    ex = next(e for e in pattern.FUSE if e.name == name)
    findings, _ = detect_all(pattern, ex.code)
    assert len(findings) == 1
    return findings[0]


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


# --- shared example checks: test_patterns runs them over every example; topic files over a name-prefixed subset ---

_FINDING_ATTRS = ("variant", "qualname", "confidence", "line", "end_line")


def example_cases(pattern: Pattern | Iterable[Pattern], prefix: str | tuple[str, ...] = "", kind: str = "fuse") -> list[Any]:
    """pytest params (pattern, example) for the examples of `kind` ("fuse", "keep", or "run": Fuse
    examples with a run script) whose name starts with `prefix` ("" selects every example)."""
    patterns = [pattern] if isinstance(pattern, Pattern) else list(pattern)
    if kind not in ("fuse", "keep", "run"):
        raise ValueError(f"unknown example kind {kind!r}")
    cases = []
    for p in patterns:
        for i, ex in enumerate(p.KEEP if kind == "keep" else p.FUSE):
            if kind == "run" and not ex.run:
                continue
            if prefix and not (ex.name or "").startswith(prefix):
                continue
            cases.append(pytest.param(p, ex, id=f"{p.id}-{kind}-{ex.name or i}"))
    return cases


def check_fuse_found(pattern: Pattern, example: Any) -> None:
    """The Fuse example is a candidate with the expected parameters."""
    findings, _ = detect_all(pattern, example.code)
    assert findings, f"{pattern.id}: example {example.name!r} not found"
    f = findings[0]
    for key, want in example.expect.items():
        got = getattr(f, key) if key in _FINDING_ATTRS else f.params.get(key)
        assert got == want, f"{pattern.id}: {key} = {got!r}, expected {want!r}"
    for f in findings:
        assert f.pattern == pattern.id and f.fused.strip() and f.guard_tensor
        assert 1 <= f.line <= f.end_line


def check_keep_refused(pattern: Pattern, example: Any) -> None:
    """The Keep example is no candidate, and (when it names one) a near miss gives the reason."""
    findings, misses = detect_all(pattern, example.code)
    assert not findings, f"{pattern.id}: near miss was reported as a candidate: {findings[0].params}"
    if example.reason:
        reasons = " | ".join(m.reason for m in misses)
        assert any(example.reason.lower() in m.reason.lower() for m in misses), (
            f"{pattern.id}: expected a near miss saying {example.reason!r}, got: {reasons or 'none'}"
        )


def check_replacement_matches(pattern: Pattern, example: Any) -> None:
    """The rewritten example runs the fused branch under the emulator and matches the original."""
    findings, _ = detect_all(pattern, example.code)
    facts = check_rewrite_runs(pattern, example.code, example.run, findings)
    assert facts["calls"] >= 1, f"fused branch did not run; calls: {facts['all_calls']}"
    assert facts["n_out"][0] == facts["n_out"][1]
    for a, b in facts["dtypes"]:
        assert a == b, f"dtype changed: {a} -> {b}"
    for a, b in facts["shapes"]:
        assert a == b
    assert min(facts["cos_out"], default=1.0) >= 0.9999, facts["cos_out"]
    assert min(facts["cos_grad"], default=1.0) >= 0.9999, facts["cos_grad"]


def install_stand_in_modules(monkeypatch: pytest.MonkeyPatch, contents: dict[str, dict[str, Any]]) -> dict[str, types.ModuleType]:
    """Register small stand-ins for uninstalled libraries (timm, apex, xformers) in ``sys.modules``
    for one test: ``contents`` maps a dotted module name to the attributes it holds; every parent
    package is created too and holds its children as attributes, so ``import a.b`` and ``from a.b
    import X`` both resolve. ``monkeypatch`` undoes it after the test."""
    mods: dict[str, types.ModuleType] = {}
    for dotted_name in contents:
        parts = dotted_name.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            mods.setdefault(name, types.ModuleType(name))
    for name, attrs in contents.items():
        for attr, value in attrs.items():
            setattr(mods[name], attr, value)
    for name, mod in mods.items():
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(mods[parent], child, mod)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods


def fused_and_runs(pattern: Pattern, code: str, run: str, qualname: str, tol: float = 0.9999) -> dict[str, Any]:
    """Exactly one candidate, in ``qualname``, whose rewrite runs the fused op under the emulator with the original's
    outputs and gradients (cosine > ``tol``), dtypes and shapes."""
    findings, misses = detect_all(pattern, code)
    assert [f.qualname for f in findings] == [qualname], [m.reason for m in misses]
    facts = check_rewrite_runs(pattern, code, run, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > tol and min(facts["cos_grad"]) > tol, facts
    assert all(a == b for a, b in facts["dtypes"]) and all(a == b for a, b in facts["shapes"]), facts
    return facts


def near_miss_says(pattern: Pattern, code: str, *phrases: str) -> None:
    """No candidate, and a near-miss reason holding one of ``phrases``."""
    findings, misses = detect_all(pattern, code)
    assert not findings, [f.qualname for f in findings]
    assert any(any(p in m.reason for p in phrases) for m in misses), [m.reason for m in misses]


def found_and_faithful(pattern: Pattern, code: str, run: str) -> list[Finding]:
    """The findings of ``pattern`` on ``code``, after checking that the rewrite runs the fused op and gives the
    original's outputs (same shapes) and gradients (cosine > 0.9999)."""
    findings, _ = detect_all(pattern, code)
    facts = check_rewrite_runs(pattern, code, run, findings)
    assert facts["calls"] >= 1 and [a == b for a, b in facts["shapes"]] == [True] * len(facts["shapes"])
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999
    return findings
