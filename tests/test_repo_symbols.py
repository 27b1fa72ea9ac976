"""npufuse.scan.repo_symbols: names resolved across the files of a repository, lazily and safely."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from npufuse.scan import repo_symbols
from npufuse.scan.repo_symbols import RepoSymbols
from npufuse.scan.walk import walk

FILES = {
    "pkg/__init__.py": "from .norms import RMSNorm\nfrom .attn import *\n",
    "pkg/norms.py": (
        "import torch.nn as nn\n\n\n"
        "class RMSNorm(nn.Module):\n    def forward(self, x):\n        return x\n\n    eps = 1e-6\n\n\n"
        "Norm = RMSNorm\nLayerNorm = nn.LayerNorm\nmake = lambda: 1\n"
    ),
    "pkg/attn.py": "__all__ = ['Attention']\n\n\nclass Attention:\n    pass\n\n\nclass Hidden:\n    pass\n",
    "pkg/sub/__init__.py": "",
    "pkg/sub/mlp.py": "from ..norms import RMSNorm as N\nfrom .. import attn\n\n\ndef swiglu(x):\n    return x\n",
    "model.py": (
        "import torch\nimport pkg\nimport pkg.sub.mlp as M\nfrom pkg import RMSNorm, Attention\n"
        "from torch.nn import functional as F\n"
        "try:\n    from apex.normalization import FusedRMSNorm as FN\nexcept ImportError:\n    from pkg.norms import RMSNorm as FN\n"
        "from pkg import Hidden\nfrom bad import thing\nfrom cyc.a import X\nfrom .nowhere import Y\n\n\n"
        "def build():\n    from pkg.attn import Attention as A\n    return A\n"
    ),
    "src/lib/__init__.py": "",
    "src/lib/ops.py": "def rope(x):\n    return x\n",
    "scripts/train.py": "from lib.ops import rope\nimport torch\n",
    "scripts/torch.py": "def not_torch():\n    pass\n",
    "tools/run.py": "import helper\nfrom helper import h\n",
    "tools/helper.py": "def h():\n    pass\n",
    "cyc/__init__.py": "",
    "cyc/a.py": "from .b import X\n",
    "cyc/b.py": "from .a import X\n",
    "bad.py": "def broken(:\n",
}


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for rel, text in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _index(root: Path, **kw) -> RepoSymbols:
    return RepoSymbols(root, walk(root).files, **kw)


def test_from_import_through_a_package_reexport(repo):
    s = _index(repo)
    sym = s.resolve("model.py", "RMSNorm")
    assert (sym.kind, sym.file, sym.qualname) == ("class", "pkg/norms.py", "RMSNorm")
    assert isinstance(sym.node, ast.ClassDef) and sym.node.name == "RMSNorm"
    assert [v.split(":")[0] for v in sym.via] == ["model.py", "pkg/__init__.py", "pkg/norms.py"]  # the hops, then the definition
    assert not sym.conditional


def test_star_reexport_respects_all(repo):
    s = _index(repo)
    assert s.resolve("model.py", "Attention").file == "pkg/attn.py"
    hidden = s.resolve("model.py", "Hidden")  # not in attn's __all__: `from .attn import *` does not bind it
    assert hidden.kind == "unresolved" and "pkg/__init__.py" in hidden.reason


def test_module_alias_dotted_attribute_and_class_member(repo):
    s = _index(repo)
    sym = s.resolve("model.py", "M.swiglu")
    assert (sym.kind, sym.file, sym.qualname) == ("function", "pkg/sub/mlp.py", "swiglu")
    method = s.resolve("model.py", "pkg.norms.RMSNorm.forward")  # import pkg; pkg.norms is a submodule
    assert (method.kind, method.qualname) == ("function", "RMSNorm.forward")
    eps = s.resolve("model.py", "pkg.norms.RMSNorm.eps")
    assert eps.kind == "value" and isinstance(eps.node, ast.Constant) and eps.node.value == 1e-6
    mod = s.resolve("model.py", "pkg.sub")
    assert mod.kind == "module" and mod.file == "pkg/sub/__init__.py"


def test_relative_imports_and_aliases(repo):
    s = _index(repo)
    assert s.resolve("pkg/sub/mlp.py", "N").qualname == "RMSNorm"
    assert s.resolve("pkg/sub/mlp.py", "attn.Attention").file == "pkg/attn.py"  # from .. import attn (a submodule)
    alias = s.resolve("pkg/norms.py", "Norm")  # Norm = RMSNorm
    assert (alias.kind, alias.qualname) == ("class", "RMSNorm")
    lam = s.resolve("pkg/norms.py", "make")
    assert lam.kind == "value" and isinstance(lam.node, ast.Lambda)


def test_external_names_are_named_not_resolved(repo):
    s = _index(repo)
    assert s.resolve("pkg/norms.py", "LayerNorm").target == "torch.nn.LayerNorm"  # via `import torch.nn as nn`
    f = s.resolve("model.py", "F.rms_norm")
    assert (f.kind, f.target) == ("external", "torch.nn.functional.rms_norm")
    # scripts/torch.py is not `torch`: scripts/ is neither the root nor model.py's folder nor a package root
    assert s.resolve("model.py", "torch.cat").kind == "external"
    # ...but for a script in scripts/ its own folder is on sys.path: there `import torch` is that file
    assert s.resolve("scripts/train.py", "torch.not_torch").file == "scripts/torch.py"


def test_last_binding_in_the_repo_wins_and_is_conditional(repo):
    sym = _index(repo).resolve("model.py", "FN")
    assert (sym.kind, sym.file, sym.qualname) == ("class", "pkg/norms.py", "RMSNorm")
    assert sym.conditional  # try/except: which one runs is a run-time fact


def test_src_layout_and_script_folder(repo):
    s = _index(repo)
    assert s.resolve("scripts/train.py", "rope").file == "src/lib/ops.py"
    assert s.resolve("tools/run.py", "h").file == "tools/helper.py"
    assert s.resolve("tools/run.py", "helper.h").kind == "function"
    # helper.py is not importable as `helper` from the root's model.py
    assert s.module_key("helper", "model.py") is None


def test_function_scope_imports(repo):
    s = _index(repo)
    tree, _ = s.tree("model.py")
    build = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build")
    assert s.resolve("model.py", "A", scope=build).qualname == "Attention"
    assert s.resolve("model.py", "A").kind == "unresolved"  # not bound at module level


def test_failures_are_reasons(repo):
    s = _index(repo)
    bad = s.resolve("model.py", "thing")
    assert bad.kind == "unresolved" and "bad.py does not parse (line 1" in bad.reason
    cyc = s.resolve("model.py", "X")
    assert cyc.kind == "unresolved" and "cycle" in cyc.reason
    rel = s.resolve("model.py", "Y")
    assert rel.kind == "unresolved" and "not in the repository" in rel.reason
    assert s.resolve("model.py", "nothing_here").kind == "unresolved"
    assert s.resolve("model.py", "not a name").kind == "unresolved"
    assert s.resolve("absent.py", "x").reason == "absent.py is not one of the scanned files"
    node = ast.parse("f()(x).y", mode="eval").body
    assert s.resolve_node("model.py", node).kind == "unresolved"


def test_lazy_only_files_on_the_chain_are_parsed(repo):
    s = _index(repo)
    assert s.parsed == 0  # building the index reads nothing
    assert s.resolve("pkg/sub/mlp.py", "N").found
    assert s.parsed == 2  # mlp.py and norms.py; not model.py, attn.py or __init__ files
    assert s.resolve("pkg/sub/mlp.py", "N").found and s.parsed == 2  # cached


def test_parse_budget_and_size_limit(repo):
    s = _index(repo, max_parses=1)
    sym = s.resolve("pkg/sub/mlp.py", "N")
    assert sym.kind == "unresolved" and "the limit" in sym.reason
    (repo / "pkg" / "norms.py").write_text("x = 1\n" * 100)
    small = _index(repo, max_bytes=100)
    assert "larger than 100 bytes" in small.resolve("pkg/sub/mlp.py", "N").reason


def test_symlink_outside_the_root_is_not_read(repo, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "evil.py").write_text("class Evil:\n    pass\n")
    (repo / "ext").symlink_to(outside, target_is_directory=True)
    (repo / "use.py").write_text("from ext.evil import Evil\n")
    files = walk(repo).files
    assert "ext/evil.py" in files  # the walker follows folder links once; the index must not read through it
    sym = RepoSymbols(repo, files).resolve("use.py", "Evil")
    assert sym.kind == "unresolved" and "outside the repository" in sym.reason


def test_deep_chains_stop(tmp_path):
    root = tmp_path / "r"
    root.mkdir()
    n = repo_symbols.MAX_HOPS + 5
    for i in range(n):
        (root / f"m{i}.py").write_text(f"from m{i + 1} import X\n")
    (root / f"m{n}.py").write_text("class X:\n    pass\n")
    sym = RepoSymbols(root, walk(root).files).resolve("m0.py", "X")
    assert sym.kind == "unresolved" and "imports followed" in sym.reason
    assert RepoSymbols(root, walk(root).files).resolve(f"m{n - 3}.py", "X").kind == "class"


def test_shared_index_per_scan(repo):
    files = walk(repo).files
    a = repo_symbols.shared(repo, files, 1 << 20)
    assert repo_symbols.shared(repo, list(files), 1 << 20) is a
    assert repo_symbols.shared(repo, files[:-1], 1 << 20) is not a
    b = repo_symbols.shared(repo, files, 1 << 20)
    repo_symbols.forget()
    assert repo_symbols.shared(repo, files, 1 << 20) is not b
    repo_symbols.forget()


def test_a_package_module_does_not_import_its_sibling_absolutely(tmp_path):
    # pkg/enum.py beside pkg/types.py: `from enum import Enum` in the package is the standard library's
    # (absolute import); in a script folder (no __init__.py) the sibling would be found first
    root = tmp_path / "r"
    for rel, text in {"pkg/__init__.py": "", "pkg/enum.py": "from enum import Enum\n", "pkg/types.py": "from enum import Enum\n",
                      "gen.py": "def generate():\n    pass\n", "gen/lora.py": "from gen import generate\n",
                      "transformers/convert.py": "x = 1\n", "run.py": "from transformers import AutoModel, convert\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    s = RepoSymbols(root, walk(root).files)
    assert s.resolve("pkg/types.py", "Enum").target == "enum.Enum"
    assert s.resolve("pkg/enum.py", "Enum").target == "enum.Enum"
    # gen.py (a module) beats the namespace folder gen/ even from inside gen/
    assert s.resolve("gen/lora.py", "generate").file == "gen.py"
    # a folder without __init__.py named like an installed package: what it lacks is the package's
    assert s.resolve("run.py", "AutoModel").target == "transformers.AutoModel"
    assert s.resolve("run.py", "convert").file == "transformers/convert.py"
