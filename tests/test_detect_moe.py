"""issue 14 class 4 (MoE) beyond the pattern's own Fuse/Keep examples: the canonical expert-mask
reader, and behaviour of the replacements the examples' cosine check cannot see (which rows each
expert receives, expert parallelism, padding rows of torch._grouped_mm, overridden seams)."""

from __future__ import annotations

import ast

import pytest
import torch

from npufuse import emulate
from npufuse.patterns import moe_experts as moe
from npufuse.scan.canonical import expert_mask
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import _exec, detect_all
from npufuse.rewrite.codegen import splice

PATTERN = moe.MoeExperts()


# -- canonical.expert_mask ------------------------------------------------------------------------


def _mask(body: str, name: str = "masks"):
    code = "import torch\nimport torch.nn.functional as F\n\ndef f(idx, E, x):\n" + "".join(f"    {ln}\n" for ln in body.splitlines()) + "    return x\n"
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "f")
    return expert_mask(module, scope, name, len(code.splitlines()))


@pytest.mark.parametrize("body,indices,orientation,spelling", [
    ("masks = F.one_hot(idx, num_classes=E).permute(2, 1, 0)", "idx", "kt", "one_hot"),
    ("masks = torch.nn.functional.one_hot(idx, E)\nmasks = masks.permute(2, 0, 1)", "idx", "tk", "one_hot"),
    ("masks = idx.unsqueeze(-1) == torch.arange(E, device=x.device)\nmasks = masks.permute(2, 0, 1)", "idx", "tk", "arange_eq"),
    ("masks = (idx[..., None] == torch.arange(0, E)).permute(2, 1, 0)", "idx", "kt", "arange_eq"),
    ("masks = (torch.arange(E) == idx[:, :, None]).long().permute((2, 0, 1))", "idx", "tk", "arange_eq"),
    ("masks = F.one_hot(idx, E)", "idx", "tke", "one_hot"),  # [T, K, E]: expert e's mask is masks[..., e]
])
def test_expert_mask_reads_every_spelling(body, indices, orientation, spelling):
    found = _mask(body)
    assert found is not None
    assert (found.indices, found.orientation, found.spelling) == (indices, orientation, spelling)
    assert ast.unparse(found.num_classes) == "E"


@pytest.mark.parametrize("body", [
    "masks = F.one_hot(idx, E).permute(0, 2, 1)",  # not expert-first
    "masks = (idx.unsqueeze(-1) == torch.arange(1, E)).permute(2, 0, 1)",  # classes start at 1
    "masks = (idx.unsqueeze(-1) == torch.arange(0, E, 2)).permute(2, 0, 1)",  # a step
    "masks = (idx.unsqueeze(0) == torch.arange(E)).permute(2, 0, 1)",  # new axis first, not last
    "masks = F.one_hot(idx.flatten(), E).permute(2, 1, 0)",  # indices not a plain name
    "masks = (idx.unsqueeze(-1) > torch.arange(E)).permute(2, 0, 1)",  # not an equality
])
def test_expert_mask_refuses_look_alikes(body):
    assert _mask(body) is None


# -- which rows each expert sees ----------------------------------------------------------------


def _rows_seen(model, x: torch.Tensor) -> dict[int, torch.Tensor]:
    """Expert index -> the input rows it was called with (hooks; None experts skipped)."""
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for i, e in enumerate(model.experts):
        if e is None:
            continue
        hooks.append(e.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, args[0].detach().clone())))
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _original_and_fused(code: str, build: str):
    """Both modules built with the same seed; call inside ``emulate.install()`` (the rewritten
    module's prelude imports torch_npu once, at import)."""
    findings, misses = detect_all(PATTERN, code)
    assert findings, [m.reason for m in misses]
    orig = _exec(code, "original")
    fused = _exec(splice(code, findings), "rewritten")
    torch.manual_seed(0)
    exec(build, orig)
    torch.manual_seed(0)
    exec(build, fused)
    return findings, orig["model"], fused["model"]


def _sorted_rows(t: torch.Tensor) -> list[tuple[float, ...]]:
    return sorted(tuple(round(v, 5) for v in row.tolist()) for row in t)


def test_expert_parallel_replacement_calls_only_local_experts_with_their_rows():
    code = moe._HEAD + moe._EP_EXPERT_CUSTOM + moe._EP_MOE
    build = "model = MoE(16, 24, 8, 2, rank=1, world_size=2)\n"
    x = torch.randn(23, 16)
    with emulate.install() as emu:
        findings, orig, fused = _original_and_fused(code, build)
        want = _rows_seen(orig, x)
        got = _rows_seen(fused, x)
        out = fused(x)
    assert findings[0].params["local_experts_start"] == "self.experts_start_idx"
    assert emu.calls.get("npu_moe_token_permute") and emu.calls.get("npu_moe_token_unpermute")
    assert set(got) == set(want) and set(got) <= {4, 5, 6, 7}  # this rank's experts, the ones with tokens
    for e in want:
        assert _sorted_rows(got[e]) == _sorted_rows(want[e])
    ref = orig(x)
    assert torch.allclose(out, ref, atol=1e-5)
    # tokens routed only to other ranks' experts come back as exactly zero, as the loop leaves them
    _, idx = torch.topk(orig.gate(x).softmax(-1), 2, dim=-1)
    remote = ~((idx >= 4) & (idx < 8)).any(-1)
    assert remote.any() and torch.equal(out[remote], torch.zeros_like(out[remote]))


def test_experts_passed_in_are_called_once_each_on_the_rows_the_loop_gives_them():
    code = moe._EXPERTS_PASSED_IN
    build = "model = MoeLayer([FeedForward(16, 20) for _ in range(5)], nn.Linear(16, 5, bias=False), 2)\n"
    x = torch.randn(17, 16)
    with emulate.install() as emu:
        findings, orig, fused = _original_and_fused(code, build)
        want = _rows_seen(orig, x)
        got = _rows_seen(fused, x)
    assert emu.calls.get("npu_moe_token_permute") == 1
    assert findings[0].params["layout"] == "expert_modules"
    assert set(got) == set(want)
    for e in want:
        # torch.where over [T, K] gives rows in token order; so does the stable permute
        assert torch.equal(got[e], want[e])


# -- torch._grouped_mm -------------------------------------------------------------------------


def test_grouped_mm_rows_past_the_last_offset_are_zero_and_the_rest_exact():
    code = moe._GROUPED_MM_SEAM
    findings, _ = detect_all(PATTERN, code)
    assert len(findings) == 1 and findings[0].variant == "grouped_mm"
    orig = _exec(code, "original")
    x = torch.randn(21, 16)
    counts = torch.tensor([5, 0, 9, 4])  # 18 rows in groups, 3 padding rows
    with emulate.install() as emu:
        fused = _exec(splice(code, findings), "rewritten")
        torch.manual_seed(0)
        ex = fused["GroupedExperts"](16, 24, 4)
        out = ex(x, counts)
    ref = orig["GroupedExperts"](16, 24, 4)
    ref.load_state_dict(ex.state_dict())
    assert emu.calls.get("npu_grouped_matmul") == 3
    assert torch.equal(out[18:], torch.zeros_like(out[18:]))
    want = ref(x, counts)[:18]
    assert torch.allclose(out[:18].float(), want.float(), rtol=2e-2, atol=2e-2)


def test_grouped_mm_seam_overridden_keeps_the_override():
    code = moe._GROUPED_MM_SEAM + '''

class Doubled(GroupedExperts):
    def _grouped_mm(self, *, A, B_t, offs):
        return 2 * torch._grouped_mm(A, B_t, offs=offs)
'''
    findings, _ = detect_all(PATTERN, code)
    # the one-line seam itself is not a site (its callers are); the override, which does more, is its own site
    assert sorted(f.qualname for f in findings) == ["Doubled._grouped_mm", "GroupedExperts.forward"]
    findings = [f for f in findings if f.qualname == "GroupedExperts.forward"]  # the caller's guard alone
    orig = _exec(code, "original")
    x, counts = torch.randn(16, 16), torch.tensor([4, 4, 4, 4])
    with emulate.install() as emu:
        fused = _exec(splice(code, findings), "rewritten")
        torch.manual_seed(0)
        ex = fused["Doubled"](16, 24, 4)
        out = ex(x, counts)
        calls_override = emu.calls.get("npu_grouped_matmul", 0)
        plain = fused["GroupedExperts"](16, 24, 4)
        plain(x, counts)
        calls_plain = emu.calls.get("npu_grouped_matmul", 0) - calls_override
    ref = orig["Doubled"](16, 24, 4)
    ref.load_state_dict(ex.state_dict())
    # emulated tensors count as on the NPU: the class's own seam is fused, the override is run as is
    assert calls_override == 0 and calls_plain == 3
    assert torch.equal(out, ref(x, counts))
    guard = findings[0].guard_tensor
    assert eval(guard, fused, {"self": ex, "x": x}) is None
    assert eval(guard, fused, {"self": plain, "x": x}) is x


def test_grouped_mm_without_offsets_falls_back_to_the_call_as_written():
    code = moe._HEAD + '''
def experts(x, w1, w2, offsets=None):
    h = F.silu(torch._grouped_mm(x, w1, offs=offsets))
    return torch._grouped_mm(h, w2, offs=offsets)
'''
    findings, _ = detect_all(PATTERN, code)
    assert len(findings) == 1
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16)
    w1 = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    w2 = torch.randn(2, 32, 16, dtype=torch.bfloat16)
    want = _exec(code, "original")["experts"](x, w1, w2)
    # 3-D x 3-D without offsets is torch's batched form: the fused branch calls it as written
    with emulate.install() as emu:
        ns = _exec(splice(code, findings), "rewritten")
        got = ns["experts"](x, w1, w2)
    assert torch.equal(got, want)
    assert not emu.calls.get("npu_grouped_matmul")


def test_grouped_mm_near_miss_only_for_real_grouped_mm_calls():
    code = moe._HEAD + '''
class Experts(nn.Module):
    def forward(self, x, counts):
        if counts is None:
            return self._forward_no_grouped_mm(x)
        return x

    def _forward_no_grouped_mm(self, x):
        return x
'''
    findings, misses = detect_all(PATTERN, code)
    assert not findings and not misses


# -- canonical.shaped_like_indices ------------------------------------------------------------------


def _shaped(body: str, weights: str = "w", indices: str = "idx") -> bool:
    from npufuse.scan.canonical import shaped_like_indices
    code = "import torch\nimport torch.nn.functional as F\n\ndef f(scores, other, k):\n" + "".join(f"    {ln}\n" for ln in body.splitlines()) + "    return w\n"
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "f")
    return shaped_like_indices(module, scope, weights, indices, len(code.splitlines()))


@pytest.mark.parametrize("body", [
    "w, idx = torch.topk(scores, k, dim=-1)",
    "w, idx = scores.topk(k, dim=-1)\nw = w / (w.sum(dim=-1, keepdim=True) + 1e-20)",
    "w, idx = scores.topk(k, dim=-1)\nw = F.softmax(w, dim=-1).to(scores.dtype)",
    "_, idx = torch.topk(scores, k)\nw = scores.gather(-1, idx)",
    "_, idx = torch.topk(scores, k)\nw = torch.gather(scores, -1, idx) * 2.0",
])
def test_weights_shaped_like_indices(body):
    assert _shaped(body)


@pytest.mark.parametrize("body", [
    "w, idx = torch.topk(scores, k, dim=-1)\nw = w / w.sum(dim=-1)",  # reduced without keepdim
    "w, idx = torch.topk(scores, k, dim=-1)\nw = w * other",  # another tensor of unknown shape
    "_, idx = torch.topk(scores, k)\nw, _ = torch.topk(other, k)",  # two different topk calls
    "_, idx = torch.topk(scores, k)\nw = scores.gather(0, idx)",  # gathered on another axis
    "w = scores\n_, idx = torch.topk(scores, k)",  # the dense scores, [T, E]
    "_, idx = torch.topk(scores, k)\nw = scores.gather(-1, idx) * other",  # times a tensor of unknown shape
])
def test_weights_not_shaped_like_indices(body):
    assert not _shaped(body)
