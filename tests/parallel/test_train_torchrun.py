"""`sharedprefix train` under torchrun with 2 CPU processes equals the single-process run."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from sharedprefix.cli.main import main
from sharedprefix.recipes.grpo.loop import read_metrics

pytestmark = pytest.mark.slow  # torchrun, 2 processes


ARGS = [
    "train",
    "--steps",
    "4",
    "--records",
    "8",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--warmup-steps",
    "2",
    "--no-bench",
    "--no-resume",
    "--threads",
    "1",
]


def test_two_processes_match_one(tmp_path):
    assert main([*ARGS, "--output", str(tmp_path / "one")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "sharedprefix.cli.main",
            *ARGS,
            "--output",
            str(tmp_path / "two"),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")
    two = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in two] == [0, 1, 2, 3]
    # each rank samples its own prompts with the same per-prompt seeds, so the data and rewards are the same
    assert [r["reward"] for r in two] == [r["reward"] for r in one]
    assert [r["tokens_plain"] for r in two] == [r["tokens_plain"] for r in one]
    a = load_file(tmp_path / "one" / "model" / "model.safetensors")  # the trained model (save_pretrained)
    b = load_file(tmp_path / "two" / "model" / "model.safetensors")
    assert sorted(a) == sorted(b)
    # The gradients agree to float32 rounding, but AdamW divides each entry by its running RMS, so an entry whose
    # exact gradient is ~0 is steered by rounding and may move by up to lr (1e-3) per step either way. Hence: almost
    # every entry identical to 1e-6, and none further apart than a tenth of one step's largest move.
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    assert float((diff <= 1e-6).float().mean()) >= 0.999
    assert float(diff.max()) <= 1e-4
