"""s51 (perf51b): rms_norm's root parse is skipped in scopes whose only "sqrt" is a bare ``math.sqrt`` of the math
module (attention's ``scores / math.sqrt(head_dim)``); see ``patterns/_rms_norm_s51b.py`` for the proof. Each case
below fails where the gate would be too strict: a real root beside ``math.sqrt``, a tensor named ``math`` (bound in
the scope or the file), ``sqrt`` spelled any other way. The last test compares the whole rms_norm output with the gate
forced open (the old answer) over every rms_norm / add_rms_norm / attention example.
"""

from __future__ import annotations

import ast

import pytest

from npufuse.patterns import _rms_norm_s51b, rms_norm
from npufuse.patterns.base import Finding, NearMiss
from npufuse.scan.dataflow import ModuleInfo

_ATTN = '''import math
import torch
from torch import nn


class Attn(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        return torch.softmax(s, dim=-1) @ v
'''

# a norm with torch's root beside attention's math.sqrt in one function: the count of "sqrt" differs
_NORM_BESIDE_MATH = '''import math
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x, k):
        h = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight
        return h @ k.transpose(-1, -2) / math.sqrt(h.size(-1))
'''

# a tensor named ``math`` in the scope: ``math.sqrt()`` is the tensor's root
_TENSOR_NAMED_MATH = '''import math
import torch
from torch import nn


class Norm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x):
        math = (x * x).mean(-1, keepdim=True) + self.eps
        return self.weight * (x / math.sqrt())
'''

_METHOD_SQRT_BESIDE_MATH = _NORM_BESIDE_MATH.replace(
    "torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)", "((x * x).mean(-1, keepdim=True) + self.eps).sqrt().reciprocal()")


def _module(src: str) -> ModuleInfo:
    return ModuleInfo.from_source("m.py", src)


def _rms(src: str) -> list[tuple[str, str, int]]:
    m = _module(src)
    out = []
    for scope in m.scopes:
        for r in rms_norm.detected(m, scope):
            if isinstance(r, Finding):
                out.append(("fuse", scope.qualname, r.line))
            elif isinstance(r, NearMiss):
                out.append(("keep", scope.qualname, r.line))
    return sorted(out)


def _forward(m: ModuleInfo, name: str = "forward"):
    return next(s for s in m.scopes if getattr(s.node, "name", None) == name)


def test_attention_scale_is_skipped() -> None:
    m = _module(_ATTN + "\n\ndef rms(x, eps):\n    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)\n")
    assert _rms_norm_s51b.sqrt_only_of_math(m, "s = q / math.sqrt(d)\n")
    assert not rms_norm._reaches_root(m, _forward(m))  # the saving
    assert rms_norm._reaches_root(m, _forward(m, "rms"))


def test_norm_beside_math_sqrt_found() -> None:
    got = _rms(_NORM_BESIDE_MATH)
    assert ("fuse", "Block.forward", 13) in got, got


def test_method_sqrt_beside_math_sqrt_read() -> None:
    m = _module(_METHOD_SQRT_BESIDE_MATH)
    assert rms_norm._reaches_root(m, _forward(m))
    assert any(q == "Block.forward" for _, q, _ in _rms(_METHOD_SQRT_BESIDE_MATH))


def test_tensor_named_math_read() -> None:
    m = _module(_TENSOR_NAMED_MATH)
    assert rms_norm._reaches_root(m, _forward(m))
    got = _rms(_TENSOR_NAMED_MATH)
    assert any(q == "Norm.forward" for _, q, _ in got), got


@pytest.mark.parametrize("text", [
    "y = x / math.sqrt(d)  # sqrt of d\n",          # a comment spelling
    "y = x / self.math.sqrt(d)\n",                   # an attribute named math
    "y = x / mymath.sqrt(d)\n",                      # another name ending in math
    "y = x / math .sqrt(d)\n",                       # a blank between
    "y = x.sqrt() / math.sqrt(d)\n",                 # a tensor's root beside it
    "y = x / sqrt(d)\n",                             # an imported sqrt
    "def f(x, math):\n    return x / math.sqrt(d)\n",  # a parameter named math
    "import math\ny = x / math.sqrt(d)\n",           # import inside the scope (binding)
    "global math\ny = x / math.sqrt(d)\n",
    "for math in xs:\n    y = x / math.sqrt(d)\n",
    "y = x / rsqrt(d) / math.sqrt(d)\n",
])
def test_other_spellings_keep_the_old_answer(text: str) -> None:
    assert not _rms_norm_s51b.sqrt_only_of_math(_module("import math\n"), text)


@pytest.mark.parametrize("src", [
    "import numpy as math\n",                        # math is numpy in this file
    "from math import sqrt\nimport math\n",          # math spelled in a from-import
    "import math\nmath = torch.ones(3)\n",           # rebound at module level
    "import torch\n",                                # no import at all
    "import math\n# the math here\n",               # a bare word in a comment: counts against
])
def test_file_level_bindings_keep_the_old_answer(src: str) -> None:
    assert not _rms_norm_s51b.sqrt_only_of_math(_module(src), "y = x / math.sqrt(d)\n")


@pytest.mark.parametrize("src", ["import math\n", "import torch\nimport math  # scale\n", "if True:\n    import math\nx = math.pi\n"])
def test_file_level_import_only(src: str) -> None:
    assert _rms_norm_s51b.sqrt_only_of_math(_module(src), "y = x / math.sqrt(d)\n")


def _examples() -> list[str]:
    from npufuse.patterns import add_rms_norm, attention
    out = []
    for cls in (rms_norm.RmsNorm, add_rms_norm.AddRmsNorm, attention.AttentionPattern):
        for ex in (*cls.FUSE, *cls.KEEP):
            out.append(ex.code)
    return out


def test_rms_norm_output_unchanged_with_the_gate_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """rms_norm's findings / near misses on every rms_norm, add_rms_norm and attention example (and each with
    ``torch.rsqrt`` respelt ``math.sqrt``, where the gate now answers) equal those with the gate forced open."""
    srcs = _examples()
    srcs += [s.replace("torch.rsqrt", "math.sqrt").replace("import torch\n", "import math\nimport torch\n", 1) for s in srcs if "torch.rsqrt" in s]
    assert len(srcs) > 100
    new = []
    for s in srcs:
        try:
            ast.parse(s)
        except SyntaxError:
            new.append(None)
            continue
        new.append(_rms(s))
    monkeypatch.setattr(_rms_norm_s51b, "sqrt_only_of_math", lambda module, text: False)
    for s, n in zip(srcs, new):
        if n is not None:
            assert _rms(s) == n, s


# -- 2. a norm helper's NAME counts as a whole identifier ------------------------------------------------------------

_META_LIKE = '''import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        out = self._norm(x.float()).type_as(x)
        return out * self.weight


def eager_attention_forward(q, k):
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1)


class Attn(nn.Module):
    def forward(self, q, k):
        fn = eager_attention_forward
        return fn(q, k)
'''


@pytest.mark.parametrize(("text", "n"), [
    ("y = self._norm(x)\n", 1),
    ("y = _norm(x)\n", 1),
    ("y = _norm (x)\n", 1),
    ("f = self._norm\ny = f(x)\n", 1),
    ("y = getattr(self, '_norm')(x)\n", 1),
    ("y = self._norm_x(x) + my_norm(x)\n", 0),
    ("y = _norm\u00e9(x)\n", 0),                          # another identifier (é is a word character)
    ("y = _norm\u0301(x)\n", 1),                          # a combining mark: counted (the old answer)
    ("def _norm(self, x):\n    return self._norm(x)\n", 2),
])
def test_name_occurrences(text: str, n: int) -> None:
    assert _rms_norm_s51b.name_occurrences(text, "_norm") == n


def test_helper_caller_still_parsed_and_attention_skipped() -> None:
    m = _module(_META_LIKE)
    fwd = [s for s in m.scopes if getattr(s.node, "name", None) == "forward"]
    norm_fwd, attn_fwd = fwd
    assert rms_norm._reaches_root(m, norm_fwd)        # ``self._norm(`` names the helper
    assert not rms_norm._reaches_root(m, attn_fwd)    # ``eager_attention_forward`` names no helper
    got = _rms(_META_LIKE)
    assert ("fuse", "RMSNorm.forward", 15) in got, got


def test_helper_function_called_by_name() -> None:
    src = ("import torch\n\n\ndef rms(x, eps):\n    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)\n\n\n"
           "def block(x, w):\n    h = rms(x.float(), 1e-6).to(x.dtype)\n    return h * w\n")
    m = _module(src)
    blk = next(s for s in m.scopes if getattr(s.node, "name", None) == "block")
    assert rms_norm._reaches_root(m, blk)
