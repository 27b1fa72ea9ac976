"""Emulated torch_npu.optim fused optimizers (spec §10): torch.optim math plus the fused constraints."""

import copy
import inspect
import math

import pytest
import torch
from torch.optim.optimizer import required

from npufuse import emulate
from npufuse.emulate.optim import NpuFusedAdam, NpuFusedAdamW, NpuFusedSGD

CASES = [
    (NpuFusedAdamW, torch.optim.AdamW, {}),
    (NpuFusedAdamW, torch.optim.AdamW, dict(lr=3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=True)),
    (NpuFusedAdam, torch.optim.Adam, {}),
    (NpuFusedAdam, torch.optim.Adam, dict(lr=2e-2, weight_decay=0.05, amsgrad=True)),
    (NpuFusedSGD, torch.optim.SGD, dict(lr=0.1)),
    (NpuFusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (NpuFusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.3)),
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_model(dtype=torch.float32):
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(dtype)


def train(model, opt, steps, zero=lambda o: o.zero_grad(set_to_none=False)):
    g = torch.Generator().manual_seed(1)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        zero(opt)
        x = torch.randn(9, 5, generator=g).to(dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("fused_cls,torch_cls,kwargs", CASES, ids=lambda v: getattr(v, "__name__", None) or str(v))
def test_steps_identical_to_torch_optim(fused_cls, torch_cls, kwargs):
    model = make_model()
    ref = copy.deepcopy(model)
    opt = fused_cls(model.parameters(), **kwargs)
    opt_ref = torch_cls(ref.parameters(), **kwargs)
    train(model, opt, 6, zero=lambda o: o.zero_grad())  # fused default: set_to_none=False
    train(ref, opt_ref, 6)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "fused_cls,torch_cls,kwargs",
    # eps=1e-8 underflows to 0 in fp16 (0/0 = NaN on both sides): use an fp16-sized eps
    [(NpuFusedAdamW, torch.optim.AdamW, dict(eps=1e-4)), (NpuFusedAdam, torch.optim.Adam, dict(eps=1e-4)), CASES[5]],
    ids=["adamw", "adam", "sgd"],
)
def test_fp16_params_supported(fused_cls, torch_cls, kwargs):
    model = make_model(torch.float16)
    ref = copy.deepcopy(model)
    train(model, fused_cls(model.parameters(), **kwargs), 3)
    train(ref, torch_cls(ref.parameters(), **kwargs), 3)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_param_groups_and_state_step_is_int():
    model = make_model()
    ref = copy.deepcopy(model)
    groups = lambda m: [{"params": m[0].parameters(), "lr": 0.05}, {"params": m[2].parameters(), "weight_decay": 0.0}]
    opt = NpuFusedAdamW(groups(model), lr=1e-2)
    train(model, opt, 3)
    train(ref, torch.optim.AdamW(groups(ref), lr=1e-2), 3)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    steps = [opt.state[p]["step"] for p in model.parameters()]
    assert steps == [3] * 4 and all(type(s) is int for s in steps)
    assert opt.state_dict()["state"][0]["step"] == 3


def test_state_dict_round_trip_continues_identically():
    model, ref = make_model(), make_model()
    ref.load_state_dict(model.state_dict())
    opt = NpuFusedAdam(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    train(model, opt, 2)
    train(ref, opt_ref, 2)
    opt2 = NpuFusedAdam(model.parameters(), lr=1e-2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(model, opt2, 2)
    train(ref, opt_ref, 2)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert opt2.state[next(model.parameters())]["step"] == 4


def test_signatures_and_defaults_match_spec():
    def sig(cls):
        return [(p.name, p.default) for p in inspect.signature(cls.__init__).parameters.values()][1:]

    E = inspect.Parameter.empty
    assert sig(NpuFusedAdamW) == [
        ("params", E), ("lr", 1e-3), ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 1e-2), ("amsgrad", False)
    ]
    assert sig(NpuFusedAdam) == [
        ("params", E), ("lr", 1e-3), ("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0), ("amsgrad", False)
    ]
    assert sig(NpuFusedSGD) == [
        ("params", E), ("lr", required), ("momentum", 0.0), ("dampening", 0.0), ("weight_decay", 0.0), ("nesterov", False)
    ]
    opt = NpuFusedAdamW(make_model().parameters())
    assert opt.param_groups[0]["weight_decay"] == 1e-2 and opt.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize("cls", [NpuFusedAdamW, NpuFusedAdam, NpuFusedSGD])
@pytest.mark.parametrize("kw", ["foreach", "fused", "capturable", "maximize", "differentiable"])
def test_torch_only_kwargs_rejected(cls, kw):
    with pytest.raises(TypeError, match=kw):
        cls(make_model().parameters(), lr=0.1, **{kw: False})


@pytest.mark.parametrize("cls", [NpuFusedAdamW, NpuFusedAdam, NpuFusedSGD])
def test_bf16_params_rejected_at_the_first_step_with_a_grad(cls):
    # _maybe_init_combined_params_and_grads checks the dtype of params that have a grad only
    model = make_model(torch.bfloat16)
    opt = cls(model.parameters(), lr=0.1)  # construction checks nothing
    model(torch.randn(2, 5, dtype=torch.bfloat16)).sum().backward()
    with pytest.raises(TypeError, match=f"{cls.__name__}: params must be float32 or float16.*bfloat16"):
        opt.step()


def test_params_without_grad_are_never_dtype_checked():
    model = make_model()
    frozen = torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16), requires_grad=False)
    opt = NpuFusedAdamW([*model.parameters(), frozen])
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2, dtype=torch.float64))]})  # never gets a grad
    train(model, opt, 2)
    assert len(opt.param_groups) == 2


def test_bf16_grad_refused_at_first_step_too():
    p = torch.nn.Parameter(torch.randn(4))
    opt = NpuFusedSGD([p], lr=0.1)
    p.data = p.data.bfloat16()  # dtype changed after construction
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="NpuFusedSGD: params must be float32 or float16"):
        opt.step()


def test_noncontiguous_param_rejected():
    p = torch.nn.Parameter(torch.randn(4, 6).t())
    opt = NpuFusedAdam([p])
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="NpuFusedAdam: params must be contiguous"):
        opt.step()


@pytest.mark.parametrize("cls", [NpuFusedAdamW, NpuFusedAdam, NpuFusedSGD])
def test_zero_grad_set_to_none_rejected(cls):
    opt = cls(make_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match=f"{cls.__name__}: set_to_none"):
        opt.zero_grad(set_to_none=True)
    assert inspect.signature(cls.zero_grad).parameters["set_to_none"].default is False


def test_zero_grad_keeps_grad_tensors_in_place():
    model = make_model()
    opt = NpuFusedAdamW(model.parameters())
    train(model, opt, 1)
    grads = [p.grad for p in model.parameters()]
    opt.zero_grad()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(not g.any() for g in grads)


@pytest.mark.parametrize("cls", [NpuFusedAdamW, NpuFusedAdam, NpuFusedSGD])
def test_sparse_grads_rejected(cls):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = cls(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2, 3])).sum().backward()
    with pytest.raises(TypeError, match=f"{cls.__name__}: sparse gradients"):
        opt.step()


def test_sgd_lr_is_required():
    with pytest.raises(ValueError, match="NpuFusedSGD: lr is required"):
        NpuFusedSGD(make_model().parameters())
    model = make_model()
    opt = NpuFusedSGD([{"params": model.parameters(), "lr": 0.1}])
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))]})
    with pytest.raises(ValueError, match="Nesterov"):
        NpuFusedSGD(model.parameters(), lr=0.1, nesterov=True)


def test_params_without_grad_at_first_step_are_excluded_permanently():
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    opt = NpuFusedSGD([a, b], lr=0.1)
    a.grad = torch.ones(3)
    opt.step()  # combines only `a`
    b_before = b.detach().clone()
    b.grad = torch.ones(3)
    opt.step()
    assert torch.equal(b, b_before)  # silently never updated, as on NPU
    assert b.grad is not None and b.grad.eq(1).all()  # its grad is left alone


def test_reallocated_grad_or_moved_param_raises():
    model = make_model()
    opt = NpuFusedAdamW(model.parameters())
    train(model, opt, 1)
    w = model[0].weight
    w.grad = torch.zeros_like(w)
    with pytest.raises(RuntimeError, match="NpuFusedAdamW: the grad .* re-allocated"):
        opt.step()
    model = make_model()
    opt = NpuFusedAdamW(model.parameters())
    train(model, opt, 1)
    model[0].weight.data = model[0].weight.data.clone()
    with pytest.raises(RuntimeError, match="moved"):
        opt.zero_grad()


@pytest.mark.parametrize("norm_type", [2, 1, math.inf])
def test_clip_grad_norm_fused_matches_torch(norm_type):
    model = make_model()
    ref = copy.deepcopy(model)
    opt = NpuFusedAdamW(model.parameters())
    x = torch.randn(9, 5)
    for m in (model, ref):
        m(x).pow(2).sum().mul(10).backward()
    total = opt.clip_grad_norm_fused_(0.5, norm_type)
    total_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type)
    assert total.dtype == torch.float32 and total.dim() == 0
    torch.testing.assert_close(total, total_ref, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_clip_grad_norm_fused_no_clip_and_no_grads():
    model = make_model()
    opt = NpuFusedSGD(model.parameters(), lr=0.1)
    assert opt.clip_grad_norm_fused_(1.0).item() == 0.0  # nothing has a grad yet
    model(torch.randn(2, 5)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.cat([g.reshape(-1) for g in grads]).norm()
    torch.testing.assert_close(opt.clip_grad_norm_fused_(1e6), expected)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_step_closure_and_hooks_run_once():
    model = make_model()
    opt = NpuFusedAdam(model.parameters())
    torch.optim.Adam(make_model().parameters())  # wraps torch.optim.Adam.step with the hook runner
    seen = []
    opt.register_step_pre_hook(lambda *a: seen.append("pre"))
    opt.register_step_post_hook(lambda *a: seen.append("post"))

    def closure():
        # NpuFusedOptimizerBase.step is @torch.no_grad() and calls the closure directly
        assert not torch.is_grad_enabled()
        opt.zero_grad()
        with torch.enable_grad():
            loss = model(torch.randn(3, 5)).sum()
            loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and seen == ["pre", "post"]


def test_closure_without_enable_grad_fails_as_on_npu():
    model = make_model()
    opt = NpuFusedAdamW(model.parameters())

    def closure():
        loss = model(torch.randn(3, 5)).sum()
        loss.backward()  # under the step's no_grad: nothing requires grad
        return loss

    with pytest.raises(RuntimeError, match="does not require grad"):
        opt.step(closure)


def test_record_call_through_install():
    model = make_model()
    with emulate.install() as emu:
        import torch_npu

        assert torch_npu.optim.NpuFusedAdamW is NpuFusedAdamW
        opt = torch_npu.optim.NpuFusedAdamW(model.parameters(), lr=1e-2)
        train(model, opt, 3)
        torch_npu.optim.NpuFusedSGD(model.parameters(), lr=0.1).step()
        torch_npu.optim.NpuFusedAdam(model.parameters())
    assert emu.calls["optim.NpuFusedAdamW"] == 4  # construction + 3 steps
    assert emu.calls["optim.NpuFusedSGD"] == 2
    assert emu.calls["optim.NpuFusedAdam"] == 1
    assert emulate.REGISTRY["optim.NpuFusedAdamW"].spec == "10"
    assert "AdamW" in emulate.REGISTRY["optim.NpuFusedAdamW"].summary


def test_deepcopy_of_optimizer_keeps_working():
    model = make_model()
    opt = NpuFusedAdamW(model.parameters())
    train(model, opt, 1)
    clone = copy.deepcopy({"m": model, "o": opt})
    train(clone["m"], clone["o"], 2)
    assert clone["o"].state[clone["m"][0].weight]["step"] == 3


@pytest.mark.parametrize("fused_name, torch_cls, kwargs", [
    ("NpuFusedAdadelta", torch.optim.Adadelta, {"lr": 0.5, "rho": 0.8, "weight_decay": 0.01}),
    ("NpuFusedRMSprop", torch.optim.RMSprop, {"lr": 1e-2, "alpha": 0.9, "momentum": 0.5, "centered": True}),
])
def test_adadelta_and_rmsprop_step_as_torch_optim(fused_name, torch_cls, kwargs):
    """No upstream test covers these two (docs only): the math must be torch.optim's, a param
    without a grad is left alone, and five steps agree to fp32 rounding."""
    from npufuse.emulate import optim as emu_optim

    gen = torch.Generator().manual_seed(0)
    ref = [torch.randn(4, 3, generator=gen, requires_grad=True), torch.randn(5, generator=gen, requires_grad=True)]
    mine = [p.detach().clone().requires_grad_(True) for p in ref]
    frozen = torch.randn(2, requires_grad=True)
    before = frozen.detach().clone()
    a = torch_cls(ref, **kwargs)
    b = getattr(emu_optim, fused_name)([*mine, frozen], **kwargs)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in ref]
        for p, q, g in zip(ref, mine, grads):
            p.grad = g.clone()
            if q.grad is None:
                q.grad = g.clone()
            else:
                q.grad.copy_(g)   # the fused optimizers read their combined grad buffer: grads stay in place
        a.step()
        b.step()
    for p, q in zip(ref, mine):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    assert torch.equal(frozen.detach(), before)
