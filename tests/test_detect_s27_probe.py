"""Numeric probe, session 27: its gates are decided before torch is imported (scope words through
the shared Pattern.SCOPE_WORDS mechanism, code names, static and structural checks), pool
workers leave probe files to the parent (one torch import per scan), and the probe's reach."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from npufuse.patterns import rms_norm as R
from npufuse.patterns.base import Finding
from npufuse.scan import engine
from npufuse.scan import numeric_probe as P
from npufuse.scan.dataflow import ModuleInfo

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _detect(code: str) -> list:
    m = ModuleInfo.from_source("m.py", textwrap.dedent(code))
    out = []
    for s in m.scopes:
        out += list(R.RmsNorm().detect(m, s))
    return out


def _scope(code: str, qual: str):
    m = ModuleInfo.from_source("m.py", textwrap.dedent(code))
    s = next(s for s in m.scopes if s.qualname == qual)
    return m, s


# --- (A) gates before torch ------------------------------------------------------------------

_ALIASED = '''
import torch
from torch import nn
from torch import rsqrt as inv_root


class AliasNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        ms = (x * x).mean(-1, keepdim=True)
        if self.eps > 0:
            ms = ms + self.eps
        return x * inv_root(ms) * self.g
'''


def test_the_probe_gate_follows_import_aliases_like_scope_words() -> None:
    # the scope's text has no root word: only the alias of torch.rsqrt (what SCOPE_WORDS' alias rule covers)
    m, s = _scope(_ALIASED, "AliasNorm.forward")
    assert "sqrt" not in engine.gate_text(m, s)
    assert P.probe_worthy(m, s, s.node)
    found = [r for r in _detect(_ALIASED) if isinstance(r, Finding)]
    assert found and found[0].params["found_by"] == "numeric_probe"


def test_words_in_a_comment_alone_do_not_pass_the_gate() -> None:
    code = '''
import torch
def f(x):
    # mean of squares, then sqrt: not here
    return x * 2
'''
    m, s = _scope(code, "f")
    assert engine.scope_holds_words(m, s, P.STAT_WORDS) and engine.scope_holds_words(m, s, P.ROOT_WORDS)
    assert not P.probe_worthy(m, s, s.node)


def test_scope_holds_words_is_open_with_the_gates_off(monkeypatch) -> None:
    m, s = _scope("def f(x):\n    return x\n", "f")
    assert not engine.scope_holds_words(m, s, ("mean",))
    monkeypatch.setattr(engine, "SCOPE_GATES", False)
    assert engine.scope_holds_words(m, s, ("mean",))


@pytest.mark.parametrize("code,reason", [
    ("class N(nn.Module):\n    def __init__(self, d):\n        super().__init__()\n        self.eps = 1e-6\n"
     "    def forward(self, x, mask):\n        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)\n",
     "argument `mask` has no default"),
    ("class N(nn.Module):\n    def __init__(self, cfg: Config):\n        super().__init__()\n        self.eps = 1e-6\n"
     "    def forward(self, x):\n        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)\n",
     "constructor argument `cfg: Config` has no default"),
    ("class N(Base):\n    def forward(self, x):\n        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)\n",
     "does not derive from nn.Module in this file"),
    ("class N(nn.Module):\n    @staticmethod\n    def forward(x):\n        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)\n",
     "a static method"),
])
def test_structural_bail_outs_are_decided_without_torch(code: str, reason: str) -> None:
    m = ModuleInfo.from_source("m.py", "import torch\nfrom torch import nn\n\n" + code)
    cls = next(iter(m.classes.values()))
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    assert P.static_gate(m, fn, cls) is None
    assert reason in (P.structural_gate(m, fn, cls) or "")
    proof = P.prove_rms_norm(m, fn, cls)
    assert proof.kind == "unknown" and reason in proof.reason


def _no_torch_script(root: Path, jobs: int) -> str:
    return textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {SRC!r})
        from npufuse.scan.engine import scan_repo
        r = scan_repo({str(root)!r}, only=["rms_norm"], jobs={jobs})
        print(len(r.candidates), "torch" in sys.modules)
    """)


def test_a_scan_whose_scopes_all_fail_the_cheap_gates_never_imports_torch(tmp_path) -> None:
    tmp_path = tmp_path / "repo"
    tmp_path.mkdir()
    (tmp_path / "a.py").write_text(textwrap.dedent('''
        import torch
        from torch import nn


        def commented(x):
            # mean, then sqrt (words in a comment only)
            return x + 1


        class NeedsMask(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.eps = 1e-6

            def forward(self, x, mask):  # an argument the probe cannot give a value
                return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * mask


        class Unbuildable(nn.Module):
            def __init__(self, cfg: "Config"):
                super().__init__()
                self.eps = cfg.eps

            def forward(self, x):
                return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * 2
    '''))
    out = subprocess.run([sys.executable, "-c", _no_torch_script(tmp_path, 1)], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "False", out.stdout + out.stderr


def _pool_repo(root: Path) -> None:
    for i in range(engine.PARALLEL_MIN_FILES + 4):
        (root / f"plain_{i:03d}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    (root / "norm.py").write_text(textwrap.dedent(R._PROBE_VECTOR_NORM))


def test_pool_workers_leave_probe_files_to_the_parent_and_the_result_is_the_same(tmp_path) -> None:
    tmp_path = tmp_path / "repo"  # pytest names its folders test_*: the walk would skip them as tests
    tmp_path.mkdir()
    _pool_repo(tmp_path)
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {SRC!r})
        from npufuse.scan import engine
        calls = []
        real = engine.defer_import
        def spy(module, name):
            got = real(module, name)
            calls.append(got)
            return got
        engine.defer_import = spy
        r = engine.scan_repo({str(tmp_path)!r}, only=["rms_norm"], jobs=2)
        # the parent never defers: only workers do (and then the parent analyses the file again)
        print(json.dumps({{"cands": [(c["file"], c["line"], c["params"].get("found_by")) for c in r.candidates],
                           "parent_deferred": any(calls), "parent_asked": len(calls)}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    pooled = json.loads(out.stdout.strip().splitlines()[-1])
    assert pooled["cands"] and pooled["cands"][0][0] == "norm.py" and pooled["cands"][0][2] == "numeric_probe"
    assert pooled["parent_asked"] >= 1 and not pooled["parent_deferred"]
    single = engine.scan_repo(tmp_path, only=["rms_norm"], jobs=1)
    assert [(c["file"], c["line"], c["params"].get("found_by")) for c in single.candidates] == [tuple(c) for c in pooled["cands"]]


def test_defer_import_marks_the_file_only_in_a_worker_without_the_module(monkeypatch) -> None:
    m = ModuleInfo.from_source("m.py", "x = 1\n")
    assert not engine.defer_import(m, "torch")  # not a worker
    monkeypatch.setattr(engine, "_DEFERRING", True)
    assert not engine.defer_import(m, "sys")  # already imported: nothing to save
    assert "_npufuse_deferred" not in m.__dict__
    with pytest.raises(engine.LeftToParent):  # the worker drops the file at once
        engine.defer_import(m, "npufuse_no_such_module_xyz")
    assert m.__dict__["_npufuse_deferred"] is True


def test_a_deferred_outcome_is_not_cached_and_is_marked(tmp_path, monkeypatch) -> None:
    (tmp_path / "norm.py").write_text(textwrap.dedent(R._PROBE_VECTOR_NORM))
    monkeypatch.setattr(engine, "_DEFERRING", True)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # restored after the test
    put = []
    cache = type("C", (), {"put": lambda self, o: put.append(o)})()
    out = engine._analyze_and_store(tmp_path, "norm.py", [R.RmsNorm()], engine.ScanOptions(), cache)
    assert out.deferred and not out.hits and put == []


# --- (B) reach: helpers imported from another file of the repo ----------------------------------

_OPS = '''
import torch

FULL = True


def mean_square(x, upcast=True):
    if upcast{extra}:
        x = x.float()
    return (x * x).mean(-1, keepdim=True)
'''
_MODEL = '''
import torch
from torch import nn
from .ops import mean_square


class Norm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float() * torch.rsqrt(mean_square(x) + self.eps)
        return self.weight * h.to(x.dtype)
'''


def _two_file_repo(root: Path, extra: str) -> Path:
    from npufuse.scan import repo_facts

    repo_facts.reset()
    root = root / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "ops.py").write_text(_OPS.replace("{extra}", extra))
    (root / "pkg" / "model.py").write_text(_MODEL)
    return root


def test_a_statistic_computed_by_a_helper_of_another_file_is_followed(tmp_path) -> None:
    from npufuse.scan import repo_facts

    root = _two_file_repo(tmp_path, "")
    r = engine.scan_repo(root, only=["rms_norm"], jobs=1)
    found = [c for c in r.candidates if c["file"] == "pkg/model.py"]
    assert len(found) == 1 and found[0]["params"]["found_by"] == "numeric_probe"
    assert found[0]["params"]["eps"] == "self.eps" and found[0]["params"]["weight"] == "self.weight"
    assert "torch_npu.npu_rms_norm(x, _npu_gamma, epsilon=self.eps)" in found[0]["fused"]
    assert found[0]["fused"].rstrip().endswith("return self.weight * h.to(x.dtype)")  # the original kept verbatim
    # its outcome depends on ops.py: the per-file cache must not keep it
    assert repo_facts.reads_other_files(root, "pkg/model.py")


def test_a_helper_of_another_file_branching_on_its_global_is_refused(tmp_path) -> None:
    root = _two_file_repo(tmp_path, " and FULL")
    r = engine.scan_repo(root, only=["rms_norm"], jobs=1)
    assert not [c for c in r.candidates if c["file"] == "pkg/model.py"]
    from npufuse.scan import repo_facts

    m = ModuleInfo.from_source("pkg/model.py", _MODEL)
    repo_facts.attach_root(m, root)
    cls = m.classes["Norm"]
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    proof = P.prove_rms_norm(m, fn, cls)
    assert proof.kind == "unknown" and "branches on its global `FULL`" in proof.reason


def test_a_name_that_is_not_imported_never_reads_other_files(tmp_path) -> None:
    from npufuse.scan import repo_facts

    root = _two_file_repo(tmp_path, "")
    m = ModuleInfo.from_source("pkg/model.py", _MODEL.replace("from .ops import mean_square\n", ""))
    repo_facts.attach_root(m, root)
    assert P._repo_function(m, "mean_square") is None
    assert not repo_facts.reads_other_files(root, "pkg/model.py")


# --- an eps that depends on the input's dtype is caught by a small-input bf16 run -----------------

_DTYPE_EPS = '''
import torch
from torch import nn


class HalfEpsNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        eps = self.eps if x.dtype == torch.float32 else 1e-3
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * self.weight
'''


def test_an_eps_that_depends_on_the_dtype_is_not_proved() -> None:
    m = ModuleInfo.from_source("m.py", _DTYPE_EPS)
    cls = m.classes["HalfEpsNorm"]
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    proof = P.prove_rms_norm(m, fn, cls)
    assert proof.kind == "mismatch" and "small bfloat16 inputs" in proof.reason
    # the same code with one eps for every dtype is proved (the check is not a blanket refusal)
    m2 = ModuleInfo.from_source("m.py", _DTYPE_EPS.replace("else 1e-3", "else self.eps"))
    cls2 = m2.classes["HalfEpsNorm"]
    fn2 = next(n for n in cls2.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    assert P.prove_rms_norm(m2, fn2, cls2).kind == "proved"


def test_a_name_imported_from_an_outside_package_never_reads_other_files(tmp_path) -> None:
    from npufuse.scan import repo_facts

    root = _two_file_repo(tmp_path, "")
    m = ModuleInfo.from_source("pkg/model.py", _MODEL.replace("from .ops import mean_square", "from somelib.ops import mean_square"))
    repo_facts.attach_root(m, root)
    assert P._repo_function(m, "mean_square") is None
    assert not repo_facts.reads_other_files(root, "pkg/model.py")
    # the same import spelled absolutely from this repository's package is followed
    m2 = ModuleInfo.from_source("pkg/model.py", _MODEL.replace("from .ops import mean_square", "from pkg.ops import mean_square"))
    repo_facts.attach_root(m2, root)
    assert P._repo_function(m2, "mean_square") is not None
