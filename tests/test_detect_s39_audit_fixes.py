"""s39 audit fixes (audit39): the classes behind the WRONG candidates and false near-miss reasons of this
session's precision audit (bench/audit_s39_precision.json; 12 repositories new to npufuse).

B1 rms_norm: a transformers RMSNorm built into ``self.<attr>`` by a class that writes its own ``forward`` and
   never calls the module (VILA's COAT / FP8 decoder layers hand only ``self.input_layernorm.weight`` to an FP8
   kernel): no inherited forward calls it, so the construction swap changed nothing. Now a near miss; an
   inherited or aliased forward (``forward = Qwen2DecoderLayer.forward``) stays a candidate.
B2 every pattern: code after an unconditional ``raise`` / ``return`` in its block (VILA's ``if tp > 1: raise
   ValueError(...)`` left above the old tensor-parallel MLP) never runs: a near miss (sdpa had the rule alone).
B3 affinity_index_put: compute_metrics' ``EvalPrediction`` holds numpy arrays (transformers' Trainer numpifies
   them; GLM-4's finetune scripts): ``preds[preds == -100] = pad`` there is numpy, not torch.
B4 affinity_where: a branch ``torch.ones_like(x) * -1e9`` is the extreme constant spelled as a product (-inf in
   fp16): lerp is not inf-safe there, as for ``torch.full_like(x, -1e9)``.
B5 affinity_index_put (reason): an attribute or subscript alone is not evidence of a tensor value:
   ``x[mask] = self.num_classes - 1`` (an int) got "is a tensor not gathered with the same mask".
"""

from __future__ import annotations

from npufuse.patterns.affinity_index_put import AffinityIndexPut
from npufuse.patterns.affinity_where import AffinityWhere
from npufuse.patterns.base import Keep
from npufuse.patterns.rms_norm import RmsNorm
from npufuse.patterns.swiglu import Swiglu
from pattern_harness import check_keep_refused, detect_all

# -- B1: a transformers RMSNorm built by a class whose own forward never calls it

_NORM_OWN_FORWARD = '''
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm


class Fp8DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.mlp = nn.Linear(config.hidden_size, config.hidden_size)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states):
        return fp8_norm_linear(hidden_states, self.input_layernorm.weight, self.mlp.weight)
'''

_NORM_INHERITED_FORWARD = '''
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm


class QuantDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
{tail}'''


def test_norm_built_but_never_called_by_its_own_forward_is_a_near_miss() -> None:
    check_keep_refused(RmsNorm(), Keep(_NORM_OWN_FORWARD, reason="self.input_layernorm is never called"))
    _, misses = detect_all(RmsNorm(), _NORM_OWN_FORWARD)
    assert any("reads only self.input_layernorm.weight" in m.reason for m in misses)


def test_norm_called_by_an_inherited_or_aliased_forward_stays_a_candidate() -> None:
    for tail in ("", "\n    forward = LlamaDecoderLayer.forward\n",
                 "\n    def forward(self, *args, **kwargs):\n        return super().forward(*args, **kwargs)\n"):
        findings, _ = detect_all(RmsNorm(), _NORM_INHERITED_FORWARD.format(tail=tail))
        assert [f.variant for f in findings] == ["hf_norm_construction"], tail


# -- B2: code after an unconditional raise never runs

_SWIGLU_AFTER_RAISE = '''
import torch
import torch.nn.functional as F
from torch import nn


class Mlp(nn.Module):
    def __init__(self, d=16, h=32, tp=1):
        super().__init__()
        self.tp = tp
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        if self.tp > 1:
            raise ValueError("tensor parallel is not implemented")
            gate = self.gate_proj(x)
            up = self.up_proj(x)
            return self.down_proj(F.silu(gate) * up)
        {guarded}return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
'''


def test_code_after_an_unconditional_raise_is_a_near_miss() -> None:
    findings, misses = detect_all(Swiglu(), _SWIGLU_AFTER_RAISE.format(guarded=""))
    # the reachable return is still the candidate; the dead one is a near miss saying why
    assert [f.line for f in findings] == [19]
    assert any(m.line == 18 and "unreachable" in m.reason for m in misses), [(m.line, m.reason) for m in misses]


def test_a_raise_inside_an_if_does_not_make_what_follows_unreachable() -> None:
    code = _SWIGLU_AFTER_RAISE.replace('            raise ValueError("tensor parallel is not implemented")\n',
                                       '            if self.tp > 8:\n                raise ValueError("too many")\n')
    findings, _ = detect_all(Swiglu(), code.format(guarded=""))
    assert len(findings) == 2


# -- B3: the arrays of transformers' EvalPrediction are numpy

_EVAL_PREDICTION = '''
import torch
from transformers import EvalPrediction


def compute_metrics(eval_preds: EvalPrediction, tokenizer):
    batched_pred_ids, batched_label_ids = eval_preds
    batched_pred_ids[batched_pred_ids == -100] = tokenizer.pad_token_id
    return batched_pred_ids
'''

_EVAL_PREDICTION_ATTR = '''
import torch
from transformers.trainer_utils import EvalPrediction


def compute_metrics(p: EvalPrediction):
    labels = p.label_ids
    labels[labels == -100] = 0
    return labels
'''

_TENSOR_PARAM = '''
import torch


def compute_metrics(batched_pred_ids, tokenizer):
    batched_pred_ids[batched_pred_ids == -100] = tokenizer.pad_token_id
    return batched_pred_ids
'''


def test_eval_prediction_arrays_are_numpy() -> None:
    check_keep_refused(AffinityIndexPut(), Keep(_EVAL_PREDICTION, reason="`batched_pred_ids` is a numpy array"))
    check_keep_refused(AffinityIndexPut(), Keep(_EVAL_PREDICTION_ATTR, reason="`labels` is a numpy array"))
    findings, _ = detect_all(AffinityIndexPut(), _TENSOR_PARAM)
    assert len(findings) == 1


# -- B4: an extreme constant spelled as a product

_ONES_TIMES_BIG = '''
import torch


def top_k_logits(logits, k):
    values, _ = torch.topk(logits, k=k)
    k_largest = torch.min(values)
    logits = torch.where(logits < k_largest, torch.ones_like(logits) * {c}, logits)
    return logits
'''


def test_ones_like_times_a_huge_constant_is_not_inf_safe() -> None:
    check_keep_refused(AffinityWhere(), Keep(_ONES_TIMES_BIG.format(c="-1e9"), reason="the dtype's extreme value"))
    findings, _ = detect_all(AffinityWhere(), _ONES_TIMES_BIG.format(c="-0.5"))
    assert len(findings) == 1


# -- B5: an int value is not "a tensor"

_INT_VALUE = '''
import torch


class RelativeSep:
    def __init__(self, num_classes: int):
        self.num_classes = num_classes

    def generate(self, feat, same_chain_mask):
        encoded = feat.clone()
        encoded[~same_chain_mask] = self.num_classes - 1
        return encoded
'''


def test_an_attribute_value_is_not_called_a_tensor() -> None:
    _, misses = detect_all(AffinityIndexPut(), _INT_VALUE)
    reasons = [m.reason for m in misses]
    assert reasons and not any("is a tensor not gathered" in r for r in reasons), reasons
    assert any("is not known to be a scalar" in r for r in reasons), reasons
