"""Registry of emulated torch_npu APIs.

Each op module in this package decorates its functions with :func:`emulated`. The registry
records the public torch_npu name, whether the real op has a backward, the spec section it
implements, and its fidelity record: which behaviours are held against torch_npu's / op-plugin's
own tests (ported as independent goldens under tests/) and which are read from the docs and
sources only. ``npufuse emulate --list`` and the stand-in module are built from this one place,
and the test names are appended to the op's docstring.
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
    verified: tuple[str, ...] = field(default=())  # behaviours checked against the upstream tests' goldens
    docs_only: tuple[str, ...] = field(default=())  # behaviours taken from docs / sources, not from a test
    held_by: tuple[str, ...] = field(default=())  # our tests holding the verified ones ("tests/<file>::<test>")


def _fidelity_doc(verified: tuple[str, ...], docs_only: tuple[str, ...], held_by: tuple[str, ...]) -> str:
    # indented like the docstrings they extend, so inspect.cleandoc / help() dedent them together
    lines = ["", "", "    Fidelity (issue 20):"]
    if verified:
        lines.append("    * verified against torch_npu / op-plugin tests: " + "; ".join(verified) + ".")
    lines.append("    * read from docs/sources only: " + ("; ".join(docs_only) if docs_only else "nothing") + ".")
    if held_by:
        lines.append("    * held against: " + ", ".join(held_by) + ".")
    return "\n".join(lines)


def emulated(
    name: str,
    *,
    autograd: bool,
    spec: str,
    aliases: tuple[str, ...] = (),
    verified: tuple[str, ...] = (),
    docs_only: tuple[str, ...] = (),
    held_by: tuple[str, ...] = (),
) -> Callable:
    """Register ``fn`` as the emulation of ``torch_npu.<name>``, with its fidelity record."""

    def decorate(fn: Callable) -> Callable:
        doc = (fn.__doc__ or "").strip().splitlines()
        api = EmulatedApi(name, fn, autograd, spec, doc[0] if doc else "", aliases, verified, docs_only, held_by)
        for key in (name, *aliases):
            if key in REGISTRY:
                raise RuntimeError(f"emulated API registered twice: {key}")
            REGISTRY[key] = api
        if verified or docs_only or held_by:
            fn.__doc__ = (fn.__doc__ or "").rstrip() + _fidelity_doc(verified, docs_only, held_by)
        return fn

    return decorate


REGISTRY: dict[str, EmulatedApi] = {}
