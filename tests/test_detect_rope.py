"""RoPE spellings outside Hugging Face (issue 14, class 2): the shared canonical layer's halves and
lane pairs, and the rope detector's behaviour where the examples in patterns/rope.py cannot show it
(einops not installed, ranks the op rejects, TorchScript)."""

from __future__ import annotations

import ast
import sys
import types

import pytest
import torch

from npufuse.patterns.rope import RopePattern
from npufuse.scan import canonical
from npufuse.scan.dataflow import ModuleInfo, strip_casts
from pattern_harness import check_rewrite_runs, detect_all

PATTERN = RopePattern()


def _lane(body: str, name: str) -> canonical.Lane | None:
    m = ModuleInfo.from_source("m.py", "import torch\nfrom einops import rearrange\n\n\ndef f(x):\n" + body + "    return None\n")
    scope = next(s for s in m.scopes if s.qualname == "f")
    ret = scope.node.body[-1]  # type: ignore[attr-defined]
    return canonical.lane_of(m, scope, ast.Name(id=name, ctx=ast.Load(), lineno=ret.lineno, col_offset=4), ret.lineno)


@pytest.mark.parametrize("body,first,second,kind,spelling", [
    ("    a, b = x.unflatten(-1, (2, -1)).unbind(-2)\n", "a", "b", "halves", "unbind"),
    ("    a, b = x.view(*x.shape[:-1], 2, -1).unbind(dim=-2)\n", "a", "b", "halves", "unbind"),
    ("    a, b = rearrange(x, '... (j d) -> ... j d', j=2).unbind(dim=-2)\n", "a", "b", "halves", "unbind"),
    ("    a, b = x.chunk(2, dim=-1)\n", "a", "b", "halves", "chunk"),
    ("    a = x[..., ::2]\n    b = x[..., 1::2]\n", "a", "b", "pairs", "slice"),
    ("    a = x[..., 0::2]\n    b = x[..., 1::2]\n", "a", "b", "pairs", "slice"),
    ("    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)\n", "a", "b", "pairs", "unbind"),
    ("    a, b = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)\n", "a", "b", "pairs", "unbind"),
    # rotary-embedding-torch: the einops view bound to a name first, then unbound
    ("    y = rearrange(x, '... (d r) -> ... d r', r=2)\n    a, b = y.unbind(dim=-1)\n", "a", "b", "pairs", "unbind"),
    ("    p = x.unflatten(-1, (-1, 2)).unbind(-1)\n    a = p[0]\n    b = p[1]\n", "a", "b", "pairs", "unbind"),
    # OLMo: x's own unpacked dims, the last cut in two
    ("    B, nh, T, hs = x.size()\n    y = x.view(B, nh, T, 2, hs // 2)\n    a, b = y.unbind(dim=-2)\n", "a", "b", "halves", "unbind"),
    ("    B, T, hs = x.shape\n    a, b = x.reshape(B, T, hs // 2, 2).unbind(-1)\n", "a", "b", "pairs", "unbind"),
    # llama2.c: the sizes as one tuple built from x's leading dims
    ("    a, b = x.float().reshape(x.shape[:-1] + (-1, 2)).unbind(-1)\n", "a", "b", "pairs", "unbind"),
    ("    a, b = x.view((*x.shape[:-1], 2, -1)).unbind(-2)\n", "a", "b", "halves", "unbind"),
])
def test_lane_spellings_name_the_tensor_the_piece_and_the_kind(body, first, second, kind, spelling):
    for name, index in ((first, 0), (second, 1)):
        lane = _lane(body, name)
        assert lane is not None, (body, name)
        source = strip_casts(lane.source)[0]  # (x.float() is x's lanes, made fp32)
        assert isinstance(source, ast.Name) and source.id == "x"
        assert (lane.index, lane.kind, lane.spelling) == (index, kind, spelling)


@pytest.mark.parametrize("body", [
    # the 2-sized axis is not the one unbound: D/2 pieces, not two
    "    a, b = x.unflatten(-1, (2, -1)).unbind(-1)\n",
    "    a, b = x.unflatten(-1, (-1, 2)).unbind(-2)\n",
    # einops with the 2 on neither / both factors
    "    a, b = rearrange(x, '... (j d) -> ... j d').unbind(dim=-2)\n",
    "    a, b = rearrange(x, '... (j d) -> ... d j', j=2).unbind(dim=-2)\n",
    # a stride of 3, a slice of the first dim
    "    a = x[..., ::3]\n    b = x[..., 1::3]\n",
    "    a = x[::2]\n    b = x[1::2]\n",
    # dims of another tensor, or x's dims out of order
    "    B, nh, T, hs = z.size()\n    a, b = x.view(B, nh, T, 2, hs // 2).unbind(dim=-2)\n",
    "    B, nh, T, hs = x.size()\n    a, b = x.view(nh, B, T, 2, hs // 2).unbind(dim=-2)\n",
])
def test_non_lane_spellings_are_not_lanes(body):
    for name in ("a", "b"):
        lane = _lane(body, name)
        # none of these is read as halves / lanes of x
        assert lane is None or not (isinstance(lane.source, ast.Name) and lane.source.id == "x"), (body, name, lane)


def _fake_einops() -> types.ModuleType:
    """A stand-in for the two einops patterns the examples use (einops is not a dependency)."""
    mod = types.ModuleType("einops")

    def rearrange(t: torch.Tensor, pattern: str, **sizes: int) -> torch.Tensor:
        compact = pattern.replace(" ", "")
        if compact in ("...(dr)->...dr", "...(jd)->...jd"):
            inner = sizes.get("r", sizes.get("j"))
            return t.unflatten(-1, (-1, inner)) if "(dr)" in compact else t.unflatten(-1, (inner, -1))
        if compact == "...dr->...(dr)":
            return t.flatten(-2)
        raise NotImplementedError(pattern)

    mod.rearrange = rearrange  # type: ignore[attr-defined]
    return mod


@pytest.mark.parametrize("name,run", [
    ("einops_pairs_rotate_rebound", '''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
t = torch.randn(2, 4, 6, 16, requires_grad=True)
out = apply_rotary_emb(ang.repeat_interleave(2, dim=-1), t)
leaves = [t]
'''),
    ("palm_einops_rotate_half", '''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
pos = torch.cat((ang, ang), dim=-1)
t = torch.randn(2, 4, 6, 16, requires_grad=True)
out = apply_rotary_pos_emb(pos, t)
leaves = [t]
'''),
])
def test_einops_rotations_rewrite_to_the_same_numbers(name, run, monkeypatch):
    monkeypatch.setitem(sys.modules, "einops", _fake_einops())
    example = next(e for e in PATTERN.FUSE if e.name == name)
    findings, _ = detect_all(PATTERN, example.code)
    assert findings
    facts = check_rewrite_runs(PATTERN, example.code, run, findings)
    assert facts["calls"] >= 1, facts["all_calls"]
    assert all(a == b for a, b in facts["dtypes"]) and all(a == b for a, b in facts["shapes"])
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


_WRITTEN_OUT = '''
import torch


def apply_rotary(x, cos, sin):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
'''


def test_five_d_input_runs_the_original_code_not_a_call_the_op_rejects():
    """A 5-D x broadcasts in eager code; npu_rotary_mul takes 4-D only: the rank guard sends it to the
    original code (the emulator raises on any call the op rejects, so a wrong guard would fail here)."""
    findings, _ = detect_all(PATTERN, _WRITTEN_OUT)
    assert findings and "x.dim() <= 4" in findings[0].fused
    run = '''
ang = torch.arange(6).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
x = torch.randn(2, 3, 6, 4, 16, requires_grad=True)
out = apply_rotary(x, ang.cos()[:, None], ang.sin()[:, None])
leaves = [x]
'''
    facts = check_rewrite_runs(PATTERN, _WRITTEN_OUT, run, findings)
    assert facts["calls"] == 0
    assert min(facts["cos_out"]) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("shape,table", [((7, 16), "[:, :]"), ((7, 4, 16), "[:, None]"), ((2, 7, 4, 16), "[:, None]")])
def test_two_three_and_four_d_tokens_are_lifted_to_the_4d_call(shape, table):
    """[T, D], [T, N, D] and [B, T, N, D] x: lifted by leading 1s (the eager broadcast), fused, same numbers."""
    findings, _ = detect_all(PATTERN, _WRITTEN_OUT)
    run = f'''
ang = torch.arange(7).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
x = torch.randn{shape}.requires_grad_()
out = apply_rotary(x, ang.cos(){table}, ang.sin(){table})
leaves = [x]
'''
    facts = check_rewrite_runs(PATTERN, _WRITTEN_OUT, run, findings)
    assert facts["calls"] == 1
    assert facts["shapes"][0][0] == facts["shapes"][0][1] == shape
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_torchscript_compiled_rope_is_rewritten_at_module_level():
    """gpt-neox's ``@torch.jit.script`` apply_rotary_pos_emb: a fused branch inside it would not
    compile, so the whole definition is the site: the scripted original stays (renamed) as the
    fallback and a Python wrapper of the same name runs the fused op (tests/test_detect_ropeglu.py
    imports the rewritten file with and without torch_npu)."""
    code = '''
import torch


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=x1.ndim - 1)


@torch.jit.script
def apply_rotary_pos_emb(q, k, cos, sin, offset: int = 0):
    cos, sin = cos[offset : q.shape[0] + offset, ...], sin[offset : q.shape[0] + offset, ...]
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
'''
    findings, misses = detect_all(PATTERN, code)
    assert [(f.qualname, f.line, f.params["lifted_from"]) for f in findings] == [("<module>", 11, "apply_rotary_pos_emb")]
    assert "@torch.jit.script\ndef _npufuse_scripted_apply_rotary_pos_emb(" in findings[0].fused
    assert not misses


def test_flagged_helper_reports_the_path_it_does_not_fuse():
    example = next(e for e in PATTERN.FUSE if e.name == "helper_two_return_paths_one_verified")
    findings, _ = detect_all(PATTERN, example.code)
    assert findings[0].fused.startswith("if (not self.interleaved)")
    assert any("is not a rotation npu_rotary_mul computes" in n for n in findings[0].notes)


def test_rotation_matrix_form_states_its_producer_as_a_risk():
    example = next(e for e in PATTERN.FUSE if e.name == "lingua_rotation_matrix_summed")
    findings, _ = detect_all(PATTERN, example.code)
    risks = " | ".join(r.detail for r in findings[0].risks)
    assert "rotation built by `precompute_freqs_cis (line 10)`" in risks
    # the sum over dim 5 is the pair axis only for a 4-D x: checked at run time
    assert "5 == xq.dim() + 1" in findings[0].fused


def test_names_reused_for_the_key_do_not_hide_the_query_site():
    """o1/o2 are read again after the query's site, but only after the key binds them anew: both sites."""
    example = next(e for e in PATTERN.FUSE if e.name == "vllm_query_and_key_reuse_names")
    findings, _ = detect_all(PATTERN, example.code)
    sites = [f for f in findings if f.qualname == "forward_native"]
    assert len(sites) == 2
    assert all(f.fused.startswith("if (is_neox_style)") for f in sites)


def test_nested_helper_shadows_the_module_level_one():
    """A def inside the function is the binding its call sees: a correct module-level rotate_half does not
    make a wrong nested one a rotation, and a wrong module-level one does not hide a correct nested one."""
    right = "    def rotate_half(x):\n        x1, x2 = x.chunk(2, dim=-1)\n        return torch.cat((-x2, x1), dim=-1)\n"
    wrong = "    def rotate_half(x):\n        x1, x2 = x.chunk(2, dim=-1)\n        return torch.cat((x2, x1), dim=-1)\n"
    call = "    return q * cos + rotate_half(q) * sin\n"
    module_level = lambda body: "\n" + body.replace("\n    ", "\n").lstrip()  # noqa: E731

    def run(top: str, nested: str):
        return detect_all(PATTERN, "import torch\n" + module_level(top) + "\n\ndef apply(q, cos, sin):\n" + nested + call)

    findings, _ = run(wrong, right)
    assert findings and findings[0].params["mode"] == "half"
    findings, misses = run(right, wrong)
    assert not findings and any("not the standard cat(-x2, x1)" in m.reason for m in misses)


def test_lambda_rotation_becomes_a_local_function_and_other_lambdas_are_silent():
    code = (
        "import torch\n\n\ndef rotate_half(x):\n    x1, x2 = x.chunk(2, dim=-1)\n    return torch.cat((-x2, x1), dim=-1)\n\n\n"
        "def apply(q, k, cos, sin):\n    q, k = map(lambda t: t * cos + rotate_half(t) * sin, (q, k))\n"
        "    a, b = map(lambda t: t * 2 + t * 3, (q, k))\n    return q, k, a, b\n"
    )
    findings, misses = detect_all(PATTERN, code)
    assert [(f.line, f.guard_tensor) for f in findings] == [(10, "q")]
    assert findings[0].fused.startswith("def _npufuse_rope_10(t):")
    assert findings[0].fused.endswith("q, k = map(_npufuse_rope_10, (q, k))")
    assert not [m for m in misses if "lambda" in m.reason]
