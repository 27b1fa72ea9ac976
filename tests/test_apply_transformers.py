"""Issue 4's transformers acceptance: apply every candidate of a scan to copies of real
``transformers`` modeling files of different families — dense (llama), MoE (mixtral, qwen2_moe),
Gemma-style ``1 + w`` norm (gemma), partial rotary (phi, gpt_neox), an encoder (bert) — then

- the rewritten module imports on this machine, which has no torch_npu;
- a tiny randomly initialised model built from its config (weights copied from the untouched
  original, nothing downloaded) gives the same logits with the switches on (emulated torch_npu:
  the fused APIs run) and off (``NPUFUSE_*=0``: bit-identical to the original).

transformers is not an npufuse dependency. The test looks for it in ``$NPUFUSE_TRANSFORMERS_PATH``,
then ``.venv/transformers-site`` (``pip install --no-deps --target .venv/transformers-site
transformers`` plus huggingface-hub, tokenizers, safetensors, regex, tqdm, typer), then the
environment; without it the test is skipped, saying so.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from apply_support import npufuse, state_of
from npufuse import emulate
from pattern_harness import cosine

SITE = Path(os.environ.get("NPUFUSE_TRANSFORMERS_PATH") or Path(__file__).resolve().parents[1] / ".venv" / "transformers-site")


def _transformers():
    if SITE.is_dir() and str(SITE) not in sys.path:
        sys.path.append(str(SITE))  # after the venv: its torch/numpy win
    try:
        return importlib.import_module("transformers")
    except Exception as exc:  # absent, or a broken partial install
        pytest.skip(f"transformers is not importable ({type(exc).__name__}: {exc}); install it into {SITE} to run this test")


VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)

# family -> (model package, config class, model class, config overrides, patterns that must be applied)
FAMILIES = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2), {"rms_norm", "rope", "attention"}),
    "mixtral": ("mixtral", "MixtralConfig", "MixtralForCausalLM", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2), {"rms_norm", "rope", "attention", "moe_experts"}),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, decoder_sparse_step=1), {"rms_norm", "rope", "attention", "moe_experts"}),
    "gemma": ("gemma", "GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=1, head_dim=16), {"rms_norm", "rope", "attention"}),
    "phi": ("phi", "PhiConfig", "PhiForCausalLM", dict(partial_rotary_factor=0.5), {"rope", "attention"}),
    "gpt_neox": ("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.25), {"rope", "attention"}),
    "bert": ("bert", "BertConfig", "BertForMaskedLM", dict(), {"attention"}),
}


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")


def _load(path: Path, package: str, name: str, monkeypatch):
    """The rewritten copy as a module of the real package, so its relative imports resolve
    (registered in sys.modules for the test's duration: transformers inspects its classes)."""
    spec = importlib.util.spec_from_file_location(f"{package}.{name}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_modeling_file_rewritten_matches(family, tmp_path, monkeypatch):
    transformers = _transformers()
    pkg, config_cls, model_cls, extra, must = FAMILIES[family]
    package = f"transformers.models.{pkg}"
    original = importlib.import_module(f"{package}.modeling_{pkg}")
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(original.__file__, repo / f"modeling_{pkg}.py")
    monkeypatch.chdir(tmp_path)
    assert npufuse("scan", "repo") in (0, 1)
    rc = npufuse("apply", "--accept", "all")
    state = state_of(tmp_path / ".npufuse")
    applied = [c for c in state["candidates"] if c["applied"]]
    scanned = {c["id"]: c for c in json.loads((tmp_path / ".npufuse" / "scan.json").read_text())["candidates"]}
    # "all" can only mean all that do not overlap: a nested site (swiglu inside an expert loop)
    # is skipped with its reason, exit 1; anything else not applied is a failure
    left = [scanned[i] for i in scanned if i not in {c["id"] for c in applied}]
    spans = [(scanned[c["id"]]["line"], scanned[c["id"]]["end_line"]) for c in applied]
    assert all(any(a <= c["end_line"] and c["line"] <= b for a, b in spans) for c in left), left
    assert rc == (1 if left else 0)
    assert must <= {c["pattern"] for c in applied}, f"{family}: applied {sorted({c['pattern'] for c in applied})}"
    path = repo / f"modeling_{pkg}.py"
    imported = {a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)}
    assert not any(m.split(".")[0] == "npufuse" for m in imported)  # the rewritten file never imports npufuse

    config = getattr(transformers, config_cls)(**BASE, **extra)
    config._attn_implementation = "eager"  # the modeling file's own attention code, which npufuse rewrote
    config._experts_implementation = "eager"  # likewise its own expert loop (v5 defaults to a kernel)
    torch.manual_seed(0)
    reference = getattr(original, model_cls)(config).eval()
    weights = reference.state_dict()
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding in the second row: the mask conversion matters
    batches = [{"input_ids": input_ids}, {"input_ids": input_ids, "attention_mask": mask}]
    # Logits compared where a token is real: a padded query row of a causal model attends to
    # nothing, and what comes out there is defined by neither HF nor the fused op (npufuse
    # reports it as a risk); no loss reads those positions.
    keep = [torch.ones(2, 12, dtype=torch.bool), mask.bool() if pkg != "bert" else torch.ones(2, 12, dtype=torch.bool)]
    expected = [_logits(reference, b) for b in batches]

    def build(module):
        model = getattr(module, model_cls)(config).eval()
        model.load_state_dict(weights, strict=True)
        return model

    # no torch_npu here: imports, and runs the original code
    plain = _load(path, package, f"_npufuse_{pkg}_plain", monkeypatch)
    assert plain.torch_npu is None
    model = build(plain)
    assert all(torch.equal(_logits(model, b), e) for b, e in zip(batches, expected))

    # switches on, emulated torch_npu: the fused branches run
    with emulate.install() as emu:
        model = build(_load(path, package, f"_npufuse_{pkg}_on", monkeypatch))
        on = [_logits(model, b) for b in batches]
    for c in applied:  # every applied site's fused branch ran: one of the APIs it calls was called
        names = set(re.findall(r"torch_npu\.([\w.]+)\(", scanned[c["id"]]["fused"]))
        assert any(emu.calls[n] for n in names), f"{family}: {c['pattern']} (calls {sorted(names)}) never ran; calls {dict(emu.calls)}"
    for got, want, k in zip(on, expected, keep):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert cosine(got[k], want[k]) >= 0.9999
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4)

    # switches off, emulated torch_npu still present: the original code, bit for bit
    for c in applied:
        sw = c["applied"]["switch"]
        if sw["kind"] == "env":
            monkeypatch.setenv(sw["name"], "0")
        else:  # a config field npufuse introduced: getattr(self.config, "use_npu_<id>", True)
            field = re.fullmatch(r'getattr\(self\.config, "(\w+)", True\)', sw["expr"])
            assert field, f"cannot turn off switch {sw['expr']!r} in this test"
            setattr(config, field.group(1), False)
    with emulate.install() as emu:
        model = build(_load(path, package, f"_npufuse_{pkg}_off", monkeypatch))
        off = [_logits(model, b) for b in batches]
    assert sum(emu.calls.values()) == 0, dict(emu.calls)
    assert all(torch.equal(a, b) for a, b in zip(off, expected))

    # and revert gives the file back byte for byte
    assert npufuse("revert") == 0
    assert path.read_bytes() == Path(original.__file__).read_bytes()
