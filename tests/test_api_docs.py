"""`npufuse api`: torch_npu's own docs read statically, npufuse's summaries as the fallback.

Three groups: the real torch_npu 2.14.0 wheel (unpacked by the Makefile, located through
NPUFUSE_TORCH_NPU_PATH - see conftest.py), a miniature fixture wheel under
tests/fixtures/api_docs/ for the parsing edge cases, and the no-torch_npu fallback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from npufuse import api_docs
from npufuse.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "api_docs"

# The APIs the brief requires npufuse to summarise in its own words.
REQUIRED_SUMMARIES = [
    "npu_rms_norm", "npu_add_rms_norm", "npu_gemma_rms_norm", "npu_swiglu", "npu_geglu", "npu_gelu_mul",
    "npu_fast_gelu", "fast_gelu", "npu_rotary_mul", "npu_apply_rotary_pos_emb", "npu_fusion_attention",
    "npu_fused_infer_attention_score", "npu_prompt_flash_attention", "npu_incre_flash_attention",
    "npu_scaled_masked_softmax", "npu_dropout_with_add_softmax", "npu_confusion_transpose",
    "npu_grouped_matmul", "npu_moe_token_permute", "npu_moe_token_unpermute", "npu_moe_init_routing",
    "npu_moe_gating_top_k_softmax", "npu_moe_finalize_routing", "npu_group_norm_silu", "npu_add_layer_norm",
    "optim.NpuFusedAdamW", "optim.NpuFusedAdam", "optim.NpuFusedSGD",
]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["api", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def real_root() -> Path:
    root = api_docs.find_docs_root()
    if root is None or api_docs.wheel_version(root) != "2.14.0":
        pytest.skip(
            "the real torch_npu 2.14.0 wheel is not unpacked here (make venv puts it in .venv/torch-npu-docs; "
            "or point NPUFUSE_TORCH_NPU_PATH at a folder holding torch_npu/)"
        )
    return root


@pytest.fixture
def fixture_wheel(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(api_docs.ENV_TORCH_NPU_PATH, str(FIXTURE))
    root = api_docs.find_docs_root()
    assert root == (FIXTURE / "torch_npu").resolve()
    return root


@pytest.fixture
def no_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    # empty = "behave as if torch_npu were absent" (the documented switch)
    monkeypatch.setenv(api_docs.ENV_TORCH_NPU_PATH, "")
    assert api_docs.find_docs_root() is None


# --------------------------------------------------------------------------------------------
# the real wheel


def test_real_fusion_attention_prints_the_wheel_doc(capsys, real_root):
    code, out, err = run_cli(capsys, "npu_fusion_attention")
    assert code == 0, err
    assert "torch_npu-2.14.0 wheel" in out and "_op_plugin_docs.py" in out
    # the schema signature (with its odd spelling) and the real parameters the doc omits
    assert "torch_npu.npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num" in out
    assert "int pre_tockens=2147483647" in out
    assert "Tensor? sink=None, Tensor? dropout_mask=None, int seed=0, int offset=0" in out
    assert "doc prototype differs from the schema" in out
    assert "omits sink, dropout_mask, seed, offset" in out
    # the Chinese sections, in the original language
    for heading in ("功能描述", "参数说明", "输出说明", "约束说明", "支持的型号", "调用示例"):
        assert heading in out
    assert "atten_mask: Tensor类型" in out
    assert "Atlas A2" in out  # supported SoCs
    assert "npufuse notes (§5.1" in out  # our pitfalls under their doc


def test_real_217_unique_names_and_later_duplicates(real_root):
    raw = api_docs.parse_doc_file(real_root / api_docs.OP_DOCS_FILE, "_add_torch_npu_docstr", "x", True)
    assert len(raw) == 220
    names = [d.name for d in raw]
    assert {n for n in names if names.count(n) > 1} == {
        "npu_moe_token_permute", "npu_moe_token_unpermute", "npu_moe_token_permute_with_routing_map",
    }
    docs = api_docs.load_api_docs(real_root)
    assert sum(d.doc_file == "torch_npu/" + api_docs.OP_DOCS_FILE for d in docs.values()) == 217
    atb = sorted(n for n in docs if n.startswith("atb."))
    assert len(atb) == 9 and "atb.npu_ring_mla" in atb and "atb._npu_paged_attention_v2" in atb

    permute = api_docs.lookup("npu_moe_token_permute")
    first = min(d.line for d in raw if d.name == "npu_moe_token_permute")
    assert permute.doc_line > first and permute.doc_line in {d.line for d in raw if d.name == "npu_moe_token_permute"}
    # text only the newer doc has (its sorted_indices contract)
    assert "permuted_tokens[sorted_indices[i]] = tokens[i//topK]" in permute.doc
    assert any("documented more than once" in n for n in permute.notes)


def test_real_raw_slice_keeps_latex_escapes(real_root):
    fast_gelu = api_docs.lookup("npu_fast_gelu").doc
    assert "\\frac{x}{1+e^{-1.702" in fast_gelu and "\x0c" not in fast_gelu
    rotary = api_docs.lookup("torch_npu.npu_rotary_mul").doc
    assert "\\begin{pmatrix}" in rotary and "\x08" not in rotary


def test_real_rms_norm_json(capsys, real_root):
    code, out, _ = run_cli(capsys, "npu_rms_norm", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["name"] == "npu_rms_norm" and data["source"] == "torch_npu-2.14.0 wheel"
    assert data["signature"] == "torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)"
    assert data["signature_source"] == "schema" and data["signature_differs"] is False
    assert [p["name"] for p in data["parameters"]] == ["self", "gamma", "epsilon"]
    assert data["parameters"][2]["default"] == "1e-06" and data["parameters"][0]["doc"].startswith("self：Tensor类型")
    assert "第1个输出" in data["returns"] and data["return_type"] == "(Tensor, Tensor)"
    assert data["constraints"] and isinstance(data["socs"], list)
    assert "RmsNorm" in data["doc"] and data["summary"]["autograd"] is True
    assert data["doc_location"]["file"] == "torch_npu/_op_plugin_docs.py"


def test_real_undocumented_op_gets_schema_and_summary(capsys, real_root):
    code, out, _ = run_cli(capsys, "npu_add_rms_norm", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["source"] == "npufuse summary" and data["doc"] is None
    assert data["signature_source"] == "schema"
    assert data["signature"] == "torch_npu.npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)"
    assert any("has no doc for this API" in n for n in data["notes"])
    assert "[2]" in data["returns"]
    code, out, _ = run_cli(capsys, "npu_add_layer_norm")
    assert code == 0 and "has no doc for this API" in out and "additional_output" in out


def test_real_summaries_agree_with_the_schema(real_root):
    """Our summaries quote signatures; the wheel is the authority, so they must match it."""
    summaries = api_docs.load_summaries()
    assert set(REQUIRED_SUMMARIES) <= set(summaries)
    for name, summary in summaries.items():
        api = api_docs.lookup(name)
        if name.startswith("optim."):
            assert api.python_signature == "torch_npu.optim." + summary.signature, name
        else:
            assert api.schemas, f"{name}: no schema in the wheel"
            assert api.schemas[0] == "torch_npu." + summary.signature, name
        assert summary.wheel_doc == (api.doc is not None), name


def test_real_name_forms(real_root):
    assert api_docs.lookup("torch_npu.npu_rms_norm").name == "npu_rms_norm"
    assert api_docs.lookup("torch.ops.npu.npu_swiglu").name == "npu_swiglu"
    adamw = api_docs.lookup("torch_npu.optim.NpuFusedAdamW")
    assert adamw.name == "optim.NpuFusedAdamW" and api_docs.lookup("NpuFusedAdamW").name == adamw.name
    assert adamw.python_signature.startswith("torch_npu.optim.NpuFusedAdamW(params, lr=1e-3")
    assert "bf16" in " ".join(adamw.summary.constraints)
    assert api_docs.lookup("torch_npu.atb.npu_ring_mla").name == "atb.npu_ring_mla"
    assert api_docs.lookup("npu_fused_infer_attention_score.out").schemas[0].startswith(
        "torch_npu.npu_fused_infer_attention_score.out("
    )
    sgd = api_docs.lookup("optim.NpuFusedSGD")  # module constants shown as their values
    assert sgd.python_signature == "torch_npu.optim.NpuFusedSGD(params, lr=required, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)"


def test_real_schema_only_op_without_doc_or_summary(capsys, real_root):
    code, out, _ = run_cli(capsys, "npu_renorm_backward")
    assert code == 0
    assert "torch_npu.npu_renorm_backward(Tensor grad" in out and "schema only" in out


def test_real_unknown_name_exits_2_with_suggestions(capsys, real_root):
    code, out, err = run_cli(capsys, "nosuch")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "unknown torch_npu API 'nosuch'" in err and "did you mean" in err
    code, _, err = run_cli(capsys, "npu_rms_nrom")
    assert code == 2 and "npu_rms_norm" in err
    code, _, err = run_cli(capsys, "torch_npu.npu_gmm")
    assert code == 2 and "MindSpeed" in err and "npu_grouped_matmul" in err
    code, _, err = run_cli(capsys)
    assert code == 2 and "--list" in err


def test_real_list(capsys, real_root):
    code, out, _ = run_cli(capsys, "--list")
    assert code == 0
    names = out.split()
    assert len(names) == len(set(names)) >= 217 + 9
    for name in ("npu_fusion_attention", "npu_add_rms_norm", "npu_add_layer_norm", "atb.npu_ring_mla",
                 "optim.NpuFusedAdamW", "npu_fused_infer_attention_score.out"):
        assert name in names
    code, out, _ = run_cli(capsys, "--list", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert set(rows) == set(names)
    assert rows["npu_add_rms_norm"]["summarised"] and "schema" in rows["npu_add_rms_norm"]["source"]


def test_real_every_doc_splits_into_sections(real_root):
    docs = api_docs.load_api_docs(real_root)
    with_params = [n for n, d in docs.items() if d.section("parameters")]
    with_description = [n for n, d in docs.items() if d.section("description")]
    # 2.14: npu_transpose_quant_batchmatmul's doc is empty; a few docs have no description text
    assert len(with_params) >= 233 and len(with_description) >= 231
    # a heading never leaks into a body as an unsplit line
    for name, doc in docs.items():
        for section in doc.sections:
            if section.key != "examples":
                for line in section.body.split("\n"):
                    assert line.strip() not in ("功能描述", "参数说明", "约束说明", "输出说明", "支持的型号"), name


def test_real_lookup_cold_reads_only_the_files_it_names(real_root, monkeypatch):
    """What keeps a cold lookup fast (~0.25 s measured): it reads the few doc / schema / optim files it names and
    never walks the wheel (several thousand files), and parses the schema yaml with libyaml where PyYAML has it.
    (A wall-clock bound here failed on a loaded CI machine: 3.5 s against 2.0 s; behaviour, not time, is tested.)"""
    import pathlib

    import yaml

    for cached in (api_docs.load_api_docs, api_docs.load_schemas, api_docs.load_summaries, api_docs.wheel_version):
        cached.cache_clear()
    read: list[pathlib.Path] = []
    real_read_text = pathlib.Path.read_text

    def read_text(self, *args, **kwargs):
        read.append(self)
        return real_read_text(self, *args, **kwargs)

    def no_walk(*args, **kwargs):
        raise AssertionError("a cold lookup walks a folder")

    monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    for name in ("rglob", "glob", "iterdir"):
        monkeypatch.setattr(pathlib.Path, name, no_walk)
    monkeypatch.setattr(os, "walk", no_walk)
    monkeypatch.setattr(os, "scandir", no_walk)
    api = api_docs.lookup("npu_fusion_attention")
    api.as_json()
    assert api.doc
    named = {real_root / "version.py", real_root / api_docs.OP_DOCS_FILE, real_root / api_docs.ATB_DOCS_FILE,
             *(real_root / rel for rel in api_docs.SCHEMA_FILES)}
    in_wheel = [p for p in read if str(p).startswith(str(real_root))]
    assert in_wheel and len(set(in_wheel)) == len(in_wheel), in_wheel  # each file read once
    assert all(p in named or p.parent == real_root / "optim" for p in in_wheel), in_wheel
    if hasattr(yaml, "CSafeLoader"):
        assert api_docs._yaml_loader() is yaml.CSafeLoader


def test_real_never_imports_torch_npu_or_torch(real_root):
    """The module must read the wheel without importing it (needs CANN) and without torch."""
    code = (
        "import sys; from npufuse import api_docs; "
        "api = api_docs.lookup('npu_fusion_attention'); api.as_json(); api_docs._render(api); "
        "assert 'torch_npu' not in sys.modules, 'torch_npu imported'; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    env = {**os.environ, api_docs.ENV_TORCH_NPU_PATH: str(real_root.parent)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------------------------
# the fixture wheel


def test_fixture_later_duplicate_wins(fixture_wheel):
    norm = api_docs.lookup("npu_fake_norm")
    assert "NEW DOC" in norm.doc and "OLD DOC" not in norm.doc
    assert norm.source == "torch_npu-0.0.1 wheel"
    assert any("also at line 12" in n for n in norm.notes)
    assert norm.socs() == ["Atlas A2 训练系列产品"]


def test_fixture_atb_calls_inside_a_function(fixture_wheel):
    atb = api_docs.lookup("torch_npu.atb.npu_fake_atb")
    assert atb.name == "atb.npu_fake_atb" and "later duplicate wins" in atb.doc
    assert atb.prototypes == ["torch_npu.atb.npu_fake_atb(x, *, y=None) -> Tensor"]
    assert atb.signature == atb.prototypes[0] and atb.schemas == []
    assert atb.constraints() == ["x 必须是2维."]  # 规格约束 counts as constraints
    assert api_docs.lookup("npu_fake_atb").name == "atb.npu_fake_atb"  # bare name finds its namespace


def test_fixture_heading_variants(fixture_wheel):
    api = api_docs.lookup("npu_fake_attention")
    keys = [s.key for s in api.sections]
    assert keys == ["prototype", "description", "formula", "parameters", "outputs", "constraints", "socs", "versions", "examples"]
    assert api.section("description") == "Fake attention used to test heading variants."
    assert api.section("formula") == "out = softmax(scale * q @ k^T) @ v"
    assert api.socs() == ["Atlas A2 训练系列产品", "Atlas A3 训练系列产品"]
    assert api.constraints() == ["该接口支持推理场景下使用.", "输入不能含有None."]
    assert api.section("versions") == "PyTorch 2.1"
    # comments inside example code that look like headings stay in the code
    assert "# 输出" in api.section("examples") and "# 调用示例" in api.section("examples")
    params = {p["name"]: p["doc"] for p in api.parameters()}
    assert params["key"] == "key: Tensor类型, 必选参数.\nkey 的第二行说明."
    assert params["sink"] is None  # in the schema, not in the doc


def test_fixture_prototype_that_differs_from_the_schema(capsys, fixture_wheel):
    api = api_docs.lookup("npu_fake_attention")
    # the multi-line prototype is joined
    assert api.prototypes == [
        "torch_npu.npu_fake_attention(Tensor query, Tensor key, *, Tensor? atten_mask=None, float scale=1.0, int next_tokens=65535) -> Tensor"
    ]
    assert api.schemas == [  # symint's duplicate entry is folded into one
        "torch_npu.npu_fake_attention(Tensor query, Tensor key, *, Tensor? atten_mask=None, float scale=1.0, int next_tokens=0, Tensor? sink=None) -> Tensor"
    ]
    assert api.signature == api.schemas[0]
    assert api.signature_notes == ["the doc prototype omits sink", "default of next_tokens: doc 65535, schema 0"]
    renamed = api_docs.lookup("npu_fake_norm")
    assert renamed.signature_notes == ["parameter names differ: doc input / schema self"]
    assert len(renamed.schemas) == 2 and ".out(" in renamed.schemas[1]
    code, out, _ = run_cli(capsys, "npu_fake_attention")
    assert code == 0
    assert "doc prototype differs from the schema: the doc prototype omits sink" in out
    assert "doc: torch_npu.npu_fake_attention(" in out


def test_fixture_raw_slice_keeps_escapes(fixture_wheel):
    doc = api_docs.lookup("npu_fake_latex").doc
    assert "$$\\frac{x}{1+e^{-1.702x}}$$ and \\begin{vmatrix}x\\end{vmatrix}" in doc
    assert api_docs.lookup("npu_fake_latex").section("formula").startswith("公式: $$\\frac")


def test_fixture_description_without_heading_and_inline_headings(fixture_wheel):
    nohead = api_docs.lookup("npu_fake_nohead")
    assert nohead.section("description") == "按元素计算一个结果, 文档没有功能描述标题."
    assert nohead.section("parameters") == "self (Tensor) - 数据类型：float16、float32。"
    assert nohead.constraints() == ["无"] and nohead.section("examples").startswith(">>>")
    assert nohead.signature_notes == []  # not in the fixture schema: nothing to compare
    inline = api_docs.lookup("npu_fake_inline")
    assert inline.section("description") == "行内内容跟在标题后面。"
    assert inline.prototypes == ["torch_npu.npu_fake_inline(Tensor x) -> Tensor"]
    assert inline.signature_notes == []
    assert api_docs.lookup("npu_fake_noproto").signature_notes == ["the doc has no prototype"]


def test_fixture_crlf_file_parses_the_same(tmp_path, monkeypatch):
    copy = tmp_path / "torch_npu"
    for path in (FIXTURE / "torch_npu").rglob("*"):
        if path.is_file():
            target = copy / path.relative_to(FIXTURE / "torch_npu")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    monkeypatch.setenv(api_docs.ENV_TORCH_NPU_PATH, str(tmp_path))
    api = api_docs.lookup("npu_fake_attention")
    assert "\r" not in api.doc
    assert api.signature_notes == ["the doc prototype omits sink", "default of next_tokens: doc 65535, schema 0"]
    assert "# 输出" in api.section("examples")


def test_fixture_schema_sections(capsys, fixture_wheel):
    schemas = api_docs.load_schemas(fixture_wheel)
    assert "add" in schemas.by_name and "add" not in schemas.op_names  # `supported` = ATen overrides
    assert "_fake_autograd_op" in schemas.op_names
    assert api_docs.schema_signature("npu_fake_norm.out", fixture_wheel).startswith("torch_npu.npu_fake_norm.out(")
    assert api_docs.schema_signature("torch_npu.npu_fake_norm", fixture_wheel) == (
        "torch_npu.npu_fake_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)"
    )
    assert api_docs.schema_signature("nosuch", fixture_wheel) is None
    # a schema op with neither doc nor summary is still answered
    code, out, _ = run_cli(capsys, "npu_fake_schema_only", "--json")
    data = json.loads(out)
    assert code == 0 and data["signature"] == "torch_npu.npu_fake_schema_only(Tensor self, int k=1) -> Tensor"
    assert [p["default"] for p in data["parameters"]] == [None, "1"]
    # an op the "wheel" has no doc for, answered from the schema + our summary
    add_rms = api_docs.lookup("npu_add_rms_norm")
    assert add_rms.source == "npufuse summary" and add_rms.signature_source == "schema"


def test_fixture_optim_class_read_statically(fixture_wheel):
    api = api_docs.lookup("torch_npu.optim.NpuFusedAdamW")
    assert api.python_signature == "torch_npu.optim.NpuFusedAdamW(params, lr=1e-3, weight_decay=1e-2)"
    assert api.section("description") == "Implements AdamW (fixture)."
    assert api.section("parameters").startswith("params (iterable)")
    assert [p["name"] for p in api.parameters()] == ["params", "lr", "weight_decay"]
    assert api.summary is not None and api.doc_file == "torch_npu/optim/npu_fused_adamw.py"


def test_fixture_list(capsys, fixture_wheel):
    code, out, _ = run_cli(capsys, "--list")
    assert code == 0
    names = out.split()
    assert names == sorted(names)
    # documented + atb + optim, plus the summarised op the fixture schema has (npu_add_rms_norm);
    # summaries whose op is missing from this schema, and schema-only ops, are not listed
    assert set(names) == {
        "npu_fake_norm", "npu_fake_latex", "npu_fake_attention", "npu_fake_nohead", "npu_fake_inline",
        "npu_fake_noproto", "atb.npu_fake_atb", "optim.NpuFusedAdamW", "npu_add_rms_norm",
    }


# --------------------------------------------------------------------------------------------
# without torch_npu


def test_fallback_summary_when_torch_npu_is_absent(capsys, no_wheel):
    code, out, err = run_cli(capsys, "torch_npu.npu_rms_norm")
    assert code == 0, err
    assert "(npufuse summary)" in out
    assert "torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)" in out
    assert "torch_npu is not installed" in out
    assert "pip install --no-deps torch-npu==2.14.0" in out and "torch_npu/_op_plugin_docs.py" in out
    assert "autograd: yes" in out


def test_fallback_json_and_every_required_api(capsys, no_wheel):
    for name in REQUIRED_SUMMARIES:
        code, out, err = run_cli(capsys, name, "--json")
        assert code == 0, (name, err)
        data = json.loads(out)
        assert data["source"] == "npufuse summary" and data["doc"] is None
        assert data["signature"] and data["signature_source"] == "npufuse summary"
        assert data["returns"] and data["parameters"]
        assert data["summary"]["spec"].startswith("§") and isinstance(data["summary"]["autograd"], bool)
    data = json.loads(run_cli(capsys, "npu_add_layer_norm", "--json")[1])
    assert any("npu_native_functions_by_codegen.yaml" in n for n in data["notes"])  # undocumented in the wheel
    data = json.loads(run_cli(capsys, "torch_npu.optim.NpuFusedSGD", "--json")[1])
    assert data["signature"].startswith("torch_npu.optim.NpuFusedSGD(params, lr=required")


def test_fallback_unknown_and_list(capsys, no_wheel):
    code, _, err = run_cli(capsys, "npu_mrope")  # real, but not summarised
    assert code == 2 and "torch_npu is not installed" in err and err.count("\n") == 1
    code, out, err = run_cli(capsys, "--list")
    assert code == 0 and set(out.split()) == set(api_docs.load_summaries())
    assert "not installed" in err
    rows = json.loads(run_cli(capsys, "--list", "--json")[1])
    assert {r["source"] for r in rows} == {"npufuse summary"}


def test_fallback_when_the_locator_finds_nothing(capsys, monkeypatch):
    monkeypatch.setattr(api_docs, "find_docs_root", lambda: None)
    code, out, _ = run_cli(capsys, "npu_swiglu")
    assert code == 0 and "npufuse summary" in out and "first half" in out.lower()


def test_summary_flag_forces_our_summary(capsys, fixture_wheel):
    data = json.loads(run_cli(capsys, "npu_rms_norm", "--summary", "--json")[1])
    assert data["source"] == "npufuse summary"


def test_locator_survives_the_emulator_stand_in(monkeypatch):
    """npufuse.emulate puts a spec-less module at sys.modules['torch_npu']; find_spec then raises."""
    import types

    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setenv(api_docs.ENV_TORCH_NPU_PATH, str(FIXTURE))
    assert api_docs.find_docs_root() == (FIXTURE / "torch_npu").resolve()


# --------------------------------------------------------------------------------------------
# units


@pytest.mark.parametrize(
    "line, key",
    [
        ("功能描述", "description"), ("功能描述:", "description"), ("功能描述：", "description"),
        ("- 参数说明", "parameters"), ("## 参数说明", "parameters"), ("**约束说明**", "constraints"),
        ("2. 支持版本", "versions"), ("支持的芯片型号:", "socs"), ("调用示例：", "examples"),
        ("返回值说明:", "outputs"), ("函数原型", "prototype"), ("功能描述实现", "description"),
    ],
)
def test_heading_forms(line, key):
    sections = api_docs.split_sections(f"{line}\nbody text")
    assert [(s.key, s.body) for s in sections] == [(key, "body text")]


def test_not_headings():
    text = "功能描述\n输入约束条件很多的一行\n示例一：\n参数说明中Shape涉及的变量说明：\n约束: 不是标题"
    assert [s.key for s in api_docs.split_sections(text)] == ["description"]


def test_parse_params():
    params = api_docs.parse_params(
        "x(Tensor(a!) self, int[2] r=[], str s=\"a,b\", *, Tensor? t=None, float e=1.) -> (Tensor, Tensor)"
    )
    assert [(p.name, p.type, p.default, p.keyword_only) for p in params] == [
        ("self", "Tensor(a!)", None, False), ("r", "int[2]", "[]", False), ("s", "str", '"a,b"', False),
        ("t", "Tensor?", "None", True), ("e", "float", "1.", True),
    ]
    assert api_docs.compare_prototype("f(a, b=1.0)", ["f(int a, float b=1.) -> Tensor"]) == []
    assert api_docs.compare_prototype("f(a, b=2^63-1)", ["f(int a, int b=9223372036854775807) -> Tensor"]) == []
