"""s48 review48: correctness review of the s47 code.

1. rope's halves reader took a split point read from x's OWN shape under the run-time check
   ``x.shape[-1] == 2 * (h)``: for ``x.shape[-1] // 3`` the check is never true (a dead fused branch), for another
   dim of x (``b, s, n, d = x.shape`` then ``s // 2``) it holds only where two unrelated sizes meet. Now
   (``_rope_s48r.dead_own_split``) such a split point is accepted exactly where it is the half of x's last dim for
   every even width (``s, _, dim = x.shape[1:]`` then ``dim // 2``: s41's ``halves_empty_early`` stays a candidate;
   the inline ``cat((-x2, x1))`` reader, which refused any read of x's shape, takes that half too).
2. float64 reaching ``npu_rotary_mul`` (spec 4.1: fp16 / bf16 / fp32 only) through the rope forms that compute the
   eager dtype themselves: flux's per-pair matrix product with a float64 matrix (flux builds its rope in float64) and
   the gpt-fast / torchtune (cos, sin) pair caches in float64: the fused branch called the op on float64 (the
   emulator raises, as the op does). Now a run-time dtype test keeps the original code there.
"""

from __future__ import annotations

import pytest

from npufuse.patterns.rope import RopePattern
from pattern_harness import check_rewrite_runs, detect_all

ROPE = RopePattern()


# --- 1. halves cut at a split point read from x's own shape --------------------------------------------------------

_EXPLICIT = '''import torch


def rotate_pairs(t, cos, sin):
{split}
    a = t[..., :cut]
    b = t[..., cut:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
'''

_INLINE = '''import torch


def rotate_pairs(t, cos, sin):
{split}
    a = t[..., :cut]
    b = t[..., cut:]
    return t * cos + torch.cat((-b, a), dim=-1) * sin
'''

_RUN = '''
t = torch.randn(2, 3, 5, 8, requires_grad=True)
ang = torch.randn(1, 1, 5, 4)
if WIDE:
    ang = ang.repeat(1, 1, 1, 2)  # the inline form's full-width tables; the explicit form's are half-width
cos, sin = ang.cos(), ang.sin()
out = rotate_pairs(t, cos, sin)
leaves = [t]
'''

_DEAD = {
    "third_of_width": "    cut = t.shape[-1] // 3",
    "third_through_size": "    w = t.size(-1)\n    cut = w // 3",
    "half_plus_one": "    cut = t.shape[-1] // 2 + 1",
    "unpacked_sequence_dim": "    bsz, seq, heads, dim = t.shape\n    cut = seq // 2",
    "sliced_unpack_other_dim": "    seq, _, dim = t.shape[1:]\n    cut = seq // 2",
    "second_to_last_dim": "    cut = t.shape[-2] // 2",
}


@pytest.mark.parametrize("template", [_EXPLICIT, _INLINE], ids=["explicit", "inline"])
@pytest.mark.parametrize("split", list(_DEAD.values()), ids=list(_DEAD))
def test_a_split_point_from_xs_own_shape_other_than_its_half_is_no_candidate(template: str, split: str) -> None:
    # before: fused under ``t.shape[-1] == 2 * (cut)``, never true for a third (or half + 1) of the width, and for a
    # sequence dim true only where the sequence length equals the head width
    findings, _ = detect_all(ROPE, template.format(split=split))
    assert not findings, [f.fused for f in findings]


_HALF = {
    "sliced_unpack_last": "    seq, _, dim = t.shape[1:]\n    cut = dim // 2",
    "starred_unpack_last": "    *_, dim = t.shape\n    cut = dim // 2",
    "size_then_int_div": "    w = t.size(-1)\n    cut = int(w / 2)",
    "ceil_half": "    cut = (t.shape[-1] + 1) // 2",
    "shifted": "    cut = t.shape[-1] >> 1",
}


@pytest.mark.parametrize("template", [_EXPLICIT, _INLINE], ids=["explicit", "inline"])
@pytest.mark.parametrize("split", list(_HALF.values()), ids=list(_HALF))
def test_the_half_of_xs_last_dim_read_through_its_shape_still_fuses(template: str, split: str) -> None:
    # the twin: the last dim's half, spelled through unpacking / size / int division, runs the fused op
    code = template.format(split=split)
    findings, _ = detect_all(ROPE, code)
    assert len(findings) == 1, findings
    facts = check_rewrite_runs(ROPE, code, f"WIDE = {template is _INLINE}" + _RUN, findings)
    assert facts["all_calls"].get("npu_rotary_mul") == 1, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999


def test_a_split_point_from_elsewhere_keeps_its_run_time_check() -> None:
    # a head size handed in: the check decides at run time (true here: fused; the original where it is false)
    code = _EXPLICIT.replace("(t, cos, sin)", "(t, cos, sin, head_dim)").format(split="    cut = head_dim // 2")
    findings, _ = detect_all(ROPE, code)
    assert len(findings) == 1 and "t.shape[-1] == 2 * (cut)" in findings[0].fused
    facts = check_rewrite_runs(ROPE, code, "WIDE = False" + _RUN.replace("rotate_pairs(t, cos, sin)", "rotate_pairs(t, cos, sin, 8)"), findings)
    assert facts["all_calls"].get("npu_rotary_mul") == 1 and min(facts["cos_out"]) > 0.9999


# --- 2. float64 at the fused call ----------------------------------------------------------------------------------

_FLUX = '''
import torch


def pair_rotations(pos, dim, base=10000):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = pos.double()[..., None] * inv
    m = torch.stack([torch.cos(ang), -torch.sin(ang), torch.sin(ang), torch.cos(ang)], dim=-1)
    return m.view(*m.shape[:-1], 2, 2){tail}


def rotate(q, k, rot):
    q2 = q{qcast}.reshape(*q.shape[:-1], -1, 1, 2)
    k2 = k{qcast}.reshape(*k.shape[:-1], -1, 1, 2)
    qo = rot[..., 0] * q2[..., 0] + rot[..., 1] * q2[..., 1]
    ko = rot[..., 0] * k2[..., 0] + rot[..., 1] * k2[..., 1]
    return qo.reshape(*q.shape).type_as(q), ko.reshape(*k.shape).type_as(k)
'''
_FLUX_RUN = '''
q = torch.randn(2, 3, 6, 8, requires_grad=True)
k = torch.randn(2, 3, 6, 8, requires_grad=True)
rot = pair_rotations(torch.arange(6), 8)[None, None]
out = rotate(q, k, rot)
leaves = [q, k]
'''

_PAIRS = '''
import torch


def make_cache(n, dim, base=10000.0):
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = torch.outer(torch.arange(n, dtype=torch.float64), freqs)
    return torch.stack([ang.cos(), ang.sin()], dim=-1){tail}


def apply(x, cache):
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    cache = cache.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack([xs[..., 0] * cache[..., 0] - xs[..., 1] * cache[..., 1],
                       xs[..., 1] * cache[..., 0] + xs[..., 0] * cache[..., 1]], -1)
    return out.flatten(3).type_as(x)
'''
_PAIRS_RUN = '''
x = torch.randn(2, 6, 3, 8, requires_grad=True)
out = apply(x, make_cache(6, 8))
leaves = [x]
'''


@pytest.mark.parametrize("code, run, calls", [
    (_FLUX.replace("{qcast}", ".float()"), _FLUX_RUN, 2),
    (_FLUX.replace("{qcast}", ""), _FLUX_RUN, 2),
    (_PAIRS, _PAIRS_RUN, 1),
], ids=["flux_matrix_fp32_pairs", "flux_matrix_plain_pairs", "pair_cache"])
def test_a_float64_table_keeps_the_original_code_and_an_fp32_one_fuses(code: str, run: str, calls: int) -> None:
    # before: the float64 matrix / cache made the eager dtype float64 and the fused branch called npu_rotary_mul on
    # float64 tensors (the op takes fp16 / bf16 / fp32: the emulator raises, as the op does)
    fp64 = code.replace("{tail}", "")
    findings, _ = detect_all(ROPE, fp64)
    assert len(findings) == 1, findings
    facts = check_rewrite_runs(ROPE, fp64, run, findings)
    assert not facts["all_calls"].get("npu_rotary_mul"), facts["all_calls"]
    assert min(facts["cos_out"]) > 0.9999
    # the twin: the same tables cast to fp32 (flux's ``out.float()``) run the fused op and match
    fp32 = code.replace("{tail}", ".float()")
    findings, _ = detect_all(ROPE, fp32)
    facts = check_rewrite_runs(ROPE, fp32, run, findings)
    assert facts["all_calls"].get("npu_rotary_mul") == calls, facts["all_calls"]
    assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999


def test_float64_pairs_of_a_float32_matrix_keep_the_original_code() -> None:
    code = _FLUX.replace("{qcast}", ".double()").replace("{tail}", ".float()")
    findings, _ = detect_all(ROPE, code)
    assert len(findings) == 1
    assert "torch.promote_types(torch.float64, rot.dtype) in (torch.float16, torch.bfloat16, torch.float32)" in findings[0].fused
    facts = check_rewrite_runs(ROPE, code, _FLUX_RUN, findings)
    assert not facts["all_calls"].get("npu_rotary_mul") and min(facts["cos_out"]) > 0.9999


# --- 3b. a layer swapped by setattr / a tuple store: no rank stated ----------------------------------------------------

from npufuse.patterns.attention import AttentionPattern  # noqa: E402
from test_detect_s46_attention import _TEMPORAL  # noqa: E402

_SWAP = {
    "setattr": "    def set_proj(self, proj):\n        setattr(self, 'to_qkv', proj)\n\n    def forward(",
    "tuple_store": "    def set_proj(self, proj):\n        self.to_qkv, self.swapped = proj, True\n\n    def forward(",
    "setattr_computed_name": "    def set_layer(self, name, proj):\n        setattr(self, name, proj)\n\n    def forward(",
    "for_target": "    def cycle(self, projs):\n        for self.to_qkv in projs:\n            pass\n\n    def forward(",
}
_BIASED = _TEMPORAL.format(param=", pos_bias=None", bias="\n        if pos_bias is not None:\n            sim = sim + pos_bias")


@pytest.mark.parametrize("swap", list(_SWAP.values()), ids=list(_SWAP))
def test_a_layer_swapped_by_setattr_or_a_tuple_store_states_no_rank(swap: str) -> None:
    # before: the constructor's nn.Linear was read as what `self.to_qkv(x)` runs, so q was "5-D" (a near miss saying
    # so, of a layer another method may replace); now as for a plain swap (s46): the rank is checked at run time
    findings, misses = detect_all(AttentionPattern(), _BIASED.replace("    def forward(", swap))
    assert len(findings) == 1 and "q.dim() == 4" in findings[0].fused, [m.reason for m in misses]


def test_a_tuple_store_of_other_attributes_keeps_the_stated_rank() -> None:
    # the twin: a tuple store that does not touch `self.to_qkv` leaves its rank stated (5-D: the true near miss)
    findings, misses = detect_all(AttentionPattern(), _BIASED.replace("    def forward(", _SWAP["tuple_store"].replace("self.to_qkv,", "self.other,")))
    assert not findings and any("is 5-D" in m.reason for m in misses), [m.reason for m in misses]


# --- 3c. a shape name "bound once" counts for / with targets too (_rope_s46h) ------------------------------------------

from test_detect_s46_ho23 import _COMPLEX_SHAPE, _COMPLEX_SHAPE_RUN  # noqa: E402

_BOUND = "        pair_shape = x.shape[:-1] + (-1, 2)\n"


def test_a_shape_name_rebound_by_a_loop_target_is_not_read_as_the_pair_view() -> None:
    # before: `pair_shape` counted as bound once (assignments only), so the view was read as (-1, 2) pairs although the
    # loop leaves it (2, -1): the fused branch returned a value where the original raises (no pairs in the last dim)
    code = _COMPLEX_SHAPE.replace(_BOUND, _BOUND + "        for pair_shape in [x.shape[:-1] + (2, -1)]:\n            pass\n")
    findings, misses = detect_all(ROPE, code)
    assert not findings
    assert any("pairs are not formed by reshape(..., -1, 2)" in m.reason for m in misses), [m.reason for m in misses]


def test_a_loop_over_another_name_keeps_the_pair_view() -> None:
    code = _COMPLEX_SHAPE.replace(_BOUND, _BOUND + "        for other in [x.shape[:-1] + (2, -1)]:\n            pass\n")
    findings, _ = detect_all(ROPE, code)
    assert len(findings) == 1
    facts = check_rewrite_runs(ROPE, code, _COMPLEX_SHAPE_RUN, findings)
    assert facts["all_calls"].get("npu_rotary_mul") == 1 and min(facts["cos_out"]) > 0.9999


# --- 3d. a def replaced later in the same class body is no site ------------------------------------------------------

from pathlib import Path  # noqa: E402

from npufuse.scan.engine import scan_repo  # noqa: E402

_STALE = '''import functools
import torch
from torch import nn


class Norm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
{between}
    {deco}def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True).clamp_min(self.eps) * self.weight
'''


def _rms_sites(tmp_path: Path, between: str, deco: str = "") -> tuple[list[int], list[str]]:
    (tmp_path / "norm.py").write_text(_STALE.format(between=between, deco=deco))
    res = scan_repo(tmp_path, jobs=1, only=["rms_norm"])
    return [c["line"] for c in res.candidates], [n["reason"] for n in res.near_misses]


def test_a_forward_replaced_later_in_its_class_is_no_candidate(tmp_path: Path) -> None:
    # before: the first forward (an RMS norm) was a candidate of its own; Python binds the second def, so the fused
    # branch written into the first could never run
    lines, reasons = _rms_sites(tmp_path, "")
    assert lines == [], lines
    assert any("`Norm.forward` is defined again later in the same body (line 15)" in r for r in reasons), reasons


@pytest.mark.parametrize("between, deco", [
    ("\n    rms_forward = forward\n", ""),  # the first def kept under another name: it can run
    ("", "@functools.wraps(forward)\n    "),  # read by the later def's decorator (a property's setter reads so too)
], ids=["aliased_between", "read_by_a_later_decorator"])
def test_a_first_def_read_between_the_two_stays_a_site(tmp_path: Path, between: str, deco: str) -> None:
    lines, _ = _rms_sites(tmp_path, between, deco)
    assert lines == [13], lines


# --- 3e. a class name defined twice in a file is resolved by no name -------------------------------------------------

from npufuse.patterns.rms_norm import RmsNorm  # noqa: E402

_NORM_CLASS = '''
    class Norm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.eps = {eps}
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps) * self.weight
'''
_HEAD = "import torch\nfrom torch import nn\nPRECISE = False\n"
_NORM_RUN = "m = Norm(8)\nx = torch.randn(2, 5, 8, requires_grad=True) * 0.3\nout = m(x)\nleaves = [x]\n"


def _two(first: str, second: str) -> str:
    return _HEAD + first + _NORM_CLASS.format(eps="1e-8") + second + _NORM_CLASS.format(eps="0.5")


@pytest.mark.parametrize("code", [
    _two("\nif PRECISE:", "else:"),  # alternative definitions under a flag
    _two("\ntry:", "except ImportError:"),  # a fallback definition
    _HEAD + _NORM_CLASS.format(eps="1e-8").replace("\n    ", "\n")
    + "\n\ndef make_loose():" + _NORM_CLASS.format(eps="0.5") + "    return Norm\n",  # a class of that name in a function
], ids=["if_else", "try_except", "nested_in_a_function"])
def test_a_class_name_defined_twice_is_not_read_through_the_other_definition(code: str) -> None:
    # before: the eps = 0.5 class's forward read the first class's __init__ (eps 1e-8, tiny), so x / (rms + eps) was
    # fused as x * rsqrt(mean + eps^2): a wrong result (cos 0.9995 at rms 0.3); now no class is read by that name
    findings, misses = detect_all(RmsNorm(), code)
    assert not findings, [f.line for f in findings]
    assert any("eps outside the sqrt" in m.reason for m in misses), [m.reason for m in misses]


def test_one_definition_of_a_tiny_eps_class_still_fuses() -> None:
    code = _HEAD + _NORM_CLASS.format(eps="1e-8").replace("\n    ", "\n")
    findings, _ = detect_all(RmsNorm(), code)
    assert len(findings) == 1
    facts = check_rewrite_runs(RmsNorm(), code, _NORM_RUN, findings)
    assert facts["all_calls"].get("npu_rms_norm") == 1 and min(facts["cos_out"]) > 0.9999


# --- 4. cost: the names a method stores, read from its scope's node index ---------------------------------------------

import ast as _ast  # noqa: E402

from npufuse.scan._method_walk_s48r import stored_names  # noqa: E402
from npufuse.scan.bound_callee import _changes_in  # noqa: E402
from npufuse.scan.dataflow import ModuleInfo  # noqa: E402

_STORES = '''
class M:
    def a(self, other, v):
        self.p = v
        other.q = v
        del self.r
        self.s += 1
        self.t[0][1] = v
        del self.u[2]
        self.w.pop()
        self.x.clear()
        setattr(self, "y", v)
        delattr(self, "z")
        for self.loop in v:
            pass
        with v as self.ctx:
            pass
        self.n.m = v
        self.call()[0] = v
        setattr(self, name, v)

        def inner():
            self.nested = 1
        return lambda: setattr(self, "lam", 2)

    @staticmethod
    def b(x=None):
        x.k = 1
'''


def test_stored_names_read_from_the_scope_index_are_those_of_a_walk() -> None:
    module = ModuleInfo.from_source("m.py", _STORES)
    cls = module.classes["M"]
    for item in cls.body:
        walked = frozenset(attr for attr, _how, _line in _changes_in(item, how=False))
        assert stored_names(module, item) == walked, item.name
    assert {"p", "q", "r", "s", "t", "u", "w", "x", "y", "z", "loop", "ctx", "m", "nested", "lam"} <= stored_names(module, cls.body[0])
    # a function that is no scope of the file (a copy) is walked on its own
    copy = _ast.parse(_STORES).body[0].body[0]
    assert stored_names(module, copy) == frozenset(attr for attr, _how, _line in _changes_in(copy, how=False))
