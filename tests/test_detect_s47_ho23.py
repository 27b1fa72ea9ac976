"""s47 (fix47h): classes behind the remaining HO23a / HO23b misses (development data since s47), with invented
reproducers (several spellings each, and near misses).

1. attention: a softmax helper decorated with AMP's ``custom_fwd`` (no ``cast_inputs``, or ``cast_inputs=float32``)
   computes the softmax it spells (in float32 under autocast, as the fused op does): read as that softmax, where
   every decorator used to drop the whole site without a near miss.
"""

from __future__ import annotations

import pytest
from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.attention import AttentionPattern


def _near_miss(pattern: object, code: str, *phrases: str) -> None:
    """No candidate, and a near miss whose reason holds one of ``phrases``."""
    findings, misses = detect_all(pattern, code)  # type: ignore[arg-type]
    assert not findings
    assert any(any(p in m.reason for p in phrases) for m in misses), [m.reason for m in misses]


def _fused_and_runs(pattern: object, code: str, run: str, qualname: str) -> list:
    """One candidate in ``qualname``, whose rewrite runs under the emulator with the original's values."""
    findings, misses = detect_all(pattern, code)  # type: ignore[arg-type]
    assert [f.qualname for f in findings] == [qualname], [m.reason for m in misses]
    facts = check_rewrite_runs(pattern, code, run, findings)  # type: ignore[arg-type]
    assert facts["calls"] >= 1 and min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.9999, facts
    return findings


# -- 1. attention: a softmax helper under AMP's custom_fwd --------------------------------------------------------------

_AMP_SOFTMAX = '''\
import math
import torch


@torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
def softmax(x, dim):
    max_x = x.amax(dim=dim, keepdim=True)
    e = (x - max_x).exp()
    return e / e.sum(dim=dim, keepdim=True)


def attend(q, k, v, causal: bool = False):
    s = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        m = torch.triu(torch.ones((s, s), device=q.device), diagonal=1).bool()
        scores = scores.masked_fill(m, float("-inf"))
    p = softmax(scores, -1)
    return torch.matmul(p, v)
'''

_AMP_SOFTMAX_RUN = """
q = torch.randn(2, 4, 16, 8, requires_grad=True)
k = torch.randn(2, 4, 16, 8, requires_grad=True)
v = torch.randn(2, 4, 16, 8, requires_grad=True)
out = attend(q, k, v, True) + attend(q, k, v)
leaves = [q, k, v]
"""


@pytest.mark.parametrize("change", [
    ("", ""),
    ('@torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)', '@torch.amp.custom_fwd(device_type="cuda")'),
    ('@torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)', "@custom_fwd(cast_inputs=torch.float)"),
    ('@torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)', "@custom_fwd"),
])
def test_softmax_helper_under_amp_custom_fwd_fuses(change: tuple[str, str]) -> None:
    code = _AMP_SOFTMAX.replace(*change) if change[0] else _AMP_SOFTMAX
    if "@custom_fwd" in code:
        code = code.replace("import torch\n", "import torch\nfrom torch.cuda.amp import custom_fwd\n", 1)
    _fused_and_runs(AttentionPattern(), code, _AMP_SOFTMAX_RUN, "attend")


@pytest.mark.parametrize("decorator", [
    '@torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float16)',  # a half-precision softmax
    "@functools.lru_cache",  # not AMP's
    "@my_wrapper",
])
def test_softmax_helper_under_other_decorators_is_not_read(decorator: str) -> None:
    code = _AMP_SOFTMAX.replace('@torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)', decorator)
    code = code.replace("import torch\n", "import functools\nimport torch\n\n\ndef my_wrapper(f):\n    return lambda x, d: f(x * 2, d)\n", 1)
    findings, _ = detect_all(AttentionPattern(), code)
    assert not findings


_AMP_SOFTMAX_SINKS = _AMP_SOFTMAX.replace('''    p = softmax(scores, -1)
    return torch.matmul(p, v)''', '''    bh = scores.shape[0]
    sinks = sinks.reshape(-1, 1, 1).repeat(bh // sinks.shape[0], s, 1)
    scores = torch.cat([scores, sinks], dim=-1)
    p = softmax(scores, -1)
    p = p[..., :-1]
    return torch.matmul(p, v)''').replace("def attend(q, k, v, causal: bool = False):", "def attend(q, k, v, sinks, causal: bool = False):")


def test_sinks_on_merged_heads_through_amp_softmax_is_a_near_miss() -> None:
    # HO23a JorgeVanco: 3-D [(b h), S, D] scores with a per-head sink column and the decorated softmax: was silent
    _near_miss(AttentionPattern(), _AMP_SOFTMAX_SINKS, "attention sinks")
