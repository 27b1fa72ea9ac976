"""s45 review45: correctness review of the code that landed in s44 (b237412..e9bef57). Each defect is pinned by a test
that fails on the s44 code, with a twin that passes on both (the form the s44 class was built for still fuses).

1. add_rms_norm: a norm class whose forward is ``return F.rms_norm(x, ..)`` (or s44's ``.to(input_dtype)`` cast back)
   was read as the library norm of its input even where a statement before the return changed the input
   (``x = x + self.bias``): the fused add + norm left the statement out (emulator cos 0.97).
2. moe_experts (defects44's id proof): an ``__init__`` parameter rebound there (``n = n - 1`` after the gate was
   built over ``n``), or an attribute another method changes, was taken as one value: top-k over a gate wider than
   the loop was "proven" in range and its ids past the loop were combined (emulator cos 0.89).
3. add_rms_norm (ho21fix44's registry-built norms): the registered classes were memoised by (root, factory) for the
   process: a second scan of the same root after an edit read the first scan's registrations.
4. double_backward_reach (ho21fix44): a use narrowed to its import closure although the closure could not be known:
   ``import torch as th; th.load(..)`` / ``from torch import load`` (a pickled model), an import of a repository module
   the scan does not list (``tests/``), a file of the closure not read (over the size limit): the model's sites were
   fused where a hessian differentiates them.
5. moe_experts scattered membership (moe44a): ``M.scatter_(1, idx, c)`` read as membership for any non-zero c;
   with c = -1 ``M[:, e] > 0`` holds for no row (the loop skips every expert, the fused layer ran them all), and
   a fraction scattered into an integer matrix truncates to 0.
6. ``const_value(..) is Ellipsis`` taken as "the index is ``...``": ``...`` is also const_value's answer for any
   non-literal. attention (attn44) read ``p.masked_fill(~keep[:, None], 0)`` ([B, 1, S]: a mask over the KEYS) as
   query rows zeroed (the fused output was masked instead: raises or differs) and ``w[:1, :-1]`` as the sink column
   dropped; moe_experts read ``W[e, 1:]`` as ``W[e, ...]`` (the whole expert weight; pre-s44, same class) and s44b's
   row-wise activation ``x[i, ::2]`` as a last-dim slice.
7. sdpa (review44's in-place check of a ``zeros(..).masked_fill(m, -inf)`` base): only element stores and in-place
   methods on the name were seen; a helper adding into it (``add_into(bias, alibi)``), an alias changed in place and
   ``torch.add(bias, x, out=bias)`` still passed as a 0/-inf mask (emulator cos 0.87).
8. bound_callee's per-class attribute table skipped tuple stores (``self.norm, self.kind = nn.LayerNorm(d), "ln"`` in
   another method): the norm looked assigned once, and add_rms_norm's fused code ran on the LayerNorm without a type
   test. One node-level reader (``bound_callee.self_attribute_stores``) now feeds both it and affinity_where; and
   (pre-s44, same class) a second store add_rms_norm's choice reading cannot resolve (``getattr(nn, name)(d)``) left
   the RMSNorm reading fused with no class test: a near miss now.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from apply_support import make_repo, scan
from pattern_harness import check_rewrite_runs, detect_all
from npufuse.patterns._moe_s42b import _HEAD, _run
from npufuse.patterns.moe_experts import MoeExperts
from test_detect_s44_defects import _close
from test_detect_s44_ho21 import _fused_against_eager


# -- 1. add_rms_norm: the library norm's forward changes its input before F.rms_norm -----------------------------------

_LIB_NORM_BLOCK = '''\
import torch
import torch.nn.functional as F
from torch import nn


class Norm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.eps = 1e-5
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        input_dtype = x.dtype
        PRELUDE
        return RETURN


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.post = Norm(d)
        self.mlp = nn.Linear(d, d)

    def forward(self, x):
        h = x + self.attn(x)
        y = self.post(h)
        return self.mlp(y) + h
'''
_RMS = "F.rms_norm(x, self.weight.shape, self.weight, self.eps)"


def _add_patterns() -> tuple[Any, ...]:
    from npufuse.patterns.add_rms_norm import AddRmsNorm

    return (AddRmsNorm(),)


def _block_run(mod: Any) -> list[Any]:
    import torch

    torch.manual_seed(0)
    m = mod.Block(16)
    with torch.no_grad():
        m.post.weight.add_(0.1 * torch.randn(16))
        m.post.bias.add_(torch.randn(16))
        return [m(torch.randn(2, 3, 16))]


@pytest.mark.parametrize("prelude", ["x = x + self.bias", "x[..., :1] = 0.0", "x += self.bias"])
@pytest.mark.parametrize("ret", [_RMS, _RMS + ".to(input_dtype)"], ids=["rms_norm", "rms_norm_cast_back"])
def test_library_norm_whose_forward_changes_its_input_first_is_not_read_as_that_norm(tmp_path: Path, prelude: str,
                                                                                    ret: str) -> None:
    code = _LIB_NORM_BLOCK.replace("PRELUDE", prelude).replace("RETURN", ret)
    data = scan(make_repo(tmp_path / "s", {"pkg/__init__.py": "", "pkg/m.py": code}), patterns=_add_patterns())
    # the norm class's own add (`x + self.bias` then the norm) may fuse; the block's add must not
    assert not [c for c in data["candidates"] if c["qualname"] == "Block.forward"], data["candidates"]
    if "=" in prelude and "+" in prelude:
        _fused_against_eager(tmp_path, {"pkg/__init__.py": "", "pkg/m.py": code}, "pkg.m", _add_patterns(), _block_run)


@pytest.mark.parametrize("ret", [_RMS, _RMS + ".to(input_dtype)"], ids=["rms_norm", "rms_norm_cast_back"])
def test_library_norm_after_a_dtype_read_still_fuses_the_residual_add(tmp_path: Path, ret: str) -> None:
    code = _LIB_NORM_BLOCK.replace("PRELUDE", "shape = x.shape").replace("RETURN", ret)
    files = {"pkg/__init__.py": "", "pkg/m.py": code}
    calls = _fused_against_eager(tmp_path, files, "pkg.m", _add_patterns(), _block_run)
    assert calls.get("npu_add_rms_norm", 0) == 1, calls


# -- 2. moe_experts: the loop's bound and the gate's width read as one value where they are not ------------------------

_MOE = _HEAD + '''

class MoE(nn.Module):
    def __init__(self, d, h, n, k):
        super().__init__()
        self.gate = nn.Linear(d, n, bias=False)
        INIT
        self.n, self.k = n, k
        self.experts = nn.ModuleList([FF(d, h) for _ in range(n)])

    def forward(self, x):
        w, sel = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.n):
            tok, slot = torch.where(sel == e)
            out[tok] += w[tok, slot, None] * self.experts[e](x[tok])
        return out
METHODS'''


def _moe_code(init: str = "pass", methods: str = "") -> str:
    return _MOE.replace("INIT", init).replace("METHODS", methods)


_SHRINK = '''
    def drop_last_expert(self):
        del self.experts[-1]
        self.n = self.n - 1
'''


@pytest.mark.parametrize("code, run", [
    (_moe_code("n = n - 1"), _run("9, 16")),  # the gate has n outputs, the loop runs n - 1 experts
    (_moe_code(methods=_SHRINK), _run("9, 16", extra="m.drop_last_expert()\n")),
], ids=["init_parameter_rebound", "attribute_changed_by_another_method"])
def test_gate_width_and_loop_bound_that_are_not_one_value_get_the_run_time_id_mask(code: str, run: str) -> None:
    findings, misses = detect_all(MoeExperts(), code)
    assert findings, [m.reason for m in misses]
    assert "_npufuse_named" in findings[0].fused
    _close(check_rewrite_runs(MoeExperts(), code, run, findings))


def test_gate_width_equal_to_the_loop_bound_needs_no_mask() -> None:
    # twin: `n` is only read in __init__ (the gate and the experts have the same n): proven, no mask
    code = _moe_code("d = d + 0")
    findings, misses = detect_all(MoeExperts(), code)
    assert findings and "_npufuse_named" not in findings[0].fused, [m.reason for m in misses]
    _close(check_rewrite_runs(MoeExperts(), code, _run("9, 16"), findings))


# -- 3. registry-built norms: a later scan of the same root reads the registrations as they are then ------------------

_SECOND_RMS = """

@Factory.register("norm", "other")
class OtherNorm(nn.Module):
    def __init__(self, config, dim):
        super().__init__()
        self.eps = 1e-6
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
"""


def test_registered_norms_are_read_again_by_a_later_scan_of_the_same_root(tmp_path: Path) -> None:
    from test_detect_s44_ho21 import _NORMS, _registry_files

    root = make_repo(tmp_path, _registry_files())
    first = [c for c in scan(root, patterns=_add_patterns())["candidates"] if c["pattern"] == "add_rms_norm"]
    assert len(first) == 1  # one registered class reads as an RMSNorm: fused under its type test
    (root / "pkg" / "norms.py").write_text(_NORMS + _SECOND_RMS)
    second = [c for c in scan(root, patterns=_add_patterns())["candidates"] if c["pattern"] == "add_rms_norm"]
    assert second == [], "two registered classes read as an RMSNorm now: each would need its own fused code"


# -- 4. double-backward reach: a closure that cannot be known reaches every file ---------------------------------------

_HESSIAN_OF = """\
import torch
IMPORTS
from torch.autograd.functional import hessian

net = BUILD
H = hessian(lambda x: net(x).sum(), torch.randn(4))
"""


@pytest.mark.parametrize("imports, build, extra, why", [
    ("import torch as th", 'th.load("model.pt", weights_only=False)', {}, "torch.load through an alias unpickles a model"),
    ("from torch import load", 'load("model.pt", weights_only=False)', {}, "torch.load imported by name"),
    ("from tests.helpers import build", "build()",
     {"tests/__init__.py": "", "tests/helpers.py": "from pkg.model import MLP\n\n\ndef build():\n    return MLP(4, 8)\n"},
     "a module of a folder the scan skips (tests/) imports the model"),
    ("from scripts.big import build", "build()",
     {"scripts/__init__.py": "", "scripts/big.py": "from pkg.model import MLP\n\n\ndef build():\n    return MLP(4, 8)\n"
      + "# padding\n" * 3000},
     "a file of the closure over the read limit: what it imports is unknown"),
])
def test_double_backward_whose_closure_cannot_be_known_still_blocks(tmp_path: Path, monkeypatch: Any, imports: str,
                                                                    build: str, extra: dict[str, str], why: str) -> None:
    from npufuse.scan import repo_symbols
    from test_detect_s44_ho21 import _MODEL, _PATTERNS, _blocked, _model_sites

    monkeypatch.setattr(repo_symbols, "DEFAULT_MAX_BYTES", 16 << 10)
    monkeypatch.setattr(repo_symbols.RepoSymbols.__init__, "__defaults__", (16 << 10, repo_symbols.DEFAULT_MAX_PARSES))
    files = {"pkg/__init__.py": "", "pkg/model.py": _MODEL,
             "scripts/05_curvature.py": _HESSIAN_OF.replace("IMPORTS", imports).replace("BUILD", build), **extra}
    data = scan(make_repo(tmp_path, files), patterns=_PATTERNS)
    assert _model_sites(data) == [], why
    assert len(_blocked(data)) == 2, data["near_misses"]


def test_double_backward_of_a_toy_function_beside_an_aliased_torch_still_does_not_block(tmp_path: Path) -> None:
    # twin: the alias alone (no load) leaves the narrowing as it was
    from test_detect_s44_ho21 import _MODEL, _PATTERNS, _blocked, _model_sites

    body = "import torch as th\nfrom torch.autograd.functional import hessian\n\nH = hessian(lambda x: (x ** 3).sum(), th.randn(2))\n"
    data = scan(make_repo(tmp_path, {"pkg/__init__.py": "", "pkg/model.py": _MODEL, "scripts/05_toy.py": body}),
                patterns=_PATTERNS)
    assert _model_sites(data) == ["rms_norm", "swiglu"] and not _blocked(data)


# -- 5. scattered membership: only a constant the matrix holds as a positive value ------------------------------------

_S44A_GT = "expert_mask[:, e] > 0"


@pytest.mark.parametrize("scatter, zeros, why", [
    ("expert_mask.scatter_(1, top_idx, -1.0)", "torch.zeros(x.size(0), self.n, device=x.device)",
     "a negative constant: `M[:, e] > 0` holds for no row, the loop runs no expert"),
    ("expert_mask.scatter_(1, top_idx, 0.5)", "torch.zeros(x.size(0), self.n, dtype=torch.long, device=x.device)",
     "0.5 scattered into an integer matrix is 0: no row is a member"),
])
def test_scattered_constant_that_is_not_a_positive_member_is_kept(scatter: str, zeros: str, why: str) -> None:
    from npufuse.patterns._moe_s44a import _SCATTER, SCATTERED

    code = SCATTERED.replace(_SCATTER, f"        {scatter}\n").replace("expert_mask[:, e].bool()", _S44A_GT) \
        .replace("torch.zeros(x.size(0), self.n, device=x.device)", zeros)
    findings, misses = detect_all(MoeExperts(), code)
    assert not findings, why
    assert any("skips experts without rows of `token_mask`" in m.reason for m in misses), [m.reason for m in misses]


def test_scattered_one_into_a_bool_matrix_read_as_positive_still_fuses() -> None:
    from npufuse.patterns._moe_s44a import SCATTERED, SCATTERED_RUN

    code = SCATTERED.replace("expert_mask[:, e].bool()", _S44A_GT).replace(
        "torch.zeros(x.size(0), self.n, device=x.device)", "torch.zeros(x.size(0), self.n, dtype=torch.bool, device=x.device)"
    ).replace("top_idx, 1.0)", "top_idx, 1)")
    findings, misses = detect_all(MoeExperts(), code)
    assert findings, [m.reason for m in misses]
    _close(check_rewrite_runs(MoeExperts(), code, SCATTERED_RUN, findings))


# -- 6. the literal ellipsis, not const_value's "not a literal" ---------------------------------------------------------

_ZEROED = """
import torch


def attend(q, k, v, keep):
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = s.softmax(dim=-1)
    p = p.masked_fill(ROWS, 0)
    return torch.matmul(p, v)
"""
_RUN_ZEROED = """
q, k, v = (torch.randn(2, 3, 5, 8, requires_grad=True) for _ in range(3))
keep = torch.ones(2, 5, dtype=torch.bool)
keep[0, 3:] = False
out = attend(q, k, v, keep)
leaves = [q, k, v]
"""


def _attention() -> Any:
    from npufuse.patterns.attention import AttentionPattern

    return AttentionPattern()


@pytest.mark.parametrize("rows", ["~keep[:, None]", "~keep[0:2, None]"])
def test_a_mask_over_the_keys_after_the_softmax_is_not_read_as_zeroed_query_rows(rows: str) -> None:
    # keep[:, None] of a [B, S] mask is [B, 1, S]: against [B, N, S, S] probabilities it zeroes key COLUMNS
    findings, misses = detect_all(_attention(), _ZEROED.replace("ROWS", rows))
    assert not findings, findings[0].fused
    assert any("modified after softmax" in m.reason for m in misses), [m.reason for m in misses]


@pytest.mark.parametrize("rows", ["~keep[:, None, :, None]", "~keep[:, None, :].unsqueeze(-1)"])
def test_query_rows_zeroed_through_a_spelled_index_still_fuse(rows: str) -> None:
    code = _ZEROED.replace("ROWS", rows)
    findings, misses = detect_all(_attention(), code)
    assert findings, [m.reason for m in misses]
    _close(check_rewrite_runs(_attention(), code, _RUN_ZEROED, findings))


def test_sink_column_dropped_with_a_batch_slice_is_not_the_sink_argument() -> None:
    from test_detect_s44_attention import _INDEXED_SINKS

    code = _INDEXED_SINKS.replace("w[..., :-1]", "w[:1, :-1]")
    findings, _ = detect_all(_attention(), code)
    assert not any("sink=" in f.fused for f in findings), "the slice also keeps batch 0 only: not the sink column dropped"


def test_expert_weight_sliced_after_the_expert_index_is_not_the_whole_weight() -> None:
    from npufuse.patterns import _moe_s44b as B

    code = B.BIASED_MATMUL_ADD.replace("self.w1 = nn.Parameter(torch.randn(n, d, h) * 0.1)",
                                       "self.w1 = nn.Parameter(torch.randn(n, d + 1, h) * 0.1)") \
        .replace("x[rows] @ self.w1[e] + self.b1[e]", "x[rows] @ self.w1[e, 1:] + self.b1[e]")
    findings, misses = detect_all(MoeExperts(), code)
    assert not findings, "W[e, 1:] is rows 1.. of the expert's weight, not W[e]"
    assert any("is not shown to be a stacked parameter" in m.reason for m in misses), [m.reason for m in misses]


def test_expert_weight_with_a_literal_ellipsis_is_still_the_expert_weight() -> None:
    from npufuse.patterns import _moe_s44b as B

    code = B.BIASED_MATMUL_ADD.replace("x[rows] @ self.w1[e] + self.b1[e]", "x[rows] @ self.w1[e, ...] + self.b1[e]")
    findings, misses = detect_all(MoeExperts(), code)
    assert findings, [m.reason for m in misses]
    _close(check_rewrite_runs(MoeExperts(), code, B.BIASED_MATMUL_ADD_RUN, findings))


def test_activation_module_indexing_rows_is_not_row_wise() -> None:
    from npufuse.patterns import _moe_s44b as B

    code = B.BIASED_GPT_OSS.replace("x_gate = x[..., ::2]", "x_gate = x[self.first, ::2]").replace(
        "        self.limit = limit\n", "        self.limit = limit\n        self.first = 0\n")
    findings, misses = detect_all(MoeExperts(), code)
    assert not findings, "x[self.first, ::2] picks one row for every row: not row-wise"


# -- 7. sdpa: a zeros base read by anything between its allocation and the fill is not known to hold zeros -------------

_SDPA_BIAS = """
import torch
import torch.nn.functional as F


def add_into(t, x):
    t.add_(x)


def f(q, k, v, alibi, m):
    bias = torch.zeros(q.shape[0], 1, q.shape[2], k.shape[2])
    CHANGE
    bias = bias.masked_fill(m, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
"""
_RUN_SDPA_BIAS = """
q, k, v = (torch.randn(2, 4, 6, 8, requires_grad=True) for _ in range(3))
alibi = torch.randn(2, 1, 6, 6)
m = torch.zeros(6, 6, dtype=torch.bool).triu(1)
out = f(q, k, v, alibi, m)
leaves = [q, k, v]
"""


@pytest.mark.parametrize("change", ["add_into(bias, alibi)", "b2 = bias\n    b2.add_(alibi)",
                                    "torch.add(bias, alibi, out=bias)"])
def test_sdpa_zeros_base_changed_through_another_name_is_checked_at_run_time(change: str) -> None:
    from npufuse.patterns.sdpa import SdpaPattern

    code = _SDPA_BIAS.replace("CHANGE", change)
    findings, misses = detect_all(SdpaPattern(), code)
    assert findings, [m.reason for m in misses]
    facts = check_rewrite_runs(SdpaPattern(), code, _RUN_SDPA_BIAS, findings)
    assert all(c > 0.9999 for c in facts["cos_out"]), facts["cos_out"]  # graded values send it to the original


def test_sdpa_zeros_base_untouched_before_the_fill_is_still_a_boolean_mask() -> None:
    from npufuse.patterns.sdpa import SdpaPattern

    code = _SDPA_BIAS.replace("CHANGE", "scale = q.shape[-1] ** -0.5")
    findings, misses = detect_all(SdpaPattern(), code)
    assert findings, [m.reason for m in misses]
    facts = check_rewrite_runs(SdpaPattern(), code, _RUN_SDPA_BIAS, findings)
    assert facts["all_calls"].get("npu_fusion_attention") == 1, facts["all_calls"]
    assert all(c > 0.9999 for c in facts["cos_out"]), facts["cos_out"]


# -- 8. attribute stores through a tuple target are stores -------------------------------------------------------------

_SWITCHED_NORM = """
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.norm = RMSNorm(d)
        self.mlp = nn.Linear(d, d)

    def use_layer_norm(self, d):
        STORE

    def forward(self, x):
        h = x + self.attn(x)
        y = self.norm(h)
        return h + self.mlp(y)
"""
_RUN_SWITCHED = """
m = Block()
SWITCH
x = torch.randn(2, 3, 32)
with torch.no_grad():
    out = m(x)
leaves = []
"""


@pytest.mark.parametrize("store", ['self.norm, self.kind = nn.LayerNorm(d), "ln"', "self.kind, self.norm = make_norm(d)",
                                   "self.norm = nn.LayerNorm(d)", 'self.norm = getattr(nn, "LayerNorm")(d)'])
def test_a_norm_attribute_stored_again_through_a_tuple_is_not_one_class(store: str) -> None:
    from npufuse.patterns.add_rms_norm import AddRmsNorm

    code = _SWITCHED_NORM.replace("STORE", store) + "\n\ndef make_norm(d):\n    return 'ln', nn.LayerNorm(d)\n"
    findings = [f for f in detect_all(AddRmsNorm(), code)[0] if f.qualname == "Block.forward"]
    for switch in ("m.use_layer_norm(32)", ""):
        facts = check_rewrite_runs(AddRmsNorm(), code, _RUN_SWITCHED.replace("SWITCH", switch), findings) if findings else None
        assert facts is None or all(c > 0.9999 for c in facts["cos_out"]), (switch, facts)


def test_self_attribute_stores_pair_tuple_elements_and_mark_unseen_values() -> None:
    import ast

    from npufuse.scan.bound_callee import self_attribute_stores

    def read(src: str) -> list[tuple[str, object]]:
        return [(t.attr, v.value if isinstance(v, ast.Constant) else ast.unparse(v))
                for t, v in self_attribute_stores(ast.parse(src).body[0])]

    assert read("self.a, (self.b, c) = 1, (2, 3)") == [("a", 1), ("b", 2)]
    assert read("self.a = self.b = f()") == [("a", "f()"), ("b", "f()")]
    assert read("self.a: float = 0.5") == [("a", 0.5)]
    assert read("self.a, self.b = pair()") == [("a", ...), ("b", ...)]  # stored, value not written out
    assert read("self.a, *self.b = 1, 2, 3") == [("a", ...), ("b", ...)]
    assert read("other.a, self.b = 1, 2") == [("b", 2)]
