"""Op-check inputs for a candidate that swaps a library ``nn.RMSNorm`` where it is constructed.

The rms_norm pattern rewrites ``self.norm = nn.RMSNorm(...)`` (the construction statement, in
``__init__`` or a factory) so that the fused branch wraps the new module in
``_npufuse_rms_norm_swap``, which gives that instance a ``forward`` calling ``npu_rms_norm``.
Calling the function holding the site (``__init__``) computes nothing the fused op touches, so the
op check would report "fused branch never executed". Here the check runs the operator instead:

* the owner is built twice, with the candidate's switch off and on (the switch is read at
  construction), each time from the same seed, so the two builds have the same weights;
* the swapped module is the one whose instance ``forward`` was defined on the site's lines of
  the rewritten file (a built ``nn.RMSNorm`` that the site did not swap is not it); its
  counterpart in the switch-off build (same module path) is the original ``nn.RMSNorm``;
* the target called by the three runs is ``module(x)`` on a small wrapper holding both, sharing
  one weight ``Parameter`` (its gradient is compared as ``param:weight``), which runs the
  original or the swapped one as the switch says: golden (float64, original), original (low
  precision) and fused (low precision, the swapped forward: its ``npu_rms_norm`` calls are
  counted from the site's lines, the proof that the fused branch ran);
* ``x`` is ``[B, S, *normalized_shape]`` of the module (B, S from the config heuristics or
  ``--batch/--seq-len``), or the first ``--shape``; its dtype is ``--dtype``, else the config's
  ``torch_dtype``, else bfloat16, as for the other norm candidates.
"""

from __future__ import annotations

import inspect
import os
import types
from typing import Any, Callable

import torch

from npufuse.cli import UsageError
from npufuse.verify import inputs as inp

SWAP_HELPER = "_npufuse_rms_norm_swap"


def is_construction_swap(fused_text: str) -> bool:
    """The candidate's fused branch swaps a module where it is built (not a call site)."""
    return f"{SWAP_HELPER}(" in fused_text


def _swapped_here(mod: torch.nn.Module, path: str, lines: tuple[int, int]) -> bool:
    """``mod`` carries an instance forward defined on the site's lines of the rewritten file."""
    fwd = mod.__dict__.get("forward")
    code = getattr(getattr(fwd, "__func__", None), "__code__", None)
    if code is None:
        return False
    return os.path.realpath(code.co_filename) == os.path.realpath(path) and lines[0] <= code.co_firstlineno <= lines[1]


def _build(target: inp.Target, module: types.ModuleType, values: dict[str, Any], init: dict[str, Any], lp: torch.dtype, seed: int) -> Any:
    """One build of what the site constructs: the owner class, or the factory's return value."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if target.owner is not None:
            return inp.construct(target.owner, module, values, init)
        made = inp.from_config_or_shapes(module, target, values, [], lp, init, None, None, seed)
        try:
            return target.fn(*made.args, **made.kwargs)
        except Exception as exc:
            raise UsageError(f"{target.qualname} raised {type(exc).__name__}: {exc} when called to build the module; pass --init NAME=VALUE") from None


def _norms(built: Any) -> list[tuple[str, torch.nn.Module]]:
    if isinstance(built, torch.nn.Module):
        return list(built.named_modules())
    if isinstance(built, (list, tuple)):
        return [(f"{i}.{n}" if n else str(i), m) for i, b in enumerate(built) if isinstance(b, torch.nn.Module) for n, m in b.named_modules()]
    return []


class _SwitchState:
    """Whether the op check's switch is on (set by :class:`SwapSwitcher`, read by the wrapper)."""

    on = False


def _pair_class(state: type[_SwitchState]) -> type[torch.nn.Module]:
    class RMSNormPair(torch.nn.Module):
        """The original nn.RMSNorm and the swapped one, sharing one weight: runs the one the
        switch selects (a fresh class per check: the switch state is a class attribute, which
        ``copy.deepcopy`` of an instance leaves shared)."""

        def __init__(self, original: torch.nn.Module, swapped: torch.nn.Module) -> None:
            super().__init__()
            weight = getattr(original, "weight", None)
            if isinstance(weight, torch.nn.Parameter):
                swapped.weight = weight
            self.original, self.swapped = original, swapped

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.swapped(x) if state.on else self.original(x)

    return RMSNormPair


def _call(pair: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return pair(x)


def swap_switcher(base: Any) -> Any:
    """The op check's switcher, also recording its state for the wrapper (same interface)."""
    state = type("SwitchState", (_SwitchState,), {"on": False})
    original_set: Callable[[bool], None] = base.set

    def set_switch(on: bool) -> None:
        original_set(on)
        state.on = on

    base.set = set_switch
    base._npufuse_swap_state = state
    return base


def swapped_norm_check(cand: Any, module: types.ModuleType, target: inp.Target, values: dict[str, Any], opts: Any, init: dict[str, Any], switch: Any) -> tuple[inp.Target, inp.CallInputs]:
    """The target and inputs of the op check of a construction-site swap (module docstring)."""
    assert cand.site is not None
    seed = opts.seed
    lp = inp.parse_dtype(opts.dtype) if opts.dtype else inp.DTYPES.get(str(values.get("torch_dtype", "bfloat16")).lower(), torch.bfloat16)
    for name, rec in (opts.traced_arguments or {}).items():
        if name not in init:  # the traced build's own arguments (npufuse trace)
            init[name] = inp.traced_argument(rec, module, values, lp, torch.Generator().manual_seed(seed), seed)
    lines = (cand.site.line, cand.site.end_line)
    switch.set(False)
    off = dict(_norms(_build(target, module, values, init, lp, seed)))
    switch.set(True)
    on = _norms(_build(target, module, values, init, lp, seed))
    switch.set(False)
    swapped = [(n, m) for n, m in on if _swapped_here(m, str(cand.path), lines)]
    if not swapped:
        raise UsageError(f"building {target.qualname.rsplit('.__init__', 1)[0]} with the switch on swapped no nn.RMSNorm at "
                         f"{cand.file}:{lines[0]}-{lines[1]} (the construction did not run with these arguments); pass --init NAME=VALUE")
    name, fused_norm = swapped[0]
    original = off.get(name)
    if not isinstance(original, torch.nn.RMSNorm) or _swapped_here(original, str(cand.path), lines):
        raise UsageError(f"building {target.qualname} with the switch off gave no plain nn.RMSNorm at `{name or 'self'}`: the switch does not turn the swap off")
    pair = _pair_class(switch_state_of(switch))(original, fused_norm).to(lp)
    gen = torch.Generator().manual_seed(seed)
    notes: list[str] = []
    inp.perturb_constant_parameters(pair, gen, notes)
    positional, named = inp.parse_shapes(list(opts.shapes))
    if named or len(positional) > 1:
        raise UsageError("a construction-site nn.RMSNorm candidate takes one --shape: the input x (AxBxC)")
    dims = inp.Dims.from_config(values, opts.batch, opts.seq_len)
    if positional:
        shape, dt = positional[0]
        x = torch.randn(*shape, generator=gen).to(inp.parse_dtype(dt) if dt else lp)
        source = "shape"
    else:
        x = torch.randn(dims.B, dims.S, *original.normalized_shape, generator=gen).to(lp)
        source = "config"
        notes.append(f"x is [batch {dims.B}, seq_len {dims.S}, *normalized_shape {list(original.normalized_shape)}] of the module "
                     "built at the site; --shape x=AxBxC gives another")
    notes.insert(0, f"the module built at the site (`{name or 'self'}`, {len(swapped)} swapped by it) is called on x: the original "
                    "nn.RMSNorm with the switch off, the swapped one with it on (one weight, shared)")
    call = Target(_call, type(pair), f"{target.qualname} -> {name or 'self'}.forward", [inspect.Parameter("x", inspect.Parameter.POSITIONAL_OR_KEYWORD)])
    return call, inp.CallInputs([x], {}, pair, source, x.dtype, notes, {"x": [list(x.shape), str(x.dtype).replace("torch.", "")]}, ["x"], {"x": True})


Target = inp.Target


def switch_state_of(switch: Any) -> type[_SwitchState]:
    state = getattr(switch, "_npufuse_swap_state", None)
    if state is None:
        raise RuntimeError("the switcher was not made by swap_switcher")
    return state
