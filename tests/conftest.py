import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from transformers.utils import logging  # noqa: E402

logging.set_verbosity_error()


import pytest  # noqa: E402


@pytest.fixture(params=["cpu", "reference"])
def kernel_path(request, monkeypatch):
    """Both CPU implementations of the attention primitive: torch's CPU flash kernel and the float64 reference."""
    from sharedprefix.attention import interface

    monkeypatch.setattr(interface.PassState, "backend", request.param)
    return request.param


# -- test tiers ----------------------------------------------------------------------------------------------------
# `scripts/dev test -m "not slow"` is the inner loop; CI runs everything. Whole files that are slow carry a
# module-level `pytestmark = pytest.mark.slow`; the slow tests of files other work is editing are listed here by
# file and test name: the function's name marks all its parameter sets, `name[params]` one of them, so those
# files stay untouched. Each slow entry below has a lighter sibling left in the inner loop.
SLOW_TESTS = {
    "test_trl.py": {  # TRL's real train(), twice per test
        "test_same_parameters_as_grpo_trainer",
        "test_budget_schedule_matches_unscheduled",
        "test_lora_trainer_matches_grpo_trainer",
        "test_multi_turn_tool_mask_trains_as_grpo_trainer",
        "test_hybrid_model_trains_as_grpo_trainer",
        "test_bf16_mixed_precision_trains_as_grpo_trainer",
    },
    "test_trl_vl_train.py": {"*"},  # TRL's real train() on image datasets
    "test_verl.py": {"*"},  # verl's engine, one and two processes (its own environment: scripts/dev test-verl)
    "test_hybrid.py": {"test_zoo_hybrids_match_the_plain_forward_and_carry_every_state"},  # the zoo's hybrids
    # the heaviest exactness cases (10-50 s each on a loaded 2-core machine); qwen3 and llama stay in the inner loop
    "test_exact.py": {
        "test_random_layouts",
        "test_float64_logprobs_and_grads_match_plain[cpu-qwen2]",
        "test_float64_logprobs_and_grads_match_plain[cpu-gemma]",
        "test_float64_logprobs_and_grads_match_plain[cpu-gpt2]",
        "test_float64_logprobs_and_grads_match_plain[cpu-mistral]",
        "test_float64_logprobs_and_grads_match_plain[reference-gemma]",
        "test_float64_logprobs_and_grads_match_plain[reference-phi3]",
        "test_float64_logprobs_and_grads_match_plain[reference-qwen2]",
        "test_float64_logprobs_and_grads_match_plain[reference-gpt2]",
        "test_layouts[reference-group_of_24]",
        "test_full_layers_ignore_a_window_left_on_the_module[reference]",
    },
    "test_indexed.py": {  # DeepSeek sparse attention; one prefix-tree case, the broken-path checks and refusals stay
        "test_a_budget_that_splits_a_group_exact[deepseek_v32-keep]",
        "test_a_budget_that_splits_a_group_exact[deepseek_v32-offload]",
        "test_a_budget_that_splits_a_group_exact[deepseek_v32-recompute]",
        "test_a_budget_that_splits_a_group_exact[hy_v4-keep]",
        "test_a_budget_that_splits_a_group_exact[hy_v4-offload]",
        "test_a_budget_that_splits_a_group_exact[hy_v4-recompute]",
        "test_deepseek_v32_prefix_tree_exact[8]",
        "test_a_split_without_the_cached_prompt_is_caught[cached indexer keys zeroed]",
        "test_a_nested_call_on_the_same_model_exact",
        "test_a_long_prompt_in_chunks_exact",
        "test_gradient_checkpointing_exact",
        "test_deepseek_v32_several_groups_per_row_exact",
        "test_deepseek_v32_prefix_tree_exact[4]",
        "test_sinks_and_a_shared_indexer_layer_exact",
    },
    "test_autocast.py": {
        "test_logprobs_and_gradients_under_autocast_by_the_2x_rule[None-llama]",
        "test_a_float64_model_under_autocast_stays_float64[None]",
        "test_logprobs_and_gradients_under_autocast_by_the_2x_rule[12-phi3]",
        "test_logprobs_and_gradients_under_autocast_by_the_2x_rule[None-phi3]",
    },
    "test_kernels.py": {
        "test_softcapped_primitive_matches_explicit_attention[causal_square-d-cpu]",
        "test_softcapped_primitive_matches_explicit_attention[causal_square-dv_smaller-cpu]",
    },
    "test_no_row_square.py": {"test_no_row_by_row_tensor[one_row-64]", "test_no_row_by_row_tensor[one_row-None]"},
    "test_refusals.py": {"test_moe_without_router_loss_is_exact"},
    # hybrids on the packed path: LFM2 and Qwen3-Next (one conv family, one delta-net family) stay in the inner loop
    "test_hybrid_packed.py": {
        "test_packed_families_match_plain_rows_in_one_pass_and_split[lfm2_moe]",
        "test_packed_families_match_plain_rows_in_one_pass_and_split[qwen3_5_text]",
        "test_packed_families_match_plain_rows_in_one_pass_and_split[qwen3_5_moe_text]",
        "test_packed_families_match_plain_rows_in_one_pass_and_split[olmo_hybrid]",
        "test_a_depth_4_tree_under_budgets_that_split_every_depth[qwen3_next]",
        "test_random_tries_match_plain_rows",
        "test_own_float32_delta_rule_within_twice_the_plain_error",
        "test_qwen3_5_with_images[16-recompute]",
    },
    "test_trl_llava_next.py": {"test_llava_next_tiles_match_plain_rows_and_grpo_trainer[36-recompute]"},
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        names = SLOW_TESTS.get(item.path.name, ())
        if "*" in names or item.name in names or getattr(item, "originalname", item.name) in names:
            item.add_marker(pytest.mark.slow)
