"""Issue 14 class 3 for attention: Megatron-style attention whose probabilities come from a softmax MODULE of
another file, its mask function passed in by the constructor's callers (repo_facts' attention block)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from npufuse.patterns.attention import _MEGATRON, _MEGATRON_FILL, AttentionPattern
from npufuse.scan import repo_facts
from npufuse.scan.engine import scan_repo
from pattern_harness import check_rewrite_runs, detect_all

PATTERN = AttentionPattern()


def _example(name: str):
    return next(ex for ex in PATTERN.FUSE + PATTERN.KEEP if ex.name == name)


@pytest.mark.parametrize("name", ["megatron_softmax_module_torch_path", "megatron_softmax_module_makes_causal_mask"])
def test_softmax_module_site_matches_under_emulator(name: str) -> None:
    ex = _example(name)
    findings, misses = detect_all(PATTERN, ex.code)
    assert findings, [m.reason for m in misses]
    f = findings[0]
    # the module's scale (read at run time: it may be None) times baddbmm's alpha; the mask filled by the mask function
    assert f.params["scale"].startswith("(self.scale_mask_softmax.scale if self.scale_mask_softmax.scale is not None else 1.0)")
    assert f.params["mask"] == ["masked: attention_mask"]
    # the optional module on the scores excludes its branch, the dropout context is stated
    assert "not (self.alibi is not None)" in f.fused
    details = " | ".join(r.detail for r in f.risks)
    assert "inside `with rng_fork():`" in details and "`self.alibi(attention_scores)`" in details
    facts = check_rewrite_runs(PATTERN, ex.code, ex.run, f and findings)
    # four calls: the biased module runs the original code; the makes-mask variant also with mask None
    assert facts["calls"] == (3 if name.endswith("torch_path") else 2)
    assert min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_module_building_its_own_mask_needs_one() -> None:
    findings, _ = detect_all(PATTERN, _example("megatron_softmax_module_makes_causal_mask").code)
    first = findings[0].fused.splitlines()[0]
    assert first.startswith("if ") and "(attention_mask is not None)" in first and "not (self.alibi is not None)" in first


@pytest.mark.parametrize("name,reason", [
    ("megatron_softmax_module_additive_mask_func", "`attention_mask_func` (example.py:"),
    ("megatron_softmax_module_mask_func_from_caller", "`mask_func` is passed into `CoreAttention.__init__` by its callers"),
    ("megatron_softmax_module_other_forward", "its forward is not read as a dropout, nor as scale -> mask function -> softmax"),
])
def test_softmax_module_near_misses_say_why(name: str, reason: str) -> None:
    findings, misses = detect_all(PATTERN, _example(name).code)
    assert not findings
    assert any(reason in m.reason for m in misses), [m.reason for m in misses]


def _repo(tmp_path: Path, mask_func_body: str) -> Path:
    """Three packages: the softmax class, the mask function, the attention built with a mask function its
    callers pass (a subclass built by a LayerSpec-style factory in a fourth file)."""
    parts = _MEGATRON.replace("MAKES_MASK", "pass").split("\n\ndef attention_mask_func")
    softmax_src = parts[0]
    attn_src = "class CoreAttention" + parts[1].split("\n\nclass CoreAttention", 1)[1]
    files = {
        "pkg/__init__.py": "",
        "pkg/fusions/__init__.py": "",
        "pkg/fusions/fused_softmax.py": softmax_src,
        "pkg/model/__init__.py": "",
        "pkg/model/utils.py": f"def gpt_mask_func(attention_scores, attention_mask):\n    {mask_func_body}\n",
        "pkg/layers/__init__.py": "",
        "pkg/layers/attention.py": "import contextlib\nimport math\n\nimport torch\nfrom torch import nn\n\n"
                                   "from ..fusions.fused_softmax import ScaleMaskSoftmax\n\n\n"
                                   "def rng_fork():\n    return contextlib.nullcontext()\n\n\n"
                                   + attn_src.replace("alibi=None):", "alibi=None, mask_func=None):")
                                   .replace("ScaleMaskSoftmax(False, False, False, attention_mask_func, True, coeff)",
                                            "ScaleMaskSoftmax(False, False, False, mask_func, True, coeff)"),
        "pkg/model/gpt.py": textwrap.dedent("""
            from pkg.layers.attention import CoreAttention
            from pkg.model.utils import gpt_mask_func


            class CoreAttentionPipe(CoreAttention):
                pass


            def LayerSpec(cls, **kwargs):
                return cls(**kwargs)


            def build(n):
                return [LayerSpec(CoreAttentionPipe, layer_number=i + 1, mask_func=gpt_mask_func) for i in range(n)]
        """),
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_cross_file_softmax_module_and_caller_mask_function(tmp_path: Path) -> None:
    root = _repo(tmp_path, _MEGATRON_FILL)
    res = scan_repo(root, jobs=1, only=["attention"])
    hits = [c for c in res.candidates if c["file"] == "pkg/layers/attention.py"]
    assert len(hits) == 1, [n["reason"] for n in res.near_misses if n["pattern"] == "attention"]
    risk = " | ".join(r["detail"] for r in hits[0]["risks"])
    # the reason names where the class and the mask function were found
    assert "pkg/fusions/fused_softmax.py" in risk and "`gpt_mask_func` (pkg/model/utils.py:1)" in risk


def test_cross_file_caller_passing_a_bias_function_is_a_near_miss(tmp_path: Path) -> None:
    root = _repo(tmp_path, "return attention_scores + attention_mask")
    res = scan_repo(root, jobs=1, only=["attention"])
    assert not [c for c in res.candidates if c["file"] == "pkg/layers/attention.py"]
    reasons = [n["reason"] for n in res.near_misses if n["pattern"] == "attention" and n["file"] == "pkg/layers/attention.py"]
    assert any("pkg/model/gpt.py" in r and "not a plain masked_fill of the scores" in r for r in reasons), reasons


def test_mask_fill_forms() -> None:
    def fn(src: str) -> ast.AST:
        return ast.parse(textwrap.dedent(src)).body[0]

    assert repo_facts.mask_fill(fn("def f(s, m):\n    s.masked_fill_(m, -10000.0)\n    return s")) == "-10000.0"
    assert repo_facts.mask_fill(fn("def f(s, m):\n    return s.masked_fill(m, float('-inf'))")) == "float('-inf')"
    assert repo_facts.mask_fill(ast.parse("lambda s, m: s.masked_fill(m, -1e9)", mode="eval").body) in ("-1e9", "-1000000000.0")
    # a small fill, the keep-mask spelling, an addition: not a masking fill
    assert repo_facts.mask_fill(fn("def f(s, m):\n    return s.masked_fill(m, -1.0)")) is None
    assert repo_facts.mask_fill(fn("def f(s, m):\n    return s.masked_fill(~m, -10000.0)")) is None
    assert repo_facts.mask_fill(fn("def f(s, m):\n    return s + m")) is None


def test_definition_follows_relative_imports_and_package_reexports(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "__init__.py").write_text("")
    (tmp_path / "a" / "b" / "__init__.py").write_text("from .impl import Thing\n")
    (tmp_path / "a" / "b" / "impl.py").write_text("class Thing:\n    pass\n")
    (tmp_path / "a" / "user.py").write_text("from .b import Thing\nfrom a.b import Thing as Other\n")
    tree = ast.parse((tmp_path / "a" / "user.py").read_text())
    for name in ("Thing", "Other"):
        d = repo_facts.definition_in(tmp_path, "a/user.py", tree, name)
        assert d is not None and d.rel == "a/b/impl.py" and d.node.name == "Thing"
    assert repo_facts.definition_in(tmp_path, "a/user.py", tree, "Missing") is None


def test_mask_fill_info_reads_a_mask_cut_to_the_scores_size_on_one_path() -> None:
    fn = ast.parse(textwrap.dedent("""
        def attention_mask_func(attention_scores, attention_mask):
            args = get_args()
            if args.curriculum:
                mask_ = attention_mask
                n = attention_scores.size()[2]
                if n != mask_.size()[2]:
                    mask_ = mask_[:, :, :n, :n].contiguous()
                attention_scores.masked_fill_(mask_, -10000.0)
            else:
                attention_scores.masked_fill_(attention_mask, -10000.0)
            return attention_scores
    """)).body[0]
    assert repo_facts.mask_fill_info(fn) == ("-10000.0", True)
    # filled on one path only, or with two values, or branching on the scores' values: not a mask function
    one_path = ast.parse(textwrap.dedent("""
        def f(s, m):
            if flag:
                s.masked_fill_(m, -10000.0)
            return s
    """)).body[0]
    two_values = ast.parse(textwrap.dedent("""
        def f(s, m):
            if flag:
                s.masked_fill_(m, -10000.0)
            else:
                s.masked_fill_(m, float("-inf"))
            return s
    """)).body[0]
    on_values = ast.parse(textwrap.dedent("""
        def f(s, m):
            if s.max() > 0:
                s.masked_fill_(m, -10000.0)
            else:
                s.masked_fill_(m, -10000.0)
            return s
    """)).body[0]
    assert repo_facts.mask_fill_info(one_path) is None
    assert repo_facts.mask_fill_info(two_values) is None
    assert repo_facts.mask_fill_info(on_values) is None


def test_cut_mask_is_passed_cut_to_the_fused_call(tmp_path: Path) -> None:
    cut = ("n = attention_scores.size()[2]\n    if n != attention_mask.size()[2]:\n        attention_mask_ = attention_mask[:, :, :n, :n]\n"
           "    else:\n        attention_mask_ = attention_mask\n    attention_scores.masked_fill_(attention_mask_, -10000.0)\n    return attention_scores")
    code = _MEGATRON.replace("MAKES_MASK", "pass").replace("MASK_FUNC", cut)
    findings, misses = detect_all(PATTERN, code)
    assert findings, [m.reason for m in misses]
    assert "attention_mask[..., :" in findings[0].fused
    run = _example("megatron_softmax_module_torch_path").run + "\nbig = torch.ones(8, 8, dtype=torch.bool).triu(1).view(1, 1, 8, 8)\nout = out + (m(q, k, v, big),)\n"
    facts = check_rewrite_runs(PATTERN, code, run, findings)
    assert facts["calls"] == 4 and min(facts["cos_out"]) >= 0.9999 and min(facts["cos_grad"]) >= 0.9999


def test_outcome_that_read_other_files_is_not_cached(tmp_path: Path) -> None:
    # the mask function lives in another file: editing it must change the next scan, so the per-file cache
    # (keyed by the attention file's own content) does not keep that file's outcome
    root = _repo(tmp_path / "repo", _MEGATRON_FILL)
    cache_dir = tmp_path / "cache"
    first = scan_repo(root, jobs=1, only=["attention"], cache_dir=cache_dir)
    assert [c for c in first.candidates if c["file"] == "pkg/layers/attention.py"]
    (root / "pkg/model/utils.py").write_text("def gpt_mask_func(attention_scores, attention_mask):\n    return attention_scores + attention_mask\n")
    second = scan_repo(root, jobs=1, only=["attention"], cache_dir=cache_dir)
    assert not [c for c in second.candidates if c["file"] == "pkg/layers/attention.py"]
