"""s43 audit fixes (audit43b): the classes behind the dubious candidate and the false near-miss reasons of this
session's precision audit on 10 repositories new to npufuse (bench/audit_s43b_precision.json,
bench/audit_s43b_near_misses.json).

D1 affinity_index_put (EmotiVoice ``Pitch._average_by_duration(self, input: np.array, d: np.array)``):
   ``arr = input[start:end]; arr[arr == 0] = 0`` on a parameter annotated as a numpy array became a candidate (its
   guard keeps numpy on the original, so a dead edit). A parameter annotated ``np.ndarray`` / ``np.array`` /
   ``NDArray`` is numpy, as an EvalPrediction already was.
R1 affinity_index_put (reason, Pytorch_mixture-of-experts ``SparseDispatcher.combine``):
   ``combined[combined == 0] = np.finfo(float).eps`` was called "a tensor not gathered with the same mask": numpy's
   finfo / iinfo fields are Python scalars, like torch.finfo's. The site is a masked_fill now.
R2 affinity_index_put (reason, InternLM-XComposer ``PLoRA.forward``): ``res[im_mask] += lora(x[im_mask])`` was
   "the value is not a scalar nor gathered with the same mask"; the value is computed from rows gathered with that
   mask (by Linear layers). The reason now says what holds: not shown to be the mask's gather element by element.
"""

from __future__ import annotations

from npufuse.patterns.affinity_index_put import AffinityIndexPut
from pattern_harness import detect_all

_NUMPY_ANNOTATED = '''\
import numpy as np
import torch


class Pitch(torch.nn.Module):
    def _average_by_duration(self, input: np.array, d: np.ndarray) -> np.array:
        d_cumsum = np.pad(d.cumsum(0), (1, 0), "constant")
        out = []
        for start, end in zip(d_cumsum[:-1], d_cumsum[1:]):
            arr = input[start:end]
            mask = arr == 0
            arr[mask] = 0
            out.append(arr.mean())
        return out
'''

# the twin: the same code on a parameter annotated as a torch tensor stays a candidate
_TENSOR_ANNOTATED = _NUMPY_ANNOTATED.replace("input: np.array", "input: torch.Tensor")


def test_d1_numpy_annotated_parameter_is_a_near_miss() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _NUMPY_ANNOTATED)
    assert not findings
    assert any("numpy array" in m.reason for m in misses), [m.reason for m in misses]


def test_d1_twin_tensor_annotated_parameter_stays_a_candidate() -> None:
    findings, _ = detect_all(AffinityIndexPut(), _TENSOR_ANNOTATED)
    assert len(findings) == 1 and findings[0].params["form"] == "masked_fill"


_NUMPY_EPS = '''\
import numpy as np
import torch


def combine(gates, batch_index, stitched):
    zeros = torch.zeros(gates.size(0), stitched.size(1), device=stitched.device)
    combined = zeros.index_add(0, batch_index, stitched.float())
    combined[combined == 0] = np.finfo(float).eps
    return combined.log()
'''

# near miss twin: a numpy array (not a scalar) as the value stays a near miss
_NUMPY_ARRAY_VALUE = _NUMPY_EPS.replace("np.finfo(float).eps", "np.linspace(0.0, 1.0, 7)")


def test_r1_numpy_finfo_field_is_a_scalar() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _NUMPY_EPS)
    assert len(findings) == 1, [m.reason for m in misses]
    assert findings[0].params["form"] == "masked_fill" and findings[0].params["value"] == "np.finfo(float).eps"


def test_r1_twin_numpy_array_value_stays_a_near_miss() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _NUMPY_ARRAY_VALUE)
    assert not findings and misses


_LORA_ON_SELECTED_ROWS = '''\
import torch


class PLoRA(torch.nn.Linear):
    def forward(self, x, im_mask):
        res = super().forward(x)
        part_x = x[im_mask]
        res[im_mask] += self.lora_b(self.lora_a(part_x)) * self.scaling
        return res
'''


def test_r2_augmented_value_from_gathered_rows_has_a_true_reason() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _LORA_ON_SELECTED_ROWS)
    assert not findings
    (miss,) = misses
    assert "nor gathered" not in miss.reason
    assert "not shown to be the same mask's gather element by element" in miss.reason


# R3 swiglu (reason, quip-sharp's quantized LlamaMLP): ``up, gate = self.upgate_proj(x)`` (one fused gate-up layer
# returning two tensors) then ``act(gate) * up`` was "gate and up are not projections of one input"; the reason now
# says they are unpacked from one call npufuse does not read.
_UNPACKED_GATE_UP = '''\
import torch
from transformers.activations import ACT2FN


class QuantizedMLP(torch.nn.Module):
    def __init__(self, config, upgate_proj, down_proj):
        super().__init__()
        self.upgate_proj = upgate_proj
        self.down_proj = down_proj
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        up_proj, gate_proj = self.upgate_proj(x.to(torch.float32))
        return self.down_proj(self.act_fn(gate_proj) * up_proj).to(x.dtype)
'''


def test_r3_gate_and_up_unpacked_from_one_call_have_a_true_reason() -> None:
    from npufuse.patterns.swiglu import Swiglu

    findings, misses = detect_all(Swiglu(), _UNPACKED_GATE_UP)
    assert not findings
    reasons = [m.reason for m in misses]
    assert any("unpacked from one call's result" in r for r in reasons), reasons
    assert not any("not projections of one input" in r for r in reasons), reasons


# D2 fused_optimizer (quip-sharp ``get_susv_adam``): ``torch.optim.Adam([{"params": susv_params, ..}, {"params":
# params, ..}])`` materialised and checked only the first group: a bf16 (or other-device) tensor in the second group
# reached NpuFusedAdam, which raises on bf16. Every group of plain names is materialised and checked now.
_TWO_NAMED_GROUPS = '''\
import torch


def get_susv_adam(susv_params, params, args):
    return torch.optim.Adam([
        {"params": susv_params, "lr": args.ft_susv_lr},
        {"params": params, "lr": args.ft_lr},
    ])
'''

# the twin: a later group that is not a plain name keeps the first-group guard (nothing to materialise safely)
_NAMED_THEN_CALL = _TWO_NAMED_GROUPS.replace('{"params": params, "lr": args.ft_lr}',
                                             '{"params": args.head_params, "lr": args.ft_lr}')


def _guard_of(code: str) -> str:
    import ast

    from npufuse.patterns.fused_optimizer import _guard
    from npufuse.scan.dataflow import ModuleInfo

    module = ModuleInfo.from_source("example.py", code)
    scope = next(s for s in module.scopes if s.qualname == "get_susv_adam")
    stmt = scope.node.body[0]
    call = stmt.value
    assert isinstance(call, ast.Call)
    guard, why = _guard(module, scope, call, stmt)
    assert guard is not None, why
    return guard


def test_d2_every_named_group_is_dtype_checked() -> None:
    import torch

    from npufuse.patterns.fused_optimizer import FusedOptimizer

    findings, _ = detect_all(FusedOptimizer(), _TWO_NAMED_GROUPS)
    assert len(findings) == 1
    guard = _guard_of(_TWO_NAMED_GROUPS)
    a = torch.nn.Parameter(torch.zeros(2))
    bf16 = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    env = {"susv_params": iter([a]), "params": iter([bf16])}
    assert eval(guard, {"torch": torch}, env) is None  # the bf16 group: the original optimizer runs
    assert env["susv_params"] == [a] and env["params"] == [bf16]  # both materialised once, for either branch
    env = {"susv_params": iter([a]), "params": iter([torch.nn.Parameter(torch.ones(3))])}
    assert eval(guard, {"torch": torch}, env) is a


def test_d2_twin_group_of_a_call_keeps_the_first_group_guard() -> None:
    guard = _guard_of(_NAMED_THEN_CALL)
    assert "susv_params := list(susv_params)" in guard and "params := list(params)" not in guard.replace("susv_params", "")


# R4 affinity_index_put (reason, Comprehensive-Transformer-TTS ``f0_to_coarse``): ``f0_mel = 1127 * (1 + f0 /
# 700).log() if is_torch else 1127 * np.log(1 + f0 / 700)`` then ``f0_mel[f0_mel <= 1] = 1`` was "`f0_mel` is a numpy
# array": it is a tensor whenever ``f0`` is one (the model calls it on tensors). A torch / numpy dispatch is numpy
# only when both arms are; the sites are candidates whose guard keeps numpy on the original.
_TORCH_OR_NUMPY = '''\
import numpy as np
import torch


def f0_to_coarse(f0, f0_bin=256):
    is_torch = isinstance(f0, torch.Tensor)
    f0_mel = 1127 * (1 + f0 / 700).log() if is_torch else 1127 * np.log(1 + f0 / 700)
    f0_mel[f0_mel <= 1] = 1
    return f0_mel
'''

# near miss twin: both arms numpy: still a numpy array
_NUMPY_BOTH_ARMS = _TORCH_OR_NUMPY.replace("1127 * (1 + f0 / 700).log() if is_torch", "1127 * np.log1p(f0 / 700) if is_torch")


def test_r4_torch_or_numpy_dispatch_is_not_called_numpy() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _TORCH_OR_NUMPY)
    assert not any("numpy array" in m.reason for m in misses), [m.reason for m in misses]
    assert len(findings) == 1 and findings[0].params["form"] == "masked_fill"


def test_r4_twin_numpy_in_both_arms_stays_numpy() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _NUMPY_BOTH_ARMS)
    assert not findings and any("numpy array" in m.reason for m in misses)


# R5 affinity_index_put (reason, same repository ``norm_interp_f0``): ``f0[uv] = np.interp(...)`` was "value ... is a
# tensor not gathered with the same mask": np.interp returns a numpy array.
_NUMPY_VALUE = '''\
import numpy as np
import torch


def norm_f0(f0, uv, config):
    is_torch = isinstance(f0, torch.Tensor)
    f0 = torch.log2(f0 + 1e-8) if is_torch else np.log2(f0 + 1e-8)
    return f0


def norm_interp_f0(f0, config):
    uv = f0 == 0
    f0 = norm_f0(f0, uv, config)
    if sum(uv) > 0:
        f0[uv] = np.interp(np.where(uv)[0], np.where(~uv)[0], f0[~uv])
    return f0, uv
'''


def test_r5_numpy_call_value_is_called_a_numpy_array() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _NUMPY_VALUE)
    assert not findings
    (miss,) = misses
    assert "is a numpy array not gathered" in miss.reason and "is a tensor" not in miss.reason
