"""A step carrying the MoE load-balancing loss under DDP on 2 CPU processes (``aux_step_worker.py``): each rank's
microbatches' own losses, the shared prompts' share of their gradient delivered once, reduced by DDP as the same
microbatches' own calls are (float64 outside transformers' loss function: 1e-9 for ``sp.backward``; the log-probs'
backward runs outside that mode, 1e-6 as ``tests/schedule/test_step_aux.py`` holds one process's)."""

import os

import pytest
import torch

from helpers import assert_grads_close
from support.torchrun import torchrun

pytestmark = pytest.mark.slow  # torchrun, 2 processes

WORKER = os.path.join(os.path.dirname(__file__), "aux_step_worker.py")


def test_a_step_with_the_moe_loss_under_ddp_equals_each_microbatchs_own_call(tmp_path):
    torchrun(WORKER, [str(tmp_path / "out.pt")], nproc=2)
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    assert set(got) == {"backward", "deferred"}
    for case, (step, calls) in got.items():
        assert any("gate" in n for n in step), case  # the routers are trained through the loss
        assert_grads_close(step, calls, 1e-9 if case == "backward" else 1e-6)
