"""The stand-in is installed only inside the context, counts calls, and restores everything."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from npufuse import emulate


def test_install_is_scoped_and_restores_state():
    before = sys.modules.get("torch_npu")
    had_npu = hasattr(torch, "npu")
    with emulate.install() as emu:
        import torch_npu

        assert torch_npu is emu.module
        assert torch_npu.NPUFUSE_EMULATED is True
        assert torch.npu.is_available()
        assert torch.ones(1).is_npu is True
        assert "torch_npu.optim" in sys.modules
    assert sys.modules.get("torch_npu") is before
    assert hasattr(torch, "npu") == had_npu
    assert not hasattr(torch.ones(1), "is_npu")


def test_restores_on_exception():
    before = sys.modules.get("torch_npu")
    with pytest.raises(RuntimeError):
        with emulate.install():
            raise RuntimeError("boom")
    assert sys.modules.get("torch_npu") is before
    assert not hasattr(torch.ones(1), "is_npu")


def test_calls_are_counted_per_api():
    x = torch.randn(2, 3, 8)
    w = torch.ones(8)
    with emulate.install() as emu:
        import torch_npu

        torch_npu.npu_rms_norm(x, w, epsilon=1e-6)
        torch_npu.npu_rms_norm(x, w)
        assert emu.calls["npu_rms_norm"] == 2
        emu.reset()
        assert emu.calls["npu_rms_norm"] == 0
    # outside the context nothing counts any more
    emulate.REGISTRY["npu_rms_norm"].fn(x, w)
    assert emu.calls["npu_rms_norm"] == 0


def test_nested_installs_restore_outer():
    with emulate.install() as outer:
        with emulate.install() as inner:
            import torch_npu

            assert torch_npu is inner.module
        import torch_npu as again

        assert again is outer.module
        assert torch.ones(1).is_npu


def test_guarded_import_without_emulator_does_not_see_stand_in():
    # Outside install(), importing torch_npu gives the real package or fails; never the stand-in.
    try:
        mod = importlib.import_module("torch_npu")
    except Exception:
        return
    assert not getattr(mod, "NPUFUSE_EMULATED", False)


def test_every_required_api_is_emulated():
    required = """npu_rms_norm npu_add_rms_norm npu_gemma_rms_norm npu_swiglu npu_geglu npu_gelu_mul
    npu_fast_gelu fast_gelu npu_rotary_mul npu_apply_rotary_pos_emb npu_fusion_attention
    npu_fused_infer_attention_score npu_prompt_flash_attention npu_incre_flash_attention
    npu_scaled_masked_softmax npu_dropout_with_add_softmax npu_confusion_transpose npu_grouped_matmul
    npu_moe_token_permute npu_moe_token_unpermute npu_moe_init_routing npu_moe_gating_top_k_softmax
    npu_moe_finalize_routing npu_group_norm_silu npu_add_layer_norm
    optim.NpuFusedAdamW optim.NpuFusedAdam optim.NpuFusedSGD""".split()
    names = set(emulate.api_names())
    missing = [n for n in required if n not in names]
    assert not missing, f"not emulated: {missing}"
    with emulate.install():
        import torch_npu

        for n in required:
            owner, _, attr = n.rpartition(".")
            assert hasattr(torch_npu.optim if owner else torch_npu, attr), n


def test_signatures_match_real_schema_names():
    import inspect

    with emulate.install():
        import torch_npu

        sig = inspect.signature(torch_npu.npu_fusion_attention)
        assert list(sig.parameters)[:5] == ["query", "key", "value", "head_num", "input_layout"]
        assert "pre_tockens" in sig.parameters and "next_tockens" in sig.parameters
        assert sig.parameters["scale"].default == 1.0
        assert inspect.signature(torch_npu.npu_rms_norm).parameters["epsilon"].default == 1e-6
