"""s42 non-LLM recall sweep b (sweep42b, bench/detect_labels_sweep42b.json): the classes behind its wrong candidates
and false near-miss reasons.

G1 swiglu (DiG's adaLN block ``x + gate_msa * self.attn(modulate(norm1(x), ...))`` where ``self.attn`` is set by a
   GLA base class in another file): an inherited attribute was taken for an activation the config picks, and the
   adaLN gate times the attention output became a swiglu/geglu candidate (dispatched on the object at run time). An
   inherited attribute whose name says it is a layer (attn, mlp, conv, proj, norm...) is that layer, never an
   activation; ``act_fn`` / ``act_layer`` still are.
R1 swiglu / geglu near-miss wording (audit41 / audit42 notes: HorNet's ``gamma1 * self.gnconv(...)``, seamless'
   ``char_embeds *= self.scale``): a layer scale (an ``nn.Parameter``, maybe viewed to broadcast) or a constant scale
   was called "a gated output". The reason now says what the factor is; a true gated output keeps its reason.
"""

from __future__ import annotations

from npufuse.patterns.base import Pattern
from npufuse.patterns.fused_optimizer import FusedOptimizer
from npufuse.patterns.swiglu import Swiglu, _names_a_layer
from pattern_harness import detect_all

# -- G1: an inherited layer attribute is no activation

_ADALN_INHERITED_ATTN = '''
import torch
from torch import nn
from module_dig import GLABlock


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiGBlock(GLABlock):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.norm1 = nn.LayerNorm(config.hidden_size, elementwise_affine=False, eps=1e-6)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(config.hidden_size, 6 * config.hidden_size))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x
'''

# the same base-class shape where the inherited callable IS the configured activation (megablocks' SharedGLU)
_INHERITED_ACT_FN = '''
import torch
from torch import nn
from base_mlp import BaseMLP


class GatedMLP(BaseMLP):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
'''


def test_an_inherited_attention_times_an_adaln_gate_is_not_a_glu() -> None:
    findings, _ = detect_all(Swiglu(), _ADALN_INHERITED_ATTN)
    assert not findings


def test_an_inherited_activation_attribute_is_still_a_glu() -> None:
    findings, _ = detect_all(Swiglu(), _INHERITED_ACT_FN)
    assert len(findings) == 1


def test_layer_names_and_activation_names() -> None:
    assert all(_names_a_layer(n) for n in ("attn", "self_attn", "mlp", "dw_conv", "out_proj", "norm2", "blocks", "fc1"))
    assert not any(_names_a_layer(n) for n in ("act", "act_fn", "act_layer", "activation", "gate_fn", "nonlinearity"))


# -- R1: a layer scale / constant scale is not a gated output

_LAYER_SCALE_BRANCH = '''
import torch
from torch import nn


class gnconv(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj_in = nn.Conv2d(dim, 2 * dim, 1)
        self.proj_out = nn.Conv2d(dim, dim, 1)

    def forward(self, x):
        a, b = self.proj_in(x).chunk(2, dim=1)
        return self.proj_out(a * b)


class Block(nn.Module):
    def __init__(self, dim, layer_scale_init_value=1e-6, gnconv=gnconv):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.gnconv = gnconv(dim)
        self.gamma1 = nn.Parameter(layer_scale_init_value * torch.ones(dim)) if layer_scale_init_value > 0 else None
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, C, H, W = x.shape
        if self.gamma1 is not None:
            gamma1 = self.gamma1.view(C, 1, 1)
        else:
            gamma1 = 1
        x = x + gamma1 * self.gnconv(self.norm1(x))
        return x + self.pwconv2(self.act(self.pwconv1(x.permute(0, 2, 3, 1)))).permute(0, 3, 1, 2)
'''

# the same block with a fixed residual scale (an init-time number) in place of the learned one
_CONSTANT_SCALE = (_LAYER_SCALE_BRANCH
                   .replace("        self.gamma1 = nn.Parameter(", "        self.alpha = dim ** -0.5\n        self.gamma1 = nn.Parameter(")
                   .replace("x = x + gamma1 * self.gnconv(", "x = x + self.alpha * self.gnconv("))

# near miss that keeps the gated-output reason: Mamba's y * silu(z), z a projection and y the scan's output
_GATED_OUTPUT = '''
import torch
import torch.nn.functional as F
from torch import nn


class MambaOut(nn.Module):
    def __init__(self, d, inner):
        super().__init__()
        self.in_proj = nn.Linear(d, inner)
        self.z_proj = nn.Linear(d, inner)
        self.out_proj = nn.Linear(inner, d)

    def forward(self, x, scan):
        y = scan(self.in_proj(x))
        z = self.z_proj(x)
        return self.out_proj(y * F.silu(z))
'''


def _near_miss_reasons(pattern: Pattern, code: str) -> list[str]:
    """The near-miss reasons of ``pattern`` on ``code``, which must give no candidate."""
    findings, misses = detect_all(pattern, code)
    assert not findings
    return [m.reason for m in misses]


def _swiglu_reasons(code: str) -> list[str]:
    return _near_miss_reasons(Swiglu(), code)


def test_a_layer_scale_is_called_a_layer_scale() -> None:
    reasons = _swiglu_reasons(_LAYER_SCALE_BRANCH)
    assert reasons and all("learned scale" in r and "layer scale" in r and "gated output" not in r for r in reasons)


def test_a_constant_scale_is_called_a_constant_scale() -> None:
    assert "x = x + self.alpha * self.gnconv(" in _CONSTANT_SCALE
    reasons = _swiglu_reasons(_CONSTANT_SCALE)
    assert reasons and all("constant scale" in r and "gated output" not in r for r in reasons)


def test_a_gated_output_keeps_its_reason() -> None:
    reasons = _swiglu_reasons(_GATED_OUTPUT)
    assert reasons and not any("scale" in r for r in reasons)


# -- G2: grad statistics gathered only for a log (diffusion-forcing's Lightning template)

_LOGGED_GRAD_STATS = '''
import torch


class Algo:
    def log_gradient_stats(self):
        with torch.no_grad():
            grad_norms = []
            gpr = []
            for param in self.parameters():
                if param.grad is not None:
                    grad_norms.append(torch.norm(param.grad).item())
                    gpr.append(torch.norm(param.grad) / torch.norm(param))
            if len(grad_norms) == 0:
                return
            grad_norms = torch.tensor(grad_norms)
            gpr = torch.tensor(gpr)
            self.log_dict({"train/grad_norm/min": grad_norms.min(), "train/grad_norm/mean": grad_norms.mean(),
                           "train/gpr/max": gpr.max()})
'''

# near miss: the same statistics steer the training (the smallest norm picks a learning rate)
_STEERING_GRAD_STATS = _LOGGED_GRAD_STATS.replace(
    '            self.log_dict({"train/grad_norm/min": grad_norms.min(), "train/grad_norm/mean": grad_norms.mean(),\n'
    '                           "train/gpr/max": gpr.max()})\n',
    '            self.log_dict({"train/gpr/max": gpr.max()})\n'
    '            self.lr = 1e-3 if grad_norms.min() > 1e-6 else 1e-4\n')


def test_grad_statistics_gathered_for_a_log_are_no_grad_none_read() -> None:
    import ast as _ast

    from npufuse.scan import grad_none

    assert grad_none.reads(_LOGGED_GRAD_STATS, _ast.parse(_LOGGED_GRAD_STATS)) == []
    assert "self.lr = 1e-3 if grad_norms.min()" in _STEERING_GRAD_STATS
    steering = grad_none.reads(_STEERING_GRAD_STATS, _ast.parse(_STEERING_GRAD_STATS))
    assert [t for _, t in steering] == ["param.grad is not None"]


# -- R2: `self.mp_trainer.zero_grad()` of a plain project class is not nn.Module.zero_grad (MDT / guided-diffusion)

_OWN_ZERO_GRAD = '''
import torch
from torch.optim import AdamW


def zero_grad(model_params):
    for param in model_params:
        if param.grad is not None:
            param.grad.detach_()
            param.grad.zero_()


class MixedPrecisionTrainer:
    def __init__(self, *, model):
        self.model = model
        self.model_params = list(self.model.parameters())
        self.master_params = self.model_params

    def zero_grad(self):
        zero_grad(self.model_params)


class TrainLoop:
    def __init__(self, model, lr):
        self.model = model
        self.mp_trainer = MixedPrecisionTrainer(model=self.model)
        self.opt = AdamW(self.mp_trainer.master_params, lr=lr)

    def run_step(self, batch):
        self.mp_trainer.zero_grad()
        loss = self.model(batch).mean()
        loss.backward()
        self.opt.step()
'''

# near miss that keeps nn.Module's reason: the receiver is a module (its zero_grad frees the grads on torch >= 2.0)
_MODULE_ZERO_GRAD = _OWN_ZERO_GRAD.replace("class MixedPrecisionTrainer:", "class MixedPrecisionTrainer(torch.nn.Module):").replace(
    "    def zero_grad(self):\n        zero_grad(self.model_params)\n", "    def forward(self, x):\n        return self.model(x)\n")


def _optimizer_reasons(code: str) -> list[str]:
    return _near_miss_reasons(FusedOptimizer(), code)


def test_a_plain_project_class_zero_grad_is_named_not_called_module_zero_grad() -> None:
    reasons = _optimizer_reasons(_OWN_ZERO_GRAD)
    assert len(reasons) == 1
    assert "`MixedPrecisionTrainer.zero_grad`" in reasons[0] and "defaults to set_to_none=True" not in reasons[0]


def test_a_module_receiver_keeps_the_module_zero_grad_reason() -> None:
    assert "torch.nn.Module" in _MODULE_ZERO_GRAD and "def forward(self, x)" in _MODULE_ZERO_GRAD
    reasons = _optimizer_reasons(_MODULE_ZERO_GRAD)
    assert len(reasons) == 1 and "nn.Module.zero_grad defaults to set_to_none=True" in reasons[0]
