"""s40 attention / sdpa / rope: ranks read through helper calls by dataflow (a helper's return rank given its
arguments' ranks), ..."""

from __future__ import annotations

import pytest
from pattern_harness import detect_all

from npufuse.patterns.attention import AttentionPattern


def _example(name: str) -> str:
    return next(e.code for e in AttentionPattern.FUSE + AttentionPattern.KEEP if e.name == name)


def test_three_d_heads_through_a_helper_method_checks_every_rank() -> None:
    (f,), misses = detect_all(AttentionPattern(), _example("s40_three_d_heads_through_a_helper_method"))
    assert f.fused.startswith("if (q.dim() == 3 and k.dim() == 3 and (v.dim() == 3)):"), f.fused
    assert not misses


@pytest.mark.parametrize("name, reason", [
    ("s40_helper_returns_a_four_d_key", "not the last two of the 4-D key"),
    ("s40_helper_returns_ranks_that_differ", "the code does not show the key's rank"),
])
def test_helper_return_rank_near_misses(name: str, reason: str) -> None:
    found, misses = detect_all(AttentionPattern(), _example(name))
    assert not found
    assert any(reason in m.reason for m in misses), [m.reason for m in misses]


def test_mask_from_a_helper_method_is_bound_once() -> None:
    (f,), misses = detect_all(AttentionPattern(), _example("s40_mask_from_a_helper_method_bound_once"))
    # one per arm of the bound conditional (one runs), one in the original code of the else branch
    assert f.fused.count("self._sliding_window_mask(") == 3
    assert "_npufuse_mask = (_npufuse_term_0) if _npufuse_term_0 is not None else None" in f.fused
    assert not misses


def test_calls_in_the_arms_of_a_conditional_expression_count_once() -> None:
    import ast

    from npufuse.patterns.base import _module_calls_in

    assert _module_calls_in(ast.parse("((self.f(x) if a else self.f(x)) if b else self.f(x))")) == {"self.f(x)": 1}
    assert _module_calls_in(ast.parse("self.f(x) if self.f(x) is not None else None")) == {"self.f(x)": 2}
    assert _module_calls_in(ast.parse("self.f(x) + (self.f(x) if c else 0)")) == {"self.f(x)": 2}


def test_a_method_called_twice_is_not_called_a_module_with_dropout() -> None:
    from npufuse.patterns.base import _is_class_method_call
    from npufuse.scan.dataflow import ModuleInfo

    module = ModuleInfo.from_source("m.py", "class A:\n    def mask(self, n):\n        return n\n    def forward(self, x):\n        return x\n")
    assert _is_class_method_call(module, "A.forward", "self.mask(L)")
    assert not _is_class_method_call(module, "A.forward", "self.drop(L)")


def test_optional_mask_with_is_causal_runs_fused_where_the_mask_is_none() -> None:
    from npufuse.patterns.sdpa import SdpaPattern

    code = next(e.code for e in SdpaPattern.FUSE if e.name == "s40_optional_mask_with_is_causal")
    (f,), misses = detect_all(SdpaPattern(), code)
    assert f.fused.startswith("if attention_mask is None and "), f.fused
    assert "sparse_mode=2" in f.fused and "atten_mask=_npufuse_mask," not in f.fused
    assert not misses


def _named_axes_einops():
    """A stand-in for the two einops patterns of the named-axes rope example (einops is not a dependency)."""
    import types

    mod = types.ModuleType("einops")

    def rearrange(t, pattern: str, **sizes: int):
        compact = pattern.replace(" ", "")
        if compact == "bhn(dsplit)->splitbhnd":
            return t.unflatten(-1, (-1, sizes["split"])).movedim(-1, 0)
        if compact == "bhndsplit->bhn(dsplit)":
            return t.flatten(-2)
        if compact == "bhndsplit->bhn(splitd)":
            return t.transpose(-1, -2).flatten(-2)
        raise NotImplementedError(pattern)

    mod.rearrange = rearrange  # type: ignore[attr-defined]
    return mod


def test_einops_named_axes_interleaved_rope_rewrites_to_the_same_numbers(monkeypatch) -> None:
    import sys

    from pattern_harness import check_rewrite_runs

    from npufuse.patterns.rope import RopePattern

    monkeypatch.setitem(sys.modules, "einops", _named_axes_einops())
    pattern = RopePattern()
    code = next(e.code for e in RopePattern.FUSE if e.name == "s40_einops_named_axes_real_imag")
    findings, _ = detect_all(pattern, code)
    assert len(findings) == 1 and 'rotary_mode="interleave"' in findings[0].fused
    run = '''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
q = torch.randn(2, 4, 6, 16, requires_grad=True)
out = apply_rope(q, ang.cos(), ang.sin())
leaves = [q]
'''
    facts = check_rewrite_runs(pattern, code, run, findings)
    assert facts["calls"] >= 1, facts["all_calls"]
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_einops_last_two_axes_merge_is_read_by_its_axes() -> None:
    import ast

    from npufuse.patterns.rope import _einops_last_two_merged

    def merged(pattern: str):
        return _einops_last_two_merged(ast.parse(f"rearrange(t, '{pattern}', split=2)", mode="eval").body)

    assert merged("b h n d split -> b h n (d split)") is not None
    assert merged("... d split -> ... (d split)") is not None
    assert merged("b h n d split -> b h n (split d)") is None  # the other order: halves, not the pairs
    assert merged("b h n d split -> b n h (d split)") is None  # a transpose besides the merge
    assert merged("b h (n d) split -> b h n (d split)") is None


# --- torchtune's RotaryPositionalEmbeddings swapped where built (the stand-in spells v0.6.1's forward exactly: the
# swap compares the forward's code names with the ones read at the release tags) ---
import torch  # noqa: E402
from torch import nn  # noqa: E402


class _TorchtuneRope(nn.Module):
    """torchtune.modules.position_embeddings.RotaryPositionalEmbeddings (v0.2.0 .. v0.6.1, main)."""

    def __init__(self, dim: int, max_seq_len: int = 4096, base: int = 10_000) -> None:
        super().__init__()
        self.dim, self.base, self.max_seq_len = dim, base, max_seq_len
        theta = 1.0 / (self.base ** (torch.arange(0, self.dim, 2)[: (self.dim // 2)].float() / self.dim))
        self.register_buffer("theta", theta, persistent=False)
        seq_idx = torch.arange(max_seq_len, dtype=self.theta.dtype, device=self.theta.device)
        idx_theta = torch.einsum("i, j -> ij", seq_idx, self.theta).float()
        cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
        self.register_buffer("cache", cache, persistent=False)

    def forward(self, x: torch.Tensor, *, input_pos=None) -> torch.Tensor:
        seq_len = x.size(1)
        rope_cache = (
            self.cache[:seq_len] if input_pos is None else self.cache[input_pos]
        )
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
        x_out = torch.stack(
            [
                xshaped[..., 0] * rope_cache[..., 0]
                - xshaped[..., 1] * rope_cache[..., 1],
                xshaped[..., 1] * rope_cache[..., 0]
                + xshaped[..., 0] * rope_cache[..., 1],
            ],
            -1,
        )
        x_out = x_out.flatten(3)
        return x_out.type_as(x)


class _TorchtuneRopeOtherwise(_TorchtuneRope):
    """A forward no release has (the halves, not the lane pairs): the swap must leave it alone."""

    def forward(self, x: torch.Tensor, *, input_pos=None) -> torch.Tensor:
        return super().forward(x.flip(-1), input_pos=input_pos)


_ROPE_MODEL = '''\
import torch
from torch import nn
from torchtune.modules import RotaryPositionalEmbeddings


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qk = nn.Linear(d, 2 * d)
        self.pos_emb = RotaryPositionalEmbeddings(d // heads, 64)

    def forward(self, x, input_pos=None):
        b, s, _ = x.shape
        q, k = self.qk(x).view(b, s, 2, self.heads, -1).unbind(2)
        return self.pos_emb(q, input_pos=input_pos), self.pos_emb(k)
'''


def _run_rope(code: str, x: torch.Tensor, input_pos=None):
    from npufuse import emulate

    ns: dict = {}
    with emulate.install() as emu:
        exec(compile(code, "<model>", "exec"), ns)
        torch.manual_seed(0)
        attn = ns["Attention"](32, 4).to(x.dtype)  # (the cache buffer too, as a model cast does)
        with torch.no_grad():
            out = attn(x, input_pos)
        return out, dict(emu.calls)


def test_torchtune_rope_is_swapped_where_built_and_computes_the_same(monkeypatch) -> None:
    from pattern_harness import install_stand_in_modules

    from npufuse.patterns.rope import RopePattern
    from npufuse.rewrite.codegen import splice

    findings, misses = detect_all(RopePattern(), _ROPE_MODEL)
    assert [(f.line, f.variant, f.params["module"]) for f in findings] == [(11, "library_rope", "torchtune.RotaryPositionalEmbeddings")]
    swapped = splice(_ROPE_MODEL, findings)
    for cls, fused_calls in ((_TorchtuneRope, 2), (_TorchtuneRopeOtherwise, 0)):
        cls.__module__, cls.__name__ = "torchtune.modules.position_embeddings", "RotaryPositionalEmbeddings"
        install_stand_in_modules(monkeypatch, {"torchtune.modules": {"RotaryPositionalEmbeddings": cls}})
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(2, 5, 32, dtype=dtype)
            ref, _ = _run_rope(_ROPE_MODEL, x)
            out, calls = _run_rope(swapped, x)
            assert all(o.dtype == r.dtype for o, r in zip(out, ref))
            for o, r in zip(out, ref):
                torch.testing.assert_close(o.float(), r.float(), atol=2e-2, rtol=2e-2)
            assert calls.get("npu_rotary_mul", 0) == fused_calls, (cls, calls)
    # with input_pos (decoding from a cache) the library's forward runs for that call
    _TorchtuneRope.__module__ = "torchtune.modules.position_embeddings"
    install_stand_in_modules(monkeypatch, {"torchtune.modules": {"RotaryPositionalEmbeddings": _TorchtuneRope}})
    x = torch.randn(1, 5, 32)
    pos = torch.arange(3, 8)[None]
    ref, _ = _run_rope(_ROPE_MODEL, x, pos)
    out, calls = _run_rope(swapped, x, pos)
    torch.testing.assert_close(out, ref)
    assert calls.get("npu_rotary_mul", 0) == 1, calls


def test_a_rope_class_of_the_repository_named_like_torchtunes_is_not_swapped() -> None:
    from npufuse.patterns.rope import RopePattern

    local = _ROPE_MODEL.replace("from torchtune.modules import RotaryPositionalEmbeddings\n",
                                "\n\nclass RotaryPositionalEmbeddings(nn.Module):\n    def forward(self, x):\n        return x\n")
    findings, misses = detect_all(RopePattern(), local)
    assert not findings and not misses


def test_mla_rope_key_shared_by_the_heads_is_expanded_under_a_shape_guard() -> None:
    (f,), misses = detect_all(AttentionPattern(), _example("s40_mla_rope_key_shared_by_the_heads"))
    assert "k_r.expand(*torch.broadcast_shapes(k_c.shape[:-1], k_r.shape[:-1]), -1)" in f.fused
    assert "(k_c.shape[-3] == k_r.shape[-3] or k_c.shape[-3] == 1 or k_r.shape[-3] == 1)" in f.fused.splitlines()[0]
    assert not misses


def test_an_if_folded_into_the_inputs_may_update_a_local_in_place_but_not_a_parameter() -> None:
    import ast

    from npufuse.patterns._attention_s40 import effect_in_folded_if
    from npufuse.scan.dataflow import ModuleInfo

    code = '''
def f(self, q, k, mask, cache):
    scores = q @ k.transpose(-2, -1)
    if self.causal:
        scores.masked_fill_(mask, float("-inf"))
    if self.causal:
        cache.masked_fill_(mask, 0.0)
    return scores
'''
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "f")
    first, second = [st for st in scope.node.body if isinstance(st, ast.If)]
    assert effect_in_folded_if(first, scope) is None  # amago: the scores it computed
    assert "cache.masked_fill_(mask, 0.0)" in effect_in_folded_if(second, scope)  # the caller's tensor
