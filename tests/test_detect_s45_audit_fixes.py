"""s45 audit fixes (audit45): the classes behind the wrong candidate and the false near-miss reason of this session's
precision audit on 14 repositories new to npufuse (bench/audit_s45_precision.json, bench/audit_s45_near_misses.json).

W1 affinity_index_put (UniAnimate's DWpose ``__call__``): ``candidate, subset = self.pose_estimation(img)`` returns
   numpy arrays; ``body = candidate[:, :18].copy()`` and later ``candidate[subset < 0.3] = -1`` became
   ``candidate.masked_fill_(...)``, an AttributeError on a numpy array. A ``.copy()`` / ``.astype()`` call on the
   target (or a slice of it) while it holds the same value shows it is not a torch tensor: a near miss.
W2 affinity_index_put (OpenSTL's MovingMNIST): ``digit_image = self.mnist[ind].copy()`` then ``digit_image[digit_image
   > 1] = 255``: a value returned by ``.copy()`` is of the receiver's kind, not a torch tensor (``copy.copy(t)``, the
   stdlib function, is no evidence).
R2 affinity_where (Score-Entropy-Discrete-Diffusion's ``Uniform.score_entropy``): the near miss quoted ``(self.dim - 1) /
   self.dim`` (a ratio of configuration numbers) as the op that can be inf/NaN; ``ratio.log()`` of the same branch is.
R1 moe_experts (Hetu-Galvatron's ``SequentialMLP.forward``): ``output, output_bias = expert(tokens)``, ``outs.append(
   output)`` and ``if self.add_bias: biases.append(output_bias...)``: the reason said "the loop keeps only one";
   it keeps both. The reason now names the other element the loop reads.
"""

from __future__ import annotations

from npufuse.patterns.affinity_index_put import AffinityIndexPut
from npufuse.patterns.affinity_where import AffinityWhere
from npufuse.patterns.moe_experts import MoeExperts
from pattern_harness import detect_all

_NUMPY_BY_COPY = '''\
import numpy as np
import torch


class PoseDetector:
    def __call__(self, image):
        with torch.no_grad():
            candidate, subset = self.pose_estimation(image)
            candidate = candidate[0][np.newaxis, :, :]
            subset = subset[0][np.newaxis, :]
            body = candidate[:, :18].copy()
            un_visible = subset < 0.3
            candidate[un_visible] = -1
        return body, candidate
'''

# the near miss's twin: the target rebound to a tensor after the `.copy()` (another value at the site) stays a candidate
_TENSOR_AFTER_COPY = _NUMPY_BY_COPY.replace(
    "            un_visible = subset < 0.3\n",
    "            candidate = torch.as_tensor(candidate)\n            un_visible = torch.as_tensor(subset) < 0.3\n")

# and `.astype(...)` is numpy's too
_NUMPY_BY_ASTYPE = _NUMPY_BY_COPY.replace("body = candidate[:, :18].copy()", "body = candidate.astype(np.float32)")


def test_w1_target_with_a_numpy_copy_call_is_a_near_miss() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _NUMPY_BY_COPY)
    assert not findings, [f.fused for f in findings]
    assert any("`candidate` is not a torch tensor" in m.reason and ".copy()" in m.reason for m in misses), \
        [m.reason for m in misses]


def test_w1_astype_call_is_evidence_too() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _NUMPY_BY_ASTYPE)
    assert not findings
    assert any("`.astype()`" in m.reason for m in misses), [m.reason for m in misses]


def test_w1_twin_rebound_to_a_tensor_stays_a_candidate() -> None:
    findings, _ = detect_all(AffinityIndexPut(), _TENSOR_AFTER_COPY)
    assert len(findings) == 1, findings
    assert "masked_fill_" in findings[0].fused


_ASSIGNED_FROM_COPY = '''\
import copy
import random

import numpy as np
import torch


class MovingDigits:
    def digit(self, background):
        ind = random.randint(0, self.mnist.shape[0] - 1)
        digit_image = self.mnist[ind].copy()
        if background:
            digit_image[digit_image > 1] = 255
        return digit_image
'''

# the twin: the stdlib ``copy.copy`` of a tensor is a tensor (the site stays a candidate)
_STDLIB_COPY = _ASSIGNED_FROM_COPY.replace("self.mnist[ind].copy()", "copy.copy(self.frames[ind])")


def test_w2_value_assigned_from_a_copy_call_is_a_near_miss() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _ASSIGNED_FROM_COPY)
    assert not findings, [f.fused for f in findings]
    assert any("`digit_image` is not a torch tensor: it is assigned `self.mnist[ind].copy()`" in m.reason
               for m in misses), [m.reason for m in misses]


def test_w2_twin_stdlib_copy_stays_a_candidate() -> None:
    findings, _ = detect_all(AffinityIndexPut(), _STDLIB_COPY)
    assert len(findings) == 1, findings


_ATTRIBUTE_RATIO_AND_LOG = '''\
import torch


class Uniform:
    def score_entropy(self, score, sigma, x, x0):
        esigm1 = torch.expm1(sigma)
        ratio = 1 - self.dim / (esigm1 + self.dim)
        const = torch.where(
            x == x0,
            (self.dim - 1) / self.dim * ratio * (ratio.log() - 1),
            score.mean(dim=-1) * ratio,
        )
        return const
'''

# the twin: with no other unsafe op the attribute ratio is still the quoted one (the near miss itself is unchanged)
_ATTRIBUTE_RATIO_ONLY = _ATTRIBUTE_RATIO_AND_LOG.replace(" * (ratio.log() - 1)", "")


def _where_reasons(code: str) -> list[str]:
    findings, misses = detect_all(AffinityWhere(), code)
    assert not findings, [f.fused for f in findings]
    return [m.reason for m in misses]


def test_r2_the_log_is_quoted_not_the_attribute_ratio() -> None:
    reasons = _where_reasons(_ATTRIBUTE_RATIO_AND_LOG)
    assert any("computes `ratio.log()`" in r for r in reasons), reasons


def test_r2_twin_attribute_ratio_alone_is_still_quoted() -> None:
    reasons = _where_reasons(_ATTRIBUTE_RATIO_ONLY)
    assert any("computes `(self.dim - 1) / self.dim`" in r for r in reasons), reasons


_EXPERT_OUTPUT_AND_BIAS = '''\
import torch
from torch import nn


class SequentialMLP(nn.Module):
    def __init__(self, experts, add_bias):
        super().__init__()
        self.local_experts = nn.ModuleList(experts)
        self.add_bias = add_bias

    def forward(self, permuted_tokens, tokens_per_expert):
        tokens_list = torch.split(permuted_tokens, tokens_per_expert.tolist())
        output_local_list = []
        output_bias_list = []
        for expert, tokens in zip(self.local_experts, tokens_list):
            output, output_bias = expert(tokens)
            output_local_list.append(output)
            if self.add_bias:
                output_bias_list.append(output_bias.expand_as(output))
        output_local = torch.cat(output_local_list, dim=0)
        output_bias_local = torch.cat(output_bias_list, dim=0) if self.add_bias else None
        return output_local, output_bias_local
'''

# the twin: the bias dropped (never read) keeps the old, true reason
_EXPERT_BIAS_DROPPED = _EXPERT_OUTPUT_AND_BIAS.replace(
    "            if self.add_bias:\n                output_bias_list.append(output_bias.expand_as(output))\n", "")


def _moe_reasons(code: str) -> list[str]:
    findings, misses = detect_all(MoeExperts(), code)
    assert not findings
    return [m.reason for m in misses]


def test_r1_second_element_collected_under_a_condition_is_named() -> None:
    reasons = _moe_reasons(_EXPERT_OUTPUT_AND_BIAS)
    assert any("uses more than one of them (also `output_bias`)" in r for r in reasons), reasons
    assert not any("keeps only one" in r for r in reasons), reasons


def test_r1_twin_dropped_element_keeps_the_only_one_reason() -> None:
    reasons = _moe_reasons(_EXPERT_BIAS_DROPPED)
    assert not any("uses more than one" in r for r in reasons), reasons
