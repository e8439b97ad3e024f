"""SharedPrefixGRPOTrainer and SharedPrefixRLOOTrainer under `accelerate launch` with 2 CPU processes (DDP over
gloo)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("trl")

pytestmark = pytest.mark.slow  # accelerate launch, 2 processes


EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "trl_grpo.py")


@pytest.mark.parametrize("trainer", ["SharedPrefixGRPOTrainer", "SharedPrefixRLOOTrainer"])
def test_trainer_runs_on_two_processes(tmp_path, trainer):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        EXAMPLE,
        str(tmp_path),
        *(["--rloo"] if "RLOO" in trainer else []),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"done: 4 steps of {trainer} on 2 process(es)" in proc.stdout


def test_grpo_steps_under_ddp_equal_the_exact_run(tmp_path):
    """SharedPrefixGRPOTrainer's default steps under DDP (2 gloo processes, accelerate's accumulation at
    gradient_accumulation_steps=2, groups split across the micro-steps): float64 parameters after two optimizer steps
    equal TRL's GRPOTrainer with a plain per-row hook to 1e-9 of the update; every policy call was a step's
    microbatch, deferred (DDP synchronises inside sharedprefix's backward)."""
    import torch

    from support.torchrun import torchrun

    out = tmp_path / "trl_step.pt"
    torchrun(os.path.join(os.path.dirname(__file__), "trl_step_worker.py"), [str(out)], timeout=400)
    got = torch.load(out, weights_only=False)
    scale = float(got["exact"].abs().max())
    assert scale > 1e-3
    assert float((got["ours"] - got["exact"]).abs().max()) <= 1e-9 * scale
    assert got["calls"] and set(got["calls"]) == {("Microbatch", None)}, got["calls"]


def test_grpo_steps_with_the_moe_loss_under_ddp_equal_trls(tmp_path):
    """As above with a Qwen3-MoE and ``router_aux_loss_coef`` 0.5 (float32; TRL's aux loss is transformers' float32
    one): the steps carry each microbatch's load-balancing loss under DDP, every policy call a step's microbatch, and
    the parameters equal TRL's GRPOTrainer under DDP to 1e-5 of the update (float32 rounding, as
    ``tests/integrations/test_trl_moe.py`` holds one process)."""
    import torch

    from support.torchrun import torchrun

    out = tmp_path / "trl_step_moe.pt"
    torchrun(os.path.join(os.path.dirname(__file__), "trl_step_worker.py"), [str(out), "moe"], timeout=400)
    got = torch.load(out, weights_only=False)
    scale = float(got["exact"].abs().max())
    assert scale > 1e-3
    assert float((got["ours"] - got["exact"]).abs().max()) <= 1e-5 * scale
    assert got["calls"] and set(got["calls"]) == {("Microbatch", None)}, got["calls"]
    assert got["aux"] and all(a > 0 for a in got["aux"])


def test_grpo_steps_under_deepspeed_equal_trls(tmp_path):
    """SharedPrefixGRPOTrainer's default steps under accelerate's DeepSpeed plugin (2 gloo processes, ZeRO-1, 2 and 3,
    DeepSpeed's gradient_accumulation_steps=2, groups split across the micro-steps): the parameters after two
    optimizer steps equal GRPOTrainer's under the same config, by float32 rounding (DeepSpeed's buffers are float32);
    every optimizer step ran as one sp.plan_step step over its two micro-steps, each policy call a step's
    microbatch, deferred, and the trainer logged fewer tokens than a plain run's."""
    import torch

    from support.torchrun import torchrun

    out = tmp_path / "trl_deepspeed_step.pt"
    torchrun(os.path.join(os.path.dirname(__file__), "trl_deepspeed_step_worker.py"), [str(out)], timeout=500)
    got = torch.load(out, weights_only=False)
    init = got["init"]
    for stage in (1, 2, 3):
        run = got[stage]
        moved = max(float((run["plain"][n] - init[n]).abs().max()) for n in init)
        assert moved > 1e-3, (stage, moved)  # the parameters moved: the comparison is not vacuous
        err = max(float((run["ours"][n] - run["plain"][n]).abs().max()) for n in init)
        # float32: the same sums in another order; a 5% temperature error moves the updates by 4e-4 of their size
        assert err <= 1e-4 * moved, (stage, err, moved)
        assert run["ours/steps"] == [(2, "finished")] * 2, run["ours/steps"]
        assert run["ours/calls"] and set(run["ours/calls"]) == {("Microbatch", None)}, run["ours/calls"]
        tokens = run["ours/step_tokens"]
        assert len(tokens) == 2 and all(0 < computed < plain for computed, plain in tokens), (stage, tokens)


def test_async_steps_under_ddp_equal_trls(tmp_path):
    """SharedPrefixAsyncGRPOTrainer under DDP (2 gloo processes, ``gradient_accumulation_steps=2``, TRL's
    FixedCountBatcher splitting groups across micro-steps and ranks), float64, with steps on (the default) and off:
    the parameters after two optimizer steps equal TRL's AsyncGRPOTrainer's (its CPU stand-ins, float64 head) to 1e-9
    of the update (measured: 3.1e-15 both); with steps on every policy call was a step's microbatch and each optimizer
    step computed fewer tokens than with steps off (the same plain tokens) on a rank that has a group in both
    micro-steps (TRL's planner puts the split group on rank 1 here), and never more."""
    import torch

    from support.torchrun import torchrun

    out = tmp_path / "trl_async_step.pt"
    torchrun(os.path.join(os.path.dirname(__file__), "trl_async_step_worker.py"), [str(out)], timeout=400)
    got = torch.load(out, weights_only=False)
    scale = float(got["trl"].abs().max())
    assert scale > 1e-2  # the parameters moved
    for ours in ("on", "off"):
        assert float((got[ours] - got["trl"]).abs().max()) <= 1e-9 * scale, ours
    assert got["calls"]["on"] and set(got["calls"]["on"]) == {"Microbatch"}, got["calls"]
    assert got["calls"]["off"] and "Microbatch" not in got["calls"]["off"], got["calls"]
    fewer = 0
    for on, off in zip(got["tokens"]["on"], got["tokens"]["off"]):  # per rank
        assert len(on) == len(off) == 2, got["tokens"]
        for (computed, plain), (computed_off, plain_off) in zip(on, off):
            assert plain == plain_off and computed <= computed_off, got["tokens"]
            fewer += computed < computed_off
    assert fewer, got["tokens"]  # some optimizer step computed a prompt once for two micro-steps
