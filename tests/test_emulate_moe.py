"""Grouped matmul and MoE routing emulations against loops written here from spec §7/§8."""

from __future__ import annotations

import inspect

import pytest
import torch

from npufuse import emulate
from npufuse.emulate.moe import (
    npu_grouped_matmul,
    npu_moe_finalize_routing,
    npu_moe_gating_top_k_softmax,
    npu_moe_init_routing,
    npu_moe_token_permute,
    npu_moe_token_unpermute,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HALF_DTYPES = [torch.float16, torch.bfloat16]
TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(2024)


def close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


# ---- npu_grouped_matmul -----------------------------------------------------------------------


def ref_gmm_groups(x, weights, sizes, biases=None):
    """Per-group loop: rows of group e times weights[e] (+ bias[e]), fp32."""
    out, start = [], 0
    for e, size in enumerate(sizes):
        y = x[start : start + size].float() @ weights[e].float()
        if biases is not None:
            y = y + biases[e].float()
        out.append(y)
        start += size
    return out


SIZES = [3, 0, 6, 4]  # odd M=13, one empty expert


def _cumsum(sizes):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_list_type", [0, 1])
def test_gmm_single_3d_weight(dtype, group_list_type):
    m, k, n = sum(SIZES), 24, 10
    x = rnd(m, k, dtype=dtype)
    w = rnd(len(SIZES), k, n, dtype=dtype)
    gl = _cumsum(SIZES) if group_list_type == 0 else torch.tensor(SIZES, dtype=torch.int64)
    out = npu_grouped_matmul([x], [w], group_list=gl, split_item=2, group_type=0, group_list_type=group_list_type)
    assert isinstance(out, list) and len(out) == 1
    assert out[0].shape == (m, n) and out[0].dtype == dtype
    close(out[0], torch.cat(ref_gmm_groups(x, list(w), SIZES)).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gmm_transposed_weight_view_and_bias(dtype):
    m, k, n = sum(SIZES), 16, 12
    x = rnd(m, k, dtype=dtype)
    w_nk = rnd(len(SIZES), n, k, dtype=dtype)  # nn.Linear-style storage [E, N, K]
    bias = rnd(len(SIZES), n, dtype=torch.float16 if dtype == torch.float16 else torch.float32)
    out = npu_grouped_matmul(
        [x], [w_nk.transpose(1, 2)], bias=[bias], group_list=_cumsum(SIZES), split_item=3, group_type=0
    )[0]
    expected = torch.cat(ref_gmm_groups(x, [we.t() for we in w_nk], SIZES, list(bias))).to(dtype)
    close(out, expected, dtype)
    # the [E, N, K] storage passed as if it were [E, K, N] is caught with a hint
    with pytest.raises(ValueError, match="npu_grouped_matmul: weight.*transpose"):
        npu_grouped_matmul([x], [w_nk], group_list=_cumsum(SIZES), split_item=3, group_type=0)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_gmm_single_x_weight_list_single_y(dtype):
    sizes = [5, 2, 0]
    x = rnd(7, 9, dtype=dtype)
    ws = [rnd(9, 6, dtype=dtype) for _ in sizes]
    out = npu_grouped_matmul(x=[x], weight=ws, group_list=torch.tensor(sizes), split_item=2, group_type=0, group_list_type=1)
    assert len(out) == 1
    close(out[0], torch.cat(ref_gmm_groups(x, ws, sizes)).to(dtype), dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_gmm_multi_multi_multi_group_type_minus1(dtype):
    xs = [rnd(2, 3, 8, dtype=dtype), rnd(1, 5, 4, dtype=dtype), rnd(4, 1, 6, dtype=dtype)]  # 3-D x
    ws = [rnd(8, 3, dtype=dtype), rnd(4, 7, dtype=dtype), rnd(6, 2, dtype=dtype)]
    bias_dtype = torch.float16 if dtype == torch.float16 else torch.float32
    bs = [rnd(3, dtype=bias_dtype), rnd(7, dtype=bias_dtype), rnd(2, dtype=bias_dtype)]
    out = npu_grouped_matmul(xs, ws, bias=bs, split_item=0, group_type=-1)
    assert len(out) == 3
    for y, x, w, b in zip(out, xs, ws, bs):
        assert y.shape == (*x.shape[:-1], w.shape[1])
        close(y, (x.float() @ w.float() + b.float()).to(dtype), dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_gmm_multi_x_multi_w_single_y(dtype):
    xs = [rnd(3, 8, dtype=dtype), rnd(0, 8, dtype=dtype), rnd(5, 8, dtype=dtype)]
    ws = [rnd(8, 4, dtype=dtype) for _ in xs]
    out = npu_grouped_matmul(xs, ws, group_list=torch.tensor([3, 3, 8]), split_item=2, group_type=0)
    close(out[0], torch.cat([x.float() @ w.float() for x, w in zip(xs, ws)]).to(dtype), dtype)
    with pytest.raises(ValueError, match="npu_grouped_matmul: group_list"):
        npu_grouped_matmul(xs, ws, group_list=torch.tensor([2, 3, 8]), split_item=2, group_type=0)


@pytest.mark.parametrize("split_item", [0, 1, 2, 3])
def test_gmm_list_group_list_overload(split_item):
    dtype = torch.float32
    sizes = [4, 1, 6]
    x = rnd(11, 5)
    ws = [rnd(5, 3) for _ in sizes]
    out = npu_grouped_matmul([x], ws, group_list=[4, 5, 11], split_item=split_item)
    ref = ref_gmm_groups(x, ws, sizes)
    if split_item in (0, 1):
        assert len(out) == 3
        for y, r in zip(out, ref):
            close(y, r, dtype)
    else:
        assert len(out) == 1
        close(out[0], torch.cat(ref), dtype)


def test_gmm_group_type_2_groups_k():
    m, n = 6, 5
    k_sizes = [3, 0, 4]
    k = sum(k_sizes)
    x = rnd(k, m).t()  # logical [M, K], a transposed view as in expert-weight gradients
    w = rnd(k, n)
    out = npu_grouped_matmul([x], [w], group_list=_cumsum(k_sizes), split_item=3, group_type=2)
    assert len(out) == 1 and out[0].shape == (len(k_sizes), m, n)
    start = 0
    for g, size in enumerate(k_sizes):
        expected = sum((torch.outer(x[:, j], w[j]) for j in range(start, start + size)), torch.zeros(m, n))
        close(out[0][g], expected, torch.float32)
        start += size


def test_gmm_is_forward_only():
    x = rnd(4, 3).requires_grad_()
    w = rnd(2, 3, 2)
    y = npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 4]), split_item=2, group_type=0)[0]
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        y.sum().backward()
    assert x.grad is None


def _gmm_reject_cases():
    x16 = rnd(4, 3, dtype=torch.float16)
    w16 = rnd(2, 3, 2, dtype=torch.float16)
    gl = torch.tensor([1, 4])
    return [
        (dict(x=[x16], weight=[w16], group_list=gl, split_item=2), ValueError, "group_type.*Requires manual passing group_type"),
        (dict(x=[x16], weight=[w16], split_item=2), ValueError, "Requires manual passing group_type"),
        (dict(x=[x16], weight=[w16], group_list=torch.tensor([1, 3]), split_item=2, group_type=0), ValueError, "group_list .*end at M=4"),
        (dict(x=[x16], weight=[w16], group_list=torch.tensor([3, 2]), split_item=2, group_type=0, group_list_type=1), ValueError, "group_list .*sum to M=4"),
        (dict(x=[x16], weight=[w16], group_list=torch.tensor([3, 2]), split_item=2, group_type=0), ValueError, "group_list .*non-decreasing"),
        (dict(x=[x16], weight=[w16], group_list=gl.int(), split_item=2, group_type=0), TypeError, "group_list"),
        (dict(x=[x16], weight=[w16], group_list=gl, split_item=2, group_type=1), ValueError, "group_type"),
        (dict(x=[x16], weight=[w16], group_list=gl, split_item=0, group_type=0), ValueError, "split_item"),
        (dict(x=[x16], weight=[w16], group_list=gl, split_item=5, group_type=0), ValueError, "split_item"),
        (dict(x=x16, weight=[w16], group_list=gl, split_item=2, group_type=0), TypeError, "x must be a list"),
        (dict(x=[x16], weight=[w16.float()], group_list=gl, split_item=2, group_type=0), TypeError, "weight\\[0\\]"),
        (dict(x=[x16], weight=[w16], bias=[rnd(2, 2)], group_list=gl, split_item=2, group_type=0), TypeError, "bias\\[0\\]"),
        (dict(x=[x16], weight=[w16], scale=[rnd(2)], group_list=gl, split_item=2, group_type=0), NotImplementedError, "scale"),
        (dict(x=[x16], weight=[w16], group_list=gl, split_item=2, group_type=0, act_type=5), ValueError, "act_type"),
        (dict(x=[x16.float()], weight=[rnd(3, 2)], split_item=0, group_type=-1), TypeError, "float32"),
        (dict(x=[x16], weight=[rnd(3, 2, dtype=torch.float16)] * 2, group_list=[1, 4], group_type=0), ValueError, "group_type"),
        (dict(x=[x16], weight=[rnd(3, 2, dtype=torch.float16)] * 2, group_list=[4], split_item=2), ValueError, "group_list"),
        (dict(x=[x16], weight=[w16], group_list=[1, 4], split_item=2), ValueError, "weight"),
        (dict(x=[x16], weight=[w16], group_list=gl, split_item=0, group_type=-1), ValueError, "group_list"),
        (
            dict(x=[x16], weight=[rnd(3, 2, dtype=torch.float16), rnd(2, 3, dtype=torch.float16).t()], group_list=gl, split_item=2, group_type=0),
            ValueError,
            "transposed-ness",
        ),
        (dict(x=[rnd(3, 4, dtype=torch.float16).t()], weight=[w16], group_list=gl, split_item=2, group_type=0), ValueError, "x\\[0\\] must not be a transposed"),
    ]


@pytest.mark.parametrize("kwargs,exc,pattern", _gmm_reject_cases())
def test_gmm_rejects(kwargs, exc, pattern):
    with pytest.raises(exc, match=f"npu_grouped_matmul: .*{pattern}"):
        npu_grouped_matmul(**kwargs)


def test_gmm_rejects_inner_dims_at_65536():
    x = torch.zeros(2, 65536, dtype=torch.float16)
    with pytest.raises(ValueError, match="npu_grouped_matmul: .*K=65536"):
        npu_grouped_matmul([x], [torch.zeros(1, 65536, 1, dtype=torch.float16)], group_list=torch.tensor([2]), split_item=2, group_type=0)
    with pytest.raises(ValueError, match="npu_grouped_matmul: weight\\[0\\] N=65536"):
        npu_grouped_matmul([x[:, :2]], [torch.zeros(1, 2, 65536, dtype=torch.float16)], group_list=torch.tensor([2]), split_item=2, group_type=0)


# ---- npu_moe_token_permute / npu_moe_token_unpermute ------------------------------------------


def ref_permute(tokens, indices):
    """Experts in ascending order; within an expert, flat positions in increasing order."""
    flat = indices.reshape(-1).tolist()
    topk = indices.shape[1] if indices.dim() == 2 else 1
    rows = []
    for e in sorted(set(flat)):
        rows += [tokens[p // topk] for p, v in enumerate(flat) if v == e]
    return torch.stack(rows)


def test_permute_unpermute_docstring_examples():
    tokens = torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4]], dtype=torch.float16)
    indices = torch.tensor([[0, 1], [1, 0], [0, 2], [2, 0]])
    permuted, sorted_indices = npu_moe_token_permute(tokens, indices)
    assert sorted_indices.dtype == torch.int32
    assert sorted_indices.tolist() == [0, 4, 5, 1, 2, 6, 7, 3]
    assert permuted.tolist() == [[1, 1], [2, 2], [3, 3], [4, 4], [1, 1], [2, 2], [3, 3], [4, 4]]
    # the unpermute docstring example (same permuted_tokens / sorted_indices, probs 1/2)
    probs = torch.ones(4, 2, dtype=torch.float16) / 2
    out = npu_moe_token_unpermute(permuted, torch.tensor([0, 4, 5, 1, 2, 6, 7, 3], dtype=torch.int32), probs=probs)
    assert out.dtype == torch.float16
    assert out.tolist() == tokens.tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,topk,experts,h", [(11, 3, 5, 6), (7, 1, 4, 3), (1, 2, 2, 5)])
def test_permute_matches_loop_and_inverse_property(dtype, n, topk, experts, h):
    tokens = rnd(n, h, dtype=dtype)
    indices = torch.randint(0, experts, (n, topk), dtype=torch.int32)
    permuted, sorted_indices = npu_moe_token_permute(tokens, indices)
    assert permuted.dtype == dtype and permuted.shape == (n * topk, h)
    torch.testing.assert_close(permuted, ref_permute(tokens, indices), atol=0, rtol=0)
    for i in range(n * topk):
        assert torch.equal(permuted[sorted_indices[i]], tokens[i // topk])


def test_permute_1d_indices_and_num_out_tokens():
    tokens = rnd(6, 4)
    indices = torch.tensor([3, 1, 3, 0, 1, 2])  # 1-D: topK = 1
    full, si = npu_moe_token_permute(tokens, indices)
    torch.testing.assert_close(full, ref_permute(tokens, indices))
    assert si.shape == (6,)
    assert npu_moe_token_permute(tokens, indices, 4)[0].shape == (4, 4)
    torch.testing.assert_close(npu_moe_token_permute(tokens, indices, 4)[0], full[:4])
    assert npu_moe_token_permute(tokens, indices, -2)[0].shape == (4, 4)
    assert npu_moe_token_permute(tokens, indices, 0)[0].shape == (6, 4)
    assert npu_moe_token_permute(tokens, indices, 100)[0].shape == (6, 4)


def ref_unpermute(permuted, sorted_indices, probs):
    n, topk = probs.shape
    out = []
    for i in range(n):
        acc = torch.zeros(permuted.shape[1])
        for k in range(topk):
            r = int(sorted_indices[i * topk + k])
            if r < permuted.shape[0]:
                acc = acc + permuted[r].float() * probs[i, k].float()
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpermute_matches_loop_and_round_trips(dtype):
    n, topk, h = 9, 3, 5
    tokens = rnd(n, h, dtype=dtype)
    indices = torch.randint(0, 4, (n, topk))
    probs = torch.rand(n, topk).to(dtype)
    permuted, si = npu_moe_token_permute(tokens, indices)
    processed = (permuted.float() * 2 + 1).to(dtype)  # a stand-in expert
    out = npu_moe_token_unpermute(processed, si, probs)
    assert out.shape == (n, h) and out.dtype == dtype
    close(out, ref_unpermute(processed, si, probs).to(dtype), dtype)
    # round trip: each token comes back weighted by the sum of its probs
    back = npu_moe_token_unpermute(permuted, si, probs)
    close(back, (tokens.float() * probs.float().sum(1, keepdim=True)).to(dtype), dtype)
    # without probs: topK = 1 and weight 1
    p1, s1 = npu_moe_token_permute(tokens, indices[:, 0])
    torch.testing.assert_close(npu_moe_token_unpermute(p1, s1), tokens)


def test_unpermute_after_dropping_rows():
    n, topk = 6, 2
    tokens = rnd(n, 3)
    indices = torch.randint(0, 3, (n, topk))
    probs = torch.rand(n, topk)
    permuted, si = npu_moe_token_permute(tokens, indices, 7)  # keeps 7 of 12 rows
    out = npu_moe_token_unpermute(permuted, si, probs)
    torch.testing.assert_close(out, ref_unpermute(permuted, si, probs))


def test_permute_unpermute_backward():
    n, topk, h = 5, 2, 4
    tokens = rnd(n, h).requires_grad_()
    indices = torch.randint(0, 3, (n, topk))
    probs = torch.rand(n, topk, requires_grad=True)
    permuted, si = npu_moe_token_permute(tokens, indices)
    g_perm = torch.randn_like(permuted)
    permuted.backward(g_perm)
    # d tokens[t] = sum of the grads of its copies
    expected = torch.zeros(n, h)
    for i in range(n * topk):
        expected[i // topk] += g_perm[si[i]]
    torch.testing.assert_close(tokens.grad, expected)

    pt = rnd(n * topk, h).requires_grad_()
    g = torch.randn(n, h)
    npu_moe_token_unpermute(pt, si, probs).backward(g)
    got = pt.grad.clone(), probs.grad.clone()
    pt.grad = probs.grad = None
    ref_unpermute(pt, si, probs).backward(g)
    torch.testing.assert_close(got[0], pt.grad)
    torch.testing.assert_close(got[1], probs.grad)


@pytest.mark.parametrize(
    "tokens,indices,kw,exc,arg",
    [
        (rnd(2, 3, 4), torch.zeros(2, 1, dtype=torch.int64), {}, ValueError, "tokens"),
        (rnd(2, 4), torch.zeros(2, 1), {}, TypeError, "indices"),
        (rnd(2, 4), torch.zeros(2, 513, dtype=torch.int64), {}, ValueError, "indices"),
        (rnd(2, 4), torch.tensor([[0], [-1]]), {}, ValueError, "indices"),
        (rnd(2, 4), torch.tensor([[0], [16777215]]), {}, ValueError, "indices"),
        (rnd(2, 4), torch.zeros(3, 1, dtype=torch.int64), {}, ValueError, "indices"),
        (rnd(2, 4), torch.zeros(2, 1, dtype=torch.int64), {"padded_mode": True}, ValueError, "padded_mode"),
        (rnd(2, 4), torch.zeros(2, 1, dtype=torch.int64), {"num_out_tokens": -3}, ValueError, "num_out_tokens"),
    ],
)
def test_permute_rejects(tokens, indices, kw, exc, arg):
    with pytest.raises(exc, match=f"npu_moe_token_permute: {arg}"):
        npu_moe_token_permute(tokens, indices, **kw)


@pytest.mark.parametrize(
    "si,probs,kw,exc,arg",
    [
        (torch.tensor([0, 1, 2, 3]), None, {}, TypeError, "sorted_indices"),  # int64
        (torch.tensor([0, 1, 1, 3], dtype=torch.int32), None, {}, ValueError, "sorted_indices"),  # duplicate
        (torch.tensor([0, 1, 2, 4], dtype=torch.int32), None, {}, ValueError, "sorted_indices"),  # out of range
        (torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.rand(3, 2), {}, ValueError, "probs"),
        (torch.tensor([0, 1, 2, 3], dtype=torch.int32), None, {"restore_shape": [4, 2]}, ValueError, "restore_shape"),
        (torch.tensor([0, 1, 2, 3], dtype=torch.int32), None, {"padded_mode": True}, ValueError, "padded_mode"),
    ],
)
def test_unpermute_rejects(si, probs, kw, exc, arg):
    with pytest.raises(exc, match=f"npu_moe_token_unpermute: {arg}"):
        npu_moe_token_unpermute(rnd(4, 2), si, probs, **kw)


# ---- npu_moe_gating_top_k_softmax -------------------------------------------------------------


def ref_gating(x, k):
    """Per row: fp32 softmax cast to dtype, then the k largest (ties -> lower expert id)."""
    flat = x.reshape(-1, x.shape[-1])
    sm = torch.softmax(flat.float(), -1).to(x.dtype)
    ys, idx = [], []
    for row in sm:
        order = sorted(range(row.numel()), key=lambda e: (-float(row[e]), e))[:k]
        idx.append(order)
        ys.append(row[order])
    return torch.stack(ys).reshape(*x.shape[:-1], k), torch.tensor(idx, dtype=torch.int32).reshape(*x.shape[:-1], k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,k", [((7, 6), 2), ((2, 3, 8), 3), ((5, 4), 1), ((3, 5), 5)])
def test_gating_top_k_softmax(dtype, shape, k):
    x = rnd(*shape, dtype=dtype)
    y, expert_idx, row_idx = npu_moe_gating_top_k_softmax(x, k=k)
    ref_y, ref_idx = ref_gating(x, k)
    assert y.dtype == dtype and expert_idx.dtype == torch.int32 and row_idx.dtype == torch.int32
    assert y.shape == expert_idx.shape == row_idx.shape == (*shape[:-1], k)
    assert torch.equal(expert_idx, ref_idx)
    close(y, ref_y, dtype)
    n = x[..., 0].numel()
    flat_rows = row_idx.reshape(n, k)
    for i in range(n):
        for kk in range(k):
            assert flat_rows[i, kk] == kk * n + i  # k-major
    if k < shape[-1]:
        assert bool((y.float().sum(-1) < 1).all())  # not renormalized


def test_gating_ties_finished_and_forward_only():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 2.0, 3.0]], requires_grad=True)
    finished = torch.tensor([False, False, True])
    y, expert_idx, _ = npu_moe_gating_top_k_softmax(x, finished, k=2)
    assert expert_idx.tolist() == [[1, 2], [0, 1], [4, 4]]  # ties -> lower id; finished -> num_experts
    ref_y, _ = ref_gating(x.detach(), 2)
    torch.testing.assert_close(y.detach(), ref_y)  # finished rows keep their values
    with pytest.raises(RuntimeError, match="not implemented"):
        y.sum().backward()


@pytest.mark.parametrize(
    "x,finished,k,exc,arg",
    [
        (rnd(3, 4), None, 5, ValueError, "k"),
        (rnd(3, 4), None, 0, ValueError, "k"),
        (rnd(2, 3, 4, 5), None, 1, ValueError, "x"),
        (rnd(3, 4).double(), None, 1, TypeError, "x"),
        (rnd(3, 4), torch.zeros(4, dtype=torch.bool), 1, ValueError, "finished"),
        (rnd(3, 4), torch.zeros(3), 1, TypeError, "finished"),
        (rnd(2, 1100), None, 1025, ValueError, "k"),
    ],
)
def test_gating_rejects(x, finished, k, exc, arg):
    with pytest.raises(exc, match=f"npu_moe_gating_top_k_softmax: {arg}"):
        npu_moe_gating_top_k_softmax(x, finished, k)


# ---- npu_moe_init_routing ---------------------------------------------------------------------


def test_init_routing_hand_worked_doc_example():
    x = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4])
    row_idx = torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.int32)
    expert_idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32)
    # by hand: row-major flat experts [1,2,0,1,0,2], stable sort -> positions [2,4,0,3,1,5];
    # their k-major sources row_idx.flat[pos] = [1,2,0,4,3,5]; tokens = source % 3 = [1,2,0,1,0,2]
    expanded_x, expanded_row_idx, expanded_expert_idx = npu_moe_init_routing(x, row_idx, expert_idx, 3)
    assert expanded_expert_idx.tolist() == [0, 0, 1, 1, 2, 2]
    assert expanded_row_idx.tolist() == [2, 0, 1, 4, 3, 5]
    torch.testing.assert_close(expanded_x, x[[1, 2, 0, 1, 0, 2]])
    assert expanded_row_idx.dtype == torch.int32 and expanded_expert_idx.dtype == torch.int32
    # active_num caps the expanded rows at min(N, active_num) * K
    ex1, eri1, _ = npu_moe_init_routing(x, row_idx, expert_idx, 1)
    assert ex1.shape == (2, 4) and eri1.shape == (6,)
    torch.testing.assert_close(ex1, x[[1, 2]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_v1_pipeline_gating_init_finalize(dtype):
    """gating -> init_routing -> per-expert scaling -> finalize(mode 0) == sum_k w * (e+1) * x."""
    n, e, k, h = 9, 5, 2, 6
    logits = rnd(n, e, dtype=dtype)
    x = rnd(n, h, dtype=dtype)
    y, expert_idx, row_idx = npu_moe_gating_top_k_softmax(logits, k=k)
    expanded_x, expanded_row_idx, expanded_expert_idx = npu_moe_init_routing(x, row_idx, expert_idx, n)
    expert_out = (expanded_x.float() * (expanded_expert_idx.float() + 1).unsqueeze(1)).to(dtype)
    out = npu_moe_finalize_routing(expert_out, None, None, None, y, expanded_row_idx, expert_idx, 0, k)
    expected = torch.zeros(n, h)
    for i in range(n):
        for kk in range(k):
            expected[i] += y[i, kk].float() * (expert_idx[i, kk].item() + 1) * x[i].float()
    close(out, expected.to(dtype), dtype)


def test_init_routing_is_forward_only_and_rejects():
    x = rnd(3, 4).requires_grad_()
    row_idx = torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.int32)
    expert_idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32)
    ex, _, _ = npu_moe_init_routing(x, row_idx, expert_idx, 3)
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        ex.sum().backward()
    assert x.grad is None
    x = x.detach()
    with pytest.raises(TypeError, match="npu_moe_init_routing: row_idx"):
        npu_moe_init_routing(x, row_idx.long(), expert_idx, 3)
    with pytest.raises(TypeError, match="npu_moe_init_routing: expert_idx"):
        npu_moe_init_routing(x, row_idx, expert_idx.long(), 3)
    with pytest.raises(ValueError, match="npu_moe_init_routing: row_idx"):
        npu_moe_init_routing(x, torch.tensor([[0, 3], [1, 4], [2, 6]], dtype=torch.int32), expert_idx, 3)
    with pytest.raises(ValueError, match="npu_moe_init_routing: active_num"):
        npu_moe_init_routing(x, row_idx, expert_idx, -1)
    with pytest.raises(ValueError, match="npu_moe_init_routing: x"):
        npu_moe_init_routing(x.unsqueeze(0), row_idx, expert_idx, 3)


# ---- npu_moe_finalize_routing -----------------------------------------------------------------


def ref_finalize(rows, skip1, skip2, bias, scales, src, expert, mode, k):
    flat = rows.reshape(-1, rows.shape[-1]).float()
    n = scales.shape[0] if scales is not None else src.numel() // k
    kk = scales.shape[1] if scales is not None else k
    out = torch.zeros(n, flat.shape[1])
    for i in range(n):
        if skip1 is not None:
            out[i] += skip1[i].float()
        if skip2 is not None:
            out[i] += skip2[i].float()
        for j in range(kk):
            r = int(src[j * n + i] if mode in (0, 1) else src[i * kk + j])
            if r < 0:
                continue
            v = flat[r] + (bias[int(expert[i, j])].float() if bias is not None else 0)
            out[i] += (scales[i, j].float() if scales is not None else 1.0) * v
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_finalize_routing_modes(dtype, mode):
    n, k, e, h, cap = 7, 3, 4, 5, 8
    if mode in (1, 3):
        rows = rnd(e, cap, h, dtype=dtype)
        src = torch.randperm(e * cap)[: n * k].to(torch.int32)
        src[::4] = -1  # dropped entries contribute 0
    else:
        rows = rnd(n * k, h, dtype=dtype)
        src = torch.randperm(n * k).to(torch.int32)
    skip1, skip2 = rnd(n, h, dtype=dtype), rnd(n, h, dtype=dtype)
    bias = rnd(e, h, dtype=dtype)
    scales = torch.rand(n, k).to(dtype)
    expert = torch.randint(0, e, (n, k), dtype=torch.int32)
    out = npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, src, expert, drop_pad_mode=mode)
    assert out.shape == (n, h) and out.dtype == dtype
    close(out, ref_finalize(rows, skip1, skip2, bias, scales, src, expert, mode, k).to(dtype), dtype)


def test_finalize_routing_optional_inputs():
    n, k, h = 4, 2, 3
    rows = rnd(n * k, h)
    src = torch.randperm(n * k).to(torch.int32)
    out = npu_moe_finalize_routing(rows, None, None, None, None, src, None, 0, k)
    torch.testing.assert_close(out, ref_finalize(rows, None, None, None, None, src, None, 0, k))
    skip2 = rnd(n, h)
    out = npu_moe_finalize_routing(rows, None, skip2, None, None, src, None, 2, k)
    torch.testing.assert_close(out, ref_finalize(rows, None, skip2, None, None, src, None, 2, k))


def test_finalize_routing_forward_only_and_rejects():
    n, k, h = 4, 2, 3
    rows = rnd(n * k, h).requires_grad_()
    src = torch.randperm(n * k).to(torch.int32)
    scales = torch.rand(n, k)
    out = npu_moe_finalize_routing(rows, None, None, None, scales, src, None)
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        out.sum().backward()
    assert rows.grad is None
    rows = rows.detach()
    api = "npu_moe_finalize_routing"
    with pytest.raises(ValueError, match=f"{api}: drop_pad_mode"):
        npu_moe_finalize_routing(rows, None, None, None, scales, src, None, 4)
    bad = src.clone()
    bad[0] = -1
    with pytest.raises(ValueError, match=f"{api}: expanded_src_to_dst_row"):
        npu_moe_finalize_routing(rows, None, None, None, scales, bad, None, 0)
    with pytest.raises(TypeError, match=f"{api}: expanded_src_to_dst_row"):
        npu_moe_finalize_routing(rows, None, None, None, scales, src.long(), None, 0)
    with pytest.raises(ValueError, match=f"{api}: export_for_source_row"):
        npu_moe_finalize_routing(rows, None, None, rnd(3, h), scales, src, None, 0)
    with pytest.raises(ValueError, match=f"{api}: export_for_source_row"):
        npu_moe_finalize_routing(rows, None, None, rnd(3, h), scales, src, torch.full((n, k), 3, dtype=torch.int32), 0)
    with pytest.raises(TypeError, match=f"{api}: skip1"):
        npu_moe_finalize_routing(rows, rnd(n, h, dtype=torch.float16), None, None, scales, src, None, 0)
    with pytest.raises(ValueError, match=f"{api}: expanded_permuted_rows"):
        npu_moe_finalize_routing(rows.view(2, 4, h), None, None, None, scales, src, None, 0)
    with pytest.raises(ValueError, match=f"{api}: scales"):
        npu_moe_finalize_routing(rows, None, None, None, torch.rand(3, 2), src, None, 0)


# ---- signatures and the stand-in module -------------------------------------------------------


def test_signatures_match_schema():
    p = inspect.signature(npu_grouped_matmul).parameters
    assert list(p)[:2] == ["x", "weight"]
    kw_only = [name for name, q in p.items() if q.kind is inspect.Parameter.KEYWORD_ONLY]
    assert kw_only == [
        "bias", "scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale", "group_list",
        "activation_input", "activation_quant_scale", "activation_quant_offset", "split_item", "group_type",
        "group_list_type", "act_type", "tuning_config", "output_dtype", "x_dtype", "weight_dtype", "scale_dtype",
        "per_token_scale_dtype",
    ]  # fmt: skip
    assert p["split_item"].default == 0 and p["group_type"].default is None and p["group_list_type"].default == 0
    assert list(inspect.signature(npu_moe_token_permute).parameters) == ["tokens", "indices", "num_out_tokens", "padded_mode"]
    assert list(inspect.signature(npu_moe_token_unpermute).parameters) == [
        "permuted_tokens", "sorted_indices", "probs", "padded_mode", "restore_shape",
    ]  # fmt: skip
    assert list(inspect.signature(npu_moe_init_routing).parameters) == ["x", "row_idx", "expert_idx", "active_num"]
    assert list(inspect.signature(npu_moe_gating_top_k_softmax).parameters) == ["x", "finished", "k"]
    p = inspect.signature(npu_moe_finalize_routing).parameters
    assert list(p) == [
        "expanded_permuted_rows", "skip1", "skip2", "bias", "scales", "expanded_src_to_dst_row",
        "export_for_source_row", "drop_pad_mode", "k",
    ]  # fmt: skip
    assert p["drop_pad_mode"].default == 0 and p["k"].default == 1


def test_calls_counted_through_install():
    tokens = rnd(4, 3)
    indices = torch.randint(0, 2, (4, 2))
    with emulate.install() as emu:
        import torch_npu

        permuted, si = torch_npu.npu_moe_token_permute(tokens, indices)
        counts = torch.bincount(indices.flatten(), minlength=2)
        y = torch_npu.npu_grouped_matmul([permuted], [rnd(2, 3, 3)], group_list=counts, group_type=0, split_item=2, group_list_type=1)[0]
        torch_npu.npu_moe_token_unpermute(y, si, torch.rand(4, 2))
        assert emu.calls["npu_moe_token_permute"] == 1
        assert emu.calls["npu_grouped_matmul"] == 1
        assert emu.calls["npu_moe_token_unpermute"] == 1
