"""s41 audit fixes (audit41): the classes behind the wrong / dubious candidates and the false near-miss reasons of
this session's precision audit on 14 repositories new to npufuse (bench/audit_s41_precision.json,
bench/audit_s41_near_misses.json).

W1 rms_norm: the output dtype "like" an intermediate expression was rendered ``a * b.dtype`` (``.dtype`` binds to
   ``b``): a TypeError in the fused branch (SkyReels-V2's ``fast_rms_norm``). The expression is bracketed.
W2 every pattern (engine): a site after the colon of a one-line compound statement (EVA's
   ``def forward(self, t): return t * self.freqs_cos + rotate_half(t) * self.freqs_sin``): the whole-line rewrite put
   the fused ``if`` (with a ``return``) where the ``def`` was, in the class body. Such a site is a near miss.
W3 every pattern (engine): MiniCPM's ``mlx_finetune.py`` (``import mlx.nn as nn``, no torch import) gave an
   add_rms_norm candidate on mx.arrays. A file that imports another array framework and no torch is not scanned.
W4 attention (Kimi-VL MoonViT ``eager_attention``, 2 sites): a boolean mask built from ``torch.zeros(.., dtype=torch.bool)``
   and ADDED to the scores (True adds 1) was converted as a 0/-inf mask; and the packed ``[T, N, D]`` q/k/v, transposed
   to 3-D, went into the 4-D BNSD call. The boolean sum is a near miss; q/k/v of no stated rank are checked 4-D at run
   time (as SDPA's ``q.dim() == 4``).
W5 affinity_where (rl4co FJSP): ``available = torch.where(busy > t, busy, torch.inf).min(1).values`` then
   ``torch.where(step_complete, available, time)`` became ``lerp``: inf * 0 = NaN in the rows not selected. A value
   reduced or selected from an inf-filled blend is extreme: a near miss.
R1 affinity_where (reason, VLA-Adapter): ``repositioned_noisy_action_features = torch.zeros_like(input_embeddings)`` was
   called "integer tensors" for the "position" inside "repositioned". Name words count as whole parts of the name.
W6 affinity_index_put (Eagle2.5 / LocateAnything, 3 sites): ``input_embeds[selected] = input_embeds[selected] * 0.0 +
   vit_embeds[:n_token]`` became ``torch.where(selected, input_embeds * 0.0 + vit_embeds[:n_token], input_embeds)``:
   the image rows are one per selected token (a masked scatter). An operand not gathered with the mask that may be
   sized by the selection (a row slice, a tensor name that is no scalar nor 1-D parameter) is a near miss.
D1 every pattern (switch, Eagle: 18 attention / sdpa sites): ``os.environ["LA_FLASH_MODEL"] = model_path`` (a worker
   passing a model path) was reused as the sites' switch, tested against "1"/"true": the fused branch never ran. An
   environment variable the repository sets to a value that is no on/off flag is a setting, and one it only sets
   (never reads: the worker exports LA_FLASH_STRICT_ATTN for the model's release files) an input of another
   program: neither is a switch.
R2 attention (reason, CLAP's prototype weighting ``F.softmax(a.squeeze(1) @ b.transpose(-1, -2), dim=1)``): "softmax over
   dim 1, not the last (key) dim" is false for 2-D scores, where dim 1 is the key axis. Where the scores' rank is not
   stated, the reason names both cases.
"""

from __future__ import annotations

from pathlib import Path

from npufuse.patterns import _attention_audit41
from npufuse.patterns.affinity_index_put import AffinityIndexPut
from npufuse.patterns.affinity_where import AffinityWhere
from npufuse.patterns.attention import AttentionPattern
from npufuse.patterns.registry import all_patterns
from npufuse.patterns.rms_norm import RmsNorm
from npufuse.scan import engine, repo_search
from npufuse.scan.dataflow import ModuleInfo
from pattern_harness import check_rewrite_runs, detect_all

# -- W1: the dtype of an intermediate product

_DTYPE_OF_PRODUCT = '''
import torch


def fast_rms_norm(x, weight, eps):
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    x = x.type_as(x) * weight
    return x
'''

_DTYPE_OF_PRODUCT_RUN = "out = fast_rms_norm(torch.randn(2, 5, 16, dtype=torch.bfloat16), torch.randn(16), 1e-6)"


def test_the_dtype_of_an_intermediate_product_is_bracketed() -> None:
    findings, _ = detect_all(RmsNorm(), _DTYPE_OF_PRODUCT)
    assert len(findings) == 1
    assert "(x.float() * torch.rsqrt(" in findings[0].fused
    facts = check_rewrite_runs(RmsNorm(), _DTYPE_OF_PRODUCT, _DTYPE_OF_PRODUCT_RUN, findings)
    assert facts["calls"] >= 1
    assert facts["dtypes"] == [(facts["dtypes"][0][0],) * 2]
    assert min(facts["cos_out"]) > 0.9999


# -- W2: a site on the line of a compound statement's header

_ONE_LINE_DEF = """
import torch
from torch import nn


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionRotaryEmbeddingFast(nn.Module):
    def __init__(self, cos, sin):
        super().__init__()
        self.register_buffer("freqs_cos", cos)
        self.register_buffer("freqs_sin", sin)

    def forward(self, t): return t * self.freqs_cos + rotate_half(t) * self.freqs_sin
"""


def _scan_one(tmp_path: Path, code: str) -> engine.FileOutcome:
    (tmp_path / "site.py").write_text(code, encoding="utf-8")
    return engine.analyze_file(tmp_path, "site.py", all_patterns(), engine.ScanOptions())


def test_a_site_after_a_one_line_def_header_is_a_near_miss(tmp_path: Path) -> None:
    out = _scan_one(tmp_path, _ONE_LINE_DEF)
    assert not [h for h in out.hits if h.finding.pattern == "rope"]
    assert any(m["pattern"] == "rope" and "header of a compound statement" in m["reason"] for m in out.near_misses)


def test_the_same_body_on_its_own_line_is_still_a_candidate(tmp_path: Path) -> None:
    split = _ONE_LINE_DEF.replace("def forward(self, t): return", "def forward(self, t):\n        return")
    out = _scan_one(tmp_path, split)
    assert [h.finding.pattern for h in out.hits] == ["rope"]


# -- W3: a file of another array framework

_MLX_BLOCK = """
import mlx.core as mx
import mlx.nn as nn


class TransformerBlock(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)

    def __call__(self, x: mx.array, r: mx.array) -> mx.array:
        h = x + r
        r = self.post_attention_layernorm(h)
        return h + r
"""


def test_a_file_of_another_array_framework_without_torch_is_not_scanned(tmp_path: Path) -> None:
    out = _scan_one(tmp_path, _MLX_BLOCK)
    assert not out.hits and not out.near_misses


def test_the_torch_twin_is_still_a_candidate(tmp_path: Path) -> None:
    twin = _MLX_BLOCK.replace("import mlx.core as mx\nimport mlx.nn as nn", "import torch\nfrom torch import nn")
    twin = twin.replace("mx.array", "torch.Tensor").replace("nn.RMSNorm(dim, eps=eps)", "nn.RMSNorm(dim, eps=eps)")
    out = _scan_one(tmp_path, twin)
    assert "add_rms_norm" in [h.finding.pattern for h in out.hits]


# -- W4: a boolean mask added to the scores; packed 3-D q/k/v

_PACKED_EAGER = """
import math
import torch


def eager_attention(q, k, v, q_cu_seqlens=None):
    seq_length = q.shape[0]
    attention_mask = torch.zeros([1, seq_length, seq_length], device=q.device, dtype=torch.bool)
    for i in range(1, len(q_cu_seqlens)):
        attention_mask[..., q_cu_seqlens[i - 1]:q_cu_seqlens[i], q_cu_seqlens[i - 1]:q_cu_seqlens[i]] = True
    q = q.transpose(0, 1)
    k = k.transpose(0, 1)
    v = v.transpose(0, 1)

    attn_weight = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    attn_weight += attention_mask
    attn_weight = torch.softmax(attn_weight, dim=-1, dtype=torch.float32).to(q.dtype)

    attn_output = attn_weight @ v
    attn_output = attn_output.transpose(0, 1)
    return attn_output.reshape(seq_length, -1)
"""

# the same helper with a float 0/-inf mask (a near miss no more): run on packed 3-D tokens
_PACKED_FLOAT = _PACKED_EAGER.replace("dtype=torch.bool)", "dtype=q.dtype) - 1e9").replace("= True", "= 0.0")
_PACKED_RUN = ("out = eager_attention(torch.randn(12, 2, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8), "
               "torch.tensor([0, 5, 12]))")


def test_a_boolean_mask_added_to_the_scores_is_a_near_miss() -> None:
    findings, misses = detect_all(AttentionPattern(), _PACKED_EAGER)
    assert not findings
    assert any("is a boolean tensor: the sum adds 1 where it is True" in m.reason for m in misses)


def test_packed_3d_tokens_run_the_fused_call_on_4d_views() -> None:
    findings, _ = detect_all(AttentionPattern(), _PACKED_FLOAT)
    assert len(findings) == 1
    assert "_npufuse_q4.dim() == 4" in findings[0].fused
    facts = check_rewrite_runs(AttentionPattern(), _PACKED_FLOAT, _PACKED_RUN, findings)
    # s51b: 3-D [N, T, D] operands (the heads first after the transposes) are passed as [1, N, T, D] views; before,
    # the 4-D-only rank check kept the original code on them (the fused branch never ran)
    assert facts["calls"] == 1
    assert min(facts["cos_out"]) > 0.9999


# -- W5: inf through a blend and a reduction

_INF_REDUCED = """
import torch


def transit(td, step_complete):
    available_time_ma = td["busy_until"]
    available_time = torch.where(available_time_ma > td["time"][:, None], available_time_ma, torch.inf).min(1).values
    td["time"] = torch.where(step_complete, available_time, td["time"])
    return td
"""

# near miss twin's Fuse side: the same blend of a finite reduction stays a candidate
_FINITE_REDUCED = _INF_REDUCED.replace("torch.inf", "available_time_ma")


def test_a_value_reduced_from_an_inf_filled_blend_is_not_inf_safe() -> None:
    findings, misses = detect_all(AffinityWhere(), _INF_REDUCED)
    assert not [f for f in findings if f.line == 8]
    assert any(m.line == 8 and "can hold ±inf/NaN" in m.reason for m in misses)


def test_a_finite_reduction_is_still_a_candidate() -> None:
    findings, _ = detect_all(AffinityWhere(), _FINITE_REDUCED)
    assert [f.line for f in findings] == [7, 8]


# -- R1: integer words are whole parts of a name

_REPOSITIONED = """
import torch


def splice(input_embeddings, noisy_action_features, all_actions_mask, batch_indices, masked_indices):
    repositioned_noisy_action_features = torch.zeros_like(input_embeddings)
    repositioned_noisy_action_features[batch_indices, masked_indices] = noisy_action_features
    return torch.where(all_actions_mask.unsqueeze(-1), repositioned_noisy_action_features, input_embeddings)
"""


def test_a_name_containing_position_inside_a_word_is_no_integer_evidence() -> None:
    findings, misses = detect_all(AffinityWhere(), _REPOSITIONED)
    assert [f.line for f in findings] == [8]
    assert not any("integer tensors" in m.reason for m in misses)


def test_a_position_ids_name_is_still_an_integer_tensor() -> None:
    twin = _REPOSITIONED.replace("repositioned_noisy_action_features", "action_position_ids")
    findings, misses = detect_all(AffinityWhere(), twin)
    assert not findings
    assert any("integer tensors (`action_position_ids`)" in m.reason for m in misses)


# -- W6: image rows spliced in by the mask (a masked scatter) beside gathered elements

_SCATTER_BESIDE_GATHERED = """
import torch


def merge(input_embeds, input_ids, vit_embeds, img_context_token_id):
    B, N, C = input_embeds.shape
    input_embeds = input_embeds.reshape(B * N, C)
    selected = input_ids.reshape(B * N) == img_context_token_id
    n_token = selected.sum()
    input_embeds[selected] = input_embeds[selected] * 0.0 + vit_embeds[:n_token]
    return input_embeds.reshape(B, N, C)
"""

_SCATTER_BARE_NAME = _SCATTER_BESIDE_GATHERED.replace(
    "    n_token = selected.sum()\n", "    vit_embeds = vit_embeds.reshape(-1, C).to(input_embeds.dtype)\n").replace(
    "vit_embeds[:n_token]", "vit_embeds")

# the near miss's twin that stays a candidate: every tensor operand gathered with the mask, a scalar beside it
_GATHERED_ONLY = _SCATTER_BESIDE_GATHERED.replace("input_embeds[selected] * 0.0 + vit_embeds[:n_token]",
                                                  "input_embeds[selected] * 0.5 + 1.0")


def test_a_row_slice_beside_gathered_elements_is_a_masked_scatter() -> None:
    for code in (_SCATTER_BESIDE_GATHERED, _SCATTER_BARE_NAME):
        findings, misses = detect_all(AffinityIndexPut(), code)
        assert not findings
        assert any("is a tensor not gathered with the mask" in m.reason for m in misses)


def test_gathered_elements_with_a_scalar_stay_a_candidate() -> None:
    findings, _ = detect_all(AffinityIndexPut(), _GATHERED_ONLY)
    assert len(findings) == 1


# -- D1: an environment variable that carries a value is no switch

_WORKER = """
import os


def start(model_path, attn, strict):
    os.environ["LA_FLASH_MODEL"] = model_path
    os.environ["LA_FLASH_ATTN"] = attn
    os.environ["USE_FLASH_ATTN"] = "1" if strict else "0"
    os.environ["LA_FLASH_STRICT_ATTN"] = "1"
"""

# the flag set above is read by the repository's own code too: a switch of this code
_READER = """
import os

FLASH = os.environ.get("USE_FLASH_ATTN", "0") == "1"
"""

_ATTN_SITE = """
import torch


def attend(q, k, v):
    attn = (q @ k.transpose(-2, -1)) * 0.125
    attn = attn.softmax(dim=-1)
    return attn @ v
"""


def _reused(switches: list[dict]) -> str | None:
    module = ModuleInfo.from_source("m.py", _ATTN_SITE)
    scope = next(s for s in module.scopes if s.qualname == "attend")
    ctx = repo_search.site_context(module, scope, 6)
    _switch, reused, _notes = repo_search.choose_switch("attention", ctx, switches, "auto", None)
    return None if reused is None else reused["name"]


def test_an_environment_variable_set_to_a_value_or_only_set_is_no_switch() -> None:
    facts = repo_search.file_facts(ModuleInfo.from_source("worker.py", _WORKER))
    carried = {s["name"] for s in facts.switches if s.get("carries")}
    assert carried == {"LA_FLASH_MODEL", "LA_FLASH_ATTN"}
    assert _reused(facts.switches) is None  # LA_FLASH_STRICT_ATTN / USE_FLASH_ATTN: set here, read by no code of the repo


def test_an_environment_variable_set_to_a_flag_and_read_is_still_reused() -> None:
    facts = repo_search.file_facts(ModuleInfo.from_source("worker.py", _WORKER))
    reader = repo_search.file_facts(ModuleInfo.from_source("config.py", _READER))
    assert _reused(facts.switches + reader.switches) == "USE_FLASH_ATTN"


# -- R2: softmax over dim 1 of scores of no stated rank

_DIM_ONE = """
import torch
import torch.nn.functional as F


def encode(audio_embeds, text_embeds_support, temp):
    sim = audio_embeds.squeeze(1) @ text_embeds_support.transpose(-1, -2)
    sim = sim / temp
    sim = F.softmax(sim, dim=1)
    return (sim @ text_embeds_support).unsqueeze(1)
"""


def test_softmax_over_dim_one_of_unstated_rank_names_the_2d_case() -> None:
    findings, misses = detect_all(AttentionPattern(), _DIM_ONE)
    assert not findings
    assert [m.reason for m in misses] == [_attention_audit41.DIM_ONE_SOFTMAX]


def test_softmax_over_dim_one_of_einsum_scores_keeps_the_plain_reason() -> None:
    einsum = _DIM_ONE.replace("audio_embeds.squeeze(1) @ text_embeds_support.transpose(-1, -2)",
                              'torch.einsum("bqd,bkd->bqk", audio_embeds, text_embeds_support)')
    _, misses = detect_all(AttentionPattern(), einsum)
    assert any("softmax over dim 1, not the last (key) dim" in m.reason for m in misses)
