"""The emulated attention ops against op-plugin's own tests (issue 20), goldens re-derived here.

Upstream: ``Ascend/op-plugin:test/test_custom_ops/test_npu_flash_attention.py``,
``test_prompt_flash_attention.py``, ``test_incre_flash_attention.py`` and
``test_npu_fused_infer_attention_score.py``. Tolerances are their ``assertRtolEqual`` defaults
(:mod:`upstream_tolerance`). Head counts and sequence lengths are reduced where marked so the file
runs in seconds on one core; layouts, dtypes, GQA ratios and scales are the upstream ones.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from npufuse.emulate.attention import (
    npu_fused_infer_attention_score,
    npu_fusion_attention,
    npu_incre_flash_attention,
    npu_prompt_flash_attention,
)
from upstream_tolerance import assert_rtol_equal


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)
    np.random.seed(0)


def _bnsd_to_bsh(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)


def _golden(q, k, v, scale, drop_mask=None, keep_prob=1.0):
    """tforward of the upstream file in fp64: softmax(QK^T * scale) (* drop_mask / keep_prob) @ V, with max/sum."""
    qk = q @ k.transpose(-1, -2) * scale
    x_max = qk.amax(dim=-1, keepdim=True)
    y = torch.exp(qk - x_max)
    x_sum = y.sum(dim=-1, keepdim=True)
    p = y / x_sum
    drop = p if drop_mask is None else p * drop_mask / keep_prob
    return drop @ v, p, x_max, x_sum


def test_fusion_attention_bsh():
    """test_npu_flash_attention / test_npu_flash_attention_tensor: BSH, fp16, scale 0.08838.

    [1, 32, 128, 128] BNSD reduced to 8 heads; golden in fp32 rounded to fp16.
    """
    q, k, v = (torch.randn(1, 8, 128, 128, dtype=torch.float16) for _ in range(3))
    gold = _golden(q.double(), k.double(), v.double(), 0.08838)[0]
    out = npu_fusion_attention(_bnsd_to_bsh(q), _bnsd_to_bsh(k), _bnsd_to_bsh(v), head_num=8, input_layout="BSH", scale=0.08838)
    assert_rtol_equal(_bnsd_to_bsh(gold).half(), out[0])


def _cu(lens):
    return [0] + np.cumsum(lens).tolist()


def test_fusion_attention_tnd_gqa_forward_backward_and_stats():
    """test_npu_flash_attention_tnd (shapes as upstream): TND, N1=8 query heads over N2=2 kv heads,
    seqlens q [1, 2, 3] / kv [3, 4, 5], D 128, scale 1/sqrt(D), softmax_layout "TND".

    Golden per sequence (supported_op_exec_with_softmax_out_tnd): fp32 tforward on kv heads
    broadcast to N1, softmax max/sum replicated 8x as [S1, N1, 8], and tbackward with the GQA
    sum of dk/dv over each group.
    """
    n1, n2, d = 8, 2, 128
    lq, lk = [1, 2, 3], [3, 4, 5]
    scale = 1 / math.sqrt(d)
    q = (2 * (torch.rand(sum(lq), n1, d) - 0.5)).half()
    k = (2 * (torch.rand(sum(lk), n2, d) - 0.5)).half()
    v = (2 * (torch.rand(sum(lk), n2, d) - 0.5)).half()
    dy = (2 * (torch.rand(sum(lq), n1, d) - 0.5)).half()
    cq, ck = _cu(lq), _cu(lk)
    out_g, dq_g = torch.zeros(q.shape, dtype=torch.float64), torch.zeros(q.shape, dtype=torch.float64)
    dk_g, dv_g = torch.zeros(k.shape, dtype=torch.float64), torch.zeros(v.shape, dtype=torch.float64)
    max_g, sum_g = [], []
    for i in range(3):
        qi = q[cq[i]:cq[i + 1]].double().transpose(0, 1)[None]
        ki = k[ck[i]:ck[i + 1]].double().transpose(0, 1)[None].repeat_interleave(n1 // n2, dim=1)
        vi = v[ck[i]:ck[i + 1]].double().transpose(0, 1)[None].repeat_interleave(n1 // n2, dim=1)
        o, p, m, s = _golden(qi, ki, vi, scale)
        out_g[cq[i]:cq[i + 1]] = o[0].transpose(0, 1)
        max_g.append(m[0].expand(n1, lq[i], 8).transpose(0, 1))
        sum_g.append(s[0].expand(n1, lq[i], 8).transpose(0, 1))
        dxi = dy[cq[i]:cq[i + 1]].double().transpose(0, 1)[None]
        dp = dxi @ vi.transpose(-1, -2)
        dv = p.transpose(-1, -2) @ dxi
        ds = (dp - (dp * p).sum(-1, keepdim=True)) * p * scale
        dq_g[cq[i]:cq[i + 1]] = (ds @ ki)[0].transpose(0, 1)
        dk = (ds.transpose(-1, -2) @ qi).view(1, n2, n1 // n2, lk[i], d).sum(2)
        dk_g[ck[i]:ck[i + 1]] = dk[0].transpose(0, 1)
        dv_g[ck[i]:ck[i + 1]] = dv.view(1, n2, n1 // n2, lk[i], d).sum(2)[0].transpose(0, 1)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    res = npu_fusion_attention(
        qr, kr, vr, n1, scale=scale, input_layout="TND", actual_seq_qlen=tuple(cq[1:]), actual_seq_kvlen=tuple(ck[1:]),
        softmax_layout="TND",
    )
    assert_rtol_equal(out_g.half(), res[0])
    assert_rtol_equal(torch.cat(max_g).float(), res[1])
    assert_rtol_equal(torch.cat(sum_g).float(), res[2])
    # derivatives.yaml: outputs 0-3 are differentiable
    assert all(t.requires_grad for t in res[:4])
    res[0].backward(dy)
    assert_rtol_equal(dq_g.half(), qr.grad)
    assert_rtol_equal(dk_g.half(), kr.grad)
    assert_rtol_equal(dv_g.half(), vr.grad)


def test_fusion_attention_with_external_dropout_mask():
    """test_npu_flash_attention_with_dropmask / _with_external_dropout_mask: keep_prob 0.9, BSH fp16.

    [1, 32, 256, 128] reduced to 4 heads; the mask is passed as ``dropout_mask`` (one uint8 per
    position, 1 = keep) and the golden is tforward with that mask.
    """
    q, k, v = (torch.randn(1, 4, 256, 128, dtype=torch.float16) for _ in range(3))
    keep = (torch.rand(1, 4, 256, 256) < 0.9).to(torch.uint8)
    gold = _golden(q.double(), k.double(), v.double(), 0.08838, keep.double(), 0.9)[0]
    out = npu_fusion_attention(
        _bnsd_to_bsh(q), _bnsd_to_bsh(k), _bnsd_to_bsh(v), head_num=4, input_layout="BSH", scale=0.08838, keep_prob=0.9,
        dropout_mask=keep, seed=7, offset=3,
    )
    assert out[0].shape == _bnsd_to_bsh(q).shape and out[1].shape[:2] == (1, 4)
    assert_rtol_equal(_bnsd_to_bsh(gold).half(), out[0])
    # test_npu_flash_attention_dropout_mask_reproducibility: same mask, same result
    again = npu_fusion_attention(
        _bnsd_to_bsh(q), _bnsd_to_bsh(k), _bnsd_to_bsh(v), head_num=4, input_layout="BSH", scale=0.08838, keep_prob=0.9,
        dropout_mask=keep, seed=7, offset=3,
    )
    assert torch.equal(out[0], again[0])


def test_fusion_attention_without_dropout_returns_seed_and_offset():
    """test_npu_flash_attention_without_dropout_mask: keep_prob 1 with a seed and offset given.

    op-plugin passes seed/offset through when no dropout runs (the emulator used to return 0, 0).
    """
    q, k, v = (torch.randn(1, 2, 64, 64, dtype=torch.float16) for _ in range(3))
    out = npu_fusion_attention(
        _bnsd_to_bsh(q), _bnsd_to_bsh(k), _bnsd_to_bsh(v), head_num=2, input_layout="BSH", scale=0.125, keep_prob=1.0,
        dropout_mask=None, seed=1234, offset=56,
    )
    assert out[0].shape == _bnsd_to_bsh(q).shape
    assert (out[4], out[5]) == (1234, 56)


def test_fusion_attention_keep_prob_zero_is_a_runtime_error():
    q = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="keep_prob"):
        npu_fusion_attention(q, q, q, 2, "BNSD", keep_prob=0.0)


def _infer_golden(q, k, v, scale):
    """PFA/IFA/FIA upstream golden: fp32 softmax of fp16 logits, rounded to fp16, then @ V."""
    w = (q.float() @ k.float().transpose(2, 3)) * scale
    w = torch.softmax(w.double(), dim=-1).half()
    return (w.float() @ v.float()).half()


def test_prompt_flash_attention_bnsd():
    """test_prompt_flash_attention.py: BNSD fp16, scale 1/sqrt(128), pre/next 65535 (no mask).

    [1, 32, 2048, 128] reduced to [1, 4, 256, 128].
    """
    q, k, v = (torch.randn(1, 4, 256, 128, dtype=torch.float16) for _ in range(3))
    out = npu_prompt_flash_attention(q, k, v, num_heads=4, input_layout="BNSD", scale_value=1 / math.sqrt(128),
                                     pre_tokens=65535, next_tokens=65535)  # fmt: skip
    assert_rtol_equal(_infer_golden(q, k, v, 1 / math.sqrt(128)), out)


def test_incre_flash_attention_bsh():
    """test_incre_flash_attention.py: q [1, 32, 1, 128], kv [1, 32, 2048, 128] as BSH (reduced to 8 heads, 512 keys)."""
    q = torch.randn(1, 8, 1, 128, dtype=torch.float16)
    k, v = (torch.randn(1, 8, 512, 128, dtype=torch.float16) for _ in range(2))
    out = npu_incre_flash_attention(_bnsd_to_bsh(q), _bnsd_to_bsh(k), _bnsd_to_bsh(v), num_heads=8, input_layout="BSH",
                                    scale_value=1 / math.sqrt(128))  # fmt: skip
    assert_rtol_equal(_bnsd_to_bsh(_infer_golden(q, k, v, 1 / math.sqrt(128))), out)


@pytest.mark.parametrize("sq", [256, 1])
def test_fused_infer_attention_score_bnsd_with_lse(sq):
    """test_npu_fused_infer_attention_score.py (PFA path, and _ifa_return_lse: Q_S 1): BNSD fp16,
    scale 1/0.0078125, softmax_lse_flag. [1, 32, 2048, 128] reduced to 4 heads and 256 keys; the
    upstream test asserts nothing (its lse cases are skipped), the golden here is its
    supported_op_exec: lse = log(sum exp(S - max)) + max, float32 [B, N, S, 1]."""
    q = torch.randn(1, 4, sq, 128, dtype=torch.float16)
    k, v = (torch.randn(1, 4, 256, 128, dtype=torch.float16) for _ in range(2))
    scale = 1 / 0.0078125
    out, lse = npu_fused_infer_attention_score(q, k, v, num_heads=4, input_layout="BNSD", scale=scale, pre_tokens=65535,
                                               next_tokens=65535, softmax_lse_flag=True)  # fmt: skip
    s = (q.double() @ k.double().transpose(2, 3)) * scale
    assert_rtol_equal(torch.logsumexp(s, dim=-1, keepdim=True).float(), lse)
    gold = (torch.softmax(s, dim=-1) @ v.double()).half()
    assert_rtol_equal(gold, out)
    _, empty = npu_fused_infer_attention_score(q, k, v, num_heads=4, input_layout="BNSD", scale=scale)
    assert empty.numel() == 0


def _band_mask(shape, pre, nxt):
    return np.triu(np.ones(shape), k=nxt + 1) + np.tril(np.ones(shape), k=-pre - 1)


@pytest.mark.parametrize("sparse_mode,pre,nxt", [(0, 128, 128), (1, 65536, 65536), (2, 65536, 0), (3, 65536, 0), (4, 128, 128)])
def test_fusion_attention_sparse_modes(sparse_mode, pre, nxt):
    """Ascend's sparse-mode flash attention test (TestNPUFlashAttention.check_result over
    sparse_params_list, an earlier revision of test_npu_flash_attention.py): BNSD [1, 8, 256, 256]
    fp16, scale 0.08838, prec 0.01. The golden adds ``mask * -10000`` (band mask for modes 0/4,
    zeros for 1, ``triu(k=1)`` for 2/3) and runs an fp32 softmax rounded to fp16; the op gets the
    band mask for mode 0, no mask for mode 1 and the compressed 2048x2048 ``triu(k=1)`` for 2/3/4.
    Shapes as upstream (Sq == Skv, so modes 3/4 coincide with 2/0 here).
    """
    q, k, v = (torch.randn(1, 8, 256, 256, dtype=torch.float16) for _ in range(3))
    shape = [1, 8, 256, 256]
    if sparse_mode in (0, 4):
        gold_mask = _band_mask(shape, pre, nxt)
    elif sparse_mode == 1:
        gold_mask = np.zeros(shape)
    else:
        gold_mask = np.triu(np.ones(shape), k=1)
    s = (q.float() @ k.float().transpose(2, 3)) * 0.08838 + torch.from_numpy(gold_mask).float() * -10000.0
    gold = (torch.softmax(s, dim=-1).half().float() @ v.float()).half()
    atten_mask = None
    if sparse_mode == 0:
        atten_mask = torch.from_numpy(_band_mask(shape, pre, nxt)).bool()
    elif sparse_mode in (2, 3, 4):
        atten_mask = torch.from_numpy(np.triu(np.ones([2048, 2048]), k=1)).bool()
    out = npu_fusion_attention(q, k, v, head_num=8, input_layout="BNSD", scale=0.08838, sparse_mode=sparse_mode,
                               atten_mask=atten_mask, pre_tockens=pre, next_tockens=nxt)  # fmt: skip
    assert_rtol_equal(gold, out[0], prec=0.01, prec16=0.01)
