"""s27 attention pass (issue 14, census of unlabelled repos): optional run-time inputs become guards, not refusals.

- a step on the probabilities under a flag (``if head_mask is not None: p = p * head_mask``);
- the 3-D scores' 4-D round trip for the mask inside the mask's own branch (BART / CLIP / fairseq);
- the probabilities exposed under a flag (``if output_attentions: w4 = w.view(...) else: w4 = None``);
- in ``k * scale`` the number is the factor, so a key whose size builds a mask is not called a tensor scale;
- a transpose copied by ``.contiguous()`` before ``bmm(v, Pᵀ)``.

Beyond the pattern's own examples (which run the rewrite under the emulator), these check which branch runs:
the fused call exactly where the optional input is absent, the original code elsewhere.
"""

from __future__ import annotations

import ast

import torch

from npufuse import emulate
from npufuse.patterns import attention as A
from npufuse.rewrite.codegen import splice
from pattern_harness import _exec, detect_all


def _example(name: str) -> str:
    return next(ex.code for ex in A.AttentionPattern.FUSE + A.AttentionPattern.KEEP if ex.name == name)


def _rewritten(code: str) -> tuple[dict, dict]:
    findings, _ = detect_all(A.AttentionPattern(), code)
    assert len(findings) == 1
    return _exec(code, "original"), {"code": splice(code, findings), "finding": findings[0]}


def _fused_calls(rewritten: str, call) -> tuple[int, object]:
    with emulate.install() as emu:
        ns = _exec(rewritten, "rewritten")
        before = sum(emu.calls.values())
        out = call(ns)
        return sum(emu.calls.values()) - before, out


def test_head_mask_step_runs_the_fused_call_only_without_a_head_mask():
    code = _example("s27_probabilities_step_under_a_flag_guarded")
    orig, r = _rewritten(code)
    assert "not (head_mask is not None)" in r["code"]
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    heads = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1)
    n_plain, out_plain = _fused_calls(r["code"], lambda ns: ns["SelfAttention"]()(q, k, v))
    n_masked, out_masked = _fused_calls(r["code"], lambda ns: ns["SelfAttention"]()(q, k, v, head_mask=heads))
    assert n_plain >= 1 and n_masked == 0
    ref = orig["SelfAttention"]()
    torch.testing.assert_close(out_plain, ref(q, k, v), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out_masked, ref(q, k, v, head_mask=heads), rtol=1e-4, atol=1e-5)
    assert out_masked[:, 1].abs().max() == 0  # the head mask zeroed head 1: the original code ran


def test_weights_under_a_flag_are_none_on_the_fused_branch_and_kept_by_the_original():
    code = _example("s27_folded_heads_mask_round_trip_in_its_branch_head_mask_and_weights_under_flags")
    orig, r = _rewritten(code)
    assert "shown = None" in r["code"] and "(not keep_weights)" in r["code"]
    torch.manual_seed(0)
    ref = orig["EncDecAttention"]().eval()
    x = torch.randn(2, 5, 32)
    pad = torch.zeros(2, 1, 5, 5)
    pad[0, ..., 4:] = torch.finfo(torch.float32).min

    def run(keep: bool):
        def call(ns):
            m = ns["EncDecAttention"]().eval()
            m.load_state_dict(ref.state_dict())
            return m(x, pad_bias=pad, keep_weights=keep)
        return call

    n_off, (out_off, w_off) = _fused_calls(r["code"], run(False))
    n_on, (out_on, w_on) = _fused_calls(r["code"], run(True))
    assert n_off >= 1 and w_off is None
    assert n_on == 0 and w_on is not None and w_on.shape == (2, 4, 5, 5)
    want, want_w = ref(x, pad_bias=pad, keep_weights=True)
    torch.testing.assert_close(out_off, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w_on, want_w)


def test_mask_round_trip_in_its_branch_expands_the_mask_over_the_folded_heads():
    code = _example("s27_folded_heads_mask_round_trip_in_its_branch_head_mask_and_weights_under_flags")
    _orig, r = _rewritten(code)
    # the [b, 1, sq, sk] mask meets [b*h, sq, sk] scores: expanded over the heads and folded like q
    assert "_npufuse_mask.expand(_npufuse_mask.shape[0], q.shape[0] // _npufuse_mask.shape[0]" in r["code"]
    assert "(pad_bias < 0)" in r["code"] and "pad_bias <= -1000.0" in r["code"]  # a graded bias runs the original


def test_views_back_in_the_branch_without_the_4d_view_stay_refused():
    code = _example("s27_folded_heads_mask_round_trip_in_its_branch_head_mask_and_weights_under_flags").replace(
        "w = w.view(b, self.heads, n, m) + pad_bias", "w = w + pad_bias")
    findings, misses = detect_all(A.AttentionPattern(), code)
    assert not findings and any("unsupported operation on the attention scores" in m.reason for m in misses)


def test_key_times_scale_reason_names_the_tensor_factor_not_the_key():
    code = _example("s27_key_times_scale_with_a_mask_from_the_key_size").replace(
        "k * scale)", "k * torch.exp(self.temp))").replace(
        "        self.drop = nn.Dropout(0.0)", "        self.drop = nn.Dropout(0.0)\n        self.temp = nn.Parameter(torch.zeros(()))")
    _findings, misses = detect_all(A.AttentionPattern(), code)
    reasons = " | ".join(m.reason for m in misses)
    assert "torch.exp(self.temp)" in reasons and "the factor `k`" not in reasons


def test_key_times_scale_fuses_with_the_squared_scale():
    code = _example("s27_key_times_scale_with_a_mask_from_the_key_size")
    _orig, r = _rewritten(code)
    # q keeps its own factor; the key's factor is the call's scale: scale * scale in all
    assert "_npufuse_q = q * scale" in r["code"] and "scale=scale," in r["code"]


def _matcher_for(src: str) -> tuple[A._Matcher, dict[str, ast.expr]]:
    from npufuse.scan.dataflow import ModuleInfo

    module = ModuleInfo.from_source("m.py", src)
    scope = next(s for s in module.scopes if s.qualname == "f")
    block = scope.node.body
    interp = A.BlockInterp(block)
    matcher = A._Matcher(module, scope, interp, block[0].lineno)
    env = interp.before[len(block) - 1]
    last = block[-1].value
    return matcher, {"left": interp.sym(last.left, env), "right": interp.sym(last.right, env)}


def test_scalar_valued_reads_numbers_through_locals():
    matcher, sides = _matcher_for(
        "import math\n"
        "def f(self, q, k):\n"
        "    s = 1.0 / math.sqrt(math.sqrt(self.width // self.heads)) * q.shape[-1] ** -0.5\n"
        "    return k * s\n")
    assert A._scalar_valued(matcher, sides["right"]) and not A._scalar_valued(matcher, sides["left"])
    matcher, sides = _matcher_for(
        "import torch\n"
        "def f(self, q, k):\n"
        "    s = torch.exp(self.t)\n"
        "    return k * s\n")
    assert not A._scalar_valued(matcher, sides["right"])
