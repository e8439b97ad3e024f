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
# file and test name (without parameters), so those files stay untouched.
SLOW_TESTS = {
    "test_trl.py": {
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
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        names = SLOW_TESTS.get(item.path.name, ())
        if "*" in names or getattr(item, "originalname", item.name) in names:
            item.add_marker(pytest.mark.slow)
