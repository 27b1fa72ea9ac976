"""s46 recall sweep (helper sweep46c): the classes behind the misses on bench/detect_labels_sweep46c.json, six
repositories labelled before npufuse was run on them (development data).

A attention: a float bias added to the scores inside a module-level helper (SAM / ViTDet / GOT-OCR / Vary's
   ``attn = add_decomposed_rel_pos(attn, q, rel_pos_h, rel_pos_w, (H, W), (H, W))``, whose body builds two
   query-dependent tables and returns ``(attn.view(B, qh, qw, kh, kw) + rel_h[..] + rel_w[..]).view(B, qh*qw,
   kh*kw)``): the helper is ``s + h(0)``, the term goes to ``pse``. Near misses: a helper that scales its first
   parameter (``attn * gate + rel``), one that reads it twice (``attn + attn.mean(-1, keepdim=True)``), one with a
   branch, and a helper that returns the scores plus the bias under a view that changes the layout (a permute).
"""

from __future__ import annotations

import pytest

from npufuse.patterns.attention import AttentionPattern
from pattern_harness import detect_all, found_and_faithful


_SAM_REL_POS = '''
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn


def get_rel_pos(q_size: int, k_size: int, rel_pos: torch.Tensor) -> torch.Tensor:
    max_rel_dist = int(2 * max(q_size, k_size) - 1)
    if rel_pos.shape[0] != max_rel_dist:
        rel_pos_resized = F.interpolate(rel_pos.reshape(1, rel_pos.shape[0], -1).permute(0, 2, 1),
                                        size=max_rel_dist, mode="linear")
        rel_pos_resized = rel_pos_resized.reshape(-1, max_rel_dist).permute(1, 0)
    else:
        rel_pos_resized = rel_pos
    q_coords = torch.arange(q_size)[:, None] * max(k_size / q_size, 1.0)
    k_coords = torch.arange(k_size)[None, :] * max(q_size / k_size, 1.0)
    relative_coords = (q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)
    return rel_pos_resized[relative_coords.long()]


def add_decomposed_rel_pos(
    attn: torch.Tensor,
    q: torch.Tensor,
    rel_pos_h: torch.Tensor,
    rel_pos_w: torch.Tensor,
    q_size: Tuple[int, int],
    k_size: Tuple[int, int],
) -> torch.Tensor:
    """Decomposed relative positional embeddings (mvitv2)."""
    q_h, q_w = q_size
    k_h, k_w = k_size
    Rh = get_rel_pos(q_h, k_h, rel_pos_h)
    Rw = get_rel_pos(q_w, k_w, rel_pos_w)

    B, _, dim = q.shape
    r_q = q.reshape(B, q_h, q_w, dim)
    rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, Rh)
    rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, Rw)

    attn = (
        attn.view(B, q_h, q_w, k_h, k_w) + rel_h[:, :, :, :, None] + rel_w[:, :, :, None, :]
    ).view(B, q_h * q_w, k_h * k_w)

    return attn


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=True, use_rel_pos=False, input_size=None):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.use_rel_pos = use_rel_pos
        if self.use_rel_pos:
            self.rel_pos_h = nn.Parameter(torch.zeros(2 * input_size[0] - 1, head_dim))
            self.rel_pos_w = nn.Parameter(torch.zeros(2 * input_size[1] - 1, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, _ = x.shape
        qkv = self.qkv(x).reshape(B, H * W, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, B * self.num_heads, H * W, -1).unbind(0)

        attn = (q * self.scale) @ k.transpose(-2, -1)

        if self.use_rel_pos:
            attn = add_decomposed_rel_pos(attn, q, self.rel_pos_h, self.rel_pos_w, (H, W), (H, W))

        attn = attn.softmax(dim=-1)
        x = (attn @ v).view(B, self.num_heads, H, W, -1).permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
        x = self.proj(x)

        return x
'''

_SAM_RUN = '''
torch.manual_seed(0)
attn = Attention(32, num_heads=4, use_rel_pos=True, input_size=(3, 4))
with torch.no_grad():
    attn.rel_pos_h.normal_()
    attn.rel_pos_w.normal_()
x = torch.randn(2, 3, 4, 32, requires_grad=True)
out = attn(x)
leaves = [x, attn.rel_pos_h]
'''


def test_a_bias_added_inside_a_helper_is_found_and_runs() -> None:
    findings = found_and_faithful(AttentionPattern(), _SAM_REL_POS, _SAM_RUN)
    assert [f.qualname for f in findings] == ["Attention.forward"]


def test_a_bias_added_inside_a_helper_runs_without_the_bias_too() -> None:
    run = _SAM_RUN.replace("use_rel_pos=True", "use_rel_pos=False").replace(
        "with torch.no_grad():\n    attn.rel_pos_h.normal_()\n    attn.rel_pos_w.normal_()\n", "").replace(
        "leaves = [x, attn.rel_pos_h]", "leaves = [x]")
    findings = found_and_faithful(AttentionPattern(), _SAM_REL_POS, run)
    assert [f.qualname for f in findings] == ["Attention.forward"]


_NOT_ADDITIVE = {
    # the scores scaled inside the helper: no `s + h(0)` left
    "scales": ("attn.view(B, q_h, q_w, k_h, k_w) + rel_h", "attn.view(B, q_h, q_w, k_h, k_w) * 0.5 + rel_h"),
    # the scores read twice (a max subtracted)
    "reads_twice": ("    return attn\n", "    return attn - attn.amax(-1, keepdim=True)\n"),
    # a branch in the helper
    "branches": ("    return attn\n", "    if q_h > 1:\n        attn = attn.clamp(min=-50.0)\n    return attn\n"),
    # a permute of the sum changes the layout, not only the view
    "permutes": (").view(B, q_h * q_w, k_h * k_w)", ").permute(0, 2, 1, 4, 3).reshape(B, q_h * q_w, k_h * k_w)"),
}


@pytest.mark.parametrize("variant", sorted(_NOT_ADDITIVE))
def test_a_helper_that_does_more_than_add_to_the_scores_stays_a_near_miss(variant: str) -> None:
    old, new = _NOT_ADDITIVE[variant]
    code = _SAM_REL_POS.replace(old, new)
    assert code != _SAM_REL_POS
    findings, misses = detect_all(AttentionPattern(), code)
    assert findings == [] and any(m.qualname == "Attention.forward" for m in misses)
