"""affinity_index_put and masks that indexing takes but masked_fill_ does not: a numpy bool array
(``reset_idx = np.array(lens) % k == 0``) or a CPU mask for a device tensor. The rewrite checks at
run time that the mask is a torch tensor on the target's device and keeps the IndexPut otherwise
(the rewrite raised TypeError on the numpy mask before; found by the s32 precision audit)."""

from __future__ import annotations

import numpy as np
import torch

from npufuse import emulate
from npufuse.patterns import affinity_index_put as A
from npufuse.patterns.registry import all_patterns
from pattern_harness import detect_all, splice


def _pattern():
    return next(p for p in all_patterns() if p.id == "affinity_index_put")


def test_numpy_mask_keeps_the_index_put_at_run_time() -> None:
    findings, _ = detect_all(_pattern(), A._S32_NUMPY_MASK)
    assert len(findings) == 1
    f = findings[0]
    assert f.params["mask_placement"] == "checked_at_runtime" and f.params["mask_first_dim"] == 1
    assert "isinstance(_npufuse_mask, torch.Tensor)" in f.fused and "_npufuse_mask.device == states[1].device" in f.fused
    rewritten = splice(A._S32_NUMPY_MASK, findings)
    ref_ns: dict = {}
    exec(compile(A._S32_NUMPY_MASK, "original", "exec"), ref_ns)
    with emulate.install():
        new_ns: dict = {}
        exec(compile(rewritten, "rewritten", "exec"), new_ns)
        torch.manual_seed(0)
        states = [torch.randn(2, 4, 3), torch.randn(2, 4, 3)]
        got = new_ns["reset_states"]([s.clone() for s in states], [3, 4, 6, 8], 3)
    want = ref_ns["reset_states"]([s.clone() for s in states], [3, 4, 6, 8], 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_placement_reasons() -> None:
    from npufuse.scan.dataflow import ModuleInfo

    m = ModuleInfo.from_source("m.py", A._S32_NUMPY_MASK)
    scope = next(s for s in m.scopes if s.qualname == "reset_states")
    name = next(n for n in __import__("ast").walk(scope.node) if getattr(n, "id", None) == "reset_idx" and type(n.ctx).__name__ == "Load")
    assert "numpy" in (A.placement_unproved(m, scope, name, name.lineno) or "")
    m2 = ModuleInfo.from_source("m.py", A._S32_HOST_EYE)
    scope2 = next(s for s in m2.scopes if s.qualname == "sequential_edges")
    unary = next(n for n in __import__("ast").walk(scope2.node) if type(n).__name__ == "UnaryOp")
    assert "CPU" in (A.placement_unproved(m2, scope2, unary, unary.lineno) or "")
    # a mask computed from a device tensor says nothing about the host
    m3 = ModuleInfo.from_source("m.py", "import torch\n\ndef f(x):\n    x[x > 0] = 0\n    return x\n")
    scope3 = next(s for s in m3.scopes if s.qualname == "f")
    cmp = next(n for n in __import__("ast").walk(scope3.node) if type(n).__name__ == "Compare")
    assert A.placement_unproved(m3, scope3, cmp, cmp.lineno) is None
