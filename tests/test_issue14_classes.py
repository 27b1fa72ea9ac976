"""Issue 14 asks that every class of measured misses has FUSE and KEEP examples. The examples are
the patterns' own tests (tests/test_patterns.py runs every one: a Fuse must be found, rewritten
and op-checked under the emulator; a Keep must give its near-miss reason). This file pins which
examples stand for which class, so that deleting or renaming the last example of a class fails
here instead of passing silently."""

from __future__ import annotations

import pytest

from npufuse.patterns.registry import all_patterns

# class -> (pattern id, example name) pairs, Fuse and Keep separately. Several patterns may serve
# one class (class 7 is about every rewrite); each class needs at least one of each kind.
CLASSES: dict[str, dict[str, list[tuple[str, str]]]] = {
    "1 library and alternative norms": {
        "fuse": [("rms_norm", "nn_rmsnorm_modules"), ("rms_norm", "f_rms_norm_in_a_module"),
                 ("rms_norm", "torch_rms_norm_without_weight"), ("rms_norm", "f_normalize_times_sqrt_d"),
                 ("rms_norm", "dim_attribute_default_last"), ("add_rms_norm", "dim_attribute_norm_training"),
                 ("rms_norm", "probe_dim_attribute_guarded_at_run_time")],
        "keep": [("rms_norm", "probe_statistic_over_dim_1"),
                 ("rms_norm", "scalenorm_l2_with_scalar_gain")],
    },
    "2 rope spellings": {
        "fuse": [("rope", "neox_chunk_written_out_half_tables"), ("rope", "helper_chosen_by_a_flag"),
                 ("rope", "palm_einops_rotate_half"), ("rope", "flux_rotation_matrix_lanes"),
                 ("rope", "phi_partial_rotary"), ("rope", "vllm_tokens_3d_written_out")],
        "keep": [("rope", "helper_chosen_by_a_flag_one_choice_unverified"), ("rope", "einops_pairs_sign_flipped"),
                 ("rope", "rotation_matrix_transposed"), ("rope", "odd_partial_rotary_dim"), ("rope", "three_d_cos")],
    },
    "3 attention forms": {
        "fuse": [("attention", "single_head_einsum_channel_first"), ("attention", "megatron_baddbmm_3d"),
                 ("attention", "softmax_module_attribute"), ("attention", "bool_or_float_mask_branches"),
                 ("attention", "hiera_5d_folded"), ("attention", "single_head_3d_matmul_causal")],
        "keep": [("attention", "alibi_bias"), ("attention", "hiera_5d_with_mask"),
                 ("attention", "megatron_softmax_module_other_forward"), ("attention", "baddbmm_adds_a_bias")],
    },
    "4 moe forms": {
        "fuse": [("moe_experts", "zip_masks_with_experts"), ("moe_experts", "experts_passed_into_init_enumerate_where"),
                 ("moe_experts", "expert_parallel_range_start_end_grouped"),
                 ("moe_experts", "split_by_counts_sorted_tokens_index_add"),
                 ("moe_experts", "argsort_index_select_inplace_index_add"), ("moe_experts", "single_linear_experts"),
                 ("moe_experts", "grouped_mm_direct_calls")],
        "keep": [("moe_experts", "arange_masks_not_expert_first"), ("moe_experts", "split_fixed_chunks"),
                 ("moe_experts", "grouped_mm_two_offsets"), ("moe_experts", "sort_descending_is_not_the_permute")],
    },
    "5 optimizers": {
        "fuse": [("fused_optimizer", "adadelta"), ("fused_optimizer", "rmsprop_module_alias_centered"),
                 ("fused_optimizer", "param_groups_passed_as_an_argument"),
                 ("fused_optimizer", "params_from_a_helper_of_another_file"),
                 ("fused_optimizer", "s27_two_tensors_listed"), ("fused_optimizer", "s27_single_parameter_attribute")],
        "keep": [("fused_optimizer", "adagrad_has_no_fused_class"), ("fused_optimizer", "fsdp_wrapped_model"),
                 ("fused_optimizer", "returned_optimizer_zero_grad_set_to_none")],
    },
    "6 config-driven activations": {
        "fuse": [("swiglu", "config_activation_func_halves_silu"), ("swiglu", "activation_chosen_by_a_flag"),
                 ("geglu", "t5_act2fn_config")],
        "keep": [("swiglu", "activation_chosen_between_unfusable_ones"), ("swiglu", "tuple_from_helper_always_relu")],
    },
    "7 torchscript and expressions bound once": {
        "fuse": [("rope", "torchscript_function_lifted"), ("swiglu", "inline_projection_silu_on_second_half_bound_once"),
                 ("attention", "module_call_bound_once")],
        "keep": [("rope", "torchscript_function_called_from_scripted_code"), ("rms_norm", "inside_torch_jit_script"),
                 ("swiglu", "optional_up_projection_in_a_conditional_expression")],
    },
}


def _examples() -> dict[tuple[str, str, str], object]:
    pats = all_patterns() if callable(all_patterns) else all_patterns
    out: dict[tuple[str, str, str], object] = {}
    for p in pats:
        for f in p.FUSE:
            out[(p.id, "fuse", f.name)] = f
        for k in p.KEEP:
            out[(p.id, "keep", k.name)] = k
    return out


@pytest.mark.parametrize("klass", sorted(CLASSES))
def test_class_has_fuse_and_keep_examples(klass: str) -> None:
    have = _examples()
    for kind in ("fuse", "keep"):
        wanted = CLASSES[klass][kind]
        assert wanted, f"class {klass} lists no {kind} example"
        missing = [f"{pid}:{name}" for pid, name in wanted if (pid, kind, name) not in have]
        assert not missing, f"class {klass}: {kind} examples gone: {missing}"


def test_keep_examples_of_the_classes_check_a_reason() -> None:
    """A near miss that stands for a class must name why (an empty reason only says 'nothing found')."""
    have = _examples()
    for klass, kinds in CLASSES.items():
        for pid, name in kinds["keep"]:
            assert have[(pid, "keep", name)].reason, f"class {klass}: {pid}:{name} checks no reason"
