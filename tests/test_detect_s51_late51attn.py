"""s51 late51attn: attention scores masked by a helper METHOD called with keywords only / declared @staticmethod
(HO28c genji970's class: ``self.padding_masking(attention_logits=.., attention_mask=..)``). Own reproducers."""

from __future__ import annotations

import torch
from pattern_harness import check_rewrite_runs, detect_all

from npufuse.patterns.attention import AttentionPattern

ATTN = AttentionPattern()

_CLASS = '''
import torch
from torch import nn


class PadAttention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.out = nn.Linear(dim, dim)

{helper}

    def forward(self, x, attention_mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-2, -1) / self.head_dim ** 0.5
        logits = {call}
        probs = logits.softmax(dim=-1)
        y = (probs @ v).transpose(1, 2).reshape(b, n, -1)
        return self.out(y)
'''

_STATIC = '''    @staticmethod
    def padding_masking(attention_logits, attention_mask):
        keep = attention_mask[:, None, None, :].bool()
        return attention_logits.masked_fill(~keep, float("-inf"))'''
_PLAIN = '''    def padding_masking(self, attention_logits, attention_mask):
        keep = attention_mask[:, None, None, :].bool()
        return attention_logits.masked_fill(~keep, torch.finfo(attention_logits.dtype).min)'''
_STATIC_BIAS = '''    @staticmethod
    def padding_masking(attention_logits, attention_mask):
        return attention_logits + attention_mask[:, None, None, :]'''
_CLASSMETHOD = '''    @classmethod
    def padding_masking(cls, attention_logits, attention_mask):
        keep = attention_mask[:, None, None, :].bool()
        return attention_logits.masked_fill(~keep, float("-inf"))'''

_KW_CALL = "self.padding_masking(attention_logits=logits, attention_mask=attention_mask)"
_POS_CALL = "self.padding_masking(logits, attention_mask)"

_RUN = '''
torch.manual_seed(0)
m = PadAttention()
x = torch.randn(2, 6, 32, requires_grad=True)
keep = torch.ones(2, 6)
keep[1, 4:] = 0
out = m(x, keep)
leaves = [x, m.qkv.weight]
'''


def _code(helper: str, call: str) -> str:
    return _CLASS.format(helper=helper, call=call)


def _fused_exact(code: str) -> None:
    findings, misses = detect_all(ATTN, code)
    assert len(findings) == 1 and not misses, [m.reason for m in misses]
    facts = check_rewrite_runs(ATTN, code, _RUN, findings)
    assert facts["calls"] >= 1
    assert facts["cos_out"] and min(facts["cos_out"]) > 0.99999
    assert facts["cos_grad"] and min(facts["cos_grad"]) > 0.99999


def test_fuse_static_method_keyword_call() -> None:
    _fused_exact(_code(_STATIC, _KW_CALL))


def test_fuse_static_method_positional_call() -> None:
    _fused_exact(_code(_STATIC, _POS_CALL))


def test_fuse_plain_method_keyword_call() -> None:
    _fused_exact(_code(_PLAIN, _KW_CALL))


def test_keep_static_method_adding_a_float_bias() -> None:
    findings, misses = detect_all(ATTN, _code(_STATIC_BIAS, _KW_CALL))
    assert not findings and len(misses) == 1
    assert "adds" in misses[0].reason and "float bias" in misses[0].reason


def test_keep_classmethod_not_read() -> None:
    findings, misses = detect_all(ATTN, _code(_CLASSMETHOD, _KW_CALL))
    assert not findings and len(misses) == 1
    assert "unsupported operation on the attention scores" in misses[0].reason


_STATIC_CHECKED = '''    @staticmethod
    def padding_masking(attention_logits, attention_mask, batch, length):
        if attention_mask.shape != (batch, length):
            raise ValueError("attention_mask must be [batch, length]")
        pad = attention_mask[:, None, None, :] == 0
        return attention_logits.masked_fill(pad, float("-inf"))'''
_CHECKED_CALL = "self.padding_masking(attention_logits=logits, attention_mask=attention_mask, batch=b, length=n)"
_STATIC_CHECK_WITH_CALL = _STATIC_CHECKED.replace("if attention_mask.shape", "if print() or attention_mask.shape")


def test_fuse_static_method_with_a_raising_shape_check() -> None:
    code = _code(_STATIC_CHECKED, _CHECKED_CALL)
    _fused_exact(code)
    findings, _ = detect_all(ATTN, code)
    facts = check_rewrite_runs(ATTN, code, _RUN, findings)
    assert "!= (b, n)" in facts["rewritten"]  # the check guards the fused call: the original runs (and raises) otherwise


def test_keep_raising_check_with_a_call_in_its_test() -> None:
    findings, misses = detect_all(ATTN, _code(_STATIC_CHECK_WITH_CALL, _CHECKED_CALL))
    assert not findings and len(misses) == 1
    assert "unsupported operation on the attention scores" in misses[0].reason


def test_fuse_checked_helper_under_a_none_test_runs_without_the_mask() -> None:
    # the check reads ``attention_mask.shape``: under ``if attention_mask is not None`` the guard must not read it on None
    code = _code(_STATIC_CHECKED, "logits\n        if attention_mask is not None:\n            logits = " + _CHECKED_CALL)
    findings, misses = detect_all(ATTN, code)
    assert len(findings) == 1 and not misses, [m.reason for m in misses]
    for run in (_RUN, _RUN.replace("out = m(x, keep)", "out = m(x, None)")):
        facts = check_rewrite_runs(ATTN, code, run, findings)
        assert facts["calls"] >= 1
        assert min(facts["cos_out"]) > 0.99999 and min(facts["cos_grad"]) > 0.99999
