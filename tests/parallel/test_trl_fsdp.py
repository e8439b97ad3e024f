"""SharedPrefixGRPOTrainer and SharedPrefixRLOOTrainer under accelerate's FSDP2 (2 gloo processes, one launch:
``trl_fsdp_worker.py``), gradient_accumulation_steps=2 with groups split across the micro-steps, float64: the same
parameters after two optimizer steps as TRL's GRPOTrainer / RLOOTrainer (plain per-row hook) under the same FSDP2
config, to 1e-9 of the update (GRPO with steps, without, with a budget and gradient checkpointing; RLOO). The policy
pass runs its backward after TRL's as sp.backward (``integrations.trl_after``), reducing only at the optimizer
step's last micro-step; what FSDP2 cannot run is refused when the trainer is built."""

import os

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

pytestmark = pytest.mark.slow  # torchrun, 2 processes, 5 trainings


def test_trainers_under_fsdp2_equal_trls(tmp_path):
    import torch

    from support.torchrun import torchrun

    out = tmp_path / "trl_fsdp.pt"
    torchrun(os.path.join(os.path.dirname(__file__), "trl_fsdp_worker.py"), [str(out)], timeout=500)
    got = torch.load(out, weights_only=False)
    pairs = [("grpo_exact", r) for r in ("grpo_steps", "grpo_no_steps", "grpo_budget_checkpointing")]
    for exact, ours in (*pairs, ("rloo_exact", "rloo_steps")):
        scale = float(got[exact].abs().max())
        assert scale > 1e-3, (exact, scale)  # the parameters moved: the comparison is not vacuous
        assert float((got[ours] - got[exact]).abs().max()) <= 1e-9 * scale, ours
    # the policy backward after TRL's: the step's microbatches (or a plan per microbatch), FSDP2 reducing only at the
    # optimizer step's last micro-step (accelerate's no_sync on the first)
    boundary = [False, True, False, True]
    assert got["sources"]["grpo_steps"] == [("Microbatch", s) for s in boundary]
    assert got["sources"]["rloo_steps"] == [("Microbatch", s) for s in boundary]
    assert got["sources"]["grpo_no_steps"] == [("CallPlan", s) for s in boundary]
    assert got["sources"]["grpo_budget_checkpointing"] == [("Microbatch", s) for s in boundary]
    assert got["passes"]["grpo_budget_checkpointing"] > got["passes"]["grpo_steps"]  # the budget split groups
    # steps computed each shared prompt once per optimizer step: fewer tokens than a call per microbatch
    steps, per_microbatch = got["tokens"]["grpo_steps"], got["tokens"]["grpo_no_steps"]
    assert len(steps) == len(per_microbatch) == 2
    for (computed, plain), (computed_mb, plain_mb) in zip(steps, per_microbatch):
        assert plain == plain_mb and computed < computed_mb < plain
    refused = got["refused"]
    assert "sharedprefix_prefix_activations='offload'" in (refused["offload"] or ""), refused
    assert "router_aux_loss_coef=0.5" in (refused["aux_loss"] or ""), refused
    assert all("refused when built" in m for m in refused.values())
