"""s42 recall sweep (helper sweep42): the classes behind the misses on bench/detect_labels_sweep42.json, seven
repositories labelled before npufuse was run on them.

A1 rms_norm / add_rms_norm (memes2, 8 + 1 sites): ``nn.RMSNorm`` constructed through a module-level alias
   (``LayerNormImpl = nn.RMSNorm``; ``LayerNormImpl([d], elementwise_affine=True)``) was not seen: names bound once at
   module level to a torch API now resolve to that API (``ModuleInfo.assigned_aliases``). Near misses: a name bound
   twice, or bound to a conditional choice, or to LayerNorm, is no RMSNorm.
"""

from __future__ import annotations

from pathlib import Path

from npufuse.patterns.registry import all_patterns
from npufuse.scan import engine
from npufuse.scan.dataflow import ModuleInfo


def _scan(tmp_path: Path, code: str) -> engine.FileOutcome:
    (tmp_path / "site.py").write_text(code, encoding="utf-8")
    return engine.analyze_file(tmp_path, "site.py", all_patterns(), engine.ScanOptions())


def _hits(out: engine.FileOutcome, pattern: str) -> list[tuple[str, int]]:
    return [(h.finding.qualname, h.finding.line) for h in out.hits if h.finding.pattern == pattern]


# -- A1: a module-level alias of nn.RMSNorm

_ALIASED_NORM = """
import torch
from torch import nn

NormImpl = nn.RMSNorm


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn_norm = NormImpl([d], elementwise_affine=True)
        self.ff_norm = NormImpl([d], elementwise_affine=True)
        self.attn = nn.Linear(d, d)
        self.ff = nn.Linear(d, d)

    def forward(self, x):
        h = self.attn(self.attn_norm(x))
        x = h + x
        h = self.ff_norm(x)
        return x + self.ff(h)
"""


def test_a_module_level_alias_resolves_to_the_torch_api() -> None:
    import ast

    info = ModuleInfo.from_source("m.py", _ALIASED_NORM, ast.parse(_ALIASED_NORM))
    assert info.assigned_aliases == {"NormImpl": "torch.nn.RMSNorm"}
    assert info.canonical(ast.parse("NormImpl").body[0].value) == "torch.nn.RMSNorm"


def test_rmsnorm_built_through_a_module_level_alias_is_found(tmp_path: Path) -> None:
    out = _scan(tmp_path, _ALIASED_NORM)
    assert _hits(out, "rms_norm") == [("Block.__init__", 11), ("Block.__init__", 12)]
    assert [q for q, _ in _hits(out, "add_rms_norm")] == ["Block.forward"]


def test_a_name_bound_twice_is_no_alias(tmp_path: Path) -> None:
    code = _ALIASED_NORM.replace("NormImpl = nn.RMSNorm\n", "NormImpl = nn.RMSNorm\nNormImpl = nn.LayerNorm\n")
    out = _scan(tmp_path, code)
    assert not _hits(out, "rms_norm")
    # the add + norm stays a candidate only behind the run-time class test it always had
    for h in out.hits:
        if h.finding.pattern == "add_rms_norm":
            assert h.finding.params["condition"].startswith("type(self.ff_norm) is torch.nn.RMSNorm")


def test_a_conditional_choice_of_norm_class_is_no_alias(tmp_path: Path) -> None:
    code = _ALIASED_NORM.replace("NormImpl = nn.RMSNorm\n", "USE_RMS = True\nNormImpl = nn.RMSNorm if USE_RMS else nn.LayerNorm\n")
    out = _scan(tmp_path, code)
    assert not _hits(out, "rms_norm")


def test_an_alias_of_layernorm_is_no_rmsnorm(tmp_path: Path) -> None:
    out = _scan(tmp_path, _ALIASED_NORM.replace("nn.RMSNorm", "nn.LayerNorm"))
    assert not _hits(out, "rms_norm") and not _hits(out, "add_rms_norm")
