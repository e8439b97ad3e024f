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
