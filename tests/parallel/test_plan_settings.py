"""A ``CallPlan`` under DDP (2 CPU processes, gloo; ``plan_worker.py``): a call's ``sync=True`` and
``grad_reduction="sum"``, the defaults passed explicitly, win over a plan made with ``sync=False`` /
``grad_reduction="mean"``. They were taken as left out: no all-reduce at all, and a gradient halved. Left out, the
plan's settings apply (the control). Single process: ``tests/schedule/test_call_plan_settings.py``."""

import os

import pytest
import torch
from parallel.worker import groups_and_weights

from helpers import assert_grads_close, grads_of, plain_logprobs, tiny_model
from support.torchrun import torchrun

pytestmark = pytest.mark.slow  # torchrun, 2 processes

WORKER = os.path.join(os.path.dirname(__file__), "plan_worker.py")


@pytest.fixture(scope="module")
def got(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.pt"
    torchrun(WORKER, [str(out)], timeout=300)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def want():
    """One process's plain float64 gradient of every row: the sum over the ranks' rows."""
    groups, W = groups_and_weights()
    model = tiny_model("qwen3")
    return grads_of(model, lambda: (plain_logprobs(model, groups)[0] * W).sum())


def _present(grads):
    return {k: v for k, v in grads.items() if v is not None}


def test_sync_passed_at_its_default_synchronises(got, want):
    grads, reduces = got["sync_passed"]
    assert reduces == 1
    assert_grads_close(_present(grads), want, 1e-9)
    grads, reduces = got["sync_left_out"]  # the plan's sync=False: this rank's share only
    assert reduces == 0
    with pytest.raises(AssertionError):
        assert_grads_close(_present(grads), want, 1e-3)


@pytest.mark.parametrize("call", ["sum", "logprobs_sum"])
def test_grad_reduction_passed_at_its_default_sums(got, want, call):
    grads, reduces = got[f"{call}_passed"]
    assert reduces == 1
    assert_grads_close(_present(grads), want, 1e-9)
    grads, _ = got[f"{call}_left_out"]  # the plan's "mean": the average over the 2 ranks
    assert_grads_close({k: 2 * v for k, v in _present(grads).items()}, want, 1e-9)
