"""Under ``install()`` the stand-in passes the probes libraries run before using torch_npu.

transformers' ``is_torch_npu_available`` calls ``importlib.util.find_spec("torch_npu")`` and
``torch.npu.is_available()``; with ``__spec__`` None find_spec raised ``ValueError`` (issue 16).
The transformers check runs the real source (``.venv/transformers-site``) in a subprocess,
because its result is ``lru_cache``d per process.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from npufuse import emulate

ROOT = Path(__file__).resolve().parents[1]
TRANSFORMERS_SITE = ROOT / ".venv" / "transformers-site"


def test_find_spec_and_spec_of_package_and_submodules():
    with emulate.install() as emu:
        spec = importlib.util.find_spec("torch_npu")
        assert isinstance(spec, importlib.machinery.ModuleSpec) and spec.name == "torch_npu"
        assert emu.module.__spec__ is spec and spec.submodule_search_locations == []
        for sub in ("torch_npu.npu", "torch_npu.optim"):
            s = importlib.util.find_spec(sub)
            assert isinstance(s, importlib.machinery.ModuleSpec) and s.name == sub
            assert sys.modules[sub].__spec__ is s and sys.modules[sub].__package__ == sub
        import torch_npu.npu  # noqa: F401  (plain submodule imports work)
        from torch_npu.optim import NpuFusedAdamW  # noqa: F401
    assert "torch_npu" not in sys.modules or sys.modules["torch_npu"] is not emu.module


def test_metadata_version_is_labelled_emulated_and_only_inside():
    with emulate.install():
        assert importlib.metadata.version("torch_npu") == emulate.EMULATED_VERSION
        assert importlib.metadata.version("torch-npu") == emulate.EMULATED_VERSION
        assert "emulated" in emulate.EMULATED_VERSION
        assert "not the real package" in importlib.metadata.metadata("torch_npu")["Summary"]
    # the finder is gone with the block (no real torch_npu in this venv)
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("torch_npu")


def test_torch_npu_device_probes():
    with emulate.install():
        assert torch.npu.is_available() and torch.npu.device_count() == 1
        assert torch.npu.is_bf16_supported() is True
        assert torch.npu.memory_allocated() == 0
        # Trainer's checkpoint RNG round trip (trainer.py: torch.npu.random.get_rng_state_all)
        states = torch.npu.random.get_rng_state_all()
        a = torch.rand(3)
        torch.npu.random.set_rng_state_all(states)
        assert torch.equal(a, torch.rand(3))
        import torch_npu

        assert torch_npu.npu is torch.npu


@pytest.mark.skipif(not (TRANSFORMERS_SITE / "transformers").is_dir(), reason="transformers source not in .venv")
def test_transformers_is_torch_npu_available_under_install():
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(TRANSFORMERS_SITE)!r})
        from npufuse import emulate
        with emulate.install():
            from transformers.utils import is_torch_npu_available
            from transformers.utils.import_utils import _is_package_available
            print("available", is_torch_npu_available(), is_torch_npu_available.__wrapped__(check_device=True))
            print("version", _is_package_available("torch_npu", return_version=True))
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "available True True" in proc.stdout
    assert f"version (True, '{emulate.EMULATED_VERSION}')" in proc.stdout


_HAS_ACCELERATE_PEFT = all((TRANSFORMERS_SITE / name / "__init__.py").is_file() for name in ("accelerate", "peft", "psutil"))

# accelerate's and peft's probes are lru_cached per process: each case runs in a fresh one
_ACCELERATE_PEFT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {site!r})
    import contextlib
    import torch
    from npufuse import emulate
    # as the verify/trace probe installs it in the user's command: for the whole process, device named
    with (emulate.install(name_device=True) if {emulated!r} else contextlib.nullcontext()):
        import accelerate
        from accelerate import Accelerator, PartialState
        from accelerate.utils import DistributedType, is_npu_available
        print("accelerate", accelerate.__version__, is_npu_available(), is_npu_available.__wrapped__(check_device=True))
        state = PartialState()
        print("state", state.device.type, state.distributed_type == DistributedType.NO, state.num_processes)
        acc = Accelerator()
        print("accelerator", acc.device.type, acc.distributed_type == DistributedType.NO)
        import peft
        from peft import LoraConfig, get_peft_model
        from peft.utils.other import infer_device
        print("peft", peft.__version__, infer_device())
        model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(8, 8)), LoraConfig(target_modules=["0"], r=2))
        out = model(torch.randn(2, 8))
        print("lora", type(model).__name__, tuple(out.shape), model.get_nb_trainable_parameters()[0])
    """
)


def _run_accelerate_peft(emulated: bool) -> str:
    code = _ACCELERATE_PEFT.format(site=str(TRANSFORMERS_SITE), emulated=emulated)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.skipif(not _HAS_ACCELERATE_PEFT, reason="accelerate/peft not in .venv/transformers-site (make venv installs them)")
def test_accelerate_and_peft_see_an_npu_under_install():
    """accelerate's is_npu_available (find_spec, import, torch.npu.device_count/is_available), its
    PartialState/Accelerator device choice (``torch.device("npu")``) and peft's infer_device all
    see the stand-in; a LoRA model still builds and runs (its tensors stay on the CPU)."""
    out = _run_accelerate_peft(emulated=True)
    assert "accelerate 1.15.0 True True" in out
    assert "state npu True 1" in out and "accelerator npu True" in out
    assert "peft 0.21.2 npu" in out
    assert "lora PeftModel (2, 8) 32" in out


@pytest.mark.skipif(not _HAS_ACCELERATE_PEFT, reason="accelerate/peft not in .venv/transformers-site (make venv installs them)")
def test_accelerate_and_peft_see_no_npu_without_install():
    """The same probes without the stand-in: no NPU (what makes the test above mean something)."""
    out = _run_accelerate_peft(emulated=False)
    assert "accelerate 1.15.0 False False" in out
    assert "state cpu True 1" in out and "accelerator cpu True" in out
    assert "peft 0.21.2 cpu" in out


_DEVICE_NAME = textwrap.dedent(
    """
    import warnings
    import torch
    from npufuse import emulate
    with emulate.install():
        try:
            torch.device("npu")
            print("scoped: parses")
        except RuntimeError:
            print("scoped: not named")
    # after a scoped block torch is as it was: an optimizer step asks torch.accelerator nothing odd
    p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.ones(2)
    torch.optim.Adam([p]).step()
    print("after scoped block: adam ok")
    held = emulate.install(name_device=True)   # as the probe does, for the rest of the process
    held.__enter__()
    dev = torch.device("npu", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.manual_seed(0)   # seeds the npu device module too: it has what torch calls
    p.grad = torch.ones(2)
    torch.optim.Adam([p]).step()
    print("named:", dev.type, dev.index, "adam ok")
    held.__exit__(None, None, None)
    """
)


def test_torch_device_npu_parses_only_where_the_process_stays_emulated():
    """accelerate builds ``torch.device("npu")``: the probe (emulated for the whole process) names
    torch's privateuse1 backend npu; a scoped install() does not (the name cannot be undone, and
    torch.accelerator would then look for a torch.npu the block's exit removed). A fresh process:
    the name is process-wide."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", _DEVICE_NAME], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["scoped: not named", "after scoped block: adam ok", "named: npu 0 adam ok"]
