"""s47 recall sweep (helper sweep47a): the classes behind the misses on bench/detect_labels_sweep47a.json, seven
repositories labelled before npufuse was run on them (development data).

A rope: the halves of x upcast to fp32 before a written-out rotation (nanogpt-to-chat's ``rope_apply``:
   ``x1 = x[..., :half]; x2 = x[..., half:]; x1 = x1.float(); x2 = x2.float()``, then
   ``cat([x1*cos - x2*sin, x1*sin + x2*cos]).type_as(x)`` with half-width tables sliced at a KV-cache offset; the
   inline spelling ``x1 = x[..., :half].float()``). The fused call rotates ``x.float()`` (every half read in fp32),
   or x promoted with fp32 where a half is also read uncast. Near miss: halves cast to bf16 first.
   The same halves written inline in the cat, ``x1, x2 = x[..., :half].float(), x[..., half:].float()`` then
   ``cat([x1*cos - x2*sin, x1*sin + x2*cos], -1).to(x.dtype)`` (a draft head's rope, kernel reference ropes), or
   ``x[..., :half].float() * cos - ...`` with no names at all, are read the same way.

B add_rms_norm: a norm helper whose flag parameter picks ``F.rms_norm`` or another norm (nanogpt-to-chat's
   ``def norm(x, use_rms=True): if use_rms: return F.rms_norm(x, (x.size(-1),)) else: return F.layer_norm(...)``,
   called as ``norm(x, use_rms=self.config.use_rmsnorm)`` on the residual sum; also spelt
   ``return F.rms_norm(...) if rms else F.layer_norm(...)``): fused where the flag passed is true, the original code
   elsewhere. Near misses: a constant flag choosing the other norm; a flag computed in the caller.

C fused_optimizer: an optimizer built in a function that only reads its ``param_groups`` (Ovis's ``train`` maps
   parameters to learning rates for a printout, then builds an HF Trainer without ``optimizers=``): nothing steps it,
   a near miss saying so. Candidates stay where the optimizer is also stepped, handed on or returned.
"""

from __future__ import annotations

import torch

from npufuse.patterns.add_rms_norm import AddRmsNorm
from npufuse.patterns.fused_optimizer import FusedOptimizer
from npufuse.patterns.moe_experts import MoeExperts
from npufuse.patterns.rope import RopePattern
from pattern_harness import check_rewrite_runs, detect_all, found_and_faithful

# -- A: halves upcast to fp32 before the rotation

_ROPE_APPLY = '''
import torch
import torch.nn as nn


def rope_cache(seq_len, head_dim, base=10000):
    half_dim = head_dim // 2
    freq_seq = torch.arange(half_dim, dtype=torch.float32)
    freq_seq = base ** (-freq_seq / half_dim)
    t = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(t, freq_seq)
    return freqs.cos()[None, None], freqs.sin()[None, None]


def rope_apply(x, cos, sin, offset=0):
    B, H, T, Hs = x.shape
    half = Hs // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    x1 = x1.float()
    x2 = x2.float()
    cos = cos[:, :, offset : offset + T, :]
    sin = sin[:, :, offset : offset + T, :]
    rotated_x1 = x1 * cos - x2 * sin
    rotated_x2 = x1 * sin + x2 * cos
    out = torch.cat([rotated_x1, rotated_x2], dim=-1)
    return out.type_as(x)


class Attn(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.c_q = nn.Linear(dim, dim, bias=False)
        self.c_k = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos_sin, past_len=0):
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = self.c_k(x).view(B, T, self.heads, C // self.heads).transpose(1, 2)
        cos, sin = cos_sin
        q = rope_apply(q, cos, sin, offset=past_len)
        k = rope_apply(k, cos, sin, offset=past_len)
        return q, k
'''


def _rope_run(dtype: str, past: int) -> str:
    return f'''
attn = Attn().to({dtype})
cos_sin = rope_cache(32, 16)
x = torch.randn(2, 5, 64, dtype={dtype}, requires_grad=True)
out = attn(x, cos_sin, past_len={past})
leaves = [x]
'''


_INLINE = '''
import torch


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1 = x[..., :half].float()
    x2 = x[..., half:].float()
    y1 = x1 * cos - x2 * sin
    y2 = x1 * sin + x2 * cos
    return torch.cat([y1, y2], dim=-1)
'''

_INLINE_RUN = '''
x = torch.randn(2, 3, 6, 16, dtype={dtype}, requires_grad=True)
ang = torch.randn(1, 1, 6, 8)
out = rotate(x, ang.cos(), ang.sin())
leaves = [x]
'''


def test_a_rope_with_halves_rebound_to_fp32_is_found_and_runs_fp32() -> None:
    findings = found_and_faithful(RopePattern(), _ROPE_APPLY, _rope_run("torch.float32", 3))
    assert [f.qualname for f in findings] == ["rope_apply"]
    assert "x.float()" in findings[0].fused


def test_a_rope_with_halves_rebound_to_fp32_keeps_the_dtype_in_bf16() -> None:
    findings, _ = detect_all(RopePattern(), _ROPE_APPLY)
    facts = check_rewrite_runs(RopePattern(), _ROPE_APPLY, _rope_run("torch.bfloat16", 0), findings)
    assert facts["calls"] >= 2
    assert all(a == b for a, b in facts["dtypes"]) and all(a == b for a, b in facts["shapes"])
    assert min(facts["cos_out"]) > 0.999 and min(facts["cos_grad"]) > 0.999


def test_a_inline_fp32_halves_give_the_eager_fp32_result_for_bf16_and_fp64_inputs() -> None:
    findings = found_and_faithful(RopePattern(), _INLINE, _INLINE_RUN.format(dtype="torch.float32"))
    assert [f.qualname for f in findings] == ["rotate"]
    for dtype in ("torch.bfloat16", "torch.float64"):
        facts = check_rewrite_runs(RopePattern(), _INLINE, _INLINE_RUN.format(dtype=dtype), findings)
        assert facts["calls"] >= 1
        # the eager products are fp32 whatever x's dtype (a float64 x is narrowed by the cast): so is the fused result
        assert facts["dtypes"] == [(torch.float32, torch.float32)]
        assert min(facts["cos_out"]) > 0.9999 and min(facts["cos_grad"]) > 0.999


def test_a_one_half_cast_and_one_read_plain_is_widened_with_x() -> None:
    code = _INLINE.replace("x2 = x[..., half:].float()", "x2 = x[..., half:]")
    findings = found_and_faithful(RopePattern(), code, _INLINE_RUN.format(dtype="torch.float32"))
    assert [f.qualname for f in findings] == ["rotate"]
    facts = check_rewrite_runs(RopePattern(), code, _INLINE_RUN.format(dtype="torch.float64"), findings)
    assert facts["calls"] >= 1 and facts["dtypes"] == [(torch.float64, torch.float64)]
    assert min(facts["cos_out"]) > 0.9999


def test_a_halves_cast_to_bf16_stay_a_near_miss_with_that_reason() -> None:
    code = _INLINE.replace(".float()", ".to(torch.bfloat16)")
    findings, misses = detect_all(RopePattern(), code)
    assert findings == []
    assert any("cast with `.to(torch.bfloat16)` before the rotation" in m.reason for m in misses)


_INLINE_CAT = '''
import torch


def rope(x, pos, theta=10000.0):
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = pos.float()[:, None] * freqs[None]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)


def rope_unnamed(x, cos, sin):
    half = x.size(-1) // 2
    return torch.cat(
        (
            x[..., :half].float() * cos - x[..., half:].float() * sin,
            x[..., half:].float() * cos + x[..., :half].float() * sin,
        ),
        dim=-1,
    ).to(x.dtype)


def apply_rope_ref(q, k, cos, sin):
    half = q.shape[-1] // 2
    qf, qs = q[..., :half].float(), q[..., half:].float()
    kf, ks = k[..., :half].float(), k[..., half:].float()
    q_r = torch.cat([qf * cos - qs * sin, qs * cos + qf * sin], dim=-1).to(q.dtype)
    k_r = torch.cat([kf * cos - ks * sin, ks * cos + kf * sin], dim=-1).to(k.dtype)
    return q_r, k_r
'''

_INLINE_CAT_RUN = '''
x = torch.randn(2, 6, 3, 16, dtype={dtype}, requires_grad=True)
q = torch.randn(2, 3, 6, 16, dtype={dtype}, requires_grad=True)
k = torch.randn(2, 3, 6, 16, dtype={dtype}, requires_grad=True)
ang = torch.randn(1, 1, 6, 8)
out = [rope(x, torch.arange(6)), rope_unnamed(q, ang.cos(), ang.sin()), apply_rope_ref(q, k, ang.cos(), ang.sin())]
leaves = [x, q, k]
'''


def test_a_fp32_halves_inline_in_the_cat_are_found_and_run() -> None:
    findings = found_and_faithful(RopePattern(), _INLINE_CAT, _INLINE_CAT_RUN.format(dtype="torch.float32"))
    assert sorted(f.qualname for f in findings) == ["apply_rope_ref", "rope", "rope_unnamed"]
    facts = check_rewrite_runs(RopePattern(), _INLINE_CAT, _INLINE_CAT_RUN.format(dtype="torch.bfloat16"), findings)
    assert facts["calls"] >= 4 and all(a == b for a, b in facts["dtypes"])
    assert min(facts["cos_out"]) > 0.999 and min(facts["cos_grad"]) > 0.999


def test_a_halves_cast_to_half_inline_stay_unfused() -> None:
    code = _INLINE_CAT.replace(".float(), x[..., half:].float()", ".half(), x[..., half:].half()")
    findings, _ = detect_all(RopePattern(), code)
    assert "rope" not in [f.qualname for f in findings]


def test_a_cast_halves_of_two_tensors_stay_unfused() -> None:
    code = _INLINE.replace("def rotate(x, cos, sin):", "def rotate(x, cos, sin, y=None):").replace(
        "x2 = x[..., half:].float()", "x2 = (x if y is None else y)[..., half:].float()")
    findings, _ = detect_all(RopePattern(), code)
    assert findings == []


# -- B: a norm helper choosing F.rms_norm by a flag

_FLAGGED_NORM = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


def norm(x, use_rms=True):
    # purely functional norm with no learnable params
    if use_rms:
        return F.rms_norm(x, (x.size(-1),))
    else:
        return F.layer_norm(x, (x.size(-1),))


class Block(nn.Module):
    def __init__(self, dim, use_rmsnorm=True):
        super().__init__()
        self.use_rmsnorm = use_rmsnorm
        self.attn = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(norm(x, use_rms=self.use_rmsnorm))
        x = x + self.mlp(norm(x, use_rms=self.use_rmsnorm))
        return x
'''


def _block_run(flag: str, grad: bool) -> str:
    ctx = "" if grad else "torch.no_grad()"
    run = f"""
blk = Block(32, use_rmsnorm={flag})
x = torch.randn(2, 7, 32, requires_grad={grad})
"""
    if grad:
        return run + "out = blk(x)\nleaves = [x] + list(blk.parameters())\n"
    return run + f"with {ctx}:\n    out = blk(x)\nleaves = []\n"


def test_b_flagged_norm_helper_is_found_and_runs_in_training() -> None:
    findings = found_and_faithful(AddRmsNorm(), _FLAGGED_NORM, _block_run("True", True))
    assert [f.qualname for f in findings] == ["Block.forward"]
    assert "bool(self.use_rmsnorm)" in findings[0].fused


def test_b_flagged_norm_helper_runs_fused_at_inference_and_original_when_off() -> None:
    findings, _ = detect_all(AddRmsNorm(), _FLAGGED_NORM)
    facts = check_rewrite_runs(AddRmsNorm(), _FLAGGED_NORM, _block_run("True", False), findings)
    assert facts["all_calls"].get("npu_add_rms_norm", 0) >= 1
    assert min(facts["cos_out"]) > 0.9999
    off = check_rewrite_runs(AddRmsNorm(), _FLAGGED_NORM, _block_run("False", False), findings)
    assert off["calls"] == 0 and min(off["cos_out"]) > 0.99999


def test_b_conditional_expression_helper_is_found() -> None:
    code = _FLAGGED_NORM.replace("""    if use_rms:
        return F.rms_norm(x, (x.size(-1),))
    else:
        return F.layer_norm(x, (x.size(-1),))""", """    return F.layer_norm(x, (x.size(-1),)) if not use_rms else F.rms_norm(x, (x.size(-1),))""")
    findings = found_and_faithful(AddRmsNorm(), code, _block_run("True", True))
    assert [f.qualname for f in findings] == ["Block.forward"]


def test_b_flag_as_an_unchanged_parameter_or_the_default_is_read() -> None:
    code = _FLAGGED_NORM.replace("    def forward(self, x):\n", "    def forward(self, x, use_rms=True):\n").replace(
        "use_rms=self.use_rmsnorm", "use_rms=use_rms")
    findings = found_and_faithful(AddRmsNorm(), code, _block_run("True", True))
    assert [f.qualname for f in findings] == ["Block.forward"] and "bool(use_rms)" in findings[0].fused
    default = _FLAGGED_NORM.replace("norm(x, use_rms=self.use_rmsnorm)", "norm(x)")
    findings = found_and_faithful(AddRmsNorm(), default, _block_run("True", True))
    assert [f.qualname for f in findings] == ["Block.forward"] and "bool(" not in findings[0].fused


def test_b_constant_flag_choosing_layer_norm_is_a_near_miss() -> None:
    code = _FLAGGED_NORM.replace("use_rms=self.use_rmsnorm", "use_rms=False")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert findings == []
    assert any("is called with `use_rms=False`" in m.reason and "F.layer_norm" in m.reason for m in misses)


def test_b_flag_computed_in_the_caller_is_a_near_miss() -> None:
    code = _FLAGGED_NORM.replace("    def forward(self, x):\n", "    def forward(self, x, step=0):\n        flag = step % 2 == 0\n").replace(
        "use_rms=self.use_rmsnorm", "use_rms=flag")
    findings, misses = detect_all(AddRmsNorm(), code)
    assert findings == []
    assert any("passed here as `flag`" in m.reason for m in misses)


def test_b_rms_branch_reading_another_parameter_stays_unfused() -> None:
    code = _FLAGGED_NORM.replace("def norm(x, use_rms=True):", "def norm(x, use_rms=True, eps=None):").replace(
        "return F.rms_norm(x, (x.size(-1),))", "return F.rms_norm(x, (x.size(-1),), eps=eps)")
    findings, _ = detect_all(AddRmsNorm(), code)
    assert findings == []


# -- C: an optimizer whose param_groups are all that is read

_GROUPS_ONLY = '''
import torch
from transformers import Trainer


def train(model, args, data_module):
    model.requires_grad_(False)
    parameters = []
    for name, lr in (("llm", args.learning_rate), ("vit", args.learning_rate * 0.1)):
        module = getattr(model, name)
        module.requires_grad_(True)
        parameters.append({"params": list(module.parameters()), "lr": lr})
    optimizer = torch.optim.AdamW(parameters, lr=args.learning_rate, weight_decay=args.weight_decay)
    param_lr_mapping = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            param_lr_mapping[param] = group["lr"]
    print(len(param_lr_mapping), len(optimizer.param_groups))
    trainer = Trainer(model=model, args=args, **data_module)
    trainer.train()
'''


def test_c_optimizer_read_only_for_its_param_groups_is_a_near_miss() -> None:
    findings, misses = detect_all(FusedOptimizer(), _GROUPS_ONLY)
    assert findings == []
    assert any("is never stepped here" in m.reason and "only reads its `param_groups`" in m.reason for m in misses)


def test_c_optimizer_handed_to_the_trainer_is_not_called_unstepped() -> None:
    # handed on: this reader says nothing (the existing HF Trainer near miss about zero_grad stands)
    code = _GROUPS_ONLY.replace("Trainer(model=model, args=args, **data_module)",
                                "Trainer(model=model, args=args, optimizers=(optimizer, None), **data_module)")
    findings, misses = detect_all(FusedOptimizer(), code)
    assert findings == [] and misses
    assert not any("never stepped" in m.reason for m in misses)
    assert any("handed to `Trainer`" in m.reason for m in misses)


def test_c_optimizer_stepped_after_reading_its_groups_stays_a_candidate() -> None:
    code = _GROUPS_ONLY.replace("    trainer = Trainer(model=model, args=args, **data_module)\n    trainer.train()\n",
                                "    for batch in data_module['train']:\n        model(batch).backward()\n"
                                "        optimizer.step()\n        optimizer.zero_grad(set_to_none=False)\n")
    findings, _ = detect_all(FusedOptimizer(), code)
    assert [f.qualname for f in findings] == ["train"]


def test_c_optimizer_returned_stays_a_candidate() -> None:
    code = _GROUPS_ONLY.replace("    trainer = Trainer(model=model, args=args, **data_module)\n    trainer.train()\n",
                                "    return optimizer\n")
    findings, _ = detect_all(FusedOptimizer(), code)
    assert [f.qualname for f in findings] == ["train"]


# -- D: the near miss of a loop unpacking zipped expert weights

_ZIPPED_WEIGHTS = '''
import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    def __init__(self, n_experts, dim, hidden):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.randn(n_experts, dim, hidden))

    def forward(self, x, expert_idx, weights):
        out = torch.zeros_like(x)
        for e, (w1, w2) in enumerate(zip(self.w1, self.w2)):
            rows = (expert_idx == e).nonzero(as_tuple=True)[0]
            out[rows] += F.linear(F.silu(F.linear(x[rows], w1)), w2) * weights[rows, None]
        return out
'''


def test_d_zipped_weight_loop_near_miss_names_the_unpacking() -> None:
    findings, misses = detect_all(MoeExperts(), _ZIPPED_WEIGHTS)
    assert findings == []
    assert any("unpacks each item of `enumerate(zip(self.w1, self.w2))` into `(w1, w2)`" in m.reason for m in misses)
