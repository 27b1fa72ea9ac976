"""npu_rotary_mul / npu_apply_rotary_pos_emb against formulas written here from spec §4."""

from __future__ import annotations

import inspect

import pytest
import torch

from npufuse import emulate
from npufuse.emulate.rope import npu_apply_rotary_pos_emb, npu_rotary_mul

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# ---- independent references ------------------------------------------------------------------


def ref_rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def ref_half(x, cos, sin):
    """HF LLaMA: q*cos + rotate_half(q)*sin (cos/sin = cat(freqs, freqs))."""
    return x * cos + ref_rotate_half(x) * sin


def ref_interleave_complex(x, cos_half, sin_half):
    """Meta LLaMA complex form: pairs (x[2k], x[2k+1]) as complex numbers times (cos_k + i sin_k)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * torch.complex(cos_half, sin_half)).flatten(-2)


# ---- npu_rotary_mul ---------------------------------------------------------------------------

# (x shape, r shape) for each accepted half-mode broadcast; odd sizes on purpose.
HALF_CASES = [
    ((2, 3, 5, 8), (1, 1, 5, 8)),  # BNSD, 11SD
    ((2, 3, 5, 8), (2, 1, 5, 8)),  # BNSD, B1SD
    ((2, 3, 5, 8), (2, 3, 5, 8)),  # BNSD, BNSD
    ((3, 7, 2, 10), (1, 7, 1, 10)),  # BSND, 1S1D
    ((3, 7, 2, 10), (3, 7, 1, 10)),  # BSND, BS1D
    ((7, 3, 2, 6), (7, 1, 1, 6)),  # SBND, S11D
    ((1, 1, 1, 128), (1, 1, 1, 128)),  # decode step, D=128
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xs,rs", HALF_CASES)
def test_rotary_mul_half_matches_hf(dtype, xs, rs):
    x = torch.randn(xs).to(dtype)
    theta = torch.rand(*rs[:-1], rs[-1] // 2) * 6.0
    emb = torch.cat((theta, theta), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    out = npu_rotary_mul(x, cos, sin)
    assert out.shape == x.shape and out.dtype == dtype
    close(out, ref_half(x.float(), cos.float(), sin.float()).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xs,rs", [((2, 3, 5, 8), (1, 1, 5, 8)), ((3, 7, 2, 12), (1, 7, 1, 12)), ((5, 2, 3, 4), (5, 1, 1, 4))])
def test_rotary_mul_interleave_matches_complex_form(dtype, xs, rs):
    x = torch.randn(xs).to(dtype)
    theta = torch.rand(*rs[:-1], rs[-1] // 2) * 6.0
    emb = theta.repeat_interleave(2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    out = npu_rotary_mul(x, cos, sin, "interleave")
    expected = ref_interleave_complex(x, cos.float()[..., ::2], sin.float()[..., ::2])
    close(out, expected.to(dtype), dtype)


def test_rotary_mul_casts_cos_sin_to_x_dtype_first():
    x = torch.randn(2, 3, 4, 8).to(torch.bfloat16)
    emb = torch.rand(1, 1, 4, 8) * 3
    cos, sin = emb.cos(), emb.sin()  # float32 while x is bf16
    out = npu_rotary_mul(x, cos, sin)
    c, s = cos.to(torch.bfloat16).float(), sin.to(torch.bfloat16).float()
    torch.testing.assert_close(out, ref_half(x.float(), c, s).to(torch.bfloat16), atol=0, rtol=0)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("xs,rs", [((2, 3, 5, 8), (2, 1, 5, 8)), ((3, 7, 2, 10), (1, 7, 1, 10))])
def test_rotary_mul_backward_matches_autograd_of_formula(xs, rs):
    x = torch.randn(xs, dtype=torch.float64).float().requires_grad_()
    cos = torch.randn(rs).requires_grad_()
    sin = torch.randn(rs).requires_grad_()
    g = torch.randn(xs)
    npu_rotary_mul(x, cos, sin).backward(g)
    got = [t.grad.clone() for t in (x, cos, sin)]
    for t in (x, cos, sin):
        t.grad = None
    ref_half(x, cos, sin).backward(g)
    for a, b in zip(got, (x.grad, cos.grad, sin.grad)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert got[1].shape == cos.shape


def test_rotary_mul_interleave_backward_reaches_x():
    x = torch.randn(2, 3, 5, 8, requires_grad=True)
    emb = (torch.rand(1, 1, 5, 4) * 3).repeat_interleave(2, -1)
    out = npu_rotary_mul(x, emb.cos(), emb.sin(), "interleave")
    out.sum().backward()
    # d/dx of x*c + rot(x)*s summed: c + rot^T(s); rot^T maps s -> out[2k]=s[2k+1], out[2k+1]=-s[2k]
    c, s = emb.cos(), emb.sin()
    rt = torch.stack((s[..., 1::2], -s[..., ::2]), dim=-1).flatten(-2)
    torch.testing.assert_close(x.grad, (c + rt).expand_as(x), atol=1e-6, rtol=1e-6)


def test_rotary_mul_rotate_matrix_half_and_interleave():
    n = 8
    x = torch.randn(2, 2, 5, n)
    emb = torch.rand(1, 1, 5, n)
    cos, sin = emb.cos(), emb.sin()
    half = n // 2
    r_half = torch.zeros(n, n)
    r_half[:half, half:] = torch.eye(half)
    r_half[half:, :half] = -torch.eye(half)
    torch.testing.assert_close(npu_rotary_mul(x, cos, sin, "half", r_half), ref_half(x, cos, sin))
    # a rotate matrix with the sign flip reproduces rotate_interleave
    r_int = torch.zeros(n, n)
    for i in range(0, n, 2):
        r_int[i + 1, i] = -1
        r_int[i, i + 1] = 1
    expected = x * cos + torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2) * sin
    torch.testing.assert_close(npu_rotary_mul(x, cos, sin, "interleave", r_int), expected)
    # the doc's example matrix (pure swap) is applied literally, not "fixed"
    r_doc = torch.zeros(n, n)
    for i in range(0, n, 2):
        r_doc[i, i + 1] = 1
        r_doc[i + 1, i] = 1
    swapped = torch.stack((x[..., 1::2], x[..., ::2]), -1).flatten(-2)
    torch.testing.assert_close(npu_rotary_mul(x, cos, sin, "interleave", r_doc), x * cos + swapped * sin)


def test_rotary_mul_with_rotate_backward_is_rotary_modes():
    # derivatives.yaml: npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode) never sees rotate,
    # so with rotate=I the forward uses x @ I but the gradient is rotate_half's; rotate gets none
    x = torch.randn(1, 1, 3, 4, requires_grad=True)
    cos = torch.randn(1, 1, 3, 4, requires_grad=True)
    sin = torch.randn(1, 1, 3, 4, requires_grad=True)
    r = torch.eye(4, requires_grad=True)
    out = npu_rotary_mul(x, cos, sin, "half", r)
    torch.testing.assert_close(out, (x * cos + x * sin).detach())
    g = torch.randn(out.shape)
    out.backward(g)
    x2, cos2, sin2 = (t.detach().clone().requires_grad_() for t in (x, cos, sin))
    x1h, x2h = x2.chunk(2, -1)
    (x2 * cos2 + torch.cat((-x2h, x1h), -1) * sin2).backward(g)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(cos.grad, cos2.grad)
    torch.testing.assert_close(sin.grad, sin2.grad)
    assert r.grad is None


@pytest.mark.parametrize(
    "kwargs,exc,arg",
    [
        (dict(x=(2, 5, 8), r=(1, 5, 8)), ValueError, "input"),  # 3-D rejected (4-D only)
        (dict(x=(2, 3, 5, 7), r=(1, 1, 5, 7)), ValueError, "input"),  # odd D
        (dict(x=(1, 1, 2, 896), r=(1, 1, 2, 896)), ValueError, "input"),  # D >= 896
        (dict(x=(2, 3, 5, 8), r=(1, 1, 5, 4)), ValueError, "r1"),  # partial rotary cos
        (dict(x=(2, 3, 5, 8), r=(1, 3, 5, 8)), ValueError, "r1"),  # 1NSD not allowed
        (dict(x=(2, 3, 5, 8), r=(1, 1, 1, 8)), ValueError, "r1"),  # 111D for S=5 not allowed
        (dict(x=(2, 3, 5, 8), r=(2, 1, 5, 8), mode="interleave"), ValueError, "r1"),  # per-batch cos
        (dict(x=(2, 3, 5, 8), r=(1, 1, 5, 8), mode="quarter"), ValueError, "rotary_mode"),
        (dict(x=(2, 3, 5, 8), r=(1, 1, 5, 8), mode="Half"), ValueError, "rotary_mode"),
        (dict(x=(1000, 1, 2, 4), r=(1, 1, 2, 4)), ValueError, "input"),  # B >= 1000 (BNSD only)
        (dict(x=(40, 30, 2, 4), r=(1, 1, 2, 4), mode="interleave"), ValueError, "input"),  # B*N >= 1000
    ],
)
def test_rotary_mul_rejects(kwargs, exc, arg):
    x = torch.randn(kwargs["x"])
    r = torch.randn(kwargs["r"])
    with pytest.raises(exc, match=f"npu_rotary_mul: {arg}"):
        npu_rotary_mul(x, r, r.clone(), kwargs.get("mode", "half"))


def test_rotary_mul_rejects_dtype_shape_and_grad_limits():
    x = torch.randn(2, 3, 5, 8)
    r = torch.randn(1, 1, 5, 8)
    with pytest.raises(TypeError, match="npu_rotary_mul: input"):
        npu_rotary_mul(x.double(), r, r)
    with pytest.raises(TypeError, match="npu_rotary_mul: r1"):
        npu_rotary_mul(x, r.to(torch.int32), r)
    with pytest.raises(ValueError, match="npu_rotary_mul: r2"):
        npu_rotary_mul(x, r, torch.randn(2, 1, 5, 8))
    with pytest.raises(ValueError, match="npu_rotary_mul: rotate"):
        npu_rotary_mul(x, r, r, "half", torch.eye(4))
    # B*N <= 1024 when cos/sin need grads (half): 2*600 = 1200
    big = torch.randn(2, 600, 3, 2)  # only BNSD fits a B1SD cos, so B=2, N=600
    cos = torch.randn(2, 1, 3, 2, requires_grad=True)
    npu_rotary_mul(big, cos.detach(), cos.detach())  # fine without grads
    with pytest.raises(ValueError, match="npu_rotary_mul: input .*B\\*N <= 1024"):
        npu_rotary_mul(big, cos, cos.detach())


# ---- npu_apply_rotary_pos_emb -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
def test_apply_rotary_pos_emb_bsnd_in_place(dtype, d):
    b, s, nq, nk = 2, 3, 5, 1  # GQA: key has fewer heads
    q = torch.randn(b, s, nq, d).to(dtype)
    k = torch.randn(b, s, nk, d).to(dtype)
    theta = torch.rand(b, s, 1, d // 2) * 6
    emb = torch.cat((theta, theta), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = npu_apply_rotary_pos_emb(q, k, cos, sin, layout="BSND", rotary_mode="half")
    assert q_out is q and k_out is k
    close(q, ref_half(q0.float(), cos.float(), sin.float()).to(dtype), dtype)
    close(k, ref_half(k0.float(), cos.float(), sin.float()).to(dtype), dtype)
    assert q.dtype == dtype and q.shape == q0.shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rotary_pos_emb_tnd(dtype):
    t, d = 7, 64
    q = torch.randn(t, 4, d).to(dtype)
    k = torch.randn(t, 2, d).to(dtype)
    emb = (torch.rand(t, 1, d // 2) * 6).repeat(1, 1, 2)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q0, k0 = q.clone(), k.clone()
    out = npu_apply_rotary_pos_emb(q, k, cos, sin, layout="TND")
    assert isinstance(out, tuple) and out[0] is q and out[1] is k
    close(q, ref_half(q0.float(), cos.float(), sin.float()).to(dtype), dtype)
    close(k, ref_half(k0.float(), cos.float(), sin.float()).to(dtype), dtype)


def test_apply_rotary_pos_emb_unknown_layout_means_bsnd():
    q = torch.randn(1, 3, 2, 64)
    k = torch.randn(1, 3, 2, 64)
    cos, sin = torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64)
    expected = ref_half(q, cos, sin)
    npu_apply_rotary_pos_emb(q, k, cos, sin, layout="whatever")
    torch.testing.assert_close(q, expected)


@pytest.mark.parametrize(
    "change,exc,arg",
    [
        (dict(layout="BNSD"), ValueError, "layout"),
        (dict(layout="SBND"), ValueError, "layout"),
        (dict(rotary_mode="interleave"), ValueError, "rotary_mode"),
        (dict(d=32), ValueError, "query"),
        (dict(cos_dtype=torch.float16), TypeError, "cos"),
        (dict(cos_shape=(2, 3, 2, 64)), ValueError, "cos"),
        (dict(key_shape=(1, 3, 2, 64)), ValueError, "key"),
        (dict(layout="TND"), ValueError, "query"),  # 4-D tensors with TND
    ],
)
def test_apply_rotary_pos_emb_rejects(change, exc, arg):
    d = change.get("d", 64)
    q = torch.randn(2, 3, 4, d)
    k = torch.randn(*change.get("key_shape", (2, 3, 2, d)))
    cos = torch.randn(*change.get("cos_shape", (2, 3, 1, d))).to(change.get("cos_dtype", torch.float32))
    sin = torch.randn(2, 3, 1, d)
    with pytest.raises(exc, match=f"npu_apply_rotary_pos_emb: {arg}"):
        npu_apply_rotary_pos_emb(
            q, k, cos, sin, layout=change.get("layout", "BSND"), rotary_mode=change.get("rotary_mode", "half")
        )


def test_apply_rotary_pos_emb_is_forward_only():
    base = torch.randn(1, 2, 2, 64, requires_grad=True)
    q = base * 1.0  # non-leaf that requires grad
    k = torch.randn(1, 2, 2, 64)
    cos, sin = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    q_out, k_out = npu_apply_rotary_pos_emb(q, k, cos, sin)
    assert q_out is q
    with pytest.raises(RuntimeError, match="not implemented"):
        q_out.sum().backward()
    # cos requiring grad also leads to a raising backward
    cos_g = cos.clone().requires_grad_()
    q2, _ = npu_apply_rotary_pos_emb(torch.randn(1, 2, 2, 64), torch.randn(1, 2, 2, 64), cos_g, sin)
    with pytest.raises(RuntimeError, match="not implemented"):
        q2.sum().backward()
    # a leaf that requires grad cannot be overwritten in place
    with pytest.raises(RuntimeError, match="npu_apply_rotary_pos_emb: query"):
        npu_apply_rotary_pos_emb(torch.randn(1, 2, 2, 64, requires_grad=True), k, cos, sin)


# ---- signatures and the stand-in module -------------------------------------------------------


def test_signatures_match_schema():
    p = inspect.signature(npu_rotary_mul).parameters
    assert list(p) == ["input", "r1", "r2", "rotary_mode", "rotate"]
    assert p["rotary_mode"].default == "half" and p["rotate"].default is None
    p = inspect.signature(npu_apply_rotary_pos_emb).parameters
    assert list(p) == ["query", "key", "cos", "sin", "layout", "rotary_mode"]
    assert p["layout"].default == "BSND" and p["rotary_mode"].default == "half"


def test_calls_counted_through_install():
    x = torch.randn(1, 2, 3, 64)
    r = torch.randn(1, 1, 3, 64)
    with emulate.install() as emu:
        import torch_npu

        torch_npu.npu_rotary_mul(x, r, r)
        torch_npu.npu_apply_rotary_pos_emb(torch.randn(1, 3, 2, 64), torch.randn(1, 3, 2, 64), torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64))
        assert emu.calls["npu_rotary_mul"] == 1
        assert emu.calls["npu_apply_rotary_pos_emb"] == 1
