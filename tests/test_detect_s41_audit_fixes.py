"""s41 audit fixes (audit41): the classes behind the wrong / dubious candidates and the false near-miss reasons of
this session's precision audit on 14 repositories new to npufuse (bench/audit_s41_precision.json,
bench/audit_s41_near_misses.json).

W1 rms_norm: the output dtype "like" an intermediate expression was rendered ``a * b.dtype`` (``.dtype`` binds to
   ``b``): a TypeError in the fused branch (SkyReels-V2's ``fast_rms_norm``). The expression is bracketed.
W2 every pattern (engine): a site after the colon of a one-line compound statement (EVA's
   ``def forward(self, t): return t * self.freqs_cos + rotate_half(t) * self.freqs_sin``): the whole-line rewrite put
   the fused ``if`` (with a ``return``) where the ``def`` was, in the class body. Such a site is a near miss.
W3 every pattern (engine): MiniCPM's ``mlx_finetune.py`` (``import mlx.nn as nn``, no torch import) gave an
   add_rms_norm candidate on mx.arrays. A file that imports another array framework and no torch is not scanned.
"""

from __future__ import annotations

from pathlib import Path

from npufuse.patterns.registry import all_patterns
from npufuse.patterns.rms_norm import RmsNorm
from npufuse.scan import engine
from pattern_harness import check_rewrite_runs, detect_all

# -- W1: the dtype of an intermediate product

_DTYPE_OF_PRODUCT = '''
import torch


def fast_rms_norm(x, weight, eps):
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    x = x.type_as(x) * weight
    return x
'''

_DTYPE_OF_PRODUCT_RUN = "out = fast_rms_norm(torch.randn(2, 5, 16, dtype=torch.bfloat16), torch.randn(16), 1e-6)"


def test_the_dtype_of_an_intermediate_product_is_bracketed() -> None:
    findings, _ = detect_all(RmsNorm(), _DTYPE_OF_PRODUCT)
    assert len(findings) == 1
    assert "(x.float() * torch.rsqrt(" in findings[0].fused
    facts = check_rewrite_runs(RmsNorm(), _DTYPE_OF_PRODUCT, _DTYPE_OF_PRODUCT_RUN, findings)
    assert facts["calls"] >= 1
    assert facts["dtypes"] == [(facts["dtypes"][0][0],) * 2]
    assert min(facts["cos_out"]) > 0.9999


# -- W2: a site on the line of a compound statement's header

_ONE_LINE_DEF = """
import torch
from torch import nn


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionRotaryEmbeddingFast(nn.Module):
    def __init__(self, cos, sin):
        super().__init__()
        self.register_buffer("freqs_cos", cos)
        self.register_buffer("freqs_sin", sin)

    def forward(self, t): return t * self.freqs_cos + rotate_half(t) * self.freqs_sin
"""


def _scan_one(tmp_path: Path, code: str) -> engine.FileOutcome:
    (tmp_path / "site.py").write_text(code, encoding="utf-8")
    return engine.analyze_file(tmp_path, "site.py", all_patterns(), engine.ScanOptions())


def test_a_site_after_a_one_line_def_header_is_a_near_miss(tmp_path: Path) -> None:
    out = _scan_one(tmp_path, _ONE_LINE_DEF)
    assert not [h for h in out.hits if h.finding.pattern == "rope"]
    assert any(m["pattern"] == "rope" and "header of a compound statement" in m["reason"] for m in out.near_misses)


def test_the_same_body_on_its_own_line_is_still_a_candidate(tmp_path: Path) -> None:
    split = _ONE_LINE_DEF.replace("def forward(self, t): return", "def forward(self, t):\n        return")
    out = _scan_one(tmp_path, split)
    assert [h.finding.pattern for h in out.hits] == ["rope"]


# -- W3: a file of another array framework

_MLX_BLOCK = """
import mlx.core as mx
import mlx.nn as nn


class TransformerBlock(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)

    def __call__(self, x: mx.array, r: mx.array) -> mx.array:
        h = x + r
        r = self.post_attention_layernorm(h)
        return h + r
"""


def test_a_file_of_another_array_framework_without_torch_is_not_scanned(tmp_path: Path) -> None:
    out = _scan_one(tmp_path, _MLX_BLOCK)
    assert not out.hits and not out.near_misses


def test_the_torch_twin_is_still_a_candidate(tmp_path: Path) -> None:
    twin = _MLX_BLOCK.replace("import mlx.core as mx\nimport mlx.nn as nn", "import torch\nfrom torch import nn")
    twin = twin.replace("mx.array", "torch.Tensor").replace("nn.RMSNorm(dim, eps=eps)", "nn.RMSNorm(dim, eps=eps)")
    out = _scan_one(tmp_path, twin)
    assert "add_rms_norm" in [h.finding.pattern for h in out.hits]
