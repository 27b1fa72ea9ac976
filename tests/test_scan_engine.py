"""The scan engine with fake detectors: ordering, keys, switches, risks, shapes, repo search."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from npufuse.scan import engine
from npufuse.scan.engine import scan_repo
from scan_fakes import FAKES, FakeAddRmsNorm, FakeOptimizer, FakeRmsNorm, FakeSdpa, copy_fixture, tree_hashes

NORM = """
import torch
from torch import nn


class Norm(nn.Module):
    def forward(self, hidden_states):
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + 1e-6)
        return hidden_states
"""


def _write(root: Path, rel: str, code: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(code).lstrip("\n"))


def test_schema_fields_in_the_documented_order(tmp_path):
    _write(tmp_path, "m.py", NORM)
    data = scan_repo(tmp_path, patterns=[FakeRmsNorm()]).to_json()
    assert list(data)[:9] == ["tool", "version", "root", "files_scanned", "files_failed", "candidates", "near_misses", "existing", "switches"]
    (c,) = data["candidates"]
    documented = ["id", "key", "pattern", "api", "file", "qualname", "line", "end_line", "confidence", "params", "value", "risks", "replacement"]
    assert list(c)[: len(documented)] == documented
    for extra in ("variant", "notes", "training_ok", "fused", "guard_tensor", "switch", "file_sha256", "code"):
        assert extra in c
    assert c["key"] == "rms_norm@m.py:Norm.forward"
    assert json.loads(json.dumps(data)) == data  # plain JSON


def test_ids_stable_and_sorted_by_file_line_pattern(tmp_path):
    _write(tmp_path, "b.py", NORM)
    _write(tmp_path, "a.py", NORM + NORM.replace("class Norm", "class Norm2"))
    data = scan_repo(tmp_path, patterns=FAKES).to_json()
    got = [(c["id"], c["file"], c["line"]) for c in data["candidates"]]
    assert got == [(1, "a.py", 7), (2, "a.py", 16), (3, "b.py", 7)]
    again = scan_repo(tmp_path, patterns=list(reversed(FAKES))).to_json()
    assert [c["key"] for c in again["candidates"]] == [c["key"] for c in data["candidates"]]


def test_duplicate_keys_are_disambiguated(tmp_path):
    code = "import torch\n\n\ndef f(x):\n    x = x * torch.rsqrt(x)\n    x = x * torch.rsqrt(x)\n    return x\n"
    _write(tmp_path, "m.py", code)
    keys = [c["key"] for c in scan_repo(tmp_path, patterns=[FakeRmsNorm()]).candidates]
    assert keys == ["rms_norm@m.py:f", "rms_norm@m.py:f#2"]


def test_only_filters_and_rejects_unknown_ids(tmp_path):
    _write(tmp_path, "m.py", NORM)
    res = scan_repo(tmp_path, patterns=FAKES, only=["sdpa"])
    assert res.patterns == ["sdpa"] and res.candidates == []
    with pytest.raises(engine.UnknownPatternError):
        scan_repo(tmp_path, patterns=FAKES, only=["nope"])


def test_parse_once_per_file(tmp_path, monkeypatch):
    for i in range(3):
        _write(tmp_path, f"m{i}.py", NORM)
    calls = []
    real = ast.parse

    def counting(source, filename="<unknown>", *a, **k):
        if filename != "<unknown>":
            calls.append(filename)
        return real(source, filename, *a, **k)

    monkeypatch.setattr(engine.ast, "parse", counting)
    scan_repo(tmp_path, patterns=FAKES, jobs=1)
    assert sorted(calls) == ["m0.py", "m1.py", "m2.py"]


def test_scan_never_modifies_source(tmp_path):
    root = copy_fixture(tmp_path)
    before = tree_hashes(root)
    scan_repo(root, patterns=FAKES)
    assert tree_hashes(root) == before


def test_file_hashes_match_the_files(tmp_path):
    import hashlib

    _write(tmp_path, "m.py", NORM)
    (c,) = scan_repo(tmp_path, patterns=[FakeRmsNorm()]).candidates
    assert c["file_sha256"] == hashlib.sha256((tmp_path / "m.py").read_bytes()).hexdigest()


def test_parallel_equals_sequential(tmp_path, monkeypatch):
    root = copy_fixture(tmp_path)
    seq = scan_repo(root, patterns=FAKES, jobs=1).to_json()
    monkeypatch.setattr(engine, "PARALLEL_MIN_FILES", 1)
    par = scan_repo(root, patterns=FAKES, jobs=2).to_json()
    assert par == seq


def test_progress_callback(tmp_path):
    for i in range(4):
        _write(tmp_path, f"m{i}.py", NORM)
    seen = []
    scan_repo(tmp_path, patterns=FAKES, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (4, 4) and len(seen) == 4


# -- switches (DESIGN rule 1) -------------------------------------------------------------------

def _switch(tmp_path, files: dict[str, str], pattern=None, **kw):
    for rel, code in files.items():
        _write(tmp_path, rel, code)
    res = scan_repo(tmp_path, patterns=[pattern or FakeRmsNorm()], **kw)
    assert res.candidates, res.files_failed
    return res.candidates[0]


ATTN_WITH_CONFIG = """
import torch.nn.functional as F
from torch import nn


class Attn(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, q, k, v):
        out = F.scaled_dot_product_attention(q, k, v)
        return out
"""


def test_existing_config_switch_reachable_through_self_config(tmp_path):
    c = _switch(tmp_path, {"m.py": ATTN_WITH_CONFIG, "config.json": '{"use_flash_attn": true}'}, FakeSdpa())
    assert c["switch"]["kind"] == "existing"
    assert c["switch"]["expr"] == 'getattr(self.config, "use_flash_attn", False)'
    assert c["switch"]["reuses"]["file"] == "config.json"
    assert 'and getattr(self.config, "use_flash_attn", False):  # npufuse: sdpa' in c["replacement"]


def test_new_config_field_when_the_module_has_a_config(tmp_path):
    c = _switch(tmp_path, {"m.py": ATTN_WITH_CONFIG}, FakeSdpa())
    assert c["switch"] == {"kind": "new_field", "expr": 'getattr(self.config, "use_npu_sdpa", True)', "name": "", "describe": c["switch"]["describe"]}


def test_env_switch_when_nothing_else(tmp_path):
    c = _switch(tmp_path, {"m.py": NORM})
    assert c["switch"]["kind"] == "env" and c["switch"]["name"] == "NPUFUSE_RMS_NORM"
    assert '_npufuse_switch("NPUFUSE_RMS_NORM")' in c["replacement"]


def test_existing_env_switch_keeps_the_repo_default(tmp_path):
    code = NORM.replace("import torch\n", "import os\nimport torch\n\nFUSED = os.getenv('USE_FUSED_RMSNORM', '0')\n")
    c = _switch(tmp_path, {"m.py": code})
    assert c["switch"]["kind"] == "existing"
    assert c["switch"]["expr"] == '_npufuse_os.environ.get("USE_FUSED_RMSNORM", "0").strip().lower() in ("1", "true", "on", "yes")'


def test_unreachable_switch_is_noted_and_falls_through(tmp_path):
    cfg = "class MyConfig:\n    def __init__(self, hidden_size=64, use_fused_rmsnorm=False):\n        self.use_fused_rmsnorm = use_fused_rmsnorm\n"
    c = _switch(tmp_path, {"m.py": NORM, "configuration.py": cfg})
    assert c["switch"]["kind"] == "env"
    assert any("use_fused_rmsnorm" in n and "not reachable" in n for n in c["notes"])


def test_argparse_switch_reachable_from_args(tmp_path):
    code = """
    import argparse
    import torch


    def main(model):
        parser = argparse.ArgumentParser()
        parser.add_argument("--use-npu-fused-adamw", action="store_true")
        args = parser.parse_args()
        optimizer = torch.optim.AdamW(model.parameters())
        return optimizer
    """
    c = _switch(tmp_path, {"train.py": code}, FakeOptimizer())
    assert c["switch"]["expr"] == 'getattr(args, "use_npu_fused_adamw", False)'


def test_disable_style_switch_is_negated(tmp_path):
    code = NORM.replace("import torch\n", "import os\nimport torch\n\nOFF = os.environ.get('DISABLE_FUSED_RMSNORM')\n")
    c = _switch(tmp_path, {"m.py": code})
    assert c["switch"]["expr"].startswith("not _npufuse_os.environ.get(\"DISABLE_FUSED_RMSNORM\"")


@pytest.mark.parametrize("mode,kind", [("env", "env"), ("none", "none")])
def test_switch_mode_override(tmp_path, mode, kind):
    c = _switch(tmp_path, {"m.py": ATTN_WITH_CONFIG, "config.json": '{"use_flash_attn": true}'}, FakeSdpa(), switch_mode=mode)
    assert c["switch"]["kind"] == kind


# -- risks ------------------------------------------------------------------------------------

def _risks(c):
    return {r["kind"]: r for r in c["risks"]}


def test_risks_dynamic_shape_non_contiguous_host_sync(tmp_path):
    code = """
    import torch.nn.functional as F


    def attend(hidden, proj):
        bsz, q_len, _ = hidden.size()
        q = proj(hidden).view(bsz, q_len, 8, -1).transpose(1, 2)
        k = q
        v = q
        out = F.scaled_dot_product_attention(q, k, v)
        return out
    """
    c = _switch(tmp_path, {"m.py": code}, FakeSdpa())
    r = _risks(c)
    assert "hidden.size()" in r["dynamic_shape"]["detail"]
    assert "`q`" in r["non_contiguous"]["detail"] and ".transpose(1, 2)" in r["non_contiguous"]["detail"]
    assert ".item()" in r["host_sync"]["detail"]
    assert c["risk_level"] == "medium"


def test_non_contiguous_note_names_only_what_the_replacement_copies(tmp_path):
    """A ``.contiguous()`` in the replacement on other tensors does not copy these views: the note must
    not say it does (audit33: llama3's BSND attention, whose output alone was made contiguous)."""
    code = """
    import torch.nn.functional as F


    def attend(hidden, proj):
        qq = proj(hidden).view(2, 16, 8, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(qq, qq, qq)
        return out
    """
    detail = _risks(_switch(tmp_path, {"m.py": code}, FakeSdpa()))["non_contiguous"]["detail"]
    assert "`qq`" in detail and "passes it as it is" in detail and "makes it contiguous" not in detail
    assert "makes it contiguous" in _risks(_switch(tmp_path, {"m.py": code.replace("qq", "q")}, FakeSdpa()))["non_contiguous"]["detail"]


def test_varlen_arguments_are_dynamic_shapes(tmp_path):
    code = "import torch\n\n\ndef f(x, cu_seqlens):\n    x = x * torch.rsqrt(x)\n    return x\n"
    c = _switch(tmp_path, {"m.py": code})
    assert "cu_seqlens" in _risks(c)["dynamic_shape"]["detail"]


def test_autocast_region_and_decorator(tmp_path):
    code = """
    import torch


    @torch.autocast("npu", dtype=torch.bfloat16)
    def f(x):
        with torch.autocast(device_type="npu", enabled=False):
            x = x * torch.rsqrt(x)
        return x
    """
    detail = _risks(_switch(tmp_path, {"m.py": code}))["autocast"]["detail"]
    assert "enabled=False" in detail and "@torch.autocast" in detail


def test_inference_only_api_in_a_training_repo(tmp_path):
    layer = """
    def forward(residual, hidden_states, norm):
        hidden_states = residual + hidden_states
        hidden_states = norm(hidden_states)
        return hidden_states
    """
    _write(tmp_path, "layer.py", layer)
    res = scan_repo(tmp_path, patterns=[FakeAddRmsNorm()])
    assert _risks(res.candidates[0])["inference_only"]["level"] == "medium"
    _write(tmp_path, "train.py", "def step(loss, optimizer):\n    loss.backward()\n    optimizer.step()\n")
    res = scan_repo(tmp_path, patterns=[FakeAddRmsNorm()])
    r = _risks(res.candidates[0])
    assert r["inference_only"]["level"] == "high" and "train.py:2" in r["inference_only"]["detail"]
    assert r["numerics"]["source"] == "detector"
    assert res.training == ["train.py:2: loss.backward()", "train.py:3: optimizer.step()"]


def test_fused_optimizer_with_bf16_is_high_risk(tmp_path):
    code = "import torch\n\n\ndef main(model):\n    model = model.to(torch.bfloat16)\n    optimizer = torch.optim.AdamW(model.parameters())\n    return optimizer\n"
    c = _switch(tmp_path, {"train.py": code}, FakeOptimizer())
    assert _risks(c)["dtype"]["level"] == "high"


def test_overlapping_candidates_are_flagged(tmp_path):
    class Wide(FakeRmsNorm):
        id = "add_rms_norm"

        def detect(self, module, scope):
            for r in super().detect(module, scope):
                r.pattern = "add_rms_norm"
                r.end_line += 1
                yield r

    _write(tmp_path, "m.py", NORM)
    res = scan_repo(tmp_path, patterns=[FakeRmsNorm(), Wide()])
    assert len(res.candidates) == 2
    assert all(any("overlaps candidate" in r["detail"] for r in c["risks"]) for c in res.candidates)


def test_suggested_order_low_risk_and_high_value_first(tmp_path):
    root = copy_fixture(tmp_path)
    res = scan_repo(root, patterns=FAKES)
    by_id = {c["id"]: c for c in res.candidates}
    levels = [by_id[i]["risk_level"] for i in res.suggested_order]
    rank = ["none", "low", "medium", "high"]
    assert levels == sorted(levels, key=rank.index)
    assert sorted(res.suggested_order) == sorted(by_id)


# -- shapes ------------------------------------------------------------------------------------

def test_shapes_from_config_json_class_dataclass_and_argparse(tmp_path):
    _write(tmp_path, "m.py", NORM)
    _write(tmp_path, "config.json", '{"hidden_size": 2048, "text_config": {"num_attention_heads": 32}}')
    _write(tmp_path, "conf.py", "from dataclasses import dataclass\n\n\n@dataclass\nclass ModelArgs:\n    dim: int = 4096\n    n_kv_heads: int = 8\n")
    _write(tmp_path, "train.py", "import argparse\np = argparse.ArgumentParser()\np.add_argument('--seq-len', type=int, default=512)\n")
    (c,) = scan_repo(tmp_path, patterns=[FakeRmsNorm()]).candidates
    s = c["shapes"]
    assert s["hidden_size"] == {"value": 2048, "from": "config.json"}
    assert s["num_attention_heads"]["value"] == 32
    assert s["num_key_value_heads"] == {"value": 8, "from": "conf.py:5 (ModelArgs)"}
    assert s["seq_len"] == {"value": 512, "from": "train.py:3 (--seq-len)"}
    assert s["batch_size"] == {"value": 4, "from": "assumed"}
    assert "tokens=2048, hidden=2048" in c["value"]["estimate"]


def test_nearest_config_wins_and_overrides_beat_everything(tmp_path):
    _write(tmp_path, "a/m.py", NORM)
    _write(tmp_path, "a/config.json", '{"hidden_size": 111}')
    _write(tmp_path, "b/config.json", '{"hidden_size": 222}')
    (c,) = scan_repo(tmp_path, patterns=[FakeRmsNorm()]).candidates
    assert c["shapes"]["hidden_size"]["value"] == 111
    (c,) = scan_repo(tmp_path, patterns=[FakeRmsNorm()], overrides={"batch_size": 16, "seq_len": None}).candidates
    assert c["shapes"]["batch_size"] == {"value": 16, "from": "command line"}


def test_generic_spellings_only_inside_config_like_classes(tmp_path):
    _write(tmp_path, "m.py", NORM + "\n\nclass Pooler:\n    def __init__(self, dim=7):\n        self.dim = dim\n")
    (c,) = scan_repo(tmp_path, patterns=[FakeRmsNorm()]).candidates
    assert "hidden_size" not in c["shapes"]


# -- repo search -------------------------------------------------------------------------------

def test_existing_torch_npu_code_guards_and_wrappers(tmp_path):
    code = """
    import torch
    import torch_npu
    from transformers.utils import is_torch_npu_available


    def fused_norm(x, w):
        if is_torch_npu_available() and x.device.type == "npu":
            return torch_npu.npu_rms_norm(x, w)[0]
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
    """
    _write(tmp_path, "ops.py", code)
    res = scan_repo(tmp_path, patterns=[FakeRmsNorm()])
    kinds = {(e["kind"], e["line"]) for e in res.existing}
    assert {("import", 2), ("guard", 3), ("wrapper", 6), ("guard", 7), ("call", 8)} <= kinds
    # the eager code after `if npu: return fused` is its fallback, not a new candidate
    assert res.candidates == []
    assert "already has a torch_npu branch" in res.near_misses[0]["reason"]


def test_npufuse_rewritten_sites_are_not_proposed_again(tmp_path):
    from npufuse.rewrite.codegen import env_switch, splice

    _write(tmp_path, "m.py", NORM)
    first = scan_repo(tmp_path, patterns=[FakeRmsNorm()])
    (c,) = first.candidates
    from npufuse.patterns.base import Finding

    f = Finding("rms_norm", c["qualname"], c["line"], c["end_line"], c["params"], c["fused"], c["guard_tensor"])
    (tmp_path / "m.py").write_text(splice((tmp_path / "m.py").read_text(), [f], {c["line"]: env_switch("rms_norm")}))
    again = scan_repo(tmp_path, patterns=[FakeRmsNorm()])
    assert again.candidates == []
    assert any(e["kind"] == "npufuse_site" for e in again.existing)
    assert any("already rewritten by npufuse" in m["reason"] for m in again.near_misses)
    # the site's pattern is read from its marker: also below a form feed (str.splitlines counts
    # it as a line break, ast does not) and with the `if` header written over two lines
    rewritten = (tmp_path / "m.py").read_text()
    assert "\x0c" not in rewritten and "_npufuse_on_npu(" in rewritten
    (tmp_path / "m.py").write_text("\x0c\n" + rewritten.replace("_npufuse_on_npu(", "_npufuse_on_npu(\n", 1))
    third = scan_repo(tmp_path, patterns=[FakeRmsNorm()])
    assert [e["what"] for e in third.existing if e["kind"] == "npufuse_site"] == ["npufuse-rewritten site (rms_norm)"]


def test_switch_entries_of_every_kind(tmp_path):
    code = """
    import argparse
    import os

    p = argparse.ArgumentParser()
    p.add_argument("--use-fused-rmsnorm", action="store_true")
    p.add_argument("--lr", type=float)
    FLASH = os.environ["USE_FLASH_ATTN"]
    NPU = "NPU_FUSION" in os.environ


    def f(config):
        return config.use_liger_kernel
    """
    _write(tmp_path, "m.py", code)
    res = scan_repo(tmp_path, patterns=[])
    got = {(s["name"], s["kind"]) for s in res.switches}
    assert got == {("use_fused_rmsnorm", "argument"), ("USE_FLASH_ATTN", "env"), ("NPU_FUSION", "env"), ("use_liger_kernel", "config_field")}


# -- the scan path stays light -----------------------------------------------------------------

def test_scan_infrastructure_does_not_import_torch(tmp_path):
    _write(tmp_path, "m.py", NORM)
    tests = Path(__file__).parent
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(tests)!r})\n"
        "from scan_fakes import FAKES\n"
        "from npufuse.scan.engine import scan_repo\n"
        "from npufuse.report.markdown import render_markdown\n"
        f"r = scan_repo({str(tmp_path)!r}, patterns=FAKES)\n"
        "render_markdown(r.to_json())\n"
        "assert r.candidates\n"
        "print(sorted(m for m in ('torch', 'libcst', 'rich') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_real_registry_does_not_import_torch():
    code = "import sys\nfrom npufuse.patterns.registry import all_patterns\nall_patterns()\nprint([m for m in ('torch',) if m in sys.modules])\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
