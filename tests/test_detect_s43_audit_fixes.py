"""s43 audit fixes (audit43): the classes behind the wrong / dubious candidates and the false near-miss reasons of
this session's precision audit on 15 repositories new to npufuse (bench/audit_s43_precision.json,
bench/audit_s43_near_misses.json).

W1 sdpa (optimum BetterTransformer ``bloom_forward``): ``alibi = torch.masked_fill(alibi, attention_mask,
   torch.finfo(alibi.dtype).min)`` then ``F.scaled_dot_product_attention(q, k, v, attn_mask=alibi)``. The fill value
   (finfo.min) was taken as proof of a 0/-inf mask, so ``alibi < 0`` went to the op with no value check: the ALiBi
   bias (slopes * positions, not 0) was dropped. A masked_fill is a 0/-inf mask only when the tensor filled is one
   (zeros, or a 0/-inf mask itself); otherwise its values are checked at run time.
W2 affinity_index_put (mmdet ``RegionAssigner``): ``labels[pos] = gt_labels[gt_inds[pos] - 1]``: the gathered term
   is the INDEX of another tensor; the where form evaluates ``gt_labels[gt_inds - 1]`` on every row, and the rows the
   mask leaves out hold -1 / 0 (index -2 / -1: an IndexError with one ground truth, any index with none).
W3 affinity_where (TorchRL ``AutoResetTransform``): ``torch.where(mask, torch.full_like(val, self.fill_float), val)``
   with ``fill_float = float("nan")`` set in ``__init__``: lerp(val, nan, 0) is NaN everywhere. An attribute fill
   value is traced to its assignments in the class (and a parameter's default / rebinding there).
W4 affinity_index_put (ProteinWorkshop ``centralize``): ``values = batch[key][node_mask]`` then
   ``masked[node_mask] = values - centroid[batch_index][node_mask]``: ``values`` (selection-sized) was kept as is
   beside the whole-tensor terms (a shape mismatch). A name bound to the gathered elements is selection-sized.
D2 affinity_index_put (ProteinWorkshop ``decentralize``): ``masked[m] = x[m] + centroid[batch_index]``: a term
   gathered by another index tensor, not by the mask, has the index's rows (selection-sized where the eager sum runs).
R1 affinity_where (reason, encodec kmeans / TorchRL quaternions): "computes `a / b.clamp_min(1e-12)`, which can be
   inf/NaN": a denominator clamped to a positive minimum (or a count with its zeros filled) is never 0.
R2 affinity_index_put (reason, TorchRL ``diff[mask] = diff.max() + 1``): "may hold one row per selected element" for
   a full reduction (a 0-d tensor). Reworded.
"""

from __future__ import annotations

from npufuse.patterns.affinity_index_put import AffinityIndexPut
from npufuse.patterns.affinity_where import AffinityWhere
from npufuse.patterns.sdpa import SdpaPattern
from pattern_harness import detect_all

# -- W1: a masked_fill of a bias (not of zeros) is no 0/-inf mask

_BLOOM_ALIBI = """
import torch


def bloom_forward(self, query_layer, key_layer, value_layer, alibi, attention_mask, batch_size):
    alibi = alibi.reshape(batch_size, -1, *alibi.shape[1:])
    alibi = torch.masked_fill(alibi, attention_mask, torch.finfo(alibi.dtype).min)
    context_layer = torch.nn.functional.scaled_dot_product_attention(
        query_layer, key_layer, value_layer, attn_mask=alibi,
    )
    return context_layer
"""

_ZEROS_FILLED = """
import torch


def attend(q, k, v, keep):
    bias = torch.zeros(q.shape[-2], k.shape[-2], device=q.device)
    bias = bias.masked_fill(~keep, float("-inf"))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
"""


def test_a_masked_fill_of_a_bias_gets_its_values_checked() -> None:
    findings, _ = detect_all(SdpaPattern(), _BLOOM_ALIBI)
    assert len(findings) == 1
    fused = findings[0].fused
    # the run-time value check decides: an ALiBi bias (not 0/-inf) keeps the original SDPA call
    assert "<= -1000.0" in fused and "alibi < 0" in fused


def test_a_masked_fill_of_zeros_is_still_a_mask_without_a_check() -> None:
    findings, _ = detect_all(SdpaPattern(), _ZEROS_FILLED)
    assert len(findings) == 1
    assert "<= -1000.0" not in findings[0].fused


# -- W2: the gathered elements used as indices of another tensor

_GATHER_BY_GATHERED = """
import torch


def assign(gt_inds, gt_labels):
    labels = torch.zeros_like(gt_inds)
    pos = gt_inds > 0
    labels[pos] = gt_labels[gt_inds[pos] - 1]
    return labels
"""

_GATHERED_ELEMENTWISE = """
import torch


def assign(gt_inds, scores):
    labels = torch.zeros_like(scores)
    pos = gt_inds > 0
    labels[pos] = scores[pos] * 2.0 + 1.0
    return labels
"""


def test_gathered_elements_used_as_indices_are_a_near_miss() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _GATHER_BY_GATHERED)
    assert not findings
    assert any("index" in m.reason and "gt_labels" in m.reason for m in misses)


def test_gathered_elements_in_arithmetic_still_fuse() -> None:
    findings, _ = detect_all(AffinityIndexPut(), _GATHERED_ELEMENTWISE)
    assert len(findings) == 1


# -- W3: a fill value read off an attribute the class sets to NaN

_NAN_ATTRIBUTE = """
import torch


class AutoReset:
    def __init__(self, fill_float="nan"):
        if fill_float == "nan":
            fill_float = float("nan")
        self.fill_float = fill_float

    def replace(self, val, mask):
        return torch.where(mask, torch.full_like(val, self.fill_float), val)

    def correct(self, vals, mask):
        def replace_and_set(val):
            return torch.where(mask, torch.full_like(val, self.fill_float), val)
        return [replace_and_set(v) for v in vals]
"""

_FINITE_ATTRIBUTE = """
import torch


class AutoReset:
    def __init__(self, fill_float=0.5):
        self.fill_float = fill_float

    def replace(self, val, mask):
        return torch.where(mask, torch.full_like(val, self.fill_float), val)
"""


def test_a_fill_attribute_set_to_nan_is_not_inf_safe() -> None:
    findings, misses = detect_all(AffinityWhere(), _NAN_ATTRIBUTE)
    assert not findings  # in the method and in a function nested in a method
    assert len([m for m in misses if "NaN" in m.reason]) == 2


def test_a_finite_fill_attribute_still_becomes_lerp() -> None:
    findings, _ = detect_all(AffinityWhere(), _FINITE_ATTRIBUTE)
    assert len(findings) == 1


# -- W4 / D2: selection-sized operands beside whole-tensor terms

_BOUND_GATHER = """
import torch


def centralize(pos, batch_index, node_mask, centroid):
    masked = torch.ones_like(pos) * 2.0
    values = pos[node_mask]
    masked[node_mask] = values - centroid[batch_index][node_mask]
    return masked
"""

_INDEX_GATHER = """
import torch


def decentralize(pos, batch_index: torch.Tensor, node_mask, centroid):
    masked = torch.ones_like(pos) * 2.0
    masked[node_mask] = pos[node_mask] + centroid[batch_index]
    return masked
"""

_BOTH_GATHERED = """
import torch


def decentralize(pos, batch_index, node_mask, centroid):
    masked = torch.ones_like(pos) * 2.0
    masked[node_mask] = pos[node_mask] + centroid[batch_index][node_mask]
    return masked
"""


def test_a_name_bound_to_the_gathered_elements_is_a_near_miss() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _BOUND_GATHER)
    assert not findings
    assert any("`values`" in m.reason for m in misses)


def test_a_term_gathered_by_another_index_is_a_near_miss() -> None:
    findings, misses = detect_all(AffinityIndexPut(), _INDEX_GATHER)
    assert not findings
    assert any("centroid[batch_index]" in m.reason for m in misses)


def test_terms_all_gathered_with_the_mask_still_fuse() -> None:
    findings, _ = detect_all(AffinityIndexPut(), _BOTH_GATHERED)
    assert len(findings) == 1


# -- R1: a denominator clamped to a positive minimum is never 0

_CLAMPED_DENOMINATOR = """
import torch


def normalize_or_identity(quat, identity):
    norm = quat.norm(dim=-1, keepdim=True)
    normalized = quat / norm.clamp_min(1e-12)
    return torch.where(norm > 1e-12, normalized, identity)
"""

_COUNT_FILLED = """
import torch


def update(means, sums, bins):
    zero_mask = bins == 0
    bins_min_clamped = bins.masked_fill(zero_mask, 1)
    new_means = sums / bins_min_clamped[..., None]
    return torch.where(zero_mask[..., None], means, new_means)
"""

_UNCLAMPED_DENOMINATOR = """
import torch


def normalize_or_identity(quat, identity):
    norm = quat.norm(dim=-1, keepdim=True)
    normalized = quat / norm
    return torch.where(norm > 1e-12, normalized, identity)
"""


_CLAMPED_THEN_RESHAPED = """
import torch


def axis_angle(xyz, angle, den, zeros):
    scaled = xyz * angle.unsqueeze(-1) / den.clamp_min(1e-6).unsqueeze(-1)
    return torch.where(den.unsqueeze(-1) > 1e-6, scaled, zeros)
"""


def test_a_clamped_denominator_is_no_guarded_division() -> None:
    for code in (_CLAMPED_DENOMINATOR, _COUNT_FILLED, _CLAMPED_THEN_RESHAPED):
        findings, misses = detect_all(AffinityWhere(), code)
        assert len(findings) == 1, [m.reason for m in misses]


def test_an_unclamped_denominator_stays_a_near_miss() -> None:
    findings, misses = detect_all(AffinityWhere(), _UNCLAMPED_DENOMINATOR)
    assert not findings
    assert any("inf/NaN" in m.reason for m in misses)


# -- R2: a full reduction is one value, not one row per selected element

_FULL_REDUCTION = """
import torch


def mark(diff, other):
    mask = other != 0
    diff[mask] = diff.max() + 1
    return diff
"""


def test_a_full_reduction_value_is_not_called_selection_sized() -> None:
    _, misses = detect_all(AffinityIndexPut(), _FULL_REDUCTION)
    assert misses
    assert all("one row per selected element" not in m.reason for m in misses)
    assert any("0-d" in m.reason for m in misses)


# -- D1 attention (mmpose's MultiheadAttention with ``residual_attn.unsqueeze(0)``): a per-head 4-D mask term


def test_a_per_head_mask_term_folds_over_batch_and_heads() -> None:
    import torch

    from npufuse.patterns._attention_audit40 import fold_term_lambda

    b, n, sq, sk = 2, 3, 4, 5
    q = torch.zeros(b * n, sq, 8)
    env: dict = {"q": q, "torch": torch}
    exec(fold_term_lambda(None, "q", "q.shape[1]", str(sk)), env)
    fold = env["_npufuse_fold"]
    per_head = torch.rand(1, n, sq, sk) < 0.5
    per_batch = torch.rand(b, 1, 1, sk) < 0.5
    view = torch.zeros(b, n, sq, sk, dtype=torch.bool)
    for term in (per_head, per_batch, torch.rand(b, n, sq, sk) < 0.5, torch.rand(1, 1, sq, sk) < 0.5):
        want = (view | term).reshape(b * n, 1, sq, sk)  # the eager view(B, N, ..) broadcast, folded like q
        assert torch.equal(fold(term).expand(b * n, 1, sq, sk), want)


# -- W5 affinity_where (TorchRL ``LossModule._reduce_loss``): the author's comment says the masked values may be NaN

_COMMENTED_GUARD = """
import torch


def reduce_loss(loss, mask):
    # Select rather than multiply: masked positions may hold non-finite
    # values, and ``nan * 0`` is ``nan`` in both the forward and the
    # backward pass.
    loss = torch.where(mask, loss, torch.zeros_like(loss))
    return loss.sum()
"""

_UNCOMMENTED_MASKING = """
import torch


def reduce_loss(loss, mask):
    # zero the padded positions before the sum
    loss = torch.where(mask, loss, torch.zeros_like(loss))
    return loss.sum()
"""


def test_a_comment_naming_nan_at_the_blend_makes_it_a_guard() -> None:
    findings, misses = detect_all(AffinityWhere(), _COMMENTED_GUARD)
    assert not findings
    assert any("non-finite" in m.reason for m in misses)


def test_a_masking_blend_without_such_a_comment_still_becomes_lerp() -> None:
    findings, _ = detect_all(AffinityWhere(), _UNCOMMENTED_MASKING)
    assert len(findings) == 1


# -- R3 affinity_index_put (reason, ProteinWorkshop's GVP layer): a tuple of values is not "one call"

_TUPLE_VALUES = """
import torch


def scatter_back(x_, x, node_mask):
    x_[0][node_mask], x_[1][node_mask] = x[0], x[1]
    return x_
"""


def test_masked_targets_unpacked_from_a_tuple_are_not_called_one_call() -> None:
    _, misses = detect_all(AffinityIndexPut(), _TUPLE_VALUES)
    assert misses and all("one call" not in m.reason for m in misses)
    assert any("from a tuple" in m.reason for m in misses)


# -- R1 (cont., mmdet ``smooth_l1_loss``): a divisor the function asserts positive

_ASSERTED_BETA = """
import torch


def smooth_l1_loss(pred, target, beta=1.0):
    assert beta > 0
    diff = torch.abs(pred - target)
    quadratic = 0.5 * diff * diff / beta
    linear = diff - 0.5 * beta
    loss = torch.where(diff < beta, quadratic, linear)
    return loss
"""


def test_a_divisor_asserted_positive_is_no_guarded_division() -> None:
    findings, misses = detect_all(AffinityWhere(), _ASSERTED_BETA)
    assert len(findings) == 1, [m.reason for m in misses]
    no_assert = _ASSERTED_BETA.replace("    assert beta > 0\n", "")
    findings, misses = detect_all(AffinityWhere(), no_assert)
    assert not findings and any("inf/NaN" in m.reason for m in misses)


def test_the_attribute_index_does_not_share_repo_search_memo() -> None:
    """The scan's repository search memoises ``self`` attributes per class in the module (as sets): the where
    detector's own index lives under another key (a shared key raised AttributeError on TorchRL's transforms)."""
    from npufuse.scan.dataflow import ModuleInfo

    module = ModuleInfo.from_source("example.py", _NAN_ATTRIBUTE)
    module.__dict__["_npufuse_self_attrs"] = {"AutoReset": set()}
    misses = [r for scope in module.scopes for r in AffinityWhere().detect(module, scope)]
    assert misses and all("NaN" in m.reason for m in misses)


_COMMENT_ON_AN_EARLIER_STATEMENT = """
import torch


def limits(lo, hi):
    # the simulator emits 0/0 for limit-less actuators -- treat as +/-inf
    unlimited = (lo == 0) & (hi == 0)
    lo = torch.where(unlimited, torch.full_like(lo, -1.0), lo)
    return lo
"""


def test_a_comment_on_an_earlier_statement_does_not_speak_for_the_blend() -> None:
    findings, _ = detect_all(AffinityWhere(), _COMMENT_ON_AN_EARLIER_STATEMENT)
    assert len(findings) == 1


# -- R5 add_rms_norm (reason, TorchRL's pendulum): ``cls.angle_normalize(...)`` is a staticmethod, not a module

_STATIC_NORMALIZE = """
import torch


class PendulumEnv:
    @classmethod
    def step(cls, th, thdot, dt):
        new_th = cls.angle_normalize(th + thdot * dt)
        return new_th

    @staticmethod
    def angle_normalize(x):
        return ((x + torch.pi) % (2 * torch.pi)) - torch.pi
"""


def test_a_method_of_the_class_is_not_called_a_module() -> None:
    from npufuse.patterns.add_rms_norm import AddRmsNorm

    _, misses = detect_all(AddRmsNorm(), _STATIC_NORMALIZE)
    assert all("is a module of" not in m.reason for m in misses)
