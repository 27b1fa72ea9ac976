"""``npufuse.emulate``: a plain-PyTorch stand-in for the ``torch_npu`` module.

Every fused API here has torch_npu 2.14's name, signature, defaults and return convention and
computes the documented result (``shared/specs/torch_npu_api.md``) on any device, with autograd
where the real op has a backward (ops without one warn in backward and pass no gradient, as
torch_npu's autograd fallback does). It is as strict as the documented op: inputs the real op
rejects raise ``TypeError`` or ``NpuOpError`` (a ``RuntimeError``, like torch_npu's
``TORCH_CHECK``, and a ``ValueError``) naming the argument.

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

The stand-in is a well-formed package for the probes libraries run before using it
(transformers' ``is_torch_npu_available``, accelerate's ``is_npu_available``, peft):
``importlib.util.find_spec("torch_npu")`` (and of ``torch_npu.npu`` / ``torch_npu.optim``) returns
a real ``ModuleSpec``; ``importlib.metadata.version("torch_npu")`` answers
``2.14.0+npufuse.emulated`` (a distribution finder on ``sys.meta_path`` for the block's
duration, so the version says it is emulated wherever it is shown); ``torch.npu`` has the
device-module functions they call. ``install(name_device=True)`` also makes
``torch.device("npu")`` parse (accelerate's ``PartialState`` device choice, and so Trainer's):
torch's privateuse1 backend is named ``npu``, which torch cannot undo and which makes
``torch.accelerator`` look for ``torch.npu`` from then on. Only for a process that stays emulated
to its end (the verify/trace probe in the user's command), never a scoped block.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import pathlib
import re
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


class _StandInLoader(importlib.abc.Loader):
    """Loader named by the stand-in's specs: its modules are built by install(), never read from disk."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return sys.modules.get(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_LOADER = _StandInLoader()
_METADATA = (
    "Metadata-Version: 2.1\n"
    "Name: torch_npu\n"
    f"Version: {EMULATED_VERSION}\n"
    "Summary: npufuse emulated stand-in for torch_npu (not the real package; numerics only)\n"
)


class _StandInDistribution(importlib.metadata.Distribution):
    """``importlib.metadata`` view of the stand-in: name torch_npu, version labelled emulated."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return _METADATA
        if filename == "top_level.txt":
            return "torch_npu\n"
        return None

    def locate_file(self, path: str | pathlib.PurePath) -> pathlib.Path:
        # nothing of the stand-in lies on disk
        return pathlib.Path("<npufuse-emulated-torch_npu>") / path


class _StandInDistributionFinder(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path`` while installed: finds no modules, only the stand-in's distribution.

    It sits first, so ``version("torch_npu")`` answers the emulated version even where a real
    torch_npu is installed (its module is replaced for the block too).
    """

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        return None

    def find_distributions(self, context: importlib.metadata.DistributionFinder.Context | None = None) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or re.sub(r"[-_.]+", "_", name).lower() == "torch_npu":
            yield _StandInDistribution()


def _package(name: str, doc: str, *, is_package: bool) -> types.ModuleType:
    mod = types.ModuleType(name, doc)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, _LOADER, is_package=is_package)
    mod.__loader__ = _LOADER
    mod.__package__ = name if is_package else name.rpartition(".")[0]
    if is_package:
        mod.__path__ = []  # a package without files: submodules come from sys.modules only
    return mod


def _build_module() -> types.ModuleType:
    import torch

    _load_ops()
    mod = _package("torch_npu", "npufuse emulated stand-in for torch_npu (not the real package)", is_package=True)
    mod.__version__ = EMULATED_VERSION
    mod.NPUFUSE_EMULATED = True
    optim = _package("torch_npu.optim", "emulated torch_npu.optim", is_package=True)
    npu = _package("torch_npu.npu", "emulated torch.npu device module", is_package=True)
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
    # torch.manual_seed seeds the privateuse1 device module through these (named npu: _name_npu_device)
    npu._is_in_bad_fork = lambda: False
    # further probes of transformers / accelerate / peft
    npu.is_bf16_supported = lambda *args, **kwargs: True
    npu.empty_cache = lambda: None
    npu.memory_allocated = lambda device=None: 0
    npu.memory_reserved = lambda device=None: 0
    npu.max_memory_reserved = lambda device=None: 0
    npu.set_compile_mode = lambda jit_compile=False: None
    npu.is_initialized = lambda: True
    # Trainer checkpoints save/restore torch.npu.random's RNG state; the emulated device's RNG is
    # the CPU generator (every emulated tensor lives on the host)
    rng = _package("torch_npu.npu.random", "emulated torch.npu.random", is_package=False)
    rng.get_rng_state = lambda device="npu": torch.get_rng_state()
    rng.get_rng_state_all = lambda: [torch.get_rng_state()]
    rng.set_rng_state = lambda new_state, device="npu": torch.set_rng_state(new_state)
    rng.set_rng_state_all = lambda new_states: torch.set_rng_state(new_states[0])
    for fn_name in ("get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all"):
        setattr(npu, fn_name, getattr(rng, fn_name))
    npu.random = rng
    mod.optim = optim
    mod.npu = npu
    return mod


_MISSING = object()


def _name_npu_device(torch: types.ModuleType) -> None:
    """``torch.device("npu")`` parses as it does with torch_npu installed (accelerate's
    ``PartialState.default_device`` builds it): torch's privateuse1 backend is named ``npu``.

    Process-wide and permanent (torch cannot rename it back; ``torch.accelerator`` then expects a
    ``torch.npu`` module, so only a process emulated to its end asks for it). No tensor or kernel
    lives on that device; emulated tensors stay on their own. Left alone when another backend
    already holds the name."""
    try:
        if torch._C._get_privateuse1_backend_name() == "privateuseone":
            torch.utils.rename_privateuse1_backend("npu")
    except (AttributeError, RuntimeError):
        pass


@contextlib.contextmanager
def install(name_device: bool = False) -> Iterator[Emulation]:
    """Put the stand-in under ``sys.modules["torch_npu"]`` for the duration of the block.
    ``name_device``: also name torch's privateuse1 backend ``npu`` (permanent: see the module doc)."""
    import torch

    mod = _build_module()
    emu = Emulation(mod)
    if name_device:
        _name_npu_device(torch)
    saved_modules = {k: sys.modules.get(k, _MISSING) for k in ("torch_npu", "torch_npu.optim", "torch_npu.npu", "torch.npu")}
    saved_torch_npu = getattr(torch, "npu", _MISSING)
    saved_is_npu = torch.Tensor.__dict__.get("is_npu", _MISSING)
    finder = _StandInDistributionFinder()
    sys.meta_path.insert(0, finder)
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
        sys.meta_path.remove(finder)
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
