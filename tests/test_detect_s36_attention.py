"""s36 attention constructs (HO12 / ports 7 development data): values decided by type and dataflow (a ``torch.math``
scale, a masking value a method returns), identity modules on the scores checked at run time, probabilities read
only under the caller's flag, comprehension unpacking of q/k/v."""

from __future__ import annotations

import re

from test_detect_s35_attention import _example, candidates  # noqa: F401  (the fixture and the example lookup)


def test_torch_math_scale_is_passed_as_written(candidates) -> None:
    (text,) = candidates(_example("s36_scale_from_torch_math_is_a_python_float"))
    assert "scale=1.0 / torch.math.sqrt(head_dim)" in text


def test_identity_module_is_checked_with_its_hooks(candidates) -> None:
    (text,) = candidates(_example("s36_identity_module_on_the_scores"))
    assert "isinstance(self.map_tap, nn.Identity)" in text
    assert "self.map_tap._forward_hooks" in text and "self.map_tap._forward_pre_hooks" in text


def test_masking_value_from_a_method_guards_an_override(candidates) -> None:
    (text,) = candidates(_example("s36_masking_value_cached_by_a_method"))
    assert "type(self)._fill_for is CachedFillAttention._fill_for" in text


def test_comprehension_unpacking_is_read_per_item_and_guarded_before_the_span(candidates) -> None:
    (text,) = candidates(_example("s36_masking_value_from_a_function_through_a_local"))
    assert "for t in (q, k, v))[" not in text  # a generator has no [k]
    assert "_npufuse_on_npu(h)" in text  # q is bound inside the rewritten span


def test_probabilities_packed_under_a_flag_run_fused_only_without_it(candidates) -> None:
    (text,) = candidates(_example("s36_probabilities_packed_into_the_outputs_under_the_callers_flag"))
    assert "not with_maps" in text


def test_channel_first_output_is_transposed_back_and_d_checked(candidates) -> None:
    (text,) = candidates(_example("s36_channel_first_qkv_with_v_times_transposed_probabilities"))
    assert "[0].transpose(-2, -1)" in text
    # s37: D (the tokens here) is bounded by the general head check on the bound k / v, not a check on q
    assert re.search(r"\.shape\[-?\d\] <= \S+\.shape\[-?\d\] <= 768", text)
    assert "q.transpose(-2, -1).shape[-1] <= 768" not in text


def test_learned_temperature_checks_the_op_head_dim_limit(candidates) -> None:
    # MONAI CABlock: the channel layout is made by the caller; the per-head temperature marks it
    (text,) = candidates(_example("s35_learned_per_head_temperature_divides_the_scores"))
    # s37: the general head check (v's head dim <= k's <= 768) bounds it; the special check on q is gone
    assert "v.shape[-1] <= k.shape[-1] <= 768" in text
    assert "q.shape[-1] <= 768" not in text


def test_sdpa_scale_from_a_learned_temperature_checks_the_head_dim(tmp_path) -> None:
    from npufuse.patterns.sdpa import SdpaPattern
    from npufuse.scan.engine import scan_repo

    code = next(e.code for e in SdpaPattern.FUSE if e.name == "s36_scale_read_off_a_learned_temperature_checks_the_head_dim")
    (tmp_path / "m.py").write_text(code)
    (cand,) = scan_repo(tmp_path, jobs=1, only=["sdpa"]).candidates
    # (s51b: q / k / v of unstated rank are read through their 4-D views, `_npufuse_k4`)
    assert "_npufuse_k4.shape[-1] <= 768" in cand["replacement"]


def test_v_times_transposed_probabilities_checks_the_ranks(candidates) -> None:
    # timm EfficientViT: q/k/v flattened to 3-D [B, D, S] before ``v @ attn.transpose(-2, -1)``: not the 4-D reading
    code = _example("s36_channel_first_qkv_with_v_times_transposed_probabilities").replace(
        "q, k, v = self.qkv(x).view(B, 3, self.heads, self.hd, H * W).unbind(1)",
        "q, k, v = self.qkv(x).flatten(2).chunk(3, dim=1)")
    for text in candidates(code):
        assert "q.dim() == 4 and k.dim() == 4" in text
