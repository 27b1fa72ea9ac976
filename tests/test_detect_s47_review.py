"""s47 correctness review of the s46 code (helper review47).

1. ``self.<m>(..)`` read as a method of this file's classes: one reader (``_site_s47review.lookup``) for the norms'
   helper calls (``_site.resolve_callee`` / ``inherited_method``) and attention's inlined helper
   (``_attention_s46b.inlinable_methods``). Before: attention inlined ``forward_attention`` where a method assigns
   ``self.forward_attention`` (the instance attribute is what the call runs), inlined the FIRST of two ``def``\\ s
   (Python binds the last) and a decorated method's bare body; the norms read ``self._norm(..)`` as the class's
   ``_norm`` where ``__init__`` or another method assigns ``self._norm``.
"""

from __future__ import annotations

import pytest

from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.rms_norm import RmsNorm
from pattern_harness import check_rewrite_runs, detect_all
import test_detect_s46_attention_b as wenet


# --- 1a. attention: the inlined helper --------------------------------------------------------------------------

_INIT = "        self.dropout = nn.Dropout(p=dropout_rate)\n"
_SHADOWED = {
    # a temperature / variant chosen at construction (the instance attribute is what forward's call runs)
    "init_store": (_INIT, _INIT + "        self.forward_attention = functools.partial(self._tempered_attention, temperature=0.5)\n",
                   "`MultiHeadedAttention.__init__` changes `self.forward_attention` (stored, line"),
    # chosen later by a setter
    "setter": ("    def forward_qkv(self, query, key, value):\n",
               "    def use_linear_attention(self):\n        self.forward_attention = self._linear_attention\n\n"
               "    def forward_qkv(self, query, key, value):\n",
               "`MultiHeadedAttention.use_linear_attention` changes `self.forward_attention` (stored, line"),
    "setattr": (_INIT, _INIT + "        setattr(self, 'forward_attention', self._tempered_attention)\n",
                "changes `self.forward_attention` (setattr, line"),
    # a wrapper that changes the arguments: its result is what the call returns, not the bare body's
    "decorated": ("    def forward_attention(self", "    @halve_scores\n    def forward_attention(self",
                  "`MultiHeadedAttention.forward_attention` is decorated (@halve_scores)"),
}
_HALVE = '''

def halve_scores(fn):
    def wrapped(self, value, scores, mask=torch.ones((0, 0, 0), dtype=torch.bool)):
        return fn(self, value, scores * 0.5, mask)
    return wrapped
'''


def _shadowed(variant: str) -> str:
    old, new, _ = _SHADOWED[variant]
    code = wenet._WENET.replace(old, new).replace("import math\n", "import functools\nimport math\n")
    if variant == "decorated":
        code = code.replace("\n\nclass MultiHeadedAttention", _HALVE + "\n\nclass MultiHeadedAttention")
    assert code != wenet._WENET
    return code


@pytest.mark.parametrize("variant", sorted(_SHADOWED))
def test_a_helper_the_call_does_not_reach_as_written_is_not_inlined(variant: str) -> None:
    findings, misses = detect_all(AttentionPattern(), _shadowed(variant))
    assert findings == [], [f.qualname for f in findings]
    # said at the caller: why the helper it calls is not read
    reason = _SHADOWED[variant][2]
    assert any(m.qualname == "MultiHeadedAttention.forward" and "which npufuse does not inline" in m.reason and reason in m.reason
               for m in misses), [m.reason for m in misses]


def test_a_subclass_init_assigning_the_helper_refuses_only_the_subclass() -> None:
    rel = wenet._REL_POS.replace(
        "        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)\n",
        "        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)\n        self.forward_attention = self._rel_attention\n")
    findings, misses = detect_all(AttentionPattern(), wenet._WENET + rel)
    assert [f.qualname for f in findings] == ["MultiHeadedAttention.forward"]
    assert any(m.qualname == "RelPositionMultiHeadedAttention.forward"
               and "`RelPositionMultiHeadedAttention.__init__` changes `self.forward_attention`" in m.reason for m in misses)


# an older version of the helper left above the one Python binds (the class body's last ``def`` wins)
_STALE = '''    def forward_attention(self, value, scores, mask=torch.ones((0, 0, 0), dtype=torch.bool)):
        attn = torch.softmax(scores * 2.0, dim=-1)
        x = torch.matmul(attn, value)
        return self.linear_out(x.transpose(1, 2).contiguous().view(value.size(0), -1, self.h * self.d_k))

'''


def test_the_last_of_two_defs_is_the_one_inlined(garbage_on_fully_masked_rows: None) -> None:
    code = wenet._WENET.replace("    def forward_attention(self", _STALE + "    def forward_attention(self", 1)
    findings = wenet._runs(code, wenet._RUN, ["MultiHeadedAttention.forward"], 4)
    assert "* 2.0" not in findings[0].fused


garbage_on_fully_masked_rows = wenet.garbage_on_fully_masked_rows


# --- 1b. norms: ``self._norm(..)`` read through the helper ------------------------------------------------------

_META = '''
import functools

import torch
from torch import nn


def l2norm(x, dim=-1):
    return x / x.norm(dim=dim, keepdim=True)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, kind: str = "rms"):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight
'''
_FORWARD = _META.splitlines().index("        output = self._norm(x.float()).type_as(x)") + 1

_NORM_SHADOWED = {
    "init_store": ("        self.weight = nn.Parameter(torch.ones(dim))\n",
                   "        self.weight = nn.Parameter(torch.ones(dim))\n        if kind == 'l2':\n"
                   "            self._norm = functools.partial(l2norm, dim=-1)\n"),
    "setter": ("    def forward(self, x):\n", "    def use_l2(self):\n        self._norm = l2norm\n\n    def forward(self, x):\n"),
    "decorated": ("    def _norm(self, x):\n", "    @torch.no_grad()\n    def _norm(self, x):\n"),
    "second_def": ("    def forward(self, x):\n", "    def _norm(self, x):\n        return l2norm(x)\n\n    def forward(self, x):\n"),
}


@pytest.mark.parametrize("variant", sorted(_NORM_SHADOWED))
def test_norm_helper_the_call_does_not_reach_as_written(variant: str) -> None:
    old, new = _NORM_SHADOWED[variant]
    code = _META.replace(old, new)
    assert code != _META
    findings, _ = detect_all(RmsNorm(), code)
    assert not any(f.qualname == "RMSNorm.forward" for f in findings), [(f.qualname, f.line) for f in findings]


@pytest.mark.parametrize("store", ["self._norm = torch.compile(self._norm)",
                                   "self._norm = torch.compile(self._norm) if eps > 0 else self._norm", None])
def test_norm_helper_read_through_the_call_twins(store: str | None) -> None:
    # the plain helper and the helper compiled in place (the instance attribute holds the class's own def) still fuse
    code = _META if store is None else _META.replace("        self.weight = nn.Parameter(torch.ones(dim))\n",
                                                     f"        self.weight = nn.Parameter(torch.ones(dim))\n        {store}\n")
    findings, _ = detect_all(RmsNorm(), code)
    assert [f.qualname for f in findings] == ["RMSNorm.forward"]


# --- 2. moe: review46's open items ------------------------------------------------------------------------------

def _one_d(body: str, name: str) -> bool:
    from npufuse.scan.canonical import flattened_to_1d
    from npufuse.scan.dataflow import ModuleInfo

    code = "import torch\n\ndef f(idx, w, k):\n" + "".join(f"    {ln}\n" for ln in body.splitlines()) + "    return None\n"
    module = ModuleInfo.from_source("m.py", code)
    scope = next(s for s in module.scopes if s.qualname == "f")
    return flattened_to_1d(module, scope, name, len(code.splitlines()))


def test_a_python_or_0d_bool_index_adds_an_axis() -> None:
    import torch

    e = torch.arange(6)
    assert e[3 > 0].shape == (1, 6) and e[torch.tensor(0.0) > 0].shape == (0, 6)  # the fact the reading rests on
    assert e[e > 2].shape == (3,)


@pytest.mark.parametrize("body, one_d", [
    ("e = idx.reshape(-1)\ns = e[k > 0]", False),                    # k a number: a Python bool, [1, n] / [0, n]
    ("e = idx.reshape(-1)\ns = e[w.sum() > 0]", False),              # a 0-d bool
    ("e = idx.reshape(-1)\nkeep = k > 0\ns = e[keep]", False),       # through a name
    ("e = idx.reshape(-1)\ns = e[e != k]", True),                    # a mask of e itself: 1-D
    ("e = idx.reshape(-1)\nkeep = w.reshape(-1) > 1e-12\ns = e[keep]", True),
])
def test_a_selection_by_a_mask_is_one_d_only_for_a_one_d_mask(body: str, one_d: bool) -> None:
    assert _one_d(body, "s") is one_d


@pytest.mark.parametrize("text, flat", [
    ("E.view(E.shape[:-1] + (-1,))", False),       # the leading dims kept: a shape, not a size
    ("E.reshape((n,) + E.shape[2:])", False),
    ("E.view(E.size()[:1] + (-1,))", False),
    ("E.reshape(N * K)", True),
    ("E.view(x.size(0) * self.top_k)", True),
    ("E.reshape(x.shape[0] * k)", True),
])
def test_a_reshape_to_a_binop_is_a_flatten_only_for_a_size(text: str, flat: bool) -> None:
    import ast

    from npufuse.patterns import _moe_s45a

    assert _moe_s45a.flattens(ast.parse(text, mode="eval").body) is flat


# --- 3. rms_norm (sweep46b): a tiny eps outside the root read from ``self.<eps>`` set once in ``__init__`` -------------

@pytest.mark.parametrize("setter", [
    "    def set_epsilon(self, eps):\n        self.epsilon = eps\n\n",
    "    def configure(self, **kw):\n        for k, v in kw.items():\n            setattr(self, 'epsilon', v)\n\n",
])
def test_an_eps_another_method_stores_is_not_read_as_the_init_literal(setter: str) -> None:
    import test_detect_s46_sweep_b as sb

    code = sb._ADA_RMS.replace("    def forward(self, input, condition):\n", setter + "    def forward(self, input, condition):\n")
    findings, misses = detect_all(RmsNorm(), code)
    assert findings == []  # after set_epsilon(1e-2) the fused (eps) ** 2 inside the root differs by about 1 %
    assert any("eps outside the sqrt" in m.reason for m in misses), [m.reason for m in misses]


# --- 4. swiglu reasons: "not projections of one input" said of matrix products npufuse has no reading for ----------

_GLU = '''
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d=16, h=32):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d, h) / 4)
        self.w3 = nn.Parameter(torch.randn(d, h) / 4)
        self.b1 = nn.Parameter(torch.randn(h) / 4)
        self.b3 = nn.Parameter(torch.randn(h) / 4)
        self.wb = nn.Parameter(torch.randn(2, d, h) / 4)

    def forward(self, x, y):
        BODY
        return out
'''
_GLU_RUN = '''
m = MLP()
x = torch.randn(6, 16, requires_grad=True)
out = m(x, x)
leaves = [x, m.w1, m.b3]
'''


def _glu(body: str) -> str:
    return _GLU.replace("BODY", body)


def test_biased_projections_of_one_input_by_addmm_are_found_and_run() -> None:
    from npufuse.patterns.swiglu import Swiglu
    from pattern_harness import found_and_faithful

    code = _glu("g = torch.addmm(self.b1, x, self.w1)\n        u = torch.addmm(self.b3, x, self.w3)\n        out = F.silu(g) * u")
    findings = found_and_faithful(Swiglu(), code, _GLU_RUN)
    assert [f.qualname for f in findings] == ["MLP.forward"]
    bf16 = _GLU_RUN.replace("m = MLP()", "m = MLP().to(torch.bfloat16)").replace("torch.randn(6, 16,", "torch.randn(6, 16, dtype=torch.bfloat16,")
    facts = check_rewrite_runs(Swiglu(), code, bf16, findings)
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.999 and min(facts["cos_grad"]) > 0.999


def test_addmm_of_two_inputs_keeps_the_true_reason() -> None:
    from npufuse.patterns.swiglu import Swiglu

    code = _glu("g = torch.addmm(self.b1, x, self.w1)\n        u = torch.addmm(self.b1, y, self.w3)\n        out = F.silu(g) * u")
    findings, misses = detect_all(Swiglu(), code)
    assert findings == [] and any("not projections of one input" in m.reason for m in misses)


def test_stacked_products_are_not_said_to_be_no_projections() -> None:
    from npufuse.patterns.swiglu import Swiglu

    code = _glu("gu = torch.einsum('bd,kdh->kbh', x, self.wb)\n        out = F.silu(gu[0]) * gu[1]")
    findings, misses = detect_all(Swiglu(), code)
    assert findings == []
    reasons = [m.reason for m in misses]
    assert any("are matrix products that npufuse does not read as projections of one input" in r for r in reasons), reasons
    assert not any("are not projections" in r for r in reasons), reasons
