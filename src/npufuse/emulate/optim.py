"""Fused optimizers of ``torch_npu.optim`` (spec §10): NpuFusedAdamW, NpuFusedAdam, NpuFusedSGD.

The real classes copy every param that has a grad at the first ``step()``/``zero_grad()``/
``clip_grad_norm_fused_()`` into one flat buffer per dtype and re-point the param/grad storages
into it. The math is plain ``torch.optim`` (the emulation subclasses it); what the flat buffers
imply is emulated as constraints:

* params that have a grad at the first combine must be float32 or float16 (``TypeError``), with
  dense grads (``TypeError``), and contiguous (``ValueError``, an emulator choice for the flat
  buffer); params without a grad are never checked, as ``_maybe_init_combined_params_and_grads``
  skips them (a frozen bf16 param is fine). Under emulation every tensor counts as an NPU tensor.
* ``step`` runs under ``torch.no_grad()`` and calls the closure directly (no ``enable_grad``).
* the set of params updated is frozen at that first combine: params without a grad then are
  never updated afterwards (silently, as on NPU), and ``zero_grad`` zeroes only those params.
* grads must never be re-allocated (``p.grad = new`` / set to None) and params never moved or
  re-assigned (``p.data = ...``): on NPU the update would silently go to the stale buffer; the
  emulation raises ``RuntimeError`` instead so a broken rewrite fails verification.
* ``zero_grad(set_to_none=True)`` raises ``ValueError`` (default is False).
* state ``step`` is a Python int; there are no ``foreach/fused/capturable/maximize/
  differentiable`` arguments (passing one is a ``TypeError``).

Each construction and each ``step()`` calls ``record_call("optim.<Class>")`` so an emulated run
can prove the fused optimizer ran.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch.optim.optimizer import required

from npufuse.emulate.checks import dtype_name
from npufuse.emulate.registry import emulated

_PARAM_DTYPES = (torch.float32, torch.float16)


def _record(name: str) -> None:
    # imported lazily: npufuse.emulate imports this module while building the registry
    from npufuse.emulate import record_call

    record_call(name)


class _NpuFusedOptimizer:
    """Behaviour shared by the fused optimizers; mixed in before the matching torch.optim class."""

    _torch_cls: type[torch.optim.Optimizer]
    _name: str  # public class name, used in messages and as "optim.<name>" in the call counter

    def _api(self) -> str:
        return self._name

    def _fused_init(self) -> None:
        self._fused_reset()
        _record(f"optim.{self._api()}")

    def _fused_reset(self) -> None:
        # Filled at the first combine (see module docstring); None until some param has a grad.
        self._fused_params: list[torch.Tensor] | None = None
        self._fused_grads: list[torch.Tensor] = []
        self._fused_ptrs: list[int] = []

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch.optim pickles only defaults/state/param_groups: a copy combines afresh.
        super().__setstate__(state)  # type: ignore[misc]
        self._fused_reset()

    # -- constraints ---------------------------------------------------------------------------

    def _check_param(self, p: torch.Tensor, where: str) -> None:
        if p.dtype not in _PARAM_DTYPES:
            raise TypeError(
                f"{self._api()}: params must be float32 or float16, got a {dtype_name(p.dtype)} param "
                f"{tuple(p.shape)} ({where}); keep fp32 master weights or use torch.optim"
            )
        if not p.is_contiguous():
            raise ValueError(f"{self._api()}: params must be contiguous, got strides {p.stride()} ({where})")

    def _combine(self) -> None:
        """Freeze the set of params the flat buffers hold, as the first combine on NPU does."""
        if self._fused_params is not None:
            return
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]  # type: ignore[attr-defined]
        if not params:
            return  # the real class retries at the next call
        for p in params:
            self._check_param(p, "at the first step")
            if p.grad.is_sparse:
                raise TypeError(f"{self._api()}: sparse gradients are not supported (param {tuple(p.shape)})")
        self._fused_params = params
        self._fused_grads = [p.grad for p in params]
        self._fused_ptrs = [p.data_ptr() for p in params]

    def _check_buffers(self) -> None:
        for p, g, ptr in zip(self._fused_params or (), self._fused_grads, self._fused_ptrs):
            if p.grad is not g:
                raise RuntimeError(
                    f"{self._api()}: the grad of a param {tuple(p.shape)} was re-allocated or set to None after "
                    "the first step; the fused optimizer keeps updating from its combined grad buffer, so on NPU "
                    "this update would be silently lost (accumulate into p.grad in place instead)"
                )
            if p.data_ptr() != ptr:
                raise RuntimeError(
                    f"{self._api()}: a param {tuple(p.shape)} was moved or its .data replaced after the first "
                    "step; on NPU the update would silently go to the stale combined buffer"
                )

    # -- torch.optim API -----------------------------------------------------------------------

    def _base_step(self) -> Callable[..., Any]:
        step = self._torch_cls.step
        # Once any instance of the torch class exists, its step is wrapped with the hook runner;
        # take the inner function so this optimizer's step hooks run once, not twice.
        return step.__wrapped__ if getattr(step, "hooked", False) else step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step with the math of the matching torch.optim class over the combined params.

        As ``NpuFusedOptimizerBase.step``: the whole step runs under ``torch.no_grad()`` and the
        closure is called directly, so a closure that needs autograd must enable it itself
        (torch.optim's classes wrap it in ``enable_grad``; the fused ones do not).
        """
        _record(f"optim.{self._api()}")
        loss = None
        if closure is not None:
            loss = closure()
        self._combine()
        if self._fused_params is None:
            return loss  # no param has a grad yet: the real class updates nothing
        self._check_buffers()
        fused = {id(p) for p in self._fused_params}
        hidden = []  # grads of params outside the combined buffers: the real step never sees them
        for group in self.param_groups:  # type: ignore[attr-defined]
            for p in group["params"]:
                if id(p) not in fused and p.grad is not None:
                    hidden.append((p, p.grad))
                    p.grad = None
        steps = self._steps_to_tensor()
        stepped = False
        try:
            self._base_step()(self)
            stepped = True
        finally:
            for p, g in hidden:
                p.grad = g
            self._steps_to_int(steps, stepped)
        return loss

    def _steps_to_tensor(self) -> dict[int, int]:
        # torch.optim keeps state["step"] as a CPU tensor; the fused classes keep a Python int.
        before: dict[int, int] = {}
        for p in self._fused_params or ():
            st = self.state.get(p)  # type: ignore[attr-defined]
            if st and "step" in st:
                n = int(st["step"].item()) if torch.is_tensor(st["step"]) else int(st["step"])
                before[id(p)] = n
                st["step"] = torch.tensor(float(n), dtype=torch.float32)
        return before

    def _steps_to_int(self, before: dict[int, int], stepped: bool) -> None:
        for p in self._fused_params or ():
            st = self.state.get(p)  # type: ignore[attr-defined]
            if st and torch.is_tensor(st.get("step")):
                # After a completed step every combined param advanced by one: derive the int from
                # the one we had instead of reading the tensor back (no device sync).
                st["step"] = before.get(id(p), 0) + 1 if stepped else int(st["step"].item())

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the combined grads in place; ``set_to_none=True`` raises ValueError (grads must stay allocated)."""
        if set_to_none:
            raise ValueError(
                f"{self._api()}: set_to_none=True is not supported by fused optimizers (grads live in a combined "
                "buffer and must not be freed); call zero_grad() or zero_grad(set_to_none=False)"
            )
        self._combine()
        if self._fused_params is None:
            super().zero_grad(set_to_none=False)  # type: ignore[misc]
            return
        self._check_buffers()
        with torch.no_grad():
            for g in self._fused_grads:
                if g.grad_fn is not None:
                    g.detach_()
                else:
                    g.requires_grad_(False)
                g.zero_()

    def clip_grad_norm_fused_(self, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Clip the combined grads in place to total norm ``max_norm``; returns the total norm (float32 tensor).

        As the real class: the norm is taken in fp32 over one flat buffer per dtype (fp32 params
        first, then fp16) holding the grads of the combined params that require grad;
        ``clip_coef = max_norm / (total_norm + 1e-6)`` is applied to every combined grad when < 1.
        ``norm_type=inf`` takes the max-abs. With no grads yet, returns ``tensor(0.)``.
        """
        self._combine()
        if self._fused_params is None:
            return torch.tensor(0.0)
        self._check_buffers()
        max_norm, norm_type = float(max_norm), float(norm_type)
        with torch.no_grad():
            per_dtype = []
            for dtype in _PARAM_DTYPES:
                grads = [g for p, g in zip(self._fused_params, self._fused_grads) if p.dtype == dtype and p.requires_grad]
                if not grads:
                    continue
                flat = torch.cat([g.reshape(-1) for g in grads]).float().abs()
                per_dtype.append(flat.max() if norm_type == math.inf else flat.pow(norm_type).sum())
            if not per_dtype:
                return torch.tensor(0.0)
            if norm_type == math.inf:
                total = torch.stack(per_dtype).max()
            else:
                total = torch.stack(per_dtype).sum().pow(1.0 / norm_type)
            clip_coef = max_norm / (total + 1e-6)
            if clip_coef < 1:
                for g in self._fused_grads:
                    g.mul_(clip_coef)
        return total


@emulated("optim.NpuFusedAdamW", autograd=False, spec="10",
    verified=(
        '10 steps over fp32/fp16 params with one param without grad, zero_grad (torch_npu test_fused_optimizers::test_step/test_zero_grad)',
    ),
    docs_only=(
        'step under no_grad with the closure called directly (source)',
        'frozen param set at the first combine',
        'clip_grad_norm_fused_',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_fused_optimizer_step_and_zero_grad',
        'tests/test_emulate_optim.py::test_closure_without_enable_grad_fails_as_on_npu',
    ),
)
class NpuFusedAdamW(_NpuFusedOptimizer, torch.optim.AdamW):
    """torch_npu.optim.NpuFusedAdamW: AdamW (decoupled weight decay) over combined fp32/fp16 buffers.

    ``NpuFusedAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False)``.
    Math identical to ``torch.optim.AdamW`` with the same arguments. Constraints: see module doc.
    """

    _torch_cls = torch.optim.AdamW
    _name = "NpuFusedAdamW"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
    ) -> None:
        torch.optim.AdamW.__init__(self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        self._fused_init()


@emulated("optim.NpuFusedAdam", autograd=False, spec="10",
    verified=(
        '10 steps over fp32/fp16 params with one param without grad, zero_grad (torch_npu test_fused_optimizers::test_step/test_zero_grad)',
    ),
    docs_only=(
        'step under no_grad with the closure called directly (source)',
        'frozen param set at the first combine',
        'clip_grad_norm_fused_',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_fused_optimizer_step_and_zero_grad',
    ),
)
class NpuFusedAdam(_NpuFusedOptimizer, torch.optim.Adam):
    """torch_npu.optim.NpuFusedAdam: Adam (L2 weight decay, g += wd*p) over combined fp32/fp16 buffers.

    ``NpuFusedAdam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False)``.
    Math identical to ``torch.optim.Adam`` with the same arguments. Constraints: see module doc.
    """

    _torch_cls = torch.optim.Adam
    _name = "NpuFusedAdam"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
    ) -> None:
        torch.optim.Adam.__init__(self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        self._fused_init()


@emulated("optim.NpuFusedSGD", autograd=False, spec="10",
    verified=(
        '10 steps with momentum over fp32/fp16 params with one param without grad, zero_grad (torch_npu test_fused_optimizers::test_step/test_zero_grad)',
    ),
    docs_only=(
        'step under no_grad with the closure called directly (source)',
        'lr required',
        'nesterov',
    ),
    held_by=(
        'tests/test_emulate_upstream.py::test_fused_optimizer_step_and_zero_grad',
    ),
)
class NpuFusedSGD(_NpuFusedOptimizer, torch.optim.SGD):
    """torch_npu.optim.NpuFusedSGD: SGD with optional momentum/Nesterov over combined fp32/fp16 buffers.

    ``NpuFusedSGD(params, lr=required, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)``:
    ``lr`` has no default — every param group must then give its own ``lr`` (``ValueError``
    otherwise, as torch.optim's ``required`` does). Math identical to ``torch.optim.SGD``.
    Constraints: see module doc.
    """

    _torch_cls = torch.optim.SGD
    _name = "NpuFusedSGD"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = required,  # type: ignore[assignment]
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        lr_required = lr is required
        if lr_required:
            # torch.optim.SGD has a numeric lr default and compares lr < 0; validate the
            # per-group lrs ourselves and keep `required` as the default for later groups.
            params = list(params)
            if not params or not all(isinstance(g, dict) and "lr" in g for g in params):
                raise ValueError(
                    "NpuFusedSGD: lr is required (no default); pass lr=... or give every param group an 'lr'"
                )
            lr = 0.0
        torch.optim.SGD.__init__(
            self, params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
        )
        if lr_required:
            self.defaults["lr"] = required
        self._fused_init()


@emulated("optim.NpuFusedAdadelta", autograd=False, spec="10",
    docs_only=(
        'math of torch.optim.Adadelta with the same arguments (no torch_npu/op-plugin test covers NpuFusedAdadelta)',
        'step under no_grad with the closure called directly; dtype checks only for params with a grad (as the other fused optimizers)',
    ),
    held_by=(
        'tests/test_emulate_optim.py::test_adadelta_and_rmsprop_step_as_torch_optim',
    ),
)
class NpuFusedAdadelta(_NpuFusedOptimizer, torch.optim.Adadelta):
    """torch_npu.optim.NpuFusedAdadelta over combined fp32/fp16 buffers.

    ``NpuFusedAdadelta(params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0)``. Math identical to
    ``torch.optim.Adadelta`` with the same arguments. Constraints: see module doc.
    """

    _torch_cls = torch.optim.Adadelta
    _name = "NpuFusedAdadelta"

    def __init__(self, params: Iterable[Any], lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0) -> None:
        torch.optim.Adadelta.__init__(self, params, lr=lr, rho=rho, eps=eps, weight_decay=weight_decay)
        self._fused_init()


@emulated("optim.NpuFusedRMSprop", autograd=False, spec="10",
    docs_only=(
        'math of torch.optim.RMSprop with the same arguments (no torch_npu/op-plugin test covers NpuFusedRMSprop)',
        'step under no_grad with the closure called directly; dtype checks only for params with a grad (as the other fused optimizers)',
    ),
    held_by=(
        'tests/test_emulate_optim.py::test_adadelta_and_rmsprop_step_as_torch_optim',
    ),
)
class NpuFusedRMSprop(_NpuFusedOptimizer, torch.optim.RMSprop):
    """torch_npu.optim.NpuFusedRMSprop over combined fp32/fp16 buffers.

    ``NpuFusedRMSprop(params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False)``.
    Math identical to ``torch.optim.RMSprop`` with the same arguments. Constraints: see module doc.
    """

    _torch_cls = torch.optim.RMSprop
    _name = "NpuFusedRMSprop"

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0,
                 momentum: float = 0, centered: bool = False) -> None:
        torch.optim.RMSprop.__init__(self, params, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum, centered=centered)
        self._fused_init()


__all__ = ["NpuFusedAdamW", "NpuFusedAdam", "NpuFusedSGD", "NpuFusedAdadelta", "NpuFusedRMSprop"]
