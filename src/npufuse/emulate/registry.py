"""Registry of emulated torch_npu APIs.

Each op module in this package decorates its functions with :func:`emulated`. The registry
records the public torch_npu name, whether the real op has a backward, and the spec section
it implements, so ``npufuse emulate --list`` and the stand-in module are built from one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class EmulatedApi:
    name: str  # public name under torch_npu (e.g. "npu_rms_norm", or "optim.NpuFusedAdamW")
    fn: Callable
    autograd: bool  # the real op registers a backward
    spec: str  # section of shared/specs/torch_npu_api.md, e.g. "2.1"
    summary: str = ""
    aliases: tuple[str, ...] = field(default=())


REGISTRY: dict[str, EmulatedApi] = {}


def emulated(name: str, *, autograd: bool, spec: str, aliases: tuple[str, ...] = ()) -> Callable:
    """Register ``fn`` as the emulation of ``torch_npu.<name>``."""

    def decorate(fn: Callable) -> Callable:
        doc = (fn.__doc__ or "").strip().splitlines()
        api = EmulatedApi(name, fn, autograd, spec, doc[0] if doc else "", aliases)
        for key in (name, *aliases):
            if key in REGISTRY:
                raise RuntimeError(f"emulated API registered twice: {key}")
            REGISTRY[key] = api
        return fn

    return decorate
