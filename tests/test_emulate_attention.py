"""npufuse.emulate.attention against an independent eager reference (spec §5).

The reference is written here from the spec text only: (Q@K^T [+ pse]) * scale, masked_fill,
softmax, @V, with keep-matrices built from tril/triu — it shares no code with the emulation.
"""

from __future__ import annotations

import pytest
import torch

from npufuse import emulate
from npufuse.emulate.attention import (
    _attend,
    _MaskedSoftmax,
    npu_fused_infer_attention_score as fia,
    npu_fusion_attention as fa,
    npu_incre_flash_attention as ifa,
    npu_prompt_flash_attention as pfa,
)
from npufuse.emulate.registry import REGISTRY

INT_MAX = 2147483647
TRIU = torch.triu(torch.ones(2048, 2048), diagonal=1).bool()
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


# ---------------------------------------------------------------------------- reference


def ref_attention(q, k, v, *, scale=1.0, keep=None, pse=None, pse_after=False, sink=None, drop=None, keep_prob=1.0):
    """BNSD eager attention in float64. keep: bool broadcastable to [B,N,Sq,Skv], True = attend."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2)
    if pse is not None and not pse_after:
        s = (s + pse.double()) * scale
    else:
        s = s * scale + (0 if pse is None else pse.double())
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if sink is not None:
        b, n, sq, _ = s.shape
        s = torch.cat([s, sink.double().view(1, n, 1, 1).expand(b, n, sq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    if sink is not None:
        p = p[..., :-1]
    p = torch.nan_to_num(p, nan=0.0)  # fully masked rows -> 0 (the documented choice)
    if drop is not None:
        p = p * drop.double() / keep_prob
    return p @ v


def ref_logits(q, k, scale, keep):
    g = q.shape[1] // k.shape[1]
    s = (q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)) * scale
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def tril_keep(sq, skv, diag):
    """keep j <= i + diag."""
    return torch.ones(sq, skv, dtype=torch.bool).tril(diagonal=diag)


def band_keep(sq, skv, lo, hi):
    """keep i + lo <= j <= i + hi."""
    ones = torch.ones(sq, skv, dtype=torch.bool)
    return ones.tril(diagonal=hi) & ones.triu(diagonal=lo)


def to_layout(x, layout):
    """BNSD -> layout (BSH / SBH / BSND / BNSD)."""
    b, n, s, d = x.shape
    if layout == "BSH":
        return x.transpose(1, 2).reshape(b, s, n * d).contiguous()
    if layout == "SBH":
        return x.permute(2, 0, 1, 3).reshape(s, b, n * d).contiguous()
    if layout == "BSND":
        return x.transpose(1, 2).contiguous()
    return x


def pack(x):
    """BNSD with equal lengths -> TND."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def qkv(b=2, nq=4, nkv=4, sq=6, skv=6, d=8, dv=None, dtype=torch.float32):
    dv = d if dv is None else dv
    return (
        torch.randn(b, nq, sq, d, dtype=dtype),
        torch.randn(b, nkv, skv, d, dtype=dtype),
        torch.randn(b, nkv, skv, dv, dtype=dtype),
    )


def close(actual, expected, dtype=torch.float32):
    torch.testing.assert_close(actual.double(), expected.double(), atol=TOL[dtype], rtol=TOL[dtype])


# ---------------------------------------------------------------------------- npu_fusion_attention


def test_registry_entries():
    assert REGISTRY["npu_fusion_attention"].autograd is True and REGISTRY["npu_fusion_attention"].spec == "5.1"
    inference = {
        "npu_prompt_flash_attention": "5.3",
        "npu_incre_flash_attention": "5.4",
        "npu_fused_infer_attention_score": "5.5",
    }
    for name, spec in inference.items():
        assert REGISTRY[name].autograd is False and REGISTRY[name].spec == spec
        assert REGISTRY[name].summary


def test_full_attention_default_scale_is_one():
    q, k, v = qkv()
    out = fa(q, k, v, 4, "BNSD")[0]
    close(out, ref_attention(q, k, v, scale=1.0))
    close(fa(q, k, v, 4, "BNSD", scale=0.125)[0], ref_attention(q, k, v, scale=0.125))


def test_return_structure_and_softmax_stats():
    q, k, v = qkv(b=2, nq=4, sq=5, skv=7)
    keep = tril_keep(5, 7, 2)
    res = fa(q, k, v, 4, "BNSD", scale=0.3, atten_mask=TRIU, sparse_mode=3)
    assert len(res) == 7
    out, smax, ssum, sout, seed, offset, numels = res
    assert out.shape == (2, 4, 5, 8) and out.dtype == torch.float32
    assert smax.shape == ssum.shape == (2, 4, 5, 8) and smax.dtype == ssum.dtype == torch.float32
    assert sout.numel() == 0 and (seed, offset) == (0, 0) and numels == 2 * 4 * 5 * 7
    assert all(isinstance(x, int) for x in (seed, offset, numels))
    s = ref_logits(q, k, 0.3, keep)
    row_max = s.amax(-1)
    close(smax, row_max.unsqueeze(-1).expand(2, 4, 5, 8))
    close(ssum, torch.exp(s - row_max.unsqueeze(-1)).sum(-1).unsqueeze(-1).expand(2, 4, 5, 8))
    assert not smax.requires_grad


@pytest.mark.parametrize("mode", [2, 3])
@pytest.mark.parametrize("sq,skv", [(5, 9), (9, 5), (6, 6)])
def test_causal_modes(mode, sq, skv):
    q, k, v = qkv(sq=sq, skv=skv)
    keep = tril_keep(sq, skv, 0 if mode == 2 else skv - sq)
    out, smax, ssum = fa(q, k, v, 4, "BNSD", scale=0.35, atten_mask=TRIU, sparse_mode=mode)[:3]
    close(out, ref_attention(q, k, v, scale=0.35, keep=keep))
    dead = ~keep.any(-1)  # fully masked rows only with mode 3 and Sq > Skv
    assert bool(dead.any()) == (mode == 3 and sq > skv)
    assert torch.all(out[:, :, dead] == 0) and torch.isfinite(out).all()
    assert torch.all(smax[:, :, dead] == float("-inf")) and torch.all(ssum[:, :, dead] == 0)


@pytest.mark.parametrize("sq,skv", [(6, 10), (10, 6), (8, 8)])
def test_band_mode4_bottom_right_origin(sq, skv):
    q, k, v = qkv(sq=sq, skv=skv)
    pre, nxt = 3, 1
    off = skv - sq
    keep = band_keep(sq, skv, off - pre, off + nxt)
    out = fa(q, k, v, 4, "BNSD", scale=0.4, atten_mask=TRIU, sparse_mode=4, pre_tockens=pre, next_tockens=nxt)[0]
    close(out, ref_attention(q, k, v, scale=0.4, keep=keep))


def test_mode0_pre_next_top_left_with_consistent_mask():
    sq, skv, pre, nxt = 7, 9, 2, 1
    keep = band_keep(sq, skv, -pre, nxt)
    q, k, v = qkv(sq=sq, skv=skv)
    out = fa(q, k, v, 4, "BNSD", scale=0.3, atten_mask=~keep, sparse_mode=0, pre_tockens=pre, next_tockens=nxt)[0]
    close(out, ref_attention(q, k, v, scale=0.3, keep=keep))
    # pre/next narrower than the mask: the band is intersected (documented choice)
    pad = torch.zeros(sq, skv, dtype=torch.bool)
    out = fa(q, k, v, 4, "BNSD", scale=0.3, atten_mask=pad, pre_tockens=pre, next_tockens=nxt)[0]
    close(out, ref_attention(q, k, v, scale=0.3, keep=keep))
    # mode 1 ignores pre/next
    out = fa(q, k, v, 4, "BNSD", scale=0.3, atten_mask=pad, sparse_mode=1, pre_tockens=0, next_tockens=0)[0]
    close(out, ref_attention(q, k, v, scale=0.3))


def test_no_mask_ignores_sparse_mode_and_pre_next():
    q, k, v = qkv(sq=5, skv=8)
    full = ref_attention(q, k, v, scale=0.3)
    for mode in (0, 2, 3, 4):
        out = fa(q, k, v, 4, "BNSD", scale=0.3, sparse_mode=mode, pre_tockens=0, next_tockens=0)[0]
        close(out, full)


@pytest.mark.parametrize("shape", ["B1SS", "BNSS", "11SS", "SS"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8])
def test_padding_mask_shapes(shape, dtype):
    b, n, sq, skv = 2, 4, 5, 7
    lens = torch.tensor([4, 7])
    pad = torch.arange(skv)[None, :] >= lens[:, None]  # [B, Skv], True = padded key
    if shape == "B1SS":
        mask = pad[:, None, None, :].expand(b, 1, sq, skv)
    elif shape == "BNSS":
        mask = pad[:, None, None, :].expand(b, n, sq, skv).clone()
        mask[:, 1, :, 0] = True  # a per-head difference
    elif shape == "11SS":
        mask = pad[1:2, None, None, :].expand(1, 1, sq, skv) | torch.eye(sq, skv, dtype=torch.bool)
    else:
        mask = torch.eye(sq, skv, dtype=torch.bool)
    q, k, v = qkv(b=b, nq=n, nkv=n, sq=sq, skv=skv)
    out = fa(q, k, v, n, "BNSD", scale=0.3, atten_mask=mask.to(dtype).contiguous())[0]
    close(out, ref_attention(q, k, v, scale=0.3, keep=~mask))


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "bnsd", "TND"])
def test_layouts_equal_bnsd(layout):
    b, n, sq, skv, d, dv = 2, 4, 5, 6, 8, 4
    q, k, v = qkv(b=b, nq=n, nkv=2, sq=sq, skv=skv, d=d, dv=dv)
    want = fa(q, k, v, n, "BNSD", scale=0.3, atten_mask=TRIU, sparse_mode=3)
    if layout == "TND":
        got = fa(pack(q), pack(k), pack(v), n, "TND", scale=0.3, atten_mask=TRIU, sparse_mode=3,
                 actual_seq_qlen=[sq, 2 * sq], actual_seq_kvlen=[skv, 2 * skv], softmax_layout="TND")
        close(got[0], pack(want[0]))
        close(got[1], want[1].transpose(1, 2).reshape(b * sq, n, 8))
        assert got[6] == want[6]
    else:
        got = fa(
            to_layout(q, layout.upper()), to_layout(k, layout.upper()), to_layout(v, layout.upper()), n, layout,
            scale=0.3, atten_mask=TRIU, sparse_mode=3,
        )
        close(got[0], to_layout(want[0], layout.upper()))
        close(got[1], want[1])


def test_tnd_varlen_equals_per_sequence_attention():
    n, nkv, d = 4, 2, 8
    sq_lens, skv_lens = [3, 0, 5, 2], [4, 2, 5, 0]  # an empty query batch and an empty kv batch
    q = torch.randn(sum(sq_lens), n, d)
    k = torch.randn(sum(skv_lens), nkv, d)
    v = torch.randn(sum(skv_lens), nkv, d)
    cq = torch.tensor(sq_lens).cumsum(0).tolist()
    ck = torch.tensor(skv_lens).cumsum(0).tolist()
    for mode in (None, 2, 3):
        kw = {} if mode is None else {"atten_mask": TRIU, "sparse_mode": mode}
        out, smax, ssum, _, _, _, numels = fa(
            q, k, v, n, "TND", scale=0.5, actual_seq_qlen=cq, actual_seq_kvlen=ck, **kw,
        )
        assert out.shape == (10, n, d) and smax.shape == (10, n, 8)
        assert numels == n * sum(a * c for a, c in zip(sq_lens, skv_lens))
        qs, ks = 0, 0
        for lq, lk in zip(sq_lens, skv_lens):
            if lq:
                qb = q[qs:qs + lq].transpose(0, 1)[None]
                kb = k[ks:ks + lk].transpose(0, 1)[None]
                vb = v[ks:ks + lk].transpose(0, 1)[None]
                keep = None if mode is None else tril_keep(lq, lk, 0 if mode == 2 else lk - lq)
                want = ref_attention(qb, kb, vb, scale=0.5, keep=keep)[0].transpose(0, 1)
                close(out[qs:qs + lq], want)
                if lk:
                    row_max = ref_logits(qb, kb, 0.5, keep).amax(-1)[0]  # [N, lq]
                    # default softmax_layout "": the [T, N, 8] buffer holds NTD order
                    close(smax.view(n, 10, 8)[:, qs:qs + lq, 0], row_max)
            qs, ks = qs + lq, ks + lk
    # trailing zeros disable trailing batches: [2, 5, 0] == [2, 5]
    a = fa(q[:5], k[:6], v[:6], n, "TND", actual_seq_qlen=[2, 5, 0], actual_seq_kvlen=[4, 6, 0])[0]
    b = fa(q[:5], k[:6], v[:6], n, "TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[4, 6])[0]
    close(a, b)


def test_tnd_local_index_padding_mask():
    n, d = 2, 8
    q = torch.randn(7, n, d)
    k = torch.randn(7, n, d)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[:, 3] = True  # local column 3 masked in every sequence that has it
    out = fa(q, k, k, n, "TND", atten_mask=mask, actual_seq_qlen=[3, 7], actual_seq_kvlen=[3, 7])[0]
    q2, k2 = q[3:].transpose(0, 1)[None], k[3:].transpose(0, 1)[None]
    close(out[3:], ref_attention(q2, k2, k2, keep=~mask)[0].transpose(0, 1))
    q1, k1 = q[:3].transpose(0, 1)[None], k[:3].transpose(0, 1)[None]
    close(out[:3], ref_attention(q1, k1, k1, keep=~mask[:3, :3])[0].transpose(0, 1))


@pytest.mark.parametrize("nkv", [2, 1])  # GQA, MQA
def test_gqa_mqa_head_mapping(nkv):
    q, k, v = qkv(nq=4, nkv=nkv, sq=5, skv=5)
    out = fa(q, k, v, 4, "BNSD", scale=0.3)
    close(out[0], ref_attention(q, k, v, scale=0.3))
    g = 4 // nkv
    for h in range(4):  # head h uses kv head h // (Nq / Nkv)
        close(
            out[0][:, h],
            ref_attention(q[:, h:h + 1], k[:, h // g:h // g + 1], v[:, h // g:h // g + 1], scale=0.3)[:, 0],
        )
    # BSH derives Nkv from H_k / D
    out_bsh = fa(to_layout(q, "BSH"), to_layout(k, "BSH"), to_layout(v, "BSH"), 4, "BSH", scale=0.3)[0]
    close(out_bsh, to_layout(out[0], "BSH"))


def test_dv_differs_from_dq():
    q, k, v = qkv(d=16, dv=8, sq=4, skv=6)
    out = fa(q, k, v, 4, "BNSD", scale=0.25)[0]
    assert out.shape == (2, 4, 4, 8)
    close(out, ref_attention(q, k, v, scale=0.25))
    out = fa(to_layout(q, "BSH"), to_layout(k, "BSH"), to_layout(v, "BSH"), 4, "BSH", scale=0.25)[0]
    assert out.shape == (2, 4, 4 * 8)


@pytest.mark.parametrize("pshape", ["BNSS", "BN1S", "1NSS"])
def test_pse_added_before_scaling(pshape):
    b, n, sq, skv = 2, 4, 5, 6
    q, k, v = qkv(b=b, nq=n, nkv=n, sq=sq, skv=skv)
    shape = {"BNSS": (b, n, sq, skv), "BN1S": (b, n, 1, skv), "1NSS": (1, n, sq, skv)}[pshape]
    pse = torch.randn(shape)
    out = fa(q, k, v, n, "BNSD", pse=pse, scale=0.3)[0]
    close(out, ref_attention(q, k, v, scale=0.3, pse=pse))
    assert not torch.allclose(out.double(), ref_attention(q, k, v, scale=0.3, pse=pse, pse_after=True), atol=1e-3)


def test_sink_per_head_logit():
    q, k, v = qkv(sq=5, skv=3)
    sink = torch.linspace(-0.5, 2.0, 4)
    out, smax, ssum = fa(q, k, v, 4, "BNSD", scale=0.3, sink=sink, atten_mask=TRIU, sparse_mode=3)[:3]
    keep = tril_keep(5, 3, -2)
    close(out, ref_attention(q, k, v, scale=0.3, sink=sink, keep=keep))
    # stats include the sink column: max + log(sum) = log-normaliser over keys and sink
    s = ref_logits(q, k, 0.3, keep)
    s = torch.cat([s, sink.double().view(1, 4, 1, 1).expand(2, 4, 5, 1)], -1)
    close(smax[..., 0] + torch.log(ssum[..., 0]), torch.logsumexp(s, -1))


def test_dropout_with_explicit_mask_is_deterministic():
    q, k, v = qkv(sq=5, skv=6)
    numels = 2 * 4 * 5 * 6
    drop = torch.rand(2, 4, 5, 6) < 0.7
    res = fa(q, k, v, 4, "BNSD", scale=0.3, keep_prob=0.7, dropout_mask=drop.to(torch.uint8))
    close(res[0], ref_attention(q, k, v, scale=0.3, drop=drop, keep_prob=0.7))
    assert res[6] == numels
    # the same mask bit-packed (LSB first) gives the same result
    bits = drop.reshape(-1, 8).to(torch.int64)
    packed = (bits << torch.arange(8)).sum(-1).to(torch.uint8)
    close(fa(q, k, v, 4, "BNSD", scale=0.3, keep_prob=0.7, dropout_mask=packed)[0], res[0])
    # keep_prob == 1: no dropout at all
    close(
        fa(q, k, v, 4, "BNSD", scale=0.3, dropout_mask=torch.zeros(numels, dtype=torch.uint8))[0],
        ref_attention(q, k, v, scale=0.3),
    )


def test_dropout_generated_mask_replays_from_seed_offset():
    q, k, v = qkv(sq=8, skv=8)
    torch.manual_seed(7)
    a = fa(q, k, v, 4, "BNSD", keep_prob=0.6)
    torch.manual_seed(7)
    b = fa(q, k, v, 4, "BNSD", keep_prob=0.6)
    assert torch.equal(a[0], b[0]) and a[4] != 0
    c = fa(q, k, v, 4, "BNSD", keep_prob=0.6, seed=a[4], offset=a[5])
    assert torch.equal(a[0], c[0]) and (c[4], c[5]) == (a[4], a[5])
    assert not torch.allclose(a[0], fa(q, k, v, 4, "BNSD")[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes(dtype):
    q, k, v = qkv(sq=6, skv=10, d=16, dtype=dtype)
    pse = torch.randn(1, 4, 6, 10, dtype=dtype)
    res = fa(q, k, v, 4, "BNSD", pse=pse, scale=0.25, atten_mask=TRIU, sparse_mode=2)
    assert res[0].dtype == dtype and res[1].dtype == torch.float32 and res[3].dtype == dtype
    close(res[0], ref_attention(q, k, v, scale=0.25, pse=pse, keep=tril_keep(6, 10, 0)), dtype)


def test_backward_matches_reference():
    q, k, v = qkv(nq=4, nkv=2, sq=6, skv=8)
    pse = torch.randn(1, 4, 6, 8)
    sink = torch.randn(4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, pse, sink)]
    out = fa(*leaves[:3], 4, "BNSD", pse=leaves[3], sink=leaves[4], scale=0.3, atten_mask=TRIU, sparse_mode=3)[0]
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_leaves = [t.double().clone().requires_grad_() for t in (q, k, v, pse, sink)]
    want = ref_attention(*ref_leaves[:3], pse=ref_leaves[3], sink=ref_leaves[4], scale=0.3, keep=tril_keep(6, 8, 2))
    want.backward(grad.double())
    for got, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=1e-4, rtol=1e-4)


def test_backward_with_fully_masked_rows_is_finite():
    q, k, v = (t.requires_grad_() for t in qkv(sq=8, skv=4))
    out = fa(q, k, v, 4, "BNSD", scale=0.3, atten_mask=TRIU, sparse_mode=3)[0]
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.all(q.grad[:, :, :4] == 0)  # rows 0..3 see no key


# ------------------------------------------------- the softmax step's own backward (_MaskedSoftmax)


def _keep_with_empty_rows(b, sq, skv):
    """Random keep-matrix [b, 1, sq, skv]; row 1 of batch 0 and row 3 of the last batch attend nothing."""
    gen = torch.Generator().manual_seed(7)
    keep = torch.rand(b, 1, sq, skv, generator=gen) > 0.35
    keep[..., 0, 0] = True  # at least one live entry per batch
    keep[0, 0, 1] = False
    keep[-1, 0, 3] = False
    return keep


def _masked_softmax(s, keep, sink):
    sink4 = None if sink is None else sink.view(1, -1, 1, 1)
    p, _, _ = _MaskedSoftmax.apply(s.masked_fill(~keep, float("-inf")), sink4)
    return p


@pytest.mark.parametrize("with_sink", [False, True])
def test_masked_softmax_gradcheck_float64(with_sink):
    keep = _keep_with_empty_rows(2, 5, 7)
    s = (torch.randn(2, 3, 5, 7, dtype=torch.float64) * 2).requires_grad_()
    sink = torch.randn(3, dtype=torch.float64, requires_grad=True) if with_sink else None
    inputs = (s, sink) if with_sink else (s,)
    assert torch.autograd.gradcheck(lambda *a: _masked_softmax(a[0], keep, a[1] if with_sink else None), inputs)


@pytest.mark.parametrize("with_sink", [False, True])
def test_masked_softmax_matches_torch_softmax_and_its_gradients(with_sink):
    """Against torch.softmax over [logits, sink] in float64 (NaN rows -> 0): values and both gradients."""
    keep = _keep_with_empty_rows(2, 5, 7)
    s0 = torch.randn(2, 3, 5, 7, dtype=torch.float64) * 2
    sink0 = torch.randn(3, dtype=torch.float64)
    dp = torch.randn(2, 3, 5, 7, dtype=torch.float64)
    s, sink = s0.clone().requires_grad_(), sink0.clone().requires_grad_()
    got = _masked_softmax(s, keep, sink if with_sink else None)
    got.backward(dp)
    rs, rsink = s0.clone().requires_grad_(), sink0.clone().requires_grad_()
    logits = rs.masked_fill(~keep, float("-inf"))
    if with_sink:
        logits = torch.cat([logits, rsink.view(1, 3, 1, 1).expand(2, 3, 5, 1)], dim=-1)
    want = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)[..., :7]
    want.backward(dp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(s.grad, torch.nan_to_num(rs.grad, nan=0.0), rtol=1e-10, atol=1e-12)
    assert torch.all(s.grad[~keep.expand_as(s)] == 0)
    if with_sink:
        torch.testing.assert_close(sink.grad, rsink.grad, rtol=1e-10, atol=1e-12)
        # the documented form: d sink = -sum over rows of p_sink * sum_j P * dP
        p = got.detach()
        p_sink = 1 - p.sum(-1)
        torch.testing.assert_close(sink.grad, -(p_sink * (p * dp).sum(-1)).sum(dim=(0, 2)), rtol=1e-10, atol=1e-12)
    else:
        assert sink.grad is None


def test_masked_softmax_fully_masked_rows():
    """No sink: P and dS are 0 on a row with no key. With a sink that row is all sink (p_sink = 1),
    P stays 0 and the row adds nothing to the sink's gradient (sum_j P * dP = 0)."""
    s = torch.full((1, 2, 1, 4), float("-inf"), requires_grad=True)
    p, m, denom = _MaskedSoftmax.apply(s, None)
    assert torch.equal(p, torch.zeros_like(p)) and torch.isneginf(m).all()
    assert torch.equal(denom, torch.zeros_like(denom))
    p.backward(torch.randn_like(p))
    assert torch.equal(s.grad, torch.zeros_like(s))
    sink = torch.tensor([0.5, -1.0], requires_grad=True)
    s = torch.full((1, 2, 1, 4), float("-inf"), requires_grad=True)
    p, m, denom = _MaskedSoftmax.apply(s, sink.view(1, -1, 1, 1))
    assert torch.equal(p, torch.zeros_like(p)) and torch.equal(m.flatten(), sink.detach()) and torch.all(denom == 1)
    p.backward(torch.randn_like(p))
    assert torch.equal(s.grad, torch.zeros_like(s)) and torch.equal(sink.grad, torch.zeros(2))


def test_masked_softmax_statistics_are_constants_and_double_backward_is_refused():
    s = torch.randn(1, 1, 3, 4, requires_grad=True)
    p, m, denom = _MaskedSoftmax.apply(s, None)
    assert p.requires_grad and not m.requires_grad and not denom.requires_grad
    (g,) = torch.autograd.grad(p, s, torch.randn_like(p), create_graph=True)
    with pytest.raises(RuntimeError):  # once_differentiable: the fused kernels have no double backward either
        g.sum().backward()


@pytest.mark.parametrize("drop", [False, True])
def test_attend_gradcheck_float64(drop):
    """The whole core (GQA, pse, sink, masks with fully masked rows, dropout) in float64."""
    q, k, v = qkv(b=2, nq=4, nkv=2, sq=5, skv=7, d=3, dv=2, dtype=torch.float64)
    pse = torch.randn(1, 4, 5, 7, dtype=torch.float64)
    sink = torch.randn(4, dtype=torch.float64)
    keep = _keep_with_empty_rows(2, 5, 7)
    drop_keep = (torch.rand(2, 4, 5, 7) > 0.25) if drop else None
    keep_prob = 0.75 if drop else 1.0
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v, pse, sink))

    def core(q_, k_, v_, pse_, sink_):
        opts = dict(scale=0.4, keep=keep, drop_keep=drop_keep, keep_prob=keep_prob)
        return _attend(q_, k_, v_, pse=pse_, sink=sink_, **opts)[0]

    assert torch.autograd.gradcheck(core, leaves)
    out = core(*leaves)
    want = ref_attention(q, k, v, scale=0.4, keep=keep, pse=pse, sink=sink, drop=drop_keep, keep_prob=keep_prob)
    torch.testing.assert_close(out, want)


def _raises(exc, arg, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert arg in str(info.value), str(info.value)
    assert str(info.value).startswith("npu_")


def test_fa_rejections():
    q, k, v = qkv()
    _raises(TypeError, "atten_mask", fa, q, k, v, 4, "BNSD", atten_mask=torch.zeros(6, 6))
    _raises(ValueError, "key", fa, q, k[:, :3], v[:, :3], 4, "BNSD")
    big = torch.randn(1, 1, 2, 769)
    _raises(ValueError, "query", fa, big, big, big, 1, "BNSD")
    _raises(ValueError, "input_layout", fa, q, k, v, 4, "BHSD")
    tq = torch.randn(6, 4, 8)
    _raises(ValueError, "actual_seq_qlen", fa, tq, tq, tq, 4, "TND")
    _raises(ValueError, "actual_seq_qlen", fa, q, k, v, 4, "BNSD", actual_seq_qlen=[6, 12], actual_seq_kvlen=[6, 12])
    _raises(ValueError, "actual_seq_qlen", fa, tq, tq, tq, 4, "TND", actual_seq_qlen=[4, 2], actual_seq_kvlen=[4, 6])
    _raises(ValueError, "atten_mask", fa, q, k, v, 4, "BNSD", atten_mask=torch.ones(6, 6).triu(1).bool(), sparse_mode=2)
    _raises(ValueError, "atten_mask", fa, q, k, v, 4, "BNSD", atten_mask=~TRIU, sparse_mode=3)  # wrong polarity
    _raises(ValueError, "padding_mask", fa, q, k, v, 4, "BNSD", padding_mask=torch.zeros(1))
    _raises(ValueError, "head_num", fa, q, k, v, 8, "BNSD")
    _raises(
        ValueError, "atten_mask", fa, q, k, v, 4, "BNSD", atten_mask=torch.zeros(2, 4, 1, 6, dtype=torch.bool),
    )
    _raises(ValueError, "keep_prob", fa, q, k, v, 4, "BNSD", keep_prob=0.0)
    _raises(ValueError, "sparse_mode", fa, q, k, v, 4, "BNSD", sparse_mode=7)
    _raises(
        ValueError, "sparse_mode", fa, q, k, v, 4, "BNSD", atten_mask=torch.zeros(2, 1, 6, 6, dtype=torch.bool),
        sparse_mode=5,
    )
    _raises(ValueError, "softmax_layout", fa, q, k, v, 4, "BNSD", softmax_layout="TND")
    _raises(
        ValueError, "next_tockens", fa, q, k, v, 4, "BNSD", atten_mask=TRIU, sparse_mode=4, pre_tockens=-3,
        next_tockens=1,
    )
    _raises(TypeError, "sink", fa, q, k, v, 4, "BNSD", sink=torch.zeros(4, dtype=torch.float16))
    _raises(TypeError, "value", fa, q, k, v.half(), 4, "BNSD")
    _raises(ValueError, "value", fa, q, k, v.repeat(1, 1, 1, 2), 4, "BNSD")  # Dv > Dk
    _raises(ValueError, "prefix", fa, q, k, v, 4, "BNSD", prefix=[1, 2])


# ---------------------------------------------------------------------------- inference ops

H = torch.float16


def test_pfa_default_next_tokens_zero_makes_padding_mask_causal():
    q, k, v = qkv(b=2, nq=4, nkv=4, sq=6, skv=6, d=16, dtype=H)
    pad = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    pad[0, ..., 5] = True
    causal = tril_keep(6, 6, 0)
    out = pfa(q, k, v, atten_mask=pad, num_heads=4, input_layout="BNSD", scale_value=0.25)
    close(out, ref_attention(q, k, v, scale=0.25, keep=~pad & causal), H)
    out = pfa(q, k, v, atten_mask=pad, num_heads=4, input_layout="BNSD", scale_value=0.25, next_tokens=INT_MAX)
    close(out, ref_attention(q, k, v, scale=0.25, keep=~pad), H)
    # without a mask pre/next are ignored: full attention despite next_tokens=0
    close(pfa(q, k, v, num_heads=4, input_layout="BNSD", scale_value=0.25), ref_attention(q, k, v, scale=0.25), H)


def test_pfa_layouts_gqa_and_lengths():
    b, n, nkv, sq, skv, d = 2, 4, 2, 5, 9, 16
    q, k, v = qkv(b=b, nq=n, nkv=nkv, sq=sq, skv=skv, d=d, dtype=H)
    kw = dict(num_heads=n, num_key_value_heads=nkv, scale_value=0.25, sparse_mode=3,
              atten_mask=TRIU.view(1, 1, 2048, 2048))
    want = pfa(q, k, v, input_layout="BNSD", **kw)
    close(want, ref_attention(q, k, v, scale=0.25, keep=tril_keep(sq, skv, skv - sq)), H)
    for layout in ("BSH", "BSND"):
        got = pfa(to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), input_layout=layout, **kw)
        close(got, to_layout(want, layout), H)
    close(pfa(q, k, v, input_layout="BNSD_BSND", **kw), to_layout(want, "BSND"), H)
    # per-batch valid lengths: bottom-right causal per batch, later queries zero, later keys ignored
    out = pfa(q, k, v, input_layout="BNSD", actual_seq_lengths=[5, 3], actual_seq_lengths_kv=[9, 6], **kw)
    close(out[0], want[0], H)
    close(
        out[1, :, :3], ref_attention(q[1:, :, :3], k[1:, :, :6], v[1:, :, :6], scale=0.25, keep=tril_keep(3, 6, 3))[0],
        H,
    )
    assert torch.all(out[1, :, 3:] == 0)


def test_pfa_tnd_bf16():
    n, d, dv = 8, 192, 128
    sq_lens, skv_lens = [2, 3], [4, 3]
    q = torch.randn(5, n, d, dtype=torch.bfloat16)
    k = torch.randn(7, n, d, dtype=torch.bfloat16)
    v = torch.randn(7, n, dv, dtype=torch.bfloat16)
    out = pfa(q, k, v, num_heads=n, input_layout="TND", scale_value=d ** -0.5, sparse_mode=3, atten_mask=TRIU,
              actual_seq_lengths=[2, 5], actual_seq_lengths_kv=[4, 7])
    assert out.shape == (5, n, dv)
    for (q0, lq), (k0, lk) in zip(((0, 2), (2, 3)), ((0, 4), (4, 3))):
        want = ref_attention(q[q0:q0 + lq].transpose(0, 1)[None], k[k0:k0 + lk].transpose(0, 1)[None],
                             v[k0:k0 + lk].transpose(0, 1)[None], scale=d ** -0.5, keep=tril_keep(lq, lk, lk - lq))
        close(out[q0:q0 + lq], want[0].transpose(0, 1), torch.bfloat16)
    _raises(
        ValueError, "sparse_mode", pfa, q, k, v, num_heads=n, input_layout="TND", actual_seq_lengths=[2, 5],
        actual_seq_lengths_kv=[4, 7], sparse_mode=2, atten_mask=TRIU,
    )


def test_ifa_decode_lengths_mask_gqa():
    b, n, nkv, skv, d = 3, 8, 2, 10, 16
    q, k, v = qkv(b=b, nq=n, nkv=nkv, sq=1, skv=skv, d=d, dtype=H)
    v = torch.randn_like(k)
    lens = [10, 4, 1]
    mask = torch.zeros(b, 1, 1, skv, dtype=torch.bool)
    mask[0, ..., 2] = True
    out = ifa(to_layout(q, "BSH"), to_layout(k, "BSH"), to_layout(v, "BSH"), num_heads=n, num_key_value_heads=nkv,
              scale_value=0.25, actual_seq_lengths=lens, atten_mask=mask.to(torch.int8))
    assert out.shape == (b, 1, n * d) and out.dtype == H
    keep = (~mask) & (torch.arange(skv) < torch.tensor(lens).view(b, 1, 1, 1))
    close(out, to_layout(ref_attention(q, k, v, scale=0.25, keep=keep), "BSH"), H)
    out = ifa(q, k, v, num_heads=n, num_key_value_heads=nkv, input_layout="BNSD", scale_value=0.25,
              atten_mask=mask.view(b, skv))
    close(out, ref_attention(q, k, v, scale=0.25, keep=~mask), H)


def test_ifa_rejections():
    q, k, v = qkv(b=1, nq=4, nkv=4, sq=1, skv=8, d=16, dtype=H)
    kw = dict(num_heads=4, input_layout="BNSD")
    _raises(ValueError, "query", ifa, torch.randn(1, 4, 2, 16, dtype=H), k, v, **kw)
    _raises(ValueError, "block_table", ifa, q, k, v, block_table=torch.zeros(1, 1, dtype=torch.int32), **kw)
    _raises(ValueError, "antiquant_scale", ifa, q, k, v, antiquant_scale=torch.ones(2, 4, 1, 16, dtype=H), **kw)
    _raises(ValueError, "kv_padding_size", ifa, q, k, v, kv_padding_size=torch.zeros(1, dtype=torch.int64), **kw)
    _raises(ValueError, "block_size", ifa, q, k, v, block_size=128, **kw)
    _raises(TypeError, "atten_mask", ifa, q, k, v, atten_mask=torch.zeros(1, 8), **kw)
    _raises(TypeError, "query", ifa, q.float(), k.float(), v.float(), **kw)
    _raises(ValueError, "num_key_value_heads", ifa, q, k[:, :2], v[:, :2], **kw)
    _raises(ValueError, "actual_seq_lengths", ifa, q, k, v, actual_seq_lengths=[9], **kw)


def test_fia_prefill_decode_and_lse():
    b, n, nkv, sq, skv, d = 2, 4, 2, 5, 7, 16
    q, k, v = qkv(b=b, nq=n, nkv=nkv, sq=sq, skv=skv, d=d, dtype=H)
    pad = torch.zeros(b, 1, sq, skv, dtype=torch.bool)
    pad[1, ..., 5:] = True
    kw = dict(num_heads=n, num_key_value_heads=nkv, scale=0.25, input_layout="BNSD")
    out, lse = fia(q, k, v, atten_mask=pad, softmax_lse_flag=True, **kw)
    close(out, ref_attention(q, k, v, scale=0.25, keep=~pad), H)  # default next_tokens is INT_MAX here
    assert lse.shape == (b, n, sq, 1) and lse.dtype == torch.float32
    close(lse[..., 0], torch.logsumexp(ref_logits(q, k, 0.25, ~pad), -1))
    close(
        out,
        pfa(q, k, v, atten_mask=pad, num_heads=n, num_key_value_heads=nkv, scale_value=0.25, input_layout="BNSD",
            next_tokens=INT_MAX),
        H,
    )
    out, lse = fia(q, k, v, atten_mask=TRIU, sparse_mode=2, **kw)
    close(out, ref_attention(q, k, v, scale=0.25, keep=tril_keep(sq, skv, 0)), H)
    assert lse.shape == (0,) and lse.dtype == torch.float32
    out = fia(q, k, v, num_heads=n, num_key_value_heads=nkv, scale=0.25, input_layout="BNSD_BSND")[0]
    assert out.shape == (b, sq, n, d)
    # Q_S == 1: IFA branch, sparse_mode/pre/next ignored, (B, Skv) mask accepted
    q1 = q[:, :, :1].contiguous()
    m1 = pad[:, 0, 0, :]
    out, lse = fia(q1, k, v, atten_mask=m1, sparse_mode=3, next_tokens=-5, softmax_lse_flag=True, **kw)
    close(
        out, ifa(q1, k, v, atten_mask=m1, num_heads=n, num_key_value_heads=nkv, scale_value=0.25, input_layout="BNSD"),
        H,
    )
    assert lse.shape == (b, n, 1, 1)


def test_fia_rejections():
    q, k, v = qkv(b=1, nq=4, nkv=4, sq=4, skv=4, d=16, dtype=H)
    kw = dict(num_heads=4, input_layout="BNSD")
    unsupported = {
        "query_rope": q, "key_rope": k, "key_shared_prefix": k, "block_table": torch.zeros(1, 1, dtype=torch.int32),
        "quant_scale2": torch.ones(1), "antiquant_scale": torch.ones(2),
        "query_padding_size": torch.zeros(1, dtype=torch.int64),
    }
    for name, val in unsupported.items():
        _raises(ValueError, name, fia, q, k, v, **{name: val}, **kw)
    _raises(ValueError, "antiquant_mode", fia, q, k, v, antiquant_mode=1, **kw)
    _raises(ValueError, "sparse_mode", fia, q, k, v, sparse_mode=9, **kw)
    _raises(ValueError, "atten_mask", fia, q, k, v, sparse_mode=3, **kw)
    _raises(ValueError, "atten_mask", fia, q, k, v, sparse_mode=1, **kw)
    _raises(TypeError, "atten_mask", fia, q, k, v, atten_mask=torch.zeros(4, 4, dtype=H), **kw)
    _raises(ValueError, "input_layout", fia, q, k, v, num_heads=4, input_layout="SBH")
    _raises(ValueError, "num_heads", fia, q, k, v, num_heads=2, input_layout="BNSD")
    _raises(ValueError, "query", fia, q[..., :8].contiguous(), k[..., :8].contiguous(), v[..., :8].contiguous(), **kw)
    _raises(ValueError, "query", fia, q.transpose(2, 3), k, v, **kw)  # non-contiguous
    _raises(ValueError, "padding_mask", pfa, q, k, v, padding_mask=torch.zeros(1), **kw)
    _raises(ValueError, "deq_scale1", pfa, q, k, v, deq_scale1=torch.ones(1), **kw)
    _raises(
        ValueError, "num_key_value_heads", pfa, to_layout(q, "BSH"), to_layout(k[:, :2], "BSH"),
        to_layout(v[:, :2], "BSH"), num_heads=4,
    )


def test_inference_ops_are_forward_only():
    q, k, v = (t.requires_grad_() for t in qkv(b=1, nq=2, nkv=2, sq=3, skv=3, d=16, dtype=H))
    for out in (pfa(q, k, v, num_heads=2, input_layout="BNSD"), fia(q, k, v, num_heads=2, input_layout="BNSD")[0],
                ifa(q[:, :, :1], k, v, num_heads=2, input_layout="BNSD")):
        with pytest.warns(UserWarning, match="autograd kernel was not registered"):
            out.float().sum().backward()
    # no gradient reaches them (q is also sliced for IFA: SliceBackward turns "none" into zeros)
    assert k.grad is None and v.grad is None
    assert q.grad is None or not bool(q.grad.any())


def test_install_counts_calls():
    q, k, v = qkv(sq=4, skv=4, d=16)
    with emulate.install() as emu:
        import torch_npu

        out = torch_npu.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.5, atten_mask=TRIU, sparse_mode=2)[0]
        torch_npu.npu_fused_infer_attention_score(q.half(), k.half(), v.half(), num_heads=4, input_layout="BNSD")
        assert emu.calls["npu_fusion_attention"] == 1
        assert emu.calls["npu_fused_infer_attention_score"] == 1
    close(out, ref_attention(q, k, v, scale=0.5, keep=tril_keep(4, 4, 0)))
