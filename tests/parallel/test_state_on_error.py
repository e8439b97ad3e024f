"""Gradients set aside for DDP synchronisation come back when sp.backward fails half-way."""

import socket

import pytest
import torch
import torch.distributed as dist

import sharedprefix as sp
from helpers import random_groups, tiny_model


@pytest.fixture
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_stashed_gradients_restored_after_an_error(one_rank_group):
    model = torch.nn.parallel.DistributedDataParallel(tiny_model("llama"))
    inner = model.module
    groups = random_groups(0, 2, [9, 4], [[3, 2], [5]])
    sp.backward(model, groups, lambda b: b.logprobs.sum())
    before = {n: p.grad.clone() for n, p in inner.named_parameters()}

    def failing(b):
        raise RuntimeError("loss failed")

    # the failing call sets the synchronised gradients aside, runs a prompt pass, then fails in loss_fn
    with pytest.raises(RuntimeError, match="loss failed"):
        sp.backward(model, groups, failing, max_tokens=10)
    assert not hasattr(inner, "_sharedprefix_synced")  # no state on the model (DDP's engine keeps none between calls)
    assert all(torch.equal(p.grad, before[n]) for n, p in inner.named_parameters())  # back, untouched
    model.zero_grad(set_to_none=True)
    sp.backward(model, groups, lambda b: b.logprobs.sum())
    again = {n: p.grad for n, p in inner.named_parameters()}
    assert all(torch.allclose(again[n], before[n], rtol=1e-12, atol=0) for n in before)


def test_a_ddp_communication_hook_is_refused(one_rank_group):
    """A comm hook (here fp16 compression) runs in DDP's reducer, which sharedprefix's own all-reduce replaces: the
    plain run's gradient would be the hook's, ours not, so the call refuses the model, naming the hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = torch.nn.parallel.DistributedDataParallel(tiny_model("llama"))
    groups = random_groups(0, 2, [9, 4], [[3, 2], [5]])
    sp.backward(model, groups, lambda b: b.logprobs.sum())  # without a hook: runs
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with pytest.raises(ValueError, match=r"communication hook \(fp16_compress_hook\); .* without register_comm_hook"):
        sp.backward(model, groups, lambda b: b.logprobs.sum())
    with pytest.raises(ValueError, match=r"communication hook \(fp16_compress_hook\)"):
        sp.logprobs(model, groups)
