"""``npufuse.emulate``: a plain-PyTorch stand-in for the ``torch_npu`` module.

Every fused API here has torch_npu 2.14's name, signature, defaults and return convention and
computes the documented result (``shared/specs/torch_npu_api.md``) on any device, with autograd
where the real op has a backward. It is as strict as the documented op: inputs the real op
rejects raise ``TypeError``/``ValueError`` naming the argument.

Installing is explicit and scoped::

    from npufuse import emulate
    with emulate.install() as emu:
        import torch_npu                      # the stand-in
        y = torch_npu.npu_rms_norm(x, w)[0]
    assert emu.calls["npu_rms_norm"] == 1     # proves the fused branch ran

Inside the context ``sys.modules["torch_npu"]`` is the stand-in, ``torch.npu.is_available()``
is True and ``Tensor.is_npu`` is True for every tensor (so generated device guards take the
fused branch on CPU). Everything is restored on exit. Results obtained this way are
*emulated*: numerically meaningful, never NPU performance.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

from npufuse.emulate.registry import REGISTRY, EmulatedApi, emulated

__all__ = ["install", "Emulation", "REGISTRY", "EmulatedApi", "emulated", "record_call", "api_names"]

# Op modules, each registering its APIs on import.
_OP_MODULES = ("norms", "activations", "rope", "attention", "softmax", "moe", "optim")

EMULATED_VERSION = "2.14.0+npufuse.emulated"

_ACTIVE: list["Emulation"] = []


def _load_ops() -> None:
    for name in _OP_MODULES:
        importlib.import_module(f"npufuse.emulate.{name}")


def api_names() -> list[str]:
    """Names of all emulated APIs (primary names, sorted)."""
    _load_ops()
    return sorted({api.name for api in REGISTRY.values()})


def record_call(name: str) -> None:
    """Count one call of ``name`` in every active emulation (used by classes such as optimizers)."""
    for emu in _ACTIVE:
        emu.calls[name] += 1


@dataclass
class Emulation:
    """Handle of an installed stand-in: ``calls`` counts calls per API name."""

    module: types.ModuleType
    calls: Counter = field(default_factory=Counter)

    def reset(self) -> None:
        self.calls.clear()


def _counted(name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        record_call(name)
        return fn(*args, **kwargs)

    wrapper.__name__ = name.rsplit(".", 1)[-1]
    wrapper.__qualname__ = wrapper.__name__
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped__ = fn  # inspect.signature follows this: same signature as the real op
    return wrapper


def _build_module() -> types.ModuleType:
    _load_ops()
    mod = types.ModuleType("torch_npu", "npufuse emulated stand-in for torch_npu (not the real package)")
    mod.__version__ = EMULATED_VERSION
    mod.NPUFUSE_EMULATED = True
    optim = types.ModuleType("torch_npu.optim", "emulated torch_npu.optim")
    npu = types.ModuleType("torch_npu.npu", "emulated torch.npu device module")
    for key, api in REGISTRY.items():
        if key.startswith("optim."):
            # classes count their own construction/steps through record_call
            setattr(optim, key.split(".", 1)[1], api.fn)
        else:
            setattr(mod, key, _counted(key, api.fn))
    npu.is_available = lambda: True
    npu.device_count = lambda: 1
    npu.current_device = lambda: 0
    npu.set_device = lambda device: None
    npu.synchronize = lambda device=None: None
    npu.get_device_name = lambda device=None: "npufuse-emulated"
    npu.max_memory_allocated = lambda device=None: 0
    npu.reset_peak_memory_stats = lambda device=None: None
    npu.manual_seed = lambda seed: None
    npu.manual_seed_all = lambda seed: None
    mod.optim = optim
    mod.npu = npu
    return mod


_MISSING = object()


@contextlib.contextmanager
def install() -> Iterator[Emulation]:
    """Put the stand-in under ``sys.modules["torch_npu"]`` for the duration of the block."""
    import torch

    mod = _build_module()
    emu = Emulation(mod)
    saved_modules = {k: sys.modules.get(k, _MISSING) for k in ("torch_npu", "torch_npu.optim", "torch_npu.npu", "torch.npu")}
    saved_torch_npu = getattr(torch, "npu", _MISSING)
    saved_is_npu = torch.Tensor.__dict__.get("is_npu", _MISSING)
    sys.modules["torch_npu"] = mod
    sys.modules["torch_npu.optim"] = mod.optim
    sys.modules["torch_npu.npu"] = mod.npu
    sys.modules["torch.npu"] = mod.npu
    torch.npu = mod.npu
    # torch_npu adds Tensor.is_npu; under emulation every tensor stands for an NPU tensor.
    torch.Tensor.is_npu = property(lambda self: True)
    _ACTIVE.append(emu)
    try:
        yield emu
    finally:
        _ACTIVE.remove(emu)
        for key, value in saved_modules.items():
            if value is _MISSING:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value
        if saved_torch_npu is _MISSING:
            if hasattr(torch, "npu"):
                delattr(torch, "npu")
        else:
            torch.npu = saved_torch_npu
        if saved_is_npu is _MISSING:
            if "is_npu" in torch.Tensor.__dict__:
                delattr(torch.Tensor, "is_npu")
        else:
            torch.Tensor.is_npu = saved_is_npu
