"""Emulated normalization fusions (spec §2, §9) against formulas written here from the spec."""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from npufuse import emulate
from npufuse.emulate.norms import (
    npu_add_layer_norm,
    npu_add_rms_norm,
    npu_gemma_rms_norm,
    npu_group_norm_silu,
    npu_rms_norm,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
SHAPES = [((2, 7), 1), ((3, 5, 33), 1), ((2, 3, 4, 17), 1), ((4, 3, 10), 2)]  # (x shape, gamma rank)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


# -- independent references (spec formulas) ------------------------------------------------------


def ref_rms(x, gamma, eps, offset=0.0):
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rms = torch.sqrt((xf * xf).sum(dims, keepdim=True) / math.prod(gamma.shape) + eps)
    return (xf / rms * (gamma.float() + offset)).to(x.dtype), 1.0 / rms


def ref_add_layer_norm(x1, x2, gamma, beta, eps):
    s = x1.float() + x2.float()
    y = F.layer_norm(s, tuple(gamma.shape), gamma.float(), beta.float(), eps)
    dims = tuple(range(x1.dim() - gamma.dim(), x1.dim()))
    var, mean = torch.var_mean(s, dims, unbiased=False, keepdim=True)
    return y, s, mean, 1.0 / torch.sqrt(var + eps)


def ref_group_norm_silu(x, weight, bias, group, eps):
    gn = F.group_norm(x.float(), group, None if weight is None else weight.float(), None if bias is None else bias.float(), eps)
    flat = x.float().reshape(x.shape[0], group, -1)
    var, mean = torch.var_mean(flat, -1, unbiased=False)
    return gn * torch.sigmoid(gn), mean, 1.0 / torch.sqrt(var + eps)


def params(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


P = inspect.Parameter.POSITIONAL_OR_KEYWORD
E = inspect.Parameter.empty


def test_signatures_match_schema():
    assert params(npu_rms_norm) == [("input", E, P), ("gamma", E, P), ("epsilon", 1e-06, P)]
    assert params(npu_add_rms_norm) == [("x1", E, P), ("x2", E, P), ("gamma", E, P), ("epsilon", 1e-06, P)]
    assert params(npu_gemma_rms_norm) == [("input", E, P), ("gamma", E, P), ("epsilon", 1e-06, P)]
    assert params(npu_add_layer_norm) == [
        ("x1", E, P), ("x2", E, P), ("gamma", E, P), ("beta", E, P), ("epsilon", 1e-05, P), ("additional_output", False, P)
    ]
    assert params(npu_group_norm_silu) == [("input", E, P), ("weight", E, P), ("bias", E, P), ("group", E, P), ("eps", 1e-05, P)]


# -- npu_rms_norm ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,r", SHAPES)
def test_rms_norm_forward(dtype, shape, r):
    x = torch.randn(shape, dtype=dtype) * 3
    gamma = torch.randn(shape[-r:], dtype=dtype)
    out = npu_rms_norm(x, gamma, 1e-5)
    assert isinstance(out, tuple) and len(out) == 2
    y, rstd = out
    assert y.dtype == dtype and y.shape == x.shape
    assert rstd.dtype == torch.float32 and rstd.shape == shape[: len(shape) - r] + (1,) * r
    y_ref, rstd_ref = ref_rms(x, gamma, 1e-5)
    close(y, y_ref, dtype)
    torch.testing.assert_close(rstd, rstd_ref, atol=1e-5, rtol=1e-5)


def test_rms_norm_default_eps_and_doc_example_shape():
    x, w = torch.randn(24, 1, 128), torch.randn(128)
    y, rstd = npu_rms_norm(x, w)
    assert rstd.shape == (24, 1, 1)
    close(y, ref_rms(x, w, 1e-6)[0], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_mixed_fp32_gamma(dtype):
    x, w = torch.randn(5, 19, dtype=dtype), torch.randn(19)
    y, _ = npu_rms_norm(x, w)
    assert y.dtype == dtype
    close(y, ref_rms(x, w, 1e-6)[0], dtype)


def test_rms_norm_noncontiguous_and_empty_accepted():
    x = torch.randn(16, 6).t()  # (6, 16) non-contiguous
    w = torch.randn(16)
    close(npu_rms_norm(x, w)[0], ref_rms(x, w, 1e-6)[0], torch.float32)
    y, rstd = npu_rms_norm(torch.randn(0, 16), w)
    assert y.shape == (0, 16) and rstd.shape == (0, 1)


def test_rms_norm_backward_matches_reference():
    x = torch.randn(3, 4, 21, requires_grad=True)
    w = torch.randn(21, requires_grad=True)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    g = torch.randn(3, 4, 21)
    y, rstd = npu_rms_norm(x, w, 1e-5)
    assert not rstd.requires_grad
    (y * g).sum().backward()
    (ref_rms(xr, wr, 1e-5)[0] * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "x,w,exc,arg",
    [
        (torch.randn(2, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), TypeError, "input"),
        (torch.randint(0, 5, (2, 8)), torch.randn(8), TypeError, "input"),
        (torch.randn(8), torch.randn(8), ValueError, "input"),  # 1-D: wheel doc says 2-8-D
        (torch.randn(2, 8), torch.randn(7), ValueError, "gamma"),
        (torch.randn(2, 8), torch.randn(2, 2, 8), ValueError, "gamma"),
        (torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.float16), TypeError, "gamma"),
        (torch.randn(2, 8), torch.randn(8, dtype=torch.float16), TypeError, "gamma"),
        (torch.randn(2, 8), [1.0] * 8, TypeError, "gamma"),
    ],
)
def test_rms_norm_rejects(x, w, exc, arg):
    with pytest.raises(exc, match=f"npu_rms_norm: {arg}"):
        npu_rms_norm(x, w)


def test_rms_norm_rejects_bad_epsilon():
    with pytest.raises(TypeError, match="npu_rms_norm: epsilon"):
        npu_rms_norm(torch.randn(2, 8), torch.randn(8), "1e-6")


# -- npu_add_rms_norm --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,r", SHAPES + [((9,), 1)])
def test_add_rms_norm_forward(dtype, shape, r):
    x1, x2 = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    gamma = torch.randn(shape[-r:], dtype=dtype)
    out = npu_add_rms_norm(x1, x2, gamma, 1e-5)
    assert isinstance(out, tuple) and len(out) == 3
    y, rstd, x = out
    assert y.dtype == x.dtype == dtype and y.shape == x.shape == x1.shape
    assert rstd.dtype == torch.float32 and rstd.shape == shape[: len(shape) - r] + (1,) * r
    # chosen reading of the spec's UNCERTAIN point: the residual is the dtype-rounded sum
    assert torch.equal(x, x1 + x2)
    y_ref, rstd_ref = ref_rms(x1 + x2, gamma, 1e-5)
    close(y, y_ref, dtype)
    torch.testing.assert_close(rstd, rstd_ref, atol=1e-5, rtol=1e-5)


def test_add_rms_norm_backward_raises():
    x1 = torch.randn(4, 16, requires_grad=True)
    y, _, x = npu_add_rms_norm(x1, torch.randn(4, 16), torch.randn(16))
    with pytest.raises(RuntimeError, match="npu_add_rms_norm.*not implemented"):
        y.sum().backward()
    with pytest.raises(RuntimeError, match="not implemented"):
        x.sum().backward()


@pytest.mark.parametrize(
    "x1,x2,w,exc,arg",
    [
        (torch.randn(2, 8), torch.randn(2, 8), torch.randn(8, dtype=torch.float16), TypeError, "gamma"),
        (torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float16), torch.randn(8), TypeError, "x2"),
        (torch.randn(2, 8), torch.randn(1, 8), torch.randn(8), ValueError, "x2"),
        (torch.randn(0, 8), torch.randn(0, 8), torch.randn(8), ValueError, "x1"),
        (torch.randn(2, 8), torch.randn(2, 8), torch.randn(4), ValueError, "gamma"),
        (torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), TypeError, "x1"),
    ],
)
def test_add_rms_norm_rejects(x1, x2, w, exc, arg):
    with pytest.raises(exc, match=f"npu_add_rms_norm: {arg}"):
        npu_add_rms_norm(x1, x2, w)


# -- npu_gemma_rms_norm ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,r", SHAPES + [((11,), 1)])
def test_gemma_rms_norm_forward(dtype, shape, r):
    x = torch.randn(shape, dtype=dtype)
    gamma = torch.randn(shape[-r:], dtype=dtype) * 0.1
    y, rstd = npu_gemma_rms_norm(x, gamma)
    assert y.dtype == dtype and y.shape == x.shape
    assert rstd.dtype == torch.float32 and rstd.shape == shape[: len(shape) - r] + (1,) * r
    y_ref, rstd_ref = ref_rms(x, gamma, 1e-6, offset=1.0)
    close(y, y_ref, dtype)
    torch.testing.assert_close(rstd, rstd_ref, atol=1e-5, rtol=1e-5)


def test_gemma_rms_norm_backward_warns_and_leaves_grad_none():
    x = torch.randn(4, 16, requires_grad=True)
    y, _ = npu_gemma_rms_norm(x, torch.zeros(16))
    with pytest.warns(UserWarning, match="npu_gemma_rms_norm: an autograd kernel was not registered"):
        y.sum().backward()
    assert x.grad is None


@pytest.mark.parametrize(
    "x,w,exc,arg",
    [
        (torch.randn(16, 4).t(), torch.randn(16), ValueError, "input"),  # non-contiguous
        (torch.randn(4, 16), torch.randn(32)[::2], ValueError, "gamma"),  # non-contiguous gamma
        (torch.randn(0, 16), torch.randn(16), ValueError, "input"),  # empty
        (torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(16), TypeError, "gamma"),  # must match
        (torch.randn(4, 16), torch.randn(15), ValueError, "gamma"),
    ],
)
def test_gemma_rms_norm_rejects(x, w, exc, arg):
    with pytest.raises(exc, match=f"npu_gemma_rms_norm: {arg}"):
        npu_gemma_rms_norm(x, w)


# -- npu_add_layer_norm ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,r", SHAPES)
def test_add_layer_norm_forward(dtype, shape, r):
    x1, x2 = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype) + 0.5
    gamma, beta = torch.randn(shape[-r:], dtype=dtype), torch.randn(shape[-r:], dtype=dtype)
    out = npu_add_layer_norm(x1, x2, gamma, beta, 1e-5, True)
    assert isinstance(out, tuple) and len(out) == 4
    y, mean, rstd, x = out
    stat_shape = shape[: len(shape) - r] + (1,)
    assert y.dtype == x.dtype == dtype and y.shape == x.shape == x1.shape
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == stat_shape
    y_ref, s_ref, mean_ref, rstd_ref = ref_add_layer_norm(x1, x2, gamma, beta, 1e-5)
    close(y, y_ref, dtype)
    close(x, s_ref, dtype)
    torch.testing.assert_close(mean, mean_ref.reshape(stat_shape), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rstd, rstd_ref.reshape(stat_shape), atol=1e-4, rtol=1e-4)


def test_add_layer_norm_x_without_additional_output_is_nan():
    x1, x2, g, b = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), torch.randn(8)
    y, _, _, x = npu_add_layer_norm(x1, x2, g, b)
    assert x.shape == x1.shape and torch.isnan(x).all()
    close(y, ref_add_layer_norm(x1, x2, g, b, 1e-5)[0], torch.float32)


@pytest.mark.parametrize("d1,d2", [(torch.float16, torch.float32), (torch.float32, torch.bfloat16)])
def test_add_layer_norm_mixed_dtypes_give_fp32(d1, d2):
    x1, x2 = torch.randn(4, 24, dtype=d1), torch.randn(4, 24, dtype=d2)
    g, b = torch.randn(24), torch.randn(24)
    y, _, _, x = npu_add_layer_norm(x1, x2, g, b, additional_output=True)
    assert y.dtype == x.dtype == torch.float32
    close(y, ref_add_layer_norm(x1, x2, g, b, 1e-5)[0], torch.float32)


def test_add_layer_norm_backward_matches_reference():
    leaves = [torch.randn(3, 5, 13), torch.randn(3, 5, 13), torch.randn(13), torch.randn(13)]
    mine = [t.clone().requires_grad_() for t in leaves]
    ref = [t.clone().requires_grad_() for t in leaves]
    gy, gx = torch.randn(3, 5, 13), torch.randn(3, 5, 13)
    y, mean, rstd, x = npu_add_layer_norm(*mine, 1e-5, True)
    assert not mean.requires_grad and not rstd.requires_grad
    ((y * gy).sum() + (x * gx).sum()).backward()
    y_ref, s_ref, _, _ = ref_add_layer_norm(*ref, 1e-5)
    ((y_ref * gy).sum() + (s_ref * gx).sum()).backward()
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "x1,x2,g,b,exc,arg",
    [
        (torch.randn(2, 8), torch.randn(2, 8), torch.randn(8), torch.randn(7), ValueError, "beta"),
        (torch.randn(2, 8), torch.randn(2, 8), torch.randn(8), torch.randn(8, dtype=torch.float16), TypeError, "beta"),
        (torch.randn(2, 8, dtype=torch.float16), torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8), torch.randn(8), TypeError, "x2"),
        (torch.randn(2, 8), torch.randn(2, 9), torch.randn(8), torch.randn(8), ValueError, "x2"),
        (torch.randn(2, 8), torch.randn(2, 8), torch.randn(9), torch.randn(9), ValueError, "gamma"),
        (torch.randn(2, 8, dtype=torch.float64),) * 2 + (torch.randn(8), torch.randn(8), TypeError, "x1"),
    ],
)
def test_add_layer_norm_rejects(x1, x2, g, b, exc, arg):
    with pytest.raises(exc, match=f"npu_add_layer_norm: {arg}"):
        npu_add_layer_norm(x1, x2, g, b)


# -- npu_group_norm_silu -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,group", [((2, 6, 5, 3), 3), ((3, 8), 4), ((1, 4, 7), 2), ((2, 6, 2, 3, 3), 6), ((2, 5, 3, 3), 1)])
def test_group_norm_silu_forward(dtype, shape, group):
    x = torch.randn(shape, dtype=dtype) * 2 + 1
    w, b = torch.randn(shape[1], dtype=dtype), torch.randn(shape[1], dtype=dtype)
    out = npu_group_norm_silu(x, w, b, group, 1e-5)
    assert isinstance(out, tuple) and len(out) == 3
    y, mean, rstd = out
    assert y.dtype == mean.dtype == rstd.dtype == dtype
    assert y.shape == x.shape and mean.shape == rstd.shape == (shape[0], group)
    y_ref, mean_ref, rstd_ref = ref_group_norm_silu(x, w, b, group, 1e-5)
    close(y, y_ref, dtype)
    close(mean, mean_ref, dtype)
    close(rstd, rstd_ref, dtype)


def test_group_norm_silu_optional_affine_and_fp32_weight():
    x = torch.randn(2, 6, 4, 4, dtype=torch.bfloat16)
    y, _, _ = npu_group_norm_silu(x, None, None, 2)
    close(y, ref_group_norm_silu(x, None, None, 2, 1e-5)[0], torch.bfloat16)
    w, b = torch.randn(6), torch.randn(6)
    y, mean, _ = npu_group_norm_silu(x, w, b, 3)
    assert y.dtype == mean.dtype == torch.bfloat16  # stats follow input (C++ wrapper), not weight
    close(y, ref_group_norm_silu(x, w, b, 3, 1e-5)[0], torch.bfloat16)


def test_group_norm_silu_noncontiguous_input():
    x = torch.randn(2, 5, 5, 6).permute(0, 3, 1, 2)  # (2, 6, 5, 5) channels-last strides
    assert not x.is_contiguous()
    w, b = torch.randn(6), torch.randn(6)
    close(npu_group_norm_silu(x, w, b, 3)[0], ref_group_norm_silu(x, w, b, 3, 1e-5)[0], torch.float32)


def test_group_norm_silu_backward_warns_and_leaves_grad_none():
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    y, _, _ = npu_group_norm_silu(x, torch.ones(4), torch.zeros(4), 2)
    with pytest.warns(UserWarning, match="npu_group_norm_silu: an autograd kernel was not registered"):
        y.sum().backward()
    assert x.grad is None


@pytest.mark.parametrize(
    "x,w,b,group,exc,arg",
    [
        (torch.randn(2, 6, 3), torch.randn(6), torch.randn(6), 4, ValueError, "group"),
        (torch.randn(2, 6, 3), torch.randn(6), torch.randn(6), 0, ValueError, "group"),
        (torch.randn(2, 6, 3), torch.randn(6), torch.randn(6), 2.0, TypeError, "group"),
        (torch.randn(2, 6, 3), torch.randn(5), torch.randn(6), 2, ValueError, "weight"),
        (torch.randn(6), None, None, 2, ValueError, "input"),
        (torch.randn(2, 6, 3, dtype=torch.float16), torch.randn(6, dtype=torch.bfloat16), None, 2, TypeError, "weight"),
        (torch.randn(2, 6, 3), torch.randn(6, dtype=torch.float16), torch.randn(6, dtype=torch.float16), 2, TypeError, "weight"),
        (torch.randn(2, 6, 3, dtype=torch.float16), torch.randn(6), torch.randn(6, dtype=torch.float16), 2, TypeError, "bias"),
        (torch.randn(2, 6, 3, dtype=torch.float64), None, None, 2, TypeError, "input"),
    ],
)
def test_group_norm_silu_rejects(x, w, b, group, exc, arg):
    with pytest.raises(exc, match=f"npu_group_norm_silu: {arg}"):
        npu_group_norm_silu(x, w, b, group)


# -- through the installed stand-in ------------------------------------------------------------


def test_resolve_and_count_through_install():
    x, w = torch.randn(2, 8), torch.randn(8)
    with emulate.install() as emu:
        import torch_npu

        torch_npu.npu_rms_norm(x, w)
        torch_npu.npu_rms_norm(x, w, 1e-5)
        torch_npu.npu_add_rms_norm(x, x, w)
        torch_npu.npu_gemma_rms_norm(x, w)
        torch_npu.npu_add_layer_norm(x, x, w, w)
        torch_npu.npu_group_norm_silu(x, w, w, 4)
        assert params(torch_npu.npu_rms_norm) == params(npu_rms_norm)
    assert emu.calls["npu_rms_norm"] == 2
    for name in ("npu_add_rms_norm", "npu_gemma_rms_norm", "npu_add_layer_norm", "npu_group_norm_silu"):
        assert emu.calls[name] == 1
    api = emulate.REGISTRY["npu_rms_norm"]
    assert api.autograd and api.spec == "2.1" and api.summary.startswith("RMSNorm")
    assert not emulate.REGISTRY["npu_add_rms_norm"].autograd and emulate.REGISTRY["npu_add_layer_norm"].autograd
