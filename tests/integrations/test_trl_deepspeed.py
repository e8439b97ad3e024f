"""SharedPrefixGRPOTrainer and SharedPrefixRLOOTrainer under DeepSpeed ZeRO-1, ZeRO-2 and ZeRO-3
(``TrainingArguments.deepspeed``, accelerate's DeepSpeed integration), one CPU process (``trl_deepspeed_worker.py``,
in a subprocess so that its process group stays out of this one): the same parameters after two steps as
GRPOTrainer / RLOOTrainer under the same config, with and without a budget that splits groups (the deferred policy
pass returns its gradient through DeepSpeed's ``engine.backward``); and with DeepSpeed's gradient_accumulation_steps=2
over one generation batch (steps_per_generation=2), where each optimizer step's two micro-steps run as one
``sp.plan_step`` step (each prompt once per optimizer step), with and without a budget."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("trl")
pytest.importorskip("datasets")

pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(__file__), "trl_deepspeed_worker.py")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trainers_under_deepspeed_zero_equal_trls(stage, tmp_path):
    out = tmp_path / "params.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(29533 + stage)}
    proc = subprocess.run(
        [sys.executable, WORKER, str(stage), str(out)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=False)
    init = got["init"]
    for plain, ours in (
        ("grpo_plain", "grpo_ours"),
        ("grpo_plain", "grpo_ours_budget"),
        ("rloo_plain", "rloo_ours_budget"),
        ("grpo_plain_ga2", "grpo_ours_ga2"),
        ("grpo_plain_ga2", "grpo_ours_ga2_budget"),
    ):
        moved = max(float((got[plain][n] - init[n]).abs().max()) for n in init)
        assert moved > 1e-3, (plain, moved)  # the parameters moved: the comparison is not vacuous
        err = max(float((got[ours][n] - got[plain][n]).abs().max()) for n in init)
        # float32: the same sums in another order (measured: 2.6e-7 to 1.5e-6 of the update under ZeRO-2, 3.5e-7 to
        # 6.9e-7 under ZeRO-3); a 5% temperature error moves the updates by 4e-4 of their size (test_trl.py's)
        assert err <= 1e-4 * moved, (ours, err, moved)
    # the steps really ran: one per optimizer step, over its two micro-steps, each finished; the trainer logged their
    # tokens, fewer than a plain run's (each prompt once per optimizer step, not once per micro-step)
    for ours in ("grpo_ours_ga2", "grpo_ours_ga2_budget"):
        assert got[f"{ours}/steps"] == [(2, "finished")] * 2, got[f"{ours}/steps"]
        tokens = got[f"{ours}/step_tokens"]
        assert len(tokens) == 2 and all(0 < computed < plain for computed, plain in tokens), tokens
    assert got["grpo_ours/steps"] == []  # gradient_accumulation_steps=1: no step to plan
