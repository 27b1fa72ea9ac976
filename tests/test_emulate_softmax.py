"""Softmax / dropout / confusion-transpose emulations against formulas written here from spec §6."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from npufuse import emulate
from npufuse.emulate.softmax import (
    npu_confusion_transpose,
    npu_dropout_with_add_softmax,
    npu_scaled_masked_softmax,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(4321)


def close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def ref_softmax(z, dim=-1):
    """exp-normalize written out (no torch.softmax)."""
    e = torch.exp(z - z.max(dim=dim, keepdim=True).values)
    return e / e.sum(dim=dim, keepdim=True)


def ref_scaled_masked_softmax(x, mask, scale):
    z = x * scale
    z = torch.where(mask, torch.full_like(z, -10000.0), z)
    return ref_softmax(z)


# ---- npu_scaled_masked_softmax ----------------------------------------------------------------

SMS_CASES = [
    ((2, 3, 32, 64), (1, 1, 32, 64)),
    ((2, 3, 32, 64), (2, 1, 32, 64)),
    ((1, 2, 96, 32), (1, 2, 96, 32)),
    ((3, 1, 64, 160), (3, 1, 64, 160)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xs,ms", SMS_CASES)
def test_scaled_masked_softmax_matches_formula(dtype, xs, ms):
    x = (torch.randn(xs) * 3).to(dtype)
    mask = torch.rand(ms) < 0.3
    scale = 0.125
    out = npu_scaled_masked_softmax(x, mask, scale)
    assert out.shape == x.shape and out.dtype == dtype
    close(out, ref_scaled_masked_softmax(x.float(), mask, scale).to(dtype), dtype)


def test_scaled_masked_softmax_true_means_masked_and_full_rows_are_uniform():
    x = torch.randn(1, 1, 32, 32)
    mask = torch.zeros(1, 1, 32, 32, dtype=torch.bool)
    mask[..., 0, :] = True  # fully masked row
    mask[..., 1, 5] = True
    out = npu_scaled_masked_softmax(x, mask)
    torch.testing.assert_close(out[0, 0, 0], torch.full((32,), 1 / 32))
    assert out[0, 0, 1, 5] < 1e-30
    assert not torch.isnan(out).any()


def test_scaled_masked_softmax_backward():
    x = torch.randn(2, 2, 32, 64, requires_grad=True)
    mask = torch.rand(1, 2, 32, 64) < 0.4
    g = torch.randn(2, 2, 32, 64)
    npu_scaled_masked_softmax(x, mask, 0.5).backward(g)
    got = x.grad.clone()
    x.grad = None
    ref_scaled_masked_softmax(x, mask, 0.5).backward(g)
    torch.testing.assert_close(got, x.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "xs,ms,mask_dtype,kw,exc,arg",
    [
        ((1, 1, 32, 32), (1, 1, 32, 32), torch.float32, {}, TypeError, "mask"),  # additive float mask
        ((1, 1, 32, 48), (1, 1, 32, 48), torch.bool, {}, ValueError, "x"),  # S2 not a multiple of 32
        ((1, 1, 16, 32), (1, 1, 16, 32), torch.bool, {}, ValueError, "x"),  # S1 < 32
        ((1, 1, 32, 4128), (1, 1, 32, 4128), torch.bool, {}, ValueError, "x"),  # S2 > 4096
        ((1, 32, 32), (1, 32, 32), torch.bool, {}, ValueError, "x"),  # 3-D
        ((2, 1, 32, 32), (3, 1, 32, 32), torch.bool, {}, ValueError, "mask"),  # bad broadcast
        ((1, 1, 32, 32), (32, 32), torch.bool, {}, ValueError, "mask"),  # not [B|1, N|1, S1, S2]
        ((1, 1, 32, 32), (1, 1, 32, 32), torch.bool, {"fixed_triu_mask": True}, ValueError, "fixed_triu_mask"),
    ],
)
def test_scaled_masked_softmax_rejects(xs, ms, mask_dtype, kw, exc, arg):
    x = torch.randn(xs)
    mask = torch.zeros(ms, dtype=mask_dtype)
    with pytest.raises(exc, match=f"npu_scaled_masked_softmax: {arg}"):
        npu_scaled_masked_softmax(x, mask, **kw)


def test_scaled_masked_softmax_rejects_fp64_x():
    with pytest.raises(TypeError, match="npu_scaled_masked_softmax: x"):
        npu_scaled_masked_softmax(torch.randn(1, 1, 32, 32, dtype=torch.float64), torch.zeros(1, 1, 32, 32, dtype=torch.bool))
    with pytest.raises(TypeError, match="npu_scaled_masked_softmax: scale"):
        npu_scaled_masked_softmax(torch.randn(1, 1, 32, 32), torch.zeros(1, 1, 32, 32, dtype=torch.bool), "0.5")
    # a 0-dim tensor is a valid Scalar
    out = npu_scaled_masked_softmax(torch.ones(1, 1, 32, 32), torch.zeros(1, 1, 32, 32, dtype=torch.bool), torch.tensor(0.5))
    torch.testing.assert_close(out, torch.full((1, 1, 32, 32), 1 / 32))


# ---- npu_dropout_with_add_softmax -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 16, 128, 128), (1, 32, 128, 256)])
def test_dropout_with_add_softmax_prob0_is_softmax(dtype, shape):
    s = torch.randn(shape).to(dtype)
    x1 = torch.randn(shape).to(dtype)
    alpha = 1 / math.sqrt(64)
    out = npu_dropout_with_add_softmax(s, x1, alpha, 0.0, -1)
    assert isinstance(out, tuple) and len(out) == 3
    mask, sm, dropped = out
    expected = ref_softmax(x1.float() + alpha * s.float()).to(dtype)
    close(sm, expected, dtype)
    close(dropped, expected, dtype)
    assert sm.dtype == dtype and dropped.dtype == dtype and dropped.shape == shape
    assert mask.dtype == torch.uint8 and mask.dim() == 1
    assert mask.numel() == math.ceil(s.numel() / 128) * 128
    assert bool((mask == 1).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_with_add_softmax_drops_with_prob_and_rescales(dtype):
    shape = (2, 16, 128, 128)
    s = torch.randn(shape).to(dtype)
    x1 = torch.randn(shape).to(dtype)
    p = 0.3
    mask, sm, dropped = npu_dropout_with_add_softmax(s, x1, 2, p, -1)
    keep = mask[: s.numel()].view(shape).float()
    assert abs(keep.mean().item() - (1 - p)) < 0.01  # prob is the DROP probability
    expected = (ref_softmax(x1.float() + 2 * s.float()) * keep / (1 - p)).to(dtype)
    close(dropped, expected, dtype)
    close(sm, ref_softmax(x1.float() + 2 * s.float()).to(dtype), dtype)


def test_dropout_with_add_softmax_is_seeded():
    s = torch.randn(1, 32, 128, 128)
    torch.manual_seed(7)
    a = npu_dropout_with_add_softmax(s, s, 1, 0.5, -1)[0]
    torch.manual_seed(7)
    b = npu_dropout_with_add_softmax(s, s, 1, 0.5, -1)[0]
    assert torch.equal(a, b)


def test_dropout_with_add_softmax_backward_through_result_2():
    shape = (1, 32, 128, 128)
    s = torch.randn(shape, requires_grad=True)
    x1 = torch.randn(shape, requires_grad=True)
    alpha, p = 0.7, 0.2
    g = torch.randn(shape)
    mask, _, dropped = npu_dropout_with_add_softmax(s, x1, alpha, p, -1)
    dropped.backward(g)
    got = s.grad.clone(), x1.grad.clone()
    s.grad = x1.grad = None
    keep = mask[: s.numel()].view(shape).float()
    (ref_softmax(x1 + alpha * s) * keep / (1 - p)).backward(g)
    torch.testing.assert_close(got[0], s.grad, atol=1e-6, rtol=1e-4)
    # the C++ backward returns (result, grad): x1 gets the incoming gradient unchanged
    torch.testing.assert_close(got[1], g)


def test_dropout_with_add_softmax_ignores_grad_of_softmax_out():
    shape = (1, 32, 128, 128)
    s = torch.randn(shape, requires_grad=True)
    mask, sm, out = npu_dropout_with_add_softmax(s, torch.randn(shape), 1, 0.1, -1)
    # output_differentiability [false, false, true]
    assert not mask.requires_grad and not sm.requires_grad and out.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        (sm * torch.randn(shape)).sum().backward()


@pytest.mark.parametrize(
    "shape,kw,exc,arg",
    [
        ((1, 32, 100, 128), {}, ValueError, "input"),  # H not in {128,256,384,512}
        ((1, 16, 128, 128), {}, ValueError, "input"),  # N*C % 32 != 0
        ((32, 128, 128), {}, ValueError, "input"),  # 3-D
        ((1, 32, 128, 128), {"dim": 2}, ValueError, "dim"),
        ((1, 32, 128, 128), {"prob": 1.0}, ValueError, "prob"),
        ((1, 32, 128, 128), {"x1_shape": (1, 32, 128, 256)}, ValueError, "x1"),
        ((1, 32, 128, 128), {"x1_dtype": torch.float16}, TypeError, "x1"),
    ],
)
def test_dropout_with_add_softmax_rejects(shape, kw, exc, arg):
    s = torch.randn(shape)
    x1 = torch.randn(kw.get("x1_shape", shape)).to(kw.get("x1_dtype", torch.float32))
    with pytest.raises(exc, match=f"npu_dropout_with_add_softmax: {arg}"):
        npu_dropout_with_add_softmax(s, x1, 1.0, kw.get("prob", 0.1), kw.get("dim", -1))


# ---- npu_confusion_transpose ------------------------------------------------------------------


def test_confusion_transpose_doc_examples():
    x = torch.rand(2, 3, 4, 6)
    y = npu_confusion_transpose(x, (0, 2, 1, 3), (2, 4, 18), True)
    assert y.shape == (2, 4, 18)
    # written out: element [b, s, n*6 + d] = x[b, n, s, d]
    expected = torch.empty(2, 4, 18)
    for b in range(2):
        for s in range(4):
            for n in range(3):
                expected[b, s, n * 6 : (n + 1) * 6] = x[b, n, s]
    torch.testing.assert_close(y, expected)
    y2 = npu_confusion_transpose(x, (0, 2, 1), (2, 12, 6), False)
    assert y2.shape == (2, 6, 12)
    torch.testing.assert_close(y2, x.reshape(2, 12, 6).transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
def test_confusion_transpose_head_split_and_merge(dtype):
    b, s, n, d = 3, 5, 7, 2
    x = (torch.randn(b, s, n * d) * 10).to(dtype)
    split = npu_confusion_transpose(x, (0, 2, 1, 3), (b, s, n, d), False)
    assert split.shape == (b, n, s, d) and split.is_contiguous() and split.dtype == dtype
    torch.testing.assert_close(split, x.view(b, s, n, d).transpose(1, 2))
    merged = npu_confusion_transpose(split, (0, 2, 1, 3), (b, s, n * d), True)
    assert merged.is_contiguous()
    torch.testing.assert_close(merged, x)


def test_confusion_transpose_backward():
    x = torch.randn(2, 5, 12, requires_grad=True)
    g = torch.randn(2, 3, 5, 4)
    npu_confusion_transpose(x, [0, 2, 1, 3], [2, 5, 3, 4], False).backward(g)
    torch.testing.assert_close(x.grad, g.transpose(1, 2).reshape(2, 5, 12))


@pytest.mark.parametrize(
    "dtype,perm,shape,tf,exc,arg",
    [
        (torch.bfloat16, (0, 2, 1, 3), (2, 4, 18), True, TypeError, "input"),  # not in the doc's dtype list
        (torch.float64, (0, 2, 1, 3), (2, 4, 18), True, TypeError, "input"),
        (torch.float32, (0, 2, 2, 3), (2, 4, 18), True, ValueError, "perm"),
        (torch.float32, (0, 2, 1), (2, 4, 18), True, ValueError, "perm"),  # rank of self is 4
        (torch.float32, (0, 2, 1, 3), (2, 4, 17), True, ValueError, "shape"),
        (torch.float32, "abc", (2, 4, 18), True, TypeError, "perm"),
    ],
)
def test_confusion_transpose_rejects(dtype, perm, shape, tf, exc, arg):
    x = torch.randn(2, 3, 4, 6).to(dtype)
    with pytest.raises(exc, match=f"npu_confusion_transpose: {arg}"):
        npu_confusion_transpose(x, perm, shape, tf)


# ---- signatures and the stand-in module -------------------------------------------------------


def test_signatures_match_schema():
    p = inspect.signature(npu_scaled_masked_softmax).parameters
    assert list(p) == ["x", "mask", "scale", "fixed_triu_mask"]
    assert p["scale"].default == 1 and p["fixed_triu_mask"].default is False
    assert list(inspect.signature(npu_dropout_with_add_softmax).parameters) == ["input", "x1", "alpha", "prob", "dim"]
    assert list(inspect.signature(npu_confusion_transpose).parameters) == ["input", "perm", "shape", "transpose_first"]


def test_calls_counted_through_install():
    with emulate.install() as emu:
        import torch_npu

        torch_npu.npu_scaled_masked_softmax(torch.randn(1, 1, 32, 32), torch.zeros(1, 1, 32, 32, dtype=torch.bool))
        torch_npu.npu_confusion_transpose(torch.randn(2, 3, 4), (1, 0, 2), (3, 2, 4), True)
        torch_npu.npu_confusion_transpose(torch.randn(2, 3, 4), (1, 0, 2), (3, 2, 4), True)
        assert emu.calls["npu_scaled_masked_softmax"] == 1
        assert emu.calls["npu_confusion_transpose"] == 2
