"""s37 attention: a term added through a view of the scores goes to pse in the scores' shape; masked_fill by keyword
(the in-place form kept its keywords); the 'modified after softmax under if' reason shows what the arms compute."""

from __future__ import annotations

from pattern_harness import detect_all

from npufuse.patterns.attention import AttentionPattern


def _example(name: str) -> str:
    return next(e.code for e in AttentionPattern.FUSE + AttentionPattern.KEEP if e.name == name)


def test_window_term_is_built_on_zeros_of_the_scores_shape_and_passed_as_pse() -> None:
    (f,), _ = detect_all(AttentionPattern(), _example("s37_shifted_window_mask_added_through_a_reshape_of_the_scores"))
    # the scores are never computed on the fused branch: the term is the mask broadcast on a zero tensor of their shape
    assert "torch.zeros(torch.Size((*q.shape[:-1], k.shape[-2]))" in f.fused
    assert ".reshape(-1, shift_mask.shape[0], self.h, n, n)).view(torch.Size(" in f.fused
    assert "pse=_npufuse_pse" in f.fused and "atten_mask" not in f.fused  # any values (Swin's -100): no 0/-inf check


def test_five_d_windows_fold_the_pse_like_q_k_v() -> None:
    (f,), _ = detect_all(AttentionPattern(), _example("s37_five_d_windows_with_a_learned_bias_and_a_window_mask"))
    assert ".flatten(0, 1).contiguous())[1]" in f.fused  # pse [B*H, W, N, N], as q.flatten(0, 1)
    assert "q.flatten(0, 1)" in f.fused and ".unflatten(0, q.shape[:2])" in f.fused


def test_in_place_masked_fill_keeps_its_keywords() -> None:
    code = '''
import torch


def attend(q, k, v, keep):
    s = torch.matmul(q, k.transpose(-1, -2)) / 4.0
    s.masked_fill_(~keep, value=-1e9)
    return torch.matmul(s.softmax(-1), v)
'''
    (f,), _ = detect_all(AttentionPattern(), code)
    assert "_npufuse_mask = ~keep" in f.fused
    # (the keyword was dropped before: the step read as ``s.masked_fill(~keep)``, an unsupported operation); a small
    # keyword fill is refused as such
    _, misses = detect_all(AttentionPattern(), code.replace(", value=-1e9)", ", value=-2.0)"))
    assert any("not −inf or a large negative value" in m.reason for m in misses)


def test_nested_if_arms_are_shown_by_what_they_compute() -> None:
    code = '''
import torch
import torch.nn.functional as F


def attend(q, k, v, mask, drop, hide):
    s = torch.matmul(q, k.transpose(-1, -2)) * 0.25
    s = s.masked_fill(mask, -1e9)
    p = F.dropout(F.softmax(s, dim=-1), drop)
    if s.amax() > 0:
        if mask.dtype == torch.bool:
            p = p.masked_fill(hide, 0.0)
        else:
            pass
    return torch.matmul(p, v)
'''
    _, misses = detect_all(AttentionPattern(), code)
    (m,) = [m for m in misses if "modified after softmax" in m.reason]
    assert "p.masked_fill(hide, 0.0) if mask.dtype == torch.bool else" in m.reason
    assert "`p if mask.dtype" not in m.reason
