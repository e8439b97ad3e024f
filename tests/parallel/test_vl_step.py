"""A step of image groups under DDP on 2 CPU processes (``vl_step_worker.py``): each image prompt and its vision
tower once per rank's step, the gradients (vision tower included) those of every rank's plain rows, summed."""

import os

import pytest
from parallel.vl_step_worker import CASES, WORLD, rank_microbatches, weights

from helpers import assert_grads_close, grads_of
from support.torchrun import torchrun
from support.vl import mrope_model, plain_mrope

pytestmark = pytest.mark.slow  # torchrun, 2 processes

WORKER = os.path.join(os.path.dirname(__file__), "vl_step_worker.py")


def test_image_groups_step_under_ddp_equals_the_plain_rows(tmp_path):
    import torch

    torchrun(WORKER, [str(tmp_path / "out.pt")], nproc=WORLD)
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    model = mrope_model("qwen2_vl")
    want = grads_of(
        model,
        lambda: sum(
            (plain_mrope(model, mb) * W).sum() for r in range(WORLD) for mb, W in zip(rank_microbatches(r), weights(r))
        ),
    )
    assert set(got) == set(CASES)
    for case, grads in got.items():
        assert any("visual" in n for n in grads), case
        assert_grads_close(grads, want, 1e-9)
