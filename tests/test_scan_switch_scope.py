"""Which repo switch guards which candidate (DESIGN rule 1 with scope): a switch is reused only
where it plausibly selects fused/NPU kernels and is in scope for the candidate. Scanning a
monorepo as one repo (transformers' 544 modeling files) once made CLAP's audio feature-fusion
field ``enable_fusion`` the switch of every model with a config."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from npufuse.scan import repo_search
from npufuse.scan.engine import scan_repo
from scan_fakes import FakeOptimizer, FakeRmsNorm, FakeSdpa


def _repo(root: Path, files: dict[str, str]) -> Path:
    for rel, code in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(code), encoding="utf-8")
    return root


def _by_file(res) -> dict[str, dict]:
    out = {}
    for c in res.candidates:
        assert c["file"] not in out, "one candidate per file in these repos"
        out[c["file"]] = c
    return out


# a norm in a class that keeps its config (FakeRmsNorm finds `h = ... torch.rsqrt(...)`)
NORM_WITH_CONFIG = """
import torch
from torch import nn


class Norm(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, h):
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h
"""

# CLAP: the feature-fusion field, read where the audio encoder is built
CLAP_READ = """
import torch
from torch import nn


class ClapAudioEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.enable_fusion = config.enable_fusion

    def forward(self, h):
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h
"""


@pytest.mark.parametrize("name,topic", [
    ("use_npu_fusion", "kernel"), ("NPUFUSE_RMS_NORM", "kernel"), ("use_flash_attn", "kernel"), ("use_fused_rmsnorm", "kernel"),
    ("use_liger_kernel", "kernel"), ("enable_fused_kernels", "kernel"), ("USE_NPU_FUSED_ROPE", "kernel"),
    ("enable_fusion", "generic"), ("use_fusion", "generic"), ("ENABLE_FUSION", "generic"), ("use_fused", "generic"),
    ("use_bias_in_fusion_residual", "other"), ("use_batch_norm_in_fusion_residual", "other"), ("enable_early_fusion", "other"),
    ("use_fused_layernorm", "other"),
])  # fmt: skip
def test_switch_topic(name: str, topic: str) -> None:
    assert repo_search.switch_topic(name) == topic


def test_npufuse_style_env_names_are_switches() -> None:
    assert repo_search.is_switch("NPUFUSE_RMS_NORM", "env")
    assert repo_search.is_switch("NPU_FUSED_ROPE", "env")
    assert not repo_search.is_switch("NPU_VISIBLE_DEVICES", "env")


def test_one_models_feature_flag_does_not_guard_another_model(tmp_path: Path) -> None:
    root = _repo(tmp_path, {
        "models/clap/modeling_clap.py": CLAP_READ,
        "models/llama/modeling_llama.py": NORM_WITH_CONFIG,
        "models/bert/modeling_bert.py": NORM_WITH_CONFIG,
    })  # fmt: skip
    res = scan_repo(root, patterns=[FakeRmsNorm()], jobs=1)
    assert [(s["name"], s["file"]) for s in res.switches] == [("enable_fusion", "models/clap/modeling_clap.py")]
    c = _by_file(res)
    for other in ("models/llama/modeling_llama.py", "models/bert/modeling_bert.py"):
        assert c[other]["switch"]["kind"] == "new_field", c[other]["switch"]
        assert c[other]["switch"]["expr"] == 'getattr(self.config, "use_npu_rms_norm", True)'
        assert not any("enable_fusion" in n for n in c[other]["notes"])  # out of scope: not this site's business
    # in its own package a bare fusion word may still be the repo's switch (the name cannot tell)
    assert c["models/clap/modeling_clap.py"]["switch"]["expr"] == "self.enable_fusion"


def test_feature_names_are_never_reused(tmp_path: Path) -> None:
    code = NORM_WITH_CONFIG.replace("self.config = config\n", "self.config = config\n        self.res = config.use_bias_in_fusion_residual\n")
    res = scan_repo(_repo(tmp_path, {"m.py": code}), patterns=[FakeRmsNorm()], jobs=1)
    assert [s["name"] for s in res.switches] == ["use_bias_in_fusion_residual"]
    assert res.candidates[0]["switch"]["kind"] == "new_field"


def test_config_field_in_scope_by_folder_or_import(tmp_path: Path) -> None:
    config = """
    from dataclasses import dataclass


    @dataclass
    class ModelConfig:
        hidden_size: int = 64
        use_npu_fusion: bool = False
    """
    importer = "from common.config import ModelConfig\n" + textwrap.dedent(NORM_WITH_CONFIG)
    root = _repo(tmp_path, {
        "common/config.py": config,
        "common/layers.py": NORM_WITH_CONFIG,  # same folder as the config class
        "models/a/model.py": importer,  # imports the config class
        "models/b/model.py": NORM_WITH_CONFIG,  # neither
    })  # fmt: skip
    c = _by_file(scan_repo(root, patterns=[FakeRmsNorm()], jobs=1))
    for rel in ("common/layers.py", "models/a/model.py"):
        assert c[rel]["switch"]["kind"] == "existing", rel
        assert c[rel]["switch"]["expr"] == 'getattr(self.config, "use_npu_fusion", False)'
        assert c[rel]["switch"]["reuses"]["file"] == "common/config.py"
    assert c["models/b/model.py"]["switch"]["kind"] == "new_field"


def test_root_config_field_covers_the_whole_repo(tmp_path: Path) -> None:
    # a config at the root (folder "") is an ancestor of every file; a data file's field likewise
    root = _repo(tmp_path, {"config.json": '{"use_npu_fusion": true}', "pkg/deep/model.py": NORM_WITH_CONFIG})
    (c,) = scan_repo(root, patterns=[FakeRmsNorm()], jobs=1).candidates
    assert c["switch"]["reuses"] == {"file": "config.json", "line": 1, "name": "use_npu_fusion", "kind": "config_field"}


def test_data_file_config_in_a_configs_folder_covers_its_siblings(tmp_path: Path) -> None:
    root = _repo(tmp_path, {
        "proj/configs/model.json": '{"use_npu_fusion": true}',
        "proj/model/norm.py": NORM_WITH_CONFIG,
        "other/norm.py": NORM_WITH_CONFIG,
    })  # fmt: skip
    c = _by_file(scan_repo(root, patterns=[FakeRmsNorm()], jobs=1))
    assert c["proj/model/norm.py"]["switch"]["kind"] == "existing"
    assert c["other/norm.py"]["switch"]["kind"] == "new_field"


ENV_NORM = """
import os
import torch


def norm(x, weight, eps):
    return weight * torch.rsqrt(x)
"""


def test_env_switch_is_global(tmp_path: Path) -> None:
    reader = "import os\n\nON = os.environ.get('NPUFUSE_RMS_NORM', '1')\n"
    root = _repo(tmp_path, {"scripts/env.py": reader, "models/x/norm.py": ENV_NORM})
    (c,) = scan_repo(root, patterns=[FakeRmsNorm()], jobs=1).candidates
    assert c["switch"]["kind"] == "existing"
    assert c["switch"]["reuses"]["name"] == "NPUFUSE_RMS_NORM"
    assert c["switch"]["expr"] == '_npufuse_os.environ.get("NPUFUSE_RMS_NORM", "1").strip().lower() in ("1", "true", "on", "yes")'


def test_generic_env_switch_needs_its_package_or_torch_npu_beside_it(tmp_path: Path) -> None:
    reader = "import os\n\nON = os.environ.get('ENABLE_FUSION', '0')\n"
    # elsewhere and without torch_npu near it: not reused, and the site says why
    (c,) = scan_repo(_repo(tmp_path / "a", {"scripts/env.py": reader, "models/x/norm.py": ENV_NORM}), patterns=[FakeRmsNorm()], jobs=1).candidates
    assert c["switch"]["kind"] == "env" and c["switch"]["name"] == "NPUFUSE_RMS_NORM"
    assert any("`ENABLE_FUSION`" in n and "not reused" in n for n in c["notes"])
    # beside torch_npu code: a kernel switch after all
    npu = reader + "\ntry:\n    import torch_npu\nexcept ImportError:\n    torch_npu = None\n"
    (c,) = scan_repo(_repo(tmp_path / "b", {"scripts/env.py": npu, "models/x/norm.py": ENV_NORM}), patterns=[FakeRmsNorm()], jobs=1).candidates
    assert c["switch"]["reuses"]["name"] == "ENABLE_FUSION"
    # in the candidate's own package
    (c,) = scan_repo(_repo(tmp_path / "c", {"models/env.py": reader, "models/x/norm.py": ENV_NORM}), patterns=[FakeRmsNorm()], jobs=1).candidates
    assert c["switch"]["reuses"]["name"] == "ENABLE_FUSION"


def test_cli_flag_is_global(tmp_path: Path) -> None:
    args = """
    import argparse


    def get_args():
        p = argparse.ArgumentParser()
        p.add_argument("--use-flash-attn", action="store_true")
        return p.parse_args()
    """
    attn = """
    import torch.nn.functional as F


    def attend(q, k, v, args):
        out = F.scaled_dot_product_attention(q, k, v)
        return out
    """
    root = _repo(tmp_path, {"tools/arguments.py": args, "model/attn.py": attn})
    (c,) = scan_repo(root, patterns=[FakeSdpa()], jobs=1).candidates
    assert c["switch"]["expr"] == 'getattr(args, "use_flash_attn", False)'
    assert c["switch"]["reuses"]["file"] == "tools/arguments.py"


def test_choose_switch_without_a_site_keeps_every_kernel_switch_in_scope() -> None:
    # callers that know no site (tests, tools) get the old rule, less the feature names
    ctx = repo_search.SiteContext(config_expr="self.config")
    far = {"file": "elsewhere/cfg.py", "line": 3, "name": "use_npu_fusion", "kind": "config_field", "owner": "Cfg"}
    feature = {"file": "m.py", "line": 1, "name": "use_bias_in_fusion_residual", "kind": "config_field"}
    sw, reused, _ = repo_search.choose_switch("rms_norm", ctx, [feature, far])
    assert reused is far and sw.expr == 'getattr(self.config, "use_npu_fusion", False)'
    site = repo_search.SwitchSite("model/m.py")
    sw, reused, _ = repo_search.choose_switch("rms_norm", ctx, [feature, far], site=site)
    assert reused is None and sw.kind == "new_field"
    assert repo_search.choose_switch("rms_norm", ctx, [far], site=repo_search.SwitchSite("model/m.py", frozenset({"Cfg"})))[1] is far


def test_optimizer_reuses_a_global_env_switch(tmp_path: Path) -> None:
    train = """
    import os
    import torch


    def main(model):
        if os.environ.get("NPU_FUSED_ADAMW", "0") == "1":
            pass
        optimizer = torch.optim.AdamW(model.parameters())
        return optimizer
    """
    (c,) = scan_repo(_repo(tmp_path, {"recipes/train.py": train}), patterns=[FakeOptimizer()], jobs=1).candidates
    assert c["switch"]["reuses"]["name"] == "NPU_FUSED_ADAMW"
