"""Emulated activation fusions (spec §3) against formulas written here from the spec."""

import inspect
import math

import pytest
import torch

from npufuse import emulate
from npufuse.emulate.activations import fast_gelu, npu_fast_gelu, npu_geglu, npu_gelu_mul, npu_swiglu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
SPLITS = [((4, 10), -1), ((6, 7), 0), ((2, 8, 3), 1), ((3, 2, 5, 14), -1), ((12,), 0)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


# -- independent references (spec formulas) ------------------------------------------------------


def halves(x, dim):
    n = x.shape[dim] // 2
    return x.narrow(dim, 0, n), x.narrow(dim, n, n)


def gelu_erf(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2.0)))


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def ref_swiglu(x, dim):
    a, b = halves(x, dim)
    if x.dtype == torch.float32:
        return a * torch.sigmoid(a) * b
    af = a.float()
    return ((af / (1 + torch.exp(-af))).to(x.dtype).float() * b.float()).to(x.dtype)


def ref_fast_gelu(x):
    # the 910/310P numerically stable form from the doc: x/(1+exp(-1.702|x|)) * exp(0.851(x-|x|))
    xf = x.float()
    return (xf / (1 + torch.exp(-1.702 * xf.abs())) * torch.exp(0.851 * (xf - xf.abs()))).to(x.dtype)


def params(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


P = inspect.Parameter.POSITIONAL_OR_KEYWORD
K = inspect.Parameter.KEYWORD_ONLY
E = inspect.Parameter.empty


def test_signatures_match_schema():
    assert params(npu_swiglu) == [("input", E, P), ("dim", -1, P)]
    assert params(npu_geglu) == [("input", E, P), ("dim", -1, P), ("approximate", 1, P), ("activate_left", False, P)]
    assert params(npu_gelu_mul) == [("input", E, P), ("approximate", "none", K)]
    assert params(npu_fast_gelu) == [("input", E, P)]
    assert params(fast_gelu) == [("input", E, P)]


# -- npu_swiglu --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", SPLITS)
def test_swiglu_forward(dtype, shape, dim):
    x = torch.randn(shape, dtype=dtype) * 2
    y = npu_swiglu(x, dim)
    expect_shape = list(shape)
    expect_shape[dim] //= 2
    assert isinstance(y, torch.Tensor) and y.dtype == dtype and list(y.shape) == expect_shape
    close(y, ref_swiglu(x, dim), dtype)


def test_swiglu_default_dim_is_last_and_first_half_is_gated():
    gate, up = torch.randn(3, 5), torch.randn(3, 5)
    y = npu_swiglu(torch.cat([gate, up], -1))
    close(y, torch.nn.functional.silu(gate) * up, torch.float32)


def test_swiglu_backward_matches_reference():
    x = torch.randn(4, 3, 18, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    g = torch.randn(4, 3, 9)
    (npu_swiglu(x) * g).sum().backward()
    (ref_swiglu(xr, -1) * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "x,dim,exc,arg",
    [
        (torch.randn(4, 7), -1, ValueError, "input"),  # odd split dim
        (torch.randn(8, 4).t(), -1, ValueError, "input"),  # non-contiguous
        (torch.randn(4, 8, dtype=torch.float64), -1, TypeError, "input"),
        (torch.randn(4, 8), 2, ValueError, "dim"),
        (torch.randn(4, 8), 1.0, TypeError, "dim"),
        (torch.tensor(1.0), -1, ValueError, "input"),  # 0-D
        (torch.randn((1,) * 9), -1, ValueError, "input"),  # 9-D
    ],
)
def test_swiglu_rejects(x, dim, exc, arg):
    with pytest.raises(exc, match=f"npu_swiglu: {arg}"):
        npu_swiglu(x, dim)


# -- npu_geglu ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", SPLITS)
@pytest.mark.parametrize("approximate", [0, 1])
@pytest.mark.parametrize("activate_left", [False, True])
def test_geglu_forward(dtype, shape, dim, approximate, activate_left):
    x = torch.randn(shape, dtype=dtype) * 2
    out = npu_geglu(x, dim, approximate, activate_left)
    assert isinstance(out, tuple) and len(out) == 2
    y, y_gelu = out
    expect_shape = list(shape)
    expect_shape[dim] //= 2
    assert y.dtype == y_gelu.dtype == dtype and list(y.shape) == list(y_gelu.shape) == expect_shape
    a, b = (t.float() for t in halves(x, dim))
    gelu = gelu_tanh if approximate == 1 else gelu_erf
    act, other = (a, b) if activate_left else (b, a)
    close(y, (gelu(act) * other).to(dtype), dtype)
    close(y_gelu, gelu(act).to(dtype), dtype)


def test_geglu_defaults_are_tanh_and_gelu_on_second_half():
    hidden, gate = torch.randn(3, 6), torch.randn(3, 6)
    y, _ = npu_geglu(torch.cat([hidden, gate], -1))
    close(y, hidden * gelu_tanh(gate), torch.float32)


def test_geglu_noncontiguous_accepted():
    x = torch.randn(10, 4).t()
    close(npu_geglu(x, -1, 0)[0], halves(x, -1)[0] * gelu_erf(halves(x, -1)[1]), torch.float32)


def test_geglu_backward_through_out_only():
    x = torch.randn(5, 2, 12, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    g = torch.randn(5, 2, 6)
    y, y_gelu = npu_geglu(x, -1, 0)
    assert y.requires_grad and not y_gelu.requires_grad
    (y * g).sum().backward()
    a, b = halves(xr, -1)
    ((a * gelu_erf(b)) * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "x,kwargs,exc,arg",
    [
        (torch.randn(4, 7), {}, ValueError, "input"),
        (torch.randn(4, 8), {"approximate": 2}, ValueError, "approximate"),
        (torch.randn(4, 8), {"approximate": "tanh"}, TypeError, "approximate"),
        (torch.randn(4, 8), {"activate_left": 1}, TypeError, "activate_left"),
        (torch.randn(4, 8), {"dim": -3}, ValueError, "dim"),
        (torch.tensor(2.0), {"dim": 0}, ValueError, "input"),  # 0-D refused (see docstring)
        (torch.randn(4, 8, dtype=torch.float64), {}, TypeError, "input"),
        (torch.randint(0, 4, (4, 8)), {}, TypeError, "input"),
    ],
)
def test_geglu_rejects(x, kwargs, exc, arg):
    with pytest.raises(exc, match=f"npu_geglu: {arg}"):
        npu_geglu(x, **kwargs)


# -- npu_gelu_mul ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 10), (3, 5, 34), (2, 1, 3, 1024), (7, 2)])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_mul_forward(dtype, shape, approximate):
    x = torch.randn(shape, dtype=dtype) * 2
    y = npu_gelu_mul(x, approximate=approximate)
    assert isinstance(y, torch.Tensor) and y.dtype == dtype and y.shape == shape[:-1] + (shape[-1] // 2,)
    left, right = (t.float() for t in halves(x, -1))
    gelu = gelu_tanh if approximate == "tanh" else gelu_erf
    close(y, (gelu(left) * right).to(dtype), dtype)


def test_gelu_mul_default_is_erf_and_noncontiguous_accepted():
    x = torch.randn(8, 5).t()
    left, right = halves(x, -1)
    close(npu_gelu_mul(x), gelu_erf(left) * right, torch.float32)


def test_gelu_mul_approximate_is_keyword_only():
    with pytest.raises(TypeError):
        npu_gelu_mul(torch.randn(2, 4), "tanh")


def test_gelu_mul_backward_warns_and_leaves_grad_none():
    # no derivative registered: VariableFallbackKernel warns and passes no gradient on
    x = torch.randn(3, 8, requires_grad=True)
    with pytest.warns(UserWarning, match="npu_gelu_mul: an autograd kernel was not registered"):
        npu_gelu_mul(x).sum().backward()
    assert x.grad is None


@pytest.mark.parametrize(
    "x,kwargs,exc,arg",
    [
        (torch.randn(4, 7), {}, ValueError, "input"),  # odd last dim
        (torch.randn(2, 1026), {}, ValueError, "input"),  # > 1024
        (torch.randn(200001, 2), {}, ValueError, "input"),  # too many rows
        (torch.randn(8), {}, ValueError, "input"),  # 1-D
        (torch.randn(4, 8), {"approximate": "erf"}, ValueError, "approximate"),
        (torch.randn(4, 8), {"approximate": 0}, TypeError, "approximate"),
        (torch.randn(4, 8, dtype=torch.float64), {}, TypeError, "input"),
    ],
)
def test_gelu_mul_rejects(x, kwargs, exc, arg):
    with pytest.raises(exc, match=f"npu_gelu_mul: {arg}"):
        npu_gelu_mul(x, **kwargs)


# -- npu_fast_gelu / fast_gelu ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(17,), (3, 5, 7), (2, 1, 4, 9), ()])
def test_npu_fast_gelu_forward(dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 4
    y = npu_fast_gelu(x)
    assert y.dtype == dtype and y.shape == x.shape
    close(y, ref_fast_gelu(x), dtype)
    close(y, (x.float() * torch.sigmoid(1.702 * x.float())).to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fast_gelu_forward(dtype):
    x = torch.randn(6, 11, dtype=dtype) * 4
    y = fast_gelu(x)
    assert y.dtype == dtype and y.shape == x.shape
    close(y, ref_fast_gelu(x), dtype)


def test_fast_gelu_extreme_values_are_finite():
    x = torch.tensor([-1e4, -100.0, 0.0, 100.0, 1e4])
    torch.testing.assert_close(npu_fast_gelu(x), torch.tensor([0.0, 0.0, 0.0, 100.0, 1e4]))


@pytest.mark.parametrize("fn", [npu_fast_gelu, fast_gelu])
def test_fast_gelu_backward_matches_reference(fn):
    x = torch.randn(4, 13, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    g = torch.randn(4, 13)
    (fn(x) * g).sum().backward()
    (ref_fast_gelu(xr) * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)


def test_fast_gelu_rejects():
    with pytest.raises(TypeError, match="fast_gelu: input has dtype bfloat16"):
        fast_gelu(torch.randn(4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="npu_fast_gelu: input"):
        npu_fast_gelu(torch.randn(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="npu_fast_gelu: input"):
        npu_fast_gelu(torch.randn((1,) * 9))
    with pytest.raises(TypeError, match="npu_fast_gelu: input"):
        npu_fast_gelu([1.0, 2.0])


# -- through the installed stand-in ------------------------------------------------------------


def test_resolve_and_count_through_install():
    x = torch.randn(4, 8)
    with emulate.install() as emu:
        import torch_npu

        torch_npu.npu_swiglu(x)
        torch_npu.npu_swiglu(x, dim=0)
        torch_npu.npu_geglu(x, approximate=0)
        torch_npu.npu_gelu_mul(x, approximate="tanh")
        torch_npu.npu_fast_gelu(x)
        torch_npu.fast_gelu(x)
        assert params(torch_npu.npu_geglu) == params(npu_geglu)
    assert emu.calls["npu_swiglu"] == 2
    for name in ("npu_geglu", "npu_gelu_mul", "npu_fast_gelu", "fast_gelu"):
        assert emu.calls[name] == 1
    assert emulate.REGISTRY["npu_swiglu"].summary.startswith("SwiGLU")
    assert emulate.REGISTRY["npu_geglu"].autograd and not emulate.REGISTRY["npu_gelu_mul"].autograd
